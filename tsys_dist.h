/* tsys_dist.h - v0.1 - distributed training for tsys: process groups on NCCL (GPUs) and MPI (CPUs),
   collectives, DDP (naive, flat, overlap, bucketed), ZeRO-1, and memory/communication accounting

   Do this:
      #define TSYS_DIST_IMPLEMENTATION      (or TSYS_IMPL)
   before you include this file in *one* file, after tsys.h (and tsys_cuda.cuh for GPUs):

      #define TSYS_IMPLEMENTATION
      #include "tsys.h"
      #define TSYS_DIST_MPI                 // CPU tensors (and host-staged CUDA tensors) through MPI
      #define TSYS_DIST_NCCL                // CUDA tensors through NCCL (needs tsys_cuda.cuh, nvcc)
      #define TSYS_DIST_IMPLEMENTATION
      #include "tsys_dist.h"

      cc  ... -DTSYS_DIST_MPI $(mpicc --showme:compile) ... $(mpicc --showme:link)
      nvcc ... -DTSYS_DIST_MPI -DTSYS_DIST_NCCL ... -lnccl $(mpicc --showme:link)

   Engines are chosen by define: TSYS_DIST_MPI and/or TSYS_DIST_NCCL. With neither, only a group of
   one process exists (world size 1), so DDP and ZeRO code runs unchanged in a single process. A
   program that does not include this header needs neither NCCL nor MPI.

   Launch and rendezvous, in this order of preference (tsys_dist_init):
      1. under mpirun / srun: rank, size and local rank from MPI; the NCCL id is broadcast over MPI
         (this is how to go multi-node);
      2. torchrun-style environment variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT:
         a small TCP rendezvous on MASTER_ADDR:MASTER_PORT exchanges the NCCL id (and, without MPI,
         carries the CPU collectives' rendezvous);
      3. neither: a group of one.
      tsys_dist_spawn(nproc, argc, argv) is the built-in local launcher (drivers' --nproc N, like
      torch.multiprocessing.spawn): it starts N copies of the program with the variables of 2 set.
      A CUDA rank uses GPU = local rank.

   tsys_dist DOES NOT:
      - hang on a dead or stuck peer: every wait is bounded by the group's timeout (desc.timeout_s,
        else TSYS_DIST_TIMEOUT from the environment, else 300 s) and ends in an error naming the rank
      - copy gradients into buckets: buckets are views of the contiguous gradient arena
      - keep global state beyond what MPI itself keeps (MPI_Init is once per process)

   Revision history:
      0.1  first release

   License: MIT, see the end of tsys.h.
*/
#ifndef TSYS_DIST_H_INCLUDED
#define TSYS_DIST_H_INCLUDED

#include "tsys.h"

