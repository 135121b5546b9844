/* The parameter table: one row per tensor, in the order the flat buffer holds them. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tera/model.h"

typedef struct {
    tera_param *rows;
    int n, cap;
    int ep, ep_rank; /* expert parallelism: this rank stores experts [ep_rank*E/ep, +E/ep) */
    int tp, tp_rank; /* tensor parallelism: this rank stores 1/tp of the split dim */
    const unsigned char *held; /* pipeline parallelism: [L] layers on this rank (NULL: all) */
    int embed, head; /* this rank holds the embedding / the final norm and LM head */
} table_builder;

static tera_param *add(table_builder *b, tera_param_kind kind, int layer, const char *name, int ndim,
                       int64_t s0, int64_t s1, int64_t s2) {
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 64;
        tera_param *nr = tera_malloc(sizeof(tera_param) * (size_t)b->cap);
        if (b->rows) memcpy(nr, b->rows, sizeof(tera_param) * (size_t)b->n);
        free(b->rows);
        b->rows = nr;
    }
    tera_param *p = &b->rows[b->n++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    p->kind = kind;
    p->layer = layer;
    p->ndim = ndim;
    p->shape[0] = s0;
    p->shape[1] = ndim > 1 ? s1 : 1;
    p->shape[2] = ndim > 2 ? s2 : 1;
    for (int d = 0; d < 3; d++) p->lo[d] = 0, p->len[d] = p->shape[d];
    p->tp_dim = -1;
    p->numel = p->shape[0] * p->shape[1] * p->shape[2];
    p->decay = ndim >= 2;
    /* pipeline parallelism: a tensor of another stage is a row with nothing stored here */
    const int here = layer >= 0 ? (!b->held || b->held[layer]) : (kind == TERA_P_EMBED ? b->embed : b->head);
    if (!here) {
        for (int d = 0; d < 3; d++) p->len[d] = 0;
        p->numel = 0;
    }
    return p;
}

static void split(tera_param *p, int dim, int parts, int part) {
    if (p->numel == 0) return; /* held by another pipeline stage */
    p->len[dim] = p->shape[dim] / parts;
    p->lo[dim] = (int64_t)part * p->len[dim];
    p->numel = p->len[0] * p->len[1] * p->len[2];
}

/* Megatron's split: column-parallel (output rows, dim 0 of [out, in]) or row-parallel (input
 * columns, the last dim); dim counts from the expert dim for stacked tensors. */
static void tp_split(table_builder *b, tera_param *p, int dim) {
    p->tp_dim = dim;
    split(p, dim, b->tp, b->tp_rank);
}

static void stack_experts(table_builder *b, tera_param *p) {
    p->expert_stacked = 1;
    split(p, 0, b->ep, b->ep_rank);
}

/* Offsets: every non-expert tensor first (in table order), then every routed-expert tensor, so
 * that the parameters replicated over all data-parallel ranks and those split over expert-parallel
 * ranks are two contiguous regions. Each tensor is 16-float (64-byte) aligned. */
static int64_t assign_offsets(table_builder *b, int64_t *n_dense) {
    int64_t off = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < b->n; i++) {
            tera_param *p = &b->rows[i];
            if (p->expert_stacked != pass) continue;
            p->offset = off;
            off = (off + p->numel + 15) & ~(int64_t)15;
        }
        if (pass == 0 && n_dense) *n_dense = off;
    }
    return off;
}

tera_param *tera_param_table(const tera_model_config *c, int *n, int64_t *n_floats) {
    return tera_param_table_ep(c, 1, 0, n, n_floats, NULL);
}

tera_param *tera_param_table_ep(const tera_model_config *c, int ep, int ep_rank, int *n, int64_t *n_floats,
                                int64_t *n_dense) {
    return tera_param_table_par(c, ep, ep_rank, 1, 0, n, n_floats, n_dense);
}

tera_param *tera_param_table_par(const tera_model_config *c, int ep, int ep_rank, int tp, int tp_rank, int *n,
                                 int64_t *n_floats, int64_t *n_dense) {
    const tera_shard_spec sp = {.ep = ep, .ep_rank = ep_rank, .tp = tp, .tp_rank = tp_rank, .pp = 1, .v = 1};
    return tera_param_table_spec(c, &sp, n, n_floats, n_dense);
}

