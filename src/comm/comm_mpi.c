/* The MPI (Open MPI) backend of the communicator (struct tera_comm_backend, comm_impl.h): serves
 * the world when a launcher started the program; src/comm/comm.c routes one-rank groups to the
 * one-rank backend, so every entry here sees two ranks or more (split and free excepted).
 *
 * Launch detection: Open MPI (OMPI_COMM_WORLD_SIZE), MPICH/Hydra and Slurm (PMI_SIZE) set these in
 * every rank's environment; without them tera runs as one rank and never initialises MPI, so a
 * single-process run needs no mpirun and pays nothing for it.
 *
 * Requests: every non-blocking operation takes an object (its MPI_Request, its kind, the
 * all-gather's counts) from a pool this backend owns: POOL_CHUNK objects allocated at init, another
 * chunk only when more operations than ever before are in flight at once (the first step), never
 * moved (MPI reads the counts until the operation completes), all freed at finalize.
 *
 * Waiting: every collective is started non-blocking and completed by one polling loop (MPI_Test on
 * end for 50 us, yielding the core until 1 ms, then sleeps growing from 50 us to 1 ms), so a rank
 * waiting for a slow or stalled peer sleeps instead of spinning a core. The loop is also the watchdog: an operation that makes no
 * progress for the timeout asks every other rank, over a side channel (a duplicate of the world
 * communicator, served by the same loop on every rank), what it is doing; a rank that does not
 * answer within a grace period is not inside any communication (computing, stalled or stopped) and
 * is named in the message, and the job is aborted. */
#include <math.h>
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm_impl.h"
#include "comm_shm.h"

/* A group's ctx: its communicator and, where every member runs on one host, its shared-memory
 * segment for fp32 sums (comm_shm.h; NULL otherwise). The world's: &g_world. */
typedef struct {
    MPI_Comm comm;
    tera_shm *shm;
} mpi_group;
static mpi_group g_world = {MPI_COMM_NULL, NULL};
static int g_rank = 0, g_size = 1; /* this rank in the world, the world's size */
static int g_mpi = 0;              /* MPI initialised and not finalized */

static MPI_Comm comm_of(const tera_comm *c) { return ((const mpi_group *)c->ctx)->comm; }
static tera_shm *shm_of(const tera_comm *c) { return ((const mpi_group *)c->ctx)->shm; }

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

