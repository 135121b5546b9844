/* Router scoring (softmax or sigmoid), top-k selection (optionally group-limited), the sigmoid
 * router's backward, and the dispatch plan (grouping assignments by expert). */
#include "moe.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/vmath.h"
#include "tera/backend.h"
#include "tera/status.h"

tera_moe_routing tera_moe_routing_of(const tera_model_config *c) {
    return (tera_moe_routing){.score = c->router_score,
                              .n_groups = c->n_groups > 1 ? c->n_groups : 1,
                              .topk_groups = c->topk_groups > 1 ? c->topk_groups : 1,
                              .scale = c->routed_scale > 0.0f ? c->routed_scale : 1.0f};
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

void tera_moe_score_forward(tera_backend *be, float *scores, float *lse, const float *logits, int64_t N, int E,
                            tera_router_score score) {
    if (score == TERA_ROUTER_SOFTMAX) {
        be->ops.softmax_forward(be, scores, lse, logits, N, E);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *r = logits + n * E;
        const float mx = tera_max(r, E);
        lse[n] = mx + logf(tera_sum_exp(r, E, mx));
        float *s = scores + n * E;
        for (int e = 0; e < E; e++) s[e] = tera_sigmoid(r[e]);
    }
}

void tera_moe_score_sums(float *rsum, const float *scores, int64_t N, int E) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) rsum[n] = lane_sum(scores + n * E, E);
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

void tera_moe_topk(int32_t *topi, float *topw, const float *probs, const float *bias, int64_t N, int E,
                   int k) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *p = probs + n * E;
        int32_t *ti = topi + n * k;
        float *tw = topw + n * k;
        /* one pass over the experts, keeping the best k so far sorted by score: O(E k) at worst,
         * about O(E) */
        int cnt = 0;
        for (int e = 0; e < E; e++) topk_offer(ti, tw, &cnt, k, e, bias ? p[e] + bias[e] : p[e]);
        float sum = 0.0f;
        for (int j = 0; j < k; j++) tw[j] = p[ti[j]], sum += tw[j];
        for (int j = 0; j < k; j++) tw[j] /= sum;
    }
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

void tera_moe_route(int32_t *topi, float *topw, const float *scores, const float *bias, int64_t N, int E, int k,
                    const tera_moe_routing *r, void *scratch) {
    if (r->n_groups <= 1) {
        tera_moe_topk(topi, topw, scores, bias, N, E, k);
    } else {
        const int G = r->n_groups, Gk = r->topk_groups, gsz = E / G, sig = r->score == TERA_ROUTER_SIGMOID;
        const size_t stride = route_thread_bytes(r);
        TERA_ASSERTF(E % G == 0 && 1 <= Gk && Gk <= G && k <= Gk * gsz && scratch,
                     "group-limited routing: E %d, %d groups, %d per token, top-%d", E, G, Gk, k);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float *gs = (float *)((char *)scratch + stride * (size_t)omp_get_thread_num()); /* [G] */
            float *gw = gs + G;                                                              /* [Gk] */
            int32_t *gi = (int32_t *)(gw + Gk);                                              /* [Gk] */
            const float *p = scores + n * E;
            int32_t *ti = topi + n * k;
            float *tw = topw + n * k;
            /* group scores: max u (softmax, DeepSeek-V2) or the sum of the two largest u (sigmoid,
             * DeepSeek-V3) */
            for (int g = 0; g < G; g++) {
                float m1 = -INFINITY, m2 = -INFINITY;
                for (int e = g * gsz; e < (g + 1) * gsz; e++) {
                    const float u = bias ? p[e] + bias[e] : p[e];
                    if (u > m1) m2 = m1, m1 = u;
                    else if (u > m2) m2 = u;
                }
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
            for (int i = 0; i < Gk; i++)
                for (int e = gi[i] * gsz; e < (gi[i] + 1) * gsz; e++)
                    topk_offer(ti, tw, &cnt, k, e, bias ? p[e] + bias[e] : p[e]);
            float sum = 0.0f;
            for (int j = 0; j < k; j++) tw[j] = p[ti[j]], sum += tw[j];
            for (int j = 0; j < k; j++) tw[j] /= sum;
        }
    }
    if (r->scale != 1.0f) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < N * k; i++) topw[i] *= r->scale;
    }
}

void tera_moe_sigmoid_backward(float *dlogits, const float *logits, const float *s, const float *lse,
                               const int32_t *topi, const float *topw, const float *dtopw,
                               const int32_t *sel_count, int B, int T, int E, int k, float scale,
                               float aux_scale, float z_scale) {
    const int64_t N = (int64_t)B * T;
    const float gunit = aux_scale * (float)E / ((float)T * (float)k * (float)T); /* d aux_b / d q_e per selection */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; t++) {
        const float *restrict st = s + t * E, *restrict xt = logits + t * E;
        const int32_t *restrict cnt = sel_count + (t / T) * E;
        float *restrict dl = dlogits + t * E; /* holds d/ds first, then d/dlogits */
        /* balancing loss: q = s / sum(s), dq_e = aux_scale E f_e / T; through the normalisation
         * ds_e = (dq_e - sum_e' dq_e' q_e') / sum(s) */
        const float Sa = lane_sum(st, E), inv = 1.0f / Sa;
        for (int e = 0; e < E; e++) dl[e] = gunit * (float)cnt[e];
        const float dq = tera_dot(dl, st, E) * inv;
        for (int e = 0; e < E; e++) dl[e] = (dl[e] - dq) * inv;
        /* combine weights w_j = scale s_{e_j} / S: ds_{e_i} += (scale dw_i - sum_j dw_j w_j) / S */
        float S = 0.0f, dw = 0.0f;
        for (int j = 0; j < k; j++) {
            S += st[topi[t * k + j]];
            dw += dtopw[t * k + j] * topw[t * k + j];
        }
        for (int j = 0; j < k; j++) dl[topi[t * k + j]] += (scale * dtopw[t * k + j] - dw) / S;
        /* sigmoid: ds/dx = s (1 - s); z-loss: d(lse^2)/dx = 2 lse softmax(x) */
        if (z_scale != 0.0f) {
            const float l = lse[t], zc = z_scale * 2.0f * l;
            for (int e = 0; e < E; e++) dl[e] = dl[e] * (st[e] * (1.0f - st[e])) + zc * tera_vexpf(xt[e] - l);
        } else {
            for (int e = 0; e < E; e++) dl[e] *= st[e] * (1.0f - st[e]);
        }
    }
}

