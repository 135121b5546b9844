/* Shared-memory all-reduce of the MPI backend: see comm_shm.h. */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "comm_shm.h"
#include "tera/status.h"

#define CTRL_BYTES 128 /* per rank: arrive (offset 0) and done (offset 64) counters, own cache lines */
#define SET_FLOATS ((int64_t)1 << 21) /* floats in one set of slots, all ranks together (comm_shm.h) */

struct tera_shm {
    MPI_Win win;
    int rank, size;
    int64_t ch;             /* floats per rank slot */
    unsigned char *ctrl;    /* [size][CTRL_BYTES] */
    float *data;            /* [2 sets][size][ch] */
    uint64_t seq;           /* chunks completed by this group (the same on every rank) */
    tera_shm_op *head, *tail;
    struct tera_shm *next;  /* every group's segment, for tera_shm_progress */
};

static tera_shm *g_groups = NULL;

/* Every group's queue, chunk counter and operations' fields are guarded by g_lock: the rank's own
 * thread (starts, polls, waits) and the progress thread (below) both advance them. g_moves counts
 * every advance, so a caller that found the lock taken still learns that something moved (the
 * backend's watchdog restarts on progress). */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_work = PTHREAD_COND_INITIALIZER; /* an operation was queued, or stop */
static _Atomic uint64_t g_moves = 0;
static _Thread_local uint64_t t_moves_seen = 0;
static pthread_t g_thread;
static int g_thread_on = 0, g_thread_stop = 0; /* under g_lock */
/* under g_lock: the counter the last advance found behind (its low 32 bits and their value then): the
 * progress thread sleeps on it (futex) until the rank behind posts, instead of polling */
static _Atomic uint64_t *g_wait_ctr = NULL;
static uint32_t g_wait_val = 0;
static void thread_start(void);
static void thread_stop(void);

int64_t tera_shm_min_floats(void) {
    static int64_t v = -1;
    if (v < 0) {
        const char *e = getenv("TERA_COMM_SHM_MIN");
        v = e && atoll(e) > 0 ? atoll(e) : 1;
    }
    return v;
}

static _Atomic uint64_t *arrive_of(const tera_shm *s, int r) {
    return (_Atomic uint64_t *)(s->ctrl + (size_t)r * CTRL_BYTES);
}
static _Atomic uint64_t *done_of(const tera_shm *s, int r) {
    return (_Atomic uint64_t *)(s->ctrl + (size_t)r * CTRL_BYTES + 64);
}
static float *slot(const tera_shm *s, uint64_t set, int r) {
    return s->data + ((int64_t)(set & 1) * s->size + r) * s->ch;
}

/* Collective over comm: 1 on every rank when all of comm's ranks run on one host (the shared-memory
 * split of the group keeps all of it). */
static int on_one_host(MPI_Comm comm) {
    int size, rank;
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm node;
    int ok = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS;
    if (ok) {
        int nsize = 0;
        MPI_Comm_size(node, &nsize);
        MPI_Comm_free(&node);
        ok = nsize == size;
    }
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
    return ok;
}

