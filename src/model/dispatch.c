/* The MoE token dispatcher: see dispatch.h. */
#include "dispatch.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"
#include "tera/backend.h"
#include "tera/comm_hier.h"
#include "tera/compress.h"
#include "tera/profile.h"

/* What the experts do with their rows: the forward, the backward, or (selective recomputation)
 * the hidden activations again; the backward also in two parts (tera_dispatch_experts_backward_dx
 * and _dw): the input gradients, then the weight gradients. */
enum { EXPERTS_FWD, EXPERTS_BWD, EXPERTS_HIDDEN, EXPERTS_BWD_DX, EXPERTS_BWD_DW };

/* An implementation: the steps that differ between local and all-to-all. */
typedef struct {
    const char *name;
    /* after the plan (permute): exchange what the peers need to know (all-to-all: the counts) */
    void (*exchange_counts)(tera_dispatcher *d, tera_dispatch_acts *t, int l);
    /* this rank's experts over the layer's rows (op: EXPERTS_*), moving them as needed */
    void (*experts)(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W, const tera_layer_view *G,
                    int l, int op);
} dispatch_impl;

enum { WIRE_OUT, WIRE_BACK };
typedef struct {
    int kind;     /* tera_compress_kind; 0: fp32, as they are */
    int64_t rowb; /* bytes of one encoded row, a multiple of 4 (sent as floats) */
} dwire;

struct tera_dispatcher {
    const dispatch_impl *impl;
    tera_backend *be;        /* the model's compute backend (not owned) */
    int B, T, E, K;          /* micro-batch shape, experts, experts per token */
    int64_t N, D, F;         /* tokens, width, this rank's expert hidden width */
    int capacity;            /* per sequence and expert; 0 = dropless */
    tera_drop_policy drop;   /* which assignments a full expert drops */
    int ep, me, El;          /* expert-parallel ranks, this rank, experts per rank (local: 1, 0, E) */
    tera_comm *group;        /* the expert-parallel group (NULL when local) */
    int overlap;             /* all-to-all: compute a block while later ones are in flight */
    int64_t R;               /* rows this rank's experts process per layer (tera_dispatch_rows) */
    /* scratch: one allocation, sized at creation */
    void *block;
    int64_t bytes;
    void *plan_scratch;      /* tera_moe_plan's */
    float *dxg, *dye;        /* [N*k, D] input and output gradients of the routed rows; all-to-all: dxg is
                                also the forward's rows sent (free during a layer's forward) */
    float *dyr, *dxr;        /* [R, D] all-to-all: received output gradients, input gradients sent back;
                                dxr is also the forward's results sent back */
    int *order;              /* [2E] experts by descending load (the upper half: the sort's) */
    uint8_t *dw_fresh;       /* [E] a weight-gradient call with dw_beta 0: this expert's gradients not yet
                                written (its first block with rows stores them; none: zeroed at the end) */
    int32_t *cnt;            /* [E] rows bound for each expert (the counts exchange) */
    int64_t *off;            /* [E+1] rows of each expert in the buffers the experts run over */
    float *da1, *da3, *dg;   /* [R, F] the backward's scratch of the call in progress (the caller's) */
    tera_comm_req *req;      /* [4 ep] in flight: sends, receives, returns sent, returns received */
    tera_comm_req *poll;     /* the caller's operation in flight, polled between experts (NULL: none) */
    /* How rows travel, per direction (WIRE_OUT: the rows to the experts, forward x and backward dy;
     * WIRE_BACK: their results, y and dx): parallel.a2a_compression encodes both (lossy); with bf16
     * products (par->a2a_rows_bf16) the rows out go as bf16, which loses nothing: every reader of them
     * is a product that rounds its operands to bf16 (round to nearest even) anyway. */
    dwire wire[2];
    int out_lossless;        /* wire[WIRE_OUT] is bf16 for that reason only: used while the backend's precision
                                is bf16 (the same on every rank), else the rows go as fp32 */
    uint8_t *c_in;           /* [N*k rows] this rank's results received back (WIRE_BACK); its rows sent (WIRE_OUT) are
                                coded into a buffer free at the time (coded_out) */
    uint8_t *c_recv, *c_res; /* [R rows] rows received for this rank's experts (WIRE_OUT) / their results sent (WIRE_BACK) */
    /* parallel.ep_hierarchical across nodes: the two-stage exchange (NULL: point-to-point) */
    tera_hier *hier;
    int64_t *hsc, *hrc;      /* [ep] bytes to / from each rank of one exchange */
    /* the caller's side work for the next experts call (tera_dispatch_side_work) */
    void (*side)(void *ctx);
    void *side_ctx;
    double side_s;           /* seconds it took in the call in progress (not the experts' profile row's),
                                and the yields' */
    void (*yield)(void *ctx); /* called between experts run one after another (tera_dispatch_set_yield) */
    void *yield_ctx;
    int64_t side_inflight;   /* side work run while rows travelled, since creation */
};

/* Runs the caller's side work, if any, once: inflight says whether rows of this exchange are travelling
 * meanwhile. Every experts call that moves rows runs it before its first block (the backward's side
 * work, the shared experts, uses the scratch the blocks write next). */
static void run_side(tera_dispatcher *d, int inflight) {
    if (!d->side) return;
    void (*fn)(void *) = d->side;
    d->side = NULL;
    const double t0 = tera_now();
    fn(d->side_ctx);
    d->side_s += tera_now() - t0;
    d->side_inflight += inflight;
}

/* Where this rank's rows out are coded (WIRE_OUT, [N*k rows] of at most 4 D bytes): a [N*k, D] fp32 buffer
 * nothing reads during the exchange: the forward the backward's dye, the backward the layer's ye (the
 * combine's backward, its last reader, ran before). */
