/* Elastic training, the rank side (src/elastic/): heartbeats for the supervisor (`tera launch`,
 * src/cli/cmd_launch.c), the wall-clock checkpoint cadence (checkpoint.every_s, full_every_s) and
 * the rollback after training.nan_rollback_after consecutive non-finite steps (docs/ELASTIC.md). */
#ifndef TERA_ELASTIC_H
#define TERA_ELASTIC_H

#include <stdint.h>

#include "tera/status.h"
#include "tera/train.h"

/* ------------------------------------------------------------------ heartbeats
 * With TERA_HEARTBEAT_DIR set (tera launch sets it), every rank keeps DIR/rank-N: two fixed-size
 * text records rewritten in place with pwrite (no allocation): at offset 0 the progress record
 * "tera-hb 1 rank R step S state STATE wall W pid P host H" (written by the step loop: state
 * ready = restored and about to train, step = a step completed, done = finished), at offset
 * TERA_HB_RECORD the liveness record "alive W" (rewritten every TERA_HB_ALIVE_S by a thread, so a
 * stopped process is told from one blocked in a collective). W: wall-clock seconds (CLOCK_REALTIME). */
#define TERA_HB_RECORD 128
#define TERA_HB_ALIVE_S 0.5

/* One progress record; the first call opens the file and starts the liveness thread. No-op
 * without TERA_HEARTBEAT_DIR; a failure to write is reported once and never stops training. */
void tera_heartbeat_beat(int world_rank, int64_t step, const char *state);

typedef struct {
    int ok;                     /* both records parsed */
    int rank;
    int64_t step;
    char state[16];
    double wall, alive;         /* the progress record's and the liveness record's times */
    long pid;
    char host[64];
} tera_heartbeat_rec;
/* Reads DIR/rank-N (0: read and parsed; -1: absent or incomplete). */
int tera_heartbeat_read(const char *dir, int rank, tera_heartbeat_rec *out);

/* ------------------------------------------------------------------ trainer hooks */
/* The wall-clock cadence: 0 = no save due by the clock, 1 = a save (differential when
 * checkpoint.full_every allows), 2 = a full save (checkpoint.full_every_s elapsed). Rank 0's clock
 * decides for every rank (a one-integer all-reduce per step, only while a wall-clock key is set). */
int tera_elastic_ckpt_due(tera_trainer *tr);
/* After a save: restarts the clocks (the full one when the save was full). */
void tera_elastic_ckpt_saved(tera_trainer *tr);
/* After a step: counts consecutive non-finite steps; at training.nan_rollback_after of them, rolls
 * back to the newest committed checkpoint (tera_trainer_resume), skips the data of those steps and
 * lowers the LR as the loss-spike guard does (spike_lr_factor for spike_lr_steps); logged on stderr
 * and as a "nan_rollback" event in metrics.jsonl. A single non-finite step is only skipped. */
tera_status tera_elastic_after_step(tera_trainer *tr, const tera_step_result *r);
/* The NaN fault hook (TERA_FAULT_NAN_STEP=S[:N][@R]): 1 when this step's gradient is to be poisoned.
 * "S": step S whenever it runs; "S:N": steps S .. S+N-1, once each (a transient fault: a replay after
 * a rollback runs clean). */
int tera_elastic_fault_nan(tera_trainer *tr);

#endif
