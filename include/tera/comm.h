/* The communicator: collectives over a group of ranks, behind a small interface so that model and
 * training code never see the backend. The backends are tables of functions (struct
 * tera_comm_backend, src/comm/comm_impl.h): src/comm/comm_single.c, the one-rank world (every
 * collective a no-op or a copy), and src/comm/comm_mpi.c (Open MPI), chosen by tera_comm_init when
 * a launcher started the program. A NCCL backend implements the same table. This header has no
 * backend types: groups and requests are opaque to callers, and a backend keeps whatever it needs
 * for an operation in flight (requests, counts) itself.
 *
 * Collective (below): every rank of the group calls it, in the same order as the group's other
 * collectives, with the same n (or counts). Buffers belong to the caller; a blocking call is done
 * with them when it returns. A one-rank group (any backend) is served by the one-rank code: sums,
 * maximum, reduce-scatter and all-gather leave the buffer as it is (already the answer), the
 * all-to-all copies, non-blocking operations are complete when they return. Misuse (a point-to-point
 * message to this rank itself, a peer outside the group, ranges too large for the backend) aborts
 * every rank with file:line. Every function is called from the thread that called tera_comm_init. */
#ifndef TERA_COMM_H
#define TERA_COMM_H

#include <stdint.h>

#include "tera/status.h"

typedef struct tera_comm tera_comm; /* a group of ranks (opaque) */
struct tera_comm_backend;           /* a backend's function table (src/comm/comm_impl.h) */

/* Starts the world communicator: the first backend that finds its launcher (Open MPI or another
 * MPI: OMPI_COMM_WORLD_SIZE or PMI_SIZE in the environment; MPI_Init then) serves the world,
 * otherwise the one-rank world (no launcher needed, nothing initialised). Idempotent; argc/argv may
 * be NULL. On failure the world stays one rank and the status says why. */
tera_status tera_comm_init(int *argc, char ***argv);
/* Ends the world (MPI_Finalize); every request must be complete. No collective after it. */
void tera_comm_finalize(void);
/* The world: every rank of the job (before tera_comm_init: the one-rank world). Not freed. */
tera_comm *tera_comm_world(void);
int tera_comm_rank(const tera_comm *c);
int tera_comm_size(const tera_comm *c);
const char *tera_comm_backend(void); /* the world's backend: "mpi" or "single" */

/* Blocking collectives, in place; buf holds n elements on every rank. Sums over every rank of c
 * (in the backend's order of additions). n = 0: nothing is sent. */
void tera_comm_allreduce_f32(tera_comm *c, float *buf, int64_t n);
void tera_comm_allreduce_f64(tera_comm *c, double *buf, int64_t n);
void tera_comm_allreduce_i64(tera_comm *c, int64_t *buf, int64_t n);
/* In-place element-wise maximum over every rank of c. */
void tera_comm_allreduce_max_f32(tera_comm *c, float *buf, int64_t n);

/* In-place reduce-scatter of a buffer split into consecutive ranges of counts[r] elements (counts:
 * size(c) entries, the same on every rank): on return, rank r's range holds the sum over all ranks
 * of that range (other ranges: undefined). */
void tera_comm_reduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts);
/* In-place all-gather: rank r contributes its range (counts as above); every rank ends with all. */
void tera_comm_allgather_f32(tera_comm *c, float *buf, const int64_t *counts);

/* A non-blocking operation in flight. The caller owns the struct (an array of them, one on the
 * stack); the backend owns what the operation needs (its request object, the all-gather's counts)
 * from a pool it sizes at tera_comm_init and grows only when more operations than ever before are in
 * flight at once (the first step; never in a steady state). A start function sets every field;
 * tera_comm_wait (or tera_comm_poll seeing it complete) clears it and returns the backend's object
 * to its pool. A zeroed request is inactive. Every started request must be completed before its
 * struct is freed or reused. */
typedef struct {
    int active;                         /* read-only: 1 while the operation is in flight */
    const struct tera_comm_backend *be; /* private: the backend that started it */
    void *op;                           /* private: the backend's object for it (its pool's) */
    int kind;                           /* private: its tera_traffic_kind (the blocked time by kind) */
} tera_comm_req;

/* Collective, non-blocking in-place sum of n floats (as tera_comm_allreduce_f32). buf must not be
 * read or written until the request completes. One-rank group or n = 0: complete on return. */
void tera_comm_iallreduce_f32(tera_comm *c, float *buf, int64_t n, tera_comm_req *req);
/* Collective, non-blocking in-place all-gather (as tera_comm_allgather_f32): this rank's range of
 * buf is written before the start; buf (all of it) must then not be read or written until the
 * request completes. The backend keeps its own copy of counts: the caller may change them at once.
 * One-rank group: complete on return. */
void tera_comm_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts, tera_comm_req *req);
/* Collective, non-blocking in-place reduce-scatter (as tera_comm_reduce_scatter_f32: once the
 * request completes, rank r's range holds the sum, added in the same order as the blocking call
 * adds: both start the backend's same operation). buf must not be read or written until then. The
 * backend keeps its own copy of counts: the caller may change them at once. One-rank group, or a
 * backend without a non-blocking form (NCCL): done by the blocking call, complete on return. */
