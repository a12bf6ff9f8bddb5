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
// Parameters without requires_grad are broadcast but never all-reduced. Trainable parameters that
// have no .grad yet get one from DDP: views of one zeroed gradient arena in parameter order (so
// buckets are views too, as torch DDP's gradient_as_bucket_view), marked zero (lazy zero-grad).
// A step is:  tsys_ddp_start_step; forward; backward; tsys_ddp_finish; optimizer step; zero grads.
// One backward per step: overlap and bucketed send gradients while backward runs, so a second
// backward before tsys_ddp_finish (gradient accumulation) would add into buffers in flight.
// Every rank must run the same backward graph (the same parameters get gradients, in the same
// order), as with torch DDP without find_unused_parameters; a trainable parameter that got no
// gradient in a backward counts as zero and is reduced as zeros by tsys_ddp_finish.
typedef enum tsys_ddp_strategy {
    TSYS_DDP_NAIVE,      // all-reduce each gradient after backward
    TSYS_DDP_FLAT,       // one all-reduce over the contiguous gradient arena after backward
    TSYS_DDP_OVERLAP,    // an async all-reduce per parameter from its gradient-ready hook
    TSYS_DDP_BUCKETED    // buckets of at most bucket_mb in reverse parameter order, launched when full
} tsys_ddp_strategy;

// bucket_mb counts MiB (1 MB = 2^20 bytes, as torch DDP's bucket_cap_mb) of parameter bytes. A
// bucket holds at most that much; a parameter larger than the limit gets a bucket of its own.
typedef struct tsys_ddp_desc {
    tsys_ddp_strategy strategy;
    double bucket_mb;            // BUCKETED: at most this many MB of parameters per bucket (0 = one bucket)
} tsys_ddp_desc;

// What the last tsys_ddp_finish saw. Times are per step, in ms:
//   CUDA tensors through NCCL (side-stream events, no host sync in the step; read by stats_get,
//   which waits for the last step's events):
//     comm_ms     sum over the step's all-reduces of end - start, where start is an event recorded
//                 on the side stream once it has waited for the compute stream (the moment the
//                 collective could run) and end an event recorded after it: the side stream's busy time
//     exposed_ms  max(0, end of the last all-reduce - backward end), backward end being an event on
//                 the compute stream at the entry of tsys_ddp_finish
//   CPU tensors (and CUDA tensors through MPI host staging), host clock:
//     comm_ms     from the launch of the first all-reduce to the return of the last wait (an upper
//                 bound: the progress of an asynchronous MPI collective is not observable)
//     exposed_ms  from max(backward end, first launch) to the return of the last wait: the time the
//                 step spent in communication after backward, i.e. what overlap did not hide
//   For naive and flat exposed_ms = comm_ms. comm_ms - exposed_ms is what ran under backward.
//   (The ddp driver also times the step's all-reduces alone, with nothing to overlap, to give the
//   hidden fraction 1 - exposed / alone.)
typedef struct tsys_ddp_stats {
    int num_buckets;             // all-reduces per step
    int copied_buckets;          // of them, buckets that are not a view of one gradient arena: their
                                 // gradients are copied into a scratch buffer and back around the all-reduce
    double comm_ms;              // last step: time the communication took (see above)
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
// Ownership: trainable parameters in order, each to the rank holding the fewest bytes so far (ties:
// the lowest rank); a rank holds at most total/N + the largest parameter. The gradients must already
// be averaged (tsys_ddp_finish, or identical data on every rank); zero_grad covers every parameter.
typedef struct tsys_zero1 tsys_zero1;
TSYSDEF tsys_zero1 *tsys_zero1_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_optim_desc *desc);
TSYSDEF tsys_status tsys_zero1_step(tsys_zero1 *z);
TSYSDEF void tsys_zero1_zero_grad(tsys_zero1 *z);
TSYSDEF int64_t tsys_zero1_local_state_bytes(const tsys_zero1 *z);   // optimizer state this rank holds
TSYSDEF void tsys_zero1_free(tsys_zero1 *z);

// Accounting: predicted bytes per rank and bytes sent per rank per step, for a model trained with
// batch x context tokens per rank, world ranks, a dtype (autocast) and a strategy. DDP and ZeRO-1
// as tsys implements them (ZeRO-1 = DDP's all-reduce + ZeRO-1's broadcasts); ZeRO-2/3 on paper.
// The formulas are in the >>accounting section; act_bytes is what the forward keeps for backward
// plus the logits' gradient (the peak of a step).
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
// DDP, ZeRO-1 and the accounting use only the public tsys and collective API (no engine internals).
// A DDP is a list of buckets; each bucket is a run of consecutive trainable parameters and one
// all-reduce per step. naive and overlap: one bucket per parameter; flat: one bucket; bucketed:
// buckets by size. naive and flat launch in tsys_ddp_finish; overlap and bucketed launch from the
// gradient-ready hooks, a bucket as soon as the last of its gradients is final (hooks fire in tape
// order, which is the same on every rank, so the collectives are issued in the same order).
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <math.h>
#if defined(TSYS_MALLOC) && defined(TSYS_FREE)
#define TSYS__DIST_ALLOC(sz) TSYS_MALLOC(sz)
#define TSYS__DIST_RELEASE(p) TSYS_FREE(p)
#else
#define TSYS__DIST_ALLOC(sz) malloc(sz)
#define TSYS__DIST_RELEASE(p) free(p)
#endif

