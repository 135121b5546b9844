/* Attention forward/backward throughput on the CPU: the fp32 kernels and the bf16 ones (products on
 * the matrix units, src/kernels/cpu/attention.c) side by side, same shapes, same run. Where the CPU
 * has AVX512-BF16 dot products (tera_attention_dot_available) the bf16 entry points run with
 * TERA_ATTN_BF16=onednn (set here unless the environment sets it: that also keeps AMX off), variant
 * "bf16" (the oneDNN per-tile products), and the dot-product kernels (src/kernels/cpu/attention_dot.c)
 * run as variant "dot", called directly: fp32, oneDNN bf16 and dot bf16 in one run, alternating.
 *
 * Build and run (from the repository root):
 *   gcc -std=c11 -D_GNU_SOURCE -O3 -march=native -fopenmp -Iinclude -Isrc src/core/status.c \
 *       src/obs/prof_products.c src/kernels/cpu/matmul.c src/kernels/cpu/attention.c src/kernels/cpu/attention_avx2.c \
 *       src/kernels/cpu/attention_dot.c \
 *       bench/bench_attention.c -o /tmp/bench_attention -ldnnl -lm && /tmp/bench_attention [reps]
 * (add -DATTN_TILE=64 or -DATTN_BF16_TILE=256 to re-measure the tile sizes.)
 *
 * Old against new in one process: an earlier attention.c (e.g. `git show REV:src/kernels/cpu/attention.c
 * > /tmp/attention_ref.c`) compiled into this program with its symbols renamed, by adding
 *   -DATTN_REF='"/tmp/attention_ref.c"' -Isrc/kernels/cpu
 * to the line above: its fp32 and bf16 kernels then run as variants "fp32-ref" / "bf16-ref",
 * alternating with the current ones, and each current variant's speed-up is against its ref
 * ("max rel diff" of the fp32 rows is then against fp32-ref). TERA_ATTN_FP32=sgemm in the
 * environment also selects the current file's sgemm kernels for fp32 (the path before the
 * register-blocked kernels), =avx2 the AVX2 form of those (attention_avx2.c), for the whole program.
 * -march=x86-64-v3 builds what an AVX2-only CPU runs (with ONEDNN_MAX_CPU_ISA=AVX2 for oneDNN).
 * At bench-m's shape this program alone ranked the two register-blocked forms the other way round
 * from whole training steps on one CPU (docs/PERFORMANCE.md): compare kernels in `tera bench`'s
 * profile as well.
 *
 * GFLOP/s are given two ways: "causal" counts the products actually needed under the causal
 * mask (T*(T+1)/2 query-key pairs), "full" counts T*T pairs as is customary for flash attention:
 * forward 4*B*H*T*T*hd, backward 8*B*H*T*T*hd (recomputing S is not counted). Medians of `reps`;
 * the fp32 and bf16 repetitions alternate, so a busy moment of the machine hits both alike. The
 * bf16 rows also give the largest difference from the fp32 outputs (out, dq) relative to their
 * largest magnitude, a sanity check that both computed the same thing. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "tera/kernels.h"
#include "bench_median.h"

typedef void (*fwd_fn)(float *, float *, const float *, const float *, const float *, int, int, int, int, int,
                       float *);
typedef void (*bwd_fn)(float *, float *, float *, const float *, const float *, const float *, const float *,
                       const float *, const float *, int, int, int, int, int, float *);
typedef size_t (*scratch_fn)(int, int, int, int, int);

#ifdef ATTN_REF
#define tera_attention_forward ref_attention_forward
#define tera_attention_backward ref_attention_backward
#define tera_attention_forward_bf16 ref_attention_forward_bf16
#define tera_attention_backward_bf16 ref_attention_backward_bf16
#define tera_attention_scratch_floats ref_attention_scratch_floats
#define tera_attention_bf16_scratch_floats ref_attention_bf16_scratch_floats
#define tera_attention_bf16_available ref_attention_bf16_available
#define tera_attention_bf16_kernel ref_attention_bf16_kernel
#define tera_cpu_attn_fp32 ref_cpu_attn_fp32 /* the kernel choice: a file that has it keeps its own */
#define tera_cpu_attn_fp32_set ref_cpu_attn_fp32_set
#define tera_cpu_attn_fp32_name ref_cpu_attn_fp32_name
#define tera_cpu_attn_fp32_available ref_cpu_attn_fp32_available
const char *ref_cpu_attn_fp32_name(int kernel);
int ref_cpu_attn_fp32_available(int kernel);
int ref_cpu_attn_fp32(void);
int ref_cpu_attn_fp32_set(int kernel);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-prototypes"
#include ATTN_REF
#pragma GCC diagnostic pop
#undef tera_attention_forward
#undef tera_attention_backward
#undef tera_attention_forward_bf16
#undef tera_attention_backward_bf16
#undef tera_attention_scratch_floats
#undef tera_attention_bf16_scratch_floats
#undef tera_attention_bf16_available
#undef tera_cpu_attn_fp32
#undef tera_cpu_attn_fp32_set
#undef tera_cpu_attn_fp32_name
#undef tera_cpu_attn_fp32_available
#undef tera_attention_bf16_kernel
#endif

