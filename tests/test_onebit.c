/* 1-bit Adam's compressed momentum all-reduce (include/tera/compress.h: TERA_COMPRESS_ONEBIT and
 * tera_creducer_set_mean; src/train/onebit.c uses it).
 *
 * The format: blocks of TERA_ONEBIT_BLOCK values from the message start, scale = mean |v| of the
 * block, one sign bit per value (0 counts as positive), value +-scale; the residual is exactly
 * v - D(Q(v)); a block with a non-finite value decodes to NaN and leaves zero residuals; the byte
 * count is 4 + ceil(m / 8) per block.
 *
 * The reference (test_mpi_reference): this program runs itself under mpirun on 2, 4 and 8 ranks
 * (skipped without mpirun). Every rank has its own momentum-like vector of 1000 floats (not a
 * multiple of the block or of the chunk alignment; magnitudes 1e-3 .. 1e3) for 20 steps and every
 * rank simulates every rank's side of the specification with its own code: each rank compresses
 * its chunks with its worker residuals, owner j averages the decoded chunks (fp32 sum in rank order,
 * times 1/p), adds its server residual, compresses again; everyone decodes. The all-reduce's answer
 * must equal the simulation bit for bit on every step and every rank, and the residual state must
 * equal the simulated one. With error feedback the running sum of the answers over the 20 steps
 * stays within a few steps' error of the exact running sum (the residuals carry what was lost), under
 * a third of the error of the same exchange without feedback. The
 * bytes sent per step are 2 (p-1)/p of the compressed size (as counted), at most 1/16 of an fp32 ring
 * all-reduce's. */
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/comm.h"
#include "tera/compress.h"

/* the specification of one message, written again: blocks from the start, scale = mean |v| */
static void ref_q(const float *x, float *e, int64_t n, float *d) {
    for (int64_t b0 = 0; b0 < n; b0 += TERA_ONEBIT_BLOCK) {
        const int64_t b1 = b0 + TERA_ONEBIT_BLOCK < n ? b0 + TERA_ONEBIT_BLOCK : n;
        float sum = 0.0f;
        for (int64_t i = b0; i < b1; i++) sum += fabsf(x[i] + e[i]);
        const float scale = sum / (float)(b1 - b0);
        for (int64_t i = b0; i < b1; i++) {
            const float v = x[i] + e[i];
            d[i] = v < 0.0f ? -scale : scale;
            e[i] = v - d[i];
        }
    }
}

static void test_format(void **state) {
    (void)state;
    enum { N = 700 }; /* two whole blocks and one of 188 */
    float x[N], e[N], e0[N], y[N], d[N], er[N];
    uint8_t buf[2 * N];
    assert_int_equal(tera_compress_bytes(TERA_COMPRESS_ONEBIT, N), 3 * 4 + 2 * 32 + (188 + 7) / 8);
    assert_int_equal(tera_compress_bytes(TERA_COMPRESS_ONEBIT, 256), 4 + 32);
    assert_int_equal(tera_compress_bytes(TERA_COMPRESS_ONEBIT, 1), 5);
    assert_string_equal(tera_compress_name(TERA_COMPRESS_ONEBIT), "onebit");
    assert_int_equal(tera_compress_parse("onebit"), -1); /* not a parallel.grad_compression choice */
    tu_fill(x, N, 3, 5.0f);
    x[10] = 0.0f;
    x[11] = -0.0f;
    tu_fill(e, N, 11, 0.5f);
    e[10] = e[11] = 0.0f;
    memcpy(e0, e, sizeof e);
    memcpy(er, e, sizeof e);
    tera_compress_encode(TERA_COMPRESS_ONEBIT, x, N, buf, e);
    tera_compress_decode(TERA_COMPRESS_ONEBIT, buf, N, y);
    ref_q(x, er, N, d);
    assert_same("decoded vs specification", y, d, N);
    assert_same("residuals vs specification", e, er, N);
    for (int i = 0; i < N; i++) { /* residual = v - D exactly, |D| the block's mean magnitude */
        const float v = x[i] + e0[i];
        const float want = v - y[i];
        assert_true(memcmp(&want, &e[i], 4) == 0);
        assert_true((y[i] < 0.0f) == (v < 0.0f));
    }
    assert_true(y[10] > 0.0f && y[11] > 0.0f); /* 0 and -0 count as positive */
    float scale;
    memcpy(&scale, buf, 4);
    double mean = 0.0;
    for (int i = 0; i < TERA_ONEBIT_BLOCK; i++) mean += fabs((double)x[i] + e0[i]);
    mean /= TERA_ONEBIT_BLOCK;
    assert_true(fabs(scale - mean) <= 1e-5 * mean);
    /* decode_add adds */
    float z[N];
    for (int i = 0; i < N; i++) z[i] = 1.0f;
    tera_compress_decode_add(TERA_COMPRESS_ONEBIT, buf, N, z);
    for (int i = 0; i < N; i++) assert_true(z[i] == 1.0f + y[i]);
    /* a non-finite value: its block decodes to NaN (the step is skipped), the other blocks do not, and
     * the residuals stay finite */
    x[300] = NAN;
    memset(e, 0, sizeof e);
    tera_compress_encode(TERA_COMPRESS_ONEBIT, x, N, buf, e);
    tera_compress_decode(TERA_COMPRESS_ONEBIT, buf, N, y);
    assert_true(isnan(y[256]) && isnan(y[511]) && !isnan(y[255]) && !isnan(y[512]));
    for (int i = 0; i < N; i++) assert_true(isfinite(e[i]));
    /* an all-zero block: scale 0, decodes to zeros, residuals 0 */
    float zx[20] = {0}, ze[20] = {0}, zy[20];
    tera_compress_encode(TERA_COMPRESS_ONEBIT, zx, 20, buf, ze);
    tera_compress_decode(TERA_COMPRESS_ONEBIT, buf, 20, zy);
    for (int i = 0; i < 20; i++) assert_true(zy[i] == 0.0f && ze[i] == 0.0f);
}

