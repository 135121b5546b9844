/* The parallel topology (src/parallel/topology.c) without launching ranks: for every layout of a
 * table, every world rank's coordinates round-trip, each axis's groups partition the world into
 * groups of the stated size whose keys are 0..size-1 and whose members differ only in the axis's
 * own coordinates, and the invalid layouts are refused naming the keys. */
#include <string.h>

#include "testutil.h"
#include "tera/topology.h"

/* The coordinates an axis's group members may differ in. */
static int same_outside(tera_axis axis, const tera_topology *a, const tera_topology *b) {
    const int pp = a->pp_rank == b->pp_rank, tp = a->tp_rank == b->tp_rank, dp = a->dp_rank == b->dp_rank;
    const int ep = a->ep_rank == b->ep_rank, edp = a->edp_rank == b->edp_rank;
    switch (axis) {
    case TERA_AXIS_TP: return pp && dp;
    case TERA_AXIS_DP: return pp && tp;
    case TERA_AXIS_PP: return dp && tp;
    case TERA_AXIS_EP: return pp && tp && edp;
    case TERA_AXIS_EDP: return pp && tp && ep;
    case TERA_AXIS_MP: return edp;
    case TERA_AXIS_STATS: return tp;
    case TERA_AXIS_STAGE: return pp;
    case TERA_AXIS_COUNT: break;
    }
    return 0;
}

static void check_layout(int pp, int dp, int tp, int ep) {
    const int W = pp * dp * tp;
    tera_topology t;
    assert_int_equal(tera_topology_init(&t, W, 0, pp, dp, tp, ep), TERA_OK);
    assert_int_equal(t.edp * t.ep, dp);
    for (int r = 0; r < W; r++) {
        tera_topology a;
        assert_int_equal(tera_topology_init(&a, W, r, pp, dp, tp, ep), TERA_OK);
        const tera_topology b = tera_topology_at(&t, r);
        assert_memory_equal(&a, &b, sizeof a); /* one rank's own view = another's view of it */
        assert_int_equal(tera_topology_rank_of(&t, a.pp_rank, a.dp_rank, a.tp_rank), r);
        assert_int_equal(a.dp_rank, a.edp_rank * ep + a.ep_rank);
        assert_int_equal(r, (a.pp_rank * dp + a.dp_rank) * tp + a.tp_rank); /* the documented formula */
    }
    for (int x = 0; x < TERA_AXIS_COUNT; x++) {
        const tera_axis axis = (tera_axis)x;
        const int size = tera_topology_size(&t, axis);
        assert_int_equal(W % size, 0);
        for (int r = 0; r < W; r++) {
            const tera_topology a = tera_topology_at(&t, r);
            int ca, ka, members = 0;
            tera_topology_split_keys(&a, axis, &ca, &ka);
            assert_int_equal(tera_topology_index(&a, axis), ka);
            assert_true(ka >= 0 && ka < size);
            for (int s = 0; s < W; s++) {
                const tera_topology b = tera_topology_at(&t, s);
                int cb, kb;
                tera_topology_split_keys(&b, axis, &cb, &kb);
                assert_int_equal(cb == ca, same_outside(axis, &a, &b)); /* the group is exactly these ranks */
                if (cb == ca) {
                    members++;
                    assert_int_equal(kb == ka, s == r); /* keys tell the members apart */
                }
            }
            assert_int_equal(members, size);
        }
    }
}

static void test_layouts(void **state) {
    (void)state;
    static const int L[][4] = {{1, 1, 1, 1}, {1, 2, 1, 1}, {1, 1, 4, 1}, {4, 1, 1, 1}, {1, 4, 1, 4}, {1, 8, 1, 2},
                               {2, 2, 2, 2}, {2, 4, 2, 2}, {3, 2, 2, 1}, {2, 8, 1, 4}, {1, 6, 3, 3}};
    for (size_t i = 0; i < sizeof L / sizeof L[0]; i++) check_layout(L[i][0], L[i][1], L[i][2], L[i][3]);
}

static void test_refused(void **state) {
    (void)state;
    tera_topology t;
    assert_int_equal(tera_topology_init(&t, 2, 0, 1, 2, 2, 1), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "parallel.dp x parallel.tp = 2 x 2 = 4 ranks, but 2 are running"));
    assert_int_equal(tera_topology_init(&t, 1, 0, 1, 2, 1, 1), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "parallel.dp = 2 but 1 rank is running"));
    assert_int_equal(tera_topology_init(&t, 4, 0, 2, 1, 1, 1), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "parallel.pp x parallel.dp x parallel.tp = 2 x 1 x 1 = 2 ranks, but 4"));
    assert_int_equal(tera_topology_init(&t, 6, 0, 1, 6, 1, 4), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "parallel.ep (4) must divide parallel.dp (6)"));
    assert_int_equal(tera_topology_init(&t, 1, 0, 1, 1, 0, 1), TERA_ERR_CONFIG);
    char buf[256];
    assert_int_equal(tera_topology_init(&t, 8, 5, 2, 2, 2, 2), TERA_OK);
    assert_non_null(strstr(tera_topology_describe(&t, buf, sizeof buf), "8 ranks = pp 2 x dp 2 x tp 2, dp 2 = edp 1 x ep 2"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layouts),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
