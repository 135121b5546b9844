/* The pipeline executor alone (include/tera/pipeline.h), without a trainer.
 *
 * This program runs itself under mpirun (skipped without mpirun) on 2 and 3 ranks. Every rank
 * builds the one-process model (the reference) and its own stage of the same model (pp = ranks,
 * v chunks), both from the same seed, and runs one step of m micro-batches: the reference as
 * forward/backward per micro-batch, the stage through tera_pipe_step with each schedule (gpipe,
 * 1f1b, and interleaved with v = 2). Checked on every rank:
 *   - every gradient tensor of the stage equals the reference's tensor of the same name bit for
 *     bit (the same operations in the same order per micro-batch);
 *   - the last stage's cross-entropy, aux and z sums equal the reference's (to fp64 rounding of the
 *     different order of adding micro-batches), the other stages report 0 cross-entropy; the last
 *     stage's loss is armed (its gradient written in the loss's pass: no cross-entropy backward);
 *   - the reader hook is called exactly once per micro-batch, with micro-batches 0 .. m-1, and the
 *     ZeRO-3 plan hook once per operation (2 m v);
 *   - tera_pipe_eval gives the last stage the reference's forward loss of one micro-batch;
 *   - tera_pipe_param_uses lists the embedding first on stage 0 and the head first in backward on the
 *     last stage, 2 m v layer uses in all (one per operation and layer).
 * On one process (no mpirun) the executor's argument checks run: an unknown schedule is an error. */
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tera/pipeline.h"
#include "tera/profile.h"
#include "tera/schedule.h"

#define CHECK(cond) TU_RANK_CHECK(me, cond)

static int me;
enum { B = 2, T = 8, M = 4 };

static tera_model_config tiny_cfg(int layers) {
    tera_config c;
    tera_config_defaults(&c);
    tera_model_config m = c.model;
    m.vocab_size = 37;
    m.dim = 16;
    m.n_layers = layers;
    m.n_heads = 4;
    m.n_kv_heads = 2;
    m.n_experts = 4;
    m.top_k = 2;
    m.ffn_dim = 12;
    m.n_shared_experts = 1;
    m.first_k_dense = 1;
    m.dense_ffn_dim = 20;
    m.max_seq_len = 64;
    m.init_std = 0.3f;
    m.aux_coef = 0.1f;
    m.z_coef = 0.01f;
    tera_model_config_derive(&m);
    return m;
}

typedef struct {
    const int32_t *tok, *tgt; /* [M][B*T] */
    int loads[M], plans;
} hook_ctx;

static double on_load(void *ctx, int micro, int32_t *tokens, int32_t *targets) {
    hook_ctx *h = ctx;
    CHECK(micro >= 0 && micro < M);
    h->loads[micro]++;
    memcpy(tokens, h->tok + (int64_t)micro * B * T, sizeof(int32_t) * B * T);
    memcpy(targets, h->tgt + (int64_t)micro * B * T, sizeof(int32_t) * B * T);
    return 0.0;
}

static void on_plan(void *ctx, int last, int next) {
    (void)last, (void)next;
    ((hook_ctx *)ctx)->plans++;
}