// Side-stream events are used for timing only when the group talks NCCL on CUDA tensors and no
// graph is being captured (elapsed times cannot be read from captured events).
static bool tsys__ddp_gpu_timing(tsys_dist *d, tsys_ctx *ctx, tsys_device dev) {
    if (dev != TSYS_CUDA || tsys_dist_engine_of(d) != TSYS_DIST_ENGINE_NCCL) return false;
#ifdef TSYS_CUDA_H_INCLUDED
    if (tsys_cuda_capturing(ctx)) return false;
#else
    (void)ctx;
#endif
    return true;
}

// Do the tensors' grads (or the tensors themselves) lie back to back in one storage, one dtype?
static bool tsys__dist_contiguous(tsys_tensor *const *t, int n, bool grads) {
    for (int i = 1; i < n; i++) {
        const tsys_tensor *a = grads ? t[i - 1]->grad : t[i - 1], *b = grads ? t[i]->grad : t[i];
        if (!a || !b || a->storage != b->storage || a->dtype != b->dtype || b->offset != a->offset + tsys_tensor_bytes(a)) return false;
    }
    return n > 0 && (!grads || t[0]->grad);
}

// A 1-D view over n back-to-back tensors (their grads when `grads`), starting at the first.
static tsys_tensor *tsys__dist_run_view(tsys_ctx *ctx, tsys_tensor *const *t, int n, bool grads) {
    int64_t numel = 0;
    for (int i = 0; i < n; i++) numel += tsys_tensor_numel(t[i]);
    tsys_tensor *base = grads ? t[0]->grad : t[0];
    return tsys_tensor_view_raw(ctx, base, 0, base->dtype, 1, &numel);
}

// Broadcasts tensors from root: each maximal run of back-to-back tensors goes as one call.
static tsys_status tsys__dist_broadcast_list(tsys_dist *d, tsys_tensor *const *t, int n, int root) {
    tsys_ctx *ctx = tsys_dist_ctx(d);
    for (int i = 0; i < n;) {
        int j = i + 1;
        while (j < n && tsys__dist_contiguous(t + i, j - i + 1, false)) j++;
        tsys_tensor *v = j - i > 1 ? tsys__dist_run_view(ctx, t + i, j - i, false) : tsys_tensor_retain(t[i]);
        tsys_status st = v ? tsys_dist_broadcast(d, v, root) : tsys_ctx_status(ctx);
        tsys_tensor_release(v);
        if (st != TSYS_OK) return st;
        i = j;
    }
    return TSYS_OK;
}

typedef struct tsys__ddp_bucket {
    int first, count;            // trainable parameters tp[first .. first + count)
    int64_t numel, bytes;
    int pending;                 // gradients of the bucket not final yet in this backward
    bool launched;
    bool scratch;                // flat is a copy buffer (the grads are not one run of one arena)
    tsys_tensor *flat;           // what is all-reduced: a view of the gradient arena, or the scratch
    tsys_dist_work *work;
    tsys_event ev_ready, ev_start, ev_end;   // CUDA timing: compute ready, side-stream start and end
    double t_launch_us;
} tsys__ddp_bucket;

typedef struct tsys__ddp_hook { struct tsys_ddp *ddp; int index; } tsys__ddp_hook;

struct tsys_ddp {
    tsys_dist *d;
    tsys_ctx *ctx;
    tsys_ddp_desc desc;
    tsys_device dev;
    tsys_tensor **params;        // every parameter, retained
    int n;
    tsys_tensor **tp;            // the trainable ones, in parameter order (borrowed from params)
    int ntp;
    int *bucket_of;              // tp index -> bucket
    tsys__ddp_hook *hooks;       // one per trainable parameter (OVERLAP, BUCKETED)
    bool hooked;
    tsys__ddp_bucket *b;
    int nb;
    int *order;                  // buckets in launch order this step
    int nlaunched;
    tsys_tensor *grad_arena;     // the gradients DDP gave parameters that had none
    bool gpu_timing;             // the last step recorded side-stream events
    tsys_event ev_bwd_end;
    double t_bwd_end_us, t_first_us, t_done_us;
    tsys_ddp_stats stats;
    int stats_launched;          // buckets the last finished step launched
    tsys_status launch_error;    // a hook that failed to launch (reported by finish)
};

TSYSDEF const char *tsys_ddp_strategy_name(tsys_ddp_strategy s) {
    switch (s) {
    case TSYS_DDP_NAIVE: return "naive";
    case TSYS_DDP_FLAT: return "flat";
    case TSYS_DDP_OVERLAP: return "overlap";
    case TSYS_DDP_BUCKETED: return "bucketed";
    }
    return "unknown";
}

