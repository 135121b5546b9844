/* tera tune -c search.ini: runs the trials of a study as child processes (tera train, or an objective
 * command), samples their parameters (random / TPE / GP), stops and promotes them by ASHA / Hyperband
 * with steps as the fidelity (a tera train trial runs to its rung and stops there with a checkpoint:
 * training.stop_at_step; a promoted one resumes from it), keeps the study in the registry (a crashed
 * or interrupted study resumes), and writes the best config and a report. docs/TRACKING.md. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <sqlite3.h>

#include "cli.h"
#include "tera/ckpt.h"
#include "tera/io.h"
#include "tera/registry.h"
#include "tera/tune.h"

typedef enum { T_RUNNING = 0, T_PAUSED, T_STOPPED, T_COMPLETE, T_FAILED, T_PENDING } tstate;
static const char *const STATE_NAMES[] = {"running", "paused", "stopped", "complete", "failed", "pending"};

typedef struct {
    int number;
    tstate state;
    int bracket;
    double x[TERA_TUNE_MAX_PARAMS];
    int n_rungs, rungs[TERA_TUNE_MAX_RUNGS];
    int rung_done;                        /* values[0 .. rung_done) are known */
    double values[TERA_TUNE_MAX_RUNGS];
    int64_t steps_used;                   /* trial-steps spent (the study's budget) */
    pid_t pid;
    char dir[TERA_PATH_MAX + 64];
} trial;

typedef struct {
    tera_search s;
    tera_registry *reg;
    char exe[TERA_PATH_MAX];
    trial *t;
    int n, cap;
    int64_t steps_used;
    FILE *events;
} study;

#define PATHBUF (3 * TERA_PATH_MAX)

static volatile sig_atomic_t g_stop;
static void on_stop(int sig) { g_stop = sig; }

static double value_at(const trial *t) { return t->rung_done ? t->values[t->rung_done - 1] : INFINITY; }
/* The fidelity of a trial's newest value: the steps of its last rung (0: none). */
static int fidelity(const trial *t) { return t->rung_done ? t->rungs[t->rung_done - 1] : 0; }

/* ---- registry ------------------------------------------------------------------------------------ */

static char *params_json(const study *st, const trial *t) {
    cJSON *o = cJSON_CreateObject();
    for (int i = 0; i < st->s.n_params; i++) {
        char b[80];
        tera_param_text(&st->s.params[i], t->x[i], b, sizeof b);
        cJSON_AddStringToObject(o, st->s.params[i].key, b);
    }
    char *txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return txt;
}

static void save_trial(study *st, const trial *t) {
    char *p = params_json(st, t);
    cJSON *rv = cJSON_CreateArray(), *x = cJSON_CreateArray();
    for (int k = 0; k < t->rung_done; k++) cJSON_AddItemToArray(rv, cJSON_CreateNumber(t->values[k]));
    for (int i = 0; i < st->s.n_params; i++) cJSON_AddItemToArray(x, cJSON_CreateNumber(t->x[i]));
    cJSON *both = cJSON_CreateObject();
    cJSON_AddItemToObject(both, "values", rv);
    cJSON_AddItemToObject(both, "x", x);
    char *rvt = cJSON_PrintUnformatted(both);
    const double now = tera_registry_now();
    if (tera_registry_run(st->reg,
                          "INSERT INTO trials(study, number, state, params, bracket, rung, step, value, rung_values, "
                          "run_dir, steps_used, started, updated) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                          "ON CONFLICT(study, number) DO UPDATE SET state=excluded.state, rung=excluded.rung, "
                          "step=excluded.step, value=excluded.value, rung_values=excluded.rung_values, "
                          "steps_used=excluded.steps_used, updated=excluded.updated",
                          "sissiiidssidd", st->s.name, (int64_t)t->number, STATE_NAMES[t->state], p, (int64_t)t->bracket,
                          (int64_t)(t->rung_done - 1), (int64_t)(t->rung_done ? t->rungs[t->rung_done - 1] : 0),
                          t->rung_done ? value_at(t) : NAN, rvt, t->dir, t->steps_used, now, now) != TERA_OK)
        fprintf(stderr, "tera tune: warning: %s\n", tera_last_error());
    tera_registry_run(st->reg, "UPDATE studies SET updated=?, budget_used=? WHERE name=?", "dis", now, st->steps_used,
                      st->s.name);
    free(p);
    free(rvt);
    cJSON_Delete(both);
}

static trial *new_trial(study *st) {
    if (st->n == st->cap) {
        st->cap = st->cap ? 2 * st->cap : 64;
        st->t = tera_realloc(st->t, (size_t)st->cap * sizeof(trial));
    }
    trial *t = &st->t[st->n];
    memset(t, 0, sizeof *t);
    t->number = st->n++;
    t->pid = -1;
    return t;
}

