/* Checkpoints of a training run: snapshot + (background) atomic write, differential saves,
 * retention, and exact resume. docs/CHECKPOINTS.md describes the layout and guarantees.
 *
 * RUN/checkpoints/step_NNNNNNNN/ holds
 *   full: config.json + model.safetensors (a Hugging Face directory, router bias included),
 *         optimizer.safetensors (Adam moments "exp_avg.i" / "exp_avg_sq.i" by parameter index),
 *   diff: diff.bin (changed 64 KiB chunks of the state since the base full checkpoint, zstd),
 *   both: state.json (step, Adam step count, seed, data position), config.ini (the resolved run
 *         configuration), manifest.json (format, model config, layout, tensors with global shape,
 *         file, byte range and slice, per-region and per-file checksums), COMMIT (written last).
 * Written under step_NNNNNNNN.tmp, every file fsynced, COMMIT last, renamed, parent fsynced. */
/* paths are bounded by TERA_PATH_MAX; a truncated one fails to open and is reported */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <xxhash.h>
#include <zstd.h>

#include "tera/ckpt.h"
#include "tera/hf.h"
#include "tera/io.h"
#include "tera/profile.h"
#include "tera/safetensors.h"
#include "tera/trace.h"
#include "tera/train.h"
#include "tera/zero.h"

/* ------------------------------------------------------------------ options */

static int env_int(const char *name, int dflt) {
    const char *e = getenv(name);
    return e && *e ? atoi(e) : dflt;
}

tera_ckpt_options tera_ckpt_options_from_config(const tera_config *c) {
    /* the config keys; the environment variables override them (tests and experiments) */
    tera_ckpt_options o = {.async = c->checkpoint.async != 0, .full_every = c->checkpoint.full_every};
    o.async = env_int("TERA_CKPT_ASYNC", o.async) != 0;
    o.full_every = env_int("TERA_CKPT_FULL_EVERY", o.full_every);
    if (o.full_every < 0) o.full_every = 0;
    return o;
}

/* ------------------------------------------------------------------ context */

struct tera_ckpt_ctx {
    tera_ckpt_options opt;
    tera_config cfg;                 /* copy: config.ini, max_shard_bytes, keep */
    char run_dir[TERA_PATH_MAX];
    tera_model shadow;               /* shallow copy of the model whose weights are the snapshot */
    tera_param *params;              /* own copy of the parameter table */
    float *snap;                     /* one allocation: the four regions */
    float *reg[TERA_CKPT_N_REGIONS];
    int64_t reg_n[TERA_CKPT_N_REGIONS];
    /* the snapshot's scalar state */
    int64_t step;
    char *state_json;
    int full;                        /* this save is full */
    /* background writer */
    pthread_t th;
    int running;
    tera_status st;
    char err[1024];
    /* differential base (chunk hashes of the last full save) */
    int has_base, since_full;
    int64_t base_step;
    uint64_t *base_hash[TERA_CKPT_N_REGIONS];
    int64_t n_chunks[TERA_CKPT_N_REGIONS];
    char *config_json;               /* the model's config.json text (from the last full save) */
    float *win;                      /* streamed saves (several ranks): the one transfer window */
    void *fin;                       /* a streamed save's background part (sfin) */
    int64_t win_n;
};

static tera_ckpt_stats g_stats;

/* Whether a save is full: the final one, the first, and every full_every-th (else differential). */
static int save_is_full(int final, int has_base, int full_every, int since_full) {
    return final || !has_base || full_every <= 1 || since_full + 1 >= full_every;
}

/* The step loop's pause of one save, into the statistics. */
static void record_pause(double pause, int full) {
    g_stats.saves++;
    g_stats.full_saves += full;
    g_stats.last_pause_s = pause;
    g_stats.total_pause_s += pause;
    if (pause > g_stats.max_pause_s) g_stats.max_pause_s = pause;
}

double tera_ckpt_last_pause_seconds(void) { return g_stats.last_pause_s; }
tera_ckpt_stats tera_ckpt_last_stats(void) { return g_stats; }

static tera_ckpt_ctx *ctx_create(const tera_trainer *tr) {
    tera_ckpt_ctx *c = tera_calloc(1, sizeof *c);
    c->opt = tera_ckpt_options_from_config(&tr->cfg);
    c->cfg = tr->cfg;
    snprintf(c->run_dir, sizeof c->run_dir, "%s", tr->run_dir);
    const tera_model *m = &tr->model;
    c->params = tera_malloc(sizeof(tera_param) * (size_t)m->n_params);
    memcpy(c->params, m->params, sizeof(tera_param) * (size_t)m->n_params);
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) c->reg_n[r] = tera_ckpt_region_floats(m, r);
    c->shadow = *m;
    c->shadow.params = c->params;
    c->shadow.g = NULL;
    return c; /* the regions are pointed at by each save (regions_at): the snapshot or the state itself */
}

/* The four regions the writer reads, from base[r] (read only: the writer never writes through
 * c->reg), and the shadow model's weights and router bias with them. */
static void regions_at(tera_ckpt_ctx *c, float *const base[TERA_CKPT_N_REGIONS]) {
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) c->reg[r] = c->reg_n[r] ? base[r] : NULL;
    c->shadow.w = c->reg[0];
    c->shadow.router_bias = c->reg[3];
}

/* The snapshot's one allocation (the four regions), made at the first save that needs it: a save in
 * the background, or one whose moments are bf16 (widened into it). */
static void snapshot_regions(tera_ckpt_ctx *c) {
    int64_t total = 0;
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) total += c->reg_n[r];
    if (!c->snap) c->snap = tera_calloc((size_t)total + 1, sizeof(float));
    float *base[TERA_CKPT_N_REGIONS], *p = c->snap;
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) {
        base[r] = p;
        p += c->reg_n[r];
    }
    regions_at(c, base);
}

static tera_status ctx_wait(tera_ckpt_ctx *c) {
    if (!c || !c->running) return TERA_OK;
    pthread_join(c->th, NULL);
    c->running = 0;
    if (c->st != TERA_OK) {
        tera_status s = c->st;
        c->st = TERA_OK;
        return tera_fail(s, "%s", c->err);
    }
    return TERA_OK;
}

static void ctx_free(tera_ckpt_ctx *c) {
    if (!c) return;
    free(c->params);
    free(c->snap);
    free(c->state_json);
    free(c->config_json);
    free(c->win);
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) free(c->base_hash[r]);
    free(c);
}

static tera_status shard_commit(tera_trainer *tr);
static void shard_free(tera_trainer *tr);

tera_status tera_trainer_ckpt_close(tera_trainer *tr) {
    tera_status s = ctx_wait(tr->ckpt.whole);
    ctx_free(tr->ckpt.whole);
    tr->ckpt.whole = NULL;
    if (tr->ckpt.shard) { /* sharded: commit the open save (collective), then free */
        tera_status s2 = shard_commit(tr);
        if (s == TERA_OK) s = s2;
        shard_free(tr);
    }
    return s;
}

/* ------------------------------------------------------------------ state.json */

static char *state_text(const tera_trainer *tr) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddNumberToObject(root, "format_version", TERA_CKPT_FORMAT_VERSION);
    cJSON_AddNumberToObject(root, "step", (double)tr->step);
    cJSON_AddNumberToObject(root, "adam_t", (double)tr->sharding->opt.t);
    cJSON_AddNumberToObject(root, "seed", (double)tr->cfg.training.seed);
    cJSON_AddNumberToObject(root, "skipped_steps", (double)tr->skipped_steps);
    if (tr->prec.precision == TERA_PREC_FP16) tera_scaler_save(&tr->prec.scaler, root); /* restored exactly on resume */
    /* the data position, serialised by the data module (src/data/data_state.c) */
    tera_data_save(&tr->loader, tr->cfg.data.path, tr->samples_consumed, root);
    /* the dynamic batch size and the loss-spike guard, each serialised by its owner: what a resumed
     * run needs to take the same batch sizes, skip the same data windows, keep the LR cut and judge
     * spikes against the same window */
    tera_batch_save(&tr->cfg.training, &tr->batch, tr->step, tr->topo.dp, root);
    tera_spike_save(&tr->spike, root);
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    return text;
}

/* Reads state.json and checks that the current data is the stream the checkpoint was reading.
 * Every count must be one a run could have written (a whole number in range: the step the
 * checkpoint's directory names, 0 <= adam_t, skipped_steps <= step), or the resume is refused
 * naming the key: a hand-edited or damaged file must not start an endless or NaN run. dir_step:
 * the step of the directory's name (step_N), -1 when it has another name. */
static tera_status read_state(tera_trainer *tr, const char *path, int64_t dir_step) {
    char *text;
    TERA_TRY(tera_read_text_file(path, &text));
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root) return tera_fail(TERA_ERR_FORMAT, "%s: not valid JSON", path);
    int64_t step = 0, adam_t = 0, skipped = 0, version;
    tera_status st = TERA_OK;
    if (cJSON_GetObjectItemCaseSensitive(root, "format_version")) /* a later format: refused, not misread */
        st = tera_json_whole(root, "format_version", path, "", 1, TERA_CKPT_FORMAT_VERSION, &version);
    if (st == TERA_OK) st = tera_json_whole(root, "step", path, "", 0, TERA_JSON_MAX_WHOLE, &step);
    if (st == TERA_OK && dir_step >= 0 && step != dir_step)
        st = tera_fail(TERA_ERR_FORMAT, "%s: \"step\" = %" PRId64 ", but the checkpoint is step %" PRId64
                       " (its directory and COMMIT)", path, step, dir_step);
    if (st == TERA_OK) st = tera_json_whole(root, "adam_t", path, "", 0, step, &adam_t);
    if (st == TERA_OK && cJSON_GetObjectItemCaseSensitive(root, "skipped_steps"))
        st = tera_json_whole(root, "skipped_steps", path, "", 0, step, &skipped);
    /* the seed: any uint64 (written as a double, so compared as one) */
    const cJSON *sd = cJSON_GetObjectItemCaseSensitive(root, "seed");
    uint64_t seed = 0;
    if (st == TERA_OK) {
        const double v = cJSON_IsNumber(sd) ? sd->valuedouble : -1;
        if (!(v >= 0 && v < 18446744073709551616.0) || v != floor(v))
            st = tera_fail(TERA_ERR_FORMAT, "%s: \"seed\" is missing or not a whole number in [0, 2^64)", path);
        else
            seed = (double)tr->cfg.training.seed == v ? tr->cfg.training.seed : (uint64_t)v;
    }
    /* fp16: the scaler's state when the checkpoint has one (else the configured initial scale) */
    tera_loss_scaler scaler = tr->prec.scaler;
    if (st == TERA_OK && tr->prec.precision == TERA_PREC_FP16) st = tera_scaler_load(&scaler, root, path);
    /* the data position, read and checked by the data module (src/data/data_state.c: the same data, and a
     * streamed source restarted at this rank's position), after every other part could be read */
    if (st == TERA_OK) st = tera_batch_load(&tr->batch, root, path);
    if (st == TERA_OK) st = tera_spike_load(&tr->spike, root, path);
    int64_t consumed = 0;
    if (st == TERA_OK) st = tera_data_load(&tr->loader, root, path, seed, (uint64_t)tr->cfg.training.seed, &consumed);
    cJSON_Delete(root);
    TERA_TRY(st);
    tr->step = step;
    tr->sharding->opt.t = adam_t;
    tr->samples_consumed = consumed;
    tr->skipped_steps = skipped;
    tr->prec.scaler = scaler;
    return TERA_OK;
}

