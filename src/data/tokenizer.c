/* BPE tokenizer: the byte-string set, building a tokenizer from a vocabulary and merges, GPT-2's
 * encoder.json / vocab.bpe files (load and save), accessors and decoding.
 * Encoding lives in tokenizer_encode.c, training in tokenizer_train.c. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <string.h>
#include <xxhash.h>

#include "data/atomic_file.h"
#include "data/tokenizer_internal.h"
#include "tera/config.h"
#include "tera/io.h"

/* ---- byte-string set ------------------------------------------------------------------------ */

void tok_bmap_init(tok_bmap *m, uint32_t expect) {
    memset(m, 0, sizeof *m);
    uint32_t slots = 16;
    while (slots < 2 * (uint64_t)expect) slots *= 2;
    m->mask = slots - 1;
    m->slot = tera_calloc(slots, sizeof *m->slot);
}

void tok_bmap_free(tok_bmap *m) {
    free(m->slot);
    free(m->hash);
    free(m->off);
    free(m->len);
    free(m->blob);
    memset(m, 0, sizeof *m);
}

/* Slot holding s[0, n) or the empty slot where it would go. */
static uint32_t bmap_probe(const tok_bmap *m, const void *s, size_t n, uint64_t h) {
    for (uint32_t i = (uint32_t)h & m->mask;; i = (i + 1) & m->mask) {
        uint32_t e = m->slot[i];
        if (e == 0) return i;
        e--;
        if (m->hash[e] == h && m->len[e] == n && memcmp(m->blob + m->off[e], s, n) == 0) return i;
    }
}

int64_t tok_bmap_find(const tok_bmap *m, const void *s, size_t n) {
    uint32_t i = bmap_probe(m, s, n, XXH3_64bits(s, n));
    return m->slot[i] ? (int64_t)m->slot[i] - 1 : -1;
}

/* Doubles the slot array and re-inserts every entry. */
static void bmap_rehash(tok_bmap *m) {
    uint32_t slots = (m->mask + 1) * 2;
    free(m->slot);
    m->slot = tera_calloc(slots, sizeof *m->slot);
    m->mask = slots - 1;
    for (uint32_t e = 0; e < m->n; e++) {
        uint32_t i = (uint32_t)m->hash[e] & m->mask;
        while (m->slot[i]) i = (i + 1) & m->mask;
        m->slot[i] = e + 1;
    }
}

uint32_t tok_bmap_add(tok_bmap *m, const void *s, size_t n, int *added) {
    uint64_t h = XXH3_64bits(s, n);
    uint32_t i = bmap_probe(m, s, n, h);
    if (added) *added = m->slot[i] == 0;
    if (m->slot[i]) return m->slot[i] - 1;
    TERA_ASSERTF(m->n < UINT32_MAX - 1 && n < UINT32_MAX, "byte-string set overflow");
    if (m->n == m->cap) {
        m->cap = m->cap ? m->cap * 2 : 256;
        m->hash = tera_realloc(m->hash, m->cap * sizeof *m->hash);
        m->off = tera_realloc(m->off, m->cap * sizeof *m->off);
        m->len = tera_realloc(m->len, m->cap * sizeof *m->len);
    }
    if (m->blob_n + n > m->blob_cap) {
        while (m->blob_n + n > m->blob_cap) m->blob_cap = m->blob_cap ? m->blob_cap * 2 : 4096;
        m->blob = tera_realloc(m->blob, m->blob_cap);
    }
    uint32_t e = m->n++;
    memcpy(m->blob + m->blob_n, s, n);
    m->hash[e] = h;
    m->off[e] = m->blob_n;
    m->len[e] = (uint32_t)n;
    m->blob_n += n;
    m->slot[i] = e + 1;
    if ((uint64_t)m->n * 2 > m->mask) bmap_rehash(m);
    return e;
}

/* ---- GPT-2's byte <-> unicode map ----------------------------------------------------------- */
/* GPT-2 writes each byte as one code point: printable Latin-1 bytes as themselves, the others as
 * 256, 257, ... in byte order (encoder.py's bytes_to_unicode). Code points are all < 324. */
#define TOK_U2B_SIZE 324

static int byte_is_printable(int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); }

static void gpt2_byte_map(uint32_t b2u[256], int16_t u2b[TOK_U2B_SIZE]) {
    int n = 0;
    for (int c = 0; c < TOK_U2B_SIZE; c++) u2b[c] = -1;
    for (int b = 0; b < 256; b++) {
        b2u[b] = byte_is_printable(b) ? (uint32_t)b : (uint32_t)(256 + n++);
        u2b[b2u[b]] = (int16_t)b;
    }
}

