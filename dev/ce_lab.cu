// ce_lab.cu - DDP's gradient all-reduce on the copy engines, between processes: can ranks order each other
// through device memory alone, so that the step stays capturable? A lab tool, not part of the library.
//
// Every rank allocates its gradients (xl's 7.87 GB of fp32 by default), a scratch of two bucket slots and a page
// of flags, and opens its peers' through CUDA IPC (the handles gathered with MPI). A bucket's all-reduce:
//   scatter  rank d pushes its chunk p into rank p's scratch row d (cudaMemcpyAsync: a copy engine), then raises
//            p's `ready` flag with a 4-byte copy behind it in the same stream;
//   sum      rank p waits for every ready flag (a one-warp kernel on its sum stream), sums the rows into its own
//            chunk in rank order (the same bits on every rank), then raises its peers' `space` flags;
//   gather   rank p pushes its sum into every peer's gradients and raises their `gathered` flag for the bucket.
// Pull mode (the gather a DDP step could use instead): every rank copies every peer's whole bucket into its own
// receive buffer behind the peer's `gathered` flag, and no kernel but the flag waits runs; the sum would then be
// read by the optimizer. Timed with fp32 and with bf16 gradients (the bytes a bf16 weight gradient would carry).
// With bf16 on the wire the pushes carry bf16 (rounded by a kernel before the scatter push), the owner sums the
// rows in fp32 and rounds the sum (every rank then holds the same bf16-rounded gradients), and a receiver widens
// the pushed sums back into its fp32 gradients.
// A flag lives with the rank that waits on it; the waiting kernel clears it (a one-bit semaphore), so a step leaves
// every flag as it found it and the same work captured as a CUDA graph replays. A wait that passes 10 s traps (a
// dead peer is an error, not a hang). Ranks may share a GPU (IPC within a device). NCCL's all-reduce of the same
// buckets, issued and captured, is timed in the same run for comparison.
//
//   make build/ce_lab
//   mpirun -np 2 build/ce_lab [gradient MB] [bucket MB]     (defaults 7872 and 100)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK_CUDA(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)
#define CK_BLAS(x) do { cublasStatus_t b_ = (x); if (b_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)b_); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)
#define CK_NCCL(x) do { ncclResult_t n_ = (x); if (n_ != ncclSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, ncclGetErrorString(n_)); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)
#define CK_MPI(x) do { if ((x) != MPI_SUCCESS) { fprintf(stderr, "%s:%d %s failed\n", __FILE__, __LINE__, #x); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)

enum { MAX_RANKS = 8, SLOTS = 2, MAX_BUCKETS = 256, REPS = 3 };

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

// ---- flags: one rank's, in its memory -----------------------------------------------------------------------

typedef struct flags {
    uint32_t ready[MAX_RANKS][SLOTS];           // rank s pushed its chunk of the slot's bucket into my scratch
    uint32_t space[MAX_RANKS][SLOTS];           // rank p summed the slot's bucket: its scratch row for me is free
    uint32_t gathered[MAX_BUCKETS][MAX_RANKS];  // rank p pushed its sum of bucket k into my gradients
    uint32_t one;                               // the constant a raise copies
} flags;

// wait until *f is 1, then clear it; trap after 10 s
__global__ void flag_take(uint32_t *f) {
    volatile uint32_t *x = f;
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
    while (*x != 1) {
        __nanosleep(256);
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
        if (t - t0 > 10000000000ull) __trap();
    }
    __threadfence_system();
    *x = 0;
}

// own[i] = sum over ranks r in rank order of (r == me ? own : row r)[i]
__global__ void rows_sum(float4 *own, const float4 *rows, size_t row4, int nranks, int me, size_t n4) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int r = 0; r < nranks; r++) {
            const float4 x = r == me ? own[i] : rows[r * row4 + i];
            acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
        }
        own[i] = acc;
    }
}

