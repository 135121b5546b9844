/* Reading checkpoints: COMMIT markers, listing, verification, and loading (full or differential). */
/* paths are bounded by TERA_PATH_MAX; a truncated one fails to open and is reported */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <xxhash.h>
#include <zstd.h>

#include "tera/ckpt.h"
#include "tera/hf.h"
#include "tera/io.h"
#include "tera/safetensors.h"

const char *const tera_ckpt_region_names[TERA_CKPT_N_REGIONS] = {"weights", "exp_avg", "exp_avg_sq", "router_bias"};

int64_t tera_ckpt_region_floats(const tera_model *m, int region) {
    if (region < 3) return m->n_floats;
    return m->router_bias ? (int64_t)m->cfg.n_layers * m->cfg.n_experts : 0;
}

uint64_t tera_ckpt_region_hash(const tera_model *m, int region, const float *buf) {
    if (region == 3) return XXH3_64bits(buf, sizeof(float) * (size_t)tera_ckpt_region_floats(m, 3));
    XXH3_state_t *s = XXH3_createState();
    XXH3_64bits_reset(s);
    for (int i = 0; i < m->n_params; i++)
        XXH3_64bits_update(s, buf + m->params[i].offset, sizeof(float) * (size_t)m->params[i].numel);
    uint64_t h = XXH3_64bits_digest(s);
    XXH3_freeState(s);
    return h;
}

/* ------------------------------------------------------------------------------ COMMIT */

#define MAX_FILES 256
typedef struct {
    int64_t step;
    int n;
    char name[MAX_FILES][128];
    int64_t size[MAX_FILES];
    uint64_t hash[MAX_FILES];
} commit_t;

/* Parses DIR/COMMIT: "tera-checkpoint-commit 1", "step N", "file NAME SIZE HEX"..., "end". */
static int read_commit(const char *dir, commit_t *c) {
    char path[4200], *text = NULL;
    snprintf(path, sizeof path, "%s/COMMIT", dir);
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) return 0;
    if (tera_read_text_file(path, &text) != TERA_OK) return 0;
    memset(c, 0, sizeof *c);
    c->step = -1;
    int ok = 0, header = 0;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        long long v;
        unsigned long long h;
        char nm[128];
        if (!header) {
            header = strcmp(line, "tera-checkpoint-commit 1") == 0;
            if (!header) break;
        } else if (sscanf(line, "step %lld", &v) == 1) {
            c->step = v;
        } else if (c->n < MAX_FILES && sscanf(line, "file %127s %lld %llx", nm, &v, &h) == 3) {
            snprintf(c->name[c->n], sizeof c->name[0], "%s", nm);
            c->size[c->n] = v;
            c->hash[c->n++] = h;
        } else if (!strcmp(line, "end")) {
            ok = 1;
            break;
        } else {
            break;
        }
    }
    free(text);
    return ok && c->step >= 0;
}

/* step_N (tmp 0), step_N.tmp (a save in progress) or step_N.deleting (retention removing it):
 * both leftovers count as uncommitted and are removed by the next save. */
static int parse_step_name(const char *name, int64_t *step, int *tmp) {
    long long s;
    int len = 0;
    if (sscanf(name, "step_%lld%n", &s, &len) != 1 || s < 0) return 0;
    if (name[len] == 0) *tmp = 0;
    else if (!strcmp(name + len, ".tmp") || !strcmp(name + len, TERA_CKPT_DELETING_SUFFIX)) *tmp = 1;
    else return 0;
    *step = s;
    return 1;
}

/* Every file COMMIT names is still there (a checkpoint half removed by an older retention, or by
 * hand, is not a checkpoint). Contents are tera_ckpt_verify's business. */
static int commit_files_present(const char *dir, const commit_t *c) {
    char path[4400];
    struct stat sb;
    for (int i = 0; i < c->n; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, c->name[i]);
        if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) return 0;
    }
    return 1;
}

static const char *base_name(const char *dir) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    const char *p = dir + n;
    while (p > dir && p[-1] != '/') p--;
    return p;
}

int64_t tera_ckpt_dir_step(const char *dir) {
    char name[256];
    snprintf(name, sizeof name, "%s", base_name(dir));
    char *slash = strchr(name, '/');
    if (slash) *slash = 0;
    int64_t step;
    int tmp;
    return parse_step_name(name, &step, &tmp) && !tmp ? step : -1;
}

int tera_ckpt_committed(const char *dir) {
    commit_t *c = malloc(sizeof *c);
    const int64_t step = tera_ckpt_dir_step(dir);
    int ok = c && step >= 0 && read_commit(dir, c) && c->step == step && commit_files_present(dir, c);
    free(c);
    return ok;
}

/* manifest.json of dir (NULL when missing or malformed). */
static cJSON *read_manifest(const char *dir) {
    char path[4200], *text = NULL;
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    if (tera_read_text_file(path, &text) != TERA_OK) return NULL;
    cJSON *j = cJSON_Parse(text);
    free(text);
    return j;
}

/* ------------------------------------------------------------------ whose directory (ckpt.h) */

static int file_in(const char *dir, const char *name) {
    char p[PATH_MAX + 64];
    if ((size_t)snprintf(p, sizeof p, "%s/%s", dir, name) >= sizeof p) return 0;
    return access(p, F_OK) == 0;
}

static int dir_in(const char *dir, const char *name) {
    char p[PATH_MAX + 64];
    struct stat sb;
    if ((size_t)snprintf(p, sizeof p, "%s/%s", dir, name) >= sizeof p) return 0;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

tera_dir_owner tera_ckpt_dir_owner(const char *path, char *owner, size_t cap) {
    char p[PATH_MAX], r[PATH_MAX];
    if (!path || !*path || strlen(path) >= sizeof p) return TERA_OWNER_NONE;
    snprintf(p, sizeof p, "%s", path);
    /* the nearest existing ancestor, resolved (a relative path with no existing part: ".") */
    const int exists = realpath(p, r) != NULL;
    while (!exists && !realpath(p, r)) {
        size_t n = strlen(p);
        while (n > 1 && p[n - 1] == '/') p[--n] = 0;
        char *slash = strrchr(p, '/');
        if (!slash) snprintf(p, sizeof p, ".");
        else if (slash == p) p[1] = 0;
        else *slash = 0;
        if (!strcmp(p, ".") && !realpath(p, r)) return TERA_OWNER_NONE;
    }
    tera_dir_owner kind = TERA_OWNER_NONE;
    struct stat sb;
    if (exists && stat(r, &sb) == 0 && S_ISDIR(sb.st_mode) && dir_in(r, "checkpoints") &&
        (file_in(r, "config.ini") || file_in(r, "metrics.jsonl")))
        kind = TERA_OWNER_RUN;
    while (kind == TERA_OWNER_NONE) {
        if (file_in(r, "manifest.json") || file_in(r, "COMMIT")) {
            kind = TERA_OWNER_CHECKPOINT;
            break;
        }
        char *slash = strrchr(r, '/');
        const int top = !slash || slash == r;
        if (slash && !strcmp(slash + 1, "checkpoints")) {
            char parent[PATH_MAX];
            snprintf(parent, sizeof parent, "%.*s", top ? 1 : (int)(slash - r), r);
            if (file_in(parent, "config.ini") || file_in(parent, "metrics.jsonl")) {
                kind = TERA_OWNER_CHECKPOINTS;
                break;
            }
        }
        if (top) break;
        *slash = 0;
    }
    if (kind != TERA_OWNER_NONE && owner && cap) snprintf(owner, cap, "%s", r);
    return kind;
}

static int64_t manifest_int(const cJSON *j, const char *key, int64_t dflt) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(j, key);
    /* in range of int64 (a cast of 1e300 is undefined) */
    return cJSON_IsNumber(it) && fabs(it->valuedouble) < 9.2e18 ? (int64_t)it->valuedouble : dflt;
}

