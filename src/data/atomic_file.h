/* Writing outputs of the data pipeline without ever destroying what is there: files are written
 * under a temporary name, every write, flush, fsync and close is checked (errors name the file and
 * strerror(errno)), and only complete files are renamed into place. Used by the dataset writer
 * (PREFIX.bin.tmp -> PREFIX.bin, ...) and by tokenizer saving (a staged directory). */
#ifndef TERA_DATA_ATOMIC_FILE_H
#define TERA_DATA_ATOMIC_FILE_H

#include <stddef.h>
#include <stdio.h>

#include "tera/config.h"
#include "tera/status.h"

/* Flushes, fsyncs and closes f (closed in every case); returns 0 on any failure, errno set. */
int tera_file_finish(FILE *f);
/* Creates `path` (replacing it) with data[0, n), flushed, fsynced and closed; on failure the file
 * is removed and the error is TERA_ERR_IO naming path and the reason. */
tera_status tera_file_write(const char *path, const void *data, size_t n);
/* rename(from, to); on failure `from` is removed and the error names both paths. */
tera_status tera_file_rename(const char *from, const char *to);

/* A directory built under a temporary name next to its destination (DIR.tmp.PID.N) and moved
 * into place by commit only once every file in it is complete. */
typedef struct {
    char dir[TERA_PATH_MAX];        /* destination, without trailing slashes */
    char tmp[TERA_PATH_MAX + 64];   /* the staging directory */
    char made_top[TERA_PATH_MAX];   /* the topmost missing parent created by open ("" if none) */
} tera_staged_dir;

/* Creates DIR's missing parents and the staging directory. */
tera_status tera_staged_dir_open(tera_staged_dir *s, const char *dir);
/* out = staging directory / name. */
tera_status tera_staged_dir_path(const tera_staged_dir *s, const char *name, char *out, size_t cap);
/* Moves the files names[0, n) (all written in the staging directory) into place:
 * - DIR absent: the staging directory is renamed to DIR;
 * - DIR holds nothing but (some of) these names: the two directories are swapped in one step
 *   (renameat2 RENAME_EXCHANGE) and the old files removed;
 * - DIR holds other files too (or the file system cannot swap): each file is renamed into DIR,
 *   so every file is either wholly old or wholly new, and DIR's other files are left alone.
 * On failure the staging directory is removed; DIR is unchanged unless a per-file rename failed
 * part-way (the message says so). */
tera_status tera_staged_dir_commit(tera_staged_dir *s, const char *const *names, int n);
/* Removes the staging directory (with names[0, n) in it) and the parents open created. */
void tera_staged_dir_abort(tera_staged_dir *s, const char *const *names, int n);

#endif
