/* Token sources for training (the full data pipeline — BPE, shuffling service, prefetch — grows
 * from here). A source is one token stream: every document concatenated in order.
 *
 * Sample i of a stream (sequence length T) is tokens[i*T, i*T+T+1): T inputs and, shifted by one,
 * T targets. Samples [0, n_train) train; the last val_fraction of samples is held out. */
#ifndef TERA_DATA_H
#define TERA_DATA_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tera/config.h"
#include "tera/status.h"

typedef enum { TERA_SRC_EMBEDDED, TERA_SRC_TEXT, TERA_SRC_BIN, TERA_SRC_U16, TERA_SRC_ONLINE, TERA_SRC_STREAM } tera_source_kind;

struct tera_blend; /* a weighted blend of sources (data.paths, src/data/blend.c) */
struct tera_stream; /* streaming online tokenization (data.stream, src/data/stream.c) */
struct tera_comm;
struct cJSON;

typedef struct tera_token_source {
    tera_source_kind kind;
    char path[TERA_PATH_MAX];   /* file (text/u16) or prefix (bin: PREFIX.bin + PREFIX.idx) */
    int64_t n_tokens;
    int elem_size;              /* bytes per token in `tokens`: 1 (text bytes), 2, 4 or 8 */
    const void *tokens;         /* mapped or embedded token array */
    void *map; size_t map_len;  /* the .bin / file mapping, if any */
    int64_t n_docs;             /* documents (bin: from the index; else 1) */
    struct tera_blend *blend;   /* data.paths: the blend (this source's own fields are its first dataset's) */
    void *owned;                /* a token array the source allocated (online tokenization), freed at close */
    struct tera_stream *stream; /* kind TERA_SRC_STREAM: the shards, read during training (no token array) */
    struct tera_token_source *val; /* data.val_path: the validation set, opened with data.stream = false (NULL:
                                      the last data.val_fraction of this source's samples validate) */
    struct {                    /* online tokenization (data.tokenizer): what the start-up pass did */
        int shards, workers, ranks; /* ranks: the processes that shared the encoding (the world) */
        int64_t bytes;          /* raw text bytes (decompressed) */
        double tokenize_seconds, seconds; /* encoding only; the whole pass (reading, splitting, packing) */
    } online;
} tera_token_source;

/* Opens dc->path according to dc->format (auto: PREFIX.idx exists -> bin, *.u16 -> u16, else
 * text). Text is byte-level: token id = byte value (needs vocab_size >= 256). "" = the embedded
 * default corpus. Every token id is checked < vocab_size; the first offender is reported with the
 * file and token offset. Empty or too-short sources (fewer than T+1 tokens... checked by the
 * loader) and malformed .idx files are TERA_ERR_FORMAT naming the file and offset. */
tera_status tera_source_open(tera_token_source *s, const tera_data_config *dc, int vocab_size);
/* With data.val_path set it also opens that set into s->val (as data.path with data.stream = false, and
 * not with a blend); its errors name data.val_path. */
/* With data.tokenizer set (online tokenization, src/data/online.c) tera_source_open is collective over
 * the world: every rank calls it, in the same order (the ranks share the encoding). */
/* data.paths = "W1 PREFIX1, W2 PREFIX2, ...": every dataset opened as tera_source_open would open
 * data.path (data.format applies to each), weights > 0 normalised to sum 1 (tera_source_open calls
 * it when data.paths is set; data.path must then be empty). */
tera_status tera_blend_open(struct tera_blend **b, const tera_data_config *dc, int vocab_size);
void tera_blend_close(struct tera_blend *b);
void tera_source_close(tera_token_source *s);
int64_t tera_source_token(const tera_token_source *s, int64_t i);

/* Megatron-LM indexed dataset (MMIDIDX version 1). Writes PREFIX.bin and PREFIX.idx (atomic
 * rename) for the documents docs[d] of doc_len[d] tokens, stored with element dtype code `dtype`
 * (Megatron codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16). */
