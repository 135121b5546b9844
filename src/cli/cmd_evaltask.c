/* tera eval --task FILE.jsonl: multiple-choice and cloze evaluation (docs/GENERATE.md).
 *
 * Each line is {"context": TEXT, "choices": [TEXT, ...], "label": I} (HellaSwag, PIQA, ARC, ...
 * converted to this form; a cloze task such as LAMBADA is one with a single choice, scored by
 * whether it is the greedy continuation). A choice's score is the log-likelihood of its tokens
 * given the context's: sum over the choice's tokens of log softmax(logits)[token]. The context and
 * each choice are encoded separately and concatenated. Two predictions: the choice with the largest
 * summed log-likelihood (acc) and with the largest log-likelihood per byte of the choice's text
 * (acc_norm, lm-evaluation-harness's normalisation); ties go to the lower index. The context is
 * run once per item (the cache holds it) and every choice continues from it. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "generate.h"
#include "tera/comm.h"
#include "tera/decode.h"
#include "tera/io.h"
#include "tera/profile.h"

/* log softmax(row)[t] in double. row: [V] */
static double log_prob(const float *row, int V, int32_t t) {
    double mx = row[0];
    for (int v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
    double s = 0.0;
    for (int v = 0; v < V; v++) s += exp((double)row[v] - mx);
    return (double)row[t] - mx - log(s);
}

int tera_cmd_eval_task(int argc, char **argv) {
    tera_config cfg;
    static const char *const opts[] = {"from", "task", "tokenizer", "scores", "limit", NULL};
    const char *val[5] = {NULL};
    static const char *const flags[] = {"force", NULL};
    int force = 0;
    if (tera_cli_parse(argc, argv, &cfg, flags, &force, opts, val)) return 1;
    if (tera_comm_size(tera_comm_world()) > 1) {
        tera_fail(TERA_ERR_ARG, "eval --task runs in one process: run it without mpirun (or with -np 1)");
        return tera_cli_error();
    }
    if (!val[0] || !val[1]) {
        tera_fail(TERA_ERR_ARG, "eval --task needs --from DIR and --task FILE.jsonl");
        return tera_cli_error();
    }
    /* --scores: not an existing file unless --force, never the task; written under FILE.tmp and
     * renamed at the end, so a failed evaluation leaves an existing file as it was */
    const char *inputs[] = {val[1], NULL};
    if (val[3] && tera_cli_refuse_output("--scores", val[3], force, inputs)) return 1;
    char scores_tmp[TERA_PATH_MAX + 8] = "";
    if (val[3] && (size_t)snprintf(scores_tmp, sizeof scores_tmp, "%s.tmp", val[3]) >= sizeof scores_tmp) {
        tera_fail(TERA_ERR_ARG, "--scores %s: path too long", val[3]);
        return tera_cli_error();
    }
    long limit = 0;
    if (val[4]) {
        char *end;
        limit = strtol(val[4], &end, 10);
        if (end == val[4] || *end || limit < 1) {
            tera_fail(TERA_ERR_ARG, "--limit '%s' is not a positive integer (the items to score)", val[4]);
            return tera_cli_error();
        }
    }
    FILE *f = fopen(val[1], "r");
    struct stat sb; /* a directory opens, then reads as no line */
    if (f && fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fclose(f);
        f = NULL;
        errno = EISDIR;
    }
    if (!f) {
        tera_fail(TERA_ERR_IO, "--task %s: %s", val[1], strerror(errno));
        return tera_cli_error();
    }
    tera_gen_model g;
    if (tera_gen_load(&g, &cfg, val[0], val[2]) != TERA_OK) {
        fclose(f);
        return tera_cli_error();
    }
    FILE *fs = NULL;
    tera_status st = TERA_OK;
    if (val[3] && !(fs = fopen(scores_tmp, "w"))) st = tera_fail(TERA_ERR_IO, "--scores %s: %s", scores_tmp, strerror(errno));
    const int V = g.cfg.model.vocab_size, T_max = g.cfg.model.max_seq_len;
    tera_decoder *d = NULL; /* created for the first item, grown for a longer one */
    int d_cap = 0;
    float *ctx_logits = tera_malloc(sizeof(float) * (size_t)V);
    float *lg = NULL; /* [lg_rows, V]: the logits after each choice token but the last */
    size_t lg_rows = 0;
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    long lineno = 0, items = 0, correct = 0, correct_norm = 0;
    const double t0 = tera_now();
    while (st == TERA_OK && (n = getline(&line, &cap, f)) >= 0 && (limit <= 0 || items < limit)) {
        lineno++;
        int blank = 1;
        for (ssize_t i = 0; i < n && blank; i++) blank = line[i] == ' ' || line[i] == '\t' || line[i] == '\n' || line[i] == '\r';
        if (blank) continue;
        cJSON *o = cJSON_Parse(line);
        const cJSON *c = o ? cJSON_GetObjectItemCaseSensitive(o, "context") : NULL;
        const cJSON *ch = o ? cJSON_GetObjectItemCaseSensitive(o, "choices") : NULL;
        const cJSON *lb = o ? cJSON_GetObjectItemCaseSensitive(o, "label") : NULL;
        const int nc = cJSON_IsArray(ch) ? cJSON_GetArraySize(ch) : 0;
        if (!o) {
            st = tera_fail(TERA_ERR_FORMAT, "%s:%ld: not a JSON object", val[1], lineno);
        } else if (!cJSON_IsString(c) || !c->valuestring[0]) {
            st = tera_fail(TERA_ERR_FORMAT, "%s:%ld: \"context\" must be a non-empty string", val[1], lineno);
        } else if (nc < 1) {
            st = tera_fail(TERA_ERR_FORMAT, "%s:%ld: \"choices\" must be a non-empty array of strings", val[1], lineno);
        } else if (!cJSON_IsNumber(lb) || lb->valuedouble != (double)lb->valueint || lb->valueint < 0 ||
                   lb->valueint >= nc) {
            st = tera_fail(TERA_ERR_FORMAT, "%s:%ld: \"label\" must be an integer index into the %d choices", val[1],
                           lineno, nc);
        }
        int32_t *cids = NULL;
        size_t ncx = 0;
        if (st == TERA_OK) st = tera_gen_encode(&g, c->valuestring, strlen(c->valuestring), &cids, &ncx);
        if (st == TERA_OK && (int64_t)ncx >= T_max)
            st = tera_fail(TERA_ERR_ARG, "%s:%ld: the context has %zu tokens, the model's context %d positions", val[1],
                           lineno, ncx, T_max);
        /* every choice's tokens first: the cache and the logits buffer grow to the item's need */
        int32_t **cho = tera_calloc((size_t)nc + 1, sizeof(int32_t *));
        size_t *cm = tera_calloc((size_t)nc + 1, sizeof(size_t)), longest = 0;
        for (int j = 0; j < nc && st == TERA_OK; j++) {
            const cJSON *cj = cJSON_GetArrayItem(ch, j);
            if (!cJSON_IsString(cj) || !cj->valuestring[0]) {
                st = tera_fail(TERA_ERR_FORMAT, "%s:%ld: choice %d must be a non-empty string", val[1], lineno, j);
                break;
            }
            st = tera_gen_encode(&g, cj->valuestring, strlen(cj->valuestring), &cho[j], &cm[j]);
            if (st == TERA_OK && (int64_t)(ncx + cm[j]) > T_max)
                st = tera_fail(TERA_ERR_ARG, "%s:%ld: context + choice %d = %zu tokens exceed the model's context of %d",
                               val[1], lineno, j, ncx + cm[j], T_max);
            if (st == TERA_OK && cm[j] == 0) st = tera_fail(TERA_ERR_FORMAT, "%s:%ld: choice %d encodes to no token", val[1], lineno, j);
            longest = cm[j] > longest ? cm[j] : longest;
        }
        const int need = (int)(ncx + longest); /* context + the longest choice (its last token is not run) */
        if (st == TERA_OK && need > d_cap) { /* grown: never the whole context for short items */
            tera_decoder_free(d);
            d = NULL;
            d_cap = need > 2 * d_cap ? need : 2 * d_cap;
            if (d_cap > T_max) d_cap = T_max;
            st = tera_decoder_create(&d, &g.model, 1, d_cap, 0);
        }
        if (st == TERA_OK && longest > lg_rows) {
            free(lg);
            lg_rows = longest;
            lg = tera_malloc(sizeof(float) * (size_t)V * lg_rows);
        }
        if (st == TERA_OK) {
            tera_decoder_reset(d, -1);
            st = tera_decoder_append(d, 0, cids, (int)ncx, ctx_logits, 0);
        }
        double best = -INFINITY, best_norm = -INFINITY;
        int pred = 0, pred_norm = 0;
        cJSON *ll = cJSON_CreateArray(), *lln = cJSON_CreateArray();
        for (int j = 0; j < nc && st == TERA_OK; j++) {
            const int32_t *ids = cho[j];
            const size_t m = cm[j];
            tera_decoder_truncate(d, 0, (int)ncx);
            /* the last choice token predicts nothing that is scored: only m - 1 rows are needed */
            if (m > 1) st = tera_decoder_append(d, 0, ids, (int)m - 1, lg, 1);
            if (st == TERA_OK) {
                double sc = log_prob(ctx_logits, V, ids[0]);
                for (size_t t = 1; t < m; t++) sc += log_prob(lg + (t - 1) * (size_t)V, V, ids[t]);
                const double sn = sc / (double)strlen(cJSON_GetArrayItem(ch, j)->valuestring);
                if (sc > best) best = sc, pred = j;
                if (sn > best_norm) best_norm = sn, pred_norm = j;
                cJSON_AddItemToArray(ll, cJSON_CreateNumber(sc));
                cJSON_AddItemToArray(lln, cJSON_CreateNumber(sn));
            }
        }
        for (int j = 0; j < nc; j++) free(cho[j]);
        free(cho);
        free(cm);
        free(cids);
        if (st == TERA_OK) {
            items++;
            correct += pred == lb->valueint;
            correct_norm += pred_norm == lb->valueint;
            if (fs) {
                cJSON *r = cJSON_CreateObject();
                cJSON_AddNumberToObject(r, "line", (double)lineno);
                cJSON_AddNumberToObject(r, "label", lb->valueint);
                cJSON_AddNumberToObject(r, "pred", pred);
                cJSON_AddNumberToObject(r, "pred_norm", pred_norm);
                cJSON_AddItemToObject(r, "loglik", ll);
                cJSON_AddItemToObject(r, "loglik_per_byte", lln);
                ll = lln = NULL;
                char *txt = cJSON_PrintUnformatted(r);
                fprintf(fs, "%s\n", txt);
                free(txt);
                cJSON_Delete(r);
            }
        }
        cJSON_Delete(ll);
        cJSON_Delete(lln);
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    if (st == TERA_OK && items == 0) st = tera_fail(TERA_ERR_FORMAT, "%s: no item (one JSON object a line)", val[1]);
    if (fs && fclose(fs) != 0 && st == TERA_OK) st = tera_fail(TERA_ERR_IO, "--scores %s: %s", scores_tmp, strerror(errno));
    if (fs && st == TERA_OK && rename(scores_tmp, val[3]) != 0)
        st = tera_fail(TERA_ERR_IO, "--scores: cannot rename %s to %s: %s", scores_tmp, val[3], strerror(errno));
    if (fs && st != TERA_OK) unlink(scores_tmp);
    if (st == TERA_OK) {
        cJSON *r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "from", val[0]);
        cJSON_AddStringToObject(r, "task", val[1]);
        cJSON_AddNumberToObject(r, "items", (double)items);
        cJSON_AddNumberToObject(r, "acc", (double)correct / (double)items);
        cJSON_AddNumberToObject(r, "acc_norm", (double)correct_norm / (double)items);
        char *txt = cJSON_PrintUnformatted(r);
        printf("%s\n", txt);
        free(txt);
        cJSON_Delete(r);
        fprintf(stderr, "tera eval: %ld items of %s in %.2f s (tokenizer %s)\n", items, val[1], tera_now() - t0, g.tok_dir);
    }
    free(ctx_logits);
    free(lg);
    tera_decoder_free(d);
    tera_gen_free(&g);
    return st == TERA_OK ? 0 : tera_cli_error();
}
