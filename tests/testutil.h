/* Helpers shared by the C tests (header-only). */
#ifndef TERA_TESTUTIL_H
#define TERA_TESTUTIL_H

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

/* Deterministic test data: xorshift-based uniform in [-a, a]. */
static inline void tu_fill(float *x, int64_t n, uint64_t seed, float a) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x[i] = a * (2.0f * (float)((s >> 40) & 0xFFFFFF) / 16777216.0f - 1.0f);
    }
}

/* Max relative error |a-b| / (atol + rtol*|b|) over n elements; > 1 means a mismatch. Prints the
 * worst element when it fails. */
static inline double tu_close(const char *what, const float *a, const float *b, int64_t n, double rtol,
                              double atol) {
    double worst = 0.0;
    int64_t wi = 0;
    for (int64_t i = 0; i < n; i++) {
        double r = fabs((double)a[i] - (double)b[i]) / (atol + rtol * fabs((double)b[i]));
        if (!(r <= worst)) worst = r, wi = i; /* NaN counts as worst */
    }
    if (!(worst <= 1.0))
        fprintf(stderr, "%s: mismatch at %ld: got %.8g want %.8g (ratio %.3g)\n", what, (long)wi,
                (double)a[wi], (double)b[wi], worst);
    return worst;
}

/* Fails the test unless a[0, n) and b[0, n) are bit-identical, naming the first element that differs. */
static inline void assert_same(const char *what, const float *a, const float *b, int64_t n) {
    if (n > 0 && memcmp(a, b, sizeof(float) * (size_t)n) != 0) {
        for (int64_t i = 0; i < n; i++)
            if (memcmp(a + i, b + i, sizeof(float)) != 0) {
                fprintf(stderr, "%s: differs at %ld: %.9g vs %.9g\n", what, (long)i, (double)a[i], (double)b[i]);
                break;
            }
        fail_msg("%s: not bit-identical", what);
    }
}

#endif
