/* tera launch: the elastic supervisor (docs/ELASTIC.md). It runs `mpirun ... tera train ...`, watches
 * every rank's heartbeat (src/elastic/heartbeat.c) and mpirun's exit, and on a failure (a dead rank, a
 * hung rank, a lost host) tears the job down, excludes the host at fault (bounded retries; hosts that
 * answer again are re-admitted at the next restart), picks a layout for the ranks left (fewer
 * data-parallel replicas and more gradient accumulation, so the global batch stays, or the first
 * fitting entry of --layouts) and relaunches with --resume. Every event is one JSON line in
 * RUN_DIR/elastic/events.jsonl with its timings. It never joins MPI itself (main.c runs it first). */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "tera/ckpt.h"
#include "tera/elastic.h"
#include "tera/io.h"

#define MAX_HOSTS 256
#define MAX_ARGS 512
#define MAX_RANKS 4096

typedef struct {
    char name[128];
    int slots;
    int failures;      /* failures this host was found at fault for */
    int out;           /* 1: not in the current job */
    int fault_now;     /* at fault in the failure being handled */
} host_t;

typedef struct {
    int dp, tp, pp, ep, accum;
} layout_t;

typedef struct {
    host_t hosts[MAX_HOSTS];
    int n_hosts;
    int max_restarts, host_retries, np;
    double hang_floor, hang_factor, start_timeout, teardown_timeout, probe_timeout, alive_stale;
    const char *layouts;      /* --layouts */
    const char *agent;        /* --rsh-agent */
    const char *mpirun;       /* --mpirun (a command with its options, split on blanks) */
    const char *mpi_args;     /* --mpi-args */
    char **train;             /* the command after --: TERA train ARGS... */
    int n_train;
    tera_config cfg;          /* the training command's configuration */
    layout_t base;            /* its layout */
    char run_dir[TERA_PATH_MAX];
    char edir[TERA_PATH_MAX + 16];
    char mpi_sess[TERA_PATH_MAX + 64]; /* Open MPI's session directory base on this host, when ours ("" if the
                                        * caller set OMPI_MCA_orte_tmpdir_base) */
    FILE *events;
    double t0;                /* supervisor start (monotonic) */
} sup_t;

static volatile sig_atomic_t g_stop; /* SIGINT / SIGTERM to the supervisor: tear the job down and stop */
static void on_stop(int sig) { g_stop = sig; }

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One event: a JSON object with "event", "t" (seconds since the supervisor started), "wall" (Unix
 * time) and the caller's fields (fmt: JSON text to follow, starting with ", "); also a line on stderr. */
__attribute__((format(printf, 3, 4))) static void event(sup_t *s, const char *name, const char *fmt, ...) {
    static char body[20000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof body, fmt, ap);
    va_end(ap);
    static char line[20600];
    snprintf(line, sizeof line, "{\"event\": \"%s\", \"t\": %.3f, \"wall\": %.3f%s}\n", name, mono() - s->t0, wall(), body);
    if (s->events) {
        fputs(line, s->events);
        fflush(s->events);
    }
    fprintf(stderr, "tera launch: %s", line);
}

/* text as the inside of a JSON string (quotes, backslashes and control characters escaped) */
static const char *esc(const char *in, char *out, size_t cap) {
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)in; *p && n + 7 < cap; p++) {
        if (*p == '"' || *p == '\\') out[n++] = '\\', out[n++] = (char)*p;
        else if (*p < 0x20) n += (size_t)snprintf(out + n, cap - n, "\\u%04x", *p);
        else out[n++] = (char)*p;
    }
    out[n] = 0;
    return out;
}

/* ------------------------------------------------------------------ hosts */

static tera_status add_host(sup_t *s, const char *name, int slots, const char *where) {
    if (!*name) return TERA_OK;
    if (slots < 1) return tera_fail(TERA_ERR_ARG, "%s: host '%s' has %d slots (at least 1)", where, name, slots);
    if (strlen(name) >= sizeof s->hosts[0].name) return tera_fail(TERA_ERR_ARG, "%s: host name '%s' is too long", where, name);
    for (int i = 0; i < s->n_hosts; i++)
        if (!strcmp(s->hosts[i].name, name)) return tera_fail(TERA_ERR_ARG, "%s: host '%s' is listed twice", where, name);
    if (s->n_hosts >= MAX_HOSTS) return tera_fail(TERA_ERR_ARG, "%s: more than %d hosts", where, MAX_HOSTS);
    host_t *h = &s->hosts[s->n_hosts++];
    memset(h, 0, sizeof *h);
    snprintf(h->name, sizeof h->name, "%s", name);
    h->slots = slots;
    return TERA_OK;
}

/* A slot count at p: 1..65536, else 0 (99999999999 used to become 1215752191); *end after it. */
static int parse_slots(const char *p, char **end) {
    const long v = strtol(p, end, 10);
    return *end == p || v < 1 || v > 65536 ? 0 : (int)v;
}

/* "h1:2,h2:2" (no ":N": 1 slot) */
static tera_status parse_hosts(sup_t *s, const char *list) {
    char buf[8192];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *colon = strrchr(tok, ':');
        int slots = 1;
        if (colon) {
            char *end;
            if ((slots = parse_slots(colon + 1, &end)) == 0 || *end)
                return tera_fail(TERA_ERR_ARG, "--hosts: '%s': expected HOST:SLOTS with SLOTS in 1..65536", tok);
            *colon = 0;
        }
        TERA_TRY(add_host(s, tok, slots, "--hosts"));
    }
    return TERA_OK;
}

