/* safetensors: strict mmap reader, atomic writer, and sharded sets tied by an index.
 *
 * The reader copies the header out of the mapping, parses it with cJSON, and checks every entry
 * before any tensor data is touched: after tera_st_open succeeds, every [begin, end) lies inside
 * the mapping, so the accessors need no further bounds checks. Values are little-endian on disk;
 * loads assemble bytes explicitly, so the code does not depend on the host's byte order or on
 * the alignment of the data inside the file. */
#include "tera/io.h"
#include "tera/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The reference implementation refuses headers above 100 MB; so do we. */
#define ST_MAX_HEADER 100000000ull
/* Largest integer a JSON number (an IEEE double in cJSON) holds exactly. */
#define ST_MAX_JSON_INT 9007199254740992.0
#define ST_INDEX_NAME "model.safetensors.index.json"

/* ---------------------------------------------------------------------------------- dtypes -- */

static const struct {
    const char *name; /* as safetensors spells it */
    size_t size;      /* bytes per element */
} g_dtypes[TERA_DT_COUNT] = {
    [TERA_DT_F64] = {"F64", 8},  [TERA_DT_F32] = {"F32", 4},  [TERA_DT_F16] = {"F16", 2},
    [TERA_DT_BF16] = {"BF16", 2}, [TERA_DT_I64] = {"I64", 8}, [TERA_DT_I32] = {"I32", 4},
    [TERA_DT_I16] = {"I16", 2},  [TERA_DT_I8] = {"I8", 1},   [TERA_DT_U64] = {"U64", 8},
    [TERA_DT_U32] = {"U32", 4},  [TERA_DT_U16] = {"U16", 2}, [TERA_DT_U8] = {"U8", 1},
    [TERA_DT_BOOL] = {"BOOL", 1},
};

size_t tera_dtype_size(tera_dtype dt) {
    TERA_ASSERT(dt >= 0 && dt < TERA_DT_COUNT);
    return g_dtypes[dt].size;
}

const char *tera_dtype_name(tera_dtype dt) {
    TERA_ASSERT(dt >= 0 && dt < TERA_DT_COUNT);
    return g_dtypes[dt].name;
}

static int dtype_from_name(const char *s, tera_dtype *dt) {
    for (int i = 0; i < TERA_DT_COUNT; i++) {
        if (strcmp(g_dtypes[i].name, s) == 0) {
            *dt = (tera_dtype)i;
            return 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------- little-endian loads -- */

static uint16_t load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t load_u64(const uint8_t *p) { return (uint64_t)load_u32(p) | (uint64_t)load_u32(p + 4) << 32; }

static void store_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float, exact for every input (subnormals, infinities, NaN payloads). */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13)); /* inf / nan */
    if (exp != 0) return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
    if (man == 0) return bits_to_f32(sign); /* +-0 */
    /* subnormal: man * 2^-24, exactly representable in float */
    float v = (float)man * 0x1p-24f;
    return sign ? -v : v;
}

static float bf16_to_f32(uint16_t b) { return bits_to_f32((uint32_t)b << 16); }

/* -------------------------------------------------------------------------------- reader -- */

/* Reads a JSON number that must be an integer in [0, 2^53]; 0 if it is not. */
static int json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return 0;
    double v = j->valuedouble;
    if (!isfinite(v) || v < 0 || v > ST_MAX_JSON_INT || floor(v) != v) return 0;
    *out = (uint64_t)v;
    return 1;
}

/* "[2,3]" into buf. */
static const char *shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%" PRId64, i ? "," : "", shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
    return buf;
}

static tera_status parse_shape(const tera_st_file *f, const char *name, const cJSON *js, tera_st_tensor *t) {
    if (!cJSON_IsArray(js))
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': \"shape\" is missing or not an array", f->path, name);
    int nd = cJSON_GetArraySize(js);
    if (nd > TERA_ST_MAX_DIMS)
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': shape has %d dims (at most %d supported)", f->path,
                         name, nd, TERA_ST_MAX_DIMS);
    t->ndim = 0;
    uint64_t numel = 1;
    const cJSON *d;
    cJSON_ArrayForEach(d, js) {
        uint64_t v;
        if (!json_uint(d, &v))
            return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': shape dim %d is not a non-negative integer",
                             f->path, name, t->ndim);
        if (__builtin_mul_overflow(numel, v, &numel) || numel > (uint64_t)INT64_MAX)
            return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': shape element count overflows", f->path, name);
        t->shape[t->ndim++] = (int64_t)v;
    }
    t->numel = (int64_t)numel;
    return TERA_OK;
}

static tera_status parse_offsets(const tera_st_file *f, const char *name, const cJSON *jo, tera_st_tensor *t) {
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !json_uint(cJSON_GetArrayItem(jo, 0), &t->begin) ||
        !json_uint(cJSON_GetArrayItem(jo, 1), &t->end))
        return tera_fail(TERA_ERR_FORMAT,
                         "%s: tensor '%s': \"data_offsets\" is missing or not [begin, end] of non-negative integers",
                         f->path, name);
    if (t->begin > t->end)
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': data_offsets [%" PRIu64 ",%" PRIu64 "] begin after end",
                         f->path, name, t->begin, t->end);
    return TERA_OK;
}

/* One {dtype, shape, data_offsets} entry into t (t->name set by the caller). */
static tera_status parse_tensor(const tera_st_file *f, const cJSON *e, tera_st_tensor *t) {
    const char *name = t->name;
    if (!cJSON_IsObject(e)) return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': entry is not an object", f->path, name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    if (!cJSON_IsString(jd))
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': \"dtype\" is missing or not a string", f->path, name);
    if (!dtype_from_name(jd->valuestring, &t->dtype))
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': unknown dtype \"%s\"", f->path, name, jd->valuestring);
    TERA_TRY(parse_shape(f, name, cJSON_GetObjectItemCaseSensitive(e, "shape"), t));
    TERA_TRY(parse_offsets(f, name, cJSON_GetObjectItemCaseSensitive(e, "data_offsets"), t));
    uint64_t need;
    if (__builtin_mul_overflow((uint64_t)t->numel, (uint64_t)tera_dtype_size(t->dtype), &need))
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s': byte size overflows", f->path, name);
    if (t->end - t->begin != need) {
        char sb[256];
        return tera_fail(TERA_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets [%" PRIu64 ",%" PRIu64 "] hold %" PRIu64
                         " bytes but shape %s %s needs %" PRIu64,
                         f->path, name, t->begin, t->end, t->end - t->begin,
                         shape_str(sb, sizeof sb, t->ndim, t->shape), tera_dtype_name(t->dtype), need);
    }
    return TERA_OK;
}

