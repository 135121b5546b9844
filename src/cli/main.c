/* tera: train Mixture-of-Experts language models. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "tera/comm.h"

static int dispatch(int argc, char **argv, const char *cmd);

/* Every command's usage, in one table: `tera help` prints all of it, `tera CMD --help` the rows of
 * CMD, `tera CMD SUB --help` the row of CMD SUB (all of CMD's rows for an unknown SUB). */
typedef struct {
    const char *cmd, *sub; /* sub: NULL for a command without subcommands */
    const char *usage;     /* the synopsis after "tera " */
    const char *about;     /* what it does (lines indented by the printer) */
} usage_row;

static const usage_row g_usage[] = {
    {"train", NULL, "train [-c FILE] [--section.key=value ...] [--force | --resume | --dry-run]",
     "train a model; --force overwrites logging.run_dir, --resume continues it from its newest checkpoint;\n"
     "--dry-run prints the memory of every rank of the layout without allocating it (tera plan --dry-run)"},
    {"eval", NULL, "eval --from DIR [-c FILE] [--section.key=value ...]",
     "validation loss of a Hugging Face directory, a checkpoint or a run directory (its newest checkpoint),\n"
     "as one JSON line; runs in fp32 unless --training.precision is given on the command line"},
    {"eval", NULL, "eval --from DIR --task FILE.jsonl [--tokenizer DIR|bytes] [--scores FILE [--force]] [--limit N]",
     "multiple-choice / cloze accuracy: each line {context, choices, label}; acc by summed log-likelihood,\n"
     "acc_norm per byte of the choice, as one JSON line; docs/GENERATE.md"},
    {"generate", NULL,
     "generate --from DIR [--prompt TEXT | --prompts FILE] [--tokenizer DIR|bytes] [--max-new-tokens N]\n"
     "                  [--temperature T --top-k K --top-p P --seed S] [--batch N] [--context N] [--json] [--no-cache]",
     "continue prompts (--prompt, one per line of --prompts FILE or of stdin) with a checkpoint, a run's newest\n"
     "checkpoint or a Hugging Face directory; greedy unless --temperature > 0; KV-cache decoding, tokens streamed\n"
     "to stdout (--json: one JSON line per prompt), tokens/s on stderr; docs/GENERATE.md"},
    {"export-hf", NULL, "export-hf --from DIR --out DIR [--max-shard-bytes N] [--force] [--tera-moe]",
     "write a Hugging Face Mixtral directory from a checkpoint or HF directory; a model transformers cannot\n"
     "compute (dense first layers, shared experts, aux-free bias, dropping capacity, DeepSeek-V3 routing)\n"
     "is refused unless --tera-moe (model_type tera_moe: read by tera only); README, Hugging Face interchange"},
    {"config", NULL, "config [-c FILE] [--section.key=value ...] | config --doc",
     "print the resolved configuration, or with --doc every key documented (docs/CONFIG.md)"},
    {"bench", NULL, "bench -c configs/bench-s.ini [--steps N] [--warmup N] [--threads N] [--name NAME] [--products N]",
     "time training steps: one JSON line (tokens/s, MFU, memory) and the profile; --products N adds\n"
     "the N costliest matrix product kinds and shapes of the timed steps (docs/PERFORMANCE.md,\n"
     "\"Matrix products by kind and shape\")"},
    {"data", "prepare",
     "data prepare --input FILE... --output PREFIX [--tokenizer DIR|bytes] [--field NAME] [--threads N]\n"
     "                  [--allow-special] [--force]",
     "text (one document per file) or .jsonl (one per line) -> Megatron .bin/.idx + checksums"},
    {"tokenizer", "train", "tokenizer train --input FILE... --vocab-size N --output DIR [--threads N] [--force]",
     "train a byte-level BPE vocabulary (encoder.json + vocab.bpe)"},
    {"tokenizer", "encode", "tokenizer encode --tokenizer DIR|bytes [--allow-special] < text", "text -> ids on stdout"},
    {"tokenizer", "decode", "tokenizer decode --tokenizer DIR|bytes < ids", "ids -> text on stdout"},
    {"ckpt", "ls", "ckpt ls RUN_DIR", "checkpoints of a run: step, kind, size, committed"},
    {"ckpt", "verify", "ckpt verify DIR|RUN_DIR", "re-hash every file against COMMIT and the manifest"},
    {"ckpt", "export-hf", "ckpt export-hf DIR --out HFDIR [--max-shard-bytes N] [--force] [--tera-moe]",
     "a checkpoint (full or differential) -> Hugging Face directory (--tera-moe: as for export-hf)"},
    {"ckpt", "convert",
     "ckpt convert --from CKPT_DIR|RUN_DIR --out RUN_DIR [--force] [-c FILE] [--section.key=value ...]",
     "reshard a checkpoint for another parallel layout (run under mpirun -np N with the new --parallel.*);\n"
     "`tera train -c RUN_DIR/config.ini --resume` continues from it"},
    {"schedule", NULL, "schedule --kind gpipe|1f1b|interleaved --pp P --micro M [--chunks V]",
     "print a pipeline schedule, its simulated bubble and activation footprint"},
    {"plan", NULL,
     "plan -c MODEL.ini --hardware FILE --devices N --global-batch B [--seq-len T] [--top K]\n"
     "                  [--write-config FILE [--force]] [--efficiency F] [--reserve F] [--max-tp N] [--threads N] [--json]\n"
     "  tera plan --dry-run [-c FILE] [--section.key=value ...] [--hardware FILE] [--json]   (= tera train --dry-run)\n"
     "  [mpirun -np N] tera plan --calibrate -c MODEL.ini [--out hardware/this-machine.ini] [--shared-only]\n"
     "  (also --products fp8|bf16|... --exchange-bytes B --exchange-overlap F --comm-overlap F: how the planned\n"
     "  run computes and communicates where it is not tera; docs/PLAN.md)",
     "search the layouts (dp, tp, pp, ep, ZeRO, schedule, chunks, recompute, micro-batch) that the configuration\n"
     "accepts for N devices, drop those that do not fit in memory (--reserve, default 0.10), rank the rest by a\n"
     "first time model (FLOPs at --efficiency of peak, default 0.40; alpha-beta communication; pipeline bubble);\n"
     "--dry-run prints the memory of every rank role of the configuration's own layout without allocating it;\n"
     "--calibrate measures this machine (product and attention rates for the model's shapes, memory bandwidth,\n"
     "collectives and what ranks computing at once each get under mpirun; --shared-only: only that) into a\n"
     "hardware file; docs/PLAN.md"},
    {"report", NULL, "report RUN_DIR [--out FILE [--force]]",
     "one self-contained HTML page of a run: SVG plots of loss and validation loss, LR, grad norm, throughput,\n"
     "memory, expert load per layer over time (heatmap), skipped steps and loss spikes, and its config.ini\n"
     "(default RUN_DIR/report.html); docs/MONITORING.md"},
    {"launch", NULL,
     "launch [--hosts H:N,... | --hostfile F | (Slurm)] [--np N] [--max-restarts K] [--host-retries K]\n"
     "                  [--hang-timeout S] [--hang-factor F] [--start-timeout S] [--layouts \"dp=4,tp=1;dp=2\"]\n"
     "                  [--rsh-agent CMD] [--mpirun CMD] [--mpi-args ARGS] -- TERA train [train options]",
     "elastic training: runs mpirun ... TERA train, watches every rank's heartbeat; on a dead rank, a hung rank\n"
     "or a lost host tears the job down, excludes the host, picks a layout for the ranks left (same global\n"
     "batch) and relaunches with --resume; events with timings in RUN_DIR/elastic/events.jsonl; docs/ELASTIC.md"},
    {"sim-failures", NULL,
     "sim-failures [--devices N] [--failures F --days D --ref-devices N] [--save-pause S] [--detect S]\n"
     "                  [--recovery S] [--every-s S] [--horizon-days D] [--trials N] [--seed N] [--goal F] [--json]",
     "effective training time under failures (default: Llama 3's 419 in 54 days on 16,384 GPUs, scaled per\n"
     "device) from the save pause, detection and recovery times (defaults: tera's, measured) and the checkpoint\n"
     "cadence; recommends checkpoint.every_s (Young/Daly and a simulation); docs/ELASTIC.md"},
    {"runs", "ls", "runs ls [--registry DB] [--status S] [--study NAME] [--where KEY=VALUE ...] [--json]",
     "the runs of the registry (logging.registry, default runs/registry.db); --where takes a config key\n"
     "(training.lr=0.001), a summary field (final_loss<3.5) or a column (git_commit=..., dataset_fp=...)"},
    {"runs", "show", "runs show ID [--registry DB] [--json]",
     "everything recorded about one run (an id prefix is enough): status, command, layout, git commit, dataset and\n"
     "tokenizer fingerprints, final metrics, checkpoints, the resolved configuration; docs/TRACKING.md"},
    {"runs", "compare", "runs compare ID ID... [--registry DB] [--all] [--plot METRIC[,METRIC...] --out FILE.html [--force]]",
     "side by side: the config keys that differ (--all: every key) and the final metrics; --plot draws the\n"
     "metrics' curves of every run (SVG in one HTML page)"},
    {"runs", "rm", "runs rm ID... [--registry DB]", "remove runs from the registry (their run directories stay)"},
    {"tune", NULL, "tune -c search.ini [--trials N] [--parallel N] [--study NAME] [--registry DB] [--dir DIR] [--fresh]",
     "hyperparameter search over any config keys (uniform, loguniform, int, choice): random or TPE sampling,\n"
     "ASHA / Hyperband early stopping with steps as the fidelity (stopped trials end, promoted ones resume from\n"
     "their checkpoint), N trials at once; the study lives in the registry and resumes after a crash; writes the\n"
     "best config and a report; docs/TRACKING.md"},
};
#define N_USAGE (sizeof g_usage / sizeof g_usage[0])

