/* Node-aware communication (include/tera/comm.h: tera_comm_set_nodes and the inter-node byte
 * counters; include/tera/comm_hier.h: hierarchical collectives and the gradient reducer).
 *
 * This program runs itself under mpirun (skipped without mpirun) on 4 ranks as 2 nodes of 2, 6 as 3
 * nodes of 2, and 8 as 2 nodes of 4 (parallel.ranks_per_node emulating nodes on one machine), and
 * checks on every rank:
 *   - host detection (ranks_per_node = 0): every rank of this machine on one node;
 *   - hierarchical all-reduce, reduce-scatter (uneven ZeRO-like ranges, an empty one) and
 *     all-gather equal the flat ones bit for bit on integer-valued floats (every order of
 *     additions exact) and within fp32 reordering (1e-6 relative) on random ones, the same bits on
 *     every rank;
 *   - bytes crossing node boundaries, summed over the ranks: a flat ring all-reduce of B bytes
 *     N x 2 (p-1)/p x B, the hierarchical one exactly 2 (N-1) B (the analytic minimum), nothing
 *     crossing inside the node stages; reduce-scatter and all-gather (N-1) B hierarchical;
 *   - the same on a sub-group spread over the nodes (the data-parallel group of tp = 2);
 *   - the two-stage all-to-all, blocking and split-phase (sources waited for one by one, with
 *     polls), against the flat one: the same bytes in the same places, the same bytes across nodes;
 *   - hierarchical + bf16 gradient compression: the same answer on every rank, within bf16 of
 *     the exact sum, at most half the fp32 hierarchical inter-node bytes. */
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/comm.h"
#include "tera/comm_hier.h"
#include "tera/topology.h"

#define CHECK(cond) TU_RANK_CHECK(me, cond)

static int me;
enum { NV = 3000 };

static int g_nodes = 1;

/* the job's sums of the ranks' counters, less what these sums themselves sent (an all-reduce of 80
 * bytes over the world: 2 (W-1)/W x 80 per rank, across nodes on the last rank of each node) */
static void job_traffic(double out[10]) {
    static double own_total = 0.0, own_inter = 0.0;
    const tera_comm_traffic t = tera_comm_traffic_get();
    const double v[10] = {t.allreduce,       t.reduce_scatter,       t.allgather,       t.alltoall,       t.p2p,
                          t.inter_allreduce, t.inter_reduce_scatter, t.inter_allgather, t.inter_alltoall, t.inter_p2p};
    memcpy(out, v, sizeof v);
    tera_comm_allreduce_f64(tera_comm_world(), out, 10);
    out[0] -= own_total;
    out[5] -= own_inter;
    const double W = tera_comm_size(tera_comm_world());
    own_total += 2.0 * (W - 1) * 80.0;
    own_inter += g_nodes > 1 ? g_nodes * 2.0 * (W - 1) / W * 80.0 : 0.0;
}

static int near(double a, double b) { return fabs(a - b) <= 1e-9 * fmax(fabs(b), 1.0); }

/* every rank holds the same bits: each rank's hash equals the mean of all (so all are equal) */
static void same_everywhere(tera_comm *c, const float *x, int64_t n) {
    int64_t h = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        h = (h * 1000003 + u) % 1000000007;
    }
    int64_t s = h;
    tera_comm_allreduce_i64(c, &s, 1);
    CHECK(s == tera_comm_size(c) * h);
}

