/* MPI backend of the communicator, and the one-rank world when no launcher started the program.
 *
 * Launch detection: Open MPI (OMPI_COMM_WORLD_SIZE), MPICH/Hydra and Slurm (PMI_SIZE) set these in
 * every rank's environment; without them tera runs as one rank and never initialises MPI, so a
 * single-process run needs no mpirun and pays nothing for it.
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

static double mono(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void sleep_s(double s) {
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - floor(s)) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---- the timeout (parallel.timeout_s): fixed, off, or automatic from the measured steps */
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

/* the grace period the stalled operation's rank gives the others to answer its question */
static double grace_s(double limit) { return fmin(fmax(0.25 * limit, 1.0), 10.0); }

/* ---- what this rank is doing, for the other ranks' questions */
enum {
    OP_NONE, OP_ALLREDUCE, OP_REDUCE_SCATTER, OP_ALLGATHER, OP_ALLTOALL, OP_BARRIER, OP_WAIT_ALLREDUCE,
    OP_WAIT_ALLGATHER, OP_SEND, OP_RECV, OP_SPLIT, OP_COUNT
};
static const char *const g_op_names[OP_COUNT] = {
    "no operation", "MPI_Allreduce", "MPI_Reduce_scatter", "MPI_Allgatherv", "MPI_Alltoall", "MPI_Barrier",
    "MPI_Wait (non-blocking all-reduce)", "MPI_Wait (non-blocking all-gather)", "MPI_Wait (send)", "MPI_Wait (receive)",
    "MPI_Comm_split"};
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
            g_answer[from][ST_RANK] = g_world.rank;
            g_answer[from][ST_OP] = g_op;
            g_answer[from][ST_STEP] = g_step;
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

/* The operation this rank waits for (request r) made no progress for `limit` seconds: ask every
 * other rank what it is doing; the ones that do not answer within the grace period are named.
 * Returns 1 when r completed meanwhile, 0 when a lower rank asked meanwhile (that one reports);
 * otherwise prints one line and aborts every rank. */
static int diagnose_and_abort(MPI_Request *r, double limit, int op) {
    const int n = g_world.size, me = g_world.rank;
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
        MPI_CHECK(MPI_Test(r, &done, MPI_STATUS_IGNORE));
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
    append(msg, sizeof msg, &len, " rank %d in %s at step %lld", me, g_op_names[op], (long long)g_step);
    for (int p = 0; p < n; p++)
        if (p != me && got[p]) {
            const int o = ans[p][ST_OP] >= 0 && ans[p][ST_OP] < OP_COUNT ? (int)ans[p][ST_OP] : OP_NONE;
            append(msg, sizeof msg, &len, ", rank %d in %s at step %lld", p, g_op_names[o], ans[p][ST_STEP]);
        }
    append(msg, sizeof msg, &len, "; aborting every rank (parallel.timeout_s%s)",
           g_user_timeout < 0.0 ? ": automatic, see docs/PARALLELISM.md" : "");
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    _exit(3);
}

/* Completes a request, sleeping between tests; times the wait out (see above). */
static void wait_req(MPI_Request *r, int op) {
    if (*r == MPI_REQUEST_NULL) return;
    int done = 0;
    MPI_CHECK(MPI_Test(r, &done, MPI_STATUS_IGNORE));
    if (done) return;
    const double t0 = mono();
    g_op = op;
    g_op_start = t0;
    double nap = 0.0, next_check = t0 + 0.01;
    for (;;) {
        MPI_CHECK(MPI_Test(r, &done, MPI_STATUS_IGNORE));
        if (done) break;
        double now = mono();
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
            if (g_asker >= 0 && g_asker < g_world.rank && now - g_asked_at < grace_s(limit) + 30.0) continue;
            if (diagnose_and_abort(r, limit, op)) break; /* completed after all */
        }
    }
    g_op_start = 0.0;
    g_op = OP_NONE;
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
                    g_world.rank, g_op_names[g_op >= 0 && g_op < OP_COUNT ? g_op : OP_NONE], limit);
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, 3);
            _exit(3);
        }
    }
    return NULL;
}

