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
#include "tera/profile.h"
#include "tera/trace.h"

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
const char *tera_traffic_kind_name(int kind) {
    static const char *const names[TERA_BLOCKED_KINDS] = {"allreduce", "reduce_scatter", "allgather", "alltoall", "p2p",
                                                         "barrier"};
    return kind >= 0 && kind < TERA_BLOCKED_KINDS ? names[kind] : "?";
}
static void blocked(int kind, double s) { /* seconds blocked in an operation of this kind */
    g_traffic.blocked_s += s;
    g_traffic.blocked_kind_s[kind] += s;
}
void tera_comm_traffic_reset(void) { memset(&g_traffic, 0, sizeof g_traffic); }
static double ring_share(const tera_comm *c) { return (double)(c->size - 1) / (double)c->size; }

/* ---- nodes: g_node[w] is world rank w's node (NULL: every rank on node 0) */
static int *g_node = NULL;
static int g_n_nodes = 1;

int tera_comm_nodes(void) { return g_n_nodes; }
int tera_comm_node_of(int world_rank) {
    TERA_ASSERTF(world_rank >= 0 && world_rank < g_world.size, "world rank %d of %d", world_rank, g_world.size);
    return g_node ? g_node[world_rank] : 0;
}
int tera_comm_world_rank_of(const tera_comm *c, int r) {
    TERA_ASSERTF(r >= 0 && r < c->size, "member %d of a group of %d", r, c->size);
    return c->wrank ? c->wrank[r] : c == &g_world ? r : g_world.rank;
}
int tera_comm_member_node(const tera_comm *c, int r) { return tera_comm_node_of(tera_comm_world_rank_of(c, r)); }

tera_status tera_comm_set_nodes(int ranks_per_node) {
    const int W = g_world.size;
    if (ranks_per_node >= W) ranks_per_node = W; /* one node (a one-rank run of a cluster's config too) */
    if (ranks_per_node < 0 || (ranks_per_node > 0 && W % ranks_per_node != 0))
        return tera_fail(TERA_ERR_CONFIG, "parallel.ranks_per_node = %d must divide the %d ranks running (0 = the hosts)",
                         ranks_per_node, W);
    int *node = tera_calloc((size_t)W, sizeof(int));
    int n = 1;
    if (ranks_per_node > 0) {
        for (int w = 0; w < W; w++) node[w] = w / ranks_per_node;
        n = W / ranks_per_node;
    } else if (W > 1) {
        TERA_ASSERTF(g_world.be->host_leader, "backend %s cannot tell hosts apart", g_world.be->name);
        int64_t *lead = tera_calloc((size_t)W, sizeof(int64_t));
        lead[g_world.rank] = g_world.be->host_leader();
        g_world.be->allreduce(&g_world, lead, W, TERA_COMM_I64, TERA_COMM_SUM); /* set-up: not counted */
        n = 0;
        for (int w = 0; w < W; w++) { /* each host's leader is its lowest rank: hosts numbered in rank order */
            if (lead[w] == w) n++;
            int k = 0;
            for (int v = 0; v < lead[w]; v++) k += lead[v] == v;
            node[w] = k;
        }
        free(lead);
    }
    free(g_node);
    g_node = node;
    g_n_nodes = n;
    return TERA_OK;
}

static double *kind_total(tera_traffic_kind k) {
    double *t[] = {&g_traffic.allreduce, &g_traffic.reduce_scatter, &g_traffic.allgather, &g_traffic.alltoall,
                   &g_traffic.p2p};
    return t[k];
}
static double *kind_inter(tera_traffic_kind k) {
    double *t[] = {&g_traffic.inter_allreduce, &g_traffic.inter_reduce_scatter, &g_traffic.inter_allgather,
                   &g_traffic.inter_alltoall, &g_traffic.inter_p2p};
    return t[k];
}
/* bytes this rank sends to member `to` of c: inter-node when `to` is on another node */
static void count_to(const tera_comm *c, int to, double bytes, tera_traffic_kind k) {
    *kind_total(k) += bytes;
    if (g_node && tera_comm_member_node(c, to) != tera_comm_member_node(c, c->rank)) *kind_inter(k) += bytes;
}
/* a ring collective: this rank sends its bytes to its successor in the group */
static void count_ring(const tera_comm *c, double bytes, tera_traffic_kind k) {
    count_to(c, (c->rank + 1) % c->size, bytes, k);
}

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
    count_ring(c, 2.0 * ring_share(c) * (double)n * (double)es, TERA_TRAFFIC_ALLREDUCE);
    const double t0 = tera_now(); /* blocked time, and the timeline (include/tera/trace.h) */
    c->be->allreduce(c, buf, n, dt, op);
    const double t1 = tera_now();
    blocked(TERA_TRAFFIC_ALLREDUCE, t1 - t0);
    if (tera_trace_active) tera_trace_comm("allreduce", t0, t1, (int64_t)n * (int64_t)es);
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
    if (c->size > 1) count_ring(c, ring_share(c) * 4.0 * (double)total_count(c, counts), TERA_TRAFFIC_REDUCE_SCATTER);
    const double t0 = tera_now();
    be_of(c)->reduce_scatter_f32(c, buf, counts);
    if (c->size > 1) blocked(TERA_TRAFFIC_REDUCE_SCATTER, tera_now() - t0);
    if (tera_trace_active && c->size > 1) tera_trace_comm("reduce_scatter", t0, tera_now(), 4 * total_count(c, counts));
}

