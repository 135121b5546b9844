/* Streaming online tokenization (data.tokenizer with data.stream = true, the default): every
 * data-parallel rank reads its own shards (shard i of the sorted list on dp rank i mod dp) during
 * training. A producer thread reads the rank's shards in order (plain, gzip or zstd, decompressed
 * chunk by chunk), splits them into documents (text: one per file; jsonl: one per line, field
 * "text"), has batches of documents encoded by data.tokenize_workers threads (results placed by the
 * document's index, so the worker count never changes the tokens) and packs them in document order,
 * each followed by the end-of-document token, into samples of T + 1 tokens (sample k of the rank's
 * stream = tokens [k T, k T + T + 1)), into a bounded ring. When the rank's last shard ends, the next
 * pass (epoch) starts at its first shard. Memory per rank: the ring, one batch of documents and the
 * read buffers; it does not grow with the data.
 *
 * Positions. Every sample is produced with its start (stream.h: shard, document byte offset, token
 * offset in the document, epoch, sample), kept for the last HIST samples, so a checkpoint can name
 * where the next sample of each rank begins (tera_loader_sync, src/data/data_state.c) and a restart
 * re-reads only that one document. A request behind the ring, or far ahead of a known position,
 * restarts the producer at the nearest known position before it (at worst the stream's start): a
 * seek is never wrong, only slower. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <zlib.h>
#include <zstd.h>

#include "data/online.h"
#include "data/stream.h"
#include "tera/comm.h"
#include "tera/io.h"
#include "tera/profile.h"
#include "tera/tokenizer.h"

#define HIST 4096             /* sample start positions kept (a checkpoint's sample is at most the read-ahead back) */
#define BATCH_DOCS 256        /* documents per encoding batch ... */
#define BATCH_BYTES (1 << 18) /* ... or this much text */
#define CHUNK (1 << 16)       /* read and decompression chunk */

struct tera_stream {
    tera_tokenizer *tok;
    int32_t eot;
    int W;
    char format[16];
    char path[TERA_PATH_MAX];
    char **all;
    int n_all;
    uint64_t fingerprint;
    /* tera_loader_bind */
    int bound, dp_rank, dp, B, T;
    int *mine; /* this rank's shards: indices into all */
    int n_mine;
    int64_t c0, Lbase;       /* global sample c0 is sample Lbase of this rank's stream */
    tera_stream_pos load;    /* the last restart point (resume) */
    int loaded;
    tera_stream_pos *synced; /* [dp] */
    /* the ring of samples [lo, hi) */
    pthread_mutex_t cmu; /* one consumer at a time (the prefetcher, the step, evaluation) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int C;
    int32_t *ring;          /* [C][T + 1] */
    tera_stream_pos *rpos;  /* [C] */
    tera_stream_pos *hist;  /* [HIST], hist[L % HIST] is sample htag[...]'s start */
    int64_t *htag;
    int64_t lo, hi;
    pthread_t th;
    int running, stop, failed;
    tera_stream_pos start;  /* where the running producer began */
    char err[1024];
    /* totals (the producer's, under mu) */
    int64_t docs, tokens, bytes; /* encoded (bytes: the documents' text) */
    double enc_seconds;
    int load_starts; /* producer starts at the restart point (a resume's byte offset) */
};

/* ------------------------------------------------------------------ reading a shard */

typedef struct {
    const char *path;
    int kind; /* 0 plain, 1 gzip, 2 zstd */
    FILE *f;
    gzFile g;
    ZSTD_DStream *z;
    unsigned char *zin;
    ZSTD_inBuffer in;
    size_t zrc;
    int in_eof;
    char *buf;
    size_t cap, beg, end; /* valid bytes buf[beg, end) */
    int64_t off, line;    /* decompressed offset of buf[beg], lines before it */
    int eof;
} rd;

static int ends_with(const char *s, const char *suf) {
    const size_t n = strlen(s), k = strlen(suf);
    return n >= k && !strcmp(s + n - k, suf);
}

