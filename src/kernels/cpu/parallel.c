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
