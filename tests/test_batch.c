/* Dynamic batch size: the ramp-up schedule, the grad-norm growth trigger, the LR rule, the data
 * accounting of a trainer, and state.json carrying the batch and loss-spike guard state across a
 * resume (skip windows still skipped, LR cut still applied, the same spike window). */
#include <unistd.h>

#include "testutil.h"
#include "tera/ckpt.h"
#include "tera/train.h"

static char g_dir[256];

static tera_train_config tcfg(int accum, int start, int steps, float gnorm, int window, int max) {
    tera_config c;
    tera_config_defaults(&c);
    c.training.grad_accum = accum;
    c.training.batch_rampup_start = start;
    c.training.batch_rampup_steps = steps;
    c.training.batch_grow_gnorm = gnorm;
    c.training.batch_grow_window = window;
    c.training.batch_grow_max = max;
    return c.training;
}

static void test_ramp(void **state) {
    (void)state;
    tera_batch_state b;
    tera_batch_init(&b);
    /* 2 -> 8 over 12 steps: 2 + floor(6 s / 12), whole micro-batches, never down, then 8 */
    tera_train_config t = tcfg(8, 2, 12, 0.0f, 1, 0);
    int prev = 0;
    for (int s = 0; s < 12; s++) {
        const int a = tera_batch_accum(&t, &b, s);
        assert_int_equal(a, 2 + 6 * s / 12);
        assert_true(a >= prev && a < 8);
        prev = a;
    }
    assert_int_equal(tera_batch_accum(&t, &b, 12), 8);
    assert_int_equal(tera_batch_accum(&t, &b, 1000000), 8);
    /* every level between 2 and 7 is visited */
    int seen[9] = {0};
    for (int s = 0; s < 12; s++) seen[tera_batch_accum(&t, &b, s)] = 1;
    for (int a = 2; a < 8; a++) assert_true(seen[a]);
    /* off: grad_accum from step 0 */
    t = tcfg(8, 0, 12, 0.0f, 1, 0);
    assert_int_equal(tera_batch_accum(&t, &b, 0), 8);
    t = tcfg(3, 1, 0, 0.0f, 1, 0); /* no ramp steps: nothing to ramp over */
    assert_int_equal(tera_batch_accum(&t, &b, 0), 3);
}

static void test_growth(void **state) {
    (void)state;
    tera_batch_state b;
    tera_batch_init(&b);
    tera_train_config t = tcfg(2, 1, 4, 1.0f, 3, 0); /* cap 0 = 4 x grad_accum = 8 */
    double mean = -1;
    /* ramping up: not observed */
    for (int s = 0; s < 4; s++) assert_int_equal(tera_batch_observe(&t, &b, s, 100.0, &mean), 0);
    assert_int_equal(b.window_n, 0);
    /* a quiet window: no growth, the window restarts */
    for (int s = 4; s < 7; s++) assert_int_equal(tera_batch_observe(&t, &b, s, 0.5, &mean), 0);
    assert_int_equal(b.window_n, 0);
    assert_int_equal(tera_batch_accum(&t, &b, 7), 2);
    /* mean (0.5 + 1.5 + 2.0) / 3 = 1.333 > 1: doubles from the next step on */
    assert_int_equal(tera_batch_observe(&t, &b, 7, 0.5, &mean), 0);
    assert_int_equal(tera_batch_observe(&t, &b, 8, 1.5, &mean), 0);
    assert_int_equal(tera_batch_observe(&t, &b, 9, 2.0, &mean), 1);
    assert_true(fabs(mean - 4.0 / 3.0) < 1e-12);
    assert_int_equal(b.grow, 2);
    assert_int_equal(tera_batch_accum(&t, &b, 10), 4);
    /* mean exactly at the threshold does not grow */
    for (int s = 10; s < 13; s++) assert_int_equal(tera_batch_observe(&t, &b, s, 1.0, NULL), 0);
    for (int s = 13; s < 16; s++) tera_batch_observe(&t, &b, s, 3.0, NULL);
    assert_int_equal(tera_batch_accum(&t, &b, 16), 8);
    /* at the cap: no more growth, nothing accumulates */
    for (int s = 16; s < 22; s++) assert_int_equal(tera_batch_observe(&t, &b, s, 3.0, NULL), 0);
    assert_int_equal(b.window_n, 0);
    assert_int_equal(tera_batch_accum(&t, &b, 22), 8);
    /* a cap that is no power-of-2 multiple clamps the last doubling: 3, 6, 8 */
    t = tcfg(3, 0, 0, 1.0f, 1, 8);
    tera_batch_init(&b);
    assert_int_equal(tera_batch_accum(&t, &b, 0), 3);
    assert_int_equal(tera_batch_observe(&t, &b, 0, 2.0, NULL), 1);
    assert_int_equal(tera_batch_accum(&t, &b, 1), 6);
    assert_int_equal(tera_batch_observe(&t, &b, 1, 2.0, NULL), 1);
    assert_int_equal(tera_batch_accum(&t, &b, 2), 8);
    assert_int_equal(tera_batch_observe(&t, &b, 2, 2.0, NULL), 0);
    /* the ramp and the growth combine: a grown run resumed inside a (new) ramp multiplies it */
    t = tcfg(4, 1, 8, 1.0f, 1, 16);
    b.grow = 2;
    assert_int_equal(tera_batch_accum(&t, &b, 0), 2);
    assert_int_equal(tera_batch_accum(&t, &b, 8), 8);
    /* off */
    t = tcfg(4, 0, 0, 0.0f, 1, 0);
    tera_batch_init(&b);
    assert_int_equal(tera_batch_observe(&t, &b, 0, 1e9, NULL), 0);
    assert_int_equal(b.window_n, 0);
}