void tera_comm_allgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    if (c->size > 1) count_ring(c, ring_share(c) * 4.0 * (double)total_count(c, counts), TERA_TRAFFIC_ALLGATHER);
    const double t0 = tera_now();
    be_of(c)->allgather_f32(c, buf, counts);
    if (c->size > 1) blocked(TERA_TRAFFIC_ALLGATHER, tera_now() - t0);
    if (tera_trace_active && c->size > 1) tera_trace_comm("allgather", t0, tera_now(), 4 * total_count(c, counts));
}

void tera_comm_alltoall_i32(tera_comm *c, const int32_t *send, int32_t *recv, int n) {
    TERA_ASSERTF(n >= 0, "all-to-all of %d values per rank", n);
    for (int r = 0; r < c->size && c->size > 1; r++)
        if (r != c->rank) count_to(c, r, 4.0 * n, TERA_TRAFFIC_ALLTOALL);
    const double t0 = tera_now();
    be_of(c)->alltoall_i32(c, send, recv, n);
    if (c->size > 1) blocked(TERA_TRAFFIC_ALLTOALL, tera_now() - t0);
    if (tera_trace_active && c->size > 1) tera_trace_comm("alltoall", t0, tera_now(), 4 * (int64_t)n * c->size);
}

void tera_comm_barrier(tera_comm *c) {
    const double t0 = tera_now();
    be_of(c)->barrier(c);
    if (c->size > 1) blocked(TERA_BLOCKED_BARRIER, tera_now() - t0);
}

void tera_comm_alltoallv_u8(tera_comm *c, const void *send, const int64_t *scounts, void *recv,
                            const int64_t *rcounts, tera_traffic_kind kind) {
    total_count(c, scounts);
    total_count(c, rcounts);
    if (c->size == 1) { /* the one-rank answer: a copy */
        TERA_ASSERTF(scounts[0] == rcounts[0], "all-to-all sends %ld bytes to itself, expects %ld", (long)scounts[0],
                     (long)rcounts[0]);
        if (scounts[0] > 0) memmove(recv, send, (size_t)scounts[0]);
        return;
    }
    TERA_ASSERTF(c->be->alltoallv_u8, "backend %s has no byte all-to-all", c->be->name);
    for (int r = 0; r < c->size; r++)
        if (r != c->rank) count_to(c, r, (double)scounts[r], kind);
    const double t0 = tera_now();
    c->be->alltoallv_u8(c, send, scounts, recv, rcounts);
    blocked(kind, tera_now() - t0);
}

void tera_comm_allgatherv_u8(tera_comm *c, void *buf, const int64_t *counts, tera_traffic_kind kind) {
    const int64_t t = total_count(c, counts);
    if (c->size == 1) return;
    TERA_ASSERTF(c->be->allgatherv_u8, "backend %s has no byte all-gather", c->be->name);
    count_ring(c, ring_share(c) * (double)t, kind);
    const double t0 = tera_now();
    c->be->allgatherv_u8(c, buf, counts);
    blocked(kind, tera_now() - t0);
}

/* ---- non-blocking operations: the request's public fields are kept here */
static void req_set(tera_comm_req *req, const struct tera_comm_backend *be, void *op) {
    req->active = op != NULL;
    req->be = op ? be : NULL;
    req->op = op;
}
static void req_start(tera_comm_req *req, const struct tera_comm_backend *be, void *op, tera_traffic_kind kind) {
    req_set(req, be, op);
    req->kind = (int)kind;
}

void tera_comm_iallreduce_f32(tera_comm *c, float *buf, int64_t n, tera_comm_req *req) {
    req_set(req, NULL, NULL);
    if (c->size == 1 || n == 0) return;
    count_ring(c, 2.0 * ring_share(c) * 4.0 * (double)n, TERA_TRAFFIC_ALLREDUCE);
    const double t0 = tera_now();
    req_start(req, c->be, c->be->iallreduce_f32(c, buf, n), TERA_TRAFFIC_ALLREDUCE);
    g_traffic.progress_s += tera_now() - t0;
}

