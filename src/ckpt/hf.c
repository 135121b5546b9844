/* Hugging Face Mixtral interchange: config.json plus safetensors weights.
 *
 * config.json says model_type "mixtral" (architectures MixtralForCausalLM) only when the model is
 * exactly what transformers' MixtralForCausalLM computes at inference (tera_hf_transformers_gaps
 * lists what it is not), else "tera_moe", a type only tera reads. The reader takes both.
 *
 * One table (g_fields) maps every numeric/boolean config.json field to its tera_model_config member
 * and drives both export and import, so the two cannot drift apart. Weights are written as F32
 * under the names of the parameter table; expert-stacked parameters ([E, out, in] in memory) become
 * E tensors [out, in] that reference slices of the flat buffer (no copy). */
#include "tera/ckpt.h"
#include "tera/hf.h"
#include "tera/io.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tera/safetensors.h"

#define HF_BIAS_FMT "model.layers.%d.block_sparse_moe.gate.e_score_correction_bias"

typedef enum {
    HF_INT,      /* JSON integer */
    HF_FLOAT,    /* JSON number */
    HF_BOOL,     /* JSON true/false */
    HF_INT_NULL, /* JSON integer, or null for the member's 0 ("none") */
} hf_kind;

/* One config.json field stored in a tera_model_config member. */
typedef struct {
    const char *key; /* config.json name */
    hf_kind kind;    /* int (JSON integer), float (JSON number) or bool (JSON true/false) */
    size_t off;      /* offsetof the member (int or float) */
} hf_field;

#define F_(key, kind, member) {key, kind, offsetof(tera_model_config, member)}
static const hf_field g_fields[] = {
    F_("vocab_size", HF_INT, vocab_size),
    F_("hidden_size", HF_INT, dim),
    F_("intermediate_size", HF_INT, ffn_dim),
    F_("num_hidden_layers", HF_INT, n_layers),
    F_("num_attention_heads", HF_INT, n_heads),
    F_("num_key_value_heads", HF_INT, n_kv_heads),
    F_("num_local_experts", HF_INT, n_experts),
    F_("num_experts_per_tok", HF_INT, top_k),
    F_("rope_theta", HF_FLOAT, rope_theta),
    F_("rms_norm_eps", HF_FLOAT, norm_eps),
    F_("router_aux_loss_coef", HF_FLOAT, aux_coef),
    F_("tie_word_embeddings", HF_BOOL, tie_embeddings),
    F_("max_position_embeddings", HF_INT, max_seq_len),
    F_("initializer_range", HF_FLOAT, init_std),
    F_("sliding_window", HF_INT_NULL, sliding_window),
    /* tera extensions (DeepSeek-V3 / Qwen-MoE names where they exist); moe_intermediate_size comes
     * after intermediate_size so that, when both are present, it sets the routed-expert width */
    F_("moe_intermediate_size", HF_INT, ffn_dim),
    F_("n_shared_experts", HF_INT, n_shared_experts),
    F_("first_k_dense_replace", HF_INT, first_k_dense),
    F_("dense_intermediate_size", HF_INT, dense_ffn_dim),
    F_("router_z_loss_coef", HF_FLOAT, z_coef),
    F_("capacity_factor", HF_FLOAT, capacity_factor),
    F_("aux_loss_free", HF_BOOL, aux_free),
    F_("aux_free_bias_update_rate", HF_FLOAT, aux_free_rate),
    /* DeepSeek-V3 routing (its names; scoring_func is a string, below) */
    F_("n_group", HF_INT, n_groups),
    F_("topk_group", HF_INT, topk_groups),
    F_("routed_scaling_factor", HF_FLOAT, routed_scale),
};
#undef F_
#define N_FIELDS ((int)(sizeof g_fields / sizeof g_fields[0]))

static const char *const g_drop_names[] = {[TERA_DROP_POSITION] = "position", [TERA_DROP_PROBABILITY] = "probability"};
static const char *const g_score_names[] = {[TERA_ROUTER_SOFTMAX] = "softmax", [TERA_ROUTER_SIGMOID] = "sigmoid"};

/* ----------------------------------------------------------------------------- utilities -- */

static tera_status join(char *out, size_t cap, const char *dir, const char *name) {
    if ((size_t)snprintf(out, cap, "%s/%s", dir, name) >= cap)
        return tera_fail(TERA_ERR_IO, "%s/%s: path too long", dir, name);
    return TERA_OK;
}

