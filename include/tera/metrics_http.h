/* The Prometheus endpoint (src/obs/metrics_http.c, docs/MONITORING.md): with logging.metrics_port
 * = P > 0 every rank serves GET /metrics in the Prometheus text exposition format (0.0.4) on port
 * P + its world rank, from libmicrohttpd's own thread. The trainer publishes a snapshot after each
 * step into a buffer sized at start and guarded by a mutex (the step loop allocates nothing and
 * holds the lock for a copy of a few hundred numbers); the serving thread copies the snapshot out
 * and formats it without the lock, so a slow or malformed scrape never slows or stops training. */
#ifndef TERA_METRICS_HTTP_H
#define TERA_METRICS_HTTP_H

#include <stdint.h>

#include "tera/status.h"
#include "tera/train.h"

typedef struct tera_metrics_http tera_metrics_http;

/* Starts the endpoint of this rank for a set-up trainer (its configuration, layout and memory
 * figures) on port logging.metrics_port + world rank, listening on every interface.
 * A port that cannot be bound (in use, or base + rank above 65535) fails with one message naming
 * the port and the key. */
tera_status tera_metrics_http_start(tera_metrics_http **out, const tera_trainer *tr);
/* After each step (every rank): the step's figures and the trainer's counters.
 * No allocation; holds the mutex for a copy. NULL h: no-op. */
void tera_metrics_http_publish(tera_metrics_http *h, const tera_trainer *tr, const tera_step_result *r);
/* After an evaluation: the validation loss of the model after step `step` (0-based index). */
void tera_metrics_http_publish_eval(tera_metrics_http *h, int64_t step, double val_loss);
/* Stops the serving thread (open connections are closed) and frees everything. NULL: no-op. */
void tera_metrics_http_stop(tera_metrics_http *h);
/* The exposition text the endpoint would serve now, into buf (size n); returns its length, or the
 * length it needs when that is >= n (0 for a NULL h). */
size_t tera_metrics_http_render(tera_metrics_http *h, char *buf, size_t n);

#endif
