/* safetensors reader/writer: round trips, conversions, every malformed header the reader must refuse,
 * truncation at every length, sharded sets and their index, atomic replacement. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tera/safetensors.h"

#ifndef TERA_SOURCE_DIR
#define TERA_SOURCE_DIR "."
#endif

/* ------------------------------------------------------------------------------- helpers -- */

static char g_dir[256]; /* per-test temporary directory */

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static int setup_dir(void **state) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tera_st_XXXXXX");
    assert_non_null(mkdtemp(g_dir));
    return 0;
}

static int teardown_dir(void **state) {
    nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}

static const char *in_dir(const char *name) {
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

static int exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static uint8_t *read_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    assert_non_null(b);
    if (sz) assert_int_equal(fread(b, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    *n = (size_t)sz;
    return b;
}

/* A safetensors file from a header (length hlen, or strlen) and data_len bytes of data (0x5a). */
static void write_st(const char *path, uint64_t hlen_field, const char *hdr, size_t data_len) {
    size_t h = strlen(hdr), n = 8 + h + data_len;
    uint8_t *b = malloc(n);
    assert_non_null(b);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(hlen_field >> (8 * i));
    memcpy(b + 8, hdr, h);
    memset(b + 8 + h, 0x5a, data_len);
    write_bytes(path, b, n);
    free(b);
}

static void expect_error(tera_status got, tera_status want, const char *path, const char *needle) {
    const char *msg = tera_last_error();
    if (got != want || !strstr(msg, path) || (needle && !strstr(msg, needle)))
        fail_msg("status %d (want %d), message \"%s\" should name \"%s\" and contain \"%s\"", (int)got, (int)want, msg,
                 path, needle ? needle : "");
}

/* ---------------------------------------------------------------------------- round trip -- */

static void test_roundtrip_dtypes(void **state) {
    const float f32[6] = {1.5f, -2.25f, 0.0f, 3e-8f, 1e30f, -0.0f};
    const double f64[4] = {1.0, -1.0 / 3.0, 1e-300, 12345.678};
    const uint16_t f16[3] = {0x3c00, 0xc000, 0x3555};   /* 1, -2, 0.333251953125 */
    const uint16_t bf16[4] = {0x3f80, 0xc040, 0x4049, 0}; /* 1, -3, 3.140625, 0 */
    const int32_t i32[5] = {1, -2, 3, -4, 2147483647};
    const uint8_t u8[7] = {1, 2, 3, 4, 5, 6, 255};
    const uint8_t bools[3] = {1, 0, 1};
    const int64_t i64[1] = {-9000000000000000000LL};
    const float scalar = 42.0f, empty_dummy = 0;
    const int64_t s23[] = {2, 3}, s4[] = {4}, s3[] = {3}, s22[] = {2, 2}, s5[] = {5}, s7[] = {7}, s111[] = {1, 1, 1},
                  s04[] = {0, 4};

    tera_st_writer w;
    tera_st_writer_init(&w);
    tera_st_writer_add(&w, "f32", TERA_DT_F32, 2, s23, f32);
    tera_st_writer_add(&w, "f64", TERA_DT_F64, 1, s4, f64);
    tera_st_writer_add(&w, "f16", TERA_DT_F16, 1, s3, f16);
    tera_st_writer_add(&w, "bf16", TERA_DT_BF16, 2, s22, bf16);
    tera_st_writer_add(&w, "i32", TERA_DT_I32, 1, s5, i32);
    tera_st_writer_add(&w, "u8", TERA_DT_U8, 1, s7, u8);
    tera_st_writer_add(&w, "bool", TERA_DT_BOOL, 1, s3, bools);
    tera_st_writer_add(&w, "i64", TERA_DT_I64, 3, s111, i64);
    tera_st_writer_add(&w, "scalar", TERA_DT_F32, 0, NULL, &scalar);
    tera_st_writer_add(&w, "empty", TERA_DT_F32, 2, s04, &empty_dummy);
    const char *path = in_dir("rt.safetensors");
    assert_int_equal(tera_st_writer_save(&w, path), TERA_OK);
    tera_st_writer_free(&w);
    assert_false(exists(in_dir("rt.safetensors.tmp")));

    /* header length is a multiple of 8, padded with spaces, no __metadata__ when there is none */
    size_t n;
    uint8_t *raw = read_bytes(path, &n);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)raw[i] << (8 * i);
    assert_int_equal(hlen % 8, 0);
    assert_true(raw[8] == '{');
    char *hdr = strndup((const char *)raw + 8, hlen);
    assert_null(strstr(hdr, "__metadata__"));
    free(hdr);
    free(raw);

    tera_st_file f;
    assert_int_equal(tera_st_open(&f, path), TERA_OK);
    assert_int_equal(f.n, 10);
    for (int i = 1; i < f.n; i++) assert_true(strcmp(f.tensors[i - 1].name, f.tensors[i].name) < 0);
    const tera_st_tensor *t = tera_st_find(&f, "i32");
    assert_non_null(t);
    assert_int_equal(t->dtype, TERA_DT_I32);
    assert_memory_equal(f.data + t->begin, i32, sizeof i32);
    t = tera_st_find(&f, "u8");
    assert_int_equal(t->end - t->begin, 7);
    assert_memory_equal(f.data + t->begin, u8, 7);
    t = tera_st_find(&f, "bool");
    assert_int_equal(t->dtype, TERA_DT_BOOL);
    assert_memory_equal(f.data + t->begin, bools, 3);
    t = tera_st_find(&f, "i64");
    assert_int_equal(t->ndim, 3);
    assert_memory_equal(f.data + t->begin, i64, 8);
    t = tera_st_find(&f, "scalar");
    assert_int_equal(t->ndim, 0);
    assert_int_equal(t->numel, 1);
    t = tera_st_find(&f, "empty");
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->numel, 0);
    assert_int_equal(t->begin, t->end);
    assert_null(tera_st_find(&f, "nope"));
    assert_null(tera_st_find(&f, ""));

    float out[8];
    assert_int_equal(tera_st_read_f32(&f, "f32", 2, s23, out), TERA_OK);
    assert_memory_equal(out, f32, sizeof f32);
    assert_int_equal(tera_st_read_f32(&f, "f64", 1, s4, out), TERA_OK);
    for (int i = 0; i < 4; i++) assert_true(out[i] == (float)f64[i]);
    assert_int_equal(tera_st_read_f32(&f, "f16", 1, s3, out), TERA_OK);
    assert_true(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0.333251953125f);
    assert_int_equal(tera_st_read_f32(&f, "bf16", 2, s22, out), TERA_OK);
    assert_true(out[0] == 1.0f && out[1] == -3.0f && out[2] == 3.140625f && out[3] == 0.0f);
    assert_int_equal(tera_st_read_f32(&f, "scalar", 0, NULL, out), TERA_OK);
    assert_true(out[0] == 42.0f);
    assert_int_equal(tera_st_read_f32(&f, "empty", 2, s04, out), TERA_OK);
    expect_error(tera_st_read_f32(&f, "i32", 1, s5, out), TERA_ERR_FORMAT, path, "'i32'");
    expect_error(tera_st_read_f32(&f, "f32", 2, s22, out), TERA_ERR_FORMAT, path, "[2,3]");
    assert_non_null(strstr(tera_last_error(), "[2,2]"));
    expect_error(tera_st_read_f32(&f, "f32", 1, s23, out), TERA_ERR_FORMAT, path, "'f32'");
    expect_error(tera_st_read_f32(&f, "missing", 1, s5, out), TERA_ERR_FORMAT, path, "'missing'");
    tera_st_close(&f);
}