/* Name of expert e from a pattern with one "%d". */
static void expert_name(char *out, size_t cap, const char *pattern, int e) {
    const char *p = strstr(pattern, "%d");
    TERA_ASSERTF(p, "expert-stacked parameter '%s' has no %%d", pattern);
    snprintf(out, cap, "%.*s%d%s", (int)(p - pattern), pattern, e, p + 2);
}

static int is_moe_layer(const tera_model_config *c, int l) { return l >= c->first_k_dense && c->n_experts > 0; }

/* Refuses an existing non-empty directory (unless overwrite) or a non-directory; creates a missing one. */
static tera_status prepare_dir(const char *dir, int overwrite) {
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (errno != ENOENT) return tera_fail(TERA_ERR_IO, "%s: %s", dir, strerror(errno));
        return tera_mkdirs(dir);
    }
    if (!S_ISDIR(st.st_mode)) return tera_fail(TERA_ERR_EXISTS, "%s: exists and is not a directory", dir);
    if (overwrite) return TERA_OK;
    DIR *d = opendir(dir);
    if (!d) return tera_fail(TERA_ERR_IO, "%s: cannot open directory: %s", dir, strerror(errno));
    int empty = 1;
    for (struct dirent *e; empty && (e = readdir(d));)
        empty = strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0;
    closedir(d);
    if (!empty) return tera_fail(TERA_ERR_EXISTS, "%s: directory exists and is not empty (refusing to overwrite)", dir);
    return TERA_OK;
}

/* Writes text to path via path.tmp + fsync + rename; the tmp file is removed on failure. */
static tera_status write_text_atomic(const char *path, const char *text) {
    char tmp[TERA_PATH_MAX + 8];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp)
        return tera_fail(TERA_ERR_IO, "%s: path too long", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    size_t n = strlen(text), done = 0;
    int err = 0;
    while (done < n && !err) {
        ssize_t k = write(fd, text + done, n - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) err = errno ? errno : EIO;
        else done += (size_t)k;
    }
    if (!err && fsync(fd) != 0) err = errno;
    if (close(fd) != 0 && !err) err = errno;
    if (!err && rename(tmp, path) != 0) err = errno;
    if (err) {
        unlink(tmp);
        return tera_fail(TERA_ERR_IO, "%s: write failed: %s", path, strerror(err));
    }
    return TERA_OK;
}

/* ------------------------------------------------------------------------------ config -- */

/* The shortest "%.Ng" that reads back (via strtod, as cJSON does) as exactly v: 1e-5f -> "1e-05";
 * whole numbers as "10000.0", as HF configs spell rope_theta (%.1f prints such a value exactly). */
static void float_repr(char *buf, size_t cap, float v) {
    if (v == floorf(v) && fabsf(v) < 1e15f) {
        snprintf(buf, cap, "%.1f", (double)v);
        return;
    }
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, cap, "%.*g", prec, (double)v);
        if ((float)strtod(buf, NULL) == v) return;
    }
}

/* Adds item under key; 0 on failure (item freed). */
static int put(cJSON *o, const char *key, cJSON *item) {
    if (!item) return 0;
    if (cJSON_AddItemToObject(o, key, item)) return 1;
    cJSON_Delete(item);
    return 0;
}

static tera_status put_field(cJSON *o, const hf_field *f, const tera_model_config *c) {
    const char *base = (const char *)c + f->off;
    int iv;
    float fv;
    char buf[64];
    int ok;
    switch (f->kind) {
    case HF_INT:
    case HF_INT_NULL:
        memcpy(&iv, base, sizeof iv);
        ok = put(o, f->key, f->kind == HF_INT_NULL && iv == 0 ? cJSON_CreateNull() : cJSON_CreateNumber(iv));
        break;
    case HF_BOOL:
        memcpy(&iv, base, sizeof iv);
        ok = put(o, f->key, cJSON_CreateBool(iv != 0));
        break;
    default:
        memcpy(&fv, base, sizeof fv);
        if (!isfinite(fv)) return tera_fail(TERA_ERR_NUMERIC, "config.json: \"%s\" is not finite", f->key);
        float_repr(buf, sizeof buf, fv);
        ok = put(o, f->key, cJSON_CreateRaw(buf));
        break;
    }
    return ok ? TERA_OK : tera_fail(TERA_ERR_NOMEM, "config.json: out of memory");
}

