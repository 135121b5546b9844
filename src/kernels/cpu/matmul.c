/* Matrix products through oneDNN (AVX-512 / AMX dispatch is oneDNN's).
 *
 * fp32 products are dnnl_sgemm calls. Their results do not depend on the thread count: oneDNN's
 * own threading does not give that (its sgemm splits and blocks the reduction by the thread count;
 * "Deterministic tiles" below), so tera cuts each fp32 sgemm that needs it (all under AVX2 kernels,
 * long reductions under AVX-512) into tiles of C chosen from the shape alone and runs every tile as
 * a single-threaded product. oneDNN's matmul primitive (faster than oneDNN's multi-threaded sgemm
 * on the LM head's shapes: TN 16384x512x2048 272 vs 110 GFLOP/s on two threads) serves the large
 * bf16 products; fp32 ones take it whole only with TERA_GEMM_TILES=0 (fp32_primitive_ok), and
 * large fp32 weight gradients as single-threaded pieces fixed by the shape ("Weight gradients in
 * primitive pieces").
 * The linear layers can run in bf16 or (emulated) fp16, the precision of the CPU backend's context
 * (tera_cpu_matmul, cpu.h; include/tera/backend.h) passed to every call: "Mixed precision" below. */
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu.h"
#include "tera/bf16.h"
#include "tera/kernels.h"
#include "tera/precision.h"
#include "tera/profile.h"
#include "tera/status.h"

static int g_threads = 0;

void tera_set_threads(int n) {
    if (n <= 0) n = omp_get_num_procs();
    g_threads = n;
    omp_set_num_threads(n);
}

int tera_get_threads(void) { return g_threads > 0 ? g_threads : omp_get_max_threads(); }

#define DNNL_CHECK(call)                                                                           \
    do {                                                                                           \
        dnnl_status_t _st = (call);                                                                \
        TERA_ASSERTF(_st == dnnl_success, "oneDNN call failed (status %d): %s", (int)_st, #call);   \
    } while (0)

#if DNNL_VERSION_MAJOR == 2
static dnnl_engine_t g_engine;
static dnnl_stream_t g_stream;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void engine_init(void) {
    DNNL_CHECK(dnnl_engine_create(&g_engine, dnnl_cpu, 0));
    DNNL_CHECK(dnnl_stream_create(&g_stream, g_engine, dnnl_stream_default_flags));
}

/* Primitives are created once per distinct product (shape, transposes, strides, beta) and kept
 * with their memory objects; a call only points the memory objects at its arrays, so the step loop
 * allocates nothing. A model has a few dozen distinct products. Only the calling thread that is
 * outside any parallel region uses this path, so the cache needs no lock. */
typedef struct {
    dnnl_data_type_t dt;             /* operand type: f32, or bf16 (the output is always f32) */
    int ta, tb;
    int64_t M, N, K, lda, ldb, ldc;
    int accumulate;                  /* beta != 0 (beta is 0 or 1 in tera) */
    float beta;
    dnnl_primitive_t prim;
    dnnl_memory_t a, b, c;
} prim_entry;

#define PRIM_CACHE 128
static prim_entry g_cache[PRIM_CACHE];
static int g_cached = 0;

static prim_entry *prim_get(dnnl_data_type_t dt, int ta, int tb, int64_t M, int64_t N, int64_t K, int64_t lda,
                            int64_t ldb, float beta, int64_t ldc) {
    for (int i = 0; i < g_cached; i++) {
        prim_entry *e = &g_cache[i];
        if (e->dt == dt && e->ta == ta && e->tb == tb && e->M == M && e->N == N && e->K == K && e->lda == lda && e->ldb == ldb &&
            e->ldc == ldc && e->beta == beta)
            return e;
    }
    if (g_cached == PRIM_CACHE) return NULL; /* full: the caller falls back to sgemm */
    prim_entry *e = &g_cache[g_cached];
    *e = (prim_entry){.dt = dt, .ta = ta, .tb = tb, .M = M, .N = N, .K = K, .lda = lda, .ldb = ldb, .ldc = ldc, .beta = beta};
    dnnl_memory_desc_t ad, bd, cd;
    dnnl_dims_t adims = {M, K}, bdims = {K, N}, cdims = {M, N};
    dnnl_dims_t as = {ta ? 1 : lda, ta ? lda : 1}, bs = {tb ? 1 : ldb, tb ? ldb : 1}, cs = {ldc, 1};
    DNNL_CHECK(dnnl_memory_desc_init_by_strides(&ad, 2, adims, dt, as));
    DNNL_CHECK(dnnl_memory_desc_init_by_strides(&bd, 2, bdims, dt, bs));
    DNNL_CHECK(dnnl_memory_desc_init_by_strides(&cd, 2, cdims, dnnl_f32, cs));
    dnnl_matmul_desc_t md;
    DNNL_CHECK(dnnl_matmul_desc_init(&md, &ad, &bd, NULL, &cd));
    dnnl_primitive_attr_t attr;
    DNNL_CHECK(dnnl_primitive_attr_create(&attr));
    if (beta != 0.0f) {
        dnnl_post_ops_t po;
        DNNL_CHECK(dnnl_post_ops_create(&po));
        DNNL_CHECK(dnnl_post_ops_append_sum(po, beta));
        DNNL_CHECK(dnnl_primitive_attr_set_post_ops(attr, po));
        dnnl_post_ops_destroy(po);
    }
    dnnl_primitive_desc_t pd;
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &md, attr, g_engine, NULL));
    DNNL_CHECK(dnnl_primitive_create(&e->prim, pd));
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    DNNL_CHECK(dnnl_memory_create(&e->a, &ad, g_engine, DNNL_MEMORY_NONE));
    DNNL_CHECK(dnnl_memory_create(&e->b, &bd, g_engine, DNNL_MEMORY_NONE));
    DNNL_CHECK(dnnl_memory_create(&e->c, &cd, g_engine, DNNL_MEMORY_NONE));
    g_cached++;
    return e;
}

/* C[M,N] = op(A) op(B) + beta C with a cached matmul primitive (A, B of type dt, C f32); returns 0
 * if the cache is full. */
static int matmul_primitive(dnnl_data_type_t dt, int ta, int tb, int64_t M, int64_t N, int64_t K, const void *A,
                            int64_t lda, const void *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    pthread_once(&g_once, engine_init);
    prim_entry *e = prim_get(dt, ta, tb, M, N, K, lda, ldb, beta, ldc);
    if (!e) return 0;
    DNNL_CHECK(dnnl_memory_set_data_handle(e->a, (void *)A));
    DNNL_CHECK(dnnl_memory_set_data_handle(e->b, (void *)B));
    DNNL_CHECK(dnnl_memory_set_data_handle(e->c, C));
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, e->a}, {DNNL_ARG_WEIGHTS, e->b}, {DNNL_ARG_DST, e->c}};
    DNNL_CHECK(dnnl_primitive_execute(e->prim, g_stream, 3, args));
    DNNL_CHECK(dnnl_stream_wait(g_stream));
    return 1;
}
#define HAVE_MATMUL_PRIMITIVE 1
#else
#define HAVE_MATMUL_PRIMITIVE 0
#endif

/* Products of at least this many multiply-adds use the matmul primitive: below it the primitive was
 * measured no faster than sgemm (bench-s/bench-m A/B with TERA_GEMM=sgemm). */
static int64_t g_primitive_min_macs = 1LL << 30; /* TERA_GEMM_PRIMITIVE_MIN overrides (A/B timing) */

/* TERA_GEMM_TILES=0 restores oneDNN's own threading of fp32 products (results that depend on the
 * thread count; for A/B timing only). Read once. */
static int g_tiles = 1;
static int g_pieces = 1; /* weight gradients in primitive pieces ("Weight gradients in primitive pieces") */
static int g_pad = 1;    /* AVX2 kernels: tiles on padded copies of their operands ("Padded operands") */
static int64_t g_pieces_taken = 0; /* products run in pieces (tests) */
static int64_t g_tile_macs = 0; /* a tile's target work: 0 the default (tile_plan); TERA_GEMM_TILE_MACS overrides (tuning) */
static int64_t g_tile_min = 128;        /* pieces of a dimension are at least this long, but for the last
                                         * (TERA_GEMM_TILE_MIN overrides) */
static pthread_once_t g_tiles_once = PTHREAD_ONCE_INIT;
static void tiles_init(void) {
    const char *e = getenv("TERA_GEMM_TILES");
    g_tiles = !(e && strcmp(e, "0") == 0);
    const char *m = getenv("TERA_GEMM_TILE_MACS"), *l = getenv("TERA_GEMM_TILE_MIN");
    if (m && atoll(m) > 0) g_tile_macs = atoll(m);
    if (l && atoll(l) > 0) g_tile_min = atoll(l);
    const char *p = getenv("TERA_GEMM_PIECES");
    if (p && strcmp(p, "0") == 0) g_pieces = 0;
    const char *pd = getenv("TERA_GEMM_PAD");
    if (pd && strcmp(pd, "0") == 0) g_pad = 0;
}

#if HAVE_MATMUL_PRIMITIVE
static int use_primitive(void) {
    static int use = -1; /* TERA_GEMM=sgemm forces sgemm everywhere (for A/B timing) */
    if (use < 0) {
        const char *e = getenv("TERA_GEMM");
        const char *mn = getenv("TERA_GEMM_PRIMITIVE_MIN");
        if (mn) g_primitive_min_macs = atoll(mn);
        use = !(e && strcmp(e, "sgemm") == 0);
    }
    return use;
}

/* Whether fp32 products may use the matmul primitive: only with TERA_GEMM_TILES=0 (oneDNN's own
 * threading, the behaviour before the tiles; A/B timing). With the tiles (the default) every fp32
 * product is sgemm, whole or in tiles: the primitive's numbers were measured to depend on the thread
 * count with A transposed and a long reduction (it splits K: TN 256x64x4096 and 32x32x65536 differ
 * at 2 threads; the LM head's weight gradient is such a product), were the same for NN/NT at 1-8
 * threads only as measured, not by construction, and differ from sgemm's: a product of 2^30
 * multiply-adds took the primitive outside parallel regions and sgemm inside them, so bench-m's
 * collapsed experts (2048 x 1024 x 512) gave other numbers on 2 threads (side by side) than on 1.
 * Measured without it, quiet machine: bench-s and bench-m steps no slower (docs/PERFORMANCE.md,
 * "Wave 6"). */
static int fp32_primitive_ok(void) { return !g_tiles; }
#endif

/* ------------------------------------------------------------------ deterministic tiles */