tera_shm *tera_shm_create(MPI_Comm comm) {
    int size, rank;
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    const char *e = getenv("TERA_COMM_SHM");
    if (size < 2 || (e && !strcmp(e, "0"))) return NULL; /* the same environment on every rank */
    if (!on_one_host(comm)) return NULL;
    int ok = 1;
    /* slots of 8 MiB per set in all (1 Mi floats a rank on two ranks; TERA_COMM_SHM_FLOATS=N floats
     * instead, the same on every rank), at least 4 Ki floats a rank */
    const char *fe = getenv("TERA_COMM_SHM_FLOATS");
    int64_t ch = (fe && atoll(fe) > 0 ? atoll(fe) : SET_FLOATS) / size;
    ch = ch < 4096 ? 4096 : ch & ~(int64_t)63;
    const MPI_Aint bytes = rank == 0 ? (MPI_Aint)((size_t)size * CTRL_BYTES + sizeof(float) * 2 * (size_t)size * (size_t)ch) : 0;
    void *base = NULL;
    MPI_Win win = MPI_WIN_NULL;
    ok = MPI_Win_allocate_shared(bytes, 1, MPI_INFO_NULL, comm, &base, &win) == MPI_SUCCESS;
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
    if (!ok) {
        if (win != MPI_WIN_NULL) MPI_Win_free(&win);
        return NULL;
    }
    MPI_Aint qsize = 0;
    int disp = 0;
    unsigned char *seg = NULL;
    MPI_Win_shared_query(win, 0, &qsize, &disp, &seg);
    TERA_ASSERTF(seg && qsize >= (MPI_Aint)((size_t)size * CTRL_BYTES), "shared segment of %ld bytes", (long)qsize);
    tera_shm *s = tera_calloc(1, sizeof *s);
    *s = (tera_shm){.win = win, .rank = rank, .size = size, .ch = ch, .ctrl = seg,
                    .data = (float *)(seg + (size_t)size * CTRL_BYTES)};
    atomic_store_explicit(arrive_of(s, rank), 0, memory_order_relaxed);
    atomic_store_explicit(done_of(s, rank), 0, memory_order_relaxed);
    MPI_Barrier(comm); /* every counter zeroed before any rank starts */
    pthread_mutex_lock(&g_lock);
    s->next = g_groups;
    g_groups = s;
    pthread_mutex_unlock(&g_lock);
    thread_start();
    return s;
}

void tera_shm_free(tera_shm *s) {
    if (!s) return;
    pthread_mutex_lock(&g_lock);
    TERA_ASSERTF(!s->head, "shared-memory all-reduce still in flight when its group is freed");
    for (tera_shm **p = &g_groups; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            break;
        }
    const int last = g_groups == NULL;
    pthread_mutex_unlock(&g_lock);
    if (last) thread_stop(); /* started again by the next group made */
    MPI_Win_free(&s->win);
    free(s);
}

/* A POSIX shared-memory object (/dev/shm): rank 0 creates it under a name no other process uses,
 * reserves its pages (posix_fallocate: a block that does not fit fails here, not with SIGBUS at the
 * first touch of a page beyond the tmpfs's limit), every rank maps it, and rank 0 removes the name
 * once all have: nothing is left behind if the job dies. Freeing is munmap, on each rank by itself,
 * so a rank that leaves on an error of its own never waits for the others there. */
struct tera_shm_mem {
    void *map;
    size_t bytes;
};

tera_shm_mem *tera_shm_mem_create(MPI_Comm comm, size_t bytes, void **base) {
    *base = NULL;
    int size, rank;
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    const char *e = getenv("TERA_COMM_SHM");
    if (size < 2 || (e && !strcmp(e, "0")) || !on_one_host(comm)) return NULL;
    static unsigned g_blocks = 0; /* this process's blocks: part of the name */
    char name[64] = {0};
    int ok = 1, fd = -1;
    if (rank == 0) {
        snprintf(name, sizeof name, "/tera-%ld-%u-%lx", (long)getpid(), g_blocks++, (unsigned long)time(NULL));
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        ok = fd >= 0 && ftruncate(fd, (off_t)bytes) == 0 && posix_fallocate(fd, 0, (off_t)bytes) == 0;
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, comm);
    MPI_Bcast(name, (int)sizeof name, MPI_CHAR, 0, comm);
    if (ok && rank != 0) {
        fd = shm_open(name, O_RDWR, 0600);
        ok = fd >= 0;
    }
    void *map = ok ? mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (fd >= 0) close(fd);
    int all = map != MAP_FAILED;
    MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, comm); /* every rank has mapped it (or one failed) */
    if (rank == 0 && name[0]) shm_unlink(name);
    if (!all) {
        if (map != MAP_FAILED) munmap(map, bytes);
        return NULL;
    }
    tera_shm_mem *m = tera_calloc(1, sizeof *m);
    *m = (tera_shm_mem){.map = map, .bytes = bytes};
    *base = map; /* page-aligned */
    return m;
}

void tera_shm_mem_free(tera_shm_mem *m) {
    if (!m) return;
    munmap(m->map, m->bytes);
    free(m);
}

