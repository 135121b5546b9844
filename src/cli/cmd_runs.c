/* tera runs ls | show | compare | rm: the run registry (logging.registry, docs/TRACKING.md). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <sqlite3.h>

#include "cli.h"
#include "tera/io.h"
#include "tera/registry.h"

#define MAX_IDS 64
#define MAX_WHERE 16

static void fmt_time(double t, char *buf, size_t n) {
    if (t <= 0) {
        snprintf(buf, n, "-");
        return;
    }
    time_t tt = (time_t)t;
    struct tm tm;
    gmtime_r(&tt, &tm);
    strftime(buf, n, "%Y-%m-%d %H:%M:%S", &tm);
}

static const char *col_text(sqlite3_stmt *s, int i) {
    const unsigned char *t = sqlite3_column_text(s, i);
    return t ? (const char *)t : "";
}

/* A number field of a JSON object text, NAN when missing. */
static double json_num(const char *text, const char *key) {
    cJSON *o = text && text[0] ? cJSON_Parse(text) : NULL;
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, key);
    const double v = cJSON_IsNumber(x) ? x->valuedouble : NAN;
    cJSON_Delete(o);
    return v;
}

static int open_registry(const char *path, tera_registry **r) {
    if (access(path, F_OK) != 0) { /* reading creates nothing */
        tera_fail(TERA_ERR_IO, "no run registry at %s (runs record themselves in logging.registry; --registry DB "
                  "names another)", path);
        return tera_cli_error();
    }
    if (tera_registry_open(r, path) != TERA_OK) return tera_cli_error();
    const char *st = getenv("TERA_REGISTRY_STALE_S");
    tera_registry_reap(*r, st && atof(st) > 0 ? atof(st) : TERA_REGISTRY_STALE_S);
    return 0;
}

/* The one run whose id is id or starts with it. */
static int resolve_id(tera_registry *r, const char *id, char *out, size_t n) {
    sqlite3 *db = tera_registry_db(r);
    sqlite3_stmt *s = NULL;
    sqlite3_prepare_v2(db, "SELECT id FROM runs WHERE id = ?1 OR substr(id, 1, length(?1)) = ?1 ORDER BY id = ?1 DESC",
                       -1, &s, NULL);
    sqlite3_bind_text(s, 1, id, -1, SQLITE_TRANSIENT);
    int found = 0, exact = 0;
    while (sqlite3_step(s) == SQLITE_ROW) {
        if (found == 0) {
            snprintf(out, n, "%s", col_text(s, 0));
            exact = !strcmp(out, id);
        }
        found++;
    }
    sqlite3_finalize(s);
    if (found == 0) {
        tera_fail(TERA_ERR_ARG, "no run '%s' in the registry (tera runs ls lists them)", id);
        return tera_cli_error();
    }
    if (found > 1 && !exact) {
        tera_fail(TERA_ERR_ARG, "run id prefix '%s' matches %d runs: give more of the id", id, found);
        return tera_cli_error();
    }
    return 0;
}

typedef struct {
    const char *registry;
    const char *status;
    const char *study;
    const char *where[MAX_WHERE];
    int n_where;
    const char *ids[MAX_IDS];
    int n_ids;
    const char *plot, *out;
    int json, all, force;
} runs_args;

static int parse_args(int argc, char **argv, runs_args *a) {
    memset(a, 0, sizeof *a);
    a->registry = "runs/registry.db";
    for (int i = 0; i < argc; i++) {
        const char *x = argv[i];
        const char **slot = NULL;
        if (!strcmp(x, "--registry")) slot = &a->registry;
        else if (!strcmp(x, "--status")) slot = &a->status;
        else if (!strcmp(x, "--study")) slot = &a->study;
        else if (!strcmp(x, "--plot")) slot = &a->plot;
        else if (!strcmp(x, "--out")) slot = &a->out;
        else if (!strcmp(x, "--where")) {
            if (a->n_where == MAX_WHERE) {
                tera_fail(TERA_ERR_ARG, "at most %d --where filters", MAX_WHERE);
                return tera_cli_error();
            }
            slot = &a->where[a->n_where++];
        } else if (!strcmp(x, "--json")) {
            a->json = 1;
            continue;
        } else if (!strcmp(x, "--all")) {
            a->all = 1;
            continue;
        } else if (!strcmp(x, "--force")) {
            a->force = 1;
            continue;
        } else if (x[0] == '-') {
            tera_fail(TERA_ERR_ARG, "tera runs: unknown option '%s' (tera runs --help)", x);
            return tera_cli_error();
        } else {
            if (a->n_ids == MAX_IDS) {
                tera_fail(TERA_ERR_ARG, "at most %d run ids", MAX_IDS);
                return tera_cli_error();
            }
            a->ids[a->n_ids++] = x;
            continue;
        }
        if (i + 1 >= argc) {
            tera_fail(TERA_ERR_ARG, "tera runs: %s needs a value", x);
            return tera_cli_error();
        }
        *slot = argv[++i];
    }
    return 0;
}

