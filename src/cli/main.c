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
     "validation loss of a Hugging Face directory or checkpoint, as one JSON line; runs in fp32 unless\n"
     "--training.precision is given on the command line"},
    {"export-hf", NULL, "export-hf --from DIR --out DIR [--max-shard-bytes N] [--force] [--tera-moe]",
     "write a Hugging Face Mixtral directory from a checkpoint or HF directory; a model transformers cannot\n"
     "compute (dense first layers, shared experts, aux-free bias, dropping capacity, DeepSeek-V3 routing)\n"
     "is refused unless --tera-moe (model_type tera_moe: read by tera only); README, Hugging Face interchange"},
    {"config", NULL, "config [-c FILE] [--section.key=value ...] | config --doc",
     "print the resolved configuration, or with --doc every key documented (docs/CONFIG.md)"},
    {"bench", NULL, "bench -c configs/bench-s.ini [--steps N] [--warmup N] [--threads N] [--name NAME]",
     "time training steps: one JSON line (tokens/s, MFU, memory) and the profile"},
    {"data", "prepare",
     "data prepare --input FILE... --output PREFIX [--tokenizer DIR|bytes] [--field NAME] [--threads N]\n"
     "                  [--allow-special] [--force]",
     "text (one document per file) or .jsonl (one per line) -> Megatron .bin/.idx + checksums"},
    {"tokenizer", "train", "tokenizer train --input FILE... --vocab-size N --output DIR [--threads N] [--force]",
     "train a byte-level BPE vocabulary (encoder.json + vocab.bpe)"},
    {"tokenizer", "encode", "tokenizer encode --tokenizer DIR [--allow-special] < text", "text -> ids on stdout"},
    {"tokenizer", "decode", "tokenizer decode --tokenizer DIR < ids", "ids -> text on stdout"},
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
     "                  [--write-config FILE] [--efficiency F] [--reserve F] [--max-tp N] [--threads N] [--json]\n"
     "  tera plan --dry-run [-c FILE] [--section.key=value ...] [--hardware FILE] [--json]   (= tera train --dry-run)",
     "search the layouts (dp, tp, pp, ep, ZeRO, schedule, chunks, recompute, micro-batch) that the configuration\n"
     "accepts for N devices, drop those that do not fit in memory (--reserve, default 0.10), rank the rest by a\n"
     "first time model (FLOPs at --efficiency of peak, default 0.40; alpha-beta communication; pipeline bubble);\n"
     "--dry-run prints the memory of every rank role of the configuration's own layout without allocating it;\n"
     "docs/PLAN.md"},
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
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "tera: error: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