tera_status tera_idx_write(const char *prefix, int dtype, const int32_t *const *docs,
                           const int64_t *doc_len, int64_t n_docs);

/* The same, streaming: documents are appended one by one to PREFIX.bin.tmp (hashed on the way);
 * commit writes PREFIX.idx and PREFIX.xxh3 (XXH3-64 of both files, checked by tera_source_open
 * when present) and renames .bin, .xxh3, then .idx into place. abort removes the temporaries. */
typedef struct tera_idx_writer tera_idx_writer;
tera_status tera_idx_writer_open(tera_idx_writer **w, const char *prefix, int dtype);
tera_status tera_idx_writer_add(tera_idx_writer *w, const int32_t *ids, int64_t n);
tera_status tera_idx_writer_commit(tera_idx_writer *w); /* frees w */
void tera_idx_writer_abort(tera_idx_writer *w);         /* frees w */

/* Deterministic sample order over a source. A streamed source (TERA_SRC_STREAM) has no token array:
 * each data-parallel rank reads its own shards in order (tera_loader_bind), sample k of a rank's
 * stream is tokens [k T, k T + T + 1) of the concatenation of its shards' documents; n_train is then
 * unbounded (TERA_STREAM_UNBOUNDED) and n_val that of data.val_path (0 without it). */
#define TERA_STREAM_UNBOUNDED ((int64_t)1 << 62)
typedef struct {
    const tera_token_source *src;
    int T;
    int64_t n_samples;          /* (n_tokens - 1) / T */
    int64_t n_train, n_val;     /* n_train + n_val = n_samples (without data.val_path; with it n_val counts its samples) */
    int shuffle;                /* 0: train sample j of epoch e is sample j */
    uint64_t seed;
    /* fault injection for tests (TERA_FAULT_POISON_SAMPLE): training samples with global index in
     * [poison_lo, poison_hi) are uniformly random token ids below poison_vocab (0: off) */
    int64_t poison_lo, poison_hi;
    int32_t poison_vocab;
} tera_loader;

tera_status tera_loader_init(tera_loader *l, const tera_token_source *src, int T, float val_fraction,
                             int shuffle, uint64_t seed);
/* The g-th training sample of the whole run (g = step * global_batch + position in the batch),
 * wrapping over epochs: epoch = g / n_train; with shuffle, a seed-and-epoch keyed bijection of
 * [0, n_train) (no table of n_train entries). Writes inputs[T] and targets[T]. */
void tera_loader_train_sample(const tera_loader *l, int64_t g, int32_t *inputs, int32_t *targets);
/* Which global training sample a rank reads: sample b of micro-batch a on data-parallel rank r of
 * R, in the step that starts after `consumed` samples. A step reads the global samples
 * [consumed, consumed + micro*accum*R), each exactly once over all ranks; each rank computes only
 * its own indices. Because the data position is counted in samples, a run resumed with another
 * micro-batch, accumulation or data-parallel degree continues with the very next sample. */
int64_t tera_loader_step_sample(int64_t consumed, int micro, int accum_idx, int dp_rank, int dp_size, int b);

/* Streaming (src/data/stream.c): which of the streams this process reads and how global sample
 * indices map onto it. Global sample g of the run is sample (g - c0) div (B dp) B + (g - c0) mod B of
 * dp rank ((g - c0) div B) mod dp's stream, counted from the data position c0 the stream was
 * (re)started at: a step's micro-batch a of rank r (tera_loader_step_sample) is then B consecutive
 * samples of r's own stream. Fails (naming the values) when dp exceeds the number of shards or
 * evaluation is asked for (no validation split). A no-op for other sources. micro: training.micro_batch */
tera_status tera_loader_bind(tera_loader *l, int dp_rank, int dp_size, int micro, int eval_every);
/* Before a checkpoint (collective over the data-parallel group dp, every rank): agrees every dp rank's
 * stream position at the data position `consumed`, for tera_data_save. A no-op without streaming. */
