/* The timeline: Chrome trace-event JSON for a window of steps (include/tera/trace.h).
 *
 * Recording: a slot index claimed with one atomic add, the slot filled, then marked done (release);
 * the writer at the end skips slots never completed. Times are integer nanoseconds of the monotonic
 * clock, so that a child's rounded interval never sticks out of its parent's; they are printed in
 * microseconds with three decimals (the format's unit). Output: {"traceEvents": [...],
 * "displayTimeUnit": "ms", "otherData": {...}} with "M" metadata events naming every process
 * ("rank R") and thread, then the "X" events of rank 0, 1, ... each sorted by (tid, start, longer
 * first), so that parents precede their children. */
#include "tera/trace.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <threads.h>
#include <time.h>
#include <unistd.h>

#include "tera/profile.h"

volatile int tera_trace_active;

typedef struct {
    const char *name, *cat;
    int64_t t0, t1;   /* ns since the trace's origin */
    int64_t arg;      /* layer (profiled ops), bytes (comm), -1: none */
    int64_t step;
    int tid;
    atomic_int done;
} trace_ev;

static struct {
    int on;                 /* logging.trace set and the ring allocated */
    char path[TERA_PATH_MAX];
    int64_t first, count;   /* the window: steps [first, first + count) */
    int rank, world;
    trace_ev *ev;
    int64_t cap;
    atomic_llong next;      /* slots claimed (may exceed cap: those are dropped) */
    int64_t step;
    int64_t origin_ns;      /* this rank's CLOCK_MONOTONIC at start */
    double closed_at;       /* tera_now() when the window closed (0: open or not reached) */
    volatile int finished;  /* tera_trace_finish ran: nothing more is recorded (the ring stays until stop) */
    int entered;            /* a step of the window began */
} g;

static thread_local int t_is_compute; /* the thread that started the trace: collectives drawn from it only */

static const char *const tid_names[TERA_TRACE_NTIDS] = {"compute", "comm", "checkpoint writer", "data prefetcher"};

static int64_t to_ns(double t) { return (int64_t)(t * 1e9 + 0.5); }

static tera_status parse_window(const char *s, int64_t *first, int64_t *count) {
    char *end;
    errno = 0;
    const long long a = strtoll(s, &end, 10);
    if (end == s || *end != ':' || a < 0 || errno)
        return tera_fail(TERA_ERR_CONFIG, "logging.trace_steps = \"%s\": expected \"FIRST:COUNT\" (0-based first step "
                         "and a step count >= 1, e.g. \"2:3\")", s);
    const char *c = end + 1;
    const long long b = strtoll(c, &end, 10);
    if (end == c || *end || b < 1 || b > 100000 || errno)
        return tera_fail(TERA_ERR_CONFIG, "logging.trace_steps = \"%s\": COUNT must be an integer from 1 to 100000 "
                         "(expected \"FIRST:COUNT\")", s);
    *first = a, *count = b;
    return TERA_OK;
}

tera_status tera_trace_start(const tera_logging_config *lc, int n_layers, int world_rank, int world_size) {
    tera_trace_stop();
    if (!lc->trace[0]) return TERA_OK;
    int64_t first = 0, count = 1;
    TERA_TRY(parse_window(lc->trace_steps, &first, &count));
    /* per step: the profiled operations of every layer (forward, backward, recompute: ~40 a layer
     * with their collectives), a few hundred for the rest; per micro-batch more, hence the margin */
    const int64_t per_step = 64 * (int64_t)(n_layers > 0 ? n_layers : 1) + 512;
    int64_t cap = per_step * count * 4;
    if (cap > ((int64_t)1 << 22)) cap = (int64_t)1 << 22; /* 4 Mi events (~250 MiB) at most; then dropped */
    { /* a path that cannot be written is found now, not at the end of the run */
        struct stat sb;
        if (stat(lc->trace, &sb) == 0 && S_ISDIR(sb.st_mode))
            return tera_fail(TERA_ERR_IO, "logging.trace = \"%s\" is a directory; give the trace file's path",
                             lc->trace);
        char probe[TERA_PATH_MAX + 32];
        snprintf(probe, sizeof probe, "%s.part-%d", lc->trace, world_rank);
        FILE *f = fopen(probe, "w");
        if (!f) return tera_fail(TERA_ERR_IO, "logging.trace = \"%s\": cannot write '%s': %s", lc->trace, probe, strerror(errno));
        fclose(f);
        unlink(probe);
    }
    snprintf(g.path, sizeof g.path, "%s", lc->trace);
    g.first = first, g.count = count;
    g.rank = world_rank, g.world = world_size;
    g.ev = tera_calloc((size_t)cap, sizeof(trace_ev));
    g.cap = cap;
    atomic_store(&g.next, 0);
    g.origin_ns = to_ns(tera_now());
    g.step = -1;
    g.entered = 0;
    g.on = 1;
    t_is_compute = 1;
    return TERA_OK;
}

