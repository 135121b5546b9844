/* tera plan: the memory of one rank of a parallel layout, without allocating the model.
 *
 * Sources of every figure (the planner must not be a second guess):
 * - parameters: tera_param_table_spec with the rank's shard spec (the table tera_model_create_par
 *   builds), so n_floats and n_dense are the allocator's own;
 * - activations, scratch and the expert-exchange buffers: tera_model_count (src/model/model.c), the
 *   allocator's own counting pass (the shape, the parameter table and the carving that
 *   tera_model_create_par runs, with nothing allocated); tests/test_plan.c and tests/cli_plan.sh
 *   check the result against the allocator;
 * - optimizer, ZeRO-2/3 shards and staging slots: tera_layout_init / zero23_init (src/train/layout.c),
 *   the slots sized by each group's span as tera_model_group_range gives it (restated as one pass
 *   over the table: the search builds thousands of tables);
 * - activation slots of a pipeline stage: the schedule's simulated peak (tera_pipe_slots);
 * - pipeline buffers, checkpoint buffers, router state: src/parallel/pipeline.c, trainer.c, checkpoint.c;
 * - the bf16 weight shadow: tera_bf16_shadow_on (src/train/precision.c), the rule the trainer registers
 *   it by, with the precision and bf16 units resolved as tera train resolves them on this machine. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "tera/backend.h"
#include "tera/ckpt.h"
#include "tera/compress.h"
#include "tera/model.h"
#include "tera/plan.h"
#include "plan_internal.h"
#include "tera/precision.h"
#include "tera/schedule.h"
#include "tera/zero.h"
#include "tera/topology.h"
#include "tera/train.h"

const char *const tera_pm_name[TERA_PM_N] = {"params", "grads", "optimizer", "activations", "scratch",
                                             "comm", "pipeline", "checkpoint", "other", "onebit", "bf16_shadow"};

/* The CPU backend that sizes the per-thread scratch (tera_model_count asks it for the attention
 * and routing scratch of omp_get_max_threads() threads): one for the process. */
static tera_backend *sizing_backend(void) {
    static tera_backend *be;
    if (!be) be = tera_backend_cpu_create(-1);
    return be;
}

/* The precision and bf16 units tera train resolves for cfg on this machine (training.precision and
 * training.bf16_gemm: `auto` asks the CPU, and bf16_gemm = auto without AMX times a probe): resolved
 * once per process for each pair of settings (the search plans thousands of layouts of one config).
 * A multi-rank run takes fma if any rank's probe chose it; this process's probe stands for them. */
static void resolved_units(const tera_config *cfg, tera_precision *p, tera_bf16_gemm *g) {
    static char prec[sizeof cfg->training.precision], gemm[sizeof cfg->training.bf16_gemm];
    static int have;
    static tera_precision rp;
    static tera_bf16_gemm rg;
    if (!have || strcmp(prec, cfg->training.precision) || strcmp(gemm, cfg->training.bf16_gemm)) {
        tera_backend *be = sizing_backend();
        rp = tera_precision_resolve(be, cfg->training.precision, NULL);
        rg = rp == TERA_PREC_BF16 ? tera_bf16_gemm_resolve(be, cfg->training.bf16_gemm, NULL) : TERA_BF16_NATIVE;
        snprintf(prec, sizeof prec, "%s", cfg->training.precision);
        snprintf(gemm, sizeof gemm, "%s", cfg->training.bf16_gemm);
        have = 1;
    }
    *p = rp, *g = rg;
}

/* ------------------------------------------------------------------ layout pieces */
/* The layer split over pp x v virtual stages: parallel.pp_layers (tera_config_pp_layers, the one
 * parser), or tera_pp_split's balanced split, as the trainer takes it. */
