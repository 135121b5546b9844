/* The data position in a checkpoint's state.json, serialised by its owner (include/tera/data.h):
 * the "data" object. Field names are those of every earlier checkpoint (path, n_tokens, seq_len,
 * n_train, shuffle, samples_consumed, epoch, offset_in_epoch), so old checkpoints load. A streamed
 * source (src/data/stream.c) adds "stream": {"dp", "shards", "fingerprint", "ranks": [{"dp_rank",
 * "shard_file", "shard", "offset", "token", "epoch", "sample"}, ...]}, one position per data-parallel
 * rank: where the rank's next sample begins. n_tokens and n_train are 0 there (the stream has no
 * fixed length). */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "data/stream.h"
#include "tera/data.h"
#include "tera/io.h"

void tera_data_save(const tera_loader *l, const char *data_path, int64_t consumed, cJSON *root) {
    const tera_token_source *src = l->src;
    struct tera_stream *st = src ? src->stream : NULL;
    cJSON *data = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "data", data);
    cJSON_AddStringToObject(data, "path", data_path[0] ? data_path : "(embedded corpus)");
    cJSON_AddNumberToObject(data, "n_tokens", st ? 0.0 : (double)src->n_tokens);
    cJSON_AddNumberToObject(data, "seq_len", l->T);
    cJSON_AddNumberToObject(data, "n_train", st ? 0.0 : (double)l->n_train);
    cJSON_AddBoolToObject(data, "shuffle", l->shuffle);
    cJSON_AddNumberToObject(data, "samples_consumed", (double)consumed);
    const tera_stream_pos *pos = st ? tera_stream_synced(st) : NULL;
    if (!st) {
        cJSON_AddNumberToObject(data, "epoch", (double)(consumed / l->n_train));
        cJSON_AddNumberToObject(data, "offset_in_epoch", (double)(consumed % l->n_train));
        return;
    }
    TERA_ASSERTF(pos, "a streamed source saved before tera_loader_bind / tera_loader_sync");
    const int dp = tera_stream_dp(st);
    cJSON_AddNumberToObject(data, "epoch", (double)pos[0].epoch); /* dp rank 0's pass over its shards */
    cJSON *s = cJSON_AddObjectToObject(data, "stream"), *ranks = cJSON_CreateArray();
    char fp[32];
    snprintf(fp, sizeof fp, "%016" PRIx64, tera_stream_fingerprint(st));
    cJSON_AddNumberToObject(s, "dp", dp);
    cJSON_AddNumberToObject(s, "shards", tera_stream_n_shards(st));
    cJSON_AddStringToObject(s, "fingerprint", fp);
    cJSON_AddItemToObject(s, "ranks", ranks);
    for (int r = 0; r < dp; r++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "dp_rank", r);
        cJSON_AddStringToObject(o, "shard_file", tera_stream_shard_name(st, r, pos[r].shard));
        cJSON_AddNumberToObject(o, "shard", (double)pos[r].shard);
        cJSON_AddNumberToObject(o, "offset", (double)pos[r].offset);
        cJSON_AddNumberToObject(o, "token", (double)pos[r].token);
        cJSON_AddNumberToObject(o, "epoch", (double)pos[r].epoch);
        cJSON_AddNumberToObject(o, "sample", (double)pos[r].sample);
        cJSON_AddItemToArray(ranks, o);
    }
}

