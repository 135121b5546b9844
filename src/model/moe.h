/* MoE routing internals shared by the model's forward and backward (private to src/model). */
#ifndef TERA_MODEL_MOE_H
#define TERA_MODEL_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "tera/backend.h"
#include "tera/config.h"

/* Top-k per token by score = probs + bias (bias may be NULL); ties keep the lower expert index.
 * Any E and k <= E; O(N E k) at worst, no memory beyond the outputs.
 * probs: [N, E]  topi: [N, k]  topw: [N, k] (chosen probs renormalised to sum 1). */
void tera_moe_topk(tera_backend *be, int32_t *topi, float *topw, const float *probs, const float *bias, int64_t N, int E,
                   int k);

/* The router's options (tera_model_config: router_score, n_groups, topk_groups, routed_scale). */
typedef struct {
    tera_router_score score; /* softmax or sigmoid scores */
    int n_groups;            /* experts [g E/G, (g+1) E/G) form group g; 1 = no group limit */
    int topk_groups;         /* groups a token may use */
    float scale;             /* routed scaling factor on the combine weights */
    int force_balance;       /* model.router_force_balance: the fixed balanced pattern (tera_moe_route_at) */
} tera_moe_routing;

tera_moe_routing tera_moe_routing_of(const tera_model_config *c);

/* Router scores from logits: softmax over the E experts, or sigmoid of each logit; lse[N] is the
 * log-sum-exp of the logits under both (the z-loss).
 * logits: [N, E]  scores: [N, E]  lse: [N] */
void tera_moe_score_forward(tera_backend *be, float *scores, float *lse, const float *logits, int64_t N, int E,
                            tera_router_score score);

/* Top-k under the routing options. Selection score u = scores + bias (bias may be NULL).
 * n_groups > 1: a group's score is the max of its u (softmax) or the sum of its two largest u
 * (sigmoid; the one u when a group has one expert); the token keeps its topk_groups best groups
 * (ties: lower group index), then its top-k experts of those groups by u (ties: lower expert
 * index); experts of other groups are never chosen. Combine weights: the chosen scores (not u)
 * renormalised to sum 1, times r->scale. n_groups = 1 and scale = 1: exactly tera_moe_topk.
 * scores: [N, E]  topi: [N, k]  topw: [N, k]
 * scratch: tera_moe_route_scratch_bytes(r, threads) bytes for up to `threads` workers (the backend's
 * max_threads: ops.for_ranges hands each worker its index). */
size_t tera_moe_route_scratch_bytes(const tera_moe_routing *r, int threads);
void tera_moe_route(tera_backend *be, int32_t *topi, float *topw, const float *scores, const float *bias, int64_t N, int E, int k,
                    const tera_moe_routing *r, void *scratch);

/* tera_moe_route for rows at known sequence positions, under every routing option. With
 * r->force_balance (model.router_force_balance, benchmarking only) the scores and the bias are not
 * looked at for the selection: the token at position t of a sequence, in layer `layer` (the model's layer index), takes
 *     e_j = (t k + j + layer) mod E,  j = 0..k-1        (distinct for k <= E; in this order)
 * so a sequence of T tokens gives every expert T k / E assignments when E divides T k, the same in
 * every parallel layout and run; combine weights as tera_moe_route (the chosen scores renormalised to
 * sum 1, times r->scale), so the maths after the selection and the router's gradient are unchanged.
 * Group-limited routing is refused by the config check (the pattern ignores groups). Without
 * force_balance: exactly tera_moe_route (T, pos and layer unused).
 * Position of row n: pos[n] when pos is given (decoding), else n mod T (rows [B*T], sequence-major). */
void tera_moe_route_at(tera_backend *be, int32_t *topi, float *topw, const float *scores, const float *bias, int64_t N,
                       int E, int k, const tera_moe_routing *r, void *scratch, int T, const int32_t *pos, int layer);

