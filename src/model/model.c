/* The transformer: allocation from size tables, forward and backward over one micro-batch.
 *
 * Memory: parameters, gradients, activations and scratch are each one allocation, carved by
 * offsets computed from the configuration; nothing is allocated in forward or backward.
 * The layers are composed here from the operations of the model's compute backend (m->be,
 * include/tera/backend.h) and two modules:
 * the tensor-parallel layers (tp_layers.h: every sum across tensor-parallel ranks, the vocabulary-
 * parallel embedding and cross-entropy) and the MoE token dispatcher (dispatch.h: local or
 * all-to-all, permute -> experts -> combine); the router is moe.h's. No OpenMP here, and
 * no sum or exchange between ranks. */
#include <string.h>

#include "carve.h"
#include "dispatch.h"
#include "host_fill.h"
#include "moe.h"
#include "head_split.h"
#include "wgrad.h"
#include "tp_layers.h"
#include "tera/backend.h"
#include "tera/model.h"
#include "tera/profile.h"
#include "tera/rng.h"

/* Activations kept for backward, per layer. Unused pointers stay NULL. */
typedef struct {
    float *x_in;     /* [N, D] layer input (residual stream) */
    float *ln1;      /* [N, D] */
    float *rstd1;    /* [N] */
    float *q;        /* [N, H*hd] after RoPE */
    float *k, *v;    /* [N, Hkv*hd] (k after RoPE) */
    float *att;      /* [N, H*hd] attention output before o_proj */
    float *att_lse;  /* [B, H, T] */
    float *h;        /* [N, D] residual after attention */
    float *ln2;      /* [N, D] */
    float *rstd2;    /* [N] */
    /* MoE */
    float *rlogits;  /* [N, E] router logits */
    float *probs;    /* [N, E] router scores: softmax probabilities, or sigmoids (model.router_score) */
    float *rlse;     /* [N] router logsumexp (z-loss) */
    int32_t *topi;   /* [N, k] */
    float *topw;     /* [N, k] combine weights */
    float *gcnt;     /* [E] switch_dp: the micro-batch's expert counts summed over the data-parallel ranks / dp */
    tera_dispatch_acts moe; /* the routed tokens: plan, grouped rows, expert activations (dispatch.h) */
    /* dense layer or shared experts */
    float *fa1, *fa3, *fg; /* [N, Fd or Fs] */
} layer_acts;

struct tera_acts {
    layer_acts *layer;   /* [L] kept per layer, or pointing into `work` (recomputation) */
    /* Recomputation (tera_recompute): the fields a layer does not keep point into this one set,
     * sized for the largest layer that shares it. It holds the activations of one layer at a time:
     * layer `work_owner`'s (-1: none or unknown), written by its forward or by its recomputation. */
    layer_acts work;
    const uint8_t *policy; /* [L] tera_recompute */
    int work_owner;
    float *x_final;      /* [N, D] output of the last layer */
    float *lnf;          /* [N, D] */
    float *rstdf;        /* [N] */
    float *loss_lse;     /* [N] */
    float *rope_cos, *rope_sin; /* [T, hd/2] */
    const int32_t *targets; /* of the last forward (caller's memory) */
    const int32_t *tokens;
    /* backward scratch, shared by all layers */
    float *dres;         /* [N, D] gradient of the residual stream */
    float *dln;          /* [N, D] */
    float *dq;           /* [N, H*hd] */
    float *dk, *dv;      /* [N, Hkv*hd] */
    float *datt;         /* [N, H*hd] */
    float *da1, *da3, *dgact; /* [R, F] routed experts (R = tera_dispatch_rows), or [N, Fd or Fs] */
    float *dprobs;       /* [N, E] */
    float *drlogits;     /* [N, E] */
    float *dtopw;        /* [N, k] */
    double *route_p;     /* [B + 1, E] sums of the balancing loss's P: per sequence, then over all */
    float *rsum;         /* [N] sigmoid scoring: each token's sum of scores (balancing loss), else NULL */
    void *route_scratch; /* group-limited routing: tera_moe_route's per-thread scratch, else NULL */
    float *logits;       /* [N, Vl] (in the scratch block, or per slot with pipeline parallelism) */
    float *attn_scratch; /* attention kernel scratch */
    int64_t *expert_load_save; /* [E] a layer's expert loads, kept across its full recomputation */
    void *act_block, *scratch_block;
    int threads;         /* thread count the attention scratch was sized for */
    /* the loss gradient written in the forward's pass over the logits (tera_model_arm_fused_loss):
     * armed for the next forward with scale ce_scale; ce_fused: the last forward did it */
    int ce_armed, ce_fused;
    float ce_scale;
    /* training.loss_chunk (m->loss_rows < N): the last forward was armed, so the backward computes the head's
     * logits block by block, the loss and its gradient (head_loss_backward) */
    int ce_deferred;
    int weights_same; /* tera_model_weights_unchanged: for the next forward */
    /* the modules every slot shares (slot 0 owns them): the token dispatcher of the MoE layers
     * (local or all-to-all) and the tensor-parallel layers */
    tera_dispatcher *dispatch;
    tera_tp *tp;
};


static int is_moe(const tera_model_config *c, int l) { return l >= c->first_k_dense; }

/* Parts of a layer's activations, for carving: what a layer keeps under each policy. */
enum {
    PART_XIN = 1,     /* x_in */
    PART_CORE = 2,    /* attention core outputs: att, att_lse */
    PART_HIDDEN = 4,  /* SwiGLU hidden activations: a1, a3, gact (routed), fa1, fa3, fg (dense/shared) */
    PART_REST = 8,    /* everything else */
    PART_ALL = 15
};

static unsigned kept_parts(int policy) {
    switch (policy) {
    case TERA_RECOMPUTE_FULL: return PART_XIN;
    case TERA_RECOMPUTE_SELECTIVE: return PART_ALL & ~(unsigned)(PART_CORE | PART_HIDDEN);
    default: return PART_ALL;
    }
}

/* Carves the `parts` of one layer's activations; moe: MoE fields; Fx: dense/shared hidden width.
 * Widths are this rank's (tensor parallelism: heads, FFN widths divided by tp); R: the rows this
 * rank's experts process (expert parallelism: the most it can receive). */
static void carve_layer(layer_acts *la, carver *c, const tera_model *m, const tera_acts *a, int moe, int64_t Fx,
                        unsigned parts) {
    const tera_model_config *cfg = &m->cfg;
    const int B = m->B, T = m->T;
    const int64_t N = (int64_t)B * T, D = cfg->dim, H = m->Hl, Hkv = m->Hkvl;
    const int64_t hd = D / cfg->n_heads, E = cfg->n_experts, K = cfg->top_k, F = m->Fl;
    const int64_t R = tera_dispatch_rows(a->dispatch);
    tera_dispatch_sizes ex; /* the dispatcher's exchange buffers (none for the local one) */
    tera_dispatch_exchange_sizes(a->dispatch, &ex);
    const int xin = (parts & PART_XIN) != 0, core = (parts & PART_CORE) != 0;
    const int hid = (parts & PART_HIDDEN) != 0, rest = (parts & PART_REST) != 0;
    const int64_t Nr = m->Nr; /* the residual stream's rows on this rank (sequence parallelism: N / tp) */
    if (xin) la->x_in = CARVE_F(c, Nr * D);
    if (rest) {
        la->ln1 = CARVE_F(c, Nr * D); /* sequence parallelism: the rank's rows (tera_tp_norm_input) */
        la->rstd1 = CARVE_F(c, Nr);
        la->q = CARVE_F(c, N * H * hd);
        la->k = CARVE_F(c, N * Hkv * hd);
        la->v = CARVE_F(c, N * Hkv * hd);
    }
    if (core) {
        la->att = CARVE_F(c, N * H * hd);
        la->att_lse = CARVE_F(c, (int64_t)B * H * T);
    }
    if (rest) {
        la->h = CARVE_F(c, Nr * D);
        la->ln2 = CARVE_F(c, Nr * D);
        la->rstd2 = CARVE_F(c, Nr);
    }
    if (moe) {
        if (rest) {
            la->rlogits = CARVE_F(c, N * E);
            la->probs = CARVE_F(c, N * E);
            la->rlse = CARVE_F(c, N);
            la->topi = CARVE_I(c, N * K);
            la->topw = CARVE_F(c, N * K);
            la->moe.slot_row = CARVE_I(c, N * K);
            la->moe.row_tok = CARVE_I(c, N * K);
            la->moe.exp_off = CARVE_I(c, E + 1);
            la->moe.sel_count = CARVE_I(c, (int64_t)B * E);
            if (cfg->balance_loss == TERA_BALANCE_SWITCH_DP) la->gcnt = CARVE_F(c, E);
            if (ex.rows > 0) { /* all-to-all: the rows sent live in the dispatcher's scratch */
                la->moe.rcnt = CARVE_I(c, ex.counts);
                la->moe.roff = CARVE_I(c, ex.offsets);
                la->moe.xr = CARVE_F(c, ex.rows * D);
            } else {
                la->moe.xg = CARVE_F(c, N * K * D);
            }
        }
        if (hid) {
            la->moe.a1 = CARVE_F(c, R * F);
            la->moe.a3 = CARVE_F(c, R * F);
            la->moe.gact = CARVE_F(c, R * F);
        }
        if (rest) la->moe.ye = CARVE_F(c, N * K * D);
    }
    if (Fx > 0 && hid) {
        la->fa1 = CARVE_F(c, N * Fx);
        la->fa3 = CARVE_F(c, N * Fx);
        la->fg = CARVE_F(c, N * Fx);
    }
}

static int64_t layer_ffn_width(const tera_model *m, int l) { return is_moe(&m->cfg, l) ? m->Fsl : m->Fdl; }

/* Per-layer activations of this rank's layers (each layer its kept parts), then the work set for
 * the others, then the head's. Bytes: sum over layers of the kept parts + the work set + the
 * head's, where the work set is everything but x_in (some layer is full) or the core and hidden
 * parts (some layer selective, none full), with the MoE fields if a recomputing layer is MoE and
 * the widest recomputing dense/shared FFN; nothing when no layer recomputes. */
