/* Data pipeline: Philox RNG, token sources (embedded, text, .u16, Megatron .bin/.idx), the index
 * validator against every kind of corruption, and the loader's sample layout and shuffle. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tera/data.h"
#include "tera/prepare.h"
#include "tera/rng.h"
#include "tera/tokenizer.h"

#ifndef TERA_SHARED_DIR
#define TERA_SHARED_DIR "/work/shared"
#endif

static char g_dir[256]; /* this run's scratch directory */

/* ---- helpers --------------------------------------------------------------------------------- */

static void path_in(char *out, size_t n, const char *name) {
    int k = snprintf(out, n, "%s/%s", g_dir, name);
    assert_true(k > 0 && (size_t)k < n);
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* Reads a whole file into a malloc'd buffer. */
static unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long len = ftell(f);
    assert_true(len >= 0);
    assert_int_equal(fseek(f, 0, SEEK_SET), 0);
    unsigned char *buf = malloc((size_t)len + 1);
    assert_non_null(buf);
    if (len) assert_int_equal(fread(buf, 1, (size_t)len, f), (size_t)len);
    assert_int_equal(fclose(f), 0);
    *n = (size_t)len;
    return buf;
}

static tera_data_config data_cfg(const char *path, const char *format) {
    tera_data_config dc;
    memset(&dc, 0, sizeof dc);
    snprintf(dc.path, sizeof dc.path, "%s", path);
    snprintf(dc.format, sizeof dc.format, "%s", format);
    dc.val_fraction = 0.0f;
    return dc;
}

/* Opening `path` must fail with `want` and a message containing `needle`. */
static void expect_open_fail(const char *path, const char *format, int vocab, tera_status want, const char *needle) {
    tera_data_config dc = data_cfg(path, format);
    tera_token_source s;
    tera_status rc = tera_source_open(&s, &dc, vocab);
    if (rc != want || !strstr(tera_last_error(), needle)) {
        print_error("open '%s' (%s): got %s '%s', want %s naming '%s'\n", path, format, tera_status_name(rc),
                    tera_last_error(), tera_status_name(want), needle);
        if (rc == TERA_OK) tera_source_close(&s);
        fail();
    }
    assert_null(s.map); /* nothing left mapped */
}