static tera_status parse_meta(tera_st_file *f, const cJSON *jm) {
    if (!cJSON_IsObject(jm)) return tera_fail(TERA_ERR_FORMAT, "%s: \"__metadata__\" is not an object", f->path);
    int n = cJSON_GetArraySize(jm);
    f->meta_keys = tera_calloc((size_t)n + 1, sizeof(char *));
    f->meta_vals = tera_calloc((size_t)n + 1, sizeof(char *));
    const cJSON *e;
    cJSON_ArrayForEach(e, jm) {
        if (!cJSON_IsString(e))
            return tera_fail(TERA_ERR_FORMAT, "%s: \"__metadata__\" value of '%s' is not a string", f->path, e->string);
        for (int i = 0; i < f->n_meta; i++)
            if (strcmp(f->meta_keys[i], e->string) == 0)
                return tera_fail(TERA_ERR_FORMAT, "%s: duplicate \"__metadata__\" key '%s'", f->path, e->string);
        f->meta_keys[f->n_meta] = strdup(e->string);
        f->meta_vals[f->n_meta] = strdup(e->valuestring);
        f->n_meta++;
        if (!f->meta_keys[f->n_meta - 1] || !f->meta_vals[f->n_meta - 1])
            return tera_fail(TERA_ERR_NOMEM, "%s: out of memory", f->path);
    }
    return TERA_OK;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const tera_st_tensor *)a)->name, ((const tera_st_tensor *)b)->name);
}

/* Orders tensor pointers by (begin, end). */
static int cmp_tensor_offsets(const void *a, const void *b) {
    const tera_st_tensor *x = *(const tera_st_tensor *const *)a, *y = *(const tera_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* Tensors sorted by offset must tile [0, data_len) exactly: no gap, no overlap, nothing past it. */
static tera_status check_layout(const tera_st_file *f, uint64_t data_len) {
    tera_st_tensor **by = tera_malloc(sizeof(*by) * (size_t)(f->n ? f->n : 1));
    for (int i = 0; i < f->n; i++) by[i] = &f->tensors[i];
    qsort(by, (size_t)f->n, sizeof *by, cmp_tensor_offsets);
    tera_status s = TERA_OK;
    uint64_t cursor = 0;
    for (int i = 0; i < f->n && s == TERA_OK; i++) {
        const tera_st_tensor *t = by[i];
        if (t->end > data_len)
            s = tera_fail(TERA_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets [%" PRIu64 ",%" PRIu64 "] run past the end of the data (%" PRIu64
                          " bytes)",
                          f->path, t->name, t->begin, t->end, data_len);
        else if (t->begin > cursor)
            s = tera_fail(TERA_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets [%" PRIu64 ",%" PRIu64 "] leave a gap: bytes [%" PRIu64
                          ",%" PRIu64 ") belong to no tensor",
                          f->path, t->name, t->begin, t->end, cursor, t->begin);
        else if (t->begin < cursor)
            s = tera_fail(TERA_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets [%" PRIu64 ",%" PRIu64 "] overlap tensor '%s' ending at %" PRIu64,
                          f->path, t->name, t->begin, t->end, by[i - 1]->name, cursor);
        cursor = t->end;
    }
    free(by);
    if (s == TERA_OK && cursor != data_len)
        s = tera_fail(TERA_ERR_FORMAT, "%s: data section is %" PRIu64 " bytes but the tensors cover only %" PRIu64,
                      f->path, data_len, cursor);
    return s;
}

/* Entries of the root object into f->tensors / f->meta_*, then sorting and duplicate checks. */
static tera_status parse_entries(tera_st_file *f, const cJSON *root) {
    int cap = cJSON_GetArraySize(root), seen_meta = 0;
    f->tensors = tera_calloc((size_t)cap + 1, sizeof(tera_st_tensor));
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (strcmp(e->string, "__metadata__") == 0) {
            if (seen_meta++) return tera_fail(TERA_ERR_FORMAT, "%s: duplicate \"__metadata__\"", f->path);
            TERA_TRY(parse_meta(f, e));
            continue;
        }
        tera_st_tensor *t = &f->tensors[f->n++];
        t->name = strdup(e->string);
        if (!t->name) return tera_fail(TERA_ERR_NOMEM, "%s: out of memory", f->path);
        TERA_TRY(parse_tensor(f, e, t));
    }
    qsort(f->tensors, (size_t)f->n, sizeof *f->tensors, cmp_tensor_name);
    for (int i = 1; i < f->n; i++)
        if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0)
            return tera_fail(TERA_ERR_FORMAT, "%s: duplicate tensor name '%s'", f->path, f->tensors[i].name);
    return TERA_OK;
}

static tera_status parse_file(tera_st_file *f) {
    if (f->file_size < 8)
        return tera_fail(TERA_ERR_FORMAT, "%s: file is %zu bytes, shorter than the 8-byte header length", f->path,
                         f->file_size);
    const uint8_t *base = f->map;
    uint64_t n = load_u64(base);
    if (n > f->file_size - 8 || n > ST_MAX_HEADER)
        return tera_fail(TERA_ERR_FORMAT, "%s: header length %" PRIu64 " exceeds the %zu bytes after it%s", f->path, n,
                         f->file_size - 8, n > ST_MAX_HEADER ? " (or the 100 MB limit)" : "");
    char *hdr = tera_malloc((size_t)n + 1);
    memcpy(hdr, base + 8, (size_t)n);
    hdr[n] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(hdr, &end, 0);
    tera_status s = TERA_OK;
    if (!root) {
        s = tera_fail(TERA_ERR_FORMAT, "%s: header is not valid JSON (error at byte %td of %" PRIu64 ")", f->path,
                      end ? end - hdr : (ptrdiff_t)0, n);
    } else {
        /* only padding may follow the JSON (an embedded NUL stops the parser early: refused here) */
        for (const char *p = end; p < hdr + n && s == TERA_OK; p++)
            if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
                s = tera_fail(TERA_ERR_FORMAT, "%s: header has trailing bytes after the JSON (byte %td)", f->path,
                              p - hdr);
        if (s == TERA_OK && !cJSON_IsObject(root))
            s = tera_fail(TERA_ERR_FORMAT, "%s: header JSON is not an object", f->path);
        if (s == TERA_OK) s = parse_entries(f, root);
    }
    cJSON_Delete(root);
    free(hdr);
    TERA_TRY(s);
    f->data = base + 8 + n;
    return check_layout(f, (uint64_t)(f->file_size - 8 - n));
}

tera_status tera_st_open(tera_st_file *f, const char *path) {
    memset(f, 0, sizeof *f);
    if ((size_t)snprintf(f->path, sizeof f->path, "%s", path) >= sizeof f->path)
        return tera_fail(TERA_ERR_IO, "%s: path too long", path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        int err = errno;
        close(fd);
        return tera_fail(TERA_ERR_IO, "%s: %s", path, err ? strerror(err) : "not a regular file");
    }
    f->file_size = (size_t)st.st_size;
    if (f->file_size > 0) {
        void *m = mmap(NULL, f->file_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int err = errno;
            close(fd);
            return tera_fail(TERA_ERR_IO, "%s: cannot mmap: %s", path, strerror(err));
        }
        f->map = m;
    }
    close(fd);
    tera_status s = parse_file(f);
    if (s != TERA_OK) tera_st_close(f);
    return s;
}

void tera_st_close(tera_st_file *f) {
    if (f->map) munmap(f->map, f->file_size);
    for (int i = 0; i < f->n; i++) free(f->tensors[i].name);
    free(f->tensors);
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_vals[i]);
    }
    free(f->meta_keys);
    free(f->meta_vals);
    memset(f, 0, sizeof *f);
}

