/* The watchdog's automatic timeout (parallel.timeout_s = -1): the start-up allowance until three
 * steps have been timed and outside steps, then max(floor, factor x the slowest step after the
 * first) inside steps; an explicit value wins, 0 is off. (The stall itself, the message naming the
 * stalled rank and the CPU a waiting rank uses: tests/cli_hang.sh.)
 *
 * The MPI backend's contracts (test_mpi_backend): this program runs itself under mpirun on 3 ranks
 * (skipped without mpirun) and checks every collective's answer and traffic count, more
 * non-blocking operations in flight at once than the request pool's first chunk, all-gather counts
 * the caller changes at once (the backend keeps its own), point-to-point in both directions with
 * two tags, one-rank and two-rank sub-groups, and the large fp32 sums that ranks on one host add through
 * a shared segment (src/comm/comm_shm.h): blocking and non-blocking, several in flight waited in any
 * order beside small MPI ones, sizes that are no multiple of a chunk, each element summed in rank
 * order (bit for bit), in the world and in sub-groups; the whole again with TERA_COMM_SHM=0 (MPI's
 * collectives). The one-rank backend: tests/test_comm_single.c. */
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "comm/comm_shm.h"
#include "tera/comm.h"

static void near(double got, double want) {
    if (fabs(got - want) > 1e-9) fprintf(stderr, "timeout %g, expected %g\n", got, want);
    assert_true(fabs(got - want) <= 1e-9);
}

static void test_auto_timeout(void **state) {
    (void)state;
    assert_true(TERA_COMM_AUTO_FLOOR_S == 60.0 && TERA_COMM_AUTO_FACTOR == 20.0 && TERA_COMM_STARTUP_S == 600.0 &&
                TERA_COMM_AUTO_AFTER_STEPS == 3);
    tera_comm_set_timeout(-1.0);
    near(tera_comm_timeout_now(), 600.0); /* set-up */
    tera_comm_step_begin(0);
    near(tera_comm_timeout_now(), 600.0); /* no step timed yet */
    tera_comm_step_end(100.0);            /* the first step (kernel generation, first touch) is not counted */
    tera_comm_step_begin(1);
    tera_comm_step_end(0.01);
    tera_comm_step_begin(2);
    near(tera_comm_timeout_now(), 600.0); /* two timed: still the allowance */
    tera_comm_step_end(0.02);
    tera_comm_step_begin(3);
    near(tera_comm_timeout_now(), 60.0); /* three timed, fast steps: the floor */
    tera_comm_step_end(4.0);
    near(tera_comm_timeout_now(), 600.0); /* outside steps (evaluation, checkpoints): the allowance */
    tera_comm_step_begin(4);
    near(tera_comm_timeout_now(), 80.0); /* 20 x the slowest step */
    tera_comm_step_end(0.5);
    tera_comm_step_begin(5);
    near(tera_comm_timeout_now(), 80.0); /* the slowest still counts */
    tera_comm_step_end(40.0);
    tera_comm_step_begin(6);
    near(tera_comm_timeout_now(), 800.0); /* slow steps: 20 x 40 inside and outside steps */
    tera_comm_step_end(1.0);
    near(tera_comm_timeout_now(), 800.0);
    tera_comm_set_timeout(5.0); /* an explicit value wins */
    near(tera_comm_timeout_now(), 5.0);
    tera_comm_set_timeout(0.0); /* off */
    near(tera_comm_timeout_now(), 0.0);
    tera_comm_set_timeout(-1.0);
}

/* ---- run under mpirun: the MPI backend's contracts, checked on every rank */
#define CHECK(cond) TU_RANK_CHECK(me, cond)

static int me;

static int close_to(double got, double want) { return fabs(got - want) <= 1e-12 * fabs(want); }

