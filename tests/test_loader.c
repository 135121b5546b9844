/* The loader: the read-ahead thread hands out exactly the loader's samples, in sequence and after
 * jumps; data-parallel sample assignment is exact across layouts and resumes. */
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

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_sequence_and_jumps),
                                       cmocka_unit_test(test_step_samples_across_layouts)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
