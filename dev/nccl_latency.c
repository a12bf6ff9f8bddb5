// nccl_latency.c - where a small all-reduce's time goes: NCCL alone, measured the way the allreduce driver
// measures tsys_dist (host clock around the call and a synchronize, the ranks lined up on the devices first),
// with the steps tsys_dist adds taken one at a time: the side stream and its two events, and NCCL symmetric
// windows for the buffers. NCCL's own protocol and algorithm choices are compared by running it under
// NCCL_PROTO / NCCL_ALGO (named in its first line). A lab tool, not part of the library.
//
//   make build/nccl_latency
//   mpirun -np 2 build/nccl_latency [iters]
//   NCCL_PROTO=LL mpirun -x NCCL_PROTO -np 4 build/nccl_latency 200
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK_CUDA(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)
#define CK_NCCL(x) do { ncclResult_t r_ = (x); if (r_ != ncclSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, ncclGetErrorString(r_)); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)
#define CK_MPI(x) do { if ((x) != MPI_SUCCESS) { fprintf(stderr, "%s:%d %s failed\n", __FILE__, __LINE__, #x); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

typedef struct probe {
    ncclComm_t comm;
    cudaStream_t compute, side;
    cudaEvent_t ready, done, t_start, t_end;   // t_*: the device's own time for one call, on the compute stream
    float *tick;
    int rank, size;
} probe;

// hop: the collective on the side stream between two events, as tsys_dist issues it; else on the compute stream
static void all_reduce(probe *p, float *buf, size_t count, int hop) {
    if (!hop) { CK_NCCL(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, p->comm, p->compute)); return; }
    CK_CUDA(cudaEventRecord(p->ready, p->compute));
    CK_CUDA(cudaStreamWaitEvent(p->side, p->ready, 0));
    CK_NCCL(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, p->comm, p->side));
    CK_CUDA(cudaEventRecord(p->done, p->side));
    CK_CUDA(cudaStreamWaitEvent(p->compute, p->done, 0));
}

// Mean and minimum over iterations of the slowest rank's time, in microseconds, and the mean of the device's
// own time (events around the call on the compute stream: what is left once the host's launch and
// synchronize are taken out).
static void run(probe *p, float *buf, size_t bytes, int hop, int iters, const char *label) {
    size_t count = bytes / sizeof(float);
    double *t = (double *)calloc((size_t)iters, sizeof(double)), *dev = (double *)calloc((size_t)iters, sizeof(double));
    for (int it = -5; it < iters; it++) {
        CK_MPI(MPI_Barrier(MPI_COMM_WORLD));
        CK_NCCL(ncclAllReduce(p->tick, p->tick, 1, ncclFloat32, ncclSum, p->comm, p->compute));   // line up on the devices
        CK_CUDA(cudaStreamSynchronize(p->compute));
        double t0 = now_us();
        CK_CUDA(cudaEventRecord(p->t_start, p->compute));
        all_reduce(p, buf, count, hop);
        CK_CUDA(cudaEventRecord(p->t_end, p->compute));
        CK_CUDA(cudaStreamSynchronize(p->compute));
        if (hop) CK_CUDA(cudaStreamSynchronize(p->side));
        float ms = 0;
        CK_CUDA(cudaEventElapsedTime(&ms, p->t_start, p->t_end));
        if (it >= 0) t[it] = now_us() - t0, dev[it] = 1e3 * ms;
    }
    CK_MPI(MPI_Allreduce(MPI_IN_PLACE, t, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
    CK_MPI(MPI_Allreduce(MPI_IN_PLACE, dev, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
    double sum = 0, lo = 1e30, dsum = 0;
    for (int i = 0; i < iters; i++) { sum += t[i]; lo = t[i] < lo ? t[i] : lo; dsum += dev[i]; }
    if (p->rank == 0) printf("| %-28s | %7zu KB | %8.1f | %8.1f | %8.1f |\n", label, bytes >> 10, sum / iters, lo, dsum / iters);
    free(t);
    free(dev);
}

int main(int argc, char **argv) {
    CK_MPI(MPI_Init(&argc, &argv));
    probe p;
    CK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &p.rank));
    CK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &p.size));
    int iters = argc > 1 ? atoi(argv[1]) : 200, ndev = 0;
    CK_CUDA(cudaGetDeviceCount(&ndev));
    CK_CUDA(cudaSetDevice(p.rank % ndev));
    ncclUniqueId id;
    if (p.rank == 0) CK_NCCL(ncclGetUniqueId(&id));
    CK_MPI(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD));
    CK_NCCL(ncclCommInitRank(&p.comm, p.size, id, p.rank));
    CK_CUDA(cudaStreamCreateWithFlags(&p.compute, cudaStreamNonBlocking));
    CK_CUDA(cudaStreamCreateWithFlags(&p.side, cudaStreamNonBlocking));
    CK_CUDA(cudaEventCreateWithFlags(&p.ready, cudaEventDisableTiming));
    CK_CUDA(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
    CK_CUDA(cudaEventCreate(&p.t_start));
    CK_CUDA(cudaEventCreate(&p.t_end));
    CK_CUDA(cudaMalloc((void **)&p.tick, sizeof(float)));
    CK_CUDA(cudaMemset(p.tick, 0, sizeof(float)));
    const size_t max_bytes = 4 << 20;
    float *plain, *sym;
    ncclWindow_t win;
    CK_CUDA(cudaMalloc((void **)&plain, max_bytes));
    CK_CUDA(cudaMemset(plain, 0, max_bytes));
    CK_NCCL(ncclMemAlloc((void **)&sym, max_bytes));
    CK_CUDA(cudaMemset(sym, 0, max_bytes));
    CK_NCCL(ncclCommWindowRegister(p.comm, sym, max_bytes, &win, NCCL_WIN_COLL_SYMMETRIC));
    if (p.rank == 0) {
        int v = 0;
        CK_NCCL(ncclGetVersion(&v));
        const char *proto = getenv("NCCL_PROTO"), *algo = getenv("NCCL_ALGO");
        printf("nccl_latency: %d ranks, NCCL %d, NCCL_PROTO=%s NCCL_ALGO=%s, %d iterations; us, slowest rank\n"
               "| case | size | mean | min | device mean |\n|---|---:|---:|---:|---:|\n",
               p.size, v, proto ? proto : "(default)", algo ? algo : "(default)", iters);
    }
    size_t sizes[3] = { 256 << 10, 1 << 20, 4 << 20 };
    for (int s = 0; s < 3; s++) {
        run(&p, plain, sizes[s], 0, iters, "plain, compute stream");
        run(&p, plain, sizes[s], 1, iters, "plain, side stream + events");
        run(&p, sym, sizes[s], 0, iters, "window, compute stream");
        run(&p, sym, sizes[s], 1, iters, "window, side stream + events");
        run(&p, plain, sizes[s], 0, iters, "plain, compute stream (again)");
    }
    CK_NCCL(ncclCommWindowDeregister(p.comm, win));
    CK_NCCL(ncclMemFree(sym));
    CK_CUDA(cudaFree(plain));
    CK_CUDA(cudaFree(p.tick));
    CK_CUDA(cudaEventDestroy(p.t_start));
    CK_CUDA(cudaEventDestroy(p.t_end));
    CK_NCCL(ncclCommDestroy(p.comm));
    CK_MPI(MPI_Finalize());
    return 0;
}
