/* tera bench: median tokens/s and MFU of full training steps on a BENCH.md configuration,
 * with the sgemm peak of this machine measured in the same run. */
#include <oneapi/dnnl/dnnl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "tera/io.h"
#include "tera/kernels.h"
#include "tera/profile.h"
#include "tera/train.h"

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

/* CPU seconds of this process (all threads): with passive OpenMP waits, the compute done, which
 * other work on the machine slows down far less than it slows wall time. */
static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------
 * The communication of one training step under a layout: bytes one rank sends, by kind of
 * transfer, as src/comm/comm.c counts them (collectives at ring-algorithm volume: an
 * all-reduce of n bytes over p ranks sends 2(p-1)/p n, a reduce-scatter or an all-gather of n
 * bytes in all (p-1)/p n; point-to-point exactly). The minimum is what the layout must move:
 * gradient sums over the data-parallel ranks, tensor-parallel partial sums, ZeRO-3's parameter
 * gathers and the expert exchange (for uniform routing: the only kind that depends on the data).
 * The overhead is the rest, known exactly: statistics of the step (loss terms, expert load,
 * router entropy, per-tensor squared norms) and the expert exchange's row counts. A micro-batch
 * holds N = micro_batch * seq_len tokens on every rank; A micro-batches make a step. */
enum { K_ALLREDUCE, K_REDUCE_SCATTER, K_ALLGATHER, K_ALLTOALL, K_P2P, N_KINDS };
static const char *const kind_name[N_KINDS] = {"allreduce", "reduce_scatter", "allgather", "alltoall", "p2p"};

typedef struct {
    double min[N_KINDS], overhead[N_KINDS];
    double grad, tp, zero3_gather, ep, pp, stats, counts; /* the same bytes by purpose */
} comm_model;

static double ring(int p) { return p > 1 ? (double)(p - 1) / (double)p : 0.0; }

/* Bytes of a reduce-scatter (or all-gather) of a whole gradient (parameter) buffer, each region
 * over the ranks sharing it: non-expert tensors over dp, this rank's experts over edp. */
static double sharded_pass(const tera_trainer *tr) {
    const tera_model *m = &tr->model;
    return 4.0 * (ring(tr->world) * (double)m->n_dense_floats +
                  ring(tr->edp_size) * (double)(m->n_floats - m->n_dense_floats));
}

/* Data-parallel gradient sums. ZeRO 0: one all-reduce per step (buckets, last micro-batch);
 * ZeRO-1: one reduce-scatter, then an all-gather of the updated parameters; ZeRO-2: a
 * reduce-scatter per micro-batch (group by group: the groups partition each region), then the
 * all-gather; ZeRO-3: the reduce-scatters, no final all-gather (parameters stay sharded). */
static void grad_bytes(const tera_trainer *tr, int A, comm_model *cm) {
    const double pass = sharded_pass(tr);
    if (tr->zero == 0) {
        cm->min[K_ALLREDUCE] += 2.0 * pass;
        cm->grad = 2.0 * pass;
        return;
    }
    const double rs = (tr->zero >= 2 ? A : 1) * pass, ag = tr->zero < 3 ? pass : 0.0;
    cm->min[K_REDUCE_SCATTER] += rs;
    cm->min[K_ALLGATHER] += ag;
    cm->grad = rs + ag;
}

/* Tensor parallelism, per micro-batch, all-reduces over the tp ranks: forward the embedding
 * lookup, each layer's o_proj and FFN block ([N, D] each), the cross-entropy's max and two sums
 * ([N] each); backward the head's input gradient, each layer's FFN and qkv input gradients
 * ([N, D] each) and each MoE layer's combine-weight gradients ([N, k]). With a pipeline, a stage
 * counts its own layers, the embedding on the first stage and the head on the last. */
