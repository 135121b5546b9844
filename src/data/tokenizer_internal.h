/* Internals of the BPE tokenizer (include/tera/tokenizer.h), shared by tokenizer.c (vocabulary,
 * files), tokenizer_encode.c (pre-tokenizer, merges, parallel encode) and tokenizer_train.c. */
#ifndef TERA_TOKENIZER_INTERNAL_H
#define TERA_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>

#include "tera/tokenizer.h"

/* GPT-2's pre-tokenizer. */
#define TOK_GPT2_PATTERN "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define TOK_EOT_TEXT "<|endoftext|>"

/* ---- a set of byte strings, numbered in insertion order (open addressing, xxHash) ---------- */
typedef struct {
    uint32_t *slot;   /* [mask+1] entry index + 1, 0 = empty */
    uint32_t mask;    /* slot count - 1 (a power of two) */
    uint32_t n;       /* entries */
    uint32_t cap;     /* entries allocated in hash/off/len */
    uint64_t *hash;   /* [cap] hash of each entry's bytes */
    uint64_t *off;    /* [cap] offset of each entry's bytes in blob */
    uint32_t *len;    /* [cap] byte count of each entry */
    char *blob;       /* all entries' bytes, back to back */
    size_t blob_n;    /* bytes used in blob */
    size_t blob_cap;  /* bytes allocated in blob */
} tok_bmap;

void tok_bmap_init(tok_bmap *m, uint32_t expect);
void tok_bmap_free(tok_bmap *m);
/* Index of the entry equal to s[0, n), or -1. */
int64_t tok_bmap_find(const tok_bmap *m, const void *s, size_t n);
/* Index of the entry equal to s[0, n), inserting it if absent; *added tells which (may be NULL). */
uint32_t tok_bmap_add(tok_bmap *m, const void *s, size_t n, int *added);
static inline const char *tok_bmap_str(const tok_bmap *m, uint32_t i, size_t *n) {
    *n = m->len[i];
    return m->blob + m->off[i];
}

/* ---- the pair -> merge table ---------------------------------------------------------------- */
typedef struct {
    uint64_t key;   /* (left id << 32) | right id; TOK_PAIR_EMPTY if the slot is free */
    int32_t rank;   /* merge rank (lower merges first) */
    int32_t result; /* id of the merged token */
} tok_pair_slot;
#define TOK_PAIR_EMPTY UINT64_MAX
#define TOK_NO_RANK INT32_MAX

static inline uint64_t tok_pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }
static inline uint64_t tok_pair_hash(uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> 32; }

/* ---- the tokenizer --------------------------------------------------------------------------- */
struct tera_tokenizer {
    int32_t n_vocab;         /* token ids are 0 .. n_vocab-1 */
    uint64_t *tok_off;       /* [n_vocab] offset of each token's bytes in tok_blob */
    uint32_t *tok_len;       /* [n_vocab] byte count of each token */
    char *tok_blob;          /* every token's bytes, back to back */
    int32_t byte_id[256];    /* token id of each single byte */
    int32_t n_merges;        /* merges, in rank order */
    int32_t *merge_left;     /* [n_merges] left id of merge r */
    int32_t *merge_right;    /* [n_merges] right id of merge r */
    int32_t *merge_result;   /* [n_merges] id of the merged token */
    tok_pair_slot *pairs;    /* [pair_mask+1] (left, right) -> (rank, result) */
    uint64_t pair_mask;      /* slot count - 1 */
    int32_t n_special;       /* special tokens ("<|...|>", not a byte nor a merge result) */
    int32_t *special_ids;    /* [n_special] their ids, ascending */
    int32_t eot;             /* id of <|endoftext|>, -1 if absent */
    pcre2_code *re;          /* the compiled pre-tokenizer */
    int jit;                 /* 1 if re was JIT-compiled (pcre2_jit_match may be used) */
};

/* Merge rank and result of the pair (a, b); rank TOK_NO_RANK if the pair never merges. */
static inline int32_t tok_pair_rank(const tera_tokenizer *t, int32_t a, int32_t b, int32_t *result) {
    uint64_t key = tok_pair_key(a, b);
    for (uint64_t i = tok_pair_hash(key) & t->pair_mask;; i = (i + 1) & t->pair_mask) {
        const tok_pair_slot *s = &t->pairs[i];
        if (s->key == key) {
            *result = s->result;
            return s->rank;
        }
        if (s->key == TOK_PAIR_EMPTY) return TOK_NO_RANK;
    }
}

/* Builds a tokenizer from a vocabulary (token v = entry v of vocab) and merges given as id
 * triples in rank order (arrays are taken over; the caller must not free them). Finds the byte
 * tokens and the special tokens, builds the pair table and compiles the pre-tokenizer.
 * `what` names the source in error messages. */
tera_status tok_build(tera_tokenizer **out, tok_bmap *vocab, int32_t n_merges, int32_t *left, int32_t *right,
                      int32_t *result, const char *what);

/* Compiles GPT-2's pattern (UTF + UCP, JIT when available). */
tera_status tok_compile_regex(pcre2_code **re, int *jit);

/* ---- pre-tokenizing (shared by encode and train) -------------------------------------------- */
/* Per-thread matcher state. */
typedef struct {
    pcre2_match_data *md;      /* match data (one pair of offsets) */
    pcre2_match_context *mctx; /* match context carrying jit_stack */
    pcre2_jit_stack *jit_stack;/* JIT stack (grows to 1 MiB for long whitespace runs) */
} tok_matcher;

tera_status tok_matcher_init(tok_matcher *m, const pcre2_code *re, int jit);
void tok_matcher_free(tok_matcher *m);
/* Checks that text[0, len) is valid UTF-8; TERA_ERR_FORMAT naming `base + offset` if not. */
tera_status tok_check_utf8(tok_matcher *m, const pcre2_code *re, const char *text, size_t len, size_t base);
/* Next pre-token of subject[0, len) at or after *pos (the subject must have passed
 * tok_check_utf8): sets [*s, *e) and returns 1, or returns 0 at the end; <0 is a PCRE2 error. */
int tok_next_pretoken(tok_matcher *m, const pcre2_code *re, int jit, const char *subject, size_t len, size_t pos,
                      size_t *s, size_t *e);

/* tera_tokenizer_encode_parallel with chunks of at least min_chunk bytes (tests use small ones). */
tera_status tok_encode_chunks(const tera_tokenizer *t, const char *text, size_t len, unsigned flags, int n_threads,
                              size_t min_chunk, int32_t **ids, size_t *n_ids);

#endif
