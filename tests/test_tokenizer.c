/* BPE tokenizer: GPT-2 conformance (every id of tinyshakespeare, plus Unicode, contractions,
 * whitespace and emoji strings whose ids come from an independent Python implementation of
 * GPT-2's encoder.py), byte-level round trips, invalid UTF-8, special tokens, training
 * (determinism, ties, vocabulary size, save/load), and parallel == serial encoding. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "data/tokenizer_internal.h"
#include "tera/tokenizer.h"

#ifndef TERA_SHARED_DIR
#define TERA_SHARED_DIR "/work/shared"
#endif
#ifndef TERA_SOURCE_DIR
#define TERA_SOURCE_DIR "."
#endif
#define GPT2_DIR TERA_SHARED_DIR "/data/gpt2"

static tera_tokenizer *g_gpt2; /* GPT-2's tokenizer, NULL if its files are absent */
static char g_dir[256];        /* this run's scratch directory */

/* ---- helpers --------------------------------------------------------------------------------- */

/* Reads a whole file (NULL if it cannot be opened). */
static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long len = ftell(f);
    assert_true(len >= 0);
    assert_int_equal(fseek(f, 0, SEEK_SET), 0);
    char *buf = malloc((size_t)len + 1);
    assert_non_null(buf);
    if (len) assert_int_equal(fread(buf, 1, (size_t)len, f), (size_t)len);
    assert_int_equal(fclose(f), 0);
    *n = (size_t)len;
    return buf;
}

static void write_all(const char *path, const char *s) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(s, 1, strlen(s), f), strlen(s));
    assert_int_equal(fclose(f), 0);
}

static tera_tokenizer *need_gpt2(void) {
    if (!g_gpt2) skip();
    return g_gpt2;
}

/* Encodes, asserting success. */
static int32_t *enc(const tera_tokenizer *t, const char *s, size_t n, unsigned flags, size_t *m) {
    int32_t *ids = NULL;
    tera_status st = tera_tokenizer_encode(t, s, n, flags, &ids, m);
    if (st != TERA_OK) fail_msg("encode: %s", tera_last_error());
    return ids;
}

/* Asserts decode(encode(s)) == s. */
static void assert_round_trip(const tera_tokenizer *t, const char *s, size_t n) {
    size_t m, back_n;
    int32_t *ids = enc(t, s, n, 0, &m);
    char *back = NULL;
    assert_int_equal(tera_tokenizer_decode(t, ids, m, &back, &back_n), TERA_OK);
    assert_int_equal(back_n, n);
    assert_memory_equal(back, s, n);
    free(ids);
    free(back);
}

