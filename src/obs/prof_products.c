/* Matrix products by kind and shape (`tera bench --products N`, include/tera/profile.h): a table the
 * backends fill while tera_prof_products_on is set, one row per distinct product shape, under a
 * mutex (a product is microseconds at least; the lock is not on any other path). Its own file so
 * that the CPU backend's products (src/kernels/cpu/matmul.c) need nothing else of the profile. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tera/profile.h"

volatile int tera_prof_products_on;
static tera_prof_product_row g_prod[TERA_PROF_PRODUCT_SHAPES];
static int g_nprod;
static tera_prof_product_row g_prod_rest; /* shapes beyond the table */
static pthread_mutex_t g_prod_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const g_prod_prec[] = {"fp32", "bf16"};

void tera_prof_product(int prec, int ta, int tb, int64_t M, int64_t N, int64_t K, int side, double seconds) {
    const double flops = 2.0 * (double)M * (double)N * (double)K;
    side = side != 0, ta = ta != 0, tb = tb != 0;
    pthread_mutex_lock(&g_prod_lock);
    tera_prof_product_row *r = NULL;
    for (int i = 0; i < g_nprod && !r; i++) {
        tera_prof_product_row *q = &g_prod[i];
        if (q->M == M && q->N == N && q->K == K && q->prec == prec && q->ta == ta && q->tb == tb && q->side == side)
            r = q;
    }
    if (!r && g_nprod < TERA_PROF_PRODUCT_SHAPES) {
        r = &g_prod[g_nprod++];
        *r = (tera_prof_product_row){.M = M, .N = N, .K = K, .prec = prec, .ta = ta, .tb = tb, .side = side};
    }
    if (!r) r = &g_prod_rest;
    r->calls++;
    r->seconds += seconds;
    r->flops += flops;
    pthread_mutex_unlock(&g_prod_lock);
}

void tera_prof_products_reset(void) {
    pthread_mutex_lock(&g_prod_lock);
    g_nprod = 0;
    memset(&g_prod_rest, 0, sizeof g_prod_rest);
    pthread_mutex_unlock(&g_prod_lock);
}

static int prod_by_time_desc(const void *a, const void *b) {
    const tera_prof_product_row *x = a, *y = b; /* ties: the shape, so that the order is the same every time */
    if (x->seconds != y->seconds) return (x->seconds < y->seconds) - (x->seconds > y->seconds);
    const int64_t kx[7] = {x->prec, x->ta, x->tb, x->side, x->M, x->N, x->K},
                  ky[7] = {y->prec, y->ta, y->tb, y->side, y->M, y->N, y->K};
    for (int i = 0; i < 7; i++)
        if (kx[i] != ky[i]) return (kx[i] > ky[i]) - (kx[i] < ky[i]);
    return 0;
}

static void prod_add(tera_prof_product_row *to, const tera_prof_product_row *r) {
    to->calls += r->calls;
    to->seconds += r->seconds;
    to->flops += r->flops;
}

int tera_prof_products(tera_prof_product_row *rows, int max, tera_prof_product_row *rest) {
    static tera_prof_product_row sorted[TERA_PROF_PRODUCT_SHAPES]; /* under the lock */
    pthread_mutex_lock(&g_prod_lock);
    const int n = g_nprod;
    memcpy(sorted, g_prod, sizeof(tera_prof_product_row) * (size_t)n);
    qsort(sorted, (size_t)n, sizeof *sorted, prod_by_time_desc);
    const int k = max < 0 ? 0 : max < n ? max : n;
    if (k > 0) memcpy(rows, sorted, sizeof(tera_prof_product_row) * (size_t)k);
    if (rest) {
        *rest = g_prod_rest;
        rest->M = rest->N = rest->K = 0;
        for (int i = k; i < n; i++) prod_add(rest, &sorted[i]);
    }
    pthread_mutex_unlock(&g_prod_lock);
    return k;
}

void tera_prof_products_totals(double *whole_s, double *whole_flops, double *side_s, double *side_flops) {
    double t[2] = {0.0, 0.0}, f[2] = {0.0, 0.0};
    pthread_mutex_lock(&g_prod_lock);
    for (int i = 0; i < g_nprod; i++) t[g_prod[i].side] += g_prod[i].seconds, f[g_prod[i].side] += g_prod[i].flops;
    pthread_mutex_unlock(&g_prod_lock);
    /* the rest row mixes both classes: it is left out of the totals (a table that overflows says so) */
    if (whole_s) *whole_s = t[0];
    if (whole_flops) *whole_flops = f[0];
    if (side_s) *side_s = t[1];
    if (side_flops) *side_flops = f[1];
}

/* The table's rows by kind: the rows dimension of a linear layer's product (M, or K when A is
 * transposed: a weight gradient's reduction) summed, the other two kept, so that the experts'
 * products, one shape per row count, read as one line each. M (or K) of a kind's row is its rows
 * per call on average. */
