/* Dataset preparation: documents are read in batches, encoded in parallel (one document per
 * thread at a time, or one large document split across threads), and appended in input order to
 * a streaming .bin/.idx writer. */
#include "tera/prepare.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "tera/data.h"
#include "tera/io.h"
#include "tera/profile.h"

#define BATCH_DOCS 512                 /* documents encoded in parallel per round */
#define BIG_DOC (4u << 20)             /* documents above this are split across threads */

typedef struct {
    const char *text;   /* document bytes (into a mapping or a decoded JSON string) */
    size_t len;
    char *owned;        /* decoded JSON text to free, or NULL */
    int32_t *ids;       /* encoded result */
    size_t n_ids;
    tera_status st;
    char err[512];
    int64_t line;       /* JSON line number (1-based), 0 for whole files */
} doc_slot;

#define MAX_WARNINGS 10                /* empty-document warnings printed one by one */

typedef struct {
    const tera_prepare_opts *o;
    tera_idx_writer *w;
    tera_prepare_stats *stats;
    int64_t total_bytes, done_bytes;   /* input file bytes: all, and read so far */
    int64_t empty_docs;                /* skipped empty documents */
    int bar_open;                      /* a progress line without its newline is on stderr */
    double t0, last_print;
} prep_ctx;

static int is_jsonl(const char *path) {
    size_t n = strlen(path);
    return (n > 6 && !strcmp(path + n - 6, ".jsonl")) || (n > 5 && !strcmp(path + n - 5, ".json"));
}

static void progress(prep_ctx *c, int final) {
    if (!c->o->progress) return;
    double now = tera_now();
    if (!final && now - c->last_print < 0.5) return;
    c->last_print = now;
    if (final) c->done_bytes = c->total_bytes; /* every input read (even if one changed size meanwhile) */
    double el = now - c->t0, frac = c->total_bytes ? (double)c->done_bytes / (double)c->total_bytes : 1.0;
    if (frac > 1.0) frac = 1.0;
    int bar = (int)(frac * 30);
    char b[31];
    for (int i = 0; i < 30; i++) b[i] = i < bar ? '#' : '.';
    b[30] = 0;
    double eta = frac > 0 ? el * (1.0 - frac) / frac : 0;
    fprintf(stderr, "\rprepare [%s] %5.1f%% | %ld docs | %ld tokens | %.1f MB/s | ETA %.0fs%s", b, 100 * frac,
            (long)c->stats->documents, (long)c->stats->tokens, el > 0 ? (double)c->done_bytes / el / 1e6 : 0.0, eta,
            final ? "\n" : "");
    fflush(stderr);
    c->bar_open = !final;
}

/* An empty document is skipped with a warning naming it (the first MAX_WARNINGS, then a count). */
static void skip_empty(prep_ctx *c, const char *path, int64_t lineno) {
    if (++c->empty_docs > MAX_WARNINGS) return;
    if (c->bar_open) fputc('\n', stderr);
    c->bar_open = 0;
    if (lineno) fprintf(stderr, "tera: warning: %s:%ld: empty document (field \"%s\" is \"\"); skipped\n", path,
                        (long)lineno, c->o->field);
    else fprintf(stderr, "tera: warning: input '%s' is empty; skipped\n", path);
}

static void encode_slot(const tera_prepare_opts *o, doc_slot *d, int threads) {
    if (!o->tok) { /* byte-level */
        d->ids = tera_malloc(sizeof(int32_t) * (d->len ? d->len : 1));
        for (size_t i = 0; i < d->len; i++) d->ids[i] = (unsigned char)d->text[i];
        d->n_ids = d->len;
        d->st = TERA_OK;
        return;
    }
    const unsigned flags = o->allow_special ? TERA_TOK_ALLOW_SPECIAL : 0;
    d->st = threads > 1 ? tera_tokenizer_encode_parallel(o->tok, d->text, d->len, flags, threads, &d->ids, &d->n_ids)
                        : tera_tokenizer_encode(o->tok, d->text, d->len, flags, &d->ids, &d->n_ids);
    if (d->st != TERA_OK) snprintf(d->err, sizeof d->err, "%s", tera_last_error());
}

