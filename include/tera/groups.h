/* The communicators of a parallel layout (src/parallel/groups.c): one per group of the topology
 * (include/tera/topology.h) that this rank belongs to, created and freed together. A group that is
 * the whole world is the world communicator itself; a group of one rank that no code sums over is
 * NULL (noted per member). */
#ifndef TERA_GROUPS_H
#define TERA_GROUPS_H

#include "tera/comm.h"
#include "tera/status.h"
#include "tera/topology.h"

typedef struct {
    struct tera_comm *dp;  /* data-parallel: the ranks of one pipeline stage with this tp_rank (size dp,
                              rank dp_rank; always set) */
    struct tera_comm *ep;  /* expert-parallel: the ep ranks that split the routed experts (NULL when ep = 1) */
    struct tera_comm *edp; /* expert-data-parallel: the dp / ep ranks holding the same experts (dp when ep = 1) */
    struct tera_comm *tp;  /* tensor-parallel: the tp ranks of one (pp_rank, dp_rank) (NULL when tp = 1) */
    struct tera_comm *mp;  /* model-parallel: the ep x tp x pp ranks of one edp_rank, together one copy of the
                              model; rank (pp_rank * ep + ep_rank) * tp + tp_rank (NULL when all are 1) */
    struct tera_comm *pp;  /* pipeline: the stages of one pipeline (NULL when pp = 1) */
    struct tera_comm *sg;  /* statistics: data-parallel x stages, whose loss sums add up (dp when tp = pp = 1) */
    struct tera_comm *ends; /* parallel.pp_head_split: the first and the last stage of one pipeline (first: rank 0;
                               tera_groups_ends), NULL on the other stages and without it */
} tera_groups;

/* The communicator of t's group along `axis` holding this rank (the world itself when the group is
 * the whole world); collective over the world. */
struct tera_comm *tera_groups_axis(const tera_topology *t, tera_axis axis);
/* Places the ranks on nodes (parallel.ranks_per_node; 0: the hosts; recorded in t) and creates every
 * group; collective over the world (every rank makes the same calls). On failure nothing is left
 * allocated. */
tera_status tera_groups_create(tera_groups *g, tera_topology *t, int ranks_per_node);
/* Collective over the world (pp > 1): g->ends, the pair of the first and the last stage of this rank's
 * pipeline, on the ranks of those stages (NULL on the others). */
void tera_groups_ends(tera_groups *g, const tera_topology *t);
void tera_groups_free(tera_groups *g);

#endif
