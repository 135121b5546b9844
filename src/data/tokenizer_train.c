/* Byte-level BPE training.
 *
 * 1. Pre-tokenize every text with GPT-2's pattern and count distinct words (word -> count).
 * 2. Count adjacent symbol pairs over the words, weighted by word count; each pair remembers the
 *    words it occurs in.
 * 3. Repeatedly take the most frequent pair from a max-heap (ties: smallest (left bytes, right
 *    bytes)), merge it in the words that contain it, and update only the counts of the pairs
 *    around each merged occurrence. Heap entries are checked against the live count when popped
 *    (a stale one is re-pushed with the live count), so each merge costs the occurrences it
 *    touches, not a rescan of the corpus. */
#include <string.h>

#include "data/tokenizer_internal.h"
#include "tera/config.h"

/* One distinct adjacent pair. */
typedef struct {
    int32_t a, b;      /* left and right token ids */
    int64_t count;     /* occurrences, weighted by word count */
    int32_t *where;    /* words it has occurred in (may repeat or be out of date) */
    uint32_t n_where;  /* used entries of where */
    uint32_t cap_where;/* allocated entries of where */
    uint32_t stamp;    /* last merge that raised its count (de-duplicates re-pushes) */
    uint8_t merged;    /* already merged (never merged twice) */
} tr_pair;

/* A heap entry: a pair and its count when pushed. */
typedef struct {
    int64_t count; /* the pair's count at push time */
    int32_t pair;  /* index into pairs */
} tr_heap_ent;

typedef struct {
    tok_bmap vocab;      /* token bytes; entry i = token id i */
    tok_bmap words;      /* distinct pre-tokens */
    int64_t *wcount;     /* [words.n] occurrences of each word */
    int32_t *syms;       /* current symbols of every word, at words.off[w] */
    uint32_t *wlen;      /* [words.n] current symbol count of each word */
    uint32_t *wstamp;    /* [words.n] last merge that visited the word */
    tr_pair *pairs;      /* distinct pairs */
    int32_t n_pairs;     /* used entries of pairs */
    int32_t cap_pairs;   /* allocated entries of pairs */
    uint64_t *pkey;      /* [pmask+1] pair key per slot, TOK_PAIR_EMPTY if free */
    int32_t *pidx;       /* [pmask+1] pair index per slot */
    uint64_t pmask;      /* slot count - 1 */
    tr_heap_ent *heap;   /* max-heap of candidate pairs */
    size_t hn, hcap;     /* heap entries used, allocated */
    int32_t *touched;    /* pairs whose count rose during the current merge */
    size_t n_touched, cap_touched;
    uint32_t merge_no;   /* merges done + 1 (stamps) */
    int32_t n_merges, cap_merges;
    int32_t *ml, *mr, *mres; /* the merges, rank order */
} tok_trainer;

/* ---- pair table ----------------------------------------------------------------------------- */

static void pmap_rehash(tok_trainer *tr) {
    uint64_t slots = tr->pmask ? 2 * (tr->pmask + 1) : 1024;
    free(tr->pkey), free(tr->pidx);
    tr->pkey = tera_malloc(slots * sizeof *tr->pkey);
    tr->pidx = tera_malloc(slots * sizeof *tr->pidx);
    tr->pmask = slots - 1;
    for (uint64_t i = 0; i < slots; i++) tr->pkey[i] = TOK_PAIR_EMPTY;
    for (int32_t p = 0; p < tr->n_pairs; p++) {
        uint64_t key = tok_pair_key(tr->pairs[p].a, tr->pairs[p].b);
        uint64_t i = tok_pair_hash(key) & tr->pmask;
        while (tr->pkey[i] != TOK_PAIR_EMPTY) i = (i + 1) & tr->pmask;
        tr->pkey[i] = key, tr->pidx[i] = p;
    }
}

