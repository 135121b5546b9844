/* TensorBoard event files (src/obs/tensorboard.c, docs/MONITORING.md): with logging.tensorboard =
 * DIR, world rank 0 writes DIR/events.out.tfevents.<unix time>.<host>.<pid>: TFRecord framing
 * (length, masked CRC32C of the length, data, masked CRC32C of the data) around Event protobufs
 * encoded here. After each step: one scalar per metrics.jsonl figure (tags are its keys: loss,
 * ce_loss, ..., grad_norm_by_group/<group>, router_entropy/layer_<l>, expert_load_max_over_mean/
 * layer_<l>, hw/... when hardware readings exist) and a histogram of each MoE layer's expert load
 * (expert_load/layer_<l>: value = expert index, weight = its assignments); after an evaluation,
 * val_loss. Every record is built in a buffer sized at start: the step loop allocates nothing. */
#ifndef TERA_TENSORBOARD_H
#define TERA_TENSORBOARD_H

#include <stddef.h>
#include <stdint.h>

#include "tera/status.h"
#include "tera/train.h"

typedef struct tera_tensorboard tera_tensorboard;

/* Creates DIR (and parents) and the event file; "" leaves *out NULL. Errors name the key and path. */
tera_status tera_tensorboard_open(tera_tensorboard **out, const char *dir, const tera_trainer *tr);
/* The step's figures (the values metrics.jsonl logs for it). NULL tb: no-op. */
void tera_tensorboard_step(tera_tensorboard *tb, const tera_trainer *tr, const tera_step_result *r);
/* The validation loss after step `step` (0-based). */
void tera_tensorboard_eval(tera_tensorboard *tb, int64_t step, double val_loss);
/* Flushes and closes; returns an I/O error once (naming the file) if any write failed. NULL: OK. */
tera_status tera_tensorboard_close(tera_tensorboard *tb);

/* Exposed for tests: CRC32C (Castagnoli) of n bytes, and the TFRecord mask of it. */
uint32_t tera_crc32c(const void *data, size_t n);
uint32_t tera_crc32c_masked(const void *data, size_t n);

#endif