/* ------------------------------------------------------------------ the writer */

typedef struct {
    int n, cap;
    char *buf;
} strbuf;

static void sb_put(strbuf *b, const void *p, size_t n) {
    if ((size_t)b->n + n + 1 > (size_t)b->cap) {
        size_t cap = ((size_t)b->cap + n) * 2 + 256;
        b->buf = tera_realloc(b->buf, cap);
        b->cap = (int)cap;
    }
    memcpy(b->buf + b->n, p, n);
    b->n += (int)n;
    b->buf[b->n] = 0;
}

/* Regular files of dir, sorted (except COMMIT). */
static int list_files(const char *dir, char names[][128], int cap) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < cap;) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, "COMMIT") || strlen(e->d_name) >= 128) continue;
        snprintf(names[n++], 128, "%s", e->d_name);
    }
    closedir(d);
    for (int i = 1; i < n; i++) /* insertion sort: few files */
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char t[128];
            memcpy(t, names[j], 128);
            memcpy(names[j], names[j - 1], 128);
            memcpy(names[j - 1], t, 128);
        }
    return n;
}

static void hex64(char *out, uint64_t h) { snprintf(out, 17, "%016" PRIx64, h); }

static cJSON *int_array(int n, const int64_t *v) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((double)v[i]));
    return a;
}

static void add_tensor(cJSON *arr, const char *name, const tera_param *p, const char *file, uint64_t b, uint64_t e,
                       int expert) {
    cJSON *t = cJSON_CreateObject();
    cJSON_AddStringToObject(t, "name", name);
    cJSON_AddStringToObject(t, "global_name", p->name);
    cJSON_AddItemToObject(t, "global_shape", int_array(p->ndim, p->shape));
    cJSON_AddStringToObject(t, "dtype", "F32");
    cJSON_AddStringToObject(t, "file", file);
    int64_t br[2] = {(int64_t)b, (int64_t)e};
    cJSON_AddItemToObject(t, "byte_range", int_array(2, br));
    cJSON *sl = cJSON_CreateArray();
    for (int d = 0; d < p->ndim; d++) {
        int64_t r[2] = {0, p->shape[d]};
        if (d == 0 && expert >= 0) r[0] = expert, r[1] = expert + 1;
        cJSON_AddItemToArray(sl, int_array(2, r));
    }
    cJSON_AddItemToObject(t, "slice", sl);
    cJSON_AddNumberToObject(t, "rank", 0);
    cJSON_AddItemToArray(arr, t);
}

static void expert_name(char *out, size_t cap, const char *pattern, int e) {
    const char *p = strstr(pattern, "%d");
    if (!p) {
        snprintf(out, cap, "%s", pattern);
        return;
    }
    snprintf(out, cap, "%.*s%d%s", (int)(p - pattern), pattern, e, p + 2);
}

/* tensors[] of a full checkpoint: where each tensor (or expert slice) lies in its file. */
static tera_status manifest_tensors(const tera_ckpt_ctx *c, const char *dir, cJSON *arr) {
    tera_st_set set;
    TERA_TRY(tera_st_set_open(&set, dir));
    char path[TERA_PATH_MAX + 128], name[192];
    tera_status s = TERA_OK;
    for (int i = 0; i < c->shadow.n_params && s == TERA_OK; i++) {
        const tera_param *p = &c->params[i];
        const int ne = p->expert_stacked ? (int)p->shape[0] : 1;
        for (int e = 0; e < ne; e++) {
            if (p->expert_stacked) expert_name(name, sizeof name, p->name, e);
            else snprintf(name, sizeof name, "%s", p->name);
            const tera_st_file *f = tera_st_set_find(&set, name);
            const tera_st_tensor *t = f ? tera_st_find(f, name) : NULL;
            if (!t) {
                s = tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s' missing after writing", dir, name);
                break;
            }
            const uint64_t base = (uint64_t)(f->data - (const uint8_t *)f->map);
            const char *fn = strrchr(f->path, '/');
            add_tensor(arr, name, p, fn ? fn + 1 : f->path, base + t->begin, base + t->end,
                       p->expert_stacked ? e : -1);
        }
    }
    tera_st_set_close(&set);
    if (s != TERA_OK) return s;
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    tera_st_file f;
    TERA_TRY(tera_st_open(&f, path));
    const uint64_t base = (uint64_t)(f.data - (const uint8_t *)f.map);
    for (int i = 0; i < c->shadow.n_params && s == TERA_OK; i++) {
        for (int k = 0; k < 2; k++) {
            snprintf(name, sizeof name, k ? "exp_avg_sq.%d" : "exp_avg.%d", i);
            const tera_st_tensor *t = tera_st_find(&f, name);
            if (!t) {
                s = tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s' missing after writing", path, name);
                break;
            }
            add_tensor(arr, name, &c->params[i], "optimizer.safetensors", base + t->begin, base + t->end, -1);
        }
    }
    tera_st_close(&f);
    return s;
}

/* Differential payload: changed chunks of every region against the base hashes. With full = 1,
 * records the hashes as the new base instead. */
static tera_status chunk_pass(tera_ckpt_ctx *c, int full, strbuf *out, int64_t *changed, int64_t *total) {
    ZSTD_CCtx *z = full ? NULL : ZSTD_createCCtx();
    const size_t CH = TERA_CKPT_CHUNK_BYTES;
    size_t bound = ZSTD_compressBound(CH);
    uint8_t *tmp = full ? NULL : tera_malloc(bound);
    uint32_t nrec = 0;
    if (!full) {
        sb_put(out, "TERADIF1", 8);
        sb_put(out, &nrec, 4);
    }
    *changed = *total = 0;
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) {
        const size_t bytes = sizeof(float) * (size_t)c->reg_n[r];
        const int64_t nc = (int64_t)((bytes + CH - 1) / CH);
        if (full) {
            free(c->base_hash[r]);
            c->base_hash[r] = tera_malloc(sizeof(uint64_t) * (size_t)(nc + 1));
            c->n_chunks[r] = nc;
        }
        const uint8_t *p = (const uint8_t *)c->reg[r];
        for (int64_t k = 0; k < nc; k++) {
            const size_t off = (size_t)k * CH, len = bytes - off < CH ? bytes - off : CH;
            const uint64_t h = XXH3_64bits(p + off, len);
            (*total)++;
            if (full) {
                c->base_hash[r][k] = h;
                continue;
            }
            if (h == c->base_hash[r][k]) continue;
            size_t cs = ZSTD_compressCCtx(z, tmp, bound, p + off, len, 1);
            TERA_ASSERT(!ZSTD_isError(cs));
            uint32_t rr = (uint32_t)r, raw = (uint32_t)len, cc = (uint32_t)cs;
            uint64_t o = off;
            sb_put(out, &rr, 4);
            sb_put(out, &raw, 4);
            sb_put(out, &o, 8);
            sb_put(out, &cc, 4);
            sb_put(out, tmp, cs);
            nrec++;
            (*changed)++;
        }
    }
    if (!full) memcpy(out->buf + 8, &nrec, 4);
    ZSTD_freeCCtx(z);
    free(tmp);
    return TERA_OK;
}

static tera_status prune(tera_ckpt_ctx *c);

/* Removes leftovers of interrupted saves: *.tmp and step directories without a valid COMMIT. */
static tera_status clean_uncommitted(const char *root) { return tera_ckpt_remove_listed(root, 1); }

/* The end of every save: the data files' checksums into the manifest, manifest.json, then COMMIT
 * (step, and size + XXH3 of every other file) last, the directory renamed into place and the
 * parent fsynced. Takes ownership of man. *bytes: the checkpoint's size. */
/* A file whose size and XXH3 its writer computed (sharded checkpoints: each rank hashes its own
 * file, so the committing rank does not read the others). */
typedef struct {
    char name[64];
    int64_t size;
    uint64_t hash;
} known_file;

static const known_file *find_known(const known_file *k, int nk, const char *name) {
    for (int i = 0; i < nk; i++)
        if (!strcmp(k[i].name, name)) return &k[i];
    return NULL;
}

/* Size and XXH3 of tmp/name: from its writer when known, else read. */
static tera_status file_sum(const char *tmp, const char *name, const known_file *k, int nk, uint64_t *h, int64_t *sz) {
    const known_file *f = find_known(k, nk, name);
    if (f) {
        *h = f->hash, *sz = f->size;
        return TERA_OK;
    }
    char path[TERA_PATH_MAX + 256];
    snprintf(path, sizeof path, "%s/%s", tmp, name);
    return tera_ckpt_hash_file(path, h, sz);
}

static tera_status commit_dir_known(cJSON *man, const char *tmp, const char *dir, const char *root, int64_t step,
                                    int64_t *bytes_out, const known_file *known, int n_known);

static tera_status commit_dir(cJSON *man, const char *tmp, const char *dir, const char *root, int64_t step,
                              int64_t *bytes_out) {
    return commit_dir_known(man, tmp, dir, root, step, bytes_out, NULL, 0);
}

static tera_status commit_dir_known(cJSON *man, const char *tmp, const char *dir, const char *root, int64_t step,
                                    int64_t *bytes_out, const known_file *known, int n_known) {
    char path[TERA_PATH_MAX + 256], hx[20];
    tera_status s = TERA_OK;
    /* checksums of the data files (everything but manifest.json and COMMIT) */
    static char names[1024][128]; /* one save at a time (the committing thread) */
    int nf = list_files(tmp, names, 1024);
    cJSON *files = cJSON_AddObjectToObject(man, "files");
    for (int i = 0; i < nf && s == TERA_OK; i++) {
        uint64_t h;
        int64_t sz;
        s = file_sum(tmp, names[i], known, n_known, &h, &sz);
        cJSON *o = cJSON_AddObjectToObject(files, names[i]);
        cJSON_AddNumberToObject(o, "bytes", (double)sz);
        hex64(hx, h);
        cJSON_AddStringToObject(o, "xxh3", hx);
    }
    char *mtext = s == TERA_OK ? cJSON_Print(man) : NULL;
    cJSON_Delete(man);
    if (s != TERA_OK) return s;
    snprintf(path, sizeof path, "%s/manifest.json", tmp);
    s = tera_ckpt_write_file(path, mtext, strlen(mtext));
    free(mtext);
    if (s != TERA_OK) return s;
    /* COMMIT: last, after every other file is durable */
    strbuf cm = {0};
    char line[512];
    snprintf(line, sizeof line, "tera-checkpoint-commit 1\nstep %" PRId64 "\n", step);
    sb_put(&cm, line, strlen(line));
    nf = list_files(tmp, names, 1024);
    int64_t bytes = 0;
    for (int i = 0; i < nf && s == TERA_OK; i++) {
        uint64_t h;
        int64_t sz;
        s = file_sum(tmp, names[i], known, n_known, &h, &sz);
        bytes += sz;
        snprintf(line, sizeof line, "file %s %" PRId64 " %016" PRIx64 "\n", names[i], sz, h);
        sb_put(&cm, line, strlen(line));
    }
    sb_put(&cm, "end\n", 4);
    snprintf(path, sizeof path, "%s/COMMIT", tmp);
    if (s == TERA_OK) s = tera_ckpt_write_file(path, cm.buf, (size_t)cm.n);
    free(cm.buf);
    if (s == TERA_OK) s = tera_ckpt_fsync_path(tmp);
    if (s != TERA_OK) return s;
    struct stat sb;
    if (stat(dir, &sb) == 0) TERA_TRY(tera_ckpt_remove(dir)); /* a damaged checkpoint of this step */
    tera_ckpt_io_point("rename", tmp);
    if (rename(tmp, dir) != 0)
        return tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, dir, strerror(errno));
    TERA_TRY(tera_ckpt_fsync_path(root));
    *bytes_out = bytes;
    return TERA_OK;
}

