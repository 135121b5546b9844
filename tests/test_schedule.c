/* Pipeline schedules: every kind is deadlock-free by simulation, runs each micro-batch's forward
 * before its backward exactly once per virtual stage, 1F1B keeps at most p - r micro-batches in
 * flight (GPipe m), and the simulated bubble equals (p-1)/(m+p-1) (interleaved: (p-1)/(vm+p-1))
 * exactly, for every backward/forward cost ratio tried. */
#include "testutil.h"
#include "tera/schedule.h"

static void check(tera_sched_kind kind, int pp, int m, int v) {
    tera_schedule s;
    assert_int_equal(tera_schedule_build(&s, kind, pp, m, v), TERA_OK);
    /* each rank: every (micro, chunk) exactly once forward and once backward, forward first */
    for (int r = 0; r < pp; r++) {
        const tera_sched_op *o = tera_schedule_rank(&s, r);
        int seen_f[256] = {0}, seen_b[256] = {0};
        for (int i = 0; i < s.n_ops; i++) {
            int key = o[i].micro * s.v + o[i].chunk;
            assert_true(o[i].micro >= 0 && o[i].micro < m && o[i].chunk >= 0 && o[i].chunk < s.v);
            if (o[i].kind == TERA_OP_FWD) {
                seen_f[key]++;
            } else {
                assert_int_equal(seen_f[key], 1); /* forward before backward */
                seen_b[key]++;
            }
        }
        for (int k = 0; k < m * s.v; k++) assert_true(seen_f[k] == 1 && seen_b[k] == 1);
    }
    const double tbs[] = {2.0, 1.0, 3.0, 0.5}; /* backward cost per forward cost */
    for (int t = 0; t < 4; t++) {
        tera_sched_stats st;
        tera_status rc = tera_schedule_simulate(&s, 1.0, tbs[t], &st);
        if (rc != TERA_OK) fprintf(stderr, "%s\n", tera_last_error());
        assert_int_equal(rc, TERA_OK);
        if (kind == TERA_SCHED_GPIPE) assert_int_equal(st.peak_in_flight, m);
        if (kind == TERA_SCHED_1F1B)
            for (int r = 0; r < pp; r++) assert_true(st.peak_in_flight_rank[r] <= (pp - r < m ? pp - r : m));
        /* the formula, exactly: (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1); the makespan is the ideal
         * v m (tf + tb) plus p - 1 stage-passes of (tf + tb) / v */
        const double want = (double)(pp - 1) / ((double)s.v * m + pp - 1);
        if (fabs(st.bubble - want) >= 1e-12 || fabs(st.bubble_theory - want) >= 1e-12)
            fprintf(stderr, "%s p=%d m=%d v=%d tb/tf=%g: simulated bubble %.15f, formula %.15f\n",
                    tera_sched_kind_name(kind), pp, m, s.v, tbs[t], st.bubble, want);
        assert_true(fabs(st.bubble - want) < 1e-12);
        assert_true(fabs(st.bubble_theory - want) < 1e-12);
        assert_true(fabs(st.makespan - ((double)s.v * m + pp - 1) * (1.0 + tbs[t])) < 1e-9);
    }
    /* parallel.pp_head_split's order: 1F1B and interleaved run the last virtual stage's forward and
     * backward of each micro-batch back to back, in micro-batch order; GPipe (m > 1) does not */
    assert_int_equal(tera_schedule_head_adjacent(&s), kind != TERA_SCHED_GPIPE || m == 1);
    tera_schedule_free(&s);
}

static void test_all_kinds(void **state) {
    (void)state;
    const int pps[] = {1, 2, 3, 4, 8}, ms[] = {1, 2, 3, 4, 6, 8, 12, 16, 24};
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 9; b++) {
            check(TERA_SCHED_GPIPE, pps[a], ms[b], 1);
            check(TERA_SCHED_1F1B, pps[a], ms[b], 1);
            if (ms[b] % pps[a] == 0 && pps[a] > 1) /* interleaved needs m a multiple of p */
                for (int v = 2; v <= 4; v++) check(TERA_SCHED_INTERLEAVED, pps[a], ms[b], v);
        }
}

static void test_known_values(void **state) {
    (void)state;
    tera_schedule s;
    tera_sched_stats st;
    /* p=4, m=8: bubble 3/11 for GPipe and 1F1B; 1F1B holds 4 micro-batches on rank 0, GPipe 8 */
    assert_int_equal(tera_schedule_build(&s, TERA_SCHED_1F1B, 4, 8, 1), TERA_OK);
    assert_int_equal(tera_schedule_simulate(&s, 1.0, 2.0, &st), TERA_OK);
    assert_true(fabs(st.bubble - 3.0 / 11.0) < 1e-12);
    assert_int_equal(st.peak_in_flight_rank[0], 4);
    assert_int_equal(st.peak_in_flight_rank[3], 1);
    assert_true(fabs(st.makespan - (8 + 3) * 3.0) < 1e-12);
    tera_schedule_free(&s);
    assert_int_equal(tera_schedule_build(&s, TERA_SCHED_INTERLEAVED, 4, 8, 2), TERA_OK);
    assert_int_equal(tera_schedule_simulate(&s, 0.5, 1.0, &st), TERA_OK); /* a chunk is half a stage */
    assert_true(fabs(st.bubble - 3.0 / 19.0) < 1e-12);                    /* (p-1)/(vm+p-1), below 3/11 */
    assert_true(fabs(st.makespan - (16 + 3) * 1.5) < 1e-12);
    tera_schedule_free(&s);
    /* a hand-made order that deadlocks is caught: rank 1 wants B0 before F0 arrives... */
    assert_int_equal(tera_schedule_build(&s, TERA_SCHED_GPIPE, 2, 2, 1), TERA_OK);
    tera_sched_op *r0 = s.ops; /* rank 0: B0 first (needs rank 1's B0, which needs rank 0's F0) */
    tera_sched_op tmp = r0[0];
    r0[0] = r0[2];
    r0[2] = tmp;
    assert_int_equal(tera_schedule_simulate(&s, 1.0, 2.0, &st), TERA_ERR_NUMERIC);
    assert_non_null(strstr(tera_last_error(), "deadlock"));
    tera_schedule_free(&s);
    /* refusals */
    assert_int_equal(tera_schedule_build(&s, TERA_SCHED_INTERLEAVED, 4, 6, 2), TERA_ERR_CONFIG);
    assert_int_equal(tera_schedule_build(&s, TERA_SCHED_INTERLEAVED, 4, 8, 1), TERA_ERR_CONFIG);
    tera_sched_kind k;
    assert_int_equal(tera_sched_kind_parse("1f1b", &k), TERA_OK);
    assert_int_equal(k, TERA_SCHED_1F1B);
    assert_int_equal(tera_sched_kind_parse("zigzag", &k), TERA_ERR_ARG);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_all_kinds), cmocka_unit_test(test_known_values)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