static void tp_bytes(const tera_trainer *tr, int A, comm_model *cm) {
    const tera_model *m = &tr->model;
    if (tr->tp < 2) return;
    const double N = (double)m->B * m->T, D = m->cfg.dim;
    double L = 0.0, moe = 0.0;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->held[l]) L += 1.0, moe += l >= m->cfg.first_k_dense;
    const int first = tr->pp_rank == 0, last = tr->pp_rank == tr->pp - 1;
    const double floats = 4.0 * L * N * D + (first ? N * D : 0.0) + (last ? N * D + 3.0 * N : 0.0) + moe * N * m->cfg.top_k;
    cm->tp = A * 2.0 * ring(tr->tp) * 4.0 * floats;
    cm->min[K_ALLREDUCE] += cm->tp;
}

/* All-gather of one group's parameters (its non-expert range over dp, its expert range over edp). */
static double group_gather(const tera_trainer *tr, int group) {
    double b = 0.0;
    for (int x = 0; x < 2; x++) {
        int64_t lo, hi;
        tera_model_group_range(&tr->model, group, x, &lo, &hi);
        b += 4.0 * ring(x ? tr->edp_size : tr->world) * (double)(hi - lo);
    }
    return b;
}

/* ZeRO-3: a group's parameters are gathered before each use unless its staging slot (embedding,
 * head, the layer in use) still holds them from this step. The order of uses is the model's
 * (forward: embedding, layers 0..L-1, head, the embedding again when tied; backward: head, tied
 * embedding, layers L-1..0), so the head, the embedding and the last layer are gathered once a
 * step, the other layers twice per micro-batch, layer 0 once more for the next micro-batch. In a
 * pipeline stage the order is its schedule's (tera_pipeline_param_uses): micro-batches interleave. */
static void zero3_gather_bytes(const tera_trainer *tr, int A, comm_model *cm) {
    if (tr->zero < 3) return;
    const int L = tr->model.cfg.n_layers, tied = tr->model.cfg.tie_embeddings;
    int held[3] = {INT32_MIN, INT32_MIN, INT32_MIN}; /* embedding, head, layer slots */
    int n = tr->pp > 1 ? tera_pipeline_param_uses(tr, NULL, 0) : A * (2 * L + 5);
    int *uses = tera_malloc(sizeof(int) * (size_t)(n + 1));
    if (tr->pp > 1) {
        tera_pipeline_param_uses(tr, uses, n);
    } else {
        for (int a = 0, j = 0; a < A; a++)
            for (int i = 0; i < 2 * L + 5; i++) { /* the uses of one micro-batch, in order */
                int g;
                if (i == 0) g = TERA_GROUP_EMBED;
                else if (i <= L) g = i - 1;
                else if (i == L + 1 || i == L + 3) g = TERA_GROUP_HEAD;
                else if (i == L + 2 || i == L + 4) g = tied ? TERA_GROUP_EMBED : TERA_GROUP_HEAD;
                else g = 2 * L + 4 - i; /* i = L+5 .. 2L+4: layers L-1 .. 0 */
                uses[j++] = g;
            }
    }
    double b = 0.0;
    for (int i = 0; i < n; i++) {
        const int g = uses[i], k = g == TERA_GROUP_EMBED ? 0 : g == TERA_GROUP_HEAD ? 1 : 2;
        if (held[k] != g) held[k] = g, b += group_gather(tr, g);
    }
    free(uses);
    cm->zero3_gather = b;
    cm->min[K_ALLGATHER] += b;
}

/* Expert parallelism: each MoE layer's routed rows [N k, D] whose expert lives on another of
 * the ep ranks ((ep-1)/ep of them for uniform routing) go there and come back, in forward and
 * again in backward: 4 transfers. Before the forward exchange, the row counts ([E/ep] int32 to
 * each other rank) are exchanged (overhead). */
static void ep_bytes(const tera_trainer *tr, int A, comm_model *cm) {
    const tera_model *m = &tr->model;
    if (tr->ep < 2) return;
    const double N = (double)m->B * m->T, rows = N * m->cfg.top_k;
    double moe = 0.0; /* this stage's MoE layers (all of them without a pipeline) */
    for (int l = m->cfg.first_k_dense; l < m->cfg.n_layers; l++) moe += m->held[l];
    cm->ep = A * moe * 4.0 * ring(tr->ep) * rows * m->cfg.dim * 4.0;
    cm->min[K_P2P] += cm->ep;
    cm->counts = A * moe * (tr->ep - 1) * 4.0 * (m->cfg.n_experts / tr->ep);
    cm->overhead[K_ALLTOALL] += cm->counts;
}