void tera_block_copy(const int64_t *shape, const int64_t *lo, const int64_t *len, float *whole, float *block,
                     int to_whole) {
    for (int64_t i0 = 0; i0 < len[0]; i0++)
        for (int64_t i1 = 0; i1 < len[1]; i1++) {
            float *b = block + (i0 * len[1] + i1) * len[2];
            float *w = whole + ((lo[0] + i0) * shape[1] + lo[1] + i1) * shape[2] + lo[2];
            if (to_whole)
                memcpy(w, b, sizeof(float) * (size_t)len[2]);
            else
                memcpy(b, w, sizeof(float) * (size_t)len[2]);
        }
}

/* Per-layer cost for the pipeline split: the model FLOPs of one token through the layer (its
 * matrices and attention, BENCH.md's convention); the LM head counts toward the last layer. */
static double layer_cost(const tera_model_config *c, int l, int T) {
    const double D = c->dim, hd = (double)c->dim / c->n_heads, H = c->n_heads, Hkv = c->n_kv_heads, F = c->ffn_dim;
    double a = D * H * hd * 2 + D * Hkv * hd * 2;
    if (l < c->first_k_dense)
        a += 3 * D * c->dense_ffn_dim;
    else
        a += (double)c->n_experts * D + c->top_k * 3 * D * F + 3 * D * F * c->n_shared_experts;
    double cost = 6 * a + 12 * D * T;
    if (l == c->n_layers - 1) cost += 6.0 * c->vocab_size * D;
    return cost;
}

void tera_pp_split(const tera_model_config *c, int stages, int T, int *first) {
    /* contiguous layers per virtual stage minimising the largest stage cost (dynamic programme
     * over split points; ties go to the earlier split), every stage at least one layer */
    const int L = c->n_layers, S = stages;
    double *pre = tera_calloc((size_t)L + 1, sizeof(double));
    for (int l = 0; l < L; l++) pre[l + 1] = pre[l] + layer_cost(c, l, T);
    double *best = tera_calloc((size_t)(S + 1) * (size_t)(L + 1), sizeof(double));
    int *cut = tera_calloc((size_t)(S + 1) * (size_t)(L + 1), sizeof(int));
#define BEST(s, l) best[(size_t)(s) * (size_t)(L + 1) + (size_t)(l)]
#define CUT(s, l) cut[(size_t)(s) * (size_t)(L + 1) + (size_t)(l)]
    for (int l = 0; l <= L; l++) BEST(0, l) = l == 0 ? 0.0 : 1e300;
    for (int s = 1; s <= S; s++)
        for (int l = 0; l <= L; l++) {
            BEST(s, l) = 1e300;
            for (int k = s - 1; k < l; k++) { /* stages 0..s-2 take layers [0, k), stage s-1 [k, l) */
                const double v = BEST(s - 1, k) > pre[l] - pre[k] ? BEST(s - 1, k) : pre[l] - pre[k];
                if (v < BEST(s, l)) BEST(s, l) = v, CUT(s, l) = k;
            }
        }
    first[S] = L;
    for (int s = S, l = L; s > 0; s--) l = first[s - 1] = CUT(s, l);
#undef BEST
#undef CUT
    free(pre);
    free(best);
    free(cut);
}