int tera_hf_transformers_gaps(const tera_model_config *c, char *buf, size_t cap) {
    int n = 0;
    if (cap) buf[0] = '\0';
#define GAP(cond, text)                                                                            \
    if (cond) {                                                                                    \
        if (cap) snprintf(buf + strlen(buf), cap - strlen(buf), "%s%s", n ? "; " : "", text);     \
        n++;                                                                                       \
    }
    /* Mixtral: every layer is a sparse MoE block; no dense FFN layers */
    GAP(c->first_k_dense > 0, "dense first layers (model.first_k_dense > 0)");
    /* Mixtral: the routed experts only; a shared expert adds an always-on FFN */
    GAP(c->n_shared_experts > 0, "shared experts (model.n_shared_experts > 0)");
    /* Mixtral: top-k of the router's softmax; the aux-free bias shifts which experts are chosen */
    GAP(c->aux_free, "the aux-loss-free router bias (model.aux_free = true)");
    /* Mixtral is dropless. A capacity of ceil(cf*T*k/E) >= T (cf*k >= E) can never drop a token (an
     * expert gets at most T of a sequence's tokens): that is dropless too */
    GAP(c->capacity_factor > 0 && (double)c->capacity_factor * c->top_k < (double)c->n_experts,
        "a capacity factor that drops tokens (model.capacity_factor > 0 and below n_experts / top_k)");
    /* Mixtral: softmax scores, top-k over every expert, combine weights summing to 1 */
    GAP(c->router_score != TERA_ROUTER_SOFTMAX, "sigmoid router scores (model.router_score = sigmoid)");
    GAP(c->n_groups > 1 && c->topk_groups < c->n_groups, "group-limited routing (model.topk_groups < model.n_groups)");
    GAP(c->routed_scale > 0.0f && c->routed_scale != 1.0f, "a routed scaling factor (model.routed_scale != 1)");
#undef GAP
    /* Not gaps (no effect at inference, or the same in both): aux_coef, z_coef, aux_free_rate,
     * init_std, drop_policy when nothing is dropped, tie_embeddings (MixtralForCausalLM ties too), GQA,
     * sliding_window (tera refuses sequences longer than the window, where the two would differ).
     * model.router_force_balance is a benchmarking switch of the run, not part of the model: config.json
     * does not record it, and an exported or imported model routes by its scores. */
    return n;
}

const char *tera_hf_config_key(size_t member_offset) {
    for (int i = 0; i < N_FIELDS; i++)
        if (g_fields[i].off == member_offset) return g_fields[i].key;
    if (member_offset == offsetof(tera_model_config, drop_policy)) return "drop_policy";
    if (member_offset == offsetof(tera_model_config, router_score)) return "scoring_func";
    return NULL;
}

/* config.json text for cfg. Caller frees with cJSON_free. */
static tera_status config_json(const tera_model_config *c, char **out) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return tera_fail(TERA_ERR_NOMEM, "config.json: out of memory");
    const int mixtral = tera_hf_transformers_gaps(c, NULL, 0) == 0;
    cJSON *arch = cJSON_CreateArray();
    int ok = put(o, "architectures", arch);
    ok = ok && cJSON_AddItemToArray(arch, cJSON_CreateString(mixtral ? "MixtralForCausalLM" : "TeraMoeForCausalLM"));
    ok = ok && put(o, "model_type", cJSON_CreateString(mixtral ? "mixtral" : "tera_moe"));
    ok = ok && put(o, "hidden_act", cJSON_CreateString("silu"));
    ok = ok && put(o, "torch_dtype", cJSON_CreateString("float32"));
    tera_status s = ok ? TERA_OK : tera_fail(TERA_ERR_NOMEM, "config.json: out of memory");
    for (int i = 0; i < N_FIELDS && s == TERA_OK; i++) s = put_field(o, &g_fields[i], c);
    if (s == TERA_OK) {
        int dp = (int)c->drop_policy;
        if (dp < 0 || dp > TERA_DROP_PROBABILITY) s = tera_fail(TERA_ERR_CONFIG, "config.json: bad drop_policy %d", dp);
        else if (!put(o, "drop_policy", cJSON_CreateString(g_drop_names[dp])))
            s = tera_fail(TERA_ERR_NOMEM, "config.json: out of memory");
    }
    if (s == TERA_OK) {
        int rs = (int)c->router_score;
        if (rs < 0 || rs > TERA_ROUTER_SIGMOID) s = tera_fail(TERA_ERR_CONFIG, "config.json: bad router_score %d", rs);
        else if (!put(o, "scoring_func", cJSON_CreateString(g_score_names[rs])))
            s = tera_fail(TERA_ERR_NOMEM, "config.json: out of memory");
    }
    if (s == TERA_OK && !(*out = cJSON_Print(o))) s = tera_fail(TERA_ERR_NOMEM, "config.json: out of memory");
    cJSON_Delete(o);
    return s;
}

