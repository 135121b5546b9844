/* Token sources: the embedded corpus, byte-level text, raw .u16 and Megatron-LM MMIDIDX .bin/.idx.
 *
 * Files are memory-mapped read-only and validated once at open (index structure, then every token
 * id against the vocabulary), so that tera_source_token and the loader never check anything in the
 * training loop. Every multi-byte field is decoded little-endian byte by byte: no unaligned or
 * out-of-mapping access whatever the file holds. */
#include "tera/data.h"

#include "data/atomic_file.h"
#include "data/blend.h"
#include "data/online.h"
#include "data/stream.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

/* ---- little-endian decoding ------------------------------------------------------------------ */

static uint16_t rd_u16(const unsigned char *p) { return (uint16_t)(p[0] | (unsigned)p[1] << 8); }
static uint32_t rd_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd_u64(const unsigned char *p) { return (uint64_t)rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32; }

/* ---- Megatron dtype codes -------------------------------------------------------------------- */

enum { DT_U8 = 1, DT_I8 = 2, DT_I16 = 3, DT_I32 = 4, DT_I64 = 5, DT_F64 = 6, DT_F32 = 7, DT_U16 = 8 };

static const char *dtype_name(int code) {
    switch (code) {
    case DT_U8: return "uint8";
    case DT_I8: return "int8";
    case DT_I16: return "int16";
    case DT_I32: return "int32";
    case DT_I64: return "int64";
    case DT_F64: return "float64";
    case DT_F32: return "float32";
    case DT_U16: return "uint16";
    }
    return "unknown";
}

/* Bytes per element of an integer dtype code; 0 for float or unknown codes. */
static int dtype_int_size(int code) {
    switch (code) {
    case DT_U8: case DT_I8: return 1;
    case DT_I16: case DT_U16: return 2;
    case DT_I32: return 4;
    case DT_I64: return 8;
    }
    return 0;
}

/* Token k of an array of `code` elements, sign-extended where the dtype is signed. */
static int64_t token_at(const unsigned char *p, int code, int64_t k) {
    switch (code) {
    case DT_U8: return p[k];
    case DT_I8: return (int8_t)p[k];
    case DT_U16: return rd_u16(p + 2 * k);
    case DT_I16: return (int16_t)rd_u16(p + 2 * k);
    case DT_I32: return (int32_t)rd_u32(p + 4 * k);
    case DT_I64: return (int64_t)rd_u64(p + 8 * k);
    }
    return -1;
}

/* ---- files ----------------------------------------------------------------------------------- */

/* Maps `path` read-only. An empty file succeeds with *map = NULL, *len = 0 (mmap refuses length 0;
 * the caller reports emptiness in its own terms). */
