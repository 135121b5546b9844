/* Compressed collectives (include/tera/compress.h).
 *
 * The formats: bf16 and fp16 against the compiler's _Float16 / the bit rules (round to nearest even,
 * NaN and infinities, fp16 saturation and subnormals), e4m3 on its table, int8 blocks within half a
 * step of their scale, and the error-feedback rule (residual = (x + e) - D(Q(x + e))).
 *
 * The reference (test_mpi_reference): this program runs itself under mpirun on 2, 4 and 8 ranks
 * (skipped without mpirun). Every rank reduces its own gradients of 1000 floats (not a multiple of
 * the chunk alignment nor of the int8 block; magnitudes from 1e-3 to 1e3) for 20 steps with each
 * lossy kind, and simulates every rank's side of the specification (include/tera/compress.h: each
 * rank's residuals, the owners' fp32 sums in rank order, the owners' second-stage residuals) with
 * its own code on the scalar conversions: the all-reduce's answer must equal the simulation bit for
 * bit, on every step; so must the reduce-scatter's (uneven ranges). The error against the fp32 sum
 * is measured and bounded per kind, and with error feedback the error of the running sum over the
 * 20 steps stays at one step's size instead of growing (the residuals carry what was lost). The
 * bytes sent equal 2 (p-1)/p x the compressed size. */
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/comm.h"
#include "tera/compress.h"

