/* The router's time per token at many experts, by phase, for the routing options (softmax top-k;
 * DeepSeek-V3's sigmoid scores with group-limited top-k and the aux-free bias; ...).
 *
 * Built by CMake with the project (build-e/bench/bench_router). Run from anywhere:
 *   bench_router [--experts E] [--top-k K] [--dim D] [--batch B] [--seq T] [--threads N] [--reps R]
 * Defaults: E = 4096, k = 8, D = 512, B = 4, T = 512 (bench-m's width and micro-batch: 2048 tokens),
 * 1 thread, 7 repetitions after one warm-up (the variants take turns inside each); every figure is
 * the median of the repetitions.
 *
 * Each phase calls the functions the model's MoE layer calls (src/model/model.c, moe_forward /
 * moe_backward), on the same shapes:
 *   gate fwd    logits[N,E] = x[N,D] gate[E,D]^T              (tera_linear_forward_fp32)
 *   scores      softmax or sigmoid, and the log-sum-exp        (tera_moe_score_forward)
 *   top-k       selection and combine weights                  (tera_moe_route)
 *   stats       aux loss, z-loss, entropy and expert load      (tera_moe_route_stats)
 *   bwd         d logits from the combine-weight gradients, aux and z (tera_moe_router_backward)
 *   gate bwd    dx[N,D] and dgate[E,D]                          (tera_linear_backward_fp32)
 * The dispatch plan, the experts and the combine are not the router and are not timed. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/moe.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "bench_median.h"

enum { PH_GATE_FWD, PH_SCORES, PH_TOPK, PH_STATS, PH_BWD, PH_GATE_BWD, N_PH };
static const char *const ph_name[N_PH] = {"gate fwd", "scores", "top-k", "stats", "bwd", "gate bwd"};

static void *xmalloc(size_t n) {
    void *p = aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "bench_router: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* uniform in [-a, a] from a xorshift stream */
static void fill(float *x, int64_t n, uint64_t seed, float a) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = a * (2.0f * (float)((s >> 40) & 0xFFFFFF) / 16777216.0f - 1.0f);
    }
}

typedef struct {
    const char *name;
    tera_router_score score;
    int n_groups, topk_groups, bias;
} variant;

