/* The one-rank backend's contracts (include/tera/comm.h, src/comm/comm_single.c): the world is one
 * rank and named "single" when no launcher started the program; every collective leaves its buffer
 * as the one-rank answer (bit for bit, NaN and -0 included), the all-to-all copies, non-blocking
 * operations are complete on return, split gives a one-rank group, the traffic counters stay 0, an
 * error is one plain line, and a point-to-point message (no peer exists) aborts. The multi-rank
 * backend's contracts: tests/test_comm.c. */
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/comm.h"

#define N 37

static int setup(void **state) {
    (void)state;
    unsetenv("OMPI_COMM_WORLD_SIZE"); /* as if started without a launcher */
    unsetenv("PMI_SIZE");
    assert_int_equal(tera_comm_init(NULL, NULL), TERA_OK);
    assert_int_equal(tera_comm_init(NULL, NULL), TERA_OK); /* idempotent */
    tera_comm_traffic_reset();
    return 0;
}

static void fill(float *x, int n, uint64_t seed) {
    tu_fill(x, n, seed, 3.0f);
    x[1] = NAN, x[2] = -0.0f, x[3] = INFINITY; /* kept as they are, not summed with anything */
}

static void same_bits(const void *a, const void *b, size_t bytes) { assert_memory_equal(a, b, bytes); }

static void traffic_zero(void) {
    const tera_comm_traffic t = tera_comm_traffic_get();
    assert_true(t.allreduce == 0.0 && t.reduce_scatter == 0.0 && t.allgather == 0.0 && t.alltoall == 0.0 &&
                t.p2p == 0.0);
}

/* every collective of include/tera/comm.h on a one-rank group c */
static void one_rank_collectives(tera_comm *c) {
    assert_int_equal(tera_comm_rank(c), 0);
    assert_int_equal(tera_comm_size(c), 1);
    float x[N], x0[N];
    fill(x, N, 1);
    memcpy(x0, x, sizeof x);
    tera_comm_allreduce_f32(c, x, N);
    same_bits(x, x0, sizeof x);
    tera_comm_allreduce_max_f32(c, x, N);
    same_bits(x, x0, sizeof x);
    tera_comm_allreduce_f32(c, x, 0);
    same_bits(x, x0, sizeof x);
    double d[3] = {1.5, -0.0, 1e300}, d0[3];
    memcpy(d0, d, sizeof d);
    tera_comm_allreduce_f64(c, d, 3);
    same_bits(d, d0, sizeof d);
    int64_t i[2] = {INT64_MAX, -7}, i0[2];
    memcpy(i0, i, sizeof i);
    tera_comm_allreduce_i64(c, i, 2);
    same_bits(i, i0, sizeof i);

    const int64_t counts[1] = {N};
    tera_comm_reduce_scatter_f32(c, x, counts); /* the one range is the whole buffer */
    same_bits(x, x0, sizeof x);
    tera_comm_allgather_f32(c, x, counts);
    same_bits(x, x0, sizeof x);

    int32_t send[5] = {1, -2, 3, INT32_MAX, INT32_MIN}, recv[5] = {0};
    tera_comm_alltoall_i32(c, send, recv, 5);
    same_bits(recv, send, sizeof send);
    tera_comm_alltoall_i32(c, send, recv, 0);

    tera_comm_req rq[4];
    memset(rq, 0xA5, sizeof rq); /* whatever was there: a start sets every field */
    tera_comm_iallreduce_f32(c, x, N, &rq[0]);
    assert_int_equal(rq[0].active, 0);
    same_bits(x, x0, sizeof x); /* complete on return: buf may be used at once */
    int64_t cnt2[1] = {N};
    tera_comm_iallgather_f32(c, x, cnt2, &rq[1]);
    cnt2[0] = -1; /* the caller may change counts at once */
    assert_int_equal(rq[1].active, 0);
    same_bits(x, x0, sizeof x);
    tera_comm_iallreduce_f32(c, x, 0, &rq[2]);
    assert_int_equal(rq[2].active, 0);
    tera_comm_isend_f32(c, x, 0, 0, 7, &rq[3]); /* n = 0 posts nothing, whatever the peer */
    assert_int_equal(rq[3].active, 0);
    tera_comm_irecv_f32(c, x, 0, 0, 7, &rq[3]);
    assert_int_equal(rq[3].active, 0);
    tera_comm_poll(rq, 4);
    for (int k = 0; k < 4; k++) {
        tera_comm_wait(&rq[k]); /* inactive: returns at once */
        assert_int_equal(rq[k].active, 0);
        assert_null(rq[k].op);
    }
    tera_comm_req zero;
    memset(&zero, 0, sizeof zero); /* a zeroed request is inactive */
    tera_comm_wait(&zero);
    tera_comm_poll(&zero, 1);
    tera_comm_barrier(c);
    same_bits(x, x0, sizeof x);
}

