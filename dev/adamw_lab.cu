// adamw_lab.cu - how fast can an AdamW-shaped pass stream through HBM? A lab tool, not part of the library.
// One pass reads p, m, v (fp32) and g (bf16) and writes p, m, v and p's bf16 copy: 28 bytes an element, what
// tsys's AdamW moves with bf16 weight gradients and kept copies. The variants differ only in how each thread
// walks the arrays (groups of 4 elements a thread-iteration, as tsys's kernel, or two groups at once; a capped
// grid-stride loop or one group a thread; plain or streaming loads and stores); the update is AdamW's, with
// the kernel's spelled-out roundings and each thread's bias corrections (two pows in double, which a
// grid-stride loop spreads over its groups), so the instruction mix is the real one.
//
//   nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a dev/adamw_lab.cu -o build/adamw_lab
//   build/adamw_lab [elements]        (default 105 M: one 2.7B layer's parameters)
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

struct arrays { float *p, *m, *v; const __nv_bfloat16 *g; __nv_bfloat16 *low; long n; const long *t; };

// The step's shared scalars, as tsys's kernel computes them once a thread (1 - beta^t in double).
struct scalars { float decay, sqrt_bc2, step; };
__device__ __forceinline__ scalars prep(const long *t_dev) {
    double t = (double)*t_dev;
    float bc1 = (float)(1.0 - pow(0.9, t)), bc2 = (float)(1.0 - pow(0.999, t));
    return { __fsub_rn(1.0f, __fmul_rn(1e-3f, 0.01f)), __fsqrt_rn(bc2), __fdiv_rn(1e-3f, bc1) };
}
__device__ __forceinline__ void update(const scalars &k, float &p, float g, float &m, float &v) {
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, decay = k.decay, sqrt_bc2 = k.sqrt_bc2, step = k.step;
    p = __fmul_rn(p, decay);
    m = __fmaf_rn(b1, m, __fmul_rn(1.0f - b1, g));
    v = __fmaf_rn(b2, v, __fmul_rn(__fmul_rn(1.0f - b2, g), g));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), sqrt_bc2), eps);
    p = __fsub_rn(p, __fmul_rn(step, __fdiv_rn(m, denom)));
}

template <bool STREAM> __device__ __forceinline__ float4 ld4(const float *a, long q) {
    return STREAM ? __ldcs((const float4 *)a + q) : ((const float4 *)a)[q];
}
template <bool STREAM> __device__ __forceinline__ void st4(float *a, long q, float4 x) {
    if (STREAM) __stcs((float4 *)a + q, x); else ((float4 *)a)[q] = x;
}
template <bool STREAM> __device__ __forceinline__ uint2 ld2(const __nv_bfloat16 *a, long q) {
    return STREAM ? __ldcs((const uint2 *)a + q) : ((const uint2 *)a)[q];
}
template <bool STREAM> __device__ __forceinline__ void st2(__nv_bfloat16 *a, long q, uint2 x) {
    if (STREAM) __stcs((uint2 *)a + q, x); else ((uint2 *)a)[q] = x;
}

// U groups of 4 a thread-iteration, all loads first. BLOCK_PREP: the scalars once a block (thread 0, through
// shared memory) instead of once a thread.
template <int U, bool STREAM, bool BLOCK_PREP = false>
__global__ void pass(arrays a) {
    const long groups = a.n / 4, stride = (long)gridDim.x * blockDim.x * U;
    __shared__ scalars kb;
    if (BLOCK_PREP && threadIdx.x == 0) kb = prep(a.t);
    if (BLOCK_PREP) __syncthreads();
    const scalars k = BLOCK_PREP ? kb : prep(a.t);
    for (long q0 = (long)blockIdx.x * blockDim.x * U + threadIdx.x; q0 < groups; q0 += stride) {
        float4 P[U], M[U], V[U];
        uint2 G[U];
        bool in[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            long q = q0 + (long)u * blockDim.x;
            in[u] = q < groups;
            if (in[u]) { P[u] = ld4<STREAM>(a.p, q); M[u] = ld4<STREAM>(a.m, q); V[u] = ld4<STREAM>(a.v, q); G[u] = ld2<STREAM>(a.g, q); }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (!in[u]) continue;
            long q = q0 + (long)u * blockDim.x;
            float2 g01 = __bfloat1622float2(*(const __nv_bfloat162 *)&G[u].x), g23 = __bfloat1622float2(*(const __nv_bfloat162 *)&G[u].y);
            update(k, P[u].x, g01.x, M[u].x, V[u].x); update(k, P[u].y, g01.y, M[u].y, V[u].y);
            update(k, P[u].z, g23.x, M[u].z, V[u].z); update(k, P[u].w, g23.y, M[u].w, V[u].w);
            st4<STREAM>(a.p, q, P[u]); st4<STREAM>(a.m, q, M[u]); st4<STREAM>(a.v, q, V[u]);
            __nv_bfloat162 l01 = __floats2bfloat162_rn(P[u].x, P[u].y), l23 = __floats2bfloat162_rn(P[u].z, P[u].w);
            st2<STREAM>(a.low, q, make_uint2(*(uint32_t *)&l01, *(uint32_t *)&l23));
        }
    }
}