// bf16 on the wire: a chunk rounded for its push; the owner's sum of rows rounded once more (its own chunk rounded
// first, like the peers'), into both its fp32 gradients and their bf16 mirror; a pushed sum widened by its receiver
__global__ void round16(__nv_bfloat162 *dst, const float2 *src, size_t n2) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n2; i += (size_t)gridDim.x * blockDim.x) dst[i] = __float22bfloat162_rn(src[i]);
}
__global__ void rows_sum16(float2 *own, __nv_bfloat162 *own16, const __nv_bfloat162 *rows, size_t row2, int nranks, int me, size_t n2) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n2; i += (size_t)gridDim.x * blockDim.x) {
        float2 acc = make_float2(0.f, 0.f);
        for (int r = 0; r < nranks; r++) {
            const float2 x = __bfloat1622float2(r == me ? __float22bfloat162_rn(own[i]) : rows[r * row2 + i]);
            acc.x += x.x; acc.y += x.y;
        }
        const __nv_bfloat162 h = __float22bfloat162_rn(acc);
        own16[i] = h;
        own[i] = __bfloat1622float2(h);
    }
}
__global__ void widen16(float2 *dst, const __nv_bfloat162 *src, size_t n2) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n2; i += (size_t)gridDim.x * blockDim.x) dst[i] = __bfloat1622float2(src[i]);
}

// ---- one rank -------------------------------------------------------------------------------------------------

typedef struct rank_state {
    int rank, nranks, nbuckets;
    size_t bytes, bucket, row;   // row: bytes of a scratch row (bucket / nranks)
    float *grad[MAX_RANKS], *scratch[MAX_RANKS];   // mine at [rank], the peers' opened through IPC
    __nv_bfloat16 *grad16[MAX_RANKS];              // wire16: the gradients' bf16 mirror (pushes and sums)
    bool wire16;                                   // bf16 on the wire
    flags *fl[MAX_RANKS];
    cudaStream_t cs, rs, ag, gs;                   // sums and waits; scatter pushes; gather pushes; GEMMs
    cudaEvent_t fork, summed, rs_done, ag_done;
    cudaGraphExec_t graph;
    ncclComm_t comm;   // the comparison: NCCL's all-reduce of the same buckets on cs
    bool nccl;
    int pull;                        // 0: all-reduce; 4 or 2: pull every peer's gradients of that many bytes an element
    char *recv;                      // pull: (nranks - 1) gradients' worth, peer q's at slot q - (q > rank)
    cudaStream_t ps[MAX_RANKS];      // pull: one stream a peer
} rank_state;

static void take(cudaStream_t s, uint32_t *f) {
    flag_take<<<1, 1, 0, s>>>(f);
    CK_CUDA(cudaGetLastError());
}
static void raise_flag(rank_state *m, cudaStream_t s, uint32_t *peer_flag) {
    CK_CUDA(cudaMemcpyAsync(peer_flag, &m->fl[m->rank]->one, 4, cudaMemcpyDeviceToDevice, s));
}

