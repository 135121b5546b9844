/* tera plan's memory model (src/parallel/plan_mem.c) against the model's own allocator in the same
 * process: for a table of one-rank model variants (dense first layers, shared experts, dropless and
 * capacity routing, DeepSeek-V3 group routing with sigmoid scores, tied embeddings, every recompute
 * policy, several micro-batch shapes) tera_plan_rank_memory must give tera_model_create's bytes of
 * parameters, activations and scratch to the byte, and tera_model_count (which the planner uses) every
 * category tera_model_create_par allocates, also for pipeline stages and sharded buffers; the shipped
 * hardware files load, a bad one is refused naming the file, line and key; a calibrated description
 * reads back as written and its measured rates are what the time model looks up. The multi-rank layouts are checked through the command
 * line against `tera train` (tests/cli_plan.sh). */
#include <math.h>
#include <omp.h>
#include <unistd.h>

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

/* tera_model_count (the model's counting entry point, which tera plan uses) against what
 * tera_model_create_par allocates, every category, for every variant on one rank and as a pipeline
 * stage (2 stages, 3 activation slots, either stage) with ZeRO-3 / ZeRO-2 sharded buffers. */
static void test_count_is_the_allocator(void **state) {
    (void)state;
    tera_set_threads(2);
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++)
        for (int shape = 0; shape < 4; shape++) {
            tera_config c;
            tera_config_defaults(&c);
            c.training.seq_len = 32;
            c.training.micro_batch = 2;
            for (int k = 0; variants[i].sets[k]; k++) assert_int_equal(tera_config_set(&c, variants[i].sets[k]), TERA_OK);
            assert_int_equal(tera_config_finalize(&c), TERA_OK);
            tera_model_config mc = c.model;
            mc.recompute = c.training.recompute;
            const int L = mc.n_layers, first[3] = {0, L / 2, L};
            tera_model_par par = {.ep = 1, .tp = 1};
            if (shape >= 1) par.pp = 2, par.pp_rank = shape - 1 < 1 ? 0 : 1, par.v = 1, par.n_slots = 3, par.layer_first = first;
            if (shape == 3) par.shard_params = 1, par.shard_grads = 1;
            tera_model_bytes cnt;
            assert_int_equal(tera_model_count(&mc, c.training.micro_batch, c.training.seq_len, &par, &cnt), TERA_OK);
            tera_model m;
            assert_int_equal(tera_model_create_par(&m, &mc, c.training.micro_batch, c.training.seq_len, &par), TERA_OK);
            if (cnt.params != m.bytes_params || cnt.grads != m.bytes_grads || cnt.acts != m.bytes_acts ||
                cnt.scratch != m.bytes_scratch || cnt.comm != m.bytes_comm || cnt.comm_acts != m.bytes_comm_acts ||
                cnt.n_floats != m.n_floats || cnt.n_dense != m.n_dense_floats)
                fail_msg("%s, shape %d: counted params %lld grads %lld acts %lld scratch %lld floats %lld; allocated "
                         "%lld %lld %lld %lld %lld", variants[i].name, shape, (long long)cnt.params, (long long)cnt.grads,
                         (long long)cnt.acts, (long long)cnt.scratch, (long long)cnt.n_floats, (long long)m.bytes_params,
                         (long long)m.bytes_grads, (long long)m.bytes_acts, (long long)m.bytes_scratch,
                         (long long)m.n_floats);
            tera_model_destroy(&m);
        }
    /* a layout the model refuses is refused by the count with the same message */
    tera_config c;
    tera_config_defaults(&c);
    tera_model_par par = {.ep = 3, .tp = 1};
    tera_model_bytes cnt;
    assert_int_equal(tera_model_count(&c.model, 1, 16, &par, &cnt), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "parallel.ep = 3"));
}

/* A calibrated description (as tera plan --calibrate writes it) reads back the same; the rate
 * lookups take a measured shape exactly, interpolate between sizes, and fall back to the peak. */
