/* tera bench: median tokens/s and MFU of full training steps on a BENCH.md configuration,
 * with the sgemm peak of this machine measured in the same run. */
#include <errno.h>
#include <oneapi/dnnl/dnnl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_peak.h"
#include "cli.h"
#include "tera/io.h"
#include "tera/kernels.h"
#include "tera/pipeline.h"
#include "tera/profile.h"
#include "tera/trace.h"
#include "tera/train.h"
#include "tera/zero.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Peak GFLOP/s of a large square fp32 product (2048^3) through oneDNN: dnnl_sgemm and the matmul
 * primitive (what tera_gemm picks for large products) are both timed, 9 repetitions each, and the
 * best repetition is the peak. The bench measures it before and after the timed steps and keeps the
 * higher, so a slow moment of the machine cannot inflate the MFU. */
static double sgemm_peak_gflops(void) {
    const int n = 2048, reps = 9;
    float *a = tera_malloc(sizeof(float) * n * n), *b = tera_malloc(sizeof(float) * n * n),
          *c = tera_malloc(sizeof(float) * n * n);
    for (int64_t i = 0; i < (int64_t)n * n; i++) a[i] = (float)(i % 13) * 0.01f, b[i] = (float)(i % 7) * 0.01f;
    double g[9], best = 0.0;
    for (int impl = 0; impl < 2; impl++) {
        for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
            double t0 = tera_now();
            if (impl == 0)
                dnnl_sgemm('N', 'T', n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
            else
                tera_gemm(0, 1, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
            if (r >= 0) g[r] = 2.0 * n * n * (double)n / (tera_now() - t0) / 1e9;
        }
        qsort(g, reps, sizeof(double), cmp_double);
        if (g[reps - 1] > best) best = g[reps - 1];
    }
    free(a);
    free(b);
    free(c);
    return best;
}

/* CPU seconds of this process (all threads): with passive OpenMP waits (OMP_WAIT_POLICY=PASSIVE), the
 * compute done, which other work on the machine slows down far less than it slows wall time; under
 * the runtime's default policy it also counts the threads' spinning between parallel regions. */
static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* --NAME S as an integer in [lo, hi] (atoi read "abc" as 0); 0, or 1 with the error set. */
static int opt_int(const char *name, const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    const long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) {
        tera_fail(TERA_ERR_ARG, "--%s '%s' is not an integer in %d..%d", name, s, lo, hi);
        return 1;
    }
    *out = (int)v;
    return 0;
}