/* Index of pair (a, b), created with count 0 if absent and `create`, else -1. */
static int32_t pair_index(tok_trainer *tr, int32_t a, int32_t b, int create) {
    uint64_t key = tok_pair_key(a, b);
    uint64_t i = tok_pair_hash(key) & tr->pmask;
    for (; tr->pkey[i] != TOK_PAIR_EMPTY; i = (i + 1) & tr->pmask)
        if (tr->pkey[i] == key) return tr->pidx[i];
    if (!create) return -1;
    if (tr->n_pairs == tr->cap_pairs) {
        tr->cap_pairs = tr->cap_pairs ? 2 * tr->cap_pairs : 1024;
        tr->pairs = tera_realloc(tr->pairs, (size_t)tr->cap_pairs * sizeof *tr->pairs);
    }
    int32_t p = tr->n_pairs++;
    memset(&tr->pairs[p], 0, sizeof tr->pairs[p]);
    tr->pairs[p].a = a, tr->pairs[p].b = b;
    tr->pkey[i] = key, tr->pidx[i] = p;
    if ((uint64_t)tr->n_pairs * 2 > tr->pmask) pmap_rehash(tr);
    return p;
}

/* Adds c occurrences of (a, b) found in word w. */
static void pair_inc(tok_trainer *tr, int32_t a, int32_t b, int64_t c, int32_t w) {
    int32_t pi = pair_index(tr, a, b, 1); /* may move tr->pairs: index first */
    tr_pair *p = &tr->pairs[pi];
    p->count += c;
    if (p->n_where == 0 || p->where[p->n_where - 1] != w) {
        if (p->n_where == p->cap_where) {
            p->cap_where = p->cap_where ? 2 * p->cap_where : 4;
            p->where = tera_realloc(p->where, p->cap_where * sizeof *p->where);
        }
        p->where[p->n_where++] = w;
    }
    if (p->stamp != tr->merge_no) {
        p->stamp = tr->merge_no;
        if (tr->n_touched == tr->cap_touched) {
            tr->cap_touched = tr->cap_touched ? 2 * tr->cap_touched : 1024;
            tr->touched = tera_realloc(tr->touched, tr->cap_touched * sizeof *tr->touched);
        }
        tr->touched[tr->n_touched++] = pi;
    }
}

/* Removes c occurrences of (a, b) (which must be counted). */
static void pair_dec(tok_trainer *tr, int32_t a, int32_t b, int64_t c) {
    int32_t p = pair_index(tr, a, b, 0);
    TERA_ASSERTF(p >= 0 && tr->pairs[p].count >= c, "BPE training: pair (%d, %d) count underflow", a, b);
    tr->pairs[p].count -= c;
}

/* ---- heap ----------------------------------------------------------------------------------- */

static int bytes_cmp(const char *x, size_t nx, const char *y, size_t ny) {
    int c = memcmp(x, y, nx < ny ? nx : ny);
    return c ? c : (nx > ny) - (nx < ny);
}

/* Pair p's bytes (left, right) compare before pair q's. */
static int pair_bytes_less(const tok_trainer *tr, int32_t p, int32_t q) {
    const tr_pair *x = &tr->pairs[p], *y = &tr->pairs[q];
    size_t nxa, nya, nxb, nyb;
    const char *xa = tok_bmap_str(&tr->vocab, (uint32_t)x->a, &nxa);
    const char *ya = tok_bmap_str(&tr->vocab, (uint32_t)y->a, &nya);
    int c = bytes_cmp(xa, nxa, ya, nya);
    if (c) return c < 0;
    const char *xb = tok_bmap_str(&tr->vocab, (uint32_t)x->b, &nxb);
    const char *yb = tok_bmap_str(&tr->vocab, (uint32_t)y->b, &nyb);
    return bytes_cmp(xb, nxb, yb, nyb) < 0;
}

