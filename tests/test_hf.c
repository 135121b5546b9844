/* Hugging Face export/import: bit-exact weight and router-bias round trips, config.json round trips,
 * sharded export, and refusals (missing/extra/misshapen tensors, bad config.json, non-empty target).
 * Models are built by hand from the parameter table (no tera_model_create). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tera/hf.h"
#include "tera/safetensors.h"

#ifndef TERA_SOURCE_DIR
#define TERA_SOURCE_DIR "."
#endif

/* ------------------------------------------------------------------------------- helpers -- */

static char g_tmp[256];   /* per-test temporary directory */
static char g_out[512];   /* g_tmp/out: the export target */

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static int setup_dir(void **state) {
    snprintf(g_tmp, sizeof g_tmp, "/tmp/tera_hf_XXXXXX");
    assert_non_null(mkdtemp(g_tmp));
    snprintf(g_out, sizeof g_out, "%s/out", g_tmp);
    return 0;
}

static int teardown_dir(void **state) {
    nftw(g_tmp, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}

static const char *in_out(const char *name) {
    static char buf[4][640];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_out, name);
    return buf[k];
}

static int exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
}

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    b[n] = '\0';
    fclose(f);
    return b;
}

static void expect_error(tera_status got, tera_status want, const char *a, const char *b) {
    const char *msg = tera_last_error();
    if (got != want || (a && !strstr(msg, a)) || (b && !strstr(msg, b)))
        fail_msg("status %d (want %d), message \"%s\" should contain \"%s\" and \"%s\"", (int)got, (int)want, msg,
                 a ? a : "", b ? b : "");
}

/* GQA, a shared expert, one dense layer, capacity factor with probability dropping, aux-free bias. */
static tera_model_config full_config(void) {
    tera_model_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 37;
    c.dim = 16;
    c.n_layers = 3;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.n_experts = 4;
    c.top_k = 2;
    c.ffn_dim = 8;
    c.n_shared_experts = 1;
    c.first_k_dense = 1;
    c.dense_ffn_dim = 12;
    c.max_seq_len = 64;
    c.sliding_window = 48;
    c.rope_theta = 10000.0f;
    c.norm_eps = 1e-5f;
    c.init_std = 0.02f;
    c.tie_embeddings = 0;
    c.capacity_factor = 1.25f;
    c.drop_policy = TERA_DROP_PROBABILITY;
    c.aux_coef = 0.01f;
    c.z_coef = 0.001f;
    c.aux_free = 1;
    c.aux_free_rate = 0.001f;
    c.router_score = TERA_ROUTER_SIGMOID;
    c.n_groups = 2;
    c.topk_groups = 1;
    c.routed_scale = 2.5f;
    return c;
}

/* Plain Mixtral: MHA, tied embeddings, no extras. */
static tera_model_config plain_config(void) {
    tera_model_config c = full_config();
    c.n_kv_heads = 4;
    c.n_shared_experts = 0;
    c.first_k_dense = 0;
    c.dense_ffn_dim = 16;
    c.tie_embeddings = 1;
    c.capacity_factor = 0.0f;
    c.drop_policy = TERA_DROP_POSITION;
    c.aux_free = 0;
    c.rope_theta = 1e6f;
    c.norm_eps = 1e-6f;
    c.init_std = 0.1f;
    c.sliding_window = 0;
    c.router_score = TERA_ROUTER_SOFTMAX;
    c.n_groups = 1;
    c.topk_groups = 1;
    c.routed_scale = 1.0f;
    return c;
}

static float pattern(uint64_t i, uint32_t seed) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (float)((int64_t)(x >> 40) - (1 << 23)) * 0x1p-23f; /* in [-1, 1), full mantissa */
}

/* A model with its table, weights (pattern over parameters only) and router bias [L, E]. */
static void build(tera_model *m, const tera_model_config *c, uint32_t seed) {
    memset(m, 0, sizeof *m);
    m->cfg = *c;
    m->params = tera_param_table(c, &m->n_params, &m->n_floats);
    m->w = calloc((size_t)m->n_floats, sizeof(float));
    m->router_bias = calloc((size_t)(c->n_layers * c->n_experts), sizeof(float));
    assert_non_null(m->w);
    assert_non_null(m->router_bias);
    if (seed == 0) return;
    for (int i = 0; i < m->n_params; i++)
        for (int64_t j = 0; j < m->params[i].numel; j++)
            m->w[m->params[i].offset + j] = pattern((uint64_t)(m->params[i].offset + j), seed);
    for (int i = 0; i < c->n_layers * c->n_experts; i++) m->router_bias[i] = pattern((uint64_t)i, seed + 7);
}