/* The study: created, or loaded (its trials) when one of that name exists with the same file. */
static int load_study(study *st, int fresh) {
    sqlite3 *db = tera_registry_db(st->reg);
    sqlite3_stmt *q = NULL;
    sqlite3_prepare_v2(db, "SELECT spec FROM studies WHERE name = ?", -1, &q, NULL);
    sqlite3_bind_text(q, 1, st->s.name, -1, SQLITE_TRANSIENT);
    int exists = 0, same = 0;
    if (sqlite3_step(q) == SQLITE_ROW) {
        exists = 1;
        const unsigned char *spec = sqlite3_column_text(q, 0);
        same = spec && !strcmp((const char *)spec, st->s.text);
    }
    sqlite3_finalize(q);
    if (exists && fresh) {
        if (tera_registry_run(st->reg, "DELETE FROM trials WHERE study = ?", "s", st->s.name) != TERA_OK ||
            tera_registry_run(st->reg, "DELETE FROM studies WHERE name = ?", "s", st->s.name) != TERA_OK)
            return tera_cli_error();
        char trials_dir[PATHBUF];
        snprintf(trials_dir, sizeof trials_dir, "%s/trials", st->s.dir);
        if (access(trials_dir, F_OK) == 0 && tera_ckpt_rmtree(trials_dir) != TERA_OK) return tera_cli_error();
        exists = 0;
    }
    if (exists && !same) {
        tera_fail(TERA_ERR_EXISTS, "study '%s' exists in %s with a different search file: give another [study] name "
                  "(or --study NAME), or --fresh to start it over (its trials are removed)", st->s.name, st->s.registry);
        return tera_cli_error();
    }
    if (!exists) {
        const double now = tera_registry_now();
        if (tera_registry_run(st->reg, "INSERT INTO studies(name, spec, created, updated, status) VALUES(?, ?, ?, ?, "
                              "'running')", "ssdd", st->s.name, st->s.text, now, now) != TERA_OK)
            return tera_cli_error();
        return 0;
    }
    tera_registry_run(st->reg, "UPDATE studies SET status='running' WHERE name=?", "s", st->s.name);
    sqlite3_prepare_v2(db, "SELECT number, state, bracket, rung_values, run_dir, steps_used FROM trials WHERE study = ? "
                       "ORDER BY number", -1, &q, NULL);
    sqlite3_bind_text(q, 1, st->s.name, -1, SQLITE_TRANSIENT);
    int resumed = 0;
    while (sqlite3_step(q) == SQLITE_ROW) {
        trial *t = new_trial(st);
        t->number = sqlite3_column_int(q, 0);
        const char *state = (const char *)sqlite3_column_text(q, 1);
        for (int k = 0; k < 6; k++)
            if (state && !strcmp(state, STATE_NAMES[k])) t->state = (tstate)k;
        if (t->state == T_RUNNING) t->state = T_PENDING, resumed++; /* its process went with the crash */
        t->bracket = sqlite3_column_int(q, 2);
        cJSON *o = cJSON_Parse((const char *)sqlite3_column_text(q, 3));
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "values"), *x = cJSON_GetObjectItemCaseSensitive(o, "x");
        for (int k = 0; k < cJSON_GetArraySize(v) && k < TERA_TUNE_MAX_RUNGS; k++)
            t->values[t->rung_done++] = cJSON_GetArrayItem(v, k)->valuedouble;
        for (int i = 0; i < cJSON_GetArraySize(x) && i < st->s.n_params; i++) t->x[i] = cJSON_GetArrayItem(x, i)->valuedouble;
        cJSON_Delete(o);
        snprintf(t->dir, sizeof t->dir, "%s", (const char *)sqlite3_column_text(q, 4));
        t->steps_used = sqlite3_column_int64(q, 5);
        st->steps_used += t->steps_used;
        t->n_rungs = tera_rungs(&st->s, t->bracket, t->rungs);
    }
    sqlite3_finalize(q);
    fprintf(stderr, "tera tune: resuming study '%s': %d trials so far (%d interrupted, continued from their "
            "checkpoints), %ld trial-steps spent\n", st->s.name, st->n, resumed, (long)st->steps_used);
    return 0;
}

/* ---- processes ----------------------------------------------------------------------------------- */

static void split_args(const char *s, char **argv, int *argc, int max, char *store, size_t cap) {
    snprintf(store, cap, "%s", s);
    for (char *save = NULL, *w = strtok_r(store, " \t", &save); w && *argc < max; w = strtok_r(NULL, " \t", &save))
        argv[(*argc)++] = w;
}

