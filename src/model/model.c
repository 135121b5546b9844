/* The transformer: allocation from size tables, forward and backward over one micro-batch.
 *
 * Memory: parameters, gradients, activations and scratch are each one allocation, carved by
 * offsets computed from the configuration; nothing is allocated in forward or backward. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "moe.h"
#include "tera/kernels.h"
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
    float *probs;    /* [N, E] */
    float *rlse;     /* [N] router logsumexp (z-loss) */
    int32_t *topi;   /* [N, k] */
    float *topw;     /* [N, k] combine weights */
    int32_t *slot_row; /* [N*k] grouped row of each assignment, -1 if dropped */
    int32_t *row_tok;  /* [N*k] token of each grouped row */
    int32_t *exp_off;  /* [E+1] */
    int32_t *sel_count;/* [B, E] selected assignments per sequence and expert */
    float *xg;       /* [N*k, D] gathered expert inputs */
    float *a1, *a3;  /* [N*k, F] */
    float *gact;     /* [N*k, F] silu(a1)*a3 */
    float *ye;       /* [N*k, D] expert outputs (unweighted) */
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
    float *dxg;          /* [N*k, D] */
    float *dye;          /* [N*k, D] */
    float *da1, *da3, *dgact; /* [N*k, F] (also used for dense/shared widths) */
    float *dprobs;       /* [N, E] */
    float *drlogits;     /* [N, E] */
    float *dtopw;        /* [N, k] */
    float *attn_scratch; /* attention kernel scratch */
    void *plan_scratch;  /* dispatch plan scratch */
    void *act_block, *scratch_block;
    int threads;         /* thread count the attention scratch was sized for */
};

/* A size table: pass 1 counts bytes, pass 2 assigns pointers into one block. */
typedef struct {
    char *base;
    size_t off;
} carver;

static void *carve(carver *c, size_t bytes) {
    void *p = c->base ? c->base + c->off : NULL;
    c->off += (bytes + 63) & ~(size_t)63;
    return p;
}
#define CARVE_F(c, n) ((float *)carve((c), sizeof(float) * (size_t)(n)))
#define CARVE_I(c, n) ((int32_t *)carve((c), sizeof(int32_t) * (size_t)(n)))

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

/* Carves the `parts` of one layer's activations; moe: MoE fields; Fx: dense/shared hidden width. */
static void carve_layer(layer_acts *la, carver *c, const tera_model_config *cfg, int B, int T, int moe,
                        int64_t Fx, unsigned parts) {
    const int64_t N = (int64_t)B * T, D = cfg->dim, H = cfg->n_heads, Hkv = cfg->n_kv_heads;
    const int64_t hd = D / H, E = cfg->n_experts, K = cfg->top_k, F = cfg->ffn_dim;
    const int xin = (parts & PART_XIN) != 0, core = (parts & PART_CORE) != 0;
    const int hid = (parts & PART_HIDDEN) != 0, rest = (parts & PART_REST) != 0;
    if (xin) la->x_in = CARVE_F(c, N * D);
    if (rest) {
        la->ln1 = CARVE_F(c, N * D);
        la->rstd1 = CARVE_F(c, N);
        la->q = CARVE_F(c, N * H * hd);
        la->k = CARVE_F(c, N * Hkv * hd);
        la->v = CARVE_F(c, N * Hkv * hd);
    }
    if (core) {
        la->att = CARVE_F(c, N * H * hd);
        la->att_lse = CARVE_F(c, (int64_t)B * H * T);
    }
    if (rest) {
        la->h = CARVE_F(c, N * D);
        la->ln2 = CARVE_F(c, N * D);
        la->rstd2 = CARVE_F(c, N);
    }
    if (moe) {
        if (rest) {
            la->rlogits = CARVE_F(c, N * E);
            la->probs = CARVE_F(c, N * E);
            la->rlse = CARVE_F(c, N);
            la->topi = CARVE_I(c, N * K);
            la->topw = CARVE_F(c, N * K);
            la->slot_row = CARVE_I(c, N * K);
            la->row_tok = CARVE_I(c, N * K);
            la->exp_off = CARVE_I(c, E + 1);
            la->sel_count = CARVE_I(c, (int64_t)B * E);
            la->xg = CARVE_F(c, N * K * D);
        }
        if (hid) {
            la->a1 = CARVE_F(c, N * K * F);
            la->a3 = CARVE_F(c, N * K * F);
            la->gact = CARVE_F(c, N * K * F);
        }
        if (rest) la->ye = CARVE_F(c, N * K * D);
    }
    if (Fx > 0 && hid) {
        la->fa1 = CARVE_F(c, N * Fx);
        la->fa3 = CARVE_F(c, N * Fx);
        la->fg = CARVE_F(c, N * Fx);
    }
}

static int64_t layer_ffn_width(const tera_model_config *cfg, int l) {
    return is_moe(cfg, l) ? (int64_t)cfg->n_shared_experts * cfg->ffn_dim : cfg->dense_ffn_dim;
}