static void carve_acts(tera_acts *a, carver *c, const tera_model *m) {
    const tera_model_config *cfg = &m->cfg;
    const int B = m->B, T = m->T;
    const int64_t N = (int64_t)B * T, D = cfg->dim, hd = D / cfg->n_heads;
    unsigned work_parts = 0;
    int work_moe = 0;
    int64_t work_Fx = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        if (!m->held[l]) continue; /* another pipeline stage's layer */
        const unsigned kept = kept_parts(a->policy[l]);
        a->layer[l] = (layer_acts){0};
        carve_layer(&a->layer[l], c, m, a, is_moe(cfg, l), layer_ffn_width(m, l), kept);
        if (kept != PART_ALL) {
            work_parts |= PART_ALL & ~kept;
            work_moe |= is_moe(cfg, l);
            if (layer_ffn_width(m, l) > work_Fx) work_Fx = layer_ffn_width(m, l);
        }
    }
    /* one work set for every activation slot (a stage recomputes one layer at a time): slot 0
     * carves it, the others point into it */
    if (a != &m->slots[0]) {
        a->work = m->slots[0].work;
    } else {
        a->work = (layer_acts){0};
        if (work_parts) carve_layer(&a->work, c, m, a, work_moe, work_Fx, work_parts);
    }
    for (int l = 0; l < cfg->n_layers; l++) { /* what a layer does not keep, it finds in the work set */
        if (!m->held[l]) continue;
        layer_acts *la = &a->layer[l];
        const unsigned kept = kept_parts(a->policy[l]);
        tera_dispatch_sizes ex;
        tera_dispatch_exchange_sizes(a->dispatch, &ex);
        const int moe = is_moe(cfg, l), ffn = layer_ffn_width(m, l) > 0, exch = ex.rows > 0;
#define SHARE(part, cond, f)                                                                       \
    if (!(kept & (part)) && (cond)) la->f = a->work.f
        SHARE(PART_REST, 1, ln1); SHARE(PART_REST, 1, rstd1); SHARE(PART_REST, 1, q);
        SHARE(PART_REST, 1, k); SHARE(PART_REST, 1, v); SHARE(PART_REST, 1, h);
        SHARE(PART_REST, 1, ln2); SHARE(PART_REST, 1, rstd2);
        SHARE(PART_CORE, 1, att); SHARE(PART_CORE, 1, att_lse);
        SHARE(PART_REST, moe, rlogits); SHARE(PART_REST, moe, probs); SHARE(PART_REST, moe, rlse);
        SHARE(PART_REST, moe, topi); SHARE(PART_REST, moe, topw); SHARE(PART_REST, moe, moe.slot_row);
        SHARE(PART_REST, moe, moe.row_tok); SHARE(PART_REST, moe, moe.exp_off); SHARE(PART_REST, moe, moe.sel_count);
        SHARE(PART_REST, moe && cfg->balance_loss == TERA_BALANCE_SWITCH_DP, gcnt);
        SHARE(PART_REST, moe && !exch, moe.xg); SHARE(PART_REST, moe, moe.ye);
        SHARE(PART_REST, moe && exch, moe.rcnt); SHARE(PART_REST, moe && exch, moe.roff);
        SHARE(PART_REST, moe && exch, moe.xr);
        SHARE(PART_HIDDEN, moe, moe.a1); SHARE(PART_HIDDEN, moe, moe.a3); SHARE(PART_HIDDEN, moe, moe.gact);
        SHARE(PART_HIDDEN, ffn, fa1); SHARE(PART_HIDDEN, ffn, fa3); SHARE(PART_HIDDEN, ffn, fg);
#undef SHARE
    }
    a->x_final = CARVE_F(c, m->Nr * D);
    a->lnf = CARVE_F(c, N * D);
    a->rstdf = CARVE_F(c, m->Nr);
    a->loss_lse = CARVE_F(c, N);
    a->rope_cos = CARVE_F(c, (int64_t)T * hd / 2);
    a->rope_sin = CARVE_F(c, (int64_t)T * hd / 2);
    /* pipeline: a micro-batch's logits live until its backward, after other micro-batches ran; only
     * the stage that holds the head (the last virtual stage, on pp_rank pp - 1) has any */
    if (m->n_slots > 1 && m->par.pp_rank == m->par.pp - 1 && m->loss_rows == N) a->logits = CARVE_F(c, N * m->Vl);
}

/* The scratch block (shared by the slots); the dispatcher and the tensor-parallel layers own theirs. */
static void carve_scratch(tera_acts *a, carver *c, const tera_model *m) {
    const tera_model_config *cfg = &m->cfg;
    const int B = m->B, T = m->T;
    const int64_t N = (int64_t)B * T, D = cfg->dim, H = m->Hl, Hkv = m->Hkvl;
    const int64_t hd = D / cfg->n_heads, E = cfg->n_experts, K = cfg->top_k, F = m->Fl;
    const int64_t Fs = m->Fsl, Fd = m->Fdl;
    const int64_t R = tera_dispatch_rows(a->dispatch);
    int64_t Fw = R * F; /* widest hidden buffer */
    if (N * Fs > Fw) Fw = N * Fs;
    if (N * Fd > Fw) Fw = N * Fd;
    if (m->loss_rows < N) { /* training.loss_chunk: one block of rows at a time, on the stage with the head */
        if (m->par.pp_rank == m->par.pp - 1) a->logits = CARVE_F(c, m->loss_rows * m->Vl);
    } else if (m->n_slots == 1) {
        a->logits = CARVE_F(c, N * m->Vl);
    }
    a->dres = CARVE_F(c, N * D);
    a->dln = CARVE_F(c, N * D);
    a->dq = CARVE_F(c, N * H * hd);
    a->dk = CARVE_F(c, N * Hkv * hd);
    a->dv = CARVE_F(c, N * Hkv * hd);
    a->datt = CARVE_F(c, N * H * hd);
    a->da1 = CARVE_F(c, Fw);
    a->da3 = CARVE_F(c, Fw);
    a->dgact = CARVE_F(c, Fw);
    a->dprobs = CARVE_F(c, N * E);
    a->drlogits = CARVE_F(c, N * E);
    a->dtopw = CARVE_F(c, N * K);
    a->route_p = (double *)carve(c, sizeof(double) * (size_t)(B + 1) * (size_t)E);
    if (cfg->router_score == TERA_ROUTER_SIGMOID) a->rsum = CARVE_F(c, N);
    const tera_moe_routing route = tera_moe_routing_of(cfg);
    if (route.n_groups > 1) a->route_scratch = carve(c, tera_moe_route_scratch_bytes(&route, m->be->ops.max_threads(m->be)));
    a->attn_scratch = CARVE_F(c, m->be->ops.attention_scratch_floats(m->be, B, T, (int)H, (int)Hkv, (int)hd));
    a->expert_load_save = (int64_t *)carve(c, sizeof(int64_t) * (size_t)E);
}

/* Points the view's entry for parameter p at ptr (NULL base: NULL). */
static void set_view(tera_weights_view *v, const tera_param *p, float *ptr) {
    tera_layer_view *lv = p->layer >= 0 ? &v->layers[p->layer] : NULL;
    switch (p->kind) {
    case TERA_P_EMBED: v->embed = ptr; break;
    case TERA_P_ATTN_NORM: lv->attn_norm = ptr; break;
    case TERA_P_WQ: lv->wq = ptr; break;
    case TERA_P_WK: lv->wk = ptr; break;
    case TERA_P_WV: lv->wv = ptr; break;
    case TERA_P_WO: lv->wo = ptr; break;
    case TERA_P_FFN_NORM: lv->ffn_norm = ptr; break;
    case TERA_P_ROUTER: lv->router = ptr; break;
    case TERA_P_EXP_W1: lv->w1 = ptr; break;
    case TERA_P_EXP_W3: lv->w3 = ptr; break;
    case TERA_P_EXP_W2: lv->w2 = ptr; break;
    case TERA_P_SHARED_W1: lv->sw1 = ptr; break;
    case TERA_P_SHARED_W3: lv->sw3 = ptr; break;
    case TERA_P_SHARED_W2: lv->sw2 = ptr; break;
    case TERA_P_DENSE_W1: lv->dw1 = ptr; break;
    case TERA_P_DENSE_W3: lv->dw3 = ptr; break;
    case TERA_P_DENSE_W2: lv->dw2 = ptr; break;
    case TERA_P_FINAL_NORM: v->final_norm = ptr; break;
    case TERA_P_LM_HEAD: v->lm_head = ptr; break;
    case TERA_P_COUNT: break;
    }
}

/* the view's pointer to parameter p (NULL: not bound) */
static float *view_of(const tera_weights_view *v, const tera_param *p) {
    const tera_layer_view *lv = p->layer >= 0 && v->layers ? &v->layers[p->layer] : NULL;
    switch (p->kind) {
    case TERA_P_EMBED: return v->embed;
    case TERA_P_FINAL_NORM: return v->final_norm;
    case TERA_P_LM_HEAD: return v->lm_head;
    case TERA_P_COUNT: return NULL;
    default: break;
    }
    if (!lv) return NULL;
    switch (p->kind) {
    case TERA_P_ATTN_NORM: return lv->attn_norm;
    case TERA_P_WQ: return lv->wq;
    case TERA_P_WK: return lv->wk;
    case TERA_P_WV: return lv->wv;
    case TERA_P_WO: return lv->wo;
    case TERA_P_FFN_NORM: return lv->ffn_norm;
    case TERA_P_ROUTER: return lv->router;
    case TERA_P_EXP_W1: return lv->w1;
    case TERA_P_EXP_W3: return lv->w3;
    case TERA_P_EXP_W2: return lv->w2;
    case TERA_P_SHARED_W1: return lv->sw1;
    case TERA_P_SHARED_W3: return lv->sw3;
    case TERA_P_SHARED_W2: return lv->sw2;
    case TERA_P_DENSE_W1: return lv->dw1;
    case TERA_P_DENSE_W3: return lv->dw3;
    case TERA_P_DENSE_W2: return lv->dw2;
    default: return NULL;
    }
}

static void make_views(tera_weights_view *v, float *base, const tera_model *m) {
    if (!v->layers) v->layers = tera_calloc((size_t)m->cfg.n_layers, sizeof(tera_layer_view));
    for (int i = 0; i < m->n_params; i++) set_view(v, &m->params[i], base ? base + m->params[i].offset : NULL);
    if (m->cfg.tie_embeddings) v->lm_head = v->embed;
}

static int in_group(const tera_param *p, int group) {
    if (group >= 0) return p->layer == group;
    if (group == TERA_GROUP_EMBED) return p->kind == TERA_P_EMBED;
    return p->kind == TERA_P_FINAL_NORM || p->kind == TERA_P_LM_HEAD;
}

/* A group's slot: layer l is l, the embedding L, the head L + 1 (g_stale's index). */
static int group_slot(const tera_model *m, int group) {
    return group >= 0 ? group : group == TERA_GROUP_EMBED ? m->cfg.n_layers : m->cfg.n_layers + 1;
}

/* The per-group index of the table (group_off, group_idx): a group's parameters without a scan of the
 * whole table, which every group's call repeated (quadratic in the layers: 65536 tiny layers spent
 * minutes a step there). */
static void group_index_build(tera_model *m) {
    const int L = m->cfg.n_layers, G = L + 2;
    m->group_off = tera_calloc((size_t)G + 1, sizeof(int));
    m->group_idx = tera_calloc((size_t)(m->n_params > 0 ? m->n_params : 1), sizeof(int));
    int *slot = tera_malloc(sizeof(int) * (size_t)(m->n_params > 0 ? m->n_params : 1));
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        slot[i] = -1;
        if (p->layer >= 0 && p->layer < L) slot[i] = p->layer;
        else if (in_group(p, TERA_GROUP_EMBED)) slot[i] = L;
        else if (in_group(p, TERA_GROUP_HEAD)) slot[i] = L + 1;
        if (slot[i] >= 0) m->group_off[slot[i] + 1]++;
    }
    for (int k = 0; k < G; k++) m->group_off[k + 1] += m->group_off[k];
    int *at = tera_malloc(sizeof(int) * (size_t)G);
    memcpy(at, m->group_off, sizeof(int) * (size_t)G);
    for (int i = 0; i < m->n_params; i++)
        if (slot[i] >= 0) m->group_idx[at[slot[i]]++] = i; /* table order within a group */
    free(at);
    free(slot);
    m->group_tab = m->params;
}

/* The parameters of a group (a layer, TERA_GROUP_EMBED or TERA_GROUP_HEAD) in table order:
 *     group_iter it = group_begin(m, group);
 *     for (int i; (i = group_next(m, &it)) >= 0;) ... m->params[i] ...
 * through the index, or a scan of the table with in_group where there is none. */
typedef struct {
    const int *idx; /* the group's table indices [n]; NULL: scan */
    int n, k, group;
} group_iter;

static group_iter group_begin(const tera_model *m, int group) {
    group_iter it = {.group = group};
    if (m->group_off && m->group_tab == m->params) {
        const int s = group_slot(m, group);
        it.idx = m->group_idx + m->group_off[s];
        it.n = m->group_off[s + 1] - m->group_off[s];
    } else {
        it.n = m->n_params;
    }
    return it;
}

static int group_next(const tera_model *m, group_iter *it) {
    while (it->k < it->n) {
        const int i = it->idx ? it->idx[it->k++] : it->k++;
        if (it->idx || in_group(&m->params[i], it->group)) return i;
    }
    return -1;
}

