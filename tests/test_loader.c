/* The loader: the read-ahead thread hands out exactly the loader's samples, in sequence and after
 * jumps; data-parallel sample assignment is exact across layouts and resumes; blends (data.paths):
 * realised proportions, each sample from its dataset in that dataset's order, validation splits,
 * errors. */
#include <unistd.h>

#include "testutil.h"
#include "tera/data.h"

static void check_batch(const tera_loader *l, int64_t g0, int B, const int32_t *in, const int32_t *tg) {
    int32_t ri[64], rt[64];
    for (int b = 0; b < B; b++) {
        tera_loader_train_sample(l, g0 + b, ri, rt);
        assert_memory_equal(in + b * l->T, ri, sizeof(int32_t) * (size_t)l->T);
        assert_memory_equal(tg + b * l->T, rt, sizeof(int32_t) * (size_t)l->T);
    }
}

static void test_sequence_and_jumps(void **state) {
    (void)state;
    tera_data_config dc = {0};
    snprintf(dc.format, sizeof dc.format, "auto");
    tera_token_source src;
    assert_int_equal(tera_source_open(&src, &dc, 256), TERA_OK); /* the embedded corpus */
    for (int shuffle = 0; shuffle < 2; shuffle++) {
        tera_loader l;
        assert_int_equal(tera_loader_init(&l, &src, 16, 0.0f, shuffle, 7), TERA_OK);
        const int B = 3;
        for (int depth = 2; depth <= 5; depth += 3) {
            tera_prefetcher *p;
            assert_int_equal(tera_prefetch_start(&p, &l, B, depth), TERA_OK);
            const int32_t *in, *tg;
            int64_t g = 0;
            for (int i = 0; i < 50; i++, g += B) { /* in sequence, wrapping past an epoch */
                tera_prefetch_get(p, g, &in, &tg);
                check_batch(&l, g, B, in, tg);
            }
            const int64_t jumps[] = {5, 5 + B, 1000, 3, l.n_train - 1, 0, 0, 12345};
            for (size_t j = 0; j < sizeof jumps / sizeof *jumps; j++) {
                tera_prefetch_get(p, jumps[j], &in, &tg);
                check_batch(&l, jumps[j], B, in, tg);
            }
            tera_prefetch_stop(p);
        }
    }
    tera_source_close(&src);
}

/* Every layout with the same global batch reads the same samples per step, and a run that changes
 * layout at a resume reads every sample exactly once, in order of steps. */
static void test_step_samples_across_layouts(void **state) {
    (void)state;
    const int layouts[][3] = {{8, 1, 1}, {4, 2, 1}, {1, 8, 1}, {4, 1, 2}, {2, 2, 2}, {1, 2, 4}, {1, 1, 8}, {2, 1, 4}};
    const int G = 8, steps = 5;
    const int n = sizeof layouts / sizeof *layouts;
    for (int i = 0; i < n; i++) {
        const int micro = layouts[i][0], accum = layouts[i][1], dp = layouts[i][2];
        assert_int_equal(micro * accum * dp, G);
        int64_t consumed = 0;
        for (int s = 0; s < steps; s++) {
            int seen[8] = {0};
            for (int r = 0; r < dp; r++)
                for (int a = 0; a < accum; a++)
                    for (int b = 0; b < micro; b++) {
                        int64_t g = tera_loader_step_sample(consumed, micro, a, r, dp, b);
                        assert_true(g >= consumed && g < consumed + G);
                        seen[g - consumed]++;
                    }
            for (int k = 0; k < G; k++) assert_int_equal(seen[k], 1);
            consumed += G;
        }
    }
    /* resume with another global batch: layout A for 3 steps (G=8), then B (G=12) for 4 */
    int64_t consumed = 0;
    int hits[8 * 3 + 12 * 4] = {0};
    for (int s = 0; s < 3; s++, consumed += 8)
        for (int r = 0; r < 2; r++)
            for (int b = 0; b < 4; b++) hits[tera_loader_step_sample(consumed, 4, 0, r, 2, b)]++;
    for (int s = 0; s < 4; s++, consumed += 12)
        for (int r = 0; r < 3; r++)
            for (int a = 0; a < 2; a++)
                for (int b = 0; b < 2; b++) hits[tera_loader_step_sample(consumed, 2, a, r, 3, b)]++;
    for (int k = 0; k < 8 * 3 + 12 * 4; k++) assert_int_equal(hits[k], 1);
}

/* dataset d of the blend test: n tokens, token i = 100 d + i mod 97 (the hundreds name the dataset) */
static void write_u16(const char *path, int d, int n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    for (int i = 0; i < n; i++) {
        const int v = 100 * d + i % 97;
        fputc(v & 255, f), fputc(v >> 8, f);
    }
    fclose(f);
}

