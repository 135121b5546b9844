/* 1-bit Adam and the per-rank communication state of checkpoints (src/train/onebit.h). */
/* paths are bounded by TERA_PATH_MAX; a truncated one fails to open and is reported */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include "onebit.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "tera/ckpt.h"
#include "tera/comm_hier.h"
#include "tera/compress.h"
#include "tera/io.h"
#include "tera/zero.h"

/* Fixed partition of each range for the loops (run on the model's backend: ops.for_ranges over the
 * chunks): the chunks' sums do not depend on the thread count. */
#define CHUNKS 64

struct tera_onebit {
    int frozen;            /* the variance is frozen: momentum exchanged in 1 bit, gradients not summed */
    int64_t t_freeze;      /* the optimizer's step count when it was frozen (v's bias correction) */
    int64_t warmup;        /* optimizer.onebit_warmup_steps */
    float *mom;            /* [n] the momentum of this rank's flat buffer: the same bits on every rank of a
                              region's group (ZeRO-0: tr->sharding->opt.m itself; ZeRO-1/2/3: own, the shards in opt.m) */
    float *own;            /* ZeRO-1/2/3: mom's allocation */
    float *g;              /* [n] this rank's own gradient after the freeze: the model's buffer (ZeRO-0/1), or
                              gown (ZeRO-2/3: bound to the model in place of the shards, tera_zero_local_grads) */
    float *gown;           /* ZeRO-2/3: g's allocation */
    int q[2];              /* the ranks sharing each region: dp (non-expert), edp (experts) */
    tera_creducer *cr[2];  /* their 1-bit all-reduces (NULL: one rank, nothing to exchange) */
};

/* the two regions: [0, n_dense) over dp, [n_dense, n) over edp */
static void region(const tera_trainer *tr, int x, int64_t *base, int64_t *len) {
    const int64_t nd = tr->model.n_dense_floats, n = tr->model.n_floats;
    *base = x ? nd : 0;
    *len = x ? n - nd : nd;
}

tera_status tera_onebit_init(tera_trainer *tr) {
    const tera_optim_config *oc = &tr->cfg.optimizer;
    if (strcmp(oc->name, "onebit_adam") != 0) return TERA_OK;
    if (oc->moments) return tera_fail(TERA_ERR_CONFIG, "optimizer.moments = bf16: not with optimizer.name = onebit_adam (its momentum exchange and frozen variance work on fp32 moments)");
    const int64_t nd = tr->model.n_dense_floats, n = tr->model.n_floats;
    tera_model_grads_sparse(&tr->model, 0); /* its momentum and sums read every gradient (model.h) */
    tera_onebit *ob = tera_calloc(1, sizeof *ob);
    ob->warmup = oc->onebit_warmup_steps;
    ob->q[0] = tr->topo.dp;
    ob->q[1] = tr->topo.edp;
    if (tr->sharding->stage) {
        ob->own = tera_calloc((size_t)n + 1, sizeof(float));
        ob->mom = ob->own;
    } else { /* the whole moments are one allocation, the expert region's a view into it */
        TERA_ASSERTF(tr->sharding->opt.lo == 0 && tr->sharding->opt_x.m == tr->sharding->opt.m + nd, "1-bit Adam: the moments of [0, %ld) are not "
                     "contiguous", (long)n);
        ob->mom = tr->sharding->opt.m;
    }
    /* ZeRO-2/3 hold no whole gradient; after the freeze the rank's own one is needed whole (its momentum
     * covers the whole region): allocated here, once */
    if (tr->sharding->stage >= 2) ob->gown = tera_calloc((size_t)n + 1, sizeof(float));
    ob->g = ob->gown ? ob->gown : tr->model.g;
    for (int x = 0; x < 2; x++) {
        int64_t base, len;
        region(tr, x, &base, &len);
        if (ob->q[x] > 1 && len > 0) {
            ob->cr[x] = tera_creducer_create(x ? tr->groups.edp : tr->groups.dp, TERA_COMPRESS_ONEBIT, len);
            tera_creducer_set_mean(ob->cr[x], 1);
        }
    }
    tr->onebit = ob;
    if (tr->root && tr->cfg.logging.progress) {
        /* what 1-bit Adam adds per rank: ZeRO-1/2/3's whole momentum, ZeRO-2/3's whole gradient, each
         * reducer's residuals (two of the region's size) and its message buffers (the region compressed,
         * p chunks received, one fp32 chunk) */
        double extra = (tr->sharding->stage ? 4.0 * (double)n : 0.0) + (ob->gown ? 4.0 * (double)n : 0.0);
        for (int x = 0; x < 2; x++) {
            int64_t base, len;
            region(tr, x, &base, &len);
            if (!ob->cr[x]) continue;
            const int64_t chunk = ((len + ob->q[x] - 1) / ob->q[x] + 15) & ~(int64_t)15;
            extra += 8.0 * (double)len + (double)tera_compress_bytes(TERA_COMPRESS_ONEBIT, len) +
                     (double)ob->q[x] * (double)tera_compress_bytes(TERA_COMPRESS_ONEBIT, chunk) + 4.0 * (double)chunk;
        }
        fprintf(stderr, "tera: optimizer 1-bit Adam: AdamW for %ld steps, then frozen variance and 1-bit momentum "
                "over dp %d / edp %d; memory per rank %.0f bytes more than AdamW's\n", (long)ob->warmup, ob->q[0],
                ob->q[1], extra);
    }
    return TERA_OK;
}