void tera_model_group_range(const tera_model *m, int group, int experts, int64_t *lo, int64_t *hi) {
    *lo = INT64_MAX;
    *hi = 0;
    group_iter it = group_begin(m, group);
    for (int i; (i = group_next(m, &it)) >= 0;) {
        const tera_param *p = &m->params[i];
        if (p->expert_stacked != experts || p->numel == 0) continue;
        if (p->offset < *lo) *lo = p->offset;
        if (p->offset + p->numel > *hi) *hi = p->offset + p->numel;
    }
    if (*hi == 0) *lo = 0;
}

void tera_model_bind_group(tera_model *m, int group, float *wd, float *wx, float *gd, float *gx) {
    int64_t lo[2], hi[2];
    tera_model_group_range(m, group, 0, &lo[0], &hi[0]);
    tera_model_group_range(m, group, 1, &lo[1], &hi[1]);
    group_iter it = group_begin(m, group);
    for (int i; (i = group_next(m, &it)) >= 0;) {
        const tera_param *p = &m->params[i];
        const int x = p->expert_stacked;
        float *wb = x ? wx : wd, *gb = x ? gx : gd;
        if (wb) set_view(&m->W, p, wb + (p->offset - lo[x]));
        if (gb) set_view(&m->G, p, gb + (p->offset - lo[x]));
    }
    if (m->cfg.tie_embeddings && group == TERA_GROUP_EMBED) {
        if (wd) m->W.lm_head = m->W.embed;
        if (gd) m->G.lm_head = m->G.embed;
    }
}

/* The model's whole buffer *buf (its views v) moved into the caller's `to` [n_floats], which first
 * gets the buffer's values (copy) or zeros; to = NULL gives the caller's buffer back (none from then
 * on, the views cleared). `what` names it in a broken invariant. */
static void adopt_whole(tera_model *m, float **buf, int *external, tera_weights_view *v, float *to, int copy,
                        const char *what) {
    if (!to) { /* the caller takes its buffer back */
        TERA_ASSERTF(*external, "tera_model_adopt_%s(NULL): the model's %s are its own", what, what);
        *buf = NULL;
        *external = 0;
        make_views(v, NULL, m);
        return;
    }
    TERA_ASSERTF(*buf, "tera_model_adopt_%s: the model has no whole %s buffer", what, what);
    if (copy) memcpy(to, *buf, sizeof(float) * (size_t)m->n_floats);
    else memset(to, 0, sizeof(float) * (size_t)m->n_floats);
    if (!*external) free(*buf);
    *buf = to;
    *external = 1;
    make_views(v, to, m);
}

/* gradients: zeros, as the model's own buffer holds before its first step (not a copy of it: its pages
 * were never touched, and reading them would make them resident at the moment the new ones become so) */
void tera_model_adopt_grads(tera_model *m, float *g) { adopt_whole(m, &m->g, &m->g_external, &m->G, g, 0, "grads"); }

void tera_model_adopt_params(tera_model *m, float *w) { adopt_whole(m, &m->w, &m->w_external, &m->W, w, 1, "params"); }

void tera_model_bind_all(tera_model *m, float *w, float *g) {
    if (w || !m->w) make_views(&m->W, w, m); /* NULL and no whole buffer: views cleared */
    if (g || !m->g) make_views(&m->G, g, m);
}

tera_status tera_model_create(tera_model *m, const tera_model_config *cfg, int B, int T) {
    return tera_model_create_par(m, cfg, B, T, NULL);
}

/* The shape of one rank's model, shared by tera_model_create_par and tera_model_count: the layout's
 * checks, the rank's widths (tp slices), its layers (pipeline stages) and slots. counting: no groups
 * (every rank's sizes are rank 0's: tp and ep slices are equal). */
static tera_status set_shape(tera_model *m, const tera_model_config *cfg, int B, int T, const tera_model_par *par,
                             tera_backend *be, int counting) {
    memset(m, 0, sizeof *m);
    m->be = be;
    m->par = par ? *par : (tera_model_par){.ep = 1, .tp = 1};
    m->par.be = be;
    if (m->par.ep < 1) m->par.ep = 1;
    if (m->par.tp < 1) m->par.tp = 1;
    const int ep = m->par.ep, tp = m->par.tp;
    if (tp > 1) {
        TERA_ASSERTF(counting || (m->par.tp_group && tera_comm_size(m->par.tp_group) == tp),
                     "tensor-parallel group for tp = %d", tp);
        static const char *const what[] = {"model.vocab_size", "model.n_heads", "model.n_kv_heads", "model.ffn_dim",
                                           "model.dense_ffn_dim"};
        const int v[] = {cfg->vocab_size, cfg->n_heads, cfg->n_kv_heads, cfg->ffn_dim, cfg->dense_ffn_dim};
        for (int i = 0; i < 5; i++)
            if (v[i] % tp != 0)
                return tera_fail(TERA_ERR_CONFIG, "parallel.tp = %d must divide %s = %d", tp, what[i], v[i]);
        if (!counting) m->tp_rank = tera_comm_rank(m->par.tp_group);
    }
    m->Hl = cfg->n_heads / tp, m->Hkvl = cfg->n_kv_heads / tp;
    m->Fl = cfg->ffn_dim / tp, m->Fsl = (int64_t)cfg->n_shared_experts * cfg->ffn_dim / tp;
    m->Fdl = cfg->dense_ffn_dim / tp;
    m->Vl = cfg->vocab_size / tp, m->v0 = (int64_t)m->tp_rank * m->Vl;
    {
        const int64_t N = (int64_t)B * T;
        m->loss_rows = cfg->loss_chunk > 0 && cfg->loss_chunk < N ? cfg->loss_chunk : N;
    }
    if (ep > 1) {
        TERA_ASSERTF(counting || (m->par.group && tera_comm_size(m->par.group) == ep),
                     "expert-parallel group of %d ranks for ep = %d", m->par.group ? tera_comm_size(m->par.group) : 0, ep);
        if (cfg->n_experts % ep != 0)
            return tera_fail(TERA_ERR_CONFIG, "parallel.ep = %d must divide model.n_experts = %d", ep, cfg->n_experts);
        if (!counting) m->ep_rank = tera_comm_rank(m->par.group);
    }
    if (T > cfg->max_seq_len)
        return tera_fail(TERA_ERR_CONFIG, "training.seq_len = %d exceeds model.max_seq_len = %d", T,
                         cfg->max_seq_len);
    m->cfg = *cfg;
    m->B = B;
    m->T = T;
    /* sequence parallelism: the rows of the residual stream this rank keeps */
    const int64_t N = (int64_t)B * T;
    m->par.sp = m->par.sp && tp > 1;
    if (m->par.sp && N % tp != 0)
        return tera_fail(TERA_ERR_CONFIG,
                         "parallel.sequence_parallel: parallel.tp = %d must divide the %ld rows of a micro-batch "
                         "(training.micro_batch x training.seq_len)", tp, (long)N);
    m->Nr = m->par.sp ? N / tp : N;
    m->r0 = m->par.sp ? m->tp_rank * m->Nr : 0;
    /* pipeline parallelism: this rank's layers (and the embedding / head on the end stages) */
    const int pp = m->par.pp > 1 ? m->par.pp : 1, vch = m->par.v > 1 ? m->par.v : 1;
    m->par.pp = pp, m->par.v = vch;
    m->n_slots = m->par.n_slots > 1 ? m->par.n_slots : 1;
    m->held = tera_calloc((size_t)cfg->n_layers, 1);
    m->layer_first = tera_calloc((size_t)(pp * vch + 1), sizeof(int));
    if (pp > 1) {
        TERA_ASSERTF(m->par.layer_first, "pipeline parallelism needs the layer split");
        memcpy(m->layer_first, m->par.layer_first, sizeof(int) * (size_t)(pp * vch + 1));
        for (int st = m->par.pp_rank; st < pp * vch; st += pp)
            for (int l = m->layer_first[st]; l < m->layer_first[st + 1]; l++) m->held[l] = 1;
    } else {
        m->layer_first[1] = cfg->n_layers;
        memset(m->held, 1, (size_t)cfg->n_layers);
    }
    m->par.layer_first = m->layer_first;
    return TERA_OK;
}

/* The expert-exchange buffers (bytes_comm, and its part inside the activations): xr of each MoE
 * layer that keeps it, per slot, and once in the shared work set when a MoE layer recomputes fully
 * (activations); the dispatcher's dyr, dxr (scratch: dxr also holds the forward's results sent back). */
static void comm_bytes(const tera_model *m, const tera_dispatcher *dispatch, int64_t *comm, int64_t *comm_acts) {
    int kept_moe = 0, full_moe = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if (!m->held[l] || !is_moe(&m->cfg, l)) continue;
        if (m->recompute[l] == TERA_RECOMPUTE_FULL) full_moe = 1;
        else kept_moe++;
    }
    tera_dispatch_sizes ex; /* 0 rows: local experts, nothing exchanged */
    tera_dispatch_exchange_sizes(dispatch, &ex);
    *comm_acts = (int64_t)(kept_moe * m->n_slots + full_moe) * ex.rows * m->cfg.dim * (int64_t)sizeof(float);
    *comm = *comm_acts + tera_dispatch_comm_bytes(dispatch);
}

static tera_status count(const tera_model_config *cfg, int B, int T, const tera_model_par *par, int table,
                         tera_model_bytes *out) {
    memset(out, 0, sizeof *out);
    tera_backend *be = par && par->be ? par->be : tera_backend_cpu_create(-1);
    tera_model m;
    tera_status st = set_shape(&m, cfg, B, T, par, be, 1);
    const int L = cfg->n_layers;
    if (st == TERA_OK) {
        const tera_shard_spec spec = {.ep = m.par.ep, .tp = m.par.tp, .pp = m.par.pp, .pp_rank = m.par.pp_rank,
                                      .v = m.par.v, .layer_first = m.layer_first};
        if (table) free(tera_param_table_spec(cfg, &spec, &m.n_params, &m.n_floats, &m.n_dense_floats));
        m.recompute = tera_calloc((size_t)L, 1);
        st = tera_recompute_parse(cfg->recompute, L, m.recompute);
    }
    if (st == TERA_OK) {
        out->n_floats = m.n_floats, out->n_dense = m.n_dense_floats;
        out->params = m.par.shard_params ? 0 : m.n_floats * (int64_t)sizeof(float);
        out->grads = m.par.shard_grads ? 0 : m.n_floats * (int64_t)sizeof(float);
        /* slot 0 carves the work set, every other slot the same as slot 1: two slots counted */
        const int ns = m.n_slots, nc = ns > 1 ? 2 : 1;
        m.slots = tera_calloc((size_t)nc, sizeof(tera_acts));
        tera_dispatcher *dispatch = tera_dispatch_create_sizes(cfg, B, T, m.Fl, &m.par);
        for (int i = 0; i < nc; i++) {
            tera_acts *a = &m.slots[i];
            a->layer = tera_calloc((size_t)L, sizeof(layer_acts));
            a->policy = m.recompute;
            a->dispatch = dispatch;
            carver c = {0};
            carve_acts(a, &c, &m);
            out->acts += (int64_t)c.off * (i == 0 ? 1 : ns - 1);
        }
        carver c = {0};
        carve_scratch(&m.slots[0], &c, &m);
        out->scratch = (int64_t)c.off + tera_dispatch_bytes(dispatch) + tera_tp_scratch_bytes(m.par.tp, (int64_t)B * T, cfg->dim, m.par.sp);
        comm_bytes(&m, dispatch, &out->comm, &out->comm_acts);
        for (int i = 0; i < nc; i++) free(m.slots[i].layer);
        free(m.slots);
        tera_dispatch_destroy(dispatch);
    }
    free(m.recompute);
    free(m.held);
    free(m.layer_first);
    if (!(par && par->be)) tera_backend_destroy(be);
    return st;
}

tera_status tera_model_count(const tera_model_config *cfg, int B, int T, const tera_model_par *par,
                             tera_model_bytes *out) {
    return count(cfg, B, T, par, 1, out);
}