static int cmp_info(const void *a, const void *b) {
    const tera_ckpt_info *x = a, *y = b;
    if (x->step != y->step) return (x->step > y->step) - (x->step < y->step);
    return strcmp(x->name, y->name);
}

tera_status tera_ckpt_list(const char *root, tera_ckpt_info **out, int *n_out) {
    *out = NULL;
    *n_out = 0;
    DIR *d = opendir(root);
    if (!d) return errno == ENOENT ? TERA_OK : tera_fail(TERA_ERR_IO, "%s: cannot open: %s", root, strerror(errno));
    int n = 0, cap = 0;
    tera_ckpt_info *v = NULL;
    commit_t *c = malloc(sizeof *c);
    struct dirent *e;
    char dir[4200], path[4400];
    while ((e = readdir(d))) {
        int64_t step;
        int tmp;
        if (!parse_step_name(e->d_name, &step, &tmp)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            v = tera_realloc(v, sizeof *v * (size_t)cap);
        }
        tera_ckpt_info *in = &v[n++];
        memset(in, 0, sizeof *in);
        snprintf(in->name, sizeof in->name, "%s", e->d_name);
        in->step = step;
        in->base_step = -1;
        snprintf(dir, sizeof dir, "%s/%s", root, e->d_name);
        in->committed = !tmp && read_commit(dir, c) && c->step == step && commit_files_present(dir, c);
        DIR *dd = opendir(dir);
        for (struct dirent *f; dd && (f = readdir(dd));) {
            struct stat sb;
            snprintf(path, sizeof path, "%s/%s", dir, f->d_name);
            if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode)) in->bytes += (int64_t)sb.st_size;
        }
        if (dd) closedir(dd);
        if (in->committed) {
            cJSON *m = read_manifest(dir);
            const cJSON *kind = m ? cJSON_GetObjectItemCaseSensitive(m, "kind") : NULL;
            in->full = !(cJSON_IsString(kind) && !strcmp(kind->valuestring, "diff"));
            if (!in->full) in->base_step = manifest_int(m, "base_step", -1);
            cJSON_Delete(m);
        }
    }
    closedir(d);
    free(c);
    if (n) qsort(v, (size_t)n, sizeof *v, cmp_info);
    *out = v;
    *n_out = n;
    return TERA_OK;
}

/* ------------------------------------------------------------------------------ verify */

static tera_status problem(FILE *report, char *first_msg, tera_status first, tera_status s) {
    if (report) fprintf(report, "%s\n", tera_last_error());
    if (first == TERA_OK) snprintf(first_msg, 1024, "%s", tera_last_error());
    return first != TERA_OK ? first : s;
}

tera_status tera_ckpt_verify(const char *dir, FILE *report) {
    commit_t *c = malloc(sizeof *c);
    char path[4400];
    tera_status first = TERA_OK;
    char first_msg[1024] = "";
    int64_t step;
    int tmp;
    char name[256];
    snprintf(name, sizeof name, "%s", base_name(dir));
    if ((name[0] && name[strlen(name) - 1] == '/')) name[strlen(name) - 1] = 0;
    if (!parse_step_name(name, &step, &tmp) || tmp) {
        free(c);
        return problem(report, first_msg, first,
                       tera_fail(TERA_ERR_FORMAT, "%s: not a checkpoint directory name (step_NNNNNNNN)", dir));
    }
    if (!read_commit(dir, c)) {
        free(c);
        return problem(report, first_msg, first,
                       tera_fail(TERA_ERR_FORMAT, "%s/COMMIT: missing or malformed: the checkpoint is not committed", dir));
    }
    if (c->step != step)
        first = problem(report, first_msg, first,
                        tera_fail(TERA_ERR_FORMAT, "%s/COMMIT: names step %" PRId64 ", the directory step %" PRId64,
                                  dir, c->step, step));
    int has_manifest = 0;
    for (int i = 0; i < c->n; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, c->name[i]);
        has_manifest |= !strcmp(c->name[i], "manifest.json");
        uint64_t h;
        int64_t sz;
        if (tera_ckpt_hash_file(path, &h, &sz) != TERA_OK) {
            first = problem(report, first_msg, first, tera_fail(TERA_ERR_FORMAT, "%s: missing or unreadable", path));
            continue;
        }
        if (sz != c->size[i])
            first = problem(report, first_msg, first,
                            tera_fail(TERA_ERR_FORMAT, "%s: %s (%" PRId64 " bytes, COMMIT says %" PRId64 ")", path,
                                      sz < c->size[i] ? "truncated" : "size changed", sz, c->size[i]));
        else if (h != c->hash[i])
            first = problem(report, first_msg, first,
                            tera_fail(TERA_ERR_FORMAT, "%s: contents differ from the checksum in COMMIT (xxh3 %016" PRIx64
                                      ", expected %016" PRIx64 ")", path, h, c->hash[i]));
    }
    if (!has_manifest) {
        first = problem(report, first_msg, first,
                        tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: not listed in COMMIT", dir));
    } else {
        cJSON *m = read_manifest(dir);
        const cJSON *files = m ? cJSON_GetObjectItemCaseSensitive(m, "files") : NULL;
        if (!cJSON_IsObject(files)) {
            first = problem(report, first_msg, first, tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: malformed", dir));
        } else {
            const cJSON *f;
            cJSON_ArrayForEach(f, files) {
                int found = -1;
                for (int i = 0; i < c->n; i++)
                    if (!strcmp(c->name[i], f->string)) found = i;
                const cJSON *hx = cJSON_GetObjectItemCaseSensitive(f, "xxh3");
                char want[32] = "";
                if (found >= 0) snprintf(want, sizeof want, "%016" PRIx64, c->hash[found]);
                if (found < 0 || !cJSON_IsString(hx) || strcmp(hx->valuestring, want) != 0)
                    first = problem(report, first_msg, first,
                                    tera_fail(TERA_ERR_FORMAT, "%s/%s: manifest checksum disagrees with COMMIT", dir,
                                              f->string));
            }
            const cJSON *kind = cJSON_GetObjectItemCaseSensitive(m, "kind");
            if (cJSON_IsString(kind) && !strcmp(kind->valuestring, "diff")) {
                int64_t b = manifest_int(m, "base_step", -1);
                snprintf(path, sizeof path, "%s/../step_%08" PRId64, dir, b);
                if (b < 0 || !tera_ckpt_committed(path))
                    first = problem(report, first_msg, first,
                                    tera_fail(TERA_ERR_FORMAT, "%s: its base checkpoint step_%08" PRId64
                                              " is missing or not committed", dir, b));
            }
        }
        cJSON_Delete(m);
    }
    free(c);
    /* with a report: a summary under its lines; without one: the first problem itself (the file at fault) */
    if (first != TERA_OK)
        report ? tera_fail(first, "%s: verification failed (see above)", dir) : tera_fail(first, "%s", first_msg);
    return first;
}

tera_status tera_ckpt_remove_listed(const char *root, int uncommitted_only) {
    tera_ckpt_info *v;
    int n;
    TERA_TRY(tera_ckpt_list(root, &v, &n));
    char path[4400];
    tera_status s = TERA_OK;
    for (int i = 0; i < n && s == TERA_OK; i++) {
        if (uncommitted_only && v[i].committed) continue;
        snprintf(path, sizeof path, "%s/%s", root, v[i].name);
        s = tera_ckpt_rmtree(path);
    }
    free(v);
    return s;
}

tera_status tera_ckpt_find_latest(const char *run_dir, char *out, size_t cap) {
    char root[4200], dir[4400], base[4400];
    snprintf(root, sizeof root, "%s/checkpoints", run_dir);
    tera_ckpt_info *v;
    int n;
    TERA_TRY(tera_ckpt_list(root, &v, &n));
    for (int i = n - 1; i >= 0; i--) {
        snprintf(dir, sizeof dir, "%s/%s", root, v[i].name);
        if (!v[i].committed) {
            /* step_N with a COMMIT whose files are not all there (damaged, or half removed): not a
             * save in progress, so the skip is worth a warning naming what is missing */
            snprintf(base, sizeof base, "%s/COMMIT", dir);
            if (!strchr(v[i].name, '.') && access(base, F_OK) == 0 && tera_ckpt_verify(dir, NULL) != TERA_OK)
                fprintf(stderr, "tera: warning: skipping checkpoint %s: %s\n", dir, tera_last_error());
            continue;
        }
        int ok = tera_ckpt_verify(dir, NULL) == TERA_OK;
        if (ok && !v[i].full) {
            snprintf(base, sizeof base, "%s/step_%08" PRId64, root, v[i].base_step);
            ok = tera_ckpt_verify(base, NULL) == TERA_OK;
        }
        if (ok) {
            snprintf(out, cap, "%s", dir);
            free(v);
            return TERA_OK;
        }
        fprintf(stderr, "tera: warning: skipping checkpoint %s: %s\n", dir, tera_last_error());
    }
    free(v);
    return tera_fail(TERA_ERR_IO, "--resume: no committed checkpoint under '%s'", root);
}

/* ------------------------------------------------------------------------------ load */

tera_status tera_ckpt_apply_diff(const char *path, const tera_model *m, float *const regions[TERA_CKPT_N_REGIONS]) {
    int64_t sizes[TERA_CKPT_N_REGIONS];
    for (int r = 0; r < TERA_CKPT_N_REGIONS; r++) sizes[r] = tera_ckpt_region_floats(m, r);
    return tera_ckpt_apply_diff_sized(path, TERA_CKPT_N_REGIONS, regions, sizes);
}

tera_status tera_ckpt_apply_diff_sized(const char *path, int n_regions, float *const *regions, const int64_t *sizes) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || sb.st_size < 12) {
        close(fd);
        return tera_fail(TERA_ERR_FORMAT, "%s: too short", path);
    }
    const size_t n = (size_t)sb.st_size;
    uint8_t *p = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return tera_fail(TERA_ERR_IO, "%s: cannot map", path);
    tera_status s = TERA_OK;
    uint32_t nrec;
    if (memcmp(p, "TERADIF1", 8) != 0) s = tera_fail(TERA_ERR_FORMAT, "%s: bad magic", path);
    memcpy(&nrec, p + 8, 4);
    size_t at = 12;
    for (uint32_t r = 0; r < nrec && s == TERA_OK; r++) {
        uint32_t region, raw, comp;
        uint64_t off;
        if (at + 20 > n) {
            s = tera_fail(TERA_ERR_FORMAT, "%s: record %u runs past the end", path, r);
            break;
        }
        memcpy(&region, p + at, 4);
        memcpy(&raw, p + at + 4, 4);
        memcpy(&off, p + at + 8, 8);
        memcpy(&comp, p + at + 16, 4);
        at += 20;
        if (region >= (uint32_t)n_regions || at + comp > n || off + raw > (uint64_t)sizes[region] * sizeof(float)) {
            s = tera_fail(TERA_ERR_FORMAT, "%s: record %u is out of bounds", path, r);
            break;
        }
        if (regions[region]) {
            size_t got = ZSTD_decompress((uint8_t *)regions[region] + off, raw, p + at, comp);
            if (ZSTD_isError(got) || got != raw)
                s = tera_fail(TERA_ERR_FORMAT, "%s: record %u does not decompress", path, r);
        }
        at += comp;
    }
    munmap(p, n);
    return s;
}