void tera_comm_set_timeout(double seconds) { g_user_timeout = seconds < 0.0 ? -1.0 : seconds; }

/* test hook: TERA_FAULT_STALL_STEP=S@RANK stops world rank RANK at the start of step S (it sleeps) */
static long long g_stall_step = -1;
static int g_stall_rank = -1;

void tera_comm_step_begin(int64_t step) {
    g_step = step;
    g_in_step = 1;
    if (step == g_stall_step && g_world.rank == g_stall_rank) {
        fprintf(stderr, "tera: rank %d stalls at step %lld (TERA_FAULT_STALL_STEP)\n", g_world.rank, g_stall_step);
        fflush(stderr);
        for (;;) sleep_s(3600.0);
    }
}

void tera_comm_step_end(double seconds) {
    g_in_step = 0;
    if (g_steps_timed++ > 0 && seconds > g_slowest_step) g_slowest_step = seconds; /* the first is warm-up */
}

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
    const char *f = getenv("TERA_FAULT_STALL_STEP");
    if (f && *f) {
        const char *at = strchr(f, '@');
        g_stall_step = atoll(f);
        g_stall_rank = at ? atoi(at + 1) : 0;
    }
    if (g_world.size > 1) {
        MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &g_side));
        MPI_Comm_set_errhandler(g_side, MPI_ERRORS_RETURN);
        g_answer = tera_calloc((size_t)g_world.size, sizeof *g_answer);
        g_answer_req = tera_calloc((size_t)g_world.size, sizeof *g_answer_req);
        for (int p = 0; p < g_world.size; p++) g_answer_req[p] = MPI_REQUEST_NULL;
        post_question_recv();
        if (pthread_create(&g_watchdog, NULL, watchdog, NULL) == 0) {
            pthread_detach(g_watchdog);
            g_watchdog_running = 1;
        }
    }
    return TERA_OK;
}

void tera_comm_finalize(void) {
    if (!g_mpi) return;
    g_op_start = 0.0;
    if (g_side != MPI_COMM_NULL) {
        MPI_Cancel(&g_q_req);
        MPI_Wait(&g_q_req, MPI_STATUS_IGNORE);
        for (int p = 0; p < g_world.size; p++)
            if (g_answer_req[p] != MPI_REQUEST_NULL) MPI_Request_free(&g_answer_req[p]);
        MPI_Comm_free(&g_side);
        free(g_answer);
        free(g_answer_req);
    }
    MPI_Finalize();
    g_mpi = 0;
}

/* An error every rank may have found (before the run, most often the same on every rank): rank 0
 * prints it and sends it to the others (a synchronous send: it completes once the rank has taken it,
 * that is once that rank has an error too); another rank prints its own only when it differs from
 * rank 0's. A rank whose error the others do not share (rank 0 sent nothing within a few seconds, or
 * a rank did not take rank 0's) stops the job with MPI_Abort after printing: the other ranks would
 * wait for it in their next collective. */
#define ERROR_WAIT_S 5.0
void tera_comm_print_error(const char *msg) {
    if (!g_mpi || g_world.size == 1 || g_side == MPI_COMM_NULL) {
        fprintf(stderr, "tera: error: %s\n", msg);
        return;
    }
    const int n = g_world.size;
    if (g_world.rank == 0) {
        fprintf(stderr, "tera: error: %s\n", msg);
        fflush(stderr);
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
    /* messages that refer to another rank's own message are left to that rank */
    const int defers = strstr(msg, "another rank") || strstr(msg, "rank 0's message") || strstr(msg, "on rank 0");
    if (!defers && (!done || strncmp(root, msg, 4095) != 0)) {
        fprintf(stderr, "tera: error (rank %d): %s\n", g_world.rank, msg);
        fflush(stderr);
    }
    free(root);
    if (!done) MPI_Abort(MPI_COMM_WORLD, 1); /* rank 0 has no error: it waits for this rank */
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
        MPI_Request r;
        MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, (char *)buf + off * (int64_t)es, (int)k, dt, op, c->mpi, &r));
        wait_req(&r, OP_ALLREDUCE);
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
    MPI_Request r;
    MPI_CHECK(MPI_Ireduce_scatter(MPI_IN_PLACE, buf, cnt, MPI_FLOAT, MPI_SUM, c->mpi, &r));
    wait_req(&r, OP_REDUCE_SCATTER);
    if (disp[c->rank] > 0) memmove(buf + disp[c->rank], buf, sizeof(float) * (size_t)cnt[c->rank]);
}

