/* fp32 matrix products give the same bits on 1, 2 and 3 threads, and inside a parallel region (one
 * thread, as the experts run side by side) as outside it on every thread, under oneDNN's AVX2 and
 * AVX-512 kernels (src/kernels/cpu/matmul.c, "Deterministic tiles"); and they are the right
 * products (against a double reference), with padded leading dimensions and beta 0 and 1.
 * oneDNN's own sgemm threading fails this under AVX2 for most of these shapes (even K = 8) and under
 * AVX-512 for the long reductions (NT 64x256x1024 at 2 threads). Each ISA runs in a child process
 * that caps oneDNN's ISA before its first call; the last two shapes are cut into several tiles by
 * default, and a run with small tiles cuts every shape. Weight gradients large enough for the
 * primitive pieces ("Weight gradients in primitive pieces") are checked the same way, plus two at
 * once in a region and across processes that create their primitives on 1 and on 3 threads. */
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include "testutil.h"
#include "kernels/cpu/cpu.h"
#include "tera/kernels.h"

typedef struct {
    int64_t M, N, K;
} shape;

/* the tiny test model's products (tokens 128, widths 32 / 64, vocabulary 256), shapes measured to
 * differ across threads with oneDNN's threading, odd sizes, and a single row */
static const shape SHAPES[] = {{128, 32, 32},  {128, 256, 32}, {64, 128, 16}, {96, 96, 8},   {128, 64, 128},
                               {200, 72, 300}, {256, 256, 96}, {64, 256, 1024}, {16, 1040, 1024}, {1, 64, 64},
                               {7, 5, 3},      {520, 272, 256}, {200, 1040, 160}};
#define NSHAPES (sizeof SHAPES / sizeof SHAPES[0])

/* weight gradients (TN) that run in primitive pieces with AVX-512 kernels (matmul.c, "Weight
 * gradients in primitive pieces"): blocks of 256 rows (the last shorter or not), a reduction of one
 * chunk of 512 and a rest or none; B and C dense (the pieces need them), A padded or not, beta 0 and 1 */
static const shape PIECE_SHAPES[] = {{1024, 512, 512}, {1030, 512, 530}};
#define NPIECE_SHAPES (sizeof PIECE_SHAPES / sizeof PIECE_SHAPES[0])

typedef struct {
    int ta, tb;
    int64_t M, N, K, lda, ldb, ldc;
    float beta;
    float *A, *B, *C0; /* C0: C before the product */
} product;

/* dense: B and C unpadded, A padded on odd seeds */
static void product_init_ld(product *p, shape s, int ta, int tb, uint64_t seed, int dense) {
    *p = (product){.ta = ta, .tb = tb, .M = s.M, .N = s.N, .K = s.K, .beta = (seed & 1) ? 1.0f : 0.0f};
    p->lda = (ta ? s.M : s.K) + (dense ? (int64_t)(seed & 1) * 3 : 3); /* padded: the tiles' offsets must use the strides */
    p->ldb = (tb ? s.K : s.N) + (dense ? 0 : 1);
    p->ldc = s.N + (dense ? 0 : 5);
    const int64_t na = (ta ? s.K : s.M) * p->lda, nb = (tb ? s.N : s.K) * p->ldb, nc = s.M * p->ldc;
    p->A = malloc(sizeof(float) * (size_t)na);
    p->B = malloc(sizeof(float) * (size_t)nb);
    p->C0 = malloc(sizeof(float) * (size_t)nc);
    tu_fill(p->A, na, seed, 1.0f);
    tu_fill(p->B, nb, seed + 100, 1.0f);
    tu_fill(p->C0, nc, seed + 200, 1.0f);
}

static void product_init(product *p, shape s, int ta, int tb, uint64_t seed) { product_init_ld(p, s, ta, tb, seed, 0); }

static void product_free(product *p) {
    free(p->A);
    free(p->B);
    free(p->C0);
}

