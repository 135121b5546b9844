/* AdamW, LR schedule and gradient clipping. */
#include <math.h>
#include <stdatomic.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define OPTIM_AVX512 1
#endif
#include <stdlib.h>
#include <string.h>

#include "tera/backend.h"
#include "tera/bf16.h"
#include "tera/ckpt.h"
#include "tera/rng.h"
#include "tera/train.h"

/* The passes over the parameter, gradient and moment arrays after backward: the gradient norm
 * (tera_adamw_grad_sq) and one fused pass that scales the gradient by the clip factor, updates both
 * moments and the parameter (decoupled weight decay), adds up the update and parameter norms and
 * clears the gradient. Each pass is one parallel call over a flat list of (tensor, chunk) work
 * items built once (tera_adamw_plan), not one region per tensor; every chunk's sums land in their
 * own slot and are added per tensor in the list's order, so results do not depend on the thread
 * count or the schedule. Inner loops run in LANES independent lanes (a fixed order GCC vectorises
 * without -ffast-math) and multiply where the old code divided (1 / sqrt(bias correction)).
 *
 * The passes run on the threads of the model's compute backend (m->be, include/tera/backend.h),
 * not on OpenMP of their own: ops.for_ranges starts one worker per backend thread, and the workers
 * take blocks of ITEM_GRAIN items from a shared counter until none is left (the dynamic schedule
 * the OpenMP loops had; one relaxed atomic add per block of 4 x 16384 elements). A model without
 * a backend (m->be NULL: a hand-built table) runs them on the calling thread, in item order.
 *
 * When the caller hands it the backend's bf16 weight shadow (tera_adamw.w16: ZeRO-0, src/parallel/zero.c),
 * the update also writes each new weight rounded to bf16 there, 2 bytes where the pass already has the
 * weight in a register, so the next forward's products read the copy instead of rounding the fp32
 * weights (docs/PERFORMANCE.md, "The optimizer writes the bf16 shadow"). */
typedef struct {
    int32_t p;    /* tensor index */
    int32_t slab; /* routed experts: the item's expert, layer * El + local expert (an index into the
                     model's g_absent marks); -1 for other tensors */
    int64_t a, b; /* flat element range [a, b) */
} optim_item;

struct tera_adamw_plan {
    int64_t lo, hi, n_floats; /* the range and table it was built for */
    int n_params;
    uint64_t key;             /* hash of the table's (offset, numel) pairs */
    int n_items;
    optim_item *items;
    double *part;             /* [3 * n_items]: each item's grad^2, update^2, param^2 */
};

static uint64_t table_key(const tera_model *m) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < m->n_params; i++) {
        h = (h ^ (uint64_t)m->params[i].offset) * 1099511628211ull;
        h = (h ^ (uint64_t)m->params[i].numel) * 1099511628211ull;
    }
    return h;
}

/* Items of tensor p inside [lo, hi): chunk k covers [s0 + k C, s0 + (k + 1) C) of each slab
 * [s0, s0 + S) (a routed-expert tensor: one slab per local expert, so an item never spans two
 * experts and an expert's gradient marked absent is whole items, tera_model_grads_sparse; any other
 * tensor: one slab, the whole tensor). Where S is a multiple of C (every shape whose D F is a multiple
 * of 16384) the items are the plain chunks of the tensor. Writes them to it (when not NULL); returns
 * their count. */
static int tensor_items(const tera_param *tp, int p, int64_t lo, int64_t hi, optim_item *it) {
    const int experts = tp->expert_stacked && tp->layer >= 0 && tp->len[0] > 0 && tp->numel % tp->len[0] == 0;
    const int64_t nslab = experts ? tp->len[0] : 1, S = tp->numel / (nslab > 0 ? nslab : 1), C = TERA_OPTIM_CHUNK;
    int n = 0;
    for (int64_t e = 0; e < nslab; e++) {
        const int64_t s0 = tp->offset + e * S;
        const int64_t a0 = s0 > lo ? s0 : lo, b0 = s0 + S < hi ? s0 + S : hi;
        if (b0 <= a0) continue;
        const int64_t k0 = (a0 - s0) / C, k1 = (b0 - s0 + C - 1) / C;
        if (it)
            for (int64_t k = k0; k < k1; k++) {
                const int64_t a = s0 + k * C, b = a + C;
                it[n + k - k0] = (optim_item){.p = p, .slab = experts ? (int32_t)(tp->layer * tp->len[0] + e) : -1,
                                              .a = a > a0 ? a : a0, .b = b < b0 ? b : b0};
            }
        n += (int)(k1 - k0);
    }
    return n;
}

/* ---- scheduling: items [0, n) in blocks of ITEM_GRAIN, handed out dynamically */
#define ITEM_GRAIN 4

typedef struct {
    void (*fn)(void *ctx, int64_t a, int64_t b); /* items [a, b) */
    void *ctx;
    int64_t n;
    atomic_llong next; /* the first item not yet taken */
} item_queue;

static void queue_worker(void *arg, int64_t lo, int64_t hi, int worker) {
    (void)lo, (void)hi, (void)worker; /* every worker drains the same queue */
    item_queue *q = arg;
    for (;;) {
        const int64_t a = (int64_t)atomic_fetch_add_explicit(&q->next, ITEM_GRAIN, memory_order_relaxed);
        if (a >= q->n) return;
        q->fn(q->ctx, a, a + ITEM_GRAIN < q->n ? a + ITEM_GRAIN : q->n);
    }
}

