/* ZeRO sharding alone (include/tera/zero.h), without a trainer or a config file.
 *
 * This program runs itself under mpirun (skipped without mpirun) on 2 and 4 ranks. For each layout
 * (dp = ranks with ep = 1, and ep = 2 so that the expert region is sharded over edp = dp / 2) and
 * each ZeRO stage 0-3, every rank builds its model from the model API (the tiny MoE of
 * tests/test_pipeline.c), the communicators (include/tera/groups.h) and the module, and runs NS
 * steps of A micro-batches: forward/backward of its own samples with the module's gradient hook,
 * the reduction, the gradient norm and AdamW, all through the module. Every rank also trains the
 * one-process reference: one model, the micro-batches of all ranks accumulated in rank order, the
 * plain AdamW (tera_adamw_step). Checked on every rank:
 *   - init: tera_zero_init_weights gives each rank's storage (ZeRO-3: each parameter shard) the
 *     values of the same elements of a stage-0 model of the same layout, bit for bit, and the whole
 *     model gathered (tera_zero_gather_window) equals the one-process init bit for bit;
 *   - after every step, the gathered weights of stage 1 equal stage 0's and those of stage 3 equal
 *     stage 2's bit for bit (the same sums in the same order: cross_stage below), and every stage's
 *     equal the reference's within LAYOUT_TOL
 *     (tests/mpilib.sh: 2e-6 relative, as cli_layouts and cli_dist compare layouts to one rank),
 *     taken over the whole vector (||w - w_ref|| / ||w_ref||), and so do the summed loss and the
 *     gradient norm;
 *   - the moments gathered (regions 1 and 2) equal the reference's within the same tolerance;
 *     a window gathered to rank 0 only (root_only) and an odd window inside the buffer equal the
 *     same elements of the whole gather, bit for bit;
 *   - tera_zero_scatter of the reference's weights and moments, gathered again, gives them back
 *     bit for bit, and tera_zero_local_window of this rank's ranges equals its storage;
 *   - the bytes each rank holds (parameters, gradients, moments, ZeRO-2/3 staging) equal the
 *     planner's formula (tera_plan_rank_memory, the one cli_memory and `tera plan` use);
 *   - ZeRO-1/2/3's gradient reduce-scatters start non-blocking (tera_zero_rs_counts: every one over
 *     several ranks; ZeRO-1's one per bucket of the last backward), and stages 1-3 run again with
 *     them blocking (TERA_ZERO_RS_OVERLAP=0; ZeRO-1: one reduce-scatter per region after the
 *     backward, none counted) give the weights of stage 0 (stage 1) and of the overlapped stage 2
 *     (stages 2 and 3) bit for bit after every step;
 *   - ZeRO-3 gathers every layer in host-shared memory (tera_zero_counts; the ranks run on one host),
 *     and the gradient sums are done there (tera_zero_shared_sums: ZeRO-0/1's buckets, the experts'
 *     over their expert-data-parallel ranks' buffers, ZeRO-2/3's layers); stages 0-3 again with the
 *     collectives (TERA_ZERO_SHARED=0, nothing shared): the weights of stage 0 / the overlapped
 *     ZeRO-2 in host-shared memory bit for bit after every step either way;
 *   - ZeRO-1/2 gather the updated parameters in host-shared memory (tera_zero_shared_param_gathers:
 *     once a step, none with TERA_ZERO_SHARED=0), and
 *     a rank's buffer holds every rank's new piece when tera_zero_adamw_step and
 *     tera_zero_params_updated return, with the last rank copying late (TERA_TEST_PW_LAG_US=2000): the
 *     buffer as it is on return equals the gathered weights bit for bit, and each rank's marked piece
 *     is in every buffer.
 * On one process (no mpirun) the module runs as one rank: stage 0, checked against the reference. */
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/groups.h"
#include "tera/plan.h"
#include "tera/zero.h"

#define CHECK(cond) TU_RANK_CHECK(me, cond)

static int me;
static int rs_blocking; /* TERA_ZERO_RS_OVERLAP=0: the second pass of stages 1-3 */
static int no_shared;   /* TERA_ZERO_SHARED=0: the third pass of stage 3 (all-gathers) */
enum { B = 2, T = 8, A = 2, NS = 3 };
static const double LAYOUT_TOL = 2e-6; /* tests/mpilib.sh */

