/* The run registry (src/obs/registry.c): concurrent writers in several processes, the reaping of
 * runs whose heartbeat stopped, fingerprints and the metrics summary. */
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/registry.h"

static char g_dir[256];

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/tera-test-registry-XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static int64_t count(tera_registry *r, const char *sql) {
    sqlite3_stmt *s = NULL;
    assert_int_equal(sqlite3_prepare_v2(tera_registry_db(r), sql, -1, &s, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(s), SQLITE_ROW);
    const int64_t n = sqlite3_column_int64(s, 0);
    sqlite3_finalize(s);
    return n;
}

/* 6 processes x 40 runs, each an insert, 3 heartbeats and a final update (a transaction each),
 * all at once on one database: nothing is lost and no writer fails. */
static void test_concurrent_writers(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/sub/registry.db", g_dir); /* the parent directory is created */
    tera_registry *r;
    assert_int_equal(tera_registry_open(&r, path), TERA_OK);
    tera_registry_close(r);
    enum { PROCS = 6, RUNS = 40 };
    pid_t pids[PROCS];
    for (int p = 0; p < PROCS; p++) {
        pids[p] = fork();
        assert_true(pids[p] >= 0);
        if (pids[p] == 0) {
            tera_registry *w;
            if (tera_registry_open(&w, path) != TERA_OK) _exit(2);
            int bad = 0;
            for (int i = 0; i < RUNS; i++) {
                char id[64];
                snprintf(id, sizeof id, "p%d-r%d", p, i);
                const double now = tera_registry_now();
                bad |= tera_registry_run(w, "INSERT INTO runs(id, status, start_time, heartbeat) VALUES(?, 'running', "
                                         "?, ?)", "sdd", id, now, now) != TERA_OK;
                for (int h = 0; h < 3; h++)
                    bad |= tera_registry_run(w, "UPDATE runs SET heartbeat=? WHERE id=?", "ds", tera_registry_now(),
                                             id) != TERA_OK;
                bad |= tera_registry_run(w, "INSERT INTO params(run_id, key, value) VALUES(?, 'training.lr', ?)", "ss",
                                         id, "0.001") != TERA_OK;
                bad |= tera_registry_run(w, "UPDATE runs SET status='finished', end_time=? WHERE id=?", "ds",
                                         tera_registry_now(), id) != TERA_OK;
            }
            tera_registry_close(w);
            _exit(bad ? 1 : 0);
        }
    }
    for (int p = 0; p < PROCS; p++) {
        int status = 0;
        assert_int_equal(waitpid(pids[p], &status, 0), pids[p]);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 0);
    }
    assert_int_equal(tera_registry_open(&r, path), TERA_OK);
    assert_int_equal(count(r, "SELECT count(*) FROM runs"), PROCS * RUNS);
    assert_int_equal(count(r, "SELECT count(*) FROM runs WHERE status = 'finished'"), PROCS * RUNS);
    assert_int_equal(count(r, "SELECT count(*) FROM params"), PROCS * RUNS);
    sqlite3_stmt *s = NULL;
    sqlite3_prepare_v2(tera_registry_db(r), "PRAGMA journal_mode", -1, &s, NULL);
    assert_int_equal(sqlite3_step(s), SQLITE_ROW);
    assert_string_equal((const char *)sqlite3_column_text(s, 0), "wal");
    sqlite3_finalize(s);
    tera_registry_close(r);
}

/* A running run whose heartbeat is older than the limit is marked killed; a fresh one is not. */
static void test_reap(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/reap.db", g_dir);
    tera_registry *r;
    assert_int_equal(tera_registry_open(&r, path), TERA_OK);
    const double now = tera_registry_now();
    assert_int_equal(tera_registry_run(r, "INSERT INTO runs(id, status, start_time, heartbeat) VALUES('old', "
                                       "'running', ?, ?)", "dd", now - 500, now - 300), TERA_OK);
    assert_int_equal(tera_registry_run(r, "INSERT INTO runs(id, status, start_time, heartbeat) VALUES('live', "
                                       "'running', ?, ?)", "dd", now - 500, now - 1), TERA_OK);
    assert_int_equal(tera_registry_reap(r, 120.0), 1);
    assert_int_equal(count(r, "SELECT count(*) FROM runs WHERE id = 'old' AND status = 'killed' AND error LIKE "
                              "'no heartbeat since%'"), 1);
    assert_int_equal(count(r, "SELECT count(*) FROM runs WHERE id = 'live' AND status = 'running'"), 1);
    tera_registry_close(r);
}