static tera_status finish_checkpoint(tera_ckpt_ctx *c, cJSON *man, const char *tmp, const char *dir, const char *root,
                                     const uint64_t *rhash, int64_t changed, int64_t total, double t0);

static tera_status write_checkpoint(tera_ckpt_ctx *c) {
    char root[TERA_PATH_MAX + 32], dir[TERA_PATH_MAX + 64], tmp[TERA_PATH_MAX + 96], path[TERA_PATH_MAX + 256];
    snprintf(root, sizeof root, "%s/checkpoints", c->run_dir);
    snprintf(dir, sizeof dir, "%s/step_%08" PRId64, root, c->step);
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    const double t0 = tera_now();
    tera_ckpt_io_point("mkdir", root);
    TERA_TRY(tera_mkdirs(root));
    TERA_TRY(clean_uncommitted(root));
    tera_ckpt_io_point("mkdir", tmp);
    TERA_TRY(tera_mkdirs(tmp));

    cJSON *man = cJSON_CreateObject();
    cJSON_AddStringToObject(man, "format", "tera-checkpoint");
    cJSON_AddNumberToObject(man, "format_version", TERA_CKPT_FORMAT_VERSION);
    cJSON_AddNumberToObject(man, "step", (double)c->step);
    cJSON_AddStringToObject(man, "kind", c->full ? "full" : "diff");
    tera_status s = TERA_OK;
    int64_t changed = 0, total = 0;
    if (c->full) {
        tera_ckpt_io_point("write", tmp); /* model.safetensors + config.json */
        s = tera_hf_export(&c->shadow, tmp, c->cfg.checkpoint.max_shard_bytes, 1);
        if (s == TERA_OK) {
            tera_st_writer w;
            tera_st_writer_init(&w);
            char nm[64];
            for (int i = 0; i < c->shadow.n_params; i++) {
                const tera_param *p = &c->params[i];
                snprintf(nm, sizeof nm, "exp_avg.%d", i);
                tera_st_writer_add(&w, nm, TERA_DT_F32, p->ndim, p->shape, c->reg[1] + p->offset);
                snprintf(nm, sizeof nm, "exp_avg_sq.%d", i);
                tera_st_writer_add(&w, nm, TERA_DT_F32, p->ndim, p->shape, c->reg[2] + p->offset);
            }
            snprintf(path, sizeof path, "%s/optimizer.safetensors", tmp);
            tera_ckpt_io_point("write", path);
            s = tera_st_writer_save(&w, path);
            tera_st_writer_free(&w);
        }
        if (s == TERA_OK) {
            free(c->config_json);
            snprintf(path, sizeof path, "%s/config.json", tmp);
            s = tera_read_text_file(path, &c->config_json);
        }
        cJSON *tensors = cJSON_AddArrayToObject(man, "tensors");
        if (s == TERA_OK) s = manifest_tensors(c, tmp, tensors);
        if (s == TERA_OK) {
            strbuf none = {0};
            s = chunk_pass(c, 1, &none, &changed, &total);
            c->has_base = 1;
            c->since_full = 0;
            c->base_step = c->step;
        }
    } else {
        cJSON_AddNumberToObject(man, "base_step", (double)c->base_step);
        char bn[64];
        snprintf(bn, sizeof bn, "step_%08" PRId64, c->base_step);
        cJSON_AddStringToObject(man, "base", bn);
        strbuf b = {0};
        s = chunk_pass(c, 0, &b, &changed, &total);
        snprintf(path, sizeof path, "%s/diff.bin", tmp);
        if (s == TERA_OK) s = tera_ckpt_write_file(path, b.buf, (size_t)b.n);
        free(b.buf);
        cJSON *ch = cJSON_AddObjectToObject(man, "chunks");
        cJSON_AddNumberToObject(ch, "chunk_bytes", TERA_CKPT_CHUNK_BYTES);
        cJSON_AddNumberToObject(ch, "total", (double)total);
        cJSON_AddNumberToObject(ch, "changed", (double)changed);
        cJSON_AddStringToObject(ch, "compression", "zstd-1");
        c->since_full++;
    }
    if (s != TERA_OK) {
        cJSON_Delete(man);
        return s;
    }
    uint64_t rhash[TERA_CKPT_N_REGIONS];
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) rhash[r] = tera_ckpt_region_hash(&c->shadow, r, c->reg[r]);
    return finish_checkpoint(c, man, tmp, dir, root, rhash, changed, total, t0);
}

static void *writer_main(void *arg) {
    tera_ckpt_ctx *c = arg;
    const double t0 = tera_now();
    c->st = write_checkpoint(c);
    tera_trace_event(TERA_TRACE_CKPT, "checkpoint write", "checkpoint", t0, tera_now(), -1); /* the timeline */
    if (c->st != TERA_OK) snprintf(c->err, sizeof c->err, "checkpoint step %" PRId64 ": %s", c->step, tera_last_error());
    return NULL;
}

/* Retention: the newest checkpoint.keep committed checkpoints (0 = all), every checkpoint whose
 * step is a multiple of checkpoint.keep_every (0 = none), plus the full checkpoints that kept
 * differential ones (or the next one) build on. */
static tera_status prune(tera_ckpt_ctx *c) {
    const int keep = c->cfg.checkpoint.keep, keep_every = c->cfg.checkpoint.keep_every;
    if (keep <= 0) return TERA_OK;
    char root[TERA_PATH_MAX + 32], path[TERA_PATH_MAX + 128];
    snprintf(root, sizeof root, "%s/checkpoints", c->run_dir);
    tera_ckpt_info *v;
    int n;
    TERA_TRY(tera_ckpt_list(root, &v, &n));
    int *keepme = tera_calloc((size_t)n + 1, sizeof(int));
    int kept = 0;
    for (int i = n - 1; i >= 0; i--) {
        if (!v[i].committed) continue;
        const int milestone = keep_every > 0 && v[i].step % keep_every == 0;
        if (kept >= keep && !milestone) continue;
        keepme[i] = 1;
        if (!milestone || kept < keep) kept++;
        for (int j = 0; j < n; j++)
            if (v[j].committed && !v[i].full && v[j].step == v[i].base_step) keepme[j] = 1;
    }
    for (int j = 0; j < n; j++)
        if (c->has_base && v[j].step == c->base_step) keepme[j] = 1;
    tera_status s = TERA_OK;
    for (int i = 0; i < n && s == TERA_OK; i++) {
        if (!v[i].committed || keepme[i]) continue;
        snprintf(path, sizeof path, "%s/%s", root, v[i].name);
        s = tera_ckpt_remove(path); /* renamed away first: never half removed under its name */
    }
    free(keepme);
    free(v);
    return s;
}

/* Copies the training state into the snapshot buffers (the pause the step loop sees), on the
 * model's backend threads: one contiguous range of each region per thread. */
typedef struct {
    float *dst;
    const float *src;
    const uint16_t *src16; /* src NULL: bf16 moments (optimizer.moments), widened (exact) */
} snap_copy;

static void snapshot_range(void *arg, int64_t lo, int64_t hi, int worker) {
    (void)worker;
    const snap_copy *k = arg;
    if (k->src) memcpy(k->dst + lo, k->src + lo, sizeof(float) * (size_t)(hi - lo));
    else
        for (int64_t i = lo; i < hi; i++) k->dst[i] = tera_bf16_widen(k->src16[i]);
}

/* The save's scalar state (step, state.json's text). */
static void snapshot_scalars(tera_ckpt_ctx *c, const tera_trainer *tr) {
    c->step = tr->step;
    free(c->state_json);
    c->state_json = state_text(tr);
}

static void snapshot(tera_ckpt_ctx *c, const tera_trainer *tr, const float *const src[TERA_CKPT_N_REGIONS]) {
    snapshot_regions(c);
    tera_backend *be = tr->model.be;
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) {
        const int64_t n = c->reg_n[r];
        if (!n) continue;
        snap_copy k = {.dst = c->reg[r], .src = src[r], .src16 = r == 1 ? tr->sharding->opt.mh : tr->sharding->opt.vh};
        TERA_ASSERTF(k.src || ((r == 1 || r == 2) && k.src16), "checkpoint snapshot: region %d has no storage", r);
        if (be) be->ops.for_ranges(be, n, snapshot_range, &k);
        else snapshot_range(&k, 0, n, 0);
    }
    snapshot_scalars(c, tr);
}


/* The end of a whole save whose data files are written: state.json, config.ini, the manifest
 * (model config, layout, region checksums), COMMIT, retention, statistics. Takes man. */
static tera_status finish_checkpoint(tera_ckpt_ctx *c, cJSON *man, const char *tmp, const char *dir, const char *root,
                                     const uint64_t *rhash, int64_t changed, int64_t total, double t0) {
    char path[TERA_PATH_MAX + 256];
    snprintf(path, sizeof path, "%s/state.json", tmp);
    tera_status s = tera_ckpt_write_file(path, c->state_json, strlen(c->state_json));
    if (s == TERA_OK) {
        snprintf(path, sizeof path, "%s/config.ini", tmp);
        tera_ckpt_io_point("write", path);
        s = tera_config_write(&c->cfg, path);
        if (s == TERA_OK) s = tera_ckpt_fsync_path(path);
    }
    if (s != TERA_OK) {
        cJSON_Delete(man);
        return s;
    }
    cJSON *mc = c->config_json ? cJSON_Parse(c->config_json) : NULL;
    cJSON_AddItemToObject(man, "model_config", mc ? mc : cJSON_CreateNull());
    cJSON_AddStringToObject(man, "run_config", "config.ini");
    cJSON *lay = cJSON_AddObjectToObject(man, "layout");
    cJSON_AddNumberToObject(lay, "world_size", 1);
    cJSON_AddNumberToObject(lay, "dp", c->cfg.parallel.dp);
    cJSON_AddNumberToObject(lay, "tp", c->cfg.parallel.tp);
    cJSON_AddNumberToObject(lay, "pp", c->cfg.parallel.pp);
    cJSON_AddNumberToObject(lay, "ep", c->cfg.parallel.ep);
    cJSON_AddNumberToObject(lay, "zero", c->cfg.parallel.zero);
    cJSON *regs = cJSON_AddObjectToObject(man, "regions");
    char hx[20];
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) {
        cJSON *o = cJSON_AddObjectToObject(regs, tera_ckpt_region_names[r]);
        cJSON_AddNumberToObject(o, "floats", (double)c->reg_n[r]);
        hex64(hx, rhash[r]);
        cJSON_AddStringToObject(o, "xxh3", hx);
    }
    int64_t bytes = 0;
    TERA_TRY(commit_dir(man, tmp, dir, root, c->step, &bytes));
    g_stats.last_write_s = tera_now() - t0;
    g_stats.last_bytes = bytes;
    g_stats.last_full = c->full;
    g_stats.last_chunks_changed = changed;
    g_stats.last_chunks_total = total;
    return prune(c);
}