static void put_u64le(unsigned char *p, uint64_t v) {
    for (int k = 0; k < 8; k++) p[k] = (unsigned char)(v >> (8 * k));
}
static void put_u32le(unsigned char *p, uint32_t v) {
    for (int k = 0; k < 4; k++) p[k] = (unsigned char)(v >> (8 * k));
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

static int group_setup(void **state) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tera_test_data_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int group_teardown(void **state) {
    return nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* ---- RNG ------------------------------------------------------------------------------------- */

static void test_philox_kat(void **state) {
    /* Random123 kat_vectors: philox4x32 10 rounds */
    uint32_t o[4];
    tera_philox4x32(0, 0, 0, o);
    uint32_t w0[4] = {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8};
    for (int k = 0; k < 4; k++) assert_int_equal(o[k], w0[k]);
    tera_philox4x32(UINT64_MAX, UINT64_MAX, UINT64_MAX, o);
    uint32_t w1[4] = {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd};
    for (int k = 0; k < 4; k++) assert_int_equal(o[k], w1[k]);
    /* ctr = {243f6a88, 85a308d3, 13198a2e, 03707344}, key = {a4093822, 299f31d0} */
    tera_philox4x32(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull, o);
    uint32_t w2[4] = {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1};
    for (int k = 0; k < 4; k++) assert_int_equal(o[k], w2[k]);
}

static void test_hash64(void **state) {
    /* splitmix64 seeded with 0: first output = mix(0 + golden gamma) */
    assert_true(tera_hash64(0x9e3779b97f4a7c15ull) == 0xe220a8397b1dcdafull);
    assert_true(tera_hash64(0) == 0);
    assert_true(tera_hash64(1) != tera_hash64(2));
}

static void test_uniform_normal(void **state) {
    const int N = 100000;
    double su = 0, sn = 0, sn2 = 0;
    float umin = 1, umax = 0;
    for (int i = 0; i < N; i++) {
        float u = tera_rng_uniform(42, 7, (uint64_t)i);
        assert_true(u >= 0.0f && u < 1.0f);
        su += u;
        umin = fminf(umin, u);
        umax = fmaxf(umax, u);
        float z = tera_rng_normal(42, 7, (uint64_t)i);
        assert_true(isfinite(z) && fabsf(z) < 7.0f);
        sn += z;
        sn2 += (double)z * z;
    }
    double mu = su / N, mn = sn / N, var = sn2 / N - mn * mn;
    assert_true(fabs(mu - 0.5) < 0.005);
    assert_true(umin < 1e-3f && umax > 0.999f);
    assert_true(fabs(mn) < 0.015);  /* 5 sigma of the mean */
    assert_true(fabs(var - 1.0) < 0.025);
    /* pure function of (key, stream, i); neighbours and other keys/streams differ */
    assert_true(tera_rng_normal(42, 7, 123) == tera_rng_normal(42, 7, 123));
    assert_true(tera_rng_normal(42, 7, 123) != tera_rng_normal(42, 7, 124));
    assert_true(tera_rng_normal(42, 7, 123) != tera_rng_normal(43, 7, 123));
    assert_true(tera_rng_normal(42, 7, 123) != tera_rng_normal(42, 8, 123));
    assert_true(tera_rng_uniform(42, 7, 5) != tera_rng_uniform(42, 7, 6));
}

/* ---- flat sources ---------------------------------------------------------------------------- */

static void test_embedded(void **state) {
    tera_data_config dc = data_cfg("", "auto");
    tera_token_source s;
    assert_int_equal(tera_source_open(&s, &dc, 256), TERA_OK);
    assert_int_equal(s.kind, TERA_SRC_EMBEDDED);
    assert_int_equal(s.n_tokens, (int64_t)tera_default_corpus_len);
    assert_int_equal(s.elem_size, 1);
    assert_int_equal(s.n_docs, 1);
    assert_null(s.map);
    for (int64_t i = 0; i < s.n_tokens; i += 997) assert_int_equal(tera_source_token(&s, i), tera_default_corpus[i]);
    tera_source_close(&s);
    tera_source_close(&s); /* idempotent */
    expect_open_fail("", "auto", 255, TERA_ERR_CONFIG, "model.vocab_size");
    expect_open_fail("", "bin", 256, TERA_ERR_CONFIG, "data.path");
    expect_open_fail("", "csv", 256, TERA_ERR_CONFIG, "data.format");
}

static void test_text(void **state) {
    char p[512];
    path_in(p, sizeof p, "t.txt");
    const char *text = "hello, world\n\xff\x80";
    write_file(p, text, strlen(text));
    for (int fmt = 0; fmt < 2; fmt++) {
        tera_data_config dc = data_cfg(p, fmt ? "text" : "auto");
        tera_token_source s;
        assert_int_equal(tera_source_open(&s, &dc, 300), TERA_OK);
        assert_int_equal(s.kind, TERA_SRC_TEXT);
        assert_string_equal(s.path, p);
        assert_int_equal(s.n_tokens, (int64_t)strlen(text));
        for (int64_t i = 0; i < s.n_tokens; i++) assert_int_equal(tera_source_token(&s, i), (unsigned char)text[i]);
        tera_source_close(&s);
    }
    expect_open_fail(p, "auto", 128, TERA_ERR_CONFIG, "model.vocab_size");
    char e[512];
    path_in(e, sizeof e, "empty.txt");
    write_file(e, "", 0);
    expect_open_fail(e, "auto", 256, TERA_ERR_FORMAT, e);
    char m[512];
    path_in(m, sizeof m, "missing.txt");
    expect_open_fail(m, "text", 256, TERA_ERR_IO, m);
}

static void test_u16(void **state) {
    char p[512];
    path_in(p, sizeof p, "x.u16");
    unsigned char raw[8] = {0x01, 0x00, 0xff, 0x00, 0x34, 0x12, 0xff, 0xff};
    write_file(p, raw, sizeof raw);
    tera_data_config dc = data_cfg(p, "auto");
    tera_token_source s;
    assert_int_equal(tera_source_open(&s, &dc, 65536), TERA_OK);
    assert_int_equal(s.kind, TERA_SRC_U16);
    assert_int_equal(s.n_tokens, 4);
    assert_int_equal(tera_source_token(&s, 0), 1);
    assert_int_equal(tera_source_token(&s, 1), 255);
    assert_int_equal(tera_source_token(&s, 2), 0x1234);
    assert_int_equal(tera_source_token(&s, 3), 65535);
    tera_source_close(&s);
    /* token 3 = 65535 >= vocab: named with its index */
    expect_open_fail(p, "u16", 65535, TERA_ERR_FORMAT, p);
    expect_open_fail(p, "u16", 65535, TERA_ERR_FORMAT, "token 3");
    /* odd length: file and size named */
    char o[512];
    path_in(o, sizeof o, "odd.u16");
    write_file(o, raw, 7);
    expect_open_fail(o, "auto", 65536, TERA_ERR_FORMAT, o);
    expect_open_fail(o, "auto", 65536, TERA_ERR_FORMAT, "7 bytes");
    char e[512];
    path_in(e, sizeof e, "empty.u16");
    write_file(e, "", 0);
    expect_open_fail(e, "auto", 65536, TERA_ERR_FORMAT, e);
}

static void test_u16_shakespeare(void **state) {
    const char *p = TERA_SHARED_DIR "/data/tinyshakespeare.gpt2.u16";
    if (access(p, R_OK) != 0) {
        print_message("skipping: %s not present\n", p);
        skip();
    }
    tera_data_config dc = data_cfg(p, "auto");
    tera_token_source s;
    assert_int_equal(tera_source_open(&s, &dc, 50257), TERA_OK);
    assert_int_equal(s.kind, TERA_SRC_U16);
    assert_int_equal(s.elem_size, 2);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(s.n_tokens, st.st_size / 2);
    /* "First Citizen:\n" in GPT-2 BPE */
    assert_int_equal(tera_source_token(&s, 0), 5962);
    assert_int_equal(tera_source_token(&s, 1), 22307);
    assert_int_equal(tera_source_token(&s, 2), 25);
    assert_int_equal(tera_source_token(&s, 3), 198);
    tera_loader l;
    assert_int_equal(tera_loader_init(&l, &s, 64, 0.1f, 1, 1234), TERA_OK);
    assert_int_equal(l.n_samples, (s.n_tokens - 1) / 64);
    int32_t in[64], tg[64];
    for (int64_t g = 0; g < 200; g++) {
        tera_loader_train_sample(&l, g * 37, in, tg);
        for (int t = 0; t < 64; t++) assert_true(in[t] >= 0 && in[t] < 50257 && tg[t] >= 0 && tg[t] < 50257);
        for (int t = 0; t + 1 < 64; t++) assert_int_equal(tg[t], in[t + 1]);
    }
    tera_source_close(&s);
}

/* ---- Megatron .bin/.idx ---------------------------------------------------------------------- */

#define N_DOCS 5
static const int64_t k_doc_len[N_DOCS] = {7, 1, 0, 13, 4};

/* Documents of distinct tokens: doc d token k = 1 + 31*d + k (< 200). */
static void make_docs(int32_t store[N_DOCS][16], const int32_t *docs[N_DOCS]) {
    for (int d = 0; d < N_DOCS; d++) {
        for (int k = 0; k < 16; k++) store[d][k] = 1 + 31 * d + k;
        docs[d] = store[d];
    }
}

static void roundtrip(int dtype, int elem) {
    int32_t store[N_DOCS][16];
    const int32_t *docs[N_DOCS];
    make_docs(store, docs);
    char prefix[512], name[64];
    snprintf(name, sizeof name, "rt%d", dtype);
    path_in(prefix, sizeof prefix, name);
    assert_int_equal(tera_idx_write(prefix, dtype, docs, k_doc_len, N_DOCS), TERA_OK);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.bin.tmp", prefix);
    assert_int_not_equal(access(tmp, F_OK), 0); /* renamed away */
    snprintf(tmp, sizeof tmp, "%s.idx.tmp", prefix);
    assert_int_not_equal(access(tmp, F_OK), 0);

    /* the prefix, PREFIX.bin and PREFIX.idx all name the pair */
    const char *suffixes[3] = {"", ".bin", ".idx"};
    for (int v = 0; v < 3; v++) {
        for (int fmt = 0; fmt < 2; fmt++) {
            char p[600];
            snprintf(p, sizeof p, "%s%s", prefix, suffixes[v]);
            tera_data_config dc = data_cfg(p, fmt ? "bin" : "auto");
            tera_token_source s;
            tera_status rc = tera_source_open(&s, &dc, 200);
            if (rc != TERA_OK) print_error("%s\n", tera_last_error());
            assert_int_equal(rc, TERA_OK);
            assert_int_equal(s.kind, TERA_SRC_BIN);
            assert_string_equal(s.path, prefix);
            assert_int_equal(s.elem_size, elem);
            assert_int_equal(s.n_docs, N_DOCS);
            int64_t total = 0;
            for (int d = 0; d < N_DOCS; d++) total += k_doc_len[d];
            assert_int_equal(s.n_tokens, total);
            int64_t i = 0;
            for (int d = 0; d < N_DOCS; d++)
                for (int64_t k = 0; k < k_doc_len[d]; k++) assert_int_equal(tera_source_token(&s, i++), store[d][k]);
            tera_source_close(&s);
        }
    }
    /* token >= vocab: named with the .bin and its token index (last token of doc 3 = 1+93+12 = 106) */
    char bin[600];
    snprintf(bin, sizeof bin, "%s.bin", prefix);
    expect_open_fail(prefix, "bin", 106, TERA_ERR_FORMAT, bin);
    expect_open_fail(prefix, "bin", 106, TERA_ERR_FORMAT, "token 20 ");
}

static void test_idx_roundtrip(void **state) {
    roundtrip(8, 2); /* uint16 */
    roundtrip(4, 4); /* int32 */
    roundtrip(1, 1); /* uint8 */
    roundtrip(5, 8); /* int64 */
    roundtrip(3, 2); /* int16 */
}

static void test_idx_write_errors(void **state) {
    int32_t store[N_DOCS][16];
    const int32_t *docs[N_DOCS];
    make_docs(store, docs);
    char prefix[512];
    path_in(prefix, sizeof prefix, "werr");
    assert_int_equal(tera_idx_write(prefix, 6, docs, k_doc_len, N_DOCS), TERA_ERR_ARG); /* float64 */
    assert_int_equal(tera_idx_write(prefix, 9, docs, k_doc_len, N_DOCS), TERA_ERR_ARG);
    store[3][2] = 300; /* does not fit uint8 */
    assert_int_equal(tera_idx_write(prefix, 1, docs, k_doc_len, N_DOCS), TERA_ERR_ARG);
    char p[600];
    snprintf(p, sizeof p, "%s.bin.tmp", prefix);
    assert_int_not_equal(access(p, F_OK), 0); /* no debris */
    snprintf(p, sizeof p, "%s.bin", prefix);
    assert_int_not_equal(access(p, F_OK), 0);
    /* a negative id fits int32 but is refused at open */
    store[3][2] = -5;
    assert_int_equal(tera_idx_write(prefix, 4, docs, k_doc_len, N_DOCS), TERA_OK);
    expect_open_fail(prefix, "bin", 1000, TERA_ERR_FORMAT, "token 10 ");
    /* zero documents: a valid index, but no tokens */
    assert_int_equal(tera_idx_write(prefix, 8, docs, k_doc_len, 0), TERA_OK);
    expect_open_fail(prefix, "bin", 1000, TERA_ERR_FORMAT, "no tokens");
}

/* The valid uint16 pair used as the base of every corruption. */
typedef struct {
    unsigned char *idx, *bin;
    size_t idx_len, bin_len;
    uint64_t S, Dc;
} pair;

static pair make_base(void) {
    int32_t store[N_DOCS][16];
    const int32_t *docs[N_DOCS];
    make_docs(store, docs);
    char prefix[512], p[600];
    path_in(prefix, sizeof prefix, "base");
    assert_int_equal(tera_idx_write(prefix, 8, docs, k_doc_len, N_DOCS), TERA_OK);
    pair b;
    snprintf(p, sizeof p, "%s.idx", prefix);
    b.idx = read_file(p, &b.idx_len);
    snprintf(p, sizeof p, "%s.bin", prefix);
    b.bin = read_file(p, &b.bin_len);
    b.S = N_DOCS;
    b.Dc = N_DOCS + 1;
    assert_int_equal(b.idx_len, 34 + 12 * b.S + 8 * b.Dc);
    assert_int_equal(memcmp(b.idx, "MMIDIDX\0\0", 9), 0);
    return b;
}

/* Writes idx/bin as the pair "bad" and expects open to fail with FORMAT naming `which` file
 * ("idx" or "bin") and, if non-NULL, containing `needle`. */
static void expect_corrupt(const unsigned char *idx, size_t idx_len, const unsigned char *bin, size_t bin_len,
                           const char *which, const char *needle) {
    char prefix[512], ip[600], bp[600];
    path_in(prefix, sizeof prefix, "bad");
    snprintf(ip, sizeof ip, "%s.idx", prefix);
    snprintf(bp, sizeof bp, "%s.bin", prefix);
    write_file(ip, idx, idx_len);
    write_file(bp, bin, bin_len);
    expect_open_fail(prefix, "bin", 1000, TERA_ERR_FORMAT, strcmp(which, "idx") == 0 ? ip : bp);
    if (needle) expect_open_fail(prefix, "bin", 1000, TERA_ERR_FORMAT, needle);
}

static void test_idx_corrupt(void **state) {
    pair b = make_base();
    unsigned char *c = malloc(b.idx_len + 16);
    assert_non_null(c);
    const size_t sizes = 34, ptrs = 34 + 4 * b.S, didx = 34 + 12 * b.S;
#define FRESH() memcpy(c, b.idx, b.idx_len)

    /* sanity: the unmodified copy opens */
    {
        char prefix[512], ip[600], bp[600];
        path_in(prefix, sizeof prefix, "bad");
        snprintf(ip, sizeof ip, "%s.idx", prefix);
        snprintf(bp, sizeof bp, "%s.bin", prefix);
        write_file(ip, b.idx, b.idx_len);
        write_file(bp, b.bin, b.bin_len);
        tera_data_config dc = data_cfg(prefix, "bin");
        tera_token_source s;
        assert_int_equal(tera_source_open(&s, &dc, 1000), TERA_OK);
        tera_source_close(&s);
    }
    FRESH(); c[0] = 'X';
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "offset 0:");
    FRESH(); c[8] = 1;
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "magic");
    FRESH(); put_u64le(c + 9, 2);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "offset 9:");
    int bad_codes[] = {0, 6, 7, 9, 255};
    for (size_t k = 0; k < sizeof bad_codes / sizeof *bad_codes; k++) {
        FRESH(); c[17] = (unsigned char)bad_codes[k];
        expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "offset 17:");
    }
    /* truncated at every length */
    for (size_t n = 0; n < b.idx_len; n++) expect_corrupt(b.idx, n, b.bin, b.bin_len, "idx", NULL);
    /* trailing bytes */
    FRESH(); c[b.idx_len] = 0;
    expect_corrupt(c, b.idx_len + 1, b.bin, b.bin_len, "idx", "trailing");
    /* counts too large (including ones whose byte sizes overflow) */
    uint64_t big[] = {b.S + 1, 1ull << 62, UINT64_MAX};
    for (size_t k = 0; k < 3; k++) {
        FRESH(); put_u64le(c + 18, big[k]);
        /* S+1 still fits the file's array bytes, so the document count is what no longer fits */
        expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", k == 0 ? "offset 26:" : "offset 18:");
        FRESH(); put_u64le(c + 26, k == 0 ? b.Dc + 1 : big[k]);
        expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "offset 26:");
    }
    /* a count whose byte size overflows is reported as such, not as "needs 0 bytes" */
    FRESH(); put_u64le(c + 18, UINT64_MAX);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "needs 18446744073709551615 x 12 (over 2^64) bytes");
    FRESH(); put_u64le(c + 26, UINT64_MAX);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "needs 18446744073709551615 x 8 (over 2^64) bytes");
    FRESH(); put_u64le(c + 26, 0);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "offset 26:");
    /* sizes inconsistent with pointers or the .bin */
    char want[64];
    FRESH(); put_u32le(c + sizes, 8); /* sizes[0] 7 -> 8: pointers[1] off */
    snprintf(want, sizeof want, "offset %zu:", ptrs + 8);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", want);
    FRESH(); put_u32le(c + sizes + 4 * 4, 5); /* last size 4 -> 5: runs past the .bin */
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "past the end");
    FRESH(); put_u32le(c + sizes + 4 * 4, 3); /* last size 4 -> 3: .bin longer than declared */
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "declares");
    FRESH(); put_u32le(c + sizes + 4, 0xffffffffu); /* negative */
    snprintf(want, sizeof want, "offset %zu:", sizes + 4);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", want);
    /* pointers */
    FRESH(); put_u64le(c + ptrs, 2);
    snprintf(want, sizeof want, "offset %zu:", ptrs);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", want);
    FRESH(); put_u64le(c + ptrs + 8 * 3, 14); /* pointers[3] = 16 (2*(7+1+0)) -> 14: not the running sum */
    snprintf(want, sizeof want, "offset %zu:", ptrs + 8 * 3);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", want);
    FRESH(); put_u64le(c + ptrs + 8 * 4, UINT64_MAX); /* negative */
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", NULL);
    /* doc_idx */
    FRESH(); put_u64le(c + didx, 1);
    snprintf(want, sizeof want, "offset %zu:", didx);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", want);
    FRESH(); put_u64le(c + didx + 8 * 3, 1); /* 0 1 2 1 4 5: not monotone */
    snprintf(want, sizeof want, "offset %zu:", didx + 8 * 3);
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", want);
    FRESH(); put_u64le(c + didx + 8 * 5, 4); /* last != S */
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "doc_idx");
    FRESH(); put_u64le(c + didx + 8 * 2, 9); /* beyond S */
    expect_corrupt(c, b.idx_len, b.bin, b.bin_len, "idx", "doc_idx[2]");
    /* .bin too short / too long */
    expect_corrupt(b.idx, b.idx_len, b.bin, b.bin_len - 2, "idx", ".bin");
    expect_corrupt(b.idx, b.idx_len, b.bin, b.bin_len - 1, "idx", ".bin");
    expect_corrupt(b.idx, b.idx_len, b.bin, 0, "idx", ".bin");
    unsigned char *longer = calloc(b.bin_len + 2, 1);
    assert_non_null(longer);
    memcpy(longer, b.bin, b.bin_len);
    expect_corrupt(b.idx, b.idx_len, longer, b.bin_len + 2, "idx", ".bin");
    /* token >= vocab in the .bin */
    memcpy(longer, b.bin, b.bin_len);
    longer[2 * 9] = 0xe8; longer[2 * 9 + 1] = 0x03; /* token 9 = 1000 */
    expect_corrupt(b.idx, b.idx_len, longer, b.bin_len, "bin", "token 9 ");
    /* a missing .bin or .idx is an I/O error naming it */
    char prefix[512], p[600];
    path_in(prefix, sizeof prefix, "bad");
    snprintf(p, sizeof p, "%s.bin", prefix);
    assert_int_equal(remove(p), 0);
    expect_open_fail(prefix, "bin", 1000, TERA_ERR_IO, p);
    write_file(p, b.bin, b.bin_len);
    snprintf(p, sizeof p, "%s.idx", prefix);
    assert_int_equal(remove(p), 0);
    expect_open_fail(prefix, "bin", 1000, TERA_ERR_IO, p);
    snprintf(p, sizeof p, "%s.bin", prefix); /* auto with an explicit .bin and no .idx */
    expect_open_fail(p, "auto", 1000, TERA_ERR_IO, ".idx");
