/* The communication of one training step under the trainer's layout, derived from the layout alone
 * (include/tera/train.h: tera_trainer_comm_volume): what `tera bench` compares with the bytes
 * src/comm/comm.c counted, and what the planner's volumes must agree with. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tera/io.h"
#include "tera/train.h"
#include "tera/zero.h"

/* The communication of one training step under a layout: bytes one rank sends, by kind of
 * transfer, as src/comm/comm.c counts them (collectives at ring-algorithm volume: an
 * all-reduce of n bytes over p ranks sends 2(p-1)/p n, a reduce-scatter or an all-gather of n
 * bytes in all (p-1)/p n; point-to-point exactly). The minimum is what the layout must move:
 * gradient sums over the data-parallel ranks, tensor-parallel partial sums, ZeRO-3's parameter
 * gathers and the expert exchange (for uniform routing: the only kind that depends on the data).
 * The overhead is the rest, known exactly: statistics of the step (loss terms, expert load,
 * router entropy, per-tensor squared norms) and the expert exchange's row counts. A micro-batch
 * holds N = micro_batch * seq_len tokens on every rank; A micro-batches make a step. */
const char *const tera_xfer_names[TERA_XFER_KINDS] = {"allreduce", "reduce_scatter", "allgather", "alltoall", "p2p"};

static double ring(int p) { return p > 1 ? (double)(p - 1) / (double)p : 0.0; }

/* Bytes of a reduce-scatter (or all-gather) of a whole gradient (parameter) buffer, each region
 * over the ranks sharing it: non-expert tensors over dp, this rank's experts over edp. */
static double sharded_pass(const tera_trainer *tr) {
    const tera_model *m = &tr->model;
    return 4.0 * (ring(tr->topo.dp) * (double)m->n_dense_floats +
                  ring(tr->topo.edp) * (double)(m->n_floats - m->n_dense_floats));
}

/* Data-parallel gradient sums. ZeRO 0: one all-reduce per step (buckets, last micro-batch);
 * ZeRO-1: one reduce-scatter (buckets, last micro-batch), then an all-gather of the updated
 * parameters; ZeRO-2: a
 * reduce-scatter per micro-batch (group by group: the groups partition each region), then the
 * all-gather; ZeRO-3: the reduce-scatters, no final all-gather (parameters stay sharded). */
static void grad_bytes(const tera_trainer *tr, int A, tera_comm_volume *cm) {
    const double pass = sharded_pass(tr);
    if (tr->sharding->stage == 0) {
        cm->min[TERA_XFER_ALLREDUCE] += 2.0 * pass;
        cm->grad = 2.0 * pass;
        return;
    }
    const double rs = (tr->sharding->stage >= 2 ? A : 1) * pass, ag = tr->sharding->stage < 3 ? pass : 0.0;
    cm->min[TERA_XFER_REDUCE_SCATTER] += rs;
    cm->min[TERA_XFER_ALLGATHER] += ag;
    cm->grad = rs + ag;
}

/* Tensor parallelism, per micro-batch, all-reduces over the tp ranks: forward the embedding
 * lookup, each layer's o_proj and FFN block ([N, D] each), the cross-entropy's max and two sums
 * ([N] each); backward the head's input gradient, each layer's FFN and qkv input gradients
 * ([N, D] each) and each MoE layer's combine-weight gradients ([N, k]). With a pipeline, a stage
 * counts its own layers, the embedding on the first stage and the head on the last.
 * Sequence parallelism (par.sp) turns each [N, D] all-reduce into a reduce-scatter and adds an
 * all-gather of the same size where the rows are read whole (ln1, ln2 and lnf forward; the residual
 * stream's gradient before each FFN block, o_proj and the embedding backward): the same bytes, split
 * by kind; it adds an all-gather of each layer's kept ln1 and ln2 rows in the backward ([N, D] each;
 * without recomputation: selective recomputation gathers ln2 once more where a dense or shared-expert
 * FFN's hidden activations are recomputed) and an all-reduce of each norm's weight gradient ([D], two
 * a layer, the final norm). */
