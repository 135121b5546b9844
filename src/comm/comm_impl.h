/* Inside the communicator: what a backend implements (struct tera_comm_backend, a table of functions
 * in the manner of ggml's backend interface) and the group object they share. src/comm/comm.c owns
 * the public functions of include/tera/comm.h: it checks their contracts, counts traffic, routes
 * every one-rank group to the one-rank backend and the others to their group's backend, and keeps
 * the requests' public fields. A backend (comm_single.c, comm_mpi.c; a NCCL one would be a third)
 * therefore sees only groups of two ranks or more (except init, split and free), never a request
 * struct, and never n = 0 for a sum or a point-to-point message. Internal names carry a double
 * underscore (tera__comm_*). */
#ifndef TERA_COMM_IMPL_H
#define TERA_COMM_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "tera/comm.h"

/* A group of ranks. The struct is the dispatcher's; ctx is the backend's. */
struct tera_comm {
    const struct tera_comm_backend *be; /* the backend serving the group (the one-rank one for ranks = 1) */
    void *ctx;                          /* the backend's group object (MPI: an MPI_Comm), NULL when none */
    int rank, size;                     /* this rank in the group, the group's size */
    int *wrank;                         /* [size] the members' world ranks (NULL: the world itself) */
};

typedef enum { TERA_COMM_F32, TERA_COMM_F64, TERA_COMM_I64 } tera_comm_dtype;
typedef enum { TERA_COMM_SUM, TERA_COMM_MAX } tera_comm_redop;

/* A backend. Every entry is required. Collectives block (under the backend's watchdog) and follow
 * include/tera/comm.h's contracts; c->size >= 2 for every entry taking a group except split and
 * free. Non-blocking starts return the backend's object for the operation (from a pool it owns and
 * never allocates from in a steady state; it keeps the all-gather's counts there), or NULL when
 * nothing is in flight; wait and test take that object back and return it to the pool. */
struct tera_comm_backend {
    const char *name; /* tera_comm_backend()'s answer when it serves the world */

    /* 1 when this process was started by the backend's launcher (the environment says so) */
    int (*launched)(void);
    /* starts the world (fills *world: be, ctx, rank, size); called once, before any other entry */
    tera_status (*init)(int *argc, char ***argv, tera_comm *world);
    /* ends the world (every request complete); no entry is called after it */
    void (*finalize)(void);

    void (*allreduce)(tera_comm *c, void *buf, int64_t n, tera_comm_dtype dt, tera_comm_redop op); /* n > 0 */
    void (*reduce_scatter_f32)(tera_comm *c, float *buf, const int64_t *counts);
    void (*allgather_f32)(tera_comm *c, float *buf, const int64_t *counts);
    void (*alltoall_i32)(tera_comm *c, const int32_t *send, int32_t *recv, int n);
    void (*barrier)(tera_comm *c);

    void *(*iallreduce_f32)(tera_comm *c, float *buf, int64_t n);               /* n > 0 */
    void *(*iallgather_f32)(tera_comm *c, float *buf, const int64_t *counts);   /* copies counts */
    void *(*isend_f32)(tera_comm *c, const float *buf, int64_t n, int peer, int tag); /* n > 0, peer valid */
    void *(*irecv_f32)(tera_comm *c, float *buf, int64_t n, int peer, int tag);
    void (*wait)(void *op);   /* blocks until op completes, then releases it */
    int (*test)(void *op);    /* 1 (op released) when op has completed, else 0; never blocks */

    /* fills *g (be, ctx, rank, size) with the sub-group of c this rank's color names (collective
     * over c; c->size may be 1); free releases g's ctx (the dispatcher frees g itself) */
    void (*split)(tera_comm *c, int color, int key, tera_comm *g);
    void (*free)(tera_comm *g);

    /* tera_comm_print_error for a world of two ranks or more */
    void (*print_error)(const char *msg);

    /* Optional (NULL in a backend that only serves one-rank groups; comm.c serves those itself):
     * byte collectives for compressed data, consecutive ranges in rank order (all-to-all: scount[r]
     * bytes of send to rank r, rcount[r] bytes of recv from rank r; all-gather in place), and the
     * lowest world rank sharing this rank's host (collective over the world). */
    void (*alltoallv_u8)(tera_comm *c, const void *send, const int64_t *scount, void *recv, const int64_t *rcount);
    void (*allgatherv_u8)(tera_comm *c, void *buf, const int64_t *counts);
    int (*host_leader)(void);
    /* the non-blocking reduce-scatter (copies counts; the result moved into this rank's range when the
     * operation completes, in wait or test), summing exactly as reduce_scatter_f32 does; NULL: comm.c
     * runs the blocking one */
    void *(*ireduce_scatter_f32)(tera_comm *c, float *buf, const int64_t *counts);
    /* Host-shared memory (tera_comm_shared_create; NULL: none, as in the NCCL backend): collective
     * over c, `bytes` bytes every member maps, not initialised, 64-byte aligned at *mem; returns the handle
     * shared_free takes (not collective: each member releases its own view), or NULL on every rank
     * alike where there is none (members on several hosts, no room). wait_for blocks until done(arg)
     * returns 1, polling under the watchdog as every wait does. */
    void *(*shared_alloc)(tera_comm *c, size_t bytes, void **mem);
    void (*shared_free)(void *handle);
    void (*wait_for)(int (*done)(void *), void *arg);
};

extern const struct tera_comm_backend tera__comm_single; /* comm_single.c: the one-rank world */
extern const struct tera_comm_backend tera__comm_mpi;    /* comm_mpi.c: Open MPI */

/* For the backends' watchdogs and fault hooks (comm.c keeps them for every backend). */
int64_t tera__comm_step(void);    /* the training step begun last, -1 before the first */
int tera__comm_timeout_auto(void); /* 1 when the timeout is automatic (parallel.timeout_s < 0) */

#endif