/* Reads one table field from j into cfg. */
static tera_status get_field(const char *path, const hf_field *f, const cJSON *j, tera_model_config *c) {
    char *base = (char *)c + f->off;
    if (f->kind == HF_BOOL) {
        if (!cJSON_IsBool(j)) return tera_fail(TERA_ERR_FORMAT, "%s: \"%s\" must be true or false", path, f->key);
        int v = cJSON_IsTrue(j);
        memcpy(base, &v, sizeof v);
        return TERA_OK;
    }
    if (f->kind == HF_INT_NULL && cJSON_IsNull(j)) {
        const int zero = 0;
        memcpy(base, &zero, sizeof zero);
        return TERA_OK;
    }
    if (!cJSON_IsNumber(j) || !isfinite(j->valuedouble))
        return tera_fail(TERA_ERR_FORMAT, "%s: \"%s\" must be a number", path, f->key);
    double d = j->valuedouble;
    if (f->kind == HF_FLOAT) {
        float v = (float)d;
        memcpy(base, &v, sizeof v);
        return TERA_OK;
    }
    if (floor(d) != d || d < INT_MIN || d > INT_MAX)
        return tera_fail(TERA_ERR_FORMAT, "%s: \"%s\" must be an integer (got %g)", path, f->key, d);
    if (f->kind == HF_INT_NULL && d < 0)
        return tera_fail(TERA_ERR_FORMAT, "%s: \"%s\" must be null or an integer >= 0 (got %g)", path, f->key, d);
    int v = (int)d;
    memcpy(base, &v, sizeof v);
    return TERA_OK;
}

/* A string field that, when present (and not null), must equal one of choices; *idx receives its index. */
static tera_status get_choice(const char *path, const cJSON *root, const char *key, const char *const *choices,
                              int n, int *idx) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, key);
    *idx = -1;
    if (!j || cJSON_IsNull(j)) return TERA_OK;
    if (cJSON_IsString(j))
        for (int i = 0; i < n; i++)
            if (strcmp(j->valuestring, choices[i]) == 0) {
                *idx = i;
                return TERA_OK;
            }
    char list[256] = "";
    for (int i = 0; i < n; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s\"%s\"", i ? ", " : "", choices[i]);
    return tera_fail(TERA_ERR_FORMAT, "%s: \"%s\" must be %s%s", path, key, n > 1 ? "one of " : "", list);
}

static tera_status apply_config(const char *path, const cJSON *root, tera_model_config *c) {
    if (!cJSON_IsObject(root)) return tera_fail(TERA_ERR_FORMAT, "%s: not a JSON object", path);
    static const char *const types[] = {"mixtral", "tera_moe"}, *const silu[] = {"silu"};
    int idx;
    TERA_TRY(get_choice(path, root, "model_type", types, 2, &idx));
    TERA_TRY(get_choice(path, root, "hidden_act", silu, 1, &idx));
    TERA_TRY(get_choice(path, root, "drop_policy", g_drop_names, 2, &idx));
    if (idx >= 0) c->drop_policy = (tera_drop_policy)idx;
    TERA_TRY(get_choice(path, root, "scoring_func", g_score_names, 2, &idx));
    if (idx >= 0) c->router_score = (tera_router_score)idx;
    int have_kv = 0;
    for (int i = 0; i < N_FIELDS; i++) {
        const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, g_fields[i].key);
        if (!j || (cJSON_IsNull(j) && g_fields[i].kind != HF_INT_NULL)) continue;
        TERA_TRY(get_field(path, &g_fields[i], j, c));
        if (g_fields[i].off == offsetof(tera_model_config, n_kv_heads)) have_kv = 1;
    }
    if (!have_kv) c->n_kv_heads = c->n_heads; /* HF: absent means multi-head attention */
    return TERA_OK;
}

