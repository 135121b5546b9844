/* Small file-system helpers shared by the subsystems. */
#ifndef TERA_IO_H
#define TERA_IO_H

#include "tera/status.h"

/* mkdir -p: creates `dir` and its missing parents (TERA_ERR_IO naming the failing path). */
tera_status tera_mkdirs(const char *dir);
/* Reads a whole (small) file into a NUL-terminated buffer; the caller frees *out. */
tera_status tera_read_text_file(const char *path, char **out);

#endif