static double mono(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void sleep_s(double s) {
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - floor(s)) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---- the timeout: tera_comm_timeout_now() (comm.c) */
/* the grace period the stalled operation's rank gives the others to answer its question */
static double grace_s(double limit) { return fmin(fmax(0.25 * limit, 1.0), 10.0); }

/* ---- what this rank is doing, for the other ranks' questions */
enum {
    OP_NONE, OP_ALLREDUCE, OP_REDUCE_SCATTER, OP_ALLGATHER, OP_ALLTOALL, OP_BARRIER, OP_WAIT_ALLREDUCE,
    OP_WAIT_ALLGATHER, OP_SEND, OP_RECV, OP_SPLIT, OP_WAIT_REDUCE_SCATTER, OP_WAIT_SHM, OP_WAIT_SHARED, OP_COUNT
};
static const char *const g_op_names[OP_COUNT] = {
    "no operation", "MPI_Allreduce", "MPI_Reduce_scatter", "MPI_Allgatherv", "MPI_Alltoall", "MPI_Barrier",
    "MPI_Wait (non-blocking all-reduce)", "MPI_Wait (non-blocking all-gather)", "MPI_Wait (send)", "MPI_Wait (receive)",
    "MPI_Comm_split", "MPI_Wait (non-blocking reduce-scatter)", "shared-memory all-reduce",
    "shared-memory flags (ZeRO-3 parameters in host-shared memory)"};
static _Atomic int g_op = OP_NONE;          /* the operation being waited for */
static _Atomic double g_op_start = 0.0;     /* monotonic start of that wait, 0 = none */
static _Atomic int g_op_blocking = 0;       /* a blocking MPI call (only the backup thread can time it out) */

/* side channel: questions (tag Q) answered with the state (tag A); error messages (tag E) */
enum { TAG_Q = 1, TAG_A = 2, TAG_E = 3 };
enum { ST_RANK, ST_OP, ST_STEP, ST_WAITED_MS, ST_LEN };
static MPI_Comm g_side = MPI_COMM_NULL;
static MPI_Request g_q_req = MPI_REQUEST_NULL;
static long long g_q_buf;
static long long (*g_answer)[ST_LEN];       /* [size] answer buffers, one per asking rank */
static MPI_Request *g_answer_req;           /* [size] */
static int g_asker = -1;                    /* the lowest rank that asked (it reports the stall) */
static double g_asked_at = 0.0;

static void post_question_recv(void) {
    MPI_CHECK(MPI_Irecv(&g_q_buf, 1, MPI_LONG_LONG, MPI_ANY_SOURCE, TAG_Q, g_side, &g_q_req));
}

/* Answers every question that has arrived (called from every waiting loop). */
static void serve_questions(void) {
    if (g_side == MPI_COMM_NULL) return;
    for (;;) {
        int got = 0;
        MPI_Status s;
        MPI_CHECK(MPI_Test(&g_q_req, &got, &s));
        if (!got) return;
        const int from = s.MPI_SOURCE;
        if (g_asker < 0 || from < g_asker) g_asker = from;
        g_asked_at = mono();
        int done = 1;
        if (g_answer_req[from] != MPI_REQUEST_NULL) MPI_CHECK(MPI_Test(&g_answer_req[from], &done, MPI_STATUS_IGNORE));
        if (done) {
            const double t0 = g_op_start;
            g_answer[from][ST_RANK] = g_rank;
            g_answer[from][ST_OP] = g_op;
            g_answer[from][ST_STEP] = (long long)tera__comm_step();
            g_answer[from][ST_WAITED_MS] = t0 > 0.0 ? (long long)(1e3 * (mono() - t0)) : 0;
            MPI_CHECK(MPI_Isend(g_answer[from], ST_LEN, MPI_LONG_LONG, from, TAG_A, g_side, &g_answer_req[from]));
        }
        post_question_recv();
    }
}

static int append(char *buf, size_t n, size_t *len, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int append(char *buf, size_t n, size_t *len, const char *fmt, ...) {
    if (*len >= n) return 0;
    va_list ap;
    va_start(ap, fmt);
    const int k = vsnprintf(buf + *len, n - *len, fmt, ap);
    va_end(ap);
    if (k > 0) *len += (size_t)k < n - *len ? (size_t)k : n - *len - 1;
    return k;
}

/* What a wait polls: poll(arg) is 1 once the operation completed (an MPI request: MPI_Test; a
 * shared-memory all-reduce: its flag, advanced by tera_shm_progress, which every waiting loop runs). */
typedef int (*poll_fn)(void *arg);
static int poll_req(void *arg) {
    int done = 0;
    MPI_CHECK(MPI_Test((MPI_Request *)arg, &done, MPI_STATUS_IGNORE));
    return done;
}
static int poll_shm(void *arg) { return tera_shm_done((const tera_shm_op *)arg); }

/* The operation this rank waits for (poll(arg)) made no progress for `limit` seconds: ask every
 * other rank what it is doing; the ones that do not answer within the grace period are named.
 * Returns 1 when it completed meanwhile, 0 when a lower rank asked meanwhile (that one reports);
 * otherwise prints one line and aborts every rank. */
static int diagnose_and_abort(poll_fn poll, void *arg, double limit, int op) {
    const int n = g_size, me = g_rank;
    long long(*ans)[ST_LEN] = calloc((size_t)n, sizeof *ans);
    MPI_Request *rq = calloc((size_t)n * 2, sizeof *rq);
    int *got = calloc((size_t)n, sizeof(int));
    static long long q = 0;
    TERA_ASSERT(ans && rq && got);
    for (int p = 0; p < n; p++) {
        rq[2 * p] = rq[2 * p + 1] = MPI_REQUEST_NULL;
        if (p == me) continue;
        MPI_CHECK(MPI_Irecv(ans[p], ST_LEN, MPI_LONG_LONG, p, TAG_A, g_side, &rq[2 * p]));
        MPI_CHECK(MPI_Isend(&q, 1, MPI_LONG_LONG, p, TAG_Q, g_side, &rq[2 * p + 1]));
    }
    const double t_end = mono() + grace_s(limit);
    int answered = 1, outcome = -1, done = 0;
    while (mono() < t_end && answered < n) {
        serve_questions();
        tera_shm_progress();
        done = poll(arg);
        if (done) outcome = 1; /* the peer was slow, not stalled: carry on */
        else if (g_asker >= 0 && g_asker < me) outcome = 0; /* a lower rank reports */
        if (outcome >= 0) break;
        for (int p = 0; p < n; p++) {
            if (p == me || got[p]) continue;
            MPI_CHECK(MPI_Test(&rq[2 * p], &got[p], MPI_STATUS_IGNORE));
            answered += got[p];
        }
        sleep_s(1e-3);
    }
    if (outcome >= 0) { /* withdraw the questions: cancel the answers' receives before freeing their buffers */
        for (int p = 0; p < n; p++) {
            if (p == me) continue;
            if (!got[p]) {
                MPI_Cancel(&rq[2 * p]);
                MPI_Wait(&rq[2 * p], MPI_STATUS_IGNORE);
            }
            if (rq[2 * p + 1] != MPI_REQUEST_NULL) MPI_Request_free(&rq[2 * p + 1]);
        }
        free(ans);
        free(rq);
        free(got);
        return outcome;
    }
    char msg[4096];
    size_t len = 0;
    append(msg, sizeof msg, &len, "tera: fatal: rank %d: %s made no progress for %.0f s: a peer rank stopped answering",
           me, g_op_names[op], limit);
    int silent = 0;
    for (int p = 0; p < n; p++) silent += p != me && !got[p];
    if (silent) {
        append(msg, sizeof msg, &len, ": %s ", silent == 1 ? "rank" : "ranks");
        int k = 0;
        for (int p = 0; p < n; p++)
            if (p != me && !got[p]) append(msg, sizeof msg, &len, "%s%d", k++ ? ", " : "", p);
        append(msg, sizeof msg, &len, " did not answer within %.0f s (stalled outside communication, stopped, or "
               "dead); waiting:", grace_s(limit));
    } else {
        append(msg, sizeof msg, &len, ": every rank answered and is waiting (the ranks' operations do not match):");
    }
    append(msg, sizeof msg, &len, " rank %d in %s at step %lld", me, g_op_names[op], (long long)tera__comm_step());
    for (int p = 0; p < n; p++)
        if (p != me && got[p]) {
            const int o = ans[p][ST_OP] >= 0 && ans[p][ST_OP] < OP_COUNT ? (int)ans[p][ST_OP] : OP_NONE;
            append(msg, sizeof msg, &len, ", rank %d in %s at step %lld", p, g_op_names[o], ans[p][ST_STEP]);
        }
    append(msg, sizeof msg, &len, "; aborting every rank (parallel.timeout_s%s)",
           tera__comm_timeout_auto() ? ": automatic, see docs/PARALLELISM.md" : "");
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    _exit(3);
}

/* Completes an operation, sleeping between polls; times the wait out (see above). Every poll also
 * advances the shared-memory all-reduces in flight (a peer may wait for this rank's share); their
 * progress counts as progress: the backoff and the timeout restart. */
static void wait_until(poll_fn poll, void *arg, int op) {
    tera_shm_progress();
    if (poll(arg)) return;
    double t0 = mono();
    g_op = op;
    g_op_start = t0;
    double nap = 0.0, next_check = t0 + 0.01;
    for (;;) {
        const int moved = tera_shm_progress();
        if (poll(arg)) break;
        double now = mono();
        if (moved) {
            t0 = now, nap = 0.0;
            g_op_start = t0;
            continue;
        }
        /* most waits end within a millisecond: test on, yielding the core after the first 50 us (to
         * another rank where ranks share cores); then sleep, 50 us growing to 1 ms */
        if (now - t0 < 50e-6) continue;
        if (now - t0 < 1e-3) {
            sched_yield();
            continue;
        }
        nap = nap == 0.0 ? 50e-6 : fmin(2.0 * nap, 1e-3);
        sleep_s(nap);
        now = mono();
        if (now < next_check) continue;
        next_check = now + 0.01;
        serve_questions();
        const double limit = tera_comm_timeout_now();
        if (limit > 0.0 && now - t0 > limit) {
            /* a lower rank asked recently: it reports; wait for its abort (and report if it never comes) */
            if (g_asker >= 0 && g_asker < g_rank && now - g_asked_at < grace_s(limit) + 30.0) continue;
            if (diagnose_and_abort(poll, arg, limit, op)) break; /* completed after all */
        }
    }
    g_op_start = 0.0;
    g_op = OP_NONE;
}

static void wait_req(MPI_Request *r, int op) {
    if (*r == MPI_REQUEST_NULL) return;
    wait_until(poll_req, r, op);
}

/* ---- the backup thread: times out blocking calls (MPI_Comm_split), and any wait whose own loop
 * could not report (e.g. a peer that never answers our questions' sends) */
static pthread_t g_watchdog;
static int g_watchdog_running = 0;

static void *watchdog(void *arg) {
    (void)arg;
    for (;;) {
        sleep(1);
        const double t0 = g_op_start, limit = tera_comm_timeout_now();
        if (t0 <= 0.0 || limit <= 0.0) continue;
        const double over = g_op_blocking ? limit : limit + grace_s(limit) + 60.0;
        if (mono() - t0 > over) {
            fprintf(stderr,
                    "tera: fatal: rank %d: %s made no progress for %.0f s: a peer rank stopped answering "
                    "(parallel.timeout_s); aborting every rank\n",
                    g_rank, g_op_names[g_op >= 0 && g_op < OP_COUNT ? g_op : OP_NONE], limit);
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 3);
            _exit(3);
        }
    }
    return NULL;
}

static int mpi_launched(void) {
    const char *v = getenv("OMPI_COMM_WORLD_SIZE");
    if (!v) v = getenv("PMI_SIZE");
    return v != NULL;
}

/* ---- the request pool: objects never move (MPI reads an all-gather's counts until it completes) */
typedef struct mpi_op {
    MPI_Request r;          /* the MPI request, MPI_REQUEST_NULL while free */
    int kind;               /* OP_WAIT_ALLREDUCE, OP_WAIT_ALLGATHER, OP_WAIT_REDUCE_SCATTER, OP_SEND, OP_RECV;
                             * blocking: OP_REDUCE_SCATTER, OP_ALLGATHER (their counts only) */
    int *cnt, *disp;        /* the all-gather's (reduce-scatter's) counts and displacements ([world size] each) */
    float *rs_buf;          /* OP_WAIT_REDUCE_SCATTER: its buffer, and this rank in its group: the result */
    int rs_rank;            /* arrives at the buffer's start and is moved into the rank's range at completion */
    tera_shm_op shm;        /* OP_WAIT_SHM: the shared-memory all-reduce (comm_shm.h) */
    struct mpi_op *next;    /* the free list */
} mpi_op;

typedef struct pool_chunk {
    struct pool_chunk *next; /* the chunks, for finalize */
    mpi_op *op;              /* [POOL_CHUNK] */
    int *ints;               /* [POOL_CHUNK][2 world size] the ops' counts */
} pool_chunk;

#define POOL_CHUNK 128
static pool_chunk *g_chunks = NULL;
static mpi_op *g_free_ops = NULL;

static void pool_grow(void) {
    pool_chunk *ch = tera_calloc(1, sizeof *ch);
    ch->op = tera_calloc(POOL_CHUNK, sizeof *ch->op);
    ch->ints = tera_calloc((size_t)POOL_CHUNK * 2 * (size_t)g_size, sizeof(int));
    for (int i = POOL_CHUNK - 1; i >= 0; i--) {
        mpi_op *o = &ch->op[i];
        o->r = MPI_REQUEST_NULL;
        o->cnt = ch->ints + (size_t)i * 2 * (size_t)g_size;
        o->disp = o->cnt + g_size;
        o->next = g_free_ops;
        g_free_ops = o;
    }
    ch->next = g_chunks;
    g_chunks = ch;
}

static mpi_op *pool_take(int kind) {
    if (!g_free_ops) pool_grow(); /* more in flight than ever before */
    mpi_op *o = g_free_ops;
    g_free_ops = o->next;
    o->next = NULL;
    o->kind = kind;
    return o;
}

static void pool_put(mpi_op *o) {
    TERA_ASSERTF(o->r == MPI_REQUEST_NULL && o->kind != OP_NONE, "MPI backend: request released twice or in flight");
    o->kind = OP_NONE;
    o->next = g_free_ops;
    g_free_ops = o;
}

static void pool_free(void) {
    while (g_chunks) {
        pool_chunk *ch = g_chunks;
        g_chunks = ch->next;
        free(ch->ints);
        free(ch->op);
        free(ch);
    }
    g_free_ops = NULL;
}

/* ---- the world */
static tera_status mpi_init(int *argc, char ***argv, tera_comm *world) {
    int provided;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return tera_fail(TERA_ERR_IO, "MPI_Init_thread failed");
    g_mpi = 1;
    /* errors return codes (checked by MPI_CHECK, which aborts every rank with file:line) */
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    g_world.comm = MPI_COMM_WORLD;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    *world = (tera_comm){.be = &tera__comm_mpi, .ctx = &g_world, .rank = g_rank, .size = g_size};
    tera_abort_hook = abort_all_ranks;
    if (g_size > 1) {
        MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &g_side));
        MPI_Comm_set_errhandler(g_side, MPI_ERRORS_RETURN);
        g_answer = tera_calloc((size_t)g_size, sizeof *g_answer);
        g_answer_req = tera_calloc((size_t)g_size, sizeof *g_answer_req);
        for (int p = 0; p < g_size; p++) g_answer_req[p] = MPI_REQUEST_NULL;
        post_question_recv();
        pool_grow();
        g_world.shm = tera_shm_create(MPI_COMM_WORLD);
        if (pthread_create(&g_watchdog, NULL, watchdog, NULL) == 0) {
            pthread_detach(g_watchdog);
            g_watchdog_running = 1;
        }
    }
    return TERA_OK;
}

