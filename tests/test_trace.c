/* The monitoring writers' contracts (src/obs/trace.c, src/obs/tensorboard.c, src/obs/hw.c):
 * the timeline records only inside its window, its events nest and are ordered per thread in the
 * file, a full ring drops and counts instead of growing, bad windows are refused naming the key;
 * CRC32C matches its published check values (TFRecord framing); the hardware readings carry the
 * figures every Linux exposes and never a rate on the first sample. */
#include <cjson/cJSON.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/comm.h"
#include "tera/hw.h"
#include "tera/profile.h"
#include "tera/tensorboard.h"
#include "tera/trace.h"

static int setup(void **state) {
    (void)state;
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("PMI_SIZE");
    assert_int_equal(tera_comm_init(NULL, NULL), TERA_OK);
    return 0;
}

static void crc32c_vectors(void **state) {
    (void)state;
    /* RFC 3720 B.4 and the common check value of CRC-32C */
    assert_int_equal(tera_crc32c("123456789", 9), 0xE3069283u);
    unsigned char zeros[32] = {0}, ones[32];
    memset(ones, 0xFF, sizeof ones);
    assert_int_equal(tera_crc32c(zeros, 32), 0x8A9136AAu);
    assert_int_equal(tera_crc32c(ones, 32), 0x62A8AB43u);
    const uint32_t c = tera_crc32c("123456789", 9);
    assert_int_equal(tera_crc32c_masked("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

static tera_logging_config lc_with(const char *path, const char *steps) {
    tera_logging_config lc;
    memset(&lc, 0, sizeof lc);
    snprintf(lc.trace, sizeof lc.trace, "%s", path);
    snprintf(lc.trace_steps, sizeof lc.trace_steps, "%s", steps);
    return lc;
}

static void window_refused(void **state) {
    (void)state;
    const char *bad[] = {"", "3", "a:2", "2:0", "-1:2", "2:x", "2:3x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tera_logging_config lc = lc_with("/tmp/x.json", bad[i]);
        assert_int_equal(tera_trace_start(&lc, 2, 0, 1), TERA_ERR_CONFIG);
        assert_non_null(strstr(tera_last_error(), "logging.trace_steps"));
    }
    tera_logging_config off = lc_with("", "nonsense");
    assert_int_equal(tera_trace_start(&off, 2, 0, 1), TERA_OK); /* off: the window is not read */
    tera_trace_step_begin(0);
    assert_int_equal(tera_trace_active, 0);
}

/* Steps 0..4 with window 1:2: events of steps 1 and 2 only; nested ops; the merged file parses. */
static void window_and_nesting(void **state) {
    (void)state;
    char path[256];
    snprintf(path, sizeof path, "/tmp/tera_test_trace_%d.json", (int)getpid());
    tera_logging_config lc = lc_with(path, "1:2");
    assert_int_equal(tera_trace_start(&lc, 2, 0, 1), TERA_OK);
    for (int s = 0; s < 5; s++) {
        tera_trace_step_begin(s);
        const double t0 = tera_now();
        TERA_PROF(NORM_FWD, { volatile double x = 0; for (int i = 0; i < 1000; i++) x += i; });
        TERA_PROF_BEGIN(ATTN_FWD);
        TERA_PROF(TP_COMM, { volatile double x = 0; for (int i = 0; i < 1000; i++) x += i; });
        TERA_PROF_END(ATTN_FWD);
        tera_trace_event(TERA_TRACE_CKPT, "checkpoint write", "checkpoint", t0, tera_now(), -1);
        tera_trace_event(TERA_TRACE_COMPUTE, "step", "step", t0, tera_now(), -1);
    }
    assert_int_equal(tera_trace_recorded(), 2 * 5); /* 3 ops + ckpt + step, two steps */
    assert_int_equal(tera_trace_dropped(), 0);
    assert_int_equal(tera_trace_finish(tera_comm_world()), TERA_OK);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char text[1 << 20];
    const size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    cJSON *root = cJSON_Parse(text);
    assert_non_null(root);
    const cJSON *evs = cJSON_GetObjectItem(root, "traceEvents");
    assert_true(cJSON_IsArray(evs));
    int x = 0, steps_seen[5] = {0};
    double last_ts[4] = {-1, -1, -1, -1}, step_end = -1;
    cJSON *e;
    cJSON_ArrayForEach(e, evs) {
        const char *ph = cJSON_GetObjectItem(e, "ph")->valuestring;
        assert_int_equal(cJSON_GetObjectItem(e, "pid")->valueint, 0);
        if (strcmp(ph, "X")) continue;
        x++;
        const int tid = cJSON_GetObjectItem(e, "tid")->valueint;
        const double ts = cJSON_GetObjectItem(e, "ts")->valuedouble, dur = cJSON_GetObjectItem(e, "dur")->valuedouble;
        assert_true(dur >= 0);
        assert_true(ts >= last_ts[tid]); /* ordered per thread */
        last_ts[tid] = ts;
        const int step = cJSON_GetObjectItem(cJSON_GetObjectItem(e, "args"), "step")->valueint;
        assert_true(step == 1 || step == 2);
        steps_seen[step]++;
        if (tid == 0 && !strcmp(cJSON_GetObjectItem(e, "name")->valuestring, "step")) step_end = ts + dur;
        else if (tid == 0) assert_true(ts + dur <= step_end + 1e-9); /* ops inside their step (it comes first) */
    }
    assert_int_equal(x, 10);
    assert_int_equal(steps_seen[1], 5);
    assert_int_equal(steps_seen[2], 5);
    cJSON_Delete(root);
    unlink(path);
    char part[300];
    snprintf(part, sizeof part, "%s.part-0", path);
    assert_int_equal(access(part, F_OK), -1); /* merged and removed */
}

/* A ring smaller than the events: the rest are counted as dropped, nothing grows. */
static void full_ring_drops(void **state) {
    (void)state;
    char path[256];
    snprintf(path, sizeof path, "/tmp/tera_test_trace_full_%d.json", (int)getpid());
    tera_logging_config lc = lc_with(path, "0:1");
    assert_int_equal(tera_trace_start(&lc, 1, 0, 1), TERA_OK); /* ring: (64 + 512) * 1 * 4 = 2304 events */
    tera_trace_step_begin(0);
    const double t = tera_now();
    for (int i = 0; i < 3000; i++) tera_trace_event(TERA_TRACE_COMPUTE, "op", "op", t, t, -1);
    assert_int_equal(tera_trace_recorded(), 2304);
    assert_int_equal(tera_trace_dropped(), 3000 - 2304);
    tera_trace_stop(); /* no output */
    assert_int_equal(access(path, F_OK), -1);
}

static void hw_readings(void **state) {
    (void)state;
    tera_hw_reading r;
    tera_hw_read_now(&r);
    int rss = 0, avail = 0;
    for (int i = 0; i < r.n; i++) {
        rss |= r.kind[i] == TERA_HW_RSS && r.value[i] > 1e5;
        avail |= r.kind[i] == TERA_HW_MEM_AVAIL && r.value[i] > 0;
        if (r.kind[i] == TERA_HW_TEMP) assert_true(r.value[i] > -50 && r.value[i] < 200);
    }
    assert_true(rss && avail);
    volatile double x = 0;
    for (int i = 0; i < 20000000; i++) x += i; /* busy: the next sample has a CPU rate */
    tera_hw_read_now(&r);
    int cpu = 0;
    for (int i = 0; i < r.n; i++)
        if (r.kind[i] == TERA_HW_CPU_CORES) {
            cpu = 1;
            assert_true(r.value[i] > 0.05 && r.value[i] < 64);
            assert_string_equal(r.name[i], "cpu_cores_used");
        }
    assert_true(cpu);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(crc32c_vectors), cmocka_unit_test(window_refused), cmocka_unit_test(window_and_nesting),
        cmocka_unit_test(full_ring_drops), cmocka_unit_test(hw_readings),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