/* Appends code point cp as UTF-8; returns the byte count. */
static int put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 0x3F)), 2;
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)), o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static uint64_t xorshift(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* ---- (a) GPT-2 conformance on tinyshakespeare ------------------------------------------------ */

static void test_gpt2_tinyshakespeare(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    size_t n, ref_bytes;
    char *text = read_all(TERA_SHARED_DIR "/data/tinyshakespeare.txt", &n);
    char *ref = read_all(TERA_SHARED_DIR "/data/tinyshakespeare.gpt2.u16", &ref_bytes);
    if (!text || !ref) {
        free(text), free(ref);
        skip();
    }
    size_t m;
    int32_t *ids = enc(t, text, n, 0, &m);
    assert_int_equal(m, ref_bytes / 2);
    const unsigned char *r = (const unsigned char *)ref;
    for (size_t i = 0; i < m; i++) {
        int32_t want = r[2 * i] | r[2 * i + 1] << 8;
        if (ids[i] != want) fail_msg("id %zu: got %d, GPT-2 has %d", i, ids[i], want);
    }
    fprintf(stderr, "tinyshakespeare: %zu GPT-2 ids match\n", m);
    char *back;
    size_t back_n;
    assert_int_equal(tera_tokenizer_decode(t, ids, m, &back, &back_n), TERA_OK);
    assert_int_equal(back_n, n);
    assert_memory_equal(back, text, n);
    free(back), free(ids), free(text), free(ref);
}

/* ---- (b) conformance strings ------------------------------------------------------------------ */

/* Ids from an independent pure-Python GPT-2 BPE (encoder.py's algorithm with the `regex` module;
 * it reproduces tinyshakespeare.gpt2.u16 exactly). */
typedef struct {
    const char *text;
    int32_t ids[24];
    int n;
} gpt2_case;

static const gpt2_case g_cases[] = {
    {"h\xc3\xa9llo w\xc3\xb6rld 123 \xd9\xa1\xd9\xa2\xd9\xa3 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",
     {71, 2634, 18798, 266, 30570, 335, 17031, 18923, 94, 149, 95, 149, 96, 10545, 245, 98, 17312, 105, 45739, 252},
     20},
    {"I'm can't we'll they've she'd it's you're",
     {40, 1101, 460, 470, 356, 1183, 484, 1053, 673, 1549, 340, 338, 345, 821}, 14},
    {"a  b\n\n\tc   ", {64, 220, 275, 628, 197, 66, 220, 220, 220}, 9},
    {"emoji \xf0\x9f\xa4\x97\xf0\x9f\x8e\x89 \xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 ok",
     {368, 31370, 12520, 97, 245, 8582, 236, 231, 50169, 102, 447, 235, 41840, 102, 447, 235, 41840, 100, 12876}, 19},
    {"\xc2\xa0x\xe2\x80\xa8y\xe3\x80\x80z\xc2\x85w", {1849, 87, 447, 101, 88, 5099, 222, 89, 126, 227, 86}, 11},
    {"\xc3\x9cn\xc3\xaf" "c\xc3\xb6" "d\xc3\xa9 \xce\x91\xce\x92\xce\x93 \xd0\xb0\xd0\xb1\xd0\xb2 \xd7\x90\xd7\x91\xd7\x92",
     {127, 250, 77, 26884, 66, 9101, 67, 2634, 7377, 239, 138, 240, 138, 241, 12466, 108, 140, 109, 38857, 14360, 238,
      49603, 147, 240},
     24},
    {"x\xc2\xb2\xc2\xb3 \xc2\xbd \xe2\x85\xab \xe2\x91\xa4 1234567 3.14",
     {87, 31185, 126, 111, 25208, 2343, 227, 104, 2343, 239, 97, 17031, 2231, 3134, 513, 13, 1415}, 17},
    {"'''s 'S 'RE", {7061, 6, 82, 705, 50, 705, 2200}, 7},
    {"\r\n\r\nCRLF\r\n", {201, 198, 201, 198, 34, 7836, 37, 201, 198}, 9},
    {"   leading and trailing   ", {220, 220, 3756, 290, 25462, 220, 220, 220}, 8},
    {"hello<|endoftext|>", {31373, 27, 91, 437, 1659, 5239, 91, 29}, 8},
    {"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
     {24794, 24794, 24794, 24794, 24794, 24794, 24794, 24794, 24794, 24794}, 10},
};

static void test_gpt2_strings(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    for (size_t c = 0; c < sizeof g_cases / sizeof g_cases[0]; c++) {
        size_t m;
        int32_t *ids = enc(t, g_cases[c].text, strlen(g_cases[c].text), 0, &m);
        if (m != (size_t)g_cases[c].n) fail_msg("case %zu: %zu ids, GPT-2 has %d", c, m, g_cases[c].n);
        for (size_t i = 0; i < m; i++)
            if (ids[i] != g_cases[c].ids[i]) fail_msg("case %zu id %zu: got %d want %d", c, i, ids[i], g_cases[c].ids[i]);
        free(ids);
        assert_round_trip(t, g_cases[c].text, strlen(g_cases[c].text));
    }
}

static void test_gpt2_special_tokens(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    assert_int_equal(tera_tokenizer_eot(t), 50256);
    assert_int_equal(tera_tokenizer_vocab_size(t), 50257);
    assert_int_equal(tera_tokenizer_n_merges(t), 50000);
    const char *s = "hello<|endoftext|><|endoftext|> world  \n<|endoftext|>";
    size_t m;
    int32_t *ids = enc(t, s, strlen(s), TERA_TOK_ALLOW_SPECIAL, &m);
    /* tiktoken's encode(allowed_special="all"): the text before a special token on its own */
    const int32_t want[] = {31373, 50256, 50256, 995, 220, 220, 198, 50256};
    assert_int_equal(m, sizeof want / sizeof want[0]);
    assert_memory_equal(ids, want, sizeof want);
    char *back;
    size_t n;
    assert_int_equal(tera_tokenizer_decode(t, ids, m, &back, &n), TERA_OK);
    assert_int_equal(n, strlen(s));
    assert_memory_equal(back, s, n);
    free(back), free(ids);
    /* never produced without the flag */
    ids = enc(t, s, strlen(s), 0, &m);
    for (size_t i = 0; i < m; i++) assert_int_not_equal(ids[i], 50256);
    free(ids);
    int32_t bad = 50257;
    assert_int_equal(tera_tokenizer_decode(t, &bad, 1, &back, &n), TERA_ERR_ARG);
    assert_non_null(strstr(tera_last_error(), "50257"));
}

/* ---- (c) round trips -------------------------------------------------------------------------- */

static void test_round_trip_random_utf8(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    static const uint32_t lo[] = {0x0, 0x20, 0x80, 0x370, 0x600, 0x2000, 0x3000, 0x4E00, 0xAC00, 0x1F300, 0x10000};
    static const uint32_t span[] = {0x20, 0x60, 0x500, 0x300, 0x100, 0x70, 0x100, 0x5000, 0x2000, 0x400, 0xF0000};
    uint64_t rng = 42;
    char buf[4 * 200];
    for (int iter = 0; iter < 300; iter++) {
        size_t n = 0, chars = xorshift(&rng) % 200;
        for (size_t c = 0; c < chars; c++) {
            int pool = (int)(xorshift(&rng) % 11);
            uint32_t cp = lo[pool] + (uint32_t)(xorshift(&rng) % span[pool]);
            if (cp >= 0xD800 && cp < 0xE000) cp = ' ';
            n += (size_t)put_utf8(buf + n, cp);
        }
        assert_round_trip(t, buf, n);
    }
}

/* Every byte value is a token, and every byte occurring in valid UTF-8 round-trips in text. */
static void test_round_trip_every_byte(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    int seen[256] = {0};
    for (int32_t id = 0; id < tera_tokenizer_vocab_size(t); id++) {
        size_t n;
        const char *s = tera_tokenizer_token(t, id, &n);
        if (n == 1) seen[(unsigned char)s[0]]++;
    }
    for (int b = 0; b < 256; b++) assert_int_equal(seen[b], 1);
    for (int b = 0; b < 256; b++) {
        char buf[16] = "a ";
        size_t n = 2;
        if (b < 0x80) buf[n++] = (char)b;
        else if (b < 0xC0) buf[n++] = (char)0xC2, buf[n++] = (char)b;                     /* continuation */
        else if (b >= 0xC2 && b < 0xE0) buf[n++] = (char)b, buf[n++] = (char)0x80;       /* 2-byte lead */
        else if (b >= 0xE0 && b < 0xF0) n += (size_t)put_utf8(buf + n, (uint32_t)(b & 0x0F) << 12 | (b == 0xED ? 0x100 : 0x800));
        else if (b >= 0xF0 && b < 0xF5) n += (size_t)put_utf8(buf + n, (uint32_t)(b & 0x07) << 18 | (b == 0xF4 ? 0x1000 : 0x10000));
        else continue; /* C0, C1, F5..FF never occur in valid UTF-8 (see test_invalid_utf8) */
        assert_true(memchr(buf + 2, b, n - 2) != NULL);
        buf[n++] = 'z';
        assert_round_trip(t, buf, n);
    }
    assert_round_trip(t, "", 0);
    const char nul[] = {'x', 0, 0, ' ', 0, 'y'};
    assert_round_trip(t, nul, sizeof nul);
}

/* ---- (d) invalid UTF-8 ------------------------------------------------------------------------ */

static void expect_bad_utf8(const tera_tokenizer *t, const char *s, size_t n, size_t offset, int parallel) {
    int32_t *ids = (int32_t *)1;
    size_t m = 1;
    tera_status st = parallel ? tok_encode_chunks(t, s, n, 0, 2, 64, &ids, &m) : tera_tokenizer_encode(t, s, n, 0, &ids, &m);
    assert_int_equal(st, TERA_ERR_FORMAT);
    assert_null(ids);
    char want[64];
    snprintf(want, sizeof want, "byte offset %zu", offset);
    if (!strstr(tera_last_error(), want)) fail_msg("message \"%s\" does not name %s", tera_last_error(), want);
}

static void test_invalid_utf8(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    expect_bad_utf8(t, "abc\xff" "def", 7, 3, 0);
    expect_bad_utf8(t, "abc\xe2\x82", 5, 3, 0);          /* truncated at the end */
    expect_bad_utf8(t, "\xc0\xaf", 2, 0, 0);             /* overlong */
    expect_bad_utf8(t, "ok \xed\xa0\x80", 6, 3, 0);      /* surrogate */
    expect_bad_utf8(t, "x \xf5\x80\x80\x80", 6, 2, 0);   /* beyond U+10FFFF */
    expect_bad_utf8(t, "caf\xc3\xa9 \x80", 7, 6, 0);     /* lone continuation */
    /* deep in a long text, serial and parallel */
    size_t n = 100000;
    char *big = malloc(n);
    assert_non_null(big);
    for (size_t i = 0; i < n; i++) big[i] = (i % 41 == 40) ? '\n' : (char)('a' + i % 26);
    big[n - 1] = (char)0xC3;
    expect_bad_utf8(t, big, n, n - 1, 0);
    expect_bad_utf8(t, big, n, n - 1, 1);
    big[n - 1] = 'z';
    big[54321] = (char)0xFE;
    expect_bad_utf8(t, big, n, 54321, 0);
    expect_bad_utf8(t, big, n, 54321, 1);
    free(big);
}

/* ---- (e) training ----------------------------------------------------------------------------- */

static char *default_corpus(size_t *n) {
    char *s = read_all(TERA_SOURCE_DIR "/data/default_corpus.txt", n);
    assert_non_null(s);
    return s;
}

static void assert_same_merges(const tera_tokenizer *a, const tera_tokenizer *b) {
    assert_int_equal(tera_tokenizer_vocab_size(a), tera_tokenizer_vocab_size(b));
    assert_int_equal(tera_tokenizer_n_merges(a), tera_tokenizer_n_merges(b));
    for (int32_t r = 0; r < tera_tokenizer_n_merges(a); r++) {
        int32_t x[3], y[3];
        tera_tokenizer_merge(a, r, &x[0], &x[1], &x[2]);
        tera_tokenizer_merge(b, r, &y[0], &y[1], &y[2]);
        assert_memory_equal(x, y, sizeof x);
    }
    for (int32_t id = 0; id < tera_tokenizer_vocab_size(a); id++) {
        size_t na, nb;
        const char *sa = tera_tokenizer_token(a, id, &na), *sb = tera_tokenizer_token(b, id, &nb);
        assert_int_equal(na, nb);
        assert_memory_equal(sa, sb, na);
    }
}

/* Hand-counted: words "ab", " ab" x2, " cd"; (a,b)=3, then (" ",ab)=2, then the tie (" ",c) vs
 * (c,d) at 1 goes to the smaller bytes " " < "c", then (" c",d); nothing is left after that. */
static void test_train_small_exact(void **state) {
    (void)state;
    const char *texts[] = {"ab ab ab cd"};
    size_t lens[] = {strlen(texts[0])};
    tera_tokenizer *t;
    assert_int_equal(tera_tokenizer_train(&t, texts, lens, 1, 300), TERA_OK);
    const char *want[][3] = {{"a", "b", "ab"}, {" ", "ab", " ab"}, {" ", "c", " c"}, {" c", "d", " cd"}};
    assert_int_equal(tera_tokenizer_n_merges(t), 4);
    assert_int_equal(tera_tokenizer_vocab_size(t), 256 + 4 + 1);
    assert_int_equal(tera_tokenizer_eot(t), 260);
    for (int r = 0; r < 4; r++) {
        int32_t ids[3];
        tera_tokenizer_merge(t, r, &ids[0], &ids[1], &ids[2]);
        for (int k = 0; k < 3; k++) {
            size_t n;
            const char *s = tera_tokenizer_token(t, ids[k], &n);
            assert_int_equal(n, strlen(want[r][k]));
            assert_memory_equal(s, want[r][k], n);
        }
    }
    size_t m;
    int32_t *ids = enc(t, "ab cd ab", 8, 0, &m);
    assert_int_equal(m, 3);
    free(ids);
    tera_tokenizer_free(t);
}

static void test_train_corpus(void **state) {
    (void)state;
    size_t n;
    char *corpus = default_corpus(&n);
    const char *texts[] = {corpus, "second <|endoftext|> document", ""};
    size_t lens[] = {n, strlen(texts[1]), 0};
    tera_tokenizer *a, *b, *c;
    assert_int_equal(tera_tokenizer_train(&a, texts, lens, 3, 700), TERA_OK);
    assert_int_equal(tera_tokenizer_train(&b, texts, lens, 3, 700), TERA_OK);
    assert_int_equal(tera_tokenizer_vocab_size(a), 700);
    assert_int_equal(tera_tokenizer_eot(a), 699);
    assert_same_merges(a, b);
    /* every merge joins two earlier tokens */
    for (int32_t r = 0; r < tera_tokenizer_n_merges(a); r++) {
        int32_t l, rt, res;
        tera_tokenizer_merge(a, r, &l, &rt, &res);
        size_t nl, nr, nres;
        const char *sl = tera_tokenizer_token(a, l, &nl), *sr = tera_tokenizer_token(a, rt, &nr);
        const char *sres = tera_tokenizer_token(a, res, &nres);
        assert_int_equal(nres, nl + nr);
        assert_memory_equal(sres, sl, nl);
        assert_memory_equal(sres + nl, sr, nr);
    }
    size_t m;
    int32_t *ids = enc(a, corpus, n, 0, &m);
    assert_true(m < n / 2); /* 700 tokens compress Shakespeare by more than 2x */
    assert_round_trip(a, corpus, n);
    assert_round_trip(a, g_cases[0].text, strlen(g_cases[0].text));
    /* save / load: same vocabulary, same merges, same ids */
    char dir[512];
    snprintf(dir, sizeof dir, "%s/trained", g_dir);
    assert_int_equal(tera_tokenizer_save(a, dir), TERA_OK);
    assert_int_equal(tera_tokenizer_load(&c, dir), TERA_OK);
    assert_same_merges(a, c);
    assert_int_equal(tera_tokenizer_eot(c), 699);
    size_t m2;
    int32_t *ids2 = enc(c, corpus, n, 0, &m2);
    assert_int_equal(m, m2);
    assert_memory_equal(ids, ids2, m * sizeof *ids);
    free(ids), free(ids2), free(corpus);
    tera_tokenizer_free(a), tera_tokenizer_free(b), tera_tokenizer_free(c);
}

static void test_train_errors(void **state) {
    (void)state;
    const char *texts[] = {"fine", "bad \xff here"};
    size_t lens[] = {4, 10};
    tera_tokenizer *t = (tera_tokenizer *)1;
    assert_int_equal(tera_tokenizer_train(&t, texts, lens, 2, 300), TERA_ERR_FORMAT);
    assert_null(t);
    assert_non_null(strstr(tera_last_error(), "text 1"));
    assert_non_null(strstr(tera_last_error(), "byte offset 4"));
    assert_int_equal(tera_tokenizer_train(&t, texts, lens, 1, 256), TERA_ERR_ARG);
}

/* Errors name the file when the caller gives names; a training set without any text is refused. */
static void test_train_named_errors(void **state) {
    (void)state;
    const char *texts[] = {"fine", "bad \xff here", ""};
    size_t lens[] = {4, 10, 0};
    const char *names[] = {"a.txt", "b.txt", "empty.txt"};
    tera_tokenizer *t = (tera_tokenizer *)1;
    assert_int_equal(tera_tokenizer_train_named(&t, texts, lens, names, 2, 300), TERA_ERR_FORMAT);
    assert_null(t);
    assert_non_null(strstr(tera_last_error(), "'b.txt'"));
    assert_non_null(strstr(tera_last_error(), "byte offset 4"));
    assert_int_equal(tera_tokenizer_train_named(&t, texts + 2, lens + 2, names + 2, 1, 300), TERA_ERR_FORMAT);
    assert_null(t);
    assert_non_null(strstr(tera_last_error(), "'empty.txt' is empty"));
    assert_int_equal(tera_tokenizer_train(&t, texts + 2, lens + 2, 1, 300), TERA_ERR_FORMAT);
    assert_null(t);
    /* an empty text next to others is fine */
    assert_int_equal(tera_tokenizer_train_named(&t, texts, lens, names, 1, 300), TERA_OK);
    tera_tokenizer_free(t);
}

/* The entries of directory d other than "." and ".." whose name contains `part`. */
static int count_entries(const char *d, const char *part) {
    DIR *dp = opendir(d);
    assert_non_null(dp);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dp)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strstr(e->d_name, part)) n++;
    closedir(dp);
    return n;
}

