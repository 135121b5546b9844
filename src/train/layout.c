/* The parallel layout of a training run: process groups, which part of the model and of the
 * optimizer state each rank holds, and conversion to and from the whole model.
 *
 * Ranks: the world is the data-parallel group (parallel.dp ranks, each reading its own samples).
 * With expert parallelism, rank = edp_index * ep + ep_rank: consecutive groups of ep ranks split
 * the routed experts of every MoE layer (ep_rank r holds experts [r E/ep, (r+1) E/ep)), and the
 * dp/ep ranks with the same ep_rank (the expert-data-parallel group) hold the same experts.
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
    if (tr->ep > 1) { /* collective over the world: every rank makes the same calls */
        tr->ep_group = tera_comm_split(tr->dp, tr->edp_rank, tr->ep_rank);
        tr->edp = tera_comm_split(tr->dp, tr->ep_rank, tr->edp_rank);
    }
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
    tr->ep_group = tr->edp = NULL;
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

/* Copies between the local layout (expert region of this rank, or of every ep rank one after
 * another in `all`) and the global layout. to_global: all -> g; else g -> local (rank r only). */
static void expert_region_copy(const tera_model *m, const tera_model *shell, float *local_or_all, float *g, int ep,
                               int r_only, int to_global) {
    const int64_t nd = m->n_dense_floats, nx = m->n_floats - nd;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *lp = &m->params[i], *gp = &shell->params[i];
        if (!lp->expert_stacked) continue;
        const int64_t per = lp->numel; /* floats of one rank's slice */
        for (int r = 0; r < ep; r++) {
            if (!to_global && r != r_only) continue;
            float *loc = to_global ? local_or_all + (int64_t)r * nx + (lp->offset - nd) : local_or_all + lp->offset;
            float *glo = g + gp->offset + (int64_t)r * per;
            if (to_global)
                memcpy(glo, loc, sizeof(float) * (size_t)per);
            else
                memcpy(loc, glo, sizeof(float) * (size_t)per);
        }
    }
}

void tera_layout_gather(tera_trainer *tr, float *gw, float *gm, float *gv) {
    tera_model *m = &tr->model;
    const int64_t nd = m->n_dense_floats, n = m->n_floats, nx = n - nd;
    float *lm = tera_calloc((size_t)(2 * n + 1), sizeof(float)), *lv = lm + n;
    local_moments(tr, lm, lv);
    tera_model shell;
    tera_layout_global_shell(tr, &shell);
    float *all = tr->ep > 1 ? tera_malloc(sizeof(float) * (size_t)(nx * tr->ep + 1)) : NULL;
    int64_t *cnt = tera_calloc((size_t)tr->ep, sizeof(int64_t));
    for (int r = 0; r < tr->ep; r++) cnt[r] = nx;
    const float *src[3] = {m->w, lm, lv};
    float *dst[3] = {gw, gm, gv};
    for (int k = 0; k < 3; k++) {
        if (!dst[k]) continue;
        memcpy(dst[k], src[k], sizeof(float) * (size_t)nd);
        if (tr->ep == 1) {
            memcpy(dst[k] + nd, src[k] + nd, sizeof(float) * (size_t)nx);
            continue;
        }
        memcpy(all + (int64_t)tr->ep_rank * nx, src[k] + nd, sizeof(float) * (size_t)nx);
        tera_comm_allgather_f32(tr->ep_group, all, cnt);
        expert_region_copy(m, &shell, all, dst[k], tr->ep, -1, 1);
    }
    free(cnt);
    free(all);
    free(shell.params);
    free(lm);
}

void tera_layout_scatter(tera_trainer *tr, const float *gw, const float *gm, const float *gv) {
    tera_model *m = &tr->model;
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    tera_model shell;
    tera_layout_global_shell(tr, &shell);
    float *lm = tera_calloc((size_t)(2 * n + 1), sizeof(float)), *lv = lm + n;
    float *dst[3] = {m->w, lm, lv};
    const float *src[3] = {gw, gm, gv};
    for (int k = 0; k < 3; k++) {
        if (!src[k]) continue;
        memcpy(dst[k], src[k], sizeof(float) * (size_t)nd);
        expert_region_copy(m, &shell, dst[k], (float *)src[k], tr->ep, tr->ep_rank, 0);
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
    for (int i = 0; i < m->n_params; i++) sq[i] += sq2[i];
    if (tr->zero) {
        /* every part of the model is in exactly one shard of one rank */
        tera_comm_allreduce_f64(tr->dp, sq, m->n_params);
    } else if (tr->ep > 1) {
        /* non-expert tensors are whole on every rank (counted once: ep rank 0's), expert tensors
         * are split over the ep group */
        if (tr->ep_rank != 0)
            for (int i = 0; i < m->n_params; i++)
                if (!m->params[i].expert_stacked) sq[i] = 0.0;
        tera_comm_allreduce_f64(tr->ep_group, sq, m->n_params);
    }
    double tot = 0.0;
    for (int i = 0; i < m->n_params; i++) tot += sq[i];
    return tot;
}

void tera_layout_adamw_step(tera_trainer *tr, float lr, float clip_scale, double *sums) {
    tera_model *m = &tr->model;
    const tera_optim_config *oc = &tr->cfg.optimizer;
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    double s[4] = {0, 0, 0, 0}; /* update^2, param^2 of the non-expert region; the same of the experts */
    tera_adamw_step(&tr->opt, m, lr, clip_scale, oc, !tr->zero, &s[0], &s[1]);
    tera_adamw_step(&tr->opt_x, m, lr, clip_scale, oc, !tr->zero, &s[2], &s[3]);
    if (tr->zero) { /* every rank gets every shard's new parameters */
        tera_comm_allgather_f32(tr->dp, m->w, tr->shard_counts);
        if (n > nd) tera_comm_allgather_f32(tr->edp, m->w + nd, tr->shard_counts_x);
        tera_comm_allreduce_f64(tr->dp, s, 4);
    } else if (tr->ep > 1) {
        if (tr->ep_rank != 0) s[0] = s[1] = 0.0;
        tera_comm_allreduce_f64(tr->ep_group, s, 4);
    }
    sums[0] = s[0] + s[2];
    sums[1] = s[1] + s[3];
}