tera_status tera_hf_read_config(const char *dir, tera_model_config *cfg) {
    char path[TERA_PATH_MAX + 64];
    TERA_TRY(join(path, sizeof path, dir, "config.json"));
    /* a tera checkpoint without config.json of its own (a differential one: its base holds the
     * weights' files) carries the same object as manifest.json's "model_config" */
    char man[TERA_PATH_MAX + 32];
    TERA_TRY(join(man, sizeof man, dir, "manifest.json"));
    const int from_manifest = access(path, F_OK) != 0 && access(man, F_OK) == 0;
    char *text;
    TERA_TRY(tera_read_text_file(from_manifest ? man : path, &text));
    cJSON *doc = cJSON_Parse(text);
    free(text);
    if (!doc) return tera_fail(TERA_ERR_FORMAT, "%s: not valid JSON", from_manifest ? man : path);
    cJSON *root = doc;
    if (from_manifest) {
        root = cJSON_GetObjectItemCaseSensitive(doc, "model_config");
        snprintf(path, sizeof path, "%s (model_config)", man);
        if (!cJSON_IsObject(root)) {
            cJSON_Delete(doc);
            return tera_fail(TERA_ERR_FORMAT, "%s/config.json is missing and %s: no \"model_config\" object", dir, man);
        }
    }
    tera_model_config c = *cfg; /* all or nothing: cfg changes only on success */
    tera_status s = apply_config(path, root, &c);
    cJSON_Delete(doc);
    if (s == TERA_OK) *cfg = c;
    return s;
}

/* ------------------------------------------------------------------------------ export -- */

static void add_weights(tera_st_writer *w, const tera_model *m) {
    char name[160];
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        const float *data = m->w + p->offset;
        if (!p->expert_stacked) {
            tera_st_writer_add(w, p->name, TERA_DT_F32, p->ndim, p->shape, data);
            continue;
        }
        const int64_t per = p->shape[1] * p->shape[2];
        for (int e = 0; e < (int)p->shape[0]; e++) {
            expert_name(name, sizeof name, p->name, e);
            tera_st_writer_add(w, name, TERA_DT_F32, 2, &p->shape[1], data + (int64_t)e * per);
        }
    }
    if (!m->cfg.aux_free || !m->router_bias) return;
    const int64_t E = m->cfg.n_experts;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if (!is_moe_layer(&m->cfg, l)) continue;
        snprintf(name, sizeof name, HF_BIAS_FMT, l);
        tera_st_writer_add(w, name, TERA_DT_F32, 1, &E, m->router_bias + (int64_t)l * E);
    }
}

tera_status tera_hf_write_config(const tera_model_config *cfg, const char *path) {
    char *cfg_text = NULL;
    TERA_TRY(config_json(cfg, &cfg_text));
    tera_status s = write_text_atomic(path, cfg_text);
    cJSON_free(cfg_text);
    return s;
}

tera_status tera_hf_export(const tera_model *m, const char *dir, int64_t max_shard_bytes, int overwrite) {
    char *cfg_text = NULL, path[TERA_PATH_MAX + 16];
    TERA_TRY(join(path, sizeof path, dir, "config.json"));
    TERA_TRY(config_json(&m->cfg, &cfg_text)); /* before touching the disk: refuse a bad config early */
    tera_status s = prepare_dir(dir, overwrite);
    if (s == TERA_OK) {
        tera_st_writer w;
        tera_st_writer_init(&w);
        tera_st_writer_meta(&w, "format", "pt");
        add_weights(&w, m);
        s = tera_st_writer_save_dir(&w, dir, max_shard_bytes);
        tera_st_writer_free(&w);
    }
    if (s == TERA_OK) s = write_text_atomic(path, cfg_text);
    cJSON_free(cfg_text);
    return s;
}

/* An export labelled for transformers only when a transformers class computes the model (or
 * --tera-moe asks for model_type "tera_moe"). */
static tera_status export_allowed(const tera_model_config *c, const char *dir, int allow_tera_moe) {
    /* never into tera's own directories, --force or not: a checkpoint there (its config.json and
     * model files replaced or joined by shards) or a run's checkpoints/ would read the export as its own */
    char owner[PATH_MAX];
    switch (tera_ckpt_dir_owner(dir, owner, sizeof owner)) {
    case TERA_OWNER_CHECKPOINT:
        return tera_fail(TERA_ERR_ARG, "--out '%s' is or lies inside the tera checkpoint %s; an export goes to a "
                         "directory of its own (--force replaces only a previous export)", dir, owner);
    case TERA_OWNER_CHECKPOINTS:
        return tera_fail(TERA_ERR_ARG, "--out '%s' lies inside the run's checkpoint directory %s, which holds "
                         "checkpoints only; choose a directory outside it", dir, owner);
    case TERA_OWNER_RUN:
        return tera_fail(TERA_ERR_ARG, "--out '%s' is a tera run directory (checkpoints/ and its configuration); "
                         "an export goes to a directory of its own (--force replaces only a previous export)", dir);
    default:
        break;
    }
    char gaps[512];
    if (!allow_tera_moe && tera_hf_transformers_gaps(c, gaps, sizeof gaps) > 0)
        return tera_fail(TERA_ERR_CONFIG,
                         "%s: not exported: the model has %s, which transformers' MixtralForCausalLM does not "
                         "compute (and no transformers class does); a config.json saying \"mixtral\" would load "
                         "as another model. Pass --tera-moe to write it as model_type \"tera_moe\" (read by tera "
                         "only), or use the checkpoint directory itself with tera",
                         dir, gaps);
    return TERA_OK;
}

