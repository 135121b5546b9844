/* The CUDA backend: the table of include/tera/backend.h filled with the kernels of kernels.cu and
 * cuBLAS products (fp32: cublasSgemm with the default math mode, never TF32; bf16/fp16: the operands
 * rounded on the device to bf16 (round to nearest even, as the CPU) or fp16, then cublasGemmEx with
 * fp32 accumulation and fp32 output), device memory from cudaMalloc, one stream and one cuBLAS handle
 * per backend object.
 *
 * Host pointers: an op whose buffer is host memory (cudaPointerGetAttributes says unregistered or
 * pinned host) copies it into a staging area on the device (inputs in, outputs back out, the same
 * host pointer given twice staged once), runs, copies back and waits. That keeps every op usable
 * by today's model, whose tensors live in host memory, at PCIe speed; with device buffers the ops
 * only queue work on the stream (ce_forward waits: it returns the loss). The staging area and the
 * other internal buffers grow to the largest op seen and then stay (no allocation in a steady step).
 *
 * Initialisation (fill_normal_block, rope_tables) runs the CPU functions on the host and copies:
 * bit-identical to the CPU backend. Scheduling: experts run one after another (items_side_by_side
 * is 0); max_threads is the host's (the router and the optimizer stay on the host).
 *
 * cuBLAS is loaded with dlopen when the first backend is created, and the CUDA runtime is linked
 * statically (it loads the driver on first use): a tera that never selects cuda maps no CUDA
 * library (libcublasLt alone would add ~0.4 s and ~200 MB of resident relocations to every start). */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/status.h"
}
#include "backend_cuda.h"
#include "cuda_kernels.h"

