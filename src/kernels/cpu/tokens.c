/* Token movement of a MoE layer (the dispatcher's row operations) and the residual add. Parallel
 * over destination rows: each output row is written by one thread, and a row that sums several
 * terms adds them in a fixed order (assignment j = 0..k-1), so results do not depend on the number
 * of threads. */
#include <string.h>

#include "tera/kernels.h"
#include "vmath.h"

void tera_moe_gather_forward(float *xg, const float *x, const int32_t *row_tok, int64_t R, int64_t D) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) memcpy(xg + r * D, x + (int64_t)row_tok[r] * D, sizeof(float) * (size_t)D);
}

void tera_moe_gather_backward(float *dx, const float *dxg, const int32_t *slot_row, int64_t N, int k, int64_t D) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; t++) {
        float *o = dx + t * D;
        for (int j = 0; j < k; j++) {
            const int32_t r = slot_row[t * k + j];
            if (r < 0) continue;
            const float *src = dxg + (int64_t)r * D;
            for (int64_t d = 0; d < D; d++) o[d] += src[d];
        }
    }
}

void tera_moe_combine_forward(float *out, const float *ye, const float *topw, const int32_t *slot_row, int64_t N,
                              int k, int64_t D) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; t++) {
        float *o = out + t * D;
        for (int j = 0; j < k; j++) {
            const int32_t r = slot_row[t * k + j];
            if (r < 0) continue;
            const float wgt = topw[t * k + j];
            const float *y = ye + (int64_t)r * D;
            for (int64_t d = 0; d < D; d++) o[d] += wgt * y[d];
        }
    }
}

void tera_moe_combine_backward(float *dye, float *dtopw, const float *dy, const float *ye, const float *topw,
                               const int32_t *slot_row, int64_t N, int k, int64_t D) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; t++) {
        const float *g = dy + t * D;
        for (int j = 0; j < k; j++) {
            const int32_t r = slot_row[t * k + j];
            float dw = 0.0f;
            if (r >= 0) {
                const float wgt = topw[t * k + j];
                float *dyr = dye + (int64_t)r * D;
                for (int64_t d = 0; d < D; d++) dyr[d] = wgt * g[d];
                dw = tera_dot(g, ye + (int64_t)r * D, D); /* 16 lanes: not one chain of D dependent adds */
            }
            dtopw[t * k + j] = dw;
        }
    }
}

void tera_add_forward(float *y, const float *x, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}
