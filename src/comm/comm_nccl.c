/* The NCCL backend of the communicator (struct tera_comm_backend, comm_impl.h; issue 21): the MPI
 * backend (comm_mpi.c) starts the world, splits groups and keeps its watchdog, and every group of
 * two ranks or more also gets an NCCL communicator (bootstrapped by broadcasting an ncclUniqueId
 * over the group's MPI communicator). The blocking sums and gathers run over NCCL:
 *   allreduce (f32, f64, i64; sum, max), reduce_scatter_f32 and allgather_f32 with equal counts;
 * everything else (reduce-scatter/all-gather with unequal counts, all-to-all, barrier, the
 * non-blocking and point-to-point operations, byte collectives, error printing, host leaders) is
 * delegated to the MPI backend unchanged, on the same group (c->ctx stays the MPI backend's).
 *
 * Buffers: a device pointer goes to NCCL as it is; a host pointer (today's model keeps its
 * gradients on the host) is copied to a device staging buffer and back. The device is the local
 * rank modulo the devices seen (several ranks may share one GPU). Operations are synchronous on
 * one stream per process: no compute/comm overlap yet, and no watchdog around NCCL calls (a
 * stalled peer blocks here; docs/GPU.md).
 *
 * libnccl is loaded with dlopen at init (a tera that never starts this backend maps no NCCL).
 *
 * Compiled only when CMake found NCCL (cmake/cuda.cmake defines TERA_NCCL); chosen as the world's
 * backend by comm.c's list when it serves one (tera__comm_nccl.launched: an MPI launch with
 * TERA_COMM_BACKEND=nccl in the environment). */
#ifdef TERA_NCCL

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <mpi.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_impl.h"

extern const struct tera_comm_backend tera__comm_nccl; /* below; comm.c lists it where built */

/* the NCCL functions used, from dlopen */
static struct {
    ncclResult_t (*get_unique_id)(ncclUniqueId *id);
    ncclResult_t (*comm_init_rank)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
    ncclResult_t (*comm_destroy)(ncclComm_t comm);
    ncclResult_t (*all_reduce)(const void *send, void *recv, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*reduce_scatter)(const void *send, void *recv, size_t recvcount, ncclDataType_t dt,
                                   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*all_gather)(const void *send, void *recv, size_t sendcount, ncclDataType_t dt, ncclComm_t comm,
                               cudaStream_t stream);
    const char *(*error_string)(ncclResult_t r);
} g_nccl;

#define NCCL_STR2(x) #x
#define NCCL_STR(x) NCCL_STR2(x)

static tera_status load_nccl(void) {
    static const char *const names[] = {"libnccl.so." NCCL_STR(NCCL_MAJOR),
#ifdef TERA_NCCL_LIBDIR
                                        TERA_NCCL_LIBDIR "/libnccl.so." NCCL_STR(NCCL_MAJOR),
#endif
                                        "libnccl.so"};
    void *h = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) return tera_fail(TERA_ERR_CONFIG, "TERA_COMM_BACKEND = nccl: cannot load libnccl (%s)", dlerror());
    static const char *const syms[] = {"ncclGetUniqueId",  "ncclCommInitRank", "ncclCommDestroy",   "ncclAllReduce",
                                       "ncclReduceScatter", "ncclAllGather",    "ncclGetErrorString"};
    void **slots[] = {(void **)&g_nccl.get_unique_id, (void **)&g_nccl.comm_init_rank, (void **)&g_nccl.comm_destroy,
                      (void **)&g_nccl.all_reduce,    (void **)&g_nccl.reduce_scatter, (void **)&g_nccl.all_gather,
                      (void **)&g_nccl.error_string};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++)
        if (!(*slots[i] = dlsym(h, syms[i])))
            return tera_fail(TERA_ERR_CONFIG, "TERA_COMM_BACKEND = nccl: libnccl lacks %s", syms[i]);
    return TERA_OK;
}