static void destroy(tera_model *m) {
    free(m->params);
    free(m->w);
    free(m->router_bias);
}

static void assert_same_weights(const tera_model *a, const tera_model *b) {
    assert_int_equal(a->n_params, b->n_params);
    for (int i = 0; i < a->n_params; i++) {
        const tera_param *p = &a->params[i];
        if (memcmp(a->w + p->offset, b->w + p->offset, sizeof(float) * (size_t)p->numel) != 0)
            fail_msg("parameter %s differs after the round trip", p->name);
    }
}

static int is_moe(const tera_model_config *c, int l) { return l >= c->first_k_dense; }

static void assert_bias(const tera_model *src, const tera_model *dst, int expect_loaded) {
    const int E = src->cfg.n_experts;
    for (int l = 0; l < src->cfg.n_layers; l++)
        for (int e = 0; e < E; e++) {
            float want = expect_loaded && is_moe(&src->cfg, l) ? src->router_bias[l * E + e] : 0.0f;
            if (memcmp(&dst->router_bias[l * E + e], &want, sizeof want) != 0)
                fail_msg("router bias [%d,%d] = %g, want %g", l, e, dst->router_bias[l * E + e], want);
        }
}

#define EXPECT_FIELD(f) assert_memory_equal(&a->f, &b->f, sizeof a->f)
static void assert_same_config(const tera_model_config *a, const tera_model_config *b) {
    EXPECT_FIELD(vocab_size);
    EXPECT_FIELD(dim);
    EXPECT_FIELD(n_layers);
    EXPECT_FIELD(n_heads);
    EXPECT_FIELD(n_kv_heads);
    EXPECT_FIELD(n_experts);
    EXPECT_FIELD(top_k);
    EXPECT_FIELD(ffn_dim);
    EXPECT_FIELD(n_shared_experts);
    EXPECT_FIELD(first_k_dense);
    EXPECT_FIELD(dense_ffn_dim);
    EXPECT_FIELD(max_seq_len);
    EXPECT_FIELD(sliding_window);
    EXPECT_FIELD(rope_theta);
    EXPECT_FIELD(norm_eps);
    EXPECT_FIELD(init_std);
    EXPECT_FIELD(tie_embeddings);
    EXPECT_FIELD(capacity_factor);
    EXPECT_FIELD(drop_policy);
    EXPECT_FIELD(aux_coef);
    EXPECT_FIELD(z_coef);
    EXPECT_FIELD(aux_free);
    EXPECT_FIELD(aux_free_rate);
    EXPECT_FIELD(router_score);
    EXPECT_FIELD(n_groups);
    EXPECT_FIELD(topk_groups);
    EXPECT_FIELD(routed_scale);
}
#undef EXPECT_FIELD

/* A config with every field different from c (so a field that is not read shows up). */
static tera_model_config scrambled(const tera_model_config *c) {
    tera_model_config s;
    memset(&s, 0, sizeof s);
    s.vocab_size = c->vocab_size + 1;
    s.dim = c->dim + 1;
    s.n_layers = c->n_layers + 1;
    s.n_heads = c->n_heads + 1;
    s.n_kv_heads = c->n_kv_heads + 1;
    s.n_experts = c->n_experts + 1;
    s.top_k = c->top_k + 1;
    s.ffn_dim = c->ffn_dim + 1;
    s.n_shared_experts = c->n_shared_experts + 1;
    s.first_k_dense = c->first_k_dense + 1;
    s.dense_ffn_dim = c->dense_ffn_dim + 1;
    s.max_seq_len = c->max_seq_len + 1;
    s.sliding_window = c->sliding_window + 1;
    s.rope_theta = c->rope_theta + 1;
    s.norm_eps = c->norm_eps * 2;
    s.init_std = c->init_std * 2;
    s.tie_embeddings = !c->tie_embeddings;
    s.capacity_factor = c->capacity_factor + 1;
    s.drop_policy = c->drop_policy == TERA_DROP_POSITION ? TERA_DROP_PROBABILITY : TERA_DROP_POSITION;
    s.aux_coef = c->aux_coef * 2;
    s.z_coef = c->z_coef * 2;
    s.aux_free = !c->aux_free;
    s.aux_free_rate = c->aux_free_rate * 2;
    s.router_score = c->router_score == TERA_ROUTER_SOFTMAX ? TERA_ROUTER_SIGMOID : TERA_ROUTER_SOFTMAX;
    s.n_groups = c->n_groups + 1;
    s.topk_groups = c->topk_groups + 1;
    s.routed_scale = c->routed_scale + 1;
    return s;
}

