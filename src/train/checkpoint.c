/* Checkpoints of a training run: save (atomic directory per step, retention) and exact resume.
 *
 * Layout of RUN/checkpoints/step_NNNNNNNN/: a Hugging Face directory (config.json +
 * model.safetensors, router bias included), optimizer.safetensors (Adam moments by parameter index),
 * state.json (step, Adam step count, seed, data position in samples), config.ini (the resolved run
 * configuration). Written under step_NNNNNNNN.tmp and renamed when complete. */
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "tera/hf.h"
#include "tera/io.h"
#include "tera/safetensors.h"
#include "tera/train.h"

/* ------------------------------------------------------------------ checkpoints (simple, full) */

static tera_status prune_checkpoints(const tera_trainer *tr);

/* The training state besides tensors: step and data position (in samples, so a resumed run with
 * another batch size or data-parallel degree reads the same samples next). */
static tera_status write_state(const tera_trainer *tr, const char *path) {
    const tera_loader *l = &tr->loader;
    cJSON *root = cJSON_CreateObject(), *data = cJSON_CreateObject();
    cJSON_AddNumberToObject(root, "format_version", 1);
    cJSON_AddNumberToObject(root, "step", (double)tr->step);
    cJSON_AddNumberToObject(root, "adam_t", (double)tr->opt.t);
    cJSON_AddNumberToObject(root, "seed", (double)tr->cfg.training.seed);
    cJSON_AddItemToObject(root, "data", data);
    cJSON_AddStringToObject(data, "path", tr->cfg.data.path[0] ? tr->cfg.data.path : "(embedded corpus)");
    cJSON_AddNumberToObject(data, "n_tokens", (double)tr->src.n_tokens);
    cJSON_AddNumberToObject(data, "seq_len", l->T);
    cJSON_AddNumberToObject(data, "n_train", (double)l->n_train);
    cJSON_AddBoolToObject(data, "shuffle", l->shuffle);
    cJSON_AddNumberToObject(data, "samples_consumed", (double)tr->samples_consumed);
    cJSON_AddNumberToObject(data, "epoch", (double)(tr->samples_consumed / l->n_train));
    cJSON_AddNumberToObject(data, "offset_in_epoch", (double)(tr->samples_consumed % l->n_train));
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    FILE *f = fopen(path, "w");
    if (!f) {
        free(text);
        return tera_fail(TERA_ERR_IO, "cannot write '%s': %s", path, strerror(errno));
    }
    int bad = fputs(text, f) < 0;
    bad |= fputc('\n', f) == EOF;
    bad |= fclose(f) != 0;
    free(text);
    if (bad) return tera_fail(TERA_ERR_IO, "cannot write '%s'", path);
    return TERA_OK;
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
    cJSON_Delete(root);
    const tera_loader *l = &tr->loader;
    if ((int64_t)d[0] != tr->src.n_tokens || (int)d[1] != l->T || (int64_t)d[2] != l->n_train ||
        shuffle != l->shuffle || (uint64_t)v[2] != tr->cfg.training.seed)
        return tera_fail(TERA_ERR_CONFIG,
                         "--resume: %s was reading other data (%ld tokens, seq_len %d, %ld training samples, "
                         "shuffle %d, seed %lu) than this run (%ld, %d, %ld, %d, %lu): resuming would not "
                         "continue the same sample stream",
                         path, (long)d[0], (int)d[1], (long)d[2], shuffle, (unsigned long)v[2],
                         (long)tr->src.n_tokens, l->T, (long)l->n_train, l->shuffle,
                         (unsigned long)tr->cfg.training.seed);
    tr->step = (int64_t)v[0];
    tr->opt.t = (int64_t)v[1];
    tr->samples_consumed = (int64_t)d[3];
    return TERA_OK;
}