#define CUDA_CHECK(call)                                                                                   \
    do {                                                                                                   \
        const cudaError_t _e = (call);                                                                     \
        if (_e != cudaSuccess) tera_abort_at(__FILE__, __LINE__, "%s: %s", #call, cudaGetErrorString(_e)); \
    } while (0)
#define BLAS_CHECK(call)                                                                                   \
    do {                                                                                                   \
        const cublasStatus_t _s = (call);                                                                  \
        if (_s != CUBLAS_STATUS_SUCCESS)                                                                   \
            tera_abort_at(__FILE__, __LINE__, "%s: %s", #call, g_blas.status_string(_s));                  \
    } while (0)

#define TERA_STR2(x) #x
#define TERA_STR(x) TERA_STR2(x)

/* The cuBLAS functions the backend calls, from dlopen */
static struct {
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    decltype(&cublasSetStream_v2) set_stream;
    decltype(&cublasSetMathMode) set_math_mode;
    decltype(&cublasSgemm_v2) sgemm;
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
                              const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *,
                              cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
    decltype(&cublasGetStatusString) status_string;
    int loaded;
} g_blas;

/* 1 when cuBLAS is loaded; else 0 with the reason in why */
static int load_cublas(char *why, size_t why_len) {
    if (g_blas.loaded) return 1;
    static const char *const names[] = {
        "libcublas.so." TERA_STR(CUBLAS_VER_MAJOR),
#ifdef TERA_CUDA_LIBDIR
        TERA_CUDA_LIBDIR "/libcublas.so." TERA_STR(CUBLAS_VER_MAJOR),
#endif
        "libcublas.so"};
    void *h = nullptr;
    for (const char *n : names)
        if ((h = dlopen(n, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    if (!h) {
        snprintf(why, why_len, "cannot load cuBLAS (libcublas.so.%d: %s)", CUBLAS_VER_MAJOR, dlerror());
        return 0;
    }
#define SYM(field, name)                                                                   \
    if (!(*reinterpret_cast<void **>(&g_blas.field) = dlsym(h, name))) {                  \
        snprintf(why, why_len, "cuBLAS (libcublas.so.%d) lacks %s", CUBLAS_VER_MAJOR, name); \
        return 0;                                                                          \
    }
    SYM(create, "cublasCreate_v2")
    SYM(destroy, "cublasDestroy_v2")
    SYM(set_stream, "cublasSetStream_v2")
    SYM(set_math_mode, "cublasSetMathMode")
    SYM(sgemm, "cublasSgemm_v2")
    SYM(gemm_ex, "cublasGemmEx")
    SYM(status_string, "cublasGetStatusString")
#undef SYM
    g_blas.loaded = 1;
    return 1;
}

namespace {

enum { ST_IN = 1, ST_OUT = 2, ST_INOUT = 3 };
enum { MAX_ARGS = 12, MAX_SLOTS = 4 };

struct StageArg {
    const char *host;
    size_t bytes;
    int mode;
    size_t off;
    void *slots[MAX_SLOTS]; /* the op's local pointer variables, to point at the device copy (memcpy: any T *) */
    int nslots;
};

struct CudaBackend {
    tera_backend be; /* first: a tera_backend * is a CudaBackend * */
    int device;
    char isa[300];
    cudaStream_t stream;
    cublasHandle_t blas;
    uint16_t *conv; /* low-precision operands */
    size_t conv_elems;
    int reserved;
    long long grows;
    char *stage; /* staging area for host buffers */
    size_t stage_bytes;
    long long staged;
    StageArg args[MAX_ARGS];
    int nargs;
    double *dsum;  /* ce_forward's loss sum */
    float *attn_D; /* attention backward's row dots when the caller's scratch is host memory */
    size_t attn_D_floats;
    int32_t *idx_host; /* host copy of an index array (staging sizes) */
    size_t idx_host_n;
    float *fill_host; /* host results of initialisation ops */
    size_t fill_host_n;
};

CudaBackend *cb(tera_backend *be) { return reinterpret_cast<CudaBackend *>(be); }
const CudaBackend *cb(const tera_backend *be) { return reinterpret_cast<const CudaBackend *>(be); }

bool is_device(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* The staging of one op: register its host buffers (in, out, inout), go() copies the inputs to the
 * device and points the op's locals there; the destructor copies the outputs back and waits. */
class Staging {
  public:
    explicit Staging(CudaBackend *c) : c_(c) { c_->nargs = 0; }
    ~Staging() { finish(); }
    template <class T> void in(T *&p, size_t bytes) { add(&p, p, bytes, ST_IN); }
    template <class T> void out(T *&p, size_t bytes) { add(&p, p, bytes, ST_OUT); }
    template <class T> void inout(T *&p, size_t bytes) { add(&p, p, bytes, ST_INOUT); }
    template <class T> void io(T *&p, size_t bytes, bool read) { add(&p, p, bytes, read ? ST_INOUT : ST_OUT); }
    void go();

  private:
    template <class T> void add(T **slot, const void *p, size_t bytes, int mode) {
        add_slot(const_cast<void *>(static_cast<const void *>(slot)), p, bytes, mode);
    }
    void add_slot(void *slot, const void *p, size_t bytes, int mode);
    void finish();
    CudaBackend *c_;
};

void Staging::add_slot(void *slot, const void *p, size_t bytes, int mode) {
    if (!p || bytes == 0 || is_device(p)) return;
    const char *h = static_cast<const char *>(p);
    for (int i = 0; i < c_->nargs; i++) {
        StageArg *a = &c_->args[i];
        if (a->host == h) {
            a->mode |= mode;
            if (bytes > a->bytes) a->bytes = bytes;
            TERA_ASSERT(a->nslots < MAX_SLOTS);
            a->slots[a->nslots++] = slot;
            return;
        }
        TERA_ASSERTF(h + bytes <= a->host || a->host + a->bytes <= h,
                     "CUDA backend: two host buffers of one op overlap without being the same buffer");
    }
    TERA_ASSERT(c_->nargs < MAX_ARGS);
    StageArg *a = &c_->args[c_->nargs++];
    a->host = h;
    a->bytes = bytes;
    a->mode = mode;
    a->slots[0] = slot;
    a->nslots = 1;
}

void Staging::go() {
    if (c_->nargs == 0) return;
    size_t total = 0;
    for (int i = 0; i < c_->nargs; i++) {
        c_->args[i].off = total;
        total += align256(c_->args[i].bytes);
    }
    if (total > c_->stage_bytes) {
        CUDA_CHECK(cudaStreamSynchronize(c_->stream));
        if (c_->stage) CUDA_CHECK(cudaFree(c_->stage));
        c_->stage = nullptr;
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&c_->stage), total));
        c_->stage_bytes = total;
    }
    for (int i = 0; i < c_->nargs; i++) {
        StageArg *a = &c_->args[i];
        char *dev = c_->stage + a->off;
        if (a->mode & ST_IN) CUDA_CHECK(cudaMemcpyAsync(dev, a->host, a->bytes, cudaMemcpyHostToDevice, c_->stream));
        for (int s = 0; s < a->nslots; s++) memcpy(a->slots[s], &dev, sizeof dev); /* T * and char * alike */
        c_->staged++;
    }
}

void Staging::finish() {
    if (c_->nargs == 0) return;
    for (int i = 0; i < c_->nargs; i++) {
        StageArg *a = &c_->args[i];
        if (a->mode & ST_OUT)
            CUDA_CHECK(cudaMemcpyAsync(const_cast<char *>(a->host), c_->stage + a->off, a->bytes, cudaMemcpyDeviceToHost,
                                       c_->stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(c_->stream));
    c_->nargs = 0;
}

/* Rows an index array reaches (max + 1, 0 when none is >= 0): the size of a host array it indexes. */
int64_t rows_indexed(CudaBackend *c, const int32_t *idx, int64_t n) {
    if (n <= 0) return 0;
    const int32_t *h = idx;
    if (is_device(idx)) {
        if ((size_t)n > c->idx_host_n) {
            free(c->idx_host);
            c->idx_host = static_cast<int32_t *>(tera_malloc(sizeof(int32_t) * (size_t)n));
            c->idx_host_n = (size_t)n;
        }
        CUDA_CHECK(cudaStreamSynchronize(c->stream));
        CUDA_CHECK(cudaMemcpy(c->idx_host, idx, sizeof(int32_t) * (size_t)n, cudaMemcpyDeviceToHost));
        h = c->idx_host;
    }
    int64_t mx = -1;
    for (int64_t i = 0; i < n; i++)
        if (h[i] > mx) mx = h[i];
    return mx + 1;
}

/* Bytes of a host array of D-float rows addressed by idx (0 when the array is on the device). */
size_t indexed_bytes(CudaBackend *c, const float *arr, const int32_t *idx, int64_t n, int64_t D) {
    if (!arr || is_device(arr)) return 0;
    return sizeof(float) * (size_t)(rows_indexed(c, idx, n) * D);
}

float *host_tmp(CudaBackend *c, size_t n) {
    if (n > c->fill_host_n) {
        free(c->fill_host);
        c->fill_host = static_cast<float *>(tera_malloc(sizeof(float) * n));
        c->fill_host_n = n;
    }
    return c->fill_host;
}

uint16_t *conv_get(CudaBackend *c, size_t elems) {
    if (elems > c->conv_elems) {
        CUDA_CHECK(cudaStreamSynchronize(c->stream));
        if (c->conv) CUDA_CHECK(cudaFree(c->conv));
        c->conv = nullptr;
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&c->conv), sizeof(uint16_t) * elems));
        c->conv_elems = elems;
        if (c->reserved) c->grows++;
    }
    return c->conv;
}

int dim(int64_t v) {
    TERA_ASSERTF(v >= 0 && v <= INT32_MAX, "CUDA backend: matrix dimension %lld exceeds cuBLAS's int", (long long)v);
    return (int)v;
}

/* Row-major C[M,N] = alpha op(A) op(B) + beta C is column-major C^T = op(B)^T op(A)^T. */
void sgemm(CudaBackend *c, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
           int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M == 0 || N == 0) return;
    BLAS_CHECK(g_blas.sgemm(c->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, dim(N), dim(M),
                           dim(K), &alpha, B, dim(ldb), A, dim(lda), &beta, C, dim(ldc)));
}

cudaDataType lowp_type(const CudaBackend *c) {
    return c->be.precision == TERA_PREC_FP16 ? CUDA_R_16F : CUDA_R_16BF;
}

void round_lowp(CudaBackend *c, uint16_t *dst, const float *src, int64_t n) {
    if (c->be.precision == TERA_PREC_FP16)
        tera_cuda::round_fp16(c->stream, dst, src, n);
    else
        tera_cuda::round_bf16(c->stream, dst, src, n);
}

/* C = op(A) op(B) + beta C from low-precision operands, fp32 accumulation and output. */
void gemm_lowp(CudaBackend *c, int ta, int tb, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
               const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    if (M == 0 || N == 0) return;
    const float one = 1.0f;
    const cudaDataType t = lowp_type(c);
    BLAS_CHECK(g_blas.gemm_ex(c->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, dim(N), dim(M),
                            dim(K), &one, B, t, dim(ldb), A, t, dim(lda), &beta, C, CUDA_R_32F, dim(ldc),
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

size_t fbytes(int64_t n) { return sizeof(float) * (size_t)n; }
size_t ibytes(int64_t n) { return sizeof(int32_t) * (size_t)n; }
/* Elements a strided row-major operand spans: rows of ld, the last one cols wide. */
int64_t span(int64_t rows, int64_t cols, int64_t ld) { return rows == 0 || cols == 0 ? 0 : (rows - 1) * ld + cols; }

/* ------------------------------------------------------------------ ops */
void cu_gemm(tera_backend *be, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A,
             int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    CudaBackend *c = cb(be);
    if (M == 0 || N == 0) return;
    Staging s(c);
    s.in(A, fbytes(ta ? span(K, M, lda) : span(M, K, lda)));
    s.in(B, fbytes(tb ? span(N, K, ldb) : span(K, N, ldb)));
    s.inout(C, fbytes(span(M, N, ldc))); /* inout: the gaps between rows (ldc > N) must survive */
    s.go();
    sgemm(c, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void linear_fwd(CudaBackend *c, bool fp32, float *y, const float *x, const float *w, int64_t N, int64_t in,
                int64_t out, float beta) {
    if (N == 0 || out == 0) return;
    Staging s(c);
    s.in(x, fbytes(N * in));
    s.in(w, fbytes(out * in));
    s.io(y, fbytes(N * out), beta != 0.0f);
    s.go();
    if (fp32 || c->be.precision == TERA_PREC_FP32 || in == 0) {
        sgemm(c, 0, 1, N, out, in, 1.0f, x, in, w, in, beta, y, out);
        return;
    }
    uint16_t *a = conv_get(c, (size_t)(N * in + out * in));
    round_lowp(c, a, x, N * in);
    round_lowp(c, a + N * in, w, out * in);
    gemm_lowp(c, 0, 1, N, out, in, a, in, a + N * in, in, beta, y, out);
}

void linear_bwd(CudaBackend *c, bool fp32, float *dx, float *dw, const float *dy, const float *x, const float *w,
                int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    if (in == 0 || out == 0) return; /* dx and dw are empty */
    if (N == 0) { /* dx is empty; dw += nothing, or (dw_beta 0) stored as zeros */
        if (dw && dw_beta == 0.0f && is_device(dw)) CUDA_CHECK(cudaMemsetAsync(dw, 0, fbytes(out * in), c->stream));
        else if (dw && dw_beta == 0.0f) memset(dw, 0, fbytes(out * in));
        return;
    }
    Staging s(c);
    s.in(dy, fbytes(N * out));
    if (dx) {
        s.in(w, fbytes(out * in));
        s.io(dx, fbytes(N * in), dx_beta != 0.0f);
    }
    if (dw) {
        s.in(x, fbytes(N * in));
        s.io(dw, fbytes(out * in), dw_beta != 0.0f);
    }
    s.go();
    if (fp32 || c->be.precision == TERA_PREC_FP32 || out == 0) {
        if (dx) sgemm(c, 0, 0, N, in, out, 1.0f, dy, out, w, in, dx_beta, dx, in);
        if (dw) sgemm(c, 1, 0, out, in, N, 1.0f, dy, out, x, in, dw_beta, dw, in);
        return;
    }
    /* dy is rounded once for both products */
    uint16_t *dy16 = conv_get(c, (size_t)(N * out + (dx ? out * in : 0) + (dw ? N * in : 0)));
    uint16_t *w16 = dy16 + N * out, *x16 = w16 + (dx ? out * in : 0);
    round_lowp(c, dy16, dy, N * out);
    if (dx) {
        round_lowp(c, w16, w, out * in);
        gemm_lowp(c, 0, 0, N, in, out, dy16, out, w16, in, dx_beta, dx, in);
    }
    if (dw) {
        round_lowp(c, x16, x, N * in);
        gemm_lowp(c, 1, 0, out, in, N, dy16, out, x16, in, dw_beta, dw, in);
    }
}

void cu_linear_forward(tera_backend *be, float *y, const float *x, const float *w, int64_t N, int64_t in,
                       int64_t out, float beta) {
    linear_fwd(cb(be), false, y, x, w, N, in, out, beta);
}
void cu_linear_backward(tera_backend *be, float *dx, float *dw, const float *dy, const float *x, const float *w,
                        int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    linear_bwd(cb(be), false, dx, dw, dy, x, w, N, in, out, dx_beta, dw_beta);
}
void cu_linear_forward_fp32(tera_backend *be, float *y, const float *x, const float *w, int64_t N, int64_t in,
                            int64_t out, float beta) {
    linear_fwd(cb(be), true, y, x, w, N, in, out, beta);
}
void cu_linear_backward_fp32(tera_backend *be, float *dx, float *dw, const float *dy, const float *x,
                             const float *w, int64_t N, int64_t in, int64_t out, float dx_beta, float dw_beta) {
    linear_bwd(cb(be), true, dx, dw, dy, x, w, N, in, out, dx_beta, dw_beta);
}

void cu_rmsnorm_forward(tera_backend *be, float *y, float *rstd, const float *x, const float *w, int64_t N,
                        int64_t D, float eps) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.out(y, fbytes(N * D));
    s.out(rstd, fbytes(N));
    s.in(x, fbytes(N * D));
    s.in(w, fbytes(D));
    s.go();
    tera_cuda::rmsnorm_forward(c->stream, y, rstd, x, w, N, D, eps);
}

void cu_rmsnorm_backward(tera_backend *be, float *dx, float *dw, const float *dy, const float *x, const float *w,
                         const float *rstd, int64_t N, int64_t D) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.inout(dx, fbytes(N * D));
    s.inout(dw, fbytes(D));
    s.in(dy, fbytes(N * D));
    s.in(x, fbytes(N * D));
    s.in(w, fbytes(D));
    s.in(rstd, fbytes(N));
    s.go();
    tera_cuda::rmsnorm_backward(c->stream, dx, dw, dy, x, w, rstd, N, D);
}

void cu_rope_tables(tera_backend *be, float *cos_t, float *sin_t, int T, int hd, float theta) {
    CudaBackend *c = cb(be);
    const size_t n = (size_t)T * (size_t)(hd / 2);
    if (n == 0) return;
    float *h = host_tmp(c, 2 * n);
    tera_rope_tables(h, h + n, T, hd, theta); /* the CPU's tables, bit for bit */
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    CUDA_CHECK(cudaMemcpy(cos_t, h, fbytes((int64_t)n), cudaMemcpyDefault));
    CUDA_CHECK(cudaMemcpy(sin_t, h + n, fbytes((int64_t)n), cudaMemcpyDefault));
}

void rope(tera_backend *be, float *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
          float sign) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.inout(x, fbytes((int64_t)B * T * nh * hd));
    s.in(cos_t, fbytes((int64_t)T * (hd / 2)));
    s.in(sin_t, fbytes((int64_t)T * (hd / 2)));
    s.go();
    tera_cuda::rope_apply(c->stream, x, cos_t, sin_t, B, T, nh, hd, sign);
}
void cu_rope_forward(tera_backend *be, float *x, const float *cos_t, const float *sin_t, int B, int T, int nh,
                     int hd) {
    rope(be, x, cos_t, sin_t, B, T, nh, hd, 1.0f);
}
void cu_rope_backward(tera_backend *be, float *dx, const float *cos_t, const float *sin_t, int B, int T, int nh,
                      int hd) {
    rope(be, dx, cos_t, sin_t, B, T, nh, hd, -1.0f);
}

void check_attention_shape(int B, int T, int H, int Hkv, int hd) {
    TERA_ASSERTF(B >= 0 && T >= 0 && H > 0 && Hkv > 0 && hd > 0 && H % Hkv == 0,
                 "attention: bad shape B=%d T=%d H=%d Hkv=%d hd=%d", B, T, H, Hkv, hd);
    TERA_ASSERTF(hd <= 256, "CUDA attention: head width %d exceeds 256 (docs/GPU.md)", hd);
}

size_t cu_attention_scratch_floats(tera_backend *be, int B, int T, int H, int Hkv, int hd) {
    (void)be, (void)Hkv, (void)hd;
    return (size_t)B * H * T; /* the backward's D = rowsum(dO * O) */
}

void cu_attention_forward(tera_backend *be, float *out, float *lse, const float *q, const float *k, const float *v,
                          int B, int T, int H, int Hkv, int hd, float *scratch) {
    (void)scratch;
    CudaBackend *c = cb(be);
    check_attention_shape(B, T, H, Hkv, hd);
    const int64_t nq = (int64_t)B * T * H * hd, nk = (int64_t)B * T * Hkv * hd;
    Staging s(c);
    s.out(out, fbytes(nq));
    s.out(lse, fbytes((int64_t)B * H * T));
    s.in(q, fbytes(nq));
    s.in(k, fbytes(nk));
    s.in(v, fbytes(nk));
    s.go();
    tera_cuda::attention_forward(c->stream, out, lse, q, k, v, B, T, H, Hkv, hd);
}

void cu_attention_backward(tera_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *q,
                           const float *k, const float *v, const float *out, const float *lse, int B, int T, int H,
                           int Hkv, int hd, float *scratch) {
    CudaBackend *c = cb(be);
    check_attention_shape(B, T, H, Hkv, hd);
    const int64_t nq = (int64_t)B * T * H * hd, nk = (int64_t)B * T * Hkv * hd, nr = (int64_t)B * H * T;
    float *D = scratch;
    if (!D || !is_device(D)) {
        if ((size_t)nr > c->attn_D_floats) {
            CUDA_CHECK(cudaStreamSynchronize(c->stream));
            if (c->attn_D) CUDA_CHECK(cudaFree(c->attn_D));
            c->attn_D = nullptr;
            CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&c->attn_D), fbytes(nr)));
            c->attn_D_floats = (size_t)nr;
        }
        D = c->attn_D;
    }
    Staging s(c);
    s.out(dq, fbytes(nq));
    s.out(dk, fbytes(nk));
    s.out(dv, fbytes(nk));
    s.in(dout, fbytes(nq));
    s.in(q, fbytes(nq));
    s.in(k, fbytes(nk));
    s.in(v, fbytes(nk));
    s.in(out, fbytes(nq));
    s.in(lse, fbytes(nr));
    s.go();
    tera_cuda::attention_backward(c->stream, dq, dk, dv, dout, q, k, v, out, lse, B, T, H, Hkv, hd, D);
}

void cu_swiglu_forward(tera_backend *be, float *g, const float *a1, const float *a3, int64_t n) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.out(g, fbytes(n));
    s.in(a1, fbytes(n));
    s.in(a3, fbytes(n));
    s.go();
    tera_cuda::swiglu_forward(c->stream, g, a1, a3, n);
}

