/* Next-token accuracy (tera_count_correct, val_acc): the first largest logit is the prediction
 * (ties: the lower token id), the vocabulary offset v0 of a tensor-parallel slice is added. */
#include "testutil.h"

#include "tera/train.h"

static void test_count_correct(void **state) {
    (void)state;
    enum { N = 5, V = 4 };
    const float logits[N * V] = {
        0.1f, 2.0f, -1.0f, 0.5f,  /* argmax 1 */
        3.0f, 3.0f, 1.0f,  0.0f,  /* tie 0 / 1: 0 */
        -5.f, -4.f, -3.f,  -2.f,  /* argmax 3 */
        1.0f, 1.0f, 1.0f,  1.0f,  /* all equal: 0 */
        0.0f, 0.0f, 7.0f,  7.0f,  /* tie 2 / 3: 2 */
    };
    const int32_t right[N] = {1, 0, 3, 0, 2}, wrong[N] = {0, 1, 2, 3, 3}, mixed[N] = {1, 1, 3, 2, 2};
    assert_int_equal(tera_count_correct(logits, right, N, V, 0, NULL, NULL), 5);
    assert_int_equal(tera_count_correct(logits, wrong, N, V, 0, NULL, NULL), 0);
    assert_int_equal(tera_count_correct(logits, mixed, N, V, 0, NULL, NULL), 3);
    const int32_t shifted[N] = {11, 10, 13, 10, 12}; /* the slice [10, 14) of a larger vocabulary */
    assert_int_equal(tera_count_correct(logits, shifted, N, V, 10, NULL, NULL), 5);
    assert_int_equal(tera_count_correct(logits, right, N, V, 10, NULL, NULL), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_count_correct)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
