/* Hierarchical collectives and the gradient reducer (include/tera/comm_hier.h). */
#include "tera/comm_hier.h"

#include <stdlib.h>
#include <string.h>

struct tera_hier {
    tera_comm *c, *local, *cross;
    int N, k;          /* nodes, members per node */
    int ni, li;        /* this rank's node index (in c's order of nodes) and local index */
    int *at;           /* [N k] c-rank of (node i, local j) at at[i k + j] */
    float *tmp;        /* [n] the permuted buffer */
    int64_t n;
    int64_t *cl, *cx, *ll, *lx; /* [k] local counts and offsets, [N] cross counts and offsets */
    /* the two-stage all-to-all (tera_hier_alltoallv_u8): two byte buffers of a2a_cap bytes, and
     * counts: [k N] sent / received in the count exchange, [p + 1] offsets by c-rank, [k] and [N]
     * per-stage byte counts */
    uint8_t *a2a_a, *a2a_b;
    int64_t a2a_cap;
    int64_t *a2a_cs, *a2a_cr, *a2a_so, *a2a_ro, *a2a_s1, *a2a_r1, *a2a_s2, *a2a_r2;
    /* the split-phase one (tera_hier_ialltoallv_*): the call's buffers and counts, [k] offsets of
     * stage 1 by peer (sent, received), [N] of stage 2 by node (received), the requests ([k] sends, [k]
     * receives, [N] sends, [N] receives), and where it is: stage 1 in flight (1) or done (0), and
     * per node whether its rows are in recv */
    const int64_t *i_rc;
    uint8_t *i_recv;
    int64_t *i_o1, *i_p1, *i_o2;
    tera_comm_req *i_req;
    int i_stage1, i_active;
    int *i_here;
};

void tera_hier_shape(const tera_hier *h, int *nodes, int *per_node) {
    *nodes = h ? h->N : 1;
    *per_node = h ? h->k : 0;
}

tera_hier *tera_hier_create(tera_comm *c, int64_t n) {
    const int p = tera_comm_size(c), me = tera_comm_rank(c);
    if (p < 2) return NULL;
    /* node index of every member: nodes numbered in order of first appearance */
    int *node = tera_calloc((size_t)p, sizeof(int)), *idx = tera_calloc((size_t)p, sizeof(int)),
        *cnt = tera_calloc((size_t)p, sizeof(int));
    int N = 0;
    for (int r = 0; r < p; r++) {
        const int w = tera_comm_member_node(c, r);
        int i = 0;
        while (i < r && tera_comm_member_node(c, i) != w) i++;
        node[r] = i < r ? node[i] : N++;
        idx[r] = cnt[node[r]]++;
    }
    int even = 1;
    for (int i = 0; i < N; i++) even &= cnt[i] == cnt[0];
    const int k = cnt[0];
    tera_hier *h = NULL;
    if (N > 1 && k > 1 && even) { /* the same on every rank: every rank splits or none does */
        h = tera_calloc(1, sizeof *h);
        h->c = c, h->N = N, h->k = k, h->ni = node[me], h->li = idx[me], h->n = n;
        h->at = tera_calloc((size_t)p, sizeof(int));
        for (int r = 0; r < p; r++) h->at[node[r] * k + idx[r]] = r;
        h->local = tera_comm_split(c, h->ni, me);
        h->cross = tera_comm_split(c, h->li, h->ni);
        h->tmp = tera_calloc((size_t)n + 16, sizeof(float));
        h->cl = tera_calloc((size_t)(2 * k + 2 * N), sizeof(int64_t));
        h->ll = h->cl + k, h->cx = h->ll + k, h->lx = h->cx + N;
        h->a2a_cs = tera_calloc((size_t)(4 * k * N + 2 * (p + 1) + 2 * k + 2 * N), sizeof(int64_t));
        h->a2a_cr = h->a2a_cs + (int64_t)k * N;
        h->a2a_so = h->a2a_cr + (int64_t)k * N;
        h->a2a_ro = h->a2a_so + p + 1;
        h->a2a_s1 = h->a2a_ro + p + 1;
        h->a2a_r1 = h->a2a_s1 + k;
        h->a2a_s2 = h->a2a_r1 + k;
        h->a2a_r2 = h->a2a_s2 + N;
        h->i_o1 = tera_calloc((size_t)(2 * k + N), sizeof(int64_t));
        h->i_p1 = h->i_o1 + k, h->i_o2 = h->i_p1 + k;
        h->i_req = tera_calloc((size_t)(2 * k + 2 * N), sizeof(tera_comm_req));
        h->i_here = tera_calloc((size_t)N, sizeof(int));
    }
    free(node), free(idx), free(cnt);
    return h;
}

