/* Matrix products by shape (`tera bench --products`, include/tera/profile.h, src/obs/profile.c): the
 * CPU backend reports every fp32 and bf16 product while the table is on and none while it is off;
 * shapes, transposes, precision, calls, flops and the side-by-side flag are those of the calls; rows
 * come sorted by time; the kinds sum the rows dimension (M, or K for a transposed A); shapes beyond the
 * table go to the rest row; reset empties it. */
#include <omp.h>

#include "testutil.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/profile.h"

static tera_prof_product_row rows[TERA_PROF_PRODUCT_SHAPES];

/* The row of this shape, or NULL. */
static const tera_prof_product_row *find(int n, int prec, int ta, int tb, int64_t M, int64_t N, int64_t K, int side) {
    for (int i = 0; i < n; i++)
        if (rows[i].prec == prec && rows[i].ta == ta && rows[i].tb == tb && rows[i].M == M && rows[i].N == N &&
            rows[i].K == K && rows[i].side == side)
            return &rows[i];
    return NULL;
}

static void gemm(int ta, int tb, int64_t M, int64_t N, int64_t K) {
    float *a = calloc((size_t)(M * K), sizeof(float)), *b = calloc((size_t)(K * N), sizeof(float)),
          *c = calloc((size_t)(M * N), sizeof(float));
    tu_fill(a, M * K, 1, 1.0f), tu_fill(b, K * N, 2, 1.0f);
    tera_gemm(ta, tb, M, N, K, 1.0f, a, ta ? M : K, b, tb ? K : N, 0.0f, c, N);
    free(a), free(b), free(c);
}

static void off_records_nothing(void **state) {
    (void)state;
    tera_prof_products_reset();
    tera_prof_products_on = 0;
    gemm(0, 1, 16, 8, 4);
    tera_prof_product_row rest;
    assert_int_equal(tera_prof_products(rows, TERA_PROF_PRODUCT_SHAPES, &rest), 0);
    assert_int_equal(rest.calls, 0);
}

static void fp32_shapes_calls_flops(void **state) {
    (void)state;
    tera_prof_products_reset();
    tera_prof_products_on = 1;
    for (int r = 0; r < 3; r++) gemm(0, 1, 64, 32, 16);
    for (int r = 0; r < 2; r++) gemm(1, 0, 32, 16, 64);
    gemm(0, 0, 5, 0, 7); /* an empty product is not a product */
    tera_prof_products_on = 0;
    gemm(0, 1, 64, 32, 16); /* off again: not counted */
    const int n = tera_prof_products(rows, TERA_PROF_PRODUCT_SHAPES, NULL);
    assert_int_equal(n, 2);
    const tera_prof_product_row *a = find(n, TERA_PROF_PROD_FP32, 0, 1, 64, 32, 16, 0),
                                *b = find(n, TERA_PROF_PROD_FP32, 1, 0, 32, 16, 64, 0);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(a->calls, 3);
    assert_int_equal(b->calls, 2);
    assert_true(a->flops == 3 * 2.0 * 64 * 32 * 16);
    assert_true(b->flops == 2 * 2.0 * 32 * 16 * 64);
    assert_true(a->seconds > 0.0 && b->seconds > 0.0);
    assert_true(rows[0].seconds >= rows[1].seconds); /* sorted by time */
    /* one row asked for: the other goes to the rest */
    tera_prof_product_row rest;
    assert_int_equal(tera_prof_products(rows, 1, &rest), 1);
    assert_int_equal(rest.calls, rows[0].calls == 3 ? 2 : 3);
    double ws, wf, ss, sf;
    tera_prof_products_totals(&ws, &wf, &ss, &sf);
    assert_true(wf == 5 * 2.0 * 64 * 32 * 16);
    assert_true(ss == 0.0 && sf == 0.0);
}

/* Products inside a parallel region of more than one thread run side by side. */
static void side_by_side(void **state) {
    (void)state;
    tera_prof_products_reset();
    tera_prof_products_on = 1;
    int team = 1;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        team = omp_get_num_threads();
        gemm(0, 0, 24, 8, 8);
    }
    tera_prof_products_on = 0;
    const int n = tera_prof_products(rows, TERA_PROF_PRODUCT_SHAPES, NULL);
    assert_int_equal(n, 1);
    assert_int_equal(rows[0].side, team > 1);
    assert_int_equal(rows[0].calls, team);
    double ws, ss;
    tera_prof_products_totals(&ws, NULL, &ss, NULL);
    assert_true(team > 1 ? ss > 0.0 && ws == 0.0 : ws > 0.0 && ss == 0.0);
}

