/* Checkpoints on disk: committed directories, manifests, differential checkpoints, verification,
 * and the crash-injection hook. The trainer side (snapshot + background writer) is in
 * src/train/checkpoint.c; docs/CHECKPOINTS.md describes the layout and the guarantees.
 *
 * A checkpoint is RUN/checkpoints/step_NNNNNNNN/. It is written as step_NNNNNNNN.tmp, every file
 * fsynced, then COMMIT (the step and size + XXH3-64 of every other file) is written and fsynced
 * last, the directory renamed into place and its parent fsynced. Only a directory whose COMMIT
 * parses and names its own step counts as a checkpoint, and only while every file COMMIT names is
 * present; everything else (".tmp", ".deleting", no COMMIT, a file missing) is ignored by readers
 * and removed by the next save. Retention removes a checkpoint by renaming it to
 * step_NNNNNNNN.deleting first, so a crash in the middle never leaves a half-removed directory
 * under a checkpoint's name. */
#ifndef TERA_CKPT_H
#define TERA_CKPT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tera/config.h"
#include "tera/model.h"
#include "tera/status.h"

#define TERA_CKPT_FORMAT_VERSION 2
#define TERA_CKPT_CHUNK_BYTES (64 * 1024)   /* differential checkpoints compare 64 KiB chunks */

/* Options (config keys checkpoint.async and checkpoint.full_every). */
typedef struct {
    int async;       /* 1: the step loop snapshots into host buffers, a background thread writes */
    int full_every;  /* every N-th save is full, the others differential against the last full one;
                        0 or 1 = always full */
} tera_ckpt_options;

/* The config keys' values; the environment variables TERA_CKPT_ASYNC and TERA_CKPT_FULL_EVERY
 * override them (tests and experiments). */
tera_ckpt_options tera_ckpt_options_from_config(const tera_config *c);

/* ---------------------------------------------------------------- fault injection (tests) */
/* Every I/O operation of the checkpoint writer (mkdir, open, write, fsync, rename, remove) calls
 * this first. With TERA_CKPT_FAULT=N in the environment the N-th call (1-based, counted over the
 * process) prints the operation to stderr and abort()s; with TERA_CKPT_DELAY_MS=M (0 to 60000) each
 * call first sleeps M ms (a slow disk: a save in the background still in flight steps later). */
void tera_ckpt_io_point(const char *op, const char *path);
int64_t tera_ckpt_io_count(void);  /* calls so far */

/* ---------------------------------------------------------------- file helpers (fault-counted) */
/* Writes buf to path (open, write, fsync, close; each an I/O point). */
tera_status tera_ckpt_write_file(const char *path, const void *buf, size_t n);
/* fsync of an existing file or directory. */
tera_status tera_ckpt_fsync_path(const char *path);
/* Removes a directory tree (an I/O point per directory). */
tera_status tera_ckpt_rmtree(const char *path);
/* Removes a checkpoint directory atomically as readers see it: renamed to DIR.deleting (an I/O
 * point), the parent fsynced, then the tree removed. */
#define TERA_CKPT_DELETING_SUFFIX ".deleting"
tera_status tera_ckpt_remove(const char *dir);
/* Writes cfg as run_dir/config.ini through a temporary file, fsynced and renamed into place (the
 * old one stays whole until the new one is complete). */
tera_status tera_ckpt_write_run_config(const tera_config *cfg, const char *run_dir);
/* XXH3-64 and size of a file's contents. */
tera_status tera_ckpt_hash_file(const char *path, uint64_t *hash, int64_t *size);

/* What a directory an output is about to go to already belongs to. `path` need not exist: its
 * nearest existing ancestor is resolved (symbolic links and "..") and it and every directory above
 * it are looked at. TERA_OWNER_CHECKPOINT: path is or lies inside a tera checkpoint directory
 * (manifest.json or COMMIT in it); TERA_OWNER_CHECKPOINTS: inside a run's checkpoints/ directory (a
 * directory of that name beside the run's config.ini or metrics.jsonl); TERA_OWNER_RUN: path itself
 * is a run directory (a checkpoints/ directory in it); TERA_OWNER_NONE: none of these. owner (cap
 * bytes, may be NULL) gets the directory that decided. Exports and conversions refuse such places
 * even with --force: what they would write there, a reader of that directory would take for its own. */
typedef enum { TERA_OWNER_NONE = 0, TERA_OWNER_CHECKPOINT, TERA_OWNER_CHECKPOINTS, TERA_OWNER_RUN } tera_dir_owner;
tera_dir_owner tera_ckpt_dir_owner(const char *path, char *owner, size_t cap);

/* ---------------------------------------------------------------- reading */
typedef struct {
    char name[64];       /* directory name: step_NNNNNNNN, step_NNNNNNNN.tmp or .deleting */
    int64_t step;
    int committed;       /* COMMIT present, parses, names this step, every file it names present
                            (not a .tmp or .deleting) */
    int full;            /* 1 full, 0 differential (only when committed) */
    int64_t base_step;   /* the full checkpoint a differential one applies to (-1: none) */
    int64_t bytes;       /* total size of its files */
} tera_ckpt_info;

/* Entries of `ckpt_root` (a run's checkpoints/ directory) that look like checkpoints, sorted by
 * step; *out is malloc'd (free it). A missing directory gives 0 entries. */