void tera_hier_free(tera_hier *h) {
    if (!h) return;
    tera_comm_free(h->local);
    tera_comm_free(h->cross);
    free(h->at), free(h->tmp), free(h->cl);
    free(h->a2a_cs), free(h->a2a_a), free(h->a2a_b);
    free(h->i_o1), free(h->i_req), free(h->i_here);
    free(h);
}

/* all-reduce with the cross-node stage given (z: compressed, at region offset off) */
static void hier_allreduce(tera_hier *h, float *buf, int64_t n, tera_creducer *z, int64_t off) {
    const int k = h->k;
    const int64_t S = ((n + k - 1) / k + 15) & ~(int64_t)15;
    for (int j = 0; j < k; j++) {
        h->ll[j] = (int64_t)j * S < n ? (int64_t)j * S : n;
        h->cl[j] = (h->ll[j] + S < n ? h->ll[j] + S : n) - h->ll[j];
    }
    tera_comm_reduce_scatter_f32(h->local, buf, h->cl);
    float *piece = buf + h->ll[h->li];
    if (z)
        tera_creducer_allreduce(z, piece, off + h->ll[h->li], h->cl[h->li]);
    else
        tera_comm_allreduce_f32(h->cross, piece, h->cl[h->li]);
    tera_comm_allgather_f32(h->local, buf, h->cl);
}

void tera_hier_allreduce_f32(tera_hier *h, float *buf, int64_t n) { hier_allreduce(h, buf, n, NULL, 0); }

/* the permutation: local index j's piece = the ranges of (node 0, j), (node 1, j), ...; fills the
 * local counts/offsets (cl, ll) and this local index's cross counts/offsets (cx, lx, relative to
 * its piece); returns the total */
static int64_t permute_plan(tera_hier *h, const int64_t *counts) {
    int64_t at = 0;
    for (int j = 0; j < h->k; j++) {
        h->ll[j] = at;
        h->cl[j] = 0;
        for (int i = 0; i < h->N; i++) {
            const int64_t c = counts[h->at[i * h->k + j]];
            if (j == h->li) h->lx[i] = h->cl[j], h->cx[i] = c;
            h->cl[j] += c;
        }
        at += h->cl[j];
    }
    TERA_ASSERTF(at <= h->n, "hierarchical collective of %ld floats, scratch for %ld", (long)at, (long)h->n);
    return at;
}

/* c-rank r's range's start in buf */
static int64_t range_lo(const tera_hier *h, const int64_t *counts, int r) {
    (void)h;
    int64_t lo = 0;
    for (int q = 0; q < r; q++) lo += counts[q];
    return lo;
}

/* moves every range between buf (c's rank order) and tmp (the permuted order): to_tmp 1 or 0 */
static void permute(tera_hier *h, float *buf, const int64_t *counts, int to_tmp) {
    for (int j = 0; j < h->k; j++) {
        int64_t at = h->ll[j];
        for (int i = 0; i < h->N; i++) {
            const int r = h->at[i * h->k + j];
            const int64_t lo = range_lo(h, counts, r), c = counts[r];
            if (c > 0) {
                if (to_tmp) memcpy(h->tmp + at, buf + lo, sizeof(float) * (size_t)c);
                else memcpy(buf + lo, h->tmp + at, sizeof(float) * (size_t)c);
            }
            at += c;
        }
    }
}