/* Per-layer activations (each layer its kept parts), then the work set for the others, then the
 * head's. Bytes: sum over layers of the kept parts + the work set + the head's, where the work set
 * is everything but x_in (some layer is full) or the core and hidden parts (some layer selective,
 * none full), with the MoE fields if a recomputing layer is MoE and the widest recomputing
 * dense/shared FFN; nothing when no layer recomputes. */
static void carve_acts(tera_acts *a, carver *c, const tera_model_config *cfg, int B, int T) {
    const int64_t N = (int64_t)B * T, D = cfg->dim, H = cfg->n_heads, hd = D / H;
    unsigned work_parts = 0;
    int work_moe = 0;
    int64_t work_Fx = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        const unsigned kept = kept_parts(a->policy[l]);
        a->layer[l] = (layer_acts){0};
        carve_layer(&a->layer[l], c, cfg, B, T, is_moe(cfg, l), layer_ffn_width(cfg, l), kept);
        if (kept != PART_ALL) {
            work_parts |= PART_ALL & ~kept;
            work_moe |= is_moe(cfg, l);
            if (layer_ffn_width(cfg, l) > work_Fx) work_Fx = layer_ffn_width(cfg, l);
        }
    }
    a->work = (layer_acts){0};
    if (work_parts) carve_layer(&a->work, c, cfg, B, T, work_moe, work_Fx, work_parts);
    for (int l = 0; l < cfg->n_layers; l++) { /* what a layer does not keep, it finds in the work set */
        layer_acts *la = &a->layer[l];
        const unsigned kept = kept_parts(a->policy[l]);
        const int moe = is_moe(cfg, l), ffn = layer_ffn_width(cfg, l) > 0;
#define SHARE(part, cond, f)                                                                       \
    if (!(kept & (part)) && (cond)) la->f = a->work.f
        SHARE(PART_REST, 1, ln1); SHARE(PART_REST, 1, rstd1); SHARE(PART_REST, 1, q);
        SHARE(PART_REST, 1, k); SHARE(PART_REST, 1, v); SHARE(PART_REST, 1, h);
        SHARE(PART_REST, 1, ln2); SHARE(PART_REST, 1, rstd2);
        SHARE(PART_CORE, 1, att); SHARE(PART_CORE, 1, att_lse);
        SHARE(PART_REST, moe, rlogits); SHARE(PART_REST, moe, probs); SHARE(PART_REST, moe, rlse);
        SHARE(PART_REST, moe, topi); SHARE(PART_REST, moe, topw); SHARE(PART_REST, moe, slot_row);
        SHARE(PART_REST, moe, row_tok); SHARE(PART_REST, moe, exp_off); SHARE(PART_REST, moe, sel_count);
        SHARE(PART_REST, moe, xg); SHARE(PART_REST, moe, ye);
        SHARE(PART_HIDDEN, moe, a1); SHARE(PART_HIDDEN, moe, a3); SHARE(PART_HIDDEN, moe, gact);
        SHARE(PART_HIDDEN, ffn, fa1); SHARE(PART_HIDDEN, ffn, fa3); SHARE(PART_HIDDEN, ffn, fg);
#undef SHARE
    }
    a->x_final = CARVE_F(c, N * D);
    a->lnf = CARVE_F(c, N * D);
    a->rstdf = CARVE_F(c, N);
    a->loss_lse = CARVE_F(c, N);
    a->rope_cos = CARVE_F(c, (int64_t)T * hd / 2);
    a->rope_sin = CARVE_F(c, (int64_t)T * hd / 2);
}

static void carve_scratch(tera_acts *a, carver *c, const tera_model_config *cfg, int B, int T,
                          float **logits) {
    const int64_t N = (int64_t)B * T, D = cfg->dim, H = cfg->n_heads, Hkv = cfg->n_kv_heads;
    const int64_t hd = D / H, E = cfg->n_experts, K = cfg->top_k, F = cfg->ffn_dim;
    const int64_t Fs = (int64_t)cfg->n_shared_experts * F, Fd = cfg->dense_ffn_dim;
    int64_t Fw = N * K * F; /* widest hidden buffer */
    if (N * Fs > Fw) Fw = N * Fs;
    if (N * Fd > Fw) Fw = N * Fd;
    *logits = CARVE_F(c, N * cfg->vocab_size);
    a->dres = CARVE_F(c, N * D);
    a->dln = CARVE_F(c, N * D);
    a->dq = CARVE_F(c, N * H * hd);
    a->dk = CARVE_F(c, N * Hkv * hd);
    a->dv = CARVE_F(c, N * Hkv * hd);
    a->datt = CARVE_F(c, N * H * hd);
    a->dxg = CARVE_F(c, N * K * D);
    a->dye = CARVE_F(c, N * K * D);
    a->da1 = CARVE_F(c, Fw);
    a->da3 = CARVE_F(c, Fw);
    a->dgact = CARVE_F(c, Fw);
    a->dprobs = CARVE_F(c, N * E);
    a->drlogits = CARVE_F(c, N * E);
    a->dtopw = CARVE_F(c, N * K);
    a->attn_scratch = CARVE_F(c, tera_attention_scratch_floats(B, T, (int)H, (int)Hkv, (int)hd));
    a->plan_scratch = carve(c, tera_moe_plan_scratch_bytes(N * K));
}

