/* tera export-hf / tera config */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "tera/ckpt.h"
#include "tera/hf.h"

int tera_cmd_export_hf(int argc, char **argv) {
    tera_config cfg;
    static const char *const flags[] = {"force", "tera-moe", NULL};
    static const char *const opts[] = {"from", "out", "max-shard-bytes", NULL};
    int set[2] = {0, 0};
    const char *val[3] = {NULL, NULL, NULL};
    if (tera_cli_parse(argc, argv, &cfg, flags, set, opts, val)) return 1;
    if (!val[0] || !val[1]) {
        tera_fail(TERA_ERR_ARG, "export-hf needs --from DIR and --out DIR");
        return tera_cli_error();
    }
    int64_t shard = cfg.checkpoint.max_shard_bytes;
    if (val[2]) {
        char *end;
        shard = strtoll(val[2], &end, 10);
        if (*end || shard < 0) {
            tera_fail(TERA_ERR_ARG, "--max-shard-bytes '%s' is not a non-negative integer", val[2]);
            return tera_cli_error();
        }
    }
    /* a tera checkpoint (a step directory, or a run directory's newest) is committed and verifies
     * before a byte is exported; anything else is read as a Hugging Face directory */
    char src[TERA_PATH_MAX], probe[TERA_PATH_MAX + 32];
    snprintf(src, sizeof src, "%s", val[0]);
    snprintf(probe, sizeof probe, "%s/manifest.json", val[0]);
    int is_ckpt = access(probe, F_OK) == 0;
    snprintf(probe, sizeof probe, "%s/checkpoints", val[0]);
    is_ckpt |= access(probe, F_OK) == 0;
    if (is_ckpt && tera_cli_ckpt_source(val[0], src, sizeof src) != TERA_OK) return tera_cli_error();
    val[0] = src;
    if (tera_config_from_hf(&cfg, val[0]) != TERA_OK) return tera_cli_error();
    cfg.training.seq_len = 1;
    cfg.training.micro_batch = 1;
    if (tera_config_finalize(&cfg) != TERA_OK) return tera_cli_error();
    /* a tera checkpoint (whole, differential or sharded: its manifest says), streamed tensor by
     * tensor, or a Hugging Face directory (imported whole) */
    char man[TERA_PATH_MAX + 32];
    snprintf(man, sizeof man, "%s/manifest.json", val[0]);
    tera_status st;
    if (access(man, F_OK) == 0) {
        st = tera_ckpt_export_hf(val[0], &cfg.model, val[1], shard, set[0], set[1]);
    } else {
        tera_model m;
        if (tera_model_create(&m, &cfg.model, 1, 1) != TERA_OK) return tera_cli_error();
        st = tera_hf_import(&m, val[0]);
        if (st == TERA_OK) st = tera_hf_export_checked(&m, val[1], shard, set[0], set[1]);
        tera_model_destroy(&m);
    }
    if (st != TERA_OK) return tera_cli_error();
    fprintf(stderr, "tera: exported %s -> %s (model_type %s)\n", val[0], val[1],
            tera_hf_transformers_gaps(&cfg.model, NULL, 0) ? "tera_moe" : "mixtral");
    return 0;
}

int tera_cmd_config(int argc, char **argv) {
    if (argc >= 1 && !strcmp(argv[0], "--doc")) {
        /* docs/CONFIG.md is this output (make docs) */
        fputs("# Configuration reference\n\n"
          "<!-- Generated from the key table in src/config/config.c (tera_config_write_doc); "
          "do not edit by hand. -->\n\n"
          "A run is configured by an INI file: `[section]` headers, `key = value` lines, comments on "
          "their own line starting with `#` or `;` (or after a value, as ` ; comment`). Strings may be "
          "quoted with `\"...\"` to keep surrounding spaces. Booleans accept true/false, 1/0, yes/no, "
          "on/off. Unknown sections or keys, a key set twice, and out-of-range values are errors that "
          "name the file, line and key.\n\n"
          "Any key can be overridden on the command line as `--section.key=value`, e.g. "
          "`--model.dim=256 --training.lr=1e-3`; a key given twice on the command line takes the last value "
          "(with a note); overrides apply after the file. Cross-field rules "
          "(n_heads divides dim, even head width, top_k <= n_experts, seq_len <= max_seq_len, a model "
          "and a micro-batch whose byte counts fit in 64 bits: at most about 7.2e16 parameters and "
          "activation floats, ...) are checked once everything is applied. The resolved configuration, every key with its value, is "
          "written to the run directory as `config.ini`, which loads back to the same run.\n\n",
              stdout);
        tera_config_write_doc(stdout);
        return 0;
    }
    tera_config cfg;
    if (tera_cli_parse(argc, argv, &cfg, NULL, NULL, NULL, NULL)) return 1;
    fflush(stdout);
    if (tera_config_write(&cfg, "/dev/stdout") != TERA_OK) return tera_cli_error();
    return 0;
}