static tera_status map_file(const char *path, void **map, size_t *len) {
    *map = NULL;
    *len = 0;
    /* O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting for a writer;
     * it changes nothing for a regular file */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return tera_fail(TERA_ERR_IO, "cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return tera_fail(TERA_ERR_IO, "'%s' is not a regular file", path);
    }
    if ((uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
        close(fd);
        return tera_fail(TERA_ERR_IO, "'%s' is too large to map", path);
    }
    size_t n = (size_t)st.st_size;
    if (n > 0) {
        void *m = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            return tera_fail(TERA_ERR_IO, "cannot map '%s' (%zu bytes): %s", path, n, strerror(e));
        }
        *map = m;
    }
    if (close(fd) != 0) {
        int e = errno;
        if (*map) munmap(*map, n);
        *map = NULL;
        return tera_fail(TERA_ERR_IO, "cannot close '%s': %s", path, strerror(e));
    }
    *len = n;
    return TERA_OK;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* Every token of p[0, n) (dtype `code`) must lie in [0, vocab). */
static tera_status check_tokens(const unsigned char *p, int code, int64_t n, int vocab, const char *file) {
    int64_t bad = -1;
    switch (code) { /* tight loops per dtype: this scans the whole dataset once */
    case DT_U8:
        for (int64_t k = 0; k < n; k++)
            if (p[k] >= vocab) { bad = k; break; }
        break;
    case DT_U16:
        for (int64_t k = 0; k < n; k++)
            if (rd_u16(p + 2 * k) >= vocab) { bad = k; break; }
        break;
    case DT_I32:
        for (int64_t k = 0; k < n; k++) {
            int32_t t = (int32_t)rd_u32(p + 4 * k);
            if (t < 0 || t >= vocab) { bad = k; break; }
        }
        break;
    default:
        for (int64_t k = 0; k < n; k++) {
            int64_t t = token_at(p, code, k);
            if (t < 0 || t >= vocab) { bad = k; break; }
        }
        break;
    }
    if (bad < 0) return TERA_OK;
    int es = dtype_int_size(code);
    return tera_fail(TERA_ERR_FORMAT,
                     "%s: token %lld (byte offset %lld) = %lld is outside [0, %d) of model.vocab_size",
                     file, (long long)bad, (long long)(bad * es), (long long)token_at(p, code, bad), vocab);
}

/* ---- MMIDIDX index --------------------------------------------------------------------------- */

#define IDX_MAGIC "MMIDIDX\x00\x00"
#define IDX_HEADER 34 /* magic 9 + version 8 + dtype 1 + sequence count 8 + document count 8 */

/* count x per as a decimal string, or "over 2^64" when the product does not fit (an .idx whose
 * count field is damaged: the message must not say it needs 0 bytes) */
static const char *bytes_for(char *buf, size_t cap, uint64_t count, unsigned per) {
    if (count > UINT64_MAX / per) snprintf(buf, cap, "%llu x %u (over 2^64)", (unsigned long long)count, per);
    else snprintf(buf, cap, "%llu", (unsigned long long)(count * per));
    return buf;
}

/* Validates the index p[0, len) against a .bin of bin_len bytes. */
static tera_status parse_idx(const char *idx, const char *bin, const unsigned char *p, size_t len,
                             uint64_t bin_len, int *dtype, int64_t *n_docs) {
    if (len < 9 || memcmp(p, IDX_MAGIC, 9) != 0)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 0: bad magic (not a Megatron MMIDIDX index)%s", idx,
                         len < 9 ? ", file shorter than the 9-byte magic" : "");
    if (len < IDX_HEADER)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset %zu: truncated header: file is %zu bytes, the header is %d",
                         idx, len, len, IDX_HEADER);
    uint64_t version = rd_u64(p + 9);
    if (version != 1)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 9: version %llu, only version 1 is supported", idx,
                         (unsigned long long)version);
    int code = p[17];
    int es = dtype_int_size(code);
    if (es == 0)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 17: dtype code %d (%s) cannot hold token ids "
                         "(expected an integer code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)",
                         idx, code, dtype_name(code));
    uint64_t S = rd_u64(p + 18), Dc = rd_u64(p + 26);
    uint64_t room = len - IDX_HEADER;
    char need[64];
    if (S > room / 12)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 18: sequence count %llu needs %s bytes of sizes and "
                         "pointers, but only %llu bytes follow the header (truncated?)", idx,
                         (unsigned long long)S, bytes_for(need, sizeof need, S, 12), (unsigned long long)room);
    room -= S * 12;
    if (Dc == 0)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 26: document count 0 (doc_idx holds at least [0])", idx);
    if (Dc > room / 8)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 26: document count %llu needs %s bytes of doc_idx, "
                         "but only %llu bytes remain (truncated?)", idx, (unsigned long long)Dc,
                         bytes_for(need, sizeof need, Dc, 8), (unsigned long long)room);
    uint64_t end = IDX_HEADER + 12 * S + 8 * Dc;
    if (end != len)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset %llu: %llu trailing bytes after the declared arrays", idx,
                         (unsigned long long)end, (unsigned long long)(len - end));
    const unsigned char *sizes = p + IDX_HEADER, *ptrs = sizes + 4 * S, *docs = ptrs + 8 * S;
    uint64_t sizes_off = IDX_HEADER, ptrs_off = sizes_off + 4 * S, docs_off = ptrs_off + 8 * S;

    uint64_t running = 0; /* byte offset in .bin of sequence i */
    for (uint64_t i = 0; i < S; i++) {
        int32_t sz = (int32_t)rd_u32(sizes + 4 * i);
        if (sz < 0)
            return tera_fail(TERA_ERR_FORMAT, "%s: offset %llu: sizes[%llu] = %d is negative", idx,
                             (unsigned long long)(sizes_off + 4 * i), (unsigned long long)i, sz);
        int64_t ptr = (int64_t)rd_u64(ptrs + 8 * i);
        if (ptr < 0 || (uint64_t)ptr != running)
            return tera_fail(TERA_ERR_FORMAT, "%s: offset %llu: pointers[%llu] = %lld, expected %llu "
                             "(the running sum of sizes * %d bytes)", idx,
                             (unsigned long long)(ptrs_off + 8 * i), (unsigned long long)i, (long long)ptr,
                             (unsigned long long)running, es);
        uint64_t bytes = (uint64_t)sz * (uint64_t)es;
        if (running + bytes > bin_len) /* no overflow: running <= bin_len and bytes < 2^34 */
            return tera_fail(TERA_ERR_FORMAT, "%s: offset %llu: sequence %llu ends at byte %llu, past the end "
                             "of %s (%llu bytes)", idx, (unsigned long long)(sizes_off + 4 * i),
                             (unsigned long long)i, (unsigned long long)(running + bytes), bin,
                             (unsigned long long)bin_len);
        running += bytes;
    }
    if (running != bin_len)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset %llu: the index declares %llu bytes of tokens but %s "
                         "is %llu bytes", idx, (unsigned long long)sizes_off, (unsigned long long)running, bin,
                         (unsigned long long)bin_len);

    uint64_t prev = 0;
    for (uint64_t d = 0; d < Dc; d++) {
        int64_t v = (int64_t)rd_u64(docs + 8 * d);
        uint64_t off = docs_off + 8 * d;
        if (d == 0 && v != 0)
            return tera_fail(TERA_ERR_FORMAT, "%s: offset %llu: doc_idx[0] = %lld, expected 0", idx,
                             (unsigned long long)off, (long long)v);
        if (v < 0 || (uint64_t)v < prev || (uint64_t)v > S)
            return tera_fail(TERA_ERR_FORMAT, "%s: offset %llu: doc_idx[%llu] = %lld is not monotone within "
                             "[%llu, %llu]", idx, (unsigned long long)off, (unsigned long long)d, (long long)v,
                             (unsigned long long)prev, (unsigned long long)S);
        if (d == Dc - 1 && (uint64_t)v != S)
            return tera_fail(TERA_ERR_FORMAT, "%s: offset %llu: the last doc_idx = %lld, expected the sequence "
                             "count %llu", idx, (unsigned long long)off, (long long)v, (unsigned long long)S);
        prev = (uint64_t)v;
    }
    *dtype = code;
    *n_docs = (int64_t)(Dc - 1);
    return TERA_OK;
}

