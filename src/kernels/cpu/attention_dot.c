/* ------------------------------------------------------------------ bf16 attention on AVX512-BF16 dot products
 *
 * tera_attention_forward_bf16 / backward_bf16 (attention.c) run these kernels where the CPU has
 * AVX512-BF16 (VDPBF16PS: 16 lanes, each the sum of two bf16 x bf16 products added to an fp32
 * accumulator) but no usable AMX, and oneDNN's ISA (ONEDNN_MAX_CPU_ISA) includes avx512_core_bf16
 * (attn_dot_on in attention.c; TERA_ATTN_BF16=onednn keeps the oneDNN per-tile products for A/B).
 *
 * The schedule and the layouts are those of the AMX kernels (attention.c, the end): DT x DT tiles,
 * scores transposed (S^T [keys, query rows], the query rows in the vector lanes, so that the softmax
 * statistics are per-lane vectors), tasks (b, h) or (b, h, query tile) forward and (b, kv head)
 * backward, every output element summed by one task in a fixed order: bit-identical for any thread
 * count. Every product has one form (dot_mm):
 *     out[i][l] (+)= sum_p  M[i][2p] * L[p][l][0] + M[i][2p+1] * L[p][l][1]      (l in the lanes)
 * M: bf16 rows whose reduction pairs are adjacent (one 32-bit word, broadcast), L: "VNNI" pairs
 * [P][lanes][2] (the 32-bit words of a vector hold two consecutive reduction elements):
 *   S^T  [keys, rows] = K Q^T        M: K rows [Tp, HP]           L: Q^T pairs of head dims [HP/2, DT]
 *   dP^T [keys, rows] = V dO^T       M: V rows                     L: dO^T pairs (dOv)
 *   O^T  [hd, rows]  += V^T P^T      M: V^T pairs of keys [HP, Tp/2 words]   L: P^T pairs of keys [DT/2, DT]
 *   dQ^T [hd, rows]  += K^T dS^T     M: K^T pairs of keys          L: dS^T pairs of keys
 *   dV   [keys, hd]  += P^T dO       M: P^T bf16 rows [DT, DT]     L: dO pairs of rows [DT/2, HP]
 *   dK   [keys, hd]  += dS^T Q       M: dS^T bf16 rows             L: Q pairs of rows
 * The register block of a product is up to 4 vectors of lanes x 6-16 rows of M (24 accumulators).
 * No block above the diagonal is computed: on the diagonal tile the scores run per 16-key block on the
 * lanes at or after it, the key-reduced products per 16-row lane vector over its keys only, the
 * row-reduced ones per 16-key block over its rows only.
 *
 * Numerics as the other bf16 paths: q, k, v, dO rounded to bf16 (to nearest even) where packed,
 * products accumulated in fp32 (VDPBF16PS rounds after each of its two products' additions), softmax
 * statistics (max, sum, lse), dP, D = rowsum(dO * O) (double, the dO rounded by tera_bf16_rne16) and
 * P, dS before rounding in fp32; P and dS rounded to bf16 as operands of the next products. The
 * operands are rounded by VCVTNEPS2BF16, which flushes subnormals where tera_bf16_rne keeps them;
 * VDPBF16PS reads subnormal inputs as zero either way, so the products see the same operands (as
 * the AMX kernels' tiles). Head dims padded with zeros to HP (a multiple of 16), keys and rows of a
 * tile to DT (the padding masked out of P and dS). Each operand tile is packed from the fp32 inputs
 * per task (a pass converting all inputs to dense bf16 first, as the oneDNN path does, measured no
 * faster: the inputs' first reads dominate either way).
 *
 * By the profile the products run at about the rate of a plain bf16 matrix product (VDPBF16PS); the rest
 * is mostly the softmax's exp (most at small head dims) and the strided first reads of the inputs.
 * The softmax loops are kept short, with the same operations on the same values in the same order:
 * the forward's row max of a tile runs the four row groups' chains interleaved (each over the keys in
 * order), the exp of the keys that see all 16 rows of a group (below the diagonal block, all rows
 * live) runs without masks (the forward's 8 keys a step), the exp is vexp16 less three instructions
 * that change no bit (vexp16_live), and dS's key pairs (dSv) are interleaved from its halves already
 * rounded for dSA rather than rounded again. Measured no faster here, so not kept: prefetching the
 * next tile's (or task's) input rows and the output rows, packing the key tiles one at a time as the
 * products first need them, computing D per query tile in the task instead of in a pass over the
 * rows, fusing the backward's softmax into the epilogue of the dP^T product (the exp and the
 * products share the FMA pipes), the products' broadcasts embedded in VDPBF16PS (slower: more loads),
 * vector copies instead of memcpy for dK, dV.
 *
 * Scratch (tera_attention_dot_scratch_floats): D [B, H, T], then per thread K, V rows and V^T / K^T
 * pairs of one kv head (bf16, [Tp, HP] each), one query tile's packed operands and fp32 tiles, and
 * the backward's dK, dV accumulators of one kv head ([Tp, HP] fp32 each). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "attention_avx512.h"
#include "cpu.h"
#include "tera/bf16.h"
#include "tera/status.h"

#if defined(ATTN_AVX512) && defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define ATTN_DOT 1
#endif

#ifdef ATTN_DOT
#define DOT_FN __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
#define DOT_INLINE static inline __attribute__((always_inline))
typedef uint32_t dot_word __attribute__((may_alias)); /* a pair of bf16, read where vectors wrote it */

