/* Byte-level BPE tokenizer (GPT-2 compatible).
 *
 * Text is split into pre-tokens by GPT-2's regular expression (PCRE2, Unicode properties), each
 * pre-token's UTF-8 bytes start as one symbol per byte (all 256 bytes are tokens), and the ranked
 * merges are applied lowest rank first, leftmost first. The result is identical to GPT-2's
 * encoder.py for every valid UTF-8 text. Input must be valid UTF-8: anything else is
 * TERA_ERR_FORMAT naming the byte offset. decode(encode(x)) == x for every valid text.
 *
 * Files: a tokenizer is stored as GPT-2's pair `encoder.json` (token string -> id, bytes written
 * through GPT-2's byte-to-unicode map) and `vocab.bpe` ("#version: 0.2" then one merge "A B" per
 * line, rank order), so trained tokenizers load in other tools (tiktoken, Hugging Face GPT2Tokenizer).
 * Special tokens are the encoder.json entries of the form "<|...|>" that are neither a byte nor
 * a merge result; `<|endoftext|>` is the end-of-document token.
 *
 * Threads: a loaded tokenizer is read-only; any number of threads may encode/decode with it. */
#ifndef TERA_TOKENIZER_H
#define TERA_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "tera/status.h"

typedef struct tera_tokenizer tera_tokenizer; /* opaque; see src/data/tokenizer_internal.h */

/* Encode flags. */
enum {
    TERA_TOK_ALLOW_SPECIAL = 1u << 0, /* recognise special tokens ("<|endoftext|>") in the text;
                                         without it they are encoded as ordinary text */
};

/* Loads GPT-2's encoder.json + vocab.bpe (any file pair in that format). */
tera_status tera_tokenizer_load_gpt2(tera_tokenizer **t, const char *encoder_json, const char *vocab_bpe);
/* Loads DIR/encoder.json + DIR/vocab.bpe. */
tera_status tera_tokenizer_load(tera_tokenizer **t, const char *dir);
/* Writes DIR/encoder.json + DIR/vocab.bpe (creating DIR and its parents), replacing the two files
 * if present, without ever leaving them half-written: both are written (every write, flush, fsync
 * and close checked) into a temporary directory next to DIR (DIR.tmp.PID.N) and moved into place
 * only when complete; a DIR that holds only these files is swapped whole in one step. On failure
 * (a full disk, ...) DIR is unchanged, nothing is left behind, and the message names the file and
 * the reason. */
tera_status tera_tokenizer_save(const tera_tokenizer *t, const char *dir);
void tera_tokenizer_free(tera_tokenizer *t);

/* Number of token ids (ids are 0 .. size-1). */
int32_t tera_tokenizer_vocab_size(const tera_tokenizer *t);
/* Number of merges (ranks are 0 .. n-1). */
int32_t tera_tokenizer_n_merges(const tera_tokenizer *t);
/* Merge `rank`: left and right token ids and the resulting id (rank must be in range). */
void tera_tokenizer_merge(const tera_tokenizer *t, int32_t rank, int32_t *left, int32_t *right, int32_t *result);
/* The end-of-document token `<|endoftext|>` (50256 for GPT-2), or -1 if the vocabulary has none. */
int32_t tera_tokenizer_eot(const tera_tokenizer *t);
/* The bytes of token `id` (not NUL-terminated) and their count; NULL if id is out of range. */
const char *tera_tokenizer_token(const tera_tokenizer *t, int32_t id, size_t *len);

/* Encodes text[0, len) (valid UTF-8). On success *ids is a malloc'd array of *n_ids ids that the
 * caller frees (free()); NULL when n_ids is 0. On failure *ids is NULL. */
tera_status tera_tokenizer_encode(const tera_tokenizer *t, const char *text, size_t len, unsigned flags,
                                  int32_t **ids, size_t *n_ids);
/* Same result as tera_tokenizer_encode, computed by n_threads OpenMP threads (<= 0: the OpenMP
 * default). The text is cut at pre-token boundaries (after a newline, before an ASCII letter or
 * digit) and the pieces' ids are concatenated in order. */
tera_status tera_tokenizer_encode_parallel(const tera_tokenizer *t, const char *text, size_t len,
                                           unsigned flags, int n_threads, int32_t **ids, size_t *n_ids);
/* Decodes ids into their bytes: *text is malloc'd (NUL-terminated for convenience, the terminator
 * not counted in *len); the caller frees it. An id out of range is TERA_ERR_ARG. */
tera_status tera_tokenizer_decode(const tera_tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len);

/* Trains a byte-level BPE tokenizer: 256 byte tokens (id = byte value), then merges of the most
 * frequent adjacent pair within pre-tokens (ties: the pair whose (left bytes, right bytes) is
 * lexicographically smallest) until the vocabulary holds vocab_size - 1 tokens, then
 * `<|endoftext|>` as the last id. Stops early (smaller vocabulary) if no pair is left.
 * Deterministic: the same texts give the same merges. vocab_size must be >= 257. Empty texts are
 * allowed, but if every text is empty it is TERA_ERR_FORMAT (nothing to learn). Errors (invalid
 * UTF-8: the byte offset) name the text as "training text I". */
tera_status tera_tokenizer_train(tera_tokenizer **t, const char *const *texts, const size_t *lens, int n_texts,
                                 int vocab_size);
/* The same, with errors naming the text by names[i] (e.g. its file) when names is not NULL. */
tera_status tera_tokenizer_train_named(tera_tokenizer **t, const char *const *texts, const size_t *lens,
                                       const char *const *names, int n_texts, int vocab_size);

#endif
