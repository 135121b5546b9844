/* tera against the independent PyTorch implementation (tests/ref/tera_ref.py), tensor by tensor.
 * Fixtures (tests/fixtures/NAME/) hold a Hugging Face directory (config.json, model.safetensors)
 * and fixture.safetensors: a batch, the logits, losses, routing, every gradient, and five AdamW
 * steps (losses, grad norms, LRs, final weights, final aux-free bias).
 *
 * Tolerances (float32 with different summation orders):
 *   logits, losses:            |a-b| <= 2e-5 * max|b| (+ losses rel 1e-5)
 *   gradients (per tensor):    max|a-b| <= 1e-4 * max|b| + 1e-7
 *   5-step losses/norms:       rel 1e-4;   final weights: max|a-b| <= 1e-3 * max|b|   */
#include "testutil.h"
#include <unistd.h>

#include "tera/data.h"
#include "tera/hf.h"
#include "tera/kernels.h"
#include "tera/safetensors.h"
#include "tera/train.h"

#ifndef TERA_SOURCE_DIR
#define TERA_SOURCE_DIR "."
#endif

static double max_abs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
    return m;
}

/* max|a-b| / max|b| for one tensor, printed for the record. */
static double rel_err(const char *fx, const char *what, const float *a, const float *b, int64_t n) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - (double)b[i]));
    if (d != d) d = INFINITY;
    double r = d / (max_abs(b, n) + 1e-30);
    if (getenv("TERA_TEST_VERBOSE")) fprintf(stderr, "  %s %-64s max|diff| %.3g rel %.3g\n", fx, what, d, r);
    return r;
}

static float *read_tensor(const tera_st_file *f, const char *name, int64_t *numel) {
    const tera_st_tensor *t = tera_st_find(f, name);
    if (!t) {
        fprintf(stderr, "fixture lacks %s\n", name);
        fail();
    }
    float *buf = malloc(sizeof(float) * (size_t)(t->numel ? t->numel : 1));
    assert_int_equal(tera_st_read_f32(f, name, t->ndim, t->shape, buf), TERA_OK);
    if (numel) *numel = t->numel;
    return buf;
}

static int32_t *read_i32(const tera_st_file *f, const char *name, int64_t *numel) {
    const tera_st_tensor *t = tera_st_find(f, name);
    assert_non_null(t);
    assert_int_equal(t->dtype, TERA_DT_I32);
    int32_t *buf = malloc(sizeof(int32_t) * (size_t)t->numel);
    memcpy(buf, f->data + t->begin, sizeof(int32_t) * (size_t)t->numel);
    if (numel) *numel = t->numel;
    return buf;
}

static double meta(const tera_st_file *f, const char *k) {
    const char *v = tera_st_meta(f, k);
    assert_non_null(v);
    return atof(v);
}

/* Compares every parameter of m (buffer `base`) with fixture tensors PREFIX<hf name>. */
static void compare_params(const char *fx, const tera_model *m, const float *base, const tera_st_file *f,
                           const char *prefix, double tol) {
    char nm[256], hf[160];
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        int ne = p->expert_stacked ? (int)p->shape[0] : 1;
        int64_t per = p->numel / ne;
        for (int e = 0; e < ne; e++) {
            if (p->expert_stacked)
                snprintf(hf, sizeof hf, p->name, e);
            else
                snprintf(hf, sizeof hf, "%s", p->name);
            snprintf(nm, sizeof nm, "%s%s", prefix, hf);
            int64_t n;
            float *want = read_tensor(f, nm, &n);
            assert_int_equal(n, per);
            double r = rel_err(fx, nm, base + p->offset + e * per, want, per);
            if (!(r <= tol)) {
                fprintf(stderr, "%s: %s relative error %.3g > %.1g\n", fx, nm, r, tol);
                fail();
            }
            free(want);
        }
    }
}

