/* Hierarchical collectives and the data-parallel gradient reducer (src/comm/comm_hier.c).
 *
 * A group c whose members sit k to a node on N > 1 nodes (tera_comm_set_nodes; the same k on every
 * node, k > 1) is split into its node's members (local group, ordered by rank in c) and the members
 * with the same local index on every node (cross group, ordered by node). Then
 *   all-reduce      = reduce-scatter inside the node (k 16-float-aligned pieces), all-reduce of this
 *                     rank's piece across the nodes (1/k of the data), all-gather inside the node;
 *   reduce-scatter  = (ranges counts[r] of c's ranks) the buffer permuted so that local index j's
 *                     piece holds the ranges of the ranks with local index j on every node, in node
 *                     order: reduce-scatter of those pieces inside the node, then of the ranges
 *                     across the nodes; the range copied back to its place;
 *   all-gather      = the reverse: across the nodes, then inside, then un-permuted.
 * Every byte crossing a node boundary is in the cross-node stage: an all-reduce of B bytes sends
 * 2 (N-1) B across node boundaries in all (the minimum: each node's sum must leave it and every
 * other node's come in), against N x 2 (p-1)/p x B for a flat ring over p = N k ranks laid out node
 * by node. Results equal the flat collective's up to the order of fp32 additions (node sums first),
 * identical on every rank. */
#ifndef TERA_COMM_HIER_H
#define TERA_COMM_HIER_H

#include <stdint.h>

#include "tera/comm.h"
#include "tera/compress.h"

typedef struct tera_hier tera_hier;
/* Collective over c. NULL (nothing to do hierarchically: use c's flat collectives) when c's
 * members are on one node, one per node, or spread unevenly. n: the largest buffer (floats) a
 * reduce-scatter or all-gather will see (their permutation's scratch). */
tera_hier *tera_hier_create(tera_comm *c, int64_t n);
void tera_hier_free(tera_hier *h);
void tera_hier_shape(const tera_hier *h, int *nodes, int *per_node);
void tera_hier_allreduce_f32(tera_hier *h, float *buf /*[n]*/, int64_t n);
void tera_hier_reduce_scatter_f32(tera_hier *h, float *buf /*[sum counts]*/, const int64_t *counts);
void tera_hier_allgather_f32(tera_hier *h, float *buf /*[sum counts]*/, const int64_t *counts);

/* Two-stage all-to-all (the expert exchange across nodes, parallel.ep_hierarchical): the same
 * result as tera_comm_alltoallv_u8 over c (scounts[r] bytes from send, consecutive in c's rank
 * order, to rank r; rcounts[r] bytes from rank r into recv, consecutive), moved as
 *   1. inside the node: to local peer i, this rank's bytes for (node 0, i), (node 1, i), ...;
 *   2. across the nodes, among the ranks with the same local index (one "rail"): to node n, what
 *      every local peer sent for (n, this local index), in one message;
 * then placed at their sources' offsets in recv. Every byte for another node crosses once, in k
 * messages per node pair (one per rail) instead of k x k; bytes inside the node move twice.
 * Before a node stage, a count exchange of 8 N bytes per local peer. Scratch: two buffers of at
 * least max(sum scounts, sum rcounts, bytes relayed) bytes, reserved beforehand (no allocation
 * here). Collective over c. */
void tera_hier_reserve_alltoall(tera_hier *h, int64_t bytes);
void tera_hier_alltoallv_u8(tera_hier *h, const void *send, const int64_t *scounts, void *recv,
                            const int64_t *rcounts);
/* The same exchange in split phases, so that the caller computes while it is in flight
 * (parallel.ep_hierarchical with parallel.ep_overlap): the same bytes in the same places of recv and
 * the same bytes inside and across nodes, but the two stages are point-to-point messages on the
 * node and rail groups (counted as point-to-point traffic). Every count a multiple of 4 bytes.
 *   _start: the count exchange (blocking), then stage 1 posted; send is copied out on return;
 *   _wait(r): blocks until rank r's bytes are in recv (a rank on this node: once stage 1 is done;
 *             on node n: once stage 1 is done and node n's stage-2 message has come);
 *   _poll: progresses both stages without blocking (stage 2 is posted when stage 1 is done);
 *   _end: everything in recv and every send complete; the next exchange may start.
 * recv and scounts / rcounts must stay as they are until _end; one exchange at a time per h.
 * tera_hier_same_node: whether c-rank r is on this rank's node (its bytes come in stage 1). */
void tera_hier_ialltoallv_start(tera_hier *h, const void *send, const int64_t *scounts, void *recv,
                                const int64_t *rcounts);
void tera_hier_ialltoallv_wait(tera_hier *h, int r);
void tera_hier_ialltoallv_poll(tera_hier *h);
void tera_hier_ialltoallv_end(tera_hier *h);
int tera_hier_same_node(const tera_hier *h, int r);

/* The data-parallel gradient reducer of one region of n floats over c (parallel.hierarchical,
 * parallel.grad_compression): flat or hierarchical, fp32 or compressed with error feedback
 * (include/tera/compress.h; hierarchical: only the cross-node stage is compressed, inside a node
 * the sums stay fp32). Collective creation; NULL when both are off (or c has one rank): the caller
 * uses the plain collectives, bit for bit as before. */
typedef struct tera_greducer tera_greducer;
tera_greducer *tera_greducer_create(tera_comm *c, int64_t n, tera_compress_kind k, int hierarchical);
void tera_greducer_free(tera_greducer *g);
/* sums of buf = [off, off + len) of the region (all-reduce), of ranges counts[r] from off
 * (reduce-scatter: rank r's range holds the sum); all-gather of ranges (parameters: never
 * compressed, hierarchical when on) */
void tera_greducer_allreduce(tera_greducer *g, float *buf, int64_t off, int64_t len);
void tera_greducer_reduce_scatter(tera_greducer *g, float *buf, int64_t off, const int64_t *counts);
void tera_greducer_allgather(tera_greducer *g, float *buf, const int64_t *counts);
/* the compressed stage's error-feedback state (NULL when uncompressed): which 0 or 1, see
 * tera_creducer_state */
float *tera_greducer_state(tera_greducer *g, int which, int64_t *n);

#endif
