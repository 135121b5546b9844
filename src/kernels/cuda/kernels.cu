/* The CUDA backend's kernels: straightforward, correct, deterministic (no atomics: every output
 * element is written by one thread, and every sum runs in an order fixed by the shapes alone).
 *
 * Naive by design (docs/GPU.md lists what a fast version changes):
 *  - attention is one warp per query row (forward, dQ) or per key row (dK/dV), visiting keys one at
 *    a time with an online softmax: O(T^2 hd) work without tiling through shared memory or tensor
 *    cores; the head width is at most 256 (8 values per lane);
 *  - parameter-gradient column sums (RMSNorm's dw, the embedding's dtable) are one thread per
 *    column looping over the rows in order (bit-identical to the CPU's order, little parallelism);
 *  - row reductions are one block of 256 threads per row. */
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "cuda_kernels.h"

extern "C" {
#include "tera/status.h"
}

namespace tera_cuda {

static void check_launch(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) tera_abort_at(__FILE__, __LINE__, "CUDA kernel %s: %s", what, cudaGetErrorString(e));
}

#define ROW_THREADS 256
#define WARPS_PER_BLOCK 4
#define ATT_NP 8 /* values per lane: head width <= 256 */

static unsigned grid_for(int64_t n, int block) {
    int64_t g = (n + block - 1) / block;
    if (g > 65535LL * 1024) g = 65535LL * 1024; /* the kernels loop (grid stride) past this */
    return (unsigned)(g < 1 ? 1 : g);
}
static unsigned warp_grid(int64_t rows) { return grid_for(rows, WARPS_PER_BLOCK); }

#define GRID_STRIDE(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* The block's sum (or max) of v, returned to every thread; sh: 32 floats of shared memory. */
template <bool MAX> __device__ float block_reduce(float v, float *sh) {
    v = MAX ? warp_max(v) : warp_sum(v);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads(); /* sh may still be read by a previous reduction */
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float x = lane < nw ? sh[lane] : (MAX ? -INFINITY : 0.0f);
        x = MAX ? warp_max(x) : warp_sum(x);
        if (lane == 0) sh[0] = x;
    }
    __syncthreads();
    return sh[0];
}

/* ------------------------------------------------------------------ roundings */
__global__ void k_round_bf16(uint16_t *d, const float *s, int64_t n) {
    GRID_STRIDE(i, n) {
        uint32_t u = __float_as_uint(s[i]);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            d[i] = (uint16_t)((u >> 16) | 0x40);
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);
            d[i] = (uint16_t)(u >> 16);
        }
    }
}
__global__ void k_round_fp16(uint16_t *d, const float *s, int64_t n) {
    GRID_STRIDE(i, n) d[i] = __half_as_ushort(__float2half_rn(s[i]));
}
void round_bf16(cudaStream_t s, uint16_t *dst, const float *src, int64_t n) {
    if (n <= 0) return;
    k_round_bf16<<<grid_for(n, 256), 256, 0, s>>>(dst, src, n);
    check_launch("round_bf16");
}
void round_fp16(cudaStream_t s, uint16_t *dst, const float *src, int64_t n) {
    if (n <= 0) return;
    k_round_fp16<<<grid_for(n, 256), 256, 0, s>>>(dst, src, n);
    check_launch("round_fp16");
}

