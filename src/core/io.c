#include "tera/io.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

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
