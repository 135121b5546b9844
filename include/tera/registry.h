/* The run registry (logging.registry, docs/TRACKING.md): one SQLite database that records every
 * `tera train` (status with heartbeats, command line, resolved configuration, layout, git commit,
 * dataset and tokenizer fingerprints, final metrics, checkpoints) and the studies of `tera tune`.
 *
 * The database runs in WAL mode with a busy timeout, and every write is one short IMMEDIATE
 * transaction, so many processes (parallel trials, several training jobs) can write it at once.
 * Only world rank 0 of a job writes. */
#ifndef TERA_REGISTRY_H
#define TERA_REGISTRY_H

#include <stdint.h>

#include "tera/config.h"
#include "tera/status.h"

#define TERA_VERSION "0.1.0"

/* The registry's connection (opaque; sqlite3 underneath). */
typedef struct tera_registry tera_registry;

/* Opens (creating the file, its parent directories and the schema when missing) the registry at
 * path. An error names the path and SQLite's message. */
tera_status tera_registry_open(tera_registry **out, const char *path);
void tera_registry_close(tera_registry *r);
/* The underlying sqlite3 handle (for src/obs/tune.c and src/cli/cmd_runs.c). */
void *tera_registry_db(tera_registry *r);
/* Runs one SQL statement (no result rows) inside an IMMEDIATE transaction, retried while the
 * database is busy. */
tera_status tera_registry_exec(tera_registry *r, const char *sql);

/* Runs one SQL statement with parameters bound by `types`, one letter each: s (const char *,
 * NULL binds NULL), i (int64_t), d (double). Result rows are discarded. */
tera_status tera_registry_run(tera_registry *r, const char *sql, const char *types, ...);

/* Statuses of a run. A run whose heartbeat is older than TERA_REGISTRY_STALE_S while it says
 * "running" was killed without a chance to say so (SIGKILL, a lost node): the readers
 * (tera runs) mark it "killed". */
#define TERA_REGISTRY_STALE_S 120.0
double tera_registry_now(void); /* seconds since the epoch (wall clock) */

/* Marks runs whose heartbeat stopped (status running, heartbeat older than stale_s) as killed.
 * Returns the number marked (or -1 on error). */
int tera_registry_reap(tera_registry *r, double stale_s);

/* Fingerprints used in the registry (16 hex digits of XXH3-64; "" when there is nothing to
 * fingerprint). Dataset: a Megatron prefix uses the PREFIX.xxh3 checksum file that `tera data
 * prepare` writes (cheap), else the XXH3 of .idx and .bin; a text file its own XXH3; the embedded
 * corpus "embedded". *bytes receives the data's size. */
void tera_registry_dataset_fp(const char *path, char *fp, size_t cap, int64_t *bytes);
/* Tokenizer: XXH3 over encoder.json and vocab.bpe found next to the dataset (DIR/encoder.json or
 * PREFIX.tokenizer/); "bytes" for byte-level data (text files, the embedded corpus). */
void tera_registry_tokenizer_fp(const char *data_path, char *fp, size_t cap);

/* ---- tracking one training run (src/cli/cmd_train.c) ---------------------------------------------
 * tera_track_start registers the run (or, for --resume of a run directory already registered,
 * marks that run running again), starts a thread that writes a heartbeat every few seconds and
 * streams metrics.jsonl to MLflow (logging.mlflow_uri) in batches, and catches SIGINT/SIGTERM to
 * record "killed" before the process ends. Returns NULL (after at most one warning) when the
 * registry and MLflow are both off, when this is not world rank 0, or when the registry cannot be
 * opened: tracking never stops training. tera_track_end writes the final status, the metrics
 * summary and the checkpoints, and frees the tracker. status: "finished", "failed" or "killed". */
typedef struct tera_track tera_track;
tera_track *tera_track_start(const tera_config *cfg, int argc, char **argv, int64_t start_step, int world);
void tera_track_end(tera_track *t, const char *status, const char *error);
/* Called by tera train before it starts any thread: SIGINT and SIGTERM are blocked in the caller, so
 * in every thread it starts, and land on a thread of their own (and the tracker's), never on one
 * inside a oneDNN kernel (src/obs/registry.c says why). Their actions are unchanged. */
void tera_track_signals_init(void);
/* The run id the tracker registered ("" when the registry is off). */
const char *tera_track_id(const tera_track *t);

/* Summary of a metrics.jsonl as a JSON object text (records: step lines; last_step: the step of the
 * last one + 1, which a resumed run's repeated steps do not change; final_loss, min_loss,
 * final_val_loss, mean tokens_per_s, elapsed_s, skipped); the caller frees it. NULL when the file is unreadable. */
char *tera_metrics_summary(const char *metrics_path);

#endif
