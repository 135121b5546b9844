/* Subcommands of the `tera` executable (one file each). */
#ifndef TERA_CLI_H
#define TERA_CLI_H

#include "tera/config.h"

int tera_cmd_train(int argc, char **argv);
int tera_cmd_eval(int argc, char **argv);
int tera_cmd_export_hf(int argc, char **argv);
int tera_cmd_config(int argc, char **argv);
int tera_cmd_bench(int argc, char **argv);
int tera_cmd_data(int argc, char **argv);
int tera_cmd_tokenizer(int argc, char **argv);
int tera_cmd_ckpt(int argc, char **argv);
int tera_cmd_schedule(int argc, char **argv);
int tera_cmd_plan(int argc, char **argv);
int tera_cmd_launch(int argc, char **argv);     /* the elastic supervisor (never joins MPI) */
int tera_cmd_simfail(int argc, char **argv);    /* tera sim-failures (no MPI) */
int tera_cmd_generate(int argc, char **argv);
int tera_cmd_eval_task(int argc, char **argv); /* tera eval --task (cmd_evaltask.c) */
int tera_cmd_report(int argc, char **argv);   /* tera report RUN_DIR: an HTML page (src/cli/cmd_report.c) */
int tera_cmd_runs(int argc, char **argv);     /* tera runs ls|show|compare|rm: the run registry (src/cli/cmd_runs.c) */
int tera_cmd_tune(int argc, char **argv);     /* tera tune -c search.ini: hyperparameter search (src/cli/cmd_tune.c) */

/* Shared argument handling: -c FILE, --section.key=value overrides, and the flags named in
 * `flags` (e.g. "force", "resume"), whose presence is reported through flag_set[i]. Prints one
 * message and returns non-zero on error. */
int tera_cli_parse(int argc, char **argv, tera_config *cfg, const char *const *flags, int *flag_set,
                   const char *const *opts, const char **opt_val);
int tera_cli_error(void); /* prints tera_last_error() as "tera: error: ..." and returns 1 */
/* An output file a command is about to write: refused (one message, returns non-zero) when it
 * already exists and force is 0 ("WHAT 'PATH' already exists; pass --force to replace it"), and,
 * even with force, when it is the same file as one of `inputs` (NULL-terminated, may be NULL): a
 * command must not replace what it reads. */
int tera_cli_refuse_output(const char *what, const char *path, int force, const char *const *inputs);
/* --from of a command that reads a tera checkpoint: a step directory, or a run directory's newest
 * committed one (into dir); it must be committed and verify (every file re-hashed against COMMIT and
 * the manifest), and so must a differential one's base; the first problem names its file. */
tera_status tera_cli_ckpt_source(const char *arg, char *dir, size_t cap);
/* 1 when the last tera_cli_parse's command line set `key` ("section.key") with --section.key=value
 * (not through -c FILE). A key or an option given twice on one command line is an error there, and
 * so are --resume with --force. */
int tera_cli_given(const char *key);
/* The OpenMP wait policy this process runs under: OMP_WAIT_POLICY as set when it is one word of
 * letters (as the runtime reads it), "default" when unset (libgomp then spins a while before a thread
 * sleeps), "other" for anything else, so that it can go into a JSON string as it is. */
const char *tera_cli_wait_policy(void);
/* Under OMP_WAIT_POLICY=PASSIVE (any case, as libgomp reads it) with threads > 1: one note on stderr,
 * prefixed by `who`, that sleeping between the step's parallel regions costs tokens/s (4-11% at 2
 * threads, docs/PERFORMANCE.md "Wave 16"). Nothing otherwise. */
void tera_cli_wait_policy_note(const char *who, int threads);

#endif