/* ------------------------------------------------------------------ streamed saves (several ranks)
 * No rank holds the whole model. A whole checkpoint: the ranks walk the parameters of the
 * one-process table in table order, each in windows of at most checkpoint.writer_buffer_mb;
 * every window is assembled from the ranks holding its blocks and shards
 * (tera_zero_gather_window) and world rank 0 puts it at its place in the safetensors files
 * (laid out up front, tera_st_stream_*), into the region checksums, and into the 64 KiB chunks
 * of the differential scheme. A sharded checkpoint: each writing rank walks its own blocks, each
 * window gathered over the ranks sharing its ZeRO shards. The files are byte for byte those of
 * the snapshot writer. These saves are synchronous (the windows travel between ranks). */

static int64_t window_floats(const tera_config *c) {
    const int64_t mb = c->checkpoint.writer_buffer_mb > 0 ? c->checkpoint.writer_buffer_mb : 16;
    const int64_t chunk = TERA_CKPT_CHUNK_BYTES / (int64_t)sizeof(float);
    int64_t w = ((mb << 20) / (int64_t)sizeof(float)) / chunk * chunk;
    return w < chunk ? chunk : w;
}

int64_t tera_ckpt_snapshot_bytes(const tera_config *c, int64_t n_floats) {
    const tera_ckpt_options o = tera_ckpt_options_from_config(c);
    const int background = o.async && (c->checkpoint.every > 0 || c->checkpoint.every_s > 0 || c->checkpoint.full_every_s > 0);
    if (!background && !c->optimizer.moments) return 0;
    return (int64_t)sizeof(float) * (3 * n_floats + (int64_t)c->model.n_layers * c->model.n_experts);
}

int tera_ckpt_save_is_whole(const tera_config *c, const tera_topology *t) {
    return t->world == 1 || (!c->checkpoint.sharded && t->tp == 1 && t->pp == 1 && t->ep == 1 &&
                             !tera_zero_stage_in_effect(t, c->parallel.zero));
}

int64_t tera_ckpt_writer_buffer_bytes(const tera_config *c) { return (int64_t)sizeof(float) * (window_floats(c) + 2); }

/* A differential file written as records arrive: "TERADIF1", the record count (patched at the
 * end), then the records. */
typedef struct {
    int fd;
    uint32_t nrec;
    char path[TERA_PATH_MAX + 256];
    int err;
} dsink;

static tera_status dsink_open(dsink *d, const char *path, int counted) {
    memset(d, 0, sizeof *d);
    snprintf(d->path, sizeof d->path, "%s", path);
    if (counted) tera_ckpt_io_point("open", path);
    d->fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (d->fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    if (counted && write(d->fd, "TERADIF1\0\0\0\0", 12) != 12) d->err = errno ? errno : EIO;
    return TERA_OK;
}

static void dsink_put(dsink *d, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n > 0 && !d->err) {
        const ssize_t k = write(d->fd, b, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) d->err = errno ? errno : EIO;
        else b += k, n -= (size_t)k;
    }
}

/* Moves the records of tmp (a scratch sink) to the end of d; tmp is emptied. */
static void dsink_append(dsink *d, dsink *tmp, uint8_t *buf, size_t cap) {
    if (tmp->err) d->err = tmp->err;
    off_t at = 0;
    for (;;) {
        const ssize_t k = pread(tmp->fd, buf, cap, at);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) d->err = errno;
        if (k <= 0) break;
        dsink_put(d, buf, (size_t)k);
        at += k;
    }
    if (ftruncate(tmp->fd, 0) != 0 || lseek(tmp->fd, 0, SEEK_SET) != 0) d->err = errno ? errno : EIO;
    d->nrec += tmp->nrec;
    tmp->nrec = 0;
}

static tera_status dsink_close(dsink *d) {
    if (!d->err && pwrite(d->fd, &d->nrec, 4, 8) != 4) d->err = errno ? errno : EIO;
    tera_ckpt_io_point("write", d->path);
    tera_ckpt_io_point("fsync", d->path);
    if (!d->err && fsync(d->fd) != 0) d->err = errno;
    if (close(d->fd) != 0 && !d->err) d->err = errno;
    d->fd = -1;
    if (d->err) return tera_fail(TERA_ERR_IO, "%s: write failed: %s", d->path, strerror(d->err));
    return TERA_OK;
}

/* 64 KiB chunks of one region filled in order (gaps are alignment padding: zeros). A full save
 * records each chunk's XXH3 as the new base; a differential one stores the chunks whose hash
 * differs from the base, zstd level 1, into its sink. One chunk may be shared by two streams (the
 * non-expert and the expert ranges meet inside it): it is finished when both have passed it. */
typedef struct {
    uint8_t *buf;           /* [chunk] the chunk being filled */
    int64_t chunk;          /* its index, -1: none yet */
    int64_t pos;            /* next float position in the region */
    dsink *sink;
} cstream;

typedef struct {
    int full, region;
    uint64_t *base;         /* [n_chunks] */
    int64_t n_chunks;
    ZSTD_CCtx *z;
    uint8_t *ztmp;
    size_t zcap;
    int64_t changed, total;
    uint8_t *shared;        /* the chunk both streams touch, or NULL */
    int64_t shared_chunk;
    int shared_left;        /* streams still to pass it */
    dsink *shared_sink;
} chunker;

static void chunk_done(chunker *k, const uint8_t *data, int64_t chunk, int64_t region_bytes, dsink *sink) {
    const size_t CH = TERA_CKPT_CHUNK_BYTES, off = (size_t)chunk * CH;
    const size_t len = (size_t)region_bytes - off < CH ? (size_t)region_bytes - off : CH;
    const uint64_t h = XXH3_64bits(data, len);
    k->total++;
    if (k->full) {
        k->base[chunk] = h;
        return;
    }
    if (chunk < k->n_chunks && h == k->base[chunk]) return;
    const size_t cs = ZSTD_compressCCtx(k->z, k->ztmp, k->zcap, data, len, 1);
    TERA_ASSERT(!ZSTD_isError(cs));
    const uint32_t rr = (uint32_t)k->region, raw = (uint32_t)len, cc = (uint32_t)cs;
    const uint64_t o = off;
    uint8_t hdr[20];
    memcpy(hdr, &rr, 4), memcpy(hdr + 4, &raw, 4), memcpy(hdr + 8, &o, 8), memcpy(hdr + 16, &cc, 4);
    dsink_put(sink, hdr, 20);
    dsink_put(sink, k->ztmp, cs);
    sink->nrec++;
    k->changed++;
}

/* Finishes the chunk s holds (the shared one only once both streams passed it). */
static void cstream_flush(chunker *k, cstream *s, int64_t region_bytes) {
    if (s->chunk < 0) return;
    if (k->shared && s->chunk == k->shared_chunk) {
        if (--k->shared_left == 0) chunk_done(k, k->shared, s->chunk, region_bytes, k->shared_sink);
    } else {
        chunk_done(k, s->buf, s->chunk, region_bytes, s->sink);
    }
    s->chunk = -1;
}

/* Feeds floats at region positions [at, at + n) (at >= s->pos; the gap before is zeros). */
static void cstream_feed(chunker *k, cstream *s, int64_t at, const float *p, int64_t n, int64_t region_floats) {
    const int64_t CF = TERA_CKPT_CHUNK_BYTES / (int64_t)sizeof(float), rb = region_floats * (int64_t)sizeof(float);
    TERA_ASSERT(at >= s->pos);
    while (s->pos < at + n) {
        const int64_t c = s->pos / CF;
        if (s->chunk != c) {
            cstream_flush(k, s, rb);
            s->chunk = c;
        }
        uint8_t *dst = k->shared && c == k->shared_chunk ? k->shared : s->buf;
        if (s->pos == c * CF && dst == s->buf) memset(dst, 0, TERA_CKPT_CHUNK_BYTES);
        const int64_t end = (c + 1) * CF < at + n ? (c + 1) * CF : at + n;
        if (s->pos < at) { /* padding */
            const int64_t z1 = at < end ? at : end;
            memset(dst + (s->pos - c * CF) * 4, 0, (size_t)(z1 - s->pos) * 4);
            s->pos = z1;
            continue;
        }
        memcpy(dst + (s->pos - c * CF) * 4, p + (s->pos - at), (size_t)(end - s->pos) * 4);
        s->pos = end;
    }
}

/* The rest of the stream's range up to `end` (zeros), then its last chunk. */
static void cstream_end(chunker *k, cstream *s, int64_t end, int64_t region_floats) {
    static const float zero[1024];
    while (s->pos < end) {
        const int64_t n = end - s->pos < 1024 ? end - s->pos : 1024;
        cstream_feed(k, s, s->pos, zero, n, region_floats);
    }
    cstream_flush(k, s, region_floats * (int64_t)sizeof(float));
}

/* The streamed whole save's state on world rank 0 (the model and optimizer files, checksums). */
typedef struct {
    tera_st_writer wm, wo;
    tera_st_stream *sm, *so;
    int *entry;             /* [n_params] model.safetensors entry of tensor i (experts: of expert 0) */
    XXH3_state_t *rh;
} wsave;