static void rd_close(rd *r) {
    if (r->f) fclose(r->f);
    if (r->g) gzclose(r->g);
    if (r->z) ZSTD_freeDStream(r->z);
    free(r->zin);
    free(r->buf);
    memset(r, 0, sizeof *r);
}

static tera_status rd_open(rd *r, const char *path) {
    memset(r, 0, sizeof *r);
    r->path = path;
    r->kind = ends_with(path, ".gz") ? 1 : ends_with(path, ".zst") ? 2 : 0;
    if (r->kind == 1) r->g = gzopen(path, "rb");
    else r->f = fopen(path, "rb");
    if (!r->f && !r->g) return tera_fail(TERA_ERR_IO, "data.path: cannot open '%s': %s", path, strerror(errno));
    if (r->kind == 2) {
        r->z = ZSTD_createDStream();
        r->zin = tera_malloc(CHUNK);
        r->in = (ZSTD_inBuffer){r->zin, 0, 0};
        r->zrc = 1;
    }
    r->cap = 2 * CHUNK;
    r->buf = tera_malloc(r->cap + 1);
    return TERA_OK;
}

/* Up to n decompressed bytes into dst; 0 at the end. */
static tera_status raw_read(rd *r, char *dst, size_t n, size_t *got) {
    *got = 0;
    if (r->kind == 0) {
        *got = fread(dst, 1, n, r->f);
        if (*got == 0 && ferror(r->f)) return tera_fail(TERA_ERR_IO, "data.path: error reading '%s'", r->path);
        return TERA_OK;
    }
    if (r->kind == 1) {
        const int k = gzread(r->g, dst, (unsigned)n);
        int zerr = Z_OK;
        const char *msg = gzerror(r->g, &zerr);
        if (k < 0 || (zerr != Z_OK && zerr != Z_STREAM_END) || gzdirect(r->g))
            return tera_fail(TERA_ERR_FORMAT, "data.path: '%s' is not a complete gzip stream (%s)", r->path,
                             gzdirect(r->g) ? "no gzip header" : msg ? msg : "");
        *got = (size_t)k;
        return TERA_OK;
    }
    for (;;) { /* zstd: until some output, or the input's end */
        if (r->in.pos == r->in.size && !r->in_eof) {
            r->in.size = fread(r->zin, 1, CHUNK, r->f), r->in.pos = 0;
            if (r->in.size == 0) {
                if (ferror(r->f)) return tera_fail(TERA_ERR_IO, "data.path: error reading '%s'", r->path);
                r->in_eof = 1;
            }
        }
        if (r->in.pos == r->in.size && r->in_eof) {
            if (r->zrc != 0)
                return tera_fail(TERA_ERR_FORMAT, "data.path: '%s' is not a complete zstd stream (truncated)", r->path);
            return TERA_OK;
        }
        ZSTD_outBuffer o = {dst, n, 0};
        r->zrc = ZSTD_decompressStream(r->z, &o, &r->in);
        if (ZSTD_isError(r->zrc))
            return tera_fail(TERA_ERR_FORMAT, "data.path: '%s' is not a complete zstd stream (%s)", r->path,
                             ZSTD_getErrorName(r->zrc));
        if (o.pos > 0) {
            *got = o.pos;
            return TERA_OK;
        }
    }
}

/* More bytes into the buffer (compacting, growing when full); sets eof at the end. */
static tera_status rd_fill(rd *r) {
    if (r->beg > 0) {
        memmove(r->buf, r->buf + r->beg, r->end - r->beg);
        r->end -= r->beg, r->beg = 0;
    }
    if (r->cap - r->end < CHUNK) {
        r->cap *= 2;
        char *b = realloc(r->buf, r->cap + 1);
        TERA_ASSERTF(b, "src/data/stream.c: out of memory (%zu bytes)", r->cap + 1);
        r->buf = b;
    }
    size_t got;
    TERA_TRY(raw_read(r, r->buf + r->end, r->cap - r->end, &got));
    if (got == 0) r->eof = 1;
    r->end += got;
    return TERA_OK;
}