/* oneDNN's sgemm gives numbers that depend on its thread count: it partitions C (and for some
 * shapes the reduction) by the threads, and blocks K by the size of each thread's part. Measured
 * with oneDNN 2.6, 1 thread against 2-8: under ONEDNN_MAX_CPU_ISA=AVX2 most shapes differ (even
 * K = 8); with AVX-512 kernels NT products with K >= 896 differ at 2 threads and most shapes with
 * K = 384 at 8. So tera cuts those fp32 sgemms (tiles_needed) into tiles of C that depend on
 * (M, N, K) alone and runs each tile as a single-threaded sgemm: side by side outside parallel
 * regions, one after another inside them (attention tiles, experts run side by side). The
 * numbers are then the same
 * on any thread count, and the same whether a product runs alone on every thread or on one thread
 * beside others. A product whose C is too small to cut (M and N both below twice the least piece)
 * runs on one thread, however long its reduction. fp32 products no longer take the matmul
 * primitive whole (fp32_primitive_ok), so a product has the same numbers inside and outside parallel
 * regions at any size; large weight gradients take it in single-threaded pieces (below), chosen by
 * the shape as the tiles are. */
#define TILE_MAX 16                     /* tiles per product at most (each tile packs its own operands) */
#define TILE_K_AVX512 384               /* with AVX-512 kernels, only reductions this long are cut (below) */
#define TILE_ALIGN 16                   /* piece lengths are multiples of this (a 64-byte line of C's row) */

typedef struct {
    char ta, tb;
    int64_t M, N, K, lda, ldb, ldc;
    int64_t tm, tn, gn; /* tile extents, tiles along N */
    float alpha, beta;
    const float *A, *B;
    float *C;
    int pad_a, pad_b;   /* run each tile on copies of op(A)'s / op(B)'s block with padded rows ("Padded operands") */
} gemm_tiles;

static int64_t tile_extent(int64_t len, int64_t pieces) {
    int64_t t = (len + pieces - 1) / pieces;
    t = (t + TILE_ALIGN - 1) / TILE_ALIGN * TILE_ALIGN;
    return t < len ? t : len;
}

/* The tiles of C[M, N] for a reduction of K: as many as g_tile_macs of work each (at most TILE_MAX),
 * cutting whichever dimension has the longer pieces first; with A transposed and B not (TN: the
 * weight gradients) only M when it can be cut (tiles of whole rows of C: fewer, so fewer packings
 * of the long operands): one thread, quiet machine, bench-m 512x512x2048 151 against 131 GFLOP/s
 * for the 4 x 4 grid, 512x1024x2048 142 against 121. Fewer tiles also means fewer threads busy on
 * many-core machines (512 rows: 4 tiles). The grid of the previous tree with TERA_GEMM_PIECES=0
 * (A/B timing). */
static void tile_plan(gemm_tiles *g) {
    /* 2^28 multiply-adds a tile, at least 2 tiles from 2^26: one thread runs a product's tiles one after
     * another (inside parallel regions: the experts side by side) 3-10% slower than one whole sgemm
     * with 2^24 (9-16 tiles), within 1% with 1-4 (bench-m's expert and attention products); 2^24
     * without the floor with TERA_GEMM_PIECES=0 (the previous tree) */
    const int64_t macs = g_tile_macs ? g_tile_macs : g_pieces ? 1LL << 28 : 1LL << 24, mnk = g->M * g->N * g->K;
    int64_t want = mnk / macs;
    if (!g_tile_macs && g_pieces && want < 2 && mnk >= (1LL << 26)) want = 2;
    if (want > TILE_MAX) want = TILE_MAX;
    const int64_t mmax = g->M / g_tile_min > 1 ? g->M / g_tile_min : 1;
    int64_t nmax = g->N / g_tile_min > 1 ? g->N / g_tile_min : 1;
    if (g_pieces && g->ta == 'T' && g->tb == 'N' && mmax > 1) nmax = 1; /* TN: whole rows of C */
    int64_t gm = 1, gn = 1;
    while (gm * gn < want) {
        const int can_m = gm < mmax, can_n = gn < nmax;
        if (!can_m && !can_n) break;
        if (can_m && (!can_n || g->M * gn >= g->N * gm))
            gm++;
        else
            gn++;
    }
    g->tm = tile_extent(g->M, gm);
    g->tn = tile_extent(g->N, gn);
    g->gn = (g->N + g->tn - 1) / g->tn;
}

/* ------------------------------------------------------------------ padded operands (AVX2 kernels)
 *
 * Under AVX2 kernels (no avx512_core) oneDNN's sgemm slows down when an operand's rows lie a multiple
 * of 256 bytes apart, as the model's do (dim, ffn_dim, vocab_size and the token count are powers of
 * two): the rows of its packing fall into the same cache sets. Measured on one thread of an AMD EPYC
 * (Zen 3, AVX2 only; 93-99 GFLOP/s is that core's sgemm on padded operands): TN 4096x256x2048 (the
 * LM head's weight gradient in bench-s) 39.6 GFLOP/s on the model's arrays, 89.8 on copies whose rows
 * are 16 floats longer; TN 256x512x512 62.4 -> 93.5, TN 512x256x512 66.7 -> 95.4, NN 512x512x256
 * 67.8 -> 98.5, NN 2048x256x4096 68.1 -> 92.9; NT products lost nothing (90-95 either way). So under
 * AVX2 kernels an NN or TN tile whose A or B has such rows (PAD_BAD_LD) runs on copies of its blocks
 * of op(A) and op(B) with padded rows (pad_ld), one buffer per thread. The copies hold the same values
 * and oneDNN's blocking depends on the product's shape, not on the leading dimensions: the results
 * are the same bits as without them (every shape tried, tests/test_gemm_threads.c). A tile whose
 * copies would take more than PAD_MAX_FLOATS runs on the arrays as they are. TERA_GEMM_PAD=0 (or
 * tera_cpu_gemm_pad(0)) turns the copies off (A/B timing); with AVX-512 kernels they are never made. */
#define PAD_BAD_LD 64                   /* floats: rows this many floats (256 bytes) apart, or a multiple */
#define PAD_MAX_FLOATS ((int64_t)1 << 22) /* 16 MiB of copies per thread at most */
#define PAD_NN_K_MAX 2048               /* NN products with longer reductions (the LM head's input gradient) gained nothing */
#define PAD_THREADS 1024

static int64_t g_padded_taken[2] = {0, 0}; /* tiles run on a padded copy of op(A), of op(B) (tests) */
static _Thread_local float *t_pad; /* this thread's copies, PAD_MAX_FLOATS; also listed in g_pad_bufs */
static float *g_pad_bufs[PAD_THREADS];
static int g_npad_bufs = 0;
static pthread_mutex_t g_pad_lock = PTHREAD_MUTEX_INITIALIZER;

static int ld_bad(int64_t ld) { return ld % PAD_BAD_LD == 0; }

/* a padded leading dimension for rows of `len` floats: a multiple of 16 (64-byte rows), not of PAD_BAD_LD */
static int64_t pad_ld(int64_t len) {
    int64_t ld = (len + 15) / 16 * 16;
    return ld_bad(ld) ? ld + 16 : ld;
}

static float *pad_buf(void) {
    if (!t_pad) {
        t_pad = tera_malloc(sizeof(float) * (size_t)PAD_MAX_FLOATS);
        pthread_mutex_lock(&g_pad_lock);
        if (g_npad_bufs < PAD_THREADS) g_pad_bufs[g_npad_bufs++] = t_pad;
        pthread_mutex_unlock(&g_pad_lock);
    }
    return t_pad;
}

/* rows x cols of src (leading dimension lds) into dst (ldd) */
static void copy_block(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) memcpy(dst + r * ldd, src + r * lds, sizeof(float) * (size_t)cols);
}

/* The stored shape of op(X)'s block for a tile: op(A) rows m of K (A stored [m, K], or [K, m] when
 * transposed); op(B) columns n of K (B stored [K, n], or [n, K] when transposed). */
static void block_shape(char trans, int64_t outer, int64_t K, int is_b, int64_t *rows, int64_t *cols) {
    const int k_rows = is_b ? trans == 'N' : trans == 'T';
    *rows = k_rows ? K : outer;
    *cols = k_rows ? outer : K;
}

static int64_t pad_floats(const gemm_tiles *g, int64_t m, int64_t n) {
    int64_t r, c, need = 0;
    if (g->pad_a) block_shape(g->ta, m, g->K, 0, &r, &c), need += r * pad_ld(c);
    if (g->pad_b) block_shape(g->tb, n, g->K, 1, &r, &c), need += r * pad_ld(c);
    return need;
}

/* Whether the tiles of g run on padded copies: AVX2 kernels, NN or TN, an operand with rows PAD_BAD_LD
 * apart, and the largest tile's copies within PAD_MAX_FLOATS (all decided by the shape and the ISA). */