// the whole all-reduce, issued on this rank's streams from cs (and joined back to it)
static void allreduce_issue(rank_state *m) {
    const int me = m->rank, n = m->nranks;
    CK_CUDA(cudaEventRecord(m->fork, m->cs));
    CK_CUDA(cudaStreamWaitEvent(m->rs, m->fork, 0));
    CK_CUDA(cudaStreamWaitEvent(m->ag, m->fork, 0));
    int k = 0;
    for (size_t off = 0; off < m->bytes; off += m->bucket, k++) {
        const size_t bb = m->bytes - off < m->bucket ? m->bytes - off : m->bucket, chunk = bb / n;
        const int slot = k % SLOTS;
        const size_t e0 = off / 4, wire = m->wire16 ? chunk / 2 : chunk;   // first element; bytes a chunk on the wire
        for (int p = 0; p < n; p++) {   // scatter
            if (p == me) continue;
            take(m->rs, &m->fl[me]->space[p][slot]);
            const void *src = (char *)m->grad[me] + off + p * chunk;
            if (m->wire16) {
                src = m->grad16[me] + e0 + p * chunk / 4;
                round16<<<132 * 2, 256, 0, m->rs>>>((__nv_bfloat162 *)src, (const float2 *)((char *)m->grad[me] + off + p * chunk), chunk / 8);
                CK_CUDA(cudaGetLastError());
            }
            CK_CUDA(cudaMemcpyAsync((char *)m->scratch[p] + (slot * n + me) * m->row, src, wire, cudaMemcpyDeviceToDevice, m->rs));
            raise_flag(m, m->rs, &m->fl[p]->ready[me][slot]);
        }
        // sum: every peer's row is in
        for (int s = 0; s < n; s++)
            if (s != me) take(m->cs, &m->fl[me]->ready[s][slot]);
        if (m->wire16)
            rows_sum16<<<132 * 4, 256, 0, m->cs>>>((float2 *)((char *)m->grad[me] + off + me * chunk), (__nv_bfloat162 *)(m->grad16[me] + e0 + me * chunk / 4),
                                                   (const __nv_bfloat162 *)((char *)m->scratch[me] + slot * n * m->row), m->row / 4, n, me, chunk / 8);
        else
            rows_sum<<<132 * 4, 256, 0, m->cs>>>((float4 *)((char *)m->grad[me] + off + me * chunk),
                                                 (const float4 *)((char *)m->scratch[me] + slot * n * m->row), m->row / 16, n, me, chunk / 16);
        CK_CUDA(cudaGetLastError());
        for (int s = 0; s < n; s++)
            if (s != me) raise_flag(m, m->cs, &m->fl[s]->space[me][slot]);
        CK_CUDA(cudaEventRecord(m->summed, m->cs));
        CK_CUDA(cudaStreamWaitEvent(m->ag, m->summed, 0));
        for (int r = 0; r < n; r++) {   // gather
            if (r == me) continue;
            if (m->wire16)
                CK_CUDA(cudaMemcpyAsync(m->grad16[r] + e0 + me * chunk / 4, m->grad16[me] + e0 + me * chunk / 4, wire, cudaMemcpyDeviceToDevice, m->ag));
            else
                CK_CUDA(cudaMemcpyAsync((char *)m->grad[r] + off + me * chunk, (char *)m->grad[me] + off + me * chunk, chunk, cudaMemcpyDeviceToDevice, m->ag));
            raise_flag(m, m->ag, &m->fl[r]->gathered[k][me]);
        }
    }
    k = 0;
    for (size_t off = 0; off < m->bytes; off += m->bucket, k++)   // every peer's sums are in (widened when bf16)
        for (int s = 0; s < n; s++) {
            if (s == me) continue;
            take(m->cs, &m->fl[me]->gathered[k][s]);
            if (!m->wire16) continue;
            const size_t chunk = (m->bytes - off < m->bucket ? m->bytes - off : m->bucket) / n, e = off / 4 + s * chunk / 4;
            widen16<<<132 * 2, 256, 0, m->cs>>>((float2 *)(m->grad[me] + e), (const __nv_bfloat162 *)(m->grad16[me] + e), chunk / 8);
            CK_CUDA(cudaGetLastError());
        }
    CK_CUDA(cudaEventRecord(m->rs_done, m->rs));
    CK_CUDA(cudaEventRecord(m->ag_done, m->ag));
    CK_CUDA(cudaStreamWaitEvent(m->cs, m->rs_done, 0));
    CK_CUDA(cudaStreamWaitEvent(m->cs, m->ag_done, 0));
}

