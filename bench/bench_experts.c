/* Where the routed experts' time goes (issue 19): one MoE layer's experts on a config's shapes
 * (B, T, E, k, D, F of -c CONFIG), through the dispatcher (src/model/dispatch.c, the local
 * implementation), against the pieces it is made of.
 *
 *   dispatcher   tera_dispatch_experts_forward / _backward (what the model runs), wall ms
 *   pieces       the same products and SwiGLU passes, one expert after another on the calling
 *                thread alone (one thread: what each thread of the side-by-side layout runs), ms of
 *                each piece summed over the experts: w1/w3 products, SwiGLU, w2 product
 *   side by side the per-thread busy time of the experts run side by side (for_each_item, the
 *                largest first), as the dispatcher does on more threads: utilisation = the busy
 *                time of all threads / (threads x wall)
 *
 *   old          the dispatcher with TERA_EXPERTS_ALONE=0 (every expert side by side, the layout before
 *                experts with more rows than a thread's share ran alone), alternating with the above rep by rep
 *
 * Routing: every token picks k distinct experts with probabilities proportional to
 * (1 + skew)^-e (skew 0: uniform, as at initialisation); seed fixed. Medians of --reps
 * repetitions; GFLOP/s count 2 multiply-adds per weight and row (fwd 3 products, bwd 6).
 * Usage: bench_experts [-c CONFIG] [--threads N] [--reps N] [--precision fp32|bf16] [--skew S]
 * Prints one JSON line. */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_median.h"
#include "model/dispatch.h"
#include "tera/backend.h"
#include "tera/config.h"
#include "tera/kernels.h"
#include "tera/profile.h"

#define MAX_REPS 200
#define MAX_THREADS 64

static float *falloc(int64_t n) {
    float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!p) {
        fprintf(stderr, "bench_experts: out of memory\n");
        exit(1);
    }
    return p;
}

static void fill(float *x, int64_t n, uint64_t seed, float scale) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = scale * ((float)((s >> 40) & 0xFFFFFF) / 16777216.0f - 0.5f);
    }
}

/* one side-by-side run's context */
typedef struct {
    tera_backend *be;
    const tera_dispatch_acts *t;
    const float *w1, *w3, *w2;
    float *y;
    int64_t D, F;
    const int *order;
    double busy[MAX_THREADS];
} sbs_ctx;

static void expert_fwd(tera_backend *be, const tera_dispatch_acts *t, const float *w1, const float *w3,
                       const float *w2, float *y, int64_t D, int64_t F, int e, double *tp) {
    const int64_t r = t->exp_off[e], n = t->exp_off[e + 1] - r;
    if (n == 0) return;
    float *a1 = t->a1 + r * F, *a3 = t->a3 + r * F, *g = t->gact + r * F;
    float *const ys[2] = {a1, a3};
    const float *const ws[2] = {w1 + e * F * D, w3 + e * F * D};
    const int64_t out[2] = {F, F};
    double t0 = tera_now();
    tera_linear_forward_multi(be, 2, ys, t->xg + r * D, ws, out, n, D);
    double t1 = tera_now();
    be->ops.swiglu_forward(be, g, a1, a3, n * F);
    double t2 = tera_now();
    be->ops.linear_forward(be, y + r * D, g, w2 + e * D * F, n, F, D, 0.0f);
    double t3 = tera_now();
    if (tp) tp[0] += t1 - t0, tp[1] += t2 - t1, tp[2] += t3 - t2;
}

static void sbs_item(void *ctx, int i) {
    sbs_ctx *c = ctx;
    const double t0 = tera_now();
    expert_fwd(c->be, c->t, c->w1, c->w3, c->w2, c->y, c->D, c->F, c->order[i], NULL);
    c->busy[omp_get_thread_num()] += tera_now() - t0;
}