// Starts bucket bi's all-reduce: gradients that still count as zero get their zeros, a scratch
// bucket copies its gradients in, then the asynchronous average.
static tsys_status tsys__ddp_launch(tsys_ddp *ddp, int bi) {
    tsys__ddp_bucket *b = &ddp->b[bi];
    tsys_ctx *ctx = ddp->ctx;
    tsys_tensor **p = ddp->tp + b->first;
    if (b->launched) return TSYS_OK;
    b->launched = true;
    ddp->order[ddp->nlaunched++] = bi;
    tsys_status st = tsys_grads_settle(ctx, p, b->count);
    if (st == TSYS_OK && b->scratch) {
        size_t off = 0;
        for (int i = 0; st == TSYS_OK && i < b->count; i++) {
            int64_t n = tsys_tensor_numel(p[i]);
            tsys_tensor *v = tsys_tensor_view_raw(ctx, b->flat, off, b->flat->dtype, 1, &n);
            st = v ? tsys_tensor_copy_from(ctx, v, p[i]->grad) : tsys_ctx_status(ctx);
            tsys_tensor_release(v);
            off += tsys_tensor_bytes(p[i]->grad);
        }
    }
    if (st != TSYS_OK) return st;
    double now = tsys_time_us();
    if (ddp->nlaunched == 1) { ddp->t_first_us = now; ddp->gpu_timing = tsys__ddp_gpu_timing(ddp->d, ctx, ddp->dev); }
    b->t_launch_us = now;
    if (ddp->gpu_timing) {   // the side stream waits for the gradients, then marks the start
        tsys_event_record(ctx, ddp->dev, TSYS_STREAM_COMPUTE, &b->ev_ready);
        tsys_event_wait(ctx, &b->ev_ready, TSYS_STREAM_SIDE);
        tsys_event_record(ctx, ddp->dev, TSYS_STREAM_SIDE, &b->ev_start);
    }
    b->work = tsys_dist_all_reduce_async(ddp->d, b->flat, TSYS_DIST_AVG);
    if (!b->work) return tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_INVALID_ARGS;
    if (ddp->gpu_timing) tsys_event_record(ctx, ddp->dev, TSYS_STREAM_SIDE, &b->ev_end);
    return tsys_ctx_status(ctx);
}

static tsys_status tsys__ddp_wait(tsys_ddp *ddp, int bi) {
    tsys__ddp_bucket *b = &ddp->b[bi];
    tsys_ctx *ctx = ddp->ctx;
    if (!b->work) return TSYS_OK;
    tsys_status st = tsys_dist_wait(b->work);
    b->work = NULL;
    if (st == TSYS_OK && b->scratch) {
        tsys_tensor **p = ddp->tp + b->first;
        size_t off = 0;
        for (int i = 0; st == TSYS_OK && i < b->count; i++) {
            int64_t n = tsys_tensor_numel(p[i]);
            tsys_tensor *v = tsys_tensor_view_raw(ctx, b->flat, off, b->flat->dtype, 1, &n);
            st = v ? tsys_tensor_copy_from(ctx, p[i]->grad, v) : tsys_ctx_status(ctx);
            tsys_tensor_release(v);
            off += tsys_tensor_bytes(p[i]->grad);
        }
    }
    return st;
}

// The gradient-ready hook: the bucket of this parameter goes once its last gradient is final.
// No synchronization here (the launch is asynchronous), so a captured CUDA graph keeps working.
static void tsys__ddp_grad_ready(tsys_ctx *ctx, tsys_tensor *param, void *user) {
    (void)ctx; (void)param;
    tsys__ddp_hook *h = (tsys__ddp_hook *)user;
    tsys_ddp *ddp = h->ddp;
    int bi = ddp->bucket_of[h->index];
    tsys__ddp_bucket *b = &ddp->b[bi];
    if (b->launched || b->pending <= 0) return;   // a second backward before finish: finish sorts it out
    if (--b->pending == 0) {
        tsys_status st = tsys__ddp_launch(ddp, bi);
        if (st != TSYS_OK && ddp->launch_error == TSYS_OK) ddp->launch_error = st;
    }
}

static void tsys__ddp_reset(tsys_ddp *ddp) {
    for (int i = 0; i < ddp->nb; i++) { ddp->b[i].pending = ddp->b[i].count; ddp->b[i].launched = false; }
    ddp->nlaunched = 0;
    ddp->launch_error = TSYS_OK;
}

