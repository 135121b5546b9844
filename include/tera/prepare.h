/* `tera data prepare`: text or JSON-lines files -> a Megatron-compatible .bin/.idx dataset. */
#ifndef TERA_PREPARE_H
#define TERA_PREPARE_H

#include <stdint.h>

#include "tera/status.h"
#include "tera/tokenizer.h"

typedef struct {
    const char *const *inputs;   /* files: *.jsonl / *.json = one document per line (field `field`),
                                    anything else = one document per file */
    int n_inputs;
    const char *output;          /* dataset prefix: PREFIX.bin, PREFIX.idx, PREFIX.xxh3 */
    const char *field;           /* JSON-lines text field ("text") */
    const tera_tokenizer *tok;   /* NULL: byte-level tokens (id = byte value), no end-of-document */
    int threads;                 /* encoding threads (<= 0: all cores) */
    int progress;                /* progress bar on stderr */
    int allow_special;           /* map special-token text ("<|endoftext|>") in documents to its id
                                    (TERA_TOK_ALLOW_SPECIAL); 0: encode it as ordinary text, as
                                    `tera tokenizer encode` does without --allow-special */
} tera_prepare_opts;

typedef struct {
    int64_t documents, tokens, bytes;
    double seconds;
} tera_prepare_stats;

/* Encodes every document, appends the end-of-document token after each (when the tokenizer has
 * one), and writes the dataset atomically (nothing is left at PREFIX on failure). Empty documents
 * (an empty text file, a JSON line whose field is "") are skipped with a warning on stderr naming
 * the file (and line); blank JSON lines are skipped silently. A dataset without any document is
 * refused, naming the input(s). Errors name the file and line/byte offset: unreadable input,
 * invalid JSON, a line without the field, invalid UTF-8. */
tera_status tera_data_prepare(const tera_prepare_opts *o, tera_prepare_stats *stats);

#endif