static tera_model_config tiny_cfg(void) {
    tera_config c;
    tera_config_defaults(&c);
    tera_model_config m = c.model;
    m.vocab_size = 37;
    m.dim = 16;
    m.n_layers = 3;
    m.n_heads = 4;
    m.n_kv_heads = 2;
    m.n_experts = 4;
    m.top_k = 2;
    m.ffn_dim = 12;
    m.n_shared_experts = 1;
    m.first_k_dense = 1;
    m.dense_ffn_dim = 20;
    m.max_seq_len = 64;
    m.init_std = 0.3f;
    m.aux_coef = 0.1f;
    m.z_coef = 0.01f;
    tera_model_config_derive(&m);
    return m;
}

/* Micro-batch a of rank r at step s: tokens and targets [B*T], the same on every rank. */
static void sample(const tera_model_config *c, int s, int r, int a, int32_t *tok, int32_t *tgt) {
    uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)(1 + s * 131 + r * 17 + a);
    for (int i = 0; i < B * T; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((x >> 33) % (uint64_t)c->vocab_size);
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        tgt[i] = (int32_t)((x >> 33) % (uint64_t)c->vocab_size);
    }
}

static tera_optim_config optim(void) {
    tera_config c;
    tera_config_defaults(&c);
    tera_optim_config o = c.optimizer;
    o.weight_decay = 0.1f;
    return o;
}

static double rel_norm(const float *a, const float *b, int64_t n) {
    double d = 0.0, r = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double e = (double)a[i] - (double)b[i];
        d += e * e;
        r += (double)b[i] * b[i];
    }
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

static tera_loss_scales scales(const tera_model_config *c, int ranks) {
    const int moe = c->n_layers - c->first_k_dense;
    const int64_t seqs = (int64_t)A * B * ranks;
    return (tera_loss_scales){.ce = 1.0f / (float)(seqs * T), .aux = c->aux_coef / (float)(moe * seqs),
                              .z = c->z_coef / (float)((int64_t)moe * seqs * T)};
}

/* The one-process reference: weights, moments and per-step loss sums / grad norms. */
typedef struct {
    tera_model m;
    tera_adamw o;
    double ce[NS], gnorm[NS];
    float *w[NS]; /* weights after each step */
} reference;

static void ref_run(reference *R, const tera_model_config *cfg, int ranks, uint64_t seed, float lr) {
    CHECK(tera_model_create(&R->m, cfg, B, T) == TERA_OK);
    tera_model_init_weights(&R->m, seed);
    tera_adamw_init(&R->o, R->m.n_floats);
    const tera_optim_config oc = optim();
    const tera_loss_scales s = scales(cfg, ranks);
    int32_t tok[B * T], tgt[B * T];
    for (int st = 0; st < NS; st++) {
        tera_model_zero_grad(&R->m);
        R->ce[st] = 0.0;
        for (int r = 0; r < ranks; r++)
            for (int a = 0; a < A; a++) {
                sample(cfg, st, r, a, tok, tgt);
                tera_model_forward(&R->m, tok, tgt);
                R->ce[st] += R->m.stats.ce_sum;
                tera_model_backward(&R->m, &s);
            }
        R->gnorm[st] = tera_grad_norm(&R->m);
        tera_adamw_step(&R->o, &R->m, lr, 1.0f, &oc, 1, NULL, NULL);
        R->w[st] = malloc(sizeof(float) * (size_t)R->m.n_floats);
        memcpy(R->w[st], R->m.w, sizeof(float) * (size_t)R->m.n_floats);
    }
}

static void ref_free(reference *R) {
    for (int st = 0; st < NS; st++) free(R->w[st]);
    tera_adamw_free(&R->o);
    tera_model_destroy(&R->m);
}

/* A model of this rank's layout and its module. */
typedef struct {
    tera_topology topo;
    tera_groups g;
    tera_model m;
    tera_zero *z;
} rank_run;