void cu_swiglu_backward(tera_backend *be, float *da1, float *da3, const float *dg, const float *a1, const float *a3,
                        int64_t n) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.out(da1, fbytes(n));
    s.out(da3, fbytes(n));
    s.in(dg, fbytes(n));
    s.in(a1, fbytes(n));
    s.in(a3, fbytes(n));
    s.go();
    tera_cuda::swiglu_backward(c->stream, da1, da3, dg, a1, a3, n);
}

void emb_fwd(CudaBackend *c, float *x, const float *table, const int32_t *tokens, int64_t N, int64_t D, int64_t v0,
             int64_t Vl) {
    if (N == 0 || D == 0) return;
    size_t tbytes = 0;
    if (!is_device(table)) {
        int64_t rows = rows_indexed(c, tokens, N) - v0;
        if (rows > Vl) rows = Vl;
        tbytes = rows > 0 ? fbytes(rows * D) : 0;
    }
    Staging s(c);
    s.out(x, fbytes(N * D));
    s.in(tokens, ibytes(N));
    s.in(table, tbytes);
    s.go();
    tera_cuda::embedding_forward_range(c->stream, x, table, tokens, N, D, v0, Vl);
}

void emb_bwd(CudaBackend *c, float *dtable, const float *dx, const int32_t *tokens, int64_t N, int64_t D,
             int64_t v0, int64_t Vl) {
    if (N == 0 || D == 0) return;
    size_t tbytes = 0;
    if (!is_device(dtable)) {
        int64_t rows = rows_indexed(c, tokens, N) - v0;
        if (rows > Vl) rows = Vl;
        tbytes = rows > 0 ? fbytes(rows * D) : 0;
    }
    Staging s(c);
    s.inout(dtable, tbytes);
    s.in(dx, fbytes(N * D));
    s.in(tokens, ibytes(N));
    s.go();
    tera_cuda::embedding_backward_range(c->stream, dtable, dx, tokens, N, D, v0, Vl);
}