/* Pipeline parallelism, per micro-batch: each chunk sends its output activations [N, D] to the
 * next virtual stage unless it is the last, and its input gradients back unless it is the first. */
static void pp_bytes(const tera_trainer *tr, int A, comm_model *cm) {
    const tera_model *m = &tr->model;
    if (tr->pp < 2) return;
    const int v = m->par.v, S = tr->pp * v;
    double sends = 0.0;
    for (int c = 0; c < v; c++) {
        const int vs = c * tr->pp + tr->pp_rank;
        sends += (vs < S - 1) + (vs > 0);
    }
    cm->pp = A * sends * (double)m->B * m->T * m->cfg.dim * 4.0;
    cm->min[K_P2P] += cm->pp;
}

/* Statistics, once a step (src/train/trainer.c, src/train/layout.c): over the data-parallel ranks
 * of every stage the 5 loss sums, the expert load [L, E] int64, the router entropy [L] and the
 * routed-token count; over the world the squared gradient norm of every tensor (f64 each) and the
 * update's 2 sums. */
static void stats_bytes(const tera_trainer *tr, comm_model *cm) {
    const tera_model *m = &tr->model;
    const double L = m->cfg.n_layers, E = m->cfg.n_experts;
    cm->stats = 2.0 * ring(tr->world * tr->pp) * 8.0 * (5.0 + L * E + L + 1.0) +
                2.0 * ring(tr->wsize) * 8.0 * ((double)m->n_params + 2.0);
    cm->overhead[K_ALLREDUCE] += cm->stats;
}

static comm_model comm_minimum(const tera_trainer *tr, int A) {
    comm_model cm;
    memset(&cm, 0, sizeof cm);
    grad_bytes(tr, A, &cm);
    tp_bytes(tr, A, &cm);
    zero3_gather_bytes(tr, A, &cm);
    ep_bytes(tr, A, &cm);
    pp_bytes(tr, A, &cm);
    stats_bytes(tr, &cm);
    return cm;
}