#define NCCL_CHECK(call)                                                                                      \
    do {                                                                                                      \
        const ncclResult_t _r = (call);                                                                       \
        if (_r != ncclSuccess) tera_abort_at(__FILE__, __LINE__, "%s: %s", #call, g_nccl.error_string(_r));  \
    } while (0)
#define CUDA_CHECK(call)                                                                                   \
    do {                                                                                                   \
        const cudaError_t _e = (call);                                                                     \
        if (_e != cudaSuccess) tera_abort_at(__FILE__, __LINE__, "%s: %s", #call, cudaGetErrorString(_e)); \
    } while (0)

/* NCCL communicators of the groups, found by the group's MPI ctx */
enum { MAX_GROUPS = 256 };
static struct {
    const void *ctx;
    ncclComm_t nc;
} g_groups[MAX_GROUPS];
static int g_n_groups = 0;
static cudaStream_t g_stream = NULL;
static char *g_stage = NULL; /* device staging for host buffers */
static size_t g_stage_bytes = 0;
static int g_up = 0;

static int nccl_launched(void) {
    const char *b = getenv("TERA_COMM_BACKEND");
    return b && strcmp(b, "nccl") == 0 && tera__comm_mpi.launched();
}

static ncclComm_t nc_of(const tera_comm *c) {
    for (int i = 0; i < g_n_groups; i++)
        if (g_groups[i].ctx == c->ctx) return g_groups[i].nc;
    tera_abort_at(__FILE__, __LINE__, "NCCL backend: a group of %d ranks without an NCCL communicator", c->size);
}

/* A group's NCCL communicator: collective over the group's members (its MPI communicator). */
static void attach(const tera_comm *c) {
    if (c->size < 2) return;
    TERA_ASSERTF(g_n_groups < MAX_GROUPS, "NCCL backend: more than %d groups", MAX_GROUPS);
    ncclUniqueId id;
    if (c->rank == 0) NCCL_CHECK(g_nccl.get_unique_id(&id));
    MPI_Comm m = *(const MPI_Comm *)c->ctx;
    if (MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, m) != MPI_SUCCESS)
        tera_abort_at(__FILE__, __LINE__, "NCCL backend: MPI_Bcast of the NCCL id failed");
    ncclComm_t nc;
    NCCL_CHECK(g_nccl.comm_init_rank(&nc, c->size, id, c->rank));
    g_groups[g_n_groups].ctx = c->ctx;
    g_groups[g_n_groups].nc = nc;
    g_n_groups++;
}

static void detach(const tera_comm *c) {
    for (int i = 0; i < g_n_groups; i++)
        if (g_groups[i].ctx == c->ctx) {
            NCCL_CHECK(g_nccl.comm_destroy(g_groups[i].nc));
            g_groups[i] = g_groups[--g_n_groups];
            return;
        }
}

static int local_rank(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *s = getenv(vars[i]);
        if (s && *s) return atoi(s);
    }
    return 0;
}

