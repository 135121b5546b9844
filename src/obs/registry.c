/* The run registry in SQLite and the tracker of one training run (include/tera/registry.h). */
#include "tera/registry.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <dirent.h>
#include <sqlite3.h>
#include <xxhash.h>

#include "tera/io.h"
#include "tera/mlflow.h"

struct tera_registry {
    sqlite3 *db;
    char path[TERA_PATH_MAX];
};

static const char *const SCHEMA =
    "CREATE TABLE IF NOT EXISTS runs("
    " id TEXT PRIMARY KEY, status TEXT NOT NULL, start_time REAL, end_time REAL, heartbeat REAL,"
    " hosts TEXT, command TEXT, run_dir TEXT, config TEXT, layout TEXT, git_commit TEXT, git_dirty INTEGER,"
    " version TEXT, dataset_path TEXT, dataset_bytes INTEGER, dataset_fp TEXT, tokenizer_fp TEXT,"
    " metrics_path TEXT, summary TEXT, checkpoints TEXT, error TEXT, study TEXT, trial INTEGER,"
    " segments INTEGER DEFAULT 1, mlflow_run TEXT);"
    "CREATE INDEX IF NOT EXISTS runs_dir ON runs(run_dir);"
    "CREATE TABLE IF NOT EXISTS params(run_id TEXT NOT NULL, key TEXT NOT NULL, value TEXT,"
    " PRIMARY KEY(run_id, key));"
    "CREATE TABLE IF NOT EXISTS studies(name TEXT PRIMARY KEY, spec TEXT, created REAL, updated REAL,"
    " status TEXT, best_trial INTEGER, best_value REAL, budget_used INTEGER DEFAULT 0);"
    "CREATE TABLE IF NOT EXISTS trials(study TEXT NOT NULL, number INTEGER NOT NULL, state TEXT NOT NULL,"
    " params TEXT, bracket INTEGER, rung INTEGER, step INTEGER, value REAL, rung_values TEXT, run_dir TEXT,"
    " steps_used INTEGER DEFAULT 0, started REAL, updated REAL, PRIMARY KEY(study, number));";

/* Every column SCHEMA gives, per table: an existing file whose tables lack one (an older or a
 * hand-edited registry; CREATE TABLE IF NOT EXISTS keeps its tables as they are) is refused at open,
 * instead of every later write failing with a warning and its data read as empty. */
static const char *const SCHEMA_CHECK[] = {
    "SELECT id, status, start_time, end_time, heartbeat, hosts, command, run_dir, config, layout, git_commit, "
    "git_dirty, version, dataset_path, dataset_bytes, dataset_fp, tokenizer_fp, metrics_path, summary, checkpoints, "
    "error, study, trial, segments, mlflow_run FROM runs LIMIT 0",
    "SELECT run_id, key, value FROM params LIMIT 0",
    "SELECT name, spec, created, updated, status, best_trial, best_value, budget_used FROM studies LIMIT 0",
    "SELECT study, number, state, params, bracket, rung, step, value, rung_values, run_dir, steps_used, started, "
    "updated FROM trials LIMIT 0",
    NULL};

static tera_status check_schema(tera_registry *r) {
    for (int i = 0; SCHEMA_CHECK[i]; i++) {
        sqlite3_stmt *s = NULL;
        const int rc = sqlite3_prepare_v2(r->db, SCHEMA_CHECK[i], -1, &s, NULL);
        sqlite3_finalize(s);
        if (rc != SQLITE_OK)
            return tera_fail(TERA_ERR_FORMAT, "registry %s: %s: not the schema this tera writes (an older or edited "
                             "registry? use another logging.registry)", r->path, sqlite3_errmsg(r->db));
    }
    return TERA_OK;
}

double tera_registry_now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + 1e-6 * (double)tv.tv_usec;
}

void *tera_registry_db(tera_registry *r) { return r ? r->db : NULL; }

static tera_status sql_fail(tera_registry *r, const char *what) {
    return tera_fail(TERA_ERR_IO, "registry %s: %s: %s", r->path, what, sqlite3_errmsg(r->db));
}