static tera_status layer_split(const tera_config *cfg, int *first) {
    const int S = cfg->parallel.pp * cfg->parallel.pp_chunks;
    if (cfg->parallel.pp_layers[0]) return tera_config_pp_layers(&cfg->parallel, cfg->model.n_layers, first);
    tera_pp_split(&cfg->model, S, cfg->training.seq_len, first);
    return TERA_OK;
}

/* src/train/layout.c's shard(): this rank's count of n floats cut into w 16-float aligned shards */
static int64_t shard_count(int64_t n, int w, int r) {
    const int64_t S = ((n + w - 1) / w + 15) & ~(int64_t)15;
    const int64_t lo = (int64_t)r * S < n ? (int64_t)r * S : n, hi = lo + S < n ? lo + S : n;
    return hi - lo;
}

/* What the parameter table of one (pp_rank, tp_rank, ep_rank) gives: sizes, the ZeRO staging slot
 * sizes of zero23_init, and each group's range sizes (what tera_model_group_range returns; for the
 * ZeRO-3 gathers of the time model). */
static void table_of(const tera_config *cfg, const tera_shard_spec *spec, tera_plan_table *ts) {
    tera_model shell;
    memset(&shell, 0, sizeof shell);
    shell.cfg = cfg->model;
    shell.params = tera_param_table_spec(&cfg->model, spec, &shell.n_params, &shell.n_floats, &shell.n_dense_floats);
    ts->n_floats = shell.n_floats;
    ts->n_dense = shell.n_dense_floats;
    ts->n_params = shell.n_params;
    memset(ts->stage, 0, sizeof ts->stage);
    const int L = cfg->model.n_layers;
    ts->group = tera_calloc((size_t)(2 * (L + 2)), sizeof(int64_t));
    /* tera_model_group_range of every group and both regions, in one pass over the table (the search
     * builds thousands of tables): the span [min offset, max end) of the group's stored tensors */
    int64_t *lo = tera_calloc((size_t)(2 * (L + 2)), sizeof(int64_t));
    for (int i = 0; i < 2 * (L + 2); i++) lo[i] = INT64_MAX;
    for (int i = 0; i < shell.n_params; i++) {
        const tera_param *q = &shell.params[i];
        if (q->numel == 0) continue;
        const int g = q->layer >= 0 ? q->layer : q->kind == TERA_P_EMBED ? TERA_GROUP_EMBED
                      : (q->kind == TERA_P_FINAL_NORM || q->kind == TERA_P_LM_HEAD) ? TERA_GROUP_HEAD : INT32_MIN;
        if (g == INT32_MIN) continue;
        const int k = 2 * (g + 2) + (q->expert_stacked != 0);
        if (q->offset < lo[k]) lo[k] = q->offset;
        if (q->offset + q->numel > ts->group[k]) ts->group[k] = q->offset + q->numel; /* hi for now */
    }
    for (int g = TERA_GROUP_HEAD; g < L; g++)
        for (int x = 0; x < 2; x++) {
            const int k = 2 * (g + 2) + x;
            ts->group[k] = ts->group[k] > 0 ? ts->group[k] - lo[k] : 0;
            const int slot = g == TERA_GROUP_EMBED ? 0 : g == TERA_GROUP_HEAD ? 1 : 2;
            if (ts->group[k] > ts->stage[slot][x]) ts->stage[slot][x] = ts->group[k];
        }
    free(lo);
    free(shell.params);
}

/* ------------------------------------------------------------------ table cache (the search) */
typedef struct {
    int tp, ep, pp, v, pp_rank;
    char pp_layers[256];
    tera_plan_table tab;
} cache_entry;

/* a simulated schedule (slots per stage, bubble, makespan) and a layer split, by their inputs */
typedef struct {
    char kind[16];
    int pp, m, v;
    int *slots;
    double bubble, makespan;
} sched_entry;
typedef struct {
    int S, T;
    char pp_layers[256];
    int *first;
} split_entry;

