/* The communicators of a parallel layout (include/tera/groups.h). */
#include <stdlib.h>
#include <string.h>

#include "tera/groups.h"

tera_comm *tera_groups_axis(const tera_topology *t, tera_axis axis) {
    tera_comm *world = tera_comm_world();
    if (tera_topology_size(t, axis) == t->world) return world;
    int color, key;
    tera_topology_split_keys(t, axis, &color, &key);
    return tera_comm_split(world, color, key); /* collective over the world */
}

tera_status tera_groups_create(tera_groups *g, tera_topology *t, int ranks_per_node) {
    memset(g, 0, sizeof *g);
    g->dp = tera_groups_axis(t, TERA_AXIS_DP);
    if (t->pp > 1) g->pp = tera_groups_axis(t, TERA_AXIS_PP);
    if (t->tp > 1) g->tp = tera_groups_axis(t, TERA_AXIS_TP);
    /* the data-parallel group's order is the topology's (its split keys are the dp ranks) */
    TERA_ASSERTF(tera_comm_rank(g->dp) == t->dp_rank && tera_comm_size(g->dp) == t->dp,
                 "data-parallel group: rank %d of %d, topology dp_rank %d of %d", tera_comm_rank(g->dp),
                 tera_comm_size(g->dp), t->dp_rank, t->dp);
    /* statistics (losses, expert loads) are summed over the data-parallel ranks of every stage */
    g->sg = t->tp > 1 || t->pp > 1 ? tera_groups_axis(t, TERA_AXIS_STATS) : g->dp;
    g->edp = g->dp;
    /* nodes: collective over the world, the same on every rank */
    tera_status st = tera_comm_set_nodes(ranks_per_node);
    if (st != TERA_OK) {
        tera_groups_free(g);
        return st;
    }
    int *node_of = tera_calloc((size_t)t->world, sizeof(int));
    for (int w = 0; w < t->world; w++) node_of[w] = tera_comm_node_of(w);
    tera_topology_set_nodes(t, node_of);
    free(node_of);
    if (t->ep > 1) { /* validated by tera_topology_init (ep divides dp) */
        g->ep = tera_groups_axis(t, TERA_AXIS_EP);
        g->edp = tera_groups_axis(t, TERA_AXIS_EDP);
    }
    if (t->ep * t->tp * t->pp > 1) {
        g->mp = tera_groups_axis(t, TERA_AXIS_MP);
        TERA_ASSERT(tera_comm_rank(g->mp) == (t->pp_rank * t->ep + t->ep_rank) * t->tp + t->tp_rank);
    }
    return TERA_OK;
}

void tera_groups_ends(tera_groups *g, const tera_topology *t) {
    TERA_ASSERTF(t->pp > 1, "the first and last pipeline stages of %d", t->pp);
    const int end = t->pp_rank == 0 || t->pp_rank == t->pp - 1;
    /* one group per pipeline (its dp and tp coordinates); a middle stage's rank alone, freed at once */
    tera_comm *c = tera_comm_split(tera_comm_world(), end ? t->dp_rank * t->tp + t->tp_rank : t->world + t->rank,
                                   t->pp_rank);
    if (end) {
        g->ends = c;
    } else {
        tera_comm_free(c);
    }
}

void tera_groups_free(tera_groups *g) {
    tera_comm *world = tera_comm_world(); /* a group spanning the world is the world itself */
    if (g->ends && g->ends != world) tera_comm_free(g->ends);
    if (g->ep && g->ep != world) tera_comm_free(g->ep);
    if (g->edp && g->edp != g->dp && g->edp != world) tera_comm_free(g->edp);
    if (g->mp && g->mp != world) tera_comm_free(g->mp);
    if (g->tp && g->tp != world) tera_comm_free(g->tp);
    if (g->pp && g->pp != world) tera_comm_free(g->pp);
    if (g->sg && g->sg != g->dp && g->sg != world) tera_comm_free(g->sg);
    if (g->dp && g->dp != world) tera_comm_free(g->dp);
    memset(g, 0, sizeof *g);
}