/* ---- open / close ---------------------------------------------------------------------------- */

/* PREFIX.xxh3 (written by tera_idx_writer_commit): one line per file, "<16 hex digits>  <name>"
 * with the XXH3-64 of PREFIX.idx and PREFIX.bin. When present, both are checked at open. */
static uint64_t file_xxh3(const char *path, int *ok) {
    void *m;
    size_t n;
    *ok = 0;
    if (map_file(path, &m, &n) != TERA_OK) return 0;
    uint64_t h = XXH3_64bits(m ? m : (const void *)"", n);
    if (m) munmap(m, n);
    *ok = 1;
    return h;
}

static tera_status verify_checksums(const char *prefix, const char *idx, const void *imap, size_t ilen,
                                    const char *bin) {
    char path[TERA_PATH_MAX + 8];
    snprintf(path, sizeof path, "%s.xxh3", prefix);
    FILE *f = fopen(path, "r");
    if (!f) return TERA_OK; /* no checksum file: nothing to check (e.g. a Megatron-made dataset) */
    unsigned long long want_idx = 0, want_bin = 0;
    int got = 0;
    char line[TERA_PATH_MAX + 64], name[TERA_PATH_MAX + 32];
    while (fgets(line, sizeof line, f)) {
        unsigned long long h;
        if (sscanf(line, "%16llx %1055s", &h, name) != 2) continue;
        size_t nl = strlen(name);
        if (nl >= 4 && !strcmp(name + nl - 4, ".idx")) want_idx = h, got |= 1;
        if (nl >= 4 && !strcmp(name + nl - 4, ".bin")) want_bin = h, got |= 2;
    }
    fclose(f);
    if (got != 3) return tera_fail(TERA_ERR_FORMAT, "%s: expected an xxh3 line for the .idx and for the .bin", path);
    if (XXH3_64bits(imap ? imap : (const void *)"", ilen) != (uint64_t)want_idx)
        return tera_fail(TERA_ERR_FORMAT, "%s: checksum mismatch against %s: the file changed or is corrupted", idx, path);
    int ok;
    uint64_t hb = file_xxh3(bin, &ok);
    if (!ok) return TERA_ERR_IO;
    if (hb != (uint64_t)want_bin)
        return tera_fail(TERA_ERR_FORMAT, "%s: checksum mismatch against %s: the file changed or is corrupted", bin, path);
    return TERA_OK;
}