/* --------------------------------------------------------------------------- round trips -- */

static void roundtrip(const tera_model_config *c, int64_t max_shard) {
    tera_model a, b;
    build(&a, c, 1234);
    build(&b, c, 99); /* different contents: the import must overwrite every parameter and bias */
    assert_int_equal(tera_hf_export(&a, g_out, max_shard, 0), TERA_OK);
    assert_true(exists(in_out("config.json")));
    assert_false(exists(in_out("config.json.tmp")));
    assert_int_equal(tera_hf_import(&b, g_out), TERA_OK);
    assert_same_weights(&a, &b);
    assert_bias(&a, &b, c->aux_free);

    tera_model_config got = scrambled(c);
    assert_int_equal(tera_hf_read_config(g_out, &got), TERA_OK);
    assert_same_config(c, &got);
    destroy(&a);
    destroy(&b);
}

static void test_roundtrip_full(void **state) {
    tera_model_config c = full_config();
    roundtrip(&c, 0);
    assert_true(exists(in_out("model.safetensors")));
    assert_false(exists(in_out("model.safetensors.index.json")));

    /* names as HF spells them, experts unstacked, aux-free bias only on MoE layers */
    tera_st_file f;
    assert_int_equal(tera_st_open(&f, in_out("model.safetensors")), TERA_OK);
    const tera_st_tensor *t = tera_st_find(&f, "model.layers.2.block_sparse_moe.experts.3.w2.weight");
    assert_non_null(t);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], c.dim);
    assert_int_equal(t->shape[1], c.ffn_dim);
    assert_int_equal(t->dtype, TERA_DT_F32);
    assert_non_null(tera_st_find(&f, "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"));
    assert_null(tera_st_find(&f, "model.layers.0.block_sparse_moe.gate.e_score_correction_bias"));
    assert_non_null(tera_st_find(&f, "model.layers.0.mlp.gate_proj.weight"));
    assert_non_null(tera_st_find(&f, "model.layers.1.mlp.shared_experts.down_proj.weight"));
    assert_non_null(tera_st_find(&f, "lm_head.weight"));
    assert_null(tera_st_find(&f, "model.layers.1.block_sparse_moe.experts.4.w1.weight"));
    int n_expected = 1 + 1 + 1; /* embed, norm, lm_head */
    n_expected += 3 * 6;         /* per layer: 2 norms + q k v o */
    n_expected += 3;             /* dense layer 0 */
    n_expected += 2 * (1 + 3 * 4 + 3 + 1); /* MoE layers: gate, 12 experts, 3 shared, bias */
    assert_int_equal(f.n, n_expected);
    tera_st_close(&f);

    /* config.json: floats printed shortest-exact, HF names present */
    char *js = read_text(in_out("config.json"));
    assert_non_null(strstr(js, "\"rms_norm_eps\":\t1e-05"));
    assert_non_null(strstr(js, "\"rope_theta\":\t10000.0"));
    assert_non_null(strstr(js, "\"capacity_factor\":\t1.25"));
    /* dense layer, shared expert, aux-free bias, dropping capacity: no transformers class computes it */
    assert_non_null(strstr(js, "\"model_type\":\t\"tera_moe\""));
    assert_non_null(strstr(js, "\"TeraMoeForCausalLM\""));
    assert_null(strstr(js, "Mixtral"));
    assert_non_null(strstr(js, "\"sliding_window\":\t48"));
    assert_non_null(strstr(js, "\"intermediate_size\":\t8"));
    assert_non_null(strstr(js, "\"moe_intermediate_size\":\t8"));
    assert_non_null(strstr(js, "\"drop_policy\":\t\"probability\""));
    assert_non_null(strstr(js, "\"aux_loss_free\":\ttrue"));
    assert_non_null(strstr(js, "\"scoring_func\":\t\"sigmoid\""));
    assert_non_null(strstr(js, "\"n_group\":\t2"));
    assert_non_null(strstr(js, "\"topk_group\":\t1"));
    assert_non_null(strstr(js, "\"routed_scaling_factor\":\t2.5"));
    assert_non_null(strstr(js, "\"hidden_act\":\t\"silu\""));
    assert_non_null(strstr(js, "\"torch_dtype\":\t\"float32\""));
    free(js);
}

