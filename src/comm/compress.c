/* Compressed collectives and their number formats (include/tera/compress.h). */
#include "tera/compress.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int tera_compress_parse(const char *name) {
    static const char *const names[] = {"none", "bf16", "fp16", "int8", "fp8"};
    for (int k = 0; k < 5; k++)
        if (!strcmp(name, names[k])) return k;
    return -1;
}

const char *tera_compress_name(tera_compress_kind k) {
    static const char *const names[] = {"none", "bf16", "fp16", "int8", "fp8", "onebit"};
    return k >= 0 && k <= TERA_COMPRESS_ONEBIT ? names[k] : "?";
}

/* ---- scalar formats */
static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t tera_f32_to_bf16(float f) {
    uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                            /* round to nearest even */
    return (uint16_t)(u >> 16);
}

float tera_bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

uint16_t tera_f32_to_f16(float f) {
    uint32_t u = bits_of(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
    if (u == 0x7f800000u) return sign | 0x7c00u; /* infinity */
    if (u >= 0x477fe000u) return sign | 0x7bffu; /* finite beyond 65504: saturate */
    if (u < 0x38800000u) {                       /* below 2^-14: subnormal steps of 2^-24 (exact scaling) */
        const float s = float_of(u) * 16777216.0f;
        return sign | (uint16_t)lrintf(s); /* nearest even; 1024 is the smallest normal's encoding */
    }
    const uint32_t m = u & 0x7fffffu;
    uint32_t h = (((u >> 23) - 112u) << 10) | (m >> 13);
    const uint32_t rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* a carry moves into the exponent: right */
    return sign | (uint16_t)h;
}

float tera_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
    return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

uint8_t tera_f32_to_e4m3(float f) {
    uint32_t u = bits_of(f);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7fu;  /* NaN */
    if (u >= 0x43e00000u) return sign | 0x7eu; /* 448 and beyond (infinity too): saturate */
    if (u < 0x3c800000u) {                     /* below 2^-6: subnormal steps of 2^-9 */
        const float s = float_of(u) * 512.0f;
        return sign | (uint8_t)lrintf(s); /* 8 is the smallest normal's encoding */
    }
    const uint32_t m = u & 0x7fffffu;
    uint32_t h = (((u >> 23) - 120u) << 3) | (m >> 20);
    const uint32_t rem = m & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (h & 1u))) h++;
    if (h > 0x7eu) h = 0x7eu;
    return sign | (uint8_t)h;
}

float tera_e4m3_to_f32(uint8_t q) {
    const uint32_t e = (q >> 3) & 0xfu, m = q & 7u, sign = (uint32_t)(q & 0x80u) << 24;
    if (e == 15 && m == 7) return NAN;
    if (e == 0) { /* subnormal: m x 2^-9 */
        const float v = (float)m * (1.0f / 512.0f);
        return q & 0x80 ? -v : v;
    }
    /* (1 + m/8) x 2^(e-7), a normal float: its bits directly (not ldexpf: a libm call per value,
     * and on this machine's AVX-512 code an SSE transition each time, made fp8 rows 3x slower
     * than fp32 ones in tera bench) */
    return float_of(sign | ((e + 120u) << 23) | (m << 20));
}

/* ---- messages */
int64_t tera_compress_bytes(tera_compress_kind k, int64_t n) {
    switch (k) {
    case TERA_COMPRESS_NONE: return 4 * n;
    case TERA_COMPRESS_BF16:
    case TERA_COMPRESS_FP16: return 2 * n;
    case TERA_COMPRESS_INT8: return n + 4 * ((n + TERA_COMPRESS_BLOCK - 1) / TERA_COMPRESS_BLOCK);
    case TERA_COMPRESS_FP8: return n + 4;
    case TERA_COMPRESS_ONEBIT:
        return 4 * ((n + TERA_ONEBIT_BLOCK - 1) / TERA_ONEBIT_BLOCK) + n / TERA_ONEBIT_BLOCK * (TERA_ONEBIT_BLOCK / 8) +
               (n % TERA_ONEBIT_BLOCK + 7) / 8;
    }
    return 0;
}