static pid_t spawn(study *st, trial *t, char *const *argv, const char *log_name) {
    char log[TERA_PATH_MAX + 64];
    snprintf(log, sizeof log, "%s/logs", st->s.dir);
    tera_mkdirs(log);
    snprintf(log, sizeof log, "%s/logs/%s", st->s.dir, log_name);
    fflush(NULL);
    const pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "tera tune: cannot start a process: %s\n", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* a trial never outlives its study */
        const int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        char num[32];
        snprintf(num, sizeof num, "%d", t->number);
        setenv("TERA_STUDY", st->s.name, 1);
        setenv("TERA_TRIAL", num, 1);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        execv(argv[0], argv);
        fprintf(stderr, "tera tune: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    t->pid = pid;
    t->state = T_RUNNING;
    return pid;
}

static int newest_ckpt(const char *dir) {
    char path[PATHBUF];
    snprintf(path, sizeof path, "%s/checkpoints", dir);
    tera_ckpt_info *infos = NULL;
    int n = 0;
    if (tera_ckpt_list(path, &infos, &n) != TERA_OK) return 0;
    int best = 0;
    for (int i = 0; i < n; i++)
        if (infos[i].committed && infos[i].step > best) best = (int)infos[i].step;
    free(infos);
    return best;
}

/* Starts (or continues from its checkpoint) a tera train trial: it trains to its next rung and stops
 * there with a checkpoint (training.stop_at_step; the LR schedule is that of max_steps), so where a
 * trial stops never depends on timing. Returns 1 (started), 0 (could not start), or 2: its newest
 * checkpoint is already at the rung (a study interrupted after the trial's save): no process. */
static int start_train(study *st, trial *t) {
    char *argv[256];
    int argc = 0;
    char store[4096], a_dir[PATHBUF], a_steps[64], a_every[64], a_reg[PATHBUF], a_stop[64], conf[PATHBUF];
    char pv[TERA_TUNE_MAX_PARAMS][256];
    argv[argc++] = st->exe;
    argv[argc++] = "train";
    const int target = t->rungs[t->rung_done];
    const int resume = newest_ckpt(t->dir);
    if (resume >= target) return 2;
    if (resume > 0) { /* promoted (or interrupted): continue from its newest checkpoint */
        snprintf(conf, sizeof conf, "%s/config.ini", t->dir);
        argv[argc++] = "-c";
        argv[argc++] = conf;
        argv[argc++] = "--resume";
    } else {
        if (st->s.base[0]) {
            argv[argc++] = "-c";
            argv[argc++] = st->s.base;
        }
        split_args(st->s.args, argv, &argc, 200, store, sizeof store);
        for (int i = 0; i < st->s.n_params; i++) {
            char v[80];
            tera_param_text(&st->s.params[i], t->x[i], v, sizeof v);
            snprintf(pv[i], sizeof pv[i], "--%s=%s", st->s.params[i].key, v);
            argv[argc++] = pv[i];
        }
        snprintf(a_dir, sizeof a_dir, "--logging.run_dir=%s", t->dir);
        snprintf(a_steps, sizeof a_steps, "--training.steps=%d", st->s.max_steps);
        snprintf(a_every, sizeof a_every, "--checkpoint.every=%d", st->s.min_steps);
        snprintf(a_reg, sizeof a_reg, "--logging.registry=%s", st->s.registry);
        argv[argc++] = a_dir;
        argv[argc++] = a_steps;
        if (st->s.scheduler != TERA_SCHED_NONE) argv[argc++] = a_every;
        argv[argc++] = a_reg;
        argv[argc++] = "--force"; /* a trial directory left by an interrupted start */
    }
    /* the rung (0 at max_steps: off, also over a stop that config.ini kept from the last segment) */
    snprintf(a_stop, sizeof a_stop, "--training.stop_at_step=%d", target < st->s.max_steps ? target : 0);
    argv[argc++] = a_stop;
    argv[argc] = NULL;
    char log[64];
    snprintf(log, sizeof log, "trial_%04d.log", t->number);
    return spawn(st, t, argv, log) > 0;
}

/* Runs the objective command of a trial at rung t->rung_done. */
static int start_command(study *st, trial *t) {
    char cmd[8192];
    size_t o = 0;
    const int k = t->rung_done;
    for (const char *p = st->s.objective; *p && o < sizeof cmd - 1;) {
        if (*p == '{') {
            const char *e = strchr(p, '}');
            char name[160], val[PATHBUF] = "";
            int known = 0;
            if (e && e - p - 1 < (long)sizeof name) {
                snprintf(name, sizeof name, "%.*s", (int)(e - p - 1), p + 1);
                if (!strcmp(name, "steps")) snprintf(val, sizeof val, "%d", t->rungs[k]), known = 1;
                else if (!strcmp(name, "prev_steps")) snprintf(val, sizeof val, "%d", k ? t->rungs[k - 1] : 0), known = 1;
                else if (!strcmp(name, "trial")) snprintf(val, sizeof val, "%d", t->number), known = 1;
                else if (!strcmp(name, "dir")) snprintf(val, sizeof val, "%s", t->dir), known = 1;
                for (int i = 0; i < st->s.n_params && !known; i++)
                    if (!strcmp(name, st->s.params[i].key)) tera_param_text(&st->s.params[i], t->x[i], val, sizeof val), known = 1;
            }
            if (known) {
                o += (size_t)snprintf(cmd + o, sizeof cmd - o, "%s", val);
                if (o >= sizeof cmd) o = sizeof cmd - 1;
                p = e + 1;
                continue;
            }
        }
        cmd[o++] = *p++;
    }
    cmd[o] = '\0';
    char log[64];
    snprintf(log, sizeof log, "trial_%04d_rung%d.out", t->number, k);
    char out[PATHBUF];
    snprintf(out, sizeof out, "%s/logs/%s", st->s.dir, log);
    unlink(out);
    char *argv[] = {"/bin/sh", "-c", cmd, NULL};
    tera_mkdirs(t->dir);
    return spawn(st, t, argv, log) > 0;
}

/* 1: started, 0: could not start, 2: no process needed (start_train) */
static int start_trial(study *st, trial *t) {
    return st->s.objective[0] ? start_command(st, t) : start_train(st, t);
}

/* ---- results ------------------------------------------------------------------------------------- */

/* train: the metric at each step from metrics.jsonl (the last record of a step wins). */
typedef struct {
    double *loss, *val;
    int n; /* steps seen: max step + 1 */
} curve;

static void read_curve(const char *dir, int max_steps, curve *c) {
    c->loss = tera_malloc((size_t)(max_steps + 1) * sizeof(double));
    c->val = tera_malloc((size_t)(max_steps + 1) * sizeof(double));
    for (int i = 0; i <= max_steps; i++) c->loss[i] = c->val[i] = NAN;
    c->n = 0;
    char path[PATHBUF];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) > 0) {
        if (line[len - 1] != '\n') break;
        cJSON *o = cJSON_Parse(line);
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
        const cJSON *l = cJSON_GetObjectItemCaseSensitive(o, "loss"), *v = cJSON_GetObjectItemCaseSensitive(o, "val_loss");
        if (cJSON_IsNumber(s) && s->valuedouble >= 0 && s->valuedouble <= max_steps) {
            const int step = (int)s->valuedouble;
            if (cJSON_IsNumber(l) && !cJSON_GetObjectItemCaseSensitive(o, "event")) {
                c->loss[step] = l->valuedouble;
                if (step + 1 > c->n) c->n = step + 1;
            }
            if (cJSON_IsNumber(v)) c->val[step] = v->valuedouble;
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
}

/* The objective after r steps: mean loss of the last `window` steps, or the newest val_loss. NAN when
 * not known (yet). */
static double curve_value(const study *st, const curve *c, int r) {
    if (c->n < r) return NAN;
    if (!strcmp(st->s.metric, "val_loss")) {
        for (int s = r - 1; s >= 0; s--)
            if (!isnan(c->val[s])) return c->val[s];
        return NAN;
    }
    const int w = st->s.window < r ? st->s.window : r;
    double sum = 0;
    for (int s = r - w; s < r; s++) {
        if (isnan(c->loss[s])) return NAN;
        sum += c->loss[s];
    }
    return sum / w;
}

/* ASHA: is t, with its value at rung k, in the best floor(n / eta) of its bracket's rung k? */
static int promotable(const study *st, const trial *t, int k) {
    double vals[4096];
    int n = 0;
    for (int i = 0; i < st->n && n < 4096; i++) {
        const trial *u = &st->t[i];
        if (u->bracket == t->bracket && u->rung_done > k) vals[n++] = u->values[k];
    }
    return tera_asha_promotable(t->values[k], vals, n, st->s.eta);
}

static void record_rung(study *st, trial *t, int k, double v) {
    t->values[k] = v;
    t->rung_done = k + 1;
    if (st->events) {
        fprintf(st->events, "{\"trial\": %d, \"bracket\": %d, \"rung\": %d, \"steps\": %d, \"value\": %.10g, "
                "\"final\": %s, \"cum_steps\": %ld, \"time\": %.3f}\n", t->number, t->bracket, k, t->rungs[k], v,
                k == t->n_rungs - 1 ? "true" : "false", (long)st->steps_used, tera_registry_now());
        fflush(st->events);
    }
    fprintf(stderr, "tera tune: trial %d (bracket %d) rung %d at %d steps: %s %.6g\n", t->number, t->bracket, k,
            t->rungs[k], st->s.objective[0] ? "value" : st->s.metric, v);
}

/* A segment ended (its process, or no process: start_train's 2): the trial trained from its last
 * rung to rung k (a train trial stops there: training.stop_at_step) or the objective command ran at
 * rung k; account its steps and decide its state. */
static void on_exit_trial(study *st, trial *t, int status) {
    const int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    t->pid = -1;
    const int k = t->rung_done, prev = k ? t->rungs[k - 1] : 0;
    double v = NAN;
    int64_t used = t->rungs[k] - prev;
    char why[PATHBUF + 128];
    if (!st->s.objective[0]) {
        curve c;
        read_curve(t->dir, st->s.max_steps, &c);
        if (c.n >= t->rungs[k]) v = curve_value(st, &c, t->rungs[k]);
        if (!ok || isnan(v)) used = c.n > prev ? c.n - prev : 0; /* the steps it did train */
        free(c.loss);
        free(c.val);
        snprintf(why, sizeof why, "%s; see %s/logs/trial_%04d.log",
                 ok ? "its metric at the rung is missing from metrics.jsonl" : "tera train exited with an error",
                 st->s.dir, t->number);
    } else {
        char out[PATHBUF];
        snprintf(out, sizeof out, "%s/logs/trial_%04d_rung%d.out", st->s.dir, t->number, k);
        FILE *f = fopen(out, "r");
        if (f) {
            char line[512];
            while (fgets(line, sizeof line, f)) {
                char *end;
                const double x = strtod(line, &end);
                while (*end == ' ' || *end == '\n' || *end == '\r' || *end == '\t') end++;
                if (end != line && *end == '\0') v = x;
            }
            fclose(f);
        }
        snprintf(why, sizeof why, "the objective command %s; see %s",
                 ok ? "printed no number on its last line" : "exited with an error", out);
    }
    t->steps_used += used;
    st->steps_used += used;
    if (!ok || !isfinite(v)) {
        t->state = T_FAILED;
        fprintf(stderr, "tera tune: trial %d failed (%s)\n", t->number, why);
        save_trial(st, t);
        return;
    }
    record_rung(st, t, k, v);
    if (k == t->n_rungs - 1) t->state = T_COMPLETE;
    else if (promotable(st, t, k)) t->state = T_PENDING; /* continues at once */
    else t->state = T_PAUSED;
    save_trial(st, t);
}

/* ---- sampling ------------------------------------------------------------------------------------ */

static const study *g_cmp_study;
static int cmp_double_asc(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static int cmp_trial_idx(const void *a, const void *b) {
    const trial *x = &g_cmp_study->t[*(const int *)a], *y = &g_cmp_study->t[*(const int *)b];
    if (fidelity(x) != fidelity(y)) return fidelity(y) - fidelity(x); /* higher fidelity first */
    const double vx = value_at(x), vy = value_at(y);
    return vx < vy ? -1 : vx > vy;
}

/* TPE sees every trial with a value, ranked by the fidelity of its newest value (more steps first),
 * then by that value (as Optuna ranks complete before pruned trials); random for the first
 * `startup` trials. */
static void sample(study *st, trial *t) {
    int *order = tera_malloc((size_t)(st->n + 1) * sizeof(int));
    int n = 0;
    for (int i = 0; i < st->n; i++)
        if (&st->t[i] != t && st->t[i].rung_done > 0) order[n++] = i;
    if (st->s.sampler == TERA_SAMPLER_RANDOM || n < st->s.startup || n < 2) {
        tera_sample_random(&st->s, t->number, t->x);
    } else if (st->s.sampler == TERA_SAMPLER_GP) { /* every value brought to max_steps, running trials as liars */
        int lv[TERA_TUNE_MAX_RUNGS];
        const int L = tera_rungs(&st->s, 0, lv), P = st->s.n_params;
        double *vals = tera_malloc((size_t)n * L * sizeof(double)), *out = tera_malloc((size_t)n * sizeof(double));
        double *xs = tera_malloc((size_t)(st->n + 1) * P * sizeof(double)), *ys = tera_malloc((size_t)n * sizeof(double));
        for (int j = 0; j < n * L; j++) vals[j] = NAN;
        for (int j = 0; j < n; j++) {
            const trial *u = &st->t[order[j]];
            for (int k = 0; k < u->rung_done; k++)
                for (int l = 0; l < L; l++)
                    if (lv[l] == u->rungs[k]) vals[(size_t)j * L + l] = u->values[k];
        }
        tera_fidelity_map(vals, n, L, out);
        int m = 0, np = 0;
        for (int j = 0; j < n; j++)
            if (isfinite(out[j])) {
                memcpy(xs + (size_t)m * P, st->t[order[j]].x, (size_t)P * sizeof(double));
                ys[m++] = out[j];
            }
        double *pend = xs + (size_t)m * P; /* after the observations */
        for (int i = 0; i < st->n; i++)
            if (&st->t[i] != t && st->t[i].rung_done == 0 && (st->t[i].state == T_RUNNING || st->t[i].state == T_PENDING))
                memcpy(pend + (size_t)np++ * P, st->t[i].x, (size_t)P * sizeof(double));
        tera_sample_gp(&st->s, xs, ys, m, pend, np, t->number, t->x);
        free(vals), free(out), free(xs), free(ys);
    } else {
        g_cmp_study = st;
        qsort(order, (size_t)n, sizeof(int), cmp_trial_idx);
        double *xs = tera_malloc((size_t)st->n * TERA_TUNE_MAX_PARAMS * sizeof(double));
        for (int i = 0; i < st->n; i++) memcpy(xs + (size_t)i * st->s.n_params, st->t[i].x, st->s.n_params * sizeof(double));
        tera_sample_tpe(&st->s, xs, order, n, t->number, t->x);
        free(xs);
    }
    free(order);
}

/* ---- outputs ------------------------------------------------------------------------------------- */

static const trial *best_trial(const study *st) {
    const trial *b = NULL;
    for (int i = 0; i < st->n; i++) {
        const trial *t = &st->t[i];
        if (!t->rung_done || t->state == T_FAILED) continue;
        if (!b || fidelity(t) > fidelity(b) || (fidelity(t) == fidelity(b) && value_at(t) < value_at(b))) b = t;
    }
    return b;
}

/* Between-bin variance share of each parameter (4 quantile bins over the trials at full fidelity,
 * else at their highest rung): a cheap parameter importance. */
static void importance(const study *st, FILE *f) {
    int idx[4096], n = 0, top = 0;
    for (int i = 0; i < st->n; i++)
        if (fidelity(&st->t[i]) > top) top = fidelity(&st->t[i]);
    for (int i = 0; i < st->n && n < 4096; i++)
        if (fidelity(&st->t[i]) == top && top > 0) idx[n++] = i;
    fprintf(f, "\n## Parameter importance\n\nShare of the variance of the objective (trials at %d steps, n = %d) "
            "explained by each parameter alone (4 quantile bins; choices by value).\n\n| parameter | importance |\n"
            "| --- | --- |\n", top, n);
    if (n < 4) {
        fprintf(f, "| (too few trials) | |\n");
        return;
    }
    double mean = 0, var = 0;
    for (int j = 0; j < n; j++) mean += value_at(&st->t[idx[j]]);
    mean /= n;
    for (int j = 0; j < n; j++) var += pow(value_at(&st->t[idx[j]]) - mean, 2);
    for (int p = 0; p < st->s.n_params; p++) {
        double xs[4096];
        for (int j = 0; j < n; j++) xs[j] = st->t[idx[j]].x[p];
        double sorted[4096];
        memcpy(sorted, xs, (size_t)n * sizeof(double));
        qsort(sorted, (size_t)n, sizeof(double), cmp_double_asc);
        double bsum[TERA_TUNE_MAX_CHOICES + 4] = {0};
        int bn[TERA_TUNE_MAX_CHOICES + 4] = {0};
        const int choice = st->s.params[p].dist == TERA_DIST_CHOICE;
        for (int j = 0; j < n; j++) {
            int b = 0;
            if (choice) b = (int)xs[j];
            else
                for (int q = 1; q < 4; q++) b += xs[j] > sorted[q * n / 4];
            bsum[b] += value_at(&st->t[idx[j]]);
            bn[b]++;
        }
        double between = 0;
        for (int b = 0; b < TERA_TUNE_MAX_CHOICES + 4; b++)
            if (bn[b]) between += bn[b] * pow(bsum[b] / bn[b] - mean, 2);
        fprintf(f, "| %s | %.3f |\n", st->s.params[p].key, var > 0 ? between / var : 0.0);
    }
}

static int write_outputs(study *st) {
    const trial *b = best_trial(st);
    char path[PATHBUF];
    if (!b) {
        tera_fail(TERA_ERR_NUMERIC, "study '%s': no trial produced a value (see %s/logs)", st->s.name, st->s.dir);
        return tera_cli_error();
    }
    snprintf(path, sizeof path, "%s/best.ini", st->s.dir);
    char tmp[PATHBUF + 16];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (!st->s.objective[0]) { /* the trial's whole resolved configuration */
        tera_config cfg;
        tera_config_defaults(&cfg);
        if (st->s.base[0] && tera_config_load(&cfg, st->s.base) != TERA_OK) return tera_cli_error();
        char *argv[256], store[4096];
        int argc = 0;
        split_args(st->s.args, argv, &argc, 200, store, sizeof store);
        for (int i = 0; i < argc; i++)
            if (!strncmp(argv[i], "--", 2) && strchr(argv[i], '=') && tera_config_set(&cfg, argv[i] + 2) != TERA_OK)
                return tera_cli_error();
        for (int i = 0; i < st->s.n_params; i++) {
            char v[80], a[256];
            tera_param_text(&st->s.params[i], b->x[i], v, sizeof v);
            snprintf(a, sizeof a, "%s=%s", st->s.params[i].key, v);
            if (tera_config_set(&cfg, a) != TERA_OK) return tera_cli_error();
        }
        cfg.training.steps = st->s.max_steps;
        if (tera_config_finalize(&cfg) != TERA_OK || tera_config_write(&cfg, tmp) != TERA_OK) return tera_cli_error();
    } else {
        FILE *f = fopen(tmp, "w");
        if (!f) {
            tera_fail(TERA_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
            return tera_cli_error();
        }
        fprintf(f, "# study %s: best trial %d, value %.10g at %d steps\n[best]\n", st->s.name, b->number, value_at(b),
                b->rungs[b->rung_done - 1]);
        for (int i = 0; i < st->s.n_params; i++) {
            char v[80];
            tera_param_text(&st->s.params[i], b->x[i], v, sizeof v);
            fprintf(f, "%s = %s\n", st->s.params[i].key, v);
        }
        if (fclose(f) != 0) {
            tera_fail(TERA_ERR_IO, "cannot write %s", tmp);
            return tera_cli_error();
        }
    }
    if (rename(tmp, path) != 0) {
        tera_fail(TERA_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        return tera_cli_error();
    }
    /* the report */
    snprintf(path, sizeof path, "%s/report.md", st->s.dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        tera_fail(TERA_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
        return tera_cli_error();
    }
    int counts[6] = {0};
    for (int i = 0; i < st->n; i++) counts[st->t[i].state]++;
    fprintf(f, "# Study %s\n\nsampler %s, scheduler %s (eta %d, steps %d..%d), %d trials: %d complete, %d stopped early, "
            "%d failed; %ld trial-steps.\n\nBest: trial %d, %s %.6g at %d steps (config: best.ini).\n\n## Trials\n\n"
            "| trial | state | bracket | steps | value |", st->s.name,
            st->s.sampler == TERA_SAMPLER_TPE ? "tpe" : st->s.sampler == TERA_SAMPLER_GP ? "gp" : "random",
            st->s.scheduler == TERA_SCHED_NONE ? "none" : st->s.scheduler == TERA_SCHED_ASHA ? "asha" : "hyperband",
            st->s.eta, st->s.min_steps, st->s.max_steps, st->n, counts[T_COMPLETE], counts[T_STOPPED] + counts[T_PAUSED],
            counts[T_FAILED], (long)st->steps_used, b->number, st->s.objective[0] ? "value" : st->s.metric, value_at(b),
            b->rungs[b->rung_done - 1]);
    for (int p = 0; p < st->s.n_params; p++) fprintf(f, " %s |", st->s.params[p].key);
    fprintf(f, " curve (value per rung) |\n|---|---|---|---|---|");
    for (int p = 0; p < st->s.n_params; p++) fprintf(f, "---|");
    fprintf(f, "---|\n");
    int *order = tera_malloc((size_t)st->n * sizeof(int));
    for (int i = 0; i < st->n; i++) order[i] = i;
    g_cmp_study = st;
    qsort(order, (size_t)st->n, sizeof(int), cmp_trial_idx);
    for (int j = 0; j < st->n; j++) {
        const trial *t = &st->t[order[j]];
        fprintf(f, "| %d | %s | %d | %d | %.6g |", t->number, STATE_NAMES[t->state], t->bracket,
                t->rung_done ? t->rungs[t->rung_done - 1] : 0, value_at(t));
        for (int p = 0; p < st->s.n_params; p++) {
            char v[80];
            tera_param_text(&st->s.params[p], t->x[p], v, sizeof v);
            fprintf(f, " %s |", v);
        }
        fprintf(f, " ");
        for (int k = 0; k < t->rung_done; k++) fprintf(f, "%s%d: %.4g", k ? ", " : "", t->rungs[k], t->values[k]);
        fprintf(f, " |\n");
    }
    free(order);
    importance(st, f);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        tera_fail(TERA_ERR_IO, "cannot write %s", path);
        return tera_cli_error();
    }
    tera_registry_run(st->reg, "UPDATE studies SET status='finished', best_trial=?, best_value=?, budget_used=? "
                      "WHERE name=?", "idis", (int64_t)b->number, value_at(b), st->steps_used, st->s.name);
    char *pj = params_json(st, b);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru); /* tera tune's own work (sampling, scheduling, the registry), not its trials' */
    const double self_s = (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_sec +
                          1e-6 * (double)ru.ru_stime.tv_usec;
    printf("{\"study\": \"%s\", \"best_trial\": %d, \"best_value\": %.10g, \"best_steps\": %d, \"trials\": %d, "
           "\"complete\": %d, \"stopped\": %d, \"failed\": %d, \"trial_steps\": %ld, \"tune_cpu_s\": %.3f, "
           "\"best_params\": %s}\n", st->s.name,
           b->number, value_at(b), b->rungs[b->rung_done - 1], st->n, counts[T_COMPLETE],
           counts[T_STOPPED] + counts[T_PAUSED], counts[T_FAILED], (long)st->steps_used, self_s, pj);
    free(pj);
    fprintf(stderr, "tera tune: best trial %d (%.6g); wrote %s/best.ini and %s/report.md\n", b->number, value_at(b),
            st->s.dir, st->s.dir);
    return 0;
}

/* ---- the loop ------------------------------------------------------------------------------------ */

static int run_study(study *st) {
    int running = 0;
    for (int i = 0; i < st->n; i++) running += st->t[i].state == T_RUNNING;
    while (!g_stop) {
        /* ended children */
        int status;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
            for (int i = 0; i < st->n; i++)
                if (st->t[i].pid == pid) {
                    running--;
                    on_exit_trial(st, &st->t[i], status);
                }
        /* free slots: a promotion first (ASHA), then an interrupted or continuing trial, then a new one */
        while (running < st->s.parallel) {
            trial *next = NULL;
            for (int i = 0; i < st->n && !next; i++) {
                trial *t = &st->t[i];
                if (t->state == T_PENDING) next = t;
                else if (t->state == T_PAUSED && t->rung_done > 0 && t->rung_done < t->n_rungs &&
                         promotable(st, t, t->rung_done - 1)) {
                    next = t;
                    fprintf(stderr, "tera tune: trial %d promoted to %d steps\n", t->number, t->rungs[t->rung_done]);
                }
            }
            if (!next && st->n < st->s.trials && (st->s.budget == 0 || st->steps_used < st->s.budget)) {
                next = new_trial(st);
                next->bracket = next->number % tera_brackets(&st->s);
                next->n_rungs = tera_rungs(&st->s, next->bracket, next->rungs);
                snprintf(next->dir, sizeof next->dir, "%.*s/trials/trial_%04d", TERA_PATH_MAX, st->s.dir, next->number);
                sample(st, next);
                char *pj = params_json(st, next);
                fprintf(stderr, "tera tune: trial %d (bracket %d): %s\n", next->number, next->bracket, pj);
                free(pj);
                next->state = T_PENDING;
                save_trial(st, next);
            }
            if (!next) break;
            const int started = start_trial(st, next);
            if (started == 2) { /* already at its rung: judged as if its process had just ended */
                on_exit_trial(st, next, 0);
                continue;
            }
            if (!started) {
                next->state = T_FAILED;
                save_trial(st, next);
                continue;
            }
            running++;
            save_trial(st, next);
        }
        if (running == 0) break;
        usleep(10 * 1000);
    }
    if (g_stop) {
        for (int i = 0; i < st->n; i++)
            if (st->t[i].pid > 0) kill(st->t[i].pid, SIGTERM);
        while (wait(NULL) > 0) {}
        fprintf(stderr, "tera tune: interrupted (signal %d): the study is kept in %s; run the same command to resume "
                "it\n", (int)g_stop, st->s.registry);
        return 1;
    }
    for (int i = 0; i < st->n; i++)
        if (st->t[i].state == T_PAUSED) { /* not promoted when the study ended: stopped for good */
            st->t[i].state = T_STOPPED;
            save_trial(st, &st->t[i]);
        }
    return write_outputs(st);
}

int tera_cmd_tune(int argc, char **argv) {
    const char *file = NULL, *study_name = NULL, *registry = NULL, *dir = NULL;
    int trials = 0, parallel = 0, fresh = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
        if ((!strcmp(a, "-c") || !strcmp(a, "--config")) && has) file = argv[++i];
        else if (!strcmp(a, "--study") && has) study_name = argv[++i];
        else if (!strcmp(a, "--registry") && has) registry = argv[++i];
        else if (!strcmp(a, "--dir") && has) dir = argv[++i];
        else if ((!strcmp(a, "--trials") || !strcmp(a, "--parallel")) && has) {
            /* the ranges of [study] trials and parallel (a bad number was ignored for the file's) */
            const int is_trials = a[2] == 't', hi = is_trials ? 100000 : 256;
            char *end;
            const long v = strtol(argv[++i], &end, 10);
            if (end == argv[i] || *end || v < 1 || v > hi) {
                tera_fail(TERA_ERR_ARG, "tera tune: %s '%s': expected an integer in [1, %d]", a, argv[i], hi);
                return tera_cli_error();
            }
            *(is_trials ? &trials : &parallel) = (int)v;
        }
        else if (!strcmp(a, "--fresh")) fresh = 1;
        else {
            tera_fail(TERA_ERR_ARG, "tera tune: unexpected argument '%s' (tera tune --help)", a);
            return tera_cli_error();
        }
    }
    if (study_name && !study_name[0]) {
        tera_fail(TERA_ERR_ARG, "tera tune: --study '': a study needs a name (its key in the registry)");
        return tera_cli_error();
    }
    if (!file) {
        tera_fail(TERA_ERR_ARG, "tera tune needs -c SEARCH.ini (docs/TRACKING.md)");
        return tera_cli_error();
    }
    study *st = tera_calloc(1, sizeof *st);
    int rc = 1;
    if (tera_search_load(&st->s, file) != TERA_OK) {
        rc = tera_cli_error();
        goto out;
    }
    if (study_name) snprintf(st->s.name, sizeof st->s.name, "%s", study_name);
    if (registry) snprintf(st->s.registry, sizeof st->s.registry, "%s", registry);
    if (dir) snprintf(st->s.dir, sizeof st->s.dir, "%s", dir);
    if (trials > 0) st->s.trials = trials;
    if (parallel > 0) st->s.parallel = parallel;
    /* keys tera tune sets itself */
    static const char *const own[] = {"training.steps", "training.stop_at_step", "logging.run_dir", "checkpoint.every",
                                      "logging.registry", NULL};
    for (int k = 0; own[k]; k++) {
        char pat[64];
        snprintf(pat, sizeof pat, "--%s=", own[k]);
        int in_space = 0;
        for (int i = 0; i < st->s.n_params; i++) in_space |= !strcmp(st->s.params[i].key, own[k]);
        if (!st->s.objective[0] && (strstr(st->s.args, pat) || in_space)) {
            tera_fail(TERA_ERR_CONFIG, "%s: %s is set by tera tune (max_steps, the rung, the trial directory, "
                      "min_steps, the registry): remove it from [study] args / [space]", file, own[k]);
            rc = tera_cli_error();
            goto out;
        }
    }
    if (readlink("/proc/self/exe", st->exe, sizeof st->exe - 1) < 0) snprintf(st->exe, sizeof st->exe, "tera");
    if (tera_mkdirs(st->s.dir) != TERA_OK || tera_registry_open(&st->reg, st->s.registry) != TERA_OK) {
        rc = tera_cli_error();
        goto out;
    }
    if (load_study(st, fresh)) goto out;
    char ev[PATHBUF];
    snprintf(ev, sizeof ev, "%s/events.jsonl", st->s.dir);
    st->events = fopen(ev, st->n ? "a" : "w"); /* a resumed study appends */
    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    fprintf(stderr, "tera tune: study '%s' in %s: %d parameters, %d trials (%d at once), sampler %s, scheduler %s, "
            "directory %s\n", st->s.name, st->s.registry, st->s.n_params, st->s.trials, st->s.parallel,
            st->s.sampler == TERA_SAMPLER_TPE ? "tpe" : st->s.sampler == TERA_SAMPLER_GP ? "gp" : "random",
            st->s.scheduler == TERA_SCHED_NONE ? "none" : st->s.scheduler == TERA_SCHED_ASHA ? "asha" : "hyperband",
            st->s.dir);
    rc = run_study(st);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
out:
    if (st->events) fclose(st->events);
    tera_registry_close(st->reg);
    free(st->t);
    free(st);
    return rc;
}