static void test_lr_rule(void **state) {
    (void)state;
    tera_train_config t = tcfg(8, 2, 10, 0.0f, 1, 0);
    t.batch_lr_scaling = TERA_BATCH_LR_SQRT;
    assert_true(tera_batch_lr_factor(&t, 8) == 1.0f); /* exactly: the full batch keeps the schedule's LR */
    assert_true(fabsf(tera_batch_lr_factor(&t, 2) - 0.5f) < 1e-7f);
    assert_true(fabsf(tera_batch_lr_factor(&t, 32) - 2.0f) < 1e-7f);
    t.batch_lr_scaling = TERA_BATCH_LR_LINEAR;
    assert_true(fabsf(tera_batch_lr_factor(&t, 2) - 0.25f) < 1e-7f);
    assert_true(fabsf(tera_batch_lr_factor(&t, 16) - 2.0f) < 1e-7f);
    t.batch_lr_scaling = TERA_BATCH_LR_NONE;
    assert_true(tera_batch_lr_factor(&t, 2) == 1.0f);
}

static void test_config_checks(void **state) {
    (void)state;
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(tera_config_set(&c, "training.grad_accum=4"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "training.batch_rampup_start=5"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "training.batch_rampup_start (5)"));
    assert_int_equal(tera_config_set(&c, "training.batch_rampup_start=1"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "training.batch_rampup_steps > 0"));
    assert_int_equal(tera_config_set(&c, "training.batch_rampup_steps=10"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "training.batch_grow_max=3"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "training.batch_grow_max (3)"));
    assert_int_equal(tera_config_set(&c, "training.batch_grow_max=0"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "training.batch_lr_scaling=linear"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    assert_int_equal(c.training.batch_lr_scaling, TERA_BATCH_LR_LINEAR);
    assert_int_equal(tera_config_set(&c, "training.batch_lr_scaling=cubic"), TERA_ERR_CONFIG);
}

static void tiny(tera_config *c, int steps) {
    tera_config_defaults(c);
    const char *kv[] = {"model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_experts=4",
                        "model.ffn_dim=32", "training.seq_len=16", "training.micro_batch=2", "training.threads=2",
                        "training.warmup_steps=2", "training.grad_accum=4", "training.batch_rampup_start=1",
                        "training.batch_rampup_steps=5", "training.batch_grow_gnorm=0.01",
                        "training.batch_grow_window=2", "training.batch_grow_max=8", "training.spike_window=3",
                        "training.spike_zscore=1e6", "training.spike_grad_zscore=1e6", "training.spike_lr_factor=0.25",
                        "logging.progress=false", "checkpoint.keep=0", "checkpoint.async=false"};
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) assert_int_equal(tera_config_set(c, kv[i]), TERA_OK);
    c->training.steps = steps;
    assert_int_equal(tera_config_finalize(c), TERA_OK);
}

/* Data accounting: the position advances by each step's actual batch, which follows the schedule. */
static void test_trainer_accounting(void **state) {
    (void)state;
    tera_config c;
    tiny(&c, 12);
    tera_trainer tr;
    assert_int_equal(tera_trainer_init(&tr, &c, "", 0), TERA_OK);
    int64_t sum = 0;
    int grew = 0;
    for (int s = 0; s < 12; s++) {
        tera_step_result r;
        const tera_batch_state before = tr.batch;
        const int want = tera_batch_accum(&c.training, &before, s);
        assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
        assert_int_equal(r.accum, want);
        assert_int_equal(r.batch_seqs, (int64_t)want * 2);
        assert_true(r.lr == tera_lr_at(&c.training, s) * tera_batch_lr_factor(&c.training, want));
        sum += r.batch_seqs;
        grew |= tr.batch.grow > 1;
    }
    assert_int_equal(tr.samples_consumed, sum);
    assert_true(grew); /* the threshold is tiny: the run grew to 8 */
    assert_int_equal(tera_batch_accum(&c.training, &tr.batch, 12), 8);
    tera_trainer_free(&tr);
}

/* A batch that would touch a skipped data window starts after it, whatever its alignment, and
 * after all windows it then touches (in any order). */
static void test_skip_unaligned(void **state) {
    (void)state;
    tera_config c;
    tiny(&c, 12);
    c.training.batch_rampup_start = 0, c.training.batch_grow_gnorm = 0.0f; /* 4 x 2 = 8 sequences per step */
    tera_trainer tr;
    assert_int_equal(tera_trainer_init(&tr, &c, "", 0), TERA_OK);
    tera_step_result r;
    assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
    const int64_t c0 = tr.samples_consumed;
    tr.spike.skip_lo[0] = c0 + 3, tr.spike.skip_hi[0] = c0 + 5, tr.spike.n_skips = 1;
    assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
    assert_int_equal(tr.samples_consumed, c0 + 5 + 8);
    const int64_t c1 = tr.samples_consumed;
    tr.spike.skip_lo[1] = c1 + 8, tr.spike.skip_hi[1] = c1 + 12, tr.spike.skip_lo[2] = c1 + 2, tr.spike.skip_hi[2] = c1 + 8, tr.spike.n_skips = 3;
    assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
    assert_int_equal(tr.samples_consumed, c1 + 12 + 8);
    assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK); /* clear of every window: no jump */
    assert_int_equal(tr.samples_consumed, c1 + 12 + 16);
    tera_trainer_free(&tr);
}

