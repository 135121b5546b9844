/* Shared-memory all-reduce of the MPI backend: see comm_shm.h. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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

tera_shm *tera_shm_create(MPI_Comm comm) {
    int size, rank;
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(comm, &rank);
    const char *e = getenv("TERA_COMM_SHM");
    if (size < 2 || (e && !strcmp(e, "0"))) return NULL; /* the same environment on every rank */
    /* every rank on one host: the shared-memory split of the group keeps all of it */
    MPI_Comm node;
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) != MPI_SUCCESS) return NULL;
    int nsize = 0;
    MPI_Comm_size(node, &nsize);
    MPI_Comm_free(&node);
    int ok = nsize == size;
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
    if (!ok) return NULL;
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
    s->next = g_groups;
    g_groups = s;
    return s;
}

void tera_shm_free(tera_shm *s) {
    if (!s) return;
    TERA_ASSERTF(!s->head, "shared-memory all-reduce still in flight when its group is freed");
    for (tera_shm **p = &g_groups; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            break;
        }
    MPI_Win_free(&s->win);
    free(s);
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
    op->done = 1;
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    op->next = NULL;
}

static int all_reached(const tera_shm *s, _Atomic uint64_t *(*ctr)(const tera_shm *, int), uint64_t k) {
    for (int r = 0; r < s->size; r++)
        if (atomic_load_explicit(ctr(s, r), memory_order_acquire) < k) return 0;
    return 1;
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
        atomic_store_explicit(arrive_of(s, me), k, memory_order_release);
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
            atomic_store_explicit(arrive_of(s, s->rank), k, memory_order_release);
            op->phase = 1, moved = 1;
        }
        if (op->phase == 1) {
            if (!all_reached(s, arrive_of, k)) return moved;
            /* this rank's share of the chunk: 16-float aligned pieces */
            const int64_t per = ((m + s->size - 1) / s->size + 15) & ~(int64_t)15;
            const int64_t lo = (int64_t)s->rank * per < m ? (int64_t)s->rank * per : m;
            const int64_t hi = lo + per < m ? lo + per : m;
            if (hi > lo) sum_slots(s, k, lo, hi - lo, slot(s, k, 0) + lo);
            atomic_store_explicit(done_of(s, s->rank), k, memory_order_release);
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
    if (op->done) return;
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    advance(s);
}

void tera_shm_start(tera_shm *s, tera_shm_op *op, float *buf, int64_t n) {
    *op = (tera_shm_op){.kind = TERA_SHM_ALLREDUCE, .buf = buf, .n = n, .done = n <= 0};
    enqueue(s, op);
}

void tera_shm_start_ranges(tera_shm *s, tera_shm_op *op, tera_shm_kind kind, float *buf, const int *cnt,
                           const int *disp) {
    int64_t longest = 0;
    for (int r = 0; r < s->size; r++) longest = cnt[r] > longest ? cnt[r] : longest;
    *op = (tera_shm_op){.kind = kind, .buf = buf, .n = longest, .cnt = cnt, .disp = disp, .done = longest <= 0};
    enqueue(s, op);
}

int tera_shm_progress(void) {
    int moved = 0;
    for (tera_shm *s = g_groups; s; s = s->next)
        if (s->head) moved |= advance(s);
    return moved;
}
