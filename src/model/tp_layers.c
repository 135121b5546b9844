/* Tensor-parallel layers: see tp_layers.h. */
#include "tp_layers.h"

#include "carve.h"
#include "host_fill.h"

#include <math.h>
#include <string.h>

#include "tera/backend.h"
#include "tera/profile.h"
#include "tera/status.h"

/* The module's scratch for tp > 1 ranks or the head split's owner (pair), carved (carve.h: counted with
 * c->base NULL, assigned into tp otherwise): the cross-entropy's [3, N]; with the pair the helper's
 * partials [N, D]; with sequence parallelism the partial outputs' [N, D], the gathered inputs' [N, D], the
 * norms' [2, D] and the rows' counts [tp]. */
static void carve_tp(carver *c, tera_tp *tp, int ranks, int64_t N, int64_t D, int sp, int pair) {
    float *ce = CARVE_F(c, 3 * N), *rows = NULL, *in = NULL, *gw = NULL, *pb = pair ? CARVE_F(c, N * D) : NULL;
    int64_t *cnt = NULL;
    if (sp) {
        rows = CARVE_F(c, N * D);
        in = CARVE_F(c, N * D);
        gw = CARVE_F(c, 2 * D);
        cnt = carve(c, sizeof(int64_t) * (size_t)ranks);
    }
    if (!c->base) return;
    tp->ce_buf = ce, tp->rows_buf = rows, tp->in_buf = in, tp->gw = gw, tp->rows_cnt = cnt, tp->pair_buf = pb;
}

static int64_t scratch_bytes(int tp, int64_t N, int64_t D, int sp, int pair) {
    if (tp <= 1 && !pair) return 0;
    carver c = {0};
    carve_tp(&c, NULL, tp, N, D, tp > 1 && sp, pair);
    return (int64_t)c.off;
}

int64_t tera_tp_scratch_bytes(int tp, int64_t N, int64_t D, int sp) { return scratch_bytes(tp, N, D, sp, 0); }

int64_t tera_tp_pair_bytes(int tp, int64_t N, int64_t D, int sp) { return scratch_bytes(tp, N, D, sp, 1); }

static void setup(tera_tp *tp, tera_backend *be, int n_ranks, tera_comm *group, int rank, int64_t v0, int64_t Vl,
                  int64_t N, int64_t D, int sp, tera_comm *pair) {
    memset(tp, 0, sizeof *tp);
    tp->be = be;
    tp->tp = n_ranks > 1 ? n_ranks : 1;
    tp->group = tp->tp > 1 ? group : NULL;
    tp->Vl = Vl;
    tp->v0 = v0;
    tp->N = N;
    tp->D = D;
    tp->sp = tp->tp > 1 && sp;
    tp->Nr = tp->sp ? N / tp->tp : N;
    tp->r0 = tp->sp ? (int64_t)rank * tp->Nr : 0;
    tp->pair = pair;
    if (tp->tp > 1 || pair) {
        TERA_ASSERTF(!tp->sp || N % tp->tp == 0, "sequence parallelism: %ld rows over %d ranks", (long)N, tp->tp);
        const size_t bytes = (size_t)scratch_bytes(tp->tp, N, D, tp->sp, pair != NULL);
        carver c = {.base = tera_malloc(bytes)};
        memset(c.base, 0, bytes);
        carve_tp(&c, tp, tp->tp, N, D, tp->sp, pair != NULL);
        for (int r = 0; tp->sp && r < tp->tp; r++) tp->rows_cnt[r] = tp->Nr * D;
        tp->bytes = (int64_t)bytes;
    }
}

void tera_tp_init(tera_tp *tp, tera_backend *be, int n_ranks, tera_comm *group, int rank, int64_t V, int64_t N,
                  int64_t D, int sp) {
    const int64_t Vl = V / (n_ranks > 1 ? n_ranks : 1);
    setup(tp, be, n_ranks, group, rank, (int64_t)rank * Vl, Vl, N, D, sp, NULL);
}

