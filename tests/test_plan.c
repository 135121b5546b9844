/* tera plan's memory model (src/parallel/plan_mem.c) against the model's own allocator in the same
 * process: for a table of one-rank model variants (dense first layers, shared experts, dropless and
 * capacity routing, DeepSeek-V3 group routing with sigmoid scores, tied embeddings, every recompute
 * policy, several micro-batch shapes) tera_plan_rank_memory must give tera_model_create's bytes of
 * parameters, activations and scratch to the byte; and the shipped hardware files load, a bad one
 * is refused naming the file, line and key. The multi-rank layouts are checked through the command
 * line against `tera train` (tests/cli_plan.sh). */
#include <omp.h>

#include "testutil.h"
#include "tera/config.h"
#include "tera/kernels.h"
#include "tera/model.h"
#include "tera/plan.h"

typedef struct {
    const char *name;
    const char *sets[12];
} variant;

static const variant variants[] = {
    {"default", {NULL}},
    {"dense+shared, capacity", {"model.first_k_dense=1", "model.n_shared_experts=1", "model.capacity_factor=1.25", NULL}},
    {"selective", {"model.first_k_dense=1", "training.recompute=selective", NULL}},
    {"full", {"model.n_shared_experts=2", "training.recompute=full", NULL}},
    {"mixed", {"model.first_k_dense=2", "training.recompute=full:0,selective:2-3", NULL}},
    {"sigmoid groups", {"model.router_score=sigmoid", "model.n_groups=4", "model.topk_groups=2", "model.top_k=2",
                        "training.micro_batch=3", NULL}},
    {"tied, GQA", {"model.tie_embeddings=true", "model.n_kv_heads=2", "training.seq_len=48", NULL}},
};

static void test_one_rank_exact(void **state) {
    (void)state;
    const int threads = 2;
    tera_set_threads(threads);
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        tera_config c;
        tera_config_defaults(&c);
        c.training.seq_len = 32;
        c.training.micro_batch = 2;
        c.training.threads = threads;
        for (int k = 0; variants[i].sets[k]; k++) assert_int_equal(tera_config_set(&c, variants[i].sets[k]), TERA_OK);
        assert_int_equal(tera_config_finalize(&c), TERA_OK);
        tera_plan_mem pm;
        assert_int_equal(tera_plan_rank_memory(&c, 0, threads, &pm), TERA_OK);
        tera_model m;
        tera_model_config mc = c.model;
        mc.recompute = c.training.recompute;
        assert_int_equal(tera_model_create(&m, &mc, c.training.micro_batch, c.training.seq_len), TERA_OK);
        if (pm.bytes[TERA_PM_PARAMS] != m.bytes_params || pm.bytes[TERA_PM_ACTS] != m.bytes_acts ||
            pm.bytes[TERA_PM_SCRATCH] != m.bytes_scratch || pm.n_floats != m.n_floats || pm.n_dense != m.n_dense_floats)
            fail_msg("%s: predicted params %lld acts %lld scratch %lld floats %lld, model %lld %lld %lld %lld",
                     variants[i].name, (long long)pm.bytes[TERA_PM_PARAMS], (long long)pm.bytes[TERA_PM_ACTS],
                     (long long)pm.bytes[TERA_PM_SCRATCH], (long long)pm.n_floats, (long long)m.bytes_params,
                     (long long)m.bytes_acts, (long long)m.bytes_scratch, (long long)m.n_floats);
        assert_int_equal(pm.bytes[TERA_PM_OPTIMIZER], 8 * m.n_floats); /* Adam m and v, no ZeRO */
        tera_model_destroy(&m);
    }
}

static void test_roles_cover_the_world(void **state) {
    (void)state;
    tera_config c;
    tera_config_defaults(&c);
    const char *sets[] = {"parallel.pp=2", "parallel.dp=4", "parallel.tp=2", "parallel.ep=2", "parallel.zero=3",
                          "training.micro_batch=1", "training.grad_accum=4", "model.n_layers=4", NULL};
    for (int k = 0; sets[k]; k++) assert_int_equal(tera_config_set(&c, sets[k]), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    tera_plan_mem *roles;
    int n;
    assert_int_equal(tera_plan_roles(&c, 1, &roles, &n), TERA_OK);
    int ranks = 0;
    for (int i = 0; i < n; i++) {
        ranks += roles[i].n_ranks;
        int64_t sum = 0;
        for (int k = 0; k < TERA_PM_N; k++) sum += roles[i].bytes[k];
        assert_int_equal(sum, roles[i].total);
    }
    assert_int_equal(ranks, 16);
    free(roles);
}

static void test_hardware_files(void **state) {
    (void)state;
    static const char *const files[] = {"h100", "h200", "h800", "a100", "ascend910b"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/hardware/%s.ini", TERA_SOURCE_DIR, files[i]);
        tera_hw hw;
        if (tera_hw_load(&hw, path) != TERA_OK) fail_msg("%s: %s", path, tera_last_error());
        assert_true(hw.memory_bytes > 0 && hw.peak_flops[TERA_HW_BF16] > 0 && hw.devices_per_node >= 1);
        assert_true(hw.intra_bw >= hw.inter_bw);
    }
    char path[] = "/tmp/tera_test_plan_hw_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "[device]\nname = x\n[node]\ndevices = 8\n[inter_node]\nbandwith_gbytes_s = 50\n");
    fclose(f);
    tera_hw hw;
    assert_int_equal(tera_hw_load(&hw, path), TERA_ERR_CONFIG);
    if (!strstr(tera_last_error(), path) || !strstr(tera_last_error(), ":6:") || !strstr(tera_last_error(), "bandwith_gbytes_s"))
        fail_msg("message lacks the file, line or key: %s", tera_last_error());
    remove(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_one_rank_exact), cmocka_unit_test(test_roles_cover_the_world),
                                       cmocka_unit_test(test_hardware_files)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