/* A file that is not a database is refused with a message naming it; its bytes stay as they were. */
static void test_not_a_database(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/notes.txt", g_dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 200; i++) fputs("these are not SQLite pages\n", f);
    fclose(f);
    tera_registry *r = NULL;
    assert_int_not_equal(tera_registry_open(&r, path), TERA_OK);
    assert_null(r);
    assert_non_null(strstr(tera_last_error(), path));
    f = fopen(path, "r");
    char line[64];
    assert_non_null(fgets(line, sizeof line, f));
    fclose(f);
    assert_string_equal(line, "these are not SQLite pages\n");
}

static void test_fingerprints_and_summary(void **state) {
    (void)state;
    char path[512], fp1[32], fp2[32], tok[32];
    int64_t bytes = 0;
    snprintf(path, sizeof path, "%s/corpus.txt", g_dir);
    FILE *f = fopen(path, "w");
    fputs("hello world\n", f);
    fclose(f);
    tera_registry_dataset_fp(path, fp1, sizeof fp1, &bytes);
    assert_int_equal(bytes, 12);
    assert_int_equal(strlen(fp1), 16);
    f = fopen(path, "a");
    fputs("more\n", f);
    fclose(f);
    tera_registry_dataset_fp(path, fp2, sizeof fp2, &bytes);
    assert_int_equal(bytes, 17);
    assert_string_not_equal(fp1, fp2); /* another content, another fingerprint */
    tera_registry_dataset_fp("", fp1, sizeof fp1, &bytes);
    assert_string_equal(fp1, "embedded");
    tera_registry_tokenizer_fp(path, tok, sizeof tok);
    assert_string_equal(tok, "bytes");

    snprintf(path, sizeof path, "%s/metrics.jsonl", g_dir);
    f = fopen(path, "w");
    fputs("{\"step\": 0, \"loss\": 5.5, \"tokens_per_s\": 100, \"elapsed_s\": 0.1, \"skipped\": 0}\n"
          "{\"step\": 1, \"loss\": 4.5, \"tokens_per_s\": 300, \"elapsed_s\": 0.2, \"skipped\": 1}\n"
          "{\"step\": 1, \"val_loss\": 4.75}\n"
          "{\"step\": 1, \"event\": \"memory\", \"loss\": 99}\n"
          "{\"step\": 2, \"loss\": 4.9, \"tokens_per_s\": 200, \"elapsed_s\": 0.3, \"skipped\": 0}\n", f);
    fclose(f);
    assert_null(tera_metrics_summary("/dev/full")); /* a device is not read (it would never end) */
    char *s = tera_metrics_summary(path);
    assert_non_null(s);
    assert_non_null(strstr(s, "\"records\": 3"));
    assert_non_null(strstr(s, "\"last_step\": 3"));
    assert_non_null(strstr(s, "\"final_loss\": 4.9"));
    assert_non_null(strstr(s, "\"min_loss\": 4.5"));
    assert_non_null(strstr(s, "\"final_val_loss\": 4.75"));
    assert_non_null(strstr(s, "\"mean_tokens_per_s\": 200.0"));
    assert_non_null(strstr(s, "\"skipped\": 1"));
    free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_concurrent_writers), cmocka_unit_test(test_reap),
        cmocka_unit_test(test_not_a_database), cmocka_unit_test(test_fingerprints_and_summary)};
    return cmocka_run_group_tests(tests, setup, teardown);
}
