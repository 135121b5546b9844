/* The Prometheus endpoint: one per rank on logging.metrics_port + world rank (docs/MONITORING.md).
 *
 * Two threads touch this module. The step thread (tera_metrics_http_publish) fills its own copy of
 * the snapshot (`pub`: counters accumulate there) and then copies it into `shared` under `lock`.
 * libmicrohttpd's internal polling thread (one thread: every request is answered in it) copies
 * `shared` into `view` under the same lock, then formats `view` into `text` without it. All four
 * buffers are sized at start; the step loop allocates nothing and never waits for a client. */
#include "tera/metrics_http.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "tera/hw.h"
#include "tera/pipeline.h"
#include "tera/profile.h"
#include "tera/zero.h"

#define N_GROUPS TERA_PARAM_GROUPS
#define N_KINDS 5
#define N_BUCKETS 15
static const char *const *const group_names = tera_param_group_names;
_Static_assert(TERA_BLOCKED_KINDS == N_KINDS + 1 && TERA_BLOCKED_BARRIER == N_KINDS,
               "the sent bytes' kinds are tera_traffic_kind's; the blocked time's add the barriers");
/* upper bounds of the step-time histogram (seconds): from small test models to large steps */
static const double bucket_le[N_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                            2.5,   5,    10,    30,   60,  120, 300};
static const char *const bucket_text[N_BUCKETS] = {"0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1",
                                                   "2.5",   "5",    "10",    "30",   "60",  "120", "300"};

/* What one scrape shows (apart from the per-layer arrays and the process figures read at scrape time). */
typedef struct {
    int have_step;                 /* 0 until the first step: step figures are absent, not zero */
    int64_t step;                  /* 0-based index of the last step (metrics.jsonl's "step") */
    double loss, part[3];          /* total; ce, aux, z (unweighted, as metrics.jsonl) */
    double lr, grad_norm, update_ratio, tokens_per_s, loss_scale, dropped_frac;
    int64_t batch_seqs;
    double group_norm[N_GROUPS];
    int group_present[N_GROUPS];
    double tokens_total, data_wait_total, comm_wait_total, step_sum;
    int pipe;                      /* a pipeline: this rank's stage's busy and waiting seconds since start */
    double pipe_busy_total, pipe_wait_total;
    int64_t step_count, bucket[N_BUCKETS]; /* bucket[i]: steps of at most bucket_le[i] seconds */
    int64_t skipped_total, spikes_total;
    double last_step_unix;
    int have_val;
    int64_t val_step;
    double val_loss;
    double traffic[N_KINDS];       /* bytes sent by kind since start (monotonic) */
    double blocked[TERA_BLOCKED_KINDS]; /* seconds blocked by kind (and barriers) since start (monotonic) */
    int64_t ckpt_saves;
    double ckpt_pause, ckpt_write; /* the last save's step-loop pause and write time */
    int64_t ckpt_step;             /* step of the newest checkpoint (the starting step before any save) */
    double ckpt_unix;              /* when it was saved (noticed at the next step; start time before any) */
    tera_hw_reading hw;            /* the step's hardware readings (src/obs/hw.c; absent ones not listed) */
    double model_flops_s, mfu;     /* the last step's model FLOP/s (the job's) and MFU (-1: no logging.peak_tflops) */
    double op_seconds[TERA_PROF_COUNT]; /* time inside each profiled operation since start (monotonic) */
    int op_seen[TERA_PROF_COUNT];  /* the operation has run in this process */
} snap;