tera_status tera_model_count_acts(const tera_model_config *cfg, int B, int T, const tera_model_par *par,
                                  tera_model_bytes *out) {
    return count(cfg, B, T, par, 0, out);
}

static tera_status create_par(tera_model *m, const tera_model_config *cfg, int B, int T, const tera_model_par *par,
                              tera_backend *be) {
    TERA_TRY(set_shape(m, cfg, B, T, par, be, 0));
    const int ep = m->par.ep, tp = m->par.tp, pp = m->par.pp, vch = m->par.v;
    const tera_shard_spec spec = {.ep = ep, .ep_rank = m->ep_rank, .tp = tp, .tp_rank = m->tp_rank, .pp = pp,
                                  .pp_rank = m->par.pp_rank, .v = vch, .layer_first = m->layer_first};
    m->params = tera_param_table_spec(cfg, &spec, &m->n_params, &m->n_floats, &m->n_dense_floats);
    group_index_build(m);
    /* ZeRO-3 / ZeRO-2: the trainer holds shards and binds each group's parameters / gradients
     * (tera_model_bind_group) when the use_params / use_grads callbacks ask for them */
    if (!m->par.shard_params) m->w = tera_calloc((size_t)m->n_floats, sizeof(float));
    if (!m->par.shard_grads) m->g = tera_calloc((size_t)m->n_floats, sizeof(float));
    m->g_stale = tera_calloc((size_t)cfg->n_layers + 2, 1);
    m->g_absent = tera_calloc((size_t)cfg->n_layers * (size_t)(cfg->n_experts / ep) + 1, 1);
    m->bytes_params = m->w ? m->n_floats * (int64_t)sizeof(float) : 0;
    m->bytes_grads = m->g ? m->n_floats * (int64_t)sizeof(float) : 0;
    make_views(&m->W, m->w, m);
    make_views(&m->G, m->g, m);
    for (int l = 0; l < cfg->n_layers; l++) m->n_moe_layers += is_moe(cfg, l);
    m->router_bias = tera_calloc((size_t)cfg->n_layers * (size_t)cfg->n_experts, sizeof(float));
    m->expert_load = tera_calloc((size_t)cfg->n_layers * (size_t)cfg->n_experts, sizeof(int64_t));
    m->router_entropy = tera_calloc((size_t)cfg->n_layers, sizeof(double));

    /* activation slots: one per micro-batch a pipeline stage holds at once (1 without a pipeline);
     * the scratch block is shared (carved once, every slot points into it) */
    m->recompute = tera_calloc((size_t)cfg->n_layers, 1);
    tera_status rst = tera_recompute_parse(cfg->recompute, cfg->n_layers, m->recompute);
    m->cfg.recompute = NULL; /* the caller's string; the parsed policy is m->recompute */
    if (rst != TERA_OK) {
        tera_model_destroy(m);
        return rst;
    }
    const int ns = m->n_slots;
    m->slots = tera_calloc((size_t)ns, sizeof(tera_acts));
    carver c = {0};
    tera_acts *a0 = &m->slots[0];
    /* the modules the slots share: token dispatcher (local or all-to-all), tensor-parallel layers */
    tera_dispatcher *dispatch = tera_dispatch_create(cfg, B, T, m->Fl, &m->par, m->ep_rank);
    tera_tp *tpl = tera_calloc(1, sizeof(tera_tp));
    tera_tp_init(tpl, m->be, tp, m->par.tp_group, m->tp_rank, cfg->vocab_size, (int64_t)B * T, cfg->dim, m->par.sp);
    tpl->overlap = m->par.tp_overlap;
    for (int i = 0; i < ns; i++) {
        tera_acts *a = &m->slots[i];
        a->layer = tera_calloc((size_t)cfg->n_layers, sizeof(layer_acts));
        a->policy = m->recompute;
        a->work_owner = -1;
        a->dispatch = dispatch;
        a->tp = tpl;
        c = (carver){0};
        carve_acts(a, &c, m);
        a->act_block = tera_malloc(c.off);
        memset(a->act_block, 0, c.off);
        m->bytes_acts += (int64_t)c.off;
        c = (carver){.base = a->act_block};
        carve_acts(a, &c, m);
    }
    c = (carver){0};
    carve_scratch(a0, &c, m);
    a0->scratch_block = tera_malloc(c.off);
    memset(a0->scratch_block, 0, c.off);
    m->bytes_scratch = (int64_t)c.off + tera_dispatch_bytes(dispatch) + tpl->bytes;
    for (int i = 0; i < ns; i++) {
        tera_acts *a = &m->slots[i];
        c = (carver){.base = a0->scratch_block};
        carve_scratch(a, &c, m);
        a->threads = m->be->ops.max_threads(m->be);
        m->be->ops.rope_tables(m->be, a->rope_cos, a->rope_sin, T, cfg->dim / cfg->n_heads, cfg->rope_theta);
    }
    comm_bytes(m, dispatch, &m->bytes_comm, &m->bytes_comm_acts); /* the expert-exchange buffers */
    if (m->par.head_role) { /* parallel.pp_head_split: half of each tp rank's head rows on the first stage */
        TERA_ASSERTF(m->Vl % 2 == 0 && !m->par.shard_params && !m->par.shard_grads && !cfg->tie_embeddings &&
                         m->loss_rows == (int64_t)B * T && m->par.pp > 1 &&
                         m->par.pp_rank == (m->par.head_role == TERA_HS_OWNER ? m->par.pp - 1 : 0),
                     "head split (role %d) on stage %d of %d with a vocabulary slice of %ld, ZeRO sharding, tied "
                     "embeddings or a loss chunk: the config refuses these", m->par.head_role, m->par.pp_rank,
                     m->par.pp, (long)m->Vl);
        m->hs = tera_head_split_create(m->par.head_role, m->par.head_group, tpl,
                                       m->par.head_role == TERA_HS_HELPER ? m->par.defer_wgrad : 0);
        m->bytes_scratch += m->hs->bytes;
    }
    if (m->par.defer_wgrad > 0 && m->par.pp > 1 && m->par.pp_rank == m->par.pp - 1) { /* parallel.pp_defer_wgrad */
        TERA_ASSERTF(!m->par.shard_params && !m->par.shard_grads && !cfg->tie_embeddings && m->loss_rows == (int64_t)B * T,
                     "deferred head weight gradients with ZeRO sharding, tied embeddings or a loss chunk: the config "
                     "refuses these");
        const int64_t h0 = m->par.head_role == TERA_HS_OWNER ? m->Vl / 2 : 0;
        m->wgq = tera_wgrad_create(m->be, m->par.defer_wgrad, (int64_t)B * T, cfg->dim, m->Vl - h0);
        m->bytes_scratch += m->wgq->bytes;
    }
    tera_model_use_slot(m, 0);
    return TERA_OK;
}

int64_t tera_model_head_split_bytes(const tera_model_config *cfg, int B, int T, int role, int tp, int sp) {
    return tera_head_split_bytes(role, cfg->vocab_size, cfg->dim, (int64_t)B * T, tp, sp);
}

int64_t tera_model_wgrad_bytes(const tera_model_config *cfg, int B, int T, int tp, int pp, int pp_rank, int head_role,
                               int entries) {
    if (entries <= 0 || pp < 2) return 0;
    const int64_t N = (int64_t)B * T, Vl = cfg->vocab_size / (tp > 0 ? tp : 1); /* a tp rank's slice */
    if (head_role == TERA_HS_HELPER) return tera_wgrad_bytes(entries, N, cfg->dim, Vl / 2); /* in the split's block */
    if (pp_rank != pp - 1) return 0;
    return tera_wgrad_bytes(entries, N, cfg->dim, head_role == TERA_HS_OWNER ? Vl - Vl / 2 : Vl);
}

static void notify_grads(tera_model *m, int group);

/* the seconds the queues' products have run (the helper's and the last stage's) */
static double wgrad_seconds(const tera_model *m) {
    return (m->hs && m->hs->wq ? m->hs->wq->run_s : 0.0) + (m->wgq ? m->wgq->run_s : 0.0);
}

int tera_model_wgrad_run(tera_model *m, double *seconds) {
    const double s0 = wgrad_seconds(m);
    const int ran = tera_head_split_work(m->hs) || (m->wgq && tera_wgrad_run(m->wgq)); /* the helper's, or ours */
    *seconds += wgrad_seconds(m) - s0;
    return ran;
}

int tera_model_wgrad_flush(tera_model *m, double *seconds) {
    const double s0 = wgrad_seconds(m);
    int n = tera_head_split_finish(m->hs); /* the helper: then its rows' gradient goes to the owner */
    if (m->wgq) n += tera_wgrad_flush(m->wgq);
    *seconds += wgrad_seconds(m) - s0;
    if (m->wgq && m->wgq_due) { /* the step's last micro-batch: the head's gradient is final now, as the backward would say */
        if (m->hs) tera_head_split_grads_in(m->hs); /* rows [0, Vh) first */
        void (*fn)(void *, int64_t, int64_t) = m->grad_ready;
        void *ctx = m->grad_ready_ctx;
        m->grad_ready = m->wgq_ready, m->grad_ready_ctx = m->wgq_ready_ctx;
        notify_grads(m, TERA_GROUP_HEAD);
        m->grad_ready = fn, m->grad_ready_ctx = ctx;
        m->wgq_due = 0;
    }
    return n;
}

void tera_model_set_yield(tera_model *m, void (*fn)(void *ctx), void *ctx) {
    m->yield = fn, m->yield_ctx = fn ? ctx : NULL;
    tera_dispatch_set_yield(m->slots[0].dispatch, fn, ctx); /* every slot shares the dispatcher */
}

void tera_model_head_split_begin(tera_model *m, int micro_batches) {
    if (m->hs) tera_head_split_begin(m->hs, m->W.lm_head, m->G.lm_head, micro_batches);
}
int tera_model_head_split_ready(tera_model *m) { return m->hs ? tera_head_split_ready(m->hs) : -1; }
tera_comm_req *tera_model_head_split_pending(tera_model *m) { return m->hs ? tera_head_split_pending(m->hs) : NULL; }
void tera_model_head_split_serve(tera_model *m, const int32_t *targets, float ce_scale) {
    tera_head_split_serve(m->hs, m->be, targets, ce_scale);
}
void tera_model_head_split_end(tera_model *m) {
    if (m->hs) tera_head_split_end(m->hs);
}

void tera_model_use_slot(tera_model *m, int slot) {
    TERA_ASSERTF(slot >= 0 && slot < m->n_slots, "activation slot %d of %d", slot, m->n_slots);
    m->acts = &m->slots[slot];
    m->logits = m->acts->logits;
}

tera_status tera_model_create_par(tera_model *m, const tera_model_config *cfg, int B, int T,
                                  const tera_model_par *par) {
    tera_backend *be = par && par->be ? par->be : tera_backend_cpu_create(-1);
    const tera_status st = create_par(m, cfg, B, T, par, be);
    if (st != TERA_OK && m->be) { /* failed before the model held anything (else destroyed with it) */
        tera_backend_destroy(m->be);
        m->be = NULL;
    }
    return st;
}

void tera_model_destroy(tera_model *m) {
    if (!m->params) return;
    tera_head_split_destroy(m->hs);
    tera_wgrad_destroy(m->wgq);
    tera_backend_destroy(m->be);
    free(m->params);
    free(m->group_off);
    free(m->group_idx);
    if (!m->w_external) free(m->w);
    if (!m->g_external) free(m->g);
    free(m->g_stale);
    free(m->g_absent);
    free(m->W.layers);
    free(m->G.layers);
    free(m->router_bias);
    free(m->expert_load);
    free(m->router_entropy);
    if (m->slots) {
        for (int i = 0; i < m->n_slots; i++) {
            free(m->slots[i].act_block);
            free(m->slots[i].layer);
        }
        free(m->slots[0].scratch_block);
        tera_dispatch_destroy(m->slots[0].dispatch);
        if (m->slots[0].tp) tera_tp_free(m->slots[0].tp);
        free(m->slots[0].tp);
        free(m->slots);
    }
    free(m->held);
    free(m->layer_first);
    free(m->recompute);
    memset(m, 0, sizeof *m);
}

