/* bf16 Adam moments with stochastic rounding (optimizer.moments = bf16; src/train/optim.c):
 * - the rounding: exact for bf16 values (and for NaN/Inf), unbiased (over all 2^16 values of its
 *   random input the mean is x exactly), the round-to-nearest of checkpoint loads ties to even;
 * - the random bits: a pure function of (key, tensor, element), different for another step, seed,
 *   tensor or element, and uniform enough (chi-square over 256 buckets of each 16-bit half), so the
 *   moments are unbiased in expectation over many draws;
 * - the update: equal bit for bit to a scalar reference of the same arithmetic with the element's
 *   draw by global index (also with infinite, NaN, overflowing and subnormal gradients: the vector
 *   loop's special-value path); bit-identical on 1, 2 and 3 threads, split into ZeRO shards with buffers of
 *   their own, and with a tensor stored as blocks of other layouts (tensor-parallel column slices,
 *   expert-parallel slices of dim 0) updated by separate optimizers: the same bits as the whole;
 * - the moments read and written as fp32 (checkpoint windows): exact both ways for bf16 values. */
#include "testutil.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/train.h"

#define C TERA_OPTIM_CHUNK

static tera_backend *g_be;

/* ---- the rounding */
static void test_rounding_exact_and_unbiased(void **state) {
    (void)state;
    /* bf16 values (low 16 bits clear): unchanged whatever the random input; nearest too */
    const uint32_t exact[] = {0x00000000u, 0x80000000u, 0x3F800000u, 0xBF800000u, 0x00010000u /* subnormal */,
                              0x7F7F0000u /* max finite */, 0xFF7F0000u, 0x7F800000u /* inf */, 0xFF800000u,
                              0x3DCC0000u, 0xC2480000u};
    const uint32_t rs[] = {0u, 1u, 0x7FFFu, 0x8000u, 0xFFFFu};
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++) {
        for (size_t r = 0; r < sizeof rs / sizeof rs[0]; r++)
            assert_int_equal(tera_bf16_stochastic(tu_float(exact[i]), rs[r]), exact[i] >> 16);
        assert_int_equal(tera_bf16_nearest(tu_float(exact[i])), exact[i] >> 16);
        assert_true(tu_bits(tera_bf16_widen((uint16_t)(exact[i] >> 16))) == exact[i]);
    }
    /* NaN stays NaN, also one whose payload is in the low 16 bits only */
    const uint32_t nans[] = {0x7FC00000u, 0x7F800001u, 0xFF80FFFFu};
    for (size_t i = 0; i < 3; i++) {
        assert_true(isnan(tera_bf16_widen(tera_bf16_stochastic(tu_float(nans[i]), 0xFFFFu))));
        assert_true(isnan(tera_bf16_widen(tera_bf16_nearest(tu_float(nans[i])))));
    }
    /* unbiased: over all 2^16 random inputs, the rounded values add up to 2^16 x exactly, and each
     * value is one of the two bf16 neighbours of x */
    const float xs[] = {0.1f, -0.1f, 1.0f + 0x1p-9f, 3.14159265f, -2.7182818e-5f, 1.2345e-30f, 6.1e-39f /* subnormal */,
                        123456.789f};
    for (size_t i = 0; i < sizeof xs / sizeof xs[0]; i++) {
        const uint32_t u = tu_bits(xs[i]);
        const float lo = tu_float(u & 0xFFFF0000u), hi = tu_float((u & 0xFFFF0000u) + 0x10000u);
        double sum = 0.0;
        for (uint32_t r = 0; r < 65536u; r++) {
            const float y = tera_bf16_widen(tera_bf16_stochastic(xs[i], r));
            assert_true(y == lo || y == hi);
            sum += y;
        }
        assert_true(sum == 65536.0 * (double)xs[i]);
    }
    /* nearest: below half an ulp down, above up, a tie to the even neighbour */
    assert_int_equal(tera_bf16_nearest(tu_float(0x3F807FFFu)), 0x3F80u);
    assert_int_equal(tera_bf16_nearest(tu_float(0x3F808001u)), 0x3F81u);
    assert_int_equal(tera_bf16_nearest(tu_float(0x3F808000u)), 0x3F80u); /* tie, 0x3F80 even */
    assert_int_equal(tera_bf16_nearest(tu_float(0x3F818000u)), 0x3F82u); /* tie, 0x3F82 even */
    assert_int_equal(tera_bf16_nearest(tu_float(0xBF808001u)), 0xBF81u);
}