/* Encodes slots [0, n) and appends them in order. */
static tera_status flush_batch(prep_ctx *c, const char *path, doc_slot *slots, int n) {
    const tera_prepare_opts *o = c->o;
    const int threads = o->threads > 0 ? o->threads : omp_get_num_procs();
    if (n == 1 && slots[0].len >= BIG_DOC) {
        encode_slot(o, &slots[0], threads);
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int i = 0; i < n; i++) encode_slot(o, &slots[i], 1);
    }
    tera_status st = TERA_OK;
    const int32_t eot = o->tok ? tera_tokenizer_eot(o->tok) : -1;
    for (int i = 0; i < n; i++) {
        doc_slot *d = &slots[i];
        if (st == TERA_OK && d->st != TERA_OK) {
            st = d->line ? tera_fail(d->st, "%s:%ld: %s", path, (long)d->line, d->err)
                         : tera_fail(d->st, "%s: %s", path, d->err);
        }
        if (st == TERA_OK && eot >= 0) { /* room for the end-of-document token */
            int32_t *grown = tera_malloc(sizeof(int32_t) * (d->n_ids + 1));
            if (d->n_ids) memcpy(grown, d->ids, sizeof(int32_t) * d->n_ids);
            grown[d->n_ids++] = eot;
            free(d->ids);
            d->ids = grown;
        }
        if (st == TERA_OK) st = tera_idx_writer_add(c->w, d->ids, (int64_t)d->n_ids);
        if (st == TERA_OK) {
            c->stats->documents++;
            c->stats->tokens += (int64_t)d->n_ids;
            c->stats->bytes += (int64_t)d->len;
        }
        free(d->ids);
        free(d->owned);
        memset(d, 0, sizeof *d);
    }
    if (st == TERA_OK) progress(c, 0);
    return st;
}

static tera_status map_input(const char *path, char **data, size_t *len) {
    int fd = open(path, O_RDONLY | O_NONBLOCK); /* a FIFO is refused below, not waited on */
    if (fd < 0) return tera_fail(TERA_ERR_IO, "cannot open input '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return tera_fail(TERA_ERR_IO, "input '%s' is not a regular file", path);
    }
    if (sb.st_size == 0) { /* no mapping: the caller skips it */
        close(fd);
        *data = NULL;
        *len = 0;
        return TERA_OK;
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return tera_fail(TERA_ERR_IO, "cannot map input '%s': %s", path, strerror(errno));
    *data = m;
    *len = (size_t)sb.st_size;
    return TERA_OK;
}

/* One JSON line -> slot (the field's string, decoded). */
static tera_status parse_line(const char *path, int64_t lineno, const char *line, size_t n, const char *field,
                              doc_slot *d) {
    const char *why = NULL;
    cJSON *root = tera_jsonl_parse(line, n, &why);
    if (!root) return tera_fail(TERA_ERR_FORMAT, "%s:%ld: not a valid JSON object: %s", path, (long)lineno, why);
    const cJSON *f = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, field) : NULL;
    if (!cJSON_IsString(f)) {
        cJSON_Delete(root);
        return tera_fail(TERA_ERR_FORMAT, "%s:%ld: no string field \"%s\" (set it with --field)", path, (long)lineno,
                         field);
    }
    d->len = strlen(f->valuestring);
    d->owned = tera_malloc(d->len + 1);
    memcpy(d->owned, f->valuestring, d->len + 1);
    d->text = d->owned;
    d->line = lineno;
    cJSON_Delete(root);
    return TERA_OK;
}

