/* Router top-k selection and the dispatch plan (grouping assignments by expert). */
#include "moe.h"

#include <stdlib.h>
#include <string.h>

void tera_moe_topk(int32_t *topi, float *topw, const float *probs, const float *bias, int64_t N, int E,
                   int k) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *p = probs + n * E;
        int32_t *ti = topi + n * k;
        float *tw = topw + n * k;
        /* one pass over the experts, keeping the best k so far sorted by score (descending; an
         * equal score goes after the lower index already there): O(E k) at worst, about O(E) */
        int cnt = 0;
        for (int e = 0; e < E; e++) {
            const float s = bias ? p[e] + bias[e] : p[e];
            if (cnt == k && !(s > tw[k - 1])) continue;
            int pos = cnt < k ? cnt++ : k - 1;
            for (; pos > 0 && s > tw[pos - 1]; pos--) ti[pos] = ti[pos - 1], tw[pos] = tw[pos - 1];
            ti[pos] = e, tw[pos] = s;
        }
        float sum = 0.0f;
        for (int j = 0; j < k; j++) tw[j] = p[ti[j]], sum += tw[j];
        for (int j = 0; j < k; j++) tw[j] /= sum;
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
