/* Router scoring (softmax or sigmoid), top-k selection (optionally group-limited), the sigmoid
 * router's backward, and the dispatch plan (grouping assignments by expert). */
#include "moe.h"

#include <float.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/vmath.h"
#include "tera/backend.h"
#include "tera/status.h"

/* Every loop over tokens here has independent rows: the backend runs them as it likes
 * (ops.for_ranges; the CPU: static OpenMP ranges), and the numbers do not depend on how. */

tera_moe_routing tera_moe_routing_of(const tera_model_config *c) {
    return (tera_moe_routing){.score = c->router_score,
                              .n_groups = c->n_groups > 1 ? c->n_groups : 1,
                              .topk_groups = c->topk_groups > 1 ? c->topk_groups : 1,
                              .scale = c->routed_scale > 0.0f ? c->routed_scale : 1.0f,
                              .force_balance = c->router_force_balance != 0};
}

/* sum of x[0..n), 16 lanes in a fixed order (vectorised without reassociation) */
static inline float lane_sum(const float *restrict x, int64_t n) {
    float acc[TERA_LANES] = {0};
    int64_t i = 0;
    for (; i + TERA_LANES <= n; i += TERA_LANES)
        for (int l = 0; l < TERA_LANES; l++) acc[l] += x[i + l];
    for (; i < n; i++) acc[i % TERA_LANES] += x[i];
    float s = 0.0f;
    for (int l = 0; l < TERA_LANES; l++) s += acc[l];
    return s;
}

typedef struct {
    float *scores, *lse, *rsum;
    const float *logits;
    int E;
} score_ctx;

static void sigmoid_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const score_ctx *c = ctx;
    (void)worker;
    const int E = c->E;
    for (int64_t n = lo; n < hi; n++) {
        const float *r = c->logits + n * E;
        const float mx = tera_max(r, E);
        c->lse[n] = mx + logf(tera_sum_exp(r, E, mx));
        float *s = c->scores + n * E;
        for (int e = 0; e < E; e++) s[e] = tera_sigmoid(r[e]);
    }
}

static void sum_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const score_ctx *c = ctx;
    (void)worker;
    for (int64_t n = lo; n < hi; n++) c->rsum[n] = lane_sum(c->scores + n * c->E, c->E);
}

void tera_moe_score_forward(tera_backend *be, float *scores, float *lse, const float *logits, int64_t N, int E,
                            tera_router_score score) {
    if (score == TERA_ROUTER_SOFTMAX) {
        be->ops.softmax_forward(be, scores, lse, logits, N, E);
        return;
    }
    score_ctx c = {.scores = scores, .lse = lse, .logits = logits, .E = E};
    be->ops.for_ranges(be, N, sigmoid_rows, &c);
}

void tera_moe_score_sums(tera_backend *be, float *rsum, const float *scores, int64_t N, int E) {
    score_ctx c = {.scores = (float *)scores, .rsum = rsum, .E = E};
    be->ops.for_ranges(be, N, sum_rows, &c);
}

/* Offers expert e with selection score u to the best-k list ti/tw of cnt entries (descending u; an
 * equal u goes after the entries already there, so offering experts in ascending order breaks ties
 * towards the lower index). */
static inline void topk_offer(int32_t *ti, float *tw, int *cnt, int k, int e, float u) {
    if (*cnt == k && !(u > tw[k - 1])) return;
    int pos = *cnt < k ? (*cnt)++ : k - 1;
    for (; pos > 0 && u > tw[pos - 1]; pos--) ti[pos] = ti[pos - 1], tw[pos] = tw[pos - 1];
    ti[pos] = e, tw[pos] = u;
}

/* Offers experts e0..e1-1 in ascending order, with scores u = p (+ bias), to the best-k list. Once the
 * list is full, a block of SCAN_BLOCK experts none of whose scores beats the list's last is skipped
 * (one vectorised compare per block): the list's last only rises, so topk_offer would have refused
 * each of them. The same list as offering every expert, ties and NaN (never above) included. */
enum { SCAN_BLOCK = 32 };
static inline void topk_scan(int32_t *ti, float *tw, int *cnt, int k, const float *restrict p,
                             const float *restrict bias, int e0, int e1) {
    int e = e0;
    for (; e < e1 && *cnt < k; e++) topk_offer(ti, tw, cnt, k, e, bias ? p[e] + bias[e] : p[e]);
    while (e < e1) {
        const int end = e1 - e > SCAN_BLOCK ? e + SCAN_BLOCK : e1;
        const float thr = tw[k - 1];
        int hit = 0;
        if (bias)
            for (int i = e; i < end; i++) hit |= p[i] + bias[i] > thr;
        else
            for (int i = e; i < end; i++) hit |= p[i] > thr;
        if (hit)
            for (int i = e; i < end; i++) topk_offer(ti, tw, cnt, k, i, bias ? p[i] + bias[i] : p[i]);
        e = end;
    }
}