static void pad_plan(gemm_tiles *g) {
    g->pad_a = g->pad_b = 0;
    const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    if (!g_pad || g->tb != 'N' || (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core) return;
    g->pad_a = g->ta == 'T' && ld_bad(g->lda); /* NN: A's copy gained nothing on the shapes measured */
    g->pad_b = ld_bad(g->ldb) && (g->ta == 'T' || g->K <= PAD_NN_K_MAX);
    if (pad_floats(g, g->tm, g->tn) > PAD_MAX_FLOATS) g->pad_a = g->pad_b = 0;
}

static void tile_run(const gemm_tiles *g, int64_t t) {
    const int64_t i = t / g->gn * g->tm, j = t % g->gn * g->tn;
    const int64_t m = g->M - i < g->tm ? g->M - i : g->tm, n = g->N - j < g->tn ? g->N - j : g->tn;
    const float *a = g->ta == 'T' ? g->A + i : g->A + i * g->lda; /* op(A) rows i.. */
    const float *b = g->tb == 'T' ? g->B + j * g->ldb : g->B + j; /* op(B) columns j.. */
    int64_t lda = g->lda, ldb = g->ldb;
    if (g->pad_a || g->pad_b) {
        float *buf = pad_buf();
        int64_t r, c;
        if (g->pad_a) {
            block_shape(g->ta, m, g->K, 0, &r, &c);
            copy_block(buf, pad_ld(c), a, lda, r, c);
            a = buf, lda = pad_ld(c), buf += r * lda;
            __atomic_add_fetch(&g_padded_taken[0], 1, __ATOMIC_RELAXED);
        }
        if (g->pad_b) {
            block_shape(g->tb, n, g->K, 1, &r, &c);
            copy_block(buf, pad_ld(c), b, ldb, r, c);
            b = buf, ldb = pad_ld(c);
            __atomic_add_fetch(&g_padded_taken[1], 1, __ATOMIC_RELAXED);
        }
    }
    DNNL_CHECK(dnnl_sgemm(g->ta, g->tb, m, n, g->K, g->alpha, a, lda, b, ldb, g->beta, g->C + i * g->ldc + j, g->ldc));
}

int64_t tera_cpu_gemm_padded_taken(int operand) { return __atomic_load_n(&g_padded_taken[operand != 0], __ATOMIC_RELAXED); }

/* Whether a product needs the tiles: always under AVX2 kernels; with AVX-512 kernels only for
 * reductions of TILE_K_AVX512 or more: shorter ones were measured to give the same numbers on 1 to 8
 * threads (every shape of the sweep above with K <= 256 at up to 8 threads, K <= 768 at up to 4),
 * and whole products keep AVX-512's speed and its previous numbers. */
static int tiles_needed(int64_t K) {
    const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    return K >= TILE_K_AVX512 || (isa & dnnl_cpu_isa_avx512_core) != dnnl_cpu_isa_avx512_core;
}

/* C[M,N] = alpha op(A) op(B) + beta C as deterministic tiles (M, N, K > 0). */
static void sgemm_tiled(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                        const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    gemm_tiles g = {.ta = ta ? 'T' : 'N', .tb = tb ? 'T' : 'N', .M = M, .N = N, .K = K, .lda = lda, .ldb = ldb,
                    .ldc = ldc, .alpha = alpha, .beta = beta, .A = A, .B = B, .C = C};
    tile_plan(&g);
    pad_plan(&g);
    const int64_t nt = (M + g.tm - 1) / g.tm * g.gn;
    if (omp_in_parallel()) { /* oneDNN runs single-threaded inside a parallel region */
        for (int64_t t = 0; t < nt; t++) tile_run(&g, t);
        return;
    }
    const int threads = omp_get_max_threads();
    if (nt == 1 || threads == 1) { /* one thread for oneDNN too, whatever it would choose */
        omp_set_num_threads(1);
        for (int64_t t = 0; t < nt; t++) tile_run(&g, t);
        omp_set_num_threads(threads);
        return;
    }
    /* an active region (at least 2 threads): every tile's sgemm runs on its own thread */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads < nt ? threads : (int)nt)
    for (int64_t t = 0; t < nt; t++) tile_run(&g, t);
}

/* ------------------------------------------------------------------ weight gradients in primitive pieces */

/* A weight gradient C[M,N] += A[K,M]^T B[K,N] (TN, K the tokens) is where oneDNN's sgemm is slowest:
 * with A transposed and M > N it packs A slowly (TN 16384x512x2048: 55-85 GFLOP/s on one thread,
 * the deterministic tiles no better) while oneDNN's matmul primitive (brgemm kernels) runs it at
 * 110-140 (bench/bench_gemm.c). The primitive is only deterministic on one thread (on several it
 * splits K by the thread count), and it takes its brgemm kernels only for dense operands (a tile of
 * C with A transposed is not). So such a product runs as pieces fixed by (M, N, K) alone: C cut
 * into blocks of PIECE_M rows (the last shorter), each block's reduction cut into chunks of PIECE_K
 * and the rest. A chunk copies its PIECE_K x m block of A into a dense array (each thread its own)
 * and is one single-threaded primitive call of the fixed shape m x N x PIECE_K, accumulated into C
 * one chunk after another (the first with the product's beta, the next with beta 1); the rest
 * (K mod PIECE_K rows) is a single-threaded sgemm. Blocks run side by side outside parallel regions
 * and one after another inside them: the numbers depend on (M, N, K) alone, on any thread count.
 * Taken for alpha 1, beta 0 or 1, K >= PIECE_K, at least two blocks and C of PIECE_MIN_MN
 * elements or more, when every piece's primitive gets oneDNN's brgemm kernels (AVX-512 and up; never
 * under AVX2): all decided by the shape and the ISA; else the product takes the tiles. Only a few
 * shapes of primitive exist per model (a chunk's reduction is fixed, whatever the experts' row counts).
 * TERA_GEMM_PIECES=0 turns them off, and the TN tiles' rows-first plan (tile_plan) with them: the
 * previous tree's fp32 products, for A/B timing (other numbers). */
#define PIECE_M 256
#define PIECE_K 512
#define PIECE_CACHE 256 /* primitive shapes; a model has a few (2 per (M, N) of its weight gradients, x 2 betas) */
#define PIECE_MIN_MN (1 << 19) /* smaller C (512 x 512, 512 x 256) measured no faster in pieces than in tiles */

#if HAVE_MATMUL_PRIMITIVE
typedef struct {
    int64_t m, N, ldb, ldc; /* the key: TN m x N x PIECE_K, A dense (lda = m) */
    int accumulate;         /* beta 1 (a sum post-op) or 0 */
    int brgemm;             /* the primitive got oneDNN's brgemm kernels (else it is not used) */
    dnnl_primitive_t prim;
    dnnl_memory_desc_t ad, bd, cd, sd; /* operands and scratchpad (user-managed: one per thread) */
    size_t scratch_bytes;
} piece_prim;

static piece_prim g_piece[PIECE_CACHE];
static int g_npiece = 0;
static pthread_mutex_t g_piece_lock = PTHREAD_MUTEX_INITIALIZER;

/* What each thread executes the pieces with: its stream, its memory objects per cached primitive,
 * its scratchpad and its dense copy of A's block (grown once, kept for the process; each thread's
 * is also listed in g_piece_thread, so that a worker thread that exits leaves no unreachable memory). */
typedef struct {
    dnnl_stream_t stream;
    dnnl_memory_t mem[PIECE_CACHE][4]; /* a, b, c, scratchpad */
    void *scratch;
    size_t scratch_bytes;
    float *abuf;
} piece_thread;
#define PIECE_THREADS 1024
static _Thread_local piece_thread *t_piece;
static piece_thread *g_piece_thread[PIECE_THREADS];
static int g_npiece_thread = 0;

static piece_thread *piece_thread_get(void) {
    if (!t_piece) {
        t_piece = tera_calloc(1, sizeof(piece_thread));
        pthread_mutex_lock(&g_piece_lock);
        if (g_npiece_thread < PIECE_THREADS) g_piece_thread[g_npiece_thread++] = t_piece;
        pthread_mutex_unlock(&g_piece_lock);
    }
    return t_piece;
}

/* The cached primitive of one piece shape (created on first use, single-threaded: oneDNN plans a
 * primitive for the thread count it is created with). A full cache is an error, not a fallback: which
 * shapes found room would depend on the order threads reach them, and with it the numbers. */
static piece_prim *piece_get(int64_t m, int64_t N, int64_t ldb, int64_t ldc, int accumulate) {
    pthread_once(&g_once, engine_init);
    pthread_mutex_lock(&g_piece_lock);
    piece_prim *e = NULL;
    for (int i = 0; i < g_npiece && !e; i++)
        if (g_piece[i].m == m && g_piece[i].N == N && g_piece[i].ldb == ldb && g_piece[i].ldc == ldc &&
            g_piece[i].accumulate == accumulate)
            e = &g_piece[i];
    TERA_ASSERTF(e || g_npiece < PIECE_CACHE, "fp32 product pieces: more than %d primitive shapes (TN %lld x %lld)",
                 PIECE_CACHE, (long long)m, (long long)N);
    if (!e) {
        e = &g_piece[g_npiece];
        *e = (piece_prim){.m = m, .N = N, .ldb = ldb, .ldc = ldc, .accumulate = accumulate};
        dnnl_dims_t adims = {m, PIECE_K}, bdims = {PIECE_K, N}, cdims = {m, N};
        dnnl_dims_t as = {1, m}, bs = {ldb, 1}, cs = {ldc, 1}; /* A^T: the copy is [PIECE_K, m] */
        DNNL_CHECK(dnnl_memory_desc_init_by_strides(&e->ad, 2, adims, dnnl_f32, as));
        DNNL_CHECK(dnnl_memory_desc_init_by_strides(&e->bd, 2, bdims, dnnl_f32, bs));
        DNNL_CHECK(dnnl_memory_desc_init_by_strides(&e->cd, 2, cdims, dnnl_f32, cs));
        dnnl_matmul_desc_t md;
        DNNL_CHECK(dnnl_matmul_desc_init(&md, &e->ad, &e->bd, NULL, &e->cd));
        dnnl_primitive_attr_t attr;
        DNNL_CHECK(dnnl_primitive_attr_create(&attr));
        DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user));
        if (accumulate) {
            dnnl_post_ops_t po;
            DNNL_CHECK(dnnl_post_ops_create(&po));
            DNNL_CHECK(dnnl_post_ops_append_sum(po, 1.0f));
            DNNL_CHECK(dnnl_primitive_attr_set_post_ops(attr, po));
            dnnl_post_ops_destroy(po);
        }
        const int threads = omp_get_max_threads();
        omp_set_num_threads(1);
        dnnl_primitive_desc_t pd;
        DNNL_CHECK(dnnl_primitive_desc_create(&pd, &md, attr, g_engine, NULL));
        const char *impl = "";
        DNNL_CHECK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl));
        e->brgemm = strncmp(impl, "brg", 3) == 0;
        if (e->brgemm) {
            e->sd = *dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
            e->scratch_bytes = dnnl_memory_desc_get_size(&e->sd);
            DNNL_CHECK(dnnl_primitive_create(&e->prim, pd));
        }
        omp_set_num_threads(threads);
        dnnl_primitive_desc_destroy(pd);
        dnnl_primitive_attr_destroy(attr);
        g_npiece++;
    }
    pthread_mutex_unlock(&g_piece_lock);
    return e;
}