void cu_embedding_forward(tera_backend *be, float *x, const float *table, const int32_t *tokens, int64_t N,
                          int64_t D) {
    emb_fwd(cb(be), x, table, tokens, N, D, 0, INT64_MAX);
}
void cu_embedding_backward(tera_backend *be, float *dtable, const float *dx, const int32_t *tokens, int64_t N,
                           int64_t D) {
    emb_bwd(cb(be), dtable, dx, tokens, N, D, 0, INT64_MAX);
}
void cu_embedding_forward_range(tera_backend *be, float *x, const float *table, const int32_t *tokens, int64_t N,
                                int64_t D, int64_t v0, int64_t Vl) {
    emb_fwd(cb(be), x, table, tokens, N, D, v0, Vl);
}
void cu_embedding_backward_range(tera_backend *be, float *dtable, const float *dx, const int32_t *tokens,
                                 int64_t N, int64_t D, int64_t v0, int64_t Vl) {
    emb_bwd(cb(be), dtable, dx, tokens, N, D, v0, Vl);
}

void cu_ce_slice_max(tera_backend *be, float *rowmax, const float *logits, int64_t N, int64_t Vl) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.out(rowmax, fbytes(N));
    s.in(logits, fbytes(N * Vl));
    s.go();
    tera_cuda::ce_slice_max(c->stream, rowmax, logits, N, Vl);
}

