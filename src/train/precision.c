/* training.precision: the rule for `auto`, and the size of the conversion scratch. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tera/precision.h"

/* The start-up probe's rule, shared by precision = auto and bf16_gemm = auto: 1 where be's bf16 dot
 * product issues at least TERA_BF16_DOT_MARGIN times its FMA's multiply-adds, 0 where it does not,
 * -1 where there is no probe or no dot-product instruction; *fma, *dot: the probe's figures (0 if none). */
static int probe_dot_fast(const tera_backend *be, double *fma, double *dot) {
    *fma = *dot = 0.0;
    if (!be->caps.bf16_probe || !be->caps.bf16_probe(be, fma, dot)) return -1;
    return *dot >= TERA_BF16_DOT_MARGIN * *fma;
}

tera_precision tera_precision_resolve(const tera_backend *be, const char *name, const char **note) {
    static char buf[256];
    const char *isa;
    const int fast = be->caps.bf16_fast(be, &isa);
    tera_precision p;
    if (!strcmp(name, "bf16")) {
        p = TERA_PREC_BF16;
        snprintf(buf, sizeof buf, "bf16 (set; oneDNN ISA %s%s)", isa, fast ? "" : ": no AMX");
    } else if (!strcmp(name, "fp16")) {
        p = TERA_PREC_FP16;
        snprintf(buf, sizeof buf, "fp16 (set; emulated: fp16-rounded operands, fp32 products; dynamic loss scaling)");
    } else if (!strcmp(name, "fp32")) {
        p = TERA_PREC_FP32;
        snprintf(buf, sizeof buf, "fp32 (set; oneDNN ISA %s)", isa);
    } else { /* auto: bf16 where this CPU's bf16 products are faster than its fp32 ones */
        double fma = 0.0, dot = 0.0;
        const int dot_fast = !fast && probe_dot_fast(be, &fma, &dot) == 1;
        p = fast || dot_fast ? TERA_PREC_BF16 : TERA_PREC_FP32;
        if (fast)
            snprintf(buf, sizeof buf, "bf16 (auto: oneDNN ISA %s, AMX bf16 products)", isa);
        else if (dot_fast)
            snprintf(buf, sizeof buf, "bf16 (auto: oneDNN ISA %s, no AMX; probe %.1f G bf16 dot product multiply-adds/s, "
                     "%.1f G FMA)", isa, dot * 1e-9, fma * 1e-9);
        else if (dot > 0.0)
            snprintf(buf, sizeof buf, "fp32 (auto: oneDNN ISA %s, no AMX; probe %.1f G bf16 dot product multiply-adds/s, "
                     "%.1f G FMA: under %.2fx)", isa, dot * 1e-9, fma * 1e-9, TERA_BF16_DOT_MARGIN);
        else
            snprintf(buf, sizeof buf, "fp32 (auto: oneDNN ISA %s, no bf16 products faster than fp32)", isa);
    }
    if (note) *note = buf;
    return p;
}

tera_bf16_gemm tera_bf16_gemm_resolve(const tera_backend *be, const char *name, const char **note) {
    static char buf[256];
    if (!strcmp(name, "native") && !be->caps.bf16_native(be)) { /* oneDNN would fail the first product */
        snprintf(buf, sizeof buf, "fma (native was set, but this CPU has no bf16 GEMM kernels: below AVX-512)");
        if (note) *note = buf;
        return TERA_BF16_FMA;
    }
    if (!strcmp(name, "native") || !strcmp(name, "fma")) {
        snprintf(buf, sizeof buf, "%s (set)", name);
        if (note) *note = buf;
        return !strcmp(name, "fma") ? TERA_BF16_FMA : TERA_BF16_NATIVE;
    }
    if (be->caps.bf16_fast(be, NULL)) {
        snprintf(buf, sizeof buf, "native (auto: AMX)");
        if (note) *note = buf;
        return TERA_BF16_NATIVE;
    }
    double fma, dot;
    const int dot_fast = probe_dot_fast(be, &fma, &dot);
    if (dot_fast < 0) {
        snprintf(buf, sizeof buf, "fma (auto: no bf16 dot-product instruction)");
        if (note) *note = buf;
        return TERA_BF16_FMA;
    }
    const tera_bf16_gemm g = dot_fast ? TERA_BF16_NATIVE : TERA_BF16_FMA;
    snprintf(buf, sizeof buf, "%s (auto: probe %.1f G multiply-adds/s FMA, %.1f G bf16 dot product)",
             g == TERA_BF16_FMA ? "fma" : "native", fma * 1e-9, dot * 1e-9);
    if (note) *note = buf;
    return g;
}