static void hier_reduce_scatter(tera_hier *h, float *buf, const int64_t *counts, tera_creducer *z, int64_t off) {
    permute_plan(h, counts);
    permute(h, buf, counts, 1);
    tera_comm_reduce_scatter_f32(h->local, h->tmp, h->cl);
    float *piece = h->tmp + h->ll[h->li];
    if (z)
        tera_creducer_reduce_scatter(z, piece, off + h->ll[h->li], h->cx);
    else
        tera_comm_reduce_scatter_f32(h->cross, piece, h->cx);
    const int me = tera_comm_rank(h->c);
    if (counts[me] > 0)
        memcpy(buf + range_lo(h, counts, me), piece + h->lx[h->ni], sizeof(float) * (size_t)counts[me]);
}

void tera_hier_reduce_scatter_f32(tera_hier *h, float *buf, const int64_t *counts) {
    hier_reduce_scatter(h, buf, counts, NULL, 0);
}

void tera_hier_allgather_f32(tera_hier *h, float *buf, const int64_t *counts) {
    permute_plan(h, counts);
    const int me = tera_comm_rank(h->c);
    float *piece = h->tmp + h->ll[h->li];
    if (counts[me] > 0)
        memcpy(piece + h->lx[h->ni], buf + range_lo(h, counts, me), sizeof(float) * (size_t)counts[me]);
    tera_comm_allgather_f32(h->cross, piece, h->cx);
    tera_comm_allgather_f32(h->local, h->tmp, h->cl);
    permute(h, buf, counts, 0);
}

/* ---- the two-stage all-to-all */
void tera_hier_reserve_alltoall(tera_hier *h, int64_t bytes) {
    if (bytes <= h->a2a_cap) return;
    free(h->a2a_a), free(h->a2a_b);
    h->a2a_a = tera_malloc((size_t)bytes);
    h->a2a_b = tera_malloc((size_t)bytes);
    h->a2a_cap = bytes;
}

/* The start of both forms: the offsets so/ro of send and recv; step 0, the counts inside the node
 * (local peer i learns, for every node n, how many bytes this rank sends to (n, i); cr[i N + n] =
 * bytes (ni, i) sends to (n, li)); stage 1's counts s1/r1 and, per local peer, where its outgoing
 * piece starts in a (o1, may be NULL) and its incoming piece in b (p1, may be NULL); then a packed
 * for stage 1: to local peer i, the rows for (0, i), (1, i), ... in node order. */
static void two_stage_begin(tera_hier *h, const uint8_t *in, const int64_t *scounts, const int64_t *rcounts,
                            int64_t *o1, int64_t *p1) {
    const int N = h->N, k = h->k, p = N * k;
    int64_t *so = h->a2a_so, *ro = h->a2a_ro;
    so[0] = ro[0] = 0;
    for (int r = 0; r < p; r++) so[r + 1] = so[r] + scounts[r], ro[r + 1] = ro[r] + rcounts[r];
    for (int i = 0; i < k; i++)
        for (int n = 0; n < N; n++) h->a2a_cs[i * N + n] = scounts[h->at[n * k + i]];
    for (int i = 0; i < k; i++) h->a2a_s1[i] = h->a2a_r1[i] = 8 * (int64_t)N;
    tera_comm_alltoallv_u8(h->local, h->a2a_cs, h->a2a_s1, h->a2a_cr, h->a2a_r1, TERA_TRAFFIC_ALLTOALL);
    int64_t relayed = 0; /* bytes this rank receives in stage 1 and forwards in stage 2 */
    for (int i = 0; i < k; i++) {
        h->a2a_s1[i] = h->a2a_r1[i] = 0;
        for (int n = 0; n < N; n++) h->a2a_s1[i] += scounts[h->at[n * k + i]], h->a2a_r1[i] += h->a2a_cr[i * N + n];
        if (o1) o1[i] = i ? o1[i - 1] + h->a2a_s1[i - 1] : 0;
        if (p1) p1[i] = relayed;
        relayed += h->a2a_r1[i];
    }
    int64_t need = so[p] > ro[p] ? so[p] : ro[p];
    if (relayed > need) need = relayed;
    TERA_ASSERTF(need <= h->a2a_cap, "hierarchical all-to-all of %ld bytes, scratch for %ld (tera_hier_reserve_alltoall)",
                 (long)need, (long)h->a2a_cap);
    int64_t at = 0;
    for (int i = 0; i < k; i++)
        for (int n = 0; n < N; n++) {
            const int r = h->at[n * k + i];
            memcpy(h->a2a_a + at, in + so[r], (size_t)scounts[r]);
            at += scounts[r];
        }
}

