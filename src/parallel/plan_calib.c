/* tera plan --calibrate: measures this machine for the time model (docs/PLAN.md, issue 18).
 *
 * One process (no mpirun): the rates of the linear layers' products (forward + backward, through
 * the compute backend: ops.linear_forward / linear_backward) for the model's training shapes at the
 * configuration's thread count and precision: every product of a layer (q, k, v, o, the dense and
 * shared FFNs, the experts over their rows at ep = 1, 2, 4, 8, the router, the head) at tp = 1, 2, 4
 * where tp divides the widths, for micro-batches 1, 2, 4, ... up to training.micro_batch; the
 * attention kernel (ops.attention_forward / backward) at the same shapes; and the streaming memory
 * bandwidth (a triad over arrays far larger than the caches). Several processes (under mpirun):
 * the collectives through tera's comm layer (all-reduce, all-gather, the experts' exchange pattern
 * of point-to-point blocks to every peer, a point-to-point send) by message size, each fitted as
 * latency + bytes / bandwidth (bytes: what one rank sends, as src/comm/comm.c counts it), at the
 * world size. The ranks of one run share the machine's cores (as bench-dist's do), so the compute
 * rates are measured by one process alone and the collectives by all ranks at once; under mpirun
 * also the fraction of its rate alone each rank gets when all compute at once ([shared]).
 *
 * Each measurement: one warm-up call, then the median of up to 5 timed calls (fewer when one call
 * takes longer than 0.2 s): the machine is shared, so medians, not best cases. The result is merged
 * into the output file (points of the same shape replaced), so several calls (thread counts,
 * configurations, world sizes) build one description. */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tera/backend.h"
#include "tera/comm.h"
#include "tera/kernels.h"
#include "tera/plan.h"
#include "tera/profile.h"
#include "tera/zero.h"

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* the median of up to 5 timed calls after a warm-up; fewer when a call is slow */
typedef void (*bench_fn)(void *ctx);
static double time_median(bench_fn fn, void *ctx) {
    double t[5];
    fn(ctx);
    int n = 0;
    double spent = 0.0;
    while (n < 5 && (n < 1 || spent < 0.6)) {
        const double t0 = tera_now();
        fn(ctx);
        t[n] = tera_now() - t0;
        spent += t[n++];
    }
    qsort(t, (size_t)n, sizeof t[0], cmp_d);
    return t[n / 2];
}

/* ------------------------------------------------------------------ products */
typedef struct {
    tera_backend *be;
    int64_t m, k, n;
    float *x, *w, *y, *dx, *dw, *dy;
} gemm_ctx;

static void gemm_call(void *p) {
    gemm_ctx *g = p;
    g->be->ops.linear_forward(g->be, g->y, g->x, g->w, g->m, g->k, g->n, 0.0f);
    g->be->ops.linear_backward(g->be, g->dx, g->dw, g->dy, g->x, g->w, g->m, g->k, g->n, 0.0f, 1.0f);
}

static void gemm_call_fp32(void *p) {
    gemm_ctx *g = p;
    g->be->ops.linear_forward_fp32(g->be, g->y, g->x, g->w, g->m, g->k, g->n, 0.0f);
    g->be->ops.linear_backward_fp32(g->be, g->dx, g->dw, g->dy, g->x, g->w, g->m, g->k, g->n, 0.0f, 1.0f);
}

static float *filled(int64_t n, float scale) {
    float *p = tera_malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) p[i] = scale * (float)((i * 7919) % 97 - 48) / 48.0f;
    return p;
}

/* points measured by this call (not to be measured twice; older ones are replaced) */
static unsigned char gemm_fresh[TERA_HW_MAX_GEMM], attn_fresh[TERA_HW_MAX_ATTN];

static void add_gemm(tera_hw *hw, const tera_hw_gemm *g) {
    for (int i = 0; i < hw->n_gemm; i++) {
        tera_hw_gemm *o = &hw->gemm[i];
        if (o->threads == g->threads && o->prec == g->prec && o->m == g->m && o->k == g->k && o->n == g->n) {
            *o = *g;
            gemm_fresh[i] = 1;
            return;
        }
    }
    if (hw->n_gemm < TERA_HW_MAX_GEMM) gemm_fresh[hw->n_gemm] = 1, hw->gemm[hw->n_gemm++] = *g;
}

