/* libFuzzer target: the Megatron .idx/.bin parser (tera_source_open) on arbitrary bytes.
 * The input is split: the first 2 bytes give the .idx length n; bytes [2, 2+n) are the .idx and the
 * rest is the .bin. The parser must refuse or accept without crashing or reading out of bounds.
 *
 * Build and run (from the repository root; needs clang):
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -D_GNU_SOURCE -Iinclude -Isrc fuzz/fuzz_idx.c \
 *       src/data/source.c src/core/status.c -o /tmp/fuzz_idx
 *   mkdir -p /tmp/fuzz_idx_corpus && /tmp/fuzz_idx -max_total_time=120 /tmp/fuzz_idx_corpus
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tera/data.h"

const unsigned char tera_default_corpus[] = "x";
const size_t tera_default_corpus_len = 1;

static char g_prefix[64];

static int write_all(const char *path, const uint8_t *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(p, 1, n, f);
    fclose(f);
    return w == n ? 0 : -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_prefix[0]) snprintf(g_prefix, sizeof g_prefix, "/tmp/fuzz_idx_%d", (int)getpid());
    if (size < 2) return 0;
    size_t n = (size_t)data[0] | (size_t)data[1] << 8;
    if (n > size - 2) n = size - 2;
    char idx[96], bin[96];
    snprintf(idx, sizeof idx, "%s.idx", g_prefix);
    snprintf(bin, sizeof bin, "%s.bin", g_prefix);
    if (write_all(idx, data + 2, n) || write_all(bin, data + 2 + n, size - 2 - n)) return 0;
    tera_data_config dc;
    memset(&dc, 0, sizeof dc);
    snprintf(dc.path, sizeof dc.path, "%s", g_prefix);
    snprintf(dc.format, sizeof dc.format, "bin");
    tera_token_source s;
    if (tera_source_open(&s, &dc, 1 << 20) == TERA_OK) {
        /* every token of an accepted source is readable and in range */
        for (int64_t i = 0; i < s.n_tokens; i++)
            if (tera_source_token(&s, i) < 0) __builtin_trap();
        tera_source_close(&s);
    }
    return 0;
}
