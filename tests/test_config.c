/* Config: defaults, INI loading, overrides, every error class, cross-field checks, write -> load
 * round trip and the generated docs. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "tera/config.h"
#include "tera/status.h"

#ifndef TERA_BINARY_DIR
#define TERA_BINARY_DIR "/tmp"
#endif

/* Every key, as section.key: the docs and the dump must list each one. */
static const char *const all_keys[] = {
    "model.vocab_size",
    "model.dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.n_experts",
    "model.top_k",
    "model.ffn_dim",
    "model.n_shared_experts",
    "model.first_k_dense",
    "model.dense_ffn_dim",
    "model.max_seq_len",
    "model.sliding_window",
    "model.rope_theta",
    "model.norm_eps",
    "model.init_std",
    "model.tie_embeddings",
    "model.capacity_factor",
    "model.drop_policy",
    "model.aux_coef",
    "model.z_coef",
    "model.aux_free",
    "model.aux_free_rate",
    "training.steps",
    "training.seq_len",
    "training.micro_batch",
    "training.grad_accum",
    "training.seed",
    "training.threads",
    "training.warmup_steps",
    "training.lr",
    "training.min_lr",
    "training.grad_clip",
    "training.eval_every",
    "training.eval_batches",
    "training.init_from",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "optimizer.weight_decay",
    "data.path",
    "data.format",
    "data.shuffle",
    "data.val_fraction",
    "parallel.dp",
    "parallel.tp",
    "parallel.pp",
    "parallel.ep",
    "parallel.ep_overlap",
    "parallel.zero",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.max_shard_bytes",
    "logging.run_dir",
    "logging.log_every",
    "logging.progress",
    "logging.profile",
};
#define N_KEYS (sizeof all_keys / sizeof all_keys[0])

/* A per-process scratch path under the build directory. */
static const char *tmp_path(const char *name) {
    static char buf[8][TERA_PATH_MAX];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, TERA_PATH_MAX, "%s/test_config_%d_%s", TERA_BINARY_DIR, (int)getpid(), name);
    return p;
}

