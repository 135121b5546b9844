/* tera plan: hardware descriptions (and the measured rates tera plan --calibrate adds), the time
 * model of a step, and the layout search.
 *
 * Time model (docs/PLAN.md, "The time model"):
 * - products: every product of a stage's layers per micro-batch, forward + backward (6 m k n), at the
 *   rate for its shape (tera_hw_gemm_rate: measured and interpolated, else gemm_efficiency x peak);
 *   attention at its kernel's rate; recomputation adds the forward of what each policy drops;
 * - element-wise passes (norms, RoPE, residuals, SwiGLU, routing, gather/combine, cross-entropy)
 *   and the optimizer by their bytes at the memory bandwidth;
 * - communication: the bytes one rank sends are bench-dist's per-layout formulas
 *   (src/cli/cmd_bench.c comm_minimum, restated here for a rank that does not exist: its functions
 *   take a live trainer), priced by the measured fit of their kind ([collective]) or alpha-beta
 *   over the link the group crosses;
 * - tensor-parallel sums, expert exchanges and pipeline sends are inside each micro-batch's
 *   operations (not overlapped, unless the planned run is another implementation: exchange_overlap,
 *   comm_overlap); data-parallel reductions overlap backward where tera overlaps them (ZeRO 0:
 *   buckets during the last micro-batch's backward; ZeRO-2: reduce-scatters during each backward;
 *   ZeRO-3: prefetched gathers during compute); ZeRO-1's reduce-scatter and all-gather are exposed;
 * - ranks x threads beyond [node] cores share them (a CPU machine);
 * - pipeline: the schedule's simulated makespan (tera_schedule_simulate, backward = 2 x forward)
 *   times the busiest stage's time per micro-batch. */
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan_internal.h"
#include "tera/model.h"
#include "tera/schedule.h"

/* ------------------------------------------------------------------ hardware */
const char *const tera_hw_prec_name[TERA_HW_NPREC] = {"fp32", "bf16", "fp16", "fp8"};
const char *const tera_hw_coll_name[TERA_HW_NCOLL] = {"allreduce", "allgather", "alltoall", "p2p"};

typedef struct {
    tera_hw *hw;
    const char *path;
    char err[1024];
    unsigned seen;
} hw_ctx;

enum { HW_NAME = 1, HW_MEM = 2, HW_FP32 = 4, HW_BF16 = 8, HW_DEV = 16, HW_IBW = 32, HW_ILAT = 64, HW_XBW = 128,
       HW_XLAT = 256, HW_ALL = 511 };

/* n numbers of a measured point's value ("2 fp32 512 256 1024 123.4": the precision word allowed at
 * index prec_at, -1 for none); 0 when malformed */