/* Decodes GPT-2's mapped string s[0, n) (UTF-8) into bytes out (capacity >= n); -1 if s is not
 * such a string, else the byte count. */
static long gpt2_unmap(const int16_t u2b[TOK_U2B_SIZE], const char *s, size_t n, char *out) {
    const unsigned char *u = (const unsigned char *)s;
    long k = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        if (u[i] < 0x80) {
            cp = u[i++];
        } else if ((u[i] & 0xE0) == 0xC0 && i + 1 < n && (u[i + 1] & 0xC0) == 0x80) {
            cp = ((uint32_t)(u[i] & 0x1F) << 6) | (u[i + 1] & 0x3F);
            i += 2;
        } else {
            return -1;
        }
        if (cp >= TOK_U2B_SIZE || u2b[cp] < 0) return -1;
        out[k++] = (char)u2b[cp];
    }
    return k;
}

/* Writes bytes s[0, n) as GPT-2's mapped UTF-8 string into out (capacity >= 2n + 1). */
static void gpt2_map(const uint32_t b2u[256], const char *s, size_t n, char *out) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = b2u[(unsigned char)s[i]];
        if (cp < 0x80) {
            out[k++] = (char)cp;
        } else {
            out[k++] = (char)(0xC0 | (cp >> 6));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    out[k] = '\0';
}

/* ---- building a tokenizer ------------------------------------------------------------------- */

tera_status tok_compile_regex(pcre2_code **re, int *jit) {
    int err;
    PCRE2_SIZE eoff;
    *re = pcre2_compile((PCRE2_SPTR)TOK_GPT2_PATTERN, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &err, &eoff,
                        NULL);
    if (!*re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return tera_fail(TERA_ERR_FORMAT, "tokenizer: cannot compile the pre-tokenizer at %zu: %s", (size_t)eoff,
                         (const char *)msg);
    }
    /* Without a JIT (unsupported platform) the interpreter gives the same matches, only slower. */
    *jit = pcre2_jit_compile(*re, PCRE2_JIT_COMPLETE) == 0;
    return TERA_OK;
}

/* A special token: "<|...|>" without a newline, neither a single byte nor a merge result. */
static int is_special_text(const char *s, size_t n) {
    return n >= 4 && memcmp(s, "<|", 2) == 0 && memcmp(s + n - 2, "|>", 2) == 0 && !memchr(s, '\n', n);
}

/* Finds the byte tokens and the special tokens of t (vocabulary and merges already set). */
static tera_status find_byte_and_special_tokens(tera_tokenizer *t, const tok_bmap *vocab, const char *what) {
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        int64_t id = tok_bmap_find(vocab, &c, 1);
        if (id < 0) return tera_fail(TERA_ERR_FORMAT, "%s: byte 0x%02x has no token", what, b);
        t->byte_id[b] = (int32_t)id;
    }
    uint8_t *merged = tera_calloc((size_t)t->n_vocab, 1);
    for (int32_t r = 0; r < t->n_merges; r++) merged[t->merge_result[r]] = 1;
    t->special_ids = tera_malloc(sizeof(int32_t) * (size_t)t->n_vocab);
    t->eot = -1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        const char *s = t->tok_blob + t->tok_off[id];
        size_t n = t->tok_len[id];
        if (merged[id] || !is_special_text(s, n)) continue;
        t->special_ids[t->n_special++] = id;
        if (n == strlen(TOK_EOT_TEXT) && memcmp(s, TOK_EOT_TEXT, n) == 0) t->eot = id;
    }
    free(merged);
    return TERA_OK;
}

/* Fills the pair table; a pair listed twice is a format error. */
static tera_status build_pair_table(tera_tokenizer *t, const char *what) {
    uint64_t slots = 16;
    while (slots < 2 * (uint64_t)t->n_merges) slots *= 2;
    t->pair_mask = slots - 1;
    t->pairs = tera_malloc(slots * sizeof *t->pairs);
    for (uint64_t i = 0; i < slots; i++) t->pairs[i].key = TOK_PAIR_EMPTY;
    for (int32_t r = 0; r < t->n_merges; r++) {
        uint64_t key = tok_pair_key(t->merge_left[r], t->merge_right[r]);
        uint64_t i = tok_pair_hash(key) & t->pair_mask;
        while (t->pairs[i].key != TOK_PAIR_EMPTY && t->pairs[i].key != key) i = (i + 1) & t->pair_mask;
        if (t->pairs[i].key == key)
            return tera_fail(TERA_ERR_FORMAT, "%s: merge %d repeats the pair of merge %d", what, r, t->pairs[i].rank);
        t->pairs[i] = (tok_pair_slot){key, r, t->merge_result[r]};
    }
    return TERA_OK;
}