/* Per-token sums of the scores (the normaliser of the sigmoid balancing loss), in a fixed order.
 * scores: [N, E]  rsum: [N] */
void tera_moe_score_sums(tera_backend *be, float *rsum, const float *scores, int64_t N, int E);

/* Backward of the sigmoid router (scores s = sigmoid(logits)): writes dlogits of
 *     sum_{t,j} dtopw[t,j] * w[t,j]                       w = scale * s_chosen / sum(s_chosen)
 *   + aux_scale * sum_b aux_b                             aux_b = E sum_e f_{b,e} P_{b,e},
 *                                                         P_{b,e} = mean_t s[t,e] / sum_e' s[t,e']
 *   + z_scale * sum_t lse[t]^2                            lse = logsumexp(logits[t])
 * where f_{b,e} = sel_count[b,e] / (T k) carries no gradient; the selection is not differentiated.
 * dlogits, logits, s: [B*T, E]  lse: [B*T]  topi, topw, dtopw: [B*T, k]  sel_count: [B, E] */
void tera_moe_sigmoid_backward(tera_backend *be, float *dlogits, const float *logits, const float *s, const float *lse,
                               const int32_t *topi, const float *topw, const float *dtopw,
                               const int32_t *sel_count, int B, int T, int E, int k, float scale,
                               float aux_scale, float z_scale);

/* Statistics of one layer's routing over B sequences of T tokens:
 *   aux     = sum_b E sum_e f_{b,e} P_{b,e}, f = sel_count / (T k), P_{b,e} = mean_t p[t,e] where p is
 *             the softmax probability, or (sigmoid) the score normalised per token, s / sum_e' s;
 *   z       = sum_t lse[t]^2;   entropy = sum_t of the entropy (nats) of p[t, :] (softmax: from the
 *             logits, -sum_e p (x - lse), without a logarithm).
 * Adds sel_count to load[E]. Sums run in a fixed order, on the backend's threads: P_{b,e} in token
 * order per expert, the entropy over fixed blocks of tokens; aux and z on the calling thread (the same
 * bits on any thread count). psum keeps, for tera_moe_balance_value, the sums of p (not yet divided):
 * row b < B over sequence b's tokens, row B over all B T tokens, each in token order.
 * scores, logits: [B*T, E]  lse: [B*T]  sel_count: [B, E]  rsum: [B*T] scratch (sigmoid; NULL
 * otherwise)  psum: [B + 1, E] */
typedef struct {
    double aux, z, entropy;
} tera_moe_stats;
tera_moe_stats tera_moe_route_stats(tera_backend *be, int64_t *load, float *rsum, double *psum, const float *scores,
                                    const float *logits, const float *lse, const int32_t *sel_count, int B, int T,
                                    int E, int k, tera_router_score score);

/* Router backward under either scoring: dlogits = d/dlogits of
 *   sum_{t,j} dtopw[t,j] w[t,j] + aux_scale * aux + z_scale * z     (aux, z as tera_moe_route_stats)
 * with the selection held fixed. Softmax: through dscores [B*T, E] (scratch) and the softmax
 * backward; sigmoid: tera_moe_sigmoid_backward.
 * dlogits, logits, scores: [B*T, E]  lse: [B*T]  topi, topw, dtopw: [B*T, k]  sel_count: [B, E] */
void tera_moe_router_backward(tera_backend *be, float *dlogits, float *dscores, const float *logits, const float *scores,
                              const float *lse, const int32_t *topi, const float *topw, const float *dtopw,
                              const int32_t *sel_count, int B, int T, int E, int k, const tera_moe_routing *r,
                              float aux_scale, float z_scale);

/* tera_moe_router_backward with gcount [E] (NULL: as tera_moe_router_backward): the balancing
 * gradient of every sequence uses gcount[e] in place of its sel_count[b, e] (switch_global). */
void tera_moe_router_backward_g(tera_backend *be, float *dlogits, float *dscores, const float *logits,
                                const float *scores, const float *lse, const int32_t *topi, const float *topw,
                                const float *dtopw, const int32_t *sel_count, const float *gcount, int B, int T,
                                int E, int k, const tera_moe_routing *r, float aux_scale, float z_scale);

