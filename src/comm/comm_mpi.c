/* MPI backend of the communicator, and the one-rank world when no launcher started the program.
 *
 * Launch detection: Open MPI (OMPI_COMM_WORLD_SIZE), MPICH/Hydra and Slurm (PMI_SIZE) set these in
 * every rank's environment; without them tera runs as one rank and never initialises MPI, so a
 * single-process run needs no mpirun and pays nothing for it. */
#include <mpi.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tera/comm.h"

struct tera_comm {
    MPI_Comm mpi;        /* MPI_COMM_NULL for the one-rank world */
    int rank, size;
};

static tera_comm g_world = {.mpi = MPI_COMM_NULL, .rank = 0, .size = 1};
static int g_inited = 0, g_mpi = 0;

extern void (*tera_abort_hook)(void);

static void abort_all_ranks(void) {
    if (g_mpi) MPI_Abort(MPI_COMM_WORLD, 1);
}

#define MPI_CHECK(call)                                                                            \
    do {                                                                                           \
        int _rc = (call);                                                                          \
        if (_rc != MPI_SUCCESS) {                                                                  \
            char _msg[MPI_MAX_ERROR_STRING];                                                       \
            int _len = 0;                                                                          \
            MPI_Error_string(_rc, _msg, &_len);                                                    \
            tera_abort_at(__FILE__, __LINE__, "%s failed: %s", #call, _msg);                         \
        }                                                                                          \
    } while (0)

/* ---- watchdog: the thread checks once a second whether the current collective is overdue */
static _Atomic double g_timeout = 0.0;      /* seconds; 0 = off */
static _Atomic double g_op_start = 0.0;     /* monotonic start of the collective in flight, 0 = none */
static const char *_Atomic g_op_name = NULL;
static pthread_t g_watchdog;
static int g_watchdog_running = 0;

static double mono(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *watchdog(void *arg) {
    (void)arg;
    for (;;) {
        sleep(1);
        const double t0 = g_op_start, limit = g_timeout;
        if (t0 > 0.0 && limit > 0.0 && mono() - t0 > limit) {
            const char *op = g_op_name;
            fprintf(stderr,
                    "tera: fatal: rank %d: %s made no progress for %.0f s: a peer rank stopped answering "
                    "(parallel.timeout_s); aborting every rank\n",
                    g_world.rank, op ? op : "a collective", limit);
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 3);
            _exit(3);
        }
    }
    return NULL;
}

void tera_comm_set_timeout(double seconds) {
    g_timeout = seconds > 0.0 ? seconds : 0.0;
    if (g_mpi && g_timeout > 0.0 && !g_watchdog_running) {
        if (pthread_create(&g_watchdog, NULL, watchdog, NULL) == 0) {
            pthread_detach(g_watchdog);
            g_watchdog_running = 1;
        }
    }
}

#define GUARDED(name, call)                                                                        \
    do {                                                                                           \
        g_op_name = (name);                                                                        \
        g_op_start = mono();                                                                       \
        MPI_CHECK(call);                                                                           \
        g_op_start = 0.0;                                                                          \
    } while (0)

static int launched_by_mpi(void) {
    const char *v = getenv("OMPI_COMM_WORLD_SIZE");
    if (!v) v = getenv("PMI_SIZE");
    return v != NULL;
}

tera_status tera_comm_init(int *argc, char ***argv) {
    if (g_inited) return TERA_OK;
    g_inited = 1;
    if (!launched_by_mpi()) return TERA_OK;
    int provided;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return tera_fail(TERA_ERR_IO, "MPI_Init_thread failed");
    g_mpi = 1;
    /* errors return codes (checked by MPI_CHECK, which aborts every rank with file:line) */
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    g_world.mpi = MPI_COMM_WORLD;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world.size);
    tera_abort_hook = abort_all_ranks;
    return TERA_OK;
}

void tera_comm_finalize(void) {
    if (g_mpi) MPI_Finalize();
    g_mpi = 0;
}

tera_comm *tera_comm_world(void) { return &g_world; }
int tera_comm_rank(const tera_comm *c) { return c->rank; }
int tera_comm_size(const tera_comm *c) { return c->size; }
const char *tera_comm_backend(void) { return g_mpi ? "mpi" : "single"; }