#define DT 64 /* tile edge: query rows and keys (four vectors of 16 rows) */
#define DOT_UNR 8 /* keys a step of the forward's unmasked exp loop (a multiple of 2 dividing 16) */

static int dot_hp(int hd) { return (hd + 15) & ~15; }
static int dot_tp(int T) { return (T + DT - 1) / DT * DT; }
static size_t up16(size_t n) { return (n + 15) & ~(size_t)15; }

typedef struct {
    size_t D, shared; /* D [B*H*T] */
    size_t kr, vr, xt, qv, dov, qr, dor, st, dpt, pa, dsa, sv, ot, mla, dka, dva, per_thread; /* a thread's block */
} dot_layout;

static dot_layout dot_layout_of(int B, int T, int H, int hd) {
    dot_layout L;
    const size_t HP = (size_t)dot_hp(hd), Tp = (size_t)dot_tp(T), D2 = DT;
    L.D = 0;
    L.shared = up16((size_t)B * H * T);
    L.kr = 0;                      /* [Tp, HP] bf16 K rows of the task's kv head */
    L.vr = L.kr + Tp * HP / 2;     /* [Tp, HP] bf16 V rows (backward) */
    L.xt = L.vr + Tp * HP / 2;     /* [HP, Tp/2] pairs: V^T (forward), K^T (backward) */
    L.qv = L.xt + Tp * HP / 2;     /* [HP/2, DT] pairs: Q^T */
    L.dov = L.qv + HP / 2 * D2;    /* [HP/2, DT] pairs: dO^T */
    L.qr = L.dov + HP / 2 * D2;    /* [DT/2, HP] pairs: Q rows */
    L.dor = L.qr + D2 / 2 * HP;    /* [DT/2, HP] pairs: dO rows */
    L.st = L.dor + D2 / 2 * HP;    /* [DT, DT] fp32 S^T */
    L.dpt = L.st + D2 * D2;        /* [DT, DT] fp32 dP^T */
    L.pa = L.dpt + D2 * D2;        /* [DT, DT] bf16 P^T */
    L.dsa = L.pa + D2 * D2 / 2;    /* [DT, DT] bf16 dS^T */
    L.sv = L.dsa + D2 * D2 / 2;    /* [DT/2, DT] pairs: P^T (forward), dS^T (backward) */
    L.ot = L.sv + D2 * D2 / 2;     /* [HP, DT] fp32 O^T, dQ^T */
    L.mla = L.ot + HP * D2;        /* [3, DT] running max, sum, rescale */
    L.dka = L.mla + 3 * D2;        /* [Tp, HP] fp32 dK, dV of a kv head */
    L.dva = L.dka + Tp * HP;
    L.per_thread = L.dva + Tp * HP;
    return L;
}

/* ---- the product: out[i*ldo + 16v + l] = (acc ? out : 0) + sum_{p0 <= p < p1} M[i*ldm + p] . L[p*ldl + 16v + l]
 * for i < NR, v < NV (M, L in 32-bit words of two bf16; ldm, ldl in words) */