static void run_fixture(const char *name) {
    char dir[1024], path[1200];
    snprintf(dir, sizeof dir, "%s/tests/fixtures/%s", TERA_SOURCE_DIR, name);
    snprintf(path, sizeof path, "%s/fixture.safetensors", dir);
    tera_st_file f;
    assert_int_equal(tera_st_open(&f, path), TERA_OK);
    const int B = (int)meta(&f, "B"), T = (int)meta(&f, "T");

    tera_config cfg;
    tera_config_defaults(&cfg);
    assert_int_equal(tera_hf_read_config(dir, &cfg.model), TERA_OK); /* the routing options too */
    cfg.training.seq_len = T;
    cfg.training.micro_batch = B;
    cfg.training.grad_accum = 1;
    cfg.training.steps = (int)meta(&f, "total_steps");
    cfg.training.warmup_steps = (int)meta(&f, "warmup_steps");
    cfg.training.lr = (float)meta(&f, "lr");
    cfg.training.min_lr = (float)meta(&f, "min_lr");
    cfg.training.grad_clip = (float)meta(&f, "grad_clip");
    cfg.optimizer.beta1 = (float)meta(&f, "beta1");
    cfg.optimizer.beta2 = (float)meta(&f, "beta2");
    cfg.optimizer.eps = (float)meta(&f, "eps");
    cfg.optimizer.weight_decay = (float)meta(&f, "weight_decay");
    cfg.logging.progress = 0;
    assert_int_equal(tera_config_finalize(&cfg), TERA_OK);

    /* ---- one forward/backward on the fixture batch */
    tera_model m;
    assert_int_equal(tera_model_create(&m, &cfg.model, B, T), TERA_OK);
    assert_int_equal(tera_hf_import(&m, dir), TERA_OK);
    int32_t *inputs = read_i32(&f, "inputs", NULL), *targets = read_i32(&f, "targets", NULL);
    tera_model_forward(&m, inputs, targets);
    int64_t nl;
    float *logits = read_tensor(&f, "logits", &nl);
    assert_int_equal(nl, (int64_t)B * T * cfg.model.vocab_size);
    assert_true(rel_err(name, "logits", m.logits, logits, nl) <= 2e-5);
    const int nmoe = m.n_moe_layers;
    const double ce = m.stats.ce_sum / (B * T), aux = nmoe ? m.stats.aux_sum / (nmoe * B) : 0,
                 z = nmoe ? m.stats.z_sum / ((double)nmoe * B * T) : 0;
    const double loss = ce + cfg.model.aux_coef * aux + cfg.model.z_coef * z;
    float *w_loss = read_tensor(&f, "loss", NULL), *w_ce = read_tensor(&f, "ce_loss", NULL),
          *w_aux = read_tensor(&f, "aux_loss", NULL), *w_z = read_tensor(&f, "z_loss", NULL);
    fprintf(stderr, "%s: loss %.7f (torch %.7f) ce %.7f (%.7f) aux %.7f (%.7f) z %.7f (%.7f), dropped %ld/%ld\n",
            name, loss, w_loss[0], ce, w_ce[0], aux, w_aux[0], z, w_z[0], (long)m.stats.n_dropped,
            (long)m.stats.n_assign);
    assert_true(fabs(loss - w_loss[0]) <= 1e-5 * fabs(w_loss[0]));
    assert_true(fabs(ce - w_ce[0]) <= 1e-5 * fabs(w_ce[0]));
    assert_true(fabs(aux - w_aux[0]) <= 1e-5 * fabs(w_aux[0]) + 1e-7);
    assert_true(fabs(z - w_z[0]) <= 1e-5 * fabs(w_z[0]) + 1e-7);

    tera_loss_scales s = {1.0f / (B * T), nmoe ? cfg.model.aux_coef / (float)(nmoe * B) : 0,
                          nmoe ? cfg.model.z_coef / (float)((int64_t)nmoe * B * T) : 0};
    tera_model_zero_grad(&m);
    tera_model_forward(&m, inputs, targets);
    tera_model_backward(&m, &s);
    compare_params(name, &m, m.g, &f, "grad.", 1e-4);

    /* ---- five AdamW steps through the trainer, data from the fixture's token stream */
    int64_t ns;
    int32_t *stream = read_i32(&f, "stream", &ns);
    char tmpd[] = "/tmp/tera-ref-XXXXXX";
    assert_non_null(mkdtemp(tmpd));
    char prefix[128];
    snprintf(prefix, sizeof prefix, "%s/stream", tmpd);
    const int32_t *docs[1] = {stream};
    assert_int_equal(tera_idx_write(prefix, 4, docs, &ns, 1), TERA_OK);
    snprintf(cfg.data.path, sizeof cfg.data.path, "%s", prefix);
    snprintf(cfg.data.format, sizeof cfg.data.format, "bin");
    cfg.data.val_fraction = 0.0f;
    snprintf(cfg.training.init_from, sizeof cfg.training.init_from, "%s", dir);
    snprintf(cfg.training.precision, sizeof cfg.training.precision, "fp32"); /* the fixtures are fp32 */
    tera_trainer tr;
    assert_int_equal(tera_trainer_init(&tr, &cfg, "", 0), TERA_OK);
    float *w_losses = read_tensor(&f, "train_losses", NULL), *w_norms = read_tensor(&f, "train_grad_norms", NULL),
          *w_lrs = read_tensor(&f, "train_lrs", NULL);
    for (int st = 0; st < cfg.training.steps; st++) {
        tera_step_result r;
        assert_int_equal(tera_trainer_step(&tr, &r), TERA_OK);
        fprintf(stderr, "%s: step %d loss %.7f (torch %.7f) grad norm %.6f (%.6f) lr %.6g (%.6g)\n", name, st,
                r.loss, w_losses[st], r.grad_norm, w_norms[st], r.lr, w_lrs[st]);
        assert_true(fabs(r.loss - w_losses[st]) <= 1e-4 * fabs(w_losses[st]));
        assert_true(fabs(r.grad_norm - w_norms[st]) <= 1e-4 * fabs(w_norms[st]));
        assert_true(fabsf(r.lr - w_lrs[st]) <= 1e-6f * fabsf(w_lrs[st]));
    }
    compare_params(name, &tr.model, tr.model.w, &f, "final.", 1e-3);
    if (cfg.model.aux_free) {
        for (int l = cfg.model.first_k_dense; l < cfg.model.n_layers; l++) {
            char bn[64];
            snprintf(bn, sizeof bn, "final_bias.%d", l);
            float *wb = read_tensor(&f, bn, NULL);
            const float *got = tr.model.router_bias + (int64_t)l * cfg.model.n_experts;
            assert_true(rel_err(name, bn, got, wb, cfg.model.n_experts) <= 1e-6);
            free(wb);
        }
    }
    tera_trainer_free(&tr);
    snprintf(path, sizeof path, "rm -rf %s", tmpd);
    assert_int_equal(system(path), 0);

    free(stream);
    free(w_losses);
    free(w_norms);
    free(w_lrs);
    free(w_loss);
    free(w_ce);
    free(w_aux);
    free(w_z);
    free(logits);
    free(inputs);
    free(targets);
    tera_model_destroy(&m);
    tera_st_close(&f);
}

static void test_mixtral(void **state) { (void)state; run_fixture("mixtral"); }
static void test_deepseek(void **state) { (void)state; run_fixture("deepseek"); }
static void test_capprob(void **state) { (void)state; run_fixture("capprob"); }
/* DeepSeek-V3 routing: 256 experts, top-8 by sigmoid score + aux-free bias inside the 4 best of 8
 * groups, weights x 2.5, balancing loss on s / sum(s) */
static void test_sigmoid(void **state) { (void)state; run_fixture("sigmoid"); }
/* group-limited routing on softmax probabilities (group score = max), weights x 1.5 */
static void test_softgroups(void **state) { (void)state; run_fixture("softgroups"); }

int main(void) {
    tera_set_threads(2);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mixtral),
        cmocka_unit_test(test_deepseek),
        cmocka_unit_test(test_capprob),
        cmocka_unit_test(test_sigmoid),
        cmocka_unit_test(test_softgroups),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