static void run_case(const char *schedule, int v, int layers) {
    tera_comm *world = tera_comm_world();
    const int pp = tera_comm_size(world), stage = tera_comm_rank(world);
    const tera_model_config cfg = tiny_cfg(layers);
    const uint64_t seed = 7;
    int32_t *tok = malloc(sizeof(int32_t) * M * B * T), *tgt = malloc(sizeof(int32_t) * M * B * T);
    uint64_t r = 12345;
    for (int i = 0; i < M * B * T; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((r >> 33) % (uint64_t)cfg.vocab_size);
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        tgt[i] = (int32_t)((r >> 33) % (uint64_t)cfg.vocab_size);
    }
    const int moe_layers = cfg.n_layers - cfg.first_k_dense;
    const tera_loss_scales s = {.ce = 1.0f / (M * B * T), .aux = cfg.aux_coef / (float)(moe_layers * M * B),
                                .z = cfg.z_coef / (float)(moe_layers * M * B * T)};

    /* the reference: one process, the micro-batches one after another */
    tera_model ref;
    CHECK(tera_model_create(&ref, &cfg, B, T) == TERA_OK);
    tera_model_init_weights(&ref, seed);
    tera_model_zero_grad(&ref);
    double ref_sums[3] = {0, 0, 0}, ref_first_ce = 0.0;
    for (int a = 0; a < M; a++) {
        tera_model_forward(&ref, tok + (int64_t)a * B * T, tgt + (int64_t)a * B * T);
        ref_sums[0] += ref.stats.ce_sum, ref_sums[1] += ref.stats.aux_sum, ref_sums[2] += ref.stats.z_sum;
        if (a == 0) ref_first_ce = ref.stats.ce_sum;
        tera_model_backward(&ref, &s);
    }

    /* this rank's stage */
    const int S = pp * v;
    int *first = calloc((size_t)S + 1, sizeof(int));
    tera_pp_split(&cfg, S, T, first);
    int slots = 0;
    CHECK(tera_pipe_slots(schedule, pp, stage, M, v, &slots) == TERA_OK && slots >= 1);
    const tera_model_par par = {.ep = 1, .tp = 1, .pp = pp, .pp_rank = stage, .v = v, .layer_first = first,
                                .n_slots = slots};
    tera_model st;
    CHECK(tera_model_create_par(&st, &cfg, B, T, &par) == TERA_OK);
    free(first);
    tera_model_init_weights(&st, seed);
    tera_model_zero_grad(&st);
    hook_ctx h = {.tok = tok, .tgt = tgt};
    const tera_pipe_env env = {.model = &st, .group = world, .stage = stage, .stages = pp, .micro_batches = M,
                               .micro_batch = B, .seq_len = T, .schedule = schedule, .load = on_load,
                               .plan = on_plan, .ctx = &h};
    tera_pipe *p = NULL;
    CHECK(tera_pipe_create(&env, &p) == TERA_OK && p);
    double sums[3] = {0, 0, 0}, data_s = 0.0;
    int64_t counts[2] = {0, 0};
    tera_model_reset_load(&st);
    tera_prof_reset();
    tera_pipe_step(p, &s, M, sums, counts, &data_s, NULL, NULL, 1);
    /* the last stage's loss is armed (tera_model_arm_fused_loss): each micro-batch's loss gradient is
     * written in the loss's own pass over the logits (one exponential per logit), no second pass */
    if (stage == pp - 1) CHECK(tera_prof_calls[TERA_PROF_LOSS_FWD] == M && tera_prof_calls[TERA_PROF_LOSS_BWD] == 0);
    for (int a = 0; a < M; a++) CHECK(h.loads[a] == 1);
    CHECK(h.plans == 2 * M * v);

    /* gradients: bit for bit against the reference, tensor by tensor */
    int compared = 0;
    for (int i = 0; i < st.n_params; i++) {
        const tera_param *q = &st.params[i];
        if (q->numel == 0) continue; /* another stage's tensor */
        const tera_param *rp = tera_model_param(&ref, q->name);
        CHECK(rp && rp->numel == q->numel);
        CHECK(memcmp(st.g + q->offset, ref.g + rp->offset, sizeof(float) * (size_t)q->numel) == 0);
        compared++;
    }
    CHECK(compared > 0);
    const int last = stage == pp - 1;
    if (last) {
        CHECK(fabs(sums[0] - ref_sums[0]) <= 1e-9 * fabs(ref_sums[0]));
    } else {
        CHECK(sums[0] == 0.0);
    }
    /* aux and z add up over the stages' layers */
    double all[2] = {sums[1], sums[2]};
    tera_comm_allreduce_f64(world, all, 2);
    CHECK(fabs(all[0] - ref_sums[1]) <= 1e-9 * fmax(fabs(ref_sums[1]), 1e-30));
    CHECK(fabs(all[1] - ref_sums[2]) <= 1e-9 * fmax(fabs(ref_sums[2]), 1e-30));

    /* evaluation: one micro-batch through the stages */
    double pos = 0.0;
    const double ce = tera_pipe_eval(p, tok, tgt, &pos);
    if (last) {
        CHECK(ce == ref_first_ce && pos == (double)(B * T));
    } else {
        CHECK(ce == 0.0 && pos == 0.0);
    }

    /* the parameter groups in the schedule's order of use */
    const int n = tera_pipe_param_uses(p, NULL, 0);
    int *uses = calloc((size_t)n + 1, sizeof(int));
    CHECK(tera_pipe_param_uses(p, uses, n) == n);
    int layer_uses = 0;
    for (int k = 0; k < n; k++) layer_uses += uses[k] >= 0;
    int64_t total = layer_uses;
    tera_comm_allreduce_i64(world, &total, 1);
    CHECK(total == 2LL * M * cfg.n_layers);
    if (stage == 0) CHECK(uses[0] == TERA_GROUP_EMBED);
    free(uses);
    double busy, wait, step;
    tera_pipe_times(p, &busy, &wait, &step);
    CHECK(step > 0.0 && busy > 0.0 && busy + wait <= step * 1.0001 + 1e-6);

    tera_pipe_destroy(p);
    tera_model_destroy(&st);
    tera_model_destroy(&ref);
    free(tok);
    free(tgt);
}

static int mpi_main(int argc, char **argv) {
    CHECK(tera_comm_init(&argc, &argv) == TERA_OK);
    me = tera_comm_rank(tera_comm_world());
    const int pp = tera_comm_size(tera_comm_world());
    run_case("gpipe", 1, 4);
    run_case("1f1b", 1, 5);
    if (M % pp == 0) run_case("interleaved", 2, 2 * pp + 1);
    tera_comm_finalize();
    return 0;
}

static void test_under_mpirun(void **state) {
    (void)state;
    if (!tu_mpirun_ready()) return;
    tu_mpirun_self(2, "");
    tu_mpirun_self(3, "");
}

static void test_bad_schedule(void **state) {
    (void)state;
    int slots = 0;
    assert_int_not_equal(tera_pipe_slots("zigzag", 2, 0, 4, 1, &slots), TERA_OK);
    assert_int_not_equal(tera_pipe_slots("interleaved", 2, 0, 3, 2, &slots), TERA_OK); /* m % pp != 0 */
    assert_int_equal(tera_pipe_slots("1f1b", 4, 0, 8, 1, &slots), TERA_OK);
    assert_int_equal(slots, 4); /* 1F1B holds at most pp micro-batches on the first stage */
    assert_int_equal(tera_pipe_slots("gpipe", 4, 3, 8, 1, &slots), TERA_OK);
    assert_int_equal(slots, 8); /* GPipe holds all m */
}

int main(int argc, char **argv) {
    if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE")) return mpi_main(argc, argv);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_bad_schedule), cmocka_unit_test(test_under_mpirun)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
