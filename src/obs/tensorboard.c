/* TensorBoard event files (include/tera/tensorboard.h).
 *
 * Event (tensorflow/core/util/event.proto): wall_time = 1 (double), step = 2 (int64), file_version
 * = 3 (string, the first record: "brain.Event:2"), summary = 5. Summary: repeated Value value = 1.
 * Value: tag = 1 (string), simple_value = 2 (float), histo = 5 (HistogramProto: min 1, max 2,
 * num 3, sum 4, sum_squares 5 (doubles), bucket_limit 6 and bucket 7 (packed doubles)).
 * One record per step holds every scalar Value; one record per MoE layer holds its histogram. */
#include "tera/tensorboard.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tera/hw.h"
#include "tera/io.h"
#include "tera/profile.h"
#include "tera/zero.h"

struct tera_tensorboard {
    FILE *f;
    char path[TERA_PATH_MAX + 128];
    char *iobuf;              /* stdio's buffer, ours: no allocation at the first write */
    unsigned char *rec;       /* one Event being encoded */
    size_t cap, len;
    int overflow;             /* a record did not fit (cannot happen with the start-up sizing) */
    int err;                  /* errno of the first failed write (0: none) */
    int n_moe, first_moe, n_experts;
    int64_t steps_since_flush;
};

/* ------------------------------------------------------------------ CRC32C (Castagnoli, reflected 0x82F63B78) */

static uint32_t crc_table[256];
static int crc_ready;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
    crc_ready = 1;
}