tera_param *tera_param_table_spec(const tera_model_config *c, const tera_shard_spec *sp, int *n, int64_t *n_floats,
                                  int64_t *n_dense) {
    const int ep = sp->ep, ep_rank = sp->ep_rank, tp = sp->tp, tp_rank = sp->tp_rank;
    TERA_ASSERTF(ep >= 1 && c->n_experts % ep == 0 && ep_rank >= 0 && ep_rank < ep,
                 "expert parallelism %d (rank %d) with %d experts", ep, ep_rank, c->n_experts);
    TERA_ASSERTF(tp >= 1 && tp_rank >= 0 && tp_rank < tp && c->vocab_size % tp == 0 && c->n_heads % tp == 0 &&
                     c->n_kv_heads % tp == 0 && c->ffn_dim % tp == 0 && c->dense_ffn_dim % tp == 0,
                 "tensor parallelism %d (rank %d) does not divide the model's widths", tp, tp_rank);
    table_builder b = {.ep = ep, .ep_rank = ep_rank, .tp = tp, .tp_rank = tp_rank, .embed = 1, .head = 1};
    unsigned char *held = NULL;
    if (sp->pp > 1) { /* virtual stage s = chunk * pp + rank holds layers [first[s], first[s+1]) */
        const int S = sp->pp * sp->v;
        const int *first = sp->layer_first;
        TERA_ASSERTF(first && first[0] == 0 && first[S] == c->n_layers, "pipeline split of %d layers into %d stages",
                     c->n_layers, S);
        held = tera_calloc((size_t)c->n_layers, 1);
        for (int s = 0; s < S; s++)
            if (s % sp->pp == sp->pp_rank)
                for (int l = first[s]; l < first[s + 1]; l++) held[l] = 1;
        b.held = held;
        b.embed = sp->pp_rank == 0;
        b.head = sp->pp_rank == sp->pp - 1;
    }
    const int64_t D = c->dim, V = c->vocab_size, H = c->n_heads, Hkv = c->n_kv_heads;
    const int64_t hd = D / H, E = c->n_experts, F = c->ffn_dim;
    const int64_t Fs = (int64_t)c->n_shared_experts * F, Fd = c->dense_ffn_dim;
    const float std = c->init_std, std_out = c->init_std / sqrtf(2.0f * (float)c->n_layers);
    char nm[128];
    tera_param *p;

    p = add(&b, TERA_P_EMBED, -1, "model.embed_tokens.weight", 2, V, D, 0);
    p->init_std = std;
    tp_split(&b, p, 0); /* vocabulary-parallel */
    for (int l = 0; l < c->n_layers; l++) {
#define NAME(...) (snprintf(nm, sizeof nm, __VA_ARGS__), nm)
        p = add(&b, TERA_P_ATTN_NORM, l, NAME("model.layers.%d.input_layernorm.weight", l), 1, D, 0, 0);
        p->init_one = 1;
        p = add(&b, TERA_P_WQ, l, NAME("model.layers.%d.self_attn.q_proj.weight", l), 2, H * hd, D, 0);
        p->init_std = std;
        tp_split(&b, p, 0);
        p = add(&b, TERA_P_WK, l, NAME("model.layers.%d.self_attn.k_proj.weight", l), 2, Hkv * hd, D, 0);
        p->init_std = std;
        tp_split(&b, p, 0);
        p = add(&b, TERA_P_WV, l, NAME("model.layers.%d.self_attn.v_proj.weight", l), 2, Hkv * hd, D, 0);
        p->init_std = std;
        tp_split(&b, p, 0);
        p = add(&b, TERA_P_WO, l, NAME("model.layers.%d.self_attn.o_proj.weight", l), 2, D, H * hd, 0);
        p->init_std = std_out;
        tp_split(&b, p, 1);
        p = add(&b, TERA_P_FFN_NORM, l, NAME("model.layers.%d.post_attention_layernorm.weight", l), 1, D, 0, 0);
        p->init_one = 1;
        if (l < c->first_k_dense) {
            p = add(&b, TERA_P_DENSE_W1, l, NAME("model.layers.%d.mlp.gate_proj.weight", l), 2, Fd, D, 0);
            p->init_std = std;
            tp_split(&b, p, 0);
            p = add(&b, TERA_P_DENSE_W3, l, NAME("model.layers.%d.mlp.up_proj.weight", l), 2, Fd, D, 0);
            p->init_std = std;
            tp_split(&b, p, 0);
            p = add(&b, TERA_P_DENSE_W2, l, NAME("model.layers.%d.mlp.down_proj.weight", l), 2, D, Fd, 0);
            p->init_std = std_out;
            tp_split(&b, p, 1);
            continue;
        }
        p = add(&b, TERA_P_ROUTER, l, NAME("model.layers.%d.block_sparse_moe.gate.weight", l), 2, E, D, 0);
        p->init_std = std;
        p = add(&b, TERA_P_EXP_W1, l, NAME("model.layers.%d.block_sparse_moe.experts.%%d.w1.weight", l), 3, E, F, D);
        p->init_std = std;
        tp_split(&b, p, 1);
        stack_experts(&b, p);
        p = add(&b, TERA_P_EXP_W3, l, NAME("model.layers.%d.block_sparse_moe.experts.%%d.w3.weight", l), 3, E, F, D);
        p->init_std = std;
        tp_split(&b, p, 1);
        stack_experts(&b, p);
        p = add(&b, TERA_P_EXP_W2, l, NAME("model.layers.%d.block_sparse_moe.experts.%%d.w2.weight", l), 3, E, D, F);
        p->init_std = std_out;
        tp_split(&b, p, 2);
        stack_experts(&b, p);
        if (Fs > 0) {
            p = add(&b, TERA_P_SHARED_W1, l, NAME("model.layers.%d.mlp.shared_experts.gate_proj.weight", l), 2, Fs, D, 0);
            p->init_std = std;
            tp_split(&b, p, 0);
            p = add(&b, TERA_P_SHARED_W3, l, NAME("model.layers.%d.mlp.shared_experts.up_proj.weight", l), 2, Fs, D, 0);
            p->init_std = std;
            tp_split(&b, p, 0);
            p = add(&b, TERA_P_SHARED_W2, l, NAME("model.layers.%d.mlp.shared_experts.down_proj.weight", l), 2, D, Fs, 0);
            p->init_std = std_out;
            tp_split(&b, p, 1);
        }
#undef NAME
    }
    p = add(&b, TERA_P_FINAL_NORM, -1, "model.norm.weight", 1, D, 0, 0);
    p->init_one = 1;
    if (!c->tie_embeddings) {
        p = add(&b, TERA_P_LM_HEAD, -1, "lm_head.weight", 2, V, D, 0);
        p->init_std = std;
        tp_split(&b, p, 0);
    }
    *n = b.n;
    *n_floats = assign_offsets(&b, n_dense);
    free(held);
    return b.rows;
}

