/* Samples while training (logging.sample_every, logging.sample_prompt, logging.sample_tokens): every
 * N steps a greedy continuation of the prompt, decoded with the key/value cache of
 * include/tera/decode.h on the trainer's own model, printed on stderr and logged in metrics.jsonl
 * as {"step": s, "sample": "..."}. The decoder and tokenizer live only for the call (every N
 * steps, like validation), nothing is kept between samples, and the model's state (weights, router
 * bias, load statistics) is only read. One process holding the whole model on the CPU backend
 * only: under several ranks (or ZeRO-3's sharded parameters, or another backend) a one-time note
 * says so and the run goes on. */
#include "tera/sample.h"

#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "tera/decode.h"
#include "tera/tokenizer.h"

static int tok_dir_at(const char *dir) {
    char a[TERA_PATH_MAX + 64], b[TERA_PATH_MAX + 64];
    if (snprintf(a, sizeof a, "%s/encoder.json", dir) >= (int)sizeof a) return 0;
    if (snprintf(b, sizeof b, "%s/vocab.bpe", dir) >= (int)sizeof b) return 0;
    return access(a, F_OK) == 0 && access(b, F_OK) == 0;
}

/* The run's tokenizer: RUN/tokenizer, or DATA_DIR/tokenizer (make run's layout); *bytes = 1 when
 * there is none and the data is text read as bytes (no PREFIX.idx). Returns 0 when neither. */
static int find_tokenizer(const tera_trainer *tr, char *out, size_t cap, int *bytes) {
    const tera_config *c = &tr->cfg;
    *bytes = 0;
    if (tr->run_dir[0] && snprintf(out, cap, "%s/tokenizer", tr->run_dir) < (int)cap && tok_dir_at(out)) return 1;
    const char *path = c->data.path;
    if (path[0]) {
        char dir[TERA_PATH_MAX];
        snprintf(dir, sizeof dir, "%s", path);
        char *sl = strrchr(dir, '/');
        if (sl) *sl = 0;
        else snprintf(dir, sizeof dir, ".");
        if (snprintf(out, cap, "%s/tokenizer", dir) < (int)cap && tok_dir_at(out)) return 1;
        char idx[TERA_PATH_MAX + 8];
        snprintf(idx, sizeof idx, "%s.idx", path);
        if (access(idx, F_OK) == 0 || !strcmp(c->data.format, "bin") || !strcmp(c->data.format, "u16")) return 0;
    }
    *bytes = 1;
    return 1;
}

static void note_once(int *noted, const char *msg) {
    if (*noted) return;
    *noted = 1;
    fprintf(stderr, "tera: note: logging.sample_every: %s; no samples are taken in this run\n", msg);
}

tera_status tera_sample_hook(tera_trainer *tr) {
    static int noted = 0;
    const tera_logging_config *lc = &tr->cfg.logging;
    if (lc->sample_every <= 0 || tr->step % lc->sample_every != 0) return TERA_OK;
    if (tr->topo.world > 1) {
        if (tr->root) note_once(&noted, "training samples need the whole model in one process (this run has several "
                                        "ranks); `tera generate --from RUN_DIR` samples from its checkpoints");
        return TERA_OK;
    }
    tera_model *m = &tr->model;
    tera_decoder *d = NULL;
    const int V = m->cfg.vocab_size;
    const int T_max = m->cfg.max_seq_len;
    /* prefill chunks no longer than the training micro-batch's rows: the backend's product scratch
     * (reserved for training) never has to grow */
    const int T_run = (int)strlen(lc->sample_prompt) + lc->sample_tokens + 1; /* >= the prompt's tokens + new ones */
    if (!m->w || tera_decoder_create(&d, m, 1, T_run < T_max ? T_run : T_max, m->B * m->T) != TERA_OK) {
        note_once(&noted, m->w ? tera_last_error() : "the model's parameters are not whole in this process (ZeRO-3)");
        return TERA_OK;
    }
    char tdir[TERA_PATH_MAX + 16];
    int bytes = 0;
    tera_tokenizer *tok = NULL;
    if (!find_tokenizer(tr, tdir, sizeof tdir, &bytes)) {
        tera_decoder_free(d);
        note_once(&noted, "the data is tokenized but no tokenizer was found (RUN/tokenizer or the tokenizer/ directory "
                          "next to data.path)");
        return TERA_OK;
    }
    if (!bytes && (tera_tokenizer_load(&tok, tdir) != TERA_OK || tera_tokenizer_vocab_size(tok) > V)) {
        tera_decoder_free(d);
        tera_tokenizer_free(tok);
        note_once(&noted, "the tokenizer next to the data cannot be loaded or does not fit the vocabulary");
        return TERA_OK;
    }
    const int32_t eot = tok ? tera_tokenizer_eot(tok) : -1;
    /* the prompt's ids: the text, or a new document */
    int32_t *ids = NULL;
    size_t n = 0;
    const char *p = lc->sample_prompt;
    if (p[0] && tok) {
        if (tera_tokenizer_encode(tok, p, strlen(p), 0, &ids, &n) != TERA_OK) n = 0;
    } else if (p[0]) {
        n = strlen(p);
        ids = tera_malloc(sizeof(int32_t) * n);
        for (size_t i = 0; i < n; i++) ids[i] = (unsigned char)p[i];
    }
    if (n == 0) {
        free(ids);
        n = 1;
        ids = tera_malloc(sizeof(int32_t));
        ids[0] = eot >= 0 ? eot : '\n';
    }
    int new_tokens = lc->sample_tokens;
    const int T_cache = tera_decoder_max_len(d);
    if ((int64_t)n + new_tokens > T_cache) new_tokens = T_cache - (int)n;
    float *logits = tera_malloc(sizeof(float) * (size_t)V);
    char *text = tera_calloc(1, 1);
    size_t len = 0;
    tera_status st = new_tokens > 0 && (int64_t)n < T_cache ? tera_decoder_append(d, 0, ids, (int)n, logits, 0) : TERA_ERR_ARG;
    for (int i = 0; st == TERA_OK && i < new_tokens; i++) {
        int32_t t = 0;
        for (int v = 1; v < V; v++)
            if (logits[v] > logits[t]) t = v;
        if (t == eot) break;
        size_t k = 0;
        char one;
        const char *piece = tok ? tera_tokenizer_token(tok, t, &k) : (one = (char)t, k = t < 256, &one);
        if (piece && k) {
            text = tera_realloc(text, len + k + 1);
            memcpy(text + len, piece, k);
            len += k;
            text[len] = 0;
        }
        if (i + 1 < new_tokens) st = tera_decoder_step(d, &t, NULL, logits);
    }
    if (st == TERA_OK && tr->root) {
        fprintf(stderr, "step %6ld | sample: %s%s\n", (long)tr->step, p, text);
        if (tr->log.metrics) { /* {"step": S, "sample": "..."}: S 0-based, as the step records */
            char *clean = tera_utf8_clean(text, len); /* JSON needs valid UTF-8 (cJSON escapes the rest) */
            cJSON *js = cJSON_CreateString(clean);
            char *q = js ? cJSON_PrintUnformatted(js) : NULL;
            if (q) fprintf(tr->log.metrics, "{\"step\": %ld, \"sample\": %s}\n", (long)(tr->step - 1), q), fflush(tr->log.metrics);
            free(q);
            cJSON_Delete(js);
            free(clean);
        }
    }
    free(text);
    free(logits);
    free(ids);
    tera_tokenizer_free(tok);
    tera_decoder_free(d);
    return TERA_OK;
}