#ifdef __cplusplus
extern "C" {
#endif

// >>public ----------------------------------------------------------------------------------------

typedef enum tsys_dist_engine {
    TSYS_DIST_ENGINE_AUTO = 0,   // NCCL for a CUDA group when compiled in, else MPI, else a group of one
    TSYS_DIST_ENGINE_MPI,        // CPU tensors; CUDA tensors through host staging
    TSYS_DIST_ENGINE_NCCL,       // CUDA tensors
    TSYS_DIST_ENGINE_SELF        // world size 1
} tsys_dist_engine;

typedef enum tsys_dist_op { TSYS_DIST_SUM, TSYS_DIST_AVG, TSYS_DIST_MAX } tsys_dist_op;

// Group creation. All fields 0 = default:
//   engine     auto: NCCL for CUDA tensors when compiled in and cuda is set, MPI for CPU tensors (and
//              for CUDA tensors without NCCL, through host staging), a group of one without either
//   cuda       this rank computes on a GPU: tsys_dist_init calls tsys_cuda_init(ctx, local rank mod
//              the device count) unless the context already has a CUDA backend
//   timeout_s  TSYS_DIST_TIMEOUT from the environment, else 300
// Collectives pick their path by the tensor's device: CUDA tensors go through NCCL when the group
// has a communicator, else through MPI with host staging (2 ranks may share one GPU that way).
typedef struct tsys_dist_desc {
    tsys_dist_engine engine;
    bool cuda;
    int timeout_s;
} tsys_dist_desc;

typedef struct tsys_dist tsys_dist;             // a process group
typedef struct tsys_dist_work tsys_dist_work;   // an asynchronous collective in flight

// Built-in launcher. If this process is not a rank yet (no RANK in the environment, not under
// mpirun) and nproc > 1, starts nproc copies of argv[0] with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
// MASTER_PORT set, waits for them and returns true with *exit_code = the first non-zero child exit
// (or 0): the caller returns it. Otherwise returns false and the caller goes on as a rank.
// A child that fails makes the launcher stop the others (after the group timeout at most).
TSYSDEF bool tsys_dist_spawn(int nproc, int argc, char **argv, int *exit_code);

TSYSDEF tsys_dist *tsys_dist_init(tsys_ctx *ctx, const tsys_dist_desc *desc);   // NULL + the context's error
TSYSDEF void tsys_dist_free(tsys_dist *d);
TSYSDEF int tsys_dist_rank(const tsys_dist *d);
TSYSDEF int tsys_dist_size(const tsys_dist *d);
TSYSDEF int tsys_dist_local_rank(const tsys_dist *d);
TSYSDEF tsys_dist_engine tsys_dist_engine_of(const tsys_dist *d);
TSYSDEF const char *tsys_dist_engine_name(tsys_dist_engine e);   // "mpi", "nccl", "self"
TSYSDEF tsys_ctx *tsys_dist_ctx(const tsys_dist *d);

// Collectives on whole tsys tensors (contiguous, same shape and dtype on every rank; a mismatch is
// an error). In-place all-reduce and broadcast; reduce-scatter takes in = size x numel(out) elements,
// all-gather gives out = size x numel(in). GPU collectives run on the side stream (TSYS_STREAM_SIDE),
// after the compute stream's work so far; waiting makes the compute stream wait for them (no host
// sync, capturable in a CUDA graph). Blocking forms = async + wait.
TSYSDEF tsys_status tsys_dist_all_reduce(tsys_dist *d, tsys_tensor *t, tsys_dist_op op);
TSYSDEF tsys_status tsys_dist_broadcast(tsys_dist *d, tsys_tensor *t, int root);
TSYSDEF tsys_status tsys_dist_reduce_scatter(tsys_dist *d, tsys_tensor *out, tsys_tensor *in, tsys_dist_op op);
TSYSDEF tsys_status tsys_dist_all_gather(tsys_dist *d, tsys_tensor *out, tsys_tensor *in);
TSYSDEF tsys_status tsys_dist_barrier(tsys_dist *d);
TSYSDEF tsys_dist_work *tsys_dist_all_reduce_async(tsys_dist *d, tsys_tensor *t, tsys_dist_op op);   // NULL on error
TSYSDEF tsys_dist_work *tsys_dist_reduce_scatter_async(tsys_dist *d, tsys_tensor *out, tsys_tensor *in, tsys_dist_op op);
TSYSDEF tsys_dist_work *tsys_dist_all_gather_async(tsys_dist *d, tsys_tensor *out, tsys_tensor *in);
TSYSDEF tsys_status tsys_dist_wait(tsys_dist_work *w);   // orders the compute stream after w, frees w
// Host-side helpers for drivers and tests: the same over plain doubles (rank 0's view of min/max/mean).
TSYSDEF tsys_status tsys_dist_all_reduce_host(tsys_dist *d, double *v, int n, tsys_dist_op op);

// DDP: wraps a set of parameters (the cs336 model's, a toy model's; tied weights appear once).
// Construction broadcasts every parameter, trainable or not, from rank 0. After backward,
// tsys_ddp_finish waits for the gradient all-reduces; gradients are averaged over ranks.
typedef enum tsys_ddp_strategy {
    TSYS_DDP_NAIVE,      // all-reduce each gradient after backward
    TSYS_DDP_FLAT,       // one all-reduce over the contiguous gradient arena after backward
    TSYS_DDP_OVERLAP,    // an async all-reduce per parameter from its gradient-ready hook
    TSYS_DDP_BUCKETED    // buckets of at most bucket_mb in reverse parameter order, launched when full
} tsys_ddp_strategy;

typedef struct tsys_ddp_desc {
    tsys_ddp_strategy strategy;
    double bucket_mb;            // BUCKETED: at most this many MB of parameters per bucket (0 = one bucket)
} tsys_ddp_desc;

typedef struct tsys_ddp_stats {
    int num_buckets;             // all-reduces per step
    double comm_ms;              // last step: time the communication took (side-stream events / MPI wall)
    double exposed_ms;           // last step: of it, what was not hidden behind backward
    int64_t bytes_per_step;      // gradient bytes all-reduced per step
} tsys_ddp_stats;

typedef struct tsys_ddp tsys_ddp;
TSYSDEF tsys_ddp *tsys_ddp_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_ddp_desc *desc);
TSYSDEF tsys_status tsys_ddp_start_step(tsys_ddp *ddp);    // before forward (bucketed: resets the buckets)
TSYSDEF tsys_status tsys_ddp_finish(tsys_ddp *ddp);        // after backward, before the optimizer
TSYSDEF tsys_ddp_stats tsys_ddp_stats_get(const tsys_ddp *ddp);
TSYSDEF const char *tsys_ddp_strategy_name(tsys_ddp_strategy s);
TSYSDEF void tsys_ddp_free(tsys_ddp *ddp);