/* the residual of v sent as d: 0 where not finite (a NaN step must not poison every later one) */
static float resid(float v, float d) {
    const float r = v - d;
    return isfinite(r) ? r : 0.0f;
}

/* int8 / fp8: one scaled group of n values (x + err) into q with its scale at *scale_out */
static void encode_scaled(int fp8, const float *x, int64_t n, uint8_t *q, void *scale_out, float *err) {
    float v[TERA_COMPRESS_BLOCK];
    float mx = 0.0f;
    int finite = 1;
    for (int64_t i0 = 0; i0 < n; i0 += TERA_COMPRESS_BLOCK) { /* the maximum over the group */
        const int64_t m = n - i0 < TERA_COMPRESS_BLOCK ? n - i0 : TERA_COMPRESS_BLOCK;
        for (int64_t i = 0; i < m; i++) {
            const float a = x[i0 + i] + (err ? err[i0 + i] : 0.0f);
            if (!isfinite(a)) finite = 0;
            else if (fabsf(a) > mx) mx = fabsf(a);
        }
    }
    const float scale = !finite ? NAN : mx / (fp8 ? 448.0f : 127.0f);
    memcpy(scale_out, &scale, 4);
    for (int64_t i0 = 0; i0 < n; i0 += TERA_COMPRESS_BLOCK) {
        const int64_t m = n - i0 < TERA_COMPRESS_BLOCK ? n - i0 : TERA_COMPRESS_BLOCK;
        for (int64_t i = 0; i < m; i++) v[i] = x[i0 + i] + (err ? err[i0 + i] : 0.0f);
        for (int64_t i = 0; i < m; i++) {
            float d;
            if (!finite || scale == 0.0f) {
                q[i0 + i] = 0;
                d = !finite ? NAN : 0.0f;
            } else if (fp8) {
                q[i0 + i] = tera_f32_to_e4m3(v[i] / scale);
                d = tera_e4m3_to_f32(q[i0 + i]) * scale;
            } else {
                float r = rintf(v[i] / scale);
                r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
                q[i0 + i] = (uint8_t)(int8_t)r;
                d = r * scale;
            }
            if (err) err[i0 + i] = resid(v[i], d);
        }
    }
}

/* onebit: one block of m <= TERA_ONEBIT_BLOCK values (x + err): its scale, then its sign bits */
static void encode_sign_block(const float *x, int64_t m, uint8_t *blk, float *err) {
    float v[TERA_ONEBIT_BLOCK];
    float sum = 0.0f;
    for (int64_t i = 0; i < m; i++) {
        v[i] = x[i] + (err ? err[i] : 0.0f);
        sum += fabsf(v[i]); /* a non-finite value makes the sum (and the scale) non-finite */
    }
    const float scale = isfinite(sum) ? sum / (float)m : NAN;
    memcpy(blk, &scale, 4);
    uint8_t *bits = blk + 4;
    memset(bits, 0, (size_t)(m + 7) / 8);
    for (int64_t i = 0; i < m; i++) {
        const int neg = v[i] < 0.0f;
        if (neg) bits[i / 8] |= (uint8_t)(1u << (i % 8));
        if (err) err[i] = isfinite(scale) ? resid(v[i], neg ? -scale : scale) : 0.0f;
    }
}

/* bf16 without error feedback: tera_f32_to_bf16 element by element, in a loop without branches (the
 * same words; the compiler's vectors) */
static void bf16_encode(const float *restrict x, int64_t n, uint8_t *restrict o) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = bits_of(x[i]);
        const uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
        const uint16_t h = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rne);
        memcpy(o + 2 * i, &h, 2);
    }
}