/* fn over items [0, n) on be's threads (each item exactly once; the join of for_ranges orders
 * every write before the return); be NULL: on this thread, in order. */
static void for_items(tera_backend *be, int64_t n, void (*fn)(void *ctx, int64_t a, int64_t b), void *ctx) {
    if (n <= 0) return;
    const int64_t blocks = (n + ITEM_GRAIN - 1) / ITEM_GRAIN;
    int64_t workers = be ? be->ops.max_threads(be) : 1;
    if (workers > blocks) workers = blocks;
    if (workers <= 1) {
        fn(ctx, 0, n);
        return;
    }
    item_queue q = {.fn = fn, .ctx = ctx, .n = n};
    atomic_init(&q.next, 0);
    be->ops.for_ranges(be, workers, queue_worker, &q);
}

void tera_adamw_plan(tera_adamw *o, const tera_model *m) {
    struct tera_adamw_plan *P = o->plan;
    const uint64_t key = table_key(m);
    if (P && P->lo == o->lo && P->hi == o->hi && P->n_floats == m->n_floats && P->n_params == m->n_params &&
        P->key == key)
        return;
    if (P) free(P->items), free(P->part), free(P);
    P = tera_calloc(1, sizeof *P);
    P->lo = o->lo, P->hi = o->hi, P->n_floats = m->n_floats, P->n_params = m->n_params, P->key = key;
    int64_t n = 0;
    for (int i = 0; i < m->n_params; i++) n += tensor_items(&m->params[i], i, o->lo, o->hi, NULL);
    TERA_ASSERTF(n < INT32_MAX, "%lld optimizer work items", (long long)n);
    P->n_items = (int)n;
    P->items = tera_malloc(sizeof(optim_item) * (size_t)(n > 0 ? n : 1));
    P->part = tera_calloc((size_t)(3 * (n > 0 ? n : 1)), sizeof(double));
    int k = 0;
    for (int i = 0; i < m->n_params; i++) k += tensor_items(&m->params[i], i, o->lo, o->hi, P->items + k);
    o->plan = P;
}

void tera_adamw_init_range(tera_adamw *o, int64_t lo, int64_t hi) {
    o->lo = lo;
    o->hi = hi;
    o->n = hi - lo;
    o->t = 0;
    o->m = tera_calloc((size_t)(2 * o->n + 1), sizeof(float));
    o->v = o->m + o->n;
    o->mh = o->vh = NULL; /* fp32 moments */
    o->sr_seed = 0;
    o->g = o->w = NULL;
    o->view = 0;
    o->plan = NULL;
    o->w16 = NULL;
}

void tera_adamw_init(tera_adamw *o, int64_t n) { tera_adamw_init_range(o, 0, n); }

void tera_adamw_init_range_bf16(tera_adamw *o, int64_t lo, int64_t hi, uint64_t seed) {
    o->lo = lo;
    o->hi = hi;
    o->n = hi - lo;
    o->t = 0;
    o->m = o->v = NULL;
    o->mh = tera_calloc((size_t)(2 * o->n + 2), sizeof(uint16_t)); /* bf16 zero: all bits clear */
    o->vh = o->mh + o->n;
    o->sr_seed = seed;
    o->g = o->w = NULL;
    o->view = 0;
    o->plan = NULL;
    o->w16 = NULL;
}

int64_t tera_adamw_moment_bytes(const tera_adamw *o) {
    return (int64_t)(o->mh ? 2 * sizeof(uint16_t) : 2 * sizeof(float)) * o->n;
}

void tera_adamw_moments_get(const tera_adamw *o, int k, int64_t a, int64_t n, float *dst) {
    TERA_ASSERTF((k == 1 || k == 2) && a >= 0 && n >= 0 && a + n <= o->n, "moments %d [%ld, +%ld) of %ld", k, (long)a,
                 (long)n, (long)o->n);
    if (o->mh) {
        const uint16_t *h = (k == 1 ? o->mh : o->vh) + a;
        for (int64_t i = 0; i < n; i++) dst[i] = tera_bf16_widen(h[i]);
    } else {
        memcpy(dst, (k == 1 ? o->m : o->v) + a, sizeof(float) * (size_t)n);
    }
}

void tera_adamw_moments_set(tera_adamw *o, int k, int64_t a, int64_t n, const float *src) {
    TERA_ASSERTF((k == 1 || k == 2) && a >= 0 && n >= 0 && a + n <= o->n, "moments %d [%ld, +%ld) of %ld", k, (long)a,
                 (long)n, (long)o->n);
    if (o->mh) {
        uint16_t *h = (k == 1 ? o->mh : o->vh) + a;
        for (int64_t i = 0; i < n; i++) h[i] = tera_bf16_nearest(src[i]);
    } else {
        memcpy((k == 1 ? o->m : o->v) + a, src, sizeof(float) * (size_t)n);
    }
}

/* ---- the random bits of the bf16 moments' stochastic rounding
 * A counter-based generator, cheap enough to run beside the memory-bound update (two 32-bit
 * multiplies per round, vectorised with the rest of the loop): the key (seed, update t) and the
 * parameter tensor with the high half of the element index give two 32-bit words k0, k1 once per
 * run of elements (tera_hash64, the splitmix64 finaliser); element e then draws
 *   mix(mix(lo32(e) ^ k0) ^ k1),  mix(x) = Wellons' "lowbias32" (x ^= x >> 16, x *= 0x21f0aaad,
 *   x ^= x >> 15, x *= 0x735a2d97, x ^= x >> 15)
 * (mix is a bijection of 32-bit words, so elements of one run never share a draw). */