static void rank_open(rank_run *q, const tera_model_config *cfg, int ep, int stage) {
    tera_comm *world = tera_comm_world();
    CHECK(tera_topology_init(&q->topo, tera_comm_size(world), tera_comm_rank(world), 1, tera_comm_size(world), 1, ep) ==
          TERA_OK);
    CHECK(tera_groups_create(&q->g, &q->topo, 0) == TERA_OK);
    const int zs = tera_zero_stage_in_effect(&q->topo, stage);
    int first[2];
    tera_pp_split(cfg, 1, T, first);
    const tera_model_par par = {.ep = ep, .group = q->g.ep, .dp_group = q->g.dp, .tp = 1, .pp = 1, .v = 1,
                                .layer_first = first, .n_slots = 1, .shard_grads = zs >= 2, .shard_params = zs >= 3};
    CHECK(tera_model_create_par(&q->m, cfg, B, T, &par) == TERA_OK);
    const tera_zero_env env = {.model = &q->m, .topo = &q->topo, .dp = q->g.dp, .edp = q->g.edp, .stage = stage,
                               .prefetch = stage >= 3, .grad_compression = "none"};
    CHECK(tera_zero_create(&env, &q->z) == TERA_OK && q->z && q->z->stage == zs);
}

static void rank_close(rank_run *q) {
    tera_zero_destroy(q->z);
    tera_model_destroy(&q->m);
    tera_groups_free(&q->g);
}

/* Region k of the whole one-process buffer, gathered on every rank (n_global floats). */
static float *gather_all(rank_run *q, const tera_model *shell, int k) {
    float *w = calloc((size_t)shell->n_floats + 2, sizeof(float));
    tera_zero_gather_window(q->z, shell, k, 0, shell->n_floats, w, 0);
    return w;
}

/* The weights after each step of stages 0 and 2 of one layout, for the cross-stage comparison. */
typedef struct {
    float *w[2][NS];
} snapshots;

/* Bytes this rank holds against the planner's formula for the same layout. */
static void check_memory(rank_run *q, const tera_model_config *cfg, int ep, int stage) {
    tera_config c;
    tera_config_defaults(&c);
    c.model = *cfg;
    c.training.micro_batch = B, c.training.seq_len = T, c.training.grad_accum = A;
    c.parallel.dp = q->topo.dp, c.parallel.ep = ep, c.parallel.zero = stage, c.parallel.zero_prefetch = stage >= 3;
    tera_plan_mem pm, p0;
    CHECK(tera_plan_rank_memory(&c, q->topo.rank, 1, &pm) == TERA_OK);
    c.parallel.zero = 0;
    CHECK(tera_plan_rank_memory(&c, q->topo.rank, 1, &p0) == TERA_OK);
    CHECK(pm.bytes[TERA_PM_PARAMS] == q->m.bytes_params);
    CHECK(pm.bytes[TERA_PM_GRADS] == q->m.bytes_grads);
    CHECK(pm.bytes[TERA_PM_OPTIMIZER] == tera_zero_optimizer_bytes(q->z));
    CHECK(pm.bytes[TERA_PM_COMM] - p0.bytes[TERA_PM_COMM] == q->z->bytes_staging);
    const int zs = tera_zero_stage_in_effect(&q->topo, stage);
    if (zs >= 1) /* the shards split each region: their sum over the ranks sharing it is the region */
        CHECK(tera_zero_optimizer_bytes(q->z) < 8 * q->m.n_floats);
}

