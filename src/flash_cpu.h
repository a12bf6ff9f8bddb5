// flash_cpu.h - FlashAttention-2 on the CPU: the tiled reference (fp32) for tsys.
//
// defines: tsys__cpu_flash_fwd, tsys__cpu_flash_bwd
//
// This is the algorithm of the CS336 handout (§1.3.2, Algorithm 1, and the backward with recomputation,
// Eqs. 13-19), written as plain loops so that it reads as the spec. It is the truth the CUDA kernels are
// checked against, so it favours clarity over speed: fp32 everywhere, tiles of 32 x 32, OpenMP over
// (batch*head, tile).
//
// Layout: q (bh, n_q, d), k and v (bh, n_k, d), o (bh, n_q, d), lse (bh, n_q); all contiguous fp32.
// Causal: query i keeps key j when i >= j; a masked score gets +(-1e6), exactly as the handout, so lse is
// torch.logsumexp of the masked scores. A key tile whose every key is masked for every query of the tile
// is skipped: its terms are exp(-1e6 - m), which is 0 in fp32, so skipping changes no bit of the result
// (row 0 always keeps key 0, so a row is never fully masked).
//
// Self-contained: libc + (optionally) OpenMP. Valid C11 and C++.
#ifndef TSYS_FLASH_CPU_H
#define TSYS_FLASH_CPU_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef TSYS__OMP
#if defined(_OPENMP) && !defined(TSYS_NO_OPENMP)
#define TSYS__OMP(x) _Pragma(#x)
#else
#define TSYS__OMP(x)
#endif
#endif

#define TSYS__FLASH_CPU_BQ 32   // query rows per tile
#define TSYS__FLASH_CPU_BK 32   // key rows per tile

// S[i][j] = scale * q_i . k_j for one (query tile, key tile) pair, masked as the handout says.
static void tsys__cpu_flash_scores(float *s, const float *q, const float *k, int64_t q0, int64_t nq_t,
                                   int64_t k0, int64_t nk_t, int64_t d, float scale, bool causal) {
    for (int64_t i = 0; i < nq_t; i++) {
        const float *qi = q + (q0 + i) * d;
        for (int64_t j = 0; j < nk_t; j++) {
            const float *kj = k + (k0 + j) * d;
            float acc = 0.0f;
            for (int64_t c = 0; c < d; c++) acc += qi[c] * kj[c];
            acc *= scale;
            if (causal && q0 + i < k0 + j) acc += -1e6f;
            s[i * TSYS__FLASH_CPU_BK + j] = acc;
        }
    }
}

// Number of key tiles query tile [q0, q0 + nq_t) must visit: causal stops after the tile that holds key
// q0 + nq_t - 1, the last key any of its rows keeps.
static int64_t tsys__cpu_flash_key_tiles(int64_t q0, int64_t nq_t, int64_t n_k, bool causal) {
    int64_t tk = (n_k + TSYS__FLASH_CPU_BK - 1) / TSYS__FLASH_CPU_BK;
    if (causal) {
        int64_t last = (q0 + nq_t - 1) / TSYS__FLASH_CPU_BK + 1;
        if (last < tk) tk = last;
    }
    return tk;
}

