/* safetensors files: strict reader (mmap) and writer, plus sharded sets tied by an index.
 *
 * Format: 8-byte little-endian header length N, N bytes of JSON
 * {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data.
 * The reader rejects (TERA_ERR_FORMAT, message naming the file and the tensor/field at fault):
 * N larger than the file, non-JSON header, offsets that overlap, leave gaps or run past the end,
 * duplicate names, unknown dtypes, shapes whose byte size disagrees with the offsets, negative or
 * non-integer dims. It never reads outside the mapping. */
#ifndef TERA_SAFETENSORS_H
#define TERA_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "tera/status.h"

typedef enum {
    TERA_DT_F64, TERA_DT_F32, TERA_DT_F16, TERA_DT_BF16,
    TERA_DT_I64, TERA_DT_I32, TERA_DT_I16, TERA_DT_I8,
    TERA_DT_U64, TERA_DT_U32, TERA_DT_U16, TERA_DT_U8, TERA_DT_BOOL,
    TERA_DT_COUNT
} tera_dtype;

size_t tera_dtype_size(tera_dtype dt);
const char *tera_dtype_name(tera_dtype dt); /* "F32", "BF16", ... as safetensors spells them */

#define TERA_ST_MAX_DIMS 8

typedef struct {
    char *name;                         /* tensor name */
    tera_dtype dtype;
    int ndim;
    int64_t shape[TERA_ST_MAX_DIMS];
    int64_t numel;
    uint64_t begin, end;                /* byte offsets into the data section */
} tera_st_tensor;

typedef struct {
    char path[1024];
    void *map;                          /* whole-file mapping (NULL for an empty file) */
    size_t file_size;
    const uint8_t *data;                /* start of the data section */
    int n;                              /* number of tensors */
    tera_st_tensor *tensors;            /* sorted by name */
    int n_meta;
    char **meta_keys, **meta_vals;      /* "__metadata__" entries */
} tera_st_file;

tera_status tera_st_open(tera_st_file *f, const char *path);
void tera_st_close(tera_st_file *f);
/* NULL when absent. */
const tera_st_tensor *tera_st_find(const tera_st_file *f, const char *name);
const char *tera_st_meta(const tera_st_file *f, const char *key); /* NULL when absent */
/* Copies a tensor into dst as float32, converting from F32/F16/BF16/F64. The tensor's shape must
 * equal (ndim, shape) exactly; otherwise TERA_ERR_FORMAT naming the tensor and both shapes. A NaN
 * or infinity in the tensor is TERA_ERR_NUMERIC naming the file, the tensor and the element. */
tera_status tera_st_read_f32(const tera_st_file *f, const char *name, int ndim, const int64_t *shape,
                             float *dst);

/* Writer: tensors are referenced, not copied, until tera_st_writer_save returns. */
typedef struct {
    const char *name;
    tera_dtype dtype;
    int ndim;
    int64_t shape[TERA_ST_MAX_DIMS];
    const void *data;
    uint64_t nbytes;
} tera_st_entry;

typedef struct {
    int n, cap;
    tera_st_entry *entries;             /* in insertion order; written sorted by name */
    int n_meta;
    char **meta_keys, **meta_vals;
} tera_st_writer;

void tera_st_writer_init(tera_st_writer *w);
void tera_st_writer_free(tera_st_writer *w);
/* `name` is copied. */
void tera_st_writer_add(tera_st_writer *w, const char *name, tera_dtype dt, int ndim,
                        const int64_t *shape, const void *data);
void tera_st_writer_meta(tera_st_writer *w, const char *key, const char *value);
/* Writes one file atomically: PATH.tmp, fsync, rename. Never leaves a partial PATH. */
tera_status tera_st_writer_save(const tera_st_writer *w, const char *path);
/* Writes `dir`/model.safetensors, or when the total exceeds max_shard_bytes (> 0),
 * `dir`/model-0000i-of-0000n.safetensors plus model.safetensors.index.json
 * ({"metadata": {"total_size": N}, "weight_map": {name: file}}). */
tera_status tera_st_writer_save_dir(const tera_st_writer *w, const char *dir, int64_t max_shard_bytes);

/* Streaming writes, for data that is never in memory at once (a checkpoint gathered piece by
 * piece): lays out w's entries as tera_st_writer_save (is_dir 0: the file `path`) or
 * tera_st_writer_save_dir (is_dir 1: `path` is the directory, shards and index as max_shard_bytes
 * says) would, creates each file as FILE.tmp holding its header, and takes the data in any order
 * through tera_st_stream_write (entry: w's insertion index; byte_off inside that tensor's data).
 * w's entries' data pointers are not read, and w must outlive the stream. finish fsyncs, renames
 * and writes the index: the files are byte for byte those the writer would have written. abort
 * removes the .tmp files. Both free the stream. */
typedef struct tera_st_stream tera_st_stream;
tera_status tera_st_stream_open(tera_st_stream **s, const tera_st_writer *w, const char *path, int is_dir,
                                int64_t max_shard_bytes);
tera_status tera_st_stream_write(tera_st_stream *s, int entry, uint64_t byte_off, const void *p, uint64_t n);
tera_status tera_st_stream_finish(tera_st_stream *s);
void tera_st_stream_abort(tera_st_stream *s);

/* Elements [lo, lo + n) of a tensor (flat, row-major) as float32, checked finite like
 * tera_st_read_f32. fd >= 0: an open descriptor of f's file, read with pread (the pages do not stay
 * mapped into the process: a rank reading its pieces does not grow by the file); -1: from the map. */
tera_status tera_st_read_range_f32(const tera_st_file *f, int fd, const char *name, int64_t lo, int64_t n,
                                   float *dst);

/* A directory's tensors: model.safetensors, or the files named by model.safetensors.index.json
 * (every file the index names must exist and hold exactly the tensors the index maps to it). */
typedef struct {
    int n_files;
    tera_st_file *files;
} tera_st_set;

tera_status tera_st_set_open(tera_st_set *s, const char *dir);
void tera_st_set_close(tera_st_set *s);
/* The file holding `name`, or NULL. */
const tera_st_file *tera_st_set_find(const tera_st_set *s, const char *name);
tera_status tera_st_set_read_f32(const tera_st_set *s, const char *name, int ndim,
                                 const int64_t *shape, float *dst);

#endif