static void mpi_finalize(void) {
    if (!g_mpi) return;
    g_op_start = 0.0;
    tera_shm_free(g_world.shm);
    g_world.shm = NULL;
    if (g_side != MPI_COMM_NULL) {
        MPI_Cancel(&g_q_req);
        MPI_Wait(&g_q_req, MPI_STATUS_IGNORE);
        for (int p = 0; p < g_size; p++)
            if (g_answer_req[p] != MPI_REQUEST_NULL) MPI_Request_free(&g_answer_req[p]);
        MPI_Comm_free(&g_side);
        free(g_answer);
        free(g_answer_req);
    }
    MPI_Finalize();
    pool_free();
    g_mpi = 0;
}

/* An error every rank may have found (before the run, most often the same on every rank): rank 0
 * prints it and sends it to the others (a synchronous send: it completes once the rank has taken it,
 * that is once that rank has an error too); another rank prints its own only when it differs from
 * rank 0's. A rank whose error the others do not share (rank 0 sent nothing within a few seconds, or
 * a rank did not take rank 0's) stops the job with MPI_Abort after printing: the other ranks would
 * wait for it in their next collective. */
#define ERROR_WAIT_S 5.0
static void mpi_print_error(const char *msg) {
    if (!g_mpi || g_size == 1 || g_side == MPI_COMM_NULL) {
        fprintf(stderr, "tera: error: %s\n", msg);
        return;
    }
    const int n = g_size;
    /* messages that refer to another rank's own message are left to that rank */
    const int defers = strstr(msg, "another rank") || strstr(msg, "rank 0's message") || strstr(msg, "on rank 0");
    if (g_rank == 0) {
        if (!defers) { /* a deferring one: printed below only if no other rank takes the message (and prints its own) */
            fprintf(stderr, "tera: error: %s\n", msg);
            fflush(stderr);
        }
        const int len = (int)strnlen(msg, 4095) + 1;
        MPI_Request *rq = tera_calloc((size_t)n, sizeof *rq);
        for (int p = 1; p < n; p++) MPI_CHECK(MPI_Issend(msg, len, MPI_CHAR, p, TAG_E, g_side, &rq[p]));
        const double t_end = mono() + ERROR_WAIT_S;
        int alone = 0;
        for (int p = 1; p < n; p++) {
            int done = 0;
            while (MPI_Test(&rq[p], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && mono() < t_end) sleep_s(1e-3);
            alone |= !done;
        }
        free(rq);
        if (alone) { /* a rank without this error waits for rank 0 in a collective */
            if (defers) fprintf(stderr, "tera: error: %s\n", msg);
            fprintf(stderr, "tera: the other ranks did not fail alike: stopping every rank\n");
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        return;
    }
    char *root = tera_calloc(4096, 1);
    MPI_Request rq;
    MPI_CHECK(MPI_Irecv(root, 4096, MPI_CHAR, 0, TAG_E, g_side, &rq));
    int done = 0;
    const double t_end = mono() + ERROR_WAIT_S;
    while (MPI_Test(&rq, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && mono() < t_end) sleep_s(1e-3);
    if (!done) {
        MPI_Cancel(&rq);
        MPI_Wait(&rq, MPI_STATUS_IGNORE);
    }
    if (!defers && (!done || strncmp(root, msg, 4095) != 0)) {
        fprintf(stderr, "tera: error (rank %d): %s\n", g_rank, msg);
        fflush(stderr);
    }
    free(root);
    if (!done) MPI_Abort(MPI_COMM_WORLD, 1); /* rank 0 has no error: it waits for this rank */
}


/* ---- collectives (c->size >= 2: comm.c serves one-rank groups and counts the traffic) */

/* MPI counts are int: large buffers go in pieces */
#define MAX_PIECE ((int64_t)1 << 30)

static MPI_Datatype mpi_type(tera_comm_dtype dt) {
    switch (dt) {
    case TERA_COMM_F32: return MPI_FLOAT;
    case TERA_COMM_F64: return MPI_DOUBLE;
    case TERA_COMM_I64: return MPI_INT64_T;
    }
    TERA_ASSERTF(0, "MPI backend: unknown data type %d", (int)dt);
    return MPI_DATATYPE_NULL;
}

static size_t type_size(tera_comm_dtype dt) { return dt == TERA_COMM_F32 ? 4 : 8; }

static void mpi_allreduce(tera_comm *c, void *buf, int64_t n, tera_comm_dtype dt, tera_comm_redop op) {
    if (dt == TERA_COMM_F32 && op == TERA_COMM_SUM && shm_of(c) && n >= tera_shm_min_floats()) {
        mpi_op *o = pool_take(OP_WAIT_SHM);
        tera_shm_start(shm_of(c), &o->shm, buf, n);
        wait_until(poll_shm, &o->shm, OP_WAIT_SHM);
        pool_put(o);
        return;
    }
    const MPI_Datatype t = mpi_type(dt);
    const size_t es = type_size(dt);
    const MPI_Op o = op == TERA_COMM_MAX ? MPI_MAX : MPI_SUM;
    for (int64_t off = 0; off < n; off += MAX_PIECE) {
        int64_t k = n - off < MAX_PIECE ? n - off : MAX_PIECE;
        MPI_Request r;
        MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, (char *)buf + off * (int64_t)es, (int)k, t, o, comm_of(c), &r));
        wait_req(&r, OP_ALLREDUCE);
    }
}

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

/* The blocking reduce-scatter and all-gather take their counts from a pool object too ([world size]
 * each: groups of any size, no allocation after the first step; MPI_THREAD_FUNNELED: one thread). */
/* ranges summing to at least tera_shm_min_floats(), on a group with a shared segment */
static int shm_ranges(const tera_comm *c, const mpi_op *o) {
    if (!shm_of(c)) return 0;
    int64_t t = 0;
    for (int r = 0; r < c->size; r++) t += o->cnt[r];
    return t >= tera_shm_min_floats();
}

static void shm_ranges_blocking(tera_comm *c, mpi_op *o, tera_shm_kind kind, float *buf) {
    tera_shm_start_ranges(shm_of(c), &o->shm, kind, buf, o->cnt, o->disp);
    wait_until(poll_shm, &o->shm, OP_WAIT_SHM);
    pool_put(o);
}

static void mpi_reduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts) {
    TERA_ASSERT(c->size <= g_size);
    mpi_op *o = pool_take(OP_REDUCE_SCATTER);
    int_counts(c, counts, o->cnt, o->disp);
    if (shm_ranges(c, o)) {
        shm_ranges_blocking(c, o, TERA_SHM_REDUCE_SCATTER, buf);
        return;
    }
    /* MPI_IN_PLACE: input from buf, this rank's result at the START of buf: move it into place */
    MPI_CHECK(MPI_Ireduce_scatter(MPI_IN_PLACE, buf, o->cnt, MPI_FLOAT, MPI_SUM, comm_of(c), &o->r));
    wait_req(&o->r, OP_REDUCE_SCATTER);
    if (o->disp[c->rank] > 0) memmove(buf + o->disp[c->rank], buf, sizeof(float) * (size_t)o->cnt[c->rank]);
    pool_put(o);
}

