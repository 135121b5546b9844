/* Online tokenization (data.tokenizer = DIR with data.format = text | jsonl): raw files, a directory
 * or a glob of shards (plain, zstd- or gzip-compressed: *.zst, *.gz), read shard by shard in sorted name order,
 * split into documents (text: one per file; jsonl: one per line, field "text"), encoded by
 * data.tokenize_workers threads and packed in document order, each document followed by the
 * tokenizer's end-of-document token: the token stream `tera data prepare` would write for the same
 * files, so sample i is the same tokens either way (docs/DATA.md). The stream is a function of the
 * files alone: any layout and any resume read the same samples. The world's ranks share the
 * encoding (each its contiguous share of every shard's documents, then an all-gather). */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <glob.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>
#include <zlib.h>
#include <zstd.h>

#include "data/online.h"
#include "tera/comm.h"
#include "tera/io.h"
#include "tera/profile.h"
#include "tera/tokenizer.h"

static int ends_with(const char *s, const char *suf) {
    const size_t n = strlen(s), k = strlen(suf);
    return n >= k && !strcmp(s + n - k, suf);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* data.path -> sorted shard list: a directory's regular files (not hidden), a glob's matches, or
 * the one file */
tera_status tera_online_list_shards(const char *path, char ***out, int *n_out) {
    char **v = NULL;
    int n = 0, cap = 0;
    struct stat st;
#define PUSH(p)                                                                                   \
    do {                                                                                          \
        if (n == cap) cap = cap ? 2 * cap : 16, v = tera_realloc(v, sizeof *v * (size_t)cap);      \
        v[n++] = strdup(p);                                                                       \
    } while (0)
    if (strpbrk(path, "*?[")) {
        glob_t g;
        const int rc = glob(path, 0, NULL, &g);
        if (rc == 0)
            for (size_t i = 0; i < g.gl_pathc; i++)
                if (stat(g.gl_pathv[i], &st) == 0 && S_ISREG(st.st_mode)) PUSH(g.gl_pathv[i]);
        globfree(&g);
    } else if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (!d) return tera_fail(TERA_ERR_IO, "data.path '%s': %s", path, strerror(errno));
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            char full[TERA_PATH_MAX + 256];
            snprintf(full, sizeof full, "%s/%s", path, e->d_name);
            if (stat(full, &st) == 0 && S_ISREG(st.st_mode)) PUSH(full);
        }
        closedir(d);
    } else if (stat(path, &st) == 0) { /* not a FIFO or device: opening one would wait for a writer */
        if (!S_ISREG(st.st_mode)) return tera_fail(TERA_ERR_IO, "data.path '%s' is not a regular file", path);
        PUSH(path);
    } else {
        return tera_fail(TERA_ERR_IO, "data.path '%s': %s", path, strerror(errno));
    }
#undef PUSH
    if (n == 0) {
        free(v);
        return tera_fail(TERA_ERR_IO, "data.path '%s' matches no file", path);
    }
    qsort(v, (size_t)n, sizeof *v, cmp_str);
    *out = v, *n_out = n;
    return TERA_OK;
}

