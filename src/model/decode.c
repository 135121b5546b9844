/* Inference forward with a key/value cache (include/tera/decode.h).
 *
 * One pass handles n rows: row r is token tok[r] of sequence seq[r] at position pos[r]. Every
 * product, norm, rotation and softmax is an operation of the model's backend; attention over the
 * cache is, per row and key/value head, two products and a row softmax:
 *     S[G, p+1] = scale * Q[G, hd] K[0..p]^T,   P = softmax(S),   out[G, hd] = P V[0..p]
 * where the G = H / Hkv query heads sharing the kv head are contiguous in q. Rows of one sequence
 * in one pass come in increasing positions, and every row's key and value are written to the cache
 * before any attention, so a row sees exactly the positions 0..p of its sequence (causal). */
#include "tera/decode.h"

#include <math.h>
#include <string.h>

#include "carve.h"
#include "moe.h"
#include "tera/backend.h"

struct tera_decoder {
    tera_model *m;
    tera_backend *be;
    int B, T_max, R, chunk; /* sequences, positions per sequence, rows per pass, prefill chunk */
    int64_t D, H, Hkv, hd, G, E, K, F, Fs, Fd, V;
    int *len;                /* [B] positions cached per sequence */
    float *kc, *vc;          /* [L][B, Hkv, T_max, hd] */
    float *rope_cos, *rope_sin; /* [T_max, hd/2] */
    /* per-pass scratch, for R rows */
    int32_t *tok, *seq, *pos; /* [R] */
    float *x, *ln, *rstd, *q, *k, *v, *att, *h; /* [R, D] / [R] / [R, H*hd] / [R, Hkv*hd] */
    float *scores, *probs, *slse; /* [G, T_max], [G, T_max], [G] */
    float *rlogits, *rprobs, *rlse; /* [R, E], [R, E], [R] */
    int32_t *topi, *slot_row, *row_tok, *exp_off, *sel_count; /* [R*K], [R*K], [R*K], [E+1], [E] */
    float *topw;             /* [R, K] */
    void *plan_scratch, *route_scratch;
    float *xg, *ye;          /* [R*K, D] */
    float *a1, *a3, *g;      /* [max(R*K*F, R*Fs, R*Fd)] */
    float *logits;           /* [R, V] */
    void *block;             /* every buffer above but len: one allocation of the backend */
};


static void carve_all(tera_decoder *d, carver *c) {
    const tera_model_config *cfg = &d->m->cfg;
    const int64_t R = d->R, L = cfg->n_layers, cache = L * d->B * d->Hkv * d->T_max * d->hd;
    int64_t Fw = R * d->K * d->F;
    if (R * d->Fs > Fw) Fw = R * d->Fs;
    if (R * d->Fd > Fw) Fw = R * d->Fd;
    const tera_moe_routing route = tera_moe_routing_of(cfg);
    d->kc = CARVE_F(c, cache);
    d->vc = CARVE_F(c, cache);
    d->rope_cos = CARVE_F(c, (int64_t)d->T_max * d->hd / 2);
    d->rope_sin = CARVE_F(c, (int64_t)d->T_max * d->hd / 2);
    d->tok = CARVE_I(c, R);
    d->seq = CARVE_I(c, R);
    d->pos = CARVE_I(c, R);
    d->x = CARVE_F(c, R * d->D);
    d->ln = CARVE_F(c, R * d->D);
    d->rstd = CARVE_F(c, R);
    d->q = CARVE_F(c, R * d->H * d->hd);
    d->k = CARVE_F(c, R * d->Hkv * d->hd);
    d->v = CARVE_F(c, R * d->Hkv * d->hd);
    d->att = CARVE_F(c, R * d->H * d->hd);
    d->h = CARVE_F(c, R * d->D);
    d->scores = CARVE_F(c, d->G * d->T_max);
    d->probs = CARVE_F(c, d->G * d->T_max);
    d->slse = CARVE_F(c, d->G);
    d->rlogits = CARVE_F(c, R * d->E);
    d->rprobs = CARVE_F(c, R * d->E);
    d->rlse = CARVE_F(c, R);
    d->topi = CARVE_I(c, R * d->K);
    d->topw = CARVE_F(c, R * d->K);
    d->slot_row = CARVE_I(c, R * d->K);
    d->row_tok = CARVE_I(c, R * d->K);
    d->exp_off = CARVE_I(c, d->E + 1);
    d->sel_count = CARVE_I(c, d->E);
    d->plan_scratch = carve(c, tera_moe_plan_scratch_bytes(R * d->K, 1, (int)d->E));
    d->route_scratch = route.n_groups > 1 ? carve(c, tera_moe_route_scratch_bytes(&route, d->be->ops.max_threads(d->be)))
                                          : NULL;
    d->xg = CARVE_F(c, R * d->K * d->D);
    d->ye = CARVE_F(c, R * d->K * d->D);
    d->a1 = CARVE_F(c, Fw);
    d->a3 = CARVE_F(c, Fw);
    d->g = CARVE_F(c, Fw);
    d->logits = CARVE_F(c, R * d->V);
}

