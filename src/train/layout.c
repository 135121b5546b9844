/* The parallel layout of a training run: process groups, which part of the model and of the
 * optimizer state each rank holds, and conversion to and from the whole model.
 *
 * Ranks: world rank = dp_rank * tp + tp_rank. The tp ranks with the same dp_rank form a
 * tensor-parallel group (same samples, Megatron splits of each tensor); the dp ranks with the
 * same tp_rank form a data-parallel group (each reading its own samples). Inside it, with expert
 * parallelism, dp_rank = edp_rank * ep + ep_rank: consecutive groups of ep ranks split the routed
 * experts of every MoE layer (ep_rank r holds experts [r E/ep, (r+1) E/ep)), and the dp/ep ranks
 * with the same ep_rank (the expert-data-parallel group) hold the same experts.
 *
 * Flat buffers hold the non-expert tensors first, [0, n_dense), replicated on every rank, then
 * this rank's slices of the expert tensors, [n_dense, n). Gradients of the first region are summed
 * over dp, of the second over edp. ZeRO-1 shards the first region's Adam moments over dp and the
 * second's over edp; the optimizer object opt holds the first region (or its shard), opt_x the
 * second. */
#include <math.h>
#include <string.h>

#include "tera/train.h"

/* Consecutive 16-float aligned shards of n floats over w ranks. */
static void shard(int64_t n, int w, int64_t *counts, int64_t *lo_of) {
    const int64_t S = ((n + w - 1) / w + 15) & ~(int64_t)15;
    for (int r = 0; r < w; r++) {
        const int64_t lo = (int64_t)r * S < n ? (int64_t)r * S : n, hi = lo + S < n ? lo + S : n;
        counts[r] = hi - lo;
        lo_of[r] = lo;
    }
}

tera_status tera_layout_groups(tera_trainer *tr) {
    const tera_parallel_config *p = &tr->cfg.parallel;
    if (p->ep < 1 || tr->world % p->ep != 0)
        return tera_fail(TERA_ERR_CONFIG, "parallel.ep = %d must divide the %d data-parallel ranks", p->ep, tr->world);
    tr->ep = p->ep;
    tr->ep_rank = tr->rank % tr->ep;
    tr->edp_size = tr->world / tr->ep;
    tr->edp_rank = tr->rank / tr->ep;
    tr->edp = tr->dp;
    if (tr->ep > 1) { /* collective over the dp group: every rank makes the same calls */
        tr->ep_group = tera_comm_split(tr->dp, tr->edp_rank, tr->ep_rank);
        tr->edp = tera_comm_split(tr->dp, tr->ep_rank, tr->edp_rank);
    }
    if (tr->ep * tr->tp > 1) /* over the world */
        tr->mp = tera_comm_split(tera_comm_world(), tr->edp_rank, tr->ep_rank * tr->tp + tr->tp_rank);
    return TERA_OK;
}

tera_status tera_layout_init(tera_trainer *tr) {
    const tera_parallel_config *p = &tr->cfg.parallel;
    tera_model *m = &tr->model;
    /* the groups (tera_layout_groups) exist; here the optimizer's ranges */
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    tr->zero = p->zero >= 1 && tr->world > 1;
    tr->shard_counts = tera_calloc((size_t)tr->world, sizeof(int64_t));
    tr->shard_counts_x = tera_calloc((size_t)tr->edp_size, sizeof(int64_t));
    if (tr->zero) {
        int64_t *lo = tera_calloc((size_t)(tr->world > tr->edp_size ? tr->world : tr->edp_size), sizeof(int64_t));
        shard(nd, tr->world, tr->shard_counts, lo);
        tera_adamw_init_range(&tr->opt, lo[tr->rank], lo[tr->rank] + tr->shard_counts[tr->rank]);
        shard(n - nd, tr->edp_size, tr->shard_counts_x, lo);
        tera_adamw_init_range(&tr->opt_x, nd + lo[tr->edp_rank], nd + lo[tr->edp_rank] + tr->shard_counts_x[tr->edp_rank]);
        free(lo);
    } else {
        tera_adamw_init_range(&tr->opt, 0, nd);
        tera_adamw_init_range(&tr->opt_x, nd, n);
    }
    return TERA_OK;
}

void tera_layout_free(tera_trainer *tr) {
    free(tr->shard_counts);
    free(tr->shard_counts_x);
    tr->shard_counts = tr->shard_counts_x = NULL;
    tera_adamw_free(&tr->opt_x);
    if (tr->ep_group) tera_comm_free(tr->ep_group);
    if (tr->edp && tr->edp != tr->dp) tera_comm_free(tr->edp);
    if (tr->mp) tera_comm_free(tr->mp);
    if (tr->tp_group) tera_comm_free(tr->tp_group);
    if (tr->dp && tr->dp != tera_comm_world()) tera_comm_free(tr->dp);
    tr->ep_group = tr->edp = tr->mp = tr->tp_group = tr->dp = NULL;
}

