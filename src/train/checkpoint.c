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
#include "tera/train.h"

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
    int64_t total = 0;
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) total += c->reg_n[r] = tera_ckpt_region_floats(m, r);
    c->snap = tera_calloc((size_t)total + 1, sizeof(float));
    float *p = c->snap;
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) {
        c->reg[r] = p;
        p += c->reg_n[r];
    }
    c->shadow = *m;
    c->shadow.params = c->params;
    c->shadow.w = c->reg[0];
    c->shadow.g = NULL;
    c->shadow.router_bias = c->reg_n[3] ? c->reg[3] : NULL;
    return c;
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
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) free(c->base_hash[r]);
    free(c);
}

static tera_status shard_commit(tera_trainer *tr);
static void shard_free(tera_trainer *tr);

tera_status tera_trainer_ckpt_close(tera_trainer *tr) {
    tera_status s = ctx_wait(tr->ckpt);
    ctx_free(tr->ckpt);
    tr->ckpt = NULL;
    if (tr->shard_ckpt) { /* sharded: commit the open save (collective), then free */
        tera_status s2 = shard_commit(tr);
        if (s == TERA_OK) s = s2;
        shard_free(tr);
    }
    return s;
}

/* ------------------------------------------------------------------ state.json */

static cJSON *int_array(int n, const int64_t *v);

/* Doubles that must round-trip exactly (cJSON prints 15 digits when they are merely close). */
static cJSON *exact_number(double v) {
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", v);
    return cJSON_CreateString(buf);
}

static int read_exact(const cJSON *it, double *v) {
    if (!cJSON_IsString(it)) return 0;
    char *end;
    *v = strtod(it->valuestring, &end);
    return end != it->valuestring && *end == 0;
}

/* The dynamic batch size and the loss-spike guard: what a resumed run needs to take the same
 * batch sizes, skip the same data windows, keep the LR cut and judge spikes against the same window. */
static void state_dynamic(cJSON *root, const tera_trainer *tr) {
    const tera_train_config *t = &tr->cfg.training;
    cJSON *b = cJSON_AddObjectToObject(root, "batch");
    const int a = tera_batch_accum(t, &tr->batch, tr->step);
    cJSON_AddNumberToObject(b, "accum", a); /* of the next step (informative: it follows from the rest) */
    cJSON_AddNumberToObject(b, "sequences", (double)a * t->micro_batch * tr->world);
    cJSON_AddNumberToObject(b, "grow", tr->batch.grow);
    cJSON_AddNumberToObject(b, "grow_window_n", tr->batch.window_n);
    cJSON_AddItemToObject(b, "grow_window_sum", exact_number(tr->batch.window_sum));
    cJSON *g = cJSON_AddObjectToObject(root, "spike_guard");
    cJSON_AddNumberToObject(g, "lr_cut_until", (double)tr->lr_cut_until);
    cJSON *sk = cJSON_AddArrayToObject(g, "skip_windows");
    for (int i = 0; i < tr->n_skips; i++) {
        int64_t w[2] = {tr->skip_lo[i], tr->skip_hi[i]};
        cJSON_AddItemToArray(sk, int_array(2, w));
    }
    cJSON_AddNumberToObject(g, "events", (double)tr->spike_events);
    cJSON_AddNumberToObject(g, "last_spike_step", (double)tr->last_spike_step);
    cJSON_AddNumberToObject(g, "repeats", tr->spike_repeats);
    const int W = t->spike_window;
    cJSON_AddNumberToObject(g, "window", W);
    cJSON_AddNumberToObject(g, "n", tr->spike_n);
    cJSON_AddNumberToObject(g, "pos", tr->spike_pos);
    cJSON *l = cJSON_AddArrayToObject(g, "loss"), *gn = cJSON_AddArrayToObject(g, "grad_norm");
    for (int i = 0; i < tr->spike_n && i < W; i++) {
        cJSON_AddItemToArray(l, exact_number(tr->spike_hist[i]));
        cJSON_AddItemToArray(gn, exact_number(tr->spike_hist[W + i]));
    }
}