static tera_status load_full(const char *dir, tera_model *m, float *ea, float *eas) {
    TERA_TRY(tera_hf_import(m, dir));
    if (!ea && !eas) return TERA_OK;
    char path[4400], nm[64];
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    tera_st_file f;
    TERA_TRY(tera_st_open(&f, path));
    tera_status st = TERA_OK;
    for (int i = 0; i < m->n_params && st == TERA_OK; i++) {
        const tera_param *p = &m->params[i];
        if (ea) {
            snprintf(nm, sizeof nm, "exp_avg.%d", i);
            st = tera_st_read_f32(&f, nm, p->ndim, p->shape, ea + p->offset);
        }
        if (st == TERA_OK && eas) {
            snprintf(nm, sizeof nm, "exp_avg_sq.%d", i);
            st = tera_st_read_f32(&f, nm, p->ndim, p->shape, eas + p->offset);
        }
    }
    tera_st_close(&f);
    return st;
}

/* A sharded checkpoint (written by several ranks, src/train/checkpoint.c): each tensor of the
 * one-process table (m must be one) is read piece by piece from the files the manifest names,
 * each piece a block [lo, lo + len) of the tensor, and the router bias from its own file. */
static int json_dims(const cJSON *a, int ndim, int64_t *out, int64_t fill) {
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != ndim) return 0;
    for (int d = 0; d < ndim; d++) { /* whole numbers in [0, 2^40]: no cast out of range, no product overflow */
        const cJSON *x = cJSON_GetArrayItem(a, d);
        if (!cJSON_IsNumber(x) || !(x->valuedouble >= 0 && x->valuedouble <= 1099511627776.0)) return 0;
    }
    for (int d = 0; d < 3; d++) out[d] = d < ndim ? (int64_t)cJSON_GetArrayItem(a, d)->valuedouble : fill;
    return 1;
}

/* A manifest piece of tensor p: its file (a name inside the checkpoint) and its block [lo, lo +
 * len) of p's global shape. NULL when malformed. */
static const char *piece_of(const cJSON *pc, const tera_param *p, int64_t *lo, int64_t *len) {
    const cJSON *file = cJSON_GetObjectItemCaseSensitive(pc, "file");
    if (!cJSON_IsString(file) || strchr(file->valuestring, '/') || strlen(file->valuestring) >= 64 ||
        !json_dims(cJSON_GetObjectItemCaseSensitive(pc, "lo"), p->ndim, lo, 0) ||
        !json_dims(cJSON_GetObjectItemCaseSensitive(pc, "len"), p->ndim, len, 1))
        return NULL;
    for (int d = 0; d < 3; d++)
        if (lo[d] + len[d] > p->shape[d]) return NULL;
    return file->valuestring;
}

/* The router bias [L E] of a sharded checkpoint (written whole by every save). */
static tera_status read_router_bias(const char *dir, tera_model *m) {
    const int64_t nb = tera_ckpt_region_floats(m, 3);
    if (nb == 0) return TERA_OK;
    char path[4400];
    snprintf(path, sizeof path, "%s/router_bias.safetensors", dir);
    tera_st_file f;
    TERA_TRY(tera_st_open(&f, path));
    tera_status s = tera_st_read_f32(&f, "router_bias", 1, &nb, m->router_bias);
    tera_st_close(&f);
    return s;
}

/* Entry i of a sharded manifest's "tensors" names tensor p with p's global shape. */
static tera_status check_manifest_tensor(const cJSON *t, const tera_param *p, int i, const char *dir) {
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(t, "name");
    int64_t gs[3];
    if (!cJSON_IsString(nm) || strcmp(nm->valuestring, p->name) != 0 ||
        !json_dims(cJSON_GetObjectItemCaseSensitive(t, "global_shape"), p->ndim, gs, 1) || gs[0] != p->shape[0] ||
        gs[1] != p->shape[1] || gs[2] != p->shape[2])
        return tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: tensor %d is not '%s' of this model's shape", dir, i, p->name);
    return TERA_OK;
}

