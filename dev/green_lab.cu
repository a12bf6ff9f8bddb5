// green_lab.cu - can two kinds of work share an H100 better when each gets its own SMs? A lab tool, not part
// of the library. CUDA green contexts give a stream a fixed set of SMs; this times a training step's two
// contending pairs alone, side by side on the whole GPU, and side by side on disjoint SM partitions:
//
//   adamw: backward's GEMMs (2.7B shapes, 1024 tokens, bf16) beside an AdamW-sized memory pass (3.36 G
//          parameters x 30 bytes: p, g, m, v read; p, m, v and a bf16 copy written), as the optimizer in
//          backward would run them.
//   nccl:  backward's GEMMs (xl shapes) on every visible GPU beside DDP's gradient all-reduces (fp32, 100 MB
//          buckets, NCCL in this process), the pair that makes the data-parallel step slower than one GPU.
//
//   nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a dev/green_lab.cu -o build/green_lab \
//        -lcuda -lcublas -lnccl
//   build/green_lab adamw [sms...]     (default 8 16 24 32: the SMs given to the memory pass)
//   build/green_lab nccl [sms...]      (the SMs given to NCCL)
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK_CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = "?"; cuGetErrorString(r_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)
#define CK_CUDA(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CK_BLAS(x) do { cublasStatus_t b_ = (x); if (b_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)b_); exit(1); } } while (0)
#define CK_NCCL(x) do { ncclResult_t n_ = (x); if (n_ != ncclSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, ncclGetErrorString(n_)); exit(1); } } while (0)

enum { MAX_GPUS = 8, REPS = 3 };

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

// ---- SM partitions: a green context of `sms` SMs and one of the rest, a stream in each ----------------------

typedef struct partition { CUgreenCtx small, rest; cudaStream_t small_stream, rest_stream; int small_sms, rest_sms; } partition;