tera_status tera_hf_export_checked(const tera_model *m, const char *dir, int64_t max_shard_bytes, int overwrite,
                                   int allow_tera_moe) {
    TERA_TRY(export_allowed(&m->cfg, dir, allow_tera_moe));
    return tera_hf_export(m, dir, max_shard_bytes, overwrite);
}

/* ------------------------------------------------------------------------------ streamed export -- */

/* tera_hf_export's file, its tensors' data read piecewise from src (never the whole model in memory). */
static tera_status export_streamed(const tera_model *m, const char *dir, int64_t max_shard_bytes,
                                   tera_hf_source src, void *ctx) {
    static const char dummy = 0; /* the stream never reads entry data */
    tera_st_writer w;
    tera_st_writer_init(&w);
    tera_st_writer_meta(&w, "format", "pt");
    char name[160];
    int *first = tera_calloc((size_t)m->n_params + 1, sizeof(int));
    for (int i = 0; i < m->n_params; i++) { /* the names and order of add_weights */
        const tera_param *p = &m->params[i];
        first[i] = w.n;
        if (!p->expert_stacked) {
            tera_st_writer_add(&w, p->name, TERA_DT_F32, p->ndim, p->shape, &dummy);
            continue;
        }
        for (int e = 0; e < (int)p->shape[0]; e++) {
            expert_name(name, sizeof name, p->name, e);
            tera_st_writer_add(&w, name, TERA_DT_F32, 2, &p->shape[1], &dummy);
        }
    }
    const int bias0 = w.n;
    const int64_t E = m->cfg.n_experts;
    const int bias = m->cfg.aux_free && m->router_bias;
    for (int l = 0; bias && l < m->cfg.n_layers; l++) {
        if (!is_moe_layer(&m->cfg, l)) continue;
        snprintf(name, sizeof name, HF_BIAS_FMT, l);
        tera_st_writer_add(&w, name, TERA_DT_F32, 1, &E, &dummy);
    }
    tera_st_stream *s = NULL;
    tera_status st = tera_st_stream_open(&s, &w, dir, 1, max_shard_bytes);
    enum { CH = 1 << 18 }; /* 1 MiB of floats at a time */
    float *buf = st == TERA_OK ? tera_malloc(sizeof(float) * CH) : NULL;
    for (int i = 0; i < m->n_params && st == TERA_OK; i++) {
        const tera_param *p = &m->params[i];
        const int64_t per = p->expert_stacked ? p->shape[1] * p->shape[2] : p->numel;
        for (int64_t a = 0; a < p->numel && st == TERA_OK; a += CH) {
            const int64_t b = a + CH < p->numel ? a + CH : p->numel;
            st = src(ctx, i, a, b - a, buf);
            for (int64_t x = a; x < b && st == TERA_OK;) { /* an expert's slice is its own tensor */
                const int64_t e = x / per, y = (e + 1) * per < b ? (e + 1) * per : b;
                st = tera_st_stream_write(s, first[i] + (int)e, sizeof(float) * (uint64_t)(x - e * per), buf + (x - a),
                                          sizeof(float) * (uint64_t)(y - x));
                x = y;
            }
        }
    }
    for (int l = 0, e = bias0; bias && l < m->cfg.n_layers && st == TERA_OK; l++) {
        if (!is_moe_layer(&m->cfg, l)) continue;
        st = tera_st_stream_write(s, e++, 0, m->router_bias + (int64_t)l * E, sizeof(float) * (size_t)E);
    }
    if (s && st == TERA_OK) st = tera_st_stream_finish(s);
    else tera_st_stream_abort(s);
    free(buf);
    free(first);
    tera_st_writer_free(&w);
    return st;
}