// pull mode: my flags for every bucket raised in my peers (my gradients are ready), then every peer's buckets
// copied in behind theirs, one stream a peer
static void pull_issue(rank_state *m) {
    const int me = m->rank, n = m->nranks;
    const size_t bytes = m->bytes / 4 * m->pull, bucket = m->bucket / 4 * m->pull;
    CK_CUDA(cudaEventRecord(m->fork, m->cs));
    for (int q = 0; q < n; q++)
        if (q != me) CK_CUDA(cudaStreamWaitEvent(m->ps[q], m->fork, 0));
    int k = 0;
    for (size_t off = 0; off < bytes; off += bucket, k++) {
        const size_t bb = bytes - off < bucket ? bytes - off : bucket;
        for (int q = 0; q < n; q++) {
            if (q == me) continue;
            raise_flag(m, m->ps[q], &m->fl[q]->gathered[k][me]);
            take(m->ps[q], &m->fl[me]->gathered[k][q]);
            const char *src = m->pull == 4 ? (const char *)m->grad[q] : (const char *)m->grad16[q];
            CK_CUDA(cudaMemcpyAsync(m->recv + (size_t)(q - (q > me)) * bytes + off, src + off, bb, cudaMemcpyDeviceToDevice, m->ps[q]));
        }
    }
    for (int q = 0; q < n; q++) {
        if (q == me) continue;
        CK_CUDA(cudaEventRecord(m->ag_done, m->ps[q]));
        CK_CUDA(cudaStreamWaitEvent(m->cs, m->ag_done, 0));
    }
}

static void nccl_issue(rank_state *m) {
    for (size_t off = 0; off < m->bytes; off += m->bucket) {
        const size_t bb = m->bytes - off < m->bucket ? m->bytes - off : m->bucket;
        float *x = (float *)((char *)m->grad[m->rank] + off);
        CK_NCCL(ncclAllReduce(x, x, bb / 4, ncclFloat32, ncclSum, m->comm, m->cs));
    }
}

static void allreduce(rank_state *m) {
    if (m->graph) CK_CUDA(cudaGraphLaunch(m->graph, m->cs));
    else if (m->nccl) nccl_issue(m);
    else if (m->pull) pull_issue(m);
    else allreduce_issue(m);
}

static void capture(rank_state *m) {
    cudaGraph_t graph;
    if (m->graph) CK_CUDA(cudaGraphExecDestroy(m->graph));
    m->graph = NULL;
    CK_CUDA(cudaStreamBeginCapture(m->cs, cudaStreamCaptureModeThreadLocal));
    if (m->nccl) nccl_issue(m);
    else if (m->pull) pull_issue(m);
    else allreduce_issue(m);
    CK_CUDA(cudaStreamEndCapture(m->cs, &graph));
    CK_CUDA(cudaGraphInstantiate(&m->graph, graph, 0));
    CK_CUDA(cudaGraphDestroy(graph));
}

// ---- backward's GEMMs (xl shapes, bf16, fp32 accumulate) -----------------------------------------------------

typedef struct gemms { __nv_bfloat16 *a, *b, *c; cublasHandle_t blas; } gemms;

static void gemms_make(gemms *g) {
    const size_t biggest = (size_t)6400 * 1600;
    CK_CUDA(cudaMalloc(&g->a, biggest * 2)); CK_CUDA(cudaMalloc(&g->b, biggest * 2)); CK_CUDA(cudaMalloc(&g->c, biggest * 2));
    CK_CUDA(cudaMemset(g->a, 0, biggest * 2)); CK_CUDA(cudaMemset(g->b, 0, biggest * 2));
    CK_BLAS(cublasCreate(&g->blas));
}

