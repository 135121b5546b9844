/* tera ckpt ls RUN_DIR | verify DIR | export-hf DIR --out HFDIR [--force]
 *           convert --from CKPT_DIR --out RUN_DIR [--force] [--section.key=value ...] (under mpirun) */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "tera/ckpt.h"
#include "tera/comm.h"
#include "tera/hf.h"
#include "tera/io.h"
#include "tera/train.h"

static void ckpt_usage(FILE *f) {
    fprintf(f, "usage: tera ckpt ls RUN_DIR            checkpoints of a run: step, kind, size, committed\n"
               "       tera ckpt verify DIR|RUN_DIR    re-hash every file against COMMIT and the manifest\n"
               "       tera ckpt export-hf DIR --out HFDIR [--force]   (full or differential) -> Hugging Face\n"
               "       [mpirun -np N] tera ckpt convert --from CKPT_DIR|RUN_DIR --out RUN_DIR [--force]\n"
               "                 [-c FILE] [--section.key=value ...]\n"
               "           reshard a checkpoint (full or differential, saved under any layout) for another\n"
               "           layout: the checkpoint's config.ini, then the options (e.g. --parallel.tp=4), give\n"
               "           the new run configuration; writes RUN_DIR/checkpoints/step_N and RUN_DIR/config.ini,\n"
               "           from which `[mpirun -np N] tera train -c RUN_DIR/config.ini --resume` continues\n");
}

/* RUN_DIR/checkpoints when it exists, else the argument itself; a RUN_DIR/checkpoints that is there
 * but no directory (a file, a dangling link), or an argument that is not there at all, is an error
 * naming it (1), not an empty list. */
static int ckpt_root(const char *arg, char *out, size_t cap) {
    struct stat sb;
    snprintf(out, cap, "%s/checkpoints", arg);
    const int found = stat(out, &sb) == 0, err = errno;
    if (found && S_ISDIR(sb.st_mode)) return 0;
    if (found || lstat(out, &sb) == 0) {
        if (found) tera_fail(TERA_ERR_IO, "%s: not a directory", out);
        else tera_fail(TERA_ERR_IO, "%s: cannot follow the link: %s", out, strerror(err));
        return 1;
    }
    if (stat(arg, &sb) != 0) {
        tera_fail(TERA_ERR_IO, "%s: %s", arg, strerror(errno));
        return 1;
    }
    snprintf(out, cap, "%s", arg);
    return 0;
}

static int cmd_ls(const char *arg) {
    char root[4200];
    if (ckpt_root(arg, root, sizeof root)) return tera_cli_error();
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
    if (ckpt_root(arg, root, sizeof root)) return tera_cli_error();
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
    static const char *const flags[] = {"force", "tera-moe", NULL};
    static const char *const opts[] = {"out", "max-shard-bytes", NULL};
    int set[2] = {0, 0};
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
    /* streamed: each tensor read from the checkpoint piece by piece, never the whole model */
    if (tera_ckpt_export_hf(dir, &cfg.model, val[0], shard, set[0], set[1]) != TERA_OK) return tera_cli_error();
    fprintf(stderr, "tera: exported %s -> %s\n", dir, val[0]);
    return 0;
}

/* ------------------------------------------------------------------ convert */

/* Every rank has the same status (the ranks read the same files; one that failed alone is named). */
static tera_status agree(tera_status st) {
    tera_comm *w = tera_comm_world();
    if (tera_comm_size(w) == 1) return st;
    int64_t failed = st != TERA_OK;
    tera_comm_allreduce_i64(w, &failed, 1);
    if (!failed) return TERA_OK;
    if (st == TERA_OK) return tera_fail(TERA_ERR_IO, "ckpt convert failed on another rank (see its message)");
    if (failed == tera_comm_size(w) && tera_comm_rank(w) != 0)
        return tera_fail(st, "ckpt convert failed on every rank (see rank 0's message)");
    return st;
}

/* tera_ckpt_verify, its first problem (the file at fault) as the one error message. */
static tera_status verify_named(const char *dir) {
    char *text = NULL;
    size_t len = 0;
    FILE *rep = open_memstream(&text, &len);
    if (!rep) return tera_ckpt_verify(dir, NULL);
    tera_status st = tera_ckpt_verify(dir, rep);
    fclose(rep);
    if (st != TERA_OK) {
        char *nl = text ? strchr(text, '\n') : NULL;
        if (nl) *nl = 0;
        st = tera_fail(st, "%s (`tera ckpt verify %s` lists every problem)", text && *text ? text : dir, dir);
    }
    free(text);
    return st;
}