#undef FRESH
    free(longer);
    free(c);
    free(b.idx);
    free(b.bin);
}

/* ---- loader ---------------------------------------------------------------------------------- */

/* An in-memory int32 source whose token k = k (mod vocab not needed: values stay small). */
static tera_token_source iota_source(int32_t *buf, int64_t n) {
    for (int64_t k = 0; k < n; k++) buf[k] = (int32_t)k;
    tera_token_source s;
    memset(&s, 0, sizeof s);
    s.kind = TERA_SRC_BIN;
    snprintf(s.path, sizeof s.path, "iota");
    s.n_tokens = n;
    s.elem_size = 4;
    s.tokens = buf;
    s.n_docs = 1;
    return s;
}

static void test_loader_layout(void **state) {
    enum { N = 1000, T = 16 };
    static int32_t buf[N];
    tera_token_source s = iota_source(buf, N);
    tera_loader l;
    assert_int_equal(tera_loader_init(&l, &s, T, 0.1f, 0, 0), TERA_OK);
    assert_int_equal(l.n_samples, (N - 1) / T); /* 62 */
    assert_int_equal(l.n_val, 6);
    assert_int_equal(l.n_train, 56);
    int32_t in[T], tg[T];
    for (int64_t g = 0; g < 3 * l.n_train; g++) {
        tera_loader_train_sample(&l, g, in, tg);
        int64_t i = g % l.n_train;
        for (int t = 0; t < T; t++) {
            assert_int_equal(in[t], i * T + t);
            assert_int_equal(tg[t], i * T + t + 1);
        }
    }
    for (int64_t v = 0; v < 2 * l.n_val; v++) {
        tera_loader_val_sample(&l, v, in, tg);
        int64_t i = l.n_train + v % l.n_val;
        for (int t = 0; t < T; t++) {
            assert_int_equal(in[t], i * T + t);
            assert_int_equal(tg[t], i * T + t + 1);
        }
        assert_true(in[0] >= l.n_train * T); /* after every training token */
    }
    /* the last sample's last target is token n_samples*T <= N-1 */
    tera_loader_val_sample(&l, l.n_val - 1, in, tg);
    assert_int_equal(tg[T - 1], l.n_samples * T);
    assert_true(tg[T - 1] <= N - 1);

    /* exactly T+1 tokens: one sample, which stays in training however large val_fraction */
    tera_token_source s1 = iota_source(buf, T + 1);
    assert_int_equal(tera_loader_init(&l, &s1, T, 0.9f, 1, 3), TERA_OK);
    assert_int_equal(l.n_samples, 1);
    assert_int_equal(l.n_train, 1);
    assert_int_equal(l.n_val, 0);
    tera_loader_train_sample(&l, 5, in, tg);
    assert_int_equal(in[0], 0);
    assert_int_equal(tg[T - 1], T);

    /* too short: data.path named with the counts */
    tera_token_source s0 = iota_source(buf, 100);
    assert_int_equal(tera_loader_init(&l, &s0, 128, 0.0f, 0, 0), TERA_ERR_FORMAT);
    assert_non_null(strstr(tera_last_error(), "data.path 'iota'"));
    assert_non_null(strstr(tera_last_error(), "100 tokens"));
    assert_non_null(strstr(tera_last_error(), "129"));
    tera_token_source sT = iota_source(buf, T);
    assert_int_equal(tera_loader_init(&l, &sT, T, 0.0f, 0, 0), TERA_ERR_FORMAT);
    assert_int_equal(tera_loader_init(&l, &s, 0, 0.0f, 0, 0), TERA_ERR_CONFIG);
    assert_int_equal(tera_loader_init(&l, &s, T, 1.0f, 0, 0), TERA_ERR_CONFIG);
    assert_int_equal(tera_loader_init(&l, &s, T, -0.1f, 0, 0), TERA_ERR_CONFIG);
    assert_int_equal(tera_loader_init(&l, &s, T, NAN, 0, 0), TERA_ERR_CONFIG);
}