/* The steadiness check: the first STEADY_POINTS products of a call are measured again at its end; a
 * rate that moved by more than STEADY_RATIO either way means the host's speed changed during the
 * calibration (docs/PLAN.md, "A second AMX CPU": a slow start read the first products 27-61% slow and
 * priced a validation 15% off), and `tera plan --calibrate` says so on stderr, naming the product. The
 * file keeps what was measured: calibrating again is the user's call. TERA_CALIBRATE_SLOW_START_US
 * (tests) adds that many microseconds to every timed call of those first products, the first time. */
#define STEADY_POINTS 3
#define STEADY_RATIO 1.5
typedef struct {
    int threads;
    tera_hw_prec prec;
    int64_t m, k, n;
    double flops_s;
} steady_point;
static steady_point g_steady[STEADY_POINTS];
static int g_n_steady;
static long g_slow_start_us;

static void gemm_call_slowed(void *p) {
    gemm_call(p);
    usleep((useconds_t)g_slow_start_us);
}

static void gemm_call_fp32_slowed(void *p) {
    gemm_call_fp32(p);
    usleep((useconds_t)g_slow_start_us);
}

/* the forward + backward rate of one product (FLOP/s); slowed: the test hook's delay in every call */
static double gemm_rate(tera_backend *be, tera_hw_prec prec, int64_t m, int64_t k, int64_t n, int slowed) {
    gemm_ctx g = {.be = be, .m = m, .k = k, .n = n, .x = filled(m * k, 1.0f), .w = filled(n * k, 0.05f),
                  .y = filled(m * n, 0.0f), .dx = filled(m * k, 0.0f), .dw = filled(n * k, 0.0f),
                  .dy = filled(m * n, 0.01f)};
    const int as_fp32 = prec == TERA_HW_FP32 && be->precision != TERA_PREC_FP32;
    const bench_fn fn = slowed ? (as_fp32 ? gemm_call_fp32_slowed : gemm_call_slowed) : as_fp32 ? gemm_call_fp32 : gemm_call;
    const double s = time_median(fn, &g);
    free(g.x), free(g.w), free(g.y), free(g.dx), free(g.dw), free(g.dy);
    return 6.0 * (double)m * (double)k * (double)n / s;
}

static void measure_gemm(tera_hw *hw, tera_backend *be, int threads, tera_hw_prec prec, int64_t m, int64_t k,
                         int64_t n, FILE *log) {
    for (int i = 0; i < hw->n_gemm; i++) { /* measured already in this call */
        const tera_hw_gemm *o = &hw->gemm[i];
        if (gemm_fresh[i] && o->threads == threads && o->prec == prec && o->m == m && o->k == k && o->n == n) return;
    }
    const int first = g_n_steady < STEADY_POINTS;
    const tera_hw_gemm p = {.threads = threads, .prec = prec, .m = m, .k = k, .n = n,
                            .flops_s = gemm_rate(be, prec, m, k, n, first && g_slow_start_us > 0)};
    if (first)
        g_steady[g_n_steady++] = (steady_point){.threads = threads, .prec = prec, .m = m, .k = k, .n = n, .flops_s = p.flops_s};
    add_gemm(hw, &p);
    if (log) fprintf(log, "  gemm %s t%d [%lld x %lld] x [%lld]^T: %.1f GFLOP/s\n", tera_hw_prec_name[prec], threads,
                     (long long)m, (long long)k, (long long)n, p.flops_s / 1e9);
}

/* The first products of this call measured again; one note on stderr when any moved, naming the one
 * that moved most */
static void steady_check(tera_backend *be, FILE *log) {
    int moved = 0, worst = -1;
    double worst_dev = 0.0, worst_again = 0.0;
    for (int i = 0; i < g_n_steady; i++) {
        const steady_point *q = &g_steady[i];
        const double again = gemm_rate(be, q->prec, q->m, q->k, q->n, 0), ratio = again / q->flops_s;
        if (log) fprintf(log, "  steadiness: gemm %s t%d [%lld x %lld] x [%lld]^T again: %.1f GFLOP/s (%.2fx the first)\n",
                         tera_hw_prec_name[q->prec], q->threads, (long long)q->m, (long long)q->k, (long long)q->n,
                         again / 1e9, ratio);
        const double dev = ratio > 1.0 ? ratio : 1.0 / ratio;
        if (dev > STEADY_RATIO) moved++;
        if (dev > worst_dev) worst_dev = dev, worst = i, worst_again = again;
    }
    if (moved) {
        const steady_point *q = &g_steady[worst];
        fprintf(stderr,
                "tera plan --calibrate: note: the host's speed moved during the calibration: the product [%lld x %lld] "
                "x [%lld]^T (%s, %d thread%s) read %.4g GFLOP/s at the start and %.4g at the end (%d of the first %d "
                "products moved by more than %.1fx); the rates measured early may be off: calibrate again on a "
                "quieter machine\n",
                (long long)q->m, (long long)q->k, (long long)q->n, tera_hw_prec_name[q->prec], q->threads,
                q->threads == 1 ? "" : "s", q->flops_s / 1e9, worst_again / 1e9, moved, g_n_steady, STEADY_RATIO);
    }
}

