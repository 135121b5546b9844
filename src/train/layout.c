/* The parallel layout of a training run: process groups, which part of the model and of the
 * optimizer state each rank holds, and conversion to and from the whole model.
 *
 * Ranks: world rank = (pp_rank * dp + dp_rank) * tp + tp_rank (set up in trainer.c). The tp
 * ranks with the same pp_rank and dp_rank form a tensor-parallel group (same samples, Megatron
 * splits of each tensor); the dp ranks with the same pp_rank and tp_rank form a data-parallel group
 * (each reading its own samples); the pp ranks with the same dp_rank and tp_rank form a pipeline
 * (each holding its stages' layers). Inside the data-parallel group, with expert
 * parallelism, dp_rank = edp_rank * ep + ep_rank: consecutive groups of ep ranks split the routed
 * experts of every MoE layer (ep_rank r holds experts [r E/ep, (r+1) E/ep)), and the dp/ep ranks
 * with the same ep_rank (the expert-data-parallel group) hold the same experts.
 *
 * Flat buffers hold this rank's blocks (its pipeline stages' tensors, their tensor-parallel slices)
 * of the non-expert tensors first, [0, n_dense), the same on every rank of the data-parallel group,
 * then this rank's slices of the expert tensors, [n_dense, n). Gradients of the first region are
 * summed over dp, of the second over edp. ZeRO (stage 1 and up) shards the first region's Adam
 * moments over dp and the second's over edp (stages 2 and 3 the gradients and parameters too, below);
 * the optimizer object opt holds the first region (or its shard), opt_x the second. */
#include <math.h>
#include <string.h>

#include "tera/ckpt.h"
#include "tera/comm_hier.h"
#include "tera/train.h"
#include "onebit.h"

/* Consecutive 16-float aligned shards of n floats over w ranks. */
static void shard(int64_t n, int w, int64_t *counts, int64_t *lo_of) {
    const int64_t S = ((n + w - 1) / w + 15) & ~(int64_t)15;
    for (int r = 0; r < w; r++) {
        const int64_t lo = (int64_t)r * S < n ? (int64_t)r * S : n, hi = lo + S < n ? lo + S : n;
        counts[r] = hi - lo;
        lo_of[r] = lo;
    }
}

tera_comm *tera_layout_axis_group(const tera_topology *t, tera_axis axis) {
    tera_comm *world = tera_comm_world();
    if (tera_topology_size(t, axis) == t->world) return world;
    int color, key;
    tera_topology_split_keys(t, axis, &color, &key);
    return tera_comm_split(world, color, key); /* collective over the world */
}

tera_status tera_layout_groups(tera_trainer *tr) {
    const tera_topology *t = &tr->topo; /* validated by tera_topology_init (ep divides dp) */
    tr->edp = tr->dp;
    /* nodes (parallel.ranks_per_node; 0: the hosts): collective over the world, the same on every rank */
    tera_status nst = tera_comm_set_nodes(tr->cfg.parallel.ranks_per_node);
    if (nst != TERA_OK) return nst;
    int *node_of = tera_calloc((size_t)t->world, sizeof(int));
    for (int w = 0; w < t->world; w++) node_of[w] = tera_comm_node_of(w);
    tera_topology_set_nodes(&tr->topo, node_of);
    free(node_of);
    if (tr->topo.ep > 1) {
        tr->ep_group = tera_layout_axis_group(t, TERA_AXIS_EP);
        tr->edp = tera_layout_axis_group(t, TERA_AXIS_EDP);
    }
    if (tr->topo.ep * tr->topo.tp * tr->topo.pp > 1) tr->mp = tera_layout_axis_group(t, TERA_AXIS_MP);
    TERA_ASSERT(!tr->mp || tera_comm_rank(tr->mp) == tera_layout_member(tr));
    /* ZeRO needs more than one data-parallel rank to shard over */
    tr->zero = tr->topo.dp > 1 ? tr->cfg.parallel.zero : 0;
    return TERA_OK;
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
 * whole backward: with tied embeddings both are in use from the first to the last op). */
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

struct tera_zero_ctx {
    zslot slot[N_SLOTS];
    int64_t version;
    float *block;
    int64_t *cnt;           /* [max(dp, edp)] reduce-scatter / all-gather counts */
    int prefetch;           /* ZeRO-3 prefetch on (parallel.zero_prefetch, no pipeline) */
    zprefetch pf;
    int dir;                /* +1 forward, -1 backward: the order layers are used in */
    int last_layer;         /* the layer group used last, or INT32_MIN */
    int plan;               /* pipeline: the executor names the order of use (tera_layout_zero3_plan) */
    int plan_last, plan_next; /* the current operation's last layer in its order of use, the next's first (-1: none) */
    int64_t n_gathered, n_prefetched, n_unused; /* layer gathers: all, of them prefetched, prefetches never used */
};