static void make_views(tera_weights_view *v, float *base, const tera_model *m) {
    v->layers = tera_calloc((size_t)m->cfg.n_layers, sizeof(tera_layer_view));
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        float *ptr = base + p->offset;
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
    if (m->cfg.tie_embeddings) v->lm_head = v->embed;
}

tera_status tera_model_create(tera_model *m, const tera_model_config *cfg, int B, int T) {
    memset(m, 0, sizeof *m);
    if (cfg->n_experts > 64)
        return tera_fail(TERA_ERR_CONFIG, "model.n_experts = %d: at most 64 experts per layer are supported",
                         cfg->n_experts);
    if (T > cfg->max_seq_len)
        return tera_fail(TERA_ERR_CONFIG, "training.seq_len = %d exceeds model.max_seq_len = %d", T,
                         cfg->max_seq_len);
    m->cfg = *cfg;
    m->B = B;
    m->T = T;
    m->params = tera_param_table(cfg, &m->n_params, &m->n_floats);
    m->w = tera_calloc((size_t)m->n_floats, sizeof(float));
    m->g = tera_calloc((size_t)m->n_floats, sizeof(float));
    m->bytes_params = m->bytes_grads = m->n_floats * (int64_t)sizeof(float);
    make_views(&m->W, m->w, m);
    make_views(&m->G, m->g, m);
    for (int l = 0; l < cfg->n_layers; l++) m->n_moe_layers += is_moe(cfg, l);
    m->router_bias = tera_calloc((size_t)cfg->n_layers * (size_t)cfg->n_experts, sizeof(float));
    m->expert_load = tera_calloc((size_t)cfg->n_layers * (size_t)cfg->n_experts, sizeof(int64_t));
    m->router_entropy = tera_calloc((size_t)cfg->n_layers, sizeof(double));

    m->recompute = tera_calloc((size_t)cfg->n_layers, 1);
    tera_status st = tera_recompute_parse(cfg->recompute, cfg->n_layers, m->recompute);
    m->cfg.recompute = NULL; /* the caller's string; the parsed policy is m->recompute */
    if (st != TERA_OK) {
        tera_model_destroy(m);
        return st;
    }
    tera_acts *a = tera_calloc(1, sizeof(tera_acts));
    a->layer = tera_calloc((size_t)cfg->n_layers, sizeof(layer_acts));
    a->policy = m->recompute;
    a->work_owner = -1;
    carver c = {0};
    carve_acts(a, &c, cfg, B, T);
    a->act_block = tera_malloc(c.off);
    memset(a->act_block, 0, c.off);
    m->bytes_acts = (int64_t)c.off;
    c = (carver){.base = a->act_block};
    carve_acts(a, &c, cfg, B, T);
    c = (carver){0};
    carve_scratch(a, &c, cfg, B, T, &m->logits);
    a->scratch_block = tera_malloc(c.off);
    memset(a->scratch_block, 0, c.off);
    m->bytes_scratch = (int64_t)c.off;
    c = (carver){.base = a->scratch_block};
    carve_scratch(a, &c, cfg, B, T, &m->logits);
    a->threads = omp_get_max_threads();
    tera_rope_tables(a->rope_cos, a->rope_sin, T, cfg->dim / cfg->n_heads, cfg->rope_theta);
    m->acts = a;
    return TERA_OK;
}

void tera_model_destroy(tera_model *m) {
    if (!m->params) return;
    free(m->params);
    free(m->w);
    free(m->g);
    free(m->W.layers);
    free(m->G.layers);
    free(m->router_bias);
    free(m->expert_load);
    free(m->router_entropy);
    free(m->recompute);
    if (m->acts) {
        free(m->acts->act_block);
        free(m->acts->scratch_block);
        free(m->acts->layer);
        free(m->acts);
    }
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
        const uint64_t stream = name_key(p->name);
        const float std = p->init_std;
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < p->numel; j++) w[j] = std * tera_rng_normal(seed, stream, (uint64_t)j);
    }
    memset(m->router_bias, 0, sizeof(float) * (size_t)m->cfg.n_layers * (size_t)m->cfg.n_experts);
}

void tera_model_zero_grad(tera_model *m) { memset(m->g, 0, sizeof(float) * (size_t)m->n_floats); }

void tera_model_reset_load(tera_model *m) {
    memset(m->expert_load, 0, sizeof(int64_t) * (size_t)m->cfg.n_layers * (size_t)m->cfg.n_experts);
    memset(m->router_entropy, 0, sizeof(double) * (size_t)m->cfg.n_layers);
    m->routed_tokens = 0;
}

/* ------------------------------------------------------------------------------ forward */

