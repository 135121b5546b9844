/* Heartbeats of a rank for the elastic supervisor (include/tera/elastic.h, docs/ELASTIC.md). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tera/elastic.h"

static int g_fd = -1;       /* DIR/rank-N, opened by the first beat */
static int g_tried;         /* the open was attempted (once) */
static char g_host[64] = "?"; /* this host's name, read once */
static pthread_t g_alive;

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Writes one record of TERA_HB_RECORD bytes (text, blank-padded, ending in a newline) at `at`. */
static void put_record(int fd, off_t at, const char *text) {
    char rec[TERA_HB_RECORD];
    memset(rec, ' ', sizeof rec);
    size_t n = strlen(text);
    if (n > sizeof rec - 1) n = sizeof rec - 1;
    memcpy(rec, text, n);
    rec[sizeof rec - 1] = '\n';
    if (pwrite(fd, rec, sizeof rec, at) != (ssize_t)sizeof rec) { /* best effort: the supervisor sees it stale */ }
}

static void *alive_main(void *arg) {
    (void)arg;
    const struct timespec period = {0, (long)(TERA_HB_ALIVE_S * 1e9)};
    for (;;) {
        char text[64];
        snprintf(text, sizeof text, "alive %.3f", wall_now());
        put_record(g_fd, TERA_HB_RECORD, text);
        nanosleep(&period, NULL);
    }
    return NULL;
}

void tera_heartbeat_beat(int world_rank, int64_t step, const char *state) {
    if (!g_tried) {
        g_tried = 1;
        const char *dir = getenv("TERA_HEARTBEAT_DIR");
        if (!dir || !*dir) return;
        char path[4096];
        snprintf(path, sizeof path, "%s/rank-%d", dir, world_rank);
        g_fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (g_fd < 0) {
            fprintf(stderr, "tera: warning: heartbeat file %s: %s (the supervisor will not see this rank)\n", path,
                    strerror(errno));
            return;
        }
        gethostname(g_host, sizeof g_host - 1);
        g_host[sizeof g_host - 1] = 0;
        char text[64];
        snprintf(text, sizeof text, "alive %.3f", wall_now());
        put_record(g_fd, TERA_HB_RECORD, text);
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&g_alive, &at, alive_main, NULL) != 0)
            fprintf(stderr, "tera: warning: heartbeat: no liveness thread (a stopped rank is then told by its step only)\n");
        pthread_attr_destroy(&at);
    }
    if (g_fd < 0) return;
    char text[TERA_HB_RECORD];
    snprintf(text, sizeof text, "tera-hb 1 rank %d step %ld state %s wall %.3f pid %ld host %s", world_rank,
             (long)step, state, wall_now(), (long)getpid(), g_host);
    put_record(g_fd, 0, text);
}

int tera_heartbeat_read(const char *dir, int rank, tera_heartbeat_rec *out) {
    memset(out, 0, sizeof *out);
    char path[4096];
    snprintf(path, sizeof path, "%s/rank-%d", dir, rank);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char buf[2 * TERA_HB_RECORD + 1];
    const ssize_t n = pread(fd, buf, 2 * TERA_HB_RECORD, 0);
    close(fd);
    if (n != 2 * TERA_HB_RECORD) return -1;
    buf[2 * TERA_HB_RECORD] = 0;
    buf[TERA_HB_RECORD - 1] = 0;
    long step;
    int got = sscanf(buf, "tera-hb 1 rank %d step %ld state %15s wall %lf pid %ld host %63s", &out->rank, &step,
                     out->state, &out->wall, &out->pid, out->host);
    if (got != 6 || sscanf(buf + TERA_HB_RECORD, "alive %lf", &out->alive) != 1) return -1;
    out->step = step;
    out->ok = 1;
    return 0;
}
