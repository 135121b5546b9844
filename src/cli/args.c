#include <string.h>

#include "cli.h"
#include "tera/comm.h"

int tera_cli_error(void) {
    tera_comm *w = tera_comm_world();
    if (tera_comm_rank(w) == 0)
        fprintf(stderr, "tera: error: %s\n", tera_last_error());
    else if (!strstr(tera_last_error(), "another rank") && !strstr(tera_last_error(), "rank 0's message") &&
             !strstr(tera_last_error(), "on rank 0"))
        fprintf(stderr, "tera: error (rank %d): %s\n", tera_comm_rank(w), tera_last_error());
    return 1;
}

/* Pass 1 loads -c FILE (so overrides apply on top whatever their position), pass 2 the rest. */
int tera_cli_parse(int argc, char **argv, tera_config *cfg, const char *const *flags, int *flag_set,
                   const char *const *opts, const char **opt_val) {
    tera_config_defaults(cfg);
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "-c") || !strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) {
                tera_fail(TERA_ERR_ARG, "%s needs a file name", argv[i]);
                return tera_cli_error();
            }
            if (tera_config_load(cfg, argv[++i]) != TERA_OK) return tera_cli_error();
        }
    }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-c") || !strcmp(a, "--config")) {
            i++;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) {
            tera_fail(TERA_ERR_ARG, "unexpected argument '%s' (options look like --section.key=value)", a);
            return tera_cli_error();
        }
        const char *body = a + 2;
        int matched = 0;
        for (int f = 0; flags && flags[f]; f++)
            if (!strcmp(body, flags[f])) flag_set[f] = 1, matched = 1;
        for (int o = 0; !matched && opts && opts[o]; o++) {
            size_t n = strlen(opts[o]);
            if (!strncmp(body, opts[o], n) && (body[n] == '=' || body[n] == 0)) {
                if (body[n] == '=') {
                    opt_val[o] = body + n + 1;
                } else if (i + 1 < argc) {
                    opt_val[o] = argv[++i];
                } else {
                    tera_fail(TERA_ERR_ARG, "--%s needs a value", opts[o]);
                    return tera_cli_error();
                }
                matched = 1;
            }
        }
        if (matched) continue;
        if (!strchr(body, '.') || !strchr(body, '=')) {
            tera_fail(TERA_ERR_ARG, "unknown option '%s'", a);
            return tera_cli_error();
        }
        if (tera_config_set(cfg, body) != TERA_OK) return tera_cli_error();
    }
    if (tera_config_finalize(cfg) != TERA_OK) return tera_cli_error();
    return 0;
}
