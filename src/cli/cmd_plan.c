/* tera plan: memory per rank of a layout without allocating it (--dry-run; also `tera train
 * --dry-run`), and the search for the fastest layout that fits a device count (docs/PLAN.md). */
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "tera/comm.h"
#include "tera/model.h"
#include "tera/plan.h"

static double gib(int64_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

static void layout_line(FILE *f, const tera_config *c) {
    const tera_parallel_config *p = &c->parallel;
    fprintf(f, "pp %d x dp %d x tp %d (%d ranks)%s, dp %d = edp %d x ep %d, ZeRO %d", p->pp, p->dp, p->tp,
            p->pp * p->dp * p->tp, p->tp > 1 && p->sequence_parallel ? " sequence-parallel" : "", p->dp, p->dp / p->ep,
            p->ep, p->dp > 1 ? p->zero : 0);
    if (p->pp > 1) fprintf(f, ", %s", p->pp_schedule);
    if (p->pp_chunks > 1) fprintf(f, " x %d chunks", p->pp_chunks);
    if (p->pp > 1 && p->pp_head_split) fprintf(f, ", head split");
    if (p->pp > 1 && p->pp_defer_wgrad) fprintf(f, ", head weight gradients deferred (%d)", p->pp_defer_wgrad);
    fprintf(f, ", micro-batch %d x accum %d (T %d), recompute %s", c->training.micro_batch, c->training.grad_accum,
            c->training.seq_len, c->training.recompute[0] ? c->training.recompute : "none");
    if (c->training.loss_chunk > 0) fprintf(f, ", loss_chunk %d", c->training.loss_chunk);
}

static void mem_json(cJSON *o, const tera_plan_mem *m) {
    for (int k = 0; k < TERA_PM_N; k++) cJSON_AddNumberToObject(o, tera_pm_name[k], (double)m->bytes[k]);
    cJSON_AddNumberToObject(o, "printed_total", (double)m->printed_total);
    cJSON_AddNumberToObject(o, "total", (double)m->total);
}

static void mem_text(FILE *f, const tera_plan_mem *m, const char *indent) {
    fprintf(f, "%sbytes:", indent);
    for (int k = 0; k < TERA_PM_N; k++) fprintf(f, " %s %lld", tera_pm_name[k], (long long)m->bytes[k]);
    fprintf(f, "\n%sGiB:  ", indent);
    for (int k = 0; k < TERA_PM_N; k++) fprintf(f, " %s %.2f", tera_pm_name[k], gib(m->bytes[k]));
    fprintf(f, " | total %.2f (tera train's line: %.2f)\n", gib(m->total), gib(m->printed_total));
}

static void time_json(cJSON *o, const tera_plan_time *t) {
    cJSON_AddNumberToObject(o, "step_s", t->step_s);
    cJSON_AddNumberToObject(o, "compute_s", t->compute_s);
    cJSON_AddNumberToObject(o, "matmul_s", t->matmul_s);
    cJSON_AddNumberToObject(o, "memory_s", t->memory_s);
    cJSON_AddNumberToObject(o, "bubble_s", t->bubble_s);
    cJSON_AddNumberToObject(o, "bubble_frac", t->bubble_frac);
    cJSON_AddNumberToObject(o, "tp_s", t->tp_s);
    cJSON_AddNumberToObject(o, "ep_s", t->ep_s);
    cJSON_AddNumberToObject(o, "pp_s", t->pp_s);
    cJSON_AddNumberToObject(o, "dp_exposed_s", t->dp_s);
    cJSON_AddNumberToObject(o, "dp_total_s", t->dp_total_s);
    cJSON_AddNumberToObject(o, "tokens_per_s", t->tokens_per_s);
    cJSON_AddNumberToObject(o, "tokens_per_day", t->tokens_per_s * 86400.0);
    cJSON_AddNumberToObject(o, "mfu", t->mfu);
    cJSON_AddNumberToObject(o, "flops_per_step", t->flops_per_step);
    cJSON_AddNumberToObject(o, "recompute_flops_per_step", t->recompute_flops);
    cJSON_AddNumberToObject(o, "bytes_tp", t->bytes_tp);
    cJSON_AddNumberToObject(o, "bytes_ep", t->bytes_ep);
    cJSON_AddNumberToObject(o, "bytes_pp", t->bytes_pp);
    cJSON_AddNumberToObject(o, "bytes_dp", t->bytes_dp);
    cJSON_AddNumberToObject(o, "optimizer_s", t->optimizer_s);
    cJSON_AddNumberToObject(o, "ep_hidden_s", t->ep_hidden_s);
}

static void time_text(FILE *f, const tera_plan_time *t, int64_t devices, const char *indent) {
    fprintf(f, "%sstep %.4g s = compute %.4g (products %.4g, memory passes %.4g) + bubble %.4g (%.1f%%) + tp %.4g + ep %.4g + pp %.4g + dp exposed %.4g "
            "(of %.4g)\n", indent, t->step_s, t->compute_s, t->matmul_s, t->memory_s, t->bubble_s, 100.0 * t->bubble_frac, t->tp_s, t->ep_s,
            t->pp_s, t->dp_s, t->dp_total_s);
    fprintf(f, "%s%.4g tokens/s, %.4g tokens/day, MFU %.1f%%, %.4g device-hours per 1e12 tokens\n", indent,
            t->tokens_per_s, t->tokens_per_s * 86400.0, 100.0 * t->mfu, (double)devices * 1e12 / t->tokens_per_s / 3600.0);
}

static int parse_num(const char *opt, const char *val, double lo, double hi, double *out) {
    char *end;
    const double v = strtod(val, &end);
    if (end == val || *end || !(v >= lo && v <= hi)) {
        tera_fail(TERA_ERR_ARG, "--%s '%s' is not a number in %g..%g", opt, val, lo, hi);
        return 1;
    }
    *out = v;
    return 0;
}

static void print_json(cJSON *root) {
    char *s = cJSON_Print(root);
    printf("%s\n", s);
    free(s);
    cJSON_Delete(root);
}

int tera_cmd_plan(int argc, char **argv) {
    tera_config cfg;
    static const char *const flags[] = {"dry-run", "json", "calibrate", "shared-only", "force", NULL};
    int set[5] = {0, 0, 0, 0, 0};
    enum { O_HW, O_DEV, O_GB, O_T, O_TOP, O_WRITE, O_EFF, O_RES, O_MAXTP, O_THREADS, O_OUT, O_XB, O_XO, O_PROD, O_CO, O_N };
    static const char *const opts[] = {"hardware", "devices", "global-batch", "seq-len", "top", "write-config",
                                       "efficiency", "reserve", "max-tp", "threads", "out", "exchange-bytes",
                                       "exchange-overlap", "products", "comm-overlap", NULL};
    const char *val[O_N] = {NULL};
    /* --seq-len is a shorthand for --training.seq_len: applied before the configuration is finalized */
    char seq_arg[64] = "";
    char **args = tera_calloc((size_t)argc + 1, sizeof(char *));
    int n = 0;
    for (int i = 0; i < argc; i++) {
        if (!strncmp(argv[i], "--seq-len", 9) && (argv[i][9] == '=' || argv[i][9] == 0)) {
            const char *v = argv[i][9] == '=' ? argv[i] + 10 : i + 1 < argc ? argv[++i] : "";
            snprintf(seq_arg, sizeof seq_arg, "--training.seq_len=%s", v);
            args[n++] = seq_arg;
            continue;
        }
        args[n++] = argv[i];
    }
    const int bad = tera_cli_parse(n, args, &cfg, flags, set, opts, val);
    free(args);
    if (bad) return 1;
    if (set[2]) { /* tera plan --calibrate [--out FILE]: every rank takes part (the collectives) */
        const char *out = val[O_OUT] ? val[O_OUT] : "hardware/this-machine.ini";
        const int root = tera_comm_rank(tera_comm_world()) == 0;
        if ((set[3] ? tera_plan_calibrate_shared : tera_plan_calibrate)(&cfg, out, root ? stdout : NULL) != TERA_OK)
            return tera_cli_error();
        if (root) printf("wrote %s\n", out);
        return 0;
    }
    /* under mpirun (tera train --dry-run in a launch script): one rank answers, nothing is allocated */
    if (tera_comm_rank(tera_comm_world()) != 0) return 0;
    const int dry = set[0], json = set[1];
    if (val[O_WRITE]) { /* checked before the search: never the hardware file or a -c file it reads */
        const char **inputs = tera_calloc((size_t)argc + 2, sizeof(char *));
        int k = 0;
        if (val[O_HW]) inputs[k++] = val[O_HW];
        for (int i = 0; i + 1 < argc; i++)
            if (!strcmp(argv[i], "-c") || !strcmp(argv[i], "--config")) inputs[k++] = argv[i + 1];
        const int refused = tera_cli_refuse_output("--write-config", val[O_WRITE], set[4], inputs);
        free(inputs);
        if (refused) return 1;
    }
    tera_plan_opts po = {.efficiency = 0.40, .reserve = 0.10, .threads = 0, .products_prec = -1};
    double x;
    if (val[O_EFF]) {
        if (parse_num("efficiency", val[O_EFF], 0.01, 1.0, &x)) return tera_cli_error();
        po.efficiency = x;
    }
    if (val[O_RES]) {
        if (parse_num("reserve", val[O_RES], 0.0, 0.9, &x)) return tera_cli_error();
        po.reserve = x;
    }
    if (val[O_THREADS]) {
        if (parse_num("threads", val[O_THREADS], 1, 4096, &x)) return tera_cli_error();
        po.threads = (int)x;
    }
    if (val[O_XB]) {
        if (parse_num("exchange-bytes", val[O_XB], 0.25, 8, &x)) return tera_cli_error();
        po.exchange_bytes = x;
    }
    if (val[O_PROD]) {
        for (int p = 0; p < TERA_HW_NPREC; p++)
            if (!strcmp(val[O_PROD], tera_hw_prec_name[p])) po.products_prec = p;
        if (po.products_prec < 0) {
            tera_fail(TERA_ERR_ARG, "--products '%s' is not fp32, bf16, fp16 or fp8", val[O_PROD]);
            return tera_cli_error();
        }
    }
    if (val[O_CO]) {
        if (parse_num("comm-overlap", val[O_CO], 0, 1, &x)) return tera_cli_error();
        po.comm_overlap = x;
    }
    if (val[O_XO]) {
        if (parse_num("exchange-overlap", val[O_XO], 0, 1, &x)) return tera_cli_error();
        po.exchange_overlap = x;
    }
    tera_hw hw;
    const int have_hw = val[O_HW] != NULL;
    if (have_hw && tera_hw_load(&hw, val[O_HW]) != TERA_OK) return tera_cli_error();

    if (dry) { /* the configuration's own layout, every distinct rank role */
        tera_plan_mem *roles;
        int nr;
        if (tera_plan_roles(&cfg, po.threads, &roles, &nr) != TERA_OK) return tera_cli_error();
        tera_plan_time tm;
        const int timed = have_hw && tera_plan_time_model(&cfg, &hw, &po, &tm) == TERA_OK;
        if (have_hw && !timed) {
            free(roles);
            return tera_cli_error();
        }
        const int64_t world = (int64_t)cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.tp;
        int64_t worst = 0;
        for (int i = 0; i < nr; i++)
            if (roles[i].total > worst) worst = roles[i].total;
        if (json) {
            cJSON *root = cJSON_CreateObject();
            cJSON *lay = cJSON_AddObjectToObject(root, "layout");
            cJSON_AddNumberToObject(lay, "ranks", (double)world);
            cJSON_AddNumberToObject(lay, "pp", cfg.parallel.pp);
            cJSON_AddNumberToObject(lay, "dp", cfg.parallel.dp);
            cJSON_AddNumberToObject(lay, "tp", cfg.parallel.tp);
            cJSON_AddNumberToObject(lay, "ep", cfg.parallel.ep);
            cJSON_AddNumberToObject(lay, "zero", cfg.parallel.dp > 1 ? cfg.parallel.zero : 0);
            cJSON_AddStringToObject(lay, "pp_schedule", cfg.parallel.pp_schedule);
            cJSON_AddNumberToObject(lay, "pp_chunks", cfg.parallel.pp_chunks);
            cJSON_AddBoolToObject(lay, "pp_head_split", cfg.parallel.pp > 1 && cfg.parallel.pp_head_split);
            cJSON_AddNumberToObject(lay, "pp_defer_wgrad", cfg.parallel.pp > 1 ? cfg.parallel.pp_defer_wgrad : 0);
            cJSON_AddNumberToObject(lay, "micro_batch", cfg.training.micro_batch);
            cJSON_AddNumberToObject(lay, "grad_accum", cfg.training.grad_accum);
            cJSON_AddNumberToObject(lay, "seq_len", cfg.training.seq_len);
            cJSON_AddStringToObject(lay, "recompute", cfg.training.recompute);
            cJSON_AddNumberToObject(lay, "loss_chunk", cfg.training.loss_chunk);
            cJSON_AddNumberToObject(root, "total_params", (double)tera_model_total_params(&cfg.model));
            cJSON_AddNumberToObject(root, "active_params", (double)tera_model_active_params(&cfg.model));
            cJSON *arr = cJSON_AddArrayToObject(root, "roles");
            for (int i = 0; i < nr; i++) {
                cJSON *o = cJSON_CreateObject();
                cJSON_AddNumberToObject(o, "pp_rank", roles[i].pp_rank);
                cJSON_AddNumberToObject(o, "dp_rank", roles[i].dp_rank);
                cJSON_AddNumberToObject(o, "world_rank",
                                        ((double)roles[i].pp_rank * cfg.parallel.dp + roles[i].dp_rank) * cfg.parallel.tp);
                cJSON_AddNumberToObject(o, "ranks", roles[i].n_ranks);
                cJSON_AddNumberToObject(o, "slots", roles[i].slots);
                cJSON_AddNumberToObject(o, "non_expert_floats", (double)roles[i].n_dense);
                cJSON_AddNumberToObject(o, "expert_floats", (double)(roles[i].n_floats - roles[i].n_dense));
                mem_json(o, &roles[i]);
                cJSON_AddItemToArray(arr, o);
            }
            cJSON_AddNumberToObject(root, "worst_total", (double)worst);
            if (timed) {
                cJSON_AddStringToObject(root, "hardware", hw.name);
                cJSON_AddNumberToObject(root, "device_bytes", hw.memory_bytes);
                cJSON_AddBoolToObject(root, "fits", (double)worst <= hw.memory_bytes * (1.0 - po.reserve));
                time_json(cJSON_AddObjectToObject(root, "time"), &tm);
            }
            print_json(root);
        } else {
            printf("tera plan --dry-run: ");
            layout_line(stdout, &cfg);
            printf("\nmodel: %.4g parameters, %.4g active per token; nothing allocated\n",
                   (double)tera_model_total_params(&cfg.model), (double)tera_model_active_params(&cfg.model));
            printf("%d distinct rank role%s (the first six categories are tera train's \"memory bytes per rank\" line):\n",
                   nr, nr == 1 ? "" : "s");
            for (int i = 0; i < nr; i++) {
                printf("  stage %d, dp rank %d (%d rank%s alike; %d activation slot%s; %lld non-expert + %lld expert "
                       "floats):\n", roles[i].pp_rank, roles[i].dp_rank, roles[i].n_ranks, roles[i].n_ranks == 1 ? "" : "s",
                       roles[i].slots, roles[i].slots == 1 ? "" : "s", (long long)roles[i].n_dense,
                       (long long)(roles[i].n_floats - roles[i].n_dense));
                mem_text(stdout, &roles[i], "    ");
            }
            if (timed) {
                printf("on %s (%.1f GiB, reserve %.0f%%): the largest rank needs %.2f GiB: %s\n", hw.name,
                       gib((int64_t)hw.memory_bytes), 100.0 * po.reserve, gib(worst),
                       (double)worst <= hw.memory_bytes * (1.0 - po.reserve) ? "fits" : "does NOT fit");
                if (hw.n_gemm)
                    printf("time model (%d measured product rates, %d attention, %d collective fits from %s):\n",
                           hw.n_gemm, hw.n_attn, hw.n_coll, val[O_HW]);
                else
                    printf("time model (products at %.0f%% of the %s peak: an assumption, no measured rates):\n",
                           100.0 * (hw.gemm_efficiency > 0 ? hw.gemm_efficiency : po.efficiency), cfg.training.precision);
                time_text(stdout, &tm, world, "  ");
            }
        }
        free(roles);
        return 0;
    }

    /* the search */
    if (!have_hw || !val[O_DEV] || !val[O_GB]) {
        tera_fail(TERA_ERR_ARG, "tera plan needs --hardware FILE --devices N --global-batch B (sequences per step), "
                                "or --dry-run for the configuration's own layout (tera plan --help)");
        return tera_cli_error();
    }
    tera_plan_search_opts so = {.keep = 5};
    if (parse_num("devices", val[O_DEV], 1, 1 << 20, &x)) return tera_cli_error();
    so.devices = (int)x;
    if (parse_num("global-batch", val[O_GB], 1, 1 << 24, &x)) return tera_cli_error();
    so.global_batch = (int)x;
    if (val[O_TOP]) {
        if (parse_num("top", val[O_TOP], 1, 100, &x)) return tera_cli_error();
        so.keep = (int)x;
    }
    if (val[O_MAXTP]) {
        if (parse_num("max-tp", val[O_MAXTP], 1, 1024, &x)) return tera_cli_error();
        so.max_tp = (int)x;
    }
    if (hw.peak_flops[tera_hw_prec_of(cfg.training.precision)] <= 0) {
        tera_fail(TERA_ERR_CONFIG, "%s: no peak for training.precision = %s", val[O_HW], cfg.training.precision);
        return tera_cli_error();
    }
    tera_plan_candidate *best;
    int nb;
    int64_t n_valid, n_fit;
    if (tera_plan_search(&cfg, &hw, &po, &so, &best, &nb, &n_valid, &n_fit) != TERA_OK) return tera_cli_error();
    const double tokens = (double)so.global_batch * cfg.training.seq_len;
    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "hardware", hw.name);
        cJSON_AddNumberToObject(root, "devices", so.devices);
        cJSON_AddNumberToObject(root, "global_batch", so.global_batch);
        cJSON_AddNumberToObject(root, "seq_len", cfg.training.seq_len);
        cJSON_AddNumberToObject(root, "total_params", (double)tera_model_total_params(&cfg.model));
        cJSON_AddNumberToObject(root, "active_params", (double)tera_model_active_params(&cfg.model));
        cJSON_AddNumberToObject(root, "device_bytes", hw.memory_bytes);
        cJSON_AddNumberToObject(root, "reserve", po.reserve);
        cJSON_AddNumberToObject(root, "efficiency", po.efficiency);
        cJSON_AddNumberToObject(root, "valid_layouts", (double)n_valid);
        cJSON_AddNumberToObject(root, "fitting_layouts", (double)n_fit);
        cJSON *arr = cJSON_AddArrayToObject(root, "best");
        for (int i = 0; i < nb; i++) {
            const tera_config *c = &best[i].cfg;
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "pp", c->parallel.pp);
            cJSON_AddNumberToObject(o, "dp", c->parallel.dp);
            cJSON_AddNumberToObject(o, "tp", c->parallel.tp);
            cJSON_AddBoolToObject(o, "sequence_parallel", c->parallel.tp > 1 && c->parallel.sequence_parallel);
            cJSON_AddNumberToObject(o, "ep", c->parallel.ep);
            cJSON_AddNumberToObject(o, "zero", c->parallel.zero);
            cJSON_AddStringToObject(o, "pp_schedule", c->parallel.pp_schedule);
            cJSON_AddNumberToObject(o, "pp_chunks", c->parallel.pp_chunks);
            cJSON_AddBoolToObject(o, "pp_head_split", c->parallel.pp > 1 && c->parallel.pp_head_split);
            cJSON_AddNumberToObject(o, "pp_defer_wgrad", c->parallel.pp > 1 ? c->parallel.pp_defer_wgrad : 0);
            cJSON_AddNumberToObject(o, "micro_batch", c->training.micro_batch);
            cJSON_AddNumberToObject(o, "grad_accum", c->training.grad_accum);
            cJSON_AddStringToObject(o, "recompute", c->training.recompute);
            cJSON_AddNumberToObject(o, "loss_chunk", c->training.loss_chunk);
            cJSON *mo = cJSON_AddObjectToObject(o, "memory_worst_rank");
            cJSON_AddNumberToObject(mo, "pp_rank", best[i].worst.pp_rank);
            mem_json(mo, &best[i].worst);
            time_json(cJSON_AddObjectToObject(o, "time"), &best[i].time);
            cJSON_AddNumberToObject(o, "device_hours_per_1e12_tokens",
                                    (double)so.devices * 1e12 / best[i].time.tokens_per_s / 3600.0);
            cJSON_AddItemToArray(arr, o);
        }
        print_json(root);
    } else {
        printf("tera plan: %.4g parameters (%.4g active per token) on %d x %s (%.1f GiB, reserve %.0f%%), global batch "
               "%d x %d = %.4g tokens per step, precision %s, products at %.0f%% of peak where not measured\n",
               (double)tera_model_total_params(&cfg.model), (double)tera_model_active_params(&cfg.model), so.devices,
               hw.name, gib((int64_t)hw.memory_bytes), 100.0 * po.reserve, so.global_batch, cfg.training.seq_len,
               tokens, cfg.training.precision, 100.0 * (hw.gemm_efficiency > 0 ? hw.gemm_efficiency : po.efficiency));
        printf("%lld layouts valid (accepted by the configuration checks), %lld fit; the best %d:\n",
               (long long)n_valid, (long long)n_fit, nb);
        for (int i = 0; i < nb; i++) {
            printf("#%d ", i + 1);
            layout_line(stdout, &best[i].cfg);
            printf("\n  memory of the largest rank (stage %d), %.2f GiB:\n", best[i].worst.pp_rank, gib(best[i].worst.total));
            mem_text(stdout, &best[i].worst, "    ");
            time_text(stdout, &best[i].time, so.devices, "  ");
        }
        if (nb == 0) printf("no layout fits: more devices, a smaller micro-batch or sequence, or recompute\n");
    }
    int rc = 0;
    if (val[O_WRITE]) {
        if (nb == 0) {
            tera_fail(TERA_ERR_CONFIG, "--write-config %s: no layout fits, nothing written", val[O_WRITE]);
            rc = tera_cli_error();
        } else if (tera_config_write(&best[0].cfg, val[O_WRITE]) != TERA_OK) {
            rc = tera_cli_error();
        } else if (!json) {
            printf("wrote the best layout to %s (tera train -c %s, under mpirun -np %d)\n", val[O_WRITE], val[O_WRITE],
                   so.devices);
        }
    }
    free(best);
    return rc;
}
