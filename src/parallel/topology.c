/* The parallel topology: ranks <-> coordinates <-> groups (include/tera/topology.h). */
#include <stdio.h>
#include <string.h>

#include "tera/topology.h"

tera_status tera_topology_init(tera_topology *t, int world, int rank, int pp, int dp, int tp, int ep) {
    *t = (tera_topology){.world = world, .rank = rank, .pp = pp, .dp = dp, .tp = tp, .ep = ep};
    if (pp < 1 || dp < 1 || tp < 1 || ep < 1)
        return tera_fail(TERA_ERR_CONFIG, "parallel.pp, parallel.dp, parallel.tp and parallel.ep must be at least 1 "
                         "(they are %d, %d, %d, %d)", pp, dp, tp, ep);
    const long want = (long)pp * dp * tp;
    const char *verb = world == 1 ? "is" : "are";
    if (pp > 1 && want != world)
        return tera_fail(TERA_ERR_CONFIG,
                         "parallel.pp x parallel.dp x parallel.tp = %d x %d x %d = %ld ranks, but %d %s running (launch "
                         "with mpirun -np %ld)", pp, dp, tp, want, world, verb, want);
    if (want != world) {
        if (tp == 1)
            return tera_fail(TERA_ERR_CONFIG,
                             "parallel.dp = %d but %d rank%s running (launch with mpirun -np %d, or set parallel.dp = %d)",
                             dp, world, world == 1 ? " is" : "s are", dp, world);
        return tera_fail(TERA_ERR_CONFIG, "parallel.dp x parallel.tp = %d x %d = %ld ranks, but %d %s running (launch "
                         "with mpirun -np %ld)", dp, tp, want, world, verb, want);
    }
    if (dp % ep != 0)
        return tera_fail(TERA_ERR_CONFIG, "parallel.ep (%d) must divide parallel.dp (%d): expert-parallel ranks are "
                         "data-parallel ranks that split the experts among themselves", ep, dp);
    if (rank < 0 || rank >= world) return tera_fail(TERA_ERR_CONFIG, "rank %d outside a world of %d", rank, world);
    t->edp = dp / ep;
    t->nodes = 1, t->tp_in_node = t->ep_in_node = 1;
    *t = tera_topology_at(t, rank);
    return TERA_OK;
}

tera_topology tera_topology_at(const tera_topology *t, int world_rank) {
    tera_topology o = *t;
    o.rank = world_rank;
    o.tp_rank = world_rank % t->tp;
    o.dp_rank = world_rank / t->tp % t->dp;
    o.pp_rank = world_rank / (t->tp * t->dp);
    o.ep_rank = o.dp_rank % t->ep;
    o.edp_rank = o.dp_rank / t->ep;
    return o;
}

int tera_topology_rank_of(const tera_topology *t, int pp_rank, int dp_rank, int tp_rank) {
    return (pp_rank * t->dp + dp_rank) * t->tp + tp_rank;
}

int tera_topology_size(const tera_topology *t, tera_axis axis) {
    switch (axis) {
    case TERA_AXIS_TP: return t->tp;
    case TERA_AXIS_DP: return t->dp;
    case TERA_AXIS_PP: return t->pp;
    case TERA_AXIS_EP: return t->ep;
    case TERA_AXIS_EDP: return t->edp;
    case TERA_AXIS_MP: return t->pp * t->ep * t->tp;
    case TERA_AXIS_STATS: return t->pp * t->dp;
    case TERA_AXIS_STAGE: return t->dp * t->tp;
    case TERA_AXIS_COUNT: break;
    }
    return 0;
}

void tera_topology_split_keys(const tera_topology *t, tera_axis axis, int *color, int *key) {
    int c = 0, k = 0;
    switch (axis) {
    case TERA_AXIS_TP: c = t->pp_rank * t->dp + t->dp_rank, k = t->tp_rank; break;
    case TERA_AXIS_DP: c = t->pp_rank * t->tp + t->tp_rank, k = t->dp_rank; break;
    case TERA_AXIS_PP: c = t->dp_rank * t->tp + t->tp_rank, k = t->pp_rank; break;
    case TERA_AXIS_EP: c = (t->pp_rank * t->tp + t->tp_rank) * t->edp + t->edp_rank, k = t->ep_rank; break;
    case TERA_AXIS_EDP: c = (t->pp_rank * t->tp + t->tp_rank) * t->ep + t->ep_rank, k = t->edp_rank; break;
    case TERA_AXIS_MP: c = t->edp_rank, k = (t->pp_rank * t->ep + t->ep_rank) * t->tp + t->tp_rank; break;
    case TERA_AXIS_STATS: c = t->tp_rank, k = t->pp_rank * t->dp + t->dp_rank; break;
    case TERA_AXIS_STAGE: c = t->pp_rank, k = t->dp_rank * t->tp + t->tp_rank; break;
    case TERA_AXIS_COUNT: break;
    }
    if (color) *color = c;
    if (key) *key = k;
}

int tera_topology_index(const tera_topology *t, tera_axis axis) {
    int k;
    tera_topology_split_keys(t, axis, NULL, &k);
    return k;
}

void tera_topology_set_nodes(tera_topology *t, const int *node_of) {
    int n = 0;
    t->tp_in_node = t->ep_in_node = 1;
    for (int w = 0; w < t->world; w++) {
        const tera_topology o = tera_topology_at(t, w);
        if (node_of[w] + 1 > n) n = node_of[w] + 1;
        if (node_of[w] != node_of[tera_topology_rank_of(t, o.pp_rank, o.dp_rank, 0)]) t->tp_in_node = 0;
        if (node_of[w] != node_of[tera_topology_rank_of(t, o.pp_rank, o.edp_rank * t->ep, o.tp_rank)]) t->ep_in_node = 0;
    }
    t->nodes = n;
    t->node = node_of[t->rank];
}

const char *tera_topology_describe(const tera_topology *t, char *buf, int size) {
    snprintf(buf, (size_t)size,
             "%d ranks = pp %d x dp %d x tp %d, dp %d = edp %d x ep %d; world rank = (pp_rank * dp + dp_rank) * tp + "
             "tp_rank, dp_rank = edp_rank * ep + ep_rank (tp varies fastest, pp slowest)",
             t->world, t->pp, t->dp, t->tp, t->dp, t->edp, t->ep);
    const size_t len = strlen(buf);
    if (t->nodes > 1 && (int)len < size)
        snprintf(buf + len, (size_t)size - len, "; %d nodes (tp groups %s nodes, ep groups %s)", t->nodes,
                 t->tp_in_node ? "inside" : "ACROSS", t->ep_in_node ? "inside nodes" : "across nodes");
    return buf;
}