/* Saving replaces a tokenizer as a whole, keeps other files, and a failed save (a write past the
 * file-size limit: EFBIG, as on a full disk) leaves the old tokenizer and nothing else behind. */
static void test_save_atomic(void **state) {
    (void)state;
    size_t n;
    char *corpus = default_corpus(&n);
    const char *texts[] = {corpus};
    tera_tokenizer *small, *big, *u;
    assert_int_equal(tera_tokenizer_train(&small, texts, &n, 1, 300), TERA_OK);
    assert_int_equal(tera_tokenizer_train(&big, texts, &n, 1, 1000), TERA_OK);
    char dir[700], base[300], notes[800];
    snprintf(base, sizeof base, "%s/atomic", g_dir);
    snprintf(dir, sizeof dir, "%s/a/b/tok/", base); /* missing parents, a trailing slash */
    assert_int_equal(tera_tokenizer_save(small, dir), TERA_OK);
    assert_int_equal(tera_tokenizer_save(big, dir), TERA_OK); /* swapped whole */
    assert_int_equal(tera_tokenizer_load(&u, dir), TERA_OK);
    assert_same_merges(big, u);
    tera_tokenizer_free(u);
    snprintf(dir, sizeof dir, "%s/a/b/tok", base);
    assert_int_equal(count_entries(dir, ""), 2);
    snprintf(notes, sizeof notes, "%s/notes.txt", dir);
    write_all(notes, "precious");
    assert_int_equal(tera_tokenizer_save(small, dir), TERA_OK); /* file by file: notes.txt stays */
    assert_int_equal(tera_tokenizer_load(&u, dir), TERA_OK);
    assert_same_merges(small, u);
    tera_tokenizer_free(u);
    size_t k;
    char *kept = read_all(notes, &k);
    assert_non_null(kept);
    assert_int_equal(k, 8);
    free(kept);
    assert_int_equal(count_entries(dir, ""), 3);
    /* a full disk: encoder.json of `big` is larger than the 4 KiB limit */
    char enc_path[800];
    snprintf(enc_path, sizeof enc_path, "%s/encoder.json", dir);
    size_t before_n, after_n;
    char *before = read_all(enc_path, &before_n);
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = 4096;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    tera_status st = tera_tokenizer_save(big, dir);
    char fresh[700];
    snprintf(fresh, sizeof fresh, "%s/new/x/tok", base);
    tera_status st2 = tera_tokenizer_save(big, fresh);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, prev);
    assert_int_equal(st2, TERA_ERR_IO);
    assert_non_null(strstr(tera_last_error(), "encoder.json"));
    assert_non_null(strstr(tera_last_error(), strerror(EFBIG)));
    assert_int_equal(st, TERA_ERR_IO);
    char *after = read_all(enc_path, &after_n);
    assert_int_equal(before_n, after_n);
    assert_memory_equal(before, after, before_n);
    free(before), free(after);
    assert_int_equal(count_entries(dir, ""), 3);
    snprintf(dir, sizeof dir, "%s/a/b", base);
    assert_int_equal(count_entries(dir, "tmp"), 0);
    assert_int_equal(count_entries(base, "new"), 0); /* the parents it made are gone too */
    /* a file where the directory should be */
    snprintf(fresh, sizeof fresh, "%s/a/file", base);
    write_all(fresh, "x");
    assert_int_equal(tera_tokenizer_save(small, fresh), TERA_ERR_EXISTS);
    snprintf(dir, sizeof dir, "%s/a", base);
    assert_int_equal(count_entries(dir, "tmp"), 0);
    tera_tokenizer_free(small), tera_tokenizer_free(big), free(corpus);
}