/* Columns of the runs table a --where may name besides config keys (section.key) and summary fields. */
static const char *const RUN_COLS[] = {"id", "status", "hosts", "run_dir", "layout", "git_commit", "git_dirty",
                                       "version", "dataset_path", "dataset_fp", "tokenizer_fp", "study", "trial",
                                       "mlflow_run", NULL};
static const char *const SUMMARY_KEYS[] = {"records", "last_step", "final_loss", "min_loss", "final_val_loss",
                                           "mean_tokens_per_s", "elapsed_s", "skipped", NULL};

static int is_in(const char *const *list, const char *k) {
    for (int i = 0; list[i]; i++)
        if (!strcmp(list[i], k)) return 1;
    return 0;
}

/* One --where KEY OP VALUE (OP: = != < > <= >=) as an SQL condition on run r, appended to sql;
 * values bound later in order. */
static int key_known(sqlite3 *db, const char *key) {
    sqlite3_stmt *s = NULL;
    sqlite3_prepare_v2(db, "SELECT 1 FROM params WHERE key = ? LIMIT 1", -1, &s, NULL);
    sqlite3_bind_text(s, 1, key, -1, SQLITE_TRANSIENT);
    int known = sqlite3_step(s) == SQLITE_ROW;
    sqlite3_finalize(s);
    if (!known) { /* an empty registry knows no key yet: nothing to refuse */
        sqlite3_prepare_v2(db, "SELECT 1 FROM params LIMIT 1", -1, &s, NULL);
        known = sqlite3_step(s) != SQLITE_ROW;
        sqlite3_finalize(s);
    }
    return known;
}