void cu_ce_slice_sums(tera_backend *be, float *sumexp, float *tlogit, float *e, const float *logits,
                      const float *rowmax, const int32_t *targets, int64_t N, int64_t Vl, int64_t v0) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.out(sumexp, fbytes(N));
    s.out(tlogit, fbytes(N));
    s.in(logits, fbytes(N * Vl));
    s.out(e, fbytes(N * Vl)); /* NULL: not staged; may be logits: staged once, in and out */
    s.in(rowmax, fbytes(N));
    s.in(targets, ibytes(N));
    s.go();
    tera_cuda::ce_slice_sums(c->stream, sumexp, tlogit, e, logits, rowmax, targets, N, Vl, v0);
}

void cu_ce_backward_range(tera_backend *be, float *dlogits, const float *e, const float *sumexp,
                          const int32_t *targets, int64_t N, int64_t Vl, int64_t v0, float scale) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.in(e, fbytes(N * Vl));
    s.out(dlogits, fbytes(N * Vl)); /* may be e: staged once, in and out */
    s.in(sumexp, fbytes(N));
    s.in(targets, ibytes(N));
    s.go();
    tera_cuda::ce_backward_range(c->stream, dlogits, e, sumexp, targets, N, Vl, v0, scale);
}

double cu_ce_forward(tera_backend *be, float *lse, const float *logits, const int32_t *targets, int64_t N,
                     int64_t V) {
    CudaBackend *c = cb(be);
    double sum = 0.0;
    {
        Staging s(c);
        s.out(lse, fbytes(N));
        s.in(logits, fbytes(N * V));
        s.in(targets, ibytes(N));
        s.go();
        tera_cuda::ce_forward(c->stream, lse, c->dsum, logits, targets, N, V);
        CUDA_CHECK(cudaMemcpyAsync(&sum, c->dsum, sizeof sum, cudaMemcpyDeviceToHost, c->stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return sum;
}

void cu_ce_backward(tera_backend *be, float *dlogits, const float *logits, const int32_t *targets, int64_t N,
                    int64_t V, float scale) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.in(logits, fbytes(N * V));
    s.out(dlogits, fbytes(N * V)); /* may be logits: staged once, in and out */
    s.in(targets, ibytes(N));
    s.go();
    tera_cuda::ce_backward(c->stream, dlogits, logits, targets, N, V, scale);
}

void cu_softmax_forward(tera_backend *be, float *probs, float *lse, const float *logits, int64_t N, int64_t E) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.out(probs, fbytes(N * E));
    s.out(lse, fbytes(N));
    s.in(logits, fbytes(N * E));
    s.go();
    tera_cuda::softmax_forward(c->stream, probs, lse, logits, N, E);
}

void cu_softmax_backward(tera_backend *be, float *dlogits, const float *dprobs, const float *probs, int64_t N,
                         int64_t E) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.in(dprobs, fbytes(N * E));
    s.in(probs, fbytes(N * E));
    s.out(dlogits, fbytes(N * E));
    s.go();
    tera_cuda::softmax_backward(c->stream, dlogits, dprobs, probs, N, E);
}