static inline uint32_t sr_mix(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21f0aaadu;
    x ^= x >> 15;
    x *= 0x735a2d97u;
    x ^= x >> 15;
    return x;
}

uint64_t tera_moment_key(uint64_t seed, int64_t t) {
    return tera_hash64(tera_hash64(seed ^ 0x6d6f6d656e747331ull) + (uint64_t)t); /* "moments1" */
}

static inline uint64_t sr_run_key(uint64_t key, int tensor, int64_t e) {
    return tera_hash64(key ^ tera_hash64((((uint64_t)(uint32_t)tensor << 32) | ((uint64_t)e >> 32)) +
                                         0x9E3779B97F4A7C15ull));
}

uint32_t tera_moment_random(uint64_t key, int tensor, int64_t e) {
    const uint64_t kk = sr_run_key(key, tensor, e);
    return sr_mix(sr_mix((uint32_t)e ^ (uint32_t)kk) ^ (uint32_t)(kk >> 32));
}

void tera_adamw_free(tera_adamw *o) {
    if (!o->view) free(o->m), free(o->mh);
    if (o->plan) free(o->plan->items), free(o->plan->part), free(o->plan);
    memset(o, 0, sizeof *o);
}

/* Software prefetch PF_AHEAD elements ahead of each stream of the passes (8 KiB of fp32): with only
 * 2-5 streams per thread the hardware prefetchers alone left the norm pass below the update pass's
 * bandwidth (docs/PERFORMANCE.md, "Optimizer"). Addresses past an array's end are harmless (a
 * prefetch never faults). */
#define PF_AHEAD 2048
#define PF(p) __builtin_prefetch((const void *)((uintptr_t)(p) + PF_AHEAD * sizeof(*(p))), 0, 3) /* no pointer past the end */

#define LANES 16  /* fp32 lanes of the AdamW pass's sums */
#define SQ_LANES 32 /* fp64 lanes of the gradient norm (four 8-wide accumulators: latency hidden) */

/* sum of g[j]^2 over n elements: the exact fp32 squares added in fp64, lane j % SQ_LANES (fp32 sums
 * over short blocks measured up to 1.6x faster on one core here, but the norm would lose its fp64
 * accuracy: ~1e-7 relative instead of the 1e-9 tests/test_model.c holds it to). sq_lanes adds
 * elements [j, n) into the lanes, sq_total adds the lanes up in order. */
static inline __attribute__((always_inline)) void sq_lanes(double *restrict acc, const float *restrict g, int64_t j,
                                                          int64_t n) {
    for (; j + SQ_LANES <= n; j += SQ_LANES)
        for (int l = 0; l < SQ_LANES; l++) acc[l] += (double)g[j + l] * (double)g[j + l];
    for (; j < n; j++) acc[j % SQ_LANES] += (double)g[j] * (double)g[j];
}

static inline double sq_total(const double *acc) {
    double s = 0.0;
    for (int l = 0; l < SQ_LANES; l++) s += acc[l];
    return s;
}

static double sq_sum(const float *restrict g, int64_t n) {
    double acc[SQ_LANES] = {0};
    sq_lanes(acc, g, 0, n);
    return sq_total(acc);
}

/* Two items at once, each in its own lanes (the numbers of sq_sum on each): two read streams per
 * thread instead of one, which alone left this pass latency-bound (about 20% less CPU time per pass
 * on bench-m's gradients here; docs/PERFORMANCE.md, "Optimizer"). */
static void sq_sum2(const float *restrict x, int64_t nx, const float *restrict y, int64_t ny, double *rx,
                    double *ry) {
    double ax[SQ_LANES] = {0}, ay[SQ_LANES] = {0};
    const int64_t n = nx < ny ? nx : ny;
    int64_t j = 0;
    for (; j + SQ_LANES <= n; j += SQ_LANES) { /* SQ_LANES floats: two lines a stream */
        PF(x + j), PF(x + j + 16), PF(y + j), PF(y + j + 16);
        for (int l = 0; l < SQ_LANES; l++) ax[l] += (double)x[j + l] * (double)x[j + l];
        for (int l = 0; l < SQ_LANES; l++) ay[l] += (double)y[j + l] * (double)y[j + l];
    }
    sq_lanes(ax, x, j, nx);
    sq_lanes(ay, y, j, ny);
    *rx = sq_total(ax), *ry = sq_total(ay);
}

/* ---- experts whose gradients were not written (tera_model_grads_sparse): the marks apply to the
 * model's own gradient buffer only; an item of a marked expert is read as zeros: the norm adds
 * nothing for it (a zero square adds nothing to a non-negative sum: the same bits), the update reads
 * its gradient from optim_zeros (the same arithmetic on the same zeros the dispatcher would have
 * written) and never from the buffer. */
static float optim_zeros[TERA_OPTIM_CHUNK]; /* read only: the update clears no gradient when marks apply */

static const uint8_t *marks_of(const tera_model *m, const float *glo, int64_t lo) {
    return m->g_sparse && m->g && glo == m->g + lo ? m->g_absent : NULL;
}