/* bf16 products on the native units are reported as bf16 (skipped where the CPU has none). */
static void bf16_products(void **state) {
    (void)state;
    tera_backend *be = tera_backend_cpu_create(-1);
    if (!be->caps.bf16_native(be)) {
        tera_backend_destroy(be);
        skip();
    }
    tera_backend_set_precision(be, TERA_PREC_BF16, TERA_BF16_NATIVE);
    tera_backend_reserve(be, 1 << 16, 0);
    const int64_t N = 32, in = 16, out = 8;
    float *x = calloc(N * in, sizeof(float)), *w = calloc(out * in, sizeof(float)), *y = calloc(N * out, sizeof(float));
    float *dy = calloc(N * out, sizeof(float)), *dx = calloc(N * in, sizeof(float)), *dw = calloc(out * in, sizeof(float));
    tu_fill(x, N * in, 3, 1.0f), tu_fill(w, out * in, 4, 1.0f), tu_fill(dy, N * out, 5, 1.0f);
    tera_prof_products_reset();
    tera_prof_products_on = 1;
    be->ops.linear_forward(be, y, x, w, N, in, out, 0.0f);
    be->ops.linear_backward(be, dx, dw, dy, x, w, N, in, out, 0.0f, 0.0f);
    tera_prof_products_on = 0;
    const int n = tera_prof_products(rows, TERA_PROF_PRODUCT_SHAPES, NULL);
    assert_int_equal(n, 3);
    assert_non_null(find(n, TERA_PROF_PROD_BF16, 0, 1, N, out, in, 0)); /* y = x w^T */
    assert_non_null(find(n, TERA_PROF_PROD_BF16, 0, 0, N, in, out, 0)); /* dx = dy w */
    assert_non_null(find(n, TERA_PROF_PROD_BF16, 1, 0, out, in, N, 0)); /* dw = dy^T x */
    free(x), free(w), free(y), free(dy), free(dx), free(dw);
    tera_backend_destroy(be);
}

/* Kinds: the shapes that differ only in their rows dimension are one kind, with the rows per call. */
static void kinds_sum_rows(void **state) {
    (void)state;
    tera_prof_products_reset();
    tera_prof_product(TERA_PROF_PROD_BF16, 0, 1, 100, 8, 4, 1, 0.003); /* y = x w^T of two experts */
    tera_prof_product(TERA_PROF_PROD_BF16, 0, 1, 300, 8, 4, 1, 0.001);
    tera_prof_product(TERA_PROF_PROD_BF16, 1, 0, 8, 4, 100, 1, 0.001); /* their weight gradients: K = rows */
    tera_prof_product(TERA_PROF_PROD_BF16, 1, 0, 8, 4, 400, 1, 0.001);
    tera_prof_product(TERA_PROF_PROD_BF16, 0, 1, 100, 8, 4, 0, 0.0005); /* whole: another kind */
    tera_prof_product_row k[8];
    const int nk = tera_prof_products_by_kind(k, 8);
    assert_int_equal(nk, 3);
    /* by time: the forward kind (4 ms), the weight-gradient kind (2 ms), the whole one */
    assert_int_equal(k[0].ta, 0);
    assert_int_equal(k[0].M, 200); /* (100 + 300) / 2 calls */
    assert_int_equal(k[0].calls, 2);
    assert_true(k[0].flops == 2.0 * 400 * 8 * 4);
    assert_int_equal(k[1].ta, 1);
    assert_int_equal(k[1].K, 250);
    assert_int_equal(k[1].M, 8);
    assert_int_equal(k[2].side, 0);
    assert_int_equal(k[2].M, 100);
    /* the table printed: both parts and the totals */
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    tera_prof_products_print(f, 2, 10);
    fclose(f);
    assert_non_null(strstr(buf, "by kind"));
    assert_non_null(strstr(buf, "by shape"));
    assert_non_null(strstr(buf, "side by side: 3.00 thread-ms/step"));
    free(buf);
}

/* Shapes beyond the table are summed into the rest row; reset empties everything. */
static void table_full(void **state) {
    (void)state;
    tera_prof_products_reset();
    const int extra = 6;
    for (int i = 0; i < TERA_PROF_PRODUCT_SHAPES + extra; i++) tera_prof_product(TERA_PROF_PROD_FP32, 0, 0, 1 + i, 2, 3, 0, 1e-6);
    tera_prof_product_row rest;
    assert_int_equal(tera_prof_products(rows, TERA_PROF_PRODUCT_SHAPES, &rest), TERA_PROF_PRODUCT_SHAPES);
    assert_int_equal(rest.calls, extra);
    assert_int_equal(tera_prof_products(rows, 10, &rest), 10);
    assert_int_equal(rest.calls, TERA_PROF_PRODUCT_SHAPES + extra - 10);
    tera_prof_products_reset();
    assert_int_equal(tera_prof_products(rows, 10, &rest), 0);
    assert_int_equal(rest.calls, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(off_records_nothing), cmocka_unit_test(fp32_shapes_calls_flops), cmocka_unit_test(side_by_side),
        cmocka_unit_test(bf16_products),       cmocka_unit_test(kinds_sum_rows),          cmocka_unit_test(table_full),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
