/* ZeRO sharding (include/tera/zero.h): which part of the optimizer state, the gradients and the
 * parameters each rank of a data-parallel layout holds, their reduction and the optimizer step on
 * them, and conversion to and from the whole model (the checkpoint windows). Works on the model,
 * the topology and the dp / edp communicators only (no trainer).
 *
 * Ranks: world rank = (pp_rank * dp + dp_rank) * tp + tp_rank (include/tera/topology.h). Inside
 * the data-parallel group, with expert parallelism, dp_rank = edp_rank * ep + ep_rank: consecutive
 * groups of ep ranks split the routed experts of every MoE layer (ep_rank r holds experts
 * [r E/ep, (r+1) E/ep)), and the dp/ep ranks with the same ep_rank (the expert-data-parallel group)
 * hold the same experts.
 *
 * Flat buffers hold this rank's blocks (its pipeline stages' tensors, their tensor-parallel slices)
 * of the non-expert tensors first, [0, n_dense), the same on every rank of the data-parallel group,
 * then this rank's slices of the expert tensors, [n_dense, n). Gradients of the first region are
 * summed over dp, of the second over edp. ZeRO (stage 1 and up) shards the first region's Adam
 * moments over dp and the second's over edp (stages 2 and 3 the gradients and parameters too, below);
 * the optimizer object opt holds the first region (or its shard), opt_x the second. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tera/ckpt.h"
#include "tera/comm_hier.h"
#include "tera/compress.h"
#include "tera/zero.h"

/* Consecutive 16-float aligned shards of n floats over w ranks. */
static void shard(int64_t n, int w, int64_t *counts, int64_t *lo_of) {
    const int64_t S = ((n + w - 1) / w + 15) & ~(int64_t)15;
    for (int r = 0; r < w; r++) {
        const int64_t lo = (int64_t)r * S < n ? (int64_t)r * S : n, hi = lo + S < n ? lo + S : n;
        counts[r] = hi - lo;
        lo_of[r] = lo;
    }
}

/* ------------------------------------------------------------------ ZeRO-2 and ZeRO-3
 * Stage 2: no whole gradient buffer. Before a group's backward the model asks for its gradients
 * (use_grads): they go to a staging slot, zeroed; when the group is done (grad_ready) each of its
 * two ranges is reduce-scattered over the ranks sharing it (non-expert: dp, experts: edp) and
 * every rank adds its piece into its shard's gradient (opt.g, opt_x.g), micro-batch by
 * micro-batch. Stage 3: no whole parameter buffer either. Before a group is used (use_params, in
 * forward and again in backward) its ranges are all-gathered from the shards' fp32 parameters
 * (opt.w, opt_x.w) into a staging slot; the slot is reused by the next group. Slots: the
 * embedding, the head, and one for the layer in use (the embedding and head slots live through a
 * whole backward: with tied embeddings both are in use from the first to the last op).
 *
 * Overlap: a group's reduce-scatters start non-blocking when it is done and complete while the
 * backward of the next group(s) computes (polled at every group hook, as stage 0's buckets are);
 * each rank's piece is added into its shard once its sum is complete, oldest first, so every shard
 * element receives the same additions in the same order as with blocking sums (and the backend's
 * non-blocking reduce-scatter sums as its blocking one does): the same bits. The layer slot has a
 * second gradient buffer (gspare): the next layer accumulates there while the previous layer's sum
 * is in flight; a buffer is reused only after its sums complete. The embedding and head slots wait
 * for theirs at their next use (the next micro-batch). Everything completes in
 * tera_zero_reduce_grads, before the optimizer. TERA_ZERO_RS_OVERLAP=0 in the environment: blocking
 * sums (A/B; the spare buffer is allocated either way, as `tera plan` counts it); hierarchical /
 * compressed reducers (zr->gred) always block. */
enum { SLOT_EMBED, SLOT_HEAD, SLOT_LAYER, N_SLOTS };

typedef struct {
    int group;              /* group held, or INT32_MIN */
    int64_t version;        /* ZeRO-3: parameter version (optimizer steps) it was gathered at */
    int live;               /* ZeRO-2: gradients accumulating (zeroed at first use in a backward) */
    int pending;            /* ZeRO-2: ranges not yet reduce-scattered */
    float *w[2], *g[2];     /* [non-expert, expert] staging */
} zslot;

/* ZeRO-3 prefetch: a second layer slot whose gather is in flight while the layer in use computes. */
typedef struct {
    int group;              /* group gathered or in flight, or INT32_MIN */
    int64_t version;        /* parameter version it was started at */
    float *w[2];            /* [non-expert, expert], the size of the layer slot's */
    tera_comm_req req[2];   /* the gathers in flight (the backend keeps their counts) */
} zprefetch;

/* A gradient reduce-scatter in flight: its buffer is not reused, nor its piece added, until it completes. */
typedef struct {
    tera_comm_req req;
    float *buf;       /* the staging buffer summed */
    const float *src; /* this rank's piece of the sum in it */
    float *dst;       /* where the piece is added: this rank's shard gradient */
    int64_t n;        /* floats of the piece */
    int x;            /* the range: 0 non-expert, 1 expert (buf is a slot's g[x]) */
    int comm;         /* over more than one rank */
    /* summed straight from the ranks' buffers in host-shared memory (zshgrad, below): */
    int shared;       /* 1: req unused; complete once every rank has posted gradient k */
    int ready;        /* a poll saw it complete */
    int b;            /* the ranks' buffer holding it */
    uint64_t k;       /* its number in the region's sequence */
    int64_t mine;     /* this rank's piece: offset in the buffer */
} zrs;
/* in flight at most: one sum on each range (non-expert, expert) of each gradient buffer (embedding,
 * head, layer, the layer's spare) */
enum { MAX_RS = 2 * (N_SLOTS + 1) };

/* ZeRO-3 on one host: a region's (non-expert or expert) layer parameters gathered in host-shared
 * memory (tera_comm_shared) where every rank sharing the region runs on one host. Two buffers of the
 * layer slot's size: the layer slot reads one (`bound`), the next gather writes the other (the
 * prefetch slot's). A gather is a publication: each rank copies its piece from its shard into the
 * buffer and posts its SH_PUB counter (publications are numbered alike on every rank: the ranks gather
 * the same layers in the same order, as their collectives already must); a rank using the layer waits
 * for every rank's SH_PUB, then reads the buffer in place (no copy out) and posts SH_CUR, the
 * publication it now reads. Before writing into the other buffer a rank waits until every rank's
 * SH_CUR has reached its own: none still reads that buffer's older contents. A prefetch finding a
 * rank not there yet leaves its piece to be written at the layer's use (`pending`). Copies only: the
 * same bits as the all-gather. Per rank and layer this moves its piece twice (read from the shard,
 * written once) instead of six times through the segment's slots (written in, copied out, and the
 * piece into its own slot), and the host holds the two buffers once instead of once per rank.
 * TERA_ZERO_SHARED=0 in the environment: the all-gathers (A/B; the same on every rank). */
enum { SH_PUB, SH_CUR, SH_FLAGS };

typedef struct {
    tera_comm_shared *s;    /* NULL: the region gathers by all-gather */
    float *buf[2];          /* in the block: [2][layer slot size] */
    int bound;              /* the buffer the layer slot reads */
    uint64_t pub;           /* publications started by this rank (the same count on every rank) */
    uint64_t cur;           /* the publication the layer slot reads (0: none yet) */
    uint64_t pending;       /* a started publication whose piece is not written yet (0: none) */
    int64_t pend_mine, pend_soff, pend_n; /* its piece: offset in the buffer, in the shard, floats */
} zshared;

/* ZeRO-2/3 on one host: the layer slot's gradient buffers of a region in host-shared memory, two per
 * rank ([rank][2][layer slot size]), where every rank sharing the region runs on one host. The
 * backward writes this rank's own buffer; when the region is final (grad_ready) the rank posts
 * SG_GRD = k (the region's k-th gradient, numbered alike on every rank), and once every rank has
 * posted k it adds its piece's sum straight from the ranks' buffers into its shard's gradient,
 * t = g_0 + g_1 + ... in rank order, then dst += t (the segment's reduce-scatter adds in the same
 * order: the same bits), and posts SG_SUMD = k. The layer slot alternates between the two buffers
 * use by use (the same buffer on every rank), and takes one back only once every rank has posted
 * SG_SUMD for the gradient it held. Per rank and layer this reads the piece from each rank's buffer
 * and adds it into the shard (about 4 floats of memory traffic per float of the piece on two ranks)
 * instead of copying the whole buffer in, summing, and copying the sum back out (about 11). The same
 * switch as the gathers: TERA_ZERO_SHARED=0. */
enum { SG_GRD, SG_SUMD, SG_FLAGS };
typedef struct {
    tera_comm_shared *s;    /* NULL: the region sums by reduce-scatter */
    float *base;            /* [ranks][2][n] */
    int64_t n;              /* floats of one buffer */
    int ranks, me;
    uint64_t k;             /* gradients posted by this rank */
    uint64_t k_of[2];       /* the gradient each of this rank's buffers held last (0: none) */
} zshgrad;

typedef struct tera_zero_staging tera_zero_staging;
struct tera_zero_staging {
    zshared sh[2];          /* ZeRO-3 on one host: [non-expert, expert] (see above) */
    zshgrad shg[2];         /* ZeRO-2/3 on one host: [non-expert, expert] gradients (see above) */
    int gl_b;               /* with shg: the buffer the layer slot's gradients use (alternating) */
    float *gpriv[2][2];     /* with shg: [x][buffer] the layer slot's two gradient buffers */
    int64_t n_shared;       /* layer gathers through host-shared memory */
    int64_t n_shg;          /* layer gradient sums through host-shared memory */
    zslot slot[N_SLOTS];
    int vocab_shared;       /* untied embeddings: the embedding and head slots share their gradient buffer */
    int64_t version;
    float *block;
    int64_t *cnt;           /* [max(dp, edp)] reduce-scatter / all-gather counts */
    int prefetch;           /* ZeRO-3 prefetch on (parallel.zero_prefetch, no pipeline) */
    zprefetch pf;
    int dir;                /* +1 forward, -1 backward: the order layers are used in */
    int last_layer;         /* the layer group used last, or INT32_MIN */
    int plan;               /* pipeline: the executor names the order of use (tera_zero_plan) */
    int plan_last, plan_next; /* the current operation's last layer in its order of use, the next's first (-1: none) */
    int64_t n_gathered, n_prefetched, n_unused; /* layer gathers: all, of them prefetched, prefetches never used */
    float *gspare[2];       /* [non-expert, expert] the layer slot's second gradient buffer (see Overlap) */
    int rs_overlap;         /* gradient reduce-scatters non-blocking (TERA_ZERO_RS_OVERLAP != 0, no zr->gred) */
    zrs rs[MAX_RS];         /* in flight, oldest first from rs_head (a ring of rs_len) */
    int rs_head, rs_len;
    int64_t n_rs, n_rs_nb, n_rs_early; /* sums over several ranks: all, started non-blocking, complete before their wait */
};

static int slot_of(int group) { return group == TERA_GROUP_EMBED ? SLOT_EMBED : group == TERA_GROUP_HEAD ? SLOT_HEAD : SLOT_LAYER; }

/* t[0..nb) = the sum of `ranks` buffers `stride` floats apart at base + at, buffer which[r] (NULL: r) of
 * member r: in rank order, the order of the segment's sums (the same bits) */
static void sum_over_ranks(float *restrict t, const float *base, int64_t stride, int ranks, const int *which, int64_t at,
                           int64_t nb) {
    memcpy(t, base + (which ? which[0] : 0) * stride + at, sizeof(float) * (size_t)nb);
    for (int r = 1; r < ranks; r++) {
        const float *restrict g = base + (which ? which[r] : r) * stride + at;
        for (int64_t i = 0; i < nb; i++) t[i] += g[i];
    }
}
enum { SUM_BLOCK = 1024 }; /* floats of t: it stays in L1 between the ranks' passes */