static int slot_of(int group) { return group == TERA_GROUP_EMBED ? SLOT_EMBED : group == TERA_GROUP_HEAD ? SLOT_HEAD : SLOT_LAYER; }

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

static void zero23_init(tera_trainer *tr) {
    tera_model *m = &tr->model;
    tera_zero_ctx *z = tera_calloc(1, sizeof *z);
    tr->zctx = z;
    int64_t size[N_SLOTS][2] = {{0}};
    for (int g = TERA_GROUP_HEAD; g < m->cfg.n_layers; g++)
        for (int x = 0; x < 2; x++) {
            int64_t lo, hi;
            tera_model_group_range(m, g, x, &lo, &hi);
            int64_t *sz = &size[slot_of(g)][x];
            if (hi - lo > *sz) *sz = hi - lo;
        }
    int64_t total = 0;
    const int nb = tr->zero >= 3 ? 2 : 1; /* gradient staging, and parameter staging for stage 3 */
    z->prefetch = tr->zero >= 3 && tr->cfg.parallel.zero_prefetch;
    z->plan = tr->topo.pp > 1;
    z->plan_last = z->plan_next = -1;
    for (int k = 0; k < N_SLOTS; k++)
        for (int x = 0; x < 2; x++) total += nb * ((size[k][x] + 15) & ~(int64_t)15);
    for (int x = 0; x < 2 && z->prefetch; x++) total += (size[SLOT_LAYER][x] + 15) & ~(int64_t)15;
    z->block = tera_calloc((size_t)total + 1, sizeof(float));
    float *p = z->block;
    for (int k = 0; k < N_SLOTS; k++) {
        z->slot[k].group = INT32_MIN;
        for (int x = 0; x < 2; x++) {
            const int64_t n = (size[k][x] + 15) & ~(int64_t)15;
            z->slot[k].g[x] = p, p += n;
            if (nb == 2) z->slot[k].w[x] = p, p += n;
        }
    }
    const int ranks = tr->topo.dp > tr->topo.edp ? tr->topo.dp : tr->topo.edp;
    z->pf.group = z->last_layer = INT32_MIN;
    z->dir = 1;
    if (z->prefetch) {
        for (int x = 0; x < 2; x++) z->pf.w[x] = p, p += (size[SLOT_LAYER][x] + 15) & ~(int64_t)15;
    }
    z->cnt = tera_calloc((size_t)ranks, sizeof(int64_t));
    /* the shards' gradients (and parameters for stage 3) */
    tera_adamw *o[2] = {&tr->opt, &tr->opt_x};
    for (int k = 0; k < 2; k++) {
        o[k]->g = tera_calloc((size_t)o[k]->n + 1, sizeof(float));
        if (tr->zero >= 3) o[k]->w = tera_calloc((size_t)o[k]->n + 1, sizeof(float));
    }
    /* memory accounting: the shards; the staging slots are communication buffers */
    m->bytes_grads = (int64_t)sizeof(float) * (o[0]->n + o[1]->n);
    if (tr->zero >= 3) m->bytes_params = (int64_t)sizeof(float) * (o[0]->n + o[1]->n);
    tr->bytes_zero_staging = (int64_t)sizeof(float) * total;
}