static uint8_t *coded_out(const tera_dispatcher *d, const tera_dispatch_acts *t, int fwd) {
    return (uint8_t *)(void *)(fwd ? d->dye : t->ye);
}

/* Whether direction w's rows travel encoded in this exchange, and the bytes of one row as they travel. */
static int wire_on(const tera_dispatcher *d, int w) {
    if (w == WIRE_OUT && d->out_lossless) return d->be->precision == TERA_PREC_BF16;
    return d->wire[w].kind != 0;
}
static int64_t wire_rowb(const tera_dispatcher *d, int w) {
    return wire_on(d, w) ? d->wire[w].rowb : d->D * (int64_t)sizeof(float);
}

/* the encoded rows [r0, r0 + n) of x [rows, D] into buf's rows r0.. (one scale per row for fp8) */
static void rows_encode(const tera_dispatcher *d, int w, const float *x, int64_t r0, int64_t n, uint8_t *buf) {
    for (int64_t r = r0; r < r0 + n; r++)
        tera_compress_encode((tera_compress_kind)d->wire[w].kind, x + r * d->D, d->D, buf + r * d->wire[w].rowb, NULL);
}
static void rows_decode(const tera_dispatcher *d, int w, const uint8_t *buf, int64_t r0, int64_t n, float *x) {
    for (int64_t r = r0; r < r0 + n; r++)
        tera_compress_decode((tera_compress_kind)d->wire[w].kind, buf + r * d->wire[w].rowb, d->D, x + r * d->D);
}

/* ------------------------------------------------------------------------------ experts */

/* One call's experts: El experts over rows [off[e], off[e+1]) of these buffers. */
typedef struct {
    const tera_dispatcher *d;
    const float *x;          /* [R, D] input rows */
    float *y;                /* [R, D] outputs */
    float *a1, *a3, *g;      /* [R, F] hidden activations */
    const float *dy;         /* [R, D] output gradients (backward) */
    float *dx;               /* [R, D] input gradients (backward) */
    const int64_t *off;      /* [El+1] */
    const tera_layer_view *W, *G;
    const int *order;        /* side by side: the experts in the order they are handed out */
    int op;
} expert_rows;

/* SwiGLU hidden activations of x[n,D]: a1 = x w1^T, a3 = x w3^T, g = silu(a1) * a3 ([n,F]). */
static void expert_hidden(tera_backend *be, float *a1, float *a3, float *g, const float *x, const float *w1, const float *w3, int64_t n,
                          int64_t D, int64_t F) {
    float *const y[2] = {a1, a3};
    const float *const w[2] = {w1, w3};
    const int64_t out[2] = {F, F};
    tera_linear_forward_multi(be, 2, y, x, w, out, n, D); /* x converted once for both */
    tera_swiglu_forward_act(be, g, a1, a3, n * F); /* g: read by the w2 products only */
}

/* Expert e over its rows: y = w2(silu(x w1^T) * (x w3^T)) (forward), its backward (dx written,
 * weight gradients +=), or the hidden activations again. */
static void expert_run(const expert_rows *b, int e) {
    const tera_dispatcher *d = b->d;
    const int64_t D = d->D, F = d->F, r = b->off[e], n = b->off[e + 1] - r;
    if (n == 0) return;
    const float *w1 = b->W->w1 + e * F * D, *w3 = b->W->w3 + e * F * D, *w2 = b->W->w2 + e * D * F;
    float *a1 = b->a1 + r * F, *a3 = b->a3 + r * F, *g = b->g + r * F;
    const float *x = b->x + r * D;
    switch (b->op) {
    case EXPERTS_FWD:
        expert_hidden(d->be, a1, a3, g, x, w1, w3, n, D, F);
        tera_linear_forward_act(d->be, b->y + r * D, g, w2, n, F, D, 0.0f);
        break;
    case EXPERTS_BWD:
    case EXPERTS_BWD_DX:
    case EXPERTS_BWD_DW: { /* _DX: the products' input-gradient halves only, _DW: their weight-gradient halves */
        const int want_dx = b->op != EXPERTS_BWD_DW, want_dw = b->op != EXPERTS_BWD_DX;
        float *da1 = d->da1 + r * F, *da3 = d->da3 + r * F, *dg = d->dg + r * F;
        /* the first rows of expert e in a call that stores: its gradients are written, not added to */
        const float dw_beta = want_dw && d->dw_fresh[e] ? 0.0f : 1.0f;
        if (want_dw) d->dw_fresh[e] = 0;
        tera_linear_backward_act(d->be, want_dx ? dg : NULL, want_dw ? b->G->w2 + e * D * F : NULL, b->dy + r * D, g,
                                 w2, n, F, D, 0.0f, dw_beta);
        if (want_dx) d->be->ops.swiglu_backward(d->be, da1, da3, dg, a1, a3, n * F);
        float *const dw[2] = {want_dw ? b->G->w1 + e * F * D : NULL, want_dw ? b->G->w3 + e * F * D : NULL};
        const float *const dyi[2] = {da1, da3}, *const w[2] = {w1, w3};
        const int64_t out[2] = {F, F};
        tera_linear_backward_multi(d->be, 2, want_dx ? b->dx + r * D : NULL, dw, dyi, x, w, out, n, D, 0.0f,
                                   dw_beta); /* x converted once */
        break;
    }
    default:
        expert_hidden(d->be, a1, a3, g, x, w1, w3, n, D, F);
    }
}

static void expert_item(void *ctx, int i) {
    const expert_rows *b = ctx;
    expert_run(b, b->order[i]);
}

/* Expert indices by descending row count (largest first balances the dynamic schedule); ties keep
 * index order. A merge sort through the upper half of order[2E]: O(E log E), no allocation. */
