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

#include "tera/config.h"
#include "tera/model.h"

/* A float's bit pattern and back (bit-for-bit comparisons, special values by their bits). */
static inline uint32_t tu_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float tu_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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

/* A hand-built model of np tensors of the given lengths (for optimizer tests): the table p[np]
 * (every second tensor decayed), w in [-0.5, 0.5] from seed and g in [-0.01, 0.01] from seed + 1
 * (malloc'd: the caller frees m->w, m->g), on backend be. */
static inline void tu_fake_model(tera_model *m, tera_param *p, const int64_t *sizes, int np, tera_backend *be,
                                 uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->be = be;
    memset(p, 0, sizeof(tera_param) * (size_t)np);
    int64_t off = 0;
    for (int i = 0; i < np; i++) {
        p[i].numel = sizes[i];
        p[i].offset = off;
        p[i].decay = i % 2;
        off += sizes[i];
    }
    m->params = p;
    m->n_params = np;
    m->n_floats = off;
    m->w = malloc(sizeof(float) * (size_t)off);
    m->g = malloc(sizeof(float) * (size_t)off);
    tu_fill(m->w, off, seed, 0.5f);
    tu_fill(m->g, off, seed + 1, 0.01f);
}

/* A tiny MoE for training tests (D 32, 2 layers of which the first dense, 4 heads over 2 kv heads, 4
 * experts of width 48 and one shared expert, T 32, 4 steps with one of warm-up, no progress lines):
 * the defaults with those set, not finalized (the caller sets its own keys, then finalizes). */
static inline tera_config tu_tiny_moe_config(int micro_batch, int grad_accum) {
    tera_config c;
    tera_config_defaults(&c);
    c.model.dim = 32;
    c.model.n_layers = 2;
    c.model.n_heads = 4;
    c.model.n_kv_heads = 2;
    c.model.n_experts = 4;
    c.model.ffn_dim = 48;
    c.model.max_seq_len = 32;
    c.model.n_shared_experts = 1;
    c.model.first_k_dense = 1;
    c.training.seq_len = 32;
    c.training.micro_batch = micro_batch;
    c.training.grad_accum = grad_accum;
    c.training.steps = 4;
    c.training.warmup_steps = 1;
    c.logging.progress = 0;
    return c;
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