/* ---- the random bits */
static void test_random_bits(void **state) {
    (void)state;
    const uint64_t key = tera_moment_key(1234, 7);
    assert_true(tera_moment_key(1234, 7) == key);
    assert_true(tera_moment_key(1234, 8) != key && tera_moment_key(1235, 7) != key);
    assert_true(tera_moment_random(key, 3, 1000) == tera_moment_random(key, 3, 1000));
    int same = 0;
    for (int64_t e = 0; e < 1000; e++) {
        const uint32_t r = tera_moment_random(key, 3, e);
        same += r == tera_moment_random(key, 4, e);                        /* another tensor */
        same += r == tera_moment_random(tera_moment_key(1234, 8), 3, e);   /* another step */
        same += r == tera_moment_random(key, 3, e + ((int64_t)1 << 32));   /* the high half of e */
        same += r == tera_moment_random(key, 3, e + 1);
    }
    assert_true(same <= 1); /* a 32-bit coincidence: about 1e-6 expected */
    /* each 16-bit half uniform over 256 buckets of its top 8 bits: chi-square with 255 degrees of
     * freedom, below 400 (p < 1e-7 for a uniform source) */
    enum { N = 1 << 18 };
    for (int half = 0; half < 2; half++) {
        int64_t count[256] = {0};
        for (int64_t e = 0; e < N; e++) {
            const uint32_t r = tera_moment_random(key, 11, e);
            count[half ? r >> 24 : (r >> 8) & 0xFF]++;
        }
        double chi = 0.0;
        const double want = N / 256.0;
        for (int b = 0; b < 256; b++) chi += (count[b] - want) * (count[b] - want) / want;
        print_message("chi-square of the %s half: %.1f\n", half ? "high" : "low", chi);
        assert_true(chi < 400.0);
    }
    /* unbiased in expectation over many draws: x rounded with element e's bits, e = 0..N-1, has the
     * mean x within 5 standard deviations of the rounding (ulp sqrt(p (1 - p) / N)) */
    const float xs[] = {0.1f, -0.3f, 1.0f + 0x1p-12f, 7.7e-7f};
    for (size_t i = 0; i < 4; i++)
        for (int half = 0; half < 2; half++) {
            const uint32_t u = tu_bits(xs[i]);
            const double ulp = (double)tu_float((u & 0xFFFF0000u) + 0x10000u) - (double)tu_float(u & 0xFFFF0000u);
            const double p = (double)(u & 0xFFFFu) / 65536.0;
            double sum = 0.0;
            for (int64_t e = 0; e < N; e++) {
                const uint32_t r = tera_moment_random(key, 2, e);
                sum += tera_bf16_widen(tera_bf16_stochastic(xs[i], half ? r >> 16 : r & 0xFFFFu));
            }
            const double err = fabs(sum / N - (double)xs[i]), sd = fabs(ulp) * sqrt(p * (1.0 - p) / N);
            assert_true(err <= 5.0 * sd + 1e-12 * fabs((double)xs[i]));
        }
}

/* ---- the update */
/* A table of tensors stored as blocks: per tensor the global shape, the block (lo, len) and the
 * flat offset; w and g filled from seed (values per global element, so another layout of the same
 * tensors gets the same values). */
typedef struct {
    int64_t shape[3], lo[3], len[3];
} blk;

static const tera_optim_config oc = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
static const float lrs[3] = {1e-3f, 3e-3f, 2e-3f}, gss[3] = {1.0f, 0.37f, 1.0f};

/* global tensors: a vector, a matrix of several chunks with a tail, a small matrix, a 3-D stack */
static const int64_t gshape[][3] = {{1, 1, 5}, {1, 3 * 96 + 1, 257}, {1, 32, 48}, {4, 40, 130}};
#define NT 4

static int g_special; /* 1: gradients with infinities, NaNs, overflowing squares and subnormals */