static int parse_point(const char *value, double *x, int n, int prec_at, tera_hw_prec *prec) {
    const char *q = value;
    for (int i = 0; i < n; i++) {
        while (*q == ' ' || *q == '\t') q++;
        if (i == prec_at) {
            int found = 0;
            for (int p = 0; p < TERA_HW_NPREC && !found; p++) {
                const size_t len = strlen(tera_hw_prec_name[p]);
                if (!strncmp(q, tera_hw_prec_name[p], len) && (q[len] == ' ' || q[len] == '\t')) {
                    *prec = (tera_hw_prec)p, q += len, found = 1;
                }
            }
            if (!found) return 0;
            x[i] = 0;
            continue;
        }
        char *end;
        x[i] = strtod(q, &end);
        if (end == q || !isfinite(x[i]) || x[i] < 0) return 0;
        q = end;
    }
    while (*q == ' ' || *q == '\t') q++;
    return *q == '\0';
}

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
        {"device", "memory_bandwidth_gbytes_s", &h->mem_bw, 1e9, 0},
        {"device", "gemm_efficiency", &h->gemm_efficiency, 1.0, 0},
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
    if (!strcmp(section, "node") && (!strcmp(name, "devices") || !strcmp(name, "cores"))) {
        const long n = strtol(value, &end, 10);
        if (*end || n < 1 || n > 4096) {
            snprintf(c->err, sizeof c->err, "[node] %s = '%.200s' is not an integer in 1..4096", name, value);
            return 0;
        }
        if (name[0] == 'd') h->devices_per_node = (int)n, c->seen |= HW_DEV;
        else h->cores = (int)n;
        return 1;
    }
    if (!strcmp(section, "gemm") && !strcmp(name, "point")) {
        double x[6];
        tera_hw_prec p = TERA_HW_FP32;
        if (!parse_point(value, x, 6, 1, &p) || x[0] < 1 || x[2] < 1 || x[3] < 1 || x[4] < 1 || x[5] <= 0) {
            snprintf(c->err, sizeof c->err, "[gemm] point = '%.200s' is not THREADS PREC M K N GFLOP/S", value);
            return 0;
        }
        if (h->n_gemm == TERA_HW_MAX_GEMM) {
            snprintf(c->err, sizeof c->err, "more than %d [gemm] points", TERA_HW_MAX_GEMM);
            return 0;
        }
        h->gemm[h->n_gemm++] = (tera_hw_gemm){.threads = (int)x[0], .prec = p, .m = (int64_t)x[2], .k = (int64_t)x[3],
                                              .n = (int64_t)x[4], .flops_s = x[5] * 1e9};
        return 1;
    }
    if (!strcmp(section, "attention") && !strcmp(name, "point")) {
        double x[7];
        if (!parse_point(value, x, 7, -1, NULL) || x[0] < 1 || x[1] < 1 || x[2] < 1 || x[3] < 1 || x[4] < 1 ||
            x[5] < 1 || x[6] <= 0) {
            snprintf(c->err, sizeof c->err, "[attention] point = '%.200s' is not THREADS B T H HKV HD GFLOP/S", value);
            return 0;
        }
        if (h->n_attn == TERA_HW_MAX_ATTN) {
            snprintf(c->err, sizeof c->err, "more than %d [attention] points", TERA_HW_MAX_ATTN);
            return 0;
        }
        h->attn[h->n_attn++] = (tera_hw_attn){.threads = (int)x[0], .B = (int)x[1], .T = (int)x[2], .H = (int)x[3],
                                              .Hkv = (int)x[4], .hd = (int)x[5], .flops_s = x[6] * 1e9};
        return 1;
    }
    if (!strcmp(section, "memory") && !strcmp(name, "point")) { /* THREADS GBYTES/S: streaming bandwidth */
        double x[2];
        if (!parse_point(value, x, 2, -1, NULL) || x[0] < 1 || x[1] <= 0) {
            snprintf(c->err, sizeof c->err, "[memory] point = '%.200s' is not THREADS GBYTES/S", value);
            return 0;
        }
        const int t = (int)x[0];
        if (t < (int)(sizeof h->mem_bw_threads / sizeof h->mem_bw_threads[0])) h->mem_bw_threads[t] = x[1] * 1e9;
        return 1;
    }
    if (!strcmp(section, "collective")) {
        for (int k = 0; k < TERA_HW_NCOLL; k++)
            if (!strcmp(name, tera_hw_coll_name[k])) {
                double x[3];
                if (!parse_point(value, x, 3, -1, NULL) || x[0] < 2 || x[2] <= 0) {
                    snprintf(c->err, sizeof c->err, "[collective] %s = '%.200s' is not RANKS LATENCY_US GBYTES/S",
                             name, value);
                    return 0;
                }
                if (h->n_coll == TERA_HW_MAX_COLL) {
                    snprintf(c->err, sizeof c->err, "more than %d [collective] lines", TERA_HW_MAX_COLL);
                    return 0;
                }
                h->coll[h->n_coll++] = (tera_hw_coll){.kind = (tera_hw_coll_kind)k, .ranks = (int)x[0],
                                                      .alpha_s = x[1] * 1e-6, .beta_bytes_s = x[2] * 1e9};
                return 1;
            }
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
             "peak_tflops_bf16, peak_tflops_fp16, peak_tflops_fp8, memory_bandwidth_gbytes_s, gemm_efficiency; [node] "
             "devices, cores; [intra_node], [inter_node] bandwidth_gbytes_s, latency_us; [gemm], [attention], [memory] "
             "point; [collective] allreduce, allgather, alltoall, p2p)", section, name);
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
    if (hw->gemm_efficiency > 1.0)
        return tera_fail(TERA_ERR_CONFIG, "%s: [device] gemm_efficiency = %g is not a fraction in 0..1", path,
                         hw->gemm_efficiency);
    return TERA_OK;
}