static tera_status open_bin(tera_token_source *s, const char *prefix, int vocab_size) {
    char idx[TERA_PATH_MAX + 8], bin[TERA_PATH_MAX + 8];
    snprintf(idx, sizeof idx, "%s.idx", prefix);
    snprintf(bin, sizeof bin, "%s.bin", prefix);
    struct stat st;
    if (stat(bin, &st) != 0) return tera_fail(TERA_ERR_IO, "cannot stat '%s': %s", bin, strerror(errno));
    if (!S_ISREG(st.st_mode)) return tera_fail(TERA_ERR_IO, "'%s' is not a regular file", bin);

    void *imap;
    size_t ilen;
    TERA_TRY(map_file(idx, &imap, &ilen));
    tera_status crc = verify_checksums(prefix, idx, imap, ilen, bin);
    if (crc != TERA_OK) {
        if (imap) munmap(imap, ilen);
        return crc;
    }
    int code = 0;
    int64_t n_docs = 0;
    tera_status rc = parse_idx(idx, bin, imap ? imap : (const void *)"", ilen, (uint64_t)st.st_size, &code, &n_docs);
    if (imap) munmap(imap, ilen);
    if (rc != TERA_OK) return rc;

    void *bmap;
    size_t blen;
    TERA_TRY(map_file(bin, &bmap, &blen));
    if (blen != (uint64_t)st.st_size) { /* changed between stat and open */
        if (bmap) munmap(bmap, blen);
        return tera_fail(TERA_ERR_IO, "'%s' changed size while being opened", bin);
    }
    if (blen == 0) return tera_fail(TERA_ERR_FORMAT, "%s: no tokens (%s declares no token bytes)", bin, idx);
    s->kind = TERA_SRC_BIN;
    s->map = bmap;
    s->map_len = blen;
    s->tokens = bmap;
    s->elem_size = dtype_int_size(code);
    s->n_tokens = (int64_t)(blen / (size_t)s->elem_size);
    s->n_docs = n_docs;
    rc = check_tokens(bmap, code, s->n_tokens, vocab_size, bin);
    if (rc != TERA_OK) tera_source_close(s);
    return rc;
}

static tera_status open_flat(tera_token_source *s, const char *path, int u16, int vocab_size) {
    void *m;
    size_t n;
    TERA_TRY(map_file(path, &m, &n));
    if (n == 0) return tera_fail(TERA_ERR_FORMAT, "%s: empty file (no tokens)", path);
    if (u16 && n % 2 != 0) {
        munmap(m, n);
        return tera_fail(TERA_ERR_FORMAT, "%s: offset %zu: a .u16 token file must have an even byte length, "
                         "this one is %zu bytes", path, n - 1, n);
    }
    s->kind = u16 ? TERA_SRC_U16 : TERA_SRC_TEXT;
    s->map = m;
    s->map_len = n;
    s->tokens = m;
    s->elem_size = u16 ? 2 : 1;
    s->n_tokens = (int64_t)(n / (size_t)s->elem_size);
    s->n_docs = 1;
    tera_status rc = check_tokens(m, u16 ? DT_U16 : DT_U8, s->n_tokens, vocab_size, path);
    if (rc != TERA_OK) tera_source_close(s);
    return rc;
}