static inline int item_absent(const uint8_t *absent, const optim_item *it) {
    return absent && it->slab >= 0 && absent[it->slab];
}

typedef struct {
    const float *glo; /* the gradients of [lo, hi) */
    const optim_item *it;
    const uint8_t *absent; /* the model's marks (NULL: none apply) */
    double *part;
    int64_t lo;
} sq_ctx;

static void sq_items(void *arg, int64_t a, int64_t b) {
    const sq_ctx *c = arg;
    const optim_item *it = c->it;
    for (int64_t k = a; k < b;) {
        if (item_absent(c->absent, &it[k])) {
            c->part[k++] = 0.0;
        } else if (k + 1 < b && !item_absent(c->absent, &it[k + 1])) {
            sq_sum2(c->glo + (it[k].a - c->lo), it[k].b - it[k].a, c->glo + (it[k + 1].a - c->lo),
                    it[k + 1].b - it[k + 1].a, &c->part[k], &c->part[k + 1]);
            k += 2;
        } else {
            c->part[k] = sq_sum(c->glo + (it[k].a - c->lo), it[k].b - it[k].a);
            k++;
        }
    }
}

double tera_adamw_grad_sq(tera_adamw *o, const tera_model *m, double *sq) {
    tera_adamw_plan(o, m);
    const struct tera_adamw_plan *P = o->plan;
    const optim_item *it = P->items;
    double *part = P->part;
    const float *glo = o->g ? o->g : m->g + o->lo;
    sq_ctx ctx = {.glo = glo, .it = it, .absent = marks_of(m, glo, o->lo), .part = part, .lo = o->lo};
    for_items(m->be, P->n_items, sq_items, &ctx);
    if (sq)
        for (int i = 0; i < m->n_params; i++) sq[i] = 0.0;
    double total = 0.0;
    for (int k = 0; k < P->n_items;) { /* a tensor's items are consecutive */
        const int p = it[k].p;
        double t = 0.0;
        for (; k < P->n_items && it[k].p == p; k++) t += part[k];
        if (sq) sq[p] = t;
        total += t;
    }
    return total;
}

typedef struct {
    float b1, b2, omb1, omb2, step_size, inv_bc2_sqrt, eps, gs;
} adam_k;

/* The bf16 weight shadow written by the update (tera_adamw.w16, include/tera/backend.h
 * weights_shadow_out) takes the products' rounding, tera_bf16_rne (include/tera/bf16.h).
 * tests/test_optim_shadow.c checks it against tera_round_bf16 over every high half. */
uint16_t tera_adamw_shadow_round(float x) { return tera_bf16_rne(x); }

/* The shadow's blocks of 16 (32 bytes): with AVX-512 and a 32-byte aligned start, non-temporal
 * stores, which do not read the line first (the shadow is write-only here: 2 of its 4 bytes of traffic
 * per parameter were that read; docs/PERFORMANCE.md, wave 23); a store fence after the chunk orders
 * them before the pass's end. Else plain stores. The same bits either way. */
#ifdef OPTIM_AVX512
#define SHADOW_STREAMS(p) (((uintptr_t)(p) & 31) == 0)
static inline void shadow_store(uint16_t *restrict dst, const uint16_t *restrict s16, int stream) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)s16);
    if (stream) _mm256_stream_si256((__m256i *)(void *)dst, v);
    else _mm256_storeu_si256((__m256i *)(void *)dst, v);
}
static inline void shadow_fence(void) { _mm_sfence(); }
#else
#define SHADOW_STREAMS(p) 0
static inline void shadow_store(uint16_t *restrict dst, const uint16_t *restrict s16, int stream) {
    (void)stream;
    memcpy(dst, s16, 16 * sizeof *s16);
}
static inline void shadow_fence(void) {}
#endif

/* One item of the fused pass: w, g, mm, vv [n] (the same element range). */
static inline __attribute__((always_inline)) void adamw_chunk(float *restrict w, float *restrict g,
                                                              float *restrict mm, float *restrict vv,
                                                              uint16_t *restrict w16, int64_t n, const adam_k *k,
                                                              float decay, int zero_grad, int shadow, double *usq,
                                                              double *psq) {
    const float b1 = k->b1, b2 = k->b2, omb1 = k->omb1, omb2 = k->omb2, ss = k->step_size, ib = k->inv_bc2_sqrt,
                eps = k->eps, gs = k->gs;
    float ua[LANES] = {0}, pa[LANES] = {0};
    int64_t j = 0;
    /* the shadow of a whole block of LANES, 32 bytes, stored around the caches where aligned
     * (shadow_store: nothing reads it before the next step's products, so a store through the cache
     * would first read each line for nothing) */
    const int stream = shadow && SHADOW_STREAMS(w16);
#define ADAMW_ELEM(J, L, SH)                                                                       \
    do {                                                                                           \
        const float gj = g[J] * gs, w0 = w[J];                                                     \
        const float mj = b1 * mm[J] + omb1 * gj, vj = b2 * vv[J] + omb2 * gj * gj;                 \
        const float wj = w0 * decay - ss * mj / (sqrtf(vj) * ib + eps);                            \
        mm[J] = mj, vv[J] = vj, w[J] = wj;                                                         \
        if (shadow) SH = tera_bf16_rne(wj);                                                         \
        ua[L] += (wj - w0) * (wj - w0);                                                            \
        pa[L] += w0 * w0;                                                                          \
        if (zero_grad) g[J] = 0.0f;                                                                \
    } while (0)
    for (; j + LANES <= n; j += LANES) { /* LANES floats: one line a stream */
        PF(g + j), PF(w + j), PF(mm + j), PF(vv + j);
        uint16_t s16[LANES];
        for (int l = 0; l < LANES; l++) ADAMW_ELEM(j + l, l, s16[l]);
        if (shadow) shadow_store(w16 + j, s16, stream);
    }
    for (; j < n; j++) ADAMW_ELEM(j, j % LANES, w16[j]);
#undef ADAMW_ELEM
    if (stream) shadow_fence();
    float us = 0.0f, ps = 0.0f;
    for (int l = 0; l < LANES; l++) us += ua[l], ps += pa[l];
    *usq = us, *psq = ps;
}