// Adds a bucket over tp[first .. first + count).
static bool tsys__ddp_add_bucket(tsys_ddp *ddp, int first, int count) {
    tsys__ddp_bucket *b = &ddp->b[ddp->nb];
    memset(b, 0, sizeof(*b));
    b->first = first; b->count = count;
    for (int i = first; i < first + count; i++) {
        ddp->bucket_of[i] = ddp->nb;
        b->numel += tsys_tensor_numel(ddp->tp[i]);
        b->bytes += (int64_t)tsys_tensor_bytes(ddp->tp[i]->grad);
    }
    tsys_tensor **p = ddp->tp + first;
    bool same_dtype = true;
    for (int i = 1; i < count; i++) same_dtype = same_dtype && p[i]->grad->dtype == p[0]->grad->dtype;
    if (count == 1) b->flat = tsys_tensor_retain(p[0]->grad);
    else if (tsys__dist_contiguous(p, count, true)) b->flat = tsys__dist_run_view(ddp->ctx, p, count, true);
    else if (same_dtype) {
        int tag = tsys_mem_set_tag(ddp->ctx, tsys_mem_tag(ddp->ctx, "ddp buckets"));
        b->flat = tsys_tensor_new(ddp->ctx, p[0]->grad->dtype, ddp->dev, 1, &b->numel);
        tsys_mem_set_tag(ddp->ctx, tag);
        b->scratch = true;
    } else {
        tsys_ctx_set_error(ddp->ctx, TSYS_ERR_INVALID_ARGS, "ddp: a bucket holds gradients of different dtypes (%s and ...); use one dtype or a smaller bucket", tsys_dtype_name(p[0]->grad->dtype));
        return false;
    }
    if (!b->flat) return false;
    b->pending = count;
    ddp->nb++;
    return true;
}

// Gives trainable parameters without a gradient one: views of one arena when they share a dtype
// and a device, else a tensor each. Filled with zeros and marked zero.
static tsys_status tsys__ddp_make_grads(tsys_ddp *ddp) {
    tsys_ctx *ctx = ddp->ctx;
    int missing = 0;
    int64_t total = 0;
    bool one_dtype = true;
    tsys_dtype dt = TSYS_F32;
    for (int i = 0; i < ddp->ntp; i++) {
        if (ddp->tp[i]->grad) continue;
        if (missing == 0) dt = ddp->tp[i]->dtype;
        one_dtype = one_dtype && ddp->tp[i]->dtype == dt;
        missing++;
        total += tsys_tensor_numel(ddp->tp[i]);
    }
    if (missing == 0) return TSYS_OK;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "grad"));
    tsys_status st = TSYS_OK;
    if (one_dtype) {
        ddp->grad_arena = tsys_tensor_new(ctx, dt, ddp->dev, 1, &total);
        if (ddp->grad_arena) { tsys_tensor_set_name(ddp->grad_arena, "ddp gradients"); st = tsys_tensor_fill(ctx, ddp->grad_arena, 0.0f); }
        else st = tsys_ctx_status(ctx);
    }
    size_t off = 0;
    for (int i = 0; st == TSYS_OK && i < ddp->ntp; i++) {
        tsys_tensor *p = ddp->tp[i];
        if (p->grad) continue;
        tsys_tensor *g = one_dtype ? tsys_tensor_view_raw(ctx, ddp->grad_arena, off, p->dtype, p->ndim, p->shape)
                                   : tsys_tensor_new(ctx, p->dtype, p->device, p->ndim, p->shape);
        if (g && !one_dtype) st = tsys_tensor_fill(ctx, g, 0.0f);
        if (!g) { st = tsys_ctx_status(ctx); break; }
        tsys_tensor_set_name(g, "%s.grad", p->name);
        p->grad = g;
        p->grad_zero = true;
        off += tsys_tensor_bytes(g);
    }
    tsys_mem_set_tag(ctx, tag);
    return st;
}

TSYSDEF void tsys_ddp_free(tsys_ddp *ddp) {
    if (!ddp) return;
    for (int i = 0; i < ddp->nb; i++) if (ddp->b[i].work) tsys_dist_wait(ddp->b[i].work);
    if (ddp->hooked)
        for (int i = 0; i < ddp->ntp; i++) tsys_tensor_remove_grad_hook(ddp->tp[i], tsys__ddp_grad_ready, &ddp->hooks[i]);
    for (int i = 0; i < ddp->nb; i++) {
        tsys__ddp_bucket *b = &ddp->b[i];
        tsys_tensor_release(b->flat);
        tsys_event_release(ddp->ctx, &b->ev_ready); tsys_event_release(ddp->ctx, &b->ev_start); tsys_event_release(ddp->ctx, &b->ev_end);
    }
    tsys_event_release(ddp->ctx, &ddp->ev_bwd_end);
    for (int i = 0; i < ddp->n; i++) tsys_tensor_release(ddp->params[i]);
    tsys_tensor_release(ddp->grad_arena);
    TSYS__DIST_RELEASE(ddp->params); TSYS__DIST_RELEASE(ddp->tp); TSYS__DIST_RELEASE(ddp->bucket_of);
    TSYS__DIST_RELEASE(ddp->hooks); TSYS__DIST_RELEASE(ddp->b); TSYS__DIST_RELEASE(ddp->order);
    TSYS__DIST_RELEASE(ddp);
}