static void test_calibrated_file(void **state) {
    (void)state;
    tera_hw hw;
    memset(&hw, 0, sizeof hw);
    snprintf(hw.name, sizeof hw.name, "test machine");
    hw.memory_bytes = 8.0 * 1024 * 1024 * 1024, hw.devices_per_node = 4096, hw.cores = 2;
    hw.peak_flops[TERA_HW_FP32] = hw.peak_flops[TERA_HW_BF16] = 100e9;
    hw.intra_bw = hw.inter_bw = 2e9, hw.intra_lat = hw.inter_lat = 5e-6;
    hw.mem_bw_threads[1] = 10e9, hw.mem_bw_threads[2] = 15e9, hw.mem_bw = 15e9;
    hw.gemm[hw.n_gemm++] = (tera_hw_gemm){.threads = 1, .prec = TERA_HW_FP32, .m = 256, .k = 64, .n = 128, .flops_s = 20e9};
    hw.gemm[hw.n_gemm++] = (tera_hw_gemm){.threads = 1, .prec = TERA_HW_FP32, .m = 1024, .k = 64, .n = 128, .flops_s = 40e9};
    hw.attn[hw.n_attn++] = (tera_hw_attn){.threads = 1, .B = 2, .T = 32, .H = 4, .Hkv = 4, .hd = 16, .flops_s = 5e9};
    hw.coll[hw.n_coll++] = (tera_hw_coll){.kind = TERA_HW_ALLREDUCE, .ranks = 4, .alpha_s = 30e-6, .beta_bytes_s = 1.5e9};
    char path[] = "/tmp/tera_test_plan_cal_XXXXXX";
    const int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(tera_hw_write(&hw, path, "# test\n"), TERA_OK);
    tera_hw r;
    if (tera_hw_load(&r, path) != TERA_OK) fail_msg("%s", tera_last_error());
    assert_int_equal(r.n_gemm, 2);
    assert_int_equal(r.n_attn, 1);
    assert_int_equal(r.n_coll, 1);
    assert_int_equal(r.cores, 2);
    assert_true(fabs(r.mem_bw_threads[2] - 15e9) < 1e6 && fabs(r.coll[0].alpha_s - 30e-6) < 1e-9);
    assert_true(fabs(tera_hw_gemm_rate(&r, 1, TERA_HW_FP32, 256, 64, 128, 0.5) - 20e9) < 1e6);
    const double mid = tera_hw_gemm_rate(&r, 1, TERA_HW_FP32, 512, 64, 128, 0.5);
    assert_true(mid > 20e9 && mid < 40e9);
    assert_true(fabs(tera_hw_gemm_rate(&r, 1, TERA_HW_FP32, 8192, 64, 128, 0.5) - 40e9) < 1e6); /* clamped */
    assert_true(fabs(tera_hw_attn_rate(&r, 1, TERA_HW_FP32, 2, 32, 4, 4, 16, 0.5) - 5e9) < 1e6);
    tera_hw bare = r;
    bare.n_gemm = bare.n_attn = 0;
    assert_true(fabs(tera_hw_gemm_rate(&bare, 1, TERA_HW_BF16, 256, 64, 128, 0.5) - 50e9) < 1e6); /* 0.5 x peak */
    remove(path);
    /* a malformed measured point is refused naming the line */
    FILE *f = fopen(path, "w");
    fprintf(f, "[device]\nname = x\n[gemm]\npoint = 1 fp33 256 64 128 20\n");
    fclose(f);
    assert_int_equal(tera_hw_load(&r, path), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), ":4:"));
    assert_non_null(strstr(tera_last_error(), "THREADS PREC M K N"));
    remove(path);
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

/* The data-parallel sums of a hierarchical run (parallel.hierarchical) are timed as comm_hier.c runs
 * them: inside the node on all of the gradient, across on 1/k of it. A group on one node: the flat
 * figure exactly; across nodes: less than flat, and at least the two stages' bandwidth terms. */
static void test_hierarchical_dp_time(void **state) {
    (void)state;
    tera_hw hw;
    char path[512];
    snprintf(path, sizeof path, "%s/hardware/h100.ini", TERA_SOURCE_DIR);
    if (tera_hw_load(&hw, path) != TERA_OK) fail_msg("%s", tera_last_error());
    hw.n_coll = 0; /* alpha-beta on the links */
    const int k = hw.devices_per_node;
    const tera_plan_opts o = {.efficiency = 0.5, .reserve = 0.1, .threads = 1};
    for (int dp = k; dp <= 4 * k; dp *= 4) {
        tera_plan_time t[2];
        for (int h = 0; h < 2; h++) {
            tera_config c;
            tera_config_defaults(&c);
            c.training.seq_len = 256;
            c.training.micro_batch = 1;
            c.training.grad_accum = 1;
            c.parallel.dp = dp;
            c.parallel.hierarchical = h;
            c.training.global_batch = 0;
            assert_int_equal(tera_config_finalize(&c), TERA_OK);
            assert_int_equal(tera_plan_time_model(&c, &hw, &o, &t[h]), TERA_OK);
        }
        assert_true(t[0].bytes_dp > 0 && t[0].bytes_dp == t[1].bytes_dp);
        if (dp == k) {
            assert_true(t[1].dp_total_s == t[0].dp_total_s); /* one node: nothing to split */
        } else {
            const int N = dp / k;
            const double G = t[0].bytes_dp / (2.0 * (dp - 1) / dp);
            const double bw = 2.0 * (k - 1) / k * G / hw.intra_bw + 2.0 * (N - 1) / N * G / k / hw.inter_bw;
            /* ZeRO-0: one all-reduce per parameter group (layers, embedding, head) in buckets of two calls */
            tera_config c;
            tera_config_defaults(&c);
            const double calls = 2.0 * (c.model.n_layers + 2);
            const double want = bw + calls * (2.0 * (k - 1) * hw.intra_lat + 2.0 * (N - 1) * hw.inter_lat);
            if (!(t[1].dp_total_s < t[0].dp_total_s && fabs(t[1].dp_total_s - want) <= 1e-9 * want))
                fail_msg("dp %d: hierarchical %.9f s (want %.9f: bandwidth %.9f + latency), flat %.9f s", dp,
                         t[1].dp_total_s, want, bw, t[0].dp_total_s);
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_one_rank_exact), cmocka_unit_test(test_count_is_the_allocator),
                                       cmocka_unit_test(test_calibrated_file), cmocka_unit_test(test_roles_cover_the_world),
                                       cmocka_unit_test(test_hardware_files), cmocka_unit_test(test_hierarchical_dp_time)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
