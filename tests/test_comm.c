/* The watchdog's automatic timeout (parallel.timeout_s = -1): the start-up allowance until three
 * steps have been timed and outside steps, then max(floor, factor x the slowest step after the
 * first) inside steps; an explicit value wins, 0 is off. (The stall itself, the message naming the
 * stalled rank and the CPU a waiting rank uses: tests/cli_hang.sh.) */
#include "testutil.h"
#include "tera/comm.h"

static void near(double got, double want) {
    if (fabs(got - want) > 1e-9) fprintf(stderr, "timeout %g, expected %g\n", got, want);
    assert_true(fabs(got - want) <= 1e-9);
}

static void test_auto_timeout(void **state) {
    (void)state;
    assert_true(TERA_COMM_AUTO_FLOOR_S == 60.0 && TERA_COMM_AUTO_FACTOR == 20.0 && TERA_COMM_STARTUP_S == 600.0 &&
                TERA_COMM_AUTO_AFTER_STEPS == 3);
    tera_comm_set_timeout(-1.0);
    near(tera_comm_timeout_now(), 600.0); /* set-up */
    tera_comm_step_begin(0);
    near(tera_comm_timeout_now(), 600.0); /* no step timed yet */
    tera_comm_step_end(100.0);            /* the first step (kernel generation, first touch) is not counted */
    tera_comm_step_begin(1);
    tera_comm_step_end(0.01);
    tera_comm_step_begin(2);
    near(tera_comm_timeout_now(), 600.0); /* two timed: still the allowance */
    tera_comm_step_end(0.02);
    tera_comm_step_begin(3);
    near(tera_comm_timeout_now(), 60.0); /* three timed, fast steps: the floor */
    tera_comm_step_end(4.0);
    near(tera_comm_timeout_now(), 600.0); /* outside steps (evaluation, checkpoints): the allowance */
    tera_comm_step_begin(4);
    near(tera_comm_timeout_now(), 80.0); /* 20 x the slowest step */
    tera_comm_step_end(0.5);
    tera_comm_step_begin(5);
    near(tera_comm_timeout_now(), 80.0); /* the slowest still counts */
    tera_comm_step_end(40.0);
    tera_comm_step_begin(6);
    near(tera_comm_timeout_now(), 800.0); /* slow steps: 20 x 40 inside and outside steps */
    tera_comm_step_end(1.0);
    near(tera_comm_timeout_now(), 800.0);
    tera_comm_set_timeout(5.0); /* an explicit value wins */
    near(tera_comm_timeout_now(), 5.0);
    tera_comm_set_timeout(0.0); /* off */
    near(tera_comm_timeout_now(), 0.0);
    tera_comm_set_timeout(-1.0);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_auto_timeout)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