tera_status tera_decoder_create(tera_decoder **out, tera_model *m, int B, int T_max, int chunk) {
    *out = NULL;
    const tera_model_config *cfg = &m->cfg;
    if (m->par.ep > 1 || m->par.tp > 1 || m->par.pp > 1 || !m->w)
        return tera_fail(TERA_ERR_CONFIG, "decoding needs the whole model in one process (ep = %d, tp = %d, pp = %d%s)",
                         m->par.ep, m->par.tp, m->par.pp, m->w ? "" : ", sharded parameters");
    if (strcmp(m->be->name, "cpu") != 0) /* the cache rows and logits are copied with memcpy: host memory */
        return tera_fail(TERA_ERR_CONFIG, "decoding runs on the CPU backend (this model computes on '%s')", m->be->name);
    if (B < 1 || T_max < 1 || T_max > cfg->max_seq_len)
        return tera_fail(TERA_ERR_ARG, "decoder for %d sequences of %d positions: need B >= 1 and 1 <= T <= "
                         "model.max_seq_len = %d", B, T_max, cfg->max_seq_len);
    tera_decoder *d = tera_calloc(1, sizeof *d);
    d->m = m;
    d->be = m->be;
    d->B = B;
    d->T_max = T_max;
    d->chunk = chunk > 0 ? chunk : 256;
    if (d->chunk > T_max) d->chunk = T_max;
    d->R = B > d->chunk ? B : d->chunk;
    d->D = cfg->dim;
    d->H = cfg->n_heads;
    d->Hkv = cfg->n_kv_heads;
    d->hd = d->D / d->H;
    d->G = d->H / d->Hkv;
    d->E = cfg->n_experts;
    d->K = cfg->top_k;
    d->F = cfg->ffn_dim;
    d->Fs = m->Fsl;
    d->Fd = m->Fdl;
    d->V = cfg->vocab_size;
    d->len = tera_calloc((size_t)B, sizeof(int));
    carver c = {0};
    carve_all(d, &c);
    d->block = d->be->mem.alloc(d->be, c.off);
    if (!d->block) {
        free(d->len);
        free(d);
        return tera_fail(TERA_ERR_NOMEM, "decoder: cannot allocate %.1f MiB (key/value cache and scratch)",
                         (double)c.off / (1024.0 * 1024.0));
    }
    c = (carver){.base = d->block};
    carve_all(d, &c);
    memset(d->block, 0, c.off);
    d->be->ops.rope_tables(d->be, d->rope_cos, d->rope_sin, T_max, (int)d->hd, cfg->rope_theta);
    *out = d;
    return TERA_OK;
}

void tera_decoder_free(tera_decoder *d) {
    if (!d) return;
    d->be->mem.free(d->be, d->block);
    free(d->len);
    free(d);
}

void tera_decoder_reset(tera_decoder *d, int b) {
    for (int i = 0; i < d->B; i++)
        if (b < 0 || i == b) d->len[i] = 0;
}