typedef struct {
    float *w, *g, *m, *v; /* the range [lo, hi)'s parameters, gradients and moments */
    uint16_t *w16;        /* the range's bf16 weight shadow, NULL: none */
    const optim_item *it;
    const uint8_t *absent; /* the model's marks (NULL: none apply) */
    const tera_param *params;
    double *part;
    int64_t lo;
    adam_k k;
    float wdecay;
    int zero_grad;
} step_ctx;

static void step_items(void *arg, int64_t a, int64_t b) {
    const step_ctx *c = arg;
    for (int64_t q = a; q < b; q++) {
        const optim_item *it = &c->it[q];
        const int64_t r = it->a - c->lo, n = it->b - it->a;
        const float decay = c->params[it->p].decay ? c->wdecay : 1.0f;
        double *part = c->part + 3 * q;
        uint16_t *w16 = c->w16 ? c->w16 + r : NULL;
        float *g = item_absent(c->absent, it) ? optim_zeros : c->g + r; /* (n <= TERA_OPTIM_CHUNK) */
        /* four copies of the loop: clearing the gradient and writing the shadow decided outside it */
        if (c->zero_grad && w16)
            adamw_chunk(c->w + r, g, c->m + r, c->v + r, w16, n, &c->k, decay, 1, 1, &part[1], &part[2]);
        else if (c->zero_grad)
            adamw_chunk(c->w + r, g, c->m + r, c->v + r, NULL, n, &c->k, decay, 1, 0, &part[1], &part[2]);
        else if (w16)
            adamw_chunk(c->w + r, g, c->m + r, c->v + r, w16, n, &c->k, decay, 0, 1, &part[1], &part[2]);
        else
            adamw_chunk(c->w + r, g, c->m + r, c->v + r, NULL, n, &c->k, decay, 0, 0, &part[1], &part[2]);
    }
}

/* bf16 moments: elements [0, n) of one run whose element 0 is element c0 (low 32 bits; a run never
 * crosses a multiple of 2^32) of its tensor; the same arithmetic as adamw_chunk on the widened
 * moments, then the new moments rounded stochastically (tera_bf16_stochastic) with the element's
 * draw. Sums into *usq, *psq (added). */
static inline __attribute__((always_inline)) void adamw_chunk_bf16(float *restrict w, float *restrict g,
                                                                   uint16_t *restrict mm, uint16_t *restrict vv,
                                                                   uint16_t *restrict w16, int64_t n,
                                                                   const adam_k *k, float decay, int zero_grad,
                                                                   int shadow, uint32_t c0, uint32_t k0,
                                                                   uint32_t k1, double *usq, double *psq) {
    const float b1 = k->b1, b2 = k->b2, omb1 = k->omb1, omb2 = k->omb2, ss = k->step_size, ib = k->inv_bc2_sqrt,
                eps = k->eps, gs = k->gs;
    float ua[LANES] = {0}, pa[LANES] = {0};
    int64_t j = 0;
#ifdef OPTIM_AVX512
    /* 16 elements a vector, the same operations in the same order as ADAMW_ELEM_BF16 below (no
     * contraction; lane l of the sums takes elements j = l mod 16, as ua[j % LANES] does), so the
     * same bits; GCC vectorised the scalar form only 8 wide here, at a third more CPU time */
    if (n >= 16) {
        const int stream = shadow && SHADOW_STREAMS(w16);
        _Static_assert(LANES == 16, "one vector of sums");
        const __m512 vb1 = _mm512_set1_ps(b1), vb2 = _mm512_set1_ps(b2), vomb1 = _mm512_set1_ps(omb1),
                     vomb2 = _mm512_set1_ps(omb2), vss = _mm512_set1_ps(ss), vib = _mm512_set1_ps(ib),
                     veps = _mm512_set1_ps(eps), vgs = _mm512_set1_ps(gs), vdecay = _mm512_set1_ps(decay);
        __m512 vua = _mm512_setzero_ps(), vpa = _mm512_setzero_ps();
        const __m512i vk0 = _mm512_set1_epi32((int)k0), vk1 = _mm512_set1_epi32((int)k1),
                      low16 = _mm512_set1_epi32(0xFFFF), mhi = _mm512_set1_epi32(0x7F0000),
                      qbit = _mm512_set1_epi32(0x400000), step = _mm512_set1_epi32(16),
                      K1 = _mm512_set1_epi32((int)0x21f0aaadu), K2 = _mm512_set1_epi32((int)0x735a2d97u);
        /* word permutations (AVX512BW vpermw / vpermt2w, one instruction each in place of a shift and
         * a two-uop vpmovdw per vector): the high words of two vectors of 32-bit lanes into one
         * (words 0-15 from the first, 16-31 from the second), and 16 bf16 words widened to the high
         * words of 32-bit lanes (the low words zeroed by the mask) */
        static const uint16_t hi_idx[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                            33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
        static const uint16_t wide_idx[32] = {0, 0, 0, 1, 0, 2,  0, 3,  0, 4,  0, 5,  0, 6,  0, 7,
                                              0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15};
        const __m512i hi = _mm512_loadu_si512(hi_idx), wide = _mm512_loadu_si512(wide_idx);
        /* the element counters c0 + j + lane (mod 2^32), advanced by 16 a vector */
        __m512i ctr = _mm512_add_epi32(_mm512_set1_epi32((int)c0),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
#define SR_MIX16(x)                                                                                \
    do {                                                                                           \
        x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));                                         \
        x = _mm512_mullo_epi32(x, K1);                                                             \
        x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));                                         \
        x = _mm512_mullo_epi32(x, K2);                                                             \
        x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));                                         \
    } while (0)