#define CACHE_BUCKETS 4096
struct tera_plan_cache {
    sched_entry *sched;
    int n_sched, cap_sched;
    split_entry *split;
    int n_split, cap_split;
    cache_entry *e;
    int *next;               /* [cap] chain in a bucket */
    int head[CACHE_BUCKETS]; /* first entry + 1 of each bucket (0: empty) */
    int n, cap;
};

tera_plan_cache *tera_plan_cache_new(void) { return tera_calloc(1, sizeof(tera_plan_cache)); }

void tera_plan_cache_free(tera_plan_cache *c) {
    if (!c) return;
    for (int i = 0; i < c->n; i++) free(c->e[i].tab.group);
    for (int i = 0; i < c->n_sched; i++) free(c->sched[i].slots);
    for (int i = 0; i < c->n_split; i++) free(c->split[i].first);
    free(c->sched);
    free(c->split);
    free(c->e);
    free(c->next);
    free(c);
}

static unsigned cache_hash(int tp, int ep, int pp, int v, int pp_rank, const char *layers) {
    unsigned h = 2166136261u;
    const int k[5] = {tp, ep, pp, v, pp_rank};
    for (int i = 0; i < 5; i++) h = (h ^ (unsigned)k[i]) * 16777619u;
    for (const char *q = layers; *q; q++) h = (h ^ (unsigned char)*q) * 16777619u;
    return h % CACHE_BUCKETS;
}

static int resolve_threads(const tera_config *cfg, int threads) {
    if (threads > 0) return threads;
    return cfg->training.threads > 0 ? cfg->training.threads : omp_get_num_procs();
}