int tera_cmd_bench(int argc, char **argv) {
    tera_config cfg;
    static const char *const opts[] = {"steps", "warmup", "threads", "name", "products", NULL};
    const char *val[5] = {NULL, NULL, NULL, NULL, NULL};
    if (tera_cli_parse(argc, argv, &cfg, NULL, NULL, opts, val)) return 1;
    int steps = 10, warmup = 3, products = 0;
    if ((val[0] && opt_int("steps", val[0], 1, 1000, &steps)) ||
        (val[1] && opt_int("warmup", val[1], 0, 100000, &warmup)) ||
        (val[4] && opt_int("products", val[4], 0, TERA_PROF_PRODUCT_SHAPES, &products)) ||
        (val[2] && opt_int("threads", val[2], 0, 4096, &cfg.training.threads)))
        return tera_cli_error();
    for (const char *c = val[3]; c && *c; c++) /* the name goes into the JSON line as it is */
        if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20) {
            tera_fail(TERA_ERR_ARG, "--name '%s': no quotes, backslashes or control characters (it is a JSON string)",
                      val[3]);
            return tera_cli_error();
        }
    cfg.training.steps = steps + warmup;
    cfg.training.warmup_steps = 0;
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) return tera_cli_error();
    fprintf(stderr, "tera bench: precision %s%s%s\n", tr.prec.precision_note,
            tr.prec.bf16_gemm_note[0] ? " | bf16 products: " : "", tr.prec.bf16_gemm_note);
    if (tr.root) tera_cli_wait_policy_note("tera bench", tera_get_threads());
    /* several ranks share this machine's cores: a peak measured by all at once means nothing */
    const int multi = tr.topo.world > 1;
    double peak = multi ? 0.0 : sgemm_peak_gflops();
    tera_bf16_peak bf16_peak = {0}; /* bench_peak.c: before and after the steps, like the sgemm peak */
    if (!multi) tera_bench_bf16_peak_measure(&cfg, &bf16_peak);
    double *sec = tera_malloc(sizeof(double) * (size_t)steps);
    tera_step_result r;
    double cpu0 = 0.0;
    int64_t tp_ov0 = 0, tp_early0 = 0; /* parallel.tp_overlap: overlapped sums before the timed steps */
    int64_t sh_ov0 = 0;                /* parallel.ep_overlap: shared-expert passes overlapped before them */
    int64_t rs0[3] = {0, 0, 0};        /* ZeRO-1/2/3's gradient reduce-scatters before them (tera_zero_rs_counts) */
    int64_t zc0[6] = {0, 0, 0, 0, 0, 0}; /* ZeRO-3's layer gathers before them (tera_zero_counts), shared sums,
                                            ZeRO-1/2's shared parameter gathers */
    for (int s = 0; s < warmup + steps; s++) {
        if (s == warmup) {
            tp_ov0 = tera_model_tp_overlapped(&tr.model, &tp_early0);
            sh_ov0 = tera_model_shared_overlapped(&tr.model);
            tera_zero_rs_counts(tr.sharding, &rs0[0], &rs0[1], &rs0[2]);
            tera_zero_counts(tr.sharding, &zc0[0], &zc0[1], &zc0[2], &zc0[3]);
            zc0[4] = tera_zero_shared_sums(tr.sharding);
            zc0[5] = tera_zero_shared_param_gathers(tr.sharding);
            tera_prof_reset();
            tera_pipe_times_reset(tr.pipe); /* pp > 1: each stage's busy and waiting time, timed steps only */
            tera_prof_products_reset(); /* --products: the timed steps' products by shape */
            tera_prof_products_on = products > 0;
            tera_comm_barrier(tera_comm_world());
            tera_comm_traffic_reset();
            cpu0 = cpu_seconds();
        }
        if (tera_trainer_step(&tr, &r) != TERA_OK) {
            tera_trainer_free(&tr);
            return tera_cli_error();
        }
        if (s >= warmup) sec[s - warmup] = r.seconds;
    }
    tera_prof_products_on = 0;
    const tera_comm_traffic tx = tera_comm_traffic_get();
    /* logging.trace: the window's events of every rank, merged by rank 0 (collective; as tera train) */
    if (tera_trace_finish(tera_comm_world()) != TERA_OK) {
        free(sec);
        tera_trainer_free(&tr);
        return tera_cli_error();
    }
    const double cpu_ms = 1e3 * (cpu_seconds() - cpu0) / steps;
    const double peak_after = multi ? 0.0 : sgemm_peak_gflops();
    if (!multi) tera_bench_bf16_peak_measure(&cfg, &bf16_peak);
    if (peak_after > peak) peak = peak_after;
    qsort(sec, (size_t)steps, sizeof(double), cmp_double);
    const double med = sec[steps / 2];
    const double tps = (double)tr.tokens_per_step / med;
    const double fpt = tera_model_flops_per_token(&cfg.model, cfg.training.seq_len);
    const double gflops = tps * fpt / 1e9;
    char fl[64]; /* the final loss as JSON (null when not finite) */
    if (multi) {
        /* steps end in collectives, so every rank's step time is the job's; rank 0 reports */
        const tera_model *m = &tr.model;
        const tera_comm_volume cm = tera_trainer_comm_volume(&tr, r.accum);
        const double kind_sent[TERA_XFER_KINDS] = {tx.allreduce / steps, tx.reduce_scatter / steps, tx.allgather / steps,
                                           tx.alltoall / steps, tx.p2p / steps};
        double tot = 0.0, min = 0.0, over = 0.0;
        for (int k = 0; k < TERA_XFER_KINDS; k++) tot += kind_sent[k], min += cm.min[k], over += cm.overhead[k];
        /* bytes per rank per step inside and across nodes (parallel.ranks_per_node; docs/COMMUNICATION.md):
         * the mean over the ranks, and the most any rank sends across (a ring's boundary ranks) */
        const double inter = (tx.inter_allreduce + tx.inter_reduce_scatter + tx.inter_allgather + tx.inter_alltoall +
                              tx.inter_p2p) / steps;
        double *node_bytes = tera_calloc((size_t)(2 + tr.topo.world), sizeof(double));
        node_bytes[0] = tot, node_bytes[1] = inter, node_bytes[2 + tr.topo.rank] = inter;
        tera_comm_allreduce_f64(tera_comm_world(), node_bytes, 2 + tr.topo.world);
        double inter_max = 0.0;
        for (int q = 0; q < tr.topo.world; q++) inter_max = node_bytes[2 + q] > inter_max ? node_bytes[2 + q] : inter_max;
        if (tr.root)
            fprintf(stderr, "tera bench: comm {\"comm_nodes\": %d, \"intra_bytes_per_rank_step\": %.0f, \"inter_bytes_per_rank_step\": %.0f, "
                   "\"inter_bytes_max_rank_step\": %.0f, \"grad_compression\": \"%s\", \"hierarchical\": %d, \"ep_hierarchical\": %d, "
                   "\"a2a_compression\": \"%s\", \"optimizer\": \"%s\"}\n",
                   tera_comm_nodes(), (node_bytes[0] - node_bytes[1]) / tr.topo.world, node_bytes[1] / tr.topo.world, inter_max,
                   cfg.parallel.grad_compression, cfg.parallel.hierarchical, cfg.parallel.ep_hierarchical,
                   cfg.parallel.a2a_compression,
                   cfg.optimizer.name);
        free(node_bytes);
        /* communication not hidden behind compute: each rank's seconds blocked in collectives and waits
         * per step (src/comm/comm.c), the mean and the largest over the ranks */
        enum { NB = TERA_BLOCKED_KINDS };
        double *blk = tera_calloc((size_t)tr.topo.world * 2 + NB, sizeof(double));
        blk[tr.topo.rank] = tx.blocked_s / steps;
        blk[tr.topo.world + tr.topo.rank] = tx.progress_s / steps; /* starting and polling non-blocking ops */
        for (int k = 0; k < NB; k++) blk[2 * tr.topo.world + k] = tx.blocked_kind_s[k] / steps; /* by kind, summed */
        tera_comm_allreduce_f64(tera_comm_world(), blk, 2 * tr.topo.world + NB);
        double blk_kind[NB]; /* the mean over the ranks */
        for (int k = 0; k < NB; k++) blk_kind[k] = blk[2 * tr.topo.world + k] / tr.topo.world;
        double blk_mean = 0.0, blk_max = 0.0, prg_mean = 0.0, prg_max = 0.0;
        for (int q = 0; q < tr.topo.world; q++) {
            const double b = blk[q], p = blk[tr.topo.world + q];
            blk_mean += b / tr.topo.world, blk_max = b > blk_max ? b : blk_max;
            prg_mean += p / tr.topo.world, prg_max = p > prg_max ? p : prg_max;
        }
        free(blk);
        /* expert parallelism: how evenly the routed rows fell on the expert-parallel ranks in the last
         * step (every rank's routing counts summed; rank r of the group holds experts [r El, (r+1) El)):
         * the busiest rank's rows over the mean, averaged over the MoE layers (1 = even; 1 without ep).
         * A rank with more rows makes the others wait in the exchange: exposed time, not bytes. */
        double ep_imb = 1.0;
        if (tr.topo.ep > 1) {
            const int L = cfg.model.n_layers, E = cfg.model.n_experts, ep = tr.topo.ep, El = E / ep;
            double *ld = tera_calloc((size_t)L * (size_t)E, sizeof(double));
            for (int64_t i = 0; i < (int64_t)L * E; i++) ld[i] = (double)tr.model.expert_load[i];
            tera_comm_allreduce_f64(tera_comm_world(), ld, (int64_t)L * E);
            double acc = 0.0;
            int nl = 0;
            for (int l = 0; l < L; l++) {
                double rows = 0.0, mx = 0.0;
                for (int q = 0; q < ep; q++) {
                    double sq = 0.0;
                    for (int e = q * El; e < (q + 1) * El; e++) sq += ld[(int64_t)l * E + e];
                    rows += sq, mx = sq > mx ? sq : mx;
                }
                if (rows > 0.0) acc += mx * ep / rows, nl++;
            }
            ep_imb = nl ? acc / nl : 1.0;
            free(ld);
        }
        /* a pipeline: each stage's mean time per step running its operations and blocked on its neighbours
         * (tera_pipe_times; the stage's first data-parallel, tensor-parallel rank): the busiest stage's busy
         * time bounds the step whatever the schedule; the rest of its step is its bubble */
        const int pp = tr.topo.pp;
        double *pst = tera_calloc((size_t)(4 * pp), sizeof(double)); /* busy, wait, deferred in waits, at the end */
        if (pp > 1) {
            if (tr.topo.dp_rank == 0 && tr.topo.tp_rank == 0) {
                double busy, wait, whole;
                tera_pipe_times(tr.pipe, &busy, &wait, &whole);
                pst[tr.topo.pp_rank] = busy, pst[pp + tr.topo.pp_rank] = wait;
                tera_pipe_deferred(tr.pipe, &pst[2 * pp + tr.topo.pp_rank], &pst[3 * pp + tr.topo.pp_rank], NULL, NULL);
            }
            tera_comm_allreduce_f64(tera_comm_world(), pst, 4 * pp);
        }
        /* every rank's operations (a pipeline's last stage runs the head; tensor parallelism
         * replicates the router and the norms): gathered, [world][op] seconds, then calls */
        const int W = tr.topo.world;
        double *pr = tera_calloc((size_t)(2 * W * TERA_PROF_COUNT), sizeof(double));
        for (int op = 0; op < TERA_PROF_COUNT; op++) {
            pr[(int64_t)tr.topo.rank * TERA_PROF_COUNT + op] = tera_prof_seconds[op];
            pr[(int64_t)(W + tr.topo.rank) * TERA_PROF_COUNT + op] = (double)tera_prof_calls[op];
        }
        tera_comm_allreduce_f64(tera_comm_world(), pr, 2 * W * TERA_PROF_COUNT);
        if (tr.root) {
            tera_prof_print(stderr, steps);
            tera_prof_print_ranks(stderr, steps, W, pr, pr + (int64_t)W * TERA_PROF_COUNT);
            if (products) tera_prof_products_print(stderr, steps, products);
            printf("{\"impl\": \"tera\", \"config\": \"%s\", \"ranks\": %d, \"pp\": %d, \"dp\": %d, \"tp\": %d, \"ep\": %d, "
                   "\"zero\": %d, "
                   "\"ep_overlap\": %d, \"threads_per_rank\": %d, \"accum\": %d, \"tokens_per_s\": %.1f, "
                   "\"step_ms_median\": %.2f, \"bytes_sent_per_step\": %.0f, \"min_bytes_per_step\": %.0f, "
                   "\"overhead_bytes_per_step\": %.0f, \"grad_min_bytes\": %.0f, \"tp_min_bytes\": %.0f, "
                   "\"zero3_gather_min_bytes\": %.0f, \"ep_min_bytes\": %.0f, \"pp_min_bytes\": %.0f, "
                   "\"stats_bytes\": %.0f, \"counts_bytes\": %.0f",
                   val[3] ? val[3] : "custom", tr.topo.world, tr.topo.pp, tr.topo.dp, tr.topo.tp, tr.topo.ep, tr.sharding->stage ? cfg.parallel.zero : 0,
                   cfg.parallel.ep_overlap, tera_get_threads(), r.accum, tps, 1e3 * med, tot, min, over, cm.grad,
                   cm.tp, cm.zero3_gather, cm.ep, cm.pp, cm.stats, cm.counts);
            for (int k = 0; k < TERA_XFER_KINDS; k++)
                printf(", \"sent_%s\": %.0f, \"min_%s\": %.0f, \"overhead_%s\": %.0f", tera_xfer_names[k], kind_sent[k],
                       tera_xfer_names[k], cm.min[k], tera_xfer_names[k], cm.overhead[k]);
            printf(", \"exposed_comm_ms\": %.2f, \"exposed_comm_ms_max\": %.2f, \"comm_progress_ms\": %.3f, "
                   "\"comm_progress_ms_max\": %.3f",
                   1e3 * blk_mean, 1e3 * blk_max, 1e3 * prg_mean, 1e3 * prg_max);
            /* the exposed time by the kind of operation waited for (tera_comm_traffic.blocked_kind_s) */
            for (int k = 0; k < NB; k++)
                printf("%s\"%s\": %.3f", k ? ", " : ", \"exposed_comm_ms_by_kind\": {", tera_traffic_kind_name(k),
                       1e3 * blk_kind[k]);
            printf("}");
            printf(", \"ep_load_max_over_mean\": %.4f, \"router_force_balance\": %d, \"omp_wait_policy\": \"%s\"",
                   ep_imb, cfg.model.router_force_balance, tera_cli_wait_policy());
            /* parallel.tp_overlap: the tensor-parallel sums waited for after work that overlapped them, and
             * of those the ones already complete at their wait (rank 0's) */
            int64_t tp_early = 0;
            const int64_t tp_ov = tera_model_tp_overlapped(&tr.model, &tp_early);
            printf(", \"tp_overlap\": %d, \"tp_overlapped_per_step\": %.1f, \"tp_done_before_wait_per_step\": %.1f",
                   cfg.parallel.tp_overlap, (double)(tp_ov - tp_ov0) / steps, (double)(tp_early - tp_early0) / steps);
            printf(", \"sequence_parallel\": %d", tr.model.par.sp); /* in effect: tp > 1 */
            if (pp > 1) /* the schedule run, its model chunks per stage (1 but with interleaved), the head split,
                           * the deferred head weight gradients */
                printf(", \"pp_schedule\": \"%s\", \"pp_chunks\": %d, \"pp_head_split\": %d, \"pp_defer_wgrad\": %d",
                       cfg.parallel.pp_schedule,
                       strcmp(cfg.parallel.pp_schedule, "interleaved") == 0 ? cfg.parallel.pp_chunks : 1,
                       cfg.parallel.pp_head_split, cfg.parallel.pp_defer_wgrad);
            if (pp > 1) { /* each stage's busy and waiting ms, and its deferred weight gradients' (within busy) */
                static const char *const key[4] = {"pp_stage_busy_ms", "pp_stage_wait_ms", "pp_stage_wgrad_in_waits_ms",
                                                   "pp_stage_wgrad_at_end_ms"};
                for (int w = 0; w < 4; w++)
                    for (int q = 0; q < pp; q++)
                        printf("%s%s%s%.2f%s", q ? ", " : ", \"", q ? "" : key[w], q ? "" : "\": [", 1e3 * pst[w * pp + q],
                               q == pp - 1 ? "]" : "");
            }
            /* parallel.ep_overlap: the MoE layers' shared-expert passes run while the rows travelled (rank 0's) */
            printf(", \"shared_overlapped_per_step\": %.1f", (double)(tera_model_shared_overlapped(&tr.model) - sh_ov0) / steps);
            /* ZeRO-1/2/3: the gradient reduce-scatters, those started non-blocking (overlapping the backward) and
             * of those the ones already complete when waited for (rank 0's) */
            int64_t rs[3];
            tera_zero_rs_counts(tr.sharding, &rs[0], &rs[1], &rs[2]);
            printf(", \"zero_rs_per_step\": %.1f, \"zero_rs_overlapped_per_step\": %.1f, \"zero_rs_done_before_wait_per_step\": %.1f",
                   (double)(rs[0] - rs0[0]) / steps, (double)(rs[1] - rs0[1]) / steps, (double)(rs[2] - rs0[2]) / steps);
            /* ZeRO-3: layer parameter gathers, of them through host-shared memory; every stage: gradient sums
             * straight from the ranks' buffers in host-shared memory; ZeRO-1/2: the updated parameters
             * gathered there (rank 0's) */
            int64_t zc[4];
            tera_zero_counts(tr.sharding, &zc[0], &zc[1], &zc[2], &zc[3]);
            printf(", \"zero3_gathers_per_step\": %.1f, \"zero3_shared_gathers_per_step\": %.1f, "
                   "\"zero_shared_sums_per_step\": %.1f, \"zero_shared_param_gathers_per_step\": %.1f",
                   (double)(zc[0] - zc0[0]) / steps, (double)(zc[3] - zc0[3]) / steps,
                   (double)(tera_zero_shared_sums(tr.sharding) - zc0[4]) / steps,
                   (double)(tera_zero_shared_param_gathers(tr.sharding) - zc0[5]) / steps);
            /* ops_ms_by_rank: each operation some rank ran, its ms per step on every rank */
            for (int op = 0, first = 1; op < TERA_PROF_COUNT; op++) {
                int ran = 0;
                for (int q = 0; q < W; q++) ran |= pr[(int64_t)(W + q) * TERA_PROF_COUNT + op] > 0;
                if (!ran) continue;
                printf("%s\"%s\": [", first ? ", \"ops_ms_by_rank\": {" : ", ", tera_prof_name(op));
                for (int q = 0; q < W; q++)
                    printf("%s%.3f", q ? ", " : "", 1e3 * pr[(int64_t)q * TERA_PROF_COUNT + op] / steps);
                printf("]");
                first = 0;
            }
            printf("}");
            printf(", \"mem_params\": %ld, \"mem_grads\": %ld, \"mem_optimizer\": %ld, \"mem_acts\": %ld, "
                   "\"mem_comm\": %ld, \"final_loss\": %s}\n",
                   (long)m->bytes_params, (long)m->bytes_grads, (long)tera_trainer_optimizer_bytes(&tr),
                   (long)m->bytes_acts, (long)m->bytes_comm, tera_json_num(fl, sizeof fl, "%.4f", r.loss));
        }
        free(pst);
        free(pr);
        free(sec);
        tera_trainer_free(&tr);
        return 0;
    }
    tera_prof_print(stderr, steps);
    if (products) tera_prof_products_print(stderr, steps, products);
    const tera_model *m = &tr.model;
    const double bf16_best = tera_bench_bf16_peak_best(&bf16_peak);
    char bf16_txt[64] = "";
    if (bf16_best > 0.0) snprintf(bf16_txt, sizeof bf16_txt, ", bf16 %.3g", bf16_best / 1e3);
    fprintf(stderr, "tera bench: this process's product peaks for logging.peak_tflops (%d threads): fp32 %.3g%s "
            "TFLOP/s; this run's model FLOP/s %.3g TFLOP/s\n", tera_get_threads(), peak / 1e3, bf16_txt, gflops / 1e3);
    fprintf(stderr, "tera bench: memory MiB: params %.1f, grads %.1f, activations %.1f (recompute %s), scratch %.1f\n",
            m->bytes_params / 1048576.0, m->bytes_grads / 1048576.0, m->bytes_acts / 1048576.0,
            cfg.training.recompute, m->bytes_scratch / 1048576.0);
    printf("{\"impl\": \"tera\", \"config\": \"%s\", \"threads\": %d, \"precision\": \"%s\", \"bf16_gemm\": \"%s\", "
           "\"tokens_per_s\": %.1f, \"step_ms_median\": %.2f, \"flops_per_token\": %.0f, \"gflops\": %.1f, "
           "\"sgemm_peak_gflops\": %.1f, \"mfu\": %.4f, \"final_loss\": %s, \"recompute\": \"%s\", "
           "\"act_bytes\": %lld, \"cpu_ms_per_step\": %.2f, \"router_force_balance\": %d, "
           "\"omp_wait_policy\": \"%s\"",
           val[3] ? val[3] : "custom", tera_get_threads(), tera_precision_name(tr.prec.precision),
           tr.prec.precision != TERA_PREC_BF16 ? "-" : tr.prec.bf16_gemm == TERA_BF16_FMA ? "fma" : "native", tps, 1e3 * med, fpt,
           gflops, peak, gflops / peak, tera_json_num(fl, sizeof fl, "%.4f", r.loss), cfg.training.recompute,
           (long long)m->bytes_acts, cpu_ms, cfg.model.router_force_balance, tera_cli_wait_policy());
    tera_bench_bf16_peak_json(stdout, &bf16_peak, gflops);
    if (products) { /* the products' totals per step: on every thread, and side by side (per thread) */
        double ws, wf, ss, sf;
        tera_prof_products_totals(&ws, &wf, &ss, &sf);
        printf(", \"products_whole_ms\": %.3f, \"products_whole_gflops\": %.1f, \"products_side_thread_ms\": %.3f, "
               "\"products_side_gflops_per_thread\": %.1f",
               1e3 * ws / steps, ws > 0 ? wf / ws * 1e-9 : 0.0, 1e3 * ss / steps, ss > 0 ? sf / ss * 1e-9 : 0.0);
    }
    printf("}\n");
    free(sec);
    tera_trainer_free(&tr);
    return 0;
}
