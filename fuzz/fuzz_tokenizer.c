/* libFuzzer target for the GPT-2 BPE tokenizer (not part of the CMake build).
 *
 * Build and run (from the repository root; needs clang and libomp-dev):
 *   clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
 *       -D_GNU_SOURCE -fopenmp -Iinclude -Isrc src/core/status.c src/core/io.c src/data/tokenizer.c \
 *       src/data/tokenizer_encode.c src/data/tokenizer_train.c fuzz/fuzz_tokenizer.c \
 *       -o /tmp/fuzz_tokenizer -lpcre2-8 -lcjson -lxxhash
 *   mkdir -p /tmp/fuzz_corpus && OMP_NUM_THREADS=2 /tmp/fuzz_tokenizer -max_total_time=120 /tmp/fuzz_corpus
 * The GPT-2 files are read from $TERA_SHARED_DIR/data/gpt2 (default ../shared).
 *
 * Input: byte 0 chooses the flags (bit 0: special tokens) and the parallel chunk size (bits 1-4),
 * the rest is the text. Checked for every input:
 *   - encode succeeds exactly when the text is valid UTF-8 (an independent structural check),
 *     and fails with TERA_ERR_FORMAT and no ids otherwise;
 *   - decode(encode(text)) == text; every id is in range;
 *   - the parallel encoder, with tiny chunks, gives the same ids. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/tokenizer_internal.h"
#include "tera/tokenizer.h"

static tera_tokenizer *g_tok;

/* Structural UTF-8 validity (RFC 3629: no overlongs, surrogates or code points > U+10FFFF). */
static int valid_utf8(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        size_t k;
        uint32_t cp, min;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            k = 1, cp = c & 0x1F, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            k = 2, cp = c & 0x0F, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            k = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return 0;
        }
        for (size_t j = 1; j <= k; j++) {
            if (i + j >= n || (s[i + j] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 0;
        i += k + 1;
    }
    return 1;
}

static void die(const char *what) {
    fprintf(stderr, "fuzz_tokenizer: %s (%s)\n", what, tera_last_error());
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *shared = getenv("TERA_SHARED_DIR");
    char enc[1024], bpe[1024];
    snprintf(enc, sizeof enc, "%s/data/gpt2/encoder.json", shared ? shared : "../shared");
    snprintf(bpe, sizeof bpe, "%s/data/gpt2/vocab.bpe", shared ? shared : "../shared");
    if (tera_tokenizer_load_gpt2(&g_tok, enc, bpe) != TERA_OK) die("cannot load GPT-2's files");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    unsigned flags = data[0] & 1 ? TERA_TOK_ALLOW_SPECIAL : 0;
    size_t min_chunk = 1 + ((data[0] >> 1) & 15) * 4;
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    int32_t *ids = NULL;
    size_t m = 0;
    tera_status s = tera_tokenizer_encode(g_tok, text, n, flags, &ids, &m);
    if (!valid_utf8(data + 1, n)) {
        if (s != TERA_ERR_FORMAT || ids || !strstr(tera_last_error(), "byte offset")) die("invalid UTF-8 accepted");
        return 0;
    }
    if (s != TERA_OK) die("valid UTF-8 rejected");
    for (size_t i = 0; i < m; i++)
        if (ids[i] < 0 || ids[i] >= tera_tokenizer_vocab_size(g_tok)) die("id out of range");
    char *back = NULL;
    size_t back_n = 0;
    if (tera_tokenizer_decode(g_tok, ids, m, &back, &back_n) != TERA_OK) die("decode failed");
    if (back_n != n || memcmp(back, text, n) != 0) die("decode(encode(x)) != x");
    int32_t *pids = NULL;
    size_t pm = 0;
    if (tok_encode_chunks(g_tok, text, n, flags, 2, min_chunk, &pids, &pm) != TERA_OK) die("parallel failed");
    if (pm != m || (m && memcmp(pids, ids, m * sizeof *ids) != 0)) die("parallel != serial");
    free(pids);
    free(back);
    free(ids);
    return 0;
}