static int json_i64(const cJSON *o, const char *name, int64_t *v) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!cJSON_IsNumber(it)) return 0;
    *v = (int64_t)it->valuedouble;
    return 1;
}

/* Restores state_dynamic's fields (absent in older checkpoints: growth off, guard unchanged).
 * Guard knowledge newer than the checkpoint (a rollback in this process) is kept: the skip windows
 * are merged, the LR cut and the event count take the later value. */
static tera_status read_dynamic(tera_trainer *tr, const cJSON *root, const char *path) {
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(root, "batch");
    tera_batch_init(&tr->batch);
    if (cJSON_IsObject(b)) {
        int64_t grow, n;
        double sum;
        if (!json_i64(b, "grow", &grow) || grow < 1 || grow > (1 << 30) || (grow & (grow - 1)) ||
            !json_i64(b, "grow_window_n", &n) || n < 0 || n > INT32_MAX ||
            !read_exact(cJSON_GetObjectItemCaseSensitive(b, "grow_window_sum"), &sum))
            return tera_fail(TERA_ERR_FORMAT, "%s: \"batch\" needs grow (a power of 2), grow_window_n >= 0 and "
                                              "grow_window_sum (a number as a string)", path);
        tr->batch.grow = (int)grow, tr->batch.window_n = (int)n, tr->batch.window_sum = sum;
    }
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(root, "spike_guard");
    if (!cJSON_IsObject(g)) return TERA_OK;
    int64_t cut, events, last, rep, W, n, pos;
    const cJSON *sk = cJSON_GetObjectItemCaseSensitive(g, "skip_windows");
    const cJSON *l = cJSON_GetObjectItemCaseSensitive(g, "loss"), *gn = cJSON_GetObjectItemCaseSensitive(g, "grad_norm");
    if (!json_i64(g, "lr_cut_until", &cut) || !json_i64(g, "events", &events) || !json_i64(g, "last_spike_step", &last) ||
        !json_i64(g, "repeats", &rep) || !json_i64(g, "window", &W) || !json_i64(g, "n", &n) || !json_i64(g, "pos", &pos) ||
        !cJSON_IsArray(sk) || !cJSON_IsArray(l) || !cJSON_IsArray(gn) || n < 0 || n > W ||
        (W > 0 && (pos < 0 || pos >= W)) || cJSON_GetArraySize(l) != n || cJSON_GetArraySize(gn) != n)
        return tera_fail(TERA_ERR_FORMAT, "%s: \"spike_guard\" is incomplete or inconsistent", path);
    if (cut > tr->lr_cut_until) tr->lr_cut_until = cut;
    if (events > tr->spike_events) tr->spike_events = events;
    if (last > tr->last_spike_step) tr->last_spike_step = last, tr->spike_repeats = (int)rep;
    const cJSON *w;
    cJSON_ArrayForEach(w, sk) {
        const cJSON *lo = cJSON_GetArrayItem(w, 0), *hi = cJSON_GetArrayItem(w, 1);
        if (!cJSON_IsArray(w) || !cJSON_IsNumber(lo) || !cJSON_IsNumber(hi) || hi->valuedouble <= lo->valuedouble)
            return tera_fail(TERA_ERR_FORMAT, "%s: \"spike_guard.skip_windows\" holds a bad [lo, hi) pair", path);
        const int64_t a = (int64_t)lo->valuedouble, e = (int64_t)hi->valuedouble;
        int at = 0, dup = 0;
        while (at < tr->n_skips && tr->skip_lo[at] <= a) dup |= tr->skip_lo[at] == a && tr->skip_hi[at] == e, at++;
        if (dup || tr->n_skips >= 64) continue;
        for (int i = tr->n_skips; i > at; i--) tr->skip_lo[i] = tr->skip_lo[i - 1], tr->skip_hi[i] = tr->skip_hi[i - 1];
        tr->skip_lo[at] = a, tr->skip_hi[at] = e; /* kept in increasing order: the step jumps them in turn */
        tr->n_skips++;
    }
    /* the window of recent healthy steps, when this run's window has the checkpoint's length */
    tr->spike_n = tr->spike_pos = 0;
    if (W != tr->cfg.training.spike_window) return TERA_OK;
    for (int i = 0; i < n; i++)
        if (!read_exact(cJSON_GetArrayItem(l, i), &tr->spike_hist[i]) ||
            !read_exact(cJSON_GetArrayItem(gn, i), &tr->spike_hist[W + i]))
            return tera_fail(TERA_ERR_FORMAT, "%s: \"spike_guard\" window entry %d is not a number string", path, i);
    tr->spike_n = (int)n, tr->spike_pos = (int)pos;
    return TERA_OK;
}

