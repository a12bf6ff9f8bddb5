/* tsys_cuda.cuh - v0.3 - the CUDA backend of tsys: kernels, cuBLASLt GEMMs, FlashAttention-2, caching
   allocator, CUDA graphs

   Do this:
      #define TSYS_CUDA_IMPLEMENTATION      (or TSYS_IMPL, which turns on every tsys implementation)
   before you include this file in *one* file compiled by nvcc (-x cu) to create the implementation.

      #define TSYS_IMPLEMENTATION
      #define TSYS_CUDA_IMPLEMENTATION
      #include "tsys_cuda.cuh"               // includes tsys.h itself

      nvcc -x cu -std=c++17 -O2 -gencode arch=compute_90a,code=sm_90a main.c -lcublasLt -lcublas

   (sm_90a, not sm_90: the Hopper FlashAttention kernels use wgmma, TMA and setmaxnreg, which only an
   arch-specific target compiles; any other target keeps the mma.sync FlashAttention kernels.)

   The declarations are plain C (no CUDA types), so C files may include this header and call
   tsys_cuda_init() while one nvcc-compiled file holds the implementation.

   Optional defines (before the include, in the implementation file):
      TSYS_CUDA_WORKSPACE_BYTES   default cuBLASLt workspace (32 MiB, what cuBLAS asks for on Hopper);
                                  tsys_cuda_desc.workspace_bytes overrides it per context
      TSYS_CUDA_GEMM_CACHE        slots of the per-shape GEMM plan cache (default 512, a power of two)
      TSYS_CUDA_NO_NVTX           make tsys_cuda_range_push/pop do nothing
      TSYS_CUDA_NO_FLASH          leave the FlashAttention kernels out (>>flash: a third of the build time);
                                  TSYS_K_FLASH_FWD/BWD then fail with TSYS_ERR_UNSUPPORTED
      TSYS_CUDA_NO_CUPTI          profiles time kernels with CUDA events only (no libcupti at run time)
      TSYS_MALLOC/TSYS_FREE/TSYS_REALLOC   host allocator, as in tsys.h (all three or none)

   Environment (read in one place, tsys_cuda__env_apply, once by tsys_cuda_init_desc, over the desc):
      TSYS_FLASH_NO_WS=1          desc.flash AUTO -> WGMMA: FlashAttention without the warp-specialized TMA
                                  kernels (MMA where wgmma cannot run)
      TSYS_FLASH_NO_WGMMA=1       desc.flash AUTO -> MMA: FlashAttention on the mma.sync kernels
      TSYS_FLASH_NONDETERMINISTIC=1  desc.flash_nondeterministic: the fused backward's dQ adds in arrival order
      TSYS_NO_CUPTI               (set at all) desc.no_cupti: profiles time kernels with CUDA events
      TSYS_PROFILER_DEBUG         (set at all) desc.profiler_debug: profiles report CUPTI's record mapping

   Sections (search for the tag, e.g. ">>flash launchers"); what each defines:
      >>public                    the API: tsys_cuda_desc, init/shutdown, setters, memory info, graphs, profiler
      >>checks                    TSYS_CUDA__CHECK and friends: a failing CUDA/cuBLASLt call -> context error
      >>state                     tsys_cuda__state (one context's backend), the fault record, tsys_cuda__get
      >>hash map                  tsys_cuda__map: open-addressing uint64 -> uint64 (allocator indexes)
      >>memory                    the caching allocator: size classes, free lists, graph pools, scratch
      >>device helpers            dtype loads/stores (fp32 <-> bf16/fp16), warp and block reductions
      >>launch helpers            tsys_cuda__launch, grid sizes, the elementwise argument packs
      >>elementwise               the generic elementwise kernels (fill, cast, add, mul, activations, ...)
      >>reductions                SUM, SUMSQ, MSE and column sums: fixed-order two-stage reductions
      >>norms                     RMSNorm / LayerNorm forward and backward, deterministic weight grads
      >>rope                      rotary embeddings, forward and backward
      >>softmax                   row softmax forward and backward, register and shared-memory variants
      >>cross entropy             fused softmax + cross-entropy loss and its gradient; bad-id records
      >>embedding                 embedding lookup and its deterministic backward
      >>transpose                 (A, B, C, D) -> (A, C, B, D) copies
      >>flash                     FlashAttention-2: overview, tile configurations, shared helpers
      >>flash ptx                 inline PTX: mma.sync, ldmatrix, cp.async, mbarriers, TMA, wgmma
      >>flash mma.sync            the mma.sync forward / backward kernels (any sm_80+), the row-sum pre-pass
      >>flash fp32                the exact fp32 SIMT kernels (desc.flash_fp32_exact)
      >>flash wgmma               the cp.async + wgmma kernels (sm_90a) and the templated wgmma wrapper
      >>flash warp-specialized    the TMA + wgmma kernels (sm_90a): forward, dQ, dK/dV, fused backward
      >>flash launchers           launchers, split and pad plans, scratch sizes, tsys_cuda__flash_fwd/_bwd
      >>fused update              AdamW in the epilogue of a weight-gradient GEMM (TMA + wgmma, sm_90a): TSYS_K_LINEAR_ADAMW
      >>kernel entry points       tsys_cuda__kernel: every TSYS_K_* checked and launched
      >>gemm                      cuBLASLt GEMMs with the per-shape plan cache
      >>copy and sync             host/device copies, tsys_sync, bad-id faults surfaced
      >>events                    the tsys_event pool (record, wait, elapsed)
      >>init                      tsys_cuda_init_desc, the environment, get_desc, setters, shutdown
      >>memory (public)           tsys_cuda_mem_info, memory limit, cache release
      >>graphs                    tsys_cuda_graph_begin/end/launch/free
      >>nvtx                      NVTX ranges through the trace hooks (domain "tsys", registered names)
      >>profiler clock            device times for the profiler: CUPTI (the one process-wide static) or events

   tsys_cuda DOES NOT:
      - call cudaMalloc or cudaFree in the steady state: freed blocks go to size-class free lists of
        a caching allocator and come back for the next request of that class
      - copy device scalars to the host inside kernels (the loss, dloss, norms stay on the device), so
        a whole training step can be captured as one CUDA graph
      - keep global state: stream, cuBLASLt handle, workspace, allocator, plan cache and the choice of
        FlashAttention kernels live in the backend state of one tsys_ctx; two contexts (even on two
        devices) coexist (the one process-wide thing is the driver's TMA encoder, looked up once)

   Quick start:

      tsys_ctx *ctx = tsys_ctx_new(NULL);
      if (tsys_cuda_init(ctx, 0) != TSYS_OK) { puts(tsys_ctx_last_error(ctx)); return 1; }
      // or, in C: tsys_cuda_init_desc(ctx, &(tsys_cuda_desc){ .device = 0, .flash = TSYS_CUDA_FLASH_MMA });
      tsys_model *m = tsys_model_new(ctx, &desc, TSYS_CUDA, 1234);
      ... same code as on the CPU ...
      tsys_model_free(m);            // release every CUDA tensor first,
      tsys_cuda_shutdown(ctx);       // then the backend,
      tsys_ctx_free(ctx);            // then the context

   ON MEMORY
      Requests are rounded up to 512 B (up to 1 MiB) or to 2 MiB (larger) and served from a free list
      of exactly that size class; a miss calls cudaMalloc. When cudaMalloc fails, every cached block
      is released (cudaFree) and the request is tried once more; if that fails too, alloc returns NULL
      (the tsys layer turns it into TSYS_ERR_OOM). tsys_cuda_set_memory_limit caps the reserved bytes,
      so out-of-memory paths can be tested and sweeps can mimic a smaller card.

   ON CUDA GRAPHS
      tsys_cuda_graph_begin() starts capturing the backend stream; every kernel, GEMM and device-to-
      device copy issued until tsys_cuda_graph_end() is recorded, not run. Blocks allocated or freed
      while capturing belong to the graph's private pool until tsys_cuda_graph_free(), so tensors
      made between replays never alias memory the graph writes. Host<->device copies and syncs are
      errors while capturing. Replays bake in every host scalar of the captured calls (the learning
      rate unless it is given as a device tensor: see TSYS_K_ADAMW below).

   ON PRECISION
      Kernels load F32/BF16/F16, compute in fp32 and round to nearest even on store. GEMMs accumulate
      in fp32 (CUBLAS_COMPUTE_32F); tsys_cuda_set_tf32(ctx, true) lets fp32 GEMMs use TF32 tensor cores.
      Reductions (SUM, SUMSQ, MSE, CE loss, RMSNorm/LayerNorm weight grads, bias grads, embedding
      grads) are deterministic: fixed block counts and fixed summation orders, no float atomics.

   ON STREAMS AND EVENTS
      Two streams per context: compute (where ops run) and side (communication, overlapped work);
      tsys_set_stream(ctx, TSYS_CUDA, s) picks where later launches go, tsys_event_record/wait order
      them, tsys_event_elapsed_ms times them (cudaEvents from a pool). tsys_sync waits for both. The
      caching allocator is not stream-aware: order side-stream users of freed memory with an event.

   ON BAD IDS
      Embedding and cross-entropy kernels never read or write out of bounds for an id outside [0, V);
      they note the first such id in a mapped host record, and the next synchronization (tsys_sync, a
      device-to-host copy, an event's elapsed time) turns it into the context's error.

   ON FLASH ATTENTION
      TSYS_K_FLASH_FWD/BWD (tsys_flash_attention) run the >>flash section: FlashAttention-2 for fp32, bf16
      and fp16 at head dims 16, 32, 64, 80, 96, 128, any sequence length, causal or not, a deterministic
      backward (no atomics). bf16/fp16 at d = 64 and 128 have three implementations (tsys_cuda_flash_impl):
      warp-specialized TMA + wgmma kernels (WS), cp.async + wgmma kernels (WGMMA), both sm_90a-only, and
      mma.sync kernels (MMA, everywhere). AUTO takes the first this binary and device can run; desc.flash
      or tsys_cuda_set_flash_impl pick one per context, and asking for one that cannot run is an error.

   ON ADAMW AND GRAPHS
      TSYS_K_ADAMW reads the step count from its device tensor t[4], so a captured optimizer step
      replays the right bias corrections; tsys_optim gives it those corrections too (t[8], written
      by the step's TSYS_K_STEP_INC), so its threads skip the powers and cover the arrays one group
      of four each. Extension of the tsys.h contract: t[5], when given, is a
      one-element fp32 device tensor holding lr and overriding f[0] (a learning-rate schedule that
      also survives graph replay). t[6], when given (tsys_optim_keep_lowp), is the parameter's kept
      bf16/fp16 copy, written beside p, m and v in the same pass: a captured step's forward reads the
      copies that the captured AdamW of the replay before wrote, and no weight is cast in the graph.
      AdamW has a kernel of its own (not the generic elementwise one), with one site computing the
      update, so the fp32 results are the same bits with the copy written or not.
      TSYS_K_LINEAR_ADAMW (tsys_optim_overlap_begin_ex's TSYS_OPTIM_FUSE_UPDATE) runs that update in the
      epilogue of the weight-gradient product on sm_90a (>>fused update: tiles of 128 x 128, the update of
      one tile beside the product of the next); elsewhere, and for shapes under a tile, the product into a
      gradient and TSYS_K_ADAMW on it. The update's bits follow from the gradient the product gives, which
      sums in another order than cuBLASLt's.

   Revision history:
      0.3  the kernel lab (dev/flash_lab.cu) uses the public API only: tsys_cuda_desc.flash_no_pdl and
           flash_no_fused (with setters) replace the lab's static switches; TSYS_NO_CUPTI and
           TSYS_PROFILER_DEBUG are desc fields (no_cupti, profiler_debug) that the environment sets, read
           with the flash overrides in one place at init; the lab-only tile and turn variants are gone
      0.2  FlashAttention-2 as the >>flash section (mma.sync, fp32 SIMT, wgmma and warp-specialized TMA
           kernels; one templated wgmma wrapper; TSYS_CUDA_NO_FLASH); tsys_cuda_desc with
           tsys_cuda_init_desc / tsys_cuda_get_desc; the flash implementation is per context
           (tsys_cuda_set_flash_impl) instead of environment switches read by the kernels; host
           allocations through TSYS_MALLOC/TSYS_REALLOC/TSYS_FREE
      0.1  first release: every tsys kernel but flash attention, cuBLASLt GEMM with a plan cache,
           caching allocator with graph pools, CUDA graphs, NVTX ranges

   License: MIT, see the end of tsys.h.
*/
#ifndef TSYS_CUDA_H_INCLUDED
#define TSYS_CUDA_H_INCLUDED
#define TSYS_CUDA_VERSION_MAJOR 0
#define TSYS_CUDA_VERSION_MINOR 3
#define TSYS_CUDA_VERSION_PATCH 0

#include "tsys.h"

#ifdef __cplusplus
extern "C" {
#endif

// >>public ----------------------------------------------------------------------------------------

typedef struct tsys_cuda_graph tsys_cuda_graph;

// What the caching allocator holds. reserved = bytes obtained from cudaMalloc (in use + cached);
// allocated = bytes handed out and not yet freed (rounded sizes).
typedef struct tsys_cuda_mem_info {
    size_t reserved_bytes;
    size_t allocated_bytes;
    size_t cached_bytes;           // reserved - allocated
    size_t peak_reserved_bytes;
    int64_t num_device_mallocs;    // cudaMalloc calls so far (a steady state adds none)
    int64_t num_device_frees;      // cudaFree calls so far
    int64_t num_allocs;            // requests served
    int64_t num_cache_hits;        // requests served from a free list
    int64_t num_ooms;              // requests that returned NULL
} tsys_cuda_mem_info;

// Which FlashAttention kernels bf16/fp16 attention at head dims 64 and 128 runs (every other head dim has one
// implementation: mma.sync tensor cores; fp32 has two, chosen by desc.flash_fp32_exact, and its TF32 forward
// at d = 64 and 128 runs warp-specialized under WS, and under AUTO from 2048 rows; bf16/fp16 at d = 16, 32 run
// zero-padded on the d = 64 kernels, d = 80 and 96 on the d = 128 ones, under WS, and under AUTO on long sequences:
// tsys_cuda__flash_pad).
//   AUTO   the fastest this binary and device can run: WS, else WGMMA, else MMA; a call whose inputs TMA
//          cannot read (not 16-byte aligned) runs WGMMA instead of WS
//   WS     warp-specialized forward, dQ and dK/dV (TMA producer warpgroup, wgmma consumers);
//          a call whose inputs TMA cannot read fails (TSYS_ERR_UNSUPPORTED)
//   WGMMA  Hopper wgmma kernels with cp.async loads
//   MMA    mma.sync kernels (sm_80 and later)
// WS and WGMMA need a binary built for sm_90a (-gencode arch=compute_90a,code=sm_90a) on a Hopper GPU (and,
// for WS, a driver with TMA tensor maps); asking for one where it cannot run is an error, never a fallback.
typedef enum tsys_cuda_flash_impl {
    TSYS_CUDA_FLASH_AUTO = 0,
    TSYS_CUDA_FLASH_WS,
    TSYS_CUDA_FLASH_WGMMA,
    TSYS_CUDA_FLASH_MMA
} tsys_cuda_flash_impl;

// How tsys_cuda_init_desc sets the backend up. All fields 0 = default:
//   device           0           CUDA device id
//   flash            AUTO        FlashAttention implementation (tsys_cuda_flash_impl); with AUTO, the
//                                environment may steer it at init: TSYS_FLASH_NO_WGMMA=1 -> MMA,
//                                TSYS_FLASH_NO_WS=1 -> WGMMA (or MMA where wgmma cannot run)
//   tf32             false       fp32 GEMMs on TF32 tensor cores (tsys_cuda_set_tf32)
//   flash_fp32_exact false       fp32 FlashAttention multiplies on TF32 tensor cores (inputs rounded to 10-bit
//                                mantissas, fp32 accumulation: what Triton's tl.dot does with fp32 by default);
//                                true: in fp32 on CUDA cores, 10-30x slower (tsys_cuda_set_flash_fp32_exact)
//   workspace_bytes  32 MiB      cuBLASLt workspace (TSYS_CUDA_WORKSPACE_BYTES)
//   memory_limit     0 = none    cap on the caching allocator's reserved bytes (tsys_cuda_set_memory_limit)
//   nvtx             false       NVTX ranges for every op, backward node and range (tsys_cuda_set_nvtx)
//   flash_no_pdl     false       the warp-specialized backward launches its dK/dV kernel after the dQ kernel
//                                instead of in its tail (programmatic dependent launch): the same bits, for
//                                timing both (tsys_cuda_set_flash_no_pdl)
//   flash_no_fused   false       the warp-specialized backward never takes the fused (5-matmul) kernel (16-bit
//                                d 128, large grids) but its two 7-matmul kernels: the same results to rounding,
//                                for timing both (tsys_cuda_set_flash_no_fused)
//   flash_nondeterministic false the fused backward adds each key block's dQ part as soon as it is ready
//                                instead of in a fixed order: a 1-5% faster backward (H200, d 128, 32 x 32768
//                                and 16 x 16384), but dQ's last bits vary from run to run (tsys_cuda_set_flash_nondeterministic;
//                                env TSYS_FLASH_NONDETERMINISTIC=1)
//   no_cupti         false       profiles time kernels with CUDA events, not CUPTI (env TSYS_NO_CUPTI sets it)
//   profiler_debug   false       profiles say on stderr how CUPTI's records mapped to launches (env
//                                TSYS_PROFILER_DEBUG sets it)
typedef struct tsys_cuda_desc {
    int device;
    tsys_cuda_flash_impl flash;
    bool tf32;
    bool flash_fp32_exact;
    size_t workspace_bytes;
    size_t memory_limit;
    bool nvtx;
    bool flash_no_pdl;
    bool flash_no_fused;
    bool flash_nondeterministic;
    bool no_cupti;
    bool profiler_debug;
} tsys_cuda_desc;

// Creates the backend state (stream, cuBLASLt handle, workspace, caching allocator) on desc->device
// (desc NULL = all defaults) and registers it as the context's TSYS_CUDA backend.
TSYSDEF tsys_status tsys_cuda_init_desc(tsys_ctx *ctx, const tsys_cuda_desc *desc);
// Shorthand: tsys_cuda_init_desc with every field 0 but .device = device_id.
TSYSDEF tsys_status tsys_cuda_init(tsys_ctx *ctx, int device_id);
// The effective desc: defaults filled in, the environment's overrides applied, AUTO resolved to the
// implementation it runs, the setters' later changes included. All zero without a CUDA backend.
TSYSDEF tsys_cuda_desc tsys_cuda_get_desc(tsys_ctx *ctx);
// Switches the FlashAttention implementation at run time (tests sweep every one in one process). Error
// (TSYS_ERR_UNSUPPORTED, with the reason) for one this binary or device cannot run; the choice stays as it was.
TSYSDEF tsys_status tsys_cuda_set_flash_impl(tsys_ctx *ctx, tsys_cuda_flash_impl impl);
TSYSDEF const char *tsys_cuda_flash_impl_name(tsys_cuda_flash_impl impl);   // "auto", "ws", "wgmma", "mma"
// Frees everything the backend holds. Release every CUDA tensor of the context first.
TSYSDEF void tsys_cuda_shutdown(tsys_ctx *ctx);
TSYSDEF int tsys_cuda_device_count(void);                 // 0 when there is no GPU or no driver
TSYSDEF const char *tsys_cuda_device_name(tsys_ctx *ctx); // "NVIDIA H100 80GB HBM3", ...
TSYSDEF void *tsys_cuda_stream(tsys_ctx *ctx);            // the cudaStream_t launches go to now (tsys_set_stream)
TSYSDEF void *tsys_cuda_stream_of(tsys_ctx *ctx, tsys_stream s);   // the compute, side, copy or background stream
TSYSDEF void tsys_cuda_set_tf32(tsys_ctx *ctx, bool on);  // fp32 GEMMs on TF32 tensor cores (default off)
TSYSDEF bool tsys_cuda_tf32(tsys_ctx *ctx);
TSYSDEF void tsys_cuda_set_flash_fp32_exact(tsys_ctx *ctx, bool on);
// desc.flash_no_pdl and desc.flash_no_fused at run time (flash_lab times the backward both ways in one process)
TSYSDEF void tsys_cuda_set_flash_no_pdl(tsys_ctx *ctx, bool on);
TSYSDEF void tsys_cuda_set_flash_no_fused(tsys_ctx *ctx, bool on);
TSYSDEF void tsys_cuda_set_flash_nondeterministic(tsys_ctx *ctx, bool on);   // desc.flash_nondeterministic

// caching allocator
TSYSDEF size_t tsys_cuda_mem_reserved(tsys_ctx *ctx);
TSYSDEF size_t tsys_cuda_mem_allocated(tsys_ctx *ctx);
TSYSDEF tsys_cuda_mem_info tsys_cuda_mem_info_get(tsys_ctx *ctx);
TSYSDEF tsys_status tsys_cuda_empty_cache(tsys_ctx *ctx);               // cudaFree every cached block
TSYSDEF void tsys_cuda_set_memory_limit(tsys_ctx *ctx, size_t bytes);   // cap on reserved bytes; 0 = none

// CUDA graphs: capture everything issued on the backend stream between begin and end.
TSYSDEF tsys_status tsys_cuda_graph_begin(tsys_ctx *ctx);
TSYSDEF tsys_status tsys_cuda_graph_end(tsys_ctx *ctx, tsys_cuda_graph **out);
TSYSDEF tsys_status tsys_cuda_graph_replay(tsys_ctx *ctx, tsys_cuda_graph *g);   // asynchronous
TSYSDEF void tsys_cuda_graph_free(tsys_cuda_graph *g);
TSYSDEF bool tsys_cuda_capturing(tsys_ctx *ctx);

// NVTX ranges (nsys shows them on the CPU and CUDA timelines), in the NVTX domain "tsys" with
// registered strings for names. tsys_cuda_set_nvtx(ctx, true) puts every op, backward node and named
// range (tsys_trace_begin) in one, through the trace hooks.
TSYSDEF void tsys_cuda_range_push(const char *name);
TSYSDEF void tsys_cuda_range_pop(void);
TSYSDEF tsys_status tsys_cuda_set_nvtx(tsys_ctx *ctx, bool on);
TSYSDEF bool tsys_cuda_nvtx(tsys_ctx *ctx);

// tsys.h's profiler gets kernel device times from CUPTI when libcupti can be loaded, else from events.
TSYSDEF bool tsys_cuda_cupti_available(void);

#ifdef __cplusplus
}
#endif
#endif // TSYS_CUDA_H_INCLUDED

// =================================================================================================
// implementation
// =================================================================================================
#if defined(TSYS_IMPL) && !defined(TSYS_CUDA_IMPLEMENTATION)
#define TSYS_CUDA_IMPLEMENTATION
#endif

#ifdef TSYS_CUDA_IMPLEMENTATION
#ifndef TSYS_CUDA_IMPLEMENTATION_INCLUDED
#define TSYS_CUDA_IMPLEMENTATION_INCLUDED

#ifndef __CUDACC__
#error "tsys_cuda.cuh: the implementation must be compiled by nvcc (-x cu)"
#endif

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cublasLt.h>
#include <cub/device/device_radix_sort.cuh>
#ifndef TSYS_CUDA_NO_NVTX
#include <nvtx3/nvToolsExt.h>
#endif
#ifndef TSYS_CUDA_NO_FLASH
#include <cuda.h>   // CUtensorMap and its enums for the flash TMA kernels (the encoder is fetched at run time)
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <type_traits>

// Host allocations (backend state, allocator tables, graphs) use tsys.h's allocator macros; they are
// defined here too for a translation unit that holds this implementation but not tsys.h's.
#if defined(TSYS_MALLOC) && defined(TSYS_FREE) && defined(TSYS_REALLOC)
#elif !defined(TSYS_MALLOC) && !defined(TSYS_FREE) && !defined(TSYS_REALLOC)
#define TSYS_MALLOC(sz) malloc(sz)
#define TSYS_REALLOC(p, sz) realloc(p, sz)
#define TSYS_FREE(p) free(p)
#else
#error "Must define all or none of TSYS_MALLOC, TSYS_FREE, and TSYS_REALLOC."
#endif

#ifndef TSYS_CUDA_WORKSPACE_BYTES
#define TSYS_CUDA_WORKSPACE_BYTES ((size_t)32 << 20)
#endif
#ifndef TSYS_CUDA_GEMM_CACHE
#define TSYS_CUDA_GEMM_CACHE 512
#endif

// >>checks ----------------------------------------------------------------------------------------
// Every CUDA / cuBLASLt call goes through one of these: on failure the context gets
// "file:line: statement: reason" and the function returns the status.

#define TSYS_CUDA__CHECK(ctx, call) do { \
    cudaError_t tsys_e_ = (call); \
    if (tsys_e_ != cudaSuccess) { \
        (void)cudaGetLastError(); /* clear non-sticky errors so later launches are not blamed */ \
        return tsys_ctx_set_error((ctx), TSYS_ERR_CUDA, "%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(tsys_e_)); \
    } } while (0)

#define TSYS_CUDA__CHECK_BLAS(ctx, call) do { \
    cublasStatus_t tsys_s_ = (call); \
    if (tsys_s_ != CUBLAS_STATUS_SUCCESS) \
        return tsys_ctx_set_error((ctx), TSYS_ERR_CUDA, "%s:%d: %s: cublas status %d", __FILE__, __LINE__, #call, (int)tsys_s_); \
    } while (0)

#define TSYS_CUDA__TRY(expr) do { tsys_status tsys_st_ = (expr); if (tsys_st_ != TSYS_OK) return tsys_st_; } while (0)

#define TSYS_CUDA__REQUIRE(ctx, cond, ...) do { if (!(cond)) { \
    char tsys_m_[200]; snprintf(tsys_m_, sizeof tsys_m_, __VA_ARGS__); \
    return tsys_ctx_set_error((ctx), TSYS_ERR_INVALID_ARGS, "cuda: %s (%s)", tsys_m_, #cond); } } while (0)

// >>state -----------------------------------------------------------------------------------------

// One device block of the caching allocator. Blocks are never split: a block serves requests of
// exactly its size class, which keeps reuse O(1) and the addresses of a step reproducible.
typedef struct tsys_cuda__block {
    void *ptr;
    size_t size;         // rounded size (the size class)
    int pool;            // 0 = general; >0 = private pool of one CUDA graph
    int next_free;       // next block in its free list, -1 = end
    bool in_use;
    bool alive;          // false once cudaFree'd (the slot is recycled)
} tsys_cuda__block;

// Open-addressing hash map from a non-zero 64-bit key to a 64-bit value, linear probing,
// backward-shift deletion (no tombstones). Used for ptr -> block and size class -> free list head.
typedef struct tsys_cuda__map {
    uint64_t *keys, *vals;
    size_t cap, count;
} tsys_cuda__map;

typedef struct tsys_cuda__gemm_key {
    int32_t ab_dt, c_dt, trans_a, trans_b, tf32, align_a, align_b, align_c, as_items, pad;
    int64_t m, n, k, batch, stride_a, stride_b, stride_c;
} tsys_cuda__gemm_key;

// A cuBLASLt plan for one GEMM shape: descriptors plus the algorithm the heuristic picked.
typedef struct tsys_cuda__gemm_plan {
    tsys_cuda__gemm_key key;
    bool used;
    bool by_item;   // as_items, but the item's algorithm cannot run the batch: one product an item
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
} tsys_cuda__gemm_plan;

// The first out-of-range id a kernel met (embedding ids, cross-entropy targets). Kernels never read
// or write out of bounds for it; they note it here, in mapped host memory, and the host turns it
// into the context's error at the next synchronization (sync, a device-to-host copy, an elapsed
// time), so checking costs no extra sync per op.
typedef struct tsys_cuda__fault {
    int flag;              // 0 = none; set once by the first kernel that met a bad id
    int kernel;            // TSYS_K_*
    long long pos, value, limit;
} tsys_cuda__fault;

typedef struct tsys_cuda__state {
    tsys_ctx *ctx;
    int device;
    int num_sms;
    char device_name[256];
    cudaStream_t stream;                       // where launches go now: one of streams[]
    cudaStream_t streams[TSYS_STREAM_COUNT];   // compute (made first), side, copy, background (tsys_cuda__streams_make)
    tsys_stream cur_stream;
    bool copies_pending;                       // copies were queued on streams[TSYS_STREAM_COPY] since the last fence
    cudaEvent_t copies_done;                   // the fence's (made at the first one)
    cudaEvent_t *free_events;                  // pool behind tsys_event handles
    int num_free_events, cap_free_events;
    tsys_trace_hooks nvtx_prev;                // the hooks the NVTX hooks chain to (desc.nvtx)
    bool nvtx_on;
    struct tsys_cuda__nvtx_names *nvtx_names;  // registered range names (made when NVTX is turned on; >>nvtx)
    cublasLtHandle_t lt;
    int cc_major, cc_minor;          // compute capability
    void *workspace;
    size_t workspace_bytes;
    bool tf32;
    tsys_cuda__fault *fault, *fault_dev;   // host and device addresses of one mapped, pinned record
    // FlashAttention (>>flash): what was asked for, what this binary and device can run, what launches get
    tsys_cuda_flash_impl flash;      // asked for (desc.flash or tsys_cuda_set_flash_impl; env overrides of AUTO applied)
    tsys_cuda_flash_impl flash_run;  // given to the launchers: AUTO (WS, then WGMMA per call), WS, WGMMA or MMA
    bool flash_wg_ok;                // the wgmma kernels are in the binary for this device (probe, at init)
    bool flash_ws_ok;                // and the driver can make TMA tensor maps
    bool flash_fp32_exact;           // fp32 on the SIMT kernels instead of TF32 tensor cores
    bool flash_no_pdl, flash_no_fused;   // desc.flash_no_pdl, desc.flash_no_fused (the lab's comparisons)
    bool flash_nondeterministic;         // desc.flash_nondeterministic
    bool no_cupti, profiler_debug;   // desc.no_cupti, desc.profiler_debug (>>profiler)
    float *partials;                 // TSYS_CUDA__MAX_PARTIALS floats for two-stage reductions
    // caching allocator
    tsys_cuda__block *blocks;
    int num_blocks, cap_blocks;
    int free_slots;                  // head of recycled block slots (linked through next_free)
    tsys_cuda__map by_ptr;           // ptr -> block index
    tsys_cuda__map free_lists;       // (pool, size class) -> head block index + 1
    size_t memory_limit;
    tsys_cuda_mem_info mem;
    // graphs
    bool capturing;
    int capture_pool;
    int next_pool;
    // GEMM plans
    tsys_cuda__gemm_plan plans[TSYS_CUDA_GEMM_CACHE];
    tsys_backend backend;
} tsys_cuda__state;
#ifndef TSYS_CUDA_NO_NVTX
static void tsys_cuda__nvtx_names_free(struct tsys_cuda__nvtx_names *names);   // >>nvtx
#endif

struct tsys_cuda_graph {
    tsys_cuda__state *st;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    int pool;
};

#define TSYS_CUDA__MAX_PARTIALS 1024

static tsys_cuda__state *tsys_cuda__get(tsys_ctx *ctx) {
    const tsys_backend *b = ctx ? tsys_ctx_backend(ctx, TSYS_CUDA) : NULL;
    return b ? (tsys_cuda__state *)b->state : NULL;
}

// Makes the context's device current: two contexts on two devices may be used from one thread.
static tsys_status tsys_cuda__enter(tsys_cuda__state *st) {
    int cur = -1;
    TSYS_CUDA__CHECK(st->ctx, cudaGetDevice(&cur));
    if (cur != st->device) TSYS_CUDA__CHECK(st->ctx, cudaSetDevice(st->device));
    return TSYS_OK;
}

// >>hash map --------------------------------------------------------------------------------------

static uint64_t tsys_cuda__mix(uint64_t x) {   // splitmix64 finalizer
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull; x ^= x >> 27; x *= 0x94d049bb133111ebull; x ^= x >> 31;
    return x;
}

static bool tsys_cuda__map_grow(tsys_cuda__map *m) {
    size_t ncap = m->cap ? m->cap * 2 : 256;
    uint64_t *nk = (uint64_t *)TSYS_MALLOC(ncap * sizeof(uint64_t)), *nv = (uint64_t *)TSYS_MALLOC(ncap * sizeof(uint64_t));
    if (!nk || !nv) { TSYS_FREE(nk); TSYS_FREE(nv); return false; }
    memset(nk, 0, ncap * sizeof(uint64_t));   // key 0 = empty slot
    memset(nv, 0, ncap * sizeof(uint64_t));
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->keys[i]) continue;
        size_t j = tsys_cuda__mix(m->keys[i]) & (ncap - 1);
        while (nk[j]) j = (j + 1) & (ncap - 1);
        nk[j] = m->keys[i]; nv[j] = m->vals[i];
    }
    TSYS_FREE(m->keys); TSYS_FREE(m->vals);
    m->keys = nk; m->vals = nv; m->cap = ncap;
    return true;
}

static bool tsys_cuda__map_get(const tsys_cuda__map *m, uint64_t key, uint64_t *val) {
    if (!m->cap) return false;
    for (size_t j = tsys_cuda__mix(key) & (m->cap - 1); m->keys[j]; j = (j + 1) & (m->cap - 1))
        if (m->keys[j] == key) { *val = m->vals[j]; return true; }
    return false;
}

static bool tsys_cuda__map_put(tsys_cuda__map *m, uint64_t key, uint64_t val) {
    if ((m->count + 1) * 2 > m->cap && !tsys_cuda__map_grow(m)) return false;
    size_t j = tsys_cuda__mix(key) & (m->cap - 1);
    while (m->keys[j] && m->keys[j] != key) j = (j + 1) & (m->cap - 1);
    if (!m->keys[j]) m->count++;
    m->keys[j] = key; m->vals[j] = val;
    return true;
}

static void tsys_cuda__map_del(tsys_cuda__map *m, uint64_t key) {
    if (!m->cap) return;
    size_t mask = m->cap - 1, j = tsys_cuda__mix(key) & mask;
    while (m->keys[j] && m->keys[j] != key) j = (j + 1) & mask;
    if (!m->keys[j]) return;
    // backward-shift: move later members of the probe chain into the hole
    size_t hole = j;
    for (size_t i = (j + 1) & mask; m->keys[i]; i = (i + 1) & mask) {
        size_t home = tsys_cuda__mix(m->keys[i]) & mask;
        bool movable = (hole <= i) ? (home <= hole || home > i) : (home <= hole && home > i);
        if (movable) { m->keys[hole] = m->keys[i]; m->vals[hole] = m->vals[i]; hole = i; }
    }
    m->keys[hole] = 0; m->vals[hole] = 0;
    m->count--;
}

static void tsys_cuda__map_free(tsys_cuda__map *m) {
    TSYS_FREE(m->keys); TSYS_FREE(m->vals);
    memset(m, 0, sizeof *m);
}

// >>memory ----------------------------------------------------------------------------------------
// Caching allocator. Size classes: 512 B steps up to 1 MiB, 2 MiB steps above. Each (pool, class)
// has a LIFO free list threaded through the blocks, so the block freed last is reused first (warm in
// L2, and the same addresses step after step).

#define TSYS_CUDA__SMALL_LIMIT ((size_t)1 << 20)
#define TSYS_CUDA__SMALL_ROUND ((size_t)512)
#define TSYS_CUDA__LARGE_ROUND ((size_t)2 << 20)

static size_t tsys_cuda__round_size(size_t bytes) {
    if (bytes == 0) bytes = 1;
    size_t r = bytes <= TSYS_CUDA__SMALL_LIMIT ? TSYS_CUDA__SMALL_ROUND : TSYS_CUDA__LARGE_ROUND;
    return (bytes + r - 1) / r * r;
}

static uint64_t tsys_cuda__class_key(int pool, size_t size) {
    return ((uint64_t)(pool + 1) << 44) | (uint64_t)(size / TSYS_CUDA__SMALL_ROUND);
}

static int tsys_cuda__free_list_pop(tsys_cuda__state *st, int pool, size_t size) {
    uint64_t key = tsys_cuda__class_key(pool, size), head;
    if (!tsys_cuda__map_get(&st->free_lists, key, &head) || head == 0) return -1;
    int bi = (int)head - 1;
    int next = st->blocks[bi].next_free;
    if (next >= 0) tsys_cuda__map_put(&st->free_lists, key, (uint64_t)next + 1);
    else tsys_cuda__map_del(&st->free_lists, key);
    st->blocks[bi].next_free = -1;
    return bi;
}

static void tsys_cuda__free_list_push(tsys_cuda__state *st, int bi) {
    tsys_cuda__block *b = &st->blocks[bi];
    uint64_t key = tsys_cuda__class_key(b->pool, b->size), head = 0;
    tsys_cuda__map_get(&st->free_lists, key, &head);
    b->next_free = head ? (int)head - 1 : -1;
    tsys_cuda__map_put(&st->free_lists, key, (uint64_t)bi + 1);
}

static int tsys_cuda__block_slot(tsys_cuda__state *st) {
    if (st->free_slots >= 0) { int i = st->free_slots; st->free_slots = st->blocks[i].next_free; return i; }
    if (st->num_blocks == st->cap_blocks) {
        int ncap = st->cap_blocks ? st->cap_blocks * 2 : 1024;
        tsys_cuda__block *nb = (tsys_cuda__block *)TSYS_REALLOC(st->blocks, (size_t)ncap * sizeof *nb);
        if (!nb) return -1;
        st->blocks = nb; st->cap_blocks = ncap;
    }
    return st->num_blocks++;
}

// cudaMalloc is not stream-ordered, but CUDA counts it as "unsafe" during a global-mode capture;
// like PyTorch's allocator, switch this thread to relaxed mode around it.
static cudaError_t tsys_cuda__device_malloc(tsys_cuda__state *st, void **ptr, size_t size) {
    if (st->memory_limit && st->mem.reserved_bytes + size > st->memory_limit) return cudaErrorMemoryAllocation;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (st->capturing) cudaThreadExchangeStreamCaptureMode(&mode);
    cudaError_t e = cudaMalloc(ptr, size);
    if (st->capturing) cudaThreadExchangeStreamCaptureMode(&mode);
    if (e != cudaSuccess) (void)cudaGetLastError();   // an OOM must not poison the next launch check
    return e;
}

// cudaFree every cached (free) block of the given pool; pool < 0 = every pool.
static void tsys_cuda__release_cached(tsys_cuda__state *st, int pool) {
    for (int i = 0; i < st->num_blocks; i++) {
        tsys_cuda__block *b = &st->blocks[i];
        if (!b->alive || b->in_use || (pool >= 0 && b->pool != pool)) continue;
        tsys_cuda__map_del(&st->free_lists, tsys_cuda__class_key(b->pool, b->size));
        tsys_cuda__map_del(&st->by_ptr, (uint64_t)(uintptr_t)b->ptr);
        cudaFree(b->ptr);
        st->mem.num_device_frees++;
        st->mem.reserved_bytes -= b->size;
        b->alive = false; b->ptr = NULL;
        b->next_free = st->free_slots; st->free_slots = i;
    }
    // every list of the released pools is now empty; drop stale heads
    if (pool < 0) { tsys_cuda__map_free(&st->free_lists); }
}

static void *tsys_cuda__alloc(tsys_ctx *ctx, size_t bytes) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st || tsys_cuda__enter(st) != TSYS_OK) return NULL;
    size_t size = tsys_cuda__round_size(bytes);
    st->mem.num_allocs++;
    // while capturing: the graph's own pool first, then any general block (it joins the graph)
    int bi = -1;
    if (st->capturing) bi = tsys_cuda__free_list_pop(st, st->capture_pool, size);
    if (bi < 0) bi = tsys_cuda__free_list_pop(st, 0, size);
    if (bi >= 0) {
        st->mem.num_cache_hits++;
    } else {
        void *ptr = NULL;
        cudaError_t e = tsys_cuda__device_malloc(st, &ptr, size);
        if (e == cudaErrorMemoryAllocation && !st->capturing) {
            // free what the cache holds (cudaFree synchronizes, so never while capturing) and retry once
            cudaStreamSynchronize(st->stream);
            tsys_cuda__release_cached(st, 0);
            e = tsys_cuda__device_malloc(st, &ptr, size);
        }
        if (e != cudaSuccess) { st->mem.num_ooms++; return NULL; }
        bi = tsys_cuda__block_slot(st);
        if (bi < 0) { cudaFree(ptr); st->mem.num_ooms++; return NULL; }
        st->mem.num_device_mallocs++;
        st->mem.reserved_bytes += size;
        if (st->mem.reserved_bytes > st->mem.peak_reserved_bytes) st->mem.peak_reserved_bytes = st->mem.reserved_bytes;
        tsys_cuda__block *b = &st->blocks[bi];
        b->ptr = ptr; b->size = size; b->pool = 0; b->next_free = -1; b->alive = true; b->in_use = false;
        if (!tsys_cuda__map_put(&st->by_ptr, (uint64_t)(uintptr_t)ptr, (uint64_t)bi)) {
            cudaFree(ptr); b->alive = false; st->mem.reserved_bytes -= size; st->mem.num_ooms++; return NULL;
        }
    }
    tsys_cuda__block *b = &st->blocks[bi];
    if (st->capturing) b->pool = st->capture_pool;
    b->in_use = true;
    st->mem.allocated_bytes += b->size;
    return b->ptr;
}

// Returning a block is host-side bookkeeping only: the stream is in order, so a kernel that later
// reuses the block runs after every kernel that used it before.
static void tsys_cuda__free(tsys_ctx *ctx, void *ptr, size_t bytes) {
    (void)bytes;
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    uint64_t bi;
    if (!st || !ptr || !tsys_cuda__map_get(&st->by_ptr, (uint64_t)(uintptr_t)ptr, &bi)) return;
    tsys_cuda__block *b = &st->blocks[bi];
    if (!b->in_use) return;   // double free: ignore rather than corrupt the lists
    b->in_use = false;
    st->mem.allocated_bytes -= b->size;
    if (st->capturing) b->pool = st->capture_pool;   // the graph may still read it: keep it out of general reuse
    tsys_cuda__free_list_push(st, (int)bi);
}

// Scratch memory for kernels (reduction partials, sort buffers): same allocator, never tracked by
// tsys's memory tracker (like cuBLAS workspace).
// Kernel scratch: blocks of the caching allocator outside tensor storage, counted as workspace in
// the memory tracker (by their size class, what they hold of the device).
static size_t tsys_cuda__block_size(tsys_cuda__state *st, void *p) {
    uint64_t bi;
    return p && tsys_cuda__map_get(&st->by_ptr, (uint64_t)(uintptr_t)p, &bi) ? st->blocks[bi].size : 0;
}
static void *tsys_cuda__scratch(tsys_cuda__state *st, size_t bytes) {
    void *p = tsys_cuda__alloc(st->ctx, bytes);
    tsys_mem_note_external(st->ctx, TSYS_CUDA, TSYS_MEM_WORKSPACE, (int64_t)tsys_cuda__block_size(st, p));
    return p;
}
static void tsys_cuda__scratch_free(tsys_cuda__state *st, void *p) {
    tsys_mem_note_external(st->ctx, TSYS_CUDA, TSYS_MEM_WORKSPACE, -(int64_t)tsys_cuda__block_size(st, p));
    tsys_cuda__free(st->ctx, p, 0);
}

// >>device helpers --------------------------------------------------------------------------------

typedef __nv_bfloat16 tsys_cuda__bf16;
typedef __half tsys_cuda__f16;

__device__ __forceinline__ float tsys_cuda__tof(float x) { return x; }
__device__ __forceinline__ float tsys_cuda__tof(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float tsys_cuda__tof(__half x) { return __half2float(x); }

template <class T> __device__ __forceinline__ T tsys_cuda__fromf(float x);
template <> __device__ __forceinline__ float tsys_cuda__fromf<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 tsys_cuda__fromf<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half tsys_cuda__fromf<__half>(float x) { return __float2half_rn(x); }

// Notes the first bad id (see tsys_cuda__fault); later ones are dropped.
__device__ __forceinline__ void tsys_cuda__bad_id(tsys_cuda__fault *f, int kernel, int64_t pos, int64_t value, int64_t limit) {
    if (f && atomicCAS(&f->flag, 0, 1) == 0) { f->kernel = kernel; f->pos = pos; f->value = value; f->limit = limit; }
}

// Loads/stores through a run-time dtype: the switch is uniform across the warp, so it costs a few
// instructions per element; used where operands may mix dtypes and speed does not matter.
__device__ __forceinline__ float tsys_cuda__ld(const void *p, int dt, int64_t i) {
    switch (dt) {
    case TSYS_F32: return ((const float *)p)[i];
    case TSYS_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case TSYS_F16: return __half2float(((const __half *)p)[i]);
    case TSYS_I32: return (float)((const int32_t *)p)[i];
    default: return (float)((const int64_t *)p)[i];
    }
}

__device__ __forceinline__ void tsys_cuda__st(void *p, int dt, int64_t i, float v) {
    switch (dt) {
    case TSYS_F32: ((float *)p)[i] = v; break;
    case TSYS_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    case TSYS_F16: ((__half *)p)[i] = __float2half_rn(v); break;
    case TSYS_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    default: ((int64_t *)p)[i] = (int64_t)v; break;
    }
}

__device__ __forceinline__ int64_t tsys_cuda__ld_id(const void *p, int dt, int64_t i) {
    return dt == TSYS_I32 ? (int64_t)((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

// 16 bytes of T: the unit of vectorized loads and stores (LDG.128 / STG.128).
template <class T> struct alignas(16) tsys_cuda__pack { T v[16 / sizeof(T)]; };

__device__ __forceinline__ float tsys_cuda__warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float tsys_cuda__warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// The order is fixed by the block shape, so results are reproducible run to run.
__device__ float tsys_cuda__block_sum(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = tsys_cuda__warp_sum(v);
    __syncthreads();                 // sh may still be read by a previous call
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nwarps ? sh[lane] : 0.0f;
    return tsys_cuda__warp_sum(v);
}

__device__ float tsys_cuda__block_max(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = tsys_cuda__warp_max(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nwarps ? sh[lane] : -INFINITY;
    return tsys_cuda__warp_max(v);
}

// >>launch helpers --------------------------------------------------------------------------------

// Launches a kernel on the backend stream and checks the launch (bad configuration, missing
// kernel image); file:line point at the caller.
template <class... KArgs, class... Args>
static tsys_status tsys_cuda__launch(tsys_cuda__state *st, const char *file, int line, const char *what,
                                     void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, Args... args) {
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) return TSYS_OK;
    kernel<<<grid, block, smem, st->stream>>>(args...);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return tsys_ctx_set_error(st->ctx, TSYS_ERR_CUDA, "%s:%d: launch of %s <<<%u, %u, %zu>>>: %s",
                                  file, line, what, grid.x, block.x, smem, cudaGetErrorString(e));
    return TSYS_OK;
}
#define TSYS_CUDA__LAUNCH(st, kernel, grid, block, smem, ...) \
    TSYS_CUDA__TRY(tsys_cuda__launch((st), __FILE__, __LINE__, #kernel, kernel, (grid), (block), (smem), __VA_ARGS__))

// Blocks for a grid-stride loop over n items: enough to fill the GPU a few times over, no more.
static unsigned tsys_cuda__grid(const tsys_cuda__state *st, int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads, cap = (int64_t)st->num_sms * 32;
    return (unsigned)(b < cap ? b : cap);
}

// Threads per block for a kernel that gives one block to a row of n elements.
static int tsys_cuda__row_threads(int64_t n) {
    return n <= 64 ? 32 : n <= 256 ? 64 : n <= 1024 ? 128 : n <= 4096 ? 256 : 512;
}

// Runs `body` with T bound to the C++ type of float dtype dt.
#define TSYS_CUDA__FLOAT_SWITCH(ctx, dt, T, ...) do { switch (dt) { \
    case TSYS_F32: { typedef float T; __VA_ARGS__; } break; \
    case TSYS_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; } break; \
    case TSYS_F16: { typedef __half T; __VA_ARGS__; } break; \
    default: return tsys_ctx_set_error((ctx), TSYS_ERR_UNSUPPORTED, "cuda: dtype %s where a float dtype is needed", tsys_dtype_name((tsys_dtype)(dt))); \
    } } while (0)

static bool tsys_cuda__aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }
static void *tsys_cuda__data(const tsys_tensor *t) { return t ? tsys_tensor_data(t) : NULL; }
static int64_t tsys_cuda__last_dim(const tsys_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }
static int64_t tsys_cuda__rows(const tsys_tensor *t) {
    int64_t d = tsys_cuda__last_dim(t);
    return d ? tsys_tensor_numel(t) / d : 0;
}

// >>elementwise -----------------------------------------------------------------------------------
// One kernel template serves every elementwise tsys kernel: an Op maps up to 4 fp32 inputs to up
// to 3 fp32 outputs. Inputs may broadcast (in_mod: index i reads element i % mod; 1 = element 0).
// Three variants:
//   ew_any: any mix of dtypes and broadcasts, one element per thread-iteration, grid-stride.
//   ew_mix: float dtypes mixed, no broadcast, aligned: four elements a thread-iteration (below).
//   ew_vec: every operand the same float dtype T, no broadcast, 16-byte aligned, n a multiple of
//           16/sizeof(T): 16-byte loads and stores (8 bf16 or 4 fp32 per thread-iteration).

#define TSYS_CUDA__EW_IN 4
#define TSYS_CUDA__EW_OUT 3

typedef struct tsys_cuda__ew_args {
    const void *in[TSYS_CUDA__EW_IN];
    int in_dt[TSYS_CUDA__EW_IN];
    int64_t in_mod[TSYS_CUDA__EW_IN];
    void *out[TSYS_CUDA__EW_OUT];
    int out_dt[TSYS_CUDA__EW_OUT];
    int64_t n;
} tsys_cuda__ew_args;

template <int NIN, int NOUT, class Op>
__global__ void tsys_cuda__ew_any(Op op, tsys_cuda__ew_args a) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < a.n; i += (int64_t)gridDim.x * blockDim.x) {
        float x[NIN > 0 ? NIN : 1], y[NOUT];
#pragma unroll
        for (int k = 0; k < NIN; k++) {
            int64_t j = a.in_mod[k] == 0 ? i : a.in_mod[k] == 1 ? 0 : i % a.in_mod[k];
            x[k] = tsys_cuda__ld(a.in[k], a.in_dt[k], j);
        }
        op(x, y);
#pragma unroll
        for (int k = 0; k < NOUT; k++)
            if (a.out[k]) tsys_cuda__st(a.out[k], a.out_dt[k], i, y[k]);
    }
}

template <class T, int NIN, int NOUT, class Op>
__global__ void tsys_cuda__ew_vec(Op op, tsys_cuda__ew_args a) {
    constexpr int V = 16 / sizeof(T);
    int64_t nv = a.n / V;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nv; i += (int64_t)gridDim.x * blockDim.x) {
        tsys_cuda__pack<T> pin[NIN > 0 ? NIN : 1], pout[NOUT];
#pragma unroll
        for (int k = 0; k < NIN; k++) pin[k] = ((const tsys_cuda__pack<T> *)a.in[k])[i];
#pragma unroll
        for (int e = 0; e < V; e++) {
            float x[NIN > 0 ? NIN : 1], y[NOUT];
#pragma unroll
            for (int k = 0; k < NIN; k++) x[k] = tsys_cuda__tof(pin[k].v[e]);
            op(x, y);
#pragma unroll
            for (int k = 0; k < NOUT; k++) pout[k].v[e] = tsys_cuda__fromf<T>(y[k]);
        }
#pragma unroll
        for (int k = 0; k < NOUT; k++) ((tsys_cuda__pack<T> *)a.out[k])[i] = pout[k];
    }
}

// ew_mix: float operands of mixed dtypes (fp32 beside bf16 / f16: casts, fp32 gradients gathering bf16
// ones), no broadcast, each aligned to four of its elements, n a multiple of 4: four elements a
// thread-iteration, one 16-byte (fp32) or 8-byte (16-bit) access an operand (the element-wise loop
// ran these at about half the HBM's rate). Each element is rounded as tsys_cuda__st rounds it.
// Four consecutive elements (group i4) as fp32, in one 16-byte (fp32) or 8-byte (16-bit) load; typed, and
// through a run-time dtype. The 16-bit value of x rounded to nearest even, as tsys_cuda__st rounds.
__device__ __forceinline__ float4 tsys_cuda__g4(const float *g, int64_t i4) { return ((const float4 *)g)[i4]; }
__device__ __forceinline__ float4 tsys_cuda__g4(const __nv_bfloat16 *g, int64_t i4) {
    const uint2 u = ((const uint2 *)g)[i4];
    const float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)&u.x), b = __bfloat1622float2(*(const __nv_bfloat162 *)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 tsys_cuda__g4(const __half *g, int64_t i4) {
    const uint2 u = ((const uint2 *)g)[i4];
    const float2 a = __half22float2(*(const __half2 *)&u.x), b = __half22float2(*(const __half2 *)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void tsys_cuda__ld4(const void *p, int dt, int64_t q, float *x) {
    const float4 v = dt == TSYS_F32 ? tsys_cuda__g4((const float *)p, q)
                   : dt == TSYS_BF16 ? tsys_cuda__g4((const __nv_bfloat16 *)p, q) : tsys_cuda__g4((const __half *)p, q);
    x[0] = v.x; x[1] = v.y; x[2] = v.z; x[3] = v.w;
}
template <int DT> __device__ __forceinline__ uint16_t tsys_cuda__lowp_bits(float x) {
    return DT == TSYS_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ uint32_t tsys_cuda__pack2(int dt, float lo, float hi) {
    return dt == TSYS_BF16 ? (uint32_t)tsys_cuda__lowp_bits<TSYS_BF16>(lo) | ((uint32_t)tsys_cuda__lowp_bits<TSYS_BF16>(hi) << 16)
                           : (uint32_t)tsys_cuda__lowp_bits<TSYS_F16>(lo) | ((uint32_t)tsys_cuda__lowp_bits<TSYS_F16>(hi) << 16);
}
// Four consecutive elements stored from fp32 (group i4), typed: one 16- or 8-byte store.
__device__ __forceinline__ void tsys_cuda__put4(float *p, int64_t i4, float4 v) { ((float4 *)p)[i4] = v; }
__device__ __forceinline__ void tsys_cuda__put4(__nv_bfloat16 *p, int64_t i4, float4 v) { ((uint2 *)p)[i4] = make_uint2(tsys_cuda__pack2(TSYS_BF16, v.x, v.y), tsys_cuda__pack2(TSYS_BF16, v.z, v.w)); }
__device__ __forceinline__ void tsys_cuda__put4(__half *p, int64_t i4, float4 v) { ((uint2 *)p)[i4] = make_uint2(tsys_cuda__pack2(TSYS_F16, v.x, v.y), tsys_cuda__pack2(TSYS_F16, v.z, v.w)); }
__device__ __forceinline__ void tsys_cuda__st4(void *p, int dt, int64_t q, const float *y) {
    if (dt == TSYS_F32) ((float4 *)p)[q] = make_float4(y[0], y[1], y[2], y[3]);
    else ((uint2 *)p)[q] = make_uint2(tsys_cuda__pack2(dt, y[0], y[1]), tsys_cuda__pack2(dt, y[2], y[3]));
}
template <int NIN, int NOUT, class Op>
__global__ void tsys_cuda__ew_mix(Op op, tsys_cuda__ew_args a) {
    for (int64_t q = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; q < a.n / 4; q += (int64_t)gridDim.x * blockDim.x) {
        float x[NIN > 0 ? NIN : 1][4], y[NOUT][4];
#pragma unroll
        for (int k = 0; k < NIN; k++) tsys_cuda__ld4(a.in[k], a.in_dt[k], q, x[k]);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float xe[NIN > 0 ? NIN : 1], ye[NOUT];
#pragma unroll
            for (int k = 0; k < NIN; k++) xe[k] = x[k][e];
            op(xe, ye);
#pragma unroll
            for (int k = 0; k < NOUT; k++) y[k][e] = ye[k];
        }
#pragma unroll
        for (int k = 0; k < NOUT; k++) tsys_cuda__st4(a.out[k], a.out_dt[k], q, y[k]);
    }
}
static bool tsys_cuda__mix_ok(const void *p, int dt) {
    return (dt == TSYS_F32 || dt == TSYS_BF16 || dt == TSYS_F16) && ((uintptr_t)p & (4 * tsys_dtype_size((tsys_dtype)dt) - 1)) == 0;
}

// Picks the vectorized variant when it applies, else the general one.
template <int NIN, int NOUT, class Op>
static tsys_status tsys_cuda__ew(tsys_cuda__state *st, Op op, tsys_cuda__ew_args a) {
    if (a.n <= 0) return TSYS_OK;
    int dt = NOUT > 0 ? a.out_dt[0] : a.in_dt[0];
    bool vec = dt == TSYS_F32 || dt == TSYS_BF16 || dt == TSYS_F16;
    int V = vec ? 16 / (int)tsys_dtype_size((tsys_dtype)dt) : 1;
    vec = vec && a.n % V == 0;
    for (int k = 0; k < NIN && vec; k++) vec = a.in_dt[k] == dt && a.in_mod[k] == 0 && tsys_cuda__aligned16(a.in[k]);
    for (int k = 0; k < NOUT && vec; k++) vec = a.out[k] && a.out_dt[k] == dt && tsys_cuda__aligned16(a.out[k]);
    const int threads = 256;
    if (vec) {
        unsigned grid = tsys_cuda__grid(st, a.n / V, threads);
        if (dt == TSYS_F32) TSYS_CUDA__LAUNCH(st, (tsys_cuda__ew_vec<float, NIN, NOUT, Op>), grid, threads, 0, op, a);
        else if (dt == TSYS_BF16) TSYS_CUDA__LAUNCH(st, (tsys_cuda__ew_vec<__nv_bfloat16, NIN, NOUT, Op>), grid, threads, 0, op, a);
        else TSYS_CUDA__LAUNCH(st, (tsys_cuda__ew_vec<__half, NIN, NOUT, Op>), grid, threads, 0, op, a);
        return TSYS_OK;
    }
    bool mix = a.n % 4 == 0;
    for (int k = 0; k < NIN && mix; k++) mix = a.in_mod[k] == 0 && tsys_cuda__mix_ok(a.in[k], a.in_dt[k]);
    for (int k = 0; k < NOUT && mix; k++) mix = a.out[k] && tsys_cuda__mix_ok(a.out[k], a.out_dt[k]);
    if (mix) {
        TSYS_CUDA__LAUNCH(st, (tsys_cuda__ew_mix<NIN, NOUT, Op>), tsys_cuda__grid(st, a.n / 4, threads), threads, 0, op, a);
        return TSYS_OK;
    }
    TSYS_CUDA__LAUNCH(st, (tsys_cuda__ew_any<NIN, NOUT, Op>), tsys_cuda__grid(st, a.n, threads), threads, 0, op, a);
    return TSYS_OK;
}

// Fills an ew_args from tensors: ins[k] (NULL allowed only where the op ignores it), outs[k] (NULL = skip).
static tsys_cuda__ew_args tsys_cuda__ew_make(int64_t n, int nin, tsys_tensor *const *ins, int nout, tsys_tensor *const *outs) {
    tsys_cuda__ew_args a;
    memset(&a, 0, sizeof a);
    a.n = n;
    for (int k = 0; k < nin; k++) {
        a.in[k] = tsys_cuda__data(ins[k]);
        a.in_dt[k] = ins[k] ? ins[k]->dtype : TSYS_F32;
    }
    for (int k = 0; k < nout; k++) {
        a.out[k] = tsys_cuda__data(outs[k]);
        a.out_dt[k] = outs[k] ? outs[k]->dtype : TSYS_F32;
    }
    return a;
}

__device__ __forceinline__ float tsys_cuda__sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

struct tsys_cuda__op_fill { float v; __device__ void operator()(const float *, float *y) const { y[0] = v; } };
struct tsys_cuda__op_copy { __device__ void operator()(const float *x, float *y) const { y[0] = x[0]; } };
struct tsys_cuda__op_scale { float s; __device__ void operator()(const float *x, float *y) const { y[0] = x[0] * s; } };
struct tsys_cuda__op_axpy { float s; __device__ void operator()(const float *x, float *y) const { y[0] = x[0] + x[1] * s; } };
struct tsys_cuda__op_add { __device__ void operator()(const float *x, float *y) const { y[0] = x[0] + x[1]; } };
struct tsys_cuda__op_mul { __device__ void operator()(const float *x, float *y) const { y[0] = x[0] * x[1]; } };
struct tsys_cuda__op_relu { __device__ void operator()(const float *x, float *y) const { y[0] = x[0] > 0.0f ? x[0] : 0.0f; } };
struct tsys_cuda__op_relu_bwd { __device__ void operator()(const float *x, float *y) const { y[0] = x[1] > 0.0f ? x[0] : 0.0f; } };
struct tsys_cuda__op_silu { __device__ void operator()(const float *x, float *y) const { y[0] = x[0] * tsys_cuda__sigmoid(x[0]); } };
// silu'(x) = s (1 + x (1 - s)), s = sigmoid(x); inputs (dy, x)
struct tsys_cuda__op_silu_bwd {
    __device__ void operator()(const float *x, float *y) const {
        float s = tsys_cuda__sigmoid(x[1]);
        y[0] = x[0] * s * (1.0f + x[1] * (1.0f - s));
    }
};
struct tsys_cuda__op_swiglu { __device__ void operator()(const float *x, float *y) const { y[0] = x[0] * tsys_cuda__sigmoid(x[0]) * x[1]; } };
// inputs (dy, a, b) -> (da, db)
struct tsys_cuda__op_swiglu_bwd {
    __device__ void operator()(const float *x, float *y) const {
        float s = tsys_cuda__sigmoid(x[1]), silu = x[1] * s;
        y[0] = x[0] * x[2] * s * (1.0f + x[1] * (1.0f - s));
        y[1] = x[0] * silu;
    }
};
// inputs (a, b, dloss) -> (da, db); s = 2 / n
struct tsys_cuda__op_mse_bwd {
    float s;
    __device__ void operator()(const float *x, float *y) const { float d = x[2] * s * (x[0] - x[1]); y[0] = d; y[1] = -d; }
};
struct tsys_cuda__op_sgd { float lr; __device__ void operator()(const float *x, float *y) const { y[0] = x[0] - lr * x[1]; } };

// 1 - beta^t in double, rounded once, as the CPU path and torch's AdamW (host scalars in double): powf's
// last-bit error is amplified by the cancellation (beta2 = 0.999: 1e3 times at step 1).
__device__ __forceinline__ float tsys_cuda__bias_correction(float beta, double t) { return (float)(1.0 - pow((double)beta, t)); }

// AdamW, torch.optim.AdamW order of operations (decoupled decay first, bias-corrected step);
// inputs (p, g, m, v) -> (p, m, v). The step count is read on the device (so a captured graph replays
// the right bias corrections), and with it the corrections STEP_INC wrote beside it (bias); without
// them each thread computes the two powers itself.
struct tsys_cuda__op_adamw {
    float lr, beta1, beta2, eps, wd;
    const void *step; int step_dt;     // one-element I32/I64 device tensor, already incremented
    const float *lr_dev;               // optional one-element fp32 device lr (extension: t[5]), overrides lr
    const float *bias;                 // optional: 1 - beta1^t, 1 - beta2^t for this step (t[8])
    // What every element of a launch shares, computed once a thread: each is the very expression the
    // per-element update would evaluate (same operands, same rounding), so hoisting it keeps the bits,
    // and the loop is left one square root and two divisions an element (the IEEE-exact _rn forms
    // are instruction sequences: at 3.4 G parameters the update was close to issue-bound).
    struct shared { float decay, one_m_b1, one_m_b2, sqrt_bc2, step_size; };
    __device__ __forceinline__ shared prep() const {
        float l = lr_dev ? *lr_dev : lr, bc1, bc2;
        if (bias) { bc1 = bias[0]; bc2 = bias[1]; }
        else {
            double t = (double)tsys_cuda__ld_id(step, step_dt, 0);
            bc1 = tsys_cuda__bias_correction(beta1, t); bc2 = tsys_cuda__bias_correction(beta2, t);
        }
        return { __fsub_rn(1.0f, __fmul_rn(l, wd)), __fsub_rn(1.0f, beta1), __fsub_rn(1.0f, beta2), __fsqrt_rn(bc2), __fdiv_rn(l, bc1) };
    }
    // Every rounding is spelled out (the _rn intrinsics are never contracted), so each kernel that
    // inlines this computes the same bits: left to the compiler, the launches with and without the
    // kept copies contracted the multiply-adds differently (measured: losses apart from step 1).
    __device__ __forceinline__ void apply(const shared &k, const float *x, float *y) const {
        float p = __fmul_rn(x[0], k.decay), g = x[1];
        float m = __fmaf_rn(beta1, x[2], __fmul_rn(k.one_m_b1, g));
        float v = __fmaf_rn(beta2, x[3], __fmul_rn(__fmul_rn(k.one_m_b2, g), g));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.sqrt_bc2), eps);
        y[0] = __fsub_rn(p, __fmul_rn(k.step_size, __fdiv_rn(m, denom)));
        y[1] = m; y[2] = v;
    }
    __device__ void operator()(const float *x, float *y) const { apply(prep(), x, y); }
};

// t[0] (one I32/I64 element) += 1, on the device: the optimizer's step count inside a graph; bias (or NULL):
// AdamW's bias corrections for the new count, once a step instead of once a thread of every launch.
__global__ void tsys_cuda__step_inc(void *t, int dt, float *bias, float beta1, float beta2) {
    int64_t n = dt == TSYS_I32 ? (int64_t)(((int32_t *)t)[0] += 1) : (((int64_t *)t)[0] += 1);
    if (bias) { bias[0] = tsys_cuda__bias_correction(beta1, (double)n); bias[1] = tsys_cuda__bias_correction(beta2, (double)n); }
}

// int <-> int casts keep all 64 bits (the float path would round ids above 2^24)
__global__ void tsys_cuda__cast_ids(void *dst, int ddt, const void *src, int sdt, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t v = tsys_cuda__ld_id(src, sdt, i);
        if (ddt == TSYS_I32) ((int32_t *)dst)[i] = (int32_t)v; else ((int64_t *)dst)[i] = v;
    }
}

// Counter-based normal sample, the same function as tsys__hash_normal in tsys.h (kept here so this
// header does not depend on tsys.h's implementation being in the same translation unit). The device
// logf/cosf differ from glibc's by an ulp or two, so values match the CPU to ~1e-7, not bit for bit.
__device__ __forceinline__ uint64_t tsys_cuda__mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float tsys_cuda__hash_normal(uint64_t seed, uint64_t i, uint32_t attempt) {
    uint64_t r1 = tsys_cuda__mix64(seed * 0x9e3779b97f4a7c15ull + i * 2 + ((uint64_t)attempt << 56) + 1);
    uint64_t r2 = tsys_cuda__mix64(r1 ^ 0x632be59bd9b4e019ull);
    float u1 = ((float)(r1 >> 40) + 0.5f) * (1.0f / 16777216.0f), u2 = (float)(r2 >> 40) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

// t = std * N(0, 1), element i from stream `seed`; redrawn while outside [lo, hi] when lo < hi.
// Grid-stride, one element per thread-iteration; no state, so it can be captured in a graph.
__global__ void tsys_cuda__randn(void *t, int dt, int64_t n, uint64_t seed, float std, float lo, float hi) {
    bool trunc = lo < hi;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = std * tsys_cuda__hash_normal(seed, (uint64_t)i, 0);
        for (uint32_t r = 1; trunc && (v < lo || v > hi); r++) v = std * tsys_cuda__hash_normal(seed, (uint64_t)i, r);
        tsys_cuda__st(t, dt, i, v);
    }
}

// >>reductions ------------------------------------------------------------------------------------
// Two-stage, deterministic: stage 1 runs a fixed number of blocks (a function of n and the GPU),
// each writing one partial sum; stage 2, one block, adds the partials in a fixed order and writes
// (or accumulates into) a one-element device tensor. No host sync anywhere.

struct tsys_cuda__red_sum { __device__ float operator()(const float *x) const { return x[0]; } };
struct tsys_cuda__red_sumsq { __device__ float operator()(const float *x) const { return x[0] * x[0]; } };
struct tsys_cuda__red_sqdiff { __device__ float operator()(const float *x) const { float d = x[0] - x[1]; return d * d; } };

template <int NIN, class Op>
__global__ void tsys_cuda__reduce_partials(Op op, tsys_cuda__ew_args a, float *partials) {
    float acc = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < a.n; i += (int64_t)gridDim.x * blockDim.x) {
        float x[NIN];
#pragma unroll
        for (int k = 0; k < NIN; k++) x[k] = tsys_cuda__ld(a.in[k], a.in_dt[k], i);
        acc += op(x);
    }
    acc = tsys_cuda__block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// out[0] = scale * sum(partials) (+ out[0] when accumulate)
__global__ void tsys_cuda__reduce_final(const float *partials, int count, void *out, int out_dt, float scale, int accumulate) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
    acc = tsys_cuda__block_sum(acc);
    if (threadIdx.x == 0) {
        float v = scale * acc;
        if (accumulate) v += tsys_cuda__ld(out, out_dt, 0);
        tsys_cuda__st(out, out_dt, 0, v);
    }
}

template <int NIN, class Op>
static tsys_status tsys_cuda__reduce(tsys_cuda__state *st, Op op, tsys_cuda__ew_args a, tsys_tensor *out, float scale, bool accumulate) {
    const int threads = 256;
    int64_t blocks = (a.n + threads * 4 - 1) / (threads * 4);   // >= 4 elements per thread
    int64_t cap = st->num_sms * 4 < TSYS_CUDA__MAX_PARTIALS ? st->num_sms * 4 : TSYS_CUDA__MAX_PARTIALS;
    unsigned grid = (unsigned)(blocks < 1 ? 1 : blocks > cap ? cap : blocks);
    if (a.n > 0) TSYS_CUDA__LAUNCH(st, (tsys_cuda__reduce_partials<NIN, Op>), grid, threads, 0, op, a, st->partials);
    else grid = 0;
    TSYS_CUDA__LAUNCH(st, tsys_cuda__reduce_final, 1, 256, 0, (const float *)st->partials, (int)grid,
                      tsys_cuda__data(out), (int)out->dtype, scale, accumulate ? 1 : 0);
    return TSYS_OK;
}

// t[0] = 1 if any element of x is inf or nan; one write per block that saw one (same value: no race).
__global__ void tsys_cuda__nonfinite(const void *x, int dt, int64_t n, float *flag) {
    int bad = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        bad |= !isfinite(tsys_cuda__ld(x, dt, i));
    if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1.0f;
}

// Column sums: out[c] += sum over rows of in[r, c]. Block (32, 32): threadIdx.x picks the column (so a
// warp reads 32 consecutive elements of a row), threadIdx.y strides over rows with four loads in flight
// (four running sums, added in a fixed order); the 32 partials of a column are added in a fixed order.
// Used for bias grads and to fold per-block weight-grad partials: a few hundred rows of a few thousand
// columns, i.e. few blocks, so each must keep many loads in flight (8 rows a block and one load at a time
// spent ~4 us of a ~10 us RMSNorm backward on its L2 latency).
constexpr int TSYS_CUDA__COLSUM_LANES = 32;
__global__ void __launch_bounds__(32 * TSYS_CUDA__COLSUM_LANES) tsys_cuda__colsum(void *out, int out_dt, const void *in, int in_dt, int64_t rows, int64_t cols, int64_t ld, bool add) {
    constexpr int L = TSYS_CUDA__COLSUM_LANES;
    __shared__ float sh[L][33];
    int64_t c = blockIdx.x * 32 + threadIdx.x;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (c < cols) {
        int64_t r = threadIdx.y;
        for (; r + 3 * L < rows; r += 4 * L)
#pragma unroll
            for (int u = 0; u < 4; u++) acc[u] += tsys_cuda__ld(in, in_dt, (r + u * L) * ld + c);
#pragma unroll
        for (int u = 0; u < 3; u++)   // the last rows: fewer than four lanes' worth
            if (r + u * L < rows) acc[u] += tsys_cuda__ld(in, in_dt, (r + u * L) * ld + c);
    }
    sh[threadIdx.y][threadIdx.x] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        float s = 0.0f;
        for (int k = 0; k < L; k++) s += sh[k][threadIdx.x];
        tsys_cuda__st(out, out_dt, c, (add ? tsys_cuda__ld(out, out_dt, c) : 0.0f) + s);   // stored: as if out were 0 (its -0 sums too)
    }
}

// ld: elements between consecutive rows of `in` (>= cols)
static tsys_status tsys_cuda__colsum_launch(tsys_cuda__state *st, void *out, int out_dt, const void *in, int in_dt, int64_t rows, int64_t cols, int64_t ld,
                                           bool add = true) {
    TSYS_CUDA__LAUNCH(st, tsys_cuda__colsum, (unsigned)((cols + 31) / 32), dim3(32, TSYS_CUDA__COLSUM_LANES), 0, out, out_dt, in, in_dt, rows, cols, ld, add);
    return TSYS_OK;
}

// >>norms -----------------------------------------------------------------------------------------

// RMSNorm forward. One block per row of D elements; each thread takes columns tid, tid+blockDim, ...
// (coalesced). Sum of squares in fp32 -> rstd = 1/sqrt(mean + eps), y = x * rstd * w, rounded to Y:
// x's dtype T, or bf16/f16 from fp32 x (the norm feeding autocast's matmuls); w (D) any float dtype
// W; rstd (rows) fp32.
// R: with a residual branch res (TSYS_K_RMSNORM_FWD's t4), fp32 x: the row is s = x + res, written
// to sum, and normalized; the sum of squares and the output are those of the plain kernel on s (the
// same block shape and order, __fmaf_rn), so the fused add and norm give the bits of the two apart.
template <class T, class Y, class W, class R = T>
__global__ void tsys_cuda__rmsnorm_fwd(Y *y, float *rstd, const T *x, const W *w, int64_t D, float eps, const R *res, float *sum) {
    int64_t r = blockIdx.x;
    const T *xr = x + r * D;
    Y *yr = y + r * D;
    float ss = 0.0f;
    if (res) {
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
            float v = tsys_cuda__tof(xr[j]) + tsys_cuda__tof(res[r * D + j]);
            sum[r * D + j] = v;
            ss = __fmaf_rn(v, v, ss);
        }
        ss = tsys_cuda__block_sum(ss);
        float rs = 1.0f / sqrtf(ss / (float)D + eps);
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
            float wj = w ? tsys_cuda__tof(w[j]) : 1.0f;
            yr[j] = tsys_cuda__fromf<Y>(sum[r * D + j] * rs * wj);
        }
        if (threadIdx.x == 0 && rstd) rstd[r] = rs;
        return;
    }
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) { float v = tsys_cuda__tof(xr[j]); ss = __fmaf_rn(v, v, ss); }
    ss = tsys_cuda__block_sum(ss);
    float rs = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        float wj = w ? tsys_cuda__tof(w[j]) : 1.0f;
        yr[j] = tsys_cuda__fromf<Y>(tsys_cuda__tof(xr[j]) * rs * wj);
    }
    if (threadIdx.x == 0 && rstd) rstd[r] = rs;
}

// The same with the row in registers, for rows of whole groups of four aligned elements, at most
// TSYS_CUDA__NORM_GROUPS a thread: each thread loads its groups of x (and the residual) once, all in flight
// together (the kernel above reads element by element, and the sum it wrote back again), and writes y
// from registers. Each thread adds its own squares group by group, so the bits differ from the kernel
// above's (a different order), never between launches.
constexpr int TSYS_CUDA__NORM_GROUPS = 4;
template <class T, class Y, class W, class R>
__global__ void tsys_cuda__rmsnorm_fwd_g4(Y *y, float *rstd, const T *x, const W *w, int64_t D, float eps, const R *res, float *sum) {
    constexpr int NG = TSYS_CUDA__NORM_GROUPS;
    const int64_t r = blockIdx.x, row4 = r * (D / 4);
    const int groups = (int)(D / 4);
    float4 v[NG];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NG; k++) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c >= groups) continue;
        v[k] = tsys_cuda__g4(x, row4 + c);
        if (res) {
            const float4 b = tsys_cuda__g4(res, row4 + c);
            v[k] = make_float4(v[k].x + b.x, v[k].y + b.y, v[k].z + b.z, v[k].w + b.w);
            tsys_cuda__put4(sum, row4 + c, v[k]);
        }
        ss = __fmaf_rn(v[k].x, v[k].x, ss); ss = __fmaf_rn(v[k].y, v[k].y, ss);
        ss = __fmaf_rn(v[k].z, v[k].z, ss); ss = __fmaf_rn(v[k].w, v[k].w, ss);
    }
    ss = tsys_cuda__block_sum(ss);
    const float rs = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
    for (int k = 0; k < NG; k++) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c >= groups) continue;
        const float4 wj = w ? tsys_cuda__g4(w, c) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        tsys_cuda__put4(y, row4 + c, make_float4(v[k].x * rs * wj.x, v[k].y * rs * wj.y, v[k].z * rs * wj.z, v[k].w * rs * wj.w));
    }
    if (threadIdx.x == 0 && rstd) rstd[r] = rs;
}

// RMSNorm backward. G blocks (fixed per shape), block b takes rows b, b+G, ...; a thread owns the same
// columns in every row, so it accumulates dw for them in shared memory without atomics; at the end
// each block writes its D partial sums to dw_part[b] and colsum folds the G rows into dw in order.
//   dx_j = rstd (dy_j w_j - x_j rstd^2 mean_k(dy_k w_k x_k)),  dw_j += dy_j x_j rstd
// dx_add: dx holds a gradient already and the row's dx is added to it (__fadd_rn: the bits of storing
// dx and accumulating it with another kernel). Shared memory: D floats (D <= 12288 with the default 48 KB).
template <class T, class W>
__global__ void tsys_cuda__rmsnorm_bwd(T *dx, bool dx_add, float *dw_part, const T *dy, const T *x, const W *w, const float *rstd, int64_t rows, int64_t D) {
    extern __shared__ float dw_acc[];
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) dw_acc[j] = 0.0f;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *dyr = dy + r * D, *xr = x + r * D;
        float rs = rstd[r], dot = 0.0f;
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
            float wj = w ? tsys_cuda__tof(w[j]) : 1.0f;
            dot += tsys_cuda__tof(dyr[j]) * wj * tsys_cuda__tof(xr[j]);
        }
        dot = tsys_cuda__block_sum(dot);
        float c = dot * rs * rs / (float)D;
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
            float wj = w ? tsys_cuda__tof(w[j]) : 1.0f, dyj = tsys_cuda__tof(dyr[j]), xj = tsys_cuda__tof(xr[j]);
            float v = rs * (dyj * wj - xj * c);
            if (dx) dx[r * D + j] = tsys_cuda__fromf<T>(dx_add ? __fadd_rn(tsys_cuda__tof(dx[r * D + j]), v) : v);
            dw_acc[j] += dyj * xj * rs;
        }
    }
    if (dw_part)
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x) dw_part[blockIdx.x * D + j] = dw_acc[j];
}

// The same with the row in registers, for rows of whole 16-byte packs (D a multiple of 16 /
// sizeof(T), aligned) of at most MAXCH packs a thread: a thread loads its packs of dy and x (and dx
// when adding) once, all in flight together, and owns the same columns in every row, so its dw
// partials stay in registers. Each row is one read of dy and x and one write of dx.
template <class T, class W, int MAXCH>
__global__ void tsys_cuda__rmsnorm_bwd_reg(T *dx, bool dx_add, float *dw_part, const T *dy, const T *x, const W *w, const float *rstd, int64_t rows, int64_t D) {
    constexpr int P = (int)(16 / sizeof(T));
    const int nch = (int)(D / P);
    float dwa[MAXCH][P];
#pragma unroll
    for (int k = 0; k < MAXCH; k++)
#pragma unroll
        for (int e = 0; e < P; e++) dwa[k][e] = 0.0f;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const tsys_cuda__pack<T> *dyr = (const tsys_cuda__pack<T> *)(dy + r * D), *xr = (const tsys_cuda__pack<T> *)(x + r * D);
        tsys_cuda__pack<T> *dxr = dx ? (tsys_cuda__pack<T> *)(dx + r * D) : NULL;
        tsys_cuda__pack<T> pdy[MAXCH], px[MAXCH], pold[MAXCH];
#pragma unroll
        for (int k = 0; k < MAXCH; k++) {
            int c = threadIdx.x + k * blockDim.x;
            if (c < nch) { pdy[k] = dyr[c]; px[k] = xr[c]; if (dx_add && dxr) pold[k] = dxr[c]; }
        }
        float rs = rstd[r], dot = 0.0f;
#pragma unroll
        for (int k = 0; k < MAXCH; k++) {
            int c = threadIdx.x + k * blockDim.x;
            if (c >= nch) continue;
#pragma unroll
            for (int e = 0; e < P; e++) {
                float wj = w ? tsys_cuda__tof(w[(int64_t)c * P + e]) : 1.0f;
                dot += tsys_cuda__tof(pdy[k].v[e]) * wj * tsys_cuda__tof(px[k].v[e]);
            }
        }
        dot = tsys_cuda__block_sum(dot);
        float cc = dot * rs * rs / (float)D;
#pragma unroll
        for (int k = 0; k < MAXCH; k++) {
            int c = threadIdx.x + k * blockDim.x;
            if (c >= nch) continue;
            tsys_cuda__pack<T> out;
#pragma unroll
            for (int e = 0; e < P; e++) {
                float wj = w ? tsys_cuda__tof(w[(int64_t)c * P + e]) : 1.0f, dyj = tsys_cuda__tof(pdy[k].v[e]), xj = tsys_cuda__tof(px[k].v[e]);
                float v = rs * (dyj * wj - xj * cc);
                out.v[e] = tsys_cuda__fromf<T>(dx_add ? __fadd_rn(tsys_cuda__tof(pold[k].v[e]), v) : v);
                dwa[k][e] += dyj * xj * rs;
            }
            if (dxr) dxr[c] = out;
        }
    }
    if (!dw_part) return;
#pragma unroll
    for (int k = 0; k < MAXCH; k++) {
        int c = threadIdx.x + k * blockDim.x;
        if (c >= nch) continue;
#pragma unroll
        for (int e = 0; e < P; e++) dw_part[blockIdx.x * D + (int64_t)c * P + e] = dwa[k][e];
    }
}

// LayerNorm forward: one block per row; mean, then variance around the mean (two passes, no
// cancellation), y = (x - mean) rstd w + b. mean, rstd (rows) fp32; w, b optional.
template <class T, class W>
__global__ void tsys_cuda__layernorm_fwd(T *y, float *mean, float *rstd, const T *x, const W *w, const W *b, int64_t D, float eps) {
    int64_t r = blockIdx.x;
    const T *xr = x + r * D;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) s += tsys_cuda__tof(xr[j]);
    float mu = tsys_cuda__block_sum(s) / (float)D;
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) { float d = tsys_cuda__tof(xr[j]) - mu; ss += d * d; }
    float rs = 1.0f / sqrtf(tsys_cuda__block_sum(ss) / (float)D + eps);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        float v = (tsys_cuda__tof(xr[j]) - mu) * rs;
        if (w) v *= tsys_cuda__tof(w[j]);
        if (b) v += tsys_cuda__tof(b[j]);
        y[r * D + j] = tsys_cuda__fromf<T>(v);
    }
    if (threadIdx.x == 0) { if (mean) mean[r] = mu; if (rstd) rstd[r] = rs; }
}

// LayerNorm backward, same tiling as rmsnorm_bwd; shared memory 2 D floats (dw and db partials).
//   xhat = (x - mean) rstd, g = dy w,  dx = rstd (g - mean(g) - xhat mean(g xhat)),  dw += dy xhat, db += dy
template <class T, class W>
__global__ void tsys_cuda__layernorm_bwd(T *dx, float *part, const T *dy, const T *x, const W *w,
                                         const float *mean, const float *rstd, int64_t rows, int64_t D) {
    extern __shared__ float acc[];   // [0, D): dw, [D, 2D): db
    for (int64_t j = threadIdx.x; j < 2 * D; j += blockDim.x) acc[j] = 0.0f;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *dyr = dy + r * D, *xr = x + r * D;
        float mu = mean[r], rs = rstd[r], sg = 0.0f, sgx = 0.0f;
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
            float g = tsys_cuda__tof(dyr[j]) * (w ? tsys_cuda__tof(w[j]) : 1.0f);
            float xh = (tsys_cuda__tof(xr[j]) - mu) * rs;
            sg += g; sgx += g * xh;
        }
        sg = tsys_cuda__block_sum(sg) / (float)D;
        sgx = tsys_cuda__block_sum(sgx) / (float)D;
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
            float dyj = tsys_cuda__tof(dyr[j]);
            float g = dyj * (w ? tsys_cuda__tof(w[j]) : 1.0f);
            float xh = (tsys_cuda__tof(xr[j]) - mu) * rs;
            if (dx) dx[r * D + j] = tsys_cuda__fromf<T>(rs * (g - sg - xh * sgx));
            acc[j] += dyj * xh;
            acc[D + j] += dyj;
        }
    }
    if (part)
        for (int64_t j = threadIdx.x; j < 2 * D; j += blockDim.x) part[blockIdx.x * 2 * D + j] = acc[j];
}

// Blocks for the norm backward kernels: enough to fill the GPU twice, never more than rows.
static int tsys_cuda__norm_bwd_blocks(const tsys_cuda__state *st, int64_t rows) {
    int64_t g = (int64_t)st->num_sms * 2;
    return (int)(rows < g ? (rows > 0 ? rows : 1) : g);
}

// >>rope ------------------------------------------------------------------------------------------
// RoPE with interleaved pairs (2j, 2j+1) of rows of D; angle = pos * theta^(-2j/D) in fp32 as torch
// does; dir = -1 rotates backwards (the gradient). mode (TSYS_K_ROPE's i0): 0 rows of (.., T, D) in
// place of layout, position = row % T; 1 x (B, T, H, D) -> y (B, H, T, D) (a projection's heads to
// attention's layout, the transpose in the same pass); 2 x (B, H, T, D) -> y (B, T, H, D). A thread
// takes E elements of one output row (E/2 pairs): a 16-byte pack when rows are whole packs and
// aligned, else one pair. Output-ordered, so writes are coalesced; a source row is contiguous too.
__device__ __forceinline__ int64_t tsys_cuda__rope_src(int64_t o, int64_t H, int64_t T, int mode, int64_t *t) {
    if (mode == 2) { int64_t b = o / (T * H), tt = (o / H) % T, h = o % H; *t = tt; return (b * H + h) * T + tt; }
    int64_t b = o / (H * T), h = (o / T) % H, tt = o % T;
    *t = tt;
    return mode == 1 ? (b * T + tt) * H + h : o;
}
// The angle of pair j at position t: sine (times dir) and cosine, in fp32 as torch computes them.
__device__ __forceinline__ void tsys_cuda__rope_angle(float theta, int64_t j, int64_t D, int64_t t, float dir, float *sn, float *cs) {
    float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)D);
    sincosf((float)t * inv_freq, sn, cs);
    *sn *= dir;
}
template <class T, int E>
__global__ void tsys_cuda__rope(T *y, const T *x, int64_t rows, int64_t H, int64_t T_len, int64_t D, float theta, float dir, int mode) {
    int64_t per_row = D / E, n = rows * per_row;
    for (int64_t q = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; q < n; q += (int64_t)gridDim.x * blockDim.x) {
        int64_t o = q / per_row, c = (q % per_row) * E, t;
        int64_t src = tsys_cuda__rope_src(o, H, T_len, mode, &t);
        tsys_cuda__pack<T> in, out;   // E <= a pack's elements
        if (E * sizeof(T) == 16) in = *(const tsys_cuda__pack<T> *)(x + src * D + c);
        else for (int e = 0; e < E; e++) in.v[e] = x[src * D + c + e];
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            float sn, cs;
            tsys_cuda__rope_angle(theta, (c + e) / 2, D, t, dir, &sn, &cs);
            float x0 = tsys_cuda__tof(in.v[e]), x1 = tsys_cuda__tof(in.v[e + 1]);
            out.v[e] = tsys_cuda__fromf<T>(x0 * cs - x1 * sn);
            out.v[e + 1] = tsys_cuda__fromf<T>(x0 * sn + x1 * cs);
        }
        if (E * sizeof(T) == 16) *(tsys_cuda__pack<T> *)(y + o * D + c) = out;
        else for (int e = 0; e < E; e++) y[o * D + c + e] = out.v[e];
    }
}

// The same with the angles computed once a position, 32-bit indices (64-bit division and remainder are
// instruction sequences, a large part of the row kernel's time at the training shapes): block (t, g) takes the rows at position t of
// batch g (layouts 1 and 2: H rows) or of chunk g (layout 0: rows t + k T, k in [g kb, g kb + kb)).
// Its threads put the position's D/2 cosines and sines into shared memory (the expressions above),
// then rotate the rows E elements a thread: powf and sincosf were most of the kernel's work when each
// thread computed its own.
template <class T, int E, class I>
__global__ void tsys_cuda__rope_pos(T *y, const T *x, I rows, I H, I T_len, I D, I kb, float theta, float dir, int mode) {
    extern __shared__ float tsys_cuda__rope_angles[];   // cosines, then sines (dir applied)
    float *cs_t = tsys_cuda__rope_angles, *sn_t = cs_t + D / 2;
    const I t = blockIdx.x % T_len, g = blockIdx.x / T_len;
    for (I j = threadIdx.x; j < D / 2; j += blockDim.x) tsys_cuda__rope_angle(theta, j, D, t, dir, &sn_t[j], &cs_t[j]);
    __syncthreads();
    const I per_row = D / E, members = mode == 0 ? kb : H, K = rows / T_len;
    for (I q = threadIdx.x; q < members * per_row; q += blockDim.x) {
        const I m = q / per_row, c = (q % per_row) * E;
        I src, o;
        if (mode == 0) { I k = g * kb + m; if (k >= K) break; src = o = t + k * T_len; }   // members ascend with q: the rest are past K too
        else if (mode == 1) { src = (g * T_len + t) * H + m; o = (g * H + m) * T_len + t; }
        else { src = (g * H + m) * T_len + t; o = (g * T_len + t) * H + m; }
        tsys_cuda__pack<T> in, out;   // E <= a pack's elements
        if (E * sizeof(T) == 16) in = *(const tsys_cuda__pack<T> *)(x + src * D + c);
        else for (int e = 0; e < E; e++) in.v[e] = x[src * D + c + e];
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            const float cs = cs_t[(c + e) / 2], sn = sn_t[(c + e) / 2];
            float x0 = tsys_cuda__tof(in.v[e]), x1 = tsys_cuda__tof(in.v[e + 1]);
            out.v[e] = tsys_cuda__fromf<T>(x0 * cs - x1 * sn);
            out.v[e + 1] = tsys_cuda__fromf<T>(x0 * sn + x1 * cs);
        }
        if (E * sizeof(T) == 16) *(tsys_cuda__pack<T> *)(y + o * D + c) = out;
        else for (int e = 0; e < E; e++) y[o * D + c + e] = out.v[e];
    }
}

// >>softmax ---------------------------------------------------------------------------------------
// Softmax over rows of N with a scale and an optional causal mask: row r of each square (N, N) block
// keeps columns <= r % N, the rest become exactly 0 (the op layer rejects non-square causal input). One block per row, three passes over the row (max,
// sum of exp, write); the row stays in L1/L2 between passes. Input and output dtype T.
template <class T>
__global__ void tsys_cuda__softmax_fwd(T *y, const T *x, int64_t N, float scale, int causal) {
    int64_t r = blockIdx.x;
    const T *xr = x + r * N;
    T *yr = y + r * N;
    int64_t valid = causal ? (r % N) + 1 : N;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) mx = fmaxf(mx, scale * tsys_cuda__tof(xr[j]));
    mx = tsys_cuda__block_max(mx);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) sum += expf(scale * tsys_cuda__tof(xr[j]) - mx);
    float inv = 1.0f / tsys_cuda__block_sum(sum);
    for (int64_t j = threadIdx.x; j < N; j += blockDim.x)
        yr[j] = tsys_cuda__fromf<T>(j < valid ? expf(scale * tsys_cuda__tof(xr[j]) - mx) * inv : 0.0f);
}

// The same with the row in registers: each thread loads up to MAXV 16-byte packs once (a pack past
// the causal limit is not read), so a row costs one read and one write. For rows of whole packs
// (N a multiple of 16 / sizeof(T), 16-byte aligned) of at most MAXV packs a thread. WARP: a warp
// per row (rows of at most 32 x MAXV packs; no block-wide synchronization), else a block per row.
#define TSYS_CUDA__SOFTMAX_ROW(WARP, rows)                                                              \
    const int lane = WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x, width = WARP ? 32 : (int)blockDim.x; \
    const int64_t r = WARP ? (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5) : (int64_t)blockIdx.x; \
    if (r >= (rows)) return;   /* a whole warp leaves: WARP reductions are warp-wide */
template <class T, int MAXV, bool WARP>
__global__ void tsys_cuda__softmax_fwd_reg(T *y, const T *x, int64_t rows, int64_t N, float scale, int causal) {
    constexpr int V = 16 / sizeof(T);
    TSYS_CUDA__SOFTMAX_ROW(WARP, rows)
    int64_t valid = causal ? (r % N) + 1 : N;
    const tsys_cuda__pack<T> *xr = reinterpret_cast<const tsys_cuda__pack<T> *>(x + r * N);
    tsys_cuda__pack<T> *yr = reinterpret_cast<tsys_cuda__pack<T> *>(y + r * N);
    int npk = (int)(N / V);
    float v[MAXV][V], mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        int i = k * width + lane;
        int64_t j0 = (int64_t)i * V;
        tsys_cuda__pack<T> p;
        bool load = i < npk && j0 < valid;
        if (load) p = xr[i];
#pragma unroll
        for (int t = 0; t < V; t++) {
            v[k][t] = load && j0 + t < valid ? scale * tsys_cuda__tof(p.v[t]) : -INFINITY;
            mx = fmaxf(mx, v[k][t]);
        }
    }
    mx = WARP ? tsys_cuda__warp_max(mx) : tsys_cuda__block_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < MAXV; k++)
#pragma unroll
        for (int t = 0; t < V; t++) { v[k][t] = expf(v[k][t] - mx); sum += v[k][t]; }   // masked: exp(-inf) = 0
    float inv = 1.0f / (WARP ? tsys_cuda__warp_sum(sum) : tsys_cuda__block_sum(sum));
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        int i = k * width + lane;
        if (i >= npk) continue;
        tsys_cuda__pack<T> p;
#pragma unroll
        for (int t = 0; t < V; t++) p.v[t] = tsys_cuda__fromf<T>(v[k][t] * inv);
        yr[i] = p;
    }
}

// dx = scale * y * (dy - sum(dy * y)); masked entries have y = 0 and get dx = 0.
template <class T>
__global__ void tsys_cuda__softmax_bwd(T *dx, const T *dy, const T *y, int64_t N, float scale) {
    int64_t r = blockIdx.x;
    const T *dyr = dy + r * N, *yr = y + r * N;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < N; j += blockDim.x) dot += tsys_cuda__tof(dyr[j]) * tsys_cuda__tof(yr[j]);
    dot = tsys_cuda__block_sum(dot);
    for (int64_t j = threadIdx.x; j < N; j += blockDim.x)
        dx[r * N + j] = tsys_cuda__fromf<T>(scale * tsys_cuda__tof(yr[j]) * (tsys_cuda__tof(dyr[j]) - dot));
}

// The same with packs in registers (as softmax_fwd_reg): dy and y are read once, and under the causal
// mask only up to the row's limit (past it y is 0, so dx is 0).
template <class T, int MAXV, bool WARP>
__global__ void tsys_cuda__softmax_bwd_reg(T *dx, const T *dy, const T *y, int64_t rows, int64_t N, float scale, int causal) {
    constexpr int V = 16 / sizeof(T);
    TSYS_CUDA__SOFTMAX_ROW(WARP, rows)
    int64_t valid = causal ? (r % N) + 1 : N;
    const tsys_cuda__pack<T> *dyr = reinterpret_cast<const tsys_cuda__pack<T> *>(dy + r * N), *yr = reinterpret_cast<const tsys_cuda__pack<T> *>(y + r * N);
    tsys_cuda__pack<T> *dxr = reinterpret_cast<tsys_cuda__pack<T> *>(dx + r * N);
    int npk = (int)(N / V);
    float g[MAXV][V], p[MAXV][V], dot = 0.0f;
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        int i = k * width + lane;
        bool load = i < npk && (int64_t)i * V < valid;
        tsys_cuda__pack<T> a, b;
        if (load) { a = dyr[i]; b = yr[i]; }
#pragma unroll
        for (int t = 0; t < V; t++) {
            g[k][t] = load ? tsys_cuda__tof(a.v[t]) : 0.0f;
            p[k][t] = load ? tsys_cuda__tof(b.v[t]) : 0.0f;
            dot += g[k][t] * p[k][t];
        }
    }
    dot = WARP ? tsys_cuda__warp_sum(dot) : tsys_cuda__block_sum(dot);
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        int i = k * width + lane;
        if (i >= npk) continue;
        tsys_cuda__pack<T> o;
#pragma unroll
        for (int t = 0; t < V; t++) o.v[t] = tsys_cuda__fromf<T>(scale * p[k][t] * (g[k][t] - dot));
        dxr[i] = o;
    }
}

// Threads a row for a register-row softmax of n elements in 16-byte packs of `per_pack`, MAXV packs
// a thread at most: 32 (a warp per row, 8 rows a block), else a multiple of 32 up to 1024 (a block
// per row); 0 when the row does not fit (the plain kernel runs).
static int tsys_cuda__softmax_reg_threads(int64_t n, int per_pack, int maxv, const void *a, const void *b, const void *c) {
    bool aligned = ((uintptr_t)a | (uintptr_t)b | (uintptr_t)(c ? c : a)) % 16 == 0;
    if (!aligned || n % per_pack != 0) return 0;
    int64_t packs = n / per_pack, t = (packs + maxv - 1) / maxv;
    t = (t + 31) / 32 * 32;
    if (t > 32 && t < 64) t = 64;
    return t <= 1024 ? (int)t : 0;
}
// The most threads a block of kernel k can launch with (its registers decide: a register-row kernel may not
// fit 1024 threads); read once per kernel.
template <class K> static int tsys_cuda__block_threads_max(K k) {
    cudaFuncAttributes fa;
    const cudaError_t e = cudaFuncGetAttributes(&fa, k);
    return e == cudaSuccess ? fa.maxThreadsPerBlock : (cudaGetLastError(), 0);
}

// >>cross entropy ---------------------------------------------------------------------------------
// CE forward, stage 1: one block per row of V logits; each thread keeps an online (max, sum) over its
// columns, the block merges them: lse[r] = max + log(sum exp(x - max)). Stage 2 (ce_loss, one block)
// adds lse[r] - x[r, target[r]] over rows in a fixed order: loss = that sum / rows. A target outside
// [0, V) is never read through: it counts 0 and is reported (tsys_cuda__fault).
template <class T>
__global__ void tsys_cuda__ce_lse(float *lse, const T *logits, int64_t V) {
    int64_t r = blockIdx.x;
    const T *xr = logits + r * V;
    float m = -INFINITY, s = 0.0f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        float v = tsys_cuda__tof(xr[j]);
        if (v > m) { s = s * expf(m - v) + 1.0f; m = v; }
        else s += expf(v - m);
    }
    float M = tsys_cuda__block_max(m);
    s = (m == -INFINITY) ? 0.0f : s * expf(m - M);
    s = tsys_cuda__block_sum(s);
    if (threadIdx.x == 0) lse[r] = M + logf(s);
}

template <class T>
__global__ void tsys_cuda__ce_loss(float *loss, const float *lse, const T *logits, const void *targets, int tdt, int64_t rows, int64_t V,
                                   tsys_cuda__fault *fault) {
    float acc = 0.0f;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
        int64_t t = tsys_cuda__ld_id(targets, tdt, r);
        if (t >= 0 && t < V) acc += lse[r] - tsys_cuda__tof(logits[r * V + t]);
        else tsys_cuda__bad_id(fault, TSYS_K_CE_FWD, r, t, V);
    }
    acc = tsys_cuda__block_sum(acc);
    if (threadIdx.x == 0) *loss = acc / (float)rows;
}

// CE backward straight from logits and lse (no probabilities tensor): one block per row,
// dlogits = dloss * inv_rows * (exp(x - lse) - [j == target]). dloss is read on the device.
template <class T, class D>
__global__ void tsys_cuda__ce_bwd(D *dlogits, const T *logits, const float *lse, const void *targets, int tdt,
                                  const void *dloss, int ddt, float inv_rows, int64_t V, tsys_cuda__fault *fault) {
    int64_t r = blockIdx.x;
    float g = tsys_cuda__ld(dloss, ddt, 0) * inv_rows, l = lse[r];
    int64_t t = tsys_cuda__ld_id(targets, tdt, r);
    if ((t < 0 || t >= V) && threadIdx.x == 0) tsys_cuda__bad_id(fault, TSYS_K_CE_BWD, r, t, V);   // no column matches it
    const T *xr = logits + r * V;
    D *dr = dlogits + r * V;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
        dr[j] = tsys_cuda__fromf<D>(g * (expf(tsys_cuda__tof(xr[j]) - l) - (j == t ? 1.0f : 0.0f)));
}

// >>embedding -------------------------------------------------------------------------------------
// Forward gather: one block per token, threads over D. An id outside [0, V) gives a row of zeros
// and is reported (tsys_cuda__fault).
__global__ void tsys_cuda__embed_fwd(void *out, int odt, const void *w, int wdt, const void *ids, int idt, int64_t V, int64_t D,
                                     tsys_cuda__fault *fault) {
    int64_t i = blockIdx.x, id = tsys_cuda__ld_id(ids, idt, i);
    bool ok = id >= 0 && id < V;
    if (!ok && threadIdx.x == 0) tsys_cuda__bad_id(fault, TSYS_K_EMBED_FWD, i, id, V);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
        tsys_cuda__st(out, odt, i * D + j, ok ? tsys_cuda__ld(w, wdt, id * D + j) : 0.0f);
}

// Backward, deterministic without float atomics: (id, position) pairs are radix-sorted (stable, so
// positions stay ascending within an id), then one block per run of equal ids adds the rows of dy
// in position order and adds the total to dW[id]. Blocks that do not start a run exit at once.
__global__ void tsys_cuda__embed_keys(int32_t *keys, int32_t *pos, const void *ids, int idt, int64_t N, int64_t V, tsys_cuda__fault *fault) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t id = tsys_cuda__ld_id(ids, idt, i);
        if (id < 0 || id >= V) tsys_cuda__bad_id(fault, TSYS_K_EMBED_BWD, i, id, V);
        keys[i] = (id >= 0 && id < V) ? (int32_t)id : (int32_t)V;   // out-of-range ids sort last and are skipped
        pos[i] = (int32_t)i;
    }
}

__global__ void tsys_cuda__embed_bwd_runs(float *dw, const void *dy, int dydt, const int32_t *keys, const int32_t *pos, int64_t N, int64_t V, int64_t D) {
    int64_t s = blockIdx.x;
    int32_t id = keys[s];
    if (id >= V || (s > 0 && keys[s - 1] == id)) return;
    int64_t e = s;
    while (e < N && keys[e] == id) e++;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        float acc = 0.0f;
        for (int64_t k = s; k < e; k++) acc += tsys_cuda__ld(dy, dydt, (int64_t)pos[k] * D + j);
        dw[(int64_t)id * D + j] += acc;
    }
}

// >>transpose -------------------------------------------------------------------------------------
// (A, B, C, D) -> (A, C, B, D): each output row of D elements is one contiguous input row, so the
// copy moves whole rows in units U (16 bytes when the row allows it, else the element size).
// I: the index type (32-bit where every index fits: 64-bit division was a large part of its time).
template <class U, class I>
__global__ void tsys_cuda__transpose12(U *out, const U *in, I A, I B, I C, I Du) {
    I n = A * B * C * Du;
    for (I i = blockIdx.x * (I)blockDim.x + threadIdx.x; i < n; i += (I)gridDim.x * blockDim.x) {
        I e = i % Du, o = i / Du;        // o = (a, c, b) output row
        I b = o % B, t = o / B, c = t % C, a = t / C;
        out[i] = in[((a * B + b) * C + c) * Du + e];
    }
}
template <class U>
static tsys_status tsys_cuda__transpose12_launch(tsys_cuda__state *st, void *out, const void *in, int64_t A, int64_t B, int64_t C, int64_t Du) {
    const int64_t n = A * B * C * Du;
    if (n < ((int64_t)1 << 31))   // and the grid-stride step past the last index does not wrap
        TSYS_CUDA__LAUNCH(st, (tsys_cuda__transpose12<U, uint32_t>), tsys_cuda__grid(st, n, 256), 256, 0, (U *)out, (const U *)in, (uint32_t)A, (uint32_t)B, (uint32_t)C, (uint32_t)Du);
    else TSYS_CUDA__LAUNCH(st, (tsys_cuda__transpose12<U, int64_t>), tsys_cuda__grid(st, n, 256), 256, 0, (U *)out, (const U *)in, A, B, C, Du);
    return TSYS_OK;
}

// >>flash -----------------------------------------------------------------------------------------
// FlashAttention-2, forward and backward (sm_80+, tuned on sm_90): the kernels behind TSYS_K_FLASH_FWD/BWD.
//
// defines: tsys_cuda__flash_fwd, tsys_cuda__flash_bwd, tsys_cuda__flash_bwd_scratch_bytes,
//          tsys_cuda__flash_supported, tsys_cuda__flash_wg_probe, tsys_cuda__flash_tmap_encoder
//
// Sub-tags: >>flash ptx (cp.async, ldmatrix, ex2 and the mma.sync fragment helpers), >>flash mma.sync (the
// bf16/fp16 kernels for every head dim, and fp32 on TF32), >>flash fp32 (SIMT kernels: exact fp32), >>flash wgmma (Hopper kernels and the
// wgmma wrapper), >>flash warp-specialized (TMA producer and consumer warpgroups), >>flash launchers (tile
// configurations, launchers, the implementation pick and the entry points).
//
// Layout everywhere: q, k, v, o and their gradients are (bh, n, d) contiguous in the one input dtype
// (fp32, bf16 or fp16); lse is (bh, n) fp32, natural log, lse_i = logsumexp_j(scale * q_i . k_j) over the
// kept keys. Causal keeps key j for query i when i >= j (the CS336 rule); masked scores are -inf here,
// which gives the same O and lse as the handout's +(-1e6) because exp(-1e6 - m) is 0 in fp32.
//
// Kernels (bf16/fp16: tensor cores, mma.sync m16n8k16 with fp32 accumulation; fp32: the same kernels on
// TF32 (m16n8k8), or a SIMT version when the caller asks for exact fp32):
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
// first. Head dims: 16, 32, 64, 80, 96, 128 (the tensor-core kernels need d % 16 == 0; d = 80 is 5 k-steps).
// (256 is not among them: the mma.sync kernels keep a warp's rows x D accumulators in registers, 256 a thread
// for the forward's O at D = 256 and as many for dK + dV, past the 255 a thread has; it needs D split over warps.)
//
// Which kernels run for bf16/fp16 at d = 64 and 128 is the caller's tsys_cuda_flash_impl (the backend keeps
// it per context: tsys_cuda_desc.flash, tsys_cuda_set_flash_impl):
//   MMA    the mma.sync kernels (which fp32 on TF32, and bf16/fp16 at other head dims where they are not padded
//          onto the Hopper kernels, run anyway);
//   WGMMA  wgmma versions of the three tensor-core kernels (tsys_cuda__flash_*_wg_kernel), cp.async loads;
//   WS     the forward and dQ as warp-specialized versions of those (tsys_cuda__flash_*_ws_kernel: a TMA
//          producer warpgroup and consumer warpgroups handing tiles over through mbarriers), dK/dV on the
//          wgmma kernel; cudaErrorNotSupported when TMA cannot read an input (no tensor map);
//   AUTO   WS, and WGMMA for a call whose inputs TMA cannot read.
// bf16/fp16 at d = 16 and 32 under WS (and under AUTO from 16384 rows: the forward, and the backward at d 32):
// zero-padded to 64 columns and run on the d = 64 Hopper kernels; d = 80 and 96 padded to 128 under WS (and AUTO
// from 8192 rows) (tsys_cuda__flash_pad).
// fp32 on TF32 at d = 64, 128 under WS (and AUTO from 2048 rows): the warp-specialized forward with tf32 wgmmas (its rounded K and
// V^T copies in the forward's scratch); the backward, and every other fp32 case, stays on mma.sync.
// WGMMA, WS and AUTO need a binary built for sm_90a (-gencode arch=compute_90a,code=sm_90a) running on a
// Hopper GPU (tsys_cuda__flash_wg_probe says so); the caller checks that once (>>init), not per call.
//
// Self-contained: CUDA runtime only (the TMA tensor-map encoder is fetched from the driver at run time),
// no backend state. The launchers return cudaError_t (cudaErrorInvalidValue for a shape they don't
// support) and never synchronise. TSYS_CUDA_NO_FLASH leaves the whole section out.
#ifndef TSYS_CUDA_NO_FLASH

#define TSYS_CUDA__FLASH_LOG2E 1.4426950408889634f
#define TSYS_CUDA__FLASH_LN2 0.6931471805599453f

// >>flash ptx -------------------------------------------------------------------------------------
// PTX helpers: cp.async (16-byte global -> shared, zero-filled when the row is out of range),
// ldmatrix (four 8x8 b16 tiles from shared into mma fragments) and the m16n8k16 mma.
//
// mma.m16n8k16 fragment layout (lane = threadIdx.x % 32, g = lane / 4, c = lane % 4):
//   A 16x16 (row-major): a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]
//   B 16x8  (k x n):     b0 = B[2c..2c+1][g],  b1 = B[2c+8..2c+9][g]
//   C 16x8  (fp32):      c0,c1 = C[g][2c..2c+1], c2,c3 = C[g+8][2c..2c+1]
// Two C tiles side by side (16 x 16) are, once rounded to 16 bits and paired, exactly an A fragment:
// that is how P and dS go from one matmul's accumulators to the next matmul's input without shared memory.

__device__ __forceinline__ uint32_t tsys_cuda__flash_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void tsys_cuda__flash_cp_async16(void *smem, const void *gmem, bool pred) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tsys_cuda__flash_smem_addr(smem)), "l"(gmem),
                 "r"(pred ? 16 : 0));
}
// 4-byte version (through L1); size 0 zero-fills the destination without reading.
__device__ __forceinline__ void tsys_cuda__flash_cp_async4(void *smem, const void *gmem, bool pred) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(tsys_cuda__flash_smem_addr(smem)), "l"(gmem),
                 "r"(pred ? 4 : 0));
}
__device__ __forceinline__ void tsys_cuda__flash_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void tsys_cuda__flash_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void tsys_cuda__flash_ldsm_x4(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tsys_cuda__flash_smem_addr(p)));
}
__device__ __forceinline__ void tsys_cuda__flash_ldsm_x4_t(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tsys_cuda__flash_smem_addr(p)));
}

// 2^x on the special-function unit (flush-to-zero; exp2f without fast-math adds denormal fix-ups).
// 2^-inf = 0, which is what the masks rely on.
__device__ __forceinline__ float tsys_cuda__flash_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// The element type's mma, and how fragments are prepared and pairs of results stored. The 16-bit types:
// fragments go to the mma as loaded, results are packed two to a word (low half = the lower column).
template <typename T> struct tsys_cuda__flash_t;
template <typename T> struct tsys_cuda__flash_t16 {
    static __device__ __forceinline__ void prep(uint32_t *) {}
    static __device__ __forceinline__ void store2(T *p, float lo, float hi) { *(uint32_t *)p = tsys_cuda__flash_t<T>::pack(lo, hi); }
};
template <> struct tsys_cuda__flash_t<__nv_bfloat16> : tsys_cuda__flash_t16<__nv_bfloat16> {
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
template <> struct tsys_cuda__flash_t<__half> : tsys_cuda__flash_t16<__half> {
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
// fp32 inputs on TF32 tensor cores: mma.m16n8k8.tf32, whose fragments hold one element a register:
//   A 16x8: a0 = A[g][c], a1 = A[g+8][c], a2 = A[g][c+4], a3 = A[g+8][c+4];  B 8x8: b0 = B[c][g], b1 = B[c+4][g]
// (C as for m16n8k16). ldmatrix.b16 moves 32-bit words as pairs of halves, so the same row addresses give
// these fragments from fp32 tiles. Operands are rounded to TF32 to nearest (cvt.rna), not truncated.
template <> struct tsys_cuda__flash_t<float> {
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t tf32(float x) {
        uint32_t r;
        asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
        return r;
    }
    static __device__ __forceinline__ void prep(uint32_t *r) {
#pragma unroll
        for (int i = 0; i < 4; i++) r[i] = tf32(__uint_as_float(r[i]));
    }
    static __device__ __forceinline__ void store2(float *p, float lo, float hi) { *(float2 *)p = make_float2(lo, hi); }
};

// Shared-memory tiles hold R rows of D elements with a row stride of D + E, E = 16 / sizeof(T) (one 16-byte
// chunk): the pad puts the 8 rows one ldmatrix phase reads into 8 different 16-byte bank groups for every D
// used here; for fp32 (D + 4 floats) it also spreads the scalar B reads of tsys_cuda__flash_gemm_pn (rows 2c
// and 2c + 1, columns g) over 32 banks.
template <typename T> constexpr int tsys_cuda__flash_e16 = 16 / (int)sizeof(T);   // elements of a 16-byte chunk
template <typename T, int D> struct tsys_cuda__flash_smem { static constexpr int E = tsys_cuda__flash_e16<T>, SD = D + E; };

// Copy rows [r0, r0 + R) of a (n, D) matrix into a padded shared tile; rows >= n become zeros, so a tail
// tile adds nothing to any product (the masks drop those rows too).
template <int R, int D, int NT, typename T>
__device__ __forceinline__ void tsys_cuda__flash_load_tile(T *s, const T *g, int r0, int n) {
    constexpr int E = tsys_cuda__flash_smem<T, D>::E, CPR = D / E, SD = tsys_cuda__flash_smem<T, D>::SD;   // CPR: 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < R * CPR; c += NT) {
        const int r = c / CPR, cc = c % CPR;
        const bool ok = r0 + r < n;
        tsys_cuda__flash_cp_async16(s + r * SD + cc * E, g + (size_t)(ok ? r0 + r : 0) * D + cc * E, ok);
    }
}

// Load the A fragment of a 16 x 16 block at (row r0, col c0) of a padded row-major shared tile.
template <int SD, typename T>
__device__ __forceinline__ void tsys_cuda__flash_lda(uint32_t a[4], const T *s, int r0, int c0, int lane) {
    tsys_cuda__flash_ldsm_x4(a, s + (r0 + (lane & 15)) * SD + c0 + (lane >> 4) * tsys_cuda__flash_e16<T>);
}
// B fragments of two n-blocks for C = A X^T where X is stored row-major (rows = n, cols = k):
// rows n0..n0+15, k cols c0..c0+15. b[0], b[1] feed n-block n0, b[2], b[3] n-block n0 + 8.
template <int SD, typename T>
__device__ __forceinline__ void tsys_cuda__flash_ldb(uint32_t b[4], const T *s, int n0, int c0, int lane) {
    tsys_cuda__flash_ldsm_x4(b, s + (n0 + (lane & 7) + (lane >> 4) * 8) * SD + c0 + ((lane >> 3) & 1) * tsys_cuda__flash_e16<T>);
}
// B fragments of two n-blocks for C = A X where X is stored row-major (rows = k, cols = n):
// k rows k0..k0+15, n cols n0..n0+15 (ldmatrix transposes on the way).
template <int SD, typename T>
__device__ __forceinline__ void tsys_cuda__flash_ldb_t(uint32_t b[4], const T *s, int k0, int n0, int lane) {
    tsys_cuda__flash_ldsm_x4_t(b, s + (k0 + (lane & 15)) * SD + n0 + (lane >> 4) * 8);
}

// acc[M/16 rows][N/8 n-blocks] (+)= A (M x K, rows r0.., shared) * X^T (X: N x K rows n0.., shared),
// for one warp. MT m-tiles share every B fragment, which halves the shared-memory reads per mma.
template <typename T, int SD, int MT, int N, int K>
__device__ __forceinline__ void tsys_cuda__flash_gemm_nt(float (*acc)[N / 8][4], const T *sa, int r0, const T *sx, int lane) {
    constexpr int KS = 2 * tsys_cuda__flash_e16<T>;   // the k of one mma: 16 (16-bit), 8 (tf32)
#pragma unroll
    for (int kk = 0; kk < K / KS; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            tsys_cuda__flash_lda<SD>(a[mt], sa, r0 + mt * 16, kk * KS, lane);
            tsys_cuda__flash_t<T>::prep(a[mt]);
        }
#pragma unroll
        for (int nb = 0; nb < N / 16; nb++) {
            uint32_t b[4];
            tsys_cuda__flash_ldb<SD>(b, sx, nb * 16, kk * KS, lane);
            tsys_cuda__flash_t<T>::prep(b);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                tsys_cuda__flash_t<T>::mma(acc[mt][2 * nb], a[mt], b[0], b[1]);
                tsys_cuda__flash_t<T>::mma(acc[mt][2 * nb + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc (M x N) += P (M x K, fp32 accumulators of a previous gemm, rounded here) * X (X: K x N rows k.., shared).
// tf32: the accumulators hold columns 2c, 2c + 1 of each 8-wide k block, the A fragment wants c and c + 4.
// The sum over k does not care about the order of k, so k is permuted within each block (A's column c is
// the accumulators' 2c, c + 4 is 2c + 1) and B's rows are read in the same order: b0 = X[2c][g],
// b1 = X[2c + 1][g] (scalar shared loads; ldmatrix cannot transpose 32-bit elements).
template <typename T, int SD, int MT, int K, int N>
__device__ __forceinline__ void tsys_cuda__flash_gemm_pn(float (*acc)[N / 8][4], float (*p)[K / 8][4], const T *sx, int lane) {
    if constexpr (sizeof(T) == 4) {
        typedef tsys_cuda__flash_t<float> F;
        const T *xl = sx + 2 * (lane & 3) * SD + (lane >> 2);
#pragma unroll
        for (int kk = 0; kk < K / 8; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                a[mt][0] = F::tf32(p[mt][kk][0]); a[mt][1] = F::tf32(p[mt][kk][2]);
                a[mt][2] = F::tf32(p[mt][kk][1]); a[mt][3] = F::tf32(p[mt][kk][3]);
            }
#pragma unroll
            for (int nb = 0; nb < N / 8; nb++) {
                const uint32_t b0 = F::tf32(xl[kk * 8 * SD + nb * 8]), b1 = F::tf32(xl[(kk * 8 + 1) * SD + nb * 8]);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) F::mma(acc[mt][nb], a[mt], b0, b1);
            }
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < K / 16; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                a[mt][0] = tsys_cuda__flash_t<T>::pack(p[mt][2 * kk][0], p[mt][2 * kk][1]);
                a[mt][1] = tsys_cuda__flash_t<T>::pack(p[mt][2 * kk][2], p[mt][2 * kk][3]);
                a[mt][2] = tsys_cuda__flash_t<T>::pack(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
                a[mt][3] = tsys_cuda__flash_t<T>::pack(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int nb = 0; nb < N / 16; nb++) {
                uint32_t b[4];
                tsys_cuda__flash_ldb_t<SD>(b, sx, kk * 16, nb * 16, lane);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    tsys_cuda__flash_t<T>::mma(acc[mt][2 * nb], a[mt], b[0], b[1]);
                    tsys_cuda__flash_t<T>::mma(acc[mt][2 * nb + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
}

// A block's share [*b, *e) of the tiles [first, end) its loop would run: split of nsplit contiguous
// shares (the split kernels; nsplit = 1: all of them). A share may be empty.
__device__ __forceinline__ void tsys_cuda__flash_share(int first, int end, int nsplit, int split, int *b, int *e) {
    const int per = (end - first + nsplit - 1) / nsplit;
    *b = min(end, first + split * per);
    *e = min(end, *b + per);
}

template <int MT, int N>
__device__ __forceinline__ void tsys_cuda__flash_zero(float (*acc)[N / 8][4]) {
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
__device__ __forceinline__ void tsys_cuda__flash_store(T *g, float (*acc)[D / 8][4], int row0, int n, float mul, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = row0 + mt * 16 + (lane >> 2) + h * 8;
            if (row >= n) continue;
#pragma unroll
            for (int nb = 0; nb < D / 8; nb++) {
                const int col = nb * 8 + (lane & 3) * 2;
                tsys_cuda__flash_t<T>::store2(g + (size_t)row * D + col, acc[mt][nb][2 * h] * mul, acc[mt][nb][2 * h + 1] * mul);
            }
        }
}

// >>flash mma.sync --------------------------------------------------------------------------------
// Forward (bf16/fp16). Block: NW warps, BQ = NW * MT * 16 query rows; warp w owns rows
// [w*MT*16, (w+1)*MT*16) of the tile. Key/value tiles of BK rows are double-buffered in shared memory
// (cp.async for tile j+1 in flight while tile j is used). Per key tile and warp:
//   S = Q K^T (fp32, registers) -> scaled to log2 units, masked -> online softmax (row max and sum across
//   the 4 lanes of a quad) -> O = alpha O + P V with P re-used from registers as the A operand.
// The row sum l is kept per lane and reduced across the quad once, at the end.
// Shared memory: (BQ + 4 BK) * SD * sizeof(T) (SD: tsys_cuda__flash_smem).

// Which (tile, slice x share) a block works on, for a grid of (tiles, slices x shares): the hardware starts
// blocks in the order of blockIdx.y * gridDim.x + blockIdx.x, and that number is read tile-major (tile 0 of
// every slice, then tile 1, ...), so that causal grids start their longest blocks first across all slices: read
// slice by slice, each slice's longest block starts late and ends the kernel ~6% after the rest. Used by the
// warp-specialized kernels and the mma.sync forward (8-9% faster with it at 16 x 16384, bf16); the mma.sync
// backward keeps the slice-by-slice order (with this one its TF32 dK/dV at batch 1, d 64 ran 5-7% slower).
struct tsys_cuda__flash_block { int tile, ys; };
__device__ __forceinline__ tsys_cuda__flash_block tsys_cuda__flash_block_of() {
    const unsigned l = blockIdx.y * gridDim.x + blockIdx.x;
    return { (int)(l / gridDim.y), (int)(l % gridDim.y) };
}

template <typename T, int D, int MT, int BK, int NW, bool CAUSAL>
__global__ void __launch_bounds__(NW * 32)
tsys_cuda__flash_fwd_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ o,
                       float *__restrict__ lse, int n, float scale_log2, int nsplit, float *__restrict__ part) {
    constexpr int BQ = NW * MT * 16, SD = tsys_cuda__flash_smem<T, D>::SD, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *qs = (T *)tsys_cuda__flash_smem_raw;
    T *ks = qs + BQ * SD;        // [2][BK * SD]
    T *vs = ks + 2 * BK * SD;    // [2][BK * SD]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const tsys_cuda__flash_block blk = tsys_cuda__flash_block_of();
    const int qt = CAUSAL ? gridDim.x - 1 - blk.tile : blk.tile;   // causal: longest rows first
    const int q0 = qt * BQ, wr0 = warp * MT * 16;
    const int bhi = blk.ys / nsplit, split = blk.ys % nsplit, nbh = gridDim.y / nsplit;
    const size_t base = (size_t)bhi * n * D;
    q += base; k += base; v += base; o += base; lse += (size_t)bhi * n;

    // this block's key tiles: its share of those the query tile sees
    int nkt_all = (n + BK - 1) / BK, j0, nkt;
    if (CAUSAL) nkt_all = min(nkt_all, (q0 + BQ - 1) / BK + 1);
    tsys_cuda__flash_share(0, nkt_all, nsplit, split, &j0, &nkt);

    tsys_cuda__flash_load_tile<BQ, D, NT>(qs, q, q0, n);
    if (j0 < nkt) {
        tsys_cuda__flash_load_tile<BK, D, NT>(ks, k, j0 * BK, n);
        tsys_cuda__flash_load_tile<BK, D, NT>(vs, v, j0 * BK, n);
    }
    tsys_cuda__flash_cp_async_commit();

    float oacc[MT][D / 8][4];
    tsys_cuda__flash_zero<MT, D>(oacc);
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;

    for (int j = j0; j < nkt; j++) {
        const int buf = (j - j0) & 1;
        if (j + 1 < nkt) {   // prefetch the next key/value tile into the other buffer
            tsys_cuda__flash_load_tile<BK, D, NT>(ks + (buf ^ 1) * BK * SD, k, (j + 1) * BK, n);
            tsys_cuda__flash_load_tile<BK, D, NT>(vs + (buf ^ 1) * BK * SD, v, (j + 1) * BK, n);
            tsys_cuda__flash_cp_async_commit();
            tsys_cuda__flash_cp_async_wait<1>();
        } else {
            tsys_cuda__flash_cp_async_wait<0>();
        }
        __syncthreads();
        const int k0 = j * BK;
        // a warp whose rows all precede this tile's first key has nothing to add (causal diagonal)
        const bool active = !CAUSAL || k0 <= q0 + wr0 + MT * 16 - 1;
        if (active) {
            const T *kt = ks + buf * BK * SD, *vt = vs + buf * BK * SD;
            float s[MT][BK / 8][4];
            tsys_cuda__flash_zero<MT, BK>(s);
            tsys_cuda__flash_gemm_nt<T, SD, MT, BK, D>(s, qs, wr0, kt, lane);

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
                    const float alpha = tsys_cuda__flash_ex2(m[mt][h] - mref);
                    float sum = 0.0f;
#pragma unroll
                    for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const float p = tsys_cuda__flash_ex2(s[mt][nb][2 * h + e] - mref);
                            s[mt][nb][2 * h + e] = p;
                            sum += p;
                        }
                    l[mt][h] = l[mt][h] * alpha + sum;
                    m[mt][h] = mx;
#pragma unroll
                    for (int nb = 0; nb < D / 8; nb++) oacc[mt][nb][2 * h] *= alpha, oacc[mt][nb][2 * h + 1] *= alpha;
                }
            }
            tsys_cuda__flash_gemm_pn<T, SD, MT, BK, D>(oacc, s, vt, lane);
        }
        __syncthreads();   // everyone is done with this buffer before it is refilled
    }
    tsys_cuda__flash_cp_async_wait<0>();   // an empty share still loaded Q
    // split: this share's O normalized by its own sum and its lse (-inf, O = 0 for a row that saw no key
    // here), to [split][bh][n][D] and, after every O, [split][bh][n]; tsys_cuda__flash_split_combine merges
    float *po = part ? part + (size_t)split * nbh * n * D + base : nullptr;
    float *pl = part ? part + (size_t)nsplit * nbh * n * D + ((size_t)split * nbh + bhi) * n : nullptr;

    // epilogue: finish the row sums across the quad, normalise, write O and lse (natural log)
    float inv[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float sum = l[mt][h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inv[mt][h] = sum > 0.0f ? 1.0f / sum : 0.0f;
            const int row = q0 + wr0 + mt * 16 + (lane >> 2) + h * 8;
            const float l = sum > 0.0f ? (m[mt][h] + log2f(sum)) * TSYS_CUDA__FLASH_LN2 : -INFINITY;
            if ((lane & 3) == 0 && row < n) (pl ? pl : lse)[row] = l;
        }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nb = 0; nb < D / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) oacc[mt][nb][e] *= inv[mt][e >> 1];
    if (po) tsys_cuda__flash_store<float, MT, D>(po, oacc, q0 + wr0, n, 1.0f, lane);
    else tsys_cuda__flash_store<T, MT, D>(o, oacc, q0 + wr0, n, 1.0f, lane);
}

// ------------------------------------------------------------------------------------------------
// Backward pre-pass: dvec[row] = sum_c dO[row][c] * O[row][c] (fp32). One warp per row. TF32: the operands
// rounded as the TF32 mma rounds dO and V, so that dS = P (dP - D) cancels where it should (at one key,
// O = V and dP = D up to the order of the sum, not up to TF32's rounding).
template <typename T, bool TF32 = false>
__global__ void tsys_cuda__flash_bwd_dot_kernel(const T *__restrict__ dout, const T *__restrict__ o, float *__restrict__ dvec,
                                           int64_t rows, int d) {
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32) {
        float x = (float)dout[row * d + c], y = (float)o[row * d + c];
        if constexpr (TF32) {
            x = __uint_as_float(tsys_cuda__flash_t<float>::tf32(x));
            y = __uint_as_float(tsys_cuda__flash_t<float>::tf32(y));
        }
        acc += x * y;
    }
#pragma unroll
    for (int off = 16; off; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) dvec[row] = acc;
}
// The same for 16-bit inputs with D a multiple of 8 and both tensors 16-byte aligned: D / 8 threads a row, one
// 16-byte load of each tensor per thread (the warp-per-row kernel above issues 2-byte loads and, at d 64,
// measured 0.050 ms at 16 x 16384 rows on an H100, twice what its 67 MB take to read).
template <typename T, int D>
__global__ void tsys_cuda__flash_bwd_dot16_kernel(const T *__restrict__ dout, const T *__restrict__ o, float *__restrict__ dvec, int64_t rows) {
    static_assert(sizeof(T) == 2 && D % 8 == 0 && 32 % (D / 8) == 0, "16-bit, D / 8 threads a row dividing a warp");
    constexpr int G = D / 8;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, row = i / G;
    const bool live = row < rows;
    float acc = 0.0f;
    if (live) {
        const uint4 x = ((const uint4 *)dout)[i], y = ((const uint4 *)o)[i];
        const T *xs = (const T *)&x, *ys = (const T *)&y;
#pragma unroll
        for (int e = 0; e < 8; e++) acc += (float)xs[e] * (float)ys[e];
    }
#pragma unroll
    for (int off = G / 2; off; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (live && i % G == 0) dvec[row] = acc;
}
template <typename T, int D, bool TF32 = false>
static void tsys_cuda__flash_bwd_dot(const T *dout, const T *o, float *dvec, int64_t rows, cudaStream_t s) {
    if constexpr (sizeof(T) == 2 && D % 8 == 0 && 32 % (D / 8) == 0)
        if (tsys_cuda__aligned16(dout) && tsys_cuda__aligned16(o)) {
            tsys_cuda__flash_bwd_dot16_kernel<T, D><<<(unsigned)((rows * (D / 8) + 255) / 256), 256, 0, s>>>(dout, o, dvec, rows);
            return;
        }
    tsys_cuda__flash_bwd_dot_kernel<T, TF32><<<(unsigned)((rows + 7) / 8), 256, 0, s>>>(dout, o, dvec, rows, D);
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
// Shared memory: (2 BKV + 4 BQ) * SD * sizeof(T) + 4 BQ * 4.

template <typename T, int D, int MK, int BQ, int NW, bool CAUSAL>
__global__ void __launch_bounds__(NW * 32)
tsys_cuda__flash_bwd_dkdv_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                            const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ dvec,
                            T *__restrict__ dk, T *__restrict__ dv, int n, float scale, float scale_log2, int nsplit,
                            float *__restrict__ part) {
    constexpr int BKV = NW * MK * 16, SD = tsys_cuda__flash_smem<T, D>::SD, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *ks = (T *)tsys_cuda__flash_smem_raw;
    T *vs = ks + BKV * SD;
    T *qs = vs + BKV * SD;       // [2][BQ * SD]
    T *gs = qs + 2 * BQ * SD;    // [2][BQ * SD]  dO
    float *ls = (float *)(gs + 2 * BQ * SD);   // [2][BQ]  lse * log2e
    float *ds = ls + 2 * BQ;                   // [2][BQ]  D

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k0 = blockIdx.x * BKV, wk0 = warp * MK * 16;
    const int bhi = blockIdx.y / nsplit, split = blockIdx.y % nsplit, nbh = gridDim.y / nsplit;
    const size_t base = (size_t)bhi * n * D;
    q += base; k += base; v += base; dout += base; dk += base; dv += base;
    lse += (size_t)bhi * n; dvec += (size_t)bhi * n;

    // this block's query tiles: its share of those the key tile sees
    int it0, nqt;
    tsys_cuda__flash_share(CAUSAL ? k0 / BQ : 0, (n + BQ - 1) / BQ, nsplit, split, &it0, &nqt);

    tsys_cuda__flash_load_tile<BKV, D, NT>(ks, k, k0, n);
    tsys_cuda__flash_load_tile<BKV, D, NT>(vs, v, k0, n);
    auto load_q = [&](int it, int buf) {
        const int q0 = it * BQ;
        tsys_cuda__flash_load_tile<BQ, D, NT>(qs + buf * BQ * SD, q, q0, n);
        tsys_cuda__flash_load_tile<BQ, D, NT>(gs + buf * BQ * SD, dout, q0, n);
        for (int i = threadIdx.x; i < BQ; i += NT) {   // plain loads: tiny, and visible after the barrier
            const bool ok = q0 + i < n;
            ls[buf * BQ + i] = ok ? lse[q0 + i] * TSYS_CUDA__FLASH_LOG2E : 0.0f;
            ds[buf * BQ + i] = ok ? dvec[q0 + i] : 0.0f;
        }
    };
    if (it0 < nqt) load_q(it0, 0);
    tsys_cuda__flash_cp_async_commit();

    float dka[MK][D / 8][4], dva[MK][D / 8][4];
    tsys_cuda__flash_zero<MK, D>(dka);
    tsys_cuda__flash_zero<MK, D>(dva);

    for (int it = it0; it < nqt; it++) {
        const int buf = (it - it0) & 1;
        if (it + 1 < nqt) {
            load_q(it + 1, buf ^ 1);
            tsys_cuda__flash_cp_async_commit();
            tsys_cuda__flash_cp_async_wait<1>();
        } else {
            tsys_cuda__flash_cp_async_wait<0>();
        }
        __syncthreads();
        const int q0 = it * BQ;
        // causal: this warp's keys all come after every query of the tile -> nothing to add
        const bool active = !CAUSAL || k0 + wk0 <= q0 + BQ - 1;
        if (active) {
            const T *qt = qs + buf * BQ * SD, *gt = gs + buf * BQ * SD;
            const float *lt = ls + buf * BQ, *dt = ds + buf * BQ;
            float st[MK][BQ / 8][4], dpt[MK][BQ / 8][4];
            tsys_cuda__flash_zero<MK, BQ>(st);
            tsys_cuda__flash_gemm_nt<T, SD, MK, BQ, D>(st, ks, wk0, qt, lane);   // S^T = K Q^T
            const bool need_mask = q0 + BQ > n || (CAUSAL && k0 + wk0 + MK * 16 - 1 > q0);
#pragma unroll
            for (int mt = 0; mt < MK; mt++)
#pragma unroll
                for (int nb = 0; nb < BQ / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                        float p = tsys_cuda__flash_ex2(st[mt][nb][e] * scale_log2 - lt[qi]);
                        if (need_mask) {
                            const int key = k0 + wk0 + mt * 16 + (lane >> 2) + (e >> 1) * 8, query = q0 + qi;
                            if (query >= n || (CAUSAL && key > query)) p = 0.0f;
                        }
                        st[mt][nb][e] = p;
                    }
            tsys_cuda__flash_gemm_pn<T, SD, MK, BQ, D>(dva, st, gt, lane);        // dV += P^T dO
            tsys_cuda__flash_zero<MK, BQ>(dpt);
            tsys_cuda__flash_gemm_nt<T, SD, MK, BQ, D>(dpt, vs, wk0, gt, lane);   // dP^T = V dO^T
#pragma unroll
            for (int mt = 0; mt < MK; mt++)
#pragma unroll
                for (int nb = 0; nb < BQ / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                        dpt[mt][nb][e] = st[mt][nb][e] * (dpt[mt][nb][e] - dt[qi]);   // dS^T
                    }
            tsys_cuda__flash_gemm_pn<T, SD, MK, BQ, D>(dka, dpt, qt, lane);       // dK += dS^T Q
        }
        __syncthreads();
    }
    tsys_cuda__flash_cp_async_wait<0>();   // an empty share still loaded K and V
    if (part) {   // split: this share's sums, unscaled, for tsys_cuda__flash_split_sum ([split][bh][n][D], dK then dV)
        const size_t plane = (size_t)nbh * n * D, at = (size_t)split * plane + base;
        tsys_cuda__flash_store<float, MK, D>(part + at, dka, k0 + wk0, n, 1.0f, lane);
        tsys_cuda__flash_store<float, MK, D>(part + (size_t)nsplit * plane + at, dva, k0 + wk0, n, 1.0f, lane);
        return;
    }
    tsys_cuda__flash_store<T, MK, D>(dk, dka, k0 + wk0, n, scale, lane);
    tsys_cuda__flash_store<T, MK, D>(dv, dva, k0 + wk0, n, 1.0f, lane);
}

// ------------------------------------------------------------------------------------------------
// Backward dQ (bf16/fp16). Block: NW warps, BQ = NW * MQ * 16 queries; warp w owns MQ*16 query rows and
// their dQ (fp32) in registers; its lse and D values live in registers too. Key/value tiles of BK rows are
// double-buffered. Per key tile: S = Q K^T, dP = dO V^T, P = exp2(S*scale*log2e - L*log2e),
// dS = P o (dP - D), dQ += dS K; dQ is scaled once at the end.
// Shared memory: (2 BQ + 4 BK) * SD * sizeof(T).

template <typename T, int D, int MQ, int BK, int NW, bool CAUSAL>
__global__ void __launch_bounds__(NW * 32)
tsys_cuda__flash_bwd_dq_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                          const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ dvec,
                          T *__restrict__ dq, int n, float scale, float scale_log2, int nsplit, float *__restrict__ part) {
    constexpr int BQ = NW * MQ * 16, SD = tsys_cuda__flash_smem<T, D>::SD, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *qs = (T *)tsys_cuda__flash_smem_raw;
    T *gs = qs + BQ * SD;
    T *ks = gs + BQ * SD;        // [2][BK * SD]
    T *vs = ks + 2 * BK * SD;    // [2][BK * SD]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qt * BQ, wr0 = warp * MQ * 16;
    const int bhi = blockIdx.y / nsplit, split = blockIdx.y % nsplit, nbh = gridDim.y / nsplit;
    const size_t base = (size_t)bhi * n * D;
    q += base; k += base; v += base; dout += base; dq += base;
    lse += (size_t)bhi * n; dvec += (size_t)bhi * n;

    // this block's key tiles: its share of those the query tile sees
    int nkt_all = (n + BK - 1) / BK, j0, nkt;
    if (CAUSAL) nkt_all = min(nkt_all, (q0 + BQ - 1) / BK + 1);
    tsys_cuda__flash_share(0, nkt_all, nsplit, split, &j0, &nkt);

    tsys_cuda__flash_load_tile<BQ, D, NT>(qs, q, q0, n);
    tsys_cuda__flash_load_tile<BQ, D, NT>(gs, dout, q0, n);
    if (j0 < nkt) {
        tsys_cuda__flash_load_tile<BK, D, NT>(ks, k, j0 * BK, n);
        tsys_cuda__flash_load_tile<BK, D, NT>(vs, v, j0 * BK, n);
    }
    tsys_cuda__flash_cp_async_commit();

    float lrow[MQ][2], drow[MQ][2];
#pragma unroll
    for (int mt = 0; mt < MQ; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = q0 + wr0 + mt * 16 + (lane >> 2) + h * 8;
            lrow[mt][h] = row < n ? lse[row] * TSYS_CUDA__FLASH_LOG2E : 0.0f;
            drow[mt][h] = row < n ? dvec[row] : 0.0f;
        }
    float dqa[MQ][D / 8][4];
    tsys_cuda__flash_zero<MQ, D>(dqa);

    for (int j = j0; j < nkt; j++) {
        const int buf = (j - j0) & 1;
        if (j + 1 < nkt) {
            tsys_cuda__flash_load_tile<BK, D, NT>(ks + (buf ^ 1) * BK * SD, k, (j + 1) * BK, n);
            tsys_cuda__flash_load_tile<BK, D, NT>(vs + (buf ^ 1) * BK * SD, v, (j + 1) * BK, n);
            tsys_cuda__flash_cp_async_commit();
            tsys_cuda__flash_cp_async_wait<1>();
        } else {
            tsys_cuda__flash_cp_async_wait<0>();
        }
        __syncthreads();
        const int k0 = j * BK;
        const bool active = !CAUSAL || k0 <= q0 + wr0 + MQ * 16 - 1;
        if (active) {
            const T *kt = ks + buf * BK * SD, *vt = vs + buf * BK * SD;
            float s[MQ][BK / 8][4], dp[MQ][BK / 8][4];
            tsys_cuda__flash_zero<MQ, BK>(s);
            tsys_cuda__flash_gemm_nt<T, SD, MQ, BK, D>(s, qs, wr0, kt, lane);    // S = Q K^T
            tsys_cuda__flash_zero<MQ, BK>(dp);
            tsys_cuda__flash_gemm_nt<T, SD, MQ, BK, D>(dp, gs, wr0, vt, lane);   // dP = dO V^T
            const bool need_mask = k0 + BK > n || (CAUSAL && k0 + BK - 1 > q0 + wr0);
#pragma unroll
            for (int mt = 0; mt < MQ; mt++)
#pragma unroll
                for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e >> 1;
                        float p = tsys_cuda__flash_ex2(s[mt][nb][e] * scale_log2 - lrow[mt][h]);
                        if (need_mask) {
                            const int key = k0 + nb * 8 + (lane & 3) * 2 + (e & 1);
                            const int row = q0 + wr0 + mt * 16 + (lane >> 2) + h * 8;
                            if (key >= n || (CAUSAL && key > row)) p = 0.0f;
                        }
                        s[mt][nb][e] = p * (dp[mt][nb][e] - drow[mt][h]);   // dS
                    }
            tsys_cuda__flash_gemm_pn<T, SD, MQ, BK, D>(dqa, s, kt, lane);         // dQ += dS K
        }
        __syncthreads();
    }
    tsys_cuda__flash_cp_async_wait<0>();   // an empty share still loaded Q and dO
    if (part) {   // split: this share's sum, unscaled ([split][bh][n][D])
        tsys_cuda__flash_store<float, MQ, D>(part + (size_t)split * nbh * n * D + base, dqa, q0 + wr0, n, 1.0f, lane);
        return;
    }
    tsys_cuda__flash_store<T, MQ, D>(dq, dqa, q0 + wr0, n, scale, lane);
}

// ------------------------------------------------------------------------------------------------
// Backward of a short sequence (n <= TSYS_CUDA__FLASH_SHORT_N, bf16/fp16, d <= 96): one block a slice keeps the
// slice's Q, K, V, dO, lse and D in shared memory and makes dK and dV, then dQ, in one launch. At training's
// context (256) the split kernels above run 2-4 blocks a slice, each loading its tiles for a loop of 1-4 steps.
// Warp w takes the 16-row tiles w and 2 NW - 1 - w, first of keys (dK, dV over 64-query chunks, as
// tsys_cuda__flash_bwd_dkdv_kernel), then of queries (dQ over 64-key chunks, as tsys_cuda__flash_bwd_dq_kernel):
// under the causal mask each warp's pair of tiles meets the same number of chunks. A grid of two blocks a slice
// (gridDim.y 2, for grids of fewer slices than half the SMs) gives dK, dV to one and dQ to the other.
// Shared memory: 4 N SD sizeof(T) + 2 N 4 (N = TSYS_CUDA__FLASH_SHORT_N).
#define TSYS_CUDA__FLASH_SHORT_N 256
template <typename T, int D> struct tsys_cuda__flash_short {
    static constexpr int N = TSYS_CUDA__FLASH_SHORT_N, NW = 8, C = 64, SD = tsys_cuda__flash_smem<T, D>::SD;
    static constexpr size_t SMEM = (size_t)4 * N * SD * sizeof(T) + 2 * N * sizeof(float);
    static_assert(N == 2 * NW * 16, "a pair of 16-row tiles a warp");
};
template <typename T, int D, bool CAUSAL>
__global__ void __launch_bounds__(tsys_cuda__flash_short<T, D>::NW * 32)
tsys_cuda__flash_bwd_short_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                                  const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ dvec,
                                  T *__restrict__ dq, T *__restrict__ dk, T *__restrict__ dv, int n, float scale, float scale_log2) {
    typedef tsys_cuda__flash_short<T, D> S;
    constexpr int N = S::N, NW = S::NW, C = S::C, SD = S::SD, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *qs = (T *)tsys_cuda__flash_smem_raw, *ks = qs + N * SD, *vs = ks + N * SD, *gs = vs + N * SD;
    float *ls = (float *)(gs + N * SD), *ds = ls + N;   // lse log2(e), D
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t base = (size_t)blockIdx.x * n * D;
    q += base; k += base; v += base; dout += base; dq += base; dk += base; dv += base;
    lse += (size_t)blockIdx.x * n; dvec += (size_t)blockIdx.x * n;
    tsys_cuda__flash_load_tile<N, D, NT>(qs, q, 0, n);   // rows >= n: zeros
    tsys_cuda__flash_load_tile<N, D, NT>(ks, k, 0, n);
    tsys_cuda__flash_load_tile<N, D, NT>(vs, v, 0, n);
    tsys_cuda__flash_load_tile<N, D, NT>(gs, dout, 0, n);
    tsys_cuda__flash_cp_async_commit();
    for (int i = threadIdx.x; i < N; i += NT) {
        ls[i] = i < n ? lse[i] * TSYS_CUDA__FLASH_LOG2E : 0.0f;
        ds[i] = i < n ? dvec[i] : 0.0f;
    }
    tsys_cuda__flash_cp_async_wait<0>();
    __syncthreads();
    const int tiles = (n + 15) / 16;
    const bool kv = gridDim.y == 1 || blockIdx.y == 0, dqs = gridDim.y == 1 || blockIdx.y == 1;
    for (int pass = 0; kv && pass < 2; pass++) {   // dK, dV of keys [k0, k0 + 16)
        const int t = pass ? 2 * NW - 1 - warp : warp, k0 = t * 16;
        if (t >= tiles) continue;
        float dka[1][D / 8][4], dva[1][D / 8][4];
        tsys_cuda__flash_zero<1, D>(dka);
        tsys_cuda__flash_zero<1, D>(dva);
        for (int q0 = CAUSAL ? k0 / C * C : 0; q0 < n; q0 += C) {
            const T *qt = qs + q0 * SD, *gt = gs + q0 * SD;
            float st[1][C / 8][4], dpt[1][C / 8][4];
            tsys_cuda__flash_zero<1, C>(st);
            tsys_cuda__flash_gemm_nt<T, SD, 1, C, D>(st, ks, k0, qt, lane);   // S^T = K Q^T
            const bool need_mask = q0 + C > n || (CAUSAL && k0 + 15 > q0);
#pragma unroll
            for (int nb = 0; nb < C / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = q0 + nb * 8 + (lane & 3) * 2 + (e & 1), key = k0 + (lane >> 2) + (e >> 1) * 8;
                    float p = tsys_cuda__flash_ex2(st[0][nb][e] * scale_log2 - ls[qi]);
                    if (need_mask && (qi >= n || (CAUSAL && key > qi))) p = 0.0f;
                    st[0][nb][e] = p;
                }
            tsys_cuda__flash_gemm_pn<T, SD, 1, C, D>(dva, st, gt, lane);   // dV += P^T dO
            tsys_cuda__flash_zero<1, C>(dpt);
            tsys_cuda__flash_gemm_nt<T, SD, 1, C, D>(dpt, vs, k0, gt, lane);   // dP^T = V dO^T
#pragma unroll
            for (int nb = 0; nb < C / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) dpt[0][nb][e] = st[0][nb][e] * (dpt[0][nb][e] - ds[q0 + nb * 8 + (lane & 3) * 2 + (e & 1)]);   // dS^T
            tsys_cuda__flash_gemm_pn<T, SD, 1, C, D>(dka, dpt, qt, lane);   // dK += dS^T Q
        }
        tsys_cuda__flash_store<T, 1, D>(dk, dka, k0, n, scale, lane);
        tsys_cuda__flash_store<T, 1, D>(dv, dva, k0, n, 1.0f, lane);
    }
    for (int pass = 0; dqs && pass < 2; pass++) {   // dQ of queries [r0, r0 + 16)
        const int t = pass ? 2 * NW - 1 - warp : warp, r0 = t * 16;
        if (t >= tiles) continue;
        float lrow[2], drow[2], dqa[1][D / 8][4];
#pragma unroll
        for (int h = 0; h < 2; h++) lrow[h] = ls[r0 + (lane >> 2) + h * 8], drow[h] = ds[r0 + (lane >> 2) + h * 8];
        tsys_cuda__flash_zero<1, D>(dqa);
        const int kend = CAUSAL ? min(n, r0 + 16) : n;
        for (int k0 = 0; k0 < kend; k0 += C) {
            const T *kt = ks + k0 * SD, *vt = vs + k0 * SD;
            float sc[1][C / 8][4], dp[1][C / 8][4];
            tsys_cuda__flash_zero<1, C>(sc);
            tsys_cuda__flash_gemm_nt<T, SD, 1, C, D>(sc, qs, r0, kt, lane);   // S = Q K^T
            tsys_cuda__flash_zero<1, C>(dp);
            tsys_cuda__flash_gemm_nt<T, SD, 1, C, D>(dp, gs, r0, vt, lane);   // dP = dO V^T
            const bool need_mask = k0 + C > n || (CAUSAL && k0 + C - 1 > r0);
#pragma unroll
            for (int nb = 0; nb < C / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int h = e >> 1, key = k0 + nb * 8 + (lane & 3) * 2 + (e & 1), row = r0 + (lane >> 2) + h * 8;
                    float p = tsys_cuda__flash_ex2(sc[0][nb][e] * scale_log2 - lrow[h]);
                    if (need_mask && (key >= n || (CAUSAL && key > row))) p = 0.0f;
                    sc[0][nb][e] = p * (dp[0][nb][e] - drow[h]);   // dS
                }
            tsys_cuda__flash_gemm_pn<T, SD, 1, C, D>(dqa, sc, kt, lane);   // dQ += dS K
        }
        tsys_cuda__flash_store<T, 1, D>(dq, dqa, r0, n, scale, lane);
    }
}

// >>flash fp32 ------------------------------------------------------------------------------------
// fp32 (SIMT). Correct and simple rather than fast: fp32 attention is a reference path here (bf16/fp16
// are what training uses). One thread owns one row (a query for fwd and dQ, a key for dK/dV); its own
// row vectors live in shared memory with a stride of D + 1 floats (thread t reads word t*(D+1)+c: no bank
// conflicts); the tile it streams over is read by all threads at the same address (a broadcast).
// Block: 64 threads = 64 rows; the streamed tile has 32 rows.

#define TSYS_CUDA__FLASH_F32_ROWS 64
#define TSYS_CUDA__FLASH_F32_TILE 32
#define TSYS_CUDA__FLASH_F32_FWD_BK(D) ((D) >= 128 ? 16 : 32)   // the forward keeps BK scores + D outputs per thread

// The backward pre-pass of these kernels: one thread a row, dO[c] * O[c] summed in column order with fma, as
// the kernels sum dP = dO . v; at one key (O = v) D and dP are the same float and dS is exactly 0.
__global__ void tsys_cuda__flash_bwd_dot_seq_kernel(const float *__restrict__ dout, const float *__restrict__ o, float *__restrict__ dvec,
                                               int64_t rows, int d) {
    const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    float acc = 0.0f;
    for (int c = 0; c < d; c++) acc = __fmaf_rn(dout[row * d + c], o[row * d + c], acc);
    dvec[row] = acc;
}

// Forward: own row q (shared), o accumulator (registers), key/value tile (shared). Natural-log softmax.
template <int D, bool CAUSAL>
__global__ void __launch_bounds__(TSYS_CUDA__FLASH_F32_ROWS)
tsys_cuda__flash_fwd_f32_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                           float *__restrict__ o, float *__restrict__ lse, int n, float scale) {
    constexpr int R = TSYS_CUDA__FLASH_F32_ROWS, BK = TSYS_CUDA__FLASH_F32_FWD_BK(D);
    extern __shared__ float tsys_cuda__flash_f32_smem[];
    float *qs = tsys_cuda__flash_f32_smem, *ks = qs + R * (D + 1), *vs = ks + BK * D;   // [R][D+1], [BK][D], [BK][D]
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
__global__ void __launch_bounds__(TSYS_CUDA__FLASH_F32_ROWS)
tsys_cuda__flash_bwd_dkdv_f32_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                const float *__restrict__ dout, const float *__restrict__ lse,
                                const float *__restrict__ dvec, float *__restrict__ dk, float *__restrict__ dv,
                                int n, float scale) {
    constexpr int R = TSYS_CUDA__FLASH_F32_ROWS, BQ = TSYS_CUDA__FLASH_F32_TILE, SR = D + 1;
    extern __shared__ float tsys_cuda__flash_f32_smem[];
    float *kr = tsys_cuda__flash_f32_smem, *vr = kr + R * SR, *dkr = vr + R * SR, *dvr = dkr + R * SR;
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
            for (int c = 0; c < D; c++) { s += kme[c] * qs[i * D + c]; dp = __fmaf_rn(gs[i * D + c], vme[c], dp); }
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
__global__ void __launch_bounds__(TSYS_CUDA__FLASH_F32_ROWS)
tsys_cuda__flash_bwd_dq_f32_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                              const float *__restrict__ dout, const float *__restrict__ lse,
                              const float *__restrict__ dvec, float *__restrict__ dq, int n, float scale) {
    constexpr int R = TSYS_CUDA__FLASH_F32_ROWS, BK = TSYS_CUDA__FLASH_F32_TILE, SR = D + 1;
    extern __shared__ float tsys_cuda__flash_f32_smem[];
    float *qr = tsys_cuda__flash_f32_smem, *gr = qr + R * SR, *dqr = gr + R * SR;
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
            for (int c = 0; c < D; c++) { s += qme[c] * ks[jj * D + c]; dp = __fmaf_rn(gme[c], vs[jj * D + c], dp); }
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

// >>flash wgmma -----------------------------------------------------------------------------------
// Hopper path (sm_90a only): the same three kernels with wgmma (warpgroup MMA, 4 warps x 16 rows = one
// m64 block per warpgroup). Compiled only when the translation unit is built for sm_90a
// (-gencode arch=compute_90a,code=sm_90a); otherwise the bodies are empty, the probe (>>flash launchers)
// reports "not available" and the backend keeps the mma.sync kernels above. Head dims 64 and 128 only.
//
// Shared tiles (R rows x D cols, D % 64 == 0): D/64 column blocks of R x 128 bytes, each 128B-swizzled
// (16-byte chunk c of row r stored at chunk c ^ (r % 8)); every tile starts 1024-byte aligned. One tile
// serves both ways: as a K-major operand (rows = M or N, cols = K: Q, K, V, dO in S = Q K^T etc.) and as
// an MN-major operand (rows = K, cols = N: V in P V, dO in P^T dO, Q in dS^T Q, K in dS K).
// A wgmma accumulator m64nN holds, in warp w of the warpgroup, rows 16w..16w+15 in exactly the mma.sync
// C layout (acc[nb][e] = C[16w + g + 8(e/2)][8nb + 2c + e%2]); rounded and paired it is the register A
// operand of the next wgmma, as in the mma.sync kernels.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// One warpgroup MMA m64nNk16 (k8 for tf32) with fp32 accumulators (d: this thread's N/2 of them), T = bf16,
// fp16 or float (TF32):
//   ss  d = (acc ? d : 0) + A B, A and B in shared memory (matrix descriptors da and db);
//   rs  d += A B, A in registers (a: this thread's 4 registers of the 64 x k tile), B in shared memory.
// An asm template must be one string literal, so the instruction is put together from literals by the
// macros below and `if constexpr` picks the (T, N) case: each case is the exact text of one instruction.
#define TSYS_CUDA__FLASH_WGMMA_PTX(AB, NN, KK, NACC, OPS, PRED, TAIL) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #NN "k" #KK ".f32." AB "." AB " " TSYS_CUDA__FLASH_WGMMA_D##NACC ", " OPS ", p, " TAIL ";\n}\n"
#define TSYS_CUDA__FLASH_WGMMA_D16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define TSYS_CUDA__FLASH_WGMMA_D32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define TSYS_CUDA__FLASH_WGMMA_D64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define TSYS_CUDA__FLASH_WGMMA_ACC8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define TSYS_CUDA__FLASH_WGMMA_ACC16(d) TSYS_CUDA__FLASH_WGMMA_ACC8(d, 0), TSYS_CUDA__FLASH_WGMMA_ACC8(d, 8)
#define TSYS_CUDA__FLASH_WGMMA_ACC32(d) TSYS_CUDA__FLASH_WGMMA_ACC8(d, 0), TSYS_CUDA__FLASH_WGMMA_ACC8(d, 8), \
    TSYS_CUDA__FLASH_WGMMA_ACC8(d, 16), TSYS_CUDA__FLASH_WGMMA_ACC8(d, 24)
#define TSYS_CUDA__FLASH_WGMMA_ACC64(d) TSYS_CUDA__FLASH_WGMMA_ACC32(d), TSYS_CUDA__FLASH_WGMMA_ACC8(d, 32), \
    TSYS_CUDA__FLASH_WGMMA_ACC8(d, 40), TSYS_CUDA__FLASH_WGMMA_ACC8(d, 48), TSYS_CUDA__FLASH_WGMMA_ACC8(d, 56)
// operands: the NACC accumulators, then da, db, acc (ss) or a[0..3], db, acc (rs).
// TAIL: the immediates after the predicate: the scales of A and B (1, 1), then for 16-bit operands the
// transpose flags (ss: of A and B, "0, 0" both K-major, "1, 1" both MN-major; rs: of B). tf32 has none: its
// shared-memory operands are always K-major.
#define TSYS_CUDA__FLASH_WGMMA_SS(AB, NN, KK, NACC, OPS, PRED, TAIL) \
    asm volatile(TSYS_CUDA__FLASH_WGMMA_PTX(AB, NN, KK, NACC, OPS, PRED, TAIL) \
                 : TSYS_CUDA__FLASH_WGMMA_ACC##NACC(d) : "l"(da), "l"(db), "r"(acc))
#define TSYS_CUDA__FLASH_WGMMA_RS(AB, NN, KK, NACC, OPS, PRED, TAIL) \
    asm volatile(TSYS_CUDA__FLASH_WGMMA_PTX(AB, NN, KK, NACC, OPS, PRED, TAIL) \
                 : TSYS_CUDA__FLASH_WGMMA_ACC##NACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc))
// The N = 64 and 128 cases of one element type (AB, k KK) for ss and rs (ss also N = 32: TF32's 32-key tiles).
#define TSYS_CUDA__FLASH_WGMMA_SS_N(AB, KK, TAIL) \
    if constexpr (N == 32) TSYS_CUDA__FLASH_WGMMA_SS(AB, 32, KK, 16, "%16, %17", "%18", TAIL); \
    else if constexpr (N == 64) TSYS_CUDA__FLASH_WGMMA_SS(AB, 64, KK, 32, "%32, %33", "%34", TAIL); \
    else TSYS_CUDA__FLASH_WGMMA_SS(AB, 128, KK, 64, "%64, %65", "%66", TAIL)
#define TSYS_CUDA__FLASH_WGMMA_RS_N(AB, KK, TAIL) \
    if constexpr (N == 64) TSYS_CUDA__FLASH_WGMMA_RS(AB, 64, KK, 32, "{%32,%33,%34,%35}, %36", "%37", TAIL); \
    else TSYS_CUDA__FLASH_WGMMA_RS(AB, 128, KK, 64, "{%64,%65,%66,%67}, %68", "%69", TAIL)

template <typename T, int N> struct tsys_cuda__flash_wgmma {
    static constexpr bool BF16 = std::is_same<T, __nv_bfloat16>::value;
    static_assert(BF16 || std::is_same<T, __half>::value, "wgmma: bf16 or fp16 operands");
    static_assert(N == 64 || N == 128, "wgmma: N = 64 or 128");
    static __device__ __forceinline__ void ss(float *d, uint64_t da, uint64_t db, int acc) {
        if constexpr (BF16) { TSYS_CUDA__FLASH_WGMMA_SS_N("bf16", 16, "1, 1, 0, 0"); }
        else { TSYS_CUDA__FLASH_WGMMA_SS_N("f16", 16, "1, 1, 0, 0"); }
    }
    // both operands MN-major (A stored K rows x M columns, B K rows x N columns)
    static __device__ __forceinline__ void ss_mn(float *d, uint64_t da, uint64_t db, int acc) {
        if constexpr (BF16) { TSYS_CUDA__FLASH_WGMMA_SS_N("bf16", 16, "1, 1, 1, 1"); }
        else { TSYS_CUDA__FLASH_WGMMA_SS_N("f16", 16, "1, 1, 1, 1"); }
    }
    // A K-major, B MN-major (stored K rows x N columns)
    static __device__ __forceinline__ void ss_kmn(float *d, uint64_t da, uint64_t db, int acc) {
        if constexpr (BF16) { TSYS_CUDA__FLASH_WGMMA_SS_N("bf16", 16, "1, 1, 0, 1"); }
        else { TSYS_CUDA__FLASH_WGMMA_SS_N("f16", 16, "1, 1, 0, 1"); }
    }
    static __device__ __forceinline__ void rs(float *d, const uint32_t *a, uint64_t db) {   // B MN-major, accumulate
        constexpr int acc = 1;
        if constexpr (BF16) { TSYS_CUDA__FLASH_WGMMA_RS_N("bf16", 16, "1, 1, 1"); }
        else { TSYS_CUDA__FLASH_WGMMA_RS_N("f16", 16, "1, 1, 1"); }
    }
    static __device__ __forceinline__ void rs_k(float *d, const uint32_t *a, uint64_t db, int acc) {   // B K-major
        if constexpr (BF16) { TSYS_CUDA__FLASH_WGMMA_RS_N("bf16", 16, "1, 1, 0"); }
        else { TSYS_CUDA__FLASH_WGMMA_RS_N("f16", 16, "1, 1, 0"); }
    }
};
// fp32 operands on TF32 (m64nNk8): both shared-memory operands K-major; the register A operand of one warp's
// 16 x 8 block holds (row g, col c), (g + 8, c), (g, c + 4), (g + 8, c + 4) for lane = 4 g + c.
template <int N> struct tsys_cuda__flash_wgmma<float, N> {
    static_assert(N == 32 || N == 64 || N == 128, "wgmma: N = 32, 64 or 128");
    static __device__ __forceinline__ void ss(float *d, uint64_t da, uint64_t db, int acc) { TSYS_CUDA__FLASH_WGMMA_SS_N("tf32", 8, "1, 1"); }
    static __device__ __forceinline__ void rs(float *d, const uint32_t *a, uint64_t db) {
        constexpr int acc = 1;
        TSYS_CUDA__FLASH_WGMMA_RS_N("tf32", 8, "1, 1");
    }
};
#endif


template <int R, int D, int NT, typename T>
__device__ __forceinline__ void tsys_cuda__flash_wg_load_tile(T *s, const T *g, int r0, int n) {
    constexpr int CPR = D / 8;
#pragma unroll
    for (int c = threadIdx.x; c < R * CPR; c += NT) {
        const int r = c / CPR, cc = c % CPR;
        const bool ok = r0 + r < n;
        unsigned char *dst = (unsigned char *)s + (cc >> 3) * R * 128 + r * 128 + (((cc & 7) ^ (r & 7)) << 4);
        tsys_cuda__flash_cp_async16(dst, g + (size_t)(ok ? r0 + r : 0) * D + cc * 8, ok);
    }
}
__device__ __forceinline__ uint64_t tsys_cuda__flash_wg_desc(const void *p, uint32_t lbo, uint32_t sbo) {
    const uint64_t a = tsys_cuda__flash_smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) |
           (1ull << 62);
}
// K-major operand: rows [r0, r0 + 64) (A) or all N rows (B) of an R-row tile, k-step kk (16 columns).
template <int R> __device__ __forceinline__ uint64_t tsys_cuda__flash_wg_desc_k(const void *tile, int r0, int kk) {
    return tsys_cuda__flash_wg_desc((const unsigned char *)tile + (kk >> 2) * R * 128 + r0 * 128 + (kk & 3) * 32, 16, 1024);
}
// MN-major operand (B = tile rows 16kk..16kk+15 as K, all D columns as N).
template <int R> __device__ __forceinline__ uint64_t tsys_cuda__flash_wg_desc_mn(const void *tile, int kk) {
    return tsys_cuda__flash_wg_desc((const unsigned char *)tile + kk * 16 * 128, R * 128, 1024);
}

__device__ __forceinline__ void tsys_cuda__flash_wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void tsys_cuda__flash_wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void tsys_cuda__flash_wg_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// cp.async writes (generic proxy) must be visible to wgmma reads (async proxy): each thread, after its
// cp.async.wait and before the barrier.
__device__ __forceinline__ void tsys_cuda__flash_fence_proxy_async() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Programmatic dependent launch (sm_90): a kernel launched with tsys_cuda__flash_launch_pdl may start while the
// kernel before it in the stream still runs, once every block of that kernel has called
// tsys_cuda__flash_grid_launch_dependents (or exited); tsys_cuda__flash_grid_wait blocks until that kernel has
// completed and its writes are visible. Both are no-ops in a kernel launched the ordinary way.
__device__ __forceinline__ void tsys_cuda__flash_grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void tsys_cuda__flash_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving reads of accumulators above the wgmma wait.
template <int N> __device__ __forceinline__ void tsys_cuda__flash_wg_fence_acc(float (*acc)[4]) {
#pragma unroll
    for (int i = 0; i < N / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(acc[i][e])::"memory");
}

// The k of one wgmma: 32 bytes of K-major row (16 elements of 16 bits, 8 tf32), so the descriptors' k-step
// is the same for every element type.
template <typename T> constexpr int tsys_cuda__flash_wg_k = 32 / (int)sizeof(T);

// acc (m64 x N) (+)= A (smem, K-major, rows r0..r0+63 of an RA-row tile) * B^T (smem, K-major, N rows), K = KD.
template <typename T, int N, int RA, int KD>
__device__ __forceinline__ void tsys_cuda__flash_wg_ss(float (*acc)[4], const T *a, int r0, const T *b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
    for (int kk = 0; kk < KD / tsys_cuda__flash_wg_k<T>; kk++) {
        const uint64_t da = tsys_cuda__flash_wg_desc_k<RA>(a, r0, kk), db = tsys_cuda__flash_wg_desc_k<N>(b, 0, kk);
        tsys_cuda__flash_wgmma<T, N>::ss(&acc[0][0], da, db, kk > 0);
    }
#endif
}
// Round a wgmma accumulator (m64 x KD fp32, this thread's part) to 16 bits and pair it into the register A
// operand of the next wgmma: KD/16 k-steps of 4 registers. All of it is packed before the wgmmas that read
// it are issued: writing A registers between wgmmas would make ptxas insert a warpgroup.arrive each time.
// tf32 (KD/8 k-steps): an 8-wide k block's accumulators hold columns 2c, 2c + 1 where the A operand wants c,
// c + 4, so slot c takes column 2c and slot c + 4 column 2c + 1: B must hold its keys in that order (the
// TF32 forward's V^T does, tsys_cuda__flash_tf32_prep). Rounded to nearest, as the mma.sync kernels round.
template <typename T, int KD>
__device__ __forceinline__ void tsys_cuda__flash_wg_pack(uint32_t (*a)[4], const float (*p)[4]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int kk = 0; kk < KD / 8; kk++) {
            a[kk][0] = tsys_cuda__flash_t<float>::tf32(p[kk][0]);
            a[kk][1] = tsys_cuda__flash_t<float>::tf32(p[kk][2]);
            a[kk][2] = tsys_cuda__flash_t<float>::tf32(p[kk][1]);
            a[kk][3] = tsys_cuda__flash_t<float>::tf32(p[kk][3]);
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < KD / 16; kk++) {
            a[kk][0] = tsys_cuda__flash_t<T>::pack(p[2 * kk][0], p[2 * kk][1]);
            a[kk][1] = tsys_cuda__flash_t<T>::pack(p[2 * kk][2], p[2 * kk][3]);
            a[kk][2] = tsys_cuda__flash_t<T>::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
            a[kk][3] = tsys_cuda__flash_t<T>::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        }
    }
}
// acc (m64 x N) += A (registers, packed by tsys_cuda__flash_wg_pack, m64 x KD) * B (smem tile of KD rows, MN-major,
// N = D columns; tf32: B^T, a tile of N rows and KD columns, K-major).
template <typename T, int N, int KD>
__device__ __forceinline__ void tsys_cuda__flash_wg_rs(float (*acc)[4], const uint32_t (*a)[4], const T *b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
    for (int kk = 0; kk < KD / tsys_cuda__flash_wg_k<T>; kk++) {
        const uint64_t db = sizeof(T) == 4 ? tsys_cuda__flash_wg_desc_k<N>(b, 0, kk) : tsys_cuda__flash_wg_desc_mn<KD>(b, kk);
        tsys_cuda__flash_wgmma<T, N>::rs(&acc[0][0], a[kk], db);
    }
#endif
}

// A warpgroup's 64 rows (r0..r0 + 63) of an R-row K-major 128B-swizzled tile of 16-bit elements, KD columns, as the
// register A operand of its wgmmas (KD / 16 k-steps of 4 registers, ldmatrix: warp w's 16 rows, the m16n8k16 A
// fragment). For operands that stay for a block's whole loop: their RS wgmmas then read only B from shared
// memory, half the bytes of an SS wgmma of the same shape.
template <int R, int KD>
__device__ __forceinline__ void tsys_cuda__flash_wg_load_a(uint32_t (*a)[4], const void *tile, int r0) {
    const int lane = threadIdx.x & 31, mi = lane >> 3;
    const int r = r0 + ((threadIdx.x >> 5) & 3) * 16 + (lane & 7) + (mi & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < KD / 16; kk++) {
        const int chunk = 2 * kk + (mi >> 1);
        tsys_cuda__flash_ldsm_x4(a[kk], (const unsigned char *)tile + (chunk >> 3) * R * 128 + r * 128 + (((chunk & 7) ^ (r & 7)) << 4));
    }
}
// acc (m64 x N) = A B^T: A in registers (tsys_cuda__flash_wg_load_a), B^T K-major in shared memory (N rows, KD columns).
template <typename T, int N, int KD>
__device__ __forceinline__ void tsys_cuda__flash_wg_rs_k(float (*acc)[4], const uint32_t (*a)[4], const T *b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
    for (int kk = 0; kk < KD / 16; kk++) tsys_cuda__flash_wgmma<T, N>::rs_k(&acc[0][0], a[kk], tsys_cuda__flash_wg_desc_k<N>(b, 0, kk), kk > 0);
#endif
}

// acc (m64 x N) = A B with both operands MN-major in shared memory: A = KD rows of 64 columns from a (the columns
// are M: a K-major tile read transposed, dS^T as dS), B = KD rows from b of a tile of RB rows, N columns.
template <typename T, int N, int KD, int RB>
__device__ __forceinline__ void tsys_cuda__flash_wg_ss_mn(float (*acc)[4], const T *a, const T *b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
    for (int kk = 0; kk < KD / 16; kk++) {
        const uint64_t da = tsys_cuda__flash_wg_desc_mn<KD>(a, kk), db = tsys_cuda__flash_wg_desc_mn<RB>(b, kk);
        tsys_cuda__flash_wgmma<T, N>::ss_mn(&acc[0][0], da, db, kk > 0);
    }
#endif
}

// acc (m64 x N) += A B: A K-major in shared memory (rows r0..r0 + 63 of an RA-row tile, KD columns), B MN-major (KD
// rows of N columns, the layout tsys_cuda__flash_wg_rs reads).
template <typename T, int N, int RA, int KD>
__device__ __forceinline__ void tsys_cuda__flash_wg_ss_kmn(float (*acc)[4], const T *a, int r0, const T *b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
    for (int kk = 0; kk < KD / 16; kk++)
        tsys_cuda__flash_wgmma<T, N>::ss_kmn(&acc[0][0], tsys_cuda__flash_wg_desc_k<RA>(a, r0, kk), tsys_cuda__flash_wg_desc_mn<KD>(b, kk), 1);
#endif
}

// Dynamic shared memory rounded up to 1024 bytes (the 128B swizzle repeats every 1024 bytes of address).
__device__ __forceinline__ unsigned char *tsys_cuda__flash_wg_smem_base(unsigned char *raw) {
    const uint32_t a = tsys_cuda__flash_smem_addr(raw);
    return raw + ((1024 - (a & 1023)) & 1023);
}

// Online softmax of one key tile for a warp's 16 rows of a wgmma accumulator (this thread: rows row0 +
// lane / 4 and + 8): raw scores s become P = 2^(s * scale_log2 - m) in place, the running max m and sum l
// are updated, and alpha is what the O accumulator must be multiplied by. MASK drops keys >= n and, when
// causal, keys past the row (interior tiles skip that arithmetic).
template <int BK, bool MASK, bool CAUSAL>
__device__ __forceinline__ void tsys_cuda__flash_wg_softmax(float (*s)[4], float *m, float *l, float *alpha, int row0, int k0, int n,
                                                 int lane, float scale_log2) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = row0 + (lane >> 2) + h * 8;
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (MASK) {
                    const int col = k0 + nb * 8 + (lane & 3) * 2 + e;
                    if (col >= n || (CAUSAL && col > row)) s[nb][2 * h + e] = -INFINITY;
                }
                mx = fmaxf(mx, s[nb][2 * h + e]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(m[h], mx * scale_log2);   // scores in log2 units (scale > 0)
        const float mref = mnew == -INFINITY ? 0.0f : mnew;
        alpha[h] = tsys_cuda__flash_ex2(m[h] - mref);
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float p = tsys_cuda__flash_ex2(fmaf(s[nb][2 * h + e], scale_log2, -mref));
                s[nb][2 * h + e] = p;
                sum += p;
            }
        l[h] = l[h] * alpha[h] + sum;
        m[h] = mnew;
    }
}

// Forward epilogue for a warp's 16 rows: O = acc / l (rows < n) and lse = m + log2(l) in natural log; a row
// that saw no key (a split share's) gets O = 0 and lse = -inf. OT: T, or float for a split share.
template <typename OT, int D>
__device__ __forceinline__ void tsys_cuda__flash_wg_fwd_finish(OT *o, float *lse, float (&oacc)[D / 8][4], const float *m,
                                                    const float *l, int row0, int n, int lane) {
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv[h] = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int row = row0 + (lane >> 2) + h * 8;
        if ((lane & 3) == 0 && row < n) lse[row] = sum > 0.0f ? (m[h] + log2f(sum)) * TSYS_CUDA__FLASH_LN2 : -INFINITY;
    }
#pragma unroll
    for (int nb = 0; nb < D / 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) oacc[nb][e] *= inv[e >> 1];
    tsys_cuda__flash_store<OT, 1, D>(o, &oacc, row0, n, 1.0f, lane);
}

// dQ kernels, one key tile of a warp's 16 rows: S (done) becomes P = 2^(s * scale_log2 - lse) (masked when
// MASK), then, once the dP wgmma (the newest group) is done, dS = P o (dP - D), in place of S.
template <int BK, bool MASK, bool CAUSAL>
__device__ __forceinline__ void tsys_cuda__flash_wg_dq_ds(float (*s)[4], float (*dp)[4], const float *lrow, const float *drow,
                                               int row0, int k0, int n, int lane, float scale_log2) {
#pragma unroll
    for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int h = e >> 1;
            float p = tsys_cuda__flash_ex2(fmaf(s[nb][e], scale_log2, -lrow[h]));
            if (MASK) {
                const int key = k0 + nb * 8 + (lane & 3) * 2 + (e & 1);
                const int row = row0 + (lane >> 2) + h * 8;
                if (key >= n || (CAUSAL && key > row)) p = 0.0f;
            }
            s[nb][e] = p;
        }
    tsys_cuda__flash_wg_wait<0>();
    tsys_cuda__flash_wg_fence_acc<BK>(dp);
#pragma unroll
    for (int nb = 0; nb < BK / 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[nb][e] *= dp[nb][e] - drow[e >> 1];
}

// dK/dV kernels: issue S^T = K Q^T and dP^T = V dO^T for warpgroup wg's 64 keys, one commit group each.
template <typename T, int D, int BQ, int BKV>
__device__ __forceinline__ void tsys_cuda__flash_wg_kv_scores(float (*st)[4], float (*dpt)[4], const T *ks, const T *vs, int wg,
                                                  const T *qt, const T *gt) {
    tsys_cuda__flash_wg_fence();
    tsys_cuda__flash_wg_ss<T, BQ, BKV, D>(st, ks, wg * 64, qt);
    tsys_cuda__flash_wg_commit();
    tsys_cuda__flash_wg_ss<T, BQ, BKV, D>(dpt, vs, wg * 64, gt);
    tsys_cuda__flash_wg_commit();
}
// ... the same with K and V of the warpgroup's keys in registers (tsys_cuda__flash_wg_load_a): RS wgmmas.
template <typename T, int D, int BQ>
__device__ __forceinline__ void tsys_cuda__flash_wg_kv_scores_r(float (*st)[4], float (*dpt)[4], const uint32_t (*kr)[4], const uint32_t (*vr)[4],
                                                    const T *qt, const T *gt) {
    tsys_cuda__flash_wg_fence();
    tsys_cuda__flash_wg_rs_k<T, BQ, D>(st, kr, qt);
    tsys_cuda__flash_wg_commit();
    tsys_cuda__flash_wg_rs_k<T, BQ, D>(dpt, vr, gt);
    tsys_cuda__flash_wg_commit();
}
// dK/dV kernels, one query tile for a warp's 16 keys (from key0) of S^T = K Q^T (done): P^T = 2^(s * scale_log2 -
// lse) in place, masked when MASK (queries >= n and, when causal, queries before the key); lt: the tile's lse, or
// with LSE_LOG2 already -lse log2(e) (the same product, made once a row by whoever fills lt, not once an element).
// (Loading a thread's two columns of lt or dt as one float2 measured 1-2% slower.)
template <int BQ, bool MASK, bool CAUSAL, bool LSE_LOG2 = false>
__device__ __forceinline__ void tsys_cuda__flash_wg_kv_p(float (*st)[4], const float *lt, int key0, int q0, int n, int lane, float scale_log2) {
#pragma unroll
    for (int nb = 0; nb < BQ / 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
            float p = tsys_cuda__flash_ex2(fmaf(st[nb][e], scale_log2, LSE_LOG2 ? lt[qi] : -lt[qi] * TSYS_CUDA__FLASH_LOG2E));
            if (MASK) {
                const int key = key0 + (lane >> 2) + (e >> 1) * 8, query = q0 + qi;
                if (query >= n || (CAUSAL && key > query)) p = 0.0f;
            }
            st[nb][e] = p;
        }
}
// ... and dS^T = P^T o (dP^T - D) in place of dP^T (dt: the tile's D).
template <int BQ>
__device__ __forceinline__ void tsys_cuda__flash_wg_kv_ds(float (*dpt)[4], const float (*st)[4], const float *dt, int lane) {
#pragma unroll
    for (int nb = 0; nb < BQ / 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) dpt[nb][e] = st[nb][e] * (dpt[nb][e] - dt[nb * 8 + (lane & 3) * 2 + (e & 1)]);
}

// The streamed tiles of the wgmma kernels sit in a ring of three buffers: tile j + 1 is requested (cp.async)
// right after the barrier that opens tile j, into the buffer of tile j - 2, so one barrier per tile suffices,
// the copy overlaps all of tile j's work, and the last matmul of tile j (P V, dS K) may still be reading its
// buffer while tile j + 1 starts: it is waited for only after the next tile's first wgmma is issued.
#define TSYS_CUDA__FLASH_WG_STAGES 3

// Forward: WG warpgroups x 64 query rows = BQ; key/value tiles of BK rows. Tiles that need no mask (inside n
// and, when causal, at or below the block's first query row) run a body without index math.
template <typename T, int D, int BK, int WG, int MINB, bool CAUSAL>
__global__ void __launch_bounds__(WG * 128, MINB)
tsys_cuda__flash_fwd_wg_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *__restrict__ o,
                          float *__restrict__ lse, int n, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BQ = WG * 64, NT = WG * 128;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *qs = (T *)tsys_cuda__flash_wg_smem_base(tsys_cuda__flash_smem_raw);
    T *ks = qs + BQ * D;                          // [STAGES][BK * D]
    T *vs = ks + TSYS_CUDA__FLASH_WG_STAGES * BK * D;        // [STAGES][BK * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qt * BQ, wr0 = warp * 16;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; o += base; lse += (size_t)blockIdx.y * n;

    int nkt = (n + BK - 1) / BK, nfull = n / BK;
    if (CAUSAL) nkt = min(nkt, (q0 + BQ - 1) / BK + 1), nfull = min(nfull, (q0 + 1) / BK);

    tsys_cuda__flash_wg_load_tile<BQ, D, NT>(qs, q, q0, n);
    tsys_cuda__flash_wg_load_tile<BK, D, NT>(ks, k, 0, n);
    tsys_cuda__flash_wg_load_tile<BK, D, NT>(vs, v, 0, n);
    tsys_cuda__flash_cp_async_commit();

    float oacc[D / 8][4];
    tsys_cuda__flash_zero<1, D>(&oacc);
    float m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.0f, 0.0f };

    uint32_t pa[BK / 16][4];   // P of the previous tile: its P V wgmma may still be reading these registers
    // no per-warpgroup causal skip anywhere: a data-dependent branch around wgmma makes ptxas serialize them
    auto tile = [&](int j, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        tsys_cuda__flash_cp_async_wait<0>();
        tsys_cuda__flash_fence_proxy_async();
        __syncthreads();
        if (j + 1 < nkt) {
            const int nb = (j + 1) % TSYS_CUDA__FLASH_WG_STAGES;
            tsys_cuda__flash_wg_load_tile<BK, D, NT>(ks + nb * BK * D, k, (j + 1) * BK, n);
            tsys_cuda__flash_wg_load_tile<BK, D, NT>(vs + nb * BK * D, v, (j + 1) * BK, n);
            tsys_cuda__flash_cp_async_commit();
        }
        const int k0 = j * BK, buf = j % TSYS_CUDA__FLASH_WG_STAGES;
        const T *kt = ks + buf * BK * D, *vt = vs + buf * BK * D;
        float s[BK / 8][4];
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_ss<T, BK, BQ, D>(s, qs, wg * 64, kt);
        tsys_cuda__flash_wg_commit();
        tsys_cuda__flash_wg_wait<0>();   // S of this tile and P V of the previous one
        tsys_cuda__flash_wg_fence_acc<BK>(s);
        tsys_cuda__flash_wg_fence_acc<D>(oacc);
        float alpha[2];
        tsys_cuda__flash_wg_softmax<BK, MASK, CAUSAL>(s, m, l, alpha, q0 + wr0, k0, n, lane, scale_log2);
        tsys_cuda__flash_wg_pack<T, BK>(pa, s);
#pragma unroll
        for (int nb = 0; nb < D / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) oacc[nb][e] *= alpha[e >> 1];
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_rs<T, D, BK>(oacc, pa, vt);   // waited for in the next tile
        tsys_cuda__flash_wg_commit();
    };
    for (int j = 0; j < nfull; j++) tile(j, std::false_type());
    for (int j = nfull; j < nkt; j++) tile(j, std::true_type());
    tsys_cuda__flash_wg_wait<0>();
    tsys_cuda__flash_wg_fence_acc<D>(oacc);

    tsys_cuda__flash_wg_fwd_finish<T, D>(o, lse, oacc, m, l, q0 + wr0, n, lane);
#endif
}

// Visits tiles [lo, hi) with the masked body at the two ends and the mask-free body in [free_lo, free_hi);
// DOWN: from hi - 1 down to lo.
template <bool DOWN = false, typename F>
__device__ __forceinline__ void tsys_cuda__flash_wg_tiles(int lo, int hi, int free_lo, int free_hi, F &&tile) {
    const int a = min(max(free_lo, lo), hi), b = max(a, min(free_hi, hi));
    if constexpr (DOWN) {
        for (int i = hi - 1; i >= b; i--) tile(i, std::true_type());
        for (int i = b - 1; i >= a; i--) tile(i, std::false_type());
        for (int i = a - 1; i >= lo; i--) tile(i, std::true_type());
    } else {
        for (int i = lo; i < a; i++) tile(i, std::true_type());
        for (int i = a; i < b; i++) tile(i, std::false_type());
        for (int i = b; i < hi; i++) tile(i, std::true_type());
    }
}

// dK, dV: WG warpgroups x 64 keys = BKV; query tiles of BQ rows (Q, dO, lse, D) double-buffered: tile it + 1
// is requested right after the barrier that opens tile it, when every wgmma of tile it - 1 has completed.
template <typename T, int D, int BQ, int WG, int MINB, bool CAUSAL>
__global__ void __launch_bounds__(WG * 128, MINB)
tsys_cuda__flash_bwd_dkdv_wg_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                               const T *__restrict__ dout, const float *__restrict__ lse,
                               const float *__restrict__ dvec, T *__restrict__ dk, T *__restrict__ dv, int n,
                               float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BKV = WG * 64, NT = WG * 128;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *ks = (T *)tsys_cuda__flash_wg_smem_base(tsys_cuda__flash_smem_raw);
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
    // query tiles in [free_lo, free_hi) need no mask: all rows < n and, when causal, >= the block's last key
    const int free_lo = CAUSAL ? (k0 + BKV - 1 + BQ - 1) / BQ : 0, free_hi = n / BQ;

    tsys_cuda__flash_wg_load_tile<BKV, D, NT>(ks, k, k0, n);
    tsys_cuda__flash_wg_load_tile<BKV, D, NT>(vs, v, k0, n);
    auto load_q = [&](int it, int buf) {
        const int q0 = it * BQ;
        tsys_cuda__flash_wg_load_tile<BQ, D, NT>(qs + buf * BQ * D, q, q0, n);
        tsys_cuda__flash_wg_load_tile<BQ, D, NT>(gs + buf * BQ * D, dout, q0, n);
        for (int i = threadIdx.x; i < BQ; i += NT) {   // zero past n: those rows are masked
            const bool ok = q0 + i < n;
            tsys_cuda__flash_cp_async4(ls + buf * BQ + i, lse + (ok ? q0 + i : 0), ok);
            tsys_cuda__flash_cp_async4(ds + buf * BQ + i, dvec + (ok ? q0 + i : 0), ok);
        }
    };
    load_q(it0, 0);
    tsys_cuda__flash_cp_async_commit();

    float dka[D / 8][4], dva[D / 8][4];
    tsys_cuda__flash_zero<1, D>(&dka);
    tsys_cuda__flash_zero<1, D>(&dva);

    tsys_cuda__flash_wg_tiles(it0, nqt, free_lo, free_hi, [&](int it, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int buf = (it - it0) & 1;
        tsys_cuda__flash_cp_async_wait<0>();
        tsys_cuda__flash_fence_proxy_async();
        __syncthreads();
        if (it + 1 < nqt) {
            load_q(it + 1, buf ^ 1);
            tsys_cuda__flash_cp_async_commit();
        }
        const int q0 = it * BQ;
        const T *qt = qs + buf * BQ * D, *gt = gs + buf * BQ * D;
        const float *lt = ls + buf * BQ, *dt = ds + buf * BQ;
        float st[BQ / 8][4], dpt[BQ / 8][4];
        tsys_cuda__flash_wg_kv_scores<T, D, BQ, BKV>(st, dpt, ks, vs, wg, qt, gt);
        tsys_cuda__flash_wg_wait<1>();
        tsys_cuda__flash_wg_fence_acc<BQ>(st);
        tsys_cuda__flash_wg_kv_p<BQ, MASK, CAUSAL>(st, lt, k0 + wk0, q0, n, lane, scale_log2);
        uint32_t pa[BQ / 16][4];
        tsys_cuda__flash_wg_pack<T, BQ>(pa, st);
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_rs<T, D, BQ>(dva, pa, gt);                  // dV += P^T dO
        tsys_cuda__flash_wg_commit();
        tsys_cuda__flash_wg_wait<1>();
        tsys_cuda__flash_wg_fence_acc<BQ>(dpt);
        tsys_cuda__flash_wg_kv_ds<BQ>(dpt, st, dt, lane);
        uint32_t dsa[BQ / 16][4];
        tsys_cuda__flash_wg_pack<T, BQ>(dsa, dpt);
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_rs<T, D, BQ>(dka, dsa, qt);                 // dK += dS^T Q
        tsys_cuda__flash_wg_commit();
        tsys_cuda__flash_wg_wait<0>();
        tsys_cuda__flash_wg_fence_acc<D>(dka);
        tsys_cuda__flash_wg_fence_acc<D>(dva);
    });
    tsys_cuda__flash_store<T, 1, D>(dk, &dka, k0 + wk0, n, scale, lane);
    tsys_cuda__flash_store<T, 1, D>(dv, &dva, k0 + wk0, n, 1.0f, lane);
#endif
}

// dQ: WG warpgroups x 64 query rows = BQ; key/value tiles of BK rows in the ring, as in the forward.
template <typename T, int D, int BK, int WG, int MINB, bool CAUSAL>
__global__ void __launch_bounds__(WG * 128, MINB)
tsys_cuda__flash_bwd_dq_wg_kernel(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,
                             const T *__restrict__ dout, const float *__restrict__ lse, const float *__restrict__ dvec,
                             T *__restrict__ dq, int n, float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BQ = WG * 64, NT = WG * 128;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *qs = (T *)tsys_cuda__flash_wg_smem_base(tsys_cuda__flash_smem_raw);
    T *gs = qs + BQ * D;
    T *ks = gs + BQ * D;                          // [STAGES][BK * D]
    T *vs = ks + TSYS_CUDA__FLASH_WG_STAGES * BK * D;        // [STAGES][BK * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int qt = CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qt * BQ, wr0 = warp * 16;
    const size_t base = (size_t)blockIdx.y * n * D;
    q += base; k += base; v += base; dout += base; dq += base;
    lse += (size_t)blockIdx.y * n; dvec += (size_t)blockIdx.y * n;

    int nkt = (n + BK - 1) / BK, nfull = n / BK;
    if (CAUSAL) nkt = min(nkt, (q0 + BQ - 1) / BK + 1), nfull = min(nfull, (q0 + 1) / BK);

    tsys_cuda__flash_wg_load_tile<BQ, D, NT>(qs, q, q0, n);
    tsys_cuda__flash_wg_load_tile<BQ, D, NT>(gs, dout, q0, n);
    tsys_cuda__flash_wg_load_tile<BK, D, NT>(ks, k, 0, n);
    tsys_cuda__flash_wg_load_tile<BK, D, NT>(vs, v, 0, n);
    tsys_cuda__flash_cp_async_commit();

    float lrow[2], drow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = q0 + wr0 + (lane >> 2) + h * 8;
        lrow[h] = row < n ? lse[row] * TSYS_CUDA__FLASH_LOG2E : 0.0f;
        drow[h] = row < n ? dvec[row] : 0.0f;
    }
    float dqa[D / 8][4];
    tsys_cuda__flash_zero<1, D>(&dqa);

    uint32_t dsa[BK / 16][4];   // dS of the previous tile: its dS K wgmma may still be reading these registers
    auto tile = [&](int j, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        tsys_cuda__flash_cp_async_wait<0>();
        tsys_cuda__flash_fence_proxy_async();
        __syncthreads();
        if (j + 1 < nkt) {
            const int nb = (j + 1) % TSYS_CUDA__FLASH_WG_STAGES;
            tsys_cuda__flash_wg_load_tile<BK, D, NT>(ks + nb * BK * D, k, (j + 1) * BK, n);
            tsys_cuda__flash_wg_load_tile<BK, D, NT>(vs + nb * BK * D, v, (j + 1) * BK, n);
            tsys_cuda__flash_cp_async_commit();
        }
        const int k0 = j * BK, buf = j % TSYS_CUDA__FLASH_WG_STAGES;
        const T *kt = ks + buf * BK * D, *vt = vs + buf * BK * D;
        float s[BK / 8][4], dp[BK / 8][4];
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_ss<T, BK, BQ, D>(s, qs, wg * 64, kt);    // S = Q K^T
        tsys_cuda__flash_wg_commit();
        tsys_cuda__flash_wg_ss<T, BK, BQ, D>(dp, gs, wg * 64, vt);   // dP = dO V^T
        tsys_cuda__flash_wg_commit();
        tsys_cuda__flash_wg_wait<1>();   // the previous dS K, and S
        tsys_cuda__flash_wg_fence_acc<BK>(s);
        tsys_cuda__flash_wg_dq_ds<BK, MASK, CAUSAL>(s, dp, lrow, drow, q0 + wr0, k0, n, lane, scale_log2);
        tsys_cuda__flash_wg_pack<T, BK>(dsa, s);
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_rs<T, D, BK>(dqa, dsa, kt);               // dQ += dS K, waited for in the next tile
        tsys_cuda__flash_wg_commit();
    };
    for (int j = 0; j < nfull; j++) tile(j, std::false_type());
    for (int j = nfull; j < nkt; j++) tile(j, std::true_type());
    tsys_cuda__flash_wg_wait<0>();
    tsys_cuda__flash_wg_fence_acc<D>(dqa);
    tsys_cuda__flash_store<T, 1, D>(dq, &dqa, q0 + wr0, n, scale, lane);
#endif
}

// >>flash warp-specialized ------------------------------------------------------------------------
// Barrier `id` (1..15) that `threads` threads (whole warps) meet at: a warpgroup (128) or the consumer warpgroups.
__device__ __forceinline__ void tsys_cuda__flash_named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void tsys_cuda__flash_named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// CW consumer warpgroups issuing their wgmmas in turn, round robin (ON: else every call is a no-op): turn w is named
// barrier 8 + w, met by consumer w (take) and the consumer before it (pass). open() before the loop lets consumer 0
// go first; close() after it has consumer 0 meet the last consumer's last pass, so that every arrive is matched.
template <int CW, bool ON> struct tsys_cuda__flash_turns {
    static __device__ __forceinline__ void open(int wg) { if (ON && wg == CW - 1) tsys_cuda__flash_named_arrive(8, 256); }
    static __device__ __forceinline__ void take(int wg) { if (ON) tsys_cuda__flash_named_sync(8 + wg, 256); }
    static __device__ __forceinline__ void pass(int wg) { if (ON) tsys_cuda__flash_named_arrive(8 + (wg + 1) % CW, 256); }
    static __device__ __forceinline__ void close(int wg) { if (ON && wg == 0) tsys_cuda__flash_named_sync(8, 256); }
};

// The consumer warpgroups' registers once the producer has given its own back (`setmaxnreg.dec` to 24): 240 each
// with 2 consumers, 160 with 3 (the block's 64K registers).
template <int CW> __device__ __forceinline__ void tsys_cuda__flash_ws_consumer_regs() {
    static_assert(CW == 2 || CW == 3, "2 or 3 consumer warpgroups");
    if constexpr (CW == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    else asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n");
}

// Warp-specialized forward (sm_90a): one producer warpgroup streams K/V tiles with the tensor-memory
// accelerator (TMA) into the ring, three consumer warpgroups (64 query rows each) compute. Stages are handed
// over with mbarriers instead of block-wide barriers, so the consumers drift out of step and one warpgroup's
// softmax (special-function unit) runs while another's matmuls use the tensor cores; `setmaxnreg` moves the
// producer's registers to the consumers (24 / 160 per thread). TMA writes the same 128B-swizzled layout the
// cp.async loads do, and fills rows past n with zeros. T = float runs the matmuls on TF32 (k8 wgmmas; 64-key
// tiles at d 64, 32-key tiles and two consumers at d 128): Q rounded in shared memory by its consumers, K and
// V^T from the pre-pass (tsys_cuda__flash_tf32_prep).
template <typename T, int D, int BK, int CW_ = 3> struct tsys_cuda__flash_ws_layout {
    static constexpr int CW = CW_, BQ = CW * 64, NT = (CW + 1) * 128;
    static constexpr size_t Q_BYTES = (size_t)BQ * D * sizeof(T), KV_BYTES = (size_t)BK * D * sizeof(T);
    // Q (and dO in the dQ kernel: SMEM; the forward's FWD_SMEM holds Q alone), the K/V ring, the mbarriers,
    // alignment slack
    static constexpr size_t RING = 2 * TSYS_CUDA__FLASH_WG_STAGES * KV_BYTES + 8 * (1 + 2 * TSYS_CUDA__FLASH_WG_STAGES) + 1024;
    static constexpr size_t SMEM = 2 * Q_BYTES + RING, FWD_SMEM = Q_BYTES + RING;
};

// The query block of a warp-specialized forward or dQ block (causal: the last, longest rows first), slice b,
// and its key tiles: its share [j0, j1) of them (ys = bh index x nsplit + share), of which those below nfull
// need no mask.
struct tsys_cuda__flash_ws_qrange { int q0, b, split, j0, j1, nfull; };
template <int BQ, int BK, bool CAUSAL>
__device__ __forceinline__ tsys_cuda__flash_ws_qrange tsys_cuda__flash_ws_qblock(int n, int b0, int nsplit) {
    tsys_cuda__flash_ws_qrange r;
    const tsys_cuda__flash_block o = tsys_cuda__flash_block_of();
    const int qt = CAUSAL ? gridDim.x - 1 - o.tile : o.tile;
    r.q0 = qt * BQ; r.b = b0 + o.ys / nsplit; r.split = o.ys % nsplit;
    int nkt = (n + BK - 1) / BK;
    r.nfull = n / BK;
    if (CAUSAL) nkt = min(nkt, (r.q0 + BQ - 1) / BK + 1), r.nfull = min(r.nfull, (r.q0 + 1) / BK);
    tsys_cuda__flash_share(0, nkt, nsplit, r.split, &r.j0, &r.j1);
    return r;
}

__device__ __forceinline__ void tsys_cuda__flash_mbar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tsys_cuda__flash_smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void tsys_cuda__flash_mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(tsys_cuda__flash_smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void tsys_cuda__flash_mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(tsys_cuda__flash_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void tsys_cuda__flash_mbar_wait(uint64_t *bar, int parity) {
    asm volatile("{\n.reg .pred p;\nTSYS_MBAR_WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra TSYS_MBAR_WAIT_%=;\n}\n" ::"r"(tsys_cuda__flash_smem_addr(bar)), "r"(parity) : "memory");
}
// One box (64 columns x the map's rows) of a (bh, n, D) tensor at column c0, row r0 of slice b.
__device__ __forceinline__ void tsys_cuda__flash_tma_load(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int r0, int b) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(tsys_cuda__flash_smem_addr(dst)), "l"((uint64_t)map), "r"(c0), "r"(r0), "r"(b), "r"(tsys_cuda__flash_smem_addr(bar))
                 : "memory");
}

// Ring bookkeeping of the warp-specialized kernels: qfull (the block's Q / dO arrived), full[s] (stage s
// holds its tile: one arrival with the byte count, then the copy engine's bytes), empty[s] (every consumer
// warp is done with stage s: `consumers` arrivals).
// `fillers`: the arrivals that fill a stage (the TMA thread's, plus the lanes of a warp that copies with cp.async);
// `stages`: the ring's (full and empty hold that many barriers each).
__device__ __forceinline__ void tsys_cuda__flash_ws_init(uint64_t *qfull, uint64_t *full, uint64_t *empty, int consumers, int fillers = 1,
                                              int stages = TSYS_CUDA__FLASH_WG_STAGES) {
    if (threadIdx.x == 0) {
        tsys_cuda__flash_mbar_init(qfull, 1);
        for (int s = 0; s < stages; s++) tsys_cuda__flash_mbar_init(full + s, fillers), tsys_cuda__flash_mbar_init(empty + s, consumers);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}
// The producer thread's loop: K and V tiles j0..j1-1 of slice b into the ring (the i-th of them in stage
// i % STAGES), each stage reused once the consumers have released the tile STAGES before. A box is 128 bytes
// wide (64 16-bit columns, 32 fp32). fp32 (TF32): tv maps V^T (bh, D, keys), and a stage holds D rows of BK
// keys, the K-major B operand of P V.
template <int D, int BK, typename T>
__device__ __forceinline__ void tsys_cuda__flash_ws_stream_kv(T *ks, T *vs, uint64_t *full, uint64_t *empty, const CUtensorMap *tk,
                                                   const CUtensorMap *tv, int j0, int j1, int b) {
    constexpr int ST = TSYS_CUDA__FLASH_WG_STAGES, C = 128 / (int)sizeof(T);
    for (int j = j0; j < j1; j++) {
        const int i = j - j0, s = i % ST;
        if (i >= ST) tsys_cuda__flash_mbar_wait(empty + s, (i / ST - 1) & 1);
        tsys_cuda__flash_mbar_expect_tx(full + s, (uint32_t)(2 * BK * D * sizeof(T)));
        for (int cb = 0; cb < D / C; cb++) tsys_cuda__flash_tma_load(ks + s * BK * D + cb * BK * C, tk, full + s, cb * C, j * BK, b);
        if constexpr (sizeof(T) == 4)
            for (int cb = 0; cb < BK / C; cb++) tsys_cuda__flash_tma_load(vs + s * BK * D + cb * D * C, tv, full + s, j * BK + cb * C, 0, b);
        else
            for (int cb = 0; cb < D / C; cb++) tsys_cuda__flash_tma_load(vs + s * BK * D + cb * BK * C, tv, full + s, cb * C, j * BK, b);
    }
}

// TF32: each consumer warpgroup rounds its 64 rows of the block's Q tile (D / 32 column blocks of BQ rows x
// 128 bytes) to nearest in place, as the mma.sync kernels round their operands; wgmma would truncate.
template <int BQ, int D>
__device__ __forceinline__ void tsys_cuda__flash_ws_round_q(float *qs, int wg) {
    for (int cb = 0; cb < D / 32; cb++) {
        float4 *p = (float4 *)(qs + cb * BQ * 32 + wg * 64 * 32);
        for (int i = threadIdx.x & 127; i < 64 * 32 / 4; i += 128) {
            float4 x = p[i];
            x.x = __uint_as_float(tsys_cuda__flash_t<float>::tf32(x.x)); x.y = __uint_as_float(tsys_cuda__flash_t<float>::tf32(x.y));
            x.z = __uint_as_float(tsys_cuda__flash_t<float>::tf32(x.z)); x.w = __uint_as_float(tsys_cuda__flash_t<float>::tf32(x.w));
            p[i] = x;
        }
    }
    tsys_cuda__flash_fence_proxy_async();   // the generic-proxy writes, before wgmma reads them
    tsys_cuda__flash_named_sync(1 + wg, 128);
}

// Split (nsplit > 1, one slice: b0 = 0): gridDim.y = bh x nsplit (tsys_cuda__flash_block_of), each block runs its share of
// the key tiles (as the mma.sync forward's split).
// CW consumer warpgroups: 3 (160 registers each), or 2 (240): TF32 at d 128 (three blocks of Q do not fit shared memory)
// and 16-bit at d 128 (128-key tiles; faster than three consumers on 64-key tiles).
// TURNS (tsys_cuda__flash_ws_tiles::FWD_TURNS): the softmax of tile j runs while tile j - 1's P V does (issued
// after tile j's S), and the consumers issue their tiles' wgmmas in turn (tsys_cuda__flash_turns), so that one's
// softmax runs while the next one's matmuls do.
template <typename T, int D, int BK, bool CAUSAL, int CW_ = 3, bool TURNS = false>
__global__ void __launch_bounds__(tsys_cuda__flash_ws_layout<T, D, BK, CW_>::NT, 1)
tsys_cuda__flash_fwd_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                          const __grid_constant__ CUtensorMap tv, T *__restrict__ o, float *__restrict__ lse, int n,
                          int b0, float scale_log2, int nsplit, float *__restrict__ part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef tsys_cuda__flash_ws_layout<T, D, BK, CW_> L;
    constexpr int BQ = L::BQ, CW = L::CW, ST = TSYS_CUDA__FLASH_WG_STAGES;
    typedef tsys_cuda__flash_turns<CW, TURNS> turns;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *qs = (T *)tsys_cuda__flash_wg_smem_base(tsys_cuda__flash_smem_raw);
    T *ks = qs + BQ * D;        // [ST][BK * D]
    T *vs = ks + ST * BK * D;   // [ST][BK * D]
    uint64_t *qfull = (uint64_t *)(vs + ST * BK * D), *full = qfull + 1, *empty = full + ST;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const tsys_cuda__flash_ws_qrange r = tsys_cuda__flash_ws_qblock<BQ, BK, CAUSAL>(n, b0, nsplit);
    const int q0 = r.q0, b = r.b, split = r.split, j0 = r.j0, nkt = r.j1, nfull = r.nfull;

    tsys_cuda__flash_ws_init(qfull, full, empty, CW * 4);

    if (wg == CW) {   // producer warpgroup: one thread issues every copy
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == CW * 128) {
            constexpr int C = 128 / (int)sizeof(T);
            tsys_cuda__flash_mbar_expect_tx(qfull, (uint32_t)L::Q_BYTES);
            for (int cb = 0; cb < D / C; cb++) tsys_cuda__flash_tma_load(qs + cb * BQ * C, &tq, qfull, cb * C, q0, b);
            tsys_cuda__flash_ws_stream_kv<D, BK>(ks, vs, full, empty, &tk, &tv, j0, nkt, b);
        }
        return;
    }
    tsys_cuda__flash_ws_consumer_regs<CW>();
    const int wr0 = warp * 16;
    o += ((size_t)b * n) * D; lse += (size_t)b * n;
    float oacc[D / 8][4];
    tsys_cuda__flash_zero<1, D>(&oacc);
    float m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.0f, 0.0f };
    uint32_t pa[BK / tsys_cuda__flash_wg_k<T>][4];   // P of the previous tile: its P V wgmma may still be reading these registers
    tsys_cuda__flash_mbar_wait(qfull, 0);
    if constexpr (sizeof(T) == 4) tsys_cuda__flash_ws_round_q<BQ, D>((float *)qs, wg);

    auto tile = [&](int j, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int i = j - j0, s = i % ST, k0 = j * BK;
        tsys_cuda__flash_mbar_wait(full + s, (i / ST) & 1);
        const T *kt = ks + s * BK * D, *vt = vs + s * BK * D;
        float sc[BK / 8][4];
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_ss<T, BK, BQ, D>(sc, qs, wg * 64, kt);
        tsys_cuda__flash_wg_commit();
        tsys_cuda__flash_wg_wait<0>();   // S of this tile and P V of the previous one
        tsys_cuda__flash_wg_fence_acc<BK>(sc);
        tsys_cuda__flash_wg_fence_acc<D>(oacc);
        if (i > 0 && lane == 0) tsys_cuda__flash_mbar_arrive(empty + (i - 1) % ST);   // this warp is done with tile j - 1
        float alpha[2];
        tsys_cuda__flash_wg_softmax<BK, MASK, CAUSAL>(sc, m, l, alpha, q0 + wr0, k0, n, lane, scale_log2);
        tsys_cuda__flash_wg_pack<T, BK>(pa, sc);
#pragma unroll
        for (int nb = 0; nb < D / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) oacc[nb][e] *= alpha[e >> 1];
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_rs<T, D, BK>(oacc, pa, vt);   // waited for in the next tile
        tsys_cuda__flash_wg_commit();
    };
    // TURNS: S of tile j, then P V of tile j - 1 (P still in pa); the softmax of tile j while that P V runs; O is
    // rescaled and pa repacked once it is done. Every tile commits two groups (the second empty for the first
    // tile), so that one unconditional wait<1> covers S.
    auto tile_ovl = [&](int j, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int i = j - j0, s = i % ST, k0 = j * BK;
        tsys_cuda__flash_mbar_wait(full + s, (i / ST) & 1);
        const T *kt = ks + s * BK * D;
        float sc[BK / 8][4];
        turns::take(wg);
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_ss<T, BK, BQ, D>(sc, qs, wg * 64, kt);
        tsys_cuda__flash_wg_commit();
        if (i > 0) tsys_cuda__flash_wg_rs<T, D, BK>(oacc, pa, vs + ((i - 1) % ST) * BK * D);
        tsys_cuda__flash_wg_commit();
        turns::pass(wg);
        tsys_cuda__flash_wg_wait<1>();   // S of this tile
        tsys_cuda__flash_wg_fence_acc<BK>(sc);
        float alpha[2];
        tsys_cuda__flash_wg_softmax<BK, MASK, CAUSAL>(sc, m, l, alpha, q0 + wr0, k0, n, lane, scale_log2);
        tsys_cuda__flash_wg_wait<0>();   // P V of the previous tile
        tsys_cuda__flash_wg_fence_acc<D>(oacc);
        if (i > 0 && lane == 0) tsys_cuda__flash_mbar_arrive(empty + (i - 1) % ST);   // this warp is done with tile j - 1
#pragma unroll
        for (int nb = 0; nb < D / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) oacc[nb][e] *= alpha[e >> 1];
        tsys_cuda__flash_wg_pack<T, BK>(pa, sc);
    };
    if constexpr (TURNS) {
        turns::open(wg);
        for (int j = j0; j < min(nfull, nkt); j++) tile_ovl(j, std::false_type());
        for (int j = max(j0, nfull); j < nkt; j++) tile_ovl(j, std::true_type());
        turns::close(wg);
        if (nkt > j0) {
            tsys_cuda__flash_wg_fence();
            tsys_cuda__flash_wg_rs<T, D, BK>(oacc, pa, vs + ((nkt - 1 - j0) % ST) * BK * D);
            tsys_cuda__flash_wg_commit();
        }
    } else {
        for (int j = j0; j < min(nfull, nkt); j++) tile(j, std::false_type());
        for (int j = max(j0, nfull); j < nkt; j++) tile(j, std::true_type());
    }
    tsys_cuda__flash_wg_wait<0>();
    tsys_cuda__flash_wg_fence_acc<D>(oacc);

    if (part) {   // split: O of this share normalized by its own sum, and its lse, for tsys_cuda__flash_split_combine
        const size_t rows = (size_t)(gridDim.y / nsplit) * n;   // one slice: gridDim.y / nsplit = bh
        tsys_cuda__flash_wg_fwd_finish<float, D>(part + (split * rows + (size_t)b * n) * D, part + nsplit * rows * D + split * rows + (size_t)b * n,
                                                 oacc, m, l, q0 + wr0, n, lane);
        return;
    }
    tsys_cuda__flash_wg_fwd_finish<T, D>(o, lse, oacc, m, l, q0 + wr0, n, lane);
#endif
}

// Warp-specialized dQ (sm_90a), built like the warp-specialized forward: the producer warpgroup loads the
// block's Q and dO once and streams K/V tiles through the ring; CW consumer warpgroups of 64 query rows each
// accumulate dQ = scale * dS K, keeping each tile's dS K wgmma in flight until the next tile's S is done.
// Split (nsplit > 1, one slice: b0 = 0): gridDim.y = bh x nsplit (tsys_cuda__flash_block_of); the block runs its share of
// the key tiles and leaves its unscaled fp32 sums in part ([share][bh][n][D]) for tsys_cuda__flash_split_sum.
// PP: the consumers issue each tile's S and dP wgmmas in turn (tsys_cuda__flash_turns), as the forward's FWD_TURNS
// (tsys_cuda__flash_ws_tiles::DQ_TURNS).
template <typename T, int D, int BK, int CW, bool CAUSAL, bool PP = false>
__global__ void __launch_bounds__((CW + 1) * 128, 1)
tsys_cuda__flash_bwd_dq_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                             const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tg,
                             const float *__restrict__ lse, const float *__restrict__ dvec, T *__restrict__ dq, int n,
                             int b0, float scale, float scale_log2, int nsplit, float *__restrict__ part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef tsys_cuda__flash_ws_layout<T, D, BK, CW> L;
    constexpr int BQ = L::BQ, ST = TSYS_CUDA__FLASH_WG_STAGES;
    typedef tsys_cuda__flash_turns<CW, PP> turns;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *qs = (T *)tsys_cuda__flash_wg_smem_base(tsys_cuda__flash_smem_raw);
    T *gs = qs + BQ * D;
    T *ks = gs + BQ * D;        // [ST][BK * D]
    T *vs = ks + ST * BK * D;   // [ST][BK * D]
    uint64_t *qfull = (uint64_t *)(vs + ST * BK * D), *full = qfull + 1, *empty = full + ST;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const tsys_cuda__flash_ws_qrange r = tsys_cuda__flash_ws_qblock<BQ, BK, CAUSAL>(n, b0, nsplit);
    const int q0 = r.q0, b = r.b, split = r.split, j0 = r.j0, nkt = r.j1, nfull = r.nfull;

    tsys_cuda__flash_grid_launch_dependents();   // the dK/dV kernel, independent of this one, may fill the tail
    tsys_cuda__flash_ws_init(qfull, full, empty, CW * 4);

    if (wg == CW) {   // producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == CW * 128) {
            tsys_cuda__flash_mbar_expect_tx(qfull, (uint32_t)(2 * L::Q_BYTES));
            for (int cb = 0; cb < D / 64; cb++) {
                tsys_cuda__flash_tma_load(qs + cb * BQ * 64, &tq, qfull, cb * 64, q0, b);
                tsys_cuda__flash_tma_load(gs + cb * BQ * 64, &tg, qfull, cb * 64, q0, b);
            }
            tsys_cuda__flash_ws_stream_kv<D, BK>(ks, vs, full, empty, &tk, &tv, j0, nkt, b);
        }
        return;
    }
    tsys_cuda__flash_ws_consumer_regs<CW>();
    const int wr0 = warp * 16;
    lse += (size_t)b * n; dvec += (size_t)b * n; dq += (size_t)b * n * D;
    float lrow[2], drow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = q0 + wr0 + (lane >> 2) + h * 8;
        lrow[h] = row < n ? lse[row] * TSYS_CUDA__FLASH_LOG2E : 0.0f;
        drow[h] = row < n ? dvec[row] : 0.0f;
    }
    float dqa[D / 8][4];
    tsys_cuda__flash_zero<1, D>(&dqa);
    uint32_t dsa[BK / 16][4];   // dS of the previous tile: its dS K wgmma may still be reading these registers
    tsys_cuda__flash_mbar_wait(qfull, 0);

    auto tile = [&](int j, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int i = j - j0, s = i % ST, k0 = j * BK;
        tsys_cuda__flash_mbar_wait(full + s, (i / ST) & 1);
        const T *kt = ks + s * BK * D, *vt = vs + s * BK * D;
        float sc[BK / 8][4], dp[BK / 8][4];
        turns::take(wg);
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_ss<T, BK, BQ, D>(sc, qs, wg * 64, kt);    // S = Q K^T
        tsys_cuda__flash_wg_commit();
        tsys_cuda__flash_wg_ss<T, BK, BQ, D>(dp, gs, wg * 64, vt);    // dP = dO V^T
        tsys_cuda__flash_wg_commit();
        turns::pass(wg);
        tsys_cuda__flash_wg_wait<1>();   // the previous dS K, and S
        tsys_cuda__flash_wg_fence_acc<BK>(sc);
        if (i > 0 && lane == 0) tsys_cuda__flash_mbar_arrive(empty + (i - 1) % ST);   // this warp is done with tile j - 1
        tsys_cuda__flash_wg_dq_ds<BK, MASK, CAUSAL>(sc, dp, lrow, drow, q0 + wr0, k0, n, lane, scale_log2);
        tsys_cuda__flash_wg_pack<T, BK>(dsa, sc);
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_rs<T, D, BK>(dqa, dsa, kt);               // dQ += dS K, waited for in the next tile
        tsys_cuda__flash_wg_commit();
    };
    turns::open(wg);
    for (int j = j0; j < min(nfull, nkt); j++) tile(j, std::false_type());
    for (int j = max(j0, nfull); j < nkt; j++) tile(j, std::true_type());
    turns::close(wg);
    tsys_cuda__flash_wg_wait<0>();
    tsys_cuda__flash_wg_fence_acc<D>(dqa);
    if (part) {   // split: this share's sums, unscaled ([share][bh][n][D]; one slice, so gridDim.y / nsplit = bh)
        const size_t plane = (size_t)(gridDim.y / nsplit) * n * D;
        tsys_cuda__flash_store<float, 1, D>(part + split * plane + (size_t)b * n * D, &dqa, q0 + wr0, n, 1.0f, lane);
        return;
    }
    tsys_cuda__flash_store<T, 1, D>(dq, &dqa, q0 + wr0, n, scale, lane);
#endif
}

// Warp-specialized dK/dV (sm_90a): CW consumer warpgroups of 64 keys each (BKV = CW * 64 keys a block, K and V
// loaded once) walk the query tiles; the producer warpgroup streams each tile's Q and dO with TMA and, from a
// second warp, its lse and D rows with cp.async (zeros past n), all landing on the stage's `full` mbarrier.
// A tile's dK += dS^T Q stays in flight until the next tile's S^T is done, so the consumers release a stage
// one tile late. At d 128 ptxas serializes the wgmmas (C7512: the dK and dV accumulators are 128 registers a
// thread), and it still beats the cp.async kernel by 15%; neither waiting for dV before dS^T is packed nor a
// 288-thread block with one producer warp (no `setmaxnreg`) helped (the latter serializes d 64 too).
template <typename T, int D, int BQ, int CW, bool FUSED = false> struct tsys_cuda__flash_ws_kv_layout {
    // DQCOL (the fused kernel past d 64): each consumer makes D / CW columns of the tile's dQ over all BKV keys
    // (its own 64 keys' dQ, D columns, would not fit its registers beside dK and dV); dS^T is then read by both
    // consumers and double-buffered, and the Q / dO ring has two stages so that it all fits shared memory.
    static constexpr bool DQCOL = FUSED && D > 64;
    static constexpr int BKV = CW * 64, NT = (CW + 1) * 128, ST = DQCOL ? 2 : TSYS_CUDA__FLASH_WG_STAGES;
    static constexpr int DQN = DQCOL ? D / CW : D;       // the columns of a consumer's dQ part
    static constexpr int SLOTS = FUSED ? 2 : 0;           // dQ staging buffers (the finishing consumer alternates)
    static constexpr size_t KV_BYTES = (size_t)BKV * D * sizeof(T), QT_BYTES = (size_t)BQ * D * sizeof(T);
    // dS^T in shared memory: the fused dQ reads it; past d 64 the dK wgmma reads it there too, which leaves the
    // registers that ptxas needs to keep the wgmmas in flight (with dS^T as register A operands it serialized them)
    static constexpr bool DS_SMEM = FUSED || (sizeof(T) == 2 && D > 64);
    static constexpr size_t DS_BYTES = DS_SMEM ? (size_t)(DQCOL ? 2 : 1) * BKV * BQ * sizeof(T) : 0;       // dS^T
    static constexpr size_t STAGE_BYTES = (size_t)BQ * D * sizeof(float);             // one tile's dQ part
    // K, V; the Q and dO rings; dS^T; the dQ staging; the lse and D rings; the mbarriers; alignment slack
    static constexpr size_t SMEM = 2 * KV_BYTES + ST * 2 * QT_BYTES + DS_BYTES + SLOTS * STAGE_BYTES + ST * 2 * BQ * sizeof(float) +
                                   8 * (1 + 2 * ST + 3 * SLOTS) + 1024;
};

// p, addressed afresh in loop iteration it when FRESH ((it >> 30) is 0, but not provably so): the wgmma descriptors
// made from it are then recomputed in the loop instead of held in registers across it (the fused d 128 dK/dV kernel
// spilled 108-124 bytes with K's and V's held).
template <bool FRESH, typename T> __device__ __forceinline__ const T *tsys_cuda__flash_fresh(const T *p, int it) {
    return FRESH ? p + ((it >> 30) << 10) : p;
}

// The fused backward's consumers: dS^T (packed as the dK wgmma's A registers, rows r0 and r0 + 8 of the block's
// keys) into a BQ = 64 column 128B-swizzled tile, the layout the dQ wgmma reads MN-major.
template <int BQ>
__device__ __forceinline__ void tsys_cuda__flash_ws_put_ds(void *tile, const uint32_t (*dsa)[4], int r0, int lane) {
    static_assert(BQ == 64, "one 128-byte row of dS^T a key");
    unsigned char *t = (unsigned char *)tile;
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++)
#pragma unroll
        for (int q = 0; q < 4; q++) {   // dsa[kk][q]: row + 8 (q & 1), columns 16 kk + 8 (q >> 1) + 2 (lane & 3)
            const int r = r0 + (q & 1) * 8, chunk = 2 * kk + (q >> 1);
            *(uint32_t *)(t + r * 128 + ((chunk ^ (r & 7)) << 4) + 4 * (lane & 3)) = dsa[kk][q];
        }
}
// ... and tile j's dQ: the two consumers' parts (64 x N each, in registers) meet in staging buffer j % 2, in
// [column block of 8][thread][4] order (a warp's stores contiguous). Consumer j % 2 finishes the tile: it waits
// for the other's part, adds its own over it (fp32 addition commutes: the same bits whichever finishes) and hands
// the sum to the adder warp; the finisher alternates so that neither consumer always waits.
template <int N>
__device__ __forceinline__ void tsys_cuda__flash_ws_stage_dq(float *stage, uint64_t *ready, uint64_t *sfull, uint64_t *sempty,
                                                  const float (*dqa)[4], int j, int wg) {
    const int slot = j & 1, use = j >> 1, t = threadIdx.x & 127;
    float4 *buf = reinterpret_cast<float4 *>(stage + (size_t)slot * 64 * N);
    if (wg != slot) {
        if (use > 0) tsys_cuda__flash_mbar_wait(sempty + slot, (use - 1) & 1);
#pragma unroll
        for (int nb = 0; nb < N / 8; nb++) buf[nb * 128 + t] = make_float4(dqa[nb][0], dqa[nb][1], dqa[nb][2], dqa[nb][3]);
        tsys_cuda__flash_mbar_arrive(ready + slot);
        return;
    }
    tsys_cuda__flash_mbar_wait(ready + slot, use & 1);
#pragma unroll
    for (int nb = 0; nb < N / 8; nb++) {
        const float4 u = buf[nb * 128 + t];
        buf[nb * 128 + t] = make_float4(dqa[nb][0] + u.x, dqa[nb][1] + u.y, dqa[nb][2] + u.z, dqa[nb][3] + u.w);
    }
    tsys_cuda__flash_fence_proxy_async();   // the bulk copy reads the buffer through the async proxy
    tsys_cuda__flash_mbar_arrive(sfull + slot);
}

// ... DQCOL: consumer wg's N columns of tile j's dQ (all of the block's keys) into its half of staging buffer
// j % 2; the adder takes the buffer once both halves are in (`sfull` counts both consumers' threads). The halves
// lie [consumer][column block of 8][thread][4]: the layout of one D-column part, so tsys_cuda__flash_dq_finish
// reads either.
template <int N, int CW>
__device__ __forceinline__ void tsys_cuda__flash_ws_stage_dq_col(float *stage, uint64_t *sfull, uint64_t *sempty, const float (*dqa)[4],
                                                      int j, int wg) {
    const int slot = j & 1, use = j >> 1, t = threadIdx.x & 127;
    float4 *buf = reinterpret_cast<float4 *>(stage + ((size_t)slot * CW + wg) * 64 * N);
    if (use > 0) tsys_cuda__flash_mbar_wait(sempty + slot, (use - 1) & 1);
#pragma unroll
    for (int nb = 0; nb < N / 8; nb++) buf[nb * 128 + t] = make_float4(dqa[nb][0], dqa[nb][1], dqa[nb][2], dqa[nb][3]);
    tsys_cuda__flash_fence_proxy_async();   // the bulk copy reads the buffer through the async proxy
    tsys_cuda__flash_mbar_arrive(sfull + slot);
}

// The fused backward's dQ: each key block adds its fp32 part of every query tile into a global accumulator
// with the bulk-copy engine, in a fixed order per tile (deterministic): a counter per (slice, query tile)
// says how many key blocks have added; key block kb adds when the counter reaches kb (every block below it
// reaches the tile too, causal or not), so the lowest block, the longest and the first launched, adds first
// and writes instead of adding (the accumulator needs no clearing). Every block walks its query tiles from
// the last down, so a block meets each tile after the blocks below it, which started no later. A turn that
// never comes (a broken order) traps after 10 s instead of hanging. Without counters (dqsem NULL: the opt-in
// non-deterministic backward) every block adds as soon as its part is staged, into a cleared accumulator:
// the sum's order, so its last bits, then vary from run to run.
__device__ __forceinline__ void tsys_cuda__flash_turn_wait(const int *sem, int turn) {
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
    for (int v;;) {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
        if (v == turn) break;
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
        if (t - t0 > 10000000000ull) __trap();
    }
    asm volatile("fence.proxy.async.global;\n" ::: "memory");   // the bulk adds below come after the acquire
}
__device__ __forceinline__ void tsys_cuda__flash_turn_pass(int *sem) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");   // the finished bulk adds come before the release
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}
__device__ __forceinline__ void tsys_cuda__flash_bulk_out(float *dst, const float *src, uint32_t bytes, bool add) {
    if (add)
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                     "r"(tsys_cuda__flash_smem_addr(src)), "r"(bytes) : "memory");
    else
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(tsys_cuda__flash_smem_addr(src)),
                     "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void tsys_cuda__flash_bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void tsys_cuda__flash_bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// The query tiles [it0, nqt) of key block kb, from the last down (the j-th is tile nqt - 1 - j, staged in buffer
// j % SLOTS): add each into the tile's accumulator ([tiles][BQ x D]) in turn, and pass the tile's counter on as
// soon as the add is complete (the next block's turn on this tile waits for nothing else).
template <int BQ, int D, int SLOTS>
__device__ __forceinline__ void tsys_cuda__flash_dq_adder(float *dqacc, int *dqsem, const float *stage, uint64_t *sfull, uint64_t *sempty,
                                               int b, int kb, int it0, int nqt_all, int nqt) {
    constexpr int PART = BQ * D;
    for (int j = 0; j < nqt - it0; j++) {
        const int it = nqt - 1 - j, slot = j % SLOTS;
        tsys_cuda__flash_mbar_wait(sfull + slot, (j / SLOTS) & 1);
        int *sem = dqsem ? dqsem + (size_t)b * nqt_all + it : nullptr;
        if (sem) tsys_cuda__flash_turn_wait(sem, kb);
        tsys_cuda__flash_bulk_out(dqacc + ((size_t)b * nqt_all + it) * PART, stage + (size_t)slot * PART, PART * sizeof(float), !sem || kb > 0);
        tsys_cuda__flash_bulk_wait_read();
        tsys_cuda__flash_mbar_arrive(sempty + slot);
        if (sem) {
            tsys_cuda__flash_bulk_wait<0>();
            tsys_cuda__flash_turn_pass(sem);
        }
    }
    tsys_cuda__flash_bulk_wait<0>();
}

// FUSED: the 5-matmul backward. The kernel also makes dQ: each consumer puts its 64 rows of dS^T (bf16) into
// shared memory and computes the tile's dQ over its own keys, dS_w K_w (dS read MN-major from the dS^T rows, K
// MN-major), or, past d 64 (DQCOL), its D / 2 columns of dQ over all the block's keys once both consumers' rows
// are in (a barrier between them); the parts meet in a staging buffer (tsys_cuda__flash_ws_stage_dq, _stage_dq_col),
// and the producer warpgroup's warp 2 adds their sum into the tile's accumulator in turn (tsys_cuda__flash_dq_adder),
// in the consumers' register order ([column block of 8][thread][4]); tsys_cuda__flash_dq_finish rounds it into dq.
// Key blocks run in grid order, slice by slice, the longest (key block 0) first, and walk their query tiles from
// the last down: a block waits only for the blocks below it, launched before it, which meet each tile before it
// does. nsplit must be 1.
// AREG: each consumer keeps its 64 rows of K and V in registers (16-bit, d 64) and issues S^T and dP^T as RS wgmmas.
template <typename T, int D, int BQ, int CW, bool CAUSAL, bool FUSED = false, bool AREG = false>
__global__ void __launch_bounds__((CW + 1) * 128, 1)
tsys_cuda__flash_bwd_dkdv_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                               const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tg,
                               const float *__restrict__ lse, const float *__restrict__ dvec, T *__restrict__ dk,
                               T *__restrict__ dv, int n, int b0, float scale, float scale_log2, int nsplit,
                               float *__restrict__ part, float *__restrict__ dqacc, int *__restrict__ dqsem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef tsys_cuda__flash_ws_kv_layout<T, D, BQ, CW, FUSED> L;
    constexpr int BKV = L::BKV, ST = L::ST, SLOTS = L::SLOTS;
    static_assert(!FUSED || (BQ == 64 && CW == 2), "the fused dQ: dS^T as one 64-column swizzled tile, two consumers");
    static_assert(!L::DQCOL || L::DQN == 64, "the fused dQ by columns: one 64-column block of K a consumer");
    static_assert(!AREG || (sizeof(T) == 2 && D == 64 && !FUSED), "K and V in registers: 16-bit, d 64, the 4-matmul kernel");
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    T *ks = (T *)tsys_cuda__flash_wg_smem_base(tsys_cuda__flash_smem_raw);
    T *vs = ks + BKV * D;
    T *qs = vs + BKV * D;         // [ST][BQ * D]
    T *gs = qs + ST * BQ * D;     // [ST][BQ * D]
    T *dst_s = gs + ST * BQ * D;  // [BKV * BQ] (DS_SMEM)
    float *stage = (float *)((unsigned char *)dst_s + L::DS_BYTES);   // [SLOTS][BQ * D] (FUSED)
    float *ls = (float *)((unsigned char *)stage + SLOTS * L::STAGE_BYTES), *ds = ls + ST * BQ;   // [ST][BQ] each
    uint64_t *kvfull = (uint64_t *)(ds + ST * BQ), *full = kvfull + 1, *empty = full + ST;
    uint64_t *ready = empty + ST, *sfull = ready + SLOTS, *sempty = sfull + SLOTS;   // [SLOTS] each (FUSED)

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    // causal: key block 0 is the longest (tsys_cuda__flash_block_of); FUSED: in grid order, slice by slice (each key
    // block of every slice in turn measured 1.8x slower causal: the slices' dQ accumulators and inputs no longer
    // share the L2), and the query tiles from the last down (tile_at)
    const tsys_cuda__flash_block o = FUSED ? tsys_cuda__flash_block{ (int)blockIdx.x, (int)blockIdx.y } : tsys_cuda__flash_block_of();
    const int bhi = o.ys / nsplit, split = o.ys % nsplit;
    const int kb = o.tile;
    const int k0 = kb * BKV, b = b0 + bhi;
    int it0, nqt;   // this block's query tiles [it0, nqt), the j-th of them visited tile_at(j)
    tsys_cuda__flash_share(CAUSAL ? k0 / BQ : 0, (n + BQ - 1) / BQ, nsplit, split, &it0, &nqt);
    const auto tile_at = [&](int j) { return FUSED ? nqt - 1 - j : it0 + j; };
    // query tiles in [free_lo, free_hi) need no mask: all rows < n and, when causal, >= the block's last key
    const int free_lo = CAUSAL ? (k0 + BKV - 1 + BQ - 1) / BQ : 0, free_hi = n / BQ;
    lse += (size_t)b * n; dvec += (size_t)b * n;

    tsys_cuda__flash_ws_init(kvfull, full, empty, CW * 4, 1 + 32, ST);
    if constexpr (FUSED) {
        if (threadIdx.x == 0) {
            for (int i = 0; i < SLOTS; i++)
                tsys_cuda__flash_mbar_init(ready + i, 128), tsys_cuda__flash_mbar_init(sfull + i, L::DQCOL ? CW * 128 : 128),
                    tsys_cuda__flash_mbar_init(sempty + i, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
    }

    if (wg == CW) {   // producer warpgroup: thread 0 issues the TMA copies, warp 1 the lse / D rows, warp 2 adds dQ
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (warp == CW * 4 && lane == 0) {
            tsys_cuda__flash_mbar_expect_tx(kvfull, (uint32_t)(2 * L::KV_BYTES));
            for (int cb = 0; cb < D / 64; cb++) {
                tsys_cuda__flash_tma_load(ks + cb * BKV * 64, &tk, kvfull, cb * 64, k0, b);
                tsys_cuda__flash_tma_load(vs + cb * BKV * 64, &tv, kvfull, cb * 64, k0, b);
            }
            for (int j = 0; j < nqt - it0; j++) {
                const int it = tile_at(j), s = j % ST;
                if (j >= ST) tsys_cuda__flash_mbar_wait(empty + s, (j / ST - 1) & 1);
                tsys_cuda__flash_mbar_expect_tx(full + s, (uint32_t)(2 * L::QT_BYTES));
                for (int cb = 0; cb < D / 64; cb++) {
                    tsys_cuda__flash_tma_load(qs + s * BQ * D + cb * BQ * 64, &tq, full + s, cb * 64, it * BQ, b);
                    tsys_cuda__flash_tma_load(gs + s * BQ * D + cb * BQ * 64, &tg, full + s, cb * 64, it * BQ, b);
                }
            }
        } else if (warp == CW * 4 + 1) {   // the rows' -lse log2(e) and D (stores, then an arrival: release)
            for (int j = 0; j < nqt - it0; j++) {
                const int it = tile_at(j), s = j % ST;
                if (j >= ST) tsys_cuda__flash_mbar_wait(empty + s, (j / ST - 1) & 1);
                for (int i = lane; i < BQ; i += 32) {
                    const int row = it * BQ + i;
                    ls[s * BQ + i] = row < n ? -lse[row] * TSYS_CUDA__FLASH_LOG2E : 0.0f;
                    ds[s * BQ + i] = row < n ? dvec[row] : 0.0f;
                }
                tsys_cuda__flash_mbar_arrive(full + s);
            }
        } else if constexpr (FUSED) {
            if (warp == CW * 4 + 2 && lane == 0)
                tsys_cuda__flash_dq_adder<BQ, D, SLOTS>(dqacc, dqsem, stage, sfull, sempty, b, kb, it0, (n + BQ - 1) / BQ, nqt);
        }
        // Launched as a programmatic dependent of the dQ kernel (which it does not read), it must still not
        // complete before that kernel does, so that what follows in the stream sees dQ.
        tsys_cuda__flash_grid_wait();
        return;
    }
    tsys_cuda__flash_ws_consumer_regs<CW>();
    const int wk0 = warp * 16;
    float dka[D / 8][4], dva[D / 8][4];
    tsys_cuda__flash_zero<1, D>(&dka);
    tsys_cuda__flash_zero<1, D>(&dva);
    uint32_t pa[BQ / 16][4], dsa[BQ / 16][4];   // P^T and dS^T: their wgmmas may still read them in the next tile
    float dqa[FUSED ? L::DQN / 8 : 1][4];       // FUSED: this consumer's part of the tile's dQ
    uint32_t kr[AREG ? D / 16 : 1][4], vr[AREG ? D / 16 : 1][4];   // AREG: this consumer's K and V rows
    tsys_cuda__flash_mbar_wait(kvfull, 0);
    if constexpr (AREG) {
        tsys_cuda__flash_wg_load_a<BKV, D>(kr, ks, wg * 64);
        tsys_cuda__flash_wg_load_a<BKV, D>(vr, vs, wg * 64);
    }

    tsys_cuda__flash_wg_tiles<FUSED>(it0, nqt, free_lo, free_hi, [&](int it, auto masked) {
        constexpr bool MASK = decltype(masked)::value;
        const int j = FUSED ? nqt - 1 - it : it - it0, s = j % ST, q0 = it * BQ;
        tsys_cuda__flash_mbar_wait(full + s, (j / ST) & 1);
        const T *qt = qs + s * BQ * D, *gt = gs + s * BQ * D;
        const float *lt = ls + s * BQ, *dt = ds + s * BQ;
        float st[BQ / 8][4], dpt[BQ / 8][4];
        if constexpr (AREG) tsys_cuda__flash_wg_kv_scores_r<T, D, BQ>(st, dpt, kr, vr, qt, gt);
        else tsys_cuda__flash_wg_kv_scores<T, D, BQ, BKV>(st, dpt, tsys_cuda__flash_fresh<L::DS_SMEM>(ks, it), tsys_cuda__flash_fresh<L::DS_SMEM>(vs, it),
                                                          wg, qt, gt);
        tsys_cuda__flash_wg_wait<1>();   // the previous tile's dV and dK, and S^T
        tsys_cuda__flash_wg_fence_acc<BQ>(st);
        if (j > 0 && lane == 0) tsys_cuda__flash_mbar_arrive(empty + (j - 1) % ST);   // this warp is done with tile j - 1
        tsys_cuda__flash_wg_kv_p<BQ, MASK, CAUSAL, true>(st, lt, k0 + wk0, q0, n, lane, scale_log2);
        tsys_cuda__flash_wg_pack<T, BQ>(pa, st);
        tsys_cuda__flash_wg_fence();
        tsys_cuda__flash_wg_rs<T, D, BQ>(dva, pa, gt);                  // dV += P^T dO
        tsys_cuda__flash_wg_commit();
        tsys_cuda__flash_wg_wait<1>();   // dP^T (dV stays in flight)
        tsys_cuda__flash_wg_fence_acc<BQ>(dpt);
        tsys_cuda__flash_wg_kv_ds<BQ>(dpt, st, dt, lane);
        tsys_cuda__flash_wg_pack<T, BQ>(dsa, dpt);
        if constexpr (FUSED) {
            // this consumer's 64 rows of dS^T. DQCOL: into buffer j % 2, whose last readers, both consumers' dQ wgmmas
            // of tile j - 2, were waited for before either met the barrier below in tile j - 1; otherwise its last
            // reader is this consumer's previous dQ wgmma, done
            T *dsb = dst_s + (L::DQCOL ? (j & 1) * BKV * BQ : 0);
            tsys_cuda__flash_ws_put_ds<BQ>(dsb, dsa, wk0 + (lane >> 2), lane);
            tsys_cuda__flash_fence_proxy_async();
            if constexpr (L::DQCOL) tsys_cuda__flash_named_sync(1 + CW, CW * 128);   // every consumer's rows are in
            else tsys_cuda__flash_named_sync(1 + wg, 128);
            tsys_cuda__flash_wg_fence();
            if constexpr (L::DQCOL)   // dQ columns of wg = dS K[:, wg]
                tsys_cuda__flash_wg_ss_mn<T, L::DQN, BKV, BKV>(dqa, dsb, tsys_cuda__flash_fresh<true>(ks, it) + wg * BKV * 64);
            else   // dQ part = dS_w K_w
                tsys_cuda__flash_wg_ss_mn<T, D, 64, BKV>(dqa, dsb + wg * 64 * BQ, ks + wg * 64 * 64);
            tsys_cuda__flash_wg_commit();
            tsys_cuda__flash_wg_ss_kmn<T, D, BKV, BQ>(dka, dsb, wg * 64, qt);   // dK += dS^T Q, waited for in the next tile
            tsys_cuda__flash_wg_commit();
            tsys_cuda__flash_wg_wait<1>();   // dQ
            tsys_cuda__flash_wg_fence_acc<L::DQN>(dqa);
            if constexpr (L::DQCOL) tsys_cuda__flash_ws_stage_dq_col<L::DQN, CW>(stage, sfull, sempty, dqa, j, wg);
            else tsys_cuda__flash_ws_stage_dq<D>(stage, ready, sfull, sempty, dqa, j, wg);
        } else if constexpr (L::DS_SMEM) {
            // this consumer's rows of dS^T; their last reader, the previous tile's dK wgmma, was waited for above
            tsys_cuda__flash_ws_put_ds<BQ>(dst_s, dsa, wk0 + (lane >> 2), lane);
            tsys_cuda__flash_fence_proxy_async();
            tsys_cuda__flash_named_sync(1 + wg, 128);
            tsys_cuda__flash_wg_fence();
            tsys_cuda__flash_wg_ss_kmn<T, D, BKV, BQ>(dka, dst_s, wg * 64, qt);   // dK += dS^T Q, waited for in the next tile
            tsys_cuda__flash_wg_commit();
        } else {
            tsys_cuda__flash_wg_fence();
            tsys_cuda__flash_wg_rs<T, D, BQ>(dka, dsa, qt);             // dK += dS^T Q, waited for in the next tile
            tsys_cuda__flash_wg_commit();
        }
    });
    tsys_cuda__flash_wg_wait<0>();
    tsys_cuda__flash_wg_fence_acc<D>(dka);
    tsys_cuda__flash_wg_fence_acc<D>(dva);
    const size_t base = (size_t)b * n * D;
    if (part) {   // split: this share's sums, unscaled ([share][bh][n][D], dK then dV; one slice: gridDim.y / nsplit = bh)
        const size_t plane = (size_t)(gridDim.y / nsplit) * n * D, at = (size_t)split * plane + base;
        tsys_cuda__flash_store<float, 1, D>(part + at, &dka, k0 + wk0, n, 1.0f, lane);
        tsys_cuda__flash_store<float, 1, D>(part + (size_t)nsplit * plane + at, &dva, k0 + wk0, n, 1.0f, lane);
        return;
    }
    tsys_cuda__flash_store<T, 1, D>(dk + base, &dka, k0 + wk0, n, scale, lane);
    tsys_cuda__flash_store<T, 1, D>(dv + base, &dva, k0 + wk0, n, 1.0f, lane);
#endif
}

// dq = scale x the fused backward's dQ accumulator (see the kernel), rows < n.
template <typename T, int D, int BQ>
__global__ void tsys_cuda__flash_dq_finish(T *__restrict__ dq, const float *__restrict__ acc, int64_t tiles, int nqt, int n, float scale) {
    constexpr int PART = BQ * D / 4;   // float4s
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < tiles * PART; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t tile = i / PART;
        const int r = (int)(i % PART), nb = r / 128, t = r % 128;
        const int row = (int)(tile % nqt) * BQ + (t >> 5) * 16 + ((t & 31) >> 2), col = nb * 8 + (t & 3) * 2;
        const float4 v = reinterpret_cast<const float4 *>(acc)[i];
        T *o = dq + (size_t)(tile / nqt) * n * D + (size_t)row * D + col;
        if (row < n) *(uint32_t *)o = tsys_cuda__flash_t<T>::pack(v.x * scale, v.y * scale);
        if (row + 8 < n) *(uint32_t *)(o + 8 * D) = tsys_cuda__flash_t<T>::pack(v.z * scale, v.w * scale);
    }
}

// cuTensorMapEncodeTiled from the driver, fetched through the runtime (no link against libcuda). It is one
// function of the process's driver, so it is looked up once per process (a C++ static: thread-safe); NULL when
// the driver does not offer it.
typedef CUresult (*tsys_cuda__flash_tmap_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                         const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                         CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
static tsys_cuda__flash_tmap_encode_fn tsys_cuda__flash_tmap_encoder() {
    static const tsys_cuda__flash_tmap_encode_fn fn = []() -> tsys_cuda__flash_tmap_encode_fn {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q;
        const bool ok = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
                        q == cudaDriverEntryPointSuccess;
        cudaGetLastError();
        return ok ? (tsys_cuda__flash_tmap_encode_fn)p : NULL;
    }();
    return fn;
}
// A (bh, n, D) tensor of 16-bit or fp32 elements as a 3-D tensor map read in boxes of 128 bytes (64 or 32
// columns) x `rows` rows, 128B-swizzled; rows past n read as zeros. False when the driver offers no encoder
// or refuses the tensor.
template <typename T>
static bool tsys_cuda__flash_tmap_rows(CUtensorMap *m, const T *g, int64_t bh, int n, int D, int rows) {
    tsys_cuda__flash_tmap_encode_fn enc = tsys_cuda__flash_tmap_encoder();
    if (!enc || ((uintptr_t)g & 15)) return false;
    const cuuint64_t dims[3] = { (cuuint64_t)D, (cuuint64_t)n, (cuuint64_t)bh };
    const cuuint64_t strides[2] = { (cuuint64_t)D * sizeof(T), (cuuint64_t)n * D * sizeof(T) };
    const cuuint32_t box[3] = { 128 / (cuuint32_t)sizeof(T), (cuuint32_t)rows, 1 }, unit[3] = { 1, 1, 1 };
    const CUtensorMapDataType dt = std::is_same<T, __nv_bfloat16>::value ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : std::is_same<T, float>::value       ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                                                         : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return enc(m, dt, 3, (void *)g, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The backward's four maps: Q and dO read in boxes of qrows rows, K and V in boxes of krows.
template <typename T>
static bool tsys_cuda__flash_tmap_bwd(CUtensorMap *tq, CUtensorMap *tg, CUtensorMap *tk, CUtensorMap *tv, const T *q, const T *dout,
                                      const T *k, const T *v, int64_t bh, int n, int D, int qrows, int krows) {
    return tsys_cuda__flash_tmap_rows(tq, q, bh, n, D, qrows) && tsys_cuda__flash_tmap_rows(tg, dout, bh, n, D, qrows) &&
           tsys_cuda__flash_tmap_rows(tk, k, bh, n, D, krows) && tsys_cuda__flash_tmap_rows(tv, v, bh, n, D, krows);
}

// >>flash launchers -------------------------------------------------------------------------------
// Launchers. Grids put the tile index in x and bh in y; bh above 65535 is launched in slices.

// Whether the wgmma kernels were compiled into the binary the current device runs: the probe has static
// shared memory only in its sm_90a body (an sm_90a image runs on Hopper only; elsewhere the compute_90 PTX
// or nothing loads). The backend asks once, at init, for its device.
__global__ void tsys_cuda__flash_wg_probe_kernel(int *p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ volatile int marker[64];
    marker[threadIdx.x & 63] = (int)threadIdx.x;
    if (p) *p = marker[0];
#endif
}
static bool tsys_cuda__flash_wg_probe() {
    cudaFuncAttributes a;
    const bool ok = cudaFuncGetAttributes(&a, tsys_cuda__flash_wg_probe_kernel) == cudaSuccess && a.sharedSizeBytes >= 256;
    cudaGetLastError();
    return ok;
}

// Hopper tile configurations (template parameters of the wg kernels): warpgroups per block, the streamed
// tile, and the min-blocks-per-SM launch bound (which caps registers).
// Picked per part from the variants timed on an H100 (docs/design/flash.md).
template <int D, bool CAUSAL> struct tsys_cuda__flash_wg_cfg {
    static constexpr int FWD_BK = D <= 64 ? 128 : 64, FWD_WG = 3, FWD_MINB = 1;
    static constexpr int DKDV_BQ = D <= 64 ? 128 : 64, DKDV_WG = 2, DKDV_MINB = 1;
    static constexpr int DQ_BK = D <= 64 ? 128 : 64, DQ_WG = 2, DQ_MINB = 1;   // when the ws dQ does not run
};

// Tile configurations, picked from the variants timed on an H100 (docs/design/flash.md).
// Registers bound the choices: a warp holds MT*16 x D accumulators (O, dK+dV, dQ) plus MT*16 x B score
// tiles (S, and dP in the backward); past ~255 registers the compiler spills.
//   FWD:  MT m-tiles (16 query rows each) per warp, BK keys per tile, NW warps
//   DKDV: MK m-tiles (16 keys each) per warp, BQ queries per tile, NW warps
//   DQ:   MQ m-tiles (16 query rows each) per warp, BK keys per tile, NW warps
// (The non-causal dK/dV kernel keeps MK = 1: with MK = 2 its mask-free loop spills at d = 64.)
template <int D, bool CAUSAL> struct tsys_cuda__flash_cfg {
    static constexpr int FWD_MT = 2, FWD_BK = D <= 64 ? 64 : 32, FWD_NW = 4;
    static constexpr int DKDV_MK = D <= 64 && CAUSAL ? 2 : 1, DKDV_BQ = 64, DKDV_NW = D <= 64 && CAUSAL ? 4 : 8;
    static constexpr int DQ_MQ = 1, DQ_BK = D <= 64 ? 128 : 64, DQ_NW = D <= 64 ? 8 : 4;
};
// By element type. fp32 (TF32): 64-row tiles and 4 warps in all three kernels, the fastest of five variants
// timed at batch 1 (docs/design/flash.md): at batch 1 the grid is small, and
// 64-row tiles give 2 to 3 blocks an SM (fp32 tiles take twice the shared memory: 203 KB at most, d = 128).
template <typename T, int D, bool CAUSAL> struct tsys_cuda__flash_cfg_of : tsys_cuda__flash_cfg<D, CAUSAL> {};
template <int D, bool CAUSAL> struct tsys_cuda__flash_cfg_of<float, D, CAUSAL> {
    static constexpr int FWD_MT = 1, FWD_BK = 64, FWD_NW = 4;
    static constexpr int DKDV_MK = 1, DKDV_BQ = 64, DKDV_NW = 4;
    static constexpr int DQ_MQ = 1, DQ_BK = 64, DQ_NW = 4;
};

template <typename K>
static cudaError_t tsys_cuda__flash_smem_attr(K kernel, size_t smem) {
    if (smem <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
}

// What the backward's flags turn off (tsys_cuda_desc.flash_no_pdl, flash_no_fused, flash_nondeterministic; 0: none):
// the dK/dV kernel launched in the dQ kernel's tail, the fused backward (the same bits either way; flash_lab times
// both), and the fused backward's fixed order of dQ adds (dQ's last bits then vary run to run).
enum { TSYS_CUDA__FLASH_NO_PDL = 1, TSYS_CUDA__FLASH_NO_FUSED = 2, TSYS_CUDA__FLASH_NONDET = 4 };
// Launches kernel on s; pdl: as a programmatic dependent of the kernel before it (see tsys_cuda__flash_grid_wait).
template <typename... P, typename... A>
static cudaError_t tsys_cuda__flash_launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool pdl, A... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid; cfg.blockDim = block; cfg.dynamicSmemBytes = smem; cfg.stream = s;
    cfg.attrs = attr; cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// out = mul * (sum over nsplit of part's planes, in plane order), rounded to T: the split backward's reduction.
template <typename T>
__global__ void tsys_cuda__flash_split_sum(T *__restrict__ out, const float *__restrict__ part, int nsplit, int64_t count, float mul) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < nsplit; s++) acc += part[(size_t)s * count + i];
        out[i] = tsys_cuda__fromf<T>(acc * mul);
    }
}

// The mma.sync backward splits its work where the grid would leave SMs idle (batch 1, short sequences): the
// dK/dV kernel cuts each key tile's query tiles, the dQ kernel each query tile's key tiles, into nsplit
// shares, a block each; the shares' fp32 sums are added in share order afterwards (deterministic). nsplit
// gives at least 2 blocks an SM, at most 8 shares, each of at least 256 keys (queries) of the sequence, so
// that the extra pass and launches stay small against the work (a short sequence in a large batch, as in
// training at context 256, does not split). The extra fp32 scratch (floats after the row sums D, 16-byte
// aligned) is what tsys_cuda__flash_bwd_scratch_bytes counts.
static int tsys_cuda__flash_sm_count() {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;   // unknown: no split
    }
    return sms;
}
static int tsys_cuda__flash_splits(int64_t blocks, int64_t n, int sms) {
    if (sms <= 0 || blocks >= 2 * (int64_t)sms || blocks * 8 > 65535) return 1;
    int64_t s = (2 * (int64_t)sms + blocks - 1) / blocks;
    s = s < 8 ? s : 8;
    s = s < n / 256 ? s : n / 256;
    return s > 1 ? (int)s : 1;
}
struct tsys_cuda__flash_split_plan {
    int kv, q;                  // shares of the dK/dV and the dQ kernel (1: no split)
    size_t d_floats, floats;    // floats of the row sums D (rounded up to 16 bytes), of everything
    bool fused;                 // the warp-specialized backward runs the fused kernel (tsys_cuda__flash_ws_split)
};
// The plan of a backward whose dK/dV kernel takes BKV keys a block and whose dQ kernel BQ rows a block.
static size_t tsys_cuda__flash_round4(size_t floats) { return (floats + 3) / 4 * 4; }   // 16-byte aligned parts
static tsys_cuda__flash_split_plan tsys_cuda__flash_split_of(int64_t bh, int64_t n, int64_t D, int BKV, int BQ) {
    const int sms = tsys_cuda__flash_sm_count();
    tsys_cuda__flash_split_plan p;
    p.kv = tsys_cuda__flash_splits(bh * ((n + BKV - 1) / BKV), n, sms);
    p.q = tsys_cuda__flash_splits(bh * ((n + BQ - 1) / BQ), n, sms);
    p.d_floats = tsys_cuda__flash_round4((size_t)(bh * n));
    p.floats = p.d_floats + (size_t)(bh * n * D) * ((p.kv > 1 ? 2 * p.kv : 0) + (p.q > 1 ? p.q : 0));
    p.fused = false;
    return p;
}
template <typename T, int D, bool CAUSAL>
static tsys_cuda__flash_split_plan tsys_cuda__flash_tc_split(int64_t bh, int64_t n) {
    typedef tsys_cuda__flash_cfg_of<T, D, CAUSAL> C;
    return tsys_cuda__flash_split_of(bh, n, D, C::DKDV_NW * C::DKDV_MK * 16, C::DQ_NW * C::DQ_MQ * 16);
}

template <typename T, int D> struct tsys_cuda__flash_ws_tiles {   // the warp-specialized kernels' tiles
    // forward: keys a tile and rows a block (fp32: 64-key tiles at d 64, and 2 x 64 rows with 32-key tiles at
    // d 128, so that Q and the ring fit shared memory; 16-bit: 128-key tiles, three consumers at d 64 and two at
    // d 128, where they measured 1.68 against 1.92 ms for three on 64-key tiles, 16 x 16384, H100)
    static constexpr bool F128 = sizeof(T) == 4 && D > 64;
    static constexpr int FWD_BK = F128 ? 32 : sizeof(T) == 4 ? 64 : 128, FWD_BQ = (F128 || (sizeof(T) == 2 && D > 64) ? 2 : 3) * 64;
    // forward, 16-bit d 64: the softmax of a tile beside the previous tile's P V, the three consumers issuing their
    // matmuls in turn (1.07x at 16 x 16384; either alone, or both on two consumers or at d 128, measured no faster)
    static constexpr bool FWD_TURNS = sizeof(T) == 2 && D == 64;
    // dQ: keys a tile, consumers, rows a block (d 64: three consumers on 64-key tiles, 1.05x two on 128-key tiles
    // once the blocks run longest-first across slices; the other way round before)
    static constexpr int DQ_BK = 64, DQ_CW = D <= 64 ? 3 : 2, DQ_BQ = DQ_CW * 64;
    // dQ, 16-bit d 128 (two consumers): S and dP issued by the consumers in turn (2.02 against 2.26 ms at 16 x 16384;
    // level at d 64, and slower in the dK/dV and fused kernels)
    static constexpr bool DQ_TURNS = sizeof(T) == 2 && D == 128;
    static constexpr int KV_BQ = 64, KV_CW = 2, KV_BKV = KV_CW * 64;                // dK/dV: queries a tile, consumers, keys a block
    // dK/dV: K and V in registers (measured 1.05-1.15x at d 64; d 128 has no registers to spare)
    static constexpr bool KV_AREG = sizeof(T) == 2 && D == 64;
};
// The warp-specialized forward's shares, and the floats of scratch they need (0 when it does not split).
template <typename T, int D>
static int tsys_cuda__flash_ws_fwd_shares(int64_t bh, int64_t n) {
    return tsys_cuda__flash_splits(bh * ((n + tsys_cuda__flash_ws_tiles<T, D>::FWD_BQ - 1) / tsys_cuda__flash_ws_tiles<T, D>::FWD_BQ), n,
                                   tsys_cuda__flash_sm_count());
}
template <typename T, int D>
static size_t tsys_cuda__flash_ws_fwd_split_floats(int64_t bh, int64_t n) {
    const int sh = tsys_cuda__flash_ws_fwd_shares<T, D>(bh, n);
    return sh > 1 ? (size_t)sh * (size_t)(bh * n) * (D + 1) : 0;
}
// The forward's scratch, in floats: the shares, then for fp32 (TF32) the rounded K at kr and the V^T of
// npad keys (n padded to the key tile) at vt.
template <typename T, int D> struct tsys_cuda__flash_ws_fwd_scratch {
    size_t kr, vt, floats;
    int npad;
    tsys_cuda__flash_ws_fwd_scratch(int64_t bh, int64_t n) {
        constexpr int BK = tsys_cuda__flash_ws_tiles<T, D>::FWD_BK;
        const size_t split = tsys_cuda__flash_ws_fwd_split_floats<T, D>(bh, n);
        npad = (int)((n + BK - 1) / BK * BK);
        kr = tsys_cuda__flash_round4(split);
        vt = kr + tsys_cuda__flash_round4((size_t)(bh * n) * D);
        floats = sizeof(T) == 4 ? vt + (size_t)bh * D * npad : split;
    }
};
template <typename T, int D>
static size_t tsys_cuda__flash_ws_fwd_floats(int64_t bh, int64_t n) { return tsys_cuda__flash_ws_fwd_scratch<T, D>(bh, n).floats; }
// The fused (5-matmul) backward's fp32 dQ accumulator: BQ x D floats a query tile, then one int a tile (the
// turn counters).
template <typename T, int D> static size_t tsys_cuda__flash_fused_floats(int64_t bh, int64_t n) {
    constexpr int BQ = tsys_cuda__flash_ws_tiles<T, D>::KV_BQ;
    const size_t tiles = (size_t)(bh * ((n + BQ - 1) / BQ));
    return tiles * BQ * D + tiles;
}
// The warp-specialized backward splits by the same rule (its dQ and dK/dV kernels' tiles). 16-bit d 128 runs the
// fused kernel instead on long sequences (from 16384 rows) whose grid fills the GPU with key blocks (one an SM at
// least; it never splits). H200, forward + backward against the two kernels (flash_lab lbfused): 1.11x at 16 x 16384,
// 1.14x at 8 x 32768, 1.13x at 32 x 16384 and non-causal, 1.16x at 32 x 32768, 1.05x at 1 x 32768 and 1.13x at
// 1 x 65536; at 1 x 16384 (128 key blocks) 0.82x. Its accumulator follows the row sums.
template <typename T, int D>
static tsys_cuda__flash_split_plan tsys_cuda__flash_ws_split(int64_t bh, int64_t n) {
    tsys_cuda__flash_split_plan p =
        tsys_cuda__flash_split_of(bh, n, D, tsys_cuda__flash_ws_tiles<T, D>::KV_BKV, tsys_cuda__flash_ws_tiles<T, D>::DQ_BQ);
    p.fused = sizeof(T) == 2 && D == 128 && n >= 16384 &&
              bh * ((n + tsys_cuda__flash_ws_tiles<T, D>::KV_BKV - 1) / tsys_cuda__flash_ws_tiles<T, D>::KV_BKV) >= tsys_cuda__flash_sm_count();
    // the scratch also holds the split kernels' parts (desc.flash_no_fused runs them)
    const size_t fused_floats = p.d_floats + tsys_cuda__flash_fused_floats<T, D>(bh, n);
    if (p.fused && fused_floats > p.floats) p.floats = fused_floats;
    return p;
}

// The forward's split (the same rule: a grid of fewer than 2 blocks an SM cuts each query tile's key tiles
// into shares): how many shares, and the floats of scratch they need (0 when it does not split).
template <typename T, int D, bool CAUSAL>
static int tsys_cuda__flash_fwd_shares(int64_t bh, int64_t n) {
    typedef tsys_cuda__flash_cfg_of<T, D, CAUSAL> C;
    constexpr int BQ = C::FWD_NW * C::FWD_MT * 16;
    return tsys_cuda__flash_splits(bh * ((n + BQ - 1) / BQ), n, tsys_cuda__flash_sm_count());
}
template <typename T, int D, bool CAUSAL>
static size_t tsys_cuda__flash_fwd_split_floats(int64_t bh, int64_t n) {
    const int sh = tsys_cuda__flash_fwd_shares<T, D, CAUSAL>(bh, n);
    return sh > 1 ? (size_t)sh * (size_t)(bh * n) * (D + 1) : 0;
}

// Merges the forward's shares: lse = log sum_s exp(lse_s), O = sum_s O_s exp(lse_s - lse), in share order.
template <typename T, int D>
__global__ void tsys_cuda__flash_split_combine(T *__restrict__ o, float *__restrict__ lse, const float *__restrict__ part, int nsplit,
                                          int64_t rows) {
    const float *pl = part + (size_t)nsplit * rows * D;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * D; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / D;
        float mx = -INFINITY;
        for (int s = 0; s < nsplit; s++) mx = fmaxf(mx, pl[(size_t)s * rows + row]);
        float sum = 0.0f, acc = 0.0f;
        for (int s = 0; s < nsplit; s++) {
            const float w = expf(pl[(size_t)s * rows + row] - mx);   // 0 for a share that saw no key
            sum += w;
            acc += w * part[(size_t)s * rows * D + i];
        }
        o[i] = tsys_cuda__fromf<T>(acc / sum);
        if (i % D == 0) lse[row] = mx + logf(sum);
    }
}

// scratch: at least tsys_cuda__flash_fwd_split_floats floats, or nullptr (then no split).
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_fwd_tc(const T *q, const T *k, const T *v, T *o, float *lse, int64_t bh, int n,
                                      float scale, cudaStream_t s, float *scratch = nullptr) {
    typedef tsys_cuda__flash_cfg_of<T, D, CAUSAL> C;
    constexpr int BQ = C::FWD_NW * C::FWD_MT * 16;
    const size_t smem = (size_t)(BQ + 4 * C::FWD_BK) * tsys_cuda__flash_smem<T, D>::SD * sizeof(T);
    auto kern = tsys_cuda__flash_fwd_kernel<T, D, C::FWD_MT, C::FWD_BK, C::FWD_NW, CAUSAL>;
    cudaError_t err = tsys_cuda__flash_smem_attr(kern, smem);
    if (err != cudaSuccess) return err;
    const int sh = scratch ? tsys_cuda__flash_fwd_shares<T, D, CAUSAL>(bh, n) : 1;
    if (sh > 1) {
        const int64_t rows = bh * n;
        kern<<<dim3((n + BQ - 1) / BQ, (unsigned)(bh * sh)), C::FWD_NW * 32, smem, s>>>(q, k, v, o, lse, n, scale * TSYS_CUDA__FLASH_LOG2E, sh, scratch);
        const int64_t count = rows * D;
        tsys_cuda__flash_split_combine<T, D><<<(unsigned)((count + 255) / 256 < 4096 ? (count + 255) / 256 : 4096), 256, 0, s>>>(o, lse, scratch, sh, rows);
        return cudaGetLastError();
    }
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D;
        dim3 grid((n + BQ - 1) / BQ, (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535));
        kern<<<grid, C::FWD_NW * 32, smem, s>>>(q + off, k + off, v + off, o + off, lse + (size_t)b0 * n, n,
                                                scale * TSYS_CUDA__FLASH_LOG2E, 1, nullptr);
    }
    return cudaGetLastError();
}

template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_bwd_tc(const T *dout, const T *q, const T *k, const T *v, const T *o, const float *lse,
                                      T *dq, T *dk, T *dv, float *dvec, int64_t bh, int n, float scale, cudaStream_t s) {
    typedef tsys_cuda__flash_cfg_of<T, D, CAUSAL> C;
    const int64_t rows = bh * n;
    tsys_cuda__flash_bwd_dot<T, D, sizeof(T) == 4>(dout, o, dvec, rows, s);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    constexpr int BKV = C::DKDV_NW * C::DKDV_MK * 16, BQ = C::DQ_NW * C::DQ_MQ * 16;
    constexpr int SD = tsys_cuda__flash_smem<T, D>::SD;
    const size_t smem_kv = (size_t)(2 * BKV + 4 * C::DKDV_BQ) * SD * sizeof(T) + 4 * C::DKDV_BQ * sizeof(float);
    const size_t smem_q = (size_t)(2 * BQ + 4 * C::DQ_BK) * SD * sizeof(T);
    auto kkv = tsys_cuda__flash_bwd_dkdv_kernel<T, D, C::DKDV_MK, C::DKDV_BQ, C::DKDV_NW, CAUSAL>;
    auto kq = tsys_cuda__flash_bwd_dq_kernel<T, D, C::DQ_MQ, C::DQ_BK, C::DQ_NW, CAUSAL>;
    if ((err = tsys_cuda__flash_smem_attr(kkv, smem_kv)) != cudaSuccess) return err;
    if ((err = tsys_cuda__flash_smem_attr(kq, smem_q)) != cudaSuccess) return err;
    const tsys_cuda__flash_split_plan sp = tsys_cuda__flash_tc_split<T, D, CAUSAL>(bh, n);
    if (sp.kv > 1 || sp.q > 1) {   // small grid: one launch of each kernel over (bh x shares), then the sums
        const int64_t count = bh * n * D;
        float *pkv = dvec + sp.d_floats, *pq = pkv + (sp.kv > 1 ? 2 * sp.kv * count : 0);
        const unsigned sum_blocks = (unsigned)((count + 255) / 256 < 4096 ? (count + 255) / 256 : 4096);
        kkv<<<dim3((n + BKV - 1) / BKV, (unsigned)(bh * sp.kv)), C::DKDV_NW * 32, smem_kv, s>>>(
            q, k, v, dout, lse, dvec, dk, dv, n, scale, scale * TSYS_CUDA__FLASH_LOG2E, sp.kv, sp.kv > 1 ? pkv : nullptr);
        if (sp.kv > 1) {
            tsys_cuda__flash_split_sum<T><<<sum_blocks, 256, 0, s>>>(dk, pkv, sp.kv, count, scale);
            tsys_cuda__flash_split_sum<T><<<sum_blocks, 256, 0, s>>>(dv, pkv + sp.kv * count, sp.kv, count, 1.0f);
        }
        kq<<<dim3((n + BQ - 1) / BQ, (unsigned)(bh * sp.q)), C::DQ_NW * 32, smem_q, s>>>(
            q, k, v, dout, lse, dvec, dq, n, scale, scale * TSYS_CUDA__FLASH_LOG2E, sp.q, sp.q > 1 ? pq : nullptr);
        if (sp.q > 1) tsys_cuda__flash_split_sum<T><<<sum_blocks, 256, 0, s>>>(dq, pq, sp.q, count, scale);
        return cudaGetLastError();
    }
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D, loff = (size_t)b0 * n;
        const unsigned nb = (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535);
        kkv<<<dim3((n + BKV - 1) / BKV, nb), C::DKDV_NW * 32, smem_kv, s>>>(
            q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dk + off, dv + off, n, scale,
            scale * TSYS_CUDA__FLASH_LOG2E, 1, nullptr);
        kq<<<dim3((n + BQ - 1) / BQ, nb), C::DQ_NW * 32, smem_q, s>>>(
            q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dq + off, n, scale,
            scale * TSYS_CUDA__FLASH_LOG2E, 1, nullptr);
    }
    return cudaGetLastError();
}

// The short-sequence backward (tsys_cuda__flash_bwd_short_kernel): the row sums D, then one block a slice.
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_bwd_short(const T *dout, const T *q, const T *k, const T *v, const T *o, const float *lse,
                                         T *dq, T *dk, T *dv, float *dvec, int64_t bh, int n, float scale, cudaStream_t s) {
    tsys_cuda__flash_bwd_dot<T, D, false>(dout, o, dvec, bh * n, s);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    auto kern = tsys_cuda__flash_bwd_short_kernel<T, D, CAUSAL>;
    if ((err = tsys_cuda__flash_smem_attr(kern, tsys_cuda__flash_short<T, D>::SMEM)) != cudaSuccess) return err;
    // two blocks a slice where one a slice would leave most SMs idle. H200, batch 4 x 256, causal, bf16, backward ms
    // against the split kernels: small's 12 heads (d 64) 0.028-0.029 against 0.028 (one block a slice: 0.034), xl's
    // 25 0.037 against 0.041-0.042, 2.7B's 32 at d 80 0.051 against 0.076
    const unsigned parts = 2 * bh <= tsys_cuda__flash_sm_count() ? 2 : 1;
    for (int64_t b0 = 0; b0 < bh; b0 += INT32_MAX) {
        const size_t off = (size_t)b0 * n * D;
        const unsigned nb = (unsigned)(bh - b0 < INT32_MAX ? bh - b0 : INT32_MAX);
        kern<<<dim3(nb, parts), tsys_cuda__flash_short<T, D>::NW * 32, tsys_cuda__flash_short<T, D>::SMEM, s>>>(
            q + off, k + off, v + off, dout + off, lse + (size_t)b0 * n, dvec + (size_t)b0 * n, dq + off, dk + off, dv + off, n, scale,
            scale * TSYS_CUDA__FLASH_LOG2E);
    }
    return cudaGetLastError();
}

template <int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_fwd_f32(const float *q, const float *k, const float *v, float *o, float *lse, int64_t bh,
                                       int n, float scale, cudaStream_t s) {
    constexpr int R = TSYS_CUDA__FLASH_F32_ROWS, B = TSYS_CUDA__FLASH_F32_FWD_BK(D);
    const size_t smem = sizeof(float) * (R * (D + 1) + 2 * B * D);
    cudaError_t err = tsys_cuda__flash_smem_attr(tsys_cuda__flash_fwd_f32_kernel<D, CAUSAL>, smem);
    if (err != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D;
        dim3 grid((n + R - 1) / R, (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535));
        tsys_cuda__flash_fwd_f32_kernel<D, CAUSAL><<<grid, R, smem, s>>>(q + off, k + off, v + off, o + off,
                                                                 lse + (size_t)b0 * n, n, scale);
    }
    return cudaGetLastError();
}

template <int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_bwd_f32(const float *dout, const float *q, const float *k, const float *v, const float *o,
                                       const float *lse, float *dq, float *dk, float *dv, float *dvec, int64_t bh, int n,
                                       float scale, cudaStream_t s) {
    constexpr int R = TSYS_CUDA__FLASH_F32_ROWS, B = TSYS_CUDA__FLASH_F32_TILE, SR = D + 1;
    const int64_t rows = bh * n;
    tsys_cuda__flash_bwd_dot_seq_kernel<<<(unsigned)((rows + 255) / 256), 256, 0, s>>>(dout, o, dvec, rows, D);
    const size_t smem_kv = sizeof(float) * (4 * R * SR + 2 * B * D + 2 * B);
    const size_t smem_q = sizeof(float) * (3 * R * SR + 2 * B * D);
    auto kkv = tsys_cuda__flash_bwd_dkdv_f32_kernel<D, CAUSAL>;
    auto kq = tsys_cuda__flash_bwd_dq_f32_kernel<D, CAUSAL>;
    cudaError_t err;
    if ((err = tsys_cuda__flash_smem_attr(kkv, smem_kv)) != cudaSuccess) return err;
    if ((err = tsys_cuda__flash_smem_attr(kq, smem_q)) != cudaSuccess) return err;
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

// The TF32 forward's pre-pass, one 32 x 32 block of (keys, columns) of a slice per block (32 x 8 threads):
// kr = K rounded to TF32 to nearest; vt = V rounded and transposed to (bh, D, npad), zeros past n, the keys of
// each 8-key block in the order the P V wgmma's register operand takes them (slot c: key 2c, slot c + 4:
// key 2c + 1; tsys_cuda__flash_wg_pack). Both are copies: wgmma reads fp32 from shared memory K-major only
// and would truncate, and V is the MN-major operand of P V.
template <int D>
__global__ void tsys_cuda__flash_tf32_prep(const float *__restrict__ k, const float *__restrict__ v, float *__restrict__ kr,
                                           float *__restrict__ vt, int n, int npad, int64_t bh) {
    __shared__ float tile[32][33];
    const int k0 = blockIdx.x * 32, c0 = blockIdx.y * 32, tx = threadIdx.x;
    for (int64_t b = blockIdx.z; b < bh; b += gridDim.z) {
        const size_t base = (size_t)b * n * D;
        for (int i = threadIdx.y; i < 32; i += 8) {
            const int key = k0 + i;
            const size_t at = base + (size_t)key * D + c0 + tx;
            tile[i][tx] = key < n ? __uint_as_float(tsys_cuda__flash_t<float>::tf32(v[at])) : 0.0f;
            if (key < n) kr[at] = __uint_as_float(tsys_cuda__flash_t<float>::tf32(k[at]));
        }
        __syncthreads();
        const int c = tx & 7, key = (tx & ~7) + (c < 4 ? 2 * c : 2 * (c - 4) + 1);
        for (int i = threadIdx.y; i < 32; i += 8) vt[((size_t)b * D + c0 + i) * npad + k0 + tx] = tile[key][i];
        __syncthreads();
    }
}

// ---- Hopper (wgmma) launchers; used by the entry points for bf16/fp16 at d = 64 and 128 when the caller's
// implementation is WGMMA, WS or AUTO (the caller has checked tsys_cuda__flash_wg_probe).
// The warp-specialized forward; cudaErrorNotSupported when no tensor map can be made (AUTO falls back).
// scratch: at least tsys_cuda__flash_ws_fwd_floats floats, or nullptr (then no split; fp32 needs it: the
// rounded K and the V^T of tsys_cuda__flash_tf32_prep live there after the shares). Tiles: tsys_cuda__flash_ws_tiles.
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_fwd_ws(const T *q, const T *k, const T *v, T *o, float *lse, int64_t bh, int n,
                                      float scale, cudaStream_t s, float *scratch = nullptr) {
    constexpr int BK = tsys_cuda__flash_ws_tiles<T, D>::FWD_BK, CW = tsys_cuda__flash_ws_tiles<T, D>::FWD_BQ / 64;
    typedef tsys_cuda__flash_ws_layout<T, D, BK, CW> L;
    const int sh = scratch ? tsys_cuda__flash_ws_fwd_shares<T, D>(bh, n) : 1;
    CUtensorMap tq, tk, tv;
    if constexpr (sizeof(T) == 4) {
        if (!scratch) return cudaErrorNotSupported;
        const tsys_cuda__flash_ws_fwd_scratch<T, D> at(bh, n);
        float *kr = scratch + at.kr, *vt = scratch + at.vt;
        const int npad = at.npad;
        if (!tsys_cuda__flash_tmap_rows(&tq, q, bh, n, D, L::BQ) || !tsys_cuda__flash_tmap_rows(&tk, (const float *)kr, bh, n, D, BK) ||
            !tsys_cuda__flash_tmap_rows(&tv, (const float *)vt, bh, D, npad, D))
            return cudaErrorNotSupported;
        const dim3 grid((unsigned)(npad / 32), D / 32, (unsigned)(bh < 65535 ? bh : 65535));
        tsys_cuda__flash_tf32_prep<D><<<grid, dim3(32, 8), 0, s>>>(k, v, kr, vt, n, npad, bh);
    } else if (!tsys_cuda__flash_tmap_rows(&tq, q, bh, n, D, L::BQ) || !tsys_cuda__flash_tmap_rows(&tk, k, bh, n, D, BK) ||
               !tsys_cuda__flash_tmap_rows(&tv, v, bh, n, D, BK))
        return cudaErrorNotSupported;
    auto kern = tsys_cuda__flash_fwd_ws_kernel<T, D, BK, CAUSAL, CW, tsys_cuda__flash_ws_tiles<T, D>::FWD_TURNS>;
    cudaError_t err = tsys_cuda__flash_smem_attr(kern, L::FWD_SMEM);
    if (err != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        dim3 grid((n + L::BQ - 1) / L::BQ, (unsigned)((bh - b0 < 65535 ? bh - b0 : 65535) * sh));
        kern<<<grid, L::NT, L::FWD_SMEM, s>>>(tq, tk, tv, o, lse, n, (int)b0, scale * TSYS_CUDA__FLASH_LOG2E, sh, sh > 1 ? scratch : nullptr);
    }
    if (sh > 1) {
        const int64_t rows = bh * n, count = rows * D;
        tsys_cuda__flash_split_combine<T, D><<<(unsigned)((count + 255) / 256 < 4096 ? (count + 255) / 256 : 4096), 256, 0, s>>>(o, lse, scratch, sh, rows);
    }
    return cudaGetLastError();
}

// The warp-specialized dQ kernel (BK keys per tile, CW consumer warpgroups); cudaErrorNotSupported when no
// tensor map can be made.
// nsplit > 1: each query tile's key tiles in nsplit shares, fp32 sums into part (see the kernel).
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_bwd_dq_ws(const T *dout, const T *q, const T *k, const T *v, const float *lse,
                                         const float *dvec, T *dq, int64_t bh, int n, float scale, cudaStream_t s,
                                         int nsplit = 1, float *part = nullptr) {
    constexpr int BK = tsys_cuda__flash_ws_tiles<T, D>::DQ_BK, CW = tsys_cuda__flash_ws_tiles<T, D>::DQ_CW;
    typedef tsys_cuda__flash_ws_layout<T, D, BK, CW> L;
    CUtensorMap tq, tk, tv, tg;
    if (!tsys_cuda__flash_tmap_bwd(&tq, &tg, &tk, &tv, q, dout, k, v, bh, n, D, L::BQ, BK)) return cudaErrorNotSupported;
    auto kern = tsys_cuda__flash_bwd_dq_ws_kernel<T, D, BK, CW, CAUSAL, tsys_cuda__flash_ws_tiles<T, D>::DQ_TURNS>;
    cudaError_t err = tsys_cuda__flash_smem_attr(kern, L::SMEM);
    if (err != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        dim3 grid((n + L::BQ - 1) / L::BQ, (unsigned)((bh - b0 < 65535 ? bh - b0 : 65535) * nsplit));
        kern<<<grid, L::NT, L::SMEM, s>>>(tq, tk, tv, tg, lse, dvec, dq, n, (int)b0, scale, scale * TSYS_CUDA__FLASH_LOG2E, nsplit, part);
    }
    return cudaGetLastError();
}

// The warp-specialized dK/dV kernel (BQ query rows per tile, CW consumer warpgroups of 64 keys);
// cudaErrorNotSupported when no tensor map can be made.
// nsplit > 1: each key block's query tiles in nsplit shares, fp32 sums into part (see the kernel).
// after_dq: the kernel before it on s is the dQ kernel; it then starts in that kernel's tail (programmatic launch).
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_bwd_dkdv_ws(const T *dout, const T *q, const T *k, const T *v, const float *lse,
                                           const float *dvec, T *dk, T *dv, int64_t bh, int n, float scale, cudaStream_t s,
                                           int nsplit = 1, float *part = nullptr, bool after_dq = false) {
    constexpr int BQ = tsys_cuda__flash_ws_tiles<T, D>::KV_BQ, CW = tsys_cuda__flash_ws_tiles<T, D>::KV_CW;
    typedef tsys_cuda__flash_ws_kv_layout<T, D, BQ, CW> L;
    CUtensorMap tq, tk, tv, tg;
    if (!tsys_cuda__flash_tmap_bwd(&tq, &tg, &tk, &tv, q, dout, k, v, bh, n, D, BQ, L::BKV)) return cudaErrorNotSupported;
    auto kern = tsys_cuda__flash_bwd_dkdv_ws_kernel<T, D, BQ, CW, CAUSAL, false, tsys_cuda__flash_ws_tiles<T, D>::KV_AREG>;
    cudaError_t err = tsys_cuda__flash_smem_attr(kern, L::SMEM);
    if (err != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        dim3 grid((n + L::BKV - 1) / L::BKV, (unsigned)((bh - b0 < 65535 ? bh - b0 : 65535) * nsplit));
        err = tsys_cuda__flash_launch_pdl(kern, grid, L::NT, L::SMEM, s, after_dq && b0 == 0, tq, tk, tv, tg, lse, dvec, dk, dv, n, (int)b0,
                                          scale, scale * TSYS_CUDA__FLASH_LOG2E, nsplit, part, (float *)nullptr, (int *)nullptr);
        if (err != cudaSuccess) return err;
    }
    return cudaGetLastError();
}

// The fused (5-matmul) backward: dK, dV and dQ from one warp-specialized kernel (see its FUSED comment), then dq
// rounded from the accumulator. dqacc: bh x ceil(n / BQ) tiles of BQ x D floats, then one int a tile (the turn
// counters, cleared here; tsys_cuda__flash_fused_floats). The entry points run it for 16-bit d 128 where the grid
// needs no split (tsys_cuda__flash_ws_split); at d 64 it measured slower than the 7-matmul kernels (3.67 against
// 3.29 ms, docs/design/flash.md). flash_lab's `lbfused` mode times it against them
// (tsys_cuda_desc.flash_no_fused). ordered false (desc.flash_nondeterministic): no turns, the accumulator cleared
// here instead. cudaErrorNotSupported when no tensor map can be made.
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_bwd_fused_ws(const T *dout, const T *q, const T *k, const T *v, const float *lse, const float *dvec,
                                            T *dq, T *dk, T *dv, int64_t bh, int n, float scale, cudaStream_t s, float *dqacc, bool ordered) {
    constexpr int BQ = tsys_cuda__flash_ws_tiles<T, D>::KV_BQ, CW = tsys_cuda__flash_ws_tiles<T, D>::KV_CW;
    typedef tsys_cuda__flash_ws_kv_layout<T, D, BQ, CW, true> L;
    CUtensorMap tq, tk, tv, tg;
    if (!tsys_cuda__flash_tmap_bwd(&tq, &tg, &tk, &tv, q, dout, k, v, bh, n, D, BQ, L::BKV)) return cudaErrorNotSupported;
    auto kern = tsys_cuda__flash_bwd_dkdv_ws_kernel<T, D, BQ, CW, CAUSAL, true, false>;
    cudaError_t err = tsys_cuda__flash_smem_attr(kern, L::SMEM);
    if (err != cudaSuccess) return err;
    const int nqt = (n + BQ - 1) / BQ, nkb = (n + L::BKV - 1) / L::BKV;
    const int64_t tiles = bh * nqt;
    int *turns = ordered ? (int *)(dqacc + (size_t)tiles * BQ * D) : nullptr;   // unordered: every block adds
    if (ordered && (err = cudaMemsetAsync(turns, 0, (size_t)tiles * sizeof(int), s)) != cudaSuccess) return err;
    if (!ordered && (err = cudaMemsetAsync(dqacc, 0, (size_t)tiles * BQ * D * sizeof(float), s)) != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        dim3 grid(nkb, (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535));
        kern<<<grid, L::NT, L::SMEM, s>>>(tq, tk, tv, tg, lse, dvec, dk, dv, n, (int)b0, scale, scale * TSYS_CUDA__FLASH_LOG2E, 1, nullptr,
                                          dqacc, turns);
    }
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    const int64_t f4 = tiles * BQ * D / 4;
    tsys_cuda__flash_dq_finish<T, D, BQ><<<(unsigned)((f4 + 255) / 256 < 2048 ? (f4 + 255) / 256 : 2048), 256, 0, s>>>(dq, dqacc, tiles, nqt, n, scale);
    return cudaGetLastError();
}

template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_fwd_wg(const T *q, const T *k, const T *v, T *o, float *lse, int64_t bh, int n,
                                      float scale, cudaStream_t s) {
    typedef tsys_cuda__flash_wg_cfg<D, CAUSAL> W;
    constexpr int BQ = W::FWD_WG * 64;
    const size_t smem = (size_t)(BQ + 2 * TSYS_CUDA__FLASH_WG_STAGES * W::FWD_BK) * D * sizeof(T) + 1024;
    auto kern = tsys_cuda__flash_fwd_wg_kernel<T, D, W::FWD_BK, W::FWD_WG, W::FWD_MINB, CAUSAL>;
    cudaError_t err = tsys_cuda__flash_smem_attr(kern, smem);
    if (err != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D;
        dim3 grid((n + BQ - 1) / BQ, (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535));
        kern<<<grid, W::FWD_WG * 128, smem, s>>>(q + off, k + off, v + off, o + off, lse + (size_t)b0 * n, n,
                                                 scale * TSYS_CUDA__FLASH_LOG2E);
    }
    return cudaGetLastError();
}

// dQ and dK/dV: the warp-specialized kernels for WS (cudaErrorNotSupported when they cannot run) and AUTO (the
// cp.async ones when they cannot run), the cp.async wgmma kernels for WGMMA. flags: TSYS_CUDA__FLASH_NO_PDL, _NO_FUSED, _NONDET.
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_bwd_wg(const T *dout, const T *q, const T *k, const T *v, const T *o, const float *lse,
                                      T *dq, T *dk, T *dv, float *dvec, int64_t bh, int n, float scale, cudaStream_t s,
                                      tsys_cuda_flash_impl impl, unsigned flags) {
    typedef tsys_cuda__flash_wg_cfg<D, CAUSAL> W;
    const int64_t rows = bh * n;
    tsys_cuda__flash_bwd_dot<T, D>(dout, o, dvec, rows, s);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    constexpr int BKV = W::DKDV_WG * 64, BQ = W::DQ_WG * 64;
    const size_t smem_kv = (size_t)(2 * BKV + 4 * W::DKDV_BQ) * D * sizeof(T) + 4 * W::DKDV_BQ * sizeof(float) + 1024;
    const size_t smem_q = (size_t)(2 * BQ + 2 * TSYS_CUDA__FLASH_WG_STAGES * W::DQ_BK) * D * sizeof(T) + 1024;
    auto kkv = tsys_cuda__flash_bwd_dkdv_wg_kernel<T, D, W::DKDV_BQ, W::DKDV_WG, W::DKDV_MINB, CAUSAL>;
    auto kq = tsys_cuda__flash_bwd_dq_wg_kernel<T, D, W::DQ_BK, W::DQ_WG, W::DQ_MINB, CAUSAL>;
    // dQ and dK/dV on the warp-specialized kernels where they can run, split on small grids (their sums after)
    bool ws_dq = false, ws_kv = false;
    auto settle = [&](cudaError_t e, bool *ran) {
        *ran = e == cudaSuccess;
        return e == cudaErrorNotSupported && impl != TSYS_CUDA_FLASH_WS ? cudaSuccess : e;
    };
    const tsys_cuda__flash_split_plan sp =
        impl != TSYS_CUDA_FLASH_WGMMA ? tsys_cuda__flash_ws_split<T, D>(bh, n) : tsys_cuda__flash_split_plan{ 1, 1, 0, 0, false };
    if (sp.fused && !(flags & TSYS_CUDA__FLASH_NO_FUSED)) {
        bool ran = false;
        if ((err = settle(tsys_cuda__flash_bwd_fused_ws<T, D, CAUSAL>(dout, q, k, v, lse, dvec, dq, dk, dv, bh, n, scale, s, dvec + sp.d_floats,
                                                                      !(flags & TSYS_CUDA__FLASH_NONDET)),
                          &ran)) != cudaSuccess || ran)
            return err;
    }
    const int64_t count = bh * n * D;
    float *pkv = dvec + sp.d_floats, *pq = pkv + (sp.kv > 1 ? 2 * sp.kv * count : 0);
    const unsigned sum_blocks = (unsigned)((count + 255) / 256 < 4096 ? (count + 255) / 256 : 4096);
    if (impl != TSYS_CUDA_FLASH_WGMMA &&
        (err = settle(tsys_cuda__flash_bwd_dq_ws<T, D, CAUSAL>(dout, q, k, v, lse, dvec, dq, bh, n, scale, s, sp.q, sp.q > 1 ? pq : nullptr), &ws_dq)) != cudaSuccess)
        return err;
    if (ws_dq && sp.q > 1) tsys_cuda__flash_split_sum<T><<<sum_blocks, 256, 0, s>>>(dq, pq, sp.q, count, scale);
    if (impl != TSYS_CUDA_FLASH_WGMMA &&
        (err = settle(tsys_cuda__flash_bwd_dkdv_ws<T, D, CAUSAL>(dout, q, k, v, lse, dvec, dk, dv, bh, n, scale, s, sp.kv, sp.kv > 1 ? pkv : nullptr,
                                                                   ws_dq && sp.q == 1 && !(flags & TSYS_CUDA__FLASH_NO_PDL)), &ws_kv)) != cudaSuccess)
        return err;
    if (ws_kv && sp.kv > 1) {
        tsys_cuda__flash_split_sum<T><<<sum_blocks, 256, 0, s>>>(dk, pkv, sp.kv, count, scale);
        tsys_cuda__flash_split_sum<T><<<sum_blocks, 256, 0, s>>>(dv, pkv + sp.kv * count, sp.kv, count, 1.0f);
    }
    if ((err = tsys_cuda__flash_smem_attr(kkv, smem_kv)) != cudaSuccess) return err;
    if ((err = tsys_cuda__flash_smem_attr(kq, smem_q)) != cudaSuccess) return err;
    for (int64_t b0 = 0; b0 < bh; b0 += 65535) {
        const size_t off = (size_t)b0 * n * D, loff = (size_t)b0 * n;
        const unsigned nb = (unsigned)(bh - b0 < 65535 ? bh - b0 : 65535);
        if (!ws_kv) kkv<<<dim3((n + BKV - 1) / BKV, nb), W::DKDV_WG * 128, smem_kv, s>>>(
            q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dk + off, dv + off, n, scale,
            scale * TSYS_CUDA__FLASH_LOG2E);
        if (!ws_dq) kq<<<dim3((n + BQ - 1) / BQ, nb), W::DQ_WG * 128, smem_q, s>>>(
            q + off, k + off, v + off, dout + off, lse + loff, dvec + loff, dq + off, n, scale,
            scale * TSYS_CUDA__FLASH_LOG2E);
    }
    return cudaGetLastError();
}

// The tensor-core entry points: the implementation the caller asked for where d allows wgmma (64, 128),
// mma.sync otherwise.
// fp32 (TF32): the warp-specialized forward at d = 64 and 128 for WS, and for AUTO from 2048 rows (below that its
// pre-pass and 192-row blocks cost more than they save: 0.022 against 0.019 ms at batch 1, 1024 rows, H100),
// when there is scratch for its copies; mma.sync otherwise (no cp.async wgmma version; the backward is mma.sync).
static bool tsys_cuda__flash_tf32_ws(int64_t n, int64_t d, tsys_cuda_flash_impl impl) {
    return (d == 64 || d == 128) && (impl == TSYS_CUDA_FLASH_WS || (impl == TSYS_CUDA_FLASH_AUTO && n >= 2048));
}
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_fwd_pick(const T *q, const T *k, const T *v, T *o, float *lse, int64_t bh, int n,
                                        float scale, tsys_cuda_flash_impl impl, cudaStream_t s, float *scratch) {
    if constexpr (sizeof(T) == 4) {
        if constexpr (D == 64 || D == 128)
            if (scratch && tsys_cuda__flash_tf32_ws(n, D, impl)) {
                const cudaError_t err = tsys_cuda__flash_fwd_ws<T, D, CAUSAL>(q, k, v, o, lse, bh, n, scale, s, scratch);
                if (err != cudaErrorNotSupported) return err;
            }
        return tsys_cuda__flash_fwd_tc<T, D, CAUSAL>(q, k, v, o, lse, bh, n, scale, s, scratch);
    } else {
        if constexpr (D == 64 || D == 128)
            if (impl != TSYS_CUDA_FLASH_MMA) {
                if (impl != TSYS_CUDA_FLASH_WGMMA) {
                    const cudaError_t err = tsys_cuda__flash_fwd_ws<T, D, CAUSAL>(q, k, v, o, lse, bh, n, scale, s, scratch);
                    if (err != cudaErrorNotSupported || impl == TSYS_CUDA_FLASH_WS) return err;
                }
                return tsys_cuda__flash_fwd_wg<T, D, CAUSAL>(q, k, v, o, lse, bh, n, scale, s);
            }
        return tsys_cuda__flash_fwd_tc<T, D, CAUSAL>(q, k, v, o, lse, bh, n, scale, s, scratch);
    }
}
template <typename T, int D, bool CAUSAL>
static cudaError_t tsys_cuda__flash_bwd_pick(const T *dout, const T *q, const T *k, const T *v, const T *o, const float *lse,
                                        T *dq, T *dk, T *dv, float *dvec, int64_t bh, int n, float scale,
                                        tsys_cuda_flash_impl impl, cudaStream_t s, unsigned flags) {
    if constexpr (sizeof(T) == 2 && D <= 96)
        if (n <= TSYS_CUDA__FLASH_SHORT_N && (impl == TSYS_CUDA_FLASH_AUTO || impl == TSYS_CUDA_FLASH_MMA))
            return tsys_cuda__flash_bwd_short<T, D, CAUSAL>(dout, q, k, v, o, lse, dq, dk, dv, dvec, bh, n, scale, s);
    if constexpr (D == 64 || D == 128)
        if (impl != TSYS_CUDA_FLASH_MMA)
            return tsys_cuda__flash_bwd_wg<T, D, CAUSAL>(dout, q, k, v, o, lse, dq, dk, dv, dvec, bh, n, scale, s, impl, flags);
    return tsys_cuda__flash_bwd_tc<T, D, CAUSAL>(dout, q, k, v, o, lse, dq, dk, dv, dvec, bh, n, scale, s);
}

// The entry points' dtype: tsys's TSYS_F32 / TSYS_BF16 / TSYS_F16 order (fp32 exact: the SIMT kernels), and
// fp32 inputs multiplied on TF32 tensor cores (the mma.sync kernels with T = float).
enum { TSYS_CUDA__FLASH_F32 = 0, TSYS_CUDA__FLASH_BF16 = 1, TSYS_CUDA__FLASH_F16 = 2, TSYS_CUDA__FLASH_TF32 = 3 };
static bool tsys_cuda__flash_supported(int dtype, int64_t d) {
    return dtype >= TSYS_CUDA__FLASH_F32 && dtype <= TSYS_CUDA__FLASH_TF32 && (d == 16 || d == 32 || d == 64 || d == 80 || d == 96 || d == 128);
}

// Head dims 16, 32, 80 and 96 (bf16/fp16) on the Hopper kernels: the inputs are copied into (bh, n, dp) buffers
// (dp = 64 for 16 and 32, 128 for 80 and 96) whose extra columns are zeros, the d = dp kernels run on them with the
// caller's scale, and the first d columns of the outputs are copied back. Zero columns add exact zeros to
// every score and leave the padded outputs' extra columns zero, so the result is the d-column attention.
// The copies cost a few microseconds. Where the padded Hopper kernels win (H100, bf16, causal; the lab's
// `pad` mode, docs/design/flash.md): at 64 columns from 16384 rows in the forward (65536 rows, batch
// 1: 1.20 against 1.82 ms) and in the backward at d 32 only (3.43 against 4.30; d 16: 3.40 against 3.14); at
// 128 columns for d 80 from 8192 rows both ways (65536: 7.84 against 12.00 ms fwd + bwd). On short sequences
// with many heads they lose (bh 128 x 256 rows, d 80: 0.26 against 0.09 ms), so AUTO pads only there (d 96 as
// d 80: 0.285 against 0.373 ms at 8192 rows, 8.09 against 14.03 at 65536, 0.26 against 0.10 at 128 x 256; v15); WS
// pads at every length and both ways (so its tests cover the path). Only when the launcher is given scratch
// and every input and output is 16-byte aligned (the copies move 16-byte chunks).
static int tsys_cuda__flash_pad_width(int64_t d) { return d == 16 || d == 32 ? 64 : d == 80 || d == 96 ? 128 : 0; }
static bool tsys_cuda__flash_pad(int dtype, int64_t n, int64_t d, tsys_cuda_flash_impl impl, bool fwd) {
    const bool pays = d == 80 || d == 96 ? n >= 8192 : n >= 16384 && (fwd || d == 32);
    return (dtype == TSYS_CUDA__FLASH_BF16 || dtype == TSYS_CUDA__FLASH_F16) && tsys_cuda__flash_pad_width(d) &&
           (impl == TSYS_CUDA_FLASH_WS || (impl == TSYS_CUDA_FLASH_AUTO && pays));
}
static size_t tsys_cuda__flash_pad_bytes(int64_t bh, int64_t n, int64_t d) {
    return ((size_t)(bh * n) * tsys_cuda__flash_pad_width(d) * 2 + 255) / 256 * 256;
}
// Up to five tensors a launch (blockIdx.y picks one), in 16-byte chunks: dst (rows, dp) = src (rows, d) and
// zeros, or back (unpad: dst (rows, d) = the first d columns of src (rows, dp)). Every pointer 16-byte aligned.
// Indexed by the padded chunks (CP = dp / 8 a row, a power of two: row and column by shift and mask), four
// chunks a thread with their loads issued before their stores (one chunk a thread with a 64-bit division
// for each ran at ~1 TB/s: 32 us for the backward's five 4 MB copies at 32768 x 32).
struct tsys_cuda__flash_pad_set { const void *src[5]; void *dst[5]; };
enum { TSYS_CUDA__FLASH_PAD_UNROLL = 4 };
template <int CP>
__global__ void tsys_cuda__flash_pad_cols(tsys_cuda__flash_pad_set set, int64_t rows, int cd, bool unpad) {
    const uint4 *src = (const uint4 *)set.src[blockIdx.y];
    uint4 *dst = (uint4 *)set.dst[blockIdx.y];
    const int64_t items = rows * CP, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t base = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; base < items; base += TSYS_CUDA__FLASH_PAD_UNROLL * stride) {
        uint4 v[TSYS_CUDA__FLASH_PAD_UNROLL];
#pragma unroll
        for (int u = 0; u < TSYS_CUDA__FLASH_PAD_UNROLL; u++) {
            const int64_t i = base + u * stride, r = i / CP;
            const int c = (int)(i & (CP - 1));
            v[u] = make_uint4(0, 0, 0, 0);
            if (i < items && c < cd) v[u] = unpad ? src[i] : src[r * cd + c];
        }
#pragma unroll
        for (int u = 0; u < TSYS_CUDA__FLASH_PAD_UNROLL; u++) {
            const int64_t i = base + u * stride, r = i / CP;
            const int c = (int)(i & (CP - 1));
            if (i >= items) continue;
            if (!unpad) dst[i] = v[u];
            else if (c < cd) dst[r * cd + c] = v[u];
        }
    }
}
static void tsys_cuda__flash_pad_launch(const tsys_cuda__flash_pad_set &set, int count, int64_t rows, int d, bool unpad, cudaStream_t s) {
    const int cp = tsys_cuda__flash_pad_width(d) / 8;
    const int64_t blocks = (rows * cp + 256 * TSYS_CUDA__FLASH_PAD_UNROLL - 1) / (256 * TSYS_CUDA__FLASH_PAD_UNROLL);
    const dim3 grid((unsigned)(blocks < 4096 ? blocks : 4096), (unsigned)count);
    if (cp == 8) tsys_cuda__flash_pad_cols<8><<<grid, 256, 0, s>>>(set, rows, d / 8, unpad);
    else tsys_cuda__flash_pad_cols<16><<<grid, 256, 0, s>>>(set, rows, d / 8, unpad);
}
static bool tsys_cuda__flash_aligned16(const void *const *p, int count) {
    for (int i = 0; i < count; i++)
        if (!tsys_cuda__aligned16(p[i])) return false;
    return true;
}

// Bytes of fp32 scratch the backward (fwd = false) needs: D = rowsum(dO o O), one float per (bh, row), and
// where the mma.sync or the warp-specialized kernels run on a small grid, their split shares
// (tsys_cuda__flash_tc_split, tsys_cuda__flash_ws_split); the forward's: its split shares (mma.sync or
// warp-specialized), and the TF32 warp-specialized forward's rounded K and V^T. The arguments are those of
// tsys_cuda__flash_fwd / _bwd.
static size_t tsys_cuda__flash_scratch_bytes(int64_t bh, int64_t n, int64_t d, int dtype, bool causal, tsys_cuda_flash_impl impl, bool fwd) {
    const size_t plain = fwd ? 0 : sizeof(float) * (size_t)(bh * n);
    if (!tsys_cuda__flash_supported(dtype, d) || n < 1 || n > INT32_MAX / 2 || bh < 1 || dtype == TSYS_CUDA__FLASH_F32) return plain;
    if (tsys_cuda__flash_pad(dtype, n, d, impl, fwd))   // the padded copies, then what the d = dp kernels need
        return (fwd ? 4 : 8) * tsys_cuda__flash_pad_bytes(bh, n, d) +
               tsys_cuda__flash_scratch_bytes(bh, n, tsys_cuda__flash_pad_width(d), dtype, causal, impl, fwd);
    if (fwd && dtype == TSYS_CUDA__FLASH_TF32 && tsys_cuda__flash_tf32_ws(n, d, impl))
        return sizeof(float) * (d == 64 ? tsys_cuda__flash_ws_fwd_floats<float, 64>(bh, n)
                                        : tsys_cuda__flash_ws_fwd_floats<float, 128>(bh, n));   // the Hopper TF32 forward
    if (dtype != TSYS_CUDA__FLASH_TF32 && (d == 64 || d == 128) && impl != TSYS_CUDA_FLASH_MMA) {   // the Hopper kernels
        if (impl == TSYS_CUDA_FLASH_WGMMA) return plain;   // only the warp-specialized kernels split
#define TSYS_CUDA__FLASH_WS_FLOATS(T, D_) (fwd ? tsys_cuda__flash_ws_fwd_split_floats<T, D_>(bh, n) : tsys_cuda__flash_ws_split<T, D_>(bh, n).floats)
#define TSYS_CUDA__FLASH_WS_BYTES(D_) (dtype == TSYS_CUDA__FLASH_BF16 ? TSYS_CUDA__FLASH_WS_FLOATS(__nv_bfloat16, D_) : TSYS_CUDA__FLASH_WS_FLOATS(__half, D_))
        return sizeof(float) * (d == 64 ? TSYS_CUDA__FLASH_WS_BYTES(64) : TSYS_CUDA__FLASH_WS_BYTES(128));
#undef TSYS_CUDA__FLASH_WS_BYTES
#undef TSYS_CUDA__FLASH_WS_FLOATS
    }
#define TSYS_CUDA__FLASH_SPLIT_BYTES(T) \
    if (fwd) return sizeof(float) * (causal ? tsys_cuda__flash_fwd_split_floats<T, D_, true>(bh, n) : tsys_cuda__flash_fwd_split_floats<T, D_, false>(bh, n)); \
    return sizeof(float) * (causal ? tsys_cuda__flash_tc_split<T, D_, true>(bh, n) : tsys_cuda__flash_tc_split<T, D_, false>(bh, n)).floats
#define TSYS_CUDA__FLASH_SPLIT_ONE \
    if (dtype == TSYS_CUDA__FLASH_TF32) { TSYS_CUDA__FLASH_SPLIT_BYTES(float); } \
    if (dtype == TSYS_CUDA__FLASH_BF16) { TSYS_CUDA__FLASH_SPLIT_BYTES(__nv_bfloat16); } \
    TSYS_CUDA__FLASH_SPLIT_BYTES(__half)
    switch (d) {
    case 16: { constexpr int D_ = 16; TSYS_CUDA__FLASH_SPLIT_ONE; }
    case 32: { constexpr int D_ = 32; TSYS_CUDA__FLASH_SPLIT_ONE; }
    case 64: { constexpr int D_ = 64; TSYS_CUDA__FLASH_SPLIT_ONE; }
    case 80: { constexpr int D_ = 80; TSYS_CUDA__FLASH_SPLIT_ONE; }
    case 96: { constexpr int D_ = 96; TSYS_CUDA__FLASH_SPLIT_ONE; }
    case 128: { constexpr int D_ = 128; TSYS_CUDA__FLASH_SPLIT_ONE; }
    default: return plain;
    }
#undef TSYS_CUDA__FLASH_SPLIT_ONE
#undef TSYS_CUDA__FLASH_SPLIT_BYTES
}
static size_t tsys_cuda__flash_bwd_scratch_bytes(int64_t bh, int64_t n, int64_t d, int dtype, bool causal, tsys_cuda_flash_impl impl) {
    return tsys_cuda__flash_scratch_bytes(bh, n, d, dtype, causal, impl, false);
}
// The forward's scratch (its split shares on a small grid); 0: none needed.
static size_t tsys_cuda__flash_fwd_scratch_bytes(int64_t bh, int64_t n, int64_t d, int dtype, bool causal, tsys_cuda_flash_impl impl) {
    return tsys_cuda__flash_scratch_bytes(bh, n, d, dtype, causal, impl, true);
}

#define TSYS_CUDA__FLASH_DISPATCH_D(d, CALL) \
    switch (d) { \
    case 16: { constexpr int D_ = 16; CALL; } break; \
    case 32: { constexpr int D_ = 32; CALL; } break; \
    case 64: { constexpr int D_ = 64; CALL; } break; \
    case 80: { constexpr int D_ = 80; CALL; } break; \
    case 96: { constexpr int D_ = 96; CALL; } break; \
    case 128: { constexpr int D_ = 128; CALL; } break; \
    default: return cudaErrorInvalidValue; \
    }

// O = softmax(scale * Q K^T [causal]) V and lse, for (bh, n, d) inputs of one dtype. lse is fp32 (bh, n).
// impl: which kernels bf16/fp16 at d = 64, 128 run (see the top of the section; WGMMA, WS and AUTO only where
// tsys_cuda__flash_wg_probe() holds). cudaErrorNotSupported: WS asked for, and TMA cannot read an input.
static cudaError_t tsys_cuda__flash_fwd(const void *q, const void *k, const void *v, void *o, float *lse, int dtype,
                                        int64_t bh, int64_t n, int64_t d, float scale, bool causal,
                                        tsys_cuda_flash_impl impl, cudaStream_t s, float *scratch = nullptr) {
    if (!tsys_cuda__flash_supported(dtype, d) || n < 1 || n > INT32_MAX / 2 || bh < 1) return cudaErrorInvalidValue;
    const void *fio[4] = { q, k, v, o };
    if (scratch && tsys_cuda__flash_pad(dtype, n, d, impl, true) && tsys_cuda__flash_aligned16(fio, 4)) {   // on the d = 64 / 128 kernels
        const size_t b = tsys_cuda__flash_pad_bytes(bh, n, d);
        unsigned char *p = (unsigned char *)scratch;
        tsys_cuda__flash_pad_launch({ { q, k, v }, { p, p + b, p + 2 * b } }, 3, bh * n, (int)d, false, s);
        const cudaError_t e = tsys_cuda__flash_fwd(p, p + b, p + 2 * b, p + 3 * b, lse, dtype, bh, n, tsys_cuda__flash_pad_width(d), scale, causal, impl, s,
                                                   (float *)(p + 4 * b));
        if (e != cudaSuccess) return e;
        tsys_cuda__flash_pad_launch({ { p + 3 * b }, { o } }, 1, bh * n, (int)d, true, s);
        return cudaGetLastError();
    }
    const int ni = (int)n;
#define TSYS_CUDA__FLASH_FWD_CALL(T, D_, C_) \
    return tsys_cuda__flash_fwd_pick<T, D_, C_>((const T *)q, (const T *)k, (const T *)v, (T *)o, lse, bh, ni, scale, impl, s, scratch)
#define TSYS_CUDA__FLASH_FWD_ONE \
    if (dtype == 0) { if (causal) return tsys_cuda__flash_fwd_f32<D_, true>((const float *)q, (const float *)k, (const float *)v, (float *)o, lse, bh, ni, scale, s); \
                      else return tsys_cuda__flash_fwd_f32<D_, false>((const float *)q, (const float *)k, (const float *)v, (float *)o, lse, bh, ni, scale, s); } \
    if (dtype == TSYS_CUDA__FLASH_TF32) { if (causal) TSYS_CUDA__FLASH_FWD_CALL(float, D_, true); else TSYS_CUDA__FLASH_FWD_CALL(float, D_, false); } \
    if (dtype == 1) { if (causal) TSYS_CUDA__FLASH_FWD_CALL(__nv_bfloat16, D_, true); else TSYS_CUDA__FLASH_FWD_CALL(__nv_bfloat16, D_, false); } \
    if (causal) TSYS_CUDA__FLASH_FWD_CALL(__half, D_, true); else TSYS_CUDA__FLASH_FWD_CALL(__half, D_, false)
    TSYS_CUDA__FLASH_DISPATCH_D(d, TSYS_CUDA__FLASH_FWD_ONE)
#undef TSYS_CUDA__FLASH_FWD_ONE
#undef TSYS_CUDA__FLASH_FWD_CALL
    return cudaErrorInvalidValue;
}

// dQ, dK, dV (input dtype) from dO, Q, K, V, O and lse of the forward. scratch: fp32, at least
// tsys_cuda__flash_bwd_scratch_bytes(bh, n, d, dtype, causal, impl) bytes (D = rowsum(dO o O), split shares).
// impl: as for the forward. flags: TSYS_CUDA__FLASH_NO_PDL, _NO_FUSED, _NONDET (the context's desc).
static cudaError_t tsys_cuda__flash_bwd(const void *dout, const void *q, const void *k, const void *v, const void *o,
                                        const float *lse, void *dq, void *dk, void *dv, float *scratch, int dtype,
                                        int64_t bh, int64_t n, int64_t d, float scale, bool causal,
                                        tsys_cuda_flash_impl impl, cudaStream_t s, unsigned flags) {
    if (!tsys_cuda__flash_supported(dtype, d) || n < 1 || n > INT32_MAX / 2 || bh < 1) return cudaErrorInvalidValue;
    const void *bio[8] = { dout, q, k, v, o, dq, dk, dv };
    if (tsys_cuda__flash_pad(dtype, n, d, impl, false) && tsys_cuda__flash_aligned16(bio, 8)) {   // padded (see the forward)
        const size_t b = tsys_cuda__flash_pad_bytes(bh, n, d);
        unsigned char *p = (unsigned char *)scratch;
        tsys_cuda__flash_pad_launch({ { dout, q, k, v, o }, { p, p + b, p + 2 * b, p + 3 * b, p + 4 * b } }, 5, bh * n, (int)d, false, s);
        const cudaError_t e = tsys_cuda__flash_bwd(p, p + b, p + 2 * b, p + 3 * b, p + 4 * b, lse, p + 5 * b, p + 6 * b, p + 7 * b,
                                                   (float *)(p + 8 * b), dtype, bh, n, tsys_cuda__flash_pad_width(d), scale, causal, impl, s, flags);
        if (e != cudaSuccess) return e;
        tsys_cuda__flash_pad_launch({ { p + 5 * b, p + 6 * b, p + 7 * b }, { dq, dk, dv } }, 3, bh * n, (int)d, true, s);
        return cudaGetLastError();
    }
    const int ni = (int)n;
#define TSYS_CUDA__FLASH_BWD_CALL(F, T, D_, C_) \
    return F<T, D_, C_>((const T *)dout, (const T *)q, (const T *)k, (const T *)v, (const T *)o, lse, (T *)dq, (T *)dk, \
                        (T *)dv, scratch, bh, ni, scale, impl, s, flags)
#define TSYS_CUDA__FLASH_BWD_ONE \
    if (dtype == 0) { if (causal) return tsys_cuda__flash_bwd_f32<D_, true>((const float *)dout, (const float *)q, (const float *)k, (const float *)v, (const float *)o, lse, (float *)dq, (float *)dk, (float *)dv, scratch, bh, ni, scale, s); \
                      else return tsys_cuda__flash_bwd_f32<D_, false>((const float *)dout, (const float *)q, (const float *)k, (const float *)v, (const float *)o, lse, (float *)dq, (float *)dk, (float *)dv, scratch, bh, ni, scale, s); } \
    if (dtype == TSYS_CUDA__FLASH_TF32) { if (causal) return tsys_cuda__flash_bwd_tc<float, D_, true>((const float *)dout, (const float *)q, (const float *)k, (const float *)v, (const float *)o, lse, (float *)dq, (float *)dk, (float *)dv, scratch, bh, ni, scale, s); \
                                          else return tsys_cuda__flash_bwd_tc<float, D_, false>((const float *)dout, (const float *)q, (const float *)k, (const float *)v, (const float *)o, lse, (float *)dq, (float *)dk, (float *)dv, scratch, bh, ni, scale, s); } \
    if (dtype == 1) { if (causal) TSYS_CUDA__FLASH_BWD_CALL(tsys_cuda__flash_bwd_pick, __nv_bfloat16, D_, true); else TSYS_CUDA__FLASH_BWD_CALL(tsys_cuda__flash_bwd_pick, __nv_bfloat16, D_, false); } \
    if (causal) TSYS_CUDA__FLASH_BWD_CALL(tsys_cuda__flash_bwd_pick, __half, D_, true); else TSYS_CUDA__FLASH_BWD_CALL(tsys_cuda__flash_bwd_pick, __half, D_, false)
    TSYS_CUDA__FLASH_DISPATCH_D(d, TSYS_CUDA__FLASH_BWD_ONE)
#undef TSYS_CUDA__FLASH_BWD_ONE
#undef TSYS_CUDA__FLASH_BWD_CALL
    return cudaErrorInvalidValue;
}
#endif // TSYS_CUDA_NO_FLASH

// >>fused update ----------------------------------------------------------------------------------
// AdamW in the epilogue of a linear weight's gradient product (TSYS_K_LINEAR_ADAMW, sm_90a): g = dy^T x is
// made tile by tile in registers, rounded to the gradient's dtype GT and handed to AdamW's update of p, m, v
// (and p's kept copy), so the gradient is never written nor read back (4 of AdamW's 28 bytes a parameter
// with bf16 gradients) and the update's memory traffic runs beside the next tile's product. One block an SM
// walks the tiles (128 outputs, rows of W, x 128 inputs): warpgroups 0 and 1 make a tile's product (64
// output rows each; the positions, rows of dy and x, 64 a stage through a 3-stage TMA ring that thread 0
// keeps filled across tiles), hand it over as a shared-memory tile and go on to the next tile, while
// warpgroups 2 and 3 update p, m, v from it, four elements a thread, a warp a row's 512 bytes, as AdamW's
// kernel reads them. Both operands are MN-major tiles (a position's outputs, or inputs, are contiguous),
// the layout the flash kernels' dS^T dO products read.
#define TSYS_CUDA__LADAMW_ST 3
#define TSYS_CUDA__LADAMW_THREADS 512
struct tsys_cuda__ladamw_layout {
    static constexpr int BM = 128, BN = 128, BK = 64, ST = TSYS_CUDA__LADAMW_ST, PITCH = BN + 4;   // gradient rows 4 banks apart
    static constexpr int HALF = 64 * BK * 2;            // one 64-column box of 16-bit elements
    static constexpr int STAGE = 4 * HALF;               // dy's two boxes, then x's two
    static constexpr int GRAD = BM * PITCH * 4;          // the handed-over gradient tile (fp32)
    static constexpr int SMEM = 1024 + ST * STAGE + GRAD + (2 * ST + 3) * 8;   // swizzle alignment, ring, tile, barriers
};

#ifndef TSYS_CUDA_NO_FLASH
// Stage k's copies (positions k * 64 ..): dy's 128 output columns, then x's 128 input columns.
__device__ __forceinline__ void tsys_cuda__ladamw_fill(unsigned char *st, uint64_t *full, const CUtensorMap *tdy, const CUtensorMap *tx, int o0, int i0, int k) {
    typedef tsys_cuda__ladamw_layout L;
    tsys_cuda__flash_mbar_expect_tx(full, (uint32_t)L::STAGE);
    tsys_cuda__flash_tma_load(st, tdy, full, o0, k * L::BK, 0);
    tsys_cuda__flash_tma_load(st + L::HALF, tdy, full, o0 + 64, k * L::BK, 0);
    tsys_cuda__flash_tma_load(st + 2 * L::HALF, tx, full, i0, k * L::BK, 0);
    tsys_cuda__flash_tma_load(st + 3 * L::HALF, tx, full, i0 + 64, k * L::BK, 0);
}
// The ring's g-th fill of this block (its tile g / nk, stage g % nk); false past its last tile.
__device__ __forceinline__ bool tsys_cuda__ladamw_fill_nth(unsigned char *ring, uint64_t *full, const CUtensorMap *tdy, const CUtensorMap *tx,
                                                           int g, int nk, int ntiles, int ntn) {
    typedef tsys_cuda__ladamw_layout L;
    const int tile = blockIdx.x + (g / nk) * gridDim.x, s = g % L::ST;
    if (tile >= ntiles) return false;
    tsys_cuda__ladamw_fill(ring + s * L::STAGE, full + s, tdy, tx, (tile / ntn) * L::BM, (tile % ntn) * L::BN, g % nk);
    return true;
}
template <int LOW, typename T, typename GT>
__global__ void __launch_bounds__(TSYS_CUDA__LADAMW_THREADS, 1)
tsys_cuda__linear_adamw_kernel(const __grid_constant__ CUtensorMap tdy, const __grid_constant__ CUtensorMap tx, tsys_cuda__op_adamw op,
                               float *__restrict__ p, float *__restrict__ m, float *__restrict__ v, uint16_t *__restrict__ low,
                               int d_out, int d_in, int rows) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef tsys_cuda__ladamw_layout L;
    extern __shared__ __align__(16) unsigned char tsys_cuda__flash_smem_raw[];
    unsigned char *ring = tsys_cuda__flash_wg_smem_base(tsys_cuda__flash_smem_raw);
    float *grad = (float *)(ring + L::ST * L::STAGE);
    uint64_t *unused = (uint64_t *)(ring + L::ST * L::STAGE + L::GRAD), *full = unused + 1, *empty = full + L::ST;
    uint64_t *gfull = empty + L::ST, *gfree = gfull + 1;   // the gradient tile written (256 arrivals) / read (256)
    const int nk = (rows + L::BK - 1) / L::BK, ntn = (d_in + L::BN - 1) / L::BN, ntiles = ((d_out + L::BM - 1) / L::BM) * ntn;
    const int warp = threadIdx.x >> 5, wg = warp >> 2, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) { tsys_cuda__flash_mbar_init(gfull, 256); tsys_cuda__flash_mbar_init(gfree, 256); }
    tsys_cuda__flash_ws_init(unused, full, empty, 2, 1, L::ST);
    if (wg < 2) {   // the product: acc (this warpgroup's 64 outputs x 128 inputs) = dy^T x over the tile's positions
        if (threadIdx.x == 0)   // positions past `rows` read as zeros
            for (int g = 0; g < L::ST && tsys_cuda__ladamw_fill_nth(ring, full, &tdy, &tx, g, nk, ntiles, ntn); g++) {}
        int it = 0;   // this block's stages so far, over its tiles
        for (int c = 0; blockIdx.x + c * gridDim.x < ntiles; c++) {
            float acc[16][4];
#pragma unroll
            for (int j = 0; j < 16; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
            for (int k = 0; k < nk; k++, it++) {
                const int s = it % L::ST;
                tsys_cuda__flash_mbar_wait(full + s, (it / L::ST) & 1);
                const unsigned char *st = ring + s * L::STAGE;
                tsys_cuda__flash_wg_fence();
#pragma unroll
                for (int kk = 0; kk < L::BK / 16; kk++)
                    tsys_cuda__flash_wgmma<T, 128>::ss_mn(&acc[0][0], tsys_cuda__flash_wg_desc_mn<L::BK>(st + wg * L::HALF, kk),
                                                          tsys_cuda__flash_wg_desc_mn<L::BK>(st + 2 * L::HALF, kk), 1);
                tsys_cuda__flash_wg_commit();
                tsys_cuda__flash_wg_wait<1>();   // the stage before this one is read: give it back, and refill it
                if (it > 0) {
                    const int sp = (it - 1) % L::ST;
                    if ((threadIdx.x & 127) == 0) tsys_cuda__flash_mbar_arrive(empty + sp);
                    if (threadIdx.x == 0) {
                        tsys_cuda__flash_mbar_wait(empty + sp, ((it - 1) / L::ST) & 1);
                        tsys_cuda__ladamw_fill_nth(ring, full, &tdy, &tx, it - 1 + L::ST, nk, ntiles, ntn);
                    }
                }
            }
            tsys_cuda__flash_wg_wait<0>();
            tsys_cuda__flash_wg_fence_acc<128>(acc);
            if (c > 0) tsys_cuda__flash_mbar_wait(gfree, (c - 1) & 1);   // the update has read the last tile
            const int r = wg * 64 + (warp & 3) * 16 + (lane >> 2), cc = 2 * (lane & 3);
#pragma unroll
            for (int j = 0; j < 16; j++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    *(float2 *)(grad + (r + 8 * h) * L::PITCH + cc + 8 * j) =
                        make_float2(tsys_cuda__tof((GT)acc[j][2 * h]), tsys_cuda__tof((GT)acc[j][2 * h + 1]));
            tsys_cuda__flash_mbar_arrive(gfull);
        }
        return;
    }
    // The update, one tile behind the product.
    const tsys_cuda__op_adamw::shared sk = op.prep();
    const int ut = threadIdx.x - 256;
    constexpr int U = 4, GROUPS = L::BM * L::BN / 4;   // groups of four elements; U of them in flight a thread
    for (int c = 0; blockIdx.x + c * gridDim.x < ntiles; c++) {
        const int tile = blockIdx.x + c * gridDim.x, o0 = (tile / ntn) * L::BM, i0 = (tile % ntn) * L::BN;
        const int cols = min(L::BN, d_in - i0), rows_here = min(L::BM, d_out - o0);
        tsys_cuda__flash_mbar_wait(gfull, c & 1);
#pragma unroll 1
        for (int q0 = ut; q0 < GROUPS; q0 += U * 256) {
            float4 P[U], M[U], V[U];
            bool in[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int q = q0 + u * 256, r = q / (L::BN / 4), c4 = 4 * (q % (L::BN / 4));
                in[u] = r < rows_here && c4 < cols;
                if (in[u]) {
                    const size_t e = (size_t)(o0 + r) * d_in + i0 + c4;
                    P[u] = *(const float4 *)(p + e); M[u] = *(const float4 *)(m + e); V[u] = *(const float4 *)(v + e);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (!in[u]) continue;
                const int q = q0 + u * 256, r = q / (L::BN / 4), c4 = 4 * (q % (L::BN / 4));
                const float4 G = *(const float4 *)(grad + r * L::PITCH + c4);
                float x[4][4] = { { P[u].x, G.x, M[u].x, V[u].x }, { P[u].y, G.y, M[u].y, V[u].y }, { P[u].z, G.z, M[u].z, V[u].z }, { P[u].w, G.w, M[u].w, V[u].w } }, y[4][3];
#pragma unroll
                for (int e = 0; e < 4; e++) op.apply(sk, x[e], y[e]);
                const size_t e = (size_t)(o0 + r) * d_in + i0 + c4;
                *(float4 *)(p + e) = make_float4(y[0][0], y[1][0], y[2][0], y[3][0]);
                *(float4 *)(m + e) = make_float4(y[0][1], y[1][1], y[2][1], y[3][1]);
                *(float4 *)(v + e) = make_float4(y[0][2], y[1][2], y[2][2], y[3][2]);
                if (LOW) *(uint2 *)(low + e) = make_uint2(tsys_cuda__pack2(LOW, y[0][0], y[1][0]), tsys_cuda__pack2(LOW, y[2][0], y[3][0]));
            }
        }
        tsys_cuda__flash_mbar_arrive(gfree);
    }
#endif
}

// Runs the fused kernel where it can: an sm_90a build on Hopper with TMA, 16-bit operands, dimensions that TMA
// boxes and 16-byte accesses fit (O and I multiples of 8 and at least 128, 64 positions or more), p, m, v
// 16-byte aligned and the copy 8-byte aligned. False when it cannot (the caller makes the gradient and runs ADAMW instead).
template <typename T>
static bool tsys_cuda__linear_adamw_fused(tsys_cuda__state *st, const tsys_cuda__op_adamw &op, const T *dy, const T *x, float *p, float *m,
                                          float *v, uint16_t *low, int ldt, tsys_dtype gdt, int64_t d_out, int64_t d_in, int64_t rows, tsys_status *ret) {
    typedef tsys_cuda__ladamw_layout L;
    if (!st->flash_ws_ok || d_out % 8 || d_in % 8 || d_out < L::BM || d_in < L::BN || rows < L::BK || d_out > INT32_MAX / 2 || d_in > INT32_MAX / 2 ||
        (d_out / L::BM + 1) * (d_in / L::BN + 1) > INT32_MAX ||
        rows > INT32_MAX / 2 || !tsys_cuda__aligned16(p) || !tsys_cuda__aligned16(m) || !tsys_cuda__aligned16(v) || ((uintptr_t)low & 7))
        return false;
    CUtensorMap tdy, tx;
    if (!tsys_cuda__flash_tmap_rows(&tdy, dy, 1, (int)rows, (int)d_out, L::BK) || !tsys_cuda__flash_tmap_rows(&tx, x, 1, (int)rows, (int)d_in, L::BK)) return false;
    const int64_t tiles = ((d_in + L::BN - 1) / L::BN) * ((d_out + L::BM - 1) / L::BM);
    const dim3 grid((unsigned)(tiles < st->num_sms ? tiles : st->num_sms));   // one block an SM walks the tiles
    const bool g32 = gdt == TSYS_F32;
#define TSYS_CUDA__LADAMW_GO(LW, GT_) { \
        auto kern = tsys_cuda__linear_adamw_kernel<LW, T, GT_>; \
        cudaError_t e = tsys_cuda__flash_smem_attr(kern, L::SMEM); \
        if (e != cudaSuccess) { *ret = tsys_ctx_set_error(st->ctx, TSYS_ERR_CUDA, "linear_adamw: shared memory of %d bytes: %s", L::SMEM, cudaGetErrorString(e)); return true; } \
        *ret = tsys_cuda__launch(st, __FILE__, __LINE__, "tsys_cuda__linear_adamw_kernel", kern, grid, dim3(TSYS_CUDA__LADAMW_THREADS), (size_t)L::SMEM, tdy, tx, op, \
                                 p, m, v, low, (int)d_out, (int)d_in, (int)rows); \
        return true; }
    if (ldt == TSYS_BF16) { if (g32) TSYS_CUDA__LADAMW_GO(TSYS_BF16, float) else TSYS_CUDA__LADAMW_GO(TSYS_BF16, T) }
    if (ldt == TSYS_F16) { if (g32) TSYS_CUDA__LADAMW_GO(TSYS_F16, float) else TSYS_CUDA__LADAMW_GO(TSYS_F16, T) }
    if (g32) TSYS_CUDA__LADAMW_GO(0, float) else TSYS_CUDA__LADAMW_GO(0, T)
#undef TSYS_CUDA__LADAMW_GO
}
#endif // TSYS_CUDA_NO_FLASH

// >>kernel entry points ---------------------------------------------------------------------------
// Each takes the context, the state and the kernel args; checks what the kernel assumes
// (dtypes, shapes); launches. Semantics: the comments of tsys_kernel in tsys.h.


static bool tsys_cuda__is_float(tsys_dtype dt) { return dt == TSYS_F32 || dt == TSYS_BF16 || dt == TSYS_F16; }
static bool tsys_cuda__is_id(tsys_dtype dt) { return dt == TSYS_I32 || dt == TSYS_I64; }

static tsys_status tsys_cuda__k_elementwise(tsys_cuda__state *st, tsys_kernel k, const tsys_kargs *a) {
    tsys_ctx *ctx = st->ctx;
    tsys_tensor *const *t = a->t;
    TSYS_CUDA__REQUIRE(ctx, t[0] != NULL, "%s: t[0] (output) is NULL", tsys_kernel_name(k));
    int64_t n = tsys_tensor_numel(t[0]);
    int nin = 0;
    switch (k) {
    case TSYS_K_FILL: nin = 0; break;
    case TSYS_K_CAST: case TSYS_K_SCALE: case TSYS_K_RELU_FWD: case TSYS_K_SILU_FWD: case TSYS_K_BROADCAST: nin = 1; break;
    default: nin = 2; break;
    }
    int last_in = (k == TSYS_K_ACCUM || k == TSYS_K_ADD_BIAS) ? 1 : nin;   // these read t[0] and t[1]
    for (int i = 1; i <= last_in; i++) {
        TSYS_CUDA__REQUIRE(ctx, t[i] != NULL, "%s: input t[%d] is NULL", tsys_kernel_name(k), i);
        if (k == TSYS_K_BROADCAST || k == TSYS_K_ADD_BIAS || (k == TSYS_K_SCALE_BY && i == 2)) continue;
        TSYS_CUDA__REQUIRE(ctx, tsys_tensor_numel(t[i]) == n, "%s: t[%d] has %lld elements, t[0] has %lld",
                           tsys_kernel_name(k), i, (long long)tsys_tensor_numel(t[i]), (long long)n);
    }
    tsys_tensor *ins[3] = { t[1], t[2], NULL }, *outs[1] = { t[0] };
    tsys_cuda__ew_args e = tsys_cuda__ew_make(n, nin, ins, 1, outs);
    switch (k) {
    case TSYS_K_FILL: return tsys_cuda__ew<0, 1>(st, tsys_cuda__op_fill{ a->f[0] }, e);
    case TSYS_K_CAST:
        if (tsys_cuda__is_id(t[0]->dtype) && tsys_cuda__is_id(t[1]->dtype)) {
            TSYS_CUDA__LAUNCH(st, tsys_cuda__cast_ids, tsys_cuda__grid(st, n, 256), 256, 0,
                              tsys_cuda__data(t[0]), (int)t[0]->dtype, (const void *)tsys_cuda__data(t[1]), (int)t[1]->dtype, n);
            return TSYS_OK;
        }
        return tsys_cuda__ew<1, 1>(st, tsys_cuda__op_copy{}, e);
    case TSYS_K_SCALE: return tsys_cuda__ew<1, 1>(st, tsys_cuda__op_scale{ a->f[0] }, e);
    case TSYS_K_BROADCAST: e.in_mod[0] = 1; return tsys_cuda__ew<1, 1>(st, tsys_cuda__op_scale{ a->f[0] }, e);
    case TSYS_K_RELU_FWD: return tsys_cuda__ew<1, 1>(st, tsys_cuda__op_relu{}, e);
    case TSYS_K_SILU_FWD: return tsys_cuda__ew<1, 1>(st, tsys_cuda__op_silu{}, e);
    case TSYS_K_ADD: return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_add{}, e);
    case TSYS_K_MUL: return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_mul{}, e);
    case TSYS_K_SCALE_BY:
        TSYS_CUDA__REQUIRE(ctx, tsys_tensor_numel(t[2]) == 1 && t[2]->dtype == TSYS_F32, "scale_by: t[2] must be one f32 element");
        e.in_mod[1] = 1;   // every element reads the one factor
        return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_mul{}, e);
    case TSYS_K_RELU_BWD: return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_relu_bwd{}, e);
    case TSYS_K_SILU_BWD: return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_silu_bwd{}, e);
    case TSYS_K_SWIGLU_FWD: return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_swiglu{}, e);
    case TSYS_K_ACCUM: {
        // t0 += t1 * f0: t0 is both input 0 and the output
        tsys_tensor *in2[2] = { t[0], t[1] };
        e = tsys_cuda__ew_make(n, 2, in2, 1, outs);
        return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_axpy{ a->f[0] }, e);
    }
    case TSYS_K_ADD_BIAS: {
        int64_t cols = tsys_tensor_numel(t[1]);
        TSYS_CUDA__REQUIRE(ctx, cols > 0 && n % cols == 0, "add_bias: bias of %lld elements does not divide t[0] of %lld", (long long)cols, (long long)n);
        tsys_tensor *in2[2] = { t[0], t[1] };
        e = tsys_cuda__ew_make(n, 2, in2, 1, outs);
        e.in_mod[1] = cols;
        return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_add{}, e);
    }
    default: break;
    }
    return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "cuda: %s is not elementwise", tsys_kernel_name(k));
}

static tsys_status tsys_cuda__k_swiglu_bwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *const *t = a->t;
    TSYS_CUDA__REQUIRE(st->ctx, t[2] && t[3] && t[4], "swiglu_bwd: dy, a, b must be given");
    int64_t n = tsys_tensor_numel(t[2]);
    TSYS_CUDA__REQUIRE(st->ctx, tsys_tensor_numel(t[3]) == n && tsys_tensor_numel(t[4]) == n, "swiglu_bwd: dy, a, b differ in size");
    tsys_tensor *ins[3] = { t[2], t[3], t[4] }, *outs[2] = { t[0], t[1] };
    return tsys_cuda__ew<3, 2>(st, tsys_cuda__op_swiglu_bwd{}, tsys_cuda__ew_make(n, 3, ins, 2, outs));
}

static tsys_status tsys_cuda__k_bias_grad(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *db = a->t[0], *dy = a->t[1];
    TSYS_CUDA__REQUIRE(st->ctx, db && dy, "bias_grad: t[0] and t[1] must be given");
    int64_t cols = tsys_tensor_numel(db), n = tsys_tensor_numel(dy);
    TSYS_CUDA__REQUIRE(st->ctx, cols > 0 && n % cols == 0, "bias_grad: %lld columns do not divide %lld elements", (long long)cols, (long long)n);
    return tsys_cuda__colsum_launch(st, tsys_cuda__data(db), db->dtype, tsys_cuda__data(dy), dy->dtype, n / cols, cols, cols);
}

// The row-in-registers forward where every operand holds whole aligned groups of four (else the
// element loop): a thread's groups (at most TSYS_CUDA__NORM_GROUPS) spread over up to 256 threads.
template <class T, class Y, class W, class R>
static tsys_status tsys_cuda__rmsnorm_fwd_launch(tsys_cuda__state *st, Y *y, float *rstd, const T *x, const W *w, int64_t rows, int64_t D, float eps,
                                                 const R *res, float *sum) {
    auto whole4 = [](const void *p, size_t es) { return !p || ((uintptr_t)p & (4 * es - 1)) == 0; };
    const int64_t groups = D / 4, per = (groups + 255) / 256;
    if (D % 4 == 0 && per <= TSYS_CUDA__NORM_GROUPS && whole4(y, sizeof(Y)) && whole4(x, sizeof(T)) && whole4(w, sizeof(W)) && whole4(res, sizeof(R)) && whole4(sum, 4)) {
        const int threads = (int)(((groups + per - 1) / per + 31) / 32 * 32);
        TSYS_CUDA__LAUNCH(st, (tsys_cuda__rmsnorm_fwd_g4<T, Y, W, R>), (unsigned)rows, threads, 0, y, rstd, x, w, D, eps, res, sum);
    } else {
        TSYS_CUDA__LAUNCH(st, (tsys_cuda__rmsnorm_fwd<T, Y, W, R>), (unsigned)rows, tsys_cuda__row_threads(D), 0, y, rstd, x, w, D, eps, res, sum);
    }
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_rmsnorm_fwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *y = a->t[0], *rstd = a->t[1], *x = a->t[2], *w = a->t[3];
    TSYS_CUDA__REQUIRE(st->ctx, y && x && (y->dtype == x->dtype || (x->dtype == TSYS_F32 && (y->dtype == TSYS_BF16 || y->dtype == TSYS_F16))),
                       "rmsnorm_fwd: y and x must be given, y of x's dtype or bf16/f16 from fp32 x");
    TSYS_CUDA__REQUIRE(st->ctx, !rstd || rstd->dtype == TSYS_F32, "rmsnorm_fwd: rstd must be fp32");
    int64_t D = tsys_cuda__last_dim(x), rows = tsys_cuda__rows(x);
    TSYS_CUDA__REQUIRE(st->ctx, !w || tsys_tensor_numel(w) == D, "rmsnorm_fwd: weight has %lld elements, rows have %lld", w ? (long long)tsys_tensor_numel(w) : 0LL, (long long)D);
    int wdt = w ? w->dtype : x->dtype;
    float *prs = (float *)tsys_cuda__data(rstd);
    tsys_tensor *res = a->t[4], *sum = a->t[5];
    if (res) {   // the residual add first: fp32 x, the sum fp32
        TSYS_CUDA__REQUIRE(st->ctx, x->dtype == TSYS_F32 && sum && sum->dtype == TSYS_F32 && tsys_tensor_numel(sum) == tsys_tensor_numel(x) && tsys_tensor_numel(res) == tsys_tensor_numel(x),
                           "rmsnorm_fwd: with a residual t4, x must be fp32 and t5 an fp32 sum of x's size");
        TSYS_CUDA__FLOAT_SWITCH(st->ctx, y->dtype, Y, TSYS_CUDA__FLOAT_SWITCH(st->ctx, wdt, W, TSYS_CUDA__FLOAT_SWITCH(st->ctx, res->dtype, R,
            return tsys_cuda__rmsnorm_fwd_launch<float, Y, W, R>(st, (Y *)tsys_cuda__data(y), prs, (const float *)tsys_cuda__data(x), (const W *)tsys_cuda__data(w), rows, D,
                                                                 a->f[0], (const R *)tsys_cuda__data(res), (float *)tsys_cuda__data(sum)))));
        return TSYS_OK;
    }
    if (y->dtype != x->dtype) {   // fp32 x, low-precision y
        TSYS_CUDA__FLOAT_SWITCH(st->ctx, y->dtype, Y, TSYS_CUDA__FLOAT_SWITCH(st->ctx, wdt, W,
            return tsys_cuda__rmsnorm_fwd_launch<float, Y, W, float>(st, (Y *)tsys_cuda__data(y), prs, (const float *)tsys_cuda__data(x), (const W *)tsys_cuda__data(w), rows, D,
                                                                     a->f[0], nullptr, nullptr)));
        return TSYS_OK;
    }
    TSYS_CUDA__FLOAT_SWITCH(st->ctx, x->dtype, T, TSYS_CUDA__FLOAT_SWITCH(st->ctx, wdt, W,
        return tsys_cuda__rmsnorm_fwd_launch<T, T, W, T>(st, (T *)tsys_cuda__data(y), prs, (const T *)tsys_cuda__data(x), (const W *)tsys_cuda__data(w), rows, D,
                                                         a->f[0], nullptr, nullptr)));
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_rmsnorm_bwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *dx = a->t[0], *dw = a->t[1], *dy = a->t[2], *x = a->t[3], *w = a->t[4], *rstd = a->t[5];
    TSYS_CUDA__REQUIRE(st->ctx, dy && x && rstd && dy->dtype == x->dtype && rstd->dtype == TSYS_F32, "rmsnorm_bwd: dy, x (same dtype) and fp32 rstd must be given");
    TSYS_CUDA__REQUIRE(st->ctx, !dx || dx->dtype == x->dtype, "rmsnorm_bwd: dx must have x's dtype");
    int64_t D = tsys_cuda__last_dim(x), rows = tsys_cuda__rows(x);
    TSYS_CUDA__REQUIRE(st->ctx, D * 4 <= 48 * 1024, "rmsnorm_bwd: rows of %lld elements exceed the shared-memory tile (12288)", (long long)D);
    // the register kernel: whole aligned packs, at most 4 a thread of 256 (D <= 4096 fp32, 8192 bf16/f16)
    constexpr int MAXCH = 4;
    int P = (int)(16 / tsys_dtype_size(x->dtype)), nch = (int)(D / P);
    bool reg = D % P == 0 && nch <= 256 * MAXCH && tsys_cuda__aligned16(tsys_cuda__data(dy)) && tsys_cuda__aligned16(tsys_cuda__data(x)) && (!dx || tsys_cuda__aligned16(tsys_cuda__data(dx)));
    int64_t g4 = (int64_t)st->num_sms * 4;
    int G = reg ? (int)(rows < 1 ? 1 : rows < g4 ? rows : g4) : tsys_cuda__norm_bwd_blocks(st, rows);
    int half = ((nch + 1) / 2 + 31) / 32 * 32;   // about two packs a thread
    int threads = reg ? (half < 32 ? 32 : half > 256 ? 256 : half) : tsys_cuda__row_threads(D);
    float *part = NULL;
    if (dw) {
        part = (float *)tsys_cuda__scratch(st, (size_t)G * D * sizeof(float));
        if (!part) return tsys_ctx_set_error(st->ctx, TSYS_ERR_OOM, "rmsnorm_bwd: no memory for %d x %lld weight-grad partials", G, (long long)D);
    }
    tsys_status s = TSYS_OK;
    int wdt = w ? w->dtype : x->dtype;
    s = [&]() -> tsys_status {
        if (reg) TSYS_CUDA__FLOAT_SWITCH(st->ctx, x->dtype, T, TSYS_CUDA__FLOAT_SWITCH(st->ctx, wdt, W,
            TSYS_CUDA__LAUNCH(st, (tsys_cuda__rmsnorm_bwd_reg<T, W, MAXCH>), (unsigned)G, threads, 0,
                              (T *)tsys_cuda__data(dx), a->i[0] != 0, part, (const T *)tsys_cuda__data(dy), (const T *)tsys_cuda__data(x),
                              (const W *)tsys_cuda__data(w), (const float *)tsys_cuda__data(rstd), rows, D)));
        else TSYS_CUDA__FLOAT_SWITCH(st->ctx, x->dtype, T, TSYS_CUDA__FLOAT_SWITCH(st->ctx, wdt, W,
            TSYS_CUDA__LAUNCH(st, (tsys_cuda__rmsnorm_bwd<T, W>), (unsigned)G, threads, (size_t)D * sizeof(float),
                              (T *)tsys_cuda__data(dx), a->i[0] != 0, part, (const T *)tsys_cuda__data(dy), (const T *)tsys_cuda__data(x),
                              (const W *)tsys_cuda__data(w), (const float *)tsys_cuda__data(rstd), rows, D)));
        if (dw) return tsys_cuda__colsum_launch(st, tsys_cuda__data(dw), dw->dtype, part, TSYS_F32, G, D, D, a->i[1] == 0);   // i1: stored
        return TSYS_OK;
    }();
    if (part) tsys_cuda__scratch_free(st, part);
    return s;
}

static tsys_status tsys_cuda__k_layernorm_fwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *y = a->t[0], *mean = a->t[1], *rstd = a->t[2], *x = a->t[3], *w = a->t[4], *b = a->t[5];
    TSYS_CUDA__REQUIRE(st->ctx, y && x && y->dtype == x->dtype, "layernorm_fwd: y and x must be given, same dtype");
    TSYS_CUDA__REQUIRE(st->ctx, (!mean || mean->dtype == TSYS_F32) && (!rstd || rstd->dtype == TSYS_F32), "layernorm_fwd: mean and rstd must be fp32");
    TSYS_CUDA__REQUIRE(st->ctx, !w || !b || w->dtype == b->dtype, "layernorm_fwd: weight and bias must share a dtype");
    int64_t D = tsys_cuda__last_dim(x), rows = tsys_cuda__rows(x);
    int wdt = w ? w->dtype : b ? b->dtype : x->dtype, threads = tsys_cuda__row_threads(D);
    TSYS_CUDA__FLOAT_SWITCH(st->ctx, x->dtype, T, TSYS_CUDA__FLOAT_SWITCH(st->ctx, wdt, W,
        TSYS_CUDA__LAUNCH(st, (tsys_cuda__layernorm_fwd<T, W>), (unsigned)rows, threads, 0,
                          (T *)tsys_cuda__data(y), (float *)tsys_cuda__data(mean), (float *)tsys_cuda__data(rstd),
                          (const T *)tsys_cuda__data(x), (const W *)tsys_cuda__data(w), (const W *)tsys_cuda__data(b), D, a->f[0])));
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_layernorm_bwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *dx = a->t[0], *dw = a->t[1], *db = a->t[2], *dy = a->t[3], *x = a->t[4], *w = a->t[5], *mean = a->t[6], *rstd = a->t[7];
    TSYS_CUDA__REQUIRE(st->ctx, dy && x && mean && rstd && dy->dtype == x->dtype, "layernorm_bwd: dy, x (same dtype), mean, rstd must be given");
    TSYS_CUDA__REQUIRE(st->ctx, !dx || dx->dtype == x->dtype, "layernorm_bwd: dx must have x's dtype");
    int64_t D = tsys_cuda__last_dim(x), rows = tsys_cuda__rows(x);
    TSYS_CUDA__REQUIRE(st->ctx, D * 8 <= 48 * 1024, "layernorm_bwd: rows of %lld elements exceed the shared-memory tile (6144)", (long long)D);
    int G = tsys_cuda__norm_bwd_blocks(st, rows), threads = tsys_cuda__row_threads(D);
    float *part = NULL;
    if (dw || db) {
        part = (float *)tsys_cuda__scratch(st, (size_t)G * 2 * D * sizeof(float));
        if (!part) return tsys_ctx_set_error(st->ctx, TSYS_ERR_OOM, "layernorm_bwd: no memory for weight-grad partials");
    }
    int wdt = w ? w->dtype : x->dtype;
    tsys_status s = [&]() -> tsys_status {
        TSYS_CUDA__FLOAT_SWITCH(st->ctx, x->dtype, T, TSYS_CUDA__FLOAT_SWITCH(st->ctx, wdt, W,
            TSYS_CUDA__LAUNCH(st, (tsys_cuda__layernorm_bwd<T, W>), (unsigned)G, threads, (size_t)2 * D * sizeof(float),
                              (T *)tsys_cuda__data(dx), part, (const T *)tsys_cuda__data(dy), (const T *)tsys_cuda__data(x),
                              (const W *)tsys_cuda__data(w), (const float *)tsys_cuda__data(mean), (const float *)tsys_cuda__data(rstd), rows, D)));
        // partials are (G, 2D) rows: columns [0, D) fold into dw, [D, 2D) into db
        if (dw) TSYS_CUDA__TRY(tsys_cuda__colsum_launch(st, tsys_cuda__data(dw), dw->dtype, part, TSYS_F32, G, D, 2 * D));
        if (db) TSYS_CUDA__TRY(tsys_cuda__colsum_launch(st, tsys_cuda__data(db), db->dtype, part + D, TSYS_F32, G, D, 2 * D));
        return TSYS_OK;
    }();
    if (part) tsys_cuda__scratch_free(st, part);
    return s;
}

static tsys_status tsys_cuda__k_rope(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *y = a->t[0], *x = a->t[1];
    int mode = (int)a->i[0];
    TSYS_CUDA__REQUIRE(st->ctx, y && x && y->dtype == x->dtype && tsys_tensor_numel(y) == tsys_tensor_numel(x), "rope: y and x must be given, same dtype and size");
    TSYS_CUDA__REQUIRE(st->ctx, mode >= 0 && mode <= 2, "rope: layout i0 = %d (0 rows, 1 (B,T,H,D) -> (B,H,T,D), 2 back)", mode);
    TSYS_CUDA__REQUIRE(st->ctx, mode == 0 ? x->ndim >= 2 : x->ndim == 4, "rope: x must be (..., T, D) (layout 0) or 4-D (layouts 1, 2), has %d dims", x->ndim);
    int64_t D = x->shape[x->ndim - 1], T_len, H;
    if (mode == 0) { T_len = x->shape[x->ndim - 2]; H = 1; }
    else { T_len = mode == 1 ? x->shape[1] : x->shape[2]; H = mode == 1 ? x->shape[2] : x->shape[1]; }
    TSYS_CUDA__REQUIRE(st->ctx, D % 2 == 0, "rope: head dim %lld is odd", (long long)D);
    int64_t rows = D ? tsys_tensor_numel(x) / D : 0;
    if (rows == 0) return TSYS_OK;
    float dir = a->f[1] < 0 ? -1.0f : 1.0f;
    TSYS_CUDA__FLOAT_SWITCH(st->ctx, x->dtype, T,
        constexpr int P = (int)(16 / sizeof(T));
        T *yp = (T *)tsys_cuda__data(y); const T *xp = (const T *)tsys_cuda__data(x);
        bool packs = D % P == 0 && tsys_cuda__aligned16(yp) && tsys_cuda__aligned16(xp);
        const bool narrow = tsys_tensor_numel(x) < ((int64_t)1 << 31);   // every index fits 32 bits
        const uint32_t r32 = (uint32_t)rows, h32 = (uint32_t)H, t32 = (uint32_t)T_len, d32 = (uint32_t)D;
        // by position (the angles once a block) where the rows are 32-bit indexable and the angles fit shared memory
        const int64_t groups = T_len ? (mode == 0 ? rows / T_len : rows / (H * T_len)) : 0, kb = 16;
        const int64_t blocks = T_len * (mode == 0 ? (groups + kb - 1) / kb : groups), members = mode == 0 ? kb : H;
        if (narrow && D <= 4096 && blocks > 0 && blocks < ((int64_t)1 << 31)) {
            const int64_t items = members * (D / (packs ? P : 2));
            const int threads = items >= 256 ? 256 : (int)((items + 31) / 32 * 32);
            const size_t smem = (size_t)D * sizeof(float);
            if (packs) TSYS_CUDA__LAUNCH(st, (tsys_cuda__rope_pos<T, P, uint32_t>), (unsigned)blocks, threads, smem, yp, xp, r32, h32, t32, d32, (uint32_t)kb, a->f[0], dir, mode);
            else TSYS_CUDA__LAUNCH(st, (tsys_cuda__rope_pos<T, 2, uint32_t>), (unsigned)blocks, threads, smem, yp, xp, r32, h32, t32, d32, (uint32_t)kb, a->f[0], dir, mode);
        }
        else if (packs) TSYS_CUDA__LAUNCH(st, (tsys_cuda__rope<T, P>), tsys_cuda__grid(st, rows * (D / P), 256), 256, 0, yp, xp, rows, H, T_len, D, a->f[0], dir, mode);
        else TSYS_CUDA__LAUNCH(st, (tsys_cuda__rope<T, 2>), tsys_cuda__grid(st, rows * (D / 2), 256), 256, 0, yp, xp, rows, H, T_len, D, a->f[0], dir, mode));
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_softmax_fwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *y = a->t[0], *x = a->t[1];
    TSYS_CUDA__REQUIRE(st->ctx, y && x && y->dtype == x->dtype && tsys_tensor_numel(y) == tsys_tensor_numel(x), "softmax_fwd: y and x must be given, same dtype and size");
    int64_t N = tsys_cuda__last_dim(x), rows = tsys_cuda__rows(x);
    bool causal = a->i[0] != 0;
    TSYS_CUDA__REQUIRE(st->ctx, !causal || (N > 0 && rows % N == 0), "softmax_fwd: causal needs square (.., T, T) blocks, rows %lld, cols %lld", (long long)rows, (long long)N);
    int threads = tsys_cuda__row_threads(N);
    TSYS_CUDA__FLOAT_SWITCH(st->ctx, x->dtype, T,
        T *yp = (T *)tsys_cuda__data(y); const T *xp = (const T *)tsys_cuda__data(x);
        int reg = tsys_cuda__softmax_reg_threads(N, (int)(16 / sizeof(T)), 4, yp, xp, NULL);
        static const int reg_max = tsys_cuda__block_threads_max(tsys_cuda__softmax_fwd_reg<T, 4, false>);
        if (reg > reg_max) reg = 0;   // more threads than its registers allow: the plain kernel
        if (reg == 32) TSYS_CUDA__LAUNCH(st, (tsys_cuda__softmax_fwd_reg<T, 4, true>), (unsigned)((rows + 7) / 8), 256, 0, yp, xp, rows, N, a->f[0], (int)causal);
        else if (reg) TSYS_CUDA__LAUNCH(st, (tsys_cuda__softmax_fwd_reg<T, 4, false>), (unsigned)rows, reg, 0, yp, xp, rows, N, a->f[0], (int)causal);
        else TSYS_CUDA__LAUNCH(st, tsys_cuda__softmax_fwd<T>, (unsigned)rows, threads, 0, yp, xp, N, a->f[0], (int)causal));
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_softmax_bwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *dx = a->t[0], *dy = a->t[1], *y = a->t[2];
    TSYS_CUDA__REQUIRE(st->ctx, dx && dy && y && dx->dtype == y->dtype && dy->dtype == y->dtype, "softmax_bwd: dx, dy, y must be given, same dtype");
    int64_t N = tsys_cuda__last_dim(y), rows = tsys_cuda__rows(y);
    bool causal = a->i[0] != 0;   // the forward's mask (y is 0 past it); 0 from callers that do not know it
    TSYS_CUDA__REQUIRE(st->ctx, !causal || (N > 0 && rows % N == 0), "softmax_bwd: causal needs square (.., T, T) blocks, rows %lld, cols %lld", (long long)rows, (long long)N);
    TSYS_CUDA__FLOAT_SWITCH(st->ctx, y->dtype, T,
        T *dxp = (T *)tsys_cuda__data(dx); const T *dyp = (const T *)tsys_cuda__data(dy), *yp = (const T *)tsys_cuda__data(y);
        int reg = tsys_cuda__softmax_reg_threads(N, (int)(16 / sizeof(T)), 4, dxp, dyp, yp);
        static const int reg_max = tsys_cuda__block_threads_max(tsys_cuda__softmax_bwd_reg<T, 4, false>);
        if (reg > reg_max) reg = 0;   // (bf16 rows of 32768: 1024 threads of 64+ registers do not launch)
        if (reg == 32) TSYS_CUDA__LAUNCH(st, (tsys_cuda__softmax_bwd_reg<T, 4, true>), (unsigned)((rows + 7) / 8), 256, 0, dxp, dyp, yp, rows, N, a->f[0], (int)causal);
        else if (reg) TSYS_CUDA__LAUNCH(st, (tsys_cuda__softmax_bwd_reg<T, 4, false>), (unsigned)rows, reg, 0, dxp, dyp, yp, rows, N, a->f[0], (int)causal);
        else TSYS_CUDA__LAUNCH(st, tsys_cuda__softmax_bwd<T>, (unsigned)rows, tsys_cuda__row_threads(N), 0, dxp, dyp, yp, N, a->f[0]));
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_ce_fwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *loss = a->t[0], *lse = a->t[1], *logits = a->t[2], *tg = a->t[3];
    TSYS_CUDA__REQUIRE(st->ctx, loss && lse && logits && tg, "ce_fwd: loss, lse, logits, targets must be given");
    TSYS_CUDA__REQUIRE(st->ctx, loss->dtype == TSYS_F32 && lse->dtype == TSYS_F32 && tsys_cuda__is_id(tg->dtype), "ce_fwd: loss and lse must be fp32, targets I32/I64");
    int64_t V = tsys_cuda__last_dim(logits), rows = tsys_cuda__rows(logits);
    TSYS_CUDA__REQUIRE(st->ctx, tsys_tensor_numel(tg) == rows && tsys_tensor_numel(lse) == rows, "ce_fwd: %lld rows of logits but %lld targets / %lld lse",
                       (long long)rows, (long long)tsys_tensor_numel(tg), (long long)tsys_tensor_numel(lse));
    TSYS_CUDA__FLOAT_SWITCH(st->ctx, logits->dtype, T,
        TSYS_CUDA__LAUNCH(st, tsys_cuda__ce_lse<T>, (unsigned)rows, tsys_cuda__row_threads(V), 0,
                          (float *)tsys_cuda__data(lse), (const T *)tsys_cuda__data(logits), V);
        TSYS_CUDA__LAUNCH(st, tsys_cuda__ce_loss<T>, 1, 1024, 0, (float *)tsys_cuda__data(loss), (const float *)tsys_cuda__data(lse),
                          (const T *)tsys_cuda__data(logits), (const void *)tsys_cuda__data(tg), (int)tg->dtype, rows, V, st->fault_dev));
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_ce_bwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *dl = a->t[0], *logits = a->t[1], *lse = a->t[2], *tg = a->t[3], *dloss = a->t[4];
    TSYS_CUDA__REQUIRE(st->ctx, dl && logits && lse && tg && dloss, "ce_bwd: dlogits, logits, lse, targets, dloss must be given");
    TSYS_CUDA__REQUIRE(st->ctx, lse->dtype == TSYS_F32 && tsys_cuda__is_id(tg->dtype) && tsys_tensor_numel(dl) == tsys_tensor_numel(logits), "ce_bwd: fp32 lse, I32/I64 targets, dlogits of logits' size");
    int64_t V = tsys_cuda__last_dim(logits), rows = tsys_cuda__rows(logits);
    int threads = tsys_cuda__row_threads(V);
    TSYS_CUDA__FLOAT_SWITCH(st->ctx, logits->dtype, T, TSYS_CUDA__FLOAT_SWITCH(st->ctx, dl->dtype, D,
        TSYS_CUDA__LAUNCH(st, (tsys_cuda__ce_bwd<T, D>), (unsigned)rows, threads, 0,
                          (D *)tsys_cuda__data(dl), (const T *)tsys_cuda__data(logits), (const float *)tsys_cuda__data(lse),
                          (const void *)tsys_cuda__data(tg), (int)tg->dtype, (const void *)tsys_cuda__data(dloss), (int)dloss->dtype, a->f[0], V,
                          st->fault_dev)));
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_mse_fwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *out = a->t[0], *x = a->t[1], *y = a->t[2];
    TSYS_CUDA__REQUIRE(st->ctx, out && x && y && tsys_tensor_numel(x) == tsys_tensor_numel(y), "mse_fwd: out, a, b must be given, a and b the same size");
    int64_t n = tsys_tensor_numel(x);
    tsys_tensor *ins[2] = { x, y };
    return tsys_cuda__reduce<2>(st, tsys_cuda__red_sqdiff{}, tsys_cuda__ew_make(n, 2, ins, 0, NULL), out, n ? 1.0f / (float)n : 0.0f, false);
}

static tsys_status tsys_cuda__k_mse_bwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *da = a->t[0], *db = a->t[1], *x = a->t[2], *y = a->t[3], *dloss = a->t[4];
    TSYS_CUDA__REQUIRE(st->ctx, x && y && dloss && tsys_tensor_numel(x) == tsys_tensor_numel(y), "mse_bwd: a, b, dloss must be given, a and b the same size");
    int64_t n = tsys_tensor_numel(x);
    tsys_tensor *ins[3] = { x, y, dloss }, *outs[2] = { da, db };
    tsys_cuda__ew_args e = tsys_cuda__ew_make(n, 3, ins, 2, outs);
    e.in_mod[2] = 1;   // dloss: one element, read on the device
    return tsys_cuda__ew<3, 2>(st, tsys_cuda__op_mse_bwd{ n ? 2.0f / (float)n : 0.0f }, e);
}

static tsys_status tsys_cuda__k_sum(tsys_cuda__state *st, const tsys_kargs *a, bool squares, bool accumulate) {
    tsys_tensor *out = a->t[0], *x = a->t[1];
    TSYS_CUDA__REQUIRE(st->ctx, out && x, "sum/sumsq: out and x must be given");
    tsys_tensor *ins[1] = { x };
    tsys_cuda__ew_args e = tsys_cuda__ew_make(tsys_tensor_numel(x), 1, ins, 0, NULL);
    if (squares) return tsys_cuda__reduce<1>(st, tsys_cuda__red_sumsq{}, e, out, 1.0f, accumulate);
    return tsys_cuda__reduce<1>(st, tsys_cuda__red_sum{}, e, out, a->f[0], accumulate);
}

static tsys_status tsys_cuda__k_nonfinite(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *flag = a->t[0], *x = a->t[1];
    TSYS_CUDA__REQUIRE(st->ctx, flag && x && flag->dtype == TSYS_F32, "nonfinite: fp32 flag and x must be given");
    int64_t n = tsys_tensor_numel(x);
    TSYS_CUDA__LAUNCH(st, tsys_cuda__nonfinite, tsys_cuda__grid(st, n, 256), 256, 0,
                      (const void *)tsys_cuda__data(x), (int)x->dtype, n, (float *)tsys_cuda__data(flag));
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_embed_fwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *out = a->t[0], *w = a->t[1], *ids = a->t[2];
    TSYS_CUDA__REQUIRE(st->ctx, out && w && ids && tsys_cuda__is_id(ids->dtype), "embed_fwd: out, weight, I32/I64 ids must be given");
    int64_t V = w->ndim ? w->shape[0] : 0, D = tsys_cuda__last_dim(w), N = tsys_tensor_numel(ids);
    TSYS_CUDA__REQUIRE(st->ctx, tsys_tensor_numel(out) == N * D, "embed_fwd: out has %lld elements, expected %lld x %lld", (long long)tsys_tensor_numel(out), (long long)N, (long long)D);
    TSYS_CUDA__LAUNCH(st, tsys_cuda__embed_fwd, (unsigned)N, tsys_cuda__row_threads(D), 0,
                      tsys_cuda__data(out), (int)out->dtype, (const void *)tsys_cuda__data(w), (int)w->dtype,
                      (const void *)tsys_cuda__data(ids), (int)ids->dtype, V, D, st->fault_dev);
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_embed_bwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *dw = a->t[0], *dy = a->t[1], *ids = a->t[2];
    TSYS_CUDA__REQUIRE(st->ctx, dw && dy && ids && dw->dtype == TSYS_F32 && tsys_cuda__is_id(ids->dtype), "embed_bwd: fp32 dW, dy, I32/I64 ids must be given");
    int64_t V = dw->ndim ? dw->shape[0] : 0, D = tsys_cuda__last_dim(dw), N = tsys_tensor_numel(ids);
    TSYS_CUDA__REQUIRE(st->ctx, tsys_tensor_numel(dy) == N * D && N < INT32_MAX && V < INT32_MAX, "embed_bwd: dy has %lld elements, expected %lld x %lld", (long long)tsys_tensor_numel(dy), (long long)N, (long long)D);
    if (N == 0) return TSYS_OK;
    int end_bit = 1;
    while (end_bit < 31 && ((int64_t)1 << end_bit) <= V) end_bit++;   // keys are in [0, V]
    size_t sort_bytes = 0;
    TSYS_CUDA__CHECK(st->ctx, cub::DeviceRadixSort::SortPairs(NULL, sort_bytes, (const int32_t *)NULL, (int32_t *)NULL,
                                                            (const int32_t *)NULL, (int32_t *)NULL, (int)N, 0, end_bit, st->stream));
    size_t arr = ((size_t)N * sizeof(int32_t) + 255) / 256 * 256;
    char *scratch = (char *)tsys_cuda__scratch(st, 4 * arr + sort_bytes);
    if (!scratch) return tsys_ctx_set_error(st->ctx, TSYS_ERR_OOM, "embed_bwd: no memory for sorting %lld ids", (long long)N);
    int32_t *keys_in = (int32_t *)scratch, *pos_in = (int32_t *)(scratch + arr), *keys = (int32_t *)(scratch + 2 * arr), *pos = (int32_t *)(scratch + 3 * arr);
    tsys_status s = [&]() -> tsys_status {
        TSYS_CUDA__LAUNCH(st, tsys_cuda__embed_keys, tsys_cuda__grid(st, N, 256), 256, 0, keys_in, pos_in,
                          (const void *)tsys_cuda__data(ids), (int)ids->dtype, N, V, st->fault_dev);
        TSYS_CUDA__CHECK(st->ctx, cub::DeviceRadixSort::SortPairs((void *)(scratch + 4 * arr), sort_bytes, (const int32_t *)keys_in, keys,
                                                                (const int32_t *)pos_in, pos, (int)N, 0, end_bit, st->stream));
        TSYS_CUDA__LAUNCH(st, tsys_cuda__embed_bwd_runs, (unsigned)N, tsys_cuda__row_threads(D), 0, (float *)tsys_cuda__data(dw),
                          (const void *)tsys_cuda__data(dy), (int)dy->dtype, (const int32_t *)keys, (const int32_t *)pos, N, V, D);
        return TSYS_OK;
    }();
    tsys_cuda__scratch_free(st, scratch);
    return s;
}

static tsys_status tsys_cuda__k_transpose12(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *out = a->t[0], *in = a->t[1];
    TSYS_CUDA__REQUIRE(st->ctx, out && in && out->dtype == in->dtype && in->ndim == 4 && tsys_tensor_numel(out) == tsys_tensor_numel(in),
                       "transpose12: out and a 4-d input of the same dtype and size must be given");
    int64_t A = in->shape[0], B = in->shape[1], C = in->shape[2], D = in->shape[3];
    size_t es = tsys_dtype_size(in->dtype), row = (size_t)D * es;
    void *o = tsys_cuda__data(out);
    const void *i = tsys_cuda__data(in);
    if (row % 16 == 0 && tsys_cuda__aligned16(o) && tsys_cuda__aligned16(i)) return tsys_cuda__transpose12_launch<uint4>(st, o, i, A, B, C, (int64_t)(row / 16));
    if (es == 2) return tsys_cuda__transpose12_launch<uint16_t>(st, o, i, A, B, C, D);
    if (es == 4) return tsys_cuda__transpose12_launch<uint32_t>(st, o, i, A, B, C, D);
    return tsys_cuda__transpose12_launch<uint64_t>(st, o, i, A, B, C, D);
}

// AdamW, with or without the kept low-precision copy of the new p (t[6], tsys_optim_keep_lowp;
// low_dt bf16 or f16, rounded to nearest even as the cast kernel rounds). One kernel for both, and
// one place in it where the update is computed: an element's new p, m and v are the same bits
// whether a copy is written or not, whichever path loads it and wherever it falls in a launch (with
// the copies on, a run of parameters can be cut into more launches: tsys__lowp_run_end). Each thread
// takes groups of four elements: float4 loads and stores when p, g, m, v are 16-byte aligned and the
// group is whole, one 8-byte store of the copies when that is aligned too; else element by element.
// The ranks' gradients of one element as AdamW reads them under tsys_optim_sum_grads: the sum in rank order of
// g (rank `self`'s) and the other ranks' terms (slots `stride` apart), divided by the ranks, spelled as the
// copy-engine all-reduce's average (tsys_dist.h) spells it, so the two give the same bits.
// Gradients are read in the dtype they were kept in (GT: float, or bf16 / f16 under tsys_tensor_set_grad_dtype),
// as fp32: one element (tsys_cuda__tof), or the four of a group (tsys_cuda__g4; the caller checked the alignment).
template <typename GT> struct tsys_cuda__rank_terms { const GT *terms; int64_t stride; int ranks, self; };
template <typename GT> __device__ __forceinline__ float tsys_cuda__rank_mean(const tsys_cuda__rank_terms<GT> &rt, float g, int64_t i) {
    float acc = 0.0f;
    for (int r = 0; r < rt.ranks; r++) acc += r == rt.self ? g : tsys_cuda__tof(rt.terms[(int64_t)(r - (r > rt.self)) * rt.stride + i]);
    return __fdiv_rn(acc, (float)rt.ranks);
}
template <typename GT> __device__ __forceinline__ float4 tsys_cuda__rank_mean4(const tsys_cuda__rank_terms<GT> &rt, float4 g, int64_t i4) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int r = 0; r < rt.ranks; r++) {
        const float4 x = r == rt.self ? g : tsys_cuda__g4(rt.terms + (int64_t)(r - (r > rt.self)) * rt.stride, i4);
        acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
    }
    const float n = (float)rt.ranks;
    return make_float4(__fdiv_rn(acc.x, n), __fdiv_rn(acc.y, n), __fdiv_rn(acc.z, n), __fdiv_rn(acc.w, n));
}
// LOW (the copies' dtype, 0 for none) and VEC are template parameters so the launch without copies
// (or unaligned) carries none of the other's code (registers, branches: the generic version ran ~9%
// slower on the H100).
template <int LOW, bool VEC, int GS, bool SUM, typename GT>
__global__ void tsys_cuda__adamw(tsys_cuda__op_adamw op, float *p, const GT *g, float *m, float *v, uint16_t *low, int64_t n, tsys_cuda__rank_terms<GT> rt) {
    constexpr int NV = GS / 4;   // float4s of each array in a group
    int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    bool low_vec = ((uintptr_t)low & (2 * GS - 1)) == 0;   // the group's copies in one 8- or 16-byte store
    const tsys_cuda__op_adamw::shared sk = op.prep();   // the same bits as per element, once
    for (int64_t q = tid; q < (n + GS - 1) / GS; q += stride) {
        int64_t i0 = GS * q;
        int k = n - i0 < GS ? (int)(n - i0) : GS;   // elements in this group
        bool whole = VEC && k == GS;
        float xs[GS][4], ys[GS][3];
        if (whole) {
#pragma unroll
            for (int u = 0; u < NV; u++) {
                float4 P = ((const float4 *)p)[q * NV + u], G = tsys_cuda__g4(g, q * NV + u), M = ((const float4 *)m)[q * NV + u], V = ((const float4 *)v)[q * NV + u];
                if (SUM) G = tsys_cuda__rank_mean4(rt, G, q * NV + u);
                float *x0 = xs[4 * u], *x1 = xs[4 * u + 1], *x2 = xs[4 * u + 2], *x3 = xs[4 * u + 3];
                x0[0] = P.x; x1[0] = P.y; x2[0] = P.z; x3[0] = P.w;
                x0[1] = G.x; x1[1] = G.y; x2[1] = G.z; x3[1] = G.w;
                x0[2] = M.x; x1[2] = M.y; x2[2] = M.z; x3[2] = M.w;
                x0[3] = V.x; x1[3] = V.y; x2[3] = V.z; x3[3] = V.w;
            }
        } else {
#pragma unroll
            for (int e = 0; e < GS; e++) {
                bool in = e < k;
                const float ge = in ? tsys_cuda__tof(g[i0 + e]) : 0.0f;
                xs[e][0] = in ? p[i0 + e] : 0.0f; xs[e][1] = in ? (SUM ? tsys_cuda__rank_mean(rt, ge, i0 + e) : ge) : 0.0f;
                xs[e][2] = in ? m[i0 + e] : 0.0f; xs[e][3] = in ? v[i0 + e] : 1.0f;
            }
        }
#pragma unroll
        for (int e = 0; e < GS; e++) op.apply(sk, xs[e], ys[e]);   // the only place the update is computed
        uint32_t c[GS / 2];
#pragma unroll
        for (int e = 0; e < GS / 2; e++) c[e] = LOW ? (uint32_t)tsys_cuda__lowp_bits<LOW>(ys[2 * e][0]) | ((uint32_t)tsys_cuda__lowp_bits<LOW>(ys[2 * e + 1][0]) << 16) : 0u;
        if (whole) {
#pragma unroll
            for (int u = 0; u < NV; u++) {
                const int e = 4 * u;
                ((float4 *)p)[q * NV + u] = make_float4(ys[e][0], ys[e + 1][0], ys[e + 2][0], ys[e + 3][0]);
                ((float4 *)m)[q * NV + u] = make_float4(ys[e][1], ys[e + 1][1], ys[e + 2][1], ys[e + 3][1]);
                ((float4 *)v)[q * NV + u] = make_float4(ys[e][2], ys[e + 1][2], ys[e + 2][2], ys[e + 3][2]);
            }
            if (LOW && low_vec && GS == 8) ((uint4 *)low)[q] = make_uint4(c[0], c[1], c[2 % (GS / 2)], c[3 % (GS / 2)]);
            else if (LOW && low_vec) ((uint2 *)low)[q] = make_uint2(c[0], c[1 % (GS / 2)]);
            else if (LOW)
#pragma unroll
                for (int e = 0; e < GS; e++) low[i0 + e] = (uint16_t)(c[e / 2] >> (16 * (e & 1)));
        } else {
#pragma unroll
            for (int e = 0; e < GS; e++) {   // unrolled with a guard: a dynamic index would put ys and c in local memory
                if (e >= k) break;
                p[i0 + e] = ys[e][0]; m[i0 + e] = ys[e][1]; v[i0 + e] = ys[e][2];
                if (LOW) low[i0 + e] = (uint16_t)(c[e / 2] >> (16 * (e & 1)));
            }
        }
    }
}

// One launch over n elements with gradients (and the ranks' terms) of type GT.
template <typename GT> static tsys_status tsys_cuda__adamw_launch(tsys_cuda__state *st, const tsys_kargs *a, const tsys_cuda__op_adamw &op, int64_t n) {
    tsys_tensor *p = a->t[0], *g = a->t[1], *m = a->t[2], *v = a->t[3], *low = a->t[6], *terms = a->t[7];
    float *pp = (float *)tsys_cuda__data(p), *pm = (float *)tsys_cuda__data(m), *pv = (float *)tsys_cuda__data(v);
    const GT *pg = (const GT *)tsys_cuda__data(g);
    tsys_cuda__rank_terms<GT> rt = { (const GT *)tsys_cuda__data(terms), terms ? a->i[0] : 0, terms ? (int)a->i[1] : 1, terms ? (int)a->i[2] : 0 };
    const uintptr_t galign = 4 * sizeof(GT) - 1;   // a group's four gradients in one load
    bool vec = tsys_cuda__aligned16(pp) && ((uintptr_t)pg & galign) == 0 && tsys_cuda__aligned16(pm) && tsys_cuda__aligned16(pv) &&
               (!terms || (((uintptr_t)rt.terms & galign) == 0 && rt.stride % 4 == 0));
    uint16_t *pl = (uint16_t *)tsys_cuda__data(low);
    int ldt = low ? (int)low->dtype : 0;
    // groups of 4 (groups of 8 measured slower: 68 registers, 2095 GB/s against 2584 with copies on
    // the H100; what costs most is local memory, which the kernel must not touch: ptxas -v shows none).
    // With the step's corrections given, one group a thread: the resident blocks then stream one window of
    // the arrays (7% more bandwidth in dev/adamw_lab.cu); without them each thread's two powers in double
    // want the capped grid's loop to spread them over its groups.
    const int64_t groups = (n + 3) / 4, blocks = (groups + 255) / 256;
    const unsigned grid = op.bias && blocks < ((int64_t)1 << 31) ? (unsigned)blocks : tsys_cuda__grid(st, groups, 256);
#define TSYS_CUDA__ADAMW_LAUNCH2(L, S) \
    { constexpr int GS = 4; \
      if (vec) TSYS_CUDA__LAUNCH(st, (tsys_cuda__adamw<L, true, GS, S, GT>), grid, 256, 0, op, pp, pg, pm, pv, pl, n, rt); \
      else TSYS_CUDA__LAUNCH(st, (tsys_cuda__adamw<L, false, GS, S, GT>), grid, 256, 0, op, pp, pg, pm, pv, pl, n, rt); }
#define TSYS_CUDA__ADAMW_LAUNCH(L) { if (terms) TSYS_CUDA__ADAMW_LAUNCH2(L, true) else TSYS_CUDA__ADAMW_LAUNCH2(L, false) }
    if (ldt == TSYS_BF16) { TSYS_CUDA__ADAMW_LAUNCH(TSYS_BF16) }
    else if (ldt == TSYS_F16) { TSYS_CUDA__ADAMW_LAUNCH(TSYS_F16) }
    else { TSYS_CUDA__ADAMW_LAUNCH(0) }
#undef TSYS_CUDA__ADAMW_LAUNCH
#undef TSYS_CUDA__ADAMW_LAUNCH2
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_adamw(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *p = a->t[0], *g = a->t[1], *m = a->t[2], *v = a->t[3], *step = a->t[4], *lr = a->t[5], *low = a->t[6], *terms = a->t[7];
    TSYS_CUDA__REQUIRE(st->ctx, p && g && m && v && step, "adamw: p, g, m, v and the device step must be given");
    int64_t n = tsys_tensor_numel(p);
    TSYS_CUDA__REQUIRE(st->ctx, tsys_tensor_numel(g) == n && tsys_tensor_numel(m) == n && tsys_tensor_numel(v) == n, "adamw: p, g, m, v differ in size");
    TSYS_CUDA__REQUIRE(st->ctx, tsys_cuda__is_id(step->dtype) && (!lr || lr->dtype == TSYS_F32), "adamw: step must be I32/I64, lr (t[5]) fp32");
    tsys_tensor *bias = a->t[8];
    TSYS_CUDA__REQUIRE(st->ctx, !bias || (bias->dtype == TSYS_F32 && tsys_tensor_numel(bias) == 2), "adamw: the bias corrections t[8] must be 2 fp32 elements");
    tsys_cuda__op_adamw op = { a->f[0], a->f[1], a->f[2], a->f[3], a->f[4], tsys_cuda__data(step), (int)step->dtype,
                               (const float *)tsys_cuda__data(lr), (const float *)tsys_cuda__data(bias) };
    TSYS_CUDA__REQUIRE(st->ctx, !low || ((low->dtype == TSYS_BF16 || low->dtype == TSYS_F16) && tsys_tensor_numel(low) == n), "adamw: the copy t[6] must be bf16/f16 of p's size");
    TSYS_CUDA__REQUIRE(st->ctx, !terms || (a->i[1] >= 2 && a->i[2] >= 0 && a->i[2] < a->i[1] && a->i[0] >= n && tsys_tensor_numel(terms) >= (a->i[1] - 2) * a->i[0] + n),
                       "adamw: the terms t[7] do not hold i1 - 1 ranks' slots i0 apart, p's size each");
    TSYS_CUDA__REQUIRE(st->ctx, g->dtype == TSYS_F32 || g->dtype == TSYS_BF16 || g->dtype == TSYS_F16, "adamw: g t[1] must be f32, bf16 or f16");
    TSYS_CUDA__REQUIRE(st->ctx, !terms || terms->dtype == g->dtype, "adamw: the terms t[7] must have g's dtype");
    if (n <= 0) return TSYS_OK;
    if (g->dtype == TSYS_BF16) return tsys_cuda__adamw_launch<__nv_bfloat16>(st, a, op, n);
    if (g->dtype == TSYS_F16) return tsys_cuda__adamw_launch<__half>(st, a, op, n);
    return tsys_cuda__adamw_launch<float>(st, a, op, n);
}

// TSYS_K_LINEAR_ADAMW: the fused kernel (>>fused update) where it runs; elsewhere the two launches it replaces,
// the gradient's product into a tensor of dtype i0 and ADAMW on it.
static tsys_status tsys_cuda__gemm(tsys_ctx *ctx, const tsys_gemm_args *g);
static tsys_status tsys_cuda__k_linear_adamw(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *p = a->t[0], *m = a->t[1], *v = a->t[2], *low = a->t[3], *dy = a->t[4], *x = a->t[5], *step = a->t[6], *lr = a->t[7], *bias = a->t[8];
    TSYS_CUDA__REQUIRE(st->ctx, p && m && v && dy && x && step, "linear_adamw: p, m, v, dy, x and the device step must be given");
    const int64_t n = tsys_tensor_numel(p), d_out = dy->ndim ? dy->shape[dy->ndim - 1] : 1, d_in = x->ndim ? x->shape[x->ndim - 1] : 1;
    const int64_t rows = d_out ? tsys_tensor_numel(dy) / d_out : 0;
    const tsys_dtype gdt = (tsys_dtype)a->i[0];
    TSYS_CUDA__REQUIRE(st->ctx, dy->dtype == x->dtype && tsys_cuda__is_float(x->dtype), "linear_adamw: dy t4 (%s) and x t5 (%s) must share a float dtype",
                       tsys_dtype_name(dy->dtype), tsys_dtype_name(x->dtype));
    TSYS_CUDA__REQUIRE(st->ctx, d_out * d_in == n && rows * d_in == tsys_tensor_numel(x) && tsys_tensor_numel(m) == n && tsys_tensor_numel(v) == n,
                       "linear_adamw: dy (rows, %lld) and x (rows, %lld) do not make p's %lld elements, or m, v differ", (long long)d_out, (long long)d_in, (long long)n);
    TSYS_CUDA__REQUIRE(st->ctx, gdt == TSYS_F32 || gdt == x->dtype, "linear_adamw: the gradient's dtype i0 = %d must be f32 or x's", (int)gdt);
    TSYS_CUDA__REQUIRE(st->ctx, !low || ((low->dtype == TSYS_BF16 || low->dtype == TSYS_F16) && tsys_tensor_numel(low) == n), "linear_adamw: the copy t3 must be bf16/f16 of p's size");
    TSYS_CUDA__REQUIRE(st->ctx, tsys_cuda__is_id(step->dtype) && (!lr || lr->dtype == TSYS_F32) && (!bias || (bias->dtype == TSYS_F32 && tsys_tensor_numel(bias) == 2)),
                       "linear_adamw: step t6 must be I32/I64, lr t7 fp32, the bias corrections t8 2 fp32 elements");
    if (n == 0) return TSYS_OK;
#ifndef TSYS_CUDA_NO_FLASH
    const tsys_cuda__op_adamw op = { a->f[0], a->f[1], a->f[2], a->f[3], a->f[4], tsys_cuda__data(step), (int)step->dtype,
                                     (const float *)tsys_cuda__data(lr), (const float *)tsys_cuda__data(bias) };
    float *pp = (float *)tsys_cuda__data(p), *pm = (float *)tsys_cuda__data(m), *pv = (float *)tsys_cuda__data(v);
    uint16_t *pl = (uint16_t *)tsys_cuda__data(low);
    const int ldt = low ? (int)low->dtype : 0;
    tsys_status ret = TSYS_OK;
    if (x->dtype == TSYS_BF16 && tsys_cuda__linear_adamw_fused(st, op, (const __nv_bfloat16 *)tsys_cuda__data(dy), (const __nv_bfloat16 *)tsys_cuda__data(x),
                                                               pp, pm, pv, pl, ldt, gdt, d_out, d_in, rows, &ret)) return ret;
    if (x->dtype == TSYS_F16 && tsys_cuda__linear_adamw_fused(st, op, (const __half *)tsys_cuda__data(dy), (const __half *)tsys_cuda__data(x),
                                                              pp, pm, pv, pl, ldt, gdt, d_out, d_in, rows, &ret)) return ret;
#endif
    int64_t shape[2] = { d_out, d_in };
    tsys_tensor *g = tsys_tensor_new(st->ctx, gdt, TSYS_CUDA, 2, shape);
    if (!g) return st->ctx->status != TSYS_OK ? st->ctx->status : TSYS_ERR_OOM;
    tsys_gemm_args ga = { dy, x, g, true, false, d_out, d_in, rows, 1, 0, 0, 0, 1.0f, 0.0f, false };
    tsys_status r = tsys_cuda__gemm(st->ctx, &ga);
    if (r == TSYS_OK) {
        tsys_kargs b;
        memset(&b, 0, sizeof b);
        b.t[0] = p; b.t[1] = g; b.t[2] = m; b.t[3] = v; b.t[4] = step; b.t[5] = lr; b.t[6] = low; b.t[8] = bias;
        for (int f = 0; f < 5; f++) b.f[f] = a->f[f];
        r = tsys_cuda__k_adamw(st, &b);
    }
    tsys_tensor_release(g);
    return r;
}

static tsys_status tsys_cuda__k_step_inc(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *t = a->t[0], *bias = a->t[1];
    TSYS_CUDA__REQUIRE(st->ctx, t && tsys_cuda__is_id(t->dtype), "step_inc: an I32/I64 scalar must be given");
    TSYS_CUDA__REQUIRE(st->ctx, !bias || (bias->dtype == TSYS_F32 && tsys_tensor_numel(bias) == 2), "step_inc: t[1] must be 2 fp32 elements");
    TSYS_CUDA__LAUNCH(st, tsys_cuda__step_inc, 1, 1, 0, tsys_cuda__data(t), (int)t->dtype, (float *)tsys_cuda__data(bias), a->f[0], a->f[1]);
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_randn(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *t = a->t[0];
    TSYS_CUDA__REQUIRE(st->ctx, t && tsys_cuda__is_float(t->dtype), "randn: a float tensor must be given");
    int64_t n = tsys_tensor_numel(t);
    TSYS_CUDA__LAUNCH(st, tsys_cuda__randn, tsys_cuda__grid(st, n, 256), 256, 0, tsys_cuda__data(t), (int)t->dtype, n,
                      (uint64_t)a->i[0], a->f[0], a->f[1], a->f[2]);
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_sgd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *p = a->t[0], *g = a->t[1];
    TSYS_CUDA__REQUIRE(st->ctx, p && g && tsys_tensor_numel(p) == tsys_tensor_numel(g), "sgd: p and g of one size must be given");
    tsys_tensor *ins[2] = { p, g }, *outs[1] = { p };
    return tsys_cuda__ew<2, 1>(st, tsys_cuda__op_sgd{ a->f[0] }, tsys_cuda__ew_make(tsys_tensor_numel(p), 2, ins, 1, outs));
}

// Flash attention over (..., N, d) tensors of one dtype, seen as (bh, N, d); L is fp32 (bh, N). The kernels
// are the context's choice of implementation (st->flash_run, see >>init).
#ifndef TSYS_CUDA_NO_FLASH
static tsys_status tsys_cuda__flash_shape(tsys_cuda__state *st, const tsys_tensor *q, int64_t *bh, int64_t *n, int64_t *d) {
    TSYS_CUDA__REQUIRE(st->ctx, q && q->ndim >= 2, "flash: q must be (..., N, d)");
    *d = q->shape[q->ndim - 1]; *n = q->shape[q->ndim - 2];
    *bh = tsys_tensor_numel(q) / (*n * *d);
    TSYS_CUDA__REQUIRE(st->ctx, tsys_cuda__flash_supported(q->dtype, *d), "flash: %s with head dim %lld is not supported (16, 32, 64, 80, 96, 128)",
                       tsys_dtype_name(q->dtype), (long long)*d);
    return TSYS_OK;
}

// The launchers' dtype for a tensor: fp32 goes to the TF32 kernels unless the context asks for exact fp32.
static int tsys_cuda__flash_dtype(const tsys_cuda__state *st, const tsys_tensor *q) {
    return q->dtype == TSYS_F32 && !st->flash_fp32_exact ? TSYS_CUDA__FLASH_TF32 : (int)q->dtype;
}

// cudaErrorNotSupported from the launchers: the WS implementation was asked for and TMA cannot read an input.
static tsys_status tsys_cuda__flash_no_tma(tsys_cuda__state *st, const char *what) {
    return tsys_ctx_set_error(st->ctx, TSYS_ERR_UNSUPPORTED, "%s: flash implementation 'ws' needs inputs TMA can read (each "
                              "16-byte aligned); TSYS_CUDA_FLASH_AUTO falls back to 'wgmma' for such calls", what);
}

static tsys_status tsys_cuda__k_flash_fwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *const *t = a->t;
    int64_t bh, n, d;
    TSYS_CUDA__REQUIRE(st->ctx, t[0] && t[1] && t[2] && t[3] && t[4] && t[1]->dtype == TSYS_F32, "flash_fwd: O, fp32 L, Q, K, V must be given");
    TSYS_CUDA__TRY(tsys_cuda__flash_shape(st, t[2], &bh, &n, &d));
    const int fdt = tsys_cuda__flash_dtype(st, t[2]);
    const size_t scratch_bytes = tsys_cuda__flash_fwd_scratch_bytes(bh, n, d, fdt, a->i[0] != 0, st->flash_run);
    float *scratch = scratch_bytes ? (float *)tsys_cuda__scratch(st, scratch_bytes) : NULL;
    if (scratch_bytes && !scratch)
        return tsys_ctx_set_error(st->ctx, TSYS_ERR_OOM, "flash_fwd: no memory for %.1f MiB of scratch (split shares, padded or rounded copies)",
                                  scratch_bytes / 1048576.0);
    cudaError_t e = tsys_cuda__flash_fwd(tsys_cuda__data(t[2]), tsys_cuda__data(t[3]), tsys_cuda__data(t[4]), tsys_cuda__data(t[0]),
                                         (float *)tsys_cuda__data(t[1]), fdt, bh, n, d, a->f[0], a->i[0] != 0, st->flash_run,
                                         st->stream, scratch);
    if (scratch) tsys_cuda__scratch_free(st, scratch);
    if (e == cudaErrorNotSupported && st->flash_run == TSYS_CUDA_FLASH_WS) return tsys_cuda__flash_no_tma(st, "flash_fwd");
    TSYS_CUDA__CHECK(st->ctx, e);
    return TSYS_OK;
}

static tsys_status tsys_cuda__k_flash_bwd(tsys_cuda__state *st, const tsys_kargs *a) {
    tsys_tensor *const *t = a->t;
    int64_t bh, n, d;
    for (int j = 0; j < 9; j++) TSYS_CUDA__REQUIRE(st->ctx, t[j] != NULL, "flash_bwd: t[%d] is NULL", j);
    TSYS_CUDA__TRY(tsys_cuda__flash_shape(st, t[4], &bh, &n, &d));
    const int fdt = tsys_cuda__flash_dtype(st, t[4]);
    const size_t scratch_bytes = tsys_cuda__flash_bwd_scratch_bytes(bh, n, d, fdt, a->i[0] != 0, st->flash_run);
    float *scratch = (float *)tsys_cuda__scratch(st, scratch_bytes);
    if (!scratch)
        return tsys_ctx_set_error(st->ctx, TSYS_ERR_OOM, "flash_bwd: no memory for %.1f MiB of scratch (row sums, split shares, padded copies)",
                                  scratch_bytes / 1048576.0);
    cudaError_t e = tsys_cuda__flash_bwd(tsys_cuda__data(t[3]), tsys_cuda__data(t[4]), tsys_cuda__data(t[5]), tsys_cuda__data(t[6]),
                                         tsys_cuda__data(t[7]), (const float *)tsys_cuda__data(t[8]), tsys_cuda__data(t[0]),
                                         tsys_cuda__data(t[1]), tsys_cuda__data(t[2]), scratch, fdt, bh, n, d, a->f[0],
                                         a->i[0] != 0, st->flash_run, st->stream,
                                         (st->flash_no_pdl ? TSYS_CUDA__FLASH_NO_PDL : 0u) | (st->flash_no_fused ? TSYS_CUDA__FLASH_NO_FUSED : 0u) |
                                             (st->flash_nondeterministic ? TSYS_CUDA__FLASH_NONDET : 0u));
    tsys_cuda__scratch_free(st, scratch);
    if (e == cudaErrorNotSupported && st->flash_run == TSYS_CUDA_FLASH_WS) return tsys_cuda__flash_no_tma(st, "flash_bwd");
    TSYS_CUDA__CHECK(st->ctx, e);
    return TSYS_OK;
}
#else
static tsys_status tsys_cuda__k_flash_off(tsys_cuda__state *st, const char *what) {
    return tsys_ctx_set_error(st->ctx, TSYS_ERR_UNSUPPORTED, "%s: flash attention was compiled out (TSYS_CUDA_NO_FLASH)", what);
}
static tsys_status tsys_cuda__k_flash_fwd(tsys_cuda__state *st, const tsys_kargs *a) { (void)a; return tsys_cuda__k_flash_off(st, "flash_fwd"); }
static tsys_status tsys_cuda__k_flash_bwd(tsys_cuda__state *st, const tsys_kargs *a) { (void)a; return tsys_cuda__k_flash_off(st, "flash_bwd"); }
#endif // TSYS_CUDA_NO_FLASH

static tsys_status tsys_cuda__kernel(tsys_ctx *ctx, tsys_kernel k, const tsys_kargs *a) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda: backend not initialized (tsys_cuda_init)");
    if ((int)k < 0 || k >= TSYS_K_COUNT || !a) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda: bad kernel id %d", (int)k);
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    switch (k) {
    case TSYS_K_FILL: case TSYS_K_CAST: case TSYS_K_ACCUM: case TSYS_K_ADD: case TSYS_K_MUL: case TSYS_K_SCALE:
    case TSYS_K_ADD_BIAS: case TSYS_K_RELU_FWD: case TSYS_K_RELU_BWD: case TSYS_K_SILU_FWD: case TSYS_K_SILU_BWD:
    case TSYS_K_SWIGLU_FWD: case TSYS_K_BROADCAST: case TSYS_K_SCALE_BY:
        return tsys_cuda__k_elementwise(st, k, a);
    case TSYS_K_SWIGLU_BWD: return tsys_cuda__k_swiglu_bwd(st, a);
    case TSYS_K_BIAS_GRAD: return tsys_cuda__k_bias_grad(st, a);
    case TSYS_K_RMSNORM_FWD: return tsys_cuda__k_rmsnorm_fwd(st, a);
    case TSYS_K_RMSNORM_BWD: return tsys_cuda__k_rmsnorm_bwd(st, a);
    case TSYS_K_LAYERNORM_FWD: return tsys_cuda__k_layernorm_fwd(st, a);
    case TSYS_K_LAYERNORM_BWD: return tsys_cuda__k_layernorm_bwd(st, a);
    case TSYS_K_ROPE: return tsys_cuda__k_rope(st, a);
    case TSYS_K_SOFTMAX_FWD: return tsys_cuda__k_softmax_fwd(st, a);
    case TSYS_K_SOFTMAX_BWD: return tsys_cuda__k_softmax_bwd(st, a);
    case TSYS_K_CE_FWD: return tsys_cuda__k_ce_fwd(st, a);
    case TSYS_K_CE_BWD: return tsys_cuda__k_ce_bwd(st, a);
    case TSYS_K_MSE_FWD: return tsys_cuda__k_mse_fwd(st, a);
    case TSYS_K_MSE_BWD: return tsys_cuda__k_mse_bwd(st, a);
    case TSYS_K_SUM: return tsys_cuda__k_sum(st, a, false, false);
    case TSYS_K_SUMSQ: return tsys_cuda__k_sum(st, a, true, true);
    case TSYS_K_NONFINITE: return tsys_cuda__k_nonfinite(st, a);
    case TSYS_K_EMBED_FWD: return tsys_cuda__k_embed_fwd(st, a);
    case TSYS_K_EMBED_BWD: return tsys_cuda__k_embed_bwd(st, a);
    case TSYS_K_TRANSPOSE12: return tsys_cuda__k_transpose12(st, a);
    case TSYS_K_ADAMW: return tsys_cuda__k_adamw(st, a);
    case TSYS_K_LINEAR_ADAMW: return tsys_cuda__k_linear_adamw(st, a);
    case TSYS_K_STEP_INC: return tsys_cuda__k_step_inc(st, a);
    case TSYS_K_RANDN: return tsys_cuda__k_randn(st, a);
    case TSYS_K_SGD: return tsys_cuda__k_sgd(st, a);
    case TSYS_K_FLASH_FWD: return tsys_cuda__k_flash_fwd(st, a);
    case TSYS_K_FLASH_BWD: return tsys_cuda__k_flash_bwd(st, a);
    default:
        return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "cuda: kernel %s is not implemented on CUDA yet", tsys_kernel_name(k));
    }
}

// >>gemm ------------------------------------------------------------------------------------------
// Row-major C (m x n) = op(A) (m x k) op(B) (k x n) is, read column-major, C^T = op(B)^T op(A)^T: so
// cuBLASLt gets user B as its A and user A as its B, with M = n, N = m, and every row-major matrix
// is its own transpose in column-major with the same leading dimension. Plans (descriptors and the
// heuristic's algorithm) are cached per shape, dtypes, strides and pointer alignment.

static cudaDataType_t tsys_cuda__blas_type(tsys_dtype dt) {
    return dt == TSYS_BF16 ? CUDA_R_16BF : dt == TSYS_F16 ? CUDA_R_16F : CUDA_R_32F;
}

// Largest power of two (<= 256) dividing every batch's start address.
static int tsys_cuda__gemm_align(const void *p, int64_t stride, int64_t batch, size_t es) {
    uint64_t x = (uint64_t)(uintptr_t)p | 256;
    if (batch > 1 && stride) x |= (uint64_t)stride * es;
    return (int)(x & (~x + 1));
}

static void tsys_cuda__plan_destroy(tsys_cuda__gemm_plan *p) {
    if (!p->used) return;
    cublasLtMatrixLayoutDestroy(p->la); cublasLtMatrixLayoutDestroy(p->lb); cublasLtMatrixLayoutDestroy(p->lc);
    cublasLtMatmulDescDestroy(p->op);
    p->used = false;
}

static tsys_status tsys_cuda__layout(tsys_ctx *ctx, cublasLtMatrixLayout_t *l, cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld, int64_t batch, int64_t stride) {
    TSYS_CUDA__CHECK_BLAS(ctx, cublasLtMatrixLayoutCreate(l, t, rows, cols, ld));
    if (batch > 1) {
        int32_t b = (int32_t)batch;
        TSYS_CUDA__CHECK_BLAS(ctx, cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof b));
        TSYS_CUDA__CHECK_BLAS(ctx, cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
    }
    return TSYS_OK;
}

// as_items: the algorithm cuBLASLt picks for one item alone (batch 1), where it runs the batch too: each item
// then gets a single GEMM's bits (the heuristic may pick another tiling for the batch, whose sums can round
// differently). Its status: not SUCCESS (or *found 0) when the batch needs an algorithm of its own.
static cublasStatus_t tsys_cuda__item_algo(tsys_cuda__state *st, const tsys_cuda__gemm_plan *p, const tsys_cuda__gemm_key *key,
                                           cublasLtMatmulPreference_t pref, cublasLtMatmulHeuristicResult_t *res, int *found) {
    // 16-bit operands on tensor cores only, without split-K: these gave the single products' bits in a batch
    // (test_cuda cuda_linears_bits_as_separate); the fp32 kernels did not
    if (key->ab_dt == TSYS_F32) return CUBLAS_STATUS_NOT_SUPPORTED;
    cudaDataType_t ab = tsys_cuda__blas_type((tsys_dtype)key->ab_dt), c = tsys_cuda__blas_type((tsys_dtype)key->c_dt);
    int64_t m = key->m, n = key->n, k = key->k;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasStatus_t s = cublasLtMatrixLayoutCreate(&la, ab, key->trans_b ? k : n, key->trans_b ? n : k, key->trans_b ? k : n);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&lb, ab, key->trans_a ? m : k, key->trans_a ? k : m, key->trans_a ? m : k);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&lc, c, n, m, n);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulAlgoGetHeuristic(st->lt, p->op, la, lb, lc, lc, pref, 1, res, found);
    uint32_t splits = 1;
    size_t got = 0;
    if (s == CUBLAS_STATUS_SUCCESS && *found)
        s = cublasLtMatmulAlgoConfigGetAttribute(&res->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof splits, &got);
    if (s == CUBLAS_STATUS_SUCCESS && *found && splits > 1) s = CUBLAS_STATUS_NOT_SUPPORTED;
    cublasLtMatmulHeuristicResult_t check;
    if (s == CUBLAS_STATUS_SUCCESS && *found) s = cublasLtMatmulAlgoCheck(st->lt, p->op, p->la, p->lb, p->lc, p->lc, &res->algo, &check);
    if (s == CUBLAS_STATUS_SUCCESS && *found && check.workspaceSize > st->workspace_bytes) s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    return s;
}

static tsys_status tsys_cuda__plan_build(tsys_cuda__state *st, tsys_cuda__gemm_plan *p, const tsys_cuda__gemm_key *key) {
    tsys_ctx *ctx = st->ctx;
    memset(p, 0, sizeof *p);
    p->key = *key;
    cudaDataType_t ab = tsys_cuda__blas_type((tsys_dtype)key->ab_dt), c = tsys_cuda__blas_type((tsys_dtype)key->c_dt);
    cublasComputeType_t ct = (key->ab_dt == TSYS_F32 && key->tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    TSYS_CUDA__CHECK_BLAS(ctx, cublasLtMatmulDescCreate(&p->op, ct, CUDA_R_32F));
    p->used = true;   // from here on plan_destroy cleans up whatever exists
    cublasOperation_t opa = key->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;   // Lt's A is the user's B
    cublasOperation_t opb = key->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    TSYS_CUDA__CHECK_BLAS(ctx, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    TSYS_CUDA__CHECK_BLAS(ctx, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    int64_t m = key->m, n = key->n, k = key->k;
    // user B: stored k x n (ld n), or n x k (ld k) when transposed; column-major view swaps the two
    tsys_status s = tsys_cuda__layout(ctx, &p->la, ab, key->trans_b ? k : n, key->trans_b ? n : k, key->trans_b ? k : n, key->batch, key->stride_b);
    if (s == TSYS_OK) s = tsys_cuda__layout(ctx, &p->lb, ab, key->trans_a ? m : k, key->trans_a ? k : m, key->trans_a ? m : k, key->batch, key->stride_a);
    if (s == TSYS_OK) s = tsys_cuda__layout(ctx, &p->lc, c, n, m, n, key->batch, key->stride_c);
    if (s != TSYS_OK) return s;
    cublasLtMatmulPreference_t pref;
    TSYS_CUDA__CHECK_BLAS(ctx, cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = st->workspace_bytes;
    uint32_t al_a = (uint32_t)key->align_b, al_b = (uint32_t)key->align_a, al_c = (uint32_t)key->align_c;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t hs = CUBLAS_STATUS_NOT_SUPPORTED;
    if (key->as_items && key->batch > 1) {
        hs = tsys_cuda__item_algo(st, p, key, pref, &res, &found);
        if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
            cublasLtMatmulPreferenceDestroy(pref);
            p->by_item = true;
            return TSYS_OK;
        }
    } else {
        hs = cublasLtMatmulAlgoGetHeuristic(st->lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (hs != CUBLAS_STATUS_SUCCESS || found == 0)
        return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "cuda gemm: cuBLASLt has no algorithm for %s x %s -> %s, m=%lld n=%lld k=%lld batch=%lld (status %d)",
                                  tsys_dtype_name((tsys_dtype)key->ab_dt), tsys_dtype_name((tsys_dtype)key->ab_dt), tsys_dtype_name((tsys_dtype)key->c_dt),
                                  (long long)m, (long long)n, (long long)k, (long long)key->batch, (int)hs);
    p->algo = res.algo;
    return TSYS_OK;
}

// Looks the plan up in a small open-addressed table (8 probes); on a miss builds it into a free
// probe slot, or evicts the first slot of the window.
static tsys_status tsys_cuda__plan_get(tsys_cuda__state *st, const tsys_cuda__gemm_key *key, tsys_cuda__gemm_plan **out) {
    uint64_t h = 1469598103934665603ull;
    const unsigned char *b = (const unsigned char *)key;
    for (size_t i = 0; i < sizeof *key; i++) { h ^= b[i]; h *= 1099511628211ull; }
    size_t home = (size_t)(h & (TSYS_CUDA_GEMM_CACHE - 1)), slot = home;
    bool have_empty = false;
    for (int probe = 0; probe < 8; probe++) {
        tsys_cuda__gemm_plan *p = &st->plans[(home + probe) & (TSYS_CUDA_GEMM_CACHE - 1)];
        if (p->used && memcmp(&p->key, key, sizeof *key) == 0) { *out = p; return TSYS_OK; }
        if (!p->used && !have_empty) { slot = (home + probe) & (TSYS_CUDA_GEMM_CACHE - 1); have_empty = true; }
    }
    tsys_cuda__gemm_plan *p = &st->plans[slot];
    tsys_cuda__plan_destroy(p);
    tsys_status s = tsys_cuda__plan_build(st, p, key);
    if (s != TSYS_OK) { tsys_cuda__plan_destroy(p); return s; }
    *out = p;
    return TSYS_OK;
}

// g's product on batch items from A, B, C (g's strides apart). as_items where the item's own algorithm cannot
// run the batch (tsys_cuda__item_algo): one product an item, each as a GEMM of its own.
static tsys_status tsys_cuda__gemm_launch(tsys_cuda__state *st, const tsys_gemm_args *g, const void *A, const void *B, void *C, int64_t batch) {
    tsys_ctx *ctx = st->ctx;
    size_t es = tsys_dtype_size(g->a->dtype), esc = tsys_dtype_size(g->c->dtype);
    tsys_cuda__gemm_key key;
    memset(&key, 0, sizeof key);   // padding takes part in the hash
    key.ab_dt = g->a->dtype; key.c_dt = g->c->dtype;
    key.trans_a = g->trans_a; key.trans_b = g->trans_b;
    key.tf32 = st->tf32 && g->a->dtype == TSYS_F32;
    key.m = g->m; key.n = g->n; key.k = g->k; key.batch = batch;
    if (batch > 1) { key.stride_a = g->stride_a; key.stride_b = g->stride_b; key.stride_c = g->stride_c; key.as_items = g->as_items; }
    key.align_a = tsys_cuda__gemm_align(A, g->stride_a, batch, es);
    key.align_b = tsys_cuda__gemm_align(B, g->stride_b, batch, es);
    key.align_c = tsys_cuda__gemm_align(C, g->stride_c, batch, esc);
    tsys_cuda__gemm_plan *p;
    TSYS_CUDA__TRY(tsys_cuda__plan_get(st, &key, &p));
    if (p->by_item) {
        for (int64_t i = 0; i < batch; i++)
            TSYS_CUDA__TRY(tsys_cuda__gemm_launch(st, g, (const char *)A + (size_t)(i * g->stride_a) * es, (const char *)B + (size_t)(i * g->stride_b) * es,
                                                  (char *)C + (size_t)(i * g->stride_c) * esc, 1));
        return TSYS_OK;
    }
    float alpha = g->alpha, beta = g->beta;
    TSYS_CUDA__CHECK_BLAS(ctx, cublasLtMatmul(st->lt, p->op, &alpha, B, p->la, A, p->lb, &beta, C, p->lc, C, p->lc,
                                              &p->algo, st->workspace, st->workspace_bytes, st->stream));
    return TSYS_OK;
}

static tsys_status tsys_cuda__gemm(tsys_ctx *ctx, const tsys_gemm_args *g) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda gemm: backend not initialized");
    TSYS_CUDA__REQUIRE(ctx, g && g->a && g->b && g->c, "gemm: a, b, c must be given");
    TSYS_CUDA__REQUIRE(ctx, g->a->dtype == g->b->dtype && tsys_cuda__is_float(g->a->dtype), "gemm: a (%s) and b (%s) must share a float dtype",
                       tsys_dtype_name(g->a->dtype), tsys_dtype_name(g->b->dtype));
    TSYS_CUDA__REQUIRE(ctx, g->c->dtype == TSYS_F32 || g->c->dtype == g->a->dtype, "gemm: c must be F32 or a's dtype, is %s", tsys_dtype_name(g->c->dtype));
    TSYS_CUDA__REQUIRE(ctx, g->m >= 0 && g->n >= 0 && g->k >= 0 && g->batch >= 1, "gemm: bad sizes m=%lld n=%lld k=%lld batch=%lld",
                       (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->batch);
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    if (g->m == 0 || g->n == 0) return TSYS_OK;
    if (g->k == 0) {   // C = beta C: cuBLASLt wants k >= 1
        tsys_kargs a;
        memset(&a, 0, sizeof a);
        a.t[0] = g->c; a.t[1] = g->c; a.f[0] = g->beta;
        return tsys_cuda__k_elementwise(st, g->beta == 0.0f ? TSYS_K_FILL : TSYS_K_SCALE, &a);
    }
    return tsys_cuda__gemm_launch(st, g, tsys_tensor_data(g->a), tsys_tensor_data(g->b), tsys_tensor_data(g->c), g->batch);
}

// >>copy and sync ---------------------------------------------------------------------------------

// After a synchronization: a bad id some kernel met since the last check becomes the context's error.
static tsys_status tsys_cuda__check_fault(tsys_cuda__state *st) {
    tsys_cuda__fault *f = st->fault;
    if (!f || !f->flag) return TSYS_OK;
    bool embed = f->kernel == TSYS_K_EMBED_FWD || f->kernel == TSYS_K_EMBED_BWD;
    tsys_status s = tsys_ctx_set_error(st->ctx, TSYS_ERR_INVALID_ARGS, "%s (%s on cuda): %s %lld at position %lld is outside [0, %lld); its row was not read or written",
                                       embed ? "embedding" : "cross_entropy", tsys_kernel_name((tsys_kernel)f->kernel), embed ? "token id" : "target",
                                       f->value, f->pos, f->limit);
    memset(f, 0, sizeof(*f));
    return s;
}

static tsys_status tsys_cuda__copy(tsys_ctx *ctx, void *dst, tsys_device dst_dev, const void *src, tsys_device src_dev, size_t bytes) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda copy: backend not initialized");
    if (bytes == 0) return TSYS_OK;
    if (dst_dev == TSYS_CPU && src_dev == TSYS_CPU) { memmove(dst, src, bytes); return TSYS_OK; }
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    if (st->capturing && (dst_dev == TSYS_CPU || src_dev == TSYS_CPU))
        return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda copy: host<->device copies cannot be captured in a CUDA graph; copy inputs before tsys_cuda_graph_replay");
    // Pageable host memory: the async H2D returns once the source is staged, so the caller may reuse
    // it at once; D2H must finish before the host reads, hence the sync.
    TSYS_CUDA__CHECK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st->stream));
    if (dst_dev == TSYS_CPU) {
        TSYS_CUDA__CHECK(ctx, cudaStreamSynchronize(st->stream));
        return tsys_cuda__check_fault(st);
    }
    return TSYS_OK;
}

// ---- copies that overlap the streams' work (asynchronous snapshots) ----
// Page-locked host memory lets a device-to-host copy run on the copy engine while kernels run; the
// copies go on their own stream, so neither the compute nor the side stream (communication) queues
// behind them until a fence makes the compute stream wait (before the library writes what they read).

static void *tsys_cuda__host_alloc(tsys_ctx *ctx, size_t bytes) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    void *p = NULL;
    if (!st || cudaSetDevice(st->device) != cudaSuccess || cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void tsys_cuda__host_free(tsys_ctx *ctx, void *p) {
    (void)ctx;
    if (p && cudaFreeHost(p) != cudaSuccess) (void)cudaGetLastError();
}

static tsys_status tsys_cuda__copy_async(tsys_ctx *ctx, void *dst, tsys_device dst_dev, const void *src, tsys_device src_dev, size_t bytes, tsys_stream s, bool fenced) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    (void)dst_dev; (void)src_dev;
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda copy: backend not initialized");
    if (st->capturing) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda copy: an asynchronous host copy cannot be made while capturing a CUDA graph");
    if ((unsigned)s >= TSYS_STREAM_COUNT) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda copy: no stream %d", (int)s);
    if (bytes == 0) return TSYS_OK;
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    TSYS_CUDA__CHECK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st->streams[s]));
    if (s == TSYS_STREAM_COPY && fenced) st->copies_pending = true;
    return TSYS_OK;
}

// The compute stream waits for the copy stream's work so far (when a fenced copy is there: one that reads
// what the library writes later). Inside a capture nothing is pending:
// tsys_cuda_graph_begin fenced, and no copy can be queued while capturing.
static tsys_status tsys_cuda__copies_fence_st(tsys_cuda__state *st) {
    if (!st->copies_pending || st->capturing) return TSYS_OK;
    tsys_ctx *ctx = st->ctx;
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    if (!st->copies_done) TSYS_CUDA__CHECK(ctx, cudaEventCreateWithFlags(&st->copies_done, cudaEventDisableTiming));
    TSYS_CUDA__CHECK(ctx, cudaEventRecord(st->copies_done, st->streams[TSYS_STREAM_COPY]));
    TSYS_CUDA__CHECK(ctx, cudaStreamWaitEvent(st->streams[TSYS_STREAM_COMPUTE], st->copies_done, 0));
    st->copies_pending = false;
    return TSYS_OK;
}

static tsys_status tsys_cuda__copies_fence(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st ? tsys_cuda__copies_fence_st(st) : TSYS_OK;
}

// Any thread: it touches no context, only the event and the device number.
static tsys_status tsys_cuda__event_host_wait(const tsys_backend *b, const tsys_event *e, char *err, size_t err_len) {
    const tsys_cuda__state *st = (const tsys_cuda__state *)b->state;
    cudaError_t c = e->handle ? cudaSetDevice(st->device) : cudaErrorInvalidResourceHandle;
    if (c == cudaSuccess) c = cudaEventSynchronize((cudaEvent_t)e->handle);
    if (c == cudaSuccess) return TSYS_OK;
    (void)cudaGetLastError();
    snprintf(err, err_len, "CUDA device %d: waiting for the copies to the host: %s", st->device, cudaGetErrorString(c));
    return TSYS_ERR_CUDA;
}

static tsys_status tsys_cuda__sync(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda sync: backend not initialized");
    if (st->capturing) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda sync: not allowed while capturing a CUDA graph");
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    for (int s = 0; s < TSYS_STREAM_COUNT; s++) TSYS_CUDA__CHECK(ctx, cudaStreamSynchronize(st->streams[s]));
    return tsys_cuda__check_fault(st);
}

// >>events ----------------------------------------------------------------------------------------
// tsys_event handles are cudaEvents from a per-context pool (no cudaEventCreate in the steady state).
// Recording and waiting work while a graph is captured (they become graph nodes); elapsed does not.
// The caching allocator is not stream-aware: memory freed while side-stream work may still use it
// must be ordered by an event before the compute stream can be handed it again.

static tsys_status tsys_cuda__event_record(tsys_ctx *ctx, tsys_event *e, tsys_stream s) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda event: backend not initialized");
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    if (!e->handle) {
        cudaEvent_t ev;
        if (st->num_free_events > 0) ev = st->free_events[--st->num_free_events];
        else TSYS_CUDA__CHECK(ctx, cudaEventCreate(&ev));
        e->handle = (void *)ev;
    }
    TSYS_CUDA__CHECK(ctx, cudaEventRecord((cudaEvent_t)e->handle, st->streams[s]));
    return TSYS_OK;
}

static tsys_status tsys_cuda__event_wait(tsys_ctx *ctx, const tsys_event *e, tsys_stream s) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda event: backend not initialized");
    if (!e->handle) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda event wait: the event was never recorded");
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    TSYS_CUDA__CHECK(ctx, cudaStreamWaitEvent(st->streams[s], (cudaEvent_t)e->handle, 0));
    return TSYS_OK;
}

static tsys_status tsys_cuda__event_elapsed(tsys_ctx *ctx, const tsys_event *a, const tsys_event *b, double *ms) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda event: backend not initialized");
    if (!a->handle || !b->handle) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda event elapsed: an event was never recorded");
    if (st->capturing) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "cuda event elapsed: not while capturing a CUDA graph");
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    float f = 0.0f;
    TSYS_CUDA__CHECK(ctx, cudaEventSynchronize((cudaEvent_t)b->handle));
    TSYS_CUDA__CHECK(ctx, cudaEventElapsedTime(&f, (cudaEvent_t)a->handle, (cudaEvent_t)b->handle));
    *ms = f;
    return tsys_cuda__check_fault(st);
}

static void tsys_cuda__event_release(tsys_ctx *ctx, tsys_event *e) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return;   // shut down: the pool (and the event) went with the state
    if (st->num_free_events == st->cap_free_events) {
        int cap = st->cap_free_events ? 2 * st->cap_free_events : 16;
        cudaEvent_t *p = (cudaEvent_t *)TSYS_REALLOC(st->free_events, sizeof(cudaEvent_t) * (size_t)cap);
        if (!p) { cudaEventDestroy((cudaEvent_t)e->handle); return; }
        st->free_events = p; st->cap_free_events = cap;
    }
    st->free_events[st->num_free_events++] = (cudaEvent_t)e->handle;
}

static tsys_stream tsys_cuda__set_stream(tsys_ctx *ctx, tsys_stream s) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return TSYS_STREAM_COMPUTE;
    tsys_stream prev = st->cur_stream;
    st->cur_stream = s;
    st->stream = st->streams[s];
    return prev;
}

// >>init ------------------------------------------------------------------------------------------

// The streams, by priority: a block of the background stream (the optimizer inside backward) is
// scheduled only where no block of the compute or side stream is waiting, so it fills the SMs a GEMM's
// last wave leaves instead of holding SMs the next backward kernel needs. Copies run on the copy
// engines; their stream's priority does not matter.
static tsys_status tsys_cuda__streams_make(tsys_ctx *ctx, tsys_cuda__state *st) {
    int least = 0, greatest = 0;
    TSYS_CUDA__CHECK(ctx, cudaDeviceGetStreamPriorityRange(&least, &greatest));
    TSYS_CUDA__CHECK(ctx, cudaStreamCreateWithPriority(&st->streams[TSYS_STREAM_COMPUTE], cudaStreamNonBlocking, greatest));
    TSYS_CUDA__CHECK(ctx, cudaStreamCreateWithPriority(&st->streams[TSYS_STREAM_SIDE], cudaStreamNonBlocking, greatest));
    TSYS_CUDA__CHECK(ctx, cudaStreamCreateWithPriority(&st->streams[TSYS_STREAM_COPY], cudaStreamNonBlocking, least));
    TSYS_CUDA__CHECK(ctx, cudaStreamCreateWithPriority(&st->streams[TSYS_STREAM_BACKGROUND], cudaStreamNonBlocking, least));
    return TSYS_OK;
}

// What the backend holds for its whole life outside the allocator: the cuBLASLt workspace and the
// reduction partials (counted as workspace in the memory tracker).
// The caching allocator's free blocks: reserved from the device, not handed out (the memory tracker's
// "cached" series, torch's reserved - allocated).
static int64_t tsys_cuda__cached_bytes(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st ? (int64_t)(st->mem.reserved_bytes - st->mem.allocated_bytes) : 0;
}
static size_t tsys_cuda__fixed_workspace(const tsys_cuda__state *st) { return st->workspace_bytes + TSYS_CUDA__MAX_PARTIALS * sizeof(float); }

// the profiler clock (>>profiler clock) that init registers
static void *tsys_cuda__clock_begin(tsys_ctx *ctx);
static void tsys_cuda__clock_launch(void *state, uint64_t seq, bool begin);
static tsys_status tsys_cuda__clock_collect(void *state, void (*put)(void *p, uint64_t seq, double start_us, double dur_us), void *p);
static void tsys_cuda__clock_end(void *state);

static void tsys_cuda__state_free(tsys_cuda__state *st) {
    if (!st) return;
    cudaSetDevice(st->device);
    for (int s = 0; s < TSYS_STREAM_COUNT; s++)
        if (st->streams[s]) cudaStreamSynchronize(st->streams[s]);
    for (int i = 0; i < TSYS_CUDA_GEMM_CACHE; i++) tsys_cuda__plan_destroy(&st->plans[i]);
    for (int i = 0; i < st->num_blocks; i++)
        if (st->blocks[i].alive) cudaFree(st->blocks[i].ptr);
    TSYS_FREE(st->blocks);
    tsys_cuda__map_free(&st->by_ptr);
    tsys_cuda__map_free(&st->free_lists);
    if (st->partials) cudaFree(st->partials);
    if (st->workspace) cudaFree(st->workspace);
    if (st->lt) cublasLtDestroy(st->lt);
    for (int i = 0; i < st->num_free_events; i++) cudaEventDestroy(st->free_events[i]);
    TSYS_FREE(st->free_events);
    if (st->fault) cudaFreeHost(st->fault);
    if (st->copies_done) cudaEventDestroy(st->copies_done);
    for (int s = 0; s < TSYS_STREAM_COUNT; s++)
        if (st->streams[s]) cudaStreamDestroy(st->streams[s]);
    TSYS_FREE(st);
}

TSYSDEF int tsys_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { (void)cudaGetLastError(); return 0; }
    return n;
}

TSYSDEF const char *tsys_cuda_flash_impl_name(tsys_cuda_flash_impl impl) {
    switch (impl) {
    case TSYS_CUDA_FLASH_AUTO: return "auto";
    case TSYS_CUDA_FLASH_WS: return "ws";
    case TSYS_CUDA_FLASH_WGMMA: return "wgmma";
    case TSYS_CUDA_FLASH_MMA: return "mma";
    }
    return "?";
}

// The environment, read here only (by tsys_cuda_init_desc, once), over the caller's desc: every variable is
// listed at the top of this file. TSYS_FLASH_NO_WGMMA / TSYS_FLASH_NO_WS / TSYS_FLASH_NONDETERMINISTIC are on when set to anything but ""
// or "0", and steer desc.flash only when it is AUTO (wg_ok: the wgmma kernels can run here);
// TSYS_NO_CUPTI and TSYS_PROFILER_DEBUG are on when set at all.
static void tsys_cuda__env_apply(tsys_cuda_desc *d, bool wg_ok) {
#ifndef TSYS_CUDA_NO_FLASH
    const char *v;
    if (d->flash == TSYS_CUDA_FLASH_AUTO && (v = getenv("TSYS_FLASH_NO_WGMMA")) && *v && *v != '0') d->flash = TSYS_CUDA_FLASH_MMA;
    else if (d->flash == TSYS_CUDA_FLASH_AUTO && (v = getenv("TSYS_FLASH_NO_WS")) && *v && *v != '0')
        d->flash = wg_ok ? TSYS_CUDA_FLASH_WGMMA : TSYS_CUDA_FLASH_MMA;
    if ((v = getenv("TSYS_FLASH_NONDETERMINISTIC")) && *v && *v != '0') d->flash_nondeterministic = true;
#else
    (void)wg_ok;
#endif
    if (getenv("TSYS_NO_CUPTI")) d->no_cupti = true;
    if (getenv("TSYS_PROFILER_DEBUG")) d->profiler_debug = true;
}

// Why this backend cannot run a flash implementation; NULL when it can.
static const char *tsys_cuda__flash_why_not(const tsys_cuda__state *st, tsys_cuda_flash_impl impl) {
#ifdef TSYS_CUDA_NO_FLASH
    (void)st;
    return impl == TSYS_CUDA_FLASH_AUTO ? NULL : "flash attention was compiled out (TSYS_CUDA_NO_FLASH)";
#else
    if (impl == TSYS_CUDA_FLASH_AUTO || impl == TSYS_CUDA_FLASH_MMA) return NULL;
    if (!st->flash_wg_ok)
        return st->cc_major != 9 ? "the wgmma kernels run on Hopper GPUs (sm_90) only"
                                 : "this binary has no sm_90a code (build with -gencode arch=compute_90a,code=sm_90a)";
    if (impl == TSYS_CUDA_FLASH_WS && !st->flash_ws_ok) return "the driver offers no TMA tensor maps (cuTensorMapEncodeTiled)";
    return NULL;
#endif
}

// Sets the implementation (one this backend can run) and what the launchers get for it: AUTO becomes
// WGMMA when TMA is missing and MMA when wgmma is, so the launchers never see a choice they cannot run.
static void tsys_cuda__flash_use(tsys_cuda__state *st, tsys_cuda_flash_impl impl) {
    st->flash = impl;
    st->flash_run = impl != TSYS_CUDA_FLASH_AUTO ? impl
                    : !st->flash_wg_ok ? TSYS_CUDA_FLASH_MMA : st->flash_ws_ok ? TSYS_CUDA_FLASH_AUTO : TSYS_CUDA_FLASH_WGMMA;
}

// The flash request checked against the backend: bad enum values and implementations it cannot run are errors.
static tsys_status tsys_cuda__flash_check(tsys_cuda__state *st, const char *who, const char *what, tsys_cuda_flash_impl impl) {
    if ((unsigned)impl > (unsigned)TSYS_CUDA_FLASH_MMA)
        return tsys_ctx_set_error(st->ctx, TSYS_ERR_INVALID_ARGS, "%s: %s = %d is not a tsys_cuda_flash_impl (0 auto, 1 ws, 2 wgmma, 3 mma)",
                                  who, what, (int)impl);
    const char *why = tsys_cuda__flash_why_not(st, impl);
    if (why)
        return tsys_ctx_set_error(st->ctx, TSYS_ERR_UNSUPPORTED, "%s: %s = '%s' cannot run on device %d (%s, sm_%d%d): %s", who, what,
                                  tsys_cuda_flash_impl_name(impl), st->device, st->device_name, st->cc_major, st->cc_minor, why);
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_cuda_init_desc(tsys_ctx *ctx, const tsys_cuda_desc *desc) {
    if (!ctx) return TSYS_ERR_INVALID_ARGS;
    tsys_cuda_desc d;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    if (tsys_cuda__get(ctx)) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_init: the context already has a CUDA backend");
    int count = tsys_cuda_device_count();
    if (count == 0) return tsys_ctx_set_error(ctx, TSYS_ERR_CUDA, "tsys_cuda_init: desc.device = %d, but no CUDA device is present (or no driver)", d.device);
    if (d.device < 0 || d.device >= count)
        return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_init: desc.device = %d, but %d CUDA device(s) are present (ids 0..%d)",
                                  d.device, count, count - 1);
    if ((unsigned)d.flash > (unsigned)TSYS_CUDA_FLASH_MMA)
        return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_init: desc.flash = %d is not a tsys_cuda_flash_impl (0 auto, 1 ws, 2 wgmma, 3 mma)",
                                  (int)d.flash);
    tsys_cuda__state *st = (tsys_cuda__state *)TSYS_MALLOC(sizeof *st);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_cuda_init: no host memory for the backend state");
    memset(st, 0, sizeof *st);
    st->ctx = ctx; st->device = d.device; st->free_slots = -1; st->next_pool = 1;
    st->tf32 = d.tf32; st->memory_limit = d.memory_limit; st->flash_fp32_exact = d.flash_fp32_exact;
    st->flash_no_pdl = d.flash_no_pdl; st->flash_no_fused = d.flash_no_fused; st->flash_nondeterministic = d.flash_nondeterministic;
    tsys_status s = [&]() -> tsys_status {
        TSYS_CUDA__CHECK(ctx, cudaSetDevice(d.device));
        cudaDeviceProp prop;
        TSYS_CUDA__CHECK(ctx, cudaGetDeviceProperties(&prop, d.device));
        st->num_sms = prop.multiProcessorCount;
        st->cc_major = prop.major; st->cc_minor = prop.minor;
        snprintf(st->device_name, sizeof st->device_name, "%s", prop.name);
#ifndef TSYS_CUDA_NO_FLASH
        st->flash_wg_ok = tsys_cuda__flash_wg_probe();
        st->flash_ws_ok = st->flash_wg_ok && tsys_cuda__flash_tmap_encoder() != NULL;
#endif
        // the environment (comparisons of one binary without rebuilding); read here, once
        tsys_cuda__env_apply(&d, st->flash_wg_ok);
        st->no_cupti = d.no_cupti; st->profiler_debug = d.profiler_debug;
        TSYS_CUDA__TRY(tsys_cuda__flash_check(st, "tsys_cuda_init", "desc.flash", d.flash));
        tsys_cuda__flash_use(st, d.flash);
        TSYS_CUDA__TRY(tsys_cuda__streams_make(ctx, st));
        st->stream = st->streams[TSYS_STREAM_COMPUTE];
        TSYS_CUDA__CHECK(ctx, cudaHostAlloc((void **)&st->fault, sizeof(tsys_cuda__fault), cudaHostAllocMapped));
        memset(st->fault, 0, sizeof(tsys_cuda__fault));
        TSYS_CUDA__CHECK(ctx, cudaHostGetDevicePointer((void **)&st->fault_dev, st->fault, 0));
        TSYS_CUDA__CHECK_BLAS(ctx, cublasLtCreate(&st->lt));
        st->workspace_bytes = d.workspace_bytes ? d.workspace_bytes : TSYS_CUDA_WORKSPACE_BYTES;
        TSYS_CUDA__CHECK(ctx, cudaMalloc(&st->workspace, st->workspace_bytes));
        TSYS_CUDA__CHECK(ctx, cudaMalloc((void **)&st->partials, TSYS_CUDA__MAX_PARTIALS * sizeof(float)));
        return TSYS_OK;
    }();
    if (s != TSYS_OK) { tsys_cuda__state_free(st); return s; }
    tsys_backend *b = &st->backend;
    b->name = "cuda";
    b->alloc = tsys_cuda__alloc;
    b->free = tsys_cuda__free;
    b->copy = tsys_cuda__copy;
    b->gemm = tsys_cuda__gemm;
    b->kernel = tsys_cuda__kernel;
    b->sync = tsys_cuda__sync;
    b->state = st;
    b->destroy = tsys_cuda_shutdown;
    b->event_record = tsys_cuda__event_record;
    b->event_wait = tsys_cuda__event_wait;
    b->event_elapsed = tsys_cuda__event_elapsed;
    b->event_release = tsys_cuda__event_release;
    b->set_stream = tsys_cuda__set_stream;
    b->cached_bytes = tsys_cuda__cached_bytes;
    b->host_alloc = tsys_cuda__host_alloc;
    b->host_free = tsys_cuda__host_free;
    b->copy_async = tsys_cuda__copy_async;
    b->copies_fence = tsys_cuda__copies_fence;
    b->event_host_wait = tsys_cuda__event_host_wait;
    tsys_ctx_set_backend(ctx, TSYS_CUDA, b);
    tsys_profiler_device_clock clock = { tsys_cuda__clock_begin, tsys_cuda__clock_launch, tsys_cuda__clock_collect, tsys_cuda__clock_end };
    tsys_profiler_set_device_clock(ctx, TSYS_CUDA, &clock);
    tsys_mem_note_external(ctx, TSYS_CUDA, TSYS_MEM_WORKSPACE, (int64_t)tsys_cuda__fixed_workspace(st));
    return d.nvtx ? tsys_cuda_set_nvtx(ctx, true) : TSYS_OK;
}

TSYSDEF tsys_status tsys_cuda_init(tsys_ctx *ctx, int device_id) {
    tsys_cuda_desc d;
    memset(&d, 0, sizeof d);
    d.device = device_id;
    return tsys_cuda_init_desc(ctx, &d);
}

TSYSDEF tsys_cuda_desc tsys_cuda_get_desc(tsys_ctx *ctx) {
    tsys_cuda_desc d;
    memset(&d, 0, sizeof d);
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return d;
    d.device = st->device;
#ifdef TSYS_CUDA_NO_FLASH
    d.flash = st->flash;
#else
    d.flash = st->flash_run == TSYS_CUDA_FLASH_AUTO ? TSYS_CUDA_FLASH_WS : st->flash_run;
#endif
    d.tf32 = st->tf32;
    d.flash_fp32_exact = st->flash_fp32_exact;
    d.workspace_bytes = st->workspace_bytes;
    d.memory_limit = st->memory_limit;
    d.nvtx = st->nvtx_on;
    d.flash_no_pdl = st->flash_no_pdl;
    d.flash_no_fused = st->flash_no_fused;
    d.flash_nondeterministic = st->flash_nondeterministic;
    d.no_cupti = st->no_cupti;
    d.profiler_debug = st->profiler_debug;
    return d;
}

TSYSDEF tsys_status tsys_cuda_set_flash_impl(tsys_ctx *ctx, tsys_cuda_flash_impl impl) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_set_flash_impl: backend not initialized (tsys_cuda_init)");
    TSYS_CUDA__TRY(tsys_cuda__flash_check(st, "tsys_cuda_set_flash_impl", "impl", impl));
    tsys_cuda__flash_use(st, impl);
    return TSYS_OK;
}

// What a context keeps after tsys_cuda_shutdown: the same entry points with no state, so a CUDA
// tensor released later (by tsys_ctx_free's tape cleanup, say) is a no-op instead of a crash, and
// every other call reports "backend not initialized". Immutable, so no hidden global state.
static const tsys_backend tsys_cuda__closed_backend = {
    "cuda (shut down)", tsys_cuda__alloc, tsys_cuda__free, tsys_cuda__copy, tsys_cuda__gemm, tsys_cuda__kernel, tsys_cuda__sync, NULL, NULL,
    tsys_cuda__event_record, tsys_cuda__event_wait, tsys_cuda__event_elapsed, tsys_cuda__event_release, tsys_cuda__set_stream,
};

TSYSDEF void tsys_cuda_shutdown(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return;
    tsys_cuda_set_nvtx(ctx, false);
#ifndef TSYS_CUDA_NO_NVTX
    tsys_cuda__nvtx_names_free(st->nvtx_names);
    st->nvtx_names = NULL;
#endif
    tsys_profiler_set_device_clock(ctx, TSYS_CUDA, NULL);
    tsys_mem_note_external(ctx, TSYS_CUDA, TSYS_MEM_WORKSPACE, -(int64_t)tsys_cuda__fixed_workspace(st));
    tsys_ctx_set_backend(ctx, TSYS_CUDA, &tsys_cuda__closed_backend);
    tsys_cuda__state_free(st);   // cudaFree's every block, live ones too
}

TSYSDEF const char *tsys_cuda_device_name(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st ? st->device_name : "";
}

TSYSDEF void *tsys_cuda_stream(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st ? (void *)st->stream : NULL;
}

TSYSDEF void *tsys_cuda_stream_of(tsys_ctx *ctx, tsys_stream s) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st && (unsigned)s < TSYS_STREAM_COUNT ? (void *)st->streams[s] : NULL;
}

TSYSDEF void tsys_cuda_set_tf32(tsys_ctx *ctx, bool on) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (st) st->tf32 = on;   // part of the plan key: no need to flush the plan cache
}
TSYSDEF void tsys_cuda_set_flash_fp32_exact(tsys_ctx *ctx, bool on) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (st) st->flash_fp32_exact = on;   // read at each launch
}

TSYSDEF void tsys_cuda_set_flash_no_pdl(tsys_ctx *ctx, bool on) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (st) st->flash_no_pdl = on;
}

TSYSDEF void tsys_cuda_set_flash_no_fused(tsys_ctx *ctx, bool on) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (st) st->flash_no_fused = on;
}

TSYSDEF void tsys_cuda_set_flash_nondeterministic(tsys_ctx *ctx, bool on) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (st) st->flash_nondeterministic = on;
}

TSYSDEF bool tsys_cuda_tf32(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st && st->tf32;
}

// >>memory (public) -------------------------------------------------------------------------------

TSYSDEF size_t tsys_cuda_mem_reserved(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st ? st->mem.reserved_bytes : 0;
}

TSYSDEF size_t tsys_cuda_mem_allocated(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st ? st->mem.allocated_bytes : 0;
}

TSYSDEF tsys_cuda_mem_info tsys_cuda_mem_info_get(tsys_ctx *ctx) {
    tsys_cuda_mem_info m;
    memset(&m, 0, sizeof m);
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return m;
    m = st->mem;
    m.cached_bytes = m.reserved_bytes - m.allocated_bytes;
    return m;
}

TSYSDEF tsys_status tsys_cuda_empty_cache(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return TSYS_OK;
    if (st->capturing) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_empty_cache: not allowed while capturing a CUDA graph");
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    TSYS_CUDA__CHECK(ctx, cudaStreamSynchronize(st->stream));
    tsys_cuda__release_cached(st, 0);
    return TSYS_OK;
}

TSYSDEF void tsys_cuda_set_memory_limit(tsys_ctx *ctx, size_t bytes) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (st) st->memory_limit = bytes;
}

// >>graphs ----------------------------------------------------------------------------------------

TSYSDEF bool tsys_cuda_capturing(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st && st->capturing;
}

TSYSDEF tsys_status tsys_cuda_graph_begin(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_graph_begin: backend not initialized");
    if (st->capturing) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_graph_begin: already capturing");
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    // thread-local mode: this thread's unsafe calls (a sync, a pageable copy) fail loudly instead of
    // silently breaking the capture; other threads are unaffected
    if (st->cur_stream != TSYS_STREAM_COMPUTE)
        return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_graph_begin: capture starts on the compute stream (the side stream joins through events)");
    TSYS_CUDA__TRY(tsys_cuda__copies_fence_st(st));   // the captured step may write what pending copies read
    TSYS_CUDA__CHECK(ctx, cudaStreamBeginCapture(st->stream, cudaStreamCaptureModeThreadLocal));
    st->capturing = true;
    st->capture_pool = st->next_pool++;
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_cuda_graph_end(tsys_ctx *ctx, tsys_cuda_graph **out) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (out) *out = NULL;
    if (!st || !st->capturing) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_graph_end: not capturing");
    st->capturing = false;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(st->streams[TSYS_STREAM_COMPUTE], &graph);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (graph) cudaGraphDestroy(graph);
        return tsys_ctx_set_error(ctx, TSYS_ERR_CUDA, "tsys_cuda_graph_end: cudaStreamEndCapture: %s (was something captured that cannot be, e.g. a sync?)", cudaGetErrorString(e));
    }
    tsys_cuda_graph *g = (tsys_cuda_graph *)TSYS_MALLOC(sizeof *g);
    if (!g) { cudaGraphDestroy(graph); return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_cuda_graph_end: no host memory"); }
    memset(g, 0, sizeof *g);
    g->st = st; g->graph = graph; g->pool = st->capture_pool;
    // the captured kernels keep their streams' priorities: the background stream's stay below the others'
    e = cudaGraphInstantiate(&g->exec, graph, cudaGraphInstantiateFlagUseNodePriority);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        cudaGraphDestroy(graph); TSYS_FREE(g);
        return tsys_ctx_set_error(ctx, TSYS_ERR_CUDA, "tsys_cuda_graph_end: cudaGraphInstantiate: %s", cudaGetErrorString(e));
    }
    if (out) *out = g; else tsys_cuda_graph_free(g);
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_cuda_graph_replay(tsys_ctx *ctx, tsys_cuda_graph *g) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st || !g || g->st != st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_graph_replay: no graph, or a graph of another context");
    TSYS_CUDA__TRY(tsys_cuda__enter(st));
    TSYS_CUDA__TRY(tsys_cuda__copies_fence_st(st));   // the replay may write what pending copies read
    TSYS_CUDA__CHECK(ctx, cudaGraphLaunch(g->exec, st->streams[TSYS_STREAM_COMPUTE]));
    return TSYS_OK;
}

// Destroys the graph and gives its private pool back to general use: blocks still in use become
// ordinary blocks, cached ones join the general free lists.
TSYSDEF void tsys_cuda_graph_free(tsys_cuda_graph *g) {
    if (!g) return;
    tsys_cuda__state *st = g->st;
    cudaSetDevice(st->device);
    cudaStreamSynchronize(st->streams[TSYS_STREAM_COMPUTE]);   // a replay may still be running
    cudaGraphExecDestroy(g->exec);
    cudaGraphDestroy(g->graph);
    for (int i = 0; i < st->num_blocks; i++) {
        tsys_cuda__block *b = &st->blocks[i];
        if (!b->alive || b->pool != g->pool) continue;
        if (b->in_use) { b->pool = 0; continue; }
        // unlink from the pool's list by rebuilding: pop everything of this class and pool
        int bi;
        while ((bi = tsys_cuda__free_list_pop(st, g->pool, b->size)) >= 0) {
            st->blocks[bi].pool = 0;
            tsys_cuda__free_list_push(st, bi);
        }
    }
    TSYS_FREE(g);
}

// >>nvtx ------------------------------------------------------------------------------------------
// NVTX ranges are a client of tsys.h's trace hooks: every op, backward node and named range becomes
// a range nsys shows on the CPU and GPU timelines. The hooks chain to whatever was installed before.
// The ranges live in an NVTX domain "tsys" (nsys groups them under it, apart from the user's own),
// and their names are registered strings: a tool sees a handle per name instead of copying the text
// on every push. Each context registers a name once, by content (a range's name may be a temporary
// string); past half of TSYS_CUDA__NVTX_SLOTS names, the rest go as plain ASCII messages.

#ifndef TSYS_CUDA_NO_NVTX
// The "tsys" domain: created once per process (a C++ function-local static is initialized exactly
// once, even from several threads) and never changed after.
static nvtxDomainHandle_t tsys_cuda__nvtx_domain(void) {
    static const nvtxDomainHandle_t dom = nvtxDomainCreateA("tsys");
    return dom;
}

// A context's registered names: open addressing on the name's FNV-1a hash, at most half full, so
// a push costs one hash and a probe or two. Owned by the context's backend state (no lock: a context
// is used by one thread at a time), freed at shutdown.
#define TSYS_CUDA__NVTX_SLOTS 2048   // a power of two
struct tsys_cuda__nvtx_names {
    char *text[TSYS_CUDA__NVTX_SLOTS];
    nvtxStringHandle_t handle[TSYS_CUDA__NVTX_SLOTS];
    int used;
};

static uint32_t tsys_cuda__nvtx_hash(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

// name's registered string (NULL when the table is half full or out of memory: the caller then
// sends the name as plain text).
static nvtxStringHandle_t tsys_cuda__nvtx_string_for(tsys_cuda__nvtx_names *names, const char *name) {
    if (!names) return NULL;
    uint32_t i = tsys_cuda__nvtx_hash(name) & (TSYS_CUDA__NVTX_SLOTS - 1);
    for (; names->text[i]; i = (i + 1) & (TSYS_CUDA__NVTX_SLOTS - 1))
        if (strcmp(names->text[i], name) == 0) return names->handle[i];
    if (2 * names->used >= TSYS_CUDA__NVTX_SLOTS) return NULL;
    size_t n = strlen(name) + 1;
    char *copy = (char *)TSYS_MALLOC(n);
    if (!copy) return NULL;
    memcpy(copy, name, n);
    names->text[i] = copy;
    names->handle[i] = nvtxDomainRegisterStringA(tsys_cuda__nvtx_domain(), copy);
    names->used++;
    return names->handle[i];
}

static void tsys_cuda__nvtx_names_free(tsys_cuda__nvtx_names *names) {
    if (!names) return;
    for (int i = 0; i < TSYS_CUDA__NVTX_SLOTS; i++) TSYS_FREE(names->text[i]);
    TSYS_FREE(names);
}

// A range in the "tsys" domain named by a registered string when names has room, else by the text.
static void tsys_cuda__nvtx_push(tsys_cuda__nvtx_names *names, const char *name) {
    if (!name) name = "?";
    nvtxStringHandle_t h = tsys_cuda__nvtx_string_for(names, name);
    nvtxEventAttributes_t a;
    memset(&a, 0, sizeof(a));
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    if (h) { a.messageType = NVTX_MESSAGE_TYPE_REGISTERED; a.message.registered = h; }
    else { a.messageType = NVTX_MESSAGE_TYPE_ASCII; a.message.ascii = name; }
    nvtxDomainRangePushEx(tsys_cuda__nvtx_domain(), &a);
}
#endif

// The user's own ranges: no context, so the name goes as text (the ops' ranges are registered).
TSYSDEF void tsys_cuda_range_push(const char *name) {
#ifndef TSYS_CUDA_NO_NVTX
    tsys_cuda__nvtx_push(NULL, name);
#else
    (void)name;
#endif
}

TSYSDEF void tsys_cuda_range_pop(void) {
#ifndef TSYS_CUDA_NO_NVTX
    nvtxDomainRangePop(tsys_cuda__nvtx_domain());
#endif
}

static void tsys_cuda__nvtx_begin(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    const tsys_trace_hooks *prev = &((tsys_cuda__state *)user)->nvtx_prev;
    char buf[96];
    if (kind == TSYS_TRACE_BACKWARD) snprintf(buf, sizeof buf, "%s (backward)", name);
#ifndef TSYS_CUDA_NO_NVTX
    tsys_cuda__nvtx_push(((tsys_cuda__state *)user)->nvtx_names, kind == TSYS_TRACE_BACKWARD ? buf : name);
#endif
    if (prev->op_begin) prev->op_begin(ctx, name, kind, prev->user);
}
static void tsys_cuda__nvtx_end(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    const tsys_trace_hooks *prev = &((tsys_cuda__state *)user)->nvtx_prev;
    if (prev->op_end) prev->op_end(ctx, name, kind, prev->user);
    tsys_cuda_range_pop();
}
static void tsys_cuda__nvtx_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    const tsys_trace_hooks *prev = &((tsys_cuda__state *)user)->nvtx_prev;
    if (prev->kernel) prev->kernel(ctx, k, prev->user);
}
static void tsys_cuda__nvtx_kernel_begin(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    const tsys_trace_hooks *prev = &((tsys_cuda__state *)user)->nvtx_prev;
    if (prev->kernel_begin) prev->kernel_begin(ctx, k, prev->user);
}
static void tsys_cuda__nvtx_mem(tsys_ctx *ctx, const tsys_mem_event *e, void *user) {
    const tsys_trace_hooks *prev = &((tsys_cuda__state *)user)->nvtx_prev;
    if (prev->mem) prev->mem(ctx, e, prev->user);
}

TSYSDEF tsys_status tsys_cuda_set_nvtx(tsys_ctx *ctx, bool on) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    if (!st) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_cuda_set_nvtx: backend not initialized");
    if (on == st->nvtx_on) return TSYS_OK;
    if (on) {
#ifndef TSYS_CUDA_NO_NVTX
        // no room for the table: the ranges still come, named by text
        if (!st->nvtx_names && (st->nvtx_names = (tsys_cuda__nvtx_names *)TSYS_MALLOC(sizeof(tsys_cuda__nvtx_names))))
            memset(st->nvtx_names, 0, sizeof(tsys_cuda__nvtx_names));
#endif
        tsys_trace_hooks h = { tsys_cuda__nvtx_begin, tsys_cuda__nvtx_end, tsys_cuda__nvtx_kernel, tsys_cuda__nvtx_mem, st, tsys_cuda__nvtx_kernel_begin };
        st->nvtx_prev = tsys_ctx_set_trace_hooks(ctx, &h);
    } else {
        tsys_ctx_set_trace_hooks(ctx, &st->nvtx_prev);   // gives back what was there before
    }
    st->nvtx_on = on;
    return TSYS_OK;
}

TSYSDEF bool tsys_cuda_nvtx(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    return st && st->nvtx_on;
}

// >>profiler clock --------------------------------------------------------------------------------
// Device times for tsys.h's profiler. CUPTI's activity API (what torch.profiler's Kineto uses) gives
// every kernel's start and end; each tsys launch pushes its sequence number as an external
// correlation id, so kernels map back to the op and phase that launched them. libcupti is loaded at
// run time (dlopen), so binaries do not need it; without it (or when another profiler holds CUPTI,
// which is process-wide) the clock falls back to a pair of cudaEvents around each launch.
// TSYS_CUDA_NO_CUPTI leaves CUPTI out.

typedef struct tsys_cuda__kernel_time { uint64_t seq; float ms; cudaEvent_t a, b; } tsys_cuda__kernel_time;

#ifndef TSYS_CUDA_NO_CUPTI
#include <dlfcn.h>
#include <stddef.h>
#include <cupti.h>

typedef struct tsys_cuda__cupti_api {
    void *lib;
    CUptiResult (*enable)(CUpti_ActivityKind);
    CUptiResult (*disable)(CUpti_ActivityKind);
    CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
    CUptiResult (*flush_all)(uint32_t);
    CUptiResult (*next_record)(uint8_t *, size_t, CUpti_Activity **);
    CUptiResult (*push_ext)(CUpti_ExternalCorrelationKind, uint64_t);
    CUptiResult (*pop_ext)(CUpti_ExternalCorrelationKind, uint64_t *);
    CUptiResult (*timestamp)(uint64_t *);
} tsys_cuda__cupti_api;

// Kernel records: CUPTI fills the buffers with its newest layout (CUpti_ActivityKernel10 in CUDA 13,
// 9 in 12.x, ...), whose names change from one CUDA to the next. Only kind, start, end and
// correlationId are read, and they have sat at the same offsets since CUpti_ActivityKernel3 (CUDA
// 6.5), the oldest layout that is read here; the asserts hold the header to those offsets. External
// correlation ids need CUPTI from CUDA 9.0 (API version 10).
#if !defined(CUPTI_API_VERSION) || CUPTI_API_VERSION < 10
#error "tsys_cuda.cuh: the CUPTI kernel timer needs CUPTI from CUDA 9.0 or newer (or define TSYS_CUDA_NO_CUPTI)"
#endif
typedef CUpti_ActivityKernel3 tsys_cuda__cupti_kernel;
static_assert(offsetof(tsys_cuda__cupti_kernel, kind) == 0 && offsetof(tsys_cuda__cupti_kernel, start) == 16 &&
              offsetof(tsys_cuda__cupti_kernel, end) == 24 && offsetof(tsys_cuda__cupti_kernel, correlationId) == 92,
              "CUpti_ActivityKernel3 no longer matches the offsets every newer kernel record keeps");

typedef struct tsys_cuda__cupti_rec { uint32_t corr; uint64_t start, end; } tsys_cuda__cupti_rec;
typedef struct tsys_cuda__cupti_ext { uint32_t corr; uint64_t seq; } tsys_cuda__cupti_ext;
#endif

typedef struct tsys_cuda__clock {
    tsys_cuda__state *st;
    bool cupti;
    double host_minus_gpu_us;                  // CUPTI timestamps to the host clock
    tsys_cuda__kernel_time *times; size_t num_times, cap_times;   // the event fallback
#ifndef TSYS_CUDA_NO_CUPTI
    tsys_cuda__cupti_api api;
    tsys_cuda__cupti_rec *recs; size_t num_recs, cap_recs;
    tsys_cuda__cupti_ext *exts; size_t num_exts, cap_exts;
#endif
} tsys_cuda__clock;

static bool tsys_cuda__grow(void **arr, size_t *cap, size_t len, size_t elem) {
    if (len < *cap) return true;
    size_t c = *cap ? 2 * *cap : 4096;
    void *a = TSYS_REALLOC(*arr, c * elem);
    if (!a) return false;
    *arr = a; *cap = c;
    return true;
}

#ifndef TSYS_CUDA_NO_CUPTI
// CUPTI delivers buffers to process-wide callbacks: the one clock that holds CUPTI receives them.
static tsys_cuda__clock *tsys_cuda__cupti_owner;

static void CUPTIAPI tsys_cuda__cupti_buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *size = (size_t)8 << 20;
    *buffer = (uint8_t *)TSYS_MALLOC(*size);   // malloc's alignment covers CUPTI's 8 bytes
    if (!*buffer) *size = 0;
    *max_records = 0;
}

static void CUPTIAPI tsys_cuda__cupti_buffer_completed(CUcontext c, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)c; (void)stream; (void)size;
    tsys_cuda__clock *k = tsys_cuda__cupti_owner;
    CUpti_Activity *rec = NULL;
    while (k && k->api.next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const tsys_cuda__cupti_kernel *r = (const tsys_cuda__cupti_kernel *)rec;
            if (tsys_cuda__grow((void **)&k->recs, &k->cap_recs, k->num_recs, sizeof(*k->recs))) {
                tsys_cuda__cupti_rec *o = &k->recs[k->num_recs++];
                o->corr = r->correlationId; o->start = r->start; o->end = r->end;
            }
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) {
            const CUpti_ActivityExternalCorrelation *r = (const CUpti_ActivityExternalCorrelation *)rec;
            if (r->externalKind == CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0 && tsys_cuda__grow((void **)&k->exts, &k->cap_exts, k->num_exts, sizeof(*k->exts))) {
                k->exts[k->num_exts].corr = r->correlationId; k->exts[k->num_exts].seq = r->externalId; k->num_exts++;
            }
        }
    }
    TSYS_FREE(buffer);
}

static bool tsys_cuda__cupti_load(tsys_cuda__cupti_api *a) {
    memset(a, 0, sizeof(*a));
    const char *names[] = {"libcupti.so", "libcupti.so.13", "libcupti.so.12", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so", "/usr/local/cuda/lib64/libcupti.so"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !a->lib; i++) a->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!a->lib) return false;
#define TSYS_CUDA__SYM(field, sym) *(void **)&a->field = dlsym(a->lib, sym)
    TSYS_CUDA__SYM(enable, "cuptiActivityEnable"); TSYS_CUDA__SYM(disable, "cuptiActivityDisable");
    TSYS_CUDA__SYM(register_callbacks, "cuptiActivityRegisterCallbacks"); TSYS_CUDA__SYM(flush_all, "cuptiActivityFlushAll");
    TSYS_CUDA__SYM(next_record, "cuptiActivityGetNextRecord"); TSYS_CUDA__SYM(push_ext, "cuptiActivityPushExternalCorrelationId");
    TSYS_CUDA__SYM(pop_ext, "cuptiActivityPopExternalCorrelationId"); TSYS_CUDA__SYM(timestamp, "cuptiGetTimestamp");
#undef TSYS_CUDA__SYM
    if (a->enable && a->disable && a->register_callbacks && a->flush_all && a->next_record && a->push_ext && a->pop_ext && a->timestamp) return true;
    dlclose(a->lib);
    a->lib = NULL;
    return false;
}

static bool tsys_cuda__cupti_start(tsys_cuda__clock *k) {
    if (tsys_cuda__cupti_owner || k->st->no_cupti || !tsys_cuda__cupti_load(&k->api)) return false;
    tsys_cuda__cupti_owner = k;
    uint64_t ts = 0;
    bool ok = k->api.register_callbacks(tsys_cuda__cupti_buffer_requested, tsys_cuda__cupti_buffer_completed) == CUPTI_SUCCESS &&
              k->api.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) == CUPTI_SUCCESS &&
              k->api.enable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) == CUPTI_SUCCESS &&
              // external ids attach to API records: without these kinds CUPTI emits no correlation
              k->api.enable(CUPTI_ACTIVITY_KIND_RUNTIME) == CUPTI_SUCCESS && k->api.enable(CUPTI_ACTIVITY_KIND_DRIVER) == CUPTI_SUCCESS &&
              k->api.timestamp(&ts) == CUPTI_SUCCESS;
    k->host_minus_gpu_us = tsys_time_us() - (double)ts * 1e-3;
    if (!ok) { tsys_cuda__cupti_owner = NULL; dlclose(k->api.lib); k->api.lib = NULL; }
    return ok;
}
#endif

static void *tsys_cuda__clock_begin(tsys_ctx *ctx) {
    tsys_cuda__state *st = tsys_cuda__get(ctx);
    tsys_cuda__clock *k = st ? (tsys_cuda__clock *)TSYS_MALLOC(sizeof(tsys_cuda__clock)) : NULL;
    if (!k) return NULL;
    memset(k, 0, sizeof(*k));
    k->st = st;
#ifndef TSYS_CUDA_NO_CUPTI
    k->cupti = tsys_cuda__cupti_start(k);
#endif
    return k;
}

static void tsys_cuda__clock_launch(void *state, uint64_t seq, bool begin) {
    tsys_cuda__clock *k = (tsys_cuda__clock *)state;
    if (!k) return;
#ifndef TSYS_CUDA_NO_CUPTI
    if (k->cupti) {
        uint64_t last;
        if (begin) k->api.push_ext(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, seq);
        else k->api.pop_ext(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, &last);
        return;
    }
#endif
    if (k->st->capturing) return;   // captured launches run later, in a replay
    if (begin) {
        if (!tsys_cuda__grow((void **)&k->times, &k->cap_times, k->num_times, sizeof(*k->times))) return;
        tsys_cuda__kernel_time *t = &k->times[k->num_times];
        t->seq = seq; t->ms = -1.0f;
        if (cudaEventCreate(&t->a) != cudaSuccess) { (void)cudaGetLastError(); return; }
        if (cudaEventCreate(&t->b) != cudaSuccess) { (void)cudaGetLastError(); cudaEventDestroy(t->a); return; }
        cudaEventRecord(t->a, k->st->stream);
        k->num_times++;
    } else if (k->num_times && k->times[k->num_times - 1].seq == seq) {
        cudaEventRecord(k->times[k->num_times - 1].b, k->st->stream);
    }
}

static tsys_status tsys_cuda__clock_collect(void *state, void (*put)(void *p, uint64_t seq, double start_us, double dur_us), void *p) {
    tsys_cuda__clock *k = (tsys_cuda__clock *)state;
    if (!k) return TSYS_OK;
#ifndef TSYS_CUDA_NO_CUPTI
    if (k->cupti) {
        k->api.flush_all(1);   // CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        // external ids by correlation id: sort, then look each kernel up
        tsys_cuda__cupti_ext *e = k->exts;
        size_t n = k->num_exts;
        qsort(e, n, sizeof(*e), [](const void *x, const void *y) -> int {
            uint32_t a = ((const tsys_cuda__cupti_ext *)x)->corr, b = ((const tsys_cuda__cupti_ext *)y)->corr;
            return (a > b) - (a < b);
        });
        size_t mapped = 0;
        for (size_t i = 0; i < k->num_recs; i++) {
            size_t lo = 0, hi = n;
            while (lo < hi) { size_t mid = (lo + hi) / 2; if (e[mid].corr < k->recs[i].corr) lo = mid + 1; else hi = mid; }
            if (lo == n || e[lo].corr != k->recs[i].corr) continue;   // a kernel tsys did not launch (a graph replay, say)
            put(p, e[lo].seq, (double)k->recs[i].start * 1e-3 + k->host_minus_gpu_us, (double)(k->recs[i].end - k->recs[i].start) * 1e-3);
            mapped++;
        }
        if (k->st->profiler_debug)
            fprintf(stderr, "tsys profiler: cupti gave %zu kernel records and %zu external ids; %zu kernels mapped to launches\n", k->num_recs, n, mapped);
        return TSYS_OK;
    }
#endif
    for (size_t i = 0; i < k->num_times; i++) {
        tsys_cuda__kernel_time *t = &k->times[i];
        float ms = 0;
        if (cudaEventElapsedTime(&ms, t->a, t->b) != cudaSuccess) { (void)cudaGetLastError(); continue; }
        put(p, t->seq, -1.0, (double)ms * 1e3);
    }
    return TSYS_OK;
}

static void tsys_cuda__clock_end(void *state) {
    tsys_cuda__clock *k = (tsys_cuda__clock *)state;
    if (!k) return;
#ifndef TSYS_CUDA_NO_CUPTI
    if (k->cupti) {
        k->api.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
        k->api.disable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION);
        k->api.disable(CUPTI_ACTIVITY_KIND_RUNTIME);
        k->api.disable(CUPTI_ACTIVITY_KIND_DRIVER);
        k->api.flush_all(1);
        tsys_cuda__cupti_owner = NULL;
    }
    TSYS_FREE(k->recs); TSYS_FREE(k->exts);
#endif
    for (size_t i = 0; i < k->num_times; i++) { cudaEventDestroy(k->times[i].a); cudaEventDestroy(k->times[i].b); }
    TSYS_FREE(k->times);
    TSYS_FREE(k);
}

// Whether profiles of this context get their kernel times from CUPTI (else from events).
TSYSDEF bool tsys_cuda_cupti_available(void) {
#ifndef TSYS_CUDA_NO_CUPTI
    tsys_cuda__cupti_api a;
    if (!tsys_cuda__cupti_load(&a)) return false;
    dlclose(a.lib);
    return true;
#else
    return false;
#endif
}

#endif // TSYS_CUDA_IMPLEMENTATION_INCLUDED
#endif // TSYS_CUDA_IMPLEMENTATION