tera_status tok_build(tera_tokenizer **out, tok_bmap *vocab, int32_t n_merges, int32_t *left, int32_t *right,
                      int32_t *result, const char *what) {
    *out = NULL;
    tera_tokenizer *t = tera_calloc(1, sizeof *t);
    t->n_vocab = (int32_t)vocab->n;
    t->tok_off = tera_malloc(sizeof *t->tok_off * vocab->n);
    t->tok_len = tera_malloc(sizeof *t->tok_len * vocab->n);
    t->tok_blob = tera_malloc(vocab->blob_n);
    memcpy(t->tok_off, vocab->off, sizeof *t->tok_off * vocab->n);
    memcpy(t->tok_len, vocab->len, sizeof *t->tok_len * vocab->n);
    memcpy(t->tok_blob, vocab->blob, vocab->blob_n);
    t->n_merges = n_merges;
    t->merge_left = left;
    t->merge_right = right;
    t->merge_result = result;
    tera_status s = find_byte_and_special_tokens(t, vocab, what);
    if (s == TERA_OK) s = build_pair_table(t, what);
    if (s == TERA_OK) s = tok_compile_regex(&t->re, &t->jit);
    if (s != TERA_OK) {
        tera_tokenizer_free(t);
        return s;
    }
    *out = t;
    return TERA_OK;
}

void tera_tokenizer_free(tera_tokenizer *t) {
    if (!t) return;
    free(t->tok_off);
    free(t->tok_len);
    free(t->tok_blob);
    free(t->merge_left);
    free(t->merge_right);
    free(t->merge_result);
    free(t->pairs);
    free(t->special_ids);
    pcre2_code_free(t->re);
    free(t);
}

/* ---- loading GPT-2's files ------------------------------------------------------------------ */

/* Reads encoder.json into vocab (entry i = token i). */
static tera_status load_encoder(const char *path, const int16_t u2b[TOK_U2B_SIZE], tok_bmap *vocab) {
    char *text = NULL;
    TERA_TRY(tera_read_text_file(path, &text));
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return tera_fail(TERA_ERR_FORMAT, "%s: not a JSON object", path);
    }
    int n = cJSON_GetArraySize(root);
    const cJSON **by_id = tera_calloc((size_t)n + 1, sizeof *by_id);
    tera_status s = TERA_OK;
    for (const cJSON *it = root->child; it && s == TERA_OK; it = it->next) {
        double v = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (v < 0 || v >= n || v != (double)(int)v || by_id[(int)v])
            s = tera_fail(TERA_ERR_FORMAT, "%s: token \"%s\": id must be a distinct integer in [0, %d)", path,
                          it->string, n);
        else
            by_id[(int)v] = it;
    }
    tok_bmap_init(vocab, (uint32_t)n);
    char *buf = tera_malloc(1);
    size_t buf_cap = 1;
    for (int id = 0; id < n && s == TERA_OK; id++) {
        const char *key = by_id[id]->string;
        size_t kn = strlen(key);
        if (kn > buf_cap) buf = tera_realloc(buf, buf_cap = kn);
        long bn = gpt2_unmap(u2b, key, kn, buf);
        int added = 0;
        if (bn > 0) tok_bmap_add(vocab, buf, (size_t)bn, &added);
        if (!added)
            s = tera_fail(TERA_ERR_FORMAT, "%s: token %d \"%s\" is empty, repeated or not GPT-2's byte encoding",
                          path, id, key);
    }
    free(buf);
    free(by_id);
    cJSON_Delete(root);
    return s;
}

