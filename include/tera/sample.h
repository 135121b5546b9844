/* Samples while training: logging.sample_every / sample_prompt / sample_tokens (src/train/sample.c). */
#ifndef TERA_SAMPLE_H
#define TERA_SAMPLE_H

#include "tera/train.h"

/* Called once after every step (tera_trainer_run): every logging.sample_every steps, a greedy
 * continuation of logging.sample_prompt on stderr and as {"step", "sample"} in metrics.jsonl.
 * Several ranks or sharded parameters: a one-time note, no sample. Never fails the run. */
tera_status tera_sample_hook(tera_trainer *tr);

#endif