struct tera_metrics_http {
    struct MHD_Daemon *daemon;
    int port, rank, world;
    char info_labels[256];         /* the layout, for tera_info */
    int n_moe, first_moe;          /* MoE layers [first_moe, first_moe + n_moe) */
    double mem[5];                 /* params, grads, optimizer, activations, scratch (bytes, fixed at start) */
    int64_t steps_target, ckpt_every;
    double start_unix;
    /* step thread only */
    snap pub;
    double *pub_layers;            /* [2 n_moe]: router entropy, expert load max/mean */
    tera_comm_traffic traffic_prev;
    int64_t saves_prev;
    double prof_prev[TERA_PROF_COUNT]; /* tera_prof_seconds at the last publish */
    double peak_flops;             /* logging.peak_tflops in FLOP/s (one rank; 0: not given) */
    /* under lock */
    pthread_mutex_t lock;
    snap shared;
    double *shared_layers;
    /* the serving thread (and tera_metrics_http_render, serialised by render_lock) */
    pthread_mutex_t render_lock;
    snap view;
    double *view_layers;
    char *text;
    size_t text_cap;
};

static double unix_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ the step thread */


static void publish_copy(tera_metrics_http *h) {
    pthread_mutex_lock(&h->lock);
    h->shared = h->pub;
    memcpy(h->shared_layers, h->pub_layers, sizeof(double) * 2 * (size_t)h->n_moe);
    pthread_mutex_unlock(&h->lock);
}

void tera_metrics_http_publish(tera_metrics_http *h, const tera_trainer *tr, const tera_step_result *r) {
    if (!h) return;
    snap *p = &h->pub;
    const tera_model *m = &tr->model;
    const double T = tr->cfg.training.seq_len;
    if (!p->have_step) p->ckpt_step = r->step; /* this process's starting point (a resumed run: its checkpoint) */
    p->have_step = 1;
    p->step = r->step;
    p->loss = r->loss, p->part[0] = r->ce_loss, p->part[1] = r->aux_loss, p->part[2] = r->z_loss;
    p->lr = r->lr, p->grad_norm = r->grad_norm, p->update_ratio = r->update_ratio;
    p->tokens_per_s = r->seconds > 0 ? (double)r->batch_seqs * T / r->seconds : 0.0;
    p->loss_scale = r->loss_scale, p->dropped_frac = r->dropped_frac, p->batch_seqs = r->batch_seqs;
    double gsq[N_GROUPS] = {0};
    int present[N_GROUPS] = {0};
    for (int i = 0; i < m->n_params; i++) {
        const int g = tera_param_group(m->params[i].kind);
        gsq[g] += tr->sharding->grad_sq[i];
        present[g] = 1;
    }
    for (int g = 0; g < N_GROUPS; g++) p->group_norm[g] = sqrt(gsq[g]), p->group_present[g] = present[g];
    const int E = m->cfg.n_experts;
    for (int j = 0; j < h->n_moe; j++) {
        const int l = h->first_moe + j;
        int64_t mx = 0, sum = 0;
        for (int e = 0; e < E; e++) {
            const int64_t v = m->expert_load[(int64_t)l * E + e];
            sum += v;
            if (v > mx) mx = v;
        }
        h->pub_layers[j] = m->routed_tokens ? m->router_entropy[l] / (double)m->routed_tokens : 0.0;
        h->pub_layers[h->n_moe + j] = sum ? (double)mx * E / (double)sum : 0.0;
    }
    p->tokens_total += (double)r->batch_seqs * T;
    p->data_wait_total += r->data_seconds;
    p->comm_wait_total += r->comm_seconds;
    if (tr->pipe) { /* this rank's own stage (tera_pipe_last), not the first data-parallel rank's */
        double b, w;
        tera_pipe_last(tr->pipe, &b, &w);
        p->pipe = 1, p->pipe_busy_total += b, p->pipe_wait_total += w;
    }
    p->step_sum += r->seconds;
    p->step_count++;
    for (int i = 0; i < N_BUCKETS; i++) p->bucket[i] += r->seconds <= bucket_le[i];
    /* counted here, so that they only grow: a spike's rollback restores the checkpoint's skip count */
    p->skipped_total += r->skipped && !r->spike;
    p->spikes_total += r->spike != 0;
    p->last_step_unix = unix_now();
    /* bytes sent: monotonic here even when someone resets the communicator's counters */
    const tera_comm_traffic t = tera_comm_traffic_get();
    const double now[N_KINDS] = {t.allreduce, t.reduce_scatter, t.allgather, t.alltoall, t.p2p};
    const double prev[N_KINDS] = {h->traffic_prev.allreduce, h->traffic_prev.reduce_scatter,
                                  h->traffic_prev.allgather, h->traffic_prev.alltoall, h->traffic_prev.p2p};
    for (int k = 0; k < N_KINDS; k++) p->traffic[k] += now[k] >= prev[k] ? now[k] - prev[k] : now[k];
    for (int k = 0; k < TERA_BLOCKED_KINDS; k++) {
        const double b = t.blocked_kind_s[k], b0 = h->traffic_prev.blocked_kind_s[k];
        p->blocked[k] += b >= b0 ? b - b0 : b;
    }
    h->traffic_prev = t;
    /* checkpoints: a save between the last step and this one wrote checkpoint step_<r->step> */
    const tera_ckpt_stats cs = tera_ckpt_last_stats();
    if (cs.saves > h->saves_prev) p->ckpt_step = r->step, p->ckpt_unix = p->last_step_unix;
    h->saves_prev = cs.saves;
    p->ckpt_saves = cs.saves;
    p->ckpt_pause = cs.last_pause_s;
    p->ckpt_write = cs.last_write_s;
    p->hw = *tera_hw_latest(); /* sampled by the step at most once a second */
    p->model_flops_s = r->model_flops_s, p->mfu = r->mfu;
    /* time per operation (include/tera/profile.h; evaluation forwards included): monotonic here even
     * when the profile is reset (tera train resets it once training starts) */
    for (int i = 0; i < TERA_PROF_COUNT; i++) {
        const double now_s = tera_prof_seconds[i];
        p->op_seconds[i] += now_s >= h->prof_prev[i] ? now_s - h->prof_prev[i] : now_s;
        h->prof_prev[i] = now_s;
        p->op_seen[i] |= tera_prof_calls[i] > 0 || p->op_seconds[i] > 0.0;
    }
    publish_copy(h);
}