static tera_status source_open(tera_token_source *s, const tera_data_config *dc, int vocab_size) {
    memset(s, 0, sizeof *s);
    if (vocab_size < 1) return tera_fail(TERA_ERR_CONFIG, "model.vocab_size = %d: must be >= 1", vocab_size);
    if (dc->tokenizer[0] && !dc->paths[0]) { /* online tokenization, unless PATH is a prepared prefix */
        char idx[TERA_PATH_MAX + 8];
        snprintf(idx, sizeof idx, "%s.idx", dc->path);
        if (!file_exists(idx) && !ends_with(dc->path, ".idx") && !ends_with(dc->path, ".bin"))
            return dc->stream ? tera_stream_open(s, dc, vocab_size) : tera_online_open(s, dc, vocab_size);
    }
    if (dc->paths[0]) { /* a blend: this source shows its first dataset; the loader reads them all */
        if (dc->path[0])
            return tera_fail(TERA_ERR_CONFIG, "data.path = '%s' and data.paths are both set: give one of them",
                             dc->path);
        struct tera_blend *b;
        tera_data_config whole = *dc;
        whole.stream = 0; /* a blend reads its datasets by global sample index: the start-up pass */
        whole.val_path[0] = '\0'; /* refused with a blend (tera_source_open) */
        TERA_TRY(tera_blend_open(&b, &whole, vocab_size));
        *s = *tera_blend_first_source(b);
        s->map = NULL, s->map_len = 0, s->owned = NULL; /* the blend owns them */
        s->blend = b;
        return TERA_OK;
    }
    size_t plen = strnlen(dc->path, TERA_PATH_MAX);
    if (plen >= TERA_PATH_MAX - 4) /* room for the .idx / .bin suffix swap */
        return tera_fail(TERA_ERR_CONFIG, "data.path is longer than %d characters", TERA_PATH_MAX - 5);
    const char *path = dc->path, *fmt = dc->format;
    enum { F_AUTO, F_TEXT, F_BIN, F_U16 } f;
    if (fmt[0] == '\0' || strcmp(fmt, "auto") == 0) f = F_AUTO;
    else if (strcmp(fmt, "text") == 0) f = F_TEXT;
    else if (strcmp(fmt, "bin") == 0) f = F_BIN;
    else if (strcmp(fmt, "u16") == 0) f = F_U16;
    else return tera_fail(TERA_ERR_CONFIG, "data.format = '%.16s': expected auto, text, bin or u16", fmt);

    if (path[0] == '\0') {
        if (f == F_BIN || f == F_U16)
            return tera_fail(TERA_ERR_CONFIG, "data.format = %s needs a data.path", fmt);
        if (vocab_size < 256)
            return tera_fail(TERA_ERR_CONFIG, "model.vocab_size = %d: the embedded corpus is byte-level text "
                             "and needs model.vocab_size >= 256", vocab_size);
        if (tera_default_corpus_len == 0) return tera_fail(TERA_ERR_FORMAT, "the embedded default corpus is empty");
        s->kind = TERA_SRC_EMBEDDED;
        s->tokens = tera_default_corpus;
        s->n_tokens = (int64_t)tera_default_corpus_len;
        s->elem_size = 1;
        s->n_docs = 1;
        return TERA_OK;
    }

    /* PREFIX of a .bin/.idx pair named by either file */
    char prefix[TERA_PATH_MAX];
    memcpy(prefix, path, plen + 1);
    int named_pair = ends_with(path, ".bin") || ends_with(path, ".idx");
    if (named_pair) prefix[plen - 4] = '\0';
    if (f == F_AUTO) {
        char probe[TERA_PATH_MAX + 8];
        snprintf(probe, sizeof probe, "%s.idx", path);
        if (named_pair) f = F_BIN; /* a missing .idx is then reported by name */
        else if (file_exists(probe)) f = F_BIN;
        else if (ends_with(path, ".u16")) f = F_U16;
        else f = F_TEXT;
    }
    if (f == F_TEXT && vocab_size < 256)
        return tera_fail(TERA_ERR_CONFIG, "model.vocab_size = %d: data.path '%s' is byte-level text and needs "
                         "model.vocab_size >= 256", vocab_size, path);
    tera_status rc;
    if (f == F_BIN) {
        snprintf(s->path, sizeof s->path, "%s", prefix);
        rc = open_bin(s, prefix, vocab_size);
    } else {
        snprintf(s->path, sizeof s->path, "%s", path);
        rc = open_flat(s, path, f == F_U16, vocab_size);
    }
    if (rc != TERA_OK) memset(s, 0, sizeof *s);
    return rc;
}

