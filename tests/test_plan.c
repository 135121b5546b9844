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
#include "tera/compress.h"
#include "tera/config.h"
#include "tera/kernels.h"
#include "tera/model.h"
#include "tera/plan.h"
#include "tera/train.h"
#include "tera/zero.h"

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
    hw.coll[hw.n_coll++] = (tera_hw_coll){.kind = TERA_HW_SHARED_SUM, .ranks = 2, .alpha_s = 4e-6, .beta_bytes_s = 25e9};
    char path[] = "/tmp/tera_test_plan_cal_XXXXXX";
    const int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(tera_hw_write(&hw, path, "# test\n"), TERA_OK);
    tera_hw r;
    if (tera_hw_load(&r, path) != TERA_OK) fail_msg("%s", tera_last_error());
    assert_int_equal(r.n_gemm, 2);
    assert_int_equal(r.n_attn, 1);
    assert_int_equal(r.n_coll, 2);
    assert_int_equal(r.cores, 2);
    assert_true(fabs(r.mem_bw_threads[2] - 15e9) < 1e6 && fabs(r.coll[0].alpha_s - 30e-6) < 1e-9);
    assert_true(r.coll[1].kind == TERA_HW_SHARED_SUM && r.coll[1].ranks == 2 && fabs(r.coll[1].alpha_s - 4e-6) < 1e-12 &&
                fabs(r.coll[1].beta_bytes_s - 25e9) < 1e3);
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
    /* counts (threads, ranks, shapes) must be whole and at most 2^24: a thread count of 2^32 + 1
     * became INT_MIN and wrote before mem_bw_threads (a crash in the Release build), 2^31 overflowed
     * the nearest-thread search. Device figures: 0 (unknown) or within [1e-6, 1e6] (gemm_efficiency
     * at most 1): 1e308 GiB made every layout fit, 1e-300 TFLOP/s gave infinite device-hours. Each
     * is refused naming its line (the file's line 3 or 4) and the bound. */
    static const struct { const char *text, *line, *says; } bad[] = {
        {"[memory]\npoint = 4294967297 5", ":4:", "at most 16777216"},
        {"[memory]\npoint = 1.5 5", ":4:", "at most 16777216"},
        {"[gemm]\npoint = 2147483648 fp32 256 256 256 100", ":4:", "at most 16777216"},
        {"[gemm]\npoint = 1 fp32 1e30 256 256 100", ":4:", "at most 16777216"},
        {"[attention]\npoint = 2147483648 1 256 8 8 32 5", ":4:", "at most 16777216"},
        {"[attention]\npoint = 1 1 1e12 8 8 32 5", ":4:", "at most 16777216"},
        {"[shared]\npoint = 2 1e12 1 1", ":4:", "at most 16777216"},
        {"[collective]\nallreduce = 4294967298 1 1", ":4:", "at most 16777216"},
        {"memory_gib = 1e308", ":3:", "is outside"},
        {"peak_tflops_bf16 = 1e-300", ":3:", "is outside"},
        {"memory_bandwidth_gbytes_s = 1e-300", ":3:", "is outside"},
        {"gemm_efficiency = 1.5", ":3:", "is outside"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        f = fopen(path, "w");
        fprintf(f, "[device]\nname = x\n%s\n", bad[i].text);
        fclose(f);
        if (tera_hw_load(&r, path) != TERA_ERR_CONFIG || !strstr(tera_last_error(), bad[i].line) ||
            !strstr(tera_last_error(), bad[i].says))
            fail_msg("'%s' not refused naming the line and the bound: %s", bad[i].text, tera_last_error());
        remove(path);
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
    static const char *const files[] = {"h100", "h200", "h800", "a100", "ascend910b", "this-machine", "xeon-2core-avx512bf16",
                                        "epyc-zen4-2core", "xeon-amx-2core"};
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

/* hardware/h100.ini with its measured collective fits dropped: alpha-beta on the links */
static void h100_alpha_beta(tera_hw *hw) {
    char path[512];
    snprintf(path, sizeof path, "%s/hardware/h100.ini", TERA_SOURCE_DIR);
    if (tera_hw_load(hw, path) != TERA_OK) fail_msg("%s", tera_last_error());
    hw->n_coll = 0;
}

/* The data-parallel sums of a hierarchical run (parallel.hierarchical) are timed as comm_hier.c runs
 * them: inside the node on all of the gradient, across on 1/k of it. A group on one node: the flat
 * figure exactly; across nodes: less than flat, and at least the two stages' bandwidth terms. */
static void test_hierarchical_dp_time(void **state) {
    (void)state;
    tera_hw hw;
    h100_alpha_beta(&hw); /* alpha-beta on the links */
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


/* Ranks sharing a CPU host ([node] cores): the fractions tera_hw_shared gives (none on a device host
 * or for one rank; the cores over ranks x threads without measured points; measured points
 * interpolated from (1, 1) and, beyond the largest count, that count's node throughput); [shared]
 * points read back as written, and a bad one is refused naming the line. */
static void test_shared_fractions(void **state) {
    (void)state;
    tera_hw hw;
    memset(&hw, 0, sizeof hw);
    assert_true(tera_hw_shared(&hw, 8, 1, 0) == 1.0); /* no cores key: a device per rank */
    hw.cores = 2;
    assert_true(tera_hw_shared(&hw, 1, 2, 0) == 1.0);
    assert_true(tera_hw_shared(&hw, 2, 1, 0) == 1.0);
    assert_true(tera_hw_shared(&hw, 8, 1, 1) == 0.25);
    assert_true(tera_hw_shared(&hw, 2, 2, 0) == 0.5);
    /* one process's throughput on both cores, 0.6 (products) and 0.8 (memory) of twice one core's */
    hw.all_cores[0] = 0.6, hw.all_cores[1] = 0.8;
    assert_true(fabs(tera_hw_shared(&hw, 2, 1, 0) - 0.6) < 1e-15);
    assert_true(fabs(tera_hw_shared(&hw, 4, 1, 0) - 0.3) < 1e-15);
    assert_true(fabs(tera_hw_shared(&hw, 2, 2, 0) - 0.5) < 1e-15); /* 4 threads' 0.3 over 2 threads' 0.6 */
    assert_true(fabs(tera_hw_shared(&hw, 8, 1, 1) - 0.2) < 1e-15);
    assert_true(tera_hw_shared(&hw, 1, 2, 0) == 1.0);
    hw.all_cores[0] = hw.all_cores[1] = 0.0;
    hw.share[hw.n_share++] = (tera_hw_share){.ranks = 2, .threads = 1, .compute = 0.7, .memory = 0.9};
    hw.share[hw.n_share++] = (tera_hw_share){.ranks = 4, .threads = 1, .compute = 0.3, .memory = 0.4};
    assert_true(fabs(tera_hw_shared(&hw, 2, 1, 0) - 0.7) < 1e-15);
    assert_true(fabs(tera_hw_shared(&hw, 2, 1, 1) - 0.9) < 1e-15);
    assert_true(fabs(tera_hw_shared(&hw, 3, 1, 0) - 0.5) < 1e-15); /* halfway between 2 and 4 */
    assert_true(fabs(tera_hw_shared(&hw, 8, 1, 0) - 0.3 * 4 / 8) < 1e-15); /* 4 ranks' throughput shared by 8 */
    assert_true(fabs(tera_hw_shared(&hw, 8, 2, 1) - 0.4 * 4 / 8) < 1e-15); /* the nearest thread count's points */
    /* read back */
    snprintf(hw.name, sizeof hw.name, "shared");
    hw.memory_bytes = 1e9, hw.devices_per_node = 4096, hw.peak_flops[TERA_HW_FP32] = hw.peak_flops[TERA_HW_BF16] = 1e11;
    hw.intra_bw = hw.inter_bw = 1e9, hw.intra_lat = hw.inter_lat = 1e-6;
    char path[] = "/tmp/tera_test_plan_sh_XXXXXX";
    const int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(tera_hw_write(&hw, path, NULL), TERA_OK);
    tera_hw r;
    if (tera_hw_load(&r, path) != TERA_OK) fail_msg("%s", tera_last_error());
    assert_int_equal(r.n_share, 2);
    assert_true(r.share[1].ranks == 4 && r.share[1].threads == 1 && fabs(r.share[1].memory - 0.4) < 1e-12);
    /* the all-cores fractions derived at load: the median ratio over shapes measured at 1 and 2 threads,
     * the memory points' ratio */
    hw.n_share = 0;
    hw.mem_bw_threads[1] = 10e9, hw.mem_bw_threads[2] = 16e9;
    static const double one[3] = {100e9, 110e9, 90e9}, two[3] = {130e9, 150e9, 140e9}; /* ratios 0.65, 0.68.., 0.77.. */
    for (int i = 0; i < 3; i++) {
        hw.gemm[hw.n_gemm++] = (tera_hw_gemm){.threads = 1, .prec = TERA_HW_FP32, .m = 64 << i, .k = 32, .n = 32, .flops_s = one[i]};
        hw.gemm[hw.n_gemm++] = (tera_hw_gemm){.threads = 2, .prec = TERA_HW_FP32, .m = 64 << i, .k = 32, .n = 32, .flops_s = two[i]};
    }
    hw.gemm[hw.n_gemm++] = (tera_hw_gemm){.threads = 2, .prec = TERA_HW_FP32, .m = 9, .k = 9, .n = 9, .flops_s = 1e9}; /* unpaired */
    assert_int_equal(tera_hw_write(&hw, path, NULL), TERA_OK);
    if (tera_hw_load(&r, path) != TERA_OK) fail_msg("%s", tera_last_error());
    assert_true(fabs(r.all_cores[0] - 150e9 / 220e9) < 1e-12 && fabs(r.all_cores[1] - 0.8) < 1e-12);
    assert_true(fabs(tera_hw_shared(&r, 4, 1, 0) - 2.0 * (150e9 / 220e9) / 4.0) < 1e-12);
    FILE *f = fopen(path, "w");
    fprintf(f, "[device]\nname = x\n[shared]\npoint = 1 1 0.5 0.5\n");
    fclose(f);
    assert_int_equal(tera_hw_load(&r, path), TERA_ERR_CONFIG);
    if (!strstr(tera_last_error(), ":4:") || !strstr(tera_last_error(), "RANKS (>= 2) THREADS COMPUTE MEMORY"))
        fail_msg("message lacks the line or the form: %s", tera_last_error());
    remove(path);
}

/* A small MoE on a CPU host description for the time model's sharing tests. */
static void cpu_host(tera_hw *hw, double fc2, double fm2) {
    memset(hw, 0, sizeof *hw);
    snprintf(hw->name, sizeof hw->name, "cpu host");
    hw->memory_bytes = 64e9, hw->devices_per_node = 4096, hw->cores = 2;
    hw->peak_flops[TERA_HW_FP32] = hw->peak_flops[TERA_HW_BF16] = 100e9;
    hw->gemm_efficiency = 0.5, hw->mem_bw = 10e9;
    hw->intra_bw = hw->inter_bw = 1e30, hw->intra_lat = hw->inter_lat = 0.0; /* transfers free */
    if (fc2 > 0) hw->share[hw->n_share++] = (tera_hw_share){.ranks = 2, .threads = 1, .compute = fc2, .memory = fm2};
}

static void cpu_config(tera_config *c, const char *const *sets) {
    tera_config_defaults(c);
    c->training.seq_len = 64;
    c->training.micro_batch = 2;
    c->training.grad_accum = 4;
    c->training.threads = 1;
    c->training.global_batch = 0;
    for (int k = 0; sets && sets[k]; k++) assert_int_equal(tera_config_set(c, sets[k]), TERA_OK);
    assert_int_equal(tera_config_finalize(c), TERA_OK);
}

/* The time model on a host whose ranks share its cores: two data-parallel ranks computing at once run
 * their products at the measured compute fraction and their memory passes (and the optimizer) at the
 * memory fraction, and their transfers hide behind nothing; a two-stage pipeline whose two ranks
 * together run no faster than one (fraction 0.5) takes exactly the one-stage run's compute (the
 * bubble's core goes to the other stage), and with A = 1 (never two at once) the fraction does not
 * matter. */
static void test_shared_time(void **state) {
    (void)state;
    const tera_plan_opts o = {.efficiency = 0.5, .reserve = 0.1, .threads = 1, .products_prec = -1};
    tera_hw dev, cpu;
    cpu_host(&dev, 0, 0);
    dev.cores = 0; /* the same figures, a device per rank */
    cpu_host(&cpu, 0.7, 0.8);
    tera_config c;
    const char *const dp2[] = {"parallel.dp=2", NULL};
    cpu_config(&c, dp2);
    tera_plan_time td, tc;
    assert_int_equal(tera_plan_time_model(&c, &dev, &o, &td), TERA_OK);
    assert_int_equal(tera_plan_time_model(&c, &cpu, &o, &tc), TERA_OK);
    assert_true(td.matmul_s > 0 && td.optimizer_s > 0);
    assert_true(fabs(tc.matmul_s - td.matmul_s / 0.7) <= 1e-12 * tc.matmul_s);
    assert_true(fabs(tc.memory_s - td.memory_s / 0.8) <= 1e-12 * tc.memory_s);
    assert_true(fabs(tc.optimizer_s - td.optimizer_s / 0.8) <= 1e-12 * tc.optimizer_s);
    assert_true(tc.dp_s == tc.dp_total_s); /* nothing hidden on the shared cores */
    /* the pipeline */
    const char *const pp2[] = {"parallel.pp=2", "model.n_layers=4", NULL}, *const pp1[] = {"model.n_layers=4", NULL};
    tera_config c1, c2;
    cpu_config(&c1, pp1);
    cpu_config(&c2, pp2);
    tera_hw one;
    cpu_host(&one, 0.5, 0.5);
    tera_plan_time t1, t2;
    assert_int_equal(tera_plan_time_model(&c1, &one, &o, &t1), TERA_OK);
    assert_int_equal(tera_plan_time_model(&c2, &one, &o, &t2), TERA_OK);
    const double pipe1 = t1.step_s - t1.optimizer_s - t1.dp_s, pipe2 = t2.step_s - t2.optimizer_s - t2.dp_s;
    if (!(fabs(pipe2 - pipe1) <= 1e-9 * pipe1)) fail_msg("pp2 on one core's throughput %.9f s, pp1 %.9f s", pipe2, pipe1);
    c2.training.grad_accum = 1, c1.training.grad_accum = 1;
    tera_plan_time a, b;
    cpu_host(&cpu, 0.3, 0.3);
    assert_int_equal(tera_plan_time_model(&c2, &one, &o, &a), TERA_OK);
    assert_int_equal(tera_plan_time_model(&c2, &cpu, &o, &b), TERA_OK);
    assert_true(fabs((a.step_s - a.optimizer_s) - (b.step_s - b.optimizer_s)) <= 1e-12 * a.step_s);
    assert_int_equal(tera_plan_time_model(&c1, &one, &o, &t1), TERA_OK);
    assert_true(fabs((a.step_s - a.optimizer_s) - (t1.step_s - t1.optimizer_s)) <= 1e-9 * a.step_s);
}

/* ZeRO's sums and ZeRO-3's gathers in host-shared memory (src/parallel/zero.c) on a CPU host whose
 * file has a shared_sum fit: priced by the bytes one rank reads and writes at that fit, per stage
 * (dp 2, S the summed floats = bytes_dp of ZeRO-0 / 4): ZeRO-0 8 S, ZeRO-1 4 (S + S/2) plus its
 * parameter all-gather (its piece copied into the other buffer: 8 S/2), ZeRO-2 4 A (S + 2 S/2) plus
 * the same all-gather, ZeRO-3 4 A (S + 2 S/2) and 8 bytes a float of its own gathered pieces (on 2
 * ranks the bytes the gathers count); the collectives instead with parallel.hierarchical and on
 * devices; experts over part of the ranks (dp 4 x ep 2) in the same block. */
static void test_shared_sum_time(void **state) {
    (void)state;
    const tera_plan_opts o = {.efficiency = 0.5, .reserve = 0.1, .threads = 1, .products_prec = -1};
    tera_hw cpu, dev;
    const double alpha = 3e-6, beta = 20e9;
    cpu_host(&cpu, 0.7, 0.8); /* transfers through the segment free (links 1e30, no fits) */
    cpu.coll[cpu.n_coll++] = (tera_hw_coll){.kind = TERA_HW_SHARED_SUM, .ranks = 2, .alpha_s = alpha, .beta_bytes_s = beta};
    dev = cpu;
    dev.cores = 0;
    tera_plan_time t[4];
    tera_config c;
    for (int z = 0; z < 4; z++) {
        char zs[32];
        snprintf(zs, sizeof zs, "parallel.zero=%d", z);
        const char *const sets[] = {"parallel.dp=2", zs, NULL};
        cpu_config(&c, sets);
        assert_int_equal(tera_plan_time_model(&c, &cpu, &o, &t[z]), TERA_OK);
        tera_plan_time d;
        assert_int_equal(tera_plan_time_model(&c, &dev, &o, &d), TERA_OK);
        assert_true(d.dp_total_s < 1e-15); /* devices: the free links, no shared sums */
        assert_true(t[z].bytes_dp == d.bytes_dp); /* counted as the collectives either way */
    }
    const double A = c.training.grad_accum, L = c.model.n_layers, S = t[0].bytes_dp / 4.0;
    const double n_sums = 2.0 * (L + 2); /* non-expert and expert region of each group (layers, embedding, head) */
    assert_true(S > 0 && t[0].dp_s == t[0].dp_total_s); /* nothing hidden on the shared cores */
    /* ZeRO-1/2's parameter all-gather: each rank's piece (S / 2) copied into the other buffer, 4 S bytes */
    const double ag = alpha + 4.0 * S / beta, grads2 = A * n_sums * alpha + A * 8.0 * S / beta;
    const double want0 = n_sums * alpha + 8.0 * S / beta, want1 = n_sums * alpha + 6.0 * S / beta + ag;
    const double want2 = grads2 + ag;
    if (fabs(t[0].dp_total_s - want0) > 1e-12 * want0) fail_msg("ZeRO-0 %.9g s, want %.9g", t[0].dp_total_s, want0);
    if (fabs(t[1].dp_total_s - want1) > 1e-12 * want1) fail_msg("ZeRO-1 %.9g s, want %.9g", t[1].dp_total_s, want1);
    if (fabs(t[2].dp_total_s - want2) > 1e-12 * want2) fail_msg("ZeRO-2 %.9g s, want %.9g", t[2].dp_total_s, want2);
    const double gathers = t[3].bytes_dp - A * t[0].bytes_dp / 2.0; /* ZeRO-3's gathered bytes (dp 2: its pieces) */
    const double n_g = 2.0 * A * L + 2.0, want3 = grads2 + n_g * alpha + 2.0 * gathers / beta;
    assert_true(gathers > 0);
    if (fabs(t[3].dp_total_s - want3) > 1e-12 * want3) fail_msg("ZeRO-3 %.9g s, want %.9g", t[3].dp_total_s, want3);
    /* 1-bit Adam's ZeRO-1 copies its updated pieces the same way (its 1-bit all-reduce free here) */
    const char *const ob[] = {"parallel.dp=2", "parallel.zero=1", "optimizer.name=onebit_adam", NULL};
    tera_plan_time t1b;
    cpu_config(&c, ob);
    assert_int_equal(tera_plan_time_model(&c, &cpu, &o, &t1b), TERA_OK);
    if (fabs(t1b.dp_total_s - ag) > 1e-9 * ag) fail_msg("1-bit Adam ZeRO-1 %.9g s, want %.9g", t1b.dp_total_s, ag);
    /* the collectives (free here) where zero.c keeps them: the hierarchical reducer */
    const char *const hier[] = {"parallel.dp=2", "parallel.hierarchical=true", NULL};
    tera_plan_time h;
    cpu_config(&c, hier);
    assert_int_equal(tera_plan_time_model(&c, &cpu, &o, &h), TERA_OK);
    assert_true(h.dp_total_s < 1e-15);
    /* experts over part of the data-parallel ranks (dp 4, ep 2: edp 2) sum and gather in the same
     * block, every stage */
    for (int z = 0; z < 4; z++) {
        char zs[32];
        snprintf(zs, sizeof zs, "parallel.zero=%d", z);
        const char *const part[] = {"parallel.dp=4", "parallel.ep=2", zs, NULL};
        cpu_config(&c, part);
        assert_int_equal(tera_plan_time_model(&c, &cpu, &o, &h), TERA_OK);
        if (!(h.dp_total_s > 1e-9)) fail_msg("dp 4 x ep 2 ZeRO-%d: %.3g s of data-parallel sums", z, h.dp_total_s);
    }
}

/* The expert exchange: parallel.ep_hierarchical over two nodes is priced as its two stages (inside the
 * node (k-1)/k of the rows, then between the nodes (N-1)/N), on one node as the flat exchange;
 * parallel.ep_overlap hides tera_plan_ep_overlap_hidden's figure (checked against the closed form)
 * of the point-to-point exchange on devices, nothing of the two-stage one or on a CPU host. */
/* Sequence parallelism (parallel.sequence_parallel) in the planner. Memory: the allocator's own count
 * keeps 1/tp of the residual stream's rows (each layer's x_in and h, rstd1 and rstd2, the final x_final and
 * rstdf: exactly those bytes fewer, with the 64-byte carving) and adds the tensor-parallel module's scratch
 * (the partial outputs' [N, D], two norms' [D], the counts); with full recomputation a layer keeps only
 * its input's rows (and the work set its h and statistics). Time: its reduce-scatters and all-gathers send the all-reduces' bytes in as many ring
 * steps, so on alpha-beta links the tensor-parallel time grows by the norms' gradient all-reduces alone
 * (2 a layer and the final norm's, D floats each, in one call a layer and one for the head). */
static int64_t carved(int64_t floats) { return (4 * floats + 63) / 64 * 64; }

/* the default model with micro-batches of 2 x 32 tokens */
static void config_2x32(tera_config *c) {
    tera_config_defaults(c);
    c->training.seq_len = 32;
    c->training.micro_batch = 2;
    assert_int_equal(tera_config_finalize(c), TERA_OK);
}

static void test_sequence_parallel(void **state) {
    (void)state;
    tera_config c;
    config_2x32(&c);
    const int64_t L = c.model.n_layers, D = c.model.dim, N = 2 * 32;
    for (int tp = 2; tp <= 4; tp *= 2)
        for (int full = 0; full < 2; full++) {
            tera_model_config mc = c.model;
            mc.recompute = full ? "full" : "none";
            tera_model_bytes b[2];
            for (int sp = 0; sp < 2; sp++) {
                const tera_model_par par = {.ep = 1, .tp = tp, .sp = sp};
                assert_int_equal(tera_model_count(&mc, 2, 32, &par, &b[sp]), TERA_OK);
            }
            const int64_t R = N / tp;
            const int64_t rows = carved(N * D) - carved(R * D), stat = carved(N) - carved(R);
            /* a layer's x_in, h, ln1, ln2 and the norms' statistics; full: each layer's x_in, and the one
             * work set's h, ln1, ln2, rstd1, rstd2 for the layer recomputed; then the final norm's input and
             * statistics */
            const int64_t want = (full ? L * rows + 3 * rows + 2 * stat : L * (4 * rows + 2 * stat)) + rows + stat;
            /* the partial outputs' and the gathered inputs' [N, D], the norms' [2, D], the counts */
            const int64_t scratch = 2 * carved(N * D) + carved(2 * D) + (8 * tp + 63) / 64 * 64;
            if (b[0].acts - b[1].acts != want || b[1].scratch - b[0].scratch != scratch)
                fail_msg("tp %d, full recompute %d: activations %lld -> %lld (want %lld fewer), scratch %lld -> %lld "
                         "(want %lld more)", tp, full, (long long)b[0].acts, (long long)b[1].acts, (long long)want,
                         (long long)b[0].scratch, (long long)b[1].scratch, (long long)scratch);
        }
    /* rows that do not divide over the ranks: refused by the count, naming the option */
    const tera_model_par odd = {.ep = 1, .tp = 2, .sp = 1};
    tera_model_bytes cnt;
    assert_int_equal(tera_model_count(&c.model, 1, 33, &odd, &cnt), TERA_ERR_CONFIG);
    assert_non_null(strstr(tera_last_error(), "parallel.sequence_parallel"));
    /* time on alpha-beta links */
    tera_hw hw;
    h100_alpha_beta(&hw);
    const tera_plan_opts o = {.efficiency = 0.5, .reserve = 0.1, .threads = 1};
    tera_plan_time t[2];
    for (int sp = 0; sp < 2; sp++) {
        tera_config cc;
        tera_config_defaults(&cc);
        cc.training.seq_len = 256;
        cc.training.micro_batch = 2;
        cc.training.grad_accum = 3;
        cc.parallel.tp = 2;
        cc.parallel.sequence_parallel = sp;
        cc.training.global_batch = 0;
        assert_int_equal(tera_config_finalize(&cc), TERA_OK);
        assert_int_equal(tera_plan_time_model(&cc, &hw, &o, &t[sp]), TERA_OK);
    }
    const double A = 3, norms = 4.0 * (2.0 * L + 1) * D; /* bytes of the norms' gradients, ring 1/2 x 2 */
    const double inputs = 0.5 * 4.0 * 2.0 * L * 512 * D; /* ln1 and ln2 gathered again in the backward, ring 1/2 */
    const double want_bytes = A * (norms + inputs),
                 want_s = A * (norms / hw.intra_bw + (L + 1) * 2.0 * hw.intra_lat + inputs / hw.intra_bw +
                               2.0 * L * hw.intra_lat);
    if (!(fabs(t[1].bytes_tp - t[0].bytes_tp - want_bytes) <= 1e-9 * t[0].bytes_tp &&
          fabs(t[1].tp_s - t[0].tp_s - want_s) <= 1e-9 * t[0].tp_s && t[0].tp_s > 0))
        fail_msg("tensor-parallel bytes %.0f -> %.0f (want %.0f more), seconds %.9g -> %.9g (want %.9g more)",
                 t[0].bytes_tp, t[1].bytes_tp, want_bytes, t[0].tp_s, t[1].tp_s, want_s);
    /* the element-wise passes of the rank's rows: fewer memory-pass seconds, the same products */
    assert_true(t[1].memory_s < t[0].memory_s && t[1].matmul_s == t[0].matmul_s);
}

/* Expert parallelism keeps, per MoE layer, the rows it received (xr [R, D]) with their counts and
 * offsets, and the results that came back (ye): the rows it sent and the results it sent back are
 * scratch (the dispatcher's backward buffers), not activations. Against one rank (local experts, which
 * keep their grouped rows xg [N k, D] for the backward): exactly the layer buffers that differ, and
 * one [R, D] exchange buffer a kept MoE layer (once for the work set under full recomputation). */
static void test_expert_exchange_memory(void **state) {
    (void)state;
    tera_config c;
    config_2x32(&c);
    const int64_t N = 2 * 32, D = c.model.dim, F = c.model.ffn_dim, E = c.model.n_experts, K = c.model.top_k;
    const int64_t moe = c.model.n_layers - c.model.first_k_dense;
    assert_true(moe > 1 && E % 4 == 0);
    for (int ep = 2; ep <= 4; ep *= 2)
        for (int full = 0; full < 2; full++) {
            tera_model_config mc = c.model;
            mc.recompute = full ? "full" : "none";
            tera_model_bytes b[2];
            const tera_model_par one = {.ep = 1, .tp = 1}, par = {.ep = ep, .tp = 1};
            assert_int_equal(tera_model_count(&mc, 2, 32, &one, &b[0]), TERA_OK);
            assert_int_equal(tera_model_count(&mc, 2, 32, &par, &b[1]), TERA_OK);
            const int64_t El = E / ep, R = ep * N * (K < El ? K : El), NK = N * K;
            /* a MoE layer's buffers that differ: xr, rcnt [E], roff [ep + 1] against xg; the hidden [R, F] x 3 */
            const int64_t layer = carved(R * D) + carved(E) + carved(ep + 1) - carved(NK * D) +
                                  3 * (carved(R * F) - carved(NK * F));
            /* full: the layers keep x_in only; the one work set holds a MoE layer's buffers */
            const int64_t want = (full ? 1 : moe) * layer;
            const int64_t comm_acts = (full ? 1 : moe) * R * D * 4;
            if (b[1].acts - b[0].acts != want || b[1].comm_acts != comm_acts || b[0].comm_acts != 0)
                fail_msg("ep %d, full recompute %d: activations %lld -> %lld (want %lld more), exchange part %lld "
                         "(want %lld)", ep, full, (long long)b[0].acts, (long long)b[1].acts, (long long)want,
                         (long long)b[1].comm_acts, (long long)comm_acts);
            /* bf16 rows out (tera_model_par.a2a_rows_bf16): one coded buffer, the rows received [R] x 2 D bytes;
             * the rows sent are coded into a buffer free at the time (the backward's dye, or ye) */
            tera_model_par p16 = par;
            p16.a2a_rows_bf16 = 1;
            tera_model_bytes b16;
            assert_int_equal(tera_model_count(&mc, 2, 32, &p16, &b16), TERA_OK);
            const int64_t coded = R * 2 * D;
            if (b16.comm - b[1].comm != coded || b16.scratch - b[1].scratch != (coded + 63) / 64 * 64 ||
                b16.acts != b[1].acts)
                fail_msg("ep %d, bf16 rows out: comm %lld -> %lld, scratch %lld -> %lld (want %lld more)", ep,
                         (long long)b[1].comm, (long long)b16.comm, (long long)b[1].scratch, (long long)b16.scratch,
                         (long long)coded);
        }
}

/* ZeRO-2/3's staging (the allocation's and the planner's one count): untied, the embedding and the
 * head share one gradient buffer of the larger size; tied, each slot has its own. Sizes in floats,
 * rounded up to 16. */
static void test_zero_staging(void **state) {
    (void)state;
    const int64_t size[3][2] = {{100, 0}, {64, 0}, {200, 40}}; /* embedding, head, layer x (non-expert, expert) */
    const int64_t emb = 112, head = 64, layer = 208 + 48;
    /* gradients (+ parameters for stage 3), the layer's spare gradient buffer, its prefetch buffer */
    assert_int_equal(tera_zero_staging_floats(size, 2, 0, 0), emb + layer + layer);
    assert_int_equal(tera_zero_staging_floats(size, 2, 0, 1), emb + head + layer + layer);
    assert_int_equal(tera_zero_staging_floats(size, 3, 0, 0), (emb + layer) + (emb + head + layer) + layer);
    assert_int_equal(tera_zero_staging_floats(size, 3, 1, 0), (emb + layer) + (emb + head + layer) + 2 * layer);
    assert_int_equal(tera_zero_staging_floats(size, 3, 1, 1), 2 * (emb + head + layer) + 2 * layer);
    const int64_t larger_head[3][2] = {{64, 0}, {100, 0}, {200, 40}};
    assert_int_equal(tera_zero_staging_floats(larger_head, 2, 0, 0), emb + layer + layer);
}

static void test_expert_exchange_time(void **state) {
    (void)state;
    /* the overlap's closed form: ep 2, experts long (c'/2 > x): the rows out hidden, the last (only)
     * block's return not, x each way; short (x > c'/2): the own block's compute, c'/2 */
    assert_true(fabs(tera_plan_ep_overlap_hidden(2, 1.0, 30.0, 0.0, 0.0) - 2.0) < 1e-12);
    assert_true(fabs(tera_plan_ep_overlap_hidden(2, 1.0, 0.3, 0.0, 0.0) - (0.05 + 0.1)) < 1e-12);
    /* ep 4, x = 3, c = 12: forward c' = 4: max(1, 3) + 3 + 1 = 7 of 3 + 4 + 3 = 10: 3 hidden; backward
     * c' = 8: max(2, 3) + 6 + 1 = 10 of 14: 4 */
    assert_true(fabs(tera_plan_ep_overlap_hidden(4, 3.0, 12.0, 0.0, 0.0) - 7.0) < 1e-12);
    assert_true(tera_plan_ep_overlap_hidden(1, 3.0, 12.0, 0.0, 0.0) == 0.0);
    /* the shared experts run while the rows out travel: ep 2, x = 1, c = 0.3, forward side work 0.5:
     * max(0.5 + 0.05, 1) + 0.05 + 1 = 2.05 of 1 + 0.5 + 0.1 + 1 = 2.6: 0.55 hidden; backward 0.2:
     * max(0.2 + 0.1, 1) + 0.1 + 1 = 2.1 of 2.4: 0.3; side work longer than the transfer (forward 2):
     * the rows out wholly hidden, max(2.05, 1) + 0.05 + 1 = 3.1 of 4.1: 1, and the backward's 0.1 */
    assert_true(fabs(tera_plan_ep_overlap_hidden(2, 1.0, 0.3, 0.5, 0.2) - (0.55 + 0.3)) < 1e-12);
    assert_true(fabs(tera_plan_ep_overlap_hidden(2, 1.0, 0.3, 2.0, 0.0) - (1.0 + 0.1)) < 1e-12);
    tera_hw hw;
    h100_alpha_beta(&hw);
    const int k = hw.devices_per_node;
    const tera_plan_opts o = {.efficiency = 0.5, .reserve = 0.1, .threads = 1, .products_prec = -1};
    for (int ep = k; ep <= 2 * k; ep *= 2) {
        tera_plan_time t[2][2]; /* [ep_hierarchical][ep_overlap] */
        tera_config c;
        for (int h = 0; h < 2; h++)
            for (int ov = 0; ov < 2; ov++) {
                tera_config_defaults(&c);
                c.training.seq_len = 64, c.training.micro_batch = 1, c.training.grad_accum = 2;
                c.training.global_batch = 0;
                c.model.n_experts = 2 * k;
                c.parallel.dp = c.parallel.ep = ep;
                c.parallel.ep_hierarchical = h, c.parallel.ep_overlap = ov;
                assert_int_equal(tera_config_finalize(&c), TERA_OK);
                assert_int_equal(tera_plan_time_model(&c, &hw, &o, &t[h][ov]), TERA_OK);
            }
        const int moe = c.model.n_layers - c.model.first_k_dense, A = c.training.grad_accum;
        const double rows = (double)c.training.micro_batch * c.training.seq_len * c.model.top_k * c.model.dim * 4.0;
        const double flat = A * moe * (4.0 * (ep - 1.0) / ep * rows / hw.inter_bw * (ep > k ? 1.0 : hw.inter_bw / hw.intra_bw) +
                                       5.0 * (ep - 1) * (ep > k ? hw.inter_lat : hw.intra_lat));
        if (!(fabs(t[0][0].ep_s - flat) <= 1e-9 * flat)) fail_msg("ep %d flat: %.9g s, want %.9g", ep, t[0][0].ep_s, flat);
        /* ep_overlap on the flat exchange: the difference is what it hides, at most the exchange */
        assert_true(t[0][1].ep_hidden_s > 0 && fabs(t[0][0].ep_s - t[0][1].ep_s - t[0][1].ep_hidden_s) <= 1e-9 * flat);
        { /* a shared expert: its work runs while the rows out travel, so more is hidden (the same exchange) */
            tera_config cs = c;
            cs.parallel.ep_hierarchical = 0;
            cs.model.n_shared_experts = 1;
            tera_plan_time ts[2];
            for (int ov = 0; ov < 2; ov++) {
                cs.parallel.ep_overlap = ov;
                assert_int_equal(tera_plan_time_model(&cs, &hw, &o, &ts[ov]), TERA_OK);
            }
            if (!(ts[0].ep_s == t[0][0].ep_s && ts[0].ep_hidden_s == 0.0 && ts[1].ep_hidden_s > t[0][1].ep_hidden_s &&
                  fabs(ts[0].ep_s - ts[1].ep_s - ts[1].ep_hidden_s) <= 1e-9 * flat))
                fail_msg("ep %d, a shared expert: exchange %.9g s, hidden %.9g (%.9g without it), want more hidden", ep,
                         ts[1].ep_s, ts[1].ep_hidden_s, t[0][1].ep_hidden_s);
        }
        if (ep == k) { /* one node: the two-stage exchange does not apply */
            assert_true(t[1][0].ep_s == t[0][0].ep_s && t[1][1].ep_s == t[0][1].ep_s);
            continue;
        }
        const int N = ep / k;
        const double t1 = (k - 1.0) / k * rows / hw.intra_bw + (k - 1) * hw.intra_lat;
        const double t2 = (N - 1.0) / N * rows / hw.inter_bw + (N - 1) * hw.inter_lat;
        const double want = A * moe * (4.0 * (t1 + t2) + (k - 1) * hw.intra_lat + (N - 1) * hw.inter_lat);
        if (!(fabs(t[1][0].ep_s - want) <= 1e-9 * want)) fail_msg("ep %d two-stage: %.9g s, want %.9g", ep, t[1][0].ep_s, want);
        assert_true(t[1][1].ep_s == t[1][0].ep_s && t[1][1].ep_hidden_s == 0.0); /* not overlapped */
        assert_true(fabs(t[1][0].bytes_ep - A * moe * 4.0 * ((k - 1.0) / k + (N - 1.0) / N) * rows) <= 1e-9 * t[1][0].bytes_ep);
    }
    /* on a CPU host nothing is hidden */
    tera_hw cpu;
    cpu_host(&cpu, 0, 0);
    tera_config c;
    const char *const ep2[] = {"parallel.dp=2", "parallel.ep=2", "parallel.ep_overlap=1", NULL};
    cpu_config(&c, ep2);
    tera_plan_time t;
    assert_int_equal(tera_plan_time_model(&c, &cpu, &o, &t), TERA_OK);
    assert_true(t.ep_hidden_s == 0.0);
    /* the bytes an element takes as tera sends it, ep over 2 nodes: fp32 4 + 4 out and back; bf16 products
     * 2 + 4 (the rows out as bf16); a2a_compression = bf16 2 + 2; TERA_A2A_ROWS_BF16=0 4 + 4; and inside
     * one node under bf16 products 2 + 4 as well */
    const char *const sets[4][3] = { /* case 4: sets[1] inside one node */{"training.precision=fp32", NULL}, {"training.precision=bf16", NULL},
                                    {"training.precision=bf16", "parallel.a2a_compression=bf16", NULL},
                                    {"training.precision=bf16", NULL}};
    const double want[5] = {1.0, 0.75, 0.5, 1.0, 0.75};
    double b0 = 0.0;
    for (int i = 0; i < 5; i++) {
        tera_config_defaults(&c);
        c.parallel.dp = c.parallel.ep = i < 4 ? 2 * k : k;
        c.model.n_experts = 2 * k;
        const char *const *set = sets[i < 4 ? i : 1];
        for (int j = 0; set[j]; j++) assert_int_equal(tera_config_set(&c, set[j]), TERA_OK);
        assert_int_equal(tera_config_finalize(&c), TERA_OK);
        if (i == 3) setenv("TERA_A2A_ROWS_BF16", "0", 1);
        assert_int_equal(tera_plan_time_model(&c, &hw, &o, &t), TERA_OK);
        unsetenv("TERA_A2A_ROWS_BF16");
        if (i == 0 || i == 4) { /* case 4 against fp32 inside one node */
            tera_config f = c;
            assert_int_equal(tera_config_set(&f, "training.precision=fp32"), TERA_OK);
            tera_plan_time tf;
            assert_int_equal(tera_plan_time_model(&f, &hw, &o, &tf), TERA_OK);
            b0 = tf.bytes_ep;
        }
        if (!(b0 > 0 && fabs(t.bytes_ep - want[i] * b0) <= 1e-9 * b0))
            fail_msg("case %d: exchange bytes %.0f, want %.3f of fp32's %.0f", i, t.bytes_ep, want[i], b0);
    }
}

/* 1-bit Adam (optimizer.name = onebit_adam): the memory src/train/onebit.c adds (ZeRO-1's whole
 * momentum, two residuals per shared region, its message buffers) in its own category; the bytes after
 * the warm-up are the momentum's 1-bit all-reduce (and ZeRO-1/2's fp32 parameter all-gather, ZeRO-3's
 * layer gathers), exposed; ZeRO-2/3 add the rank's own whole gradient. */
static void test_onebit(void **state) {
    (void)state;
    tera_hw hw;
    h100_alpha_beta(&hw);
    const tera_plan_opts o = {.efficiency = 0.5, .reserve = 0.1, .threads = 1, .products_prec = -1};
    for (int zero = 0; zero <= 3; zero++) {
        tera_config c, a;
        char z[32];
        snprintf(z, sizeof z, "parallel.zero=%d", zero);
        const char *const sets[] = {"parallel.dp=4", "parallel.ep=2", z, "optimizer.name=onebit_adam", NULL};
        cpu_config(&c, sets);
        a = c;
        snprintf(a.optimizer.name, sizeof a.optimizer.name, "adamw");
        tera_plan_mem m, ma;
        assert_int_equal(tera_plan_rank_memory(&c, 0, 1, &m), TERA_OK);
        assert_int_equal(tera_plan_rank_memory(&a, 0, 1, &ma), TERA_OK);
        assert_int_equal(ma.bytes[TERA_PM_ONEBIT], 0);
        const int64_t n = m.n_floats, nd = m.n_dense, nx = n - nd;
        int64_t want = (zero ? 4 * n : 0) + (zero >= 2 ? 4 * n : 0); /* ZeRO-2/3: the rank's own whole gradient */
        const int64_t len[2] = {nd, nx};
        const int q[2] = {4, 2};
        for (int x = 0; x < 2; x++) {
            const int64_t chunk = ((len[x] + q[x] - 1) / q[x] + 15) & ~(int64_t)15;
            want += 8 * len[x] + tera_compress_bytes(TERA_COMPRESS_ONEBIT, len[x]) +
                    q[x] * tera_compress_bytes(TERA_COMPRESS_ONEBIT, chunk) + 4 * chunk;
        }
        assert_int_equal(m.bytes[TERA_PM_ONEBIT], want);
        assert_int_equal(m.total - ma.total, want);
        tera_plan_time t, ta;
        assert_int_equal(tera_plan_time_model(&c, &hw, &o, &t), TERA_OK);
        assert_int_equal(tera_plan_time_model(&a, &hw, &o, &ta), TERA_OK);
        const double cb = 2.0 * (3.0 / 4.0 * (double)tera_compress_bytes(TERA_COMPRESS_ONEBIT, nd) +
                                 1.0 / 2.0 * (double)tera_compress_bytes(TERA_COMPRESS_ONEBIT, nx));
        const double pass = 4.0 * (3.0 / 4.0 * nd + 1.0 / 2.0 * nx);
        if (zero <= 2) { /* ZeRO-1/2: one fp32 all-gather of the updated parameters */
            if (!(fabs(t.bytes_dp - (cb + (zero ? pass : 0.0))) <= 1e-9 * t.bytes_dp))
                fail_msg("ZeRO-%d: 1-bit bytes %.0f, want %.0f", zero, t.bytes_dp, cb + (zero ? pass : 0.0));
            assert_true(t.dp_s == t.dp_total_s);
        } else { /* ZeRO-3: AdamW's layer gathers (the same bytes), no gradient reduce-scatter */
            if (!(fabs(t.bytes_dp - (cb + ta.bytes_dp - (double)c.training.grad_accum * pass)) <= 1e-9 * t.bytes_dp))
                fail_msg("ZeRO-3: 1-bit bytes %.0f, want %.0f", t.bytes_dp,
                         cb + ta.bytes_dp - (double)c.training.grad_accum * pass);
        }
        assert_true(t.bytes_dp < ta.bytes_dp);
    }
}

/* The bf16 weight shadow (tera_bf16_shadow_on, include/tera/precision.h): the planner's bf16_shadow
 * category equals the bytes the trainer's backend holds (tera_backend_weights_shadow_bytes), one rank,
 * for each case of the rule: bf16 on the native units at one micro-batch (the update writes it, 2 bytes
 * per parameter), the A/B switches TERA_BF16_SHADOW=lazy (then only grad_accum >= 4) and =0, bf16 on
 * the FMA units, fp32, and 1-bit Adam. Where the CPU has no bf16 GEMM kernels no case has one. */
static void test_shadow_is_the_trainer(void **state) {
    (void)state;
    tera_set_threads(1);
    tera_backend *be = tera_backend_cpu_create(-1);
    const int native = be->caps.bf16_native(be);
    tera_backend_destroy(be);
    if (!native) print_message("no bf16 GEMM kernels on this CPU: every case without a shadow\n");
    const struct {
        const char *prec, *units, *env, *opt;
        int accum, on;
    } cases[] = {{"bf16", "native", NULL, "adamw", 1, 1},   {"bf16", "native", "lazy", "adamw", 1, 0},
                 {"bf16", "native", "lazy", "adamw", 4, 1}, {"bf16", "native", "0", "adamw", 4, 0},
                 {"bf16", "fma", NULL, "adamw", 1, 0},      {"fp32", "auto", NULL, "adamw", 4, 0},
                 {"bf16", "native", NULL, "onebit_adam", 1, 0}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        tera_config c = tu_tiny_moe_config(1, cases[k].accum);
        c.training.threads = 1;
        snprintf(c.training.precision, sizeof c.training.precision, "%s", cases[k].prec);
        snprintf(c.training.bf16_gemm, sizeof c.training.bf16_gemm, "%s", cases[k].units);
        snprintf(c.optimizer.name, sizeof c.optimizer.name, "%s", cases[k].opt);
        assert_int_equal(tera_config_finalize(&c), TERA_OK);
        if (cases[k].env) setenv("TERA_BF16_SHADOW", cases[k].env, 1);
        else unsetenv("TERA_BF16_SHADOW");
        tera_plan_mem pm;
        assert_int_equal(tera_plan_rank_memory(&c, 0, 1, &pm), TERA_OK);
        tera_trainer tr;
        if (tera_trainer_init(&tr, &c, "", 0) != TERA_OK) fail_msg("case %zu: %s", k, tera_last_error());
        const int64_t held = tera_backend_weights_shadow_bytes(tr.model.be), n = tr.model.n_floats;
        tera_trainer_free(&tr);
        unsetenv("TERA_BF16_SHADOW");
        print_message("%s/%s %s accum %d TERA_BF16_SHADOW=%s: trainer %lld, plan %lld bytes\n", cases[k].prec,
                      cases[k].units, cases[k].opt, cases[k].accum, cases[k].env ? cases[k].env : "(unset)",
                      (long long)held, (long long)pm.bytes[TERA_PM_SHADOW]);
        assert_int_equal(held, cases[k].on && native ? 2 * n : 0);
        assert_int_equal(pm.bytes[TERA_PM_SHADOW], held);
        int64_t sum = 0;
        for (int b = 0; b < TERA_PM_N; b++) sum += pm.bytes[b];
        assert_int_equal(sum, pm.total);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_one_rank_exact), cmocka_unit_test(test_count_is_the_allocator),
                                       cmocka_unit_test(test_calibrated_file), cmocka_unit_test(test_roles_cover_the_world),
                                       cmocka_unit_test(test_hardware_files), cmocka_unit_test(test_hierarchical_dp_time),
                                       cmocka_unit_test(test_shared_fractions), cmocka_unit_test(test_shared_time),
                                       cmocka_unit_test(test_shared_sum_time),
                                       cmocka_unit_test(test_sequence_parallel), cmocka_unit_test(test_expert_exchange_memory), cmocka_unit_test(test_zero_staging),
                                       cmocka_unit_test(test_expert_exchange_time), cmocka_unit_test(test_onebit),
                                       cmocka_unit_test(test_shadow_is_the_trainer)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