/* ------------------------------------------------------------------ attention */
typedef struct {
    tera_backend *be;
    int B, T, H, Hkv, hd;
    float *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv, *scratch;
} attn_ctx;

static void attn_call(void *p) {
    attn_ctx *a = p;
    a->be->ops.attention_forward(a->be, a->o, a->lse, a->q, a->k, a->v, a->B, a->T, a->H, a->Hkv, a->hd, a->scratch);
    a->be->ops.attention_backward(a->be, a->dq, a->dk, a->dv, a->dout, a->q, a->k, a->v, a->o, a->lse, a->B, a->T, a->H,
                                  a->Hkv, a->hd, a->scratch);
}

static void measure_attn(tera_hw *hw, tera_backend *be, int threads, int B, int T, int H, int Hkv, int hd, FILE *log) {
    for (int i = 0; i < hw->n_attn; i++) {
        const tera_hw_attn *o = &hw->attn[i];
        if (attn_fresh[i] && o->threads == threads && o->B == B && o->T == T && o->H == H && o->Hkv == Hkv && o->hd == hd)
            return; /* measured already in this call */
    }
    const int64_t nq = (int64_t)B * T * H * hd, nk = (int64_t)B * T * Hkv * hd;
    attn_ctx a = {.be = be, .B = B, .T = T, .H = H, .Hkv = Hkv, .hd = hd, .q = filled(nq, 0.5f), .k = filled(nk, 0.5f),
                  .v = filled(nk, 1.0f), .o = filled(nq, 0.0f), .lse = filled((int64_t)B * H * T, 0.0f),
                  .dout = filled(nq, 0.01f), .dq = filled(nq, 0.0f), .dk = filled(nk, 0.0f), .dv = filled(nk, 0.0f),
                  .scratch = filled((int64_t)be->ops.attention_scratch_floats(be, B, T, H, Hkv, hd), 0.0f)};
    const double s = time_median(attn_call, &a);
    const tera_hw_attn p = {.threads = threads, .B = B, .T = T, .H = H, .Hkv = Hkv, .hd = hd,
                            .flops_s = 12.0 * B * (double)T * T * H * hd / s};
    int at = -1;
    for (int i = 0; i < hw->n_attn && at < 0; i++) {
        const tera_hw_attn *o = &hw->attn[i];
        if (o->threads == threads && o->B == B && o->T == T && o->H == H && o->Hkv == Hkv && o->hd == hd) at = i;
    }
    if (at < 0 && hw->n_attn < TERA_HW_MAX_ATTN) at = hw->n_attn++;
    if (at >= 0) hw->attn[at] = p, attn_fresh[at] = 1;
    if (log) fprintf(log, "  attention t%d B %d T %d H %d/%d hd %d: %.1f GFLOP/s\n", threads, B, T, H, Hkv, hd,
                     p.flops_s / 1e9);
    free(a.q), free(a.k), free(a.v), free(a.o), free(a.lse), free(a.dout), free(a.dq), free(a.dk), free(a.dv);
    free(a.scratch);
}

/* ------------------------------------------------------------------ memory bandwidth */
typedef struct {
    float *a, *b, *c;
    int64_t n;
    int threads;
} triad_ctx;

static void triad_call(void *p) {
    triad_ctx *t = p;
    float *a = t->a;
    const float *b = t->b, *c = t->c;
    const int64_t n = t->n;
#pragma omp parallel for num_threads(t->threads) schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] = b[i] + 0.5f * c[i];
}

/* ------------------------------------------------------------------ collectives */
typedef struct {
    tera_comm *w;
    tera_hw_coll_kind kind;
    int64_t n; /* floats per rank's buffer */
    float *buf, *recv;
    int64_t *counts;
    tera_comm_req *req;
} coll_ctx;

