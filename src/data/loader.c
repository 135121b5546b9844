/* Deterministic sample order over a token source; see include/tera/data.h.
 *
 * Shuffling holds no permutation table: the order of epoch e is a keyed bijection of [0, n_train)
 * computed per sample, so any global sample index g (and hence an exact resume at any step, on any
 * number of ranks) costs O(1) to locate. The bijection is a 4-round Feistel network on the b-bit
 * words, 2^b the next power of two >= n_train, restricted to [0, n_train) by cycle-walking:
 * re-encrypt until the value falls inside the domain. Each round XORs one half of the word with a
 * keyed hash of the other half, so every round, and the whole network, is invertible on b bits for
 * any split (b odd gives halves of ceil(b/2) and floor(b/2) bits). Walking from a point of
 * [0, n_train) stays on its cycle and must come back into [0, n_train), so the restriction is a
 * bijection too; with 2^b < 2 n_train the expected walk is under two encryptions. */
#include "tera/data.h"

#include <math.h>
#include <string.h>

#include "data/blend.h"
#include "data/stream.h"
#include "tera/rng.h"

/* Philox counter tag of the shuffle's round keys ("SHUF"), distinct from other users of the seed. */
#define SHUFFLE_TAG 0x53485546ull

tera_status tera_loader_init(tera_loader *l, const tera_token_source *src, int T, float val_fraction,
                             int shuffle, uint64_t seed) {
    memset(l, 0, sizeof *l);
    if (T < 1) return tera_fail(TERA_ERR_CONFIG, "training.seq_len = %d: must be >= 1", T);
    if (!(val_fraction >= 0.0f && val_fraction < 1.0f))
        return tera_fail(TERA_ERR_CONFIG, "data.val_fraction = %g: must be in [0, 1)", (double)val_fraction);
    int64_t n_val_set = 0; /* data.val_path: the validation set's samples */
    if (src->val) {
        n_val_set = src->val->n_tokens > 0 ? (src->val->n_tokens - 1) / T : 0;
        if (n_val_set < 1)
            return tera_fail(TERA_ERR_FORMAT, "data.val_path '%s': %lld tokens hold no sample of training.seq_len+1 = "
                             "%lld tokens", src->val->path, (long long)src->val->n_tokens, (long long)T + 1);
        val_fraction = 0.0f; /* open_val refused a split besides the set */
    }
    if (src->stream) { /* streamed (src/data/stream.c): read in order, unbounded, no split */
        if (val_fraction > 0.0f)
            return tera_fail(TERA_ERR_CONFIG, "data.val_fraction = %g: streamed online tokenization (data.stream = true) "
                             "keeps no validation split; set data.val_fraction = 0, or data.stream = false (the "
                             "start-up pass) for a split", (double)val_fraction);
        if (shuffle)
            return tera_fail(TERA_ERR_CONFIG, "data.shuffle = true: streamed online tokenization (data.stream = true) "
                             "reads each rank's shards in order; set data.shuffle = false, or data.stream = false");
        l->src = src;
        l->T = T;
        l->n_samples = l->n_train = TERA_STREAM_UNBOUNDED;
        l->n_val = n_val_set;
        l->seed = seed;
        return TERA_OK;
    }
    int64_t n_samples = src->n_tokens > 0 ? (src->n_tokens - 1) / T : 0;
    if (n_samples < 1) {
        if (src->kind == TERA_SRC_EMBEDDED)
            return tera_fail(TERA_ERR_FORMAT, "the embedded default corpus: %lld tokens hold no sample of "
                             "training.seq_len+1 = %lld tokens", (long long)src->n_tokens, (long long)T + 1);
        return tera_fail(TERA_ERR_FORMAT, "data.path '%s': %lld tokens hold no sample of training.seq_len+1 = "
                         "%lld tokens", src->path, (long long)src->n_tokens, (long long)T + 1);
    }
    int64_t n_val = (int64_t)floor((double)val_fraction * (double)n_samples);
    if (n_val > n_samples - 1) n_val = n_samples - 1; /* keep at least one training sample */
    if (n_val < 0) n_val = 0;
    l->src = src;
    l->T = T;
    l->n_samples = n_samples;
    l->n_val = n_val;
    l->n_train = n_samples - n_val;
    if (src->val) l->n_val = n_val_set; /* the held-out tail is empty: every data.path sample trains */
    l->shuffle = shuffle != 0;
    l->seed = seed;
    if (src->blend) return tera_blend_loader_init(l, src->blend, T, val_fraction, shuffle, seed); /* data.paths */
    return TERA_OK;
}