void cu_moe_gather_forward(tera_backend *be, float *xg, const float *x, const int32_t *row_tok, int64_t R,
                           int64_t D) {
    CudaBackend *c = cb(be);
    if (R == 0 || D == 0) return;
    const size_t xbytes = indexed_bytes(c, x, row_tok, R, D);
    Staging s(c);
    s.out(xg, fbytes(R * D));
    s.in(row_tok, ibytes(R));
    s.in(x, xbytes);
    s.go();
    tera_cuda::moe_gather_forward(c->stream, xg, x, row_tok, R, D);
}

void cu_moe_gather_backward(tera_backend *be, float *dx, const float *dxg, const int32_t *slot_row, int64_t N, int k,
                            int64_t D) {
    CudaBackend *c = cb(be);
    if (N == 0 || D == 0) return;
    const size_t gbytes = indexed_bytes(c, dxg, slot_row, N * k, D);
    Staging s(c);
    s.inout(dx, fbytes(N * D));
    s.in(slot_row, ibytes(N * k));
    s.in(dxg, gbytes);
    s.go();
    tera_cuda::moe_gather_backward(c->stream, dx, dxg, slot_row, N, k, D);
}

void cu_moe_combine_forward(tera_backend *be, float *out, const float *ye, const float *topw,
                            const int32_t *slot_row, int64_t N, int k, int64_t D) {
    CudaBackend *c = cb(be);
    if (N == 0 || D == 0) return;
    const size_t ybytes = indexed_bytes(c, ye, slot_row, N * k, D);
    Staging s(c);
    s.inout(out, fbytes(N * D));
    s.in(topw, fbytes(N * k));
    s.in(slot_row, ibytes(N * k));
    s.in(ye, ybytes);
    s.go();
    tera_cuda::moe_combine_forward(c->stream, out, ye, topw, slot_row, N, k, D);
}