DOT_FN DOT_INLINE void dot_body(const int NV, const int NR, int p0, int p1, const dot_word *restrict M, int64_t ldm,
                                const dot_word *restrict L, int64_t ldl, float *restrict O, int64_t ldo, int acc) {
    __m512 a[16][4];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) a[r][v] = acc ? _mm512_loadu_ps(O + r * ldo + 16 * v) : _mm512_setzero_ps();
    for (int p = p0; p < p1; p++) {
        const dot_word *restrict Lp = L + (int64_t)p * ldl;
        __m512i l[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) l[v] = _mm512_loadu_si512((const void *)(Lp + 16 * v));
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            const __m512i b = _mm512_set1_epi32((int)M[r * ldm + p]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) a[r][v] = _mm512_dpbf16_ps(a[r][v], (__m512bh)b, (__m512bh)l[v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(O + r * ldo + 16 * v, a[r][v]);
}

typedef void (*dot_fn)(int, int, const dot_word *, int64_t, const dot_word *, int64_t, float *, int64_t, int);
#define DOT_DEF(NV, NR)                                                                                          \
    DOT_FN static void dot_##NV##_##NR(int p0, int p1, const dot_word *M, int64_t ldm, const dot_word *L,         \
                                       int64_t ldl, float *O, int64_t ldo, int acc) {                             \
        dot_body(NV, NR, p0, p1, M, ldm, L, ldl, O, ldo, acc);                                                   \
    }
DOT_DEF(4, 6) DOT_DEF(4, 4) DOT_DEF(4, 2) DOT_DEF(4, 1)
DOT_DEF(3, 8) DOT_DEF(3, 4) DOT_DEF(3, 2) DOT_DEF(3, 1)
DOT_DEF(2, 12) DOT_DEF(2, 4) DOT_DEF(2, 2) DOT_DEF(2, 1)
DOT_DEF(1, 16) DOT_DEF(1, 4) DOT_DEF(1, 2) DOT_DEF(1, 1)
/* [vectors - 1][block]: the widest row block (24 accumulators at most), then 4, 2, 1 rows */
static const dot_fn g_dot[4][4] = {{dot_1_16, dot_1_4, dot_1_2, dot_1_1},
                                   {dot_2_12, dot_2_4, dot_2_2, dot_2_1},
                                   {dot_3_8, dot_3_4, dot_3_2, dot_3_1},
                                   {dot_4_6, dot_4_4, dot_4_2, dot_4_1}};
static const int g_dot_rows[4] = {16, 12, 8, 6};

/* out rows i < I (stride ldo), nv vectors of lanes (+)= M rows (stride ldm words) x L pairs [p0, p1) */
static void dot_mm(int I, int nv, int p0, int p1, const dot_word *M, int64_t ldm, const dot_word *L, int64_t ldl,
                   float *O, int64_t ldo, int acc) {
    for (int v0 = 0; v0 < nv; v0 += 4) {
        const int w = nv - v0 < 4 ? nv - v0 : 4;
        const dot_fn *f = g_dot[w - 1];
        const int big = g_dot_rows[w - 1];
        int i = 0;
        for (; i + big <= I; i += big) f[0](p0, p1, M + (int64_t)i * ldm, ldm, L + 16 * v0, ldl, O + (int64_t)i * ldo + 16 * v0, ldo, acc);
        for (; i + 4 <= I; i += 4) f[1](p0, p1, M + (int64_t)i * ldm, ldm, L + 16 * v0, ldl, O + (int64_t)i * ldo + 16 * v0, ldo, acc);
        for (; i + 2 <= I; i += 2) f[2](p0, p1, M + (int64_t)i * ldm, ldm, L + 16 * v0, ldl, O + (int64_t)i * ldo + 16 * v0, ldo, acc);
        for (; i < I; i++) f[3](p0, p1, M + (int64_t)i * ldm, ldm, L + 16 * v0, ldl, O + (int64_t)i * ldo + 16 * v0, ldo, acc);
    }
}

/* S^T [DT keys, DT rows] (row stride DT) = M rows [keys of the tile] x L pairs [HP/2, DT]; on the
 * diagonal key block [c0, c0+16) only for the lane vectors at or after it (the rest unwritten) */
static void dot_scores(float *St, const dot_word *M, const dot_word *Lv, int nk, int HP, int diag) {
    if (!diag) {
        dot_mm(nk, DT / 16, 0, HP / 2, M, HP / 2, Lv, DT, St, DT, 0);
        return;
    }
    for (int c0 = 0; c0 < nk; c0 += 16)
        dot_mm(nk - c0 < 16 ? nk - c0 : 16, DT / 16 - c0 / 16, 0, HP / 2, M + (int64_t)c0 * (HP / 2), HP / 2, Lv + c0, DT,
               St + (int64_t)c0 * DT + c0, DT, 0);
}

/* X^T [HP rows, DT lanes] (+)= M [HP rows, the tile's key pairs (stride ldm words)] x Pv [key pairs, DT]
 * over the nk keys of the tile; on the diagonal lane vector g over key pairs < 8g + 8 only */
static void dot_by_keys(float *Xt, const dot_word *M, int64_t ldm, const dot_word *Pv, int nk, int HP, int diag,
                        int acc) {
    const int np = (nk + 1) / 2;
    if (!diag) {
        dot_mm(HP, DT / 16, 0, np, M, ldm, Pv, DT, Xt, DT, acc);
        return;
    }
    for (int g = 0; g < DT / 16; g++) {
        const int p1 = 8 * g + 8 < np ? 8 * g + 8 : np;
        if (g > 0 && 8 * g >= p1) break;
        dot_mm(HP, DT / 16 - g, 8 * g, p1, M, ldm, Pv + 16 * g, DT, Xt + 16 * g, DT, acc || g > 0);
    }
}

/* Y [keys of the tile, HP] += A [keys, DT rows bf16] x X pairs of rows [DT/2, HP] over the nq rows; on
 * the diagonal key block [c0, c0+16) over row pairs from c0/2 only */
static void dot_by_rows(float *Y, const uint16_t *A, const dot_word *Xr, int nk, int nq, int HP, int diag) {
    const int np = (nq + 1) / 2;
    const dot_word *Aw = (const dot_word *)A;
    if (!diag) {
        dot_mm(nk, HP / 16, 0, np, Aw, DT / 2, Xr, HP, Y, HP, 1);
        return;
    }
    for (int c0 = 0; c0 < nk; c0 += 16)
        dot_mm(nk - c0 < 16 ? nk - c0 : 16, HP / 16, c0 / 2, np, Aw + (int64_t)c0 * (DT / 2), DT / 2, Xr, HP,
               Y + (int64_t)c0 * HP, HP, 1);
}

/* vexp16 (attention_avx512.h) in three instructions fewer, the same bits for every x: without its lower
 * clamp max(-87, x) (the lanes below -87 are zeroed by its last step whatever the clamp gave them,
 * and max(-87, NaN) is the NaN), the exponent's bias subtracted before the shift dropped ((t -
 * 0x4B400000) << 23 = t << 23 modulo 2^32, 0x4B400000 being a multiple of 2^9), and the zeroing of
 * the lanes below -87 done by the last (integer) addition, with the lanes of live (the zeros of a
 * causal mask) also zeroed: maskz_mov(live, vexp16(x)) */
DOT_FN DOT_INLINE __m512 vexp16_live(__m512 x, __mmask16 live) {
    __m512 t;
    const __m512 p = vexp16_poly(_mm512_min_ps(_mm512_set1_ps(88.0f), x), &t);
    const __mmask16 keep = _mm512_mask_cmp_ps_mask(live, x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ); /* not x < -87 */
    return _mm512_castsi512_ps(_mm512_maskz_add_epi32(keep, _mm512_castps_si512(p), _mm512_slli_epi32(_mm512_castps_si512(t), 23)));
}
DOT_FN DOT_INLINE __m512 vexp16_lo(__m512 x) { return vexp16_live(x, (__mmask16)0xffff); }

/* ---- rounding (VCVTNEPS2BF16, see the top) and packing */
DOT_FN DOT_INLINE __m256i cvt16(__m512 a) { return (__m256i)_mm512_cvtneps_pbh(a); }
/* 16 words: (bf16(a), bf16(b)) lane by lane, a in the low half */
DOT_FN DOT_INLINE __m512i vpair(__m512 a, __m512 b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}
/* vpair from the two halves already rounded (VCVTNE2PS2BF16 rounds as VCVTNEPS2BF16: the same words) */
DOT_FN DOT_INLINE __m512i vpair16(__m256i a, __m256i b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}
/* 16 words: the bf16 of x[0..31] (masks lo, hi for the halves), consecutive pairs */
DOT_FN DOT_INLINE __m512i vrow32(const float *x, __mmask16 lo, __mmask16 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + 16), _mm512_maskz_loadu_ps(lo, x));
}