tera_status tera_registry_exec(tera_registry *r, const char *sql) {
    char *err = NULL;
    if (sqlite3_exec(r->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) return sql_fail(r, "BEGIN");
    if (sqlite3_exec(r->db, sql, NULL, NULL, &err) != SQLITE_OK) {
        tera_status st = tera_fail(TERA_ERR_IO, "registry %s: %s", r->path, err ? err : "error");
        sqlite3_free(err);
        sqlite3_exec(r->db, "ROLLBACK", NULL, NULL, NULL);
        return st;
    }
    if (sqlite3_exec(r->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        tera_status st = sql_fail(r, "COMMIT");
        sqlite3_exec(r->db, "ROLLBACK", NULL, NULL, NULL);
        return st;
    }
    return TERA_OK;
}

tera_status tera_registry_open(tera_registry **out, const char *path) {
    *out = NULL;
    tera_registry *r = tera_calloc(1, sizeof *r);
    snprintf(r->path, sizeof r->path, "%s", path);
    char dir[TERA_PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        tera_status st = tera_mkdirs(dir);
        if (st != TERA_OK) {
            free(r);
            return st;
        }
    }
    if (sqlite3_open_v2(path, &r->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, NULL) !=
        SQLITE_OK) {
        tera_status st = tera_fail(TERA_ERR_IO, "registry %s: cannot open: %s", path,
                                   r->db ? sqlite3_errmsg(r->db) : "out of memory");
        sqlite3_close(r->db);
        free(r);
        return st;
    }
    sqlite3_busy_timeout(r->db, 60000); /* concurrent writers wait for each other */
    char *err = NULL;
    /* WAL: readers never block the writer; the mode is stored in the file (set once) */
    if (sqlite3_exec(r->db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;", NULL, NULL, &err) != SQLITE_OK ||
        (sqlite3_free(err), err = NULL, tera_registry_exec(r, SCHEMA) != TERA_OK)) {
        tera_status st = err ? tera_fail(TERA_ERR_IO, "registry %s: %s (is it an SQLite database?)", path, err)
                             : tera_fail(TERA_ERR_IO, "registry %s: cannot create the schema: %s (is it an SQLite "
                                         "database?)", path, tera_last_error());
        sqlite3_free(err);
        sqlite3_close(r->db);
        free(r);
        return st;
    }
    const tera_status cs = check_schema(r);
    if (cs != TERA_OK) {
        sqlite3_close(r->db);
        free(r);
        return cs;
    }
    *out = r;
    return TERA_OK;
}

void tera_registry_close(tera_registry *r) {
    if (!r) return;
    sqlite3_close(r->db);
    free(r);
}

tera_status tera_registry_run(tera_registry *r, const char *sql, const char *types, ...) {
    sqlite3_stmt *s = NULL;
    if (sqlite3_prepare_v2(r->db, sql, -1, &s, NULL) != SQLITE_OK) return sql_fail(r, sql);
    va_list ap;
    va_start(ap, types);
    for (int i = 0; types[i]; i++) {
        const int at = i + 1;
        switch (types[i]) {
        case 's': {
            const char *v = va_arg(ap, const char *);
            if (v) sqlite3_bind_text(s, at, v, -1, SQLITE_TRANSIENT);
            else sqlite3_bind_null(s, at);
            break;
        }
        case 'i': sqlite3_bind_int64(s, at, va_arg(ap, int64_t)); break;
        case 'd': sqlite3_bind_double(s, at, va_arg(ap, double)); break;
        default: TERA_ASSERTF(0, "tera_registry_run: type '%c'", types[i]);
        }
    }
    va_end(ap);
    int rc;
    while ((rc = sqlite3_step(s)) == SQLITE_ROW) {}
    tera_status st = rc == SQLITE_DONE ? TERA_OK : sql_fail(r, "write");
    sqlite3_finalize(s);
    return st;
}

int tera_registry_reap(tera_registry *r, double stale_s) {
    const double now = tera_registry_now();
    if (tera_registry_run(r,
                          "UPDATE runs SET status='killed', end_time=heartbeat, error='no heartbeat since ' || "
                          "datetime(heartbeat, 'unixepoch') || ' UTC: the process ended without a word (SIGKILL, a "
                          "lost node)' WHERE status='running' AND heartbeat < ?",
                          "d", now - stale_s) != TERA_OK)
        return -1;
    return sqlite3_changes(r->db);
}

/* ---- fingerprints ------------------------------------------------------------------------------ */

static int file_size(const char *path, int64_t *n) {
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    *n = (int64_t)st.st_size;
    return 1;
}

/* XXH3 of a file streamed in blocks into state; 0 when unreadable. */
static int hash_file(XXH3_state_t *h, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    char buf[1 << 16];
    size_t k;
    while ((k = fread(buf, 1, sizeof buf, f)) > 0) XXH3_64bits_update(h, buf, k);
    fclose(f);
    return 1;
}

void tera_registry_dataset_fp(const char *path, char *fp, size_t cap, int64_t *bytes) {
    *bytes = 0;
    snprintf(fp, cap, "%s", "");
    if (!path || !path[0]) {
        snprintf(fp, cap, "embedded");
        return;
    }
    char idx[TERA_PATH_MAX + 8], bin[TERA_PATH_MAX + 8], sum[TERA_PATH_MAX + 8];
    snprintf(idx, sizeof idx, "%s.idx", path);
    snprintf(bin, sizeof bin, "%s.bin", path);
    snprintf(sum, sizeof sum, "%s.xxh3", path);
    int64_t ni = 0, nb = 0;
    XXH3_state_t *h = XXH3_createState();
    XXH3_64bits_reset(h);
    int ok = 0;
    if (file_size(idx, &ni) && file_size(bin, &nb)) { /* a Megatron prefix */
        *bytes = ni + nb;
        int64_t ns;
        ok = file_size(sum, &ns) ? hash_file(h, sum) : (hash_file(h, idx) && hash_file(h, bin));
    } else if (file_size(path, &nb)) { /* a text or .jsonl file, or raw u16 tokens */
        *bytes = nb;
        ok = hash_file(h, path);
    }
    if (ok) snprintf(fp, cap, "%016llx", (unsigned long long)XXH3_64bits_digest(h));
    XXH3_freeState(h);
}

void tera_registry_tokenizer_fp(const char *data_path, char *fp, size_t cap) {
    snprintf(fp, cap, "%s", "");
    int64_t n;
    char idx[TERA_PATH_MAX + 8];
    snprintf(idx, sizeof idx, "%s.idx", data_path ? data_path : "");
    if (!data_path || !data_path[0] || !file_size(idx, &n)) { /* byte-level tokens */
        snprintf(fp, cap, "bytes");
        return;
    }
    char dirs[2][TERA_PATH_MAX + 16];
    snprintf(dirs[0], sizeof dirs[0], "%s.tokenizer", data_path);
    snprintf(dirs[1], sizeof dirs[1], "%s", data_path);
    char *slash = strrchr(dirs[1], '/');
    if (slash) *slash = '\0';
    else snprintf(dirs[1], sizeof dirs[1], ".");
    for (int d = 0; d < 2; d++) {
        char enc[2 * TERA_PATH_MAX + 64], bpe[2 * TERA_PATH_MAX + 64];
        snprintf(enc, sizeof enc, "%s/encoder.json", dirs[d]);
        snprintf(bpe, sizeof bpe, "%s/vocab.bpe", dirs[d]);
        if (!file_size(enc, &n) || !file_size(bpe, &n)) continue;
        XXH3_state_t *h = XXH3_createState();
        XXH3_64bits_reset(h);
        if (hash_file(h, enc) && hash_file(h, bpe))
            snprintf(fp, cap, "%016llx", (unsigned long long)XXH3_64bits_digest(h));
        XXH3_freeState(h);
        return;
    }
}

/* ---- metrics summary --------------------------------------------------------------------------- */

char *tera_metrics_summary(const char *metrics_path) {
    int64_t size;
    if (!file_size(metrics_path, &size)) return NULL; /* only a regular file (not /dev/full, a pipe, ...) */
    FILE *f = fopen(metrics_path, "r");
    if (!f) return NULL;
    char *line = NULL;
    size_t cap = 0;
    long steps = 0, skipped = 0, n_tps = 0, last_step = -1;
    double final_loss = NAN, min_loss = INFINITY, val = NAN, tps = 0, elapsed = NAN;
    while (getline(&line, &cap, f) > 0) {
        cJSON *o = cJSON_Parse(line);
        if (!o) continue;
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "step");
        const cJSON *loss = cJSON_GetObjectItemCaseSensitive(o, "loss");
        const cJSON *vl = cJSON_GetObjectItemCaseSensitive(o, "val_loss");
        if (cJSON_IsNumber(vl)) val = vl->valuedouble;
        if (cJSON_IsNumber(loss) && !cJSON_GetObjectItemCaseSensitive(o, "event")) {
            if (cJSON_IsNumber(st)) last_step = (long)st->valuedouble; /* a resumed run repeats steps: the last counts */
            steps++;
            final_loss = loss->valuedouble;
            if (final_loss < min_loss) min_loss = final_loss;
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "tokens_per_s");
            if (cJSON_IsNumber(t)) tps += t->valuedouble, n_tps++;
            const cJSON *e = cJSON_GetObjectItemCaseSensitive(o, "elapsed_s");
            if (cJSON_IsNumber(e)) elapsed = e->valuedouble;
            const cJSON *sk = cJSON_GetObjectItemCaseSensitive(o, "skipped");
            if ((cJSON_IsNumber(sk) && sk->valuedouble != 0) || cJSON_IsTrue(sk)) skipped++;
        }
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    char a[64], b[64], c[64], d[64], e[64], out[1024];
    snprintf(out, sizeof out,
             "{\"records\": %ld, \"last_step\": %ld, \"final_loss\": %s, \"min_loss\": %s, \"final_val_loss\": %s, "
             "\"mean_tokens_per_s\": %s, \"elapsed_s\": %s, \"skipped\": %ld}",
             steps, last_step + 1, tera_json_num(a, sizeof a, "%.6g", final_loss),
             tera_json_num(b, sizeof b, "%.6g", steps ? min_loss : NAN), tera_json_num(c, sizeof c, "%.6g", val),
             tera_json_num(d, sizeof d, "%.1f", n_tps ? tps / (double)n_tps : NAN),
             tera_json_num(e, sizeof e, "%.3f", elapsed), skipped);
    return strdup(out);
}

/* ---- the tracker of one run --------------------------------------------------------------------- */

struct tera_track {
    tera_registry *reg;
    tera_mlflow *ml;
    char id[64];
    char run_dir[TERA_PATH_MAX];
    char metrics[TERA_PATH_MAX + 32];
    long metrics_off; /* MLflow: metrics.jsonl streamed up to here */
    double heartbeat_s;
    pthread_t thread;
    int thread_on;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    int ended;
};

static volatile sig_atomic_t g_track_signal;
static struct sigaction g_old_int, g_old_term;

static void on_signal(int sig) { g_track_signal = sig; }

/* SIGINT and SIGTERM of tera train land on a thread that only waits for them. A handled signal is
 * delivered on any thread that does not block it, and the kernel pushes its frame (~3 KiB with the
 * AVX-512 state) below that thread's stack pointer; oneDNN's JIT sgemm kernels (libdnnl before 3.11,
 * uxlfoundation/oneDNN#4845) run with rsp pointing into a heap workspace, so a frame pushed there
 * overwrites the heap ("corrupted size vs. prev_size", a segfault later). Every thread the run starts
 * inherits the block; this one and the tracker's unblock them. */
static void signal_set(sigset_t *s) {
    sigemptyset(s);
    sigaddset(s, SIGINT);
    sigaddset(s, SIGTERM);
}

static void *signal_pad(void *arg) {
    (void)arg;
    sigset_t s;
    signal_set(&s);
    pthread_sigmask(SIG_UNBLOCK, &s, NULL);
    for (;;) pause(); /* the handler (or the default action) runs here */
    return NULL;
}

void tera_track_signals_init(void) {
    static int done;
    if (done) return;
    done = 1;
    sigset_t s, old;
    signal_set(&s);
    pthread_sigmask(SIG_BLOCK, &s, &old);
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&th, &at, signal_pad, NULL) != 0) pthread_sigmask(SIG_SETMASK, &old, NULL); /* as before */
    pthread_attr_destroy(&at);
}