int main(int argc, char **argv) {
    int E = 4096, K = 8, D = 512, B = 4, T = 512, threads = 1, reps = 7;
    for (int i = 1; i + 1 < argc; i += 2) {
        const int v = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--experts")) E = v;
        else if (!strcmp(argv[i], "--top-k")) K = v;
        else if (!strcmp(argv[i], "--dim")) D = v;
        else if (!strcmp(argv[i], "--batch")) B = v;
        else if (!strcmp(argv[i], "--seq")) T = v;
        else if (!strcmp(argv[i], "--threads")) threads = v;
        else if (!strcmp(argv[i], "--reps")) reps = v;
        else {
            fprintf(stderr, "bench_router: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (E < 8 || E % 8 || K < 1 || K > E / 2 || D < 1 || B < 1 || T < 1 || reps < 1 || reps > 99) {
        fprintf(stderr, "bench_router: need E a multiple of 8, 1 <= k <= E/2, positive sizes, 1-99 reps\n");
        return 2;
    }
    tera_set_threads(threads);
    tera_backend *be = tera_backend_cpu_create(-1); /* the router's softmax runs on the CPU backend */
    const int64_t N = (int64_t)B * T;
    const variant vars[] = {
        {"softmax", TERA_ROUTER_SOFTMAX, 1, 1, 0},
        {"softmax, 8 groups / 4", TERA_ROUTER_SOFTMAX, 8, 4, 0},
        {"sigmoid", TERA_ROUTER_SIGMOID, 1, 1, 0},
        {"sigmoid, 8 groups / 4, bias", TERA_ROUTER_SIGMOID, 8, 4, 1},
    };
    const int n_vars = (int)(sizeof vars / sizeof vars[0]);

    float *x = xmalloc(sizeof(float) * (size_t)(N * D)), *gate = xmalloc(sizeof(float) * (size_t)E * D);
    float *dgate = xmalloc(sizeof(float) * (size_t)E * D), *dx = xmalloc(sizeof(float) * (size_t)(N * D));
    float *logits = xmalloc(sizeof(float) * (size_t)(N * E)), *scores = xmalloc(sizeof(float) * (size_t)(N * E));
    float *dlogits = xmalloc(sizeof(float) * (size_t)(N * E)), *dscores = xmalloc(sizeof(float) * (size_t)(N * E));
    float *lse = xmalloc(sizeof(float) * (size_t)N), *rsum = xmalloc(sizeof(float) * (size_t)N);
    float *topw = xmalloc(sizeof(float) * (size_t)(N * K)), *dtopw = xmalloc(sizeof(float) * (size_t)(N * K));
    float *bias = xmalloc(sizeof(float) * (size_t)E);
    int32_t *topi = xmalloc(sizeof(int32_t) * (size_t)(N * K)), *sel = xmalloc(sizeof(int32_t) * (size_t)B * E);
    int64_t *load = xmalloc(sizeof(int64_t) * (size_t)E);
    double *psum = xmalloc(sizeof(double) * (size_t)(B + 1) * E); /* tera_moe_route_stats: [B + 1, E] */
    fill(x, N * D, 1, 1.7f); /* about unit RMS, like the RMSNorm output the router sees */
    fill(gate, (int64_t)E * D, 2, 0.02f * 1.7f);
    fill(dtopw, N * K, 3, 1e-3f);
    fill(bias, E, 4, 0.01f);
    memset(dgate, 0, sizeof(float) * (size_t)E * D);
    memset(load, 0, sizeof(int64_t) * (size_t)E);

    printf("router, E = %d, k = %d, D = %d, %lld tokens (B %d x T %d), %d thread%s, median of %d; us per token\n", E,
           K, D, (long long)N, B, T, threads, threads > 1 ? "s" : "", reps);
    printf("%-28s", "variant");
    for (int p = 0; p < N_PH; p++) printf(" %9s", ph_name[p]);
    printf(" %9s %9s\n", "total", "w/o gate");
    /* the variants take turns inside each repetition, so a slow moment of the machine hits all alike */
    static double t[8][N_PH][100], total[8][100], router_only[8][100];
    void *scratch[8];
    tera_moe_routing r[8];
    for (int v = 0; v < n_vars; v++) {
        r[v] = (tera_moe_routing){.score = vars[v].score, .n_groups = vars[v].n_groups,
                                  .topk_groups = vars[v].topk_groups, .scale = 1.0f};
        scratch[v] = r[v].n_groups > 1 ? xmalloc(tera_moe_route_scratch_bytes(&r[v], tera_get_threads())) : NULL;
    }
    for (int rep = -1; rep < reps; rep++) { /* rep -1: warm-up */
        for (int v = 0; v < n_vars; v++) {
            double t0 = tera_now(), ph[N_PH];
            tera_linear_forward_fp32(logits, x, gate, N, D, E, 0.0f);
            ph[PH_GATE_FWD] = tera_now() - t0, t0 = tera_now();
            tera_moe_score_forward(be, scores, lse, logits, N, E, r[v].score);
            ph[PH_SCORES] = tera_now() - t0, t0 = tera_now();
            tera_moe_route(be, topi, topw, scores, vars[v].bias ? bias : NULL, N, E, K, &r[v], scratch[v]);
            ph[PH_TOPK] = tera_now() - t0;
            memset(sel, 0, sizeof(int32_t) * (size_t)B * E); /* the dispatch plan's count (not timed) */
            for (int64_t a = 0; a < N * K; a++) sel[(a / ((int64_t)T * K)) * E + topi[a]]++;
            t0 = tera_now();
            const tera_moe_stats st = tera_moe_route_stats(be, load, rsum, psum, scores, logits, lse, sel, B, T, E, K, r[v].score);
            ph[PH_STATS] = tera_now() - t0, t0 = tera_now();
            tera_moe_router_backward(be, dlogits, dscores, logits, scores, lse, topi, topw, dtopw, sel, B, T, E, K, &r[v],
                                     1e-2f / (float)B, 1e-3f / (float)N);
            ph[PH_BWD] = tera_now() - t0, t0 = tera_now();
            tera_linear_backward_fp32(dx, dgate, dlogits, x, gate, N, D, E, 0.0f, 1.0f);
            ph[PH_GATE_BWD] = tera_now() - t0;
            if (!(st.aux > 0.0) || !isfinite(st.z)) {
                fprintf(stderr, "bench_router: bad statistics\n");
                return 1;
            }
            if (rep < 0) continue;
            total[v][rep] = router_only[v][rep] = 0.0;
            for (int p = 0; p < N_PH; p++) {
                t[v][p][rep] = ph[p];
                total[v][rep] += ph[p];
                if (p != PH_GATE_FWD && p != PH_GATE_BWD) router_only[v][rep] += ph[p];
            }
        }
    }
    for (int v = 0; v < n_vars; v++) {
        printf("%-28s", vars[v].name);
        for (int p = 0; p < N_PH; p++) printf(" %9.3f", 1e6 * median(t[v][p], reps) / (double)N);
        printf(" %9.3f %9.3f\n", 1e6 * median(total[v], reps) / (double)N,
               1e6 * median(router_only[v], reps) / (double)N);
        free(scratch[v]);
    }
    printf("gate products at the first variant's medians: forward %.1f GFLOP/s, backward %.1f GFLOP/s\n",
           2e-9 * (double)N * D * E / median(t[0][PH_GATE_FWD], reps),
           4e-9 * (double)N * D * E / median(t[0][PH_GATE_BWD], reps));
    free(x), free(gate), free(dgate), free(dx), free(logits), free(scores), free(dlogits), free(dscores);
    free(lse), free(rsum), free(topw), free(dtopw), free(bias), free(topi), free(sel), free(load), free(psum);
    tera_backend_destroy(be);
    return 0;
}