tera_status tera_hw_write(const tera_hw *hw, const char *path, const char *comment) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot write hardware description '%s': %s", tmp, strerror(errno));
    if (comment) fprintf(f, "%s", comment);
    fprintf(f, "[device]\nname = %s\nmemory_gib = %.3f\n", hw->name, hw->memory_bytes / (1024.0 * 1024.0 * 1024.0));
    for (int p = 0; p < TERA_HW_NPREC; p++)
        if (p <= TERA_HW_BF16 || hw->peak_flops[p] > 0)
            fprintf(f, "peak_tflops_%s = %.6g\n", tera_hw_prec_name[p], hw->peak_flops[p] / 1e12);
    if (hw->mem_bw > 0) fprintf(f, "memory_bandwidth_gbytes_s = %.4g\n", hw->mem_bw / 1e9);
    if (hw->gemm_efficiency > 0) fprintf(f, "gemm_efficiency = %.4g\n", hw->gemm_efficiency);
    fprintf(f, "\n[node]\ndevices = %d\n", hw->devices_per_node);
    if (hw->cores > 0) fprintf(f, "cores = %d\n", hw->cores);
    fprintf(f, "\n[intra_node]\nbandwidth_gbytes_s = %.4g\nlatency_us = %.4g\n", hw->intra_bw / 1e9, hw->intra_lat * 1e6);
    fprintf(f, "\n[inter_node]\nbandwidth_gbytes_s = %.4g\nlatency_us = %.4g\n", hw->inter_bw / 1e9, hw->inter_lat * 1e6);
    int any = 0;
    for (size_t t = 0; t < sizeof hw->mem_bw_threads / sizeof hw->mem_bw_threads[0]; t++)
        if (hw->mem_bw_threads[t] > 0) {
            if (!any++) fprintf(f, "\n# streaming bandwidth by thread count: THREADS GBYTES/S\n[memory]\n");
            fprintf(f, "point = %zu %.4g\n", t, hw->mem_bw_threads[t] / 1e9);
        }
    if (hw->n_gemm) fprintf(f, "\n# linear layer products, forward + backward (6 M K N FLOPs): THREADS PREC M K N GFLOP/S\n[gemm]\n");
    for (int i = 0; i < hw->n_gemm; i++) {
        const tera_hw_gemm *g = &hw->gemm[i];
        fprintf(f, "point = %d %s %lld %lld %lld %.4g\n", g->threads, tera_hw_prec_name[g->prec], (long long)g->m,
                (long long)g->k, (long long)g->n, g->flops_s / 1e9);
    }
    if (hw->n_attn) fprintf(f, "\n# attention kernel, forward + backward (12 T H HD FLOPs a token): THREADS B T H HKV HD GFLOP/S\n[attention]\n");
    for (int i = 0; i < hw->n_attn; i++) {
        const tera_hw_attn *a = &hw->attn[i];
        fprintf(f, "point = %d %d %d %d %d %d %.4g\n", a->threads, a->B, a->T, a->H, a->Hkv, a->hd, a->flops_s / 1e9);
    }
    if (hw->n_coll)
        fprintf(f, "\n# through tera's comm layer, a call = latency + bytes one rank sends / bandwidth: RANKS LATENCY_US "
                   "GBYTES/S\n[collective]\n");
    for (int i = 0; i < hw->n_coll; i++) {
        const tera_hw_coll *c = &hw->coll[i];
        fprintf(f, "%s = %d %.4g %.4g\n", tera_hw_coll_name[c->kind], c->ranks, c->alpha_s * 1e6, c->beta_bytes_s / 1e9);
    }
    const int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        remove(tmp);
        return tera_fail(TERA_ERR_IO, "cannot write hardware description '%s'", tmp);
    }
    if (rename(tmp, path) != 0) {
        const int e = errno;
        remove(tmp);
        return tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(e));
    }
    return TERA_OK;
}

tera_hw_prec tera_hw_prec_of(const char *p) {
    if (!strcmp(p, "bf16")) return TERA_HW_BF16;
    if (!strcmp(p, "fp16")) return TERA_HW_FP16;
    if (!strcmp(p, "fp8")) return TERA_HW_FP8;
    return TERA_HW_FP32;
}

/* piecewise linear interpolation of log(rate) over log(x), clamped at the ends; xs ascending */
static double interp_log(const double *xs, const double *ys, int n, double x) {
    if (n == 1 || x <= xs[0]) return ys[0];
    if (x >= xs[n - 1]) return ys[n - 1];
    int i = 1;
    while (xs[i] < x) i++;
    const double t = (log(x) - log(xs[i - 1])) / (log(xs[i]) - log(xs[i - 1]));
    return exp(log(ys[i - 1]) + t * (log(ys[i]) - log(ys[i - 1])));
}

/* sorts (x, y) pairs by x, merging equal x (their rates averaged) */
static int sort_pairs(double *xs, double *ys, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && xs[j] < xs[j - 1]; j--) {
            double t = xs[j]; xs[j] = xs[j - 1], xs[j - 1] = t;
            t = ys[j]; ys[j] = ys[j - 1], ys[j - 1] = t;
        }
    int w = 0;
    for (int i = 0; i < n; i++) {
        if (w > 0 && xs[i] == xs[w - 1]) { ys[w - 1] = 0.5 * (ys[w - 1] + ys[i]); continue; }
        xs[w] = xs[i], ys[w] = ys[i], w++;
    }
    return w;
}

