#include "tera/status.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static _Thread_local char g_msg[2048];

tera_status tera_fail(tera_status s, const char *fmt, ...) {
    /* formatted aside, then copied: callers wrap the last message (tera_fail(st, "prompt %d: %s", p,
     * tera_last_error())), and vsnprintf into the buffer it reads from is undefined (glibc wrote
     * the prefix twice) */
    char msg[sizeof g_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(g_msg, msg, sizeof g_msg);
    return s;
}

const char *tera_last_error(void) { return g_msg; }

const char *tera_status_name(tera_status s) {
    switch (s) {
    case TERA_OK: return "ok";
    case TERA_ERR_IO: return "i/o error";
    case TERA_ERR_FORMAT: return "format error";
    case TERA_ERR_CONFIG: return "config error";
    case TERA_ERR_ARG: return "argument error";
    case TERA_ERR_NOMEM: return "out of memory";
    case TERA_ERR_EXISTS: return "already exists";
    case TERA_ERR_NUMERIC: return "numeric error";
    }
    return "unknown error";
}

/* Hook set by the communicator so that an abort on one rank takes down every rank. */
void (*tera_abort_hook)(void) = NULL;

void tera_abort_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tera: fatal: %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
    if (tera_abort_hook) tera_abort_hook();
    abort();
}

/* Large blocks (parameters, gradients, moments, activations, scratch) start on a 2 MiB boundary and
 * are offered to the kernel's transparent huge pages, which most distributions enable in madvise mode
 * (/sys/kernel/mm/transparent_hugepage/enabled: nothing happens without the advice). A streaming pass
 * then crosses a page every 2 MiB instead of every 4 KiB: fewer TLB misses, and the hardware
 * prefetchers, which stop at a page's end, run on (docs/PERFORMANCE.md, wave 22). Advice only: where
 * the kernel has no huge pages or refuses, the block is an ordinary one. The same bits either way.
 * TERA_HUGEPAGES=0: no advice and 64-byte alignment, as before (A/B, tests). */
void *tera_malloc_at(size_t n, const char *file, int line) {
    void *p = NULL;
    if (n == 0) n = 1;
    const char *e = n >= TERA_HUGE_MIN ? getenv("TERA_HUGEPAGES") : NULL; /* read per large block: cheap beside it */
    const int huge = n >= TERA_HUGE_MIN && !(e && strcmp(e, "0") == 0);
    if (posix_memalign(&p, huge ? TERA_HUGE_ALIGN : 64, n) != 0 || !p)
        tera_abort_at(file, line, "out of memory (%zu bytes)", n);
#if defined(MADV_HUGEPAGE)
    if (huge) (void)madvise(p, n & ~(TERA_HUGE_ALIGN - 1), MADV_HUGEPAGE); /* whole 2 MiB pages of the block */
#endif
    return p;
}

void *tera_realloc_at(void *p, size_t n, const char *file, int line) {
    void *q = realloc(p, n ? n : 1);
    if (!q) tera_abort_at(file, line, "out of memory (%zu bytes)", n);
    return q;
}

void *tera_calloc_at(size_t n, size_t size, const char *file, int line) {
    void *p = tera_malloc_at(n * size, file, line);
    memset(p, 0, n * size);
    return p;
}

void tera_zero_stream(void *dst, size_t bytes) {
#if defined(__SSE2__)
    char *p = dst;
    size_t head = (64 - ((uintptr_t)p & 63)) & 63; /* to the first whole line */
    if (head > bytes) head = bytes;
    memset(p, 0, head);
    p += head, bytes -= head;
#if defined(__AVX512F__)
    const __m512i z = _mm512_setzero_si512();
    for (; bytes >= 64; p += 64, bytes -= 64) _mm512_stream_si512((void *)p, z);
#else
    const __m128i z = _mm_setzero_si128();
    for (; bytes >= 64; p += 64, bytes -= 64)
        for (int i = 0; i < 4; i++) _mm_stream_si128((__m128i *)(void *)(p + 16 * i), z);
#endif
    memset(p, 0, bytes);
    _mm_sfence();
#else
    memset(dst, 0, bytes);
#endif
}