int tera_bf16_shadow_on(const tera_config *cfg, int zero, tera_precision p, tera_bf16_gemm g) {
    const char *env = getenv("TERA_BF16_SHADOW");
    if (env && !strcmp(env, "0")) return 0;
    if (strcmp(cfg->training.device, "cpu") || p != TERA_PREC_BF16 || g != TERA_BF16_NATIVE || cfg->parallel.pp != 1 ||
        zero >= 3)
        return 0;
    const int filled = !zero && !strcmp(cfg->optimizer.name, "adamw") && !(env && !strcmp(env, "lazy"));
    return filled || cfg->training.grad_accum >= 4;
}

/* One linear layer x[N,in] -> [N,out]: its products convert at most N*in + N*out + in*out operand
 * elements together (the backward rounds dy, w and x once for both of its products; +2: each copy
 * after the first starts at an even element). */
static int64_t linear_elems(int64_t N, int64_t in, int64_t out) { return N * (in + out) + in * out + 2; }

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* An FFN's w1/w3 backward when SwiGLU's backward wrote the bf16 copies of both gradients side by side
 * (bf16 on the native units: src/kernels/cpu/cpu.h, tera_cpu_prod): one [N,F] more than one layer. */
static int64_t ffn_elems(int64_t N, int64_t D, int64_t F) { return linear_elems(N, D, F) + N * F + 2; }

void tera_precision_scratch_elems(const tera_model_config *c, int B, int T, int ep, int64_t *main_elems,
                                  int64_t *thread_elems) {
    const int64_t N = (int64_t)B * T, D = c->dim, hd = c->dim / c->n_heads;
    const int64_t Ne = N * (ep > 1 ? ep : 1); /* expert parallelism: rows from each of ep ranks */
    tera_model_config d = *c;
    tera_model_config_derive(&d); /* c is finalized already; a raw one gets the same defaults */
    const int64_t H = c->n_heads, Hkv = d.n_kv_heads, F = c->ffn_dim, Fd = d.dense_ffn_dim;
    int64_t m = linear_elems(N, D, H * hd);        /* q, and o (the same sizes swapped) */
    m = max64(m, linear_elems(N, D, Hkv * hd));    /* k, v */
    m = max64(m, linear_elems(N, D, c->vocab_size)); /* LM head */
    const int64_t e = ffn_elems(Ne, D, F);         /* an expert's rows are at most N per source rank */
    m = max64(m, e);
    if (c->n_shared_experts > 0) m = max64(m, ffn_elems(N, D, (int64_t)c->n_shared_experts * F));
    if (c->first_k_dense > 0) m = max64(m, ffn_elems(N, D, Fd));
    *main_elems = m;
    *thread_elems = e;
}

int tera_a2a_rows_bf16(const tera_config *cfg) {
    const char *env = getenv("TERA_A2A_ROWS_BF16");
    if (env && !strcmp(env, "0")) return 0;
    return cfg->parallel.ep > 1 && !strcmp(cfg->parallel.a2a_compression, "none") &&
           (!strcmp(cfg->training.precision, "bf16") || !strcmp(cfg->training.precision, "auto"));
}