static void coll_call(coll_ctx *c) {
    const int p = tera_comm_size(c->w), me = tera_comm_rank(c->w);
    switch (c->kind) {
    case TERA_HW_ALLREDUCE: tera_comm_allreduce_f32(c->w, c->buf, c->n); break;
    case TERA_HW_ALLGATHER: tera_comm_allgather_f32(c->w, c->buf, c->counts); break;
    case TERA_HW_ALLTOALL: { /* the experts' exchange: a block of n / p floats to every peer, one from each */
        const int64_t blk = c->n / p;
        int r = 0;
        for (int s = 1; s < p; s++) {
            const int to = (me + s) % p, from = (me - s + p) % p;
            tera_comm_irecv_f32(c->w, c->recv + (int64_t)from * blk, blk, from, 77, &c->req[r++]);
            tera_comm_isend_f32(c->w, c->buf + (int64_t)to * blk, blk, to, 77, &c->req[r++]);
        }
        for (int i = 0; i < r; i++) tera_comm_wait(&c->req[i]);
        break;
    }
    case TERA_HW_P2P: /* pairs (0, 1), (2, 3), ...: the even rank sends, the odd one receives */
        if ((me ^ 1) < p) {
            if (me % 2 == 0) tera_comm_isend_f32(c->w, c->buf, c->n, me ^ 1, 78, &c->req[0]);
            else tera_comm_irecv_f32(c->w, c->recv, c->n, me ^ 1, 78, &c->req[0]);
            tera_comm_wait(&c->req[0]);
        }
        break;
    default: break;
    }
}

/* bytes one rank sends for one call of n floats (src/comm/comm.c's counting) */
static double coll_bytes(tera_hw_coll_kind k, int p, int64_t n) {
    const double b = 4.0 * (double)n;
    switch (k) {
    case TERA_HW_ALLREDUCE: return 2.0 * (p - 1) / p * b;
    case TERA_HW_ALLGATHER: return (double)(p - 1) / p * b;
    case TERA_HW_ALLTOALL: return (double)(p - 1) / p * b;
    default: return b;
    }
}

/* the slowest rank's median time of a call (every rank returns it) */
static double coll_time(coll_ctx *c) {
    double t[5];
    const int reps = c->n >= (1 << 20) ? 3 : 5;
    coll_call(c); /* warm-up */
    for (int i = 0; i < reps; i++) {
        tera_comm_barrier(c->w);
        const double t0 = tera_now();
        coll_call(c);
        float dt = (float)(tera_now() - t0);
        tera_comm_allreduce_max_f32(c->w, &dt, 1);
        t[i] = dt;
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_d);
    return t[reps / 2];
}

/* ZeRO's sum in host-shared memory (TERA_HW_SHARED_SUM): every rank's buffer of n floats is a part of
 * one block (as the backward leaves its gradients there, written just before: in cache as they would
 * be); each rank adds its 1/p share of all of them in rank order and writes it into every buffer
 * (tera_zero_shared_sum, ZeRO-0's form), after a flag says all buffers are written, before a flag says
 * all shares are. The slowest rank's median time of a call (every rank returns it); *k counts the calls. */
enum { SHS_GRD, SHS_SUMD, SHS_FLAGS };
static double shared_sum_time(tera_comm *w, tera_comm_shared *s, int64_t n, uint64_t *k) {
    const int p = tera_comm_size(w), me = tera_comm_rank(w);
    float *base = tera_comm_shared_mem(s), *mine = base + (int64_t)me * n;
    const int64_t lo = n * me / p, hi = n * (me + 1) / p;
    double t[5];
    const int reps = n >= (1 << 20) ? 3 : 5;
    for (int i = -1; i < reps; i++) { /* -1: the warm-up */
        for (int64_t j = 0; j < n; j++) mine[j] = (float)(j & 255);
        tera_comm_barrier(w);
        const double t0 = tera_now();
        tera_comm_shared_post(s, SHS_GRD, ++*k);
        tera_comm_shared_wait(s, SHS_GRD, *k, TERA_TRAFFIC_ALLREDUCE);
        tera_zero_shared_sum(base, n, p, NULL, lo, hi, -1);
        tera_comm_shared_post(s, SHS_SUMD, *k);
        tera_comm_shared_wait(s, SHS_SUMD, *k, TERA_TRAFFIC_ALLREDUCE);
        float dt = (float)(tera_now() - t0);
        tera_comm_allreduce_max_f32(w, &dt, 1);
        if (i >= 0) t[i] = dt;
    }
    qsort(t, (size_t)reps, sizeof t[0], cmp_d);
    return t[reps / 2];
}