static tera_status wsave_open(wsave *ws, tera_ckpt_ctx *c, const char *tmp) {
    const tera_model *g = &c->shadow;
    char name[192], path[TERA_PATH_MAX + 256];
    static const char dummy = 0; /* the stream never reads entry data */
    tera_st_writer_init(&ws->wm);
    tera_st_writer_init(&ws->wo);
    tera_st_writer_meta(&ws->wm, "format", "pt");
    ws->entry = tera_calloc((size_t)g->n_params + 1, sizeof(int));
    for (int i = 0; i < g->n_params; i++) { /* the order and names of tera_hf_export */
        const tera_param *p = &g->params[i];
        ws->entry[i] = ws->wm.n;
        if (!p->expert_stacked) {
            tera_st_writer_add(&ws->wm, p->name, TERA_DT_F32, p->ndim, p->shape, &dummy);
            continue;
        }
        for (int e = 0; e < (int)p->shape[0]; e++) {
            expert_name(name, sizeof name, p->name, e);
            tera_st_writer_add(&ws->wm, name, TERA_DT_F32, 2, &p->shape[1], &dummy);
        }
    }
    const int64_t E = g->cfg.n_experts;
    const int bias0 = ws->wm.n;
    if (g->cfg.aux_free && g->router_bias)
        for (int l = 0; l < g->cfg.n_layers; l++) {
            if (l < g->cfg.first_k_dense || E <= 0) continue;
            snprintf(name, sizeof name, "model.layers.%d.block_sparse_moe.gate.e_score_correction_bias", l);
            tera_st_writer_add(&ws->wm, name, TERA_DT_F32, 1, &E, &dummy);
        }
    for (int i = 0; i < g->n_params; i++) {
        const tera_param *p = &g->params[i];
        snprintf(name, sizeof name, "exp_avg.%d", i);
        tera_st_writer_add(&ws->wo, name, TERA_DT_F32, p->ndim, p->shape, &dummy);
        snprintf(name, sizeof name, "exp_avg_sq.%d", i);
        tera_st_writer_add(&ws->wo, name, TERA_DT_F32, p->ndim, p->shape, &dummy);
    }
    tera_ckpt_io_point("write", tmp); /* model.safetensors + config.json */
    TERA_TRY(tera_st_stream_open(&ws->sm, &ws->wm, tmp, 1, c->cfg.checkpoint.max_shard_bytes));
    snprintf(path, sizeof path, "%s/optimizer.safetensors", tmp);
    tera_ckpt_io_point("write", path);
    TERA_TRY(tera_st_stream_open(&ws->so, &ws->wo, path, 0, 0));
    /* the router biases: world rank 0 holds them */
    if (g->cfg.aux_free && g->router_bias) {
        int e = bias0;
        for (int l = 0; l < g->cfg.n_layers; l++) {
            if (l < g->cfg.first_k_dense || E <= 0) continue;
            TERA_TRY(tera_st_stream_write(ws->sm, e++, 0, g->router_bias + (int64_t)l * E, sizeof(float) * (size_t)E));
        }
    }
    return TERA_OK;
}

static void wsave_free(wsave *ws) {
    tera_st_stream_abort(ws->sm);
    tera_st_stream_abort(ws->so);
    tera_st_writer_free(&ws->wm);
    tera_st_writer_free(&ws->wo);
    free(ws->entry);
    memset(ws, 0, sizeof *ws);
}

/* A window [a, b) of tensor i's region-k elements into the files. */
static tera_status wsave_put(wsave *ws, const tera_param *p, int i, int k, int64_t a, int64_t b, const float *win) {
    if (k > 0) return tera_st_stream_write(ws->so, 2 * i + (k - 1), sizeof(float) * (uint64_t)a, win, sizeof(float) * (uint64_t)(b - a));
    const int64_t per = p->expert_stacked ? p->shape[1] * p->shape[2] : p->numel;
    for (int64_t x = a; x < b;) {
        const int64_t e = x / per, y = (e + 1) * per < b ? (e + 1) * per : b;
        TERA_TRY(tera_st_stream_write(ws->sm, ws->entry[i] + (int)e, sizeof(float) * (uint64_t)(x - e * per), win + (x - a),
                                      sizeof(float) * (uint64_t)(y - x)));
        x = y;
    }
    return TERA_OK;
}

static tera_ckpt_ctx *ctx_create_streamed(const tera_trainer *tr) {
    tera_ckpt_ctx *c = tera_calloc(1, sizeof *c);
    c->opt = tera_ckpt_options_from_config(&tr->cfg);
    c->cfg = tr->cfg;
    snprintf(c->run_dir, sizeof c->run_dir, "%s", tr->run_dir);
    tera_zero_global_shell(&tr->model, &c->shadow); /* the one-process table; no buffers */
    c->params = c->shadow.params;
    c->shadow.w = NULL;
    c->shadow.router_bias = tr->model.router_bias;
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) c->reg_n[r] = tera_ckpt_region_floats(&c->shadow, r);
    c->win_n = window_floats(&tr->cfg);
    c->win = tera_malloc(sizeof(float) * (size_t)(c->win_n + 2));
    return c;
}

/* The whole checkpoint of a run on several ranks (collective; world rank 0 writes). */
/* The background part of a streamed whole save (world rank 0): finish the data files, then the
 * checkpoint (finish_checkpoint). */
typedef struct {
    tera_ckpt_ctx *c;
    wsave ws;
    dsink main_sink, tail_sink;
    tera_status st;             /* of the windows' part */
    uint64_t rhash[TERA_CKPT_N_REGIONS];
    int64_t changed, total;
    double t0;
    char root[TERA_PATH_MAX + 32], dir[TERA_PATH_MAX + 64], tmp[TERA_PATH_MAX + 96];
} sfin;

static tera_status streamed_finish(sfin *f) {
    tera_ckpt_ctx *c = f->c;
    const tera_model *g = &c->shadow;
    wsave ws = f->ws;
    const char *tmp = f->tmp;
    char path[TERA_PATH_MAX + 256];
    tera_status s = f->st;
    cJSON *man = cJSON_CreateObject();
    cJSON_AddStringToObject(man, "format", "tera-checkpoint");
    cJSON_AddNumberToObject(man, "format_version", TERA_CKPT_FORMAT_VERSION);
    cJSON_AddNumberToObject(man, "step", (double)c->step);
    cJSON_AddStringToObject(man, "kind", c->full ? "full" : "diff");
    if (c->full) {
        if (s == TERA_OK) s = tera_st_stream_finish(ws.sm);
        ws.sm = NULL;
        if (s == TERA_OK) s = tera_st_stream_finish(ws.so);
        ws.so = NULL;
        snprintf(path, sizeof path, "%s/config.json", tmp);
        if (s == TERA_OK) s = tera_hf_write_config(&g->cfg, path);
        if (s == TERA_OK) {
            free(c->config_json);
            c->config_json = NULL;
            s = tera_read_text_file(path, &c->config_json);
        }
        cJSON *tensors = cJSON_AddArrayToObject(man, "tensors");
        if (s == TERA_OK) s = manifest_tensors(c, tmp, tensors);
        if (s == TERA_OK) c->has_base = 1, c->since_full = 0, c->base_step = c->step;
    } else {
        if (f->tail_sink.fd >= 0) close(f->tail_sink.fd);
        snprintf(path, sizeof path, "%s/diff.bin.part", tmp);
        unlink(path);
        if (f->main_sink.fd >= 0) {
            const tera_status s2 = dsink_close(&f->main_sink);
            if (s == TERA_OK) s = s2;
        }
        cJSON_AddNumberToObject(man, "base_step", (double)c->base_step);
        char bn[64];
        snprintf(bn, sizeof bn, "step_%08" PRId64, c->base_step);
        cJSON_AddStringToObject(man, "base", bn);
        cJSON *ch = cJSON_AddObjectToObject(man, "chunks");
        cJSON_AddNumberToObject(ch, "chunk_bytes", TERA_CKPT_CHUNK_BYTES);
        cJSON_AddNumberToObject(ch, "total", (double)f->total);
        cJSON_AddNumberToObject(ch, "changed", (double)f->changed);
        cJSON_AddStringToObject(ch, "compression", "zstd-1");
        c->since_full++;
    }
    wsave_free(&ws);
    if (s == TERA_OK) return finish_checkpoint(c, man, tmp, f->dir, f->root, f->rhash, f->changed, f->total, f->t0);
    cJSON_Delete(man);
    return s;
}

static void *streamed_finish_main(void *arg) {
    tera_ckpt_ctx *c = arg;
    sfin *f = c->fin;
    const double t0 = tera_now();
    c->st = streamed_finish(f);
    tera_trace_event(TERA_TRACE_CKPT, "checkpoint write", "checkpoint", t0, tera_now(), -1); /* the timeline */
    if (c->st != TERA_OK) snprintf(c->err, sizeof c->err, "checkpoint step %" PRId64 ": %s", c->step, tera_last_error());
    free(f);
    c->fin = NULL;
    return NULL;
}

