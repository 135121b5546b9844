/* Weighted blends of datasets (data.paths = "0.7 web, 0.2 code, 0.1 books"): parsing, the
 * interleaving of include/tera/data.h (a greedy period of TERA_BLEND_PERIOD positions, a function
 * of the global sample index alone), each dataset's own loader. */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/blend.h"

#define BLEND_MAX 64

struct tera_blend {
    int K;
    double w[BLEND_MAX];             /* normalised weights */
    char name[BLEND_MAX][64];        /* JSON-safe base names */
    tera_token_source src[BLEND_MAX];
    tera_loader comp[BLEND_MAX];     /* each dataset's own split, epochs and shuffle */
    int64_t per[BLEND_MAX];          /* positions of dataset d in one period */
    unsigned char which[TERA_BLEND_PERIOD]; /* dataset of position p */
    int32_t rank[TERA_BLEND_PERIOD]; /* its rank among that dataset's positions of the period */
};

void tera_blend_close(struct tera_blend *b) {
    if (!b) return;
    for (int d = 0; d < b->K; d++) tera_source_close(&b->src[d]);
    free(b);
}

/* "web/data_text_document" -> "data_text_document"; characters outside [A-Za-z0-9_] -> '_' */
static void base_name(char *out, size_t n, const char *path) {
    const char *p = path + strlen(path);
    while (p > path && p[-1] == '/') p--; /* trailing slashes */
    const char *end = p;
    while (p > path && p[-1] != '/') p--;
    size_t k = 0;
    for (; p < end && k + 1 < n; p++, k++) out[k] = isalnum((unsigned char)*p) || *p == '_' ? *p : '_';
    out[k] = '\0';
    if (k == 0) snprintf(out, n, "data");
}

tera_status tera_blend_open(struct tera_blend **out, const tera_data_config *dc, int vocab_size) {
    *out = NULL;
    struct tera_blend *b = tera_calloc(1, sizeof *b);
    const char *p = dc->paths;
    double wsum = 0.0;
    tera_status st = TERA_OK;
    while (*p) {
        while (*p == ',' || isspace((unsigned char)*p)) p++;
        if (!*p) break;
        const char *item = p;
        const char *comma = strchr(p, ',');
        const size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char buf[TERA_PATH_MAX + 64];
        if (len >= sizeof buf) {
            st = tera_fail(TERA_ERR_CONFIG, "data.paths: the item starting '%.40s' is too long", item);
            goto fail;
        }
        memcpy(buf, p, len);
        buf[len] = '\0';
        p += len;
        char *end;
        const double w = strtod(buf, &end);
        if (end == buf || !isspace((unsigned char)*end) || !(w > 0.0) || !isfinite(w)) {
            st = tera_fail(TERA_ERR_CONFIG, "data.paths: '%s' is not 'WEIGHT PATH' with a weight > 0 (e.g. "
                           "\"0.7 web, 0.3 code\")", buf);
            goto fail;
        }
        while (isspace((unsigned char)*end)) end++;
        size_t n = strlen(end);
        while (n > 0 && isspace((unsigned char)end[n - 1])) end[--n] = '\0';
        if (n == 0) {
            st = tera_fail(TERA_ERR_CONFIG, "data.paths: '%s' names no dataset after its weight", buf);
            goto fail;
        }
        if (b->K == BLEND_MAX) {
            st = tera_fail(TERA_ERR_CONFIG, "data.paths: more than %d datasets", BLEND_MAX);
            goto fail;
        }
        tera_data_config one = *dc;
        one.paths[0] = '\0';
        snprintf(one.path, sizeof one.path, "%s", end);
        const int d = b->K;
        if ((st = tera_source_open(&b->src[d], &one, vocab_size)) != TERA_OK) goto fail;
        b->K++;
        b->w[d] = w;
        wsum += w;
        base_name(b->name[d], sizeof b->name[d], end);
        for (int e = 0; e < d; e++) /* two datasets of one name: the later gets its position appended */
            if (!strcmp(b->name[e], b->name[d])) {
                char tmp[64];
                snprintf(tmp, sizeof tmp, "%.50s_%d", b->name[d], d % 100);
                memcpy(b->name[d], tmp, sizeof tmp);
                break;
            }
    }
    if (b->K == 0) {
        st = tera_fail(TERA_ERR_CONFIG, "data.paths = '%.60s' names no dataset", dc->paths);
        goto fail;
    }
    for (int d = 0; d < b->K; d++) b->w[d] /= wsum;
    /* the period: position p goes to argmax_d w_d (p + 1) - count_d (ties: lower d) */
    int64_t cnt[BLEND_MAX] = {0};
    for (int i = 0; i < TERA_BLEND_PERIOD; i++) {
        int best = 0;
        double bv = -INFINITY;
        for (int d = 0; d < b->K; d++) {
            const double v = b->w[d] * (double)(i + 1) - (double)cnt[d];
            if (v > bv) bv = v, best = d;
        }
        b->which[i] = (unsigned char)best;
        b->rank[i] = (int32_t)cnt[best]++;
    }
    for (int d = 0; d < b->K; d++) b->per[d] = cnt[d];
    *out = b;
    return TERA_OK;
fail:
    tera_blend_close(b);
    return st;
}

