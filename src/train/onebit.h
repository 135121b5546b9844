/* 1-bit Adam (optimizer.name = onebit_adam; Tang et al. 2021), src/train/onebit.c; and the per-rank
 * communication state of a checkpoint (1-bit Adam's error feedback and parallel.grad_compression's).
 * docs/COMMUNICATION.md has the algorithm, its formulas and the figures.
 *
 * Steps [0, optimizer.onebit_warmup_steps): AdamW exactly as with optimizer.name = adamw (fp32
 * gradient sums). At the end of the last warm-up step the variance v is frozen (with its bias
 * correction 1 - beta2^t at that step). From then on the gradients are not summed: every rank
 * updates its own momentum with its own gradient, m = beta1 m + (1 - beta1) q g_r (q: the ranks
 * sharing the region: dp for the non-expert region, edp for the experts; q g_r is the rank's
 * estimate of the gradient), and m is averaged over those q ranks by a 1-bit compressed all-reduce
 * with error feedback on both sides (include/tera/compress.h, TERA_COMPRESS_ONEBIT; every rank gets
 * the same bits); the parameters of this rank's optimizer range (ZeRO-1: its shard) take
 * w = w (1 - lr wd) - lr / (1 - beta1^t) m / (sqrt(v / (1 - beta2^t_freeze)) + eps).
 * ZeRO-2/3 (no whole gradient buffer): after the freeze the rank's own gradient accumulates whole in
 * a buffer of this module's (tera_zero_local_grads: no reduce-scatter), the update takes this rank's
 * shard (ZeRO-3: of the parameters too), then the shards' parameters are shared as with AdamW
 * (tera_zero_params_updated). Memory per rank: a whole momentum (ZeRO-1/2/3) and a whole gradient
 * (ZeRO-2/3) besides the error feedback, printed at start-up. */
#ifndef TERA_TRAIN_ONEBIT_H
#define TERA_TRAIN_ONEBIT_H

#include "tera/train.h"

typedef struct tera_onebit tera_onebit;

/* After tera_zero_create (collective over the groups when on): tr->onebit, NULL when
 * optimizer.name = adamw. */
tera_status tera_onebit_init(tera_trainer *tr);
void tera_onebit_free(tera_trainer *tr);
/* 1 once the variance is frozen: the step's gradients are not summed over the data-parallel ranks. */
int tera_onebit_frozen(const tera_trainer *tr);
/* Frozen: the squared gradient norm as the trainer uses it (clipping, the finite check, metrics):
 * sum over tensors of the mean over the q ranks of |q g_r|^2 (per tensor in tr->sharding->grad_sq), collective
 * over the world; a non-finite gradient on any rank makes it non-finite everywhere. */
double tera_onebit_grad_sq(tera_trainer *tr);
/* The optimizer step (replaces tera_zero_adamw_step when on); sums as tera_zero_adamw_step's. */
void tera_onebit_step(tera_trainer *tr, float lr, float grad_scale, double *sums);

/* Per-rank communication state of a checkpoint of step tr->step: RUN/checkpoints/comm_state/
 * step_NNNNNNNN/rank-RRRRR.bin (world rank R) holds 1-bit Adam's frozen flag, its step count at the
 * freeze and the error-feedback residuals of both sides, and parallel.grad_compression's residuals.
 * Written (collective: every rank learns whether all could) before the checkpoint itself when 1-bit
 * Adam or a lossy grad_compression is on; a no-op otherwise. */
tera_status tera_comm_state_save(tera_trainer *tr);
/* After a save of step tr->step returned: removes this rank's files of older steps whose checkpoint
 * retention removed, those below the newest committed checkpoint only (a save in the background may
 * not have created its directory yet). Not collective; a no-op where tera_comm_state_save is one. */
void tera_comm_state_prune(tera_trainer *tr);
/* After a checkpoint of step tr->step was restored (collective): reads this rank's file. Missing or
 * from another layout: an error for 1-bit Adam past its warm-up (its state cannot be rebuilt), a
 * warning and zero residuals for grad_compression (as before the file existed). */
tera_status tera_comm_state_load(tera_trainer *tr);

#endif