/* Drops the first n bytes (a restart's document offset), counting lines. */
static tera_status rd_skip(rd *r, int64_t n) {
    while (n > 0) {
        if (r->beg == r->end) {
            if (r->eof) return tera_fail(TERA_ERR_FORMAT, "data.path: '%s' is shorter than the checkpoint's position "
                                         "(byte %lld): the shard changed", r->path, (long long)(r->off + n));
            TERA_TRY(rd_fill(r));
            continue;
        }
        size_t k = r->end - r->beg;
        if ((int64_t)k > n) k = (size_t)n;
        for (const char *p = r->buf + r->beg, *e = p + k; (p = memchr(p, '\n', (size_t)(e - p))); p++) r->line++;
        r->beg += k, r->off += (int64_t)k, n -= (int64_t)k;
    }
    return TERA_OK;
}

/* The next line (without its newline): *p, *len valid until the next call; *at its offset; 0 at the end. */
static tera_status rd_line(rd *r, const char **p, size_t *len, int64_t *at, int *got) {
    *got = 0;
    for (size_t scanned = 0;;) {
        char *nl = memchr(r->buf + r->beg + scanned, '\n', r->end - r->beg - scanned);
        if (nl || (r->eof && r->end > r->beg)) {
            const size_t n = nl ? (size_t)(nl - (r->buf + r->beg)) : r->end - r->beg;
            *p = r->buf + r->beg, *len = n, *at = r->off, *got = 1;
            const size_t step = n + (nl != NULL);
            r->beg += step, r->off += (int64_t)step, r->line++;
            return TERA_OK;
        }
        if (r->eof) return TERA_OK;
        scanned = r->end - r->beg;
        TERA_TRY(rd_fill(r));
    }
}

/* ------------------------------------------------------------------ the producer */

typedef tera_online_doc sdoc; /* text: its own copy (freed with the batch) */

/* The producer's reading state: the open shard and where it is in the rank's list. */
typedef struct {
    struct tera_stream *st;
    rd r;
    int open, jsonl;
    int64_t epoch, shard;
    int64_t docs_since_wrap; /* documents read since the last wrap (a rank without any never ends a pass) */
    int wraps_empty;
} reader;

static tera_status reader_open(reader *q, int64_t offset) {
    struct tera_stream *st = q->st;
    const char *path = st->all[st->mine[q->shard]];
    TERA_TRY(rd_open(&q->r, path));
    q->open = 1;
    q->jsonl = tera_online_is_jsonl(st->format, path);
    return rd_skip(&q->r, offset);
}

