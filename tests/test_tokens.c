/* Unit tests of the CPU backend's row kernels that the MoE token dispatcher and the model call
 * (src/kernels/cpu/tokens.c: gather and combine, forward and backward, the residual add), the weight
 * initialisation over a tensor's block (init.c: tera_fill_normal_block) and the scheduling helpers
 * (parallel.c: tera_max_threads, tera_items_side_by_side, tera_for_each_item).
 *
 * Each kernel is compared with a naive loop written here, on random plans (empty experts, dropped
 * assignments, k = 1 and k = 8) and several thread counts: the forwards (and the gather backward)
 * bit for bit, since every output row adds its terms in a fixed order (j = 0..k-1) with
 * -ffp-contract off (C11 without extensions), the backwards also through the adjoint identity
 * <J v, w> = <v, J^T w> computed in double. */
#include "testutil.h"

#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/rng.h"

static const int THREADS[] = {1, 2, 3, 4};
#define N_THREADS ((int)(sizeof THREADS / sizeof THREADS[0]))

/* xorshift for shapes and plans */
static uint64_t rs = 88172645463325252ull;
static uint32_t rnd(uint32_t n) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)((rs >> 32) % n);
}

static float *fnew(int64_t n) { return malloc(sizeof(float) * (size_t)(n > 0 ? n : 1)); }
static void fnan(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
}
static double dot(const float *a, const float *b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * (double)b[i];
    return s;
}
static void assert_adjoint(const char *what, double lhs, double rhs, double scale) {
    if (!(fabs(lhs - rhs) <= 1e-5 * scale + 1e-9)) fail_msg("%s: <Jv,w> = %.12g, <v,J^T w> = %.12g", what, lhs, rhs);
}

/* A random plan as tera_moe_plan builds it: N tokens, k distinct experts of E each, some assignments
 * dropped (slot -1); the kept ones grouped by expert, in assignment order inside an expert. Experts
 * [E - 2, E) (when E > 2) are never chosen, so some experts are always empty. */
typedef struct {
    int64_t N, R;
    int k, E;
    int32_t *topi, *slot_row, *row_tok, *exp_off;
} plan;

static plan make_plan(int64_t N, int k, int E, int drop_pct) {
    plan p = {.N = N, .k = k, .E = E};
    p.topi = malloc(sizeof(int32_t) * (size_t)(N * k + 1));
    p.slot_row = malloc(sizeof(int32_t) * (size_t)(N * k + 1));
    p.row_tok = malloc(sizeof(int32_t) * (size_t)(N * k + 1));
    p.exp_off = calloc((size_t)E + 1, sizeof(int32_t));
    const int usable = E > 2 + k ? E - 2 : E;
    for (int64_t t = 0; t < N; t++)
        for (int j = 0; j < k; j++) {
            int e, dup;
            do { /* distinct experts per token */
                e = (int)rnd((uint32_t)usable);
                dup = 0;
                for (int i = 0; i < j; i++) dup |= p.topi[t * k + i] == e;
            } while (dup);
            p.topi[t * k + j] = e;
        }
    int32_t *keep = malloc(sizeof(int32_t) * (size_t)(N * k + 1));
    for (int64_t a = 0; a < N * k; a++) {
        keep[a] = (int)rnd(100) >= drop_pct;
        if (keep[a]) p.exp_off[p.topi[a] + 1]++;
    }
    for (int e = 0; e < E; e++) p.exp_off[e + 1] += p.exp_off[e];
    p.R = p.exp_off[E];
    int32_t *fill = malloc(sizeof(int32_t) * (size_t)E);
    memcpy(fill, p.exp_off, sizeof(int32_t) * (size_t)E);
    for (int64_t a = 0; a < N * k; a++) {
        if (!keep[a]) {
            p.slot_row[a] = -1;
            continue;
        }
        const int32_t r = fill[p.topi[a]]++;
        p.slot_row[a] = r;
        p.row_tok[r] = (int32_t)(a / k);
    }
    free(fill);
    free(keep);
    return p;
}
static void free_plan(plan *p) {
    free(p->topi), free(p->slot_row), free(p->row_tok), free(p->exp_off);
}