static void print_row(FILE *f, const usage_row *r) {
    fprintf(f, "  tera %s\n      ", r->usage);
    for (const char *p = r->about; *p; p++) fputs(*p == '\n' ? "\n      " : (char[2]){*p, 0}, f);
    fputc('\n', f);
}

static void usage(FILE *f) {
    fprintf(f, "usage: tera <command> [options]   (tera <command> --help: that command only)\n\ncommands:\n");
    for (size_t i = 0; i < N_USAGE; i++) print_row(f, &g_usage[i]);
    fprintf(f, "  tera help\n      this text\n\n"
               "Every config key can be overridden on the command line as --section.key=value (a key given\n"
               "twice: the last applies, with a note; see docs/CONFIG.md or `tera config --doc`).\n");
}

/* `tera CMD [SUB] ... --help|-h`: prints the usage of CMD (SUB) on stdout and returns 1; else 0. */
static int help_asked(int argc, char **argv, const char *cmd) {
    int asked = 0;
    for (int i = 2; i < argc; i++) asked |= !strcmp(argv[i], "--help") || !strcmp(argv[i], "-h");
    if (!asked) return 0;
    const char *sub = argc > 2 && argv[2][0] != '-' ? argv[2] : NULL;
    int one = 0;
    for (size_t i = 0; i < N_USAGE; i++)
        one |= !strcmp(g_usage[i].cmd, cmd) && sub && g_usage[i].sub && !strcmp(g_usage[i].sub, sub);
    printf("usage:\n");
    for (size_t i = 0; i < N_USAGE; i++)
        if (!strcmp(g_usage[i].cmd, cmd) && (!one || !strcmp(g_usage[i].sub, sub))) print_row(stdout, &g_usage[i]);
    if (strcmp(cmd, "config") != 0 && strcmp(cmd, "schedule") != 0 && strcmp(cmd, "tokenizer") != 0 &&
        strcmp(cmd, "runs") != 0 && strcmp(cmd, "tune") != 0 &&
        !(sub && (!strcmp(sub, "ls") || !strcmp(sub, "verify"))))
        printf("\n--section.key=value overrides any config key (tera config --doc lists them)\n");
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    int known = 0;
    for (size_t i = 0; i < N_USAGE; i++) known |= !strcmp(g_usage[i].cmd, cmd);
    if (known && help_asked(argc, argv, cmd)) return 0; /* before MPI: nothing to set up */
    if (!strcmp(cmd, "launch")) return tera_cmd_launch(argc - 2, argv + 2); /* a supervisor of mpirun: no MPI */
    if (!strcmp(cmd, "sim-failures")) return tera_cmd_simfail(argc - 2, argv + 2);
    if (!strcmp(cmd, "runs")) return tera_cmd_runs(argc - 2, argv + 2); /* the registry only: no MPI */
    if (!strcmp(cmd, "tune")) return tera_cmd_tune(argc - 2, argv + 2); /* runs trials as child processes: no MPI */
    if (tera_comm_init(&argc, &argv) != TERA_OK) {
        fprintf(stderr, "tera: error: %s\n", tera_last_error());
        return 1;
    }
    int rc = dispatch(argc, argv, cmd);
    tera_comm_finalize();
    return rc;
}