static void test_bf16_fp16(void **state) {
    (void)state;
    assert_int_equal(tera_f32_to_bf16(1.0f), 0x3f80);
    /* 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1) */
    assert_int_equal(tera_f32_to_bf16(1.00390625f), 0x3f80);
    assert_int_equal(tera_f32_to_bf16(1.01171875f), 0x3f82); /* 1 + 3 x 2^-8: tie to even, up */
    assert_true(isnan(tera_bf16_to_f32(tera_f32_to_bf16(NAN))));
    assert_true(isinf(tera_bf16_to_f32(tera_f32_to_bf16(INFINITY))));
    assert_int_equal(tera_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(tera_f32_to_f16(1e6f), 0x7bff);   /* saturates */
    assert_int_equal(tera_f32_to_f16(-1e6f), 0xfbff);
    assert_int_equal(tera_f32_to_f16(INFINITY), 0x7c00);
    assert_true(isnan(tera_f16_to_f32(tera_f32_to_f16(NAN))));
    assert_int_equal(tera_f32_to_f16(5.9604645e-8f), 0x0001); /* 2^-24, the smallest subnormal */
    assert_int_equal(tera_f32_to_f16(2.9802322e-8f), 0x0000); /* half of it: a tie, to even (0) */
    assert_int_equal(tera_f32_to_f16(6.1035156e-5f), 0x0400); /* 2^-14, the smallest normal */
#ifdef __FLT16_MAX__
    float x[4096];
    tu_fill(x, 4096, 7, 1.0f);
    for (int i = 0; i < 4096; i++) {
        const float v = x[i] * ldexpf(1.0f, i % 40 - 28); /* 2^-28 .. 2^11: subnormals to large normals */
        const _Float16 h = (_Float16)v;
        uint16_t hb;
        memcpy(&hb, &h, 2);
        if (tera_f32_to_f16(v) != hb) fail_msg("fp16 of %.9g: %04x, compiler %04x", (double)v, tera_f32_to_f16(v), hb);
        assert_true(tera_f16_to_f32(hb) == (float)h);
    }
#endif
}

static void test_e4m3(void **state) {
    (void)state;
    assert_int_equal(tera_f32_to_e4m3(448.0f), 0x7e);
    assert_int_equal(tera_f32_to_e4m3(1e9f), 0x7e);
    assert_int_equal(tera_f32_to_e4m3(-448.0f), 0xfe);
    assert_int_equal(tera_f32_to_e4m3(1.0f), 0x38);
    assert_int_equal(tera_f32_to_e4m3(1.0625f), 0x38); /* 1 + 1/16: tie between 1 and 1.125, to even */
    assert_int_equal(tera_f32_to_e4m3(1.1875f), 0x3a); /* 1 + 3/16: tie, to even (1.25) */
    assert_int_equal(tera_f32_to_e4m3(0.001953125f), 0x01); /* 2^-9 */
    assert_true(isnan(tera_e4m3_to_f32(tera_f32_to_e4m3(NAN))));
    for (int q = 0; q < 256; q++) { /* every finite code decodes and encodes back to itself */
        if ((q & 0x7f) == 0x7f) continue;
        const float v = tera_e4m3_to_f32((uint8_t)q);
        if (q == 0x80) continue; /* -0 encodes as -0: fine, but compare by value */
        assert_int_equal(tera_f32_to_e4m3(v), q);
    }
}

static void test_int8_and_feedback(void **state) {
    (void)state;
    enum { N = 700 };
    float x[N], e[N], e0[N], y[N];
    uint8_t buf[4 * N + 64];
    tu_fill(x, N, 3, 5.0f);
    x[10] = 0.0f;
    for (int k = TERA_COMPRESS_BF16; k <= TERA_COMPRESS_FP8; k++) {
        tu_fill(e, N, 11 + (uint64_t)k, 0.01f);
        memcpy(e0, e, sizeof e);
        assert_true(tera_compress_bytes((tera_compress_kind)k, N) <= (int64_t)sizeof buf);
        tera_compress_encode((tera_compress_kind)k, x, N, buf, e);
        tera_compress_decode((tera_compress_kind)k, buf, N, y);
        for (int i = 0; i < N; i++) {
            const float v = x[i] + e0[i];
            const float want = v - y[i];
            if (memcmp(&want, &e[i], 4) != 0) fail_msg("%s: residual %d is %g, want %g", tera_compress_name(k), i, (double)e[i], (double)want);
            if (k == TERA_COMPRESS_INT8) { /* within half a step of the block's scale */
                float mx = 0.0f;
                const int b0 = i / TERA_COMPRESS_BLOCK * TERA_COMPRESS_BLOCK;
                for (int j = b0; j < b0 + TERA_COMPRESS_BLOCK && j < N; j++) mx = fmaxf(mx, fabsf(x[j] + e0[j]));
                assert_true(fabsf(want) <= 0.5f * mx / 127.0f * 1.0001f);
            }
        }
    }
    /* a non-finite value: NaN comes out (the step is skipped), the residual stays finite */
    x[5] = NAN;
    memset(e, 0, sizeof e);
    tera_compress_encode(TERA_COMPRESS_INT8, x, N, buf, e);
    tera_compress_decode(TERA_COMPRESS_INT8, buf, N, y);
    assert_true(isnan(y[5]) && isnan(y[0]) && !isnan(y[TERA_COMPRESS_BLOCK]));
    for (int i = 0; i < N; i++) assert_true(isfinite(e[i]));
    assert_int_equal(tera_compress_parse("int8"), TERA_COMPRESS_INT8);
    assert_int_equal(tera_compress_parse("fp32"), -1);
    assert_int_equal(tera_compress_bytes(TERA_COMPRESS_INT8, 512), 512 + 8);
}

/* ---- under mpirun */
#define CHECK(cond) TU_RANK_CHECK(me, cond)

static int me;
enum { NV = 1000, STEPS = 20, PMAX = 8 };

/* rank r's gradient at step t: uniform, magnitudes 1e-3 .. 1e3 by element */
static void grad(int r, int t, float *g) {
    tu_fill(g, NV, (uint64_t)(1000 * r + t + 1), 1.0f);
    for (int i = 0; i < NV; i++) g[i] *= powf(10.0f, (float)(i % 7) - 3.0f);
}

/* the reference quantizer of one message (the specification, written again): v = x + e, Q, D,
 * residual v - D; int8 blocks from the message start */
static void ref_q(int k, const float *x, float *e, int64_t n, float *d) {
    for (int64_t b0 = 0; b0 < n; b0 += TERA_COMPRESS_BLOCK) {
        const int64_t b1 = k == TERA_COMPRESS_INT8 && b0 + TERA_COMPRESS_BLOCK < n ? b0 + TERA_COMPRESS_BLOCK : n;
        float mx = 0.0f;
        for (int64_t i = b0; i < b1; i++) mx = fmaxf(mx, fabsf(x[i] + e[i]));
        const float scale = mx / 127.0f;
        for (int64_t i = b0; i < b1; i++) {
            const float v = x[i] + e[i];
            float q;
            if (k == TERA_COMPRESS_BF16) q = tera_bf16_to_f32(tera_f32_to_bf16(v));
            else if (k == TERA_COMPRESS_FP16) q = tera_f16_to_f32(tera_f32_to_f16(v));
            else q = scale == 0.0f ? 0.0f : (float)(int)fminf(fmaxf(rintf(v / scale), -127.0f), 127.0f) * scale; /* q an integer: no -0 */
            d[i] = q;
            e[i] = v - q;
        }
        if (k != TERA_COMPRESS_INT8) break;
    }
}

static int mpi_reference(int argc, char **argv) {
    CHECK(tera_comm_init(&argc, &argv) == TERA_OK);
    tera_comm *w = tera_comm_world();
    me = tera_comm_rank(w);
    const int p = tera_comm_size(w);
    CHECK(p <= PMAX);
    /* simulated state of every rank */
    float *g = calloc((size_t)PMAX * NV, sizeof(float)), *e1 = calloc((size_t)PMAX * NV, sizeof(float));
    float *e2 = calloc(NV, sizeof(float)), *d = calloc((size_t)PMAX * NV, sizeof(float)), *want = calloc(NV, sizeof(float));
    float *buf = calloc(NV, sizeof(float)), *cum = calloc(NV, sizeof(float));
    double *cum_exact = calloc(NV, sizeof(double));
    int64_t lo[PMAX + 1], cnt[PMAX];
    const int64_t S = ((NV + p - 1) / p + 15) & ~(int64_t)15;
    for (int j = 0; j <= p; j++) lo[j] = (int64_t)j * S < NV ? (int64_t)j * S : NV;
    for (int j = 0; j < p; j++) cnt[j] = lo[j + 1] - lo[j];
    const double bound[] = {0, 1e-2, 2e-3, 2e-2}; /* relative L2 error of one step, per kind */
    for (int k = TERA_COMPRESS_BF16; k <= TERA_COMPRESS_INT8; k++) {
        tera_creducer *cr = tera_creducer_create(w, (tera_compress_kind)k, NV);
        memset(e1, 0, sizeof(float) * PMAX * NV);
        memset(e2, 0, sizeof(float) * NV);
        memset(cum, 0, sizeof(float) * NV);
        memset(cum_exact, 0, sizeof(double) * NV);
        double step_err = 0.0, step_abs = 0.0, cum_err = 0.0, cum_norm = 0.0;
        tera_comm_traffic_reset();
        for (int t = 0; t < STEPS; t++) {
            for (int r = 0; r < p; r++) grad(r, t, g + (int64_t)r * NV);
            /* the specification, simulated for every rank */
            for (int r = 0; r < p; r++)
                for (int j = 0; j < p; j++)
                    ref_q(k, g + (int64_t)r * NV + lo[j], e1 + (int64_t)r * NV + lo[j], cnt[j], d + (int64_t)r * NV + lo[j]);
            for (int i = 0; i < NV; i++) {
                float s = d[i];
                for (int r = 1; r < p; r++) s += d[(int64_t)r * NV + i];
                want[i] = s;
            }
            for (int j = 0; j < p; j++) ref_q(k, want + lo[j], e2 + lo[j], cnt[j], want + lo[j]);
            /* the real thing */
            memcpy(buf, g + (int64_t)me * NV, sizeof(float) * NV);
            tera_creducer_allreduce(cr, buf, 0, NV);
            for (int i = 0; i < NV; i++)
                if (memcmp(&buf[i], &want[i], 4) != 0) {
                    fprintf(stderr, "rank %d: %s step %d: element %d is %.9g, the specification says %.9g\n", me,
                            tera_compress_name((tera_compress_kind)k), t, i, (double)buf[i], (double)want[i]);
                    CHECK(0);
                }
            double en = 0.0, nn = 0.0;
            for (int i = 0; i < NV; i++) {
                double x = 0.0;
                for (int r = 0; r < p; r++) x += g[(int64_t)r * NV + i];
                en += ((double)buf[i] - x) * ((double)buf[i] - x);
                nn += x * x;
                cum[i] += buf[i];
                cum_exact[i] += x;
            }
            step_err += sqrt(en / nn) / STEPS;
            step_abs += sqrt(en) / STEPS;
        }
        for (int i = 0; i < NV; i++) {
            cum_err += ((double)cum[i] - cum_exact[i]) * ((double)cum[i] - cum_exact[i]);
            cum_norm += cum_exact[i] * cum_exact[i];
        }
        const double cum_abs = sqrt(cum_err);
        cum_err = sqrt(cum_err / cum_norm);
        const tera_comm_traffic tr = tera_comm_traffic_get();
        double want_bytes = 0.0; /* 2 (p-1)/p of the compressed message, as counted (exact chunks) */
        for (int j = 0; j < p; j++)
            if (j != me) want_bytes += (double)tera_compress_bytes((tera_compress_kind)k, cnt[j]);
        double tot = 0.0;
        for (int j = 0; j < p; j++) tot += (double)tera_compress_bytes((tera_compress_kind)k, cnt[j]);
        want_bytes = STEPS * (want_bytes + (double)(p - 1) / p * tot);
        CHECK(fabs(tr.allreduce - want_bytes) <= 1e-9 * want_bytes);
        if (me == 0)
            printf("%s on %d ranks: error vs fp32 per step %.3g (relative L2), of the sum over %d steps %.3g; "
                   "bytes per step %.0f (fp32 ring: %.0f)\n",
                   tera_compress_name((tera_compress_kind)k), p, step_err, STEPS, cum_err, tr.allreduce / STEPS,
                   2.0 * (p - 1) / p * 4.0 * NV);
        CHECK(step_err < bound[k]);
        /* error feedback: the running sum's error is the last residuals' (about one step's error), not
         * a random walk of 20 steps' errors (sqrt(20) = 4.5 times one step's) */
        if (me == 0) printf("  absolute: per step %.3g, of the sum %.3g\n", step_abs, cum_abs);
        CHECK(cum_abs < 1.5 * step_abs);
        tera_creducer_free(cr);
    }
    /* reduce-scatter with uneven ranges (ZeRO shards): steps 1-2 only, the owner's fp32 sum */
    for (int k = TERA_COMPRESS_BF16; k <= TERA_COMPRESS_INT8; k++) {
        int64_t rc[PMAX], rl[PMAX + 1];
        rl[0] = 0;
        for (int j = 0; j < p; j++) rc[j] = j == 0 ? 0 : 300 + 37 * j, rl[j + 1] = rl[j] + rc[j];
        const int64_t tot = rl[p], off = 5;
        tera_creducer *cr = tera_creducer_create(w, (tera_compress_kind)k, tot + off);
        float *gg = calloc((size_t)PMAX * (size_t)tot, sizeof(float)), *ee = calloc((size_t)PMAX * (size_t)tot, sizeof(float));
        float *dd = calloc((size_t)PMAX * (size_t)tot, sizeof(float)), *bb = calloc((size_t)tot, sizeof(float));
        for (int t = 0; t < 3; t++) {
            for (int r = 0; r < p; r++) tu_fill(gg + (int64_t)r * tot, tot, (uint64_t)(77 * r + t + 5), 2.0f);
            for (int r = 0; r < p; r++)
                for (int j = 0; j < p; j++)
                    ref_q(k, gg + (int64_t)r * tot + rl[j], ee + (int64_t)r * tot + rl[j], rc[j], dd + (int64_t)r * tot + rl[j]);
            memcpy(bb, gg + (int64_t)me * tot, sizeof(float) * (size_t)tot);
            tera_creducer_reduce_scatter(cr, bb, off, rc);
            for (int64_t i = rl[me]; i < rl[me + 1]; i++) {
                float s = dd[i];
                for (int r = 1; r < p; r++) s += dd[(int64_t)r * tot + i];
                CHECK(memcmp(&s, &bb[i], 4) == 0);
            }
        }
        int64_t ne;
        const float *st = tera_creducer_state(cr, 0, &ne);
        CHECK(ne == tot + off && memcmp(st + off, ee + (int64_t)me * tot, sizeof(float) * (size_t)tot) == 0);
        free(gg), free(ee), free(dd), free(bb);
        tera_creducer_free(cr);
    }
    free(g), free(e1), free(e2), free(d), free(want), free(buf), free(cum), free(cum_exact);
    tera_comm_finalize();
    if (me == 0) printf("compressed reductions: reference ok on %d ranks\n", p);
    return 0;
}

static void test_mpi_reference(void **state) {
    (void)state;
    if (!tu_mpirun_ready()) return;
    tu_mpirun_self(2, "");
    tu_mpirun_self(4, "");
    tu_mpirun_self(8, "");
}

int main(int argc, char **argv) {
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE")) return mpi_reference(argc, argv);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_bf16_fp16), cmocka_unit_test(test_e4m3),
                                       cmocka_unit_test(test_int8_and_feedback), cmocka_unit_test(test_mpi_reference)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