static uint64_t name_key(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a, then a strong finaliser */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return tera_hash64(h);
}

void tera_model_init_weights(tera_model *m, uint64_t seed) {
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        float *w = m->w + p->offset;
        if (p->init_one) {
            for (int64_t j = 0; j < p->numel; j++) w[j] = 1.0f;
            continue;
        }
        /* element (i0, i1, i2) of this rank's block is element (lo + i) of the whole tensor */
        m->be->ops.fill_normal_block(m->be, w, p->numel, p->shape, p->lo, p->len, p->init_std, seed, name_key(p->name));
    }
    memset(m->router_bias, 0, sizeof(float) * (size_t)m->cfg.n_layers * (size_t)m->cfg.n_experts);
}

/* local experts per rank: the rows of g_absent */
static int64_t local_experts(const tera_model *m) { return m->cfg.n_experts / (m->par.ep > 1 ? m->par.ep : 1); }

/* clears the marks of group (layers only: the others have no routed experts) */
static void absent_clear(tera_model *m, int group) {
    const int64_t El = local_experts(m);
    if (group == TERA_GROUP_ALL) memset(m->g_absent, 0, (size_t)(m->cfg.n_layers * El));
    else if (group >= 0) memset(m->g_absent + group * El, 0, (size_t)El);
}

void tera_model_zero_grad(tera_model *m) {
    if (m->g) memset(m->g, 0, sizeof(float) * (size_t)m->n_floats);
    memset(m->g_stale, 0, (size_t)m->cfg.n_layers + 2);
    absent_clear(m, TERA_GROUP_ALL);
}

/* the gradient slabs of every marked expert zeroed, the marks cleared (sparse turned off) */
static void grads_materialize(tera_model *m) {
    const int64_t El = local_experts(m);
    for (int p = 0; p < m->n_params; p++) {
        const tera_param *q = &m->params[p];
        float *gp = q->expert_stacked && q->numel > 0 ? view_of(&m->G, q) : NULL;
        if (!gp) continue;
        const int64_t slab = q->numel / q->len[0];
        for (int64_t e = 0; e < q->len[0]; e++)
            if (m->g_absent[q->layer * El + e]) tera_host_fill(m->be, gp + e * slab, NULL, slab);
    }
    absent_clear(m, TERA_GROUP_ALL);
}

void tera_model_grads_sparse(tera_model *m, int on) {
    if (!on && m->g_sparse) grads_materialize(m);
    m->g_sparse = on && m->g && m->cfg.n_experts > 0;
}

/* the marks of layer l's local experts ([El]) for the dispatcher; NULL when sparse is off */
static uint8_t *grads_absent(const tera_model *m, int l) {
    return m->g_sparse && l >= 0 && l < m->cfg.n_layers ? m->g_absent + l * local_experts(m) : NULL;
}

void tera_model_grads_stale(tera_model *m, int group) {
    if (group == TERA_GROUP_ALL) memset(m->g_stale, 1, (size_t)m->cfg.n_layers + 2);
    else m->g_stale[group_slot(m, group)] = 1;
    absent_clear(m, group); /* the group's next backward decides its marks again */
}

void tera_model_group_zero_gaps(const tera_model *m, int group, int experts, float *base) {
    int64_t lo, hi;
    tera_model_group_range(m, group, experts, &lo, &hi);
    int64_t at = lo; /* the table's order is the offsets' order within a region (params.c) */
    group_iter it = group_begin(m, group);
    for (int i; (i = group_next(m, &it)) >= 0;) {
        const tera_param *p = &m->params[i];
        if (p->expert_stacked != experts || p->numel == 0) continue;
        TERA_ASSERTF(p->offset >= at, "%s: parameter offsets out of table order", p->name);
        if (p->offset > at) memset(base + (at - lo), 0, sizeof(float) * (size_t)(p->offset - at));
        at = p->offset + p->numel;
    }
}

void tera_model_grads_settle(tera_model *m) {
    const int L = m->cfg.n_layers;
    for (int i = 0; i < L + 2; i++) {
        if (!m->g_stale[i]) continue;
        const int group = i < L ? i : i == L ? TERA_GROUP_EMBED : TERA_GROUP_HEAD;
        group_iter it = group_begin(m, group);
        for (int p; (p = group_next(m, &it)) >= 0;) {
            const tera_param *q = &m->params[p];
            float *gp = view_of(&m->G, q);
            if (q->numel > 0 && gp) tera_host_fill(m->be, gp, NULL, q->numel);
        }
        m->g_stale[i] = 0;
        absent_clear(m, group);
    }
}

/* Before group's backward writes its gradients: the beta of its weight-gradient products. 0 (store)
 * where the group is stale, after zeroing the tensors the backward adds into (1-D weights: the norms'
 * sums over rows; the embedding table: a scatter; the experts: the dispatcher zeroes those no row
 * reaches); the group is current from then on. 1 (add) otherwise. The tied LM head is the embedding
 * table, stored by the head's product: see tera_model_backward_range. */
static float grads_begin(tera_model *m, int group) {
    unsigned char *st = &m->g_stale[group_slot(m, group)];
    if (!*st) return 1.0f;
    *st = 0;
    group_iter it = group_begin(m, group);
    for (int p; (p = group_next(m, &it)) >= 0;) {
        const tera_param *q = &m->params[p];
        if (q->numel == 0 || (q->ndim >= 2 && q->kind != TERA_P_EMBED)) continue;
        float *gp = view_of(&m->G, q);
        TERA_ASSERTF(gp, "gradients of %s written before they are bound", q->name);
        tera_host_fill(m->be, gp, NULL, q->numel);
    }
    return 0.0f;
}

void tera_model_reset_load(tera_model *m) {
    memset(m->expert_load, 0, sizeof(int64_t) * (size_t)m->cfg.n_layers * (size_t)m->cfg.n_experts);
    memset(m->router_entropy, 0, sizeof(double) * (size_t)m->cfg.n_layers);
    m->routed_tokens = 0;
}

/* ------------------------------------------------------------------------------ forward */

/* SwiGLU hidden activations of x[N,D]: a1 = x w1^T, a3 = x w3^T, g = silu(a1) * a3 ([N,F]). */
static void ffn_hidden(tera_backend *be, float *a1, float *a3, float *g, const float *x, const float *w1, const float *w3,
                       int64_t N, int64_t D, int64_t F) {
    float *const y[2] = {a1, a3};
    const float *const w[2] = {w1, w3};
    const int64_t out[2] = {F, F};
    tera_linear_forward_multi(be, 2, y, x, w, out, N, D); /* x converted once for both */
    tera_swiglu_forward_act(be, g, a1, a3, N * F); /* g: read by the w2 products only */
}

/* SwiGLU FFN on all N rows: y[N,D] += w2(silu(x w1^T) * (x w3^T)). */
static void ffn_forward(tera_backend *be, float *y, float *a1, float *a3, float *g, const float *x, const float *w1,
                        const float *w3, const float *w2, int64_t N, int64_t D, int64_t F) {
    ffn_hidden(be, a1, a3, g, x, w1, w3, N, D, F);
    tera_linear_forward_act(be, y, g, w2, N, F, D, 1.0f);
}

/* The shared experts' work the dispatcher runs while the layer's rows travel (tera_dispatch_side_work,
 * parallel.ep_overlap): the forward's hidden activations (its w2 product adds into the layer's output
 * after the combine, as before), the whole backward (dln = its input gradient before the routed rows'
 * are added, as before). */
typedef struct {
    tera_model *m;
    int l;
    const float *x;    /* [N, D] the MoE block's input (the backward: whole once rq completes) */
    const float *dy;   /* [N, D] the block's output gradient (backward) */
    tera_comm_req *rq; /* the backward: x's gather in flight (sequence parallelism) */
    float dw_beta;
} shared_side;

static void shared_forward_side(void *ctx) {
    const shared_side *s = ctx;
    tera_model *m = s->m;
    layer_acts *la = &m->acts->layer[s->l];
    const tera_layer_view *W = &m->W.layers[s->l];
    TERA_PROF(DENSE_FWD, ffn_hidden(m->be, la->fa1, la->fa3, la->fg, s->x, W->sw1, W->sw3, (int64_t)m->B * m->T,
                                    m->cfg.dim, m->Fsl));
}

/* The MoE block: the router (moe.c), then the token dispatcher (dispatch.c: local or all-to-all)
 * permutes the routed rows, runs the experts and combines their outputs into out; the shared
 * experts add theirs. */
static void moe_forward(tera_model *m, int l, float *out, const float *x /* [N, D] the norm's output */) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    layer_acts *la = &a->layer[l];
    const tera_layer_view *W = &m->W.layers[l];
    const int B = m->B, T = m->T, E = c->n_experts, K = c->top_k;
    const int64_t N = (int64_t)B * T, D = c->dim;

    TERA_PROF(ROUTER_FWD, {
        m->be->ops.linear_forward_fp32(m->be, la->rlogits, x, W->router, N, D, E, 0.0f);
        tera_moe_score_forward(m->be, la->probs, la->rlse, la->rlogits, N, E, c->router_score);
        const tera_moe_routing route = tera_moe_routing_of(c);
        tera_moe_route_at(m->be, la->topi, la->topw, la->probs, c->aux_free ? m->router_bias + (int64_t)l * E : NULL, N,
                          E, K, &route, a->route_scratch, T, NULL, l); /* rows b*T + t: position t */
    });
    const int64_t dropped = tera_dispatch_permute(a->dispatch, &la->moe, x, la->topi, la->probs, l);
    m->stats.n_assign += N * K;
    m->stats.n_dropped += dropped;

    /* load statistics: aux loss per sequence, z-loss, expert load, router entropy */
    {
        TERA_PROF_BEGIN(ROUTER_FWD);
        const tera_moe_stats st = tera_moe_route_stats(m->be, m->expert_load + (int64_t)l * E, a->rsum, a->route_p,
                                                       la->probs, la->rlogits, la->rlse, la->moe.sel_count, B, T, E, K,
                                                       c->router_score);
        TERA_PROF_END(ROUTER_FWD);
        m->router_entropy[l] += st.entropy;
        if (l == c->first_k_dense) m->routed_tokens += N;
        if (c->balance_loss == TERA_BALANCE_SWITCH_DP) { /* the counts of every data-parallel rank's micro-batch */
            double *cnt = a->route_p; /* row 0 of route_p: row B, the sums the value needs, stays */
            for (int e = 0; e < E; e++) {
                int64_t n = 0;
                for (int b = 0; b < B; b++) n += la->moe.sel_count[b * E + e];
                cnt[e] = (double)n;
            }
            const int dp = m->par.dp_group ? tera_comm_size(m->par.dp_group) : 1;
            if (dp > 1) tera_comm_allreduce_f64(m->par.dp_group, cnt, E);
            for (int e = 0; e < E; e++) la->gcnt[e] = (float)(cnt[e] / dp);
        }
        m->stats.aux_sum += tera_moe_balance_value(c->balance_loss, st.aux, a->route_p, la->topi, la->topw,
                                                   la->moe.sel_count, la->gcnt, B, T, E, K); /* model.balance_loss */
        m->stats.z_sum += st.z;
    }

    shared_side side = {.m = m, .l = l, .x = x};
    if (c->n_shared_experts > 0) tera_dispatch_side_work(a->dispatch, shared_forward_side, &side);
    tera_dispatch_experts_forward(a->dispatch, &la->moe, W, l);
    tera_dispatch_combine_forward(a->dispatch, out, &la->moe, la->topw);
    if (c->n_shared_experts > 0)
        TERA_PROF(DENSE_FWD, tera_linear_forward_act(m->be, out, la->fg, W->sw2, N, m->Fsl, D, 1.0f));
}

static void need_params(tera_model *m, int group) {
    if (m->use_params) m->use_params(m->bind_ctx, group);
}