/* C = C0, then the product into it (tera_gemm, or oneDNN's own sgemm when raw) */
static void product_run(const product *p, float *C, int raw) {
    memcpy(C, p->C0, sizeof(float) * (size_t)(p->M * p->ldc));
    if (raw)
        dnnl_sgemm(p->ta ? 'T' : 'N', p->tb ? 'T' : 'N', p->M, p->N, p->K, 1.0f, p->A, p->lda, p->B, p->ldb, p->beta, C,
                   p->ldc);
    else
        tera_gemm(p->ta, p->tb, p->M, p->N, p->K, 1.0f, p->A, p->lda, p->B, p->ldb, p->beta, C, p->ldc);
}

/* 0 when C is the product within fp32 rounding of the double reference, and the padding untouched:
 * every column of every step-th row and the last (tiles are at least 16 rows, pieces 256 but the
 * last: with a step of 5, or 23 for the piece shapes, each tile and piece is seen) */
static int product_check(const product *p, const float *C, int64_t step) {
    for (int64_t i = 0; i < p->M; i = (i + step < p->M || i == p->M - 1) ? i + step : p->M - 1) {
        for (int64_t j = 0; j < p->N; j++) {
            double s = 0.0, mag = 0.0;
            for (int64_t k = 0; k < p->K; k++) {
                const double a = p->ta ? p->A[k * p->lda + i] : p->A[i * p->lda + k];
                const double b = p->tb ? p->B[j * p->ldb + k] : p->B[k * p->ldb + j];
                s += a * b;
                mag += fabs(a * b);
            }
            s += p->beta * p->C0[i * p->ldc + j];
            mag += fabs(p->C0[i * p->ldc + j]);
            if (fabs(C[i * p->ldc + j] - s) > 1e-6 * (double)(p->K + 1) * mag + 1e-30) return 1;
        }
        for (int64_t j = p->N; j < p->ldc; j++)
            if (memcmp(&C[i * p->ldc + j], &p->C0[i * p->ldc + j], sizeof(float))) return 1;
    }
    return 0;
}

/* The thread count of a piece shape's first product (its primitives are created then), and a digest
 * of the piece shapes' TN products (the pieces' numbers): children that create them at different
 * thread counts must agree. */
static int g_first_threads = 3;
static uint64_t g_digest = 1469598103934665603ULL;

