#include "tera/io.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "tera/config.h"

tera_status tera_mkdirs(const char *dir) {
    char p[TERA_PATH_MAX];
    if ((size_t)snprintf(p, sizeof p, "%s", dir) >= sizeof p) return tera_fail(TERA_ERR_IO, "%s: path too long", dir);
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s != '\0') continue;
        char c = *s;
        *s = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST)
            return tera_fail(TERA_ERR_IO, "%s: cannot create directory: %s", p, strerror(errno));
        *s = c;
        if (c == '\0') break;
    }
    struct stat sb; /* EEXIST: a file of that name is no directory */
    if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return tera_fail(TERA_ERR_IO, "%s: exists and is not a directory", p);
    return TERA_OK;
}

tera_status tera_read_text_file(const char *path, char **out) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return tera_fail(TERA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = tera_malloc(cap);
    for (;;) {
        n += fread(buf + n, 1, cap - 1 - n, fp);
        if (n < cap - 1) break;
        char *nb = tera_malloc(cap * 2);
        memcpy(nb, buf, n);
        free(buf);
        buf = nb;
        cap *= 2;
    }
    int bad = ferror(fp);
    fclose(fp);
    if (bad) {
        free(buf);
        return tera_fail(TERA_ERR_IO, "%s: read error", path);
    }
    buf[n] = '\0';
    *out = buf;
    return TERA_OK;
}

/* ------------------------------------------------------------------ JSON numbers */

const char *tera_json_num(char *buf, size_t cap, const char *fmt, double v) {
    if (!isfinite(v)) snprintf(buf, cap, "null");
    else snprintf(buf, cap, fmt, v);
    return buf;
}

tera_status tera_json_whole(const cJSON *obj, const char *key, const char *path, const char *where, int64_t lo,
                            int64_t hi, int64_t *out) {
    const cJSON *it = cJSON_IsObject(obj) ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    if (!cJSON_IsNumber(it)) return tera_fail(TERA_ERR_FORMAT, "%s: \"%s%s\" is missing or not a number", path, where, key);
    const double v = it->valuedouble;
    /* lo and hi within +-2^53, so that the doubles compare exactly */
    if (!(v >= (double)lo && v <= (double)hi) || v != floor(v))
        return tera_fail(TERA_ERR_FORMAT, "%s: \"%s%s\" = %.17g is not a whole number in [%lld, %lld]", path, where, key,
                         v, (long long)lo, (long long)hi);
    *out = (int64_t)v;
    return TERA_OK;
}

/* ------------------------------------------------------------------ JSON lines */

cJSON *tera_jsonl_parse(const char *p, size_t n, const char **why) {
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(p, n, &end, 0);
    if (!j) {
        *why = "invalid JSON";
        return NULL;
    }
    for (const char *e = p + n; end && end < e; end++) {
        if (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\f' || *end == '\v' || *end == 0) continue;
        cJSON_Delete(j);
        *why = "more than one JSON value on the line (one object a line)";
        return NULL;
    }
    return j;
}

/* 1 when text[0, n) (no newline inside) parses as JSON. */
static int json_line_ok(const char *text, size_t n) {
    char *line = tera_malloc(n + 1);
    memcpy(line, text, n);
    line[n] = 0;
    cJSON *j = cJSON_Parse(line);
    free(line);
    const int ok = j != NULL;
    cJSON_Delete(j);
    return ok;
}

tera_status tera_jsonl_repair(const char *path, long *dropped) {
    *dropped = 0;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT ? TERA_OK : tera_fail(TERA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        const int e = errno;
        close(fd);
        return tera_fail(TERA_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode) || sb.st_size == 0) { /* a device or a pipe is written, never cut */
        close(fd);
        return TERA_OK;
    }
    /* the end of the last complete line that parses: searched from the end, in a window of the file's
     * tail that doubles until it holds such a line (or the whole file) */
    const off_t size = sb.st_size;
    off_t good = -1;
    tera_status st = TERA_OK;
    for (off_t win = 65536; good < 0 && st == TERA_OK; win *= 2) {
        const off_t from = size > win ? size - win : 0;
        const size_t n = (size_t)(size - from);
        char *buf = tera_malloc(n + 1);
        size_t got = 0;
        while (got < n) {
            const ssize_t k = pread(fd, buf + got, n - got, from + (off_t)got);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) break;
            got += (size_t)k;
        }
        if (got != n) {
            st = tera_fail(TERA_ERR_IO, "%s: read error: %s", path, errno ? strerror(errno) : "short read");
            free(buf);
            break;
        }
        /* lines ending in '\n', last first; the first one of a partial window may be cut: skip it */
        size_t end = n;
        while (end > 0 && buf[end - 1] != '\n') end--; /* [end, n): the unterminated tail */
        while (end > 0) {
            size_t start = end - 1;
            while (start > 0 && buf[start - 1] != '\n') start--;
            if (start == 0 && from > 0) break; /* may begin before the window */
            if (json_line_ok(buf + start, end - 1 - start)) {
                good = from + (off_t)end;
                break;
            }
            end = start;
        }
        free(buf);
        if (good < 0 && from == 0) good = 0; /* no complete JSON line at all */
    }
    if (st == TERA_OK && good < size) {
        if (ftruncate(fd, good) != 0 || fsync(fd) != 0)
            st = tera_fail(TERA_ERR_IO, "%s: cannot cut the incomplete last line: %s", path, strerror(errno));
        else
            *dropped = (long)(size - good);
    }
    close(fd);
    return st;
}

