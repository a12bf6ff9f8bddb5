// flash_cuda.cuh - FlashAttention-2 forward and backward CUDA kernels for tsys (sm_80+, tuned on sm_90).
//
// defines: tsys_cuda__flash_fwd, tsys_cuda__flash_bwd, tsys_cuda__flash_bwd_scratch_bytes,
//          tsys_cuda__flash_supported
//
// Layout everywhere: q, k, v, o and their gradients are (bh, n, d) contiguous in the one input dtype
// (fp32, bf16 or fp16); lse is (bh, n) fp32, natural log, lse_i = logsumexp_j(scale * q_i . k_j) over the
// kept keys. Causal keeps key j for query i when i >= j (the CS336 rule); masked scores are -inf here,
// which gives the same O and lse as the handout's +(-1e6) because exp(-1e6 - m) is 0 in fp32.
//
// Kernels (bf16/fp16: tensor cores, mma.sync m16n8k16 with fp32 accumulation; fp32: a SIMT version):
//   flash_fwd      one block per (query tile, bh); loops over key tiles with the online softmax
//                  (Algorithm 1 of the handout); writes O and lse.
//   flash_bwd_dot  D_i = rowsum(dO_i * O_i) in fp32 (the scratch buffer).
//   flash_bwd_dkdv one block per (key tile, bh); loops over query tiles, recomputes P = exp(S - L) and
//                  accumulates dV = P^T dO and dK = scale * dS^T Q in registers.
//   flash_bwd_dq   one block per (query tile, bh); loops over key tiles and accumulates
//                  dQ = scale * dS K in registers.
// Each output element is written by exactly one thread, once, after a fixed-order loop: no atomics,
// and the backward is bit-identical from run to run. dQ recomputes S and dP (7 matmuls instead of 5):
// that is the price of no atomics.
//
// Any n >= 1 works: tiles are loaded with zero fill past row n and the masks drop keys >= n and queries
// >= n. Causal launches skip key tiles that every query of a tile masks, and the heaviest tiles start
// first. Head dims: 16, 32, 64, 80, 128 (the tensor-core kernels need d % 16 == 0; d = 80 is 5 k-steps).
//
// Hopper: built for sm_90a (-gencode arch=compute_90a,code=sm_90a), bf16/fp16 at d = 64 and 128 run wgmma
// versions of the three tensor-core kernels (tsys__flash_*_wg_kernel, below the fp32 kernels); in any other
// build, or with TSYS_FLASH_NO_WGMMA=1 in the environment, the mma.sync kernels run.
//
// Self-contained: CUDA runtime only. The launchers return cudaError_t (cudaErrorInvalidValue for a
// shape they don't support) and never synchronise.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdlib.h>
#include <type_traits>

#define TSYS__FLASH_LOG2E 1.4426950408889634f
#define TSYS__FLASH_LN2 0.6931471805599453f

// ------------------------------------------------------------------------------------------------
// PTX helpers: cp.async (16-byte global -> shared, zero-filled when the row is out of range),
// ldmatrix (four 8x8 b16 tiles from shared into mma fragments) and the m16n8k16 mma.
//
// mma.m16n8k16 fragment layout (lane = threadIdx.x % 32, g = lane / 4, c = lane % 4):
//   A 16x16 (row-major): a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]
//   B 16x8  (k x n):     b0 = B[2c..2c+1][g],  b1 = B[2c+8..2c+9][g]
//   C 16x8  (fp32):      c0,c1 = C[g][2c..2c+1], c2,c3 = C[g+8][2c..2c+1]
// Two C tiles side by side (16 x 16) are, once rounded to 16 bits and paired, exactly an A fragment:
// that is how P and dS go from one matmul's accumulators to the next matmul's input without shared memory.

__device__ __forceinline__ uint32_t tsys__smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void tsys__cp_async16(void *smem, const void *gmem, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tsys__smem_addr(smem)), "l"(gmem),
                 "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void tsys__cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void tsys__cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void tsys__ldsm_x4(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tsys__smem_addr(p)));
}
__device__ __forceinline__ void tsys__ldsm_x4_t(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tsys__smem_addr(p)));
}

// 2^x on the special-function unit (flush-to-zero; exp2f without fast-math adds denormal fix-ups).
// 2^-inf = 0, which is what the masks rely on.
__device__ __forceinline__ float tsys__ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The 16-bit type's mma and its pack of two floats (low half = the lower column).
template <typename T> struct tsys__flash_t;
template <> struct tsys__flash_t<__nv_bfloat16> {
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *(uint32_t *)&h;
    }
};
template <> struct tsys__flash_t<__half> {
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *(uint32_t *)&h;
    }
};

// Shared-memory tiles hold R rows of D 16-bit elements with a row stride of D + 8: the 16-byte pad puts
// the 8 rows one ldmatrix phase reads into 8 different 16-byte bank groups for every D used here.
template <int D> struct tsys__flash_smem { static constexpr int SD = D + 8; };

// Copy rows [r0, r0 + R) of a (n, D) matrix into a padded shared tile; rows >= n become zeros, so a tail
// tile adds nothing to any product (the masks drop those rows too).
template <int R, int D, int NT, typename T>
__device__ __forceinline__ void tsys__flash_load_tile(T *s, const T *g, int r0, int n) {
    constexpr int CPR = D / 8, SD = D + 8;   // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < R * CPR; c += NT) {
        const int r = c / CPR, cc = c % CPR;
        const bool ok = r0 + r < n;
        tsys__cp_async16(s + r * SD + cc * 8, g + (size_t)(ok ? r0 + r : 0) * D + cc * 8, ok);
    }
}

// Load the A fragment of a 16 x 16 block at (row r0, col c0) of a padded row-major shared tile.
template <int SD, typename T>
__device__ __forceinline__ void tsys__flash_lda(uint32_t a[4], const T *s, int r0, int c0, int lane) {
    tsys__ldsm_x4(a, s + (r0 + (lane & 15)) * SD + c0 + (lane >> 4) * 8);
}
// B fragments of two n-blocks for C = A X^T where X is stored row-major (rows = n, cols = k):
// rows n0..n0+15, k cols c0..c0+15. b[0], b[1] feed n-block n0, b[2], b[3] n-block n0 + 8.
template <int SD, typename T>
__device__ __forceinline__ void tsys__flash_ldb(uint32_t b[4], const T *s, int n0, int c0, int lane) {
    tsys__ldsm_x4(b, s + (n0 + (lane & 7) + (lane >> 4) * 8) * SD + c0 + ((lane >> 3) & 1) * 8);
}
// B fragments of two n-blocks for C = A X where X is stored row-major (rows = k, cols = n):
// k rows k0..k0+15, n cols n0..n0+15 (ldmatrix transposes on the way).
template <int SD, typename T>
__device__ __forceinline__ void tsys__flash_ldb_t(uint32_t b[4], const T *s, int k0, int n0, int lane) {
    tsys__ldsm_x4_t(b, s + (k0 + (lane & 15)) * SD + n0 + (lane >> 4) * 8);
}