typedef struct {
    int32_t *topi;
    float *topw;
    const float *probs, *bias;
    int E, k;
    const tera_moe_routing *r;
    char *scratch;
    size_t stride;
    const int32_t *pos; /* forced balance: positions of the rows (NULL: row mod T) */
    int T, layer;
} route_ctx;

/* The chosen scores tw[0..k) renormalised to sum 1. A sum of exactly 0 (every chosen score underflowed:
 * sigmoid logits below about -88, or forced balanced routing choosing experts a softmax gives 0)
 * gives equal weights 1/k instead of 0/0; the router backward then passes nothing through the
 * normalisation (the weights do not depend on the scores there). Otherwise the same bits as before. */
static inline void renormalise(float *tw, int k, float sum) {
    if (sum > 0.0f) {
        for (int j = 0; j < k; j++) tw[j] /= sum;
    } else {
        for (int j = 0; j < k; j++) tw[j] = 1.0f / (float)k;
    }
}

static void topk_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const route_ctx *c = ctx;
    (void)worker;
    const int E = c->E, k = c->k;
    const float *probs = c->probs, *bias = c->bias;
    int32_t *topi = c->topi;
    float *topw = c->topw;
    for (int64_t n = lo; n < hi; n++) {
        const float *p = probs + n * E;
        int32_t *ti = topi + n * k;
        float *tw = topw + n * k;
        /* one pass over the experts, keeping the best k so far sorted by score: O(E k) at worst,
         * about O(E) */
        int cnt = 0;
        topk_scan(ti, tw, &cnt, k, p, bias, 0, E);
        float sum = 0.0f;
        for (int j = 0; j < k; j++) tw[j] = p[ti[j]], sum += tw[j];
        renormalise(tw, k, sum);
    }
}

void tera_moe_topk(tera_backend *be, int32_t *topi, float *topw, const float *probs, const float *bias, int64_t N,
                   int E, int k) {
    route_ctx c = {.topi = topi, .topw = topw, .probs = probs, .bias = bias, .E = E, .k = k};
    be->ops.for_ranges(be, N, topk_rows, &c);
}

/* Per-thread scratch of the group-limited top-k: group scores [G], then the best groups' scores
 * [topk_groups] and indices [topk_groups]. */
static size_t route_thread_bytes(const tera_moe_routing *r) {
    const size_t b = sizeof(float) * (size_t)(r->n_groups + r->topk_groups) + sizeof(int32_t) * (size_t)r->topk_groups;
    return (b + 63) / 64 * 64;
}

size_t tera_moe_route_scratch_bytes(const tera_moe_routing *r, int threads) {
    return r->n_groups > 1 ? route_thread_bytes(r) * (size_t)(threads > 0 ? threads : 1) : 0;
}

/* (u1, u2) <- the best two of (u1, u2) and u (NaN never enters) */
static inline void top2_offer(float *u1, float *u2, float u) {
    if (u > *u1) *u2 = *u1, *u1 = u;
    else if (u > *u2) *u2 = u;
}

/* The two largest scores u = p (+ bias) of experts [e0, e1) (-inf where fewer): the values depend on
 * the set alone, so groups of 32 or more keep a best two per lane of 16 (compares and blends, which
 * GCC vectorises), then merge the lanes and the tail. */
static void group_top2(const float *restrict p, const float *restrict bias, int e0, int e1, float *m1, float *m2) {
    enum { L = 16 };
    float u1 = -INFINITY, u2 = -INFINITY;
    int e = e0;
    if (e1 - e0 >= 2 * L) {
        float a1[L], a2[L];
        for (int j = 0; j < L; j++) a1[j] = a2[j] = -INFINITY;
        for (; e + L <= e1; e += L)
            for (int j = 0; j < L; j++) {
                const float u = bias ? p[e + j] + bias[e + j] : p[e + j];
                const float lo = u > a1[j] ? a1[j] : u;
                a1[j] = u > a1[j] ? u : a1[j];
                a2[j] = lo > a2[j] ? lo : a2[j];
            }
        for (int j = 0; j < L; j++) top2_offer(&u1, &u2, a1[j]), top2_offer(&u1, &u2, a2[j]);
    }
    for (; e < e1; e++) top2_offer(&u1, &u2, bias ? p[e] + bias[e] : p[e]);
    *m1 = u1, *m2 = u2;
}