static void tp_bytes(const tera_trainer *tr, int A, tera_comm_volume *cm) {
    const tera_model *m = &tr->model;
    if (tr->topo.tp < 2) return;
    const double N = (double)m->B * m->T, D = m->cfg.dim;
    double L = 0.0, moe = 0.0;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->held[l]) L += 1.0, moe += l >= m->cfg.first_k_dense;
    const int first = tr->topo.pp_rank == 0, last = tr->topo.pp_rank == tr->topo.pp - 1;
    const double rows = 4.0 * L * N * D + (first ? N * D : 0.0) + (last ? N * D : 0.0); /* the [N, D] sums */
    const double small = (last ? 3.0 * N : 0.0) + moe * N * m->cfg.top_k;
    const double r = ring(tr->topo.tp);
    if (m->par.sp) {
        const double norms = (2.0 * L + (last ? 1.0 : 0.0)) * D, inputs = 2.0 * L * N * D; /* ln1, ln2 again */
        cm->min[TERA_XFER_REDUCE_SCATTER] += A * r * 4.0 * rows;
        cm->min[TERA_XFER_ALLGATHER] += A * r * 4.0 * (rows + inputs);
        cm->min[TERA_XFER_ALLREDUCE] += A * 2.0 * r * 4.0 * (small + norms);
        cm->tp = A * r * 4.0 * (2.0 * rows + inputs + 2.0 * (small + norms));
        return;
    }
    cm->tp = A * 2.0 * r * 4.0 * (rows + small);
    cm->min[TERA_XFER_ALLREDUCE] += cm->tp;
}

/* All-gather of one group's parameters (its non-expert range over dp, its expert range over edp). */
static double group_gather(const tera_trainer *tr, int group) {
    double b = 0.0;
    for (int x = 0; x < 2; x++) {
        int64_t lo, hi;
        tera_model_group_range(&tr->model, group, x, &lo, &hi);
        b += 4.0 * ring(x ? tr->topo.edp : tr->topo.dp) * (double)(hi - lo);
    }
    return b;
}

/* ZeRO-3: a group's parameters are gathered before each use unless its staging slot (embedding,
 * head, the layer in use) still holds them from this step. The order of uses is the model's
 * (forward: embedding, layers 0..L-1, head, the embedding again when tied; backward: head, tied
 * embedding, layers L-1..0), so the head, the embedding and the last layer are gathered once a
 * step, the other layers twice per micro-batch, layer 0 once more for the next micro-batch. In a
 * pipeline stage the order is its schedule's (tera_pipe_param_uses): micro-batches interleave. */