/* Completes the oldest sum in flight and adds this rank's piece into its shard. */
static void rs_finish_oldest(tera_zero_staging *z) {
    TERA_ASSERT(z->rs_len > 0);
    zrs *e = &z->rs[z->rs_head];
    if (e->shared) {
        zshgrad *h = &z->shg[e->x];
        if (e->ready) z->n_rs_early++;
        tera_comm_shared_wait(h->s, SG_GRD, e->k, TERA_TRAFFIC_REDUCE_SCATTER);
        const int64_t stride = 2 * h->n, off = (int64_t)e->b * h->n + e->mine;
        float *restrict dst = e->dst;
        for (int64_t i0 = 0; i0 < e->n; i0 += SUM_BLOCK) {
            const int64_t nb = e->n - i0 < SUM_BLOCK ? e->n - i0 : SUM_BLOCK;
            float t[SUM_BLOCK];
            sum_over_ranks(t, h->base, stride, h->ranks, NULL, off + i0, nb);
            for (int64_t i = 0; i < nb; i++) dst[i0 + i] += t[i];
        }
        tera_comm_shared_post(h->s, SG_SUMD, e->k);
    } else {
        if (e->comm && !e->req.active) z->n_rs_early++; /* done while compute ran (a poll saw it) */
        tera_comm_wait(&e->req);
        float *dst = e->dst;
        const float *src = e->src;
        for (int64_t i = 0; i < e->n; i++) dst[i] += src[i];
    }
    z->rs_head = (z->rs_head + 1) % MAX_RS;
    z->rs_len--;
}

static int rs_done(const zrs *e) { return e->shared ? e->ready : !e->req.active; }

/* Lets the sums in flight progress (the MPI backend has no progress thread) and adds the pieces of
 * those complete, oldest first, stopping at the first still in flight. */
static void rs_progress(tera_zero_staging *z) {
    for (int i = 0; i < z->rs_len; i++) {
        zrs *e = &z->rs[(z->rs_head + i) % MAX_RS];
        if (e->shared && !e->ready) e->ready = tera_comm_shared_reached(z->shg[e->x].s, SG_GRD, e->k);
        else if (e->req.active) tera_comm_poll(&e->req, 1);
    }
    while (z->rs_len > 0 && rs_done(&z->rs[z->rs_head])) rs_finish_oldest(z);
}

/* Whether a sum in flight reads one of a slot's buffers g[0], g[1] (compared range by range: an
 * empty buffer may share its address with the next one). */
static int rs_busy(const tera_zero_staging *z, float *const g[2]) {
    for (int i = 0; i < z->rs_len; i++) {
        const zrs *e = &z->rs[(z->rs_head + i) % MAX_RS];
        if (e->buf == g[e->x]) return 1;
    }
    return 0;
}

/* Completes every sum up to the last one reading g[0] or g[1] (oldest first: the order of additions). */
static void rs_release(tera_zero_staging *z, float *const g[2]) {
    while (rs_busy(z, g)) rs_finish_oldest(z);
}

static void rs_drain(tera_zero_staging *z) {
    while (z && z->rs_len > 0) rs_finish_oldest(z);
}

/* Counts of [lo, hi) per rank of a region's shards (counts[r] floats from the region start at
 * lo_r = sum of earlier counts); returns the offset inside [lo, hi) of this rank's piece. */
static int64_t piece_counts(const int64_t *shard_counts, int ranks, int me, int64_t lo, int64_t hi, int64_t *cnt,
                            int64_t *my_shard_off) {
    int64_t s0 = 0, mine = 0;
    *my_shard_off = 0;
    for (int r = 0; r < ranks; r++) {
        const int64_t s1 = s0 + shard_counts[r];
        const int64_t a = lo > s0 ? lo : s0, b = hi < s1 ? hi : s1;
        cnt[r] = b > a ? b - a : 0;
        if (r == me && cnt[r] > 0) {
            mine = a - lo;
            *my_shard_off = a - s0;
        }
        s0 = s1;
    }
    return mine;
}

static int64_t up16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* The gradient buffer's size of slot k: untied, the embedding's holds the head's too (the head's none). */
static int64_t grad_slot_floats(const int64_t size[N_SLOTS][2], int k, int x, int tied) {
    if (tied || k == SLOT_LAYER) return up16(size[k][x]);
    if (k == SLOT_HEAD) return 0;
    return up16(size[SLOT_EMBED][x] > size[SLOT_HEAD][x] ? size[SLOT_EMBED][x] : size[SLOT_HEAD][x]);
}

int64_t tera_zero_staging_floats(const int64_t size[3][2], int stage, int prefetch, int tied) {
    int64_t total = 0;
    for (int k = 0; k < N_SLOTS; k++)
        for (int x = 0; x < 2; x++)
            total += grad_slot_floats(size, k, x, tied) + (stage >= 3 ? up16(size[k][x]) : 0);
    for (int x = 0; x < 2; x++) total += (stage >= 3 && prefetch ? 2 : 1) * up16(size[SLOT_LAYER][x]);
    return total;
}

static void zero23_init(tera_zero *zr, const tera_zero_env *env) {
    tera_model *m = zr->model;
    tera_zero_staging *z = tera_calloc(1, sizeof *z);
    zr->zs = z;
    int64_t size[N_SLOTS][2] = {{0}};
    for (int g = TERA_GROUP_HEAD; g < m->cfg.n_layers; g++)
        for (int x = 0; x < 2; x++) {
            int64_t lo, hi;
            tera_model_group_range(m, g, x, &lo, &hi);
            int64_t *sz = &size[slot_of(g)][x];
            if (hi - lo > *sz) *sz = hi - lo;
        }
    int64_t total = 0, shared = 0;
    const int nb = zr->stage >= 3 ? 2 : 1; /* gradient staging, and parameter staging for stage 3 */
    z->prefetch = zr->stage >= 3 && env->prefetch;
    z->plan = env->planned;
    z->plan_last = z->plan_next = -1;
    /* the layer slots in host-shared memory, region by region (zshared, zshgrad; collective over the
     * region's ranks: every rank creates them in the same order; none with the hierarchical or
     * compressed reducers, whose sums and gathers stay theirs) */
    const int shared_on = zr->host_shared;
    for (int x = 0; x < 2 && shared_on; x++) { /* the layer slot's gradients (stages 2 and 3) */
        const int64_t n = (size[SLOT_LAYER][x] + 15) & ~(int64_t)15;
        tera_comm *c = x ? zr->edp : zr->dp;
        if (n == 0 || tera_comm_size(c) < 2) continue;
        zshgrad *h = &z->shg[x];
        h->ranks = tera_comm_size(c);
        h->me = tera_comm_rank(c);
        h->n = n;
        h->s = tera_comm_shared_create(c, (int64_t)sizeof(float) * 2 * n * h->ranks, SG_FLAGS);
        if (!h->s) continue;
        h->base = tera_comm_shared_mem(h->s);
        shared += 2 * n; /* this rank's two buffers: what its private slot and spare would hold */
    }
    for (int x = 0; x < 2 && shared_on && zr->stage >= 3; x++) { /* the layer slot's parameters (stage 3) */
        const int64_t n = (size[SLOT_LAYER][x] + 15) & ~(int64_t)15;
        tera_comm *c = x ? zr->edp : zr->dp;
        if (n == 0 || tera_comm_size(c) < 2) continue;
        zshared *h = &z->sh[x];
        h->s = tera_comm_shared_create(c, (int64_t)sizeof(float) * 2 * n, SH_FLAGS);
        if (!h->s) continue;
        h->buf[0] = tera_comm_shared_mem(h->s);
        h->buf[1] = h->buf[0] + n;
        shared += (1 + z->prefetch) * n; /* what the private slots would hold (the accounting counts it) */
    }
    const int tied = m->cfg.tie_embeddings;
    z->vocab_shared = !tied;
    total = tera_zero_staging_floats(size, zr->stage, z->prefetch, tied); /* the slots, spare and prefetch buffers */
    z->block = tera_calloc((size_t)(total - shared) + 1, sizeof(float));
    float *p = z->block;
    for (int k = 0; k < N_SLOTS; k++) {
        z->slot[k].group = INT32_MIN;
        for (int x = 0; x < 2; x++) {
            const int64_t n = up16(size[k][x]);
            if (k == SLOT_LAYER && z->shg[x].s)
                z->slot[k].g[x] = z->shg[x].base + (int64_t)z->shg[x].me * 2 * n;
            else if (k == SLOT_HEAD && !tied) /* untied: the embedding's buffer (tera_zero_staging_floats) */
                z->slot[k].g[x] = z->slot[SLOT_EMBED].g[x];
            else
                z->slot[k].g[x] = p, p += grad_slot_floats(size, k, x, tied);
            if (nb == 2 && k == SLOT_LAYER && z->sh[x].s)
                z->slot[k].w[x] = z->sh[x].buf[0];
            else if (nb == 2)
                z->slot[k].w[x] = p, p += n;
        }
    }
    const int ranks = zr->topo.dp > zr->topo.edp ? zr->topo.dp : zr->topo.edp;
    z->pf.group = z->last_layer = INT32_MIN;
    z->dir = 1;
    if (z->prefetch) {
        for (int x = 0; x < 2; x++) {
            if (z->sh[x].s)
                z->pf.w[x] = z->sh[x].buf[1];
            else
                z->pf.w[x] = p, p += (size[SLOT_LAYER][x] + 15) & ~(int64_t)15;
        }
    }
    for (int x = 0; x < 2; x++) {
        if (z->shg[x].s)
            z->gspare[x] = z->slot[SLOT_LAYER].g[x] + z->shg[x].n;
        else
            z->gspare[x] = p, p += (size[SLOT_LAYER][x] + 15) & ~(int64_t)15;
    }
    for (int x = 0; x < 2; x++) { /* with shared gradients the layer slot alternates buffers strictly */
        z->gpriv[x][0] = z->slot[SLOT_LAYER].g[x];
        z->gpriv[x][1] = z->gspare[x];
    }
    TERA_ASSERTF(p - z->block == total - shared, "ZeRO staging: %ld floats carved, %ld allocated", (long)(p - z->block),
                 (long)(total - shared));
    z->rs_overlap = zr->rs_overlap;
    z->cnt = tera_calloc((size_t)ranks, sizeof(int64_t));
    /* the shards' gradients (and parameters for stage 3) */
    tera_adamw *o[2] = {&zr->opt, &zr->opt_x};
    for (int k = 0; k < 2; k++) {
        o[k]->g = tera_calloc((size_t)o[k]->n + 1, sizeof(float));
        if (zr->stage >= 3) o[k]->w = tera_calloc((size_t)o[k]->n + 1, sizeof(float));
    }
    /* memory accounting: the shards; the staging slots are communication buffers */
    m->bytes_grads = (int64_t)sizeof(float) * (o[0]->n + o[1]->n);
    if (zr->stage >= 3) m->bytes_params = (int64_t)sizeof(float) * (o[0]->n + o[1]->n);
    zr->bytes_staging = (int64_t)sizeof(float) * total;
}

static void zero23_free(tera_zero *zr) {
    tera_zero_staging *z = zr->zs;
    if (!z) return;
    rs_drain(z);                   /* gradient sums still in flight */
    tera_comm_wait(&z->pf.req[0]); /* a prefetch still in flight (inactive requests return at once) */
    tera_comm_wait(&z->pf.req[1]);
    free(z->block);
    free(z->cnt);
    for (int x = 0; x < 2; x++) { /* (this rank's views: not collective) */
        tera_comm_shared_free(z->sh[x].s);
        tera_comm_shared_free(z->shg[x].s);
    }
    free(z);
    zr->zs = NULL;
    tera_adamw *o[2] = {&zr->opt, &zr->opt_x};
    for (int k = 0; k < 2; k++) {
        free(o[k]->g), o[k]->g = NULL;
        free(o[k]->w), o[k]->w = NULL;
    }
}