void tera_tp_init_pair(tera_tp *tp, tera_backend *be, int n_ranks, tera_comm *group, int rank, int64_t v0, int64_t Vl,
                       int64_t N, int64_t D, int sp, tera_comm *pair) {
    TERA_ASSERTF(pair && tera_comm_size(pair) == 2 && tera_comm_rank(pair) == 1, "the head split's owner is rank 1 of "
                 "a pair");
    setup(tp, be, n_ranks, group, rank, v0, Vl, N, D, sp, pair);
}

/* parallel.pp_head_split's owner: buf [n] combined with the helper's partial (received from pair rank 0; the
 * helper's first, as an all-reduce over the pair would) before any sum over the group */
static void pair_in(const tera_tp *tp, float *buf, int64_t n, int tag, int max) {
    tera_comm_req rq;
    TERA_PROF(TP_COMM, (tera_comm_irecv_f32(tp->pair, tp->pair_buf, n, 0, tag, &rq), tera_comm_wait(&rq)));
    const float *h = tp->pair_buf;
    if (max)
        for (int64_t i = 0; i < n; i++) buf[i] = h[i] > buf[i] ? h[i] : buf[i];
    else
        for (int64_t i = 0; i < n; i++) buf[i] = h[i] + buf[i];
}

/* ... and the result back to the helper */
static void pair_out(const tera_tp *tp, const float *buf, int64_t n, int tag) {
    tera_comm_req rq;
    TERA_PROF(TP_COMM, (tera_comm_isend_f32(tp->pair, buf, n, 0, tag, &rq), tera_comm_wait(&rq)));
}

void tera_tp_free(tera_tp *tp) {
    free(tp->ce_buf); /* the one block */
    memset(tp, 0, sizeof *tp);
}

static void tp_sum(const tera_tp *tp, float *buf, int64_t n) {
    if (tp->tp > 1) TERA_PROF(TP_COMM, tera_comm_allreduce_f32(tp->group, buf, n));
}

void tera_tp_reduce_forward(const tera_tp *tp, float *buf, int64_t n) { tp_sum(tp, buf, n); }

void tera_tp_copy_backward(const tera_tp *tp, float *dx, int64_t n) { tp_sum(tp, dx, n); }

int tera_tp_overlapping(const tera_tp *tp) {
    return tp->tp > 1 && (tp->overlap == 2 || (tp->overlap == 1 && tp->be->precision == TERA_PREC_FP32));
}

int tera_tp_copy_backward_start(const tera_tp *tp, float *dx, int64_t n, tera_comm_req *req) {
    memset(req, 0, sizeof *req);
    if (tp->tp == 1) return 0;
    if (!tera_tp_overlapping(tp)) {
        tp_sum(tp, dx, n);
        return 0;
    }
    TERA_PROF(TP_COMM, tera_comm_iallreduce_f32(tp->group, dx, n, req));
    return 1;
}

void tera_tp_poll(const tera_tp *tp, tera_comm_req *req) {
    if (tp->tp > 1 && req->active) TERA_PROF(TP_COMM, tera_comm_poll(req, 1));
}

void tera_tp_copy_backward_wait(tera_tp *tp, tera_comm_req *req) {
    if (!tera_tp_overlapping(tp)) return;
    if (!req->active) tp->done_early++; /* completed at a poll */
    TERA_PROF(TP_COMM, tera_comm_wait(req)); /* an inactive request returns at once */
    tp->overlapped++;
}

void tera_tp_gather_rows(const tera_tp *tp, float *buf) {
    if (tp->sp) TERA_PROF(TP_COMM, tera_comm_allgather_f32(tp->group, buf, tp->rows_cnt));
}

/* sp: buf [N, D] summed over the ranks into this rank's rows */
static void rows_sum(const tera_tp *tp, float *buf) {
    TERA_PROF(TP_COMM, tera_comm_reduce_scatter_f32(tp->group, buf, tp->rows_cnt));
}

void tera_tp_dx_sum(const tera_tp *tp, float *dx) {
    if (tp->sp)
        rows_sum(tp, dx);
    else
        tp_sum(tp, dx, tp->N * tp->D);
}

