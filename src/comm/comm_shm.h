/* Shared-memory all-reduce for the MPI backend (comm_shm.c): the ranks of a group that all run on one
 * host sum fp32 buffers through a segment they all map (MPI_Win_allocate_shared), instead of through
 * Open MPI's collectives, which copy and sum through their own buffers in the calls that start and
 * poll them (docs/PERFORMANCE.md, "Wave 9": 120-200 ms of a rank's core per 208 MB step on two ranks).
 *
 * Each buffer goes in chunks of CH floats per rank: every rank copies its chunk into its slot, then
 * sums its own share of the chunk over the slots in rank order (0, 1, ..., p-1: every element summed
 * once, by one rank, in a fixed order, so every rank receives the same bits and a run repeats them;
 * on two ranks a + b, as MPI's), then copies the whole summed chunk back. Two sets of slots
 * alternate, so a chunk needs two flag waits and no third. Operations are non-blocking and proceed in
 * the order each group started them (the order MPI requires of collectives anyway); tera_shm_progress
 * advances every group's queue as far as the other ranks allow, never waiting. Internal to the MPI
 * backend (src/comm/comm_mpi.c), which starts, polls and waits for them under its watchdog. */
#ifndef TERA_COMM_SHM_H
#define TERA_COMM_SHM_H

#include <mpi.h>
#include <stdatomic.h>
#include <stdint.h>

typedef struct tera_shm tera_shm;

typedef enum { TERA_SHM_ALLREDUCE, TERA_SHM_REDUCE_SCATTER, TERA_SHM_ALLGATHER } tera_shm_kind;

typedef struct tera_shm_op {
    tera_shm_kind kind;
    float *buf;               /* [n] summed in place (all-reduce); the ranks' ranges (the others) */
    int64_t n, off;           /* elements (the longest range), and the start of the chunk in progress
                               * (in the buffer; in every range for the others) */
    const int *cnt, *disp;    /* reduce-scatter, all-gather: rank r's range [disp[r], disp[r] + cnt[r]) */
    int phase;                /* 0 copy in, 1 wait for every rank's copy, 2 wait for every rank's share */
    _Atomic int done;         /* set when the whole buffer holds the sum (read it with tera_shm_done) */
    struct tera_shm_op *next; /* the group's queue */
} tera_shm_op;

/* Collective over comm (set-up): the group's segment, or NULL (every rank alike) when the ranks are
 * not all on one host, the segment cannot be made, or TERA_COMM_SHM=0 (A/B timing). */
tera_shm *tera_shm_create(MPI_Comm comm);
void tera_shm_free(tera_shm *s); /* collective over the group */

/* The smallest collective that goes through the segment: every one (1 float), so that every fp32 sum
 * of a group adds in the same order whatever its size (ZeRO-1's reduce-scatters and ZeRO-0's bucket
 * sums give the same bits); TERA_COMM_SHM_MIN=N leaves smaller ones to MPI (experiments). */
int64_t tera_shm_min_floats(void);

/* Queues the sum of buf[n] over the group (op is the caller's until op->done) and advances it. */
void tera_shm_start(tera_shm *s, tera_shm_op *op, float *buf, int64_t n);
/* The same for a reduce-scatter (this rank's range of buf receives its sum over the group, in place;
 * the rest of buf is left as it was) or an all-gather (every range of buf receives its owner's), with
 * the ranges cnt/disp ([group size] each, read until op->done). A chunk of either needs one flag wait:
 * each rank sums (copies) its own pieces only. */
void tera_shm_start_ranges(tera_shm *s, tera_shm_op *op, tera_shm_kind kind, float *buf, const int *cnt,
                           const int *disp);
/* Advances every group's queue without waiting (unless the progress thread is at it); returns 1 when
 * anything moved since this thread's previous call, by whichever thread. */
int tera_shm_progress(void);
/* 1 once op is done: its buffer holds the result and op may be reused (acquire) */
int tera_shm_done(const tera_shm_op *op);
/* Host-shared memory for tera_comm_shared_create (src/comm/comm.c, through the MPI backend's
 * shared_alloc): `bytes` bytes that every rank of comm maps (a POSIX shared-memory object, its pages
 * reserved but not written: a page no rank touches stays out of every resident set), page-aligned;
 * NULL on every rank alike where the ranks are not all on one host, TERA_COMM_SHM=0, or the object
 * cannot be made (e.g. /dev/shm lacks the room). Creation is collective over comm; tera_shm_mem_free
 * is not (each rank unmaps its own view). */
typedef struct tera_shm_mem tera_shm_mem;
tera_shm_mem *tera_shm_mem_create(MPI_Comm comm, size_t bytes, void **base);
void tera_shm_mem_free(tera_shm_mem *m);

/* 1 while the progress thread runs (every group made starts it unless TERA_COMM_SHM_THREAD=0; the last
 * group freed stops it) */
int tera_shm_thread_running(void);

#endif