static void need_grads(tera_model *m, int group) {
    if (m->use_grads) m->use_grads(m->bind_ctx, group);
}

/* The shared work set now holds layer l's activations of the slot in use: every other slot's
 * claim on it is gone. */
static void claim_work(tera_model *m, int l) {
    for (int i = 0; i < m->n_slots; i++) m->slots[i].work_owner = -1;
    m->acts->work_owner = l;
}

/* One layer: attention (column-parallel q/k/v, row-parallel o_proj with the residual), then the FFN
 * block (MoE or dense; a row-parallel block that adds into out after the residual). */
static void layer_forward(tera_model *m, int l, float *out) {
    const tera_model_config *c = &m->cfg;
    layer_acts *la = &m->acts->layer[l];
    const tera_tp *tp = m->acts->tp;
    const tera_layer_view *W = &m->W.layers[l];
    const int B = m->B, T = m->T, H = (int)m->Hl, Hkv = (int)m->Hkvl; /* this rank's heads */
    const int64_t N = (int64_t)B * T, D = c->dim, hd = D / c->n_heads;

    const float *ln1 = tera_tp_norm_input(tp, la->ln1, la->rstd1, la->x_in, W->attn_norm, N, D, c->norm_eps);
    TERA_PROF(QKV_FWD, {
        float *const y[3] = {la->q, la->k, la->v};
        const float *const w[3] = {W->wq, W->wk, W->wv};
        const int64_t widths[3] = {H * hd, Hkv * hd, Hkv * hd};
        tera_linear_forward_multi(m->be, 3, y, ln1, w, widths, N, D); /* ln1 converted once */
    });
    TERA_PROF(ROPE_FWD, {
        if (m->be->ops.rope_qk_forward) { /* q and k in one pass */
            m->be->ops.rope_qk_forward(m->be, la->q, la->k, m->acts->rope_cos, m->acts->rope_sin, B, T, H, Hkv, (int)hd);
        } else {
            m->be->ops.rope_forward(m->be, la->q, m->acts->rope_cos, m->acts->rope_sin, B, T, H, (int)hd);
            m->be->ops.rope_forward(m->be, la->k, m->acts->rope_cos, m->acts->rope_sin, B, T, Hkv, (int)hd);
        }
    });
    TERA_PROF(ATTN_FWD, m->be->ops.attention_forward(m->be, la->att, la->att_lse, la->q, la->k, la->v, B, T, H, Hkv,
                                               (int)hd, m->acts->attn_scratch));
    tera_tp_row_linear_residual_forward(tp, la->h, la->att, W->wo, la->x_in, N, H * hd, D);
    if (m->yield) m->yield(m->yield_ctx);
    /* the FFN block adds into acc: out (begun at the residual), or the partial sums' buffer */
    const float *ln2; /* the whole [N, D] (sequence parallelism: la->ln2 keeps the rank's rows) */
    float *acc = tera_tp_norm_block_begin(tp, la->ln2, la->rstd2, out, la->h, W->ffn_norm, N, D, c->norm_eps, &ln2);
    if (is_moe(c, l))
        moe_forward(m, l, acc, ln2);
    else
        TERA_PROF(DENSE_FWD, ffn_forward(m->be, acc, la->fa1, la->fa3, la->fg, ln2, W->dw1, W->dw3, W->dw2, N, D,
                                         m->Fdl));
    tera_tp_row_block_end(tp, out, acc, la->h, N, D);
}

void tera_model_weights_unchanged(tera_model *m) { m->acts->weights_same = 1; }

void tera_model_arm_fused_loss(tera_model *m, float ce_scale) {
    m->acts->ce_armed = 1;
    m->acts->ce_scale = ce_scale;
}

void tera_model_forward(tera_model *m, const int32_t *tokens, const int32_t *targets) {
    tera_model_forward_range(m, tokens, targets, 0, m->cfg.n_layers, NULL, NULL);
}

void tera_model_forward_range(tera_model *m, const int32_t *tokens, const int32_t *targets, int l0, int l1,
                              const float *x_in, float *x_out) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    const int L = c->n_layers;
    const int64_t N = (int64_t)m->B * m->T, D = c->dim, V = m->Vl;
    TERA_ASSERTF(m->be->ops.max_threads(m->be) <= a->threads,
                 "%d threads, but the model's scratch was sized for %d: set threads before tera_model_create",
                 m->be->ops.max_threads(m->be), a->threads);
    TERA_ASSERTF(0 <= l0 && l0 < l1 && l1 <= L, "layer range [%d, %d) of %d", l0, l1, L);
    for (int l = l0; l < l1; l++) TERA_ASSERTF(m->held[l], "layer %d is not on this pipeline stage", l);
    memset(&m->stats, 0, sizeof m->stats);
    tera_backend_weights_begin(m->be, !a->weights_same); /* unless told otherwise, the weights have changed */
    a->weights_same = 0;
    a->tokens = tokens;
    a->targets = targets;
    const int ce_armed = a->ce_armed; /* armed for this forward only */
    a->ce_armed = 0;
    a->ce_fused = 0;
    a->ce_deferred = 0;
    if (l0 > 0) {
        memcpy(a->layer[l0].x_in, x_in, sizeof(float) * (size_t)(m->Nr * D)); /* this rank's rows */
    } else {
        need_params(m, TERA_GROUP_EMBED);
        tera_tp_embedding_forward(a->tp, a->layer[0].x_in, m->W.embed, tokens, N, D);
    }
    a->work_owner = -1;
    for (int l = l0; l < l1; l++) {
        float *out = l + 1 < l1 ? a->layer[l + 1].x_in : (l1 == L ? a->x_final : x_out);
        need_params(m, l);
        layer_forward(m, l, out);
        if (a->policy[l] != TERA_RECOMPUTE_NONE) claim_work(m, l); /* its parts in the work set */
    }
    if (l1 < L) { /* the next stage goes on */
        tera_backend_weights_end(m->be);
        return;
    }
    need_params(m, TERA_GROUP_HEAD);
    if (c->tie_embeddings) need_params(m, TERA_GROUP_EMBED);
    tera_tp_norm_forward(a->tp, a->lnf, a->rstdf, a->x_final, m->W.final_norm, N, D, c->norm_eps);
    m->stats.n_positions = N;
    const int64_t R = m->loss_rows;
    if (R < N) { /* training.loss_chunk */
        a->ce_deferred = ce_armed; /* a training step: the head and the loss run in the backward (head_loss_backward) */
        if (!ce_armed) /* evaluation: the loss block by block, each block to on_logits */
            for (int64_t r0 = 0; r0 < N; r0 += R) {
                const int64_t n = N - r0 < R ? N - r0 : R;
                TERA_PROF(HEAD_FWD, m->be->ops.linear_forward(m->be, m->logits, a->lnf + r0 * D, m->W.lm_head, n, D, V, 0.0f));
                m->stats.ce_sum += tera_tp_ce_forward(a->tp, a->loss_lse + r0, m->logits, targets + r0, n);
                if (m->on_logits) m->on_logits(m->on_logits_ctx, m->logits, targets + r0, n);
            }
        tera_backend_weights_end(m->be);
        return;
    }
    /* parallel.pp_head_split, a training micro-batch: rows [Vh, V) here and [0, Vh) on the first stage, which
     * gets the final norm's output first; the loss meets over the pair as over a tensor-parallel group */
    tera_head_split *hs = ce_armed ? m->hs : NULL;
    const int64_t h0 = hs ? hs->Vh : 0;
    if (hs) tera_head_split_send_input(hs, a->lnf);
    TERA_PROF(HEAD_FWD, m->be->ops.linear_forward(m->be, m->logits, a->lnf, m->W.lm_head + h0 * D, N, D, V - h0, 0.0f));
    /* armed (a training step): the loss and its gradient over the logits in one pass; the targets'
     * logits go to dres, free until the backward */
    if (ce_armed && tera_tp_ce_fused(hs ? &hs->tp : a->tp, m->logits, a->loss_lse, a->dres, m->logits, targets, N,
                                     a->ce_scale, &m->stats.ce_sum)) {
        a->ce_fused = 1;
    } else {
        m->stats.ce_sum = tera_tp_ce_forward(a->tp, a->loss_lse, m->logits, targets, N);
        if (m->on_logits && !ce_armed) m->on_logits(m->on_logits_ctx, m->logits, targets, N);
    }
    tera_backend_weights_end(m->be);
}

/* ------------------------------------------------------------------------------ backward */

/* Backward of y += w2(silu(x w1^T) * (x w3^T)): dx += ..., weight grads = dw_beta grads + .... */
static void ffn_backward(tera_backend *be, tera_acts *a, float *dx, const float *dy, const float *x, const float *a1,
                         const float *a3, const float *g, const float *w1, const float *w3, const float *w2,
                         float *gw1, float *gw3, float *gw2, int64_t N, int64_t D, int64_t F, float dw_beta) {
    tera_linear_backward_act(be, a->dgact, gw2, dy, g, w2, N, F, D, 0.0f, dw_beta);
    be->ops.swiglu_backward(be, a->da1, a->da3, a->dgact, a1, a3, N * F);
    float *const dw[2] = {gw1, gw3};
    const float *const dyi[2] = {a->da1, a->da3}, *const w[2] = {w1, w3};
    const int64_t out[2] = {F, F};
    tera_linear_backward_multi(be, 2, dx, dw, dyi, x, w, out, N, D, 1.0f, dw_beta); /* x converted once for both */
}

/* parallel.tp_overlap: whether this model splits the backward's column-parallel products into their
 * input-gradient halves, the sum over the tensor-parallel ranks started, then the weight-gradient halves
 * (the same products, so the same bits; only the order of independent work changes) */
static int tp_split(const tera_acts *a) { return tera_tp_overlapping(a->tp); }

/* ffn_backward's input-gradient half (dx += ...; a->dgact, a->da1, a->da3 written and kept) ... */
static void ffn_backward_dx(tera_backend *be, tera_acts *a, float *dx, const float *dy, const float *x, const float *a1,
                            const float *a3, const float *g, const float *w1, const float *w3, const float *w2,
                            int64_t N, int64_t D, int64_t F) {
    tera_linear_backward_act(be, a->dgact, NULL, dy, g, w2, N, F, D, 0.0f, 1.0f);
    be->ops.swiglu_backward(be, a->da1, a->da3, a->dgact, a1, a3, N * F);
    float *const dw[2] = {NULL, NULL};
    const float *const dyi[2] = {a->da1, a->da3}, *const w[2] = {w1, w3};
    const int64_t out[2] = {F, F};
    tera_linear_backward_multi(be, 2, dx, dw, dyi, x, w, out, N, D, 1.0f, 1.0f);
}

/* ... and its weight-gradient half from them (gw2, gw1, gw3 = dw_beta gw + ...), polling the sum in flight
 * between products */
static void ffn_backward_dw(tera_acts *a, const float *dy, const float *x, const float *g, const float *w1,
                            const float *w3, const float *w2, float *gw1, float *gw3, float *gw2, int64_t N, int64_t D,
                            int64_t F, int prof, tera_comm_req *req, float dw_beta) {
    tera_backend *be = a->tp->be;
    const float *const dyi[3] = {dy, a->da1, a->da3}, *const xi[3] = {g, x, x}, *const w[3] = {w2, w1, w3};
    float *const dw[3] = {gw2, gw1, gw3};
    const int64_t in[3] = {F, D, D}, out[3] = {D, F, F};
    for (int i = 0; i < 3; i++) {
        const double t0 = tera_now();
        if (i == 0) /* g: in the backend's product format (tera_swiglu_forward_act) */
            tera_linear_backward_act(be, NULL, dw[i], dyi[i], xi[i], w[i], N, in[i], out[i], 0.0f, dw_beta);
        else
            be->ops.linear_backward(be, NULL, dw[i], dyi[i], xi[i], w[i], N, in[i], out[i], 0.0f, dw_beta);
        tera_prof_add(prof, t0);
        tera_tp_poll(a->tp, req);
    }
}