/* data.val_path: opened as data.path would be, read whole (no streaming); a message of the inner open
 * that names data.path is reworded to name data.val_path. */
static tera_status open_val(tera_token_source *s, const tera_data_config *dc, int vocab_size) {
    tera_data_config v = *dc;
    snprintf(v.path, sizeof v.path, "%s", dc->val_path);
    v.val_path[0] = '\0';
    v.stream = 0;
    tera_token_source *val = tera_calloc(1, sizeof *val);
    tera_status st = source_open(val, &v, vocab_size);
    if (st != TERA_OK) {
        free(val);
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", tera_last_error());
        if (strncmp(msg, "data.path", 9) == 0) return tera_fail(st, "data.val_path%s", msg + 9);
        return tera_fail(st, "data.val_path '%s': %s", dc->val_path, msg);
    }
    s->val = val;
    return TERA_OK;
}

tera_status tera_source_open(tera_token_source *s, const tera_data_config *dc, int vocab_size) {
    memset(s, 0, sizeof *s);
    if (dc->val_path[0] && dc->paths[0])
        return tera_fail(TERA_ERR_CONFIG, "data.val_path = '%s' with a blend (data.paths): each dataset of a blend has its "
                         "own validation split (data.val_fraction); give one of them", dc->val_path);
    if (dc->val_path[0] && dc->val_fraction > 0.0f)
        return tera_fail(TERA_ERR_CONFIG, "data.val_path = '%s' and data.val_fraction = %g are both set: the validation "
                         "set is either a separate file or the held-out tail of data.path; give one of them",
                         dc->val_path, (double)dc->val_fraction);
    TERA_TRY(source_open(s, dc, vocab_size));
    if (!dc->val_path[0]) return TERA_OK;
    tera_status st = open_val(s, dc, vocab_size);
    if (st != TERA_OK) tera_source_close(s);
    return st;
}

void tera_source_close(tera_token_source *s) {
    if (s->val) {
        tera_source_close(s->val);
        free(s->val);
    }
    if (s->blend) tera_blend_close(s->blend);
    tera_stream_close(s->stream);
    free(s->owned);
    if (s->map) munmap(s->map, s->map_len);
    memset(s, 0, sizeof *s);
}

int64_t tera_source_token(const tera_token_source *s, int64_t i) {
    TERA_ASSERTF(i >= 0 && i < s->n_tokens, "token %lld outside [0, %lld)", (long long)i, (long long)s->n_tokens);
    const unsigned char *p = s->tokens;
    switch (s->elem_size) { /* ids were checked in [0, vocab): unsigned decoding equals signed */
    case 1: return p[i];
    case 2: return rd_u16(p + 2 * i);
    case 4: return (int64_t)rd_u32(p + 4 * i);
    case 8: return (int64_t)rd_u64(p + 8 * i);
    }
    TERA_ASSERTF(0, "bad token element size %d", s->elem_size);
    return -1;
}

/* ---- writer ---------------------------------------------------------------------------------- */

static int put_bytes(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n; }
static int put_u64(FILE *f, uint64_t v) {
    unsigned char b[8];
    for (int k = 0; k < 8; k++) b[k] = (unsigned char)(v >> (8 * k));
    return put_bytes(f, b, 8);
}
static int put_u32(FILE *f, uint32_t v) {
    unsigned char b[4];
    for (int k = 0; k < 4; k++) b[k] = (unsigned char)(v >> (8 * k));
    return put_bytes(f, b, 4);
}

struct tera_idx_writer {
    char prefix[TERA_PATH_MAX];
    char bin_tmp[TERA_PATH_MAX + 16];
    FILE *bin;                 /* PREFIX.bin.tmp */
    int dtype, es;             /* Megatron dtype code and its byte size */
    int64_t lo, hi;            /* representable token range */
    int64_t *doc_len;          /* [cap] tokens per document */
    int64_t n_docs, cap;
    XXH3_state_t *hash;        /* running XXH3-64 of the .bin bytes */
    unsigned char buf[1 << 16];
    size_t used;
};