void tera_compress_encode(tera_compress_kind k, const float *x, int64_t n, void *out, float *err) {
    uint8_t *o = out;
    switch (k) {
    case TERA_COMPRESS_NONE:
        memcpy(o, x, sizeof(float) * (size_t)n);
        return;
    case TERA_COMPRESS_BF16:
    case TERA_COMPRESS_FP16:
        if (k == TERA_COMPRESS_BF16 && !err) {
            bf16_encode(x, n, o);
            return;
        }
        for (int64_t i = 0; i < n; i++) {
            const float v = x[i] + (err ? err[i] : 0.0f);
            const uint16_t h = k == TERA_COMPRESS_BF16 ? tera_f32_to_bf16(v) : tera_f32_to_f16(v);
            memcpy(o + 2 * i, &h, 2);
            if (err) err[i] = resid(v, k == TERA_COMPRESS_BF16 ? tera_bf16_to_f32(h) : tera_f16_to_f32(h));
        }
        return;
    case TERA_COMPRESS_INT8: /* per block: scale (4 bytes), then the block's bytes */
        for (int64_t i0 = 0; i0 < n; i0 += TERA_COMPRESS_BLOCK) {
            const int64_t m = n - i0 < TERA_COMPRESS_BLOCK ? n - i0 : TERA_COMPRESS_BLOCK;
            uint8_t *blk = o + i0 + 4 * (i0 / TERA_COMPRESS_BLOCK);
            encode_scaled(0, x + i0, m, blk + 4, blk, err ? err + i0 : NULL);
        }
        return;
    case TERA_COMPRESS_FP8: /* the row's scale, then its bytes */
        encode_scaled(1, x, n, o + 4, o, err);
        return;
    case TERA_COMPRESS_ONEBIT: /* per block: scale (4 bytes), then ceil(m / 8) bytes of signs */
        for (int64_t i0 = 0; i0 < n; i0 += TERA_ONEBIT_BLOCK) {
            const int64_t m = n - i0 < TERA_ONEBIT_BLOCK ? n - i0 : TERA_ONEBIT_BLOCK;
            encode_sign_block(x + i0, m, o + i0 / TERA_ONEBIT_BLOCK * (4 + TERA_ONEBIT_BLOCK / 8), err ? err + i0 : NULL);
        }
        return;
    }
}

static void decode(tera_compress_kind k, const void *in, int64_t n, float *y, int add) {
    const uint8_t *p = in;
    switch (k) {
    case TERA_COMPRESS_NONE:
        for (int64_t i = 0; i < n; i++) {
            float v;
            memcpy(&v, p + 4 * i, 4);
            y[i] = add ? y[i] + v : v;
        }
        return;
    case TERA_COMPRESS_BF16:
    case TERA_COMPRESS_FP16:
        if (k == TERA_COMPRESS_BF16 && !add) { /* the words shifted up: a loop the compiler vectorises */
            for (int64_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, p + 2 * i, 2);
                y[i] = float_of((uint32_t)h << 16);
            }
            return;
        }
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            const float v = k == TERA_COMPRESS_BF16 ? tera_bf16_to_f32(h) : tera_f16_to_f32(h);
            y[i] = add ? y[i] + v : v;
        }
        return;
    case TERA_COMPRESS_INT8:
        for (int64_t i0 = 0; i0 < n; i0 += TERA_COMPRESS_BLOCK) {
            const int64_t m = n - i0 < TERA_COMPRESS_BLOCK ? n - i0 : TERA_COMPRESS_BLOCK;
            const uint8_t *blk = p + i0 + 4 * (i0 / TERA_COMPRESS_BLOCK);
            float s;
            memcpy(&s, blk, 4);
            for (int64_t i = 0; i < m; i++) {
                const float v = !isfinite(s) ? NAN : s == 0.0f ? 0.0f : (float)(int8_t)blk[4 + i] * s;
                y[i0 + i] = add ? y[i0 + i] + v : v;
            }
        }
        return;
    case TERA_COMPRESS_FP8: {
        float s;
        memcpy(&s, p, 4);
        for (int64_t i = 0; i < n; i++) {
            const float v = !isfinite(s) ? NAN : s == 0.0f ? 0.0f : tera_e4m3_to_f32(p[4 + i]) * s;
            y[i] = add ? y[i] + v : v;
        }
        return;
    }
    case TERA_COMPRESS_ONEBIT:
        for (int64_t i0 = 0; i0 < n; i0 += TERA_ONEBIT_BLOCK) {
            const int64_t m = n - i0 < TERA_ONEBIT_BLOCK ? n - i0 : TERA_ONEBIT_BLOCK;
            const uint8_t *blk = p + i0 / TERA_ONEBIT_BLOCK * (4 + TERA_ONEBIT_BLOCK / 8);
            float s;
            memcpy(&s, blk, 4);
            for (int64_t i = 0; i < m; i++) {
                const float v = blk[4 + i / 8] >> (i % 8) & 1u ? -s : s;
                y[i0 + i] = add ? y[i0 + i] + v : v;
            }
        }
        return;
    }
}