static char *state_text(const tera_trainer *tr) {
    const tera_loader *l = &tr->loader;
    cJSON *root = cJSON_CreateObject(), *data = cJSON_CreateObject();
    cJSON_AddNumberToObject(root, "format_version", TERA_CKPT_FORMAT_VERSION);
    cJSON_AddNumberToObject(root, "step", (double)tr->step);
    cJSON_AddNumberToObject(root, "adam_t", (double)tr->opt.t);
    cJSON_AddNumberToObject(root, "seed", (double)tr->cfg.training.seed);
    cJSON_AddNumberToObject(root, "skipped_steps", (double)tr->skipped_steps);
    if (tr->precision == TERA_PREC_FP16) { /* the dynamic loss scaler, restored exactly on resume */
        cJSON *sc = cJSON_AddObjectToObject(root, "loss_scaler");
        cJSON_AddNumberToObject(sc, "scale", (double)tr->scaler.scale);
        cJSON_AddNumberToObject(sc, "good_steps", (double)tr->scaler.good_steps);
        cJSON_AddNumberToObject(sc, "overflows", (double)tr->scaler.overflows);
    }
    cJSON_AddItemToObject(root, "data", data);
    cJSON_AddStringToObject(data, "path", tr->cfg.data.path[0] ? tr->cfg.data.path : "(embedded corpus)");
    cJSON_AddNumberToObject(data, "n_tokens", (double)tr->src.n_tokens);
    cJSON_AddNumberToObject(data, "seq_len", l->T);
    cJSON_AddNumberToObject(data, "n_train", (double)l->n_train);
    cJSON_AddBoolToObject(data, "shuffle", l->shuffle);
    cJSON_AddNumberToObject(data, "samples_consumed", (double)tr->samples_consumed);
    cJSON_AddNumberToObject(data, "epoch", (double)(tr->samples_consumed / l->n_train));
    cJSON_AddNumberToObject(data, "offset_in_epoch", (double)(tr->samples_consumed % l->n_train));
    state_dynamic(root, tr);
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    return text;
}