static tera_comm_traffic g_traffic;
tera_comm_traffic tera_comm_traffic_get(void) { return g_traffic; }
void tera_comm_traffic_reset(void) { memset(&g_traffic, 0, sizeof g_traffic); }
static double ring_share(const tera_comm *c) { return (double)(c->size - 1) / (double)c->size; }

/* MPI counts are int: large buffers go in pieces */
#define MAX_PIECE ((int64_t)1 << 30)

static void allreduce(tera_comm *c, void *buf, int64_t n, MPI_Datatype dt, size_t es, MPI_Op op) {
    if (c->size == 1 || n == 0) return;
    g_traffic.allreduce += 2.0 * ring_share(c) * (double)n * (double)es;
    for (int64_t off = 0; off < n; off += MAX_PIECE) {
        int64_t k = n - off < MAX_PIECE ? n - off : MAX_PIECE;
        GUARDED("MPI_Allreduce", MPI_Allreduce(MPI_IN_PLACE, (char *)buf + off * (int64_t)es, (int)k, dt, op, c->mpi));
    }
}

void tera_comm_allreduce_f32(tera_comm *c, float *buf, int64_t n) { allreduce(c, buf, n, MPI_FLOAT, 4, MPI_SUM); }
void tera_comm_allreduce_f64(tera_comm *c, double *buf, int64_t n) { allreduce(c, buf, n, MPI_DOUBLE, 8, MPI_SUM); }
void tera_comm_allreduce_i64(tera_comm *c, int64_t *buf, int64_t n) { allreduce(c, buf, n, MPI_INT64_T, 8, MPI_SUM); }
void tera_comm_allreduce_max_f32(tera_comm *c, float *buf, int64_t n) { allreduce(c, buf, n, MPI_FLOAT, 4, MPI_MAX); }

/* counts/displacements as MPI ints (ranges must stay below 2^31 elements each) */
static void int_counts(const tera_comm *c, const int64_t *counts, int *cnt, int *disp) {
    int64_t off = 0;
    for (int r = 0; r < c->size; r++) {
        TERA_ASSERTF(counts[r] < INT32_MAX && off < INT32_MAX, "range of %ld elements is too large for MPI counts",
                     (long)counts[r]);
        cnt[r] = (int)counts[r];
        disp[r] = (int)off;
        off += counts[r];
    }
}

void tera_comm_reduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts) {
    if (c->size == 1) return;
    int cnt[1024], disp[1024];
    TERA_ASSERT(c->size <= 1024);
    int_counts(c, counts, cnt, disp);
    g_traffic.reduce_scatter += ring_share(c) * 4.0 * (double)(disp[c->size - 1] + cnt[c->size - 1]);
    /* MPI_IN_PLACE: input from buf, this rank's result at the START of buf: move it into place */
    GUARDED("MPI_Reduce_scatter", MPI_Reduce_scatter(MPI_IN_PLACE, buf, cnt, MPI_FLOAT, MPI_SUM, c->mpi));
    if (disp[c->rank] > 0) memmove(buf + disp[c->rank], buf, sizeof(float) * (size_t)cnt[c->rank]);
}

void tera_comm_allgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    if (c->size == 1) return;
    int cnt[1024], disp[1024];
    TERA_ASSERT(c->size <= 1024);
    int_counts(c, counts, cnt, disp);
    g_traffic.allgather += ring_share(c) * 4.0 * (double)(disp[c->size - 1] + cnt[c->size - 1]);
    GUARDED("MPI_Allgatherv", MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, cnt, disp, MPI_FLOAT, c->mpi));
}

_Static_assert(sizeof(MPI_Request) <= sizeof(((tera_comm_req *)0)->storage), "tera_comm_req too small");

static MPI_Request *req_of(tera_comm_req *req) { return (MPI_Request *)(void *)req->storage; }

void tera_comm_iallreduce_f32(tera_comm *c, float *buf, int64_t n, tera_comm_req *req) {
    req->active = 0;
    if (c->size == 1 || n == 0) return;
    TERA_ASSERTF(n <= MAX_PIECE, "non-blocking all-reduce of %ld floats: buckets must be smaller", (long)n);
    g_traffic.allreduce += 2.0 * ring_share(c) * 4.0 * (double)n;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, c->mpi, req_of(req)));
    req->active = 1;
}