void tera_loader_sync(const tera_loader *l, struct tera_comm *dp, int64_t consumed);
/* The data section of state.json, serialised by its owner (src/data/data_state.c): root's "data"
 * object (path, n_tokens, seq_len, n_train, shuffle, samples_consumed, epoch, offset_in_epoch; when
 * streaming also "stream": the dp degree, the shard list's fingerprint and each dp rank's position:
 * shard, byte offset of the document, token offset in it, epoch, sample). data_path: as configured. */
void tera_data_save(const tera_loader *l, const char *data_path, int64_t consumed, struct cJSON *root);
/* Reads it back and checks that this run reads the same stream (ckpt_seed / run_seed: training.seed of
 * the checkpoint and of this run); restarts a streamed source at this rank's saved position. *consumed:
 * the data position. Errors name the file and field. */
tera_status tera_data_load(tera_loader *l, const struct cJSON *root, const char *path, uint64_t ckpt_seed,
                           uint64_t run_seed, int64_t *consumed);

/* The v-th validation sample (v mod n_val): of data.val_path's source when set (every sample of it
 * validates), else of the held-out tail. */
void tera_loader_val_sample(const tera_loader *l, int64_t v, int32_t *inputs, int32_t *targets);

/* Blends (data.paths): global sample g (training or validation alike) belongs to dataset
 * which[g mod P] of a fixed period of P = TERA_BLEND_PERIOD positions filled greedily (position p
 * goes to the dataset d maximising w_d (p + 1) - (positions of d so far), ties to the lower d,
 * Megatron's blending rule), and is that dataset's sample (g / P) n_d + (its rank among d's
 * positions of the period), n_d = d's positions per period: a function of g alone, so any layout
 * and any resume read the same samples; any prefix of a period holds w_d x its length samples of
 * dataset d, within one sample. The datasets' loaders live in the blended source, so a blended
 * source serves one loader configuration (its latest tera_loader_init). Each dataset has its own train/validation
 * split (the last data.val_fraction of its samples), epochs and shuffle (keyed by seed + d). */
#define TERA_BLEND_PERIOD 10000
int tera_loader_n_datasets(const tera_loader *l);          /* 1 without a blend */
const char *tera_loader_dataset_name(const tera_loader *l, int d); /* the prefix's base name, JSON-safe */
double tera_loader_dataset_weight(const tera_loader *l, int d);
/* Which dataset global training sample g comes from (0 without a blend). */
int tera_loader_dataset_of(const tera_loader *l, int64_t g);
/* The v-th validation sample of dataset d alone (v mod its validation samples). */
void tera_loader_val_sample_of(const tera_loader *l, int d, int64_t v, int32_t *inputs, int32_t *targets);
int64_t tera_loader_n_val_of(const tera_loader *l, int d);
/* One line per blended dataset (name, weight, samples) and, for online tokenization, the start-up
 * pass: documents, tokens, shards, workers and tokens/s of the encoding (nothing for other sources). */
void tera_data_report(const tera_loader *l, FILE *f);

/* A background thread that reads training micro-batches ahead of the step loop: it prepares the
 * micro-batches of global samples [g, g+B), [g+B, g+2B), ... into `depth` slots. */
typedef struct tera_prefetcher tera_prefetcher;

tera_status tera_prefetch_start(tera_prefetcher **p, const tera_loader *l, int B, int depth);
/* The micro-batch of global training samples [g0, g0+B): inputs, targets [B, T], valid until the
 * next call. Blocks until it is ready (a request other than the next in sequence restarts the
 * read-ahead at g0). Returns the seconds spent waiting. */
double tera_prefetch_get(tera_prefetcher *p, int64_t g0, const int32_t **inputs, const int32_t **targets);
void tera_prefetch_stop(tera_prefetcher *p);

extern const unsigned char tera_default_corpus[];
extern const size_t tera_default_corpus_len;

#endif
