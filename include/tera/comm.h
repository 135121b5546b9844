/* The communicator: collectives over a group of ranks, behind a small interface so that model and
 * training code never see the backend. MPI (Open MPI) is the backend when the program runs under
 * a launcher (mpirun); otherwise the world is one rank and every collective is a no-op. A NCCL
 * backend implements the same functions. */
#ifndef TERA_COMM_H
#define TERA_COMM_H

#include <stdint.h>

#include "tera/status.h"

typedef struct tera_comm tera_comm;

/* Starts the world communicator (MPI_Init when launched by mpirun). Idempotent. */
tera_status tera_comm_init(int *argc, char ***argv);
void tera_comm_finalize(void);
tera_comm *tera_comm_world(void);
int tera_comm_rank(const tera_comm *c);
int tera_comm_size(const tera_comm *c);
const char *tera_comm_backend(void); /* "mpi" or "single" */

/* In-place sums over every rank of c. */
void tera_comm_allreduce_f32(tera_comm *c, float *buf, int64_t n);
void tera_comm_allreduce_f64(tera_comm *c, double *buf, int64_t n);
void tera_comm_allreduce_i64(tera_comm *c, int64_t *buf, int64_t n);
/* In-place element-wise maximum over every rank of c. */
void tera_comm_allreduce_max_f32(tera_comm *c, float *buf, int64_t n);

/* In-place reduce-scatter of a buffer split into consecutive ranges of counts[r] elements: on
 * return, rank r's range holds the sum over all ranks of that range (other ranges: undefined). */
void tera_comm_reduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts);
/* In-place all-gather: rank r contributes its range (counts as above); every rank ends with all. */
void tera_comm_allgather_f32(tera_comm *c, float *buf, const int64_t *counts);

/* Non-blocking in-place sum; complete it with tera_comm_wait. */
typedef struct {
    int active;                                 /* 1 while the operation is in flight */
    _Alignas(16) unsigned char storage[32];     /* the backend's request object */
} tera_comm_req;
void tera_comm_iallreduce_f32(tera_comm *c, float *buf, int64_t n, tera_comm_req *req);
/* Non-blocking in-place all-gather (counts as tera_comm_allgather_f32). scratch: 2 * size ints the
 * backend keeps its counts in; it and buf must stay untouched until tera_comm_wait. */
void tera_comm_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts, int *scratch, tera_comm_req *req);
void tera_comm_wait(tera_comm_req *req);
/* Lets queued non-blocking operations progress (backends without a progress thread). */
void tera_comm_poll(tera_comm_req *reqs, int n);
void tera_comm_barrier(tera_comm *c);

/* A sub-group: ranks of c passing the same color form one group, ordered by key (MPI_Comm_split).
 * Called by every rank of c. On one rank it returns a one-rank group. Freed with tera_comm_free. */
tera_comm *tera_comm_split(tera_comm *c, int color, int key);
void tera_comm_free(tera_comm *c);
/* All-to-all of n int32 per rank: send[r*n ..] goes to rank r, recv[r*n ..] comes from rank r. */
void tera_comm_alltoall_i32(tera_comm *c, const int32_t *send, int32_t *recv, int n);
/* Non-blocking point-to-point of n floats with rank `peer` of c (complete with tera_comm_wait).
 * n = 0 posts nothing. The tag tells apart messages between the same pair in flight together. */
void tera_comm_isend_f32(tera_comm *c, const float *buf, int64_t n, int peer, int tag, tera_comm_req *req);
void tera_comm_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag, tera_comm_req *req);

/* Waiting and the watchdog. Every wait (collectives, tera_comm_wait) polls: after its first
 * millisecond with sleeps growing to 1 ms, so a rank waiting for a peer does not spin a core. A wait that makes no progress for the
 * timeout means a peer rank stopped answering: the rank asks every other rank what it is doing (a
 * side channel every waiting rank answers), prints one line naming the ranks that did not answer
 * (stalled outside communication, stopped or dead) and where the others wait, and aborts every rank
 * (MPI_Abort), so a hung peer never hangs the job. A dead peer is already reported by the launcher.
 *
 * tera_comm_set_timeout: seconds > 0 fixed, 0 off, < 0 automatic (parallel.timeout_s's default):
 * inside a training step (between tera_comm_step_begin and _end), once TERA_COMM_AUTO_AFTER_STEPS
 * steps have been timed, max(TERA_COMM_AUTO_FLOOR_S, TERA_COMM_AUTO_FACTOR x the slowest step after
 * the first); before that and outside steps (set-up, evaluation, checkpoints, a rollback), max(
 * TERA_COMM_STARTUP_S, TERA_COMM_AUTO_FACTOR x the slowest step). */
#define TERA_COMM_AUTO_AFTER_STEPS 3
#define TERA_COMM_AUTO_FLOOR_S 60.0
#define TERA_COMM_AUTO_FACTOR 20.0
#define TERA_COMM_STARTUP_S 600.0
void tera_comm_set_timeout(double seconds);
/* The trainer marks each step (the automatic timeout is measured on them). Test hook:
 * TERA_FAULT_STALL_STEP=S[@RANK] makes world rank RANK (default 0) sleep for ever at the start of
 * step S. */
void tera_comm_step_begin(int64_t step);
void tera_comm_step_end(double seconds);
double tera_comm_timeout_now(void); /* the limit in effect now, seconds (0 = off) */

/* Prints "tera: error: MSG" once for the job: rank 0 prints its message and sends it to the other
 * ranks; another rank prints its own (naming itself) only when it differs from rank 0's. Messages
 * that refer to another rank's message ("... on another rank", "see rank 0's message") are printed
 * by rank 0 only. Every rank with an error calls it. An error the other ranks do not share (rank 0
 * sent none within 5 s, or a rank did not take rank 0's) stops the job with MPI_Abort after the
 * message, since those ranks would wait for this one. One rank: a plain print. */
void tera_comm_print_error(const char *msg);

/* Bytes this rank has sent since the last reset, by kind. Point-to-point transfers count exactly;
 * a collective over p ranks counts what a bandwidth-optimal (ring) algorithm sends from each rank
 * (all-reduce 2(p-1)/p of the buffer, reduce-scatter and all-gather (p-1)/p, all-to-all (p-1)/p):
 * the volume the layout needs, whatever algorithm the MPI library picks. */
typedef struct {
    double allreduce, reduce_scatter, allgather, alltoall, p2p;
} tera_comm_traffic;
tera_comm_traffic tera_comm_traffic_get(void);
void tera_comm_traffic_reset(void);

#endif
