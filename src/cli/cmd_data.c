/* tera data prepare / tera tokenizer train|encode|decode */
#include <errno.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "tera/prepare.h"
#include "tera/tokenizer.h"

#define MAX_INPUTS 4096

/* Options of these commands: --input FILE... (one or more files, and repeatable), single-valued
 * others, the flags --force and --allow-special. */
typedef struct {
    const char *inputs[MAX_INPUTS];
    int n_inputs;
    const char *output, *tokenizer, *field;
    int vocab_size, threads, force, allow_special;
} data_args;

static int add_input(data_args *a, const char *v) {
    if (a->n_inputs == MAX_INPUTS) {
        tera_fail(TERA_ERR_ARG, "at most %d --input files", MAX_INPUTS);
        return tera_cli_error();
    }
    if (!*v) {
        tera_fail(TERA_ERR_ARG, "--input: empty file name");
        return tera_cli_error();
    }
    a->inputs[a->n_inputs++] = v;
    return 0;
}

static int parse(int argc, char **argv, data_args *a) {
    memset(a, 0, sizeof *a);
    a->field = "text";
    for (int i = 0; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "--force")) {
            a->force = 1;
            continue;
        }
        if (!strcmp(k, "--allow-special")) {
            a->allow_special = 1;
            continue;
        }
        const char *v = NULL;
        const char *eq = strchr(k, '=');
        char key[64];
        if (strncmp(k, "--", 2) != 0) {
            tera_fail(TERA_ERR_ARG, "unexpected argument '%s'", k);
            return tera_cli_error();
        }
        if (eq) {
            snprintf(key, sizeof key, "%.*s", (int)(eq - k), k);
            v = eq + 1;
        } else {
            snprintf(key, sizeof key, "%s", k);
            if (i + 1 >= argc) {
                tera_fail(TERA_ERR_ARG, "%s needs a value", k);
                return tera_cli_error();
            }
            v = argv[++i];
        }
        if (!strcmp(key, "--input")) { /* --input A B C: every following argument up to the next option */
            if (!eq && !strncmp(v, "--", 2)) {
                tera_fail(TERA_ERR_ARG, "--input needs a file before '%s'", v);
                return tera_cli_error();
            }
            if (add_input(a, v)) return 1;
            while (!eq && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0)
                if (add_input(a, argv[++i])) return 1;
        } else if (!strcmp(key, "--output")) {
            a->output = v;
        } else if (!strcmp(key, "--tokenizer")) {
            a->tokenizer = v;
        } else if (!strcmp(key, "--field")) {
            a->field = v;
        } else if (!strcmp(key, "--vocab-size") || !strcmp(key, "--threads")) {
            char *end;
            long n = strtol(v, &end, 10);
            if (*end || n < (key[2] == 'v' ? 257 : 0) || n > 16777216) {
                tera_fail(TERA_ERR_ARG, "%s = '%s' is not a valid %s", key, v,
                          key[2] == 'v' ? "vocabulary size (257 .. 16777216)" : "thread count");
                return tera_cli_error();
            }
            if (key[2] == 'v')
                a->vocab_size = (int)n;
            else
                a->threads = (int)n;
        } else {
            tera_fail(TERA_ERR_ARG, "unknown option '%s'", key);
            return tera_cli_error();
        }
    }
    return 0;
}

static tera_status load_tokenizer(const char *spec, tera_tokenizer **t) {
    *t = NULL;
    if (!spec || !strcmp(spec, "bytes")) return TERA_OK;
    return tera_tokenizer_load(t, spec);
}

/* Refuses to replace an existing output unless --force (prints the message; returns non-zero). */
static int refuse_existing(const char *what, const char *path, int force) {
    return tera_cli_refuse_output(what, path, force, NULL);
}

static int data_prepare(int argc, char **argv) {
    data_args a;
    if (parse(argc, argv, &a)) return 1;
    if (!a.n_inputs || !a.output) {
        tera_fail(TERA_ERR_ARG, "data prepare needs --input FILE... and --output PREFIX");
        return tera_cli_error();
    }
    /* every file the dataset writes (an existing .bin may be another dataset, or this command's input) */
    static const char *const ext[] = {"idx", "bin", "xxh3"};
    for (int i = 0; i < 3; i++) {
        char out[1100];
        snprintf(out, sizeof out, "%s.%s", a.output, ext[i]);
        if (refuse_existing("dataset file", out, a.force)) return 1;
    }
    tera_tokenizer *tok;
    if (load_tokenizer(a.tokenizer, &tok) != TERA_OK) return tera_cli_error();
    tera_prepare_opts o = {.inputs = a.inputs, .n_inputs = a.n_inputs, .output = a.output, .field = a.field,
                           .tok = tok, .threads = a.threads, .progress = 1,
                           .allow_special = a.allow_special};
    tera_prepare_stats s;
    tera_status st = tera_data_prepare(&o, &s);
    tera_tokenizer_free(tok);
    if (st != TERA_OK) return tera_cli_error();
    fprintf(stderr, "tera: wrote %s.{bin,idx,xxh3}: %ld documents, %ld tokens from %.1f MB in %.2f s (%.1f MB/s)\n",
            a.output, (long)s.documents, (long)s.tokens, s.bytes / 1e6, s.seconds,
            s.seconds > 0 ? s.bytes / 1e6 / s.seconds : 0.0);
    return 0;
}

