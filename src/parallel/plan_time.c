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
 *   ZeRO-1: reduce-scatters of the same buckets; ZeRO-3: prefetched gathers during compute); the
 *   parameter all-gather of ZeRO-1/2 after the update is exposed;
 * - the expert exchange flat or in two stages (parallel.ep_hierarchical), parallel.ep_overlap's
 *   hidden part of the flat one (tera_plan_ep_overlap_hidden); 1-bit Adam's momentum all-reduce;
 * - a host with [node] cores (a CPU machine): ranks computing at once there each get the measured
 *   [shared] fraction of their rate alone (tera_hw_shared), and transfers hide behind nothing;
 * - pipeline: the schedule's simulated makespan (tera_schedule_simulate, backward = 2 x forward)
 *   times the busiest stage's time per micro-batch; on a host whose cores the ranks share, a
 *   processor-sharing simulation of the schedule (shared_pipeline). */
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "plan_internal.h"
#include "tera/compress.h"
#include "tera/model.h"
#include "tera/precision.h"
#include "tera/schedule.h"

/* ------------------------------------------------------------------ hardware */
const char *const tera_hw_prec_name[TERA_HW_NPREC] = {"fp32", "bf16", "fp16", "fp8"};
const char *const tera_hw_coll_name[TERA_HW_NCOLL] = {"allreduce", "allgather", "alltoall", "p2p", "shared_sum"};

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
/* Fields of a point line: n numbers (field prec_at a precision name instead, -1: none), each finite
 * and >= 0; the fields in the bit mask `counts` (threads, ranks, shapes) whole and at most
 * HW_MAX_COUNT, so that they convert to int and their products stay far from overflow (a thread
 * count of 2^32 became INT_MIN and indexed before an array). */