static void test_roundtrip_plain_tied(void **state) {
    tera_model_config c = plain_config();
    roundtrip(&c, 0);
    char *js = read_text(in_out("config.json")); /* exactly a Mixtral: labelled so, no window */
    assert_non_null(strstr(js, "\"model_type\":\t\"mixtral\""));
    assert_non_null(strstr(js, "\"MixtralForCausalLM\""));
    assert_non_null(strstr(js, "\"sliding_window\":\tnull"));
    free(js);
    tera_st_file f;
    assert_int_equal(tera_st_open(&f, in_out("model.safetensors")), TERA_OK);
    assert_null(tera_st_find(&f, "lm_head.weight"));
    assert_null(tera_st_find(&f, "model.layers.0.block_sparse_moe.gate.e_score_correction_bias"));
    tera_st_close(&f);
}

static void test_roundtrip_sharded(void **state) {
    tera_model_config c = full_config();
    roundtrip(&c, 4096);
    assert_true(exists(in_out("model.safetensors.index.json")));
    assert_false(exists(in_out("model.safetensors")));
    tera_st_set s;
    assert_int_equal(tera_st_set_open(&s, g_out), TERA_OK);
    assert_true(s.n_files > 1);
    char name[64];
    for (int i = 0; i < s.n_files; i++) {
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", i + 1, s.n_files);
        assert_non_null(strstr(s.files[i].path, name));
        uint64_t bytes = 0;
        for (int t = 0; t < s.files[i].n; t++) bytes += s.files[i].tensors[t].end - s.files[i].tensors[t].begin;
        assert_true(bytes <= 4096); /* every tensor here is below the limit */
    }
    tera_st_set_close(&s);
}

/* Absent bias -> zeros, even when the importing model held other values. */
static void test_bias_absent_is_zero(void **state) {
    tera_model_config c = full_config();
    c.aux_free = 0;
    tera_model a, b;
    build(&a, &c, 5);
    build(&b, &c, 6);
    assert_int_equal(tera_hf_export(&a, g_out, 0, 0), TERA_OK);
    b.cfg.aux_free = 1;
    assert_int_equal(tera_hf_import(&b, g_out), TERA_OK);
    assert_bias(&a, &b, 0);
    destroy(&a);
    destroy(&b);
}

/* --------------------------------------------------------------------------- config.json -- */

static void test_config_fields(void **state) {
    assert_int_equal(mkdir(g_out, 0755), 0);
    tera_model_config c = full_config();
    /* HF Mixtral's own config: no kv heads -> = heads, unknown fields ignored, nulls ignored */
    write_text(in_out("config.json"),
               "{\"architectures\": [\"MixtralForCausalLM\"], \"model_type\": \"mixtral\", \"hidden_size\": 32,"
               " \"num_attention_heads\": 8, \"sliding_window\": null, \"attention_dropout\": 0.0,"
               " \"rope_theta\": 1e6, \"rms_norm_eps\": 1e-05, \"output_router_logits\": false,"
               " \"torch_dtype\": \"bfloat16\", \"num_experts_per_tok\": 2, \"tie_word_embeddings\": false}");
    assert_int_equal(tera_hf_read_config(g_out, &c), TERA_OK);
    assert_int_equal(c.dim, 32);
    assert_int_equal(c.n_heads, 8);
    assert_int_equal(c.n_kv_heads, 8);
    assert_true(c.rope_theta == 1e6f);
    assert_true(c.norm_eps == 1e-5f);
    assert_int_equal(c.vocab_size, 37); /* absent: kept */
    assert_int_equal(c.drop_policy, TERA_DROP_PROBABILITY);

    /* moe_intermediate_size wins over intermediate_size for the expert width */
    write_text(in_out("config.json"), "{\"intermediate_size\": 100, \"moe_intermediate_size\": 24}");
    assert_int_equal(tera_hf_read_config(g_out, &c), TERA_OK);
    assert_int_equal(c.ffn_dim, 24);
}

