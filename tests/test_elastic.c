/* Heartbeats (src/elastic/heartbeat.c): a rank's records round-trip through tera_heartbeat_read (step,
 * state, pid, host), later beats overwrite the progress record in place (the file keeps its two fixed
 * records), the liveness thread keeps "alive" fresh while the step does not change, and a missing or
 * truncated file reads as absent. */
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/elastic.h"

static char g_dir[256];

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void test_round_trip(void **state) {
    (void)state;
    tera_heartbeat_rec h;
    assert_int_equal(tera_heartbeat_read(g_dir, 3, &h), -1); /* nothing yet */
    const double t0 = wall_now();
    tera_heartbeat_beat(3, 0, "ready");
    assert_int_equal(tera_heartbeat_read(g_dir, 3, &h), 0);
    assert_true(h.ok);
    assert_int_equal(h.rank, 3);
    assert_int_equal(h.step, 0);
    assert_string_equal(h.state, "ready");
    assert_int_equal(h.pid, (long)getpid());
    char host[64] = "";
    gethostname(host, sizeof host - 1);
    assert_string_equal(h.host, host);
    assert_true(h.wall >= t0 - 1 && h.wall <= wall_now() + 1);
    tera_heartbeat_beat(3, 41, "step");
    assert_int_equal(tera_heartbeat_read(g_dir, 3, &h), 0);
    assert_int_equal(h.step, 41);
    assert_string_equal(h.state, "step");
    char path[512];
    snprintf(path, sizeof path, "%s/rank-3", g_dir);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal((int)sb.st_size, 2 * TERA_HB_RECORD); /* rewritten in place */
    /* no step for a while: the liveness record still moves */
    const double a0 = h.alive;
    usleep((useconds_t)(3 * TERA_HB_ALIVE_S * 1e6));
    assert_int_equal(tera_heartbeat_read(g_dir, 3, &h), 0);
    assert_int_equal(h.step, 41);
    assert_true(h.alive > a0 + TERA_HB_ALIVE_S);
    /* another rank's file, short or not a heartbeat, reads as absent */
    snprintf(path, sizeof path, "%s/rank-5", g_dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("tera-hb 1 rank 5 step 7", f);
    fclose(f);
    assert_int_equal(tera_heartbeat_read(g_dir, 5, &h), -1);
    f = fopen(path, "w");
    for (int i = 0; i < 2 * TERA_HB_RECORD; i++) fputc('x', f);
    fclose(f);
    assert_int_equal(tera_heartbeat_read(g_dir, 5, &h), -1);
    unlink(path);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tera_test_elastic_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    setenv("TERA_HEARTBEAT_DIR", g_dir, 1);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_round_trip)};
    const int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char path[512];
    snprintf(path, sizeof path, "%s/rank-3", g_dir);
    unlink(path);
    rmdir(g_dir);
    return rc;
}