// acc[M/16 rows][N/8 n-blocks] (+)= A (M x K, rows r0.., shared) * X^T (X: N x K rows n0.., shared),
// for one warp. MT m-tiles share every B fragment, which halves the shared-memory reads per mma.
template <typename T, int SD, int MT, int N, int K>
__device__ __forceinline__ void tsys__flash_gemm_nt(float (*acc)[N / 8][4], const T *sa, int r0, const T *sx, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) tsys__flash_lda<SD>(a[mt], sa, r0 + mt * 16, kk * 16, lane);
#pragma unroll
        for (int nb = 0; nb < N / 16; nb++) {
            uint32_t b[4];
            tsys__flash_ldb<SD>(b, sx, nb * 16, kk * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                tsys__flash_t<T>::mma(acc[mt][2 * nb], a[mt], b[0], b[1]);
                tsys__flash_t<T>::mma(acc[mt][2 * nb + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc (M x N) += P (M x K, fp32 accumulators of a previous gemm, rounded here) * X (X: K x N rows k.., shared).
template <typename T, int SD, int MT, int K, int N>
__device__ __forceinline__ void tsys__flash_gemm_pn(float (*acc)[N / 8][4], float (*p)[K / 8][4], const T *sx, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            a[mt][0] = tsys__flash_t<T>::pack(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            a[mt][1] = tsys__flash_t<T>::pack(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            a[mt][2] = tsys__flash_t<T>::pack(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            a[mt][3] = tsys__flash_t<T>::pack(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int nb = 0; nb < N / 16; nb++) {
            uint32_t b[4];
            tsys__flash_ldb_t<SD>(b, sx, kk * 16, nb * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                tsys__flash_t<T>::mma(acc[mt][2 * nb], a[mt], b[0], b[1]);
                tsys__flash_t<T>::mma(acc[mt][2 * nb + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

template <int MT, int N>
__device__ __forceinline__ void tsys__flash_zero(float (*acc)[N / 8][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nb = 0; nb < N / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nb][e] = 0.0f;
}

// Store a warp's (MT*16) x D fp32 accumulator, times mul, as T rows [row0, row0 + MT*16) of a (n, D)
// matrix; rows >= n are dropped. Each lane writes pairs of 16-bit values (4 bytes).
template <typename T, int MT, int D>
__device__ __forceinline__ void tsys__flash_store(T *g, float (*acc)[D / 8][4], int row0, int n, float mul, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = row0 + mt * 16 + (lane >> 2) + h * 8;
            if (row >= n) continue;
#pragma unroll
            for (int nb = 0; nb < D / 8; nb++) {
                const int col = nb * 8 + (lane & 3) * 2;
                *(uint32_t *)(g + (size_t)row * D + col) =
                    tsys__flash_t<T>::pack(acc[mt][nb][2 * h] * mul, acc[mt][nb][2 * h + 1] * mul);
            }
        }
}

// ------------------------------------------------------------------------------------------------
// Forward (bf16/fp16). Block: NW warps, BQ = NW * MT * 16 query rows; warp w owns rows
// [w*MT*16, (w+1)*MT*16) of the tile. Key/value tiles of BK rows are double-buffered in shared memory
// (cp.async for tile j+1 in flight while tile j is used). Per key tile and warp:
//   S = Q K^T (fp32, registers) -> scaled to log2 units, masked -> online softmax (row max and sum across
//   the 4 lanes of a quad) -> O = alpha O + P V with P re-used from registers as the A operand.
// The row sum l is kept per lane and reduced across the quad once, at the end.
// Shared memory: (BQ + 4 BK) * (D + 8) * sizeof(T).

template <typename T, int D, int MT, int BK, int NW, bool CAUSAL>
__global__ void __launch_bounds__(NW * 32)
tsys__flash_fwd_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ o,
                       float *__restrict__ lse, int n, float scale_log2) {
    constexpr int BQ = NW * MT * 16, SD = D + 8, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char tsys__flash_smem_raw[];
    T *qs = (T *)tsys__flash_smem_raw;
    T *ks = qs + BQ * SD;        // [2][BK * SD]
    T *vs = ks + 2 * BK * SD;    // [2][BK * SD]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;   // causal: longest rows first
    const int q0 = qt * BQ, wr0 = warp * MT * 16;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; o += base; lse += (size_t)blockIdx.y * n;

    int nkt = (n + BK - 1) / BK;
    if (CAUSAL) nkt = min(nkt, (q0 + BQ - 1) / BK + 1);

    tsys__flash_load_tile<BQ, D, NT>(qs, q, q0, n);
    tsys__flash_load_tile<BK, D, NT>(ks, k, 0, n);
    tsys__flash_load_tile<BK, D, NT>(vs, v, 0, n);
    tsys__cp_async_commit();

    float oacc[MT][D / 8][4];
    tsys__flash_zero<MT, D>(oacc);
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;

    for (int j = 0; j < nkt; j++) {
        if (j + 1 < nkt) {   // prefetch the next key/value tile into the other buffer
            tsys__flash_load_tile<BK, D, NT>(ks + ((j + 1) & 1) * BK * SD, k, (j + 1) * BK, n);
            tsys__flash_load_tile<BK, D, NT>(vs + ((j + 1) & 1) * BK * SD, v, (j + 1) * BK, n);
            tsys__cp_async_commit();
            tsys__cp_async_wait<1>();
        } else {
            tsys__cp_async_wait<0>();
        }
        __syncthreads();
        const int k0 = j * BK;
        // a warp whose rows all precede this tile's first key has nothing to add (causal diagonal)
        const bool active = !CAUSAL || k0 <= q0 + wr0 + MT * 16 - 1;
        if (active) {
            const T *kt = ks + (j & 1) * BK * SD, *vt = vs + (j & 1) * BK * SD;
            float s[MT][BK / 8][4];
            tsys__flash_zero<MT, BK>(s);
            tsys__flash_gemm_nt<T, SD, MT, BK, D>(s, qs, wr0, kt, lane);

            const bool need_mask = k0 + BK > n || (CAUSAL && k0 + BK - 1 > q0 + wr0);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int row = q0 + wr0 + mt * 16 + (lane >> 2) + h * 8;
                    float mx = m[mt][h];
#pragma unroll
                    for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            float x = s[mt][nb][2 * h + e] * scale_log2;
                            if (need_mask) {
                                const int col = k0 + nb * 8 + (lane & 3) * 2 + e;
                                if (col >= n || (CAUSAL && col > row)) x = -INFINITY;
                            }
                            s[mt][nb][2 * h + e] = x;
                            mx = fmaxf(mx, x);
                        }
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    // mx = -inf only for a row with no key yet (a tail row); keep its terms at 0, not NaN
                    const float mref = mx == -INFINITY ? 0.0f : mx;
                    const float alpha = tsys__ex2(m[mt][h] - mref);
                    float sum = 0.0f;
#pragma unroll
                    for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const float p = tsys__ex2(s[mt][nb][2 * h + e] - mref);
                            s[mt][nb][2 * h + e] = p;
                            sum += p;
                        }
                    l[mt][h] = l[mt][h] * alpha + sum;
                    m[mt][h] = mx;
#pragma unroll
                    for (int nb = 0; nb < D / 8; nb++) oacc[mt][nb][2 * h] *= alpha, oacc[mt][nb][2 * h + 1] *= alpha;
                }
            }
            tsys__flash_gemm_pn<T, SD, MT, BK, D>(oacc, s, vt, lane);
        }
        __syncthreads();   // everyone is done with buffer j & 1 before it is refilled
    }

    // epilogue: finish the row sums across the quad, normalise, write O and lse (natural log)
    float inv[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float sum = l[mt][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inv[mt][h] = 1.0f / sum;
            const int row = q0 + wr0 + mt * 16 + (lane >> 2) + h * 8;
            if ((lane & 3) == 0 && row < n) lse[row] = (m[mt][h] + log2f(sum)) * TSYS__FLASH_LN2;
        }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nb = 0; nb < D / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) oacc[mt][nb][e] *= inv[mt][e >> 1];
    tsys__flash_store<T, MT, D>(o, oacc, q0 + wr0, n, 1.0f, lane);
}

// ------------------------------------------------------------------------------------------------
// Backward pre-pass: dvec[row] = sum_c dO[row][c] * O[row][c] (fp32). One warp per row.
template <typename T>
__global__ void tsys__flash_bwd_dot_kernel(const T *__restrict__ dout, const T *__restrict__ o, float *__restrict__ dvec,
                                           int64_t rows, int d) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32) acc += (float)dout[row * d + c] * (float)o[row * d + c];
#pragma unroll
    for (int off = 16; off; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) dvec[row] = acc;
}

// ------------------------------------------------------------------------------------------------
// Backward dK, dV (bf16/fp16). Block: NW warps, BKV = NW * MK * 16 keys; warp w owns MK*16 keys of the
// tile and keeps their dK, dV (MK*16 x D fp32) in registers. K and V of the tile stay in shared memory;
// query tiles of BQ rows (Q, dO, L, D) are double-buffered. Everything is computed transposed, keys as rows:
//   S^T = K Q^T, P^T = exp2(S^T * scale*log2e - L*log2e), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T o (dP^T - D), dK += dS^T Q; dK is scaled once at the end.
// MK = 2 lets each Q / dO fragment read from shared memory feed two mma (shared-memory bandwidth is what
// limits the MK = 1 version). Causal: query tiles that end before the key tile starts are skipped; key
// tile 0 is the longest, so the natural block order already starts the heavy blocks first.
// Shared memory: (2 BKV + 4 BQ) * (D + 8) * sizeof(T) + 4 BQ * 4.

template <typename T, int D, int MK, int BQ, int NW, bool CAUSAL>
__global__ void __launch_bounds__(NW * 32)
tsys__flash_bwd_dkdv_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                            const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ dvec,
                            T *__restrict__ dk, T *__restrict__ dv, int n, float scale, float scale_log2) {
    constexpr int BKV = NW * MK * 16, SD = D + 8, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char tsys__flash_smem_raw[];
    T *ks = (T *)tsys__flash_smem_raw;
    T *vs = ks + BKV * SD;
    T *qs = vs + BKV * SD;       // [2][BQ * SD]
    T *gs = qs + 2 * BQ * SD;    // [2][BQ * SD]  dO
    float *ls = (float *)(gs + 2 * BQ * SD);   // [2][BQ]  lse * log2e
    float *ds = ls + 2 * BQ;                   // [2][BQ]  D

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k0 = blockIdx.x * BKV, wk0 = warp * MK * 16;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; dout += base; dk += base; dv += base;
    lse += (size_t)blockIdx.y * n; dvec += (size_t)blockIdx.y * n;

    const int it0 = CAUSAL ? k0 / BQ : 0, nqt = (n + BQ - 1) / BQ;

    tsys__flash_load_tile<BKV, D, NT>(ks, k, k0, n);
    tsys__flash_load_tile<BKV, D, NT>(vs, v, k0, n);
    auto load_q = [&](int it, int buf) {
        const int q0 = it * BQ;
        tsys__flash_load_tile<BQ, D, NT>(qs + buf * BQ * SD, q, q0, n);
        tsys__flash_load_tile<BQ, D, NT>(gs + buf * BQ * SD, dout, q0, n);
        for (int i = threadIdx.x; i < BQ; i += NT) {   // plain loads: tiny, and visible after the barrier
            const bool ok = q0 + i < n;
            ls[buf * BQ + i] = ok ? lse[q0 + i] * TSYS__FLASH_LOG2E : 0.0f;
            ds[buf * BQ + i] = ok ? dvec[q0 + i] : 0.0f;
        }
    };
    load_q(it0, 0);
    tsys__cp_async_commit();

    float dka[MK][D / 8][4], dva[MK][D / 8][4];
    tsys__flash_zero<MK, D>(dka);
    tsys__flash_zero<MK, D>(dva);

    for (int it = it0; it < nqt; it++) {
        const int buf = (it - it0) & 1;
        if (it + 1 < nqt) {
            load_q(it + 1, buf ^ 1);
            tsys__cp_async_commit();
            tsys__cp_async_wait<1>();
        } else {
            tsys__cp_async_wait<0>();
        }
        __syncthreads();
        const int q0 = it * BQ;
        // causal: this warp's keys all come after every query of the tile -> nothing to add
        const bool active = !CAUSAL || k0 + wk0 <= q0 + BQ - 1;
        if (active) {
            const T *qt = qs + buf * BQ * SD, *gt = gs + buf * BQ * SD;
            const float *lt = ls + buf * BQ, *dt = ds + buf * BQ;
            float st[MK][BQ / 8][4], dpt[MK][BQ / 8][4];
            tsys__flash_zero<MK, BQ>(st);
            tsys__flash_gemm_nt<T, SD, MK, BQ, D>(st, ks, wk0, qt, lane);   // S^T = K Q^T
            const bool need_mask = q0 + BQ > n || (CAUSAL && k0 + wk0 + MK * 16 - 1 > q0);
#pragma unroll
            for (int mt = 0; mt < MK; mt++)
#pragma unroll
                for (int nb = 0; nb < BQ / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                        float p = tsys__ex2(st[mt][nb][e] * scale_log2 - lt[qi]);
                        if (need_mask) {
                            const int key = k0 + wk0 + mt * 16 + (lane >> 2) + (e >> 1) * 8, query = q0 + qi;
                            if (query >= n || (CAUSAL && key > query)) p = 0.0f;
                        }
                        st[mt][nb][e] = p;
                    }
            tsys__flash_gemm_pn<T, SD, MK, BQ, D>(dva, st, gt, lane);        // dV += P^T dO
            tsys__flash_zero<MK, BQ>(dpt);
            tsys__flash_gemm_nt<T, SD, MK, BQ, D>(dpt, vs, wk0, gt, lane);   // dP^T = V dO^T
#pragma unroll
            for (int mt = 0; mt < MK; mt++)
#pragma unroll
                for (int nb = 0; nb < BQ / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                        dpt[mt][nb][e] = st[mt][nb][e] * (dpt[mt][nb][e] - dt[qi]);   // dS^T
                    }
            tsys__flash_gemm_pn<T, SD, MK, BQ, D>(dka, dpt, qt, lane);       // dK += dS^T Q
        }
        __syncthreads();
    }
    tsys__flash_store<T, MK, D>(dk, dka, k0 + wk0, n, scale, lane);
    tsys__flash_store<T, MK, D>(dv, dva, k0 + wk0, n, 1.0f, lane);
}

// ------------------------------------------------------------------------------------------------
// Backward dQ (bf16/fp16). Block: NW warps, BQ = NW * MQ * 16 queries; warp w owns MQ*16 query rows and
// their dQ (fp32) in registers; its lse and D values live in registers too. Key/value tiles of BK rows are
// double-buffered. Per key tile: S = Q K^T, dP = dO V^T, P = exp2(S*scale*log2e - L*log2e),
// dS = P o (dP - D), dQ += dS K; dQ is scaled once at the end.
// Shared memory: (2 BQ + 4 BK) * (D + 8) * sizeof(T).

template <typename T, int D, int MQ, int BK, int NW, bool CAUSAL>
__global__ void __launch_bounds__(NW * 32)
tsys__flash_bwd_dq_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                          const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ dvec,
                          T *__restrict__ dq, int n, float scale, float scale_log2) {
    constexpr int BQ = NW * MQ * 16, SD = D + 8, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char tsys__flash_smem_raw[];
    T *qs = (T *)tsys__flash_smem_raw;
    T *gs = qs + BQ * SD;
    T *ks = gs + BQ * SD;        // [2][BK * SD]
    T *vs = ks + 2 * BK * SD;    // [2][BK * SD]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qt * BQ, wr0 = warp * MQ * 16;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; dout += base; dq += base;
    lse += (size_t)blockIdx.y * n; dvec += (size_t)blockIdx.y * n;

    int nkt = (n + BK - 1) / BK;
    if (CAUSAL) nkt = min(nkt, (q0 + BQ - 1) / BK + 1);

    tsys__flash_load_tile<BQ, D, NT>(qs, q, q0, n);
    tsys__flash_load_tile<BQ, D, NT>(gs, dout, q0, n);
    tsys__flash_load_tile<BK, D, NT>(ks, k, 0, n);
    tsys__flash_load_tile<BK, D, NT>(vs, v, 0, n);
    tsys__cp_async_commit();

    float lrow[MQ][2], drow[MQ][2];
#pragma unroll
    for (int mt = 0; mt < MQ; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = q0 + wr0 + mt * 16 + (lane >> 2) + h * 8;
            lrow[mt][h] = row < n ? lse[row] * TSYS__FLASH_LOG2E : 0.0f;
            drow[mt][h] = row < n ? dvec[row] : 0.0f;
        }
    float dqa[MQ][D / 8][4];
    tsys__flash_zero<MQ, D>(dqa);

    for (int j = 0; j < nkt; j++) {
        if (j + 1 < nkt) {
            tsys__flash_load_tile<BK, D, NT>(ks + ((j + 1) & 1) * BK * SD, k, (j + 1) * BK, n);
            tsys__flash_load_tile<BK, D, NT>(vs + ((j + 1) & 1) * BK * SD, v, (j + 1) * BK, n);
            tsys__cp_async_commit();
            tsys__cp_async_wait<1>();
        } else {
            tsys__cp_async_wait<0>();
        }
        __syncthreads();
        const int k0 = j * BK;
        const bool active = !CAUSAL || k0 <= q0 + wr0 + MQ * 16 - 1;
        if (active) {
            const T *kt = ks + (j & 1) * BK * SD, *vt = vs + (j & 1) * BK * SD;
            float s[MQ][BK / 8][4], dp[MQ][BK / 8][4];
            tsys__flash_zero<MQ, BK>(s);
            tsys__flash_gemm_nt<T, SD, MQ, BK, D>(s, qs, wr0, kt, lane);    // S = Q K^T
            tsys__flash_zero<MQ, BK>(dp);
            tsys__flash_gemm_nt<T, SD, MQ, BK, D>(dp, gs, wr0, vt, lane);   // dP = dO V^T
            const bool need_mask = k0 + BK > n || (CAUSAL && k0 + BK - 1 > q0 + wr0);
#pragma unroll
            for (int mt = 0; mt < MQ; mt++)
#pragma unroll
                for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e >> 1;
                        float p = tsys__ex2(s[mt][nb][e] * scale_log2 - lrow[mt][h]);
                        if (need_mask) {
                            const int key = k0 + nb * 8 + (lane & 3) * 2 + (e & 1);
                            const int row = q0 + wr0 + mt * 16 + (lane >> 2) + h * 8;
                            if (key >= n || (CAUSAL && key > row)) p = 0.0f;
                        }
                        s[mt][nb][e] = p * (dp[mt][nb][e] - drow[mt][h]);   // dS
                    }
            tsys__flash_gemm_pn<T, SD, MQ, BK, D>(dqa, s, kt, lane);         // dQ += dS K
        }
        __syncthreads();
    }
    tsys__flash_store<T, MQ, D>(dq, dqa, q0 + wr0, n, scale, lane);
}

// ------------------------------------------------------------------------------------------------
// fp32 (SIMT). Correct and simple rather than fast: fp32 attention is a reference path here (bf16/fp16
// are what training uses). One thread owns one row (a query for fwd and dQ, a key for dK/dV); its own
// row vectors live in shared memory with a stride of D + 1 floats (thread t reads word t*(D+1)+c: no bank
// conflicts); the tile it streams over is read by all threads at the same address (a broadcast).
// Block: 64 threads = 64 rows; the streamed tile has 32 rows.

#define TSYS__FLASH_F32_ROWS 64
#define TSYS__FLASH_F32_TILE 32
#define TSYS__FLASH_F32_FWD_BK(D) ((D) >= 128 ? 16 : 32)   // the forward keeps BK scores + D outputs per thread

// Forward: own row q (shared), o accumulator (registers), key/value tile (shared). Natural-log softmax.
template <int D, bool CAUSAL>
__global__ void __launch_bounds__(TSYS__FLASH_F32_ROWS)
tsys__flash_fwd_f32_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                           float *__restrict__ o, float *__restrict__ lse, int n, float scale) {
    constexpr int R = TSYS__FLASH_F32_ROWS, BK = TSYS__FLASH_F32_FWD_BK(D);
    extern __shared__ float tsys__flash_f32_smem[];
    float *qs = tsys__flash_f32_smem, *ks = qs + R * (D + 1), *vs = ks + BK * D;   // [R][D+1], [BK][D], [BK][D]
    const int t = threadIdx.x;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qt * R, row = q0 + t;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; o += base; lse += (size_t)blockIdx.y * n;
    for (int i = t; i < R * D; i += R) {
        const int r = i / D, c = i % D;
        qs[r * (D + 1) + c] = q0 + r < n ? q[(size_t)(q0 + r) * D + c] : 0.0f;
    }
    float acc[D];
#pragma unroll
    for (int c = 0; c < D; c++) acc[c] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    int nkt = (n + BK - 1) / BK;
    if (CAUSAL) nkt = min(nkt, (q0 + R - 1) / BK + 1);
    const float *qr = qs + t * (D + 1);
    for (int j = 0; j < nkt; j++) {
        const int k0 = j * BK;
        __syncthreads();
        for (int i = t; i < BK * D; i += R) {
            const bool ok = k0 + i / D < n;
            ks[i] = ok ? k[(size_t)k0 * D + i] : 0.0f;
            vs[i] = ok ? v[(size_t)k0 * D + i] : 0.0f;
        }
        __syncthreads();
        float s[BK];
        float mx = m;
#pragma unroll
        for (int jj = 0; jj < BK; jj++) s[jj] = 0.0f;
        for (int c = 0; c < D; c++) {
            const float qc = qr[c];
#pragma unroll
            for (int jj = 0; jj < BK; jj++) s[jj] += qc * ks[jj * D + c];
        }
#pragma unroll
        for (int jj = 0; jj < BK; jj++) {
            const int key = k0 + jj;
            s[jj] = (key >= n || (CAUSAL && key > row)) ? -INFINITY : s[jj] * scale;
            mx = fmaxf(mx, s[jj]);
        }
        const float mref = mx == -INFINITY ? 0.0f : mx;
        const float alpha = expf(m - mref);
        float sum = 0.0f;
#pragma unroll
        for (int jj = 0; jj < BK; jj++) { s[jj] = expf(s[jj] - mref); sum += s[jj]; }
        l = l * alpha + sum;
        m = mx;
#pragma unroll
        for (int c = 0; c < D; c++) {
            float a = acc[c] * alpha;
#pragma unroll
            for (int jj = 0; jj < BK; jj++) a += s[jj] * vs[jj * D + c];
            acc[c] = a;
        }
    }
    if (row < n) {
        const float inv = 1.0f / l;
#pragma unroll
        for (int c = 0; c < D; c++) o[(size_t)row * D + c] = acc[c] * inv;
        lse[row] = m + logf(l);
    }
}