/* x pops before y: higher count, then smaller bytes. */
static int heap_before(const tok_trainer *tr, const tr_heap_ent *x, const tr_heap_ent *y) {
    if (x->count != y->count) return x->count > y->count;
    return pair_bytes_less(tr, x->pair, y->pair);
}

static void heap_push(tok_trainer *tr, int64_t count, int32_t pair) {
    if (tr->hn == tr->hcap) {
        tr->hcap = tr->hcap ? 2 * tr->hcap : 1024;
        tr->heap = tera_realloc(tr->heap, tr->hcap * sizeof *tr->heap);
    }
    tr_heap_ent e = {count, pair};
    size_t i = tr->hn++;
    while (i > 0 && heap_before(tr, &e, &tr->heap[(i - 1) / 2])) {
        tr->heap[i] = tr->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    tr->heap[i] = e;
}

static tr_heap_ent heap_pop(tok_trainer *tr) {
    tr_heap_ent top = tr->heap[0], last = tr->heap[--tr->hn];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= tr->hn) break;
        if (c + 1 < tr->hn && heap_before(tr, &tr->heap[c + 1], &tr->heap[c])) c++;
        if (!heap_before(tr, &tr->heap[c], &last)) break;
        tr->heap[i] = tr->heap[c];
        i = c;
    }
    tr->heap[i] = last;
    return top;
}

/* ---- counting ------------------------------------------------------------------------------- */

/* Adds the pre-tokens of every text to tr->words / tr->wcount. */
static tera_status count_words(tok_trainer *tr, const char *const *texts, const size_t *lens,
                               const char *const *names, int n_texts) {
    pcre2_code *re = NULL;
    int jit = 0;
    tok_matcher m;
    TERA_TRY(tok_compile_regex(&re, &jit));
    tera_status s = tok_matcher_init(&m, re, jit);
    uint32_t cap = 0;
    for (int i = 0; i < n_texts && s == TERA_OK; i++) {
        char what[TERA_PATH_MAX + 32];
        if (names) snprintf(what, sizeof what, "'%s'", names[i]);
        else snprintf(what, sizeof what, "training text %d", i);
        s = tok_check_utf8(&m, re, texts[i], lens[i], 0);
        if (s != TERA_OK) {
            char why[512]; /* (tera_fail must not format from its own buffer) */
            snprintf(why, sizeof why, "%s", tera_last_error());
            s = tera_fail(s, "%s: %s", what, why);
        }
        size_t p = 0, a, b;
        int rc = 0;
        while (s == TERA_OK && (rc = tok_next_pretoken(&m, re, jit, texts[i], lens[i], p, &a, &b)) > 0) {
            uint32_t w = tok_bmap_add(&tr->words, texts[i] + a, b - a, NULL);
            if (w >= cap) {
                cap = cap ? 2 * cap : 4096;
                tr->wcount = tera_realloc(tr->wcount, cap * sizeof *tr->wcount);
                memset(tr->wcount + w, 0, (cap - w) * sizeof *tr->wcount);
            }
            tr->wcount[w]++;
            p = b;
        }
        if (s == TERA_OK && rc < 0) s = tera_fail(TERA_ERR_FORMAT, "%s: pre-tokenizer error %d", what, rc);
    }
    tok_matcher_free(&m);
    pcre2_code_free(re);
    return s;
}

/* Turns every word into byte symbols and counts all adjacent pairs. */
static void init_pairs(tok_trainer *tr) {
    uint32_t nw = tr->words.n;
    tr->syms = tera_malloc(sizeof(int32_t) * (tr->words.blob_n + 1));
    tr->wlen = tera_malloc(sizeof(uint32_t) * (nw + 1));
    tr->wstamp = tera_calloc(nw + 1, sizeof(uint32_t));
    for (size_t j = 0; j < tr->words.blob_n; j++) tr->syms[j] = (unsigned char)tr->words.blob[j];
    pmap_rehash(tr);
    for (uint32_t w = 0; w < nw; w++) {
        const int32_t *s = tr->syms + tr->words.off[w];
        tr->wlen[w] = tr->words.len[w];
        for (uint32_t i = 0; i + 1 < tr->wlen[w]; i++) pair_inc(tr, s[i], s[i + 1], tr->wcount[w], (int32_t)w);
    }
    for (int32_t p = 0; p < tr->n_pairs; p++) heap_push(tr, tr->pairs[p].count, p);
    tr->n_touched = 0;
}