static void zero23_free(tera_trainer *tr) {
    tera_zero_ctx *z = tr->zctx;
    if (!z) return;
    tera_comm_wait(&z->pf.req[0]); /* a prefetch still in flight (inactive requests return at once) */
    tera_comm_wait(&z->pf.req[1]);
    free(z->block);
    free(z->cnt);
    free(z);
    tr->zctx = NULL;
    tera_adamw *o[2] = {&tr->opt, &tr->opt_x};
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

static zpiece pieces(tera_trainer *tr, int x, int64_t lo, int64_t hi) {
    zpiece p = {.c = x ? tr->edp : tr->dp, .o = x ? &tr->opt_x : &tr->opt, .me = x ? tr->topo.edp_rank : tr->topo.dp_rank};
    const int64_t base = x ? tr->model.n_dense_floats : 0;
    p.mine = piece_counts(x ? tr->shard_counts_x : tr->shard_counts, x ? tr->topo.edp : tr->topo.dp, p.me, lo - base,
                          hi - base, tr->zctx->cnt, &p.soff);
    return p;
}

/* Gathers a group's ranges into w (each rank copies its piece in, then all-gather): blocking, or
 * started into the prefetch slot when pf is given. */
static void gather_group(tera_trainer *tr, int group, float *const w[2], zprefetch *pf) {
    tera_zero_ctx *z = tr->zctx;
    for (int x = 0; x < 2; x++) {
        int64_t lo, hi;
        tera_model_group_range(&tr->model, group, x, &lo, &hi);
        if (hi <= lo) continue;
        const zpiece p = pieces(tr, x, lo, hi);
        if (z->cnt[p.me] > 0) memcpy(w[x] + p.mine, p.o->w + p.soff, sizeof(float) * (size_t)z->cnt[p.me]);
        if (pf)
            tera_comm_iallgather_f32(p.c, w[x], z->cnt, &pf->req[x]);
        else if (tr->gred[x])
            tera_greducer_allgather(tr->gred[x], w[x], z->cnt);
        else
            tera_comm_allgather_f32(p.c, w[x], z->cnt);
    }
}

/* Starts gathering layer `group` into the prefetch slot unless it is in use, already there, or
 * not a layer. A prefetch that was not used is completed first (every rank posts the same
 * collectives in the same order, so no rank is left waiting). */
static void prefetch_start(tera_trainer *tr, int group) {
    tera_zero_ctx *z = tr->zctx;
    zprefetch *pf = &z->pf;
    const zslot *sl = &z->slot[SLOT_LAYER];
    if (group < 0 || group >= tr->model.cfg.n_layers) return;
    if ((sl->group == group && sl->version == z->version) || (pf->group == group && pf->version == z->version)) return;
    tera_comm_wait(&pf->req[0]);
    tera_comm_wait(&pf->req[1]);
    if (pf->group != INT32_MIN) z->n_unused++;
    pf->group = group;
    pf->version = z->version;
    gather_group(tr, group, pf->w, pf);
}

static void zero_use_params(void *ctx, int group) {
    tera_trainer *tr = ctx;
    tera_zero_ctx *z = tr->zctx;
    zslot *sl = &z->slot[slot_of(group)];
    if (sl->group != group || sl->version != z->version) {
        zprefetch *pf = &z->pf;
        if (z->prefetch && group >= 0 && pf->group == group && pf->version == z->version) {
            /* prefetched: finish it and swap the slots (the layer slot's old contents become the
             * next prefetch's buffer) */
            tera_comm_wait(&pf->req[0]);
            tera_comm_wait(&pf->req[1]);
            for (int x = 0; x < 2; x++) {
                float *t = sl->w[x];
                sl->w[x] = pf->w[x], pf->w[x] = t;
            }
            pf->group = INT32_MIN;
            z->n_prefetched++;
        } else {
            gather_group(tr, group, sl->w, NULL);
        }
        if (group >= 0) z->n_gathered++;
        sl->group = group;
        sl->version = z->version;
        tera_model_bind_group(&tr->model, group, sl->w[0], sl->w[1], NULL, NULL);
    }
    if (!z->prefetch) return;
    if (z->plan) { /* a pipeline stage: the executor said which layer comes after this operation */
        if (group < 0 || z->plan_last < 0) return;
        prefetch_start(tr, group == z->plan_last ? z->plan_next : group + (z->plan_last > group ? 1 : -1));
        return;
    }
    /* the next layer in the order of use: forward starts at the embedding (layers ascending), backward
     * at the head (descending) */
    const int L = tr->model.cfg.n_layers;
    int next;
    if (group == TERA_GROUP_EMBED && tr->model.cfg.tie_embeddings && z->dir == -1 && z->last_layer == L - 1) {
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
    prefetch_start(tr, next);
}

static void zero_use_grads(void *ctx, int group) {
    tera_trainer *tr = ctx;
    tera_zero_ctx *z = tr->zctx;
    zslot *sl = &z->slot[slot_of(group)];
    if (sl->live && sl->group == group) return; /* accumulating since earlier in this backward */
    TERA_ASSERTF(!sl->live, "ZeRO-2: group %d's gradients were never reduced", sl->group);
    sl->live = 1;
    sl->pending = 0;
    for (int x = 0; x < 2; x++) {
        int64_t lo, hi;
        tera_model_group_range(&tr->model, group, x, &lo, &hi);
        if (hi > lo) memset(sl->g[x], 0, sizeof(float) * (size_t)(hi - lo)), sl->pending++;
    }
    sl->group = group;
    tera_model_bind_group(&tr->model, group, NULL, NULL, sl->g[0], sl->g[1]);
}

/* A group range's gradients are final for this micro-batch: sum them into the owners' shards. */
static void zero_grad_ready(void *ctx, int64_t offset, int64_t count) {
    tera_trainer *tr = ctx;
    tera_zero_ctx *z = tr->zctx;
    const int x = offset >= tr->model.n_dense_floats;
    zslot *sl = NULL;
    for (int k = 0; k < N_SLOTS; k++) {
        if (!z->slot[k].live) continue;
        int64_t lo, hi;
        tera_model_group_range(&tr->model, z->slot[k].group, x, &lo, &hi);
        if (lo == offset && hi == offset + count) sl = &z->slot[k];
    }
    TERA_ASSERTF(sl, "ZeRO-2: gradients of [%ld, %ld) are in no live slot", (long)offset, (long)(offset + count));
    const zpiece p = pieces(tr, x, offset, offset + count);
    if (tr->step == tr->faults.nan_step && count > 0) { /* test hook: a NaN in this rank's own gradient */
        sl->g[x][0] = NAN;
        tr->faults.nan_step = -1;
    }
    if (tr->gred[x]) /* hierarchical / compressed (error feedback indexed by the region's offsets) */
        tera_greducer_reduce_scatter(tr->gred[x], sl->g[x], offset - (x ? tr->model.n_dense_floats : 0), z->cnt);
    else
        tera_comm_reduce_scatter_f32(p.c, sl->g[x], z->cnt);
    const float *src = sl->g[x] + p.mine;
    float *dst = p.o->g + p.soff;
    for (int64_t i = 0; i < z->cnt[p.me]; i++) dst[i] += src[i];
    if (--sl->pending == 0) sl->live = 0;
}

void tera_layout_zero3_plan(tera_trainer *tr, int last, int next) {
    tera_zero_ctx *z = tr->zctx;
    if (!z || !z->plan) return;
    z->plan_last = last;
    z->plan_next = next;
}

void tera_layout_zero3_counts(const tera_trainer *tr, int64_t *gathered, int64_t *prefetched, int64_t *unused) {
    const tera_zero_ctx *z = tr->zctx;
    *gathered = z ? z->n_gathered : 0;
    *prefetched = z ? z->n_prefetched : 0;
    *unused = z ? z->n_unused : 0;
}

void tera_layout_bind_hooks(tera_trainer *tr) {
    tera_model *m = &tr->model;
    if (tr->zero < 2) return;
    m->bind_ctx = tr;
    m->use_grads = zero_use_grads;
    if (tr->zero >= 3) m->use_params = zero_use_params;
}

/* The gradient callback of a micro-batch's backward under this layout (NULL: none needed). */
void (*tera_layout_grad_ready(tera_trainer *tr))(void *, int64_t, int64_t) {
    return tr->zero >= 2 ? zero_grad_ready : NULL;
}

void tera_layout_zero_grads(tera_trainer *tr) {
    if (tr->zero < 2) {
        tera_model_zero_grad(&tr->model);
        return;
    }
    memset(tr->opt.g, 0, sizeof(float) * (size_t)tr->opt.n);
    memset(tr->opt_x.g, 0, sizeof(float) * (size_t)tr->opt_x.n);
}

/* Test hooks (fault injection): scale every gradient, poison one. */
void tera_layout_grad_scale(tera_trainer *tr, float s) {
    if (tr->zero < 2) {
        tera_grad_scale(&tr->model, s);
        return;
    }
    tera_adamw *o[2] = {&tr->opt, &tr->opt_x};
    for (int k = 0; k < 2; k++)
        for (int64_t i = 0; i < o[k]->n; i++) o[k]->g[i] *= s;
}

/* A NaN in this rank's gradient where its own backward would have produced one: in the gradient the
 * backward accumulates into, before any data-parallel sum (called after the gradients are zeroed).
 * ZeRO-2/3 stage each group's gradients in a slot that is zeroed when the group starts, so there the
 * NaN goes into the first slot summed (zero_grad_ready). */
void tera_layout_poison_grad(tera_trainer *tr) {
    if (tr->zero < 2) {
        tr->model.g[tr->model.n_floats / 2] = NAN;
        tr->faults.nan_step = -1;
    }
}

/* The parts of region k (0 weights, 1 exp_avg, 2 exp_avg_sq) of the flat buffer [0, n) this rank
 * stores: up to two ranges [lo, hi) with their storage (p[o - lo] holds element o); *sharded: the
 * ranges are this rank's ZeRO shards (the data-parallel replicas hold other parts), else the rank
 * holds the whole region as its replicas do. */
typedef struct {
    int64_t lo, hi;
    float *p;
} lseg;

static int region_segs(const tera_trainer *tr, int k, lseg s[2], int *sharded) {
    const tera_model *m = &tr->model;
    if (k == 0 && m->w) {
        s[0] = (lseg){0, m->n_floats, m->w};
        *sharded = 0;
        return 1;
    }
    const tera_adamw *o[2] = {&tr->opt, &tr->opt_x};
    for (int x = 0; x < 2; x++) s[x] = (lseg){o[x]->lo, o[x]->hi, k == 0 ? o[x]->w : k == 1 ? o[x]->m : o[x]->v};
    *sharded = k == 0 ? 1 : tr->zero >= 1;
    return 2;
}

void tera_layout_init_weights(tera_trainer *tr, uint64_t seed) {
    tera_model *m = &tr->model;
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
    const int ns = region_segs(tr, 0, sg, &sharded);
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

void tera_layout_gather_window(tera_trainer *tr, const tera_model *shell, int k, int64_t a, int64_t b, float *win,
                               int root_only) {
    const tera_model *m = &tr->model;
    const int64_t nw = b - a, n64 = (nw + 1) / 2;
    memset(win, 0, sizeof(int64_t) * (size_t)n64);
    lseg sg[2];
    int sharded;
    const int ns = region_segs(tr, k, sg, &sharded);
    int64_t wrote = 0; /* elements of the window this rank wrote */
    /* root_only: the runs this rank wrote (window offset, length), sent to rank 0 below */
    int64_t *runs = NULL, n_runs = 0, cap_runs = 0;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *lp = &m->params[i], *gp = &shell->params[i];
        if (lp->numel == 0 || gp->offset >= b || gp->offset + gp->numel <= a) continue;
        if (lp->tp_dim < 0 && tr->topo.tp_rank != 0) continue;                          /* tp rank 0's copy */
        if (!sharded && (lp->expert_stacked ? tr->topo.edp_rank : tr->topo.dp_rank) != 0) continue; /* the first replica's */
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
                    memcpy(win + (x0 - a) + (z0 - y0), sg[s].p + (z0 - sg[s].lo), sizeof(float) * (size_t)(z1 - z0));
                    wrote += z1 - z0;
                    if (root_only && !tr->root) {
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
    if (tr->topo.world == 1) {
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
        const int P = tr->topo.world;
        int64_t *sz = tera_calloc((size_t)P, sizeof(int64_t));
        /* a rank's message: the run count, the runs (offset, length), then their values in that order */
        const int64_t mine = tr->root || !n_runs ? 0 : 8 + 16 * n_runs + (int64_t)sizeof(float) * wrote;
        sz[tr->topo.rank] = mine;
        tera_comm_allreduce_i64(w, sz, P);
        int64_t total = 0;
        for (int r = 0; r < P; r++) total += sz[r];
        if (total > 0) {
            uint8_t *pack = tera_malloc((size_t)(tr->root ? total : mine) + 8);
            enum { GATHER_TAG = 1 }; /* the world communicator carries no other point-to-point messages */
            if (!tr->root && mine > 0) {
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
            } else if (tr->root) {
                tera_comm_req *rq = tera_calloc((size_t)P, sizeof(tera_comm_req));
                int64_t at = 0;
                for (int r = 1; r < P; r++) {
                    if (sz[r] > 0) tera_comm_irecv_f32(w, (float *)(void *)(pack + at), sz[r] / 4, r, GATHER_TAG, &rq[r]);
                    at += sz[r];
                }
                for (int r = 1; r < P; r++) tera_comm_wait(&rq[r]);
                free(rq);
            }
            if (tr->root) { /* each rank's runs into their places */
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

void tera_layout_local_window(tera_trainer *tr, int k, int x, int64_t a, int64_t b, float *dst) {
    lseg sg[2];
    int sharded;
    region_segs(tr, k, sg, &sharded);
    if (!sharded) {
        memcpy(dst, sg[0].p + (a - sg[0].lo), sizeof(float) * (size_t)(b - a));
        return;
    }
    const int ranks = x ? tr->topo.edp : tr->topo.dp, me = x ? tr->topo.edp_rank : tr->topo.dp_rank;
    const int64_t base = x ? tr->model.n_dense_floats : 0;
    int64_t *cnt = tera_calloc((size_t)ranks, sizeof(int64_t)), soff;
    const int64_t mine = piece_counts(x ? tr->shard_counts_x : tr->shard_counts, ranks, me, a - base, b - base, cnt, &soff);
    if (cnt[me] > 0) memcpy(dst + mine, sg[x].p + soff, sizeof(float) * (size_t)cnt[me]);
    tera_comm_allgather_f32(x ? tr->edp : tr->dp, dst, cnt);
    free(cnt);
}

tera_status tera_layout_load(tera_trainer *tr, tera_ckpt_reader *rd, int moments) {
    tera_model *m = &tr->model;
    tera_model shell;
    tera_layout_global_shell(tr, &shell);
    tera_status st = TERA_OK;
    for (int k = 0; k < (moments ? 3 : 1) && st == TERA_OK; k++) {
        lseg sg[2];
        int sharded;
        const int ns = region_segs(tr, k, sg, &sharded);
        for (int i = 0; i < m->n_params && st == TERA_OK; i++) {
            const tera_param *lp = &m->params[i], *gp = &shell.params[i];
            const int64_t nr = tera_block_n_runs(gp->shape, lp->len);
            for (int64_t r = 0; r < nr && st == TERA_OK; r++) {
                int64_t g, l, n;
                tera_block_run(gp->shape, lp->lo, lp->len, r, &g, &l, &n);
                l += lp->offset;
                for (int s = 0; s < ns && st == TERA_OK; s++) {
                    const int64_t z0 = l > sg[s].lo ? l : sg[s].lo, z1 = l + n < sg[s].hi ? l + n : sg[s].hi;
                    if (z1 > z0) st = tera_ckpt_reader_read(rd, k, i, g + (z0 - l), z1 - z0, sg[s].p + (z0 - sg[s].lo));
                }
            }
        }
    }
    if (st == TERA_OK && m->router_bias) st = tera_ckpt_reader_bias(rd, m->router_bias);
    if (tr->zctx) tr->zctx->version++; /* ZeRO-3: gathered parameters are stale */
    free(shell.params);
    return st;
}

tera_status tera_layout_init(tera_trainer *tr) {
    const tera_parallel_config *p = &tr->cfg.parallel;
    tera_model *m = &tr->model;
    /* the groups (tera_layout_groups) exist; here the optimizer's ranges */
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    (void)p;
    tr->shard_counts = tera_calloc((size_t)tr->topo.dp, sizeof(int64_t));
    tr->shard_counts_x = tera_calloc((size_t)tr->topo.edp, sizeof(int64_t));
    if (tr->zero) {
        int64_t *lo = tera_calloc((size_t)(tr->topo.dp > tr->topo.edp ? tr->topo.dp : tr->topo.edp), sizeof(int64_t));
        shard(nd, tr->topo.dp, tr->shard_counts, lo);
        tera_adamw_init_range(&tr->opt, lo[tr->topo.dp_rank], lo[tr->topo.dp_rank] + tr->shard_counts[tr->topo.dp_rank]);
        shard(n - nd, tr->topo.edp, tr->shard_counts_x, lo);
        tera_adamw_init_range(&tr->opt_x, nd + lo[tr->topo.edp_rank], nd + lo[tr->topo.edp_rank] + tr->shard_counts_x[tr->topo.edp_rank]);
        free(lo);
    } else {
        /* one allocation for both regions, so the whole moments are contiguous (a one-rank
         * checkpoint snapshots them directly) */
        tera_adamw_init_range(&tr->opt, 0, n);
        tr->opt_x = (tera_adamw){.m = tr->opt.m + nd, .v = tr->opt.v + nd, .lo = nd, .hi = n, .n = n - nd, .view = 1};
        tr->opt.hi = tr->opt.n = nd;
    }
    if (tr->zero >= 2) zero23_init(tr);
    tera_adamw_plan(&tr->opt, m); /* the optimizer's work items, so that the step allocates nothing */
    tera_adamw_plan(&tr->opt_x, m);
    /* hierarchical / compressed gradient sums (collective over each group; NULL when both are off) */
    const int ck = tera_compress_parse(p->grad_compression);
    TERA_ASSERTF(ck >= 0 && ck != TERA_COMPRESS_FP8, "parallel.grad_compression = %s", p->grad_compression);
    if (tr->topo.dp > 1) tr->gred[0] = tera_greducer_create(tr->dp, nd, (tera_compress_kind)ck, p->hierarchical);
    if (tr->topo.edp > 1 && n > nd)
        tr->gred[1] = tera_greducer_create(tr->edp, n - nd, (tera_compress_kind)ck, p->hierarchical);
    return TERA_OK;
}

void tera_layout_free(tera_trainer *tr) {
    tera_onebit_free(tr); /* its reducers use the groups freed below */
    zero23_free(tr);
    tera_greducer_free(tr->gred[0]);
    tera_greducer_free(tr->gred[1]);
    tr->gred[0] = tr->gred[1] = NULL;
    free(tr->shard_counts);
    free(tr->shard_counts_x);
    tr->shard_counts = tr->shard_counts_x = NULL;
    tera_adamw_free(&tr->opt_x);
    tera_comm *world = tera_comm_world(); /* a group spanning the world is the world itself */
    if (tr->ep_group && tr->ep_group != world) tera_comm_free(tr->ep_group);
    if (tr->edp && tr->edp != tr->dp && tr->edp != world) tera_comm_free(tr->edp);
    if (tr->mp && tr->mp != world) tera_comm_free(tr->mp);
    if (tr->tp_group && tr->tp_group != world) tera_comm_free(tr->tp_group);
    if (tr->pp_group && tr->pp_group != world) tera_comm_free(tr->pp_group);
    if (tr->sg && tr->sg != tr->dp && tr->sg != world) tera_comm_free(tr->sg);
    if (tr->dp && tr->dp != world) tera_comm_free(tr->dp);
    tr->ep_group = tr->edp = tr->mp = tr->tp_group = tr->pp_group = tr->sg = tr->dp = NULL;
}

void tera_layout_global_shell(const tera_trainer *tr, tera_model *shell) {
    memset(shell, 0, sizeof *shell);
    shell->cfg = tr->model.cfg;
    shell->B = tr->model.B;
    shell->T = tr->model.T;
    shell->params = tera_param_table_ep(&shell->cfg, 1, 0, &shell->n_params, &shell->n_floats, &shell->n_dense_floats);
    shell->par.ep = 1;
    shell->n_moe_layers = tr->model.n_moe_layers;
    shell->router_bias = tr->model.router_bias;
}


int tera_layout_member_writes(const tera_trainer *tr, int member, const tera_param *p) {
    if (p->numel == 0) return 0;
    if (!p->expert_stacked && member / tr->topo.tp % tr->topo.ep != 0) return 0; /* non-expert: the first of the ep group */
    return p->tp_dim >= 0 || member % tr->topo.tp == 0;                     /* replicated over tp: the first tp rank */
}

int tera_layout_writes(const tera_trainer *tr, const tera_param *p) {
    /* one copy: the first expert-data-parallel replica */
    return tr->topo.edp_rank == 0 && tera_layout_member_writes(tr, tera_layout_member(tr), p);
}

int tera_layout_member(const tera_trainer *tr) { return (tr->topo.pp_rank * tr->topo.ep + tr->topo.ep_rank) * tr->topo.tp + tr->topo.tp_rank; }

tera_param *tera_layout_member_table(const tera_trainer *tr, int member, int64_t *n_floats) {
    const tera_model *m = &tr->model;
    const tera_shard_spec sp = {.ep = tr->topo.ep, .ep_rank = member / tr->topo.tp % tr->topo.ep, .tp = tr->topo.tp,
                                .tp_rank = member % tr->topo.tp, .pp = tr->topo.pp, .pp_rank = member / (tr->topo.tp * tr->topo.ep),
                                .v = m->par.v, .layer_first = m->layer_first};
    int np;
    int64_t nf;
    return tera_param_table_spec(&m->cfg, &sp, &np, n_floats ? n_floats : &nf, NULL);
}

void tera_layout_scatter(tera_trainer *tr, const float *gw, const float *gm, const float *gv) {
    /* straight into this rank's storage (its blocks; under ZeRO its shards), no temporary */
    tera_model *m = &tr->model;
    tera_model shell;
    tera_layout_global_shell(tr, &shell);
    const float *src[3] = {gw, gm, gv};
    for (int k = 0; k < 3; k++) {
        if (!src[k]) continue;
        lseg sg[2];
        int sharded;
        const int ns = region_segs(tr, k, sg, &sharded);
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
                        memcpy(sg[x].p + (z0 - sg[x].lo), src[k] + gp->offset + g + (z0 - l), sizeof(float) * (size_t)(z1 - z0));
                }
            }
        }
    }
    if (!m->w && gw && tr->zctx) tr->zctx->version++; /* ZeRO-3: gathered parameters are stale */
    free(shell.params);
}

/* Whether this rank's sums of tensor i count toward the whole model's: each element of the model
 * must be counted once over the world. Copies on several data-parallel ranks count on the first
 * (ZeRO-1 shards split them instead), copies on several tensor-parallel ranks (norms, router) on
 * tp rank 0. */
static int counts_here(const tera_trainer *tr, const tera_param *p) {
    if (p->tp_dim < 0 && tr->topo.tp_rank != 0) return 0;
    if (tr->zero) return 1;
    return p->expert_stacked ? tr->topo.edp_rank == 0 : tr->topo.dp_rank == 0;
}

void tera_layout_reduce_grads(tera_trainer *tr) {
    tera_model *m = &tr->model;
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    if (tr->topo.dp == 1 || tr->zero >= 2) return; /* ZeRO-2/3: reduced group by group during backward */
    if (tr->zero) { /* each rank sums only its own shard of each region */
        if (tr->gred[0]) tera_greducer_reduce_scatter(tr->gred[0], m->g, 0, tr->shard_counts);
        else tera_comm_reduce_scatter_f32(tr->dp, m->g, tr->shard_counts);
        if (n > nd && tr->gred[1]) tera_greducer_reduce_scatter(tr->gred[1], m->g + nd, 0, tr->shard_counts_x);
        else if (n > nd) tera_comm_reduce_scatter_f32(tr->edp, m->g + nd, tr->shard_counts_x);
    } else if (tr->gred[0] || tr->gred[1]) { /* hierarchical / compressed: no buckets were started */
        if (tr->gred[0]) tera_greducer_allreduce(tr->gred[0], m->g, 0, nd);
        else tera_comm_allreduce_f32(tr->dp, m->g, nd);
        if (n > nd && tr->gred[1]) tera_greducer_allreduce(tr->gred[1], m->g + nd, 0, n - nd);
        else if (n > nd) tera_comm_allreduce_f32(tr->edp, m->g + nd, n - nd);
    } else { /* the buckets started during the last backward */
        for (int i = 0; i < tr->n_buckets; i++) tera_comm_wait(&tr->buckets[i]);
    }
}

double tera_layout_grad_sq(tera_trainer *tr) {
    tera_model *m = &tr->model;
    double *sq = tr->grad_sq, *sq2 = tr->grad_sq + m->n_params;
    tera_adamw_grad_sq(&tr->opt, m, sq); /* one parallel region each (src/train/optim.c) */
    tera_adamw_grad_sq(&tr->opt_x, m, sq2);
    /* a tensor another rank counts (a replica) still enters as NaN when this rank's copy of its
     * gradient is not finite: the update this rank would apply must be skipped everywhere */
    for (int i = 0; i < m->n_params; i++) {
        const double v = sq[i] + sq2[i];
        sq[i] = counts_here(tr, &m->params[i]) || !isfinite(v) ? v : 0.0;
    }
    if (tr->topo.world > 1) tera_comm_allreduce_f64(tera_comm_world(), sq, m->n_params);
    double tot = 0.0;
    for (int i = 0; i < m->n_params; i++) tot += sq[i];
    return tot;
}

void tera_layout_adamw_step(tera_trainer *tr, float lr, float clip_scale, double *sums) {
    tera_model *m = &tr->model;
    const tera_optim_config *oc = &tr->cfg.optimizer;
    const int64_t nd = m->n_dense_floats, n = m->n_floats;
    double *usq = tr->grad_sq + m->n_params * 2, *psq = usq + m->n_params; /* per tensor */
    memset(usq, 0, sizeof(double) * 2 * (size_t)m->n_params);
    tera_adamw_step_by_param(&tr->opt, m, lr, clip_scale, oc, !tr->zero, NULL, NULL, usq, psq);
    tera_adamw_step_by_param(&tr->opt_x, m, lr, clip_scale, oc, !tr->zero, NULL, NULL, usq, psq);
    if (tr->zctx) tr->zctx->version++; /* ZeRO-3: gathered parameters are stale */
    if (tr->zero && tr->zero < 3) { /* every rank gets every shard's new parameters */
        if (tr->gred[0]) tera_greducer_allgather(tr->gred[0], m->w, tr->shard_counts);
        else tera_comm_allgather_f32(tr->dp, m->w, tr->shard_counts);
        if (n > nd && tr->gred[1]) tera_greducer_allgather(tr->gred[1], m->w + nd, tr->shard_counts_x);
        else if (n > nd) tera_comm_allgather_f32(tr->edp, m->w + nd, tr->shard_counts_x);
    }
    double s[2] = {0.0, 0.0}; /* update^2, param^2 over the whole model */
    for (int i = 0; i < m->n_params; i++)
        if (counts_here(tr, &m->params[i])) s[0] += usq[i], s[1] += psq[i];
    if (tr->topo.world > 1) tera_comm_allreduce_f64(tera_comm_world(), s, 2);
    sums[0] = s[0];
    sums[1] = s[1];
}