/* Group-limited top-k of rows [lo, hi); worker picks the thread's scratch. */
static void group_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const route_ctx *c = ctx;
    const tera_moe_routing *r = c->r;
    const int E = c->E, k = c->k, G = r->n_groups, Gk = r->topk_groups, gsz = E / G;
    const int sig = r->score == TERA_ROUTER_SIGMOID;
    const float *bias = c->bias;
    float *gs = (float *)(c->scratch + c->stride * (size_t)worker); /* [G] */
    float *gw = gs + G;                                            /* [Gk] */
    int32_t *gi = (int32_t *)(gw + Gk);                            /* [Gk] */
    for (int64_t n = lo; n < hi; n++) {
        const float *p = c->probs + n * E;
        int32_t *ti = c->topi + n * k;
        float *tw = c->topw + n * k;
        /* group scores: max u (softmax, DeepSeek-V2) or the sum of the two largest u (sigmoid,
         * DeepSeek-V3) */
        for (int g = 0; g < G; g++) {
            float m1, m2;
            group_top2(p, bias, g * gsz, (g + 1) * gsz, &m1, &m2);
            gs[g] = sig && gsz > 1 ? m1 + m2 : m1;
        }
        /* the topk_groups best groups (ties: lower index), then in ascending group order */
        int cnt = 0;
        for (int g = 0; g < G; g++) topk_offer(gi, gw, &cnt, Gk, g, gs[g]);
        for (int i = 1; i < Gk; i++)
            for (int j = i; j > 0 && gi[j] < gi[j - 1]; j--) {
                const int32_t t = gi[j];
                gi[j] = gi[j - 1], gi[j - 1] = t;
            }
        /* top-k of the experts of those groups, offered in ascending expert order */
        cnt = 0;
        for (int i = 0; i < Gk; i++) topk_scan(ti, tw, &cnt, k, p, bias, gi[i] * gsz, (gi[i] + 1) * gsz);
        float sum = 0.0f;
        for (int j = 0; j < k; j++) tw[j] = p[ti[j]], sum += tw[j];
        renormalise(tw, k, sum);
    }
}

static void scale_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const route_ctx *c = ctx;
    (void)worker;
    const float sc = c->r->scale;
    for (int64_t i = lo * c->k; i < hi * c->k; i++) c->topw[i] *= sc;
}

/* model.router_force_balance: experts (t k + j + layer) mod E of the token at position t, the chosen
 * scores renormalised (the scale is applied after, as for the other selections) */
static void forced_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const route_ctx *c = ctx;
    (void)worker;
    const int E = c->E, k = c->k;
    for (int64_t n = lo; n < hi; n++) {
        const float *p = c->probs + n * E;
        int32_t *ti = c->topi + n * k;
        float *tw = c->topw + n * k;
        const int64_t t = c->pos ? (int64_t)c->pos[n] : n % c->T;
        const int64_t e0 = (t * k + c->layer) % E;
        float sum = 0.0f;
        for (int j = 0; j < k; j++) {
            const int e = (int)((e0 + j) % E);
            ti[j] = e, tw[j] = p[e], sum += tw[j];
        }
        renormalise(tw, k, sum);
    }
}

void tera_moe_route(tera_backend *be, int32_t *topi, float *topw, const float *scores, const float *bias, int64_t N,
                    int E, int k, const tera_moe_routing *r, void *scratch) {
    TERA_ASSERTF(!r->force_balance, "forced balanced routing needs the rows' positions: tera_moe_route_at");
    route_ctx c = {.topi = topi, .topw = topw, .probs = scores, .bias = bias, .E = E, .k = k, .r = r,
                   .scratch = scratch, .stride = route_thread_bytes(r)};
    if (r->n_groups <= 1) {
        be->ops.for_ranges(be, N, topk_rows, &c);
    } else {
        const int G = r->n_groups, Gk = r->topk_groups, gsz = E / G;
        TERA_ASSERTF(E % G == 0 && 1 <= Gk && Gk <= G && k <= Gk * gsz && scratch,
                     "group-limited routing: E %d, %d groups, %d per token, top-%d", E, G, Gk, k);
        be->ops.for_ranges(be, N, group_rows, &c);
    }
    if (r->scale != 1.0f) be->ops.for_ranges(be, N, scale_rows, &c);
}

void tera_moe_route_at(tera_backend *be, int32_t *topi, float *topw, const float *scores, const float *bias, int64_t N,
                       int E, int k, const tera_moe_routing *r, void *scratch, int T, const int32_t *pos, int layer) {
    if (!r->force_balance) {
        tera_moe_route(be, topi, topw, scores, bias, N, E, k, r, scratch);
        return;
    }
    TERA_ASSERTF(1 <= k && k <= E && (pos || T >= 1) && layer >= 0, "forced balanced routing: E %d, top-%d, T %d, layer %d",
                 E, k, T, layer);
    route_ctx c = {.topi = topi, .topw = topw, .probs = scores, .E = E, .k = k, .r = r, .pos = pos, .T = T,
                   .layer = layer};
    be->ops.for_ranges(be, N, forced_rows, &c);
    if (r->scale != 1.0f) be->ops.for_ranges(be, N, scale_rows, &c);
}

/* gcount [E] (NULL: per sequence): the count every sequence's balancing gradient uses instead of its
 * own sel_count row (switch_global: the micro-batch's mean count per sequence) */