/* ---- merging -------------------------------------------------------------------------------- */

/* Replaces every (a, b) in word w by c, updating the neighbouring pairs' counts. */
static void merge_in_word(tok_trainer *tr, int32_t w, int32_t a, int32_t b, int32_t c) {
    int32_t *s = tr->syms + tr->words.off[w];
    uint32_t n = tr->wlen[w];
    int64_t k = tr->wcount[w];
    for (uint32_t i = 0; i + 1 < n; i++) {
        if (s[i] != a || s[i + 1] != b) continue;
        if (i > 0) {
            pair_dec(tr, s[i - 1], a, k);
            pair_inc(tr, s[i - 1], c, k, w);
        }
        if (i + 2 < n) {
            pair_dec(tr, b, s[i + 2], k);
            pair_inc(tr, c, s[i + 2], k, w);
        }
        pair_dec(tr, a, b, k);
        s[i] = c;
        memmove(s + i + 1, s + i + 2, (n - i - 2) * sizeof *s);
        n--;
    }
    tr->wlen[w] = n;
}

static void record_merge(tok_trainer *tr, int32_t a, int32_t b, int32_t c) {
    if (tr->n_merges == tr->cap_merges) {
        tr->cap_merges = tr->cap_merges ? 2 * tr->cap_merges : 1024;
        tr->ml = tera_realloc(tr->ml, (size_t)tr->cap_merges * 4);
        tr->mr = tera_realloc(tr->mr, (size_t)tr->cap_merges * 4);
        tr->mres = tera_realloc(tr->mres, (size_t)tr->cap_merges * 4);
    }
    tr->ml[tr->n_merges] = a, tr->mr[tr->n_merges] = b, tr->mres[tr->n_merges] = c;
    tr->n_merges++;
}

/* Merges pair p everywhere: a new token (or the existing one with the same bytes). */
static void apply_merge(tok_trainer *tr, int32_t p, char **buf, size_t *buf_cap) {
    int32_t a = tr->pairs[p].a, b = tr->pairs[p].b;
    size_t na, nb;
    const char *sa = tok_bmap_str(&tr->vocab, (uint32_t)a, &na), *sb = tok_bmap_str(&tr->vocab, (uint32_t)b, &nb);
    if (na + nb > *buf_cap) *buf = tera_realloc(*buf, *buf_cap = 2 * (na + nb));
    memcpy(*buf, sa, na);
    memcpy(*buf + na, sb, nb);
    int32_t c = (int32_t)tok_bmap_add(&tr->vocab, *buf, na + nb, NULL);
    record_merge(tr, a, b, c);
    tr->merge_no++;
    tr->n_touched = 0;
    tr->pairs[p].merged = 1;
    int32_t *where = tr->pairs[p].where; /* pair p's list does not grow below: new pairs hold c */
    uint32_t n_where = tr->pairs[p].n_where;
    for (uint32_t i = 0; i < n_where; i++) {
        int32_t w = where[i];
        if (tr->wstamp[w] == tr->merge_no) continue;
        tr->wstamp[w] = tr->merge_no;
        merge_in_word(tr, w, a, b, c);
    }
    free(where);
    tr->pairs[p].where = NULL, tr->pairs[p].n_where = tr->pairs[p].cap_where = 0;
    for (size_t i = 0; i < tr->n_touched; i++) {
        const tr_pair *q = &tr->pairs[tr->touched[i]];
        if (q->count > 0 && !q->merged) heap_push(tr, q->count, tr->touched[i]);
    }
}