static void experts_by_load(int *order, const int64_t *off, int E) {
    int *src = order, *dst = order + E;
    for (int e = 0; e < E; e++) src[e] = e;
#define LOAD(x) (off[(x) + 1] - off[(x)])
    for (int w = 1; w < E; w *= 2) {
        for (int lo = 0; lo < E; lo += 2 * w) {
            const int mid = lo + w < E ? lo + w : E, hi = lo + 2 * w < E ? lo + 2 * w : E;
            int i = lo, j = mid, o = lo;
            while (i < mid && j < hi) dst[o++] = LOAD(src[j]) > LOAD(src[i]) ? src[j++] : src[i++];
            while (i < mid) dst[o++] = src[i++];
            while (j < hi) dst[o++] = src[j++];
        }
        int *t = src;
        src = dst, dst = t;
    }
#undef LOAD
    if (src != order) memcpy(order, src, sizeof(int) * (size_t)E);
}

/* The caller's yield between two experts, its time taken out of the experts' profile row. */
static void yield_between(tera_dispatcher *d) {
    if (!d->yield) return;
    const double t0 = tera_now();
    d->yield(d->yield_ctx);
    d->side_s += tera_now() - t0;
}

/* All El experts of one call. One after another, each product on every thread, when there are fewer
 * than two experts per thread (ops.items_side_by_side: always on one thread); else side by side by
 * descending load (each expert's products single-threaded on the thread that takes it,
 * ops.for_each_item), except the experts with more rows than a thread's share (rows x threads > all
 * rows), which run first, one after another, each product on every thread: side by side the other
 * threads would wait for them (k = 1, or many threads: bench-m's routing gives one expert half the
 * rows, so 3 threads ran at 2/3 and 4 at 1/2 of their rate). A product gives the same numbers alone
 * on every thread and single-threaded beside others (fp32: sgemm tiles that depend on the shape
 * alone, src/kernels/cpu/matmul.c; bf16: oneDNN's bf16 GEMM), so the layout is a scheduling decision
 * only (tests/test_experts_layout.c, tests/test_dispatch.c). */
static void experts_run(tera_dispatcher *d, expert_rows *b) {
    const int El = d->El;
    if (!d->be->ops.items_side_by_side(d->be, El)) {
        for (int e = 0; e < El; e++) {
            expert_run(b, e);
            if (d->poll) tera_comm_poll(d->poll, 1);
            yield_between(d);
        }
        return;
    }
    experts_by_load(d->order, b->off, El);
    const int64_t all = b->off[El] - b->off[0], threads = d->be->ops.max_threads(d->be);
    /* TERA_EXPERTS_ALONE=0: every expert side by side (the layout before; bench/bench_experts.c's A/B
     * sets it rep by rep, so it is read on every call; the same numbers either way) */
    const char *ab = getenv("TERA_EXPERTS_ALONE");
    const int side_by_side_only = ab && !strcmp(ab, "0");
    int alone = 0; /* the experts by descending load: the ones that run alone are a prefix */
    while (!side_by_side_only && alone < El && (b->off[d->order[alone] + 1] - b->off[d->order[alone]]) * threads > all) {
        expert_run(b, d->order[alone++]);
        if (d->poll) tera_comm_poll(d->poll, 1);
        yield_between(d);
    }
    if (alone == El) return;
    b->order = d->order + alone;
    d->be->ops.for_each_item(d->be, El - alone, expert_item, b);
}

/* ------------------------------------------------------------------------------ local */

static void local_counts(tera_dispatcher *d, tera_dispatch_acts *t, int l) {}

static void local_experts(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                          const tera_layer_view *G, int l, int op) {
    run_side(d, 0); /* nothing travels */
    for (int e = 0; e <= d->E; e++) d->off[e] = t->exp_off[e];
    expert_rows b = {.d = d, .x = t->xg, .y = t->ye, .a1 = t->a1, .a3 = t->a3, .g = t->gact, .dy = d->dye,
                     .dx = d->dxg, .off = d->off, .W = W, .G = G, .op = op};
    experts_run(d, &b);
}

static const dispatch_impl local_impl = {"local", local_counts, local_experts};

/* ------------------------------------------------------------------------------ all-to-all
 * After routing, this rank's assignments are grouped by expert (exp_off), so the rows bound for
 * rank s are one contiguous block. Each rank sends each peer its block, receives the peers' rows for
 * its own experts (xr, one block per source, grouped by expert), runs its experts over each
 * source's block, and sends the outputs back into ye, where the combine finds them exactly as with
 * local experts. Backward does the same with the output gradients (dye -> dyr) and the input
 * gradients (dxr -> dxg). Blocks are computed in a fixed order (own block first, then the next
 * ranks in ring order), so results do not depend on arrival times; with overlap on, a block is
 * computed as soon as it has arrived while later blocks are still in flight, and each result block
 * is sent back at once. */
enum { EP_TAG_X, EP_TAG_Y, EP_TAG_DY, EP_TAG_DX };
static int ep_tag(int l, int what) { return 4 * l + what; }

/* Counts first: how many rows each source sends for each of this rank's experts (rcnt, roff). */
static void a2a_counts(tera_dispatcher *d, tera_dispatch_acts *t, int l) {
    const int ep = d->ep, El = d->El;
    int32_t *cnt = d->cnt;
    for (int e = 0; e < d->E; e++) cnt[e] = t->exp_off[e + 1] - t->exp_off[e];
    tera_comm_alltoall_i32(d->group, cnt, t->rcnt, El);
    t->roff[0] = 0;
    for (int s = 0; s < ep; s++) {
        int64_t n = 0;
        for (int e = 0; e < El; e++) n += t->rcnt[s * El + e];
        t->roff[s + 1] = t->roff[s] + (int32_t)n;
    }
    TERA_ASSERTF(t->roff[ep] <= d->R, "layer %d: %d rows received for %d experts, buffers hold %ld", l, t->roff[ep],
                 El, (long)d->R);
}