static tera_status load_sharded(const char *dir, const cJSON *man, tera_model *m, float *ea, float *eas) {
    const cJSON *tens = cJSON_GetObjectItemCaseSensitive(man, "tensors");
    if (!cJSON_IsArray(tens) || cJSON_GetArraySize(tens) != m->n_params)
        return tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: \"tensors\" must list the model's %d tensors", dir,
                         m->n_params);
    char path[4400], key[32];
    float *dst[3] = {m->w, ea, eas};
    float *tmp = NULL;
    size_t tmp_cap = 0;
    tera_status s = TERA_OK;
    for (int i = 0; i < m->n_params && s == TERA_OK; i++) {
        const tera_param *p = &m->params[i];
        const cJSON *t = cJSON_GetArrayItem(tens, i);
        if ((s = check_manifest_tensor(t, p, i, dir)) != TERA_OK) break;
        int64_t covered = 0;
        const cJSON *pc;
        cJSON_ArrayForEach(pc, cJSON_GetObjectItemCaseSensitive(t, "pieces")) {
            int64_t lo[3], len[3];
            const char *file = piece_of(pc, p, lo, len);
            if (!file) {
                s = tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: a piece of '%s' is malformed", dir, p->name);
                break;
            }
            const size_t cnt = (size_t)(len[0] * len[1] * len[2]);
            if (cnt > tmp_cap) {
                free(tmp);
                tmp = tera_malloc(sizeof(float) * cnt);
                tmp_cap = cnt;
            }
            snprintf(path, sizeof path, "%s/%s", dir, file);
            tera_st_file f;
            if ((s = tera_st_open(&f, path)) != TERA_OK) break;
            static const char prefix[3] = {'w', 'm', 'v'};
            for (int k = 0; k < 3 && s == TERA_OK; k++) {
                if (!dst[k]) continue;
                snprintf(key, sizeof key, "%c.%d", prefix[k], i);
                s = tera_st_read_f32(&f, key, p->ndim, len, tmp);
                if (s == TERA_OK) tera_block_copy(p->shape, lo, len, dst[k] + p->offset, tmp, 1); /* into the whole */
            }
            tera_st_close(&f);
            covered += (int64_t)cnt;
        }
        if (s == TERA_OK && covered != p->numel)
            s = tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: the pieces of '%s' hold %ld of its %ld elements", dir,
                          p->name, (long)covered, (long)p->numel);
    }
    free(tmp);
    return s == TERA_OK ? read_router_bias(dir, m) : s;
}

/* A sharded differential checkpoint: for each rank file of the pieces, the rank's buffer (its
 * blocks in table order, each as parameters, exp_avg, exp_avg_sq) is rebuilt from the loaded base,
 * the rank's diff applied to it, and the blocks copied back. */
static tera_status apply_sharded_diffs(const char *dir, const cJSON *man, tera_model *m, float *ea, float *eas) {
    const cJSON *tens = cJSON_GetObjectItemCaseSensitive(man, "tensors");
    float *zm = NULL, *zv = NULL; /* moments not asked for: scratch */
    if (!ea) ea = zm = tera_calloc((size_t)m->n_floats + 1, sizeof(float));
    if (!eas) eas = zv = tera_calloc((size_t)m->n_floats + 1, sizeof(float));
    float *arr[3] = {m->w, ea, eas};
    char files[1024][64];
    int nfiles = 0;
    const cJSON *t, *pc;
    if (!cJSON_IsArray(tens) || cJSON_GetArraySize(tens) != m->n_params) {
        free(zm);
        free(zv);
        return tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: \"tensors\" must list the model's %d tensors", dir,
                         m->n_params);
    }
    tera_status s = TERA_OK;
    int i = 0;
    cJSON_ArrayForEach(t, tens) {
        const tera_param *p = &m->params[i++];
        cJSON_ArrayForEach(pc, cJSON_GetObjectItemCaseSensitive(t, "pieces")) {
            int64_t lo[3], len[3];
            const char *f = piece_of(pc, p, lo, len);
            if (!f) {
                s = tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: a piece of '%s' is malformed", dir, p->name);
                break;
            }
            int seen = 0;
            for (int k = 0; k < nfiles && !seen; k++) seen = !strcmp(files[k], f);
            if (!seen && nfiles < 1024) snprintf(files[nfiles++], sizeof files[0], "%s", f);
        }
    }
    float *buf = NULL;
    for (int fi = 0; fi < nfiles && s == TERA_OK; fi++) {
        /* twice over the pieces of this file: gather into the buffer, then (after the diff) back */
        for (int pass = 0; pass < 3 && s == TERA_OK; pass++) {
            int64_t at = 0;
            int ti = 0;
            cJSON_ArrayForEach(t, tens) {
                const tera_param *p = &m->params[ti++];
                cJSON_ArrayForEach(pc, cJSON_GetObjectItemCaseSensitive(t, "pieces")) {
                    int64_t lo[3], len[3];
                    if (strcmp(piece_of(pc, p, lo, len), files[fi])) continue; /* validated above */
                    for (int k = 0; k < 3; k++) {
                        if (pass > 0) tera_block_copy(p->shape, lo, len, arr[k] + p->offset, buf + at, pass == 2);
                        at += len[0] * len[1] * len[2];
                    }
                }
            }
            if (pass == 0) { /* sizes known: the buffer */
                free(buf);
                buf = tera_calloc((size_t)at + 1, sizeof(float));
            } else if (pass == 1) { /* the diff onto the rebuilt buffer */
                char path[4400];
                snprintf(path, sizeof path, "%s/%.*s.diff", dir, (int)(strlen(files[fi]) - strlen(".safetensors")), files[fi]);
                float *regions[1] = {buf};
                const int64_t sizes[1] = {at};
                s = tera_ckpt_apply_diff_sized(path, 1, regions, sizes);
            }
        }
    }
    free(buf);
    free(zm);
    free(zv);
    return s;
}

tera_status tera_ckpt_load(const char *dir, tera_model *m, float *ea, float *eas) {
    cJSON *man = read_manifest(dir);
    if (!man) return tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: missing or malformed", dir);
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(man, "sharded"))) {
        /* the files' checksums (COMMIT, manifest) are what tera_ckpt_verify checks */
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(man, "kind");
        tera_status s;
        if (cJSON_IsString(kind) && !strcmp(kind->valuestring, "diff")) {
            char base[4400];
            snprintf(base, sizeof base, "%s/../step_%08" PRId64, dir, manifest_int(man, "base_step", -1));
            cJSON *bman = read_manifest(base);
            s = bman ? load_sharded(base, bman, m, ea, eas)
                     : tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: missing or malformed (the base of %s)", base, dir);
            cJSON_Delete(bman);
            if (s == TERA_OK) s = apply_sharded_diffs(dir, man, m, ea, eas);
            if (s == TERA_OK) s = read_router_bias(dir, m); /* this step's, not the base's */
        } else {
            s = load_sharded(dir, man, m, ea, eas);
        }
        cJSON_Delete(man);
        return s;
    }
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(man, "kind");
    const int diff = cJSON_IsString(kind) && !strcmp(kind->valuestring, "diff");
    tera_status s = TERA_OK;
    char path[4400];
    if (diff) {
        snprintf(path, sizeof path, "%s/../step_%08" PRId64, dir, manifest_int(man, "base_step", -1));
        s = load_full(path, m, ea, eas);
        /* the diff's chunks for regions not asked for (moments when NULL) are skipped */
        if (s == TERA_OK) {
            float *regions[TERA_CKPT_N_REGIONS] = {m->w, ea, eas, m->router_bias};
            snprintf(path, sizeof path, "%s/diff.bin", dir);
            s = tera_ckpt_apply_diff(path, m, regions);
        }
    } else {
        s = load_full(dir, m, ea, eas);
    }
    /* the restored state must be the state that was saved */
    const cJSON *regs = cJSON_GetObjectItemCaseSensitive(man, "regions");
    const float *bufs[TERA_CKPT_N_REGIONS] = {m->w, ea, eas, m->router_bias};
    for (int r = 0; r < TERA_CKPT_N_REGIONS && s == TERA_OK; r++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(regs, tera_ckpt_region_names[r]);
        const cJSON *hx = cJSON_GetObjectItemCaseSensitive(it, "xxh3");
        if (!bufs[r] || !tera_ckpt_region_floats(m, r)) continue;
        if (!cJSON_IsString(hx)) {
            s = tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: no checksum for region %s", dir, tera_ckpt_region_names[r]);
            break;
        }
        char got[32];
        snprintf(got, sizeof got, "%016" PRIx64, tera_ckpt_region_hash(m, r, bufs[r]));
        if (strcmp(got, hx->valuestring) != 0)
            s = tera_fail(TERA_ERR_FORMAT, "%s: restored %s differ from the saved state (xxh3 %s, manifest %s)", dir,
                          tera_ckpt_region_names[r], got, hx->valuestring);
    }
    cJSON_Delete(man);
    return s;
}