/* The pieces of the flat range [lo, hi) of region x (0: non-expert, sharded over dp; 1: experts,
 * over edp) that each rank's shard holds: z->cnt[r] floats each, in rank order. */
typedef struct {
    tera_comm *c;    /* the ranks sharing the region */
    tera_adamw *o;   /* this rank's shard of it */
    int me;          /* this rank in c */
    int64_t mine;    /* offset of this rank's piece inside [lo, hi) */
    int64_t soff;    /* offset of this rank's piece inside its shard */
} zpiece;

static zpiece pieces(tera_zero *zr, int x, int64_t lo, int64_t hi) {
    zpiece p = {.c = x ? zr->edp : zr->dp, .o = x ? &zr->opt_x : &zr->opt, .me = x ? zr->topo.edp_rank : zr->topo.dp_rank};
    const int64_t base = x ? zr->model->n_dense_floats : 0;
    p.mine = piece_counts(x ? zr->shard_counts_x : zr->shard_counts, x ? zr->topo.edp : zr->topo.dp, p.me, lo - base,
                          hi - base, zr->zs->cnt, &p.soff);
    return p;
}

/* ---- ZeRO-3 in host-shared memory (zshared, above) */
/* Writes this rank's piece of the started publication into the buffer the layer slot does not read,
 * and posts it. */
static void sh_write(tera_zero *zr, int x) {
    zshared *h = &zr->zs->sh[x];
    const tera_adamw *o = x ? &zr->opt_x : &zr->opt;
    if (h->pend_n > 0)
        memcpy(h->buf[1 - h->bound] + h->pend_mine, o->w + h->pend_soff, sizeof(float) * (size_t)h->pend_n);
    tera_comm_shared_post(h->s, SH_PUB, h->pending);
    h->pending = 0;
}

/* Starts a publication of region x's piece p: written now when every rank already reads this rank's
 * current publication (so none reads the other buffer), else at its use. A started publication that
 * was never used and whose piece is still unwritten is dropped: no rank reads it. */
static void sh_start(tera_zero *zr, int x, const zpiece *p) {
    tera_zero_staging *z = zr->zs;
    zshared *h = &z->sh[x];
    h->pending = ++h->pub;
    h->pend_mine = p->mine, h->pend_soff = p->soff, h->pend_n = z->cnt[p->me];
    tera_comm_shared_count(h->s, TERA_TRAFFIC_ALLGATHER, z->cnt);
    if (tera_comm_shared_reached(h->s, SH_CUR, h->cur)) sh_write(zr, x);
}

/* The layer slot takes region x's last started publication: this rank's piece written (once every
 * rank reads its current one), every rank's piece there; then this rank reads it (SH_CUR). */
static void sh_use(tera_zero *zr, int x) {
    zshared *h = &zr->zs->sh[x];
    if (h->pending) {
        tera_comm_shared_wait(h->s, SH_CUR, h->cur, TERA_TRAFFIC_ALLGATHER);
        sh_write(zr, x);
    }
    tera_comm_shared_wait(h->s, SH_PUB, h->pub, TERA_TRAFFIC_ALLGATHER);
    h->bound = 1 - h->bound;
    h->cur = h->pub;
    tera_comm_shared_post(h->s, SH_CUR, h->cur);
}

/* Gathers a group's ranges into w (each rank copies its piece in, then all-gather): blocking, or
 * started into the prefetch slot when pf is given. A layer's region in host-shared memory is started
 * instead (into the buffer the layer slot does not read, whatever w is; sh_use completes it). */
static void gather_group(tera_zero *zr, int group, float *const w[2], zprefetch *pf) {
    tera_zero_staging *z = zr->zs;
    for (int x = 0; x < 2; x++) {
        int64_t lo, hi;
        tera_model_group_range(zr->model, group, x, &lo, &hi);
        if (hi <= lo) continue;
        const zpiece p = pieces(zr, x, lo, hi);
        if (group >= 0 && z->sh[x].s) {
            sh_start(zr, x, &p);
            continue;
        }
        if (z->cnt[p.me] > 0) memcpy(w[x] + p.mine, p.o->w + p.soff, sizeof(float) * (size_t)z->cnt[p.me]);
        if (pf)
            tera_comm_iallgather_f32(p.c, w[x], z->cnt, &pf->req[x]);
        else if (zr->gred[x])
            tera_greducer_allgather(zr->gred[x], w[x], z->cnt);
        else
            tera_comm_allgather_f32(p.c, w[x], z->cnt);
    }
}

/* Starts gathering layer `group` into the prefetch slot unless it is in use, already there, or
 * not a layer. A prefetch that was not used is completed first (every rank posts the same
 * collectives in the same order, so no rank is left waiting). */
static void prefetch_start(tera_zero *zr, int group) {
    tera_zero_staging *z = zr->zs;
    zprefetch *pf = &z->pf;
    const zslot *sl = &z->slot[SLOT_LAYER];
    if (group < 0 || group >= zr->model->cfg.n_layers) return;
    if ((sl->group == group && sl->version == z->version) || (pf->group == group && pf->version == z->version)) return;
    tera_comm_wait(&pf->req[0]);
    tera_comm_wait(&pf->req[1]);
    if (pf->group != INT32_MIN) z->n_unused++;
    pf->group = group;
    pf->version = z->version;
    gather_group(zr, group, pf->w, pf);
}

static void zero_use_params(void *ctx, int group) {
    tera_zero *zr = ctx;
    tera_zero_staging *z = zr->zs;
    rs_progress(z); /* gradient sums in flight (backward) */
    zslot *sl = &z->slot[slot_of(group)];
    if (sl->group != group || sl->version != z->version) {
        zprefetch *pf = &z->pf;
        const int shared = group >= 0 && (z->sh[0].s || z->sh[1].s);
        if (z->prefetch && group >= 0 && pf->group == group && pf->version == z->version) {
            /* prefetched: finish it and swap the slots (the layer slot's old contents become the
             * next prefetch's buffer; host-shared regions below) */
            for (int x = 0; x < 2; x++) {
                if (z->sh[x].s) continue;
                tera_comm_wait(&pf->req[x]);
                float *t = sl->w[x];
                sl->w[x] = pf->w[x], pf->w[x] = t;
            }
            pf->group = INT32_MIN;
            z->n_prefetched++;
        } else {
            if (shared && pf->group != INT32_MIN) { /* its host-shared buffers are taken: not used */
                tera_comm_wait(&pf->req[0]);
                tera_comm_wait(&pf->req[1]);
                pf->group = INT32_MIN;
                z->n_unused++;
            }
            gather_group(zr, group, sl->w, NULL);
        }
        for (int x = 0; x < 2 && shared; x++) {
            int64_t lo, hi;
            tera_model_group_range(zr->model, group, x, &lo, &hi);
            if (!z->sh[x].s || hi <= lo) continue;
            sh_use(zr, x);
            sl->w[x] = z->sh[x].buf[z->sh[x].bound];
            if (z->prefetch) pf->w[x] = z->sh[x].buf[1 - z->sh[x].bound];
        }
        z->n_shared += shared;
        if (group >= 0) z->n_gathered++;
        sl->group = group;
        sl->version = z->version;
        tera_model_bind_group(zr->model, group, sl->w[0], sl->w[1], NULL, NULL);
    }
    if (!z->prefetch) return;
    if (z->plan) { /* a pipeline stage: the executor said which layer comes after this operation */
        if (group < 0 || z->plan_last < 0) return;
        prefetch_start(zr, group == z->plan_last ? z->plan_next : group + (z->plan_last > group ? 1 : -1));
        return;
    }
    /* the next layer in the order of use: forward starts at the embedding (layers ascending), backward
     * at the head (descending) */
    const int L = zr->model->cfg.n_layers;
    int next;
    if (group == TERA_GROUP_EMBED && zr->model->cfg.tie_embeddings && z->dir == -1 && z->last_layer == L - 1) {
        next = L - 1; /* the tied embedding as the LM head: backward comes next */
    } else if (group == TERA_GROUP_EMBED) {
        z->dir = 1;
        next = 0;
    } else if (group == TERA_GROUP_HEAD) {
        z->dir = -1;
        next = L - 1;
    } else {
        /* a step to a neighbour tells the direction (a jump, as from the last layer back to layer 0
         * between two forwards, does not: the embedding or the head has set it) */
        if (z->last_layer != INT32_MIN && (group == z->last_layer + 1 || group == z->last_layer - 1))
            z->dir = group > z->last_layer ? 1 : -1;
        z->last_layer = group;
        next = group + z->dir;
    }
    prefetch_start(zr, next);
}

static void zero_use_grads(void *ctx, int group) {
    tera_zero *zr = ctx;
    tera_zero_staging *z = zr->zs;
    if (zr->local_g) { /* 1-bit Adam past its freeze: this rank's own whole gradient (tera_zero_local_grads) */
        int64_t lo[2], hi[2];
        for (int x = 0; x < 2; x++) tera_model_group_range(zr->model, group, x, &lo[x], &hi[x]);
        tera_model_bind_group(zr->model, group, NULL, NULL, zr->local_g + lo[0], zr->local_g + lo[1]);
        return;
    }
    zslot *sl = &z->slot[slot_of(group)];
    if (sl->live && sl->group == group) return; /* accumulating since earlier in this backward */
    TERA_ASSERTF(!sl->live, "ZeRO-2: group %d's gradients were never reduced", sl->group);
    if (z->vocab_shared && sl != &z->slot[SLOT_LAYER]) { /* the other vocabulary slot's sums read this buffer */
        const zslot *o = &z->slot[sl == &z->slot[SLOT_EMBED] ? SLOT_HEAD : SLOT_EMBED];
        TERA_ASSERTF(!o->live, "ZeRO-2: group %d's gradients, in the buffer group %d takes, were never reduced",
                     o->group, group);
    }
    rs_progress(z);
    const int shg = sl == &z->slot[SLOT_LAYER] && (z->shg[0].s || z->shg[1].s);
    if (shg) { /* host-shared gradients: the other buffer, every use (the same on every rank) */
        z->gl_b ^= 1;
        for (int x = 0; x < 2; x++) sl->g[x] = z->gpriv[x][z->gl_b];
    } else if (sl == &z->slot[SLOT_LAYER] && rs_busy(z, sl->g)) { /* the previous layer's sums in flight: the other buffer */
        for (int x = 0; x < 2; x++) {
            float *t = sl->g[x];
            sl->g[x] = z->gspare[x], z->gspare[x] = t;
        }
    }
    rs_release(z, sl->g); /* sums still reading the buffers now taken (the layer before last's, the last micro-batch's) */
    for (int x = 0; x < 2 && shg; x++) /* ... and every rank's sums reading this rank's buffer */
        if (z->shg[x].s) tera_comm_shared_wait(z->shg[x].s, SG_SUMD, z->shg[x].k_of[z->gl_b], TERA_TRAFFIC_REDUCE_SCATTER);
    sl->live = 1;
    sl->pending = 0;
    for (int x = 0; x < 2; x++) {
        int64_t lo, hi;
        tera_model_group_range(zr->model, group, x, &lo, &hi);
        if (hi == lo) continue;
        sl->pending++;
        if (!zr->grads_lazy) {
            memset(sl->g[x], 0, sizeof(float) * (size_t)(hi - lo));
            continue;
        }
        /* stored by the group's backward (below); only the alignment gaps between its tensors, which
         * no backward writes and the sums read, are zeroed (test hook: the tensors' old values NaN) */
        if (zr->stale_nan)
            for (int64_t i = 0; i < hi - lo; i++) sl->g[x][i] = NAN;
        tera_model_group_zero_gaps(zr->model, group, x, sl->g[x]);
    }
    sl->group = group;
    tera_model_bind_group(zr->model, group, NULL, NULL, sl->g[0], sl->g[1]);
    if (zr->grads_lazy) tera_model_grads_stale(zr->model, group);
}