void tera_trace_step_begin(int64_t step) {
    if (!g.on) return;
    g.step = step;
    const int was = tera_trace_active;
    tera_trace_active = step >= g.first && step < g.first + g.count;
    g.entered |= tera_trace_active;
    if (was && !tera_trace_active) g.closed_at = tera_now();
}

void tera_trace_event(int tid, const char *name, const char *cat, double t0, double t1, int64_t arg) {
    /* in the window, or begun in it (a background checkpoint write or prefetch that ends later) */
    if (!g.on || g.finished) return;
    if (!tera_trace_active && !(tid >= TERA_TRACE_CKPT && g.closed_at > 0 && t0 < g.closed_at)) return;
    const long long i = atomic_fetch_add_explicit(&g.next, 1, memory_order_relaxed);
    if (i >= g.cap) return; /* counted as dropped */
    trace_ev *e = &g.ev[i];
    e->name = name, e->cat = cat;
    e->t0 = to_ns(t0) - g.origin_ns;
    e->t1 = to_ns(t1) - g.origin_ns;
    if (e->t1 < e->t0) e->t1 = e->t0;
    e->arg = arg, e->tid = tid;
    e->step = g.step < g.first + g.count ? g.step : g.first + g.count - 1; /* begun in the window's last step */
    atomic_store_explicit(&e->done, 1, memory_order_release);
}

void tera_trace_comm(const char *name, double t0, double t1, int64_t bytes) {
    if (t_is_compute) tera_trace_event(TERA_TRACE_COMM, name, "comm", t0, t1, bytes);
}

int64_t tera_trace_recorded(void) {
    const int64_t n = atomic_load(&g.next);
    return n < g.cap ? n : g.cap;
}

int64_t tera_trace_dropped(void) {
    const int64_t n = atomic_load(&g.next);
    return n > g.cap ? n - g.cap : 0;
}

static int by_tid_time(const void *pa, const void *pb) {
    const trace_ev *a = pa, *b = pb;
    if (a->tid != b->tid) return a->tid < b->tid ? -1 : 1;
    if (a->t0 != b->t0) return a->t0 < b->t0 ? -1 : 1;
    if (a->t1 != b->t1) return a->t1 > b->t1 ? -1 : 1; /* the enclosing event first */
    return 0;
}

/* A JSON string of a name we chose (no quotes or controls in them; escaped anyway). */
static void put_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', f);
        if ((unsigned char)*s < 0x20) fputc(' ', f);
        else fputc(*s, f);
    }
    fputc('"', f);
}

static void put_us(FILE *f, int64_t ns) {
    const int neg = ns < 0;
    const int64_t a = neg ? -ns : ns;
    fprintf(f, "%s%" PRId64 ".%03" PRId64, neg ? "-" : "", a / 1000, a % 1000);
}

/* This rank's events, one per line, each line starting with ",": the merge concatenates parts. */
static tera_status write_part(const char *path, int64_t shift_ns) {
    const int64_t n = tera_trace_recorded();
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) /* compact the completed slots */
        if (atomic_load_explicit(&g.ev[i].done, memory_order_acquire)) {
            if (k != i) {
                trace_ev *d = &g.ev[k], *s = &g.ev[i];
                d->name = s->name, d->cat = s->cat, d->t0 = s->t0, d->t1 = s->t1;
                d->arg = s->arg, d->step = s->step, d->tid = s->tid;
            }
            k++;
        }
    qsort(g.ev, (size_t)k, sizeof(trace_ev), by_tid_time);
    FILE *f = fopen(path, "w");
    if (!f) return tera_fail(TERA_ERR_IO, "logging.trace: cannot write '%s': %s", path, strerror(errno));
    fprintf(f, ",\n{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": {\"name\": \"rank %d\"}}",
            g.rank, g.rank);
    fprintf(f, ",\n{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": {\"sort_index\": %d}}",
            g.rank, g.rank);
    for (int t = 0; t < TERA_TRACE_NTIDS; t++) {
        fprintf(f, ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": ", g.rank, t);
        put_str(f, tid_names[t]);
        fprintf(f, "}}");
        fprintf(f, ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": "
                "{\"sort_index\": %d}}", g.rank, t, t);
    }
    for (int64_t i = 0; i < k; i++) {
        const trace_ev *e = &g.ev[i];
        fputs(",\n{\"name\": ", f);
        put_str(f, e->name);
        fputs(", \"cat\": ", f);
        put_str(f, e->cat);
        fputs(", \"ph\": \"X\", \"ts\": ", f);
        put_us(f, e->t0 + shift_ns);
        fputs(", \"dur\": ", f);
        put_us(f, e->t1 - e->t0);
        fprintf(f, ", \"pid\": %d, \"tid\": %d, \"args\": {\"step\": %" PRId64, g.rank, e->tid, e->step);
        if (e->arg >= 0) fprintf(f, ", \"%s\": %" PRId64, !strcmp(e->cat, "comm") ? "bytes" : "layer", e->arg);
        fputs("}}", f);
    }
    const int bad = ferror(f);
    if (fclose(f) != 0 || bad) return tera_fail(TERA_ERR_IO, "logging.trace: write to '%s' failed", path);
    return TERA_OK;
}

static tera_status append_file(FILE *out, const char *path, int skip_comma) {
    FILE *in = fopen(path, "r");
    if (!in) return tera_fail(TERA_ERR_IO, "logging.trace: cannot read rank part '%s': %s", path, strerror(errno));
    char buf[65536];
    size_t n;
    int first = 1;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0) {
        const size_t skip = first && skip_comma && n >= 2 ? 2 : 0; /* the leading ",\n" of the first part */
        fwrite(buf + skip, 1, n - skip, out);
        first = 0;
    }
    fclose(in);
    return TERA_OK;
}