void tera_comm_allgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    if (c->size == 1) return;
    int cnt[1024], disp[1024];
    TERA_ASSERT(c->size <= 1024);
    int_counts(c, counts, cnt, disp);
    g_traffic.allgather += ring_share(c) * 4.0 * (double)(disp[c->size - 1] + cnt[c->size - 1]);
    MPI_Request r;
    MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, cnt, disp, MPI_FLOAT, c->mpi, &r));
    wait_req(&r, OP_ALLGATHER);
}

_Static_assert(sizeof(MPI_Request) <= sizeof(((tera_comm_req *)0)->storage), "tera_comm_req too small");

static MPI_Request *req_of(tera_comm_req *req) { return (MPI_Request *)(void *)req->storage; }

void tera_comm_iallreduce_f32(tera_comm *c, float *buf, int64_t n, tera_comm_req *req) {
    req->active = 0;
    if (c->size == 1 || n == 0) return;
    TERA_ASSERTF(n <= MAX_PIECE, "non-blocking all-reduce of %ld floats: buckets must be smaller", (long)n);
    g_traffic.allreduce += 2.0 * ring_share(c) * 4.0 * (double)n;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, c->mpi, req_of(req)));
    req->active = OP_WAIT_ALLREDUCE;
}

void tera_comm_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts, int *scratch, tera_comm_req *req) {
    req->active = 0;
    if (c->size == 1) return;
    int *cnt = scratch, *disp = scratch + c->size;
    int_counts(c, counts, cnt, disp);
    g_traffic.allgather += ring_share(c) * 4.0 * (double)(disp[c->size - 1] + cnt[c->size - 1]);
    MPI_CHECK(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, cnt, disp, MPI_FLOAT, c->mpi, req_of(req)));
    req->active = OP_WAIT_ALLGATHER;
}

/* req->active holds the kind of the operation in flight (OP_WAIT_*, OP_SEND, OP_RECV), 0 when none */
void tera_comm_wait(tera_comm_req *req) {
    if (!req->active) return;
    wait_req(req_of(req), req->active);
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
    /* blocking (there is no non-blocking split): the backup thread times it out */
    g_op = OP_SPLIT;
    g_op_blocking = 1;
    g_op_start = mono();
    MPI_CHECK(MPI_Comm_split(c->mpi, color, key, &g->mpi));
    g_op_start = 0.0;
    g_op_blocking = 0;
    g_op = OP_NONE;
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
    MPI_Request r;
    MPI_CHECK(MPI_Ialltoall(send, n, MPI_INT32_T, recv, n, MPI_INT32_T, c->mpi, &r));
    wait_req(&r, OP_ALLTOALL);
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
    req->active = send ? OP_SEND : OP_RECV;
}

void tera_comm_isend_f32(tera_comm *c, const float *buf, int64_t n, int peer, int tag, tera_comm_req *req) {
    p2p(c, (float *)buf, n, peer, tag, req, 1); /* MPI_Isend reads it only */
}

void tera_comm_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag, tera_comm_req *req) {
    p2p(c, buf, n, peer, tag, req, 0);
}

void tera_comm_barrier(tera_comm *c) {
    if (c->size == 1) return;
    MPI_Request r;
    MPI_CHECK(MPI_Ibarrier(c->mpi, &r));
    wait_req(&r, OP_BARRIER);
}
