/* The communicator's public functions (include/tera/comm.h), shared by every backend: choosing the
 * world's backend, the contracts' checks, routing (a one-rank group goes to the one-rank backend,
 * any other to its group's backend), the requests' public fields, the traffic counters, and the
 * watchdog's timeout with the step marks it is measured on. The backends (comm_single.c, comm_mpi.c)
 * implement struct tera_comm_backend (comm_impl.h). */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm_impl.h"

/* The backends that can serve a multi-rank world, tried in order; none launched: the one-rank world. */
static const struct tera_comm_backend *const g_backends[] = {&tera__comm_mpi};

static tera_comm g_world = {.be = &tera__comm_single, .ctx = NULL, .rank = 0, .size = 1};
static int g_inited = 0;

static const struct tera_comm_backend *be_of(const tera_comm *c) {
    return c->size > 1 ? c->be : &tera__comm_single;
}

/* ---- the timeout (parallel.timeout_s): fixed, off, or automatic from the measured steps. Atomics:
 * a backend's watchdog thread reads them. */
static _Atomic double g_user_timeout = -1.0; /* > 0 fixed, 0 off, < 0 automatic */
static _Atomic int g_in_step = 0;            /* between tera_comm_step_begin and _end */
static _Atomic long long g_step = -1;        /* the step begun last */
static _Atomic int g_steps_timed = 0;        /* steps measured in this process */
static _Atomic double g_slowest_step = 0.0;  /* the slowest of them after the first */

double tera_comm_timeout_now(void) {
    const double u = g_user_timeout;
    if (u >= 0.0) return u;
    const double auto_t = TERA_COMM_AUTO_FACTOR * g_slowest_step;
    if (g_in_step && g_steps_timed >= TERA_COMM_AUTO_AFTER_STEPS)
        return fmax(TERA_COMM_AUTO_FLOOR_S, auto_t);
    return fmax(TERA_COMM_STARTUP_S, auto_t);
}

void tera_comm_set_timeout(double seconds) { g_user_timeout = seconds < 0.0 ? -1.0 : seconds; }

int64_t tera__comm_step(void) { return (int64_t)g_step; }
int tera__comm_timeout_auto(void) { return g_user_timeout < 0.0; }

/* test hook: TERA_FAULT_STALL_STEP=S@RANK stops world rank RANK at the start of step S (it sleeps);
 * armed only in a launched (multi-rank backend's) world */
static long long g_stall_step = -1;
static int g_stall_rank = -1;

void tera_comm_step_begin(int64_t step) {
    g_step = step;
    g_in_step = 1;
    if (step == g_stall_step && g_world.rank == g_stall_rank) {
        fprintf(stderr, "tera: rank %d stalls at step %lld (TERA_FAULT_STALL_STEP)\n", g_world.rank, g_stall_step);
        fflush(stderr);
        for (;;) {
            struct timespec ts = {.tv_sec = 3600, .tv_nsec = 0};
            nanosleep(&ts, NULL);
        }
    }
}

void tera_comm_step_end(double seconds) {
    g_in_step = 0;
    if (g_steps_timed++ > 0 && seconds > g_slowest_step) g_slowest_step = seconds; /* the first is warm-up */
}

/* ---- the world */
tera_status tera_comm_init(int *argc, char ***argv) {
    if (g_inited) return TERA_OK;
    g_inited = 1;
    const struct tera_comm_backend *be = &tera__comm_single;
    for (size_t i = 0; i < sizeof g_backends / sizeof g_backends[0]; i++)
        if (g_backends[i]->launched()) {
            be = g_backends[i];
            break;
        }
    tera_comm w;
    const tera_status st = be->init(argc, argv, &w);
    if (st != TERA_OK) return st; /* the world stays one rank */
    g_world = w;
    if (be != &tera__comm_single) {
        const char *f = getenv("TERA_FAULT_STALL_STEP");
        if (f && *f) {
            const char *at = strchr(f, '@');
            g_stall_step = atoll(f);
            g_stall_rank = at ? atoi(at + 1) : 0;
        }
    }
    return TERA_OK;
}

void tera_comm_finalize(void) {
    if (g_inited) g_world.be->finalize(); /* idempotent in every backend */
}

tera_comm *tera_comm_world(void) { return &g_world; }
int tera_comm_rank(const tera_comm *c) { return c->rank; }
int tera_comm_size(const tera_comm *c) { return c->size; }
const char *tera_comm_backend(void) { return g_world.be->name; }

void tera_comm_print_error(const char *msg) { be_of(&g_world)->print_error(msg); }

/* ---- traffic: what a bandwidth-optimal (ring) algorithm sends from each rank */
static tera_comm_traffic g_traffic;
tera_comm_traffic tera_comm_traffic_get(void) { return g_traffic; }
void tera_comm_traffic_reset(void) { memset(&g_traffic, 0, sizeof g_traffic); }
static double ring_share(const tera_comm *c) { return (double)(c->size - 1) / (double)c->size; }