void tera_comm_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts, tera_comm_req *req) {
    req_set(req, NULL, NULL);
    if (c->size == 1) return;
    count_ring(c, ring_share(c) * 4.0 * (double)total_count(c, counts), TERA_TRAFFIC_ALLGATHER);
    const double t0 = tera_now();
    req_start(req, c->be, c->be->iallgather_f32(c, buf, counts), TERA_TRAFFIC_ALLGATHER);
    g_traffic.progress_s += tera_now() - t0;
}

void tera_comm_ireduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts, tera_comm_req *req) {
    req_set(req, NULL, NULL);
    if (c->size == 1 || !c->be->ireduce_scatter_f32) { /* the one-rank answer, or a backend without it */
        tera_comm_reduce_scatter_f32(c, buf, counts);
        return;
    }
    count_ring(c, ring_share(c) * 4.0 * (double)total_count(c, counts), TERA_TRAFFIC_REDUCE_SCATTER);
    const double t0 = tera_now();
    req_start(req, c->be, c->be->ireduce_scatter_f32(c, buf, counts), TERA_TRAFFIC_REDUCE_SCATTER);
    g_traffic.progress_s += tera_now() - t0;
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
    count_to(c, peer, 4.0 * (double)n, TERA_TRAFFIC_P2P);
    const double t0 = tera_now();
    req_start(req, c->be, c->be->isend_f32(c, buf, n, peer, tag), TERA_TRAFFIC_P2P);
    g_traffic.progress_s += tera_now() - t0;
}

void tera_comm_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag, tera_comm_req *req) {
    req_set(req, NULL, NULL);
    if (n == 0) return;
    p2p_check(c, n, peer, 0);
    const double t0 = tera_now();
    req_start(req, c->be, c->be->irecv_f32(c, buf, n, peer, tag), TERA_TRAFFIC_P2P);
    g_traffic.progress_s += tera_now() - t0;
}

void tera_comm_wait(tera_comm_req *req) {
    if (!req->active) return;
    const double t0 = tera_now();
    req->be->wait(req->op);
    const double t1 = tera_now();
    blocked(req->kind, t1 - t0);
    if (tera_trace_active) tera_trace_comm("wait (non-blocking op)", t0, t1, -1);
    req_set(req, NULL, NULL);
}

typedef struct {
    tera_comm_req *const *reqs;
    int n, done; /* done: the index of the request seen complete (released), -1 */
} any_cond;
static int any_cond_done(void *arg) {
    any_cond *q = arg;
    for (int i = 0; i < q->n; i++)
        if (q->reqs[i]->active && q->reqs[i]->be->test(q->reqs[i]->op)) {
            q->done = i;
            return 1;
        }
    return 0;
}

int tera_comm_wait_any(tera_comm_req *const *reqs, int n) {
    any_cond q = {reqs, n, -1};
    const struct tera_comm_backend *be = NULL;
    for (int i = 0; i < n; i++)
        if (reqs[i]->active) be = reqs[i]->be;
    if (!be) return -1; /* none in flight */
    const double t0 = tera_now();
    if (!any_cond_done(&q)) {
        if (be->wait_for) {
            be->wait_for(any_cond_done, &q); /* polling under the watchdog */
        } else { /* a backend without one (NCCL): tests with sleeps growing to 1 ms */
            long ns = 1000;
            while (!any_cond_done(&q)) {
                const struct timespec ts = {0, ns};
                nanosleep(&ts, NULL);
                ns = ns < 1000000 ? 2 * ns : 1000000;
            }
        }
    }
    const double t1 = tera_now();
    blocked(reqs[q.done]->kind, t1 - t0);
    if (tera_trace_active && t1 - t0 > 0.0) tera_trace_comm("wait (any of several)", t0, t1, -1);
    req_set(reqs[q.done], NULL, NULL);
    return q.done;
}

void tera_comm_poll(tera_comm_req *reqs, int n) {
    const double t0 = tera_now();
    int any = 0;
    for (int i = 0; i < n; i++)
        if (reqs[i].active) {
            any = 1;
            if (reqs[i].be->test(reqs[i].op)) req_set(&reqs[i], NULL, NULL);
        }
    if (any) g_traffic.progress_s += tera_now() - t0;
}

/* ---- host-shared memory */
struct tera_comm_shared {
    tera_comm *c;
    void *handle;          /* the backend's */
    unsigned char *flags;  /* [size][nflags] counters, 64 bytes apart */
    void *mem;
    int nflags;
};