/* out[i] = slot_0[at + i] + slot_1[at + i] + ... + slot_{p-1}[at + i] for i in [0, n): in rank order
 * (the one order of every sum here). out may be slot 0 itself (the all-reduce sums in place). */
static void sum_slots(const tera_shm *s, uint64_t set, int64_t at, int64_t n, float *out) {
    const float *a = slot(s, set, 0) + at;
    if (out != a) memcpy(out, a, sizeof(float) * (size_t)n);
    for (int r = 1; r < s->size; r++) {
        const float *restrict b = slot(s, set, r) + at;
        float *restrict o = out;
        for (int64_t i = 0; i < n; i++) o[i] += b[i];
    }
}

/* The head operation is done when its last chunk is: off the queue. */
static void dequeue_if_done(tera_shm *s, tera_shm_op *op) {
    if (op->off < op->n) return;
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    op->next = NULL;
    /* the last touch of op: its owner may reuse it once it sees the flag (its buffer's writes before) */
    atomic_store_explicit(&op->done, 1, memory_order_release);
}

static int all_reached(const tera_shm *s, _Atomic uint64_t *(*ctr)(const tera_shm *, int), uint64_t k) {
    for (int r = 0; r < s->size; r++) {
        const uint64_t v = atomic_load_explicit(ctr(s, r), memory_order_acquire);
        if (v < k) {
            g_wait_ctr = ctr(s, r), g_wait_val = (uint32_t)v;
            return 0;
        }
    }
    return 1;
}

/* The futex word of a counter: its low 32 bits (the counters only grow, so a changed counter has
 * changed low bits until 2^32 chunks) */
static uint32_t *futex_word(_Atomic uint64_t *c) {
    return (uint32_t *)(void *)c + (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__);
}

static int thread_wanted(void);

/* A counter of this rank set to k, and the progress threads sleeping on it (any rank's) woken. The
 * segment is a shared mapping, so the futex is a shared one (no FUTEX_PRIVATE_FLAG). */