static tera_status nccl_init(int *argc, char ***argv, tera_comm *world) {
    tera_status st = load_nccl();
    if (st != TERA_OK) return st;
    st = tera__comm_mpi.init(argc, argv, world);
    if (st != TERA_OK) return st;
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return tera_fail(TERA_ERR_CONFIG, "TERA_COMM_BACKEND = nccl: no CUDA device (%s)",
                         e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    CUDA_CHECK(cudaSetDevice(local_rank() % n));
    CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    g_up = 1;
    world->be = &tera__comm_nccl;
    attach(world);
    return TERA_OK;
}

static void nccl_finalize(void) {
    if (g_up) {
        while (g_n_groups > 0) NCCL_CHECK(g_nccl.comm_destroy(g_groups[--g_n_groups].nc));
        if (g_stage) cudaFree(g_stage);
        g_stage = NULL;
        g_stage_bytes = 0;
        cudaStreamDestroy(g_stream);
        g_up = 0;
    }
    tera__comm_mpi.finalize();
}

static int is_device(const void *p) {
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

/* The device buffer an operation on buf[0, bytes) works in: buf itself, or the staging buffer
 * holding a copy of buf[0, copy_in) */
static char *dev_buf(void *buf, size_t bytes, size_t copy_in) {
    if (is_device(buf)) return buf;
    if (bytes > g_stage_bytes) {
        if (g_stage) CUDA_CHECK(cudaFree(g_stage));
        g_stage = NULL;
        CUDA_CHECK(cudaMalloc((void **)&g_stage, bytes));
        g_stage_bytes = bytes;
    }
    if (copy_in) CUDA_CHECK(cudaMemcpyAsync(g_stage, buf, copy_in, cudaMemcpyHostToDevice, g_stream));
    return g_stage;
}

/* waits, then copies dev[off, off + bytes) back to buf when dev is the staging buffer */
static void finish(void *buf, const char *dev, size_t off, size_t bytes) {
    if (dev != buf && bytes)
        CUDA_CHECK(cudaMemcpyAsync((char *)buf + off, dev + off, bytes, cudaMemcpyDeviceToHost, g_stream));
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

static size_t dtype_size(tera_comm_dtype dt) { return dt == TERA_COMM_F32 ? 4 : 8; }
static ncclDataType_t nccl_type(tera_comm_dtype dt) {
    return dt == TERA_COMM_F32 ? ncclFloat32 : dt == TERA_COMM_F64 ? ncclFloat64 : ncclInt64;
}

static void nccl_allreduce(tera_comm *c, void *buf, int64_t n, tera_comm_dtype dt, tera_comm_redop op) {
    const size_t bytes = (size_t)n * dtype_size(dt);
    char *d = dev_buf(buf, bytes, bytes);
    NCCL_CHECK(g_nccl.all_reduce(d, d, (size_t)n, nccl_type(dt), op == TERA_COMM_MAX ? ncclMax : ncclSum, nc_of(c),
                             g_stream));
    finish(buf, d, 0, bytes);
}

static int equal_counts(const tera_comm *c, const int64_t *counts) {
    for (int r = 1; r < c->size; r++)
        if (counts[r] != counts[0]) return 0;
    return counts[0] > 0;
}

static void nccl_reduce_scatter_f32(tera_comm *c, float *buf, const int64_t *counts) {
    if (!equal_counts(c, counts)) {
        tera__comm_mpi.reduce_scatter_f32(c, buf, counts);
        return;
    }
    const size_t cnt = (size_t)counts[0], total = sizeof(float) * cnt * (size_t)c->size;
    char *d = dev_buf(buf, total, total);
    float *df = (float *)d;
    NCCL_CHECK(g_nccl.reduce_scatter(df, df + cnt * (size_t)c->rank, cnt, ncclFloat32, ncclSum, nc_of(c), g_stream));
    finish(buf, d, sizeof(float) * cnt * (size_t)c->rank, sizeof(float) * cnt);
}

static void nccl_allgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    if (!equal_counts(c, counts)) {
        tera__comm_mpi.allgather_f32(c, buf, counts);
        return;
    }
    const size_t cnt = (size_t)counts[0], total = sizeof(float) * cnt * (size_t)c->size;
    char *d = dev_buf(buf, total, 0);
    float *df = (float *)d;
    if ((char *)d != (char *)buf) /* only this rank's range is needed on the device */
        CUDA_CHECK(cudaMemcpyAsync(df + cnt * (size_t)c->rank, buf + cnt * (size_t)c->rank, sizeof(float) * cnt,
                                   cudaMemcpyHostToDevice, g_stream));
    NCCL_CHECK(g_nccl.all_gather(df + cnt * (size_t)c->rank, df, cnt, ncclFloat32, nc_of(c), g_stream));
    finish(buf, d, 0, total);
}

/* ---- delegated to the MPI backend (same group object) */
static void nccl_alltoall_i32(tera_comm *c, const int32_t *send, int32_t *recv, int n) {
    tera__comm_mpi.alltoall_i32(c, send, recv, n);
}
static void nccl_barrier(tera_comm *c) { tera__comm_mpi.barrier(c); }
static void *nccl_iallreduce_f32(tera_comm *c, float *buf, int64_t n) { return tera__comm_mpi.iallreduce_f32(c, buf, n); }
static void *nccl_iallgather_f32(tera_comm *c, float *buf, const int64_t *counts) {
    return tera__comm_mpi.iallgather_f32(c, buf, counts);
}
static void *nccl_isend_f32(tera_comm *c, const float *buf, int64_t n, int peer, int tag) {
    return tera__comm_mpi.isend_f32(c, buf, n, peer, tag);
}
static void *nccl_irecv_f32(tera_comm *c, float *buf, int64_t n, int peer, int tag) {
    return tera__comm_mpi.irecv_f32(c, buf, n, peer, tag);
}
static void nccl_wait(void *op) { tera__comm_mpi.wait(op); }
static int nccl_test(void *op) { return tera__comm_mpi.test(op); }
static void nccl_print_error(const char *msg) { tera__comm_mpi.print_error(msg); }
static void nccl_alltoallv_u8(tera_comm *c, const void *send, const int64_t *scount, void *recv,
                              const int64_t *rcount) {
    tera__comm_mpi.alltoallv_u8(c, send, scount, recv, rcount);
}
static void nccl_allgatherv_u8(tera_comm *c, void *buf, const int64_t *counts) {
    tera__comm_mpi.allgatherv_u8(c, buf, counts);
}
static int nccl_host_leader(void) { return tera__comm_mpi.host_leader(); }

static void nccl_split(tera_comm *c, int color, int key, tera_comm *g) {
    tera__comm_mpi.split(c, color, key, g);
    g->be = &tera__comm_nccl;
    attach(g);
}

static void nccl_free(tera_comm *g) {
    detach(g);
    tera__comm_mpi.free(g);
}

const struct tera_comm_backend tera__comm_nccl = {
    .name = "nccl",
    .launched = nccl_launched,
    .init = nccl_init,
    .finalize = nccl_finalize,
    .allreduce = nccl_allreduce,
    .reduce_scatter_f32 = nccl_reduce_scatter_f32,
    .allgather_f32 = nccl_allgather_f32,
    .alltoall_i32 = nccl_alltoall_i32,
    .barrier = nccl_barrier,
    .iallreduce_f32 = nccl_iallreduce_f32,
    .iallgather_f32 = nccl_iallgather_f32,
    .isend_f32 = nccl_isend_f32,
    .irecv_f32 = nccl_irecv_f32,
    .wait = nccl_wait,
    .test = nccl_test,
    .split = nccl_split,
    .free = nccl_free,
    .print_error = nccl_print_error,
    .alltoallv_u8 = nccl_alltoallv_u8,
    .allgatherv_u8 = nccl_allgatherv_u8,
    .host_leader = nccl_host_leader,
};

#else
/* built without NCCL: nothing here (an ISO C translation unit may not be empty) */
typedef int tera__comm_nccl_absent;
#endif
