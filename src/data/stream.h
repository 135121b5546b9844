/* Streaming online tokenization (data.stream): the source's and the data state's side (private to src/data). */
#ifndef TERA_DATA_STREAM_H
#define TERA_DATA_STREAM_H

#include "tera/data.h"

/* Where a sample of a dp rank's stream begins: its first token is token `token` of the document
 * (its tokens, then the end-of-document token) that starts at decompressed byte `offset` of the
 * rank's shard number `shard` (0-based in the rank's own list), in pass `epoch` over the rank's
 * shards; `sample` is the sample's index in the rank's stream. This is the whole packing state:
 * the tokens of a partly packed sequence are re-made from the document on a restart. */
typedef struct {
    int64_t epoch, shard, offset, token, sample;
} tera_stream_pos;
#define TERA_STREAM_POS_FIELDS 5

/* Lists data.path's shards, loads data.tokenizer and checks what can be checked before training
 * (format, vocabulary, the files open); s: kind TERA_SRC_STREAM, no token array. Reads nothing more
 * until the first sample is asked for. */
tera_status tera_stream_open(tera_token_source *s, const tera_data_config *dc, int vocab_size);
void tera_stream_close(struct tera_stream *st); /* stops the threads; prints the rank's totals (world rank 0) */
/* Global training sample g (after tera_loader_bind). inputs, targets: [T] */
void tera_stream_sample(struct tera_stream *st, int64_t g, int32_t *inputs, int32_t *targets);

/* for src/data/data_state.c */
int tera_stream_dp(const struct tera_stream *st);
int tera_stream_dp_rank(const struct tera_stream *st);
int tera_stream_n_shards(const struct tera_stream *st);       /* all shards (every dp rank's) */
uint64_t tera_stream_fingerprint(const struct tera_stream *st); /* of the shard list's base names and the format */
/* dp rank r's shard number i (its own list) -> the shard's path */
const char *tera_stream_shard_name(const struct tera_stream *st, int r, int64_t i);
/* the positions agreed by the last tera_loader_sync: [dp] (NULL before any) */
const tera_stream_pos *tera_stream_synced(const struct tera_stream *st);
/* Continue this rank's stream at pos, global sample `consumed` being its sample pos->sample. */
tera_status tera_stream_restart(struct tera_stream *st, int64_t consumed, const tera_stream_pos *pos);

#endif
