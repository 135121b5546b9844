/* MoE routing internals shared by the model's forward and backward (private to src/model). */
#ifndef TERA_MODEL_MOE_H
#define TERA_MODEL_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "tera/config.h"

/* Top-k per token by score = probs + bias (bias may be NULL); ties keep the lower expert index.
 * Any E and k <= E; O(N E k) at worst, no memory beyond the outputs.
 * probs: [N, E]  topi: [N, k]  topw: [N, k] (chosen probs renormalised to sum 1). */
void tera_moe_topk(int32_t *topi, float *topw, const float *probs, const float *bias, int64_t N, int E,
                   int k);

/* Builds the grouped layout of one micro-batch of B sequences of T tokens.
 * topi: [N, k]; probs: [N, E] (for the probability drop policy); capacity: per sequence and
 * expert (<= 0: dropless). Outputs:
 *   slot_row [N*k]: row of assignment a = t*k + j in the grouped buffers, or -1 when dropped
 *   row_tok  [N*k]: token of each row (rows ordered by expert, then by assignment index)
 *   exp_off  [E+1]: rows of expert e are [exp_off[e], exp_off[e+1])
 *   sel_count [B, E]: assignments of each sequence selected for each expert, before drops
 *   scratch: tera_moe_plan_scratch_bytes(N*k, B, E) bytes. Returns the number of dropped assignments. */
size_t tera_moe_plan_scratch_bytes(int64_t n_assign, int B, int E);
int64_t tera_moe_plan(int32_t *slot_row, int32_t *row_tok, int32_t *exp_off, int32_t *sel_count,
                      void *scratch, const int32_t *topi, const float *probs, int B, int T, int E,
                      int k, int capacity, tera_drop_policy policy);

#endif