/* ------------------------------------------------------------------------------ runs of a block */

int64_t tera_block_n_runs(const int64_t *shape, const int64_t *len) {
    if (len[0] * len[1] * len[2] == 0) return 0;
    if (len[2] == shape[2] && len[1] == shape[1]) return 1;
    if (len[2] == shape[2]) return len[0];
    return len[0] * len[1];
}

void tera_block_run(const int64_t *shape, const int64_t *lo, const int64_t *len, int64_t r, int64_t *g, int64_t *l,
                    int64_t *n) {
    const int64_t S1 = shape[1], S2 = shape[2];
    if (len[2] == S2 && len[1] == S1) { /* the whole block is one run */
        *g = lo[0] * S1 * S2, *l = 0, *n = len[0] * S1 * S2;
    } else if (len[2] == S2) { /* one run per index of dim 0 */
        *g = ((lo[0] + r) * S1 + lo[1]) * S2, *l = r * len[1] * S2, *n = len[1] * S2;
    } else {
        const int64_t i0 = r / len[1], i1 = r % len[1];
        *g = ((lo[0] + i0) * S1 + lo[1] + i1) * S2 + lo[2], *l = r * len[2], *n = len[2];
    }
}

/* The first run of a block whose global range ends after g (runs are in increasing global order). */
static int64_t first_run_after(const int64_t *shape, const int64_t *lo, const int64_t *len, int64_t g) {
    int64_t a = 0, b = tera_block_n_runs(shape, len);
    while (a < b) {
        const int64_t mid = a + (b - a) / 2;
        int64_t rg, rl, rn;
        tera_block_run(shape, lo, len, mid, &rg, &rl, &rn);
        if (rg + rn <= g) a = mid + 1;
        else b = mid;
    }
    return a;
}

/* ------------------------------------------------------------------------------ piecewise reader */

#define HF_BIAS_NAME "model.layers.%d.block_sparse_moe.gate.e_score_correction_bias"

typedef struct {
    int region;
    uint32_t raw, comp;
    uint64_t off, at;    /* byte offset into the region, position of the frame in the file */
} diff_rec;

typedef struct {
    char path[4400];
    int fd;
    diff_rec *rec;
    int n;
    uint8_t *cbuf;      /* one compressed frame */
    size_t cbuf_cap;
    int cached;         /* record decompressed into chunk, or -1 */
    uint8_t *chunk;     /* [TERA_CKPT_CHUNK_BYTES] */
} diff_file;

typedef struct {
    int file;
    int64_t lo[3], len[3];
    int64_t sb_off;     /* floats before this piece's blocks in its file's buffer (differential) */
} piece;

struct tera_ckpt_reader {
    const tera_model *g;   /* the one-process table */
    int sharded;
    tera_ckpt_reader *base; /* a differential checkpoint's base */
    diff_file *diffs;      /* whole: one (diff.bin); sharded: one per file (NULL entries: none) */
    int n_diffs;
    /* whole */
    tera_st_set set;
    int *set_fd;
    tera_st_file opt;
    int opt_fd, has_opt;
    int hf;                /* a Hugging Face directory (no manifest: no moments, no region checksums) */
    /* sharded */
    int n_files;
    char (*fname)[64];
    tera_st_file *files;
    int *fds;
    piece **pieces;        /* [n_params] */
    int *n_pieces;
    char dir[4200];
};