// Forward, Algorithm 1: for each query tile keep O (unnormalised), the running max m and the running sum l;
// each key tile rescales them by exp(m_old - m_new) and adds its own terms.
static void tsys__cpu_flash_fwd(const float *q, const float *k, const float *v, float *o, float *lse,
                                int64_t bh, int64_t n_q, int64_t n_k, int64_t d, float scale, bool causal) {
    const int64_t BQ = TSYS__FLASH_CPU_BQ, BK = TSYS__FLASH_CPU_BK;
    const int64_t tq = (n_q + BQ - 1) / BQ;
    TSYS__OMP(omp parallel)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(BQ * BK));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(BQ * d));
        float m[TSYS__FLASH_CPU_BQ], l[TSYS__FLASH_CPU_BQ];
        TSYS__OMP(omp for schedule(dynamic))
        for (int64_t t = 0; t < bh * tq; t++) {
            const int64_t b = t / tq, q0 = (t % tq) * BQ;
            const int64_t nq_t = n_q - q0 < BQ ? n_q - q0 : BQ;
            const float *qb = q + b * n_q * d, *kb = k + b * n_k * d, *vb = v + b * n_k * d;
            for (int64_t i = 0; i < nq_t; i++) { m[i] = -INFINITY; l[i] = 0.0f; }
            memset(acc, 0, sizeof(float) * (size_t)(BQ * d));
            const int64_t tk = tsys__cpu_flash_key_tiles(q0, nq_t, n_k, causal);
            for (int64_t j = 0; j < tk; j++) {
                const int64_t k0 = j * BK, nk_t = n_k - k0 < BK ? n_k - k0 : BK;
                tsys__cpu_flash_scores(s, qb, kb, q0, nq_t, k0, nk_t, d, scale, causal);
                for (int64_t i = 0; i < nq_t; i++) {
                    float *si = s + i * BK, *ai = acc + i * d;
                    float mx = m[i];
                    for (int64_t c = 0; c < nk_t; c++) mx = si[c] > mx ? si[c] : mx;
                    const float alpha = expf(m[i] - mx);   // exp(-inf) = 0 on the first tile
                    float sum = 0.0f;
                    for (int64_t c = 0; c < nk_t; c++) { si[c] = expf(si[c] - mx); sum += si[c]; }
                    l[i] = alpha * l[i] + sum;
                    m[i] = mx;
                    for (int64_t c = 0; c < d; c++) ai[c] *= alpha;
                    for (int64_t c = 0; c < nk_t; c++) {
                        const float p = si[c], *vc = vb + (k0 + c) * d;
                        for (int64_t e = 0; e < d; e++) ai[e] += p * vc[e];
                    }
                }
            }
            for (int64_t i = 0; i < nq_t; i++) {
                const float inv = 1.0f / l[i];
                float *oi = o + (b * n_q + q0 + i) * d;
                for (int64_t c = 0; c < d; c++) oi[c] = acc[i * d + c] * inv;
                lse[b * n_q + q0 + i] = m[i] + logf(l[i]);
            }
        }
        free(s);
        free(acc);
    }
}

// D_i = rowsum(dO_i * O_i) for rows [q0, q0 + nq_t) of one batch*head.
static void tsys__cpu_flash_dvec(float *dvec, const float *dout, const float *o, int64_t q0, int64_t nq_t, int64_t d) {
    for (int64_t i = 0; i < nq_t; i++) {
        const float *a = dout + (q0 + i) * d, *b = o + (q0 + i) * d;
        float acc = 0.0f;
        for (int64_t c = 0; c < d; c++) acc += a[c] * b[c];
        dvec[i] = acc;
    }
}

