/* Checkpoints through the library: async save + resume bit-identical, differential round trip,
 * COMMIT required, verify finds damage, frozen-state differential is small. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tera/ckpt.h"
#include "tera/train.h"

static char g_dir[256];

static void tiny_cfg(tera_config *c, int steps, int every) {
    tera_config_defaults(c);
    assert_int_equal(tera_config_set(c, "model.dim=32"), TERA_OK);
    assert_int_equal(tera_config_set(c, "model.n_layers=2"), TERA_OK);
    assert_int_equal(tera_config_set(c, "model.n_heads=4"), TERA_OK);
    assert_int_equal(tera_config_set(c, "model.n_experts=4"), TERA_OK);
    assert_int_equal(tera_config_set(c, "model.ffn_dim=32"), TERA_OK);
    assert_int_equal(tera_config_set(c, "training.seq_len=32"), TERA_OK);
    assert_int_equal(tera_config_set(c, "training.micro_batch=2"), TERA_OK);
    assert_int_equal(tera_config_set(c, "training.threads=2"), TERA_OK);
    assert_int_equal(tera_config_set(c, "logging.progress=false"), TERA_OK);
    assert_int_equal(tera_config_set(c, "checkpoint.keep=0"), TERA_OK);
    c->training.warmup_steps = 2;
    c->training.steps = steps;
    c->checkpoint.every = every;
    if (tera_config_finalize(c) != TERA_OK) fprintf(stderr, "%s\n", tera_last_error());
    assert_int_equal(tera_config_finalize(c), TERA_OK);
}

static void run_to(const char *run, int steps, int every, int resume, int full_every, tera_trainer *tr) {
    tera_config c;
    tiny_cfg(&c, steps, every);
    char env[16];
    snprintf(env, sizeof env, "%d", full_every);
    setenv("TERA_CKPT_FULL_EVERY", env, 1);
    assert_int_equal(tera_trainer_init(tr, &c, run, 1), TERA_OK);
    if (resume) assert_int_equal(tera_trainer_resume(tr), TERA_OK);
    assert_int_equal(tera_trainer_run(tr, NULL), TERA_OK);
    assert_int_equal(tera_trainer_ckpt_close(tr), TERA_OK);
    assert_null(tr->ckpt);
}

static void test_async_resume_identical(void **state) {
    (void)state;
    char a[400], b[400], dir[500];
    snprintf(a, sizeof a, "%s/a", g_dir);
    snprintf(b, sizeof b, "%s/b", g_dir);
    tera_trainer ta, tb;
    run_to(a, 9, 3, 0, 0, &ta);
    const tera_ckpt_stats st = tera_ckpt_last_stats();
    assert_true(st.saves >= 3);
    assert_true(tera_ckpt_last_pause_seconds() >= 0.0);
    /* b: differential saves every other time; drop the final checkpoint, resume from step 6 (a diff) */
    run_to(b, 9, 3, 0, 2, &tb);
    tera_trainer_free(&tb);
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000006", b);
    assert_true(tera_ckpt_committed(dir));
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000009", b);
    assert_int_equal(tera_ckpt_rmtree(dir), TERA_OK);
    run_to(b, 9, 3, 1, 2, &tb);
    assert_int_equal(ta.step, tb.step);
    assert_memory_equal(ta.model.w, tb.model.w, sizeof(float) * (size_t)ta.model.n_floats);
    /* Adam moments: of the non-expert region (opt) and of the experts (opt_x) */
    assert_int_equal(ta.opt.n + ta.opt_x.n, ta.model.n_floats);
    assert_memory_equal(ta.opt.m, tb.opt.m, sizeof(float) * (size_t)ta.opt.n);
    assert_memory_equal(ta.opt.v, tb.opt.v, sizeof(float) * (size_t)ta.opt.n);
    assert_memory_equal(ta.opt_x.m, tb.opt_x.m, sizeof(float) * (size_t)ta.opt_x.n);
    assert_memory_equal(ta.opt_x.v, tb.opt_x.v, sizeof(float) * (size_t)ta.opt_x.n);
    /* load a differential checkpoint directly: equals the full one of the other run */
    tera_ckpt_info *v;
    int n;
    snprintf(dir, sizeof dir, "%s/checkpoints", b);
    assert_int_equal(tera_ckpt_list(dir, &v, &n), TERA_OK);
    int diffs = 0;
    for (int i = 0; i < n; i++) diffs += v[i].committed && !v[i].full;
    free(v);
    assert_true(diffs >= 1);
    tera_trainer_free(&ta);
    tera_trainer_free(&tb);
}