static void mpi_allgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    TERA_ASSERT(c->size <= g_size);
    mpi_op *o = pool_take(OP_ALLGATHER);
    int_counts(c, counts, o->cnt, o->disp);
    if (shm_ranges(c, o)) {
        shm_ranges_blocking(c, o, TERA_SHM_ALLGATHER, buf);
        return;
    }
    MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, o->cnt, o->disp, MPI_FLOAT, comm_of(c), &o->r));
    wait_req(&o->r, OP_ALLGATHER);
    pool_put(o);
}

static void mpi_alltoall_i32(tera_comm *c, const int32_t *send, int32_t *recv, int n) {
    MPI_Request r;
    MPI_CHECK(MPI_Ialltoall(send, n, MPI_INT32_T, recv, n, MPI_INT32_T, comm_of(c), &r));
    wait_req(&r, OP_ALLTOALL);
}

static void mpi_barrier(tera_comm *c) {
    MPI_Request r;
    MPI_CHECK(MPI_Ibarrier(comm_of(c), &r));
    wait_req(&r, OP_BARRIER);
}

/* ---- non-blocking operations: an object from the pool each */
static void *mpi_iallreduce_f32(tera_comm *c, float *buf, int64_t n) {
    TERA_ASSERTF(n <= MAX_PIECE, "non-blocking all-reduce of %ld floats: buckets must be smaller", (long)n);
    if (shm_of(c) && n >= tera_shm_min_floats()) { /* on one host: through the shared segment */
        mpi_op *o = pool_take(OP_WAIT_SHM);
        tera_shm_start(shm_of(c), &o->shm, buf, n);
        return o;
    }
    mpi_op *o = pool_take(OP_WAIT_ALLREDUCE);
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, comm_of(c), &o->r));
    return o;
}

