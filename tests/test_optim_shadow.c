/* The bf16 weight shadow written by the optimizer's update (issue 19; src/train/optim.c, tera_adamw.w16;
 * include/tera/backend.h, weights_shadow_out / weights_filled): the update's rounding is the products'
 * rounding bit for bit (every high half of the fp32 pattern, NaN, infinities, subnormals); the pass
 * writes the rounding of every new weight (fp32 and bf16 moments, vector bodies and tails) and leaves
 * the weights, moments and sums as they are without it; in training (ZeRO-0: grad_accum 4, where the
 * trainer registers the shadow, and one micro-batch: the default at ZeRO-0) the next forward
 * really reads the copy the update wrote (weights changed behind its back show the old rounding in
 * that forward, the fresh one in the next), the run equals one without the shadow and one with the
 * lazy rounding only (TERA_BF16_SHADOW_FILL=0) bit for bit, and the check (TERA_BF16_SHADOW_CHECK=1)
 * aborts on such a change. */
#include "testutil.h"
#include "tera/backend.h"
#include "tera/kernels.h"
#include "tera/train.h"

static tera_backend *g_be; /* created in main */

static int native_bf16(void) {
    if (g_be->caps.bf16_native(g_be)) return 1;
    print_message("skip: bf16 on native units (no bf16 GEMM kernels on this CPU)\n");
    return 0;
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* tera_adamw_shadow_round against the products' rounding (tera_round_bf16: its vector body and its
 * scalar tail) for every high half with several low halves (ties to even and odd, just below and
 * above a tie, zero, a random one). */
static void test_rounding_is_the_products(void **state) {
    (void)state;
    enum { NL = 8 };
    const int64_t n = 65536 * NL;
    float *x = malloc(sizeof(float) * (size_t)n);
    uint16_t *ref = malloc(sizeof(uint16_t) * (size_t)n), one;
    uint64_t s = 12345;
    for (int64_t h = 0; h < 65536; h++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        const uint32_t lows[NL] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, (uint32_t)(s & 0xffff)};
        for (int l = 0; l < NL; l++) x[h * NL + l] = from_bits((uint32_t)h << 16 | lows[l]);
    }
    tera_round_bf16(ref, x, n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t mine = tera_adamw_shadow_round(x[i]);
        tera_round_bf16(&one, x + i, 1); /* the scalar path */
        if (mine != ref[i] || mine != one) {
            uint32_t u;
            memcpy(&u, x + i, sizeof u);
            if (bad++ < 5) print_message("0x%08x: update 0x%04x, products 0x%04x / 0x%04x\n", (unsigned)u, mine, ref[i], one);
        }
    }
    assert_int_equal(bad, 0);
    free(x), free(ref);
}

/* A hand-built table of tensors (lengths with tails and several chunks); w and g from seed, with a
 * NaN, infinities and subnormals among the weights. */
static const int64_t sizes[] = {5, TERA_OPTIM_CHUNK + 7, 1, 256, 2 * TERA_OPTIM_CHUNK - 3, 33};
#define NP ((int)(sizeof sizes / sizeof sizes[0]))

static void fake_model(tera_model *m, tera_param *p, uint64_t seed) {
    tu_fake_model(m, p, sizes, NP, g_be, seed);
    const int64_t off = m->n_floats;
    m->w[3] = NAN, m->w[40] = INFINITY, m->w[41] = -INFINITY, m->w[42] = 1e-40f, m->w[43] = -3e-39f;
    m->w[off - 2] = 1e-41f;
}