tera_status tera_idx_writer_open(tera_idx_writer **out, const char *prefix, int dtype) {
    int es = dtype_int_size(dtype);
    if (es == 0)
        return tera_fail(TERA_ERR_ARG, "%s.idx: dtype code %d (%s) cannot hold token ids", prefix, dtype,
                         dtype_name(dtype));
    if (strlen(prefix) >= TERA_PATH_MAX - 8) return tera_fail(TERA_ERR_ARG, "'%s': prefix too long", prefix);
    tera_idx_writer *w = tera_calloc(1, sizeof *w);
    snprintf(w->prefix, sizeof w->prefix, "%s", prefix);
    snprintf(w->bin_tmp, sizeof w->bin_tmp, "%s.bin.tmp", prefix);
    w->dtype = dtype;
    w->es = es;
    switch (dtype) {
    case DT_U8: w->lo = 0; w->hi = UINT8_MAX; break;
    case DT_I8: w->lo = INT8_MIN; w->hi = INT8_MAX; break;
    case DT_I16: w->lo = INT16_MIN; w->hi = INT16_MAX; break;
    case DT_U16: w->lo = 0; w->hi = UINT16_MAX; break;
    default: w->lo = INT32_MIN; w->hi = INT32_MAX; break;
    }
    w->bin = fopen(w->bin_tmp, "wb");
    if (!w->bin) {
        tera_status st = tera_fail(TERA_ERR_IO, "cannot create '%s': %s", w->bin_tmp, strerror(errno));
        free(w);
        return st;
    }
    w->hash = XXH3_createState();
    XXH3_64bits_reset(w->hash);
    *out = w;
    return TERA_OK;
}

static int writer_flush(tera_idx_writer *w) {
    if (!w->used) return 1;
    XXH3_64bits_update(w->hash, w->buf, w->used);
    int ok = put_bytes(w->bin, w->buf, w->used);
    w->used = 0;
    return ok;
}

tera_status tera_idx_writer_add(tera_idx_writer *w, const int32_t *ids, int64_t n) {
    if (n < 0 || n > INT32_MAX || (n > 0 && !ids))
        return tera_fail(TERA_ERR_ARG, "%s.idx: document %lld: bad length %lld", w->prefix, (long long)w->n_docs,
                         (long long)n);
    for (int64_t k = 0; k < n; k++) {
        const int64_t t = ids[k];
        if (t < w->lo || t > w->hi)
            return tera_fail(TERA_ERR_ARG, "%s: document %lld token %lld = %lld does not fit dtype %s", w->bin_tmp,
                             (long long)w->n_docs, (long long)k, (long long)t, dtype_name(w->dtype));
        const uint64_t u = (uint64_t)t;
        for (int b = 0; b < w->es; b++) w->buf[w->used++] = (unsigned char)(u >> (8 * b));
        if (w->used + 8 > sizeof w->buf && !writer_flush(w))
            return tera_fail(TERA_ERR_IO, "cannot write '%s': %s", w->bin_tmp, strerror(errno));
    }
    if (w->n_docs == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 1024;
        int64_t *nd = tera_malloc(sizeof(int64_t) * (size_t)w->cap);
        if (w->n_docs) memcpy(nd, w->doc_len, sizeof(int64_t) * (size_t)w->n_docs);
        free(w->doc_len);
        w->doc_len = nd;
    }
    w->doc_len[w->n_docs++] = n;
    return TERA_OK;
}

void tera_idx_writer_abort(tera_idx_writer *w) {
    if (!w) return;
    if (w->bin) fclose(w->bin);
    remove(w->bin_tmp);
    XXH3_freeState(w->hash);
    free(w->doc_len);
    free(w);
}

static tera_status write_idx(const char *tmp, int dtype, int es, const int64_t *doc_len, int64_t n_docs) {
    FILE *f = fopen(tmp, "wb");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    unsigned char code = (unsigned char)dtype;
    int ok = put_bytes(f, IDX_MAGIC, 9) && put_u64(f, 1) && put_bytes(f, &code, 1) &&
             put_u64(f, (uint64_t)n_docs) && put_u64(f, (uint64_t)n_docs + 1);
    for (int64_t d = 0; ok && d < n_docs; d++) ok = put_u32(f, (uint32_t)doc_len[d]);
    uint64_t ptr = 0;
    for (int64_t d = 0; ok && d < n_docs; d++) {
        ok = put_u64(f, ptr);
        ptr += (uint64_t)doc_len[d] * (uint64_t)es;
    }
    for (int64_t d = 0; ok && d <= n_docs; d++) ok = put_u64(f, (uint64_t)d);
    int e = errno;
    if (!ok) fclose(f);
    else if (!tera_file_finish(f)) { ok = 0; e = errno; }
    if (!ok) {
        remove(tmp);
        return tera_fail(TERA_ERR_IO, "cannot write '%s': %s", tmp, strerror(e));
    }
    return TERA_OK;
}