/* Streams the complete new lines of metrics.jsonl to MLflow (every number but "step"). */
static void stream_metrics(tera_track *t) {
    int64_t size;
    if (!t->ml || !tera_mlflow_ok(t->ml) || !file_size(t->metrics, &size)) return;
    FILE *f = fopen(t->metrics, "r");
    if (!f) return;
    if (fseek(f, t->metrics_off, SEEK_SET) != 0) {
        fclose(f);
        return;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    struct timeval tv;
    gettimeofday(&tv, NULL);
    const int64_t ts = (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
    while ((n = getline(&line, &cap, f)) > 0) {
        if (line[n - 1] != '\n') break; /* a line being written: next time */
        t->metrics_off += (long)n;
        cJSON *o = cJSON_Parse(line);
        if (!o) continue;
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "step");
        const int64_t step = cJSON_IsNumber(st) ? (int64_t)st->valuedouble : 0;
        for (const cJSON *x = o->child; x; x = x->next)
            if (cJSON_IsNumber(x) && strcmp(x->string, "step") != 0)
                tera_mlflow_metric(t->ml, x->string, x->valuedouble, step, ts);
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    tera_mlflow_flush(t->ml);
}

static void mark_killed(tera_track *t, int sig) {
    char why[96];
    snprintf(why, sizeof why, "stopped by signal %d (%s)", sig, strsignal(sig));
    if (t->reg)
        tera_registry_run(t->reg, "UPDATE runs SET status='killed', end_time=?, heartbeat=?, error=? WHERE id=?", "ddss",
                          tera_registry_now(), tera_registry_now(), why, t->id);
    if (t->ml) {
        stream_metrics(t);
        tera_mlflow_end(t->ml, "KILLED");
        t->ml = NULL;
    }
}

static void *track_thread(void *arg) {
    tera_track *t = arg;
    sigset_t sigs;
    signal_set(&sigs);
    pthread_sigmask(SIG_UNBLOCK, &sigs, NULL); /* a landing place too, and raise() below reaches this thread */
    double last_hb = tera_registry_now(), last_ml = last_hb;
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200 * 1000 * 1000; /* signals are noticed within 0.2 s */
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&t->cv, &t->mu, &ts);
        if (t->stop) break;
        const int sig = g_track_signal;
        if (sig) {
            mark_killed(t, sig);
            t->ended = 1;
            pthread_mutex_unlock(&t->mu);
            sigaction(SIGINT, &g_old_int, NULL);
            sigaction(SIGTERM, &g_old_term, NULL);
            raise(sig); /* the action the process had before the tracker */
            return NULL;
        }
        const double now = tera_registry_now();
        if (t->reg && now - last_hb >= t->heartbeat_s) {
            last_hb = now;
            tera_registry_run(t->reg, "UPDATE runs SET heartbeat=? WHERE id=? AND status='running'", "ds", now, t->id);
        }
        if (t->ml && now - last_ml >= 2.0) {
            last_ml = now;
            pthread_mutex_unlock(&t->mu);
            stream_metrics(t);
            pthread_mutex_lock(&t->mu);
        }
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Output of a shell command's first line (""/0 when it fails). */
static int first_line(const char *cmd, char *out, size_t cap) {
    out[0] = '\0';
    sigset_t s, old; /* the shell and git do not inherit tera train's blocked SIGINT/SIGTERM */
    signal_set(&s);
    pthread_sigmask(SIG_UNBLOCK, &s, &old);
    FILE *p = popen(cmd, "r");
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!p) return 0;
    if (!fgets(out, (int)cap, p)) out[0] = '\0';
    while (fgetc(p) != EOF) {}
    const int rc = pclose(p);
    out[strcspn(out, "\n")] = '\0';
    return rc == 0;
}

static void json_escape_into(cJSON *arr, const char *s) { cJSON_AddItemToArray(arr, cJSON_CreateString(s)); }

/* The checkpoints of the run directory as a JSON array of paths. */
static char *list_checkpoints(const char *run_dir) {
    cJSON *arr = cJSON_CreateArray();
    char dir[TERA_PATH_MAX + 32];
    snprintf(dir, sizeof dir, "%s/checkpoints", run_dir);
    struct dirent **ents = NULL;
    const int n = scandir(dir, &ents, NULL, alphasort);
    for (int i = 0; i < n; i++) {
        if (!strncmp(ents[i]->d_name, "step_", 5)) {
            char p[2 * TERA_PATH_MAX];
            snprintf(p, sizeof p, "%s/%s", dir, ents[i]->d_name);
            json_escape_into(arr, p);
        }
        free(ents[i]);
    }
    free(ents);
    char *s = cJSON_PrintUnformatted(arr);
    cJSON_Delete(arr);
    return s;
}

/* Each "key = value" of an INI text under its [section], as section.key (quotes removed). */
typedef void (*ini_fn)(void *user, const char *key, const char *value);
static void ini_each(const char *text, ini_fn fn, void *user) {
    char sec[128] = "";
    const char *p = text;
    while (*p) {
        const char *e = strchr(p, '\n');
        const size_t n = e ? (size_t)(e - p) : strlen(p);
        char line[4 * TERA_PATH_MAX];
        snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line - 1 ? n : sizeof line - 1), p);
        p += n + (e ? 1 : 0);
        char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        if (*s == '#' || *s == ';' || !*s) continue;
        if (*s == '[') {
            char *close = strchr(s, ']');
            if (close) snprintf(sec, sizeof sec, "%.*s", (int)(close - s - 1), s + 1);
            continue;
        }
        char *eq = strchr(s, '=');
        if (!eq) continue;
        char *ke = eq;
        while (ke > s && (ke[-1] == ' ' || ke[-1] == '\t')) ke--;
        *ke = '\0';
        char *v = eq + 1;
        while (*v == ' ' || *v == '\t') v++;
        size_t vl = strlen(v);
        while (vl > 0 && (v[vl - 1] == ' ' || v[vl - 1] == '\r')) v[--vl] = '\0';
        if (vl >= 2 && v[0] == '"' && v[vl - 1] == '"') v[vl - 1] = '\0', v++;
        char key[512];
        snprintf(key, sizeof key, "%s.%.300s", sec, s);
        fn(user, key, v);
    }
}