/* value of global element e of tensor i at step s (s = -1: the weights) */
static float val(int i, int64_t e, int s) {
    float x;
    tu_fill(&x, 1, (uint64_t)(1000 * (s + 2) + 17 * i) * 1000003ull + (uint64_t)e, s < 0 ? 0.5f : 0.01f);
    if (s >= 0 && (e + s) % 89 == 0) x = 0.0f; /* exact zeros: moments from zero */
    if (g_special && s >= 0) { /* one special value per element and run at most (a single NaN payload) */
        static const uint32_t sp0[] = {0x7F800000u, 0xFF800000u, 0x7FFFFFFFu, 0xFFFFFFFFu, 0x7F800001u,
                                       0x60AD78ECu /* 1e20: its square overflows */, 0xE0AD78ECu, 0x00011C3Au /* subnormal */};
        const int64_t r = e % 61;
        if (s == 0 && r < 8) x = tu_float(sp0[r]);
        if (s == 1 && r == 9) x = tu_float(0x7FC0FFFFu);
        if (s == 2 && r == 10) x = tu_float(0x60AD78ECu);
    }
    return x;
}

/* local element j of a block -> its global element index */
static int64_t global_of(const blk *b, int64_t j) {
    const int64_t i2 = j % b->len[2], i1 = j / b->len[2] % b->len[1], i0 = j / (b->len[1] * b->len[2]);
    return ((b->lo[0] + i0) * b->shape[1] + b->lo[1] + i1) * b->shape[2] + b->lo[2] + i2;
}

static void block_model(tera_model *m, tera_param *p, const blk *b) {
    memset(m, 0, sizeof *m);
    m->be = g_be;
    memset(p, 0, sizeof(tera_param) * NT);
    int64_t off = 0;
    for (int i = 0; i < NT; i++) {
        for (int d = 0; d < 3; d++) p[i].shape[d] = b[i].shape[d], p[i].lo[d] = b[i].lo[d], p[i].len[d] = b[i].len[d];
        p[i].ndim = 3;
        p[i].tp_dim = -1;
        p[i].numel = b[i].len[0] * b[i].len[1] * b[i].len[2];
        p[i].offset = off;
        p[i].decay = i % 2;
        off += p[i].numel;
    }
    m->params = p;
    m->n_params = NT;
    m->n_floats = off;
    m->w = malloc(sizeof(float) * (size_t)(off + 1));
    m->g = malloc(sizeof(float) * (size_t)(off + 1));
    for (int i = 0; i < NT; i++)
        for (int64_t j = 0; j < p[i].numel; j++) m->w[p[i].offset + j] = val(i, global_of(&b[i], j), -1);
}

static void set_grads(tera_model *m, const blk *b, int s) {
    for (int i = 0; i < NT; i++)
        for (int64_t j = 0; j < m->params[i].numel; j++) m->g[m->params[i].offset + j] = val(i, global_of(&b[i], j), s);
}

static void whole_blocks(blk *b) {
    for (int i = 0; i < NT; i++)
        for (int d = 0; d < 3; d++) b[i].shape[d] = b[i].len[d] = gshape[i][d], b[i].lo[d] = 0;
}

static void free_model(tera_model *m) { free(m->w), free(m->g); }

/* three steps of o on m (threads t) */
static void run3(tera_model *m, const blk *b, tera_adamw *o, int threads) {
    tera_set_threads(threads);
    for (int s = 0; s < 3; s++) {
        set_grads(m, b, s);
        tera_adamw_step(o, m, lrs[s], gss[s], &oc, 1, NULL, NULL);
    }
    tera_set_threads(2);
}

