/* Shared by `tera generate` (cmd_generate.c) and `tera eval --task` (cmd_evaltask.c): a model
 * loaded whole into one process from a checkpoint, a run directory or a Hugging Face directory,
 * with its tokenizer. */
#ifndef TERA_CLI_GENERATE_H
#define TERA_CLI_GENERATE_H

#include <stdint.h>
#include <stdio.h>

#include "tera/config.h"
#include "tera/model.h"
#include "tera/tokenizer.h"

typedef struct {
    tera_config cfg;          /* the model section from the directory's config.json */
    tera_model model;         /* one process, B = T = 1 (the decoder brings its own activations) */
    tera_tokenizer *tok;      /* NULL: bytes (token id = byte value) */
    char dir[TERA_PATH_MAX];  /* the checkpoint or Hugging Face directory the weights came from */
    char tok_dir[TERA_PATH_MAX]; /* where the tokenizer came from ("bytes" for bytes) */
    int32_t eot;              /* the end-of-document token, -1: none */
} tera_gen_model;

/* Resolves `from` (a checkpoint: manifest.json; a run directory: its newest checkpoint that
 * verifies; a Hugging Face directory: config.json), builds the model (cfg's [training] threads) and
 * loads its weights; the tokenizer is `tokenizer` (a directory with encoder.json + vocab.bpe, or
 * "bytes"), else the first of FROM/tokenizer, FROM/encoder.json, RUN/tokenizer, the tokenizer
 * directory next to the run's data.path (where `make run` puts it), else bytes when the vocabulary
 * is 256; else an error asking for --tokenizer. cfg: the command line's configuration. */
tera_status tera_gen_load(tera_gen_model *g, const tera_config *cfg, const char *from, const char *tokenizer);
void tera_gen_free(tera_gen_model *g);
/* Text -> ids (*ids malloc'd; NULL when *n = 0). */
tera_status tera_gen_encode(const tera_gen_model *g, const char *text, size_t len, int32_t **ids, size_t *n);
/* The bytes of token id (bytes: one byte; an id the tokenizer lacks: "[id]") into buf[cap]. */
size_t tera_gen_piece(const tera_gen_model *g, int32_t id, char *buf, size_t cap);

#endif