void tera_onebit_free(tera_trainer *tr) {
    tera_onebit *ob = tr->onebit;
    if (!ob) return;
    tera_creducer_free(ob->cr[0]);
    tera_creducer_free(ob->cr[1]);
    tera_zero_local_grads(tr->sharding, NULL);
    free(ob->own);
    free(ob->gown);
    free(ob);
    tr->onebit = NULL;
}

int tera_onebit_frozen(const tera_trainer *tr) { return tr->onebit && tr->onebit->frozen; }

/* The frozen state, and with it where ZeRO-2/3 put the gradients: the rank's own whole buffer once
 * frozen (nothing reduce-scattered), the shards before */
static void set_frozen(tera_trainer *tr, int frozen, int64_t t_freeze) {
    tera_onebit *ob = tr->onebit;
    ob->frozen = frozen;
    ob->t_freeze = t_freeze;
    tera_zero_local_grads(tr->sharding, frozen ? ob->gown : NULL);
}

/* ZeRO-1/2/3: every rank's whole momentum from the shards in opt.m / opt_x.m (at the freeze and after a
 * resume; one fp32 all-gather per region) */
static void gather_momentum(tera_trainer *tr) {
    tera_onebit *ob = tr->onebit;
    const int64_t nd = tr->model.n_dense_floats, n = tr->model.n_floats;
    if (!tr->sharding->stage) return;
    memcpy(ob->mom + tr->sharding->opt.lo, tr->sharding->opt.m, sizeof(float) * (size_t)tr->sharding->opt.n);
    tera_comm_allgather_f32(tr->groups.dp, ob->mom, tr->sharding->shard_counts);
    if (n > nd) {
        memcpy(ob->mom + tr->sharding->opt_x.lo, tr->sharding->opt_x.m, sizeof(float) * (size_t)tr->sharding->opt_x.n);
        tera_comm_allgather_f32(tr->groups.edp, ob->mom + nd, tr->sharding->shard_counts_x);
    }
}

static void freeze(tera_trainer *tr) {
    set_frozen(tr, 1, tr->sharding->opt.t);
    gather_momentum(tr);
}