/* This rank's experts over source s's block of the received buffers. */
static void a2a_block(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W, const tera_layer_view *G,
                      int s, int op) {
    const int El = d->El;
    int64_t *off = d->off;
    off[0] = t->roff[s];
    for (int e = 0; e < El; e++) off[e + 1] = off[e] + t->rcnt[s * El + e];
    expert_rows b = {.d = d, .x = t->xr, .y = d->dxr, .a1 = t->a1, .a3 = t->a3, .g = t->gact,
                     .dy = d->dyr, .dx = d->dxr, .off = off, .W = W, .G = G, .op = op}; /* y: forward, dx: backward */
    experts_run(d, &b);
}

/* The two-stage node-aware exchange (parallel.ep_hierarchical): for every rank s, rows
 * [o[s], o[s+1]) of src go to rank s, and rank s's rows for this rank arrive at [q[s], q[s+1]) of
 * dst (o, q: row offsets by rank, every `stride`-th entry). Both layouts are consecutive by rank, so
 * they are the all-to-all's buffers as they are; this rank's own block travels too (a copy, no
 * transfer). Encoded rows (a2a_compression) go through the coded buffers cs -> cr, and only the
 * other ranks' blocks are encoded and decoded: the caller copies its own rows uncoded, as the
 * point-to-point path does, so the result is that path's bit for bit. */
static void hier_move(tera_dispatcher *d, int w, const float *src, const int32_t *o, int ostride, float *dst,
                      const int32_t *q, int qstride, uint8_t *cs, uint8_t *cr, int split) {
    const int ep = d->ep, me = d->me, coded = wire_on(d, w);
    const int64_t rb = wire_rowb(d, w);
    for (int s = 0; s < ep; s++) {
        const int64_t s0 = o[s * ostride], ns = o[(s + 1) * ostride] - s0;
        d->hsc[s] = ns * rb;
        d->hrc[s] = (int64_t)(q[(s + 1) * qstride] - q[s * qstride]) * rb;
        if (coded && s != me && ns > 0) rows_encode(d, w, src, s0, ns, cs);
    }
    const uint8_t *sb = coded ? cs : (const uint8_t *)(const void *)src;
    uint8_t *rbuf = coded ? cr : (uint8_t *)(void *)dst;
    if (split) { /* started only: the caller waits for each source (hier_wait_rows) */
        tera_hier_ialltoallv_start(d->hier, sb + o[0] * rb, d->hsc, rbuf + q[0] * rb, d->hrc);
        return;
    }
    tera_hier_alltoallv_u8(d->hier, sb + o[0] * rb, d->hsc, rbuf + q[0] * rb, d->hrc);
    if (coded)
        for (int s = 0; s < ep; s++) {
            const int64_t r0 = q[s * qstride], nr = q[(s + 1) * qstride] - r0;
            if (s != me && nr > 0) rows_decode(d, w, cr, r0, nr, dst);
        }
}

/* after a split hier_move of the rows out (into dst at row offsets q): source s's rows in dst, decoded */
static void hier_wait_rows(tera_dispatcher *d, int s, float *dst, const int32_t *q, const uint8_t *cr) {
    tera_hier_ialltoallv_wait(d->hier, s);
    const int64_t r0 = q[s], nr = q[s + 1] - r0;
    if (wire_on(d, WIRE_OUT) && nr > 0) rows_decode(d, WIRE_OUT, cr, r0, nr, dst);
}

/* The layer's exchange in two node-aware stages: every rank's rows out, the experts over every
 * source's block, the results back (in two stages too, once every block is done).
 * Without parallel.ep_overlap the rows out are one blocking exchange, then every block runs in the
 * point-to-point path's order (this rank first, then the ring). With it the exchange is split
 * (tera_hier_ialltoallv_*) and the experts run on the blocks already here while the rest is in
 * flight: this rank's own rows during stage 1 (inside the node), the blocks of this node's ranks
 * during stage 2 (across the nodes). The backward keeps the ring order (each block's weight
 * gradients are added to G in that order: another order would round differently), so it only runs
 * ahead while the ring's next source is on this node; the forward's blocks are independent (each
 * writes its own rows), so it runs this node's blocks first, then the other nodes' as they come.
 * Every block sees the same rows and the same G as without overlap: the same bits. */
static void hier_experts(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                         const tera_layer_view *G, int op) {
    const int ep = d->ep, me = d->me, El = d->El;
    const int fwd = op == EXPERTS_FWD;
    const int64_t D = d->D;
    float *out_local = fwd ? d->dxg : d->dye, *in_local = fwd ? t->ye : d->dxg;
    float *recv = fwd ? t->xr : d->dyr, *res = d->dxr; /* the forward's rows sent and results: scratch */
    const int64_t m0 = t->exp_off[me * El], m1 = t->exp_off[(me + 1) * El];
    if (!d->overlap) run_side(d, 0);
    hier_move(d, WIRE_OUT, out_local, t->exp_off, El, recv, t->roff, 1, coded_out(d, t, fwd), d->c_recv, d->overlap);
    memcpy(recv + (int64_t)t->roff[me] * D, out_local + m0 * D, sizeof(float) * (size_t)((m1 - m0) * D));
    run_side(d, 1); /* parallel.ep_overlap: while the rows out are in flight */
    if (!d->overlap) {
        for (int i = 0; i < ep; i++) a2a_block(d, t, W, G, (me + i) % ep, op);
    } else {
        /* forward: pass 0 this node's sources, pass 1 the others; backward: one pass, ring order */
        for (int pass = 0; pass < (fwd ? 2 : 1); pass++)
            for (int i = 0; i < ep; i++) {
                const int s = (me + i) % ep;
                if (fwd && tera_hier_same_node(d->hier, s) != (pass == 0)) continue;
                if (s != me) hier_wait_rows(d, s, recv, t->roff, d->c_recv);
                a2a_block(d, t, W, G, s, op);
                tera_hier_ialltoallv_poll(d->hier);
            }
        tera_hier_ialltoallv_end(d->hier);
    }
    hier_move(d, WIRE_BACK, res, t->roff, 1, in_local, t->exp_off, El, d->c_res, d->c_in, 0);
    memcpy(in_local + m0 * D, res + (int64_t)t->roff[me] * D, sizeof(float) * (size_t)((m1 - m0) * D));
}

