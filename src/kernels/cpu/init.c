/* Parameter initialisation from the counter-based RNG: each element is a pure function of its
 * index in the whole tensor, so any block of any tensor fills alike on any rank and thread count. */
#include "tera/kernels.h"
#include "tera/rng.h"

void tera_fill_normal_block(float *w, int64_t numel, const int64_t *shape, const int64_t *lo, const int64_t *len,
                            float std, uint64_t seed, uint64_t stream) {
    const int64_t L1 = len[1], L2 = len[2], S1 = shape[1], S2 = shape[2];
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < numel; j++) {
        const int64_t i0 = j / (L1 * L2), i1 = j / L2 % L1, i2 = j % L2;
        const uint64_t g = (uint64_t)(((lo[0] + i0) * S1 + lo[1] + i1) * S2 + lo[2] + i2);
        w[j] = std * tera_rng_normal(seed, stream, g);
    }
}