tera_status tera_data_load(tera_loader *l, const cJSON *root, const char *path, uint64_t ckpt_seed, uint64_t run_seed,
                           int64_t *consumed) {
    const tera_token_source *src = l->src;
    struct tera_stream *st = src ? src->stream : NULL;
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(root, "data");
    /* whole numbers in range: a damaged or hand-edited position is refused naming the key, never
     * cast into a negative sample index (an abort in the loader) or an endless epoch count */
    const char *dfields[] = {"n_tokens", "seq_len", "n_train", "samples_consumed"};
    const int64_t dmax[] = {TERA_JSON_MAX_WHOLE, INT_MAX, TERA_JSON_MAX_WHOLE, TERA_JSON_MAX_WHOLE};
    int64_t d[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; i++) TERA_TRY(tera_json_whole(data, dfields[i], path, "data.", 0, dmax[i], &d[i]));
    const int shuffle = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(data, "shuffle"));
    const cJSON *sj = cJSON_GetObjectItemCaseSensitive(data, "stream");
    if (!st && sj)
        return tera_fail(TERA_ERR_CONFIG, "--resume: %s was streaming its data (data.stream = true, data.tokenizer "
                         "set); this run reads a whole token stream: set data.stream = true with the same data", path);
    if (st && !sj)
        return tera_fail(TERA_ERR_CONFIG, "--resume: %s was reading a whole token stream (prepared data or data.stream "
                         "= false); this run streams: set data.stream = false", path);
    if (!st) {
        if ((int64_t)d[0] != src->n_tokens || (int)d[1] != l->T || (int64_t)d[2] != l->n_train ||
            shuffle != l->shuffle || ckpt_seed != run_seed)
            return tera_fail(TERA_ERR_CONFIG,
                             "--resume: %s was reading other data (%ld tokens, seq_len %d, %ld training samples, "
                             "shuffle %d, seed %lu) than this run (%ld, %d, %ld, %d, %lu): resuming would not "
                             "continue the same sample stream",
                             path, (long)d[0], (int)d[1], (long)d[2], shuffle, (unsigned long)ckpt_seed,
                             (long)src->n_tokens, l->T, (long)l->n_train, l->shuffle, (unsigned long)run_seed);
        *consumed = (int64_t)d[3];
        return TERA_OK;
    }
    /* streaming: the same shards, sequence length and dp degree (each dp rank continues its own stream) */
    int64_t dp = 0, ns = 0;
    TERA_TRY(tera_json_whole(sj, "dp", path, "data.stream.", 1, INT_MAX, &dp));
    TERA_TRY(tera_json_whole(sj, "shards", path, "data.stream.", 1, INT_MAX, &ns));
    const cJSON *fp = cJSON_GetObjectItemCaseSensitive(sj, "fingerprint");
    char mine[32];
    snprintf(mine, sizeof mine, "%016" PRIx64, tera_stream_fingerprint(st));
    if ((int)d[1] != l->T)
        return tera_fail(TERA_ERR_CONFIG, "--resume: %s streamed samples of training.seq_len = %d, this run has %d: "
                         "resuming would not continue the same sample stream", path, (int)d[1], l->T);
    if ((int)ns != tera_stream_n_shards(st) || !cJSON_IsString(fp) || strcmp(fp->valuestring, mine))
        return tera_fail(TERA_ERR_CONFIG, "--resume: %s streamed %d shard(s) with other names or format (fingerprint "
                         "%s) than this run's %d under data.path '%s' (%s)", path, (int)ns,
                         cJSON_IsString(fp) ? fp->valuestring : "?", tera_stream_n_shards(st), src->path, mine);
    if ((int)dp != tera_stream_dp(st))
        return tera_fail(TERA_ERR_CONFIG, "--resume: %s streamed its shards over parallel.dp = %d data-parallel ranks "
                         "(each rank its own shards and position), this run has dp = %d: resume with parallel.dp = "
                         "%d (tp, pp and ep may change)", path, (int)dp, tera_stream_dp(st), (int)dp);
    if (ckpt_seed != run_seed)
        return tera_fail(TERA_ERR_CONFIG, "--resume: %s was trained with training.seed = %lu, this run has %lu", path,
                         (unsigned long)ckpt_seed, (unsigned long)run_seed);
    const cJSON *ranks = cJSON_GetObjectItemCaseSensitive(sj, "ranks");
    const int r = tera_stream_dp_rank(st);
    const cJSON *o = cJSON_IsArray(ranks) && cJSON_GetArraySize(ranks) == (int)dp ? cJSON_GetArrayItem(ranks, r) : NULL;
    if (!o) return tera_fail(TERA_ERR_FORMAT, "%s: \"data.stream.ranks\" is missing or has not %d entries", path, (int)dp);
    const char *keys[] = {"epoch", "shard", "offset", "token", "sample"};
    int64_t v[5] = {0, 0, 0, 0, 0};
    for (int i = 0; i < 5; i++) TERA_TRY(tera_json_whole(o, keys[i], path, "data.stream.ranks[].", 0, TERA_JSON_MAX_WHOLE, &v[i]));
    const tera_stream_pos p = {v[0], v[1], v[2], v[3], v[4]};
    TERA_TRY(tera_stream_restart(st, (int64_t)d[3], &p));
    *consumed = (int64_t)d[3];
    return TERA_OK;
}
