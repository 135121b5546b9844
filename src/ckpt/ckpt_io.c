/* Checkpoint file helpers: fault-injection points, durable writes, tree removal, file hashes. */
/* paths are bounded by TERA_PATH_MAX; a truncated one fails to open and is reported */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "tera/ckpt.h"

static atomic_llong g_io_calls;

void tera_ckpt_io_point(const char *op, const char *path) {
    const long long n = atomic_fetch_add(&g_io_calls, 1) + 1;
    static long long fault = -2;
    if (fault == -2) {
        const char *e = getenv("TERA_CKPT_FAULT");
        fault = e && *e ? atoll(e) : -1;
    }
    static long delay_ms = -2;
    if (delay_ms == -2) {
        const char *e = getenv("TERA_CKPT_DELAY_MS");
        delay_ms = e && *e ? atol(e) : 0;
        if (delay_ms < 0 || delay_ms > 60000) delay_ms = 0;
    }
    if (delay_ms > 0) { /* a slow disk: a background save still in flight several steps later */
        const struct timespec ts = {delay_ms / 1000, (delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (fault > 0 && n == fault) {
        fprintf(stderr, "tera: TERA_CKPT_FAULT=%lld: aborting at checkpoint I/O #%lld (%s %s)\n", fault, n, op,
                path);
        fflush(stderr);
        abort();
    }
}

int64_t tera_ckpt_io_count(void) { return (int64_t)atomic_load(&g_io_calls); }

tera_status tera_ckpt_write_file(const char *path, const void *buf, size_t n) {
    tera_ckpt_io_point("open", path);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    const char *p = buf;
    size_t done = 0;
    int err = 0;
    /* one I/O point per write call, at most 64 MiB each */
    while (done < n && !err) {
        size_t want = n - done < ((size_t)64 << 20) ? n - done : ((size_t)64 << 20);
        tera_ckpt_io_point("write", path);
        ssize_t k = write(fd, p + done, want);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) err = errno ? errno : EIO;
        else done += (size_t)k;
    }
    if (!err) {
        tera_ckpt_io_point("fsync", path);
        if (fsync(fd) != 0) err = errno;
    }
    if (close(fd) != 0 && !err) err = errno;
    if (err) return tera_fail(TERA_ERR_IO, "%s: write failed: %s", path, strerror(err));
    return TERA_OK;
}

tera_status tera_ckpt_fsync_path(const char *path) {
    tera_ckpt_io_point("fsync", path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot open for fsync: %s", path, strerror(errno));
    int r = fsync(fd), e = errno;
    close(fd);
    if (r != 0) return tera_fail(TERA_ERR_IO, "%s: fsync failed: %s", path, strerror(e));
    return TERA_OK;
}

static int rm_rec(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) return errno == ENOENT ? 0 : -1;
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(path);
        if (!d) return -1;
        struct dirent *e;
        char sub[4096];
        int bad = 0;
        while ((e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            if ((size_t)snprintf(sub, sizeof sub, "%s/%s", path, e->d_name) >= sizeof sub) bad = 1;
            else if (rm_rec(sub) != 0) bad = 1;
        }
        closedir(d);
        if (bad) return -1;
        return rmdir(path);
    }
    return unlink(path);
}

tera_status tera_ckpt_rmtree(const char *path) {
    tera_ckpt_io_point("remove", path);
    if (rm_rec(path) != 0) return tera_fail(TERA_ERR_IO, "cannot remove '%s': %s", path, strerror(errno));
    return TERA_OK;
}

tera_status tera_ckpt_hash_file(const char *path, uint64_t *hash, int64_t *size) {
    /* O_NONBLOCK: a FIFO in a file's place must not block the open until a writer comes */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        close(fd);
        return tera_fail(TERA_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return tera_fail(TERA_ERR_FORMAT, "%s: not a regular file", path);
    }
    *size = (int64_t)sb.st_size;
    if (sb.st_size == 0) {
        close(fd);
        *hash = XXH3_64bits(NULL, 0);
        return TERA_OK;
    }
    /* read(2) through a 1 MiB buffer: a mapping would count the whole file in the process's
     * resident memory (every rank verifies a checkpoint before loading it) */
    enum { BUF = 1 << 20 };
    unsigned char *buf = malloc(BUF);
    XXH3_state_t *st = XXH3_createState();
    if (!buf || !st) {
        free(buf);
        XXH3_freeState(st);
        close(fd);
        return tera_fail(TERA_ERR_NOMEM, "%s: out of memory hashing", path);
    }
    XXH3_64bits_reset(st);
    int err = 0;
    for (;;) {
        const ssize_t k = read(fd, buf, BUF);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) err = errno;
        if (k <= 0) break;
        XXH3_64bits_update(st, buf, (size_t)k);
    }
    close(fd);
    *hash = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    free(buf);
    if (err) return tera_fail(TERA_ERR_IO, "%s: read failed: %s", path, strerror(err));
    return TERA_OK;
}

tera_status tera_ckpt_remove(const char *dir) {
    char gone[4200], parent[4200];
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    if (n + strlen(TERA_CKPT_DELETING_SUFFIX) + 1 > sizeof gone) return tera_fail(TERA_ERR_IO, "%s: path too long", dir);
    snprintf(gone, sizeof gone, "%.*s%s", (int)n, dir, TERA_CKPT_DELETING_SUFFIX);
    struct stat sb;
    if (lstat(gone, &sb) == 0) TERA_TRY(tera_ckpt_rmtree(gone)); /* a removal interrupted before */
    tera_ckpt_io_point("rename", dir);
    if (rename(dir, gone) != 0) {
        if (errno == ENOENT) return TERA_OK;
        return tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", dir, gone, strerror(errno));
    }
    /* the rename is what readers see; make it durable before the files go */
    snprintf(parent, sizeof parent, "%.*s", (int)n, dir);
    char *slash = strrchr(parent, '/');
    if (!slash) snprintf(parent, sizeof parent, ".");
    else if (slash == parent) parent[1] = 0;
    else *slash = 0;
    TERA_TRY(tera_ckpt_fsync_path(parent));
    return tera_ckpt_rmtree(gone);
}

tera_status tera_ckpt_write_run_config(const tera_config *cfg, const char *run_dir) {
    char path[4200], tmp[4300];
    if ((size_t)snprintf(path, sizeof path, "%s/config.ini", run_dir) >= sizeof path)
        return tera_fail(TERA_ERR_IO, "%s: path too long", run_dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    tera_status st = tera_config_write(cfg, tmp);
    if (st == TERA_OK) { /* not a fault-injection point: this is not the checkpoint writer */
        const int fd = open(tmp, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || fsync(fd) != 0) st = tera_fail(TERA_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
        if (fd >= 0) close(fd);
    }
    if (st == TERA_OK && rename(tmp, path) != 0)
        st = tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
    if (st != TERA_OK) unlink(tmp);
    return st;
}