const tera_param *tera_model_param(const tera_model *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

int64_t tera_model_total_params(const tera_model_config *c) {
    int n;
    int64_t nf, total = 0;
    tera_param *t = tera_param_table(c, &n, &nf);
    for (int i = 0; i < n; i++) total += t[i].numel; /* one rank: every slice is whole */
    free(t);
    return total;
}

/* Matrix parameters a token passes through: attention, router, k chosen experts, shared experts,
 * dense FFNs, LM head (embedding lookup excluded), per BENCH.md. */
int64_t tera_model_active_params(const tera_model_config *c) {
    const int64_t D = c->dim, H = c->n_heads, Hkv = c->n_kv_heads, hd = D / H, F = c->ffn_dim;
    int64_t a = 0;
    for (int l = 0; l < c->n_layers; l++) {
        a += D * H * hd * 2 + D * Hkv * hd * 2;
        if (l < c->first_k_dense) {
            a += 3 * D * (int64_t)c->dense_ffn_dim;
        } else {
            a += (int64_t)c->n_experts * D + (int64_t)c->top_k * 3 * D * F +
                 3 * D * F * (int64_t)c->n_shared_experts;
        }
    }
    a += (int64_t)c->vocab_size * D;
    return a;
}

double tera_model_flops_per_token(const tera_model_config *c, int T) {
    return 6.0 * (double)tera_model_active_params(c) + 12.0 * c->n_layers * (double)c->dim * T;
}

const char *const tera_param_group_names[TERA_PARAM_GROUPS] = {"embed", "attn", "router", "experts",
                                                               "dense_shared_ffn", "norms", "lm_head"};

int tera_param_group(tera_param_kind k) {
    switch (k) {
    case TERA_P_EMBED: return 0;
    case TERA_P_WQ: case TERA_P_WK: case TERA_P_WV: case TERA_P_WO: return 1;
    case TERA_P_ROUTER: return 2;
    case TERA_P_EXP_W1: case TERA_P_EXP_W2: case TERA_P_EXP_W3: return 3;
    case TERA_P_SHARED_W1: case TERA_P_SHARED_W2: case TERA_P_SHARED_W3:
    case TERA_P_DENSE_W1: case TERA_P_DENSE_W2: case TERA_P_DENSE_W3: return 4;
    case TERA_P_ATTN_NORM: case TERA_P_FFN_NORM: case TERA_P_FINAL_NORM: return 5;
    default: return 6; /* lm_head */
    }
}