/* The exchange of one layer, forward (the rows sent -> xr, experts, their results -> ye), backward (dye ->
 * dyr, expert backward, dxr -> dxg), or the hidden activations again from the kept xr (no exchange).
 * The forward's rows sent and results sent back are read by nothing after it (the backward runs on the
 * kept xr and ye): they live in the backward's scratch dxg and dxr, not in the layer's activations. */
static void a2a_experts(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                        const tera_layer_view *G, int l, int op) {
    const int ep = d->ep, me = d->me, El = d->El;
    if (op == EXPERTS_HIDDEN || op == EXPERTS_BWD_DW) { /* over the kept rows: no exchange */
        run_side(d, 0);
        for (int i = 0; i < ep; i++) a2a_block(d, t, W, G, (me + i) % ep, op);
        return;
    }
    if (d->hier) {
        hier_experts(d, t, W, G, op);
        return;
    }
    tera_comm *g = d->group;
    const int fwd = op == EXPERTS_FWD;
    const int64_t D = d->D;
    tera_comm_req *snd = d->req, *rcv = d->req + ep, *rsnd = d->req + 2 * ep, *rrcv = d->req + 3 * ep;
    float *out_local = fwd ? d->dxg : d->dye; /* [N*k, D] this rank's rows, grouped by expert (scratch) */
    float *in_local = fwd ? t->ye : d->dxg;   /* [N*k, D] where their results come back */
    float *recv = fwd ? t->xr : d->dyr;       /* [R, D] rows for this rank's experts */
    float *res = d->dxr;                      /* [R, D] their results (scratch) */
    const int tag_out = ep_tag(l, fwd ? EP_TAG_X : EP_TAG_DY), tag_back = ep_tag(l, fwd ? EP_TAG_Y : EP_TAG_DX);
    /* encoded rows (per direction, wire_on): through the coded buffers, decoded as they arrive */
    const int c_out = wire_on(d, WIRE_OUT), c_back = wire_on(d, WIRE_BACK);
    uint8_t *cs = coded_out(d, t, fwd);
    const int64_t fo = d->wire[WIRE_OUT].rowb / 4, fb = d->wire[WIRE_BACK].rowb / 4; /* floats per encoded row */
    if (!d->overlap) run_side(d, 0);
    for (int s = 0; s < ep; s++) {
        if (s == me) continue;
        const int64_t o0 = t->exp_off[s * El], o1 = t->exp_off[(s + 1) * El];
        const int64_t nr = t->roff[s + 1] - t->roff[s];
        if (c_out)
            tera_comm_irecv_f32(g, (float *)(void *)(d->c_recv + (int64_t)t->roff[s] * d->wire[WIRE_OUT].rowb), nr * fo,
                                s, tag_out, &rcv[s]);
        else
            tera_comm_irecv_f32(g, recv + (int64_t)t->roff[s] * D, nr * D, s, tag_out, &rcv[s]);
        if (c_back)
            tera_comm_irecv_f32(g, (float *)(void *)(d->c_in + o0 * d->wire[WIRE_BACK].rowb), (o1 - o0) * fb, s,
                                tag_back, &rrcv[s]);
        else
            tera_comm_irecv_f32(g, in_local + o0 * D, (o1 - o0) * D, s, tag_back, &rrcv[s]);
        if (c_out) {
            rows_encode(d, WIRE_OUT, out_local, o0, o1 - o0, cs);
            tera_comm_isend_f32(g, (const float *)(const void *)(cs + o0 * d->wire[WIRE_OUT].rowb),
                                (o1 - o0) * fo, s, tag_out, &snd[s]);
        } else {
            tera_comm_isend_f32(g, out_local + o0 * D, (o1 - o0) * D, s, tag_out, &snd[s]);
        }
    }
    const int64_t m0 = t->exp_off[me * El], m1 = t->exp_off[(me + 1) * El];
    memcpy(recv + (int64_t)t->roff[me] * D, out_local + m0 * D, sizeof(float) * (size_t)((m1 - m0) * D));
    run_side(d, 1); /* parallel.ep_overlap: while the rows out are in flight */
    if (!d->overlap)
        for (int s = 0; s < ep; s++) tera_comm_wait(&rcv[s]);
    for (int i = 0; i < ep; i++) {
        const int s = (me + i) % ep;
        tera_comm_wait(&rcv[s]);
        const int64_t r0 = t->roff[s], n = t->roff[s + 1] - r0;
        if (c_out && s != me) rows_decode(d, WIRE_OUT, d->c_recv, r0, n, recv);
        a2a_block(d, t, W, G, s, op);
        if (s == me) {
            memcpy(in_local + m0 * D, res + r0 * D, sizeof(float) * (size_t)(n * D));
        } else if (c_back) {
            rows_encode(d, WIRE_BACK, res, r0, n, d->c_res);
            tera_comm_isend_f32(g, (const float *)(const void *)(d->c_res + r0 * d->wire[WIRE_BACK].rowb), n * fb, s,
                                tag_back, &rsnd[s]);
        } else {
            tera_comm_isend_f32(g, res + r0 * D, n * D, s, tag_back, &rsnd[s]);
        }
        if (d->overlap) tera_comm_poll(d->req, 4 * ep); /* progress the other transfers */
    }
    for (int s = 0; s < ep; s++) {
        tera_comm_wait(&snd[s]);
        tera_comm_wait(&rrcv[s]);
        tera_comm_wait(&rsnd[s]);
        if (c_back && s != me) {
            const int64_t o0 = t->exp_off[s * El], o1 = t->exp_off[(s + 1) * El];
            rows_decode(d, WIRE_BACK, d->c_in, o0, o1 - o0, in_local);
        }
    }
}