/* A group range's gradients are final for this micro-batch: sum them into the owners' shards. */
static void zero_grad_ready(void *ctx, int64_t offset, int64_t count) {
    tera_zero *zr = ctx;
    tera_zero_staging *z = zr->zs;
    const int x = offset >= zr->model->n_dense_floats;
    zslot *sl = NULL;
    for (int k = 0; k < N_SLOTS; k++) {
        if (!z->slot[k].live) continue;
        int64_t lo, hi;
        tera_model_group_range(zr->model, z->slot[k].group, x, &lo, &hi);
        if (lo == offset && hi == offset + count) sl = &z->slot[k];
    }
    TERA_ASSERTF(sl, "ZeRO-2: gradients of [%ld, %ld) are in no live slot", (long)offset, (long)(offset + count));
    const zpiece p = pieces(zr, x, offset, offset + count);
    if (zr->poison && count > 0) { /* test hook: a NaN in this rank's own gradient */
        sl->g[x][0] = NAN;
        zr->poison = 0;
    }
    const int comm = tera_comm_size(p.c) > 1;
    z->n_rs += comm;
    if (sl == &z->slot[SLOT_LAYER] && z->shg[x].s) { /* host-shared: posted now, summed once every rank has */
        zshgrad *h = &z->shg[x];
        TERA_ASSERTF(sl->g[x] == h->base + ((int64_t)h->me * 2 + z->gl_b) * h->n, "ZeRO-2: layer gradients outside the shared block");
        TERA_ASSERTF(z->rs_len < MAX_RS, "ZeRO-2: more than %d gradient sums in flight", MAX_RS);
        h->k_of[z->gl_b] = ++h->k;
        z->n_shg++;
        tera_comm_shared_post(h->s, SG_GRD, h->k);
        tera_comm_shared_count(h->s, TERA_TRAFFIC_REDUCE_SCATTER, z->cnt);
        zrs *e = &z->rs[(z->rs_head + z->rs_len++) % MAX_RS];
        *e = (zrs){.buf = sl->g[x], .dst = p.o->g + p.soff, .n = z->cnt[p.me], .x = x, .comm = 1, .shared = 1,
                   .b = z->gl_b, .k = h->k, .mine = p.mine};
        if (z->rs_overlap) {
            z->n_rs_nb++;
            rs_progress(z);
        } else {
            rs_drain(z);
        }
    } else if (z->rs_overlap) { /* started now, its piece added once complete (see Overlap) */
        TERA_ASSERTF(z->rs_len < MAX_RS, "ZeRO-2: more than %d gradient sums in flight", MAX_RS);
        zrs *e = &z->rs[(z->rs_head + z->rs_len++) % MAX_RS];
        *e = (zrs){.buf = sl->g[x], .src = sl->g[x] + p.mine, .dst = p.o->g + p.soff, .n = z->cnt[p.me], .x = x, .comm = comm};
        tera_comm_ireduce_scatter_f32(p.c, sl->g[x], z->cnt, &e->req);
        z->n_rs_nb += comm && e->req.active;
        rs_progress(z);
    } else {
        if (zr->gred[x]) /* hierarchical / compressed (error feedback indexed by the region's offsets) */
            tera_greducer_reduce_scatter(zr->gred[x], sl->g[x], offset - (x ? zr->model->n_dense_floats : 0), z->cnt);
        else
            tera_comm_reduce_scatter_f32(p.c, sl->g[x], z->cnt);
        const float *src = sl->g[x] + p.mine;
        float *dst = p.o->g + p.soff;
        for (int64_t i = 0; i < z->cnt[p.me]; i++) dst[i] += src[i];
    }
    if (--sl->pending == 0) sl->live = 0;
}

void tera_zero_plan(tera_zero *zr, int last, int next) {
    tera_zero_staging *z = zr->zs;
    if (!z || !z->plan) return;
    z->plan_last = last;
    z->plan_next = next;
}

void tera_zero_rs_counts(const tera_zero *zr, int64_t *total, int64_t *nonblocking, int64_t *early) {
    const tera_zero_staging *z = zr ? zr->zs : NULL;
    *total = z ? z->n_rs : zr ? zr->rs1[0] : 0;
    *nonblocking = z ? z->n_rs_nb : zr ? zr->rs1[1] : 0;
    *early = z ? z->n_rs_early : zr ? zr->rs1[2] : 0;
}

void tera_zero_counts(const tera_zero *zr, int64_t *gathered, int64_t *prefetched, int64_t *unused, int64_t *shared) {
    const tera_zero_staging *z = zr ? zr->zs : NULL;
    *gathered = z ? z->n_gathered : 0;
    *prefetched = z ? z->n_prefetched : 0;
    *unused = z ? z->n_unused : 0;
    *shared = z ? z->n_shared : 0;
}

static void bind_hooks(tera_zero *zr) {
    tera_model *m = zr->model;
    if (zr->stage < 2) return;
    m->bind_ctx = zr;
    m->use_grads = zero_use_grads;
    if (zr->stage >= 3) m->use_params = zero_use_params;
}

/* ------------------------------------------------------------------ ZeRO-0 and ZeRO-1 on one host
 * Where the data-parallel ranks all run on one host (no hierarchical or compressed reducer; ZeRO-1 with
 * its reduce-scatters overlapped),
 * the model's whole gradient buffer is in host-shared memory ([dp][n], tera_model_adopt_grads) and
 * the buckets (a layer's non-expert or expert tensors, the head, the embedding; the last micro-batch's
 * backward) are summed straight from the ranks' buffers instead of through the segment's copies. A
 * bucket is numbered alike on every rank; when it is final the rank posts WG_GRD = k, and once every
 * rank has posted k it sums its share of the bucket over the ranks' buffers in rank order (t = g_0 +
 * g_1 + ..., the segment's order: the same bits) and writes t where the collective would: ZeRO-0
 * (all-reduce; its share is 1/dp of the bucket) into every rank's buffer, ZeRO-1 (reduce-scatter; its
 * share is its shard's piece) into its own; then it posts WG_SUMD = k. An expert bucket with the
 * experts over part of the ranks (1 < edp < dp) is summed the same way over the buffers of this
 * rank's expert-data-parallel group only (xwho: the ranks holding the same experts, in that group's
 * rank order, the order of its collective), and its share is 1/edp or the experts' shard piece. tera_zero_reduce_grads sums what
 * is left and waits until every rank has posted its last WG_SUMD: every share is in this rank's buffer
 * and no rank still reads it. On two ranks that is about 8 bytes of memory traffic per float of a
 * bucket (ZeRO-0) instead of about 22. TERA_ZERO_SHARED=0: the segment's collectives (A/B). */
enum { WG_GRD, WG_SUMD, WG_FLAGS };
typedef struct {
    int64_t lo, hi; /* this rank's share of the bucket, in the flat buffer */
    uint64_t k;     /* the bucket's number */
    int x;          /* an expert bucket: summed over the expert-data-parallel ranks (xwho) */
} zwbucket;
struct tera_zero_whole {
    tera_comm_shared *s;
    float *base;          /* [ranks][n] */
    int64_t n;            /* floats of one rank's buffer (n_floats padded to 16) */
    int ranks, me, sum_x; /* sum_x: the experts' region is summed too (edp > 1) */
    uint64_t k;           /* buckets posted by this rank (the same count on every rank; tera_zero_shared_sums) */
    zwbucket *q;          /* [n_buckets] posted, not yet summed by this rank, oldest first */
    int q_head, q_len, q_cap;
};

void tera_zero_shared_sum(float *base, int64_t stride, int ranks, const int *which, int64_t lo, int64_t hi, int dst) {
    for (int64_t i0 = lo; i0 < hi; i0 += SUM_BLOCK) {
        const int64_t nb = hi - i0 < SUM_BLOCK ? hi - i0 : SUM_BLOCK;
        float t[SUM_BLOCK];
        sum_over_ranks(t, base, stride, ranks, which, i0, nb);
        if (dst < 0)
            for (int r = 0; r < ranks; r++) memcpy(base + (which ? which[r] : r) * stride + i0, t, sizeof(float) * (size_t)nb);
        else
            memcpy(base + dst * stride + i0, t, sizeof(float) * (size_t)nb);
    }
}

/* Sums bucket b's share of this rank (see above) and posts it. */
static void whole_sum(tera_zero *zr, const zwbucket *b) {
    struct tera_zero_whole *w = zr->zw;
    tera_zero_shared_sum(w->base, w->n, b->x ? zr->topo.edp : w->ranks, b->x ? zr->xwho : NULL, b->lo, b->hi,
                         zr->stage == 0 ? -1 : w->me);
    tera_comm_shared_post(w->s, WG_SUMD, b->k);
}

/* Sums the posted buckets whose gradients every rank has posted, oldest first; all of them, waiting,
 * when `all`. */
static void whole_progress(tera_zero *zr, int all) {
    struct tera_zero_whole *w = zr->zw;
    while (w->q_len > 0) {
        const zwbucket *b = &w->q[w->q_head];
        const int ready = tera_comm_shared_reached(w->s, WG_GRD, b->k);
        if (!ready && !all) return;
        if (!ready) tera_comm_shared_wait(w->s, WG_GRD, b->k, zr->stage ? TERA_TRAFFIC_REDUCE_SCATTER : TERA_TRAFFIC_ALLREDUCE);
        if (ready && zr->stage) zr->rs1[2]++; /* complete before its wait (a poll saw it) */
        whole_sum(zr, b);
        w->q_head = (w->q_head + 1) % w->q_cap;
        w->q_len--;
    }
}

/* Stages 0 and 1 in host-shared memory: a bucket is ready (last micro-batch of a step). */
static void whole_bucket_ready(void *ctx, int64_t offset, int64_t count) {
    tera_zero *zr = ctx;
    struct tera_zero_whole *w = zr->zw;
    const int x = offset >= zr->model->n_dense_floats;
    if (x && !w->sum_x) return; /* experts, edp = 1: nothing to sum */
    TERA_ASSERTF(w->q_len < w->q_cap, "more gradient buckets than the %d expected", w->q_cap);
    /* the ranks' shares (rs_cnt: what the collective would send) and this rank's: ZeRO-0 1/q of the
     * bucket each, ZeRO-1 the shards' pieces (q: dp, or edp for the experts) */
    const int ranks = x ? zr->topo.edp : w->ranks, me = x ? zr->topo.edp_rank : w->me;
    int64_t lo = offset;
    if (zr->stage == 0) {
        for (int r = 0; r < ranks; r++) zr->rs_cnt[r] = count * (r + 1) / ranks - count * r / ranks;
        lo += count * me / ranks;
    } else {
        const int64_t base = x ? zr->model->n_dense_floats : 0;
        int64_t soff;
        lo += piece_counts(x ? zr->shard_counts_x : zr->shard_counts, ranks, me, offset - base, offset - base + count,
                           zr->rs_cnt, &soff);
        zr->rs1[0]++, zr->rs1[1]++; /* over several ranks, started before the wait */
        zr->rs1_started = 1;
    }
    tera_comm_shared_post(w->s, WG_GRD, ++w->k);
    w->q[(w->q_head + w->q_len++) % w->q_cap] = (zwbucket){.lo = lo, .hi = lo + zr->rs_cnt[me], .k = w->k, .x = x};
    tera_comm_count_as(x ? zr->edp : zr->dp, zr->stage ? TERA_TRAFFIC_REDUCE_SCATTER : TERA_TRAFFIC_ALLREDUCE, zr->rs_cnt);
    whole_progress(zr, 0);
}