static void test_metadata(void **state) {
    const float v[2] = {1, 2};
    const int64_t s2[] = {2};
    tera_st_writer w;
    tera_st_writer_init(&w);
    tera_st_writer_add(&w, "x", TERA_DT_F32, 1, s2, v);
    tera_st_writer_meta(&w, "format", "pt");
    tera_st_writer_meta(&w, "note", "quote \" and \\ and unicode \xc3\xa9");
    const char *path = in_dir("meta.safetensors");
    assert_int_equal(tera_st_writer_save(&w, path), TERA_OK);
    tera_st_writer_free(&w);
    tera_st_file f;
    assert_int_equal(tera_st_open(&f, path), TERA_OK);
    assert_int_equal(f.n, 1);
    assert_int_equal(f.n_meta, 2);
    assert_string_equal(tera_st_meta(&f, "format"), "pt");
    assert_string_equal(tera_st_meta(&f, "note"), "quote \" and \\ and unicode \xc3\xa9");
    assert_null(tera_st_meta(&f, "absent"));
    tera_st_close(&f);
}

static void test_empty_file_set(void **state) {
    /* a file with no tensors at all is valid */
    tera_st_writer w;
    tera_st_writer_init(&w);
    const char *path = in_dir("none.safetensors");
    assert_int_equal(tera_st_writer_save(&w, path), TERA_OK);
    tera_st_writer_free(&w);
    tera_st_file f;
    assert_int_equal(tera_st_open(&f, path), TERA_OK);
    assert_int_equal(f.n, 0);
    assert_null(tera_st_find(&f, "x"));
    tera_st_close(&f);
}