/* Sample index of training position g (tokens are iota, so in[0] = i*T). */
static int64_t sample_of(const tera_loader *l, int64_t g, int32_t *in, int32_t *tg) {
    tera_loader_train_sample(l, g, in, tg);
    assert_int_equal(in[0] % l->T, 0);
    for (int t = 0; t < l->T; t++) {
        assert_int_equal(in[t], in[0] + t);
        assert_int_equal(tg[t], in[0] + t + 1);
    }
    return in[0] / l->T;
}

static void test_loader_shuffle(void **state) {
    enum { N = 20000, T = 3 };
    static int32_t buf[N];
    int32_t in[T], tg[T];
    /* many domain sizes, around powers of two, odd and even bit counts */
    const int64_t n_trains[] = {1, 2, 3, 4, 5, 7, 8, 9, 31, 33, 100, 127, 128, 129, 1000, 1025, 4096, 6000};
    for (size_t c = 0; c < sizeof n_trains / sizeof *n_trains; c++) {
        int64_t nt = n_trains[c];
        tera_token_source s = iota_source(buf, nt * T + 1);
        tera_loader a, a2, b;
        assert_int_equal(tera_loader_init(&a, &s, T, 0.0f, 1, 1234), TERA_OK);
        assert_int_equal(tera_loader_init(&a2, &s, T, 0.0f, 1, 1234), TERA_OK);
        assert_int_equal(tera_loader_init(&b, &s, T, 0.0f, 1, 99), TERA_OK);
        assert_int_equal(a.n_train, nt);
        int64_t *p0 = malloc(sizeof(int64_t) * (size_t)nt), *p1 = malloc(sizeof(int64_t) * (size_t)nt);
        unsigned char *seen = malloc((size_t)nt);
        assert_non_null(p0); assert_non_null(p1); assert_non_null(seen);
        int64_t same_epoch = 0, same_seed = 0, fixed = 0;
        for (int e = 0; e < 3; e++) {
            memset(seen, 0, (size_t)nt);
            for (int64_t j = 0; j < nt; j++) {
                int64_t i = sample_of(&a, e * nt + j, in, tg);
                assert_true(i >= 0 && i < nt);
                assert_int_equal(seen[i], 0); /* each sample exactly once per epoch */
                seen[i] = 1;
                assert_int_equal(sample_of(&a2, e * nt + j, in, tg), i); /* same seed, same order */
                if (e == 0) p0[j] = i;
                if (e == 1) { p1[j] = i; same_epoch += p0[j] == i; }
                if (e == 0) {
                    same_seed += sample_of(&b, j, in, tg) == i;
                    fixed += i == j;
                }
            }
        }
        if (nt >= 100) {
            /* a random permutation agrees with another in ~1 place */
            assert_true(same_epoch < nt / 10);
            assert_true(same_seed < nt / 10);
            assert_true(fixed < nt / 10);
        }
        free(p0); free(p1); free(seen);
    }
    /* shuffle off is the identity order */
    tera_token_source s = iota_source(buf, 100 * T + 1);
    tera_loader l;
    assert_int_equal(tera_loader_init(&l, &s, T, 0.0f, 0, 1234), TERA_OK);
    for (int64_t g = 0; g < 250; g++) assert_int_equal(sample_of(&l, g, in, tg), g % 100);
}