/* Every bucket summed, and every rank done with this rank's buffer (tera_zero_reduce_grads). */
static void whole_finish(tera_zero *zr) {
    struct tera_zero_whole *w = zr->zw;
    whole_progress(zr, 1);
    tera_comm_shared_wait(w->s, WG_SUMD, w->k, zr->stage ? TERA_TRAFFIC_REDUCE_SCATTER : TERA_TRAFFIC_ALLREDUCE);
}

/* Collective over dp: a block of one whole-model buffer per data-parallel rank ([dp][*n], *n the
 * model's floats padded to 16) where the ranks share a host and the reducer is flat and uncompressed
 * (NULL elsewhere: the collectives). The first one also finds zr->xwho [edp]: the buffers of this
 * rank's expert-data-parallel group in that group's rank order (the members hold the same experts). */
static tera_comm_shared *whole_block(tera_zero *zr, int nflags, int64_t *n) {
    if (!zr->host_shared || zr->topo.dp < 2) return NULL;
    *n = (zr->model->n_floats + 15) & ~(int64_t)15;
    tera_comm_shared *s = tera_comm_shared_create(zr->dp, (int64_t)sizeof(float) * *n * zr->topo.dp, nflags);
    if (!s || zr->xwho) return s;
    zr->xwho = tera_calloc((size_t)zr->topo.edp, sizeof(int));
    for (int j = 0; j < zr->topo.edp; j++) {
        const int wr = zr->topo.edp > 1 ? tera_comm_world_rank_of(zr->edp, j) : tera_comm_world_rank_of(zr->dp, zr->topo.dp_rank);
        int r = 0;
        while (r < zr->topo.dp && tera_comm_world_rank_of(zr->dp, r) != wr) r++;
        TERA_ASSERTF(r < zr->topo.dp, "expert-data-parallel rank %d (world %d) not in the data-parallel group", j, wr);
        zr->xwho[j] = r;
    }
    return s;
}

/* Collective over dp: the block, where the conditions above hold (NULL elsewhere). */
static void whole_create(tera_zero *zr) {
    tera_model *m = zr->model;
    if (zr->stage > 1 || !m->g || (zr->stage == 1 && !zr->rs_overlap)) return;
    int64_t n = 0;
    tera_comm_shared *s = whole_block(zr, WG_FLAGS, &n);
    if (!s) return;
    struct tera_zero_whole *w = tera_calloc(1, sizeof *w);
    *w = (struct tera_zero_whole){.s = s, .base = tera_comm_shared_mem(s), .n = n, .ranks = zr->topo.dp,
                                  .me = zr->topo.dp_rank, .sum_x = zr->topo.edp > 1 && m->n_floats > m->n_dense_floats,
                                  .q_cap = zr->n_buckets};
    w->q = tera_calloc((size_t)w->q_cap, sizeof(zwbucket));
    zr->zw = w;
    tera_model_adopt_grads(m, w->base + (int64_t)w->me * n);
}


/* ------------------------------------------------------------------ ZeRO-1/2's parameters on one host
 * Under the same conditions (the data-parallel ranks on one host, the flat uncompressed reducer),
 * ZeRO-1 and ZeRO-2 keep the model's whole parameter buffer in host-shared memory ([dp][n],
 * tera_model_adopt_params), and after the update each rank copies its shard's pieces (non-expert into
 * every other buffer, the experts' where edp > 1 into those of its expert-data-parallel group)
 * straight into the other ranks' buffers instead of the all-gather (which
 * copies every piece into the segment and every piece out of it: on two ranks about three moves of
 * the buffer a rank, against one of its half). Update k: a rank posts PW_FREE = k once it reads no
 * parameter outside its pieces any more (its update is done; its forward and backward before it);
 * once every rank has posted k it writes its pieces into the others' buffers and posts PW_DONE = k;
 * tera_zero_params_updated returns once every rank has, so the parameters are whole on return, as
 * after the all-gather. TERA_ZERO_SHARED=0: the all-gather (A/B). */
enum { PW_FREE, PW_DONE, PW_FLAGS };
struct tera_zero_pw {
    tera_comm_shared *s;
    float *base;               /* [ranks][n] */
    int64_t n;                 /* floats of one rank's buffer (n_floats padded to 16) */
    int ranks, me;
    int64_t lo, hi, xlo, xhi;  /* this rank's pieces: non-expert [lo, hi), experts [xlo, xhi) (empty: edp = 1) */
    uint64_t k;                /* updates gathered (the same count on every rank) */
    int lag_us;                /* test hook TERA_TEST_PW_LAG_US: the last rank waits this long before its copies */
};

/* Collective over dp: the block, where the conditions above hold (NULL elsewhere). */
static void pw_create(tera_zero *zr) {
    tera_model *m = zr->model;
    if (zr->stage < 1 || zr->stage > 2 || !m->w) return;
    int64_t n = 0;
    tera_comm_shared *s = whole_block(zr, PW_FLAGS, &n);
    if (!s) return;
    struct tera_zero_pw *p = tera_calloc(1, sizeof *p);
    const int x = zr->topo.edp > 1 && m->n_floats > m->n_dense_floats;
    *p = (struct tera_zero_pw){.s = s, .base = tera_comm_shared_mem(s), .n = n, .ranks = zr->topo.dp,
                               .me = zr->topo.dp_rank, .lo = zr->opt.lo, .hi = zr->opt.hi,
                               .xlo = x ? zr->opt_x.lo : 0, .xhi = x ? zr->opt_x.hi : 0};
    const char *lag = getenv("TERA_TEST_PW_LAG_US");
    p->lag_us = lag && p->me == p->ranks - 1 ? atoi(lag) : 0;
    zr->pw = p;
    tera_model_adopt_params(m, p->base + (int64_t)p->me * n);
}

/* ZeRO-0/1's gradient block and ZeRO-1/2's parameter block: the model's views leave them, then this
 * rank releases its own view of each (not collective). */
static void whole_blocks_free(tera_zero *zr) {
    if (zr->zw) {
        tera_model_adopt_grads(zr->model, NULL);
        tera_comm_shared_free(zr->zw->s);
        free(zr->zw->q), free(zr->zw), zr->zw = NULL;
    }
    if (zr->pw) {
        tera_model_adopt_params(zr->model, NULL);
        tera_comm_shared_free(zr->pw->s);
        free(zr->pw), zr->pw = NULL;
    }
    free(zr->xwho), zr->xwho = NULL;
}

/* The all-gather of the updated parameters through the block (see above). */
static void pw_gather(tera_zero *zr) {
    struct tera_zero_pw *p = zr->pw;
    const uint64_t k = ++p->k;
    tera_comm_shared_post(p->s, PW_FREE, k);
    tera_comm_shared_wait(p->s, PW_FREE, k, TERA_TRAFFIC_ALLGATHER);
    const float *mine = p->base + (int64_t)p->me * p->n;
    if (p->lag_us > 0) usleep((useconds_t)p->lag_us);
    for (int r = 1; r < p->ranks; r++) { /* the next ranks first: not every rank writes into one at once */
        float *dst = p->base + (int64_t)((p->me + r) % p->ranks) * p->n;
        memcpy(dst + p->lo, mine + p->lo, sizeof(float) * (size_t)(p->hi - p->lo));
    }
    for (int j = 0; j < zr->topo.edp && p->xhi > p->xlo; j++) /* the experts: the buffers holding the same ones */
        if (zr->xwho[j] != p->me)
            memcpy(p->base + (int64_t)zr->xwho[j] * p->n + p->xlo, mine + p->xlo, sizeof(float) * (size_t)(p->xhi - p->xlo));
    tera_comm_shared_post(p->s, PW_DONE, k);
    tera_comm_shared_count(p->s, TERA_TRAFFIC_ALLGATHER, zr->shard_counts);
    if (p->xhi > p->xlo) tera_comm_count_as(zr->edp, TERA_TRAFFIC_ALLGATHER, zr->shard_counts_x);
    tera_comm_shared_wait(p->s, PW_DONE, k, TERA_TRAFFIC_ALLGATHER);
}

/* The first bucket request not in flight (stages 0 and 1 start one per bucket, in backward order). */
static int bucket_free(const tera_zero *zr) {
    int i = 0;
    while (i < zr->n_buckets && zr->buckets[i].active) i++;
    TERA_ASSERTF(i < zr->n_buckets, "more gradient buckets than the %d expected", zr->n_buckets);
    return i;
}

/* Stage 0: a gradient bucket is ready (last micro-batch of a step): start its data-parallel sum now,
 * while backward continues, and let earlier ones progress. Buckets are numbered in backward order. */
static void bucket_ready(void *ctx, int64_t offset, int64_t count) {
    tera_zero *zr = ctx;
    const int i = bucket_free(zr);
    /* non-expert tensors: summed over every data-parallel rank; this rank's experts: over the
     * ranks holding the same experts */
    tera_comm *g = offset >= zr->model->n_dense_floats ? zr->edp : zr->dp;
    tera_comm_iallreduce_f32(g, zr->model->g + offset, count, &zr->buckets[i]);
    tera_comm_poll(zr->buckets, i);
}

/* Stage 1: a gradient bucket is ready (last micro-batch of a step): start its reduce-scatter now, in
 * place in the model's gradient, each rank's shard's piece of the bucket summed into its place (as
 * the whole region's blocking reduce-scatter leaves it), while backward continues. */
static void bucket_ready_rs(void *ctx, int64_t offset, int64_t count) {
    tera_zero *zr = ctx;
    const int i = bucket_free(zr);
    const int x = offset >= zr->model->n_dense_floats;
    tera_comm *c = x ? zr->edp : zr->dp;
    const int64_t base = x ? zr->model->n_dense_floats : 0;
    int64_t soff; /* (the piece's place in the shard: the optimizer reads the shard in the gradient buffer) */
    piece_counts(x ? zr->shard_counts_x : zr->shard_counts, x ? zr->topo.edp : zr->topo.dp,
                 x ? zr->topo.edp_rank : zr->topo.dp_rank, offset - base, offset - base + count, zr->rs_cnt, &soff);
    const int comm = tera_comm_size(c) > 1;
    zr->rs1[0] += comm;
    tera_comm_ireduce_scatter_f32(c, zr->model->g + offset, zr->rs_cnt, &zr->buckets[i]); /* counts copied */
    zr->rs1_nb[i] = comm && zr->buckets[i].active;
    zr->rs1[1] += zr->rs1_nb[i];
    zr->rs1_started = 1;
    tera_comm_poll(zr->buckets, i + 1);
}

void (*tera_zero_grad_ready(tera_zero *zr, int last))(void *, int64_t, int64_t) {
    if (zr->local_g) return NULL; /* 1-bit Adam past its freeze: nothing is summed */
    if (zr->stage >= 2) return zero_grad_ready; /* every micro-batch, group by group */
    /* hierarchical / compressed: summed in tera_zero_reduce_grads (so is ZeRO-1 with
     * TERA_ZERO_RS_OVERLAP=0) */
    if (!last || zr->topo.dp == 1 || zr->gred[0] || zr->gred[1]) return NULL;
    if (zr->zw) return whole_bucket_ready; /* host-shared memory (above) */
    if (!zr->stage) return bucket_ready;
    return zr->rs_overlap ? bucket_ready_rs : NULL;
}

