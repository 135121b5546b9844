/* Token sources: the embedded corpus, byte-level text, raw .u16 and Megatron-LM MMIDIDX .bin/.idx.
 *
 * Files are memory-mapped read-only and validated once at open (index structure, then every token
 * id against the vocabulary), so that tera_source_token and the loader never check anything in the
 * training loop. Every multi-byte field is decoded little-endian byte by byte: no unaligned or
 * out-of-mapping access whatever the file holds. */
#include "tera/data.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
    int fd = open(path, O_RDONLY | O_CLOEXEC);
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
    if (S > room / 12)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 18: sequence count %llu needs %llu bytes of sizes and "
                         "pointers, but only %llu bytes follow the header (truncated?)", idx,
                         (unsigned long long)S, S > UINT64_MAX / 12 ? 0ull : (unsigned long long)(S * 12),
                         (unsigned long long)room);
    room -= S * 12;
    if (Dc == 0)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 26: document count 0 (doc_idx holds at least [0])", idx);
    if (Dc > room / 8)
        return tera_fail(TERA_ERR_FORMAT, "%s: offset 26: document count %llu needs %llu bytes of doc_idx, "
                         "but only %llu bytes remain (truncated?)", idx, (unsigned long long)Dc,
                         Dc > UINT64_MAX / 8 ? 0ull : (unsigned long long)(Dc * 8), (unsigned long long)room);
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

tera_status tera_source_open(tera_token_source *s, const tera_data_config *dc, int vocab_size) {
    memset(s, 0, sizeof *s);
    if (vocab_size < 1) return tera_fail(TERA_ERR_CONFIG, "model.vocab_size = %d: must be >= 1", vocab_size);
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

void tera_source_close(tera_token_source *s) {
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

/* Flushes, syncs and closes; returns 0 on any failure (errno set). */
static int finish_file(FILE *f) {
    int ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    int e = errno;
    if (fclose(f) != 0) return 0;
    errno = e;
    return ok;
}

static tera_status write_bin(const char *tmp, int dtype, int es, const int32_t *const *docs,
                             const int64_t *doc_len, int64_t n_docs) {
    int64_t lo, hi;
    switch (dtype) {
    case DT_U8: lo = 0; hi = UINT8_MAX; break;
    case DT_I8: lo = INT8_MIN; hi = INT8_MAX; break;
    case DT_I16: lo = INT16_MIN; hi = INT16_MAX; break;
    case DT_U16: lo = 0; hi = UINT16_MAX; break;
    default: lo = INT32_MIN; hi = INT32_MAX; break;
    }
    FILE *f = fopen(tmp, "wb");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot create '%s': %s", tmp, strerror(errno));
    unsigned char buf[8192];
    size_t used = 0;
    for (int64_t d = 0; d < n_docs; d++) {
        for (int64_t k = 0; k < doc_len[d]; k++) {
            int64_t t = docs[d][k];
            if (t < lo || t > hi) {
                fclose(f);
                remove(tmp);
                return tera_fail(TERA_ERR_ARG, "%s: document %lld token %lld = %lld does not fit dtype %s",
                                 tmp, (long long)d, (long long)k, (long long)t, dtype_name(dtype));
            }
            uint64_t u = (uint64_t)t;
            for (int b = 0; b < es; b++) buf[used++] = (unsigned char)(u >> (8 * b));
            if (used + 8 > sizeof buf) {
                if (!put_bytes(f, buf, used)) goto io_fail;
                used = 0;
            }
        }
    }
    if (used && !put_bytes(f, buf, used)) goto io_fail;
    if (!finish_file(f)) {
        int e = errno;
        remove(tmp);
        return tera_fail(TERA_ERR_IO, "cannot write '%s': %s", tmp, strerror(e));
    }
    return TERA_OK;
io_fail:;
    int e = errno;
    fclose(f);
    remove(tmp);
    return tera_fail(TERA_ERR_IO, "cannot write '%s': %s", tmp, strerror(e));
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
    else if (!finish_file(f)) { ok = 0; e = errno; }
    if (!ok) {
        remove(tmp);
        return tera_fail(TERA_ERR_IO, "cannot write '%s': %s", tmp, strerror(e));
    }
    return TERA_OK;
}

tera_status tera_idx_write(const char *prefix, int dtype, const int32_t *const *docs,
                           const int64_t *doc_len, int64_t n_docs) {
    int es = dtype_int_size(dtype);
    if (es == 0)
        return tera_fail(TERA_ERR_ARG, "%s.idx: dtype code %d (%s) cannot hold token ids", prefix, dtype,
                         dtype_name(dtype));
    if (n_docs < 0) return tera_fail(TERA_ERR_ARG, "%s.idx: negative document count %lld", prefix, (long long)n_docs);
    for (int64_t d = 0; d < n_docs; d++) {
        if (doc_len[d] < 0 || doc_len[d] > INT32_MAX || (doc_len[d] > 0 && !docs[d]))
            return tera_fail(TERA_ERR_ARG, "%s.idx: document %lld: bad length %lld", prefix, (long long)d,
                             (long long)doc_len[d]);
    }
    if (strlen(prefix) >= TERA_PATH_MAX - 8)
        return tera_fail(TERA_ERR_ARG, "'%s': prefix too long", prefix);
    char bin[TERA_PATH_MAX + 8], idx[TERA_PATH_MAX + 8], bin_tmp[TERA_PATH_MAX + 16], idx_tmp[TERA_PATH_MAX + 16];
    snprintf(bin, sizeof bin, "%s.bin", prefix);
    snprintf(idx, sizeof idx, "%s.idx", prefix);
    snprintf(bin_tmp, sizeof bin_tmp, "%s.bin.tmp", prefix);
    snprintf(idx_tmp, sizeof idx_tmp, "%s.idx.tmp", prefix);
    TERA_TRY(write_bin(bin_tmp, dtype, es, docs, doc_len, n_docs));
    tera_status rc = write_idx(idx_tmp, dtype, es, doc_len, n_docs);
    if (rc != TERA_OK) {
        remove(bin_tmp);
        return rc;
    }
    /* .bin first: an .idx on disk (what auto-detection looks for) implies its .bin is complete */
    if (rename(bin_tmp, bin) != 0) {
        int e = errno;
        remove(bin_tmp);
        remove(idx_tmp);
        return tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", bin_tmp, bin, strerror(e));
    }
    if (rename(idx_tmp, idx) != 0) {
        int e = errno;
        remove(idx_tmp);
        return tera_fail(TERA_ERR_IO, "cannot rename '%s' to '%s': %s", idx_tmp, idx, strerror(e));
    }
    return TERA_OK;
}