static const dispatch_impl a2a_impl = {"all-to-all", a2a_counts, a2a_experts};

/* ------------------------------------------------------------------------------ interface */

/* Rows the experts of one rank can receive in one layer: from each of the ep sources, at most
 * min(k, El) assignments per token (a token's k experts are distinct), and with a capacity at
 * most capacity per sequence for each of the El experts. (Also the planner's, src/parallel/plan_mem.c.) */
int64_t tera_dispatch_rows_max(const tera_model_config *c, int B, int T, int ep) {
    const int64_t N = (int64_t)B * T, El = c->n_experts / ep;
    int64_t per_src = N * (c->top_k < El ? c->top_k : El);
    if (c->capacity_factor > 0.0f) {
        const int64_t cap = (int64_t)ceil((double)c->capacity_factor * T * c->top_k / c->n_experts);
        if (El * B * cap < per_src) per_src = El * B * cap;
    }
    return (int64_t)ep * per_src;
}

/* Pass 1 (base NULL) counts bytes, pass 2 assigns pointers into one block; 64-byte granules. */
static void *take(char *base, int64_t *off, size_t bytes) {
    void *p = base ? base + *off : NULL;
    *off += (int64_t)((bytes + 63) & ~(size_t)63);
    return p;
}

static void carve_scratch(tera_dispatcher *d, char *base) {
    const int64_t NK = d->N * d->K, E = d->E;
    int64_t off = 0;
    d->plan_scratch = take(base, &off, tera_moe_plan_scratch_bytes(NK, d->B, d->E));
    d->dxg = take(base, &off, sizeof(float) * (size_t)(NK * d->D));
    d->dye = take(base, &off, sizeof(float) * (size_t)(NK * d->D));
    if (d->ep > 1) {
        d->dyr = take(base, &off, sizeof(float) * (size_t)(d->R * d->D));
        d->dxr = take(base, &off, sizeof(float) * (size_t)(d->R * d->D));
    }
    if (d->wire[WIRE_OUT].kind) {
        d->c_recv = take(base, &off, (size_t)(d->R * d->wire[WIRE_OUT].rowb));
    }
    if (d->wire[WIRE_BACK].kind) {
        d->c_in = take(base, &off, (size_t)(NK * d->wire[WIRE_BACK].rowb));
        d->c_res = take(base, &off, (size_t)(d->R * d->wire[WIRE_BACK].rowb));
    }
    if (d->hier) {
        d->hsc = take(base, &off, sizeof(int64_t) * (size_t)d->ep);
        d->hrc = take(base, &off, sizeof(int64_t) * (size_t)d->ep);
    }
    d->order = take(base, &off, sizeof(int) * 2 * (size_t)E);
    d->dw_fresh = take(base, &off, (size_t)E);
    d->cnt = take(base, &off, sizeof(int32_t) * (size_t)E);
    d->off = take(base, &off, sizeof(int64_t) * (size_t)(E + 1));
    d->bytes = off;
}

/* the sizes of a dispatcher (sizing: no scratch block, no requests, no group) */
static tera_dispatcher *dispatch_new(const tera_model_config *c, int B, int T, int64_t F, const tera_model_par *par,
                                     int ep_rank, int sizing) {
    tera_dispatcher *d = tera_calloc(1, sizeof *d);
    TERA_ASSERTF(sizing || (par && par->be), "the token dispatcher runs on the model's backend");
    d->be = par ? par->be : NULL;
    const int ep = par && par->ep > 1 ? par->ep : 1;
    d->B = B, d->T = T, d->E = c->n_experts, d->K = c->top_k;
    d->N = (int64_t)B * T, d->D = c->dim, d->F = F;
    d->capacity = c->capacity_factor > 0.0f ? (int)ceil((double)c->capacity_factor * T * d->K / d->E) : 0;
    d->drop = c->drop_policy;
    d->ep = ep, d->me = ep > 1 ? ep_rank : 0, d->El = d->E / ep;
    if (ep > 1) {
        d->impl = &a2a_impl;
        d->group = par->group;
        d->overlap = par->overlap;
        const int cq = par->a2a_compression > 0 ? par->a2a_compression : 0;
        d->out_lossless = !cq && par->a2a_rows_bf16;
        for (int w = 0; w < 2; w++) {
            d->wire[w].kind = tera_exchange_wire_kind(cq, par->a2a_rows_bf16, w);
            d->wire[w].rowb = tera_exchange_row_bytes(d->wire[w].kind, d->D);
        }
        d->R = tera_dispatch_rows_max(c, B, T, ep);
        if (!sizing) d->req = tera_calloc((size_t)(4 * ep), sizeof(tera_comm_req));
        if (!sizing && par->hierarchical) { /* NULL when the group is on one node (or uneven): point-to-point */
            d->hier = tera_hier_create(d->group, 0);
            int nodes, k;
            tera_hier_shape(d->hier, &nodes, &k);
            /* relayed at most: every local peer's rows for this rail; received: R rows */
            /* the most a row takes: fp32 unless a2a_compression codes both directions (the lossless rows
             * out go as fp32 while the products are not bf16, and the results as fp32 always) */
            const int64_t rb = tera_exchange_row_bytes(cq, d->D);
            const int64_t rows = d->N * d->K > d->R ? d->N * d->K : d->R;
            if (d->hier) tera_hier_reserve_alltoall(d->hier, (int64_t)k * rows * rb);
        }
    } else {
        d->impl = &local_impl;
        d->R = d->N * d->K;
    }
    carve_scratch(d, NULL);
    if (sizing) return d;
    d->block = tera_malloc((size_t)d->bytes);
    memset(d->block, 0, (size_t)d->bytes);
    carve_scratch(d, d->block);
    return d;
}