/* The shapes of the random cases: (N, k, E, drop %, D). */
typedef struct {
    int64_t N;
    int k, E, drop;
    int64_t D;
} shape;
static const shape SHAPES[] = {
    {1, 1, 1, 0, 1},    {17, 1, 4, 0, 5},   {33, 1, 8, 30, 16},  {40, 2, 6, 10, 7},   {25, 8, 8, 0, 3},
    {31, 8, 16, 25, 9}, {64, 8, 12, 50, 33}, {9, 4, 32, 100, 4}, {0, 2, 4, 0, 8},    {100, 2, 64, 5, 2},
};
#define N_SHAPES ((int)(sizeof SHAPES / sizeof SHAPES[0]))

/* ------------------------------------------------------------------------------ gather */

static void test_gather_forward(void **state) {
    (void)state;
    for (int c = 0; c < N_SHAPES; c++) {
        const shape s = SHAPES[c];
        plan p = make_plan(s.N, s.k, s.E, s.drop);
        const int64_t D = s.D, R = p.R;
        float *x = fnew(s.N * D), *ref = fnew(R * D), *got = fnew(R * D), *first = fnew(R * D);
        tu_fill(x, s.N * D, 100 + c, 1.0f);
        for (int64_t r = 0; r < R; r++)
            for (int64_t d = 0; d < D; d++) ref[r * D + d] = x[(int64_t)p.row_tok[r] * D + d];
        for (int i = 0; i < N_THREADS; i++) {
            tera_set_threads(THREADS[i]);
            fnan(got, R * D);
            tera_moe_gather_forward(got, x, p.row_tok, R, D);
            assert_same("gather forward vs naive", got, ref, R * D);
        }
        /* the adjoint: <G v, w> = <v, G^T w>, G^T = the gather backward over slot_row */
        float *w = fnew(R * D), *gt = fnew(s.N * D);
        tu_fill(w, R * D, 200 + c, 1.0f);
        memset(gt, 0, sizeof(float) * (size_t)(s.N * D));
        tera_moe_gather_backward(gt, w, p.slot_row, s.N, s.k, D);
        assert_adjoint("gather", dot(ref, w, R * D), dot(x, gt, s.N * D), (double)(R * D + 1));
        free(x), free(ref), free(got), free(first), free(w), free(gt);
        free_plan(&p);
    }
    tera_set_threads(2);
}

static void test_gather_backward(void **state) {
    (void)state;
    for (int c = 0; c < N_SHAPES; c++) {
        const shape s = SHAPES[c];
        plan p = make_plan(s.N, s.k, s.E, s.drop);
        const int64_t D = s.D, N = s.N, R = p.R;
        float *dxg = fnew(R * D), *dx0 = fnew(N * D), *ref = fnew(N * D), *got = fnew(N * D);
        tu_fill(dxg, R * D, 300 + c, 1.0f);
        tu_fill(dx0, N * D, 400 + c, 1.0f); /* dx accumulates */
        memcpy(ref, dx0, sizeof(float) * (size_t)(N * D));
        for (int64_t t = 0; t < N; t++)
            for (int j = 0; j < s.k; j++) {
                const int32_t r = p.slot_row[t * s.k + j];
                if (r < 0) continue;
                for (int64_t d = 0; d < D; d++) ref[t * D + d] += dxg[(int64_t)r * D + d];
            }
        for (int i = 0; i < N_THREADS; i++) {
            tera_set_threads(THREADS[i]);
            memcpy(got, dx0, sizeof(float) * (size_t)(N * D));
            tera_moe_gather_backward(got, dxg, p.slot_row, N, s.k, D);
            assert_same("gather backward vs naive (accumulating, j order)", got, ref, N * D);
        }
        free(dxg), free(dx0), free(ref), free(got);
        free_plan(&p);
    }
    tera_set_threads(2);
}

/* ------------------------------------------------------------------------------ combine */