int tera_tp_dx_sum_start(const tera_tp *tp, float *dx, tera_comm_req *req) {
    if (!tp->sp) return tera_tp_copy_backward_start(tp, dx, tp->N * tp->D, req);
    memset(req, 0, sizeof *req);
    if (!tera_tp_overlapping(tp)) {
        rows_sum(tp, dx);
        return 0;
    }
    TERA_PROF(TP_COMM, tera_comm_ireduce_scatter_f32(tp->group, dx, tp->rows_cnt, req));
    return 1;
}

void tera_tp_head_backward(tera_tp *tp, float *dx, float *gw, const float *dlogits, const float *x, const float *w,
                           int64_t N, int64_t D, int64_t V, float beta) {
    tera_backend *be = tp->be;
    if (tp->pair) { /* parallel.pp_head_split's owner: the helper's partial input gradient added first */
        if (gw && !tera_tp_overlapping(tp)) { /* no sum over the group to overlap: both products while it comes */
            TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, dx, gw, dlogits, x, w, N, D, V, 0.0f, beta));
            pair_in(tp, dx, N * D, TERA_PAIR_TAG_DX, 0);
            tera_tp_dx_sum(tp, dx);
            return;
        }
        TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, dx, NULL, dlogits, x, w, N, D, V, 0.0f, 1.0f));
        pair_in(tp, dx, N * D, TERA_PAIR_TAG_DX, 0);
        if (!gw) {
            tera_tp_dx_sum(tp, dx);
            return;
        }
        tera_comm_req rq;
        tera_tp_dx_sum_start(tp, dx, &rq);
        TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, NULL, gw, dlogits, x, w, N, D, V, 0.0f, beta));
        tera_tp_copy_backward_wait(tp, &rq);
        return;
    }
    if (!gw) { /* the weight gradient deferred (wgrad.h): the input gradient alone */
        TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, dx, NULL, dlogits, x, w, N, D, V, 0.0f, 1.0f));
        tera_tp_dx_sum(tp, dx);
        return;
    }
    if (tera_tp_overlapping(tp)) { /* the weight gradient while the input gradient is summed */
        tera_comm_req rq;
        TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, dx, NULL, dlogits, x, w, N, D, V, 0.0f, 1.0f));
        tera_tp_dx_sum_start(tp, dx, &rq);
        TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, NULL, gw, dlogits, x, w, N, D, V, 0.0f, beta));
        tera_tp_copy_backward_wait(tp, &rq);
    } else {
        TERA_PROF(HEAD_BWD, be->ops.linear_backward(be, dx, gw, dlogits, x, w, N, D, V, 0.0f, beta));
        tera_tp_dx_sum(tp, dx); /* the vocabulary slices' partial input gradients */
    }
}

void tera_tp_norm_forward(const tera_tp *tp, float *y, float *rstd, const float *x, const float *w, int64_t N,
                          int64_t D, float eps) {
    if (!tp->sp) {
        TERA_PROF(NORM_FWD, tp->be->ops.rmsnorm_forward(tp->be, y, rstd, x, w, N, D, eps));
        return;
    }
    TERA_PROF(NORM_FWD, tp->be->ops.rmsnorm_forward(tp->be, y + tp->r0 * D, rstd, x, w, tp->Nr, D, eps));
    tera_tp_gather_rows(tp, y);
}

/* sp: this rank's rows [Nr, D] into their place in the gather buffer */
static void rows_into_input(const tera_tp *tp, const float *rows) {
    memcpy(tp->in_buf + tp->r0 * tp->D, rows, sizeof(float) * (size_t)(tp->Nr * tp->D));
}

const float *tera_tp_input_whole(const tera_tp *tp, const float *rows) {
    if (!tp->sp) return rows;
    rows_into_input(tp, rows);
    tera_tp_gather_rows(tp, tp->in_buf);
    return tp->in_buf;
}