/* SwiGLU hidden activations of x[N,D]: a1 = x w1^T, a3 = x w3^T, g = silu(a1) * a3 ([N,F]). */
static void ffn_hidden(float *a1, float *a3, float *g, const float *x, const float *w1, const float *w3,
                       int64_t N, int64_t D, int64_t F) {
    tera_linear_forward(a1, x, w1, N, D, F, 0.0f);
    tera_linear_forward(a3, x, w3, N, D, F, 0.0f);
    tera_swiglu_forward(g, a1, a3, N * F);
}

/* SwiGLU FFN on all N rows: y[N,D] += w2(silu(x w1^T) * (x w3^T)). */
static void ffn_forward(float *y, float *a1, float *a3, float *g, const float *x, const float *w1,
                        const float *w3, const float *w2, int64_t N, int64_t D, int64_t F) {
    ffn_hidden(a1, a3, g, x, w1, w3, N, D, F);
    tera_linear_forward(y, g, w2, N, F, D, 1.0f);
}

/* Experts run either one after another, each product using every thread, or side by side (when
 * there are at least two experts per thread), each with single-threaded products: an expert's
 * matrices are too small to split well across threads. Both give the same maths; each expert's
 * outputs and weight gradients are written by exactly one thread. */
static int experts_in_parallel(int E) {
    const int t = omp_get_max_threads();
    return t > 1 && E >= 2 * t;
}

/* Expert indices by descending row count (largest first balances the dynamic schedule). */
static void experts_by_load(int *order, const int32_t *exp_off, int E) {
    for (int e = 0; e < E; e++) order[e] = e;
    for (int i = 1; i < E; i++) { /* insertion sort, stable: ties keep index order */
        int x = order[i], j = i - 1;
        const int32_t nx = exp_off[x + 1] - exp_off[x];
        while (j >= 0 && exp_off[order[j] + 1] - exp_off[order[j]] < nx) order[j + 1] = order[j], j--;
        order[j + 1] = x;
    }
}

/* Expert e's hidden activations over its grouped rows: a1, a3, gact = silu(a1) * a3. */
static void expert_hidden(layer_acts *la, const tera_layer_view *W, int e, int64_t D, int64_t F) {
    const int64_t r0 = la->exp_off[e], n = la->exp_off[e + 1] - r0;
    if (n == 0) return;
    ffn_hidden(la->a1 + r0 * F, la->a3 + r0 * F, la->gact + r0 * F, la->xg + r0 * D, W->w1 + e * F * D,
               W->w3 + e * F * D, n, D, F);
}

/* Expert e over its grouped rows: ye = w2(silu(xg w1^T) * (xg w3^T)). */
static void expert_forward(layer_acts *la, const tera_layer_view *W, int e, int64_t D, int64_t F) {
    const int64_t r0 = la->exp_off[e], n = la->exp_off[e + 1] - r0;
    if (n == 0) return;
    expert_hidden(la, W, e, D, F);
    tera_linear_forward(la->ye + r0 * D, la->gact + r0 * F, W->w2 + e * D * F, n, F, D, 0.0f);
}

static void expert_backward(tera_acts *a, layer_acts *la, const tera_layer_view *W, const tera_layer_view *G,
                            int e, int64_t D, int64_t F) {
    const int64_t r0 = la->exp_off[e], n = la->exp_off[e + 1] - r0;
    if (n == 0) return;
    tera_linear_backward(a->dgact + r0 * F, G->w2 + e * D * F, a->dye + r0 * D, la->gact + r0 * F,
                         W->w2 + e * D * F, n, F, D, 0.0f);
    tera_swiglu_backward(a->da1 + r0 * F, a->da3 + r0 * F, a->dgact + r0 * F, la->a1 + r0 * F, la->a3 + r0 * F,
                         n * F);
    tera_linear_backward(a->dxg + r0 * D, G->w1 + e * F * D, a->da1 + r0 * F, la->xg + r0 * D,
                         W->w1 + e * F * D, n, D, F, 0.0f);
    tera_linear_backward(a->dxg + r0 * D, G->w3 + e * F * D, a->da3 + r0 * F, la->xg + r0 * D,
                         W->w3 + e * F * D, n, D, F, 1.0f);
}

