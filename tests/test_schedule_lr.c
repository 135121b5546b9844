/* LR schedules (training.lr_schedule = cosine | linear | wsd, decay_fraction, decay_shape) through
 * the formulas of docs/SCHEDULES.md: values at hand-computed steps, the default cosine equal bit for
 * bit to MODEL.md's formula, long warmups, monotonicity, and the config keys; fp16's fixed loss
 * scale (training.loss_scaling = fixed). */
#include "testutil.h"

#include "tera/config.h"
#include "tera/precision.h"
#include "tera/train.h"

static tera_train_config sched(int S, int W, float lr, float min_lr, tera_lr_schedule k, float frac,
                               tera_decay_shape shape) {
    tera_config c;
    tera_config_defaults(&c);
    tera_train_config t = c.training;
    t.steps = S, t.warmup_steps = W, t.lr = lr, t.min_lr = min_lr;
    t.lr_schedule = k, t.decay_fraction = frac, t.decay_shape = shape;
    return t;
}

static void near(double got, double want, const char *what, int s) {
    if (!(fabs(got - want) <= 1e-6 * fabs(want) + 1e-12)) fail_msg("%s step %d: lr %.9g, want %.9g", what, s, got, want);
}

/* The default is MODEL.md's cosine, bit for bit (the expression MODEL.md states, evaluated as before). */
static void test_cosine_default(void **state) {
    (void)state;
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(c.training.lr_schedule, TERA_LR_COSINE);
    const tera_train_config t = sched(100, 10, 3e-3f, 3e-4f, TERA_LR_COSINE, 0.2f, TERA_DECAY_LINEAR);
    for (int s = 0; s < 110; s++) {
        float want;
        if (s < 10) want = t.lr * (float)(s + 1) / 10.0f;
        else {
            double p = (double)(s - 10) / 90.0;
            if (p > 1.0) p = 1.0;
            want = (float)(t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + cos(M_PI * p)));
        }
        const float got = tera_lr_at(&t, s);
        assert_memory_equal(&got, &want, sizeof got);
    }
    near(tera_lr_at(&t, 55), 3e-4 + 0.5 * 2.7e-3 * (1 + cos(M_PI * 0.5)), "cosine midpoint", 55); /* 1.65e-3 */
}

static void test_linear(void **state) {
    (void)state;
    const tera_train_config t = sched(110, 10, 1.0f, 0.1f, TERA_LR_LINEAR, 0.2f, TERA_DECAY_LINEAR);
    near(tera_lr_at(&t, 0), 0.1, "linear warmup", 0);
    near(tera_lr_at(&t, 9), 1.0, "linear warmup end", 9);
    near(tera_lr_at(&t, 10), 1.0, "linear start", 10);
    near(tera_lr_at(&t, 35), 0.1 + 0.9 * 0.75, "linear quarter", 35);
    near(tera_lr_at(&t, 60), 0.55, "linear half", 60);
    near(tera_lr_at(&t, 110), 0.1, "linear end", 110);
    near(tera_lr_at(&t, 500), 0.1, "linear after the end", 500);
    for (int s = 10; s < 110; s++) assert_true(tera_lr_at(&t, s + 1) <= tera_lr_at(&t, s));
}

/* S = 100, W = 10, decay_fraction 0.2: stable until step 80, then to min_lr at step 100. */
static void test_wsd(void **state) {
    (void)state;
    const tera_decay_shape shapes[3] = {TERA_DECAY_LINEAR, TERA_DECAY_COSINE, TERA_DECAY_SQRT};
    const double at_q25[3] = {0.75, 0.5 * (1 + cos(M_PI * 0.25)), 0.5}; /* shape(0.25) */
    for (int i = 0; i < 3; i++) {
        const tera_train_config t = sched(100, 10, 2.0f, 0.2f, TERA_LR_WSD, 0.2f, shapes[i]);
        near(tera_lr_at(&t, 4), 2.0 * 5 / 10, "wsd warmup", 4);
        for (int s = 10; s <= 80; s++) near(tera_lr_at(&t, s), 2.0, "wsd stable", s);
        near(tera_lr_at(&t, 85), 0.2 + 1.8 * at_q25[i], "wsd decay q=0.25", 85);
        near(tera_lr_at(&t, 100), 0.2, "wsd end", 100);
        for (int s = 80; s < 100; s++) assert_true(tera_lr_at(&t, s + 1) <= tera_lr_at(&t, s));
    }
    /* a decay longer than what the warmup leaves starts at the warmup's end */
    const tera_train_config t = sched(100, 30, 1.0f, 0.0f, TERA_LR_WSD, 0.9f, TERA_DECAY_LINEAR);
    near(tera_lr_at(&t, 29), 1.0, "wsd long decay: warmup end", 29);
    near(tera_lr_at(&t, 30), 1.0, "wsd long decay: start", 30);
    near(tera_lr_at(&t, 65), 0.5, "wsd long decay: half", 65);
    /* decay_fraction 0: constant after the warmup, min_lr only at the end */
    const tera_train_config c = sched(100, 5, 1.0f, 0.0f, TERA_LR_WSD, 0.0f, TERA_DECAY_LINEAR);
    near(tera_lr_at(&c, 99), 1.0, "wsd no decay", 99);
    near(tera_lr_at(&c, 100), 0.0, "wsd no decay: after the end", 100);
}

