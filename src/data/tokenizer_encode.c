/* BPE encoding: GPT-2's pre-tokenizer (PCRE2), the per-word merge loop, a per-thread cache of
 * short words, special tokens, and the parallel encoder.
 *
 * Merge loop: a word's symbols start as its byte tokens; the adjacent pair of lowest merge rank
 * (leftmost on ties) is merged until no pair has a rank. That is GPT-2's "merge every occurrence
 * of the best pair" because a merged token's pairs always rank after the merge that made it.
 * Short words (most) scan an array of pair ranks; long ones use a linked list and a min-heap of
 * (rank, position), so a 1 MB word costs O(n log n), not O(n^2). */
#include <omp.h>
#include <string.h>
#include <xxhash.h>

#include "data/tokenizer_internal.h"

/* ---- the matcher ---------------------------------------------------------------------------- */

tera_status tok_matcher_init(tok_matcher *m, const pcre2_code *re, int jit) {
    memset(m, 0, sizeof *m);
    m->md = pcre2_match_data_create(1, NULL);
    m->mctx = pcre2_match_context_create(NULL);
    if (jit) m->jit_stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, NULL);
    if (!m->md || !m->mctx || (jit && !m->jit_stack)) {
        tok_matcher_free(m);
        return tera_fail(TERA_ERR_NOMEM, "tokenizer: cannot allocate PCRE2 match data");
    }
    if (jit) pcre2_jit_stack_assign(m->mctx, NULL, m->jit_stack);
    (void)re;
    return TERA_OK;
}

void tok_matcher_free(tok_matcher *m) {
    pcre2_match_data_free(m->md);
    pcre2_match_context_free(m->mctx);
    pcre2_jit_stack_free(m->jit_stack);
    memset(m, 0, sizeof *m);
}

tera_status tok_check_utf8(tok_matcher *m, const pcre2_code *re, const char *text, size_t len, size_t base) {
    if (len == 0) return TERA_OK;
    /* pcre2_match validates the subject from the start offset to its end before matching. */
    int rc = pcre2_match(re, (PCRE2_SPTR)text, len, 0, 0, m->md, m->mctx);
    if (rc >= 0 || rc == PCRE2_ERROR_NOMATCH) return TERA_OK;
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21)
        return tera_fail(TERA_ERR_FORMAT, "tokenizer: invalid UTF-8 at byte offset %zu: %s",
                         base + (size_t)pcre2_get_startchar(m->md), (const char *)msg);
    return tera_fail(TERA_ERR_FORMAT, "tokenizer: pre-tokenizer failed at byte offset %zu: %s", base,
                     (const char *)msg);
}

int tok_next_pretoken(tok_matcher *m, const pcre2_code *re, int jit, const char *subject, size_t len, size_t pos,
                      size_t *s, size_t *e) {
    if (pos >= len) return 0;
    int rc = jit ? pcre2_jit_match(re, (PCRE2_SPTR)subject, len, pos, 0, m->md, m->mctx)
                 : pcre2_match(re, (PCRE2_SPTR)subject, len, pos, PCRE2_NO_UTF_CHECK, m->md, m->mctx);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) return rc;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(m->md);
    *s = ov[0], *e = ov[1];
    return 1;
}

/* ---- per-thread encoder state --------------------------------------------------------------- */

#define TOK_CACHE_SLOTS 4096 /* direct-mapped cache of short words (64 bytes a slot) */
#define TOK_CACHE_WORD 22    /* longest cached word, bytes */
#define TOK_CACHE_IDS 8      /* most ids of a cached word */
#define TOK_SMALL_WORD 64    /* words up to this many bytes use the array scan, longer ones the heap */

/* One cached word -> ids result. */
typedef struct {
    uint64_t hash;                /* XXH3 of the word */
    uint8_t wlen;                 /* word length in bytes; 0 = empty slot */
    uint8_t nid;                  /* ids in `ids` */
    char w[TOK_CACHE_WORD];       /* the word */
    int32_t ids[TOK_CACHE_IDS];   /* its tokens */
} tok_cache_slot;
_Static_assert(sizeof(tok_cache_slot) == 64, "a cache slot is one cache line");

