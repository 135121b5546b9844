/* Dynamic batch size: the batch-size ramp-up, the grad-norm-triggered growth, and the LR rule
 * (the rules are stated in include/tera/train.h). Pure functions of the config, the step and a small
 * state that checkpoints carry, so a resumed run takes the same batch sizes as an uninterrupted one. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cjson/cJSON.h>

#include "tera/train.h"

void tera_batch_init(tera_batch_state *b) {
    b->grow = 1;
    b->window_n = 0;
    b->window_sum = 0.0;
}

static int grow_max(const tera_train_config *t) {
    return t->batch_grow_max > 0 ? t->batch_grow_max : 4 * t->grad_accum;
}

static int ramp_active(const tera_train_config *t, int64_t step) {
    return t->batch_rampup_start > 0 && step < t->batch_rampup_steps;
}

int tera_batch_accum(const tera_train_config *t, const tera_batch_state *b, int64_t step) {
    const int G = t->grad_accum;
    int64_t a = G;
    if (ramp_active(t, step)) {
        const int64_t s0 = t->batch_rampup_start;
        a = s0 + (G - s0) * step / t->batch_rampup_steps;
    }
    const int g = b && b->grow > 1 ? b->grow : 1;
    if (g > 1) {
        a *= g;
        if (a > grow_max(t)) a = grow_max(t);
    }
    TERA_ASSERTF(a >= 1 && a <= INT32_MAX, "accumulation count %ld out of range", (long)a);
    return (int)a;
}

float tera_batch_lr_factor(const tera_train_config *t, int accum) {
    if (accum == t->grad_accum) return 1.0f;
    const double r = (double)accum / (double)t->grad_accum;
    switch (t->batch_lr_scaling) {
    case TERA_BATCH_LR_SQRT: return (float)sqrt(r);
    case TERA_BATCH_LR_LINEAR: return (float)r;
    case TERA_BATCH_LR_NONE: return 1.0f;
    }
    return 1.0f;
}

int tera_batch_observe(const tera_train_config *t, tera_batch_state *b, int64_t step, double grad_norm,
                       double *mean) {
    /* off, still ramping up (the grad norm of a smaller batch is not comparable), or at the cap */
    if (t->batch_grow_gnorm <= 0.0f || ramp_active(t, step) || !isfinite(grad_norm)) return 0;
    if ((int64_t)t->grad_accum * b->grow >= grow_max(t)) return 0;
    b->window_sum += grad_norm;
    if (++b->window_n < t->batch_grow_window) return 0;
    const double m = b->window_sum / b->window_n;
    b->window_n = 0;
    b->window_sum = 0.0;
    if (!(m > (double)t->batch_grow_gnorm)) return 0;
    b->grow *= 2;
    if (mean) *mean = m;
    return 1;
}

void tera_trainer_batch_observe(tera_trainer *tr, const tera_step_result *r) {
    const tera_train_config *t = &tr->cfg.training;
    double mean = 0.0;
    if (r->skipped || !tera_batch_observe(t, &tr->batch, r->step, r->grad_norm, &mean)) return;
    const int a = tera_batch_accum(t, &tr->batch, r->step + 1);
    const int64_t seqs = (int64_t)a * t->micro_batch * tr->topo.dp;
    const float f = tera_batch_lr_factor(t, a);
    if (!tr->root) return;
    fprintf(stderr,
            "tera: mean grad norm %.4g over %d steps > %.4g: batch grows to %d micro-batches per rank "
            "(%ld sequences) from step %ld, LR x %.4g\n",
            mean, t->batch_grow_window, (double)t->batch_grow_gnorm, a, (long)seqs, (long)(r->step + 1), (double)f);
    if (tr->log.metrics) {
        fprintf(tr->log.metrics,
                "{\"step\": %ld, \"event\": \"batch_grow\", \"mean_grad_norm\": %.7g, \"accum\": %d, \"batch\": %ld, "
                "\"lr_factor\": %.7g}\n",
                (long)r->step, mean, a, (long)seqs, (double)f);
        fflush(tr->log.metrics);
    }
}

/* grow_window_sum as a string: doubles must round-trip exactly (cJSON prints 15 digits). */
void tera_batch_save(const tera_train_config *t, const tera_batch_state *b, int64_t step, int world, cJSON *root) {
    cJSON *o = cJSON_AddObjectToObject(root, "batch");
    const int a = tera_batch_accum(t, b, step);
    cJSON_AddNumberToObject(o, "accum", a); /* of the next step (informative: it follows from the rest) */
    cJSON_AddNumberToObject(o, "sequences", (double)a * t->micro_batch * world);
    cJSON_AddNumberToObject(o, "grow", b->grow);
    cJSON_AddNumberToObject(o, "grow_window_n", b->window_n);
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", b->window_sum);
    cJSON_AddStringToObject(o, "grow_window_sum", buf);
}

tera_status tera_batch_load(tera_batch_state *b, const cJSON *root, const char *path) {
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, "batch");
    tera_batch_init(b);
    if (!cJSON_IsObject(o)) return TERA_OK;
    const cJSON *grow = cJSON_GetObjectItemCaseSensitive(o, "grow"), *n = cJSON_GetObjectItemCaseSensitive(o, "grow_window_n");
    const cJSON *sum = cJSON_GetObjectItemCaseSensitive(o, "grow_window_sum");
    char *end = NULL;
    const double sv = cJSON_IsString(sum) ? strtod(sum->valuestring, &end) : 0.0;
    const int64_t gv = cJSON_IsNumber(grow) ? (int64_t)grow->valuedouble : 0, nv = cJSON_IsNumber(n) ? (int64_t)n->valuedouble : -1;
    if (gv < 1 || gv > (1 << 30) || (gv & (gv - 1)) || nv < 0 || nv > INT32_MAX || !end || end == sum->valuestring || *end)
        return tera_fail(TERA_ERR_FORMAT, "%s: \"batch\" needs grow (a power of 2), grow_window_n >= 0 and "
                                          "grow_window_sum (a number as a string)", path);
    b->grow = (int)gv, b->window_n = (int)nv, b->window_sum = sv;
    return TERA_OK;
}