const float *tera_tp_input_whole_start(const tera_tp *tp, const float *rows, tera_comm_req *req) {
    memset(req, 0, sizeof *req);
    if (!tp->sp || !tp->overlap) return tera_tp_input_whole(tp, rows);
    rows_into_input(tp, rows);
    TERA_PROF(TP_COMM, tera_comm_iallgather_f32(tp->group, tp->in_buf, tp->rows_cnt, req));
    return tp->in_buf;
}

void tera_tp_input_wait(const tera_tp *tp, tera_comm_req *req) {
    if (req->active) TERA_PROF(TP_COMM, tera_comm_wait(req));
}

const float *tera_tp_norm_input(const tera_tp *tp, float *yr, float *rstd, const float *x, const float *w, int64_t N,
                                int64_t D, float eps) {
    if (!tp->sp) {
        TERA_PROF(NORM_FWD, tp->be->ops.rmsnorm_forward(tp->be, yr, rstd, x, w, N, D, eps));
        return yr;
    }
    /* written into its place in the gather buffer, kept as the rank's rows, then gathered */
    float *own = tp->in_buf + tp->r0 * D;
    TERA_PROF(NORM_FWD, tp->be->ops.rmsnorm_forward(tp->be, own, rstd, x, w, tp->Nr, D, eps));
    memcpy(yr, own, sizeof(float) * (size_t)(tp->Nr * D));
    tera_tp_gather_rows(tp, tp->in_buf);
    return tp->in_buf;
}

void tera_tp_norm_backward(tera_tp *tp, float *dx, float *dw, const float *dy, const float *x, const float *w,
                           const float *rstd, int64_t N, int64_t D) {
    if (!tp->sp) {
        TERA_PROF(NORM_BWD, tp->be->ops.rmsnorm_backward(tp->be, dx, dw, dy, x, w, rstd, N, D));
        return;
    }
    /* this rank's rows; the weight gradient of those rows alone, pending its sum over the ranks */
    TERA_ASSERTF(tp->gw_n < 2 && D == tp->D, "a third pending norm gradient (or of width %ld)", (long)D);
    float *g = tp->gw + tp->gw_n * D;
    memset(g, 0, sizeof(float) * (size_t)D);
    TERA_PROF(NORM_BWD, tp->be->ops.rmsnorm_backward(tp->be, dx + tp->r0 * D, g, dy + tp->r0 * D, x, w, rstd,
                                                     tp->Nr, D));
    tp->gw_dst[tp->gw_n++] = dw;
}

void tera_tp_norm_grads_sum(tera_tp *tp) {
    if (tp->gw_n == 0) return;
    tp_sum(tp, tp->gw, tp->gw_n * tp->D); /* one all-reduce for both of a layer's norms */
    for (int k = 0; k < tp->gw_n; k++)
        for (int64_t i = 0; i < tp->D; i++) tp->gw_dst[k][i] += tp->gw[k * tp->D + i];
    tp->gw_n = 0;
}

void tera_tp_embedding_forward(const tera_tp *tp, float *x, const float *table, const int32_t *tokens, int64_t N,
                               int64_t D) {
    if (tp->sp) { /* each rank its vocabulary's rows, summed into each rank's rows of the stream */
        TERA_PROF(EMBED_FWD, tp->be->ops.embedding_forward_range(tp->be, tp->rows_buf, table, tokens, N, D, tp->v0,
                                                                  tp->Vl));
        rows_sum(tp, tp->rows_buf);
        memcpy(x, tp->rows_buf + tp->r0 * D, sizeof(float) * (size_t)(tp->Nr * D));
    } else if (tp->tp > 1) { /* each rank its rows, summed */
        TERA_PROF(EMBED_FWD, tp->be->ops.embedding_forward_range(tp->be, x, table, tokens, N, D, tp->v0, tp->Vl));
        tp_sum(tp, x, N * D);
    } else {
        TERA_PROF(EMBED_FWD, tp->be->ops.embedding_forward(tp->be, x, table, tokens, N, D));
    }
}