/* The same arithmetic, element by element, with the element's draw by global index. */
static void step_reference(void) {
    blk b[NT];
    whole_blocks(b);
    tera_param p[NT];
    tera_model m;
    block_model(&m, p, b);
    const int64_t n = m.n_floats;
    const uint64_t seed = 99;
    float *w = malloc(sizeof(float) * (size_t)n);
    uint16_t *mm = calloc((size_t)n, 2), *vv = calloc((size_t)n, 2);
    memcpy(w, m.w, sizeof(float) * (size_t)n);
    for (int s = 0; s < 3; s++) {
        const int64_t t = s + 1;
        const float b1 = oc.beta1, b2 = oc.beta2, bc1 = 1.0f - powf(b1, (float)t), bc2 = 1.0f - powf(b2, (float)t);
        const float ss = lrs[s] / bc1, ib = 1.0f / sqrtf(bc2), omb1 = 1.0f - b1, omb2 = 1.0f - b2;
        const uint64_t key = tera_moment_key(seed, t);
        for (int i = 0; i < NT; i++) {
            const float decay = p[i].decay ? 1.0f - lrs[s] * oc.weight_decay : 1.0f;
            for (int64_t e = 0; e < p[i].numel; e++) {
                const int64_t j = p[i].offset + e;
                const float gj = val(i, e, s) * gss[s], w0 = w[j];
                const float mj = b1 * tera_bf16_widen(mm[j]) + omb1 * gj, vj = b2 * tera_bf16_widen(vv[j]) + omb2 * gj * gj;
                w[j] = w0 * decay - ss * mj / (sqrtf(vj) * ib + oc.eps);
                const uint32_t r = tera_moment_random(key, i, e);
                mm[j] = tera_bf16_stochastic(mj, r & 0xFFFFu);
                vv[j] = tera_bf16_stochastic(vj, r >> 16);
            }
        }
    }
    tera_adamw o;
    tera_adamw_init_range_bf16(&o, 0, n, seed);
    assert_null(o.m);
    assert_int_equal(tera_adamw_moment_bytes(&o), 4 * n);
    run3(&m, b, &o, 2);
    assert_same("w", m.w, w, n);
    assert_memory_equal(o.mh, mm, 2 * (size_t)n);
    assert_memory_equal(o.vh, vv, 2 * (size_t)n);
    for (int64_t i = 0; i < n; i++) assert_true(m.g[i] == 0.0f);
    if (g_special) { /* the special values reached the moments: infinities and NaNs stored as such */
        int64_t inf = 0, nan = 0;
        for (int64_t i = 0; i < n; i++) {
            const float x = tera_bf16_widen(vv[i]);
            inf += isinf(x), nan += isnan(x);
        }
        assert_true(inf > 0 && nan > 0);
    }
    /* the moments are not all exact: the rounding went both ways somewhere */
    int64_t nonzero = 0;
    for (int64_t i = 0; i < n; i++) nonzero += mm[i] != 0;
    assert_true(nonzero > n / 2);
    free(w), free(mm), free(vv);
    tera_adamw_free(&o);
    free_model(&m);
}

static void test_step_reference(void **state) {
    (void)state;
    step_reference();
}

/* The vector loop's infinity and NaN path (tera_bf16_stochastic's special case: a NaN payload that
 * the random bits would carry into the sign or turn into an infinity) against the scalar reference. */
static void test_step_special(void **state) {
    (void)state;
    g_special = 1;
    step_reference();
}

static int special_off(void **state) { /* teardown: also after a failure */
    (void)state;
    g_special = 0;
    return 0;
}

/* 1, 2, 3 threads; shards [0, k) and [k, n) with the second on its own buffers: the same bits */
static void test_threads_and_shards(void **state) {
    (void)state;
    blk b[NT];
    whole_blocks(b);
    tera_param p[NT];
    tera_model ref;
    block_model(&ref, p, b);
    const int64_t n = ref.n_floats;
    tera_adamw oref;
    tera_adamw_init_range_bf16(&oref, 0, n, 5);
    run3(&ref, b, &oref, 1);
    for (int t = 2; t <= 3; t++) {
        tera_model m;
        block_model(&m, p, b);
        tera_adamw o;
        tera_adamw_init_range_bf16(&o, 0, n, 5);
        run3(&m, b, &o, t);
        assert_same("w", m.w, ref.w, n);
        assert_memory_equal(o.mh, oref.mh, 2 * (size_t)n);
        assert_memory_equal(o.vh, oref.vh, 2 * (size_t)n);
        tera_adamw_free(&o);
        free_model(&m);
    }
    /* shards, cut inside tensor 1 off any chunk boundary */
    const int64_t k = p[1].offset + C + 1001;
    tera_model m;
    block_model(&m, p, b);
    tera_adamw lo, hi;
    tera_adamw_init_range_bf16(&lo, 0, k, 5);
    tera_adamw_init_range_bf16(&hi, k, n, 5);
    float *hw = malloc(sizeof(float) * (size_t)(n - k)), *hg = malloc(sizeof(float) * (size_t)(n - k));
    memcpy(hw, m.w + k, sizeof(float) * (size_t)(n - k));
    hi.w = hw, hi.g = hg;
    for (int s = 0; s < 3; s++) {
        set_grads(&m, b, s);
        memcpy(hg, m.g + k, sizeof(float) * (size_t)(n - k));
        tera_adamw_step(&lo, &m, lrs[s], gss[s], &oc, 1, NULL, NULL);
        tera_adamw_step(&hi, &m, lrs[s], gss[s], &oc, 1, NULL, NULL);
    }
    assert_same("w lo", m.w, ref.w, k);
    assert_same("w hi", hw, ref.w + k, n - k);
    assert_memory_equal(lo.mh, oref.mh, 2 * (size_t)k);
    assert_memory_equal(hi.mh, oref.mh + k, 2 * (size_t)(n - k));
    assert_memory_equal(hi.vh, oref.vh + k, 2 * (size_t)(n - k));
    free(hw), free(hg);
    tera_adamw_free(&lo), tera_adamw_free(&hi);
    free_model(&m);
    tera_adamw_free(&oref);
    free_model(&ref);
}