void cu_moe_combine_backward(tera_backend *be, float *dye, float *dtopw, const float *dy, const float *ye,
                             const float *topw, const int32_t *slot_row, int64_t N, int k, int64_t D) {
    CudaBackend *c = cb(be);
    if (N == 0 || k == 0) return;
    const size_t ybytes = indexed_bytes(c, ye, slot_row, N * k, D);
    const size_t dybytes = indexed_bytes(c, dye, slot_row, N * k, D);
    Staging s(c);
    s.inout(dye, dybytes); /* rows no kept assignment names keep their values */
    s.out(dtopw, fbytes(N * k));
    s.in(dy, fbytes(N * D));
    s.in(ye, ybytes);
    s.in(topw, fbytes(N * k));
    s.in(slot_row, ibytes(N * k));
    s.go();
    tera_cuda::moe_combine_backward(c->stream, dye, dtopw, dy, ye, topw, slot_row, N, k, D);
}

void cu_add_forward(tera_backend *be, float *y, const float *x, int64_t n) {
    CudaBackend *c = cb(be);
    Staging s(c);
    s.inout(y, fbytes(n));
    s.in(x, fbytes(n));
    s.go();
    tera_cuda::add_forward(c->stream, y, x, n);
}

void cu_fill_normal_block(tera_backend *be, float *w, int64_t numel, const int64_t *shape, const int64_t *lo,
                          const int64_t *len, float std, uint64_t seed, uint64_t stream) {
    CudaBackend *c = cb(be);
    if (numel <= 0) return;
    if (!is_device(w)) {
        tera_fill_normal_block(w, numel, shape, lo, len, std, seed, stream);
        return;
    }
    float *h = host_tmp(c, (size_t)numel);
    tera_fill_normal_block(h, numel, shape, lo, len, std, seed, stream); /* the CPU's values, bit for bit */
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    CUDA_CHECK(cudaMemcpy(w, h, fbytes(numel), cudaMemcpyHostToDevice));
}

int cu_max_threads(tera_backend *be) {
    (void)be;
    return tera_max_threads(); /* the host code's threads (router, optimizer) */
}
int cu_items_side_by_side(tera_backend *be, int n) {
    (void)be, (void)n;
    return 0;
}
void cu_for_each_item(tera_backend *be, int n, void (*fn)(void *ctx, int i), void *ctx) {
    (void)be;
    for (int i = 0; i < n; i++) fn(ctx, i);
}

void cu_for_ranges(tera_backend *be, int64_t n, void (*fn)(void *ctx, int64_t lo, int64_t hi, int worker), void *ctx) {
    (void)be;
    tera_for_ranges(n, fn, ctx); /* host loops (the router) stay on the host's threads */
}

void *cu_alloc(tera_backend *be, size_t bytes) {
    (void)be;
    void *p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}
void cu_free(tera_backend *be, void *p) {
    CudaBackend *c = cb(be);
    if (!p) return;
    CUDA_CHECK(cudaStreamSynchronize(c->stream));
    CUDA_CHECK(cudaFree(p));
}

int cu_bf16_fast(const tera_backend *be, const char **isa_name) {
    if (isa_name) *isa_name = cb(be)->isa;
    return 1;
}
int cu_bf16_native(const tera_backend *be) {
    (void)be;
    return 1;
}
int cu_bf16_has_dot(const tera_backend *be) {
    (void)be;
    return 1;
}
int cu_bf16_probe(const tera_backend *be, double *fma_macs, double *dot_macs) {
    (void)be;
    if (fma_macs) *fma_macs = 0.0;
    if (dot_macs) *dot_macs = 0.0;
    return 0; /* no CPU instruction to probe: bf16 products run on the tensor cores */
}

void cu_set_precision(tera_backend *be, tera_precision p, tera_bf16_gemm g) {
    be->precision = p;
    be->bf16_gemm = g;
}
void cu_reserve(tera_backend *be, int64_t main_elems, int64_t thread_elems) {
    CudaBackend *c = cb(be);
    /* one buffer: the work items (experts) run one after another here, each product on it */
    const int64_t n = main_elems > thread_elems ? main_elems : thread_elems;
    if (n > 0) conv_get(c, (size_t)n);
    c->reserved = 1;
}
int64_t cu_scratch_grows(const tera_backend *be) { return cb(be)->grows; }

void cu_destroy(tera_backend *be) {
    CudaBackend *c = cb(be);
    cudaStreamSynchronize(c->stream);
    cudaFree(c->conv);
    cudaFree(c->stage);
    cudaFree(c->dsum);
    cudaFree(c->attn_D);
    free(c->idx_host);
    free(c->fill_host);
    g_blas.destroy(c->blas);
    cudaStreamDestroy(c->stream);
    free(c);
}

int local_rank(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                                       "LOCAL_RANK"};
    for (const char *v : vars) {
        const char *s = getenv(v);
        if (s && *s) return atoi(s);
    }
    return 0;
}

} // namespace

extern "C" int tera_cuda_device_count(char *why, size_t why_len) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (why) snprintf(why, why_len, "no usable CUDA device (%s)", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return 0;
    }
    if (n == 0 && why) snprintf(why, why_len, "no CUDA device found");
    return n;
}