/* Parses one vocab.bpe line "A B" into the ids of A, B and A+B. */
static tera_status parse_merge(const char *path, long lineno, char *line, const int16_t u2b[TOK_U2B_SIZE],
                               const tok_bmap *vocab, int32_t ids[3]) {
    char *sp = strchr(line, ' ');
    size_t n = strlen(line);
    if (!sp || sp == line || sp + 1 == line + n || strchr(sp + 1, ' '))
        return tera_fail(TERA_ERR_FORMAT, "%s:%ld: expected two tokens separated by one space", path, lineno);
    char *buf = tera_malloc(n);
    long na = gpt2_unmap(u2b, line, (size_t)(sp - line), buf);
    long nb = na < 0 ? -1 : gpt2_unmap(u2b, sp + 1, n - (size_t)(sp - line) - 1, buf + na);
    tera_status s = TERA_OK;
    if (na < 0 || nb < 0) {
        s = tera_fail(TERA_ERR_FORMAT, "%s:%ld: not GPT-2's byte encoding", path, lineno);
    } else {
        int64_t a = tok_bmap_find(vocab, buf, (size_t)na), b = tok_bmap_find(vocab, buf + na, (size_t)nb);
        int64_t ab = tok_bmap_find(vocab, buf, (size_t)(na + nb));
        if (a < 0 || b < 0 || ab < 0)
            s = tera_fail(TERA_ERR_FORMAT, "%s:%ld: merge \"%s\": %s is not in the vocabulary", path, lineno, line,
                          a < 0 ? "the left token" : b < 0 ? "the right token" : "the merged token");
        ids[0] = (int32_t)a, ids[1] = (int32_t)b, ids[2] = (int32_t)ab;
    }
    free(buf);
    return s;
}

/* Reads vocab.bpe: an optional "#version" line, then one merge per line in rank order. */
static tera_status load_merges(const char *path, const int16_t u2b[TOK_U2B_SIZE], const tok_bmap *vocab,
                               int32_t *n_out, int32_t **left, int32_t **right, int32_t **result) {
    char *text = NULL;
    TERA_TRY(tera_read_text_file(path, &text));
    size_t cap = 1024;
    int32_t n = 0, *l = tera_malloc(cap * 4), *r = tera_malloc(cap * 4), *m = tera_malloc(cap * 4);
    tera_status s = TERA_OK;
    long lineno = 0;
    for (char *line = text, *next; line && s == TERA_OK; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        lineno++;
        size_t len = strlen(line);
        if (len && line[len - 1] == '\r') line[--len] = '\0';
        if (len == 0 || (lineno == 1 && line[0] == '#')) continue;
        if ((size_t)n == cap) {
            cap *= 2;
            l = tera_realloc(l, cap * 4), r = tera_realloc(r, cap * 4), m = tera_realloc(m, cap * 4);
        }
        int32_t ids[3] = {-1, -1, -1};
        s = parse_merge(path, lineno, line, u2b, vocab, ids);
        l[n] = ids[0], r[n] = ids[1], m[n] = ids[2];
        n++;
    }
    free(text);
    if (s != TERA_OK) {
        free(l), free(r), free(m);
        return s;
    }
    *n_out = n, *left = l, *right = r, *result = m;
    return TERA_OK;
}

tera_status tera_tokenizer_load_gpt2(tera_tokenizer **t, const char *encoder_json, const char *vocab_bpe) {
    uint32_t b2u[256];
    int16_t u2b[TOK_U2B_SIZE];
    gpt2_byte_map(b2u, u2b);
    *t = NULL;
    tok_bmap vocab;
    memset(&vocab, 0, sizeof vocab);
    tera_status s = load_encoder(encoder_json, u2b, &vocab);
    int32_t n = 0, *l = NULL, *r = NULL, *m = NULL;
    if (s == TERA_OK) s = load_merges(vocab_bpe, u2b, &vocab, &n, &l, &r, &m);
    if (s == TERA_OK) s = tok_build(t, &vocab, n, l, r, m, vocab_bpe);
    tok_bmap_free(&vocab);
    return s;
}

/* Joins dir and name into out (TERA_PATH_MAX). */
static tera_status join_path(char *out, const char *dir, const char *name) {
    if ((size_t)snprintf(out, TERA_PATH_MAX, "%s/%s", dir, name) >= TERA_PATH_MAX)
        return tera_fail(TERA_ERR_IO, "%s: path too long", dir);
    return TERA_OK;
}

tera_status tera_tokenizer_load(tera_tokenizer **t, const char *dir) {
    char enc[TERA_PATH_MAX], bpe[TERA_PATH_MAX];
    *t = NULL;
    TERA_TRY(join_path(enc, dir, "encoder.json"));
    TERA_TRY(join_path(bpe, dir, "vocab.bpe"));
    return tera_tokenizer_load_gpt2(t, enc, bpe);
}

/* ---- saving --------------------------------------------------------------------------------- */

/* The longest token, in bytes. */
static size_t max_token_len(const tera_tokenizer *t) {
    size_t mx = 1;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (t->tok_len[i] > mx) mx = t->tok_len[i];
    return mx;
}