/* The balancing loss of one micro-batch of B sequences of T tokens under model.balance_loss, in the
 * units of tera_fwd_stats.aux_sum (the trainer divides by MoE layers x sequences of the global batch,
 * so a per-micro-batch loss counts B times):
 *   switch          aux_switch (tera_moe_route_stats' aux: sum_b E sum_e f_{b,e} P_{b,e})
 *   switch_global   B E sum_e f_e P_e,  f_e = C_e / (B T k),  P_e = mean over the B T tokens of p[t,e]
 *   switch_dp       the same with C_e = gcnt[e]: the counts summed over the data-parallel ranks divided
 *                   by their number (the model computes it; NULL: this rank's, as switch_global)
 *   importance_load B (CV^2(I) + CV^2(L)),  I_e = sum of topw[t,j] over assignments to e,  L_e = C_e
 * with C_e = sum_b sel_count[b,e], p as tera_moe_route_stats, CV^2(x) = var(x) / (mean(x)^2 + 1e-10),
 * var with E - 1 in the denominator (0 when E = 1). Sums in a fixed order (no threads). psum is
 * tera_moe_route_stats' of the same micro-batch: its row B (the sums of p over all B T tokens) gives
 * P, and is scratch for importance_load.
 * psum: [B + 1, E]  topi, topw: [B*T, k]  sel_count: [B, E]  gcnt: [E] or NULL */
double tera_moe_balance_value(tera_balance_loss kind, double aux_switch, double *psum, const int32_t *topi,
                              const float *topw, const int32_t *sel_count, const float *gcnt, int B, int T, int E,
                              int k);

/* Prepares the router backward for model.balance_loss (call it after the combine weights' gradient
 * dtopw is complete, then tera_moe_router_backward_g with the returned gcount and *aux_scale):
 *   switch          returns NULL (the per-sequence gradient)
 *   switch_global   returns gcount [E] = C_e / B (floats written over scratch)
 *   switch_dp       the same with C_e = gcnt[e] (NULL: this rank's counts)
 *   importance_load adds aux_scale B dCV^2(I)/dI_e to dtopw[t,j] for e = topi[t,j] (the load term has
 *                   no gradient), sets *aux_scale = 0 and returns NULL
 * dtopw, topi, topw: [B*T, k]  sel_count: [B, E]  scratch: [E] doubles  gcnt: [E] or NULL */
const float *tera_moe_balance_backward_prep(tera_backend *be, tera_balance_loss kind, double *scratch, float *dtopw,
                                            const int32_t *topi, const float *topw, const int32_t *sel_count,
                                            const float *gcnt, int B, int T, int E, int k, float *aux_scale);

/* Builds the grouped layout of one micro-batch of B sequences of T tokens.
 * topi: [N, k]; probs: [N, E] (for the probability drop policy); capacity: per sequence and
 * expert (<= 0: dropless). Outputs:
 *   slot_row [N*k]: row of assignment a = t*k + j in the grouped buffers, or -1 when dropped
 *   row_tok  [N*k]: token of each row (rows ordered by expert, then by assignment index)
 *   exp_off  [E+1]: rows of expert e are [exp_off[e], exp_off[e+1])
 *   sel_count [B, E]: assignments of each sequence selected for each expert, before drops
 *   scratch: tera_moe_plan_scratch_bytes(N*k, B, E) bytes. Returns the number of dropped assignments. */
size_t tera_moe_plan_scratch_bytes(int64_t n_assign, int B, int E);
int64_t tera_moe_plan(tera_backend *be, int32_t *slot_row, int32_t *row_tok, int32_t *exp_off, int32_t *sel_count,
                      void *scratch, const int32_t *topi, const float *probs, int B, int T, int E,
                      int k, int capacity, tera_drop_policy policy);

#endif
