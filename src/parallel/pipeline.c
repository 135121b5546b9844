/* The pipeline executor: runs a schedule (include/tera/schedule.h) on this rank's stage.
 *
 * Stage r of pp holds the layers of virtual stages c * pp + r (c = 0 .. v-1, the chunks); virtual
 * stage s takes its input activations from s - 1 and sends its output to s + 1 (rank (r +- 1) mod
 * pp), and gradients travel back the same way. Each operation of the schedule is one micro-batch
 * through one chunk: a forward receives its input (blocking; stage 0's first chunk embeds the
 * tokens instead), runs, and sends its output without waiting; a backward receives the output's
 * gradient, runs, and sends its input's gradient. Sends complete in the background: a buffer is
 * reused only after its send is waited for, and every send is waited for by the step's end.
 *
 * A micro-batch holds an activation slot of the model from its first forward on this rank to its
 * last backward; the schedule's simulation gives the most micro-batches in flight on each rank,
 * which is the number of slots (GPipe: all m; 1F1B: at most pp). Each rank reads the micro-batch's
 * tokens itself (the data position is the same everywhere). Busy time (operations) and waiting
 * time (blocked in receives, and in sends: a slot's earlier sends before its buffers are reused, the
 * last sends at the step's end) are measured per step: the measured bubble. The rest of the step
 * (reading the micro-batches, ZeRO-3's gathers, bookkeeping) is neither. */
#include <string.h>

#include "tera/pipeline.h"
#include "tera/profile.h"
#include "tera/schedule.h"

struct tera_pipe {
    tera_pipe_env env;
    tera_schedule sched;
    int pp, v, S, rank, m;     /* stages, chunks, virtual stages, this stage, micro-batches */
    const int *first;          /* [S + 1] layer split (the model's) */
    int n_slots;
    int *slot_of;              /* [m] slot of each micro-batch in flight, -1 */
    int *slot_busy;            /* [n_slots] */
    int64_t nd;                /* floats of one activation tensor [N, D] */
    float *buf;                /* one allocation: per slot and chunk: input, output, output grad, input grad */
    int32_t *tok, *tgt;        /* [n_slots][N] */
    tera_comm_req *req;        /* [n_slots][v][2] sends: forward output, backward input gradient */
    float ce_scale;            /* the step's loss gradient scale (the head split's helper serves with it) */
    double served;             /* seconds serving the head split, or deferred weight gradients, inside waits (busy) */
    int wgrad_in_waits;        /* parallel.pp_defer_wgrad: deferred weight gradients run in waits (else at the end) */
    double busy_s, wait_s, step_s; /* the last step's */
    double busy_total, wait_total, step_total;
    double dw_wait_total, dw_end_total; /* parallel.pp_defer_wgrad: deferred products run in waits, at steps' ends */
    int64_t dw_wait_n, dw_end_n;      /* how many products, over the steps */
    int steps;
};

static float *pbuf(tera_pipe *p, int slot, int chunk, int which) {
    return p->buf + (((int64_t)slot * p->v + chunk) * 4 + which) * p->nd;
}

enum { BUF_XIN, BUF_XOUT, BUF_DYIN, BUF_DXOUT };

/* A message is named by its micro-batch and the virtual stage it goes to (sender and receiver
 * differ in chunk index where the pipeline wraps from the last rank to the first). */
static int tag_of(const tera_pipe *p, int micro, int dst_vs, int bwd) { return ((micro * p->S + dst_vs) << 1) | bwd; }

tera_status tera_pipe_slots(const char *schedule, int stages, int stage, int micro_batches, int chunks, int *slots) {
    /* before the model exists: the schedule is built and simulated (which also checks it) */
    tera_sched_kind kind;
    tera_schedule s;
    tera_sched_stats ss;
    TERA_TRY(tera_sched_kind_parse(schedule, &kind));
    TERA_TRY(tera_schedule_build(&s, kind, stages, micro_batches, chunks));
    const tera_status st = tera_schedule_simulate(&s, 1.0, 2.0, &ss);
    tera_schedule_free(&s);
    TERA_TRY(st);
    const int n = stage < 64 ? ss.peak_in_flight_rank[stage] : ss.peak_in_flight;
    *slots = n > 0 ? n : 1;
    return TERA_OK;
}

