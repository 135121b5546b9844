/* The read-ahead thread hands out exactly the loader's samples, in sequence and after jumps. */
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

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_sequence_and_jumps)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