static void param_to_registry(void *user, const char *key, const char *value) {
    tera_track *t = user;
    tera_registry_run(t->reg, "INSERT OR REPLACE INTO params(run_id, key, value) VALUES(?, ?, ?)", "sss", t->id, key,
                      value);
}
static void param_to_mlflow(void *user, const char *key, const char *value) {
    tera_mlflow_param(((tera_track *)user)->ml, key, value);
}

const char *tera_track_id(const tera_track *t) { return t ? t->id : ""; }

tera_track *tera_track_start(const tera_config *cfg, int argc, char **argv, int64_t start_step, int world) {
    const tera_logging_config *lg = &cfg->logging;
    if (!lg->run_dir[0] || (!lg->registry[0] && !lg->mlflow_uri[0])) return NULL;
    tera_track *t = tera_calloc(1, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    if (!realpath(lg->run_dir, t->run_dir)) snprintf(t->run_dir, sizeof t->run_dir, "%s", lg->run_dir);
    snprintf(t->metrics, sizeof t->metrics, "%s/metrics.jsonl", t->run_dir);
    const char *hb = getenv("TERA_REGISTRY_HEARTBEAT_S");
    t->heartbeat_s = hb && atof(hb) > 0 ? atof(hb) : 10.0;
    if (lg->registry[0] && tera_registry_open(&t->reg, lg->registry) != TERA_OK)
        fprintf(stderr, "tera: warning: %s; this run is not registered (training goes on)\n", tera_last_error());

    /* what the run is: command line, configuration, layout, code, data */
    char cmd[8192];
    int k = snprintf(cmd, sizeof cmd, "tera train");
    for (int i = 0; i < argc && k < (int)sizeof cmd - 8; i++)
        k += snprintf(cmd + k, sizeof cmd - (size_t)k, strchr(argv[i], ' ') ? " '%s'" : " %s", argv[i]);
    char *config_text = NULL;
    char tmp[] = "/tmp/tera-config-XXXXXX";
    const int fd = mkstemp(tmp);
    if (fd >= 0) {
        close(fd);
        if (tera_config_write(cfg, tmp) == TERA_OK) tera_read_text_file(tmp, &config_text);
        unlink(tmp);
    }
    char layout[256];
    const tera_parallel_config *p = &cfg->parallel;
    snprintf(layout, sizeof layout, "world %d = pp %d x dp %d x tp %d; ep %d, zero %d, schedule %s", world, p->pp,
             p->dp, p->tp, p->ep, p->zero, p->pp_schedule);
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    char hosts[320];
    snprintf(hosts, sizeof hosts, world > 1 ? "%s (rank 0 of %d)" : "%s", host, world);
    char commit[64] = "", dirty_s[8] = "";
    int git = first_line("git rev-parse HEAD 2>/dev/null", commit, sizeof commit) && commit[0];
    int dirty = -1;
    if (git) {
        first_line("git --no-optional-locks status --porcelain --untracked-files=no 2>/dev/null | head -c 1 | wc -c",
                   dirty_s, sizeof dirty_s);
        dirty = atoi(dirty_s) > 0;
    }
    char dfp[32], tfp[32];
    int64_t dbytes;
    tera_registry_dataset_fp(cfg->data.path, dfp, sizeof dfp, &dbytes);
    tera_registry_tokenizer_fp(cfg->data.path, tfp, sizeof tfp);
    const char *study = getenv("TERA_STUDY"), *trial = getenv("TERA_TRIAL");
    const double now = tera_registry_now();

    /* --resume of a registered run directory continues its row */
    if (t->reg && start_step > 0) {
        sqlite3_stmt *s = NULL;
        if (sqlite3_prepare_v2(t->reg->db, "SELECT id FROM runs WHERE run_dir=? ORDER BY start_time DESC LIMIT 1", -1,
                               &s, NULL) == SQLITE_OK) {
            sqlite3_bind_text(s, 1, t->run_dir, -1, SQLITE_TRANSIENT);
            if (sqlite3_step(s) == SQLITE_ROW)
                snprintf(t->id, sizeof t->id, "%s", (const char *)sqlite3_column_text(s, 0));
            sqlite3_finalize(s);
        }
    }
    if (t->reg && t->id[0]) {
        if (tera_registry_run(t->reg,
                              "UPDATE runs SET status='running', heartbeat=?, end_time=NULL, error=NULL, "
                              "segments=segments+1, command=?, config=?, layout=?, hosts=? WHERE id=?",
                              "dsssss", now, cmd, config_text, layout, hosts, t->id) != TERA_OK)
            fprintf(stderr, "tera: warning: %s\n", tera_last_error());
    } else if (t->reg) {
        time_t tt = (time_t)now;
        struct tm tm;
        gmtime_r(&tt, &tm);
        char stamp[32];
        strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &tm);
        const uint64_t salt = XXH3_64bits_withSeed(t->run_dir, strlen(t->run_dir),
                                                   (uint64_t)getpid() * 1000003u ^ (uint64_t)(now * 1e6));
        snprintf(t->id, sizeof t->id, "%s-%06llx", stamp, (unsigned long long)(salt & 0xffffff));
        if (tera_registry_run(t->reg,
                              "INSERT INTO runs(id, status, start_time, heartbeat, hosts, command, run_dir, config, "
                              "layout, git_commit, git_dirty, version, dataset_path, dataset_bytes, dataset_fp, "
                              "tokenizer_fp, metrics_path, study, trial) VALUES(?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, "
                              "?, ?, ?, ?, ?, ?, ?, ?, ?)",
                              "sddssssssississsss", t->id, now, now, hosts, cmd, t->run_dir, config_text, layout,
                              git ? commit : NULL, (int64_t)dirty, TERA_VERSION, cfg->data.path, dbytes, dfp, tfp,
                              t->metrics, study, trial) != TERA_OK) {
            fprintf(stderr, "tera: warning: %s; this run is not registered (training goes on)\n", tera_last_error());
            tera_registry_close(t->reg);
            t->reg = NULL;
            t->id[0] = '\0';
        } else if (!git) {
            tera_registry_run(t->reg, "UPDATE runs SET git_dirty=NULL WHERE id=?", "s", t->id);
        }
    }
    if (t->reg && config_text) {
        sqlite3_exec(t->reg->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
        ini_each(config_text, param_to_registry, t);
        sqlite3_exec(t->reg->db, "COMMIT", NULL, NULL, NULL);
    }

    /* MLflow */
    if (lg->mlflow_uri[0]) {
        curl_global_init(CURL_GLOBAL_DEFAULT);
        const char *slash = strrchr(t->run_dir, '/');
        t->ml = tera_mlflow_start(lg->mlflow_uri, lg->mlflow_experiment[0] ? lg->mlflow_experiment : "tera",
                                  t->id[0] ? t->id : (slash ? slash + 1 : t->run_dir));
        if (t->ml) {
            if (config_text) ini_each(config_text, param_to_mlflow, t);
            tera_mlflow_tag(t->ml, "mlflow.source.name", "tera train");
            tera_mlflow_tag(t->ml, "mlflow.source.type", "LOCAL");
            if (git) {
                tera_mlflow_tag(t->ml, "mlflow.source.git.commit", commit);
                tera_mlflow_tag(t->ml, "git_commit", commit);
                tera_mlflow_tag(t->ml, "git_dirty", dirty ? "true" : "false");
            }
            tera_mlflow_tag(t->ml, "tera_version", TERA_VERSION);
            tera_mlflow_tag(t->ml, "dataset_path", cfg->data.path[0] ? cfg->data.path : "embedded");
            tera_mlflow_tag(t->ml, "dataset_fingerprint", dfp);
            tera_mlflow_tag(t->ml, "tokenizer_fingerprint", tfp);
            tera_mlflow_tag(t->ml, "layout", layout);
            tera_mlflow_tag(t->ml, "hosts", hosts);
            tera_mlflow_tag(t->ml, "command", cmd);
            if (t->id[0]) tera_mlflow_tag(t->ml, "tera_run_id", t->id);
            tera_mlflow_tag(t->ml, "run_dir", t->run_dir);
            tera_mlflow_flush(t->ml);
            char ini[TERA_PATH_MAX + 32];
            snprintf(ini, sizeof ini, "%s/config.ini", t->run_dir);
            tera_mlflow_artifact(t->ml, ini, "config.ini");
            if (t->reg)
                tera_registry_run(t->reg, "UPDATE runs SET mlflow_run=? WHERE id=?", "ss", tera_mlflow_run_id(t->ml),
                                  t->id);
            /* a resumed run directory: only the steps from here on (the earlier ones went to the earlier run) */
            int64_t sz;
            if (start_step > 0 && file_size(t->metrics, &sz)) t->metrics_off = (long)sz;
        }
    }
    free(config_text);
    if (!t->reg && !t->ml) {
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
        free(t);
        return NULL;
    }
    g_track_signal = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    /* a signal ignored when the run started (nohup, SIGINT of a background job) stays ignored */
    sigaction(SIGINT, NULL, &g_old_int);
    sigaction(SIGTERM, NULL, &g_old_term);
    if (g_old_int.sa_handler != SIG_IGN) sigaction(SIGINT, &sa, NULL);
    if (g_old_term.sa_handler != SIG_IGN) sigaction(SIGTERM, &sa, NULL);
    t->thread_on = pthread_create(&t->thread, NULL, track_thread, t) == 0;
    if (!t->thread_on) { /* nobody would act on a caught signal */
        sigaction(SIGINT, &g_old_int, NULL);
        sigaction(SIGTERM, &g_old_term, NULL);
    }
    if (t->reg) fprintf(stderr, "tera: registry %s: run %s\n", lg->registry, t->id);
    if (t->ml) fprintf(stderr, "tera: MLflow %s: run %s\n", lg->mlflow_uri, tera_mlflow_run_id(t->ml));
    return t;
}

void tera_track_end(tera_track *t, const char *status, const char *error) {
    if (!t) return;
    if (t->thread_on) {
        pthread_mutex_lock(&t->mu);
        t->stop = 1;
        pthread_cond_signal(&t->cv);
        pthread_mutex_unlock(&t->mu);
        pthread_join(t->thread, NULL);
    }
    /* a signal caught after the tracker's last look (or during the final write below) is recorded,
     * and the process ends by it at the end: as without a tracker */
    const int caught = t->thread_on && !t->ended; /* our handler is installed and nobody acted on it */
    int sig = caught ? g_track_signal : 0;
    if (sig) {
        mark_killed(t, sig);
    } else if (!t->ended) {
        char *summary = tera_metrics_summary(t->metrics);
        char *ckpts = list_checkpoints(t->run_dir);
        if (t->reg &&
            tera_registry_run(t->reg,
                              "UPDATE runs SET status=?, end_time=?, heartbeat=?, error=?, summary=?, checkpoints=? "
                              "WHERE id=?",
                              "sddssss", status, tera_registry_now(), tera_registry_now(), error, summary, ckpts,
                              t->id) != TERA_OK)
            fprintf(stderr, "tera: warning: %s\n", tera_last_error());
        if (t->ml) {
            stream_metrics(t);
            tera_mlflow_end(t->ml, !strcmp(status, "finished") ? "FINISHED"
                                   : !strcmp(status, "killed") ? "KILLED" : "FAILED");
            t->ml = NULL;
        }
        free(summary);
        free(ckpts);
    }
    sigaction(SIGINT, &g_old_int, NULL);
    sigaction(SIGTERM, &g_old_term, NULL);
    if (caught && !sig && (sig = g_track_signal) != 0) mark_killed(t, sig);
    tera_registry_close(t->reg);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
    if (sig) {
        sigset_t s;
        sigemptyset(&s);
        sigaddset(&s, sig);
        pthread_sigmask(SIG_UNBLOCK, &s, NULL);
        raise(sig); /* the action the process had before the tracker */
    }
}
