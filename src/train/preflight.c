/* Memory preflight: before `tera train` allocates anything, each rank asks the planner's memory
 * model (src/parallel/plan_mem.c: the allocator's own counting, exact to the byte for every layout
 * tests/cli_plan.sh checks) what its layout will hold, sums it over the ranks sharing its host, and
 * compares the sum with what the host can give: MemAvailable, and the cgroup's limit less its current
 * use where one is set. A configuration that cannot fit is refused by name before a byte is allocated,
 * instead of an out-of-memory abort part-way through the model, or (Linux overcommits) the OOM killer
 * minutes into the run. What the model does not count (the program, oneDNN's scratch, the dataset's
 * pages, the MPI library) is not predicted, so a run that passes may still be short: the check refuses
 * only what is certain not to fit. training.memory_check = false skips it; on the CUDA backend the
 * host is not where the model lives, and it is skipped. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tera/comm.h"
#include "tera/hw.h"
#include "tera/plan.h"
#include "tera/train.h"

static void gib(char *out, size_t n, double bytes) { snprintf(out, n, "%.2f GiB", bytes / 1073741824.0); }

tera_status tera_train_memory_check(const tera_config *cfg) {
    if (!cfg->training.memory_check || !strcmp(cfg->training.device, "cuda")) return TERA_OK;
    tera_comm *w = tera_comm_world();
    const int W = tera_comm_size(w), me = tera_comm_rank(w);
    /* this rank's figure; a layout the planner refuses is left to tera_trainer_init, which names it */
    tera_plan_mem pm;
    const int planned = tera_plan_rank_memory(cfg, me, cfg->training.threads, &pm) == TERA_OK;
    /* one checkpoint snapshot is counted only where a run directory can receive saves */
    const double own = planned ? (double)(pm.total - (cfg->logging.run_dir[0] ? 0 : pm.bytes[TERA_PM_CKPT])) : 0;
    /* every rank's need, host and availability, known to all (the same decision and message on every rank) */
    if (W > 1) {
        const tera_status st = tera_comm_set_nodes(0); /* the real hosts (tera_groups_create sets the configured) */
        if (st != TERA_OK) return st;
    }
    double *v = tera_calloc((size_t)W * 3, sizeof(double));
    v[3 * me] = own, v[3 * me + 1] = (double)tera_comm_node_of(me), v[3 * me + 2] = tera_hw_memory_available();
    if (W > 1) { /* set-up, not the run's traffic: the counters are left as they were when nothing was counted yet */
        const tera_comm_traffic t0 = tera_comm_traffic_get();
        static const tera_comm_traffic zero;
        tera_comm_allreduce_f64(w, v, 3 * (int64_t)W);
        if (!memcmp(&t0, &zero, sizeof zero)) tera_comm_traffic_reset();
    }
    tera_status st = TERA_OK;
    for (int r = 0; r < W && st == TERA_OK; r++) { /* hosts in rank order; the first short one is named */
        const int host = (int)v[3 * r + 1];
        int first = 1, ranks = 0;
        double need = 0;
        for (int q = 0; q < W; q++)
            if ((int)v[3 * q + 1] == host) {
                if (q < r) first = 0;
                need += v[3 * q], ranks++;
            }
        const double avail = v[3 * r + 2];
        if (!first || avail < 0 || need <= avail) continue;
        char n_s[32], a_s[32], p_s[32];
        gib(n_s, sizeof n_s, need), gib(a_s, sizeof a_s, avail), gib(p_s, sizeof p_s, v[3 * r]);
        st = tera_fail(TERA_ERR_CONFIG,
                       "memory: this configuration needs %s on the host of world rank %d (%d rank%s; rank %d alone %s: "
                       "parameters, gradients, optimizer, activations and buffers as `tera plan --dry-run` lists "
                       "them), and the host has %s available (MemAvailable, or the cgroup limit's rest): a "
                       "smaller model, micro-batch or sequence, more ranks with ZeRO or tensor, pipeline or "
                       "expert parallelism, or recompute would fit (`tera plan --devices N` searches); "
                       "training.memory_check = false skips this check",
                       n_s, r, ranks, ranks == 1 ? "" : "s", r, p_s, a_s);
    }
    free(v);
    return st;
}