/* tera_bf16_stochastic on 16 lanes, the result in each lane's high word: u + r, or where sp (an
 * infinity or NaN) u itself with bit 22 set for a NaN whose payload would vanish (the scalar form's
 * (u >> 16) | 0x40) */
#define SR_SPECIAL16(u, sp, out)                                                                   \
    do {                                                                                           \
        const __mmask16 q = _mm512_mask_test_epi32_mask(sp, u, low16) & _mm512_testn_epi32_mask(u, mhi); \
        out = _mm512_mask_blend_epi32(sp, out, _mm512_mask_or_epi32(u, q, u, qbit));               \
    } while (0)
        for (; j + 16 <= n; j += 16) {
            PF(g + j), PF(w + j), PF(mm + j), PF(vv + j); /* a line of g and w, half a line of m and v */
            const __m512 gj = _mm512_mul_ps(_mm512_loadu_ps(g + j), vgs), w0 = _mm512_loadu_ps(w + j);
            const __m512 m0 = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
                0xAAAAAAAAu, wide, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(mm + j)))));
            const __m512 v0 = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
                0xAAAAAAAAu, wide, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vv + j)))));
            const __m512 mj = _mm512_add_ps(_mm512_mul_ps(vb1, m0), _mm512_mul_ps(vomb1, gj));
            const __m512 vj = _mm512_add_ps(_mm512_mul_ps(vb2, v0), _mm512_mul_ps(_mm512_mul_ps(vomb2, gj), gj));
            const __m512 wj = _mm512_sub_ps(
                _mm512_mul_ps(w0, vdecay),
                _mm512_div_ps(_mm512_mul_ps(vss, mj), _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vj), vib), veps)));
            __m512i x = _mm512_xor_si512(ctr, vk0);
            ctr = _mm512_add_epi32(ctr, step);
            SR_MIX16(x);
            x = _mm512_xor_si512(x, vk1);
            SR_MIX16(x);
            const __m512i um = _mm512_castps_si512(mj), uv = _mm512_castps_si512(vj);
            __m512i sm = _mm512_add_epi32(um, _mm512_and_si512(x, low16)), sv = _mm512_add_epi32(uv, _mm512_srli_epi32(x, 16));
            const __mmask16 spm = _mm512_fpclass_ps_mask(mj, 0x99), spv = _mm512_fpclass_ps_mask(vj, 0x99); /* NaN, +-inf */
            if (!_kortestz_mask16_u8(spm, spv)) {
                SR_SPECIAL16(um, spm, sm);
                SR_SPECIAL16(uv, spv, sv);
            }
            const __m512i hv = _mm512_permutex2var_epi16(sm, hi, sv); /* m's 16 bf16, then v's */
            _mm256_storeu_si256((__m256i *)(mm + j), _mm512_castsi512_si256(hv));
            _mm256_storeu_si256((__m256i *)(vv + j), _mm512_extracti64x4_epi64(hv, 1));
            _mm512_storeu_ps(w + j, wj);
            if (shadow) { /* tera_bf16_rne on 16 lanes; non-temporal where aligned (shadow_store) */
                const __m256i s16 = _mm512_castsi512_si256(_mm512_permutexvar_epi16(hi, tera_bf16_rne16(_mm512_castps_si512(wj))));
                if (stream) _mm256_stream_si256((__m256i *)(void *)(w16 + j), s16);
                else _mm256_storeu_si256((__m256i *)(void *)(w16 + j), s16);
            }
            const __m512 d = _mm512_sub_ps(wj, w0);
            vua = _mm512_add_ps(vua, _mm512_mul_ps(d, d));
            vpa = _mm512_add_ps(vpa, _mm512_mul_ps(w0, w0));
            if (zero_grad) _mm512_storeu_ps(g + j, _mm512_setzero_ps());
        }
#undef SR_SPECIAL16
#undef SR_MIX16
        if (stream) shadow_fence();
        _mm512_storeu_ps(ua, vua);
        _mm512_storeu_ps(pa, vpa);
    }
