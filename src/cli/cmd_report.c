/* tera report RUN_DIR [--out FILE]: one self-contained HTML page about a run (docs/MONITORING.md).
 *
 * Reads RUN_DIR/metrics.jsonl (the last record of each step: a resumed run or a spike's rollback
 * logs some steps twice; validation lines; event lines) and RUN_DIR/config.ini, and writes inline
 * SVG plots: loss with validation loss, LR, grad norm, throughput, memory (when the run logged
 * hardware readings or its peak), the expert load per MoE layer over time as a heatmap, with
 * skipped steps and loss-spike events marked on the loss plot and listed, then the configuration.
 * No script, no external resource: the page opens anywhere. Written to a temporary name and renamed
 * (default RUN_DIR/report.html). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "tera/status.h"

typedef struct {
    int64_t step;
    double loss, ce, aux, lr, gnorm, tps, rss, val;
    int skipped, has_step;
    int n_load;
    double *load; /* expert_load_max_over_mean per MoE layer (n_load) */
} rec;

typedef struct {
    int64_t step;
    char kind[40];
    char detail[200];
} event;

typedef struct {
    rec *r;
    int n, cap;
    event *ev;
    int n_ev, cap_ev;
    int n_layers; /* MoE layers (the widest load array seen) */
    int first_moe; /* model.first_k_dense of config.ini: the model layer of the first MoE layer */
    double peak_rss_mib;
} run;

static rec *rec_for(run *R, int64_t step) {
    /* a step logged again (a resume, a spike's rollback): the records after it are dropped, its own reused */
    while (R->n > 0 && R->r[R->n - 1].step > step) free(R->r[--R->n].load);
    if (R->n > 0 && R->r[R->n - 1].step == step) return &R->r[R->n - 1];
    if (R->n == R->cap) {
        R->cap = R->cap ? 2 * R->cap : 1024;
        R->r = tera_realloc(R->r, sizeof(rec) * (size_t)R->cap);
    }
    rec *x = &R->r[R->n++];
    memset(x, 0, sizeof *x);
    x->step = step;
    x->loss = x->ce = x->aux = x->lr = x->gnorm = x->tps = x->rss = x->val = NAN;
    return x;
}