/* Reads state.json and checks that the current data is the stream the checkpoint was reading. */
static tera_status read_state(tera_trainer *tr, const char *path) {
    char *text;
    TERA_TRY(tera_read_text_file(path, &text));
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root) return tera_fail(TERA_ERR_FORMAT, "%s: not valid JSON", path);
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(root, "data");
    const char *fields[] = {"step", "adam_t", "seed"};
    double v[3];
    for (int i = 0; i < 3; i++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, fields[i]);
        if (!cJSON_IsNumber(it)) {
            cJSON_Delete(root);
            return tera_fail(TERA_ERR_FORMAT, "%s: \"%s\" is missing or not a number", path, fields[i]);
        }
        v[i] = it->valuedouble;
    }
    const char *dfields[] = {"n_tokens", "seq_len", "n_train", "samples_consumed"};
    double d[4];
    for (int i = 0; i < 4; i++) {
        const cJSON *it = cJSON_IsObject(data) ? cJSON_GetObjectItemCaseSensitive(data, dfields[i]) : NULL;
        if (!cJSON_IsNumber(it)) {
            cJSON_Delete(root);
            return tera_fail(TERA_ERR_FORMAT, "%s: \"data.%s\" is missing or not a number", path, dfields[i]);
        }
        d[i] = it->valuedouble;
    }
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(data, "shuffle");
    const int shuffle = cJSON_IsTrue(sh);
    const cJSON *sk = cJSON_GetObjectItemCaseSensitive(root, "skipped_steps");
    const int64_t skipped = cJSON_IsNumber(sk) ? (int64_t)sk->valuedouble : 0;
    /* fp16: the scaler's state when the checkpoint has one (else the configured initial scale) */
    const cJSON *sc = cJSON_GetObjectItemCaseSensitive(root, "loss_scaler");
    const cJSON *sc_scale = cJSON_GetObjectItemCaseSensitive(sc, "scale");
    const cJSON *sc_good = cJSON_GetObjectItemCaseSensitive(sc, "good_steps");
    const cJSON *sc_over = cJSON_GetObjectItemCaseSensitive(sc, "overflows");
    tera_loss_scaler scaler = tr->scaler;
    if (tr->precision == TERA_PREC_FP16 && cJSON_IsNumber(sc_scale)) {
        if (!(sc_scale->valuedouble >= TERA_LOSS_SCALE_MIN && sc_scale->valuedouble <= TERA_LOSS_SCALE_MAX)) {
                    return tera_fail(TERA_ERR_FORMAT, "%s: \"loss_scaler.scale\" = %g is outside [%g, %g]", path,
                             sc_scale->valuedouble, (double)TERA_LOSS_SCALE_MIN, (double)TERA_LOSS_SCALE_MAX);
        }
        scaler.scale = (float)sc_scale->valuedouble;
        scaler.good_steps = cJSON_IsNumber(sc_good) ? (int64_t)sc_good->valuedouble : 0;
        scaler.overflows = cJSON_IsNumber(sc_over) ? (int64_t)sc_over->valuedouble : 0;
    }
    const tera_loader *l = &tr->loader;
    if ((int64_t)d[0] != tr->src.n_tokens || (int)d[1] != l->T || (int64_t)d[2] != l->n_train ||
        shuffle != l->shuffle || (uint64_t)v[2] != tr->cfg.training.seed) {
        cJSON_Delete(root);
        return tera_fail(TERA_ERR_CONFIG,
                         "--resume: %s was reading other data (%ld tokens, seq_len %d, %ld training samples, "
                         "shuffle %d, seed %lu) than this run (%ld, %d, %ld, %d, %lu): resuming would not "
                         "continue the same sample stream",
                         path, (long)d[0], (int)d[1], (long)d[2], shuffle, (unsigned long)v[2],
                         (long)tr->src.n_tokens, l->T, (long)l->n_train, l->shuffle,
                         (unsigned long)tr->cfg.training.seed);
    }
    const tera_status st = read_dynamic(tr, root, path);
    cJSON_Delete(root);
    TERA_TRY(st);
    tr->step = (int64_t)v[0];
    tr->opt.t = (int64_t)v[1];
    tr->samples_consumed = (int64_t)d[3];
    tr->skipped_steps = skipped;
    tr->scaler = scaler;
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
        b->buf = realloc(b->buf, cap);
        TERA_ASSERT(b->buf != NULL);
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
static tera_status clean_uncommitted(const char *root) {
    tera_ckpt_info *v;
    int n;
    TERA_TRY(tera_ckpt_list(root, &v, &n));
    char path[TERA_PATH_MAX + 128];
    tera_status s = TERA_OK;
    for (int i = 0; i < n && s == TERA_OK; i++) {
        if (v[i].committed) continue;
        snprintf(path, sizeof path, "%s/%s", root, v[i].name);
        s = tera_ckpt_rmtree(path);
    }
    free(v);
    return s;
}

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
    if (s == TERA_OK) {
        snprintf(path, sizeof path, "%s/state.json", tmp);
        s = tera_ckpt_write_file(path, c->state_json, strlen(c->state_json));
    }
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
        hex64(hx, tera_ckpt_region_hash(&c->shadow, r, c->reg[r]));
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

static void *writer_main(void *arg) {
    tera_ckpt_ctx *c = arg;
    c->st = write_checkpoint(c);
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

/* Copies the training state into the snapshot buffers (the pause the step loop sees). */
static void snapshot(tera_ckpt_ctx *c, const tera_trainer *tr) {
    const float *src[TERA_CKPT_N_REGIONS] = {tr->model.w, tr->opt.m, tr->opt.v, tr->model.router_bias};
    const int64_t BLK = 1 << 18; /* 1 MiB of floats per task */
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) {
        const int64_t n = c->reg_n[r];
        if (!n) continue;
        const int64_t nb = (n + BLK - 1) / BLK;
        float *dst = c->reg[r];
        const float *s = src[r];
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t lo = b * BLK, hi = lo + BLK < n ? lo + BLK : n;
            memcpy(dst + lo, s + lo, sizeof(float) * (size_t)(hi - lo));
        }
    }
    c->step = tr->step;
    free(c->state_json);
    c->state_json = state_text(tr);
}