static void test_loader_val_disjoint(void **state) {
    enum { N = 5000, T = 7 };
    static int32_t buf[N];
    tera_token_source s = iota_source(buf, N);
    int32_t in[T], tg[T];
    const float fr[] = {0.05f, 0.1f, 0.5f, 0.99f};
    for (size_t c = 0; c < 4; c++) {
        for (int sh = 0; sh < 2; sh++) {
            tera_loader l;
            assert_int_equal(tera_loader_init(&l, &s, T, fr[c], sh, 7), TERA_OK);
            assert_int_equal(l.n_train + l.n_val, l.n_samples);
            assert_int_equal(l.n_val, (int64_t)floor((double)fr[c] * (double)l.n_samples));
            assert_true(l.n_train >= 1);
            /* every token a training sample touches (inputs and targets) lies before the first val input,
             * except the shared boundary token n_train*T (last target of the last training sample) */
            int64_t max_train = -1;
            for (int64_t g = 0; g < 2 * l.n_train; g++) {
                tera_loader_train_sample(&l, g, in, tg);
                assert_true(in[0] / T < l.n_train);
                if (tg[T - 1] > max_train) max_train = tg[T - 1];
            }
            assert_int_equal(max_train, l.n_train * T);
            for (int64_t v = 0; v < l.n_val; v++) {
                tera_loader_val_sample(&l, v, in, tg);
                assert_true(in[0] / T >= l.n_train);
                assert_true(in[0] >= max_train);
            }
        }
    }
}