/* One rank, with its stage's table stats and slot count given. */
static void rank_mem(const tera_config *cfg, const tera_topology *t, const int *first, int slots,
                     const tera_plan_table *ts, const uint8_t *policy, int threads, tera_plan_mem *out) {
    const tera_model_config *mc = &cfg->model;
    const tera_train_config *tc = &cfg->training;
    const int L = mc->n_layers, pp = t->pp, v = pp > 1 ? cfg->parallel.pp_chunks : 1;
    memset(out, 0, sizeof *out);
    out->pp_rank = t->pp_rank, out->dp_rank = t->dp_rank, out->tp_rank = t->tp_rank;
    out->n_ranks = 1;
    out->slots = slots;
    out->layer_lo = first[t->pp_rank], out->layer_hi = first[t->pp_rank + 1];
    out->n_floats = ts->n_floats, out->n_dense = ts->n_dense;
    /* the model's own count (tera_model_count): activations, scratch, exchange buffers; the attention
     * and routing scratch sized for `threads` OpenMP threads */
    tera_model_config mcfg = *mc;
    mcfg.recompute = tc->recompute;
    mcfg.loss_chunk = tc->loss_chunk;
    const int zero_ = t->dp > 1 ? cfg->parallel.zero : 0;
    const tera_model_par par = {.ep = t->ep, .tp = t->tp, .pp = pp, .pp_rank = t->pp_rank, .v = v, .n_slots = slots,
                                .layer_first = first, .shard_params = zero_ >= 3, .shard_grads = zero_ >= 2,
                                .a2a_compression = tera_compress_parse(cfg->parallel.a2a_compression),
                                .a2a_rows_bf16 = tera_a2a_rows_bf16(cfg),
                                .sp = cfg->parallel.sequence_parallel, .be = sizing_backend()};
    tera_model_bytes mb;
    const int old = omp_get_max_threads();
    omp_set_num_threads(threads);
    const tera_status cst = tera_model_count_acts(&mcfg, tc->micro_batch, tc->seq_len, &par, &mb);
    omp_set_num_threads(old);
    TERA_ASSERTF(cst == TERA_OK, "tera_model_count of a layout the configuration checks accepted");
    (void)policy;
    /* parallel.pp_head_split: the pair's scratch, and on the first stage its half of the head (tera_model_create_par) */
    const int hs_role = cfg->parallel.pp_head_split && pp > 1 ? (t->pp_rank == 0 ? 1 : t->pp_rank == pp - 1 ? 2 : 0) : 0;
    /* parallel.pp_defer_wgrad: the deferred head weight gradients' queue on the stages that compute the head */
    const int64_t dwq = tera_model_wgrad_bytes(mc, tc->micro_batch, tc->seq_len, t->tp, pp, t->pp_rank, hs_role,
                                               cfg->parallel.pp_defer_wgrad);
    const int64_t acts = mb.acts, scratch = mb.scratch + tera_model_head_split_bytes(mc, tc->micro_batch, tc->seq_len, hs_role, t->tp,
                                                                           cfg->parallel.sequence_parallel) + dwq,
                  comm = mb.comm, comm_acts = mb.comm_acts;
    const int64_t N = (int64_t)tc->micro_batch * tc->seq_len;
    const int sp_on = cfg->parallel.sequence_parallel && t->tp > 1;
    /* optimizer and ZeRO (tera_layout_groups / tera_layout_init / zero23_init) */
    const int zero = t->dp > 1 ? cfg->parallel.zero : 0;
    const int64_t n = ts->n_floats, nd = ts->n_dense;
    int64_t on = n, oxn = 0, staging = 0;
    if (zero) {
        on = shard_count(nd, t->dp, t->dp_rank);
        oxn = shard_count(n - nd, t->edp, t->edp_rank);
    }
    int64_t bp = 4 * n, bg = 4 * n;
    if (zero >= 2) {
        staging = 4 * tera_zero_staging_floats(ts->stage, zero, cfg->parallel.zero_prefetch, mc->tie_embeddings);
        bg = 4 * (on + oxn);
        if (zero >= 3) bp = 4 * (on + oxn);
    }
    out->bytes[TERA_PM_PARAMS] = bp;
    out->bytes[TERA_PM_GRADS] = bg;
    out->bytes[TERA_PM_OPTIMIZER] = (cfg->optimizer.moments ? 4 : 8) * (on + oxn); /* optimizer.moments fp32 | bf16 */
    out->bytes[TERA_PM_ACTS] = acts - comm_acts;
    out->bytes[TERA_PM_SCRATCH] = scratch - (comm - comm_acts);
    out->bytes[TERA_PM_COMM] = comm + staging;
    if (pp > 1) /* tera_pipe_create: send/receive buffers per slot and chunk, tokens and targets */
        out->bytes[TERA_PM_PIPELINE] = 4 * ((int64_t)slots * v * 4 * (sp_on ? N / t->tp : N) * mc->dim + 1) +
                                       2 * 4 * (int64_t)slots * N; /* sequence parallelism: a rank's rows */
    /* a whole save from the rank's own storage (world rank 0 writes, the others hold nothing): its
     * snapshot where one is needed (tera_trainer_save_whole); else streamed, every rank holding the
     * window and a chunk */
    out->bytes[TERA_PM_CKPT] = !tera_ckpt_save_is_whole(cfg, t) ? tera_ckpt_writer_buffer_bytes(cfg) + TERA_CKPT_CHUNK_BYTES
                               : t->rank == 0 ? tera_ckpt_snapshot_bytes(cfg, n)
                                              : 0;
    /* router bias, expert load, router entropy; per-tensor squared norms (grad_sq); tokens and targets */
    out->bytes[TERA_PM_OTHER] = (int64_t)L * mc->n_experts * (4 + 8) + 8 * (int64_t)L + 8 * 4 * (int64_t)ts->n_params +
                                2 * 4 * N;
    /* optimizer.name = onebit_adam (src/train/onebit.c, the count tera_onebit_init prints): ZeRO-1/2/3's whole
     * momentum, ZeRO-2/3's whole gradient of the rank's own (after the freeze), and per region shared by q > 1 ranks (non-expert over dp, experts over edp) its 1-bit
     * all-reduce's two residuals (the region's size each), the region compressed, q chunks received
     * compressed and one fp32 chunk (chunk: the region over q, rounded up to 16 floats) */
    if (!strcmp(cfg->optimizer.name, "onebit_adam")) {
        int64_t extra = (zero ? 4 * n : 0) + (zero >= 2 ? 4 * n : 0); /* + ZeRO-2/3's whole own gradient */
        for (int x = 0; x < 2; x++) {
            const int64_t len = x ? n - nd : nd;
            const int q = x ? t->edp : t->dp;
            if (q <= 1 || len <= 0) continue;
            const int64_t chunk = ((len + q - 1) / q + 15) & ~(int64_t)15;
            extra += 8 * len + tera_compress_bytes(TERA_COMPRESS_ONEBIT, len) +
                     q * tera_compress_bytes(TERA_COMPRESS_ONEBIT, chunk) + 4 * chunk;
        }
        out->bytes[TERA_PM_ONEBIT] = extra;
    }
    /* the bf16 weight shadow: 2 bytes per resident parameter (the model's n_floats: no ZeRO-3 shards) */
    tera_precision prec;
    tera_bf16_gemm units;
    resolved_units(cfg, &prec, &units);
    if (tera_bf16_shadow_on(cfg, zero, prec, units)) out->bytes[TERA_PM_SHADOW] = 2 * n;
    for (int k = 0; k < TERA_PM_N; k++) {
        out->total += out->bytes[k];
        if (k <= TERA_PM_COMM) out->printed_total += out->bytes[k];
    }
}