/* The router backward's rows: everything its loops need. */
typedef struct {
    float *dlogits, *dscores;
    const float *logits, *s, *lse, *topw, *dtopw, *gcount;
    const int32_t *topi, *sel_count;
    int T, E, k;
    float scale, aux_scale, z_scale, gunit;
} rback_ctx;

static void sigmoid_back_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const rback_ctx *c = ctx;
    (void)worker;
    const int T = c->T, E = c->E, k = c->k;
    const float gunit = c->gunit, scale = c->scale, z_scale = c->z_scale;
    const int32_t *topi = c->topi;
    const float *topw = c->topw, *dtopw = c->dtopw, *gcount = c->gcount;
    for (int64_t t = lo; t < hi; t++) {
        const float *restrict st = c->s + t * E, *restrict xt = c->logits + t * E;
        const int32_t *restrict cnt = c->sel_count + (t / T) * E;
        float *restrict dl = c->dlogits + t * E; /* holds d/ds first, then d/dlogits */
        /* balancing loss: q = s / sum(s), dq_e = aux_scale E f_e / T; through the normalisation
         * ds_e = (dq_e - sum_e' dq_e' q_e') / sum(s) */
        const float Sa = lane_sum(st, E), inv = 1.0f / Sa;
        if (gcount)
            for (int e = 0; e < E; e++) dl[e] = gunit * gcount[e];
        else
            for (int e = 0; e < E; e++) dl[e] = gunit * (float)cnt[e];
        const float dq = tera_dot(dl, st, E) * inv;
        for (int e = 0; e < E; e++) dl[e] = (dl[e] - dq) * inv;
        /* combine weights w_j = scale s_{e_j} / S: ds_{e_i} += (scale dw_i - sum_j dw_j w_j) / S */
        float S = 0.0f, dw = 0.0f;
        for (int j = 0; j < k; j++) {
            S += st[topi[t * k + j]];
            dw += dtopw[t * k + j] * topw[t * k + j];
        }
        if (S > 0.0f) /* S = 0: equal weights, constant (renormalise) */
            for (int j = 0; j < k; j++) dl[topi[t * k + j]] += (scale * dtopw[t * k + j] - dw) / S;
        /* sigmoid: ds/dx = s (1 - s); z-loss: d(lse^2)/dx = 2 lse softmax(x) */
        if (z_scale != 0.0f) {
            const float l = c->lse[t], zc = z_scale * 2.0f * l;
            for (int e = 0; e < E; e++) dl[e] = dl[e] * (st[e] * (1.0f - st[e])) + zc * tera_vexpf(xt[e] - l);
        } else {
            for (int e = 0; e < E; e++) dl[e] *= st[e] * (1.0f - st[e]);
        }
    }
}

/* gcount [E] (NULL: per sequence): the count every sequence's balancing gradient uses instead of its
 * own sel_count row (switch_global: the micro-batch's mean count per sequence) */
static void sigmoid_backward(tera_backend *be, float *dlogits, const float *logits, const float *s, const float *lse,
                             const int32_t *topi, const float *topw, const float *dtopw, const int32_t *sel_count,
                             const float *gcount, int B, int T, int E, int k, float scale, float aux_scale,
                             float z_scale) {
    const int64_t N = (int64_t)B * T;
    rback_ctx c = {.dlogits = dlogits, .logits = logits, .s = s, .lse = lse, .topw = topw, .dtopw = dtopw,
                   .gcount = gcount, .topi = topi, .sel_count = sel_count, .T = T, .E = E, .k = k, .scale = scale,
                   .aux_scale = aux_scale, .z_scale = z_scale,
                   .gunit = aux_scale * (float)E / ((float)T * (float)k * (float)T)}; /* d aux_b / d q_e per selection */
    be->ops.for_ranges(be, N, sigmoid_back_rows, &c);
}

void tera_moe_sigmoid_backward(tera_backend *be, float *dlogits, const float *logits, const float *s, const float *lse,
                               const int32_t *topi, const float *topw, const float *dtopw,
                               const int32_t *sel_count, int B, int T, int E, int k, float scale,
                               float aux_scale, float z_scale) {
    sigmoid_backward(be, dlogits, logits, s, lse, topi, topw, dtopw, sel_count, NULL, B, T, E, k, scale, aux_scale,
                     z_scale);
}

/* The routing statistics on the backend's threads, in one pass of fixed work items: items of even
 * index are blocks of tokens for the router entropy (STATS_BLOCKS blocks, bounds set by the token
 * count alone; each summed in token and expert order by whichever thread takes it, the blocks then
 * added in order), items of odd index are ranges of experts for the per-sequence sums P_{b,e} (each
 * summed in token order, whatever thread and range it falls in). The same bits on any thread count.
 *
 * The entropy of a softmax row needs no logarithm: log p_e = x_e - lse, so H = -sum_e p_e (x_e - lse).
 * Sigmoid scores normalised per token take a vectorised float logarithm (tera_vlogf). Both sum each
 * row in eight fixed lanes, in double. */