static void *mpi_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    TERA_ASSERT(c->size <= g_size);
    mpi_op *o = pool_take(OP_WAIT_ALLGATHER);
    int_counts(c, counts, o->cnt, o->disp); /* kept with the request until it completes */
    if (shm_ranges(c, o)) {
        o->kind = OP_WAIT_SHM;
        tera_shm_start_ranges(shm_of(c), &o->shm, TERA_SHM_ALLGATHER, buf, o->cnt, o->disp);
        return o;
    }
    MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, o->cnt, o->disp, MPI_FLOAT, comm_of(c), &o->r));
    return o;
}

/* The same MPI call as the blocking mpi_reduce_scatter_f32 (the same algorithm, the same order of
 * additions); the result is moved into place when the request completes (mpi_wait, mpi_test). */
static void *mpi_ireduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts) {
    TERA_ASSERT(c->size <= g_size);
    mpi_op *o = pool_take(OP_WAIT_REDUCE_SCATTER);
    int_counts(c, counts, o->cnt, o->disp); /* kept with the request until it completes */
    if (shm_ranges(c, o)) { /* the result lands in this rank's range directly */
        o->kind = OP_WAIT_SHM;
        tera_shm_start_ranges(shm_of(c), &o->shm, TERA_SHM_REDUCE_SCATTER, buf, o->cnt, o->disp);
        return o;
    }
    o->rs_buf = buf;
    o->rs_rank = c->rank;
    MPI_CHECK(MPI_Ireduce_scatter(MPI_IN_PLACE, buf, o->cnt, MPI_FLOAT, MPI_SUM, comm_of(c), &o->r));
    return o;
}

