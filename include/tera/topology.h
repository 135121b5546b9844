/* The parallel topology of a run: world ranks <-> coordinates (pp, dp, tp; dp split into edp x ep)
 * and the process groups along each axis, validated once. Pure arithmetic: no communicator, no
 * MPI, so every rule is unit-tested without launching ranks (tests/test_topology.c); the trainer
 * turns each group into a communicator with tera_comm_split(world, color, key).
 *
 * world rank = (pp_rank * dp + dp_rank) * tp + tp_rank   (tp varies fastest, pp slowest)
 * dp_rank    = edp_rank * ep + ep_rank                    (consecutive ep ranks split the experts)
 *
 * Groups (the ranks sharing every coordinate but the group's own):
 *   TERA_AXIS_TP    tp ranks of one (pp_rank, dp_rank): split each tensor (Megatron)
 *   TERA_AXIS_DP    dp ranks of one (pp_rank, tp_rank): read different samples, sum gradients
 *   TERA_AXIS_PP    pp ranks of one (dp_rank, tp_rank): one pipeline, a stage each
 *   TERA_AXIS_EP    ep ranks of one (pp_rank, tp_rank, edp_rank): split the routed experts
 *   TERA_AXIS_EDP   edp ranks of one (pp_rank, tp_rank, ep_rank): hold the same experts, sum their gradients
 *   TERA_AXIS_MP    pp * ep * tp ranks of one edp_rank: together one whole copy of the model;
 *                   index (member) = (pp_rank * ep + ep_rank) * tp + tp_rank
 *   TERA_AXIS_STATS pp * dp ranks of one tp_rank: the ranks whose loss sums and expert loads add up
 *   TERA_AXIS_STAGE dp * tp ranks of one pp_rank: one pipeline stage */
#ifndef TERA_TOPOLOGY_H
#define TERA_TOPOLOGY_H

#include "tera/status.h"

typedef enum {
    TERA_AXIS_TP,
    TERA_AXIS_DP,
    TERA_AXIS_PP,
    TERA_AXIS_EP,
    TERA_AXIS_EDP,
    TERA_AXIS_MP,
    TERA_AXIS_STATS,
    TERA_AXIS_STAGE,
    TERA_AXIS_COUNT
} tera_axis;

typedef struct {
    int world, rank;                                  /* world size, this process's world rank */
    int pp, dp, tp, ep, edp;                          /* degrees: world = pp dp tp, dp = edp ep */
    int pp_rank, dp_rank, tp_rank, ep_rank, edp_rank; /* this rank's coordinates */
    /* nodes (tera_topology_set_nodes; 1 node until then): how many, this rank's, and whether every
     * tensor-parallel (expert-parallel) group sits inside one node, as the rank order intends (tp
     * varies fastest, then ep: a node of a multiple of tp (tp x ep) ranks holds whole groups) */
    int nodes, node, tp_in_node, ep_in_node;
} tera_topology;

/* Checks the degrees against the world size (each >= 1, pp dp tp = world, ep divides dp) and sets
 * this rank's coordinates. Errors name the keys (parallel.*) and the launch that would fit. */
tera_status tera_topology_init(tera_topology *t, int world, int rank, int pp, int dp, int tp, int ep);
/* The same topology seen from another world rank. */
tera_topology tera_topology_at(const tera_topology *t, int world_rank);
/* The world rank at coordinates (pp_rank, dp_rank, tp_rank). */
int tera_topology_rank_of(const tera_topology *t, int pp_rank, int dp_rank, int tp_rank);
/* The group of `axis` that holds this rank: its size, this rank's index in it, and a (color, key)
 * pair for a split of the world (equal colors: one group; keys order it, key = index). */
int tera_topology_size(const tera_topology *t, tera_axis axis);
int tera_topology_index(const tera_topology *t, tera_axis axis);
void tera_topology_split_keys(const tera_topology *t, tera_axis axis, int *color, int *key);
/* Places the world's ranks on nodes: node_of[w] (0 .. nodes-1) for every world rank w. */
void tera_topology_set_nodes(tera_topology *t, const int *node_of);
/* One line describing the layout (printed at start by multi-rank runs). */
const char *tera_topology_describe(const tera_topology *t, char *buf, int size);

#endif