// ZeRO-1: AdamW whose state is sharded by bytes over the ranks. Each rank updates the parameters it
// owns with the same math as tsys_adamw_new's, then the owners broadcast them: equal to unsharded
// AdamW bit for bit. Parameters without a gradient are left alone.
typedef struct tsys_zero1 tsys_zero1;
TSYSDEF tsys_zero1 *tsys_zero1_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_optim_desc *desc);
TSYSDEF tsys_status tsys_zero1_step(tsys_zero1 *z);
TSYSDEF void tsys_zero1_zero_grad(tsys_zero1 *z);
TSYSDEF int64_t tsys_zero1_local_state_bytes(const tsys_zero1 *z);   // optimizer state this rank holds
TSYSDEF void tsys_zero1_free(tsys_zero1 *z);

// Accounting: predicted bytes per rank and bytes sent per rank per step, for a model trained with
// batch x context tokens per rank, world ranks, a dtype (autocast) and a strategy.
typedef enum tsys_dist_scheme { TSYS_SCHEME_DDP, TSYS_SCHEME_ZERO1, TSYS_SCHEME_ZERO2, TSYS_SCHEME_ZERO3 } tsys_dist_scheme;
typedef struct tsys_dist_account {
    double param_bytes, grad_bytes, optim_bytes, act_bytes, total_bytes;   // per rank, at the peak of a step
    double sent_bytes;                                                    // per rank per step (ring algorithms)
} tsys_dist_account;
TSYSDEF tsys_dist_account tsys_dist_accounting(const tsys_model_desc *m, tsys_dtype dtype, int batch, int context, int world, tsys_dist_scheme scheme);
TSYSDEF const char *tsys_dist_scheme_name(tsys_dist_scheme s);

#ifdef __cplusplus
}
#endif
#endif // TSYS_DIST_H_INCLUDED

// =================================================================================================
//                                        IMPLEMENTATION
// =================================================================================================
#if (defined(TSYS_DIST_IMPLEMENTATION) || defined(TSYS_IMPL)) && !defined(TSYS_DIST_IMPLEMENTATION_INCLUDED)
#define TSYS_DIST_IMPLEMENTATION_INCLUDED

// >>config ----------------------------------------------------------------------------------------

// >>launch ----------------------------------------------------------------------------------------

// >>group -----------------------------------------------------------------------------------------

// >>collectives -----------------------------------------------------------------------------------

// >>ddp -------------------------------------------------------------------------------------------

// >>zero1 -----------------------------------------------------------------------------------------

// >>accounting ------------------------------------------------------------------------------------

#endif // TSYS_DIST_IMPLEMENTATION