static void run_case(const tera_model_config *cfg, const reference *R, int ep, int stage, snapshots *snap) {
    const uint64_t seed = 11;
    const float lr = 3e-3f;
    rank_run q;
    rank_open(&q, cfg, ep, stage);
    tera_zero *z = q.z;
    tera_model *m = &q.m;
    const int ranks = q.topo.world;
    tera_model shell;
    tera_zero_global_shell(m, &shell);
    CHECK(shell.n_floats == R->m.n_floats);

    /* init: this rank's storage against a stage-0 model of the same layout, the whole against the reference */
    tera_zero_init_weights(z, seed);
    rank_run q0;
    rank_open(&q0, cfg, ep, 0);
    tera_zero_init_weights(q0.z, seed);
    if (m->w) {
        CHECK(memcmp(m->w, q0.m.w, sizeof(float) * (size_t)m->n_floats) == 0);
    } else { /* ZeRO-3: each shard is the same elements' slice */
        const tera_adamw *o[2] = {&z->opt, &z->opt_x};
        for (int x = 0; x < 2; x++)
            CHECK(memcmp(o[x]->w, q0.m.w + o[x]->lo, sizeof(float) * (size_t)o[x]->n) == 0);
    }
    for (int x = 0; x < 2; x++) { /* this rank's ranges, assembled from the shards where sharded */
        const int64_t lo = x ? m->n_dense_floats : 0, hi = x ? m->n_floats : m->n_dense_floats;
        float *dst = calloc((size_t)(hi - lo) + 1, sizeof(float));
        tera_zero_local_window(z, 0, x, lo, hi, dst);
        CHECK(memcmp(dst, q0.m.w + lo, sizeof(float) * (size_t)(hi - lo)) == 0);
        free(dst);
    }
    rank_close(&q0);
    tera_model ref0;
    CHECK(tera_model_create(&ref0, cfg, B, T) == TERA_OK);
    tera_model_init_weights(&ref0, seed);
    float *w = gather_all(&q, &shell, 0);
    CHECK(memcmp(w, ref0.w, sizeof(float) * (size_t)shell.n_floats) == 0);
    free(w);
    tera_model_destroy(&ref0);
    check_memory(&q, cfg, ep, stage);

    /* the steps */
    const tera_optim_config oc = optim();
    const tera_loss_scales s = scales(cfg, ranks);
    int32_t tok[B * T], tgt[B * T];
    for (int st = 0; st < NS; st++) {
        tera_zero_grads_begin(z, 0);
        double ce = 0.0;
        for (int a = 0; a < A; a++) {
            sample(cfg, st, q.topo.dp_rank, a, tok, tgt);
            tera_model_forward(m, tok, tgt);
            ce += m->stats.ce_sum;
            m->grad_ready = tera_zero_grad_ready(z, a == A - 1);
            m->grad_ready_ctx = z;
            tera_model_backward(m, &s);
            m->grad_ready = NULL;
        }
        tera_zero_grads_end(z);
        if (ranks > 1) tera_zero_reduce_grads(z);
        const double gn = sqrt(tera_zero_grad_sq(z));
        double sums[2];
        tera_zero_adamw_step(z, lr, 1.0f, &oc, sums);
        CHECK(sums[1] > 0.0 && sums[0] > 0.0);
        /* ep 1: this rank's whole parameters as they are on return, before any other call (ZeRO-1/2:
         * every shard's new values already there), compared below with the gathered ones bit for bit */
        float *own = m->w && m->n_floats == shell.n_floats ? malloc(sizeof(float) * (size_t)m->n_floats) : NULL;
        if (own) memcpy(own, m->w, sizeof(float) * (size_t)m->n_floats);
        tera_comm_allreduce_f64(tera_comm_world(), &ce, 1);
        CHECK(fabs(ce - R->ce[st]) <= LAYOUT_TOL * fabs(R->ce[st]));
        CHECK(fabs(gn - R->gnorm[st]) <= LAYOUT_TOL * R->gnorm[st]);
        w = gather_all(&q, &shell, 0);
        if (own) {
            const int same = memcmp(own, w, sizeof(float) * (size_t)shell.n_floats) == 0;
            if (!same) fprintf(stderr, "rank %d: zero %d step %d: parameters on return are not the gathered ones\n", me, stage, st);
            CHECK(same);
            free(own);
        }
        const double d = rel_norm(w, R->w[st], shell.n_floats);
        if (d > LAYOUT_TOL) fprintf(stderr, "rank %d: ep %d zero %d step %d: weights %.3g from one process\n", me, ep, stage, st, d);
        CHECK(d <= LAYOUT_TOL);
        /* cross_stage: ZeRO-1 sums the gradients as ZeRO-0 does (over the ranks after the last
         * micro-batch, a reduce-scatter instead of an all-reduce) and ZeRO-3 as ZeRO-2 (over the ranks
         * after every micro-batch, then over the micro-batches): the same sums in the same order, so
         * bit-identical; between the two pairs the order differs (ranks first or micro-batches first),
         * measured 6e-8 relative after one step, and both are within LAYOUT_TOL of one process above */
        if ((stage == 0 || stage == 2) && !rs_blocking && !no_shared) {
            snap->w[stage / 2][st] = w;
        } else { /* (blocking reduce-scatters: against the overlapped ZeRO-2) */
            const float *base = snap->w[stage / 2][st];
            const int same = memcmp(w, base, sizeof(float) * (size_t)shell.n_floats) == 0;
            if (!same)
                fprintf(stderr, "rank %d: ep %d zero %d%s step %d: weights differ from ZeRO-%d's by %.3g (relative)\n", me,
                        ep, stage, rs_blocking ? " (blocking reduce-scatters)" : "", st, stage / 2 * 2, rel_norm(w, base, shell.n_floats));
            CHECK(same);
            free(w);
        }
    }

    /* the moments, and windows gathered to rank 0 only or in pieces */
    const float *refk[3] = {R->m.w, R->o.m, R->o.v};
    for (int k = 0; k < 3; k++) {
        float *all = gather_all(&q, &shell, k);
        CHECK(rel_norm(all, refk[k], shell.n_floats) <= (k ? 10 : 1) * LAYOUT_TOL);
        float *root = calloc((size_t)shell.n_floats + 2, sizeof(float));
        tera_zero_gather_window(z, &shell, k, 0, shell.n_floats, root, 1);
        if (q.topo.rank == 0) CHECK(memcmp(root, all, sizeof(float) * (size_t)shell.n_floats) == 0);
        const int64_t a = shell.n_floats / 3 + 1, b = 2 * shell.n_floats / 3; /* odd bounds */
        tera_zero_gather_window(z, &shell, k, a, b, root, 0);
        CHECK(memcmp(root, all + a, sizeof(float) * (size_t)(b - a)) == 0);
        free(root);
        free(all);
    }
    /* the reference's state scattered into this rank's part and gathered back */
    tera_zero_scatter(z, R->m.w, R->o.m, R->o.v);
    for (int k = 0; k < 3; k++) {
        float *all = gather_all(&q, &shell, k);
        CHECK(memcmp(all, refk[k], sizeof(float) * (size_t)shell.n_floats) == 0);
        free(all);
    }
    int64_t gathered, prefetched, unused, shared;
    tera_zero_counts(z, &gathered, &prefetched, &unused, &shared);
    if (z->stage >= 3) CHECK(gathered > 0 && prefetched > 0);
    else CHECK(gathered == 0 && shared == 0);
    /* ranks on one host gather ZeRO-3's layers in host-shared memory, every one of them (TERA_ZERO_SHARED=0:
     * none; the same bits, checked above against ZeRO-2) */
    const char *shm = getenv("TERA_COMM_SHM");
    const int host_shared = !no_shared && !(shm && !strcmp(shm, "0")) && q.topo.dp > 1;
    if (z->stage >= 3) CHECK(shared == (host_shared ? gathered : 0));
    /* gradient sums straight from the ranks' buffers: ZeRO-0 and ZeRO-1 (its reduce-scatters overlapped;
     * the experts over their expert-data-parallel ranks' buffers in the same block), ZeRO-2/3 always */
    const int whole = z->stage >= 2 || z->stage == 0 || !rs_blocking;
    const int64_t ssum = tera_zero_shared_sums(z);
    if (!((host_shared && whole) ? ssum > 0 : ssum == 0))
        fprintf(stderr, "rank %d: ep %d zero %d: %ld gradient sums in host-shared memory\n", me, ep, z->stage, (long)ssum);
    CHECK((host_shared && whole) ? ssum > 0 : ssum == 0);
    /* ZeRO-1/2 gather the updated parameters there too, once a step (TERA_ZERO_SHARED=0: by all-gather;
     * the same bits, checked above) */
    const int pw = host_shared && (z->stage == 1 || z->stage == 2);
    const int64_t pgat = tera_zero_shared_param_gathers(z);
    if (!(pw ? pgat == NS : pgat == 0))
        fprintf(stderr, "rank %d: ep %d zero %d: %ld parameter gathers in host-shared memory\n", me, ep, z->stage, (long)pgat);
    CHECK(pw ? pgat == NS : pgat == 0);
    if (pw) { /* every rank's piece is in this rank's buffer when tera_zero_params_updated returns, with
                 nothing else between (TERA_TEST_PW_LAG_US: the last rank copies late) */
        for (int64_t i = z->opt.lo; i < z->opt.hi; i++) m->w[i] = 1000.0f + (float)q.topo.dp_rank;
        tera_zero_params_updated(z);
        int64_t at = 0, bad = 0;
        for (int r = 0; r < q.topo.dp; r++) {
            for (int64_t i = at; i < at + z->shard_counts[r]; i++) bad += m->w[i] != 1000.0f + (float)r;
            at += z->shard_counts[r];
        }
        if (bad) fprintf(stderr, "rank %d: zero %d: %ld parameters of other ranks' pieces missing on return\n", me, z->stage, (long)bad);
        CHECK(bad == 0);
    }
    int64_t rs, rs_nb, rs_early;
    tera_zero_rs_counts(z, &rs, &rs_nb, &rs_early);
    if (z->stage >= 2 || (z->stage == 1 && !rs_blocking)) CHECK(rs > 0 && rs_nb == (rs_blocking ? 0 : rs) && rs_early <= rs_nb);
    else CHECK(rs == 0 && rs_nb == 0); /* ZeRO-1 blocking: one reduce-scatter per region after the backward */
    free(shell.params);
    rank_close(&q);
}