tera_status tera_hf_export_source(const tera_model *m, const char *dir, int64_t max_shard_bytes, int overwrite,
                                  int allow_tera_moe, tera_hf_source src, void *ctx) {
    TERA_TRY(export_allowed(&m->cfg, dir, allow_tera_moe));
    char *cfg_text = NULL, path[TERA_PATH_MAX + 16];
    TERA_TRY(join(path, sizeof path, dir, "config.json"));
    TERA_TRY(config_json(&m->cfg, &cfg_text));
    tera_status s = prepare_dir(dir, overwrite);
    if (s == TERA_OK) s = export_streamed(m, dir, max_shard_bytes, src, ctx);
    if (s == TERA_OK) s = write_text_atomic(path, cfg_text);
    cJSON_free(cfg_text);
    return s;
}

/* ------------------------------------------------------------------------------ import -- */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Every tensor name the model accepts (parameters, expanded experts, router biases), sorted.
 * Caller frees each and the array. */
static char **expected_names(const tera_model *m, int *n_out) {
    int cap = m->cfg.n_layers + 1, n = 0;
    for (int i = 0; i < m->n_params; i++) cap += m->params[i].expert_stacked ? (int)m->params[i].shape[0] : 1;
    char **v = tera_malloc(sizeof(char *) * (size_t)cap);
    char name[160];
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        for (int e = 0; e < (p->expert_stacked ? (int)p->shape[0] : 1); e++) {
            if (p->expert_stacked) expert_name(name, sizeof name, p->name, e);
            else snprintf(name, sizeof name, "%s", p->name);
            v[n++] = strdup(name);
        }
    }
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if (!is_moe_layer(&m->cfg, l)) continue;
        snprintf(name, sizeof name, HF_BIAS_FMT, l);
        v[n++] = strdup(name);
    }
    for (int i = 0; i < n; i++) TERA_ASSERT(v[i] != NULL);
    qsort(v, (size_t)n, sizeof *v, cmp_str);
    *n_out = n;
    return v;
}

/* Every "model." / "lm_head." tensor in the files must be one the model has. */
static tera_status check_no_extra(const tera_model *m, const tera_st_set *set, const char *dir) {
    int n = 0;
    char **names = expected_names(m, &n);
    tera_status s = TERA_OK;
    for (int fi = 0; fi < set->n_files && s == TERA_OK; fi++) {
        const tera_st_file *f = &set->files[fi];
        for (int i = 0; i < f->n && s == TERA_OK; i++) {
            const char *t = f->tensors[i].name;
            if (strncmp(t, "model.", 6) != 0 && strncmp(t, "lm_head.", 8) != 0) continue;
            if (m->cfg.tie_embeddings && strcmp(t, "lm_head.weight") == 0) continue; /* checked in load_tied */
            if (!bsearch(&t, names, (size_t)n, sizeof *names, cmp_str))
                s = tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s' in %s is not a parameter of this model "
                              "(does config.json match the weights?)", dir, t, f->path);
        }
    }
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    return s;
}

/* Reads one tensor of exactly (ndim, shape) into dst; a missing tensor names dir and tensor. */
static tera_status load_one(const tera_st_set *set, const char *dir, const char *name, int ndim,
                            const int64_t *shape, float *dst) {
    if (!tera_st_set_find(set, name)) return tera_fail(TERA_ERR_FORMAT, "%s: missing tensor '%s'", dir, name);
    return tera_st_set_read_f32(set, name, ndim, shape, dst);
}

static tera_status load_params(tera_model *m, const tera_st_set *set, const char *dir) {
    char name[160];
    for (int i = 0; i < m->n_params; i++) {
        const tera_param *p = &m->params[i];
        float *dst = m->w + p->offset;
        if (!p->expert_stacked) {
            TERA_TRY(load_one(set, dir, p->name, p->ndim, p->shape, dst));
            continue;
        }
        const int64_t per = p->shape[1] * p->shape[2];
        for (int e = 0; e < (int)p->shape[0]; e++) {
            expert_name(name, sizeof name, p->name, e);
            TERA_TRY(load_one(set, dir, name, 2, &p->shape[1], dst + (int64_t)e * per));
        }
    }
    return TERA_OK;
}