static void test_combine_forward(void **state) {
    (void)state;
    for (int c = 0; c < N_SHAPES; c++) {
        const shape s = SHAPES[c];
        plan p = make_plan(s.N, s.k, s.E, s.drop);
        const int64_t D = s.D, N = s.N, R = p.R, K = s.k;
        float *ye = fnew(R * D), *topw = fnew(N * K), *out0 = fnew(N * D), *ref = fnew(N * D), *got = fnew(N * D);
        tu_fill(ye, R * D, 500 + c, 1.0f);
        tu_fill(topw, N * K, 600 + c, 1.0f);
        tu_fill(out0, N * D, 700 + c, 1.0f); /* out accumulates (the residual) */
        /* a dropped slot's weight must not be read into the sum: make it poison */
        for (int64_t a = 0; a < N * K; a++)
            if (p.slot_row[a] < 0) topw[a] = NAN;
        memcpy(ref, out0, sizeof(float) * (size_t)(N * D));
        for (int64_t t = 0; t < N; t++)
            for (int j = 0; j < s.k; j++) {
                const int32_t r = p.slot_row[t * K + j];
                if (r < 0) continue;
                const float w = topw[t * K + j];
                for (int64_t d = 0; d < D; d++) ref[t * D + d] += w * ye[(int64_t)r * D + d];
            }
        for (int i = 0; i < N_THREADS; i++) {
            tera_set_threads(THREADS[i]);
            memcpy(got, out0, sizeof(float) * (size_t)(N * D));
            tera_moe_combine_forward(got, ye, topw, p.slot_row, N, s.k, D);
            assert_same("combine forward vs naive (j order)", got, ref, N * D);
        }
        free(ye), free(topw), free(out0), free(ref), free(got);
        free_plan(&p);
    }
    tera_set_threads(2);
}

static void test_combine_backward(void **state) {
    (void)state;
    for (int c = 0; c < N_SHAPES; c++) {
        const shape s = SHAPES[c];
        plan p = make_plan(s.N, s.k, s.E, s.drop);
        const int64_t D = s.D, N = s.N, R = p.R, K = s.k;
        float *ye = fnew(R * D), *topw = fnew(N * K), *dy = fnew(N * D);
        float *dye = fnew(R * D), *dtopw = fnew(N * K), *dye1 = fnew(R * D), *dtopw1 = fnew(N * K);
        tu_fill(ye, R * D, 800 + c, 1.0f);
        tu_fill(topw, N * K, 900 + c, 1.0f);
        tu_fill(dy, N * D, 1000 + c, 1.0f);
        for (int i = 0; i < N_THREADS; i++) {
            tera_set_threads(THREADS[i]);
            fnan(dye, R * D), fnan(dtopw, N * K); /* both are written, every element */
            tera_moe_combine_backward(dye, dtopw, dy, ye, topw, p.slot_row, N, s.k, D);
            for (int64_t t = 0; t < N; t++)
                for (int j = 0; j < s.k; j++) {
                    const int64_t a = t * K + j;
                    const int32_t r = p.slot_row[a];
                    if (r < 0) {
                        if (dtopw[a] != 0.0f) fail_msg("dtopw of dropped assignment %ld = %g, not 0", (long)a, dtopw[a]);
                        continue;
                    }
                    for (int64_t d = 0; d < D; d++)
                        if (dye[(int64_t)r * D + d] != topw[a] * dy[t * D + d])
                            fail_msg("dye[%d][%ld] = %g, want topw * dy = %g", r, (long)d, dye[(int64_t)r * D + d],
                                     topw[a] * dy[t * D + d]);
                    const double want = dot(dy + t * D, ye + (int64_t)r * D, D);
                    if (!(fabs((double)dtopw[a] - want) <= 1e-5 * (1.0 + fabs(want))))
                        fail_msg("dtopw[%ld] = %.8g, want <dy, ye> = %.8g", (long)a, dtopw[a], want);
                }
            if (i == 0) {
                memcpy(dye1, dye, sizeof(float) * (size_t)(R * D));
                memcpy(dtopw1, dtopw, sizeof(float) * (size_t)(N * K));
            } else {
                assert_same("combine backward dye: same on any thread count", dye, dye1, R * D);
                assert_same("combine backward dtopw: same on any thread count", dtopw, dtopw1, N * K);
            }
        }
        /* adjoints of the bilinear combine: in ye at fixed topw, and in topw at fixed ye */
        float *v = fnew(R * D), *u = fnew(N * K), *o = fnew(N * D);
        tu_fill(v, R * D, 1100 + c, 1.0f);
        memset(o, 0, sizeof(float) * (size_t)(N * D));
        tera_moe_combine_forward(o, v, topw, p.slot_row, N, s.k, D);
        assert_adjoint("combine in ye", dot(o, dy, N * D), dot(v, dye, R * D), (double)(N * D + 1));
        tu_fill(u, N * K, 1200 + c, 1.0f);
        memset(o, 0, sizeof(float) * (size_t)(N * D));
        tera_moe_combine_forward(o, ye, u, p.slot_row, N, s.k, D);
        assert_adjoint("combine in topw", dot(o, dy, N * D), dot(u, dtopw, N * K), (double)(N * D + 1));
        free(v), free(u), free(o);
        free(ye), free(topw), free(dy), free(dye), free(dtopw), free(dye1), free(dtopw1);
        free_plan(&p);
    }
    tera_set_threads(2);
}