static void test_writer_duplicate(void **state) {
    const float v = 1;
    tera_st_writer w;
    tera_st_writer_init(&w);
    tera_st_writer_add(&w, "dup", TERA_DT_F32, 0, NULL, &v);
    tera_st_writer_add(&w, "dup", TERA_DT_F32, 0, NULL, &v);
    const char *path = in_dir("dup.safetensors");
    expect_error(tera_st_writer_save(&w, path), TERA_ERR_ARG, path, "'dup'");
    tera_st_writer_free(&w);
    assert_false(exists(path));
}

/* ---------------------------------------------------------------------------- conversions -- */

static void test_f16_bf16_values(void **state) {
    static const struct {
        uint16_t bits;
        float want;
    } f16[] = {
        {0x0000, 0.0f},         {0x3c00, 1.0f},          {0xc000, -2.0f},        {0x7bff, 65504.0f},
        {0xfbff, -65504.0f},    {0x0001, 0x1p-24f},      {0x03ff, 1023 * 0x1p-24f}, {0x0400, 0x1p-14f},
        {0x8001, -0x1p-24f},    {0x3555, 0.333251953125f}, {0x3800, 0.5f},       {0x4248, 3.140625f},
    };
    static const struct {
        uint16_t bits;
        float want;
    } bf[] = {
        {0x3f80, 1.0f}, {0xc040, -3.0f}, {0x4049, 3.140625f}, {0x0001, 0x1p-133f}, {0x7f7f, 3.3895313892515355e38f}, {0x0080, 0x1p-126f},
    };
    enum { NF = sizeof f16 / sizeof f16[0], NB = sizeof bf / sizeof bf[0] };
    uint16_t a[NF + 1], b[NB];
    for (int i = 0; i < NF; i++) a[i] = f16[i].bits;
    a[NF] = 0x8000; /* -0 */
    for (int i = 0; i < NB; i++) b[i] = bf[i].bits;
    const int64_t sa[] = {NF + 1}, sb[] = {NB};
    /* non-finite values (F16/BF16/F32/F64 infinities and NaNs) are refused, naming file, tensor, element */
    static const uint16_t f16_bad[] = {0x7c00, 0xfc00, 0x7e00, 0x7c01}, bf_bad[] = {0x7f80, 0xff80, 0x7fc0};
    const float f32_bad[] = {NAN, INFINITY};
    const double f64_bad[] = {-INFINITY};
    tera_st_writer w;
    tera_st_writer_init(&w);
    tera_st_writer_add(&w, "h", TERA_DT_F16, 1, sa, a);
    tera_st_writer_add(&w, "b", TERA_DT_BF16, 1, sb, b);
    uint16_t hb[4][2], bb[3][2];
    static const char *const h_names[] = {"h_bad0", "h_bad1", "h_bad2", "h_bad3"};
    static const char *const b_names[] = {"b_bad0", "b_bad1", "b_bad2"};
    for (int i = 0; i < 4; i++) {
        hb[i][0] = 0x3c00, hb[i][1] = f16_bad[i];
        tera_st_writer_add(&w, h_names[i], TERA_DT_F16, 1, (const int64_t[]){2}, hb[i]);
    }
    for (int i = 0; i < 3; i++) {
        bb[i][0] = 0x3f80, bb[i][1] = bf_bad[i];
        tera_st_writer_add(&w, b_names[i], TERA_DT_BF16, 1, (const int64_t[]){2}, bb[i]);
    }
    tera_st_writer_add(&w, "f_bad0", TERA_DT_F32, 1, (const int64_t[]){1}, &f32_bad[0]);
    tera_st_writer_add(&w, "f_bad1", TERA_DT_F32, 1, (const int64_t[]){1}, &f32_bad[1]);
    tera_st_writer_add(&w, "d_bad0", TERA_DT_F64, 1, (const int64_t[]){1}, f64_bad);
    const char *path = in_dir("conv.safetensors");
    assert_int_equal(tera_st_writer_save(&w, path), TERA_OK);
    tera_st_writer_free(&w);
    tera_st_file f;
    assert_int_equal(tera_st_open(&f, path), TERA_OK);
    float out[32];
    assert_int_equal(tera_st_read_f32(&f, "h", 1, sa, out), TERA_OK);
    for (int i = 0; i < NF; i++)
        if (out[i] != f16[i].want) fail_msg("f16 0x%04x -> %.9g, want %.9g", f16[i].bits, out[i], f16[i].want);
    assert_true(out[NF] == 0.0f && signbit(out[NF]));
    assert_int_equal(tera_st_read_f32(&f, "b", 1, sb, out), TERA_OK);
    for (int i = 0; i < NB; i++)
        if (out[i] != bf[i].want) fail_msg("bf16 0x%04x -> %.9g, want %.9g", bf[i].bits, out[i], bf[i].want);
    static const char *const bad_names[] = {"h_bad0", "h_bad1", "h_bad2", "h_bad3", "b_bad0",
                                            "b_bad1", "b_bad2", "f_bad0", "f_bad1", "d_bad0"};
    static const char *const bad_what[] = {"+inf", "-inf", "NaN", "NaN", "+inf", "-inf", "NaN", "NaN", "+inf", "-inf"};
    for (int i = 0; i < 10; i++) {
        const int n = bad_names[i][0] == 'f' || bad_names[i][0] == 'd' ? 1 : 2;
        assert_int_equal(tera_st_read_f32(&f, bad_names[i], 1, (const int64_t[]){n}, out), TERA_ERR_NUMERIC);
        const char *msg = tera_last_error();
        if (!strstr(msg, bad_names[i]) || !strstr(msg, "conv.safetensors") || !strstr(msg, bad_what[i]) ||
            !strstr(msg, n == 2 ? "element 1 of 2" : "element 0 of 1"))
            fail_msg("%s: message \"%s\"", bad_names[i], msg);
    }
    tera_st_close(&f);

    /* every finite f16 value against a reference computed independently: ldexp(mantissa, exp) */
    uint16_t all[65536];
    for (int i = 0; i < 65536; i++) all[i] = ((i >> 10) & 31) == 31 ? 0 : (uint16_t)i; /* finite ones only */
    const int64_t s_all[] = {65536};
    tera_st_writer_init(&w);
    tera_st_writer_add(&w, "all", TERA_DT_F16, 1, s_all, all);
    assert_int_equal(tera_st_writer_save(&w, path), TERA_OK);
    tera_st_writer_free(&w);
    float *o = malloc(sizeof(float) * 65536);
    assert_int_equal(tera_st_open(&f, path), TERA_OK);
    assert_int_equal(tera_st_read_f32(&f, "all", 1, s_all, o), TERA_OK);
    tera_st_close(&f);
    for (int i = 0; i < 65536; i++) {
        int e = (i >> 10) & 31, m = i & 1023;
        if (e == 31) continue;
        double v = e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
        if (i & 0x8000) v = -v;
        if (o[i] != (float)v) fail_msg("f16 0x%04x -> %.9g, want %.9g", i, o[i], v);
    }
    free(o);
}