/* R[r*HP + d] = bf16(x[r*ld + d]) for r < DT (zero for r >= n, d >= hd) */
DOT_FN static void pack_rows16(uint16_t *restrict R, const float *restrict x, int64_t ld, int n, int hd, int HP) {
    for (int r = 0; r < DT; r++) {
        for (int d0 = 0; d0 < HP; d0 += 16) {
            const __m512 a = r < n ? _mm512_maskz_loadu_ps(lanes_mask(hd - d0), x + (int64_t)r * ld + d0) : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(void *)(R + (int64_t)r * HP + d0), cvt16(a));
        }
    }
}

/* Xv[p*DT + r] = (x[r][2p], x[r][2p+1]) for p < HP/2, r < DT: rows of x (stride ld) rounded, as 32-bit
 * words, transposed 16 x 16 (zero for rows >= n and d >= hd) */
DOT_FN static void pack_qv(dot_word *restrict Xv, const float *restrict x, int64_t ld, int n, int hd, int HP) {
    for (int r0 = 0; r0 < DT; r0 += 16) {
        for (int p0 = 0; p0 < HP / 2; p0 += 16) {
            const int d0 = 2 * p0;
            __m512 blk[16];
            for (int i = 0; i < 16; i++)
                blk[i] = r0 + i < n ? _mm512_castsi512_ps(vrow32(x + (int64_t)(r0 + i) * ld + d0, lanes_mask(hd - d0),
                                                                 lanes_mask(hd - d0 - 16)))
                                    : _mm512_setzero_ps();
            transpose16(blk);
            for (int p = 0; p < 16 && p0 + p < HP / 2; p++) _mm512_storeu_ps((float *)(Xv + (int64_t)(p0 + p) * DT + r0), blk[p]);
        }
    }
}

/* Xr[p*HP + d] = (x[2p][d], x[2p+1][d]) for p < DT/2, d < HP (rows of x with stride ld; zero for rows
 * >= n and d >= hd) */
DOT_FN static void pack_pairs_rows(dot_word *restrict Xr, const float *restrict x, int64_t ld, int n, int hd, int HP) {
    for (int p = 0; p < DT / 2; p++) {
        for (int d0 = 0; d0 < HP; d0 += 16) {
            const __mmask16 cols = lanes_mask(hd - d0);
            const __m512 a = 2 * p < n ? _mm512_maskz_loadu_ps(cols, x + (int64_t)(2 * p) * ld + d0) : _mm512_setzero_ps();
            const __m512 b = 2 * p + 1 < n ? _mm512_maskz_loadu_ps(cols, x + (int64_t)(2 * p + 1) * ld + d0) : _mm512_setzero_ps();
            _mm512_storeu_si512((void *)(Xr + (int64_t)p * HP + d0), vpair(a, b));
        }
    }
}

/* XT[d*ldt + p] = (x[2p][d], x[2p+1][d]) for d < HP, p < DT/2: pairs of rows, transposed (zero for
 * rows >= n and d >= hd) */
DOT_FN static void pack_pairs_t(dot_word *restrict XT, int64_t ldt, const float *restrict x, int64_t ld, int n, int hd, int HP) {
    for (int p0 = 0; p0 < DT / 2; p0 += 16) {
        for (int d0 = 0; d0 < HP; d0 += 16) {
            const __mmask16 cols = lanes_mask(hd - d0);
            __m512 blk[16];
            for (int i = 0; i < 16; i++) {
                const int r = 2 * (p0 + i);
                const __m512 a = r < n ? _mm512_maskz_loadu_ps(cols, x + (int64_t)r * ld + d0) : _mm512_setzero_ps();
                const __m512 b = r + 1 < n ? _mm512_maskz_loadu_ps(cols, x + (int64_t)(r + 1) * ld + d0) : _mm512_setzero_ps();
                blk[i] = _mm512_castsi512_ps(vpair(a, b));
            }
            transpose16(blk);
            for (int j = 0; j < 16; j++) _mm512_storeu_ps((float *)(XT + (int64_t)(d0 + j) * ldt + p0), blk[j]);
        }
    }
}