static void run_layout(const tera_model_config *cfg, int ep) {
    const int ranks = tera_comm_size(tera_comm_world());
    reference R;
    ref_run(&R, cfg, ranks, 11, 3e-3f);
    snapshots snap = {{{0}}};
    for (int stage = 0; stage <= 3; stage++) run_case(cfg, &R, ep, stage, &snap);
    /* the gradient reduce-scatters blocking: the same bits as overlapped */
    setenv("TERA_ZERO_RS_OVERLAP", "0", 1);
    rs_blocking = 1;
    for (int stage = 1; stage <= 3; stage++) run_case(cfg, &R, ep, stage, &snap);
    rs_blocking = 0;
    unsetenv("TERA_ZERO_RS_OVERLAP");
    /* the gradient sums (ZeRO-0-3) and ZeRO-3's layer gathers by the collectives instead of in
     * host-shared memory: the same bits */
    setenv("TERA_ZERO_SHARED", "0", 1);
    no_shared = 1;
    for (int stage = 0; stage <= 3; stage++) run_case(cfg, &R, ep, stage, &snap);
    no_shared = 0;
    unsetenv("TERA_ZERO_SHARED");
    for (int st = 0; st < NS; st++) free(snap.w[0][st]), free(snap.w[1][st]);
    ref_free(&R);
    if (me == 0) fprintf(stderr, "test_zero: %d ranks, ep %d: ZeRO 0-3 checked over %d steps\n", ranks, ep, NS);
}