/* Other layouts of the same tensors: two "ranks" holding column halves (tensor parallelism on the
 * last dim), then two holding halves of dim 0 of the stack and row halves of the matrices (expert
 * parallelism / tensor parallelism on dim 1); each rank updates its blocks with its own optimizer.
 * Every element ends with the bits the whole model's gives it. */
static void test_layouts(void **state) {
    (void)state;
    blk bw[NT];
    whole_blocks(bw);
    tera_param pw[NT];
    tera_model whole;
    block_model(&whole, pw, bw);
    tera_adamw ow;
    tera_adamw_init_range_bf16(&ow, 0, whole.n_floats, 77);
    run3(&whole, bw, &ow, 2);
    for (int split = 0; split < 2; split++)
        for (int r = 0; r < 2; r++) {
            blk b[NT];
            whole_blocks(b);
            for (int i = 0; i < NT; i++) {
                const int d = split == 0 ? 2 : (gshape[i][0] > 1 ? 0 : 1); /* the dim split */
                if (gshape[i][d] < 2) continue;
                const int64_t half = gshape[i][d] / 2;
                b[i].lo[d] = r ? half : 0;
                b[i].len[d] = r ? gshape[i][d] - half : half;
            }
            tera_param p[NT];
            tera_model m;
            block_model(&m, p, b);
            tera_adamw o;
            tera_adamw_init_range_bf16(&o, 0, m.n_floats, 77);
            run3(&m, b, &o, 2);
            for (int i = 0; i < NT; i++)
                for (int64_t j = 0; j < p[i].numel; j++) {
                    const int64_t e = global_of(&b[i], j), a = p[i].offset + j, z = pw[i].offset + e;
                    if (tu_bits(m.w[a]) != tu_bits(whole.w[z]) || o.mh[a] != ow.mh[z] || o.vh[a] != ow.vh[z])
                        fail_msg("split %d rank %d: tensor %d element %ld differs from the whole model's", split, r, i,
                                 (long)e);
                }
            tera_adamw_free(&o);
            free_model(&m);
        }
    tera_adamw_free(&ow);
    free_model(&whole);
}

/* The moments as fp32 (checkpoint windows): widened exactly, bf16 values written back exactly,
 * other values rounded to nearest; fp32 moments copied. */
static void test_moments_io(void **state) {
    (void)state;
    enum { N = 1000 };
    tera_adamw o, f;
    tera_adamw_init_range_bf16(&o, 100, 100 + N, 1);
    tera_adamw_init_range(&f, 100, 100 + N);
    float x[N], y[N];
    tu_fill(x, N, 3, 2.0f);
    tera_adamw_moments_set(&o, 2, 0, N, x);
    tera_adamw_moments_get(&o, 2, 0, N, y);
    for (int i = 0; i < N; i++) assert_true(tu_bits(y[i]) == (uint32_t)tera_bf16_nearest(x[i]) << 16);
    float z[N];
    tera_adamw_moments_set(&o, 1, 0, N, y); /* bf16 values: exact */
    tera_adamw_moments_get(&o, 1, 0, N, z);
    assert_same("bf16 round trip", z, y, N);
    tera_adamw_moments_set(&f, 1, 10, 20, x);
    tera_adamw_moments_get(&f, 1, 10, 20, z);
    assert_same("fp32 copy", z, x, 20);
    assert_same("fp32 storage", f.m + 10, x, 20);
    tera_adamw_free(&o), tera_adamw_free(&f);
}

int main(void) {
    tera_set_threads(2);
    g_be = tera_backend_cpu_create(-1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rounding_exact_and_unbiased), cmocka_unit_test(test_random_bits),
        cmocka_unit_test(test_step_reference), cmocka_unit_test_teardown(test_step_special, special_off), cmocka_unit_test(test_threads_and_shards),
        cmocka_unit_test(test_layouts), cmocka_unit_test(test_moments_io),
    };
    const int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tera_backend_destroy(g_be);
    return rc;
}
