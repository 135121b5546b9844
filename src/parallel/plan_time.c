/* tera plan: hardware descriptions, the first time model of a step, and the layout search.
 *
 * Time model (stated, not calibrated; docs/PLAN.md):
 * - compute: each stage's model FLOPs per micro-batch (forward 2 x active matrix params + 4 D T per
 *   token and layer for attention, backward twice the forward: the 6 x active + 12 L D T of
 *   tera_model_flops_per_token), divided by tp, plus recomputation (full: the layer's forward again;
 *   selective: the attention core and the SwiGLU hidden products), at `efficiency` x the device's
 *   dense peak for training.precision;
 * - communication: the bytes one rank sends per step are bench-dist's per-layout formulas
 *   (src/cli/cmd_bench.c comm_minimum, restated here for a rank that does not exist: its functions
 *   take a live trainer), each over the link its group crosses (inside a node when the group's
 *   ranks fit in one node's devices, else between nodes), alpha-beta: bytes / bandwidth + messages
 *   x latency;
 * - tensor-parallel sums, expert exchanges and pipeline sends are inside each micro-batch's
 *   operations (not overlapped); data-parallel reductions overlap backward where tera overlaps them
 *   (ZeRO 0: buckets during the last micro-batch's backward; ZeRO-2: reduce-scatters during each
 *   backward; ZeRO-3: prefetched gathers during compute); ZeRO-1's reduce-scatter and all-gather
 *   are exposed;
 * - pipeline: the schedule's simulated makespan (tera_schedule_simulate, backward = 2 x forward)
 *   times the busiest stage's time per micro-batch. */
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <string.h>

#include "plan_internal.h"
#include "tera/model.h"
#include "tera/schedule.h"

/* ------------------------------------------------------------------ hardware */
typedef struct {
    tera_hw *hw;
    const char *path;
    char err[1024];
    unsigned seen;
} hw_ctx;

enum { HW_NAME = 1, HW_MEM = 2, HW_FP32 = 4, HW_BF16 = 8, HW_DEV = 16, HW_IBW = 32, HW_ILAT = 64, HW_XBW = 128,
       HW_XLAT = 256, HW_ALL = 511 };

static int hw_handler(void *user, const char *section, const char *name, const char *raw) {
    hw_ctx *c = user;
    tera_hw *h = c->hw;
    char value[256]; /* the value without a trailing "# comment" and blanks */
    snprintf(value, sizeof value, "%s", raw);
    char *hash = strchr(value, '#');
    if (hash) *hash = '\0';
    for (size_t n = strlen(value); n > 0 && (value[n - 1] == ' ' || value[n - 1] == '\t'); n--) value[n - 1] = '\0';
    char *end;
    const double v = strtod(value, &end);
    const int numeric = end != value && *end == '\0' && isfinite(v) && v >= 0.0;
    struct {
        const char *sec, *key;
        double *dst, scale;
        unsigned bit;
    } keys[] = {
        {"device", "memory_gib", &h->memory_bytes, 1024.0 * 1024.0 * 1024.0, HW_MEM},
        {"device", "peak_tflops_fp32", &h->peak_flops[TERA_HW_FP32], 1e12, HW_FP32},
        {"device", "peak_tflops_bf16", &h->peak_flops[TERA_HW_BF16], 1e12, HW_BF16},
        {"device", "peak_tflops_fp16", &h->peak_flops[TERA_HW_FP16], 1e12, 0},
        {"device", "peak_tflops_fp8", &h->peak_flops[TERA_HW_FP8], 1e12, 0},
        {"intra_node", "bandwidth_gbytes_s", &h->intra_bw, 1e9, HW_IBW},
        {"intra_node", "latency_us", &h->intra_lat, 1e-6, HW_ILAT},
        {"inter_node", "bandwidth_gbytes_s", &h->inter_bw, 1e9, HW_XBW},
        {"inter_node", "latency_us", &h->inter_lat, 1e-6, HW_XLAT},
    };
    if (!strcmp(section, "device") && !strcmp(name, "name")) {
        snprintf(h->name, sizeof h->name, "%.127s", value);
        c->seen |= HW_NAME;
        return 1;
    }
    if (!strcmp(section, "node") && !strcmp(name, "devices")) {
        const long n = strtol(value, &end, 10);
        if (*end || n < 1 || n > 1024) {
            snprintf(c->err, sizeof c->err, "[node] devices = '%.200s' is not an integer in 1..1024", value);
            return 0;
        }
        h->devices_per_node = (int)n;
        c->seen |= HW_DEV;
        return 1;
    }
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strcmp(section, keys[i].sec) && !strcmp(name, keys[i].key)) {
            if (!numeric) {
                snprintf(c->err, sizeof c->err, "[%.64s] %.64s = '%.200s' is not a non-negative number", section, name,
                         value);
                return 0;
            }
            *keys[i].dst = v * keys[i].scale;
            c->seen |= keys[i].bit;
            return 1;
        }
    snprintf(c->err, sizeof c->err, "unknown key [%.64s] %.64s (keys: [device] name, memory_gib, peak_tflops_fp32, "
             "peak_tflops_bf16, peak_tflops_fp16, peak_tflops_fp8; [node] devices; [intra_node], [inter_node] "
             "bandwidth_gbytes_s, latency_us)", section, name);
    return 0;
}