tera_status tera_trainer_save_streamed(tera_trainer *tr) {
    const int final = tr->step >= tr->cfg.training.steps;
    if (!tr->ckpt.whole) tr->ckpt.whole = ctx_create_streamed(tr);
    tera_ckpt_ctx *c = tr->ckpt.whole;
    const double t0 = tera_now();
    char root[TERA_PATH_MAX + 32], dir[TERA_PATH_MAX + 64], tmp[TERA_PATH_MAX + 96], path[TERA_PATH_MAX + 256];
    snprintf(root, sizeof root, "%s/checkpoints", c->run_dir);
    snprintf(dir, sizeof dir, "%s/step_%08" PRId64, root, tr->step);
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    /* the previous save's background part must be complete (world rank 0); a committed checkpoint
     * of this step that verifies is kept (a resumed, finished run) */
    tera_status s = ctx_wait(c);
    int64_t flags[2] = {tr->root && s == TERA_OK && tera_ckpt_committed(dir) && tera_ckpt_verify(dir, NULL) == TERA_OK,
                        s != TERA_OK};
    tera_comm_allreduce_i64(tera_comm_world(), flags, 2);
    const int64_t have = flags[0];
    if (flags[1]) {
        if (s == TERA_OK) s = tera_fail(TERA_ERR_IO, "checkpoint failed on rank 0 (see its message)");
        if (final) tera_trainer_ckpt_close(tr);
        return s;
    }
    if (!have) {
        const tera_model *g = &c->shadow;
        wsave ws = {0};
        chunker ck = {0};
        dsink main_sink = {.fd = -1}, tail_sink = {.fd = -1};
        uint64_t rhash[TERA_CKPT_N_REGIONS] = {0};
        int64_t changed = 0, total = 0;
        if (tr->root) {
            c->full = save_is_full(final || tr->ckpt.force_full, c->has_base, c->opt.full_every, c->since_full);
            c->step = tr->step;
            free(c->state_json);
            c->state_json = state_text(tr);
            tera_ckpt_io_point("mkdir", root);
            s = tera_mkdirs(root);
            if (s == TERA_OK) s = clean_uncommitted(root);
            tera_ckpt_io_point("mkdir", tmp);
            if (s == TERA_OK) s = tera_mkdirs(tmp);
            if (s == TERA_OK && c->full) s = wsave_open(&ws, c, tmp);
            if (s == TERA_OK && !c->full) {
                snprintf(path, sizeof path, "%s/diff.bin", tmp);
                s = dsink_open(&main_sink, path, 1);
                snprintf(path, sizeof path, "%s/diff.bin.part", tmp);
                if (s == TERA_OK) s = dsink_open(&tail_sink, path, 0);
            }
            ws.rh = XXH3_createState();
            ck.z = ZSTD_createCCtx();
            ck.zcap = ZSTD_compressBound(TERA_CKPT_CHUNK_BYTES);
            ck.ztmp = tera_malloc(ck.zcap);
            ck.full = c->full;
        }
        uint8_t *cbuf = tr->root ? tera_malloc(3 * (size_t)TERA_CKPT_CHUNK_BYTES) : NULL;
        const int64_t nd = g->n_dense_floats, CF = TERA_CKPT_CHUNK_BYTES / (int64_t)sizeof(float);
        for (int k = 0; k < 3; k++) {
            const int64_t n = c->reg_n[k], nc = (n * (int64_t)sizeof(float) + TERA_CKPT_CHUNK_BYTES - 1) / TERA_CKPT_CHUNK_BYTES;
            cstream cs[2] = {{.buf = cbuf, .chunk = -1, .pos = 0, .sink = &main_sink},
                             {.buf = cbuf ? cbuf + TERA_CKPT_CHUNK_BYTES : NULL, .chunk = -1, .pos = nd, .sink = &tail_sink}};
            if (tr->root) {
                XXH3_64bits_reset(ws.rh);
                ck.region = k;
                if (c->full) {
                    free(c->base_hash[k]);
                    c->base_hash[k] = tera_calloc((size_t)nc + 1, sizeof(uint64_t));
                    c->n_chunks[k] = nc;
                }
                ck.base = c->base_hash[k];
                ck.n_chunks = nc;
                const int straddle = nd % CF != 0 && nd < n;
                ck.shared = straddle ? cbuf + 2 * TERA_CKPT_CHUNK_BYTES : NULL;
                ck.shared_chunk = straddle ? nd / CF : -1;
                ck.shared_left = 2;
                ck.shared_sink = &main_sink;
                if (straddle) memset(ck.shared, 0, TERA_CKPT_CHUNK_BYTES);
            }
            for (int i = 0; i < g->n_params; i++) {
                const tera_param *p = &g->params[i];
                for (int64_t a = 0; a < p->numel; a += c->win_n) {
                    const int64_t b = a + c->win_n < p->numel ? a + c->win_n : p->numel;
                    tera_zero_gather_window(tr->sharding, g, k, p->offset + a, p->offset + b, c->win, 1);
                    if (!tr->root) continue;
                    XXH3_64bits_update(ws.rh, c->win, sizeof(float) * (size_t)(b - a));
                    cstream_feed(&ck, &cs[p->offset >= nd], p->offset + a, c->win, b - a, n);
                    if (s == TERA_OK && c->full) s = wsave_put(&ws, p, i, k, a, b, c->win);
                }
            }
            if (tr->root) {
                cstream_end(&ck, &cs[0], nd, n);
                cstream_end(&ck, &cs[1], n, n);
                if (!c->full) dsink_append(&main_sink, &tail_sink, cbuf, TERA_CKPT_CHUNK_BYTES);
                rhash[k] = XXH3_64bits_digest(ws.rh);
            }
        }
        if (tr->root) {
            /* the router bias: world rank 0's */
            const int64_t nb = c->reg_n[3];
            rhash[3] = tera_ckpt_region_hash(g, 3, g->router_bias);
            const int64_t nc = (nb * (int64_t)sizeof(float) + TERA_CKPT_CHUNK_BYTES - 1) / TERA_CKPT_CHUNK_BYTES;
            ck.region = 3;
            ck.shared = NULL;
            if (c->full) {
                free(c->base_hash[3]);
                c->base_hash[3] = tera_calloc((size_t)nc + 1, sizeof(uint64_t));
                c->n_chunks[3] = nc;
            }
            ck.base = c->base_hash[3];
            cstream bs = {.buf = cbuf, .chunk = -1, .pos = 0, .sink = &main_sink};
            if (nb > 0) cstream_feed(&ck, &bs, 0, g->router_bias, nb, nb);
            cstream_flush(&ck, &bs, nb * (int64_t)sizeof(float));
            changed = ck.changed, total = ck.total;
            XXH3_freeState(ws.rh);
            ZSTD_freeCCtx(ck.z);
            free(ck.ztmp);
            /* the rest (fsync, rename, config.json, manifest, COMMIT, retention) needs no other
             * rank: in the background (checkpoint.async) unless final; the next save waits for it */
            sfin *f = tera_calloc(1, sizeof *f);
            f->c = c, f->ws = ws, f->main_sink = main_sink, f->tail_sink = tail_sink, f->st = s;
            memcpy(f->rhash, rhash, sizeof rhash);
            f->changed = changed, f->total = total, f->t0 = t0;
            snprintf(f->root, sizeof f->root, "%s", root);
            snprintf(f->dir, sizeof f->dir, "%s", dir);
            snprintf(f->tmp, sizeof f->tmp, "%s", tmp);
            c->fin = f;
            if (s == TERA_OK && c->opt.async && !final && pthread_create(&c->th, NULL, streamed_finish_main, c) == 0) {
                c->running = 1;
            } else {
                streamed_finish_main(c);
                s = c->st;
                c->st = TERA_OK;
                if (s != TERA_OK) s = tera_fail(s, "%s", c->err);
            }
        }
        free(cbuf);
    }
    int64_t failed = s != TERA_OK;
    tera_comm_allreduce_i64(tera_comm_world(), &failed, 1);
    if (failed && s == TERA_OK) s = tera_fail(TERA_ERR_IO, "checkpoint failed on rank 0 (see its message)");
    if (!have) record_pause(tera_now() - t0, tr->root ? c->full : 1);
    if (final && g_stats.saves > 0 && tr->root && tr->cfg.logging.progress)
        fprintf(stderr, "tera: checkpoints: %d streamed saves (%d full), step-loop pause mean %.2f ms, max %.2f ms; "
                "last write %.3f s, %" PRId64 " bytes; writer window %.1f MiB per rank\n", g_stats.saves,
                g_stats.full_saves, 1e3 * g_stats.total_pause_s / g_stats.saves, 1e3 * g_stats.max_pause_s,
                g_stats.last_write_s, g_stats.last_bytes, (double)tera_ckpt_writer_buffer_bytes(&tr->cfg) / (1 << 20));
    if (final) {
        tera_status s2 = tera_trainer_ckpt_close(tr);
        if (s == TERA_OK) s = s2;
    }
    return s;
}

tera_status tera_trainer_save_whole(tera_trainer *tr) {
    if (!tr->run_dir[0]) return TERA_OK;
    /* one process, or a data-parallel replica without ZeRO: its storage is the whole model, its
     * moments one contiguous buffer (the expert region's optimizer is a view into the non-expert
     * one's allocation) */
    TERA_ASSERTF(tr->root && tr->topo.tp == 1 && tr->topo.pp == 1 && tr->topo.ep == 1 && !tr->sharding->stage && tr->model.w &&
                 (tr->sharding->opt_x.view || !tr->sharding->opt_x.n), "a whole save from memory needs the whole model in this rank's storage");
    const float *const src[TERA_CKPT_N_REGIONS] = {tr->model.w, tr->sharding->opt.m, tr->sharding->opt.v, tr->model.router_bias};
    const int final = tr->step >= tr->cfg.training.steps;
    if (!tr->ckpt.whole) tr->ckpt.whole = ctx_create(tr);
    tera_ckpt_ctx *c = tr->ckpt.whole;
    const double t0 = tera_now();
    tera_status s = ctx_wait(c); /* the previous write must be complete */
    const double t_wait = tera_now() - t0;
    char dir[TERA_PATH_MAX + 64];
    snprintf(dir, sizeof dir, "%s/checkpoints/step_%08ld", tr->run_dir, (long)tr->step);
    /* a committed checkpoint of this step that verifies is kept (a resumed, finished run) */
    if (s == TERA_OK && !(tera_ckpt_committed(dir) && tera_ckpt_verify(dir, NULL) == TERA_OK)) {
        /* the final save is always full, so a finished run ends with a Hugging Face directory */
        c->full = save_is_full(final || tr->ckpt.force_full, c->has_base, c->opt.full_every, c->since_full);
        const double t1 = tera_now();
        /* A synchronous save (checkpoint.async off, the final one, the run's last) writes the training
         * state itself: the step loop waits for the write either way, and the snapshot (3 x the
         * rank's floats) is never allocated. A snapshot only for a save in the background, or to
         * widen bf16 moments (optimizer.moments). */
        const int background = c->opt.async && !final && !tr->ckpt.last;
        int direct = !background;
        for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) direct &= !c->reg_n[r] || src[r] != NULL;
        if (direct) {
            float *base[TERA_CKPT_N_REGIONS];
            memcpy(base, src, sizeof base); /* read only (regions_at) */
            regions_at(c, base);
            snapshot_scalars(c, tr);
            s = write_checkpoint(c);
            regions_at(c, (float *[TERA_CKPT_N_REGIONS]){NULL}); /* no pointer into the state outlives the save */
            record_pause(tera_now() - t1 + t_wait, c->full);
        } else {
            snapshot(c, tr, src);
            record_pause(tera_now() - t1 + t_wait, c->full);
            c->running = background && pthread_create(&c->th, NULL, writer_main, c) == 0;
            if (!c->running) s = write_checkpoint(c); /* synchronous (or no thread could start) */
        }
    }
    if (final && g_stats.saves > 0 && tr->cfg.logging.progress)
        fprintf(stderr, "tera: checkpoints: %d saves (%d full), step-loop pause mean %.2f ms, max %.2f ms; last write "
                "%.3f s, %" PRId64 " bytes\n", g_stats.saves, g_stats.full_saves,
                1e3 * g_stats.total_pause_s / g_stats.saves, 1e3 * g_stats.max_pause_s, g_stats.last_write_s,
                g_stats.last_bytes);
    if (final) {
        tera_status s2 = tera_trainer_ckpt_close(tr);
        if (s == TERA_OK) s = s2;
    }
    return s;
}

/* Every rank of the world learns whether st failed anywhere. */
static tera_status agree_world(const tera_trainer *tr, tera_status st, const char *what) {
    if (tr->topo.world == 1) return st;
    int64_t failed = st != TERA_OK;
    tera_comm_allreduce_i64(tera_comm_world(), &failed, 1);
    if (failed && st == TERA_OK) return tera_fail(TERA_ERR_FORMAT, "%s failed on another rank (see its message)", what);
    return st;
}

/* The restored state must be the state that was saved: the XXH3 of each region of the whole model
 * (table order), streamed window by window from the ranks' parts (collective). */
static tera_status check_regions(tera_trainer *tr, const char *dir, int moments) {
    if (moments) { /* bf16 moments from an fp32-moment checkpoint were rounded on purpose: not compared */
        int64_t rounded = tr->sharding->moments_rounded;
        if (tr->topo.world > 1) tera_comm_allreduce_i64(tera_comm_world(), &rounded, 1);
        if (rounded && tr->root)
            fprintf(stderr, "tera: %s: fp32 moments rounded to bf16 (optimizer.moments = bf16); their checksums are "
                    "not compared\n", dir);
        moments = !rounded;
    }
    tera_model shell;
    tera_zero_global_shell(&tr->model, &shell);
    shell.router_bias = tr->model.router_bias;
    const int64_t W = window_floats(&tr->cfg);
    float *win = tera_malloc(sizeof(float) * (size_t)(W + 2));
    XXH3_state_t *h = XXH3_createState();
    tera_status st = TERA_OK;
    for (int k = 0; k < TERA_CKPT_N_REGIONS && st == TERA_OK; k++) {
        if (k > 0 && k < 3 && !moments) continue;
        uint64_t hash;
        if (k == 3) {
            if (!tera_ckpt_region_floats(&shell, 3)) continue;
            hash = tera_ckpt_region_hash(&shell, 3, shell.router_bias);
        } else {
            XXH3_64bits_reset(h);
            for (int i = 0; i < shell.n_params; i++) {
                const tera_param *p = &shell.params[i];
                for (int64_t a = 0; a < p->numel; a += W) {
                    const int64_t b = a + W < p->numel ? a + W : p->numel;
                    tera_zero_gather_window(tr->sharding, &shell, k, p->offset + a, p->offset + b, win, 0);
                    XXH3_64bits_update(h, win, sizeof(float) * (size_t)(b - a));
                }
            }
            hash = XXH3_64bits_digest(h);
        }
        int checked;
        st = tera_ckpt_region_check(dir, k, hash, &checked);
        if (!checked) break; /* a sharded checkpoint: no region checksums */
    }
    XXH3_freeState(h);
    free(win);
    free(shell.params);
    return st;
}