/* one group's checks: c's members k to a node on N nodes (N = 1 or k = 1: no hierarchy) */
static void check_group(tera_comm *c, int N, int k, int integers) {
    const int p = tera_comm_size(c), r = tera_comm_rank(c);
    float *a = calloc(NV, sizeof(float)), *b = calloc(NV, sizeof(float)), *x = calloc(NV, sizeof(float));
    tu_fill(x, NV, (uint64_t)(100 + tera_comm_rank(tera_comm_world())), 4.0f);
    if (integers)
        for (int i = 0; i < NV; i++) x[i] = rintf(x[i] * 1000.0f);
    tera_hier *h = tera_hier_create(c, NV);
    int hn, hk;
    tera_hier_shape(h, &hn, &hk);
    CHECK((N > 1 && k > 1) ? (h && hn == N && hk == k) : !h);
    if (!h) {
        free(a), free(b), free(x);
        return;
    }
    double t0[10], t1[10], t2[10];
    /* all-reduce */
    memcpy(a, x, sizeof(float) * NV);
    memcpy(b, x, sizeof(float) * NV);
    job_traffic(t0);
    tera_comm_allreduce_f32(c, a, NV);
    job_traffic(t1);
    tera_hier_allreduce_f32(h, b, NV);
    job_traffic(t2);
    if (integers)
        CHECK(memcmp(a, b, sizeof(float) * NV) == 0);
    else
        CHECK(tu_close("hierarchical all-reduce", b, a, NV, 1e-6, 1e-6) <= 1.0);
    same_everywhere(c, b, NV);
    const double B = 4.0 * NV, groups = (double)tera_comm_size(tera_comm_world()) / p; /* groups like c */
    /* flat ring: N boundary edges of 2 (p-1)/p B each; hierarchical: 2 (N-1) B, the minimum */
    CHECK(near((t1[5] - t0[5]) / groups, N * 2.0 * (p - 1) / p * B));
    CHECK(near((t2[5] + t2[6] + t2[7] - t1[5] - t1[6] - t1[7]) / groups, 2.0 * (N - 1) * B));
    CHECK(near((t2[0] + t2[1] + t2[2] - t1[0] - t1[1] - t1[2]) / groups,
               2.0 * (N - 1) * B + N * k * 2.0 * (k - 1) / k * B)); /* + the node stages' bytes, all intra */
    if (me == 0)
        printf("  group of %d on %d nodes: all-reduce of %.0f bytes, bytes across nodes (job) flat %.0f, hierarchical "
               "%.0f (minimum 2 (N-1) B = %.0f)\n",
               p, N, B, (t1[5] - t0[5]) / groups, (t2[5] + t2[6] + t2[7] - t1[5] - t1[6] - t1[7]) / groups,
               2.0 * (N - 1) * B);
    /* reduce-scatter and all-gather over uneven ranges */
    int64_t cnt[16], lo = 0, mylo = 0;
    CHECK(p <= 16);
    for (int q = 0; q < p; q++) {
        cnt[q] = q == 1 ? 0 : (NV / p) - 16 * (q % 3);
        if (q == r) mylo = lo;
        lo += cnt[q];
    }
    memcpy(a, x, sizeof(float) * NV);
    memcpy(b, x, sizeof(float) * NV);
    tera_comm_reduce_scatter_f32(c, a, cnt);
    job_traffic(t0);
    tera_hier_reduce_scatter_f32(h, b, cnt);
    job_traffic(t1);
    if (integers)
        CHECK(memcmp(a + mylo, b + mylo, sizeof(float) * (size_t)cnt[r]) == 0);
    else
        CHECK(tu_close("hierarchical reduce-scatter", b + mylo, a + mylo, cnt[r], 1e-6, 1e-6) <= 1.0);
    CHECK(near((t1[5] + t1[6] + t1[7] - t0[5] - t0[6] - t0[7]) / groups, (N - 1) * 4.0 * (double)lo));
    for (int i = 0; i < NV; i++) a[i] = b[i] = -1.0f;
    for (int64_t i = mylo; i < mylo + cnt[r]; i++) a[i] = b[i] = (float)(i * 7 + r);
    tera_comm_allgather_f32(c, a, cnt);
    job_traffic(t0);
    tera_hier_allgather_f32(h, b, cnt);
    job_traffic(t1);
    CHECK(memcmp(a, b, sizeof(float) * (size_t)lo) == 0);
    CHECK(near((t1[5] + t1[6] + t1[7] - t0[5] - t0[6] - t0[7]) / groups, (N - 1) * 4.0 * (double)lo));
    /* two-stage all-to-all: the flat one's bytes in the flat one's places; the same bytes cross nodes
     * (in k messages per node pair instead of k x k), the rest moves inside the nodes */
    {
#define A2A_BYTES(src, dst) ((int64_t)(((src) * 5 + (dst) * 3) % 7) * 13 + ((src) == 1 ? 0 : 3))
        int64_t sc[16], rc[16], st = 0, rt = 0;
        for (int q = 0; q < p; q++) sc[q] = A2A_BYTES(r, q), rc[q] = A2A_BYTES(q, r), st += sc[q], rt += rc[q];
        uint8_t *sb = malloc((size_t)st + 1), *ra = malloc((size_t)rt + 1), *rb = malloc((size_t)rt + 1);
        int64_t o = 0;
        for (int q = 0; q < p; q++)
            for (int64_t i = 0; i < sc[q]; i++) sb[o++] = (uint8_t)(r * 31 + q * 7 + i);
        memset(rb, 0xEE, (size_t)rt + 1);
        job_traffic(t0);
        tera_comm_alltoallv_u8(c, sb, sc, ra, rc, TERA_TRAFFIC_ALLTOALL);
        job_traffic(t1);
        tera_hier_reserve_alltoall(h, (int64_t)k * (st > rt ? st : rt) * 4);
        tera_hier_alltoallv_u8(h, sb, sc, rb, rc);
        job_traffic(t2);
        CHECK(memcmp(ra, rb, (size_t)rt) == 0);
        o = 0; /* and the flat one is right: from q, the bytes q made for this rank */
        for (int q = 0; q < p; q++)
            for (int64_t i = 0; i < rc[q]; i++) CHECK(ra[o++] == (uint8_t)(q * 31 + r * 7 + i));
        const double flat_inter = (t1[8] - t0[8]) / groups, hier_inter = (t2[8] - t1[8]) / groups;
        double want = 0.0; /* every pair on different nodes, in c's node numbering */
        for (int s0 = 0; s0 < p; s0++)
            for (int d0 = 0; d0 < p; d0++)
                if (tera_comm_member_node(c, s0) != tera_comm_member_node(c, d0)) want += (double)A2A_BYTES(s0, d0);
        CHECK(near(flat_inter, want) && near(hier_inter, want));
        CHECK((t2[3] - t1[3]) / groups > (t1[3] - t0[3]) / groups); /* relayed inside the nodes too */
        if (me == 0)
            printf("  two-stage all-to-all: %.0f bytes across nodes (flat %.0f), %.0f in all (flat %.0f)\n", hier_inter,
                   flat_inter, (t2[3] - t1[3]) / groups, (t1[3] - t0[3]) / groups);
        /* the split-phase one (words: counts x 4): the flat answer, whichever order the sources
         * are waited for (here the ring from this rank backwards), with polls in between; the
         * same bytes across nodes (as point-to-point), none in the count exchange */
        int64_t sw[16], rw[16], swt = 0, rwt = 0;
        for (int q = 0; q < p; q++) sw[q] = 4 * sc[q], rw[q] = 4 * rc[q], swt += sw[q], rwt += rw[q];
        uint8_t *sb4 = malloc((size_t)swt + 1), *ra4 = malloc((size_t)rwt + 1), *rb4 = malloc((size_t)rwt + 1);
        for (int64_t i = 0; i < swt; i++) sb4[i] = (uint8_t)(i * 13 + r * 101 + 1);
        memset(rb4, 0xEE, (size_t)rwt + 1);
        tera_comm_alltoallv_u8(c, sb4, sw, ra4, rw, TERA_TRAFFIC_ALLTOALL);
        tera_hier_reserve_alltoall(h, (int64_t)k * (swt > rwt ? swt : rwt));
        job_traffic(t0);
        tera_hier_ialltoallv_start(h, sb4, sw, rb4, rw);
        memset(sb4, 0, (size_t)swt); /* copied out at the start */
        for (int i = 0; i < p; i++) {
            const int q = (r - i + p) % p;
            tera_hier_ialltoallv_wait(h, q);
            int64_t qlo = 0;
            for (int u = 0; u < q; u++) qlo += rw[u];
            CHECK(memcmp(ra4 + qlo, rb4 + qlo, (size_t)rw[q]) == 0); /* rank q's bytes are here */
            CHECK(tera_hier_same_node(h, q) == (tera_comm_member_node(c, q) == tera_comm_member_node(c, r)));
            tera_hier_ialltoallv_poll(h);
        }
        tera_hier_ialltoallv_end(h);
        job_traffic(t1);
        CHECK(memcmp(ra4, rb4, (size_t)rwt) == 0 && rb4[rwt] == 0xEE);
        const double split_inter = (t1[8] + t1[9] - t0[8] - t0[9]) / groups;
        CHECK(near(split_inter, 4.0 * want) && t1[8] == t0[8]);
        /* and again (the state is reset by _end), waiting for nothing before the end */
        memset(rb4, 0xEE, (size_t)rwt + 1);
        for (int64_t i = 0; i < swt; i++) sb4[i] = (uint8_t)(i * 13 + r * 101 + 1);
        tera_hier_ialltoallv_start(h, sb4, sw, rb4, rw);
        tera_hier_ialltoallv_end(h);
        CHECK(memcmp(ra4, rb4, (size_t)rwt) == 0);
        if (me == 0) printf("  split-phase two-stage all-to-all: %.0f bytes across nodes (4 x %.0f)\n", split_inter, want);
        free(sb4), free(ra4), free(rb4);
        free(sb), free(ra), free(rb);
#undef A2A_BYTES
    }
    tera_hier_free(h);
    /* hierarchical + bf16: the cross-node stage compressed */
    tera_greducer *g = tera_greducer_create(c, NV, TERA_COMPRESS_BF16, 1);
    CHECK(g != NULL);
    memcpy(a, x, sizeof(float) * NV);
    memcpy(b, x, sizeof(float) * NV);
    tera_comm_allreduce_f32(c, a, NV);
    job_traffic(t0);
    tera_greducer_allreduce(g, b, 0, NV);
    job_traffic(t1);
    same_everywhere(c, b, NV);
    float amax = 0.0f; /* bf16 keeps 8 bits: within 1% of the largest sum (two roundings, with feedback) */
    for (int i = 0; i < NV; i++) amax = fmaxf(amax, fabsf(a[i]));
    CHECK(tu_close("hierarchical bf16 all-reduce", b, a, NV, 0.0, 1e-2 * amax) <= 1.0);
    const double inter = (t1[5] + t1[6] + t1[7] - t0[5] - t0[6] - t0[7]) / groups;
    CHECK(inter <= 0.5 * 2.0 * (N - 1) * B + 64.0 * N * k);
    if (me == 0) printf("  hierarchical + bf16: bytes across nodes %.0f (fp32 %.0f)\n", inter, 2.0 * (N - 1) * B);
    tera_greducer_free(g);
    free(a), free(b), free(x);
}

