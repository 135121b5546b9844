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

#include <math.h>
#include <sys/stat.h>

#include "tera/ckpt.h"
#include "tera/io.h"
#include "tera/train.h"
#include "tera/zero.h"

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
    assert_null(tr->ckpt.whole);
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
    assert_int_equal(ta.sharding->opt.n + ta.sharding->opt_x.n, ta.model.n_floats);
    assert_memory_equal(ta.sharding->opt.m, tb.sharding->opt.m, sizeof(float) * (size_t)ta.sharding->opt.n);
    assert_memory_equal(ta.sharding->opt.v, tb.sharding->opt.v, sizeof(float) * (size_t)ta.sharding->opt.n);
    assert_memory_equal(ta.sharding->opt_x.m, tb.sharding->opt_x.m, sizeof(float) * (size_t)ta.sharding->opt_x.n);
    assert_memory_equal(ta.sharding->opt_x.v, tb.sharding->opt_x.v, sizeof(float) * (size_t)ta.sharding->opt_x.n);
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

static int exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* A checkpoint whose COMMIT is there but a file it names is not (half removed by an older
 * retention, or by hand) is not committed: ls says so, --resume takes the one before without
 * re-hashing it, the next save removes it. Retention renames a checkpoint to .deleting before
 * removing its files; such a leftover is not listed as committed and is cleaned up too. */
static void test_half_removed_skipped(void **state) {
    (void)state;
    char run[400], dir[500], path[600], out[600], gone[600];
    snprintf(run, sizeof run, "%s/h", g_dir);
    tera_trainer t;
    run_to(run, 4, 2, 0, 0, &t);
    tera_trainer_free(&t);
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000004", run);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_true(tera_ckpt_committed(dir));
    assert_int_equal(unlink(path), 0);
    assert_false(tera_ckpt_committed(dir));
    char root[500];
    snprintf(root, sizeof root, "%s/checkpoints", run);
    tera_ckpt_info *v;
    int n;
    assert_int_equal(tera_ckpt_list(root, &v, &n), TERA_OK);
    assert_int_equal(n, 2);
    assert_true(v[0].committed && v[0].step == 2);
    assert_false(v[1].committed);
    free(v);
    assert_int_equal(tera_ckpt_find_latest(run, out, sizeof out), TERA_OK);
    assert_non_null(strstr(out, "step_00000002"));
    /* tera_ckpt_remove: renamed away (a crash after the rename leaves only a .deleting leftover) */
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000002", run);
    snprintf(gone, sizeof gone, "%s.deleting", dir);
    assert_int_equal(rename(dir, gone), 0);
    assert_int_equal(tera_ckpt_list(root, &v, &n), TERA_OK);
    assert_int_equal(n, 2);
    assert_string_equal(v[0].name, "step_00000002.deleting");
    assert_false(v[0].committed || v[1].committed);
    free(v);
    assert_int_not_equal(tera_ckpt_find_latest(run, out, sizeof out), TERA_OK);
    assert_int_equal(rename(gone, dir), 0);
    assert_int_equal(tera_ckpt_remove(dir), TERA_OK);
    assert_false(exists(dir) || exists(gone));
    /* the next save (a fresh run over the same directory) removes both leftovers */
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000004", run);
    assert_true(exists(dir));
    assert_int_equal(mkdir(gone, 0755), 0);
    run_to(run, 2, 2, 0, 0, &t);
    tera_trainer_free(&t);
    assert_false(exists(dir) || exists(gone));
    snprintf(dir, sizeof dir, "%s/checkpoints/step_00000002", run);
    assert_true(tera_ckpt_committed(dir));
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

/* metrics.jsonl after a crash or a full disk: cut back to the complete JSON lines. */
static void test_jsonl_repair(void **state) {
    (void)state;
    char path[400], *text = NULL;
    long dropped = -1;
    snprintf(path, sizeof path, "%s/m.jsonl", g_dir);
    assert_int_equal(tera_jsonl_repair(path, &dropped), TERA_OK); /* missing: nothing to do */
    assert_int_equal(dropped, 0);
    write_text(path, "{\"step\": 0}\n{\"step\": 1}\n");
    assert_int_equal(tera_jsonl_repair(path, &dropped), TERA_OK);
    assert_int_equal(dropped, 0);
    write_text(path, "{\"step\": 0}\n{\"step\": 1}\n{\"step\": 2, \"lo");
    assert_int_equal(tera_jsonl_repair(path, &dropped), TERA_OK);
    assert_int_equal(dropped, 15);
    assert_int_equal(tera_read_text_file(path, &text), TERA_OK);
    assert_string_equal(text, "{\"step\": 0}\n{\"step\": 1}\n");
    free(text);
    /* the history before the last good line is kept as it is (an older tera's bare nan) */
    write_text(path, "{\"step\": 0}\n{\"step\": 1, \"loss\": nan}\n{\"step\": 2}\n");
    assert_int_equal(tera_jsonl_repair(path, &dropped), TERA_OK);
    assert_int_equal(dropped, 0);
    /* a complete last line that does not parse goes too */
    write_text(path, "{\"step\": 0}\n{\"step\": 1, \"loss\": nan}\n{\"step\": 2, \"lo\n{\"st");
    assert_int_equal(tera_jsonl_repair(path, &dropped), TERA_OK);
    assert_int_equal(tera_read_text_file(path, &text), TERA_OK);
    assert_string_equal(text, "{\"step\": 0}\n");
    free(text);
    /* nothing complete at all: emptied */
    write_text(path, "{\"step\": 0");
    assert_int_equal(tera_jsonl_repair(path, &dropped), TERA_OK);
    assert_int_equal(dropped, 10);
    /* a long file: the search window grows past 64 KiB of the tail (one torn line of 100 KB) */
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 1000; i++) fprintf(f, "{\"step\": %d}\n", i);
    const long keep = ftell(f);
    fputs("{\"x\": \"", f);
    for (int i = 0; i < 100000; i++) fputc('a', f);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(tera_jsonl_repair(path, &dropped), TERA_OK);
    assert_int_equal(dropped, 100007);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_size, keep);
    /* a device is written to, never cut */
    assert_int_equal(tera_jsonl_repair("/dev/null", &dropped), TERA_OK);
    assert_int_equal(dropped, 0);
}