/* A candidate merge of the symbols at pos and next[pos] (large words). */
typedef struct {
    int32_t rank; /* merge rank (heap key) */
    int32_t pos;  /* position of the left symbol (tie-break: leftmost first) */
    int32_t a, b; /* the ids it expects there (else the entry is stale) */
    int32_t res;  /* id of the merged token */
} tok_heap_ent;

/* A growable array of ids. */
typedef struct {
    int32_t *v;  /* ids */
    size_t n;    /* used */
    size_t cap;  /* allocated */
} tok_ids;

typedef struct {
    tok_matcher m;         /* regex match state */
    size_t cap;            /* symbols allocated in the arrays below */
    int32_t *sym;          /* [cap] symbol ids of the current word */
    int32_t *rk;           /* [cap] rank of pair (i, i+1) (small words) */
    int32_t *res;          /* [cap] result of pair (i, i+1) (small words) */
    int32_t *prev, *next;  /* [cap] linked list of live symbols (large words) */
    tok_heap_ent *heap;    /* [3*cap] candidate merges (large words) */
    tok_cache_slot *cache; /* [TOK_CACHE_SLOTS] */
    size_t *spec_pos;      /* [n_special] next known occurrence of each special token */
} tok_worker;

static void worker_reserve(tok_worker *w, size_t n) {
    if (n <= w->cap) return;
    w->cap = n > 2 * w->cap ? n : 2 * w->cap;
    w->sym = tera_realloc(w->sym, w->cap * sizeof(int32_t));
    w->rk = tera_realloc(w->rk, w->cap * sizeof(int32_t));
    w->res = tera_realloc(w->res, w->cap * sizeof(int32_t));
    w->prev = tera_realloc(w->prev, w->cap * sizeof(int32_t));
    w->next = tera_realloc(w->next, w->cap * sizeof(int32_t));
    w->heap = tera_realloc(w->heap, 3 * w->cap * sizeof(tok_heap_ent));
}

static tera_status worker_init(tok_worker *w, const tera_tokenizer *t) {
    memset(w, 0, sizeof *w);
    TERA_TRY(tok_matcher_init(&w->m, t->re, t->jit));
    worker_reserve(w, 256);
    w->cache = tera_calloc(TOK_CACHE_SLOTS, sizeof(tok_cache_slot));
    w->spec_pos = tera_malloc(sizeof(size_t) * ((size_t)t->n_special + 1));
    return TERA_OK;
}

static void worker_free(tok_worker *w) {
    tok_matcher_free(&w->m);
    free(w->sym), free(w->rk), free(w->res), free(w->prev), free(w->next), free(w->heap);
    free(w->cache), free(w->spec_pos);
}

static inline void ids_push(tok_ids *o, int32_t id) {
    if (o->n == o->cap) {
        o->cap = o->cap ? 2 * o->cap : 1024;
        o->v = tera_realloc(o->v, o->cap * sizeof(int32_t));
    }
    o->v[o->n++] = id;
}

/* ---- the merge loop ------------------------------------------------------------------------- */

/* Merges w->sym[0, n) by scanning the pair-rank array; returns the new length. */
static size_t bpe_small(const tera_tokenizer *t, tok_worker *w, size_t n) {
    int32_t *sym = w->sym, *rk = w->rk, *res = w->res;
    for (size_t i = 0; i + 1 < n; i++) rk[i] = tok_pair_rank(t, sym[i], sym[i + 1], &res[i]);
    while (n > 1) {
        size_t best = 0;
        for (size_t i = 1; i + 1 < n; i++)
            if (rk[i] < rk[best]) best = i;
        if (rk[best] == TOK_NO_RANK) break;
        sym[best] = res[best];
        /* drop symbol best+1 and pair (best+1, best+2) */
        memmove(sym + best + 1, sym + best + 2, (n - best - 2) * sizeof(int32_t));
        if (best + 3 < n) {
            memmove(rk + best + 1, rk + best + 2, (n - best - 3) * sizeof(int32_t));
            memmove(res + best + 1, res + best + 2, (n - best - 3) * sizeof(int32_t));
        }
        n--;
        if (best > 0) rk[best - 1] = tok_pair_rank(t, sym[best - 1], sym[best], &res[best - 1]);
        if (best + 1 < n) rk[best] = tok_pair_rank(t, sym[best], sym[best + 1], &res[best]);
    }
    return n;
}