void tera_zero_zero_grads(tera_zero *zr) {
    zr->poison = 0;
    rs_drain(zr->zs); /* (none in flight between steps) */
    if (zr->stage < 2) {
        tera_model_zero_grad(zr->model);
        return;
    }
    memset(zr->opt.g, 0, sizeof(float) * (size_t)zr->opt.n);
    memset(zr->opt_x.g, 0, sizeof(float) * (size_t)zr->opt_x.n);
    if (zr->local_g) memset(zr->local_g, 0, sizeof(float) * (size_t)zr->model->n_floats);
}

void tera_zero_grads_begin(tera_zero *zr, int clear) {
    if (zr->stage < 2 && zr->grads_lazy && !clear) {
        zr->poison = 0;
        tera_model *m = zr->model;
        if (zr->stale_nan) /* test hook: a value no backward may read, in every tensor (the padding stays 0) */
            for (int i = 0; i < m->n_params; i++)
                for (int64_t j = 0; j < m->params[i].numel; j++) m->g[m->params[i].offset + j] = NAN;
        tera_model_grads_stale(m, TERA_GROUP_ALL);
    } else if (!zr->grads_zero) {
        tera_zero_zero_grads(zr);
    }
    zr->grads_zero = 0;
}

void tera_zero_grads_end(tera_zero *zr) {
    if (zr->stage < 2) tera_model_grads_settle(zr->model);
}

void tera_zero_local_grads(tera_zero *zr, float *g) {
    if (zr->stage < 2) return;
    rs_drain(zr->zs);
    for (int k = 0; k < N_SLOTS; k++)
        TERA_ASSERTF(!zr->zs->slot[k].live, "ZeRO-%d: gradients of group %d still unreduced when switching to "
                     "local gradients", zr->stage, zr->zs->slot[k].group);
    zr->local_g = g;
}

/* Test hooks (fault injection): scale every gradient, poison one. */
void tera_zero_grad_scale(tera_zero *zr, float s) {
    if (zr->stage < 2) {
        tera_grad_scale(zr->model, s);
        return;
    }
    rs_drain(zr->zs);
    if (zr->local_g)
        for (int64_t i = 0; i < zr->model->n_floats; i++) zr->local_g[i] *= s;
    tera_adamw *o[2] = {&zr->opt, &zr->opt_x};
    for (int k = 0; k < 2; k++)
        for (int64_t i = 0; i < o[k]->n; i++) o[k]->g[i] *= s;
}

/* A NaN in this rank's gradient where its own backward would have produced one: in the gradient the
 * backward accumulates into, before any data-parallel sum (called after the gradients are zeroed).
 * ZeRO-2/3 stage each group's gradients in a slot that is zeroed when the group starts, so there the
 * NaN goes into the first slot summed (zero_grad_ready). */
void tera_zero_poison_grad(tera_zero *zr) {
    if (zr->stage < 2) zr->model->g[zr->model->n_floats / 2] = NAN;
    else if (zr->local_g) zr->local_g[zr->model->n_floats / 2] = NAN; /* as stage 0/1 (tera_zero_local_grads) */
    else zr->poison = 1;
}

/* The parts of region k (0 weights, 1 exp_avg, 2 exp_avg_sq) of the flat buffer [0, n) this rank
 * stores: up to two ranges [lo, hi) with their storage (p[o - lo] holds element o); *sharded: the
 * ranges are this rank's ZeRO shards (the data-parallel replicas hold other parts), else the rank
 * holds the whole region as its replicas do. */
typedef struct {
    int64_t lo, hi;
    float *p;
    tera_adamw *o; /* p NULL: bf16 moments k of o (read widened, written rounded to nearest) */
    int k;
} lseg;

/* Elements [at, at + n) (flat, inside the segment) of a segment into dst / from src. */
static void seg_read(const lseg *s, int64_t at, int64_t n, float *dst) {
    if (s->p) memcpy(dst, s->p + (at - s->lo), sizeof(float) * (size_t)n);
    else tera_adamw_moments_get(s->o, s->k, at - s->lo, n, dst);
}

static void seg_write(const lseg *s, int64_t at, int64_t n, const float *src) {
    if (s->p) memcpy(s->p + (at - s->lo), src, sizeof(float) * (size_t)n);
    else tera_adamw_moments_set(s->o, s->k, at - s->lo, n, src);
}

static int region_segs(const tera_zero *zr, int k, lseg s[2], int *sharded) {
    const tera_model *m = zr->model;
    if (k == 0 && m->w) {
        s[0] = (lseg){.lo = 0, .hi = m->n_floats, .p = m->w};
        *sharded = 0;
        return 1;
    }
    tera_adamw *o[2] = {(tera_adamw *)&zr->opt, (tera_adamw *)&zr->opt_x}; /* written only by load / scatter */
    for (int x = 0; x < 2; x++)
        s[x] = (lseg){o[x]->lo, o[x]->hi, k == 0 ? o[x]->w : k == 1 ? o[x]->m : o[x]->v, k == 0 ? NULL : o[x], k};
    *sharded = k == 0 ? 1 : zr->stage >= 1;
    return 2;
}

void tera_zero_init_weights(tera_zero *zr, uint64_t seed) {
    tera_model *m = zr->model;
    if (m->w) {
        tera_model_init_weights(m, seed);
        return;
    }
    /* ZeRO-3: each rank generates only its shards. The init draws element g of a tensor from
     * (seed, name, g), so a shard's piece of a block (a flat range of it) is initialised as the
     * boxes it consists of (each a block of the whole tensor): the model's own init runs over a
     * table whose rows are those boxes, with offsets into the shard. */
    tera_param *rows = tera_calloc((size_t)(5 * m->n_params + 1), sizeof(tera_param));
    lseg sg[2];
    int sharded;
    const int ns = region_segs(zr, 0, sg, &sharded);
    for (int x = 0; x < ns; x++) {
        int nr = 0;
        for (int i = 0; i < m->n_params; i++) {
            const tera_param *p = &m->params[i];
            const int64_t a = p->offset > sg[x].lo ? p->offset : sg[x].lo;
            const int64_t b = p->offset + p->numel < sg[x].hi ? p->offset + p->numel : sg[x].hi;
            if (b <= a) continue;
            /* [a, b) of the block in row-major order over len[3]: a partial row, partial plane, whole
             * planes, partial plane, partial row */
            int64_t j = a - p->offset;
            const int64_t end = b - p->offset, L1 = p->len[1], L2 = p->len[2], plane = L1 * L2;
            while (j < end) {
                const int64_t i0 = j / plane, i1 = j / L2 % L1, i2 = j % L2;
                int64_t lo[3] = {i0, i1, i2}, len[3] = {1, 1, 1};
                if (i2 != 0 || j + L2 > end) {
                    len[2] = (L2 - i2 < end - j ? L2 - i2 : end - j);
                } else if (i1 != 0 || j + plane > end) {
                    len[1] = (L1 - i1 < (end - j) / L2 ? L1 - i1 : (end - j) / L2);
                    len[2] = L2;
                } else {
                    len[0] = (end - j) / plane;
                    len[1] = L1;
                    len[2] = L2;
                }
                tera_param *r = &rows[nr++];
                TERA_ASSERT(nr <= 5 * m->n_params);
                *r = *p;
                for (int d = 0; d < 3; d++) r->lo[d] = p->lo[d] + lo[d], r->len[d] = len[d];
                r->numel = len[0] * len[1] * len[2];
                r->offset = (p->offset + j) - sg[x].lo;
                j += r->numel;
            }
        }
        tera_model view = *m; /* the same model, its table the boxes, its weights the shard */
        view.params = rows;
        view.n_params = nr;
        view.w = sg[x].p;
        tera_model_init_weights(&view, seed);
    }
    free(rows);
}

void tera_zero_gather_window(tera_zero *zr, const tera_model *shell, int k, int64_t a, int64_t b, float *win,
                               int root_only) {
    const tera_model *m = zr->model;
    const int64_t nw = b - a, n64 = (nw + 1) / 2;
    memset(win, 0, sizeof(int64_t) * (size_t)n64);
    lseg sg[2];
    int sharded;
    const int ns = region_segs(zr, k, sg, &sharded);
    int64_t wrote = 0; /* elements of the window this rank wrote */
    /* root_only: the runs this rank wrote (window offset, length), sent to rank 0 below */
    int64_t *runs = NULL, n_runs = 0, cap_runs = 0;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *lp = &m->params[i], *gp = &shell->params[i];
        if (lp->numel == 0 || gp->offset >= b || gp->offset + gp->numel <= a) continue;
        if (lp->tp_dim < 0 && zr->topo.tp_rank != 0) continue;                          /* tp rank 0's copy */
        if (!sharded && (lp->expert_stacked ? zr->topo.edp_rank : zr->topo.dp_rank) != 0) continue; /* the first replica's */
        const int64_t nr = tera_block_n_runs(gp->shape, lp->len);
        for (int64_t r = 0; r < nr; r++) {
            int64_t g, l, n;
            tera_block_run(gp->shape, lp->lo, lp->len, r, &g, &l, &n);
            g += gp->offset, l += lp->offset;
            if (g >= b) break;
            if (g + n <= a) continue;
            const int64_t x0 = g > a ? g : a, x1 = g + n < b ? g + n : b, y0 = l + (x0 - g), y1 = l + (x1 - g);
            for (int s = 0; s < ns; s++) {
                const int64_t z0 = y0 > sg[s].lo ? y0 : sg[s].lo, z1 = y1 < sg[s].hi ? y1 : sg[s].hi;
                if (z1 > z0) {
                    seg_read(&sg[s], z0, z1 - z0, win + (x0 - a) + (z0 - y0));
                    wrote += z1 - z0;
                    if (root_only && !(zr->topo.rank == 0)) {
                        if (n_runs == cap_runs) {
                            cap_runs = cap_runs ? 2 * cap_runs : 64;
                            runs = tera_realloc(runs, sizeof(int64_t) * 2 * (size_t)cap_runs);
                        }
                        runs[2 * n_runs] = (x0 - a) + (z0 - y0), runs[2 * n_runs + 1] = z1 - z0;
                        n_runs++;
                    }
                }
            }
        }
    }
    if (zr->topo.world == 1) {
        free(runs);
        return;
    }
    if (root_only) {
        /* every element has exactly one writer: each rank that wrote some sends rank 0 its runs (offset
         * and length, then the values) in one message, so each byte of the window crosses once (the
         * all-reduce below moves 2 (p-1)/p of the whole window from every rank); when rank 0 holds the
         * whole window itself (data-parallel replicas without ZeRO) only the sizes cross. (Point to
         * point: an all-to-all with one non-empty destination hung in Open MPI 4.1 on the ranks whose
         * counts were all zero.) */
        tera_comm *w = tera_comm_world();
        const int P = zr->topo.world;
        int64_t *sz = tera_calloc((size_t)P, sizeof(int64_t));
        /* a rank's message: the run count, the runs (offset, length), then their values in that order */
        const int64_t mine = (zr->topo.rank == 0) || !n_runs ? 0 : 8 + 16 * n_runs + (int64_t)sizeof(float) * wrote;
        sz[zr->topo.rank] = mine;
        tera_comm_allreduce_i64(w, sz, P);
        int64_t total = 0;
        for (int r = 0; r < P; r++) total += sz[r];
        if (total > 0) {
            uint8_t *pack = tera_malloc((size_t)((zr->topo.rank == 0) ? total : mine) + 8);
            enum { GATHER_TAG = 1 }; /* the world communicator carries no other point-to-point messages */
            if (!(zr->topo.rank == 0) && mine > 0) {
                memcpy(pack, &n_runs, 8);
                memcpy(pack + 8, runs, sizeof(int64_t) * 2 * (size_t)n_runs);
                uint8_t *v = pack + 8 + sizeof(int64_t) * 2 * (size_t)n_runs;
                for (int64_t i = 0; i < n_runs; i++) {
                    memcpy(v, win + runs[2 * i], sizeof(float) * (size_t)runs[2 * i + 1]);
                    v += sizeof(float) * (size_t)runs[2 * i + 1];
                }
                tera_comm_req rq; /* a message of mine / 4 floats (8 + 16 n + 4 values bytes) */
                tera_comm_isend_f32(w, (const float *)(void *)pack, mine / 4, 0, GATHER_TAG, &rq);
                tera_comm_wait(&rq);
            } else if ((zr->topo.rank == 0)) {
                tera_comm_req *rq = tera_calloc((size_t)P, sizeof(tera_comm_req));
                int64_t at = 0;
                for (int r = 1; r < P; r++) {
                    if (sz[r] > 0) tera_comm_irecv_f32(w, (float *)(void *)(pack + at), sz[r] / 4, r, GATHER_TAG, &rq[r]);
                    at += sz[r];
                }
                for (int r = 1; r < P; r++) tera_comm_wait(&rq[r]);
                free(rq);
            }
            if ((zr->topo.rank == 0)) { /* each rank's runs into their places */
                const uint8_t *q = pack;
                for (int r = 1; r < P; r++) {
                    if (sz[r] == 0) continue;
                    int64_t nr;
                    memcpy(&nr, q, 8);
                    TERA_ASSERTF(nr > 0 && 8 + 16 * nr <= sz[r], "window gather: rank %d sent %ld bytes, %ld runs", r,
                                 (long)sz[r], (long)nr);
                    const uint8_t *h = q + 8, *v = q + 8 + 16 * nr;
                    for (int64_t i = 0; i < nr; i++) {
                        int64_t off, len;
                        memcpy(&off, h + 16 * i, 8);
                        memcpy(&len, h + 16 * i + 8, 8);
                        TERA_ASSERTF(off >= 0 && len >= 0 && off + len <= nw, "window gather: run %ld+%ld of %ld",
                                     (long)off, (long)len, (long)nw);
                        TERA_ASSERTF(v + 4 * len <= q + sz[r], "window gather: rank %d's values overrun its message", r);
                        memcpy(win + off, v, sizeof(float) * (size_t)len);
                        v += sizeof(float) * (size_t)len;
                    }
                    q += sz[r];
                }
            }
            free(pack);
        }
        free(sz);
        free(runs);
        return;
    }
    /* exactly one rank wrote each element, the others hold zero bits: an integer sum of the bits
     * is a bit-exact gather (a float sum would turn -0.0 into +0.0). (An MPI reduce to rank 0 alone
     * moves half the bytes but measured 3x slower than the all-reduce in Open MPI here.) */
    tera_comm_allreduce_i64(tera_comm_world(), (int64_t *)(void *)win, n64);
}