extern "C" void tera_cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
}

extern "C" void tera_cuda_sync(tera_backend *be) { CUDA_CHECK(cudaStreamSynchronize(cb(be)->stream)); }

extern "C" void tera_cuda_staging_stats(const tera_backend *be, long long *staged_args, size_t *stage_bytes) {
    if (staged_args) *staged_args = cb(be)->staged;
    if (stage_bytes) *stage_bytes = cb(be)->stage_bytes;
}

extern "C" tera_backend *tera_backend_cuda_create(int threads, char *why, size_t why_len) {
    const int n = tera_cuda_device_count(why, why_len);
    if (n <= 0) return nullptr;
    const int dev = local_rank() % n;
    cudaError_t e = cudaSetDevice(dev);
    cudaDeviceProp prop;
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, dev);
    if (e != cudaSuccess) {
        snprintf(why, why_len, "CUDA device %d of %d unusable (%s)", dev, n, cudaGetErrorString(e));
        (void)cudaGetLastError();
        return nullptr;
    }
    CudaBackend *c = static_cast<CudaBackend *>(tera_calloc(1, sizeof *c));
    c->device = dev;
    snprintf(c->isa, sizeof c->isa, "cuda sm_%d%d %s", prop.major, prop.minor, prop.name);
    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaMalloc(reinterpret_cast<void **>(&c->dsum), sizeof(double))) != cudaSuccess) {
        snprintf(why, why_len, "CUDA device %d (%s): %s", dev, prop.name, cudaGetErrorString(e));
        (void)cudaGetLastError();
        free(c);
        return nullptr;
    }
    const cublasStatus_t bs = load_cublas(why, why_len) ? g_blas.create(&c->blas) : CUBLAS_STATUS_NOT_INITIALIZED;
    if (bs != CUBLAS_STATUS_SUCCESS) {
        if (g_blas.loaded)
            snprintf(why, why_len, "cuBLAS on device %d (%s): %s", dev, prop.name, g_blas.status_string(bs));
        cudaFree(c->dsum);
        cudaStreamDestroy(c->stream);
        free(c);
        return nullptr;
    }
    BLAS_CHECK(g_blas.set_stream(c->blas, c->stream));
    BLAS_CHECK(g_blas.set_math_mode(c->blas, CUBLAS_DEFAULT_MATH)); /* fp32 products stay fp32 (no TF32) */
    if (threads >= 0) tera_set_threads(threads);

    tera_backend *be = &c->be;
    be->name = "cuda";
    tera_backend_ops *o = &be->ops;
    o->gemm = cu_gemm;
    o->linear_forward = cu_linear_forward;
    o->linear_backward = cu_linear_backward;
    o->linear_forward_fp32 = cu_linear_forward_fp32;
    o->linear_backward_fp32 = cu_linear_backward_fp32;
    o->rmsnorm_forward = cu_rmsnorm_forward;
    o->rmsnorm_backward = cu_rmsnorm_backward;
    o->rope_tables = cu_rope_tables;
    o->rope_forward = cu_rope_forward;
    o->rope_backward = cu_rope_backward;
    o->attention_scratch_floats = cu_attention_scratch_floats;
    o->attention_forward = cu_attention_forward;
    o->attention_backward = cu_attention_backward;
    o->swiglu_forward = cu_swiglu_forward;
    o->swiglu_backward = cu_swiglu_backward;
    o->embedding_forward = cu_embedding_forward;
    o->embedding_backward = cu_embedding_backward;
    o->embedding_forward_range = cu_embedding_forward_range;
    o->embedding_backward_range = cu_embedding_backward_range;
    o->ce_slice_max = cu_ce_slice_max;
    o->ce_slice_sums = cu_ce_slice_sums;
    o->ce_backward_range = cu_ce_backward_range;
    o->ce_forward = cu_ce_forward;
    o->ce_backward = cu_ce_backward;
    o->softmax_forward = cu_softmax_forward;
    o->softmax_backward = cu_softmax_backward;
    o->moe_gather_forward = cu_moe_gather_forward;
    o->moe_gather_backward = cu_moe_gather_backward;
    o->moe_combine_forward = cu_moe_combine_forward;
    o->moe_combine_backward = cu_moe_combine_backward;
    o->add_forward = cu_add_forward;
    o->fill_normal_block = cu_fill_normal_block;
    o->max_threads = cu_max_threads;
    o->items_side_by_side = cu_items_side_by_side;
    o->for_each_item = cu_for_each_item;
    o->for_ranges = cu_for_ranges;
    be->mem.alloc = cu_alloc;
    be->mem.free = cu_free;
    be->caps.bf16_fast = cu_bf16_fast;
    be->caps.bf16_native = cu_bf16_native;
    be->caps.bf16_has_dot = cu_bf16_has_dot;
    be->caps.bf16_probe = cu_bf16_probe;
    be->ctl.set_precision = cu_set_precision;
    be->ctl.reserve = cu_reserve;
    be->ctl.scratch_grows = cu_scratch_grows;
    be->ctl.destroy = cu_destroy;
    be->threads = tera_get_threads();
    be->impl = c;
    cu_set_precision(be, TERA_PREC_FP32, TERA_BF16_NATIVE);
    return be;
}