void tera_comm_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts, int *scratch, tera_comm_req *req) {
    req->active = 0;
    if (c->size == 1) return;
    int *cnt = scratch, *disp = scratch + c->size;
    int_counts(c, counts, cnt, disp);
    g_traffic.allgather += ring_share(c) * 4.0 * (double)(disp[c->size - 1] + cnt[c->size - 1]);
    MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, cnt, disp, MPI_FLOAT, c->mpi, req_of(req)));
    req->active = 1;
}

void tera_comm_wait(tera_comm_req *req) {
    if (!req->active) return;
    GUARDED("MPI_Wait (non-blocking transfer)", MPI_Wait(req_of(req), MPI_STATUS_IGNORE));
    req->active = 0;
}

void tera_comm_poll(tera_comm_req *reqs, int n) {
    for (int i = 0; i < n; i++) {
        if (!reqs[i].active) continue;
        int done = 0;
        MPI_CHECK(MPI_Test(req_of(&reqs[i]), &done, MPI_STATUS_IGNORE));
        if (done) reqs[i].active = 0;
    }
}

tera_comm *tera_comm_split(tera_comm *c, int color, int key) {
    tera_comm *g = tera_calloc(1, sizeof *g);
    if (c->size == 1) {
        *g = (tera_comm){.mpi = MPI_COMM_NULL, .rank = 0, .size = 1};
        return g;
    }
    GUARDED("MPI_Comm_split", MPI_Comm_split(c->mpi, color, key, &g->mpi));
    MPI_Comm_set_errhandler(g->mpi, MPI_ERRORS_RETURN);
    MPI_Comm_rank(g->mpi, &g->rank);
    MPI_Comm_size(g->mpi, &g->size);
    return g;
}

void tera_comm_free(tera_comm *c) {
    if (!c || c == &g_world) return;
    if (c->mpi != MPI_COMM_NULL && g_mpi) MPI_Comm_free(&c->mpi);
    free(c);
}

void tera_comm_alltoall_i32(tera_comm *c, const int32_t *send, int32_t *recv, int n) {
    if (c->size == 1) {
        memcpy(recv, send, sizeof(int32_t) * (size_t)n);
        return;
    }
    g_traffic.alltoall += (double)(c->size - 1) * 4.0 * n;
    GUARDED("MPI_Alltoall", MPI_Alltoall(send, n, MPI_INT32_T, recv, n, MPI_INT32_T, c->mpi));
}

/* A non-blocking send (send = 1, counted as traffic) or receive of n floats with `peer`. */
static void p2p(tera_comm *c, float *buf, int64_t n, int peer, int tag, tera_comm_req *req, int send) {
    req->active = 0;
    if (n == 0) return;
    TERA_ASSERTF(c->size > 1 && peer != c->rank, "point-to-point %s rank %d of a group of %d",
                 send ? "send to" : "receive from", peer, c->size);
    TERA_ASSERTF(n <= MAX_PIECE, "point-to-point message of %ld floats is too large", (long)n);
    if (send) {
        g_traffic.p2p += 4.0 * (double)n;
        MPI_CHECK(MPI_Isend(buf, (int)n, MPI_FLOAT, peer, tag, c->mpi, req_of(req)));
    } else {
        MPI_CHECK(MPI_Irecv(buf, (int)n, MPI_FLOAT, peer, tag, c->mpi, req_of(req)));
    }
    req->active = 1;
}

void tera_comm_isend_f32(tera_comm *c, const float *buf, int64_t n, int peer, int tag, tera_comm_req *req) {
    p2p(c, (float *)buf, n, peer, tag, req, 1); /* MPI_Isend reads it only */
}

void tera_comm_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag, tera_comm_req *req) {
    p2p(c, buf, n, peer, tag, req, 0);
}

void tera_comm_barrier(tera_comm *c) {
    if (c->size > 1) GUARDED("MPI_Barrier", MPI_Barrier(c->mpi));
}