/* ------------------------------------------------------------------ RMSNorm */
__global__ void k_rmsnorm_fwd(float *y, float *rstd, const float *x, const float *w, int64_t D, float eps) {
    __shared__ float sh[32];
    const int64_t n = blockIdx.x;
    const float *xr = x + n * D;
    float ss = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) ss += xr[d] * xr[d];
    ss = block_reduce<false>(ss, sh);
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    if (threadIdx.x == 0) rstd[n] = r;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) y[n * D + d] = w[d] * (xr[d] * r);
}
__global__ void k_rmsnorm_bwd_dx(float *dx, const float *dy, const float *x, const float *w, const float *rstd,
                                 int64_t D) {
    __shared__ float sh[32];
    const int64_t n = blockIdx.x;
    const float *xr = x + n * D, *dyr = dy + n * D;
    const float r = rstd[n];
    float dot = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dot += dyr[d] * w[d] * xr[d];
    dot = block_reduce<false>(dot, sh);
    const float c = dot * r * r / (float)D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dx[n * D + d] += r * (dyr[d] * w[d] - xr[d] * c);
}
__global__ void k_rmsnorm_bwd_dw(float *dw, const float *dy, const float *x, const float *rstd, int64_t N,
                                 int64_t D) {
    GRID_STRIDE(d, D) {
        float acc = 0.0f;
        for (int64_t n = 0; n < N; n++) acc += dy[n * D + d] * x[n * D + d] * rstd[n];
        dw[d] += acc;
    }
}
void rmsnorm_forward(cudaStream_t s, float *y, float *rstd, const float *x, const float *w, int64_t N, int64_t D,
                     float eps) {
    if (N <= 0 || D <= 0) return;
    k_rmsnorm_fwd<<<(unsigned)N, ROW_THREADS, 0, s>>>(y, rstd, x, w, D, eps);
    check_launch("rmsnorm_forward");
}
void rmsnorm_backward(cudaStream_t s, float *dx, float *dw, const float *dy, const float *x, const float *w,
                      const float *rstd, int64_t N, int64_t D) {
    if (N <= 0 || D <= 0) return;
    k_rmsnorm_bwd_dx<<<(unsigned)N, ROW_THREADS, 0, s>>>(dx, dy, x, w, rstd, D);
    check_launch("rmsnorm_backward dx");
    k_rmsnorm_bwd_dw<<<grid_for(D, 128), 128, 0, s>>>(dw, dy, x, rstd, N, D);
    check_launch("rmsnorm_backward dw");
}

/* ------------------------------------------------------------------ RoPE */
__global__ void k_rope(float *x, const float *cos_t, const float *sin_t, int T, int nh, int hd, float sign,
                       int64_t total) {
    const int half = hd / 2;
    GRID_STRIDE(i, total) {
        const int j = (int)(i % half);
        const int64_t rest = i / half;
        const int h = (int)(rest % nh);
        const int64_t bt = rest / nh;
        const int t = (int)(bt % T);
        float *v = x + (bt * nh + h) * hd;
        const float c = cos_t[(int64_t)t * half + j], sj = sign * sin_t[(int64_t)t * half + j];
        const float x1 = v[j], x2 = v[j + half];
        v[j] = x1 * c - x2 * sj;
        v[j + half] = x2 * c + x1 * sj;
    }
}
void rope_apply(cudaStream_t s, float *x, const float *cos_t, const float *sin_t, int B, int T, int nh, int hd,
                float sign) {
    const int64_t total = (int64_t)B * T * nh * (hd / 2);
    if (total <= 0) return;
    k_rope<<<grid_for(total, 256), 256, 0, s>>>(x, cos_t, sin_t, T, nh, hd, sign, total);
    check_launch("rope");
}

/* ------------------------------------------------------------------ attention */
/* One warp per query row (b, h, t), rows ordered [B, H, T] like lse. */
__global__ void k_attn_fwd(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                           int H, int Hkv, int hd, float scale) {
    const int64_t row = (int64_t)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (int64_t)B * H * T) return;
    const int t = (int)(row % T), h = (int)(row / T % H), b = (int)(row / T / H);
    const int g = h / (H / Hkv);
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const float *qr = q + ((int64_t)b * T + t) * ldq + (int64_t)h * hd;
    float qv[ATT_NP], acc[ATT_NP];