double tera_onebit_grad_sq(tera_trainer *tr) {
    tera_model *m = &tr->model;
    const tera_onebit *ob = tr->onebit;
    double *sq = tr->sharding->grad_sq;
    tera_grad_sq_by_param_at(m, 0, m->n_floats, ob->g, sq);
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        /* mean over the q ranks of |q g_r|^2 = sum over them of q |g_r|^2; a copy replicated over tp
         * counts on tp rank 0 (but a non-finite one everywhere: the step is skipped on every rank) */
        const double v = sq[i] * (double)ob->q[p->offset >= m->n_dense_floats];
        sq[i] = p->tp_dim < 0 && tr->topo.tp_rank != 0 && isfinite(v) ? 0.0 : v;
    }
    if (tr->topo.world > 1) tera_comm_allreduce_f64(tera_comm_world(), sq, m->n_params);
    double tot = 0.0;
    for (int i = 0; i < m->n_params; i++) tot += sq[i];
    return tot;
}

/* whether this rank's sums of tensor p count toward the whole model's (as layout.c's counts_here) */
static int counts_here(const tera_trainer *tr, const tera_param *p) {
    if (p->tp_dim < 0 && tr->topo.tp_rank != 0) return 0;
    if (tr->sharding->stage) return 1;
    return p->expert_stacked ? tr->topo.edp_rank == 0 : tr->topo.dp_rank == 0;
}

/* Step 1's chunks: the rank's momentum from its own gradient, the gradient cleared */
typedef struct {
    float *mm, *g;
    float b1, gs;
    int64_t len, per;
} mom_ctx;

static void mom_chunks(void *ctx, int64_t lo, int64_t hi, int worker) {
    (void)worker;
    const mom_ctx *c = ctx;
    for (int64_t ch = lo; ch < hi; ch++) {
        const int64_t j0 = ch * c->per, j1 = j0 + c->per < c->len ? j0 + c->per : c->len;
        for (int64_t j = j0; j < j1; j++) {
            c->mm[j] = c->b1 * c->mm[j] + (1.0f - c->b1) * (c->g[j] * c->gs);
            c->g[j] = 0.0f;
        }
    }
}

/* Step 2's chunks: the update of one tensor's range with the frozen variance; each chunk's update and
 * parameter squares */
typedef struct {
    float *w;
    const float *mm, *vv;
    float decay, step_size, bc2_sqrt, eps;
    int64_t len, per;
    double *up, *pp; /* [CHUNKS] */
} upd_ctx;

static void upd_chunks(void *ctx, int64_t lo, int64_t hi, int worker) {
    (void)worker;
    const upd_ctx *c = ctx;
    for (int64_t ch = lo; ch < hi; ch++) {
        const int64_t j0 = ch * c->per, j1 = j0 + c->per < c->len ? j0 + c->per : c->len;
        float us = 0.0f, ps = 0.0f;
        for (int64_t j = j0; j < j1; j++) {
            const float w0 = c->w[j];
            float wj = w0 * c->decay;
            wj -= c->step_size * c->mm[j] / (sqrtf(c->vv[j]) / c->bc2_sqrt + c->eps);
            c->w[j] = wj;
            us += (wj - w0) * (wj - w0);
            ps += w0 * w0;
        }
        c->up[ch] = us;
        c->pp[ch] = ps;
    }
}