TSYSDEF tsys_ddp *tsys_ddp_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_ddp_desc *desc) {
    if (!d) return NULL;
    tsys_ctx *ctx = tsys_dist_ctx(d);
    if (tsys_ctx_status(ctx) != TSYS_OK) return NULL;
    tsys_ddp_desc dd;
    memset(&dd, 0, sizeof(dd));
    if (desc) dd = *desc;
    if (n < 0 || (n > 0 && !params)) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: %d parameters and %s list", n, params ? "a" : "no"); return NULL; }
    if ((unsigned)dd.strategy > TSYS_DDP_BUCKETED) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: unknown strategy %d", (int)dd.strategy); return NULL; }
    if (!(dd.bucket_mb >= 0) || !isfinite(dd.bucket_mb)) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: bucket_mb %g must be finite and >= 0", dd.bucket_mb); return NULL; }
    for (int i = 0; i < n; i++) {
        if (!params[i]) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: parameter %d is NULL", i); return NULL; }
        if (params[i]->device != params[0]->device) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: parameters '%s' and '%s' are on different devices", params[0]->name, params[i]->name); return NULL; }
    }
    tsys_ddp *ddp = (tsys_ddp *)TSYS__DIST_ALLOC(sizeof(tsys_ddp));
    if (!ddp) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "ddp: out of host memory"); return NULL; }
    memset(ddp, 0, sizeof(*ddp));
    ddp->d = d; ddp->ctx = ctx; ddp->desc = dd;
    ddp->dev = n ? params[0]->device : TSYS_CPU;
    size_t cnt = (size_t)(n ? n : 1);
    ddp->params = (tsys_tensor **)TSYS__DIST_ALLOC(sizeof(tsys_tensor *) * cnt);
    ddp->tp = (tsys_tensor **)TSYS__DIST_ALLOC(sizeof(tsys_tensor *) * cnt);
    ddp->bucket_of = (int *)TSYS__DIST_ALLOC(sizeof(int) * cnt);
    ddp->hooks = (tsys__ddp_hook *)TSYS__DIST_ALLOC(sizeof(tsys__ddp_hook) * cnt);
    ddp->b = (tsys__ddp_bucket *)TSYS__DIST_ALLOC(sizeof(tsys__ddp_bucket) * cnt);
    ddp->order = (int *)TSYS__DIST_ALLOC(sizeof(int) * cnt);
    if (!ddp->params || !ddp->tp || !ddp->bucket_of || !ddp->hooks || !ddp->b || !ddp->order) {
        tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "ddp: out of host memory");
        tsys_ddp_free(ddp);
        return NULL;
    }
    for (int i = 0; i < n; i++) {   // a tensor listed twice (tied weights) counts once
        bool seen = false;
        for (int j = 0; j < ddp->n && !seen; j++) seen = ddp->params[j] == params[i];
        if (seen) continue;
        ddp->params[ddp->n++] = tsys_tensor_retain(params[i]);
        if (params[i]->requires_grad) ddp->tp[ddp->ntp++] = params[i];
    }
    // every parameter from rank 0, trainable or not (back-to-back runs in one call)
    tsys_status st = tsys__dist_broadcast_list(d, ddp->params, ddp->n, 0);
    if (st == TSYS_OK) st = tsys__ddp_make_grads(ddp);
    // buckets in reverse parameter order
    if (st == TSYS_OK && ddp->ntp > 0) {
        if (dd.strategy == TSYS_DDP_FLAT) { if (!tsys__ddp_add_bucket(ddp, 0, ddp->ntp)) st = TSYS_ERR_INVALID_ARGS; }
        else if (dd.strategy == TSYS_DDP_BUCKETED) {
            double limit = dd.bucket_mb * 1048576.0;
            int end = ddp->ntp;   // the open bucket is tp[i + 1 .. end)
            double bytes = 0;
            for (int i = ddp->ntp - 1; st == TSYS_OK && i >= 0; i--) {
                double sz = (double)tsys_tensor_bytes(ddp->tp[i]);
                if (end > i + 1 && limit > 0 && bytes + sz > limit) {
                    if (!tsys__ddp_add_bucket(ddp, i + 1, end - i - 1)) st = TSYS_ERR_INVALID_ARGS;
                    end = i + 1; bytes = 0;
                }
                bytes += sz;
            }
            if (st == TSYS_OK && !tsys__ddp_add_bucket(ddp, 0, end)) st = TSYS_ERR_INVALID_ARGS;
        } else {
            for (int i = ddp->ntp - 1; st == TSYS_OK && i >= 0; i--)
                if (!tsys__ddp_add_bucket(ddp, i, 1)) st = TSYS_ERR_INVALID_ARGS;
        }
        if (st != TSYS_OK && tsys_ctx_status(ctx) != TSYS_OK) st = tsys_ctx_status(ctx);
    }
    if (st == TSYS_OK && (dd.strategy == TSYS_DDP_OVERLAP || dd.strategy == TSYS_DDP_BUCKETED)) {
        ddp->hooked = true;
        for (int i = 0; i < ddp->ntp; i++) {
            ddp->hooks[i].ddp = ddp; ddp->hooks[i].index = i;
            tsys_tensor_add_grad_hook(ddp->tp[i], tsys__ddp_grad_ready, &ddp->hooks[i]);
        }
    }
    if (st != TSYS_OK || tsys_ctx_status(ctx) != TSYS_OK) {
        if (tsys_ctx_status(ctx) == TSYS_OK) tsys_ctx_set_error(ctx, st, "ddp: setup failed (%s)", tsys_status_str(st));
        tsys_ddp_free(ddp);
        return NULL;
    }
    ddp->stats.num_buckets = ddp->nb;
    for (int i = 0; i < ddp->nb; i++) {
        ddp->stats.bytes_per_step += ddp->b[i].bytes;
        ddp->stats.copied_buckets += ddp->b[i].scratch;
    }
    return ddp;
}