tera_status tera_pipe_create(const tera_pipe_env *env, tera_pipe **out) {
    const tera_model *m = env->model;
    TERA_ASSERTF(env->load && env->group && env->stages > 1 && env->stage >= 0 && env->stage < env->stages,
                 "pipeline: bad environment (stages %d, stage %d)", env->stages, env->stage);
    tera_pipe *p = tera_calloc(1, sizeof *p);
    p->env = *env;
    p->pp = env->stages;
    p->v = m->par.v;
    p->S = p->pp * p->v;
    p->rank = env->stage;
    p->m = env->micro_batches;
    p->first = m->layer_first;
    tera_sched_kind kind;
    tera_status st = tera_sched_kind_parse(env->schedule, &kind);
    if (st == TERA_OK) st = tera_schedule_build(&p->sched, kind, p->pp, p->m, p->v);
    if (st != TERA_OK) {
        free(p);
        return st;
    }
    if (m->par.head_role && !tera_schedule_head_adjacent(&p->sched)) { /* the config refuses GPipe already */
        tera_schedule_free(&p->sched);
        free(p);
        return tera_fail(TERA_ERR_CONFIG, "parallel.pp_head_split: schedule '%s' does not run each micro-batch's last "
                                          "backward right after its forward on the last stage", env->schedule);
    }
    p->n_slots = m->n_slots; /* tera_pipe_slots: the schedule's peak on this stage */
    /* parallel.pp_defer_wgrad: the last stage keeps its deferred products for the step's end, where it
     * waits for the others' cool-down anyway (in a wait here each would hold up its answer to the stage
     * below, which is waiting for it); the head split's first stage runs its own in its waits */
    p->wgrad_in_waits = m->par.defer_wgrad > 0 && env->stage != env->stages - 1;
    const int64_t N = (int64_t)env->micro_batch * env->seq_len;
    TERA_ASSERTF(N == (int64_t)m->B * m->T, "pipeline micro-batch of %ld rows, the model's %ld", (long)N,
                 (long)m->B * m->T);
    p->nd = m->Nr * m->cfg.dim; /* a stage boundary: this rank's rows of the residual stream */
    p->buf = tera_calloc((size_t)(p->n_slots * p->v * 4 * p->nd + 1), sizeof(float));
    p->tok = tera_calloc((size_t)(p->n_slots * N), sizeof(int32_t));
    p->tgt = tera_calloc((size_t)(p->n_slots * N), sizeof(int32_t));
    p->req = tera_calloc((size_t)(p->n_slots * p->v * 2), sizeof(tera_comm_req));
    p->slot_of = tera_calloc((size_t)p->m, sizeof(int));
    p->slot_busy = tera_calloc((size_t)p->n_slots, sizeof(int));
    *out = p;
    return TERA_OK;
}

void tera_pipe_destroy(tera_pipe *p) {
    if (!p) return;
    for (int i = 0; i < p->n_slots * p->v * 2; i++) tera_comm_wait(&p->req[i]);
    tera_schedule_free(&p->sched);
    free(p->buf);
    free(p->tok);
    free(p->tgt);
    free(p->req);
    free(p->slot_of);
    free(p->slot_busy);
    free(p);
}

/* parallel.pp_head_split, the first stage: serves every micro-batch whose head input has arrived, in
 * order (its targets are in its slot: the micro-batch is in flight here until its backward, which needs
 * the head's input gradient first); returns the seconds spent. Elsewhere: nothing. */
static double serve(tera_pipe *p) {
    const double t0 = tera_now();
    const int64_t N = (int64_t)p->env.micro_batch * p->env.seq_len;
    for (int i; (i = tera_model_head_split_ready(p->env.model)) >= 0;) {
        const int sl = p->slot_of[i];
        TERA_ASSERTF(sl >= 0, "pipeline: the head's input of micro-batch %d arrived before its forward here", i);
        tera_model_head_split_serve(p->env.model, p->tgt + (int64_t)sl * N, p->ce_scale);
    }
    return tera_now() - t0;
}

static void serve_yield(void *ctx) { (void)serve(ctx); } /* inside an operation: its busy time */

/* Waits for rq; the head split's first stage serves the head meanwhile (the last stage may be waiting
 * for it, and this wait for the last stage), the time it serves counted in p->served. */