/* ------------------------------------------------------------------------ malformed files -- */

/* One crafted file the reader must refuse with TERA_ERR_FORMAT. */
typedef struct {
    const char *label;  /* file name */
    const char *header; /* header JSON */
    size_t data_len;    /* data bytes after the header */
    uint64_t hlen;      /* header-length field (0: the header's real length) */
    const char *needle; /* the message must contain this (besides the file name) */
} bad_case;

static const bad_case g_bad[] = {
    {"hlen_past_end", "{}", 0, 1000, "header length"},
    {"hlen_absurd", "{}", 0, 0xffffffffffffff00ull, "header length"},
    {"not_json", "{\"a\": {\"dtype\": ", 0, 0, "JSON"},
    {"not_json_garbage", "hello world!", 0, 0, "JSON"},
    {"not_object", "[1, 2, 3]", 0, 0, "not an object"},
    {"trailing_after_json", "{} x", 0, 0, "trailing"},
    {"entry_not_object", "{\"x\": 5}", 0, 0, "'x'"},
    {"missing_dtype", "{\"x\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4, 0, "dtype"},
    {"dtype_not_string", "{\"x\": {\"dtype\": 4, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, 0, "dtype"},
    {"missing_shape", "{\"x\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4, 0, "shape"},
    {"missing_offsets", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4, 0, "data_offsets"},
    {"unknown_dtype", "{\"x\": {\"dtype\": \"F8\", \"shape\": [1], \"data_offsets\": [0, 1]}}", 1, 0, "F8"},
    {"lowercase_dtype", "{\"x\": {\"dtype\": \"f32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 4, 0, "f32"},
    {"negative_dim", "{\"x\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4, 0, "shape"},
    {"fractional_dim", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", 4, 0, "shape"},
    {"string_dim", "{\"x\": {\"dtype\": \"F32\", \"shape\": [\"1\"], \"data_offsets\": [0, 4]}}", 4, 0, "shape"},
    {"huge_dim", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1e300], \"data_offsets\": [0, 4]}}", 4, 0, "shape"},
    {"too_many_dims",
     "{\"x\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}}", 4, 0, "dims"},
    {"numel_overflow",
     "{\"x\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 4294967296], \"data_offsets\": [0, 4]}}", 4,
     0, "overflow"},
    {"shape_not_array", "{\"x\": {\"dtype\": \"F32\", \"shape\": 1, \"data_offsets\": [0, 4]}}", 4, 0, "shape"},
    {"size_mismatch", "{\"x.weight\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 12]}}", 12, 0,
     "tensor 'x.weight': data_offsets [0,12] hold 12 bytes but shape [2,2] F32 needs 16"},
    {"begin_after_end", "{\"x\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [4, 0]}}", 4, 0, "begin"},
    {"offsets_three", "{\"x\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [0, 4, 8]}}", 8, 0,
     "data_offsets"},
    {"offsets_negative", "{\"x\": {\"dtype\": \"U8\", \"shape\": [4], \"data_offsets\": [-4, 0]}}", 4, 0,
     "data_offsets"},
    {"offsets_past_end", "{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 4, 0,
     "past the end"},
    {"overlap",
     "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
     " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
     12, 0, "overlap"},
    {"same_range",
     "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
     " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
     4, 0, "overlap"},
    {"gap_between",
     "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
     " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}",
     12, 0, "gap"},
    {"gap_at_start", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}", 8, 0, "gap"},
    {"trailing_data", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 9, 0, "cover"},
    {"data_without_tensors", "{}", 4, 0, "cover"},
    {"duplicate_name",
     "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
     " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
     8, 0, "duplicate tensor name 'a'"},
    {"metadata_not_object", "{\"__metadata__\": [\"a\"]}", 0, 0, "__metadata__"},
    {"metadata_number", "{\"__metadata__\": {\"format\": 1}}", 0, 0, "format"},
    {"metadata_null", "{\"__metadata__\": {\"k\": null}}", 0, 0, "'k'"},
    {"metadata_duplicate", "{\"__metadata__\": {}, \"__metadata__\": {}}", 0, 0, "__metadata__"},
    {"empty_header", "", 0, 0, "JSON"},
    {"nul_in_header", "{}\0\0", 0, 4, "trailing"},
};

static void test_malformed(void **state) {
    const bad_case *c = *state;
    char path[512];
    snprintf(path, sizeof path, "%s/%s.safetensors", g_dir, c->label);
    write_st(path, c->hlen ? c->hlen : strlen(c->header), c->header, c->data_len);
    if (c->hlen == 4 && strcmp(c->label, "nul_in_header") == 0) {
        /* header with embedded NULs: write it byte-exactly */
        uint8_t b[12] = {4, 0, 0, 0, 0, 0, 0, 0, '{', '}', 0, 0};
        write_bytes(path, b, sizeof b);
    }
    tera_st_file f;
    tera_status s = tera_st_open(&f, path);
    expect_error(s, TERA_ERR_FORMAT, path, c->needle);
    assert_null(f.map); /* closed on failure */
}

static int setup_case(void **state) { return setup_dir(state); }

static void test_short_files(void **state) {
    for (size_t n = 0; n < 8; n++) {
        const char *path = in_dir("short.safetensors");
        uint8_t z[8] = {0};
        write_bytes(path, z, n);
        tera_st_file f;
        expect_error(tera_st_open(&f, path), TERA_ERR_FORMAT, path, "8-byte");
    }
}

static void test_open_io_errors(void **state) {
    tera_st_file f;
    const char *path = in_dir("does_not_exist.safetensors");
    expect_error(tera_st_open(&f, path), TERA_ERR_IO, path, NULL);
    expect_error(tera_st_open(&f, g_dir), TERA_ERR_IO, g_dir, NULL); /* a directory */
}

/* A small valid file, cut at every length, is refused every time; flipped bytes never crash. */
static void test_truncated_and_corrupted(void **state) {
    const float v[3] = {1, 2, 3};
    const uint16_t h[2] = {0x3c00, 0x4000};
    const int64_t s3[] = {3}, s2[] = {2};
    tera_st_writer w;
    tera_st_writer_init(&w);
    tera_st_writer_add(&w, "a", TERA_DT_F32, 1, s3, v);
    tera_st_writer_add(&w, "b", TERA_DT_F16, 1, s2, h);
    tera_st_writer_meta(&w, "k", "v");
    const char *full = in_dir("full.safetensors");
    assert_int_equal(tera_st_writer_save(&w, full), TERA_OK);
    tera_st_writer_free(&w);
    size_t n;
    uint8_t *b = read_bytes(full, &n);
    const char *cut = in_dir("cut.safetensors");
    tera_st_file f;
    for (size_t len = 0; len < n; len++) {
        write_bytes(cut, b, len);
        tera_status s = tera_st_open(&f, cut);
        if (s != TERA_ERR_FORMAT || !strstr(tera_last_error(), cut))
            fail_msg("truncated to %zu of %zu bytes: status %d, \"%s\"", len, n, (int)s, tera_last_error());
    }
    write_bytes(cut, b, n);
    assert_int_equal(tera_st_open(&f, cut), TERA_OK);
    tera_st_close(&f);
    /* corruption: every byte of the header region replaced by a few values; must not crash */
    uint8_t *c = malloc(n);
    const uint8_t subst[] = {0, '"', '{', '}', '[', ']', ',', '9', '-', ' ', 0xff};
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < sizeof subst; k++) {
            memcpy(c, b, n);
            c[i] = subst[k];
            write_bytes(cut, c, n);
            if (tera_st_open(&f, cut) == TERA_OK) {
                float out[3];
                for (int t = 0; t < f.n; t++)
                    if (f.tensors[t].numel <= 3 && f.tensors[t].ndim == 1)
                        (void)tera_st_read_f32(&f, f.tensors[t].name, 1, f.tensors[t].shape, out);
                tera_st_close(&f);
            } else {
                assert_non_null(strstr(tera_last_error(), cut));
            }
        }
    }
    free(c);
    free(b);
}

/* ------------------------------------------------------------------------------- sharding -- */

#define N_SHARD_T 9

/* Tensors t0..t8 of 10*(i+1) floats with values i*1000 + j; returns the writer. */
static void fill_writer(tera_st_writer *w, float **bufs) {
    tera_st_writer_init(w);
    char name[32];
    for (int i = 0; i < N_SHARD_T; i++) {
        int64_t shape[2] = {i + 1, 10};
        bufs[i] = malloc(sizeof(float) * 10 * (size_t)(i + 1));
        for (int j = 0; j < 10 * (i + 1); j++) bufs[i][j] = (float)(i * 1000 + j);
        snprintf(name, sizeof name, "t%d", i);
        tera_st_writer_add(w, name, TERA_DT_F32, 2, shape, bufs[i]);
    }
}

static void free_bufs(float **bufs) {
    for (int i = 0; i < N_SHARD_T; i++) free(bufs[i]);
}

static void check_set_contents(const tera_st_set *s) {
    char name[32];
    float out[100];
    for (int i = 0; i < N_SHARD_T; i++) {
        int64_t shape[2] = {i + 1, 10};
        snprintf(name, sizeof name, "t%d", i);
        assert_non_null(tera_st_set_find(s, name));
        assert_int_equal(tera_st_set_read_f32(s, name, 2, shape, out), TERA_OK);
        for (int j = 0; j < 10 * (i + 1); j++) assert_true(out[j] == (float)(i * 1000 + j));
    }
    assert_null(tera_st_set_find(s, "t9"));
    int64_t one[1] = {1};
    assert_int_equal(tera_st_set_read_f32(s, "t9", 1, one, out), TERA_ERR_FORMAT);
    assert_non_null(strstr(tera_last_error(), "'t9'"));
}

static void write_sharded(int64_t max_bytes) {
    tera_st_writer w;
    float *bufs[N_SHARD_T];
    fill_writer(&w, bufs);
    tera_st_writer_meta(&w, "format", "pt");
    assert_int_equal(tera_st_writer_save_dir(&w, g_dir, max_bytes), TERA_OK);
    tera_st_writer_free(&w);
    free_bufs(bufs);
}

static void test_sharded_roundtrip(void **state) {
    /* sizes 40..360 bytes, total 1800; limit 500: greedy fill gives
     * {t0..t3}=400, {t4}=200.. -> t4+t5=440, {t6}=280, {t7}=320, {t8}=360 */
    write_sharded(500);
    assert_true(exists(in_dir("model.safetensors.index.json")));
    assert_false(exists(in_dir("model.safetensors")));
    int n_files = 0;
    char name[64];
    for (int i = 1; i <= 9; i++) {
        snprintf(name, sizeof name, "model-%05d-of-00005.safetensors", i);
        n_files += exists(in_dir(name));
    }
    assert_int_equal(n_files, 5);
    tera_st_set s;
    assert_int_equal(tera_st_set_open(&s, g_dir), TERA_OK);
    assert_int_equal(s.n_files, 5);
    for (int i = 0; i < s.n_files; i++) {
        uint64_t bytes = 0;
        for (int t = 0; t < s.files[i].n; t++) bytes += s.files[i].tensors[t].end - s.files[i].tensors[t].begin;
        assert_true(bytes <= 500);
        assert_string_equal(tera_st_meta(&s.files[i], "format"), "pt");
    }
    check_set_contents(&s);
    tera_st_set_close(&s);

    /* total_size in the index */
    size_t n;
    char *idx = (char *)read_bytes(in_dir("model.safetensors.index.json"), &n);
    idx[n] = '\0';
    assert_non_null(strstr(idx, "\"total_size\":\t1800"));
    free(idx);
}

static void test_shard_never_splits(void **state) {
    /* every tensor is larger than the limit: one tensor per shard */
    write_sharded(16);
    tera_st_set s;
    assert_int_equal(tera_st_set_open(&s, g_dir), TERA_OK);
    assert_int_equal(s.n_files, N_SHARD_T);
    for (int i = 0; i < s.n_files; i++) assert_int_equal(s.files[i].n, 1);
    check_set_contents(&s);
    tera_st_set_close(&s);
}

static void test_single_file_set(void **state) {
    write_sharded(0);
    assert_true(exists(in_dir("model.safetensors")));
    assert_false(exists(in_dir("model.safetensors.index.json")));
    tera_st_set s;
    assert_int_equal(tera_st_set_open(&s, g_dir), TERA_OK);
    assert_int_equal(s.n_files, 1);
    check_set_contents(&s);
    tera_st_set_close(&s);
    /* a limit above the total also gives one file, and removes a stale index */
    write_sharded(500);
    assert_true(exists(in_dir("model.safetensors.index.json")));
    write_sharded(1 << 20);
    assert_false(exists(in_dir("model.safetensors.index.json")));
    assert_int_equal(tera_st_set_open(&s, g_dir), TERA_OK);
    assert_int_equal(s.n_files, 1);
    tera_st_set_close(&s);
}

static void test_set_empty_dir(void **state) {
    tera_st_set s;
    expect_error(tera_st_set_open(&s, g_dir), TERA_ERR_IO, g_dir, "model.safetensors");
}

static void test_index_missing_file(void **state) {
    write_sharded(500);
    const char *victim = in_dir("model-00003-of-00005.safetensors");
    assert_int_equal(unlink(victim), 0);
    tera_st_set s;
    expect_error(tera_st_set_open(&s, g_dir), TERA_ERR_FORMAT, "model.safetensors.index.json",
                 "model-00003-of-00005.safetensors");
}

static void write_text(const char *path, const char *text) { write_bytes(path, text, strlen(text)); }

static void test_index_missing_tensor(void **state) {
    write_sharded(500);
    const char *ipath = in_dir("model.safetensors.index.json");
    /* maps a tensor to a file that lacks it */
    write_text(ipath, "{\"weight_map\": {\"t0\": \"model-00001-of-00005.safetensors\", "
                      "\"ghost\": \"model-00001-of-00005.safetensors\"}}");
    tera_st_set s;
    expect_error(tera_st_set_open(&s, g_dir), TERA_ERR_FORMAT, ipath, "'ghost'");
    /* a file holds tensors the index does not map to it (t1..t3 omitted) */
    write_text(ipath, "{\"weight_map\": {\"t0\": \"model-00001-of-00005.safetensors\"}}");
    expect_error(tera_st_set_open(&s, g_dir), TERA_ERR_FORMAT, "model-00001-of-00005.safetensors", "'t1'");
    /* a tensor mapped to the wrong file */
    write_text(ipath, "{\"weight_map\": {\"t0\": \"model-00002-of-00005.safetensors\", "
                      "\"t1\": \"model-00001-of-00005.safetensors\", \"t2\": \"model-00001-of-00005.safetensors\","
                      "\"t3\": \"model-00001-of-00005.safetensors\"}}");
    expect_error(tera_st_set_open(&s, g_dir), TERA_ERR_FORMAT, ipath, "'t0'");
}

static void test_index_malformed(void **state) {
    const char *ipath = in_dir("model.safetensors.index.json");
    static const char *const bad[][2] = {
        {"not json", "JSON"},
        {"{\"metadata\": {}}", "weight_map"},
        {"{\"weight_map\": []}", "weight_map"},
        {"{\"weight_map\": {\"a\": 3}}", "'a'"},
        {"{\"weight_map\": {\"a\": \"../evil.safetensors\"}}", "'a'"},
        {"{\"weight_map\": {\"a\": \"x.safetensors\", \"a\": \"x.safetensors\"}}", "'a'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(ipath, bad[i][0]);
        tera_st_set s;
        expect_error(tera_st_set_open(&s, g_dir), TERA_ERR_FORMAT, ipath, bad[i][1]);
    }
    /* an empty weight_map is an empty, valid set */
    write_text(ipath, "{\"weight_map\": {}}");
    tera_st_set s;
    assert_int_equal(tera_st_set_open(&s, g_dir), TERA_OK);
    assert_int_equal(s.n_files, 0);
    tera_st_set_close(&s);
}

/* ---------------------------------------------------------------------------- atomic save -- */

static void save_values(const char *path, float v, int n, tera_status want) {
    float *buf = malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) buf[i] = v;
    int64_t shape[1] = {n};
    tera_st_writer w;
    tera_st_writer_init(&w);
    tera_st_writer_add(&w, "v", TERA_DT_F32, 1, shape, buf);
    tera_status s = tera_st_writer_save(&w, path);
    tera_st_writer_free(&w);
    free(buf);
    if (want == TERA_OK) assert_int_equal(s, TERA_OK);
    else expect_error(s, want, path, NULL);
}

static void test_atomic_save(void **state) {
    const char *path = in_dir("a.safetensors"), *tmp = in_dir("a.safetensors.tmp");
    save_values(path, 1.0f, 4, TERA_OK);
    assert_false(exists(tmp));
    save_values(path, 2.0f, 4, TERA_OK); /* replaces */
    assert_false(exists(tmp));
    size_t n1;
    uint8_t *before = read_bytes(path, &n1);

    /* a write that fails midway (file size limit -> EFBIG) leaves the old file and no tmp */
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    lim = old;
    lim.rlim_cur = 256;
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    save_values(path, 3.0f, 1000, TERA_ERR_IO);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, prev);
    assert_non_null(strstr(tera_last_error(), "a.safetensors"));
    assert_false(exists(tmp));
    size_t n2;
    uint8_t *after = read_bytes(path, &n2);
    assert_int_equal(n1, n2);
    assert_memory_equal(before, after, n1);
    free(after);

    /* the tmp file cannot be created (a directory is in the way): old file untouched */
    assert_int_equal(mkdir(tmp, 0755), 0);
    save_values(path, 4.0f, 4, TERA_ERR_IO);
    assert_int_equal(rmdir(tmp), 0);
    after = read_bytes(path, &n2);
    assert_memory_equal(before, after, n1);
    free(after);
    free(before);

    /* a missing directory */
    save_values(in_dir("no/such/dir/x.safetensors"), 1.0f, 1, TERA_ERR_IO);

    tera_st_file f;
    assert_int_equal(tera_st_open(&f, path), TERA_OK);
    float out[4];
    int64_t s4[] = {4};
    assert_int_equal(tera_st_read_f32(&f, "v", 1, s4, out), TERA_OK);
    assert_true(out[0] == 2.0f && out[3] == 2.0f);
    tera_st_close(&f);
}

static void test_dtype_table(void **state) {
    assert_int_equal(tera_dtype_size(TERA_DT_F64), 8);
    assert_int_equal(tera_dtype_size(TERA_DT_BF16), 2);
    assert_int_equal(tera_dtype_size(TERA_DT_BOOL), 1);
    assert_string_equal(tera_dtype_name(TERA_DT_BF16), "BF16");
    assert_string_equal(tera_dtype_name(TERA_DT_U64), "U64");
    assert_string_equal(tera_dtype_name(TERA_DT_BOOL), "BOOL");
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup_dir, teardown_dir)

int main(void) {
    enum { N_BAD = sizeof g_bad / sizeof g_bad[0] };
    struct CMUnitTest tests[20 + N_BAD] = {
        T(test_roundtrip_dtypes),     T(test_metadata),          T(test_empty_file_set),
        T(test_writer_duplicate),     T(test_f16_bf16_values),   T(test_short_files),
        T(test_open_io_errors),       T(test_truncated_and_corrupted), T(test_sharded_roundtrip),
        T(test_shard_never_splits),   T(test_single_file_set),   T(test_set_empty_dir),
        T(test_index_missing_file),   T(test_index_missing_tensor), T(test_index_malformed),
        T(test_atomic_save),          T(test_dtype_table),
    };
    int n = 17;
    for (int i = 0; i < N_BAD; i++) {
        tests[n] = (struct CMUnitTest){g_bad[i].label, test_malformed, setup_case, teardown_dir, (void *)&g_bad[i]};
        n++;
    }
    return _cmocka_run_group_tests("safetensors", tests, (size_t)n, NULL, NULL);
}