/* A completed request's last step (a reduce-scatter's result into this rank's range), then back to the pool. */
static void op_done(mpi_op *o) {
    if (o->kind == OP_WAIT_REDUCE_SCATTER && o->disp[o->rs_rank] > 0)
        memmove(o->rs_buf + o->disp[o->rs_rank], o->rs_buf, sizeof(float) * (size_t)o->cnt[o->rs_rank]);
    o->rs_buf = NULL;
    pool_put(o);
}

static void *mpi_isend_f32(tera_comm *c, const float *buf, int64_t n, int peer, int tag) {
    TERA_ASSERTF(n <= MAX_PIECE, "point-to-point message of %ld floats is too large", (long)n);
    mpi_op *o = pool_take(OP_SEND);
    MPI_CHECK(MPI_Isend(buf, (int)n, MPI_FLOAT, peer, tag, comm_of(c), &o->r));
    return o;
}

static void *mpi_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag) {
    TERA_ASSERTF(n <= MAX_PIECE, "point-to-point message of %ld floats is too large", (long)n);
    mpi_op *o = pool_take(OP_RECV);
    MPI_CHECK(MPI_Irecv(buf, (int)n, MPI_FLOAT, peer, tag, comm_of(c), &o->r));
    return o;
}

static void mpi_wait(void *op) {
    mpi_op *o = op;
    if (o->kind == OP_WAIT_SHM) wait_until(poll_shm, &o->shm, OP_WAIT_SHM);
    else wait_req(&o->r, o->kind);
    op_done(o);
}