static int mpi_main(int argc, char **argv) {
    CHECK(tera_comm_init(&argc, &argv) == TERA_OK);
    tera_comm *w = tera_comm_world();
    me = tera_comm_rank(w);
    const int p = tera_comm_size(w), rpn = atoi(getenv("TERA_TEST_RANKS_PER_NODE"));
    /* this machine's hosts: one */
    CHECK(tera_comm_set_nodes(0) == TERA_OK);
    CHECK(tera_comm_nodes() == 1 && tera_comm_node_of(p - 1) == 0);
    CHECK(tera_comm_set_nodes(p - 1) != TERA_OK); /* does not divide */
    CHECK(tera_comm_set_nodes(p + 1) == TERA_OK && tera_comm_nodes() == 1); /* more than the world: one node */
    CHECK(tera_comm_set_nodes(rpn) == TERA_OK);
    const int N = p / rpn;
    g_nodes = N;
    CHECK(tera_comm_nodes() == N && tera_comm_node_of(me) == me / rpn);
    for (int integers = 1; integers >= 0; integers--) check_group(w, N, rpn, integers);
    /* the data-parallel group of tp = 2: members 2 apart, rpn / 2 on each node */
    tera_comm *dp = tera_comm_split(w, me % 2, me / 2);
    CHECK(tera_comm_world_rank_of(dp, tera_comm_size(dp) - 1) == p - 2 + me % 2);
    check_group(dp, N, rpn / 2, 1);
    tera_comm_free(dp);
    tera_comm_finalize();
    if (me == 0) printf("node-aware collectives: ok on %d ranks, %d nodes of %d\n", p, N, rpn);
    return 0;
}