/* One chunk on the calling thread: C[m,N] = beta C + a[PIECE_K,m]^T b[PIECE_K,N] (a dense). */
static void piece_run(piece_prim *e, const float *a, const float *b, float *c) {
    piece_thread *t = piece_thread_get();
    const int i = (int)(e - g_piece);
    if (!t->stream) DNNL_CHECK(dnnl_stream_create(&t->stream, g_engine, dnnl_stream_default_flags));
    if (!t->mem[i][0]) {
        DNNL_CHECK(dnnl_memory_create(&t->mem[i][0], &e->ad, g_engine, DNNL_MEMORY_NONE));
        DNNL_CHECK(dnnl_memory_create(&t->mem[i][1], &e->bd, g_engine, DNNL_MEMORY_NONE));
        DNNL_CHECK(dnnl_memory_create(&t->mem[i][2], &e->cd, g_engine, DNNL_MEMORY_NONE));
        if (e->scratch_bytes) DNNL_CHECK(dnnl_memory_create(&t->mem[i][3], &e->sd, g_engine, DNNL_MEMORY_NONE));
    }
    if (e->scratch_bytes > t->scratch_bytes) {
        free(t->scratch);
        t->scratch = tera_malloc(e->scratch_bytes);
        t->scratch_bytes = e->scratch_bytes;
    }
    DNNL_CHECK(dnnl_memory_set_data_handle(t->mem[i][0], (void *)a));
    DNNL_CHECK(dnnl_memory_set_data_handle(t->mem[i][1], (void *)b));
    DNNL_CHECK(dnnl_memory_set_data_handle(t->mem[i][2], c));
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, t->mem[i][0]}, {DNNL_ARG_WEIGHTS, t->mem[i][1]}, {DNNL_ARG_DST, t->mem[i][2]},
                               {DNNL_ARG_SCRATCHPAD, t->mem[i][3]}};
    if (e->scratch_bytes) DNNL_CHECK(dnnl_memory_set_data_handle(t->mem[i][3], t->scratch));
    DNNL_CHECK(dnnl_primitive_execute(e->prim, t->stream, e->scratch_bytes ? 4 : 3, args));
    DNNL_CHECK(dnnl_stream_wait(t->stream));
}

typedef struct {
    int64_t M, N, K, lda, ldb, ldc;
    float beta;
    const float *A, *B;
    float *C;
    piece_prim *p[2][2]; /* [last block][accumulate] */
} gemm_pieces;

/* Block b of C (rows b PIECE_M ..): its chunks in order, then the rest of the reduction. */
static void pieces_block(const gemm_pieces *g, int64_t b) {
    const int64_t i0 = b * PIECE_M, m = g->M - i0 < PIECE_M ? g->M - i0 : PIECE_M, last = m != PIECE_M;
    piece_thread *t = piece_thread_get();
    if (!t->abuf) t->abuf = tera_malloc(sizeof(float) * PIECE_M * PIECE_K);
    float *c = g->C + i0 * g->ldc;
    int64_t k0 = 0;
    for (; k0 + PIECE_K <= g->K; k0 += PIECE_K) {
        for (int64_t k = 0; k < PIECE_K; k++) memcpy(t->abuf + k * m, g->A + (k0 + k) * g->lda + i0, sizeof(float) * (size_t)m);
        const int acc = k0 > 0 || g->beta != 0.0f;
        piece_run(g->p[last][acc], t->abuf, g->B + k0 * g->ldb, c);
    }
    if (k0 < g->K)
        DNNL_CHECK(dnnl_sgemm('T', 'N', m, g->N, g->K - k0, 1.0f, g->A + k0 * g->lda + i0, g->lda, g->B + k0 * g->ldb, g->ldb,
                              1.0f, c, g->ldc));
}

/* C[M,N] = A[K,M]^T B[K,N] + beta C in pieces when they apply (see above); 0 when not (nothing done). */
static int gemm_pieces_tn(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                          int64_t ldb, float beta, float *C, int64_t ldc) {
    if (!g_pieces || alpha != 1.0f || (beta != 0.0f && beta != 1.0f) || K < PIECE_K || M < 2 * PIECE_M ||
        M * N < PIECE_MIN_MN)
        return 0;
    gemm_pieces g = {.M = M, .N = N, .K = K, .lda = lda, .ldb = ldb, .ldc = ldc, .beta = beta, .A = A, .B = B, .C = C};
    const int64_t mlast = M % PIECE_M;
    for (int last = 0; last < 2; last++)
        for (int acc = 0; acc < 2; acc++) {
            if (last && !mlast) continue;
            g.p[last][acc] = piece_get(last ? mlast : PIECE_M, N, ldb, ldc, acc);
            if (!g.p[last][acc]->brgemm) return 0;
        }
    __atomic_add_fetch(&g_pieces_taken, 1, __ATOMIC_RELAXED);
    const int64_t nb = (M + PIECE_M - 1) / PIECE_M;
    const int threads = omp_get_max_threads();
    if (omp_in_parallel() || threads == 1) {
        omp_set_num_threads(1); /* the rest's sgemm on this thread */
        for (int64_t b = 0; b < nb; b++) pieces_block(&g, b);
        omp_set_num_threads(threads);
        return 1;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads < nb ? threads : (int)nb)
    for (int64_t b = 0; b < nb; b++) pieces_block(&g, b);
    return 1;
}
#endif

int64_t tera_cpu_gemm_pieces_taken(void) { return __atomic_load_n(&g_pieces_taken, __ATOMIC_RELAXED); }

void tera_cpu_gemm_pieces(int on) {
    pthread_once(&g_tiles_once, tiles_init);
    g_pieces = on;
}

void tera_cpu_gemm_pad(int on) {
    pthread_once(&g_tiles_once, tiles_init);
    g_pad = on;
}

static void gemm_fp32(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                      int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (K == 0) {
        /* oneDNN rejects K = 0; the product is empty, so C = beta * C */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
        return;
    }
    pthread_once(&g_tiles_once, tiles_init);
#if HAVE_MATMUL_PRIMITIVE
    if (use_primitive() && alpha == 1.0f && M * N * K >= g_primitive_min_macs && !omp_in_parallel() &&
        fp32_primitive_ok() && matmul_primitive(dnnl_f32, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc))
        return;
#endif
#if HAVE_MATMUL_PRIMITIVE
    if (g_tiles && trans_a && !trans_b && tiles_needed(K) &&
        gemm_pieces_tn(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc))
        return;
#endif
    if (g_tiles && tiles_needed(K))
        sgemm_tiled(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    else
        DNNL_CHECK(dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc));
}

void tera_gemm(int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
               int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M == 0 || N == 0) return;
    /* `tera bench --products`: every fp32 product by shape (include/tera/profile.h) */
    TERA_PROF_PRODUCT(TERA_PROF_PROD_FP32, trans_a, trans_b, M, N, K, omp_in_parallel(),
                      gemm_fp32(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc));
}

/* ------------------------------------------------------------------ mixed precision */

/* oneDNN's bf16 GEMM: exported by libdnnl (DNNL_API in its src/cpu/gemm/gemm.hpp) but not declared in
 * the public headers of 2.x. Row-major like dnnl_sgemm; A and B are bf16 bit patterns, C is f32. */
dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N, dnnl_dim_t K,
                                    float alpha, const uint16_t *A, dnnl_dim_t lda, const uint16_t *B,
                                    dnnl_dim_t ldb, float beta, float *C, dnnl_dim_t ldc);

/* 1 when the low-precision operands are rounded into fp32 arrays and multiplied by the fp32 kernels
 * (fp16 always; bf16 with the fma engine), 0 when they are bf16 arrays for oneDNN's bf16 kernels. */
static int lowp_in_fp32(const tera_cpu_matmul *mm) {
    return mm->prec == TERA_PREC_FP16 || (mm->prec == TERA_PREC_BF16 && mm->bf16_gemm == TERA_BF16_FMA);
}

const char *tera_precision_name(tera_precision p) {
    return p == TERA_PREC_BF16 ? "bf16" : p == TERA_PREC_FP16 ? "fp16" : "fp32";
}