static tera_status diff_open(diff_file *d, const char *path) {
    memset(d, 0, sizeof *d);
    d->cached = -1;
    d->fd = open(path, O_RDONLY | O_CLOEXEC);
    snprintf(d->path, sizeof d->path, "%s", path);
    if (d->fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    uint8_t hdr[20];
    if (fstat(d->fd, &sb) != 0 || sb.st_size < 12 || pread(d->fd, hdr, 12, 0) != 12 || memcmp(hdr, "TERADIF1", 8) != 0)
        return tera_fail(TERA_ERR_FORMAT, "%s: too short or bad magic", path);
    uint32_t nrec;
    memcpy(&nrec, hdr + 8, 4);
    if ((uint64_t)nrec * 20 > (uint64_t)sb.st_size) return tera_fail(TERA_ERR_FORMAT, "%s: bad record count", path);
    d->rec = tera_calloc((size_t)nrec + 1, sizeof *d->rec);
    uint64_t at = 12;
    for (uint32_t r = 0; r < nrec; r++) {
        if (at + 20 > (uint64_t)sb.st_size || pread(d->fd, hdr, 20, (off_t)at) != 20)
            return tera_fail(TERA_ERR_FORMAT, "%s: record %u runs past the end", path, r);
        diff_rec *e = &d->rec[d->n++];
        uint32_t region;
        memcpy(&region, hdr, 4);
        memcpy(&e->raw, hdr + 4, 4);
        memcpy(&e->off, hdr + 8, 8);
        memcpy(&e->comp, hdr + 16, 4);
        e->region = (int)region;
        e->at = at + 20;
        at += 20 + e->comp;
        if (at > (uint64_t)sb.st_size || e->raw > TERA_CKPT_CHUNK_BYTES || region >= TERA_CKPT_N_REGIONS ||
            (d->n > 1 && (e->region < e[-1].region || (e->region == e[-1].region && e->off < e[-1].off + e[-1].raw))))
            return tera_fail(TERA_ERR_FORMAT, "%s: record %u is out of bounds or out of order", path, r);
    }
    d->chunk = tera_malloc(TERA_CKPT_CHUNK_BYTES);
    return TERA_OK;
}

static void diff_close(diff_file *d) {
    if (d->fd >= 0) close(d->fd);
    free(d->rec);
    free(d->cbuf);
    free(d->chunk);
    memset(d, 0, sizeof *d);
    d->fd = -1;
}

/* Overlays the diff's bytes of region `region` at float positions [pos, pos + n) onto dst. */
static tera_status diff_overlay(diff_file *d, int region, int64_t pos, int64_t n, float *dst) {
    const uint64_t b0 = (uint64_t)pos * sizeof(float), b1 = (uint64_t)(pos + n) * sizeof(float);
    int a = 0, b = d->n; /* first record of the region ending after b0 */
    while (a < b) {
        const int mid = a + (b - a) / 2;
        const diff_rec *e = &d->rec[mid];
        if (e->region < region || (e->region == region && e->off + e->raw <= b0)) a = mid + 1;
        else b = mid;
    }
    for (int r = a; r < d->n && d->rec[r].region == region && d->rec[r].off < b1; r++) {
        const diff_rec *e = &d->rec[r];
        if (d->cached != r) {
            if (e->comp > d->cbuf_cap) {
                free(d->cbuf);
                d->cbuf = tera_malloc(e->comp);
                d->cbuf_cap = e->comp;
            }
            if (pread(d->fd, d->cbuf, e->comp, (off_t)e->at) != (ssize_t)e->comp)
                return tera_fail(TERA_ERR_IO, "%s: read of record %d failed", d->path, r);
            const size_t got = ZSTD_decompress(d->chunk, TERA_CKPT_CHUNK_BYTES, d->cbuf, e->comp);
            if (ZSTD_isError(got) || got != e->raw) {
                d->cached = -1;
                return tera_fail(TERA_ERR_FORMAT, "%s: record %d does not decompress", d->path, r);
            }
            d->cached = r;
        }
        const uint64_t x0 = e->off > b0 ? e->off : b0, x1 = e->off + e->raw < b1 ? e->off + e->raw : b1;
        memcpy((uint8_t *)dst + (x0 - b0), d->chunk + (x0 - e->off), (size_t)(x1 - x0));
    }
    return TERA_OK;
}

void tera_ckpt_reader_close(tera_ckpt_reader *r) {
    if (!r) return;
    tera_ckpt_reader_close(r->base);
    for (int i = 0; i < r->n_diffs; i++) diff_close(&r->diffs[i]);
    free(r->diffs);
    if (r->set_fd) {
        for (int i = 0; i < r->set.n_files; i++)
            if (r->set_fd[i] >= 0) close(r->set_fd[i]);
        tera_st_set_close(&r->set);
        free(r->set_fd);
    }
    if (r->has_opt) tera_st_close(&r->opt);
    if (r->opt_fd >= 0) close(r->opt_fd);
    for (int f = 0; r->fds && f < r->n_files; f++) { /* fds and files: NULL when the pieces were refused */
        if (r->fds[f] >= 0) close(r->fds[f]);
        if (r->files[f].path[0]) tera_st_close(&r->files[f]);
    }
    free(r->files);
    free(r->fds);
    free(r->fname);
    if (r->pieces)
        for (int i = 0; i < r->g->n_params; i++) free(r->pieces[i]);
    free(r->pieces);
    free(r->n_pieces);
    free(r);
}

static int open_ro(const char *path) { return open(path, O_RDONLY | O_CLOEXEC); }

/* A tensor of f named name must have exactly (ndim, shape), as tera_st_read_f32 demands. */
static tera_status check_shape(const tera_st_file *f, const char *name, int ndim, const int64_t *shape) {
    const tera_st_tensor *t = tera_st_find(f, name);
    if (!t) return tera_fail(TERA_ERR_FORMAT, "%s: no tensor '%s'", f->path, name);
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
    if (same) return TERA_OK;
    char a[256], b[256]; /* as tera_st_read_f32 words it */
    size_t ka = (size_t)snprintf(a, sizeof a, "["), kb = (size_t)snprintf(b, sizeof b, "[");
    for (int d = 0; d < t->ndim && ka < sizeof a; d++) ka += (size_t)snprintf(a + ka, sizeof a - ka, "%s%" PRId64, d ? "," : "", t->shape[d]);
    for (int d = 0; d < ndim && kb < sizeof b; d++) kb += (size_t)snprintf(b + kb, sizeof b - kb, "%s%" PRId64, d ? "," : "", shape[d]);
    if (ka < sizeof a) snprintf(a + ka, sizeof a - ka, "]");
    if (kb < sizeof b) snprintf(b + kb, sizeof b - kb, "]");
    return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s", f->path, name, a, b);
}

/* Every tensor a full (whole) checkpoint must hold, with its shape. */
static tera_status check_whole(const tera_ckpt_reader *r) {
    char name[192];
    for (int i = 0; i < r->g->n_params; i++) {
        const tera_param *p = &r->g->params[i];
        for (int e = 0; e < (p->expert_stacked ? (int)p->shape[0] : 1); e++) {
            if (p->expert_stacked) {
                const char *pc = strstr(p->name, "%d");
                snprintf(name, sizeof name, "%.*s%d%s", (int)(pc - p->name), p->name, e, pc + 2);
            } else {
                snprintf(name, sizeof name, "%s", p->name);
            }
            const tera_st_file *f = tera_st_set_find(&r->set, name);
            if (!f) return tera_fail(TERA_ERR_FORMAT, "%s: missing tensor '%s'", r->dir, name);
            TERA_TRY(check_shape(f, name, p->expert_stacked ? 2 : p->ndim, p->expert_stacked ? &p->shape[1] : p->shape));
        }
        for (int k = 1; k < 3 && r->has_opt; k++) {
            snprintf(name, sizeof name, k == 1 ? "exp_avg.%d" : "exp_avg_sq.%d", i);
            TERA_TRY(check_shape(&r->opt, name, p->ndim, p->shape));
        }
    }
    return TERA_OK;
}

/* The pieces of a sharded manifest, checked to cover each tensor. */
static tera_status reader_pieces(tera_ckpt_reader *r, const cJSON *man, const char *dir) {
    const tera_model *m = r->g;
    const cJSON *tens = cJSON_GetObjectItemCaseSensitive(man, "tensors");
    if (!cJSON_IsArray(tens) || cJSON_GetArraySize(tens) != m->n_params)
        return tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: \"tensors\" must list the model's %d tensors", dir,
                         m->n_params);
    r->pieces = tera_calloc((size_t)m->n_params, sizeof(piece *));
    r->n_pieces = tera_calloc((size_t)m->n_params, sizeof(int));
    int cap = 64;
    r->fname = tera_calloc((size_t)cap, sizeof *r->fname);
    int64_t *sb_at = tera_calloc((size_t)cap, sizeof(int64_t));
    tera_status s = TERA_OK;
    for (int i = 0; i < m->n_params && s == TERA_OK; i++) {
        const tera_param *p = &m->params[i];
        const cJSON *t = cJSON_GetArrayItem(tens, i);
        if ((s = check_manifest_tensor(t, p, i, dir)) != TERA_OK) break;
        const cJSON *pcs = cJSON_GetObjectItemCaseSensitive(t, "pieces"), *pc;
        r->pieces[i] = tera_calloc((size_t)cJSON_GetArraySize(pcs) + 1, sizeof(piece));
        int64_t covered = 0;
        cJSON_ArrayForEach(pc, pcs) {
            piece *q = &r->pieces[i][r->n_pieces[i]];
            const char *file = piece_of(pc, p, q->lo, q->len);
            if (!file) {
                s = tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: a piece of '%s' is malformed", dir, p->name);
                break;
            }
            int f = 0;
            while (f < r->n_files && strcmp(r->fname[f], file)) f++;
            if (f == r->n_files) {
                if (f == cap) {
                    cap *= 2;
                    char (*nf)[64] = tera_calloc((size_t)cap, sizeof *nf);
                    memcpy(nf, r->fname, sizeof *nf * (size_t)f);
                    free(r->fname);
                    r->fname = nf;
                    int64_t *ns = tera_calloc((size_t)cap, sizeof(int64_t));
                    memcpy(ns, sb_at, sizeof(int64_t) * (size_t)f);
                    free(sb_at);
                    sb_at = ns;
                }
                snprintf(r->fname[f], sizeof r->fname[f], "%s", file);
                r->n_files++;
            }
            const int64_t cnt = q->len[0] * q->len[1] * q->len[2];
            q->file = f;
            q->sb_off = sb_at[f];
            sb_at[f] += 3 * cnt;
            covered += cnt;
            r->n_pieces[i]++;
        }
        if (s == TERA_OK && covered != p->numel)
            s = tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: the pieces of '%s' hold %ld of its %ld elements", dir,
                          p->name, (long)covered, (long)p->numel);
    }
    free(sb_at);
    if (s != TERA_OK) return s;
    r->files = tera_calloc((size_t)r->n_files + 1, sizeof(tera_st_file));
    r->fds = tera_malloc(sizeof(int) * ((size_t)r->n_files + 1));
    char path[4400];
    for (int f = 0; f < r->n_files; f++) r->fds[f] = -1;
    for (int f = 0; f < r->n_files && s == TERA_OK; f++) {
        snprintf(path, sizeof path, "%s/%s", dir, r->fname[f]);
        s = tera_st_open(&r->files[f], path);
        if (s == TERA_OK && (r->fds[f] = open_ro(path)) < 0)
            s = tera_fail(TERA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    static const char prefix[3] = {'w', 'm', 'v'};
    char key[32];
    for (int i = 0; i < m->n_params && s == TERA_OK; i++)
        for (int q = 0; q < r->n_pieces[i] && s == TERA_OK; q++)
            for (int k = 0; k < 3 && s == TERA_OK; k++) {
                snprintf(key, sizeof key, "%c.%d", prefix[k], i);
                s = check_shape(&r->files[r->pieces[i][q].file], key, m->params[i].ndim, r->pieces[i][q].len);
            }
    return s;
}

/* A Hugging Face directory (config.json and safetensors weights, no manifest.json): read range by
 * range like a whole checkpoint without moments; tera_hf_import's checks run on the open files. */
static tera_status reader_open_hf(tera_ckpt_reader **out, const char *dir, const tera_model *g) {
    tera_ckpt_reader *r = tera_calloc(1, sizeof *r);
    r->g = g;
    r->opt_fd = -1;
    r->hf = 1;
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    tera_status s = tera_st_set_open(&r->set, dir);
    if (s == TERA_OK) {
        r->set_fd = tera_malloc(sizeof(int) * ((size_t)r->set.n_files + 1));
        for (int f = 0; f < r->set.n_files; f++) r->set_fd[f] = open_ro(r->set.files[f].path);
        s = check_whole(r);
        if (s == TERA_OK) s = tera_hf_check_set(g, &r->set, dir);
    }
    if (s != TERA_OK) {
        tera_ckpt_reader_close(r);
        return s;
    }
    *out = r;
    return TERA_OK;
}

static tera_status reader_open_one(tera_ckpt_reader **out, const char *dir, const tera_model *g, int depth) {
    char path[4400];
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    if (depth == 0 && access(path, F_OK) != 0) return reader_open_hf(out, dir, g);
    cJSON *man = read_manifest(dir);
    if (!man) return tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: missing or malformed", dir);
    tera_ckpt_reader *r = tera_calloc(1, sizeof *r);
    r->g = g;
    r->opt_fd = -1;
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    r->sharded = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(man, "sharded"));
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(man, "kind");
    const int diff = cJSON_IsString(kind) && !strcmp(kind->valuestring, "diff");
    tera_status s = TERA_OK;
    if (diff) {
        snprintf(path, sizeof path, "%s/../step_%08" PRId64, dir, manifest_int(man, "base_step", -1));
        s = depth > 0 ? tera_fail(TERA_ERR_FORMAT, "%s: a differential checkpoint's base is differential", dir)
                      : reader_open_one(&r->base, path, g, depth + 1);
    }
    if (s == TERA_OK && r->sharded) {
        /* the pieces: a differential one lists its base's */
        s = reader_pieces(r, man, diff ? r->base->dir : dir);
        if (s == TERA_OK && diff) {
            r->n_diffs = r->n_files;
            r->diffs = tera_calloc((size_t)r->n_diffs + 1, sizeof(diff_file));
            for (int f = 0; f < r->n_diffs; f++) r->diffs[f].fd = -1;
            for (int f = 0; f < r->n_diffs && s == TERA_OK; f++) {
                snprintf(path, sizeof path, "%s/%.*s.diff", dir, (int)(strlen(r->fname[f]) - strlen(".safetensors")),
                         r->fname[f]);
                if (access(path, F_OK) == 0) s = diff_open(&r->diffs[f], path);
            }
        }
    } else if (s == TERA_OK && diff) {
        r->n_diffs = 1;
        r->diffs = tera_calloc(1, sizeof(diff_file));
        snprintf(path, sizeof path, "%s/diff.bin", dir);
        s = diff_open(&r->diffs[0], path);
    } else if (s == TERA_OK) {
        s = tera_st_set_open(&r->set, dir);
        if (s == TERA_OK) {
            r->set_fd = tera_malloc(sizeof(int) * ((size_t)r->set.n_files + 1));
            for (int f = 0; f < r->set.n_files; f++) r->set_fd[f] = open_ro(r->set.files[f].path);
            snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
            if (access(path, F_OK) == 0) {
                s = tera_st_open(&r->opt, path);
                r->has_opt = s == TERA_OK;
                if (s == TERA_OK) r->opt_fd = open_ro(path);
            }
            if (s == TERA_OK) s = check_whole(r);
        }
    }
    cJSON_Delete(man);
    if (s != TERA_OK) {
        tera_ckpt_reader_close(r);
        return s;
    }
    *out = r;
    return TERA_OK;
}