/* ---- under mpirun */
#define CHECK(cond) TU_RANK_CHECK(me, cond)

static int me;
enum { NV = 1000, STEPS = 20, PMAX = 8 };

/* rank r's momentum at step t: a slowly moving mean plus rank noise, magnitudes 1e-3 .. 1e3 by range of
 * 128 elements (as tensors of different scales; every block lies in one range on 2, 4 and 8 ranks) */
static void momentum(int r, int t, float *g) {
    float base[NV];
    tu_fill(base, NV, 99, 1.0f);
    tu_fill(g, NV, (uint64_t)(1000 * r + t + 1), 0.5f);
    for (int i = 0; i < NV; i++)
        g[i] = (g[i] + base[i] * (1.0f + 0.02f * (float)t)) * powf(10.0f, (float)(i / 128 % 7) - 3.0f);
}

static int mpi_reference(int argc, char **argv) {
    CHECK(tera_comm_init(&argc, &argv) == TERA_OK);
    tera_comm *w = tera_comm_world();
    me = tera_comm_rank(w);
    const int p = tera_comm_size(w);
    CHECK(p <= PMAX);
    float *g = calloc((size_t)PMAX * NV, sizeof(float)), *e1 = calloc((size_t)PMAX * NV, sizeof(float));
    float *e2 = calloc(NV, sizeof(float)), *d = calloc((size_t)PMAX * NV, sizeof(float)), *want = calloc(NV, sizeof(float));
    float *buf = calloc(NV, sizeof(float)), *cum = calloc(NV, sizeof(float));
    double *cum_exact = calloc(NV, sizeof(double)), *cum_noef = calloc(NV, sizeof(double));
    float *z1 = calloc(NV, sizeof(float)), *dn = calloc(NV, sizeof(float)), *sn = calloc(NV, sizeof(float));
    int64_t lo[PMAX + 1], cnt[PMAX];
    const int64_t S = ((NV + p - 1) / p + 15) & ~(int64_t)15;
    for (int j = 0; j <= p; j++) lo[j] = (int64_t)j * S < NV ? (int64_t)j * S : NV;
    for (int j = 0; j < p; j++) cnt[j] = lo[j + 1] - lo[j];
    tera_creducer *cr = tera_creducer_create(w, TERA_COMPRESS_ONEBIT, NV);
    tera_creducer_set_mean(cr, 1);
    const float inv = 1.0f / (float)p;
    double step_abs = 0.0, step_rel = 0.0;
    double cum_err_at[STEPS], noef_err = 0.0;
    tera_comm_traffic_reset();
    for (int t = 0; t < STEPS; t++) {
        for (int r = 0; r < p; r++) momentum(r, t, g + (int64_t)r * NV);
        /* the specification, simulated for every rank */
        for (int r = 0; r < p; r++)
            for (int j = 0; j < p; j++)
                ref_q(g + (int64_t)r * NV + lo[j], e1 + (int64_t)r * NV + lo[j], cnt[j], d + (int64_t)r * NV + lo[j]);
        for (int i = 0; i < NV; i++) {
            float s = d[i];
            for (int r = 1; r < p; r++) s += d[(int64_t)r * NV + i];
            want[i] = s * inv;
        }
        for (int j = 0; j < p; j++) ref_q(want + lo[j], e2 + lo[j], cnt[j], want + lo[j]);
        /* the same without error feedback (residuals dropped every step), for comparison */
        memset(sn, 0, sizeof(float) * NV);
        for (int r = 0; r < p; r++)
            for (int j = 0; j < p; j++) {
                memset(z1, 0, sizeof(float) * NV);
                ref_q(g + (int64_t)r * NV + lo[j], z1, cnt[j], dn + lo[j]);
                for (int64_t i = lo[j]; i < lo[j + 1]; i++) sn[i] += dn[i];
            }
        for (int i = 0; i < NV; i++) sn[i] *= inv;
        for (int j = 0; j < p; j++) {
            memset(z1, 0, sizeof(float) * NV);
            ref_q(sn + lo[j], z1, cnt[j], sn + lo[j]);
        }
        /* the real thing */
        memcpy(buf, g + (int64_t)me * NV, sizeof(float) * NV);
        tera_creducer_allreduce(cr, buf, 0, NV);
        for (int i = 0; i < NV; i++)
            if (memcmp(&buf[i], &want[i], 4) != 0) {
                fprintf(stderr, "rank %d: step %d: element %d is %.9g, the specification says %.9g\n", me, t, i,
                        (double)buf[i], (double)want[i]);
                CHECK(0);
            }
        double en = 0.0, nn = 0.0, ce = 0.0;
        for (int i = 0; i < NV; i++) {
            double x = 0.0;
            for (int r = 0; r < p; r++) x += g[(int64_t)r * NV + i];
            x /= p;
            en += ((double)buf[i] - x) * ((double)buf[i] - x);
            nn += x * x;
            cum[i] += buf[i];
            cum_exact[i] += x;
            cum_noef[i] += sn[i];
            ce += ((double)cum[i] - cum_exact[i]) * ((double)cum[i] - cum_exact[i]);
        }
        if (t == STEPS - 1)
            for (int i = 0; i < NV; i++) noef_err += (cum_noef[i] - cum_exact[i]) * (cum_noef[i] - cum_exact[i]);
        step_abs += sqrt(en) / STEPS;
        step_rel += sqrt(en / nn) / STEPS;
        cum_err_at[t] = sqrt(ce);
    }
    /* the residual state equals the simulation's: this rank's worker side, and its own chunk's server side */
    int64_t ne;
    const float *s1 = tera_creducer_state(cr, 0, &ne);
    CHECK(ne == NV && memcmp(s1, e1 + (int64_t)me * NV, sizeof(float) * NV) == 0);
    const float *s2 = tera_creducer_state(cr, 1, &ne);
    CHECK(memcmp(s2 + lo[me], e2 + lo[me], sizeof(float) * (size_t)cnt[me]) == 0);
    /* error feedback: the running sum's error stays at a few steps' error instead of growing with the
     * steps: under a third of the error without it (20 steps of 1-bit errors, correlated by the slowly
     * moving mean, add up: measured 4 to 4.6 times the error with it) */
    if (me == 0)
        printf("onebit on %d ranks: error vs the fp32 mean per step %.3g (relative L2 %.3g), of the running sum "
               "after 5, 10, 20 steps %.3g %.3g %.3g (without error feedback after 20: %.3g)\n", p, step_abs, step_rel,
               cum_err_at[4], cum_err_at[9], cum_err_at[STEPS - 1], sqrt(noef_err));
    CHECK(cum_err_at[STEPS - 1] < 3.0 * step_abs);
    CHECK(cum_err_at[STEPS - 1] < sqrt(noef_err) / 3.0);
    CHECK(step_rel < 1.5);
    /* bytes: 2 (p-1)/p of the compressed size, as counted; at most 1/16 of an fp32 ring all-reduce */
    const tera_comm_traffic tr = tera_comm_traffic_get();
    double want_bytes = 0.0, tot = 0.0;
    for (int j = 0; j < p; j++) {
        if (j != me) want_bytes += (double)tera_compress_bytes(TERA_COMPRESS_ONEBIT, cnt[j]);
        tot += (double)tera_compress_bytes(TERA_COMPRESS_ONEBIT, cnt[j]);
    }
    want_bytes = STEPS * (want_bytes + (double)(p - 1) / p * tot);
    CHECK(fabs(tr.allreduce - want_bytes) <= 1e-9 * want_bytes);
    const double fp32 = 2.0 * (p - 1) / p * 4.0 * NV;
    if (me == 0) printf("  bytes per step %.0f (fp32 ring: %.0f, ratio %.4f)\n", tr.allreduce / STEPS, fp32, tr.allreduce / STEPS / fp32);
    CHECK(tr.allreduce / STEPS <= fp32 / 16.0);
    tera_creducer_free(cr);
    free(g), free(e1), free(e2), free(d), free(want), free(buf), free(cum), free(cum_exact);
    free(cum_noef), free(z1), free(dn), free(sn);
    tera_comm_finalize();
    if (me == 0) printf("1-bit all-reduce: reference ok on %d ranks\n", p);
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
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_format), cmocka_unit_test(test_mpi_reference)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