/* the measured thread count nearest `threads` among the points of precision prec (0: none) */
static int nearest_threads(const tera_hw *hw, int threads, tera_hw_prec prec) {
    int best = 0;
    for (int i = 0; i < hw->n_gemm; i++) {
        const int t = hw->gemm[i].threads;
        if (hw->gemm[i].prec != prec) continue;
        if (!best || abs(t - threads) < abs(best - threads)) best = t;
    }
    return best;
}

static double fallback_rate(const tera_hw *hw, tera_hw_prec prec, double efficiency) {
    const double e = hw->gemm_efficiency > 0 ? hw->gemm_efficiency : efficiency;
    /* a precision the device has no figure for (the router's fp32 on a device whose fp32 peak is
     * unknown): its bf16, else fp32 figure */
    const double peak = hw->peak_flops[prec] > 0 ? hw->peak_flops[prec]
                        : hw->peak_flops[TERA_HW_BF16] > 0 ? hw->peak_flops[TERA_HW_BF16] : hw->peak_flops[TERA_HW_FP32];
    return e * peak;
}

double tera_hw_gemm_rate(const tera_hw *hw, int threads, tera_hw_prec prec, int64_t m, int64_t k, int64_t n,
                         double efficiency) {
    if (m <= 0 || k <= 0 || n <= 0) return fallback_rate(hw, prec, efficiency);
    tera_hw_prec p = prec;
    int t = nearest_threads(hw, threads, p);
    if (!t && p != TERA_HW_FP32) p = TERA_HW_FP32, t = nearest_threads(hw, threads, p);
    if (!t) return fallback_rate(hw, prec, efficiency);
    double xs[TERA_HW_MAX_GEMM], ys[TERA_HW_MAX_GEMM];
    int c = 0;
    for (int i = 0; i < hw->n_gemm; i++) { /* the same (k, n): by m */
        const tera_hw_gemm *g = &hw->gemm[i];
        if (g->prec == p && g->threads == t && g->k == k && g->n == n) xs[c] = (double)g->m, ys[c++] = g->flops_s;
    }
    if (c > 0) {
        c = sort_pairs(xs, ys, c);
        return interp_log(xs, ys, c, (double)m);
    }
    c = 0;
    for (int i = 0; i < hw->n_gemm; i++) { /* any shape: by FLOPs per call */
        const tera_hw_gemm *g = &hw->gemm[i];
        if (g->prec == p && g->threads == t) xs[c] = 6.0 * (double)g->m * (double)g->k * (double)g->n, ys[c++] = g->flops_s;
    }
    c = sort_pairs(xs, ys, c);
    return interp_log(xs, ys, c, 6.0 * (double)m * (double)k * (double)n);
}

double tera_hw_attn_rate(const tera_hw *hw, int threads, tera_hw_prec prec, int B, int T, int H, int Hkv, int hd,
                         double efficiency) {
    int best_t = 0;
    for (int i = 0; i < hw->n_attn; i++)
        if (!best_t || abs(hw->attn[i].threads - threads) < abs(best_t - threads)) best_t = hw->attn[i].threads;
    if (!best_t) return tera_hw_gemm_rate(hw, threads, prec, (int64_t)B * T, hd, T, efficiency);
    double xs[TERA_HW_MAX_ATTN], ys[TERA_HW_MAX_ATTN];
    int c = 0;
    for (int i = 0; i < hw->n_attn; i++) {
        const tera_hw_attn *a = &hw->attn[i];
        if (a->threads != best_t) continue;
        if (a->B == B && a->T == T && a->H == H && a->Hkv == Hkv && a->hd == hd) return a->flops_s;
        xs[c] = 12.0 * a->B * (double)a->T * a->T * a->H * a->hd, ys[c++] = a->flops_s;
    }
    c = sort_pairs(xs, ys, c);
    return interp_log(xs, ys, c, 12.0 * B * (double)T * T * H * hd);
}

/* streaming bandwidth for a thread count: a measured point (nearest thread count), else the
 * device's figure (0: none known) */
static double mem_bw_of(const tera_hw *hw, int threads) {
    const int n = (int)(sizeof hw->mem_bw_threads / sizeof hw->mem_bw_threads[0]);
    int best = 0;
    for (int t = 1; t < n; t++)
        if (hw->mem_bw_threads[t] > 0 && (!best || abs(t - threads) < abs(best - threads))) best = t;
    return best ? hw->mem_bw_threads[best] : hw->mem_bw;
}