/* Merges until the vocabulary has `target` tokens or no pair is left. */
static void merge_loop(tok_trainer *tr, uint32_t target) {
    char *buf = NULL;
    size_t buf_cap = 0;
    while (tr->vocab.n < target && tr->hn > 0) {
        tr_heap_ent e = heap_pop(tr);
        const tr_pair *p = &tr->pairs[e.pair];
        if (p->merged || p->count <= 0) continue;
        if (p->count != e.count) { /* stale: the pair lost occurrences since it was pushed */
            heap_push(tr, p->count, e.pair);
            continue;
        }
        apply_merge(tr, e.pair, &buf, &buf_cap);
    }
    free(buf);
}

static void trainer_free(tok_trainer *tr) {
    tok_bmap_free(&tr->vocab);
    tok_bmap_free(&tr->words);
    for (int32_t p = 0; p < tr->n_pairs; p++) free(tr->pairs[p].where);
    free(tr->pairs), free(tr->pkey), free(tr->pidx), free(tr->heap), free(tr->touched);
    free(tr->wcount), free(tr->syms), free(tr->wlen), free(tr->wstamp);
    free(tr->ml), free(tr->mr), free(tr->mres);
}

tera_status tera_tokenizer_train(tera_tokenizer **t, const char *const *texts, const size_t *lens, int n_texts,
                                 int vocab_size) {
    return tera_tokenizer_train_named(t, texts, lens, NULL, n_texts, vocab_size);
}

tera_status tera_tokenizer_train_named(tera_tokenizer **t, const char *const *texts, const size_t *lens,
                                       const char *const *names, int n_texts, int vocab_size) {
    *t = NULL;
    if (vocab_size < 257)
        return tera_fail(TERA_ERR_ARG, "tokenizer training: vocab_size %d must be at least 257 (256 bytes + "
                         "<|endoftext|>)", vocab_size);
    if (n_texts < 0 || (n_texts > 0 && (!texts || !lens)))
        return tera_fail(TERA_ERR_ARG, "tokenizer training: no texts");
    size_t total = 0;
    for (int i = 0; i < n_texts; i++) total += lens[i];
    if (total == 0) { /* nothing to learn from: refuse rather than write a vocabulary of bytes alone */
        if (n_texts == 0) return tera_fail(TERA_ERR_ARG, "tokenizer training: no texts");
        if (names)
            return tera_fail(TERA_ERR_FORMAT, "tokenizer training: '%s'%s empty: no text to learn merges from",
                             names[0], n_texts > 1 ? " and every other input are" : " is");
        return tera_fail(TERA_ERR_FORMAT, "tokenizer training: every training text is empty");
    }
    tok_trainer tr;
    memset(&tr, 0, sizeof tr);
    tok_bmap_init(&tr.vocab, (uint32_t)vocab_size);
    tok_bmap_init(&tr.words, 1024);
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        tok_bmap_add(&tr.vocab, &c, 1, NULL);
    }
    tera_status s = count_words(&tr, texts, lens, names, n_texts);
    if (s == TERA_OK) {
        tr.merge_no = 1;
        init_pairs(&tr);
        merge_loop(&tr, (uint32_t)vocab_size - 1);
        int added = 0;
        tok_bmap_add(&tr.vocab, TOK_EOT_TEXT, strlen(TOK_EOT_TEXT), &added);
        TERA_ASSERT(added); /* ordinary tokens never span "<|" and "endoftext" (different pre-tokens) */
        s = tok_build(t, &tr.vocab, tr.n_merges, tr.ml, tr.mr, tr.mres, "trained tokenizer");
        tr.ml = tr.mr = tr.mres = NULL; /* owned by the tokenizer now */
    }
    trainer_free(&tr);
    return s;
}
