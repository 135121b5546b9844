/* Deferred weight gradients (wgrad.h). */
#include "wgrad.h"

#include <string.h>

#include "tera/profile.h"

int64_t tera_wgrad_bytes(int cap, int64_t N, int64_t D, int64_t V) {
    return cap > 0 ? (int64_t)cap * (N * V + N * D) * (int64_t)sizeof(float) : 0;
}

tera_wgrad_queue *tera_wgrad_create(tera_backend *be, int cap, int64_t N, int64_t D, int64_t V) {
    TERA_ASSERTF(be && cap >= 1 && N > 0 && D > 0 && V > 0, "weight-gradient queue: %d entries of %ld x %ld / %ld", cap,
                 (long)N, (long)V, (long)D);
    tera_wgrad_queue *q = tera_calloc(1, sizeof *q);
    q->be = be;
    q->cap = cap, q->N = N, q->D = D, q->V = V;
    q->bytes = tera_wgrad_bytes(cap, N, D, V);
    q->block = tera_calloc((size_t)(q->bytes / (int64_t)sizeof(float)), sizeof(float)); /* one block */
    q->dy = tera_calloc((size_t)cap * 2, sizeof(float *));
    q->x = q->dy + cap;
    q->item = tera_calloc((size_t)cap, sizeof(tera_wgrad_item));
    for (int i = 0; i < cap; i++) {
        q->dy[i] = q->block + (int64_t)i * N * V;
        q->x[i] = q->block + (int64_t)cap * N * V + (int64_t)i * N * D;
    }
    return q;
}

void tera_wgrad_destroy(tera_wgrad_queue *q) {
    if (!q) return; /* products still queued (a step cut short) are dropped */
    free(q->block); /* the dy buffers in q->dy may be others' now; theirs are in this block */
    free(q->dy);
    free(q->item);
    free(q);
}

void tera_wgrad_push(tera_wgrad_queue *q, float **dy, const float *x, float *gw, int64_t Vrows, float beta) {
    TERA_ASSERTF(Vrows > 0 && Vrows <= q->V && gw && dy && *dy && x, "weight-gradient queue: %ld rows of at most %ld",
                 (long)Vrows, (long)q->V);
    if (q->count == q->cap) (void)tera_wgrad_run(q);
    const int s = (q->first + q->count) % q->cap;
    float *t = q->dy[s];
    q->dy[s] = *dy, *dy = t; /* the caller's gradient stays where it is, in the queue's hands now */
    memcpy(q->x[s], x, sizeof(float) * (size_t)(q->N * q->D));
    q->item[s] = (tera_wgrad_item){.gw = gw, .V = Vrows, .beta = beta};
    q->count++;
}

int tera_wgrad_run(tera_wgrad_queue *q) {
    if (!q || q->count == 0) return 0;
    const int s = q->first;
    const tera_wgrad_item *it = &q->item[s];
    const double t0 = tera_now();
    /* outside any weights window (bf16: the operands round on the fly, as in the undeferred call) */
    TERA_PROF(HEAD_BWD, q->be->ops.linear_backward(q->be, NULL, it->gw, q->dy[s], q->x[s], NULL, q->N, q->D, it->V,
                                                   0.0f, it->beta));
    q->run_s += tera_now() - t0;
    q->first = (q->first + 1) % q->cap;
    q->count--;
    return 1;
}

int tera_wgrad_flush(tera_wgrad_queue *q) {
    int n = 0;
    while (tera_wgrad_run(q)) n++;
    return n;
}