void tera_hier_alltoallv_u8(tera_hier *h, const void *send, const int64_t *scounts, void *recv,
                            const int64_t *rcounts) {
    const int N = h->N, k = h->k;
    uint8_t *out = recv;
    const int64_t *ro = h->a2a_ro;
    two_stage_begin(h, send, scounts, rcounts, NULL, NULL);
    /* 1. inside the node */
    uint8_t *a = h->a2a_a, *b = h->a2a_b;
    int64_t at = 0;
    tera_comm_alltoallv_u8(h->local, a, h->a2a_s1, b, h->a2a_r1, TERA_TRAFFIC_ALLTOALL);
    /* 2. across the nodes, among the ranks with this local index: to node n, what every local peer i
     * sent for (n, li), in local order; b holds them by peer, then node */
    for (int n = 0; n < N; n++) {
        h->a2a_s2[n] = 0;
        h->a2a_r2[n] = 0;
        for (int i = 0; i < k; i++) h->a2a_s2[n] += h->a2a_cr[i * N + n], h->a2a_r2[n] += rcounts[h->at[n * k + i]];
    }
    at = 0;
    for (int n = 0; n < N; n++)
        for (int i = 0; i < k; i++) {
            int64_t from = 0; /* peer i's piece for node n in b */
            for (int q = 0; q < i; q++) from += h->a2a_r1[q];
            for (int m = 0; m < n; m++) from += h->a2a_cr[i * N + m];
            memcpy(a + at, b + from, (size_t)h->a2a_cr[i * N + n]);
            at += h->a2a_cr[i * N + n];
        }
    tera_comm_alltoallv_u8(h->cross, a, h->a2a_s2, b, h->a2a_r2, TERA_TRAFFIC_ALLTOALL);
    /* b: from node n, the rows of (n, 0), (n, 1), ... for this rank: into their sources' places */
    at = 0;
    for (int n = 0; n < N; n++)
        for (int i = 0; i < k; i++) {
            const int r = h->at[n * k + i];
            memcpy(out + ro[r], b + at, (size_t)rcounts[r]);
            at += rcounts[r];
        }
}

/* ---- the split-phase two-stage all-to-all: the stages as point-to-point messages on the node and
 * rail groups (one tag each; an exchange completes before the next starts) */
enum { HIER_TAG_NODE = 7001, HIER_TAG_RAIL = 7002 };

int tera_hier_same_node(const tera_hier *h, int r) {
    for (int i = 0; i < h->k; i++)
        if (h->at[h->ni * h->k + i] == r) return 1;
    return 0;
}

/* the node of c-rank r */
static int hier_node_of(const tera_hier *h, int r) {
    for (int j = 0; j < h->N * h->k; j++)
        if (h->at[j] == r) return j / h->k;
    TERA_ASSERTF(0, "rank %d is not in the group", r);
    return -1;
}

static int64_t f32_count(int64_t bytes) {
    TERA_ASSERTF(bytes % 4 == 0, "split-phase two-stage all-to-all of %ld bytes: a multiple of 4 expected", (long)bytes);
    return bytes / 4;
}