tera_status tera_hw_load(tera_hw *hw, const char *path) {
    memset(hw, 0, sizeof *hw);
    hw_ctx c = {.hw = hw, .path = path};
    FILE *f = fopen(path, "r");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot open hardware description '%s': %s", path, strerror(errno));
    const int rc = ini_parse_file(f, hw_handler, &c);
    fclose(f);
    if (rc > 0)
        return tera_fail(TERA_ERR_CONFIG, "%s:%d: %s", path, rc, c.err[0] ? c.err : "malformed line");
    if (rc < 0) return tera_fail(TERA_ERR_IO, "cannot read hardware description '%s'", path);
    if ((c.seen & HW_ALL) != HW_ALL)
        return tera_fail(TERA_ERR_CONFIG, "%s: needs [device] name, memory_gib, peak_tflops_fp32, peak_tflops_bf16; "
                         "[node] devices; [intra_node] and [inter_node] bandwidth_gbytes_s and latency_us", path);
    if (hw->memory_bytes <= 0 || hw->intra_bw <= 0 || hw->inter_bw <= 0)
        return tera_fail(TERA_ERR_CONFIG, "%s: memory_gib and the bandwidths must be positive", path);
    return TERA_OK;
}

tera_hw_prec tera_hw_prec_of(const char *p) {
    if (!strcmp(p, "bf16")) return TERA_HW_BF16;
    if (!strcmp(p, "fp16")) return TERA_HW_FP16;
    return TERA_HW_FP32;
}

/* ------------------------------------------------------------------ time model */
static double ring(int p) { return p > 1 ? (double)(p - 1) / (double)p : 0.0; }

/* The link a group of `span` consecutive world ranks (its members spaced inside that span) crosses. */
static void link_of(const tera_hw *hw, int64_t span, double *bw, double *lat) {
    const int intra = span <= hw->devices_per_node;
    *bw = intra ? hw->intra_bw : hw->inter_bw;
    *lat = intra ? hw->intra_lat : hw->inter_lat;
}

/* Model FLOPs per token of one layer's forward (tera_model_active_params / flops_per_token by layer),
 * and the forward FLOPs its recomputation adds per token. */
static void layer_flops(const tera_model_config *c, int l, int T, double *fwd, double *rec_full, double *rec_sel) {
    const double D = c->dim, H = c->n_heads, Hkv = c->n_kv_heads, hd = D / H, F = c->ffn_dim;
    const double attn_mat = 2.0 * D * H * hd + 2.0 * D * Hkv * hd, attn_core = 4.0 * D * T;
    double ffn_mat, hidden;
    if (l < c->first_k_dense) {
        ffn_mat = 3.0 * D * c->dense_ffn_dim;
        hidden = 2.0 * D * c->dense_ffn_dim;
    } else {
        ffn_mat = (double)c->n_experts * D + c->top_k * 3.0 * D * F + 3.0 * D * F * c->n_shared_experts;
        hidden = (c->top_k + (double)c->n_shared_experts) * 2.0 * D * F;
    }
    *fwd = 2.0 * (attn_mat + ffn_mat) + attn_core;
    *rec_full = *fwd;
    *rec_sel = attn_core + 2.0 * hidden;
}