uint32_t tera_crc32c(const void *data, size_t n) {
    if (!crc_ready) crc_init();
    const unsigned char *p = data;
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

uint32_t tera_crc32c_masked(const void *data, size_t n) {
    const uint32_t c = tera_crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

/* ------------------------------------------------------------------ protobuf encoding */

typedef struct {
    unsigned char *b;
    size_t cap, len;
    int overflow;
} pb;

static void pb_byte(pb *p, unsigned char c) {
    if (p->len < p->cap) p->b[p->len] = c;
    else p->overflow = 1;
    p->len++;
}
static void pb_varint(pb *p, uint64_t v) {
    while (v >= 0x80) {
        pb_byte(p, (unsigned char)(v | 0x80));
        v >>= 7;
    }
    pb_byte(p, (unsigned char)v);
}
static void pb_key(pb *p, int field, int wire) { pb_varint(p, (uint64_t)field << 3 | (uint64_t)wire); }
static void pb_fixed64(pb *p, uint64_t v) {
    for (int i = 0; i < 8; i++) pb_byte(p, (unsigned char)(v >> (8 * i)));
}
static void pb_double(pb *p, int field, double v) {
    uint64_t u;
    memcpy(&u, &v, 8);
    pb_key(p, field, 1);
    pb_fixed64(p, u);
}
static void pb_float(pb *p, int field, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    pb_key(p, field, 5);
    for (int i = 0; i < 4; i++) pb_byte(p, (unsigned char)(u >> (8 * i)));
}
static void pb_bytes(pb *p, int field, const void *s, size_t n) {
    pb_key(p, field, 2);
    pb_varint(p, n);
    for (size_t i = 0; i < n; i++) pb_byte(p, ((const unsigned char *)s)[i]);
}
/* A length-delimited field whose contents are encoded afterwards: reserve the largest length
 * prefix needed for `room` bytes, then close_len shifts nothing (the prefix is written padded:
 * a varint may carry redundant continuation bytes, which protobuf parsers accept). */
static size_t open_len(pb *p, int field) {
    pb_key(p, field, 2);
    const size_t at = p->len;
    for (int i = 0; i < 4; i++) pb_byte(p, 0x80); /* 4 bytes: lengths below 2^28 */
    return at;
}
static void close_len(pb *p, size_t at) {
    const size_t n = p->len - at - 4;
    if (n >= (1u << 28)) { p->overflow = 1; return; }
    if (p->len > p->cap) return; /* overflowed already */
    for (int i = 0; i < 4; i++) p->b[at + i] = (unsigned char)(((n >> (7 * i)) & 0x7F) | (i < 3 ? 0x80 : 0));
}

/* ------------------------------------------------------------------ records */

static double unix_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The TFRecord of the encoded event in tb->rec[12 .. 12 + len): header before it, CRC after. */
static void emit(tera_tensorboard *tb, pb *p) {
    if (p->overflow) {
        tb->overflow = 1;
        return;
    }
    if (!tb->f || tb->err) return;
    const uint64_t n = p->len;
    unsigned char hdr[12];
    for (int i = 0; i < 8; i++) hdr[i] = (unsigned char)(n >> (8 * i));
    const uint32_t hc = tera_crc32c_masked(hdr, 8);
    for (int i = 0; i < 4; i++) hdr[8 + i] = (unsigned char)(hc >> (8 * i));
    const uint32_t dc = tera_crc32c_masked(p->b, p->len);
    unsigned char tail[4];
    for (int i = 0; i < 4; i++) tail[i] = (unsigned char)(dc >> (8 * i));
    if (fwrite(hdr, 1, 12, tb->f) != 12 || fwrite(p->b, 1, p->len, tb->f) != p->len || fwrite(tail, 1, 4, tb->f) != 4)
        tb->err = errno ? errno : EIO;
}

static pb begin_event(tera_tensorboard *tb, int64_t step) {
    pb p = {tb->rec, tb->cap, 0, 0};
    pb_double(&p, 1, unix_now());
    pb_key(&p, 2, 0);
    pb_varint(&p, (uint64_t)step);
    return p;
}

static void scalar(pb *p, const char *tag, double v) {
    const size_t at = open_len(p, 1); /* Summary.value */
    pb_bytes(p, 1, tag, strlen(tag));
    pb_float(p, 2, (float)v);
    close_len(p, at);
}

tera_status tera_tensorboard_open(tera_tensorboard **out, const char *dir, const tera_trainer *tr) {
    *out = NULL;
    if (!dir || !dir[0]) return TERA_OK;
    if (tera_mkdirs(dir) != TERA_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", tera_last_error());
        return tera_fail(TERA_ERR_IO, "logging.tensorboard = \"%s\": %s", dir, why);
    }
    tera_tensorboard *tb = tera_calloc(1, sizeof *tb);
    char host[64] = "localhost";
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    snprintf(tb->path, sizeof tb->path, "%s/events.out.tfevents.%ld.%s.%ld", dir, (long)time(NULL), host, (long)getpid());
    tb->f = fopen(tb->path, "wb");
    if (!tb->f) {
        const tera_status st = tera_fail(TERA_ERR_IO, "logging.tensorboard: cannot create '%s': %s", tb->path, strerror(errno));
        free(tb);
        return st;
    }
    tb->iobuf = tera_malloc(1 << 16);
    setvbuf(tb->f, tb->iobuf, _IOFBF, 1 << 16);
    const tera_model *m = &tr->model;
    tb->first_moe = m->cfg.first_k_dense < m->cfg.n_layers ? m->cfg.first_k_dense : m->cfg.n_layers;
    tb->n_moe = m->cfg.n_experts > 0 ? m->cfg.n_layers - tb->first_moe : 0;
    tb->n_experts = m->cfg.n_experts;
    /* the largest record: the step's scalars (~48 bytes each: fixed figures, groups, two per MoE
     * layer, the hardware readings) or one histogram (two doubles per expert) */
    tb->cap = 8192 + 128 * (size_t)(2 * tb->n_moe + TERA_PARAM_GROUPS + 32) + 24 * (size_t)(tb->n_experts + 1);
    tb->rec = tera_malloc(tb->cap);
    pb p = begin_event(tb, 0);
    pb_bytes(&p, 3, "brain.Event:2", 13);
    emit(tb, &p);
    if (fflush(tb->f) != 0) tb->err = errno ? errno : EIO;
    *out = tb;
    return TERA_OK;
}

void tera_tensorboard_step(tera_tensorboard *tb, const tera_trainer *tr, const tera_step_result *r) {
    if (!tb) return;
    const tera_model *m = &tr->model;
    pb p = begin_event(tb, r->step);
    const size_t sum = open_len(&p, 5); /* Event.summary */
    const double T = tr->cfg.training.seq_len;
    scalar(&p, "loss", r->loss);
    scalar(&p, "ce_loss", r->ce_loss);
    scalar(&p, "aux_loss", r->aux_loss);
    scalar(&p, "z_loss", r->z_loss);
    scalar(&p, "aux_loss_weighted", tr->cfg.model.aux_coef * r->aux_loss); /* what each added to the loss */
    scalar(&p, "z_loss_weighted", tr->cfg.model.z_coef * r->z_loss);
    scalar(&p, "lr", r->lr);
    scalar(&p, "grad_norm", r->grad_norm);
    scalar(&p, "tokens_per_s", r->seconds > 0 ? (double)r->batch_seqs * T / r->seconds : 0.0);
    scalar(&p, "step_s", r->seconds);
    scalar(&p, "data_wait_s", r->data_seconds);
    scalar(&p, "comm_wait_s", r->comm_seconds);
    scalar(&p, "dropped_frac", r->dropped_frac);
    scalar(&p, "update_ratio", r->update_ratio);
    scalar(&p, "loss_scale", r->loss_scale);
    scalar(&p, "skipped", r->skipped);
    scalar(&p, "batch", (double)r->batch_seqs);
    scalar(&p, "model_tflops", 1e-12 * r->model_flops_s);
    if (r->mfu >= 0.0) scalar(&p, "mfu", r->mfu); /* logging.peak_tflops given */
    double gsq[TERA_PARAM_GROUPS] = {0};
    int present[TERA_PARAM_GROUPS] = {0};
    for (int i = 0; i < m->n_params; i++) {
        const int g = tera_param_group(m->params[i].kind);
        gsq[g] += tr->sharding->grad_sq[i];
        present[g] = 1;
    }
    char tag[96];
    for (int g = 0; g < TERA_PARAM_GROUPS; g++) {
        if (!present[g]) continue;
        snprintf(tag, sizeof tag, "grad_norm_by_group/%s", tera_param_group_names[g]);
        scalar(&p, tag, sqrt(gsq[g]));
    }
    const int E = tb->n_experts;
    for (int j = 0; j < tb->n_moe; j++) {
        const int l = tb->first_moe + j;
        int64_t mx = 0, s = 0;
        for (int e = 0; e < E; e++) {
            const int64_t v = m->expert_load[(int64_t)l * E + e];
            s += v;
            if (v > mx) mx = v;
        }
        snprintf(tag, sizeof tag, "router_entropy/layer_%d", l);
        scalar(&p, tag, m->routed_tokens ? m->router_entropy[l] / (double)m->routed_tokens : 0.0);
        snprintf(tag, sizeof tag, "expert_load_max_over_mean/layer_%d", l);
        scalar(&p, tag, s ? (double)mx * E / (double)s : 0.0);
    }
    for (int q = 0; q < r->pp && r->pp_busy_s; q++) { /* a pipeline: each stage's busy and waiting seconds */
        snprintf(tag, sizeof tag, "pp_busy_s/stage_%d", q);
        scalar(&p, tag, r->pp_busy_s[q]);
        snprintf(tag, sizeof tag, "pp_wait_s/stage_%d", q);
        scalar(&p, tag, r->pp_wait_s[q]);
    }
    const tera_hw_reading *hw = tera_hw_latest(); /* sampled by the step (absent readings: not written) */
    for (int i = 0; i < hw->n; i++) {
        snprintf(tag, sizeof tag, "hw/%s", hw->name[i]);
        scalar(&p, tag, hw->value[i]);
    }
    close_len(&p, sum);
    emit(tb, &p);
    /* the expert load of each MoE layer: value = expert index, weight = its assignments */
    for (int j = 0; j < tb->n_moe; j++) {
        const int l = tb->first_moe + j;
        const int64_t *ld = m->expert_load + (int64_t)l * E;
        double num = 0, s1 = 0, s2 = 0, lo = -1, hi = -1;
        for (int e = 0; e < E; e++) {
            num += (double)ld[e], s1 += (double)ld[e] * e, s2 += (double)ld[e] * e * e;
            if (ld[e] > 0) {
                if (lo < 0) lo = e;
                hi = e;
            }
        }
        pb h = begin_event(tb, r->step);
        const size_t hs = open_len(&h, 5);
        const size_t hv = open_len(&h, 1);
        snprintf(tag, sizeof tag, "expert_load/layer_%d", l);
        pb_bytes(&h, 1, tag, strlen(tag));
        const size_t hp = open_len(&h, 5);
        pb_double(&h, 1, lo < 0 ? 0 : lo);
        pb_double(&h, 2, hi < 0 ? 0 : hi);
        pb_double(&h, 3, num);
        pb_double(&h, 4, s1);
        pb_double(&h, 5, s2);
        pb_key(&h, 6, 2); /* bucket e holds expert e: (e - 1, e] with upper limit e + 0.5 */
        pb_varint(&h, 8 * (uint64_t)E);
        for (int e = 0; e < E; e++) {
            const double lim = e + 0.5;
            uint64_t u;
            memcpy(&u, &lim, 8);
            pb_fixed64(&h, u);
        }
        pb_key(&h, 7, 2);
        pb_varint(&h, 8 * (uint64_t)E);
        for (int e = 0; e < E; e++) {
            const double c = (double)ld[e];
            uint64_t u;
            memcpy(&u, &c, 8);
            pb_fixed64(&h, u);
        }
        close_len(&h, hp);
        close_len(&h, hv);
        close_len(&h, hs);
        emit(tb, &h);
    }
    if (++tb->steps_since_flush >= 10) { /* a live TensorBoard sees the run within ten steps */
        tb->steps_since_flush = 0;
        if (tb->f && !tb->err && fflush(tb->f) != 0) tb->err = errno ? errno : EIO;
    }
}

void tera_tensorboard_eval(tera_tensorboard *tb, int64_t step, double val_loss) {
    if (!tb) return;
    pb p = begin_event(tb, step);
    const size_t sum = open_len(&p, 5);
    scalar(&p, "val_loss", val_loss);
    scalar(&p, "val_perplexity", exp(val_loss));
    close_len(&p, sum);
    emit(tb, &p);
    if (tb->f && !tb->err && fflush(tb->f) != 0) tb->err = errno ? errno : EIO;
}

tera_status tera_tensorboard_close(tera_tensorboard *tb) {
    if (!tb) return TERA_OK;
    int err = tb->err;
    if (tb->f && fclose(tb->f) != 0 && !err) err = errno ? errno : EIO;
    tera_status st = TERA_OK;
    if (err) st = tera_fail(TERA_ERR_IO, "logging.tensorboard: writing '%s' failed: %s", tb->path, strerror(err));
    else if (tb->overflow) st = tera_fail(TERA_ERR_IO, "logging.tensorboard: a record of '%s' exceeded its buffer", tb->path);
    free(tb->iobuf);
    free(tb->rec);
    free(tb);
    return st;
}
