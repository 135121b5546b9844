/* The one-rank backend: the world when no launcher started the program, and every one-rank group
 * of any backend (src/comm/comm.c routes them here). A one-rank group already holds every answer:
 * sums, maximum, reduce-scatter, all-gather and the barrier do nothing, the all-to-all copies, and
 * no operation is ever left in flight. Point-to-point messages need a peer, so they never reach it
 * (comm.c aborts first); its entries for them abort as well. */
#include <stdio.h>
#include <string.h>

#include "comm_impl.h"

static int single_launched(void) { return 1; }

static tera_status single_init(int *argc, char ***argv, tera_comm *world) {
    (void)argc, (void)argv;
    *world = (tera_comm){.be = &tera__comm_single, .ctx = NULL, .rank = 0, .size = 1};
    return TERA_OK;
}

static void single_finalize(void) {}

static void single_allreduce(tera_comm *c, void *buf, int64_t n, tera_comm_dtype dt, tera_comm_redop op) {
    (void)c, (void)buf, (void)n, (void)dt, (void)op; /* the sum (maximum) over one rank is its value */
}

static void single_reduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts) {
    (void)c, (void)buf, (void)counts; /* this rank's range is the whole buffer, already summed */
}

static void single_allgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    (void)c, (void)buf, (void)counts; /* this rank's range is the whole buffer */
}

static void single_alltoall_i32(tera_comm *c, const int32_t *send, int32_t *recv, int n) {
    (void)c;
    if (n > 0) memcpy(recv, send, sizeof(int32_t) * (size_t)n);
}

static void single_barrier(tera_comm *c) { (void)c; }

static void *single_iallreduce_f32(tera_comm *c, float *buf, int64_t n) {
    single_allreduce(c, buf, n, TERA_COMM_F32, TERA_COMM_SUM);
    return NULL; /* complete */
}

static void *single_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    single_allgather_f32(c, buf, counts);
    return NULL;
}

static void *single_isend_f32(tera_comm *c, const float *buf, int64_t n, int peer, int tag) {
    (void)buf, (void)tag;
    TERA_ASSERTF(0, "point-to-point send of %ld floats to rank %d of a one-rank group (rank %d)", (long)n, peer,
                 c->rank);
    return NULL;
}

static void *single_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag) {
    (void)buf, (void)tag;
    TERA_ASSERTF(0, "point-to-point receive of %ld floats from rank %d of a one-rank group (rank %d)", (long)n,
                 peer, c->rank);
    return NULL;
}

/* no operation is ever in flight: these see no object */
static void single_wait(void *op) { TERA_ASSERTF(op == NULL, "one-rank backend: wait on a request it never started"); }
static int single_test(void *op) {
    TERA_ASSERTF(op == NULL, "one-rank backend: test of a request it never started");
    return 1;
}

static void single_split(tera_comm *c, int color, int key, tera_comm *g) {
    (void)c, (void)color, (void)key;
    *g = (tera_comm){.be = &tera__comm_single, .ctx = NULL, .rank = 0, .size = 1};
}

static void single_free(tera_comm *g) { (void)g; }

static void single_print_error(const char *msg) { fprintf(stderr, "tera: error: %s\n", msg); }

const struct tera_comm_backend tera__comm_single = {
    .name = "single",
    .launched = single_launched,
    .init = single_init,
    .finalize = single_finalize,
    .allreduce = single_allreduce,
    .reduce_scatter_f32 = single_reduce_scatter_f32,
    .allgather_f32 = single_allgather_f32,
    .alltoall_i32 = single_alltoall_i32,
    .barrier = single_barrier,
    .iallreduce_f32 = single_iallreduce_f32,
    .iallgather_f32 = single_iallgather_f32,
    .isend_f32 = single_isend_f32,
    .irecv_f32 = single_irecv_f32,
    .wait = single_wait,
    .test = single_test,
    .split = single_split,
    .free = single_free,
    .print_error = single_print_error,
};
