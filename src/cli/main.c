/* tera: train Mixture-of-Experts language models. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "tera/comm.h"

static int dispatch(int argc, char **argv, const char *cmd);

static void usage(FILE *f) {
    fprintf(f,
            "usage: tera <command> [options]\n"
            "\n"
            "commands:\n"
            "  train      train a model:  tera train [-c FILE] [--section.key=value ...] [--force] [--resume]\n"
            "  eval       validation loss of a checkpoint:  tera eval --from DIR [-c FILE] [--section.key=value ...]\n"
            "  export-hf  write a Hugging Face Mixtral directory:  tera export-hf --from DIR --out DIR [--max-shard-bytes N] [--force]\n"
            "  config     print the resolved config (-c FILE ...) or, with --doc, every key documented\n"
            "  data       tera data prepare --input FILE... --output PREFIX [--tokenizer DIR|bytes] [--field NAME]\n"
            "             (text = one document per file, .jsonl = one per line) -> Megatron .bin/.idx + checksums\n"
            "  tokenizer  tera tokenizer train --input FILE... --vocab-size N --output DIR | encode | decode --tokenizer DIR\n"
            "  schedule   print a pipeline schedule and its simulated bubble:\n"
            "             tera schedule --kind gpipe|1f1b|interleaved --pp P --micro M [--chunks V]\n"
            "  bench      time training steps:  tera bench -c configs/bench-s.ini [--steps N] [--warmup N] [--threads N]\n"
            "  ckpt       checkpoints:  tera ckpt ls RUN_DIR | verify DIR | export-hf DIR --out HFDIR [--force]\n"
            "             [mpirun -np N] tera ckpt convert --from CKPT_DIR --out RUN_DIR [--force] [--parallel.*=...]\n"
            "  help       this text\n"
            "\n"
            "Every config key can be overridden on the command line as --section.key=value\n"
            "(see docs/CONFIG.md or `tera config --doc`).\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (tera_comm_init(&argc, &argv) != TERA_OK) {
        fprintf(stderr, "tera: error: %s\n", tera_last_error());
        return 1;
    }
    int rc = dispatch(argc, argv, cmd);
    tera_comm_finalize();
    return rc;
}

static int dispatch(int argc, char **argv, const char *cmd) {
    if (!strcmp(cmd, "train")) return tera_cmd_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return tera_cmd_eval(argc - 2, argv + 2);
    if (!strcmp(cmd, "export-hf")) return tera_cmd_export_hf(argc - 2, argv + 2);
    if (!strcmp(cmd, "config")) return tera_cmd_config(argc - 2, argv + 2);
    if (!strcmp(cmd, "bench")) return tera_cmd_bench(argc - 2, argv + 2);
    if (!strcmp(cmd, "data")) return tera_cmd_data(argc - 2, argv + 2);
    if (!strcmp(cmd, "tokenizer")) return tera_cmd_tokenizer(argc - 2, argv + 2);
    if (!strcmp(cmd, "ckpt")) return tera_cmd_ckpt(argc - 2, argv + 2);
    if (!strcmp(cmd, "schedule")) return tera_cmd_schedule(argc - 2, argv + 2);
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "tera: error: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