static int prod_kinds(tera_prof_product_row *kinds, const tera_prof_product_row *rows, int n) {
    int nk = 0;
    for (int i = 0; i < n; i++) {
        const tera_prof_product_row *r = &rows[i];
        tera_prof_product_row *k = NULL;
        for (int j = 0; j < nk && !k; j++) {
            tera_prof_product_row *q = &kinds[j];
            if (q->prec == r->prec && q->ta == r->ta && q->tb == r->tb && q->side == r->side && q->N == r->N &&
                (r->ta ? q->M == r->M : q->K == r->K))
                k = q;
        }
        if (!k) {
            k = &kinds[nk++];
            *k = *r;
            k->calls = 0, k->seconds = 0.0, k->flops = 0.0;
            if (r->ta) k->K = 0; else k->M = 0; /* the rows, summed below */
        }
        if (r->ta) k->K += r->K * r->calls; else k->M += r->M * r->calls;
        prod_add(k, r);
    }
    for (int j = 0; j < nk; j++) { /* rows per call */
        tera_prof_product_row *k = &kinds[j];
        if (k->ta) k->K = (k->K + k->calls / 2) / k->calls; else k->M = (k->M + k->calls / 2) / k->calls;
    }
    qsort(kinds, (size_t)nk, sizeof *kinds, prod_by_time_desc);
    return nk;
}

int tera_prof_products_by_kind(tera_prof_product_row *kinds, int max) {
    static tera_prof_product_row rows[TERA_PROF_PRODUCT_SHAPES], all[TERA_PROF_PRODUCT_SHAPES];
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* the two static arrays */
    pthread_mutex_lock(&lock);
    const int n = tera_prof_products(rows, TERA_PROF_PRODUCT_SHAPES, NULL);
    const int nk = prod_kinds(all, rows, n), k = max < 0 ? 0 : max < nk ? max : nk;
    if (k > 0) memcpy(kinds, all, sizeof(tera_prof_product_row) * (size_t)k);
    pthread_mutex_unlock(&lock);
    return k;
}

static void prod_line(FILE *f, const tera_prof_product_row *r, int steps, double all) {
    fprintf(f, "  %-4s %2d %2d %7lld %7lld %7lld %5s %10.2f %10.3f %9.1f %5.1f%%\n", g_prod_prec[r->prec & 1], r->ta, r->tb,
            (long long)r->M, (long long)r->N, (long long)r->K, r->side ? "side" : "whole", (double)r->calls / steps,
            1e3 * r->seconds / steps, r->seconds > 0 ? r->flops / r->seconds * 1e-9 : 0.0,
            all > 0 ? 100.0 * r->seconds / all : 0.0);
}

void tera_prof_products_print(FILE *f, int steps, int top) {
    static tera_prof_product_row rows[TERA_PROF_PRODUCT_SHAPES], kinds[TERA_PROF_PRODUCT_SHAPES];
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* the two static arrays */
    pthread_mutex_lock(&lock);
    tera_prof_product_row rest;
    if (steps < 1) steps = 1;
    if (top > TERA_PROF_PRODUCT_SHAPES) top = TERA_PROF_PRODUCT_SHAPES;
    const int nk = tera_prof_products_by_kind(kinds, TERA_PROF_PRODUCT_SHAPES);
    const int n = tera_prof_products(rows, top, &rest);
    double ws, wf, ss, sf;
    tera_prof_products_totals(&ws, &wf, &ss, &sf);
    pthread_mutex_lock(&g_prod_lock);
    const tera_prof_product_row over = g_prod_rest; /* shapes beyond the table */
    pthread_mutex_unlock(&g_prod_lock);
    const double all = ws + ss + over.seconds;
    fprintf(f, "matrix products (%d steps; C[M,N] = op(A)[M,K] op(B)[K,N]; whole: on every thread; side: on one thread "
               "beside others, ms and GFLOP/s per thread)\n", steps);
    fprintf(f, "  by kind (the rows dimension, M or for ta 1 K, summed: its column is the rows per call):\n");
    fprintf(f, "  %-4s %2s %2s %7s %7s %7s %5s %10s %10s %9s %6s\n", "prec", "ta", "tb", "M", "N", "K", "run",
            "calls/step", "ms/step", "GFLOP/s", "share");
    for (int i = 0; i < nk && i < top; i++) prod_line(f, &kinds[i], steps, all);
    if (nk > top) fprintf(f, "  (%d kinds more)\n", nk - top);
    fprintf(f, "  by shape:\n");
    for (int i = 0; i < n; i++) prod_line(f, &rows[i], steps, all);
    if (rest.calls)
        fprintf(f, "  %-38s %10.2f %10.3f %9.1f %5.1f%%\n", over.calls ? "the other shapes (table full: mixed)"
                                                                         : "the other shapes",
                (double)rest.calls / steps, 1e3 * rest.seconds / steps,
                rest.seconds > 0 ? rest.flops / rest.seconds * 1e-9 : 0.0, all > 0 ? 100.0 * rest.seconds / all : 0.0);
    fprintf(f, "  whole: %.2f ms/step at %.1f GFLOP/s; side by side: %.2f thread-ms/step at %.1f GFLOP/s per thread\n",
            1e3 * ws / steps, ws > 0 ? wf / ws * 1e-9 : 0.0, 1e3 * ss / steps, ss > 0 ? sf / ss * 1e-9 : 0.0);
    pthread_mutex_unlock(&lock);
}