static void measure_colls(tera_hw *hw, FILE *log) {
    tera_comm *w = tera_comm_world();
    const int p = tera_comm_size(w), me = tera_comm_rank(w);
    static const int64_t sizes[] = {1024, 16384, 131072, 524288, 2097152}; /* floats: 4 KiB .. 8 MiB */
    /* the shared sum's buffers up to 32 MiB a rank: a step's gradient buckets are tens of MiB, written
     * by a backward that streams its activations, so mostly no longer in the last-level cache */
    static const int64_t sh_sizes[] = {1024, 16384, 131072, 1048576, 8388608};
    const int ns = (int)(sizeof sizes / sizeof sizes[0]);
    const int64_t nmax = sizes[ns - 1], sh_max = sh_sizes[ns - 1];
    coll_ctx c = {.w = w, .buf = filled(nmax, 1.0f), .recv = filled(nmax, 0.0f),
                  .counts = tera_calloc((size_t)p, sizeof(int64_t)), .req = tera_calloc((size_t)(2 * p), sizeof(tera_comm_req))};
    /* the host-shared sum: a block of p buffers of the largest size (none where the ranks do not share
     * a host or the backend has no such blocks: the time model then prices the collectives) */
    tera_comm_shared *sh = tera_comm_shared_create(w, (int64_t)sizeof(float) * sh_max * p, SHS_FLAGS);
    uint64_t sh_calls = 0;
    for (int k = 0; k < TERA_HW_NCOLL; k++) {
        double x[8], y[8];
        if (k == TERA_HW_SHARED_SUM && !sh) continue;
        for (int i = 0; i < ns; i++) {
            c.kind = (tera_hw_coll_kind)k;
            c.n = (k == TERA_HW_SHARED_SUM ? sh_sizes[i] : sizes[i]) / p * p;
            for (int r = 0; r < p; r++) c.counts[r] = c.n / p;
            x[i] = k == TERA_HW_SHARED_SUM ? 8.0 * (double)c.n : coll_bytes(c.kind, p, c.n);
            y[i] = k == TERA_HW_SHARED_SUM ? shared_sum_time(w, sh, c.n, &sh_calls) : coll_time(&c);
            if (log && me == 0)
                fprintf(log, "  %s on %d ranks, %.0f bytes %s a rank: %.1f us\n", tera_hw_coll_name[k], p, x[i],
                        k == TERA_HW_SHARED_SUM ? "read and written" : "sent", y[i] * 1e6);
        }
        /* least squares y = a + x / beta */
        double sx = 0, sy = 0, sxx = 0, sxy = 0;
        for (int i = 0; i < ns; i++) sx += x[i], sy += y[i], sxx += x[i] * x[i], sxy += x[i] * y[i];
        double slope = (ns * sxy - sx * sy) / (ns * sxx - sx * sx), a = (sy - slope * sx) / ns;
        if (!(slope > 0)) slope = y[ns - 1] / x[ns - 1];
        if (!(a > 0)) a = y[0] > 0 ? y[0] : 1e-6; /* the smallest message's time: all latency */
        const tera_hw_coll f = {.kind = c.kind, .ranks = p, .alpha_s = a, .beta_bytes_s = 1.0 / slope};
        int at = -1;
        for (int i = 0; i < hw->n_coll && at < 0; i++)
            if (hw->coll[i].kind == f.kind && hw->coll[i].ranks == p) at = i;
        if (at < 0 && hw->n_coll < TERA_HW_MAX_COLL) at = hw->n_coll++;
        if (at >= 0) hw->coll[at] = f;
        if (log && me == 0)
            fprintf(log, "%s on %d ranks: latency %.1f us, %.3f GB/s\n", tera_hw_coll_name[k], p, a * 1e6, 1e-9 / slope);
        if (k == TERA_HW_P2P && p == 2) hw->intra_bw = hw->inter_bw = 1.0 / slope, hw->intra_lat = hw->inter_lat = a;
    }
    tera_comm_shared_free(sh);
    free(c.buf), free(c.recv), free(c.counts), free(c.req);
}

/* ------------------------------------------------------------------ ranks sharing the node */
/* One process's rate of a product (the layers' FFN shape: [B T, D] x [F, D]^T, forward + backward)
 * and of the streaming triad, measured by rank 0 alone (the others wait in a barrier, which sleeps:
 * include/tera/comm.h) and then by every rank at once, the same number of calls each: the fraction
 * each gets at once is (calls x work / the slowest rank's time) / the rate alone, the node's
 * throughput shared out (mpirun places the ranks, the OS the threads). Written as [shared] point =
 * RANKS THREADS COMPUTE MEMORY; the time model uses it for ranks computing at once on one node. */
typedef struct {
    tera_backend *be;
    gemm_ctx g;
    triad_ctx tr;
} share_ctx;