/* ------------------------------------------------------------------ time model */
static double ring(int p) { return p > 1 ? (double)(p - 1) / (double)p : 0.0; }

/* The link a group of `span` consecutive world ranks (its members spaced inside that span) crosses. */
static void link_of(const tera_hw *hw, int64_t span, double *bw, double *lat) {
    const int intra = span <= hw->devices_per_node;
    *bw = intra ? hw->intra_bw : hw->inter_bw;
    *lat = intra ? hw->intra_lat : hw->inter_lat;
}

/* Seconds for `calls` transfers of one kind in a group of p ranks, `bytes` sent by one rank in all:
 * a measured fit of tera's comm layer ([collective], the world size nearest the job's), else
 * alpha-beta on the link the group spans (ring steps: 2(p-1) an all-reduce, p-1 a gather or
 * exchange, 1 a send). */
static double comm_s(const tera_hw *hw, tera_hw_coll_kind kind, int p, int64_t world, int64_t span, double bytes,
                     double calls) {
    if (p <= 1 || (bytes <= 0 && calls <= 0)) return 0.0;
    const tera_hw_coll *best = NULL;
    for (int i = 0; i < hw->n_coll; i++) {
        const tera_hw_coll *c = &hw->coll[i];
        if (c->kind != kind) continue;
        if (!best || llabs(c->ranks - world) < llabs(best->ranks - world)) best = c;
    }
    if (best) return calls * best->alpha_s + bytes / best->beta_bytes_s;
    double bw, lat;
    link_of(hw, span, &bw, &lat);
    const double steps = kind == TERA_HW_ALLREDUCE ? 2.0 * (p - 1) : kind == TERA_HW_P2P ? 1.0 : (double)(p - 1);
    return bytes / bw + calls * steps * lat;
}

/* Data-parallel sums over dp ranks (tp apart: a group spans dp x tp consecutive world ranks) of
 * `bytes` sent per rank by the flat ring (factor x (p-1)/p x G for a buffer of G bytes; factor 2 for
 * an all-reduce, 1 for a reduce-scatter or all-gather). parallel.hierarchical with the group on
 * N > 1 nodes of k = devices_per_node / tp members (k > 1, N k = dp): inside the node on all G
 * ((k-1)/k per stage), then across the nodes on G / k, each stage alpha-beta on its own link
 * (src/comm/comm_hier.c's schedule); otherwise the flat collective (comm_s). */
static double dp_comm_s(const tera_hw *hw, tera_hw_coll_kind kind, int dp, int tp, int64_t world, double bytes,
                        double calls, int hierarchical) {
    const int64_t span = (int64_t)dp * tp;
    const int k = tp > 0 && hw->devices_per_node % tp == 0 ? hw->devices_per_node / tp : 1;
    if (!hierarchical || span <= hw->devices_per_node || k < 2 || dp % k != 0)
        return comm_s(hw, kind, dp, world, span, bytes, calls);
    const int N = dp / k;
    const double factor = kind == TERA_HW_ALLREDUCE ? 2.0 : 1.0;
    const double G = bytes / (factor * ring(dp));
    const double t_in = factor * ring(k) * G / hw->intra_bw + calls * factor * (k - 1) * hw->intra_lat;
    const double t_x = factor * ring(N) * G / k / hw->inter_bw + calls * factor * (N - 1) * hw->inter_lat;
    return t_in + t_x;
}

/* One micro-batch on one stage: the products and attention (forward + backward, and the forward
 * recomputation adds), and the element-wise passes' bytes. */
typedef struct {
    double mm, mm_rec;       /* seconds */
    double bytes, bytes_rec; /* bytes through memory */
} stage_work;