void tera_onebit_step(tera_trainer *tr, float lr, float grad_scale, double *sums) {
    tera_onebit *ob = tr->onebit;
    if (!ob->frozen) { /* warm-up: AdamW with fp32 gradient sums, then the freeze after the last one */
        tera_zero_adamw_step(tr->sharding, lr, grad_scale, &tr->cfg.optimizer, sums);
        if (tr->step + 1 >= ob->warmup) freeze(tr);
        return;
    }
    tera_model *m = &tr->model;
    const tera_optim_config *c = &tr->cfg.optimizer;
    const float b1 = c->beta1, b2 = c->beta2, eps = c->eps;
    tera_backend *be = m->be;
    /* 1. each rank's momentum from its own gradient estimate q g_r (the gradients cleared on the way),
     *    then its 1-bit mean over the region's ranks: the same bits on every one of them */
    for (int x = 0; x < 2; x++) {
        int64_t base, len;
        region(tr, x, &base, &len);
        if (len == 0) continue;
        mom_ctx mc = {.mm = ob->mom + base, .g = ob->g + base, .b1 = b1, .gs = grad_scale * (float)ob->q[x],
                      .len = len, .per = (len + CHUNKS - 1) / CHUNKS};
        be->ops.for_ranges(be, CHUNKS, mom_chunks, &mc);
        if (ob->cr[x]) tera_creducer_allreduce(ob->cr[x], mc.mm, 0, len);
    }
    /* 2. the update of this rank's optimizer ranges with the frozen variance */
    double *usq = tr->sharding->grad_sq + m->n_params * 2, *psq = usq + m->n_params; /* per tensor */
    memset(usq, 0, sizeof(double) * 2 * (size_t)m->n_params);
    const float bc2_sqrt = sqrtf(1.0f - powf(b2, (float)ob->t_freeze));
    tera_adamw *os[2] = {&tr->sharding->opt, &tr->sharding->opt_x};
    for (int x = 0; x < 2; x++) {
        tera_adamw *o = os[x];
        o->t++;
        const float step_size = lr / (1.0f - powf(b1, (float)o->t));
        for (int i = 0; i < m->n_params; i++) {
            const tera_param *p = &m->params[i];
            const int64_t a = p->offset > o->lo ? p->offset : o->lo;
            const int64_t b = p->offset + p->numel < o->hi ? p->offset + p->numel : o->hi;
            if (b <= a) continue;
            double up[CHUNKS], pp[CHUNKS];
            const int64_t len = b - a;
            upd_ctx uc = {.w = o->w ? o->w + (a - o->lo) : m->w + a, /* ZeRO-3: the shard's parameters */
                          .mm = ob->mom + a, .vv = o->v + (a - o->lo),
                          .decay = p->decay ? 1.0f - lr * c->weight_decay : 1.0f, .step_size = step_size,
                          .bc2_sqrt = bc2_sqrt, .eps = eps, .len = len, .per = (len + CHUNKS - 1) / CHUNKS,
                          .up = up, .pp = pp};
            be->ops.for_ranges(be, CHUNKS, upd_chunks, &uc);
            double ut = 0.0, pt = 0.0;
            for (int ch = 0; ch < CHUNKS; ch++) ut += up[ch], pt += pp[ch];
            usq[i] += ut, psq[i] += pt;
        }
        /* ZeRO-1/2/3: the shard's momentum where the checkpoint reads it (ZeRO-0: it is mom itself) */
        if (o->n > 0 && o->m != ob->mom + o->lo) memcpy(o->m, ob->mom + o->lo, sizeof(float) * (size_t)o->n);
    }
    /* ZeRO-1/2: every rank gets every shard's new parameters (fp32, as with AdamW); ZeRO-3: the layers
     * gathered before are stale */
    tera_zero_params_updated(tr->sharding);
    double s[2] = {0.0, 0.0};
    for (int i = 0; i < m->n_params; i++)
        if (counts_here(tr, &m->params[i])) s[0] += usq[i], s[1] += psq[i];
    if (tr->topo.world > 1) tera_comm_allreduce_f64(tera_comm_world(), s, 2);
    sums[0] = s[0];
    sums[1] = s[1];
}

/* ------------------------------------------------------------------ per-rank state in checkpoints */

enum { HDR_MAGIC, HDR_VERSION, HDR_STEP, HDR_WORLD, HDR_RANK, HDR_DP, HDR_TP, HDR_PP, HDR_EP, HDR_ZERO, HDR_N,
       HDR_ND, HDR_FROZEN, HDR_TFREEZE, HDR_NARR, HDR_LEN };
#define STATE_MAGIC 0x5449424531415254ll /* "TRA1EBIT" little-endian, any fixed value */
#define STATE_VERSION 1

/* The residual arrays of this rank: id = source * 4 + region * 2 + which (source 0: 1-bit Adam, 1:
 * grad_compression; which 0: this rank's side, 1: the owner's side). */
static float *state_array(tera_trainer *tr, int id, int64_t *n) {
    const int src = id / 4, x = id / 2 % 2, which = id % 2;
    *n = 0;
    if (src == 0) return tr->onebit && tr->onebit->cr[x] ? tera_creducer_state(tr->onebit->cr[x], which, n) : NULL;
    return tera_greducer_state(tr->sharding->gred[x], which, n);
}