void tera_hier_ialltoallv_start(tera_hier *h, const void *send, const int64_t *scounts, void *recv,
                                const int64_t *rcounts) {
    TERA_ASSERTF(!h->i_active, "a split-phase two-stage all-to-all is already in flight");
    const int N = h->N, k = h->k;
    two_stage_begin(h, send, scounts, rcounts, h->i_o1, h->i_p1); /* send is read here only */
    h->i_rc = rcounts, h->i_recv = recv;
    h->i_active = 1, h->i_stage1 = 1;
    for (int n = 0; n < N; n++) h->i_here[n] = 0;
    /* 1. inside the node, posted */
    uint8_t *a = h->a2a_a, *b = h->a2a_b;
    tera_comm_req *snd = h->i_req, *rcv = h->i_req + k;
    for (int i = 0; i < k; i++) {
        if (i == h->li) {
            memcpy(b + h->i_p1[i], a + h->i_o1[i], (size_t)h->a2a_s1[i]);
            snd[i] = rcv[i] = (tera_comm_req){0};
            continue;
        }
        tera_comm_irecv_f32(h->local, (float *)(void *)(b + h->i_p1[i]), f32_count(h->a2a_r1[i]), i, HIER_TAG_NODE,
                            &rcv[i]);
        tera_comm_isend_f32(h->local, (const float *)(const void *)(a + h->i_o1[i]), f32_count(h->a2a_s1[i]), i,
                            HIER_TAG_NODE, &snd[i]);
    }
}

/* stage 1 finished (block: wait for it): this node's rows into recv, stage 2 posted. Returns 1
 * when stage 1 is done. */
static int hier_stage1(tera_hier *h, int block) {
    if (!h->i_stage1) return 1;
    const int N = h->N, k = h->k;
    tera_comm_req *r1 = h->i_req;
    if (block)
        for (int i = 0; i < 2 * k; i++) tera_comm_wait(&r1[i]);
    else
        tera_comm_poll(r1, 2 * k);
    for (int i = 0; i < 2 * k; i++)
        if (r1[i].active) return 0;
    h->i_stage1 = 0;
    uint8_t *a = h->a2a_a, *b = h->a2a_b;
    const int64_t *cr = h->a2a_cr;
    /* peer i's piece for node n sits in b at p1[i] + (its pieces for nodes before n) */
    for (int i = 0; i < k; i++) {
        int64_t from = h->i_p1[i];
        for (int m = 0; m < h->ni; m++) from += cr[i * N + m];
        const int r = h->at[h->ni * k + i];
        TERA_ASSERTF(cr[i * N + h->ni] == h->i_rc[r], "two-stage all-to-all: rank %d sends %ld bytes, %ld expected", r,
                     (long)cr[i * N + h->ni], (long)h->i_rc[r]);
        memcpy(h->i_recv + h->a2a_ro[r], b + from, (size_t)h->i_rc[r]);
    }
    h->i_here[h->ni] = 1;
    /* 2. across the nodes on this rail: to node n (n != this node), every local peer's rows for
     * (n, li) in local order, from a; from node n, its ranks' rows for this rank into b */
    int64_t at = 0, rat = 0;
    tera_comm_req *snd = h->i_req + 2 * k, *rcv = h->i_req + 2 * k + N;
    for (int n = 0; n < N; n++) {
        snd[n] = rcv[n] = (tera_comm_req){0};
        h->a2a_s2[n] = h->a2a_r2[n] = 0;
        if (n == h->ni) continue;
        for (int i = 0; i < k; i++) h->a2a_r2[n] += h->i_rc[h->at[n * k + i]];
        h->i_o2[n] = rat;
        rat += h->a2a_r2[n];
    }
    for (int n = 0; n < N; n++) {
        if (n == h->ni) continue;
        const int64_t start = at;
        for (int i = 0; i < k; i++) {
            int64_t from = h->i_p1[i];
            for (int m = 0; m < n; m++) from += cr[i * N + m];
            memcpy(a + at, b + from, (size_t)cr[i * N + n]);
            at += cr[i * N + n];
        }
        h->a2a_s2[n] = at - start;
    }
    /* every piece is out of b before a receive into it is posted */
    at = 0;
    for (int n = 0; n < N; n++) {
        if (n == h->ni) continue;
        tera_comm_irecv_f32(h->cross, (float *)(void *)(b + h->i_o2[n]), f32_count(h->a2a_r2[n]), n, HIER_TAG_RAIL,
                            &rcv[n]);
        tera_comm_isend_f32(h->cross, (const float *)(const void *)(a + at), f32_count(h->a2a_s2[n]), n, HIER_TAG_RAIL,
                            &snd[n]);
        at += h->a2a_s2[n];
    }
    return 1;
}