static void pipe_wait(tera_pipe *p, tera_comm_req *rq) {
    for (;;) {
        p->served += serve(p);
        if (!rq->active) return;
        if (p->wgrad_in_waits) { /* parallel.pp_defer_wgrad: a deferred weight gradient while rq is on its way */
            tera_comm_poll(rq, 1);
            if (!rq->active) return;
            double s = 0.0;
            if (tera_model_wgrad_run(p->env.model, &s)) {
                p->served += s, p->dw_wait_total += s, p->dw_wait_n++;
                continue;
            }
        }
        tera_comm_req *hr = tera_model_head_split_pending(p->env.model);
        if (!hr) {
            tera_comm_wait(rq);
            return;
        }
        tera_comm_req *const two[2] = {rq, hr};
        (void)tera_comm_wait_any(two, 2);
    }
}

static void wait_slot_sends(tera_pipe *p, int slot) {
    for (int i = 0; i < p->v * 2; i++) pipe_wait(p, &p->req[(int64_t)slot * p->v * 2 + i]);
}

static int take_slot(tera_pipe *p) {
    for (int i = 0; i < p->n_slots; i++)
        if (!p->slot_busy[i]) {
            wait_slot_sends(p, i); /* its buffers may still be on their way from a previous use */
            p->slot_busy[i] = 1;
            return i;
        }
    TERA_ASSERTF(0, "pipeline: more micro-batches in flight than the %d activation slots", p->n_slots);
    return -1;
}

/* Reads micro-batch a of this step into a slot's token buffers (every stage reads it: stage 0
 * embeds the tokens, the last stage needs the targets). */
static double load_micro(tera_pipe *p, int a, int slot) {
    const int64_t N = (int64_t)p->env.micro_batch * p->env.seq_len;
    return p->env.load(p->env.ctx, a, p->tok + (int64_t)slot * N, p->tgt + (int64_t)slot * N);
}

static void plan(tera_pipe *p, int last, int next) {
    if (p->env.plan) p->env.plan(p->env.ctx, last, next);
}