static void test_json_num(void **state) {
    (void)state;
    char b[64];
    assert_string_equal(tera_json_num(b, sizeof b, "%.7g", NAN), "null");
    assert_string_equal(tera_json_num(b, sizeof b, "%.7g", INFINITY), "null");
    assert_string_equal(tera_json_num(b, sizeof b, "%.7g", -INFINITY), "null");
    assert_string_equal(tera_json_num(b, sizeof b, "%.4f", 1.5), "1.5000");
}

/* One holder per run directory; the refusal names the holder's pid; the release leaves nothing. */
static void test_run_lock(void **state) {
    (void)state;
    char dir[400], msg[64];
    snprintf(dir, sizeof dir, "%s/locked/run", g_dir);
    tera_run_lock a, b;
    assert_int_equal(tera_run_lock_acquire(&a, dir), TERA_OK);
    assert_true(a.created_dir);
    assert_int_equal(tera_run_lock_acquire(&b, dir), TERA_ERR_EXISTS); /* flock: per open file */
    snprintf(msg, sizeof msg, "(pid %ld)", (long)getpid());
    assert_non_null(strstr(tera_last_error(), msg));
    assert_true(exists(dir)); /* the refused one does not remove the holder's directory */
    tera_run_lock_release(&b);
    tera_run_lock_release(&a);
    assert_false(exists(dir)); /* created by the acquire, empty: removed */
    assert_int_equal(tera_mkdirs(dir), TERA_OK);
    assert_int_equal(tera_run_lock_acquire(&a, dir), TERA_OK);
    assert_false(a.created_dir);
    tera_run_lock_release(&a);
    assert_true(exists(dir)); /* it was there before: kept */
    char lockfile[500];
    snprintf(lockfile, sizeof lockfile, "%s/%s", dir, TERA_RUN_LOCK_NAME);
    assert_false(exists(lockfile));
}

/* A sharded manifest the reader refuses after it has named a file (a piece short of its tensor, or
 * a coordinate out of range): an error naming the tensor, no crash in the reader's clean-up (it
 * used to close file descriptors it had not allocated yet). */
static void test_sharded_manifest_refused(void **state) {
    (void)state;
    tera_config c;
    tiny_cfg(&c, 2, 0);
    tera_model m;
    assert_int_equal(tera_model_create(&m, &c.model, 1, 4), TERA_OK);
    const tera_param *p = &m.params[0];
    assert_int_equal(p->ndim, 2);
    char dir[400], path[500], text[1024];
    snprintf(dir, sizeof dir, "%s/bad_sharded/step_00000002", g_dir);
    assert_int_equal(tera_mkdirs(dir), TERA_OK);
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    static const char *const lo_len[] = {"[0, 0], \"len\": [1, %lld]", "[-5, 0], \"len\": [1, %lld]",
                                         "[0, 0], \"len\": [1e300, %lld]"};
    static const char *const want[] = {"hold", "malformed", "malformed"};
    for (int k = 0; k < 3; k++) {
        char piece[128];
        snprintf(piece, sizeof piece, lo_len[k], (long long)p->shape[1]);
        snprintf(text, sizeof text,
                 "{\"format\": \"tera-checkpoint\", \"kind\": \"full\", \"sharded\": true, "
                 "\"tensors\": [{\"name\": \"%s\", "
                 "\"global_shape\": [%lld, %lld], \"pieces\": [{\"file\": \"rank-00000.safetensors\", \"lo\": %s}]}]}",
                 p->name, (long long)p->shape[0], (long long)p->shape[1], piece);
        /* every other tensor missing: the count check comes first, so pad the list to n_params */
        char *full = malloc(strlen(text) + 64 * (size_t)m.n_params);
        strcpy(full, text);
        full[strlen(full) - 2] = 0; /* drop "]}" */
        for (int i = 1; i < m.n_params; i++) strcat(full, ", {}");
        strcat(full, "]}");
        write_text(path, full);
        free(full);
        tera_ckpt_reader *r = NULL;
        assert_int_not_equal(tera_ckpt_reader_open(&r, dir, &m), TERA_OK);
        assert_non_null(strstr(tera_last_error(), p->name));
        assert_non_null(strstr(tera_last_error(), want[k]));
    }
    tera_model_destroy(&m);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tera-test-ckpt-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_async_resume_identical),
        cmocka_unit_test(test_commit_required_and_verify),
        cmocka_unit_test(test_frozen_diff_small),
        cmocka_unit_test(test_half_removed_skipped),
        cmocka_unit_test(test_jsonl_repair),
        cmocka_unit_test(test_json_num),
        cmocka_unit_test(test_run_lock),
        cmocka_unit_test(test_sharded_manifest_refused),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