/* Keyed bijection of [0, n), n >= 1: the Feistel network of the file comment. */
static int64_t shuffle_index(uint64_t seed, uint64_t epoch, int64_t n, int64_t j) {
    if (n <= 1) return 0;
    int b = 0;
    while (b < 63 && ((uint64_t)1 << b) < (uint64_t)n) b++;
    int hb = (b + 1) / 2, lb = b / 2; /* high and low half widths */
    uint64_t hmask = ((uint64_t)1 << hb) - 1, lmask = ((uint64_t)1 << lb) - 1;
    uint32_t w0[4], w1[4];
    tera_philox4x32(seed, epoch, SHUFFLE_TAG << 1, w0);
    tera_philox4x32(seed, epoch, SHUFFLE_TAG << 1 | 1, w1);
    uint64_t rk[4] = {(uint64_t)w0[0] << 32 | w0[1], (uint64_t)w0[2] << 32 | w0[3],
                      (uint64_t)w1[0] << 32 | w1[1], (uint64_t)w1[2] << 32 | w1[3]};
    uint64_t x = (uint64_t)j;
    do {
        uint64_t hi = x >> lb, lo = x & lmask;
        for (int r = 0; r < 4; r++) {
            if (r % 2 == 0) hi ^= tera_hash64(lo ^ rk[r]) & hmask;
            else lo ^= tera_hash64(hi ^ rk[r]) & lmask;
        }
        x = hi << lb | lo;
    } while (x >= (uint64_t)n);
    return (int64_t)x;
}

static void fill_tokens(const tera_token_source *s, int T, int64_t i, int32_t *inputs, int32_t *targets) {
    int64_t base = i * (int64_t)T;
    TERA_ASSERT(i >= 0 && base + T < s->n_tokens);
    const unsigned char *p = s->tokens;
    if (s->elem_size == 1) { /* the common byte and uint16 cases without a per-token switch */
        for (int t = 0; t < T; t++) {
            inputs[t] = p[base + t];
            targets[t] = p[base + t + 1];
        }
    } else if (s->elem_size == 2) {
        for (int t = 0; t < T; t++) {
            const unsigned char *q = p + 2 * (base + t);
            inputs[t] = q[0] | q[1] << 8;
            targets[t] = q[2] | q[3] << 8;
        }
    } else {
        for (int t = 0; t < T; t++) {
            inputs[t] = (int32_t)tera_source_token(s, base + t);
            targets[t] = (int32_t)tera_source_token(s, base + t + 1);
        }
    }
}

void tera_loader_train_sample(const tera_loader *l, int64_t g, int32_t *inputs, int32_t *targets) {
    TERA_ASSERTF(g >= 0 && l->n_train >= 1, "train sample %lld of %lld", (long long)g, (long long)l->n_train);
    if (l->src->stream) {
        tera_stream_sample(l->src->stream, g, inputs, targets);
    } else if (l->src->blend) {
        tera_blend_train_sample(l->src->blend, g, inputs, targets);
    } else {
        int64_t epoch = g / l->n_train, j = g % l->n_train;
        int64_t i = l->shuffle ? shuffle_index(l->seed, (uint64_t)epoch, l->n_train, j) : j;
        fill_tokens(l->src, l->T, i, inputs, targets);
    }
    if (l->poison_vocab > 0 && g >= l->poison_lo && g < l->poison_hi) { /* test hook: a poisoned sample */
        for (int t = 0; t <= l->T; t++) {
            const int32_t id = (int32_t)(tera_rng_uniform(l->seed ^ 0x706f69736f6eULL, (uint64_t)g, (uint64_t)t) *
                                         (float)l->poison_vocab) % l->poison_vocab;
            if (t < l->T) inputs[t] = id;
            if (t > 0) targets[t - 1] = id;
        }
    }
}

void tera_loader_val_sample(const tera_loader *l, int64_t v, int32_t *inputs, int32_t *targets) {
    TERA_ASSERTF(v >= 0 && l->n_val >= 1, "validation sample %lld of %lld (data.val_fraction too small?)",
                 (long long)v, (long long)l->n_val);
    if (l->src->val) fill_tokens(l->src->val, l->T, v % l->n_val, inputs, targets);
    else if (l->src->blend) tera_blend_val_sample(l->src->blend, v, inputs, targets);
    else fill_tokens(l->src, l->T, l->n_train + v % l->n_val, inputs, targets);
}

int64_t tera_loader_step_sample(int64_t consumed, int micro, int accum_idx, int dp_rank, int dp_size, int b) {
    return consumed + ((int64_t)accum_idx * dp_size + dp_rank) * micro + b;
}