static void zero3_gather_bytes(const tera_trainer *tr, int A, tera_comm_volume *cm) {
    if (tr->sharding->stage < 3) return;
    const int L = tr->model.cfg.n_layers, tied = tr->model.cfg.tie_embeddings;
    int held[3] = {INT32_MIN, INT32_MIN, INT32_MIN}; /* embedding, head, layer slots */
    int n = tr->topo.pp > 1 ? tera_pipe_param_uses(tr->pipe, NULL, 0) : A * (2 * L + 5);
    int *uses = tera_malloc(sizeof(int) * (size_t)(n + 1));
    if (tr->topo.pp > 1) {
        tera_pipe_param_uses(tr->pipe, uses, n);
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
    cm->min[TERA_XFER_ALLGATHER] += b;
}

/* Expert parallelism: each MoE layer's routed rows [N k, D] whose expert lives on another of
 * the ep ranks ((ep-1)/ep of them for uniform routing) go there and come back, in forward and
 * again in backward: 4 transfers, each row as the dispatcher encodes it on that wire (fp32, or
 * a2a_compression's, or bf16 rows out under bf16 products: tera_model_exchange_row_bytes). Before the
 * forward exchange, the row counts ([E/ep] int32 to each other rank) are exchanged (overhead). */
static void ep_bytes(const tera_trainer *tr, int A, tera_comm_volume *cm) {
    const tera_model *m = &tr->model;
    if (tr->topo.ep < 2) return;
    const double N = (double)m->B * m->T, rows = N * m->cfg.top_k;
    double moe = 0.0; /* this stage's MoE layers (all of them without a pipeline) */
    for (int l = m->cfg.first_k_dense; l < m->cfg.n_layers; l++) moe += m->held[l];
    const double row = (double)(tera_model_exchange_row_bytes(m, 0) + tera_model_exchange_row_bytes(m, 1));
    cm->ep = A * moe * 2.0 * ring(tr->topo.ep) * rows * row;
    cm->min[TERA_XFER_P2P] += cm->ep;
    cm->counts = A * moe * (tr->topo.ep - 1) * 4.0 * (m->cfg.n_experts / tr->topo.ep);
    cm->overhead[TERA_XFER_ALLTOALL] += cm->counts;
}

/* Pipeline parallelism, per micro-batch: each chunk sends its output activations [N, D] to the
 * next virtual stage unless it is the last, and its input gradients back unless it is the first;
 * and the head split's transfers (below). */
static void pp_bytes(const tera_trainer *tr, int A, tera_comm_volume *cm) {
    const tera_model *m = &tr->model;
    if (tr->topo.pp < 2) return;
    const int v = m->par.v, S = tr->topo.pp * v;
    double sends = 0.0;
    for (int c = 0; c < v; c++) {
        const int vs = c * tr->topo.pp + tr->topo.pp_rank;
        sends += (vs < S - 1) + (vs > 0);
    }
    cm->pp = A * sends * (double)m->Nr * m->cfg.dim * 4.0; /* sequence parallelism: this rank's rows */
    cm->min[TERA_XFER_P2P] += cm->pp;
    /* parallel.pp_head_split (src/model/head_split.h), between the first and the last stage's tp rank r: once a
     * step the owner (last) sends its vocabulary slice's first Vh rows (Vh = V / tp / 2) and the helper (first)
     * sends back their gradient ([Vh, D] each); per micro-batch the owner sends the final norm's output [N, D]
     * and the cross-entropy's maxima and sums over the vocabulary ([N], [2N]), the helper its own maxima and
     * sums and its partial input gradient [N, D]: the same bytes each way */
    if (m->par.head_role) {
        const double N = (double)m->B * m->T, D = m->cfg.dim;
        const double p2p = 4.0 * (double)(m->cfg.vocab_size / tr->topo.tp / 2) * D + A * 4.0 * (N * D + 3.0 * N);
        cm->min[TERA_XFER_P2P] += p2p;
        cm->pp += p2p;
    }
}

/* Statistics, once a step (src/train/trainer.c, src/train/layout.c): over the data-parallel ranks
 * of every stage the 5 loss sums (and with a pipeline each stage's busy and waiting seconds), the
 * expert load [L, E] int64, the router entropy [L] and the routed-token count; over the world the
 * squared gradient norm of every tensor (f64 each) and the update's 2 sums. */
static void stats_bytes(const tera_trainer *tr, tera_comm_volume *cm) {
    const tera_model *m = &tr->model;
    const double L = m->cfg.n_layers, E = m->cfg.n_experts;
    const double pipe = tr->topo.pp > 1 ? 2.0 * tr->topo.pp : 0.0; /* each stage's busy and waiting seconds */
    cm->stats = 2.0 * ring(tr->topo.dp * tr->topo.pp) * 8.0 * (5.0 + pipe + L * E + L + 1.0) +
                2.0 * ring(tr->topo.world) * 8.0 * ((double)m->n_params + 2.0);
    cm->overhead[TERA_XFER_ALLREDUCE] += cm->stats;
}

/* model.balance_loss = switch_dp: per micro-batch, every MoE layer of the stage all-reduces its E
 * expert counts (f64) over the data-parallel group, again when a full recomputation reruns the layer
 * (without a pipeline the last recomputing layer of the forward is not rerun: the work set still
 * holds it; with one, micro-batches interleave and this count is an upper bound). */
static void balance_bytes(const tera_trainer *tr, int A, tera_comm_volume *cm) {
    const tera_model *m = &tr->model;
    if (m->cfg.balance_loss != TERA_BALANCE_SWITCH_DP || tr->topo.dp < 2) return;
    double calls = 0.0;
    int top = -1; /* the last layer of the forward that uses the work set */
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->held[l] && m->recompute[l] != TERA_RECOMPUTE_NONE) top = l;
    for (int l = m->cfg.first_k_dense; l < m->cfg.n_layers; l++)
        if (m->held[l])
            calls += m->recompute[l] == TERA_RECOMPUTE_FULL && !(l == top && tr->topo.pp == 1) ? 2.0 : 1.0;
    const double b = A * calls * 2.0 * ring(tr->topo.dp) * 8.0 * m->cfg.n_experts;
    cm->stats += b;
    cm->overhead[TERA_XFER_ALLREDUCE] += b;
}

tera_comm_volume tera_trainer_comm_volume(const tera_trainer *tr, int A) {
    tera_comm_volume cm;
    memset(&cm, 0, sizeof cm);
    grad_bytes(tr, A, &cm);
    tp_bytes(tr, A, &cm);
    zero3_gather_bytes(tr, A, &cm);
    ep_bytes(tr, A, &cm);
    pp_bytes(tr, A, &cm);
    stats_bytes(tr, &cm);
    balance_bytes(tr, A, &cm);
    return cm;
}


int64_t tera_trainer_optimizer_bytes(const tera_trainer *tr) {
    return tera_zero_optimizer_bytes(tr->sharding); /* optimizer.moments: 8 or 4 bytes per element */
}