// dK, dV: thread owns key row `key`; its k, v rows and dk, dv accumulators are in shared memory.
template <int D, bool CAUSAL>
__global__ void __launch_bounds__(TSYS__FLASH_F32_ROWS)
tsys__flash_bwd_dkdv_f32_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                const float *__restrict__ dout, const float *__restrict__ lse,
                                const float *__restrict__ dvec, float *__restrict__ dk, float *__restrict__ dv,
                                int n, float scale) {
    constexpr int R = TSYS__FLASH_F32_ROWS, BQ = TSYS__FLASH_F32_TILE, SR = D + 1;
    extern __shared__ float tsys__flash_f32_smem[];
    float *kr = tsys__flash_f32_smem, *vr = kr + R * SR, *dkr = vr + R * SR, *dvr = dkr + R * SR;
    float *qs = dvr + R * SR, *gs = qs + BQ * D, *ls = gs + BQ * D, *dd = ls + BQ;
    const int t = threadIdx.x, k0 = blockIdx.x * R, key = k0 + t;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; dout += base; dk += base; dv += base;
    lse += (size_t)blockIdx.y * n; dvec += (size_t)blockIdx.y * n;
    for (int i = t; i < R * D; i += R) {
        const int r = i / D, c = i % D;
        const bool ok = k0 + r < n;
        kr[r * SR + c] = ok ? k[(size_t)(k0 + r) * D + c] : 0.0f;
        vr[r * SR + c] = ok ? v[(size_t)(k0 + r) * D + c] : 0.0f;
        dkr[r * SR + c] = dvr[r * SR + c] = 0.0f;
    }
    const float *kme = kr + t * SR, *vme = vr + t * SR;
    float *dkme = dkr + t * SR, *dvme = dvr + t * SR;
    const int it0 = CAUSAL ? k0 / BQ : 0, nqt = (n + BQ - 1) / BQ;
    for (int it = it0; it < nqt; it++) {
        const int q0 = it * BQ;
        __syncthreads();
        for (int i = t; i < BQ * D; i += R) {
            const bool ok = q0 + i / D < n;
            qs[i] = ok ? q[(size_t)q0 * D + i] : 0.0f;
            gs[i] = ok ? dout[(size_t)q0 * D + i] : 0.0f;
        }
        for (int i = t; i < BQ; i += R) {
            ls[i] = q0 + i < n ? lse[q0 + i] : 0.0f;
            dd[i] = q0 + i < n ? dvec[q0 + i] : 0.0f;
        }
        __syncthreads();
        for (int i = 0; i < BQ; i++) {
            const int query = q0 + i;
            if (query >= n || (CAUSAL && key > query)) continue;   // per-thread divergence is fine here
            float s = 0.0f, dp = 0.0f;
            for (int c = 0; c < D; c++) { s += kme[c] * qs[i * D + c]; dp += vme[c] * gs[i * D + c]; }
            const float p = expf(s * scale - ls[i]);
            const float dsv = p * (dp - dd[i]);
            for (int c = 0; c < D; c++) { dvme[c] += p * gs[i * D + c]; dkme[c] += dsv * qs[i * D + c]; }
        }
    }
    __syncthreads();
    for (int i = t; i < R * D; i += R) {   // coalesced write-out of the block's rows
        const int r = i / D, c = i % D;
        if (k0 + r < n) {
            dk[(size_t)(k0 + r) * D + c] = dkr[r * SR + c] * scale;
            dv[(size_t)(k0 + r) * D + c] = dvr[r * SR + c];
        }
    }
}