/* ------------------------------------------------------------------ public */
typedef struct {
    int L;
    uint8_t *policy;
    int *first, *slots;
    tera_topology topo;
    double bubble, makespan; /* the schedule's simulation (tf = 1/v, tb = 2/v per virtual stage) */
} layout_ctx;

/* Activation slots of every pipeline stage: the schedule's simulated peak (tera_pipe_slots
 * simulates with tf = 1, tb = 2, which gives the same order of operations and peaks); and the
 * bubble and makespan of the stage's whole work (a chunk holds 1/v of it, tera schedule's scaling). */
static tera_status stage_slots(const tera_config *cfg, layout_ctx *c) {
    const int pp = cfg->parallel.pp;
    c->bubble = 0.0;
    c->makespan = 3.0 * cfg->training.grad_accum;
    if (pp <= 1) {
        c->slots[0] = 1;
        return TERA_OK;
    }
    tera_sched_kind kind;
    tera_schedule s;
    tera_sched_stats ss;
    TERA_TRY(tera_sched_kind_parse(cfg->parallel.pp_schedule, &kind));
    TERA_TRY(tera_schedule_build(&s, kind, pp, cfg->training.grad_accum, cfg->parallel.pp_chunks));
    tera_status st = tera_schedule_simulate(&s, 1.0, 2.0, &ss);
    for (int r = 0; r < pp && st == TERA_OK; r++) {
        const int n = r < 64 ? ss.peak_in_flight_rank[r] : ss.peak_in_flight;
        c->slots[r] = n > 0 ? n : 1;
    }
    if (st == TERA_OK) {
        const double k = s.v > 1 ? 1.0 / s.v : 1.0;
        st = tera_schedule_simulate(&s, k, 2.0 * k, &ss);
        c->bubble = ss.bubble;
        c->makespan = ss.makespan;
    }
    tera_schedule_free(&s);
    return st;
}

static void *grow(void *a, int n, int *cap, size_t size) {
    if (n < *cap) return a;
    *cap = *cap ? 2 * *cap : 32;
    void *b = tera_calloc((size_t)*cap, size);
    if (n) memcpy(b, a, size * (size_t)n);
    free(a);
    return b;
}

