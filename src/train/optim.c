/* AdamW, LR schedule and gradient clipping. */
#include <math.h>
#include <string.h>

#include "tera/train.h"

void tera_adamw_init_range(tera_adamw *o, int64_t lo, int64_t hi) {
    o->lo = lo;
    o->hi = hi;
    o->n = hi - lo;
    o->t = 0;
    o->m = tera_calloc((size_t)(2 * o->n + 1), sizeof(float));
    o->v = o->m + o->n;
}

void tera_adamw_init(tera_adamw *o, int64_t n) { tera_adamw_init_range(o, 0, n); }

void tera_adamw_free(tera_adamw *o) {
    if (!o->view) free(o->m);
    memset(o, 0, sizeof *o);
}

#define CHUNKS 64 /* fixed partition of each tensor for reductions: thread-count independent */

void tera_adamw_step(tera_adamw *o, tera_model *m, float lr, float grad_scale, const tera_optim_config *c,
                     int zero_grad, double *update_sq, double *param_sq) {
    tera_adamw_step_by_param(o, m, lr, grad_scale, c, zero_grad, update_sq, param_sq, NULL, NULL);
}

void tera_adamw_step_by_param(tera_adamw *o, tera_model *m, float lr, float grad_scale, const tera_optim_config *c,
                              int zero_grad, double *update_sq, double *param_sq, double *usq, double *psq) {
    o->t++;
    const float b1 = c->beta1, b2 = c->beta2, eps = c->eps;
    const float bc1 = 1.0f - powf(b1, (float)o->t), bc2 = 1.0f - powf(b2, (float)o->t);
    const float step_size = lr / bc1, bc2_sqrt = sqrtf(bc2);
    double usum = 0.0, psum = 0.0;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        /* the part of this tensor inside [lo, hi) */
        const int64_t a = p->offset > o->lo ? p->offset : o->lo;
        const int64_t b = p->offset + p->numel < o->hi ? p->offset + p->numel : o->hi;
        if (b <= a) continue;
        float *w = o->w ? o->w + (a - o->lo) : m->w + a;
        float *g = o->g ? o->g + (a - o->lo) : m->g + a;
        float *mm = o->m + (a - o->lo), *vv = o->v + (a - o->lo);
        const float decay = p->decay ? 1.0f - lr * c->weight_decay : 1.0f;
        const int64_t n = b - a, len = (n + CHUNKS - 1) / CHUNKS;
        double up[CHUNKS], pp[CHUNKS];
#pragma omp parallel for schedule(static)
        for (int ch = 0; ch < CHUNKS; ch++) {
            const int64_t j0 = ch * len, j1 = j0 + len < n ? j0 + len : n;
            float us = 0.0f, ps = 0.0f;
            for (int64_t j = j0; j < j1; j++) {
                const float gj = g[j] * grad_scale;
                const float w0 = w[j];
                float wj = w0 * decay;
                mm[j] = b1 * mm[j] + (1.0f - b1) * gj;
                vv[j] = b2 * vv[j] + (1.0f - b2) * gj * gj;
                wj -= step_size * mm[j] / (sqrtf(vv[j]) / bc2_sqrt + eps);
                w[j] = wj;
                us += (wj - w0) * (wj - w0);
                ps += w0 * w0;
                if (zero_grad) g[j] = 0.0f;
            }
            up[ch] = us;
            pp[ch] = ps;
        }
        double ut = 0.0, pt = 0.0;
        for (int ch = 0; ch < CHUNKS; ch++) ut += up[ch], pt += pp[ch];
        usum += ut, psum += pt;
        if (usq) usq[i] += ut;
        if (psq) psq[i] += pt;
    }
    if (update_sq) *update_sq = usum;
    if (param_sq) *param_sq = psum;
}

/* The LR schedules (docs/SCHEDULES.md has the formulas): a linear warmup over W steps, then
 *   cosine: min + (max - min) (1 + cos(pi p)) / 2,  p = (s - W) / (S - W)   (MODEL.md, bit for bit)
 *   linear: min + (max - min) (1 - p)
 *   wsd:    max until D0 = max(W, S - round(decay_fraction S)), then min + (max - min) shape(q),
 *           q = (s - D0) / (S - D0), shape(q) = 1 - q | (1 + cos(pi q)) / 2 | 1 - sqrt(q)
 * with p and q clamped to [0, 1]; steps at or after S keep the last value. */
float tera_lr_at(const tera_train_config *t, int64_t s) {
    const int64_t W = t->warmup_steps, S = t->steps;
    if (s < W) return t->lr * (float)(s + 1) / (float)W;
    if (t->lr_schedule == TERA_LR_WSD) {
        int64_t D0 = S - (int64_t)llround((double)t->decay_fraction * (double)S);
        if (D0 < W) D0 = W;
        if (s < D0) return t->lr;
        if (S <= D0) return t->min_lr;
        double q = (double)(s - D0) / (double)(S - D0);
        if (q > 1.0) q = 1.0;
        const double f = t->decay_shape == TERA_DECAY_COSINE ? 0.5 * (1.0 + cos(M_PI * q))
                         : t->decay_shape == TERA_DECAY_SQRT ? 1.0 - sqrt(q)
                                                             : 1.0 - q;
        return (float)(t->min_lr + (t->lr - t->min_lr) * f);
    }
    if (S <= W) return t->min_lr;
    double prog = (double)(s - W) / (double)(S - W);
    if (prog > 1.0) prog = 1.0;
    if (t->lr_schedule == TERA_LR_LINEAR) return (float)(t->min_lr + (t->lr - t->min_lr) * (1.0 - prog));
    return (float)(t->min_lr + 0.5 * (t->lr - t->min_lr) * (1.0 + cos(M_PI * prog)));
}

double tera_grad_sq_by_param(const tera_model *m, double *sq) {
    return tera_grad_sq_by_param_range(m, 0, m->n_floats, sq);
}

double tera_grad_sq_by_param_range(const tera_model *m, int64_t lo, int64_t hi, double *sq) {
    return tera_grad_sq_by_param_at(m, lo, hi, m->g + lo, sq);
}

double tera_grad_sq_by_param_at(const tera_model *m, int64_t lo, int64_t hi, const float *glo, double *sq) {
    double total = 0.0;
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        const int64_t a = p->offset > lo ? p->offset : lo;
        const int64_t b = p->offset + p->numel < hi ? p->offset + p->numel : hi;
        if (b <= a) {
            if (sq) sq[i] = 0.0;
            continue;
        }
        const float *g = glo + (a - lo);
        const int64_t n = b - a, len = (n + CHUNKS - 1) / CHUNKS;
        double part[CHUNKS];
#pragma omp parallel for schedule(static)
        for (int ch = 0; ch < CHUNKS; ch++) {
            const int64_t j0 = ch * len, j1 = j0 + len < n ? j0 + len : n;
            double s = 0.0;
            for (int64_t j = j0; j < j1; j++) s += (double)g[j] * g[j];
            part[ch] = s;
        }
        double t = 0.0;
        for (int ch = 0; ch < CHUNKS; ch++) t += part[ch];
        if (sq) sq[i] = t;
        total += t;
    }
    return total;
}

double tera_grad_norm(const tera_model *m) { return sqrt(tera_grad_sq_by_param(m, NULL)); }

void tera_grad_scale(tera_model *m, float s) {
    float *g = m->g;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m->n_floats; i++) g[i] *= s;
}
