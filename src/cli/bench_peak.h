/* tera bench: the bf16 product rate of the model's own training shapes (src/cli/bench_peak.c). */
#ifndef TERA_CLI_BENCH_PEAK_H
#define TERA_CLI_BENCH_PEAK_H

#include <stdint.h>
#include <stdio.h>

#include "tera/config.h"

#define TERA_PEAK_SHAPES 12
typedef struct {
    char name[48];      /* which layers use it: "attn_q", "expert_w13", "attn_q+attn_kv", ... */
    int64_t N, in, out; /* y[N,out] = x[N,in] w[out,in]^T */
    double fwd, bwd;    /* best GFLOP/s seen: forward product; backward pair (dx and dw) */
} tera_peak_shape;

typedef struct {
    int n;
    tera_peak_shape s[TERA_PEAK_SHAPES];
    const char *skipped; /* why nothing was measured (NULL: measured) */
    const char *isa;     /* oneDNN's ISA */
    int amx;
} tera_bf16_peak;

/* Times the bf16 linear products (the backend's linear_forward / linear_backward, bf16 on the native
 * units, operands rounded per call as in training) at the model's shapes for cfg's micro-batch; a
 * second call keeps the better figure of each shape (the bench measures before and after its steps). */
void tera_bench_bf16_peak_measure(const tera_config *cfg, tera_bf16_peak *p);
double tera_bench_bf16_peak_best(const tera_bf16_peak *p); /* 0 when skipped */
/* JSON fields, each preceded by ", ": bf16_peak_gflops, mfu_bf16 (model_gflops over it), the ISA and
 * the per-shape figures; or nulls and bf16_peak_skipped with the reason. */
void tera_bench_bf16_peak_json(FILE *f, const tera_bf16_peak *p, double model_gflops);

#endif
