/* Shared by src/parallel/plan_*.c (tera plan), private to them. */
#ifndef TERA_PLAN_INTERNAL_H
#define TERA_PLAN_INTERNAL_H

#include "tera/plan.h"

/* What one rank's parameter table gives (tera_param_table_spec; group spans as tera_model_group_range). */
typedef struct {
    int64_t n_floats, n_dense;
    int n_params;
    int64_t stage[3][2]; /* ZeRO staging slot sizes (zero23_init): embedding, head, layer x (non-expert, expert) */
    int64_t *group;      /* [2 (L + 2)]: group g's range sizes, index 2 (g + 2) + x (x = 1: experts) */
} tera_plan_table;

/* Tables by (tp, ep, pp, chunks, pp_rank, pp_layers): the search builds each once. */
typedef struct tera_plan_cache tera_plan_cache;
tera_plan_cache *tera_plan_cache_new(void);
void tera_plan_cache_free(tera_plan_cache *c);

/* One pipeline stage of a layout (its dp rank 0, tp rank 0). */
typedef struct {
    tera_plan_mem mem;
    int layers, moe_layers;                  /* layers held, of them MoE */
    int full[2], selective[2];               /* of them recomputed fully / selectively: [dense, MoE] */
    int64_t n_floats, n_dense;
    int n_params;
    const int64_t *group; /* the cached table's group sizes (NULL without a cache) */
    int sends;            /* activation sends per micro-batch, each way (pp_bytes of bench-dist) */
} tera_plan_stage;

/* st[pp]; bubble and makespan of the schedule in units of the stage's forward per micro-batch
 * (backward = 2 x forward; 3 m without a pipeline). */
tera_status tera_plan_stages(const tera_config *cfg, tera_plan_cache *cache, int threads, tera_plan_stage *st,
                             double *bubble, double *makespan);

/* The time model over the stages tera_plan_stages gave. */
tera_status tera_plan_time_model_stages(const tera_config *cfg, const tera_hw *hw, const tera_plan_opts *o,
                                        const tera_plan_stage *st, double makespan, double bubble,
                                        tera_plan_time *out);

#endif