static void test_world(void **state) {
    (void)state;
    assert_string_equal(tera_comm_backend(), "single");
    tera_comm *w = tera_comm_world();
    assert_non_null(w);
    assert_ptr_equal(w, tera_comm_world());
    one_rank_collectives(w);
    traffic_zero();
}

static void test_split(void **state) {
    (void)state;
    tera_comm *w = tera_comm_world();
    tera_comm *g = tera_comm_split(w, 3, 9);
    assert_non_null(g);
    assert_ptr_not_equal(g, w);
    one_rank_collectives(g);
    tera_comm *h = tera_comm_split(g, 0, 0); /* a group of a group */
    one_rank_collectives(h);
    tera_comm *k = tera_comm_split(w, -1, -5);
    one_rank_collectives(k);
    tera_comm_free(h);
    tera_comm_free(g);
    tera_comm_free(k);
    tera_comm_free(w);    /* ignored: the world stays */
    tera_comm_free(NULL); /* ignored */
    one_rank_collectives(tera_comm_world());
    traffic_zero();
}

/* Runs f in a child with stderr in a pipe; returns what it printed, *status its wait status. */
static char *run_child(void (*f)(void), int *status) {
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    fflush(stderr);
    const pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fd[0]);
        dup2(fd[1], 2);
        f();
        fflush(stderr);
        _exit(0);
    }
    close(fd[1]);
    static char out[4096];
    size_t len = 0;
    ssize_t k;
    while (len < sizeof out - 1 && (k = read(fd[0], out + len, sizeof out - 1 - len)) > 0) len += (size_t)k;
    out[len] = 0;
    close(fd[0]);
    assert_int_equal(waitpid(pid, status, 0), pid);
    return out;
}

static void print_two(void) {
    tera_comm_print_error("first problem");
    tera_comm_print_error("second problem");
}

static void test_print_error(void **state) {
    (void)state;
    int st = 0;
    const char *out = run_child(print_two, &st);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0); /* an error does not stop the one-rank world */
    assert_string_equal(out, "tera: error: first problem\ntera: error: second problem\n");
}

static void send_to_self(void) {
    float x[4] = {0};
    tera_comm_req r;
    tera_comm_isend_f32(tera_comm_world(), x, 4, 0, 1, &r);
}

static void recv_from_peer(void) {
    float x[4] = {0};
    tera_comm_req r;
    tera_comm *g = tera_comm_split(tera_comm_world(), 0, 0);
    tera_comm_irecv_f32(g, x, 4, 1, 1, &r);
}

static void test_p2p_aborts(void **state) {
    (void)state;
    void (*const fs[2])(void) = {send_to_self, recv_from_peer};
    for (int k = 0; k < 2; k++) {
        int st = 0;
        const char *out = run_child(fs[k], &st);
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) fprintf(stderr, "child %d returned: %s\n", k, out);
        assert_false(WIFEXITED(st) && WEXITSTATUS(st) == 0); /* a broken invariant stops the program */
        assert_non_null(strstr(out, "comm.c:"));                /* with file:line */
        assert_non_null(strstr(out, k == 0 ? "send to rank 0 of a group of 1" : "receive from rank 1 of a group of 1"));
    }
    traffic_zero(); /* the children's counts stayed theirs */
}

static void test_finalize(void **state) {
    (void)state;
    tera_comm_finalize(); /* nothing was initialised: nothing to end */
    tera_comm_finalize();
    assert_string_equal(tera_comm_backend(), "single");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_world),        cmocka_unit_test(test_split),
        cmocka_unit_test(test_print_error),  cmocka_unit_test(test_p2p_aborts),
        cmocka_unit_test(test_finalize),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