// dQ: thread owns query row `row`; q, dO rows and the dq accumulator are in shared memory.
template <int D, bool CAUSAL>
__global__ void __launch_bounds__(TSYS__FLASH_F32_ROWS)
tsys__flash_bwd_dq_f32_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                              const float *__restrict__ dout, const float *__restrict__ lse,
                              const float *__restrict__ dvec, float *__restrict__ dq, int n, float scale) {
    constexpr int R = TSYS__FLASH_F32_ROWS, BK = TSYS__FLASH_F32_TILE, SR = D + 1;
    extern __shared__ float tsys__flash_f32_smem[];
    float *qr = tsys__flash_f32_smem, *gr = qr + R * SR, *dqr = gr + R * SR;
    float *ks = dqr + R * SR, *vs = ks + BK * D;
    const int t = threadIdx.x;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qt * R, row = q0 + t;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; dout += base; dq += base;
    lse += (size_t)blockIdx.y * n; dvec += (size_t)blockIdx.y * n;
    for (int i = t; i < R * D; i += R) {
        const int r = i / D, c = i % D;
        const bool ok = q0 + r < n;
        qr[r * SR + c] = ok ? q[(size_t)(q0 + r) * D + c] : 0.0f;
        gr[r * SR + c] = ok ? dout[(size_t)(q0 + r) * D + c] : 0.0f;
        dqr[r * SR + c] = 0.0f;
    }
    const float lrow = row < n ? lse[row] : 0.0f, drow = row < n ? dvec[row] : 0.0f;
    const float *qme = qr + t * SR, *gme = gr + t * SR;
    float *dqme = dqr + t * SR;
    int nkt = (n + BK - 1) / BK;
    if (CAUSAL) nkt = min(nkt, (q0 + R - 1) / BK + 1);
    for (int j = 0; j < nkt; j++) {
        const int k0 = j * BK;
        __syncthreads();
        for (int i = t; i < BK * D; i += R) {
            const bool ok = k0 + i / D < n;
            ks[i] = ok ? k[(size_t)k0 * D + i] : 0.0f;
            vs[i] = ok ? v[(size_t)k0 * D + i] : 0.0f;
        }
        __syncthreads();
        if (row >= n) continue;
        for (int jj = 0; jj < BK; jj++) {
            const int key = k0 + jj;
            if (key >= n || (CAUSAL && key > row)) continue;
            float s = 0.0f, dp = 0.0f;
            for (int c = 0; c < D; c++) { s += qme[c] * ks[jj * D + c]; dp += gme[c] * vs[jj * D + c]; }
            const float dsv = expf(s * scale - lrow) * (dp - drow);
            for (int c = 0; c < D; c++) dqme[c] += dsv * ks[jj * D + c];
        }
    }
    __syncthreads();
    for (int i = t; i < R * D; i += R) {
        const int r = i / D, c = i % D;
        if (q0 + r < n) dq[(size_t)(q0 + r) * D + c] = dqr[r * SR + c] * scale;
    }
}

// ------------------------------------------------------------------------------------------------
// Hopper path (sm_90a only): the same three kernels with wgmma (warpgroup MMA, 4 warps x 16 rows = one
// m64 block per warpgroup). Compiled only when the translation unit is built for sm_90a
// (-gencode arch=compute_90a,code=sm_90a); otherwise the bodies are empty, the probe below reports
// "not available" and the launchers keep the mma.sync kernels above. Head dims 64 and 128 only.
//
// Shared tiles (R rows x D cols, D % 64 == 0): D/64 column blocks of R x 128 bytes, each 128B-swizzled
// (16-byte chunk c of row r stored at chunk c ^ (r % 8)); every tile starts 1024-byte aligned. One tile
// serves both ways: as a K-major operand (rows = M or N, cols = K: Q, K, V, dO in S = Q K^T etc.) and as
// an MN-major operand (rows = K, cols = N: V in P V, dO in P^T dO, Q in dS^T Q, K in dS K).
// A wgmma accumulator m64nN holds, in warp w of the warpgroup, rows 16w..16w+15 in exactly the mma.sync
// C layout (acc[nb][e] = C[16w + g + 8(e/2)][8nb + 2c + e%2]); rounded and paired it is the register A
// operand of the next wgmma, as in the mma.sync kernels.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void tsys__wgmma_ss64_bf16(float *d, uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void tsys__wgmma_rs64_bf16(float *d, const uint32_t *a, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void tsys__wgmma_ss128_bf16(float *d, uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void tsys__wgmma_rs128_bf16(float *d, const uint32_t *a, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void tsys__wgmma_ss64_f16(float *d, uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void tsys__wgmma_rs64_f16(float *d, const uint32_t *a, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void tsys__wgmma_ss128_f16(float *d, uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void tsys__wgmma_rs128_f16(float *d, const uint32_t *a, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
#endif