tera_status tera_ckpt_reader_open(tera_ckpt_reader **r, const char *dir, const tera_model *global) {
    *r = NULL;
    return reader_open_one(r, dir, global, 0);
}

int tera_ckpt_reader_sharded(const tera_ckpt_reader *r) { return r->sharded; }
int tera_ckpt_reader_is_hf(const tera_ckpt_reader *r) { return r->hf; }

/* Elements [g0, g0 + n) of tensor i (global, flat) of region k from a full checkpoint's files. */
static tera_status read_full(tera_ckpt_reader *r, int k, int i, int64_t g0, int64_t n, float *dst) {
    const tera_param *p = &r->g->params[i];
    char name[192];
    if (!r->sharded) {
        if (k > 0) {
            if (!r->has_opt) return tera_fail(TERA_ERR_FORMAT, "%s: no optimizer.safetensors (the moments)", r->dir);
            snprintf(name, sizeof name, k == 1 ? "exp_avg.%d" : "exp_avg_sq.%d", i);
            return tera_st_read_range_f32(&r->opt, r->opt_fd, name, g0, n, dst);
        }
        const int64_t per = p->expert_stacked ? p->shape[1] * p->shape[2] : p->numel;
        for (int64_t done = 0; done < n;) { /* expert-stacked tensors are E files' tensors */
            const int64_t at = g0 + done, e = at / per, off = at % per, k1 = per - off < n - done ? per - off : n - done;
            if (p->expert_stacked) {
                const char *pc = strstr(p->name, "%d");
                snprintf(name, sizeof name, "%.*s%d%s", (int)(pc - p->name), p->name, (int)e, pc + 2);
            } else {
                snprintf(name, sizeof name, "%s", p->name);
            }
            const tera_st_file *f = tera_st_set_find(&r->set, name);
            if (!f) return tera_fail(TERA_ERR_FORMAT, "%s: missing tensor '%s'", r->dir, name);
            TERA_TRY(tera_st_read_range_f32(f, r->set_fd[f - r->set.files], name, off, k1, dst + done));
            done += k1;
        }
        return TERA_OK;
    }
    /* sharded: the pieces' runs that meet [g0, g0 + n) */
    static const char prefix[3] = {'w', 'm', 'v'};
    snprintf(name, sizeof name, "%c.%d", prefix[k], i);
    int64_t got = 0;
    for (int q = 0; q < r->n_pieces[i]; q++) {
        const piece *pc = &r->pieces[i][q];
        const int64_t nr = tera_block_n_runs(p->shape, pc->len);
        for (int64_t run = first_run_after(p->shape, pc->lo, pc->len, g0); run < nr; run++) {
            int64_t rg, rl, rn;
            tera_block_run(p->shape, pc->lo, pc->len, run, &rg, &rl, &rn);
            if (rg >= g0 + n) break;
            const int64_t x0 = rg > g0 ? rg : g0, x1 = rg + rn < g0 + n ? rg + rn : g0 + n;
            TERA_TRY(tera_st_read_range_f32(&r->files[pc->file], r->fds[pc->file], name, rl + (x0 - rg), x1 - x0,
                                            dst + (x0 - g0)));
            got += x1 - x0;
        }
    }
    if (got != n)
        return tera_fail(TERA_ERR_FORMAT, "%s: the pieces of '%s' do not cover elements [%lld, %lld)", r->dir, p->name,
                         (long long)g0, (long long)(g0 + n));
    return TERA_OK;
}