/* Every shape and transpose under the current ISA cap: failures counted (the child's exit code). */
static int run_all(const char *isa) {
    int fails = 0, raw_differ = 0, n = 0;
    for (size_t si = 0; si < NSHAPES + 2 * NPIECE_SHAPES; si++) {
        for (int tt = 0; tt < 4; tt++) {
            if (si >= NSHAPES && tt != 2) continue; /* piece shapes: TN only (the others take the tiles) */
            product p;
            if (si < NSHAPES)
                product_init(&p, SHAPES[si], tt >> 1, tt & 1, 7 * si + tt);
            else /* each piece shape twice: beta 0 and 1 */
                product_init_ld(&p, PIECE_SHAPES[(si - NSHAPES) % NPIECE_SHAPES], tt >> 1, tt & 1,
                                7 * si + tt + (si - NSHAPES) / NPIECE_SHAPES, 1);
            const size_t bytes = sizeof(float) * (size_t)(p.M * p.ldc);
            float *ref = malloc(bytes), *c = malloc(bytes), *side = malloc(bytes), *raw1 = malloc(bytes);
            if (si >= NSHAPES) { /* a piece shape's first product on g_first_threads threads */
                omp_set_num_threads(g_first_threads);
                product_run(&p, side, 0);
            }
            omp_set_num_threads(1);
            product_run(&p, ref, 0);
            if (si >= NSHAPES && memcmp(side, ref, bytes)) {
                fprintf(stderr, "%s: %c%c %ldx%ldx%ld: %d threads (first call) differ from 1\n", isa, p.ta ? 'T' : 'N',
                        p.tb ? 'T' : 'N', (long)p.M, (long)p.N, (long)p.K, g_first_threads);
                fails++;
            }
            if (si >= NSHAPES && p.ta && !p.tb) {
                const unsigned char *b = (const unsigned char *)ref;
                for (size_t i = 0; i < bytes; i++) g_digest = (g_digest ^ b[i]) * 1099511628211ULL;
            }
            product_run(&p, raw1, 1);
            if (product_check(&p, ref, si < NSHAPES ? 5 : 23)) { /* piece shapes: 11+ rows of each 256-row block */
                fprintf(stderr, "%s: %c%c %ldx%ldx%ld: wrong product\n", isa, p.ta ? 'T' : 'N', p.tb ? 'T' : 'N',
                        (long)p.M, (long)p.N, (long)p.K);
                fails++;
            }
            for (int t = 2; t <= 3; t++) {
                omp_set_num_threads(t);
                product_run(&p, c, 0);
                if (memcmp(c, ref, bytes)) {
                    fprintf(stderr, "%s: %c%c %ldx%ldx%ld: %d threads differ from 1\n", isa, p.ta ? 'T' : 'N',
                            p.tb ? 'T' : 'N', (long)p.M, (long)p.N, (long)p.K, t);
                    fails++;
                }
                product_run(&p, c, 1);
                raw_differ += memcmp(c, raw1, bytes) != 0;
            }
            /* one thread of a 2-thread region runs the product, the other waits (the experts' way); a
             * piece shape's product runs on both threads at once (the same cached primitives side by side) */
            omp_set_num_threads(2);
#pragma omp parallel num_threads(2)
            {
                if (omp_get_thread_num() == 0) product_run(&p, side, 0);
                if (omp_get_thread_num() == 1 && si >= NSHAPES) product_run(&p, c, 0);
            }
            if (si >= NSHAPES && memcmp(c, ref, bytes)) {
                fprintf(stderr, "%s: %c%c %ldx%ldx%ld: two at once inside a parallel region differ\n", isa,
                        p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', (long)p.M, (long)p.N, (long)p.K);
                fails++;
            }
            if (memcmp(side, ref, bytes)) {
                fprintf(stderr, "%s: %c%c %ldx%ldx%ld: inside a parallel region differs\n", isa, p.ta ? 'T' : 'N',
                        p.tb ? 'T' : 'N', (long)p.M, (long)p.N, (long)p.K);
                fails++;
            }
            n++;
            free(ref);
            free(c);
            free(side);
            free(raw1);
            product_free(&p);
        }
    }
    /* the piece shapes' TN products ran in pieces wherever oneDNN has AVX-512 kernels (2 betas x (the
     * first call, the 1-thread reference, 2 and 3 threads, inside a region twice) each), and never
     * under AVX2 */
    const int avx512 = (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
    const int64_t taken = tera_cpu_gemm_pieces_taken();
    printf("%s: %lld products ran in primitive pieces\n", isa, (long long)taken);
    if (avx512 ? taken < (int64_t)(2 * NPIECE_SHAPES * 5) : taken != 0) {
        fprintf(stderr, "%s: %lld products in pieces, expected %s\n", isa, (long long)taken,
                avx512 ? "every piece shape's TN product" : "none");
        fails++;
    }
    /* not asserted (a later oneDNN may fix it): shows what the tiles are for */
    printf("%s: %d products; oneDNN's own threading differs from 1 thread in %d of %d (2 and 3 threads)\n", isa, n,
           raw_differ, 2 * n);
    return fails;
}

/* Padded operands (matmul.c): under AVX2 kernels an NN tile (reduction <= 2048) whose B rows, or a TN
 * tile whose A or B rows, lie a multiple of 64 floats apart runs on padded copies; the numbers are
 * those without the copies, bit for bit, and the right product. Dense model-like operands (leading
 * dimensions 64 .. 512), every transpose, beta 0 and 1, whole and (small tiles) in many tiles, on 1
 * and 2 threads; NT and TT never copy, nor does an NN product with a longer reduction. */
static const shape PAD_SHAPES[] = {{256, 256, 64}, {128, 512, 256}, {100, 256, 70}, {320, 128, 192}, {64, 64, 2112}};
#define NPAD_SHAPES (sizeof PAD_SHAPES / sizeof PAD_SHAPES[0])

static int run_padded(const char *isa) {
    const int avx512 = (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
    int fails = 0;
    int64_t copied = 0;
    for (size_t si = 0; si < NPAD_SHAPES; si++)
        for (int tt = 0; tt < 4; tt++)
            for (int beta = 0; beta < 2; beta++) {
                product p;
                product_init_ld(&p, PAD_SHAPES[si], tt >> 1, tt & 1, 2 * (7 * si + tt), 1); /* dense */
                p.beta = (float)beta;
                const int bad_a = p.lda % 64 == 0, bad_b = p.ldb % 64 == 0;
                const int want_a = !avx512 && !p.tb && p.ta && bad_a; /* NN: B only */
                const int want_b = !avx512 && !p.tb && bad_b && (p.ta || p.K <= 2048);
                const size_t bytes = sizeof(float) * (size_t)(p.M * p.ldc);
                float *on = malloc(bytes), *off = malloc(bytes);
                for (int t = 1; t <= 2; t++) {
                    omp_set_num_threads(t);
                    tera_cpu_gemm_pad(0);
                    const int64_t a0 = tera_cpu_gemm_padded_taken(0), b0 = tera_cpu_gemm_padded_taken(1);
                    product_run(&p, off, 0);
                    const int64_t a1 = tera_cpu_gemm_padded_taken(0), b1 = tera_cpu_gemm_padded_taken(1);
                    tera_cpu_gemm_pad(1);
                    product_run(&p, on, 0);
                    const int64_t ta = tera_cpu_gemm_padded_taken(0) - a1, tb = tera_cpu_gemm_padded_taken(1) - b1;
                    copied += ta + tb;
                    const char *why = a1 != a0 || b1 != b0        ? "copies made while off"
                                      : (ta > 0) != want_a        ? (want_a ? "no padded copy of A" : "a padded copy of A")
                                      : (tb > 0) != want_b        ? (want_b ? "no padded copy of B" : "a padded copy of B")
                                      : memcmp(on, off, bytes)    ? "padded copies change the numbers"
                                      : product_check(&p, on, 5)  ? "wrong product"
                                                                  : NULL;
                    if (why) {
                        fprintf(stderr, "%s: %c%c %ldx%ldx%ld (lda %ld, ldb %ld, beta %d, %d threads): %s\n", isa,
                                p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', (long)p.M, (long)p.N, (long)p.K, (long)p.lda,
                                (long)p.ldb, beta, t, why);
                        fails++;
                    }
                }
                free(on);
                free(off);
                product_free(&p);
            }
    printf("%s: %lld padded copies of operand blocks\n", isa, (long long)copied);
    return fails;
}

/* The copies' cap (matmul.c's PAD_MAX_FLOATS, 4 Mi floats a thread): a TN tile whose copies of A and B
 * would not fit runs on the arrays as they are: no copy, the same bits as with the copies off, the
 * right product. K = 2^18 puts even a 16-row tile's copies (2 x K x 16 floats) over the cap; the same
 * operands with K = 4096 are copied, so it is the cap that stops them. Under AVX-512 kernels nothing
 * is copied either way. */
static int run_pad_cap(const char *isa) {
    const int avx512 = (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
    static const shape caps[2] = {{64, 64, 4096}, {64, 64, 262144}};
    int fails = 0;
    omp_set_num_threads(1);
    for (int i = 0; i < 2; i++) {
        product p;
        product_init_ld(&p, caps[i], 1, 0, 2 * (40 + i), 1); /* TN, lda = ldb = 64: rows 256 bytes apart */
        const size_t bytes = sizeof(float) * (size_t)(p.M * p.ldc);
        float *on = malloc(bytes), *off = malloc(bytes);
        tera_cpu_gemm_pad(0);
        product_run(&p, off, 0);
        tera_cpu_gemm_pad(1);
        const int64_t a0 = tera_cpu_gemm_padded_taken(0), b0 = tera_cpu_gemm_padded_taken(1);
        product_run(&p, on, 0);
        const int64_t ta = tera_cpu_gemm_padded_taken(0) - a0, tb = tera_cpu_gemm_padded_taken(1) - b0;
        const int want = !avx512 && i == 0;
        const char *why = (ta > 0) != want || (tb > 0) != want ? (want ? "no padded copies" : "copies over the cap")
                          : memcmp(on, off, bytes)             ? "the cap changes the numbers"
                          : product_check(&p, on, 63)          ? "wrong product"
                                                               : NULL;
        printf("%s: TN 64x64x%ld: %lld + %lld padded copies\n", isa, (long)p.K, (long long)ta, (long long)tb);
        if (why) {
            fprintf(stderr, "%s: TN 64x64x%ld: %s\n", isa, (long)p.K, why);
            fails++;
        }
        free(on);
        free(off);
        product_free(&p);
    }
    return fails;
}

/* tile_macs: TERA_GEMM_TILE_MACS for the child (NULL: the default tiles, which leave the smaller
 * shapes whole; a small value cuts every shape into many tiles, checking the tiles' offsets) */
/* first_threads: g_first_threads for the child; returns the child's g_digest */
static uint64_t under_isa_run(dnnl_cpu_isa_t isa, const char *name, const char *tile_macs, int first_threads,
                              int (*run)(const char *)) {
    fflush(stdout);
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    const pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fd[0]);
        if (tile_macs) setenv("TERA_GEMM_TILE_MACS", tile_macs, 1); /* read at the first product */
        /* before any other oneDNN call in this process; a CPU without the ISA runs the best it has */
        if (dnnl_set_max_cpu_isa(isa) != dnnl_success) _exit(100);
        g_first_threads = first_threads;
        const int fails = run(name);
        fflush(stdout);
        if (write(fd[1], &g_digest, sizeof g_digest) != (ssize_t)sizeof g_digest) _exit(101);
        _exit(fails > 99 ? 99 : fails);
    }
    close(fd[1]);
    uint64_t digest = 0;
    const ssize_t got = read(fd[0], &digest, sizeof digest);
    close(fd[0]);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_int_equal(got, (ssize_t)sizeof digest);
    return digest;
}

static uint64_t under_isa(dnnl_cpu_isa_t isa, const char *name, const char *tile_macs, int first_threads) {
    return under_isa_run(isa, name, tile_macs, first_threads, run_all);
}

static void test_padded(void **state) {
    (void)state;
    under_isa_run(dnnl_cpu_isa_avx2, "AVX2, padded operands", NULL, 1, run_padded);
    under_isa_run(dnnl_cpu_isa_avx2, "AVX2, padded operands, small tiles", "4096", 1, run_padded);
    under_isa_run(dnnl_cpu_isa_avx512_core, "AVX512_CORE, padded operands", NULL, 1, run_padded);
    under_isa_run(dnnl_cpu_isa_avx2, "AVX2, the copies' cap", NULL, 1, run_pad_cap);
    under_isa_run(dnnl_cpu_isa_avx512_core, "AVX512_CORE, the copies' cap", NULL, 1, run_pad_cap);
}

static void test_avx2(void **state) {
    (void)state;
    under_isa(dnnl_cpu_isa_avx2, "AVX2", NULL, 3);
    under_isa(dnnl_cpu_isa_avx2, "AVX2, small tiles", "4096", 1);
}

static void test_avx512(void **state) {
    (void)state;
    /* the pieces' primitives created on 3 threads in one process and on 1 in the other: same numbers
     * (the tiles' size does not touch the pieces) */
    const uint64_t d3 = under_isa(dnnl_cpu_isa_avx512_core, "AVX512_CORE", NULL, 3);
    const uint64_t d1 = under_isa(dnnl_cpu_isa_avx512_core, "AVX512_CORE, small tiles", "4096", 1);
    assert_true(d3 == d1);
}

static void test_all(void **state) {
    (void)state;
    under_isa(dnnl_cpu_isa_all, "default ISA", NULL, 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_avx2), cmocka_unit_test(test_avx512),
                                       cmocka_unit_test(test_padded), cmocka_unit_test(test_all)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
