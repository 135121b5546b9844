#include "data/atomic_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tera/io.h"

int tera_file_finish(FILE *f) {
    int ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    int e = errno;
    if (fclose(f) != 0) return 0;
    errno = e;
    return ok;
}

tera_status tera_file_write(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot create '%s': %s", path, strerror(errno));
    int ok = fwrite(data, 1, n, f) == n;
    int e = errno;
    if (!ok) fclose(f);
    else if (!tera_file_finish(f)) { ok = 0; e = errno; }
    if (ok) return TERA_OK;
    remove(path);
    return tera_fail(TERA_ERR_IO, "cannot write '%s': %s", path, strerror(e));
}

tera_status tera_file_rename(const char *from, const char *to) {
    if (rename(from, to) == 0) return TERA_OK;
    int e = errno;
    remove(from);
    return tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", from, to, strerror(e));
}

/* ---- staged directories ---------------------------------------------------------------------- */

/* Makes the directory entry of `path` durable (best effort: fsync of its parent directory). */
static void sync_parent(const char *path) {
    char p[TERA_PATH_MAX + 128];
    snprintf(p, sizeof p, "%s", path);
    char *slash = strrchr(p, '/');
    if (slash == p) slash[1] = '\0';
    else if (slash) *slash = '\0';
    else snprintf(p, sizeof p, ".");
    int fd = open(p, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
}

tera_status tera_staged_dir_open(tera_staged_dir *s, const char *dir) {
    memset(s, 0, sizeof *s);
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/') n--;
    if (n == 0) return tera_fail(TERA_ERR_ARG, "empty output directory name");
    if (n >= sizeof s->dir - 16) return tera_fail(TERA_ERR_IO, "'%s': path too long", dir);
    memcpy(s->dir, dir, n);
    s->dir[n] = '\0';
    if (!strcmp(s->dir, "/") || !strcmp(s->dir, ".") || !strcmp(s->dir, ".."))
        return tera_fail(TERA_ERR_ARG, "'%s' cannot be an output directory (name a directory for the files)", dir);
    /* the parent: remember the topmost missing ancestor, so that a failure removes what we made */
    char parent[TERA_PATH_MAX];
    snprintf(parent, sizeof parent, "%s", s->dir);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = '\0';
        for (char *q = parent + 1;; q++) {
            if (*q != '/' && *q != '\0') continue;
            char c = *q;
            *q = '\0';
            int missing = access(parent, F_OK) != 0;
            if (missing) snprintf(s->made_top, sizeof s->made_top, "%s", parent);
            *q = c;
            if (missing || c == '\0') break;
        }
        tera_status st = tera_mkdirs(parent);
        if (st != TERA_OK) {
            tera_staged_dir_abort(s, NULL, 0);
            return st;
        }
    }
    /* (not mkdtemp: its 0700 would become DIR's mode; mkdir 0777 follows the umask) */
    int made = 0, e = EEXIST;
    for (unsigned k = 0; k < 100 && !made && e == EEXIST; k++) {
        snprintf(s->tmp, sizeof s->tmp, "%s.tmp.%ld.%u", s->dir, (long)getpid(), k);
        made = mkdir(s->tmp, 0777) == 0;
        e = errno;
    }
    if (!made) {
        s->tmp[0] = '\0';
        tera_staged_dir_abort(s, NULL, 0);
        return tera_fail(TERA_ERR_IO, "cannot create a temporary directory next to '%s': %s", s->dir, strerror(e));
    }
    return TERA_OK;
}

tera_status tera_staged_dir_path(const tera_staged_dir *s, const char *name, char *out, size_t cap) {
    if ((size_t)snprintf(out, cap, "%s/%s", s->tmp, name) >= cap)
        return tera_fail(TERA_ERR_IO, "%s/%s: path too long", s->tmp, name);
    return TERA_OK;
}

/* Removes names[0, n) from directory d, then d itself (if empty). */
static void remove_dir(const char *d, const char *const *names, int n) {
    char p[TERA_PATH_MAX + 128];
    for (int i = 0; i < n; i++) {
        snprintf(p, sizeof p, "%s/%s", d, names[i]);
        unlink(p);
    }
    rmdir(d);
}

void tera_staged_dir_abort(tera_staged_dir *s, const char *const *names, int n) {
    if (s->tmp[0]) remove_dir(s->tmp, names, n);
    s->tmp[0] = '\0';
    if (!s->made_top[0]) return;
    /* the parents open created, deepest first (rmdir leaves any that are no longer empty) */
    char p[TERA_PATH_MAX];
    snprintf(p, sizeof p, "%s", s->dir);
    const size_t top = strlen(s->made_top);
    for (;;) {
        char *slash = strrchr(p, '/');
        if (!slash || slash == p) break;
        *slash = '\0';
        if (strlen(p) < top) break;
        rmdir(p);
    }
    s->made_top[0] = '\0';
}

/* 1 if directory d holds nothing but entries among names[0, n), 0 if it holds others, -1 on error. */
static int holds_only(const char *d, const char *const *names, int n) {
    DIR *dp = opendir(d);
    if (!dp) return -1;
    int only = 1;
    struct dirent *e;
    while (only && (e = readdir(dp)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        int known = 0;
        for (int i = 0; i < n && !known; i++) known = !strcmp(e->d_name, names[i]);
        only = known;
    }
    closedir(dp);
    return only;
}

tera_status tera_staged_dir_commit(tera_staged_dir *s, const char *const *names, int n) {
    struct stat sb;
    tera_status st = TERA_OK;
    if (lstat(s->dir, &sb) != 0) {
        int e = errno;
        if (e != ENOENT) st = tera_fail(TERA_ERR_IO, "cannot inspect '%s': %s", s->dir, strerror(e));
        else if (rename(s->tmp, s->dir) != 0)
            st = tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", s->tmp, s->dir, strerror(errno));
        if (st != TERA_OK) {
            tera_staged_dir_abort(s, names, n);
            return st;
        }
        sync_parent(s->dir);
        return TERA_OK;
    }
    if (!S_ISDIR(sb.st_mode)) {
        st = tera_fail(TERA_ERR_EXISTS, "'%s' exists and is not a directory", s->dir);
        tera_staged_dir_abort(s, names, n);
        return st;
    }
    (void)chmod(s->tmp, sb.st_mode & 07777); /* the new DIR keeps the old one's mode */
    if (holds_only(s->dir, names, n) == 1 && renameat2(AT_FDCWD, s->tmp, AT_FDCWD, s->dir, RENAME_EXCHANGE) == 0) {
        remove_dir(s->tmp, names, n); /* the old files, now under the temporary name */
        s->tmp[0] = '\0';
        sync_parent(s->dir);
        return TERA_OK;
    }
    /* DIR holds other files, or the swap is not supported here: file by file */
    char from[TERA_PATH_MAX + 128], to[TERA_PATH_MAX + 128];
    for (int i = 0; i < n; i++) {
        snprintf(from, sizeof from, "%s/%s", s->tmp, names[i]);
        snprintf(to, sizeof to, "%s/%s", s->dir, names[i]);
        if (rename(from, to) != 0) {
            int e = errno;
            st = tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s%s", from, to, strerror(e),
                           i ? " (the files before it were already replaced)" : "");
            tera_staged_dir_abort(s, names, n);
            return st;
        }
    }
    rmdir(s->tmp);
    s->tmp[0] = '\0';
    sync_parent(to);
    return TERA_OK;
}