void tera_layout_global_shell(const tera_trainer *tr, tera_model *shell) {
    memset(shell, 0, sizeof *shell);
    shell->cfg = tr->model.cfg;
    shell->B = tr->model.B;
    shell->T = tr->model.T;
    shell->params = tera_param_table_ep(&shell->cfg, 1, 0, &shell->n_params, &shell->n_floats, &shell->n_dense_floats);
    shell->par.ep = 1;
    shell->n_moe_layers = tr->model.n_moe_layers;
    shell->router_bias = tr->model.router_bias;
}

/* Whole Adam moments of this rank's storage (local layout, n floats each) from the shards. */
static void local_moments(tera_trainer *tr, float *lm, float *lv) {
    const int64_t nd = tr->model.n_dense_floats, n = tr->model.n_floats;
    const tera_adamw *o[2] = {&tr->opt, &tr->opt_x};
    for (int k = 0; k < 2; k++) {
        memcpy(lm + o[k]->lo, o[k]->m, sizeof(float) * (size_t)o[k]->n);
        memcpy(lv + o[k]->lo, o[k]->v, sizeof(float) * (size_t)o[k]->n);
    }
    if (!tr->zero) return;
    tera_comm_allgather_f32(tr->dp, lm, tr->shard_counts);
    tera_comm_allgather_f32(tr->dp, lv, tr->shard_counts);
    if (n > nd) {
        tera_comm_allgather_f32(tr->edp, lm + nd, tr->shard_counts_x);
        tera_comm_allgather_f32(tr->edp, lv + nd, tr->shard_counts_x);
    }
}

/* Copies one tensor's block between a rank's storage (contiguous [len0, len1, len2]) and the whole
 * tensor (global layout, shape of p). to_global: local -> g; else g -> local. */
static void block_copy(const tera_param *lp, const tera_param *gp, float *local, float *g, int to_global) {
    const int64_t S1 = gp->shape[1], S2 = gp->shape[2], L0 = lp->len[0], L1 = lp->len[1], L2 = lp->len[2];
    for (int64_t i0 = 0; i0 < L0; i0++)
        for (int64_t i1 = 0; i1 < L1; i1++) {
            float *loc = local + lp->offset + (i0 * L1 + i1) * L2;
            float *glo = g + gp->offset + ((lp->lo[0] + i0) * S1 + lp->lo[1] + i1) * S2 + lp->lo[2];
            if (to_global)
                memcpy(glo, loc, sizeof(float) * (size_t)L2);
            else
                memcpy(loc, glo, sizeof(float) * (size_t)L2);
        }
}

void tera_layout_gather(tera_trainer *tr, float *gw, float *gm, float *gv) {
    tera_model *m = &tr->model;
    const int64_t n = m->n_floats;
    float *lm = tera_calloc((size_t)(2 * n + 1), sizeof(float)), *lv = lm + n;
    local_moments(tr, lm, lv);
    tera_model shell;
    tera_layout_global_shell(tr, &shell);
    /* the mp group's ranks together hold every block once: gather their storage, and their tables */
    const int P = tr->ep * tr->tp;
    float *all = tera_malloc(sizeof(float) * (size_t)(n * P + 1));
    int64_t *cnt = tera_calloc((size_t)P, sizeof(int64_t));
    for (int r = 0; r < P; r++) cnt[r] = n;
    tera_param **tab = tera_calloc((size_t)P, sizeof(tera_param *));
    for (int r = 0; r < P; r++) {
        int np;
        int64_t nf;
        tab[r] = tera_param_table_par(&m->cfg, tr->ep, r / tr->tp, tr->tp, r % tr->tp, &np, &nf, NULL);
    }
    const int me = tr->ep_rank * tr->tp + tr->tp_rank;
    const float *src[3] = {m->w, lm, lv};
    float *dst[3] = {gw, gm, gv};
    for (int k = 0; k < 3; k++) {
        if (!dst[k]) continue;
        memcpy(all + (int64_t)me * n, src[k], sizeof(float) * (size_t)n);
        if (P > 1) tera_comm_allgather_f32(tr->mp, all, cnt);
        for (int r = 0; r < P; r++)
            for (int i = 0; i < m->n_params; i++) block_copy(&tab[r][i], &shell.params[i], all + (int64_t)r * n, dst[k], 1);
    }
    for (int r = 0; r < P; r++) free(tab[r]);
    free(tab);
    free(cnt);
    free(all);
    free(shell.params);
    free(lm);
}