static void shared_backward_side(void *ctx) {
    const shared_side *s = ctx;
    tera_model *m = s->m;
    tera_acts *a = m->acts;
    const layer_acts *la = &a->layer[s->l];
    const tera_layer_view *W = &m->W.layers[s->l], *G = &m->G.layers[s->l];
    tera_tp_input_wait(a->tp, s->rq);
    TERA_PROF(DENSE_BWD, ffn_backward(m->be, a, a->dln, s->dy, s->x, la->fa1, la->fa3, la->fg, W->sw1, W->sw3, W->sw2,
                                      G->sw1, G->sw3, G->sw2, (int64_t)m->B * m->T, m->cfg.dim, m->Fsl, s->dw_beta));
}

static void moe_backward(tera_model *m, int l, const tera_loss_scales *s, float dw_beta) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    layer_acts *la = &a->layer[l];
    const tera_layer_view *W = &m->W.layers[l], *G = &m->G.layers[l];
    const int B = m->B, T = m->T, E = c->n_experts, K = c->top_k;
    const int64_t N = (int64_t)B * T, D = c->dim;
    const float *dy = a->dres; /* gradient of the layer output */
    /* [N, D] (sequence parallelism: gathered again, behind the combine's and the experts' backward
     * unless shared experts read it first) */
    tera_comm_req rq_ln;
    const float *ln2 = tera_tp_input_whole_start(a->tp, la->ln2, &rq_ln);

    /* dln accumulates every path into the MoE input; shared experts first (they write dln=), inside the
     * experts' call below (while the rows travel: shared_backward_side) */
    tera_host_fill(m->be, a->dln, NULL, N * D);
    shared_side side = {.m = m, .l = l, .x = ln2, .dy = dy, .rq = &rq_ln, .dw_beta = dw_beta};
    if (c->n_shared_experts > 0) tera_dispatch_side_work(a->dispatch, shared_backward_side, &side);
    tera_dispatch_combine_backward(a->dispatch, a->dtopw, dy, &la->moe, la->topw);
    /* tensor parallelism: each rank's expert outputs are partial sums over its hidden slice, so
     * are the combine-weight gradients: sum them before the router sees them */
    const int split = tp_split(a);
    tera_comm_req rq_w, rq_x; /* parallel.tp_overlap: the two sums in flight */
    if (split) { /* the combine weights' sum behind the experts' input gradients */
        tera_tp_copy_backward_start(a->tp, a->dtopw, N * K, &rq_w);
        tera_dispatch_experts_backward_dx(a->dispatch, &la->moe, W, G, l, a->da1, a->da3, a->dgact, &rq_w);
    } else {
        tera_tp_copy_backward(a->tp, a->dtopw, N * K);
        tera_dispatch_experts_backward(a->dispatch, &la->moe, W, G, l, a->da1, a->da3, a->dgact, dw_beta,
                                       grads_absent(m, l));
    }
    tera_dispatch_permute_backward(a->dispatch, a->dln, &la->moe);
    if (split) tera_tp_copy_backward_wait(a->tp, &rq_w); /* the combine weights' gradients, summed */
    /* The router (replicated) computes its whole input gradient on every tensor-parallel rank: each
     * rank adds it for its share of the rows, [r N/tp, (r+1) N/tp) (sequence parallelism: its own
     * rows), to its partial input gradient, so that the sum below counts it once (tp = 1: every row,
     * after the experts', as always) */
    const int tpn = m->par.tp > 1 ? m->par.tp : 1;
    const int64_t x0 = N * m->tp_rank / tpn, xn = N * (m->tp_rank + 1) / tpn - x0;
    tera_tp_input_wait(a->tp, &rq_ln);
    {
        TERA_PROF_BEGIN(ROUTER_BWD);
        const tera_moe_routing route = tera_moe_routing_of(c);
        float aux_s = s->aux; /* model.balance_loss: switch leaves it and returns NULL */
        const float *gcount = tera_moe_balance_backward_prep(m->be, c->balance_loss, a->route_p, a->dtopw, la->topi, la->topw,
                                                             la->moe.sel_count, la->gcnt, B, T, E, K, &aux_s);
        tera_moe_router_backward_g(m->be, a->drlogits, a->dprobs, la->rlogits, la->probs, la->rlse, la->topi, la->topw,
                                   a->dtopw, la->moe.sel_count, gcount, B, T, E, K, &route, aux_s, s->z);
        m->be->ops.linear_backward_fp32(m->be, a->dln + x0 * D, NULL, a->drlogits + x0 * E, ln2 + x0 * D, W->router,
                                        xn, D, E, 1.0f, 1.0f);
        TERA_PROF_END(ROUTER_BWD);
    }
    /* tensor parallelism: the experts' input gradients are partial sums; overlapped: the router's and
     * the experts' weight gradients while the sum is in flight */
    if (split) {
        tera_tp_dx_sum_start(a->tp, a->dln, &rq_x);
        TERA_PROF(ROUTER_BWD, m->be->ops.linear_backward_fp32(m->be, NULL, G->router, a->drlogits, ln2, W->router, N,
                                                              D, E, 1.0f, dw_beta));
        tera_dispatch_experts_backward_dw(a->dispatch, &la->moe, W, G, l, a->da1, a->da3, a->dgact, &rq_x, dw_beta,
                                          grads_absent(m, l));
        tera_tp_copy_backward_wait(a->tp, &rq_x);
    } else {
        TERA_PROF(ROUTER_BWD, m->be->ops.linear_backward_fp32(m->be, NULL, G->router, a->drlogits, ln2, W->router, N,
                                                              D, E, 1.0f, dw_beta));
        tera_tp_dx_sum(a->tp, a->dln);
    }
}

static void layer_backward(tera_model *m, int l, const tera_loss_scales *s) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    layer_acts *la = &a->layer[l];
    const tera_layer_view *W = &m->W.layers[l], *G = &m->G.layers[l];
    const int B = m->B, T = m->T, H = (int)m->Hl, Hkv = (int)m->Hkvl; /* this rank's heads */
    const int64_t N = (int64_t)B * T, D = c->dim, hd = D / c->n_heads;
    const float bw = grads_begin(m, l); /* every weight gradient of the layer: stored (0) or added (1) */

    /* FFN: a->dres holds dL/d(layer output); it becomes dL/dh after the norm backward (sequence
     * parallelism: this rank's rows of it, gathered before the layers that read every row). */
    tera_tp_gather_rows(a->tp, a->dres);
    const int split = tp_split(a);
    tera_comm_req rq; /* parallel.tp_overlap: the input gradient's sum in flight */
    if (is_moe(c, l)) {
        moe_backward(m, l, s, bw); /* sums the tensor-parallel partial input gradients itself */
    } else if (split) { /* the weight gradients while the input gradient is summed */
        const float *ln2 = tera_tp_input_whole(a->tp, la->ln2); /* sequence parallelism: gathered again */
        tera_host_fill(m->be, a->dln, NULL, N * D);
        TERA_PROF(DENSE_BWD, ffn_backward_dx(m->be, a, a->dln, a->dres, ln2, la->fa1, la->fa3, la->fg, W->dw1,
                                             W->dw3, W->dw2, N, D, m->Fdl));
        tera_tp_dx_sum_start(a->tp, a->dln, &rq);
        ffn_backward_dw(a, a->dres, ln2, la->fg, W->dw1, W->dw3, W->dw2, G->dw1, G->dw3, G->dw2, N, D, m->Fdl,
                        TERA_PROF_DENSE_BWD, &rq, bw);
        tera_tp_copy_backward_wait(a->tp, &rq);
    } else {
        const float *ln2 = tera_tp_input_whole(a->tp, la->ln2);
        tera_host_fill(m->be, a->dln, NULL, N * D);
        TERA_PROF(DENSE_BWD, ffn_backward(m->be, a, a->dln, a->dres, ln2, la->fa1, la->fa3, la->fg, W->dw1,
                                          W->dw3, W->dw2, G->dw1, G->dw3, G->dw2, N, D, m->Fdl, bw));
        tera_tp_dx_sum(a->tp, a->dln);
    }
    tera_tp_norm_backward(a->tp, a->dres, G->ffn_norm, a->dln, la->h, W->ffn_norm, la->rstd2, N, D);
    if (m->yield) m->yield(m->yield_ctx);
    tera_tp_gather_rows(a->tp, a->dres); /* dL/dh of every row, for o_proj */
    tera_comm_req rq_ln; /* sequence parallelism: ln1 gathered again behind o_proj's and attention's backward */
    const float *ln1 = tera_tp_input_whole_start(a->tp, la->ln1, &rq_ln); /* [N, D] */
    /* attention */
    TERA_PROF(OPROJ_BWD, m->be->ops.linear_backward(m->be, a->datt, G->wo, a->dres, la->att, W->wo, N, H * hd, D, 0.0f, bw));
    TERA_PROF(ATTN_BWD, m->be->ops.attention_backward(m->be, a->dq, a->dk, a->dv, a->datt, la->q, la->k, la->v, la->att,
                                                la->att_lse, B, T, H, Hkv, (int)hd, a->attn_scratch));
    TERA_PROF(ROPE_BWD, {
        if (m->be->ops.rope_qk_backward) {
            m->be->ops.rope_qk_backward(m->be, a->dq, a->dk, a->rope_cos, a->rope_sin, B, T, H, Hkv, (int)hd);
        } else {
            m->be->ops.rope_backward(m->be, a->dq, a->rope_cos, a->rope_sin, B, T, H, (int)hd);
            m->be->ops.rope_backward(m->be, a->dk, a->rope_cos, a->rope_sin, B, T, Hkv, (int)hd);
        }
    });
    if (m->yield) m->yield(m->yield_ctx);
    float *const dw[3] = {G->wq, G->wk, G->wv};
    const float *const dy[3] = {a->dq, a->dk, a->dv}, *const w[3] = {W->wq, W->wk, W->wv};
    const int64_t widths[3] = {H * hd, Hkv * hd, Hkv * hd};
    tera_tp_input_wait(a->tp, &rq_ln);
    if (split) { /* the heads' partial input gradients summed while the weight gradients are computed */
        float *const no_dw[3] = {NULL, NULL, NULL};
        TERA_PROF(QKV_BWD, tera_linear_backward_multi(m->be, 3, a->dln, no_dw, dy, ln1, w, widths, N, D, 0.0f, 1.0f));
        tera_tp_dx_sum_start(a->tp, a->dln, &rq);
        for (int i = 0; i < 3; i++) {
            TERA_PROF(QKV_BWD, m->be->ops.linear_backward(m->be, NULL, dw[i], dy[i], ln1, w[i], N, D, widths[i], 0.0f, bw));
            tera_tp_poll(a->tp, &rq);
        }
        tera_tp_copy_backward_wait(a->tp, &rq);
    } else {
        TERA_PROF(QKV_BWD, tera_linear_backward_multi(m->be, 3, a->dln, dw, dy, ln1, w, widths, N, D, 0.0f,
                                                      bw)); /* ln1 converted once */
        tera_tp_dx_sum(a->tp, a->dln); /* the heads' partial input gradients */
    }
    tera_tp_norm_backward(a->tp, a->dres, G->attn_norm, a->dln, la->x_in, W->attn_norm, la->rstd1, N, D);
    tera_tp_norm_grads_sum(a->tp); /* sequence parallelism: the two norms' weight gradients, summed over the ranks */
}

/* Brings back what layer l did not keep (tera_recompute), into the work set, before its backward.
 * The same code on the same inputs (kept x_in or q/k/v/xg/xr/ln2, unchanged weights and router
 * bias, the same thread layout, 64-byte aligned buffers at the same relative offsets) gives the
 * same bits. Nothing to do when the work set still holds layer l's (the last recomputing layer of
 * the forward). The statistics a MoE forward accumulates are restored afterwards: counted once.
 * A full recomputation reruns the layer's forward, exchanges between ranks included (every rank of
 * a group has the same policy, so they run it together). */
