/* The compute backend a run asks for (training.device): the one place that knows which backends this
 * build has (include/tera/backend.h: tera_backend_for_device). */
#include <string.h>

#include "tera/backend.h"
#include "tera/status.h"
#ifdef TERA_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

tera_status tera_backend_for_device(const char *device, int threads, tera_backend **out) {
    *out = NULL;
    if (!device || !device[0] || strcmp(device, "cpu") == 0) {
        *out = tera_backend_cpu_create(threads);
        return TERA_OK;
    }
    if (strcmp(device, "cuda") != 0)
        return tera_fail(TERA_ERR_CONFIG, "training.device = '%s': expected cpu or cuda", device);
#ifdef TERA_CUDA
    char why[256];
    *out = tera_backend_cuda_create(threads, why, sizeof why);
    if (*out) return TERA_OK;
    return tera_fail(TERA_ERR_CONFIG, "training.device = cuda: %s", why);
#else
    return tera_fail(TERA_ERR_CONFIG,
                     "training.device = cuda: this build has no CUDA backend (nvcc and cuBLAS were not found "
                     "when it was configured, or -DTERA_CUDA=OFF; docs/GPU.md)");
#endif
}