static int cmp_name_key(const void *key, const void *elem) {
    return strcmp((const char *)key, ((const tera_st_tensor *)elem)->name);
}

const tera_st_tensor *tera_st_find(const tera_st_file *f, const char *name) {
    if (f->n == 0) return NULL;
    return bsearch(name, f->tensors, (size_t)f->n, sizeof *f->tensors, cmp_name_key);
}

const char *tera_st_meta(const tera_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_vals[i];
    return NULL;
}

static void convert_to_f32(const tera_st_tensor *t, const uint8_t *src, float *dst) {
    const int64_t n = t->numel;
    switch (t->dtype) {
    case TERA_DT_F32:
        for (int64_t i = 0; i < n; i++) dst[i] = bits_to_f32(load_u32(src + 4 * i));
        break;
    case TERA_DT_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(load_u16(src + 2 * i));
        break;
    case TERA_DT_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(load_u16(src + 2 * i));
        break;
    case TERA_DT_F64:
        for (int64_t i = 0; i < n; i++) {
            uint64_t u = load_u64(src + 8 * i);
            double d;
            memcpy(&d, &u, sizeof d);
            dst[i] = (float)d;
        }
        break;
    default: TERA_ASSERT(0 && "convert_to_f32: dtype checked by the caller");
    }
}

tera_status tera_st_read_f32(const tera_st_file *f, const char *name, int ndim, const int64_t *shape, float *dst) {
    const tera_st_tensor *t = tera_st_find(f, name);
    if (!t) return tera_fail(TERA_ERR_FORMAT, "%s: no tensor '%s'", f->path, name);
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char a[256], b[256];
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s", f->path, name,
                         shape_str(a, sizeof a, t->ndim, t->shape), shape_str(b, sizeof b, ndim, shape));
    }
    if (t->dtype != TERA_DT_F32 && t->dtype != TERA_DT_F16 && t->dtype != TERA_DT_BF16 && t->dtype != TERA_DT_F64)
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s' has dtype %s, which cannot be read as float", f->path, name,
                         tera_dtype_name(t->dtype));
    convert_to_f32(t, f->data + t->begin, dst);
    /* a NaN or infinity is never a usable weight, moment or bias: refuse it here, where the file and
     * the tensor are known, rather than let every step of a run be skipped */
    for (int64_t i = 0; i < t->numel; i++)
        if (!isfinite(dst[i]))
            return tera_fail(TERA_ERR_NUMERIC,
                             "%s: tensor '%s' holds a non-finite value (%s at element %lld of %lld); refusing to "
                             "load it (the file was written after the values diverged, or is damaged)",
                             f->path, name, isnan(dst[i]) ? "NaN" : dst[i] > 0 ? "+inf" : "-inf", (long long)i,
                             (long long)t->numel);
    return TERA_OK;
}

/* -------------------------------------------------------------------------------- writer -- */

void tera_st_writer_init(tera_st_writer *w) { memset(w, 0, sizeof *w); }

void tera_st_writer_free(tera_st_writer *w) {
    for (int i = 0; i < w->n; i++) free((char *)w->entries[i].name);
    free(w->entries);
    for (int i = 0; i < w->n_meta; i++) {
        free(w->meta_keys[i]);
        free(w->meta_vals[i]);
    }
    free(w->meta_keys);
    free(w->meta_vals);
    memset(w, 0, sizeof *w);
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = tera_malloc(n);
    memcpy(d, s, n);
    return d;
}