// Waits for whatever is in flight (a step that never reached finish) and re-arms the buckets.
TSYSDEF tsys_status tsys_ddp_start_step(tsys_ddp *ddp) {
    if (!ddp) return TSYS_ERR_INVALID_ARGS;
    tsys_status st = TSYS_OK;
    for (int k = 0; k < ddp->nlaunched; k++) {
        tsys_status s = tsys__ddp_wait(ddp, ddp->order[k]);
        if (st == TSYS_OK) st = s;
    }
    tsys__ddp_reset(ddp);
    return st;
}

TSYSDEF tsys_status tsys_ddp_finish(tsys_ddp *ddp) {
    if (!ddp) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = ddp->ctx;
    tsys_status st = ddp->launch_error != TSYS_OK ? ddp->launch_error : tsys_ctx_status(ctx);
    ddp->t_bwd_end_us = tsys_time_us();
    bool timing = tsys__ddp_gpu_timing(ddp->d, ctx, ddp->dev);
    if (timing) tsys_event_record(ctx, ddp->dev, TSYS_STREAM_COMPUTE, &ddp->ev_bwd_end);
    if (ddp->nlaunched == 0) ddp->gpu_timing = timing;
    bool blocking = ddp->desc.strategy == TSYS_DDP_NAIVE;   // one all-reduce at a time
    for (int i = 0; st == TSYS_OK && i < ddp->nb; i++) {
        if (ddp->b[i].launched) continue;
        st = tsys__ddp_launch(ddp, i);
        if (st == TSYS_OK && blocking) st = tsys__ddp_wait(ddp, i);
    }
    for (int k = 0; k < ddp->nlaunched; k++) {   // in launch order; after an error, still drain
        tsys_status s = tsys__ddp_wait(ddp, ddp->order[k]);
        if (st == TSYS_OK) st = s;
    }
    ddp->t_done_us = tsys_time_us();
    if (ddp->nlaunched > 0) {
        double start = ddp->t_bwd_end_us > ddp->t_first_us ? ddp->t_bwd_end_us : ddp->t_first_us;
        ddp->stats.comm_ms = (ddp->t_done_us - ddp->t_first_us) * 1e-3;
        ddp->stats.exposed_ms = (ddp->t_done_us - start) * 1e-3;
    } else ddp->stats.comm_ms = ddp->stats.exposed_ms = 0;
    ddp->stats_launched = ddp->nlaunched;   // CUDA times are read from this step's events by stats_get
    tsys__ddp_reset(ddp);
    return st;
}

TSYSDEF tsys_ddp_stats tsys_ddp_stats_get(const tsys_ddp *ddp) {
    tsys_ddp_stats s;
    memset(&s, 0, sizeof(s));
    if (!ddp) return s;
    s = ddp->stats;
    if (ddp->gpu_timing && ddp->stats_launched > 0) {   // side-stream busy time and what ran past backward
        double comm = 0, exposed = 0;
        for (int i = 0; i < ddp->nb; i++) {
            const tsys__ddp_bucket *b = &ddp->b[i];
            if (!b->ev_start.handle || !b->ev_end.handle) continue;
            double ms = tsys_event_elapsed_ms(ddp->ctx, &b->ev_start, &b->ev_end);
            if (ms == ms) comm += ms;
            double past = tsys_event_elapsed_ms(ddp->ctx, &ddp->ev_bwd_end, &b->ev_end);
            if (past == past && past > exposed) exposed = past;
        }
        s.comm_ms = comm;
        s.exposed_ms = exposed;
    }
    return s;
}

// >>zero1 -----------------------------------------------------------------------------------------
// Sharding: the trainable parameters, in parameter order, each to the rank that holds the fewest
// bytes so far (ties: the lowest rank) - greedy, deterministic, the same on every rank; a rank
// holds at most total/N + the largest parameter. Each rank runs a tsys_adamw over the parameters
// it owns (the same desc, so the same per-element math and step count as one unsharded AdamW:
// bit-for-bit equal), then every parameter is broadcast from its owner, a run of back-to-back
// parameters with one owner in one call. (A flat all-gather would need equal-sized shards: either
// parameters split across ranks or padded copies; broadcasts of runs send the same bytes.)

struct tsys_zero1 {
    tsys_dist *d;
    tsys_ctx *ctx;
    tsys_tensor **params;        // every parameter, retained
    int n;
    tsys_tensor **tp;            // trainable ones (borrowed)
    int ntp;
    int *owner;                  // per trainable parameter
    tsys_tensor **mine;          // the ones this rank owns
    int nmine;
    tsys_optim *opt;             // AdamW over `mine` (NULL when this rank owns none)
    int64_t state_bytes;
};