tera_status tera_plan_time_model_stages(const tera_config *cfg, const tera_hw *hw, const tera_plan_opts *o,
                                        const tera_plan_stage *st, double makespan, double bubble,
                                        tera_plan_time *out) {
    const tera_model_config *c = &cfg->model;
    const tera_parallel_config *p = &cfg->parallel;
    const int T = cfg->training.seq_len, A = cfg->training.grad_accum, pp = p->pp, tp = p->tp, dp = p->dp,
              ep = p->ep, L = c->n_layers, v = pp > 1 ? p->pp_chunks : 1;
    const int zero = dp > 1 ? p->zero : 0, edp = dp / ep;
    const double N = (double)cfg->training.micro_batch * T, D = c->dim;
    const double peak = hw->peak_flops[tera_hw_prec_of(cfg->training.precision)];
    memset(out, 0, sizeof *out);
    if (peak <= 0)
        return tera_fail(TERA_ERR_CONFIG, "hardware '%s' has no peak for training.precision = %s", hw->name,
                         cfg->training.precision);
    const double rate = peak * o->efficiency;
    const int64_t devices = (int64_t)pp * dp * tp;
    out->flops_per_step = tera_model_flops_per_token(c, T) * N * A * dp;
    double bw, lat;
    double worst_u = 0.0, u_tp = 0, u_ep = 0, u_pp = 0, u_comp = 0, rec_all = 0.0;
    int worst = 0;
    for (int s = 0; s < pp; s++) {
        /* the stage's layers: from its layer range(s); recompute per layer policy */
        double fwd, rec;
        const int layers = st[s].layers, moe = st[s].moe_layers;
        /* FLOPs per layer differ only between dense and MoE layers, so the stage's counts suffice */
        double fd, rfd, rsd, fm, rfm, rsm;
        layer_flops(c, 0, T, &fd, &rfd, &rsd);
        layer_flops(c, c->first_k_dense < L ? c->first_k_dense : 0, T, &fm, &rfm, &rsm);
        const int dense = layers - moe;
        fwd = dense * fd + moe * fm;
        /* recomputation: the extra forward of each recomputed layer, by its policy */
        rec = st[s].full[0] * rfd + st[s].full[1] * rfm + st[s].selective[0] * rsd + st[s].selective[1] * rsm;
        const int has_head = s == pp - 1;
        if (has_head) fwd += 2.0 * (double)c->vocab_size * D;
        const double comp = (3.0 * fwd + rec) * N / tp / rate;
        rec_all += rec * N * A * dp; /* whole job, this stage's share */
        /* tensor parallelism: bench-dist's tp_bytes per micro-batch */
        double ttp = 0.0;
        if (tp > 1) {
            const double floats = 4.0 * layers * N * D + (s == 0 ? N * D : 0.0) + (has_head ? N * D + 3.0 * N : 0.0) +
                                  moe * N * c->top_k;
            const double bytes = 2.0 * ring(tp) * 4.0 * floats;
            link_of(hw, tp, &bw, &lat);
            const double n_ar = 4.0 * layers + (s == 0) + (has_head ? 3.0 : 0.0) + moe;
            ttp = bytes / bw + n_ar * 2.0 * (tp - 1) * lat;
            if (s == 0 || bytes * A > out->bytes_tp) out->bytes_tp = bytes * A;
        }
        /* expert exchange: bench-dist's ep_bytes per micro-batch (uniform routing) */
        double tep = 0.0;
        if (ep > 1 && moe > 0) {
            const double bytes = moe * 4.0 * ring(ep) * N * c->top_k * D * 4.0;
            link_of(hw, (int64_t)ep * tp, &bw, &lat);
            tep = bytes / bw + moe * 4.0 * lat;
            if (bytes * A > out->bytes_ep) out->bytes_ep = bytes * A;
        }
        /* pipeline sends: bench-dist's pp_bytes per micro-batch */
        double tpp = 0.0;
        if (pp > 1) {
            const double bytes = st[s].sends * N * D * 4.0;
            link_of(hw, (int64_t)pp * dp * tp, &bw, &lat); /* neighbours are dp x tp ranks apart */
            tpp = bytes / bw + st[s].sends * lat;
            if (bytes * A > out->bytes_pp) out->bytes_pp = bytes * A;
        }
        const double u = comp + ttp + tep + tpp;
        if (s == 0 || u > worst_u) worst_u = u, worst = s, u_tp = ttp, u_ep = tep, u_pp = tpp, u_comp = comp;
    }
    (void)v;
    out->recompute_flops = rec_all;
    /* the schedule: makespan in forward units (a micro-batch's work = 3 units) */
    const double pipe = makespan / 3.0 * worst_u;
    out->compute_s = A * u_comp;
    out->tp_s = A * u_tp, out->ep_s = A * u_ep, out->pp_s = A * u_pp;
    out->bubble_s = pipe - A * worst_u;
    out->bubble_frac = pp > 1 ? bubble : 0.0;
    /* data parallelism over dp (non-expert) and edp (experts), the stage's ranks: bench-dist's grad_bytes
     * and zero3_gather_bytes; one group of dp x tp ranks */
    const tera_plan_stage *w = &st[worst];
    const double nd = (double)w->n_dense, nx = (double)(w->n_floats - w->n_dense);
    const double pass = 4.0 * (ring(dp) * nd + ring(edp) * nx);
    link_of(hw, (int64_t)dp * tp, &bw, &lat);
    const double groups = w->layers + (worst == 0) + (worst == pp - 1);
    const double msg = (dp > 1 ? dp - 1 : 0) * lat; /* one ring pass's latency */
    double t_dp = 0.0, exposed = 0.0;
    const double t_bwd = 2.0 / 3.0 * u_comp; /* one micro-batch's backward on the stage */
    if (dp > 1) {
        if (zero == 0) {
            out->bytes_dp = 2.0 * pass;
            t_dp = out->bytes_dp / bw + 2.0 * groups * 2.0 * msg;
            exposed = t_dp > t_bwd ? t_dp - t_bwd : 0.0;
        } else if (zero == 1) {
            out->bytes_dp = 2.0 * pass;
            t_dp = out->bytes_dp / bw + 2.0 * 2.0 * msg;
            exposed = t_dp;
        } else {
            const double rs = A * pass, ag = zero < 3 ? pass : 0.0;
            double gather = 0.0, n_gathers = 0.0;
            if (zero >= 3 && w->group) { /* each layer gathered twice per micro-batch, embedding/head once a step */
                for (int g = -2; g < L; g++) {
                    const double sz = 4.0 * (ring(dp) * w->group[2 * (g + 2)] + ring(edp) * w->group[2 * (g + 2) + 1]);
                    if (sz <= 0) continue;
                    const double uses = g < 0 ? 1.0 : 2.0 * A;
                    gather += uses * sz, n_gathers += uses;
                }
            }
            out->bytes_dp = rs + ag + gather;
            t_dp = out->bytes_dp / bw + (A * groups * 2.0 + 2.0 + 2.0 * n_gathers) * msg;
            const double t_rs = rs / bw + A * groups * 2.0 * msg, t_rest = t_dp - t_rs;
            const double hide_rs = A * t_bwd, hide_g = A * u_comp;
            exposed = (t_rs > hide_rs ? t_rs - hide_rs : 0.0);
            if (zero >= 3) exposed += t_rest > hide_g ? t_rest - hide_g : 0.0;
            else exposed += t_rest;
        }
    }
    out->dp_total_s = t_dp;
    out->dp_s = exposed;
    out->step_s = pipe + exposed;
    out->tokens_per_s = N * A * dp / out->step_s;
    out->mfu = out->flops_per_step / (out->step_s * (double)devices * peak);
    return TERA_OK;
}