/* The next non-empty document into d (text owned by d); *got = 0 never happens: the stream wraps. */
static tera_status next_doc(reader *q, sdoc *d) {
    struct tera_stream *st = q->st;
    for (;;) {
        if (!q->open) TERA_TRY(reader_open(q, 0));
        rd *r = &q->r;
        if (!q->jsonl) { /* the whole shard is one document, read whole */
            if (r->off == 0 && !r->eof) {
                while (!r->eof) TERA_TRY(rd_fill(r));
                const size_t n = r->end - r->beg;
                r->beg = r->end, r->off = (int64_t)n;
                if (n > 0) {
                    memset(d, 0, sizeof *d);
                    d->text = tera_malloc(n + 1);
                    memcpy(d->text, r->buf + r->beg - n, n);
                    d->text[n] = '\0';
                    d->len = n, d->epoch = q->epoch, d->shard = q->shard, d->offset = 0, d->line = 0;
                    q->docs_since_wrap++;
                    return TERA_OK;
                }
            }
        } else {
            const char *p;
            size_t n;
            int64_t at;
            int got;
            for (;;) {
                TERA_TRY(rd_line(r, &p, &n, &at, &got));
                if (!got) break;
                size_t a = 0;
                while (a < n && (p[a] == ' ' || p[a] == '\t' || p[a] == '\r' || p[a] == '\f' || p[a] == '\v')) a++;
                if (a == n) continue; /* blank */
                const char *why = NULL;
                cJSON *j = tera_jsonl_parse(p, n, &why);
                const cJSON *f = j ? cJSON_GetObjectItemCaseSensitive(j, "text") : NULL;
                if (!j || !cJSON_IsString(f)) {
                    cJSON_Delete(j);
                    return tera_fail(TERA_ERR_FORMAT, "%s:%lld: %s", r->path, (long long)r->line,
                                     j ? "no string field \"text\"" : why);
                }
                const size_t l = strlen(f->valuestring);
                if (l > 0) {
                    memset(d, 0, sizeof *d);
                    d->text = tera_malloc(l + 1);
                    memcpy(d->text, f->valuestring, l + 1);
                    d->len = l, d->epoch = q->epoch, d->shard = q->shard, d->offset = at, d->line = r->line;
                    q->docs_since_wrap++;
                    cJSON_Delete(j);
                    return TERA_OK;
                }
                cJSON_Delete(j);
            }
        }
        /* the shard's end: the next one, or the next pass */
        rd_close(r);
        q->open = 0;
        if (++q->shard == st->n_mine) {
            q->shard = 0, q->epoch++;
            if (q->docs_since_wrap == 0 && ++q->wraps_empty >= 2)
                return tera_fail(TERA_ERR_FORMAT, "data.path '%s': the shards of data-parallel rank %d (%s, ...) hold no "
                                 "document", st->path, st->dp_rank, st->all[st->mine[0]]);
            q->docs_since_wrap = 0;
        }
    }
}

/* Appends a finished sample; 0 when asked to stop. */
static int push(struct tera_stream *st, const int32_t *cur, const tera_stream_pos *pos) {
    pthread_mutex_lock(&st->mu);
    while (!st->stop && st->hi - st->lo >= st->C) pthread_cond_wait(&st->cv, &st->mu);
    const int ok = !st->stop;
    if (ok) {
        const int64_t L = st->hi;
        TERA_ASSERT(L == pos->sample);
        memcpy(st->ring + (size_t)(L % st->C) * (size_t)(st->T + 1), cur, sizeof *cur * (size_t)(st->T + 1));
        st->rpos[L % st->C] = *pos;
        st->hist[L % HIST] = *pos;
        st->htag[L % HIST] = L;
        st->hi = L + 1;
        pthread_cond_broadcast(&st->cv);
    }
    pthread_mutex_unlock(&st->mu);
    return ok;
}