enum { STATS_BLOCKS = 64 };
typedef struct {
    const float *scores, *logits, *lse, *rsum; /* logits, lse: softmax; rsum: sigmoid normalisers */
    double *psum;                              /* [B + 1, E] */
    int64_t N, per;                            /* tokens, tokens per entropy block */
    int B, T, E, nb, eper;                     /* entropy blocks, experts per range */
    double part[STATS_BLOCKS];
} stats_ctx;

static double softmax_row_entropy(const float *restrict p, const float *restrict x, float l, int E) {
    double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int e = 0;
    for (; e + 8 <= E; e += 8)
        for (int j = 0; j < 8; j++) acc[j] += (double)p[e + j] * (double)(x[e + j] - l);
    for (int j = 0; e < E; e++, j++) acc[j] += (double)p[e] * (double)(x[e] - l);
    return -(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
}

/* -sum_e q_e log q_e of the sigmoid scores s normalised by their sum r (a q below FLT_MIN takes the log
 * of q + FLT_MIN: q log q under 1e-36; written without a branch, which would stop the vectoriser) */
static double sigmoid_row_entropy(const float *restrict s, float r, int E) {
    const float inv = 1.0f / r;
    double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int e = 0;
    for (; e + 8 <= E; e += 8)
        for (int j = 0; j < 8; j++) {
            const float q = s[e + j] * inv;
            acc[j] += (double)q * (double)tera_vlogf(q + (float)(q < FLT_MIN) * FLT_MIN);
        }
    for (int j = 0; e < E; e++, j++) {
        const float q = s[e] * inv;
        acc[j] += (double)q * (double)tera_vlogf(q + (float)(q < FLT_MIN) * FLT_MIN);
    }
    return -(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
}

static void entropy_block(stats_ctx *c, int64_t i) {
    const int E = c->E;
    const int64_t lo = i * c->per, hi = lo + c->per < c->N ? lo + c->per : c->N;
    double h = 0.0;
    for (int64_t n = lo; n < hi; n++)
        h += c->rsum ? sigmoid_row_entropy(c->scores + n * E, c->rsum[n], E)
                     : softmax_row_entropy(c->scores + n * E, c->logits + n * E, c->lse[n], E);
    c->part[i] = h;
}

/* psum[b, e0..e1) = sum over the sequence's tokens, in token order, of p[t, e]; psum[B, e0..e1) = the
 * sum over all B T tokens in token order (the global balancing losses' P) */
static void psum_range(const stats_ctx *c, int e0, int e1) {
    const int E = c->E, T = c->T;
    double *pg = c->psum + (int64_t)c->B * E;
    for (int e = e0; e < e1; e++) pg[e] = 0.0;
    for (int b = 0; b < c->B; b++) {
        double *ps = c->psum + (int64_t)b * E;
        for (int e = e0; e < e1; e++) ps[e] = 0.0;
        for (int t = 0; t < T; t++) {
            const int64_t n = (int64_t)b * T + t;
            const float *p = c->scores + n * E;
            if (c->rsum) {
                const float inv = 1.0f / c->rsum[n];
                for (int e = e0; e < e1; e++) {
                    const float v = p[e] * inv;
                    ps[e] += v, pg[e] += v;
                }
            } else
                for (int e = e0; e < e1; e++) ps[e] += p[e], pg[e] += p[e];
        }
    }
}

static void stats_items(void *ctx, int64_t i0, int64_t i1, int worker) {
    stats_ctx *c = ctx;
    (void)worker;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t j = i / 2;
        if (i % 2 == 0) {
            if (j < c->nb) entropy_block(c, j);
        } else {
            const int64_t e0 = j * c->eper;
            if (e0 < c->E) psum_range(c, (int)e0, (int)(e0 + c->eper < c->E ? e0 + c->eper : c->E));
        }
    }
}

tera_moe_stats tera_moe_route_stats(tera_backend *be, int64_t *load, float *rsum, double *psum, const float *scores,
                                    const float *logits, const float *lse, const int32_t *sel_count, int B, int T,
                                    int E, int k, tera_router_score score) {
    const int64_t N = (int64_t)B * T;
    const int sig = score == TERA_ROUTER_SIGMOID;
    if (sig) tera_moe_score_sums(be, rsum, scores, N, E);
    stats_ctx c = {.scores = scores, .logits = logits, .lse = lse, .rsum = sig ? rsum : NULL, .psum = psum, .N = N,
                   .per = (N + STATS_BLOCKS - 1) / STATS_BLOCKS, .B = B, .T = T, .E = E,
                   .eper = (E + STATS_BLOCKS - 1) / STATS_BLOCKS};
    c.nb = c.per ? (int)((N + c.per - 1) / c.per) : 0;
    const int ne = (E + c.eper - 1) / c.eper;
    const int64_t items = 2 * (int64_t)(c.nb > ne ? c.nb : ne);
    if (be) be->ops.for_ranges(be, items, stats_items, &c);
    else stats_items(&c, 0, items, 0);
    tera_moe_stats st = {0.0, 0.0, 0.0};
    for (int i = 0; i < c.nb; i++) st.entropy += c.part[i];
    for (int b = 0; b < B; b++) {
        const double *ps = psum + (int64_t)b * E;
        double s = 0.0;
        for (int e = 0; e < E; e++) {
            s += (double)sel_count[b * E + e] / ((double)T * k) * (ps[e] / T);
            load[e] += sel_count[b * E + e];
        }
        st.aux += E * s;
    }
    for (int64_t n = 0; n < N; n++) st.z += (double)lse[n] * lse[n];
    return st;
}

void tera_moe_router_backward(tera_backend *be, float *dlogits, float *dscores, const float *logits, const float *scores,
                              const float *lse, const int32_t *topi, const float *topw, const float *dtopw,
                              const int32_t *sel_count, int B, int T, int E, int k, const tera_moe_routing *r,
                              float aux_scale, float z_scale) {
    tera_moe_router_backward_g(be, dlogits, dscores, logits, scores, lse, topi, topw, dtopw, sel_count, NULL, B, T, E,
                               k, r, aux_scale, z_scale);
}

static void softmax_back_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const rback_ctx *c = ctx;
    (void)worker;
    const int T = c->T, E = c->E, k = c->k;
    const float aux_scale = c->aux_scale, scale = c->scale;
    const int32_t *topi = c->topi, *sel_count = c->sel_count;
    const float *topw = c->topw, *dtopw = c->dtopw, *gcount = c->gcount;
    for (int64_t t = lo; t < hi; t++) {
        float *dp = c->dscores + t * E;
        const float *p = c->s + t * E;
        const int b = (int)(t / T);
        if (gcount)
            for (int e = 0; e < E; e++) dp[e] = aux_scale * (float)E * (gcount[e] / ((float)T * k)) / (float)T;
        else
            for (int e = 0; e < E; e++)
                dp[e] = aux_scale * (float)E * ((float)sel_count[b * E + e] / ((float)T * k)) / (float)T;
        float S = 0.0f, dot = 0.0f;
        for (int j = 0; j < k; j++) {
            S += p[topi[t * k + j]];
            dot += dtopw[t * k + j] * topw[t * k + j];
        }
        if (S > 0.0f) /* S = 0: equal weights, constant (renormalise) */
            for (int j = 0; j < k; j++) dp[topi[t * k + j]] += (scale * dtopw[t * k + j] - dot) / S;
    }
}