tera_status tera_idx_writer_commit(tera_idx_writer *w) {
    char bin[TERA_PATH_MAX + 8], idx[TERA_PATH_MAX + 8], idx_tmp[TERA_PATH_MAX + 16];
    char sum[TERA_PATH_MAX + 8], sum_tmp[TERA_PATH_MAX + 16];
    snprintf(bin, sizeof bin, "%s.bin", w->prefix);
    snprintf(idx, sizeof idx, "%s.idx", w->prefix);
    snprintf(idx_tmp, sizeof idx_tmp, "%s.idx.tmp", w->prefix);
    snprintf(sum, sizeof sum, "%s.xxh3", w->prefix);
    snprintf(sum_tmp, sizeof sum_tmp, "%s.xxh3.tmp", w->prefix);
    int done = writer_flush(w), e = errno;
    if (done) { /* (on a failed flush the file stays open for abort to close) */
        done = tera_file_finish(w->bin);
        e = errno;
        w->bin = NULL;
    }
    if (!done) {
        tera_status st = tera_fail(TERA_ERR_IO, "cannot write '%s': %s", w->bin_tmp, strerror(e));
        tera_idx_writer_abort(w);
        return st;
    }
    const uint64_t hbin = XXH3_64bits_digest(w->hash);
    tera_status st = write_idx(idx_tmp, w->dtype, w->es, w->doc_len, w->n_docs);
    if (st != TERA_OK) {
        tera_idx_writer_abort(w);
        return st;
    }
    int ok;
    const uint64_t hidx = file_xxh3(idx_tmp, &ok);
    FILE *f = ok ? fopen(sum_tmp, "w") : NULL;
    const char *base = strrchr(w->prefix, '/');
    base = base ? base + 1 : w->prefix;
    int wrote = 0;
    if (f) { /* closed in every case (a failed fprintf included) */
        wrote = fprintf(f, "%016llx  %s.idx\n%016llx  %s.bin\n", (unsigned long long)hidx, base,
                        (unsigned long long)hbin, base) >= 0;
        e = errno;
        if (!wrote) fclose(f);
        else if (!tera_file_finish(f)) wrote = 0, e = errno;
    } else {
        e = errno;
    }
    if (!wrote) {
        st = tera_fail(TERA_ERR_IO, "cannot write '%s': %s", sum_tmp, strerror(e));
        remove(idx_tmp);
        remove(sum_tmp);
        tera_idx_writer_abort(w);
        return st;
    }
    /* order: .bin, checksums, .idx last: an .idx on disk implies its .bin and checksums are complete */
    st = tera_file_rename(w->bin_tmp, bin);
    if (st == TERA_OK) st = tera_file_rename(sum_tmp, sum);
    if (st == TERA_OK) st = tera_file_rename(idx_tmp, idx);
    if (st != TERA_OK) {
        remove(idx_tmp);
        remove(sum_tmp);
    }
    XXH3_freeState(w->hash);
    free(w->doc_len);
    free(w);
    return st;
}

tera_status tera_idx_write(const char *prefix, int dtype, const int32_t *const *docs, const int64_t *doc_len,
                           int64_t n_docs) {
    if (n_docs < 0) return tera_fail(TERA_ERR_ARG, "%s.idx: negative document count %lld", prefix, (long long)n_docs);
    tera_idx_writer *w;
    TERA_TRY(tera_idx_writer_open(&w, prefix, dtype));
    for (int64_t d = 0; d < n_docs; d++) {
        tera_status st = tera_idx_writer_add(w, docs[d], doc_len[d]);
        if (st != TERA_OK) {
            tera_idx_writer_abort(w);
            return st;
        }
    }
    return tera_idx_writer_commit(w);
}