/* Long warmups: W = S (the whole run warms up), W = S - 1, W = 0; every schedule. */
static void test_long_warmup(void **state) {
    (void)state;
    const tera_lr_schedule ks[3] = {TERA_LR_COSINE, TERA_LR_LINEAR, TERA_LR_WSD};
    for (int i = 0; i < 3; i++) {
        tera_train_config t = sched(2000, 2000, 1e-3f, 1e-4f, ks[i], 0.2f, TERA_DECAY_SQRT);
        for (int s = 0; s < 2000; s++) near(tera_lr_at(&t, s), 1e-3 * (s + 1) / 2000.0, "warmup W=S", s);
        for (int s = 0; s + 1 < 2000; s++) assert_true(tera_lr_at(&t, s + 1) > tera_lr_at(&t, s));
        t = sched(2000, 1999, 1e-3f, 1e-4f, ks[i], 0.2f, TERA_DECAY_SQRT);
        near(tera_lr_at(&t, 1998), 1e-3, "warmup W=S-1 end", 1998);
        near(tera_lr_at(&t, 1999), 1e-3, "first step after a long warmup", 1999);
        t = sched(100, 0, 1e-3f, 1e-4f, ks[i], 0.2f, TERA_DECAY_LINEAR);
        near(tera_lr_at(&t, 0), 1e-3, "no warmup", 0);
        for (int s = 0; s < 100; s++) assert_true(isfinite(tera_lr_at(&t, s)) && tera_lr_at(&t, s) >= 1e-4f * 0.999f);
    }
}

static void test_keys(void **state) {
    (void)state;
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(tera_config_set(&c, "training.lr_schedule=wsd"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "training.decay_fraction=0.1"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "training.decay_shape=sqrt"), TERA_OK);
    assert_int_equal(c.training.lr_schedule, TERA_LR_WSD);
    assert_int_equal(c.training.decay_shape, TERA_DECAY_SQRT);
    assert_true(c.training.decay_fraction == 0.1f);
    assert_int_equal(tera_config_set(&c, "training.lr_schedule=linear"), TERA_OK);
    assert_int_equal(c.training.lr_schedule, TERA_LR_LINEAR);
    assert_int_not_equal(tera_config_set(&c, "training.lr_schedule=step"), TERA_OK);
    assert_int_not_equal(tera_config_set(&c, "training.decay_fraction=1.5"), TERA_OK);
    assert_int_equal(c.training.loss_scaling, 0);
    assert_int_equal(tera_config_set(&c, "training.loss_scaling=fixed"), TERA_OK);
    assert_int_equal(c.training.loss_scaling, 1);
    assert_int_equal(c.model.balance_loss, TERA_BALANCE_SWITCH);
    assert_int_equal(tera_config_set(&c, "model.balance_loss=importance_load"), TERA_OK);
    assert_int_equal(c.model.balance_loss, TERA_BALANCE_IMPORTANCE_LOAD);
}

/* A fixed scale never changes: overflows are counted (and the update skipped: -1), clean steps
 * never double it; the dynamic scaler with the same start does change. */
static void test_fixed_loss_scale(void **state) {
    (void)state;
    tera_loss_scaler f, d;
    tera_scaler_init(&f, 1024.0f, 0);
    tera_scaler_init(&d, 1024.0f, 3);
    assert_true(f.fixed && !d.fixed);
    const int finite[10] = {1, 1, 1, 1, 0, 1, 1, 1, 0, 0};
    int skipped = 0;
    for (int i = 0; i < 10; i++) {
        const int rf = tera_scaler_update(&f, finite[i]);
        tera_scaler_update(&d, finite[i]);
        assert_true(f.scale == 1024.0f);
        assert_int_equal(rf, finite[i] ? 0 : -1);
        skipped += rf < 0;
    }
    assert_int_equal(skipped, 3);
    assert_int_equal(f.overflows, 3);
    assert_true(d.scale != 1024.0f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cosine_default), cmocka_unit_test(test_linear), cmocka_unit_test(test_wsd),
        cmocka_unit_test(test_long_warmup),    cmocka_unit_test(test_keys), cmocka_unit_test(test_fixed_loss_scale),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