void tera_pipe_step(tera_pipe *p, const tera_loss_scales *s, int A, double *sums, int64_t *counts, double *data_s,
                    void (*grad_ready)(void *, int64_t, int64_t), void *grad_ctx, int final_only) {
    tera_model *m = p->env.model;
    TERA_ASSERTF(A == p->m, "pipeline built for %d micro-batches, step has %d (dynamic batch size with pp > 1)", p->m,
                 A);
    const int L = m->cfg.n_layers;
    const int64_t N = (int64_t)p->env.micro_batch * p->env.seq_len;
    const int prev = (p->rank - 1 + p->pp) % p->pp, next = (p->rank + 1) % p->pp;
    const tera_sched_op *ops = tera_schedule_rank(&p->sched, p->rank);
    for (int i = 0; i < p->m; i++) p->slot_of[i] = -1;
    for (int i = 0; i < p->n_slots; i++) p->slot_busy[i] = 0;
    p->ce_scale = s->ce;
    p->served = 0.0;
    tera_model_head_split_begin(m, p->m); /* parallel.pp_head_split (else nothing) */
    if (tera_model_head_split_pending(m)) tera_model_set_yield(m, serve_yield, p); /* the first stage's layers */
    const double t_start = tera_now();
    double busy = 0.0, wait = 0.0;
    for (int k = 0; k < p->sched.n_ops; k++) {
        const tera_sched_op *op = &ops[k];
        const int i = op->micro, c = op->chunk, vs = c * p->pp + p->rank;
        const int l0 = p->first[vs], l1 = p->first[vs + 1];
        int after = -1; /* ZeRO-3 prefetch: the first layer the next operation uses */
        if (k + 1 < p->sched.n_ops) {
            const int vn = ops[k + 1].chunk * p->pp + p->rank;
            after = ops[k + 1].kind == TERA_OP_FWD ? p->first[vn] : p->first[vn + 1] - 1;
        }
        plan(p, op->kind == TERA_OP_FWD ? l1 - 1 : l0, after);
        if (op->kind == TERA_OP_FWD) {
            if (p->slot_of[i] < 0) {
                const double t0 = tera_now();
                p->slot_of[i] = take_slot(p); /* may wait for the slot's sends from its previous use */
                wait += tera_now() - t0;
                *data_s += load_micro(p, i, p->slot_of[i]);
            }
            const int sl = p->slot_of[i];
            tera_model_use_slot(m, sl);
            float *xin = pbuf(p, sl, c, BUF_XIN), *xout = pbuf(p, sl, c, BUF_XOUT);
            if (vs > 0) {
                tera_comm_req rq;
                const double t0 = tera_now();
                tera_comm_irecv_f32(p->env.group, xin, p->nd, prev, tag_of(p, i, vs, 0), &rq);
                pipe_wait(p, &rq);
                wait += tera_now() - t0;
            }
            /* the loss's pass also writes its gradient over the slot's logits (one exponential per
             * logit; the backward of this micro-batch takes it: tera_model_arm_fused_loss) */
            if (l1 == L) tera_model_arm_fused_loss(m, s->ce);
            const double t1 = tera_now();
            tera_model_forward_range(m, p->tok + (int64_t)sl * N, p->tgt + (int64_t)sl * N, l0, l1, xin, xout);
            busy += tera_now() - t1;
            sums[0] += m->stats.ce_sum, sums[1] += m->stats.aux_sum, sums[2] += m->stats.z_sum;
            counts[0] += m->stats.n_assign, counts[1] += m->stats.n_dropped;
            if (l1 < L)
                tera_comm_isend_f32(p->env.group, xout, p->nd, next, tag_of(p, i, vs + 1, 0),
                                    &p->req[((int64_t)sl * p->v + c) * 2]);
        } else {
            const int sl = p->slot_of[i];
            TERA_ASSERTF(sl >= 0, "pipeline: backward of micro-batch %d before its forward", i);
            tera_model_use_slot(m, sl);
            float *dyin = pbuf(p, sl, c, BUF_DYIN), *dxout = pbuf(p, sl, c, BUF_DXOUT);
            if (l1 < L) {
                tera_comm_req rq;
                const double t0 = tera_now();
                tera_comm_irecv_f32(p->env.group, dyin, p->nd, next, tag_of(p, i, vs, 1), &rq);
                pipe_wait(p, &rq);
                wait += tera_now() - t0;
            }
            /* gradient buckets start reducing once a chunk's last micro-batch is through */
            m->grad_ready = !final_only || i == p->m - 1 ? grad_ready : NULL;
            m->grad_ready_ctx = grad_ctx;
            const double t1 = tera_now();
            tera_model_backward_range(m, s, l0, l1, dyin, dxout);
            busy += tera_now() - t1;
            m->grad_ready = NULL;
            if (m->stats.ce_from_backward) { /* training.loss_chunk: the loss came with the head's backward */
                sums[0] += m->stats.ce_sum;
                m->stats.ce_from_backward = 0;
            }
            if (vs > 0)
                tera_comm_isend_f32(p->env.group, dxout, p->nd, prev, tag_of(p, i, vs - 1, 1),
                                    &p->req[((int64_t)sl * p->v + c) * 2 + 1]);
            if (c == 0) { /* the micro-batch's last operation on this rank: its slot is free */
                p->slot_busy[sl] = 0;
                p->slot_of[i] = -1;
            }
        }
        tera_comm_poll(p->req, p->n_slots * p->v * 2); /* let sends progress */
        busy += serve(p);
    }
    const double t_sends = tera_now();
    for (int i = 0; i < p->n_slots; i++) wait_slot_sends(p, i);
    p->served += serve(p); /* the head split's last micro-batches, in turn */
    for (tera_comm_req *hr; (hr = tera_model_head_split_pending(m)) != NULL;) {
        tera_comm_wait(hr);
        p->served += serve(p);
    }
    double dw_end = 0.0; /* parallel.pp_defer_wgrad: what the waits left (else nothing) */
    p->dw_end_n += tera_model_wgrad_flush(m, &dw_end);
    p->served += dw_end;
    tera_model_head_split_end(m);
    tera_model_set_yield(m, NULL, NULL);
    wait += tera_now() - t_sends;
    /* the head served inside waits was work, not waiting */
    wait -= p->served, busy += p->served;
    p->served = 0.0;
    tera_model_use_slot(m, 0);
    p->busy_s = busy, p->wait_s = wait, p->step_s = tera_now() - t_start;
    p->busy_total += busy, p->wait_total += wait, p->step_total += p->step_s;
    p->dw_end_total += dw_end;
    p->steps++;
}

