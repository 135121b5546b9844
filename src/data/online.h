/* Online tokenization (data.tokenizer): the source's side (private to src/data). */
#ifndef TERA_DATA_ONLINE_H
#define TERA_DATA_ONLINE_H

#include <pthread.h>
#include <stdint.h>

#include "tera/data.h"
#include "tera/tokenizer.h"

/* Reads data.path (a file, a directory's files or a glob, sorted; *.zst, *.gz decompressed), splits it into
 * documents (data.format text: one per file; jsonl: the "text" field of each line), encodes them with
 * data.tokenizer on data.tokenize_workers threads and packs them in order, each followed by the
 * end-of-document token, into s (kind TERA_SRC_ONLINE, int32 ids it owns). Collective over the world
 * (tera_comm_world): each rank encodes its contiguous share of every shard's documents and an
 * all-gather assembles the stream, so every rank of the job must call it, in the same order. Errors
 * name the file (and line); an encoding failure is agreed, every rank returns the same message. */
tera_status tera_online_open(tera_token_source *s, const tera_data_config *dc, int vocab_size);

/* data.path -> its shards, sorted by name: a directory's regular, non-hidden files, a glob's matches or
 * the one file (*out: strdup'ed names in a malloc'ed array). "matches no file" is an error. */
tera_status tera_online_list_shards(const char *path, char ***out, int *n_out);
/* Whether a shard is JSON lines: data.format = jsonl, or auto and named *.jsonl / *.json (.zst, .gz). */
int tera_online_is_jsonl(const char *format, const char *name);

/* The checks both ways of online tokenization share (data.format text | jsonl | auto, a data.path),
 * then data.tokenizer loaded into *out, whose vocabulary must fit model.vocab_size. Errors name the key. */
tera_status tera_online_tokenizer(const tera_data_config *dc, int vocab_size, tera_tokenizer **out);

/* One document of a shard, as the start-up pass (online.c) and the streaming producer (stream.c)
 * encode it: text[len] in; ids[n_ids] out (malloc'ed by the encoder, the caller frees), or st and err
 * (the message) when it could not be encoded. owned: what to free of the text (NULL: it points into
 * the caller's shard buffer). epoch, shard, offset, line: where it starts (streaming; line 0 in a
 * text shard). */
typedef struct {
    char *text;
    size_t len;
    char *owned;
    int64_t epoch, shard, offset, line;
    int32_t *ids;
    size_t n_ids;
    tera_status st;
    char err[512];
} tera_online_doc;

/* Encodes docs[0..n) with tok on min(workers, n) threads, the caller's one of them (th: room for
 * workers - 1 thread handles). Each document's ids do not depend on which thread encodes it. */
void tera_online_encode(const tera_tokenizer *tok, tera_online_doc *docs, int n, int workers, pthread_t *th);

#endif
