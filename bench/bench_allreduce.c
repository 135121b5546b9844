/* The fp32 collectives of a data-parallel step alone, under mpirun (docs/COMMUNICATION.md, "Ranks on
 * one host"; issue 19): a gradient-sized buffer summed blocking, then in buckets started one after
 * another and waited for at the end (the data-parallel gradient sums' pattern), then reduce-scattered
 * and all-gathered in ranges (ZeRO's). Per repetition: the time inside the calls that start the
 * non-blocking sums (progress) and in the waits; medians over the repetitions. Run it twice to
 * compare the shared segment with MPI's collectives:
 *   mpirun -np 2 build/bench/bench_allreduce [--floats N] [--buckets B] [--reps R]
 *   TERA_COMM_SHM=0 mpirun -np 2 build/bench/bench_allreduce ...
 * Prints one JSON line (rank 0). Defaults: 52M floats (bench-dist's 208 MB gradient), 18 buckets.
 * (On one rank, without mpirun, every collective is the one-rank answer: the smoke test.) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_median.h"
#include "tera/comm.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define MAXB 256
#define MAXR 64

int main(int argc, char **argv) {
    int64_t n = 52 * 1000 * 1000;
    int nb = 18, reps = 5;
    if (tera_comm_init(&argc, &argv) != TERA_OK) return 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--floats")) n = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--buckets")) nb = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    }
    if (nb < 1 || nb > MAXB || reps < 1 || reps > MAXR || n < nb) {
        fprintf(stderr, "bench_allreduce: --buckets 1..%d, --reps 1..%d, --floats >= buckets\n", MAXB, MAXR);
        return 2;
    }
    tera_comm *w = tera_comm_world();
    const int p = tera_comm_size(w), me = tera_comm_rank(w);
    float *g = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) g[i] = 1.0f + (float)(i % 7);
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)p);
    for (int r = 0; r < p; r++) counts[r] = n / p + (r < n % p);
    double blk[MAXR], post[MAXR], wait[MAXR], rs[MAXR], ag[MAXR];
    tera_comm_req rq[MAXB];
    for (int rep = 0; rep < reps; rep++) {
        tera_comm_barrier(w);
        double t0 = now();
        tera_comm_allreduce_f32(w, g, n);
        blk[rep] = now() - t0;
        tera_comm_barrier(w);
        const int64_t per = n / nb;
        double tp = 0.0;
        for (int b = 0; b < nb; b++) {
            const double a = now();
            tera_comm_iallreduce_f32(w, g + b * per, b == nb - 1 ? n - b * per : per, &rq[b]);
            tp += now() - a;
        }
        post[rep] = tp;
        t0 = now();
        for (int b = 0; b < nb; b++) tera_comm_wait(&rq[b]);
        wait[rep] = now() - t0;
        tera_comm_barrier(w);
        t0 = now();
        tera_comm_reduce_scatter_f32(w, g, counts);
        rs[rep] = now() - t0;
        tera_comm_barrier(w);
        t0 = now();
        tera_comm_allgather_f32(w, g, counts);
        ag[rep] = now() - t0;
    }
    if (me == 0) {
        const char *e = getenv("TERA_COMM_SHM");
        printf("{\"ranks\": %d, \"floats\": %ld, \"buckets\": %d, \"reps\": %d, \"shm\": %d, "
               "\"allreduce_ms\": %.2f, \"iallreduce_post_ms\": %.2f, \"iallreduce_wait_ms\": %.2f, "
               "\"reduce_scatter_ms\": %.2f, \"allgather_ms\": %.2f}\n",
               p, (long)n, nb, reps, !(e && !strcmp(e, "0")), 1e3 * median(blk, reps),
               1e3 * median(post, reps), 1e3 * median(wait, reps), 1e3 * median(rs, reps),
               1e3 * median(ag, reps));
    }
    free(g), free(counts);
    tera_comm_finalize();
    return 0;
}
