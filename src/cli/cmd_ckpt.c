/* tera ckpt ls RUN_DIR | verify DIR | export-hf DIR --out HFDIR [--force] */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "tera/ckpt.h"
#include "tera/hf.h"

static void ckpt_usage(FILE *f) {
    fprintf(f, "usage: tera ckpt ls RUN_DIR            checkpoints of a run: step, kind, size, committed\n"
               "       tera ckpt verify DIR|RUN_DIR    re-hash every file against COMMIT and the manifest\n"
               "       tera ckpt export-hf DIR --out HFDIR [--force]   (full or differential) -> Hugging Face\n");
}

/* RUN_DIR/checkpoints when it exists, else the argument itself. */
static void ckpt_root(const char *arg, char *out, size_t cap) {
    struct stat sb;
    snprintf(out, cap, "%s/checkpoints", arg);
    if (stat(out, &sb) != 0 || !S_ISDIR(sb.st_mode)) snprintf(out, cap, "%s", arg);
}

static int cmd_ls(const char *arg) {
    char root[4200];
    ckpt_root(arg, root, sizeof root);
    tera_ckpt_info *v;
    int n;
    if (tera_ckpt_list(root, &v, &n) != TERA_OK) return tera_cli_error();
    printf("%-22s %10s %-6s %14s %s\n", "checkpoint", "step", "kind", "bytes", "committed");
    for (int i = 0; i < n; i++) {
        char kind[32];
        if (!v[i].committed) snprintf(kind, sizeof kind, "-");
        else if (v[i].full) snprintf(kind, sizeof kind, "full");
        else snprintf(kind, sizeof kind, "diff");
        char base[48] = "";
        if (v[i].committed && !v[i].full) snprintf(base, sizeof base, " (base step %" PRId64 ")", v[i].base_step);
        printf("%-22s %10" PRId64 " %-6s %14" PRId64 " %s%s\n", v[i].name, v[i].step, kind, v[i].bytes,
               v[i].committed ? "yes" : "no", base);
    }
    free(v);
    return 0;
}

static int cmd_verify(const char *arg) {
    char root[4200], dir[4400];
    struct stat sb;
    snprintf(dir, sizeof dir, "%s/COMMIT", arg);
    const int single = stat(dir, &sb) == 0 || strstr(arg, "step_") != NULL;
    if (single) {
        if (tera_ckpt_verify(arg, stdout) != TERA_OK) return tera_cli_error();
        printf("ok: %s\n", arg);
        return 0;
    }
    ckpt_root(arg, root, sizeof root);
    tera_ckpt_info *v;
    int n, bad = 0, checked = 0;
    if (tera_ckpt_list(root, &v, &n) != TERA_OK) return tera_cli_error();
    for (int i = 0; i < n; i++) {
        snprintf(dir, sizeof dir, "%s/%s", root, v[i].name);
        if (!v[i].committed) {
            printf("skipped (not committed): %s\n", dir);
            continue;
        }
        checked++;
        if (tera_ckpt_verify(dir, stdout) != TERA_OK) {
            bad++;
            fprintf(stderr, "tera: error: %s\n", tera_last_error());
        } else {
            printf("ok: %s\n", dir);
        }
    }
    free(v);
    if (!checked) {
        tera_fail(TERA_ERR_IO, "%s: no committed checkpoint", root);
        return tera_cli_error();
    }
    return bad ? 1 : 0;
}

static int cmd_export(int argc, char **argv) {
    tera_config cfg;
    static const char *const flags[] = {"force", NULL};
    static const char *const opts[] = {"out", "max-shard-bytes", NULL};
    int set[1] = {0};
    const char *val[2] = {NULL, NULL};
    if (argc < 1 || argv[0][0] == '-') {
        tera_fail(TERA_ERR_ARG, "ckpt export-hf needs a checkpoint directory: tera ckpt export-hf DIR --out HFDIR");
        return tera_cli_error();
    }
    const char *dir = argv[0];
    if (tera_cli_parse(argc - 1, argv + 1, &cfg, flags, set, opts, val)) return 1;
    if (!val[0]) {
        tera_fail(TERA_ERR_ARG, "ckpt export-hf needs --out HFDIR");
        return tera_cli_error();
    }
    int64_t shard = val[1] ? strtoll(val[1], NULL, 10) : 0;
    if (tera_ckpt_verify(dir, stderr) != TERA_OK) return tera_cli_error();
    /* the run's configuration is in the checkpoint */
    char path[4400];
    snprintf(path, sizeof path, "%s/config.ini", dir);
    tera_config_defaults(&cfg);
    if (tera_config_load(&cfg, path) != TERA_OK) return tera_cli_error();
    cfg.training.seq_len = 1;
    cfg.training.micro_batch = 1;
    if (tera_config_finalize(&cfg) != TERA_OK) return tera_cli_error();
    tera_model m;
    if (tera_model_create(&m, &cfg.model, 1, 1) != TERA_OK) return tera_cli_error();
    tera_status st = tera_ckpt_load(dir, &m, NULL, NULL);
    if (st == TERA_OK) st = tera_hf_export(&m, val[0], shard, set[0]);
    tera_model_destroy(&m);
    if (st != TERA_OK) return tera_cli_error();
    fprintf(stderr, "tera: exported %s -> %s\n", dir, val[0]);
    return 0;
}

int tera_cmd_ckpt(int argc, char **argv) {
    if (argc < 1 || !strcmp(argv[0], "-h") || !strcmp(argv[0], "--help")) {
        ckpt_usage(argc < 1 ? stderr : stdout);
        return argc < 1 ? 2 : 0;
    }
    if (!strcmp(argv[0], "ls") && argc == 2) return cmd_ls(argv[1]);
    if (!strcmp(argv[0], "verify") && argc == 2) return cmd_verify(argv[1]);
    if (!strcmp(argv[0], "export-hf")) return cmd_export(argc - 1, argv + 1);
    fprintf(stderr, "tera: error: unknown or incomplete ckpt command\n");
    ckpt_usage(stderr);
    return 2;
}