tera_status tera_trainer_save(tera_trainer *tr) {
    if (!tr->run_dir[0]) return TERA_OK;
    char dir[TERA_PATH_MAX + 64], tmp[TERA_PATH_MAX + 96], path[TERA_PATH_MAX + 128];
    snprintf(dir, sizeof dir, "%s/checkpoints/step_%08ld", tr->run_dir, (long)tr->step);
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    struct stat sb;
    if (stat(dir, &sb) == 0) return TERA_OK; /* this step is already saved (e.g. a resumed, finished run) */
    TERA_TRY(tera_mkdirs(tmp));
    TERA_TRY(tera_hf_export(&tr->model, tmp, tr->cfg.checkpoint.max_shard_bytes, 1));
    /* optimizer moments, by parameter name */
    tera_st_writer w;
    tera_st_writer_init(&w);
    char nm[160];
    for (int i = 0; i < tr->model.n_params; i++) {
        const tera_param *p = &tr->model.params[i];
        snprintf(nm, sizeof nm, "exp_avg.%d", i);
        tera_st_writer_add(&w, nm, TERA_DT_F32, p->ndim, p->shape, tr->opt.m + p->offset);
        snprintf(nm, sizeof nm, "exp_avg_sq.%d", i);
        tera_st_writer_add(&w, nm, TERA_DT_F32, p->ndim, p->shape, tr->opt.v + p->offset);
    }
    snprintf(path, sizeof path, "%s/optimizer.safetensors", tmp);
    tera_status st = tera_st_writer_save(&w, path);
    tera_st_writer_free(&w);
    if (st != TERA_OK) return st;
    snprintf(path, sizeof path, "%s/config.ini", tmp);
    TERA_TRY(tera_config_write(&tr->cfg, path));
    snprintf(path, sizeof path, "%s/state.json", tmp);
    TERA_TRY(write_state(tr, path));
    /* commit: rename the finished directory into place */
    if (rename(tmp, dir) != 0)
        return tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, dir, strerror(errno));
    return prune_checkpoints(tr);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static int cmp_long(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

/* Retention: keep the newest checkpoint.keep complete checkpoints (0 = keep all). */
static tera_status prune_checkpoints(const tera_trainer *tr) {
    const int keep = tr->cfg.checkpoint.keep;
    if (keep <= 0) return TERA_OK;
    char cdir[TERA_PATH_MAX + 32], path[TERA_PATH_MAX + 64];
    snprintf(cdir, sizeof cdir, "%s/checkpoints", tr->run_dir);
    DIR *d = opendir(cdir);
    if (!d) return TERA_OK;
    long steps[4096];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 4096) {
        long s;
        char tail;
        if (sscanf(e->d_name, "step_%ld%c", &s, &tail) == 1) steps[n++] = s;
    }
    closedir(d);
    qsort(steps, (size_t)n, sizeof(long), cmp_long);
    for (int i = 0; i + keep < n; i++) {
        snprintf(path, sizeof path, "%s/step_%08ld", cdir, steps[i]);
        if (nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
            return tera_fail(TERA_ERR_IO, "cannot remove old checkpoint '%s': %s", path, strerror(errno));
    }
    return TERA_OK;
}

static int find_latest_ckpt(const char *run_dir, char *out, size_t n) {
    char cdir[TERA_PATH_MAX + 32];
    snprintf(cdir, sizeof cdir, "%s/checkpoints", run_dir);
    DIR *d = opendir(cdir);
    if (!d) return 0;
    long best = -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        long s;
        char tail;
        if (sscanf(e->d_name, "step_%ld%c", &s, &tail) == 1 && s > best) best = s;
    }
    closedir(d);
    if (best < 0) return 0;
    snprintf(out, n, "%s/step_%08ld", cdir, best);
    return 1;
}

tera_status tera_trainer_resume(tera_trainer *tr) {
    char dir[TERA_PATH_MAX + 64], path[TERA_PATH_MAX + 128];
    if (!find_latest_ckpt(tr->run_dir, dir, sizeof dir))
        return tera_fail(TERA_ERR_IO, "--resume: no checkpoint under '%s/checkpoints'", tr->run_dir);
    TERA_TRY(tera_hf_import(&tr->model, dir));
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    tera_st_file f;
    TERA_TRY(tera_st_open(&f, path));
    tera_status st = TERA_OK;
    char nm[160];
    for (int i = 0; i < tr->model.n_params && st == TERA_OK; i++) {
        const tera_param *p = &tr->model.params[i];
        snprintf(nm, sizeof nm, "exp_avg.%d", i);
        st = tera_st_read_f32(&f, nm, p->ndim, p->shape, tr->opt.m + p->offset);
        if (st != TERA_OK) break;
        snprintf(nm, sizeof nm, "exp_avg_sq.%d", i);
        st = tera_st_read_f32(&f, nm, p->ndim, p->shape, tr->opt.v + p->offset);
    }
    tera_st_close(&f);
    if (st == TERA_OK) {
        snprintf(path, sizeof path, "%s/state.json", dir);
        st = read_state(tr, path);
    }
    if (st == TERA_OK) st = tera_trainer_open_metrics(tr, "a");
    return st;
}