#endif
#define ADAMW_ELEM_BF16(J, L)                                                                      \
    do {                                                                                           \
        const float gj = g[J] * gs, w0 = w[J];                                                     \
        const float m0 = tera_bf16_widen(mm[J]), v0 = tera_bf16_widen(vv[J]);                      \
        const float mj = b1 * m0 + omb1 * gj, vj = b2 * v0 + omb2 * gj * gj;                       \
        const float wj = w0 * decay - ss * mj / (sqrtf(vj) * ib + eps);                            \
        const uint32_t r = sr_mix(sr_mix((c0 + (uint32_t)(J)) ^ k0) ^ k1);                         \
        mm[J] = tera_bf16_stochastic(mj, r & 0xFFFFu), vv[J] = tera_bf16_stochastic(vj, r >> 16);  \
        w[J] = wj;                                                                                 \
        if (shadow) w16[J] = tera_bf16_rne(wj);                                                     \
        ua[L] += (wj - w0) * (wj - w0);                                                            \
        pa[L] += w0 * w0;                                                                          \
        if (zero_grad) g[J] = 0.0f;                                                                \
    } while (0)
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) ADAMW_ELEM_BF16(j + l, l);
    for (; j < n; j++) ADAMW_ELEM_BF16(j, j % LANES);
#undef ADAMW_ELEM_BF16
    float us = 0.0f, ps = 0.0f;
    for (int l = 0; l < LANES; l++) us += ua[l], ps += pa[l];
    *usq += us, *psq += ps;
}

typedef struct {
    float *w, *g;
    uint16_t *m, *v; /* the range [lo, hi)'s bf16 moments */
    uint16_t *w16;   /* the range's bf16 weight shadow, NULL: none */
    const optim_item *it;
    const uint8_t *absent; /* the model's marks (NULL: none apply) */
    const tera_param *params;
    double *part;
    int64_t lo;
    adam_k k;
    float wdecay;
    int zero_grad;
    uint64_t key; /* tera_moment_key(seed, t) */
} step16_ctx;

/* An item of tensor p in runs contiguous in the tensor's global element order (the block's rows
 * when tensor parallelism slices a dimension, tera_block_run), each with the draws of its global
 * element indices. */
static void step_items_bf16(void *arg, int64_t a, int64_t b) {
    const step16_ctx *c = arg;
    for (int64_t q = a; q < b; q++) {
        const optim_item *it = &c->it[q];
        const tera_param *tp = &c->params[it->p];
        const float decay = tp->decay ? c->wdecay : 1.0f;
        double *part = c->part + 3 * q;
        part[1] = part[2] = 0.0;
        const int absent = item_absent(c->absent, it);
        /* a hand-built table without a block description: the local order is the global one */
        const int blocked = tp->len[0] * tp->len[1] * tp->len[2] == tp->numel && tp->shape[1] > 0 && tp->shape[2] > 0;
        int64_t run_len = tp->numel, g0, l0;
        if (blocked) tera_block_run(tp->shape, tp->lo, tp->len, 0, &g0, &l0, &run_len);
        for (int64_t j = it->a - tp->offset, je = it->b - tp->offset; j < je;) { /* j: in the block */
            int64_t e = j, n = je - j;
            if (blocked) {
                const int64_t r = j / run_len;
                int64_t gr, lr, nr;
                tera_block_run(tp->shape, tp->lo, tp->len, r, &gr, &lr, &nr);
                e = gr + (j - lr);
                if (lr + nr - j < n) n = lr + nr - j;
            }
            const int64_t to_wrap = ((e >> 32) + 1) * ((int64_t)1 << 32) - e; /* a run stays below a multiple of 2^32 */
            if (to_wrap < n) n = to_wrap;
            const uint64_t kk = sr_run_key(c->key, it->p, e);
            const int64_t r0 = tp->offset + j - c->lo;
            uint16_t *w16 = c->w16 ? c->w16 + r0 : NULL;
            float *g = absent ? optim_zeros + (tp->offset + j - it->a) : c->g + r0;
#define CHUNK16(ZG, SH)                                                                            \
    adamw_chunk_bf16(c->w + r0, g, c->m + r0, c->v + r0, w16, n, &c->k, decay, ZG, SH, (uint32_t)e, \
                     (uint32_t)kk, (uint32_t)(kk >> 32), &part[1], &part[2])
            if (c->zero_grad && w16) CHUNK16(1, 1);
            else if (c->zero_grad) CHUNK16(1, 0);
            else if (w16) CHUNK16(0, 1);
            else CHUNK16(0, 0);
#undef CHUNK16
            j += n;
        }
    }
}

void tera_adamw_step(tera_adamw *o, tera_model *m, float lr, float grad_scale, const tera_optim_config *c,
                     int zero_grad, double *update_sq, double *param_sq) {
    tera_adamw_step_by_param(o, m, lr, grad_scale, c, zero_grad, update_sq, param_sq, NULL, NULL);
}