static void test_commit_required_and_verify(void **state) {
    (void)state;
    char run[400], dir[500], path[600], out[600];
    snprintf(run, sizeof run, "%s/c", g_dir);
    tera_trainer t;
    run_to(run, 4, 2, 0, 0, &t);
    tera_trainer_free(&t);
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000004", run);
    assert_int_equal(tera_ckpt_verify(dir, NULL), TERA_OK);
    /* without COMMIT the newest checkpoint is ignored */
    snprintf(path, sizeof path, "%s/COMMIT", dir);
    assert_int_equal(unlink(path), 0);
    assert_false(tera_ckpt_committed(dir));
    assert_int_not_equal(tera_ckpt_verify(dir, NULL), TERA_OK);
    assert_int_equal(tera_ckpt_find_latest(run, out, sizeof out), TERA_OK);
    assert_non_null(strstr(out, "step_00000002"));
    /* a flipped byte is named */
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000002", run);
    snprintf(path, sizeof path, "%s/state.json", dir);
    FILE *f = fopen(path, "r+");
    assert_non_null(f);
    fputc('#', f);
    fclose(f);
    assert_int_equal(tera_ckpt_verify(dir, NULL), TERA_ERR_FORMAT);
    char rep[4096] = "";
    FILE *r = fmemopen(rep, sizeof rep - 1, "w");
    tera_ckpt_verify(dir, r);
    fclose(r);
    assert_non_null(strstr(rep, "state.json"));
    assert_int_not_equal(tera_ckpt_find_latest(run, out, sizeof out), TERA_OK);
}

/* An unchanged state gives a differential checkpoint with no chunks: the saving on frozen weights. */
static void test_frozen_diff_small(void **state) {
    (void)state;
    char run[400];
    snprintf(run, sizeof run, "%s/f", g_dir);
    tera_config c;
    tiny_cfg(&c, 4, 0);
    setenv("TERA_CKPT_FULL_EVERY", "4", 1);
    setenv("TERA_CKPT_ASYNC", "0", 1);
    tera_trainer t;
    assert_int_equal(tera_trainer_init(&t, &c, run, 1), TERA_OK);
    assert_int_equal(tera_trainer_save(&t), TERA_OK); /* step 0: full */
    tera_ckpt_stats s0 = tera_ckpt_last_stats();
    assert_true(s0.last_full);
    t.step = 1; /* same state, next step: differential with nothing changed */
    assert_int_equal(tera_trainer_save(&t), TERA_OK);
    tera_ckpt_stats s1 = tera_ckpt_last_stats();
    assert_false(s1.last_full);
    assert_int_equal(s1.last_chunks_changed, 0);
    assert_true(s1.last_bytes * 4 < s0.last_bytes);
    t.model.w[0] += 1.0f; /* one changed chunk */
    t.step = 2;
    assert_int_equal(tera_trainer_save(&t), TERA_OK);
    assert_int_equal(tera_ckpt_last_stats().last_chunks_changed, 1);
    float w0 = t.model.w[0];
    assert_int_equal(tera_trainer_ckpt_close(&t), TERA_OK);
    tera_trainer_free(&t);
    /* load step 2 (base + diff) into a fresh model */
    tera_trainer u;
    assert_int_equal(tera_trainer_init(&u, &c, "", 0), TERA_OK);
    char dir[500];
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000002", run);
    float *mv = calloc(2 * (size_t)u.model.n_floats, sizeof(float));
    assert_int_equal(tera_ckpt_load(dir, &u.model, mv, mv + u.model.n_floats), TERA_OK);
    assert_true(u.model.w[0] == w0);
    free(mv);
    tera_trainer_free(&u);
    unsetenv("TERA_CKPT_ASYNC");
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tera-test-ckpt-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_async_resume_identical),
        cmocka_unit_test(test_commit_required_and_verify),
        cmocka_unit_test(test_frozen_diff_small),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