/* out[r][d] = Xt[d][r] * inv[r] for rows r < nq, d < hd (out rows with stride ldo; inv NULL: 1) */
static void store_t(float *out, int64_t ldo, const float *Xt, const float *inv, int nq, int hd) {
    for (int r0 = 0; r0 < nq; r0 += 16)
        for (int d0 = 0; d0 < hd; d0 += 16) {
            const __m512 iv = inv ? _mm512_loadu_ps(inv + r0) : _mm512_set1_ps(1.0f);
            __m512 blk[16];
            for (int c = 0; c < 16; c++)
                blk[c] = d0 + c < hd ? _mm512_mul_ps(_mm512_loadu_ps(Xt + (int64_t)(d0 + c) * DT + r0), iv) : _mm512_setzero_ps();
            transpose16(blk);
            const __mmask16 cols = lanes_mask(hd - d0);
            for (int i = 0; i < 16 && r0 + i < nq; i++) _mm512_mask_storeu_ps(out + (int64_t)(r0 + i) * ldo + d0, cols, blk[i]);
        }
}

/* Key tile kt of kv head (b, kvh): K rows into Kr [Tp, HP] (and V into Vr) at row kt*DT, and the pairs
 * of X's rows (X = V, or K with kt_k) transposed into XT [HP, Tp/2] at word column kt*DT/2; NULL
 * targets skipped */
DOT_FN static void pack_kv(uint16_t *Kr, uint16_t *Vr, dot_word *XT, const float *xsrc, const float *k, const float *v,
                    int64_t koff, int nk, int kt, int T, int Hkv, int hd) {
    const int HP = dot_hp(hd), Tp = dot_tp(T);
    const int64_t ldk = (int64_t)Hkv * hd, s0 = (int64_t)kt * DT;
    if (Kr) pack_rows16(Kr + s0 * HP, k + koff, ldk, nk, hd, HP);
    if (Vr) pack_rows16(Vr + s0 * HP, v + koff, ldk, nk, hd, HP);
    if (XT) pack_pairs_t(XT + s0 / 2, Tp / 2, xsrc + koff, ldk, nk, hd, HP);
}