tera_dispatcher *tera_dispatch_create(const tera_model_config *c, int B, int T, int64_t F, const tera_model_par *par,
                                      int ep_rank) {
    return dispatch_new(c, B, T, F, par, ep_rank, 0);
}

tera_dispatcher *tera_dispatch_create_sizes(const tera_model_config *c, int B, int T, int64_t F, const tera_model_par *par) {
    return dispatch_new(c, B, T, F, par, 0, 1);
}

void tera_dispatch_destroy(tera_dispatcher *d) {
    if (!d) return;
    free(d->block);
    free(d->req);
    tera_hier_free(d->hier);
    free(d);
}

const char *tera_dispatch_name(const tera_dispatcher *d) { return d->impl->name; }
int64_t tera_dispatch_rows(const tera_dispatcher *d) { return d->R; }
int64_t tera_dispatch_bytes(const tera_dispatcher *d) { return d->bytes; }
int tera_exchange_wire_kind(int a2a_compression, int rows_bf16, int back) {
    if (a2a_compression > 0) return a2a_compression;
    return !back && rows_bf16 ? TERA_COMPRESS_BF16 : 0;
}
int64_t tera_exchange_row_bytes(int kind, int64_t D) {
    return kind ? (tera_compress_bytes((tera_compress_kind)kind, D) + 3) & ~(int64_t)3 : 4 * D;
}
int64_t tera_dispatch_row_bytes(const tera_dispatcher *d, int back) {
    return d->ep > 1 ? wire_rowb(d, back ? WIRE_BACK : WIRE_OUT) : 4 * d->D;
}
void tera_dispatch_exchange_sizes(const tera_dispatcher *d, tera_dispatch_sizes *s) {
    const int a2a = d->ep > 1;
    *s = (tera_dispatch_sizes){.counts = a2a ? d->E : 0, .offsets = a2a ? d->ep + 1 : 0, .rows = a2a ? d->R : 0};
}
int64_t tera_dispatch_comm_bytes(const tera_dispatcher *d) {
    int64_t coded = 0;
    for (int w = 0; w < 2; w++) /* the rows out's own coded copy lives in dye or ye (coded_out) */
        coded += (w == WIRE_BACK ? d->N * d->K + d->R : d->R) * (d->wire[w].kind ? d->wire[w].rowb : 0);
    return d->ep > 1 ? 2 * d->R * d->D * (int64_t)sizeof(float) + coded : 0;
}

int64_t tera_dispatch_permute(tera_dispatcher *d, tera_dispatch_acts *t, const float *x, const int32_t *topi,
                              const float *probs, int l) {
    TERA_PROF_BEGIN(DISPATCH);
    const int64_t dropped = tera_moe_plan(d->be, t->slot_row, t->row_tok, t->exp_off, t->sel_count, d->plan_scratch, topi,
                                          probs, d->B, d->T, d->E, d->K, d->capacity, d->drop);
    /* all-to-all: the rows sent, in scratch (a2a_experts); local: kept for the experts' backward */
    d->be->ops.moe_gather_forward(d->be, d->ep > 1 ? d->dxg : t->xg, x, t->row_tok, t->exp_off[d->E], d->D);
    d->impl->exchange_counts(d, t, l);
    TERA_PROF_END(DISPATCH);
    return dropped;
}

/* One experts call timed in the profile's row op, less the side work it ran (timed in its own rows). */
static void experts_call(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W, const tera_layer_view *G,
                         int l, int op, int prof) {
    const double t0 = tera_now();
    d->side_s = 0.0;
    d->impl->experts(d, t, W, G, l, op);
    TERA_ASSERTF(!d->side, "the dispatcher's side work was not run");
    tera_prof_add(prof, t0);
    tera_prof_seconds[prof] -= d->side_s;
}

void tera_dispatch_side_work(tera_dispatcher *d, void (*fn)(void *ctx), void *ctx) {
    TERA_ASSERTF(!d->side, "the dispatcher's side work set twice");
    d->side = fn;
    d->side_ctx = ctx;
}

int64_t tera_dispatch_side_inflight(const tera_dispatcher *d) { return d->side_inflight; }

void tera_dispatch_set_yield(tera_dispatcher *d, void (*fn)(void *ctx), void *ctx) {
    d->yield = fn;
    d->yield_ctx = ctx;
}

void tera_dispatch_experts_forward(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W, int l) {
    experts_call(d, t, W, NULL, l, EXPERTS_FWD, TERA_PROF_EXPERT_FWD);
}

void tera_dispatch_combine_forward(tera_dispatcher *d, float *out, const tera_dispatch_acts *t, const float *topw) {
    TERA_PROF(COMBINE_FWD, d->be->ops.moe_combine_forward(d->be, out, t->ye, topw, t->slot_row, d->N, d->K, d->D));
}