tera_status tera_trainer_load_dir(tera_trainer *tr, const char *dir, int moments) {
    /* every rank reads its own part (its blocks, its ZeRO shards) straight from the files */
    tera_model shell;
    tera_zero_global_shell(&tr->model, &shell);
    tera_ckpt_reader *rd = NULL;
    tera_status st = tera_ckpt_reader_open(&rd, dir, &shell);
    if (st == TERA_OK && moments && tera_ckpt_reader_is_hf(rd))
        st = tera_fail(TERA_ERR_FORMAT, "%s: a Hugging Face directory holds no optimizer state to resume from (use it "
                       "as training.init_from)", dir);
    if (st == TERA_OK) st = tera_zero_load(tr->sharding, rd, moments);
    /* sharded checkpoints and Hugging Face directories carry no region checksums */
    const int checksums = rd && !tera_ckpt_reader_sharded(rd) && !tera_ckpt_reader_is_hf(rd);
    tera_ckpt_reader_close(rd);
    free(shell.params);
    st = agree_world(tr, st, "loading the checkpoint");
    if (st == TERA_OK && checksums) st = check_regions(tr, dir, moments);
    return st;
}

tera_status tera_trainer_resume_dir(tera_trainer *tr, const char *dir) {
    char path[TERA_PATH_MAX + 128];
    TERA_TRY(tera_trainer_load_dir(tr, dir, 1));
    snprintf(path, sizeof path, "%s/state.json", dir);
    /* the step the directory's name gives (tera_ckpt_find_latest and ckpt verify check that COMMIT
     * names the same); under another name (a copied checkpoint) state.json's step is range-checked
     * only */
    TERA_TRY(read_state(tr, path, tera_ckpt_dir_step(dir)));
    tr->sharding->opt_x.t = tr->sharding->opt.t;
    return TERA_OK;
}


/* ------------------------------------------------------------------ sharded checkpoints
 * checkpoint.sharded with several ranks: no rank gathers the model. Every element of the model is
 * written by exactly one rank (tera_zero_writes: the first expert-data-parallel replica, the
 * first rank of the ep group for non-expert tensors, the first tp rank for tensors replicated over
 * tp), into rank-NNNNN.safetensors (NNNNN: its index in the model-parallel group, (pp_rank * ep +
 * ep_rank) * tp + tp_rank): tensors "w.I", "m.I", "v.I" hold its block of parameter I (of the
 * one-process table) and the block's Adam moments. World rank 0 writes config.json,
 * router_bias.safetensors, state.json, config.ini and the manifest, whose "tensors" give each
 * tensor's global shape and, per piece, the file and the slice (lo, len per dim) it holds; then
 * COMMIT covers every file of every rank. Synchronous (the ranks meet before the commit) and always
 * full. tera_ckpt_load reads it under any layout. */
/* The manifest of a sharded checkpoint: format, step, layout, and for every tensor of the
 * one-process table its global shape and the pieces (file, lo, len) the writing ranks hold. */
static cJSON *sharded_manifest(const tera_trainer *tr, int64_t step) {
    cJSON *man = cJSON_CreateObject();
    cJSON_AddStringToObject(man, "format", "tera-checkpoint");
    cJSON_AddNumberToObject(man, "format_version", TERA_CKPT_FORMAT_VERSION);
    cJSON_AddNumberToObject(man, "step", (double)step);
    cJSON_AddStringToObject(man, "kind", "full");
    cJSON_AddBoolToObject(man, "sharded", 1);
    cJSON_AddStringToObject(man, "run_config", "config.ini");
    cJSON *lay = cJSON_AddObjectToObject(man, "layout");
    cJSON_AddNumberToObject(lay, "world_size", tr->topo.world);
    cJSON_AddNumberToObject(lay, "dp", tr->cfg.parallel.dp);
    cJSON_AddNumberToObject(lay, "tp", tr->topo.tp);
    cJSON_AddNumberToObject(lay, "pp", tr->topo.pp);
    cJSON_AddNumberToObject(lay, "ep", tr->topo.ep);
    cJSON_AddNumberToObject(lay, "zero", tr->cfg.parallel.zero);
    tera_model shell;
    tera_zero_global_shell(&tr->model, &shell);
    const int P = tr->topo.ep * tr->topo.tp * tr->topo.pp;
    tera_param **tab = tera_calloc((size_t)P, sizeof(tera_param *));
    for (int r = 0; r < P; r++) tab[r] = tera_zero_member_table(&tr->model, &tr->topo, r, NULL);
    cJSON *tens = cJSON_AddArrayToObject(man, "tensors");
    char file[64];
    for (int i = 0; i < shell.n_params; i++) {
        const tera_param *g = &shell.params[i];
        cJSON *t = cJSON_CreateObject();
        cJSON_AddStringToObject(t, "name", g->name);
        cJSON *gs = cJSON_AddArrayToObject(t, "global_shape");
        for (int d = 0; d < g->ndim; d++) cJSON_AddItemToArray(gs, cJSON_CreateNumber((double)g->shape[d]));
        cJSON *pcs = cJSON_AddArrayToObject(t, "pieces");
        for (int r = 0; r < P; r++) {
            const tera_param *p = &tab[r][i];
            if (!tera_zero_member_writes(&tr->topo, r, p)) continue;
            cJSON *pc = cJSON_CreateObject();
            snprintf(file, sizeof file, "rank-%05d.safetensors", r);
            cJSON_AddStringToObject(pc, "file", file);
            cJSON *lo = cJSON_AddArrayToObject(pc, "lo"), *len = cJSON_AddArrayToObject(pc, "len");
            for (int d = 0; d < g->ndim; d++) {
                cJSON_AddItemToArray(lo, cJSON_CreateNumber((double)p->lo[d]));
                cJSON_AddItemToArray(len, cJSON_CreateNumber((double)p->len[d]));
            }
            cJSON_AddItemToArray(pcs, pc);
        }
        cJSON_AddItemToArray(tens, t);
    }
    for (int r = 0; r < P; r++) free(tab[r]);
    free(tab);
    free(shell.params);
    return man;
}

static tera_status agree(tera_status st, const char *what) {
    int64_t failed = st != TERA_OK;
    tera_comm_allreduce_i64(tera_comm_world(), &failed, 1);
    if (failed && st == TERA_OK) return tera_fail(TERA_ERR_IO, "sharded checkpoint: %s failed on another rank", what);
    return st;
}

/* The sharded writer's state: the step's scalar state, this rank's file (written window by window
 * from its blocks, each window gathered over the ranks sharing its ZeRO shards), committed right
 * after (or at close). */
struct tera_shard_ckpt {
    float *win;                 /* the one transfer window [win_n] */
    int64_t win_n;
    uint8_t *cbuf;              /* one 64 KiB chunk (differential scheme) */
    float *bias;                /* [L E] router bias (world rank 0) */
    char root[TERA_PATH_MAX + 32], dir[TERA_PATH_MAX + 64], tmp[TERA_PATH_MAX + 96];
    int64_t step;
    char *state_json;           /* world rank 0 */
    int pending;                /* written, not committed */
    pthread_t th;
    int running;                /* always 0: the write is synchronous (the windows travel between ranks) */
    tera_status st;
    char err[1024];
    int wrote;                  /* this rank has a file */
    char file[64];
    int64_t size;
    uint64_t hash;
    double t_start;
    /* differential saves (checkpoint.full_every): the rank's written blocks in table order, each as
     * parameters, exp_avg, exp_avg_sq, form one buffer cut into 64 KiB chunks; their hashes at the
     * last full save */
    int full, has_base, since_full;
    int64_t base_step;
    uint64_t *base_hash;
    int64_t n_chunks;
    int64_t changed, total;     /* chunks of the last differential save */
    /* this rank's file between its windows and its finish */
    tera_st_writer fw;
    tera_st_stream *ss;
    dsink ds;
    int any;
    char path[TERA_PATH_MAX + 200];
};

static void shard_free(tera_trainer *tr) {
    tera_shard_ckpt *c = tr->ckpt.shard;
    free(c->win);
    free(c->cbuf);
    free(c->bias);
    free(c->state_json);
    free(c->base_hash);
    free(c);
    tr->ckpt.shard = NULL;
}

/* This rank's part of a sharded save (collective over the ranks sharing ZeRO shards): every rank
 * walks its blocks in table order, window by window; the writing rank puts each window into its
 * file (full) or into the changed chunks (differential). */
static tera_status shard_stream(tera_trainer *tr, tera_shard_ckpt *c) {
    const tera_model *m = &tr->model;
    static const char dummy = 0;
    tera_st_writer w;
    tera_st_writer_init(&w);
    char nm[32], path[TERA_PATH_MAX + 200];
    int64_t sb_n = 0;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        if (!tera_zero_writes(&tr->topo, p)) continue;
        static const char prefix[3] = {'w', 'm', 'v'};
        for (int k = 0; k < 3; k++) {
            snprintf(nm, sizeof nm, "%c.%d", prefix[k], i);
            tera_st_writer_add(&w, nm, TERA_DT_F32, p->ndim, p->len, &dummy);
        }
        sb_n += 3 * p->numel;
    }
    const int any = w.n > 0;
    tera_status st = TERA_OK;
    tera_st_stream *ss = NULL;
    dsink ds = {.fd = -1};
    if (any && c->full) {
        snprintf(path, sizeof path, "%s/%s", c->tmp, c->file);
        tera_ckpt_io_point("write", path);
        st = tera_st_stream_open(&ss, &w, path, 0, 0);
    } else if (any) {
        snprintf(path, sizeof path, "%s/%.*s.diff", c->tmp, (int)(strlen(c->file) - strlen(".safetensors")), c->file);
        tera_ckpt_io_point("write", path);
        st = dsink_open(&ds, path, 1);
    }
    const int64_t CHB = TERA_CKPT_CHUNK_BYTES, nc = (sb_n * (int64_t)sizeof(float) + CHB - 1) / CHB;
    chunker ck = {.full = c->full, .region = 0, .n_chunks = c->n_chunks, .base = c->base_hash};
    if (any && c->full) {
        free(c->base_hash);
        c->base_hash = tera_calloc((size_t)nc + 1, sizeof(uint64_t));
        c->n_chunks = nc;
        ck.base = c->base_hash, ck.n_chunks = nc;
    }
    if (any && !c->full) {
        ck.z = ZSTD_createCCtx();
        ck.zcap = ZSTD_compressBound(TERA_CKPT_CHUNK_BYTES);
        ck.ztmp = tera_malloc(ck.zcap);
    }
    cstream cs = {.buf = c->cbuf, .chunk = -1, .pos = 0, .sink = &ds};
    int64_t at = 0;
    int e = 0;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        if (p->numel == 0 || (p->tp_dim < 0 && tr->topo.tp_rank != 0)) continue; /* the same on the ranks sharing it */
        const int writes = tera_zero_writes(&tr->topo, p), x = p->expert_stacked;
        for (int k = 0; k < 3; k++)
            for (int64_t a = 0; a < p->numel; a += c->win_n) {
                const int64_t b = a + c->win_n < p->numel ? a + c->win_n : p->numel;
                tera_zero_local_window(tr->sharding, k, x, p->offset + a, p->offset + b, c->win);
                if (!writes) continue;
                if (ss && st == TERA_OK)
                    st = tera_st_stream_write(ss, e + k, sizeof(float) * (uint64_t)a, c->win, sizeof(float) * (uint64_t)(b - a));
                cstream_feed(&ck, &cs, at + k * p->numel + a, c->win, b - a, sb_n);
            }
        if (writes) at += 3 * p->numel, e += 3;
    }
    if (any) cstream_end(&ck, &cs, sb_n, sb_n);
    c->changed = ck.changed, c->total = ck.total;
    ZSTD_freeCCtx(ck.z);
    free(ck.ztmp);
    /* finished (fsync, rename, hash) by shard_finish_main, in the background when async */
    c->fw = w;
    c->ss = ss;
    c->ds = ds;
    c->any = any;
    snprintf(c->path, sizeof c->path, "%s", path);
    return st;
}