void tera_adamw_step_by_param(tera_adamw *o, tera_model *m, float lr, float grad_scale, const tera_optim_config *c,
                              int zero_grad, double *update_sq, double *param_sq, double *usq, double *psq) {
    o->t++;
    tera_adamw_plan(o, m);
    const struct tera_adamw_plan *P = o->plan;
    const float b1 = c->beta1, b2 = c->beta2;
    const float bc1 = 1.0f - powf(b1, (float)o->t), bc2 = 1.0f - powf(b2, (float)o->t);
    const adam_k k = {.b1 = b1, .b2 = b2, .omb1 = 1.0f - b1, .omb2 = 1.0f - b2, .step_size = lr / bc1,
                      .inv_bc2_sqrt = 1.0f / sqrtf(bc2), .eps = c->eps, .gs = grad_scale};
    const optim_item *it = P->items;
    double *part = P->part;
    float *const glo = o->g ? o->g : m->g + o->lo;
    const uint8_t *absent = marks_of(m, glo, o->lo);
    TERA_ASSERTF(!(absent && zero_grad), "the update would clear gradients some experts never wrote (marks and "
                 "zero_grad together)");
    if (o->mh) {
        step16_ctx ctx = {.w = o->w ? o->w : m->w + o->lo, .g = glo, .m = o->mh, .v = o->vh,
                          .w16 = o->w16, .it = it, .absent = absent, .params = m->params, .part = part, .lo = o->lo, .k = k,
                          .wdecay = 1.0f - lr * c->weight_decay, .zero_grad = zero_grad,
                          .key = tera_moment_key(o->sr_seed, o->t)};
        for_items(m->be, P->n_items, step_items_bf16, &ctx);
    } else {
        step_ctx ctx = {.w = o->w ? o->w : m->w + o->lo, .g = glo, .m = o->m, .v = o->v,
                        .w16 = o->w16, .it = it, .absent = absent, .params = m->params, .part = part, .lo = o->lo, .k = k,
                        .wdecay = 1.0f - lr * c->weight_decay, .zero_grad = zero_grad};
        for_items(m->be, P->n_items, step_items, &ctx);
    }
    double usum = 0.0, psum = 0.0;
    for (int q = 0; q < P->n_items;) {
        const int p = it[q].p;
        double ut = 0.0, pt = 0.0;
        for (; q < P->n_items && it[q].p == p; q++) ut += part[3 * q + 1], pt += part[3 * q + 2];
        usum += ut, psum += pt;
        if (usq) usq[p] += ut;
        if (psq) psq[p] += pt;
    }
    if (update_sq) *update_sq = usum;
    if (param_sq) *param_sq = psum;
}

/* The LR schedules (docs/SCHEDULES.md has the formulas): a linear warmup over W steps, then
 *   cosine: min + (max - min) (1 + cos(pi p)) / 2,  p = (s - W) / (S - W)   (MODEL.md, bit for bit)
 *   linear: min + (max - min) (1 - p)
 *   wsd:    max until D0 = max(W, S - round(decay_fraction S)), then min + (max - min) shape(q),
 *           q = (s - D0) / (S - D0), shape(q) = 1 - q | (1 + cos(pi q)) / 2 | 1 - sqrt(q)
 * with p and q clamped to [0, 1]; steps at or after S keep the last value. */
float tera_lr_at(const tera_train_config *t, int64_t s) {
    const int64_t W = t->warmup_steps, S = t->steps;
    if (s < W) return t->lr * (float)(s + 1) / (float)W;
    if (t->lr_schedule == TERA_LR_WSD) {
        int64_t D0 = S - (int64_t)llround((double)t->decay_fraction * (double)S);
        if (D0 < W) D0 = W;
        if (s < D0) return t->lr;
        if (S <= D0) return t->min_lr;
        double q = (double)(s - D0) / (double)(S - D0);
        if (q > 1.0) q = 1.0;
        const double f = t->decay_shape == TERA_DECAY_COSINE ? 0.5 * (1.0 + cos(M_PI * q))
                         : t->decay_shape == TERA_DECAY_SQRT ? 1.0 - sqrt(q)
                                                             : 1.0 - q;
        return (float)(t->min_lr + (t->lr - t->min_lr) * f);
    }
    if (S <= W) return t->min_lr;
    double prog = (double)(s - W) / (double)(S - W);
    if (prog > 1.0) prog = 1.0;
    if (t->lr_schedule == TERA_LR_LINEAR) return (float)(t->min_lr + (t->lr - t->min_lr) * (1.0 - prog));
    return (float)(t->min_lr + 0.5 * (t->lr - t->min_lr) * (1.0 + cos(M_PI * prog)));
}

double tera_grad_sq_by_param(const tera_model *m, double *sq) {
    return tera_grad_sq_by_param_range(m, 0, m->n_floats, sq);
}

double tera_grad_sq_by_param_range(const tera_model *m, int64_t lo, int64_t hi, double *sq) {
    return tera_grad_sq_by_param_at(m, lo, hi, m->g + lo, sq);
}

double tera_grad_sq_by_param_at(const tera_model *m, int64_t lo, int64_t hi, const float *glo, double *sq) {
    /* the optimizer's pass on a plan of its own (allocated here: not for the step loop) */
    tera_adamw o = {.lo = lo, .hi = hi, .n = hi - lo, .g = (float *)glo};
    const double total = tera_adamw_grad_sq(&o, m, sq);
    free(o.plan->items), free(o.plan->part), free(o.plan);
    return total;
}

double tera_grad_norm(const tera_model *m) { return sqrt(tera_grad_sq_by_param(m, NULL)); }

typedef struct {
    float *g, s;
} scale_ctx;

static void scale_range(void *arg, int64_t lo, int64_t hi, int worker) {
    (void)worker;
    const scale_ctx *c = arg;
    float *restrict g = c->g;
    const float s = c->s;
    for (int64_t i = lo; i < hi; i++) g[i] *= s;
}

void tera_grad_scale(tera_model *m, float s) {
    scale_ctx c = {.g = m->g, .s = s};
    if (m->be) m->be->ops.for_ranges(m->be, m->n_floats, scale_range, &c);
    else scale_range(&c, 0, m->n_floats, 0);
}