static int mpi_main(int argc, char **argv) {
    CHECK(tera_comm_init(&argc, &argv) == TERA_OK);
    me = tera_comm_rank(tera_comm_world());
    const tera_model_config cfg = tiny_cfg();
    run_layout(&cfg, 1);
    if (tera_comm_size(tera_comm_world()) % 2 == 0) run_layout(&cfg, 2);
    tera_comm_finalize();
    return 0;
}

static void test_under_mpirun(void **state) {
    (void)state;
    if (!tu_mpirun_ready()) return;
    /* one OpenMP thread per rank: 4 ranks share the machine's cores */
    tu_mpirun_self(2, "OMP_NUM_THREADS=1 TERA_TEST_PW_LAG_US=2000 ");
    tu_mpirun_self(4, "OMP_NUM_THREADS=1 TERA_TEST_PW_LAG_US=2000 ");
}

/* One process: the module on a one-rank world (ZeRO stages fall back to 0). */
static void test_one_rank(void **state) {
    (void)state;
    int argc = 1;
    char *argv0[] = {"test_zero", NULL};
    char **argv = argv0;
    assert_int_equal(tera_comm_init(&argc, &argv), TERA_OK);
    const tera_model_config cfg = tiny_cfg();
    reference R;
    ref_run(&R, &cfg, 1, 11, 3e-3f);
    snapshots snap = {{{0}}};
    run_case(&cfg, &R, 1, 0, &snap);
    run_case(&cfg, &R, 1, 1, &snap); /* in effect 0: bit-identical */
    for (int st = 0; st < NS; st++) free(snap.w[0][st]), free(snap.w[1][st]);
    ref_free(&R);
    tera_comm_finalize();
}

int main(int argc, char **argv) {
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE")) return mpi_main(argc, argv);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_one_rank), cmocka_unit_test(test_under_mpirun)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