static void moe_forward(tera_model *m, int l, float *out) {
    const tera_model_config *c = &m->cfg;
    layer_acts *la = &m->acts->layer[l];
    const tera_layer_view *W = &m->W.layers[l];
    const int B = m->B, T = m->T, E = c->n_experts, K = c->top_k;
    const int64_t N = (int64_t)B * T, D = c->dim, F = c->ffn_dim;

    TERA_PROF(ROUTER_FWD, {
        tera_linear_forward(la->rlogits, la->ln2, W->router, N, D, E, 0.0f);
        tera_softmax_forward(la->probs, la->rlse, la->rlogits, N, E);
        tera_moe_topk(la->topi, la->topw, la->probs, c->aux_free ? m->router_bias + (int64_t)l * E : NULL,
                      N, E, K);
    });
    int capacity = 0;
    if (c->capacity_factor > 0.0f) capacity = (int)ceil((double)c->capacity_factor * T * K / E);
    int64_t dropped;
    {
        TERA_PROF_BEGIN(DISPATCH);
        dropped = tera_moe_plan(la->slot_row, la->row_tok, la->exp_off, la->sel_count,
                                m->acts->plan_scratch, la->topi, la->probs, B, T, E, K, capacity,
                                c->drop_policy);
        const int64_t R = la->exp_off[E];
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < R; r++)
            memcpy(la->xg + r * D, la->ln2 + (int64_t)la->row_tok[r] * D, sizeof(float) * (size_t)D);
        TERA_PROF_END(DISPATCH);
    }
    m->stats.n_assign += N * K;
    m->stats.n_dropped += dropped;

    /* load statistics: aux loss per sequence, z-loss, expert load */
    double aux = 0.0, z = 0.0;
    for (int b = 0; b < B; b++) {
        double s = 0.0;
        for (int e = 0; e < E; e++) {
            double P = 0.0;
            for (int t = 0; t < T; t++) P += la->probs[((int64_t)b * T + t) * E + e];
            s += (double)la->sel_count[b * E + e] / ((double)T * K) * (P / T);
            m->expert_load[(int64_t)l * E + e] += la->sel_count[b * E + e];
        }
        aux += E * s;
    }
    double ent = 0.0;
    for (int64_t n = 0; n < N; n++) {
        z += (double)la->rlse[n] * la->rlse[n];
        for (int e = 0; e < E; e++) {
            const float p = la->probs[n * E + e];
            if (p > 0.0f) ent -= (double)p * log((double)p);
        }
    }
    m->router_entropy[l] += ent;
    if (l == c->first_k_dense) m->routed_tokens += N;
    m->stats.aux_sum += aux;
    m->stats.z_sum += z;

    {
        TERA_PROF_BEGIN(EXPERT_FWD);
        int order[64];
        if (experts_in_parallel(E)) {
            experts_by_load(order, la->exp_off, E);
#pragma omp parallel for schedule(dynamic, 1)
            for (int i = 0; i < E; i++) expert_forward(la, W, order[i], D, F);
        } else {
            for (int e = 0; e < E; e++) expert_forward(la, W, e, D, F);
        }
        TERA_PROF_END(EXPERT_FWD);
    }
    {
        TERA_PROF_BEGIN(COMBINE_FWD);
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < N; t++) {
            float *o = out + t * D;
            for (int j = 0; j < K; j++) {
                const int32_t r = la->slot_row[t * K + j];
                if (r < 0) continue;
                const float wgt = la->topw[t * K + j];
                const float *y = la->ye + (int64_t)r * D;
                for (int64_t d = 0; d < D; d++) o[d] += wgt * y[d];
            }
        }
        TERA_PROF_END(COMBINE_FWD);
    }
    if (c->n_shared_experts > 0)
        TERA_PROF(DENSE_FWD, ffn_forward(out, la->fa1, la->fa3, la->fg, la->ln2, W->sw1, W->sw3, W->sw2, N,
                                         D, (int64_t)c->n_shared_experts * F));
}

static void layer_forward(tera_model *m, int l, float *out) {
    const tera_model_config *c = &m->cfg;
    layer_acts *la = &m->acts->layer[l];
    const tera_layer_view *W = &m->W.layers[l];
    const int B = m->B, T = m->T, H = c->n_heads, Hkv = c->n_kv_heads;
    const int64_t N = (int64_t)B * T, D = c->dim, hd = D / H;

    TERA_PROF(NORM_FWD, tera_rmsnorm_forward(la->ln1, la->rstd1, la->x_in, W->attn_norm, N, D, c->norm_eps));
    TERA_PROF(QKV_FWD, {
        tera_linear_forward(la->q, la->ln1, W->wq, N, D, H * hd, 0.0f);
        tera_linear_forward(la->k, la->ln1, W->wk, N, D, Hkv * hd, 0.0f);
        tera_linear_forward(la->v, la->ln1, W->wv, N, D, Hkv * hd, 0.0f);
    });
    TERA_PROF(ROPE_FWD, {
        tera_rope_forward(la->q, m->acts->rope_cos, m->acts->rope_sin, B, T, H, (int)hd);
        tera_rope_forward(la->k, m->acts->rope_cos, m->acts->rope_sin, B, T, Hkv, (int)hd);
    });
    TERA_PROF(ATTN_FWD, tera_attention_forward(la->att, la->att_lse, la->q, la->k, la->v, B, T, H, Hkv,
                                               (int)hd, m->acts->attn_scratch));
    TERA_PROF(OPROJ_FWD, {
        memcpy(la->h, la->x_in, sizeof(float) * (size_t)(N * D));
        tera_linear_forward(la->h, la->att, W->wo, N, H * hd, D, 1.0f);
    });
    TERA_PROF(NORM_FWD, tera_rmsnorm_forward(la->ln2, la->rstd2, la->h, W->ffn_norm, N, D, c->norm_eps));
    memcpy(out, la->h, sizeof(float) * (size_t)(N * D));
    if (is_moe(c, l))
        moe_forward(m, l, out);
    else
        TERA_PROF(DENSE_FWD, ffn_forward(out, la->fa1, la->fa3, la->fg, la->ln2, W->dw1, W->dw3, W->dw2, N, D,
                                         c->dense_ffn_dim));
}