void tera_decoder_truncate(tera_decoder *d, int b, int n) {
    TERA_ASSERTF(b >= 0 && b < d->B && n >= 0 && n <= d->len[b], "truncate sequence %d of %d to %d positions", b, d->B, n);
    d->len[b] = n;
}

int tera_decoder_len(const tera_decoder *d, int b) { return d->len[b]; }
int tera_decoder_max_len(const tera_decoder *d) { return d->T_max; }
int tera_decoder_batch(const tera_decoder *d) { return d->B; }

/* Key/value cache row of (layer l, sequence b, kv head g, position p): [hd]. */
static float *cache_at(const tera_decoder *d, float *base, int l, int b, int64_t g, int p) {
    return base + ((((int64_t)l * d->B + b) * d->Hkv + g) * d->T_max + p) * d->hd;
}

/* SwiGLU FFN on n rows: y[n, D] += w2(silu(x w1^T) * (x w3^T)), hidden width F. */
static void ffn(tera_decoder *d, float *y, const float *x, const float *w1, const float *w3, const float *w2, int64_t n,
                int64_t F) {
    tera_backend *be = d->be;
    be->ops.linear_forward(be, d->a1, x, w1, n, d->D, F, 0.0f);
    be->ops.linear_forward(be, d->a3, x, w3, n, d->D, F, 0.0f);
    be->ops.swiglu_forward(be, d->g, d->a1, d->a3, n * F);
    be->ops.linear_forward(be, y, d->g, w2, n, F, d->D, 1.0f);
}

/* The MoE block on n rows of ln: y[n, D] += the weighted routed experts (dropless) + shared experts. */
static void moe(tera_decoder *d, int l, float *y, const float *ln, int64_t n) {
    tera_backend *be = d->be;
    const tera_model *m = d->m;
    const tera_model_config *c = &m->cfg;
    const tera_layer_view *W = &m->W.layers[l];
    const int E = (int)d->E, K = (int)d->K;
    const int64_t D = d->D, F = d->F;
    be->ops.linear_forward_fp32(be, d->rlogits, ln, W->router, n, D, E, 0.0f);
    tera_moe_score_forward(be, d->rprobs, d->rlse, d->rlogits, n, E, c->router_score);
    const tera_moe_routing route = tera_moe_routing_of(c);
    tera_moe_route_at(be, d->topi, d->topw, d->rprobs, c->aux_free ? m->router_bias + (int64_t)l * E : NULL, n, E, K,
                      &route, d->route_scratch, 1, d->pos, l); /* the rows' own positions */
    tera_moe_plan(be, d->slot_row, d->row_tok, d->exp_off, d->sel_count, d->plan_scratch, d->topi, d->rprobs, 1, (int)n,
                  E, K, 0, c->drop_policy);
    be->ops.moe_gather_forward(be, d->xg, ln, d->row_tok, n * K, D);
    for (int e = 0; e < E; e++) {
        const int64_t r0 = d->exp_off[e], ne = d->exp_off[e + 1] - r0;
        if (ne == 0) continue;
        const float *xe = d->xg + r0 * D;
        be->ops.linear_forward(be, d->a1, xe, W->w1 + (int64_t)e * F * D, ne, D, F, 0.0f);
        be->ops.linear_forward(be, d->a3, xe, W->w3 + (int64_t)e * F * D, ne, D, F, 0.0f);
        be->ops.swiglu_forward(be, d->g, d->a1, d->a3, ne * F);
        be->ops.linear_forward(be, d->ye + r0 * D, d->g, W->w2 + (int64_t)e * D * F, ne, F, D, 0.0f);
    }
    be->ops.moe_combine_forward(be, y, d->ye, d->topw, d->slot_row, n, K, D);
    if (c->n_shared_experts > 0) ffn(d, y, ln, W->sw1, W->sw3, W->sw2, n, d->Fs);
}

/* Rotates rows [0, n) of x (nh heads each) at their positions: runs of consecutive rows of one
 * sequence at consecutive positions in one call. x: [n, nh, hd] */