typedef void (*kernel_t)(arrays);
struct variant { const char *name; kernel_t k; int threads, blocks_per_sm; int unroll; };   // blocks_per_sm 0: one group a thread

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 105 * 1000 * 1000L;
    n -= n % 4096;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    arrays a;
    CK(cudaMalloc(&a.p, n * 4)); CK(cudaMalloc(&a.m, n * 4)); CK(cudaMalloc(&a.v, n * 4));
    CK(cudaMalloc((void **)&a.g, n * 2)); CK(cudaMalloc(&a.low, n * 2));
    CK(cudaMemset(a.p, 0, n * 4)); CK(cudaMemset(a.m, 0, n * 4)); CK(cudaMemset(a.v, 0, n * 4)); CK(cudaMemset((void *)a.g, 0, n * 2));
    a.n = n;
    long one = 7, *t_dev;
    CK(cudaMalloc(&t_dev, sizeof(long))); CK(cudaMemcpy(t_dev, &one, sizeof(long), cudaMemcpyHostToDevice));
    a.t = t_dev;
    const variant vs[] = {
        {"groups of 4, 256 threads, grid 32 a SM (tsys)", pass<1, false>, 256, 32, 1},
        {"the same, streaming loads/stores", pass<1, true>, 256, 32, 1},
        {"two groups an iteration", pass<2, false>, 256, 32, 2},
        {"two groups, streaming", pass<2, true>, 256, 32, 2},
        {"one group a thread (no loop)", pass<1, false>, 256, 0, 1},
        {"one group a thread, streaming", pass<1, true>, 256, 0, 1},
        {"groups of 4, 512 threads, 16 a SM", pass<1, false>, 512, 16, 1},
        {"four groups an iteration, streaming", pass<4, true>, 256, 32, 4},
        {"one group a thread, scalars once a block", pass<1, false, true>, 256, 0, 1},
        {"the same, streaming", pass<1, true, true>, 256, 0, 1},
        {"groups of 4, grid 128 a SM", pass<1, false>, 256, 128, 1},
        {"groups of 4, grid 256 a SM", pass<1, false>, 256, 256, 1},
        {"groups of 4, grid 512 a SM", pass<1, false>, 256, 512, 1},
    };
    const int nv = sizeof vs / sizeof *vs, reps = 20;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    printf("%ld elements, %.1f GB a pass (28 bytes an element), %d SMs\n", n, 28.0 * n / 1e9, sms);
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < nv; i++) {
            long groups = n / 4;
            long need = (groups + (long)vs[i].threads * vs[i].unroll - 1) / ((long)vs[i].threads * vs[i].unroll);
            long cap = vs[i].blocks_per_sm ? (long)sms * vs[i].blocks_per_sm : need;
            unsigned grid = (unsigned)(need < cap ? need : cap);
            vs[i].k<<<grid, vs[i].threads>>>(a);   // warm
            CK(cudaGetLastError());
            CK(cudaEventRecord(e0));
            for (int r = 0; r < reps; r++) vs[i].k<<<grid, vs[i].threads>>>(a);
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            ms /= reps;
            printf("round %d  %-44s grid %7u  %7.3f ms  %6.0f GB/s\n", round + 1, vs[i].name, grid, ms, 28.0 * n / ms / 1e6);
        }
    return 0;
}