static void test_config_refusals(void **state) {
    tera_model_config c = full_config(), keep = c;
    expect_error(tera_hf_read_config(g_out, &c), TERA_ERR_IO, "config.json", g_out); /* no dir at all */
    assert_int_equal(mkdir(g_out, 0755), 0);
    expect_error(tera_hf_read_config(g_out, &c), TERA_ERR_IO, "config.json", NULL);
    static const char *const bad[][2] = {
        {"{\"model_type\": \"llama\"}", "model_type"},
        {"{\"model_type\": 3}", "model_type"},
        {"{\"hidden_size\": \"16\"}", "hidden_size"},
        {"{\"num_local_experts\": 2.5}", "num_local_experts"},
        {"{\"num_hidden_layers\": 1e12}", "num_hidden_layers"},
        {"{\"rope_theta\": \"big\"}", "rope_theta"},
        {"{\"tie_word_embeddings\": 1}", "tie_word_embeddings"},
        {"{\"aux_loss_free\": \"yes\"}", "aux_loss_free"},
        {"{\"drop_policy\": \"random\"}", "drop_policy"},
        {"{\"scoring_func\": \"relu\"}", "scoring_func"},
        {"{\"n_group\": 1.5}", "n_group"},
        {"{\"hidden_act\": \"gelu\"}", "hidden_act"},
        {"{\"vocab_size\": 10, \"hidden_size\": [16]}", "hidden_size"},
        {"{\"vocab_size\": 10,", "config.json"},
        {"[1, 2]", "config.json"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(in_out("config.json"), bad[i][0]);
        expect_error(tera_hf_read_config(g_out, &c), TERA_ERR_FORMAT, bad[i][1], "config.json");
        assert_same_config(&keep, &c); /* untouched on failure */
    }
}

/* -------------------------------------------------------------------------------- import -- */

/* Rewrites out/model.safetensors: drops tensor `drop`, replaces `reshape` by a 1-D tensor of shape
 * [shape[0] + 1], and adds `extra` (F32 [2]). NULL skips each. */
static void rewrite(const char *drop, const char *reshape, const char *extra) {
    tera_st_file f;
    assert_int_equal(tera_st_open(&f, in_out("model.safetensors")), TERA_OK);
    float *big = calloc(4096, sizeof(float));
    tera_st_writer w;
    tera_st_writer_init(&w);
    for (int i = 0; i < f.n; i++) {
        const tera_st_tensor *t = &f.tensors[i];
        if (drop && strcmp(t->name, drop) == 0) continue;
        if (reshape && strcmp(t->name, reshape) == 0) {
            int64_t s1[1] = {t->shape[0] + 1};
            tera_st_writer_add(&w, t->name, TERA_DT_F32, 1, s1, big);
            continue;
        }
        tera_st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, f.data + t->begin);
    }
    int64_t s2[1] = {2};
    if (extra) tera_st_writer_add(&w, extra, TERA_DT_F32, 1, s2, big);
    assert_int_equal(tera_st_writer_save(&w, in_out("model.safetensors")), TERA_OK); /* old inode stays mapped */
    tera_st_writer_free(&w);
    tera_st_close(&f);
    free(big);
}

