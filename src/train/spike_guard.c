/* The loss-spike guard (include/tera/guard.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <cjson/cJSON.h>

#include "tera/guard.h"
#include "tera/io.h"

void tera_spike_init(tera_spike_guard *g, const tera_train_config *t) {
    *g = (tera_spike_guard){0};
    g->window = t->spike_window > 0 ? t->spike_window : 0;
    g->zscore = t->spike_zscore;
    g->grad_zscore = t->spike_grad_zscore;
    g->hist = tera_calloc((size_t)(2 * g->window + 1), sizeof(double));
    g->last_spike_step = -1;
}

void tera_spike_free(tera_spike_guard *g) {
    free(g->hist);
    g->hist = NULL;
}

int tera_spike_check(tera_spike_guard *g, double loss_v, double gn_v) {
    const int W = g->window;
    if (W <= 0) return 0;
    double *loss = g->hist, *gn = g->hist + W;
    int spike = 0;
    if (g->n == W) {
        double ml = 0, mg = 0, vl = 0, vg = 0;
        for (int i = 0; i < W; i++) ml += loss[i], mg += gn[i];
        ml /= W, mg /= W;
        for (int i = 0; i < W; i++) vl += (loss[i] - ml) * (loss[i] - ml), vg += (gn[i] - mg) * (gn[i] - mg);
        /* floors on the spread (2% of the mean loss, 10% of the mean grad norm): a window of very
         * steady steps must not turn an ordinary wobble into a huge z-score */
        const double sl = fmax(sqrt(vl / W), 0.02 * fabs(ml)) + 1e-12, sg = fmax(sqrt(vg / W), 0.1 * fabs(mg)) + 1e-12;
        const double zl = (loss_v - ml) / sl, zg = (gn_v - mg) / sg;
        spike = zl > g->zscore || zg > g->grad_zscore;
        g->hist[2 * W] = zl > zg ? zl : zg; /* kept for the event record */
    }
    if (!spike) {
        loss[g->pos] = loss_v;
        gn[g->pos] = gn_v;
        g->pos = (g->pos + 1) % W;
        if (g->n < W) g->n++;
    }
    return spike;
}

double tera_spike_last_z(const tera_spike_guard *g) { return g->window > 0 ? g->hist[2 * g->window] : 0.0; }

int64_t tera_spike_next_clean(const tera_spike_guard *g, int64_t s, int64_t seqs) {
    /* checked again against every window after each jump (the batch size of a replay may differ) */
    for (int i = 0; i < g->n_skips; i++)
        if (s < g->skip_hi[i] && s + seqs > g->skip_lo[i]) s = g->skip_hi[i], i = -1;
    return s;
}

int tera_spike_event(tera_spike_guard *g, int64_t step) {
    g->events++;
    g->repeats = step == g->last_spike_step ? g->repeats + 1 : 0;
    g->last_spike_step = step;
    return g->repeats < 3 && g->n_skips < TERA_SPIKE_MAX_SKIPS;
}

void tera_spike_add_skip(tera_spike_guard *g, int64_t a, int64_t e) {
    int at = 0, dup = 0;
    while (at < g->n_skips && g->skip_lo[at] <= a) dup |= g->skip_lo[at] == a && g->skip_hi[at] == e, at++;
    if (dup || g->n_skips >= TERA_SPIKE_MAX_SKIPS) return;
    for (int i = g->n_skips; i > at; i--) g->skip_lo[i] = g->skip_lo[i - 1], g->skip_hi[i] = g->skip_hi[i - 1];
    g->skip_lo[at] = a, g->skip_hi[at] = e;
    g->n_skips++;
}

void tera_spike_cut(tera_spike_guard *g, int64_t until) {
    if (until > g->lr_cut_until) g->lr_cut_until = until;
    g->n = g->pos = 0;
}

/* Doubles that must round-trip exactly (cJSON prints 15 digits when they are merely close). */
static cJSON *exact_number(double v) {
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", v);
    return cJSON_CreateString(buf);
}

static int read_exact(const cJSON *it, double *v) {
    if (!cJSON_IsString(it)) return 0;
    char *end;
    *v = strtod(it->valuestring, &end);
    return end != it->valuestring && *end == 0;
}

static int json_i64(const cJSON *o, const char *name, int64_t *v) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!cJSON_IsNumber(it)) return 0;
    *v = (int64_t)it->valuedouble;
    return 1;
}