/* Writes `text` to a scratch file and returns its path. */
static const char *write_file(const char *name, const char *text) {
    const char *path = tmp_path(name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
    return path;
}

/* The whole file as a malloc'd string. */
static char *read_all(const char *path) {
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    assert_true(n >= 0);
    assert_int_equal(fseek(f, 0, SEEK_SET), 0);
    char *s = malloc((size_t)n + 1);
    assert_non_null(s);
    assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = '\0';
    assert_int_equal(fclose(f), 0);
    return s;
}

/* Asserts that the last error message contains `needle` (prints the message when not). */
static void assert_msg_has(const char *needle) {
    const char *msg = tera_last_error();
    if (!strstr(msg, needle)) fail_msg("message \"%s\" lacks \"%s\"", msg, needle);
}

/* Loads `text` as a file over defaults; expects `want` and, in the message, "path:line" and every
 * further substring (NULL-terminated). Also checks that a failed load left the config unchanged. */
static void expect_load(const char *text, tera_status want, int line, ...) {
    tera_config c, before;
    tera_config_defaults(&c);
    before = c;
    const char *path = write_file("case.ini", text);
    tera_status s = tera_config_load(&c, path);
    if (s != want)
        fail_msg("status %s (%s), wanted %s", tera_status_name(s), tera_last_error(),
                 tera_status_name(want));
    char where[TERA_PATH_MAX + 32];
    snprintf(where, sizeof where, "%s:%d:", path, line);
    assert_msg_has(where);
    va_list ap;
    va_start(ap, line);
    for (const char *needle; (needle = va_arg(ap, const char *));) assert_msg_has(needle);
    va_end(ap);
    assert_memory_equal(&c, &before, sizeof c);
    assert_int_equal(unlink(path), 0);
}

/* Applies overrides to defaults, then finalize; expects `want` and the substring in the message. */
static void expect_finalize(tera_status want, const char *needle, const char *o1, const char *o2) {
    tera_config c;
    tera_config_defaults(&c);
    if (o1) assert_int_equal(tera_config_set(&c, o1), TERA_OK);
    if (o2) assert_int_equal(tera_config_set(&c, o2), TERA_OK);
    tera_status s = tera_config_finalize(&c);
    if (s != want)
        fail_msg("%s %s: status %s (%s), wanted %s", o1 ? o1 : "", o2 ? o2 : "",
                 tera_status_name(s), tera_last_error(), tera_status_name(want));
    if (needle) assert_msg_has(needle);
}

static void test_defaults(void **state) {
    (void)state;
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(c.model.vocab_size, 256);
    assert_int_equal(c.model.dim, 128);
    assert_int_equal(c.model.n_layers, 4);
    assert_int_equal(c.model.n_heads, 4);
    assert_int_equal(c.model.n_kv_heads, 0);
    assert_int_equal(c.model.n_experts, 8);
    assert_int_equal(c.model.top_k, 2);
    assert_int_equal(c.model.ffn_dim, 256);
    assert_int_equal(c.model.n_shared_experts, 0);
    assert_int_equal(c.model.first_k_dense, 0);
    assert_int_equal(c.model.dense_ffn_dim, 0);
    assert_int_equal(c.model.max_seq_len, 1024);
    assert_int_equal(c.model.sliding_window, 0);
    assert_true(c.model.rope_theta == 10000.0f);
    assert_true(c.model.norm_eps == 1e-5f);
    assert_true(c.model.init_std == 0.02f);
    assert_int_equal(c.model.tie_embeddings, 0);
    assert_true(c.model.capacity_factor == 0.0f);
    assert_int_equal(c.model.drop_policy, TERA_DROP_POSITION);
    assert_true(c.model.aux_coef == 0.01f);
    assert_true(c.model.z_coef == 0.0f);
    assert_int_equal(c.model.aux_free, 0);
    assert_true(c.model.aux_free_rate == 0.001f);
    assert_int_equal(c.training.steps, 300);
    assert_int_equal(c.training.seq_len, 128);
    assert_int_equal(c.training.micro_batch, 8);
    assert_int_equal(c.training.grad_accum, 1);
    assert_true(c.training.seed == 1234);
    assert_int_equal(c.training.threads, 0);
    assert_int_equal(c.training.warmup_steps, 30);
    assert_true(c.training.lr == 3e-3f);
    assert_true(c.training.min_lr == 3e-4f);
    assert_true(c.training.grad_clip == 1.0f);
    assert_int_equal(c.training.eval_every, 0);
    assert_int_equal(c.training.eval_batches, 4);
    assert_string_equal(c.training.init_from, "");
    assert_true(c.optimizer.beta1 == 0.9f);
    assert_true(c.optimizer.beta2 == 0.95f);
    assert_true(c.optimizer.eps == 1e-8f);
    assert_true(c.optimizer.weight_decay == 0.1f);
    assert_string_equal(c.data.path, "");
    assert_string_equal(c.data.format, "auto");
    assert_int_equal(c.data.shuffle, 0);
    assert_true(c.data.val_fraction == 0.0f);
    assert_int_equal(c.parallel.dp, 1);
    assert_int_equal(c.parallel.tp, 1);
    assert_int_equal(c.parallel.pp, 1);
    assert_int_equal(c.parallel.ep, 1);
    assert_int_equal(c.parallel.zero, 0);
    assert_int_equal(c.checkpoint.every, 0);
    assert_int_equal(c.checkpoint.keep, 3);
    assert_true(c.checkpoint.max_shard_bytes == 0);
    assert_string_equal(c.logging.run_dir, "runs/default");
    assert_int_equal(c.logging.log_every, 10);
    assert_int_equal(c.logging.progress, 1);
    assert_int_equal(c.logging.profile, 0);

    /* Finalize fills the derived defaults, and is idempotent. dense_ffn_dim stays 0 (unused)
     * without dense layers, and is top_k * ffn_dim with them. */
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    assert_int_equal(c.model.n_kv_heads, 4);
    assert_int_equal(c.model.dense_ffn_dim, 0);
    tera_config again = c;
    assert_int_equal(tera_config_finalize(&again), TERA_OK);
    assert_memory_equal(&again, &c, sizeof c);
    assert_int_equal(tera_config_set(&c, "model.first_k_dense=1"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    assert_int_equal(c.model.dense_ffn_dim, 2 * 256);
}

static void test_load_file(void **state) {
    (void)state;
    const char *path =
        write_file("good.ini", "# a comment\n"
                               "; another comment\n"
                               "\n"
                               "[model]\n"
                               "dim = 256            ; inline comment\n"
                               "n_heads=8\n"
                               "  n_kv_heads = 2\n"
                               "drop_policy = \"probability\"\n"
                               "tie_embeddings = yes\n"
                               "rope_theta = 1e6\n"
                               "\n"
                               "[training]\n"
                               "seed = 18446744073709551615\n"
                               "lr = 0.001\n"
                               "init_from = \"  /models/with spaces # not a comment  \"\n"
                               "[data]\n"
                               "path = unquoted/path.txt\n"
                               "format = u16\n"
                               "shuffle = ON\n"
                               "[checkpoint]\n"
                               "max_shard_bytes = 5000000000\n"
                               "[logging]\n"
                               "run_dir = \"\"\n"
                               "progress = 0\n"
                               "[model]\n" /* a section may be reopened; keys still unique */
                               "top_k = 4\n");
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(tera_config_load(&c, path), TERA_OK);
    assert_int_equal(c.model.dim, 256);
    assert_int_equal(c.model.n_heads, 8);
    assert_int_equal(c.model.n_kv_heads, 2);
    assert_int_equal(c.model.drop_policy, TERA_DROP_PROBABILITY);
    assert_int_equal(c.model.tie_embeddings, 1);
    assert_true(c.model.rope_theta == 1e6f);
    assert_int_equal(c.model.top_k, 4);
    assert_true(c.training.seed == UINT64_MAX);
    assert_true(c.training.lr == 0.001f);
    assert_string_equal(c.training.init_from, "  /models/with spaces # not a comment  ");
    assert_string_equal(c.data.path, "unquoted/path.txt");
    assert_string_equal(c.data.format, "u16");
    assert_int_equal(c.data.shuffle, 1);
    assert_true(c.checkpoint.max_shard_bytes == INT64_C(5000000000));
    assert_string_equal(c.logging.run_dir, "");
    assert_int_equal(c.logging.progress, 0);
    /* untouched keys keep their defaults */
    assert_int_equal(c.model.vocab_size, 256);
    assert_int_equal(c.training.steps, 300);
    assert_int_equal(unlink(path), 0);

    /* An empty file changes nothing; a UTF-8 BOM before a section is accepted. */
    tera_config d, e;
    tera_config_defaults(&d);
    e = d;
    path = write_file("empty.ini", "");
    assert_int_equal(tera_config_load(&d, path), TERA_OK);
    assert_memory_equal(&d, &e, sizeof d);
    assert_int_equal(unlink(path), 0);
    path = write_file("bom.ini", "\xEF\xBB\xBF[model]\ndim = 64\n");
    assert_int_equal(tera_config_load(&d, path), TERA_OK);
    assert_int_equal(d.model.dim, 64);
    assert_int_equal(unlink(path), 0);

    /* A full-length path fits on one line. */
    char *big = malloc(2 * TERA_PATH_MAX);
    assert_non_null(big);
    strcpy(big, "[data]\npath = \"");
    size_t at = strlen(big);
    memset(big + at, 'p', TERA_PATH_MAX - 1);
    strcpy(big + at + TERA_PATH_MAX - 1, "\"\n");
    path = write_file("long.ini", big);
    assert_int_equal(tera_config_load(&d, path), TERA_OK);
    assert_int_equal(strlen(d.data.path), TERA_PATH_MAX - 1);
    assert_int_equal(unlink(path), 0);
    free(big);
}

static void test_overrides(void **state) {
    (void)state;
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(tera_config_set(&c, "model.dim=512"), TERA_OK);
    assert_int_equal(c.model.dim, 512);
    assert_int_equal(tera_config_set(&c, " training.lr = 1e-3 "), TERA_OK);
    assert_true(c.training.lr == 1e-3f);
    assert_int_equal(tera_config_set(&c, "data.path=\"a b; c\""), TERA_OK);
    assert_string_equal(c.data.path, "a b; c");
    assert_int_equal(tera_config_set(&c, "data.path=x=y"), TERA_OK); /* first '=' splits */
    assert_string_equal(c.data.path, "x=y");
    assert_int_equal(tera_config_set(&c, "logging.progress=off"), TERA_OK);
    assert_int_equal(c.logging.progress, 0);
    assert_int_equal(tera_config_set(&c, "model.drop_policy=probability"), TERA_OK);
    assert_int_equal(c.model.drop_policy, TERA_DROP_PROBABILITY);
    assert_int_equal(tera_config_set(&c, "model.dim=64"), TERA_OK); /* later override wins */
    assert_int_equal(c.model.dim, 64);
    assert_int_equal(tera_config_set(&c, "training.init_from="), TERA_OK);
    assert_string_equal(c.training.init_from, "");

    tera_config before = c;
    assert_int_equal(tera_config_set(&c, "model.dim"), TERA_ERR_CONFIG);
    assert_msg_has("command line");
    assert_msg_has("section.key=value");
    assert_int_equal(tera_config_set(&c, "dim=5"), TERA_ERR_CONFIG);
    assert_msg_has("section.key=value");
    assert_int_equal(tera_config_set(&c, "modle.dim=5"), TERA_ERR_CONFIG);
    assert_msg_has("command line: unknown section [modle]");
    assert_msg_has(
        "valid sections: model, training, optimizer, data, parallel, checkpoint, logging");
    assert_int_equal(tera_config_set(&c, "model.dimm=5"), TERA_ERR_CONFIG);
    assert_msg_has("command line: unknown key model.dimm");
    assert_msg_has("valid keys of [model]: vocab_size, dim, n_layers");
    assert_msg_has("aux_free_rate");
    assert_int_equal(tera_config_set(&c, "model.drop_policy=random"), TERA_ERR_CONFIG);
    assert_string_equal(tera_last_error(),
                        "command line: model.drop_policy = \"random\" is not one of: position, "
                        "probability");
    assert_int_equal(tera_config_set(&c, "model.dim=-3"), TERA_ERR_CONFIG);
    assert_msg_has("model.dim = \"-3\" is out of range; valid range: >= 1");
    /* a layer count the parameter table could not hold is refused at once, not after minutes of
     * building the table (10 million layers took 114 s and 16.8 GB before running out of memory) */
    assert_int_equal(tera_config_set(&c, "model.n_layers=10000000"), TERA_ERR_CONFIG);
    assert_msg_has("model.n_layers = \"10000000\" is out of range; valid range: [1, 65536]");
    assert_int_equal(tera_config_set(&c, "parallel.zero=4"), TERA_ERR_CONFIG);
    assert_msg_has("[0, 3]");
    assert_int_equal(tera_config_set(&c, "data.path=a\nb"), TERA_ERR_CONFIG);
    assert_msg_has("control character");
    assert_int_equal(tera_config_set(&c, "data.path=a ;b"), TERA_ERR_CONFIG); /* unwritable */
    assert_msg_has("comment");
    char *big = malloc(3 * TERA_PATH_MAX);
    assert_non_null(big);
    strcpy(big, "logging.run_dir=");
    memset(big + strlen(big), 'r', 2 * TERA_PATH_MAX);
    big[strlen("logging.run_dir=") + 2 * TERA_PATH_MAX] = '\0';
    assert_int_equal(tera_config_set(&c, big), TERA_ERR_CONFIG);
    assert_msg_has("logging.run_dir");
    assert_msg_has("too long (2048 characters; at most 1023)");
    free(big);
    assert_memory_equal(&c, &before, sizeof c); /* failed overrides change nothing */
    tera_config most;
    tera_config_defaults(&most);
    assert_int_equal(tera_config_set(&most, "model.n_layers=65536"), TERA_OK);
    assert_int_equal(most.model.n_layers, 65536);
}

static void test_load_errors(void **state) {
    (void)state;
    /* unknown section, also an empty one */
    expect_load("[model]\n[modle]\ndim = 4\n", TERA_ERR_CONFIG, 2, "unknown section [modle]",
                "valid sections: model, training, optimizer, data, parallel, checkpoint, logging",
                NULL);
    expect_load("[model]\ndim = 64\n[extra]\n", TERA_ERR_CONFIG, 3, "unknown section [extra]",
                NULL);
    /* key before any section */
    expect_load("# header\ndim = 4\n", TERA_ERR_CONFIG, 2, "dim", "outside any [section]",
                "valid sections", NULL);
    /* unknown key lists the section's keys */
    expect_load("[training]\nsteps = 5\nstep = 4\n", TERA_ERR_CONFIG, 3,
                "unknown key training.step",
                "valid keys of [training]: steps, seq_len, micro_batch", "init_from", NULL);
    /* integers */
    expect_load("[model]\ndim = abc\n", TERA_ERR_CONFIG, 2, "model.dim = \"abc\"", "not an integer",
                "valid range: >= 1", NULL);
    expect_load("[model]\n\ndim = 12x\n", TERA_ERR_CONFIG, 3, "model.dim = \"12x\"",
                "not an integer", NULL);
    expect_load("[model]\ndim = 1.5\n", TERA_ERR_CONFIG, 2, "model.dim", "not an integer", NULL);
    expect_load("[model]\ndim =\n", TERA_ERR_CONFIG, 2, "model.dim = \"\"", "not an integer", NULL);
    expect_load("[model]\ndim = 99999999999\n", TERA_ERR_CONFIG, 2, "model.dim = \"99999999999\"",
                "out of range", NULL);
    expect_load("[checkpoint]\nmax_shard_bytes = 99999999999999999999\n", TERA_ERR_CONFIG, 2,
                "checkpoint.max_shard_bytes", "out of range", NULL);
    expect_load("[training]\nseed = 18446744073709551616\n", TERA_ERR_CONFIG, 2, "training.seed",
                "out of range", NULL);
    expect_load("[training]\nseed = -1\n", TERA_ERR_CONFIG, 2, "training.seed = \"-1\"",
                "not an unsigned integer", NULL);
    expect_load("[parallel]\nzero = 5\n", TERA_ERR_CONFIG, 2, "parallel.zero = \"5\"",
                "valid range: [0, 3]", NULL);
    /* floats */
    expect_load("[training]\nlr = fast\n", TERA_ERR_CONFIG, 2, "training.lr = \"fast\"",
                "not a number", "valid range: > 0", NULL);
    expect_load("[training]\nlr = 1e-3x\n", TERA_ERR_CONFIG, 2, "training.lr", "not a number",
                NULL);
    expect_load("[training]\nlr = nan\n", TERA_ERR_CONFIG, 2, "training.lr = \"nan\"", "finite",
                NULL);
    expect_load("[training]\nlr = inf\n", TERA_ERR_CONFIG, 2, "training.lr", "finite", NULL);
    expect_load("[training]\nlr = 1e40\n", TERA_ERR_CONFIG, 2, "training.lr", "finite", NULL);
    expect_load("[training]\nlr = 0\n", TERA_ERR_CONFIG, 2, "training.lr", "out of range", NULL);
    { /* a NUL byte inside a value: refused naming the line (it used to cut "3\0" "0" to steps = 3) */
        tera_config c, before;
        tera_config_defaults(&c);
        before = c;
        const char *path = tmp_path("nul.ini");
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        static const char text[] = "[training]\nsteps = 3\0" "0\n";
        assert_int_equal(fwrite(text, 1, sizeof text - 1, f), sizeof text - 1);
        assert_int_equal(fclose(f), 0);
        assert_int_equal(tera_config_load(&c, path), TERA_ERR_CONFIG);
        assert_msg_has(":2: a NUL byte in the line");
        assert_memory_equal(&c, &before, sizeof c);
        assert_int_equal(unlink(path), 0);
    }
    expect_load("[optimizer]\nbeta2 = 1\n", TERA_ERR_CONFIG, 2, "optimizer.beta2",
                "valid range: [0, 1)", NULL);
    expect_load("[data]\nval_fraction = 0.6\n", TERA_ERR_CONFIG, 2, "data.val_fraction",
                "valid range: [0, 0.5]", NULL);
    /* bools */
    expect_load("[data]\nshuffle = maybe\n", TERA_ERR_CONFIG, 2, "data.shuffle = \"maybe\"",
                "not a boolean", "true, false, 1, 0, yes, no, on, off", NULL);
    /* enums: the exact message */
    {
        tera_config c;
        tera_config_defaults(&c);
        const char *path = write_file("enum.ini", "[model]\n\n\n\n\n\ndrop_policy = \"random\"\n");
        assert_int_equal(tera_config_load(&c, path), TERA_ERR_CONFIG);
        char want[TERA_PATH_MAX + 128];
        snprintf(want, sizeof want,
                 "%s:7: model.drop_policy = \"random\" is not one of: position, probability", path);
        assert_string_equal(tera_last_error(), want);
        assert_int_equal(unlink(path), 0);
    }
    expect_load("[data]\nformat = csv\n", TERA_ERR_CONFIG, 2, "data.format = \"csv\"",
                "is not one of: auto, text, bin, u16", NULL);
    /* strings */
    {
        char *text = malloc(3 * TERA_PATH_MAX);
        assert_non_null(text);
        strcpy(text, "[logging]\nrun_dir = ");
        size_t at = strlen(text);
        memset(text + at, 'd', 2000);
        strcpy(text + at + 2000, "\n");
        expect_load(text, TERA_ERR_CONFIG, 2, "logging.run_dir",
                    "too long (2000 characters; at most 1023)", NULL);
        free(text);
        /* a line past the parser's buffer is refused, not split */
        text = malloc(6 * TERA_PATH_MAX);
        assert_non_null(text);
        strcpy(text, "[data]\npath = ");
        at = strlen(text);
        memset(text + at, 'x', 5 * TERA_PATH_MAX);
        strcpy(text + at + 5 * TERA_PATH_MAX, "\n");
        expect_load(text, TERA_ERR_CONFIG, 2, "line longer than", NULL);
        free(text);
    }
    expect_load("[data]\npath = \"unterminated\n", TERA_ERR_CONFIG, 2, "data.path",
                "unterminated quote", NULL);
    /* duplicate key names both lines */
    expect_load("[model]\ndim = 64\nn_heads = 4\ndim = 128\n", TERA_ERR_CONFIG, 4, "model.dim",
                "set twice (lines 2 and 4)", NULL);
    expect_load("[model]\ndim = 64\n[training]\nsteps = 4\n[model]\ndim = 64\n", TERA_ERR_CONFIG, 6,
                "model.dim", "set twice (lines 2 and 6)", NULL);
    /* syntax errors inih finds */
    expect_load("[model]\ndim = 64\nthis is not ini\n", TERA_ERR_CONFIG, 3, "syntax error", NULL);
    expect_load("[model\ndim = 64\n", TERA_ERR_CONFIG, 1, "syntax error", NULL);
    /* the first error is the one reported */
    expect_load("[model]\ndim = x\nbroken line\nfoo = 1\n", TERA_ERR_CONFIG, 2, "model.dim", NULL);

    /* missing file: an I/O error naming it */
    tera_config c, before;
    tera_config_defaults(&c);
    before = c;
    const char *missing = tmp_path("does_not_exist.ini");
    assert_int_equal(tera_config_load(&c, missing), TERA_ERR_IO);
    assert_msg_has(missing);
    assert_memory_equal(&c, &before, sizeof c);
    /* a directory is not a config file */
    assert_int_equal(tera_config_load(&c, TERA_BINARY_DIR), TERA_ERR_IO);
    assert_msg_has(TERA_BINARY_DIR);
}

static void test_finalize(void **state) {
    (void)state;
    expect_finalize(TERA_OK, NULL, NULL, NULL);
    expect_finalize(TERA_OK, NULL, "model.n_kv_heads=2", NULL); /* GQA */
    expect_finalize(TERA_OK, NULL, "model.top_k=8", "model.first_k_dense=4");
    expect_finalize(TERA_OK, NULL, "training.warmup_steps=300", "training.min_lr=3e-3");
    expect_finalize(TERA_OK, NULL, "parallel.zero=3", NULL); /* one rank: nothing to shard */
    expect_finalize(TERA_ERR_CONFIG, "model.dim (130) must be divisible by model.n_heads (4)",
                    "model.dim=130", NULL);
    expect_finalize(TERA_ERR_CONFIG, "must be even (RoPE)", "model.dim=12", NULL);
    expect_finalize(TERA_ERR_CONFIG, "model.n_heads (4) must be divisible by model.n_kv_heads (3)",
                    "model.n_kv_heads=3", NULL);
    expect_finalize(TERA_ERR_CONFIG, "model.n_kv_heads", "model.n_kv_heads=8", NULL);
    expect_finalize(TERA_ERR_CONFIG, "model.top_k (9)", "model.top_k=9", NULL);
    expect_finalize(TERA_ERR_CONFIG, "model.n_experts", "model.top_k=3", "model.n_experts=2");
    expect_finalize(TERA_ERR_CONFIG, "model.first_k_dense (5) must be at most model.n_layers (4)",
                    "model.first_k_dense=5", NULL);
    expect_finalize(TERA_ERR_CONFIG, "training.seq_len (2048) must be at most model.max_seq_len",
                    "training.seq_len=2048", NULL);
    expect_finalize(TERA_ERR_CONFIG, "training.min_lr", "training.min_lr=0.01", NULL);
    expect_finalize(TERA_ERR_CONFIG,
                    "training.warmup_steps (30) must be at most training.steps (10)",
                    "training.steps=10", NULL);
    expect_finalize(TERA_OK, NULL, "logging.run_dir=", NULL); /* "" = no run directory */
    expect_finalize(TERA_OK, NULL, "model.top_k=8", "model.ffn_dim=1000000000"); /* no dense layer: unused */
    {
        tera_config c;
        tera_config_defaults(&c);
        assert_int_equal(tera_config_set(&c, "model.first_k_dense=1"), TERA_OK);
        assert_int_equal(tera_config_set(&c, "model.top_k=8"), TERA_OK);
        assert_int_equal(tera_config_set(&c, "model.ffn_dim=1000000000"), TERA_OK);
        assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
        assert_msg_has("model.dense_ffn_dim");
    }
    /* a Hugging Face attention window shorter than the sequences: tera has no sliding-window attention */
    expect_finalize(TERA_ERR_CONFIG, "model.sliding_window = 16", "model.sliding_window=16", "training.seq_len=64");
    expect_finalize(TERA_OK, NULL, "model.sliding_window=64", "training.seq_len=64");
    expect_finalize(TERA_OK, NULL, "parallel.dp=2", NULL); /* data parallelism is supported */
    expect_finalize(TERA_OK, NULL, "parallel.tp=2", NULL);
    expect_finalize(TERA_ERR_CONFIG, "parallel.tp (3) must divide model.vocab_size", "parallel.tp=3", NULL);
    /* sequence parallelism splits a micro-batch's rows over the tensor-parallel ranks */
    expect_finalize(TERA_OK, NULL, "parallel.tp=2", "parallel.sequence_parallel=true");
    {
        tera_config c;
        tera_config_defaults(&c);
        assert_int_equal(tera_config_set(&c, "parallel.tp=2"), TERA_OK);
        assert_int_equal(tera_config_set(&c, "parallel.sequence_parallel=true"), TERA_OK);
        assert_int_equal(tera_config_set(&c, "training.micro_batch=1"), TERA_OK);
        assert_int_equal(tera_config_set(&c, "training.seq_len=33"), TERA_OK);
        assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
        assert_msg_has("parallel.sequence_parallel splits a micro-batch's training.micro_batch x training.seq_len "
                       "(1 x 33) rows over parallel.tp (2) ranks");
        assert_int_equal(tera_config_set(&c, "parallel.sequence_parallel=false"), TERA_OK);
        assert_int_equal(tera_config_finalize(&c), TERA_OK); /* without it, any rows */
    }
    expect_finalize(TERA_OK, NULL, "parallel.pp=2", NULL); /* pipeline parallelism */
    expect_finalize(TERA_ERR_CONFIG,
                    "training.global_batch = 8, but training.micro_batch x training.grad_accum x parallel.dp = "
                    "8 x 1 x 2 = 16 sequences", "training.global_batch=8", "parallel.dp=2");
    expect_finalize(TERA_OK, NULL, "training.global_batch=16", "parallel.dp=2");
    expect_finalize(TERA_ERR_CONFIG, "parallel.pp_chunks = 2 needs parallel.pp_schedule = interleaved",
                    "parallel.pp_chunks=2", NULL);
    expect_finalize(TERA_ERR_CONFIG, "with model.tie_embeddings", "parallel.pp=2", "model.tie_embeddings=true");
    expect_finalize(TERA_ERR_CONFIG, "parallel.pp_layers = \"1,x\": expected positive layer counts",
                    "parallel.pp_layers=1,x", NULL);
    expect_finalize(TERA_ERR_CONFIG, "parallel.ep (8) must divide parallel.dp (1)", "parallel.ep=8", NULL);
    expect_finalize(TERA_ERR_CONFIG, "parallel.ep (3) must divide model.n_experts (8)", "parallel.ep=3",
                    "parallel.dp=6");
    expect_finalize(TERA_ERR_CONFIG, "parallel.ep (2) must divide parallel.dp (3)", "parallel.ep=2",
                    "parallel.dp=3");
    expect_finalize(TERA_OK, NULL, "parallel.ep=4", "parallel.dp=8");

    /* Fields set directly, bypassing the parser, are range-checked too. */
    tera_config c;
    tera_config_defaults(&c);
    c.model.dim = 0;
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("model.dim = \"0\" is out of range");
    tera_config_defaults(&c);
    c.model.vocab_size = 1;
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("model.vocab_size");
    tera_config_defaults(&c);
    c.model.rope_theta = NAN;
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("model.rope_theta");
    assert_msg_has("finite");
    tera_config_defaults(&c);
    c.optimizer.beta1 = 1.0f;
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("optimizer.beta1");
    tera_config_defaults(&c);
    c.model.drop_policy = (tera_drop_policy)7;
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("model.drop_policy = \"7\" is not one of: position, probability");
    tera_config_defaults(&c);
    c.logging.progress = 2;
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("logging.progress");
    tera_config_defaults(&c);
    strcpy(c.data.format, "csv");
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("data.format");
    tera_config_defaults(&c);
    memset(c.data.path, 'x', sizeof c.data.path);
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("data.path");
}

/* Sets many non-default values (edge cases included), writes, loads into fresh defaults. */
static void test_round_trip(void **state) {
    (void)state;
    static const char *const overrides[] = {
        "model.vocab_size=50257",
        "model.dim=96",
        "model.n_heads=6",
        "model.n_kv_heads=3",
        "model.n_experts=16",
        "model.top_k=3",
        "model.ffn_dim=77",
        "model.n_shared_experts=2",
        "model.first_k_dense=1",
        "model.dense_ffn_dim=333",
        "model.max_seq_len=4096",
        "model.sliding_window=300",
        "model.rope_theta=500000",
        "model.norm_eps=1e-6",
        "model.init_std=0.0123456789",
        "model.tie_embeddings=true",
        "model.capacity_factor=1.25",
        "model.drop_policy=probability",
        "model.aux_coef=0.1",
        "model.z_coef=1e-3",
        "model.aux_free=on",
        "model.aux_free_rate=3.3333e-4",
        "training.steps=1000",
        "training.seq_len=256",
        "training.micro_batch=3",
        "training.grad_accum=5",
        "training.seed=18446744073709551615",
        "training.threads=7",
        "training.warmup_steps=0",
        "training.lr=0.1",
        "training.min_lr=1e-30",
        "training.grad_clip=0",
        "training.eval_every=50",
        "training.eval_batches=9",
        "training.init_from=\" /x/y z # q \"",
        "optimizer.beta1=0",
        "optimizer.beta2=0.999999",
        "optimizer.eps=1.17549435e-38",
        "optimizer.weight_decay=3.14159265",
        "data.path=\"quo\"te\"d\"",
        "data.format=bin",
        "data.shuffle=1",
        "data.val_fraction=0.5",
        "parallel.zero=2",
        "checkpoint.every=25",
        "checkpoint.keep=0",
        "checkpoint.max_shard_bytes=9223372036854775807",
        "logging.run_dir=runs/a;b",
        "logging.log_every=1",
        "logging.progress=no",
        "logging.profile=yes",
    };
    tera_config c;
    tera_config_defaults(&c);
    for (size_t i = 0; i < sizeof overrides / sizeof overrides[0]; i++)
        if (tera_config_set(&c, overrides[i]) != TERA_OK)
            fail_msg("%s: %s", overrides[i], tera_last_error());
    assert_string_equal(c.data.path, "quo\"te\"d");
    assert_string_equal(c.training.init_from, " /x/y z # q ");
    assert_int_equal(tera_config_finalize(&c), TERA_OK);

    const char *path = tmp_path("round.ini");
    assert_int_equal(tera_config_write(&c, path), TERA_OK);
    tera_config back;
    tera_config_defaults(&back);
    if (tera_config_load(&back, path) != TERA_OK) fail_msg("%s", tera_last_error());
    assert_memory_equal(&back.model, &c.model, sizeof c.model);
    assert_memory_equal(&back.training, &c.training, sizeof c.training);
    assert_memory_equal(&back.optimizer, &c.optimizer, sizeof c.optimizer);
    assert_memory_equal(&back.data, &c.data, sizeof c.data);
    assert_memory_equal(&back.parallel, &c.parallel, sizeof c.parallel);
    assert_memory_equal(&back.checkpoint, &c.checkpoint, sizeof c.checkpoint);
    assert_memory_equal(&back.logging, &c.logging, sizeof c.logging);
    assert_true(back.model_given != 0 && (back.model_given & c.model_given) == c.model_given); /* set by the file */
    back.model_given = c.model_given; /* not a key: which [model] keys were set, by the file or overrides */
    assert_memory_equal(&back, &c, sizeof c);

    /* The dump: a header comment, sections, every key exactly once, short float text. */
    char *text = read_all(path);
    assert_int_equal(text[0], '#');
    assert_non_null(strstr(text, "\n[model]\n"));
    assert_non_null(strstr(text, "\n[logging]\n"));
    assert_non_null(strstr(text, "\nlr = 0.1\n"));
    assert_non_null(strstr(text, "\ndrop_policy = probability\n"));
    assert_non_null(strstr(text, "\nrun_dir = \"runs/a;b\"\n"));
    for (size_t i = 0; i < N_KEYS; i++) {
        char needle[96];
        snprintf(needle, sizeof needle, "\n%s = ", strchr(all_keys[i], '.') + 1);
        const char *hit = strstr(text, needle);
        if (!hit) fail_msg("dump lacks %s", all_keys[i]);
    }
    free(text);

    /* Defaults round-trip as well (unfinalized: n_kv_heads 0 stays 0). */
    tera_config_defaults(&c);
    assert_int_equal(tera_config_write(&c, path), TERA_OK);
    memset(&back, 0, sizeof back);
    tera_config_defaults(&back);
    assert_int_equal(tera_config_set(&back, "model.dim=8"), TERA_OK);
    assert_int_equal(tera_config_set(&back, "data.path=something/long/to/leave/a/tail"), TERA_OK);
    assert_int_equal(tera_config_load(&back, path), TERA_OK);
    back.model_given = c.model_given; /* not a key (the file set every [model] key) */
    assert_memory_equal(&back, &c, sizeof c);
    assert_int_equal(unlink(path), 0);

    /* Refusals: an unwritable location, an invalid or unrepresentable value. */
    assert_int_equal(tera_config_write(&c, TERA_BINARY_DIR "/no/such/dir/config.ini"), TERA_ERR_IO);
    assert_msg_has("no/such/dir/config.ini");
    c.training.lr = INFINITY;
    assert_int_equal(tera_config_write(&c, path), TERA_ERR_CONFIG);
    assert_msg_has("training.lr");
    tera_config_defaults(&c);
    strcpy(c.data.path, "a ; b");
    assert_int_equal(tera_config_write(&c, path), TERA_ERR_CONFIG);
    assert_msg_has("data.path");
    assert_int_equal(access(path, F_OK), -1); /* nothing was written */
}

/* A Hugging Face directory with config.json = text (under the build directory). */
static const char *hf_dir(const char *text) {
    const char *dir = tmp_path("hf");
    char path[TERA_PATH_MAX + 16];
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
    return dir;
}

/* tera_config_from_hf (training.init_from, eval/export-hf --from): the model comes from config.json;
 * a [model] value given in a file or on the command line that config.json contradicts is refused,
 * naming the key and both values; derived defaults follow config.json's values. */
static void test_from_hf(void **state) {
    (void)state;
    const char *dir = hf_dir("{\"model_type\": \"mixtral\", \"vocab_size\": 300, \"hidden_size\": 64, "
                             "\"intermediate_size\": 32, \"num_hidden_layers\": 2, \"num_attention_heads\": 8, "
                             "\"num_local_experts\": 4, \"num_experts_per_tok\": 2, \"first_k_dense_replace\": 1, "
                             "\"router_aux_loss_coef\": 0.01, \"sliding_window\": null}");
    /* nothing given: derived defaults from config.json's values, not from the defaults' (2 x 256) */
    tera_config c;
    tera_config_defaults(&c);
    assert_int_equal(tera_config_finalize(&c), TERA_OK); /* as tera_cli_parse does before */
    assert_int_equal(tera_config_from_hf(&c, dir), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    assert_int_equal(c.model.dim, 64);
    assert_int_equal(c.model.n_kv_heads, 8);        /* absent: = num_attention_heads */
    assert_int_equal(c.model.dense_ffn_dim, 2 * 32); /* absent: top_k x intermediate_size */
    assert_int_equal(c.model.sliding_window, 0);

    /* a conflicting value is refused with both values; c is unchanged */
    static const char *const bad[][3] = {
        {"model.dim=32", "model.dim = 32", "hidden_size = 64"},
        {"model.aux_coef=0.5", "model.aux_coef = 0.5", "router_aux_loss_coef = 0.01"},
        {"model.n_kv_heads=4", "model.n_kv_heads = 4", "num_key_value_heads = 8"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tera_config_defaults(&c);
        assert_int_equal(tera_config_set(&c, bad[i][0]), TERA_OK);
        assert_int_equal(tera_config_finalize(&c), TERA_OK);
        tera_config before = c;
        assert_int_equal(tera_config_from_hf(&c, dir), TERA_ERR_CONFIG);
        assert_msg_has(bad[i][1]);
        assert_msg_has(bad[i][2]);
        assert_msg_has("config.json");
        assert_memory_equal(&c, &before, sizeof c);
    }
    /* in a file too */
    tera_config_defaults(&c);
    assert_int_equal(tera_config_load(&c, write_file("m.ini", "[model]\ndim = 32\n")), TERA_OK);
    assert_int_equal(tera_config_from_hf(&c, dir), TERA_ERR_CONFIG);
    assert_msg_has("model.dim = 32");

    /* agreeing values pass; a value config.json does not state is kept */
    tera_config_defaults(&c);
    assert_int_equal(tera_config_set(&c, "model.dim=64"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "model.capacity_factor=1.5"), TERA_OK);
    assert_int_equal(tera_config_set(&c, "model.dense_ffn_dim=64"), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    assert_int_equal(tera_config_from_hf(&c, dir), TERA_OK);
    assert_true(c.model.capacity_factor == 1.5f);
    tera_config_defaults(&c);
    assert_int_equal(tera_config_set(&c, "model.dense_ffn_dim=100"), TERA_OK);
    assert_int_equal(tera_config_from_hf(&c, dir), TERA_OK);
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    assert_int_equal(c.model.dense_ffn_dim, 100);

    /* a window shorter than the sequences is refused at finalize, naming the key */
    dir = hf_dir("{\"model_type\": \"mixtral\", \"hidden_size\": 64, \"num_attention_heads\": 8, "
                 "\"sliding_window\": 16}");
    tera_config_defaults(&c);
    assert_int_equal(tera_config_from_hf(&c, dir), TERA_OK);
    assert_int_equal(c.model.sliding_window, 16);
    assert_int_equal(tera_config_finalize(&c), TERA_ERR_CONFIG);
    assert_msg_has("model.sliding_window = 16");
    assert_msg_has("training.seq_len = 128");
    c.training.seq_len = 16;
    assert_int_equal(tera_config_finalize(&c), TERA_OK);
    char path[TERA_PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
    unlink(tmp_path("m.ini"));
}

/* An error wrapped in context (tera_fail(st, "...: %s", tera_last_error()), 35 callers) reads as
 * the context once, then the inner message: the message is formatted aside before it replaces the
 * last one (formatting into the buffer it reads printed "prompt 1: prompt 1: ..."). */
static void test_fail_wraps(void **state) {
    (void)state;
    assert_int_equal(tera_fail(TERA_ERR_IO, "inner %d: %s", 7, "cannot open"), TERA_ERR_IO);
    assert_int_equal(tera_fail(TERA_ERR_ARG, "prompt %d: %s", 2, tera_last_error()), TERA_ERR_ARG);
    assert_string_equal(tera_last_error(), "prompt 2: inner 7: cannot open");
    assert_int_equal(tera_fail(TERA_ERR_ARG, "%s (and more)", tera_last_error()), TERA_ERR_ARG);
    assert_string_equal(tera_last_error(), "prompt 2: inner 7: cannot open (and more)");
}

static void test_doc(void **state) {
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    tera_config_write_doc(f);
    assert_int_equal(fclose(f), 0);
    assert_non_null(buf);
    const char *sections[] = {"model",    "training",   "optimizer", "data",
                              "parallel", "checkpoint", "logging"};
    for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++) {
        char needle[64];
        snprintf(needle, sizeof needle, "## [%s]", sections[i]);
        if (!strstr(buf, needle)) fail_msg("doc lacks %s", needle);
    }
    for (size_t i = 0; i < N_KEYS; i++) {
        char needle[96];
        snprintf(needle, sizeof needle, "| `%s` |", strchr(all_keys[i], '.') + 1);
        if (!strstr(buf, needle)) fail_msg("doc lacks %s", all_keys[i]);
    }
    assert_non_null(strstr(buf, "| key | type | default | range / choices | meaning |"));
    assert_non_null(strstr(buf, "| `drop_policy` | enum | `position` | position, probability |"));
    assert_non_null(strstr(buf, "| `zero` | int | `0` | [0, 3] |"));
    assert_non_null(strstr(buf, "| `beta1` | float | `0.9` | [0, 1) |"));
    free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),  cmocka_unit_test(test_load_file),
        cmocka_unit_test(test_overrides), cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_finalize),  cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_doc),       cmocka_unit_test(test_from_hf),
        cmocka_unit_test(test_fail_wraps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