void tera_model_forward(tera_model *m, const int32_t *tokens, const int32_t *targets) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    const int64_t N = (int64_t)m->B * m->T, D = c->dim, V = c->vocab_size;
    TERA_ASSERTF(omp_get_max_threads() <= a->threads,
                 "%d threads, but the model's scratch was sized for %d: set threads before tera_model_create",
                 omp_get_max_threads(), a->threads);
    memset(&m->stats, 0, sizeof m->stats);
    a->tokens = tokens;
    a->targets = targets;
    TERA_PROF(EMBED_FWD, tera_embedding_forward(a->layer[0].x_in, m->W.embed, tokens, N, D));
    a->work_owner = -1;
    for (int l = 0; l < c->n_layers; l++) {
        float *out = l + 1 < c->n_layers ? a->layer[l + 1].x_in : a->x_final;
        layer_forward(m, l, out);
        if (a->policy[l] != TERA_RECOMPUTE_NONE) a->work_owner = l; /* its parts in the work set */
    }
    TERA_PROF(NORM_FWD, tera_rmsnorm_forward(a->lnf, a->rstdf, a->x_final, m->W.final_norm, N, D, c->norm_eps));
    TERA_PROF(HEAD_FWD, tera_linear_forward(m->logits, a->lnf, m->W.lm_head, N, D, V, 0.0f));
    TERA_PROF(LOSS_FWD, m->stats.ce_sum = tera_ce_forward(a->loss_lse, m->logits, targets, N, V));
    m->stats.n_positions = N;
}

/* ------------------------------------------------------------------------------ backward */

/* Backward of y += w2(silu(x w1^T) * (x w3^T)): dx += ..., weight grads +=. */
static void ffn_backward(tera_acts *a, float *dx, const float *dy, const float *x, const float *a1,
                         const float *a3, const float *g, const float *w1, const float *w3, const float *w2,
                         float *gw1, float *gw3, float *gw2, int64_t N, int64_t D, int64_t F) {
    tera_linear_backward(a->dgact, gw2, dy, g, w2, N, F, D, 0.0f);
    tera_swiglu_backward(a->da1, a->da3, a->dgact, a1, a3, N * F);
    tera_linear_backward(dx, gw1, a->da1, x, w1, N, D, F, 1.0f);
    tera_linear_backward(dx, gw3, a->da3, x, w3, N, D, F, 1.0f);
}

static void moe_backward(tera_model *m, int l, const tera_loss_scales *s) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    layer_acts *la = &a->layer[l];
    const tera_layer_view *W = &m->W.layers[l], *G = &m->G.layers[l];
    const int B = m->B, T = m->T, E = c->n_experts, K = c->top_k;
    const int64_t N = (int64_t)B * T, D = c->dim, F = c->ffn_dim;
    const float *dy = a->dres; /* gradient of the layer output */

    /* dln accumulates every path into the MoE input; shared experts first (they write dln=) */
    memset(a->dln, 0, sizeof(float) * (size_t)(N * D));
    if (c->n_shared_experts > 0)
        TERA_PROF(DENSE_BWD, ffn_backward(a, a->dln, dy, la->ln2, la->fa1, la->fa3, la->fg, W->sw1, W->sw3,
                                          W->sw2, G->sw1, G->sw3, G->sw2, N, D,
                                          (int64_t)c->n_shared_experts * F));
    {
        TERA_PROF_BEGIN(COMBINE_BWD);
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < N; t++) {
            const float *g = dy + t * D;
            for (int j = 0; j < K; j++) {
                const int32_t r = la->slot_row[t * K + j];
                float dw = 0.0f;
                if (r >= 0) {
                    const float wgt = la->topw[t * K + j];
                    const float *y = la->ye + (int64_t)r * D;
                    float *dyr = a->dye + (int64_t)r * D;
                    for (int64_t d = 0; d < D; d++) {
                        dyr[d] = wgt * g[d];
                        dw += g[d] * y[d];
                    }
                }
                a->dtopw[t * K + j] = dw;
            }
        }
        TERA_PROF_END(COMBINE_BWD);
    }
    {
        TERA_PROF_BEGIN(EXPERT_BWD);
        int order[64];
        if (experts_in_parallel(E)) {
            experts_by_load(order, la->exp_off, E);
#pragma omp parallel for schedule(dynamic, 1)
            for (int i = 0; i < E; i++) expert_backward(a, la, W, G, order[i], D, F);
        } else {
            for (int e = 0; e < E; e++) expert_backward(a, la, W, G, e, D, F);
        }
        TERA_PROF_END(EXPERT_BWD);
    }
    {
        TERA_PROF_BEGIN(COMBINE_BWD);
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < N; t++) {
            float *o = a->dln + t * D;
            for (int j = 0; j < K; j++) {
                const int32_t r = la->slot_row[t * K + j];
                if (r < 0) continue;
                const float *src = a->dxg + (int64_t)r * D;
                for (int64_t d = 0; d < D; d++) o[d] += src[d];
            }
        }
        TERA_PROF_END(COMBINE_BWD);
    }
    {
        TERA_PROF_BEGIN(ROUTER_BWD);
        /* combine weights w_j = p_{e_j} / S  ->  dp_{e_i} = (dw_i - sum_j dw_j w_j) / S */
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < N; t++) {
            float *dp = a->dprobs + t * E;
            const float *p = la->probs + t * E;
            const int b = (int)(t / T);
            for (int e = 0; e < E; e++)
                dp[e] = s->aux * (float)E * ((float)la->sel_count[b * E + e] / ((float)T * K)) / (float)T;
            float S = 0.0f, dot = 0.0f;
            for (int j = 0; j < K; j++) {
                S += p[la->topi[t * K + j]];
                dot += a->dtopw[t * K + j] * la->topw[t * K + j];
            }
            for (int j = 0; j < K; j++) dp[la->topi[t * K + j]] += (a->dtopw[t * K + j] - dot) / S;
        }
        tera_softmax_backward(a->drlogits, a->dprobs, la->probs, N, E);
        if (s->z != 0.0f) {
            /* d(lse^2)/dlogits = 2 lse softmax */
#pragma omp parallel for schedule(static)
            for (int64_t t = 0; t < N; t++)
                for (int e = 0; e < E; e++)
                    a->drlogits[t * E + e] += s->z * 2.0f * la->rlse[t] * la->probs[t * E + e];
        }
        tera_linear_backward(a->dln, G->router, a->drlogits, la->ln2, W->router, N, D, E, 1.0f);
        TERA_PROF_END(ROUTER_BWD);
    }
}