static void post(_Atomic uint64_t *c, uint64_t k) {
    atomic_store_explicit(c, k, memory_order_release);
    if (thread_wanted()) syscall(SYS_futex, futex_word(c), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static int64_t clamp0(int64_t x, int64_t hi) { return x < 0 ? 0 : x < hi ? x : hi; }

/* A reduce-scatter's or all-gather's chunk: the pieces [off, off + piece) of every rank's range.
 * Reduce-scatter: each rank copies its buffer's piece of every range into its slot (piece q at
 * q * piece), then sums piece `rank` over the slots in rank order into its own range. All-gather:
 * each rank copies its own range's piece into its slot, then every other rank's piece out of theirs.
 * Returns 0 while waiting for the other ranks' copies, 1 when the chunk is done. */
static int advance_ranges(tera_shm *s, tera_shm_op *op, uint64_t k, int *moved) {
    const int me = s->rank, p = s->size;
    const int64_t piece = op->kind == TERA_SHM_REDUCE_SCATTER ? (s->ch / p) & ~(int64_t)15 : s->ch;
    TERA_ASSERTF(piece > 0, "shared-memory reduce-scatter over %d ranks: slots of %ld floats", p, (long)s->ch);
    if (op->phase == 0) {
        float *mine = slot(s, k, me);
        if (op->kind == TERA_SHM_REDUCE_SCATTER) {
            for (int q = 0; q < p; q++) {
                const int64_t len = clamp0(op->cnt[q] - op->off, piece);
                if (len) memcpy(mine + q * piece, op->buf + op->disp[q] + op->off, sizeof(float) * (size_t)len);
            }
        } else {
            const int64_t len = clamp0(op->cnt[me] - op->off, piece);
            if (len) memcpy(mine, op->buf + op->disp[me] + op->off, sizeof(float) * (size_t)len);
        }
        post(arrive_of(s, me), k);
        op->phase = 1, *moved = 1;
    }
    if (!all_reached(s, arrive_of, k)) return 0;
    if (op->kind == TERA_SHM_REDUCE_SCATTER) {
        const int64_t len = clamp0(op->cnt[me] - op->off, piece);
        if (len) sum_slots(s, k, me * piece, len, op->buf + op->disp[me] + op->off);
    } else {
        for (int q = 0; q < p; q++) {
            const int64_t len = clamp0(op->cnt[q] - op->off, piece);
            if (q != me && len) memcpy(op->buf + op->disp[q] + op->off, slot(s, k, q), sizeof(float) * (size_t)len);
        }
    }
    op->off += piece;
    *moved = 1;
    return 1;
}

/* Advances the group's head operations as far as the other ranks allow; 1 when anything moved.
 * Slots: chunk k writes set k & 1; a rank writes set k & 1 again (chunk k + 2) only after every rank
 * arrived at chunk k + 1, that is after every rank finished reading chunk k's slots. */
static int advance(tera_shm *s) {
    int moved = 0;
    while (s->head) {
        tera_shm_op *op = s->head;
        if (op->kind != TERA_SHM_ALLREDUCE) {
            const uint64_t k = s->seq + 1;
            if (!advance_ranges(s, op, k, &moved)) return moved;
            s->seq = k;
            op->phase = 0;
            dequeue_if_done(s, op);
            continue;
        }
        const int64_t m = op->n - op->off < s->ch ? op->n - op->off : s->ch;
        const uint64_t k = s->seq + 1; /* this chunk's number; its set of slots: k & 1 */
        if (op->phase == 0) {
            memcpy(slot(s, k, s->rank), op->buf + op->off, sizeof(float) * (size_t)m);
            post(arrive_of(s, s->rank), k);
            op->phase = 1, moved = 1;
        }
        if (op->phase == 1) {
            if (!all_reached(s, arrive_of, k)) return moved;
            /* this rank's share of the chunk: 16-float aligned pieces */
            const int64_t per = ((m + s->size - 1) / s->size + 15) & ~(int64_t)15;
            const int64_t lo = (int64_t)s->rank * per < m ? (int64_t)s->rank * per : m;
            const int64_t hi = lo + per < m ? lo + per : m;
            if (hi > lo) sum_slots(s, k, lo, hi - lo, slot(s, k, 0) + lo);
            post(done_of(s, s->rank), k);
            op->phase = 2, moved = 1;
        }
        if (!all_reached(s, done_of, k)) return moved;
        memcpy(op->buf + op->off, slot(s, k, 0), sizeof(float) * (size_t)m);
        s->seq = k;
        op->off += m, op->phase = 0, moved = 1;
        dequeue_if_done(s, op);
    }
    return moved;
}

static void enqueue(tera_shm *s, tera_shm_op *op) {
    if (atomic_load_explicit(&op->done, memory_order_relaxed)) return;
    pthread_mutex_lock(&g_lock);
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    if (advance(s)) atomic_fetch_add_explicit(&g_moves, 1, memory_order_relaxed);
    if (g_thread_on) pthread_cond_signal(&g_work);
    pthread_mutex_unlock(&g_lock);
}

void tera_shm_start(tera_shm *s, tera_shm_op *op, float *buf, int64_t n) {
    *op = (tera_shm_op){.kind = TERA_SHM_ALLREDUCE, .buf = buf, .n = n};
    atomic_init(&op->done, n <= 0);
    enqueue(s, op);
}

void tera_shm_start_ranges(tera_shm *s, tera_shm_op *op, tera_shm_kind kind, float *buf, const int *cnt,
                           const int *disp) {
    int64_t longest = 0;
    for (int r = 0; r < s->size; r++) longest = cnt[r] > longest ? cnt[r] : longest;
    *op = (tera_shm_op){.kind = kind, .buf = buf, .n = longest, .cnt = cnt, .disp = disp};
    atomic_init(&op->done, longest <= 0);
    enqueue(s, op);
}

/* under g_lock: advances every group's queue; 1 when anything moved, *pending: 1 when anything is
 * still queued */
static int progress_locked(int *pending) {
    int moved = 0, left = 0;
    for (tera_shm *s = g_groups; s; s = s->next)
        if (s->head) {
            moved |= advance(s);
            left |= s->head != NULL;
        }
    if (moved) atomic_fetch_add_explicit(&g_moves, 1, memory_order_relaxed);
    if (pending) *pending = left;
    return moved;
}

int tera_shm_progress(void) {
    /* the progress thread holding the lock is advancing the queues itself: no need to wait for it */
    if (pthread_mutex_trylock(&g_lock) == 0) {
        progress_locked(NULL);
        pthread_mutex_unlock(&g_lock);
    }
    const uint64_t now = atomic_load_explicit(&g_moves, memory_order_relaxed);
    const int moved = now != t_moves_seen;
    t_moves_seen = now;
    return moved;
}

int tera_shm_done(const tera_shm_op *op) { return atomic_load_explicit(&op->done, memory_order_acquire); }

/* ---- the progress thread: advances the queues while the rank's own thread computes, so that a chunk
 * waits for the other ranks' progress threads, not for their next poll. Idle (nothing queued) it sleeps
 * on g_work; with operations queued that wait for another rank it sleeps on that rank's counter (a
 * futex the rank wakes when it posts, at most 1 ms, which also covers a new operation of another
 * group queued meanwhile). It never spins: a spinning thread would take the core from the rank's own
 * computation where ranks share cores; waking on a timer (tried first: naps of 20-200 us) cost ep2 on
 * bench-dist about 4% of its tokens/s (docs/PERFORMANCE.md, "Wave 14"), likely its context switches. */
static void *progress_main(void *arg) {
    (void)arg;
    sigset_t all; /* asynchronous signals are for the run's own threads (src/obs/registry.c); a fault here
                   * still reaches its handler (ASan's report, the crash message) */
    sigfillset(&all);
    const int sync_sigs[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS};
    for (size_t i = 0; i < sizeof sync_sigs / sizeof sync_sigs[0]; i++) sigdelset(&all, sync_sigs[i]);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    pthread_mutex_lock(&g_lock);
    while (!g_thread_stop) {
        int pending = 0;
        g_wait_ctr = NULL;
        const int moved = progress_locked(&pending);
        if (!pending) {
            pthread_cond_wait(&g_work, &g_lock);
            continue;
        }
        _Atomic uint64_t *const ctr = g_wait_ctr;
        const uint32_t val = g_wait_val;
        pthread_mutex_unlock(&g_lock);
        if (!moved && ctr) { /* returns at once when the counter moved since the advance read it */
            const struct timespec ms = {.tv_sec = 0, .tv_nsec = 1000000L};
            syscall(SYS_futex, futex_word(ctr), FUTEX_WAIT, val, &ms, NULL, 0);
        }
        pthread_mutex_lock(&g_lock);
    }
    pthread_mutex_unlock(&g_lock);
    return NULL;
}

/* TERA_COMM_SHM_THREAD=0: no progress thread (A/B timing): the queues advance in the polls and waits */
static int thread_wanted(void) {
    static int v = -1; /* the same environment on every rank */
    if (v < 0) {
        const char *e = getenv("TERA_COMM_SHM_THREAD");
        v = !(e && !strcmp(e, "0"));
    }
    return v;
}

/* under the lock throughout: the new thread waits for it before its first look at the queues */
static void thread_start(void) {
    pthread_mutex_lock(&g_lock);
    if (!g_thread_on && thread_wanted()) {
        g_thread_stop = 0;
        g_thread_on = pthread_create(&g_thread, NULL, progress_main, NULL) == 0;
    }
    pthread_mutex_unlock(&g_lock);
}

static void thread_stop(void) {
    pthread_mutex_lock(&g_lock);
    const int on = g_thread_on;
    g_thread_stop = 1;
    g_thread_on = 0;
    pthread_cond_signal(&g_work);
    pthread_mutex_unlock(&g_lock);
    if (on) pthread_join(g_thread, NULL);
}

int tera_shm_thread_running(void) {
    pthread_mutex_lock(&g_lock);
    const int on = g_thread_on;
    pthread_mutex_unlock(&g_lock);
    return on;
}