static void rope_rows(tera_decoder *d, float *x, int64_t n, int64_t nh) {
    const int64_t half = d->hd / 2;
    for (int64_t r = 0; r < n;) {
        int64_t e = r + 1;
        while (e < n && d->seq[e] == d->seq[r] && d->pos[e] == d->pos[e - 1] + 1) e++;
        d->be->ops.rope_forward(d->be, x + r * nh * d->hd, d->rope_cos + d->pos[r] * half, d->rope_sin + d->pos[r] * half,
                                1, (int)(e - r), (int)nh, (int)d->hd);
        r = e;
    }
}

/* Attention of row r of layer l against its sequence's cached positions 0..pos[r]. */
static void attend(tera_decoder *d, int l, int64_t r) {
    tera_backend *be = d->be;
    const int b = d->seq[r], p = d->pos[r];
    const int64_t hd = d->hd, G = d->G, np = p + 1;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int64_t g = 0; g < d->Hkv; g++) {
        const float *qg = d->q + (r * d->H + g * G) * hd;      /* [G, hd] */
        const float *kg = cache_at(d, d->kc, l, b, g, 0);      /* [np, hd] */
        const float *vg = cache_at(d, d->vc, l, b, g, 0);      /* [np, hd] */
        be->ops.gemm(be, 0, 1, G, np, hd, scale, qg, hd, kg, hd, 0.0f, d->scores, np);
        be->ops.softmax_forward(be, d->probs, d->slse, d->scores, G, np);
        be->ops.gemm(be, 0, 0, G, hd, np, 1.0f, d->probs, np, vg, hd, 0.0f, d->att + (r * d->H + g * G) * hd, hd);
    }
}

/* One pass over n rows (tok, seq, pos filled; every row's position < T_max). Logits of rows
 * [r0, n) land in d->logits [n - r0, V]. */
static void forward_rows(tera_decoder *d, int64_t n, int64_t r0) {
    tera_backend *be = d->be;
    const tera_model *m = d->m;
    const tera_model_config *c = &m->cfg;
    const int64_t D = d->D, H = d->H, Hkv = d->Hkv, hd = d->hd;
    be->ops.embedding_forward(be, d->x, m->W.embed, d->tok, n, D);
    for (int l = 0; l < c->n_layers; l++) {
        const tera_layer_view *W = &m->W.layers[l];
        be->ops.rmsnorm_forward(be, d->ln, d->rstd, d->x, W->attn_norm, n, D, c->norm_eps);
        be->ops.linear_forward(be, d->q, d->ln, W->wq, n, D, H * hd, 0.0f);
        be->ops.linear_forward(be, d->k, d->ln, W->wk, n, D, Hkv * hd, 0.0f);
        be->ops.linear_forward(be, d->v, d->ln, W->wv, n, D, Hkv * hd, 0.0f);
        rope_rows(d, d->q, n, H);
        rope_rows(d, d->k, n, Hkv);
        for (int64_t r = 0; r < n; r++)
            for (int64_t g = 0; g < Hkv; g++) {
                memcpy(cache_at(d, d->kc, l, d->seq[r], g, d->pos[r]), d->k + (r * Hkv + g) * hd, sizeof(float) * (size_t)hd);
                memcpy(cache_at(d, d->vc, l, d->seq[r], g, d->pos[r]), d->v + (r * Hkv + g) * hd, sizeof(float) * (size_t)hd);
            }
        for (int64_t r = 0; r < n; r++) attend(d, l, r);
        /* h = x + o_proj(att); the FFN block adds onto h */
        memcpy(d->h, d->x, sizeof(float) * (size_t)(n * D));
        be->ops.linear_forward(be, d->h, d->att, W->wo, n, H * hd, D, 1.0f);
        be->ops.rmsnorm_forward(be, d->ln, d->rstd, d->h, W->ffn_norm, n, D, c->norm_eps);
        memcpy(d->x, d->h, sizeof(float) * (size_t)(n * D));
        if (l >= c->first_k_dense)
            moe(d, l, d->x, d->ln, n);
        else
            ffn(d, d->x, d->ln, W->dw1, W->dw3, W->dw2, n, d->Fd);
    }
    const int64_t nh = n - r0;
    be->ops.rmsnorm_forward(be, d->ln, d->rstd, d->x + r0 * D, m->W.final_norm, nh, D, c->norm_eps);
    be->ops.linear_forward(be, d->logits, d->ln, m->W.lm_head, nh, D, d->V, 0.0f);
}