/* Router biases: present -> loaded, absent -> zero. Skipped when the model keeps no bias state. */
static tera_status load_bias(tera_model *m, const tera_st_set *set, const char *dir) {
    if (!m->router_bias) return TERA_OK;
    const int64_t E = m->cfg.n_experts;
    memset(m->router_bias, 0, sizeof(float) * (size_t)(m->cfg.n_layers * E));
    char name[160];
    for (int l = 0; l < m->cfg.n_layers; l++) {
        snprintf(name, sizeof name, HF_BIAS_FMT, l);
        if (is_moe_layer(&m->cfg, l) && tera_st_set_find(set, name))
            TERA_TRY(load_one(set, dir, name, 1, &E, m->router_bias + (int64_t)l * E));
    }
    return TERA_OK;
}

/* Tied embeddings: an lm_head.weight in the files is accepted only if it equals embed_tokens. */
static tera_status load_tied(const tera_model *m, const tera_st_set *set, const char *dir) {
    if (!m->cfg.tie_embeddings || !tera_st_set_find(set, "lm_head.weight")) return TERA_OK;
    const tera_param *emb = tera_model_param(m, "model.embed_tokens.weight");
    TERA_ASSERT(emb != NULL);
    float *tmp = tera_malloc(sizeof(float) * (size_t)emb->numel);
    tera_status s = tera_st_set_read_f32(set, "lm_head.weight", 2, emb->shape, tmp);
    if (s == TERA_OK && memcmp(tmp, m->w + emb->offset, sizeof(float) * (size_t)emb->numel) != 0)
        s = tera_fail(TERA_ERR_FORMAT, "%s: tie_word_embeddings is set but tensor 'lm_head.weight' differs from "
                      "'model.embed_tokens.weight'", dir);
    free(tmp);
    return s;
}

/* The checks of tera_hf_import that need no whole-model buffer: no tensor the model lacks, and a
 * tied lm_head.weight equal to embed_tokens, compared in windows read from the files (pread). */
tera_status tera_hf_check_set(const tera_model *m, const tera_st_set *set, const char *dir) {
    TERA_TRY(check_no_extra(m, set, dir));
    if (!m->cfg.tie_embeddings || !tera_st_set_find(set, "lm_head.weight")) return TERA_OK;
    const tera_param *emb = tera_model_param(m, "model.embed_tokens.weight");
    TERA_ASSERT(emb != NULL);
    const tera_st_file *fh = tera_st_set_find(set, "lm_head.weight"), *fe = tera_st_set_find(set, emb->name);
    if (!fe) return tera_fail(TERA_ERR_FORMAT, "%s: missing tensor '%s'", dir, emb->name);
    const tera_st_tensor *th = tera_st_find(fh, "lm_head.weight");
    if (th->ndim != 2 || th->shape[0] != emb->shape[0] || th->shape[1] != emb->shape[1])
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor 'lm_head.weight' has another shape than '%s'", dir, emb->name);
    const int fdh = open(fh->path, O_RDONLY | O_CLOEXEC), fde = open(fe->path, O_RDONLY | O_CLOEXEC);
    enum { WIN = 1 << 16 };
    float *a = tera_malloc(sizeof(float) * 2 * WIN), *b = a + WIN;
    tera_status s = fdh < 0 || fde < 0 ? tera_fail(TERA_ERR_IO, "%s: cannot open its safetensors files: %s", dir,
                                                   strerror(errno))
                                       : TERA_OK;
    for (int64_t at = 0; at < emb->numel && s == TERA_OK; at += WIN) {
        const int64_t n = emb->numel - at < WIN ? emb->numel - at : WIN;
        s = tera_st_read_range_f32(fh, fdh, "lm_head.weight", at, n, a);
        if (s == TERA_OK) s = tera_st_read_range_f32(fe, fde, emb->name, at, n, b);
        if (s == TERA_OK && memcmp(a, b, sizeof(float) * (size_t)n) != 0)
            s = tera_fail(TERA_ERR_FORMAT, "%s: tie_word_embeddings is set but tensor 'lm_head.weight' differs from "
                          "'model.embed_tokens.weight'", dir);
    }
    free(a);
    if (fdh >= 0) close(fdh);
    if (fde >= 0) close(fde);
    return s;
}

tera_status tera_hf_import(tera_model *m, const char *dir) {
    tera_st_set set;
    TERA_TRY(tera_st_set_open(&set, dir));
    tera_status s = check_no_extra(m, &set, dir);
    if (s == TERA_OK) s = load_params(m, &set, dir);
    if (s == TERA_OK) s = load_bias(m, &set, dir);
    if (s == TERA_OK) s = load_tied(m, &set, dir);
    tera_st_set_close(&set);
    return s;
}