#pragma unroll
    for (int i = 0; i < ATT_NP; i++) {
        const int d = lane + 32 * i;
        qv[i] = d < hd ? qr[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int s = 0; s <= t; s++) {
        const float *kr = k + ((int64_t)b * T + s) * ldk + (int64_t)g * hd;
        const float *vr = v + ((int64_t)b * T + s) * ldk + (int64_t)g * hd;
        float p = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_NP; i++) {
            const int d = lane + 32 * i;
            if (d < hd) p += qv[i] * kr[d];
        }
        p = scale * warp_sum(p);
        const float mn = fmaxf(m, p);
        const float alpha = expf(m - mn), e = expf(p - mn);
        l = l * alpha + e;
#pragma unroll
        for (int i = 0; i < ATT_NP; i++) {
            const int d = lane + 32 * i;
            if (d < hd) acc[i] = acc[i] * alpha + e * vr[d];
        }
        m = mn;
    }
    float *orow = out + ((int64_t)b * T + t) * ldq + (int64_t)h * hd;
    const float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < ATT_NP; i++) {
        const int d = lane + 32 * i;
        if (d < hd) orow[d] = acc[i] * inv;
    }
    if (lane == 0) lse[row] = m + logf(l);
}

/* Dsum[b,h,t] = sum_d dO * O (double accumulation) */
__global__ void k_attn_rowdot(float *Dsum, const float *dout, const float *out, int B, int T, int H, int hd) {
    const int64_t row = (int64_t)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (int64_t)B * H * T) return;
    const int t = (int)(row % T), h = (int)(row / T % H), b = (int)(row / T / H);
    const int64_t off = ((int64_t)b * T + t) * H * hd + (int64_t)h * hd;
    double s = 0.0;
    for (int d = lane; d < hd; d += 32) s += (double)out[off + d] * dout[off + d];
    s = warp_sum_d(s);
    if (lane == 0) Dsum[row] = (float)s;
}

/* dQ: one warp per query row. */
__global__ void k_attn_bwd_dq(float *dq, const float *dout, const float *q, const float *k, const float *v,
                              const float *lse, const float *Dsum, int B, int T, int H, int Hkv, int hd,
                              float scale) {
    const int64_t row = (int64_t)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (int64_t)B * H * T) return;
    const int t = (int)(row % T), h = (int)(row / T % H), b = (int)(row / T / H);
    const int g = h / (H / Hkv);
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int64_t qoff = ((int64_t)b * T + t) * ldq + (int64_t)h * hd;
    float qv[ATT_NP], dov[ATT_NP], acc[ATT_NP];
#pragma unroll
    for (int i = 0; i < ATT_NP; i++) {
        const int d = lane + 32 * i;
        qv[i] = d < hd ? q[qoff + d] : 0.0f;
        dov[i] = d < hd ? dout[qoff + d] : 0.0f;
        acc[i] = 0.0f;
    }
    const float L = lse[row], Dr = Dsum[row];
    for (int s = 0; s <= t; s++) {
        const float *kr = k + ((int64_t)b * T + s) * ldk + (int64_t)g * hd;
        const float *vr = v + ((int64_t)b * T + s) * ldk + (int64_t)g * hd;
        float sc = 0.0f, dp = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_NP; i++) {
            const int d = lane + 32 * i;
            if (d < hd) {
                sc += qv[i] * kr[d];
                dp += dov[i] * vr[d];
            }
        }
        sc = scale * warp_sum(sc);
        dp = warp_sum(dp);
        const float p = expf(sc - L);
        const float ds = p * (dp - Dr);
#pragma unroll
        for (int i = 0; i < ATT_NP; i++) {
            const int d = lane + 32 * i;
            if (d < hd) acc[i] += ds * kr[d];
        }
    }
#pragma unroll
    for (int i = 0; i < ATT_NP; i++) {
        const int d = lane + 32 * i;
        if (d < hd) dq[qoff + d] = scale * acc[i];
    }
}