const tera_token_source *tera_blend_first_source(const struct tera_blend *b) { return &b->src[0]; }

/* ---- the loader's side (called by src/data/loader.c) ----------------------------------------- */

tera_status tera_blend_loader_init(tera_loader *l, struct tera_blend *b, int T, float val_fraction, int shuffle,
                                   uint64_t seed) {
    int64_t ns = 0, nt = 0, nv = 0;
    for (int d = 0; d < b->K; d++) {
        /* dataset 0 keeps the run's seed; the others a seed of their own */
        TERA_TRY(tera_loader_init(&b->comp[d], &b->src[d], T, val_fraction, shuffle,
                                  seed ^ (uint64_t)d * 0x9E3779B97F4A7C15ull));
        if (b->per[d] == 0)
            return tera_fail(TERA_ERR_CONFIG, "data.paths: dataset '%s' has weight %.3g: below one sample in %d, it "
                             "would never be read", b->src[d].path, b->w[d], TERA_BLEND_PERIOD);
        if (val_fraction > 0.0f && b->comp[d].n_val == 0)
            return tera_fail(TERA_ERR_CONFIG, "data.paths: dataset '%s' (%lld samples) holds no validation sample "
                             "at data.val_fraction = %g", b->src[d].path, (long long)b->comp[d].n_samples,
                             (double)val_fraction);
        ns += b->comp[d].n_samples, nt += b->comp[d].n_train, nv += b->comp[d].n_val;
    }
    l->n_samples = ns, l->n_train = nt, l->n_val = nv;
    return TERA_OK;
}

/* global sample g -> (dataset, its sample index) */
static int blend_locate(const struct tera_blend *b, int64_t g, int64_t *j) {
    const int64_t blk = g / TERA_BLEND_PERIOD, pos = g % TERA_BLEND_PERIOD;
    const int d = b->which[pos];
    *j = blk * b->per[d] + b->rank[pos];
    return d;
}

void tera_blend_train_sample(const struct tera_blend *b, int64_t g, int32_t *inputs, int32_t *targets) {
    int64_t j;
    const int d = blend_locate(b, g, &j);
    tera_loader_train_sample(&b->comp[d], j, inputs, targets);
}

void tera_blend_val_sample(const struct tera_blend *b, int64_t v, int32_t *inputs, int32_t *targets) {
    int64_t j;
    const int d = blend_locate(b, v, &j);
    tera_loader_val_sample(&b->comp[d], j, inputs, targets);
}

int tera_loader_n_datasets(const tera_loader *l) { return l->src && l->src->blend ? l->src->blend->K : 1; }

const char *tera_loader_dataset_name(const tera_loader *l, int d) {
    return l->src && l->src->blend ? l->src->blend->name[d] : "data";
}

double tera_loader_dataset_weight(const tera_loader *l, int d) {
    return l->src && l->src->blend ? l->src->blend->w[d] : 1.0;
}

int tera_loader_dataset_of(const tera_loader *l, int64_t g) {
    if (!l->src || !l->src->blend) return 0;
    int64_t j;
    return blend_locate(l->src->blend, g, &j);
}

void tera_loader_val_sample_of(const tera_loader *l, int d, int64_t v, int32_t *inputs, int32_t *targets) {
    if (l->src && l->src->blend) tera_loader_val_sample(&l->src->blend->comp[d], v, inputs, targets);
    else tera_loader_val_sample(l, v, inputs, targets);
}

int64_t tera_loader_n_val_of(const tera_loader *l, int d) {
    return l->src && l->src->blend ? l->src->blend->comp[d].n_val : l->n_val;
}

void tera_data_report(const tera_loader *l, FILE *f) {
    const tera_token_source *s = l->src;
    if (!s) return;
    const struct tera_blend *b = s->blend;
    for (int d = 0; b && d < b->K; d++)
        fprintf(f, "tera: blend %d/%d: %s (val_loss_%s) weight %.4f (%lld of every %d samples) | %lld tokens, %lld "
                "train / %lld val samples\n", d + 1, b->K, b->src[d].path, b->name[d], b->w[d], (long long)b->per[d],
                TERA_BLEND_PERIOD, (long long)b->src[d].n_tokens, (long long)b->comp[d].n_train,
                (long long)b->comp[d].n_val);
    if (s->val)
        fprintf(f, "tera: validation set (data.val_path): %s | %lld tokens, %lld samples\n", s->val->path,
                (long long)s->val->n_tokens, (long long)l->n_val);
    const tera_token_source *o = b ? NULL : s;
    if (o && o->kind == TERA_SRC_ONLINE)
        fprintf(f, "tera: online tokenization: %lld documents, %lld tokens from %d shard(s), %.1f MB of text in %.2f s "
                "(encoding %.2f s on %d worker(s) x %d rank(s): %.0f tokens/s)\n", (long long)o->n_docs,
                (long long)o->n_tokens, o->online.shards, (double)o->online.bytes / 1e6, o->online.seconds,
                o->online.tokenize_seconds, o->online.workers, o->online.ranks,
                o->online.tokenize_seconds > 0 ? (double)o->n_tokens / o->online.tokenize_seconds : 0.0);
}
