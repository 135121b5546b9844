/* The register-blocked fp32 attention kernels' schedule, written once for both vector widths: the
 * forward over a span of query tiles and the backward of one kv head's group (attention.c's "fp32 on
 * AVX-512" comment describes both). Included once by attention.c (AVX-512, 16 lanes) and once by
 * attention_avx2.c (AVX2, 8 lanes), each after defining:
 *   RB_VL (lanes a vector: 16 or 8), RB_FN(name) (a per-width name), FT (the tile edge),
 *   rb_vec / rb_mask (a vector of floats / a mask of its lanes), and the static inline operations
 *   rb_ld rb_st rb_set1 rb_zero rb_add rb_sub rb_mul rb_max rb_fmadd rb_exp (rb_fmadd(a, b, c) =
 *   a * b + c, one rounding), rb_rows(n) (lanes < n), rb_causal(c, g) (the lanes of row group g, rows
 *   RB_VL g .., whose row is at or past key c), rb_mask_and, rb_ld_or(mask, p, fill) (p's lanes where
 *   mask, fill elsewhere; no read outside mask), rb_keep(mask, v) (v where mask, 0 elsewhere),
 *   rb_max_where(mask, a, b) (max(a, b) where mask, a elsewhere),
 * and the static functions pack_t, pack_rows and mk (the register-blocked product; the three
 * products below are its calls).
 * The softmax passes run in groups of RB_VL rows; on the diagonal a group visits every key of its
 * 16-row block, so both widths compute the same terms: each element is the same sum in the same
 * order, and the two instantiations give the same bits (tests/test_attention.c). No include guard:
 * it is meant to be included once per width. */

/* St[c*FT + r] = sum_d A[c*lda + d] * Bt[d*FT + r] for keys c < nk; on the diagonal tile (diag) key
 * block [c0, c0+16) only for rows r >= c0 (the lanes below c0 are left unwritten) */
static void scores_t(float *St, const float *A, int64_t lda, const float *Bt, int nk, int hd, int diag) {
    if (!diag) {
        mk(nk, hd, FT, A, lda, 1, Bt, FT, St, FT, 0);
        return;
    }
    for (int c0 = 0; c0 < nk; c0 += 16)
        mk(nk - c0 < 16 ? nk - c0 : 16, hd, FT - c0, A + (int64_t)c0 * lda, lda, 1, Bt + c0, FT,
           St + (int64_t)c0 * FT + c0, FT, 0);
}

/* out rows r < nq (stride ldo, lanes hd) (+)= sum_c Pt[c*FT + r] * X[c*ldx + d] over keys c < nk (on
 * the diagonal, 16-row blocks stop at their block's last key) */
static void rows_by_keys(float *out, int64_t ldo, const float *Pt, const float *X, int64_t ldx, int nq, int nk,
                         int hd, int diag, int acc) {
    if (!diag) {
        mk(nq, nk, hd, Pt, 1, FT, X, ldx, out, ldo, acc);
        return;
    }
    for (int r0 = 0; r0 < nq; r0 += 16)
        mk(nq - r0 < 16 ? nq - r0 : 16, nk < r0 + 16 ? nk : r0 + 16, hd, Pt + r0, 1, FT, X, ldx,
           out + (int64_t)r0 * ldo, ldo, acc);
}

/* out rows c < nk (stride ldo, lanes hd) += sum_r Pt[c*FT + r] * X[r*ldx + d] over rows r < nq (on
 * the diagonal, 16-key blocks start at their first key) */
static void keys_by_rows(float *out, int64_t ldo, const float *Pt, const float *X, int64_t ldx, int nq, int nk,
                         int hd, int diag) {
    if (!diag) {
        mk(nk, nq, hd, Pt, FT, 1, X, ldx, out, ldo, 1);
        return;
    }
    for (int c0 = 0; c0 < nk; c0 += 16)
        mk(nk - c0 < 16 ? nk - c0 : 16, nq - c0, hd, Pt + (int64_t)c0 * FT + c0, FT, 1, X + (int64_t)c0 * ldx, ldx,
           out + (int64_t)c0 * ldo, ldo, 1);
}

/* keys the softmax pass of row group g (RB_VL rows) visits: all nk, or on the diagonal those of the
 * group's 16-row block (its probabilities above the diagonal written as 0 for the block's products) */
static inline int RB_FN(group_keys)(int g, int nk, int diag) {
    const int end = g * RB_VL / 16 * 16 + 16;
    return diag && end < nk ? end : nk;
}