int tera_cpu_bf16_fast(const char **isa_name) {
    const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    const char *name = "older than avx512_core";
    if ((isa & dnnl_cpu_isa_avx512_core_amx) == dnnl_cpu_isa_avx512_core_amx)
        name = "avx512_core_amx";
    else if ((isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16)
        name = "avx512_core_bf16";
    else if ((isa & dnnl_cpu_isa_avx512_core_vnni) == dnnl_cpu_isa_avx512_core_vnni)
        name = "avx512_core_vnni";
    else if ((isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core)
        name = "avx512_core";
    if (isa_name) *isa_name = name;
    return (isa & dnnl_cpu_isa_avx512_core_amx) == dnnl_cpu_isa_avx512_core_amx;
}

int tera_cpu_bf16_native(void) {
    const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    return (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
}

int tera_cpu_bf16_has_dot(void) {
    const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    return (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
}

/* Instruction-throughput probe: 12 independent accumulators (more than latency x ports), so each
 * loop runs at the unit's issue rate. Timed in the thread's CPU time, so that a loop preempted by
 * another process (ranks and tests sharing the cores) is not charged for the time it did not run. Compiled for AVX512-BF16 whatever the build flags; only run
 * where the CPU has it. Multiply-adds per second of the vector FMA (16 per instruction) and of the
 * BF16 dot product (32 per instruction). */
#if defined(__x86_64__) && defined(__GNUC__)
#define PROBE_ACC 12
static double thread_cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
__attribute__((target("avx512f,avx512bf16"))) static double probe_fma(int64_t iters) {
    __m512 acc[PROBE_ACC];
    for (int j = 0; j < PROBE_ACC; j++) acc[j] = _mm512_setzero_ps();
    __m512 a = _mm512_set1_ps(1e-8f), b = _mm512_set1_ps(1.0f);
    const double t0 = thread_cpu_s();
    for (int64_t i = 0; i < iters; i++) {
        for (int j = 0; j < PROBE_ACC; j++) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
        __asm__ volatile("" : "+v"(a)); /* keeps the loop from being folded */
    }
    const double dt = thread_cpu_s() - t0;
    float sink = 0.0f;
    for (int j = 0; j < PROBE_ACC; j++) sink += _mm512_reduce_add_ps(acc[j]);
    __asm__ volatile("" : : "x"(sink));
    return (double)iters * PROBE_ACC * 16 / dt;
}
__attribute__((target("avx512f,avx512bf16"))) static double probe_dot(int64_t iters) {
    __m512 acc[PROBE_ACC];
    for (int j = 0; j < PROBE_ACC; j++) acc[j] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
    const double t0 = thread_cpu_s();
    for (int64_t i = 0; i < iters; i++) {
        for (int j = 0; j < PROBE_ACC; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
        __asm__ volatile("" : "+v"(a));
    }
    const double dt = thread_cpu_s() - t0;
    float sink = 0.0f;
    for (int j = 0; j < PROBE_ACC; j++) sink += _mm512_reduce_add_ps(acc[j]);
    __asm__ volatile("" : : "x"(sink));
    return (double)iters * PROBE_ACC * 32 / dt;
}
#endif

/* Measured once per process (the first call), so that every decision taken from it in a run (the
 * bf16 units of training.bf16_gemm = auto, attention's bf16 kernels) sees the same figures. */
static double g_probe_fma, g_probe_dot;
static int g_probe_ok;
static pthread_once_t g_probe_once = PTHREAD_ONCE_INIT;
static void probe_run(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (!tera_cpu_bf16_has_dot() || !__builtin_cpu_supports("avx512bf16")) return;
    /* best of 5 alternating pairs of ~2 ms loops: a busy neighbour (a sibling hardware thread, the
     * caches) slows a loop, never speeds it up */
    for (int r = 0; r < 5; r++) {
        const double f = probe_fma(400000), d = probe_dot(400000);
        if (f > g_probe_fma) g_probe_fma = f;
        if (d > g_probe_dot) g_probe_dot = d;
    }
    g_probe_ok = 1;
#endif
}

int tera_cpu_bf16_probe(double *fma_macs, double *dot_macs) {
    pthread_once(&g_probe_once, probe_run);
    *fma_macs = g_probe_fma, *dot_macs = g_probe_dot;
    return g_probe_ok;
}

int tera_cpu_bf16_dot_fast(void) {
    double f, d;
    return tera_cpu_bf16_probe(&f, &d) && d >= TERA_BF16_DOT_MARGIN * f;
}

/* Per-thread conversion scratch (the backend context's): thread 0 (the only caller outside parallel
 * regions) holds the large one. Sized by tera_cpu_matmul_reserve at set-up; reallocated only if a
 * product outgrows it. */
#define SCRATCH_THREADS TERA_CPU_SCRATCH_THREADS

static void scratch_resize(tera_cpu_scratch_buf *b, size_t bytes) {
    free(b->p);
    b->p = tera_malloc(bytes);
    b->bytes = bytes;
}

void tera_cpu_matmul_reserve(tera_cpu_matmul *mm, int64_t main_elems, int64_t thread_elems) {
    const size_t es = lowp_in_fp32(mm) ? sizeof(float) : sizeof(uint16_t); /* set the precision and engine first */
    const int nt = tera_get_threads() < SCRATCH_THREADS ? tera_get_threads() : SCRATCH_THREADS;
    for (int t = 0; t < nt; t++) {
        const size_t want = (size_t)(t == 0 ? main_elems : thread_elems) * es;
        if (mm->scratch[t].bytes < want) scratch_resize(&mm->scratch[t], want);
    }
    mm->grows = 0;
    tera_cpu_prod_sync(mm); /* a scratch may be new */
}

void tera_cpu_matmul_release(tera_cpu_matmul *mm) {
    for (int t = 0; t < SCRATCH_THREADS; t++) {
        free(mm->scratch[t].p);
        mm->scratch[t] = (tera_cpu_scratch_buf){0};
    }
    mm->grows = 0;
    free(mm->shadow.w16);
    free(mm->shadow.stamp);
    mm->shadow = (tera_cpu_shadow){0};
}

static void *scratch_get(tera_cpu_matmul *mm, size_t bytes) {
    const int t = omp_in_parallel() ? omp_get_thread_num() : 0;
    TERA_ASSERTF(t < SCRATCH_THREADS, "thread %d: at most %d threads use low-precision products", t,
                 SCRATCH_THREADS);
    tera_cpu_scratch_buf *b = &mm->scratch[t];
    if (b->bytes < bytes) {
        /* only thread t touches its buffer; the counter is for tests */
#pragma omp atomic
        mm->grows++;
        scratch_resize(b, bytes);
    }
    return b->p;
}

float tera_bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float fp16_scalar(float x) {
    if (!isfinite(x)) return x;
    float a = fabsf(x);
    if (a >= 65520.0f) return copysignf(INFINITY, x); /* past the largest fp16 (65504) once rounded */
    if (a < 6.103515625e-05f) {                       /* fp16 subnormals: multiples of 2^-24 */
        a = nearbyintf(a * 16777216.0f) / 16777216.0f;
    } else { /* 11 significant bits, round to nearest even */
        uint32_t u;
        memcpy(&u, &a, sizeof u);
        u += 0xfffu + ((u >> 13) & 1u);
        u &= ~0x1fffu;
        memcpy(&a, &u, sizeof a);
    }
    return copysignf(a, x);
}

static void round_bf16_range(uint16_t *d, const float *s, int64_t n) { tera_bf16_rne_n(d, s, n); }

/* The same rounding, each result widened back to fp32 (the fma engine's operands). */
static void round_bf16f_range(float *d, const float *s, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512i r = tera_bf16_rne16(_mm512_loadu_si512((const void *)(s + i)));
        _mm512_storeu_si512((void *)(d + i), _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
    }
#endif
    for (; i < n; i++) d[i] = tera_bf16_to_float(tera_bf16_rne(s[i]));
}

static void round_fp16_range(float *d, const float *s, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm512_storeu_ps(d + i, _mm512_cvtph_ps(h));
    }
#endif
    for (; i < n; i++) d[i] = fp16_scalar(s[i]);
}

/* Conversions run on every thread outside parallel regions (chunks of a fixed size: the result does
 * not depend on the thread count), on the calling thread inside them. */
#define CVT_CHUNK 16384
typedef void (*round_range_fn)(void *dst, const float *src, int64_t n);
static void bf16_range_v(void *d, const float *s, int64_t n) { round_bf16_range(d, s, n); }
static void fp16_range_v(void *d, const float *s, int64_t n) { round_fp16_range(d, s, n); }
static void bf16f_range_v(void *d, const float *s, int64_t n) { round_bf16f_range(d, s, n); }

static void round_chunked(round_range_fn range, void *dst, size_t es, const float *src, int64_t n) {
    if (n <= CVT_CHUNK || omp_in_parallel()) {
        range(dst, src, n);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < n; c += CVT_CHUNK)
        range((char *)dst + (size_t)c * es, src + c, n - c < CVT_CHUNK ? n - c : CVT_CHUNK);
}

void tera_round_bf16(uint16_t *dst, const float *src, int64_t n) { round_chunked(bf16_range_v, dst, sizeof *dst, src, n); }
void tera_round_fp16(float *dst, const float *src, int64_t n) { round_chunked(fp16_range_v, dst, sizeof *dst, src, n); }
void tera_round_bf16f(float *dst, const float *src, int64_t n) { round_chunked(bf16f_range_v, dst, sizeof *dst, src, n); }

/* ------------------------------------------------------------------ the weights' bf16 shadow */

/* Elements per block of the shadow: the unit that is rounded again after a change (a block that
 * straddles two tensors is rounded whole at the first use of either). */
#define SHADOW_BLOCK 8192

static int shadow_wanted(const tera_cpu_matmul *mm) {
    const char *e = getenv("TERA_BF16_SHADOW"); /* 0: off (A/B timing, tests); read at set-up only */
    return mm->shadow.base && mm->shadow.n > 0 && !lowp_in_fp32(mm) && mm->prec == TERA_PREC_BF16 &&
           !(e && strcmp(e, "0") == 0);
}

static void shadow_free(tera_cpu_shadow *s) {
    free(s->w16);
    free(s->stamp);
    s->w16 = NULL;
    s->stamp = NULL;
    s->nblocks = 0;
    s->filled = 0;
}

void tera_cpu_shadow_sync(tera_cpu_matmul *mm) {
    tera_cpu_shadow *s = &mm->shadow;
    if (!shadow_wanted(mm)) {
        shadow_free(s);
        return;
    }
    if (s->w16) return;
    s->w16 = tera_malloc(sizeof(uint16_t) * (size_t)s->n);
    s->nblocks = (s->n + SHADOW_BLOCK - 1) / SHADOW_BLOCK;
    s->stamp = tera_calloc((size_t)s->nblocks, sizeof(int64_t)); /* 0: never rounded (epochs start at 1) */
    s->epoch++;
    s->filled = 0;
    const char *c = getenv("TERA_BF16_SHADOW_CHECK"); /* 1: verify every filled shadow (slow; tests) */
#if defined(__SANITIZE_ADDRESS__)
    s->check = !(c && strcmp(c, "0") == 0); /* on in the sanitizer builds unless turned off */
#else
    s->check = c && strcmp(c, "1") == 0;
#endif
    const char *f = getenv("TERA_BF16_SHADOW_FILL"); /* 0: the update never writes it (A/B timing) */
    s->fill = !(f && strcmp(f, "0") == 0);
}

void tera_cpu_shadow_register(tera_cpu_matmul *mm, const float *w, int64_t n) {
    tera_cpu_shadow *s = &mm->shadow;
    shadow_free(s);
    s->base = w;
    s->n = w ? n : 0;
    s->active = 0;
    if (s->epoch < 1) s->epoch = 1;
    tera_cpu_shadow_sync(mm);
}

static void shadow_verify(const tera_cpu_shadow *s);

void tera_cpu_shadow_begin(tera_cpu_matmul *mm, int changed) {
    tera_cpu_shadow *s = &mm->shadow;
    TERA_ASSERTF(!omp_in_parallel(), "the weights' window opens outside parallel regions");
    if (s->filled) { /* written by the optimizer's pass (weights_filled): every block current, once */
        if (s->check) shadow_verify(s);
    } else if (changed) {
        s->epoch++; /* every block stale */
    }
    s->filled = 0;
    s->active = 1;
}

void tera_cpu_shadow_end(tera_cpu_matmul *mm) { mm->shadow.active = 0; }

/* A filled shadow against the rounding of the buffer, element by element (TERA_ASSERT on a
 * difference): the check that nothing changed the weights between weights_filled and the window. */
static void shadow_verify(const tera_cpu_shadow *s) {
    int64_t bad = -1;
#pragma omp parallel for schedule(static) reduction(max : bad)
    for (int64_t i = 0; i < s->n; i++)
        if (s->w16[i] != tera_bf16_rne(s->base[i]) && i > bad) bad = i;
    TERA_ASSERTF(bad < 0, "bf16 weight shadow: element %lld is 0x%04x, the rounding of %a is 0x%04x (the weights "
                 "changed between the optimizer's pass and the next forward)", (long long)bad, s->w16[bad],
                 (double)s->base[bad], tera_bf16_rne(s->base[bad]));
}

uint16_t *tera_cpu_shadow_out(tera_cpu_matmul *mm, const float *w, int64_t n) {
    tera_cpu_shadow *s = &mm->shadow;
    if (!s->w16 || !s->fill || s->active || w != s->base || n != s->n) return NULL;
    s->epoch++; /* the caller overwrites it: stale until weights_filled */
    s->filled = 0;
    return s->w16;
}

void tera_cpu_shadow_filled(tera_cpu_matmul *mm) {
    tera_cpu_shadow *s = &mm->shadow;
    TERA_ASSERTF(s->w16 && !s->active && !omp_in_parallel(), "weights_filled: no shadow handed out, or inside a window");
    s->epoch++;
    for (int64_t b = 0; b < s->nblocks; b++) s->stamp[b] = s->epoch;
    s->filled = 1;
}

/* Block b brought to the current epoch: rounded by whichever thread claims it first, the others
 * wait until it is done. */
static void shadow_block(tera_cpu_shadow *s, int64_t b) {
    const int64_t e = s->epoch;
    int64_t st = __atomic_load_n(&s->stamp[b], __ATOMIC_ACQUIRE);
    int spins = 0;
    while (st != e) {
        if (st == -e) { /* another thread is rounding it (a few microseconds): wait, yielding the
                         * core now and then in case that thread was preempted */
            if (++spins % 1024 == 0) {
                sched_yield();
            } else {
#if defined(__x86_64__)
                _mm_pause();
#endif
            }
            st = __atomic_load_n(&s->stamp[b], __ATOMIC_ACQUIRE);
            continue;
        }
        if (__atomic_compare_exchange_n(&s->stamp[b], &st, -e, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            const int64_t lo = b * SHADOW_BLOCK, len = s->n - lo < SHADOW_BLOCK ? s->n - lo : SHADOW_BLOCK;
            round_bf16_range(s->w16 + lo, s->base + lo, len);
            __atomic_store_n(&s->stamp[b], e, __ATOMIC_RELEASE);
            return;
        }
    }
}

/* The bf16 copy of the weight operand w[n] when it lies in the registered buffer and a window is
 * open (stale blocks rounded first, on every thread outside parallel regions), else NULL: the
 * caller rounds it into its scratch. */
static const uint16_t *shadow_get(tera_cpu_matmul *mm, const float *w, int64_t n) {
    tera_cpu_shadow *s = &mm->shadow;
    if (!s->w16 || !s->active || n <= 0) return NULL;
    const uintptr_t lo = (uintptr_t)s->base, hi = (uintptr_t)(s->base + s->n), p = (uintptr_t)w;
    if (p < lo || p >= hi || (uintptr_t)(w + n) > hi) return NULL;
    const int64_t off = w - s->base, b0 = off / SHADOW_BLOCK, b1 = (off + n - 1) / SHADOW_BLOCK;
    const int64_t e = s->epoch;
    int64_t b = b0;
    while (b <= b1 && __atomic_load_n(&s->stamp[b], __ATOMIC_ACQUIRE) == e) b++;
    if (b <= b1) { /* something to round */
        if (omp_in_parallel() || b1 - b < 2) {
            for (; b <= b1; b++) shadow_block(s, b);
        } else {
            const int64_t first = b;
#pragma omp parallel for schedule(static)
            for (int64_t k = first; k <= b1; k++) shadow_block(s, k);
        }
    }
    return s->w16 + off;
}

/* ------------------------------------------------------------------ operands written by their producers */

/* tera_cpu_prod (cpu.h): the producer op writes the bf16 copies of its outputs into the calling
 * thread's scratch and records them; the next op on that thread takes the record, and a product
 * among its operands finds the copy there instead of rounding the fp32 array again. */

_Static_assert(sizeof(tera_cpu_prod) == 64, "one record per cache line");

static int prod_thread(void) { return omp_in_parallel() ? omp_get_thread_num() : 0; }

void tera_cpu_prod_sync(tera_cpu_matmul *mm) {
    for (int t = 0; t < SCRATCH_THREADS; t++) mm->prod[t].count = 0;
    mm->prod_region++;
}

void tera_cpu_prod_init(tera_cpu_matmul *mm) {
    const char *e = getenv("TERA_PRODUCER_BF16"), *c = getenv("TERA_PRODUCER_BF16_CHECK"), *a = getenv("TERA_ACT_BF16");
    mm->prod_off = e && strcmp(e, "0") == 0;
    mm->act_off = a && strcmp(a, "0") == 0;
#if defined(__SANITIZE_ADDRESS__)
    mm->prod_check = !(c && strcmp(c, "0") == 0); /* on in the sanitizer builds unless turned off */
#else
    mm->prod_check = c && strcmp(c, "1") == 0;
#endif
    tera_cpu_prod_sync(mm);
}

void tera_cpu_producer_bf16(tera_cpu_matmul *mm, int on) {
    mm->prod_off = !on;
    tera_cpu_prod_sync(mm);
}

void tera_cpu_prod_take(tera_cpu_matmul *mm, tera_cpu_prod *rec) {
    const int par = omp_in_parallel(), t = par ? omp_get_thread_num() : 0;
    if (t >= SCRATCH_THREADS) { /* no scratch, so never recorded */
        if (rec) rec->count = 0;
        return;
    }
    tera_cpu_prod *p = &mm->prod[t];
    if (rec) {
        *rec = *p;
        if (rec->region != mm->prod_region) rec->count = 0;
    }
    p->count = 0;
    if (!par) mm->prod_region++; /* workers read it only inside regions, where it does not change */
}

void tera_cpu_prod_item_end(tera_cpu_matmul *mm) {
    const int t = prod_thread();
    if (t < SCRATCH_THREADS) mm->prod[t].count = 0;
}

uint16_t *tera_cpu_prod_out(tera_cpu_matmul *mm, int k, const float *const *src, const int64_t *n, int64_t *off) {
    if (mm->prod_off || mm->prec != TERA_PREC_BF16 || lowp_in_fp32(mm) || k < 1 || k > TERA_CPU_PROD_MAX)
        return NULL;
    const int t = prod_thread();
    if (t >= SCRATCH_THREADS) return NULL;
    int64_t total = 0;
    for (int i = 0; i < k; i++) {
        if (n[i] <= 0 || !src[i]) return NULL;
        off[i] = total;
        total += n[i] + (n[i] & 1); /* the next copy at an even element, as the products lay them out */
    }
    tera_cpu_scratch_buf *b = &mm->scratch[t];
    if (!b->p || b->bytes < sizeof(uint16_t) * (size_t)total) return NULL; /* never grown by a producer */
    tera_cpu_prod *p = &mm->prod[t];
    for (int i = 0; i < k; i++) {
        p->src[i] = src[i];
        p->n[i] = n[i];
        p->off[i] = off[i];
    }
    p->region = mm->prod_region;
    p->count = k;
    return b->p;
}

/* Whether rec (the record this op took) holds a copy of x[n] at element `want` of the scratch. */
static int prod_match(const tera_cpu_prod *rec, const float *x, int64_t n, int64_t want) {
    if (!rec) return 0;
    for (int i = 0; i < rec->count; i++)
        if (rec->src[i] == x && rec->n[i] == n && rec->off[i] == want) return 1;
    return 0;
}

/* Whether the thread's scratch holds `need` bytes: the product's whole layout (it is not grown when
 * it holds a producer's copy, which growing would lose). */
static int prod_fits(const tera_cpu_matmul *mm, size_t need) { return mm->scratch[prod_thread()].bytes >= need; }

/* The copy of x[n] at element `at` of the thread's scratch, taken by a product (prod_match and
 * prod_fits said so). It is checked against the rounding of x, every element with prod_check and 8
 * spread elements otherwise: a mismatch means x was written between its producer and this product by
 * something other than the backend's ops, a broken contract (include/tera/backend.h). */
static const uint16_t *prod_use(tera_cpu_matmul *mm, const float *x, int64_t n, int64_t at) {
    const uint16_t *c = (const uint16_t *)mm->scratch[prod_thread()].p + at;
    int64_t bad = -1;
    if (mm->prod_check) {
        for (int64_t j = 0; j < n && bad < 0; j++)
            if (c[j] != tera_bf16_rne(x[j])) bad = j;
    } else {
        for (int64_t k = 0; k < 8 && bad < 0; k++) {
            const int64_t j = k * (n - 1) / 7;
            if (c[j] != tera_bf16_rne(x[j])) bad = j;
        }
    }
    TERA_ASSERTF(bad < 0, "bf16 operand written by its producer: element %lld of %lld is 0x%04x, the rounding of %a "
                 "is 0x%04x (the array was written between its producer and the product)", (long long)bad,
                 (long long)n, bad >= 0 ? c[bad] : 0, bad >= 0 ? (double)x[bad] : 0.0,
                 bad >= 0 ? tera_bf16_rne(x[bad]) : 0);
    __atomic_add_fetch(&mm->prod_used, 1, __ATOMIC_RELAXED);
    return c;
}

/* A single operand x[n] at element 0 (the first operand of a product's layout): its copy, or NULL. */
static const uint16_t *prod_find(tera_cpu_matmul *mm, const tera_cpu_prod *rec, const float *x, int64_t n,
                                 size_t need) {
    return prod_match(rec, x, n, 0) && prod_fits(mm, need) ? prod_use(mm, x, n, 0) : NULL;
}

/* C[M,N] = op(A) op(B) + beta C from bf16 operands, fp32 accumulation and output. */
static void gemm_bf16_run(int ta, int tb, int64_t M, int64_t N, int64_t K, const uint16_t *a16, int64_t lda,
                          const uint16_t *b16, int64_t ldb, float beta, float *C, int64_t ldc) {
#if HAVE_MATMUL_PRIMITIVE
    if (use_primitive() && M * N * K >= g_primitive_min_macs && !omp_in_parallel() &&
        matmul_primitive(dnnl_bf16, ta, tb, M, N, K, a16, lda, b16, ldb, beta, C, ldc))
        return;
#endif
    DNNL_CHECK(dnnl_gemm_bf16bf16f32(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, a16, lda, b16, ldb, beta, C, ldc));
}

/* ---- bf16 outputs written in row chunks, each prefetched for writing first (AMX; docs/PERFORMANCE.md,
 * "Wave 20"). On the matrix units a product with a short reduction (K <= OUT_CHUNK_MAX_K) and a fresh
 * fp32 output (the experts' hidden activations [rows, F]: memory not in any cache) spends much of its
 * time in its output's stores: `tera bench --products` measured the experts' x w1^T at 318 GFLOP/s per
 * thread in bench-s against 600+ for the same shape with its output in cache. A product with at least
 * two chunks of rows therefore runs chunk by chunk, each chunk on one thread: the chunk's output lines
 * are prefetched for writing (every line's ownership requested at once, not store by store), then the
 * chunk's product writes them in L2. A loop of oneDNN's bf16 GEMM with outputs cycling through 8
 * buffers: 2036x512x256 673-688 against 453-496 GFLOP/s per thread, 1071x1024x512 620-670 against
 * 473-511, 512x512x256 675 against 580. A product on every thread (outside the experts' side-by-side
 * region) shares its chunks out among the threads, each chunk single-threaded, instead of one call
 * that oneDNN splits (TERA_GEMM_OUT_CHUNK_WHOLE=0 keeps the one call: bench-s's q/k/v forward 5.1-5.2
 * -> 3.6 ms per step at 2 threads). The chunks give the bits of the whole product: rows of A and C are
 * independent and oneDNN's reduction order over K <= 2048 did not depend on M for 256 rows or more (a one-row product
 * takes other kernels: chunks are 256-511 rows, none shorter; tests/test_gemm_chunks.c checks it on
 * the shapes it applies to, which is also what keeps an expert's numbers the same side by side and
 * alone). TERA_GEMM_OUT_CHUNK=0 turns it off (A/B). */
#define OUT_CHUNK_ROWS 256
#define OUT_CHUNK_MAX_K 512
#define OUT_CHUNK_MAX_N 1024
static int g_out_chunk = -1; /* -1: not read yet */
static int g_out_whole = 1;   /* a product on every thread: its chunks shared out (TERA_GEMM_OUT_CHUNK_WHOLE=0: no) */
static int64_t g_out_chunked = 0; /* products run in chunks (tests) */

void tera_cpu_gemm_out_chunk(int on) { g_out_chunk = on != 0; }
int64_t tera_cpu_gemm_out_chunked(void) { return __atomic_load_n(&g_out_chunked, __ATOMIC_RELAXED); }

static int env_off(const char *name) {
    const char *e = getenv(name);
    return e && strcmp(e, "0") == 0;
}

static int out_chunk_on(void) {
    int on = __atomic_load_n(&g_out_chunk, __ATOMIC_RELAXED);
    if (on < 0) { /* first use: AMX (the kernels the figures are for), unless the environment says 0 */
        g_out_whole = !env_off("TERA_GEMM_OUT_CHUNK_WHOLE");
        on = tera_cpu_bf16_fast(NULL) && !env_off("TERA_GEMM_OUT_CHUNK");
        __atomic_store_n(&g_out_chunk, on, __ATOMIC_RELAXED);
    }
    return on;
}

/* Every 64-byte line of rows [0, m) of C (n floats each, ldc apart), prefetched for writing. */
static void prefetch_rows_w(float *C, int64_t m, int64_t n, int64_t ldc) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j += 16) __builtin_prefetch(C + i * ldc + j, 1, 3);
}

/* Chunk c of nc: rows [c M / nc, (c + 1) M / nc), its output prefetched, then its product on this thread. */
static void out_chunk(int tb, int64_t M, int64_t N, int64_t K, const uint16_t *a16, int64_t lda, const uint16_t *b16,
                      int64_t ldb, float *C, int64_t ldc, int64_t c, int64_t nc) {
    const int64_t r = c * M / nc, m = (c + 1) * M / nc - r;
    prefetch_rows_w(C + r * ldc, m, N, ldc);
    gemm_bf16_run(0, tb, m, N, K, a16 + r * lda, lda, b16, ldb, 0.0f, C + r * ldc, ldc);
}

/* gemm_bf16_run, in row chunks where the rule above applies */
static void gemm_bf16_out(int ta, int tb, int64_t M, int64_t N, int64_t K, const uint16_t *a16, int64_t lda,
                          const uint16_t *b16, int64_t ldb, float beta, float *C, int64_t ldc) {
    const int threads = omp_in_parallel() ? 1 : tera_get_threads();
    if (ta || beta != 0.0f || M < 2 * OUT_CHUNK_ROWS || K > OUT_CHUNK_MAX_K || N > OUT_CHUNK_MAX_N ||
        !out_chunk_on() || (threads > 1 && !g_out_whole)) {
        gemm_bf16_run(ta, tb, M, N, K, a16, lda, b16, ldb, beta, C, ldc);
        return;
    }
    /* chunks of 256-511 rows: no short last one (oneDNN takes other kernels, and another sum order, for
     * a few rows); a product on every thread shares its chunks out, each on one thread */
    const int64_t nc = M / OUT_CHUNK_ROWS;
    if (threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t c = 0; c < nc; c++) out_chunk(tb, M, N, K, a16, lda, b16, ldb, C, ldc, c, nc);
    } else { /* no nested region: on this thread, in order */
        for (int64_t c = 0; c < nc; c++) out_chunk(tb, M, N, K, a16, lda, b16, ldb, C, ldc, c, nc);
    }
    __atomic_add_fetch(&g_out_chunked, 1, __ATOMIC_RELAXED);
}

/* gemm_bf16_out, reported by shape to `tera bench --products` (include/tera/profile.h) as one product */
static void gemm_bf16(int ta, int tb, int64_t M, int64_t N, int64_t K, const uint16_t *a16, int64_t lda,
                      const uint16_t *b16, int64_t ldb, float beta, float *C, int64_t ldc) {
    TERA_PROF_PRODUCT(TERA_PROF_PROD_BF16, ta, tb, M, N, K, omp_in_parallel(),
                      gemm_bf16_out(ta, tb, M, N, K, a16, lda, b16, ldb, beta, C, ldc));
}

/* An operand rounded to the current low precision, kept as fp32 (lowp_in_fp32 modes). */
static void round_fp32_operand(const tera_cpu_matmul *mm, float *dst, const float *src, int64_t n) {
    if (mm->prec == TERA_PREC_FP16)
        tera_round_fp16(dst, src, n);
    else
        tera_round_bf16f(dst, src, n);
}

/* C[M,N] = op(A) op(B) + beta C in the current low precision. A holds na elements, B nb (dense
 * operands: the linear layers' arrays). */
static void gemm_lowp(tera_cpu_matmul *mm, const tera_cpu_prod *rec, int ta, int tb, int64_t M, int64_t N, int64_t K,
                      const float *A, int64_t lda, int64_t na, const float *B, int64_t ldb, int64_t nb, float beta, float *C,
                      int64_t ldc) {
    if (M == 0 || N == 0) return;
    if (K == 0) {
        tera_gemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    if (lowp_in_fp32(mm)) { /* fp16, or bf16 on the fp32 FMA kernels: rounded operands, fp32 product */
        float *s = scratch_get(mm, sizeof(float) * (size_t)(na + nb));
        round_fp32_operand(mm, s, A, na);
        round_fp32_operand(mm, s + na, B, nb);
        tera_gemm(ta, tb, M, N, K, 1.0f, s, lda, s + na, ldb, beta, C, ldc);
        return;
    }
    /* bf16: the bf16 copy of B starts at an even element, so 4-byte aligned; B is the weights'
     * shadow when it has one */
    const uint16_t *bs = shadow_get(mm, B, nb);
    const size_t need = sizeof(uint16_t) * (size_t)(na + (na & 1) + (bs ? 0 : nb));
    const int have_a = prod_find(mm, rec, A, na, need) != NULL; /* A's copy by its producer, in place */
    uint16_t *s = scratch_get(mm, need);
    uint16_t *a16 = s, *b16 = s + na + (na & 1);
    if (!have_a) tera_round_bf16(a16, A, na);
    if (!bs) tera_round_bf16(b16, B, nb);
    gemm_bf16(ta, tb, M, N, K, a16, lda, bs ? bs : b16, ldb, beta, C, ldc);
}

void tera_linear_forward_fp32(float *y, const float *x, const float *w, int64_t N, int64_t in, int64_t out,
                              float beta) {
    /* y[N,out] = x[N,in] w[out,in]^T */
    tera_gemm(0, 1, N, out, in, 1.0f, x, in, w, in, beta, y, out);
}

void tera_linear_backward_fp32(float *dx, float *dw, const float *dy, const float *x, const float *w,
                               int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    /* dx[N,in] = dy[N,out] w[out,in] */
    if (dx) tera_gemm(0, 0, N, in, out, 1.0f, dy, out, w, in, dx_beta, dx, in);
    /* dw[out,in] = dw_beta dw + dy^T[out,N] x[N,in] */
    if (dw) tera_gemm(1, 0, out, in, N, 1.0f, dy, out, x, in, dw_beta, dw, in);
}

void tera_cpu_linear_forward(tera_cpu_matmul *mm, float *y, const float *x, const float *w, int64_t N, int64_t in, int64_t out,
                         float beta) {
    tera_cpu_prod rec;
    tera_cpu_prod_take(mm, &rec);
    if (mm->prec == TERA_PREC_FP32) {
        tera_linear_forward_fp32(y, x, w, N, in, out, beta);
        return;
    }
    gemm_lowp(mm, &rec, 0, 1, N, out, in, x, in, N * in, w, in, out * in, beta, y, out);
}

void tera_cpu_linear_backward(tera_cpu_matmul *mm, float *dx, float *dw, const float *dy, const float *x, const float *w,
                          int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    tera_cpu_prod rec;
    tera_cpu_prod_take(mm, &rec);
    if (mm->prec == TERA_PREC_FP32) {
        tera_linear_backward_fp32(dx, dw, dy, x, w, N, in, out, dx_beta, dw_beta);
        return;
    }
    /* activation and weight gradients: low-precision operands, fp32 accumulation into fp32 arrays;
     * dy is rounded once for both products */
    if (dx && dw && N > 0 && in > 0 && out > 0) {
        if (lowp_in_fp32(mm)) {
            float *dyr = scratch_get(mm, sizeof(float) * (size_t)(N * out + out * in + N * in));
            float *wr = dyr + N * out, *xr = wr + out * in;
            round_fp32_operand(mm, dyr, dy, N * out);
            round_fp32_operand(mm, wr, w, out * in);
            round_fp32_operand(mm, xr, x, N * in);
            tera_gemm(0, 0, N, in, out, 1.0f, dyr, out, wr, in, dx_beta, dx, in);
            tera_gemm(1, 0, out, in, N, 1.0f, dyr, out, xr, in, dw_beta, dw, in);
            return;
        }
        /* bf16 arrays: each copy starts at an even element; w is the weights' shadow when it has one */
        const uint16_t *ws = shadow_get(mm, w, out * in);
        const int64_t ny = N * out + ((N * out) & 1), nw = ws ? 0 : out * in + ((out * in) & 1);
        const size_t need = sizeof(uint16_t) * (size_t)(ny + nw + N * in);
        const int have_dy = prod_find(mm, &rec, dy, N * out, need) != NULL; /* by its producer, in place */
        uint16_t *dy16 = scratch_get(mm, need);
        uint16_t *w16 = dy16 + ny, *x16 = w16 + nw;
        const uint16_t *wop = ws ? ws : w16;
        if (!have_dy) tera_round_bf16(dy16, dy, N * out);
        if (!ws) tera_round_bf16(w16, w, out * in);
        tera_round_bf16(x16, x, N * in);
        gemm_bf16(0, 0, N, in, out, dy16, out, wop, in, dx_beta, dx, in);
        gemm_bf16(1, 0, out, in, N, dy16, out, x16, in, dw_beta, dw, in);
        return;
    }
    if (dx) gemm_lowp(mm, &rec, 0, 0, N, in, out, dy, out, N * out, w, in, out * in, dx_beta, dx, in);
    if (dw) gemm_lowp(mm, dx ? NULL : &rec, 1, 0, out, in, N, dy, out, N * out, x, in, N * in, dw_beta, dw, in);
}

/* ------------------------------------------------------------------ an FFN's g kept in bf16 */

int tera_cpu_act_bf16(const tera_cpu_matmul *mm) {
    return mm->prec == TERA_PREC_BF16 && !lowp_in_fp32(mm) && !mm->act_off;
}

/* gemm_lowp's bf16 products of tera_cpu_linear_forward with x's rounding given */
void tera_cpu_linear_forward_x16(tera_cpu_matmul *mm, float *y, const uint16_t *x16, const float *w, int64_t N,
                                 int64_t in, int64_t out, float beta) {
    TERA_ASSERT(tera_cpu_act_bf16(mm));
    tera_cpu_prod_take(mm, NULL);
    if (N == 0 || out == 0) return;
    if (in == 0) { /* no terms: y = beta y, as the fp32 product does it */
        tera_gemm(0, 1, N, out, 0, 1.0f, NULL, 1, NULL, 1, beta, y, out);
        return;
    }
    const uint16_t *ws = shadow_get(mm, w, out * in);
    uint16_t *w16 = NULL;
    if (!ws) {
        w16 = scratch_get(mm, sizeof(uint16_t) * (size_t)(out * in));
        tera_round_bf16(w16, w, out * in);
    }
    gemm_bf16(0, 1, N, out, in, x16, in, ws ? ws : w16, in, beta, y, out);
}

/* tera_cpu_linear_backward's bf16 products with x's rounding given: dy rounded once (or its
 * producer's copy), dx = dy w, dw = dw_beta dw + dy^T x */
void tera_cpu_linear_backward_x16(tera_cpu_matmul *mm, float *dx, float *dw, const float *dy, const uint16_t *x16,
                                  const float *w, int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    TERA_ASSERT(tera_cpu_act_bf16(mm));
    tera_cpu_prod rec;
    tera_cpu_prod_take(mm, &rec);
    if (N == 0 || in == 0 || out == 0) { /* no terms somewhere: the fp32 products' scaling by beta */
        if (dx) tera_gemm(0, 0, N, in, 0, 1.0f, NULL, 1, NULL, 1, dx_beta, dx, in);
        if (dw) tera_gemm(1, 0, out, in, 0, 1.0f, NULL, 1, NULL, 1, dw_beta, dw, in);
        return;
    }
    const uint16_t *ws = dx ? shadow_get(mm, w, out * in) : NULL;
    const int64_t ny = N * out + ((N * out) & 1), nw = dx && !ws ? out * in : 0;
    const size_t need = sizeof(uint16_t) * (size_t)(ny + nw);
    const int have_dy = prod_find(mm, &rec, dy, N * out, need) != NULL; /* by its producer, in place */
    uint16_t *dy16 = scratch_get(mm, need), *w16 = dy16 + ny;
    if (!have_dy) tera_round_bf16(dy16, dy, N * out);
    if (nw) tera_round_bf16(w16, w, out * in);
    if (dx) gemm_bf16(0, 0, N, in, out, dy16, out, ws ? ws : w16, in, dx_beta, dx, in);
    if (dw) gemm_bf16(1, 0, out, in, N, dy16, out, x16, in, dw_beta, dw, in);
}

/* ------------------------------------------------------------------ several products of one input */

/* Largest out[i] * in, and whether the fused path applies (every product non-empty). */
static int multi_ok(int n, const int64_t *out, int64_t N, int64_t in, int64_t *wmax) {
    *wmax = 0;
    if (N <= 0 || in <= 0) return 0;
    for (int i = 0; i < n; i++) {
        if (out[i] <= 0) return 0;
        if (out[i] * in > *wmax) *wmax = out[i] * in;
    }
    return 1;
}

void tera_cpu_linear_forward_multi(tera_cpu_matmul *mm, int n, float *const *y, const float *x,
                                   const float *const *w, const int64_t *out, int64_t N, int64_t in) {
    int64_t wmax;
    if (mm->prec == TERA_PREC_FP32 || !multi_ok(n, out, N, in, &wmax)) {
        for (int i = 0; i < n; i++) tera_cpu_linear_forward(mm, y[i], x, w[i], N, in, out[i], 0.0f);
        return;
    }
    tera_cpu_prod rec;
    tera_cpu_prod_take(mm, &rec);
    /* the products of tera_cpu_linear_forward (gemm_lowp: x as A, w as B), x rounded once; each
     * weight is rounded into the same place after it (or read from the shadow) */
    const int64_t na = N * in;
    if (lowp_in_fp32(mm)) {
        float *s = scratch_get(mm, sizeof(float) * (size_t)(na + wmax));
        round_fp32_operand(mm, s, x, na);
        for (int i = 0; i < n; i++) {
            round_fp32_operand(mm, s + na, w[i], out[i] * in);
            tera_gemm(0, 1, N, out[i], in, 1.0f, s, in, s + na, in, 0.0f, y[i], out[i]);
        }
        return;
    }
    const size_t need = sizeof(uint16_t) * (size_t)(na + (na & 1) + wmax);
    const int have_x = prod_find(mm, &rec, x, na, need) != NULL; /* x's copy by its producer, in place */
    uint16_t *s = scratch_get(mm, need);
    uint16_t *x16 = s, *w16 = s + na + (na & 1);
    if (!have_x) tera_round_bf16(x16, x, na);
    for (int i = 0; i < n; i++) {
        const uint16_t *ws = shadow_get(mm, w[i], out[i] * in);
        if (!ws) tera_round_bf16(w16, w[i], out[i] * in);
        gemm_bf16(0, 1, N, out[i], in, x16, in, ws ? ws : w16, in, 0.0f, y[i], out[i]);
    }
}

void tera_cpu_linear_backward_multi(tera_cpu_matmul *mm, int n, float *dx, float *const *dw, const float *const *dy,
                                    const float *x, const float *const *w, const int64_t *out, int64_t N, int64_t in,
                                    float dx_beta, float dw_beta) {
    int64_t wmax;
    int both = dx != NULL;
    for (int i = 0; i < n; i++) both = both && dw[i];
    if (mm->prec == TERA_PREC_FP32 || !both || !multi_ok(n, out, N, in, &wmax)) {
        for (int i = 0; i < n; i++)
            tera_cpu_linear_backward(mm, dx, dw[i], dy[i], x, w[i], N, in, out[i], i == 0 ? dx_beta : 1.0f, dw_beta);
        return;
    }
    tera_cpu_prod rec;
    tera_cpu_prod_take(mm, &rec);
    /* the two products of tera_cpu_linear_backward for each i in turn, x rounded once */
    int64_t ymax = 0;
    for (int i = 0; i < n; i++) ymax = N * out[i] > ymax ? N * out[i] : ymax;
    const int64_t nx = N * in;
    if (lowp_in_fp32(mm)) {
        float *xr = scratch_get(mm, sizeof(float) * (size_t)(nx + ymax + wmax));
        float *dyr = xr + nx, *wr = dyr + ymax;
        round_fp32_operand(mm, xr, x, nx);
        for (int i = 0; i < n; i++) {
            round_fp32_operand(mm, dyr, dy[i], N * out[i]);
            round_fp32_operand(mm, wr, w[i], out[i] * in);
            tera_gemm(0, 0, N, in, out[i], 1.0f, dyr, out[i], wr, in, i == 0 ? dx_beta : 1.0f, dx, in);
            tera_gemm(1, 0, out[i], in, N, 1.0f, dyr, out[i], xr, in, dw_beta, dw[i], in);
        }
        return;
    }
    /* bf16 arrays: each copy starts at an even element. When the producer of the gradients (SwiGLU's
     * backward: da1, da3) wrote the copies of all n of them side by side at the start of the scratch,
     * the products read them there, with x and the weight after them; else x, one gradient at a time
     * and the weight. */
    const int64_t px = nx + (nx & 1), py = ymax + (ymax & 1);
    const uint16_t *dyp[TERA_CPU_PROD_MAX] = {NULL};
    int64_t pall = 0; /* the producer's copies, elements */
    if (rec.count == n) {
        int all = 1;
        for (int i = 0; i < n; i++) {
            all = all && prod_match(&rec, dy[i], N * out[i], pall);
            pall += N * out[i] + ((N * out[i]) & 1);
        }
        if (!all || !prod_fits(mm, sizeof(uint16_t) * (size_t)(pall + px + wmax))) pall = 0;
        for (int64_t i = 0, off = 0; i < n && pall > 0; off += N * out[i] + ((N * out[i]) & 1), i++)
            dyp[i] = prod_use(mm, dy[i], N * out[i], off);
    }
    if (pall > 0) {
        uint16_t *s = scratch_get(mm, sizeof(uint16_t) * (size_t)(pall + px + wmax)); /* fits: prod_fits */
        uint16_t *x16 = s + pall, *w16 = x16 + px;
        tera_round_bf16(x16, x, nx);
        for (int i = 0; i < n; i++) {
            const uint16_t *ws = shadow_get(mm, w[i], out[i] * in);
            if (!ws) tera_round_bf16(w16, w[i], out[i] * in);
            gemm_bf16(0, 0, N, in, out[i], dyp[i], out[i], ws ? ws : w16, in, i == 0 ? dx_beta : 1.0f, dx, in);
            gemm_bf16(1, 0, out[i], in, N, dyp[i], out[i], x16, in, dw_beta, dw[i], in);
        }
        return;
    }
    uint16_t *x16 = scratch_get(mm, sizeof(uint16_t) * (size_t)(px + py + wmax));
    uint16_t *dy16 = x16 + px, *w16 = dy16 + py;
    tera_round_bf16(x16, x, nx);
    for (int i = 0; i < n; i++) {
        const uint16_t *ws = shadow_get(mm, w[i], out[i] * in);
        tera_round_bf16(dy16, dy[i], N * out[i]);
        if (!ws) tera_round_bf16(w16, w[i], out[i] * in);
        gemm_bf16(0, 0, N, in, out[i], dy16, out[i], ws ? ws : w16, in, i == 0 ? dx_beta : 1.0f, dx, in);
        gemm_bf16(1, 0, out[i], in, N, dy16, out[i], x16, in, dw_beta, dw[i], in);
    }
}