/* The combine's gradients against central differences of L = <dy, combine(ye, topw)> in double:
 * L is linear in each argument, so the difference quotient is exact up to rounding. */
static void test_combine_finite_differences(void **state) {
    (void)state;
    plan p = make_plan(12, 3, 6, 20);
    const int64_t N = 12, K = 3, D = 5, R = p.R;
    float *ye = fnew(R * D), *topw = fnew(N * K), *dy = fnew(N * D), *dye = fnew(R * D), *dtopw = fnew(N * K);
    float *o = fnew(N * D);
    tu_fill(ye, R * D, 1, 1.0f), tu_fill(topw, N * K, 2, 1.0f), tu_fill(dy, N * D, 3, 1.0f);
    tera_moe_combine_backward(dye, dtopw, dy, ye, topw, p.slot_row, N, (int)K, D);
    const float h = 0.25f; /* exact in float, so x +- h are the points evaluated */
#define LOSS(res)                                                                                                   \
    do {                                                                                                            \
        memset(o, 0, sizeof(float) * (size_t)(N * D));                                                              \
        tera_moe_combine_forward(o, ye, topw, p.slot_row, N, (int)K, D);                                            \
        res = dot(o, dy, N * D);                                                                                    \
    } while (0)
    for (int64_t a = 0; a < N * K; a++) {
        const float keep = topw[a];
        double lp, lm;
        topw[a] = keep + h;
        LOSS(lp);
        topw[a] = keep - h;
        LOSS(lm);
        topw[a] = keep;
        const double fd = (lp - lm) / (2.0 * h);
        if (!(fabs(fd - dtopw[a]) <= 1e-4 * (1.0 + fabs(fd)))) fail_msg("dtopw[%ld] %g vs fd %g", (long)a, dtopw[a], fd);
    }
    for (int64_t i = 0; i < R * D; i++) {
        const float keep = ye[i];
        double lp, lm;
        ye[i] = keep + h;
        LOSS(lp);
        ye[i] = keep - h;
        LOSS(lm);
        ye[i] = keep;
        const double fd = (lp - lm) / (2.0 * h);
        if (!(fabs(fd - dye[i]) <= 1e-4 * (1.0 + fabs(fd)))) fail_msg("dye[%ld] %g vs fd %g", (long)i, dye[i], fd);
    }
#undef LOSS
    free(ye), free(topw), free(dy), free(dye), free(dtopw), free(o);
    free_plan(&p);
}

/* ------------------------------------------------------------------------------ add */

static void test_add_forward(void **state) {
    (void)state;
    const int64_t sizes[] = {0, 1, 7, 1000, 100003};
    for (int c = 0; c < 5; c++) {
        const int64_t n = sizes[c];
        float *x = fnew(n), *y0 = fnew(n), *y = fnew(n + 1), *ref = fnew(n);
        tu_fill(x, n, 10 + c, 3.0f), tu_fill(y0, n, 20 + c, 3.0f);
        for (int64_t i = 0; i < n; i++) ref[i] = y0[i] + x[i];
        for (int i = 0; i < N_THREADS; i++) {
            tera_set_threads(THREADS[i]);
            memcpy(y, y0, sizeof(float) * (size_t)n);
            y[n] = 12345.0f; /* one past the end: untouched */
            tera_add_forward(y, x, n);
            assert_same("add forward", y, ref, n);
            assert_true(y[n] == 12345.0f);
        }
        free(x), free(y0), free(y), free(ref);
    }
    tera_set_threads(2);
}

/* ------------------------------------------------------------------------------ init */