template <int R, int D, int NT, typename T>
__device__ __forceinline__ void tsys__wg_load_tile(T *s, const T *g, int r0, int n) {
    constexpr int CPR = D / 8;
#pragma unroll
    for (int c = threadIdx.x; c < R * CPR; c += NT) {
        const int r = c / CPR, cc = c % CPR;
        const bool ok = r0 + r < n;
        unsigned char *dst = (unsigned char *)s + (cc >> 3) * R * 128 + r * 128 + (((cc & 7) ^ (r & 7)) << 4);
        tsys__cp_async16(dst, g + (size_t)(ok ? r0 + r : 0) * D + cc * 8, ok);
    }
}
__device__ __forceinline__ uint64_t tsys__wg_desc(const void *p, uint32_t lbo, uint32_t sbo) {
    const uint64_t a = tsys__smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) |
           (1ull << 62);
}
// K-major operand: rows [r0, r0 + 64) (A) or all N rows (B) of an R-row tile, k-step kk (16 columns).
template <int R> __device__ __forceinline__ uint64_t tsys__wg_desc_k(const void *tile, int r0, int kk) {
    return tsys__wg_desc((const unsigned char *)tile + (kk >> 2) * R * 128 + r0 * 128 + (kk & 3) * 32, 16, 1024);
}
// MN-major operand (B = tile rows 16kk..16kk+15 as K, all D columns as N).
template <int R> __device__ __forceinline__ uint64_t tsys__wg_desc_mn(const void *tile, int kk) {
    return tsys__wg_desc((const unsigned char *)tile + kk * 16 * 128, R * 128, 1024);
}

__device__ __forceinline__ void tsys__wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void tsys__wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void tsys__wg_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// cp.async writes (generic proxy) must be visible to wgmma reads (async proxy): each thread, after its
// cp.async.wait and before the barrier.
__device__ __forceinline__ void tsys__fence_proxy_async() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving reads of accumulators above the wgmma wait.
template <int N> __device__ __forceinline__ void tsys__wg_fence_acc(float (*acc)[4]) {
#pragma unroll
    for (int i = 0; i < N / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(acc[i][e])::"memory");
}

// acc (m64 x N) (+)= A (smem, K-major, rows r0..r0+63 of an RA-row tile) * B^T (smem, K-major, N rows), K = KD.
template <typename T, int N, int RA, int KD>
__device__ __forceinline__ void tsys__wg_ss(float (*acc)[4], const T *a, int r0, const T *b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
    for (int kk = 0; kk < KD / 16; kk++) {
        const uint64_t da = tsys__wg_desc_k<RA>(a, r0, kk), db = tsys__wg_desc_k<N>(b, 0, kk);
        if constexpr (N == 64) {
            if constexpr (std::is_same<T, __nv_bfloat16>::value) tsys__wgmma_ss64_bf16(&acc[0][0], da, db, kk > 0);
            else tsys__wgmma_ss64_f16(&acc[0][0], da, db, kk > 0);
        } else {
            if constexpr (std::is_same<T, __nv_bfloat16>::value) tsys__wgmma_ss128_bf16(&acc[0][0], da, db, kk > 0);
            else tsys__wgmma_ss128_f16(&acc[0][0], da, db, kk > 0);
        }
    }
#endif
}
// acc (m64 x N) += P (registers: fp32 accumulators of a previous wgmma, m64 x KD, rounded here) * B
// (smem tile of RB = KD rows, MN-major, N = D columns).
template <typename T, int N, int KD>
__device__ __forceinline__ void tsys__wg_rs(float (*acc)[4], float (*p)[4], const T *b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
    for (int kk = 0; kk < KD / 16; kk++) {
        uint32_t a[4];
        a[0] = tsys__flash_t<T>::pack(p[2 * kk][0], p[2 * kk][1]);
        a[1] = tsys__flash_t<T>::pack(p[2 * kk][2], p[2 * kk][3]);
        a[2] = tsys__flash_t<T>::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = tsys__flash_t<T>::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        const uint64_t db = tsys__wg_desc_mn<KD>(b, kk);
        if constexpr (N == 64) {
            if constexpr (std::is_same<T, __nv_bfloat16>::value) tsys__wgmma_rs64_bf16(&acc[0][0], a, db);
            else tsys__wgmma_rs64_f16(&acc[0][0], a, db);
        } else {
            if constexpr (std::is_same<T, __nv_bfloat16>::value) tsys__wgmma_rs128_bf16(&acc[0][0], a, db);
            else tsys__wgmma_rs128_f16(&acc[0][0], a, db);
        }
    }
#endif
}

// Dynamic shared memory rounded up to 1024 bytes (the 128B swizzle repeats every 1024 bytes of address).
__device__ __forceinline__ unsigned char *tsys__wg_smem_base(unsigned char *raw) {
    const uint32_t a = tsys__smem_addr(raw);
    return raw + ((1024 - (a & 1023)) & 1023);
}

// Forward: WG warpgroups x 64 query rows = BQ; key/value tiles of BK rows, double-buffered.
template <typename T, int D, int BK, int WG, int MINB, bool CAUSAL>
__global__ void __launch_bounds__(WG * 128, MINB)
tsys__flash_fwd_wg_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ o,
                          float *__restrict__ lse, int n, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BQ = WG * 64, NT = WG * 128;
    extern __shared__ __align__(16) unsigned char tsys__flash_smem_raw[];
    T *qs = (T *)tsys__wg_smem_base(tsys__flash_smem_raw);
    T *ks = qs + BQ * D;        // [2][BK * D]
    T *vs = ks + 2 * BK * D;    // [2][BK * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qt * BQ, wr0 = warp * 16;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; o += base; lse += (size_t)blockIdx.y * n;

    int nkt = (n + BK - 1) / BK;
    if (CAUSAL) nkt = min(nkt, (q0 + BQ - 1) / BK + 1);

    tsys__wg_load_tile<BQ, D, NT>(qs, q, q0, n);
    tsys__wg_load_tile<BK, D, NT>(ks, k, 0, n);
    tsys__wg_load_tile<BK, D, NT>(vs, v, 0, n);
    tsys__cp_async_commit();

    float oacc[1][D / 8][4];
    tsys__flash_zero<1, D>(oacc);
    float m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.0f, 0.0f };

    for (int j = 0; j < nkt; j++) {
        if (j + 1 < nkt) {
            tsys__wg_load_tile<BK, D, NT>(ks + ((j + 1) & 1) * BK * D, k, (j + 1) * BK, n);
            tsys__wg_load_tile<BK, D, NT>(vs + ((j + 1) & 1) * BK * D, v, (j + 1) * BK, n);
            tsys__cp_async_commit();
            tsys__cp_async_wait<1>();
        } else {
            tsys__cp_async_wait<0>();
        }
        tsys__fence_proxy_async();
        __syncthreads();
        const int k0 = j * BK;
        {   // no per-warpgroup causal skip: a data-dependent branch around wgmma makes ptxas serialize them
            const T *kt = ks + (j & 1) * BK * D, *vt = vs + (j & 1) * BK * D;
            float s[1][BK / 8][4];
            tsys__wg_fence();
            tsys__wg_ss<T, BK, BQ, D>(s[0], qs, wg * 64, kt);
            tsys__wg_commit();
            tsys__wg_wait<0>();
            tsys__wg_fence_acc<BK>(s[0]);
            const bool need_mask = k0 + BK > n || (CAUSAL && k0 + BK - 1 > q0 + wr0);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = q0 + wr0 + (lane >> 2) + h * 8;
                float mx = m[h];
#pragma unroll
                for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float x = s[0][nb][2 * h + e] * scale_log2;
                        if (need_mask) {
                            const int col = k0 + nb * 8 + (lane & 3) * 2 + e;
                            if (col >= n || (CAUSAL && col > row)) x = -INFINITY;
                        }
                        s[0][nb][2 * h + e] = x;
                        mx = fmaxf(mx, x);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mref = mx == -INFINITY ? 0.0f : mx;
                const float alpha = tsys__ex2(m[h] - mref);
                float sum = 0.0f;
#pragma unroll
                for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float p = tsys__ex2(s[0][nb][2 * h + e] - mref);
                        s[0][nb][2 * h + e] = p;
                        sum += p;
                    }
                l[h] = l[h] * alpha + sum;
                m[h] = mx;
#pragma unroll
                for (int nb = 0; nb < D / 8; nb++) oacc[0][nb][2 * h] *= alpha, oacc[0][nb][2 * h + 1] *= alpha;
            }
            tsys__wg_fence();
            tsys__wg_rs<T, D, BK>(oacc[0], s[0], vt);
            tsys__wg_commit();
            tsys__wg_wait<0>();
            tsys__wg_fence_acc<D>(oacc[0]);
        }
        __syncthreads();
    }
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv[h] = 1.0f / sum;
        const int row = q0 + wr0 + (lane >> 2) + h * 8;
        if ((lane & 3) == 0 && row < n) lse[row] = (m[h] + log2f(sum)) * TSYS__FLASH_LN2;
    }
#pragma unroll
    for (int nb = 0; nb < D / 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) oacc[0][nb][e] *= inv[e >> 1];
    tsys__flash_store<T, 1, D>(o, oacc, q0 + wr0, n, 1.0f, lane);