void tera_st_writer_add(tera_st_writer *w, const char *name, tera_dtype dt, int ndim, const int64_t *shape,
                        const void *data) {
    TERA_ASSERTF(dt >= 0 && dt < TERA_DT_COUNT, "tensor '%s': bad dtype %d", name, (int)dt);
    TERA_ASSERTF(ndim >= 0 && ndim <= TERA_ST_MAX_DIMS, "tensor '%s': %d dims", name, ndim);
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 64;
        tera_st_entry *ne = tera_malloc(sizeof(*ne) * (size_t)w->cap);
        if (w->n) memcpy(ne, w->entries, sizeof(*ne) * (size_t)w->n);
        free(w->entries);
        w->entries = ne;
    }
    tera_st_entry *e = &w->entries[w->n++];
    memset(e, 0, sizeof *e);
    e->name = dup_str(name);
    e->dtype = dt;
    e->ndim = ndim;
    uint64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        TERA_ASSERTF(shape[i] >= 0, "tensor '%s': negative dim", name);
        e->shape[i] = shape[i];
        numel *= (uint64_t)shape[i];
    }
    e->data = data;
    e->nbytes = numel * tera_dtype_size(dt);
    TERA_ASSERTF(e->nbytes == 0 || data, "tensor '%s': NULL data", name);
}

void tera_st_writer_meta(tera_st_writer *w, const char *key, const char *value) {
    char **nk = tera_malloc(sizeof(char *) * (size_t)(w->n_meta + 1));
    char **nv = tera_malloc(sizeof(char *) * (size_t)(w->n_meta + 1));
    if (w->n_meta) {
        memcpy(nk, w->meta_keys, sizeof(char *) * (size_t)w->n_meta);
        memcpy(nv, w->meta_vals, sizeof(char *) * (size_t)w->n_meta);
    }
    free(w->meta_keys);
    free(w->meta_vals);
    w->meta_keys = nk;
    w->meta_vals = nv;
    w->meta_keys[w->n_meta] = dup_str(key);
    w->meta_vals[w->n_meta] = dup_str(value);
    w->n_meta++;
}

static int cmp_entry_ptr(const void *a, const void *b) {
    return strcmp((*(const tera_st_entry *const *)a)->name, (*(const tera_st_entry *const *)b)->name);
}

/* Entry pointers sorted by name; NULL (with a message) on a duplicate name. Caller frees. */
static const tera_st_entry **sorted_entries(const tera_st_entry *e, int n, const char *path) {
    const tera_st_entry **s = tera_malloc(sizeof(*s) * (size_t)(n ? n : 1));
    for (int i = 0; i < n; i++) s[i] = &e[i];
    qsort(s, (size_t)n, sizeof *s, cmp_entry_ptr);
    for (int i = 1; i < n; i++) {
        if (strcmp(s[i - 1]->name, s[i]->name) == 0) {
            tera_fail(TERA_ERR_ARG, "%s: tensor '%s' added twice", path, s[i]->name);
            free(s);
            return NULL;
        }
    }
    return s;
}

/* An exact integer as a raw JSON number (cJSON's doubles would print large ones in exponent form). */
static cJSON *json_int(uint64_t v) {
    char b[32];
    snprintf(b, sizeof b, "%" PRIu64, v);
    return cJSON_CreateRaw(b);
}

/* Adds item to an object (key) or array (key NULL); 0 when item is NULL or adding failed, in which
 * case item is freed. Callers attach containers before filling them so nothing leaks on failure. */
static int json_put(cJSON *obj, const char *key, cJSON *item) {
    if (!item) return 0;
    if (key ? cJSON_AddItemToObject(obj, key, item) : cJSON_AddItemToArray(obj, item)) return 1;
    cJSON_Delete(item);
    return 0;
}

static cJSON *header_entry(const tera_st_entry *e, uint64_t begin) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON *sh = cJSON_CreateArray(), *off = cJSON_CreateArray();
    int ok = json_put(o, "dtype", cJSON_CreateString(tera_dtype_name(e->dtype)));
    ok &= json_put(o, "shape", sh);
    ok &= json_put(o, "data_offsets", off);
    for (int d = 0; ok && d < e->ndim; d++) ok = json_put(sh, NULL, json_int((uint64_t)e->shape[d]));
    ok = ok && json_put(off, NULL, json_int(begin)) && json_put(off, NULL, json_int(begin + e->nbytes));
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

/* Header JSON (unformatted, space-padded so 8 + its length is a multiple of 8). Caller frees. */
static char *build_header(const tera_st_writer *w, const tera_st_entry **s, size_t *len) {
    cJSON *root = cJSON_CreateObject();
    int ok = root != NULL;
    if (ok && w->n_meta > 0) {
        cJSON *m = cJSON_CreateObject();
        ok = json_put(root, "__metadata__", m);
        for (int i = 0; i < w->n_meta && ok; i++)
            ok = json_put(m, w->meta_keys[i], cJSON_CreateString(w->meta_vals[i]));
    }
    uint64_t off = 0;
    for (int i = 0; ok && i < w->n; i++) {
        ok = json_put(root, s[i]->name, header_entry(s[i], off));
        off += s[i]->nbytes;
    }
    char *js = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!js) return NULL;
    size_t n = strlen(js), padded = (n + 7) & ~(size_t)7;
    char *out = tera_malloc(padded + 1);
    memcpy(out, js, n);
    memset(out + n, ' ', padded - n);
    out[padded] = '\0';
    cJSON_free(js);
    *len = padded;
    return out;
}

/* One piece of a file's contents. */
typedef struct {
    const void *p;
    uint64_t n;
} st_chunk;

static int write_all(int fd, const void *p, uint64_t n) {
    const uint8_t *b = p;
    while (n > 0) {
        size_t step = n > (1u << 30) ? (1u << 30) : (size_t)n;
        ssize_t k = write(fd, b, step);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        b += k;
        n -= (uint64_t)k;
    }
    return 0;
}

/* fsync of the directory holding path, so a rename into it is durable. */
static int fsync_parent(const char *path) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = '\0';
    else *slash = '\0';
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    int r = fsync(fd);
    close(fd);
    return r;
}

/* Writes chunks to PATH.tmp, fsyncs, renames over PATH, fsyncs the directory. Never leaves a partial
 * PATH; on failure PATH.tmp is removed and PATH is untouched. */
