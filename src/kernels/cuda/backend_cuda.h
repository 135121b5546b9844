/* The CUDA compute backend (issue 21): the table of include/tera/backend.h filled with CUDA kernels
 * and cuBLAS products over device buffers (src/kernels/cuda/backend_cuda.cu, kernels.cu), and the
 * choice of a backend by training.device. docs/GPU.md describes what runs where and what is naive.
 *
 * Built only where CMake found nvcc and cuBLAS (cmake/cuda.cmake defines TERA_CUDA); elsewhere the
 * functions below that need it are absent and tera_backend_for_device answers `cuda` with one
 * error naming the key. */
#ifndef TERA_BACKEND_CUDA_H
#define TERA_BACKEND_CUDA_H

#include <stddef.h>
#include <string.h>

#include "tera/backend.h"
#include "tera/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef TERA_CUDA
/* The CUDA backend on this process's device (the local rank modulo the devices seen, so several
 * ranks may share one GPU). threads: host compute threads (OpenMP, for the code that stays on the
 * host), as tera_backend_cpu_create. NULL when there is no usable device, with the reason in
 * why[why_len]. Precision fp32 until set.
 *
 * Buffers: ops take device pointers (mem.alloc: cudaMalloc). A host pointer is also accepted: the
 * op copies it to a staging area on the device and back (correct, slow: PCIe bound, synchronous);
 * this is how the model runs on it today, because the model allocates its tensors on the host. */
tera_backend *tera_backend_cuda_create(int threads, char *why, size_t why_len);
/* Devices visible to this process (0 when none, or no driver); why (may be NULL) gets the reason. */
int tera_cuda_device_count(char *why, size_t why_len);
/* Copies between any two buffers (host or device), then waits for the device. */
void tera_cuda_copy(void *dst, const void *src, size_t bytes);
/* Waits for every op queued on the backend's stream. */
void tera_cuda_sync(tera_backend *be);
/* Host pointers staged since creation, and the staging area's current size in bytes. */
void tera_cuda_staging_stats(const tera_backend *be, long long *staged_args, size_t *stage_bytes);
#endif

/* tera_backend_for_device (the backend training.device names) is declared in include/tera/backend.h
 * and defined in src/kernels/device.c. */

#ifdef __cplusplus
}
#endif

#endif
