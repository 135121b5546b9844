/* Per-operation wall-time profile of the training step (cheap: two clock reads per op). */
#ifndef TERA_PROFILE_H
#define TERA_PROFILE_H

#include <stdint.h>
#include <stdio.h>

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
    X(TP_COMM, "tensor-parallel all-reduce")                                                         \
    X(OPTIM, "optimizer") X(DATA, "data wait") X(OTHER, "other")

typedef enum {
#define TERA_PROF_ENUM(id, name) TERA_PROF_##id,
    TERA_PROF_OPS(TERA_PROF_ENUM)
#undef TERA_PROF_ENUM
    TERA_PROF_COUNT
} tera_prof_op;

extern double tera_prof_seconds[TERA_PROF_COUNT];
extern int64_t tera_prof_calls[TERA_PROF_COUNT];
double tera_now(void); /* monotonic seconds */
void tera_prof_reset(void);
/* Table of ops sorted by time with share of the total and GFLOP-free ms per step. */
void tera_prof_print(FILE *f, int steps);

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

#endif