static int mpi_test(void *op) {
    mpi_op *o = op;
    int done = 0;
    tera_shm_progress();
    if (o->kind == OP_WAIT_SHM) done = tera_shm_done(&o->shm);
    else MPI_CHECK(MPI_Test(&o->r, &done, MPI_STATUS_IGNORE));
    if (done) op_done(o);
    return done;
}

/* ---- byte collectives (compressed data: src/comm/compress.c) */
static void mpi_alltoallv_u8(tera_comm *c, const void *send, const int64_t *scount, void *recv, const int64_t *rcount) {
    TERA_ASSERT(c->size <= g_size);
    mpi_op *a = pool_take(OP_ALLTOALL), *b = pool_take(OP_ALLTOALL); /* their count arrays */
    int_counts(c, scount, a->cnt, a->disp);
    int_counts(c, rcount, b->cnt, b->disp);
    MPI_CHECK(MPI_Ialltoallv(send, a->cnt, a->disp, MPI_BYTE, recv, b->cnt, b->disp, MPI_BYTE, comm_of(c), &a->r));
    wait_req(&a->r, OP_ALLTOALL);
    pool_put(b);
    pool_put(a);
}

static void mpi_allgatherv_u8(tera_comm *c, void *buf, const int64_t *counts) {
    TERA_ASSERT(c->size <= g_size);
    mpi_op *o = pool_take(OP_ALLGATHER);
    int_counts(c, counts, o->cnt, o->disp);
    MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, o->cnt, o->disp, MPI_BYTE, comm_of(c), &o->r));
    wait_req(&o->r, OP_ALLGATHER);
    pool_put(o);
}