/* GPT-2's own files survive save + load unchanged. */
static void test_gpt2_save_load(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/gpt2", g_dir);
    assert_int_equal(tera_tokenizer_save(t, dir), TERA_OK);
    tera_tokenizer *u;
    assert_int_equal(tera_tokenizer_load(&u, dir), TERA_OK);
    assert_same_merges(t, u);
    assert_int_equal(tera_tokenizer_eot(u), 50256);
    tera_tokenizer_free(u);
}

static void test_load_errors(void **state) {
    (void)state;
    tera_tokenizer *t = (tera_tokenizer *)1;
    char enc_path[512], bpe_path[512];
    snprintf(enc_path, sizeof enc_path, "%s/bad_encoder.json", g_dir);
    snprintf(bpe_path, sizeof bpe_path, "%s/bad_vocab.bpe", g_dir);
    assert_int_equal(tera_tokenizer_load(&t, "/nonexistent/dir"), TERA_ERR_IO);
    assert_null(t);
    write_all(enc_path, "[1, 2]");
    write_all(bpe_path, "#version: 0.2\n");
    assert_int_equal(tera_tokenizer_load_gpt2(&t, enc_path, bpe_path), TERA_ERR_FORMAT);
    assert_non_null(strstr(tera_last_error(), "bad_encoder.json"));
    write_all(enc_path, "{\"a\": 0, \"b\": 0}");
    assert_int_equal(tera_tokenizer_load_gpt2(&t, enc_path, bpe_path), TERA_ERR_FORMAT);
    write_all(enc_path, "{\"a\": 0, \"b\": 1}"); /* bytes missing */
    assert_int_equal(tera_tokenizer_load_gpt2(&t, enc_path, bpe_path), TERA_ERR_FORMAT);
    assert_non_null(strstr(tera_last_error(), "has no token"));
    if (!g_gpt2) return;
    write_all(bpe_path, "#version: 0.2\n\xc4\xa0 t\nq zz\n");
    assert_int_equal(tera_tokenizer_load_gpt2(&t, GPT2_DIR "/encoder.json", bpe_path), TERA_ERR_FORMAT);
    if (!strstr(tera_last_error(), "bad_vocab.bpe:3")) fail_msg("message: %s", tera_last_error());
    write_all(bpe_path, "#version: 0.2\n\xc4\xa0 t\n\xc4\xa0 t\n");
    assert_int_equal(tera_tokenizer_load_gpt2(&t, GPT2_DIR "/encoder.json", bpe_path), TERA_ERR_FORMAT);
    assert_non_null(strstr(tera_last_error(), "repeats"));
    assert_null(t);
}