void tera_zero_local_window(tera_zero *zr, int k, int x, int64_t a, int64_t b, float *dst) {
    lseg sg[2];
    int sharded;
    region_segs(zr, k, sg, &sharded);
    if (!sharded) {
        seg_read(&sg[0], a, b - a, dst);
        return;
    }
    const int ranks = x ? zr->topo.edp : zr->topo.dp, me = x ? zr->topo.edp_rank : zr->topo.dp_rank;
    const int64_t base = x ? zr->model->n_dense_floats : 0;
    int64_t *cnt = tera_calloc((size_t)ranks, sizeof(int64_t)), soff;
    const int64_t mine = piece_counts(x ? zr->shard_counts_x : zr->shard_counts, ranks, me, a - base, b - base, cnt, &soff);
    if (cnt[me] > 0) seg_read(&sg[x], sg[x].lo + soff, cnt[me], dst + mine);
    tera_comm_allgather_f32(x ? zr->edp : zr->dp, dst, cnt);
    free(cnt);
}

tera_status tera_zero_load(tera_zero *zr, tera_ckpt_reader *rd, int moments) {
    tera_model *m = zr->model;
    tera_model shell;
    tera_zero_global_shell(zr->model, &shell);
    tera_status st = TERA_OK;
    enum { LOAD_PIECE = 65536 };
    float *piece = NULL; /* bf16 moments: a piece read as fp32 */
    zr->moments_rounded = 0;
    for (int k = 0; k < (moments ? 3 : 1) && st == TERA_OK; k++) {
        lseg sg[2];
        int sharded;
        const int ns = region_segs(zr, k, sg, &sharded);
        for (int i = 0; i < m->n_params && st == TERA_OK; i++) {
            const tera_param *lp = &m->params[i], *gp = &shell.params[i];
            const int64_t nr = tera_block_n_runs(gp->shape, lp->len);
            for (int64_t r = 0; r < nr && st == TERA_OK; r++) {
                int64_t g, l, n;
                tera_block_run(gp->shape, lp->lo, lp->len, r, &g, &l, &n);
                l += lp->offset;
                for (int s = 0; s < ns && st == TERA_OK; s++) {
                    const int64_t z0 = l > sg[s].lo ? l : sg[s].lo, z1 = l + n < sg[s].hi ? l + n : sg[s].hi;
                    if (z1 > z0 && sg[s].p) {
                        st = tera_ckpt_reader_read(rd, k, i, g + (z0 - l), z1 - z0, sg[s].p + (z0 - sg[s].lo));
                    } else { /* bf16 moments: through fp32 pieces, rounded to nearest (exact for bf16 values) */
                        for (int64_t y = z0; y < z1 && st == TERA_OK; y += LOAD_PIECE) {
                            const int64_t ny = z1 - y < LOAD_PIECE ? z1 - y : LOAD_PIECE;
                            if (!piece) piece = tera_malloc(sizeof(float) * LOAD_PIECE);
                            st = tera_ckpt_reader_read(rd, k, i, g + (y - l), ny, piece);
                            if (st != TERA_OK) break;
                            for (int64_t q = 0; q < ny && !zr->moments_rounded; q++)
                                zr->moments_rounded = tera_bf16_widen(tera_bf16_nearest(piece[q])) != piece[q];
                            seg_write(&sg[s], y, ny, piece);
                        }
                    }
                }
            }
        }
    }
    free(piece);
    if (st == TERA_OK && m->router_bias) st = tera_ckpt_reader_bias(rd, m->router_bias);
    if (zr->zs) zr->zs->version++; /* ZeRO-3: gathered parameters are stale */
    free(shell.params);
    return st;
}

/* The moments of [lo, hi): fp32, or bf16 (env->bf16_moments, include/tera/train.h). */
static void init_range(const tera_zero_env *env, tera_adamw *o, int64_t lo, int64_t hi) {
    if (env->bf16_moments) tera_adamw_init_range_bf16(o, lo, hi, env->seed);
    else tera_adamw_init_range(o, lo, hi);
}

tera_status tera_zero_create(const tera_zero_env *env, tera_zero **out) {
    *out = NULL;
    const int ck = tera_compress_parse(env->grad_compression ? env->grad_compression : "none");
    if (ck < 0 || ck == TERA_COMPRESS_FP8)
        return tera_fail(TERA_ERR_CONFIG, "parallel.grad_compression = %s: not a gradient compression",
                         env->grad_compression);
    tera_zero *zr = tera_calloc(1, sizeof *zr);
    zr->model = env->model;
    zr->topo = *env->topo;
    zr->dp = env->dp;
    zr->edp = env->edp ? env->edp : env->dp;
    zr->stage = tera_zero_stage_in_effect(env->topo, env->stage);
    const char *cleared = getenv("TERA_GRADS_CLEARED");
    zr->grads_lazy = !(cleared && !strcmp(cleared, "1"));
    const char *nan = getenv("TERA_TEST_STALE_NAN");
    zr->stale_nan = zr->grads_lazy && nan && !strcmp(nan, "1");
    if (zr->stale_nan && zr->topo.rank == 0)
        fprintf(stderr, "tera: TERA_TEST_STALE_NAN=1: the stale gradients are set to NaN before every step\n");
    tera_model *m = zr->model;
    /* experts no row reached: marked, not zeroed (tera_model_grads_sparse), where the only readers of
     * their gradients are this module's norm and update on the model's own buffer: ZeRO-0, stored
     * gradients, and one replica of each expert (no sum over expert-data-parallel ranks reads them;
     * the dense tensors are never marked). 1-bit Adam turns it off (src/train/onebit.c). */
    tera_model_grads_sparse(m, zr->grads_lazy && zr->stage == 0 && zr->topo.edp == 1);
    TERA_ASSERTF(m->par.shard_grads == (zr->stage >= 2) && m->par.shard_params == (zr->stage >= 3),
                 "ZeRO-%d on a model created with shard_grads %d, shard_params %d", zr->stage, m->par.shard_grads,
                 m->par.shard_params);
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    zr->shard_counts = tera_calloc((size_t)zr->topo.dp, sizeof(int64_t));
    zr->shard_counts_x = tera_calloc((size_t)zr->topo.edp, sizeof(int64_t));
    if (zr->stage) {
        int64_t *lo = tera_calloc((size_t)(zr->topo.dp > zr->topo.edp ? zr->topo.dp : zr->topo.edp), sizeof(int64_t));
        shard(nd, zr->topo.dp, zr->shard_counts, lo);
        init_range(env, &zr->opt, lo[zr->topo.dp_rank], lo[zr->topo.dp_rank] + zr->shard_counts[zr->topo.dp_rank]);
        shard(n - nd, zr->topo.edp, zr->shard_counts_x, lo);
        init_range(env, &zr->opt_x, nd + lo[zr->topo.edp_rank], nd + lo[zr->topo.edp_rank] + zr->shard_counts_x[zr->topo.edp_rank]);
        free(lo);
    } else {
        /* one allocation for both regions, so the whole moments are contiguous (a one-rank
         * checkpoint snapshots them directly) */
        init_range(env, &zr->opt, 0, n);
        if (zr->opt.mh)
            zr->opt_x = (tera_adamw){.mh = zr->opt.mh + nd, .vh = zr->opt.vh + nd, .sr_seed = zr->opt.sr_seed, .lo = nd,
                                     .hi = n, .n = n - nd, .view = 1};
        else
            zr->opt_x = (tera_adamw){.m = zr->opt.m + nd, .v = zr->opt.v + nd, .lo = nd, .hi = n, .n = n - nd, .view = 1};
        zr->opt.hi = zr->opt.n = nd;
    }
    /* A/B switch, TERA_ZERO_RS_OVERLAP=0: blocking gradient reduce-scatters (ZeRO-1: one per region
     * after the backward; ZeRO-2/3: each group's as it is ready); the same bits */
    const char *ov = getenv("TERA_ZERO_RS_OVERLAP");
    zr->rs_overlap = !(ov && strcmp(ov, "0") == 0);
    /* A/B switch, TERA_ZERO_SHARED=0: the collectives instead of host-shared memory (the same bits); the
     * hierarchical and compressed reducers keep their own sums and gathers */
    const char *she = getenv("TERA_ZERO_SHARED");
    zr->host_shared = !(she && !strcmp(she, "0")) && !env->hierarchical && ck == TERA_COMPRESS_NONE;
    pw_create(zr); /* ZeRO-1/2's parameters on one host (collective over dp), before anything keeps m->w */
    if (zr->stage >= 2) zero23_init(zr, env);
    tera_adamw_plan(&zr->opt, m); /* the optimizer's work items, so that the step allocates nothing */
    tera_adamw_plan(&zr->opt_x, m);
    /* hierarchical / compressed gradient sums (collective over each group; NULL when both are off) */
    if (zr->topo.dp > 1) zr->gred[0] = tera_greducer_create(zr->dp, nd, (tera_compress_kind)ck, env->hierarchical);
    if (zr->topo.edp > 1 && n > nd)
        zr->gred[1] = tera_greducer_create(zr->edp, n - nd, (tera_compress_kind)ck, env->hierarchical);
    if (zr->zs && (zr->gred[0] || zr->gred[1])) zr->zs->rs_overlap = 0; /* the reducers' sums block */
    zr->n_buckets = 2 * (m->cfg.n_layers + 2); /* per layer: non-expert and expert tensors */
    zr->rs_cnt = tera_calloc((size_t)(zr->topo.dp > zr->topo.edp ? zr->topo.dp : zr->topo.edp), sizeof(int64_t));
    whole_create(zr); /* ZeRO-0/1 on one host (collective over dp) */
    zr->grad_sq = tera_calloc((size_t)(4 * m->n_params), sizeof(double)); /* + the step's scratch */
    zr->buckets = tera_calloc((size_t)zr->n_buckets, sizeof(tera_comm_req));
    zr->rs1_nb = tera_calloc((size_t)zr->n_buckets, 1);
    bind_hooks(zr);
    *out = zr;
    return TERA_OK;
}