tera_status tera_plan_time_model(const tera_config *cfg, const tera_hw *hw, const tera_plan_opts *o,
                                 tera_plan_time *out) {
    tera_plan_cache *cache = tera_plan_cache_new();
    tera_plan_stage *st = tera_calloc((size_t)cfg->parallel.pp, sizeof *st);
    double bubble, makespan;
    tera_status s = tera_plan_stages(cfg, cache, o->threads, st, &bubble, &makespan);
    if (s == TERA_OK) s = tera_plan_time_model_stages(cfg, hw, o, st, makespan, bubble, out);
    free(st);
    tera_plan_cache_free(cache);
    return s;
}

/* ------------------------------------------------------------------ search */
static int cmp_cand(const void *a, const void *b) {
    const tera_plan_candidate *x = a, *y = b;
    if (x->time.step_s != y->time.step_s) return x->time.step_s < y->time.step_s ? -1 : 1;
    return x->worst.total < y->worst.total ? -1 : x->worst.total > y->worst.total;
}

tera_status tera_plan_search(const tera_config *base, const tera_hw *hw, const tera_plan_opts *o,
                             const tera_plan_search_opts *so, tera_plan_candidate **best, int *n_best,
                             int64_t *n_valid, int64_t *n_fit) {
    const tera_model_config *mc = &base->model;
    const int devs = so->devices, G = so->global_batch, L = mc->n_layers;
    const int max_tp = so->max_tp > 0 ? so->max_tp : hw->devices_per_node;
    const int keep = so->keep > 0 ? so->keep : 10;
    const double budget = hw->memory_bytes * (1.0 - o->reserve);
    *n_valid = *n_fit = 0;
    *n_best = 0;
    if (devs < 1 || G < 1) return tera_fail(TERA_ERR_ARG, "--devices and --global-batch must be positive");
    tera_plan_candidate *top = tera_calloc((size_t)keep + 1, sizeof *top);
    int n_top = 0;
    tera_plan_cache *cache = tera_plan_cache_new();
    tera_plan_stage *st = tera_calloc((size_t)(L + 1), sizeof *st);
    static const char *const rec[] = {"none", "selective", "full"};
    static const struct {
        const char *kind;
        int chunks;
    } sched[] = {{"1f1b", 1}, {"gpipe", 1}, {"interleaved", 2}, {"interleaved", 4}};
    for (int tp = 1; tp <= devs && tp <= max_tp; tp++) {
        if (devs % tp) continue;
        for (int pp = 1; pp <= devs / tp && pp <= L; pp++) {
            if ((devs / tp) % pp) continue;
            const int dp = devs / tp / pp;
            if (G % dp) continue;
            const int per_rank = G / dp;
            for (int ep = 1; ep <= dp; ep++) {
                if (dp % ep || mc->n_experts % ep) continue;
                for (size_t si = 0; si < (pp > 1 ? sizeof sched / sizeof sched[0] : 1); si++)
                    for (int mb = 1; mb <= per_rank; mb++) {
                        if (per_rank % mb) continue;
                        /* the configuration checks (tera_config_finalize), once per shape: their verdict
                         * does not depend on the ZeRO stage (0-3) or on the three recompute policies */
                        tera_config c0 = *base;
                        c0.parallel.tp = tp, c0.parallel.pp = pp, c0.parallel.dp = dp, c0.parallel.ep = ep;
                        c0.parallel.zero = 0;
                        snprintf(c0.parallel.pp_schedule, sizeof c0.parallel.pp_schedule, "%s", sched[si].kind);
                        c0.parallel.pp_chunks = sched[si].chunks;
                        c0.parallel.pp_layers[0] = '\0';
                        c0.training.micro_batch = mb;
                        c0.training.grad_accum = per_rank / mb;
                        c0.training.global_batch = G;
                        snprintf(c0.training.recompute, sizeof c0.training.recompute, "none");
                        if (tera_config_finalize(&c0) != TERA_OK) continue; /* the layouts tera accepts */
                        for (int zero = 0; zero <= (dp > 1 ? 3 : 0); zero++)
                            for (int r = 0; r < 3; r++) {
                                tera_plan_candidate cand;
                                memset(&cand, 0, sizeof cand);
                                tera_config *c = &cand.cfg;
                                *c = c0;
                                c->parallel.zero = zero;
                                snprintf(c->training.recompute, sizeof c->training.recompute, "%s", rec[r]);
                                double bubble, makespan;
                                if (tera_plan_stages(c, cache, o->threads, st, &bubble, &makespan) != TERA_OK) continue;
                                (*n_valid)++;
                                cand.worst = st[0].mem;
                                for (int s = 1; s < pp; s++)
                                    if (st[s].mem.total > cand.worst.total) cand.worst = st[s].mem;
                                cand.fits = (double)cand.worst.total <= budget;
                                if (!cand.fits) continue;
                                (*n_fit)++;
                                if (tera_plan_time_model_stages(c, hw, o, st, makespan, bubble, &cand.time) != TERA_OK)
                                    continue;
                                if (n_top == keep && cmp_cand(&cand, &top[keep - 1]) >= 0) continue;
                                int at = n_top < keep ? n_top++ : keep - 1;
                                top[at] = cand;
                                while (at > 0 && cmp_cand(&top[at], &top[at - 1]) < 0) {
                                    const tera_plan_candidate t = top[at];
                                    top[at] = top[at - 1], top[at - 1] = t;
                                    at--;
                                }
                            }
                    }
            }
        }
    }
    free(st);
    tera_plan_cache_free(cache);
    *best = top;
    *n_best = n_top;
    return TERA_OK;
}
