#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <strings.h>

#include "cli.h"
#include "tera/comm.h"

int tera_cli_error(void) {
    tera_comm_print_error(tera_last_error()); /* once for the job (src/comm: rank 0 prints what all share) */
    return 1;
}

const char *tera_cli_wait_policy(void) {
    const char *v = getenv("OMP_WAIT_POLICY");
    if (!v || !*v) return "default";
    for (const char *p = v; *p; p++)
        if (!((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z')) || p - v > 16) return "other";
    return v;
}

void tera_cli_wait_policy_note(const char *who, int threads) {
    if (threads < 2 || strcasecmp(tera_cli_wait_policy(), "passive")) return;
    fprintf(stderr,
            "%s: note: OMP_WAIT_POLICY=%s puts the %d threads to sleep after each of the step's parallel regions "
            "(hundreds a step), which cost 4-11%% of tokens/s at 2 threads on 2 cores (docs/PERFORMANCE.md, "
            "\"Wave 16\"); leave it unset unless other processes need these cores\n",
            who, getenv("OMP_WAIT_POLICY"), threads);
}

/* The section.key names set by --section.key=value on the last parsed command line (the blanks
 * tera_config_set ignores removed), and the argument that set each. */
#define CLI_MAX_KEYS 256
static char g_keys[CLI_MAX_KEYS][128];
static const char *g_key_arg[CLI_MAX_KEYS];
static int g_n_keys;

/* "section.key" of an assignment "section.key=value", without surrounding blanks. */
static void key_of(const char *body, char *out, size_t cap) {
    const char *eq = strchr(body, '=');
    size_t n = 0;
    for (const char *p = body; p < eq && n + 1 < cap; p++)
        if (*p != ' ' && *p != '\t') out[n++] = *p;
    out[n] = '\0';
}

int tera_cli_given(const char *key) {
    for (int i = 0; i < g_n_keys; i++)
        if (!strcmp(g_keys[i], key)) return 1;
    return 0;
}

/* Pass 1 loads -c FILE (so overrides apply on top whatever their position), pass 2 the rest. */
int tera_cli_parse(int argc, char **argv, tera_config *cfg, const char *const *flags, int *flag_set,
                   const char *const *opts, const char **opt_val) {
    g_n_keys = 0;
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
    const char *opt_arg[16] = {NULL}; /* the value each option was given (to name a repeated one) */
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
                if (o < 16 && opt_arg[o]) {
                    tera_fail(TERA_ERR_ARG, "--%s is given twice ('%s' and '%s'); give it once", opts[o], opt_arg[o],
                              body[n] == '=' ? body + n + 1 : i + 1 < argc ? argv[i + 1] : "");
                    return tera_cli_error();
                }
                if (body[n] == '=') {
                    opt_val[o] = body + n + 1;
                } else if (i + 1 < argc) {
                    opt_val[o] = argv[++i];
                } else {
                    tera_fail(TERA_ERR_ARG, "--%s needs a value", opts[o]);
                    return tera_cli_error();
                }
                if (o < 16) opt_arg[o] = opt_val[o];
                matched = 1;
            }
        }
        if (matched) continue;
        if (!strchr(body, '.') || !strchr(body, '=')) {
            tera_fail(TERA_ERR_ARG, "unknown option '%s'", a);
            return tera_cli_error();
        }
        if (tera_config_set(cfg, body) != TERA_OK) return tera_cli_error();
        char key[128];
        key_of(body, key, sizeof key);
        /* a key set again later on the command line: the last value applies, as a wrapper script that
         * appends "$@" to its defaults expects; not silently (a file that sets a key twice is an error:
         * a file is one document, the command line layers overrides) */
        int again = 0;
        for (int k = 0; k < g_n_keys && !again; k++)
            if (!strcmp(g_keys[k], key)) {
                again = 1;
                const char *v0 = strchr(g_key_arg[k], '='), *v1 = strchr(a, '=');
                if (strcmp(v0, v1) != 0 && tera_comm_rank(tera_comm_world()) == 0)
                    fprintf(stderr, "tera: note: the command line sets %s twice ('%s', then '%s'): the last one applies\n",
                            key, g_key_arg[k], a);
                g_key_arg[k] = a;
            }
        if (!again && g_n_keys < CLI_MAX_KEYS) {
            memcpy(g_keys[g_n_keys], key, sizeof key);
            g_key_arg[g_n_keys++] = a;
        }
    }
    /* flags that contradict each other */
    int force = -1, resume = -1;
    for (int f = 0; flags && flags[f]; f++) {
        if (!strcmp(flags[f], "force")) force = f;
        if (!strcmp(flags[f], "resume")) resume = f;
    }
    if (force >= 0 && resume >= 0 && flag_set[force] && flag_set[resume]) {
        tera_fail(TERA_ERR_ARG, "--resume and --force contradict each other (--resume continues the run directory, "
                                "--force overwrites it): give one");
        return tera_cli_error();
    }
    if (tera_config_finalize(cfg) != TERA_OK) return tera_cli_error();
    return 0;
}

int tera_cli_refuse_output(const char *what, const char *path, int force, const char *const *inputs) {
    struct stat out;
    if (stat(path, &out) != 0) return 0; /* a new file */
    for (int i = 0; inputs && inputs[i]; i++) {
        struct stat in;
        if (stat(inputs[i], &in) == 0 && in.st_dev == out.st_dev && in.st_ino == out.st_ino) {
            tera_fail(TERA_ERR_ARG, "%s '%s' is the input '%s': writing it would destroy what the command reads; "
                      "choose another file", what, path, inputs[i]);
            return tera_cli_error();
        }
    }
    if (force) return 0;
    tera_fail(TERA_ERR_EXISTS, "%s '%s' already exists; pass --force to replace it", what, path);
    return tera_cli_error();
}