/* The checkpoint to read: a step directory, or the newest committed one of a run directory.
 * It must be committed and verify, and so must the base of a differential one (cli.h). */
tera_status tera_cli_ckpt_source(const char *arg, char *dir, size_t cap) {
    struct stat sb;
    char path[4400];
    if (stat(arg, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return tera_fail(TERA_ERR_IO, "--from '%s': no such checkpoint directory", arg);
    snprintf(path, sizeof path, "%s/checkpoints", arg);
    snprintf(dir, cap, "%s", arg);
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) TERA_TRY(tera_ckpt_find_latest(arg, dir, cap));
    TERA_TRY(verify_named(dir));
    /* a differential checkpoint: its base full one (step_B beside it) */
    char root[4400], name[256];
    snprintf(root, sizeof root, "%s", dir);
    size_t k = strlen(root);
    while (k > 1 && root[k - 1] == '/') root[--k] = 0;
    char *slash = strrchr(root, '/');
    snprintf(name, sizeof name, "%s", slash ? slash + 1 : root);
    if (slash == root) root[1] = 0;
    else if (slash) *slash = 0;
    else snprintf(root, sizeof root, ".");
    tera_ckpt_info *v;
    int n;
    TERA_TRY(tera_ckpt_list(root, &v, &n));
    tera_status st = TERA_OK;
    for (int i = 0; i < n && st == TERA_OK; i++) {
        if (strcmp(v[i].name, name) != 0 || v[i].full || v[i].base_step < 0) continue;
        snprintf(path, sizeof path, "%s/step_%08" PRId64, root, v[i].base_step);
        st = verify_named(path);
    }
    free(v);
    return st;
}

static int dir_nonempty(const char *path) {
    DIR *d = opendir(path);
    if (!d) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, TERA_RUN_LOCK_NAME);
    closedir(d);
    return n > 0;
}

/* 1 when path a lies inside b (or is b); both must exist to overlap. */
static int path_within(const char *a, const char *b) {
    char ra[PATH_MAX], rb[PATH_MAX];
    if (!realpath(a, ra) || !realpath(b, rb)) return 0;
    const size_t n = strlen(rb);
    return !strncmp(ra, rb, n) && (ra[n] == 0 || ra[n] == '/' || (n == 1 && rb[0] == '/'));
}

/* The value of --NAME=V or --NAME V in argv (NULL when absent). */
static const char *find_opt(int argc, char **argv, const char *name) {
    const size_t n = strlen(name);
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "--", 2) != 0 || strncmp(argv[i] + 2, name, n) != 0) continue;
        if (argv[i][2 + n] == '=') return argv[i] + 3 + n;
        if (argv[i][2 + n] == 0 && i + 1 < argc) return argv[i + 1];
    }
    return NULL;
}

/* Loads the checkpoint into a trainer built for the new layout (every rank keeps its part) and
 * saves it through the normal path (every rank contributes, rank 0 writes): the converted
 * checkpoint is bit for bit the one the old layout wrote, with the new configuration. */
