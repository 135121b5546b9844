/* Logging a run to an MLflow tracking server over its REST API (logging.mlflow_uri, libcurl;
 * docs/TRACKING.md): parameters, metrics (batched, 1000 per request), tags, artefacts (through the
 * server's artefact proxy, mlflow-artifacts:/, or a local file store), and the run's final status.
 *
 * MLflow is an observer: every failure prints one warning naming the server and what failed, turns
 * the logger off for the rest of the run, and never stops training. */
#ifndef TERA_MLFLOW_H
#define TERA_MLFLOW_H

#include <stdint.h>

typedef struct tera_mlflow tera_mlflow;

/* Creates a run in experiment `experiment` (created when missing) named run_name. NULL (after one
 * warning) when the server cannot be reached or refuses. Call curl_global_init before any thread. */
tera_mlflow *tera_mlflow_start(const char *uri, const char *experiment, const char *run_name);
const char *tera_mlflow_run_id(const tera_mlflow *m);
/* Queues a parameter / tag (sent by the next flush, 100 per request). */
void tera_mlflow_param(tera_mlflow *m, const char *key, const char *value);
void tera_mlflow_tag(tera_mlflow *m, const char *key, const char *value);
/* Queues one metric value; sent by the next flush (and whenever 1000 are queued). */
void tera_mlflow_metric(tera_mlflow *m, const char *key, double value, int64_t step, int64_t timestamp_ms);
/* Sends everything queued (runs/log-batch). */
void tera_mlflow_flush(tera_mlflow *m);
/* Uploads a local file as artefact `name` of the run. */
void tera_mlflow_artifact(tera_mlflow *m, const char *local_path, const char *name);
/* Flushes, sets the run's status (FINISHED, FAILED or KILLED) and end time, frees m. */
void tera_mlflow_end(tera_mlflow *m, const char *status);
/* 1 while the logger works (no failure so far). */
int tera_mlflow_ok(const tera_mlflow *m);

#endif
