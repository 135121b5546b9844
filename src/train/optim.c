/* AdamW, LR schedule and gradient clipping. */
#include <math.h>
#include <string.h>

#include "tera/train.h"

void tera_adamw_init(tera_adamw *o, int64_t n) {
    o->n = n;
    o->t = 0;
    o->m = tera_calloc((size_t)(2 * n), sizeof(float));
    o->v = o->m + n;
}

void tera_adamw_free(tera_adamw *o) {
    free(o->m);
    memset(o, 0, sizeof *o);
}

void tera_adamw_step(tera_adamw *o, tera_model *m, float lr, float grad_scale, const tera_optim_config *c,
                     int zero_grad) {
    o->t++;
    const float b1 = c->beta1, b2 = c->beta2, eps = c->eps;
    const float bc1 = 1.0f - powf(b1, (float)o->t), bc2 = 1.0f - powf(b2, (float)o->t);
    const float step_size = lr / bc1, bc2_sqrt = sqrtf(bc2);
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        float *w = m->w + p->offset;
        float *g = m->g + p->offset;
        float *mm = o->m + p->offset, *vv = o->v + p->offset;
        const float decay = p->decay ? 1.0f - lr * c->weight_decay : 1.0f;
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < p->numel; j++) {
            const float gj = g[j] * grad_scale;
            w[j] *= decay;
            mm[j] = b1 * mm[j] + (1.0f - b1) * gj;
            vv[j] = b2 * vv[j] + (1.0f - b2) * gj * gj;
            w[j] -= step_size * mm[j] / (sqrtf(vv[j]) / bc2_sqrt + eps);
            if (zero_grad) g[j] = 0.0f;
        }
    }
}

float tera_lr_at(const tera_train_config *t, int64_t s) {
    const int64_t W = t->warmup_steps, S = t->steps;
    if (s < W) return t->lr * (float)(s + 1) / (float)W;
    if (S <= W) return t->min_lr;
    double prog = (double)(s - W) / (double)(S - W);
    if (prog > 1.0) prog = 1.0;
    return (float)(t->min_lr + 0.5 * (t->lr - t->min_lr) * (1.0 + cos(M_PI * prog)));
}

#define NORM_PARTS 256

double tera_grad_norm(const tera_model *m) {
    /* NORM_PARTS fixed slices, each summed in order, then added in order: the result does not
     * depend on the number of threads */
    const int64_t n = m->n_floats, len = (n + NORM_PARTS - 1) / NORM_PARTS;
    double part[NORM_PARTS];
#pragma omp parallel for schedule(static)
    for (int c = 0; c < NORM_PARTS; c++) {
        const int64_t a = c * len, b = a + len < n ? a + len : n;
        double s = 0.0;
        for (int64_t i = a; i < b; i++) s += (double)m->g[i] * m->g[i];
        part[c] = s;
    }
    double total = 0.0;
    for (int c = 0; c < NORM_PARTS; c++) total += part[c];
    return sqrt(total);
}

void tera_grad_scale(tera_model *m, float s) {
    float *g = m->g;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m->n_floats; i++) g[i] *= s;
}