static inline int heap_less(const tok_heap_ent *x, const tok_heap_ent *y) {
    return x->rank < y->rank || (x->rank == y->rank && x->pos < y->pos);
}

static void heap_push(tok_heap_ent *h, size_t *n, tok_heap_ent e) {
    size_t i = (*n)++;
    while (i > 0 && heap_less(&e, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = e;
}

static tok_heap_ent heap_pop(tok_heap_ent *h, size_t *n) {
    tok_heap_ent top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

/* Pushes the merge candidate (i, j) if the pair has a rank. */
static void push_pair(const tera_tokenizer *t, tok_worker *w, size_t *hn, int32_t i, int32_t j) {
    int32_t res, r = tok_pair_rank(t, w->sym[i], w->sym[j], &res);
    if (r != TOK_NO_RANK) heap_push(w->heap, hn, (tok_heap_ent){r, i, w->sym[i], w->sym[j], res});
}

/* Merges w->sym[0, n) through a linked list and a heap of candidates; returns the new length. */
static size_t bpe_large(const tera_tokenizer *t, tok_worker *w, size_t n) {
    int32_t *sym = w->sym, *prev = w->prev, *next = w->next;
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) prev[i] = (int32_t)i - 1, next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    for (size_t i = 0; i + 1 < n; i++) push_pair(t, w, &hn, (int32_t)i, (int32_t)i + 1);
    while (hn > 0) {
        tok_heap_ent e = heap_pop(w->heap, &hn);
        int32_t i = e.pos, j = next[i];
        if (sym[i] != e.a || j < 0 || sym[j] != e.b) continue; /* stale: a neighbour merged first */
        sym[i] = e.res, sym[j] = -1;
        next[i] = next[j];
        if (next[i] >= 0) prev[next[i]] = i;
        if (prev[i] >= 0) push_pair(t, w, &hn, prev[i], i);
        if (next[i] >= 0) push_pair(t, w, &hn, i, next[i]);
    }
    size_t k = 0;
    for (int32_t i = 0; i >= 0; i = next[i]) sym[k++] = sym[i];
    return k;
}

/* Appends the tokens of one pre-token s[0, n) (n >= 1). */
static void encode_word(const tera_tokenizer *t, tok_worker *w, const char *s, size_t n, tok_ids *out) {
    if (n == 1) {
        ids_push(out, t->byte_id[(unsigned char)s[0]]);
        return;
    }
    tok_cache_slot *c = NULL;
    uint64_t h = 0;
    if (n <= TOK_CACHE_WORD) {
        h = XXH3_64bits(s, n);
        c = &w->cache[h & (TOK_CACHE_SLOTS - 1)];
        if (c->wlen == n && c->hash == h && memcmp(c->w, s, n) == 0) {
            for (int i = 0; i < c->nid; i++) ids_push(out, c->ids[i]);
            return;
        }
    }
    worker_reserve(w, n);
    for (size_t i = 0; i < n; i++) w->sym[i] = t->byte_id[(unsigned char)s[i]];
    size_t m = n <= TOK_SMALL_WORD ? bpe_small(t, w, n) : bpe_large(t, w, n);
    for (size_t i = 0; i < m; i++) ids_push(out, w->sym[i]);
    if (c && m <= TOK_CACHE_IDS) {
        c->hash = h, c->wlen = (uint8_t)n, c->nid = (uint8_t)m;
        memcpy(c->w, s, n);
        memcpy(c->ids, w->sym, m * sizeof(int32_t));
    }
}

/* ---- ranges of text ------------------------------------------------------------------------- */

/* Encodes the ordinary text [start, end) of a subject text[0, subj) (the regex's lookahead may
 * look past `end`, up to `subj`). */
static tera_status encode_plain(const tera_tokenizer *t, tok_worker *w, const char *text, size_t subj, size_t start,
                                size_t end, tok_ids *out) {
    size_t p = start, s, e;
    while (p < end) {
        int rc = tok_next_pretoken(&w->m, t->re, t->jit, text, subj, p, &s, &e);
        if (rc == 0) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return tera_fail(TERA_ERR_FORMAT, "tokenizer: pre-tokenizer failed at byte offset %zu: %s", p,
                             (const char *)msg);
        }
        /* GPT-2's pattern matches every character, and pieces are cut where a match ends. */
        TERA_ASSERTF(s == p && e > s && e <= end, "pre-token [%zu, %zu) outside [%zu, %zu)", s, e, p, end);
        encode_word(t, w, text + s, e - s, out);
        p = e;
    }
    return TERA_OK;
}

/* First special token in text[from, end): returns its position (end if none), *which its index. */
static size_t find_special(const tera_tokenizer *t, tok_worker *w, const char *text, size_t from, size_t end,
                           int32_t *which) {
    size_t best = end;
    size_t best_len = 0;
    for (int32_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special_ids[k];
        size_t n = t->tok_len[id];
        if (w->spec_pos[k] == SIZE_MAX || w->spec_pos[k] < from) {
            const char *hit = memmem(text + from, end - from, t->tok_blob + t->tok_off[id], n);
            w->spec_pos[k] = hit ? (size_t)(hit - text) : end;
        }
        if (w->spec_pos[k] < best || (w->spec_pos[k] == best && best < end && n > best_len))
            best = w->spec_pos[k], best_len = n, *which = k;
    }
    return best;
}

/* Encodes text[start, end) of the whole text[0, len) (already UTF-8 checked). */
static tera_status encode_range(const tera_tokenizer *t, tok_worker *w, const char *text, size_t len,
                                size_t start, size_t end, unsigned flags, tok_ids *out) {
    if (!(flags & TERA_TOK_ALLOW_SPECIAL)) return encode_plain(t, w, text, len, start, end, out);
    for (int32_t k = 0; k < t->n_special; k++) w->spec_pos[k] = SIZE_MAX;
    for (size_t p = start; p < end;) {
        int32_t which = -1;
        size_t q = find_special(t, w, text, p, end, &which);
        /* like tiktoken: the text before a special token is encoded on its own */
        TERA_TRY(encode_plain(t, w, text, which >= 0 ? q : len, p, q, out));
        if (which < 0) break;
        int32_t id = t->special_ids[which];
        ids_push(out, id);
        p = q + t->tok_len[id];
    }
    return TERA_OK;
}

/* Hands the ids over to the caller (NULL when empty). */
static void ids_finish(tok_ids *o, int32_t **ids, size_t *n_ids) {
    if (o->n == 0) {
        free(o->v);
        o->v = NULL;
    }
    *ids = o->v, *n_ids = o->n;
}

tera_status tera_tokenizer_encode(const tera_tokenizer *t, const char *text, size_t len, unsigned flags,
                                  int32_t **ids, size_t *n_ids) {
    *ids = NULL, *n_ids = 0;
    tok_worker w;
    TERA_TRY(worker_init(&w, t));
    tok_ids out = {0};
    tera_status s = tok_check_utf8(&w.m, t->re, text, len, 0);
    if (s == TERA_OK) {
        out.cap = len / 3 + 16;
        out.v = tera_malloc(out.cap * sizeof(int32_t));
        s = encode_range(t, &w, text, len, 0, len, flags, &out);
    }
    worker_free(&w);
    if (s != TERA_OK) {
        free(out.v);
        return s;
    }
    ids_finish(&out, ids, n_ids);
    return TERA_OK;
}

/* ---- parallel encoding ---------------------------------------------------------------------- */

/* p cuts the text at a pre-token boundary: after a newline, before an ASCII letter or digit (the
 * newline's whitespace match ends there, and no special token "<|...|>" starts there). */
static int is_cut(const char *text, size_t len, size_t p) {
    if (p == 0 || p >= len || text[p - 1] != '\n') return 0;
    char c = text[p];
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

/* Chooses up to max_chunks+1 cut points 0 = b[0] < ... < b[k] = len; returns k. */
static int choose_cuts(const char *text, size_t len, int max_chunks, size_t *b) {
    int k = 0;
    b[0] = 0;
    for (int c = 1; c < max_chunks; c++) {
        size_t p = (size_t)((double)len * c / max_chunks);
        if (p <= b[k]) p = b[k] + 1;
        while (p < len && !is_cut(text, len, p)) p++;
        if (p >= len) break;
        b[++k] = p;
    }
    b[++k] = len;
    return k;
}

/* Encodes chunk [a, b) into out; errors leave their message in msg (a worker thread's message
 * buffer is its own). */
static tera_status encode_chunk(const tera_tokenizer *t, tok_worker *w, const char *text, size_t len, size_t a,
                                size_t b, unsigned flags, tok_ids *out, char *msg, size_t msg_n) {
    tera_status s = tok_check_utf8(&w->m, t->re, text + a, b - a, a);
    if (s == TERA_OK) {
        out->cap = (b - a) / 3 + 16;
        out->v = tera_malloc(out->cap * sizeof(int32_t));
        s = encode_range(t, w, text, len, a, b, flags, out);
    }
    if (s != TERA_OK) snprintf(msg, msg_n, "%s", tera_last_error());
    return s;
}

tera_status tok_encode_chunks(const tera_tokenizer *t, const char *text, size_t len, unsigned flags, int n_threads,
                              size_t min_chunk, int32_t **ids, size_t *n_ids) {
    *ids = NULL, *n_ids = 0;
    if (n_threads <= 0) n_threads = omp_get_max_threads();
    size_t want = len / (min_chunk ? min_chunk : 1);
    if (want > (size_t)n_threads * 4) want = (size_t)n_threads * 4;
    if (n_threads == 1 || want < 2) return tera_tokenizer_encode(t, text, len, flags, ids, n_ids);
    size_t *b = tera_malloc(sizeof(size_t) * (want + 1));
    int k = choose_cuts(text, len, (int)want, b);
    tok_ids *outs = tera_calloc((size_t)k, sizeof *outs);
    tera_status *st = tera_calloc((size_t)k, sizeof *st);
    char(*msg)[512] = tera_calloc((size_t)k, sizeof *msg);
#pragma omp parallel num_threads(n_threads)
    {
        tok_worker w;
        tera_status ws = worker_init(&w, t);
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < k; c++) {
            if (ws != TERA_OK) {
                st[c] = ws;
                snprintf(msg[c], sizeof msg[c], "%s", tera_last_error());
                continue;
            }
            st[c] = encode_chunk(t, &w, text, len, b[c], b[c + 1], flags, &outs[c], msg[c], sizeof msg[c]);
        }
        if (ws == TERA_OK) worker_free(&w);
    }
    tera_status s = TERA_OK;
    size_t total = 0;
    for (int c = 0; c < k; c++) {
        if (st[c] != TERA_OK && s == TERA_OK) s = tera_fail(st[c], "%s", msg[c]);
        total += outs[c].n;
    }
    tok_ids all = {0};
    if (s == TERA_OK && total > 0) {
        all.v = tera_malloc(total * sizeof(int32_t));
        for (int c = 0; c < k; c++) {
            if (outs[c].n) memcpy(all.v + all.n, outs[c].v, outs[c].n * sizeof(int32_t));
            all.n += outs[c].n;
        }
    }
    for (int c = 0; c < k; c++) free(outs[c].v);
    free(outs), free(st), free(msg), free(b);
    if (s == TERA_OK) ids_finish(&all, ids, n_ids);
    return s;
}

tera_status tera_tokenizer_encode_parallel(const tera_tokenizer *t, const char *text, size_t len, unsigned flags,
                                           int n_threads, int32_t **ids, size_t *n_ids) {
    return tok_encode_chunks(t, text, len, flags, n_threads, (size_t)1 << 16, ids, n_ids);
}
