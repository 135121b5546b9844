/* BPE tokenizer throughput: GPT-2 encoding of tinyshakespeare (1.1 MB) on 1 and 2 threads, and
 * training a 2048-token vocabulary on it.
 *
 * Build and run (from the repository root):
 *   gcc -std=c11 -D_GNU_SOURCE -O3 -march=native -fopenmp -Iinclude -Isrc src/core/status.c \
 *       src/core/io.c src/data/tokenizer.c src/data/tokenizer_encode.c src/data/tokenizer_train.c \
 *       bench/bench_tokenizer.c -o /tmp/bench_tokenizer -lpcre2-8 -lcjson -lxxhash \
 *       && /tmp/bench_tokenizer [reps] [shared_dir]
 *
 * Each encode call starts with an empty word cache (it lives in the call), as a real caller's
 * would. MB/s = 1e6 bytes per second of the text; medians of `reps` runs after one warm-up. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tera/io.h"
#include "tera/tokenizer.h"
#include "bench_median.h"

static void check(tera_status s, const char *what) {
    if (s == TERA_OK) return;
    fprintf(stderr, "bench_tokenizer: %s: %s\n", what, tera_last_error());
    exit(1);
}

/* Median seconds of one encode with `threads` threads (0 = the serial entry point). */
static double time_encode(const tera_tokenizer *t, const char *text, size_t n, int threads, int reps,
                          size_t *n_ids) {
    double *sec = malloc(sizeof(double) * (size_t)reps);
    for (int r = -1; r < reps; r++) {
        int32_t *ids;
        double t0 = omp_get_wtime();
        if (threads == 0)
            check(tera_tokenizer_encode(t, text, n, 0, &ids, n_ids), "encode");
        else
            check(tera_tokenizer_encode_parallel(t, text, n, 0, threads, &ids, n_ids), "encode_parallel");
        double dt = omp_get_wtime() - t0;
        if (r >= 0) sec[r] = dt;
        free(ids);
    }
    double m = median(sec, reps);
    free(sec);
    return m;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 7;
    const char *shared = argc > 2 ? argv[2] : "../shared";
    if (reps < 1) reps = 1;
    char enc[1024], bpe[1024], txt[1024];
    snprintf(enc, sizeof enc, "%s/data/gpt2/encoder.json", shared);
    snprintf(bpe, sizeof bpe, "%s/data/gpt2/vocab.bpe", shared);
    snprintf(txt, sizeof txt, "%s/data/tinyshakespeare.txt", shared);
    tera_tokenizer *t;
    double t0 = omp_get_wtime();
    check(tera_tokenizer_load_gpt2(&t, enc, bpe), "load");
    printf("load GPT-2 tokenizer: %.3f s\n", omp_get_wtime() - t0);
    char *text;
    check(tera_read_text_file(txt, &text), "read");
    size_t n = strlen(text), n_ids = 0;
    double s1 = time_encode(t, text, n, 0, reps, &n_ids);
    printf("encode 1 thread : %7.2f MB/s (%zu bytes -> %zu ids, median of %d: %.4f s)\n", n / s1 / 1e6, n, n_ids,
           reps, s1);
    for (int th = 2; th <= 2; th++) {
        double s = time_encode(t, text, n, th, reps, &n_ids);
        printf("encode %d threads: %7.2f MB/s (median of %d: %.4f s)\n", th, n / s / 1e6, reps, s);
    }
    const char *texts[] = {text};
    size_t lens[] = {n};
    tera_tokenizer *trained;
    t0 = omp_get_wtime();
    check(tera_tokenizer_train(&trained, texts, lens, 1, 2048), "train");
    printf("train vocab 2048 on %zu bytes: %.3f s\n", n, omp_get_wtime() - t0);
    tera_tokenizer_free(trained);
    tera_tokenizer_free(t);
    free(text);
    return 0;
}