static tera_status ctx_init_cached(layout_ctx *c, const tera_config *cfg, tera_plan_cache *cache);
static tera_status ctx_init(layout_ctx *c, const tera_config *cfg) { return ctx_init_cached(c, cfg, NULL); }

static tera_status ctx_init_cached(layout_ctx *c, const tera_config *cfg, tera_plan_cache *cache) {
    memset(c, 0, sizeof *c);
    const tera_parallel_config *p = &cfg->parallel;
    const int world = p->pp * p->dp * p->tp;
    TERA_TRY(tera_topology_init(&c->topo, world, 0, p->pp, p->dp, p->tp, p->ep));
    c->L = cfg->model.n_layers;
    c->policy = tera_calloc((size_t)c->L, 1);
    tera_status st = tera_recompute_parse(cfg->training.recompute, c->L, c->policy);
    const int v = p->pp > 1 ? p->pp_chunks : 1;
    c->first = tera_calloc((size_t)(p->pp * v + 1), sizeof(int));
    c->slots = tera_calloc((size_t)p->pp, sizeof(int));
    const int S = p->pp * v;
    if (st == TERA_OK && p->pp > 1 && cache) { /* the split: computed once per (stages, T, pp_layers) */
        int hit = -1;
        for (int i = 0; i < cache->n_split && hit < 0; i++)
            if (cache->split[i].S == S && cache->split[i].T == cfg->training.seq_len &&
                !strcmp(cache->split[i].pp_layers, p->pp_layers))
                hit = i;
        if (hit < 0) {
            cache->split = grow(cache->split, cache->n_split, &cache->cap_split, sizeof *cache->split);
            split_entry *e = &cache->split[hit = cache->n_split++];
            e->S = S, e->T = cfg->training.seq_len;
            snprintf(e->pp_layers, sizeof e->pp_layers, "%s", p->pp_layers);
            e->first = tera_calloc((size_t)S + 1, sizeof(int));
            st = layer_split(cfg, e->first);
            if (st != TERA_OK) free(e->first), cache->n_split--; /* not kept */
        }
        if (st == TERA_OK) memcpy(c->first, cache->split[hit].first, sizeof(int) * (size_t)(S + 1));
    } else if (st == TERA_OK) {
        if (p->pp > 1) st = layer_split(cfg, c->first);
        else c->first[1] = c->L;
    }
    if (st == TERA_OK && p->pp > 1 && cache) { /* the schedule: simulated once per (kind, pp, m, v) */
        int hit = -1;
        for (int i = 0; i < cache->n_sched && hit < 0; i++) {
            const sched_entry *e = &cache->sched[i];
            if (e->pp == p->pp && e->m == cfg->training.grad_accum && e->v == p->pp_chunks && !strcmp(e->kind, p->pp_schedule))
                hit = i;
        }
        if (hit < 0) {
            st = stage_slots(cfg, c);
            if (st == TERA_OK) {
                cache->sched = grow(cache->sched, cache->n_sched, &cache->cap_sched, sizeof *cache->sched);
                sched_entry *e = &cache->sched[cache->n_sched++];
                snprintf(e->kind, sizeof e->kind, "%s", p->pp_schedule);
                e->pp = p->pp, e->m = cfg->training.grad_accum, e->v = p->pp_chunks;
                e->slots = tera_calloc((size_t)p->pp, sizeof(int));
                memcpy(e->slots, c->slots, sizeof(int) * (size_t)p->pp);
                e->bubble = c->bubble, e->makespan = c->makespan;
            }
        } else {
            const sched_entry *e = &cache->sched[hit];
            memcpy(c->slots, e->slots, sizeof(int) * (size_t)p->pp);
            c->bubble = e->bubble, c->makespan = e->makespan;
        }
    } else if (st == TERA_OK) {
        st = stage_slots(cfg, c);
    }
    if (st != TERA_OK) {
        free(c->policy), free(c->first), free(c->slots);
        memset(c, 0, sizeof *c);
    }
    return st;
}