static void layer_recompute(tera_model *m, int l) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    const int policy = a->policy[l];
    if (policy == TERA_RECOMPUTE_NONE || a->work_owner == l) return;
    layer_acts *la = &a->layer[l];
    const tera_layer_view *W = &m->W.layers[l];
    const int B = m->B, T = m->T, H = (int)m->Hl, Hkv = (int)m->Hkvl, E = c->n_experts;
    const int64_t N = (int64_t)B * T, D = c->dim, hd = D / c->n_heads;
    a->work_owner = -1;
    if (policy == TERA_RECOMPUTE_FULL) {
        /* the layer's output is not needed: a->dln is free until layer_backward clears it */
        const tera_fwd_stats stats = m->stats;
        int64_t *load = a->expert_load_save;
        if (is_moe(c, l)) memcpy(load, m->expert_load + (int64_t)l * E, sizeof(int64_t) * (size_t)E);
        const double entropy = m->router_entropy[l];
        const int64_t routed = m->routed_tokens;
        layer_forward(m, l, a->dln);
        m->stats = stats;
        if (is_moe(c, l)) memcpy(m->expert_load + (int64_t)l * E, load, sizeof(int64_t) * (size_t)E);
        m->router_entropy[l] = entropy;
        m->routed_tokens = routed;
    } else { /* selective: attention core, then the FFN hidden activations */
        TERA_PROF(ATTN_FWD, m->be->ops.attention_forward(m->be, la->att, la->att_lse, la->q, la->k, la->v, B, T, H, Hkv,
                                                   (int)hd, a->attn_scratch));
        if (is_moe(c, l)) {
            tera_dispatch_experts_recompute(a->dispatch, &la->moe, W); /* from the kept xg (or xr) */
            if (c->n_shared_experts > 0) /* sequence parallelism: ln2 gathered again (and in the backward) */
                TERA_PROF(DENSE_FWD, ffn_hidden(m->be, la->fa1, la->fa3, la->fg, tera_tp_input_whole(a->tp, la->ln2),
                                                W->sw1, W->sw3, N, D, m->Fsl));
        } else {
            TERA_PROF(DENSE_FWD, ffn_hidden(m->be, la->fa1, la->fa3, la->fg, tera_tp_input_whole(a->tp, la->ln2), W->dw1,
                                            W->dw3, N, D, m->Fdl));
        }
    }
    claim_work(m, l);
}

/* Gradients of a group are final for this micro-batch: hand each contiguous range (non-expert
 * tensors, then expert tensors) to the trainer. */
static void notify_grads(tera_model *m, int group) {
    if (!m->grad_ready) return;
    for (int experts = 0; experts < 2; experts++) {
        int64_t lo, hi;
        tera_model_group_range(m, group, experts, &lo, &hi);
        if (hi > lo) m->grad_ready(m->grad_ready_ctx, lo, hi - lo);
    }
}

void tera_model_backward(tera_model *m, const tera_loss_scales *s) {
    tera_model_backward_range(m, s, 0, m->cfg.n_layers, NULL, NULL);
}

/* training.loss_chunk: the head over loss_rows rows at a time, into the logits' [loss_rows, Vl] block: its
 * product (again, where the forward computed the loss: not armed), the loss's gradient over the block (armed:
 * with the loss itself, ce_sum, in the same pass, as the forward's fused pass), the block's input gradient
 * (dln, written) and the weight gradient (hb: stored or added at the first block, added after it). */
static void head_loss_backward(tera_model *m, const tera_loss_scales *s, float hb) {
    tera_acts *a = m->acts;
    const int64_t N = (int64_t)m->B * m->T, D = m->cfg.dim, V = m->Vl, R = m->loss_rows;
    const int deferred = a->ce_deferred;
    a->ce_deferred = 0;
    double ce = 0.0;
    for (int64_t r0 = 0; r0 < N; r0 += R) {
        const int64_t n = N - r0 < R ? N - r0 : R;
        const float *x = a->lnf + r0 * D;
        const int32_t *tg = a->targets + r0;
        TERA_PROF(HEAD_FWD, m->be->ops.linear_forward(m->be, m->logits, x, m->W.lm_head, n, D, V, 0.0f));
        double cs = 0.0; /* the targets' logits to dres, free until the final norm's backward */
        if (!deferred) {
            tera_tp_ce_backward(a->tp, m->logits, m->logits, tg, n, s->ce);
        } else if (!tera_tp_ce_fused(a->tp, m->logits, a->loss_lse + r0, a->dres, m->logits, tg, n, s->ce, &cs)) {
            cs = tera_tp_ce_forward(a->tp, a->loss_lse + r0, m->logits, tg, n);
            tera_tp_ce_backward(a->tp, m->logits, m->logits, tg, n, s->ce);
        }
        ce += cs;
        TERA_PROF(HEAD_BWD, m->be->ops.linear_backward(m->be, a->dln + r0 * D, m->G.lm_head, m->logits, x, m->W.lm_head,
                                                       n, D, V, 0.0f, r0 > 0 ? 1.0f : hb));
    }
    if (deferred) m->stats.ce_sum = ce, m->stats.ce_from_backward = 1;
}

/* The head's backward over all N rows: dlogits over the logits (unless the forward's fused pass wrote
 * them), the input gradient summed over the vocabulary slices, the weight gradient (hb: stored or added). */
static void head_backward(tera_model *m, const tera_loss_scales *s, float hb) {
    tera_acts *a = m->acts;
    const int64_t N = (int64_t)m->B * m->T, D = m->cfg.dim, V = m->Vl;
    /* dlogits overwrite the logits (tensor parallelism: this rank's vocabulary slice), unless the
     * forward wrote them already (tera_model_arm_fused_loss) */
    if (a->ce_fused) {
        TERA_ASSERTF(s->ce == a->ce_scale, "the forward wrote the loss gradient for scale %g, the backward has %g",
                     (double)a->ce_scale, (double)s->ce);
        a->ce_fused = 0;
    } else {
        tera_tp_ce_backward(a->tp, m->logits, m->logits, a->targets, N, s->ce);
    }
    /* parallel.pp_head_split (a training micro-batch): this stage's rows [Vh, V), summed over the pair */
    tera_head_split *hs = m->hs && m->hs->armed ? m->hs : NULL;
    const int64_t h0 = hs ? hs->Vh : 0;
    /* parallel.pp_defer_wgrad: the weight gradient queued (the logits' buffer changes hands), computed in
     * the pipeline's waits or at the step's end (tera_model_wgrad_run / _flush), which then hands the
     * head's gradient on */
    tera_tp_head_backward(hs ? &hs->tp : a->tp, a->dln, m->wgq ? NULL : m->G.lm_head + h0 * D, m->logits, a->lnf,
                          m->W.lm_head + h0 * D, N, D, V - h0, hb);
    if (m->wgq) {
        tera_wgrad_push(m->wgq, &a->logits, a->lnf, m->G.lm_head + h0 * D, V - h0, hb);
        m->logits = a->logits;
        if (m->grad_ready) m->wgq_ready = m->grad_ready, m->wgq_ready_ctx = m->grad_ready_ctx, m->wgq_due = 1;
    }
    tera_host_fill(m->be, a->dres, NULL, N * D);
    if (hs) {
        hs->armed = 0;
        if (m->grad_ready && !m->wgq) tera_head_split_grads_in(hs); /* rows [0, Vh) before the head's gradients go on */
    }
}

void tera_model_backward_range(tera_model *m, const tera_loss_scales *s, int l0, int l1, const float *dout,
                               float *dx) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    const int L = c->n_layers;
    const int64_t N = (int64_t)m->B * m->T, D = c->dim;
    tera_backend_weights_begin(m->be, 0); /* the weights of the forward */
    if (l1 < L) {
        memcpy(a->dres + m->r0 * D, dout, sizeof(float) * (size_t)(m->Nr * D)); /* this rank's rows */
    } else {
        need_params(m, TERA_GROUP_HEAD);
        need_grads(m, TERA_GROUP_HEAD);
        if (c->tie_embeddings) {
            need_params(m, TERA_GROUP_EMBED);
            need_grads(m, TERA_GROUP_EMBED);
        }
        /* the head's weight gradient: stored or added (tied: the embedding table's, which the embedding's
         * scatter below then adds into) */
        float hb = grads_begin(m, TERA_GROUP_HEAD);
        if (c->tie_embeddings) {
            unsigned char *st = &m->g_stale[group_slot(m, TERA_GROUP_EMBED)];
            hb = *st ? 0.0f : 1.0f;
            *st = 0;
        }
        if (m->loss_rows < N) { /* training.loss_chunk: block by block, then the slices' input gradients summed */
            head_loss_backward(m, s, hb);
            tera_tp_dx_sum(a->tp, a->dln);
            tera_host_fill(m->be, a->dres, NULL, N * D);
        } else {
            head_backward(m, s, hb);
        }
        tera_tp_norm_backward(a->tp, a->dres, m->G.final_norm, a->dln, a->x_final, m->W.final_norm, a->rstdf, N, D);
        tera_tp_norm_grads_sum(a->tp);
        /* tied: the head is the embedding, final below; deferred: when the queue is through */
        if (!c->tie_embeddings && !m->wgq) notify_grads(m, TERA_GROUP_HEAD);
    }
    for (int l = l1 - 1; l >= l0; l--) {
        need_params(m, l);
        layer_recompute(m, l);
        need_grads(m, l);
        layer_backward(m, l, s);
        notify_grads(m, l);
    }
    tera_backend_weights_end(m->be);
    if (l0 > 0) {
        memcpy(dx, a->dres + m->r0 * D, sizeof(float) * (size_t)(m->Nr * D)); /* this rank's rows */
        return;
    }
    tera_tp_gather_rows(a->tp, a->dres); /* the embedding reads every row's gradient */
    need_grads(m, TERA_GROUP_EMBED);
    (void)grads_begin(m, TERA_GROUP_EMBED); /* stale (untied, or the head elsewhere): zeroed for the scatter */
    tera_tp_embedding_backward(a->tp, m->G.embed, a->dres, a->tokens, N, D);
    notify_grads(m, TERA_GROUP_EMBED);
    if (c->tie_embeddings) notify_grads(m, TERA_GROUP_HEAD);
}

int64_t tera_model_shared_overlapped(const tera_model *m) {
    return m->slots ? tera_dispatch_side_inflight(m->slots[0].dispatch) : 0;
}

int64_t tera_model_tp_overlapped(const tera_model *m, int64_t *done_early) {
    const tera_tp *tp = m->slots ? m->slots[0].tp : NULL;
    if (done_early) *done_early = tp ? tp->done_early : 0;
    return tp ? tp->overlapped : 0;
}

int64_t tera_model_exchange_row_bytes(const tera_model *m, int back) {
    return m->slots ? tera_dispatch_row_bytes(m->slots[0].dispatch, back) : 4 * (int64_t)m->cfg.dim;
}

void tera_model_set_tp_overlap(tera_model *m, int mode) {
    m->par.tp_overlap = mode;
    if (m->slots && m->slots[0].tp) m->slots[0].tp->overlap = mode;
}

void tera_model_update_router_bias(tera_model *m) {
    const tera_model_config *c = &m->cfg;
    if (!c->aux_free) return;
    const int E = c->n_experts;
    for (int l = 0; l < c->n_layers; l++) {
        if (!is_moe(c, l)) continue;
        const int64_t *load = m->expert_load + (int64_t)l * E;
        double mean = 0.0;
        for (int e = 0; e < E; e++) mean += (double)load[e];
        mean /= E;
        for (int e = 0; e < E; e++) {
            double err = mean - (double)load[e];
            float sign = err > 0 ? 1.0f : (err < 0 ? -1.0f : 0.0f);
            m->router_bias[(int64_t)l * E + e] += c->aux_free_rate * sign;
        }
    }
}