int main(int argc, char **argv) {
    const char *cfg_path = "configs/bench-s.ini", *prec = "fp32";
    int threads = 1, reps = 9;
    double skew = 0.0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-c")) cfg_path = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--precision")) prec = argv[i + 1];
        else if (!strcmp(argv[i], "--skew")) skew = atof(argv[i + 1]);
        else {
            fprintf(stderr, "bench_experts: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (threads < 1 || threads > MAX_THREADS || reps < 1 || reps > MAX_REPS || skew < 0.0 ||
        (strcmp(prec, "fp32") && strcmp(prec, "bf16"))) {
        fprintf(stderr, "bench_experts: --threads 1..%d, --reps 1..%d, --precision fp32|bf16, --skew >= 0\n",
                MAX_THREADS, MAX_REPS);
        return 2;
    }
    tera_config cfg;
    tera_config_defaults(&cfg);
    if (tera_config_load(&cfg, cfg_path) != TERA_OK || tera_config_finalize(&cfg) != TERA_OK) {
        fprintf(stderr, "bench_experts: %s\n", tera_last_error());
        return 1;
    }
    const tera_model_config *c = &cfg.model;
    const int B = cfg.training.micro_batch, T = cfg.training.seq_len, E = c->n_experts, K = c->top_k;
    const int64_t D = c->dim, F = c->ffn_dim, N = (int64_t)B * T, NK = N * K;
    if (E < 1 || K < 1 || K > E) {
        fprintf(stderr, "bench_experts: %s has no routed experts\n", cfg_path);
        return 1;
    }
    tera_backend *be = tera_backend_cpu_create(threads);
    const int bf16 = !strcmp(prec, "bf16");
    tera_backend_set_precision(be, bf16 ? TERA_PREC_BF16 : TERA_PREC_FP32, TERA_BF16_NATIVE);
    tera_backend_reserve(be, NK * D + 3 * F * D + NK * F, NK * D + 3 * F * D + NK * F);

    const tera_model_par par = {.ep = 1, .tp = 1, .be = be};
    tera_dispatcher *d = tera_dispatch_create(c, B, T, F, &par, 0);
    tera_dispatch_acts t = {0};
    t.slot_row = malloc(sizeof(int32_t) * (size_t)NK);
    t.row_tok = malloc(sizeof(int32_t) * (size_t)NK);
    t.exp_off = malloc(sizeof(int32_t) * (size_t)(E + 1));
    t.sel_count = malloc(sizeof(int32_t) * (size_t)B * E);
    t.xg = falloc(NK * D), t.ye = falloc(NK * D);
    t.a1 = falloc(NK * F), t.a3 = falloc(NK * F), t.gact = falloc(NK * F);
    float *w1 = falloc(E * F * D), *w3 = falloc(E * F * D), *w2 = falloc(E * D * F);
    float *g1 = falloc(E * F * D), *g3 = falloc(E * F * D), *g2 = falloc(E * D * F);
    float *da1 = falloc(NK * F), *da3 = falloc(NK * F), *dg = falloc(NK * F);
    float *x = falloc(N * D), *probs = falloc(N * E), *y = falloc(NK * D), *topw = falloc(NK), *dtopw = falloc(NK);
    fill(w1, E * F * D, 1, 0.1f), fill(w3, E * F * D, 2, 0.1f), fill(w2, E * D * F, 3, 0.1f);
    fill(x, N * D, 4, 1.0f), fill(topw, NK, 5, 1.0f);
    memset(g1, 0, sizeof(float) * (size_t)(E * F * D)), memset(g3, 0, sizeof(float) * (size_t)(E * F * D));
    memset(g2, 0, sizeof(float) * (size_t)(E * D * F));
    for (int64_t i = 0; i < N * E; i++) probs[i] = 1.0f / (float)E;
    /* routing: k distinct experts per token, expert e with weight (1 + skew)^-e */
    int32_t *topi = malloc(sizeof(int32_t) * (size_t)NK);
    double *cum = malloc(sizeof(double) * (size_t)E);
    double tot = 0.0;
    for (int e = 0; e < E; e++) cum[e] = (tot += pow(1.0 + skew, -(double)e));
    uint64_t s = 12345;
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < K; j++) {
            int e, dup;
            do {
                s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                const double u = (double)(s >> 11) / 9007199254740992.0 * tot;
                for (e = 0; e < E - 1 && cum[e] <= u; e++) {}
                dup = 0;
                for (int i = 0; i < j; i++) dup |= topi[n * K + i] == e;
            } while (dup);
            topi[n * K + j] = e;
        }
    tera_dispatch_permute(d, &t, x, topi, probs, 0);
    int64_t maxrows = 0;
    for (int e = 0; e < E; e++) maxrows = t.exp_off[e + 1] - t.exp_off[e] > maxrows ? t.exp_off[e + 1] - t.exp_off[e] : maxrows;
    const tera_layer_view W = {.w1 = w1, .w3 = w3, .w2 = w2}, G = {.w1 = g1, .w3 = g3, .w2 = g2};
    const double flops_fwd = 2.0 * 3.0 * (double)t.exp_off[E] * (double)D * (double)F;

    double fwd[MAX_REPS], bwd[MAX_REPS], p13[MAX_REPS], psw[MAX_REPS], p2[MAX_REPS], sbs[MAX_REPS], util[MAX_REPS];
    /* warm-up: every primitive and scratch once */
    tera_dispatch_experts_forward(d, &t, &W, 0);
    tera_dispatch_combine_backward(d, dtopw, x, &t, topw); /* the dispatcher's dye from some dy */
    tera_dispatch_experts_backward(d, &t, &W, &G, 0, da1, da3, dg, 1.0f, NULL);
    double ofwd[MAX_REPS], obwd[MAX_REPS];
    for (int r = 0; r < reps; r++) {
        for (int v = 0; v < 2; v++) { /* the order alternates rep by rep */
            const int old = (v + r) % 2;
            if (old) setenv("TERA_EXPERTS_ALONE", "0", 1);
            double t0 = tera_now();
            tera_dispatch_experts_forward(d, &t, &W, 0);
            double t1 = tera_now();
            tera_dispatch_experts_backward(d, &t, &W, &G, 0, da1, da3, dg, 1.0f, NULL);
            double t2 = tera_now();
            unsetenv("TERA_EXPERTS_ALONE");
            (old ? ofwd : fwd)[r] = 1e3 * (t1 - t0), (old ? obwd : bwd)[r] = 1e3 * (t2 - t1);
        }
        /* the pieces, one thread */
        double tp[3] = {0, 0, 0};
        tera_set_threads(1);
        for (int e = 0; e < E; e++) expert_fwd(be, &t, w1, w3, w2, y, D, F, e, tp);
        tera_set_threads(threads);
        p13[r] = 1e3 * tp[0], psw[r] = 1e3 * tp[1], p2[r] = 1e3 * tp[2];
        /* side by side, largest first */
        int order[256];
        const int ne = E < 256 ? E : 256;
        for (int e = 0; e < ne; e++) order[e] = e;
        for (int i = 1; i < ne; i++) /* insertion sort by descending rows, ties by index */
            for (int j = i; j > 0; j--) {
                const int a = order[j - 1], b = order[j];
                if (t.exp_off[b + 1] - t.exp_off[b] > t.exp_off[a + 1] - t.exp_off[a]) order[j - 1] = b, order[j] = a;
                else break;
            }
        sbs_ctx sc = {.be = be, .t = &t, .w1 = w1, .w3 = w3, .w2 = w2, .y = y, .D = D, .F = F, .order = order};
        double t3 = tera_now();
        be->ops.for_each_item(be, ne, sbs_item, &sc);
        double t4 = tera_now();
        double busy = 0.0;
        for (int i = 0; i < MAX_THREADS; i++) busy += sc.busy[i];
        sbs[r] = 1e3 * (t4 - t3);
        util[r] = busy / ((double)threads * (t4 - t3));
    }
    const double mf = median(fwd, reps), mb = median(bwd, reps);
    const double m13 = median(p13, reps), msw = median(psw, reps), m2 = median(p2, reps);
    printf("{\"bench\": \"experts\", \"config\": \"%s\", \"precision\": \"%s\", \"threads\": %d, \"skew\": %.3f, "
           "\"rows\": %d, \"max_rows\": %ld, \"experts\": %d, "
           "\"fwd_ms\": %.3f, \"bwd_ms\": %.3f, \"old_fwd_ms\": %.3f, \"old_bwd_ms\": %.3f, "
           "\"fwd_gflops\": %.1f, \"bwd_gflops\": %.1f, "
           "\"one_thread_w13_ms\": %.3f, \"one_thread_swiglu_ms\": %.3f, \"one_thread_w2_ms\": %.3f, "
           "\"one_thread_products_gflops\": %.1f, \"sbs_fwd_ms\": %.3f, \"sbs_utilisation\": %.3f}\n",
           cfg_path, prec, threads, skew, t.exp_off[E], (long)maxrows, E, mf, mb, median(ofwd, reps), median(obwd, reps),
           flops_fwd / mf / 1e6, 2.0 * flops_fwd / mb / 1e6, m13, msw, m2, flops_fwd / (m13 + m2) / 1e6,
           median(sbs, reps), median(util, reps));
    tera_dispatch_destroy(d);
    free(t.slot_row), free(t.row_tok), free(t.exp_off), free(t.sel_count);
    free(t.xg), free(t.ye), free(t.a1), free(t.a3), free(t.gact);
    free(w1), free(w3), free(w2), free(g1), free(g3), free(g2), free(da1), free(da3), free(dg);
    free(x), free(probs), free(y), free(topw), free(dtopw), free(topi), free(cum);
    tera_backend_destroy(be);
    return 0;
}
