/* Status codes, error messages and invariant checks.
 *
 * Recoverable failures (I/O, bad input, bad config) return a tera_status and leave one message,
 * naming the file, key or value at fault, in a thread-local buffer that the caller prints once.
 * Broken invariants abort through TERA_ASSERT with the expression, file and line. */
#ifndef TERA_STATUS_H
#define TERA_STATUS_H

#include <stdio.h>
#include <stdlib.h>

typedef enum {
    TERA_OK = 0,
    TERA_ERR_IO,       /* a file could not be opened, read or written */
    TERA_ERR_FORMAT,   /* a file's contents are malformed */
    TERA_ERR_CONFIG,   /* a config key or value is invalid */
    TERA_ERR_ARG,      /* a command-line argument is invalid */
    TERA_ERR_NOMEM,    /* an allocation failed */
    TERA_ERR_EXISTS,   /* refusing to overwrite something that exists */
    TERA_ERR_NUMERIC,  /* a non-finite value where a finite one was required */
} tera_status;

/* Records a formatted message and returns `s`; use as `return tera_fail(TERA_ERR_IO, "...")`. */
tera_status tera_fail(tera_status s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The message of the last tera_fail on this thread ("" if none). */
const char *tera_last_error(void);
/* A short name for a status ("io error", "format error", ...). */
const char *tera_status_name(tera_status s);

/* Aborts the process (every rank: MPI_Abort once the communicator exists) with file:line. */
void tera_abort_at(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));

#define TERA_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond)) tera_abort_at(__FILE__, __LINE__, "assertion failed: %s", #cond);             \
    } while (0)
#define TERA_ASSERTF(cond, ...)                                                                    \
    do {                                                                                           \
        if (!(cond)) tera_abort_at(__FILE__, __LINE__, __VA_ARGS__);                               \
    } while (0)
/* Propagate a non-OK status to the caller. */
#define TERA_TRY(expr)                                                                             \
    do {                                                                                           \
        tera_status _s = (expr);                                                                   \
        if (_s != TERA_OK) return _s;                                                              \
    } while (0)

/* Checked allocation: aborts with file:line on failure (used only at set-up, never in the step).
 * 64-byte aligned; blocks of TERA_HUGE_MIN bytes or more 2 MiB aligned and advised for transparent
 * huge pages (src/core/status.c; TERA_HUGEPAGES=0 in the environment: not). Freed with free(). */
#define TERA_HUGE_MIN ((size_t)4 << 20)
#define TERA_HUGE_ALIGN ((size_t)2 << 20)
void *tera_malloc_at(size_t n, const char *file, int line);
void *tera_calloc_at(size_t n, size_t size, const char *file, int line);
#define tera_malloc(n) tera_malloc_at((n), __FILE__, __LINE__)
#define tera_calloc(n, s) tera_calloc_at((n), (s), __FILE__, __LINE__)
/* realloc that aborts with file:line on failure (the alignment is malloc's, not tera_malloc's 64 bytes). */
void *tera_realloc_at(void *p, size_t n, const char *file, int line);
#define tera_realloc(p, n) tera_realloc_at((p), (n), __FILE__, __LINE__)

/* memset(dst, 0, bytes) with stores that go around the caches where the CPU has them (x86-64:
 * non-temporal stores; elsewhere memset): for large buffers that nothing reads soon, such as the
 * weight gradients of experts no rows reached, which wait for the optimizer. A store through the
 * cache first reads each line it fills; these do not, so the pass moves half the bytes (2.2x faster
 * on 84 MiB here, docs/PERFORMANCE.md, wave 23). Ordered before the call returns (a store fence). */
void tera_zero_stream(void *dst, size_t bytes);

#endif