/* np ranks as nodes of rpn */
static void run(int np, int rpn) {
    char env[64];
    snprintf(env, sizeof env, "TERA_TEST_RANKS_PER_NODE=%d ", rpn);
    tu_mpirun_self(np, env);
}

static void test_hier_mpi(void **state) {
    (void)state;
    if (!tu_mpirun_ready()) return;
    run(4, 2);
    run(6, 2);
    run(8, 4);
}

/* the topology knows the nodes: tp varies fastest, then ep, so nodes of a multiple of tp (tp x ep)
 * ranks hold whole tensor-parallel (expert-parallel) groups */
static void test_topology_nodes(void **state) {
    (void)state;
    tera_topology t;
    int node[16];
    assert_int_equal(tera_topology_init(&t, 16, 5, 1, 8, 2, 2), TERA_OK); /* dp 8 x tp 2, ep 2 */
    assert_true(t.nodes == 1 && t.tp_in_node && t.ep_in_node);
    const int rpn[] = {8, 4, 2, 1}, tp_in[] = {1, 1, 1, 0}, ep_in[] = {1, 1, 0, 0};
    for (int c = 0; c < 4; c++) {
        for (int w = 0; w < 16; w++) node[w] = w / rpn[c];
        tera_topology_set_nodes(&t, node);
        assert_int_equal(t.nodes, 16 / rpn[c]);
        assert_int_equal(t.node, 5 / rpn[c]);
        assert_int_equal(t.tp_in_node, tp_in[c]);
        assert_int_equal(t.ep_in_node, ep_in[c]);
    }
    char buf[512];
    tera_topology_describe(&t, buf, sizeof buf);
    assert_non_null(strstr(buf, "16 nodes (tp groups ACROSS nodes"));
}

int main(int argc, char **argv) {
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE")) return mpi_main(argc, argv);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_topology_nodes), cmocka_unit_test(test_hier_mpi)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
