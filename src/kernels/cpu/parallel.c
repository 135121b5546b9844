/* Scheduling of independent work items (the experts of a MoE layer) on the CPU's threads. */
#include <omp.h>

#include "tera/kernels.h"

int tera_max_threads(void) { return omp_get_max_threads(); }

int tera_items_side_by_side(int n) {
    const int t = omp_get_max_threads();
    return t > 1 && n >= 2 * t;
}

void tera_for_each_item(int n, void (*fn)(void *ctx, int i), void *ctx) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < n; i++) fn(ctx, i);
}

void tera_for_ranges(int64_t n, void (*fn)(void *ctx, int64_t lo, int64_t hi, int worker), void *ctx) {
    if (n <= 0) return;
    if (n == 1 || omp_get_max_threads() == 1) {
        fn(ctx, 0, n, 0);
        return;
    }
#pragma omp parallel
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
        if (hi > lo) fn(ctx, lo, hi, (int)t);
    }
}