static void gemms_issue(gemms *g, cudaStream_t s) {
    const int in[5] = {1600, 1600, 1600, 1600, 6400}, out[5] = {4800, 1600, 6400, 6400, 1600}, tokens = 1024;
    const float one = 1.0f, zero = 0.0f;
    CK_BLAS(cublasSetStream(g->blas, s));
    for (int l = 0; l < 48; l++)
        for (int i = 0; i < 5; i++) {
            CK_BLAS(cublasGemmEx(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, in[i], tokens, out[i], &one, g->a, CUDA_R_16BF, in[i], g->b, CUDA_R_16BF,
                                 out[i], &zero, g->c, CUDA_R_16BF, in[i], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            CK_BLAS(cublasGemmEx(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, in[i], out[i], tokens, &one, g->a, CUDA_R_16BF, in[i], g->b, CUDA_R_16BF,
                                 tokens, &zero, g->c, CUDA_R_16BF, in[i], CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
}

// ---- checks and timings ----------------------------------------------------------------------------------------

static float value_of(size_t i, int rank) { return (float)((i * 7 + rank * 13) % 1000) * 0.001f - 0.5f; }
static float round16_host(float x) {   // to the nearest bf16, ties to even (finite x)
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

// pull: every peer's gradients (or their bf16 rounding) in my receive buffer, bit for bit
static bool check_pull(rank_state *m) {
    const size_t n = m->bytes / 4;
    float *h = (float *)malloc(m->bytes);
    uint16_t *h16 = (uint16_t *)malloc(m->bytes / 2);
    if (!h || !h16) { fprintf(stderr, "ce_lab: out of host memory\n"); MPI_Abort(MPI_COMM_WORLD, 1); }
    for (size_t i = 0; i < n; i++) {
        h[i] = value_of(i, m->rank);
        const float r = round16_host(h[i]);
        uint32_t u;
        memcpy(&u, &r, 4);
        h16[i] = (uint16_t)(u >> 16);
    }
    CK_CUDA(cudaMemcpy(m->grad[m->rank], h, m->bytes, cudaMemcpyHostToDevice));
    CK_CUDA(cudaMemcpy(m->grad16[m->rank], h16, m->bytes / 2, cudaMemcpyHostToDevice));
    CK_CUDA(cudaDeviceSynchronize());
    CK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    allreduce(m);
    CK_CUDA(cudaStreamSynchronize(m->cs));
    int ok = 1;
    for (int q = 0; q < m->nranks && ok; q++) {
        if (q == m->rank) continue;
        const char *slot = m->recv + (size_t)(q - (q > m->rank)) * (m->bytes / 4 * m->pull);
        if (m->pull == 4) CK_CUDA(cudaMemcpy(h, slot, m->bytes, cudaMemcpyDeviceToHost));
        else CK_CUDA(cudaMemcpy(h16, slot, m->bytes / 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n && ok; i++) {
            const float want = value_of(i, q);
            if (m->pull == 4) { ok = h[i] == want; continue; }
            uint32_t u = (uint32_t)h16[i] << 16;
            float got;
            memcpy(&got, &u, 4);
            ok = got == round16_host(want);
        }
    }
    free(h); free(h16);
    int all = 0;
    CK_MPI(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    return all == 1;
}

// every rank's gradients after one all-reduce against the host's rank-ordered sum; true on every rank when all agree
static bool check(rank_state *m) {
    if (m->pull) return check_pull(m);
    const size_t n = m->bytes / 4;
    float *h = (float *)malloc(m->bytes);
    if (!h) { fprintf(stderr, "ce_lab: out of host memory\n"); MPI_Abort(MPI_COMM_WORLD, 1); }
    for (size_t i = 0; i < n; i++) h[i] = value_of(i, m->rank);
    CK_CUDA(cudaMemcpy(m->grad[m->rank], h, m->bytes, cudaMemcpyHostToDevice));
    CK_CUDA(cudaDeviceSynchronize());
    CK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    allreduce(m);
    CK_CUDA(cudaStreamSynchronize(m->cs));
    CK_MPI(MPI_Barrier(MPI_COMM_WORLD));   // the peers' pushes into my gradients are done too
    CK_CUDA(cudaMemcpy(h, m->grad[m->rank], m->bytes, cudaMemcpyDeviceToHost));
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) {
        float want = 0.0f;
        for (int r = 0; r < m->nranks; r++) want += m->wire16 && !m->nccl ? round16_host(value_of(i, r)) : value_of(i, r);
        ok = h[i] == (m->wire16 && !m->nccl ? round16_host(want) : want);
    }
    free(h);
    int all = 0;
    CK_MPI(MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    return all == 1;
}

// the slowest rank's best of REPS (after a warm-up): the all-reduce, the GEMMs, or both; gemms_done: when the
// GEMMs' stream finished in that run
static double timed(rank_state *m, gemms *g, bool ar, bool gm, double *gemms_done) {
    double best = 1e30, done = 0;
    for (int r = 0; r < REPS + 1; r++) {
        CK_CUDA(cudaDeviceSynchronize());
        CK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        const double t0 = now_ms();
        if (ar) allreduce(m);
        if (gm) gemms_issue(g, m->gs);
        CK_CUDA(cudaStreamSynchronize(m->gs));
        const double tg = now_ms() - t0;
        CK_CUDA(cudaStreamSynchronize(m->cs));
        double t = now_ms() - t0, slowest = 0, tg_slowest = 0;
        CK_MPI(MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
        CK_MPI(MPI_Allreduce((void *)&tg, &tg_slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
        if (r > 0 && slowest < best) best = slowest, done = tg_slowest;
    }
    if (gemms_done) *gemms_done = done;
    return best;
}

static void rows(rank_state *m, gemms *g, const char *how, double tg) {
    const bool exact = check(m);
    const double tc = timed(m, g, true, false, NULL);
    double done = 0;
    const double both = timed(m, g, true, true, &done);
    if (m->rank) return;
    printf("| all-reduce alone, %s (sums %s the host's) | %.2f | %.0f |\n", how, exact ? "equal to" : "differ from", tc,
           (m->pull ? m->bytes / 4.0 * m->pull * (m->nranks - 1) : m->bytes * 2.0 * (m->nranks - 1) / m->nranks) / (tc * 1e6));
    printf("| both, %s (GEMMs done at %.2f ms, alone %.2f) | %.2f | |\n", how, done, tg, both);
}

// the rows issued, then captured as one graph and replayed
static void both_ways(rank_state *m, gemms *g, const char *what, double tg) {
    char how[96];
    if (m->graph) CK_CUDA(cudaGraphExecDestroy(m->graph));
    m->graph = NULL;
    snprintf(how, sizeof how, "%s, issued", what);
    rows(m, g, how, tg);
    capture(m);
    snprintf(how, sizeof how, "%s, captured", what);
    rows(m, g, how, tg);
}

// ---- setup ------------------------------------------------------------------------------------------------------

static size_t mb_arg(int argc, char **argv, int i, size_t dflt) {
    if (argc <= i) return dflt * 1000 * 1000;
    char *end;
    const long v = strtol(argv[i], &end, 10);
    if (*end || v < 1 || v > 1 << 20) { fprintf(stderr, "ce_lab: '%s' must be a whole number of MB, 1-%d\n", argv[i], 1 << 20); MPI_Abort(MPI_COMM_WORLD, 2); }
    return (size_t)v * 1000 * 1000;
}

// my buffer's handle to every rank, theirs opened into out[] (mine stays at out[rank])
static void share(rank_state *m, void *mine, void **out) {
    cudaIpcMemHandle_t h, all[MAX_RANKS];
    CK_CUDA(cudaIpcGetMemHandle(&h, mine));
    CK_MPI(MPI_Allgather(&h, sizeof h, MPI_BYTE, all, sizeof h, MPI_BYTE, MPI_COMM_WORLD));
    for (int r = 0; r < m->nranks; r++)
        if (r == m->rank) out[r] = mine;
        else CK_CUDA(cudaIpcOpenMemHandle(&out[r], all[r], cudaIpcMemLazyEnablePeerAccess));
}

int main(int argc, char **argv) {
    rank_state m;
    memset(&m, 0, sizeof m);
    CK_MPI(MPI_Init(&argc, &argv));
    CK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &m.rank));
    CK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &m.nranks));
    if (m.nranks < 2 || m.nranks > MAX_RANKS) { fprintf(stderr, "ce_lab: 2-%d ranks, not %d\n", MAX_RANKS, m.nranks); MPI_Abort(MPI_COMM_WORLD, 2); }
    m.bytes = mb_arg(argc, argv, 1, 7872), m.bucket = mb_arg(argc, argv, 2, 100);
    if (m.bucket % (32 * m.nranks) || m.bytes % (32 * m.nranks)) { fprintf(stderr, "ce_lab: sizes must split into 16-byte rank chunks\n"); MPI_Abort(MPI_COMM_WORLD, 2); }
    m.nbuckets = (int)((m.bytes + m.bucket - 1) / m.bucket);
    if (m.nbuckets > MAX_BUCKETS) { fprintf(stderr, "ce_lab: %d buckets, at most %d\n", m.nbuckets, (int)MAX_BUCKETS); MPI_Abort(MPI_COMM_WORLD, 2); }
    m.row = m.bucket / m.nranks;
    int ngpu = 0;
    CK_CUDA(cudaGetDeviceCount(&ngpu));
    CK_CUDA(cudaSetDevice(m.rank % ngpu));
    setvbuf(stdout, NULL, _IONBF, 0);

    CK_CUDA(cudaMalloc(&m.grad[m.rank], m.bytes));
    CK_CUDA(cudaMalloc(&m.scratch[m.rank], SLOTS * m.bucket));
    CK_CUDA(cudaMalloc(&m.fl[m.rank], sizeof(flags)));
    flags init;
    memset(&init, 0, sizeof init);
    for (int p = 0; p < MAX_RANKS; p++) init.space[p][0] = init.space[p][1] = 1;   // every scratch row starts free
    init.one = 1;
    CK_CUDA(cudaMemcpy(m.fl[m.rank], &init, sizeof init, cudaMemcpyHostToDevice));
    share(&m, m.grad[m.rank], (void **)m.grad);
    share(&m, m.scratch[m.rank], (void **)m.scratch);
    share(&m, m.fl[m.rank], (void **)m.fl);
    CK_CUDA(cudaMalloc(&m.grad16[m.rank], m.bytes / 2));
    share(&m, m.grad16[m.rank], (void **)m.grad16);
    cudaStream_t *ss[4] = {&m.cs, &m.rs, &m.ag, &m.gs};
    for (cudaStream_t *s : ss) CK_CUDA(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    cudaEvent_t *es[4] = {&m.fork, &m.summed, &m.rs_done, &m.ag_done};
    for (cudaEvent_t *e : es) CK_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    gemms g;
    gemms_make(&g);

    const double tg = timed(&m, &g, false, true, NULL);
    if (!m.rank)
        printf("ce_lab: %d ranks on %d GPUs; all-reduce %.2f GB in %zu MB buckets; xl backward GEMMs beside it\n\n| what | ms | bus GB/s |\n|---|---:|---:|\n"
               "| GEMMs alone | %.2f | |\n", m.nranks, ngpu < m.nranks ? ngpu : m.nranks, m.bytes / 1e9, m.bucket / 1000000, tg);
    both_ways(&m, &g, "copy engines", tg);
    m.wire16 = true;
    both_ways(&m, &g, "copy engines, bf16 on the wire", tg);
    m.wire16 = false;
    CK_CUDA(cudaMalloc(&m.recv, (size_t)(m.nranks - 1) * m.bytes));
    for (int q = 0; q < m.nranks; q++) CK_CUDA(cudaStreamCreateWithFlags(&m.ps[q], cudaStreamNonBlocking));
    m.pull = 4;
    both_ways(&m, &g, "pull every peer's fp32 gradients", tg);
    m.pull = 2;
    both_ways(&m, &g, "pull every peer's bf16 gradients", tg);
    m.pull = 0;
    ncclUniqueId id;
    if (!m.rank) CK_NCCL(ncclGetUniqueId(&id));
    CK_MPI(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD));
    CK_NCCL(ncclCommInitRank(&m.comm, m.nranks, id, m.rank));
    m.nccl = true;
    both_ways(&m, &g, "NCCL", tg);
    CK_CUDA(cudaGraphExecDestroy(m.graph));
    CK_NCCL(ncclCommDestroy(m.comm));
    CK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    CK_MPI(MPI_Finalize());
    return 0;
}