/* dK, dV: one warp per key row (b, kv head g, s), rows ordered [B, Hkv, T]; the sums run over the
 * group's query heads, then the query rows t >= s, in order. */
__global__ void k_attn_bwd_dkv(float *dk, float *dv, const float *dout, const float *q, const float *k,
                               const float *v, const float *lse, const float *Dsum, int B, int T, int H, int Hkv,
                               int hd, float scale) {
    const int64_t row = (int64_t)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (int64_t)B * Hkv * T) return;
    const int s = (int)(row % T), g = (int)(row / T % Hkv), b = (int)(row / T / Hkv);
    const int rep = H / Hkv;
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int64_t koff = ((int64_t)b * T + s) * ldk + (int64_t)g * hd;
    float kv[ATT_NP], vv[ATT_NP], dka[ATT_NP], dva[ATT_NP];
#pragma unroll
    for (int i = 0; i < ATT_NP; i++) {
        const int d = lane + 32 * i;
        kv[i] = d < hd ? k[koff + d] : 0.0f;
        vv[i] = d < hd ? v[koff + d] : 0.0f;
        dka[i] = dva[i] = 0.0f;
    }
    for (int hh = 0; hh < rep; hh++) {
        const int h = g * rep + hh;
        const float *lse_h = lse + ((int64_t)b * H + h) * T, *D_h = Dsum + ((int64_t)b * H + h) * T;
        for (int t = s; t < T; t++) {
            const int64_t qoff = ((int64_t)b * T + t) * ldq + (int64_t)h * hd;
            float sc = 0.0f, dp = 0.0f;
#pragma unroll
            for (int i = 0; i < ATT_NP; i++) {
                const int d = lane + 32 * i;
                if (d < hd) {
                    sc += q[qoff + d] * kv[i];
                    dp += dout[qoff + d] * vv[i];
                }
            }
            sc = scale * warp_sum(sc);
            dp = warp_sum(dp);
            const float p = expf(sc - lse_h[t]);
            const float ds = p * (dp - D_h[t]);
#pragma unroll
            for (int i = 0; i < ATT_NP; i++) {
                const int d = lane + 32 * i;
                if (d < hd) {
                    dva[i] += p * dout[qoff + d];
                    dka[i] += ds * q[qoff + d];
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ATT_NP; i++) {
        const int d = lane + 32 * i;
        if (d < hd) {
            dk[koff + d] = scale * dka[i];
            dv[koff + d] = dva[i];
        }
    }
}

void attention_forward(cudaStream_t s, float *out, float *lse, const float *q, const float *k, const float *v,
                       int B, int T, int H, int Hkv, int hd) {
    const int64_t rows = (int64_t)B * H * T;
    if (rows <= 0) return;
    k_attn_fwd<<<warp_grid(rows), 32 * WARPS_PER_BLOCK, 0, s>>>(out, lse, q, k, v, B, T, H, Hkv, hd,
                                                                  1.0f / sqrtf((float)hd));
    check_launch("attention_forward");
}
void attention_backward(cudaStream_t s, float *dq, float *dk, float *dv, const float *dout, const float *q,
                        const float *k, const float *v, const float *out, const float *lse, int B, int T, int H,
                        int Hkv, int hd, float *scratch) {
    const int64_t rows = (int64_t)B * H * T, krows = (int64_t)B * Hkv * T;
    if (rows <= 0) return;
    const float scale = 1.0f / sqrtf((float)hd);
    k_attn_rowdot<<<warp_grid(rows), 32 * WARPS_PER_BLOCK, 0, s>>>(scratch, dout, out, B, T, H, hd);
    check_launch("attention_backward D");
    k_attn_bwd_dq<<<warp_grid(rows), 32 * WARPS_PER_BLOCK, 0, s>>>(dq, dout, q, k, v, lse, scratch, B, T, H, Hkv,
                                                                     hd, scale);
    check_launch("attention_backward dq");
    k_attn_bwd_dkv<<<warp_grid(krows), 32 * WARPS_PER_BLOCK, 0, s>>>(dk, dv, dout, q, k, v, lse, scratch, B, T, H,
                                                                       Hkv, hd, scale);
    check_launch("attention_backward dk dv");
}

/* ------------------------------------------------------------------ SwiGLU */
__global__ void k_swiglu_fwd(float *g, const float *a1, const float *a3, int64_t n) {
    GRID_STRIDE(i, n) g[i] = a1[i] / (1.0f + expf(-a1[i])) * a3[i];
}
__global__ void k_swiglu_bwd(float *da1, float *da3, const float *dg, const float *a1, const float *a3,
                             int64_t n) {
    GRID_STRIDE(i, n) {
        const float sg = 1.0f / (1.0f + expf(-a1[i]));
        const float silu = a1[i] * sg;
        da3[i] = dg[i] * silu;
        da1[i] = dg[i] * a3[i] * sg * (1.0f + a1[i] * (1.0f - sg));
    }
}
void swiglu_forward(cudaStream_t s, float *g, const float *a1, const float *a3, int64_t n) {
    if (n <= 0) return;
    k_swiglu_fwd<<<grid_for(n, 256), 256, 0, s>>>(g, a1, a3, n);
    check_launch("swiglu_forward");
}
void swiglu_backward(cudaStream_t s, float *da1, float *da3, const float *dg, const float *a1, const float *a3,
                     int64_t n) {
    if (n <= 0) return;
    k_swiglu_bwd<<<grid_for(n, 256), 256, 0, s>>>(da1, da3, dg, a1, a3, n);
    check_launch("swiglu_backward");
}

/* ------------------------------------------------------------------ embedding */
__global__ void k_emb_fwd(float *x, const float *table, const int32_t *tokens, int64_t N, int64_t D, int64_t v0,
                          int64_t Vl) {
    GRID_STRIDE(i, N * D) {
        const int64_t n = i / D, d = i % D;
        const int64_t r = (int64_t)tokens[n] - v0;
        x[i] = r >= 0 && r < Vl ? table[r * D + d] : 0.0f;
    }
}
__global__ void k_emb_bwd(float *dtable, const float *dx, const int32_t *tokens, int64_t N, int64_t D, int64_t v0,
                          int64_t Vl) {
    GRID_STRIDE(d, D) {
        for (int64_t n = 0; n < N; n++) {
            const int64_t r = (int64_t)tokens[n] - v0;
            if (r >= 0 && r < Vl) dtable[r * D + d] += dx[n * D + d];
        }
    }
}
void embedding_forward_range(cudaStream_t s, float *x, const float *table, const int32_t *tokens, int64_t N,
                             int64_t D, int64_t v0, int64_t Vl) {
    if (N <= 0 || D <= 0) return;
    k_emb_fwd<<<grid_for(N * D, 256), 256, 0, s>>>(x, table, tokens, N, D, v0, Vl);
    check_launch("embedding_forward");
}
void embedding_backward_range(cudaStream_t s, float *dtable, const float *dx, const int32_t *tokens, int64_t N,
                              int64_t D, int64_t v0, int64_t Vl) {
    if (N <= 0 || D <= 0) return;
    k_emb_bwd<<<grid_for(D, 64), 64, 0, s>>>(dtable, dx, tokens, N, D, v0, Vl);
    check_launch("embedding_backward");
}

/* ------------------------------------------------------------------ softmax / cross-entropy */
__global__ void k_row_max(float *rowmax, const float *logits, int64_t V) {
    __shared__ float sh[32];
    const float *r = logits + (int64_t)blockIdx.x * V;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, r[c]);
    m = block_reduce<true>(m, sh);
    if (threadIdx.x == 0) rowmax[blockIdx.x] = m;
}
/* the slice's sum of exponentials, its target logit, and (e != NULL) the exponentials themselves
 * (e may be logits: the target logit is read before any is written) */
__global__ void k_ce_sums(float *sumexp, float *tlogit, float *e, const float *logits, const float *rowmax,
                          const int32_t *targets, int64_t Vl, int64_t v0) {
    __shared__ float sh[32];
    const int64_t n = blockIdx.x;
    const float *r = logits + n * Vl;
    const float mx = rowmax[n];
    const int64_t t = (int64_t)targets[n] - v0;
    if (threadIdx.x == 0) tlogit[n] = t >= 0 && t < Vl ? r[t] : 0.0f;
    __syncthreads();
    float se = 0.0f;
    for (int64_t c = threadIdx.x; c < Vl; c += blockDim.x) {
        const float x = expf(r[c] - mx);
        se += x;
        if (e) e[n * Vl + c] = x;
    }
    se = block_reduce<false>(se, sh);
    if (threadIdx.x == 0) sumexp[n] = se;
}
/* dlogits = e * (scale / sumexp) - scale * onehot (may be e): no exponential; the product rounded
 * (no FMA with the subtraction), as k_ce_row_bwd */
__global__ void k_ce_bwd(float *dlogits, const float *e, const float *sumexp, const int32_t *targets, int64_t N,
                         int64_t Vl, int64_t v0, float scale) {
    GRID_STRIDE(i, N * Vl) {
        const int64_t n = i / Vl, c = i % Vl;
        float d = __fmul_rn(e[i], scale / sumexp[n]);
        if ((int64_t)targets[n] - v0 == c) d -= scale;
        dlogits[i] = d;
    }
}
/* one block per row of the whole vocabulary: k_row_max, k_ce_sums (e into dlogits) and k_ce_bwd in
 * turn, the same arithmetic (dlogits may be logits) */
__global__ void k_ce_row_bwd(float *dlogits, const float *logits, const int32_t *targets, int64_t V, float scale) {
    __shared__ float sh[32];
    const int64_t n = blockIdx.x;
    const float *r = logits + n * V;
    float *d = dlogits + n * V;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, r[c]);
    m = block_reduce<true>(m, sh);
    float se = 0.0f;
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) { /* each thread rewrites only what it read */
        const float x = expf(r[c] - m);
        se += x;
        d[c] = x;
    }
    se = block_reduce<false>(se, sh);
    const float k = scale / se;
    const int64_t t = targets[n];
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) {
        float v = __fmul_rn(d[c], k);
        if (c == t) v -= scale;
        d[c] = v;
    }
}
/* lse of each row (softmax too: probs = exp(x - lse) when probs != NULL) */
__global__ void k_row_lse(float *lse, float *probs, const float *logits, int64_t V) {
    __shared__ float sh[32];
    const int64_t n = blockIdx.x;
    const float *r = logits + n * V;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, r[c]);
    m = block_reduce<true>(m, sh);
    float se = 0.0f;
    for (int64_t c = threadIdx.x; c < V; c += blockDim.x) se += expf(r[c] - m);
    se = block_reduce<false>(se, sh);
    const float l = m + logf(se);
    if (threadIdx.x == 0) lse[n] = l;
    if (probs)
        for (int64_t c = threadIdx.x; c < V; c += blockDim.x) probs[n * V + c] = expf(r[c] - l);
}
/* the loss sum in row order, in double (the CPU's order) */
__global__ void k_ce_sum(double *sum, const float *lse, const float *logits, const int32_t *targets, int64_t N,
                         int64_t V) {
    double acc = 0.0;
    for (int64_t n = 0; n < N; n++) acc += (double)lse[n] - (double)logits[n * V + targets[n]];
    *sum = acc;
}
__global__ void k_softmax_bwd(float *dlogits, const float *dprobs, const float *probs, int64_t E) {
    __shared__ float sh[32];
    const int64_t n = blockIdx.x;
    const float *p = probs + n * E, *dp = dprobs + n * E;
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < E; c += blockDim.x) dot += dp[c] * p[c];
    dot = block_reduce<false>(dot, sh);
    for (int64_t c = threadIdx.x; c < E; c += blockDim.x) dlogits[n * E + c] = p[c] * (dp[c] - dot);
}
void ce_slice_max(cudaStream_t s, float *rowmax, const float *logits, int64_t N, int64_t Vl) {
    if (N <= 0) return;
    k_row_max<<<(unsigned)N, ROW_THREADS, 0, s>>>(rowmax, logits, Vl);
    check_launch("ce_slice_max");
}
void ce_slice_sums(cudaStream_t s, float *sumexp, float *tlogit, float *e, const float *logits, const float *rowmax,
                   const int32_t *targets, int64_t N, int64_t Vl, int64_t v0) {
    if (N <= 0) return;
    k_ce_sums<<<(unsigned)N, ROW_THREADS, 0, s>>>(sumexp, tlogit, e, logits, rowmax, targets, Vl, v0);
    check_launch("ce_slice_sums");
}
void ce_backward_range(cudaStream_t s, float *dlogits, const float *e, const float *sumexp,
                       const int32_t *targets, int64_t N, int64_t Vl, int64_t v0, float scale) {
    if (N <= 0 || Vl <= 0) return;
    k_ce_bwd<<<grid_for(N * Vl, 256), 256, 0, s>>>(dlogits, e, sumexp, targets, N, Vl, v0, scale);
    check_launch("ce_backward_range");
}
void ce_backward(cudaStream_t s, float *dlogits, const float *logits, const int32_t *targets, int64_t N, int64_t V,
                 float scale) {
    if (N <= 0 || V <= 0) return;
    k_ce_row_bwd<<<(unsigned)N, ROW_THREADS, 0, s>>>(dlogits, logits, targets, V, scale);
    check_launch("ce_backward");
}
void ce_forward(cudaStream_t s, float *lse, double *sum, const float *logits, const int32_t *targets, int64_t N,
                int64_t V) {
    if (N > 0) {
        k_row_lse<<<(unsigned)N, ROW_THREADS, 0, s>>>(lse, nullptr, logits, V);
        check_launch("ce_forward lse");
    }
    k_ce_sum<<<1, 1, 0, s>>>(sum, lse, logits, targets, N, V);
    check_launch("ce_forward sum");
}
void softmax_forward(cudaStream_t s, float *probs, float *lse, const float *logits, int64_t N, int64_t E) {
    if (N <= 0) return;
    k_row_lse<<<(unsigned)N, ROW_THREADS, 0, s>>>(lse, probs, logits, E);
    check_launch("softmax_forward");
}
void softmax_backward(cudaStream_t s, float *dlogits, const float *dprobs, const float *probs, int64_t N,
                      int64_t E) {
    if (N <= 0) return;
    k_softmax_bwd<<<(unsigned)N, ROW_THREADS, 0, s>>>(dlogits, dprobs, probs, E);
    check_launch("softmax_backward");
}