static void ctx_free(layout_ctx *c) {
    free(c->policy);
    free(c->first);
    free(c->slots);
}

/* The table of rank t's part (ep_rank and tp_rank slices have equal sizes: tp divides every split
 * width, ep the experts; only pp_rank changes it). From the cache when given (owned by it), else
 * computed into *own (the caller frees own->group). */
static const tera_plan_table *table_at(const tera_config *cfg, const layout_ctx *c, const tera_topology *t,
                                       tera_plan_cache *cache, tera_plan_table *own) {
    const int v = t->pp > 1 ? cfg->parallel.pp_chunks : 1;
    const unsigned b = cache ? cache_hash(t->tp, t->ep, t->pp, v, t->pp_rank, cfg->parallel.pp_layers) : 0;
    if (cache)
        for (int i = cache->head[b] - 1; i >= 0; i = cache->next[i] - 1) {
            const cache_entry *e = &cache->e[i];
            if (e->tp == t->tp && e->ep == t->ep && e->pp == t->pp && e->v == v && e->pp_rank == t->pp_rank &&
                !strcmp(e->pp_layers, cfg->parallel.pp_layers))
                return &e->tab;
        }
    const tera_shard_spec spec = {.ep = t->ep, .ep_rank = 0, .tp = t->tp, .tp_rank = 0, .pp = t->pp,
                                  .pp_rank = t->pp_rank, .v = v, .layer_first = c->first};
    if (!cache) {
        table_of(cfg, &spec, own);
        return own;
    }
    if (cache->n == cache->cap) {
        cache->cap = cache->cap ? 2 * cache->cap : 64;
        cache_entry *ne = tera_calloc((size_t)cache->cap, sizeof *ne);
        int *nn = tera_calloc((size_t)cache->cap, sizeof *nn);
        if (cache->n) memcpy(ne, cache->e, sizeof *ne * (size_t)cache->n), memcpy(nn, cache->next, sizeof *nn * (size_t)cache->n);
        free(cache->e);
        free(cache->next);
        cache->e = ne;
        cache->next = nn;
    }
    cache->next[cache->n] = cache->head[b];
    cache->head[b] = cache->n + 1;
    cache_entry *e = &cache->e[cache->n++];
    *e = (cache_entry){.tp = t->tp, .ep = t->ep, .pp = t->pp, .v = v, .pp_rank = t->pp_rank};
    snprintf(e->pp_layers, sizeof e->pp_layers, "%s", cfg->parallel.pp_layers);
    table_of(cfg, &spec, &e->tab);
    return &e->tab;
}

tera_status tera_plan_rank_memory(const tera_config *cfg, int wrank, int threads, tera_plan_mem *out) {
    layout_ctx c;
    TERA_TRY(ctx_init(&c, cfg));
    if (wrank < 0 || wrank >= c.topo.world) {
        ctx_free(&c);
        return tera_fail(TERA_ERR_ARG, "rank %d is not in the layout's %d ranks", wrank, c.topo.world);
    }
    const tera_topology t = tera_topology_at(&c.topo, wrank);
    tera_plan_table own;
    const tera_plan_table *ts = table_at(cfg, &c, &t, NULL, &own);
    rank_mem(cfg, &t, c.first, c.slots[t.pp_rank], ts, c.policy, resolve_threads(cfg, threads), out);
    free(own.group);
    ctx_free(&c);
    return TERA_OK;
}

static int same_figures(const tera_plan_mem *a, const tera_plan_mem *b) {
    return a->pp_rank == b->pp_rank && a->n_floats == b->n_floats && a->n_dense == b->n_dense &&
           !memcmp(a->bytes, b->bytes, sizeof a->bytes);
}