static tera_status check_token(const tera_decoder *d, int32_t t) {
    if (t < 0 || t >= d->V)
        return tera_fail(TERA_ERR_ARG, "token id %d is outside the vocabulary [0, %ld)", (int)t, (long)d->V);
    return TERA_OK;
}

tera_status tera_decoder_append(tera_decoder *d, int b, const int32_t *tokens, int n, float *logits, int all) {
    TERA_ASSERTF(b >= 0 && b < d->B, "sequence %d of %d", b, d->B);
    if (n < 1) return tera_fail(TERA_ERR_ARG, "nothing to append (0 tokens)");
    if ((int64_t)d->len[b] + n > d->T_max)
        return tera_fail(TERA_ERR_ARG, "%d + %d tokens exceed the context of %d positions", d->len[b], n, d->T_max);
    for (int i = 0; i < n; i++) TERA_TRY(check_token(d, tokens[i]));
    for (int i0 = 0; i0 < n; i0 += d->chunk) {
        const int nc = n - i0 < d->chunk ? n - i0 : d->chunk;
        for (int i = 0; i < nc; i++) {
            d->tok[i] = tokens[i0 + i];
            d->seq[i] = b;
            d->pos[i] = d->len[b] + i;
        }
        const int last = i0 + nc == n;
        forward_rows(d, nc, all ? 0 : nc - 1); /* all = 0: the head runs on the chunk's last row only */
        d->len[b] += nc;
        if (all)
            memcpy(logits + (int64_t)i0 * d->V, d->logits, sizeof(float) * (size_t)(nc * d->V));
        else if (last)
            memcpy(logits, d->logits, sizeof(float) * (size_t)d->V);
    }
    return TERA_OK;
}

tera_status tera_decoder_step(tera_decoder *d, const int32_t *tokens, const uint8_t *active, float *logits) {
    int64_t n = 0;
    for (int b = 0; b < d->B; b++) {
        if (active && !active[b]) continue;
        if (d->len[b] >= d->T_max)
            return tera_fail(TERA_ERR_ARG, "sequence %d is full (%d positions, the context)", b, d->T_max);
        TERA_TRY(check_token(d, tokens[b]));
        d->tok[n] = tokens[b];
        d->seq[n] = b;
        d->pos[n] = d->len[b];
        n++;
    }
    if (n == 0) return TERA_OK;
    forward_rows(d, n, 0);
    for (int64_t r = 0; r < n; r++) {
        memcpy(logits + (int64_t)d->seq[r] * d->V, d->logits + r * d->V, sizeof(float) * (size_t)d->V);
        d->len[d->seq[r]]++;
    }
    return TERA_OK;
}

/* UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF. */
char *tera_utf8_clean(const char *s, size_t n) {
    char *o = tera_malloc(3 * n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        const unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
        int ok = len > 0 && i + len <= n;
        for (size_t j = 1; ok && j < len; j++) ok = ((unsigned char)s[i + j] & 0xC0) == 0x80;
        if (ok && len == 3) { /* no overlong forms, no surrogates */
            const unsigned char d = (unsigned char)s[i + 1];
            ok = !(c == 0xE0 && d < 0xA0) && !(c == 0xED && d >= 0xA0);
        }
        if (ok && len == 4) {
            const unsigned char d = (unsigned char)s[i + 1];
            ok = !(c == 0xF0 && d < 0x90) && !(c == 0xF4 && d >= 0x90);
        }
        if (ok && c != 0) {
            memcpy(o + k, s + i, len);
            k += len, i += len;
        } else { /* (a NUL byte too: JSON strings from cJSON end there) */
            memcpy(o + k, "\xEF\xBF\xBD", 3);
            k += 3, i++;
        }
    }
    o[k] = 0;
    return o;
}