/* The rest of this rank's file: fsync, rename, size and XXH3 (no other rank needed). */
static void *shard_finish_main(void *arg) {
    tera_shard_ckpt *c = arg;
    tera_status st = c->st;
    if (c->ss) {
        if (st == TERA_OK) st = tera_st_stream_finish(c->ss);
        else tera_st_stream_abort(c->ss);
        if (st == TERA_OK) st = tera_ckpt_fsync_path(c->path);
    } else if (c->any) {
        const tera_status s2 = dsink_close(&c->ds);
        if (st == TERA_OK) st = s2;
    }
    c->ss = NULL;
    tera_st_writer_free(&c->fw);
    if (c->any && st == TERA_OK) st = tera_ckpt_hash_file(c->path, &c->hash, &c->size);
    c->wrote = c->any && st == TERA_OK;
    c->st = st;
    if (st != TERA_OK) snprintf(c->err, sizeof c->err, "checkpoint step %" PRId64 ": %s", c->step, tera_last_error());
    return NULL;
}

/* Waits for this rank's write of the pending checkpoint, then commits it: the ranks agree, world
 * rank 0 writes its files, the manifest and COMMIT (with every rank's file size and hash), renames
 * the directory. Collective. */
static tera_status shard_commit(tera_trainer *tr) {
    tera_shard_ckpt *c = tr->ckpt.shard;
    if (!c || !c->pending) return TERA_OK;
    if (c->running) pthread_join(c->th, NULL);
    c->running = 0;
    c->pending = 0;
    tera_status st = c->st;
    if (st != TERA_OK) st = tera_fail(st, "%s", c->err);
    /* every rank's file: size and hash, to rank 0 (one slot per world rank) */
    const int W = tr->topo.world;
    int64_t *info = tera_calloc((size_t)(3 * W), sizeof(int64_t));
    if (c->wrote) {
        const int me = tera_zero_member(&tr->topo);
        info[3 * tr->topo.rank] = me + 1;
        info[3 * tr->topo.rank + 1] = c->size;
        memcpy(&info[3 * tr->topo.rank + 2], &c->hash, sizeof c->hash);
    }
    tera_comm_allreduce_i64(tera_comm_world(), info, 3 * W);
    st = agree(st, "writing a rank's shard");
    if (st == TERA_OK && tr->root) {
        const tera_model *m = &tr->model;
        known_file *known = tera_calloc((size_t)W, sizeof(known_file));
        int nk = 0;
        for (int r = 0; r < W; r++) {
            if (!info[3 * r]) continue;
            snprintf(known[nk].name, sizeof known[nk].name, "rank-%05d.%s", (int)(info[3 * r] - 1),
                     c->full ? "safetensors" : "diff");
            known[nk].size = info[3 * r + 1];
            memcpy(&known[nk].hash, &info[3 * r + 2], sizeof known[nk].hash);
            nk++;
        }
        char path[TERA_PATH_MAX + 256];
        snprintf(path, sizeof path, "%s/config.json", c->tmp);
        tera_ckpt_io_point("write", path);
        st = tera_hf_write_config(&m->cfg, path);
        const int64_t nb = tera_ckpt_region_floats(m, 3);
        if (st == TERA_OK && nb > 0) {
            tera_st_writer w;
            tera_st_writer_init(&w);
            tera_st_writer_add(&w, "router_bias", TERA_DT_F32, 1, &nb, c->bias);
            snprintf(path, sizeof path, "%s/router_bias.safetensors", c->tmp);
            tera_ckpt_io_point("write", path);
            st = tera_st_writer_save(&w, path);
            if (st == TERA_OK) st = tera_ckpt_fsync_path(path);
            tera_st_writer_free(&w);
        }
        snprintf(path, sizeof path, "%s/state.json", c->tmp);
        if (st == TERA_OK) st = tera_ckpt_write_file(path, c->state_json, strlen(c->state_json));
        snprintf(path, sizeof path, "%s/config.ini", c->tmp);
        if (st == TERA_OK) {
            tera_ckpt_io_point("write", path);
            st = tera_config_write(&tr->cfg, path);
            if (st == TERA_OK) st = tera_ckpt_fsync_path(path);
        }
        if (st == TERA_OK) {
            cJSON *man = sharded_manifest(tr, c->step);
            if (!c->full) { /* the pieces stay those of the base; the data is base + each rank's diff */
                cJSON_ReplaceItemInObject(man, "kind", cJSON_CreateString("diff"));
                cJSON_AddNumberToObject(man, "base_step", (double)c->base_step);
                char bn[64];
                snprintf(bn, sizeof bn, "step_%08" PRId64, c->base_step);
                cJSON_AddStringToObject(man, "base", bn);
            }
            int64_t bytes = 0;
            st = commit_dir_known(man, c->tmp, c->dir, c->root, c->step, &bytes, known, nk);
            if (st == TERA_OK) {
                g_stats.last_write_s = tera_now() - c->t_start;
                g_stats.last_bytes = bytes;
                g_stats.last_full = c->full;
                tera_ckpt_ctx pc = {.cfg = tr->cfg};
                snprintf(pc.run_dir, sizeof pc.run_dir, "%s", tr->run_dir);
                st = prune(&pc);
            }
        }
        free(known);
    }
    free(info);
    return agree(st, "committing the checkpoint");
}

tera_status tera_trainer_save_sharded(tera_trainer *tr) {
    const tera_model *m = &tr->model;
    const int final = tr->step >= tr->cfg.training.steps;
    const double t0 = tera_now();
    TERA_TRY(shard_commit(tr)); /* the previous save, if still open */
    if (!tr->ckpt.shard) {
        tera_shard_ckpt *c = tera_calloc(1, sizeof *c);
        c->win_n = window_floats(&tr->cfg);
        c->win = tera_malloc(sizeof(float) * (size_t)(c->win_n + 2));
        c->cbuf = tera_malloc(TERA_CKPT_CHUNK_BYTES);
        c->bias = tera_calloc((size_t)tera_ckpt_region_floats(m, 3) + 1, sizeof(float));
        snprintf(c->root, sizeof c->root, "%s/checkpoints", tr->run_dir);
        tr->ckpt.shard = c;
    }
    tera_shard_ckpt *c = tr->ckpt.shard;
    snprintf(c->dir, sizeof c->dir, "%s/step_%08" PRId64, c->root, tr->step);
    snprintf(c->tmp, sizeof c->tmp, "%s.tmp", c->dir);
    /* a committed checkpoint of this step that verifies is kept (a resumed, finished run) */
    int64_t have = tr->root && tera_ckpt_committed(c->dir) && tera_ckpt_verify(c->dir, NULL) == TERA_OK;
    tera_comm_allreduce_i64(tera_comm_world(), &have, 1);
    if (have) return final ? tera_trainer_ckpt_close(tr) : TERA_OK;
    memcpy(c->bias, m->router_bias, sizeof(float) * (size_t)tera_ckpt_region_floats(m, 3));
    c->step = tr->step;
    c->t_start = t0;
    free(c->state_json);
    c->state_json = tr->root ? state_text(tr) : NULL;
    c->wrote = 0;
    snprintf(c->file, sizeof c->file, "rank-%05d.safetensors", tera_zero_member(&tr->topo));
    tera_status st = TERA_OK;
    if (tr->root) {
        tera_ckpt_io_point("mkdir", c->root);
        st = tera_mkdirs(c->root);
        if (st == TERA_OK) st = clean_uncommitted(c->root);
        tera_ckpt_io_point("mkdir", c->tmp);
        if (st == TERA_OK) st = tera_mkdirs(c->tmp);
    }
    TERA_TRY(agree(st, "creating the directory"));
    c->pending = 1;
    const tera_ckpt_options opt = tera_ckpt_options_from_config(&tr->cfg);
    /* the final save is full, like the whole-model path's; the others by checkpoint.full_every */
    c->full = save_is_full(final || tr->ckpt.force_full, c->has_base, opt.full_every, c->since_full);
    if (c->full) {
        c->has_base = 1, c->since_full = 0, c->base_step = tr->step;
    } else {
        c->since_full++;
    }
    c->running = 0;
    c->st = shard_stream(tr, c); /* collective: windows gathered over the ranks sharing ZeRO shards */
    if (c->st != TERA_OK) snprintf(c->err, sizeof c->err, "checkpoint step %" PRId64 ": %s", c->step, tera_last_error());
    /* the file's finish in the background (checkpoint.async), committed at the next save or at close */
    c->running = c->st == TERA_OK && opt.async && !final && pthread_create(&c->th, NULL, shard_finish_main, c) == 0;
    record_pause(tera_now() - t0, c->full);
    if (c->running) return TERA_OK;
    shard_finish_main(c);
    st = shard_commit(tr);
    if (final) {
        if (tr->root && tr->cfg.logging.progress)
            fprintf(stderr, "tera: checkpoints: %d sharded saves (%d full), step-loop pause mean %.2f ms, max %.2f ms; "
                    "last write %.3f s, %" PRId64 " bytes; writer window %.1f MiB per rank\n", g_stats.saves,
                    g_stats.full_saves, 1e3 * g_stats.total_pause_s / g_stats.saves, 1e3 * g_stats.max_pause_s,
                    g_stats.last_write_s, g_stats.last_bytes, (double)tera_ckpt_writer_buffer_bytes(&tr->cfg) / (1 << 20));
        tera_status s2 = tera_trainer_ckpt_close(tr);
        if (st == TERA_OK) st = s2;
    }
    return st;
}