static void layer_backward(tera_model *m, int l, const tera_loss_scales *s) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    layer_acts *la = &a->layer[l];
    const tera_layer_view *W = &m->W.layers[l], *G = &m->G.layers[l];
    const int B = m->B, T = m->T, H = c->n_heads, Hkv = c->n_kv_heads;
    const int64_t N = (int64_t)B * T, D = c->dim, hd = D / H;

    /* FFN: a->dres holds dL/d(layer output); it becomes dL/dh after the norm backward. */
    if (is_moe(c, l)) {
        moe_backward(m, l, s);
    } else {
        memset(a->dln, 0, sizeof(float) * (size_t)(N * D));
        TERA_PROF(DENSE_BWD, ffn_backward(a, a->dln, a->dres, la->ln2, la->fa1, la->fa3, la->fg, W->dw1,
                                          W->dw3, W->dw2, G->dw1, G->dw3, G->dw2, N, D, c->dense_ffn_dim));
    }
    TERA_PROF(NORM_BWD, tera_rmsnorm_backward(a->dres, G->ffn_norm, a->dln, la->h, W->ffn_norm, la->rstd2, N, D));
    /* attention */
    TERA_PROF(OPROJ_BWD, tera_linear_backward(a->datt, G->wo, a->dres, la->att, W->wo, N, H * hd, D, 0.0f));
    TERA_PROF(ATTN_BWD, tera_attention_backward(a->dq, a->dk, a->dv, a->datt, la->q, la->k, la->v, la->att,
                                                la->att_lse, B, T, H, Hkv, (int)hd, a->attn_scratch));
    TERA_PROF(ROPE_BWD, {
        tera_rope_backward(a->dq, a->rope_cos, a->rope_sin, B, T, H, (int)hd);
        tera_rope_backward(a->dk, a->rope_cos, a->rope_sin, B, T, Hkv, (int)hd);
    });
    TERA_PROF(QKV_BWD, {
        tera_linear_backward(a->dln, G->wq, a->dq, la->ln1, W->wq, N, D, H * hd, 0.0f);
        tera_linear_backward(a->dln, G->wk, a->dk, la->ln1, W->wk, N, D, Hkv * hd, 1.0f);
        tera_linear_backward(a->dln, G->wv, a->dv, la->ln1, W->wv, N, D, Hkv * hd, 1.0f);
    });
    TERA_PROF(NORM_BWD, tera_rmsnorm_backward(a->dres, G->attn_norm, a->dln, la->x_in, W->attn_norm, la->rstd1, N, D));
}

/* Brings back what layer l did not keep (tera_recompute), into the work set, before its backward.
 * The same code on the same inputs (kept x_in or q/k/v/xg/ln2, unchanged weights and router bias,
 * the same thread layout, 64-byte aligned buffers at the same relative offsets) gives the same
 * bits. Nothing to do when the work set still holds layer l's (the last recomputing layer of the
 * forward). The statistics a MoE forward accumulates are restored afterwards: counted once. */