static void stage_work_of(const tera_config *cfg, const tera_hw *hw, const tera_plan_opts *o, const tera_plan_stage *st,
                          int has_head, int threads, stage_work *w) {
    const tera_model_config *c = &cfg->model;
    const tera_parallel_config *p = &cfg->parallel;
    const int tp = p->tp, ep = p->ep, B = cfg->training.micro_batch, T = cfg->training.seq_len;
    const tera_hw_prec prec = o->products_prec >= 0 && o->products_prec < TERA_HW_NPREC ? (tera_hw_prec)o->products_prec
                                                                                       : tera_hw_prec_of(cfg->training.precision);
    const tera_hw_prec aprec = tera_hw_prec_of(cfg->training.precision); /* attention: the run's own precision */
    const int64_t N = (int64_t)B * T, D = c->dim, hd = c->dim / c->n_heads, Hl = c->n_heads / tp;
    const int64_t Hkvl = c->n_kv_heads / tp, Fl = c->ffn_dim / tp, Fsl = (int64_t)c->n_shared_experts * c->ffn_dim / tp;
    const int64_t Fdl = c->dense_ffn_dim / tp, Vl = c->vocab_size / tp, E = c->n_experts, K = c->top_k;
    const double e = o->efficiency;
#define MM(m, k, n) (6.0 * (double)(m) * (double)(k) * (double)(n) / tera_hw_gemm_rate(hw, threads, prec, (m), (k), (n), e))
    /* attention block: q, k, v, o products and the kernel */
    const double t_proj = MM(N, D, Hl * hd) + 2.0 * MM(N, D, Hkvl * hd) + MM(N, Hl * hd, D);
    const double t_core = 12.0 * (double)N * T * Hl * hd / tera_hw_attn_rate(hw, threads, aprec, B, T, (int)Hl, (int)Hkvl,
                                                                            (int)hd, e);
    /* FFNs: dense; MoE = router (fp32) + El experts over their rows + shared experts */
    const double t_dense = Fdl > 0 ? 2.0 * MM(N, D, Fdl) + MM(N, Fdl, D) : 0.0;
    const int64_t El = E / ep;
    int64_t r = E > 0 ? (N * K * ep + E - 1) / E : 0; /* rows per local expert, uniform routing */
    if (c->capacity_factor > 0.0f && E > 0) {
        const int64_t cap = (int64_t)ceil((double)c->capacity_factor * T * K / E) * B * ep;
        if (cap < r) r = cap;
    }
    const double t_exp_hidden = r > 0 ? (double)El * 2.0 * MM(r, D, Fl) : 0.0;
    const double t_exp = r > 0 ? t_exp_hidden + (double)El * MM(r, Fl, D) : 0.0;
    const double t_router = E > 0 ? 6.0 * (double)N * D * E / tera_hw_gemm_rate(hw, threads, TERA_HW_FP32, N, D, E, e)
                                  : 0.0;
    const double t_shared = Fsl > 0 ? 2.0 * MM(N, D, Fsl) + MM(N, Fsl, D) : 0.0;
    const double t_shared_hidden = Fsl > 0 ? 2.0 * MM(N, D, Fsl) : 0.0;
    const double t_dense_hidden = Fdl > 0 ? 2.0 * MM(N, D, Fdl) : 0.0;
    /* element-wise forward bytes of a layer: 2 norms, rope on q and k, 2 residual adds; SwiGLU;
     * MoE: router probabilities, gather and combine of the routed rows */
    const double b_base = 2.0 * 8.0 * N * D + 8.0 * N * (Hl + Hkvl) * hd + 2.0 * 12.0 * N * D;
    const double b_dense_glu = 12.0 * N * Fdl;
    const double b_moe_glu = 12.0 * (double)N * K * Fl + 12.0 * N * Fsl;
    const double b_moe = 12.0 * N * E + 8.0 * N * K * D + 4.0 * N * K * D + 4.0 * N * D;
    const int dense = st->layers - st->moe_layers, moe = st->moe_layers;
    const double fb_dense = t_proj + t_core + t_dense, fb_moe = t_proj + t_core + t_router + t_exp + t_shared;
    w->mm = dense * fb_dense + moe * fb_moe;
    /* recomputation: the forward again (a third of forward + backward) of what each policy drops */
    w->mm_rec = (st->full[0] * fb_dense + st->full[1] * fb_moe) / 3.0 +
                (st->selective[0] * (t_core + t_dense_hidden) + st->selective[1] * (t_core + t_exp_hidden + t_shared_hidden)) /
                    3.0;
    const double fwd_dense = b_base + b_dense_glu, fwd_moe = b_base + b_moe_glu + b_moe;
    w->bytes = 3.0 * (dense * fwd_dense + moe * fwd_moe); /* backward: about twice the forward's traffic */
    w->bytes_rec = st->full[0] * fwd_dense + st->full[1] * fwd_moe + st->selective[0] * b_dense_glu +
                   st->selective[1] * b_moe_glu;
    if (has_head) {
        w->mm += MM(N, D, Vl);
        w->bytes += 16.0 * N * Vl + 3.0 * 8.0 * N * D; /* cross-entropy over the logits; the final norm */
    }
#undef MM
}