void tera_compress_decode(tera_compress_kind k, const void *in, int64_t n, float *y) { decode(k, in, n, y, 0); }
void tera_compress_decode_add(tera_compress_kind k, const void *in, int64_t n, float *y) { decode(k, in, n, y, 1); }

/* ---- the compressed reducer */
struct tera_creducer {
    tera_comm *c;
    tera_compress_kind k;
    int64_t n;         /* the region's floats */
    float *e1, *e2;    /* [n] each: this rank's residuals, the owner's residuals */
    uint8_t *sbuf, *rbuf;
    int64_t scap, rcap; /* their capacities in bytes */
    float *sum;        /* [chunk cap] the owner's sum */
    int64_t sumcap;
    int64_t *cnt, *lo, *sb, *rb; /* [p] each */
    int mean;          /* the owner's value: 1 the mean over the ranks, 0 the sum */
};

static void grow(void **p, int64_t *cap, int64_t need) {
    if (need <= *cap) return; /* the first call of a size: never in a steady state */
    free(*p);
    *p = tera_calloc((size_t)need + 16, 1);
    *cap = need;
}

tera_creducer *tera_creducer_create(tera_comm *c, tera_compress_kind k, int64_t n) {
    tera_creducer *r = tera_calloc(1, sizeof *r);
    const int p = tera_comm_size(c);
    r->c = c, r->k = k, r->n = n;
    r->e1 = tera_calloc((size_t)n + 1, sizeof(float));
    r->e2 = tera_calloc((size_t)n + 1, sizeof(float));
    r->cnt = tera_calloc((size_t)p * 4, sizeof(int64_t));
    r->lo = r->cnt + p, r->sb = r->lo + p, r->rb = r->sb + p;
    /* scratch for a whole-region all-reduce (the largest message) */
    const int64_t chunk = ((n + p - 1) / p + 15) & ~(int64_t)15;
    grow((void **)&r->sbuf, &r->scap, tera_compress_bytes(k, n) + 8 * (int64_t)p);
    grow((void **)&r->rbuf, &r->rcap, (int64_t)p * tera_compress_bytes(k, chunk));
    grow((void **)&r->sum, &r->sumcap, 4 * chunk);
    return r;
}

void tera_creducer_free(tera_creducer *r) {
    if (!r) return;
    free(r->e1), free(r->e2), free(r->sbuf), free(r->rbuf), free(r->sum), free(r->cnt);
    free(r);
}

void tera_creducer_set_mean(tera_creducer *r, int mean) { r->mean = mean; }

float *tera_creducer_state(tera_creducer *r, int which, int64_t *n) {
    *n = r->n;
    return which ? r->e2 : r->e1;
}