tera_status tera_trainer_save_whole(tera_trainer *tr) {
    if (!tr->run_dir[0]) return TERA_OK;
    const int final = tr->step >= tr->cfg.training.steps;
    if (!tr->ckpt) tr->ckpt = ctx_create(tr);
    tera_ckpt_ctx *c = tr->ckpt;
    const double t0 = tera_now();
    tera_status s = ctx_wait(c); /* the previous write must be complete */
    const double t_wait = tera_now() - t0;
    char dir[TERA_PATH_MAX + 64];
    snprintf(dir, sizeof dir, "%s/checkpoints/step_%08ld", tr->run_dir, (long)tr->step);
    /* a committed checkpoint of this step that verifies is kept (a resumed, finished run) */
    if (s == TERA_OK && !(tera_ckpt_committed(dir) && tera_ckpt_verify(dir, NULL) == TERA_OK)) {
        /* the final save is always full, so a finished run ends with a Hugging Face directory */
        c->full = save_is_full(final, c->has_base, c->opt.full_every, c->since_full);
        const double t1 = tera_now();
        snapshot(c, tr);
        record_pause(tera_now() - t1 + t_wait, c->full);
        if (c->opt.async && !final) {
            c->running = 1;
            if (pthread_create(&c->th, NULL, writer_main, c) != 0) {
                c->running = 0;
                s = write_checkpoint(c);
            }
        } else {
            s = write_checkpoint(c);
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

tera_status tera_trainer_resume_dir(tera_trainer *tr, const char *dir) {
    char path[TERA_PATH_MAX + 128];
    /* the checkpoint holds the whole model: load it, keep this rank's part (its experts, its
     * ZeRO-1 shards of the moments) */
    tera_model shell;
    tera_layout_global_shell(tr, &shell);
    const int64_t n = shell.n_floats;
    float *buf = tera_calloc((size_t)(3 * n + 1), sizeof(float));
    shell.w = buf;
    tera_status st = tera_ckpt_load(dir, &shell, buf + n, buf + 2 * n);
    if (st == TERA_OK) tera_layout_scatter(tr, buf, buf + n, buf + 2 * n);
    free(buf);
    free(shell.params);
    TERA_TRY(st);
    snprintf(path, sizeof path, "%s/state.json", dir);
    TERA_TRY(read_state(tr, path));
    tr->opt_x.t = tr->opt.t;
    return TERA_OK;
}

tera_status tera_trainer_resume(tera_trainer *tr) {
    char dir[TERA_PATH_MAX + 64], path[TERA_PATH_MAX + 64];
    TERA_TRY(tera_ckpt_find_latest(tr->run_dir, dir, sizeof dir));
    TERA_TRY(tera_trainer_resume_dir(tr, dir));
    /* every check passed: only now is the run directory written (a refused --resume leaves it as
     * it was): the configuration of the continued run, and metrics.jsonl cut back to its last
     * complete line (a crash or a full disk can leave half a line) before appending */
    tera_status st = TERA_OK;
    if (tr->root) {
        st = tera_ckpt_write_run_config(&tr->cfg, tr->run_dir);
        long dropped = 0;
        snprintf(path, sizeof path, "%s/metrics.jsonl", tr->run_dir);
        if (st == TERA_OK) st = tera_jsonl_repair(path, &dropped);
        if (st == TERA_OK && dropped > 0)
            fprintf(stderr, "tera: warning: %s: removed an incomplete last line (%ld bytes) before appending\n", path,
                    dropped);
        if (st == TERA_OK) st = tera_trainer_open_metrics(tr, "a");
    }
    if (tr->wsize > 1) { /* every rank learns whether rank 0 could write */
        int64_t failed = st != TERA_OK;
        tera_comm_allreduce_i64(tera_comm_world(), &failed, 1);
        if (failed && st == TERA_OK) st = tera_fail(TERA_ERR_IO, "--resume: writing the run directory failed on rank 0");
    }
    return st;
}

/* ------------------------------------------------------------------ sharded checkpoints
 * checkpoint.sharded with several ranks: no rank gathers the model. Every element of the model is
 * written by exactly one rank (tera_layout_writes: the first expert-data-parallel replica, the
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
    cJSON_AddNumberToObject(lay, "world_size", tr->wsize);
    cJSON_AddNumberToObject(lay, "dp", tr->cfg.parallel.dp);
    cJSON_AddNumberToObject(lay, "tp", tr->tp);
    cJSON_AddNumberToObject(lay, "pp", tr->pp);
    cJSON_AddNumberToObject(lay, "ep", tr->ep);
    cJSON_AddNumberToObject(lay, "zero", tr->cfg.parallel.zero);
    tera_model shell;
    tera_layout_global_shell(tr, &shell);
    const int P = tr->ep * tr->tp * tr->pp;
    tera_param **tab = tera_calloc((size_t)P, sizeof(tera_param *));
    for (int r = 0; r < P; r++) tab[r] = tera_layout_member_table(tr, r, NULL);
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
            if (!tera_layout_member_writes(tr, r, p)) continue;
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

/* The sharded writer's state: the snapshot (this rank's whole storage), the step's scalar state,
 * and the background write of this rank's file, committed at the next save (or at close). */
struct tera_shard_ckpt {
    float *buf;                 /* [3 n]: parameters, exp_avg, exp_avg_sq (this rank's layout) */
    float *bias;                /* [L E] router bias (world rank 0) */
    int64_t n;
    char root[TERA_PATH_MAX + 32], dir[TERA_PATH_MAX + 64], tmp[TERA_PATH_MAX + 96];
    int64_t step;
    char *state_json;           /* world rank 0 */
    int pending;                /* written (or being written), not committed */
    pthread_t th;
    int running;
    tera_status st;
    char err[1024];
    int wrote;                  /* this rank has a file */
    char file[64];
    int64_t size;
    uint64_t hash;
    const tera_trainer *tr;     /* for the writer thread: the table (read only) */
    double t_start;
    /* differential saves (checkpoint.full_every): this rank's buffer = its written blocks, in
     * table order, each as parameters, exp_avg, exp_avg_sq; chunk hashes of the last full save */
    int full, has_base, since_full;
    int64_t base_step;
    float *sb;                  /* [3 n] at most */
    int64_t sb_n;
    uint64_t *base_hash;
    int64_t n_chunks;
    int64_t changed, total;     /* chunks of the last differential save */
};

static void shard_free(tera_trainer *tr) {
    tera_shard_ckpt *c = tr->shard_ckpt;
    free(c->buf);
    free(c->bias);
    free(c->state_json);
    free(c->sb);
    free(c->base_hash);
    free(c);
    tr->shard_ckpt = NULL;
}

/* Differential: the changed 64 KiB chunks of this rank's buffer since its last full save, zstd,
 * in the TERADIF1 format with one region (tera_ckpt_apply_diff_sized). */
static tera_status shard_write_diff(tera_shard_ckpt *c, const char *path) {
    const size_t CH = TERA_CKPT_CHUNK_BYTES, bytes = sizeof(float) * (size_t)c->sb_n, bound = ZSTD_compressBound(CH);
    const int64_t nc = (int64_t)((bytes + CH - 1) / CH);
    ZSTD_CCtx *z = ZSTD_createCCtx();
    uint8_t *tmp = tera_malloc(bound);
    strbuf out = {0};
    uint32_t nrec = 0;
    sb_put(&out, "TERADIF1", 8);
    sb_put(&out, &nrec, 4);
    const uint8_t *p = (const uint8_t *)c->sb;
    c->changed = 0;
    c->total = nc;
    for (int64_t k = 0; k < nc; k++) {
        const size_t off = (size_t)k * CH, len = bytes - off < CH ? bytes - off : CH;
        if (k < c->n_chunks && XXH3_64bits(p + off, len) == c->base_hash[k]) continue;
        const size_t cs = ZSTD_compressCCtx(z, tmp, bound, p + off, len, 1);
        TERA_ASSERT(!ZSTD_isError(cs));
        const uint32_t region = 0, raw = (uint32_t)len, cc = (uint32_t)cs;
        const uint64_t o = off;
        sb_put(&out, &region, 4);
        sb_put(&out, &raw, 4);
        sb_put(&out, &o, 8);
        sb_put(&out, &cc, 4);
        sb_put(&out, tmp, cs);
        nrec++;
        c->changed++;
    }
    memcpy(out.buf + 8, &nrec, 4);
    tera_status st = tera_ckpt_write_file(path, out.buf, (size_t)out.n);
    free(out.buf);
    free(tmp);
    ZSTD_freeCCtx(z);
    return st;
}

static void shard_base_hashes(tera_shard_ckpt *c) {
    const size_t CH = TERA_CKPT_CHUNK_BYTES, bytes = sizeof(float) * (size_t)c->sb_n;
    c->n_chunks = (int64_t)((bytes + CH - 1) / CH);
    free(c->base_hash);
    c->base_hash = tera_malloc(sizeof(uint64_t) * (size_t)(c->n_chunks + 1));
    const uint8_t *p = (const uint8_t *)c->sb;
    for (int64_t k = 0; k < c->n_chunks; k++) {
        const size_t off = (size_t)k * CH, len = bytes - off < CH ? bytes - off : CH;
        c->base_hash[k] = XXH3_64bits(p + off, len);
    }
}

static void *shard_writer_main(void *arg) {
    tera_shard_ckpt *c = arg;
    const tera_trainer *tr = c->tr;
    const tera_model *m = &tr->model;
    const int64_t n = c->n;
    const float *src[3] = {c->buf, c->buf + n, c->buf + 2 * n};
    tera_st_writer w;
    tera_st_writer_init(&w);
    char (*nm)[3][16] = tera_calloc((size_t)m->n_params + 1, sizeof *nm); /* keys, alive until the save */
    int any = 0;
    c->sb_n = 0;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        if (!tera_layout_writes(tr, p)) continue;
        any = 1;
        static const char prefix[3] = {'w', 'm', 'v'};
        for (int k = 0; k < 3; k++) {
            snprintf(nm[i][k], sizeof nm[i][k], "%c.%d", prefix[k], i);
            tera_st_writer_add(&w, nm[i][k], TERA_DT_F32, p->ndim, p->len, src[k] + p->offset);
            memcpy(c->sb + c->sb_n, src[k] + p->offset, sizeof(float) * (size_t)p->numel);
            c->sb_n += p->numel;
        }
    }
    c->st = TERA_OK;
    if (any) {
        char path[TERA_PATH_MAX + 200];
        if (c->full) {
            snprintf(path, sizeof path, "%s/%s", c->tmp, c->file);
            tera_ckpt_io_point("write", path);
            c->st = tera_st_writer_save(&w, path);
            if (c->st == TERA_OK) c->st = tera_ckpt_fsync_path(path);
            if (c->st == TERA_OK) shard_base_hashes(c);
        } else {
            snprintf(path, sizeof path, "%s/%.*s.diff", c->tmp, (int)(strlen(c->file) - strlen(".safetensors")), c->file);
            tera_ckpt_io_point("write", path);
            c->st = shard_write_diff(c, path);
        }
        if (c->st == TERA_OK) c->st = tera_ckpt_hash_file(path, &c->hash, &c->size);
        c->wrote = c->st == TERA_OK;
    }
    tera_st_writer_free(&w);
    free(nm);
    if (c->st != TERA_OK) snprintf(c->err, sizeof c->err, "checkpoint step %" PRId64 ": %s", c->step, tera_last_error());
    return NULL;
}

/* Waits for this rank's write of the pending checkpoint, then commits it: the ranks agree, world
 * rank 0 writes its files, the manifest and COMMIT (with every rank's file size and hash), renames
 * the directory. Collective. */
static tera_status shard_commit(tera_trainer *tr) {
    tera_shard_ckpt *c = tr->shard_ckpt;
    if (!c || !c->pending) return TERA_OK;
    if (c->running) pthread_join(c->th, NULL);
    c->running = 0;
    c->pending = 0;
    tera_status st = c->st;
    if (st != TERA_OK) st = tera_fail(st, "%s", c->err);
    /* every rank's file: size and hash, to rank 0 (one slot per world rank) */
    const int W = tr->wsize;
    int64_t *info = tera_calloc((size_t)(3 * W), sizeof(int64_t));
    if (c->wrote) {
        const int me = tera_layout_member(tr);
        info[3 * tr->wrank] = me + 1;
        info[3 * tr->wrank + 1] = c->size;
        memcpy(&info[3 * tr->wrank + 2], &c->hash, sizeof c->hash);
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
    const int64_t n = m->n_floats;
    const int final = tr->step >= tr->cfg.training.steps;
    const double t0 = tera_now();
    TERA_TRY(shard_commit(tr)); /* the previous save, if still open */
    const double t_wait = tera_now() - t0;
    if (!tr->shard_ckpt) {
        tera_shard_ckpt *c = tera_calloc(1, sizeof *c);
        c->n = n;
        c->buf = tera_calloc((size_t)(3 * n + 1), sizeof(float));
        c->bias = tera_calloc((size_t)tera_ckpt_region_floats(m, 3) + 1, sizeof(float));
        c->sb = tera_calloc((size_t)(3 * n + 1), sizeof(float));
        snprintf(c->root, sizeof c->root, "%s/checkpoints", tr->run_dir);
        tr->shard_ckpt = c;
    }
    tera_shard_ckpt *c = tr->shard_ckpt;
    snprintf(c->dir, sizeof c->dir, "%s/step_%08" PRId64, c->root, tr->step);
    snprintf(c->tmp, sizeof c->tmp, "%s.tmp", c->dir);
    /* a committed checkpoint of this step that verifies is kept (a resumed, finished run) */
    int64_t have = tr->root && tera_ckpt_committed(c->dir) && tera_ckpt_verify(c->dir, NULL) == TERA_OK;
    tera_comm_allreduce_i64(tera_comm_world(), &have, 1);
    if (have) return final ? tera_trainer_ckpt_close(tr) : TERA_OK;
    /* the snapshot: the step loop goes on once it is taken */
    const double t1 = tera_now();
    tera_layout_local_state(tr, c->buf, c->buf + n, c->buf + 2 * n); /* collective: ZeRO shards gathered */
    memcpy(c->bias, m->router_bias, sizeof(float) * (size_t)tera_ckpt_region_floats(m, 3));
    c->step = tr->step;
    c->t_start = t1;
    free(c->state_json);
    c->state_json = tr->root ? state_text(tr) : NULL;
    c->tr = tr;
    c->wrote = 0;
    snprintf(c->file, sizeof c->file, "rank-%05d.safetensors", tera_layout_member(tr));
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
    c->full = save_is_full(final, c->has_base, opt.full_every, c->since_full);
    if (c->full) {
        c->has_base = 1, c->since_full = 0, c->base_step = tr->step;
    } else {
        c->since_full++;
    }
    c->running = opt.async && !final && pthread_create(&c->th, NULL, shard_writer_main, c) == 0;
    record_pause(tera_now() - t1 + t_wait, c->full);
    if (c->running) return TERA_OK;
    shard_writer_main(c); /* synchronous: the final save, or async off */
    st = shard_commit(tr);
    if (final) {
        if (tr->root && tr->cfg.logging.progress)
            fprintf(stderr, "tera: checkpoints: %d sharded saves (%d full), step-loop pause mean %.2f ms, max %.2f ms; "
                    "last write %.3f s, %" PRId64 " bytes\n", g_stats.saves, g_stats.full_saves,
                    1e3 * g_stats.total_pause_s / g_stats.saves,
                    1e3 * g_stats.max_pause_s, g_stats.last_write_s, g_stats.last_bytes);
        tera_status s2 = tera_trainer_ckpt_close(tr);
        if (st == TERA_OK) st = s2;
    }
    return st;
}
