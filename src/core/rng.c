/* Philox4x32-10 and what is built on it; see include/tera/rng.h. */
#include "tera/rng.h"

#include <math.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

static inline void philox_round(uint32_t c[4], uint32_t k0, uint32_t k1) {
    uint64_t p0 = (uint64_t)PHILOX_M0 * c[0];
    uint64_t p1 = (uint64_t)PHILOX_M1 * c[2];
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    uint32_t n0 = hi1 ^ c[1] ^ k0;
    uint32_t n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
}

void tera_philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo, uint32_t out[4]) {
    uint32_t c[4] = {(uint32_t)counter_lo, (uint32_t)(counter_lo >> 32), (uint32_t)counter_hi,
                     (uint32_t)(counter_hi >> 32)};
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        philox_round(c, k0, k1);
    }
    out[0] = c[0];
    out[1] = c[1];
    out[2] = c[2];
    out[3] = c[3];
}

float tera_rng_uniform(uint64_t key, uint64_t stream, uint64_t i) {
    uint32_t o[4];
    tera_philox4x32(key, stream, i, o);
    return (float)(o[0] >> 8) * (1.0f / 16777216.0f);
}

float tera_rng_normal(uint64_t key, uint64_t stream, uint64_t i) {
    uint32_t o[4];
    tera_philox4x32(key, stream, i, o);
    const double two_m32 = 1.0 / 4294967296.0;
    double u1 = ((double)o[0] + 0.5) * two_m32; /* (0, 1): log is finite */
    double u2 = (double)o[1] * two_m32;         /* [0, 1) */
    const double two_pi = 6.283185307179586476925286766559;
    return (float)(sqrt(-2.0 * log(u1)) * cos(two_pi * u2));
}

uint64_t tera_hash64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