static void test_import_refusals(void **state) {
    tera_model_config c = full_config();
    tera_model a, b;
    build(&a, &c, 11);
    build(&b, &c, 0);
    assert_int_equal(tera_hf_export(&a, g_out, 0, 0), TERA_OK);

    const char *w3 = "model.layers.1.block_sparse_moe.experts.2.w3.weight";
    rewrite(w3, NULL, NULL);
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_FORMAT, w3, g_out);

    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    rewrite(NULL, "model.norm.weight", NULL);
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_FORMAT, "'model.norm.weight'", "[17]");

    const char *extra = "model.layers.1.block_sparse_moe.experts.4.w1.weight";
    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    rewrite(NULL, NULL, extra);
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_FORMAT, extra, g_out);

    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    rewrite(NULL, NULL, "lm_head.bias");
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_FORMAT, "lm_head.bias", NULL);

    /* a bias on a dense layer is not a tensor of this model */
    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    rewrite(NULL, NULL, "model.layers.0.block_sparse_moe.gate.e_score_correction_bias");
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_FORMAT, "model.layers.0.block_sparse_moe", NULL);

    /* a bias of the wrong size */
    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    rewrite(NULL, "model.layers.2.block_sparse_moe.gate.e_score_correction_bias", NULL);
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_FORMAT, "e_score_correction_bias", "[5]");

    /* tensors outside model./lm_head. are ignored */
    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    rewrite(NULL, NULL, "optimizer.step");
    assert_int_equal(tera_hf_import(&b, g_out), TERA_OK);
    assert_same_weights(&a, &b);

    /* a model built for another config (no shared experts) refuses the extra tensors */
    tera_model_config c2 = c;
    c2.n_shared_experts = 0;
    tera_model d;
    build(&d, &c2, 0);
    expect_error(tera_hf_import(&d, g_out), TERA_ERR_FORMAT, "shared_experts", NULL);
    destroy(&d);

    /* no weights at all */
    assert_int_equal(unlink(in_out("model.safetensors")), 0);
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_IO, g_out, NULL);
    destroy(&a);
    destroy(&b);
}

static void test_import_tied_lm_head(void **state) {
    tera_model_config c = plain_config();
    tera_model a, b;
    build(&a, &c, 21);
    build(&b, &c, 0);
    const tera_param *emb = tera_model_param(&a, "model.embed_tokens.weight");
    assert_non_null(emb);
    /* an lm_head.weight equal to the embedding is accepted */
    tera_st_writer w;
    tera_st_writer_init(&w);
    char name[160];
    for (int i = 0; i < a.n_params; i++) {
        const tera_param *p = &a.params[i];
        for (int e = 0; e < (p->expert_stacked ? (int)p->shape[0] : 1); e++) {
            if (p->expert_stacked) {
                const char *pc = strstr(p->name, "%d");
                snprintf(name, sizeof name, "%.*s%d%s", (int)(pc - p->name), p->name, e, pc + 2);
                tera_st_writer_add(&w, name, TERA_DT_F32, 2, &p->shape[1], a.w + p->offset + e * p->shape[1] * p->shape[2]);
            } else {
                tera_st_writer_add(&w, p->name, TERA_DT_F32, p->ndim, p->shape, a.w + p->offset);
            }
        }
    }
    tera_st_writer_add(&w, "lm_head.weight", TERA_DT_F32, 2, emb->shape, a.w + emb->offset);
    assert_int_equal(mkdir(g_out, 0755), 0);
    assert_int_equal(tera_st_writer_save_dir(&w, g_out, 0), TERA_OK);
    assert_int_equal(tera_hf_import(&b, g_out), TERA_OK);
    assert_same_weights(&a, &b);
    /* ... a different one is refused */
    w.entries[w.n - 1].data = a.w + a.params[1].offset; /* not the embedding */
    assert_int_equal(tera_st_writer_save_dir(&w, g_out, 0), TERA_OK);
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_FORMAT, "lm_head.weight", g_out);
    tera_st_writer_free(&w);
    destroy(&a);
    destroy(&b);
}

/* -------------------------------------------------------------------------------- export -- */

static void test_export_refuses_nonempty(void **state) {
    tera_model_config c = full_config();
    tera_model a;
    build(&a, &c, 3);
    assert_int_equal(mkdir(g_out, 0755), 0);
    write_text(in_out("keep.txt"), "precious");
    expect_error(tera_hf_export(&a, g_out, 0, 0), TERA_ERR_EXISTS, g_out, NULL);
    assert_false(exists(in_out("config.json")));
    assert_false(exists(in_out("model.safetensors")));
    char *t = read_text(in_out("keep.txt"));
    assert_string_equal(t, "precious");
    free(t);
    /* a file where the directory should be */
    char file[700];
    snprintf(file, sizeof file, "%s/afile", g_tmp);
    write_text(file, "x");
    expect_error(tera_hf_export(&a, file, 0, 0), TERA_ERR_EXISTS, file, NULL);
    /* overwrite allowed: replaces the weights, leaves other files alone */
    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    assert_true(exists(in_out("keep.txt")));
    /* an existing empty directory is fine; missing parents are created */
    char nested[700];
    snprintf(nested, sizeof nested, "%s/x/y/z", g_tmp);
    assert_int_equal(tera_hf_export(&a, nested, 0, 0), TERA_OK);
    snprintf(nested, sizeof nested, "%s/empty", g_tmp);
    assert_int_equal(mkdir(nested, 0755), 0);
    assert_int_equal(tera_hf_export(&a, nested, 0, 0), TERA_OK);
    destroy(&a);
}