static int dispatch(int argc, char **argv, const char *cmd) {
    int dry_run = 0; /* tera train --dry-run: the memory plan of the layout, nothing allocated (tera plan) */
    for (int i = 2; i < argc; i++) dry_run |= !strcmp(argv[i], "--dry-run");
    if (!strcmp(cmd, "train") && dry_run) return tera_cmd_plan(argc - 2, argv + 2);
    if (!strcmp(cmd, "train")) return tera_cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return tera_cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "export-hf")) return tera_cmd_export_hf(argc - 2, argv + 2);
    if (!strcmp(cmd, "config")) return tera_cmd_config(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench")) return tera_cmd_bench(argc - 2, argv + 2);
    if (!strcmp(cmd, "data")) return tera_cmd_data(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenizer")) return tera_cmd_tokenizer(argc - 2, argv + 2);
    if (!strcmp(cmd, "ckpt")) return tera_cmd_ckpt(argc - 2, argv + 2);
    if (!strcmp(cmd, "schedule")) return tera_cmd_schedule(argc - 2, argv + 2);
    if (!strcmp(cmd, "plan")) return tera_cmd_plan(argc - 2, argv + 2);
    if (!strcmp(cmd, "generate")) return tera_cmd_generate(argc - 2, argv + 2);
    if (!strcmp(cmd, "report")) return tera_cmd_report(argc - 2, argv + 2);
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "tera: error: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