static CUgreenCtx green_from(CUdevResource *res, CUdevice dev) {
    CUdevResourceDesc desc;
    CUgreenCtx g;
    CK_CU(cuDevResourceGenerateDesc(&desc, res, 1));
    CK_CU(cuGreenCtxCreate(&g, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
    return g;
}

static cudaStream_t stream_in(CUgreenCtx g) {
    CUstream s;
    CK_CU(cuGreenCtxStreamCreate(&s, g, CU_STREAM_NON_BLOCKING, 0));
    return (cudaStream_t)s;
}

// false when the device cannot give `sms` SMs a group of their own (granularity: 8 on Hopper)
static bool partition_make(partition *p, int device, int sms) {
    CUdevice dev;
    CUdevResource all, small, rest;
    unsigned groups = 1;
    CK_CU(cuDeviceGet(&dev, device));
    CK_CU(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
    if (cuDevSmResourceSplitByCount(&small, &groups, &all, &rest, 0, (unsigned)sms) != CUDA_SUCCESS || groups != 1) return false;
    p->small = green_from(&small, dev);
    p->rest = green_from(&rest, dev);
    p->small_stream = stream_in(p->small);
    p->rest_stream = stream_in(p->rest);
    p->small_sms = (int)small.sm.smCount;
    p->rest_sms = (int)rest.sm.smCount;
    return true;
}

// the runtime issues into the current context: make the stream's own (a green one) current around its work
static void push_ctx_of(cudaStream_t s) {
    CUcontext c;
    CK_CU(cuStreamGetCtx((CUstream)s, &c));
    CK_CU(cuCtxPushCurrent(c));
}

static void pop_ctx(void) {
    CUcontext c;
    CK_CU(cuCtxPopCurrent(&c));
}

static void partition_free(partition *p) {
    CK_CU(cuStreamDestroy((CUstream)p->small_stream));
    CK_CU(cuStreamDestroy((CUstream)p->rest_stream));
    CK_CU(cuGreenCtxDestroy(p->small));
    CK_CU(cuGreenCtxDestroy(p->rest));
}

// ---- backward's GEMMs: per block and linear, dX = dY W and dW = dY^T X, bf16 in, fp32 accumulate --------------

typedef struct gemms { int tokens, layers, nlin, sms; int in[5], out[5]; __nv_bfloat16 *a, *b, *c; cublasHandle_t blas; double tflop; } gemms;

static void gemms_make(gemms *g, int d_model, int d_ff, int layers) {
    int in[5] = {d_model, d_model, d_model, d_model, d_ff}, out[5] = {3 * d_model, d_model, d_ff, d_ff, d_model};
    size_t biggest = (size_t)d_ff * (d_model > 1024 ? d_model : 1024);
    g->tokens = 1024;
    g->layers = layers;
    g->nlin = 5;
    g->sms = 0;
    memcpy(g->in, in, sizeof in);
    memcpy(g->out, out, sizeof out);
    CK_CUDA(cudaMalloc(&g->a, biggest * sizeof(__nv_bfloat16)));
    CK_CUDA(cudaMalloc(&g->b, biggest * sizeof(__nv_bfloat16)));
    CK_CUDA(cudaMalloc(&g->c, biggest * sizeof(__nv_bfloat16)));
    CK_CUDA(cudaMemset(g->a, 0, biggest * sizeof(__nv_bfloat16)));
    CK_CUDA(cudaMemset(g->b, 0, biggest * sizeof(__nv_bfloat16)));
    CK_BLAS(cublasCreate(&g->blas));
    double flop = 0;
    for (int i = 0; i < 5; i++) flop += 2.0 * 2.0 * g->tokens * in[i] * out[i];
    g->tflop = flop * layers / 1e12;
}

static void gemm(gemms *g, int m, int n, int k) {
    const float one = 1.0f, zero = 0.0f;
    CK_BLAS(cublasGemmEx(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, g->a, CUDA_R_16BF, m, g->b, CUDA_R_16BF, k, &zero,
                         g->c, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static void gemms_issue(gemms *g, cudaStream_t s) {
    push_ctx_of(s);
    CK_BLAS(cublasSetStream(g->blas, s));
    CK_BLAS(cublasSetSmCountTarget(g->blas, g->sms));   // plan the waves for the SMs the stream has (0: the device's)
    for (int l = 0; l < g->layers; l++)
        for (int i = 0; i < g->nlin; i++) {
            gemm(g, g->in[i], g->tokens, g->out[i]);    // dX
            gemm(g, g->in[i], g->out[i], g->tokens);    // dW
        }
    pop_ctx();
}

// ---- an AdamW-sized memory pass ---------------------------------------------------------------------------

typedef struct adamw { float *p, *g, *m, *v; __nv_bfloat16 *copy; size_t n; } adamw;

__global__ void adamw_kernel(float4 *p, const float4 *g, float4 *m, float4 *v, __nv_bfloat162 *copy, size_t n4) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 pp = p[i], gg = g[i], mm = m[i], vv = v[i];
        float *pe = &pp.x, *ge = &gg.x, *me = &mm.x, *ve = &vv.x;
        for (int j = 0; j < 4; j++) {
            me[j] = 0.9f * me[j] + 0.1f * ge[j];
            ve[j] = 0.999f * ve[j] + 0.001f * ge[j] * ge[j];
            pe[j] -= 1e-4f * (me[j] / (sqrtf(ve[j]) + 1e-8f) + 0.01f * pe[j]);
        }
        p[i] = pp; m[i] = mm; v[i] = vv;
        copy[2 * i] = __floats2bfloat162_rn(pp.x, pp.y);
        copy[2 * i + 1] = __floats2bfloat162_rn(pp.z, pp.w);
    }
}

static void adamw_make(adamw *a, size_t n) {
    a->n = n;
    CK_CUDA(cudaMalloc(&a->p, n * 4)); CK_CUDA(cudaMalloc(&a->g, n * 4));
    CK_CUDA(cudaMalloc(&a->m, n * 4)); CK_CUDA(cudaMalloc(&a->v, n * 4));
    CK_CUDA(cudaMalloc(&a->copy, n * 2));
    CK_CUDA(cudaMemset(a->p, 0, n * 4)); CK_CUDA(cudaMemset(a->g, 0, n * 4));
    CK_CUDA(cudaMemset(a->m, 0, n * 4)); CK_CUDA(cudaMemset(a->v, 0, n * 4));
}

// launched in slices like the optimizer in backward (one a layer), each grid sized for the whole device
static void adamw_issue(adamw *a, cudaStream_t s, int slices) {
    size_t per = (a->n / 4 + slices - 1) / slices;
    push_ctx_of(s);
    for (int i = 0; i < slices; i++) {
        size_t lo = i * per, hi = lo + per < a->n / 4 ? lo + per : a->n / 4;
        if (lo >= hi) break;
        adamw_kernel<<<132 * 8, 256, 0, s>>>((float4 *)a->p + lo, (const float4 *)a->g + lo, (float4 *)a->m + lo, (float4 *)a->v + lo,
                                             (__nv_bfloat162 *)a->copy + 2 * lo, hi - lo);
        CK_CUDA(cudaGetLastError());
    }
    pop_ctx();
}

// ---- timing: the best of REPS host-clocked runs of one or two streams' work, GPUs synchronized around it -------

typedef void (*issue_fn)(void *work, int gpu, cudaStream_t s);
typedef struct job { issue_fn issue; void *work; cudaStream_t stream[MAX_GPUS]; } job;

static void sync_all(int ngpu) {
    for (int d = 0; d < ngpu; d++) { CK_CUDA(cudaSetDevice(d)); CK_CUDA(cudaDeviceSynchronize()); }
}

static void stream_sync(cudaStream_t s) { CK_CU(cuStreamSynchronize((CUstream)s)); }

static double timed(int ngpu, job *x, job *y) {
    double best = 1e30;
    for (int r = 0; r < REPS + 1; r++) {   // the first run warms up
        sync_all(ngpu);
        double t0 = now_ms();
        if (x) x->issue(x->work, -1, NULL);
        if (y) y->issue(y->work, -1, NULL);
        for (int d = 0; d < ngpu; d++) {
            if (x) stream_sync(x->stream[d]);
            if (y) stream_sync(y->stream[d]);
        }
        double t = now_ms() - t0;
        if (r > 0 && t < best) best = t;
    }
    return best;
}

// ---- adamw: one GPU ---------------------------------------------------------------------------------------

typedef struct one_gpu { gemms g; adamw a; cudaStream_t gs, as; } one_gpu;

static void issue_gemms(void *w, int gpu, cudaStream_t s) { (void)gpu; (void)s; one_gpu *o = (one_gpu *)w; gemms_issue(&o->g, o->gs); }
static void issue_adamw(void *w, int gpu, cudaStream_t s) { (void)gpu; (void)s; one_gpu *o = (one_gpu *)w; adamw_issue(&o->a, o->as, 32); }

static void row(const char *what, double ms, double alone_sum) {
    printf("| %s | %.2f | %.3f |\n", what, ms, alone_sum > 0 ? ms / alone_sum : 0.0);
}

static void lab_adamw(int *sms, int nsms) {
    one_gpu o;
    cudaStream_t s1, s2;
    CK_CUDA(cudaSetDevice(0));
    CK_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    gemms_make(&o.g, 2560, 10240, 32);
    adamw_make(&o.a, (size_t)3355443200ull);
    job G = {issue_gemms, &o, {s1}}, A = {issue_adamw, &o, {s2}};
    o.gs = s1; o.as = s2;
    double tg = timed(1, &G, NULL), ta = timed(1, &A, NULL);
    printf("adamw lab: 2.7B backward GEMMs %.2f TFLOP; memory pass %.1f GB\n\n", o.g.tflop, o.a.n * 30.0 / 1e9);
    printf("| what | ms | / (GEMMs + pass alone, whole GPU) |\n|---|---:|---:|\n");
    row("GEMMs alone, whole GPU", tg, tg + ta);
    row("memory pass alone, whole GPU", ta, tg + ta);
    row("both, two streams, whole GPU", timed(1, &G, &A), tg + ta);
    for (int i = 0; i < nsms; i++) {
        partition p;
        char what[160];
        if (!partition_make(&p, 0, sms[i])) { printf("| %d SMs: no such partition | | |\n", sms[i]); continue; }
        o.gs = p.rest_stream; o.as = p.small_stream;
        G.stream[0] = p.rest_stream; A.stream[0] = p.small_stream;
        o.g.sms = p.rest_sms;
        snprintf(what, sizeof what, "GEMMs alone on %d SMs", p.rest_sms); row(what, timed(1, &G, NULL), tg + ta);
        snprintf(what, sizeof what, "pass alone on %d SMs", p.small_sms); row(what, timed(1, &A, NULL), tg + ta);
        snprintf(what, sizeof what, "both, %d + %d SMs", p.rest_sms, p.small_sms); row(what, timed(1, &G, &A), tg + ta);
        o.gs = s1; G.stream[0] = s1; o.g.sms = 0;
        snprintf(what, sizeof what, "both, GEMMs whole GPU + pass on %d SMs", p.small_sms); row(what, timed(1, &G, &A), tg + ta);
        o.as = s2; A.stream[0] = s2;
        partition_free(&p);
    }
}

// ---- nccl: every visible GPU, one process ------------------------------------------------------------------

typedef struct many_gpu { int ngpu; gemms g[MAX_GPUS]; float *grad[MAX_GPUS]; size_t bytes, bucket; ncclComm_t comm[MAX_GPUS]; cudaStream_t gs[MAX_GPUS], cs[MAX_GPUS]; } many_gpu;

static void issue_many_gemms(void *w, int gpu, cudaStream_t s) {
    (void)gpu; (void)s;
    many_gpu *m = (many_gpu *)w;
    for (int d = 0; d < m->ngpu; d++) { CK_CUDA(cudaSetDevice(d)); gemms_issue(&m->g[d], m->gs[d]); }
}

static void issue_allreduces(void *w, int gpu, cudaStream_t s) {
    (void)gpu; (void)s;
    many_gpu *m = (many_gpu *)w;
    for (size_t off = 0; off < m->bytes; off += m->bucket) {
        size_t n = (m->bytes - off < m->bucket ? m->bytes - off : m->bucket) / 4;
        CK_NCCL(ncclGroupStart());
        for (int d = 0; d < m->ngpu; d++) CK_NCCL(ncclAllReduce(m->grad[d] + off / 4, m->grad[d] + off / 4, n, ncclFloat32, ncclSum, m->comm[d], m->cs[d]));
        CK_NCCL(ncclGroupEnd());
    }
}

static void lab_nccl(int *sms, int nsms) {
    many_gpu m;
    int devs[MAX_GPUS];
    CK_CUDA(cudaGetDeviceCount(&m.ngpu));
    if (m.ngpu < 2) { fprintf(stderr, "green_lab nccl: needs at least 2 GPUs, found %d\n", m.ngpu); exit(2); }
    if (m.ngpu > MAX_GPUS) m.ngpu = MAX_GPUS;
    m.bytes = (size_t)1968 * 1000 * 1000 * 4;   // xl's gradients, fp32
    m.bucket = (size_t)100 * 1000 * 1000;
    for (int d = 0; d < m.ngpu; d++) {
        devs[d] = d;
        CK_CUDA(cudaSetDevice(d));
        CK_CUDA(cudaStreamCreateWithFlags(&m.gs[d], cudaStreamNonBlocking));
        CK_CUDA(cudaStreamCreateWithFlags(&m.cs[d], cudaStreamNonBlocking));
        gemms_make(&m.g[d], 1600, 6400, 48);
        CK_CUDA(cudaMalloc(&m.grad[d], m.bytes));
        CK_CUDA(cudaMemset(m.grad[d], 0, m.bytes));
    }
    CK_NCCL(ncclCommInitAll(m.comm, m.ngpu, devs));
    cudaStream_t gs0[MAX_GPUS], cs0[MAX_GPUS];
    memcpy(gs0, m.gs, sizeof gs0);
    memcpy(cs0, m.cs, sizeof cs0);
    job G = {issue_many_gemms, &m, {0}}, C = {issue_allreduces, &m, {0}};
    memcpy(G.stream, m.gs, sizeof gs0);
    memcpy(C.stream, m.cs, sizeof cs0);
    double tg = timed(m.ngpu, &G, NULL), tc = timed(m.ngpu, &C, NULL);
    printf("nccl lab: %d GPUs; xl backward GEMMs %.2f TFLOP a GPU; all-reduce %.2f GB in %zu MB buckets\n\n", m.ngpu, m.g[0].tflop,
           m.bytes / 1e9, m.bucket / 1000000);
    printf("| what | ms | / (GEMMs + all-reduce alone, whole GPU) |\n|---|---:|---:|\n");
    row("GEMMs alone, whole GPU", tg, tg + tc);
    row("all-reduces alone, whole GPU", tc, tg + tc);
    row("both, two streams, whole GPU", timed(m.ngpu, &G, &C), tg + tc);
    for (int i = 0; i < nsms; i++) {
        partition p[MAX_GPUS];
        char what[160];
        bool ok = true;
        for (int d = 0; d < m.ngpu && ok; d++) { CK_CUDA(cudaSetDevice(d)); ok = partition_make(&p[d], d, sms[i]); }
        if (!ok) { printf("| %d SMs: no such partition | | |\n", sms[i]); continue; }
        for (int d = 0; d < m.ngpu; d++) { m.gs[d] = G.stream[d] = p[d].rest_stream; m.cs[d] = C.stream[d] = p[d].small_stream; m.g[d].sms = p[d].rest_sms; }
        snprintf(what, sizeof what, "GEMMs alone on %d SMs", p[0].rest_sms); row(what, timed(m.ngpu, &G, NULL), tg + tc);
        snprintf(what, sizeof what, "all-reduces alone on %d SMs", p[0].small_sms); row(what, timed(m.ngpu, &C, NULL), tg + tc);
        snprintf(what, sizeof what, "both, %d + %d SMs", p[0].rest_sms, p[0].small_sms); row(what, timed(m.ngpu, &G, &C), tg + tc);
        for (int d = 0; d < m.ngpu; d++) { m.gs[d] = G.stream[d] = gs0[d]; m.g[d].sms = 0; }
        snprintf(what, sizeof what, "both, GEMMs whole GPU + all-reduces on %d SMs", p[0].small_sms); row(what, timed(m.ngpu, &G, &C), tg + tc);
        for (int d = 0; d < m.ngpu; d++) { m.cs[d] = C.stream[d] = cs0[d]; CK_CUDA(cudaSetDevice(d)); partition_free(&p[d]); }
    }
    for (int d = 0; d < m.ngpu; d++) CK_NCCL(ncclCommDestroy(m.comm[d]));
}

int main(int argc, char **argv) {
    int sms[16] = {8, 16, 24, 32}, nsms = 4;
    if (argc < 2 || (strcmp(argv[1], "adamw") && strcmp(argv[1], "nccl"))) {
        fprintf(stderr, "usage: %s adamw|nccl [sms...]  (the SMs given to the memory pass or to NCCL; default 8 16 24 32)\n", argv[0]);
        return 2;
    }
    if (argc > 2) {
        nsms = 0;
        for (int i = 2; i < argc && nsms < 16; i++) {
            char *end;
            long v = strtol(argv[i], &end, 10);
            if (*end || v < 1 || v > 1024) { fprintf(stderr, "%s: sms '%s' must be a whole number of SMs, 1-1024\n", argv[0], argv[i]); return 2; }
            sms[nsms++] = (int)v;
        }
    }
    setvbuf(stdout, NULL, _IONBF, 0);   // rows reach the log even if a later configuration fails
    CK_CU(cuInit(0));
    CK_CUDA(cudaSetDevice(0));
    CK_CUDA(cudaFree(0));   // the primary context first: green contexts retain it
    if (!strcmp(argv[1], "adamw")) lab_adamw(sms, nsms);
    else lab_nccl(sms, nsms);
    return 0;
}