/* node n's rows (from stage 2) into recv */
static void hier_unpack(tera_hier *h, int n) {
    tera_comm_wait(&h->i_req[2 * h->k + h->N + n]);
    int64_t at = h->i_o2[n];
    for (int i = 0; i < h->k; i++) {
        const int r = h->at[n * h->k + i];
        memcpy(h->i_recv + h->a2a_ro[r], h->a2a_b + at, (size_t)h->i_rc[r]);
        at += h->i_rc[r];
    }
    h->i_here[n] = 1;
}

void tera_hier_ialltoallv_wait(tera_hier *h, int r) {
    TERA_ASSERTF(h->i_active, "no split-phase two-stage all-to-all in flight");
    const int n = hier_node_of(h, r);
    if (h->i_here[n]) return;
    hier_stage1(h, 1);
    if (!h->i_here[n]) hier_unpack(h, n);
}

void tera_hier_ialltoallv_poll(tera_hier *h) {
    if (!h->i_active) return;
    if (hier_stage1(h, 0)) tera_comm_poll(h->i_req + 2 * h->k, 2 * h->N);
}

void tera_hier_ialltoallv_end(tera_hier *h) {
    TERA_ASSERTF(h->i_active, "no split-phase two-stage all-to-all in flight");
    hier_stage1(h, 1);
    for (int n = 0; n < h->N; n++)
        if (!h->i_here[n]) hier_unpack(h, n);
    for (int n = 0; n < h->N; n++) tera_comm_wait(&h->i_req[2 * h->k + n]);
    h->i_active = 0;
}

/* ---- the gradient reducer */
struct tera_greducer {
    tera_comm *c;
    tera_hier *h;      /* NULL: flat */
    tera_creducer *z;  /* NULL: fp32; over the cross group when hierarchical, else over c */
};

tera_greducer *tera_greducer_create(tera_comm *c, int64_t n, tera_compress_kind k, int hierarchical) {
    if (tera_comm_size(c) < 2 || (k == TERA_COMPRESS_NONE && !hierarchical)) return NULL;
    tera_hier *h = hierarchical ? tera_hier_create(c, n) : NULL;
    if (!h && k == TERA_COMPRESS_NONE) return NULL; /* hierarchical on one node: flat as before */
    tera_greducer *g = tera_calloc(1, sizeof *g);
    g->c = c;
    g->h = h;
    if (k != TERA_COMPRESS_NONE) g->z = tera_creducer_create(h ? h->cross : c, k, n);
    return g;
}

void tera_greducer_free(tera_greducer *g) {
    if (!g) return;
    tera_creducer_free(g->z);
    tera_hier_free(g->h);
    free(g);
}

void tera_greducer_allreduce(tera_greducer *g, float *buf, int64_t off, int64_t len) {
    if (g->h) hier_allreduce(g->h, buf, len, g->z, off);
    else if (g->z) tera_creducer_allreduce(g->z, buf, off, len);
    else tera_comm_allreduce_f32(g->c, buf, len);
}

void tera_greducer_reduce_scatter(tera_greducer *g, float *buf, int64_t off, const int64_t *counts) {
    if (g->h) hier_reduce_scatter(g->h, buf, counts, g->z, off);
    else if (g->z) tera_creducer_reduce_scatter(g->z, buf, off, counts);
    else tera_comm_reduce_scatter_f32(g->c, buf, counts);
}

void tera_greducer_allgather(tera_greducer *g, float *buf, const int64_t *counts) {
    if (g->h) tera_hier_allgather_f32(g->h, buf, counts);
    else tera_comm_allgather_f32(g->c, buf, counts);
}

float *tera_greducer_state(tera_greducer *g, int which, int64_t *n) {
    *n = 0;
    return g && g->z ? tera_creducer_state(g->z, which, n) : NULL;
}