tera_status tera_ckpt_list(const char *ckpt_root, tera_ckpt_info **out, int *n);
/* Removes the entries tera_ckpt_list gives (step_N, step_N.tmp, step_N.deleting) from ckpt_root,
 * only the uncommitted ones when uncommitted_only; nothing else there is touched. */
tera_status tera_ckpt_remove_listed(const char *ckpt_root, int uncommitted_only);
/* The step of a checkpoint directory's name (step_N, trailing slashes allowed); -1 for any other
 * name (step_N.tmp and step_N.deleting included). */
int64_t tera_ckpt_dir_step(const char *dir);
/* 1 when dir holds a COMMIT that parses and names the directory's step, and every file it names. */
int tera_ckpt_committed(const char *dir);
/* Re-hashes every file named by COMMIT (size and XXH3) and checks the manifest's checksums, and
 * for a differential checkpoint that its base is committed. TERA_ERR_FORMAT names the first file
 * at fault. report (may be NULL) receives one line per problem. */
tera_status tera_ckpt_verify(const char *dir, FILE *report);
/* The newest checkpoint under run_dir/checkpoints that verifies (and whose base verifies);
 * newer ones that do not are skipped with a warning on stderr. */
tera_status tera_ckpt_find_latest(const char *run_dir, char *out, size_t cap);
/* Loads a checkpoint (full, or its base + the differential) into m's weights and router bias, and
 * into the moments exp_avg / exp_avg_sq (each [m->n_floats]; NULL = skip). The result is checked
 * against the manifest's per-region XXH3. */
tera_status tera_ckpt_load(const char *dir, tera_model *m, float *exp_avg, float *exp_avg_sq);

/* ---------------------------------------------------------------- piecewise reading
 * A rank reads only the pieces it holds, straight from the files (pread; no whole-model buffer):
 * full, differential (base + changed chunks) and sharded checkpoints alike, and Hugging Face
 * directories (config.json + safetensors, no manifest.json) as whole weights. `global` is the
 * one-process parameter table (tera_zero_global_shell) and must outlive the reader. */
typedef struct tera_ckpt_reader tera_ckpt_reader;
tera_status tera_ckpt_reader_open(tera_ckpt_reader **r, const char *dir, const tera_model *global);
void tera_ckpt_reader_close(tera_ckpt_reader *r);
int tera_ckpt_reader_sharded(const tera_ckpt_reader *r);
/* 1: dir is a Hugging Face directory (no manifest.json), read like a whole checkpoint without moments. */
int tera_ckpt_reader_is_hf(const tera_ckpt_reader *r);
/* Elements [g0, g0 + n) (flat, row-major over the global shape) of parameter i of region k (0
 * weights, 1 exp_avg, 2 exp_avg_sq). */
tera_status tera_ckpt_reader_read(tera_ckpt_reader *r, int k, int i, int64_t g0, int64_t n, float *dst);
/* The router bias [n_layers * n_experts] (zeros where the checkpoint has none). */
tera_status tera_ckpt_reader_bias(tera_ckpt_reader *r, float *bias);
/* Compares a region's XXH3 with the manifest's (*checked = 0: the manifest has none, sharded). */
tera_status tera_ckpt_region_check(const char *dir, int region, uint64_t hash, int *checked);

/* The checkpoint's weights (and router bias) as a Hugging Face directory (tera_hf_export_checked's
 * files), streamed tensor piece by tensor piece; mc: the checkpoint's model configuration. */
tera_status tera_ckpt_export_hf(const char *dir, const tera_model_config *mc, const char *out, int64_t max_shard_bytes,
                                int overwrite, int allow_tera_moe);

/* A block [lo, lo + len) of a tensor of shape[3] as runs contiguous in both the whole tensor and
 * the block (dims merged where the block spans them): their number, and run r's global offset g
 * (inside the tensor), offset l inside the block and length n, in increasing g. */
int64_t tera_block_n_runs(const int64_t *shape, const int64_t *len);
void tera_block_run(const int64_t *shape, const int64_t *lo, const int64_t *len, int64_t r, int64_t *g, int64_t *l,
                    int64_t *n);

/* ---------------------------------------------------------------- shared with the writer */
/* The state is four regions of floats: 0 weights, 1 exp_avg, 2 exp_avg_sq (each laid out as the
 * flat parameter buffer, [n_floats]), 3 router bias ([n_layers * n_experts], empty without one). */
enum { TERA_CKPT_N_REGIONS = 4 };
extern const char *const tera_ckpt_region_names[TERA_CKPT_N_REGIONS];
int64_t tera_ckpt_region_floats(const tera_model *m, int region);
/* XXH3-64 of a region's tensor contents (table order; alignment padding excluded). */
uint64_t tera_ckpt_region_hash(const tera_model *m, int region, const float *buf);
/* Differential file: "TERADIF1", u32 n_records, then per record u32 region, u32 raw_bytes,
 * u64 byte offset into the region, u32 compressed bytes, the zstd frame. */
tera_status tera_ckpt_apply_diff(const char *path, const tera_model *m, float *const regions[TERA_CKPT_N_REGIONS]);
/* The same over n_regions buffers of sizes[r] floats (a sharded checkpoint's rank buffer: 1). */
tera_status tera_ckpt_apply_diff_sized(const char *path, int n_regions, float *const *regions, const int64_t *sizes);

#endif
