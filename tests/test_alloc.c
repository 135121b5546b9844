/* tera_malloc's large blocks (src/core/status.c): 2 MiB aligned and advised for transparent huge
 * pages, small ones 64-byte aligned and not advised; TERA_HUGEPAGES=0 turns the advice off. The
 * advice is read back from the kernel: the "hg" flag of the block's mapping in /proc/self/smaps.
 * tera_zero_stream zeroes exactly its bytes at any start and length (head, whole lines, tail). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <cmocka.h>

#include "tera/status.h"

/* 1: the mapping holding p has VmFlags "hg"; 0: it has not; -1: no /proc/self/smaps here */
static int advised(const void *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[1024];
    int in = 0, found = 0, hg = 0;
    const uintptr_t a = (uintptr_t)p;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) { /* a mapping's first line (keys fail at their second letter) */
            in = a >= lo && a < hi;
            continue;
        }
        if (in && strncmp(line, "VmFlags:", 8) == 0) {
            found = 1;
            hg = strstr(line, " hg") != NULL;
            break;
        }
    }
    fclose(f);
    return found ? hg : -1;
}

static void test_large_blocks_advised(void **state) {
    (void)state;
    unsetenv("TERA_HUGEPAGES");
    const size_t n = TERA_HUGE_MIN + 12345;
    unsigned char *p = tera_malloc(n);
    assert_int_equal((uintptr_t)p % TERA_HUGE_ALIGN, 0);
    memset(p, 1, n); /* touched: the kernel may back it with huge pages now; the bytes are ordinary */
    for (size_t i = 0; i < n; i += 4093) assert_int_equal(p[i], 1);
    const int a = advised(p);
    if (a < 0) {
        free(p);
        skip();
    }
#if defined(MADV_HUGEPAGE)
    assert_int_equal(a, 1);
#endif
    free(p);
    /* calloc takes the same path, zeroed */
    float *z = tera_calloc(TERA_HUGE_MIN / sizeof(float) + 3, sizeof(float));
    assert_int_equal((uintptr_t)z % TERA_HUGE_ALIGN, 0);
    for (size_t i = 0; i < TERA_HUGE_MIN / sizeof(float) + 3; i += 1001) assert_true(z[i] == 0.0f);
    free(z);
}

static void test_small_blocks_and_off(void **state) {
    (void)state;
    unsetenv("TERA_HUGEPAGES");
    void *s = tera_malloc(TERA_HUGE_MIN - 1); /* below the threshold: 64-byte aligned, no advice */
    assert_int_equal((uintptr_t)s % 64, 0);
    memset(s, 2, TERA_HUGE_MIN - 1);
    const int as = advised(s);
    if (as >= 0) assert_int_equal(as, 0);
    setenv("TERA_HUGEPAGES", "0", 1);
    void *o = tera_malloc(3 * TERA_HUGE_MIN); /* turned off: no advice */
    assert_int_equal((uintptr_t)o % 64, 0);
    memset(o, 3, 3 * TERA_HUGE_MIN);
    const int ao = advised(o);
    if (ao >= 0) assert_int_equal(ao, 0);
    unsetenv("TERA_HUGEPAGES");
    free(s);
    free(o);
}

/* Every start within a line and lengths around the line size and larger: the bytes in range are
 * zero, the guard bytes on either side untouched. */
static void test_zero_stream(void **state) {
    (void)state;
    enum { GUARD = 128, MAXLEN = 4 * 64 * 1024 + 200 };
    unsigned char *buf = tera_malloc(GUARD + 64 + MAXLEN + GUARD);
    const size_t lens[] = {0, 1, 3, 63, 64, 65, 127, 128, 1000, 4096 + 17, MAXLEN};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
        for (size_t start = 0; start < 64; start += (lens[li] > 4096 ? 7 : 1)) {
            const size_t len = lens[li], total = GUARD + 64 + MAXLEN + GUARD;
            memset(buf, 0xA5, total);
            tera_zero_stream(buf + GUARD + start, len);
            for (size_t i = 0; i < total; i++) {
                const int in = i >= GUARD + start && i < GUARD + start + len;
                if (buf[i] != (in ? 0 : 0xA5))
                    fail_msg("start %zu, length %zu: byte %zu is 0x%02x", start, len, i, buf[i]);
            }
        }
    free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_large_blocks_advised),
        cmocka_unit_test(test_small_blocks_and_off),
        cmocka_unit_test(test_zero_stream),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