/* Reads a whole file (every byte, as data prepare does). */
static tera_status read_all(const char *path, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return tera_fail(TERA_ERR_IO, "cannot open input '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return tera_fail(TERA_ERR_IO, "input '%s' is not a regular file", path);
    }
    size_t cap = (size_t)sb.st_size + 1, n = 0, k;
    char *buf = tera_malloc(cap);
    while ((k = fread(buf + n, 1, cap - n, f)) > 0) {
        n += k;
        if (n == cap) { /* grew since fstat */
            char *g = tera_malloc(cap * 2);
            memcpy(g, buf, n);
            free(buf);
            buf = g;
            cap *= 2;
        }
    }
    int e = errno, bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return tera_fail(TERA_ERR_IO, "cannot read input '%s': %s", path, strerror(e));
    }
    *text = buf;
    *len = n;
    return TERA_OK;
}

static int tokenizer_train(int argc, char **argv) {
    data_args a;
    if (parse(argc, argv, &a)) return 1;
    if (!a.n_inputs || !a.output || !a.vocab_size) {
        tera_fail(TERA_ERR_ARG, "tokenizer train needs --input FILE..., --vocab-size N and --output DIR");
        return tera_cli_error();
    }
    static const char *const files[] = {"encoder.json", "vocab.bpe"}; /* both files the tokenizer writes */
    for (int i = 0; i < 2; i++) {
        char out[1100];
        snprintf(out, sizeof out, "%s/%s", a.output, files[i]);
        if (refuse_existing("tokenizer file", out, a.force)) return 1;
    }
    char **texts = tera_calloc((size_t)a.n_inputs, sizeof(char *));
    size_t *lens = tera_calloc((size_t)a.n_inputs, sizeof(size_t));
    tera_status st = TERA_OK;
    size_t total = 0;
    for (int i = 0; i < a.n_inputs && st == TERA_OK; i++) {
        st = read_all(a.inputs[i], &texts[i], &lens[i]);
        total += lens[i];
    }
    for (int i = 0; i < a.n_inputs && st == TERA_OK && total > 0; i++) /* all empty: refused below */
        if (lens[i] == 0) fprintf(stderr, "tera: warning: input '%s' is empty; skipped\n", a.inputs[i]);
    tera_tokenizer *t = NULL;
    if (st == TERA_OK)
        st = tera_tokenizer_train_named(&t, (const char *const *)texts, lens, a.inputs, a.n_inputs, a.vocab_size);
    if (st == TERA_OK) st = tera_tokenizer_save(t, a.output);
    for (int i = 0; i < a.n_inputs; i++) free(texts[i]);
    free(texts);
    free(lens);
    if (st != TERA_OK) {
        tera_tokenizer_free(t);
        return tera_cli_error();
    }
    fprintf(stderr, "tera: trained a %d-token byte-level BPE vocabulary (%d merges) into %s\n",
            tera_tokenizer_vocab_size(t), tera_tokenizer_n_merges(t), a.output);
    tera_tokenizer_free(t);
    return 0;
}