static void test_fill_normal_block(void **state) {
    (void)state;
    const int64_t shapes[][3] = {{5, 7, 9}, {1, 33, 17}, {1, 1, 100}, {6, 4, 1}, {3, 1, 11}};
    for (int c = 0; c < 5; c++) {
        const int64_t *S = shapes[c];
        const int64_t whole_n = S[0] * S[1] * S[2];
        const uint64_t seed = 1234 + c, stream = tera_hash64(0xabc + c);
        const float std = 0.02f * (c + 1);
        float *whole = fnew(whole_n), *ref = fnew(whole_n);
        for (int64_t g = 0; g < whole_n; g++) ref[g] = std * tera_rng_normal(seed, stream, (uint64_t)g);
        const int64_t zero[3] = {0, 0, 0};
        for (int i = 0; i < N_THREADS; i++) {
            tera_set_threads(THREADS[i]);
            fnan(whole, whole_n);
            tera_fill_normal_block(whole, whole_n, S, zero, S, std, seed, stream);
            assert_same("whole tensor vs element-wise tera_rng_normal", whole, ref, whole_n);
        }
        /* blocks at several offsets: each equals the same elements of the whole tensor */
        for (int b = 0; b < 12; b++) {
            int64_t lo[3], len[3];
            for (int d = 0; d < 3; d++) {
                lo[d] = b == 0 ? S[d] - 1 : (int64_t)rnd((uint32_t)S[d]); /* b = 0: the last element */
                len[d] = b == 0 ? 1 : 1 + (int64_t)rnd((uint32_t)(S[d] - lo[d]));
            }
            if (b == 1) lo[0] = lo[1] = lo[2] = 0, len[0] = S[0], len[1] = S[1], len[2] = S[2] > 1 ? S[2] - 1 : 1;
            const int64_t n = len[0] * len[1] * len[2];
            float *blk = fnew(n + 1);
            tera_set_threads(THREADS[b % N_THREADS]);
            fnan(blk, n + 1);
            tera_fill_normal_block(blk, n, S, lo, len, std, seed, stream);
            for (int64_t i0 = 0; i0 < len[0]; i0++)
                for (int64_t i1 = 0; i1 < len[1]; i1++)
                    for (int64_t i2 = 0; i2 < len[2]; i2++) {
                        const int64_t j = (i0 * len[1] + i1) * len[2] + i2;
                        const int64_t g = ((lo[0] + i0) * S[1] + lo[1] + i1) * S[2] + lo[2] + i2;
                        if (memcmp(&blk[j], &ref[g], sizeof(float)) != 0)
                            fail_msg("shape %ld x %ld x %ld block lo (%ld %ld %ld) len (%ld %ld %ld): element %ld = %g, "
                                     "the whole tensor's %ld = %g",
                                     (long)S[0], (long)S[1], (long)S[2], (long)lo[0], (long)lo[1], (long)lo[2],
                                     (long)len[0], (long)len[1], (long)len[2], (long)j, blk[j], (long)g, ref[g]);
                    }
            assert_true(isnan(blk[n])); /* nothing written past the block */
            free(blk);
        }
        /* another seed or stream gives other numbers */
        float *other = fnew(whole_n);
        tera_fill_normal_block(other, whole_n, S, zero, S, std, seed + 1, stream);
        assert_true(whole_n < 4 || memcmp(other, ref, sizeof(float) * (size_t)whole_n) != 0);
        free(other), free(whole), free(ref);
    }
    tera_set_threads(2);
}

/* ------------------------------------------------------------------------------ scheduling */

typedef struct {
    int *count;
} items_ctx;
static void count_item(void *ctx, int i) {
    items_ctx *c = ctx;
    __atomic_fetch_add(&c->count[i], 1, __ATOMIC_RELAXED);
}

static void test_for_each_item(void **state) {
    (void)state;
    const int ns[] = {0, 1, 2, 3, 7, 64, 1000};
    for (int i = 0; i < N_THREADS; i++) {
        tera_set_threads(THREADS[i]);
        for (int c = 0; c < 7; c++) {
            const int n = ns[c];
            int *count = calloc((size_t)n + 1, sizeof(int));
            items_ctx ctx = {count};
            tera_for_each_item(n, count_item, &ctx);
            for (int it = 0; it < n; it++)
                if (count[it] != 1)
                    fail_msg("%d threads, %d items: item %d ran %d times", THREADS[i], n, it, count[it]);
            assert_int_equal(count[n], 0); /* nothing beyond n */
            free(count);
        }
    }
    tera_set_threads(2);
}

static void test_threads_and_side_by_side(void **state) {
    (void)state;
    for (int i = 0; i < N_THREADS; i++) {
        const int t = THREADS[i];
        tera_set_threads(t);
        assert_int_equal(tera_max_threads(), t);
        for (int n = 0; n <= 3 * t + 2; n++) {
            const int want = t > 1 && n >= 2 * t; /* at least two items per thread */
            if (tera_items_side_by_side(n) != want)
                fail_msg("%d threads, %d items: side by side %d, want %d", t, n, tera_items_side_by_side(n), want);
        }
    }
    tera_set_threads(2);
}