/* state.json: the batch and guard state survive a save + resume into a fresh trainer; a data
 * window ahead is still skipped and the LR cut still applied; a rollback merges newer windows. */
static void test_resume_state(void **state) {
    (void)state;
    char run[400];
    snprintf(run, sizeof run, "%s/r", g_dir);
    tera_config c;
    tiny(&c, 20);
    tera_trainer a;
    assert_int_equal(tera_trainer_init(&a, &c, run, 1), TERA_OK);
    tera_step_result r;
    for (int s = 0; s < 6; s++) assert_int_equal(tera_trainer_step(&a, &r), TERA_OK);
    assert_int_equal(a.spike.n, 3);
    assert_true(a.batch.window_n == 1); /* mid-window: steps 5 observed, window of 2 */
    const int64_t at = a.samples_consumed, ahead = at + 8 + 16; /* where step 8 starts (step 6: 4 x 2, 7: 8 x 2) */
    a.spike.skip_lo[0] = ahead, a.spike.skip_hi[0] = ahead + 5, a.spike.n_skips = 1;
    a.spike.lr_cut_until = 8, a.spike.events = 1, a.spike.last_spike_step = 4, a.spike.repeats = 1;
    assert_int_equal(tera_trainer_save(&a), TERA_OK);
    assert_int_equal(tera_trainer_ckpt_close(&a), TERA_OK);

    tera_trainer b;
    assert_int_equal(tera_trainer_init(&b, &c, run, 1), TERA_OK);
    assert_int_equal(tera_trainer_resume(&b), TERA_OK);
    assert_int_equal(b.step, 6);
    assert_int_equal(b.samples_consumed, at);
    assert_int_equal(b.batch.grow, a.batch.grow);
    assert_int_equal(b.batch.window_n, a.batch.window_n);
    assert_true(b.batch.window_sum == a.batch.window_sum); /* bit for bit */
    assert_int_equal(b.spike.n, a.spike.n);
    assert_int_equal(b.spike.pos, a.spike.pos);
    assert_memory_equal(b.spike.hist, a.spike.hist, sizeof(double) * 2 * 3);
    assert_int_equal(b.spike.n_skips, 1);
    assert_true(b.spike.skip_lo[0] == ahead && b.spike.skip_hi[0] == ahead + 5);
    assert_true(b.spike.lr_cut_until == 8 && b.spike.events == 1 && b.spike.last_spike_step == 4 && b.spike.repeats == 1);
    /* both continue alike: the LR cut applies to steps 6 and 7, the window is jumped over */
    int jumped = 0;
    for (int s = 6; s < 10; s++) {
        tera_step_result ra, rb;
        const int64_t pa = a.samples_consumed;
        assert_int_equal(tera_trainer_step(&a, &ra), TERA_OK);
        assert_int_equal(tera_trainer_step(&b, &rb), TERA_OK);
        assert_true(ra.loss == rb.loss && ra.lr == rb.lr && ra.grad_norm == rb.grad_norm);
        const float base = tera_lr_at(&c.training, s) * tera_batch_lr_factor(&c.training, rb.accum);
        assert_true(rb.lr == (s < 8 ? base * 0.25f : base));
        if (pa == ahead) assert_int_equal(a.samples_consumed, ahead + 5 + rb.batch_seqs), jumped = 1; /* skipped */
        assert_int_equal(a.samples_consumed, b.samples_consumed);
    }
    assert_true(jumped);
    /* rollback: b knows a newer window (below the other) and a later LR cut; resuming the older
     * checkpoint keeps them and merges the windows in increasing order */
    b.spike.skip_lo[1] = at + 1, b.spike.skip_hi[1] = at + 2, b.spike.n_skips = 2, b.spike.lr_cut_until = 50;
    assert_int_equal(tera_trainer_resume(&b), TERA_OK);
    assert_int_equal(b.step, 6);
    assert_int_equal(b.spike.n_skips, 2);
    assert_true(b.spike.skip_lo[0] == ahead && b.spike.skip_lo[1] == at + 1); /* in memory: as they were */
    tera_trainer d;
    assert_int_equal(tera_trainer_init(&d, &c, run, 1), TERA_OK);
    d.spike.skip_lo[0] = at + 1, d.spike.skip_hi[0] = at + 2, d.spike.n_skips = 1, d.spike.lr_cut_until = 50;
    assert_int_equal(tera_trainer_resume(&d), TERA_OK);
    assert_int_equal(d.spike.n_skips, 2);
    assert_true(d.spike.skip_lo[0] == at + 1 && d.spike.skip_lo[1] == ahead && d.spike.lr_cut_until == 50);
    tera_trainer_free(&a);
    tera_trainer_free(&b);
    tera_trainer_free(&d);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tera-test-batch-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ramp),          cmocka_unit_test(test_growth),
        cmocka_unit_test(test_lr_rule),       cmocka_unit_test(test_config_checks),
        cmocka_unit_test(test_trainer_accounting), cmocka_unit_test(test_skip_unaligned),
        cmocka_unit_test(test_resume_state),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