tera_moe_stats tera_moe_route_stats(int64_t *load, float *rsum, double *psum, const float *scores, const float *lse,
                                    const int32_t *sel_count, int B, int T, int E, int k, tera_router_score score) {
    const int64_t N = (int64_t)B * T;
    const int sig = score == TERA_ROUTER_SIGMOID;
    if (sig) tera_moe_score_sums(rsum, scores, N, E);
    tera_moe_stats st = {0.0, 0.0, 0.0};
    for (int b = 0; b < B; b++) {
        /* P_e summed over the sequence's tokens in token order, row by row */
        for (int e = 0; e < E; e++) psum[e] = 0.0;
        for (int t = 0; t < T; t++) {
            const int64_t n = (int64_t)b * T + t;
            const float *p = scores + n * E;
            if (sig) {
                const float inv = 1.0f / rsum[n];
                for (int e = 0; e < E; e++) psum[e] += p[e] * inv;
            } else
                for (int e = 0; e < E; e++) psum[e] += p[e];
        }
        double s = 0.0;
        for (int e = 0; e < E; e++) {
            s += (double)sel_count[b * E + e] / ((double)T * k) * (psum[e] / T);
            load[e] += sel_count[b * E + e];
        }
        st.aux += E * s;
    }
    for (int64_t n = 0; n < N; n++) {
        st.z += (double)lse[n] * lse[n];
        if (sig) {
            const float inv = 1.0f / rsum[n];
            for (int e = 0; e < E; e++) {
                const float p = scores[n * E + e] * inv;
                if (p > 0.0f) st.entropy -= (double)p * log((double)p);
            }
        } else {
            for (int e = 0; e < E; e++) {
                const float p = scores[n * E + e];
                if (p > 0.0f) st.entropy -= (double)p * log((double)p);
            }
        }
    }
    return st;
}

void tera_moe_router_backward(tera_backend *be, float *dlogits, float *dscores, const float *logits, const float *scores,
                              const float *lse, const int32_t *topi, const float *topw, const float *dtopw,
                              const int32_t *sel_count, int B, int T, int E, int k, const tera_moe_routing *r,
                              float aux_scale, float z_scale) {
    if (r->score == TERA_ROUTER_SIGMOID) {
        tera_moe_sigmoid_backward(dlogits, logits, scores, lse, topi, topw, dtopw, sel_count, B, T, E, k, r->scale,
                                  aux_scale, z_scale);
        return;
    }
    const int64_t N = (int64_t)B * T;
    const float scale = r->scale;
    /* combine weights w_j = scale p_{e_j} / S  ->  dp_{e_i} = (scale dw_i - sum_j dw_j w_j) / S;
     * balancing loss: dp_e = aux_scale E f_e / T */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; t++) {
        float *dp = dscores + t * E;
        const float *p = scores + t * E;
        const int b = (int)(t / T);
        for (int e = 0; e < E; e++) dp[e] = aux_scale * (float)E * ((float)sel_count[b * E + e] / ((float)T * k)) / (float)T;
        float S = 0.0f, dot = 0.0f;
        for (int j = 0; j < k; j++) {
            S += p[topi[t * k + j]];
            dot += dtopw[t * k + j] * topw[t * k + j];
        }
        for (int j = 0; j < k; j++) dp[topi[t * k + j]] += (scale * dtopw[t * k + j] - dot) / S;
    }
    be->ops.softmax_backward(be, dlogits, dscores, scores, N, E);
    if (z_scale != 0.0f) {
        /* d(lse^2)/dlogits = 2 lse softmax */
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < N; t++)
            for (int e = 0; e < E; e++) dlogits[t * E + e] += z_scale * 2.0f * lse[t] * scores[t * E + e];
    }
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

int64_t tera_moe_plan(int32_t *slot_row, int32_t *row_tok, int32_t *exp_off, int32_t *sel_count,
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
#pragma omp parallel for schedule(static) reduction(+ : dropped)
        for (int b = 0; b < B; b++) {
            const int64_t a0 = (int64_t)b * T * k, a1 = a0 + (int64_t)T * k;
            if (policy == TERA_DROP_POSITION) {
                int32_t *used = used_all + (size_t)b * E;
                memset(used, 0, sizeof(int32_t) * (size_t)E);
                for (int64_t a = a0; a < a1; a++)
                    if (used[topi[a]]++ >= capacity) keep[a] = 0, dropped++;
            } else {
                prob_assign *lst = sortbuf + a0;
                for (int e = 0; e < E; e++) {
                    if (sel_count[b * E + e] <= capacity) continue;
                    int n = 0;
                    for (int64_t a = a0; a < a1; a++)
                        if (topi[a] == e) lst[n++] = (prob_assign){probs[(a / k) * E + e], (int32_t)a};
                    qsort(lst, (size_t)n, sizeof *lst, prob_assign_cmp);
                    for (int i = capacity; i < n; i++) keep[lst[i].a] = 0, dropped++;
                }
            }
        }
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