/* seconds for `reps` calls of fn */
static double run_reps(bench_fn fn, void *ctx, int reps) {
    const double t0 = tera_now();
    for (int i = 0; i < reps; i++) fn(ctx);
    return tera_now() - t0;
}

static void measure_shared(tera_hw *hw, const tera_config *cfg, int threads, FILE *log) {
    tera_comm *w = tera_comm_world();
    const int p = tera_comm_size(w), me = tera_comm_rank(w);
    const tera_model_config *m = &cfg->model;
    const int64_t M = (int64_t)cfg->training.micro_batch * cfg->training.seq_len, K = m->dim;
    const int64_t Nn = m->ffn_dim > 0 ? m->ffn_dim : m->dim;
    tera_backend *be = tera_backend_cpu_create(threads);
    gemm_ctx g = {.be = be, .m = M, .k = K, .n = Nn, .x = filled(M * K, 1.0f), .w = filled(Nn * K, 0.05f),
                  .y = filled(M * Nn, 0.0f), .dx = filled(M * K, 0.0f), .dw = filled(Nn * K, 0.0f),
                  .dy = filled(M * Nn, 0.01f)};
    triad_ctx t = {.n = (int64_t)8 << 20, .threads = threads};
    t.a = filled(t.n, 0.0f), t.b = filled(t.n, 1.0f), t.c = filled(t.n, 1.0f);
    const double gflop = 6.0 * (double)M * (double)K * (double)Nn, tbytes = 12.0 * (double)t.n;
    double frac[2];
    for (int k = 0; k < 2; k++) { /* 0: the product, 1: the triad */
        bench_fn fn = k ? triad_call : gemm_call_fp32;
        void *ctx = k ? (void *)&t : (void *)&g;
        /* three rounds of: rank 0 alone, after a warm-up, as many calls as take about 0.25 s (at least
         * 3); then every rank the same calls at once, the slowest rank's time. The median round's
         * fraction (the machine may be shared with other work: alone and together alternate) */
        double f[3], rate_alone = 0.0;
        for (int round = 0; round < 3; round++) {
            float alone = 0.0f, reps_f = 0.0f;
            tera_comm_barrier(w);
            if (me == 0) {
                fn(ctx);
                const double one = run_reps(fn, ctx, 1);
                int reps = one > 0 ? (int)(0.25 / one) : 3;
                if (reps < 3) reps = 3;
                if (reps > 200) reps = 200;
                alone = (float)(run_reps(fn, ctx, reps) / reps);
                reps_f = (float)reps;
            }
            tera_comm_barrier(w);
            tera_comm_allreduce_max_f32(w, &reps_f, 1);
            tera_comm_allreduce_max_f32(w, &alone, 1);
            fn(ctx);
            tera_comm_barrier(w);
            float dt = (float)run_reps(fn, ctx, (int)reps_f);
            tera_comm_allreduce_max_f32(w, &dt, 1);
            f[round] = dt > 0 ? (double)alone * reps_f / dt : 1.0;
            rate_alone += (k ? tbytes : gflop) / alone / 3.0;
        }
        qsort(f, 3, sizeof f[0], cmp_d);
        /* a rank computing beside others is never faster than alone: a median above 1 means the
         * alone rounds were slowed by other work on the machine (seen under a parallel ctest: rounds
         * 0.83 1.99 2.30). The point is written as 1 (no slowdown measured), with a note, so the file
         * always holds what its reader accepts: fractions in (0, 1.5] (plan_time.c) */
        const double measured = f[1];
        frac[k] = measured > 1.0 ? 1.0 : measured < 0.01 ? 0.01 : measured;
        if (log && me == 0) {
            fprintf(log, "shared: %d ranks x %d threads at once, %s: %.3f of the rate alone (rounds %.3f %.3f %.3f; "
                    "%.1f %s alone)\n", p, threads, k ? "memory (triad)" : "products", frac[k], f[0], f[1], f[2],
                    rate_alone / 1e9, k ? "GB/s" : "GFLOP/s");
            if (frac[k] != measured)
                fprintf(log, "shared: note: the median round measured %.3f, outside (0.01, 1]: the machine was busy "
                        "while rank 0 ran alone; written as %.3f, measure again on a quiet machine "
                        "(tera plan --calibrate --shared-only)\n", measured, frac[k]);
        }
    }
    int at = -1;
    for (int i = 0; i < hw->n_share && at < 0; i++)
        if (hw->share[i].ranks == p && hw->share[i].threads == threads) at = i;
    if (at < 0 && hw->n_share < TERA_HW_MAX_SHARE) at = hw->n_share++;
    if (at >= 0) hw->share[at] = (tera_hw_share){.ranks = p, .threads = threads, .compute = frac[0], .memory = frac[1]};
    free(g.x), free(g.w), free(g.y), free(g.dx), free(g.dw), free(g.dy);
    free(t.a), free(t.b), free(t.c);
    tera_backend_destroy(be);
}