/* Query tiles [qa, qb) of (b, h): out rows and their lse. Key tiles are visited in chunks (K, V of a
 * chunk copied to dense rows once, for all the span's query tiles); between chunks a query tile's
 * state is kept exactly: O unnormalised in out, the running max in lse, the running sum in lsum
 * ([T], this head's row of the scratch's D block, which the forward does not otherwise use). So
 * neither the span nor the chunk size changes a bit: a span of one tile (many threads) and of all
 * (few threads) give the same results. */
/* noinline (both): inlined into the task loop, the AVX-512 forward ran 2-4% slower (bench_attention) */
__attribute__((noinline)) static void
RB_FN(forward_span)(float *out, float *lse, float *lsum, const float *q, const float *k, const float *v,
                    int b, int h, int qa, int qb, int T, int H, int Hkv, int hd, int kch, float *ws) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int kvh = h / (H / Hkv);
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t hdp = ATTN_FP32_HDP(hd);
    float *Qt = ws;                                      /* [hd, FT] scale * Q^T */
    float *St = Qt + (size_t)hd * FT;                    /* [FT keys, FT rows] S^T, then P^T */
    float *m = St + FT * FT, *l = m + FT, *al = l + FT;  /* [FT] running max, sum, rescale */
    float *Op = al + FT;                                 /* [FT, hdp] O of the query tile */
    float *Kc = Op + FT * hdp, *Vc = Kc + (int64_t)kch * FT * hdp; /* [kch*FT, hdp] the chunk's K, V */
    float *lse_h = lse + ((int64_t)b * H + h) * T;
    const rb_vec ninf = rb_set1(-INFINITY);
    for (int kc0 = 0; kc0 < qb; kc0 += kch) {
        const int kc1 = kc0 + kch < qb ? kc0 + kch : qb; /* no key tile beyond the last query tile */
        const int c0 = kc0 * FT, nkc = (kc1 * FT < T ? kc1 * FT : T) - c0;
        const int64_t koff = ((int64_t)b * T + c0) * ldk + (int64_t)kvh * hd;
        pack_rows(Kc, k + koff, ldk, nkc, hd, hdp);
        pack_rows(Vc, v + koff, ldk, nkc, hd, hdp);
        for (int qt = qa > kc0 ? qa : kc0; qt < qb; qt++) {
            const int t0 = qt * FT;
            const int nq = T - t0 < FT ? T - t0 : FT;
            float *oi = out + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
            pack_t(Qt, q + ((int64_t)b * T + t0) * ldq + (int64_t)h * hd, ldq, nq, hd, scale);
            for (int g = 0; g < FT / RB_VL; g++) { /* pad rows (r >= nq) start afresh in every chunk */
                const rb_mask rows = rb_rows(nq - RB_VL * g);
                rb_st(m + RB_VL * g, kc0 == 0 ? ninf : rb_ld_or(rows, lse_h + t0 + RB_VL * g, ninf));
                rb_st(l + RB_VL * g, kc0 == 0 ? rb_zero() : rb_ld_or(rows, lsum + t0 + RB_VL * g, rb_zero()));
            }
            if (kc0 > 0) pack_rows(Op, oi, ldq, nq, hd, hdp);
            const int kend = qt < kc1 - 1 ? qt : kc1 - 1;
            for (int kt = kc0; kt <= kend; kt++) {
                const int s0 = kt * FT;
                const int nk = T - s0 < FT ? T - s0 : FT;
                const int diag = kt == qt;
                const float *Kp = Kc + (int64_t)(s0 - c0) * hdp, *Vp = Vc + (int64_t)(s0 - c0) * hdp;
                scores_t(St, Kp, hdp, Qt, nk, hd, diag);
                /* online softmax, RB_VL rows a vector; keys up to the group's first row need no mask;
                 * pad rows see every key of the tile: finite */
                for (int g = 0; g < FT / RB_VL; g++) {
                    const int cend = RB_FN(group_keys)(g, nk, diag);
                    const int cfree = diag && RB_VL * g + 1 < cend ? RB_VL * g + 1 : cend;
                    rb_vec mt = ninf;
                    for (int c = 0; c < cfree; c++) mt = rb_max(mt, rb_ld(St + (int64_t)c * FT + RB_VL * g));
                    for (int c = cfree; c < cend; c++)
                        mt = rb_max_where(rb_causal(c, g), mt, rb_ld(St + (int64_t)c * FT + RB_VL * g));
                    const rb_vec mo = rb_ld(m + RB_VL * g);
                    const rb_vec mn = rb_max(mo, mt);
                    rb_vec sum = rb_zero();
                    for (int c = 0; c < cfree; c++) {
                        float *p = St + (int64_t)c * FT + RB_VL * g;
                        const rb_vec e = rb_exp(rb_sub(rb_ld(p), mn));
                        rb_st(p, e);
                        sum = rb_add(sum, e);
                    }
                    for (int c = cfree; c < cend; c++) { /* the same sum, on in key order */
                        float *p = St + (int64_t)c * FT + RB_VL * g;
                        const rb_vec e = rb_keep(rb_causal(c, g), rb_exp(rb_sub(rb_ld(p), mn)));
                        rb_st(p, e);
                        sum = rb_add(sum, e);
                    }
                    const rb_vec alpha = rb_exp(rb_sub(mo, mn)); /* 0 at the first tile (mo = -inf) */
                    rb_st(m + RB_VL * g, mn);
                    rb_st(l + RB_VL * g, rb_fmadd(rb_ld(l + RB_VL * g), alpha, sum));
                    rb_st(al + RB_VL * g, alpha);
                }
                if (kt > 0)
                    for (int r = 0; r < nq; r++)
                        if (al[r] != 1.0f) {
                            float *restrict o = Op + (int64_t)r * hdp;
                            for (int d = 0; d < hd; d++) o[d] *= al[r];
                        }
                rows_by_keys(Op, hdp, St, Vp, hdp, nq, nk, hd, diag, kt > 0); /* O (+)= P V_j */
            }
            if (kend == qt) { /* the query tile's last key tile: normalise */
                for (int r = 0; r < nq; r++) {
                    const float inv = 1.0f / l[r];
                    const float *restrict o = Op + (int64_t)r * hdp;
                    float *restrict y = oi + (int64_t)r * ldq;
                    for (int d = 0; d < hd; d++) y[d] = o[d] * inv;
                    lse_h[t0 + r] = m[r] + logf(l[r]);
                }
            } else { /* keep the state for the next chunk */
                for (int r = 0; r < nq; r++) memcpy(oi + (int64_t)r * ldq, Op + (int64_t)r * hdp, sizeof(float) * (size_t)hd);
                memcpy(lse_h + t0, m, sizeof(float) * (size_t)nq);
                memcpy(lsum + t0, l, sizeof(float) * (size_t)nq);
            }
        }
    }
}