void tera_dispatch_experts_recompute(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W) {
    experts_call(d, t, W, NULL, -1, EXPERTS_HIDDEN, TERA_PROF_EXPERT_FWD);
}

void tera_dispatch_combine_backward(tera_dispatcher *d, float *dtopw, const float *dy, const tera_dispatch_acts *t,
                                    const float *topw) {
    TERA_PROF(COMBINE_BWD, d->be->ops.moe_combine_backward(d->be, d->dye, dtopw, dy, t->ye, topw, t->slot_row, d->N, d->K, d->D));
}

/* Before a call that writes the weight gradients: with dw_beta 0 every local expert is fresh (see
 * dw_fresh), and so is one marked absent (no value yet: tera_model_grads_sparse); after it, the
 * experts still fresh are zeroed, or marked where the caller keeps marks. */
static void dw_fresh_begin(tera_dispatcher *d, float dw_beta, const uint8_t *absent) {
    memset(d->dw_fresh, dw_beta == 0.0f, (size_t)d->El);
    if (absent)
        for (int e = 0; e < d->El; e++) d->dw_fresh[e] |= absent[e];
}
/* The zeroing of dw_fresh_end: the three gradients of the experts no rows reached, in blocks of
 * ZERO_BLOCK floats shared out among the threads (bench-m's collapsed routing leaves 14 of 16
 * experts without rows in most layers: 6 MiB each to clear, which one thread did while the others
 * waited). The experts to clear are order[0, nz) (the dispatcher's scratch, free at this point). */
#define ZERO_BLOCK ((int64_t)1 << 16)
typedef struct {
    const tera_dispatcher *d;
    const tera_layer_view *G;
    int64_t per; /* blocks per tensor */
} zero_grads;

static void zero_grads_range(void *ctx, int64_t lo, int64_t hi, int worker) {
    (void)worker;
    const zero_grads *z = ctx;
    const int64_t DF = z->d->D * z->d->F;
    for (int64_t i = lo; i < hi; i++) {
        const int64_t b = i % z->per, t = (i / z->per) % 3, e = z->d->order[i / z->per / 3];
        float *g = (t == 0 ? z->G->w1 : t == 1 ? z->G->w3 : z->G->w2) + e * DF + b * ZERO_BLOCK;
        const int64_t n = DF - b * ZERO_BLOCK < ZERO_BLOCK ? DF - b * ZERO_BLOCK : ZERO_BLOCK;
        tera_zero_stream(g, sizeof(float) * (size_t)n); /* read next by the optimizer: around the caches */
    }
}

static void dw_fresh_end(tera_dispatcher *d, const tera_layer_view *G, uint8_t *absent) {
    int nz = 0;
    for (int e = 0; e < d->El; e++) {
        if (absent) absent[e] = d->dw_fresh[e]; /* marked: nothing written, read as zero */
        else if (d->dw_fresh[e]) d->order[nz++] = e;
        d->dw_fresh[e] = 0;
    }
    if (nz == 0) return;
    zero_grads z = {.d = d, .G = G, .per = (d->D * d->F + ZERO_BLOCK - 1) / ZERO_BLOCK};
    d->be->ops.for_ranges(d->be, (int64_t)nz * 3 * z.per, zero_grads_range, &z);
}

void tera_dispatch_experts_backward(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                                    const tera_layer_view *G, int l, float *da1, float *da3, float *dg, float dw_beta,
                                    uint8_t *absent) {
    d->da1 = da1, d->da3 = da3, d->dg = dg;
    dw_fresh_begin(d, dw_beta, absent);
    experts_call(d, t, W, G, l, EXPERTS_BWD, TERA_PROF_EXPERT_BWD);
    dw_fresh_end(d, G, absent);
    d->da1 = d->da3 = d->dg = NULL;
}

/* Block by block, in ring order as the exchange's backward adds them (the DW phase of a split
 * backward runs the same blocks in the same order: every G sum rounds as in one pass). */
static void experts_backward_op(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                                const tera_layer_view *G, int l, float *da1, float *da3, float *dg,
                                tera_comm_req *poll, int op, float dw_beta, uint8_t *absent) {
    d->da1 = da1, d->da3 = da3, d->dg = dg, d->poll = poll;
    if (op == EXPERTS_BWD_DW) dw_fresh_begin(d, dw_beta, absent);
    else dw_fresh_begin(d, 1.0f, NULL); /* (the input-gradient half writes no weight gradient) */
    experts_call(d, t, W, G, l, op, TERA_PROF_EXPERT_BWD);
    if (op == EXPERTS_BWD_DW) dw_fresh_end(d, G, absent);
    d->da1 = d->da3 = d->dg = NULL, d->poll = NULL;
}

void tera_dispatch_experts_backward_dx(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                                       const tera_layer_view *G, int l, float *da1, float *da3, float *dg,
                                       tera_comm_req *poll) {
    experts_backward_op(d, t, W, G, l, da1, da3, dg, poll, EXPERTS_BWD_DX, 1.0f, NULL);
}

void tera_dispatch_experts_backward_dw(tera_dispatcher *d, tera_dispatch_acts *t, const tera_layer_view *W,
                                       const tera_layer_view *G, int l, float *da1, float *da3, float *dg,
                                       tera_comm_req *poll, float dw_beta, uint8_t *absent) {
    experts_backward_op(d, t, W, G, l, da1, da3, dg, poll, EXPERTS_BWD_DW, dw_beta, absent);
}

void tera_dispatch_permute_backward(tera_dispatcher *d, float *dx, const tera_dispatch_acts *t) {
    TERA_PROF(COMBINE_BWD, d->be->ops.moe_gather_backward(d->be, dx, d->dxg, t->slot_row, d->N, d->K, d->D));
}