/* A gzip file, decompressed (concatenated members too); NUL-terminated (not counted in *len). */
static tera_status read_gzip(const char *path, char **data, size_t *len) {
    gzFile g = gzopen(path, "rb");
    if (!g) return tera_fail(TERA_ERR_IO, "data.path: cannot open '%s': %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = tera_malloc(cap);
    int got;
    for (;;) {
        if (cap - n < (1 << 15)) buf = tera_realloc(buf, cap *= 2);
        got = gzread(g, buf + n, (unsigned)(cap - n - 1));
        if (got <= 0) break;
        n += (size_t)got;
    }
    int zerr = Z_OK;
    const char *msg = gzerror(g, &zerr); /* a truncated member ends reads with Z_BUF_ERROR */
    char why[160] = "";
    snprintf(why, sizeof why, "%s", gzdirect(g) ? "no gzip header" : msg ? msg : "");
    const int bad = got < 0 || (zerr != Z_OK && zerr != Z_STREAM_END) || gzdirect(g);
    gzclose(g);
    if (bad) {
        free(buf);
        return tera_fail(TERA_ERR_FORMAT, "data.path: '%s' is not a complete gzip stream (%s)", path, why);
    }
    buf[n] = '\0';
    *data = buf, *len = n;
    return TERA_OK;
}

/* The whole file, decompressed when it ends in .zst or .gz; NUL-terminated (not counted in *len). */
static tera_status read_shard(const char *path, char **data, size_t *len) {
    *data = NULL, *len = 0;
    if (ends_with(path, ".gz")) return read_gzip(path, data, len);
    FILE *f = fopen(path, "rb");
    if (!f) return tera_fail(TERA_ERR_IO, "data.path: cannot open '%s': %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = tera_malloc(cap);
    for (;;) {
        if (n == cap) buf = tera_realloc(buf, cap *= 2);
        const size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    const int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return tera_fail(TERA_ERR_IO, "data.path: error reading '%s'", path);
    }
    if (ends_with(path, ".zst")) { /* streaming decompression: frames without a content size too */
        ZSTD_DStream *z = ZSTD_createDStream();
        size_t ocap = n * 4 + (1 << 16), on = 0;
        char *out = tera_malloc(ocap);
        ZSTD_inBuffer in = {buf, n, 0};
        size_t rc = 1;
        while (in.pos < in.size) {
            if (ocap - on < (1 << 16)) out = tera_realloc(out, ocap *= 2);
            ZSTD_outBuffer o = {out + on, ocap - on, 0};
            rc = ZSTD_decompressStream(z, &o, &in);
            on += o.pos;
            if (ZSTD_isError(rc)) break;
        }
        ZSTD_freeDStream(z);
        free(buf);
        if (ZSTD_isError(rc) || rc != 0) {
            free(out);
            return tera_fail(TERA_ERR_FORMAT, "data.path: '%s' is not a complete zstd stream (%s)", path,
                             ZSTD_isError(rc) ? ZSTD_getErrorName(rc) : "truncated");
        }
        buf = out, n = on, cap = ocap;
    }
    if (n == cap) buf = tera_realloc(buf, cap + 1);
    buf[n] = '\0';
    *data = buf, *len = n;
    return TERA_OK;
}

int tera_online_is_jsonl(const char *format, const char *nm) {
    return !strcmp(format, "jsonl") ||
           (!strcmp(format, "auto") &&
            (ends_with(nm, ".jsonl") || ends_with(nm, ".jsonl.zst") || ends_with(nm, ".jsonl.gz") ||
             ends_with(nm, ".json") || ends_with(nm, ".json.zst") || ends_with(nm, ".json.gz")));
}

typedef tera_online_doc doc; /* owned: a decoded JSON string */

typedef struct {
    const tera_tokenizer *tok;
    doc *docs;
    int n;
    atomic_int next;
} work;

static void *worker(void *arg) {
    work *w = arg;
    for (;;) {
        const int i = atomic_fetch_add(&w->next, 1);
        if (i >= w->n) break;
        doc *d = &w->docs[i];
        d->st = tera_tokenizer_encode(w->tok, d->text, d->len, 0, &d->ids, &d->n_ids);
        if (d->st != TERA_OK) snprintf(d->err, sizeof d->err, "%s", tera_last_error());
    }
    return NULL;
}

void tera_online_encode(const tera_tokenizer *tok, tera_online_doc *docs, int n, int workers, pthread_t *th) {
    work w = {.tok = tok, .docs = docs, .n = n};
    atomic_init(&w.next, 0);
    const int nt = workers < n ? workers : (n > 0 ? n : 1);
    for (int i = 1; i < nt; i++) pthread_create(&th[i - 1], NULL, worker, &w);
    worker(&w);
    for (int i = 1; i < nt; i++) pthread_join(th[i - 1], NULL);
}

/* Splits one shard into documents (jsonl: the "text" field of every non-blank line; text: the file) */
static tera_status split_docs(const char *path, char *data, size_t len, int jsonl, doc **docs, int *n_docs,
                              int64_t *empty) {
    int n = 0, cap = 0;
    doc *v = NULL;
#define ADD(t, l, o)                                                                              \
    do {                                                                                          \
        if (n == cap) cap = cap ? 2 * cap : 256, v = tera_realloc(v, sizeof *v * (size_t)cap);     \
        memset(&v[n], 0, sizeof v[n]);                                                           \
        v[n].text = (t), v[n].len = (l), v[n].owned = (o);                                         \
        n++;                                                                                      \
    } while (0)
    tera_status st = TERA_OK;
    if (!jsonl) {
        if (len > 0) ADD(data, len, NULL);
        else (*empty)++;
    } else {
        int64_t lineno = 0;
        for (size_t at = 0; at < len;) {
            char *nl = memchr(data + at, '\n', len - at);
            const size_t end = nl ? (size_t)(nl - data) : len;
            lineno++;
            size_t a = at;
            while (a < end && isspace((unsigned char)data[a])) a++;
            if (a < end) {
                const char *why = NULL;
                cJSON *j = tera_jsonl_parse(data + at, end - at, &why);
                const cJSON *f = j ? cJSON_GetObjectItemCaseSensitive(j, "text") : NULL;
                if (!j || !cJSON_IsString(f)) {
                    cJSON_Delete(j);
                    st = tera_fail(TERA_ERR_FORMAT, "%s:%ld: %s", path, (long)lineno,
                                   j ? "no string field \"text\"" : why);
                    break;
                }
                const size_t l = strlen(f->valuestring);
                if (l == 0) (*empty)++;
                else {
                    char *o = tera_malloc(l + 1);
                    memcpy(o, f->valuestring, l + 1);
                    ADD(o, l, o);
                }
                cJSON_Delete(j);
            }
            at = end + 1;
        }
    }
#undef ADD
    *docs = v, *n_docs = n;
    return st;
}

tera_status tera_online_tokenizer(const tera_data_config *dc, int vocab_size, tera_tokenizer **out) {
    if (strcmp(dc->format, "auto") && strcmp(dc->format, "text") && strcmp(dc->format, "jsonl"))
        return tera_fail(TERA_ERR_CONFIG, "data.tokenizer is set: data.format must be text, jsonl or auto, not %s",
                         dc->format);
    if (!dc->path[0]) return tera_fail(TERA_ERR_CONFIG, "data.tokenizer is set but data.path is empty");
    tera_tokenizer *tok;
    TERA_TRY(tera_tokenizer_load(&tok, dc->tokenizer));
    const int32_t tv = tera_tokenizer_vocab_size(tok);
    if (tv > vocab_size) {
        tera_tokenizer_free(tok);
        return tera_fail(TERA_ERR_CONFIG, "data.tokenizer '%s' has %d tokens but model.vocab_size = %d", dc->tokenizer,
                         (int)tv, vocab_size);
    }
    *out = tok;
    return TERA_OK;
}

tera_status tera_online_open(tera_token_source *s, const tera_data_config *dc, int vocab_size) {
    const double t0 = tera_now();
    tera_tokenizer *tok;
    TERA_TRY(tera_online_tokenizer(dc, vocab_size, &tok));
    const int32_t eot = tera_tokenizer_eot(tok);
    tera_status st = TERA_OK;
    char **shards = NULL;
    int n_shards = 0;
    if ((st = tera_online_list_shards(dc->path, &shards, &n_shards)) != TERA_OK) {
        tera_tokenizer_free(tok);
        return st;
    }
    const int W = dc->tokenize_workers > 0 ? dc->tokenize_workers : 1;
    tera_comm *world = tera_comm_world(); /* the ranks share the encoding: every rank opens the source */
    const int R = tera_comm_size(world), wr = tera_comm_rank(world);
    pthread_t *th = tera_calloc((size_t)W, sizeof *th);
    size_t cap = 1 << 20, n = 0;
    int32_t *ids = tera_malloc(sizeof *ids * cap);
    int64_t n_docs = 0, empty = 0, bytes = 0;
    double t_tok = 0.0;
    for (int f = 0; f < n_shards && st == TERA_OK; f++) {
        char *data;
        size_t len;
        if ((st = read_shard(shards[f], &data, &len)) != TERA_OK) break;
        bytes += (int64_t)len;
        /* jsonl: data.format = jsonl, or auto and the shard is named *.jsonl / *.json (.zst) */
        const int jsonl = tera_online_is_jsonl(dc->format, shards[f]);
        doc *docs = NULL;
        int nd = 0;
        st = split_docs(shards[f], data, len, jsonl, &docs, &nd, &empty);
        const int n_split = nd; /* what to free */
        if (st != TERA_OK) nd = 0; /* the same on every rank: every rank reads and splits every shard */
        /* this rank encodes its share, the documents [lo, hi); the others' come by an all-gather */
        const int64_t lo = (int64_t)nd * wr / R, hi = (int64_t)nd * (wr + 1) / R;
        const double tt = tera_now();
        tera_online_encode(tok, docs + lo, (int)(hi - lo), W, th);
        t_tok += tera_now() - tt;
        /* every document's length (-1: it could not be encoded), agreed over the ranks before anything
         * moves; on a failure every rank encodes the first failing document itself, so all report the
         * same message */
        int64_t *info = tera_calloc((size_t)nd + 1, sizeof *info);
        for (int64_t i = lo; i < hi; i++) info[i] = docs[i].st == TERA_OK ? (int64_t)docs[i].n_ids : -1;
        if (R > 1) tera_comm_allreduce_i64(world, info, (int64_t)nd);
        for (int64_t i = 0; i < nd && st == TERA_OK; i++) {
            if (info[i] >= 0) continue;
            doc *d = &docs[i];
            if (d->st == TERA_OK) { /* another rank's share */
                d->st = tera_tokenizer_encode(tok, d->text, d->len, 0, &d->ids, &d->n_ids);
                if (d->st != TERA_OK) snprintf(d->err, sizeof d->err, "%s", tera_last_error());
            }
            st = tera_fail(d->st != TERA_OK ? d->st : TERA_ERR_FORMAT, "data.path: '%s'%s: %s", shards[f],
                           jsonl ? " (a JSON line)" : "", d->st != TERA_OK ? d->err : "could not be encoded on every rank");
        }
        if (st == TERA_OK) { /* packed in document order: this rank's range, then the all-gather */
            int64_t total = 0, at = 0;
            int64_t *counts = tera_calloc((size_t)R, sizeof *counts);
            for (int64_t i = 0, q = 0; i < nd; i++) {
                while (i >= (int64_t)nd * (q + 1) / R) q++;
                const int64_t k = info[i] + (eot >= 0);
                if (i < lo) at += k;
                counts[q] += k;
                total += k;
            }
            while (n + (size_t)total > cap) ids = tera_realloc(ids, sizeof *ids * (cap *= 2));
            int32_t *o = ids + n + at;
            for (int64_t i = lo; i < hi; i++) {
                memcpy(o, docs[i].ids, sizeof *o * docs[i].n_ids);
                o += docs[i].n_ids;
                if (eot >= 0) *o++ = eot;
            }
            /* ids travel as 4-byte elements, bits unchanged (the all-gather copies, it does not add) */
            if (R > 1) tera_comm_allgather_f32(world, (float *)(void *)(ids + n), counts);
            free(counts);
            n += (size_t)total;
            n_docs += nd;
        }
        free(info);
        for (int i = 0; i < n_split; i++) free(docs[i].ids), free(docs[i].owned);
        free(docs);
        free(data);
    }
    for (int f = 0; f < n_shards; f++) free(shards[f]);
    free(shards);
    free(th);
    tera_tokenizer_free(tok);
    if (st == TERA_OK && n_docs == 0)
        st = tera_fail(TERA_ERR_FORMAT, "data.path '%s': no document (%ld empty ones skipped)", dc->path, (long)empty);
    if (st != TERA_OK) {
        free(ids);
        return st;
    }
    memset(s, 0, sizeof *s);
    s->kind = TERA_SRC_ONLINE;
    snprintf(s->path, sizeof s->path, "%s", dc->path);
    s->n_tokens = (int64_t)n;
    s->elem_size = 4;
    s->tokens = ids;
    s->owned = ids;
    s->n_docs = n_docs;
    s->online.shards = n_shards, s->online.bytes = bytes, s->online.workers = W, s->online.ranks = R;
    s->online.tokenize_seconds = t_tok, s->online.seconds = tera_now() - t0;
    return TERA_OK;
}