/* ---- dataset preparation --------------------------------------------------------------------- */

/* The token ids of PREFIX.bin (uint16). */
static int32_t *bin_ids(const char *prefix, size_t *n) {
    char p[600];
    snprintf(p, sizeof p, "%s.bin", prefix);
    size_t len;
    unsigned char *b = read_file(p, &len);
    int32_t *ids = malloc(sizeof(int32_t) * (len / 2 + 1));
    assert_non_null(ids);
    for (size_t i = 0; i < len / 2; i++) ids[i] = b[2 * i] | b[2 * i + 1] << 8;
    free(b);
    *n = len / 2;
    return ids;
}

/* Appends encode(text, flags) and the end-of-document id to ids[*n]. */
static void append_doc(const tera_tokenizer *t, const char *text, unsigned flags, int32_t *ids, size_t *n) {
    int32_t *e;
    size_t m;
    assert_int_equal(tera_tokenizer_encode(t, text, strlen(text), flags, &e, &m), TERA_OK);
    memcpy(ids + *n, e, m * sizeof *e);
    *n += m;
    ids[(*n)++] = tera_tokenizer_eot(t);
    free(e);
}

/* One rule for empty documents in text files and JSON lines (skipped; a dataset without documents
 * is refused, naming the input), and special-token text encoded as `tokenizer encode` does. */
