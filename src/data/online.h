/* Online tokenization (data.tokenizer): the source's side (private to src/data). */
#ifndef TERA_DATA_ONLINE_H
#define TERA_DATA_ONLINE_H

#include "tera/data.h"

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

#endif