static tera_status write_atomic(const char *path, const st_chunk *c, int nc) {
    char tmp[1100];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp)
        return tera_fail(TERA_ERR_IO, "%s: path too long", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return tera_fail(TERA_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    int err = 0;
    for (int i = 0; i < nc && !err; i++)
        if (write_all(fd, c[i].p, c[i].n) != 0) err = errno ? errno : EIO;
    if (!err && fsync(fd) != 0) err = errno;
    if (close(fd) != 0 && !err) err = errno;
    if (!err && rename(tmp, path) != 0) err = errno;
    if (err) {
        unlink(tmp);
        return tera_fail(TERA_ERR_IO, "%s: write failed: %s", path, strerror(err));
    }
    if (fsync_parent(path) != 0)
        return tera_fail(TERA_ERR_IO, "%s: fsync of its directory failed: %s", path, strerror(errno));
    return TERA_OK;
}

/* Writes the n entries s[0..n) (already sorted, unique) with w's metadata to path. */
static tera_status save_sorted(const tera_st_writer *w, const tera_st_entry **s, int n, const char *path) {
    tera_st_writer sub = *w;
    sub.n = n;
    size_t hlen = 0;
    char *hdr = build_header(&sub, s, &hlen);
    if (!hdr) return tera_fail(TERA_ERR_NOMEM, "%s: out of memory building the header", path);
    uint8_t len8[8];
    store_u64(len8, hlen);
    st_chunk *c = tera_malloc(sizeof(*c) * (size_t)(n + 2));
    c[0] = (st_chunk){len8, 8};
    c[1] = (st_chunk){hdr, hlen};
    for (int i = 0; i < n; i++) c[i + 2] = (st_chunk){s[i]->data, s[i]->nbytes};
    tera_status st = write_atomic(path, c, n + 2);
    free(c);
    free(hdr);
    return st;
}

tera_status tera_st_writer_save(const tera_st_writer *w, const char *path) {
    const tera_st_entry **s = sorted_entries(w->entries, w->n, path);
    if (!s) return TERA_ERR_ARG;
    tera_status st = save_sorted(w, s, w->n, path);
    free(s);
    return st;
}

static tera_status join_path(char *out, size_t cap, const char *dir, const char *name) {
    if ((size_t)snprintf(out, cap, "%s/%s", dir, name) >= cap)
        return tera_fail(TERA_ERR_IO, "%s/%s: path too long", dir, name);
    return TERA_OK;
}

/* model.safetensors.index.json for shards: entry i goes to file shard_of[i] (1-based) of n_shards. */
static tera_status save_index(const char *dir, const tera_st_entry **s, int n, const int *shard_of, int n_shards) {
    uint64_t total = 0;
    for (int i = 0; i < n; i++) total += s[i]->nbytes;
    cJSON *root = cJSON_CreateObject();
    int ok = root != NULL;
    cJSON *meta = ok ? cJSON_CreateObject() : NULL, *map = ok ? cJSON_CreateObject() : NULL;
    if (ok) {
        ok = json_put(root, "metadata", meta);
        ok &= json_put(root, "weight_map", map);
    }
    ok = ok && json_put(meta, "total_size", json_int(total));
    char fname[64];
    for (int i = 0; ok && i < n; i++) {
        snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", shard_of[i], n_shards);
        ok = json_put(map, s[i]->name, cJSON_CreateString(fname));
    }
    char *js = ok ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!js) return tera_fail(TERA_ERR_NOMEM, "%s/%s: out of memory", dir, ST_INDEX_NAME);
    char path[1100];
    tera_status st = join_path(path, sizeof path, dir, ST_INDEX_NAME);
    if (st == TERA_OK) {
        st_chunk c[2] = {{js, strlen(js)}, {"\n", 1}};
        st = write_atomic(path, c, 2);
    }
    cJSON_free(js);
    return st;
}

/* Greedy assignment of sorted entries to shards (1-based); returns the shard count. */
static int assign_shards(const tera_st_entry **s, int n, int64_t max_bytes, int *shard_of) {
    int shard = 1;
    uint64_t fill = 0;
    for (int i = 0; i < n; i++) {
        if (fill > 0 && fill + s[i]->nbytes > (uint64_t)max_bytes) {
            shard++;
            fill = 0;
        }
        shard_of[i] = shard;
        fill += s[i]->nbytes;
    }
    return shard;
}

static tera_status save_shards(const tera_st_writer *w, const tera_st_entry **s, const char *dir, int64_t max_bytes,
                               int *n_out) {
    int *shard_of = tera_malloc(sizeof(int) * (size_t)(w->n ? w->n : 1));
    const int n_shards = assign_shards(s, w->n, max_bytes, shard_of);
    *n_out = n_shards;
    tera_status st = TERA_OK;
    if (n_shards > 99999) st = tera_fail(TERA_ERR_ARG, "%s: %d shards exceed 99999", dir, n_shards);
    for (int i = 0, sh = 1; st == TERA_OK && sh <= n_shards; sh++) {
        int j = i;
        while (j < w->n && shard_of[j] == sh) j++;
        char name[64], path[1100];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", sh, n_shards);
        st = join_path(path, sizeof path, dir, name);
        if (st == TERA_OK) st = save_sorted(w, s + i, j - i, path);
        i = j;
    }
    /* the index goes last: a reader never sees it naming shards that are not yet written */
    if (st == TERA_OK) st = save_index(dir, s, w->n, shard_of, n_shards);
    free(shard_of);
    return st;
}

/* After a save of n_shards shards (0: the single model.safetensors), the model files of an earlier
 * save into the same directory that the new one does not name (a directory replaced by an export
 * with --force): shards of another count, and model.safetensors beside shards. Only names of this
 * writer's pattern are touched. */