TSYSDEF void tsys_zero1_free(tsys_zero1 *z) {
    if (!z) return;
    tsys_optim_free(z->opt);
    for (int i = 0; i < z->n; i++) tsys_tensor_release(z->params[i]);
    TSYS__DIST_RELEASE(z->params); TSYS__DIST_RELEASE(z->tp); TSYS__DIST_RELEASE(z->owner); TSYS__DIST_RELEASE(z->mine);
    TSYS__DIST_RELEASE(z);
}

TSYSDEF tsys_zero1 *tsys_zero1_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_optim_desc *desc) {
    if (!d) return NULL;
    tsys_ctx *ctx = tsys_dist_ctx(d);
    if (tsys_ctx_status(ctx) != TSYS_OK) return NULL;
    if (n < 0 || (n > 0 && !params)) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "zero1: %d parameters and %s list", n, params ? "a" : "no"); return NULL; }
    for (int i = 0; i < n; i++)
        if (!params[i]) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "zero1: parameter %d is NULL", i); return NULL; }
    tsys_zero1 *z = (tsys_zero1 *)TSYS__DIST_ALLOC(sizeof(tsys_zero1));
    if (!z) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "zero1: out of host memory"); return NULL; }
    memset(z, 0, sizeof(*z));
    z->d = d; z->ctx = ctx;
    size_t cnt = (size_t)(n ? n : 1);
    int world = tsys_dist_size(d), rank = tsys_dist_rank(d);
    z->params = (tsys_tensor **)TSYS__DIST_ALLOC(sizeof(tsys_tensor *) * cnt);
    z->tp = (tsys_tensor **)TSYS__DIST_ALLOC(sizeof(tsys_tensor *) * cnt);
    z->mine = (tsys_tensor **)TSYS__DIST_ALLOC(sizeof(tsys_tensor *) * cnt);
    z->owner = (int *)TSYS__DIST_ALLOC(sizeof(int) * cnt);
    double *load = (double *)TSYS__DIST_ALLOC(sizeof(double) * (size_t)(world > 0 ? world : 1));
    if (!z->params || !z->tp || !z->mine || !z->owner || !load) {
        TSYS__DIST_RELEASE(load);
        tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "zero1: out of host memory");
        tsys_zero1_free(z);
        return NULL;
    }
    for (int r = 0; r < world; r++) load[r] = 0;
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int j = 0; j < z->n && !seen; j++) seen = z->params[j] == params[i];
        if (seen) continue;
        z->params[z->n++] = tsys_tensor_retain(params[i]);
        if (!params[i]->requires_grad) continue;   // never updated: no state, no broadcast
        int best = 0;
        for (int r = 1; r < world; r++) if (load[r] < load[best]) best = r;
        load[best] += (double)tsys_tensor_bytes(params[i]);
        z->owner[z->ntp] = best;
        z->tp[z->ntp++] = params[i];
        if (best == rank) {
            z->mine[z->nmine++] = params[i];
            z->state_bytes += 2 * (int64_t)tsys_tensor_numel(params[i]) * 4;   // m and v, fp32
        }
    }
    TSYS__DIST_RELEASE(load);
    if (z->nmine > 0) z->opt = tsys_adamw_new(ctx, z->mine, z->nmine, desc);
    if ((z->nmine > 0 && !z->opt) || tsys_ctx_status(ctx) != TSYS_OK) { tsys_zero1_free(z); return NULL; }
    return z;
}

TSYSDEF tsys_status tsys_zero1_step(tsys_zero1 *z) {
    if (!z) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = z->ctx;
    if (tsys_ctx_status(ctx) != TSYS_OK) return tsys_ctx_status(ctx);
    tsys_status st = z->opt ? tsys_optim_step(z->opt) : TSYS_OK;
    // each run of back-to-back parameters with one owner: one broadcast from the owner
    for (int i = 0; st == TSYS_OK && i < z->ntp;) {
        int j = i + 1;
        while (j < z->ntp && z->owner[j] == z->owner[i] && tsys__dist_contiguous(z->tp + i, j - i + 1, false)) j++;
        st = tsys__dist_broadcast_list(z->d, z->tp + i, j - i, z->owner[i]);
        i = j;
    }
    return st;
}

TSYSDEF void tsys_zero1_zero_grad(tsys_zero1 *z) { if (z) tsys_zero_grads(z->ctx, z->params, z->n); }
TSYSDEF int64_t tsys_zero1_local_state_bytes(const tsys_zero1 *z) { return z ? z->state_bytes : 0; }