static void test_blend(void **state) {
    (void)state;
    char dir[] = "/tmp/tera_blend_XXXXXX", pa[64], pb[64], pc[64];
    assert_non_null(mkdtemp(dir));
    snprintf(pa, sizeof pa, "%s/web.u16", dir), snprintf(pb, sizeof pb, "%s/code.u16", dir);
    snprintf(pc, sizeof pc, "%s/books.u16", dir);
    const int T = 4, ntok[3] = {4001, 801, 401}; /* 1000, 200, 100 samples */
    write_u16(pa, 0, ntok[0]), write_u16(pb, 1, ntok[1]), write_u16(pc, 2, ntok[2]);
    tera_data_config dc = {0};
    snprintf(dc.format, sizeof dc.format, "auto");
    snprintf(dc.paths, sizeof dc.paths, "0.7 %s, 0.2 %s,0.1   %s ", pa, pb, pc);
    tera_token_source src;
    assert_int_equal(tera_source_open(&src, &dc, 300), TERA_OK);
    tera_loader l;
    assert_int_equal(tera_loader_init(&l, &src, T, 0.1f, 0, 5), TERA_OK);
    assert_int_equal(tera_loader_n_datasets(&l), 3);
    assert_string_equal(tera_loader_dataset_name(&l, 0), "web_u16");
    assert_string_equal(tera_loader_dataset_name(&l, 2), "books_u16");
    assert_true(fabs(tera_loader_dataset_weight(&l, 1) - 0.2) < 1e-12);
    assert_int_equal(l.n_train, 900 + 180 + 90);
    assert_int_equal(l.n_val, 100 + 20 + 10);
    /* proportions: every prefix of 30000 samples within one sample of the weights; a period exact */
    const double w[3] = {0.7, 0.2, 0.1};
    int64_t cnt[3] = {0}, next[3] = {0};
    int32_t in[4], tg[4];
    for (int64_t g = 0; g < 30000; g++) {
        const int d = tera_loader_dataset_of(&l, g);
        cnt[d]++;
        for (int e = 0; e < 3; e++)
            if (fabs((double)cnt[e] - w[e] * (double)(g + 1)) > 1.0 + 1e-9)
                fail_msg("after %ld samples dataset %d has %ld, weight %.1f", (long)g + 1, e, (long)cnt[e], w[e]);
        if (g + 1 == TERA_BLEND_PERIOD) assert_true(cnt[0] == 7000 && cnt[1] == 2000 && cnt[2] == 1000);
        /* the sample is the next of that dataset's own training order (unshuffled: j mod n_train) */
        tera_loader_train_sample(&l, g, in, tg);
        const int64_t j = next[d]++ % (int64_t)(ntok[d] / T * 9 / 10);
        for (int t = 0; t < T; t++) {
            assert_int_equal(in[t], 100 * d + (int)((j * T + t) % 97));
            assert_int_equal(tg[t], 100 * d + (int)((j * T + t + 1) % 97));
        }
    }
    /* validation: each dataset's own tail; the blend's validation samples interleave them */
    for (int d = 0; d < 3; d++) {
        assert_int_equal(tera_loader_n_val_of(&l, d), ntok[d] / T / 10);
        tera_loader_val_sample_of(&l, d, 0, in, tg);
        assert_int_equal(in[0], 100 * d + (int)((int64_t)(ntok[d] / T * 9 / 10) * T % 97));
    }
    for (int64_t v = 0; v < 100; v++) {
        tera_loader_val_sample(&l, v, in, tg);
        assert_int_equal(in[0] / 100, tera_loader_dataset_of(&l, v));
    }
    /* the read-ahead thread over a blend, with shuffling */
    tera_loader ls;
    assert_int_equal(tera_loader_init(&ls, &src, T, 0.1f, 1, 9), TERA_OK);
    tera_prefetcher *p;
    assert_int_equal(tera_prefetch_start(&p, &ls, 3, 2), TERA_OK);
    const int32_t *pin, *ptg;
    for (int64_t g = 0; g < 300; g += 3) {
        tera_prefetch_get(p, g, &pin, &ptg);
        check_batch(&ls, g, 3, pin, ptg);
        for (int b = 0; b < 3; b++) assert_int_equal(pin[b * T] / 100, tera_loader_dataset_of(&ls, g + b));
    }
    tera_prefetch_stop(p);
    tera_source_close(&src);
    /* errors name the item */
    const char *bad[] = {"x web", "0 web", "0.5", "-1 a, 1 b", ",", "0.5 /nonexistent/tera_blend_nothing"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(dc.paths, sizeof dc.paths, "%s", bad[i]);
        assert_int_not_equal(tera_source_open(&src, &dc, 300), TERA_OK);
    }
    snprintf(dc.paths, sizeof dc.paths, "1 %s", pa);
    snprintf(dc.path, sizeof dc.path, "%s", pb);
    assert_int_not_equal(tera_source_open(&src, &dc, 300), TERA_OK); /* data.path and data.paths */
    dc.path[0] = '\0';
    snprintf(dc.paths, sizeof dc.paths, "0.99999 %s, 0.00001 %s", pa, pb); /* never read: refused */
    assert_int_equal(tera_source_open(&src, &dc, 300), TERA_OK);
    assert_int_not_equal(tera_loader_init(&l, &src, T, 0.0f, 0, 5), TERA_OK);
    tera_source_close(&src);
    unlink(pa), unlink(pb), unlink(pc), rmdir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_sequence_and_jumps),
                                       cmocka_unit_test(test_step_samples_across_layouts),
                                       cmocka_unit_test(test_blend)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