/* ------------------------------------------------------------------ MoE token movement, residual add */
__global__ void k_gather_fwd(float *xg, const float *x, const int32_t *row_tok, int64_t R, int64_t D) {
    GRID_STRIDE(i, R * D) xg[i] = x[(int64_t)row_tok[i / D] * D + i % D];
}
__global__ void k_gather_bwd(float *dx, const float *dxg, const int32_t *slot_row, int64_t N, int k, int64_t D) {
    GRID_STRIDE(i, N * D) {
        const int64_t t = i / D, d = i % D;
        float o = dx[i];
        for (int j = 0; j < k; j++) {
            const int32_t r = slot_row[t * k + j];
            if (r >= 0) o += dxg[(int64_t)r * D + d];
        }
        dx[i] = o;
    }
}
__global__ void k_combine_fwd(float *out, const float *ye, const float *topw, const int32_t *slot_row, int64_t N,
                              int k, int64_t D) {
    GRID_STRIDE(i, N * D) {
        const int64_t t = i / D, d = i % D;
        float o = out[i];
        for (int j = 0; j < k; j++) {
            const int32_t r = slot_row[t * k + j];
            if (r >= 0) o += topw[t * k + j] * ye[(int64_t)r * D + d];
        }
        out[i] = o;
    }
}
__global__ void k_combine_bwd_dye(float *dye, const float *dy, const float *topw, const int32_t *slot_row,
                                  int64_t N, int k, int64_t D) {
    GRID_STRIDE(i, N * k * D) {
        const int64_t a = i / D, d = i % D; /* assignment a = t*k + j */
        const int32_t r = slot_row[a];
        if (r >= 0) dye[(int64_t)r * D + d] = topw[a] * dy[(a / k) * D + d];
    }
}
__global__ void k_combine_bwd_dtopw(float *dtopw, const float *dy, const float *ye, const int32_t *slot_row,
                                    int64_t N, int k, int64_t D) {
    const int64_t a = (int64_t)blockIdx.x * WARPS_PER_BLOCK + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (a >= N * k) return;
    const int32_t r = slot_row[a];
    float dw = 0.0f;
    if (r >= 0) {
        const float *g = dy + (a / k) * D, *y = ye + (int64_t)r * D;
        for (int64_t d = lane; d < D; d += 32) dw += g[d] * y[d];
        dw = warp_sum(dw);
    }
    if (lane == 0) dtopw[a] = dw;
}
__global__ void k_add(float *y, const float *x, int64_t n) {
    GRID_STRIDE(i, n) y[i] += x[i];
}
void moe_gather_forward(cudaStream_t s, float *xg, const float *x, const int32_t *row_tok, int64_t R, int64_t D) {
    if (R <= 0 || D <= 0) return;
    k_gather_fwd<<<grid_for(R * D, 256), 256, 0, s>>>(xg, x, row_tok, R, D);
    check_launch("moe_gather_forward");
}
void moe_gather_backward(cudaStream_t s, float *dx, const float *dxg, const int32_t *slot_row, int64_t N, int k,
                         int64_t D) {
    if (N <= 0 || D <= 0) return;
    k_gather_bwd<<<grid_for(N * D, 256), 256, 0, s>>>(dx, dxg, slot_row, N, k, D);
    check_launch("moe_gather_backward");
}
void moe_combine_forward(cudaStream_t s, float *out, const float *ye, const float *topw, const int32_t *slot_row,
                         int64_t N, int k, int64_t D) {
    if (N <= 0 || D <= 0) return;
    k_combine_fwd<<<grid_for(N * D, 256), 256, 0, s>>>(out, ye, topw, slot_row, N, k, D);
    check_launch("moe_combine_forward");
}
void moe_combine_backward(cudaStream_t s, float *dye, float *dtopw, const float *dy, const float *ye,
                          const float *topw, const int32_t *slot_row, int64_t N, int k, int64_t D) {
    if (N <= 0 || k <= 0) return;
    if (D > 0) {
        k_combine_bwd_dye<<<grid_for(N * k * D, 256), 256, 0, s>>>(dye, dy, topw, slot_row, N, k, D);
        check_launch("moe_combine_backward dye");
    }
    k_combine_bwd_dtopw<<<warp_grid(N * k), 32 * WARPS_PER_BLOCK, 0, s>>>(dtopw, dy, ye, slot_row, N, k, D);
    check_launch("moe_combine_backward dtopw");
}
void add_forward(cudaStream_t s, float *y, const float *x, int64_t n) {
    if (n <= 0) return;
    k_add<<<grid_for(n, 256), 256, 0, s>>>(y, x, n);
    check_launch("add_forward");
}

} // namespace tera_cuda