/* d(lse^2)/dlogits = 2 lse softmax */
static void zloss_back_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const rback_ctx *c = ctx;
    (void)worker;
    const int E = c->E;
    const float z_scale = c->z_scale;
    for (int64_t t = lo; t < hi; t++)
        for (int e = 0; e < E; e++) c->dlogits[t * E + e] += z_scale * 2.0f * c->lse[t] * c->s[t * E + e];
}

void tera_moe_router_backward_g(tera_backend *be, float *dlogits, float *dscores, const float *logits,
                                const float *scores, const float *lse, const int32_t *topi, const float *topw,
                                const float *dtopw, const int32_t *sel_count, const float *gcount, int B, int T,
                                int E, int k, const tera_moe_routing *r, float aux_scale, float z_scale) {
    if (r->score == TERA_ROUTER_SIGMOID) {
        sigmoid_backward(be, dlogits, logits, scores, lse, topi, topw, dtopw, sel_count, gcount, B, T, E, k, r->scale,
                         aux_scale, z_scale);
        return;
    }
    const int64_t N = (int64_t)B * T;
    /* combine weights w_j = scale p_{e_j} / S  ->  dp_{e_i} = (scale dw_i - sum_j dw_j w_j) / S;
     * balancing loss: dp_e = aux_scale E f_e / T */
    rback_ctx c = {.dlogits = dlogits, .dscores = dscores, .logits = logits, .s = scores, .lse = lse, .topw = topw,
                   .dtopw = dtopw, .gcount = gcount, .topi = topi, .sel_count = sel_count, .T = T, .E = E, .k = k,
                   .scale = r->scale, .aux_scale = aux_scale, .z_scale = z_scale};
    be->ops.for_ranges(be, N, softmax_back_rows, &c);
    be->ops.softmax_backward(be, dlogits, dscores, scores, N, E);
    if (z_scale != 0.0f) be->ops.for_ranges(be, N, zloss_back_rows, &c);
}

/* ------------------------------------------------------------ balancing losses (model.balance_loss) */

/* CV^2(x) = var(x) / (mean(x)^2 + eps) with the unbiased variance (Shazeer et al.'s cv_squared);
 * 0 for fewer than 2 experts */