tera_status tera_ckpt_reader_read(tera_ckpt_reader *r, int k, int i, int64_t g0, int64_t n, float *dst) {
    const tera_param *p = &r->g->params[i];
    TERA_ASSERTF(i >= 0 && i < r->g->n_params && k >= 0 && k < 3 && g0 >= 0 && g0 + n <= p->numel,
                 "checkpoint reader: tensor %d region %d elements [%lld, %lld)", i, k, (long long)g0,
                 (long long)(g0 + n));
    if (n <= 0) return TERA_OK;
    if (!r->base) return read_full(r, k, i, g0, n, dst);
    TERA_TRY(read_full(r->base, k, i, g0, n, dst)); /* base, then this checkpoint's changed chunks */
    if (!r->sharded) return diff_overlay(&r->diffs[0], k, p->offset + g0, n, dst);
    for (int q = 0; q < r->n_pieces[i]; q++) { /* each piece's part lies at its own place in its file's buffer */
        const piece *pc = &r->pieces[i][q];
        diff_file *d = &r->diffs[pc->file];
        if (d->fd < 0 && !d->rec) continue; /* that file did not change */
        const int64_t cnt = pc->len[0] * pc->len[1] * pc->len[2], nr = tera_block_n_runs(p->shape, pc->len);
        for (int64_t run = first_run_after(p->shape, pc->lo, pc->len, g0); run < nr; run++) {
            int64_t rg, rl, rn;
            tera_block_run(p->shape, pc->lo, pc->len, run, &rg, &rl, &rn);
            if (rg >= g0 + n) break;
            const int64_t x0 = rg > g0 ? rg : g0, x1 = rg + rn < g0 + n ? rg + rn : g0 + n;
            TERA_TRY(diff_overlay(d, 0, pc->sb_off + k * cnt + rl + (x0 - rg), x1 - x0, dst + (x0 - g0)));
        }
    }
    return TERA_OK;
}

tera_status tera_ckpt_reader_bias(tera_ckpt_reader *r, float *bias) {
    const int64_t nb = tera_ckpt_region_floats(r->g, 3);
    if (nb == 0 || !bias) return TERA_OK;
    if (r->sharded) { /* every save writes the whole bias, a differential one too */
        tera_model m = *r->g;
        m.router_bias = bias;
        return read_router_bias(r->dir, &m);
    }
    if (r->base) {
        TERA_TRY(tera_ckpt_reader_bias(r->base, bias));
        return diff_overlay(&r->diffs[0], 3, 0, nb, bias);
    }
    const int64_t E = r->g->cfg.n_experts;
    memset(bias, 0, sizeof(float) * (size_t)nb);
    char name[160];
    for (int l = 0; l < r->g->cfg.n_layers; l++) {
        snprintf(name, sizeof name, HF_BIAS_NAME, l);
        const tera_st_file *f = l >= r->g->cfg.first_k_dense && E > 0 ? tera_st_set_find(&r->set, name) : NULL;
        if (f) TERA_TRY(tera_st_read_f32(f, name, 1, &E, bias + (int64_t)l * E));
    }
    return TERA_OK;
}

tera_status tera_ckpt_region_check(const char *dir, int region, uint64_t hash, int *checked) {
    *checked = 0;
    cJSON *man = read_manifest(dir);
    if (!man) return tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: missing or malformed", dir);
    const cJSON *regs = cJSON_GetObjectItemCaseSensitive(man, "regions");
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(regs, tera_ckpt_region_names[region]);
    const cJSON *hx = cJSON_GetObjectItemCaseSensitive(it, "xxh3");
    tera_status s = TERA_OK;
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(man, "sharded"))) {
        /* sharded checkpoints carry no region checksums */
    } else if (!cJSON_IsString(hx)) {
        s = tera_fail(TERA_ERR_FORMAT, "%s/manifest.json: no checksum for region %s", dir, tera_ckpt_region_names[region]);
    } else {
        char got[32];
        snprintf(got, sizeof got, "%016" PRIx64, hash);
        *checked = 1;
        if (strcmp(got, hx->valuestring) != 0)
            s = tera_fail(TERA_ERR_FORMAT, "%s: restored %s differ from the saved state (xxh3 %s, manifest %s)", dir,
                          tera_ckpt_region_names[region], got, hx->valuestring);
    }
    cJSON_Delete(man);
    return s;
}

/* export-hf's source: the weights from the checkpoint, hashed in table order as they pass, the
 * hash compared with the manifest's when the last piece has been read (the restored weights must
 * be the saved ones, as tera_ckpt_load checks). */
typedef struct {
    const char *dir;
    const tera_model *g;
    tera_ckpt_reader *rd;
    XXH3_state_t *h;
    int64_t done, total;
} export_src;

static tera_status export_read(void *ctx, int i, int64_t lo, int64_t n, float *dst) {
    export_src *e = ctx;
    TERA_TRY(tera_ckpt_reader_read(e->rd, 0, i, lo, n, dst));
    XXH3_64bits_update(e->h, dst, sizeof(float) * (size_t)n);
    e->done += n;
    if (e->done < e->total) return TERA_OK;
    int checked;
    return tera_ckpt_region_check(e->dir, 0, XXH3_64bits_digest(e->h), &checked);
}

tera_status tera_ckpt_export_hf(const char *dir, const tera_model_config *mc, const char *out, int64_t max_shard_bytes,
                                int overwrite, int allow_tera_moe) {
    /* each tensor read from the checkpoint piece by piece (a differential one through its base, a
     * sharded one from its ranks' files) and written at once: never the whole model in memory */
    tera_model g;
    memset(&g, 0, sizeof g);
    g.cfg = *mc;
    g.params = tera_param_table_ep(&g.cfg, 1, 0, &g.n_params, &g.n_floats, &g.n_dense_floats);
    g.par.ep = 1;
    g.router_bias = tera_calloc((size_t)mc->n_layers * (size_t)mc->n_experts + 1, sizeof(float));
    export_src es = {.dir = dir, .g = &g};
    for (int i = 0; i < g.n_params; i++) es.total += g.params[i].numel;
    tera_status st = tera_ckpt_reader_open(&es.rd, dir, &g);
    if (st == TERA_OK) st = tera_ckpt_reader_bias(es.rd, g.router_bias);
    if (st == TERA_OK) { /* the restored bias must be the saved one */
        int checked;
        st = tera_ckpt_region_check(dir, 3, tera_ckpt_region_hash(&g, 3, g.router_bias), &checked);
    }
    es.h = XXH3_createState();
    XXH3_64bits_reset(es.h);
    if (st == TERA_OK) st = tera_hf_export_source(&g, out, max_shard_bytes, overwrite, allow_tera_moe, export_read, &es);
    XXH3_freeState(es.h);
    tera_ckpt_reader_close(es.rd);
    free(g.router_bias);
    free(g.params);
    return st;
}