/* ---- (f) parallel == serial ------------------------------------------------------------------- */

static void assert_parallel_equal(const tera_tokenizer *t, const char *s, size_t n, unsigned flags, int threads,
                                  size_t min_chunk) {
    size_t m1, m2;
    int32_t *a = enc(t, s, n, flags, &m1), *b = NULL;
    assert_int_equal(tok_encode_chunks(t, s, n, flags, threads, min_chunk, &b, &m2), TERA_OK);
    assert_int_equal(m1, m2);
    if (m1) assert_memory_equal(a, b, m1 * sizeof *a);
    free(a), free(b);
}

/* Text full of the cases a careless cut gets wrong: whitespace before newlines (GPT-2's
 * `\s+(?!\S)`), blank lines, special tokens next to newlines. */
static char *tricky_text(size_t *n) {
    static const char *pieces[] = {"word", " ", "  ", "\n", "\n\n", " \n", "  \n  ", "\t\n", "<|endoftext|>",
                                   "Caps", "42", "'s", "\xc3\xa9t\xc3\xa9", "!?", "\xe2\x80\xa8", "x"};
    size_t cap = 200000, k = 0;
    char *s = malloc(cap);
    assert_non_null(s);
    uint64_t rng = 7;
    while (k + 32 < cap) {
        const char *p = pieces[xorshift(&rng) % (sizeof pieces / sizeof pieces[0])];
        memcpy(s + k, p, strlen(p));
        k += strlen(p);
    }
    *n = k;
    return s;
}