void tera_layout_scatter(tera_trainer *tr, const float *gw, const float *gm, const float *gv) {
    tera_model *m = &tr->model;
    const int64_t n = m->n_floats;
    tera_model shell;
    tera_layout_global_shell(tr, &shell);
    float *lm = tera_calloc((size_t)(2 * n + 1), sizeof(float)), *lv = lm + n;
    float *dst[3] = {m->w, lm, lv};
    const float *src[3] = {gw, gm, gv};
    for (int k = 0; k < 3; k++) {
        if (!src[k]) continue;
        for (int i = 0; i < m->n_params; i++) block_copy(&m->params[i], &shell.params[i], dst[k], (float *)src[k], 0);
    }
    if (gm && gv) {
        tera_adamw *o[2] = {&tr->opt, &tr->opt_x};
        for (int k = 0; k < 2; k++) {
            memcpy(o[k]->m, lm + o[k]->lo, sizeof(float) * (size_t)o[k]->n);
            memcpy(o[k]->v, lv + o[k]->lo, sizeof(float) * (size_t)o[k]->n);
        }
    }
    free(lm);
    free(shell.params);
}

/* Whether this rank's sums of tensor i count toward the whole model's: each element of the model
 * must be counted once over the world. Copies on several data-parallel ranks count on the first
 * (ZeRO-1 shards split them instead), copies on several tensor-parallel ranks (norms, router) on
 * tp rank 0. */
static int counts_here(const tera_trainer *tr, const tera_param *p) {
    if (p->tp_dim < 0 && tr->tp_rank != 0) return 0;
    if (tr->zero) return 1;
    return p->expert_stacked ? tr->edp_rank == 0 : tr->rank == 0;
}

void tera_layout_reduce_grads(tera_trainer *tr) {
    tera_model *m = &tr->model;
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    if (tr->world == 1) return;
    if (tr->zero) { /* each rank sums only its own shard of each region */
        tera_comm_reduce_scatter_f32(tr->dp, m->g, tr->shard_counts);
        if (n > nd) tera_comm_reduce_scatter_f32(tr->edp, m->g + nd, tr->shard_counts_x);
    } else { /* the buckets started during the last backward */
        for (int i = 0; i < tr->n_buckets; i++) tera_comm_wait(&tr->buckets[i]);
    }
}

double tera_layout_grad_sq(tera_trainer *tr) {
    tera_model *m = &tr->model;
    double *sq = tr->grad_sq, *sq2 = tr->grad_sq + m->n_params;
    tera_grad_sq_by_param_range(m, tr->opt.lo, tr->opt.hi, sq);
    tera_grad_sq_by_param_range(m, tr->opt_x.lo, tr->opt_x.hi, sq2);
    for (int i = 0; i < m->n_params; i++) sq[i] = counts_here(tr, &m->params[i]) ? sq[i] + sq2[i] : 0.0;
    if (tr->wsize > 1) tera_comm_allreduce_f64(tera_comm_world(), sq, m->n_params);
    double tot = 0.0;
    for (int i = 0; i < m->n_params; i++) tot += sq[i];
    return tot;
}

void tera_layout_adamw_step(tera_trainer *tr, float lr, float clip_scale, double *sums) {
    tera_model *m = &tr->model;
    const tera_optim_config *oc = &tr->cfg.optimizer;
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    double *usq = tr->grad_sq + m->n_params * 2, *psq = usq + m->n_params; /* per tensor */
    memset(usq, 0, sizeof(double) * 2 * (size_t)m->n_params);
    tera_adamw_step_by_param(&tr->opt, m, lr, clip_scale, oc, !tr->zero, NULL, NULL, usq, psq);
    tera_adamw_step_by_param(&tr->opt_x, m, lr, clip_scale, oc, !tr->zero, NULL, NULL, usq, psq);
    if (tr->zero) { /* every rank gets every shard's new parameters */
        tera_comm_allgather_f32(tr->dp, m->w, tr->shard_counts);
        if (n > nd) tera_comm_allgather_f32(tr->edp, m->w + nd, tr->shard_counts_x);
    }
    double s[2] = {0.0, 0.0}; /* update^2, param^2 over the whole model */
    for (int i = 0; i < m->n_params; i++)
        if (counts_here(tr, &m->params[i])) s[0] += usq[i], s[1] += psq[i];
    if (tr->wsize > 1) tera_comm_allreduce_f64(tera_comm_world(), s, 2);
    sums[0] = s[0];
    sums[1] = s[1];
}