static tera_status remove_stale(const char *dir, int n_shards) {
    DIR *d = opendir(dir);
    if (!d) return tera_fail(TERA_ERR_IO, "%s: cannot open directory: %s", dir, strerror(errno));
    tera_status st = TERA_OK;
    for (struct dirent *e; st == TERA_OK && (e = readdir(d));) {
        int sh = 0, of = 0, len = 0;
        const int shard = sscanf(e->d_name, "model-%5d-of-%5d.safetensors%n", &sh, &of, &len) == 2 &&
                          e->d_name[len] == 0 && strlen(e->d_name) == 32; /* model-NNNNN-of-NNNNN.safetensors */
        const int stale = shard ? of != n_shards : n_shards > 0 && !strcmp(e->d_name, "model.safetensors");
        char path[1100];
        if (!stale || join_path(path, sizeof path, dir, e->d_name) != TERA_OK) continue;
        if (unlink(path) != 0 && errno != ENOENT)
            st = tera_fail(TERA_ERR_IO, "%s: cannot remove the earlier save's file: %s", path, strerror(errno));
    }
    closedir(d);
    return st;
}

tera_status tera_st_writer_save_dir(const tera_st_writer *w, const char *dir, int64_t max_shard_bytes) {
    const tera_st_entry **s = sorted_entries(w->entries, w->n, dir);
    if (!s) return TERA_ERR_ARG;
    uint64_t total = 0;
    for (int i = 0; i < w->n; i++) total += s[i]->nbytes;
    tera_status st;
    char path[1100];
    if (max_shard_bytes > 0 && total > (uint64_t)max_shard_bytes) {
        int n_shards = 0;
        st = save_shards(w, s, dir, max_shard_bytes, &n_shards);
        if (st == TERA_OK) st = remove_stale(dir, n_shards);
    } else {
        st = join_path(path, sizeof path, dir, "model.safetensors");
        if (st == TERA_OK) st = save_sorted(w, s, w->n, path);
        /* a stale index would take precedence over the new single file when reading */
        if (st == TERA_OK && join_path(path, sizeof path, dir, ST_INDEX_NAME) == TERA_OK && unlink(path) != 0 &&
            errno != ENOENT)
            st = tera_fail(TERA_ERR_IO, "%s: cannot remove stale index: %s", path, strerror(errno));
        if (st == TERA_OK) st = remove_stale(dir, 0);
    }
    free(s);
    return st;
}

/* ----------------------------------------------------------------------------------- sets -- */

/* One weight_map entry. */
typedef struct {
    const char *name; /* tensor name (owned by the cJSON tree) */
    const char *file; /* file name inside the directory */
} st_map_entry;

static int cmp_map_entry(const void *a, const void *b) {
    return strcmp(((const st_map_entry *)a)->name, ((const st_map_entry *)b)->name);
}

static int cmp_str_ptr(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* weight_map into a sorted array of entries (pointing into the cJSON tree). */
static tera_status index_entries(const char *ipath, const cJSON *root, st_map_entry **out, int *n_out) {
    const cJSON *map = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!cJSON_IsObject(map)) return tera_fail(TERA_ERR_FORMAT, "%s: \"weight_map\" is missing or not an object", ipath);
    int n = 0;
    st_map_entry *e = tera_malloc(sizeof(*e) * (size_t)(cJSON_GetArraySize(map) + 1));
    const cJSON *it;
    cJSON_ArrayForEach(it, map) {
        if (!cJSON_IsString(it) || !it->valuestring[0] || strchr(it->valuestring, '/')) {
            free(e);
            return tera_fail(TERA_ERR_FORMAT, "%s: weight_map entry '%s' is not a file name in the directory", ipath,
                             it->string);
        }
        e[n++] = (st_map_entry){it->string, it->valuestring};
    }
    qsort(e, (size_t)n, sizeof *e, cmp_map_entry);
    for (int i = 1; i < n; i++) {
        if (strcmp(e[i - 1].name, e[i].name) == 0) {
            tera_status s = tera_fail(TERA_ERR_FORMAT, "%s: weight_map names tensor '%s' twice", ipath, e[i].name);
            free(e);
            return s;
        }
    }
    *out = e;
    *n_out = n;
    return TERA_OK;
}

/* Opens file `fname` of dir and checks it holds exactly the tensors the index maps to it. */
static tera_status open_indexed(tera_st_file *f, const char *dir, const char *ipath, const char *fname,
                                const st_map_entry *e, int n) {
    char path[1100];
    struct stat st;
    TERA_TRY(join_path(path, sizeof path, dir, fname));
    if (stat(path, &st) != 0)
        return tera_fail(TERA_ERR_FORMAT, "%s: names file '%s', but %s does not exist", ipath, fname, path);
    TERA_TRY(tera_st_open(f, path));
    int mapped = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(e[i].file, fname) != 0) continue;
        mapped++;
        if (!tera_st_find(f, e[i].name))
            return tera_fail(TERA_ERR_FORMAT, "%s: maps tensor '%s' to %s, which does not contain it", ipath,
                             e[i].name, path);
    }
    for (int i = 0; mapped != f->n && i < f->n; i++) {
        st_map_entry key = {f->tensors[i].name, NULL};
        const st_map_entry *m = bsearch(&key, e, (size_t)n, sizeof *e, cmp_map_entry);
        if (!m || strcmp(m->file, fname) != 0)
            return tera_fail(TERA_ERR_FORMAT, "%s: holds tensor '%s', which %s does not map to it", path,
                             f->tensors[i].name, ipath);
    }
    return TERA_OK;
}

static tera_status open_index_set(tera_st_set *s, const char *dir, const char *ipath) {
    char *text = NULL;
    TERA_TRY(tera_read_text_file(ipath, &text));
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root) return tera_fail(TERA_ERR_FORMAT, "%s: not valid JSON", ipath);
    st_map_entry *e = NULL;
    int n = 0;
    tera_status st = index_entries(ipath, root, &e, &n);
    if (st == TERA_OK) {
        /* distinct file names, in order */
        const char **files = tera_malloc(sizeof(char *) * (size_t)(n ? n : 1));
        int nf = 0;
        for (int i = 0; i < n; i++) files[i] = e[i].file;
        qsort(files, (size_t)n, sizeof *files, cmp_str_ptr);
        for (int i = 0; i < n; i++)
            if (nf == 0 || strcmp(files[nf - 1], files[i]) != 0) files[nf++] = files[i];
        s->files = tera_calloc((size_t)(nf ? nf : 1), sizeof(tera_st_file));
        for (int i = 0; i < nf && st == TERA_OK; i++) {
            st = open_indexed(&s->files[i], dir, ipath, files[i], e, n);
            s->n_files = i + (st == TERA_OK);
            if (st != TERA_OK) tera_st_close(&s->files[i]);
        }
        free(files);
    }
    free(e);
    cJSON_Delete(root);
    return st;
}