static int state_on(tera_trainer *tr) {
    if (tr->onebit) return 1;
    int64_t n;
    return state_array(tr, 4, &n) || state_array(tr, 6, &n);
}

static void state_paths(const tera_trainer *tr, int64_t step, char *dir, size_t nd, char *file, size_t nf) {
    snprintf(dir, nd, "%s/checkpoints/comm_state/step_%08" PRId64, tr->run_dir, step);
    snprintf(file, nf, "%s/rank-%05d.bin", dir, tr->topo.rank);
}

static void fill_header(const tera_trainer *tr, int64_t *h) {
    memset(h, 0, sizeof(int64_t) * HDR_LEN);
    h[HDR_MAGIC] = STATE_MAGIC, h[HDR_VERSION] = STATE_VERSION, h[HDR_STEP] = tr->step;
    h[HDR_WORLD] = tr->topo.world, h[HDR_RANK] = tr->topo.rank, h[HDR_DP] = tr->topo.dp, h[HDR_TP] = tr->topo.tp;
    h[HDR_PP] = tr->topo.pp, h[HDR_EP] = tr->topo.ep, h[HDR_ZERO] = tr->sharding->stage, h[HDR_N] = tr->model.n_floats;
    h[HDR_ND] = tr->model.n_dense_floats;
    h[HDR_FROZEN] = tr->onebit ? tr->onebit->frozen : 0;
    h[HDR_TFREEZE] = tr->onebit ? tr->onebit->t_freeze : 0;
}