static int cmd_convert(int argc, char **argv) {
    const int root = tera_comm_rank(tera_comm_world()) == 0;
    const char *from = find_opt(argc, argv, "from");
    char dir[4400] = "", ini[4500];
    tera_status st = from ? tera_cli_ckpt_source(from, dir, sizeof dir)
                          : tera_fail(TERA_ERR_ARG, "ckpt convert needs --from CKPT_DIR (a checkpoint or a run directory)");
    if (agree(st) != TERA_OK) return tera_cli_error();
    /* the checkpoint's run configuration first, then -c files and --section.key=value overrides */
    snprintf(ini, sizeof ini, "%s/config.ini", dir);
    char **av = tera_malloc(sizeof(char *) * (size_t)(argc + 3));
    av[0] = (char *)"-c";
    av[1] = ini;
    memcpy(av + 2, argv, sizeof(char *) * (size_t)argc);
    tera_config cfg;
    static const char *const flags[] = {"force", NULL};
    static const char *const opts[] = {"from", "out", NULL};
    int set[1] = {0};
    const char *val[2] = {NULL, NULL};
    const int bad = tera_cli_parse(argc + 2, av, &cfg, flags, set, opts, val);
    free(av);
    if (bad) return 1;
    const char *out = val[1];
    char owner[PATH_MAX];
    tera_dir_owner kind = TERA_OWNER_NONE;
    if (!out || !*out) st = tera_fail(TERA_ERR_ARG, "ckpt convert needs --out RUN_DIR (the run directory to write)");
    else if (path_within(dir, out) || path_within(out, dir))
        st = tera_fail(TERA_ERR_ARG, "ckpt convert: --out '%s' holds or lies inside the checkpoint '%s'; choose "
                       "another run directory", out, dir);
    else if ((kind = tera_ckpt_dir_owner(out, owner, sizeof owner)) == TERA_OWNER_CHECKPOINT ||
             kind == TERA_OWNER_CHECKPOINTS) /* a run directory there: deleted with the run's checkpoints */
        st = tera_fail(TERA_ERR_ARG, "ckpt convert: --out '%s' lies inside %s %s; a converted run goes to a run "
                       "directory of its own", out, kind == TERA_OWNER_CHECKPOINT ? "the tera checkpoint" :
                       "the run's checkpoint directory", owner);
    else if (dir_nonempty(out) && !set[0])
        st = tera_fail(TERA_ERR_EXISTS, "ckpt convert: run directory '%s' already exists and is not empty; choose "
                       "another --out or pass --force to replace its checkpoints and metrics", out);
    if (agree(st) != TERA_OK) return tera_cli_error();
    /* every check that needs no trainer passed: lock --out (creating it when missing) */
    tera_run_lock lock = {.fd = -1};
    if (agree(root ? tera_run_lock_acquire(&lock, out) : TERA_OK) != TERA_OK) return tera_cli_error();
    const int created = lock.created_dir;
    snprintf(cfg.logging.run_dir, sizeof cfg.logging.run_dir, "%s", out);
    cfg.training.init_from[0] = 0; /* the weights come from the checkpoint */
    /* nothing is written into --out until the checkpoint has loaded under the new layout: the
     * trainer continues (writes nothing), --force's removal and config.ini come after */
    tera_trainer tr;
    long step = 0;
    if (!tera_cli_given("logging.metrics_port")) cfg.logging.metrics_port = 0; /* a conversion serves no metrics */
    st = tera_trainer_init(&tr, &cfg, out, TERA_RUN_CONTINUE);
    if (st == TERA_OK) {
        st = agree(tera_trainer_resume_dir(&tr, dir));
        if (st == TERA_OK && set[0]) { /* --force: the old run's metrics and checkpoints go, as train --force */
            char path[4600];
            tera_status rs = TERA_OK;
            if (root) {
                snprintf(path, sizeof path, "%s/metrics.jsonl", out);
                if (unlink(path) != 0 && errno != ENOENT)
                    rs = tera_fail(TERA_ERR_IO, "cannot remove %s: %s", path, strerror(errno));
                snprintf(path, sizeof path, "%s/checkpoints", out);
                if (rs == TERA_OK && access(path, F_OK) == 0) rs = tera_ckpt_rmtree(path);
            }
            st = agree(rs);
        }
        tr.ckpt.last = 1; /* synchronous: nothing runs beside it */
        if (st == TERA_OK) st = tera_trainer_save(&tr); /* collective; every rank learns the outcome */
        if (st == TERA_OK) st = agree(tera_trainer_ckpt_close(&tr));
        if (st == TERA_OK) st = agree(root ? tera_ckpt_write_run_config(&tr.cfg, out) : TERA_OK);
        step = (long)tr.step;
        tera_trainer_free(&tr);
    }
    if (st != TERA_OK) {
        /* a refused conversion leaves nothing new: an --out it created goes again */
        if (root && created) {
            char keep[1024];
            snprintf(keep, sizeof keep, "%s", tera_last_error());
            tera_ckpt_rmtree(out);
            tera_fail(st, "%s", keep);
        }
        tera_run_lock_release(&lock);
        return tera_cli_error();
    }
    tera_run_lock_release(&lock);
    if (root)
        fprintf(stderr, "tera: converted %s (step %ld) -> %s/checkpoints/step_%08ld: %d ranks = pp %d x dp %d x tp %d, "
                "ep %d, ZeRO %d\n", dir, step, out, step, tera_comm_size(tera_comm_world()), cfg.parallel.pp,
                cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.zero);
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
    if (!strcmp(argv[0], "convert")) {
        for (int i = 1; i < argc; i++)
            if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
                ckpt_usage(stdout);
                return 0;
            }
        return cmd_convert(argc - 1, argv + 1);
    }
    fprintf(stderr, "tera: error: unknown or incomplete ckpt command\n");
    ckpt_usage(stderr);
    return 2;
}