#define BALANCE_CV_EPS 1e-10

static double cv_squared(const double *x, int E) {
    if (E < 2) return 0.0;
    double mu = 0.0, v = 0.0;
    for (int e = 0; e < E; e++) mu += x[e];
    mu /= E;
    for (int e = 0; e < E; e++) v += (x[e] - mu) * (x[e] - mu);
    return v / (E - 1) / (mu * mu + BALANCE_CV_EPS);
}

double tera_moe_balance_value(tera_balance_loss kind, double aux_switch, double *psum, const int32_t *topi,
                              const float *topw, const int32_t *sel_count, const float *gcnt, int B, int T, int E,
                              int k) {
    const int64_t N = (int64_t)B * T;
    double *scratch = psum + (int64_t)B * E; /* [E]: the global sums of tera_moe_route_stats, then scratch */
    if (kind == TERA_BALANCE_SWITCH) return aux_switch;
    if (kind == TERA_BALANCE_SWITCH_GLOBAL || kind == TERA_BALANCE_SWITCH_DP) {
        /* B E sum_e f_e P_e, f_e = C_e / (B T k), P_e = mean over the B T tokens of p (summed in token
         * order by tera_moe_route_stats) */
        const double *P = scratch;
        double s = 0.0;
        for (int e = 0; e < E; e++) {
            int64_t C = 0;
            for (int b = 0; b < B; b++) C += sel_count[b * E + e];
            const double Ce = kind == TERA_BALANCE_SWITCH_DP && gcnt ? (double)gcnt[e] : (double)C;
            s += Ce / ((double)N * k) * (P[e] / (double)N);
        }
        return (double)B * E * s;
    }
    /* importance_load: B (CV^2(I) + CV^2(L)), I_e = sum of the combine weights given to e, L_e = the
     * assignments to e */
    double *I = scratch; /* [E], then the loads */
    for (int e = 0; e < E; e++) I[e] = 0.0;
    for (int64_t a = 0; a < N * k; a++) I[topi[a]] += topw[a];
    const double ci = cv_squared(I, E);
    for (int e = 0; e < E; e++) {
        int64_t C = 0;
        for (int b = 0; b < B; b++) C += sel_count[b * E + e];
        I[e] = (double)C;
    }
    return (double)B * (ci + cv_squared(I, E));
}

typedef struct {
    float *dtopw;
    const int32_t *topi;
    const double *I;
} imp_ctx;

static void importance_back_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    const imp_ctx *c = ctx;
    (void)worker;
    for (int64_t a = lo; a < hi; a++) c->dtopw[a] += (float)c->I[c->topi[a]];
}

const float *tera_moe_balance_backward_prep(tera_backend *be, tera_balance_loss kind, double *scratch, float *dtopw,
                                            const int32_t *topi, const float *topw, const int32_t *sel_count,
                                            const float *gcnt, int B, int T, int E, int k, float *aux_scale) {
    (void)T;
    const int64_t N = (int64_t)B * T;
    if (kind == TERA_BALANCE_SWITCH) return NULL;
    if (kind == TERA_BALANCE_SWITCH_GLOBAL || kind == TERA_BALANCE_SWITCH_DP) {
        /* d/dp_t,e of B E sum_e f_e P_e = E f_e / T with f_e = C_e / (B T k): the per-sequence formula
         * with the count C_e / B (written over the scratch as floats) */
        float *g = (float *)scratch;
        for (int e = 0; e < E; e++) {
            int64_t C = 0;
            for (int b = 0; b < B; b++) C += sel_count[b * E + e];
            const double Ce = kind == TERA_BALANCE_SWITCH_DP && gcnt ? (double)gcnt[e] : (double)C;
            g[e] = (float)(Ce / B);
        }
        return g;
    }
    /* importance_load: the load term has no gradient; the importance term's flows through the
     * combine weights: dtopw[t,j] += aux_scale B dCV^2/dI_e (e = topi[t,j]),
     * dCV^2/dI_e = 2 (I_e - mu) / ((E - 1) D) - var 2 mu / (E D^2), D = mu^2 + eps */
    const float as = *aux_scale;
    *aux_scale = 0.0f; /* no per-token probability term */
    if (E < 2 || as == 0.0f) return NULL;
    double *I = scratch;
    for (int e = 0; e < E; e++) I[e] = 0.0;
    for (int64_t a = 0; a < N * k; a++) I[topi[a]] += topw[a];
    double mu = 0.0, v = 0.0;
    for (int e = 0; e < E; e++) mu += I[e];
    mu /= E;
    for (int e = 0; e < E; e++) v += (I[e] - mu) * (I[e] - mu);
    v /= E - 1;
    const double D = mu * mu + BALANCE_CV_EPS;
    for (int e = 0; e < E; e++) I[e] = (double)as * B * (2.0 * (I[e] - mu) / ((E - 1) * D) - v * 2.0 * mu / (E * D * D));
    imp_ctx ic = {.dtopw = dtopw, .topi = topi, .I = I};
    be->ops.for_ranges(be, N * k, importance_back_rows, &ic);
    return NULL;
}