/* ------------------------------------------------------------------ the whole */
static int divides_widths(const tera_model_config *m, int tp) {
    return m->n_heads % tp == 0 && m->n_kv_heads % tp == 0 && m->ffn_dim % tp == 0 && m->dense_ffn_dim % tp == 0 &&
           m->vocab_size % tp == 0;
}

static tera_status calibrate(const tera_config *cfg, const char *out, int shared_only, FILE *log);
tera_status tera_plan_calibrate(const tera_config *cfg, const char *out, FILE *log) { return calibrate(cfg, out, 0, log); }
tera_status tera_plan_calibrate_shared(const tera_config *cfg, const char *out, FILE *log) {
    if (tera_comm_size(tera_comm_world()) < 2)
        return tera_fail(TERA_ERR_ARG, "tera plan --calibrate --shared-only measures ranks sharing the node: run it "
                         "under mpirun with 2 or more ranks");
    return calibrate(cfg, out, 1, log);
}

static tera_status calibrate(const tera_config *cfg, const char *out, int shared_only, FILE *log) {
    tera_comm *world = tera_comm_world();
    const int p = tera_comm_size(world), me = tera_comm_rank(world);
    tera_hw hw;
    memset(&hw, 0, sizeof hw);
    memset(gemm_fresh, 0, sizeof gemm_fresh);
    memset(attn_fresh, 0, sizeof attn_fresh);
    g_n_steady = 0;
    const char *slow = getenv("TERA_CALIBRATE_SLOW_START_US");
    g_slow_start_us = slow ? atol(slow) : 0;
    if (g_slow_start_us < 0 || g_slow_start_us > 999999) g_slow_start_us = 0; /* usleep's range */
    int have = 0;
    if (me == 0 && access(out, F_OK) == 0) {
        TERA_TRY(tera_hw_load(&hw, out));
        have = 1;
    }
    if (!have) {
        const long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
        snprintf(hw.name, sizeof hw.name, "this machine (tera plan --calibrate)");
        hw.memory_bytes = pages > 0 && psize > 0 ? (double)pages * (double)psize : 1.0;
        hw.devices_per_node = 4096; /* every rank of a job here shares this machine */
        hw.cores = (int)sysconf(_SC_NPROCESSORS_ONLN); /* the machine's (mpirun binds a rank to fewer) */
        hw.intra_bw = hw.inter_bw = 1e9;     /* replaced by the 2-rank point-to-point fit */
        hw.intra_lat = hw.inter_lat = 1e-5;
    }
    if (p > 1) { /* the collectives, all ranks at once; what ranks computing at once get */
        if (!shared_only) measure_colls(&hw, log);
        measure_shared(&hw, cfg, cfg->training.threads > 0 ? cfg->training.threads : 1, log);
    } else {
        const tera_model_config *m = &cfg->model;
        const int threads = cfg->training.threads > 0 ? cfg->training.threads : omp_get_num_procs();
        tera_backend *be = tera_backend_cpu_create(threads);
        const tera_hw_prec prec = tera_hw_prec_of(cfg->training.precision);
        if (prec == TERA_HW_BF16)
            tera_backend_set_precision(be, TERA_PREC_BF16, be->caps.bf16_native(be) ? TERA_BF16_NATIVE : TERA_BF16_FMA);
        else if (prec == TERA_HW_FP16)
            tera_backend_set_precision(be, TERA_PREC_FP16, TERA_BF16_FMA);
        const int T = cfg->training.seq_len, hd = m->dim / m->n_heads;
        const int64_t D = m->dim, E = m->n_experts, K = m->top_k;
        if (log) fprintf(log, "tera plan --calibrate: %d threads, %s, T %d, micro-batches up to %d\n", threads,
                         tera_hw_prec_name[prec], T, cfg->training.micro_batch);
        /* the products and attention of every micro-batch size 1, 2, 4, ... and tp 1, 2, 4 */
        int bs[16], nb = 0;
        for (int b = 1; b < cfg->training.micro_batch && nb < 15; b *= 2) bs[nb++] = b;
        bs[nb++] = cfg->training.micro_batch;
        for (int tp = 1; tp <= 4; tp *= 2) {
            if (!divides_widths(m, tp)) continue;
            const int64_t Hl = m->n_heads / tp, Hkvl = m->n_kv_heads / tp, Fl = m->ffn_dim / tp;
            const int64_t Fsl = (int64_t)m->n_shared_experts * m->ffn_dim / tp, Fdl = m->dense_ffn_dim / tp;
            for (int i = 0; i < nb; i++) {
                const int64_t N = (int64_t)bs[i] * T;
                measure_gemm(&hw, be, threads, prec, N, D, Hl * hd, log);
                if (Hkvl != Hl) measure_gemm(&hw, be, threads, prec, N, D, Hkvl * hd, log);
                measure_gemm(&hw, be, threads, prec, N, Hl * hd, D, log);
                if (Fdl > 0 && m->first_k_dense > 0) {
                    measure_gemm(&hw, be, threads, prec, N, D, Fdl, log);
                    measure_gemm(&hw, be, threads, prec, N, Fdl, D, log);
                }
                if (Fsl > 0) {
                    measure_gemm(&hw, be, threads, prec, N, D, Fsl, log);
                    measure_gemm(&hw, be, threads, prec, N, Fsl, D, log);
                }
                for (int ep = 1; E > 0 && ep <= 8 && ep <= E; ep *= 2) {
                    if (E % ep) continue;
                    const int64_t r = (N * K * ep + E - 1) / E;
                    measure_gemm(&hw, be, threads, prec, r, D, Fl, log);
                    measure_gemm(&hw, be, threads, prec, r, Fl, D, log);
                }
                if (tp == 1 && E > 0) measure_gemm(&hw, be, threads, TERA_HW_FP32, N, D, E, log);
                measure_gemm(&hw, be, threads, prec, N, D, m->vocab_size / tp, log);
                measure_attn(&hw, be, threads, bs[i], T, (int)Hl, (int)Hkvl, hd, log);
            }
        }
        steady_check(be, log);
        /* the peak: a large square product, kept if higher */
        {
            const int64_t n = 1024;
            gemm_ctx g = {.be = be, .m = n, .k = n, .n = n, .x = filled(n * n, 1.0f), .w = filled(n * n, 0.05f),
                          .y = filled(n * n, 0.0f), .dx = filled(n * n, 0.0f), .dw = filled(n * n, 0.0f),
                          .dy = filled(n * n, 0.01f)};
            const double rate = 6.0 * (double)n * n * n / time_median(gemm_call_fp32, &g);
            if (rate > hw.peak_flops[TERA_HW_FP32]) hw.peak_flops[TERA_HW_FP32] = rate;
            if (hw.peak_flops[TERA_HW_BF16] < hw.peak_flops[TERA_HW_FP32]) hw.peak_flops[TERA_HW_BF16] = hw.peak_flops[TERA_HW_FP32];
            if (log) fprintf(log, "peak (fp32 1024^3, forward + backward): %.1f GFLOP/s\n", rate / 1e9);
            free(g.x), free(g.w), free(g.y), free(g.dx), free(g.dw), free(g.dy);
        }
        /* streaming bandwidth: a = b + s c over 3 x 32 MiB */
        {
            triad_ctx t = {.n = (int64_t)8 << 20, .threads = threads};
            t.a = filled(t.n, 0.0f), t.b = filled(t.n, 1.0f), t.c = filled(t.n, 1.0f);
            const double s = time_median(triad_call, &t);
            const double bw = 12.0 * (double)t.n / s;
            if (threads < (int)(sizeof hw.mem_bw_threads / sizeof hw.mem_bw_threads[0])) hw.mem_bw_threads[threads] = bw;
            if (bw > hw.mem_bw) hw.mem_bw = bw;
            if (log) fprintf(log, "memory bandwidth (triad, %d threads): %.2f GB/s\n", threads, bw / 1e9);
            free(t.a), free(t.b), free(t.c);
        }
        tera_backend_destroy(be);
    }
    if (me != 0) return TERA_OK;
    const char *note =
        "# This machine, measured by `tera plan --calibrate` (docs/PLAN.md): [gemm] and [attention] are the\n"
        "# compute backend's rates for the training shapes of the configurations it was run with; [memory]\n"
        "# a streaming triad; [collective] tera's comm layer under mpirun at each world size (ranks share\n"
        "# the cores; shared_sum: ZeRO's sum in host-shared memory, by bytes read and written a rank);\n"
        "# peak_tflops_fp32 the best forward + backward rate of a 1024^3 fp32 product.\n"
        "# memory_gib is the host's RAM. A shared machine: rates are medians, and vary with the load.\n";
    return tera_hw_write(&hw, out, note);
}