static int where_sql(sqlite3 *db, const char *w, char *sql, size_t cap, char keys[][256], char vals[][512], int *numeric_out,
                     int i) {
    const char *op = strpbrk(w, "=<>!");
    if (!op || op == w) {
        tera_fail(TERA_ERR_ARG, "--where '%s': expected KEY=VALUE (or KEY<VALUE, KEY>VALUE, KEY!=VALUE)", w);
        return tera_cli_error();
    }
    char o[3] = {op[0], 0, 0};
    const char *v = op + 1;
    if (*v == '=' && (op[0] == '<' || op[0] == '>' || op[0] == '!')) o[1] = '=', v++;
    if (!strcmp(o, "!")) {
        tera_fail(TERA_ERR_ARG, "--where '%s': expected KEY=VALUE (or KEY<VALUE, KEY>VALUE, KEY!=VALUE)", w);
        return tera_cli_error();
    }
    snprintf(keys[i], 256, "%.*s", (int)(op - w), w);
    snprintf(vals[i], 512, "%s", v);
    char *end;
    const double x = strtod(v, &end);
    if (*v && *end == '\0' && isnan(x)) { /* "final_loss<nan" was accepted and matched nothing */
        tera_fail(TERA_ERR_ARG, "--where '%s': '%s' is not a number to compare with", w, v);
        return tera_cli_error();
    }
    const int is_num = *v && *end == '\0';
    if ((o[0] == '<' || o[0] == '>') && !is_num) { /* atof would compare with 0 */
        tera_fail(TERA_ERR_ARG, "--where '%s': %s compares numbers; '%s' is not one", w, o, v);
        return tera_cli_error();
    }
    const int numeric = o[0] == '<' || o[0] == '>' || is_num; /* 2e-3 matches 0.002 */
    numeric_out[i] = numeric;
    const char *k = keys[i];
    char cond[1024];
    if (strchr(k, '.') && !key_known(db, k)) {
        tera_fail(TERA_ERR_ARG, "--where '%s': no run in the registry has the config key '%s' (tera config --doc lists "
                  "the keys)", w, k);
        return tera_cli_error();
    }
    if (strchr(k, '.'))
        snprintf(cond, sizeof cond, " AND EXISTS (SELECT 1 FROM params p WHERE p.run_id = runs.id AND p.key = ?%d AND "
                 "%s%s %s ?%d)", 2 * i + 1, numeric ? "p.value GLOB '*[0-9]*' AND " : "",
                 numeric ? "CAST(p.value AS REAL)" : "p.value", o, 2 * i + 2);
    else if (is_in(RUN_COLS, k))
        snprintf(cond, sizeof cond, " AND ?%d IS NOT NULL AND %s%s%s %s ?%d", 2 * i + 1, numeric ? "CAST(" : "", k,
                 numeric ? " AS REAL)" : "", o, 2 * i + 2);
    else if (is_in(SUMMARY_KEYS, k))
        snprintf(cond, sizeof cond, " AND ?%d IS NOT NULL AND CAST(json_extract(summary, '$.%s') AS %s) %s ?%d",
                 2 * i + 1, k, numeric ? "REAL" : "TEXT", o, 2 * i + 2);
    else {
        tera_fail(TERA_ERR_ARG, "--where '%s': unknown key '%s' (a config key section.key, a summary field such as "
                  "final_loss, or one of status, run_dir, git_commit, dataset_fp, study, ...)", w, k);
        return tera_cli_error();
    }
    strncat(sql, cond, cap - strlen(sql) - 1);
    return 0;
}

static int cmd_ls(const runs_args *a) {
    tera_registry *r;
    if (open_registry(a->registry, &r)) return 1;
    char sql[8192] = "SELECT id, status, start_time, end_time, heartbeat, summary, run_dir, study, trial FROM runs "
                     "WHERE 1";
    char keys[MAX_WHERE][256], vals[MAX_WHERE][512];
    int numeric[MAX_WHERE];
    for (int i = 0; i < a->n_where; i++)
        if (where_sql(tera_registry_db(r), a->where[i], sql, sizeof sql, keys, vals, numeric, i)) {
            tera_registry_close(r);
            return 1;
        }
    char extra[256];
    snprintf(extra, sizeof extra, "%s%s ORDER BY start_time", a->status ? " AND status = ?100" : "",
             a->study ? " AND study = ?101" : "");
    strncat(sql, extra, sizeof sql - strlen(sql) - 1);
    sqlite3_stmt *s = NULL;
    if (sqlite3_prepare_v2(tera_registry_db(r), sql, -1, &s, NULL) != SQLITE_OK) {
        tera_fail(TERA_ERR_IO, "registry %s: %s", a->registry, sqlite3_errmsg(tera_registry_db(r)));
        tera_registry_close(r);
        return tera_cli_error();
    }
    for (int i = 0; i < a->n_where; i++) {
        sqlite3_bind_text(s, 2 * i + 1, keys[i], -1, SQLITE_TRANSIENT);
        if (numeric[i]) sqlite3_bind_double(s, 2 * i + 2, atof(vals[i]));
        else sqlite3_bind_text(s, 2 * i + 2, vals[i], -1, SQLITE_TRANSIENT);
    }
    if (a->status) sqlite3_bind_text(s, 100, a->status, -1, SQLITE_TRANSIENT);
    if (a->study) sqlite3_bind_text(s, 101, a->study, -1, SQLITE_TRANSIENT);
    if (!a->json)
        printf("%-22s %-9s %-19s %9s %7s %10s %10s  %s\n", "id", "status", "start (UTC)", "time_s", "steps",
               "final_loss", "val_loss", "run_dir");
    int n = 0;
    while (sqlite3_step(s) == SQLITE_ROW) {
        n++;
        const char *summary = col_text(s, 5);
        const double t0 = sqlite3_column_double(s, 2), t1 = sqlite3_column_double(s, 3), hb = sqlite3_column_double(s, 4);
        const double dur = (t1 > 0 ? t1 : hb) - t0;
        if (a->json) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "id", col_text(s, 0));
            cJSON_AddStringToObject(o, "status", col_text(s, 1));
            cJSON_AddNumberToObject(o, "start_time", t0);
            cJSON_AddNumberToObject(o, "seconds", dur);
            cJSON_AddStringToObject(o, "run_dir", col_text(s, 6));
            if (sqlite3_column_type(s, 7) != SQLITE_NULL) cJSON_AddStringToObject(o, "study", col_text(s, 7));
            cJSON *sm = summary[0] ? cJSON_Parse(summary) : NULL;
            if (sm) cJSON_AddItemToObject(o, "summary", sm);
            char *text = cJSON_PrintUnformatted(o);
            printf("%s\n", text);
            free(text);
            cJSON_Delete(o);
            continue;
        }
        char start[32], fl[32], vl[32], st[32];
        fmt_time(t0, start, sizeof start);
        const double steps = json_num(summary, "last_step");
        snprintf(st, sizeof st, isnan(steps) ? "-" : "%.0f", steps);
        snprintf(fl, sizeof fl, isnan(json_num(summary, "final_loss")) ? "-" : "%.4f", json_num(summary, "final_loss"));
        snprintf(vl, sizeof vl, isnan(json_num(summary, "final_val_loss")) ? "-" : "%.4f",
                 json_num(summary, "final_val_loss"));
        printf("%-22s %-9s %-19s %9.1f %7s %10s %10s  %s\n", col_text(s, 0), col_text(s, 1), start, dur, st, fl, vl,
               col_text(s, 6));
    }
    sqlite3_finalize(s);
    if (!a->json) printf("%d run%s\n", n, n == 1 ? "" : "s");
    tera_registry_close(r);
    return 0;
}