/* dQ of kv head kvh's query heads and its dK, dV, for batch row b: key tiles in chunks (K, V and the
 * chunk's dK, dV accumulators as dense rows), the query heads and their query tiles inner. */
__attribute__((noinline)) static void
RB_FN(backward_group)(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                      const float *v, const float *lse, const float *D, int b, int kvh, int T, int H, int Hkv, int hd,
                      int kch, float *ws) {
    const int64_t ldq = (int64_t)H * hd, ldk = (int64_t)Hkv * hd;
    const int rep = H / Hkv;
    const float scale = 1.0f / sqrtf((float)hd);
    const int nt = (T + FT - 1) / FT;
    const int64_t hdp = ATTN_FP32_HDP(hd);
    float *Qt = ws, *dOt = Qt + (size_t)hd * FT; /* [hd, FT] scale * Q^T, dO^T */
    float *Pt = dOt + (size_t)hd * FT;           /* [FT keys, FT rows] S^T, then P^T */
    float *dSt = Pt + FT * FT;                   /* [FT keys, FT rows] dP^T, then scale * dS^T */
    float *Qp = dSt + FT * FT, *dOp = Qp + FT * hdp, *dQp = dOp + FT * hdp; /* [FT, hdp] Q_i, dO_i, dQ_i */
    float *Kc = dQp + FT * hdp, *Vc = Kc + (int64_t)kch * FT * hdp;         /* [kch*FT, hdp] the chunk's */
    float *dKc = Vc + (int64_t)kch * FT * hdp, *dVc = dKc + (int64_t)kch * FT * hdp; /* K, V, dK, dV */
    const rb_vec vscale = rb_set1(scale);
    /* key tiles in chunks [kc0, kc1), as the AVX-512 kernel: every dK, dV element gets its terms in
     * (head, query tile) order, every dQ element in key order */
    for (int kc0 = 0; kc0 < nt; kc0 += kch) {
        const int kc1 = kc0 + kch < nt ? kc0 + kch : nt;
        const int c0 = kc0 * FT, nkc = (kc1 * FT < T ? kc1 * FT : T) - c0; /* keys of the chunk */
        const int64_t koff = ((int64_t)b * T + c0) * ldk + (int64_t)kvh * hd;
        pack_rows(Kc, k + koff, ldk, nkc, hd, hdp);
        pack_rows(Vc, v + koff, ldk, nkc, hd, hdp);
        memset(dKc, 0, sizeof(float) * (size_t)nkc * (size_t)hdp);
        memset(dVc, 0, sizeof(float) * (size_t)nkc * (size_t)hdp);
        for (int hh = 0; hh < rep; hh++) {
            const int h = kvh * rep + hh;
            for (int qt = kc0; qt < nt; qt++) {
                const int t0 = qt * FT;
                const int nq = T - t0 < FT ? T - t0 : FT;
                const int64_t qoff = ((int64_t)b * T + t0) * ldq + (int64_t)h * hd;
                const float *qi = q + qoff, *doi = dout + qoff;
                const float *lse_i = lse + ((int64_t)b * H + h) * T + t0;
                const float *D_i = D + ((int64_t)b * H + h) * T + t0;
                pack_t(Qt, qi, ldq, nq, hd, scale);
                pack_t(dOt, doi, ldq, nq, hd, 1.0f);
                pack_rows(Qp, qi, ldq, nq, hd, hdp);
                pack_rows(dOp, doi, ldq, nq, hd, hdp);
                if (kc0 == 0)
                    memset(dQp, 0, sizeof(float) * (size_t)nq * (size_t)hdp);
                else
                    pack_rows(dQp, dq + qoff, ldq, nq, hd, hdp); /* the sum so far */
                const int kend = qt < kc1 - 1 ? qt : kc1 - 1;
                for (int kt = kc0; kt <= kend; kt++) {
                    const int s0 = kt * FT;
                    const int nk = T - s0 < FT ? T - s0 : FT;
                    const int diag = kt == qt;
                    const int64_t co = (int64_t)(s0 - c0) * hdp; /* the tile's rows in the chunk */
                    const float *Kp = Kc + co, *Vp = Vc + co;
                    scores_t(Pt, Kp, hdp, Qt, nk, hd, diag);
                    scores_t(dSt, Vp, hdp, dOt, nk, hd, diag); /* dP^T = V_j dO_i^T */
                    for (int g = 0; g < FT / RB_VL; g++) {
                        const int live = nq - RB_VL * g; /* rows of the group that exist */
                        if (live <= 0) break;
                        const int cend = RB_FN(group_keys)(g, nk, diag);
                        const rb_mask rows = rb_rows(live);
                        const rb_vec lv = rb_ld_or(rows, lse_i + RB_VL * g, rb_zero());
                        const rb_vec Dv = rb_ld_or(rows, D_i + RB_VL * g, rb_zero());
                        for (int c = 0; c < cend; c++) {
                            float *p = Pt + (int64_t)c * FT + RB_VL * g, *ds = dSt + (int64_t)c * FT + RB_VL * g;
                            /* P = exp(S - lse), 0 where masked; dS = scale * P * (dP - D) */
                            const rb_mask keep = diag && c > RB_VL * g ? rb_mask_and(rows, rb_causal(c, g)) : rows;
                            const rb_vec e = rb_keep(keep, rb_exp(rb_sub(rb_ld(p), lv)));
                            rb_st(p, e);
                            rb_st(ds, rb_mul(vscale, rb_mul(e, rb_sub(rb_ld(ds), Dv))));
                        }
                    }
                    keys_by_rows(dVc + co, hdp, Pt, dOp, hdp, nq, nk, hd, diag); /* dV_j += P^T dO_i */
                    keys_by_rows(dKc + co, hdp, dSt, Qp, hdp, nq, nk, hd, diag); /* dK_j += dS^T Q_i */
                    rows_by_keys(dQp, hdp, dSt, Kp, hdp, nq, nk, hd, diag, 1);  /* dQ_i += dS K_j */
                }
                for (int r = 0; r < nq; r++) memcpy(dq + qoff + r * ldq, dQp + r * hdp, sizeof(float) * (size_t)hd);
            }
        }
        for (int r = 0; r < nkc; r++) {
            memcpy(dk + koff + r * ldk, dKc + r * hdp, sizeof(float) * (size_t)hd);
            memcpy(dv + koff + r * ldk, dVc + r * hdp, sizeof(float) * (size_t)hd);
        }
    }
}