/* Overwriting a sharded export with a single-file one leaves a readable directory. */
static void test_export_overwrite_shards(void **state) {
    tera_model_config c = full_config();
    tera_model a, b;
    build(&a, &c, 8);
    build(&b, &c, 0);
    assert_int_equal(tera_hf_export(&a, g_out, 4096, 0), TERA_OK);
    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    assert_false(exists(in_out("model.safetensors.index.json")));
    assert_int_equal(tera_hf_import(&b, g_out), TERA_OK);
    assert_same_weights(&a, &b);
    destroy(&a);
    destroy(&b);
}

/* --------------------------------------------------------------- transformers interop -- */

/* Which models transformers' MixtralForCausalLM computes exactly (tera_hf_transformers_gaps), and
 * the export-hf refusal of the others unless --tera-moe. */
static void test_transformers_gaps(void **state) {
    tera_model_config c = plain_config();
    char buf[512];
    assert_int_equal(tera_hf_transformers_gaps(&c, buf, sizeof buf), 0);
    assert_string_equal(buf, "");
    /* no effect at inference: still Mixtral */
    c.aux_coef = 0.5f, c.z_coef = 0.1f, c.aux_free_rate = 0.1f, c.init_std = 1, c.tie_embeddings = 0;
    c.n_kv_heads = 2, c.sliding_window = 64, c.drop_policy = TERA_DROP_PROBABILITY;
    assert_int_equal(tera_hf_transformers_gaps(&c, NULL, 0), 0);
    /* a capacity that can never drop (cf * k >= E: capacity >= T) is dropless */
    c.capacity_factor = 2.0f; /* k = 2, E = 4 */
    assert_int_equal(tera_hf_transformers_gaps(&c, NULL, 0), 0);
    tera_model_config g = plain_config();
    g.first_k_dense = 1;
    assert_int_equal(tera_hf_transformers_gaps(&g, buf, sizeof buf), 1);
    assert_non_null(strstr(buf, "first_k_dense"));
    g = plain_config();
    g.n_shared_experts = 1;
    assert_int_equal(tera_hf_transformers_gaps(&g, buf, sizeof buf), 1);
    assert_non_null(strstr(buf, "n_shared_experts"));
    g = plain_config();
    g.aux_free = 1;
    assert_int_equal(tera_hf_transformers_gaps(&g, buf, sizeof buf), 1);
    assert_non_null(strstr(buf, "aux_free"));
    g = plain_config();
    g.capacity_factor = 1.25f;
    assert_int_equal(tera_hf_transformers_gaps(&g, buf, sizeof buf), 1);
    assert_non_null(strstr(buf, "capacity_factor"));
    g = plain_config(); /* DeepSeek-V3 routing */
    g.router_score = TERA_ROUTER_SIGMOID;
    g.n_groups = 2, g.topk_groups = 1;
    g.routed_scale = 2.5f;
    assert_int_equal(tera_hf_transformers_gaps(&g, buf, sizeof buf), 3);
    assert_non_null(strstr(buf, "router_score"));
    assert_non_null(strstr(buf, "topk_groups"));
    assert_non_null(strstr(buf, "routed_scale"));
    g.router_score = TERA_ROUTER_SOFTMAX, g.topk_groups = 2, g.routed_scale = 1; /* every group allowed, x 1 */
    assert_int_equal(tera_hf_transformers_gaps(&g, NULL, 0), 0);
    g = full_config();
    assert_int_equal(tera_hf_transformers_gaps(&g, buf, sizeof buf), 7);

    /* export-hf refuses (nothing written) unless allowed; the plain model passes */
    tera_model a, b;
    build(&a, &g, 3);
    expect_error(tera_hf_export_checked(&a, g_out, 0, 0, 0), TERA_ERR_CONFIG, "--tera-moe", "shared experts");
    assert_non_null(strstr(tera_last_error(), "dense first layers"));
    assert_non_null(strstr(tera_last_error(), "aux-loss-free"));
    assert_non_null(strstr(tera_last_error(), "capacity factor"));
    assert_false(exists(g_out));
    assert_int_equal(tera_hf_export_checked(&a, g_out, 0, 0, 1), TERA_OK);
    build(&b, &g, 0);
    assert_int_equal(tera_hf_import(&b, g_out), TERA_OK); /* tera reads its tera_moe export */
    assert_same_weights(&a, &b);
    tera_model_config got = scrambled(&g);
    assert_int_equal(tera_hf_read_config(g_out, &got), TERA_OK);
    assert_same_config(&g, &got);
    destroy(&a);
    destroy(&b);
    tera_model_config p = plain_config();
    build(&a, &p, 4);
    assert_int_equal(tera_hf_export_checked(&a, g_out, 0, 1, 0), TERA_OK);
    destroy(&a);
}