/* Open MPI's format: "host [slots=N]" per line, # comments */
static tera_status parse_hostfile(sup_t *s, const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return tera_fail(TERA_ERR_IO, "--hostfile '%s': %s", path, strerror(errno));
    char line[1024];
    int ln = 0;
    tera_status st = TERA_OK;
    while (st == TERA_OK && fgets(line, sizeof line, f)) {
        ln++;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char name[256] = "";
        if (sscanf(line, "%255s", name) != 1) continue;
        int slots = 1;
        const char *sl = strstr(line, "slots=");
        char where[TERA_PATH_MAX + 32];
        snprintf(where, sizeof where, "%s:%d", path, ln);
        if (sl) {
            char *end;
            if ((slots = parse_slots(sl + 6, &end)) == 0 || (*end && !isspace((unsigned char)*end))) {
                st = tera_fail(TERA_ERR_ARG, "%s: host '%s': slots= must be an integer in 1..65536", where, name);
                break;
            }
        }
        st = add_host(s, name, slots, where);
    }
    fclose(f);
    return st;
}

/* Slurm's allocation: SLURM_JOB_NODELIST ("n[01-03,07],gpu5") and SLURM_TASKS_PER_NODE ("2(x3),1")
 * or SLURM_NTASKS_PER_NODE. */
static tera_status parse_slurm(sup_t *s, const char *list) {
    const char *tpn = getenv("SLURM_TASKS_PER_NODE");
    const char *ntpn = getenv("SLURM_NTASKS_PER_NODE");
    int counts[MAX_HOSTS], nc = 0;
    for (const char *p = tpn; p && *p && nc < MAX_HOSTS;) {
        int v = atoi(p), rep = 1;
        while (isdigit((unsigned char)*p)) p++;
        if (!strncmp(p, "(x", 2)) rep = atoi(p + 2), p = strchr(p, ')') ? strchr(p, ')') + 1 : p + strlen(p);
        for (int r = 0; r < rep && nc < MAX_HOSTS; r++) counts[nc++] = v;
        if (*p == ',') p++;
        else break;
    }
    int k = 0;
    for (const char *p = list; *p;) {
        char prefix[128];
        size_t n = 0;
        while (*p && *p != ',' && *p != '[' && n + 1 < sizeof prefix) prefix[n++] = *p++;
        prefix[n] = 0;
        char names[MAX_HOSTS][160];
        int nn = 0;
        if (*p == '[') {
            p++;
            while (*p && *p != ']') {
                char *end;
                const char *a = p;
                long lo = strtol(p, &end, 10), hi = lo;
                const int width = (int)(end - a);
                p = end;
                if (*p == '-') hi = strtol(p + 1, &end, 10), p = end;
                for (long v = lo; v <= hi && nn < MAX_HOSTS; v++) snprintf(names[nn++], sizeof names[0], "%s%0*ld", prefix, width, v);
                if (*p == ',') p++;
                else if (*p != ']') return tera_fail(TERA_ERR_ARG, "SLURM_JOB_NODELIST '%s': cannot read the range", list);
            }
            if (*p == ']') p++;
        } else {
            snprintf(names[nn++], sizeof names[0], "%s", prefix);
        }
        for (int i = 0; i < nn; i++, k++)
            TERA_TRY(add_host(s, names[i], ntpn ? atoi(ntpn) : k < nc ? counts[k] : 1, "SLURM_JOB_NODELIST"));
        if (*p == ',') p++;
    }
    return TERA_OK;
}

static int host_of_rank(const sup_t *s, int rank) { /* by-slot placement over the hosts in the job */
    int at = 0;
    for (int i = 0; i < s->n_hosts; i++) {
        if (s->hosts[i].out) continue;
        if (rank < at + s->hosts[i].slots) return i;
        at += s->hosts[i].slots;
    }
    return -1;
}

static int find_host(const sup_t *s, const char *name) {
    for (int i = 0; i < s->n_hosts; i++)
        if (!strcmp(s->hosts[i].name, name)) return i;
    return -1;
}

/* Runs argv (no shell) with stdout/stderr to /dev/null; its exit status, or -1 after `timeout` s. */
static int run_bounded(char **argv, double timeout) {
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        setpgid(0, 0);
        int fd = open("/dev/null", O_RDWR);
        if (fd >= 0) dup2(fd, 0), dup2(fd, 1), dup2(fd, 2);
        execvp(argv[0], argv);
        _exit(127);
    }
    setpgid(pid, pid);
    const double end = mono() + timeout;
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        if (mono() > end) {
            kill(-pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        usleep(20000);
    }
}

/* A host answers when the launcher's own path to it works: `AGENT HOST true` (ssh by default). */
static int probe(sup_t *s, int h) {
    char self[256] = "";
    gethostname(self, sizeof self - 1);
    const char *name = s->hosts[h].name;
    if (!s->agent && (!strcmp(name, "localhost") || !strcmp(name, "127.0.0.1") || !strcmp(name, self)))
        return 1; /* this machine: mpirun starts its ranks without ssh */
    char *argv[16];
    int n = 0;
    char agent[1024];
    snprintf(agent, sizeof agent, "%s", s->agent ? s->agent : "ssh");
    for (char *save = NULL, *tok = strtok_r(agent, " ", &save); tok && n < 8; tok = strtok_r(NULL, " ", &save)) argv[n++] = tok;
    if (!s->agent) argv[n++] = "-oBatchMode=yes", argv[n++] = "-oConnectTimeout=5";
    argv[n++] = s->hosts[h].name;
    argv[n++] = "true";
    argv[n] = NULL;
    const double t = mono();
    const int rc = run_bounded(argv, s->probe_timeout);
    event(s, "probe", ", \"host\": \"%s\", \"reachable\": %s, \"rc\": %d, \"probe_s\": %.3f", s->hosts[h].name,
          rc == 0 ? "true" : "false", rc, mono() - t);
    return rc == 0;
}