int tera_cmd_bench(int argc, char **argv) {
    tera_config cfg;
    static const char *const opts[] = {"steps", "warmup", "threads", "name", NULL};
    const char *val[4] = {NULL, NULL, NULL, NULL};
    if (tera_cli_parse(argc, argv, &cfg, NULL, NULL, opts, val)) return 1;
    int steps = val[0] ? atoi(val[0]) : 10, warmup = val[1] ? atoi(val[1]) : 3;
    if (val[2]) cfg.training.threads = atoi(val[2]);
    if (steps < 1 || warmup < 0 || steps > 1000) {
        tera_fail(TERA_ERR_ARG, "--steps must be in 1..1000 and --warmup >= 0");
        return tera_cli_error();
    }
    cfg.training.steps = steps + warmup;
    cfg.training.warmup_steps = 0;
    tera_trainer tr;
    if (tera_trainer_init(&tr, &cfg, "", 0) != TERA_OK) return tera_cli_error();
    fprintf(stderr, "tera bench: precision %s%s%s\n", tr.precision_note,
            tr.bf16_gemm_note[0] ? " | bf16 products: " : "", tr.bf16_gemm_note);
    /* several ranks share this machine's cores: a peak measured by all at once means nothing */
    const int multi = tr.wsize > 1;
    double peak = multi ? 0.0 : sgemm_peak_gflops();
    double *sec = tera_malloc(sizeof(double) * (size_t)steps);
    tera_step_result r;
    double cpu0 = 0.0;
    for (int s = 0; s < warmup + steps; s++) {
        if (s == warmup) {
            tera_prof_reset();
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
    const tera_comm_traffic tx = tera_comm_traffic_get();
    const double cpu_ms = 1e3 * (cpu_seconds() - cpu0) / steps;
    const double peak_after = multi ? 0.0 : sgemm_peak_gflops();
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
        const comm_model cm = comm_minimum(&tr, r.accum);
        const double kind_sent[N_KINDS] = {tx.allreduce / steps, tx.reduce_scatter / steps, tx.allgather / steps,
                                           tx.alltoall / steps, tx.p2p / steps};
        double tot = 0.0, min = 0.0, over = 0.0;
        for (int k = 0; k < N_KINDS; k++) tot += kind_sent[k], min += cm.min[k], over += cm.overhead[k];
        if (tr.root) {
            tera_prof_print(stderr, steps);
            printf("{\"impl\": \"tera\", \"config\": \"%s\", \"ranks\": %d, \"pp\": %d, \"dp\": %d, \"tp\": %d, \"ep\": %d, "
                   "\"zero\": %d, "
                   "\"ep_overlap\": %d, \"threads_per_rank\": %d, \"accum\": %d, \"tokens_per_s\": %.1f, "
                   "\"step_ms_median\": %.2f, \"bytes_sent_per_step\": %.0f, \"min_bytes_per_step\": %.0f, "
                   "\"overhead_bytes_per_step\": %.0f, \"grad_min_bytes\": %.0f, \"tp_min_bytes\": %.0f, "
                   "\"zero3_gather_min_bytes\": %.0f, \"ep_min_bytes\": %.0f, \"pp_min_bytes\": %.0f, "
                   "\"stats_bytes\": %.0f, \"counts_bytes\": %.0f",
                   val[3] ? val[3] : "custom", tr.wsize, tr.pp, tr.world, tr.tp, tr.ep, tr.zero ? cfg.parallel.zero : 0,
                   cfg.parallel.ep_overlap, tera_get_threads(), r.accum, tps, 1e3 * med, tot, min, over, cm.grad,
                   cm.tp, cm.zero3_gather, cm.ep, cm.pp, cm.stats, cm.counts);
            for (int k = 0; k < N_KINDS; k++)
                printf(", \"sent_%s\": %.0f, \"min_%s\": %.0f, \"overhead_%s\": %.0f", kind_name[k], kind_sent[k],
                       kind_name[k], cm.min[k], kind_name[k], cm.overhead[k]);
            printf(", \"mem_params\": %ld, \"mem_grads\": %ld, \"mem_optimizer\": %ld, \"mem_acts\": %ld, "
                   "\"mem_comm\": %ld, \"final_loss\": %s}\n",
                   (long)m->bytes_params, (long)m->bytes_grads, (long)(8 * (tr.opt.n + tr.opt_x.n)),
                   (long)m->bytes_acts, (long)m->bytes_comm, tera_json_num(fl, sizeof fl, "%.4f", r.loss));
        }
        free(sec);
        tera_trainer_free(&tr);
        return 0;
    }
    tera_prof_print(stderr, steps);
    const tera_model *m = &tr.model;
    fprintf(stderr, "tera bench: memory MiB: params %.1f, grads %.1f, activations %.1f (recompute %s), scratch %.1f\n",
            m->bytes_params / 1048576.0, m->bytes_grads / 1048576.0, m->bytes_acts / 1048576.0,
            cfg.training.recompute, m->bytes_scratch / 1048576.0);
    printf("{\"impl\": \"tera\", \"config\": \"%s\", \"threads\": %d, \"precision\": \"%s\", \"bf16_gemm\": \"%s\", "
           "\"tokens_per_s\": %.1f, \"step_ms_median\": %.2f, \"flops_per_token\": %.0f, \"gflops\": %.1f, "
           "\"sgemm_peak_gflops\": %.1f, \"mfu\": %.4f, \"final_loss\": %s, \"recompute\": \"%s\", "
           "\"act_bytes\": %lld, \"cpu_ms_per_step\": %.2f}\n",
           val[3] ? val[3] : "custom", tera_get_threads(), tera_precision_name(tr.precision),
           tr.precision != TERA_PREC_BF16 ? "-" : tr.bf16_gemm == TERA_BF16_FMA ? "fma" : "native", tps, 1e3 * med, fpt,
           gflops, peak, gflops / peak, tera_json_num(fl, sizeof fl, "%.4f", r.loss), cfg.training.recompute,
           (long long)m->bytes_acts, cpu_ms);
    free(sec);
    tera_trainer_free(&tr);
    return 0;
}