tera_status tera_st_set_open(tera_st_set *s, const char *dir) {
    memset(s, 0, sizeof *s);
    char ipath[1100], spath[1100];
    struct stat st;
    TERA_TRY(join_path(ipath, sizeof ipath, dir, ST_INDEX_NAME));
    TERA_TRY(join_path(spath, sizeof spath, dir, "model.safetensors"));
    tera_status r;
    if (stat(ipath, &st) == 0) {
        r = open_index_set(s, dir, ipath);
    } else if (stat(spath, &st) == 0) {
        s->files = tera_calloc(1, sizeof(tera_st_file));
        r = tera_st_open(&s->files[0], spath);
        s->n_files = r == TERA_OK;
    } else {
        r = tera_fail(TERA_ERR_IO, "%s: neither model.safetensors nor %s exists", dir, ST_INDEX_NAME);
    }
    if (r != TERA_OK) tera_st_set_close(s);
    return r;
}

void tera_st_set_close(tera_st_set *s) {
    for (int i = 0; i < s->n_files; i++) tera_st_close(&s->files[i]);
    free(s->files);
    memset(s, 0, sizeof *s);
}

const tera_st_file *tera_st_set_find(const tera_st_set *s, const char *name) {
    for (int i = 0; i < s->n_files; i++)
        if (tera_st_find(&s->files[i], name)) return &s->files[i];
    return NULL;
}

tera_status tera_st_set_read_f32(const tera_st_set *s, const char *name, int ndim, const int64_t *shape, float *dst) {
    const tera_st_file *f = tera_st_set_find(s, name);
    if (!f)
        return tera_fail(TERA_ERR_FORMAT, "tensor '%s' is in none of the %d safetensors files%s%s", name, s->n_files,
                         s->n_files ? " starting with " : "", s->n_files ? s->files[0].path : "");
    return tera_st_read_f32(f, name, ndim, shape, dst);
}

/* ------------------------------------------------------------------------------ streaming -- */

struct tera_st_stream {
    const tera_st_writer *w;
    const tera_st_entry **sorted;
    int n_files;
    int *fds;
    char (*paths)[1100];
    int *file_of;           /* [w->n] by insertion index */
    uint64_t *off_of;       /* absolute byte offset of the entry's data in its file */
    int *shard_of;          /* [w->n] by sorted position (1-based), for the index */
    int is_dir, indexed;
    char dir[1024];
};

static int entry_index(const tera_st_writer *w, const tera_st_entry *e) { return (int)(e - w->entries); }

void tera_st_stream_abort(tera_st_stream *s) {
    if (!s) return;
    char tmp[1200];
    for (int f = 0; f < s->n_files; f++) {
        if (s->fds[f] >= 0) close(s->fds[f]);
        snprintf(tmp, sizeof tmp, "%s.tmp", s->paths[f]);
        unlink(tmp);
    }
    free(s->sorted);
    free(s->fds);
    free(s->paths);
    free(s->file_of);
    free(s->off_of);
    free(s->shard_of);
    free(s);
}

tera_status tera_st_stream_open(tera_st_stream **out, const tera_st_writer *w, const char *path, int is_dir,
                                int64_t max_shard_bytes) {
    *out = NULL;
    const tera_st_entry **srt = sorted_entries(w->entries, w->n, path);
    if (!srt) return TERA_ERR_ARG;
    tera_st_stream *s = tera_calloc(1, sizeof *s);
    s->w = w;
    s->sorted = srt;
    s->is_dir = is_dir;
    snprintf(s->dir, sizeof s->dir, "%s", path);
    const int n = w->n;
    s->file_of = tera_calloc((size_t)n + 1, sizeof(int));
    s->off_of = tera_calloc((size_t)n + 1, sizeof(uint64_t));
    s->shard_of = tera_calloc((size_t)n + 1, sizeof(int));
    uint64_t total = 0;
    for (int i = 0; i < n; i++) total += srt[i]->nbytes;
    s->indexed = is_dir && max_shard_bytes > 0 && total > (uint64_t)max_shard_bytes;
    s->n_files = s->indexed ? assign_shards(srt, n, max_shard_bytes, s->shard_of) : 1;
    if (!s->indexed)
        for (int i = 0; i < n; i++) s->shard_of[i] = 1;
    s->fds = tera_malloc(sizeof(int) * (size_t)s->n_files);
    s->paths = tera_calloc((size_t)s->n_files, sizeof *s->paths);
    for (int f = 0; f < s->n_files; f++) s->fds[f] = -1;
    tera_status st = TERA_OK;
    if (s->n_files > 99999) st = tera_fail(TERA_ERR_ARG, "%s: %d shards exceed 99999", path, s->n_files);
    for (int f = 0, i = 0; st == TERA_OK && f < s->n_files; f++) {
        char name[64];
        if (s->indexed) snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", f + 1, s->n_files);
        if (!is_dir) snprintf(s->paths[f], sizeof s->paths[f], "%s", path);
        else st = join_path(s->paths[f], sizeof s->paths[f], path, s->indexed ? name : "model.safetensors");
        int j = i;
        while (j < n && s->shard_of[j] == f + 1) j++;
        if (st != TERA_OK) break;
        /* the header of entries [i, j), as save_sorted writes it */
        tera_st_writer sub = *w;
        sub.n = j - i;
        size_t hlen = 0;
        char *hdr = build_header(&sub, srt + i, &hlen);
        if (!hdr) {
            st = tera_fail(TERA_ERR_NOMEM, "%s: out of memory building the header", s->paths[f]);
            break;
        }
        uint64_t at = 8 + hlen;
        for (int k = i; k < j; k++) {
            const int e = entry_index(w, srt[k]);
            s->file_of[e] = f;
            s->off_of[e] = at;
            at += srt[k]->nbytes;
        }
        char tmp[1200];
        snprintf(tmp, sizeof tmp, "%s.tmp", s->paths[f]);
        s->fds[f] = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        uint8_t len8[8];
        store_u64(len8, hlen);
        int err = s->fds[f] < 0 ? errno : 0;
        if (!err && (write_all(s->fds[f], len8, 8) != 0 || write_all(s->fds[f], hdr, hlen) != 0)) err = errno ? errno : EIO;
        if (!err && ftruncate(s->fds[f], (off_t)at) != 0) err = errno;
        free(hdr);
        if (err) st = tera_fail(TERA_ERR_IO, "%s: cannot create: %s", tmp, strerror(err));
        i = j;
    }
    if (st != TERA_OK) {
        tera_st_stream_abort(s);
        return st;
    }
    *out = s;
    return TERA_OK;
}