void tera_tp_embedding_backward(const tera_tp *tp, float *dtable, const float *dx, const int32_t *tokens, int64_t N,
                                int64_t D) {
    if (tp->tp > 1)
        TERA_PROF(EMBED_BWD, tp->be->ops.embedding_backward_range(tp->be, dtable, dx, tokens, N, D, tp->v0, tp->Vl));
    else
        TERA_PROF(EMBED_BWD, tp->be->ops.embedding_backward(tp->be, dtable, dx, tokens, N, D));
}

void tera_tp_row_linear_residual_forward(const tera_tp *tp, float *y, const float *x, const float *w,
                                         const float *res, int64_t N, int64_t in, int64_t out) {
    if (tp->sp) { /* the partial outputs summed into this rank's rows, then its rows' residual added */
        TERA_ASSERTF(out == tp->D, "sequence parallelism: a row-parallel output of width %ld, the stream's %ld",
                     (long)out, (long)tp->D);
        TERA_PROF(OPROJ_FWD, tp->be->ops.linear_forward(tp->be, tp->rows_buf, x, w, N, in, out, 0.0f));
        rows_sum(tp, tp->rows_buf);
        memcpy(y, tp->rows_buf + tp->r0 * out, sizeof(float) * (size_t)(tp->Nr * out));
        tp->be->ops.add_forward(tp->be, y, res, tp->Nr * out);
    } else if (tp->tp > 1) { /* the partial outputs are summed, then the residual added once */
        TERA_PROF(OPROJ_FWD, tp->be->ops.linear_forward(tp->be, y, x, w, N, in, out, 0.0f));
        tp_sum(tp, y, N * out);
        tp->be->ops.add_forward(tp->be, y, res, N * out);
    } else { /* the product accumulates onto the residual */
        TERA_PROF(OPROJ_FWD, {
            tera_host_fill(tp->be, y, res, N * out);
            tp->be->ops.linear_forward(tp->be, y, x, w, N, in, out, 1.0f);
        });
    }
}

void tera_tp_row_block_begin(const tera_tp *tp, float *out, const float *res, int64_t n) {
    if (tp->tp > 1)
        memset(out, 0, sizeof(float) * (size_t)n);
    else
        memcpy(out, res, sizeof(float) * (size_t)n);
}

float *tera_tp_norm_block_begin(const tera_tp *tp, float *ln, float *rstd, float *out, const float *x,
                                const float *w, int64_t N, int64_t D, float eps, const float **lnw) {
    if (tp->tp == 1 && tp->be->ops.rmsnorm_copy_forward) { /* the residual copied in the norm's pass over x */
        TERA_PROF(NORM_FWD, tp->be->ops.rmsnorm_copy_forward(tp->be, ln, rstd, out, x, w, N, D, eps));
        *lnw = ln;
        return out;
    }
    *lnw = tera_tp_norm_input(tp, ln, rstd, x, w, N, D, eps);
    float *acc = tp->sp ? tp->rows_buf : out;
    tera_tp_row_block_begin(tp, acc, x, N * D);
    return acc;
}

void tera_tp_row_block_end(const tera_tp *tp, float *out, float *acc, const float *res, int64_t N, int64_t D) {
    if (tp->tp == 1) return;
    if (tp->sp) {
        rows_sum(tp, acc);
        memcpy(out, acc + tp->r0 * D, sizeof(float) * (size_t)(tp->Nr * D));
        tp->be->ops.add_forward(tp->be, out, res, tp->Nr * D);
        return;
    }
    tp_sum(tp, acc, N * D); /* acc is out (tera_tp_norm_block_begin) */
    tp->be->ops.add_forward(tp->be, out, res, N * D);
}

/* tp > 1: this rank's slice against the whole vocabulary, combined over the ranks with three sums of N
 * floats: mx (max), se (sum of exponentials) and tl (the target's logit) in tp->ce_buf; e (NULL: not
 * written) = exp(logits - mx) of the slice; with lse not NULL, lse[n] and the sum of losses returned.
 * Timed as op (the loss's forward or backward). */