static void layer_recompute(tera_model *m, int l) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    const int policy = a->policy[l];
    if (policy == TERA_RECOMPUTE_NONE || a->work_owner == l) return;
    layer_acts *la = &a->layer[l];
    const tera_layer_view *W = &m->W.layers[l];
    const int B = m->B, T = m->T, H = c->n_heads, Hkv = c->n_kv_heads, E = c->n_experts;
    const int64_t N = (int64_t)B * T, D = c->dim, hd = D / H, F = c->ffn_dim;
    a->work_owner = -1;
    if (policy == TERA_RECOMPUTE_FULL) {
        /* the layer's output is not needed: a->dln is free until layer_backward clears it */
        const tera_fwd_stats stats = m->stats;
        int64_t load[64];
        if (is_moe(c, l)) memcpy(load, m->expert_load + (int64_t)l * E, sizeof(int64_t) * (size_t)E);
        const double entropy = m->router_entropy[l];
        const int64_t routed = m->routed_tokens;
        layer_forward(m, l, a->dln);
        m->stats = stats;
        if (is_moe(c, l)) memcpy(m->expert_load + (int64_t)l * E, load, sizeof(int64_t) * (size_t)E);
        m->router_entropy[l] = entropy;
        m->routed_tokens = routed;
    } else { /* selective: attention core, then the FFN hidden activations */
        TERA_PROF(ATTN_FWD, tera_attention_forward(la->att, la->att_lse, la->q, la->k, la->v, B, T, H, Hkv,
                                                   (int)hd, a->attn_scratch));
        if (is_moe(c, l)) {
            TERA_PROF_BEGIN(EXPERT_FWD);
            int order[64];
            if (experts_in_parallel(E)) { /* the forward's thread layout (moe_forward) */
                experts_by_load(order, la->exp_off, E);
#pragma omp parallel for schedule(dynamic, 1)
                for (int i = 0; i < E; i++) expert_hidden(la, W, order[i], D, F);
            } else {
                for (int e = 0; e < E; e++) expert_hidden(la, W, e, D, F);
            }
            TERA_PROF_END(EXPERT_FWD);
            if (c->n_shared_experts > 0)
                TERA_PROF(DENSE_FWD, ffn_hidden(la->fa1, la->fa3, la->fg, la->ln2, W->sw1, W->sw3, N, D,
                                                (int64_t)c->n_shared_experts * F));
        } else {
            TERA_PROF(DENSE_FWD,
                      ffn_hidden(la->fa1, la->fa3, la->fg, la->ln2, W->dw1, W->dw3, N, D, c->dense_ffn_dim));
        }
    }
    a->work_owner = l;
}

/* Flat-buffer range [lo, hi) of the parameters selected by `pick` (layer index, or -1 with the
 * kinds of the head / embedding). Parameters of one layer are contiguous in the table. */
static void param_range(const tera_model *m, int layer, int head, int64_t *lo, int64_t *hi) {
    *lo = INT64_MAX;
    *hi = 0;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        int in = layer >= 0 ? p->layer == layer
                            : (head ? (p->kind == TERA_P_FINAL_NORM || p->kind == TERA_P_LM_HEAD) : p->kind == TERA_P_EMBED);
        if (!in) continue;
        if (p->offset < *lo) *lo = p->offset;
        if (p->offset + p->numel > *hi) *hi = p->offset + p->numel;
    }
}

static void notify_grads(tera_model *m, int layer, int head) {
    if (!m->grad_ready) return;
    int64_t lo, hi;
    param_range(m, layer, head, &lo, &hi);
    if (hi > lo) m->grad_ready(m->grad_ready_ctx, lo, hi - lo);
}

void tera_model_backward(tera_model *m, const tera_loss_scales *s) {
    const tera_model_config *c = &m->cfg;
    tera_acts *a = m->acts;
    const int64_t N = (int64_t)m->B * m->T, D = c->dim, V = c->vocab_size;
    /* dlogits overwrite the logits */
    TERA_PROF(LOSS_BWD, tera_ce_backward(m->logits, m->logits, a->loss_lse, a->targets, N, V, s->ce));
    TERA_PROF(HEAD_BWD, tera_linear_backward(a->dln, m->G.lm_head, m->logits, a->lnf, m->W.lm_head, N, D, V, 0.0f));
    memset(a->dres, 0, sizeof(float) * (size_t)(N * D));
    TERA_PROF(NORM_BWD, tera_rmsnorm_backward(a->dres, m->G.final_norm, a->dln, a->x_final, m->W.final_norm,
                                              a->rstdf, N, D));
    if (!c->tie_embeddings) notify_grads(m, -1, 1); /* tied: the head is the embedding, final below */
    for (int l = c->n_layers - 1; l >= 0; l--) {
        layer_recompute(m, l);
        layer_backward(m, l, s);
        notify_grads(m, l, 0);
    }
    TERA_PROF(EMBED_BWD, tera_embedding_backward(m->G.embed, a->dres, a->tokens, N, D));
    notify_grads(m, -1, 0);
    if (c->tie_embeddings) notify_grads(m, -1, 1);
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