/* ------------------------------------------------------------------------------ the CPU backend's table */

/* Model code calls these kernels through the CPU backend's table (include/tera/backend.h): each entry
 * gives the same bits as the function it wraps. */
static void test_cpu_backend_table(void **state) {
    (void)state;
    tera_backend *be = tera_backend_cpu_create(-1);
    plan p = make_plan(20, 3, 7, 20);
    const int64_t N = 20, K = 3, D = 6, R = p.R;
    float *x = fnew(N * D), *xg = fnew(R * D), *a = fnew(R * D), *b = fnew(R * D), *topw = fnew(N * K);
    float *o1 = fnew(N * D), *o2 = fnew(N * D), *w1 = fnew(N * K), *w2 = fnew(N * K);
    tu_fill(x, N * D, 61, 1.0f), tu_fill(xg, R * D, 62, 1.0f), tu_fill(topw, N * K, 63, 1.0f);
    tera_moe_gather_forward(a, x, p.row_tok, R, D);
    be->ops.moe_gather_forward(be, b, x, p.row_tok, R, D);
    assert_same("backend gather forward", b, a, R * D);
    memcpy(o1, x, sizeof(float) * (size_t)(N * D)), memcpy(o2, x, sizeof(float) * (size_t)(N * D));
    tera_moe_gather_backward(o1, xg, p.slot_row, N, (int)K, D);
    be->ops.moe_gather_backward(be, o2, xg, p.slot_row, N, (int)K, D);
    assert_same("backend gather backward", o2, o1, N * D);
    memcpy(o1, x, sizeof(float) * (size_t)(N * D)), memcpy(o2, x, sizeof(float) * (size_t)(N * D));
    tera_moe_combine_forward(o1, xg, topw, p.slot_row, N, (int)K, D);
    be->ops.moe_combine_forward(be, o2, xg, topw, p.slot_row, N, (int)K, D);
    assert_same("backend combine forward", o2, o1, N * D);
    tera_moe_combine_backward(a, w1, x, xg, topw, p.slot_row, N, (int)K, D);
    be->ops.moe_combine_backward(be, b, w2, x, xg, topw, p.slot_row, N, (int)K, D);
    assert_same("backend combine backward dye", b, a, R * D);
    assert_same("backend combine backward dtopw", w2, w1, N * K);
    memcpy(o1, x, sizeof(float) * (size_t)(N * D)), memcpy(o2, x, sizeof(float) * (size_t)(N * D));
    tera_add_forward(o1, topw, N * K);
    be->ops.add_forward(be, o2, topw, N * K);
    assert_same("backend add", o2, o1, N * D);
    const int64_t S[3] = {3, 4, 5}, lo[3] = {1, 1, 2}, len[3] = {2, 3, 3};
    tera_fill_normal_block(o1, 18, S, lo, len, 0.1f, 5, 6);
    be->ops.fill_normal_block(be, o2, 18, S, lo, len, 0.1f, 5, 6);
    assert_same("backend fill_normal_block", o2, o1, 18);
    for (int i = 0; i < N_THREADS; i++) {
        tera_set_threads(THREADS[i]);
        assert_int_equal(be->ops.max_threads(be), tera_max_threads());
        for (int n = 0; n < 12; n++) assert_int_equal(be->ops.items_side_by_side(be, n), tera_items_side_by_side(n));
        int count[50] = {0};
        items_ctx ctx = {count};
        be->ops.for_each_item(be, 49, count_item, &ctx);
        for (int it = 0; it < 49; it++) assert_int_equal(count[it], 1);
        assert_int_equal(count[49], 0);
    }
    tera_set_threads(2);
    free(x), free(xg), free(a), free(b), free(topw), free(o1), free(o2), free(w1), free(w2);
    free_plan(&p);
    tera_backend_destroy(be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gather_forward),
        cmocka_unit_test(test_gather_backward),
        cmocka_unit_test(test_combine_forward),
        cmocka_unit_test(test_combine_backward),
        cmocka_unit_test(test_combine_finite_differences),
        cmocka_unit_test(test_add_forward),
        cmocka_unit_test(test_fill_normal_block),
        cmocka_unit_test(test_for_each_item),
        cmocka_unit_test(test_threads_and_side_by_side),
        cmocka_unit_test(test_cpu_backend_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