static double ce_slices(const tera_tp *tp, float *e, float *lse, const float *logits, const int32_t *targets,
                        int64_t N, int op) {
    TERA_ASSERTF(N <= tp->N, "cross-entropy over %ld rows, scratch for %ld", (long)N, (long)tp->N);
    float *mx = tp->ce_buf, *se = tp->ce_buf + N, *tl = tp->ce_buf + 2 * N;
    double t0 = tera_now();
    tp->be->ops.ce_slice_max(tp->be, mx, logits, N, tp->Vl);
    tera_prof_add(op, t0);
    if (tp->pair) pair_in(tp, mx, N, TERA_PAIR_TAG_MAX, 1);
    if (tp->tp > 1) TERA_PROF(TP_COMM, tera_comm_allreduce_max_f32(tp->group, mx, N));
    if (tp->pair) pair_out(tp, mx, N, TERA_PAIR_TAG_MAX);
    t0 = tera_now();
    tp->be->ops.ce_slice_sums(tp->be, se, tl, e, logits, mx, targets, N, tp->Vl, tp->v0);
    tera_prof_add(op, t0);
    if (tp->pair) pair_in(tp, se, 2 * N, TERA_PAIR_TAG_SUMS, 0);
    tp_sum(tp, se, 2 * N); /* se and tl are adjacent */
    if (tp->pair) pair_out(tp, se, 2 * N, TERA_PAIR_TAG_SUMS);
    double sum = 0.0;
    if (lse)
        for (int64_t n = 0; n < N; n++) { /* fixed order */
            lse[n] = mx[n] + logf(se[n]);
            sum += (double)lse[n] - (double)tl[n];
        }
    return sum;
}

double tera_tp_ce_forward(const tera_tp *tp, float *lse, const float *logits, const int32_t *targets, int64_t N) {
    double sum = 0.0;
    if (tp->tp == 1 && !tp->pair) {
        TERA_PROF(LOSS_FWD, sum = tp->be->ops.ce_forward(tp->be, lse, logits, targets, N, tp->Vl));
        return sum;
    }
    return ce_slices(tp, NULL, lse, logits, targets, N, TERA_PROF_LOSS_FWD);
}

void tera_tp_ce_backward(const tera_tp *tp, float *dlogits, const float *logits, const int32_t *targets, int64_t N,
                         float scale) {
    if (tp->tp == 1 && !tp->pair) {
        TERA_PROF(LOSS_BWD, tp->be->ops.ce_backward(tp->be, dlogits, logits, targets, N, tp->Vl, scale));
        return;
    }
    /* the max and sums over the ranks again (the forward kept only the lse), the exponentials in dlogits */
    ce_slices(tp, dlogits, NULL, logits, targets, N, TERA_PROF_LOSS_BWD);
    TERA_PROF(LOSS_BWD, tp->be->ops.ce_backward_range(tp->be, dlogits, dlogits, tp->ce_buf + N, targets, N, tp->Vl,
                                                      tp->v0, scale));
}

int tera_tp_ce_fused(const tera_tp *tp, float *dlogits, float *lse, float *tlogit, const float *logits,
                     const int32_t *targets, int64_t N, float scale, double *sum) {
    if (tp->tp == 1 && !tp->pair) {
        if (!tp->be->ops.ce_fused) return 0;
        TERA_PROF(LOSS_FWD, *sum = tp->be->ops.ce_fused(tp->be, dlogits, lse, tlogit, logits, targets, N, tp->Vl, scale));
        return 1;
    }
    /* the slice's exponentials written to dlogits in the forward's pass, scaled once the sums over the
     * ranks are known: no second exponential (tlogit unused: the targets' logits are in tp->ce_buf) */
    *sum = ce_slices(tp, dlogits, lse, logits, targets, N, TERA_PROF_LOSS_FWD);
    TERA_PROF(LOSS_FWD, tp->be->ops.ce_backward_range(tp->be, dlogits, dlogits, tp->ce_buf + N, targets, N, tp->Vl,
                                                      tp->v0, scale));
    return 1;
}