static const char *const SHOW_COLS[] = {"id", "status", "start_time", "end_time", "heartbeat", "hosts", "command",
                                        "run_dir", "layout", "git_commit", "git_dirty", "version", "dataset_path",
                                        "dataset_bytes", "dataset_fp", "tokenizer_fp", "metrics_path", "summary",
                                        "checkpoints", "error", "study", "trial", "segments", "mlflow_run", NULL};

static int cmd_show(const runs_args *a) {
    if (a->n_ids != 1) {
        tera_fail(TERA_ERR_ARG, "tera runs show needs one run id");
        return tera_cli_error();
    }
    tera_registry *r;
    if (open_registry(a->registry, &r)) return 1;
    char id[64];
    if (resolve_id(r, a->ids[0], id, sizeof id)) {
        tera_registry_close(r);
        return 1;
    }
    sqlite3 *db = tera_registry_db(r);
    sqlite3_stmt *s = NULL;
    sqlite3_prepare_v2(db, "SELECT * FROM runs WHERE id = ?", -1, &s, NULL);
    sqlite3_bind_text(s, 1, id, -1, SQLITE_TRANSIENT);
    cJSON *o = cJSON_CreateObject();
    if (sqlite3_step(s) == SQLITE_ROW) {
        for (int c = 0; c < sqlite3_column_count(s); c++) {
            const char *name = sqlite3_column_name(s, c);
            if (!strcmp(name, "config")) continue; /* shown as params below */
            switch (sqlite3_column_type(s, c)) {
            case SQLITE_NULL: cJSON_AddNullToObject(o, name); break;
            case SQLITE_INTEGER: cJSON_AddNumberToObject(o, name, (double)sqlite3_column_int64(s, c)); break;
            case SQLITE_FLOAT: cJSON_AddNumberToObject(o, name, sqlite3_column_double(s, c)); break;
            default: {
                const char *t = col_text(s, c);
                cJSON *j = (!strcmp(name, "summary") || !strcmp(name, "checkpoints")) ? cJSON_Parse(t) : NULL;
                if (j) cJSON_AddItemToObject(o, name, j);
                else cJSON_AddStringToObject(o, name, t);
            }
            }
        }
    }
    sqlite3_finalize(s);
    cJSON *params = cJSON_AddObjectToObject(o, "config");
    sqlite3_prepare_v2(db, "SELECT key, value FROM params WHERE run_id = ? ORDER BY rowid", -1, &s, NULL);
    sqlite3_bind_text(s, 1, id, -1, SQLITE_TRANSIENT);
    while (sqlite3_step(s) == SQLITE_ROW) cJSON_AddStringToObject(params, col_text(s, 0), col_text(s, 1));
    sqlite3_finalize(s);
    if (a->json) {
        char *text = cJSON_PrintUnformatted(o);
        printf("%s\n", text);
        free(text);
    } else {
        for (int c = 0; SHOW_COLS[c]; c++) {
            const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, SHOW_COLS[c]);
            if (!x || cJSON_IsNull(x)) continue;
            char buf[64];
            const int is_time = strstr(SHOW_COLS[c], "time") != NULL || !strcmp(SHOW_COLS[c], "heartbeat");
            if (cJSON_IsNumber(x) && !is_time) {
                printf("%-14s %.17g\n", SHOW_COLS[c], x->valuedouble);
            } else if (cJSON_IsNumber(x)) {
                fmt_time(x->valuedouble, buf, sizeof buf);
                printf("%-14s %s UTC\n", SHOW_COLS[c], buf);
            } else if (cJSON_IsString(x)) {
                printf("%-14s %s\n", SHOW_COLS[c], x->valuestring);
            } else {
                char *t = cJSON_PrintUnformatted(x);
                printf("%-14s %s\n", SHOW_COLS[c], t);
                free(t);
            }
        }
        printf("config:\n");
        for (const cJSON *x = params->child; x; x = x->next) printf("  %s = %s\n", x->string, x->valuestring);
    }
    cJSON_Delete(o);
    tera_registry_close(r);
    return 0;
}