#endif
}

// dK, dV: WG warpgroups x 64 keys = BKV; query tiles of BQ rows (Q, dO, lse, D) double-buffered.
template <typename T, int D, int BQ, int WG, int MINB, bool CAUSAL>
__global__ void __launch_bounds__(WG * 128, MINB)
tsys__flash_bwd_dkdv_wg_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                               const T *__restrict__ dout, const float *__restrict__ lse,
                               const float *__restrict__ dvec, T *__restrict__ dk, T *__restrict__ dv, int n,
                               float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BKV = WG * 64, NT = WG * 128;
    extern __shared__ __align__(16) unsigned char tsys__flash_smem_raw[];
    T *ks = (T *)tsys__wg_smem_base(tsys__flash_smem_raw);
    T *vs = ks + BKV * D;
    T *qs = vs + BKV * D;       // [2][BQ * D]
    T *gs = qs + 2 * BQ * D;    // [2][BQ * D]
    float *ls = (float *)(gs + 2 * BQ * D);   // [2][BQ]
    float *ds = ls + 2 * BQ;                  // [2][BQ]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int k0 = blockIdx.x * BKV, wk0 = warp * 16;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; dout += base; dk += base; dv += base;
    lse += (size_t)blockIdx.y * n; dvec += (size_t)blockIdx.y * n;
    const int it0 = CAUSAL ? k0 / BQ : 0, nqt = (n + BQ - 1) / BQ;

    tsys__wg_load_tile<BKV, D, NT>(ks, k, k0, n);
    tsys__wg_load_tile<BKV, D, NT>(vs, v, k0, n);
    auto load_q = [&](int it, int buf) {
        const int q0 = it * BQ;
        tsys__wg_load_tile<BQ, D, NT>(qs + buf * BQ * D, q, q0, n);
        tsys__wg_load_tile<BQ, D, NT>(gs + buf * BQ * D, dout, q0, n);
        for (int i = threadIdx.x; i < BQ; i += NT) {
            const bool ok = q0 + i < n;
            ls[buf * BQ + i] = ok ? lse[q0 + i] * TSYS__FLASH_LOG2E : 0.0f;
            ds[buf * BQ + i] = ok ? dvec[q0 + i] : 0.0f;
        }
    };
    load_q(it0, 0);
    tsys__cp_async_commit();

    float dka[1][D / 8][4], dva[1][D / 8][4];
    tsys__flash_zero<1, D>(dka);
    tsys__flash_zero<1, D>(dva);

    for (int it = it0; it < nqt; it++) {
        const int buf = (it - it0) & 1;
        if (it + 1 < nqt) {
            load_q(it + 1, buf ^ 1);
            tsys__cp_async_commit();
            tsys__cp_async_wait<1>();
        } else {
            tsys__cp_async_wait<0>();
        }
        tsys__fence_proxy_async();
        __syncthreads();
        const int q0 = it * BQ;
        {   // no per-warpgroup causal skip: a data-dependent branch around wgmma makes ptxas serialize them
            const T *qt = qs + buf * BQ * D, *gt = gs + buf * BQ * D;
            const float *lt = ls + buf * BQ, *dt = ds + buf * BQ;
            float st[1][BQ / 8][4], dpt[1][BQ / 8][4];
            tsys__wg_fence();
            tsys__wg_ss<T, BQ, BKV, D>(st[0], ks, wg * 64, qt);    // S^T = K Q^T
            tsys__wg_commit();
            tsys__wg_ss<T, BQ, BKV, D>(dpt[0], vs, wg * 64, gt);   // dP^T = V dO^T
            tsys__wg_commit();
            tsys__wg_wait<1>();
            tsys__wg_fence_acc<BQ>(st[0]);
            const bool need_mask = q0 + BQ > n || (CAUSAL && k0 + wk0 + 15 > q0);
#pragma unroll
            for (int nb = 0; nb < BQ / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                    float p = tsys__ex2(st[0][nb][e] * scale_log2 - lt[qi]);
                    if (need_mask) {
                        const int key = k0 + wk0 + (lane >> 2) + (e >> 1) * 8, query = q0 + qi;
                        if (query >= n || (CAUSAL && key > query)) p = 0.0f;
                    }
                    st[0][nb][e] = p;
                }
            tsys__wg_fence();
            tsys__wg_rs<T, D, BQ>(dva[0], st[0], gt);              // dV += P^T dO
            tsys__wg_commit();
            tsys__wg_wait<1>();
            tsys__wg_fence_acc<BQ>(dpt[0]);
#pragma unroll
            for (int nb = 0; nb < BQ / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                    dpt[0][nb][e] = st[0][nb][e] * (dpt[0][nb][e] - dt[qi]);   // dS^T
                }
            tsys__wg_fence();
            tsys__wg_rs<T, D, BQ>(dka[0], dpt[0], qt);             // dK += dS^T Q
            tsys__wg_commit();
            tsys__wg_wait<0>();
            tsys__wg_fence_acc<D>(dka[0]);
            tsys__wg_fence_acc<D>(dva[0]);
        }
        __syncthreads();
    }
    tsys__flash_store<T, 1, D>(dk, dka, k0 + wk0, n, scale, lane);
    tsys__flash_store<T, 1, D>(dv, dva, k0 + wk0, n, 1.0f, lane);
#endif
}

// dQ: WG warpgroups x 64 query rows = BQ; key/value tiles of BK rows, double-buffered.
template <typename T, int D, int BK, int WG, int MINB, bool CAUSAL>
__global__ void __launch_bounds__(WG * 128, MINB)
tsys__flash_bwd_dq_wg_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                             const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ dvec,
                             T *__restrict__ dq, int n, float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BQ = WG * 64, NT = WG * 128;
    extern __shared__ __align__(16) unsigned char tsys__flash_smem_raw[];
    T *qs = (T *)tsys__wg_smem_base(tsys__flash_smem_raw);
    T *gs = qs + BQ * D;
    T *ks = gs + BQ * D;        // [2][BK * D]
    T *vs = ks + 2 * BK * D;    // [2][BK * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qt * BQ, wr0 = warp * 16;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; dout += base; dq += base;
    lse += (size_t)blockIdx.y * n; dvec += (size_t)blockIdx.y * n;

    int nkt = (n + BK - 1) / BK;
    if (CAUSAL) nkt = min(nkt, (q0 + BQ - 1) / BK + 1);

    tsys__wg_load_tile<BQ, D, NT>(qs, q, q0, n);
    tsys__wg_load_tile<BQ, D, NT>(gs, dout, q0, n);
    tsys__wg_load_tile<BK, D, NT>(ks, k, 0, n);
    tsys__wg_load_tile<BK, D, NT>(vs, v, 0, n);
    tsys__cp_async_commit();

    float lrow[2], drow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = q0 + wr0 + (lane >> 2) + h * 8;
        lrow[h] = row < n ? lse[row] * TSYS__FLASH_LOG2E : 0.0f;
        drow[h] = row < n ? dvec[row] : 0.0f;
    }
    float dqa[1][D / 8][4];
    tsys__flash_zero<1, D>(dqa);

    for (int j = 0; j < nkt; j++) {
        if (j + 1 < nkt) {
            tsys__wg_load_tile<BK, D, NT>(ks + ((j + 1) & 1) * BK * D, k, (j + 1) * BK, n);
            tsys__wg_load_tile<BK, D, NT>(vs + ((j + 1) & 1) * BK * D, v, (j + 1) * BK, n);
            tsys__cp_async_commit();
            tsys__cp_async_wait<1>();
        } else {
            tsys__cp_async_wait<0>();
        }
        tsys__fence_proxy_async();
        __syncthreads();
        const int k0 = j * BK;
        {   // no per-warpgroup causal skip: a data-dependent branch around wgmma makes ptxas serialize them
            const T *kt = ks + (j & 1) * BK * D, *vt = vs + (j & 1) * BK * D;
            float s[1][BK / 8][4], dp[1][BK / 8][4];
            tsys__wg_fence();
            tsys__wg_ss<T, BK, BQ, D>(s[0], qs, wg * 64, kt);    // S = Q K^T
            tsys__wg_commit();
            tsys__wg_ss<T, BK, BQ, D>(dp[0], gs, wg * 64, vt);   // dP = dO V^T
            tsys__wg_commit();
            tsys__wg_wait<1>();
            tsys__wg_fence_acc<BK>(s[0]);
            const bool need_mask = k0 + BK > n || (CAUSAL && k0 + BK - 1 > q0 + wr0);
#pragma unroll
            for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = e >> 1;
                    float p = tsys__ex2(s[0][nb][e] * scale_log2 - lrow[h]);
                    if (need_mask) {
                        const int key = k0 + nb * 8 + (lane & 3) * 2 + (e & 1);
                        const int row = q0 + wr0 + (lane >> 2) + h * 8;
                        if (key >= n || (CAUSAL && key > row)) p = 0.0f;
                    }
                    s[0][nb][e] = p;
                }
            tsys__wg_wait<0>();
            tsys__wg_fence_acc<BK>(dp[0]);
#pragma unroll
            for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[0][nb][e] *= dp[0][nb][e] - drow[e >> 1];   // dS
            tsys__wg_fence();
            tsys__wg_rs<T, D, BK>(dqa[0], s[0], kt);             // dQ += dS K
            tsys__wg_commit();
            tsys__wg_wait<0>();
            tsys__wg_fence_acc<D>(dqa[0]);
        }
        __syncthreads();
    }
    tsys__flash_store<T, 1, D>(dq, dqa, q0 + wr0, n, scale, lane);
