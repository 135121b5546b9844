/* Compressed collectives (src/comm/compress.c): data-parallel gradient sums sent in low precision
 * with error feedback (parallel.grad_compression), and the number formats they and the expert
 * exchange (parallel.a2a_compression) use. docs/COMMUNICATION.md has the figures.
 *
 * Formats: bf16 (round to nearest even; NaN and infinities kept), fp16 (IEEE half, round to nearest
 * even, finite values beyond +-65504 saturate to +-65504, NaN and infinities kept), int8 (blocks of
 * TERA_COMPRESS_BLOCK values from the start of each message, one fp32 scale = max|v| / 127 per
 * block, q = round-to-nearest-even(v / scale) in [-127, 127], value q x scale; a block with a
 * non-finite value decodes to NaN everywhere), fp8 e4m3 (rows: one fp32 scale = max|v| / 448 per
 * row, values rounded to nearest even in e4m3, no infinities, the largest finite 448).
 *
 * Error feedback (the lossy kinds): a residual e per element is kept between calls; a value v is
 * sent as Q(v + e) and e becomes (v + e) - D(Q(v + e)) in fp32 (0 where that is not finite), so what
 * one step's rounding loses enters the next step's message. */
#ifndef TERA_COMPRESS_H
#define TERA_COMPRESS_H

#include <stdint.h>

#include "tera/comm.h"
#include "tera/status.h"

typedef enum { TERA_COMPRESS_NONE, TERA_COMPRESS_BF16, TERA_COMPRESS_FP16, TERA_COMPRESS_INT8, TERA_COMPRESS_FP8,
               TERA_COMPRESS_ONEBIT } tera_compress_kind;
#define TERA_COMPRESS_BLOCK 256
/* onebit (1-bit Adam's momentum, src/train/onebit.c; not a parallel.grad_compression choice): blocks of
 * TERA_ONEBIT_BLOCK values from the start of each message, each one fp32 scale = mean |v| over the
 * block (summed in order in fp32, divided by the block's length) followed by one sign bit per value
 * (bit i % 8 of byte i / 8, 1 = negative; 0 and -0 count as positive), value = +-scale; a block with a
 * non-finite value has scale NaN and decodes to NaN everywhere (its residuals are 0). Bytes of n values:
 * 4 + ceil(m / 8) per block of m values (1/32 of fp32 plus 4 bytes per block). */
#define TERA_ONEBIT_BLOCK 256

/* "none" | "bf16" | "fp16" | "int8" | "fp8" -> kind; -1 when unknown */
int tera_compress_parse(const char *name);
const char *tera_compress_name(tera_compress_kind k);

/* scalar conversions */
uint16_t tera_f32_to_bf16(float f);
float tera_bf16_to_f32(uint16_t h);
uint16_t tera_f32_to_f16(float f);
float tera_f16_to_f32(uint16_t h);
uint8_t tera_f32_to_e4m3(float f); /* f already scaled; saturates to +-448, NaN -> NaN */
float tera_e4m3_to_f32(uint8_t q);

/* Bytes of n values in kind k (bf16, fp16, int8, onebit; fp8: one row of n). */
int64_t tera_compress_bytes(tera_compress_kind k, int64_t n);
/* Encodes x[0..n) (+ err, updated as above, when err is given) into out (tera_compress_bytes). */
void tera_compress_encode(tera_compress_kind k, const float *x, int64_t n, void *out, float *err);
/* y[0..n) = the values of in; _add: y += them (fp32, element by element). */
void tera_compress_decode(tera_compress_kind k, const void *in, int64_t n, float *y);
void tera_compress_decode_add(tera_compress_kind k, const void *in, int64_t n, float *y);

/* A compressed reducer over a group c for a region of n floats: its error-feedback state and its
 * scratch, allocated once (at creation; a message larger than ever before grows the scratch once).
 *
 * All-reduce of [off, off + len) of the region (buf holds those len values): the range is split into
 * p = size(c) consecutive 16-float-aligned chunks (the ZeRO shard rule), chunk j owned by rank j.
 *   1. every rank r sends chunk j as Q(x + e1) with its residual e1 (indexed by region offset);
 *   2. owner j sums the decoded chunks in rank order in fp32: s = D(q_0) + D(q_1) + ... + D(q_{p-1});
 *   3. owner j sends Q(s + e2) to every rank with its own residual e2 for that chunk (second stage);
 *      every rank, the owner included, takes D of it: the result is the same bits everywhere.
 * Reduce-scatter of [off, off + sum counts) with ranges of counts[r] (ZeRO): steps 1-2; rank r's
 * range of buf holds s (fp32).
 * Bytes: the all-reduce sends 2 (p-1)/p x tera_compress_bytes(len) per rank (as a ring all-reduce of
 * the compressed data), the reduce-scatter (p-1)/p; counted as all-reduce and reduce-scatter. */
typedef struct tera_creducer tera_creducer;
tera_creducer *tera_creducer_create(tera_comm *c, tera_compress_kind k, int64_t n);
void tera_creducer_free(tera_creducer *r);
void tera_creducer_allreduce(tera_creducer *r, float *buf /*[len]*/, int64_t off, int64_t len);
void tera_creducer_reduce_scatter(tera_creducer *r, float *buf /*[sum counts]*/, int64_t off, const int64_t *counts);
/* The error-feedback state: e1 (this rank's residuals, n) and e2 (the owner's, n; only the chunks
 * this rank owns are used), for checkpoints. */
float *tera_creducer_state(tera_creducer *r, int which, int64_t *n);
/* mean = 1: the owner's value is the mean instead of the sum: s = (D(q_0) + ... + D(q_{p-1})) x (1/p)
 * in fp32 (the sum in rank order as above, then one product); 0 (the default): the sum. */
void tera_creducer_set_mean(tera_creducer *r, int mean);

#endif
