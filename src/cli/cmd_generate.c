/* tera generate: text from a checkpoint, a run or a Hugging Face directory (docs/GENERATE.md).
 *
 * The model is loaded whole into this process and decoded with the key/value cache of
 * include/tera/decode.h: each prompt is prefilled once, then every new token is one row through the
 * layers (--no-cache recomputes the whole sequence for every token instead, for checking). Prompts
 * run in batches of --batch sequences that step together. Greedy by default; --temperature > 0
 * samples, after --top-k and --top-p filtering, with draws that depend only on (--seed, prompt
 * index, token index), so a prompt's text does not depend on the batch it ran in. Generation
 * stops at the end-of-document token, after --max-new-tokens, or at the end of the context. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "generate.h"
#include "tera/ckpt.h"
#include "tera/comm.h"
#include "tera/decode.h"
#include "tera/hf.h"
#include "tera/io.h"
#include "tera/profile.h"
#include "tera/rng.h"

/* ------------------------------------------------------------------ loading */

/* local path buffers: longer than any path built from a TERA_PATH_MAX one plus a suffix */
#define PB (4 * TERA_PATH_MAX + 64)

static int exists(const char *path) { return access(path, F_OK) == 0; }
static int is_dir(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* A tokenizer directory holds encoder.json and vocab.bpe. */
static int tok_dir_at(const char *dir) {
    char a[PB + 32], b[PB + 32];
    if (snprintf(a, sizeof a, "%s/encoder.json", dir) >= (int)sizeof a) return 0;
    if (snprintf(b, sizeof b, "%s/vocab.bpe", dir) >= (int)sizeof b) return 0;
    return exists(a) && exists(b);
}

static void parent_of(const char *path, char *out, size_t cap) {
    snprintf(out, cap, "%s", path);
    size_t n = strlen(out);
    while (n > 1 && out[n - 1] == '/') out[--n] = 0;
    char *s = strrchr(out, '/');
    if (!s) snprintf(out, cap, ".");
    else if (s == out) out[1] = 0;
    else *s = 0;
}

/* Candidates for the tokenizer of a run, in order; the first that holds one wins. */
static int find_tokenizer(const char *dir, const char *run_dir, char *out, size_t cap, char *looked, size_t lcap) {
    char cand[4][PB + 32];
    int n = 0;
    snprintf(cand[n++], sizeof cand[0], "%s/tokenizer", dir);
    snprintf(cand[n++], sizeof cand[0], "%s", dir);
    if (run_dir[0]) {
        snprintf(cand[n++], sizeof cand[0], "%s/tokenizer", run_dir);
        /* the run's data: PREFIX's directory's tokenizer/ (make run: runs/quickstart-data/{corpus,tokenizer}) */
        char ini[PB];
        snprintf(ini, sizeof ini, "%s/config.ini", run_dir);
        tera_config rc;
        tera_config_defaults(&rc);
        if (exists(ini) && tera_config_load(&rc, ini) == TERA_OK && rc.data.path[0]) {
            char pd[PB];
            parent_of(rc.data.path, pd, sizeof pd);
            snprintf(cand[n++], sizeof cand[0], "%s/tokenizer", pd);
        }
    }
    looked[0] = 0;
    for (int i = 0; i < n; i++) {
        if (tok_dir_at(cand[i]) && snprintf(out, cap, "%s", cand[i]) < (int)cap) return 1;
        const size_t k = strlen(looked);
        snprintf(looked + k, lcap - k, "%s%s", k ? ", " : "", cand[i]);
    }
    return 0;
}

static tera_status read_weights(tera_gen_model *g) {
    tera_model *m = &g->model;
    tera_ckpt_reader *r;
    TERA_TRY(tera_ckpt_reader_open(&r, g->dir, m));
    tera_status st = TERA_OK;
    for (int i = 0; i < m->n_params && st == TERA_OK; i++)
        st = tera_ckpt_reader_read(r, 0, i, 0, m->params[i].numel, m->w + m->params[i].offset);
    if (st == TERA_OK) st = tera_ckpt_reader_bias(r, m->router_bias);
    tera_ckpt_reader_close(r);
    int checked;
    if (st == TERA_OK) st = tera_ckpt_region_check(g->dir, 0, tera_ckpt_region_hash(m, 0, m->w), &checked);
    if (st == TERA_OK) st = tera_ckpt_region_check(g->dir, 3, tera_ckpt_region_hash(m, 3, m->router_bias), &checked);
    return st;
}

tera_status tera_gen_load(tera_gen_model *g, const tera_config *cfg, const char *from, const char *tokenizer) {
    memset(g, 0, sizeof *g);
    g->eot = -1;
    char man[TERA_PATH_MAX + 32], run_dir[TERA_PATH_MAX] = "";
    snprintf(man, sizeof man, "%s/manifest.json", from);
    int ckpt = 0;
    if (exists(man)) { /* a checkpoint: RUN/checkpoints/step_N, committed and verified */
        ckpt = 1;
        TERA_TRY(tera_cli_ckpt_source(from, g->dir, sizeof g->dir));
        char p[TERA_PATH_MAX], pp[TERA_PATH_MAX];
        parent_of(from, p, sizeof p);
        parent_of(p, pp, sizeof pp);
        char ini[TERA_PATH_MAX + 32];
        snprintf(ini, sizeof ini, "%s/config.ini", pp);
        if (exists(ini)) snprintf(run_dir, sizeof run_dir, "%s", pp);
    } else if (is_dir(from) && (snprintf(man, sizeof man, "%s/checkpoints", from), is_dir(man))) { /* a run directory */
        ckpt = 1;
        if (tera_ckpt_find_latest(from, g->dir, sizeof g->dir) != TERA_OK)
            return tera_fail(TERA_ERR_IO, "--from %s: the run directory has no committed checkpoint that verifies", from);
        snprintf(run_dir, sizeof run_dir, "%s", from);
    } else {
        snprintf(man, sizeof man, "%s/config.json", from);
        if (!exists(man))
            return tera_fail(TERA_ERR_ARG, "--from %s is neither a tera checkpoint (manifest.json), a run directory "
                             "(checkpoints/) nor a Hugging Face directory (config.json)", from);
        snprintf(g->dir, sizeof g->dir, "%s", from);
    }
    g->cfg = *cfg;
    TERA_TRY(tera_config_from_hf(&g->cfg, g->dir));
    g->cfg.training.seq_len = 1;
    g->cfg.training.micro_batch = 1;
    g->cfg.training.grad_accum = 1;
    g->cfg.training.global_batch = 0;
    TERA_TRY(tera_config_finalize(&g->cfg));
    /* the tokenizer first: a missing one fails before the weights are read */
    char looked[8 * PB];
    const int V = g->cfg.model.vocab_size;
    if (tokenizer && !strcmp(tokenizer, "bytes")) {
        snprintf(g->tok_dir, sizeof g->tok_dir, "bytes");
    } else if (tokenizer) {
        snprintf(g->tok_dir, sizeof g->tok_dir, "%s", tokenizer);
    } else if (!find_tokenizer(g->dir, run_dir, g->tok_dir, sizeof g->tok_dir, looked, sizeof looked)) {
        if (V != 256)
            return tera_fail(TERA_ERR_ARG, "%s has no tokenizer (looked for encoder.json + vocab.bpe in %s) and its "
                             "vocabulary (%d) is not the 256 bytes: give --tokenizer DIR (the tokenizer the run's data "
                             "was prepared with) or --tokenizer bytes", from, looked, V);
        snprintf(g->tok_dir, sizeof g->tok_dir, "bytes");
    }
    if (strcmp(g->tok_dir, "bytes") != 0) {
        if (!is_dir(g->tok_dir))
            return tera_fail(TERA_ERR_ARG, "--tokenizer %s: no such directory (a tokenizer directory holds encoder.json "
                             "and vocab.bpe; or --tokenizer bytes)", g->tok_dir);
        TERA_TRY(tera_tokenizer_load(&g->tok, g->tok_dir));
        if (tera_tokenizer_vocab_size(g->tok) > V) {
            const int tv = tera_tokenizer_vocab_size(g->tok);
            tera_tokenizer_free(g->tok);
            g->tok = NULL;
            return tera_fail(TERA_ERR_ARG, "tokenizer %s has %d tokens but the model's vocabulary is %d: not this "
                             "model's tokenizer", g->tok_dir, tv, V);
        }
        g->eot = tera_tokenizer_eot(g->tok);
    }
    const tera_model_par par = {.ep = 1, .tp = 1, .be = tera_backend_cpu_create(g->cfg.training.threads)};
    tera_model_config mc = g->cfg.model;
    mc.recompute = NULL;
    tera_status st = tera_model_create_par(&g->model, &mc, 1, 1, &par);
    if (st == TERA_OK) st = ckpt ? read_weights(g) : tera_hf_import(&g->model, g->dir);
    if (st != TERA_OK) tera_gen_free(g);
    return st;
}

void tera_gen_free(tera_gen_model *g) {
    tera_model_destroy(&g->model);
    tera_tokenizer_free(g->tok);
    g->tok = NULL;
}

tera_status tera_gen_encode(const tera_gen_model *g, const char *text, size_t len, int32_t **ids, size_t *n) {
    if (g->tok) return tera_tokenizer_encode(g->tok, text, len, 0, ids, n);
    *n = len;
    *ids = len ? tera_malloc(sizeof(int32_t) * len) : NULL;
    for (size_t i = 0; i < len; i++) (*ids)[i] = (unsigned char)text[i];
    return TERA_OK;
}

size_t tera_gen_piece(const tera_gen_model *g, int32_t id, char *buf, size_t cap) {
    size_t n = 0;
    const char *p = g->tok ? tera_tokenizer_token(g->tok, id, &n) : NULL;
    if (!g->tok && id >= 0 && id < 256) {
        buf[0] = (char)id;
        return 1;
    }
    if (!p) return (size_t)snprintf(buf, cap, "[%d]", (int)id);
    if (n > cap) n = cap;
    memcpy(buf, p, n);
    return n;
}

/* ------------------------------------------------------------------ sampling */

typedef struct {
    float temperature; /* 0: greedy */
    int top_k;         /* 0: off */
    float top_p;       /* 1: off */
    uint64_t seed;
} sampler;

static float *g_sort_logits; /* qsort's context (one thread) */
static int by_logit_desc(const void *a, const void *b) {
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    const float x = g_sort_logits[i], y = g_sort_logits[j];
    if (x != y) return x > y ? -1 : 1;
    return i < j ? -1 : (i > j);
}

/* The next token from logits[V]: argmax (ties: lower id), or a draw from the softmax of
 * logits / temperature restricted to the top-k ids and to the smallest set of most probable ids
 * whose probability reaches top-p. Draw number i of prompt p: uniform (seed, p, i).
 * idx, prob: [V] scratch. */
static int32_t pick(const sampler *s, float *logits, int V, uint64_t prompt, uint64_t i, int32_t *idx, float *prob) {
    if (s->temperature <= 0.0f) {
        int32_t best = 0;
        for (int v = 1; v < V; v++)
            if (logits[v] > logits[best]) best = v;
        return best;
    }
    for (int v = 0; v < V; v++) idx[v] = v;
    g_sort_logits = logits;
    qsort(idx, (size_t)V, sizeof(int32_t), by_logit_desc);
    int n = s->top_k > 0 && s->top_k < V ? s->top_k : V;
    const double mx = logits[idx[0]];
    double sum = 0.0;
    for (int j = 0; j < n; j++) sum += prob[j] = (float)exp(((double)logits[idx[j]] - mx) / s->temperature);
    if (s->top_p < 1.0f) {
        double c = 0.0;
        int keep = n;
        for (int j = 0; j < n; j++) {
            c += prob[j] / sum;
            if (c >= s->top_p) {
                keep = j + 1;
                break;
            }
        }
        n = keep;
        sum = 0.0;
        for (int j = 0; j < n; j++) sum += prob[j];
    }
    const double u = (double)tera_rng_uniform(s->seed, prompt, i) * sum;
    double c = 0.0;
    for (int j = 0; j < n; j++) {
        c += prob[j];
        if (u < c) return idx[j];
    }
    return idx[n - 1];
}

/* ------------------------------------------------------------------ prompts */

typedef struct {
    char **text;
    int n, cap;
} prompt_list;

static void add_prompt(prompt_list *p, const char *s, size_t len) {
    if (p->n == p->cap) {
        p->cap = p->cap ? 2 * p->cap : 16;
        p->text = tera_realloc(p->text, sizeof(char *) * (size_t)p->cap);
    }
    char *c = tera_malloc(len + 1);
    memcpy(c, s, len);
    c[len] = 0;
    p->text[p->n++] = c;
}

/* One prompt per line (a trailing "\r" dropped; blank lines skipped). */
static tera_status read_prompts(prompt_list *p, FILE *f, const char *name) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) >= 0) {
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) n--;
        int blank = 1;
        for (ssize_t i = 0; i < n && blank; i++) blank = line[i] == ' ' || line[i] == '\t';
        if (!blank) add_prompt(p, line, (size_t)n);
    }
    free(line);
    if (ferror(f)) return tera_fail(TERA_ERR_IO, "cannot read the prompts from %s: %s", name, strerror(errno));
    if (p->n == 0) return tera_fail(TERA_ERR_ARG, "no prompt in %s (one prompt per line; blank lines are skipped)", name);
    return TERA_OK;
}