tera_status tera_plan_roles(const tera_config *cfg, int threads, tera_plan_mem **out, int *n) {
    layout_ctx c;
    TERA_TRY(ctx_init(&c, cfg));
    const int th = resolve_threads(cfg, threads);
    /* one table per stage gives every rank's sizes there; ZeRO shards then differ by dp rank only
     * through the 16-float rounding of the last shards */
    int cap = 16, cnt = 0;
    tera_plan_mem *roles = tera_calloc((size_t)cap, sizeof *roles);
    for (int s = 0; s < c.topo.pp; s++) {
        tera_topology t = tera_topology_at(&c.topo, tera_topology_rank_of(&c.topo, s, 0, 0));
        tera_plan_table own;
        const tera_plan_table *ts = table_at(cfg, &c, &t, NULL, &own);
        const int first_role = cnt;
        for (int d = 0; d < c.topo.dp; d++) {
            t = tera_topology_at(&c.topo, tera_topology_rank_of(&c.topo, s, d, 0));
            tera_plan_mem m;
            rank_mem(cfg, &t, c.first, c.slots[s], ts, c.policy, th, &m);
            m.n_ranks = c.topo.tp;
            int found = 0;
            for (int r = first_role; r < cnt && !found; r++)
                if (same_figures(&roles[r], &m)) roles[r].n_ranks += m.n_ranks, found = 1;
            if (found) continue;
            if (cnt == cap) {
                cap *= 2;
                tera_plan_mem *nr = tera_calloc((size_t)cap, sizeof *nr);
                memcpy(nr, roles, sizeof *roles * (size_t)cnt);
                free(roles);
                roles = nr;
            }
            roles[cnt++] = m;
        }
        free(own.group);
    }
    ctx_free(&c);
    *out = roles;
    *n = cnt;
    return TERA_OK;
}

/* Per stage (dp rank 0, which holds the largest ZeRO shards: shards are cut in rank order and only
 * the last ones are short): memory, table, layers; and the schedule's bubble and makespan. */
tera_status tera_plan_stages(const tera_config *cfg, tera_plan_cache *cache, int threads, tera_plan_stage *st,
                             double *bubble, double *makespan) {
    layout_ctx c;
    TERA_TRY(ctx_init_cached(&c, cfg, cache));
    const int th = resolve_threads(cfg, threads);
    const int v = c.topo.pp > 1 ? cfg->parallel.pp_chunks : 1;
    for (int s = 0; s < c.topo.pp; s++) {
        const tera_topology t = tera_topology_at(&c.topo, tera_topology_rank_of(&c.topo, s, 0, 0));
        tera_plan_table own;
        const tera_plan_table *ts = table_at(cfg, &c, &t, cache, &own);
        tera_plan_stage *o = &st[s];
        rank_mem(cfg, &t, c.first, c.slots[s], ts, c.policy, th, &o->mem);
        o->layers = o->moe_layers = 0;
        memset(o->full, 0, sizeof o->full);
        memset(o->selective, 0, sizeof o->selective);
        for (int vs = s; vs < c.topo.pp * v; vs += c.topo.pp)
            for (int l = c.first[vs]; l < c.first[vs + 1]; l++) {
                const int moe = l >= cfg->model.first_k_dense;
                o->layers++;
                o->moe_layers += moe;
                o->full[moe] += c.policy[l] == TERA_RECOMPUTE_FULL;
                o->selective[moe] += c.policy[l] == TERA_RECOMPUTE_SELECTIVE;
            }
        o->group = cache ? ts->group : NULL;
        if (!cache) free(own.group);
        o->n_floats = ts->n_floats, o->n_dense = ts->n_dense, o->n_params = ts->n_params;
        o->sends = 0;
        for (int ch = 0; ch < v; ch++) {
            const int vs = ch * c.topo.pp + s;
            o->sends += (vs < c.topo.pp * v - 1) + (vs > 0);
        }
    }
    *bubble = c.bubble;
    *makespan = c.makespan;
    ctx_free(&c);
    return TERA_OK;
}