static const tera_optim_config oc = {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

/* Three steps with and without the shadow, fp32 and bf16 moments, the gradient cleared or kept: the
 * same weights, moments and sums, and after each step the shadow holds the rounding of every weight. */
static void test_update_writes_the_rounding(void **state) {
    (void)state;
    /* the shadow at every residue of 16 elements from a 64-byte boundary: each tensor's item starts
     * once 32-byte aligned (non-temporal stores where AVX-512 exists) and otherwise (plain stores) */
    for (int shift = 0; shift < 16; shift++)
    for (int bf16m = 0; bf16m < 2; bf16m++)
        for (int zg = 0; zg < 2; zg++) {
            tera_model a, b;
            tera_param pa[NP], pb[NP];
            fake_model(&a, pa, 7), fake_model(&b, pb, 7);
            const int64_t n = a.n_floats;
            tera_adamw oa, ob;
            if (bf16m) tera_adamw_init_range_bf16(&oa, 0, n, 99), tera_adamw_init_range_bf16(&ob, 0, n, 99);
            else tera_adamw_init(&oa, n), tera_adamw_init(&ob, n);
            uint16_t *w16_block = NULL;
            assert_int_equal(posix_memalign((void **)&w16_block, 64, sizeof(uint16_t) * (size_t)(n + 32)), 0);
            uint16_t *w16 = w16_block + shift;
            uint16_t *ref = malloc(sizeof(uint16_t) * (size_t)n);
            for (int s = 0; s < 3; s++) {
                for (int64_t i = 0; i < n + 32; i++) w16_block[i] = 0xAAAA; /* nothing left from before */
                tu_fill(a.g, n, 50 + (uint64_t)s, 0.01f);
                memcpy(b.g, a.g, sizeof(float) * (size_t)n);
                double ua, pa2, ub, pb2;
                oa.w16 = w16;
                tera_adamw_step(&oa, &a, 1e-3f, 0.5f, &oc, zg, &ua, &pa2);
                oa.w16 = NULL;
                tera_adamw_step(&ob, &b, 1e-3f, 0.5f, &oc, zg, &ub, &pb2);
                assert_memory_equal(a.w, b.w, sizeof(float) * (size_t)n); /* NaN included: bits */
                assert_memory_equal(a.g, b.g, sizeof(float) * (size_t)n);
                if (bf16m) assert_memory_equal(oa.mh, ob.mh, sizeof(uint16_t) * 2 * (size_t)n);
                else assert_memory_equal(oa.m, ob.m, sizeof(float) * 2 * (size_t)n);
                assert_memory_equal(&ua, &ub, sizeof ua);
                assert_memory_equal(&pa2, &pb2, sizeof pa2);
                tera_round_bf16(ref, a.w, n);
                for (int64_t i = 0; i < n; i++)
                    if (w16[i] != ref[i])
                        fail_msg("shift %d, moments %s, clear %d, step %d: element %ld 0x%04x, want 0x%04x", shift,
                                 bf16m ? "bf16" : "fp32", zg, s, (long)i, w16[i], ref[i]);
                if (shift) assert_int_equal(w16_block[0], 0xAAAA); /* nothing written before the shadow */
                assert_int_equal(w16[n], 0xAAAA);                  /* nor after it */
            }
            assert_true(a.w[3] != a.w[3] && isinf(a.w[40])); /* the special values were there */
            free(w16_block), free(ref);
            tera_adamw_free(&oa), tera_adamw_free(&ob);
            free(a.w), free(a.g), free(b.w), free(b.g);
        }
}

static tera_config tiny_cfg(int accum) {
    tera_config c = tu_tiny_moe_config(2, accum);
    snprintf(c.training.precision, sizeof c.training.precision, "bf16");
    snprintf(c.training.bf16_gemm, sizeof c.training.bf16_gemm, "native");
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    return c;
}

/* the forward's cross-entropy sum on a fixed batch */
static double forward_ce(tera_trainer *tr) {
    const int64_t BT = (int64_t)tr->cfg.training.micro_batch * tr->cfg.training.seq_len, V = tr->cfg.model.vocab_size;
    for (int64_t i = 0; i < BT; i++) tr->tokens[i] = (int32_t)(i * 7 % V), tr->targets[i] = (int32_t)((i * 7 + 1) % V);
    tera_model_forward(&tr->model, tr->tokens, tr->targets);
    return tr->model.stats.ce_sum;
}

/* Steps of training, then the weights scaled behind the trainer's back: the first forward reads the
 * shadow the last update wrote (the old rounding), the next one rounds the new weights. */
static void corrupt_after_steps(tera_trainer *tr, int steps, double *ce) {
    tera_step_result r;
    for (int s = 0; s < steps; s++) assert_int_equal(tera_trainer_step(tr, &r), TERA_OK);
    for (int64_t i = 0; i < tr->model.n_floats; i++) tr->model.w[i] *= 1.5f;
    for (int k = 0; k < 3; k++) ce[k] = forward_ce(tr);
}

static void test_training_reads_the_filled_shadow(void **state) {
    (void)state;
    if (!native_bf16()) return;
    for (int accum = 1; accum <= 4; accum += 3) {
        const tera_config c = tiny_cfg(accum);
        double la[4], lb[4];
        float *wa = NULL;
        int64_t n = 0;
        /* filled by the update, then (accum 4) rounded lazily only, then without a shadow */
        for (int run = 0; run < 3; run++) {
            if (run == 1 && accum < 4) continue;
            if (run == 2) setenv("TERA_BF16_SHADOW", "0", 1);
            else unsetenv("TERA_BF16_SHADOW"); /* the default: the update writes it at every grad_accum */
            setenv("TERA_BF16_SHADOW_FILL", run == 1 ? "0" : "1", 1);
            setenv("TERA_BF16_SHADOW_CHECK", "1", 1); /* each filled shadow verified when the forward opens */
            tera_trainer tr;
            assert_int_equal(tera_trainer_init(&tr, &c, "", 0), TERA_OK);
            n = tr.model.n_floats;
            assert_int_equal(tera_backend_weights_shadow_bytes(tr.model.be), run < 2 ? 2 * n : 0);
            tera_step_result r;
            for (int s = 0; s < c.training.steps; s++) {
                assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
                (run == 0 ? la : lb)[s] = r.loss;
            }
            if (run == 0) {
                wa = malloc(sizeof(float) * (size_t)n);
                memcpy(wa, tr.model.w, sizeof(float) * (size_t)n);
            } else {
                assert_same("weights after training, filled shadow / lazy or none", wa, tr.model.w, n);
                assert_memory_equal(la, lb, sizeof la);
            }
            tera_trainer_free(&tr);
        }
        unsetenv("TERA_BF16_SHADOW_FILL");
        assert_true(la[3] != la[0]);
        free(wa);
        /* TERA_BF16_SHADOW=lazy: the update writes none; the trainer registers one only where 4
         * micro-batches share it */
        setenv("TERA_BF16_SHADOW", "lazy", 1);
        {
            tera_trainer tl;
            assert_int_equal(tera_trainer_init(&tl, &c, "", 0), TERA_OK);
            assert_int_equal(tera_backend_weights_shadow_bytes(tl.model.be), accum >= 4 ? 2 * n : 0);
            tera_trainer_free(&tl);
        }
        unsetenv("TERA_BF16_SHADOW");

        /* the copy is really read: weights changed after the update show the old rounding once */
        setenv("TERA_BF16_SHADOW_CHECK", "0", 1);
        tera_trainer tr;
        assert_int_equal(tera_trainer_init(&tr, &c, "", 0), TERA_OK);
        double ce[3];
        corrupt_after_steps(&tr, 2, ce);
        print_message("accum %d: cross-entropy with the stale copy %.6f, after the change %.6f, %.6f\n", accum, ce[0],
                      ce[1], ce[2]);
        assert_true(ce[0] != ce[1]);
        assert_memory_equal(&ce[1], &ce[2], sizeof ce[1]);
        tera_trainer_free(&tr);
        unsetenv("TERA_BF16_SHADOW_CHECK");
        unsetenv("TERA_BF16_SHADOW");
    }
}

/* The same change with TERA_BF16_SHADOW_CHECK=1 aborts (in a process of its own: this binary with
 * --corrupt). */
static char g_self[4096];

static void test_check_aborts_on_a_change(void **state) {
    (void)state;
    if (!native_bf16()) return;
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "TERA_BF16_SHADOW_CHECK=1 '%s' --corrupt 2>/dev/null", g_self);
    const int st = system(cmd);
    print_message("--corrupt with the check: status %d\n", st);
    assert_true(st != -1 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0));
    snprintf(cmd, sizeof cmd, "TERA_BF16_SHADOW_CHECK=0 '%s' --corrupt 2>/dev/null", g_self);
    assert_int_equal(system(cmd), 0); /* the same run without the check gets through */
}

static int corrupt_main(void) {
    const tera_config c = tiny_cfg(1);
    tera_trainer tr;
    if (tera_trainer_init(&tr, &c, "", 0) != TERA_OK) return 2;
    double ce[3];
    corrupt_after_steps(&tr, 1, ce); /* aborts in the first forward when the check is on */
    tera_trainer_free(&tr);
    return 0;
}

int main(int argc, char **argv) {
    tera_set_threads(2);
    const ssize_t k = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
    g_self[k > 0 ? k : 0] = '\0';
    if (argc > 1 && !strcmp(argv[1], "--corrupt")) return corrupt_main();
    g_be = tera_backend_cpu_create(-1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rounding_is_the_products),
        cmocka_unit_test(test_update_writes_the_rounding),
        cmocka_unit_test(test_training_reads_the_filled_shadow),
        cmocka_unit_test(test_check_aborts_on_a_change),
    };
    const int failed = cmocka_run_group_tests(tests, NULL, NULL);
    tera_backend_destroy(g_be);
    return failed;
}