static _Atomic uint64_t *flag_of(const tera_comm_shared *s, int r, int flag) {
    TERA_ASSERTF(flag >= 0 && flag < s->nflags, "shared block flag %d of %d", flag, s->nflags);
    return (_Atomic uint64_t *)(void *)(s->flags + ((size_t)r * (size_t)s->nflags + (size_t)flag) * 64);
}

tera_comm_shared *tera_comm_shared_create(tera_comm *c, int64_t bytes, int nflags) {
    TERA_ASSERTF(bytes >= 0 && nflags >= 0, "shared block of %ld bytes, %d flags", (long)bytes, nflags);
    if (c->size == 1 || !c->be->shared_alloc) return NULL; /* the same answer on every member */
    const size_t fb = (size_t)c->size * (size_t)nflags * 64;
    void *base = NULL;
    void *h = c->be->shared_alloc(c, fb + (size_t)bytes, &base);
    if (!h) return NULL;
    tera_comm_shared *s = tera_calloc(1, sizeof *s);
    *s = (tera_comm_shared){.c = c, .handle = h, .flags = base, .mem = (unsigned char *)base + fb, .nflags = nflags};
    for (int f = 0; f < nflags; f++) /* each member zeroes its own counters; every one before any is read */
        atomic_store_explicit(flag_of(s, c->rank, f), 0, memory_order_relaxed);
    c->be->barrier(c);
    return s;
}

void tera_comm_shared_free(tera_comm_shared *s) {
    if (!s) return;
    s->c->be->shared_free(s->handle);
    free(s);
}

void *tera_comm_shared_mem(const tera_comm_shared *s) { return s->mem; }

void tera_comm_shared_post(tera_comm_shared *s, int flag, uint64_t v) {
    atomic_store_explicit(flag_of(s, s->c->rank, flag), v, memory_order_release);
}

int tera_comm_shared_reached(const tera_comm_shared *s, int flag, uint64_t v) {
    for (int r = 0; r < s->c->size; r++)
        if (atomic_load_explicit(flag_of(s, r, flag), memory_order_acquire) < v) return 0;
    return 1;
}

typedef struct {
    const tera_comm_shared *s;
    int flag;
    uint64_t v;
} shared_cond;
static int shared_cond_done(void *arg) {
    const shared_cond *q = arg;
    return tera_comm_shared_reached(q->s, q->flag, q->v);
}

void tera_comm_shared_wait(tera_comm_shared *s, int flag, uint64_t v, int kind) {
    if (tera_comm_shared_reached(s, flag, v)) return;
    TERA_ASSERTF(kind >= 0 && kind < TERA_BLOCKED_KINDS, "blocked-time kind %d", kind);
    shared_cond q = {s, flag, v};
    const double t0 = tera_now();
    s->c->be->wait_for(shared_cond_done, &q);
    const double t1 = tera_now();
    blocked(kind, t1 - t0);
    if (tera_trace_active) tera_trace_comm("wait (shared-memory flags)", t0, t1, -1);
}

void tera_comm_count_as(tera_comm *c, int kind, const int64_t *counts) {
    TERA_ASSERTF(kind == TERA_TRAFFIC_ALLGATHER || kind == TERA_TRAFFIC_REDUCE_SCATTER || kind == TERA_TRAFFIC_ALLREDUCE,
                 "shared block count of kind %d", kind);
    const double passes = kind == TERA_TRAFFIC_ALLREDUCE ? 2.0 : 1.0; /* reduce-scatter, then all-gather */
    if (c->size > 1) count_ring(c, passes * ring_share(c) * 4.0 * (double)total_count(c, counts), (tera_traffic_kind)kind);
}

void tera_comm_shared_count(tera_comm_shared *s, int kind, const int64_t *counts) { tera_comm_count_as(s->c, kind, counts); }

/* ---- groups */
tera_comm *tera_comm_split(tera_comm *c, int color, int key) {
    tera_comm *g = tera_calloc(1, sizeof *g);
    be_of(c)->split(c, color, key, g);
    /* the members' world ranks (for their nodes): one sum over the new group, not counted */
    g->wrank = tera_calloc((size_t)g->size, sizeof(int));
    if (g->size == 1) {
        g->wrank[0] = g_world.rank;
    } else {
        int64_t *w = tera_calloc((size_t)g->size, sizeof(int64_t));
        w[g->rank] = g_world.rank;
        g->be->allreduce(g, w, g->size, TERA_COMM_I64, TERA_COMM_SUM);
        for (int r = 0; r < g->size; r++) g->wrank[r] = (int)w[r];
        free(w);
    }
    return g;
}

void tera_comm_free(tera_comm *c) {
    if (!c || c == &g_world) return;
    c->be->free(c);
    free(c->wrank);
    free(c);
}
