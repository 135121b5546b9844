/* The trainer's elastic hooks (include/tera/elastic.h): the wall-clock checkpoint cadence, the
 * rollback after consecutive non-finite steps, the NaN fault hook. */
#include <math.h>
#include <stdio.h>

#include "tera/ckpt.h"
#include "tera/comm.h"
#include "tera/elastic.h"
#include "tera/guard.h"
#include "tera/profile.h"

int tera_elastic_ckpt_due(tera_trainer *tr) {
    const tera_ckpt_config *c = &tr->cfg.checkpoint;
    if (!tr->run_dir[0] || (c->every_s <= 0 && c->full_every_s <= 0)) return 0;
    const double now = tera_now();
    if (tr->elastic.ckpt_wall_last <= 0) { /* the clocks start at the first step this process runs */
        tr->elastic.ckpt_wall_last = tr->elastic.ckpt_wall_full = now;
        tr->elastic.ckpt_full_seen = tera_ckpt_last_stats().full_saves;
    }
    int64_t due = 0;
    if (tr->root) {
        if (c->full_every_s > 0 && now - tr->elastic.ckpt_wall_full >= c->full_every_s) due = 2;
        else if (c->every_s > 0 && now - tr->elastic.ckpt_wall_last >= c->every_s) due = 1;
    }
    /* rank 0's decision for every rank (the others add 0): their clocks may disagree by a step */
    if (tr->topo.world > 1) tera_comm_allreduce_i64(tera_comm_world(), &due, 1);
    return (int)due;
}

void tera_elastic_ckpt_saved(tera_trainer *tr) {
    const tera_ckpt_config *c = &tr->cfg.checkpoint;
    tr->ckpt.force_full = 0;
    if (c->every_s <= 0 && c->full_every_s <= 0) return;
    const double now = tera_now();
    const int full = tera_ckpt_last_stats().full_saves;
    tr->elastic.ckpt_wall_last = now;
    if (full != tr->elastic.ckpt_full_seen) tr->elastic.ckpt_wall_full = now; /* this save was full (by any rule) */
    tr->elastic.ckpt_full_seen = full;
}

tera_status tera_elastic_after_step(tera_trainer *tr, const tera_step_result *r) {
    const tera_train_config *t = &tr->cfg.training;
    if (!r->skipped || r->spike) { /* a healthy step (or a spike, which its guard handled) */
        tr->elastic.nonfinite_run = 0;
        return TERA_OK;
    }
    if (tr->elastic.nonfinite_run++ == 0) tr->elastic.nonfinite_lo = tr->samples_consumed - r->batch_seqs; /* its first batch */
    const int N = t->nan_rollback_after;
    if (N <= 0 || tr->elastic.nonfinite_run < N) return TERA_OK;
    const int64_t lo = tr->elastic.nonfinite_lo, hi = tr->samples_consumed, first = r->step - N + 1;
    tr->elastic.nonfinite_run = 0;
    tr->elastic.nan_rollbacks++;
    /* roll back unless the same steps keep failing after rollbacks (then go on skipping) */
    tr->elastic.nan_repeats = first == tr->elastic.nan_last_step ? tr->elastic.nan_repeats + 1 : 0;
    tr->elastic.nan_last_step = first;
    int64_t back = -1;
    if (tr->run_dir[0] && tr->elastic.nan_repeats < 3) {
        tera_trainer_ckpt_close(tr); /* a checkpoint still being written is the one to roll back to */
        const int64_t consumed = tr->samples_consumed, step = tr->step;
        if (tera_trainer_resume(tr) == TERA_OK) {
            back = tr->step;
            if (tr->samples_consumed <= lo) tera_spike_add_skip(&tr->spike, lo, hi); /* the replay skips them */
        } else {
            tr->samples_consumed = consumed, tr->step = step;
        }
    }
    /* the LR cut: the replayed steps, then spike_lr_steps steps from the first failed step on */
    const int64_t cut = (back < 0 ? r->step + 1 : first) + t->spike_lr_steps;
    tera_spike_cut(&tr->spike, cut);
    if (tr->root) {
        fprintf(stderr,
                "tera: %d consecutive non-finite steps (%ld .. %ld): %s, samples [%ld, %ld) skipped, LR x %.2g until "
                "step %ld\n", N, (long)first, (long)r->step,
                back >= 0 ? "rolled back to the newest checkpoint" : "no checkpoint to roll back to",
                (long)lo, (long)hi, t->spike_lr_factor, (long)tr->spike.lr_cut_until);
        if (back >= 0) fprintf(stderr, "tera: resuming at step %ld\n", (long)back);
        if (tr->log.metrics) {
            fprintf(tr->log.metrics,
                    "{\"step\": %ld, \"event\": \"nan_rollback\", \"nonfinite_steps\": %d, \"rolled_back_to\": %ld, "
                    "\"skipped_samples\": [%ld, %ld], \"lr_factor\": %.4g, \"lr_cut_until\": %ld}\n",
                    (long)first, N, (long)back, (long)lo, (long)hi, t->spike_lr_factor, (long)tr->spike.lr_cut_until);
            fflush(tr->log.metrics);
        }
    }
    return TERA_OK;
}

int tera_elastic_fault_nan(tera_trainer *tr) {
    if (tr->faults.nan_n > 0 && tr->faults.nan_step >= 0) { /* "S:N", at the first step: the range [S, S+N) */
        tr->faults.nan_done = tr->faults.nan_step;        /* the next step to fire */
        tr->faults.nan_n = -(tr->faults.nan_step + tr->faults.nan_n); /* negative: the range's end */
        tr->faults.nan_step = -1;
    }
    if (tr->faults.nan_n < 0) {
        if (tr->step < tr->faults.nan_done || tr->step >= -tr->faults.nan_n) return 0;
        tr->faults.nan_done = tr->step + 1; /* once: a replay after a rollback runs clean */
        tr->faults.nan_step = tr->step;     /* ZeRO-2/3 poison in their reduce path (src/train/layout.c) */
        return 1;
    }
    return tr->faults.nan_step >= 0 && tr->step == tr->faults.nan_step;
}