tera_status tera_trace_finish(tera_comm *world) {
    if (!g.on || g.finished) return TERA_OK;
    if (tera_trace_active) g.closed_at = tera_now();
    tera_trace_active = 0;
    g.finished = 1;
    /* a common origin: rank 0's start (the monotonic clock is one per machine) */
    int64_t origin = g.rank == 0 ? g.origin_ns : 0;
    if (g.world > 1) tera_comm_allreduce_i64(world, &origin, 1);
    char part[TERA_PATH_MAX + 32];
    snprintf(part, sizeof part, "%s.part-%d", g.path, g.rank);
    tera_status st = write_part(part, g.origin_ns - origin);
    const int64_t dropped = tera_trace_dropped();
    int64_t failed = st != TERA_OK;
    if (g.world > 1) tera_comm_allreduce_i64(world, &failed, 1); /* and a barrier: every part is written */
    if (g.rank == 0 && failed == 0) {
        char tmp[TERA_PATH_MAX + 32];
        snprintf(tmp, sizeof tmp, "%s.tmp", g.path);
        FILE *f = fopen(tmp, "w");
        if (!f) {
            st = tera_fail(TERA_ERR_IO, "logging.trace: cannot write '%s': %s", tmp, strerror(errno));
        } else {
            fprintf(f, "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"producer\": \"tera\", \"ranks\": %d, "
                    "\"first_step\": %" PRId64 ", \"steps\": %" PRId64 ", \"rank0_dropped_events\": %" PRId64 "},\n"
                    "\"traceEvents\": [\n", g.world, g.first, g.count, dropped);
            for (int r = 0; r < g.world && st == TERA_OK; r++) {
                char p[TERA_PATH_MAX + 32];
                snprintf(p, sizeof p, "%s.part-%d", g.path, r);
                st = append_file(f, p, r == 0);
            }
            fputs("\n]}\n", f);
            const int bad = ferror(f);
            if (fclose(f) != 0 || bad) st = tera_fail(TERA_ERR_IO, "logging.trace: write to '%s' failed", tmp);
            if (st == TERA_OK && rename(tmp, g.path) != 0)
                st = tera_fail(TERA_ERR_IO, "logging.trace: cannot rename '%s' to '%s': %s", tmp, g.path, strerror(errno));
            if (st != TERA_OK) unlink(tmp);
            for (int r = 0; r < g.world && st == TERA_OK; r++) {
                char p[TERA_PATH_MAX + 32];
                snprintf(p, sizeof p, "%s.part-%d", g.path, r);
                unlink(p);
            }
        }
    } else if (failed) {
        unlink(part);
        if (st == TERA_OK) st = tera_fail(TERA_ERR_IO, "logging.trace: another rank could not write its part");
    }
    if (st == TERA_OK && g.rank == 0 && !g.entered)
        fprintf(stderr, "tera: warning: logging.trace_steps: no step of the window [%" PRId64 ", %" PRId64
                ") ran (the last step run was %" PRId64 "); '%s' holds no steps\n", g.first, g.first + g.count, g.step,
                g.path);
    if (dropped > 0 && st == TERA_OK)
        fprintf(stderr, "tera: warning: logging.trace: rank %d dropped %" PRId64 " events (ring of %" PRId64
                " full); shorten logging.trace_steps\n", g.rank, dropped, g.cap);
    return st; /* the ring stays until tera_trace_stop: a background thread may still be inside tera_trace_event */
}

void tera_trace_stop(void) {
    tera_trace_active = 0;
    g.on = 0;
    g.finished = 0;
    g.closed_at = 0;
    free(g.ev);
    g.ev = NULL;
    g.cap = 0;
    atomic_store(&g.next, 0);
}