/* ---- compare ------------------------------------------------------------------------------------- */

typedef struct {
    char id[64];
    char metrics[TERA_PATH_MAX + 64];
    char *summary;
    cJSON *params; /* key -> value */
} run_rec;

static const char *param_of(const run_rec *r, const char *key) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(r->params, key);
    return cJSON_IsString(x) ? x->valuestring : "(unset)";
}

/* The series of `metric` in a metrics.jsonl: steps and values (caller frees). */
static int read_series(const char *path, const char *metric, double **xs, double **ys) {
    *xs = *ys = NULL;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0, cap = 0;
    char *line = NULL;
    size_t lcap = 0;
    while (getline(&line, &lcap, f) > 0) {
        cJSON *o = cJSON_Parse(line);
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, metric), *s = cJSON_GetObjectItemCaseSensitive(o, "step");
        if (cJSON_IsNumber(v) && cJSON_IsNumber(s) && isfinite(v->valuedouble)) {
            if (n == cap) {
                cap = cap ? 2 * cap : 256;
                *xs = tera_realloc(*xs, (size_t)cap * sizeof(double));
                *ys = tera_realloc(*ys, (size_t)cap * sizeof(double));
            }
            (*xs)[n] = s->valuedouble;
            (*ys)[n] = v->valuedouble;
            n++;
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    return n;
}

static void html_escape(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else fputc(*s, f);
    }
}