static int64_t total_count(const tera_comm *c, const int64_t *counts) {
    int64_t t = 0;
    for (int r = 0; r < c->size; r++) {
        TERA_ASSERTF(counts[r] >= 0, "negative count %ld for rank %d", (long)counts[r], r);
        t += counts[r];
    }
    return t;
}

/* ---- collectives */
static void allreduce(tera_comm *c, void *buf, int64_t n, tera_comm_dtype dt, size_t es, tera_comm_redop op) {
    if (c->size == 1 || n == 0) return; /* the one-rank answer: buf as it is */
    g_traffic.allreduce += 2.0 * ring_share(c) * (double)n * (double)es;
    c->be->allreduce(c, buf, n, dt, op);
}

void tera_comm_allreduce_f32(tera_comm *c, float *buf, int64_t n) {
    allreduce(c, buf, n, TERA_COMM_F32, 4, TERA_COMM_SUM);
}
void tera_comm_allreduce_f64(tera_comm *c, double *buf, int64_t n) {
    allreduce(c, buf, n, TERA_COMM_F64, 8, TERA_COMM_SUM);
}
void tera_comm_allreduce_i64(tera_comm *c, int64_t *buf, int64_t n) {
    allreduce(c, buf, n, TERA_COMM_I64, 8, TERA_COMM_SUM);
}
void tera_comm_allreduce_max_f32(tera_comm *c, float *buf, int64_t n) {
    allreduce(c, buf, n, TERA_COMM_F32, 4, TERA_COMM_MAX);
}

void tera_comm_reduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts) {
    if (c->size > 1) g_traffic.reduce_scatter += ring_share(c) * 4.0 * (double)total_count(c, counts);
    be_of(c)->reduce_scatter_f32(c, buf, counts);
}

void tera_comm_allgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    if (c->size > 1) g_traffic.allgather += ring_share(c) * 4.0 * (double)total_count(c, counts);
    be_of(c)->allgather_f32(c, buf, counts);
}

void tera_comm_alltoall_i32(tera_comm *c, const int32_t *send, int32_t *recv, int n) {
    TERA_ASSERTF(n >= 0, "all-to-all of %d values per rank", n);
    if (c->size > 1) g_traffic.alltoall += (double)(c->size - 1) * 4.0 * n;
    be_of(c)->alltoall_i32(c, send, recv, n);
}

void tera_comm_barrier(tera_comm *c) { be_of(c)->barrier(c); }

/* ---- non-blocking operations: the request's public fields are kept here */
static void req_set(tera_comm_req *req, const struct tera_comm_backend *be, void *op) {
    req->active = op != NULL;
    req->be = op ? be : NULL;
    req->op = op;
}

void tera_comm_iallreduce_f32(tera_comm *c, float *buf, int64_t n, tera_comm_req *req) {
    req_set(req, NULL, NULL);
    if (c->size == 1 || n == 0) return;
    g_traffic.allreduce += 2.0 * ring_share(c) * 4.0 * (double)n;
    req_set(req, c->be, c->be->iallreduce_f32(c, buf, n));
}

void tera_comm_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts, tera_comm_req *req) {
    req_set(req, NULL, NULL);
    if (c->size == 1) return;
    g_traffic.allgather += ring_share(c) * 4.0 * (double)total_count(c, counts);
    req_set(req, c->be, c->be->iallgather_f32(c, buf, counts));
}

static void p2p_check(const tera_comm *c, int64_t n, int peer, int send) {
    TERA_ASSERTF(c->size > 1 && peer != c->rank && peer >= 0 && peer < c->size,
                 "point-to-point %s rank %d of a group of %d", send ? "send to" : "receive from", peer, c->size);
    TERA_ASSERTF(n > 0, "point-to-point message of %ld floats", (long)n);
}

void tera_comm_isend_f32(tera_comm *c, const float *buf, int64_t n, int peer, int tag, tera_comm_req *req) {
    req_set(req, NULL, NULL);
    if (n == 0) return;
    p2p_check(c, n, peer, 1);
    g_traffic.p2p += 4.0 * (double)n;
    req_set(req, c->be, c->be->isend_f32(c, buf, n, peer, tag));
}

void tera_comm_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag, tera_comm_req *req) {
    req_set(req, NULL, NULL);
    if (n == 0) return;
    p2p_check(c, n, peer, 0);
    req_set(req, c->be, c->be->irecv_f32(c, buf, n, peer, tag));
}

void tera_comm_wait(tera_comm_req *req) {
    if (!req->active) return;
    req->be->wait(req->op);
    req_set(req, NULL, NULL);
}

void tera_comm_poll(tera_comm_req *reqs, int n) {
    for (int i = 0; i < n; i++)
        if (reqs[i].active && reqs[i].be->test(reqs[i].op)) req_set(&reqs[i], NULL, NULL);
}

/* ---- groups */
tera_comm *tera_comm_split(tera_comm *c, int color, int key) {
    tera_comm *g = tera_calloc(1, sizeof *g);
    be_of(c)->split(c, color, key, g);
    return g;
}

void tera_comm_free(tera_comm *c) {
    if (!c || c == &g_world) return;
    c->be->free(c);
    free(c);
}