#define HW_MAX_COUNT 16777216.0
#define HW_COUNTS_NOTE " (counts whole, at most 16777216)"
static int parse_point(const char *value, double *x, int n, int prec_at, tera_hw_prec *prec, unsigned counts) {
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
        if ((counts >> i & 1u) && (x[i] != floor(x[i]) || x[i] > HW_MAX_COUNT)) return 0;
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
        if (!parse_point(value, x, 6, 1, &p, 0x1du) || x[0] < 1 || x[2] < 1 || x[3] < 1 || x[4] < 1 || x[5] <= 0) {
            snprintf(c->err, sizeof c->err, "[gemm] point = '%.200s' is not THREADS PREC M K N GFLOP/S" HW_COUNTS_NOTE, value);
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
        if (!parse_point(value, x, 7, -1, NULL, 0x3fu) || x[0] < 1 || x[1] < 1 || x[2] < 1 || x[3] < 1 || x[4] < 1 ||
            x[5] < 1 || x[6] <= 0) {
            snprintf(c->err, sizeof c->err, "[attention] point = '%.200s' is not THREADS B T H HKV HD GFLOP/S" HW_COUNTS_NOTE, value);
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
        if (!parse_point(value, x, 2, -1, NULL, 0x1u) || x[0] < 1 || x[1] <= 0) {
            snprintf(c->err, sizeof c->err, "[memory] point = '%.200s' is not THREADS GBYTES/S" HW_COUNTS_NOTE, value);
            return 0;
        }
        const int t = (int)x[0];
        if (t < (int)(sizeof h->mem_bw_threads / sizeof h->mem_bw_threads[0])) h->mem_bw_threads[t] = x[1] * 1e9;
        return 1;
    }
    if (!strcmp(section, "shared") && !strcmp(name, "point")) { /* RANKS THREADS COMPUTE MEMORY */
        double x[4];
        if (!parse_point(value, x, 4, -1, NULL, 0x3u) || x[0] < 2 || x[1] < 1 || x[2] <= 0 || x[2] > 1.5 || x[3] <= 0 ||
            x[3] > 1.5) {
            snprintf(c->err, sizeof c->err, "[shared] point = '%.200s' is not RANKS (>= 2) THREADS COMPUTE MEMORY "
                     "(fractions of the rate alone, in (0, 1.5])" HW_COUNTS_NOTE, value);
            return 0;
        }
        int at = -1;
        for (int i = 0; i < h->n_share && at < 0; i++)
            if (h->share[i].ranks == (int)x[0] && h->share[i].threads == (int)x[1]) at = i;
        if (at < 0) {
            if (h->n_share == TERA_HW_MAX_SHARE) {
                snprintf(c->err, sizeof c->err, "more than %d [shared] points", TERA_HW_MAX_SHARE);
                return 0;
            }
            at = h->n_share++;
        }
        h->share[at] = (tera_hw_share){.ranks = (int)x[0], .threads = (int)x[1], .compute = x[2], .memory = x[3]};
        return 1;
    }
    if (!strcmp(section, "collective")) {
        for (int k = 0; k < TERA_HW_NCOLL; k++)
            if (!strcmp(name, tera_hw_coll_name[k])) {
                double x[3];
                if (!parse_point(value, x, 3, -1, NULL, 0x1u) || x[0] < 2 || x[2] <= 0) {
                    snprintf(c->err, sizeof c->err, "[collective] %s = '%.200s' is not RANKS LATENCY_US GBYTES/S" HW_COUNTS_NOTE,
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
            /* 0 (unknown) or within what a device can be: 1e308 GiB made every layout fit, 1e-300 TFLOP/s
             * an infinite time */
            const double most = !strcmp(name, "gemm_efficiency") ? 1.0 : 1e6;
            if (v != 0.0 && !(v >= 1e-6 && v <= most)) {
                snprintf(c->err, sizeof c->err, "[%.64s] %.64s = '%.200s' is outside [1e-06, %g] (0: unknown)", section,
                         name, value, most);
                return 0;
            }
            *keys[i].dst = v * keys[i].scale;
            c->seen |= keys[i].bit;
            return 1;
        }
    snprintf(c->err, sizeof c->err, "unknown key [%.64s] %.64s (keys: [device] name, memory_gib, peak_tflops_fp32, "
             "peak_tflops_bf16, peak_tflops_fp16, peak_tflops_fp8, memory_bandwidth_gbytes_s, gemm_efficiency; [node] "
             "devices, cores; [intra_node], [inter_node] bandwidth_gbytes_s, latency_us; [gemm], [attention], [memory] "
             "point; [collective] allreduce, allgather, alltoall, p2p, shared_sum; [shared] point)", section, name);
    return 0;
}

tera_status tera_hw_load(tera_hw *hw, const char *path) {
    memset(hw, 0, sizeof *hw);
    hw_ctx c = {.hw = hw, .path = path};
    FILE *f = fopen(path, "r");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot open hardware description '%s': %s", path, strerror(errno));
    struct stat sb; /* a directory opens, then reads as an empty file */
    if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fclose(f);
        return tera_fail(TERA_ERR_IO, "cannot read hardware description '%s': %s", path, strerror(EISDIR));
    }
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
    /* each core's throughput with all cores busy in one process against one core alone: the products
     * of the shapes measured at both thread counts (median ratio), and the streaming bandwidth */
    const int C = hw->cores;
    if (C > 1) {
        double r[TERA_HW_MAX_GEMM];
        int n = 0;
        for (int i = 0; i < hw->n_gemm; i++) {
            const tera_hw_gemm *a = &hw->gemm[i];
            if (a->threads != 1) continue;
            for (int j = 0; j < hw->n_gemm; j++) {
                const tera_hw_gemm *b = &hw->gemm[j];
                if (b->threads == C && b->prec == a->prec && b->m == a->m && b->k == a->k && b->n == a->n) {
                    r[n++] = b->flops_s / (C * a->flops_s);
                    break;
                }
            }
        }
        if (n > 0) {
            for (int i = 1; i < n; i++)
                for (int j = i; j > 0 && r[j] < r[j - 1]; j--) {
                    const double u = r[j]; r[j] = r[j - 1], r[j - 1] = u;
                }
            hw->all_cores[0] = n % 2 ? r[n / 2] : 0.5 * (r[n / 2 - 1] + r[n / 2]);
        }
        if (C < (int)(sizeof hw->mem_bw_threads / sizeof hw->mem_bw_threads[0]) && hw->mem_bw_threads[1] > 0 &&
            hw->mem_bw_threads[C] > 0)
            hw->all_cores[1] = hw->mem_bw_threads[C] / (C * hw->mem_bw_threads[1]);
        for (int k = 0; k < 2; k++)
            if (hw->all_cores[k] > 1.5) hw->all_cores[k] = 1.5; /* noise: no more than that from more cores */
    }
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
    if (hw->n_share)
        fprintf(f, "\n# ranks sharing the node, all computing at once: each one's rate as a fraction of its rate alone: "
                   "RANKS THREADS COMPUTE MEMORY\n[shared]\n");
    for (int i = 0; i < hw->n_share; i++) {
        const tera_hw_share *q = &hw->share[i];
        fprintf(f, "point = %d %d %.4g %.4g\n", q->ranks, q->threads, q->compute, q->memory);
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

double tera_hw_shared(const tera_hw *hw, int ranks, int threads, int memory) {
    if (hw->cores <= 0 || ranks <= 1) return 1.0;
    if (threads < 1) threads = 1;
    int t = 0; /* the measured thread count nearest `threads` */
    for (int i = 0; i < hw->n_share; i++)
        if (!t || abs(hw->share[i].threads - threads) < abs(t - threads)) t = hw->share[i].threads;
    if (!t) { /* one process's throughput on all cores (1 when unknown), shared out */
        const double C = hw->cores, a = hw->all_cores[memory ? 1 : 0] > 0 && C > 1 ? hw->all_cores[memory ? 1 : 0] : 1.0;
#define S_OF(W) ((W) <= C ? 1.0 + ((W) - 1.0) * (a - 1.0) / (C > 1 ? C - 1.0 : 1.0) : C * a / (W))
        const double f = S_OF((double)ranks * threads) / S_OF((double)threads);
#undef S_OF
        return f < 1.0 ? f : 1.0;
    }
    double xs[TERA_HW_MAX_SHARE + 1], ys[TERA_HW_MAX_SHARE + 1];
    int n = 0;
    xs[n] = 1.0, ys[n++] = 1.0;
    for (int i = 0; i < hw->n_share; i++)
        if (hw->share[i].threads == t) xs[n] = hw->share[i].ranks, ys[n++] = memory ? hw->share[i].memory : hw->share[i].compute;
    for (int i = 1; i < n; i++) /* by ranks (distinct: the loader keeps one point per (ranks, threads)) */
        for (int j = i; j > 0 && xs[j] < xs[j - 1]; j--) {
            double u = xs[j]; xs[j] = xs[j - 1], xs[j - 1] = u;
            u = ys[j]; ys[j] = ys[j - 1], ys[j - 1] = u;
        }
    const double r = ranks;
    if (r >= xs[n - 1]) { /* beyond the largest count measured: the node's throughput at that count */
        const double fmax = ys[n - 1];
        if (xs[n - 1] * t >= hw->cores) return fmax * xs[n - 1] / r;
        const double f = (double)hw->cores / (r * threads);
        return f < fmax ? f : fmax;
    }
    int i = 1;
    while (xs[i] < r) i++;
    return ys[i - 1] + (r - xs[i - 1]) / (xs[i] - xs[i - 1]) * (ys[i] - ys[i - 1]);
}

/* ------------------------------------------------------------------ time model */
static double ring(int p) { return p > 1 ? (double)(p - 1) / (double)p : 0.0; }

/* ZeRO-3's parameter gathers of a stage over a step of A micro-batches: each layer twice per
 * micro-batch (forward, backward), the embedding and head groups once a step; bytes received per rank
 * (non-expert ranges over dp, expert ranges over edp), the number of gathers in *n, and in *piece the
 * bytes of this rank's own pieces of them (what it writes where the gathers are in host-shared memory). */
static double zero3_gathers(const tera_plan_stage *w, int L, int A, int dp, int edp, double *n, double *piece) {
    double bytes = 0.0;
    *n = *piece = 0.0;
    if (!w->group) return 0.0;
    for (int g = -2; g < L; g++) {
        const double nd = w->group[2 * (g + 2)], nx = w->group[2 * (g + 2) + 1];
        const double sz = 4.0 * (ring(dp) * nd + ring(edp) * nx);
        if (sz <= 0) continue;
        const double uses = g < 0 ? 1.0 : 2.0 * A;
        bytes += uses * sz, *n += uses;
        *piece += uses * 4.0 * (nd / dp + (edp > 1 ? nx / edp : 0.0)); /* this rank's piece of each gather */
    }
    return bytes;
}

/* ZeRO's gradient sums and ZeRO-3's gathers in host-shared memory (src/parallel/zero.c, "on one host")
 * where a data-parallel group's ranks share a CPU host: `traffic` bytes one rank reads and writes in
 * `calls` operations, at the calibrated shared_sum fit (the world size nearest the job's); -1 where the
 * hardware file has none (the collectives through the segment are priced instead). */
static double shared_s(const tera_hw *hw, int64_t world, double traffic, double calls) {
    const tera_hw_coll *best = NULL;
    for (int i = 0; i < hw->n_coll; i++) {
        const tera_hw_coll *c = &hw->coll[i];
        if (c->kind == TERA_HW_SHARED_SUM && (!best || llabs(c->ranks - world) < llabs(best->ranks - world))) best = c;
    }
    return best ? calls * best->alpha_s + traffic / best->beta_bytes_s : -1.0;
}

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

/* The expert exchange of one MoE layer and micro-batch: four transfers (tokens out and results back,
 * forward and backward), each of the `rows` bytes a rank routes (N k D x bytes per element), and a
 * counts exchange. Flat (the point-to-point exchange): the rows for the ep - 1 peers, (ep-1)/ep of them,
 * priced by comm_s over the group's span (ep x tp consecutive world ranks), 5 calls. parallel.
 * ep_hierarchical with the group over N > 1 nodes of k > 1 members (k = devices_per_node / tp, N k =
 * ep): src/comm/comm_hier.c's two stages in sequence, per transfer inside the node (k-1)/k of the rows
 * (k-1 messages) then between nodes (N-1)/N (N-1 messages, one per rail and node pair), each on its own
 * link; the counts take one latency of each stage. *sent: the bytes one rank sends. */
static double ep_layer_s(const tera_hw *hw, int ep, int tp, int64_t world, double rows, int hierarchical, double *sent) {
    *sent = 0.0;
    if (ep <= 1) return 0.0;
    const int64_t span = (int64_t)ep * tp;
    const int k = tp > 0 && hw->devices_per_node % tp == 0 ? hw->devices_per_node / tp : 1;
    if (!hierarchical || span <= hw->devices_per_node || k < 2 || ep % k != 0) {
        *sent = 4.0 * ring(ep) * rows;
        return comm_s(hw, TERA_HW_ALLTOALL, ep, world, span, *sent, 5.0);
    }
    const int N = ep / k;
    const double t1 = ring(k) * rows / hw->intra_bw + (k - 1) * hw->intra_lat;
    const double t2 = ring(N) * rows / hw->inter_bw + (N - 1) * hw->inter_lat;
    *sent = 4.0 * (ring(k) + ring(N)) * rows;
    return 4.0 * (t1 + t2) + (k - 1) * hw->intra_lat + (N - 1) * hw->inter_lat;
}

double tera_plan_ep_overlap_hidden(int ep, double x, double c, double sf, double sb) {
    if (ep <= 1 || x <= 0) return 0.0;
    double hidden = 0.0;
    for (int dir = 0; dir < 2; dir++) {
        const double cd = dir ? 2.0 / 3.0 * c : c / 3.0, sd = dir ? sb : sf;
        const double own = sd + cd / ep;
        const double first = own > x ? own : x; /* side work and own block computed; the others all arrived */
        const double done = first + cd * (ep - 1) / ep + x / (ep - 1);
        hidden += 2.0 * x + sd + cd - done;
    }
    return hidden;
}

/* One micro-batch on one stage: the products and attention (forward + backward, and the forward
 * recomputation adds), and the element-wise passes' bytes. */
typedef struct {
    double mm, mm_rec;       /* seconds */
    double mm_head_w;        /* of mm: the LM head's weight-gradient product (parallel.pp_defer_wgrad moves it) */
    double bytes, bytes_rec; /* bytes through memory */
    double t_exp;            /* of mm: one MoE layer's routed experts */
    double t_sh_f, t_sh_b;   /* of mm: one MoE layer's shared experts, the forward's hidden activations and the
                                backward (the dispatcher's side work: tera_plan_ep_overlap_hidden) */
} stage_work;

static void stage_work_of(const tera_config *cfg, const tera_hw *hw, const tera_plan_opts *o, const tera_plan_stage *st,
                          int has_head, double head_rows, int threads, stage_work *w) {
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
    const double b_base = 8.0 * N * (Hl + Hkvl) * hd + (p->sequence_parallel && tp > 1
                                                            /* this rank's rows: the norms, the residual adds, the
                                                             * copies out of the partial sums and of the kept rows */
                                                            ? (2.0 * 8.0 * N * D + 2.0 * 12.0 * N * D + 4.0 * 8.0 * N * D) / tp
                                                            : 2.0 * 8.0 * N * D + 2.0 * 12.0 * N * D);
    const double b_dense_glu = 12.0 * N * Fdl;
    const double b_moe_glu = 12.0 * (double)N * K * Fl + 12.0 * N * Fsl;
    const double b_moe = 12.0 * N * E + 8.0 * N * K * D + 4.0 * N * K * D + 4.0 * N * D;
    const int dense = st->layers - st->moe_layers, moe = st->moe_layers;
    const double fb_dense = t_proj + t_core + t_dense, fb_moe = t_proj + t_core + t_router + t_exp + t_shared;
    w->mm = dense * fb_dense + moe * fb_moe;
    w->mm_head_w = 0.0;
    /* recomputation: the forward again (a third of forward + backward) of what each policy drops */
    w->mm_rec = (st->full[0] * fb_dense + st->full[1] * fb_moe) / 3.0 +
                (st->selective[0] * (t_core + t_dense_hidden) + st->selective[1] * (t_core + t_exp_hidden + t_shared_hidden)) /
                    3.0;
    w->t_exp = t_exp;
    w->t_sh_f = t_shared_hidden / 3.0, w->t_sh_b = 2.0 * t_shared / 3.0;
    const double fwd_dense = b_base + b_dense_glu, fwd_moe = b_base + b_moe_glu + b_moe;
    w->bytes = 3.0 * (dense * fwd_dense + moe * fwd_moe); /* backward: about twice the forward's traffic */
    w->bytes_rec = st->full[0] * fwd_dense + st->full[1] * fwd_moe + st->selective[0] * b_dense_glu +
                   st->selective[1] * b_moe_glu;
    if (head_rows > 0.0) { /* the stage's share of the head's vocabulary rows (parallel.pp_head_split: half) */
        const int64_t Vs = (int64_t)((double)Vl * head_rows);
        w->mm += MM(N, D, Vs);
        w->mm_head_w = MM(N, D, Vs) / 3.0; /* one of its three products */
        w->bytes += 16.0 * N * Vs; /* cross-entropy over the logits */
    }
    if (has_head) w->bytes += 3.0 * 8.0 * N * D; /* the final norm */
#undef MM
}

/* The pipeline on a host whose ranks share its cores ([node] cores): the schedule's operations in
 * order (tera_schedule_build), each starting when its rank is free and its inputs exist (as
 * tera_schedule_simulate), a forward costing a third and a backward two thirds of the stage's
 * micro-batch over its v chunks: first its compute (products mm[s] and memory passes mem[s], seconds
 * at the rate alone), then its communication x[s] (seconds, measured with all ranks at once: not
 * scaled). While n stages compute, each of their `group` ranks on the node runs its products at
 * tera_hw_shared(n group, threads, 0) and its memory passes at (.., 1) of the rate alone: a stage in
 * its bubble or waiting for a transfer leaves its cores to the others (processor sharing).
 * parallel.pp_defer_wgrad: dw[s] (seconds alone, of mm[s]) of a micro-batch's work is the head's weight
 * gradient, taken out of the stage's backwards and queued: the last stage runs its queue after its last
 * operation, the others (the head split's first stage) a micro-batch's product at a time whenever their
 * next operation is not ready (pipeline.c). *makespan: seconds from the first forward to the last
 * backward or deferred product. */
static tera_status shared_pipeline(const tera_config *cfg, const tera_hw *hw, int threads, double group, const double *mm,
                                   const double *mem, const double *x, const double *dw, double *makespan) {
    const int pp = cfg->parallel.pp, A = cfg->training.grad_accum, v = pp > 1 ? cfg->parallel.pp_chunks : 1;
    tera_sched_kind kind;
    TERA_TRY(tera_sched_kind_parse(cfg->parallel.pp_schedule, &kind));
    tera_schedule sc;
    TERA_TRY(tera_schedule_build(&sc, kind, pp, A, v));
    const int V = pp * v, nops = sc.n_ops;
    double *fin_f = tera_malloc(sizeof(double) * (size_t)A * V), *fin_b = tera_malloc(sizeof(double) * (size_t)A * V);
    for (int i = 0; i < A * V; i++) fin_f[i] = fin_b[i] = NAN;
    double *rem = tera_calloc((size_t)pp, sizeof(double)), *xk = tera_calloc((size_t)pp, sizeof(double));
    double *cend = tera_calloc((size_t)pp, sizeof(double)), *fc = tera_calloc((size_t)pp + 1, sizeof(double));
    double *fm = tera_calloc((size_t)pp + 1, sizeof(double));
    int *next = tera_calloc((size_t)pp, sizeof(int)), *phase = tera_calloc((size_t)pp, sizeof(int)); /* 0 idle, 1 compute, 2 transfer */
    double *pend = tera_calloc((size_t)pp, sizeof(double)); /* deferred seconds queued */
    int *dphase = tera_calloc((size_t)pp, sizeof(int));     /* the compute under way is a deferred product */
    int queued = 0;                                         /* stages with pend > 0 or a deferred product running */
    for (int n = 1; n <= pp; n++) {
        const int ranks = (int)ceil(n * group - 1e-9);
        fc[n] = tera_hw_shared(hw, ranks, threads, 0);
        fm[n] = tera_hw_shared(hw, ranks, threads, 1);
    }
    tera_status rc = TERA_OK;
    double t = 0.0;
    for (int done = 0; done < pp * nops || queued;) {
        for (int r = 0; r < pp; r++) { /* start what is ready */
            if (phase[r]) continue;
            if (next[r] < nops) {
                const tera_sched_op *op = tera_schedule_rank(&sc, r) + next[r];
                const int vs = op->chunk * pp + r, idx = op->micro * V + vs;
                int ready;
                if (op->kind == TERA_OP_FWD) ready = vs == 0 || !isnan(fin_f[op->micro * V + vs - 1]);
                else ready = !isnan(fin_f[idx]) && (vs == V - 1 || !isnan(fin_b[op->micro * V + vs + 1]));
                if (ready) {
                    const double k = (op->kind == TERA_OP_FWD ? 1.0 : 2.0) / (3.0 * v);
                    rem[r] = (mm[r] + mem[r]) * k, xk[r] = x[r] * k;
                    if (op->kind != TERA_OP_FWD && dw[r] > 0) /* the head's weight gradient queued */
                        rem[r] -= dw[r] / v, pend[r] += dw[r] / v;
                    phase[r] = rem[r] > 0 ? 1 : 2;
                    cend[r] = t + xk[r];
                    continue;
                }
                if (r == pp - 1) continue; /* the last stage keeps its queue for the end */
            }
            if (pend[r] > 1e-15) { /* a wait (or the end): one micro-batch's deferred product */
                rem[r] = pend[r] < dw[r] ? pend[r] : dw[r], xk[r] = 0.0;
                pend[r] -= rem[r];
                phase[r] = 1, dphase[r] = 1;
            }
        }
        int n = 0;
        for (int r = 0; r < pp; r++) n += phase[r] == 1;
        /* the next event: a compute part or a transfer ends */
        double dt = INFINITY;
        int first = -1;
        for (int r = 0; r < pp; r++) {
            double d = INFINITY;
            if (phase[r] == 1) {
                const double w = mm[r] + mem[r];
                const double rate = w / (mm[r] / fc[n] + mem[r] / fm[n]); /* alone-seconds per second */
                d = rem[r] / rate;
            } else if (phase[r] == 2) {
                d = cend[r] - t;
            }
            if (d < dt) dt = d, first = r;
        }
        if (first < 0) {
            rc = tera_fail(TERA_ERR_NUMERIC, "%s schedule deadlocks in the shared-core simulation", cfg->parallel.pp_schedule);
            break;
        }
        if (dt < 0) dt = 0;
        t += dt;
        for (int r = 0; r < pp; r++) {
            if (phase[r] == 1) {
                const double w = mm[r] + mem[r], rate = w / (mm[r] / fc[n] + mem[r] / fm[n]);
                rem[r] -= dt * rate;
                if (r == first || rem[r] <= 1e-12 * w) rem[r] = 0.0, phase[r] = 2, cend[r] = t + xk[r];
            }
        }
        for (int r = 0; r < pp; r++) {
            if (phase[r] != 2 || cend[r] > t * (1.0 + 1e-12)) continue;
            if (dphase[r]) { /* a deferred product done */
                phase[r] = 0, dphase[r] = 0;
                continue;
            }
            const tera_sched_op *op = tera_schedule_rank(&sc, r) + next[r];
            const int idx = op->micro * V + op->chunk * pp + r;
            if (op->kind == TERA_OP_FWD) fin_f[idx] = t;
            else fin_b[idx] = t;
            phase[r] = 0, next[r]++, done++;
        }
        queued = 0;
        for (int r = 0; r < pp; r++) queued |= pend[r] > 1e-15 || dphase[r];
    }
    *makespan = t;
    free(fin_f), free(fin_b), free(rem), free(xk), free(cend), free(fc), free(fm), free(next), free(phase);
    free(pend), free(dphase);
    tera_schedule_free(&sc);
    return rc;
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
    /* threads per rank (the measured rates are by thread count). A host with [node] cores (a CPU
     * machine) runs its ranks on the same cores and memory: while n of its ranks compute at once, each
     * gets tera_hw_shared(n) of its rate alone; its transfers are copies by those same cores, so nothing
     * hides behind compute there. A device per rank (no cores key): nothing is shared. */
    const int threads = cfg->training.threads > 0 ? cfg->training.threads : hw->cores > 0 ? hw->cores : 1;
    const int cpu_host = hw->cores > 0;
    const int64_t on_node = devices < hw->devices_per_node ? devices : hw->devices_per_node;
    const double fc_all = tera_hw_shared(hw, (int)on_node, threads, 0), fm_all = tera_hw_shared(hw, (int)on_node, threads, 1);
    const double bw_mem = mem_bw_of(hw, threads);
    /* bytes an element of the expert exchange takes: --exchange-bytes, else tera's (the mean of the rows
     * out and their results back as the dispatcher encodes them: tera_exchange_row_bytes; the rows out
     * in bf16 under bf16 products) */
    double xb = o->exchange_bytes;
    if (!(xb > 0)) {
        const int kind = tera_compress_parse(cfg->parallel.a2a_compression);
        const int rows16 = tera_a2a_rows_bf16(cfg) && tera_hw_prec_of(cfg->training.precision) == TERA_HW_BF16;
        xb = 0.0;
        for (int back = 0; back < 2; back++)
            xb += (double)tera_exchange_row_bytes(tera_exchange_wire_kind(kind, rows16, back), c->dim) / (2.0 * c->dim);
    }
    const double hide_comm = o->comm_overlap > 0 ? (o->comm_overlap < 1 ? o->comm_overlap : 1.0) : 0.0;
    const double hide_ep = o->exchange_overlap > 0 ? (o->exchange_overlap < 1 ? o->exchange_overlap : 1.0) : 0.0;
    out->flops_per_step = tera_model_flops_per_token(c, T) * N * A * dp;
    double worst_u = 0.0, u_tp = 0, u_ep = 0, u_pp = 0, u_comp = 0, u_mm = 0, u_mem = 0, rec_all = 0.0;
    int worst = 0;
    double *s_mm = tera_calloc((size_t)pp, sizeof(double)), *s_mem = tera_calloc((size_t)pp, sizeof(double));
    double *s_x = tera_calloc((size_t)pp, sizeof(double)), *ep_hidden = tera_calloc((size_t)pp, sizeof(double));
    double *s_dw = tera_calloc((size_t)pp, sizeof(double)); /* parallel.pp_defer_wgrad: of s_mm, deferred */
    double worst_dw = 0.0;
    for (int s = 0; s < pp; s++) {
        const int layers = st[s].layers, moe = st[s].moe_layers;
        const int has_head = s == pp - 1;
        /* parallel.pp_head_split: the first and the last stage compute half the head each */
        const int split = pp > 1 && p->pp_head_split && (s == 0 || has_head);
        stage_work w;
        stage_work_of(cfg, hw, o, &st[s], has_head, split ? 0.5 : has_head ? 1.0 : 0.0, threads, &w);
        s_mm[s] = w.mm + w.mm_rec;
        s_dw[s] = pp > 1 && p->pp_defer_wgrad > 0 ? w.mm_head_w : 0.0;
        s_mem[s] = bw_mem > 0 ? (w.bytes + w.bytes_rec) / bw_mem : 0.0;
        const double mm = s_mm[s] / fc_all, mem = s_mem[s] / fm_all;
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
        /* tensor parallelism: bench-dist's tp_bytes per micro-batch (all-reduces; with sequence
         * parallelism each [N, D] one a reduce-scatter and an all-gather, and a layer's norm gradients) */
        double ttp = 0.0;
        if (tp > 1) {
            const double rows = 4.0 * layers * N * D + (s == 0 ? N * D : 0.0) + (has_head ? N * D : 0.0);
            const double small = (has_head ? 3.0 * N : 0.0) + moe * N * c->top_k;
            const double n_rows = 4.0 * layers + (s == 0) + (has_head ? 1.0 : 0.0);
            const double n_small = (has_head ? 2.0 : 0.0) + moe;
            double bytes;
            if (p->sequence_parallel) {
                const double norms = (2.0 * layers + (has_head ? 1.0 : 0.0)) * D, n_norms = layers + (has_head ? 1.0 : 0.0);
                const double half = ring(tp) * 4.0 * rows; /* the reduce-scatters, and as many all-gathers */
                const double inputs = ring(tp) * 4.0 * 2.0 * layers * N * D; /* ln1, ln2 gathered again in the backward */
                bytes = 2.0 * half + inputs + 2.0 * ring(tp) * 4.0 * (small + norms);
                /* a reduce-scatter at the all-gather's fit, as ZeRO's (the same ring bytes) */
                ttp = (1.0 - hide_comm) * (comm_s(hw, TERA_HW_ALLGATHER, tp, devices, tp, half, n_rows) +
                                           comm_s(hw, TERA_HW_ALLGATHER, tp, devices, tp, half + inputs,
                                                  n_rows + 2.0 * layers) +
                                           comm_s(hw, TERA_HW_ALLREDUCE, tp, devices, tp,
                                                  2.0 * ring(tp) * 4.0 * (small + norms), n_small + n_norms));
            } else {
                bytes = 2.0 * ring(tp) * 4.0 * (rows + small);
                ttp = (1.0 - hide_comm) * comm_s(hw, TERA_HW_ALLREDUCE, tp, devices, tp, bytes, n_rows + n_small);
            }
            if (s == 0 || bytes * A > out->bytes_tp) out->bytes_tp = bytes * A;
        }
        /* expert exchange: bench-dist's ep_bytes per micro-batch (uniform routing; rows out and back,
         * forward and backward) at exchange_bytes per element, flat or in two stages (ep_layer_s); the
         * hidden fraction: --exchange-overlap for another implementation, else tera's parallel.ep_overlap
         * (the point-to-point exchange on devices, behind the routed and the shared experts:
         * tera_plan_ep_overlap_hidden; the two-stage exchange's
         * partial overlap is not credited, an upper bound) */
        double tep = 0.0;
        if (ep > 1 && moe > 0) {
            double sent;
            const double t_layer = ep_layer_s(hw, ep, tp, devices, N * c->top_k * D * xb, p->ep_hierarchical, &sent);
            const int flat = sent == 4.0 * ring(ep) * N * c->top_k * D * xb;
            double hidden = hide_ep * t_layer;
            if (hide_ep <= 0 && p->ep_overlap && flat && !cpu_host)
                hidden = tera_plan_ep_overlap_hidden(ep, 0.25 * comm_s(hw, TERA_HW_ALLTOALL, ep, devices, (int64_t)ep * tp, sent, 4.0),
                                                     w.t_exp, w.t_sh_f, w.t_sh_b);
            if (hidden > t_layer) hidden = t_layer;
            tep = moe * (t_layer - hidden);
            ep_hidden[s] = moe * hidden;
            if (moe * sent * A > out->bytes_ep) out->bytes_ep = moe * sent * A;
        }
        /* pipeline sends: bench-dist's pp_bytes per micro-batch */
        double tpp = 0.0;
        if (pp > 1) {
            double bytes = st[s].sends * N * D * 4.0;
            tpp = comm_s(hw, TERA_HW_P2P, 2, devices, (int64_t)pp * dp * tp, bytes, st[s].sends);
            if (split) { /* the head split's pair (bench-dist's pp_bytes): each end sends [N, D] (the owner the final
                          * norm's output, the helper its input gradient) and the cross-entropy's [N] and [2N] */
                const double hb = 4.0 * (N * D + 3.0 * N);
                tpp += comm_s(hw, TERA_HW_P2P, 2, devices, (int64_t)pp * dp * tp, hb, 3.0);
                bytes += hb;
            }
            if (bytes * A > out->bytes_pp) out->bytes_pp = bytes * A;
        }
        s_x[s] = ttp + tep + tpp;
        /* deferred: the head's weight gradient off the stage's operations (the schedule's gaps take it) */
        const double dws = s_dw[s] / fc_all, u = comp + ttp + tep + tpp - dws;
        if (s == 0 || u > worst_u)
            worst_u = u, worst = s, u_tp = ttp, u_ep = tep, u_pp = tpp, u_comp = comp, u_mm = mm, u_mem = mem, worst_dw = dws;
    }
    out->recompute_flops = rec_all;
    /* the schedule: makespan in forward units (a micro-batch's work = 3 units) times the busiest stage's
     * micro-batch; on a host whose cores the stages share, the shared-core simulation instead */
    double pipe = makespan / 3.0 * worst_u;
    /* parallel.pp_defer_wgrad: the busiest stage's deferred products fill its bubble; what does not fit adds */
    if (A * worst_dw > pipe - A * worst_u) pipe += A * worst_dw - (pipe - A * worst_u);
    tera_status rc = TERA_OK;
    if (cpu_host && pp > 1) {
        const double group = (double)on_node / pp; /* a stage's ranks on the node */
        rc = shared_pipeline(cfg, hw, threads, group, s_mm, s_mem, s_x, s_dw, &pipe);
    }
    out->ep_hidden_s = A * ep_hidden[worst];
    free(s_mm), free(s_mem), free(s_x), free(ep_hidden), free(s_dw);
    if (rc != TERA_OK) return rc;
    /* the optimizer on the busiest stage's rank: Adam reads parameter, gradient and both moments and
     * writes three (its shard under ZeRO); the norm pass reads every gradient once, and ZeRO-2/3 also
     * clear theirs (ZeRO-0/1 store them in the next step's first backward instead: tera_model_grads_stale);
     * 1-bit Adam after its warm-up also updates the whole momentum from the rank's own gradient and
     * its error feedback (read m, g, e; write m, e: 20 bytes a float held) */
    const tera_plan_stage *w = &st[worst];
    const int onebit = !strcmp(cfg->optimizer.name, "onebit_adam") && dp > 1;
    /* optimizer.moments = bf16: 4 bytes of moments a parameter held instead of 8, Adam's pass 20 bytes instead of 28 */
    const int m16 = cfg->optimizer.moments;
    const double opt_floats = (double)w->mem.bytes[TERA_PM_OPTIMIZER] / (m16 ? 4.0 : 8.0);
    const double opt_bytes = (m16 ? 20.0 : 28.0) * opt_floats + (zero >= 2 ? 8.0 : 4.0) * (double)w->n_floats +
                             (onebit ? 20.0 * (double)w->n_floats : 0.0);
    const double t_opt = bw_mem > 0 ? opt_bytes / bw_mem / fm_all : 0.0;
    out->optimizer_s = t_opt;
    out->matmul_s = A * u_mm;
    out->memory_s = A * u_mem + t_opt;
    out->compute_s = A * u_comp + t_opt;
    out->tp_s = A * u_tp, out->ep_s = A * u_ep, out->pp_s = A * u_pp;
    out->bubble_s = pipe - A * (worst_u + worst_dw); /* the deferred products are in compute_s */
    out->bubble_frac = pp > 1 ? bubble : 0.0;
    /* data parallelism over dp (non-expert) and edp (experts), the stage's ranks: bench-dist's grad_bytes
     * and zero3_gather_bytes; one group of dp x tp ranks */
    const double nd = (double)w->n_dense, nx = (double)(w->n_floats - w->n_dense);
    const double pass = 4.0 * (ring(dp) * nd + ring(edp) * nx);
    const double groups = w->layers + (worst == 0) + (worst == pp - 1);
    double t_dp = 0.0, exposed = 0.0;
    const double t_bwd = 2.0 / 3.0 * u_comp; /* one micro-batch's backward on the stage */
    const int hier = cfg->parallel.hierarchical;
    /* in host-shared memory (zero.c's conditions: a CPU host holding the group, the flat uncompressed
     * reducer; the experts over their edp ranks' buffers): per rank, the summed floats S (read once from
     * the ranks' buffers) and its piece of them (ZeRO-0 writes its share into every buffer: 8 S bytes;
     * ZeRO-1 into its shard: 4 (S + piece); ZeRO-2/3 add it into the shard: 4 (S + 2 piece) a
     * micro-batch; a ZeRO-3 gather writes the piece from the shard: 8 piece) */
    const int sh_ok = cpu_host && (int64_t)dp * tp <= hw->devices_per_node && !hier &&
                      tera_compress_parse(cfg->parallel.grad_compression) == TERA_COMPRESS_NONE &&
                      shared_s(hw, devices, 0.0, 0.0) >= 0;
    const double sum_f = nd + (edp > 1 ? nx : 0.0), piece_f = nd / dp + (edp > 1 ? nx / edp : 0.0);
    /* ZeRO-1/2's all-gather of the updated parameters there too: each rank copies its non-expert piece
     * into the dp - 1 other buffers and its expert piece into the edp - 1 others holding those experts */
    const int pw_ok = sh_ok;
    const double pw_bytes = 8.0 * ((dp - 1) * nd / dp + (edp > 1 ? (edp - 1) * nx / edp : 0.0));
    const double t_ag_pw = pw_ok ? shared_s(hw, devices, pw_bytes, 1.0) : 0.0;
    const double n_sums = groups * (edp > 1 && nx > 0 ? 2.0 : 1.0);
    if (dp > 1 && onebit) {
        /* 1-bit Adam after its warm-up (docs/COMMUNICATION.md): no gradient sums; the momentum's 1-bit
         * all-reduce per region (2 (q-1)/q of the region compressed: n/8 bytes + 4 per 256 values; flat),
         * in the optimizer step; ZeRO-1 also all-gathers the fp32 parameters (as AdamW's ZeRO-1) */
        const double cb = 2.0 * (ring(dp) * (double)tera_compress_bytes(TERA_COMPRESS_ONEBIT, (int64_t)nd) +
                                 ring(edp) * (double)tera_compress_bytes(TERA_COMPRESS_ONEBIT, (int64_t)nx));
        /* ZeRO-1/2 all-gather the updated parameters once; ZeRO-3 gathers each layer where it is used, as
         * AdamW's ZeRO-3 (the update marks the gathered layers stale) */
        double n_gathers = 0.0, piece = 0.0;
        const double params = zero >= 3 ? zero3_gathers(w, L, A, dp, edp, &n_gathers, &piece) : zero ? pass : 0.0;
        out->bytes_dp = cb + params;
        t_dp = dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, cb, 4.0, 0);
        /* (in host-shared memory as AdamW's: ZeRO-3's gathers, ZeRO-1/2's parameter copies) */
        const double t_par = params <= 0 ? 0.0
                             : zero >= 3 && sh_ok ? shared_s(hw, devices, 2.0 * piece, n_gathers)
                             : zero < 3 && pw_ok  ? t_ag_pw
                                                  : dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, params,
                                                              zero >= 3 ? 2.0 * n_gathers : 2.0, hier);
        t_dp += t_par;
        exposed = t_dp;
        if (zero >= 3 && !cpu_host) /* the layer gathers hide behind compute as AdamW's do */
            exposed -= t_par > A * u_comp ? A * u_comp : t_par;
    } else if (dp > 1) {
        if (zero == 0) { /* buckets, one all-reduce per group, during the last micro-batch's backward */
            out->bytes_dp = 2.0 * pass;
            t_dp = sh_ok ? shared_s(hw, devices, 8.0 * sum_f, n_sums)
                         : dp_comm_s(hw, TERA_HW_ALLREDUCE, dp, tp, devices, out->bytes_dp, 2.0 * groups, hier);
            exposed = t_dp > t_bwd ? t_dp - t_bwd : 0.0;
        } else if (zero == 1) { /* buckets, one reduce-scatter per group, during the last micro-batch's
                                   backward; one all-gather of the updated parameters after the step */
            out->bytes_dp = 2.0 * pass;
            const double t_rs = sh_ok ? shared_s(hw, devices, 4.0 * (sum_f + piece_f), n_sums)
                                      : dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, pass, 2.0 * groups, hier);
            const double t_ag = pw_ok ? t_ag_pw : dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, pass, 2.0, hier);
            t_dp = t_rs + t_ag;
            exposed = (t_rs > t_bwd ? t_rs - t_bwd : 0.0) + t_ag;
        } else {
            const double rs = A * pass, ag = zero < 3 ? pass : 0.0;
            double n_gathers = 0.0, piece = 0.0;
            const double gather = zero >= 3 ? zero3_gathers(w, L, A, dp, edp, &n_gathers, &piece) : 0.0;
            out->bytes_dp = rs + ag + gather;
            const double t_rs = sh_ok ? shared_s(hw, devices, A * 4.0 * (sum_f + 2.0 * piece_f), A * n_sums)
                                      : dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, rs, A * groups * 2.0, hier);
            const double t_rest = sh_ok ? (zero >= 3 ? shared_s(hw, devices, 2.0 * piece, n_gathers)
                                                     : pw_ok ? t_ag_pw
                                                             : dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, ag, 2.0, hier))
                                        : dp_comm_s(hw, TERA_HW_ALLGATHER, dp, tp, devices, ag + gather,
                                                    2.0 + 2.0 * n_gathers, hier);
            t_dp = t_rs + t_rest;
            const double hide_rs = A * t_bwd, hide_g = A * u_comp;
            exposed = (t_rs > hide_rs ? t_rs - hide_rs : 0.0);
            if (zero >= 3) exposed += t_rest > hide_g ? t_rest - hide_g : 0.0;
            else exposed += t_rest;
        }
        if (cpu_host) exposed = t_dp; /* the cores that compute do the copies */
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

/* the largest rank's memory of a layout's stages */
static void worst_of(const tera_plan_stage *st, int pp, tera_plan_mem *worst) {
    *worst = st[0].mem;
    for (int s = 1; s < pp; s++)
        if (st[s].mem.total > worst->total) *worst = st[s].mem;
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
                        c0.parallel.sequence_parallel = 0;
                        if (tera_config_finalize(&c0) != TERA_OK) continue; /* the layouts tera accepts */
                        /* tensor parallelism: with and without sequence parallelism, where tera accepts it */
                        tera_config c1 = c0;
                        c1.parallel.sequence_parallel = 1;
                        const int sp_max = tp > 1 && tera_config_finalize(&c1) == TERA_OK;
                        /* parallel.pp_head_split: with and without it where tera accepts it (ZeRO 0-1, not
                         * GPipe, each tp rank's vocabulary slice even; the loss over blocks of rows is not tried with it) */
                        const int hs_ok = pp > 1 && strcmp(sched[si].kind, "gpipe") != 0 && mc->vocab_size % (2 * tp) == 0;
                        for (int zero = 0; zero <= (dp > 1 ? 3 : 0); zero++) {
                            /* parallel.pp_defer_wgrad (every micro-batch's entry) with and without, where tera
                             * accepts it (a pipeline, ZeRO 0-1) */
                            const int per = 3 * (1 + sp_max), nhs = 1 + (hs_ok && zero <= 1), ndw = 1 + (pp > 1 && zero <= 1);
                            for (int k = 0; k < per * nhs * ndw; k++) {
                                /* without, then with sequence parallelism; x recompute; then the same with the head
                                 * split; then all of it with the head's weight gradients deferred */
                                const int dw = k / (per * nhs), hs = k % (per * nhs) / per, kk = k % per;
                                const int sp = kk / 3, r = kk % 3;
                                tera_plan_candidate cand;
                                memset(&cand, 0, sizeof cand);
                                tera_config *c = &cand.cfg;
                                *c = c0;
                                c->parallel.zero = zero;
                                c->parallel.sequence_parallel = sp;
                                c->parallel.pp_head_split = hs;
                                c->parallel.pp_defer_wgrad = dw ? c->training.grad_accum : 0;
                                snprintf(c->training.recompute, sizeof c->training.recompute, "%s", rec[r]);
                                double bubble, makespan;
                                if (tera_plan_stages(c, cache, o->threads, st, &bubble, &makespan) != TERA_OK) continue;
                                (*n_valid)++;
                                worst_of(st, pp, &cand.worst);
                                cand.fits = (double)cand.worst.total <= budget;
                                /* too large with the whole logits: the head and the loss over blocks of rows
                                 * (training.loss_chunk; the same step time: no product repeated) */
                                if (!cand.fits && base->training.loss_chunk == 0 && !hs && !dw &&
                                    (int64_t)mb * c->training.seq_len > TERA_PLAN_LOSS_CHUNK) {
                                    c->training.loss_chunk = TERA_PLAN_LOSS_CHUNK;
                                    if (tera_plan_stages(c, cache, o->threads, st, &bubble, &makespan) != TERA_OK) continue;
                                    worst_of(st, pp, &cand.worst);
                                    cand.fits = (double)cand.worst.total <= budget;
                                }
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
    }
    free(st);
    tera_plan_cache_free(cache);
    *best = top;
    *n_best = n_top;
    return TERA_OK;
}