// Backward with recomputation: P = exp(S - L), dV = P^T dO, dP = dO V^T, dS = P o (dP - D),
// dQ = scale dS K, dK = scale dS^T Q. Two passes, as the CUDA kernels do, so no two threads ever write
// one output: pass 1 owns a key tile (dK, dV) and walks the query tiles; pass 2 owns a query tile (dQ)
// and walks the key tiles. D is recomputed per query tile, which costs BQ*d and needs no scratch.
static void tsys__cpu_flash_bwd(const float *dout, const float *q, const float *k, const float *v,
                                const float *o, const float *lse, float *dq, float *dk, float *dv,
                                int64_t bh, int64_t n_q, int64_t n_k, int64_t d, float scale, bool causal) {
    const int64_t BQ = TSYS__FLASH_CPU_BQ, BK = TSYS__FLASH_CPU_BK;
    const int64_t tq = (n_q + BQ - 1) / BQ, tk = (n_k + BK - 1) / BK;
    // pass 1: dK, dV
    TSYS__OMP(omp parallel)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(BQ * BK));
        float dvec[TSYS__FLASH_CPU_BQ];
        TSYS__OMP(omp for schedule(dynamic))
        for (int64_t t = 0; t < bh * tk; t++) {
            const int64_t b = t / tk, k0 = (t % tk) * BK;
            const int64_t nk_t = n_k - k0 < BK ? n_k - k0 : BK;
            const float *qb = q + b * n_q * d, *kb = k + b * n_k * d, *vb = v + b * n_k * d;
            const float *ob = o + b * n_q * d, *gb = dout + b * n_q * d, *lb = lse + b * n_q;
            float *dkb = dk + (b * n_k + k0) * d, *dvb = dv + (b * n_k + k0) * d;
            memset(dkb, 0, sizeof(float) * (size_t)(nk_t * d));
            memset(dvb, 0, sizeof(float) * (size_t)(nk_t * d));
            // causal: query tiles that end before this key tile starts see none of its keys
            const int64_t i_first = causal ? k0 / BQ : 0;
            for (int64_t it = i_first; it < tq; it++) {
                const int64_t q0 = it * BQ, nq_t = n_q - q0 < BQ ? n_q - q0 : BQ;
                tsys__cpu_flash_scores(s, qb, kb, q0, nq_t, k0, nk_t, d, scale, causal);
                tsys__cpu_flash_dvec(dvec, gb, ob, q0, nq_t, d);
                for (int64_t i = 0; i < nq_t; i++) {
                    const float *gi = gb + (q0 + i) * d, *qi = qb + (q0 + i) * d;
                    for (int64_t j = 0; j < nk_t; j++) {
                        const float p = expf(s[i * BK + j] - lb[q0 + i]);
                        const float *vj = vb + (k0 + j) * d;
                        float dp = 0.0f;
                        for (int64_t c = 0; c < d; c++) dp += gi[c] * vj[c];
                        const float ds = p * (dp - dvec[i]) * scale;
                        float *dkj = dkb + j * d, *dvj = dvb + j * d;
                        for (int64_t c = 0; c < d; c++) { dvj[c] += p * gi[c]; dkj[c] += ds * qi[c]; }
                    }
                }
            }
        }
        free(s);
    }
    // pass 2: dQ
    TSYS__OMP(omp parallel)
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(BQ * BK));
        float dvec[TSYS__FLASH_CPU_BQ];
        TSYS__OMP(omp for schedule(dynamic))
        for (int64_t t = 0; t < bh * tq; t++) {
            const int64_t b = t / tq, q0 = (t % tq) * BQ;
            const int64_t nq_t = n_q - q0 < BQ ? n_q - q0 : BQ;
            const float *qb = q + b * n_q * d, *kb = k + b * n_k * d, *vb = v + b * n_k * d;
            const float *ob = o + b * n_q * d, *gb = dout + b * n_q * d, *lb = lse + b * n_q;
            float *dqb = dq + (b * n_q + q0) * d;
            memset(dqb, 0, sizeof(float) * (size_t)(nq_t * d));
            tsys__cpu_flash_dvec(dvec, gb, ob, q0, nq_t, d);
            const int64_t tkq = tsys__cpu_flash_key_tiles(q0, nq_t, n_k, causal);
            for (int64_t j = 0; j < tkq; j++) {
                const int64_t k0 = j * BK, nk_t = n_k - k0 < BK ? n_k - k0 : BK;
                tsys__cpu_flash_scores(s, qb, kb, q0, nq_t, k0, nk_t, d, scale, causal);
                for (int64_t i = 0; i < nq_t; i++) {
                    const float *gi = gb + (q0 + i) * d;
                    float *dqi = dqb + i * d;
                    for (int64_t jj = 0; jj < nk_t; jj++) {
                        const float p = expf(s[i * BK + jj] - lb[q0 + i]);
                        const float *vj = vb + (k0 + jj) * d, *kj = kb + (k0 + jj) * d;
                        float dp = 0.0f;
                        for (int64_t c = 0; c < d; c++) dp += gi[c] * vj[c];
                        const float ds = p * (dp - dvec[i]) * scale;
                        for (int64_t c = 0; c < d; c++) dqi[c] += ds * kj[c];
                    }
                }
            }
        }
        free(s);
    }
}

#endif // TSYS_FLASH_CPU_H