/* ------------------------------------------------------------------ layouts */

static int layout_ok(const layout_t *l, int64_t gm, int ranks) {
    return l->dp >= 1 && l->tp >= 1 && l->pp >= 1 && l->ep >= 1 && l->dp % l->ep == 0 &&
           (int64_t)l->dp * l->tp * l->pp <= ranks && l->accum >= 1 && (int64_t)l->dp * l->accum == gm;
}

/* The layout for `ranks` ranks: the configured one when it fits, else the first fitting entry of
 * --layouts ("dp=4,tp=1;dp=2": unnamed degrees as configured, accum derived from the global batch
 * unless given), else the largest dp (a divisor of the global batch in micro-batches that ep divides)
 * with tp, pp, ep as configured. The global batch (micro_batch x accum x dp) never changes. */
static int plan(const sup_t *s, int ranks, layout_t *out, char *why, size_t nwhy) {
    const layout_t *b = &s->base;
    const int64_t gm = (int64_t)b->dp * b->accum; /* the global batch in micro-batches */
    if (layout_ok(b, gm, ranks)) {
        *out = *b;
        snprintf(why, nwhy, "configured");
        return 1;
    }
    if (s->layouts) {
        char buf[2048];
        snprintf(buf, sizeof buf, "%s", s->layouts);
        for (char *s1 = NULL, *ent = strtok_r(buf, ";", &s1); ent; ent = strtok_r(NULL, ";", &s1)) {
            layout_t l = *b;
            l.accum = 0;
            for (char *s2 = NULL, *kv = strtok_r(ent, ", ", &s2); kv; kv = strtok_r(NULL, ", ", &s2)) {
                int v = 0;
                if (sscanf(kv, "dp=%d", &v) == 1) l.dp = v;
                else if (sscanf(kv, "tp=%d", &v) == 1) l.tp = v;
                else if (sscanf(kv, "pp=%d", &v) == 1) l.pp = v;
                else if (sscanf(kv, "ep=%d", &v) == 1) l.ep = v;
                else if (sscanf(kv, "accum=%d", &v) == 1 || sscanf(kv, "grad_accum=%d", &v) == 1) l.accum = v;
            }
            if (!l.accum && l.dp > 0 && gm % l.dp == 0) l.accum = (int)(gm / l.dp);
            if (layout_ok(&l, gm, ranks)) {
                *out = l;
                snprintf(why, nwhy, "--layouts entry");
                return 1;
            }
        }
    }
    for (int d = b->dp; d >= 1; d--) {
        layout_t l = *b;
        l.dp = d;
        l.accum = gm % d == 0 ? (int)(gm / d) : 0;
        if (layout_ok(&l, gm, ranks)) {
            *out = l;
            snprintf(why, nwhy, "dp reduced, accumulation raised (same global batch)");
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ one attempt */

typedef struct {
    int64_t step;              /* last step seen (-1: no record yet) */
    char state[16];
    double changed;            /* supervisor time of the last change */
    double alive;              /* the liveness record's wall time */
    char host[64];
} rank_seen;

typedef enum { END_OK, END_EXIT, END_HANG, END_STOP } end_kind;

typedef struct {
    int k;                     /* attempt number */
    int np;
    layout_t lay;
    char hb[TERA_PATH_MAX + 64], log[TERA_PATH_MAX + 64];
    pid_t pid;
    double t_launch, t_ready, t_first, t_detect;
    double t_fail;             /* detection time of the failure this attempt recovers from (-1: none) */
    int64_t step0, first_step, last_step;
    int status;
    rank_seen *seen;
    int failed_ranks[64], n_failed;
    char failed_hosts[8][128];
    int n_failed_hosts;
    char detail[512];
} attempt_t;

static void add_failed_host(attempt_t *a, const char *name) {
    for (int i = 0; i < a->n_failed_hosts; i++)
        if (!strcmp(a->failed_hosts[i], name)) return;
    if (a->n_failed_hosts < 8) snprintf(a->failed_hosts[a->n_failed_hosts++], sizeof a->failed_hosts[0], "%s", name);
}

static int split_into(char *text, char **argv, int n, int cap) {
    for (char *save = NULL, *tok = strtok_r(text, " \t", &save); tok && n < cap; tok = strtok_r(NULL, " \t", &save))
        argv[n++] = tok;
    return n;
}

/* Whether a training argument is one the supervisor sets itself. */
static int ours(const char *a) {
    static const char *const keys[] = {"--parallel.dp=", "--parallel.tp=", "--parallel.pp=", "--parallel.ep=",
                                       "--training.grad_accum=", NULL};
    if (!strcmp(a, "--force") || !strcmp(a, "--resume")) return 1;
    for (int i = 0; keys[i]; i++)
        if (!strncmp(a, keys[i], strlen(keys[i]))) return 1;
    return 0;
}

static tera_status launch(sup_t *s, attempt_t *a, int resume) {
    char hostfile[TERA_PATH_MAX + 64];
    snprintf(hostfile, sizeof hostfile, "%s/hostfile-%d", s->edir, a->k);
    snprintf(a->hb, sizeof a->hb, "%s/heartbeat-%d", s->edir, a->k);
    snprintf(a->log, sizeof a->log, "%s/attempt-%d.log", s->edir, a->k);
    TERA_TRY(tera_mkdirs(a->hb));
    FILE *f = fopen(hostfile, "w");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot write %s: %s", hostfile, strerror(errno));
    int left = a->np;
    for (int i = 0; i < s->n_hosts && left > 0; i++) {
        if (s->hosts[i].out) continue;
        const int n = s->hosts[i].slots < left ? s->hosts[i].slots : left;
        fprintf(f, "%s slots=%d\n", s->hosts[i].name, n);
        left -= n;
    }
    if (fclose(f) != 0) return tera_fail(TERA_ERR_IO, "cannot write %s", hostfile);
    static char mp[4096], ma[4096], np[16], hbenv[TERA_PATH_MAX + 96], agent[1100];
    static char lay[5][48];
    char *argv[MAX_ARGS];
    int n = 0;
    snprintf(mp, sizeof mp, "%s", s->mpirun ? s->mpirun : "mpirun");
    n = split_into(mp, argv, n, 64);
    snprintf(np, sizeof np, "%d", a->np);
    argv[n++] = "-np", argv[n++] = np, argv[n++] = "--hostfile", argv[n++] = hostfile;
    if (s->agent) {
        snprintf(agent, sizeof agent, "%s", s->agent);
        argv[n++] = "--mca", argv[n++] = "plm_rsh_agent", argv[n++] = agent;
    }
    snprintf(hbenv, sizeof hbenv, "TERA_HEARTBEAT_DIR=%s", a->hb);
    argv[n++] = "-x", argv[n++] = hbenv;
    if (s->mpi_args) {
        snprintf(ma, sizeof ma, "%s", s->mpi_args);
        n = split_into(ma, argv, n, 200);
    }
    argv[n++] = s->train[0];
    for (int i = 1; i < s->n_train && n < MAX_ARGS - 16; i++)
        if (a->k == 0 || !ours(s->train[i])) argv[n++] = s->train[i];
    if (a->k > 0) {
        snprintf(lay[0], sizeof lay[0], "--parallel.dp=%d", a->lay.dp);
        snprintf(lay[1], sizeof lay[1], "--parallel.tp=%d", a->lay.tp);
        snprintf(lay[2], sizeof lay[2], "--parallel.pp=%d", a->lay.pp);
        snprintf(lay[3], sizeof lay[3], "--parallel.ep=%d", a->lay.ep);
        snprintf(lay[4], sizeof lay[4], "--training.grad_accum=%d", a->lay.accum);
        for (int i = 0; i < 5; i++) argv[n++] = lay[i];
        argv[n++] = resume ? "--resume" : "--force";
    }
    argv[n] = NULL;
    char cmd[8192] = "";
    for (int i = 0; i < n; i++) {
        size_t len = strlen(cmd);
        snprintf(cmd + len, sizeof cmd - len, "%s%s", i ? " " : "", argv[i]);
    }
    a->pid = fork();
    if (a->pid < 0) return tera_fail(TERA_ERR_IO, "fork: %s", strerror(errno));
    if (a->pid == 0) {
        setpgid(0, 0);
        int fd = open(a->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) dup2(fd, 1), dup2(fd, 2);
        setenv("TERA_HEARTBEAT_DIR", a->hb, 1);
        if (s->mpi_sess[0]) setenv("OMPI_MCA_orte_tmpdir_base", s->mpi_sess, 1);
        execvp(argv[0], argv);
        fprintf(stderr, "tera launch: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    setpgid(a->pid, a->pid);
    a->t_launch = mono();
    static char e1[2 * TERA_PATH_MAX + 200], e2[16384];
    char hosts[2048] = "";
    for (int i = 0, left2 = a->np; i < s->n_hosts && left2 > 0; i++) {
        if (s->hosts[i].out) continue;
        size_t len = strlen(hosts);
        snprintf(hosts + len, sizeof hosts - len, "%s\"%s\"", len ? ", " : "", s->hosts[i].name);
        left2 -= s->hosts[i].slots;
    }
    event(s, "launch", ", \"attempt\": %d, \"np\": %d, \"hosts\": [%s], \"dp\": %d, \"tp\": %d, \"pp\": %d, \"ep\": %d, "
          "\"grad_accum\": %d, \"resume\": %s, \"from_step\": %ld, \"log\": \"%s\", \"command\": \"%s\"",
          a->k, a->np, hosts, a->lay.dp, a->lay.tp, a->lay.pp, a->lay.ep, a->lay.accum, resume ? "true" : "false",
          (long)a->step0, esc(a->log, e1, sizeof e1), esc(cmd, e2, sizeof e2));
    return TERA_OK;
}

/* Copies what the job printed since last time to stderr. */
static void forward_log(const attempt_t *a, off_t *at) {
    int fd = open(a->log, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char buf[16384];
    ssize_t n;
    while ((n = pread(fd, buf, sizeof buf, *at)) > 0) {
        if (fwrite(buf, 1, (size_t)n, stderr) != (size_t)n) break;
        *at += n;
    }
    close(fd);
}

/* mpirun's account of a failure: the ranks and nodes it names. */
static void read_mpirun_verdict(sup_t *s, attempt_t *a) {
    FILE *f = fopen(a->log, "r");
    if (!f) return;
    char line[2048];
    int want_exit_rank = 0;
    while (fgets(line, sizeof line, f)) {
        const char *p;
        int r;
        char node[128];
        /* "mpirun noticed that process rank 2 with PID 123 on node h2 exited on signal 9 (Killed)." */
        if ((p = strstr(line, "process rank ")) && sscanf(p, "process rank %d with PID %*d on node %127s", &r, node) == 2) {
            if (a->n_failed < 64) a->failed_ranks[a->n_failed++] = r;
            add_failed_host(a, node);
            snprintf(a->detail, sizeof a->detail, "%.*s", (int)strcspn(line, "\n"), line);
        }
        /* a rank that exited non-zero: "Process name: [[J,1],R]" after "returned a non-zero exit code" */
        if (strstr(line, "non-zero exit") || strstr(line, "non-zero status")) want_exit_rank = 1;
        if (want_exit_rank && (p = strstr(line, "Process name:")) && sscanf(p, "Process name: [[%*d,%*d],%d]", &r) == 1) {
            if (a->n_failed < 64) a->failed_ranks[a->n_failed++] = r; /* its host is not blamed: software */
            snprintf(a->detail, sizeof a->detail, "rank %d exited with a non-zero status", r);
            want_exit_rank = 0;
        }
        /* a daemon lost: "Remote daemon: [[J,0],D] on node h3" */
        if ((p = strstr(line, "Remote daemon:")) && (p = strstr(p, " on node ")) && sscanf(p, " on node %127s", node) == 1)
            add_failed_host(a, node);
    }
    fclose(f);
}

static void teardown(sup_t *s, attempt_t *a) {
    const double t = mono();
    int forced = 0, st = 0;
    if (a->pid > 0) {
        if (waitpid(a->pid, &st, WNOHANG) == 0) {
            kill(-a->pid, SIGTERM); /* mpirun stops every rank it still reaches */
            while (waitpid(a->pid, &st, WNOHANG) == 0) {
                if (mono() - t > s->teardown_timeout) {
                    kill(-a->pid, SIGKILL);
                    waitpid(a->pid, &st, 0);
                    forced = 1;
                    break;
                }
                usleep(50000);
            }
        }
        a->pid = -1;
    }
    event(s, "teardown", ", \"attempt\": %d, \"teardown_s\": %.3f, \"forced\": %s", a->k, mono() - t,
          forced ? "true" : "false");
}

/* Watches one attempt until it ends: END_OK (mpirun exited 0), END_EXIT (non-zero), END_HANG. */
static end_kind watch(sup_t *s, attempt_t *a) {
    off_t fwd = 0;
    double last_progress = mono(), max_gap = 0.0, prev_change = 0.0;
    int all_ready = 0, first_seen = 0;
    for (int r = 0; r < a->np; r++) a->seen[r] = (rank_seen){.step = -1, .changed = mono()};
    for (;;) {
        usleep(100000);
        forward_log(a, &fwd);
        if (g_stop) return END_STOP;
        const double now = mono();
        int st;
        if (waitpid(a->pid, &st, WNOHANG) == a->pid) {
            forward_log(a, &fwd);
            a->pid = -1;
            a->status = st;
            a->t_detect = now;
            return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? END_OK : END_EXIT;
        }
        int ready = 0, changed = 0;
        int64_t lo = INT64_MAX, hi = -1;
        for (int r = 0; r < a->np; r++) {
            tera_heartbeat_rec h;
            if (tera_heartbeat_read(a->hb, r, &h) != 0) {
                lo = -1;
                continue;
            }
            rank_seen *e = &a->seen[r];
            e->alive = h.alive;
            snprintf(e->host, sizeof e->host, "%s", h.host);
            if (h.step != e->step || strcmp(h.state, e->state) != 0) {
                e->step = h.step, e->changed = now, changed = 1;
                snprintf(e->state, sizeof e->state, "%s", h.state);
            }
            ready++;
            if (h.step < lo) lo = h.step;
            if (h.step > hi) hi = h.step;
        }
        if (changed) {
            if (first_seen && prev_change > 0 && now - prev_change > max_gap) max_gap = now - prev_change;
            prev_change = now;
            last_progress = now;
        }
        if (!all_ready && ready == a->np && lo >= 0) {
            all_ready = 1;
            a->t_ready = now;
            a->step0 = lo;
            event(s, "ready", ", \"attempt\": %d, \"step\": %ld, \"restore_s\": %.3f", a->k, (long)lo, now - a->t_launch);
        }
        if (all_ready && !first_seen && lo > a->step0) {
            first_seen = 1;
            a->t_first = now;
            a->first_step = lo;
            event(s, "first_step", ", \"attempt\": %d, \"step\": %ld, \"since_launch_s\": %.3f", a->k, (long)lo,
                  now - a->t_launch);
            if (a->t_fail >= 0) /* recovery: from the failure's detection to this first resumed step */
                event(s, "recovered", ", \"attempt\": %d, \"recovery_s\": %.3f, \"restore_s\": %.3f, "
                      "\"resumed_from_step\": %ld, \"first_step\": %ld", a->k, now - a->t_fail, a->t_ready - a->t_launch,
                      (long)a->step0, (long)lo);
        }
        if (hi >= 0) a->last_step = hi;
        /* the hang timeout: before the first step the start-up allowance, then max(floor, factor x
         * the longest gap between progress seen so far) */
        const double limit = first_seen ? fmax(s->hang_floor, s->hang_factor * max_gap) : s->start_timeout;
        if (now - last_progress > limit) {
            a->t_detect = now;
            /* the rank at fault: one whose liveness record went stale (a stopped process). A hang limit
             * near the staleness threshold would leave a rank stopped just after the last progress short
             * of it at detection (its last record up to TERA_HB_ALIVE_S before the stop): the threshold is
             * at most half the limit, and at least four records' period */
            const double w = wall(), stale = fmin(s->alive_stale, fmax(4.0 * TERA_HB_ALIVE_S, 0.5 * limit));
            for (int r = 0; r < a->np; r++)
                if (a->seen[r].alive > 0 && w - a->seen[r].alive > stale && a->n_failed < 64) {
                    a->failed_ranks[a->n_failed++] = r;
                    const int hh = host_of_rank(s, r);
                    add_failed_host(a, hh >= 0 ? s->hosts[hh].name : a->seen[r].host);
                }
            snprintf(a->detail, sizeof a->detail, "no progress for %.1f s (limit %.1f s: %s)", now - last_progress, limit,
                     first_seen ? "max(--hang-timeout, --hang-factor x the longest step gap)" : "--start-timeout");
            return END_HANG;
        }
    }
}

/* mpirun named no node (a whole host gone, its daemon with it: "ORTE was unable to reliably start one
 * or more daemons"): a host all of whose ranks stopped beating clearly before the others (whose
 * liveness went on until mpirun tore them down) is the one lost. */
static void blame_silent_hosts(sup_t *s, attempt_t *a) {
    double newest = 0.0;
    for (int r = 0; r < a->np; r++) {
        tera_heartbeat_rec h;
        if (tera_heartbeat_read(a->hb, r, &h) == 0) a->seen[r].alive = h.alive;
        if (a->seen[r].alive > newest) newest = a->seen[r].alive;
    }
    if (newest <= 0.0) return;
    for (int i = 0; i < s->n_hosts; i++) {
        if (s->hosts[i].out) continue;
        int n = 0, silent = 0;
        for (int r = 0; r < a->np; r++)
            if (host_of_rank(s, r) == i) n++, silent += a->seen[r].alive > 0 && a->seen[r].alive < newest - 1.5 * TERA_HB_ALIVE_S;
        if (n > 0 && silent == n) {
            add_failed_host(a, s->hosts[i].name);
            for (int r = 0; r < a->np && a->n_failed < 64; r++)
                if (host_of_rank(s, r) == i) a->failed_ranks[a->n_failed++] = r;
            snprintf(a->detail, sizeof a->detail, "every rank of %s stopped beating first (host lost)", s->hosts[i].name);
        }
    }
}

static void fmt_ranks(const attempt_t *a, char *buf, size_t n) {
    buf[0] = 0;
    for (int i = 0; i < a->n_failed; i++) {
        size_t len = strlen(buf);
        snprintf(buf + len, n - len, "%s%d", i ? ", " : "", a->failed_ranks[i]);
    }
}

static void fmt_hosts_json(char names[][128], int n, char *buf, size_t cap) {
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        size_t len = strlen(buf);
        snprintf(buf + len, cap - len, "%s\"%s\"", i ? ", " : "", names[i]);
    }
}

static int64_t newest_checkpoint(const sup_t *s) {
    char dir[TERA_PATH_MAX + 64];
    if (tera_ckpt_find_latest(s->run_dir, dir, sizeof dir) != TERA_OK) return -1;
    const char *b = strrchr(dir, '_');
    return b ? atoll(b + 1) : -1;
}

static int supervise(sup_t *s) {
    attempt_t a;
    memset(&a, 0, sizeof a);
    a.seen = tera_calloc(MAX_RANKS, sizeof(rank_seen));
    a.lay = s->base;
    a.np = s->np;
    a.step0 = -1;
    double t_fail_detect = -1; /* detection time of the failure being recovered from */
    int rc = 1;
    for (int restarts = 0;; restarts++) {
        a.n_failed = a.n_failed_hosts = 0;
        a.detail[0] = 0;
        a.t_ready = a.t_first = 0;
        a.first_step = a.last_step = -1;
        int64_t ck = a.k > 0 ? newest_checkpoint(s) : -1;
        a.step0 = ck;
        if (launch(s, &a, ck >= 0) != TERA_OK) {
            rc = tera_cli_error();
            break;
        }
        a.t_fail = t_fail_detect;
        const end_kind end = watch(s, &a);
        if (a.t_first > 0) t_fail_detect = -1; /* recovered (else the next attempt still recovers from it) */
        if (end == END_OK) {
            event(s, "finished", ", \"attempt\": %d, \"restarts\": %d, \"last_step\": %ld", a.k, restarts, (long)a.last_step);
            rc = 0;
            break;
        }
        if (end == END_STOP) {
            event(s, "stopped", ", \"attempt\": %d, \"signal\": %d, \"last_step\": %ld", a.k, (int)g_stop, (long)a.last_step);
            teardown(s, &a);
            rc = 128 + (int)g_stop;
            break;
        }
        const int sig = end == END_EXIT && WIFSIGNALED(a.status) ? WTERMSIG(a.status) : 0;
        const int code = end == END_EXIT && WIFEXITED(a.status) ? WEXITSTATUS(a.status) : -1;
        if (end == END_EXIT) read_mpirun_verdict(s, &a);
        if (end == END_EXIT && a.n_failed_hosts == 0) blame_silent_hosts(s, &a);
        char rk[512], hj[1200], ed[1100];
        fmt_ranks(&a, rk, sizeof rk);
        fmt_hosts_json(a.failed_hosts, a.n_failed_hosts, hj, sizeof hj);
        event(s, "failure", ", \"attempt\": %d, \"kind\": \"%s\", \"exit_code\": %d, \"signal\": %d, \"ranks\": [%s], "
              "\"hosts\": [%s], \"last_step\": %ld, \"detail\": \"%s\"", a.k, end == END_HANG ? "hang" : "exit", code, sig,
              rk, hj, (long)a.last_step, esc(a.detail, ed, sizeof ed));
        t_fail_detect = a.t_detect;
        teardown(s, &a);
        if (restarts >= s->max_restarts) {
            event(s, "gave_up", ", \"reason\": \"--max-restarts %d reached\"", s->max_restarts);
            break;
        }
        const double t_replan = mono();
        /* which hosts are at fault: those named above, and every host of the job that does not answer */
        for (int i = 0; i < s->n_hosts; i++) s->hosts[i].fault_now = 0;
        for (int i = 0; i < a.n_failed_hosts; i++) {
            const int h = find_host(s, a.failed_hosts[i]);
            if (h >= 0) s->hosts[h].fault_now = 1;
        }
        char readmit[MAX_HOSTS][128], excl[MAX_HOSTS][128];
        int n_re = 0, n_ex = 0;
        for (int i = 0; i < s->n_hosts; i++) {
            host_t *h = &s->hosts[i];
            const int was_out = h->out;
            const int up = probe(s, i);
            if (!up) h->fault_now = 1;
            if (h->fault_now) h->failures++;
            h->out = h->fault_now || !up || h->failures > s->host_retries;
            if (h->out) snprintf(excl[n_ex++], sizeof excl[0], "%s", h->name);
            else if (was_out) snprintf(readmit[n_re++], sizeof readmit[0], "%s", h->name);
        }
        /* a job that failed by itself (a non-zero exit before any rank was ready, no host at fault):
         * a restart would fail the same way */
        if (end == END_EXIT && a.t_ready == 0 && sig == 0 && a.n_failed_hosts == 0 && n_ex == 0) {
            event(s, "gave_up", ", \"reason\": \"the job failed before training started, with every host answering: "
                  "see %s\"", esc(a.log, ed, sizeof ed));
            break;
        }
        int slots = 0;
        for (int i = 0; i < s->n_hosts; i++)
            if (!s->hosts[i].out) slots += s->hosts[i].slots;
        layout_t l;
        char why[128];
        if (!plan(s, slots, &l, why, sizeof why)) {
            event(s, "gave_up", ", \"reason\": \"no layout fits %d ranks (tp %d x pp %d, ep %d dividing dp, global batch %d "
                  "micro-batches)\"", slots, s->base.tp, s->base.pp, s->base.ep, s->base.dp * s->base.accum);
            break;
        }
        char ej[4096], rj[4096];
        fmt_hosts_json(excl, n_ex, ej, sizeof ej);
        fmt_hosts_json(readmit, n_re, rj, sizeof rj);
        a.k++;
        a.lay = l;
        a.np = l.dp * l.tp * l.pp;
        event(s, "replan", ", \"attempt\": %d, \"replan_s\": %.3f, \"slots\": %d, \"np\": %d, \"dp\": %d, \"tp\": %d, "
              "\"pp\": %d, \"ep\": %d, \"grad_accum\": %d, \"why\": \"%s\", \"excluded\": [%s], \"readmitted\": [%s]",
              a.k, mono() - t_replan, slots, a.np, l.dp, l.tp, l.pp, l.ep, l.accum, why, ej, rj);
    }
    if (a.pid > 0) teardown(s, &a);
    free(a.seen);
    return rc;
}

/* ------------------------------------------------------------------ the command */

static double num_arg(const char *name, const char *v, double lo, int *bad) {
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !(x >= lo)) {
        tera_fail(TERA_ERR_ARG, "--%s '%s': expected a number >= %g", name, v, lo);
        *bad = 1;
    }
    return x;
}

int tera_cmd_launch(int argc, char **argv) {
    static sup_t s; /* large (hosts): not on the stack */
    memset(&s, 0, sizeof s);
    s.max_restarts = 3, s.host_retries = 2;
    s.hang_floor = 30, s.hang_factor = 10, s.start_timeout = 300, s.teardown_timeout = 10, s.probe_timeout = 10;
    s.alive_stale = 3;
    const char *hosts = NULL, *hostfile = NULL;
    int dd = -1, bad = 0;
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--")) {
            dd = i;
            break;
        }
    if (dd < 0 || dd + 2 >= argc || strcmp(argv[dd + 2], "train") != 0) {
        tera_fail(TERA_ERR_ARG, "tera launch needs the training command after --: tera launch [options] -- TERA train "
                                "[-c FILE] [--section.key=value ...]");
        return tera_cli_error();
    }
    for (int i = 0; i < dd && !bad; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < dd ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, "--" name) && v && (i++, 1))
        if (OPT("hosts")) hosts = v;
        else if (OPT("hostfile")) hostfile = v;
        else if (OPT("np")) s.np = (int)num_arg("np", v, 1, &bad);
        else if (OPT("max-restarts")) s.max_restarts = (int)num_arg("max-restarts", v, 0, &bad);
        else if (OPT("host-retries")) s.host_retries = (int)num_arg("host-retries", v, 0, &bad);
        else if (OPT("hang-timeout")) s.hang_floor = num_arg("hang-timeout", v, 0.1, &bad);
        else if (OPT("hang-factor")) s.hang_factor = num_arg("hang-factor", v, 1, &bad);
        else if (OPT("start-timeout")) s.start_timeout = num_arg("start-timeout", v, 1, &bad);
        else if (OPT("teardown-timeout")) s.teardown_timeout = num_arg("teardown-timeout", v, 0.1, &bad);
        else if (OPT("probe-timeout")) s.probe_timeout = num_arg("probe-timeout", v, 0.1, &bad);
        else if (OPT("layouts")) s.layouts = v;
        else if (OPT("rsh-agent")) s.agent = v;
        else if (OPT("mpirun")) s.mpirun = v;
        else if (OPT("mpi-args")) s.mpi_args = v;
        else {
            tera_fail(TERA_ERR_ARG, "tera launch: unknown option or missing value: '%s' (tera launch --help)", a);
            bad = 1;
        }
#undef OPT
    }
    if (bad) return tera_cli_error();
    s.train = argv + dd + 1;
    s.n_train = argc - dd - 1;
    static const char *const flags[] = {"force", "resume", NULL};
    int set[2] = {0, 0};
    if (tera_cli_parse(s.n_train - 2, s.train + 2, &s.cfg, flags, set, NULL, NULL)) return 1;
    snprintf(s.run_dir, sizeof s.run_dir, "%s", s.cfg.logging.run_dir);
    if (!s.run_dir[0]) {
        tera_fail(TERA_ERR_ARG, "tera launch: the training command needs a run directory (logging.run_dir): restarts "
                                "resume from its checkpoints");
        return tera_cli_error();
    }
    const tera_parallel_config *p = &s.cfg.parallel;
    s.base = (layout_t){p->dp, p->tp, p->pp, p->ep, s.cfg.training.grad_accum};
    const int np0 = p->dp * p->tp * p->pp;
    if (s.np == 0) s.np = np0;
    if (s.np != np0) {
        tera_fail(TERA_ERR_ARG, "tera launch: --np %d, but the training command's layout needs pp %d x dp %d x tp %d = %d "
                                "ranks (set --parallel.dp)", s.np, p->pp, p->dp, p->tp, np0);
        return tera_cli_error();
    }
    tera_status st = TERA_OK;
    const char *slurm = getenv("SLURM_JOB_NODELIST");
    if (hosts) st = parse_hosts(&s, hosts);
    else if (hostfile) st = parse_hostfile(&s, hostfile);
    else if (slurm) st = parse_slurm(&s, slurm);
    else st = tera_fail(TERA_ERR_ARG, "tera launch needs hosts: --hosts h1:2,h2:2, --hostfile FILE, or a Slurm allocation "
                                      "(SLURM_JOB_NODELIST)");
    if (st != TERA_OK) return tera_cli_error();
    int slots = 0;
    for (int i = 0; i < s.n_hosts; i++) slots += s.hosts[i].slots;
    if (slots < s.np) {
        tera_fail(TERA_ERR_ARG, "tera launch: %d ranks, but the hosts have %d slots", s.np, slots);
        return tera_cli_error();
    }
    snprintf(s.edir, sizeof s.edir, "%s/elastic", s.run_dir);
    if (tera_mkdirs(s.edir) != TERA_OK) return tera_cli_error();
    { /* absolute: the ranks of other hosts may start elsewhere */
        char abs[TERA_PATH_MAX];
        if (realpath(s.edir, abs)) snprintf(s.edir, sizeof s.edir, "%s", abs);
    }
    char path[TERA_PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/events.jsonl", s.edir);
    s.events = fopen(path, "a");
    if (!s.events) {
        tera_fail(TERA_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        return tera_cli_error();
    }
    /* A session directory of the job's own on this host: under the shared /tmp/ompi.HOST.UID one job's
     * clean-up removes the emptied top directory while another job started beside it is creating its
     * own inside, which fails that job at start ('orte_session_dir failed'; docs/PARALLELISM.md,
     * Launch). Kept when the caller chose one. */
    const char *base = getenv("OMPI_MCA_orte_tmpdir_base");
    if (!base || !base[0]) {
        const char *tmp = getenv("TMPDIR");
        const int len = snprintf(s.mpi_sess, sizeof s.mpi_sess, "%s/tera-launch.%u.%ld", tmp && tmp[0] ? tmp : "/tmp",
                                 (unsigned)getuid(), (long)getpid());
        if (len < 0 || len >= (int)sizeof s.mpi_sess) s.mpi_sess[0] = '\0'; /* too long: Open MPI's default */
    }
    s.t0 = mono();
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    static char ebuf[2 * TERA_PATH_MAX + 16], sbuf[2 * TERA_PATH_MAX + 160];
    event(&s, "start", ", \"hosts\": %d, \"slots\": %d, \"np\": %d, \"max_restarts\": %d, \"hang_timeout_s\": %.1f, "
          "\"hang_factor\": %.1f, \"run_dir\": \"%s\", \"mpi_session_base\": \"%s\"", s.n_hosts, slots, s.np,
          s.max_restarts, s.hang_floor, s.hang_factor, esc(s.run_dir, ebuf, sizeof ebuf),
          esc(s.mpi_sess[0] ? s.mpi_sess : base ? base : "", sbuf, sizeof sbuf));
    const int rc = supervise(&s);
    /* mpirun removes its own directories inside; what a killed job left goes with the base */
    if (s.mpi_sess[0] && access(s.mpi_sess, F_OK) == 0 && tera_ckpt_rmtree(s.mpi_sess) != TERA_OK)
        fprintf(stderr, "tera launch: note: Open MPI's session directory is left behind: %s\n", tera_last_error());
    fclose(s.events);
    return rc;
}