/* the lowest world rank on this rank's host (set-up; blocking, timed out by the backup thread) */
static int mpi_host_leader(void) {
    MPI_Comm node;
    g_op = OP_SPLIT;
    g_op_blocking = 1;
    g_op_start = mono();
    MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_rank, MPI_INFO_NULL, &node));
    int lead = g_rank;
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &lead, 1, MPI_INT, MPI_MIN, node));
    g_op_start = 0.0;
    g_op_blocking = 0;
    g_op = OP_NONE;
    MPI_Comm_free(&node);
    return lead;
}

/* ---- groups */
static void mpi_split(tera_comm *c, int color, int key, tera_comm *g) {
    mpi_group *m = tera_calloc(1, sizeof *m);
    /* blocking (there is no non-blocking split): the backup thread times it out */
    g_op = OP_SPLIT;
    g_op_blocking = 1;
    g_op_start = mono();
    MPI_CHECK(MPI_Comm_split(comm_of(c), color, key, &m->comm));
    MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    *g = (tera_comm){.be = &tera__comm_mpi, .ctx = m};
    MPI_Comm_rank(m->comm, &g->rank);
    MPI_Comm_size(m->comm, &g->size);
    m->shm = tera_shm_create(m->comm); /* collective over the new group (NULL for one rank) */
    g_op_start = 0.0;
    g_op_blocking = 0;
    g_op = OP_NONE;
}

static void mpi_free(tera_comm *g) {
    mpi_group *m = g->ctx;
    if (!m || m == &g_world) return;
    if (g_mpi) tera_shm_free(m->shm);
    if (m->comm != MPI_COMM_NULL && g_mpi) MPI_Comm_free(&m->comm);
    free(m);
}

static void *mpi_shared_alloc(tera_comm *c, size_t bytes, void **mem) {
    *mem = NULL;
    if (!shm_of(c)) return NULL; /* not on one host, or TERA_COMM_SHM=0: the same answer on every rank */
    return tera_shm_mem_create(comm_of(c), bytes, mem);
}
static void mpi_shared_free(void *h) {
    if (g_mpi) tera_shm_mem_free(h);
}
static void mpi_wait_for(int (*done)(void *), void *arg) { wait_until(done, arg, OP_WAIT_SHARED); }

const struct tera_comm_backend tera__comm_mpi = {
    .name = "mpi",
    .launched = mpi_launched,
    .init = mpi_init,
    .finalize = mpi_finalize,
    .allreduce = mpi_allreduce,
    .reduce_scatter_f32 = mpi_reduce_scatter_f32,
    .allgather_f32 = mpi_allgather_f32,
    .alltoall_i32 = mpi_alltoall_i32,
    .barrier = mpi_barrier,
    .iallreduce_f32 = mpi_iallreduce_f32,
    .iallgather_f32 = mpi_iallgather_f32,
    .isend_f32 = mpi_isend_f32,
    .irecv_f32 = mpi_irecv_f32,
    .wait = mpi_wait,
    .test = mpi_test,
    .split = mpi_split,
    .free = mpi_free,
    .print_error = mpi_print_error,
    .alltoallv_u8 = mpi_alltoallv_u8,
    .allgatherv_u8 = mpi_allgatherv_u8,
    .host_leader = mpi_host_leader,
    .ireduce_scatter_f32 = mpi_ireduce_scatter_f32,
    .shared_alloc = mpi_shared_alloc,
    .shared_free = mpi_shared_free,
    .wait_for = mpi_wait_for,
};
