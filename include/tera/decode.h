/* Inference forward with a key/value cache (`tera generate`, `tera eval --task`, training samples).
 *
 * A decoder runs the model of a one-process tera_model (its weights, configuration, router bias and
 * compute backend; tera_model_create with par NULL) over rows of tokens, each row one token of one
 * of B sequences at that sequence's next position. The keys and values of every position it has
 * seen stay in a cache ([L][B, Hkv, T_max, hd] each), so a new token costs one row through the
 * layers and one attention pass over the cached positions: no recomputation of the prefix.
 *
 * It computes exactly MODEL.md's model, the one tera_model_forward computes: RoPE at each row's
 * absolute position, grouped-query causal attention (softmax in fp32), MoE routing with the model's
 * router scoring, group limit, routed scale and aux-free selection bias, shared experts, dense
 * layers. Routing is dropless (as Hugging Face Mixtral at inference): a model trained with a
 * capacity factor computes what tera_model_forward computes when no assignment is dropped.
 * Every operation goes through the model's backend (include/tera/backend.h).
 *
 * Memory: the cache and the scratch for up to max(B, chunk) rows per call are allocated once by
 * tera_decoder_create; nothing is allocated per token. */
#ifndef TERA_DECODE_H
#define TERA_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "tera/model.h"
#include "tera/status.h"

typedef struct tera_decoder tera_decoder;

/* A decoder over m (one process: m->par.ep = tp = pp = 1, whole weights in m->w) for B sequences
 * of at most T_max positions (<= model.max_seq_len); prefill chunks of up to `chunk` rows (0: 256).
 * m must outlive the decoder. The CPU backend only (the cache is written with memcpy): another
 * backend is TERA_ERR_CONFIG. */
tera_status tera_decoder_create(tera_decoder **d, tera_model *m, int B, int T_max, int chunk);
void tera_decoder_free(tera_decoder *d);

/* Empties sequence b's cache (b = -1: every sequence). */
void tera_decoder_reset(tera_decoder *d, int b);
/* Keeps the first n positions of sequence b (n <= its length): the rest is forgotten, so another
 * continuation of the same prefix can follow without recomputing it. */
void tera_decoder_truncate(tera_decoder *d, int b, int n);
/* Positions cached for sequence b. */
int tera_decoder_len(const tera_decoder *d, int b);
int tera_decoder_max_len(const tera_decoder *d);
int tera_decoder_batch(const tera_decoder *d);

/* Appends tokens[0, n) to sequence b (positions len .. len + n - 1), in chunks. logits: [n, V], the
 * next-token logits after every appended token (all = 1), or [V] after the last one (all = 0).
 * TERA_ERR_ARG when the sequence would exceed T_max or a token is outside [0, V). */
tera_status tera_decoder_append(tera_decoder *d, int b, const int32_t *tokens, int n, float *logits, int all);

/* One token for each sequence b with active[b] != 0 (active NULL: all), all in one pass of rows
 * through the layers. tokens: [B]; logits: [B, V] (rows of inactive sequences are left as they are).
 * TERA_ERR_ARG when an active sequence is full or a token is outside [0, V). */
tera_status tera_decoder_step(tera_decoder *d, const int32_t *tokens, const uint8_t *active, float *logits);

/* Decoded text s[0, n) as valid UTF-8 (for JSON): every byte that does not start a well-formed
 * sequence, and every NUL, becomes U+FFFD (a token may end inside a character). Returns a malloc'd
 * NUL-terminated string. */
char *tera_utf8_clean(const char *s, size_t n);

#endif