/* ---- forward: one (b, h, query tile) */
DOT_FN static void forward_tile_dot(float *out, float *lse, const float *q, const uint16_t *Kh, const dot_word *VTh, int b,
                             int h, int qt, int T, int H, int hd, float *ws, const dot_layout *L) {
    const int64_t ldq = (int64_t)H * hd;
    const int HP = dot_hp(hd), Tp = dot_tp(T);
    const float scale = 1.0f / sqrtf((float)hd);
    const __m512 vs = _mm512_set1_ps(scale);
    const int t0 = qt * DT, nq = T - t0 < DT ? T - t0 : DT;
    float *St = ws + L->st, *Ot = ws + L->ot;
    dot_word *Qv = (dot_word *)(ws + L->qv), *Pv = (dot_word *)(ws + L->sv);
    float *m = ws + L->mla, *l = m + DT, *al = l + DT;
    float *oi = out + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
    pack_qv(Qv, q + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd, ldq, nq, hd, HP);
    for (int g = 0; g < DT / 16; g++) {
        _mm512_storeu_ps(m + 16 * g, _mm512_set1_ps(-INFINITY));
        _mm512_storeu_ps(l + 16 * g, _mm512_setzero_ps());
    }
    for (int kt = 0; kt <= qt; kt++) {
        const int s0 = kt * DT, nk = T - s0 < DT ? T - s0 : DT, diag = kt == qt, full = !diag && nk == DT;
        int grow[DT / 16]; /* the row group's max grew: its O^T lanes to rescale */
        dot_scores(St, (const dot_word *)(Kh + (int64_t)s0 * HP), Qv, nk, HP, diag); /* S^T = K_j Q_i^T (unscaled) */
        /* online softmax, 16 rows a vector: P = exp(scale S - m) into key pairs (zero where masked) */
        __m512 mt[DT / 16]; /* the tile's row max: the four groups' chains interleaved, each over keys in order */
        for (int g = 0; g < DT / 16; g++) mt[g] = _mm512_set1_ps(-INFINITY);
        if (full)
            for (int c = 0; c < DT; c++)
                for (int g = 0; g < DT / 16; g++) mt[g] = _mm512_max_ps(mt[g], _mm512_loadu_ps(St + (int64_t)c * DT + 16 * g));
        else
            for (int c = 0; c < nk; c++)
                for (int g = 0; g < DT / 16; g++) {
                    const int cend = diag && 16 * g + 16 < nk ? 16 * g + 16 : nk;
                    if (c < cend)
                        mt[g] = _mm512_mask_max_ps(mt[g], causal_mask(c, g, diag), mt[g], _mm512_loadu_ps(St + (int64_t)c * DT + 16 * g));
                }
        for (int g = 0; g < DT / 16; g++) {
            const int cend = diag && 16 * g + 16 < nk ? 16 * g + 16 : nk;
            const __m512 mo = _mm512_loadu_ps(m + 16 * g);
            const __m512 mn = _mm512_max_ps(mo, _mm512_mul_ps(mt[g], vs));
            /* keys below cu see all 16 rows (below the diagonal block, DOT_UNR at a time): no masks */
            const int cu = (diag && 16 * g < cend ? 16 * g : cend) & ~(DOT_UNR - 1);
            __m512 sum = _mm512_setzero_ps();
            int c = 0;
            for (; c < cu; c += DOT_UNR) {
                __m512 e[DOT_UNR];
#pragma GCC unroll 8
                for (int u = 0; u < DOT_UNR; u++) e[u] = vexp16_lo(_mm512_fmsub_ps(_mm512_loadu_ps(St + (int64_t)(c + u) * DT + 16 * g), vs, mn));
#pragma GCC unroll 8
                for (int u = 0; u < DOT_UNR; u += 2) {
                    sum = _mm512_add_ps(_mm512_add_ps(sum, e[u]), e[u + 1]);
                    _mm512_storeu_si512((void *)(Pv + (int64_t)((c + u) / 2) * DT + 16 * g), vpair(e[u], e[u + 1]));
                }
            }
            for (; c < cend; c += 2) {
                __m512 e[2];
                for (int u = 0; u < 2; u++)
                    e[u] = c + u < cend ? vexp16_live(_mm512_fmsub_ps(_mm512_loadu_ps(St + (int64_t)(c + u) * DT + 16 * g), vs, mn),
                                                      causal_mask(c + u, g, diag))
                                        : _mm512_setzero_ps();
                sum = _mm512_add_ps(_mm512_add_ps(sum, e[0]), e[1]);
                _mm512_storeu_si512((void *)(Pv + (int64_t)(c / 2) * DT + 16 * g), vpair(e[0], e[1]));
            }
            const __m512 alpha = vexp16(_mm512_sub_ps(mo, mn)); /* 0 at the first tile (mo = -inf) */
            _mm512_storeu_ps(m + 16 * g, mn);
            _mm512_storeu_ps(l + 16 * g, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * g), alpha, sum));
            _mm512_storeu_ps(al + 16 * g, alpha);
            grow[g] = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
        }
        if (kt > 0) /* O^T rows (head dims) rescaled, lane by lane (x 1 skipped: the same bits) */
            for (int g = 0; g < DT / 16; g++)
                if (grow[g]) {
                    const __m512 a = _mm512_loadu_ps(al + 16 * g);
                    for (int d = 0; d < HP; d++) {
                        float *o = Ot + (int64_t)d * DT + 16 * g;
                        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), a));
                    }
                }
        dot_by_keys(Ot, VTh + s0 / 2, Tp / 2, Pv, nk, HP, diag, kt > 0); /* O^T (+)= V_j^T P^T */
    }
    for (int g = 0; g < DT / 16; g++) /* 1 / l, into al */
        _mm512_storeu_ps(al + 16 * g, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + 16 * g)));
    store_t(oi, ldq, Ot, al, nq, hd);
    float *lse_row = lse + ((int64_t)b * H + h) * T + t0;
    for (int r = 0; r < nq; r++) lse_row[r] = m[r] + logf(l[r]);
}

/* sum_d o[d] * bf16(g[d]) in double, 16 lanes then a fixed tree over the lanes */
static float dot_d(const float *o, const float *g, int hd) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (int d0 = 0; d0 < hd; d0 += 16) {
        const __mmask16 m = lanes_mask(hd - d0);
        const __m512 gr = _mm512_castsi512_ps(_mm512_and_si512(tera_bf16_rne16(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, g + d0))),
                                                               _mm512_set1_epi32((int)0xffff0000u)));
        const __m512 ov = _mm512_maskz_loadu_ps(m, o + d0);
        a0 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(ov)), _mm512_cvtps_pd(_mm512_castps512_ps256(gr)), a0);
        a1 = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ov), 1))),
                             _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(gr), 1))), a1);
    }
    return (float)_mm512_reduce_add_pd(_mm512_add_pd(a0, a1)); /* a fixed tree of the 16 lanes */
}