void tera_comm_ireduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts, tera_comm_req *req);
/* Blocks until req completes (an inactive request returns at once), under the watchdog below. */
void tera_comm_wait(tera_comm_req *req);
/* Blocks until one of the n requests *reqs[i] completes, under the watchdog as tera_comm_wait: returns
 * its index (that request cleared; others that completed meanwhile stay active until waited or
 * polled), or -1 at once when none is active. The time blocked counts under the completed
 * operation's kind. */
int tera_comm_wait_any(tera_comm_req *const *reqs, int n);
/* Tests reqs[0..n) once each, completing those that are done (inactive ones are skipped): lets
 * queued non-blocking operations progress where the backend has no progress thread. Never blocks. */
void tera_comm_poll(tera_comm_req *reqs, int n);
/* Collective: returns once every rank of c has entered it. */
void tera_comm_barrier(tera_comm *c);

/* A sub-group: ranks of c passing the same color form one group, ordered by key (MPI_Comm_split).
 * Collective over c (blocking). On one rank it returns a one-rank group. The caller owns the group
 * and frees it with tera_comm_free (not collective; NULL and the world are ignored) once no
 * operation on it is in flight. */
tera_comm *tera_comm_split(tera_comm *c, int color, int key);
void tera_comm_free(tera_comm *c);
/* Collective all-to-all of n int32 per rank: send[r*n ..] goes to rank r, recv[r*n ..] comes from
 * rank r (send and recv: size(c) * n each, not overlapping). Blocking. */
void tera_comm_alltoall_i32(tera_comm *c, const int32_t *send, int32_t *recv, int n);
/* Non-blocking point-to-point of n floats with rank `peer` of c (not this rank), completed with
 * tera_comm_wait or tera_comm_poll; not collective: the peer posts the matching call with the same
 * tag and n. The send's buf must not be written, the receive's not read or written, until the
 * request completes. n = 0 posts nothing (the request is inactive). The tag tells apart messages
 * between the same pair in flight together; messages with the same tag arrive in order. */
void tera_comm_isend_f32(tera_comm *c, const float *buf, int64_t n, int peer, int tag, tera_comm_req *req);
void tera_comm_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag, tera_comm_req *req);

/* Waiting and the watchdog (multi-rank backends; the one-rank world never waits). Every wait
 * (collectives, tera_comm_wait) polls: after its first millisecond with sleeps growing to 1 ms, so a
 * rank waiting for a peer does not spin a core. A wait that makes no progress for the timeout means
 * a peer rank stopped answering: the rank asks every other rank what it is doing (a side channel
 * every waiting rank answers), prints one line naming the ranks that did not answer (stalled outside
 * communication, stopped or dead) and where the others wait, and aborts every rank (MPI_Abort), so a
 * hung peer never hangs the job. A dead peer is already reported by the launcher. The timeout and
 * the step marks below are kept by src/comm/comm.c for every backend.
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
 * message, since those ranks would wait for this one. One-rank world: a plain print to stderr. */
void tera_comm_print_error(const char *msg);

#define TERA_BLOCKED_KINDS 6 /* tera_comm_traffic.blocked_kind_s: the tera_traffic_kind values, then barriers */
/* Bytes this rank has sent since the last reset, by kind, counted by src/comm/comm.c whatever the
 * backend (a one-rank group sends nothing: its counters stay 0). Point-to-point transfers count exactly;
 * a collective over p ranks counts what a bandwidth-optimal (ring) algorithm sends from each rank
 * (all-reduce 2(p-1)/p of the buffer, reduce-scatter and all-gather (p-1)/p, all-to-all (p-1)/p):
 * the volume the layout needs, whatever algorithm the backend's library picks. */
typedef struct {
    double allreduce, reduce_scatter, allgather, alltoall, p2p;
    /* of those bytes, the ones sent to a rank on another node (tera_comm_set_nodes): a ring
     * collective's bytes cross when the rank's successor in the group's ring is on another node, an
     * all-to-all's and a point-to-point's per destination */
    double inter_allreduce, inter_reduce_scatter, inter_allgather, inter_alltoall, inter_p2p;
    /* seconds this rank spent blocked in communication: inside blocking collectives and waits for
     * non-blocking operations and point-to-point transfers (groups of more than one rank); the
     * communication compute did not hide, waiting for slower ranks included */
    double blocked_s;
    /* blocked_s by the operation's kind: [tera_traffic_kind] (all-reduce, reduce-scatter, all-gather,
     * all-to-all, point-to-point; a wait counts under its operation's kind), then [TERA_BLOCKED_BARRIER] */
    double blocked_kind_s[TERA_BLOCKED_KINDS];
    /* seconds inside the calls that start and poll non-blocking operations (tera_comm_i*, tera_comm_poll) of
     * groups of more than one rank: with no progress thread (the MPI backend) the
     * library moves and sums data inside them, on the rank's own cores, so this is communication
     * the overlap hides from the wait but not from the step */
    double progress_s;
} tera_comm_traffic;
tera_comm_traffic tera_comm_traffic_get(void);
void tera_comm_traffic_reset(void);