/* ------------------------------------------------------------------ the command */

static int parse_num(const char *opt, const char *v, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    const double x = v ? strtod(v, &end) : 0.0;
    if (!v) return 0;
    const int integer = strcmp(opt, "temperature") != 0 && strcmp(opt, "top-p") != 0;
    if (end == v || *end || errno || !(x >= lo && x <= hi) || (integer && x != floor(x))) {
        tera_fail(TERA_ERR_ARG, "--%s '%s' is not %s in [%g, %g]", opt, v, integer ? "an integer" : "a number", lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

typedef struct {
    int32_t *ids;     /* [T_run] prompt + generated */
    int n_prompt, n;  /* prompt tokens, tokens so far */
    int active;
    char *out;        /* the completion's bytes (batch > 1 or --json) */
    size_t out_len, out_cap;
    int stop;         /* 0 running, 1 end-of-document, 2 max-new-tokens, 3 context full */
} seq_state;

static void out_append(seq_state *s, const char *b, size_t n) {
    if (s->out_len + n + 1 > s->out_cap) {
        s->out_cap = (s->out_len + n + 1) * 2;
        s->out = tera_realloc(s->out, s->out_cap);
    }
    memcpy(s->out + s->out_len, b, n);
    s->out_len += n;
    s->out[s->out_len] = 0;
}

int tera_cmd_generate(int argc, char **argv) {
    tera_config cfg;
    static const char *const flags[] = {"no-cache", "json", NULL};
    static const char *const opts[] = {"from",  "prompt", "prompts", "tokenizer", "max-new-tokens", "temperature",
                                       "top-k", "top-p",  "seed",    "batch",     "context",        "logits", NULL};
    enum { O_FROM, O_PROMPT, O_PROMPTS, O_TOK, O_MAXNEW, O_TEMP, O_TOPK, O_TOPP, O_SEED, O_BATCH, O_CTX, O_LOGITS };
    int set[2] = {0, 0};
    const char *val[12] = {NULL};
    if (tera_cli_parse(argc, argv, &cfg, flags, set, opts, val)) return 1;
    const int no_cache = set[0], json = set[1];
    if (tera_comm_size(tera_comm_world()) > 1) {
        tera_fail(TERA_ERR_ARG, "generate runs in one process (the whole model in memory): run it without mpirun "
                  "(or with -np 1); tensor- or expert-parallel decoding is not implemented");
        return tera_cli_error();
    }
    if (!val[O_FROM]) {
        tera_fail(TERA_ERR_ARG, "generate needs --from DIR (a checkpoint, a run directory or a Hugging Face directory)");
        return tera_cli_error();
    }
    if (val[O_PROMPT] && val[O_PROMPTS]) {
        tera_fail(TERA_ERR_ARG, "give --prompt TEXT or --prompts FILE, not both");
        return tera_cli_error();
    }
    double max_new = 64, temp = 0, topk = 0, topp = 1, seed = 0, batch = 1, ctx = 0;
    if (parse_num("max-new-tokens", val[O_MAXNEW], 1, 1e9, &max_new) || parse_num("temperature", val[O_TEMP], 0, 1e6, &temp) ||
        parse_num("top-k", val[O_TOPK], 0, 1e9, &topk) || parse_num("top-p", val[O_TOPP], 1e-9, 1, &topp) ||
        parse_num("seed", val[O_SEED], 0, 1.8e19, &seed) || parse_num("batch", val[O_BATCH], 1, 4096, &batch) ||
        parse_num("context", val[O_CTX], 1, 1e9, &ctx))
        return tera_cli_error();
    if (temp == 0 && (val[O_TOPK] || val[O_TOPP] || val[O_SEED]))
        fprintf(stderr, "tera generate: note: --top-k, --top-p and --seed apply when sampling (--temperature > 0); "
                        "this run is greedy\n");
    /* the prompts, before the model is read */
    prompt_list prompts = {0};
    tera_status st = TERA_OK;
    if (val[O_PROMPT]) {
        if (!val[O_PROMPT][0]) {
            tera_fail(TERA_ERR_ARG, "--prompt is empty: give the text to continue");
            return tera_cli_error();
        }
        add_prompt(&prompts, val[O_PROMPT], strlen(val[O_PROMPT]));
    } else if (val[O_PROMPTS]) {
        FILE *f = fopen(val[O_PROMPTS], "r");
        if (!f) {
            tera_fail(TERA_ERR_IO, "--prompts %s: %s", val[O_PROMPTS], strerror(errno));
            return tera_cli_error();
        }
        st = read_prompts(&prompts, f, val[O_PROMPTS]);
        fclose(f);
    } else {
        st = read_prompts(&prompts, stdin, "standard input");
    }
    tera_gen_model g;
    int loaded = 0;
    if (st == TERA_OK) st = tera_gen_load(&g, &cfg, val[O_FROM], val[O_TOK]);
    loaded = st == TERA_OK;
    const int V = loaded ? g.cfg.model.vocab_size : 0;
    const int T_max = loaded ? (ctx > 0 && ctx < g.cfg.model.max_seq_len ? (int)ctx : g.cfg.model.max_seq_len) : 0;
    if (loaded && ctx > g.cfg.model.max_seq_len)
        st = tera_fail(TERA_ERR_ARG, "--context %.0f exceeds model.max_seq_len = %d", ctx, g.cfg.model.max_seq_len);
    /* every prompt encoded and checked before anything is generated */
    int32_t **pids = tera_calloc((size_t)prompts.n + 1, sizeof(int32_t *));
    int *plen = tera_calloc((size_t)prompts.n + 1, sizeof(int));
    for (int p = 0; p < prompts.n && st == TERA_OK; p++) {
        size_t n = 0;
        st = tera_gen_encode(&g, prompts.text[p], strlen(prompts.text[p]), &pids[p], &n);
        if (st != TERA_OK) {
            st = tera_fail(st, "prompt %d: %s", p + 1, tera_last_error());
        } else if (n == 0) {
            st = tera_fail(TERA_ERR_ARG, "prompt %d is empty", p + 1);
        } else if ((int64_t)n >= T_max) {
            st = tera_fail(TERA_ERR_ARG, "prompt %d has %zu tokens: the context holds %d positions (model.max_seq_len%s), "
                           "so a prompt may have at most %d", p + 1, n, T_max, ctx > 0 ? " or --context" : "", T_max - 1);
        }
        plen[p] = (int)n;
    }
    if (loaded && st == TERA_OK) {
        fprintf(stderr, "tera generate: %s (%.2fM params, V=%d, context %d) | tokenizer %s | %s | %s%s\n", g.dir,
                tera_model_total_params(&g.cfg.model) / 1e6, V, T_max, g.tok_dir,
                temp > 0 ? "sampling" : "greedy", no_cache ? "no cache (full recomputation per token)" : "KV cache",
                g.cfg.model.capacity_factor > 0 ? " | dropless routing (the model was trained with a capacity factor)" : "");
    }
    /* the cache holds the longest prompt and its new tokens, at most the context (a long context,
     * e.g. 32k positions, is not allocated for short prompts) */
    int longest = 0;
    for (int p = 0; p < prompts.n; p++) longest = plen[p] > longest ? plen[p] : longest;
    const int T_run = (int64_t)longest + (int64_t)max_new < T_max ? longest + (int)max_new : T_max;
    tera_decoder *d = NULL;
    const int Bn = (int)batch;
    if (st == TERA_OK) st = tera_decoder_create(&d, &g.model, Bn, T_run, 0);
    FILE *flog = NULL;
    if (st == TERA_OK && val[O_LOGITS] && !(flog = fopen(val[O_LOGITS], "wb")))
        st = tera_fail(TERA_ERR_IO, "--logits %s: %s", val[O_LOGITS], strerror(errno));
    if (st != TERA_OK) {
        for (int p = 0; p < prompts.n; p++) free(pids[p]), free(prompts.text[p]);
        free(pids), free(plen), free(prompts.text);
        if (loaded) tera_gen_free(&g);
        return tera_cli_error();
    }
    const sampler smp = {(float)temp, (int)topk, (float)topp, (uint64_t)seed};
    seq_state *ss = tera_calloc((size_t)Bn, sizeof(seq_state));
    for (int b = 0; b < Bn; b++) ss[b].ids = tera_malloc(sizeof(int32_t) * (size_t)T_run);
    float *logits = tera_malloc(sizeof(float) * (size_t)Bn * V);
    float *prob = tera_malloc(sizeof(float) * (size_t)V);
    int32_t *idx = tera_malloc(sizeof(int32_t) * (size_t)V), *cur = tera_malloc(sizeof(int32_t) * (size_t)Bn);
    uint8_t *act = tera_malloc((size_t)Bn);
    const int stream = Bn == 1 && !json;
    double t_prefill = 0, t_decode = 0;
    int64_t n_prefill = 0, n_new = 0;
    int context_full = 0;
    char piece[256];
    for (int p0 = 0; p0 < prompts.n && st == TERA_OK; p0 += Bn) {
        const int nb = prompts.n - p0 < Bn ? prompts.n - p0 : Bn;
        tera_decoder_reset(d, -1);
        double t0 = tera_now();
        for (int b = 0; b < Bn; b++) {
            seq_state *s = &ss[b];
            s->active = b < nb;
            s->out_len = 0;
            s->stop = 0;
            if (!s->active) continue;
            memcpy(s->ids, pids[p0 + b], sizeof(int32_t) * (size_t)plen[p0 + b]);
            s->n = s->n_prompt = plen[p0 + b];
            if (st == TERA_OK) st = tera_decoder_append(d, b, s->ids, s->n, logits + (int64_t)b * V, 0);
            n_prefill += s->n;
        }
        t_prefill += tera_now() - t0;
        if (stream) {
            fputs(prompts.text[p0], stdout);
            fflush(stdout);
        }
        t0 = tera_now();
        for (int i = 0; st == TERA_OK; i++) {
            int any = 0;
            for (int b = 0; b < nb; b++) {
                seq_state *s = &ss[b];
                act[b] = 0;
                if (!s->active) continue;
                if (flog) fwrite(logits + (int64_t)b * V, sizeof(float), (size_t)V, flog);
                const int32_t t = pick(&smp, logits + (int64_t)b * V, V, (uint64_t)(p0 + b), (uint64_t)i, idx, prob);
                if (t == g.eot) {
                    s->active = 0, s->stop = 1;
                    continue;
                }
                s->ids[s->n++] = t;
                n_new++;
                const size_t k = tera_gen_piece(&g, t, piece, sizeof piece);
                if (stream) {
                    fwrite(piece, 1, k, stdout);
                    fflush(stdout);
                } else {
                    out_append(s, piece, k);
                }
                if (s->n - s->n_prompt >= (int)max_new) {
                    s->active = 0, s->stop = 2;
                } else if (s->n >= T_run) { /* T_run < T_max only stops after max-new-tokens (above) */
                    s->active = 0, s->stop = 3, context_full = 1;
                } else {
                    act[b] = 1, cur[b] = t, any = 1;
                }
            }
            for (int b = nb; b < Bn; b++) act[b] = 0;
            if (!any) break;
            if (!no_cache) {
                st = tera_decoder_step(d, cur, act, logits);
            } else { /* the whole sequence again, for each token */
                for (int b = 0; b < nb && st == TERA_OK; b++) {
                    if (!act[b]) continue;
                    tera_decoder_reset(d, b);
                    st = tera_decoder_append(d, b, ss[b].ids, ss[b].n, logits + (int64_t)b * V, 0);
                }
            }
        }
        t_decode += tera_now() - t0;
        for (int b = 0; b < nb && st == TERA_OK; b++) {
            seq_state *s = &ss[b];
            if (json) {
                cJSON *o = cJSON_CreateObject(), *ids = cJSON_CreateArray();
                cJSON_AddNumberToObject(o, "prompt_index", p0 + b);
                char *pt = tera_utf8_clean(prompts.text[p0 + b], strlen(prompts.text[p0 + b]));
                char *ct = tera_utf8_clean(s->out ? s->out : "", s->out ? s->out_len : 0);
                cJSON_AddStringToObject(o, "prompt", pt);
                cJSON_AddStringToObject(o, "completion", ct);
                free(pt), free(ct);
                for (int j = s->n_prompt; j < s->n; j++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(s->ids[j]));
                cJSON_AddItemToObject(o, "tokens", ids);
                cJSON *pid = cJSON_CreateArray();
                for (int j = 0; j < s->n_prompt; j++) cJSON_AddItemToArray(pid, cJSON_CreateNumber(s->ids[j]));
                cJSON_AddItemToObject(o, "prompt_ids", pid);
                static const char *const why[] = {"running", "end_of_document", "max_new_tokens", "context"};
                cJSON_AddStringToObject(o, "stop", why[s->stop]);
                char *txt = cJSON_PrintUnformatted(o);
                printf("%s\n", txt);
                free(txt);
                cJSON_Delete(o);
            } else if (stream) {
                fputc('\n', stdout);
            } else {
                fputs(prompts.text[p0 + b], stdout);
                if (s->out) fwrite(s->out, 1, s->out_len, stdout);
                fputc('\n', stdout);
            }
        }
        fflush(stdout);
    }
    if (flog && fclose(flog) != 0 && st == TERA_OK) st = tera_fail(TERA_ERR_IO, "--logits %s: %s", val[O_LOGITS], strerror(errno));
    if (st == TERA_OK) {
        if (context_full)
            fprintf(stderr, "tera generate: note: a sequence reached the end of the context (%d positions) before "
                            "--max-new-tokens\n", T_max);
        fprintf(stderr, "tera generate: %d prompt%s, batch %d: prefill %ld tokens in %.3f s (%.1f tokens/s), "
                "generated %ld tokens in %.3f s: %.1f tokens/s\n", prompts.n, prompts.n == 1 ? "" : "s", Bn,
                (long)n_prefill, t_prefill, t_prefill > 0 ? n_prefill / t_prefill : 0.0, (long)n_new, t_decode,
                t_decode > 0 ? n_new / t_decode : 0.0);
    }
    for (int b = 0; b < Bn; b++) free(ss[b].ids), free(ss[b].out);
    free(ss), free(logits), free(prob), free(idx), free(cur), free(act);
    for (int p = 0; p < prompts.n; p++) free(pids[p]), free(prompts.text[p]);
    free(pids), free(plen), free(prompts.text);
    tera_decoder_free(d);
    tera_gen_free(&g);
    return st == TERA_OK ? 0 : tera_cli_error();
}