/* ---- backward: one (b, kv head): dK, dV of the head and dQ of its H/Hkv query heads */
DOT_FN static void backward_group_dot(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *lse,
                               const float *D, const uint16_t *Kh, const uint16_t *Vh, const dot_word *KTh, int b,
                               int kvh, int T, int H, int Hkv, int hd, float *ws, const dot_layout *L) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int rep = H / Hkv, HP = dot_hp(hd), Tp = dot_tp(T), nt = Tp / DT;
    const float scale = 1.0f / sqrtf((float)hd);
    const __m512 vs = _mm512_set1_ps(scale);
    float *St = ws + L->st, *dPt = ws + L->dpt, *dQt = ws + L->ot;
    float *dKa = ws + L->dka, *dVa = ws + L->dva;
    dot_word *Qv = (dot_word *)(ws + L->qv), *dOv = (dot_word *)(ws + L->dov);
    dot_word *Qr = (dot_word *)(ws + L->qr), *dOr = (dot_word *)(ws + L->dor), *dSv = (dot_word *)(ws + L->sv);
    uint16_t *PA = (uint16_t *)(ws + L->pa), *dSA = (uint16_t *)(ws + L->dsa);
    memset(dKa, 0, sizeof(float) * (size_t)Tp * HP);
    memset(dVa, 0, sizeof(float) * (size_t)Tp * HP);
    for (int hh = 0; hh < rep; hh++) {
        const int h = kvh * rep + hh;
        for (int qt = 0; qt < nt; qt++) {
            const int t0 = qt * DT, nq = T - t0 < DT ? T - t0 : DT;
            const int64_t qoff = ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
            const float *lse_i = lse + ((int64_t)b * H + h) * T + t0, *D_i = D + ((int64_t)b * H + h) * T + t0;
            pack_qv(Qv, q + qoff, ldq, nq, hd, HP);
            pack_qv(dOv, dout + qoff, ldq, nq, hd, HP);
            pack_pairs_rows(Qr, q + qoff, ldq, nq, hd, HP);
            pack_pairs_rows(dOr, dout + qoff, ldq, nq, hd, HP);
            for (int kt = 0; kt <= qt; kt++) {
                const int s0 = kt * DT, nk = T - s0 < DT ? T - s0 : DT, diag = kt == qt;
                dot_scores(St, (const dot_word *)(Kh + (int64_t)s0 * HP), Qv, nk, HP, diag);   /* S^T = K_j Q_i^T */
                dot_scores(dPt, (const dot_word *)(Vh + (int64_t)s0 * HP), dOv, nk, HP, diag); /* dP^T = V_j dO_i^T */
                for (int g = 0; g < DT / 16; g++) {
                    const int cend = diag && 16 * g + 16 < nk ? 16 * g + 16 : nk;
                    const __mmask16 rows = lanes_mask(nq - 16 * g);
                    const __m512 lv = _mm512_maskz_loadu_ps(rows, lse_i + 16 * g);
                    const __m512 Dv = _mm512_maskz_loadu_ps(rows, D_i + 16 * g);
                    /* keys below cu see all 16 rows (all live, below the diagonal block): no masks */
                    const int cu = rows == 0xffff ? (diag && 16 * g < cend ? 16 * g : cend) & ~1 : 0;
                    int c = 0;
                    for (; c < cu; c += 2) {
                        __m256i dh[2];
                        for (int u = 0; u < 2; u++) {
                            const int cc = c + u;
                            /* P = exp(scale S - lse); dS = scale * P * (dP - D) */
                            const __m512 e = vexp16_lo(_mm512_fmsub_ps(_mm512_loadu_ps(St + (int64_t)cc * DT + 16 * g), vs, lv));
                            const __m512 ds = _mm512_mul_ps(vs, _mm512_mul_ps(e, _mm512_sub_ps(_mm512_loadu_ps(dPt + (int64_t)cc * DT + 16 * g), Dv)));
                            dh[u] = cvt16(ds);
                            _mm256_storeu_si256((__m256i *)(void *)(PA + (int64_t)cc * DT + 16 * g), cvt16(e));
                            _mm256_storeu_si256((__m256i *)(void *)(dSA + (int64_t)cc * DT + 16 * g), dh[u]);
                        }
                        _mm512_storeu_si512((void *)(dSv + (int64_t)(c / 2) * DT + 16 * g), vpair16(dh[0], dh[1]));
                    }
                    for (; c < cend; c += 2) {
                        __m512 e[2], ds[2];
                        __m256i dh[2];
                        for (int u = 0; u < 2; u++) {
                            const int cc = c + u;
                            e[u] = ds[u] = _mm512_setzero_ps();
                            if (cc < cend && rows) {
                                /* the same, 0 where masked */
                                const __mmask16 live = causal_mask(cc, g, diag) & rows;
                                e[u] = vexp16_live(_mm512_fmsub_ps(_mm512_loadu_ps(St + (int64_t)cc * DT + 16 * g), vs, lv), live);
                                ds[u] = _mm512_maskz_mul_ps(live, vs, _mm512_mul_ps(e[u], _mm512_sub_ps(_mm512_loadu_ps(dPt + (int64_t)cc * DT + 16 * g), Dv)));
                            }
                            dh[u] = cvt16(ds[u]);
                            _mm256_storeu_si256((__m256i *)(void *)(PA + (int64_t)cc * DT + 16 * g), cvt16(e[u]));
                            _mm256_storeu_si256((__m256i *)(void *)(dSA + (int64_t)cc * DT + 16 * g), dh[u]);
                        }
                        _mm512_storeu_si512((void *)(dSv + (int64_t)(c / 2) * DT + 16 * g), vpair16(dh[0], dh[1]));
                    }
                }
                dot_by_rows(dVa + (int64_t)s0 * HP, PA, dOr, nk, nq, HP, diag); /* dV_j += P^T dO_i */
                dot_by_rows(dKa + (int64_t)s0 * HP, dSA, Qr, nk, nq, HP, diag); /* dK_j += dS^T Q_i */
                dot_by_keys(dQt, KTh + s0 / 2, Tp / 2, dSv, nk, HP, diag, kt > 0); /* dQ_i^T (+)= K_j^T dS^T */
            }
            store_t(dq + qoff, ldq, dQt, NULL, nq, hd);
        }
    }
    for (int t = 0; t < T; t++) {
        const int64_t off = ((int64_t)b * T + t) * ldk + (int64_t)kvh * hd;
        memcpy(dk + off, dKa + (int64_t)t * HP, sizeof(float) * (size_t)hd);
        memcpy(dv + off, dVa + (int64_t)t * HP, sizeof(float) * (size_t)hd);
    }
}
#endif