/* An HTML page with one SVG chart per metric, one line per run. */
static int write_plot(const char *out, const char *metrics_csv, run_rec *runs, int n) {
    char tmp[TERA_PATH_MAX + 16];
    snprintf(tmp, sizeof tmp, "%s.tmp", out);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        tera_fail(TERA_ERR_IO, "cannot write %s", tmp);
        return tera_cli_error();
    }
    static const char *const colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                         "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
    fprintf(f, "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>tera runs compare</title>\n"
               "<style>body{font-family:sans-serif;margin:20px} .legend span{margin-right:16px}</style></head><body>\n"
               "<h1>tera runs compare</h1>\n<div class=\"legend\">");
    for (int i = 0; i < n; i++)
        fprintf(f, "<span style=\"color:%s\">&#9632; %s</span>", colors[i % 10], runs[i].id);
    fprintf(f, "</div>\n");
    char list[512];
    snprintf(list, sizeof list, "%s", metrics_csv);
    for (char *save = NULL, *m = strtok_r(list, ",", &save); m; m = strtok_r(NULL, ",", &save)) {
        double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
        double *xs[MAX_IDS], *ys[MAX_IDS];
        int cnt[MAX_IDS];
        for (int i = 0; i < n; i++) {
            cnt[i] = read_series(runs[i].metrics, m, &xs[i], &ys[i]);
            for (int j = 0; j < cnt[i]; j++) {
                x0 = fmin(x0, xs[i][j]), x1 = fmax(x1, xs[i][j]);
                y0 = fmin(y0, ys[i][j]), y1 = fmax(y1, ys[i][j]);
            }
        }
        const double W = 720, H = 360, L = 60, B = 30, T = 10, R = 10;
        fprintf(f, "<h2>");
        html_escape(f, m);
        fprintf(f, "</h2>\n");
        if (!(x1 >= x0)) {
            fprintf(f, "<p>no values of this metric in these runs</p>\n");
        } else {
            if (x1 == x0) x1 = x0 + 1;
            if (y1 == y0) y1 = y0 + 1;
            fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" data-metric=\"", W, H);
            html_escape(f, m);
            fprintf(f, "\">\n<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#999\"/>\n",
                    L, T, W - L - R, H - T - B);
            fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"11\" text-anchor=\"end\">%.4g</text>\n", L - 4, T + 10, y1);
            fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"11\" text-anchor=\"end\">%.4g</text>\n", L - 4, H - B, y0);
            fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"11\">step %.0f</text>\n", L, H - 10, x0);
            fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"11\" text-anchor=\"end\">step %.0f</text>\n", W - R, H - 10, x1);
            for (int i = 0; i < n; i++) {
                if (!cnt[i]) continue;
                fprintf(f, "<polyline class=\"run\" data-run=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"",
                        runs[i].id, colors[i % 10]);
                for (int j = 0; j < cnt[i]; j++)
                    fprintf(f, "%.1f,%.1f ", L + (xs[i][j] - x0) / (x1 - x0) * (W - L - R),
                            T + (y1 - ys[i][j]) / (y1 - y0) * (H - T - B));
                fprintf(f, "\"/>\n");
            }
            fprintf(f, "</svg>\n");
        }
        for (int i = 0; i < n; i++) free(xs[i]), free(ys[i]);
    }
    fprintf(f, "</body></html>\n");
    if (fclose(f) != 0 || rename(tmp, out) != 0) {
        tera_fail(TERA_ERR_IO, "cannot write %s", out);
        return tera_cli_error();
    }
    fprintf(stderr, "tera: wrote %s\n", out);
    return 0;
}