static tera_status save_encoder(const tera_tokenizer *t, const uint32_t b2u[256], const char *path) {
    cJSON *root = cJSON_CreateObject();
    char *key = tera_malloc(2 * max_token_len(t) + 1);
    int ok = root != NULL;
    for (int32_t id = 0; id < t->n_vocab && ok; id++) {
        gpt2_map(b2u, t->tok_blob + t->tok_off[id], t->tok_len[id], key);
        cJSON *num = cJSON_CreateNumber(id);
        ok = num && cJSON_AddItemToObject(root, key, num);
    }
    free(key);
    char *json = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!json) return tera_fail(TERA_ERR_NOMEM, "%s: cannot build the JSON text", path);
    tera_status s = tera_file_write(path, json, strlen(json));
    cJSON_free(json);
    return s;
}

static tera_status save_merges(const tera_tokenizer *t, const uint32_t b2u[256], const char *path) {
    size_t mx = 2 * max_token_len(t) + 1, cap = 64 + (size_t)t->n_merges * 8, n = 0;
    char *out = tera_malloc(cap), *a = tera_malloc(mx), *b = tera_malloc(mx);
    n += (size_t)sprintf(out, "#version: 0.2\n");
    for (int32_t r = 0; r < t->n_merges; r++) {
        int32_t l = t->merge_left[r], rt = t->merge_right[r];
        gpt2_map(b2u, t->tok_blob + t->tok_off[l], t->tok_len[l], a);
        gpt2_map(b2u, t->tok_blob + t->tok_off[rt], t->tok_len[rt], b);
        size_t need = strlen(a) + strlen(b) + 3;
        if (n + need > cap) out = tera_realloc(out, cap = 2 * cap + need);
        n += (size_t)sprintf(out + n, "%s %s\n", a, b);
    }
    free(a), free(b);
    tera_status s = tera_file_write(path, out, n);
    free(out);
    return s;
}

/* Both files are written into a staging directory next to `dir` and moved into place together
 * (see data/atomic_file.h): a failure at any point leaves `dir` as it was and nothing behind. */
tera_status tera_tokenizer_save(const tera_tokenizer *t, const char *dir) {
    static const char *const names[] = {"encoder.json", "vocab.bpe"};
    uint32_t b2u[256];
    int16_t u2b[TOK_U2B_SIZE];
    gpt2_byte_map(b2u, u2b);
    tera_staged_dir sd;
    TERA_TRY(tera_staged_dir_open(&sd, dir));
    char enc[TERA_PATH_MAX + 96], bpe[TERA_PATH_MAX + 96];
    tera_status s = tera_staged_dir_path(&sd, names[0], enc, sizeof enc);
    if (s == TERA_OK) s = tera_staged_dir_path(&sd, names[1], bpe, sizeof bpe);
    if (s == TERA_OK) s = save_encoder(t, b2u, enc);
    if (s == TERA_OK) s = save_merges(t, b2u, bpe);
    if (s != TERA_OK) {
        char why[768]; /* (tera_fail must not format from its own buffer) */
        snprintf(why, sizeof why, "%s", tera_last_error());
        tera_staged_dir_abort(&sd, names, 2);
        return tera_fail(s, "tokenizer '%s' not written (nothing was changed): %s", sd.dir, why);
    }
    return tera_staged_dir_commit(&sd, names, 2);
}

/* ---- accessors and decoding ----------------------------------------------------------------- */

int32_t tera_tokenizer_vocab_size(const tera_tokenizer *t) { return t->n_vocab; }
int32_t tera_tokenizer_n_merges(const tera_tokenizer *t) { return t->n_merges; }
int32_t tera_tokenizer_eot(const tera_tokenizer *t) { return t->eot; }

void tera_tokenizer_merge(const tera_tokenizer *t, int32_t rank, int32_t *left, int32_t *right, int32_t *result) {
    TERA_ASSERT(rank >= 0 && rank < t->n_merges);
    *left = t->merge_left[rank], *right = t->merge_right[rank], *result = t->merge_result[rank];
}

const char *tera_tokenizer_token(const tera_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    *len = t->tok_len[id];
    return t->tok_blob + t->tok_off[id];
}

tera_status tera_tokenizer_decode(const tera_tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len) {
    size_t total = 0;
    *text = NULL, *len = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return tera_fail(TERA_ERR_ARG, "tokenizer: id %d at position %zu is not in [0, %d)", ids[i], i,
                             t->n_vocab);
        total += t->tok_len[ids[i]];
    }
    char *out = tera_malloc(total + 1);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(out + k, t->tok_blob + t->tok_off[ids[i]], t->tok_len[ids[i]]);
        k += t->tok_len[ids[i]];
    }
    out[k] = '\0';
    *text = out, *len = k;
    return TERA_OK;
}