void tera_metrics_http_publish_eval(tera_metrics_http *h, int64_t step, double val_loss) {
    if (!h) return;
    h->pub.have_val = 1;
    h->pub.val_step = step;
    h->pub.val_loss = val_loss;
    publish_copy(h);
}

/* ------------------------------------------------------------------ the exposition text */

typedef struct {
    char *b;
    size_t cap, len; /* len keeps counting past cap: the size needed */
} out;

__attribute__((format(printf, 2, 3))) static void put(out *o, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const size_t room = o->len < o->cap ? o->cap - o->len : 0;
    const int k = vsnprintf(room ? o->b + o->len : NULL, room, fmt, ap);
    va_end(ap);
    if (k > 0) o->len += (size_t)k;
}

/* A sample value as Prometheus reads it (Go's ParseFloat: NaN, +Inf, -Inf). */
static const char *num(char *buf, size_t n, double v) {
    if (isnan(v)) return "NaN";
    if (isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    snprintf(buf, n, "%.15g", v);
    return buf;
}

static void family(out *o, const char *name, const char *type, const char *help) {
    put(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* name{rank="R"[,extra]} value */
static void sample(out *o, const tera_metrics_http *h, const char *name, const char *extra, double v) {
    char b[64];
    put(o, "%s{rank=\"%d\"%s%s} %s\n", name, h->rank, extra ? "," : "", extra ? extra : "", num(b, sizeof b, v));
}

static void metric(out *o, const tera_metrics_http *h, const char *name, const char *type, const char *help, double v) {
    family(o, name, type, help);
    sample(o, h, name, NULL, v);
}

static double rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return -1;
    long size = 0, res = -1;
    const int n = fscanf(f, "%ld %ld", &size, &res);
    fclose(f);
    return n == 2 ? (double)res * (double)sysconf(_SC_PAGESIZE) : -1;
}

/* The hardware readings: a family only when the machine exposes at least one of its readings. */
static void hw_families(out *o, const tera_metrics_http *h, const tera_hw_reading *hw) {
    static const struct {
        tera_hw_kind kind;
        const char *name, *type, *label, *help;
    } fam[] = {
        {TERA_HW_CPU_UTIL, "tera_cpu_utilization_ratio", "gauge", NULL,
         "CPU time of this process over wall time and the CPUs it may use, since the previous sample (about 1 s)"},
        {TERA_HW_CPU_CORES, "tera_cpu_cores_used", "gauge", NULL, "CPU cores this process kept busy since the previous sample"},
        {TERA_HW_NET_RX, "tera_host_network_receive_bytes_total", "counter", NULL,
         "bytes the machine received on every interface but loopback (/proc/net/dev)"},
        {TERA_HW_NET_TX, "tera_host_network_transmit_bytes_total", "counter", NULL,
         "bytes the machine sent on every interface but loopback (/proc/net/dev)"},
        {TERA_HW_TEMP, "tera_hw_temperature_celsius", "gauge", "sensor", "hwmon temperatures (absent where /sys has none)"},
        {TERA_HW_POWER, "tera_hw_power_watts", "gauge", "domain",
         "RAPL power per domain since the previous sample (absent where /sys has none or it is not readable)"},
    };
    char lab[96];
    for (size_t f = 0; f < sizeof fam / sizeof fam[0]; f++) {
        int any = 0;
        for (int i = 0; i < hw->n; i++) {
            if (hw->kind[i] != fam[f].kind) continue;
            if (!any) family(o, fam[f].name, fam[f].type, fam[f].help);
            any = 1;
            if (fam[f].label) snprintf(lab, sizeof lab, "%s=\"%s\"", fam[f].label, hw->label[i]);
            sample(o, h, fam[f].name, fam[f].label ? lab : NULL, hw->value[i]);
        }
    }
}

static size_t render_view(tera_metrics_http *h, char *buf, size_t cap) {
    pthread_mutex_lock(&h->lock);
    h->view = h->shared;
    memcpy(h->view_layers, h->shared_layers, sizeof(double) * 2 * (size_t)h->n_moe);
    pthread_mutex_unlock(&h->lock);
    const snap *s = &h->view;
    out o = {buf, cap, 0};
    char lab[96];

    family(&o, "tera_info", "gauge", "constant 1; labels: this rank's place in the layout");
    put(&o, "tera_info{rank=\"%d\",%s} 1\n", h->rank, h->info_labels);
    metric(&o, h, "tera_start_time_seconds", "gauge", "Unix time at which this process set up training", h->start_unix);
    metric(&o, h, "tera_steps_target", "gauge", "training.steps: the step count the run trains to",
           (double)h->steps_target);
    if (s->have_step) {
        metric(&o, h, "tera_step", "gauge", "0-based index of the last completed step (metrics.jsonl's step)",
               (double)s->step);
        metric(&o, h, "tera_last_step_timestamp_seconds", "gauge", "Unix time at which the last step ended",
               s->last_step_unix);
        metric(&o, h, "tera_loss", "gauge", "training loss of the last step: ce + aux_coef aux + z_coef z", s->loss);
        family(&o, "tera_loss_part", "gauge", "the last step's loss terms before their coefficients (ce, aux, z)");
        static const char *const parts[3] = {"ce", "aux", "z"};
        for (int i = 0; i < 3; i++) {
            snprintf(lab, sizeof lab, "part=\"%s\"", parts[i]);
            sample(&o, h, "tera_loss_part", lab, s->part[i]);
        }
        metric(&o, h, "tera_learning_rate", "gauge", "LR of the last step", s->lr);
        metric(&o, h, "tera_grad_norm", "gauge", "global gradient norm of the last step, before clipping",
               s->grad_norm);
        family(&o, "tera_grad_norm_group", "gauge", "gradient norm of the last step by parameter group");
        for (int g = 0; g < N_GROUPS; g++) {
            if (!s->group_present[g]) continue;
            snprintf(lab, sizeof lab, "group=\"%s\"", group_names[g]);
            sample(&o, h, "tera_grad_norm_group", lab, s->group_norm[g]);
        }
        metric(&o, h, "tera_update_ratio", "gauge", "|update| / |weights| of the last step (0 when skipped)",
               s->update_ratio);
        metric(&o, h, "tera_tokens_per_second", "gauge", "tokens per second of the last step's actual batch",
               s->tokens_per_s);
        metric(&o, h, "tera_model_flops_per_second", "gauge",
               "model FLOP/s of the whole job in the last step (forward and backward model FLOPs per token x tokens "
               "per second; recomputation not counted)", s->model_flops_s);
        if (s->mfu >= 0.0)
            metric(&o, h, "tera_mfu_ratio", "gauge",
                   "model FLOPs utilisation of the last step: tera_model_flops_per_second over tera_peak_flops_per_second "
                   "x world ranks", s->mfu);
        metric(&o, h, "tera_batch_sequences", "gauge", "global batch of the last step in sequences",
               (double)s->batch_seqs);
        metric(&o, h, "tera_loss_scale", "gauge", "fp16's dynamic loss scale of the last step (1 otherwise)",
               s->loss_scale);
        metric(&o, h, "tera_dropped_tokens_ratio", "gauge",
               "fraction of the last step's expert assignments dropped by the capacity", s->dropped_frac);
        if (h->n_moe > 0) {
            family(&o, "tera_router_entropy", "gauge", "mean router entropy (nats) per MoE layer, last step");
            for (int j = 0; j < h->n_moe; j++) {
                snprintf(lab, sizeof lab, "layer=\"%d\"", h->first_moe + j);
                sample(&o, h, "tera_router_entropy", lab, h->view_layers[j]);
            }
            family(&o, "tera_expert_load_max_over_mean", "gauge",
                   "assignments of the busiest expert over the mean per MoE layer, last step (1 = balanced)");
            for (int j = 0; j < h->n_moe; j++) {
                snprintf(lab, sizeof lab, "layer=\"%d\"", h->first_moe + j);
                sample(&o, h, "tera_expert_load_max_over_mean", lab, h->view_layers[h->n_moe + j]);
            }
        }
    }
    metric(&o, h, "tera_tokens_total", "counter", "tokens of the steps this process ran (global batch)",
           s->tokens_total);
    if (s->pipe) { /* rate(wait) / rate(tera_step_seconds_sum): the stage's bubble */
        metric(&o, h, "tera_pipeline_busy_seconds_total", "counter",
               "time this rank's pipeline stage ran its forward and backward operations (training steps)",
               s->pipe_busy_total);
        metric(&o, h, "tera_pipeline_wait_seconds_total", "counter",
               "time this rank's pipeline stage was blocked on its neighbours' activations and gradients and on its "
               "own sends (training steps): its bubble", s->pipe_wait_total);
    }
    family(&o, "tera_step_seconds", "histogram", "wall time of a training step on this rank");
    for (int i = 0; i < N_BUCKETS; i++) {
        snprintf(lab, sizeof lab, "le=\"%s\"", bucket_text[i]);
        sample(&o, h, "tera_step_seconds_bucket", lab, (double)s->bucket[i]);
    }
    sample(&o, h, "tera_step_seconds_bucket", "le=\"+Inf\"", (double)s->step_count);
    sample(&o, h, "tera_step_seconds_sum", NULL, s->step_sum);
    sample(&o, h, "tera_step_seconds_count", NULL, (double)s->step_count);
    metric(&o, h, "tera_data_wait_seconds_total", "counter", "time this rank's steps waited for training data",
           s->data_wait_total);
    metric(&o, h, "tera_comm_wait_seconds_total", "counter",
           "time this rank's steps were blocked in communication (collectives, waits; comm_wait_s summed)",
           s->comm_wait_total);
    metric(&o, h, "tera_skipped_steps_total", "counter", "updates this process skipped for a non-finite loss or gradient",
           (double)s->skipped_total);
    if (h->peak_flops > 0.0)
        metric(&o, h, "tera_peak_flops_per_second", "gauge", "one rank's peak FLOP/s as configured (logging.peak_tflops)",
               h->peak_flops);
    int any_op = 0;
    for (int i = 0; i < TERA_PROF_COUNT; i++) {
        if (!s->op_seen[i]) continue;
        if (!any_op)
            family(&o, "tera_operation_seconds_total", "counter",
                   "time this rank spent inside each timed operation (the per-operation profile; evaluation included)");
        any_op = 1;
        snprintf(lab, sizeof lab, "op=\"%s\"", tera_prof_name(i));
        sample(&o, h, "tera_operation_seconds_total", lab, s->op_seconds[i]);
    }
    metric(&o, h, "tera_loss_spike_events_total", "counter",
           "loss spikes this process handled (training.spike_window)", (double)s->spikes_total);
    if (s->have_val) {
        metric(&o, h, "tera_validation_loss", "gauge", "validation loss of the last evaluation", s->val_loss);
        metric(&o, h, "tera_validation_perplexity", "gauge", "exp(validation loss) of the last evaluation",
               exp(s->val_loss));
        metric(&o, h, "tera_validation_step", "gauge", "0-based index of the step after which it was evaluated",
               (double)s->val_step);
    }
    family(&o, "tera_memory_bytes", "gauge", "memory allocated by this rank at set-up, by category");
    static const char *const cats[5] = {"params", "grads", "optimizer", "activations", "scratch"};
    for (int i = 0; i < 5; i++) {
        snprintf(lab, sizeof lab, "category=\"%s\"", cats[i]);
        sample(&o, h, "tera_memory_bytes", lab, h->mem[i]);
    }
    const double rss = rss_bytes(), lim = tera_hw_memory_limit(), avail = tera_hw_meminfo("MemAvailable");
    if (rss >= 0)
        metric(&o, h, "tera_process_resident_memory_bytes", "gauge", "resident set size of this process", rss);
    if (lim > 0)
        metric(&o, h, "tera_memory_limit_bytes", "gauge",
               "memory this process may use: its cgroup limit or else the machine's total", lim);
    if (avail >= 0)
        metric(&o, h, "tera_memory_available_bytes", "gauge", "the machine's available memory (MemAvailable)", avail);
    struct timespec cpu;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    metric(&o, h, "tera_process_cpu_seconds_total", "counter", "CPU time of this process, all threads",
           (double)cpu.tv_sec + 1e-9 * (double)cpu.tv_nsec);
    family(&o, "tera_comm_sent_bytes_total", "counter",
           "bytes this rank sent, by kind (collectives at ring-algorithm volume; include/tera/comm.h)");
    for (int k = 0; k < N_KINDS; k++) {
        snprintf(lab, sizeof lab, "kind=\"%s\"", tera_traffic_kind_name(k));
        sample(&o, h, "tera_comm_sent_bytes_total", lab, s->traffic[k]);
    }
    family(&o, "tera_comm_blocked_seconds_total", "counter",
           "time this rank was blocked in communication, by the operation's kind (a wait counts under its "
           "operation's; all steps, evaluations and saves included)");
    for (int k = 0; k < TERA_BLOCKED_KINDS; k++) {
        snprintf(lab, sizeof lab, "kind=\"%s\"", tera_traffic_kind_name(k));
        sample(&o, h, "tera_comm_blocked_seconds_total", lab, s->blocked[k]);
    }
    metric(&o, h, "tera_checkpoint_saves_total", "counter", "checkpoints saved by this process", (double)s->ckpt_saves);
    metric(&o, h, "tera_checkpoint_last_pause_seconds", "gauge", "the step loop's pause for the last save",
           s->ckpt_pause);
    metric(&o, h, "tera_checkpoint_last_write_seconds", "gauge", "duration of the last completed checkpoint write",
           s->ckpt_write);
    metric(&o, h, "tera_checkpoint_last_step", "gauge",
           "step of the newest checkpoint this process saved (the starting step before its first)", (double)s->ckpt_step);
    metric(&o, h, "tera_checkpoint_last_timestamp_seconds", "gauge",
           "Unix time of the newest checkpoint this process saved (its start before the first)", s->ckpt_unix);
    metric(&o, h, "tera_checkpoint_every_steps", "gauge", "checkpoint.every (0: only at the end)",
           (double)h->ckpt_every);
    hw_families(&o, h, &s->hw);
    return o.len;
}

size_t tera_metrics_http_render(tera_metrics_http *h, char *buf, size_t n) {
    if (!h) return 0;
    pthread_mutex_lock(&h->render_lock);
    const size_t len = render_view(h, buf, n);
    pthread_mutex_unlock(&h->render_lock);
    return len;
}

/* ------------------------------------------------------------------ the serving thread */

static enum MHD_Result reply(struct MHD_Connection *c, unsigned int code, const char *body, size_t len,
                             const char *type) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (code == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    const enum MHD_Result ret = MHD_queue_response(c, code, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    tera_metrics_http *h = cls;
    static const char plain[] = "text/plain; charset=utf-8";
    if (strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD)) {
        static const char msg[] = "method not allowed: GET /metrics\n";
        return reply(c, MHD_HTTP_METHOD_NOT_ALLOWED, msg, sizeof msg - 1, plain);
    }
    if (strcmp(url, "/metrics")) {
        static const char msg[] = "not found: tera serves GET /metrics\n";
        return reply(c, MHD_HTTP_NOT_FOUND, msg, sizeof msg - 1, plain);
    }
    pthread_mutex_lock(&h->render_lock);
    const size_t len = render_view(h, h->text, h->text_cap);
    enum MHD_Result ret;
    if (len < h->text_cap) {
        ret = reply(c, MHD_HTTP_OK, h->text, len, "text/plain; version=0.0.4; charset=utf-8");
    } else { /* cannot happen with the start-up sizing; answered, not cut off */
        static const char msg[] = "metrics text larger than its buffer\n";
        ret = reply(c, MHD_HTTP_INTERNAL_SERVER_ERROR, msg, sizeof msg - 1, plain);
    }
    pthread_mutex_unlock(&h->render_lock);
    return ret;
}

/* ------------------------------------------------------------------ start and stop */

static void free_all(tera_metrics_http *h) {
    free(h->pub_layers);
    free(h->shared_layers);
    free(h->view_layers);
    free(h->text);
    pthread_mutex_destroy(&h->lock);
    pthread_mutex_destroy(&h->render_lock);
    free(h);
}

tera_status tera_metrics_http_start(tera_metrics_http **out_h, const tera_trainer *tr) {
    *out_h = NULL;
    const tera_config *cfg = &tr->cfg;
    const int base = cfg->logging.metrics_port;
    if (base <= 0) return TERA_OK;
    const long port = (long)base + tr->topo.rank;
    if (port > 65535)
        return tera_fail(TERA_ERR_CONFIG, "logging.metrics_port = %d: world rank %d would serve on port %ld, above "
                         "65535 (each rank serves on metrics_port + its world rank); choose a lower base port",
                         base, tr->topo.rank, port);
    /* the listening socket is bound here, so that a port in use is named with its reason */
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "logging.metrics_port: cannot create a socket: %s", strerror(errno));
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one); /* a port in TIME_WAIT from a previous run is free */
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons((uint16_t)port);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 16) != 0) {
        const int err = errno;
        close(fd);
        return tera_fail(TERA_ERR_IO, "logging.metrics_port = %d: cannot serve metrics on port %ld (metrics_port + "
                         "world rank %d): %s; choose another logging.metrics_port, or 0 for no endpoint",
                         base, port, tr->topo.rank, err == EADDRINUSE ? "the port is in use" : strerror(err));
    }
    tera_metrics_http *h = tera_calloc(1, sizeof *h);
    pthread_mutex_init(&h->lock, NULL);
    pthread_mutex_init(&h->render_lock, NULL);
    h->port = (int)port, h->rank = tr->topo.rank, h->world = tr->topo.world;
    const tera_model *m = &tr->model;
    h->first_moe = m->cfg.first_k_dense < m->cfg.n_layers ? m->cfg.first_k_dense : m->cfg.n_layers;
    h->n_moe = m->cfg.n_experts > 0 ? m->cfg.n_layers - h->first_moe : 0;
    snprintf(h->info_labels, sizeof h->info_labels,
             "world_size=\"%d\",pp=\"%d\",dp=\"%d\",tp=\"%d\",ep=\"%d\",zero=\"%d\",pp_rank=\"%d\",dp_rank=\"%d\","
             "tp_rank=\"%d\"", tr->topo.world, tr->topo.pp, tr->topo.dp, tr->topo.tp, tr->topo.ep, tr->sharding->stage, tr->topo.pp_rank, tr->topo.dp_rank,
             tr->topo.tp_rank);
    h->mem[0] = (double)m->bytes_params;
    h->mem[1] = (double)m->bytes_grads;
    h->mem[2] = (double)tera_zero_optimizer_bytes(tr->sharding);
    h->mem[3] = (double)m->bytes_acts;
    h->mem[4] = (double)m->bytes_scratch;
    h->steps_target = cfg->training.steps;
    h->ckpt_every = cfg->checkpoint.every;
    h->start_unix = unix_now();
    const size_t nl = 2 * (size_t)h->n_moe + 1;
    h->pub_layers = tera_calloc(nl, sizeof(double));
    h->shared_layers = tera_calloc(nl, sizeof(double));
    h->view_layers = tera_calloc(nl, sizeof(double));
    h->pub.ckpt_unix = h->start_unix;
    h->traffic_prev = tera_comm_traffic_get();
    h->saves_prev = tera_ckpt_last_stats().saves;
    h->peak_flops = 1e12 * (double)cfg->logging.peak_tflops;
    h->pub.mfu = -1.0;
    h->shared = h->pub;
    /* the text: fixed families plus two lines per MoE layer, with room to spare */
    h->text_cap = 16384 + 256 * nl + 256 * TERA_HW_MAX + 128 * TERA_PROF_COUNT;
    h->text = tera_malloc(h->text_cap);
    /* one internal thread answers every request (poll/epoll); a client that stalls is dropped after
     * 10 s; at most 64 connections; 32 KiB per connection for the request */
    h->daemon = MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD, (uint16_t)port, NULL, NULL, on_request, h,
                                 MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_TIMEOUT, 10u,
                                 MHD_OPTION_CONNECTION_LIMIT, 64u, MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)32768, MHD_OPTION_END);
    if (!h->daemon) { /* fd is left alone: libmicrohttpd may have closed it already (the run stops here) */
        free_all(h);
        return tera_fail(TERA_ERR_IO, "logging.metrics_port = %d: libmicrohttpd could not start serving on port %ld",
                         base, port);
    }
    *out_h = h;
    return TERA_OK;
}

void tera_metrics_http_stop(tera_metrics_http *h) {
    if (!h) return;
    MHD_stop_daemon(h->daemon); /* joins the thread and closes the listening socket */
    free_all(h);
}