/* sliding_window: null or absent = 0 (none), an integer is kept (tera_config_finalize refuses a
 * window below training.seq_len), anything else is refused. */
static void test_config_sliding_window(void **state) {
    assert_int_equal(mkdir(g_out, 0755), 0);
    tera_model_config c = full_config();
    write_text(in_out("config.json"), "{\"sliding_window\": 4096}");
    assert_int_equal(tera_hf_read_config(g_out, &c), TERA_OK);
    assert_int_equal(c.sliding_window, 4096);
    write_text(in_out("config.json"), "{\"sliding_window\": null}");
    assert_int_equal(tera_hf_read_config(g_out, &c), TERA_OK);
    assert_int_equal(c.sliding_window, 0);
    write_text(in_out("config.json"), "{\"model_type\": \"tera_moe\"}");
    assert_int_equal(tera_hf_read_config(g_out, &c), TERA_OK);
    static const char *const bad[] = {"{\"sliding_window\": -1}", "{\"sliding_window\": \"16\"}",
                                      "{\"sliding_window\": 1.5}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(in_out("config.json"), bad[i]);
        expect_error(tera_hf_read_config(g_out, &c), TERA_ERR_FORMAT, "sliding_window", "config.json");
    }
}

/* A NaN or infinite weight is refused at load, naming the file and the tensor. */
static void test_import_nonfinite(void **state) {
    tera_model_config c = plain_config();
    tera_model a, b;
    build(&a, &c, 11);
    build(&b, &c, 0);
    const tera_param *p = tera_model_param(&a, "model.layers.1.self_attn.k_proj.weight");
    assert_non_null(p);
    a.w[p->offset + 5] = NAN;
    assert_int_equal(tera_hf_export(&a, g_out, 0, 0), TERA_OK);
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_NUMERIC, "model.layers.1.self_attn.k_proj.weight",
                 "model.safetensors");
    assert_non_null(strstr(tera_last_error(), "NaN"));
    a.w[p->offset + 5] = -INFINITY;
    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    expect_error(tera_hf_import(&b, g_out), TERA_ERR_NUMERIC, "k_proj", "-inf");
    a.w[p->offset + 5] = 1.0f;
    assert_int_equal(tera_hf_export(&a, g_out, 0, 1), TERA_OK);
    assert_int_equal(tera_hf_import(&b, g_out), TERA_OK);
    destroy(&a);
    destroy(&b);
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup_dir, teardown_dir)

int main(void) {
    const struct CMUnitTest tests[] = {
        T(test_roundtrip_full),        T(test_roundtrip_plain_tied),  T(test_roundtrip_sharded),
        T(test_bias_absent_is_zero),   T(test_config_fields),         T(test_config_refusals),
        T(test_import_refusals),       T(test_import_tied_lm_head),   T(test_export_refuses_nonempty),
        T(test_export_overwrite_shards), T(test_transformers_gaps),    T(test_config_sliding_window),
        T(test_import_nonfinite),
    };
    return cmocka_run_group_tests_name("hf", tests, NULL, NULL);
}