/* encode: text on stdin -> ids on stdout; decode: ids on stdin -> text on stdout */
static int tokenizer_codec(int argc, char **argv, int encode) {
    data_args a;
    if (parse(argc, argv, &a)) return 1;
    if (!a.tokenizer) {
        tera_fail(TERA_ERR_ARG, "--tokenizer DIR|bytes is required");
        return tera_cli_error();
    }
    if (!encode && a.allow_special) { /* decode prints every id as its text: there is nothing to allow */
        tera_fail(TERA_ERR_ARG, "--allow-special applies to encode (and data prepare), not to decode");
        return tera_cli_error();
    }
    tera_tokenizer *t; /* NULL: "bytes", each byte its own id (as data prepare and generate take it) */
    if (load_tokenizer(a.tokenizer, &t) != TERA_OK) return tera_cli_error();
    size_t cap = 1 << 16, n = 0;
    char *in = tera_malloc(cap);
    size_t k;
    while ((k = fread(in + n, 1, cap - n, stdin)) > 0) {
        n += k;
        if (n == cap) {
            char *g = tera_malloc(cap * 2);
            memcpy(g, in, n);
            free(in);
            in = g;
            cap *= 2;
        }
    }
    in[n] = '\0'; /* n < cap (the buffer grows when full): strtol below stops at the end of the input */
    if (ferror(stdin)) {
        tera_fail(TERA_ERR_IO, "cannot read stdin: %s", strerror(errno));
        free(in);
        tera_tokenizer_free(t);
        return tera_cli_error();
    }
    tera_status st;
    if (encode) {
        int32_t *ids;
        size_t m;
        if (t) {
            st = tera_tokenizer_encode(t, in, n, a.allow_special ? TERA_TOK_ALLOW_SPECIAL : 0, &ids, &m);
        } else {
            ids = tera_malloc(sizeof(int32_t) * (n + 1)), m = n, st = TERA_OK;
            for (size_t i = 0; i < n; i++) ids[i] = (unsigned char)in[i];
        }
        if (st == TERA_OK) {
            for (size_t i = 0; i < m; i++) printf(i ? " %d" : "%d", ids[i]);
            printf("\n");
            free(ids);
        }
    } else {
        size_t m = 0, mcap = 1024;
        int32_t *ids = tera_malloc(sizeof(int32_t) * mcap);
        char *p = in, *end = in + n;
        st = TERA_OK;
        while (p < end) {
            char *q;
            long v = strtol(p, &q, 10);
            if (q == p) {
                if (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') {
                    p++;
                    continue;
                }
                st = tera_fail(TERA_ERR_FORMAT, "stdin: byte %ld: expected a token id", (long)(p - in));
                break;
            }
            if (m == mcap) {
                int32_t *g = tera_malloc(sizeof(int32_t) * mcap * 2);
                memcpy(g, ids, sizeof(int32_t) * m);
                free(ids);
                ids = g;
                mcap *= 2;
            }
            /* the vocabulary's bound here, not only in tera_tokenizer_decode: the first bad id in order is named */
            if (v < 0 || v > (t ? tera_tokenizer_vocab_size(t) - 1L : 255L)) {
                const char *s0 = p; /* strtol skipped the blanks before the number */
                while (s0 < q && (*s0 == ' ' || *s0 == '\n' || *s0 == '\t' || *s0 == '\r')) s0++;
                st = tera_fail(TERA_ERR_FORMAT, "stdin: byte %ld: token id %.*s is not in 0..%ld%s", (long)(s0 - in),
                               (int)(q - s0 < 40 ? q - s0 : 40), s0, t ? tera_tokenizer_vocab_size(t) - 1L : 255L,
                               t ? " (the tokenizer's vocabulary)" : " (--tokenizer bytes)");
                break;
            }
            ids[m++] = (int32_t)v;
            p = q;
        }
        char *text;
        size_t tl;
        if (st == TERA_OK && t) {
            st = tera_tokenizer_decode(t, ids, m, &text, &tl);
        } else if (st == TERA_OK) {
            text = tera_malloc(m + 1), tl = m;
            for (size_t i = 0; i < m; i++) text[i] = (char)ids[i];
        }
        if (st == TERA_OK) {
            fwrite(text, 1, tl, stdout);
            free(text);
        }
        free(ids);
    }
    free(in);
    tera_tokenizer_free(t);
    if (st == TERA_OK && (fflush(stdout) != 0 || ferror(stdout)))
        st = tera_fail(TERA_ERR_IO, "cannot write stdout: %s", strerror(errno));
    return st == TERA_OK ? 0 : tera_cli_error();
}

int tera_cmd_data(int argc, char **argv) {
    if (argc >= 1 && !strcmp(argv[0], "prepare")) return data_prepare(argc - 1, argv + 1);
    tera_fail(TERA_ERR_ARG, "usage: tera data prepare --input FILE... --output PREFIX [--tokenizer DIR|bytes] "
                            "[--field NAME] [--threads N] [--allow-special] [--force]");
    return tera_cli_error();
}

int tera_cmd_tokenizer(int argc, char **argv) {
    if (argc >= 1 && !strcmp(argv[0], "train")) return tokenizer_train(argc - 1, argv + 1);
    if (argc >= 1 && !strcmp(argv[0], "encode")) return tokenizer_codec(argc - 1, argv + 1, 1);
    if (argc >= 1 && !strcmp(argv[0], "decode")) return tokenizer_codec(argc - 1, argv + 1, 0);
    tera_fail(TERA_ERR_ARG, "usage: tera tokenizer train --input FILE... --vocab-size N --output DIR [--force] | "
                            "encode --tokenizer DIR|bytes [--allow-special] < text | decode --tokenizer DIR|bytes < ids");
    return tera_cli_error();
}