static void test_prepare_empty_and_special(void **state) {
    (void)state;
    const char *doc = "Hello<|endoftext|>world", *jl = "{\"text\": \"\"}\n\n{\"text\": \"hi <|endoftext|>\"}\n";
    char empty[300], txt[300], jsonl[300], only[300], out[300], probe[400];
    path_in(empty, sizeof empty, "p_empty.txt");
    path_in(txt, sizeof txt, "p_doc.txt");
    path_in(jsonl, sizeof jsonl, "p_docs.jsonl");
    path_in(only, sizeof only, "p_only_empty.jsonl");
    write_file(empty, "", 0);
    write_file(txt, doc, strlen(doc));
    write_file(jsonl, jl, strlen(jl));
    write_file(only, "{\"text\": \"\"}\n", 13);
    const char *train_text[] = {"Hello world, hello there <|endoftext|> and hi again"};
    size_t train_len[] = {strlen(train_text[0])};
    tera_tokenizer *t;
    assert_int_equal(tera_tokenizer_train(&t, train_text, train_len, 1, 300), TERA_OK);
    for (int allow = 0; allow <= 1; allow++) {
        const char *inputs[] = {empty, txt, jsonl};
        path_in(out, sizeof out, allow ? "p_allow" : "p_plain");
        tera_prepare_opts o = {.inputs = inputs, .n_inputs = 3, .output = out, .field = "text", .tok = t,
                               .threads = 2, .allow_special = allow};
        tera_prepare_stats st;
        assert_int_equal(tera_data_prepare(&o, &st), TERA_OK);
        assert_int_equal(st.documents, 2);
        const unsigned flags = allow ? TERA_TOK_ALLOW_SPECIAL : 0;
        int32_t want[256];
        size_t n_want = 0, n_got;
        append_doc(t, doc, flags, want, &n_want);
        append_doc(t, "hi <|endoftext|>", flags, want, &n_want);
        int32_t *got = bin_ids(out, &n_got);
        assert_int_equal(n_got, n_want);
        assert_memory_equal(got, want, n_want * sizeof *want);
        int eots = 0;
        for (size_t i = 0; i < n_got; i++) eots += got[i] == tera_tokenizer_eot(t);
        assert_int_equal(eots, allow ? 4 : 2); /* the text maps to the id only when allowed */
        free(got);
    }
    /* nothing but empty documents: refused, naming the input, and nothing written */
    const char *cases[][2] = {{empty, NULL}, {only, NULL}, {empty, only}};
    for (int c = 0; c < 3; c++) {
        path_in(out, sizeof out, "p_none");
        tera_prepare_opts o = {.inputs = cases[c], .n_inputs = cases[c][1] ? 2 : 1, .output = out, .field = "text",
                               .tok = c == 1 ? t : NULL};
        tera_prepare_stats st;
        assert_int_equal(tera_data_prepare(&o, &st), TERA_ERR_FORMAT);
        assert_non_null(strstr(tera_last_error(), c == 1 ? "p_only_empty.jsonl" : "p_empty.txt"));
        for (int k = 0; k < 3; k++) {
            snprintf(probe, sizeof probe, "%s.%s", out, (const char *[]){"bin", "idx", "bin.tmp"}[k]);
            assert_int_not_equal(access(probe, F_OK), 0);
        }
    }
    tera_tokenizer_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox_kat),
        cmocka_unit_test(test_hash64),
        cmocka_unit_test(test_uniform_normal),
        cmocka_unit_test(test_embedded),
        cmocka_unit_test(test_text),
        cmocka_unit_test(test_u16),
        cmocka_unit_test(test_u16_shakespeare),
        cmocka_unit_test(test_idx_roundtrip),
        cmocka_unit_test(test_idx_write_errors),
        cmocka_unit_test(test_idx_corrupt),
        cmocka_unit_test(test_loader_layout),
        cmocka_unit_test(test_loader_shuffle),
        cmocka_unit_test(test_loader_val_disjoint),
        cmocka_unit_test(test_prepare_empty_and_special),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