#endif
}

// Whether the wgmma kernels were compiled into the binary the device runs: the probe has static shared
// memory only in its sm_90a body. TSYS_FLASH_NO_WGMMA=1 in the environment forces the mma.sync kernels.
__global__ void tsys__flash_wg_probe_kernel(int *p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ volatile int marker[64];
    marker[threadIdx.x & 63] = (int)threadIdx.x;
    if (p) *p = marker[0];
#endif
}
static bool tsys__flash_wg_available() {
    static int avail = -1;
    if (avail < 0) {
        cudaFuncAttributes a;
        const char *env = getenv("TSYS_FLASH_NO_WGMMA");
        avail = (!env || !*env || *env == '0') && cudaFuncGetAttributes(&a, tsys__flash_wg_probe_kernel) == cudaSuccess &&
                a.sharedSizeBytes >= 256;
        cudaGetLastError();
    }
    return avail == 1;
}

// Hopper tile configurations (template parameters of the wg kernels): warpgroups per block, the streamed
// tile, and the min-blocks-per-SM launch bound (which caps registers).
// Picked per part from the variants timed on an H100 (docs/perf-notes-flash.md, v4).
template <int D, bool CAUSAL> struct tsys__flash_wg_cfg {
    static constexpr int FWD_BK = D <= 64 ? 128 : 64, FWD_WG = 2, FWD_MINB = 2;
    static constexpr int DKDV_BQ = D <= 64 ? 128 : 64, DKDV_WG = D <= 64 ? 2 : 1, DKDV_MINB = D <= 64 ? 1 : 2;
    static constexpr int DQ_BK = 128, DQ_WG = 2, DQ_MINB = 1;
};

// ------------------------------------------------------------------------------------------------
// Launchers. Grids put the tile index in x and bh in y; bh above 65535 is launched in slices.

// Tile configurations, picked from the variants timed on an H100 (docs/perf-notes-flash.md, run 2).
// Registers bound the choices: a warp holds MT*16 x D accumulators (O, dK+dV, dQ) plus MT*16 x B score
// tiles (S, and dP in the backward); past ~255 registers the compiler spills.
//   FWD:  MT m-tiles (16 query rows each) per warp, BK keys per tile, NW warps
//   DKDV: MK m-tiles (16 keys each) per warp, BQ queries per tile, NW warps
//   DQ:   MQ m-tiles (16 query rows each) per warp, BK keys per tile, NW warps
// (The non-causal dK/dV kernel keeps MK = 1: with MK = 2 its mask-free loop spills at d = 64.)
template <int D, bool CAUSAL> struct tsys__flash_cfg {
    static constexpr int FWD_MT = 2, FWD_BK = D <= 64 ? 64 : 32, FWD_NW = 4;
    static constexpr int DKDV_MK = D <= 64 && CAUSAL ? 2 : 1, DKDV_BQ = 64, DKDV_NW = D <= 64 && CAUSAL ? 4 : 8;
    static constexpr int DQ_MQ = 1, DQ_BK = D <= 64 ? 128 : 64, DQ_NW = D <= 64 ? 8 : 4;
};

