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
#include <sys/wait.h>
#include <unistd.h>
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

/* ---- C tests that run themselves under mpirun (test_comm, test_compress, test_hier) */

/* On a rank: a failed check names the rank and the line, then aborts the job. */
#define TU_RANK_CHECK(rank, cond)                                                                      \
    do {                                                                                               \
        if (!(cond)) {                                                                                 \
            fprintf(stderr, "rank %d: %s:%d: check failed: %s\n", (rank), __FILE__, __LINE__, #cond);  \
            fflush(stderr);                                                                            \
            abort();                                                                                   \
        }                                                                                              \
    } while (0)

/* 1 when mpirun can be used (else a skip message is printed): sets the environment every launch
 * needs (root allowed, oversubscription, no leak report for Open MPI's own allocations). */
static inline int tu_mpirun_ready(void) {
    if (system("command -v mpirun > /dev/null 2>&1") != 0) {
        fprintf(stderr, "skip: mpirun not installed\n");
        return 0;
    }
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    const char *asan = getenv("ASAN_OPTIONS");
    char opts[1024];
    snprintf(opts, sizeof opts, "%s%sdetect_leaks=0", asan ? asan : "", asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1); /* Open MPI's own allocations (see tests/mpilib.sh) */
    return 1;
}

/* Runs this test program under mpirun on np ranks (env: "" or "K=V " prefixes) and asserts that the
 * job exits 0. */
static inline void tu_mpirun_self(int np, const char *env) {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    assert_true(n > 0);
    self[n] = 0;
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "%stimeout 300 mpirun --oversubscribe -np %d '%s'", env, np, self);
    const int rc = system(cmd);
    assert_true(WIFEXITED(rc));
    assert_int_equal(WEXITSTATUS(rc), 0);
}

#endif