/* ------------------------------------------------------------------ run-directory lock */

/* The pid recorded in an open lock file (0 when unreadable). */
static long lock_holder(int fd) {
    char buf[32] = "";
    const ssize_t k = pread(fd, buf, sizeof buf - 1, 0);
    if (k <= 0) return 0;
    buf[k] = 0;
    return strtol(buf, NULL, 10);
}

tera_status tera_run_lock_acquire(tera_run_lock *l, const char *dir) {
    memset(l, 0, sizeof *l);
    l->fd = -1;
    if ((size_t)snprintf(l->dir, sizeof l->dir, "%s", dir) >= sizeof l->dir ||
        (size_t)snprintf(l->path, sizeof l->path, "%s/%s", dir, TERA_RUN_LOCK_NAME) >= sizeof l->path)
        return tera_fail(TERA_ERR_IO, "%s: path too long", dir);
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        TERA_TRY(tera_mkdirs(dir));
        l->created_dir = 1;
    } else if (!S_ISDIR(sb.st_mode)) {
        return tera_fail(TERA_ERR_IO, "run directory '%s' exists and is not a directory", dir);
    }
    for (int attempt = 0; attempt < 100; attempt++) {
        const int fd = open(l->path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) {
            const int e = errno;
            tera_run_lock_release(l);
            return tera_fail(TERA_ERR_IO, "%s: cannot create the run directory's lock file: %s", l->path, strerror(e));
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            const int e = errno;
            const long pid = lock_holder(fd);
            close(fd);
            tera_run_lock_release(l);
            if (e == EWOULDBLOCK) {
                char who[64] = "another process";
                if (pid > 0) snprintf(who, sizeof who, "another tera process (pid %ld)", pid);
                return tera_fail(TERA_ERR_EXISTS, "run directory '%s' is in use by %s, which holds %s; wait for it "
                                 "to end or choose another logging.run_dir", dir, who, l->path);
            }
            return tera_fail(TERA_ERR_IO, "%s: cannot lock: %s", l->path, strerror(e));
        }
        /* the holder removes the file when it ends: a file locked after its removal is not the lock */
        struct stat a, b;
        if (fstat(fd, &a) == 0 && stat(l->path, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) {
            char pid[32];
            const int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
            if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
                const int e = errno;
                close(fd);
                tera_run_lock_release(l);
                return tera_fail(TERA_ERR_IO, "%s: cannot write: %s", l->path, strerror(e));
            }
            l->fd = fd;
            return TERA_OK;
        }
        close(fd);
    }
    tera_run_lock_release(l);
    return tera_fail(TERA_ERR_IO, "%s: cannot take the lock (the file keeps being replaced)", l->path);
}

void tera_run_lock_release(tera_run_lock *l) {
    if (l->fd >= 0) {
        unlink(l->path); /* while still holding it: a waiting opener then sees another inode */
        close(l->fd);
        l->fd = -1;
    }
    if (l->created_dir) rmdir(l->dir); /* only when still empty: a run that never started leaves nothing */
    l->created_dir = 0;
}
