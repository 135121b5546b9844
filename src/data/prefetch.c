/* Read-ahead of training micro-batches on a background thread.
 *
 * A ring of `depth` slots. The worker fills slot (k % depth) with micro-batch k of the current
 * sequence (global samples base + k*B ...) while fewer than depth-1 slots are ready beyond the one
 * the consumer holds; the consumer's slot is never written until it asks for the next batch. */
#include <pthread.h>
#include <string.h>

#include "tera/data.h"
#include "tera/profile.h"
#include "tera/trace.h"

struct tera_prefetcher {
    const tera_loader *loader;
    int B, T, depth;
    int32_t *buf;             /* [depth][2][B*T]: inputs then targets per slot */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t base;             /* global sample of micro-batch 0 of the current sequence */
    int64_t produced;         /* micro-batches of the sequence filled so far */
    int64_t consumed;         /* micro-batches handed out (the last one is still in use) */
    uint64_t generation;      /* bumped on restart: the worker drops work of older generations */
    int stop;
};

static int32_t *slot_inputs(tera_prefetcher *p, int64_t k) {
    return p->buf + (size_t)(k % p->depth) * 2 * (size_t)p->B * (size_t)p->T;
}

static void fill(tera_prefetcher *p, int32_t *in, int64_t g0) {
    const int T = p->T;
    int32_t *tg = in + (size_t)p->B * T;
    for (int b = 0; b < p->B; b++) tera_loader_train_sample(p->loader, g0 + b, in + (size_t)b * T, tg + (size_t)b * T);
}

static void *worker(void *arg) {
    tera_prefetcher *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        /* room: slots beyond the one in use (consumed-1) that are not yet ready */
        while (!p->stop && p->produced - (p->consumed > 0 ? p->consumed - 1 : 0) >= p->depth)
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->stop) break;
        const int64_t k = p->produced;
        const int64_t g0 = p->base + k * p->B;
        const uint64_t gen = p->generation;
        int32_t *dst = slot_inputs(p, k);
        pthread_mutex_unlock(&p->mu);
        const double t0 = tera_now();
        fill(p, dst, g0); /* outside the lock: the consumer never touches this slot meanwhile */
        tera_trace_event(TERA_TRACE_DATA, "load micro-batch", "data", t0, tera_now(), -1); /* the timeline */
        pthread_mutex_lock(&p->mu);
        if (gen == p->generation) p->produced = k + 1;
        pthread_cond_broadcast(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

tera_status tera_prefetch_start(tera_prefetcher **out, const tera_loader *l, int B, int depth) {
    if (depth < 2) depth = 2;
    tera_prefetcher *p = tera_calloc(1, sizeof *p);
    p->loader = l;
    p->B = B;
    p->T = l->T;
    p->depth = depth;
    p->buf = tera_malloc(sizeof(int32_t) * (size_t)depth * 2 * (size_t)B * (size_t)l->T);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (pthread_create(&p->thread, NULL, worker, p) != 0) {
        free(p->buf);
        free(p);
        return tera_fail(TERA_ERR_IO, "cannot start the data prefetch thread");
    }
    *out = p;
    return TERA_OK;
}

double tera_prefetch_get(tera_prefetcher *p, int64_t g0, const int32_t **inputs, const int32_t **targets) {
    const double t0 = tera_now();
    pthread_mutex_lock(&p->mu);
    if (g0 != p->base + p->consumed * p->B) {
        /* not the next batch of the sequence: restart the read-ahead at g0. The worker may be
         * filling a slot of the old generation; it is discarded, and since the new sequence's
         * first slot is 0 while the worker could be writing any slot, wait for it to finish. */
        p->generation++;
        p->base = g0;
        p->produced = 0;
        p->consumed = 0;
        pthread_cond_broadcast(&p->cv);
    }
    const uint64_t gen = p->generation;
    while (p->produced <= p->consumed || gen != p->generation) pthread_cond_wait(&p->cv, &p->mu);
    int32_t *in = slot_inputs(p, p->consumed);
    p->consumed++;
    pthread_cond_broadcast(&p->cv); /* the previous slot is free again */
    pthread_mutex_unlock(&p->mu);
    *inputs = in;
    *targets = in + (size_t)p->B * p->T;
    return tera_now() - t0;
}

void tera_prefetch_stop(tera_prefetcher *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->buf);
    free(p);
}