static void test_parallel_equals_serial(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    size_t n;
    char *s = tricky_text(&n);
    for (int threads = 2; threads <= 3; threads++) {
        assert_parallel_equal(t, s, n, 0, threads, 16);
        assert_parallel_equal(t, s, n, TERA_TOK_ALLOW_SPECIAL, threads, 16);
        assert_parallel_equal(t, s, n, TERA_TOK_ALLOW_SPECIAL, threads, 5000);
    }
    free(s);
    char *ts = read_all(TERA_SHARED_DIR "/data/tinyshakespeare.txt", &n);
    if (ts) {
        assert_parallel_equal(t, ts, n, 0, 2, 1000);
        size_t m1, m2;
        int32_t *a = enc(t, ts, n, 0, &m1), *b = NULL;
        assert_int_equal(tera_tokenizer_encode_parallel(t, ts, n, 0, 0, &b, &m2), TERA_OK);
        assert_int_equal(m1, m2);
        assert_memory_equal(a, b, m1 * sizeof *a);
        free(a), free(b), free(ts);
    }
    assert_parallel_equal(t, "", 0, 0, 2, 1);
    assert_parallel_equal(t, "no newline at all", 17, 0, 2, 1);
}

/* Words far longer than the array-scan limit go through the heap path. */
static void test_long_words(void **state) {
    (void)state;
    const tera_tokenizer *t = need_gpt2();
    size_t n = 300000;
    char *s = malloc(n);
    assert_non_null(s);
    for (size_t i = 0; i < n; i++) s[i] = (char)('a' + (i * 7 + i / 13) % 26);
    assert_round_trip(t, s, n);
    memset(s, ' ', n);
    assert_round_trip(t, s, n); /* one whitespace run */
    /* a 100-byte word (heap path); ids from the independent Python GPT-2 BPE */
    static const char *word = "obtofccnkwuobeerehhtefrhnqxqkrbkxwhoxtcxonnrwucuobroqkxhqbkbqhtotbhqxxteteooexrbhubnho"
                              "irkoohwioqchic";
    static const int32_t want[] = {672,   1462, 69,   535,   77,   74,    43812, 5910,  567,  12337, 660,  8310,
                                   21116, 80,   87,   80,    74,   26145, 74,    87,    8727, 742,   66,   23813,
                                   77,    31653, 1229, 84,   672,   305,  80,    74,    87,   71,    80,   65,
                                   32812, 80,   4352, 313,   34369, 80,   87,    742,   14471, 2238, 1069,  26145,
                                   40140, 77,   8873, 343,   7204,  1219, 86,    952,   80,   354,   291};
    size_t m;
    int32_t *ids = enc(t, word, strlen(word), 0, &m);
    assert_int_equal(strlen(word), 100);
    assert_int_equal(m, sizeof want / sizeof want[0]);
    assert_memory_equal(ids, want, sizeof want);
    free(ids);
    memset(s, 'a', n);
    ids = enc(t, s, 4000, 0, &m); /* "a" x 4000 = 1000 x "aaaa" (24794) per GPT-2 */
    assert_int_equal(m, 1000);
    for (size_t i = 0; i < m; i++) assert_int_equal(ids[i], 24794);
    free(ids);
    free(s);
}

/* ---- main ------------------------------------------------------------------------------------- */

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static int group_setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/tera_test_tokenizer_XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    if (access(GPT2_DIR "/encoder.json", R_OK) == 0 &&
        tera_tokenizer_load_gpt2(&g_gpt2, GPT2_DIR "/encoder.json", GPT2_DIR "/vocab.bpe") != TERA_OK) {
        fprintf(stderr, "loading GPT-2: %s\n", tera_last_error());
        return -1;
    }
    return 0;
}

static int group_teardown(void **state) {
    (void)state;
    tera_tokenizer_free(g_gpt2);
    nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpt2_tinyshakespeare),
        cmocka_unit_test(test_gpt2_strings),
        cmocka_unit_test(test_gpt2_special_tokens),
        cmocka_unit_test(test_round_trip_random_utf8),
        cmocka_unit_test(test_round_trip_every_byte),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_train_small_exact),
        cmocka_unit_test(test_train_corpus),
        cmocka_unit_test(test_train_errors),
        cmocka_unit_test(test_train_named_errors),
        cmocka_unit_test(test_save_atomic),
        cmocka_unit_test(test_gpt2_save_load),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_parallel_equals_serial),
        cmocka_unit_test(test_long_words),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
