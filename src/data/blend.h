/* Blends (data.paths): the loader's calls into src/data/blend.c (private to src/data). */
#ifndef TERA_DATA_BLEND_H
#define TERA_DATA_BLEND_H

#include "tera/data.h"

/* Initialises every dataset's loader (its own split, epochs and shuffle) and sets l's totals. */
tera_status tera_blend_loader_init(tera_loader *l, struct tera_blend *b, int T, float val_fraction, int shuffle,
                                   uint64_t seed);
/* The first dataset's source (tera_source_open shows it as the blend's own). */
const tera_token_source *tera_blend_first_source(const struct tera_blend *b);
/* Global training / validation sample g of the blend. inputs, targets: [T] */
void tera_blend_train_sample(const struct tera_blend *b, int64_t g, int32_t *inputs, int32_t *targets);
void tera_blend_val_sample(const struct tera_blend *b, int64_t v, int32_t *inputs, int32_t *targets);

#endif