static void *producer(void *arg) {
    struct tera_stream *st = arg;
    pthread_mutex_lock(&st->mu);
    const tera_stream_pos p0 = st->start;
    pthread_mutex_unlock(&st->mu);
    const int T = st->T;
    reader q = {.st = st, .epoch = p0.epoch, .shard = p0.shard};
    int32_t *cur = tera_malloc(sizeof *cur * (size_t)(T + 1));
    sdoc *docs = tera_calloc(BATCH_DOCS, sizeof *docs);
    pthread_t *th = tera_calloc((size_t)st->W, sizeof *th);
    tera_status s = reader_open(&q, p0.offset);
    int64_t L = p0.sample, skip = p0.token;
    int f = 0, first = 1;
    tera_stream_pos cp = p0;
    while (s == TERA_OK) {
        int nd = 0;
        size_t bytes = 0;
        while (nd < BATCH_DOCS && bytes < BATCH_BYTES && s == TERA_OK) {
            if ((s = next_doc(&q, &docs[nd])) == TERA_OK) bytes += docs[nd++].len;
            if (first) break; /* the restart's document alone: its offset must be the one asked for */
        }
        if (s != TERA_OK) {
            for (int i = 0; i < nd; i++) free(docs[i].text);
            break;
        }
        /* a recorded position names a document's first byte (the stream's start {0, ...} need not) */
        const int synthetic = !p0.epoch && !p0.shard && !p0.offset && !p0.token && !p0.sample;
        if (first && !synthetic && (docs[0].offset != p0.offset || docs[0].shard != p0.shard)) {
            s = tera_fail(TERA_ERR_FORMAT, "data.path: '%s' has no document at byte %lld (the checkpoint's position): "
                          "the shard changed", st->all[st->mine[p0.shard]], (long long)p0.offset);
            break;
        }
        const double t0 = tera_now();
        tera_online_encode(st->tok, docs, nd, st->W, th);
        const double enc = tera_now() - t0;
        int64_t ntok = 0, nbytes = 0;
        for (int i = 0; i < nd; i++) ntok += (int64_t)docs[i].n_ids + (st->eot >= 0), nbytes += (int64_t)docs[i].len;
        int stopped = 0;
        for (int i = 0; i < nd && s == TERA_OK && !stopped; i++) {
            sdoc *d = &docs[i];
            if (d->st != TERA_OK) {
                char where[32] = "";
                if (d->line > 0) snprintf(where, sizeof where, ":%lld", (long long)d->line);
                s = tera_fail(d->st, "data.path: '%s'%s: %s", st->all[st->mine[d->shard]], where, d->err);
                break;
            }
            const int64_t n = (int64_t)d->n_ids + (st->eot >= 0);
            for (int64_t k = first ? skip : 0; k < n; k++) {
                if (f == 0) cp = (tera_stream_pos){d->epoch, d->shard, d->offset, k, L};
                cur[f++] = k < (int64_t)d->n_ids ? d->ids[k] : st->eot;
                if (f == T + 1) {
                    if (!push(st, cur, &cp)) {
                        stopped = 1;
                        break;
                    }
                    L++;
                    cur[0] = cur[T], f = 1; /* the next sample starts with this token */
                    cp = (tera_stream_pos){d->epoch, d->shard, d->offset, k, L};
                }
            }
            first = 0;
        }
        pthread_mutex_lock(&st->mu);
        st->docs += nd, st->tokens += ntok, st->bytes += nbytes, st->enc_seconds += enc;
        pthread_mutex_unlock(&st->mu);
        for (int i = 0; i < nd; i++) free(docs[i].text), free(docs[i].ids);
        if (stopped) break;
    }
    if (q.open) rd_close(&q.r);
    free(th);
    free(docs);
    free(cur);
    pthread_mutex_lock(&st->mu);
    if (s != TERA_OK) {
        snprintf(st->err, sizeof st->err, "%s", tera_last_error());
        st->failed = 1;
        pthread_cond_broadcast(&st->cv);
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

/* ------------------------------------------------------------------ the consumer (holds cmu) */

static void producer_stop(struct tera_stream *st) { /* holds mu */
    if (!st->running) return;
    st->stop = 1;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    pthread_join(st->th, NULL);
    pthread_mutex_lock(&st->mu);
    st->running = 0, st->stop = 0;
}

static void producer_start(struct tera_stream *st, const tera_stream_pos *p) { /* holds mu */
    producer_stop(st);
    if (st->loaded && !memcmp(p, &st->load, sizeof *p) && p->sample > 0) st->load_starts++;
    st->start = *p;
    st->lo = st->hi = p->sample;
    st->failed = 0;
    st->running = 1;
    TERA_ASSERTF(pthread_create(&st->th, NULL, producer, st) == 0, "cannot start the data streaming thread");
}

/* The nearest known sample start at or before L (at worst the stream's beginning). holds mu */
static tera_stream_pos known_before(const struct tera_stream *st, int64_t L) {
    tera_stream_pos best = {0, 0, 0, 0, 0};
    if (st->loaded && st->load.sample <= L) best = st->load;
    for (int i = 0; i < HIST; i++)
        if (st->htag[i] >= 0 && st->htag[i] <= L && st->htag[i] > best.sample) best = st->hist[i];
    return best;
}

static void fatal(struct tera_stream *st) { /* holds mu: bad input met while training */
    fprintf(stderr, "tera: error: %s\n", st->err);
    fflush(stderr);
    exit(1);
}

/* Sample L of this rank's stream is in the ring afterwards (samples before it dropped). holds mu */
static void ensure(struct tera_stream *st, int64_t L) {
    if (!st->running || L < st->lo) {
        const tera_stream_pos p = known_before(st, L);
        producer_start(st, &p);
    } else if (st->loaded && st->load.sample > st->hi && st->load.sample <= L) {
        producer_start(st, &st->load); /* a resume point ahead of the producer */
    } else if (L >= st->hi + st->C) { /* far ahead: a known position nearer? */
        const tera_stream_pos p = known_before(st, L);
        if (p.sample > st->hi) producer_start(st, &p);
    }
    while (st->hi <= L && !st->failed) {
        if (st->lo < st->hi) {
            st->lo = st->hi; /* passed over: free the ring */
            pthread_cond_broadcast(&st->cv);
        }
        pthread_cond_wait(&st->cv, &st->mu);
    }
    if (st->hi <= L && st->failed) fatal(st);
    if (st->lo < L) {
        st->lo = L;
        pthread_cond_broadcast(&st->cv);
    }
}

static int64_t floordiv(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

static int64_t local_of(const struct tera_stream *st, int64_t g) {
    const int64_t d = g - st->c0, q = floordiv(d, st->B);
    const int64_t L = st->Lbase + floordiv(q, st->dp) * st->B + (d - q * st->B);
    return L < 0 ? 0 : L;
}

void tera_stream_sample(struct tera_stream *st, int64_t g, int32_t *inputs, int32_t *targets) {
    TERA_ASSERTF(st->bound, "streamed data read before tera_loader_bind");
    pthread_mutex_lock(&st->cmu);
    pthread_mutex_lock(&st->mu);
    const int64_t L = local_of(st, g);
    ensure(st, L);
    const int32_t *s = st->ring + (size_t)(L % st->C) * (size_t)(st->T + 1);
    memcpy(inputs, s, sizeof *inputs * (size_t)st->T);
    memcpy(targets, s + 1, sizeof *targets * (size_t)st->T);
    pthread_mutex_unlock(&st->mu);
    pthread_mutex_unlock(&st->cmu);
}

/* ------------------------------------------------------------------ open, bind, sync, close */

tera_status tera_stream_open(tera_token_source *s, const tera_data_config *dc, int vocab_size) {
    tera_tokenizer *tok;
    TERA_TRY(tera_online_tokenizer(dc, vocab_size, &tok));
    char **all = NULL;
    int n_all = 0;
    tera_status st = tera_online_list_shards(dc->path, &all, &n_all);
    for (int i = 0; i < n_all && st == TERA_OK; i++) { /* each opens (its contents are read during training) */
        FILE *f = fopen(all[i], "rb");
        if (!f) st = tera_fail(TERA_ERR_IO, "data.path: cannot open '%s': %s", all[i], strerror(errno));
        else fclose(f);
    }
    if (st != TERA_OK) {
        for (int i = 0; i < n_all; i++) free(all[i]);
        free(all);
        tera_tokenizer_free(tok);
        return st;
    }
    struct tera_stream *x = tera_calloc(1, sizeof *x);
    x->tok = tok;
    x->eot = tera_tokenizer_eot(tok);
    x->W = dc->tokenize_workers > 0 ? dc->tokenize_workers : 1;
    snprintf(x->format, sizeof x->format, "%s", dc->format);
    snprintf(x->path, sizeof x->path, "%s", dc->path);
    x->all = all, x->n_all = n_all;
    uint64_t h = 1469598103934665603ull; /* FNV-1a of the base names (a moved directory still resumes) and format */
    for (int i = 0; i < n_all; i++) {
        const char *b = strrchr(all[i], '/');
        for (const char *c = b ? b + 1 : all[i];; c++) {
            h = (h ^ (unsigned char)*c) * 1099511628211ull;
            if (!*c) break;
        }
    }
    for (const char *c = dc->format; *c; c++) h = (h ^ (unsigned char)*c) * 1099511628211ull;
    x->fingerprint = h;
    pthread_mutex_init(&x->cmu, NULL);
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->cv, NULL);
    memset(s, 0, sizeof *s);
    s->kind = TERA_SRC_STREAM;
    snprintf(s->path, sizeof s->path, "%s", dc->path);
    s->elem_size = 4;
    s->stream = x;
    s->online.shards = n_all, s->online.workers = x->W, s->online.ranks = 1;
    return TERA_OK;
}

tera_status tera_loader_bind(tera_loader *l, int dp_rank, int dp_size, int micro, int eval_every) {
    struct tera_stream *st = l->src ? l->src->stream : NULL;
    if (!st) return TERA_OK;
    if (eval_every > 0 && !l->src->val)
        return tera_fail(TERA_ERR_CONFIG, "training.eval_every = %d: streamed online tokenization (data.stream = true) "
                         "keeps no validation split; give a validation set (data.val_path), or set data.stream = false "
                         "(the start-up pass) to evaluate on a held-out tail", eval_every);
    if (dp_size > st->n_all)
        return tera_fail(TERA_ERR_CONFIG, "data.path '%s': %d shard(s) for parallel.dp = %d: each data-parallel rank "
                         "streams its own shards (shard i on dp rank i mod dp), give at least %d shards or set "
                         "data.stream = false", st->path, st->n_all, dp_size, dp_size);
    TERA_ASSERT(!st->bound && micro >= 1 && l->T >= 1);
    st->dp_rank = dp_rank, st->dp = dp_size, st->B = micro, st->T = l->T;
    st->mine = tera_calloc((size_t)st->n_all, sizeof *st->mine);
    for (int i = dp_rank; i < st->n_all; i += dp_size) st->mine[st->n_mine++] = i;
    st->C = 4 * micro < 64 ? 64 : 4 * micro; /* samples ahead: a few micro-batches */
    st->ring = tera_malloc(sizeof *st->ring * (size_t)st->C * (size_t)(st->T + 1));
    st->rpos = tera_calloc((size_t)st->C, sizeof *st->rpos);
    st->hist = tera_calloc(HIST, sizeof *st->hist);
    st->htag = tera_malloc(sizeof *st->htag * HIST);
    for (int i = 0; i < HIST; i++) st->htag[i] = -1;
    st->synced = tera_calloc((size_t)dp_size, sizeof *st->synced);
    st->bound = 1;
    if (tera_comm_rank(tera_comm_world()) == 0)
        fprintf(stderr, "tera: streaming tokenization: %d shard(s) over %d data-parallel rank(s) (shard i on dp rank i "
                "mod %d), %d worker(s) per rank, read-ahead %d samples\n", st->n_all, dp_size, dp_size, st->W, st->C);
    return TERA_OK;
}

void tera_loader_sync(const tera_loader *l, tera_comm *dp, int64_t consumed) {
    struct tera_stream *st = l->src ? l->src->stream : NULL;
    if (!st || !st->bound) return;
    pthread_mutex_lock(&st->cmu);
    pthread_mutex_lock(&st->mu);
    const int64_t L = local_of(st, consumed);
    tera_stream_pos p;
    if (st->htag[L % HIST] == L) p = st->hist[L % HIST];
    else if (st->loaded && st->load.sample == L) p = st->load;
    else if (L == 0) p = (tera_stream_pos){0, 0, 0, 0, 0};
    else {
        ensure(st, L);
        p = st->rpos[L % st->C];
    }
    pthread_mutex_unlock(&st->mu);
    pthread_mutex_unlock(&st->cmu);
    const int F = TERA_STREAM_POS_FIELDS;
    int64_t *v = tera_calloc((size_t)st->dp * F, sizeof *v); /* at a checkpoint, not in the step loop */
    const int64_t mine[TERA_STREAM_POS_FIELDS] = {p.epoch, p.shard, p.offset, p.token, p.sample};
    memcpy(v + (size_t)st->dp_rank * F, mine, sizeof mine);
    if (st->dp > 1) tera_comm_allreduce_i64(dp, v, (int64_t)st->dp * F);
    for (int r = 0; r < st->dp; r++)
        st->synced[r] = (tera_stream_pos){v[r * F], v[r * F + 1], v[r * F + 2], v[r * F + 3], v[r * F + 4]};
    free(v);
}

tera_status tera_stream_restart(struct tera_stream *st, int64_t consumed, const tera_stream_pos *pos) {
    TERA_ASSERT(st->bound);
    if (pos->shard < 0 || pos->shard >= st->n_mine || pos->offset < 0 || pos->token < 0 || pos->sample < 0 ||
        pos->epoch < 0)
        return tera_fail(TERA_ERR_FORMAT, "data.stream position of dp rank %d (shard %lld of %d, byte %lld, token "
                         "%lld) is out of range", st->dp_rank, (long long)pos->shard, st->n_mine,
                         (long long)pos->offset, (long long)pos->token);
    pthread_mutex_lock(&st->cmu);
    pthread_mutex_lock(&st->mu);
    producer_stop(st); /* the next request starts it at the nearest known position */
    for (int i = 0; i < HIST; i++) st->htag[i] = -1;
    st->c0 = consumed, st->Lbase = pos->sample;
    st->load = *pos, st->loaded = 1;
    st->lo = st->hi = 0;
    pthread_mutex_unlock(&st->mu);
    pthread_mutex_unlock(&st->cmu);
    return TERA_OK;
}

void tera_stream_close(struct tera_stream *st) {
    if (!st) return;
    pthread_mutex_lock(&st->mu);
    producer_stop(st);
    pthread_mutex_unlock(&st->mu);
    if (st->bound && st->docs > 0 && tera_comm_rank(tera_comm_world()) == 0)
        fprintf(stderr, "tera: streaming tokenization (this rank, read-ahead included): %lld documents, %lld tokens, "
                "%.2f MB of text; encoding %.2f s on %d worker(s): %.0f tokens/s; %d start(s) at a checkpoint's "
                "position\n", (long long)st->docs, (long long)st->tokens, (double)st->bytes / 1e6, st->enc_seconds,
                st->W, st->enc_seconds > 0 ? (double)st->tokens / st->enc_seconds : 0.0, st->load_starts);
    pthread_cond_destroy(&st->cv);
    pthread_mutex_destroy(&st->mu);
    pthread_mutex_destroy(&st->cmu);
    for (int i = 0; i < st->n_all; i++) free(st->all[i]);
    free(st->all);
    free(st->mine);
    free(st->ring);
    free(st->rpos);
    free(st->hist);
    free(st->htag);
    free(st->synced);
    tera_tokenizer_free(st->tok);
    free(st);
}

int tera_stream_dp(const struct tera_stream *st) { return st->dp; }
int tera_stream_dp_rank(const struct tera_stream *st) { return st->dp_rank; }
int tera_stream_n_shards(const struct tera_stream *st) { return st->n_all; }
uint64_t tera_stream_fingerprint(const struct tera_stream *st) { return st->fingerprint; }
const char *tera_stream_shard_name(const struct tera_stream *st, int r, int64_t i) {
    const int64_t k = r + i * st->dp;
    return k >= 0 && k < st->n_all ? st->all[k] : "?";
}
const tera_stream_pos *tera_stream_synced(const struct tera_stream *st) { return st->bound ? st->synced : NULL; }