static double num_of(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static void add_event(run *R, int64_t step, const char *kind, const char *detail) {
    if (R->n_ev == R->cap_ev) {
        R->cap_ev = R->cap_ev ? 2 * R->cap_ev : 64;
        event *ne = realloc(R->ev, sizeof(event) * (size_t)R->cap_ev);
        TERA_ASSERTF(ne, "out of memory reading metrics.jsonl");
        R->ev = ne;
    }
    event *e = &R->ev[R->n_ev++];
    e->step = step;
    snprintf(e->kind, sizeof e->kind, "%s", kind);
    snprintf(e->detail, sizeof e->detail, "%s", detail);
}

static tera_status read_metrics(const char *path, run *R) {
    FILE *f = fopen(path, "r");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot open '%s': %s (is it a run directory of tera train?)", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    long lineno = 0, bad = 0;
    while ((len = getline(&line, &cap, f)) > 0) {
        lineno++;
        cJSON *o = cJSON_Parse(line);
        const cJSON *st = o ? cJSON_GetObjectItemCaseSensitive(o, "step") : NULL;
        if (!o || !cJSON_IsNumber(st)) { /* a torn last line of a killed run: skipped, counted */
            bad++;
            cJSON_Delete(o);
            continue;
        }
        const int64_t step = (int64_t)st->valuedouble;
        const cJSON *ev = cJSON_GetObjectItemCaseSensitive(o, "event");
        if (cJSON_IsString(ev)) {
            char detail[200] = "";
            if (!strcmp(ev->valuestring, "memory")) {
                const double p = num_of(o, "peak_rss_mib");
                if (isfinite(p)) R->peak_rss_mib = p;
                snprintf(detail, sizeof detail, "peak RSS %.1f MiB", p);
            } else if (!strcmp(ev->valuestring, "loss_spike")) {
                snprintf(detail, sizeof detail, "loss %.5g, grad norm %.5g, z %.3g", num_of(o, "loss"), num_of(o, "grad_norm"),
                         num_of(o, "z"));
            } else {
                char *txt = cJSON_PrintUnformatted(o);
                snprintf(detail, sizeof detail, "%s", txt ? txt : "");
                free(txt);
            }
            add_event(R, step, ev->valuestring, detail);
        } else if (cJSON_GetObjectItemCaseSensitive(o, "loss")) {
            rec *x = rec_for(R, step);
            x->has_step = 1;
            x->loss = num_of(o, "loss"), x->ce = num_of(o, "ce_loss"), x->aux = num_of(o, "aux_loss");
            x->lr = num_of(o, "lr"), x->gnorm = num_of(o, "grad_norm"), x->tps = num_of(o, "tokens_per_s");
            const cJSON *sk = cJSON_GetObjectItemCaseSensitive(o, "skipped");
            x->skipped = cJSON_IsNumber(sk) && sk->valuedouble != 0;
            const cJSON *hw = cJSON_GetObjectItemCaseSensitive(o, "hw");
            if (hw) x->rss = num_of(hw, "rss_bytes");
            const cJSON *ld = cJSON_GetObjectItemCaseSensitive(o, "expert_load_max_over_mean");
            free(x->load);
            x->load = NULL;
            x->n_load = cJSON_IsArray(ld) ? cJSON_GetArraySize(ld) : 0;
            if (x->n_load > 0) {
                x->load = tera_calloc((size_t)x->n_load, sizeof(double));
                for (int i = 0; i < x->n_load; i++) {
                    const cJSON *v = cJSON_GetArrayItem(ld, i);
                    x->load[i] = cJSON_IsNumber(v) ? v->valuedouble : NAN;
                }
                if (x->n_load > R->n_layers) R->n_layers = x->n_load;
            }
            if (x->skipped) add_event(R, step, "skipped", "update skipped: loss or gradient not finite");
        } else if (cJSON_GetObjectItemCaseSensitive(o, "val_loss")) {
            rec *x = rec_for(R, step);
            x->val = num_of(o, "val_loss");
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    /* a spike's step is also logged as skipped: it is listed once, as the spike */
    int k = 0;
    for (int i = 0; i < R->n_ev; i++) {
        int spike_too = 0;
        for (int j = 0; j < R->n_ev && !strcmp(R->ev[i].kind, "skipped"); j++)
            spike_too |= R->ev[j].step == R->ev[i].step && !strcmp(R->ev[j].kind, "loss_spike");
        if (!spike_too) R->ev[k++] = R->ev[i];
    }
    R->n_ev = k;
    if (bad) fprintf(stderr, "tera: report: %ld of %ld lines of %s are not metrics records (skipped)\n", bad, lineno, path);
    return TERA_OK;
}

/* ------------------------------------------------------------------ SVG */

static void html_text(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '&': fputs("&amp;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

#define PW 760
#define PH 260
#define ML 84
#define MR 20
#define MT 30
#define MB 40

typedef struct {
    const char *name, *color;
    int field; /* offset selector below */
    int dashed;
} series;

enum { F_LOSS, F_CE, F_VAL, F_LR, F_GNORM, F_TPS, F_RSS };

static double field_of(const rec *x, int f) {
    switch (f) {
    case F_LOSS: return x->loss;
    case F_CE: return x->ce;
    case F_VAL: return x->val;
    case F_LR: return x->lr;
    case F_GNORM: return x->gnorm;
    case F_TPS: return x->tps;
    case F_RSS: return x->rss / (1024.0 * 1024.0);
    }
    return NAN;
}

static void fmt_tick(char *b, size_t n, double v) {
    if (v != 0 && (fabs(v) < 1e-3 || fabs(v) >= 1e5)) snprintf(b, n, "%.2e", v);
    else snprintf(b, n, "%.4g", v);
}

/* A line chart of the given fields against the step; marks: steps drawn as vertical lines. */
static int line_chart(FILE *f, const run *R, const char *id, const char *title, const char *ylabel, const series *s, int ns,
                      int marks) {
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    int points = 0;
    for (int k = 0; k < ns; k++)
        for (int i = 0; i < R->n; i++) {
            const double v = field_of(&R->r[i], s[k].field);
            if (!isfinite(v)) continue;
            points++;
            x0 = fmin(x0, (double)R->r[i].step), x1 = fmax(x1, (double)R->r[i].step);
            y0 = fmin(y0, v), y1 = fmax(y1, v);
        }
    if (points == 0) return 0;
    if (x1 <= x0) x1 = x0 + 1;
    if (y1 <= y0) y1 = y0 + (y0 != 0 ? fabs(y0) * 0.1 : 1);
    const double pad = 0.05 * (y1 - y0);
    y0 = y0 >= 0 && y0 - pad < 0 ? 0 : y0 - pad; /* a non-negative figure keeps a non-negative axis */
    y1 += pad;
    const double w = PW - ML - MR, h = PH - MT - MB;
#define SX(x) (ML + ((x) - x0) / (x1 - x0) * w)
#define SY(y) (MT + h - ((y) - y0) / (y1 - y0) * h)
    fprintf(f, "<h2>%s</h2>\n<svg id=\"%s\" class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"%s\">\n", title, id, PW, PH, PW, PH, title);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%g\" height=\"%g\" fill=\"#fafafa\" stroke=\"#999\"/>\n", ML, MT, w, h);
    char b[32];
    for (int t = 0; t <= 4; t++) { /* y grid and ticks */
        const double v = y0 + (y1 - y0) * t / 4.0, y = SY(v);
        fmt_tick(b, sizeof b, v);
        fprintf(f, "<line x1=\"%d\" x2=\"%g\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/><text x=\"%d\" y=\"%.1f\" "
                "font-size=\"11\" text-anchor=\"end\">%s</text>\n", ML, ML + w, y, y, ML - 4, y + 4, b);
    }
    for (int t = 0; t <= 5; t++) { /* x ticks: steps */
        const double v = x0 + (x1 - x0) * t / 5.0, x = SX(v);
        fprintf(f, "<text x=\"%.1f\" y=\"%d\" font-size=\"11\" text-anchor=\"middle\">%.0f</text>\n", x, PH - MB + 15, v);
    }
    fprintf(f, "<text x=\"%g\" y=\"%d\" font-size=\"12\" text-anchor=\"middle\">step</text>\n", ML + w / 2, PH - 6);
    fprintf(f, "<text x=\"12\" y=\"%g\" font-size=\"12\" text-anchor=\"middle\" transform=\"rotate(-90 12 %g)\">%s</text>\n",
            MT + h / 2, MT + h / 2, ylabel);
    if (marks)
        for (int i = 0; i < R->n_ev; i++) {
            const event *e = &R->ev[i];
            const int spike = !strcmp(e->kind, "loss_spike"), skip = !strcmp(e->kind, "skipped");
            if (!spike && !skip) continue;
            const double x = SX(fmin(fmax((double)e->step, x0), x1));
            fprintf(f, "<line class=\"event-%s\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%g\" stroke=\"%s\" stroke-width=\"1.5\" "
                    "stroke-dasharray=\"4 3\"><title>step %ld: %s</title></line>\n", spike ? "spike" : "skip", x, x, MT,
                    MT + h, spike ? "#d62728" : "#ff7f0e", (long)e->step, spike ? "loss spike" : "skipped step");
        }
    for (int k = 0; k < ns; k++) {
        fprintf(f, "<polyline class=\"series\" data-name=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\"%s points=\"",
                s[k].name, s[k].color, s[k].dashed ? " stroke-dasharray=\"5 3\"" : "");
        int n = 0;
        for (int i = 0; i < R->n; i++) {
            const double v = field_of(&R->r[i], s[k].field);
            if (!isfinite(v)) continue;
            fprintf(f, "%s%.1f,%.1f", n++ ? " " : "", SX((double)R->r[i].step), SY(v));
        }
        fputs("\"/>\n", f);
        if (n == 1) { /* one point (validation at the end): a dot */
            for (int i = 0; i < R->n; i++) {
                const double v = field_of(&R->r[i], s[k].field);
                if (isfinite(v))
                    fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", SX((double)R->r[i].step), SY(v), s[k].color);
            }
        }
        fprintf(f, "<rect x=\"%g\" y=\"%d\" width=\"12\" height=\"3\" fill=\"%s\"/><text x=\"%g\" y=\"%d\" font-size=\"11\">%s</text>\n",
                ML + 10 + 150.0 * k, 14, s[k].color, ML + 26 + 150.0 * k, 18, s[k].name);
    }
    fputs("</svg>\n", f);
#undef SX
#undef SY
    return 1;
}

/* Expert load per MoE layer over time: rows = layers, columns = step bins (mean of the bin). */
static int heatmap(FILE *f, const run *R) {
    const int L = R->n_layers;
    if (L == 0 || R->n == 0) return 0;
    const int cols = R->n < 200 ? R->n : 200;
    double *cell = tera_calloc((size_t)L * (size_t)cols, sizeof(double));
    int *cnt = tera_calloc((size_t)L * (size_t)cols, sizeof(int));
    double vmax = 1.0;
    for (int i = 0; i < R->n; i++) {
        const int c = (int)((int64_t)i * cols / R->n);
        for (int l = 0; l < R->r[i].n_load; l++) {
            const double v = R->r[i].load[l];
            if (!isfinite(v) || v <= 0) continue; /* 0: a step without routed tokens */
            cell[(size_t)l * cols + c] += v;
            cnt[(size_t)l * cols + c]++;
        }
    }
    for (int k = 0; k < L * cols; k++)
        if (cnt[k]) {
            cell[k] /= cnt[k];
            if (cell[k] > vmax) vmax = cell[k];
        }
    const double w = PW - ML - MR, rowh = L <= 8 ? 24 : (L <= 32 ? 10 : 4), h = rowh * L;
    const int H = (int)(MT + h + MB);
    fprintf(f, "<h2>Expert load per MoE layer (busiest expert / mean; 1 = balanced)</h2>\n"
            "<svg id=\"plot-expert-load\" class=\"plot heatmap\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"expert load heatmap\">\n", PW, H, PW, H);
    const double cw = w / cols;
    for (int l = 0; l < L; l++) {
        for (int c = 0; c < cols; c++) {
            const size_t k = (size_t)l * cols + c;
            if (!cnt[k]) continue;
            /* 1 (balanced) = pale yellow, vmax = dark red */
            const double t = vmax > 1 ? fmin(1.0, (cell[k] - 1.0) / (vmax - 1.0)) : 0.0;
            const int r = (int)(255 - 120 * t), g = (int)(245 - 225 * t), bl = (int)(200 - 180 * t);
            const int s0 = (int)((int64_t)c * R->n / cols);
            fprintf(f, "<rect class=\"cell\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"rgb(%d,%d,%d)\">"
                    "<title>layer %d, from step %ld: %.3f</title></rect>\n", ML + c * cw, MT + l * rowh, cw + 0.3, rowh,
                    r, g, bl, R->first_moe + l, (long)R->r[s0].step, cell[k]);
        }
        if (L <= 32)
            fprintf(f, "<text x=\"%d\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">layer %d</text>\n", ML - 4,
                    MT + l * rowh + rowh / 2 + 4, R->first_moe + l);
    }
    for (int t = 0; t <= 5; t++) {
        const int i = (int)((int64_t)t * (R->n - 1) / 5);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"middle\">%ld</text>\n", ML + w * t / 5.0,
                MT + h + 15, (long)R->r[i].step);
    }
    fprintf(f, "<text x=\"%g\" y=\"%d\" font-size=\"12\" text-anchor=\"middle\">step (max %.3f)</text>\n", ML + w / 2, H - 6, vmax);
    fputs("</svg>\n", f);
    free(cell);
    free(cnt);
    return 1;
}

static void usage_error(const char *msg) { fprintf(stderr, "tera: error: %s\nusage: tera report RUN_DIR [--out FILE]\n", msg); }

int tera_cmd_report(int argc, char **argv) {
    const char *dir = NULL, *out = NULL;
    int force = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--force")) force = 1;
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strncmp(argv[i], "--out=", 6)) out = argv[i] + 6;
        else if (argv[i][0] == '-') {
            char m[256];
            snprintf(m, sizeof m, "report: unknown option '%.200s'", argv[i]);
            usage_error(m);
            return 2;
        } else if (!dir) dir = argv[i];
        else {
            usage_error("report: one run directory");
            return 2;
        }
    }
    if (!dir) {
        usage_error("report: RUN_DIR is missing");
        return 2;
    }
    char path[TERA_PATH_MAX + 64], mpath[TERA_PATH_MAX + 64], def_out[TERA_PATH_MAX + 64], tmp[TERA_PATH_MAX + 80];
    snprintf(mpath, sizeof mpath, "%s/metrics.jsonl", dir);
    snprintf(path, sizeof path, "%s/config.ini", dir);
    /* --out FILE: not an existing file unless --force, never the run's own files (the default,
     * RUN_DIR/report.html, is this command's page and is replaced) */
    const char *inputs[] = {mpath, path, NULL};
    if (out && tera_cli_refuse_output("--out", out, force, inputs)) return 1;
    run R;
    memset(&R, 0, sizeof R);
    if (read_metrics(mpath, &R) != TERA_OK) return tera_cli_error();
    snprintf(path, sizeof path, "%s/config.ini", dir);
    FILE *ci = fopen(path, "r");
    if (ci) { /* the heatmap's layer numbers */
        char line[512];
        int in_model = 0;
        while (fgets(line, sizeof line, ci)) {
            if (line[0] == '[') in_model = !strncmp(line, "[model]", 7);
            if (in_model && !strncmp(line, "first_k_dense", 13)) {
                const char *eq = strchr(line, '=');
                if (eq) R.first_moe = atoi(eq + 1);
            }
        }
        fclose(ci);
    }
    int steps = 0;
    for (int i = 0; i < R.n; i++) steps += R.r[i].has_step;
    if (steps == 0) {
        fprintf(stderr, "tera: error: %s has no step records: nothing to report\n", mpath);
        free(R.r);
        free(R.ev);
        return 1;
    }
    if (!out) {
        snprintf(def_out, sizeof def_out, "%s/report.html", dir);
        out = def_out;
    }
    snprintf(tmp, sizeof tmp, "%s.tmp", out);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        fprintf(stderr, "tera: error: cannot write '%s': %s\n", tmp, strerror(errno));
        return 1;
    }
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>tera run report: ", f);
    html_text(f, dir);
    fputs("</title>\n<style>body{font-family:sans-serif;margin:24px;color:#222;background:#fff}h1{font-size:22px}"
          "h2{font-size:16px;margin:22px 0 6px}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
          "font-size:13px}pre{background:#f4f4f4;padding:10px;font-size:12px;overflow:auto}</style></head><body>\n", f);
    fputs("<h1>tera run report: ", f);
    html_text(f, dir);
    fputs("</h1>\n", f);
    const rec *last = NULL;
    for (int i = R.n - 1; i >= 0 && !last; i--)
        if (R.r[i].has_step) last = &R.r[i];
    int nspike = 0, nskip = 0;
    for (int i = 0; i < R.n_ev; i++) nspike += !strcmp(R.ev[i].kind, "loss_spike"), nskip += !strcmp(R.ev[i].kind, "skipped");
    fprintf(f, "<table id=\"summary\"><tr><th>steps logged</th><td>%d</td></tr><tr><th>last step</th><td>%ld</td></tr>"
            "<tr><th>last loss</th><td>%.5g</td></tr><tr><th>skipped steps</th><td>%d</td></tr>"
            "<tr><th>loss spikes</th><td>%d</td></tr>", steps, (long)last->step, last->loss, nskip, nspike);
    if (R.peak_rss_mib > 0) fprintf(f, "<tr><th>peak RSS</th><td>%.1f MiB</td></tr>", R.peak_rss_mib);
    fputs("</table>\n", f);
    const series loss[3] = {{"loss", "#1f77b4", F_LOSS, 0}, {"cross-entropy", "#2ca02c", F_CE, 1},
                            {"validation loss", "#d62728", F_VAL, 0}};
    const series lr[1] = {{"learning rate", "#9467bd", F_LR, 0}};
    const series gn[1] = {{"grad norm", "#8c564b", F_GNORM, 0}};
    const series tp[1] = {{"tokens/s", "#17becf", F_TPS, 0}};
    const series mem[1] = {{"RSS (MiB)", "#7f7f7f", F_RSS, 0}};
    line_chart(f, &R, "plot-loss", "Loss and validation loss (dashed red: loss spikes, orange: skipped steps)", "loss", loss, 3, 1);
    line_chart(f, &R, "plot-lr", "Learning rate", "lr", lr, 1, 0);
    line_chart(f, &R, "plot-grad-norm", "Gradient norm (before clipping)", "grad norm", gn, 1, 0);
    line_chart(f, &R, "plot-throughput", "Throughput", "tokens/s", tp, 1, 0);
    if (!line_chart(f, &R, "plot-memory", "Resident memory of rank 0 (logging.hardware)", "MiB", mem, 1, 0))
        fputs("<p class=\"note\">Memory over time: not logged (logging.hardware = false); peak in the table above.</p>\n", f);
    if (!heatmap(f, &R)) fputs("<p class=\"note\">Expert load: the model has no MoE layer.</p>\n", f);
    fputs("<h2>Events</h2>\n<table id=\"events\"><tr><th>step</th><th>event</th><th>detail</th></tr>\n", f);
    for (int i = 0; i < R.n_ev; i++) {
        fprintf(f, "<tr class=\"event\"><td>%ld</td><td>", (long)R.ev[i].step);
        html_text(f, R.ev[i].kind);
        fputs("</td><td>", f);
        html_text(f, R.ev[i].detail);
        fputs("</td></tr>\n", f);
    }
    fputs("</table>\n<h2>Configuration (config.ini)</h2>\n<pre id=\"config\">", f);
    snprintf(path, sizeof path, "%s/config.ini", dir);
    FILE *c = fopen(path, "r");
    if (c) {
        char line[8192];
        while (fgets(line, sizeof line, c)) html_text(f, line);
        fclose(c);
    } else {
        fputs("(no config.ini in the run directory)", f);
    }
    fputs("</pre>\n</body></html>\n", f);
    const int bad = ferror(f);
    int rc = 0;
    if (fclose(f) != 0 || bad) {
        fprintf(stderr, "tera: error: writing '%s' failed\n", tmp);
        unlink(tmp);
        rc = 1;
    } else if (rename(tmp, out) != 0) {
        fprintf(stderr, "tera: error: cannot rename '%s' to '%s': %s\n", tmp, out, strerror(errno));
        unlink(tmp);
        rc = 1;
    } else {
        fprintf(stderr, "tera: report of %d steps written to %s\n", steps, out);
    }
    for (int i = 0; i < R.n; i++) free(R.r[i].load);
    free(R.r);
    free(R.ev);
    return rc;
}