tera_status tera_plan_time_model_stages(const tera_config *cfg, const tera_hw *hw, const tera_plan_opts *o,
                                        const tera_plan_stage *st, double makespan, double bubble,
                                        tera_plan_time *out) {
    const tera_model_config *c = &cfg->model;
    const tera_parallel_config *p = &cfg->parallel;
    const int T = cfg->training.seq_len, A = cfg->training.grad_accum, pp = p->pp, tp = p->tp, dp = p->dp,
              ep = p->ep, L = c->n_layers;
    const int zero = dp > 1 ? p->zero : 0, edp = dp / ep;
    const double N = (double)cfg->training.micro_batch * T, D = c->dim;
    const double peak = hw->peak_flops[tera_hw_prec_of(cfg->training.precision)];
    memset(out, 0, sizeof *out);
    if (peak <= 0)
        return tera_fail(TERA_ERR_CONFIG, "hardware '%s' has no peak for training.precision = %s", hw->name,
                         cfg->training.precision);
    const int64_t devices = (int64_t)pp * dp * tp;
    /* threads per rank (the measured rates are by thread count); ranks x threads beyond the
     * machine's cores share them (a CPU machine running several ranks) */
    const int threads = cfg->training.threads > 0 ? cfg->training.threads : hw->cores > 0 ? hw->cores : 1;
    double share = 1.0;
    if (hw->cores > 0) {
        const int64_t on_node = devices < hw->devices_per_node ? devices : hw->devices_per_node;
        if ((double)on_node * threads > hw->cores) share = (double)on_node * threads / hw->cores;
    }
    const double bw_mem = mem_bw_of(hw, threads);
    const double xb = o->exchange_bytes > 0 ? o->exchange_bytes : 4.0;
    const double hide_comm = o->comm_overlap > 0 ? (o->comm_overlap < 1 ? o->comm_overlap : 1.0) : 0.0;
    const double hide_ep = o->exchange_overlap > 0 ? (o->exchange_overlap < 1 ? o->exchange_overlap : 1.0) : 0.0;
    out->flops_per_step = tera_model_flops_per_token(c, T) * N * A * dp;
    double worst_u = 0.0, u_tp = 0, u_ep = 0, u_pp = 0, u_comp = 0, u_mm = 0, u_mem = 0, rec_all = 0.0;
    int worst = 0;
    for (int s = 0; s < pp; s++) {
        const int layers = st[s].layers, moe = st[s].moe_layers;
        const int has_head = s == pp - 1;
        stage_work w;
        stage_work_of(cfg, hw, o, &st[s], has_head, threads, &w);
        const double mm = (w.mm + w.mm_rec) * share;
        const double mem = bw_mem > 0 ? (w.bytes + w.bytes_rec) / bw_mem * share : 0.0;
        const double comp = mm + mem;
        /* recomputation FLOPs (reported): the forward of the recomputed layers, by policy */
        {
            const double hd = D / c->n_heads, attn_core = 4.0 * D * T;
            const double fwd_dense = 2.0 * (2.0 * D * c->n_heads * hd + 2.0 * D * c->n_kv_heads * hd +
                                            3.0 * D * c->dense_ffn_dim) + attn_core;
            const double fwd_moe = 2.0 * (2.0 * D * c->n_heads * hd + 2.0 * D * c->n_kv_heads * hd + (double)c->n_experts * D +
                                          c->top_k * 3.0 * D * c->ffn_dim + 3.0 * D * c->ffn_dim * c->n_shared_experts) +
                                   attn_core;
            const double sel_dense = attn_core + 4.0 * D * c->dense_ffn_dim;
            const double sel_moe = attn_core + (c->top_k + (double)c->n_shared_experts) * 4.0 * D * c->ffn_dim;
            rec_all += (st[s].full[0] * fwd_dense + st[s].full[1] * fwd_moe + st[s].selective[0] * sel_dense +
                        st[s].selective[1] * sel_moe) * N * A * dp;
        }
        /* tensor parallelism: bench-dist's tp_bytes per micro-batch (all-reduces) */
        double ttp = 0.0;
        if (tp > 1) {
            const double floats = 4.0 * layers * N * D + (s == 0 ? N * D : 0.0) + (has_head ? N * D + 3.0 * N : 0.0) +
                                  moe * N * c->top_k;
            const double bytes = 2.0 * ring(tp) * 4.0 * floats;
            const double n_ar = 4.0 * layers + (s == 0) + (has_head ? 3.0 : 0.0) + moe;
            ttp = (1.0 - hide_comm) * comm_s(hw, TERA_HW_ALLREDUCE, tp, devices, tp, bytes, n_ar);
            if (s == 0 || bytes * A > out->bytes_tp) out->bytes_tp = bytes * A;
        }
        /* expert exchange: bench-dist's ep_bytes per micro-batch (uniform routing; rows out and back,
         * forward and backward) at exchange_bytes per element; the hidden fraction overlaps compute */
        double tep = 0.0;
        if (ep > 1 && moe > 0) {
            const double bytes = moe * 4.0 * ring(ep) * N * c->top_k * D * xb;
            tep = (1.0 - hide_ep) * comm_s(hw, TERA_HW_ALLTOALL, ep, devices, (int64_t)ep * tp, bytes, moe * 5.0);
            if (bytes * A > out->bytes_ep) out->bytes_ep = bytes * A;
        }
        /* pipeline sends: bench-dist's pp_bytes per micro-batch */
        double tpp = 0.0;
        if (pp > 1) {
            const double bytes = st[s].sends * N * D * 4.0;
            tpp = comm_s(hw, TERA_HW_P2P, 2, devices, (int64_t)pp * dp * tp, bytes, st[s].sends);
            if (bytes * A > out->bytes_pp) out->bytes_pp = bytes * A;
        }
        const double u = comp + ttp + tep + tpp;
        if (s == 0 || u > worst_u)
            worst_u = u, worst = s, u_tp = ttp, u_ep = tep, u_pp = tpp, u_comp = comp, u_mm = mm, u_mem = mem;
    }
    out->recompute_flops = rec_all;
    /* the schedule: makespan in forward units (a micro-batch's work = 3 units) */
    const double pipe = makespan / 3.0 * worst_u;
    /* the optimizer on the busiest stage's rank: Adam reads parameter, gradient and both moments and
     * writes three (its shard under ZeRO); zeroing and the norm pass touch every gradient once each */
    const tera_plan_stage *w = &st[worst];
    const double opt_floats = (double)w->mem.bytes[TERA_PM_OPTIMIZER] / 8.0;
    const double t_opt = bw_mem > 0 ? (28.0 * opt_floats + 8.0 * (double)w->n_floats) / bw_mem * share : 0.0;
    out->matmul_s = A * u_mm;
    out->memory_s = A * u_mem + t_opt;
    out->compute_s = A * u_comp + t_opt;
    out->tp_s = A * u_tp, out->ep_s = A * u_ep, out->pp_s = A * u_pp;
    out->bubble_s = pipe - A * worst_u;
    out->bubble_frac = pp > 1 ? bubble : 0.0;
    /* data parallelism over dp (non-expert) and edp (experts), the stage's ranks: bench-dist's grad_bytes
     * and zero3_gather_bytes; one group of dp x tp ranks */
    const double nd = (double)w->n_dense, nx = (double)(w->n_floats - w->n_dense);
    const double pass = 4.0 * (ring(dp) * nd + ring(edp) * nx);
    const double groups = w->layers + (worst == 0) + (worst == pp - 1);
    double t_dp = 0.0, exposed = 0.0;
    const double t_bwd = 2.0 / 3.0 * u_comp; /* one micro-batch's backward on the stage */
    const int hier = cfg->parallel.hierarchical;
    if (dp > 1) {
        if (zero == 0) { /* buckets, one all-reduce per group, during the last micro-batch's backward */
            out->bytes_dp = 2.0 * pass;
            t_dp = dp_comm_s(hw, TERA_HW_ALLREDUCE, dp, tp, devices, out->bytes_dp, 2.0 * groups, hier);
            exposed = t_dp > t_bwd ? t_dp - t_bwd : 0.0;
        } else if (zero == 1) { /* one reduce-scatter and one all-gather after the last backward */
            out->bytes_dp = 2.0 * pass;
            t_dp = dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, out->bytes_dp, 4.0, hier);
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
            const double t_rs = dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, rs, A * groups * 2.0, hier);
            const double t_rest = dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, ag + gather, 2.0 + 2.0 * n_gathers, hier);
            t_dp = t_rs + t_rest;
            const double hide_rs = A * t_bwd, hide_g = A * u_comp;
            exposed = (t_rs > hide_rs ? t_rs - hide_rs : 0.0);
            if (zero >= 3) exposed += t_rest > hide_g ? t_rest - hide_g : 0.0;
            else exposed += t_rest;
        }
    }
    out->dp_total_s = t_dp;
    out->dp_s = (1.0 - hide_comm) * exposed;
    exposed = out->dp_s;
    out->step_s = pipe + t_opt + exposed;
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
                                if (tera_plan_time_model_stages(c, hw, o, st, makespan, bubble, &cand.time) != TERA_OK ||
                                    !isfinite(cand.time.step_s) || !(cand.time.step_s > 0))
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