tera_status tera_st_stream_write(tera_st_stream *s, int entry, uint64_t byte_off, const void *p, uint64_t n) {
    TERA_ASSERTF(entry >= 0 && entry < s->w->n && byte_off + n <= s->w->entries[entry].nbytes,
                 "safetensors stream: entry %d, bytes [%llu, %llu) out of range", entry, (unsigned long long)byte_off,
                 (unsigned long long)(byte_off + n));
    const int fd = s->fds[s->file_of[entry]];
    const uint8_t *b = p;
    uint64_t at = s->off_of[entry] + byte_off;
    while (n > 0) {
        const size_t step = n > (1u << 30) ? (1u << 30) : (size_t)n;
        const ssize_t k = pwrite(fd, b, step, (off_t)at);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            return tera_fail(TERA_ERR_IO, "%s.tmp: write failed: %s", s->paths[s->file_of[entry]],
                             strerror(errno ? errno : EIO));
        b += k, at += (uint64_t)k, n -= (uint64_t)k;
    }
    return TERA_OK;
}

tera_status tera_st_stream_finish(tera_st_stream *s) {
    tera_status st = TERA_OK;
    char tmp[1200];
    for (int f = 0; f < s->n_files && st == TERA_OK; f++) {
        snprintf(tmp, sizeof tmp, "%s.tmp", s->paths[f]);
        int err = fsync(s->fds[f]) != 0 ? errno : 0;
        if (close(s->fds[f]) != 0 && !err) err = errno;
        s->fds[f] = -1;
        if (!err && rename(tmp, s->paths[f]) != 0) err = errno;
        if (err) st = tera_fail(TERA_ERR_IO, "%s: write failed: %s", s->paths[f], strerror(err));
        else if (fsync_parent(s->paths[f]) != 0)
            st = tera_fail(TERA_ERR_IO, "%s: fsync of its directory failed: %s", s->paths[f], strerror(errno));
    }
    char path[1100];
    if (st == TERA_OK && s->indexed) st = save_index(s->dir, s->sorted, s->w->n, s->shard_of, s->n_files);
    else if (st == TERA_OK && s->is_dir && join_path(path, sizeof path, s->dir, ST_INDEX_NAME) == TERA_OK &&
             unlink(path) != 0 && errno != ENOENT)
        st = tera_fail(TERA_ERR_IO, "%s: cannot remove stale index: %s", path, strerror(errno));
    if (st == TERA_OK && s->is_dir) st = remove_stale(s->dir, s->indexed ? s->n_files : 0);
    tera_st_stream_abort(s); /* frees (the renamed files are no longer .tmp) */
    return st;
}

tera_status tera_st_read_range_f32(const tera_st_file *f, int fd, const char *name, int64_t lo, int64_t n,
                                   float *dst) {
    const tera_st_tensor *t = tera_st_find(f, name);
    if (!t) return tera_fail(TERA_ERR_FORMAT, "%s: no tensor '%s'", f->path, name);
    if (lo < 0 || n < 0 || lo + n > t->numel)
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s' has %lld elements, elements [%lld, %lld) were asked for",
                         f->path, name, (long long)t->numel, (long long)lo, (long long)(lo + n));
    if (t->dtype != TERA_DT_F32 && t->dtype != TERA_DT_F16 && t->dtype != TERA_DT_BF16 && t->dtype != TERA_DT_F64)
        return tera_fail(TERA_ERR_FORMAT, "%s: tensor '%s' has dtype %s, which cannot be read as float", f->path, name,
                         tera_dtype_name(t->dtype));
    const size_t es = tera_dtype_size(t->dtype);
    const uint64_t base = (uint64_t)(f->data - (const uint8_t *)f->map) + t->begin;
    enum { CH = 4096 };
    uint8_t raw[CH * 8];
    for (int64_t done = 0; done < n;) {
        const int64_t k = n - done < CH ? n - done : CH;
        const uint8_t *src = f->data + t->begin + (uint64_t)(lo + done) * es;
        if (fd >= 0) { /* read(2): the rank's pieces only, nothing of the file stays resident */
            size_t got = 0;
            const size_t want = (size_t)k * es;
            while (got < want) {
                const ssize_t r = pread(fd, raw + got, want - got, (off_t)(base + (uint64_t)(lo + done) * es + got));
                if (r < 0 && errno == EINTR) continue;
                if (r <= 0) return tera_fail(TERA_ERR_IO, "%s: read failed: %s", f->path, r < 0 ? strerror(errno) : "short file");
                got += (size_t)r;
            }
            src = raw;
        }
        tera_st_tensor part = *t;
        part.numel = k;
        convert_to_f32(&part, src, dst + done);
        for (int64_t i = 0; i < k; i++)
            if (!isfinite(dst[done + i]))
                return tera_fail(TERA_ERR_NUMERIC,
                                 "%s: tensor '%s' holds a non-finite value (%s at element %lld of %lld); refusing to "
                                 "load it (the file was written after the values diverged, or is damaged)",
                                 f->path, name, isnan(dst[done + i]) ? "NaN" : dst[done + i] > 0 ? "+inf" : "-inf",
                                 (long long)(lo + done + i), (long long)t->numel);
        done += k;
    }
    return TERA_OK;
}