static int cmd_compare(const runs_args *a) {
    if (a->n_ids < 2) {
        tera_fail(TERA_ERR_ARG, "tera runs compare needs at least two run ids");
        return tera_cli_error();
    }
    if (a->plot && !a->out) {
        tera_fail(TERA_ERR_ARG, "--plot needs --out FILE.html");
        return tera_cli_error();
    }
    const char *inputs[] = {a->registry, NULL};
    if (a->out && tera_cli_refuse_output("--out", a->out, a->force, inputs)) return 1;
    tera_registry *r;
    if (open_registry(a->registry, &r)) return 1;
    sqlite3 *db = tera_registry_db(r);
    run_rec runs[MAX_IDS];
    memset(runs, 0, sizeof runs);
    int rc = 0, n = 0;
    for (; n < a->n_ids && !rc; n++) {
        run_rec *x = &runs[n];
        x->params = cJSON_CreateObject();
        if ((rc = resolve_id(r, a->ids[n], x->id, sizeof x->id))) break;
        sqlite3_stmt *s = NULL;
        sqlite3_prepare_v2(db, "SELECT summary, metrics_path FROM runs WHERE id = ?", -1, &s, NULL);
        sqlite3_bind_text(s, 1, x->id, -1, SQLITE_TRANSIENT);
        if (sqlite3_step(s) == SQLITE_ROW) {
            x->summary = strdup(col_text(s, 0));
            snprintf(x->metrics, sizeof x->metrics, "%s", col_text(s, 1));
        }
        sqlite3_finalize(s);
        sqlite3_prepare_v2(db, "SELECT key, value FROM params WHERE run_id = ? ORDER BY rowid", -1, &s, NULL);
        sqlite3_bind_text(s, 1, x->id, -1, SQLITE_TRANSIENT);
        while (sqlite3_step(s) == SQLITE_ROW) cJSON_AddStringToObject(x->params, col_text(s, 0), col_text(s, 1));
        sqlite3_finalize(s);
    }
    if (!rc) {
        /* configuration: the keys whose values differ (every key with --all), in the first run's order,
         * then keys only later runs have */
        printf("%-32s", "config");
        for (int i = 0; i < n; i++) printf(" | %-22s", runs[i].id);
        printf("\n");
        int shown = 0;
        cJSON *seen = cJSON_CreateObject();
        for (int i = 0; i < n; i++)
            for (const cJSON *k = runs[i].params->child; k; k = k->next) {
                if (cJSON_GetObjectItemCaseSensitive(seen, k->string)) continue;
                cJSON_AddTrueToObject(seen, k->string);
                int differ = 0;
                for (int j = 1; j < n; j++) differ |= strcmp(param_of(&runs[0], k->string), param_of(&runs[j], k->string)) != 0;
                if (!differ && !a->all) continue;
                shown++;
                printf("%-32s", k->string);
                for (int j = 0; j < n; j++) printf(" | %-22s", param_of(&runs[j], k->string));
                printf("\n");
            }
        cJSON_Delete(seen);
        if (!shown) printf("(the configurations are identical)\n");
        printf("\n%-32s", "final metrics");
        for (int i = 0; i < n; i++) printf(" | %-22s", runs[i].id);
        printf("\n");
        for (int k = 0; SUMMARY_KEYS[k]; k++) {
            printf("%-32s", SUMMARY_KEYS[k]);
            for (int i = 0; i < n; i++) {
                const double v = json_num(runs[i].summary, SUMMARY_KEYS[k]);
                char b[32];
                snprintf(b, sizeof b, isnan(v) ? "-" : "%.6g", v);
                printf(" | %-22s", b);
            }
            printf("\n");
        }
        if (a->plot) rc = write_plot(a->out, a->plot, runs, n);
    }
    for (int i = 0; i < n; i++) {
        free(runs[i].summary);
        cJSON_Delete(runs[i].params);
    }
    tera_registry_close(r);
    return rc;
}

static int cmd_rm(const runs_args *a) {
    if (a->n_ids < 1) {
        tera_fail(TERA_ERR_ARG, "tera runs rm needs a run id");
        return tera_cli_error();
    }
    tera_registry *r;
    if (open_registry(a->registry, &r)) return 1;
    int rc = 0;
    for (int i = 0; i < a->n_ids && !rc; i++) {
        char id[64];
        if ((rc = resolve_id(r, a->ids[i], id, sizeof id))) break;
        if (tera_registry_run(r, "DELETE FROM params WHERE run_id = ?", "s", id) != TERA_OK ||
            tera_registry_run(r, "DELETE FROM runs WHERE id = ?", "s", id) != TERA_OK) {
            rc = tera_cli_error();
            break;
        }
        printf("removed %s from %s (its run directory is left as it is)\n", id, a->registry);
    }
    tera_registry_close(r);
    return rc;
}

int tera_cmd_runs(int argc, char **argv) {
    if (argc < 1) {
        tera_fail(TERA_ERR_ARG, "tera runs needs a subcommand: ls, show, compare or rm (tera runs --help)");
        return tera_cli_error();
    }
    runs_args a;
    if (parse_args(argc - 1, argv + 1, &a)) return 1;
    const char *sub = argv[0];
    if (!strcmp(sub, "ls")) return cmd_ls(&a);
    if (!strcmp(sub, "show")) return cmd_show(&a);
    if (!strcmp(sub, "compare")) return cmd_compare(&a);
    if (!strcmp(sub, "rm")) return cmd_rm(&a);
    tera_fail(TERA_ERR_ARG, "tera runs: unknown subcommand '%s' (ls, show, compare, rm)", sub);
    return tera_cli_error();
}