static tera_status prepare_file(prep_ctx *c, const char *path, doc_slot *slots) {
    char *data = NULL;
    size_t len = 0;
    TERA_TRY(map_input(path, &data, &len));
    const int64_t base = c->done_bytes, docs_before = c->stats->documents, empty_before = c->empty_docs;
    tera_status st = TERA_OK;
    int n = 0;
    if (len == 0) {
        skip_empty(c, path, 0);
        return TERA_OK;
    }
    if (!is_jsonl(path)) {
        slots[0].text = data;
        slots[0].len = len;
        c->done_bytes = base + (int64_t)len;
        st = flush_batch(c, path, slots, 1);
    } else {
        int64_t lineno = 0;
        size_t pos = 0;
        while (st == TERA_OK && pos < len) {
            const char *nl = memchr(data + pos, '\n', len - pos);
            size_t end = nl ? (size_t)(nl - data) : len;
            lineno++;
            size_t a = pos, b = end;
            while (a < b && (data[a] == ' ' || data[a] == '\t' || data[a] == '\r')) a++;
            pos = end + 1;
            if (a < b) { /* blank lines are skipped */
                st = parse_line(path, lineno, data + a, b - a, c->o->field, &slots[n]);
                if (st == TERA_OK && slots[n].len == 0) { /* {"text": ""}: an empty document */
                    free(slots[n].owned);
                    memset(&slots[n], 0, sizeof slots[n]);
                    skip_empty(c, path, lineno);
                } else if (st == TERA_OK && ++n == BATCH_DOCS) {
                    c->done_bytes = base + (int64_t)(pos < len ? pos : len);
                    st = flush_batch(c, path, slots, n);
                    n = 0;
                }
            }
        }
        c->done_bytes = base + (int64_t)len;
        if (st == TERA_OK && n) st = flush_batch(c, path, slots, n);
        else
            for (int i = 0; i < n; i++) free(slots[i].owned), memset(&slots[i], 0, sizeof slots[i]);
        if (st == TERA_OK && c->stats->documents == docs_before && c->empty_docs == empty_before) {
            /* only blank lines */
            if (c->bar_open) fputc('\n', stderr);
            c->bar_open = 0;
            fprintf(stderr, "tera: warning: input '%s' holds no documents (only blank lines); skipped\n", path);
        }
    }
    munmap(data, len);
    return st;
}

tera_status tera_data_prepare(const tera_prepare_opts *o, tera_prepare_stats *stats) {
    memset(stats, 0, sizeof *stats);
    if (o->n_inputs < 1) return tera_fail(TERA_ERR_ARG, "data prepare needs at least one --input file");
    prep_ctx c = {.o = o, .stats = stats, .t0 = tera_now()};
    for (int i = 0; i < o->n_inputs; i++) {
        struct stat sb;
        if (stat(o->inputs[i], &sb) != 0)
            return tera_fail(TERA_ERR_IO, "cannot open input '%s': %s", o->inputs[i], strerror(errno));
        c.total_bytes += (int64_t)sb.st_size;
    }
    const int vocab = o->tok ? tera_tokenizer_vocab_size(o->tok) : 256;
    const int dtype = vocab <= 65536 ? 8 /* uint16 */ : 4 /* int32 */;
    TERA_TRY(tera_idx_writer_open(&c.w, o->output, dtype));
    doc_slot *slots = tera_calloc(BATCH_DOCS, sizeof(doc_slot));
    tera_status st = TERA_OK;
    for (int i = 0; i < o->n_inputs && st == TERA_OK; i++) st = prepare_file(&c, o->inputs[i], slots);
    free(slots);
    if (st == TERA_OK && c.empty_docs > MAX_WARNINGS)
        fprintf(stderr, "%stera: warning: %ld empty documents skipped in all\n", c.bar_open ? "\n" : "",
                (long)c.empty_docs), c.bar_open = 0;
    if (st == TERA_OK && stats->documents == 0) {
        if (o->n_inputs == 1)
            st = tera_fail(TERA_ERR_FORMAT, "input '%s' holds no documents: nothing to prepare",
                           o->inputs[0]);
        else
            st = tera_fail(TERA_ERR_FORMAT, "none of the %d inputs ('%s', ...) holds a document: nothing to prepare",
                           o->n_inputs, o->inputs[0]);
    }
    if (st != TERA_OK) {
        tera_idx_writer_abort(c.w);
        if (c.bar_open) fputc('\n', stderr);
        return st;
    }
    st = tera_idx_writer_commit(c.w);
    stats->seconds = tera_now() - c.t0;
    if (st == TERA_OK) progress(&c, 1);
    else if (c.bar_open) fputc('\n', stderr);
    return st;
}
