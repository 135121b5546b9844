/* tera bench: the best bf16 product rate over the model's own training shapes, measured in the same
 * run as the steps, so that bf16 model FLOP/s can be read against what the products themselves
 * reach on this machine (issue 19's target: >= 50% of it).
 *
 * The shapes are those of the linear layers for the configured micro-batch (N = micro_batch x
 * seq_len rows; one rank, no tensor parallelism): q, k/v and o projections, the routed experts'
 * w1/w3 and w2 at the balanced load N*k/E rows, shared and dense FFNs where the model has them, and
 * the LM head. Each is timed through a CPU backend set to bf16 on the native units: the very
 * linear_forward / linear_backward the model calls (the operands rounded to bf16 on every call, fp32
 * accumulation and output), on all the process's threads. The router stays fp32 in training and is
 * not listed. Best of 5 repetitions after one warm-up, per shape. */
#include "bench_peak.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "tera/status.h"

static void add_shape(tera_bf16_peak *p, const char *name, int64_t N, int64_t in, int64_t out) {
    if (N <= 0 || in <= 0 || out <= 0) return;
    for (int i = 0; i < p->n; i++)
        if (p->s[i].N == N && p->s[i].in == in && p->s[i].out == out) { /* the same product */
            const size_t l = strlen(p->s[i].name);
            snprintf(p->s[i].name + l, sizeof p->s[i].name - l, "+%s", name);
            return;
        }
    TERA_ASSERT(p->n < TERA_PEAK_SHAPES);
    tera_peak_shape *s = &p->s[p->n++];
    *s = (tera_peak_shape){.N = N, .in = in, .out = out};
    snprintf(s->name, sizeof s->name, "%s", name);
}

static void model_shapes(const tera_config *cfg, tera_bf16_peak *p) {
    const tera_model_config *m = &cfg->model;
    const int64_t N = (int64_t)cfg->training.micro_batch * cfg->training.seq_len, D = m->dim;
    const int64_t hd = D / m->n_heads, Hkv = m->n_kv_heads > 0 ? m->n_kv_heads : m->n_heads;
    add_shape(p, "attn_q", N, D, m->n_heads * hd);
    add_shape(p, "attn_kv", N, D, Hkv * hd);
    add_shape(p, "attn_o", N, m->n_heads * hd, D);
    if (m->first_k_dense < m->n_layers && m->n_experts > 0) {
        const int64_t Ne = (N * m->top_k + m->n_experts - 1) / m->n_experts;
        add_shape(p, "expert_w13", Ne, D, m->ffn_dim);
        add_shape(p, "expert_w2", Ne, m->ffn_dim, D);
        if (m->n_shared_experts > 0) {
            add_shape(p, "shared_w13", N, D, (int64_t)m->n_shared_experts * m->ffn_dim);
            add_shape(p, "shared_w2", N, (int64_t)m->n_shared_experts * m->ffn_dim, D);
        }
    }
    if (m->first_k_dense > 0) {
        add_shape(p, "dense_w13", N, D, m->dense_ffn_dim);
        add_shape(p, "dense_w2", N, m->dense_ffn_dim, D);
    }
    add_shape(p, "lm_head", N, D, m->vocab_size);
}

static float *filled(int64_t n, float a) {
    float *x = tera_malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] = a * (float)((i * 7919) % 1009 - 504) / 504.0f;
    return x;
}

void tera_bench_bf16_peak_measure(const tera_config *cfg, tera_bf16_peak *p) {
    tera_backend *be = tera_backend_cpu_create(-1);
    p->amx = be->caps.bf16_fast(be, &p->isa);
    if (!be->caps.bf16_native(be)) {
        p->skipped = "no native bf16 products on this CPU (oneDNN ISA below avx512_core)";
        tera_backend_destroy(be);
        return;
    }
    if (p->n == 0) model_shapes(cfg, p);
    int64_t most = 0;
    for (int i = 0; i < p->n; i++) {
        const tera_peak_shape *s = &p->s[i];
        const int64_t need = s->N * s->out + s->out * s->in + s->N * s->in + 4;
        most = need > most ? need : most;
    }
    tera_backend_set_precision(be, TERA_PREC_BF16, TERA_BF16_NATIVE);
    tera_backend_reserve(be, most, 0);
    const int reps = 5;
    for (int i = 0; i < p->n; i++) {
        tera_peak_shape *s = &p->s[i];
        float *x = filled(s->N * s->in, 1.0f), *w = filled(s->out * s->in, 0.05f), *y = filled(s->N * s->out, 0.0f);
        float *dy = filled(s->N * s->out, 0.01f), *dx = filled(s->N * s->in, 0.0f), *dw = filled(s->out * s->in, 0.0f);
        const double flops = 2.0 * (double)s->N * (double)s->in * (double)s->out;
        for (int r = -1; r < reps; r++) { /* r = -1: warm-up (creates the primitives) */
            double t0 = tera_now();
            be->ops.linear_forward(be, y, x, w, s->N, s->in, s->out, 0.0f);
            const double f = flops / (tera_now() - t0) * 1e-9;
            t0 = tera_now();
            be->ops.linear_backward(be, dx, dw, dy, x, w, s->N, s->in, s->out, 0.0f, 1.0f);
            const double b = 2.0 * flops / (tera_now() - t0) * 1e-9;
            if (r < 0) continue;
            s->fwd = f > s->fwd ? f : s->fwd;
            s->bwd = b > s->bwd ? b : s->bwd;
        }
        free(x), free(w), free(y), free(dy), free(dx), free(dw);
    }
    tera_backend_destroy(be);
}

double tera_bench_bf16_peak_best(const tera_bf16_peak *p) {
    double best = 0.0;
    for (int i = 0; i < p->n && !p->skipped; i++) {
        best = p->s[i].fwd > best ? p->s[i].fwd : best;
        best = p->s[i].bwd > best ? p->s[i].bwd : best;
    }
    return best;
}

void tera_bench_bf16_peak_json(FILE *f, const tera_bf16_peak *p, double model_gflops) {
    const double best = tera_bench_bf16_peak_best(p);
    if (p->skipped || best <= 0.0) {
        fprintf(f, ", \"bf16_peak_gflops\": null, \"mfu_bf16\": null, \"bf16_peak_skipped\": \"%s\"",
                p->skipped ? p->skipped : "not measured (several ranks share the machine's cores)");
        return;
    }
    fprintf(f, ", \"bf16_peak_gflops\": %.1f, \"mfu_bf16\": %.4f, \"bf16_peak_isa\": \"%s\", \"bf16_peak_amx\": %d, "
            "\"bf16_peak_shapes\": [",
            best, model_gflops / best, p->isa ? p->isa : "", p->amx);
    for (int i = 0; i < p->n; i++)
        fprintf(f, "%s{\"shape\": \"%s\", \"N\": %lld, \"in\": %lld, \"out\": %lld, \"fwd_gflops\": %.1f, \"bwd_gflops\": %.1f}",
                i ? ", " : "", p->s[i].name, (long long)p->s[i].N, (long long)p->s[i].in, (long long)p->s[i].out,
                p->s[i].fwd, p->s[i].bwd);
    fprintf(f, "]");
}