static tera_status write_all(int fd, const void *p, size_t n, const char *path) {
    const char *c = p;
    while (n > 0) {
        const ssize_t k = write(fd, c, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return tera_fail(TERA_ERR_IO, "cannot write '%s': %s", path, k < 0 ? strerror(errno) : "no space");
        c += k, n -= (size_t)k;
    }
    return TERA_OK;
}

/* this rank's file, written under a temporary name and renamed */
static tera_status save_local(tera_trainer *tr) {
    char dir[TERA_PATH_MAX + 96], path[TERA_PATH_MAX + 128], tmp[TERA_PATH_MAX + 140];
    state_paths(tr, tr->step, dir, sizeof dir, path, sizeof path);
    TERA_TRY(tera_mkdirs(dir));
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int64_t h[HDR_LEN];
    fill_header(tr, h);
    for (int id = 0; id < 8; id++) {
        int64_t n;
        if (state_array(tr, id, &n)) h[HDR_NARR]++;
    }
    XXH3_state_t *xs = XXH3_createState();
    XXH3_64bits_reset(xs);
    const int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        XXH3_freeState(xs);
        return tera_fail(TERA_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    }
    tera_status st = write_all(fd, h, sizeof h, tmp);
    XXH3_64bits_update(xs, h, sizeof h);
    for (int id = 0; id < 8 && st == TERA_OK; id++) {
        int64_t n;
        const float *a = state_array(tr, id, &n);
        if (!a) continue;
        const int64_t ah[2] = {id, n};
        st = write_all(fd, ah, sizeof ah, tmp);
        XXH3_64bits_update(xs, ah, sizeof ah);
        if (st == TERA_OK) st = write_all(fd, a, sizeof(float) * (size_t)n, tmp);
        XXH3_64bits_update(xs, a, sizeof(float) * (size_t)n);
    }
    const uint64_t hash = XXH3_64bits_digest(xs);
    XXH3_freeState(xs);
    if (st == TERA_OK) st = write_all(fd, &hash, sizeof hash, tmp);
    if (st == TERA_OK && fsync(fd) != 0) st = tera_fail(TERA_ERR_IO, "cannot fsync '%s': %s", tmp, strerror(errno));
    if (close(fd) != 0 && st == TERA_OK) st = tera_fail(TERA_ERR_IO, "cannot close '%s': %s", tmp, strerror(errno));
    if (st == TERA_OK && rename(tmp, path) != 0)
        st = tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
    if (st != TERA_OK) unlink(tmp);
    return st;
}

/* This rank's files of steps before the current one whose checkpoint is gone (retention) and not
 * being written: removed (with their directory once it is empty). A save in the background may not
 * have created even its step_N.tmp yet (its thread starts late on a busy machine), so a step counts as
 * gone only below the newest committed checkpoint: saves complete in step order, and retention only
 * removes checkpoints older than one it just committed. */
void tera_comm_state_prune(tera_trainer *tr) {
    if (!tr->run_dir[0] || !state_on(tr)) return;
    char root[TERA_PATH_MAX + 64], path[TERA_PATH_MAX + 160];
    snprintf(root, sizeof root, "%s/checkpoints", tr->run_dir);
    tera_ckpt_info *ck = NULL;
    int nck = 0;
    if (tera_ckpt_list(root, &ck, &nck) != TERA_OK) return; /* nothing removed: the files stay until a later save */
    int64_t newest = -1;
    for (int i = 0; i < nck; i++)
        if (ck[i].committed && ck[i].step > newest) newest = ck[i].step;
    free(ck);
    snprintf(root, sizeof root, "%s/checkpoints/comm_state", tr->run_dir);
    DIR *d = opendir(root);
    if (!d) return;
    const struct dirent *e;
    while ((e = readdir(d))) {
        long long s;
        int len = 0;
        if (sscanf(e->d_name, "step_%lld%n", &s, &len) != 1 || e->d_name[len] || s >= tr->step || s >= newest) continue;
        struct stat sb;
        snprintf(path, sizeof path, "%s/checkpoints/step_%08lld", tr->run_dir, s);
        if (stat(path, &sb) == 0) continue;
        snprintf(path, sizeof path, "%s/checkpoints/step_%08lld.tmp", tr->run_dir, s);
        if (stat(path, &sb) == 0) continue;
        snprintf(path, sizeof path, "%s/%s/rank-%05d.bin", root, e->d_name, tr->topo.rank);
        unlink(path);
        snprintf(path, sizeof path, "%s/%s", root, e->d_name);
        rmdir(path); /* fails while another rank's file is there: that rank removes it */
    }
    closedir(d);
}

tera_status tera_comm_state_save(tera_trainer *tr) {
    if (!tr->run_dir[0] || !state_on(tr)) return TERA_OK; /* the same on every rank */
    tera_status st = save_local(tr);
    if (tr->topo.world > 1) {
        int64_t failed = st != TERA_OK;
        tera_comm_allreduce_i64(tera_comm_world(), &failed, 1);
        if (failed && st == TERA_OK)
            st = tera_fail(TERA_ERR_IO, "checkpoint step %ld: writing another rank's communication state failed",
                           (long)tr->step);
    }
    return st;
}

/* Reads this rank's file into the live state when it is complete and from this layout; returns 0
 * (nothing changed) with a reason otherwise. */
static int load_local(tera_trainer *tr, char *why, size_t nwhy) {
    char dir[TERA_PATH_MAX + 96], path[TERA_PATH_MAX + 128];
    state_paths(tr, tr->step, dir, sizeof dir, path, sizeof path);
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(why, nwhy, "%s: %s", path, strerror(errno));
        return 0;
    }
    int ok = 0;
    int64_t h[HDR_LEN], want[HDR_LEN];
    fill_header(tr, want);
    XXH3_state_t *xs = XXH3_createState();
    XXH3_64bits_reset(xs);
    float *bufs[8] = {NULL};
    int64_t lens[8] = {0};
    if (fread(h, sizeof h, 1, f) != 1 || h[HDR_MAGIC] != STATE_MAGIC || h[HDR_VERSION] != STATE_VERSION) {
        snprintf(why, nwhy, "%s: not a communication-state file of this version", path);
        goto done;
    }
    XXH3_64bits_update(xs, h, sizeof h);
    for (int k = HDR_STEP; k <= HDR_ND; k++)
        if (h[k] != want[k]) {
            snprintf(why, nwhy, "%s: written at step %ld by rank %ld of %ld (dp %ld, tp %ld, pp %ld, ep %ld, ZeRO %ld, "
                     "%ld floats): another layout or step", path, (long)h[HDR_STEP], (long)h[HDR_RANK], (long)h[HDR_WORLD],
                     (long)h[HDR_DP], (long)h[HDR_TP], (long)h[HDR_PP], (long)h[HDR_EP], (long)h[HDR_ZERO], (long)h[HDR_N]);
            goto done;
        }
    for (int64_t a = 0; a < h[HDR_NARR]; a++) {
        int64_t ah[2], n;
        if (fread(ah, sizeof ah, 1, f) != 1 || ah[0] < 0 || ah[0] >= 8 || bufs[ah[0]] || !state_array(tr, (int)ah[0], &n) ||
            ah[1] != n) {
            snprintf(why, nwhy, "%s: its residual arrays do not match this run's (optimizer.name, "
                     "parallel.grad_compression or parallel.hierarchical changed?)", path);
            goto done;
        }
        XXH3_64bits_update(xs, ah, sizeof ah);
        bufs[ah[0]] = tera_malloc(sizeof(float) * (size_t)n + 4);
        lens[ah[0]] = n;
        if (fread(bufs[ah[0]], sizeof(float), (size_t)n, f) != (size_t)n) {
            snprintf(why, nwhy, "%s: truncated", path);
            goto done;
        }
        XXH3_64bits_update(xs, bufs[ah[0]], sizeof(float) * (size_t)n);
    }
    for (int id = 0; id < 8; id++) {
        int64_t n;
        if (state_array(tr, id, &n) && !bufs[id]) {
            snprintf(why, nwhy, "%s: lacks residual array %d of this run", path, id);
            goto done;
        }
    }
    uint64_t hash;
    if (fread(&hash, sizeof hash, 1, f) != 1 || hash != XXH3_64bits_digest(xs)) {
        snprintf(why, nwhy, "%s: checksum mismatch (damaged)", path);
        goto done;
    }
    ok = 1;
done:
    fclose(f);
    XXH3_freeState(xs);
    if (ok) {
        for (int id = 0; id < 8; id++) {
            int64_t n;
            float *a = state_array(tr, id, &n);
            if (a) memcpy(a, bufs[id], sizeof(float) * (size_t)lens[id]);
        }
        if (tr->onebit) set_frozen(tr, (int)h[HDR_FROZEN], h[HDR_TFREEZE]);
    }
    for (int id = 0; id < 8; id++) free(bufs[id]);
    return ok;
}