/* the traffic counters since the last reset (sums of doubles: equal up to rounding) */
static int traffic_is(double ar, double rs, double ag, double a2a, double p2p) {
    const tera_comm_traffic t = tera_comm_traffic_get();
    const int ok = close_to(t.allreduce, ar) && close_to(t.reduce_scatter, rs) && close_to(t.allgather, ag) &&
                   close_to(t.alltoall, a2a) && close_to(t.p2p, p2p);
    if (!ok)
        fprintf(stderr, "rank %d: traffic %g %g %g %g %g, expected %g %g %g %g %g\n", me, t.allreduce,
                t.reduce_scatter, t.allgather, t.alltoall, t.p2p, ar, rs, ag, a2a, p2p);
    return ok;
}

#define NOPS 300 /* more than the pool's first chunk (128) in flight at once */
#define LEN 5

static int mpi_contracts(int argc, char **argv) {
    if (tera_comm_init(&argc, &argv) != TERA_OK) return 1;
    tera_comm *w = tera_comm_world();
    me = tera_comm_rank(w);
    const int p = tera_comm_size(w);
    CHECK(strcmp(tera_comm_backend(), "mpi") == 0 && p >= 2);
    const double share = (double)(p - 1) / (double)p;
    tera_comm_traffic_reset();

    /* blocking sums and maximum: exact in every type */
    float x[LEN];
    double d[LEN];
    int64_t i64[LEN];
    for (int i = 0; i < LEN; i++) x[i] = (float)(me + i), d[i] = 0.5 * me, i64[i] = (int64_t)me << 40;
    tera_comm_allreduce_f32(w, x, LEN);
    tera_comm_allreduce_f64(w, d, LEN);
    tera_comm_allreduce_i64(w, i64, LEN);
    const int tri = p * (p - 1) / 2;
    for (int i = 0; i < LEN; i++)
        CHECK(x[i] == (float)(tri + p * i) && d[i] == 0.5 * tri && i64[i] == (int64_t)tri << 40);
    for (int i = 0; i < LEN; i++) x[i] = (float)(me == i % p ? 100 + i : -i);
    tera_comm_allreduce_max_f32(w, x, LEN);
    for (int i = 0; i < LEN; i++) CHECK(x[i] == (float)(100 + i));
    tera_comm_allreduce_f32(w, x, 0);
    CHECK(traffic_is(2.0 * share * LEN * 4 * 2 + 2.0 * share * LEN * 8 * 2, 0, 0, 0, 0));
    tera_comm_traffic_reset();

    /* reduce-scatter and all-gather over ranges of r + 1 elements */
    int64_t counts[64], total = 0;
    for (int r = 0; r < p; r++) counts[r] = r + 1, total += r + 1;
    float *buf = calloc((size_t)total, sizeof(float));
    for (int64_t i = 0; i < total; i++) buf[i] = (float)(me + 1);
    tera_comm_reduce_scatter_f32(w, buf, counts);
    const int64_t off = (int64_t)me * (me + 1) / 2;
    for (int64_t i = 0; i < counts[me]; i++) CHECK(buf[off + i] == (float)(p * (p + 1) / 2));
    for (int64_t i = 0; i < total; i++) buf[i] = -1.0f;
    for (int64_t i = 0; i < counts[me]; i++) buf[off + i] = (float)(10 * me + i);
    tera_comm_allgather_f32(w, buf, counts);
    for (int r = 0, o = 0; r < p; o += r + 1, r++)
        for (int i = 0; i <= r; i++) CHECK(buf[o + i] == (float)(10 * r + i));
    CHECK(traffic_is(0, share * 4.0 * (double)total, share * 4.0 * (double)total, 0, 0));
    tera_comm_traffic_reset();

    /* non-blocking: NOPS sums in flight at once (the pool grows), then two all-gathers whose counts
     * the caller overwrites as soon as each has started */
    float *many = calloc((size_t)NOPS * LEN, sizeof(float));
    tera_comm_req *rq = calloc(NOPS, sizeof *rq);
    for (int k = 0; k < NOPS; k++) {
        for (int i = 0; i < LEN; i++) many[k * LEN + i] = (float)(k + me);
        tera_comm_iallreduce_f32(w, many + k * LEN, LEN, &rq[k]);
        CHECK(rq[k].active);
    }
    tera_comm_poll(rq, NOPS);
    for (int k = 0; k < NOPS; k += 2) tera_comm_wait(&rq[k]);
    tera_comm_poll(rq, NOPS);
    for (int k = 0; k < NOPS; k++) tera_comm_wait(&rq[k]);
    for (int k = 0; k < NOPS; k++) {
        CHECK(!rq[k].active && rq[k].op == NULL);
        for (int i = 0; i < LEN; i++) CHECK(many[k * LEN + i] == (float)(p * k + tri));
    }
    float *g2[2];
    int64_t cnt[64], sum2[2] = {0, 0};
    for (int x2 = 0; x2 < 2; x2++) {
        for (int r = 0; r < p; r++) cnt[r] = x2 ? 2 * (p - r) : r + 1, sum2[x2] += cnt[r];
        g2[x2] = calloc((size_t)sum2[x2], sizeof(float));
        int64_t o = 0;
        for (int r = 0; r < me; r++) o += cnt[r];
        for (int64_t i = 0; i < cnt[me]; i++) g2[x2][o + i] = (float)(1000 * x2 + 10 * me + i);
        tera_comm_iallgather_f32(w, g2[x2], cnt, &rq[x2]);
        for (int r = 0; r < p; r++) cnt[r] = -77; /* the backend kept its own counts */
    }
    tera_comm_wait(&rq[1]);
    tera_comm_wait(&rq[0]);
    for (int x2 = 0; x2 < 2; x2++)
        for (int r = 0, o = 0; r < p; r++) {
            const int c = x2 ? 2 * (p - r) : r + 1;
            for (int i = 0; i < c; i++) CHECK(g2[x2][o + i] == (float)(1000 * x2 + 10 * r + i));
            o += c;
        }
    CHECK(traffic_is(2.0 * share * 4.0 * LEN * NOPS, 0, share * 4.0 * (double)(sum2[0] + sum2[1]), 0, 0));
    tera_comm_traffic_reset();

    /* point-to-point around the ring, both directions, two tags each */
    const int next = (me + 1) % p, prev = (me + p - 1) % p;
    float out[2][LEN], in[2][LEN];
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < LEN; i++) out[t][i] = (float)(100 * me + 10 * t + i);
    tera_comm_req pr[4];
    tera_comm_irecv_f32(w, in[1], LEN, prev, 11, &pr[0]);
    tera_comm_irecv_f32(w, in[0], LEN, prev, 10, &pr[1]);
    tera_comm_isend_f32(w, out[0], LEN, next, 10, &pr[2]);
    tera_comm_isend_f32(w, out[1], LEN, next, 11, &pr[3]);
    for (int k = 0; k < 4; k++) tera_comm_wait(&pr[k]);
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < LEN; i++) CHECK(in[t][i] == (float)(100 * prev + 10 * t + i));
    tera_comm_isend_f32(w, out[0], 0, next, 12, &pr[0]); /* n = 0: nothing posted */
    CHECK(!pr[0].active);
    CHECK(traffic_is(0, 0, 0, 0, 2.0 * 4.0 * LEN));
    tera_comm_traffic_reset();

    /* all-to-all */
    int32_t s32[64 * 2], r32[64 * 2];
    for (int r = 0; r < p; r++) s32[2 * r] = 100 * me + r, s32[2 * r + 1] = -me;
    tera_comm_alltoall_i32(w, s32, r32, 2);
    for (int r = 0; r < p; r++) CHECK(r32[2 * r] == 100 * r + me && r32[2 * r + 1] == -r);
    CHECK(traffic_is(0, 0, 0, (double)(p - 1) * 4.0 * 2, 0));
    tera_comm_traffic_reset();

    /* sub-groups: one rank each (served by the one-rank backend), and pairs by parity */
    tera_comm *one = tera_comm_split(w, me, 0);
    CHECK(tera_comm_size(one) == 1 && tera_comm_rank(one) == 0);
    for (int i = 0; i < LEN; i++) x[i] = (float)i;
    tera_comm_allreduce_f32(one, x, LEN);
    tera_comm_iallreduce_f32(one, x, LEN, &pr[0]);
    CHECK(!pr[0].active);
    for (int i = 0; i < LEN; i++) CHECK(x[i] == (float)i);
    tera_comm *par = tera_comm_split(w, me % 2, -me); /* ordered by key: highest world rank first */
    const int np = (p + 1 - me % 2) / 2;
    CHECK(tera_comm_size(par) == np && tera_comm_rank(par) == np - 1 - me / 2);
    int64_t v = me;
    tera_comm_allreduce_i64(par, &v, 1);
    int64_t want = 0;
    for (int r = me % 2; r < p; r += 2) want += r;
    CHECK(v == want);
    tera_comm *sub = tera_comm_split(one, 5, 5); /* a split of a one-rank group */
    CHECK(tera_comm_size(sub) == 1);
    tera_comm_free(sub);
    tera_comm_free(one);
    tera_comm_free(par);
    tera_comm_barrier(w);
    CHECK(traffic_is(np > 1 ? 2.0 * ((double)(np - 1) / (double)np) * 1 * 8 : 0, 0, 0, 0, 0));

    /* large fp32 sums (the shared segment on one host, unless TERA_COMM_SHM=0): values whose sum
     * rounds, so that the order of additions shows; with the segment, rank order exactly */
    const char *shm_env = getenv("TERA_COMM_SHM");
    const int shm = !(shm_env && !strcmp(shm_env, "0"));
    tera_comm_traffic_reset();
    const int64_t big[4] = {300001, 16384, 1 << 18, 77777};
    float *L[4], *want4[4];
    for (int k = 0; k < 4; k++) {
        L[k] = malloc(sizeof(float) * (size_t)big[k]);
        want4[k] = malloc(sizeof(float) * (size_t)big[k]);
        for (int64_t i = 0; i < big[k]; i++) {
            float acc = 0.0f;
            for (int r = 0; r < p; r++) {
                const float val = 1.0f + (float)((i * 7 + r * 13 + k) % 101) * 1.1e-3f + (float)r * 3.3e-8f;
                if (r == me) L[k][i] = val;
                acc = r == 0 ? val : acc + val;
            }
            want4[k][i] = acc;
        }
    }
    tera_comm_allreduce_f32(w, L[0], big[0]); /* blocking */
    tera_comm_req lr[8];
    memset(lr, 0, sizeof lr); /* lr[0] and lr[4] stay inactive */
    float small[3][LEN];
    for (int k = 1; k < 4; k++) { /* three in flight, a small one (MPI) between each */
        tera_comm_iallreduce_f32(w, L[k], big[k], &lr[k]);
        for (int i = 0; i < LEN; i++) small[k - 1][i] = (float)(me + i);
        tera_comm_iallreduce_f32(w, small[k - 1], LEN, &lr[4 + k]);
    }
    tera_comm_poll(lr + 1, 7);
    tera_comm_wait(&lr[3]); /* the last started first */
    tera_comm_wait(&lr[6]);
    tera_comm_wait(&lr[1]);
    tera_comm_wait(&lr[5]);
    tera_comm_wait(&lr[2]);
    tera_comm_wait(&lr[7]);
    for (int k = 0; k < 4; k++) {
        int64_t bad = 0, exact_bad = 0;
        for (int64_t i = 0; i < big[k]; i++) {
            const float want_k = want4[k][i];
            bad += fabsf(L[k][i] - want_k) > 1e-5f * fabsf(want_k);
            exact_bad += memcmp(&L[k][i], &want_k, sizeof(float)) != 0;
        }
        if (bad || (shm && exact_bad))
            fprintf(stderr, "rank %d: large sum %d (%ld floats): %ld wrong, %ld not in rank order\n", me, k,
                    (long)big[k], (long)bad, (long)exact_bad);
        CHECK(bad == 0 && (!shm || exact_bad == 0));
    }
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < LEN; i++) CHECK(small[k][i] == (float)(tri + p * i));
    CHECK(traffic_is(2.0 * share * 4.0 * (double)(big[0] + big[1] + big[2] + big[3] + 3 * LEN), 0, 0, 0, 0));
    /* large reduce-scatters and all-gathers over unequal ranges (the segment's pieces), blocking and
     * non-blocking, two of each in flight: rank order again for the sums */
    tera_comm_traffic_reset();
    int64_t rc[64], rtot = 0, roff[64];
    for (int r = 0; r < p; r++) roff[r] = rtot, rc[r] = 100000 + 7777 * r, rtot += rc[r];
    float *R[2], *G[2];
    for (int x2 = 0; x2 < 2; x2++) {
        R[x2] = malloc(sizeof(float) * (size_t)rtot), G[x2] = malloc(sizeof(float) * (size_t)rtot);
        for (int64_t i = 0; i < rtot; i++) {
            R[x2][i] = 1.0f + (float)((i * 5 + me * 11 + x2) % 97) * 1.3e-3f + (float)me * 2.1e-8f;
            G[x2][i] = -1.0f;
        }
        for (int64_t i = 0; i < rc[me]; i++) G[x2][roff[me] + i] = (float)(x2 * 1000000 + me * 100000) + (float)i;
    }
    tera_comm_reduce_scatter_f32(w, R[0], rc);
    tera_comm_ireduce_scatter_f32(w, R[1], rc, &lr[0]);
    tera_comm_allgather_f32(w, G[0], rc);
    tera_comm_iallgather_f32(w, G[1], rc, &lr[1]);
    tera_comm_wait(&lr[1]);
    tera_comm_wait(&lr[0]);
    for (int x2 = 0; x2 < 2; x2++) {
        int64_t bad = 0, exact_bad = 0, gbad = 0;
        for (int64_t i = roff[me]; i < roff[me] + rc[me]; i++) {
            float acc = 0.0f;
            for (int r = 0; r < p; r++) {
                const float val = 1.0f + (float)((i * 5 + r * 11 + x2) % 97) * 1.3e-3f + (float)r * 2.1e-8f;
                acc = r == 0 ? val : acc + val;
            }
            bad += fabsf(R[x2][i] - acc) > 1e-5f * fabsf(acc);
            exact_bad += memcmp(&R[x2][i], &acc, sizeof(float)) != 0;
        }
        for (int r = 0; r < p; r++)
            for (int64_t i = 0; i < rc[r]; i++) gbad += G[x2][roff[r] + i] != (float)(x2 * 1000000 + r * 100000) + (float)i;
        if (bad || gbad || (shm && exact_bad))
            fprintf(stderr, "rank %d: large reduce-scatter %d: %ld wrong, %ld not in rank order; all-gather: %ld wrong\n",
                    me, x2, (long)bad, (long)exact_bad, (long)gbad);
        CHECK(bad == 0 && gbad == 0 && (!shm || exact_bad == 0));
        free(R[x2]), free(G[x2]);
    }
    CHECK(traffic_is(0, 2.0 * share * 4.0 * (double)rtot, 2.0 * share * 4.0 * (double)rtot, 0, 0));
    /* a sub-group of two (the segment is per group): world ranks 0 and 1 */
    tera_comm *lo2 = tera_comm_split(w, me < 2 ? 0 : 1, me);
    if (me < 2) {
        for (int64_t i = 0; i < big[0]; i++) L[0][i] = (float)(me + 1) * (float)(i % 1000);
        tera_comm_iallreduce_f32(lo2, L[0], big[0], &lr[0]);
        tera_comm_wait(&lr[0]);
        int64_t bad = 0;
        for (int64_t i = 0; i < big[0]; i++) bad += L[0][i] != 3.0f * (float)(i % 1000);
        CHECK(bad == 0);
    }
    tera_comm_free(lo2);
    for (int k = 0; k < 4; k++) free(L[k]), free(want4[k]);

    /* the progress thread (comm_shm.h): an all-reduce and an all-gather of many chunks started, then
     * no rank polls or waits: with the thread both complete by themselves (their flags read without
     * advancing anything), in rank order; with TERA_COMM_SHM_THREAD=0 they stay where the starts left
     * them (more chunks than a start advances) until the ranks poll */
    if (shm) {
        const char *te = getenv("TERA_COMM_SHM_THREAD");
        const int thread = !(te && !strcmp(te, "0"));
        tera_shm *seg = tera_shm_create(MPI_COMM_WORLD);
        CHECK(seg != NULL);
        CHECK(tera_shm_thread_running() == thread);
        const int64_t n = 5000003; /* at least 3 chunks with the default sets, hundreds with small ones */
        float *a = malloc(sizeof(float) * (size_t)n), *gth = malloc(sizeof(float) * (size_t)n);
        int gcnt[64], gdisp[64];
        for (int r = 0, at = 0; r < p; r++) gcnt[r] = (int)(n / p) + (r < n % p), gdisp[r] = at, at += gcnt[r];
        for (int64_t i = 0; i < n; i++) a[i] = 1.0f + (float)((i * 3 + me * 17) % 89) * 1.7e-3f + (float)me * 4.1e-8f;
        for (int64_t i = 0; i < n; i++) gth[i] = i >= gdisp[me] && i < gdisp[me] + gcnt[me] ? (float)i : -1.0f;
        MPI_Barrier(MPI_COMM_WORLD);
        tera_shm_op op, gop;
        tera_shm_start(seg, &op, a, n);
        tera_shm_start_ranges(seg, &gop, TERA_SHM_ALLGATHER, gth, gcnt, gdisp);
        int done = 0;
        for (int i = 0; i < (thread ? 500 : 5) && !done; i++) { /* up to 5 s (50 ms without the thread), flags only */
            usleep(10000);
            done = tera_shm_done(&op) && tera_shm_done(&gop);
        }
        if (done != thread)
            fprintf(stderr, "rank %d: progress thread %s: after %s without polls the operations are %s\n", me,
                    thread ? "on" : "off", thread ? "5 s" : "50 ms", done ? "done" : "not done");
        CHECK(done == thread);
        while (!tera_shm_done(&op) || !tera_shm_done(&gop)) tera_shm_progress();
        int64_t bad = 0, gbad = 0;
        for (int64_t i = 0; i < n; i++) {
            float acc = 0.0f;
            for (int r = 0; r < p; r++) {
                const float val = 1.0f + (float)((i * 3 + r * 17) % 89) * 1.7e-3f + (float)r * 4.1e-8f;
                acc = r == 0 ? val : acc + val;
            }
            bad += memcmp(&a[i], &acc, sizeof acc) != 0;
            gbad += gth[i] != (float)i;
        }
        if (bad || gbad) fprintf(stderr, "rank %d: progress thread: %ld sums not in rank order, %ld gathered wrong\n", me, (long)bad, (long)gbad);
        CHECK(bad == 0 && gbad == 0);
        tera_shm_free(seg); /* the world's segment remains: the thread with it */
        CHECK(tera_shm_thread_running() == thread);
        free(a), free(gth);
    }

    /* host-shared memory (tera_comm_shared): a block where the segment exists (every rank on this host),
     * none with TERA_COMM_SHM=0; each rank writes its own part, posts a flag, and reads every rank's part in
     * place once every flag is up; a second round reuses the block after the readers posted their second
     * flag; the counts go under the kind named; a one-rank group has none */
    {
        tera_comm_traffic_reset();
        const int64_t per = 1000;
        tera_comm_shared *sb = tera_comm_shared_create(w, (int64_t)sizeof(float) * per * p, 2);
        CHECK((sb != NULL) == shm);
        if (sb) {
            float *mem = tera_comm_shared_mem(sb);
            CHECK(((uintptr_t)mem & 63) == 0);
            CHECK(tera_comm_shared_reached(sb, 0, 0) && !tera_comm_shared_reached(sb, 0, 1)); /* flags start at 0 */
            int64_t pcnt[64];
            for (int r = 0; r < p; r++) pcnt[r] = per;
            for (uint64_t round = 1; round <= 2; round++) {
                if (round > 1) tera_comm_shared_wait(sb, 1, round - 1, TERA_TRAFFIC_ALLGATHER); /* every reader done */
                for (int64_t i = 0; i < per; i++) mem[me * per + i] = (float)(1000 * round + 10 * me) + (float)i;
                if (me == 0) usleep(20000); /* the others wait: blocked time */
                tera_comm_shared_post(sb, 0, round);
                tera_comm_shared_count(sb, TERA_TRAFFIC_ALLGATHER, pcnt);
                tera_comm_shared_wait(sb, 0, round, TERA_TRAFFIC_ALLGATHER);
                int64_t bad = 0;
                for (int r = 0; r < p; r++)
                    for (int64_t i = 0; i < per; i++) bad += mem[r * per + i] != (float)(1000 * round + 10 * r) + (float)i;
                CHECK(bad == 0);
                tera_comm_shared_post(sb, 1, round);
            }
            const tera_comm_traffic t = tera_comm_traffic_get();
            CHECK(traffic_is(0, 0, 2.0 * share * 4.0 * (double)(per * p), 0, 0));
            CHECK(me == 0 || t.blocked_kind_s[TERA_TRAFFIC_ALLGATHER] >= 0.015); /* rank 0 slept 20 ms before posting */
            tera_comm_shared_free(sb);
        }
        /* a block larger than /dev/shm has free is not made (it would fault when touched): none, on every rank */
        struct statvfs fsv;
        if (shm && statvfs("/dev/shm", &fsv) == 0) {
            const double free_b = (double)fsv.f_bavail * (double)fsv.f_frsize;
            tera_comm_shared *huge = tera_comm_shared_create(w, (int64_t)(2.0 * free_b) + 4096, 1);
            CHECK(huge == NULL);
            tera_comm_shared_free(huge);
        }
        tera_comm *solo = tera_comm_split(w, me, 0); /* one rank each */
        CHECK(tera_comm_shared_create(solo, 64, 1) == NULL);
        tera_comm_free(solo);
    }

    free(buf), free(many), free(rq), free(g2[0]), free(g2[1]);
    tera_comm_finalize();
    if (me == 0) printf("mpi backend contracts: ok on %d ranks (large sums %s)\n", p, shm ? "through the shared segment" : "through MPI");
    return 0;
}

static void test_mpi_backend(void **state) {
    (void)state;
    if (!tu_mpirun_ready()) return;
    tu_mpirun_self(3, "");
    tu_mpirun_self(3, "TERA_COMM_SHM=0 "); /* MPI's collectives for the large sums too */
    tu_mpirun_self(3, "TERA_COMM_SHM_FLOATS=12288 "); /* slots of 4 Ki floats a rank: every large op in many chunks */
    tu_mpirun_self(3, "TERA_COMM_SHM_THREAD=0 "); /* no progress thread: the polls and waits advance the segment */
    tu_mpirun_self(2, "TERA_COMM_SHM_THREAD=0 TERA_COMM_SHM_FLOATS=12288 ");
    tu_mpirun_self(2, "");
    tu_mpirun_self(4, ""); /* rank order shows from three terms on */
}

int main(int argc, char **argv) {
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE")) return mpi_contracts(argc, argv);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_auto_timeout), cmocka_unit_test(test_mpi_backend)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