template <typename K>
static cudaError_t tsys__flash_smem_attr(K kernel, size_t smem) {
    if (smem <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
}

template <typename T, int D, bool CAUSAL, typename C = tsys__flash_cfg<D, CAUSAL>>
static cudaError_t tsys__flash_fwd_tc(const T *q, const T *k, const T *v, T *o, float *lse, int64_t bh, int n,
                                      float scale, cudaStream_t s) {
    constexpr int BQ = C::FWD_NW * C::FWD_MT * 16;
    const size_t smem = (size_t)(BQ + 4 * C::FWD_BK) * (D + 8) * sizeof(T);
    auto kern = tsys__flash_fwd_kernel<T, D, C::FWD_MT, C::FWD_BK, C::FWD_NW, CAUSAL>;
    cudaError_t err = tsys__flash_smem_attr(kern, smem);
    if (err != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D;
        dim3 grid((n + BQ - 1) / BQ, (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535));
        kern<<<grid, C::FWD_NW * 32, smem, s>>>(q + off, k + off, v + off, o + off, lse + (size_t)b0 * n, n,
                                                scale * TSYS__FLASH_LOG2E);
    }
    return cudaGetLastError();
}

template <typename T, int D, bool CAUSAL, typename C = tsys__flash_cfg<D, CAUSAL>>
static cudaError_t tsys__flash_bwd_tc(const T *dout, const T *q, const T *k, const T *v, const T *o, const float *lse,
                                      T *dq, T *dk, T *dv, float *dvec, int64_t bh, int n, float scale, cudaStream_t s,
                                      int parts = 7 /* 1: D, 2: dK dV, 4: dQ (the lab times them apart) */) {
    const int64_t rows = bh * n;
    if (parts & 1) tsys__flash_bwd_dot_kernel<T><<<(unsigned)((rows + 7) / 8), 256, 0, s>>>(dout, o, dvec, rows, D);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    constexpr int BKV = C::DKDV_NW * C::DKDV_MK * 16, BQ = C::DQ_NW * C::DQ_MQ * 16;
    const size_t smem_kv = (size_t)(2 * BKV + 4 * C::DKDV_BQ) * (D + 8) * sizeof(T) + 4 * C::DKDV_BQ * sizeof(float);
    const size_t smem_q = (size_t)(2 * BQ + 4 * C::DQ_BK) * (D + 8) * sizeof(T);
    auto kkv = tsys__flash_bwd_dkdv_kernel<T, D, C::DKDV_MK, C::DKDV_BQ, C::DKDV_NW, CAUSAL>;
    auto kq = tsys__flash_bwd_dq_kernel<T, D, C::DQ_MQ, C::DQ_BK, C::DQ_NW, CAUSAL>;
    if ((err = tsys__flash_smem_attr(kkv, smem_kv)) != cudaSuccess) return err;
    if ((err = tsys__flash_smem_attr(kq, smem_q)) != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D, loff = (size_t)b0 * n;
        const unsigned nb = (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535);
        if (parts & 2) kkv<<<dim3((n + BKV - 1) / BKV, nb), C::DKDV_NW * 32, smem_kv, s>>>(
            q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dk + off, dv + off, n, scale,
            scale * TSYS__FLASH_LOG2E);
        if (parts & 4) kq<<<dim3((n + BQ - 1) / BQ, nb), C::DQ_NW * 32, smem_q, s>>>(
            q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dq + off, n, scale,
            scale * TSYS__FLASH_LOG2E);
    }
    return cudaGetLastError();
}

template <int D, bool CAUSAL>
static cudaError_t tsys__flash_fwd_f32(const float *q, const float *k, const float *v, float *o, float *lse, int64_t bh,
                                       int n, float scale, cudaStream_t s) {
    constexpr int R = TSYS__FLASH_F32_ROWS, B = TSYS__FLASH_F32_FWD_BK(D);
    const size_t smem = sizeof(float) * (R * (D + 1) + 2 * B * D);
    cudaError_t err = tsys__flash_smem_attr(tsys__flash_fwd_f32_kernel<D, CAUSAL>, smem);
    if (err != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D;
        dim3 grid((n + R - 1) / R, (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535));
        tsys__flash_fwd_f32_kernel<D, CAUSAL><<<grid, R, smem, s>>>(q + off, k + off, v + off, o + off,
                                                                 lse + (size_t)b0 * n, n, scale);
    }
    return cudaGetLastError();
}

template <int D, bool CAUSAL>
static cudaError_t tsys__flash_bwd_f32(const float *dout, const float *q, const float *k, const float *v, const float *o,
                                       const float *lse, float *dq, float *dk, float *dv, float *dvec, int64_t bh, int n,
                                       float scale, cudaStream_t s) {
    constexpr int R = TSYS__FLASH_F32_ROWS, B = TSYS__FLASH_F32_TILE, SR = D + 1;
    const int64_t rows = bh * n;
    tsys__flash_bwd_dot_kernel<float><<<(unsigned)((rows + 7) / 8), 256, 0, s>>>(dout, o, dvec, rows, D);
    const size_t smem_kv = sizeof(float) * (4 * R * SR + 2 * B * D + 2 * B);
    const size_t smem_q = sizeof(float) * (3 * R * SR + 2 * B * D);
    auto kkv = tsys__flash_bwd_dkdv_f32_kernel<D, CAUSAL>;
    auto kq = tsys__flash_bwd_dq_f32_kernel<D, CAUSAL>;
    cudaError_t err;
    if ((err = tsys__flash_smem_attr(kkv, smem_kv)) != cudaSuccess) return err;
    if ((err = tsys__flash_smem_attr(kq, smem_q)) != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D, loff = (size_t)b0 * n;
        dim3 grid((n + R - 1) / R, (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535));
        kkv<<<grid, R, smem_kv, s>>>(q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dk + off,
                                     dv + off, n, scale);
        kq<<<grid, R, smem_q, s>>>(q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dq + off, n,
                                   scale);
    }
    return cudaGetLastError();
}

// ---- Hopper (wgmma) launchers; used by the entry points when tsys__flash_wg_available() and d is 64 or 128.
template <typename T, int D, bool CAUSAL, typename W = tsys__flash_wg_cfg<D, CAUSAL>>
static cudaError_t tsys__flash_fwd_wg(const T *q, const T *k, const T *v, T *o, float *lse, int64_t bh, int n,
                                      float scale, cudaStream_t s) {
    constexpr int BQ = W::FWD_WG * 64;
    const size_t smem = (size_t)(BQ + 4 * W::FWD_BK) * D * sizeof(T) + 1024;
    auto kern = tsys__flash_fwd_wg_kernel<T, D, W::FWD_BK, W::FWD_WG, W::FWD_MINB, CAUSAL>;
    cudaError_t err = tsys__flash_smem_attr(kern, smem);
    if (err != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D;
        dim3 grid((n + BQ - 1) / BQ, (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535));
        kern<<<grid, W::FWD_WG * 128, smem, s>>>(q + off, k + off, v + off, o + off, lse + (size_t)b0 * n, n,
                                                 scale * TSYS__FLASH_LOG2E);
    }
    return cudaGetLastError();
}

template <typename T, int D, bool CAUSAL, typename W = tsys__flash_wg_cfg<D, CAUSAL>>
static cudaError_t tsys__flash_bwd_wg(const T *dout, const T *q, const T *k, const T *v, const T *o, const float *lse,
                                      T *dq, T *dk, T *dv, float *dvec, int64_t bh, int n, float scale, cudaStream_t s,
                                      int parts = 7) {
    const int64_t rows = bh * n;
    if (parts & 1) tsys__flash_bwd_dot_kernel<T><<<(unsigned)((rows + 7) / 8), 256, 0, s>>>(dout, o, dvec, rows, D);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    constexpr int BKV = W::DKDV_WG * 64, BQ = W::DQ_WG * 64;
    const size_t smem_kv = (size_t)(2 * BKV + 4 * W::DKDV_BQ) * D * sizeof(T) + 4 * W::DKDV_BQ * sizeof(float) + 1024;
    const size_t smem_q = (size_t)(2 * BQ + 4 * W::DQ_BK) * D * sizeof(T) + 1024;
    auto kkv = tsys__flash_bwd_dkdv_wg_kernel<T, D, W::DKDV_BQ, W::DKDV_WG, W::DKDV_MINB, CAUSAL>;
    auto kq = tsys__flash_bwd_dq_wg_kernel<T, D, W::DQ_BK, W::DQ_WG, W::DQ_MINB, CAUSAL>;
    if ((err = tsys__flash_smem_attr(kkv, smem_kv)) != cudaSuccess) return err;
    if ((err = tsys__flash_smem_attr(kq, smem_q)) != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D, loff = (size_t)b0 * n;
        const unsigned nb = (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535);
        if (parts & 2) kkv<<<dim3((n + BKV - 1) / BKV, nb), W::DKDV_WG * 128, smem_kv, s>>>(
            q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dk + off, dv + off, n, scale,
            scale * TSYS__FLASH_LOG2E);
        if (parts & 4) kq<<<dim3((n + BQ - 1) / BQ, nb), W::DQ_WG * 128, smem_q, s>>>(
            q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dq + off, n, scale,
            scale * TSYS__FLASH_LOG2E);
    }
    return cudaGetLastError();
}

// The tensor-core entry points: wgmma where it was compiled in and d allows, mma.sync otherwise.
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys__flash_fwd_pick(const T *q, const T *k, const T *v, T *o, float *lse, int64_t bh, int n,
                                        float scale, cudaStream_t s) {
    if constexpr (D == 64 || D == 128)
        if (tsys__flash_wg_available()) return tsys__flash_fwd_wg<T, D, CAUSAL>(q, k, v, o, lse, bh, n, scale, s);
    return tsys__flash_fwd_tc<T, D, CAUSAL>(q, k, v, o, lse, bh, n, scale, s);
}
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys__flash_bwd_pick(const T *dout, const T *q, const T *k, const T *v, const T *o, const float *lse,
                                        T *dq, T *dk, T *dv, float *dvec, int64_t bh, int n, float scale, cudaStream_t s) {
    if constexpr (D == 64 || D == 128)
        if (tsys__flash_wg_available())
            return tsys__flash_bwd_wg<T, D, CAUSAL>(dout, q, k, v, o, lse, dq, dk, dv, dvec, bh, n, scale, s);
    return tsys__flash_bwd_tc<T, D, CAUSAL>(dout, q, k, v, o, lse, dq, dk, dv, dvec, bh, n, scale, s);
}

// dtype: 0 fp32, 1 bf16, 2 fp16 (tsys's TSYS_F32 / TSYS_BF16 / TSYS_F16 order).
static bool tsys_cuda__flash_supported(int dtype, int64_t d) {
    return dtype >= 0 && dtype <= 2 && (d == 16 || d == 32 || d == 64 || d == 80 || d == 128);
}

// Bytes of fp32 scratch the backward needs: D = rowsum(dO o O), one float per (bh, row).
static size_t tsys_cuda__flash_bwd_scratch_bytes(int64_t bh, int64_t n) { return sizeof(float) * (size_t)(bh * n); }

#define TSYS__FLASH_DISPATCH_D(d, CALL) \
    switch (d) { \
    case 16: { constexpr int D_ = 16; CALL; } break; \
    case 32: { constexpr int D_ = 32; CALL; } break; \
    case 64: { constexpr int D_ = 64; CALL; } break; \
    case 80: { constexpr int D_ = 80; CALL; } break; \
    case 128: { constexpr int D_ = 128; CALL; } break; \
    default: return cudaErrorInvalidValue; \
    }

// O = softmax(scale * Q K^T [causal]) V and lse, for (bh, n, d) inputs of one dtype. lse is fp32 (bh, n).
static cudaError_t tsys_cuda__flash_fwd(const void *q, const void *k, const void *v, void *o, float *lse, int dtype,
                                        int64_t bh, int64_t n, int64_t d, float scale, bool causal, cudaStream_t s) {
    if (!tsys_cuda__flash_supported(dtype, d) || n < 1 || n > INT32_MAX / 2 || bh < 1) return cudaErrorInvalidValue;
    const int ni = (int)n;
#define TSYS__FLASH_FWD_CALL(T, D_, C_) \
    return tsys__flash_fwd_pick<T, D_, C_>((const T *)q, (const T *)k, (const T *)v, (T *)o, lse, bh, ni, scale, s)
#define TSYS__FLASH_FWD_ONE \
    if (dtype == 0) { if (causal) return tsys__flash_fwd_f32<D_, true>((const float *)q, (const float *)k, (const float *)v, (float *)o, lse, bh, ni, scale, s); \
                      else return tsys__flash_fwd_f32<D_, false>((const float *)q, (const float *)k, (const float *)v, (float *)o, lse, bh, ni, scale, s); } \
    if (dtype == 1) { if (causal) TSYS__FLASH_FWD_CALL(__nv_bfloat16, D_, true); else TSYS__FLASH_FWD_CALL(__nv_bfloat16, D_, false); } \
    if (causal) TSYS__FLASH_FWD_CALL(__half, D_, true); else TSYS__FLASH_FWD_CALL(__half, D_, false)
    TSYS__FLASH_DISPATCH_D(d, TSYS__FLASH_FWD_ONE)
#undef TSYS__FLASH_FWD_ONE
#undef TSYS__FLASH_FWD_CALL
    return cudaErrorInvalidValue;
}

// dQ, dK, dV (input dtype) from dO, Q, K, V, O and lse of the forward. scratch: fp32, at least
// tsys_cuda__flash_bwd_scratch_bytes(bh, n) bytes (holds D = rowsum(dO o O)).
static cudaError_t tsys_cuda__flash_bwd(const void *dout, const void *q, const void *k, const void *v, const void *o,
                                        const float *lse, void *dq, void *dk, void *dv, float *scratch, int dtype,
                                        int64_t bh, int64_t n, int64_t d, float scale, bool causal, cudaStream_t s) {
    if (!tsys_cuda__flash_supported(dtype, d) || n < 1 || n > INT32_MAX / 2 || bh < 1) return cudaErrorInvalidValue;
    const int ni = (int)n;
#define TSYS__FLASH_BWD_CALL(F, T, D_, C_) \
    return F<T, D_, C_>((const T *)dout, (const T *)q, (const T *)k, (const T *)v, (const T *)o, lse, (T *)dq, (T *)dk, \
                        (T *)dv, scratch, bh, ni, scale, s)
#define TSYS__FLASH_BWD_ONE \
    if (dtype == 0) { if (causal) return tsys__flash_bwd_f32<D_, true>((const float *)dout, (const float *)q, (const float *)k, (const float *)v, (const float *)o, lse, (float *)dq, (float *)dk, (float *)dv, scratch, bh, ni, scale, s); \
                      else return tsys__flash_bwd_f32<D_, false>((const float *)dout, (const float *)q, (const float *)k, (const float *)v, (const float *)o, lse, (float *)dq, (float *)dk, (float *)dv, scratch, bh, ni, scale, s); } \
    if (dtype == 1) { if (causal) TSYS__FLASH_BWD_CALL(tsys__flash_bwd_pick, __nv_bfloat16, D_, true); else TSYS__FLASH_BWD_CALL(tsys__flash_bwd_pick, __nv_bfloat16, D_, false); } \
    if (causal) TSYS__FLASH_BWD_CALL(tsys__flash_bwd_pick, __half, D_, true); else TSYS__FLASH_BWD_CALL(tsys__flash_bwd_pick, __half, D_, false)
    TSYS__FLASH_DISPATCH_D(d, TSYS__FLASH_BWD_ONE)
#undef TSYS__FLASH_BWD_ONE
#undef TSYS__FLASH_BWD_CALL
    return cudaErrorInvalidValue;
}