/* ---- nodes (hosts). Collective over the world: groups ranks by node, ranks_per_node > 0: world
 * ranks [k r, (k+1) r) form node k (emulated nodes on one machine; must divide the world size;
 * r >= the world size: one node),
 * 0: the ranks sharing a host (MPI_Comm_split_type shared), numbered by their lowest world rank.
 * Before the call (and on one rank) every rank is on node 0. Groups made before or after know it. */
tera_status tera_comm_set_nodes(int ranks_per_node);
int tera_comm_nodes(void);                 /* nodes of the world */
int tera_comm_node_of(int world_rank);     /* the node of a world rank */
int tera_comm_world_rank_of(const tera_comm *c, int r); /* member r of c's world rank */
int tera_comm_member_node(const tera_comm *c, int r);   /* member r of c's node */

/* ---- host-shared memory: a block every member of a group maps, where they all run on one host
 * (the MPI backend; docs/COMMUNICATION.md, "Host-shared memory"). Members write their own parts and
 * read the others' in place, ordered by flags: each member has `nflags` counters (64-bit, monotonic,
 * each on its own cache line) that it posts and every member reads. ZeRO-3 gathers a layer's
 * parameters this way (src/parallel/zero.c): each rank writes its piece once and every rank's
 * products read the one gathered copy, with no copy out.
 * tera_comm_shared_create: collective over c; `bytes` bytes (64-byte aligned, not initialised: pages
 * no member touches stay out of resident memory) and the flags (zero), or NULL on every rank alike
 * where there are none: one-rank groups, a backend without them (NCCL), members on several hosts,
 * TERA_COMM_SHM=0, a block that does not fit in what /dev/shm (the MPI backend's store) has free.
 * tera_comm_shared_free is not collective: each member releases its own view (NULL: nothing), so a
 * rank that leaves on an error of its own does not wait for the others there. */
typedef struct tera_comm_shared tera_comm_shared;
tera_comm_shared *tera_comm_shared_create(tera_comm *c, int64_t bytes, int nflags);
void tera_comm_shared_free(tera_comm_shared *s);
void *tera_comm_shared_mem(const tera_comm_shared *s);
/* this member's counter `flag` := v (a release: its writes before the call are seen by a member
 * that then reads v or more) */
void tera_comm_shared_post(tera_comm_shared *s, int flag, uint64_t v);
/* 1 when every member's counter `flag` is >= v (an acquire); never blocks */
int tera_comm_shared_reached(const tera_comm_shared *s, int flag, uint64_t v);
/* blocks until tera_comm_shared_reached, under the watchdog; the time counts as blocked in an
 * operation of `kind` (tera_comm_traffic.blocked_kind_s) */
void tera_comm_shared_wait(tera_comm_shared *s, int flag, uint64_t v, int kind);
/* counts an all-gather, reduce-scatter or all-reduce (kind: TERA_TRAFFIC_ALLGATHER, _REDUCE_SCATTER,
 * _ALLREDUCE) of counts[r] floats per member (the all-reduce: of their sum) done through the block (its
 * ring volume, as the collectives count it), so that layouts report the same bytes either way */
void tera_comm_shared_count(tera_comm_shared *s, int kind, const int64_t *counts);
/* the same for such a collective over group c done through memory shared some other way (a block of a
 * larger group that holds c's members: ZeRO's experts summed over their expert-data-parallel ranks in
 * the data-parallel ranks' block) */
void tera_comm_count_as(tera_comm *c, int kind, const int64_t *counts);

/* ---- byte collectives for compressed data (src/comm/compress.c). Counted under `kind` (its
 * tera_comm_traffic field). All-to-all: scounts[r] bytes from send (consecutive, in rank order) to
 * rank r, rcounts[r] bytes from rank r into recv (consecutive); exact bytes counted. All-gather in
 * place of consecutive ranges of counts[r] bytes (counted as a ring, (p-1)/p of the total). */
typedef enum {
    TERA_TRAFFIC_ALLREDUCE,
    TERA_TRAFFIC_REDUCE_SCATTER,
    TERA_TRAFFIC_ALLGATHER,
    TERA_TRAFFIC_ALLTOALL,
    TERA_TRAFFIC_P2P
} tera_traffic_kind;
#define TERA_BLOCKED_BARRIER 5 /* tera_comm_traffic.blocked_kind_s: barriers */
/* "allreduce", "reduce_scatter", "allgather", "alltoall", "p2p" (tera_traffic_kind), "barrier"
 * (TERA_BLOCKED_BARRIER): the label of a kind in metrics and JSON */
const char *tera_traffic_kind_name(int kind);
void tera_comm_alltoallv_u8(tera_comm *c, const void *send, const int64_t *scounts, void *recv,
                            const int64_t *rcounts, tera_traffic_kind kind);
void tera_comm_allgatherv_u8(tera_comm *c, void *buf, const int64_t *counts, tera_traffic_kind kind);

#endif