/* Sort context for the probability policy: higher prob first, then lower assignment index. */
typedef struct {
    float p;
    int32_t a;
} prob_assign;

static int prob_assign_cmp(const void *x, const void *y) {
    const prob_assign *u = x, *v = y;
    if (u->p != v->p) return u->p > v->p ? -1 : 1;
    return (u->a > v->a) - (u->a < v->a);
}

size_t tera_moe_plan_scratch_bytes(int64_t n_assign, int B, int E) {
    return (size_t)n_assign * (sizeof(int32_t) + sizeof(prob_assign)) +
           sizeof(int32_t) * ((size_t)B * (size_t)E + (size_t)E);
}

/* Capacity per sequence: the assignments of sequences [lo, hi) beyond it are dropped. */
typedef struct {
    int32_t *keep, *used_all;
    prob_assign *sortbuf;
    const int32_t *sel_count, *topi;
    const float *probs;
    int T, E, k, capacity;
    tera_drop_policy policy;
    _Atomic int64_t dropped;
} drop_ctx;

static void drop_rows(void *ctx, int64_t lo, int64_t hi, int worker) {
    drop_ctx *c = ctx;
    (void)worker;
    const int T = c->T, E = c->E, k = c->k, capacity = c->capacity;
    const int32_t *topi = c->topi;
    int32_t *keep = c->keep;
    int64_t dropped = 0;
    for (int64_t b = lo; b < hi; b++) {
        const int64_t a0 = b * T * k, a1 = a0 + (int64_t)T * k;
        if (c->policy == TERA_DROP_POSITION) {
            int32_t *used = c->used_all + (size_t)b * E;
            memset(used, 0, sizeof(int32_t) * (size_t)E);
            for (int64_t a = a0; a < a1; a++)
                if (used[topi[a]]++ >= capacity) keep[a] = 0, dropped++;
        } else {
            prob_assign *lst = c->sortbuf + a0;
            for (int e = 0; e < E; e++) {
                if (c->sel_count[b * E + e] <= capacity) continue;
                int n = 0;
                for (int64_t a = a0; a < a1; a++)
                    if (topi[a] == e) lst[n++] = (prob_assign){c->probs[(a / k) * E + e], (int32_t)a};
                qsort(lst, (size_t)n, sizeof *lst, prob_assign_cmp);
                for (int i = capacity; i < n; i++) keep[lst[i].a] = 0, dropped++;
            }
        }
    }
    atomic_fetch_add(&c->dropped, dropped); /* an integer count: the same whatever the order */
}

int64_t tera_moe_plan(tera_backend *be, int32_t *slot_row, int32_t *row_tok, int32_t *exp_off, int32_t *sel_count,
                      void *scratch, const int32_t *topi, const float *probs, int B, int T, int E, int k,
                      int capacity, tera_drop_policy policy) {
    const int64_t A = (int64_t)B * T * k;
    int32_t *keep = scratch;
    prob_assign *sortbuf = (prob_assign *)(keep + A);
    int32_t *used_all = (int32_t *)(sortbuf + A); /* [B, E] position policy: kept so far */
    int32_t *fill = used_all + (size_t)B * E;     /* [E] next free row of each expert */
    memset(sel_count, 0, sizeof(int32_t) * (size_t)B * E);
    for (int64_t a = 0; a < A; a++) {
        sel_count[(a / ((int64_t)T * k)) * E + topi[a]]++;
        keep[a] = 1;
    }
    int64_t dropped = 0;
    if (capacity > 0) {
        drop_ctx dc = {.keep = keep, .sortbuf = sortbuf, .used_all = used_all, .sel_count = sel_count, .topi = topi,
                       .probs = probs, .T = T, .E = E, .k = k, .capacity = capacity, .policy = policy};
        be->ops.for_ranges(be, B, drop_rows, &dc);
        dropped = atomic_load(&dc.dropped);
    }
    /* counting sort of kept assignments by expert, stable in assignment order */
    memset(exp_off, 0, sizeof(int32_t) * (size_t)(E + 1));
    for (int64_t a = 0; a < A; a++)
        if (keep[a]) exp_off[topi[a] + 1]++;
    for (int e = 0; e < E; e++) exp_off[e + 1] += exp_off[e];
    memcpy(fill, exp_off, sizeof(int32_t) * (size_t)E);
    for (int64_t a = 0; a < A; a++) {
        if (!keep[a]) {
            slot_row[a] = -1;
            continue;
        }
        int32_t r = fill[topi[a]]++;
        slot_row[a] = r;
        row_tok[r] = (int32_t)(a / k);
    }
    return dropped;
}