/* Steps 1-2 over ranges cnt[j] at lo[j] of buf (region offset off): the owner's fp32 sum in r->sum. */
static void stage1(tera_creducer *r, const float *buf, int64_t off, tera_traffic_kind kind) {
    const int p = tera_comm_size(r->c), me = tera_comm_rank(r->c);
    int64_t sbytes = 0, mx = 0;
    for (int j = 0; j < p; j++) {
        r->sb[j] = tera_compress_bytes(r->k, r->cnt[j]);
        sbytes += r->sb[j];
        if (r->lo[j] + r->cnt[j] > mx) mx = r->lo[j] + r->cnt[j];
    }
    TERA_ASSERTF(off >= 0 && off + mx <= r->n, "compressed reduction of [%ld, %ld) outside a region of %ld", (long)off,
                 (long)(off + mx), (long)r->n);
    const int64_t mine = tera_compress_bytes(r->k, r->cnt[me]);
    for (int j = 0; j < p; j++) r->rb[j] = mine;
    grow((void **)&r->sbuf, &r->scap, sbytes);
    grow((void **)&r->rbuf, &r->rcap, mine * p);
    grow((void **)&r->sum, &r->sumcap, 4 * r->cnt[me]);
    int64_t at = 0;
    for (int j = 0; j < p; j++) {
        tera_compress_encode(r->k, buf + r->lo[j], r->cnt[j], r->sbuf + at, r->e1 + off + r->lo[j]);
        at += r->sb[j];
    }
    tera_comm_alltoallv_u8(r->c, r->sbuf, r->sb, r->rbuf, r->rb, kind);
    if (r->cnt[me] == 0) return;
    tera_compress_decode(r->k, r->rbuf, r->cnt[me], r->sum); /* in rank order: deterministic */
    for (int s = 1; s < p; s++) tera_compress_decode_add(r->k, r->rbuf + s * mine, r->cnt[me], r->sum);
    if (r->mean) {
        const float inv = 1.0f / (float)p;
        for (int64_t i = 0; i < r->cnt[me]; i++) r->sum[i] *= inv;
    }
}

void tera_creducer_allreduce(tera_creducer *r, float *buf, int64_t off, int64_t len) {
    const int p = tera_comm_size(r->c), me = tera_comm_rank(r->c);
    if (len == 0) return;
    const int64_t S = ((len + p - 1) / p + 15) & ~(int64_t)15;
    for (int j = 0; j < p; j++) {
        r->lo[j] = (int64_t)j * S < len ? (int64_t)j * S : len;
        r->cnt[j] = (r->lo[j] + S < len ? r->lo[j] + S : len) - r->lo[j];
    }
    stage1(r, buf, off, TERA_TRAFFIC_ALLREDUCE);
    /* step 3: the owner's sum, compressed again with its own residuals, to every rank */
    int64_t at = 0;
    for (int j = 0; j < me; j++) at += r->sb[j];
    if (r->cnt[me] > 0) tera_compress_encode(r->k, r->sum, r->cnt[me], r->sbuf + at, r->e2 + off + r->lo[me]);
    tera_comm_allgatherv_u8(r->c, r->sbuf, r->sb, TERA_TRAFFIC_ALLREDUCE);
    at = 0;
    for (int j = 0; j < p; j++) {
        tera_compress_decode(r->k, r->sbuf + at, r->cnt[j], buf + r->lo[j]);
        at += r->sb[j];
    }
}

void tera_creducer_reduce_scatter(tera_creducer *r, float *buf, int64_t off, const int64_t *counts) {
    const int p = tera_comm_size(r->c), me = tera_comm_rank(r->c);
    int64_t lo = 0;
    for (int j = 0; j < p; j++) r->cnt[j] = counts[j], r->lo[j] = lo, lo += counts[j];
    if (lo == 0) return;
    stage1(r, buf, off, TERA_TRAFFIC_REDUCE_SCATTER);
    if (r->cnt[me] > 0) memcpy(buf + r->lo[me], r->sum, sizeof(float) * (size_t)r->cnt[me]);
}