void tera_spike_save(const tera_spike_guard *g, cJSON *root) {
    cJSON *o = cJSON_AddObjectToObject(root, "spike_guard");
    cJSON_AddNumberToObject(o, "lr_cut_until", (double)g->lr_cut_until);
    cJSON *sk = cJSON_AddArrayToObject(o, "skip_windows");
    for (int i = 0; i < g->n_skips; i++) {
        cJSON *w = cJSON_CreateArray();
        cJSON_AddItemToArray(w, cJSON_CreateNumber((double)g->skip_lo[i]));
        cJSON_AddItemToArray(w, cJSON_CreateNumber((double)g->skip_hi[i]));
        cJSON_AddItemToArray(sk, w);
    }
    cJSON_AddNumberToObject(o, "events", (double)g->events);
    cJSON_AddNumberToObject(o, "last_spike_step", (double)g->last_spike_step);
    cJSON_AddNumberToObject(o, "repeats", g->repeats);
    const int W = g->window;
    cJSON_AddNumberToObject(o, "window", W);
    cJSON_AddNumberToObject(o, "n", g->n);
    cJSON_AddNumberToObject(o, "pos", g->pos);
    cJSON *l = cJSON_AddArrayToObject(o, "loss"), *gn = cJSON_AddArrayToObject(o, "grad_norm");
    for (int i = 0; i < g->n && i < W; i++) {
        cJSON_AddItemToArray(l, exact_number(g->hist[i]));
        cJSON_AddItemToArray(gn, exact_number(g->hist[W + i]));
    }
}

tera_status tera_spike_load(tera_spike_guard *g, const cJSON *root, const char *path) {
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, "spike_guard");
    if (!cJSON_IsObject(o)) return TERA_OK;
    int64_t cut, events, last, rep, W, n, pos;
    const cJSON *sk = cJSON_GetObjectItemCaseSensitive(o, "skip_windows");
    const cJSON *l = cJSON_GetObjectItemCaseSensitive(o, "loss"), *gn = cJSON_GetObjectItemCaseSensitive(o, "grad_norm");
    if (!json_i64(o, "lr_cut_until", &cut) || !json_i64(o, "events", &events) || !json_i64(o, "last_spike_step", &last) ||
        !json_i64(o, "repeats", &rep) || !json_i64(o, "window", &W) || !json_i64(o, "n", &n) || !json_i64(o, "pos", &pos) ||
        !cJSON_IsArray(sk) || !cJSON_IsArray(l) || !cJSON_IsArray(gn) || n < 0 || n > W ||
        (W > 0 && (pos < 0 || pos >= W)) || cJSON_GetArraySize(l) != n || cJSON_GetArraySize(gn) != n)
        return tera_fail(TERA_ERR_FORMAT, "%s: \"spike_guard\" is incomplete or inconsistent", path);
    const cJSON *w;
    cJSON_ArrayForEach(w, sk) {
        const cJSON *lo = cJSON_GetArrayItem(w, 0), *hi = cJSON_GetArrayItem(w, 1);
        if (!cJSON_IsArray(w) || !cJSON_IsNumber(lo) || !cJSON_IsNumber(hi) || hi->valuedouble <= lo->valuedouble)
            return tera_fail(TERA_ERR_FORMAT, "%s: \"spike_guard.skip_windows\" holds a bad [lo, hi) pair", path);
    }
    /* the window of recent healthy steps, when this run's window has the checkpoint's length */
    double *tmp = tera_calloc((size_t)(2 * n + 1), sizeof(double));
    for (int i = 0; i < n && W == g->window; i++)
        if (!read_exact(cJSON_GetArrayItem(l, i), &tmp[i]) || !read_exact(cJSON_GetArrayItem(gn, i), &tmp[n + i])) {
            free(tmp);
            return tera_fail(TERA_ERR_FORMAT, "%s: \"spike_guard\" window entry %d is not a number string", path, i);
        }
    /* everything checked: apply */
    if (cut > g->lr_cut_until) g->lr_cut_until = cut;
    if (events > g->events) g->events = events;
    if (last > g->last_spike_step) g->last_spike_step = last, g->repeats = (int)rep;
    cJSON_ArrayForEach(w, sk) tera_spike_add_skip(g, (int64_t)cJSON_GetArrayItem(w, 0)->valuedouble,
                                                  (int64_t)cJSON_GetArrayItem(w, 1)->valuedouble);
    g->n = g->pos = 0;
    if (W == g->window) {
        for (int i = 0; i < n; i++) g->hist[i] = tmp[i], g->hist[W + i] = tmp[n + i];
        g->n = (int)n, g->pos = (int)pos;
    }
    free(tmp);
    return TERA_OK;
}