// >>accounting ------------------------------------------------------------------------------------
// Bytes per rank, Ψ = parameters (tsys_model_desc_num_params), N = world, E = batch x context
// tokens per rank, d = d_model, f = d_ff, H = heads, T = context, V = vocab, L = layers,
// c = 4 (fp32) or 2 (bf16/fp16 autocast), Ψmm = the matmul weights L(4d² + 3df) + Vd (every
// linear's weight and the lm_head; the embedding is not cast):
//   parameters   4Ψ fp32 masters; under autocast + cΨmm, the low-precision copies tsys caches for
//                the step (linear saves them for backward, so they live until its backward)
//   gradients    4Ψ (fp32, one arena)
//   optimizer    8Ψ (AdamW m and v, fp32)
//   ZeRO-1: optimizer / N;  ZeRO-2: + gradients / N;  ZeRO-3: + parameters / N (the ZeRO paper's
//   Ψ(2 + 2 + K) / N split, with tsys's 4 + 4 + 8 bytes)
//   activations  what the forward saves for backward (read off tsys's ops), per layer:
//       two rmsnorms: x (fp32) 4Ed + rstd 4E, each
//       attention input: fp32 one saved h, 4Ed; autocast: q, k, v each save their own cast, 3cEd
//       attention: naive q, k (QKᵀ), v (PV) 3cEd + softmax output c·B·H·T²;
//                  flash q, k, v, O 4cEd + lse 4·B·H·T
//       output projection input cEd
//       FFN input: fp32 4Ed shared by w1 and w3; autocast two casts, 2cEd
//       SwiGLU a, b and the w2 input s: 3cEf
//     plus the final rmsnorm (4Ed + 4E), the lm_head input (fp32 4Ed, autocast cEd), the logits
//     kept by cross-entropy cEV and its lse 4E, and the logits' gradient cEV that backward makes
//     first while they are still held (the peak of the step is there for V > H·T).
//   The same for every scheme (activations are not sharded here).
// Bytes sent per rank per step (ring algorithms; gradients are all-reduced in fp32):
//   DDP      all-reduce of the gradients: 2(N-1)/N · 4Ψ
//   ZeRO-1   as tsys implements it: the DDP all-reduce, then every parameter broadcast from its
//            owner (a ring/pipelined broadcast of S bytes has the N-1 non-last ranks send S:
//            (N-1)/N · S per rank on average): 2(N-1)/N · 4Ψ + (N-1)/N · 4Ψ = 3(N-1)/N · 4Ψ
//   ZeRO-2   (on paper) reduce-scatter of the gradients + all-gather of the parameters: 2(N-1)/N · 4Ψ
//   ZeRO-3   (on paper) reduce-scatter + an all-gather of the parameters in forward and again in
//            backward: 3(N-1)/N · 4Ψ

TSYSDEF const char *tsys_dist_scheme_name(tsys_dist_scheme s) {
    switch (s) {
    case TSYS_SCHEME_DDP: return "ddp";
    case TSYS_SCHEME_ZERO1: return "zero1";
    case TSYS_SCHEME_ZERO2: return "zero2";
    case TSYS_SCHEME_ZERO3: return "zero3";
    }
    return "unknown";
}

TSYSDEF tsys_dist_account tsys_dist_accounting(const tsys_model_desc *m, tsys_dtype dtype, int batch, int context, int world, tsys_dist_scheme scheme) {
    tsys_dist_account a;
    memset(&a, 0, sizeof(a));
    tsys_model_desc d = tsys_model_desc_defaults(m);
    double N = world > 0 ? world : 1;
    double P = (double)tsys_model_desc_num_params(&d);
    double dm = d.d_model, f = d.d_ff, H = d.num_heads, V = d.vocab_size, L = d.num_layers;
    double B = batch > 0 ? batch : 0, T = context > 0 ? context : 0, E = B * T;
    bool ac = dtype == TSYS_BF16 || dtype == TSYS_F16;
    double c = ac ? 2.0 : 4.0;
    double Pmm = L * (4 * dm * dm + 3 * dm * f) + V * dm;
    a.param_bytes = 4 * P + (ac ? c * Pmm : 0);
    a.grad_bytes = 4 * P;
    a.optim_bytes = 8 * P;
    if (scheme >= TSYS_SCHEME_ZERO1) a.optim_bytes /= N;
    if (scheme >= TSYS_SCHEME_ZERO2) a.grad_bytes /= N;
    if (scheme >= TSYS_SCHEME_ZERO3) a.param_bytes /= N;
    bool flash = d.attn && strcmp(d.attn, "flash") == 0;
    double layer = 2 * (4 * E * dm + 4 * E)                                     // two rmsnorms: x, rstd
                 + (ac ? 3 * c : 4) * E * dm                                     // q, k, v inputs
                 + (flash ? 4 * c * E * dm + 4 * B * H * T : 3 * c * E * dm + c * B * H * T * T)
                 + c * E * dm                                                    // output projection input
                 + (ac ? 2 * c : 4) * E * dm                                     // w1, w3 input
                 + 3 * c * E * f;                                                // a, b, s
    a.act_bytes = L * layer + (4 * E * dm + 4 * E) + (ac ? c : 4) * E * dm + c * E * V + 4 * E + c * E * V;
    a.total_bytes = a.param_bytes + a.grad_bytes + a.optim_bytes + a.act_bytes;
    double ring = (N - 1) / N, G = 4 * P;
    switch (scheme) {
    case TSYS_SCHEME_DDP: a.sent_bytes = 2 * ring * G; break;
    case TSYS_SCHEME_ZERO1: a.sent_bytes = 3 * ring * G; break;
    case TSYS_SCHEME_ZERO2: a.sent_bytes = 2 * ring * G; break;
    case TSYS_SCHEME_ZERO3: a.sent_bytes = 3 * ring * G; break;
    }
    return a;
}

#endif // TSYS_DIST_IMPLEMENTATION