typedef struct {
    const char *name;
    fwd_fn fwd;
    bwd_fn bwd;
    scratch_fn scratch;
    int ref;  /* index of the variant it is compared with (speed-up, max rel diff) */
} variant;

typedef struct {
    const char *name;
    int B, T, H, Hkv, hd;
} bench_shape;

static float *alloc_rand(size_t n, uint64_t *rng) {
    float *p = malloc((n ? n : 1) * sizeof(float));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) {
        *rng ^= *rng << 13, *rng ^= *rng >> 7, *rng ^= *rng << 17;
        p[i] = (float)((*rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
    }
    return p;
}

/* the dot kernels' scratch for the thread count of the run (bench threads <= omp max at sizing) */
static size_t dot_scratch(int B, int T, int H, int Hkv, int hd) {
    return tera_attention_dot_scratch_floats(B, T, H, Hkv, hd, omp_get_max_threads());
}

static double rel_diff(const float *a, const float *b, size_t n) {
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - b[i]);
        d = e > d ? e : d;
        m = fabs(b[i]) > m ? fabs(b[i]) : m;
    }
    return m > 0 ? d / m : d;
}

int main(int argc, char **argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 21;
    const bench_shape shapes[] = {{"bench-s", 8, 256, 8, 8, 32}, {"bench-m", 4, 512, 8, 8, 64}, {"hd128", 4, 512, 4, 4, 128}};
    const int max_threads = 2;
    /* the dot kernels as their own variant; the entry points then on the oneDNN products */
    const int dot = tera_attention_bf16_available() && tera_attention_dot_available();
    if (dot) setenv("TERA_ATTN_BF16", "onednn", 0);
    const int bf16 = tera_attention_bf16_available();
    variant var[5];
    int nv = 0;
#ifdef ATTN_REF
    var[nv++] = (variant){"fp32-ref", ref_attention_forward, ref_attention_backward, ref_attention_scratch_floats, 0};
    var[nv++] = (variant){"fp32", tera_attention_forward, tera_attention_backward, tera_attention_scratch_floats, 0};
    if (bf16) {
        var[nv++] = (variant){"bf16-ref", ref_attention_forward_bf16, ref_attention_backward_bf16,
                              ref_attention_bf16_scratch_floats, 2};
        var[nv++] = (variant){"bf16", tera_attention_forward_bf16, tera_attention_backward_bf16,
                              tera_attention_bf16_scratch_floats, 2};
    }
    if (dot) var[nv++] = (variant){"dot", tera_attention_forward_dot, tera_attention_backward_dot, dot_scratch, 1};
#else
    var[nv++] = (variant){"fp32", tera_attention_forward, tera_attention_backward, tera_attention_scratch_floats, 0};
    if (bf16)
        var[nv++] = (variant){"bf16", tera_attention_forward_bf16, tera_attention_backward_bf16,
                              tera_attention_bf16_scratch_floats, 0};
    if (dot) var[nv++] = (variant){"dot", tera_attention_forward_dot, tera_attention_backward_dot, dot_scratch, 0};
#endif
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    double *t[5][3];
    for (int p = 0; p < nv; p++)
        for (int j = 0; j < 3; j++) t[p][j] = malloc((size_t)reps * sizeof(double));
    const char *isa = "";
    tera_cpu_bf16_fast(&isa);
    printf("oneDNN ISA %s; bf16 attention %s (%s products)%s\n", isa, bf16 ? "available" : "not available (fp32 only)",
           tera_attention_bf16_kernel(), dot ? "; dot: AVX512-BF16 dot-product kernels (attention_dot.c)" : "");
    printf("%-8s %3s %8s | %9s %9s %9s | fwd GF/s causal/full | bwd GF/s causal/full | f+b GF/s causal/full | %7s | %s\n",
           "shape", "thr", "variant", "fwd ms", "bwd ms", "f+b ms", "speedup", "max rel diff out/dq vs its ref");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const bench_shape s = shapes[si];
        const size_t nq = (size_t)s.B * s.T * s.H * s.hd, nk = (size_t)s.B * s.T * s.Hkv * s.hd;
        const size_t nl = (size_t)s.B * s.H * s.T;
        omp_set_num_threads(max_threads);
        float *q = alloc_rand(nq, &rng), *k = alloc_rand(nk, &rng), *v = alloc_rand(nk, &rng);
        float *dout = alloc_rand(nq, &rng);
        float *out[5], *lse[5], *dq[5], *dk[5], *dv[5];
        size_t ns = 0;
        for (int p = 0; p < nv; p++) {
            out[p] = alloc_rand(nq, &rng), lse[p] = alloc_rand(nl, &rng), dq[p] = alloc_rand(nq, &rng);
            dk[p] = alloc_rand(nk, &rng), dv[p] = alloc_rand(nk, &rng);
            const size_t n = var[p].scratch(s.B, s.T, s.H, s.Hkv, s.hd);
            ns = n > ns ? n : ns;
        }
        float *scratch = alloc_rand(ns, &rng);
        const double bhd = (double)s.B * s.H * s.hd;
        const double pairs_full = (double)s.T * s.T, pairs_causal = (double)s.T * (s.T + 1) / 2.0;
        for (int thr = 1; thr <= max_threads; thr++) {
            omp_set_num_threads(thr);
            for (int r = -3; r < reps; r++) {
                for (int p = 0; p < nv; p++) {
                    const double t0 = omp_get_wtime();
                    var[p].fwd(out[p], lse[p], q, k, v, s.B, s.T, s.H, s.Hkv, s.hd, scratch);
                    const double t1 = omp_get_wtime();
                    var[p].bwd(dq[p], dk[p], dv[p], dout, q, k, v, out[p], lse[p], s.B, s.T, s.H, s.Hkv, s.hd,
                               scratch);
                    const double t2 = omp_get_wtime();
                    if (r < 0) continue; /* warm-up */
                    t[p][0][r] = t1 - t0, t[p][1][r] = t2 - t1, t[p][2][r] = t2 - t0;
                }
            }
            double med[5] = {0};
            for (int p = 0; p < nv; p++) {
                const double mf = median(t[p][0], reps), mb = median(t[p][1], reps), mt = median(t[p][2], reps);
                med[p] = mt;
                const double ff = 4 * bhd * pairs_full, fb = 8 * bhd * pairs_full;
                const double cf = 4 * bhd * pairs_causal, cb = 8 * bhd * pairs_causal;
                const int rp = var[p].ref;
                char diff[64] = "-";
                if (rp != p)
                    snprintf(diff, sizeof diff, "%.2e / %.2e", rel_diff(out[p], out[rp], nq), rel_diff(dq[p], dq[rp], nq));
                printf("%-8s %3d %8s | %9.3f %9.3f %9.3f | %8.1f / %-8.1f  | %8.1f / %-8.1f  | %8.1f / %-8.1f  | %6.2fx | %s\n",
                       s.name, thr, var[p].name, mf * 1e3, mb * 1e3, mt * 1e3, cf / mf * 1e-9, ff / mf * 1e-9,
                       cb / mb * 1e-9, fb / mb * 1e-9, (cf + cb) / mt * 1e-9, (ff + fb) / mt * 1e-9, med[rp] / mt,
                       diff);
            }
            if (dot) /* the dot kernels against the entry points' bf16 products (the last two variants) */
                printf("%-8s %3d %8s | f+b speed-up of dot over bf16: %.2fx\n", s.name, thr, "", med[nv - 2] / med[nv - 1]);
        }
        free(q), free(k), free(v), free(dout), free(scratch);
        for (int p = 0; p < nv; p++) free(out[p]), free(lse[p]), free(dq[p]), free(dk[p]), free(dv[p]);
    }
    for (int p = 0; p < nv; p++)
        for (int j = 0; j < 3; j++) free(t[p][j]);
    return 0;
}
