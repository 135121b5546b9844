/* Zeroing and copying the step's larger host buffers on every thread (ops.for_ranges): one thread
 * clearing bench-m's 32 MiB embedding gradient, a layer's input gradients [N, D] or the residual
 * under the output projection while the others waited was measurable beside the step
 * (docs/PERFORMANCE.md, wave 21). Below 65536 floats: one memset / memcpy on the calling thread. */
#ifndef TERA_MODEL_HOST_FILL_H
#define TERA_MODEL_HOST_FILL_H

#include <stdint.h>
#include <string.h>

#include "tera/backend.h"

#define TERA_HOST_FILL_MIN ((int64_t)1 << 16)

typedef struct {
    float *dst;
    const float *src; /* NULL: zeros */
} tera_host_fill_job;

static inline void tera_host_fill_range(void *ctx, int64_t lo, int64_t hi, int worker) {
    (void)worker;
    const tera_host_fill_job *j = ctx;
    if (j->src) memcpy(j->dst + lo, j->src + lo, sizeof(float) * (size_t)(hi - lo));
    else memset(j->dst + lo, 0, sizeof(float) * (size_t)(hi - lo));
}

/* dst[0, n) = src[0, n), or zeros when src is NULL */
static inline void tera_host_fill(tera_backend *be, float *dst, const float *src, int64_t n) {
    tera_host_fill_job j = {dst, src};
    if (n < TERA_HOST_FILL_MIN) tera_host_fill_range(&j, 0, n, 0);
    else be->ops.for_ranges(be, n, tera_host_fill_range, &j);
}

#endif
