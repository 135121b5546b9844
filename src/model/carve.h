/* A size table in two passes over one routine: with base NULL it only counts the bytes; with base
 * set (one allocation of that size) it hands out the pointers in the same order, each 64-byte
 * aligned. The model (model.c) and the decoder (decode.c) carve their buffers this way. */
#ifndef TERA_MODEL_CARVE_H
#define TERA_MODEL_CARVE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    char *base;
    size_t off;
} carver;

static inline void *carve(carver *c, size_t bytes) {
    void *p = c->base ? c->base + c->off : NULL;
    c->off += (bytes + 63) & ~(size_t)63;
    return p;
}
#define CARVE_F(c, n) ((float *)carve((c), sizeof(float) * (size_t)(n)))
#define CARVE_I(c, n) ((int32_t *)carve((c), sizeof(int32_t) * (size_t)(n)))

#endif
