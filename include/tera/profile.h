/* Per-operation wall-time profile of the training step (cheap: two clock reads per op). */
#ifndef TERA_PROFILE_H
#define TERA_PROFILE_H

#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define TERA_PROF_OPS(X)                                                                            \
    X(EMBED_FWD, "embedding fwd") X(EMBED_BWD, "embedding bwd")                                     \
    X(NORM_FWD, "rmsnorm fwd") X(NORM_BWD, "rmsnorm bwd")                                           \
    X(QKV_FWD, "qkv proj fwd") X(QKV_BWD, "qkv proj bwd")                                           \
    X(ROPE_FWD, "rope fwd") X(ROPE_BWD, "rope bwd")                                                 \
    X(ATTN_FWD, "attention fwd") X(ATTN_BWD, "attention bwd")                                       \
    X(OPROJ_FWD, "o proj fwd") X(OPROJ_BWD, "o proj bwd")                                           \
    X(ROUTER_FWD, "router fwd") X(ROUTER_BWD, "router bwd")                                         \
    X(DISPATCH, "dispatch/gather") X(COMBINE_FWD, "combine fwd") X(COMBINE_BWD, "combine bwd")      \
    X(EXPERT_FWD, "expert ffn fwd") X(EXPERT_BWD, "expert ffn bwd")                                 \
    X(SWIGLU_FWD, "swiglu fwd") X(SWIGLU_BWD, "swiglu bwd")                                         \
    X(DENSE_FWD, "dense/shared ffn fwd") X(DENSE_BWD, "dense/shared ffn bwd")                       \
    X(HEAD_FWD, "lm head fwd") X(HEAD_BWD, "lm head bwd")                                           \
    X(LOSS_FWD, "cross-entropy fwd") X(LOSS_BWD, "cross-entropy bwd")                               \
    X(TP_COMM, "tensor-parallel comm")                                                               \
    X(OPTIM, "optimizer") X(DATA, "data wait") X(OTHER, "other")

typedef enum {
#define TERA_PROF_ENUM(id, name) TERA_PROF_##id,
    TERA_PROF_OPS(TERA_PROF_ENUM)
#undef TERA_PROF_ENUM
    TERA_PROF_COUNT
} tera_prof_op;

extern double tera_prof_seconds[TERA_PROF_COUNT];
extern int64_t tera_prof_calls[TERA_PROF_COUNT];
/* Monotonic seconds (inline: the backends' product timer, TERA_PROF_PRODUCT, needs nothing of profile.c) */
static inline double tera_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
void tera_prof_reset(void);
/* Table of ops sorted by time with share of the total and GFLOP-free ms per step. */
void tera_prof_print(FILE *f, int steps);
/* Every rank's table side by side (tera bench with several ranks): sec and calls are
 * [world][TERA_PROF_COUNT] (seconds and calls summed over the steps, gathered from the ranks); an
 * operation no rank ran is left out. Columns per rank up to 8 ranks, else min / mean / max. */
void tera_prof_print_ranks(FILE *f, int steps, int world, const double *sec, const double *calls);

const char *tera_prof_name(int op);
/* The timeline (include/tera/trace.h): while a traced step runs, every timed op is also an event. */
extern volatile int tera_trace_active;
void tera_trace_prof(int op, double t0, double t1);
static inline void tera_prof_add(int op, double t0) {
    const double t1 = tera_now();
    tera_prof_seconds[op] += t1 - t0;
    tera_prof_calls[op]++;
    if (tera_trace_active) tera_trace_prof(op, t0, t1);
}

/* TERA_PROF(OP, statements...) times the statements (no #pragma inside: use BEGIN/END). */
#define TERA_PROF(op, ...)                                                                         \
    do {                                                                                           \
        double _t0 = tera_now();                                                                   \
        __VA_ARGS__;                                                                               \
        tera_prof_add(TERA_PROF_##op, _t0);                                                        \
    } while (0)
#define TERA_PROF_BEGIN(op) const double _tp_##op = tera_now()
#define TERA_PROF_END(op) tera_prof_add(TERA_PROF_##op, _tp_##op)

/* Matrix products by shape (`tera bench --products N`): while tera_prof_products_on is set, a
 * backend reports every product it runs, C[M,N] = op(A)[M,K] op(B)[K,N] (ta, tb: A or B
 * transposed), with its operands' precision, whether it ran on one thread beside others ("side":
 * inside a parallel region, e.g. experts side by side) or on every thread ("whole"), and its wall
 * seconds on the calling thread. The table holds TERA_PROF_PRODUCT_SHAPES distinct shapes; products
 * of further shapes are summed into one "rest" row. Thread-safe; no allocation (src/obs/prof_products.c). */
#define TERA_PROF_PRODUCT_SHAPES 1024
typedef enum { TERA_PROF_PROD_FP32 = 0, TERA_PROF_PROD_BF16 = 1 } tera_prof_prod_prec;
typedef struct {
    int64_t M, N, K;
    int prec, ta, tb, side;
    int64_t calls;
    double seconds; /* summed over calls (side: thread-seconds) */
    double flops;   /* 2 M N K per call, summed */
} tera_prof_product_row;
extern volatile int tera_prof_products_on;
void tera_prof_product(int prec, int ta, int tb, int64_t M, int64_t N, int64_t K, int side, double seconds);
void tera_prof_products_reset(void);
/* Copies up to max rows sorted by time (largest first) into rows; *rest (optional) gets the sum of
 * the rows not copied and of the shapes that did not fit in the table (M = N = K = 0). Returns the
 * number of rows copied. */
int tera_prof_products(tera_prof_product_row *rows, int max, tera_prof_product_row *rest);
/* The table's rows by kind, sorted by time: a linear layer's rows dimension (M, or K when A is
 * transposed: a weight gradient's reduction) summed over the shapes that differ only in it (the
 * experts' products, one shape per row count), then divided by the calls (rows per call, rounded).
 * Returns the number of kinds (at most max). */
int tera_prof_products_by_kind(tera_prof_product_row *kinds, int max);
/* Totals of the whole and side-by-side products: seconds and flops (either pointer may be NULL). */
void tera_prof_products_totals(double *whole_s, double *whole_flops, double *side_s, double *side_flops);
/* The top rows as a table, per step, with each class's total and rate. */
void tera_prof_products_print(FILE *f, int steps, int top);
/* Times one product when the table is on: TERA_PROF_PRODUCT(prec, ta, tb, M, N, K, side, call;) */
#define TERA_PROF_PRODUCT(prec, ta, tb, M, N, K, side, ...)                                        \
    do {                                                                                           \
        if (tera_prof_products_on) {                                                               \
            const double _pt0 = tera_now();                                                 \
            __VA_ARGS__;                                                                           \
            tera_prof_product(prec, ta, tb, M, N, K, side, tera_now() - _pt0);              \
        } else {                                                                                   \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)

#endif