tera_status tera_comm_state_load(tera_trainer *tr) {
    if (!tr->run_dir[0] || !state_on(tr)) return TERA_OK;
    char why[TERA_PATH_MAX + 512] = "";
    int64_t missing = !load_local(tr, why, sizeof why);
    if (missing && tr->cfg.logging.progress)
        fprintf(stderr, "tera: rank %d: no usable communication state for step %ld: %s\n", tr->topo.rank,
                (long)tr->step, why);
    if (tr->topo.world > 1) tera_comm_allreduce_i64(tera_comm_world(), &missing, 1);
    if (missing) { /* on every rank alike: the residuals start at zero, 1-bit Adam's warm-up state holds */
        for (int id = 0; id < 8; id++) {
            int64_t n;
            float *a = state_array(tr, id, &n);
            if (a) memset(a, 0, sizeof(float) * (size_t)n);
        }
        if (tr->onebit) set_frozen(tr, 0, 0);
        if (tr->root)
            fprintf(stderr, "tera: warning: --resume at step %ld: %ld rank(s) have no communication state of this "
                    "checkpoint; error-feedback residuals start at zero%s: not bit-identical to an uninterrupted run\n",
                    (long)tr->step, (long)missing,
                    tr->onebit ? " and 1-bit Adam freezes the variance again after its next step" : "");
        return TERA_OK;
    }
    if (tr->onebit && tr->onebit->frozen) gather_momentum(tr); /* ZeRO-1/2/3: from the checkpoint's shards */
    return TERA_OK;
}