int tera_attention_dot_available(void) {
#ifdef ATTN_DOT
    return __builtin_cpu_supports("avx512bf16") && tera_cpu_bf16_has_dot();
#else
    return 0;
#endif
}

size_t tera_attention_dot_scratch_floats(int B, int T, int H, int Hkv, int hd, int nthr) {
#ifdef ATTN_DOT
    (void)Hkv;
    const dot_layout L = dot_layout_of(B, T, H, hd);
    return L.shared + (size_t)nthr * L.per_thread;
#else
    (void)B, (void)T, (void)H, (void)Hkv, (void)hd, (void)nthr;
    return 0;
#endif
}

void tera_attention_forward_dot(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                                int H, int Hkv, int hd, float *scratch) {
    ATTN_CHECK_SHAPE(B, T, H, Hkv, hd);
#ifdef ATTN_DOT
    if (B == 0 || T == 0) return;
    const int nthr = omp_get_max_threads();
    const dot_layout L = dot_layout_of(B, T, H, hd);
    float *blocks = scratch + L.shared;
    const int nt = dot_tp(T) / DT;
    /* one task per head when there are enough heads for the threads (K, V^T rounded once for all
     * query tiles), else one per (head, query tile), the longest (last) first, rounding the key
     * tiles up to its own: the same results either way, each output row written by one task */
    const int per_head = (int64_t)B * H >= 4 * (int64_t)nthr;
    const int64_t ntask = (int64_t)B * H * (per_head ? 1 : nt);
    const int64_t ldk = (int64_t)Hkv * hd;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthr)
    for (int64_t task = 0; task < ntask; task++) {
        float *ws = blocks + (size_t)omp_get_thread_num() * L.per_thread;
        uint16_t *Kh = (uint16_t *)(ws + L.kr);
        dot_word *VTh = (dot_word *)(ws + L.xt);
        const int qa = per_head ? 0 : nt - 1 - (int)(task / ((int64_t)B * H)), qb = per_head ? nt : qa + 1;
        const int bh = (int)(task % ((int64_t)B * H)), b = bh / H, h = bh % H, kvh = h / (H / Hkv);
        for (int kt = 0; kt < qb; kt++) {
            const int s0 = kt * DT, nk = T - s0 < DT ? T - s0 : DT;
            pack_kv(Kh, NULL, VTh, v, k, v, ((int64_t)b * T + s0) * ldk + (int64_t)kvh * hd, nk, kt, T, Hkv, hd);
        }
        for (int qt = qa; qt < qb; qt++) forward_tile_dot(out, lse, q, Kh, VTh, b, h, qt, T, H, hd, ws, &L);
    }
#else
    (void)out, (void)lse, (void)q, (void)k, (void)v, (void)scratch;
    TERA_ASSERTF(0, "attention: the AVX512-BF16 kernels are not in this build");
#endif
}

void tera_attention_backward_dot(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                 const float *v, const float *out, const float *lse, int B, int T, int H, int Hkv,
                                 int hd, float *scratch) {
    ATTN_CHECK_SHAPE(B, T, H, Hkv, hd);
#ifdef ATTN_DOT
    if (B == 0 || T == 0) return;
    const int nthr = omp_get_max_threads();
    const dot_layout L = dot_layout_of(B, T, H, hd);
    float *D = scratch + L.D, *blocks = scratch + L.shared;
    const int nt = dot_tp(T) / DT;
    const int64_t ld = (int64_t)H * hd, nrow = (int64_t)B * T, ldk = (int64_t)Hkv * hd;
#pragma omp parallel num_threads(nthr)
    {
        float *ws = blocks + (size_t)omp_get_thread_num() * L.per_thread;
        uint16_t *Kh = (uint16_t *)(ws + L.kr), *Vh = (uint16_t *)(ws + L.vr);
        dot_word *KTh = (dot_word *)(ws + L.xt);
#pragma omp for schedule(static)
        for (int64_t row = 0; row < nrow; row++) {
            const int b = (int)(row / T), t = (int)(row % T);
            /* D = rowsum(dO * O) with the rounded dO that dP = dO V^T sees (double, fixed order) */
            for (int h = 0; h < H; h++)
                D[((int64_t)b * H + h) * T + t] = dot_d(out + row * ld + (int64_t)h * hd, dout + row * ld + (int64_t)h * hd, hd);
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < B * Hkv; task++) {
            const int b = task / Hkv, kvh = task % Hkv;
            for (int kt = 0; kt < nt; kt++) {
                const int s0 = kt * DT, nk = T - s0 < DT ? T - s0 : DT;
                pack_kv(Kh, Vh, KTh, k, k, v, ((int64_t)b * T + s0) * ldk + (int64_t)kvh * hd, nk, kt, T, Hkv, hd);
            }
            backward_group_dot(dq, dk, dv, dout, q, lse, D, Kh, Vh, KTh, b, kvh, T, H, Hkv, hd, ws, &L);
        }
    }
#else
    (void)dq, (void)dk, (void)dv, (void)dout, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)scratch;
    TERA_ASSERTF(0, "attention: the AVX512-BF16 kernels are not in this build");
#endif
}
