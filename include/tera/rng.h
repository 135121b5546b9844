/* Counter-based random numbers: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random
 * numbers: as easy as 1, 2, 3", SC'11). No state: every value is a pure function of
 * (key, stream, index), so element i of a weight tensor or of a shuffle is the same on any rank,
 * any thread count and after any resume.
 *
 * Word order (matches Random123's philox4x32 with ctr = {c0,c1,c2,c3}, key = {k0,k1}):
 *   key        = k0 | (uint64)k1 << 32
 *   counter_lo = c0 | (uint64)c1 << 32
 *   counter_hi = c2 | (uint64)c3 << 32 */
#ifndef TERA_RNG_H
#define TERA_RNG_H

#include <stdint.h>

/* One Philox4x32-10 block: 10 rounds, multipliers 0xD2511F53 / 0xCD9E8D57, Weyl key increments
 * 0x9E3779B9 / 0xBB67AE85. out[0..3] = c0'..c3'. */
void tera_philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo, uint32_t out[4]);

/* Uniform in [0, 1) with 24 random bits: (out[0] >> 8) * 2^-24 of block (key, stream, i). */
float tera_rng_uniform(uint64_t key, uint64_t stream, uint64_t i);

/* Standard normal by Box-Muller on block (key, stream, i), computed in double:
 *   u1 = (out[0] + 0.5) * 2^-32 in (0, 1),  u2 = out[1] * 2^-32 in [0, 1)
 *   z  = sqrt(-2 ln u1) * cos(2 pi u2)       (|z| < 6.8)
 * Element i depends only on (key, stream, i). */
float tera_rng_normal(uint64_t key, uint64_t stream, uint64_t i);

/* splitmix64's finalizer (Steele, Lea, Flood 2014; constants from Stafford's "Mix13"):
 * a bijection of uint64 with full avalanche; hash64(0) = 0. */
uint64_t tera_hash64(uint64_t x);

#endif
