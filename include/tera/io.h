/* Small file-system helpers shared by the subsystems. */
#ifndef TERA_IO_H
#define TERA_IO_H

#include <stddef.h>
#include <stdint.h>

#include "tera/status.h"

/* mkdir -p: creates `dir` and its missing parents (TERA_ERR_IO naming the failing path). */
tera_status tera_mkdirs(const char *dir);
/* Reads a whole (small) file into a NUL-terminated buffer; the caller frees *out. */
tera_status tera_read_text_file(const char *path, char **out);

/* A number for a JSON file: fmt applied to v, or "null" when v is NaN or infinite (JSON has no
 * literal for them). Returns buf. */
const char *tera_json_num(char *buf, size_t cap, const char *fmt, double v);

/* A count read back from a JSON file the program wrote (state.json): obj[key] must be a whole
 * number in [lo, hi] (so that the cast to int64 is exact and the value is one a run could have
 * written). Else TERA_ERR_FORMAT, one message naming path, where + key and the value. */
#define TERA_JSON_MAX_WHOLE ((int64_t)1 << 53) /* every whole number up to here is exact in a double */
struct cJSON;
tera_status tera_json_whole(const struct cJSON *obj, const char *key, const char *path, const char *where, int64_t lo,
                            int64_t hi, int64_t *out);

/* One line of a JSON-lines input (p[0, n), no newline): its one JSON value, or NULL with *why
 * ("invalid JSON", or "more than one JSON value on the line": cJSON alone stops after the first
 * and would drop the rest silently). Free with cJSON_Delete. */
struct cJSON *tera_jsonl_parse(const char *p, size_t n, const char **why);

/* A JSON-lines file (metrics.jsonl) cut back to the end of its last complete line (one ending in
 * '\n' that parses as JSON), so that appending continues on a line of its own after a crash or a
 * full disk; the lines before it are kept as they are. *dropped: the bytes removed. A missing file,
 * or one that is not a regular file (e.g. a device), is left alone. */
tera_status tera_jsonl_repair(const char *path, long *dropped);

/* Exclusive lock of a run directory for the life of a run: flock on DIR/.tera.lock, which holds
 * the holder's pid. The directory is created when missing (and removed again by the release when
 * it is still empty). A second process is refused (TERA_ERR_EXISTS) with a message naming the
 * holder's pid. The lock goes with the process (also on a crash: a stale file is taken over). */
#define TERA_RUN_LOCK_NAME ".tera.lock"
typedef struct {
    int fd;            /* -1: not held */
    int created_dir;   /* the acquire created dir */
    char dir[4096], path[4128];
} tera_run_lock;
tera_status tera_run_lock_acquire(tera_run_lock *l, const char *dir);
/* Removes the lock file and unlocks; removes dir when the acquire created it and it is empty.
 * Safe on a lock that is not held. */
void tera_run_lock_release(tera_run_lock *l);

#endif