int64_t tera_zero_shared_sums(const tera_zero *zr) {
    if (!zr) return 0;
    return (zr->zw ? (int64_t)zr->zw->k : 0) + (zr->zs ? zr->zs->n_shg : 0);
}

int64_t tera_zero_shared_param_gathers(const tera_zero *zr) { return zr && zr->pw ? (int64_t)zr->pw->k : 0; }

void tera_zero_destroy(tera_zero *zr) {
    if (!zr) return;
    zero23_free(zr);
    whole_blocks_free(zr);
    tera_greducer_free(zr->gred[0]);
    tera_greducer_free(zr->gred[1]);
    free(zr->shard_counts);
    free(zr->shard_counts_x);
    free(zr->grad_sq);
    free(zr->buckets);
    free(zr->rs1_nb);
    free(zr->rs_cnt);
    tera_adamw_free(&zr->opt_x);
    tera_adamw_free(&zr->opt);
    free(zr);
}

int64_t tera_zero_optimizer_bytes(const tera_zero *zr) {
    return tera_adamw_moment_bytes(&zr->opt) + tera_adamw_moment_bytes(&zr->opt_x);
}

void tera_zero_global_shell(const tera_model *m, tera_model *shell) {
    memset(shell, 0, sizeof *shell);
    shell->cfg = m->cfg;
    shell->B = m->B;
    shell->T = m->T;
    shell->params = tera_param_table_ep(&shell->cfg, 1, 0, &shell->n_params, &shell->n_floats, &shell->n_dense_floats);
    shell->par.ep = 1;
    shell->n_moe_layers = m->n_moe_layers;
    shell->router_bias = m->router_bias;
}

int tera_zero_member_writes(const tera_topology *t, int member, const tera_param *p) {
    if (p->numel == 0) return 0;
    if (!p->expert_stacked && member / t->tp % t->ep != 0) return 0; /* non-expert: the first of the ep group */
    return p->tp_dim >= 0 || member % t->tp == 0;                     /* replicated over tp: the first tp rank */
}

int tera_zero_writes(const tera_topology *t, const tera_param *p) {
    /* one copy: the first expert-data-parallel replica */
    return t->edp_rank == 0 && tera_zero_member_writes(t, tera_zero_member(t), p);
}

int tera_zero_member(const tera_topology *t) { return (t->pp_rank * t->ep + t->ep_rank) * t->tp + t->tp_rank; }

tera_param *tera_zero_member_table(const tera_model *m, const tera_topology *t, int member, int64_t *n_floats) {
    const tera_shard_spec sp = {.ep = t->ep, .ep_rank = member / t->tp % t->ep, .tp = t->tp,
                                .tp_rank = member % t->tp, .pp = t->pp, .pp_rank = member / (t->tp * t->ep),
                                .v = m->par.v, .layer_first = m->layer_first};
    int np;
    int64_t nf;
    return tera_param_table_spec(&m->cfg, &sp, &np, n_floats ? n_floats : &nf, NULL);
}

void tera_zero_scatter(tera_zero *zr, const float *gw, const float *gm, const float *gv) {
    /* straight into this rank's storage (its blocks; under ZeRO its shards), no temporary */
    tera_model *m = zr->model;
    tera_model shell;
    tera_zero_global_shell(zr->model, &shell);
    const float *src[3] = {gw, gm, gv};
    for (int k = 0; k < 3; k++) {
        if (!src[k]) continue;
        lseg sg[2];
        int sharded;
        const int ns = region_segs(zr, k, sg, &sharded);
        for (int i = 0; i < m->n_params; i++) {
            const tera_param *lp = &m->params[i], *gp = &shell.params[i];
            const int64_t nr = tera_block_n_runs(gp->shape, lp->len);
            for (int64_t r = 0; r < nr; r++) {
                int64_t g, l, n;
                tera_block_run(gp->shape, lp->lo, lp->len, r, &g, &l, &n);
                l += lp->offset;
                for (int x = 0; x < ns; x++) {
                    const int64_t z0 = l > sg[x].lo ? l : sg[x].lo, z1 = l + n < sg[x].hi ? l + n : sg[x].hi;
                    if (z1 > z0)
                        seg_write(&sg[x], z0, z1 - z0, src[k] + gp->offset + g + (z0 - l));
                }
            }
        }
    }
    if (!m->w && gw && zr->zs) zr->zs->version++; /* ZeRO-3: gathered parameters are stale */
    free(shell.params);
}

/* Whether this rank's sums of tensor i count toward the whole model's: each element of the model
 * must be counted once over the world. Copies on several data-parallel ranks count on the first
 * (ZeRO-1 shards split them instead), copies on several tensor-parallel ranks (norms, router) on
 * tp rank 0. */
static int counts_here(const tera_zero *zr, const tera_param *p) {
    if (p->tp_dim < 0 && zr->topo.tp_rank != 0) return 0;
    if (zr->stage) return 1;
    return p->expert_stacked ? zr->topo.edp_rank == 0 : zr->topo.dp_rank == 0;
}

void tera_zero_reduce_grads(tera_zero *zr) {
    tera_model *m = zr->model;
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    rs_drain(zr->zs); /* ZeRO-2/3: the last sums still in flight */
    if (zr->topo.dp == 1 || zr->stage >= 2) return; /* ZeRO-2/3: reduced group by group during backward */
    if (zr->zw) { /* host-shared memory: the buckets posted during the last backward */
        whole_finish(zr);
        zr->rs1_started = 0;
        return;
    }
    if (zr->stage && zr->rs1_started) { /* ZeRO-1: the buckets' reduce-scatters started during the last backward */
        for (int i = 0; i < zr->n_buckets; i++) {
            zr->rs1[2] += zr->rs1_nb[i] && !zr->buckets[i].active; /* done while compute ran (a poll saw it) */
            zr->rs1_nb[i] = 0;
            tera_comm_wait(&zr->buckets[i]);
        }
        zr->rs1_started = 0;
    } else if (zr->stage) { /* each rank sums only its own shard of each region */
        if (zr->gred[0]) tera_greducer_reduce_scatter(zr->gred[0], m->g, 0, zr->shard_counts);
        else tera_comm_reduce_scatter_f32(zr->dp, m->g, zr->shard_counts);
        if (n > nd && zr->gred[1]) tera_greducer_reduce_scatter(zr->gred[1], m->g + nd, 0, zr->shard_counts_x);
        else if (n > nd) tera_comm_reduce_scatter_f32(zr->edp, m->g + nd, zr->shard_counts_x);
    } else if (zr->gred[0] || zr->gred[1]) { /* hierarchical / compressed: no buckets were started */
        if (zr->gred[0]) tera_greducer_allreduce(zr->gred[0], m->g, 0, nd);
        else tera_comm_allreduce_f32(zr->dp, m->g, nd);
        if (n > nd && zr->gred[1]) tera_greducer_allreduce(zr->gred[1], m->g + nd, 0, n - nd);
        else if (n > nd) tera_comm_allreduce_f32(zr->edp, m->g + nd, n - nd);
    } else { /* the buckets started during the last backward */
        for (int i = 0; i < zr->n_buckets; i++) tera_comm_wait(&zr->buckets[i]);
    }
}

double tera_zero_grad_sq(tera_zero *zr) {
    tera_model *m = zr->model;
    double *sq = zr->grad_sq, *sq2 = zr->grad_sq + m->n_params;
    rs_drain(zr->zs); /* (tera_zero_reduce_grads did; 1-bit Adam's callers may not) */
    tera_adamw_grad_sq(&zr->opt, m, sq); /* one parallel region each (src/train/optim.c) */
    tera_adamw_grad_sq(&zr->opt_x, m, sq2);
    /* a tensor another rank counts (a replica) still enters as NaN when this rank's copy of its
     * gradient is not finite: the update this rank would apply must be skipped everywhere */
    for (int i = 0; i < m->n_params; i++) {
        const double v = sq[i] + sq2[i];
        sq[i] = counts_here(zr, &m->params[i]) || !isfinite(v) ? v : 0.0;
    }
    if (zr->topo.world > 1) tera_comm_allreduce_f64(tera_comm_world(), sq, m->n_params);
    double tot = 0.0;
    for (int i = 0; i < m->n_params; i++) tot += sq[i];
    return tot;
}

void tera_zero_params_updated(tera_zero *zr) {
    tera_model *m = zr->model;
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    if (zr->zs) zr->zs->version++; /* ZeRO-3: gathered parameters are stale */
    if (zr->pw) {
        pw_gather(zr);
    } else if (zr->stage && zr->stage < 3) { /* every rank gets every shard's new parameters */
        if (zr->gred[0]) tera_greducer_allgather(zr->gred[0], m->w, zr->shard_counts);
        else tera_comm_allgather_f32(zr->dp, m->w, zr->shard_counts);
        if (n > nd && zr->gred[1]) tera_greducer_allgather(zr->gred[1], m->w + nd, zr->shard_counts_x);
        else if (n > nd) tera_comm_allgather_f32(zr->edp, m->w + nd, zr->shard_counts_x);
    }
}

void tera_zero_adamw_step(tera_zero *zr, float lr, float clip_scale, const tera_optim_config *oc, double *sums) {
    tera_model *m = zr->model;
    double *usq = zr->grad_sq + m->n_params * 2, *psq = usq + m->n_params; /* per tensor */
    memset(usq, 0, sizeof(double) * 2 * (size_t)m->n_params);
    /* ZeRO-0: this rank updates every resident weight in place, so the update writes the backend's
     * bf16 weight shadow as well (NULL where there is none; ZeRO-1/2 gather other ranks' shards
     * after it, ZeRO-3 holds none: the products round lazily there) */
    uint16_t *w16 = !zr->stage && m->w ? tera_backend_weights_shadow_out(m->be, m->w, m->n_floats) : NULL;
    zr->opt.w16 = w16, zr->opt_x.w16 = w16 ? w16 + m->n_dense_floats : NULL;
    const int clear = !zr->stage && !zr->grads_lazy; /* grads_lazy: the next step's backward stores them */
    tera_adamw_step_by_param(&zr->opt, m, lr, clip_scale, oc, clear, NULL, NULL, usq, psq);
    tera_adamw_step_by_param(&zr->opt_x, m, lr, clip_scale, oc, clear, NULL, NULL, usq, psq);
    zr->grads_zero = clear; /* ZeRO-1 cleared only its shard */
    zr->opt.w16 = zr->opt_x.w16 = NULL;
    if (w16) tera_backend_weights_filled(m->be);
    tera_zero_params_updated(zr);
    double s[2] = {0.0, 0.0}; /* update^2, param^2 over the whole model */
    for (int i = 0; i < m->n_params; i++)
        if (counts_here(zr, &m->params[i])) s[0] += usq[i], s[1] += psq[i];
    if (zr->topo.world > 1) tera_comm_allreduce_f64(tera_comm_world(), s, 2);
    sums[0] = s[0];
    sums[1] = s[1];
}