double tera_pipe_eval(tera_pipe *p, const int32_t *tokens, const int32_t *targets, double *positions) {
    tera_model *m = p->env.model;
    const int L = m->cfg.n_layers;
    const int prev = (p->rank - 1 + p->pp) % p->pp, next = (p->rank + 1) % p->pp;
    double ce = 0.0;
    *positions = 0.0;
    tera_model_use_slot(m, 0);
    for (int vs = 0; vs < p->S; vs++) { /* one micro-batch through every virtual stage in turn */
        if (vs % p->pp != p->rank) continue;
        const int c = vs / p->pp, l0 = p->first[vs], l1 = p->first[vs + 1];
        float *xin = pbuf(p, 0, c, BUF_XIN), *xout = pbuf(p, 0, c, BUF_XOUT);
        plan(p, l1 - 1, vs + p->pp < p->S ? p->first[vs + p->pp] : -1);
        tera_comm_req rq;
        if (vs > 0) {
            tera_comm_irecv_f32(p->env.group, xin, p->nd, prev, tag_of(p, 0, vs, 0), &rq);
            tera_comm_wait(&rq);
        }
        tera_model_forward_range(m, tokens, targets, l0, l1, xin, xout);
        if (l1 < L) {
            tera_comm_isend_f32(p->env.group, xout, p->nd, next, tag_of(p, 0, vs + 1, 0), &rq);
            tera_comm_wait(&rq);
        } else {
            ce = m->stats.ce_sum;
            *positions = (double)m->stats.n_positions;
        }
    }
    return ce;
}

int tera_pipe_param_uses(const tera_pipe *p, int *uses, int max) {
    const int L = p->env.model->cfg.n_layers;
    const tera_sched_op *ops = tera_schedule_rank(&p->sched, p->rank);
    int n = 0;
#define USE(g) do { if (n < max) uses[n] = (g); n++; } while (0)
    for (int k = 0; k < p->sched.n_ops; k++) {
        const int vs = ops[k].chunk * p->pp + p->rank, l0 = p->first[vs], l1 = p->first[vs + 1];
        if (ops[k].kind == TERA_OP_FWD) { /* tera_model_forward_range */
            if (l0 == 0) USE(TERA_GROUP_EMBED);
            for (int l = l0; l < l1; l++) USE(l);
            if (l1 == L) USE(TERA_GROUP_HEAD);
        } else { /* tera_model_backward_range (no tied embeddings with a pipeline) */
            if (l1 == L) USE(TERA_GROUP_HEAD);
            for (int l = l1 - 1; l >= l0; l--) USE(l);
        }
    }
#undef USE
    return n;
}

void tera_pipe_last(const tera_pipe *p, double *busy, double *wait) {
    *busy = p ? p->busy_s : 0.0;
    *wait = p ? p->wait_s : 0.0;
}

void tera_pipe_times_reset(tera_pipe *p) {
    if (!p) return;
    p->busy_total = p->wait_total = p->step_total = 0.0;
    p->dw_wait_total = p->dw_end_total = 0.0;
    p->dw_wait_n = p->dw_end_n = 0;
    p->steps = 0;
}

void tera_pipe_deferred(const tera_pipe *p, double *in_waits, double *at_end, int64_t *n_waits, int64_t *n_end) {
    const int n = p && p->steps > 0 ? p->steps : 0;
    *in_waits = n ? p->dw_wait_total / n : 0.0;
    *at_end = n ? p->dw_end_total / n : 0.0;
    if (n_waits) *n_waits = n ? p->dw_wait_n : 0;
    if (n_end) *n_end = n ? p->dw_end_n : 0;
}

void tera_pipe_times(const tera_pipe *p, double *busy, double *wait, double *step) {
    if (!p || p->steps == 0) {
        *busy = *wait = *step = 0.0;
        return;
    }
    *busy = p->busy_total / p->steps;
    *wait = p->wait_total / p->steps;
    *step = p->step_total / p->steps;
}
