/* The loss-spike guard (src/train/spike_guard.c): z-scores of a step's loss and grad norm against a
 * window of recent healthy steps, the data windows that caused spikes (skipped on replay), the LR
 * cut after a spike, and its state in checkpoints (state.json "spike_guard"). The trainer decides
 * what a spike does (drop the update, roll back); the guard owns what it remembers. */
#ifndef TERA_GUARD_H
#define TERA_GUARD_H

#include <stdint.h>

#include "tera/config.h"
#include "tera/status.h"

struct cJSON;

#define TERA_SPIKE_MAX_SKIPS 64

typedef struct {
    int window;                 /* W: healthy steps the z-scores are taken against (0: guard off) */
    double zscore, grad_zscore; /* thresholds on the loss's and the grad norm's z-score */
    double *hist;               /* [2W + 1]: recent losses, then grad norms (rings), then the last z */
    int n, pos;                 /* entries in the rings, next slot */
    int64_t lr_cut_until;       /* steps before this one run at spike_lr_factor x LR */
    int64_t skip_lo[TERA_SPIKE_MAX_SKIPS], skip_hi[TERA_SPIKE_MAX_SKIPS]; /* sample windows [lo, hi) to jump over,
                                                                            increasing */
    int n_skips;
    int64_t last_spike_step;    /* to stop rolling back when the same step keeps spiking */
    int repeats;                /* consecutive spikes at last_spike_step */
    int64_t events;             /* spikes handled so far */
} tera_spike_guard;

void tera_spike_init(tera_spike_guard *g, const tera_train_config *t);
void tera_spike_free(tera_spike_guard *g);
/* 1 when (loss, grad_norm) is a spike against the window (never before the window is full);
 * healthy steps enter the window. Call with finite values only. */
int tera_spike_check(tera_spike_guard *g, double loss, double grad_norm);
/* The larger z-score of the last full-window check (for the event record). */
double tera_spike_last_z(const tera_spike_guard *g);
/* The first sample at or after `start` where a batch of `seqs` samples touches no skipped window. */
int64_t tera_spike_next_clean(const tera_spike_guard *g, int64_t start, int64_t seqs);
/* A spike at `step`: counts it and tells whether rolling back is still sensible (1: the same step
 * has not kept spiking on fresh data and the table of skipped windows has room). */
int tera_spike_event(tera_spike_guard *g, int64_t step);
/* Remembers [lo, hi) as a window to skip (kept in increasing order; duplicates ignored). */
void tera_spike_add_skip(tera_spike_guard *g, int64_t lo, int64_t hi);
/* LR cut until `until` (the later of it and the current one); the window refills from healthy steps. */
void tera_spike_cut(tera_spike_guard *g, int64_t until);
/* state.json: adds "spike_guard" to root. */
void tera_spike_save(const tera_spike_guard *g, struct cJSON *root);
/* Restores "spike_guard" of root (absent: unchanged). Knowledge newer than the checkpoint (a rollback
 * in this process) is kept: skip windows are merged, the LR cut and the event count take the later
 * value; the window of recent steps is restored when its length matches. path names the file in errors. */
tera_status tera_spike_load(tera_spike_guard *g, const struct cJSON *root, const char *path);

#endif
