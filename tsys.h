/* tsys.h - v0.4 - training and measuring Transformer language models in C (CPU reference backend)

   Do this:
      #define TSYS_IMPLEMENTATION
   before you include this file in *one* C or C++ file to create the implementation.

      #include ...
      #define TSYS_IMPLEMENTATION
      #include "tsys.h"

   Optional defines (before the include, in the implementation file):
      TSYS_STATIC          make every function static (private to one translation unit)
      TSYS_MALLOC/TSYS_FREE/TSYS_REALLOC   host allocator (all three or none)
      TSYS_ASSERT(c)       assertion for programmer errors (default: assert)
      TSYS_NO_CBLAS        plain C loops instead of CBLAS for matmuls (slow; for odd machines)
      TSYS_NO_OPENMP       no OpenMP pragmas
      TSYS_DEBUG           1 (default unless NDEBUG): every kernel launch is checked against the
                           TSYS_KERNELS contract table (slot count, NULLs, dtypes, device)

   tsys DOES NOT:
      - call exit() or abort() on bad input or out-of-memory: functions return a tsys_status
        (or NULL) and leave a message in the context (tsys_ctx_last_error)
      - keep hidden global state: everything lives in a tsys_ctx; two contexts coexist
      - support non-contiguous tensors: every tensor is row-major contiguous; views are reshapes
        and leading-dimension slices that share storage

   Quick start (CPU):

      tsys_ctx *ctx = tsys_ctx_new(NULL);
      tsys_model_desc d = tsys_model_desc_defaults(NULL);         // or tsys_model_desc_preset
      d.d_model = 64; d.num_layers = 2; d.num_heads = 4; d.d_ff = 128; d.context_length = 32;
      tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 1234);
      tsys_optim *opt = tsys_adamw_new(ctx, tsys_model_params(m), tsys_model_num_tensors(m), NULL);
      tsys_tensor *ids = ..., *targets = ...;                    // (B, T) I32/I64 tensors
      tsys_tensor *logits = tsys_model_forward(m, ids);
      tsys_tensor *loss = tsys_cross_entropy(ctx, logits, targets);   // or tsys_model_loss(m, ids, targets):
      tsys_backward(ctx, loss);                                       // d.fused_loss = true never makes the logits
      tsys_optim_step(opt);  tsys_optim_zero_grad(opt);
      tsys_tensor_release(logits); tsys_tensor_release(loss);
      if (tsys_ctx_status(ctx) != TSYS_OK) puts(tsys_ctx_last_error(ctx));

   ON ERRORS
      Ops return a new tensor or NULL. A NULL input makes an op return NULL without touching the
      error already recorded, so a whole forward pass can be written without checks and tested once
      at the end with tsys_ctx_status(). tsys_ctx_clear_error() resets the sticky error.
      Misuse of the API is an error too, never a crash or corrupted memory: a NULL context, object,
      name or path (a NULL context has nowhere to keep a message: the function returns NULL or
      TSYS_ERR_INVALID_ARGS), a device outside tsys_device, a tensor of another context, a storage
      resized under its tensors, bad optimizer hyper-parameters. Tensors may outlive their context
      (see tsys_ctx_free).
      Ops that index by tensor values (embedding ids, cross-entropy targets) reject a value outside
      [0, rows) naming the op, the value, its position and the range, and write nothing. On the CPU
      the op fails at once; on CUDA the kernels skip the value and the error is raised at the next
      synchronization (tsys_sync, a read to the host), so the check costs no sync per op.

   ON MEMORY
      Every byte of tensor storage, on every device, goes through one allocator that reports to the
      context's memory tracker: live bytes, peak bytes, bytes per tag (the op or phase that asked) and,
      when enabled, a timeline of events. CPU storage respects a budget (tsys_ctx_desc.cpu_memory_limit,
      by default the memory the machine has available, or less: the room left under the process's
      memory cgroup, a container's or a Slurm job's), so running out is TSYS_ERR_OOM rather than the
      kernel's OOM killer. Tensors are refcounted; an op's result is owned by the caller
      (release it); the autograd tape holds what backward needs and lets go of it node by node.

   ON AUTOGRAD
      Every op with an input that requires grad appends a node to the context's tape. tsys_backward()
      walks the tape in reverse, accumulates gradients (parameters: into .grad, fp32), releases each
      node's saved tensors as soon as the node is done, and fires a parameter's gradient-ready hooks
      (several may be added; they run in order) the moment its last use on the tape has been processed;
      backward hooks (tsys_ctx_add_backward_hook) run once the whole backward is done.
      tsys_no_grad_begin/end brackets regions that record nothing.

   ON CHECKPOINTING
      tsys_checkpoint_begin/end bracket a region whose ops keep only the region's inputs for backward;
      backward recomputes the region when it reaches it (regions nest). Gradients and hooks are those
      of the run without regions, bit for bit. The model takes a policy (tsys_model_desc.checkpoint:
      blocks:K, sqrt, nested, selective, P+keep-attn, auto:BYTES), and tsys_checkpoint_plan_make
      predicts what a policy keeps, its peak and its recomputation (>>checkpoint, >>checkpoint
      planner). tsys_checkpoint_begin_ex's flags keep autocast weight copies or attention's output.

   ON TRAINING STATE
      tsys_state_save/load snapshot what a run needs to resume bit for bit (the parameters, AdamW's
      moments and step count, the loss scaler, the context's RNG, a user record) as a directory of
      safetensors files and a checksummed MANIFEST, written so that a crash leaves the previous
      snapshot or the new one whole (>>state; docs/design/state.md). Not activation checkpointing.
      Sharded snapshots (tsys_dist.h's ZeRO-1 and FSDP) are made of chunks of global tensors, one part
      per process, and read back by ranges on any world size; tsys_state_consolidate makes one plain.

   ON INSTRUMENTATION
      One place sees everything: tsys_ctx_set_trace_hooks installs {op_begin, op_end, kernel, mem}
      callbacks that every forward op, every backward node, every named range (tsys_trace_begin/end),
      every kernel and GEMM launch and every allocation pass through; profilers, NVTX ranges and
      memory timelines are clients. With no hooks installed the cost is a branch. Backends also
      offer events and a second stream (tsys_event_record/wait/elapsed_ms, tsys_set_stream): timing
      is one code on the CPU (the host clock) and on CUDA (cudaEvents).

   ON KERNELS
      tsys_kernel is generated from one table, TSYS_KERNELS(X): each kernel's name, argument slots
      (count, which may be NULL, the dtypes each takes) and which slots it writes. Backends implement
      every row; under TSYS_DEBUG each launch is checked against it.

   ON PRECISION
      tsys_autocast_begin(ctx, TSYS_BF16 or TSYS_F16) makes matmul-class ops (linear, matmul/bmm,
      attention matmuls) round their inputs to the low precision, accumulate in fp32 and round the
      output; norms, softmax, losses and reductions compute in fp32. Parameters and gradients stay
      fp32; tsys_model_set_grad_dtype(m, TSYS_BF16) keeps the linear weights' gradients in bf16, as
      the weight-gradient matmul writes them and torch's autocast rounds them (AdamW reads them; one
      gradient a backward). tsys_grad_scaler gives fp16 dynamic loss scaling with torch GradScaler semantics.
      A weight is cast once per autocast region; tsys_optim_keep_lowp(opt, TSYS_BF16) instead has
      AdamW write each parameter's bf16 (or fp16) copy in its update kernel, kept across steps, so a
      training step casts no weight (2 bytes a parameter; bitwise the same training). A copy counts
      while its parameter's storage is at the version it was made from: every write tsys sees bumps
      it (kernels, copies, fills, loads, resizes, collectives); after writing through
      tsys_tensor_data yourself, call tsys_tensor_mark_written.

   TAG INDEX (search the file for ">>tag"; docs/design/contributing.md says where new code goes)
      declarations (always compiled)
      >>structs              tsys_status, tsys_dtype, tsys_device, tsys_tensor, tsys_ctx_desc, memory
                             stats and events, TSYS_KERNELS (the kernel contract) and tsys_kernel,
                             tsys_kargs, tsys_gemm_args, tsys_backend, events, trace hooks
      >>public               every TSYSDEF declaration: context, tensors, autograd, checkpointing,
                             autocast, ops, model, checkpoint plans, optimizers, loss scaling, bench,
                             atomic files, profiler, memory snapshots, safetensors
      implementation (TSYS_IMPLEMENTATION)
      >>config               libc includes, TSYS_MALLOC/FREE/REALLOC, TSYS_ASSERT, TSYS__OMP,
                             TSYS_DEBUG, TSYS__FAIL / TSYS__REQUIRE / TSYS__CHECK_ARG
      >>structs (private)    tsys__op (autograd op ids), saved-slot indices, tsys__node, tsys__region,
                             the memory tracker, struct tsys_ctx
      >>logging / errors     tsys__fail, tsys_ctx_set_error, status strings, device/ownership checks
      >>dtypes               bf16/f16 conversions, tsys__load/tsys__store/tsys__load_id, the
                             counter-based normal hash (shared with CUDA)
      >>memory               memory tags, categories, tracker, events; storages (new, release, resize)
      >>tensors              tensor create/wrap/view/copy/cast/fill, refcounts
      >>rng                  xoshiro256** context RNG; tensor randn, trunc_normal, randint
      >>cpu kernels          fp32 views (tsys__fin/fout/fdone) and the CPU math of norms, rope,
                             softmax, cross-entropy, AdamW, transpose12
      >>cpu flash            FlashAttention-2 forward/backward on the CPU (the tiled fp32 reference)
      >>kernel contract      TSYS_KERNELS as data: tsys_kernel_name, written slots, tsys__kargs_check
      >>cpu kernel entry points  tsys__cpu_k_<name> (one per kernel id) and the tsys__cpu_kernels
                             table; tsys__cpu_kernel dispatches through it
      >>cpu backend          CPU gemm (CBLAS or loops), alloc/free/copy, events, tsys__cpu_backend
      >>launch               tsys__launch: ownership, contract check, version bumps, kernel hooks
      >>context              CPU memory budget (cgroups), tsys_ctx_new/free, backends, tsys_sync
      >>events               tsys_event_record/wait/elapsed_ms, tsys_set_stream
      >>trace                trace hooks, named ranges, op begin/end
      >>autograd             no_grad, grad hooks, tape recording (tsys__record), gradient homes,
                             tsys_backward
      >>autocast             autocast regions, low-precision weight cache and kept copies, promotion
      >>ops                  forward ops (tsys_linear ... tsys_mean): input checks, launches, records
      >>backward             tsys__node_backward: one case per tsys__op
      >>checkpoint           tsys_checkpoint_begin/end, what nodes keep, region recomputation
      >>model                presets, desc validation, parameters, tsys_model_forward, memory predict
      >>checkpoint planner   policy parsing, tsys_checkpoint_plan_make, auto:BYTES search
      >>optimizer            AdamW/SGD, overlapped updates, kept low-precision copies, grad zero/
                             clip/release, cosine LR
      >>loss scaling         tsys_grad_scaler (fp16 dynamic loss scaling)
      >>bench                tsys_stats_of, tsys_cpu_sgemm_gflops
      >>gemm rate            tsys_gemm_rate: the measured rate of the GEMM path, with its spread
      >>atomic files         tsys_atomic_file: write to a temporary, fsync, rename
      >>profiler             tsys_profiler: per-op and per-kernel tables, Chrome trace
      >>memory snapshot      tsys_mem_snapshot: the allocations as torch.cuda.memory._snapshot()'s
                             pickle (pytorch.org/memory_viz), with op, region and phase frames
      >>safetensors          safetensors parser and writer, tsys_model_save/load
      >>state                training-state snapshots: CRC-32C, manifest, atomic snapshot
                             directories, tsys_state_save/load/latest; sharded snapshots' building
                             blocks (chunks, parts, commit, range reads), tsys_state_consolidate

   Revision history:
      0.4  the CPU backend has one entry point per kernel (tsys__cpu_k_<name>, found through
           tsys__cpu_kernels) as the CUDA backend does; a tag index of the sections above
      0.3  errors, not corruption, on API misuse (mixed contexts, shrunk storages, NULLs, devices, bad
           optimizer settings); tsys_model_load strict (tsys_model_load_ex to relax); tsys_atomic_file;
           linear-time safetensors names; the CPU budget bounded by memory cgroups
      0.2  the kernel contract table, trace hooks and ranges, events and streams, several gradient-ready
           hooks per tensor and backward hooks, a CPU memory budget, id checks in embedding/cross-entropy
      0.1  first release: CPU backend, autograd, cs336 Transformer LM, AdamW/SGD, autocast,
           safetensors I/O

   License: MIT, see the end of the file.
*/
#ifndef TSYS_H_INCLUDED
#define TSYS_H_INCLUDED
#define TSYS_VERSION_MAJOR 0
#define TSYS_VERSION_MINOR 4
#define TSYS_VERSION_PATCH 0

#if (defined(TSYS_IMPLEMENTATION) || defined(TSYS_IMPL)) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L   // the implementation's clock_gettime, before the first libc header
#endif
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdio.h>                // FILE, for the profiler's tables

#ifdef TSYS_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define TSYSDEF static __attribute__((unused))   // a program uses a few functions of the library
#else
#define TSYSDEF static
#endif
#else
#define TSYSDEF extern
#endif

#ifdef __cplusplus
extern "C" {
#endif

// >>structs ---------------------------------------------------------------------------------------

#define TSYS_RESULTS(X) \
    X(TSYS_OK, 0, "ok") \
    X(TSYS_ERR_INVALID_ARGS, -1, "invalid argument") \
    X(TSYS_ERR_OOM, -2, "out of memory") \
    X(TSYS_ERR_CUDA, -3, "CUDA error") \
    X(TSYS_ERR_NCCL, -4, "NCCL error") \
    X(TSYS_ERR_IO, -5, "I/O error") \
    X(TSYS_ERR_UNSUPPORTED, -6, "unsupported")

typedef enum tsys_status {
#define TSYS__X(name, value, text) name = value,
    TSYS_RESULTS(TSYS__X)
#undef TSYS__X
} tsys_status;

typedef enum tsys_dtype { TSYS_F32, TSYS_BF16, TSYS_F16, TSYS_I32, TSYS_I64, TSYS_DTYPE_COUNT } tsys_dtype;
typedef enum tsys_device { TSYS_CPU, TSYS_CUDA, TSYS_DEVICE_COUNT } tsys_device;

#define TSYS_MAX_DIMS 4
#define TSYS_NAME_LEN 64

typedef struct tsys_ctx tsys_ctx;
typedef struct tsys_tensor tsys_tensor;
typedef struct tsys__node tsys__node;
typedef struct tsys__grad_home tsys__grad_home;

// What an allocation holds. Storage starts in the category the context is set to when it is made
// (tsys_mem_set_category; the library sets it for parameters, gradients and optimizer state) and a
// temporary moves to "activations" when the autograd tape saves it for backward. Backends count
// their own scratch and library workspaces (cuBLAS) as workspace.
#define TSYS_MEM_CATEGORIES(X) \
    X(PARAMETERS, "parameters") \
    X(GRADIENTS, "gradients") \
    X(OPTIMIZER, "optimizer state") \
    X(ACTIVATIONS, "activations") \
    X(TEMPORARY, "temporaries") \
    X(WORKSPACE, "workspace")
typedef enum tsys_mem_category {
#define TSYS__X(e, name) TSYS_MEM_##e,
    TSYS_MEM_CATEGORIES(TSYS__X)
#undef TSYS__X
    TSYS_MEM_CATEGORY_COUNT
} tsys_mem_category;

// Refcounted block of bytes on one device. Tensors are windows into a storage.
typedef struct tsys_storage {
    tsys_ctx *ctx;
    tsys_device device;
    void *data;
    size_t bytes;
    int refcount;
    int tag;             // index into the tracker's tag table at allocation time
    tsys_mem_category category;
    int saved_by;        // tape nodes that keep it for backward (a temporary is an activation meanwhile)
    uint64_t id;         // serial number, the id of its memory events
    uint64_t version;    // bumped by every write of its bytes that tsys sees (kernels, GEMMs, copies, fills,
                         // resizes, loads, collectives, tsys_tensor_mark_written): a kept low-precision
                         // copy of a parameter is valid only at the version it was made from
    bool external;       // memory tsys did not allocate (tsys_tensor_wrap): given back through release, if any
    void (*release)(void *user, void *data, size_t bytes);
    void *release_user;
    size_t extent;       // the most bytes from data any tensor on it has reached (its own, views, rebinds): a
                         // resize keeps at least this many (or frees the memory, 0), never cuts under a tensor
    struct tsys__stale *stale;   // parameters out of date here (tsys_params_mark_stale), n_stale of them
    int n_stale;
} tsys_storage;

typedef void (*tsys_grad_hook_fn)(tsys_ctx *ctx, tsys_tensor *param, void *user_data);

struct tsys_tensor {
    tsys_dtype dtype;
    tsys_device device;
    int ndim;
    int64_t shape[TSYS_MAX_DIMS];
    tsys_storage *storage;
    size_t offset;               // bytes from storage->data to element 0
    int refcount;
    bool requires_grad;          // leaf that wants .grad, or result of a recorded op
    tsys_tensor *grad;           // leaves only (parameters); same shape, fp32 for fp32 params
    tsys_dtype grad_lowp;        // leaves: bf16/f16 when .grad is kept in it (tsys_tensor_set_grad_dtype); F32: the leaf's dtype
    tsys__node *grad_fn;         // the tape node that produced this tensor (weak)
    int tape_uses;               // leaves: uses on the tape not yet processed by backward
    bool grad_touched;           // leaves: received a gradient in the backward now running
    bool grad_zero;              // leaves: .grad holds stale bytes that count as zero (tsys_optim_zero_grad);
                                 // the next gradient overwrites instead of adding, saving a fill and a read
    struct tsys__grad_hook *hooks;   // leaves: fired in order once .grad is final for this backward
    struct tsys__grad_home *grad_home;   // leaves: the block .grad is carved from when backward first needs it
    tsys_tensor *lowp;           // parameters: the kept bf16/fp16 copy autocast reads (tsys_optim_keep_lowp), or NULL
    uint64_t lowp_of, lowp_version;   // the storage id and version lowp was made from (0: not made yet)
    char name[TSYS_NAME_LEN];
};

// Context creation. All fields 0 = default.
//   cpu_memory_limit   bytes of live CPU tensor storage past which allocation fails (TSYS_ERR_OOM);
//                      0 = the memory the machine has available when the context is made (Linux:
//                      MemAvailable of /proc/meminfo, or less: the room left under the memory cgroups
//                      holding the process, v1 or v2; unlimited where none can be read); SIZE_MAX = unlimited.
//                      Without a budget Linux overcommits and its OOM killer ends the process instead.
//   record_events      keep the allocation timeline (tsys_mem_events)
//   seed               0 = 0x5eed
typedef struct tsys_ctx_desc {
    size_t cpu_memory_limit;
    bool record_events;
    uint64_t seed;
} tsys_ctx_desc;

// One entry of the memory timeline. A temporary saved for backward shows as two events of the same
// time and opposite deltas (-bytes temporaries, +bytes activations): live does not change.
// What an event records: an allocation, a free, or a move between categories (a temporary saved for
// backward becomes an activation: two MOVE events of the same time, -bytes from, +bytes to).
typedef enum tsys_mem_action { TSYS_MEM_EV_ALLOC, TSYS_MEM_EV_FREE, TSYS_MEM_EV_MOVE } tsys_mem_action;

// An allocation and its free carry the same id (a storage's serial number; 0 for memory a backend
// notes itself, such as library workspaces); the allocation also carries the shape and dtype of the
// tensor it was made for (ndim -1 when it was not made for one).
typedef struct tsys_mem_event {
    double t_us;          // microseconds since the context was created (tsys_ctx_time_us)
    int64_t delta;        // +bytes on allocation, -bytes on free
    int64_t live;         // live bytes on that device after the event
    int64_t cached;       // bytes the device's allocator holds beyond those in use (0 on the CPU)
    uint64_t id;
    int tag;
    tsys_device device;
    tsys_mem_category category;
    tsys_mem_action action;
    tsys_dtype dtype;
    int ndim;
    int64_t shape[TSYS_MAX_DIMS];
} tsys_mem_event;

// Memory tracker totals for one device.
typedef struct tsys_mem_stats {
    int64_t live_bytes;
    int64_t peak_bytes;
    int64_t num_allocs;
    int64_t num_frees;
    int64_t category_bytes[TSYS_MEM_CATEGORY_COUNT];   // live now, by category (they add up to live_bytes)
    int64_t peak_category_bytes[TSYS_MEM_CATEGORY_COUNT];   // the breakdown at the peak
} tsys_mem_stats;

// ---- backend interface: every device supplies these. The CPU backend is built in; the CUDA
// backend (tsys_cuda.cuh) fills one in tsys_cuda_init(). Kernels receive contiguous, already
// allocated tensors; the op layer above them does validation, dtype promotion and autograd.
//
// The kernel contract: one row per kernel, X(ENUM, name, slots, written, what it computes).
//   slots    one letter per argument slot t[0], t[1], ...: F float (f32/bf16/f16), S f32, I ids
//            (i32/i64), L an i64 scalar, A any dtype; lower case = may be NULL. Slots past the
//            string must be NULL. Under TSYS_DEBUG every launch is checked against this.
//   written  bit j set = the kernel writes t[j]; the other slots are read only.
// Scalars f[] and i[] are named in the last column. Every backend handles every row (a test runs
// each kernel on each backend); adding a row means adding its CPU entry (tsys__cpu_k_<name> and its
// row in tsys__cpu_kernels), its CUDA entry (tsys_cuda__k_<name>) and tests.
#define TSYS_KERNELS(X) \
    X(FILL,          "fill",          "A",         0x001, "t0 = f0") \
    X(CAST,          "cast",          "AA",        0x001, "t0 = (dtype of t0) t1, rounded to nearest even") \
    X(ACCUM,         "accum",         "FF",        0x001, "t0 += t1 * f0 (dtypes may differ; same numel)") \
    X(ADD,           "add",           "FFF",       0x001, "t0 = t1 + t2 (dtypes may differ; same numel)") \
    X(MUL,           "mul",           "FFF",       0x001, "t0 = t1 * t2") \
    X(SCALE,         "scale",         "FF",        0x001, "t0 = t1 * f0") \
    X(ADD_BIAS,      "add_bias",      "FF",        0x001, "t0 (rows, n) += t1 (n)") \
    X(BIAS_GRAD,     "bias_grad",     "SF",        0x001, "t0 (n, f32) += column sums of t1 (rows, n)") \
    X(RELU_FWD,      "relu_fwd",      "FF",        0x001, "t0 = relu(t1)") \
    X(RELU_BWD,      "relu_bwd",      "FFF",       0x001, "dx t0 = dy t1 * (x t2 > 0)") \
    X(SILU_FWD,      "silu_fwd",      "FF",        0x001, "t0 = silu(t1)") \
    X(SILU_BWD,      "silu_bwd",      "FFF",       0x001, "dx t0 = dy t1 * silu'(x t2)") \
    X(SWIGLU_FWD,    "swiglu_fwd",    "FFF",       0x001, "t0 = silu(t1) * t2") \
    X(SWIGLU_BWD,    "swiglu_bwd",    "FFFFF",     0x003, "da t0, db t1 from dy t2, a t3, b t4") \
    X(RMSNORM_FWD,   "rmsnorm_fwd",   "FSFFfs",    0x023, "y t0 (x's dtype, or bf16/f16 from f32 x), rstd t1 (rows, f32) from x t2, w t3; f0 = eps; with r t4: s = x + r (f32 x) written to t5, y = norm(s)") \
    X(RMSNORM_BWD,   "rmsnorm_bwd",   "FSFFFS",    0x003, "dx t0 (i0 = 1: added to), dw t1 (f32, accumulated; i1 = 1: stored) from dy t2, x t3, w t4, rstd t5") \
    X(LAYERNORM_FWD, "layernorm_fwd", "FSSFff",    0x007, "y t0, mean t1, rstd t2 from x t3, w t4, b t5; f0 = eps") \
    X(LAYERNORM_BWD, "layernorm_bwd", "FssFFfSS",  0x007, "dx t0, dw t1, db t2 (f32, accumulated) from dy t3, x t4, w t5, mean t6, rstd t7") \
    X(ROPE,          "rope",          "FF",        0x001, "t0 = rope(t1) over (.., T, D), positions 0..T-1; f0 = theta, f1 = +1 forward or -1 inverse; i0 = 1: t1 (B, T, H, D) -> t0 (B, H, T, D), 2: the way back") \
    X(SOFTMAX_FWD,   "softmax_fwd",   "FF",        0x001, "t0 = softmax(f0 * t1) over the last dim; i0 = causal (row r of a (.., T, T) block keeps cols <= r % T)") \
    X(SOFTMAX_BWD,   "softmax_bwd",   "FFF",       0x001, "dx t0 from dy t1, y t2; f0 = scale") \
    X(CE_FWD,        "ce_fwd",        "SSFI",      0x003, "loss t0 (scalar), lse t1 (rows) from logits t2 (rows, V), targets t3 (rows, each in [0, V))") \
    X(CE_BWD,        "ce_bwd",        "FFSIS",     0x001, "dlogits t0 from logits t1, lse t2, targets t3, dloss t4 (scalar); f0 = 1/rows") \
    X(MSE_FWD,       "mse_fwd",       "SFF",       0x001, "t0 = mean((t1 - t2)^2) (scalar)") \
    X(MSE_BWD,       "mse_bwd",       "ffFFS",     0x003, "da t0, db t1 (either may be NULL) from a t2, b t3, dloss t4 (scalar)") \
    X(SUM,           "sum",           "SF",        0x001, "t0 (scalar) = f0 * sum(t1)") \
    X(BROADCAST,     "broadcast",     "FF",        0x001, "t0 = f0 * t1[0] (t1 a one-element tensor)") \
    X(EMBED_FWD,     "embed_fwd",     "AAI",       0x001, "t0 (N, D) = rows t2 (N ids, each in [0, V)) of t1 (V, D)") \
    X(EMBED_BWD,     "embed_bwd",     "SFI",       0x001, "t0 (V, D, f32) += scatter of t1 (N, D) to rows t2 (N ids, each in [0, V))") \
    X(TRANSPOSE12,   "transpose12",   "AA",        0x001, "t0 (A, C, B, D) = t1 (A, B, C, D) with dims 1 and 2 swapped") \
    X(ADAMW,         "adamw",         "SFSSLsffs", 0x04d, "p t0, g t1 (f32, or bf16/f16 read as f32), m t2, v t3, step t4 (already counted), lr t5 (overrides f0 when given), t6 (bf16/f16, optional) = the new p rounded to nearest even; f = lr, beta1, beta2, eps, wd; t7 (optional): the other ranks' gradients, slots i0 elements apart, i1 ranks, this one i2, in g's dtype: g is the rank-ordered sum / i1; t8 (optional, 2 elements): the step's bias corrections as STEP_INC wrote them, read instead of computed from t4") \
    X(LINEAR_ADAMW,  "linear_adamw",  "SSSfFFLss", 0x00f, "AdamW of a linear weight inside its gradient product: g = t4^T t5 (dy (rows, O), x (rows, I), one dtype), rounded to dtype i0 (f32 or x's), updates p t0 (O, I), m t1, v t2 and the copy t3 (bf16/f16, optional) as ADAMW would from that gradient; step t6, lr t7, bias corrections t8 and f as ADAMW's t4, t5, t8 and f") \
    X(STEP_INC,      "step_inc",      "Ls",        0x003, "t0 += 1; with t1 (2 elements): t1 = 1 - f0^t0, 1 - f1^t0 (AdamW's bias corrections for betas f0, f1: the powers in double, rounded once)") \
    X(RANDN,         "randn",         "F",         0x001, "t0 = f0 N(0, 1) from a counter-based hash of (seed i0, element index), redrawn into [f1, f2] when f1 < f2") \
    X(SGD,           "sgd",           "FF",        0x001, "p t0 -= f0 * g t1") \
    X(SUMSQ,         "sumsq",         "SF",        0x001, "t0 (scalar) += sum(t1^2)") \
    X(NONFINITE,     "nonfinite",     "SF",        0x001, "t0 (scalar) = 1 if any element of t1 is inf or nan (else unchanged)") \
    X(FLASH_FWD,     "flash_fwd",     "FSFFF",     0x003, "O t0, L t1 (BH, N, f32) from Q t2, K t3, V t4; i0 = causal, f0 = scale") \
    X(FLASH_BWD,     "flash_bwd",     "FFFFFFFFS", 0x007, "dQ t0, dK t1, dV t2 from dO t3, Q t4, K t5, V t6, O t7, L t8; i0 = causal, f0 = scale") \
    X(SCALE_BY,      "scale_by",      "FFS",       0x001, "t0 = t1 * t2[0] (t2 one f32 element, read where it lives: no host sync)")

typedef enum tsys_kernel {
#define TSYS__X(e, name, slots, written, doc) TSYS_K_##e,
    TSYS_KERNELS(TSYS__X)
#undef TSYS__X
    TSYS_K_COUNT
} tsys_kernel;

#define TSYS_KARGS_MAX 10
typedef struct tsys_kargs {
    tsys_tensor *t[TSYS_KARGS_MAX];
    float f[8];
    int64_t i[4];
} tsys_kargs;

// Batched row-major GEMM: for each b < batch, C_b = alpha * op(A_b) op(B_b) + beta * C_b,
// op(A_b) is m x k, op(B_b) is k x n, C_b is m x n. Elements of batch b start at
// offset_x + b * stride_x; stride 0 broadcasts. A and B share one dtype; C is F32 or that dtype.
// Accumulation is always fp32. as_items: each item gives the bits it would as a GEMM of its own (batch 1);
// otherwise a backend may pick another algorithm for the batch (other rounding of the same sums).
typedef struct tsys_gemm_args {
    const tsys_tensor *a, *b;
    tsys_tensor *c;
    bool trans_a, trans_b;
    int64_t m, n, k, batch;
    int64_t stride_a, stride_b, stride_c;
    float alpha, beta;
    bool as_items;
} tsys_gemm_args;

// A point on one of a device's streams. Zero-initialize, record, read, release:
//   tsys_event a = {0}, b = {0};
//   tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &a); ...work...; tsys_event_record(..., &b);
//   double ms = tsys_event_elapsed_ms(ctx, &a, &b); tsys_event_release(ctx, &a); tsys_event_release(ctx, &b);
// CPU: the host clock at the record (its one stream runs work as it is issued). CUDA: a cudaEvent
// from the backend's pool, recorded on the stream; elapsed waits for the later event.
typedef enum tsys_stream {
    TSYS_STREAM_COMPUTE = 0,   // where ops run by default
    TSYS_STREAM_SIDE = 1,      // a second stream: communication, work overlapped with the compute stream
    TSYS_STREAM_COPY = 2,      // device-to-host copies that overlap both (asynchronous snapshots)
    TSYS_STREAM_BACKGROUND = 3,   // work that takes only what the others leave (the optimizer inside backward):
                                  // CUDA gives it the least priority and the compute and side streams the greatest
    TSYS_STREAM_COUNT
} tsys_stream;

typedef struct tsys_event {
    tsys_device device;
    tsys_stream stream;
    double host_us;      // host clock at the record
    void *handle;        // backend's event (NULL until first recorded; kept across re-records)
} tsys_event;

typedef struct tsys_backend {
    const char *name;
    void *(*alloc)(tsys_ctx *ctx, size_t bytes);                 // NULL when out of memory
    void (*free)(tsys_ctx *ctx, void *ptr, size_t bytes);
    // copy bytes between any two devices (one of them is this backend's device)
    tsys_status (*copy)(tsys_ctx *ctx, void *dst, tsys_device dst_dev, const void *src, tsys_device src_dev, size_t bytes);
    tsys_status (*gemm)(tsys_ctx *ctx, const tsys_gemm_args *g);
    tsys_status (*kernel)(tsys_ctx *ctx, tsys_kernel k, const tsys_kargs *a);
    tsys_status (*sync)(tsys_ctx *ctx);                          // waits for every stream
    void *state;                                                // backend's own data (streams, handles, pools)
    void (*destroy)(tsys_ctx *ctx);   // frees the state; tsys_ctx_free calls it once the tape and caches are gone
    // events and streams (see tsys_event)
    tsys_status (*event_record)(tsys_ctx *ctx, tsys_event *e, tsys_stream s);
    tsys_status (*event_wait)(tsys_ctx *ctx, const tsys_event *e, tsys_stream s);   // stream s waits for e
    tsys_status (*event_elapsed)(tsys_ctx *ctx, const tsys_event *start, const tsys_event *end, double *ms);
    void (*event_release)(tsys_ctx *ctx, tsys_event *e);
    tsys_stream (*set_stream)(tsys_ctx *ctx, tsys_stream s);    // where later kernels and GEMMs go; returns the previous
    int64_t (*cached_bytes)(tsys_ctx *ctx);   // optional: bytes reserved from the device but not in use (a caching allocator's free blocks)
    // optional, for copies that overlap the work of the streams (asynchronous snapshots; without them
    // the context uses malloc and copy): page-locked host memory, NULL when there is none
    void *(*host_alloc)(tsys_ctx *ctx, size_t bytes);
    void (*host_free)(tsys_ctx *ctx, void *ptr);
    // queues the copy on stream s and returns at once (the bytes are there once s gets that far). fenced:
    // src is memory the library writes later (a parameter, optimizer state), so copies_fence waits for it
    tsys_status (*copy_async)(tsys_ctx *ctx, void *dst, tsys_device dst_dev, const void *src, tsys_device src_dev, size_t bytes, tsys_stream s, bool fenced);
    // the compute stream waits for the fenced copies queued on TSYS_STREAM_COPY so far (nothing if none is pending)
    tsys_status (*copies_fence)(tsys_ctx *ctx);
    // the calling thread waits for e. Any thread may call it: it sets no error in the context (err gets the message)
    tsys_status (*event_host_wait)(const struct tsys_backend *b, const tsys_event *e, char *err, size_t err_len);
} tsys_backend;

// ---- trace hooks: every forward op, every backward node, named ranges, kernel and GEMM launches,
// and memory events pass through them (profilers, NVTX, memory timelines are clients). Install with
// tsys_ctx_set_trace_hooks; NULL members are skipped. Hooks also run while a CUDA graph is being
// captured (the kernel hook then sees launches that are recorded, not run).
typedef enum tsys_trace_kind {
    TSYS_TRACE_FORWARD,    // an op (name: "linear", "rmsnorm", ...)
    TSYS_TRACE_BACKWARD,   // the backward of one tape node (name: the op's)
    TSYS_TRACE_RANGE,      // a named range: tsys_trace_begin/end ("forward", "backward", "optimizer", ...)
    TSYS_TRACE_REGION      // a part of the model the library marks: "layers.3", "computing attention scores",
                           // "computing softmax", "final matmul", "flash attention" (hooks only, no memory tag)
} tsys_trace_kind;

typedef struct tsys_trace_kernel {
    uint64_t seq;                  // launch number in this context (1, 2, ...): matches kernel_begin to kernel
    tsys_device device;
    tsys_kernel kernel;            // TSYS_K_COUNT for a GEMM
    const char *name;              // tsys_kernel_name(kernel), or "gemm"
    const tsys_kargs *args;        // the launch's arguments (NULL for a GEMM)
    const tsys_gemm_args *gemm;    // the GEMM's arguments (NULL for a kernel)
    tsys_status status;            // what the backend returned
    double t_begin_us, t_end_us;   // host clock around the launch (CPU: the kernel's time; CUDA: the launch's)
} tsys_trace_kernel;

typedef struct tsys_trace_hooks {
    void (*op_begin)(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user);
    void (*op_end)(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user);
    void (*kernel)(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user);          // after the launch
    void (*mem)(tsys_ctx *ctx, const tsys_mem_event *e, void *user);
    void *user;
    void (*kernel_begin)(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user);    // before it (status, t_end unset)
} tsys_trace_hooks;

// >>public ----------------------------------------------------------------------------------------

// context and errors
TSYSDEF tsys_ctx *tsys_ctx_new(const tsys_ctx_desc *desc);
// Frees the context: its tape, autocast's weight copies, its hooks and its device backends go at once
// (a device backend's memory goes with it, live tensors' too: a CUDA tensor still held has no memory
// from here on). What is still held (tensors, models, optimizers) keeps only the context's header, which
// goes with the last of them: releasing them after tsys_ctx_free (tsys_tensor_release, tsys_model_free,
// tsys_optim_free) is safe and frees their CPU memory, and memory a tensor wraps still goes back to its
// owner then. Release is all they are good for: the context is gone for every other use. NULL: nothing.
TSYSDEF void tsys_ctx_free(tsys_ctx *ctx);
TSYSDEF tsys_status tsys_ctx_status(const tsys_ctx *ctx);
TSYSDEF const char *tsys_ctx_last_error(const tsys_ctx *ctx);
TSYSDEF void tsys_ctx_clear_error(tsys_ctx *ctx);
TSYSDEF tsys_status tsys_ctx_set_error(tsys_ctx *ctx, tsys_status s, const char *fmt, ...);
TSYSDEF const char *tsys_status_str(tsys_status s);
TSYSDEF void tsys_ctx_set_backend(tsys_ctx *ctx, tsys_device dev, const tsys_backend *backend);
TSYSDEF const tsys_backend *tsys_ctx_backend(const tsys_ctx *ctx, tsys_device dev);
TSYSDEF tsys_status tsys_sync(tsys_ctx *ctx, tsys_device dev);
TSYSDEF double tsys_time_us(void);   // monotonic wall clock
TSYSDEF double tsys_ctx_time_us(const tsys_ctx *ctx);   // microseconds since the context was made (the memory timeline's clock)
// The CPU budget (tsys_ctx_desc.cpu_memory_limit): what the context has, and a new one (0 = the
// default, the memory available now); tsys_cpu_memory_available() is that default: the least of
// MemAvailable and the room left in this process's memory cgroups (containers, Slurm jobs).
TSYSDEF size_t tsys_ctx_cpu_memory_limit(const tsys_ctx *ctx);
TSYSDEF void tsys_ctx_set_cpu_memory_limit(tsys_ctx *ctx, size_t bytes);
TSYSDEF size_t tsys_cpu_memory_available(void);
TSYSDEF const char *tsys_kernel_name(tsys_kernel k);

// events and streams (see tsys_event); the CPU backend has them too, so timing code is one code
TSYSDEF tsys_status tsys_event_record(tsys_ctx *ctx, tsys_device dev, tsys_stream s, tsys_event *e);
TSYSDEF tsys_status tsys_event_wait(tsys_ctx *ctx, const tsys_event *e, tsys_stream s);          // stream s (of e's device) waits for e
TSYSDEF double tsys_event_elapsed_ms(tsys_ctx *ctx, const tsys_event *start, const tsys_event *end);   // waits for end; NAN on error
TSYSDEF void tsys_event_release(tsys_ctx *ctx, tsys_event *e);
TSYSDEF tsys_stream tsys_set_stream(tsys_ctx *ctx, tsys_device dev, tsys_stream s);              // returns the previous

// trace hooks and named ranges
TSYSDEF tsys_trace_hooks tsys_ctx_set_trace_hooks(tsys_ctx *ctx, const tsys_trace_hooks *hooks); // NULL removes; returns the previous
TSYSDEF void tsys_trace_begin(tsys_ctx *ctx, const char *name);   // a range for the hooks; also the memory tag of what it allocates
TSYSDEF void tsys_trace_end(tsys_ctx *ctx);                       // closes the innermost range
// Inside the op_begin/op_end hooks of a linear or embedding, forward or backward: its weight (the
// parameter itself, not an autocast copy), so a hook can tell which parameters an op is about to use
// (FSDP gathers them); NULL in any other hook.
TSYSDEF tsys_tensor *tsys_trace_weight(const tsys_ctx *ctx);
// Inside the op_begin hook of an op (forward, or its backward node): how many inputs the op takes
// (0 in any other hook, and for ranges and regions), and input i's dtype and shape; false for an
// input the call left out (a linear without bias). A backward node tells its forward op's inputs.
TSYSDEF int tsys_trace_num_inputs(const tsys_ctx *ctx);
TSYSDEF bool tsys_trace_input(const tsys_ctx *ctx, int i, tsys_dtype *dtype, int *ndim, int64_t shape[TSYS_MAX_DIMS]);

// dtypes
TSYSDEF size_t tsys_dtype_size(tsys_dtype dt);
TSYSDEF const char *tsys_dtype_name(tsys_dtype dt);
TSYSDEF bool tsys_dtype_is_float(tsys_dtype dt);
TSYSDEF uint16_t tsys_f32_to_bf16(float f);
TSYSDEF float tsys_bf16_to_f32(uint16_t h);
TSYSDEF uint16_t tsys_f32_to_f16(float f);
TSYSDEF float tsys_f16_to_f32(uint16_t h);

// memory tracker
TSYSDEF tsys_mem_stats tsys_mem_stats_get(const tsys_ctx *ctx, tsys_device dev);
TSYSDEF void tsys_mem_reset_peak(tsys_ctx *ctx, tsys_device dev);
TSYSDEF int tsys_mem_tag(tsys_ctx *ctx, const char *tag);          // interns a tag, returns its id
TSYSDEF const char *tsys_mem_tag_name(const tsys_ctx *ctx, int tag);
TSYSDEF int tsys_mem_num_tags(const tsys_ctx *ctx);
TSYSDEF int tsys_mem_set_tag(tsys_ctx *ctx, int tag);               // sets the current tag, returns the previous
TSYSDEF tsys_mem_category tsys_mem_set_category(tsys_ctx *ctx, tsys_mem_category c);   // for what is made next; returns the previous
TSYSDEF const char *tsys_mem_category_name(tsys_mem_category c);
// Bytes a backend holds outside tensor storage (kernel scratch, library workspaces): +bytes when
// taken, -bytes when given back; they count in live bytes and peaks like storage.
TSYSDEF void tsys_mem_note_external(tsys_ctx *ctx, tsys_device dev, tsys_mem_category c, int64_t delta);
TSYSDEF int64_t tsys_mem_tag_bytes(const tsys_ctx *ctx, int tag, tsys_device dev);   // live bytes under a tag
TSYSDEF const tsys_mem_event *tsys_mem_events(const tsys_ctx *ctx, size_t *count);
TSYSDEF void tsys_mem_record_events(tsys_ctx *ctx, bool on);
TSYSDEF void tsys_mem_clear_events(tsys_ctx *ctx);

// tensors
TSYSDEF tsys_tensor *tsys_tensor_new(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape);
TSYSDEF tsys_tensor *tsys_tensor_new_2d(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int64_t d0, int64_t d1);
TSYSDEF tsys_tensor *tsys_tensor_from_data(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape, const void *host_data);
TSYSDEF int64_t tsys_shape_bytes(tsys_ctx *ctx, tsys_dtype dt, int ndim, const int64_t *shape);   // -1 + the context's error on a bad shape
// A tensor over memory tsys did not allocate (a communication library's buffer, a mapped file): data must hold
// the shape's bytes on dev; release (may be NULL: the caller keeps ownership) runs once, when the last tensor
// on it goes (after tsys_ctx_free too). It counts in the memory tracker like storage, and cannot be resized.
TSYSDEF tsys_tensor *tsys_tensor_wrap(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape, void *data,
                                      void (*release)(void *user, void *data, size_t bytes), void *user);
TSYSDEF tsys_tensor *tsys_tensor_retain(tsys_tensor *t);
TSYSDEF void tsys_tensor_release(tsys_tensor *t);
TSYSDEF int64_t tsys_tensor_numel(const tsys_tensor *t);
TSYSDEF size_t tsys_tensor_bytes(const tsys_tensor *t);
TSYSDEF void *tsys_tensor_data(const tsys_tensor *t);
TSYSDEF void tsys_tensor_set_name(tsys_tensor *t, const char *fmt, ...);   // printf-style; NULL t or fmt: nothing
TSYSDEF bool tsys_tensor_same_shape(const tsys_tensor *a, const tsys_tensor *b);
TSYSDEF tsys_tensor *tsys_tensor_to(tsys_ctx *ctx, const tsys_tensor *t, tsys_device dev);        // copy, no autograd
TSYSDEF tsys_tensor *tsys_tensor_clone(tsys_ctx *ctx, const tsys_tensor *t);                      // copy, no autograd
TSYSDEF tsys_status tsys_tensor_copy_from(tsys_ctx *ctx, tsys_tensor *dst, const tsys_tensor *src); // same numel and dtype
TSYSDEF tsys_status tsys_tensor_cast_from(tsys_ctx *ctx, tsys_tensor *dst, const tsys_tensor *src); // same numel, float dtypes
                                                                                                  // may differ (tsys_cast's rounding)
TSYSDEF tsys_status tsys_tensor_accumulate(tsys_ctx *ctx, tsys_tensor *dst, const tsys_tensor *src); // dst += src in fp32 (same numel;
                                                                                                   // src's float dtype may differ)
TSYSDEF tsys_status tsys_tensor_to_host(tsys_ctx *ctx, const tsys_tensor *t, void *host);          // raw bytes
TSYSDEF tsys_status tsys_tensor_to_f32(tsys_ctx *ctx, const tsys_tensor *t, float *host);          // converted to fp32
TSYSDEF tsys_status tsys_tensor_fill(tsys_ctx *ctx, tsys_tensor *t, float value);
TSYSDEF tsys_status tsys_tensor_randn(tsys_ctx *ctx, tsys_tensor *t, float std);                  // from the ctx RNG
TSYSDEF tsys_status tsys_tensor_trunc_normal(tsys_ctx *ctx, tsys_tensor *t, float std, float lo, float hi);
TSYSDEF tsys_status tsys_tensor_randint(tsys_ctx *ctx, tsys_tensor *t, int64_t hi);               // ints in [0, hi)
TSYSDEF tsys_tensor *tsys_view(tsys_ctx *ctx, tsys_tensor *t, int ndim, const int64_t *shape);   // reshape, shares storage, recorded
TSYSDEF tsys_tensor *tsys_tensor_view_raw(tsys_ctx *ctx, tsys_tensor *t, size_t byte_offset, tsys_dtype dt, int ndim, const int64_t *shape);  // no autograd
TSYSDEF void tsys_tensor_set_requires_grad(tsys_tensor *t, bool on);
// The dtype backward makes a leaf's .grad in: TSYS_BF16 or TSYS_F16 for an fp32 leaf, TSYS_F32 back to the
// leaf's own. What torch's autocast gives a weight: its matmul writes the gradient in the compute dtype and
// .grad holds those rounded values; kept in that dtype, the optimizer reads half the bytes (and a linear
// layer's weight-gradient matmul under autocast of dt writes it directly). A low-precision gradient takes one
// gradient a backward, rounded to nearest even once: a second one (a weight used twice, or gradients
// accumulated over micro-batches without zero_grad) is an error, since fp32 gradients would add the two in
// fp32. Set it while t holds no gradient (before backward, or after tsys_release_grads). AdamW and SGD read
// it; clipping, the fp16 loss scaler, DDP, ZeRO-1 and FSDP refuse it.
TSYSDEF tsys_status tsys_tensor_set_grad_dtype(tsys_ctx *ctx, tsys_tensor *t, tsys_dtype dt);
TSYSDEF tsys_dtype tsys_tensor_grad_dtype(const tsys_tensor *t);   // what backward makes t's .grad in
// Writes through tsys_tensor_data's pointer (or by any means tsys does not launch) must be followed by
// this: it bumps the storage's version, so a kept low-precision copy of t (tsys_optim_keep_lowp) is
// made again at its next use instead of serving the old values.
TSYSDEF void tsys_tensor_mark_written(tsys_tensor *t);
// The same for parameters written in bulk behind tsys's back (n of them; written[i] says which): the kept
// copies of the others on their storages stay valid (mark_written of one parameter makes every copy made
// from its storage stale), and so do the written ones' where copies_written: their kept copies were
// written with them, the same values rounded to nearest even as the cast rounds them (tsys_ddp's
// shard_updates: each bucket's owner sends its new weights and their copies).
TSYSDEF void tsys_params_mark_written(tsys_tensor *const *params, int n, const bool *written, bool copies_written);
// Parameters whose values are held elsewhere (tsys_ddp's desc.shard_masters: the fp32 weights a peer updates, of which
// this rank receives only the kept copies), n of them, stale[i] says which; the others on their storages are current.
// A launch that reads a stale parameter's bytes (through any view: a cast of it, an fp32 forward), a read of them to the
// host and a save fail, naming it; a write tsys sees that covers it (a kernel's, a copy or load into it, mark_written)
// makes it current again.
TSYSDEF tsys_status tsys_params_mark_stale(tsys_ctx *ctx, tsys_tensor *const *params, int n, const bool *stale);
// Storage surgery for sharded training (tsys_dist.h's FSDP). rebind: t becomes a window of target's
// storage at byte_offset (its dtype and shape kept, its old storage released; the window must fit).
// resize: frees (bytes = 0) or reallocates the memory of t's storage under every tensor that views it,
// as torch's storage().resize_(0) does for FSDP's parameters; the contents are undefined afterwards.
// A size other than 0 must cover every tensor that was placed on the storage (its own, views, rebinds:
// the storage's extent), else the resize is refused: a shrink under a live view would leave it past the
// end. A tensor on a 0-byte storage has no memory: ops, kernels and copies given it fail with an error
// (tsys_tensor_data is NULL + offset: do not read it yourself). The tracker sees the bytes come and go.
// Both take tensors of ctx only.
TSYSDEF tsys_status tsys_tensor_rebind(tsys_ctx *ctx, tsys_tensor *t, tsys_tensor *target, size_t byte_offset);
TSYSDEF tsys_status tsys_storage_resize(tsys_ctx *ctx, tsys_tensor *t, size_t bytes);
// Gradient-ready hooks: fn runs once per backward, the moment t's gradient is final (after its last
// use on the tape, tied weights included); several hooks on one tensor run in registration order.
TSYSDEF tsys_status tsys_tensor_add_grad_hook(tsys_tensor *t, tsys_grad_hook_fn fn, void *user);
TSYSDEF bool tsys_tensor_remove_grad_hook(tsys_tensor *t, tsys_grad_hook_fn fn, void *user);  // false when not registered
TSYSDEF void tsys_tensor_set_grad_hook(tsys_tensor *t, tsys_grad_hook_fn fn, void *user);     // removes all, then adds fn (NULL: none)
TSYSDEF uint64_t tsys_rng_next(tsys_ctx *ctx);
TSYSDEF void tsys_rng_seed(tsys_ctx *ctx, uint64_t seed);
TSYSDEF float tsys_rng_normal(tsys_ctx *ctx);
TSYSDEF float tsys_rng_uniform(tsys_ctx *ctx);

// autograd
TSYSDEF tsys_status tsys_backward(tsys_ctx *ctx, tsys_tensor *loss);              // d loss = 1
TSYSDEF tsys_status tsys_backward_with(tsys_ctx *ctx, tsys_tensor *out, tsys_tensor *grad_out);
TSYSDEF void tsys_tape_clear(tsys_ctx *ctx);   // drop everything recorded (no backward)
TSYSDEF size_t tsys_tape_size(const tsys_ctx *ctx);
TSYSDEF void tsys_no_grad_begin(tsys_ctx *ctx);
TSYSDEF void tsys_no_grad_end(tsys_ctx *ctx);
TSYSDEF bool tsys_grad_enabled(const tsys_ctx *ctx);
// Callbacks at the end of every successful backward, after every gradient-ready hook, in registration order.
typedef void (*tsys_backward_hook_fn)(tsys_ctx *ctx, void *user_data);
TSYSDEF tsys_status tsys_ctx_add_backward_hook(tsys_ctx *ctx, tsys_backward_hook_fn fn, void *user);
TSYSDEF bool tsys_ctx_remove_backward_hook(tsys_ctx *ctx, tsys_backward_hook_fn fn, void *user);

// Checkpointed regions (activation checkpointing): the ops between begin and end keep only the
// region's inputs for backward (parameters, and the activations made before the region); backward
// recomputes the region's forward when it gets there, then goes through it. Regions nest (an inner
// region stays checkpointed while its outer one is recomputed). Gradients and gradient-ready hooks
// are exactly those of the run without regions. Begin/end pairs are the caller's; backward refuses
// to run while a region is open.
TSYSDEF tsys_status tsys_checkpoint_begin(tsys_ctx *ctx);
// As tsys_checkpoint_begin, with options (TSYS_CHECKPOINT_*, or'ed).
enum {
    // A linear under autocast keeps its low-precision weight copy (as it would without the region)
    // instead of casting the weight again in backward: for regions whose linears need not rerun
    // (selective), where the copies would be made again only to be read once. Applies when the region
    // is the outermost one around the linear; inside an outer region without it, the copies go.
    TSYS_CHECKPOINT_KEEP_WEIGHT_COPIES = 1,
    // A flash attention keeps its output and log-sum-exp, so a recompute of the region does not run
    // the attention forward again (it still recomputes q, k, v): for long contexts, where attention's
    // O(T^2) FLOPs dominate the recompute and its output is a small part of what a block keeps.
    TSYS_CHECKPOINT_KEEP_ATTENTION = 2
};
TSYSDEF tsys_status tsys_checkpoint_begin_ex(tsys_ctx *ctx, unsigned flags);
TSYSDEF tsys_status tsys_checkpoint_end(tsys_ctx *ctx);
TSYSDEF int tsys_checkpoint_depth(const tsys_ctx *ctx);   // regions open now

// autocast (mixed precision)
TSYSDEF void tsys_autocast_begin(tsys_ctx *ctx, tsys_dtype low);     // TSYS_BF16 or TSYS_F16
TSYSDEF void tsys_autocast_end(tsys_ctx *ctx);                       // also drops the region's low-precision weights (not the kept ones)
TSYSDEF tsys_dtype tsys_autocast_dtype(const tsys_ctx *ctx);         // TSYS_F32 when off

// ops (forward + backward). Inputs are borrowed; the result is a new reference. Every input must
// belong to ctx (made by it or from its tensors): a tensor of another context is an error naming the op.
TSYSDEF tsys_tensor *tsys_cast(tsys_ctx *ctx, tsys_tensor *x, tsys_dtype dt);
TSYSDEF tsys_tensor *tsys_embedding(tsys_ctx *ctx, tsys_tensor *weight, tsys_tensor *ids);
TSYSDEF tsys_tensor *tsys_linear(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *weight, tsys_tensor *bias);  // x W^T (+ b)
// out[i] = tsys_linear(x, weights[i], NULL) for n (<= TSYS_LINEARS_MAX) weights of one shape that read one
// input (a block's q, k, v; w1, w3): the same values and gradients as n tsys_linear calls, in that order.
// Where the weights (or the low-precision copies autocast reads) lie a constant stride apart in one storage
// and each product is small (rows x d_out <= TSYS_LINEARS_GROUP_MAX), the forward is one strided-batched GEMM and
// backward runs the group's dX and dW products as one each, once every output's gradient is in (their
// kernels show in the first forward and the last backward linear of the group). On failure every out[i]
// is NULL and the context's error says why.
#define TSYS_LINEARS_MAX 4
#define TSYS_LINEARS_GROUP_MAX ((int64_t)1 << 23)
TSYSDEF tsys_status tsys_linears(tsys_ctx *ctx, tsys_tensor *x, int n, tsys_tensor *const *weights, tsys_tensor **out);
TSYSDEF tsys_tensor *tsys_matmul(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b, bool trans_b);           // (.., m, k) x (.., k, n) (or (.., n, k)^T)
TSYSDEF tsys_tensor *tsys_add(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b);
TSYSDEF tsys_tensor *tsys_mul(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b);
TSYSDEF tsys_tensor *tsys_scale(tsys_ctx *ctx, tsys_tensor *a, float s);
TSYSDEF tsys_tensor *tsys_relu(tsys_ctx *ctx, tsys_tensor *x);
TSYSDEF tsys_tensor *tsys_silu(tsys_ctx *ctx, tsys_tensor *x);
TSYSDEF tsys_tensor *tsys_swiglu(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b);     // silu(a) * b, fused
TSYSDEF tsys_tensor *tsys_rmsnorm(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *weight, float eps);
TSYSDEF tsys_tensor *tsys_layernorm(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *weight, tsys_tensor *bias, float eps);
TSYSDEF tsys_tensor *tsys_rope(tsys_ctx *ctx, tsys_tensor *x, float theta);           // (.., T, D), interleaved pairs
TSYSDEF tsys_tensor *tsys_rope_heads(tsys_ctx *ctx, tsys_tensor *x, float theta);     // (B, T, H, D) -> (B, H, T, D): rope(transpose12(x)) in one pass
TSYSDEF tsys_tensor *tsys_softmax(tsys_ctx *ctx, tsys_tensor *x, float scale, bool causal);
TSYSDEF tsys_tensor *tsys_transpose12(tsys_ctx *ctx, tsys_tensor *x);                  // (A, B, C, D) -> (A, C, B, D)
TSYSDEF tsys_tensor *tsys_attention_naive(tsys_ctx *ctx, tsys_tensor *q, tsys_tensor *k, tsys_tensor *v, bool causal);  // (.., T, D)
TSYSDEF tsys_tensor *tsys_flash_attention(tsys_ctx *ctx, tsys_tensor *q, tsys_tensor *k, tsys_tensor *v, bool causal, tsys_tensor **lse_out);
TSYSDEF tsys_tensor *tsys_cross_entropy(tsys_ctx *ctx, tsys_tensor *logits, tsys_tensor *targets);   // mean over rows
// tsys_cross_entropy(tsys_linear(x, w), targets) without the (rows, V) logits: forward takes chunk_rows rows
// at a time (0: a power of two, at least 2048 and about as many logits as x has elements), and for each makes the logits, the
// loss and its gradient, then the chunk's d x and its share of d w; backward only scales them by the loss's
// gradient. It keeps x's and w's gradient sizes from forward on instead of the logits (S26: 0.5 + 2.5 GB for
// 10 GB of bf16 logits and as much again for their gradient). One chunk gives linear + cross_entropy's bits;
// more sum d w and the loss chunk by chunk (fp32 rounding apart). Not inside a checkpoint region.
TSYSDEF tsys_tensor *tsys_linear_cross_entropy(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *w, tsys_tensor *targets, int64_t chunk_rows);
TSYSDEF tsys_tensor *tsys_mse(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b);
TSYSDEF tsys_tensor *tsys_sum(tsys_ctx *ctx, tsys_tensor *x);
TSYSDEF tsys_tensor *tsys_mean(tsys_ctx *ctx, tsys_tensor *x);
TSYSDEF float tsys_item(tsys_ctx *ctx, const tsys_tensor *scalar);                     // NAN on error

// Custom ops, as torch.autograd.Function. forward makes out (a new tensor; a view of an input is fine) from
// 1-4 inputs; the ops it calls are not recorded; it may keep one tensor it computed for backward (*saved, a
// new reference). backward gives every input j with needs[j] its gradient (grads[j], a new tensor of input
// j's element count, any float dtype), from grad_out, the inputs it keeps (bit j of saves; the others come
// as NULL) and the saved tensor. Inside a checkpointed region forward runs again during backward on the same
// inputs, as every op does there. The descriptor must outlive the tape that records it.
typedef struct tsys_custom_op {
    const char *name;
    tsys_tensor *(*forward)(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user);
    tsys_status (*backward)(tsys_ctx *ctx, tsys_tensor *grad_out, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs,
                            tsys_tensor **grads, void *user);
    unsigned saves;   // bit j: backward reads input j
    void *user;
} tsys_custom_op;
TSYSDEF tsys_tensor *tsys_custom(tsys_ctx *ctx, const tsys_custom_op *op, tsys_tensor *const *ins, int n);

// the cs336 Transformer LM
// Model shape. All fields 0 = default (tsys_model_desc_defaults fills them):
//   vocab_size 10000 | context_length 256 | d_model 768 | num_layers 12 | num_heads 12 | d_ff 4*d_model
//   rope_theta 10000 | eps 1e-5 | attn "naive" (CPU) ("flash" once the backend has it)
//   checkpoint "none": activation checkpointing policy (see tsys_checkpoint_policy_parse):
//     none | blocks:K | sqrt | nested[:K] | selective | blocks:K+selective ... | auto:BYTES
typedef struct tsys_model_desc {
    int vocab_size, context_length, d_model, num_layers, num_heads, d_ff;
    float rope_theta, eps;
    const char *attn;
    const char *checkpoint;
    bool fused_loss;        // tsys_model_loss runs the LM head and the loss fused (tsys_linear_cross_entropy): no logits
    int fused_loss_chunk;   // its rows a chunk (0: the op's default; fewer rows, less memory and more passes over d w)
} tsys_model_desc;

typedef struct tsys_model tsys_model;

TSYSDEF tsys_model_desc tsys_model_desc_defaults(const tsys_model_desc *desc);
TSYSDEF tsys_status tsys_model_desc_preset(const char *name, tsys_model_desc *out, char *err, size_t err_len);
TSYSDEF const char *tsys_model_preset_names(void);
TSYSDEF tsys_status tsys_model_desc_validate(const tsys_model_desc *desc, char *err, size_t err_len);
TSYSDEF int64_t tsys_model_desc_num_params(const tsys_model_desc *desc);
TSYSDEF tsys_model *tsys_model_new(tsys_ctx *ctx, const tsys_model_desc *desc, tsys_device dev, uint64_t seed);
TSYSDEF void tsys_model_free(tsys_model *m);
TSYSDEF const tsys_model_desc *tsys_model_get_desc(const tsys_model *m);
TSYSDEF tsys_tensor **tsys_model_params(tsys_model *m);     // PyTorch parameters() order, named as in its state_dict
TSYSDEF int tsys_model_num_tensors(const tsys_model *m);
TSYSDEF int64_t tsys_model_num_params(const tsys_model *m);
TSYSDEF tsys_tensor *tsys_model_param(tsys_model *m, const char *name);
// p is one of m's parameters that only matmuls read (under autocast, through its kept copy): the linear layers'
// and lm_head's weights, not the token embedding (looked up) or the norms' gains.
TSYSDEF bool tsys_model_matmul_weight(const tsys_model *m, const tsys_tensor *p);
// The linear layers' weight gradients (every 2-D parameter but the embedding: attention and FFN
// projections, lm_head) kept in dt: TSYS_BF16 / TSYS_F16 as autocast of dt writes them, TSYS_F32 back
// (tsys_tensor_set_grad_dtype on each, with its rules; the norms' and the embedding's stay fp32).
TSYSDEF tsys_status tsys_model_set_grad_dtype(tsys_model *m, tsys_dtype dt);
TSYSDEF tsys_tensor *tsys_model_forward(tsys_model *m, tsys_tensor *ids);   // (B, T) ids -> (B, T, V) logits
// The mean cross-entropy of the next-token logits against targets (B, T): tsys_cross_entropy of
// tsys_model_forward, or with desc.fused_loss the head and the loss fused, the logits never made.
TSYSDEF tsys_tensor *tsys_model_loss(tsys_model *m, tsys_tensor *ids, tsys_tensor *targets);
// The rows a chunk of the fused loss takes for `rows` tokens of this model (desc.fused_loss_chunk, else the op's
// default), as the memory accounting counts its logits.
TSYSDEF int64_t tsys_model_fused_loss_chunk(const tsys_model_desc *desc, int64_t rows);
TSYSDEF tsys_status tsys_check_token_ids(tsys_ctx *ctx, const tsys_tensor *ids, int vocab_size, int context_length);
TSYSDEF double tsys_model_flops(const tsys_model_desc *desc, int64_t batch, int64_t T, bool backward);  // matmul FLOPs

// Activation checkpointing of the model (tsys_model_desc.checkpoint). A policy says which parts of
// the forward are checkpointed regions (tsys_checkpoint_begin/end):
//   none           everything is kept for backward
//   blocks:K       every K consecutive blocks one region (the last may be shorter): keeps one
//                  residual per region; backward recomputes K blocks at a time
//   sqrt           blocks:K with K = ceil(sqrt(num_layers)) (Chen et al. 2016)
//   nested[:K]     regions of K blocks (default ceil(sqrt(num_layers))), each block a region nested
//                  inside: keeps one residual per K blocks, then K residuals and one block at a time
//   selective      in every block, regions around what is cheap to recompute and large to keep: the
//                  two RMSNorms with the projections that read them (the normalized inputs and their
//                  low-precision copies), the attention core (naive: QK^T and softmax, whose T x T
//                  probabilities go; flash: the kernel and the output projection's input), and SwiGLU
//                  with w2 (its output); GEMM outputs are kept
//   P+selective    (P = blocks:K, sqrt, nested[:K]) the selective regions nested in P's, so a
//                  recomputed block keeps only what selective keeps
//   P+keep-attn    P's regions, where flash attention keeps its output and log-sum-exp (one bf16
//                  activation a block) so the recompute does not run the attention forward again:
//                  for long contexts (TSYS_CHECKPOINT_KEEP_ATTENTION; no effect with naive attention)
//   P+first:N      (P a policy of block regions, with its suffixes) P's regions over the first N
//                  blocks only; the blocks above keep everything (Megatron's recompute-num-layers):
//                  memory that is left over buys back their recomputation, block by block
//   auto:BYTES     the planner (tsys_checkpoint_plan_make) picks the policy (+first:N included) with
//                  the least recomputation whose predicted peak fits BYTES (suffixes K, M, G, T, with or without
//                  "iB"/"B", are powers of 1024); the model plans for a training step with AdamW
// Which policy a model runs is fixed at tsys_model_new; auto plans again when (batch, context,
// autocast) change.
typedef struct tsys_checkpoint_policy {
    int segment;       // blocks per region (0 = no block regions)
    int inner;         // blocks per region nested in each segment (0 = none, 1 = every block)
    bool selective;    // the per-block regions of `selective`
    bool keep_attention;   // flash attention keeps its output in the block regions (+keep-attn)
    int first;         // the regions cover blocks [0, first) only (+first:N; 0 = every block)
    double budget;     // auto: bytes the step's peak must fit in (0 = not auto)
} tsys_checkpoint_policy;
TSYSDEF tsys_status tsys_checkpoint_policy_parse(const char *s, int num_layers, tsys_checkpoint_policy *out, char *err, size_t err_len);
TSYSDEF void tsys_checkpoint_policy_name(const tsys_checkpoint_policy *p, char *buf, size_t len);   // canonical: "blocks:4+selective"
// Every policy auto chooses from, in the order it tries them: none, selective, then blocks and nested with every
// region size, suffix (+keep-attn only for flash attention) and +first:N (segments no longer than N).
typedef void (*tsys_checkpoint_policy_fn)(const tsys_checkpoint_policy *p, void *user);
TSYSDEF void tsys_checkpoint_policy_each(const tsys_model_desc *desc, tsys_checkpoint_policy_fn fn, void *user);
// auto's ranking: a candidate that fits beats one that does not; among those that fit the least cost
// (tsys_checkpoint_plan_cost), then the smaller peak; among those that do not, the smaller peak.
TSYSDEF bool tsys_checkpoint_candidate_better(bool fits, double cost, double peak, bool best_fits, double best_cost, double best_peak);

// What a policy costs, from the accounting of what each op keeps for backward and the FLOPs of the
// recomputed ops (formulas at >>checkpoint planner). Bytes are what the memory tracker counts.
typedef struct tsys_checkpoint_plan {
    tsys_checkpoint_policy policy;
    char name[48];               // the policy, canonical
    int64_t batch, context;
    tsys_dtype dtype;            // autocast dtype (F32: none)
    bool optimizer;              // AdamW state in the peak
    double block_bytes;          // what one block keeps for backward without checkpointing
    double kept_block_bytes;     // what the blocks keep after the forward under the policy, per block
    double kept_bytes;           // what the whole forward keeps (blocks, embedding, final norm, lm_head, loss)
    double fixed_bytes;          // parameters, optimizer state, the batch (gradients are made by layer in backward)
    double peak_bytes;           // predicted peak of the step (forward, backward, optimizer)
    double step_flops;           // matmul FLOPs of forward + backward without recomputation
    double recompute_flops;      // matmul FLOPs the recomputation adds
    double recompute_bytes;      // bytes the recomputed elementwise ops (norms, casts, SwiGLU, softmax) move
    double budget;               // auto: the budget; the plan fits when peak_bytes <= budget
    bool fits;
} tsys_checkpoint_plan;
// policy: any policy string (auto:BYTES: the planner's choice; when nothing fits, the plan with the
// least predicted peak, fits = false). dtype: the autocast dtype. The model desc's own checkpoint is ignored.
TSYSDEF tsys_status tsys_checkpoint_plan_make(const tsys_model_desc *desc, const char *policy, int64_t batch, int64_t context, tsys_dtype dtype,
                                              bool optimizer, tsys_checkpoint_plan *out, char *err, size_t err_len);
// The same for a step described by flags: the optimizer's state in the peak (OPTIMIZER), AdamW's kept
// low-precision weights in place of the step's casts (KEPT_COPIES, tsys_optim_keep_lowp; with an
// optimizer under autocast), the optimizer in backward giving each layer's gradients back
// (FREE_GRADS, TSYS_OPTIM_FREE_GRADS), a model that computes in dtype throughout instead of under
// autocast (PURE, as FSDP's gathered compute-dtype weights make it: the residual stream and the norms'
// inputs are kept in dtype, no weight is cast), the linear weights' gradients kept in the autocast
// dtype (LOWP_GRADS, tsys_model_set_grad_dtype). tsys_checkpoint_plan_make is OPTIMIZER or nothing.
#define TSYS_PLAN_OPTIMIZER 1u
#define TSYS_PLAN_KEPT_COPIES 2u
#define TSYS_PLAN_FREE_GRADS 4u
#define TSYS_PLAN_PURE 8u
#define TSYS_PLAN_LOWP_GRADS 16u
TSYSDEF tsys_status tsys_checkpoint_plan_make_ex(const tsys_model_desc *desc, const char *policy, int64_t batch, int64_t context, tsys_dtype dtype,
                                                 unsigned flags, tsys_checkpoint_plan *out, char *err, size_t err_len);
// Extra step time of the recomputation at the given rates (TFLOP/s for matmuls, GB/s for elementwise).
TSYSDEF double tsys_checkpoint_plan_extra_ms(const tsys_checkpoint_plan *p, double tflops, double gbps);
// What auto ranks policies by: the extra ms on a nominal machine (400 TFLOP/s, 2 TB/s).
TSYSDEF double tsys_checkpoint_plan_cost(const tsys_checkpoint_plan *p);
// The plan in a few lines: policy, what is kept and what is recomputed, predicted peak, extra time.
TSYSDEF void tsys_checkpoint_plan_print(const tsys_checkpoint_plan *p, FILE *f, double tflops, double gbps);
TSYSDEF const tsys_checkpoint_plan *tsys_model_checkpoint_plan(const tsys_model *m);   // the last forward's (NULL before / none)
// The memory of one step of the model from its shapes alone: what the tape keeps for backward, op by
// op, and the state the step holds (the memory driver prints it beside the tracker's measurement).
typedef struct tsys_model_mem_estimate {
    int64_t params;            // fp32 master weights (+ autocast's low-precision copies, alive through backward)
    int64_t grads, optimizer;  // fp32 gradients (steps with backward), AdamW m and v (train)
    int64_t saved_per_layer;   // activations one block keeps for backward
    int64_t saved_outside;     // those of the embedding, the final norm, lm_head and the loss
    int64_t activations;       // saved_per_layer x num_layers + saved_outside (0 without backward)
    int64_t temporaries;       // the largest short-lived buffers alive at the peak
    const char *temporaries_what;
    int64_t peak;              // the sum: where the peak is (end of forward / start of backward)
    int num_layers;
} tsys_model_mem_estimate;
TSYSDEF tsys_model_mem_estimate tsys_model_mem_predict(const tsys_model_desc *desc, int64_t batch, int64_t T, tsys_dtype compute, bool backward, bool optimizer);
// The same with AdamW keeping the compute-dtype weights (tsys_optim_keep_lowp, when kept_copies and an
// optimizer under autocast): a copy of every parameter held across the step, in place of the step's copies.
TSYSDEF tsys_model_mem_estimate tsys_model_mem_predict_kept(const tsys_model_desc *desc, int64_t batch, int64_t T, tsys_dtype compute, bool backward, bool optimizer,
                                                            bool kept_copies);

// optimizers and training utilities
// AdamW desc, 0 = default: lr 1e-3 | beta1 0.9 | beta2 0.999 | eps 1e-8 | weight_decay 0.01.
// weight_decay 0 cannot be asked for with 0; set no_weight_decay instead. As torch.optim, the
// constructors refuse (NULL, and an error naming the field and its rule) lr < 0, eps < 0, a beta
// outside [0, 1), weight_decay < 0, and NaN or infinity anywhere; so does tsys_optim_set_lr, which
// then keeps the rate it had. params must hold n (>= 0) tensors of ctx.
typedef struct tsys_optim_desc {
    float lr, beta1, beta2, eps, weight_decay;
    bool no_weight_decay;
    // AdamW: no moments at construction; tsys_optim_shard_state makes those of the parameters it lists, and until then
    // every update is refused. The whole moments never exist (ZeRO-1's memory from the start: tsys_ddp's shard_state).
    bool sharded_state;
} tsys_optim_desc;

typedef struct tsys_optim tsys_optim;
TSYSDEF tsys_optim *tsys_adamw_new(tsys_ctx *ctx, tsys_tensor **params, int n, const tsys_optim_desc *desc);
TSYSDEF tsys_optim *tsys_sgd_new(tsys_ctx *ctx, tsys_tensor **params, int n, float lr);
TSYSDEF tsys_status tsys_optim_step(tsys_optim *opt);
TSYSDEF void tsys_optim_zero_grad(tsys_optim *opt);
TSYSDEF void tsys_optim_release_grads(tsys_optim *opt);   // tsys_release_grads on its parameters
// The optimizer inside backward: between overlap_begin (before tsys_backward) and overlap_end (after
// it, instead of tsys_optim_step), each group of parameters whose gradients are made together (a
// model's layer; any other tensor alone) is updated on TSYS_STREAM_BACKGROUND as soon as its gradients
// are final, after them by an event: its blocks take the SMs backward's kernels leave (a GEMM's last
// wave), never those backward is waiting for. The same kernels in the same order per parameter as
// tsys_optim_step, so the result is bitwise the same. overlap_end joins the background stream into
// the compute stream and updates what backward did not reach. Works
// inside a captured CUDA graph (the event pairs become the graph's fork and join). What needs every
// gradient before any update does not fit this mode: clip by global norm and the fp16 loss scaler's
// inf check; and DDP, whose buckets do not follow the groups (a group could be updated before its
// bucket is reduced): there DDP says when (TSYS_OPTIM_CALLER_READY, tsys_ddp_optim_in_backward). For the
// others, tsys_optim_step after backward.
TSYSDEF tsys_status tsys_optim_overlap_begin(tsys_optim *opt);
TSYSDEF tsys_status tsys_optim_overlap_end(tsys_optim *opt);
// Gradients summed over ranks as AdamW reads them (tsys_ddp's desc.ce_gather: the peers' gradients are copied
// in, not all-reduced). Each parameter's gradient becomes the sum over ranks r = 0 .. nranks - 1, in rank order,
// of rank `self`'s p->grad and the other ranks' terms, widened to fp32 and divided by nranks: the copy-engine
// all-reduce's average, bit for bit. terms: bytes on the parameters' device (any dtype), nranks - 1 slots
// `stride_bytes` apart (0: G), each starting with the G bytes of every parameter's gradient back to back in the
// optimizer's order, each in its gradient dtype (tsys_tensor_grad_dtype: fp32, or bf16 / f16 where it is kept
// so), as DDP lays out the gradients it makes; rank r's slot is r - (r > self); it holds at least
// (nranks - 2) x stride_bytes + G bytes. Every gradient must start at a multiple of its element size in each
// slot. AdamW over fp32 parameters only; in backward only as the caller says (TSYS_OPTIM_CALLER_READY), each
// update reading its terms as they are then. terms NULL: plain gradients again.
TSYSDEF tsys_status tsys_optim_sum_grads(tsys_optim *opt, tsys_tensor *terms, int nranks, int self, int64_t stride_bytes);
// The same with each parameter's place in a slot given: at[i] the byte offset of parameter i's gradient terms in
// every slot, or -1 for one without terms (its gradient is the ranks' mean already: FSDP's replicated parameters,
// all-reduced). Places must not overlap and must fit in stride_bytes (> 0).
TSYSDEF tsys_status tsys_optim_sum_grads_at(tsys_optim *opt, tsys_tensor *terms, int nranks, int self, int64_t stride_bytes, const int64_t *at);
// Flags of overlap_begin_ex. FREE_GRADS: each group is updated on the compute stream (in order, so no
// event is needed) and a model's gradients of that group are given back right after its update, as
// tsys_release_grads would after the step: the peak holds the parameters, the optimizer state, the
// activations and one layer's gradients (the layer backward is in), not every gradient (torch's
// "optimizer step fused into backward"). The same bits as the ordinary step; after overlap_end the
// model holds no gradients.
#define TSYS_OPTIM_FREE_GRADS 1u
// FUSE_UPDATE (AdamW): a linear weight whose whole gradient one weight-gradient product makes (its one use on
// the tape, no gradient before it) is updated inside that product, on the compute stream: the update reads
// the product's result where it lies (CUDA on sm_90a: AdamW in the GEMM's epilogue, the update's memory
// traffic beside other tiles' matmuls), and the gradient is never written (its .grad, if any, counts as zero
// after backward). Values: the update's bits from the gradient the product gives; that gradient is the
// ordinary one on the CPU (bitwise the same training) and within the GEMM's rounding of cuBLASLt's on CUDA
// (another order of the sums). The other parameters are updated as without the flag. On the H200 the fused
// kernel is not yet faster than cuBLASLt's product and AdamW's kernel (docs/design/step.md).
#define TSYS_OPTIM_FUSE_UPDATE 2u
// CALLER_READY: the gradient hooks launch nothing; the caller says when parameters' gradients are final with
// tsys_optim_overlap_ready, for gradients a hook cannot see finished: DDP's, once a bucket's all-reduce or its
// peers' copies are in (tsys_ddp_optim_in_backward). Allowed with the ranks' terms (tsys_optim_sum_grads).
// overlap_end updates what was not said. Not with FREE_GRADS or FUSE_UPDATE.
#define TSYS_OPTIM_CALLER_READY 4u
TSYSDEF tsys_status tsys_optim_overlap_begin_ex(tsys_optim *opt, unsigned flags);
// Under CALLER_READY: the n parameters' gradients (and terms) are final as of the work queued so far on
// stream `after` of their device: they are updated on the background stream after it, once a step each (a
// parameter said twice is updated once). Every one must be this optimizer's.
TSYSDEF tsys_status tsys_optim_overlap_ready(tsys_optim *opt, tsys_tensor *const *params, int n, tsys_stream after);
// CALLER_READY: parameters this step leaves alone, their update made elsewhere (tsys_ddp's desc.shard_updates: the
// rank that owns them updates them and sends the result): overlap_end does not update them, nothing reads their
// gradients. Their AdamW moments here stay as they were.
TSYSDEF tsys_status tsys_optim_overlap_skip(tsys_optim *opt, tsys_tensor *const *params, int n);
// Kept low-precision weights (AdamW only; opt-in): the optimizer holds a dt (TSYS_BF16 or TSYS_F16)
// copy of every parameter, one block in parameter order ("parameters" memory, tag "kept weight
// copies", 2 bytes a parameter), and its update kernel writes the new copy beside the new fp32 value,
// rounded to nearest even as the cast is. Autocast of dt then reads the copy instead of casting each
// weight every step; a copy counts only while its parameter's storage is at the version it was made
// from (any other write of the parameter: the next use casts into the copy again). Bitwise the same
// training as without it. TSYS_F32 gives the copies back. Call before capturing a step in a CUDA graph
// and run one eager step first: the copies' addresses are fixed, the captured forward reads them and
// the captured AdamW writes them; whether a weight is cast was decided at capture, so a parameter
// written outside the graph between replays (a checkpoint load) needs an eager step or a new capture.
// The copies belong to the optimizer's own parameters: under FSDP (an optimizer of shards, a forward
// of gathered weights) nothing reads them but its copy-engine transfers (tsys_fsdp_desc.ce_transfers),
// which send each shard's copy to the ranks' gathered weights.
TSYSDEF tsys_status tsys_optim_keep_lowp(tsys_optim *opt, tsys_dtype dt);
// The same with each parameter's copy given: copies[i] a bf16 or f16 tensor (one dtype for all) of parameter i's
// number of elements on its device, or NULL for none, which the caller keeps alive until the copies are given back
// (tsys_optim_keep_lowp(opt, TSYS_F32), another keep, or tsys_optim_free). The updates write them as they write the
// optimizer's own block (tsys_fsdp's ce_transfers: each shard's copy is its rank's part of the unit's gathered weights,
// so the update itself writes the weights the copy engines send).
TSYSDEF tsys_status tsys_optim_keep_lowp_into(tsys_optim *opt, tsys_tensor *const *copies);
TSYSDEF tsys_dtype tsys_optim_lowp(const tsys_optim *opt);   // TSYS_F32 when off
TSYSDEF void tsys_optim_set_lr(tsys_optim *opt, float lr);
TSYSDEF int64_t tsys_optim_steps(const tsys_optim *opt);
TSYSDEF tsys_tensor *tsys_optim_state(tsys_optim *opt, int param_index, int which);  // AdamW: 0 = m, 1 = v
// AdamW's moments kept only for the n parameters `held` lists (each one of the optimizer's), the others' given
// back: ZeRO-1's memory where each parameter has one rank that updates it (tsys_ddp's desc.shard_state). This
// optimizer must then never update the others (tsys_optim_overlap_skip them; a step that reaches one fails, naming
// it); tsys_optim_state gives NULL for them and tsys_state_save refuses the optimizer (a sharded snapshot holds its
// part). Before the first step; listing every parameter keeps every moment again.
TSYSDEF tsys_status tsys_optim_shard_state(tsys_optim *opt, tsys_tensor *const *held, int n);
TSYSDEF void tsys_optim_free(tsys_optim *opt);
TSYSDEF double tsys_clip_grad_norm(tsys_ctx *ctx, tsys_tensor **params, int n, double max_norm);   // returns the norm before clipping
// The cs336 schedule: max_lr * it / warmup_iters while it < warmup_iters; then the cosine from max_lr
// down to min_lr until it reaches cosine_cycle_iters; min_lr from there on (a cycle equal to the warmup
// has no cosine part: min_lr right after the warmup). NAN for nonsense (which tsys_optim_set_lr
// refuses): it < 0, warmup_iters < 0, cosine_cycle_iters < warmup_iters, a rate that is NaN or negative.
TSYSDEF double tsys_cosine_lr(int64_t it, double max_lr, double min_lr, int64_t warmup_iters, int64_t cosine_cycle_iters);
TSYSDEF void tsys_zero_grads(tsys_ctx *ctx, tsys_tensor **params, int n);          // lazy: marks them zero (see the implementation)
TSYSDEF void tsys_release_grads(tsys_ctx *ctx, tsys_tensor **params, int n);       // zero_grad(set_to_none=True): a model's gradients are given back
TSYSDEF tsys_status tsys_grads_settle(tsys_ctx *ctx, tsys_tensor **params, int n); // writes the zeros of gradients marked zero

// fp16 dynamic loss scaling, torch.cuda.amp.GradScaler semantics
typedef struct tsys_grad_scaler {
    float scale;             // 65536 initially
    float growth_factor;     // 2
    float backoff_factor;    // 0.5
    int growth_interval;     // 2000
    int growth_tracker;      // clean steps since the last change
    bool found_inf;          // set by tsys_grad_scaler_unscale
} tsys_grad_scaler;
TSYSDEF tsys_grad_scaler tsys_grad_scaler_init(void);
TSYSDEF tsys_tensor *tsys_grad_scaler_scale(tsys_ctx *ctx, tsys_grad_scaler *s, tsys_tensor *loss);   // loss * scale (recorded)
TSYSDEF tsys_status tsys_grad_scaler_unscale(tsys_ctx *ctx, tsys_grad_scaler *s, tsys_tensor **params, int n);
TSYSDEF tsys_status tsys_grad_scaler_step(tsys_grad_scaler *s, tsys_optim *opt);   // unscales (once) and steps unless inf/nan
TSYSDEF void tsys_grad_scaler_update(tsys_grad_scaler *s);

// safetensors
TSYSDEF tsys_status tsys_safetensors_save(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n);
// With "__metadata__" strings besides "format": "pt": n_metadata pairs, metadata[2i] -> metadata[2i+1]
// (a "format" pair replaces the default one).
TSYSDEF tsys_status tsys_safetensors_save_ex(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n, const char *const *metadata, int n_metadata);
// Loads every tensor of the file onto dev; *out is an array of *n new tensors (named), free with tsys_tensor_list_free.
TSYSDEF tsys_status tsys_safetensors_load(tsys_ctx *ctx, const char *path, tsys_device dev, tsys_tensor ***out, int *n);
TSYSDEF void tsys_tensor_list_free(tsys_tensor **list, int n);
// Copies the named tensors of the file into the given tensors (names, shapes and dtypes must match;
// F32 file data may fill BF16/F16 tensors and the other way round).
TSYSDEF tsys_status tsys_safetensors_load_into(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n);
// Saves the parameters, and the dimensions as "__metadata__" strings (vocab_size, context_length,
// d_model, d_ff, num_layers, num_heads, rope_theta, eps) for tsys_model_desc_from_file.
TSYSDEF tsys_status tsys_model_save(tsys_model *m, const char *path);
// The model desc a checkpoint was saved from: the dimensions tsys_model_save wrote into the file's
// "__metadata__" (attn and checkpoint are left 0, the defaults). A Hugging Face Llama checkpoint (path
// its directory or its model.safetensors) takes them from the config.json beside it: hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads, vocab_size, max_position_embeddings
// (default 2048), rope_theta (10000), rms_norm_eps (1e-6); what tsys cannot run is refused (grouped-
// query attention, a head_dim other than hidden_size / heads, scaled RoPE, biases, an activation
// other than silu). A file with neither is refused, and so is a missing or malformed key; err names
// the file and the key.
TSYSDEF tsys_status tsys_model_desc_from_file(const char *path, tsys_model_desc *out, char *err, size_t err_len);
// Loads a model's parameters, strictly by default (PyTorch's load_state_dict(strict=True)): a
// parameter the file lacks, or a tensor of the file the model lacks, is an error naming it, and no
// parameter is written. tsys_model_load(m, path) is tsys_model_load_ex(m, path, NULL).
// Names of other tools load too: leading "_orig_mod." and "module." prefixes are dropped, name by name,
// and a Hugging Face LlamaForCausalLM checkpoint (model.embed_tokens.weight, model.layers.N...) is
// mapped to tsys's names, its q/k rows permuted from rotate-half RoPE to interleaved pairs, lm_head
// taken from the embedding when the file has none (tied). path may be a directory holding
// model.safetensors (save_pretrained's layout). The map is in >>safetensors ("names of other tools").
// CS336's spring-2026 model (half-split RoPE output: the rotated pairs concatenated, not re-interleaved)
// loads as it is: it pairs the same (2j, 2j + 1) columns and permutes q and k alike, so its weights,
// Q K^T and logits are tsys's; only its intermediate q/k layout differs, which no file holds.
// tsys_model_load_desc, 0 = default (strict):
//   allow_unexpected   tensors of the file that the model does not have are skipped
//   allow_missing      parameters the file does not hold keep their values
typedef struct tsys_model_load_desc {
    bool allow_unexpected;
    bool allow_missing;
} tsys_model_load_desc;
TSYSDEF tsys_status tsys_model_load(tsys_model *m, const char *path);
TSYSDEF tsys_status tsys_model_load_ex(tsys_model *m, const char *path, const tsys_model_load_desc *desc);

// Training state: snapshots to resume a run from (not activation checkpointing, which is
// tsys_checkpoint_begin/end). A snapshot is a directory DIR/<name> ("step-000123" by default) of
//   model.safetensors        the tensors: a model's parameters under their names (the model's dims in
//                            "__metadata__", as tsys_model_save writes them), then desc.tensors
//   train_state.safetensors  AdamW's moments as "optim.state.<param name>.exp_avg" and ".exp_avg_sq"
//                            (PyTorch's names); in "__metadata__": the optimizer, its hyper-parameters
//                            and step count, the loss scaler, the context's RNG, the step, the user
//                            record ("user.<key>")
//   MANIFEST                 written last: each file's size and CRC-32C, the snapshot's serial number
// It is written as a temporary DIR/.tmp-*, every file and the directory fsynced, then renamed into
// place and DIR fsynced: after a crash at any moment DIR holds the snapshots it held before, and the
// new one either complete or not at all. keep_last removes older snapshots only once the new one is
// durable. The kept low-precision copies (tsys_optim_keep_lowp) are not saved: the loaded parameters
// make them again at their next use, bitwise the same. docs/design/state.md has the format.
#define TSYS_STATE_MAX_USER 32        // pairs in a user record
#define TSYS_STATE_KEY_LEN 64         // bytes of a user key, NUL included
#define TSYS_STATE_VALUE_LEN 256      // bytes of a user value, NUL included
typedef struct tsys_state_desc {
    tsys_model *model;            // its parameters and dims, or NULL
    tsys_tensor **tensors;        // named tensors besides the model's (or instead of a model)
    int n_tensors;
    tsys_optim *optim;            // AdamW: m, v, the step count, hyper-parameters; SGD: step, lr; or NULL
    tsys_grad_scaler *scaler;     // or NULL
    bool no_rng;                  // the context's RNG is not saved (save) / left as it is (load)
    const char *const *user;      // save: n_user pairs user[2i] -> user[2i + 1] (keys: letters, digits, '_', '.', '-')
    int n_user;
    int64_t step;                 // save: the training step (>= 0), recorded, and the name "step-%06lld"
    const char *name;             // save: the directory's name instead (no '/', not starting with '.')
    int keep_last;                // save: > 0 keeps only the newest keep_last snapshots of DIR
} tsys_state_desc;
// What a load read besides tensors: the step, the serial number, the user record.
typedef struct tsys_state_info {
    int64_t step, serial;
    int n_user;
    char key[TSYS_STATE_MAX_USER][TSYS_STATE_KEY_LEN];
    char value[TSYS_STATE_MAX_USER][TSYS_STATE_VALUE_LEN];
} tsys_state_info;
// Saves what desc lists as a new snapshot in DIR (made if missing; its parent must exist). A snapshot
// of the same name is replaced (atomically too: until the new one is in place the old one is there,
// under another name). Temporaries left in DIR by dead writers of this host are removed. One writer
// per DIR at a time (under DDP: rank 0; the others load once it is in place, from a directory they
// all see).
TSYSDEF tsys_status tsys_state_save(tsys_ctx *ctx, const char *dir, const tsys_state_desc *desc);
// Loads the snapshot at path (DIR/<name>) into what desc lists, after every file's size and checksum
// are verified (a truncated or altered file is an error naming it), and every name, shape and dtype is
// checked (strict: desc's tensors and the file's are the same set; with an optimizer, one moment pair
// per parameter, the same kind of optimizer). On any error nothing is written. Restores the optimizer's
// hyper-parameters (as torch's load_state_dict does), step count, the scaler, the RNG (unless no_rng).
// info (may be NULL) gets the step, serial and user record. What desc does not list is not read.
TSYSDEF tsys_status tsys_state_load(tsys_ctx *ctx, const char *path, const tsys_state_desc *desc, tsys_state_info *info);
// The newest complete snapshot of DIR (the highest serial: the one saved last) into buf as
// "DIR/<name>"; buf "" when DIR has none or does not exist (not an error). Temporaries are ignored and
// so are directories whose MANIFEST is missing or damaged, or whose files have other sizes.
TSYSDEF tsys_status tsys_state_latest(tsys_ctx *ctx, const char *dir, char *buf, size_t len);
TSYSDEF const char *tsys_state_info_get(const tsys_state_info *info, const char *key);   // NULL when absent

// Asynchronous snapshots: tsys_state_save in two halves, so that training goes on while the files are
// written. tsys_state_save_async checks desc as tsys_state_save does, takes the host part at once (the
// step, the optimizer's count and hyper-parameters, the scaler, the RNG, the user record) and copies the
// tensors into host memory the saver keeps: CPU tensors at once, device tensors on TSYS_STREAM_COPY
// into page-locked memory, after the work queued so far, without waiting. A thread of the saver waits
// for the copies and writes the snapshot exactly as tsys_state_save would (files, rename, keep_last).
// Until the copies are done, the library's own writes of what desc lists wait for them on the device
// (tsys_optim_step, the optimizer in backward, CUDA graph capture and replay, loads); anything else
// that writes those tensors calls tsys_state_saver_copied first. One snapshot is in flight per saver:
// a save while one is being written waits for it, and fails with its error if it failed. The staging
// memory (the snapshot's tensor bytes, pinned on CUDA) is kept for the next save; the saver must be
// freed before the tensors it copies. Without POSIX threads the files are written before it returns.
typedef struct tsys_state_saver tsys_state_saver;
typedef struct tsys_state_saver_stats {
    int64_t saves;        // snapshots written whole
    int64_t bytes;        // tensor bytes of the last one
    double stage_ms;      // the last one's time in tsys_state_save_async (what holds the caller up)
    double copy_ms;       // from that call until its copies were done
    double write_ms;      // from then until it was durable in place (keep_last included)
} tsys_state_saver_stats;
TSYSDEF tsys_state_saver *tsys_state_saver_new(tsys_ctx *ctx);   // NULL + the context's error
TSYSDEF tsys_status tsys_state_save_async(tsys_state_saver *sv, const char *dir, const tsys_state_desc *desc);
// Allocates now the staging memory a save of desc needs, so that the first save does not pay for it
// (page-locked memory is slow to get: about a second for a few GB). Optional.
TSYSDEF tsys_status tsys_state_saver_reserve(tsys_state_saver *sv, const tsys_state_desc *desc);
// Stages the device tensors in device memory first (default: off). A save then holds the next update of
// those tensors only for a device-to-device copy (twice the bytes at the device's memory bandwidth:
// milliseconds) instead of for the copy to the host (PCIe: 0.2 s for 12 GB); the price is a second copy
// of the tensors in device memory, kept for the next save. Takes effect at the next save or reserve.
TSYSDEF tsys_status tsys_state_saver_stage_on_device(tsys_state_saver *sv, bool on);
TSYSDEF tsys_status tsys_state_saver_copied(tsys_state_saver *sv);   // the host waits for the copies in flight
TSYSDEF tsys_status tsys_state_saver_wait(tsys_state_saver *sv);     // ... and for the snapshot: in place, or its error
TSYSDEF bool tsys_state_saver_busy(const tsys_state_saver *sv);      // a snapshot is still being written
TSYSDEF tsys_state_saver_stats tsys_state_saver_stats_get(const tsys_state_saver *sv);
TSYSDEF void tsys_state_saver_free(tsys_state_saver *sv);            // waits (an error is lost: wait first); NULL: nothing

// Sharded snapshots, the building blocks (tsys_dist.h's ZeRO-1 and FSDP snapshots are made of them; the
// format in docs/design/state.md). Every saved tensor is a chunk of a global tensor: its fqn (the
// parameter's name, or "optim.state.<name>.exp_avg"/".exp_avg_sq"), the global shape, and the flat
// element range [offset, offset + numel(t)) of the row-major global tensor that t holds. Any sharding
// loads into any other: a reader finds each range asked for among the chunks, whoever saved them.
typedef struct tsys_state_chunk {
    const char *fqn;
    tsys_tensor *t;                  // contiguous; its dtype is the saved one
    int ndim;
    int64_t shape[TSYS_MAX_DIMS];    // the global tensor's
    int64_t offset;                  // elements of the global tensor before t's first
} tsys_state_chunk;
// A written part: its file name in the snapshot, size and CRC-32C (what the MANIFEST records).
typedef struct tsys_state_part {
    char file[64];
    uint64_t bytes;
    uint32_t crc32c;
} tsys_state_part;
// The steps of a sharded save: begin (one process: makes DIR if missing, removes the temporaries of dead
// writers, makes a temporary DIR/.tmp-* and returns its path in tmp), then each process writes its part
// into tmp (on a file system they all see), then commit (one process, after every part is written).
TSYSDEF tsys_status tsys_state_begin(tsys_ctx *ctx, const char *dir, char *tmp, size_t len);
// tmp/file: a safetensors of the chunks, under their fqns (a whole chunk in its global shape, a part of
// one 1-D), "chunk.<fqn>" = "<offset> <d0>,<d1>..." in "__metadata__", and what desc gives (may be
// NULL): the model's dims, the optimizer's hyper-parameters and step count, the scaler, the RNG (unless
// no_rng), step and user record. desc's tensors are not saved (pass them as chunks). out: size, CRC.
TSYSDEF tsys_status tsys_state_part_write(tsys_ctx *ctx, const char *tmp, const char *file, const tsys_state_chunk *chunks, int n,
                                          const tsys_state_desc *desc, tsys_state_part *out);
typedef struct tsys_state_commit_desc {
    const char *name;                // the snapshot's name (as tsys_state_desc.name; NULL: "step-%06lld")
    int64_t step;
    int world;                       // the processes that wrote parts (the MANIFEST's world line), 0: a plain snapshot
    const char *layout;              // how they split the state ("zero1", "fsdp"...: letters, digits, '_'), or NULL
    const tsys_state_part *parts;
    int n_parts;                     // at most TSYS_STATE_MAX_PARTS
    int keep_last;
} tsys_state_commit_desc;
#define TSYS_STATE_MAX_PARTS 256
// Writes tmp/MANIFEST (the parts' sizes and checksums, the next serial), renames tmp to DIR/<name> (a
// snapshot of that name is replaced as tsys_state_save does) and applies keep_last.
TSYSDEF tsys_status tsys_state_commit(tsys_ctx *ctx, const char *dir, const char *tmp, const tsys_state_commit_desc *c);
TSYSDEF void tsys_state_abort(const char *tmp);   // removes a temporary that will not be committed
// Reading any snapshot, sharded or plain (whose tensors are whole chunks), by ranges. Opening reads
// and checks the MANIFEST and every file's header; a file's checksum is verified the first time a range
// is checked or read from it.
typedef struct tsys_state_reader tsys_state_reader;
TSYSDEF tsys_state_reader *tsys_state_open(tsys_ctx *ctx, const char *path);   // NULL + the error
TSYSDEF int tsys_state_reader_world(const tsys_state_reader *r);               // 0: a plain snapshot
TSYSDEF int64_t tsys_state_reader_step(const tsys_state_reader *r);
// The global tensors, in name order: i from 0 to count - 1 (the shape into shape[TSYS_MAX_DIMS]).
TSYSDEF int tsys_state_reader_count(const tsys_state_reader *r);
TSYSDEF const char *tsys_state_reader_tensor(const tsys_state_reader *r, int i, tsys_dtype *dtype, int *ndim, int64_t *shape);
// Whether elements [offset, offset + numel) of fqn, a global tensor of that shape and dtype, are all
// saved (an error naming the fqn and the first element missing), and the files holding them verified.
TSYSDEF tsys_status tsys_state_check_range(tsys_state_reader *r, const char *fqn, int ndim, const int64_t *shape, tsys_dtype dt,
                                           int64_t offset, int64_t numel);
// Reads elements [offset, offset + numel(dst)) of fqn into dst (of the saved dtype), reading only the
// overlapping bytes of each chunk.
TSYSDEF tsys_status tsys_state_read(tsys_state_reader *r, const char *fqn, int64_t offset, tsys_tensor *dst);
// What a load sets besides tensors, from part `part`'s metadata (a plain snapshot's train_state; a
// part without an optimizer's state: the first that has it): desc's optimizer (hyper-parameters, step
// count), scaler, RNG (unless no_rng), info (may be NULL). apply false: only checked.
TSYSDEF tsys_status tsys_state_read_host(tsys_state_reader *r, int part, const tsys_state_desc *desc, tsys_state_info *info, bool apply);
TSYSDEF void tsys_state_close(tsys_state_reader *r);
// Writes the snapshot at src (sharded or not) as a plain one into DIR dst, under src's name: every
// tensor whole, model.safetensors loadable by tsys_model_load and safetensors.torch. One process.
TSYSDEF tsys_status tsys_state_consolidate(tsys_ctx *ctx, const char *src, const char *dst);

// Replacing a file whole (safetensors, traces, the drivers' reports): the content is written to a
// temporary beside path, "<path>.tmp.XXXXXX", created exclusively (0644 less the umask; never through
// a symlink, never someone else's file), then checked, fsynced and renamed over path, and the
// directory is fsynced. Readers see the old file or the new one, never a part of one; processes
// saving one path at once each leave a whole file (the last rename wins). On any failure, and on
// abort, the temporary is removed and path is untouched. `what` starts the messages ("safetensors"
// gives "safetensors '<path>': ..."); ctx may be NULL (no message is kept).
//   tsys_atomic_file af;
//   if (tsys_atomic_file_open(ctx, "report", path, &af) != TSYS_OK) return ...;
//   fprintf(af.f, ...);                        // any stdio writes
//   tsys_status s = tsys_atomic_file_commit(ctx, &af);   // or tsys_atomic_file_abort(&af)
typedef struct tsys_atomic_file {
    FILE *f;              // write the new content here
    char *path, *tmp;     // the final name and the temporary's (owned)
    const char *what;
} tsys_atomic_file;
TSYSDEF tsys_status tsys_atomic_file_open(tsys_ctx *ctx, const char *what, const char *path, tsys_atomic_file *af);
TSYSDEF tsys_status tsys_atomic_file_commit(tsys_ctx *ctx, tsys_atomic_file *af);
TSYSDEF void tsys_atomic_file_abort(tsys_atomic_file *af);

// profiler: host time of every op (and, where the backend reports it, device time of every kernel),
// built on the trace hooks. Outputs: an op table like torch.profiler's key_averages().table(), a
// kernel table like nsys stats' cuda_gpu_kern_sum (per phase, matmuls apart), a Chrome trace (Perfetto).
// Phases are the outermost named ranges open (tsys_trace_begin "forward", "backward", "optimizer").
typedef struct tsys_profiler tsys_profiler;
TSYSDEF tsys_profiler *tsys_profiler_begin(tsys_ctx *ctx);            // installs its hooks (chaining the ones there)
TSYSDEF tsys_status tsys_profiler_end(tsys_profiler *p);              // syncs, gives the hooks back, collects device times
TSYSDEF void tsys_profiler_print_ops(const tsys_profiler *p, FILE *f, int max_rows);     // sorted by device time
TSYSDEF void tsys_profiler_print_kernels(const tsys_profiler *p, FILE *f, int max_rows); // per kernel name, per phase
TSYSDEF tsys_status tsys_profiler_write_trace(const tsys_profiler *p, const char *path); // Chrome trace JSON
TSYSDEF double tsys_profiler_kernel_ms(const tsys_profiler *p, const char *phase);        // sum of kernel device times (phase NULL = all)
TSYSDEF int tsys_profiler_op_calls(const tsys_profiler *p, const char *name, tsys_trace_kind kind);
TSYSDEF double tsys_profiler_matmul_ms(const tsys_profiler *p, const char *phase);        // the GEMMs' part of it
TSYSDEF double tsys_profiler_span_ms(const tsys_profiler *p, const char *name);          // device ms under every span of that name (op, region or range)
// The kernel with the most device time in a phase (NULL = all): matmul -1 any, 0 only non-matmul,
// 1 only matmul kernels; its total ms and launches go to *ms and *calls. NULL when there is none.
TSYSDEF const char *tsys_profiler_top_kernel(const tsys_profiler *p, const char *phase, int matmul, double *ms, int *calls);
TSYSDEF void tsys_profiler_free(tsys_profiler *p);
// A backend that can time kernels on its device fills them in here (tsys_cuda.cuh: CUPTI, else
// events); by default a kernel's device time is its host time, exact on the CPU. collect's put may be
// called several times for one launch (its device kernels add up); start_us < 0 = start unknown.
typedef struct tsys_profiler_device_clock {
    void *(*begin)(tsys_ctx *ctx);                                           // returns the clock's state
    void (*launch)(void *state, uint64_t seq, bool begin);                   // around each launch
    tsys_status (*collect)(void *state, void (*put)(void *p, uint64_t seq, double start_us, double dur_us), void *p);
    void (*end)(void *state);
} tsys_profiler_device_clock;
TSYSDEF void tsys_profiler_set_device_clock(tsys_ctx *ctx, tsys_device dev, const tsys_profiler_device_clock *clock);

// memory snapshot: the allocations of one device as torch.cuda.memory._snapshot() describes them, a
// pickle that pytorch.org/memory_viz and `python -m torch.cuda._memory_viz` read, built on the trace
// hooks (chaining the ones there). It follows every allocation and free on dev from begin on, each
// with its frames: the op that allocated with the tensor's shape and dtype, then the ops, backward
// ops, model regions and the phase (the named range) open at the time. Begin it before the
// allocations it should see (the model, the optimizer): a free of memory allocated before begin is
// only counted (stats.unmatched). The trace holds what happened since the last restart (or begin);
// write puts it, and what is live at that moment, in path (replaced whole: tsys_atomic_file).
//   tsys_mem_snapshot *s = tsys_mem_snapshot_begin(ctx, TSYS_CUDA);
//   ... setup, warmup step ...
//   tsys_mem_snapshot_restart(s);              // the trace starts again with what is live now
//   ... the step to look at ...
//   tsys_mem_snapshot_write(s, "step.pickle");
//   tsys_mem_snapshot_free(s);                 // gives the hooks back (end them in reverse order of begin)
typedef struct tsys_mem_snapshot tsys_mem_snapshot;
typedef struct tsys_mem_snapshot_stats {
    size_t allocs, frees;           // in the trace (a restart opens it with an allocation per live block)
    int64_t live_bytes, peak_bytes; // what the trace replays to now, and its highest since the restart
    long unmatched;                 // frees of allocations made before begin
    bool complete;                  // false once the host ran out of memory for it (write then fails)
} tsys_mem_snapshot_stats;
TSYSDEF tsys_mem_snapshot *tsys_mem_snapshot_begin(tsys_ctx *ctx, tsys_device dev);   // NULL on bad args or no host memory
TSYSDEF void tsys_mem_snapshot_restart(tsys_mem_snapshot *s);
TSYSDEF tsys_mem_snapshot_stats tsys_mem_snapshot_stats_get(const tsys_mem_snapshot *s);
TSYSDEF tsys_status tsys_mem_snapshot_write(const tsys_mem_snapshot *s, const char *path);
TSYSDEF void tsys_mem_snapshot_end(tsys_mem_snapshot *s);    // gives the hooks back; the snapshot stays readable
TSYSDEF void tsys_mem_snapshot_free(tsys_mem_snapshot *s);   // ends it first if needed

// bench helpers
typedef struct tsys_stats { double mean, std, median, min, max; int n; } tsys_stats;
TSYSDEF tsys_stats tsys_stats_of(const double *x, int n);
TSYSDEF double tsys_cpu_sgemm_gflops(int n, int reps);   // measured CBLAS sgemm rate on an n x n x n product

// gemm rate: the rate of the GEMM path the ops take (tsys_matmul on dev, under the context's settings),
// the ceiling an MFU is measured against. 2 untimed n x n x n products of random dt matrices, then
// reps timed ones (each between two tsys_sync): the stats of their TFLOP/s (max: the peak; n = 0 when
// the tensors could not be made, the context's error then cleared). Allocates 3 n x n tensors on dev.
TSYSDEF tsys_stats tsys_gemm_rate(tsys_ctx *ctx, tsys_device dev, tsys_dtype dt, int n, int reps);

#ifdef __cplusplus
}
#endif
#endif // TSYS_H_INCLUDED

// =================================================================================================
//                                        IMPLEMENTATION
// =================================================================================================
#if (defined(TSYS_IMPLEMENTATION) || defined(TSYS_IMPL)) && !defined(TSYS_IMPLEMENTATION_INCLUDED)
#define TSYS_IMPLEMENTATION_INCLUDED

// >>config ----------------------------------------------------------------------------------------
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <math.h>
#include <time.h>
#include <errno.h>
#include <assert.h>
#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#define TSYS__POSIX 1
#ifndef O_CLOEXEC
#define O_CLOEXEC 0
#endif
#ifndef O_NOFOLLOW
#define O_NOFOLLOW 0
#endif
#endif

#if defined(TSYS_MALLOC) && defined(TSYS_FREE) && defined(TSYS_REALLOC)
#elif !defined(TSYS_MALLOC) && !defined(TSYS_FREE) && !defined(TSYS_REALLOC)
#define TSYS_MALLOC(sz) malloc(sz)
#define TSYS_REALLOC(p, sz) realloc(p, sz)
#define TSYS_FREE(p) free(p)
#else
#error "Must define all or none of TSYS_MALLOC, TSYS_FREE, and TSYS_REALLOC."
#endif
#ifndef TSYS_ASSERT
#define TSYS_ASSERT(c) assert(c)
#endif
#ifndef TSYS_NO_CBLAS
#include <cblas.h>
#endif
#if defined(_OPENMP) && !defined(TSYS_NO_OPENMP)
#include <omp.h>
#define TSYS__OMP(x) _Pragma(#x)
#else
#define TSYS__OMP(x)
#endif

#define TSYS__MAX_TAGS 256
#define TSYS__MAX_RANGES 64

// TSYS_DEBUG (on unless NDEBUG): every kernel launch is checked against the TSYS_KERNELS contract.
#ifndef TSYS_DEBUG
#ifdef NDEBUG
#define TSYS_DEBUG 0
#else
#define TSYS_DEBUG 1
#endif
#endif
#define TSYS__MIN(a, b) ((a) < (b) ? (a) : (b))
#define TSYS__MAX(a, b) ((a) > (b) ? (a) : (b))

// Records an error (file:line and what failed) in the context and returns the status.
#define TSYS__FAIL(ctx, status, ...) tsys__fail((ctx), (status), __FILE__, __LINE__, __VA_ARGS__)
// Checks a caller-supplied condition; on failure records "func: message" and returns NULL.
#define TSYS__REQUIRE(ctx, cond, ...) do { if (!(cond)) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, __VA_ARGS__); return NULL; } } while (0)
// The same for any public function: returns ret (TSYS_ERR_INVALID_ARGS, NULL, NAN, ...; left empty in a
// function returning void). A NULL ctx has nowhere to keep the message: TSYS__CHECK_ARG(ctx, ctx, ret, ...)
// just returns.
#define TSYS__CHECK_ARG(ctx, cond, ret, ...) do { if (!(cond)) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, __VA_ARGS__); return ret; } } while (0)

// >>structs (private) -----------------------------------------------------------------------------

typedef enum tsys__op {
    TSYS__OP_CAST, TSYS__OP_EMBEDDING, TSYS__OP_LINEAR, TSYS__OP_MATMUL, TSYS__OP_ADD, TSYS__OP_MUL,
    TSYS__OP_SCALE, TSYS__OP_RELU, TSYS__OP_SILU, TSYS__OP_SWIGLU, TSYS__OP_RMSNORM, TSYS__OP_LAYERNORM,
    TSYS__OP_ROPE, TSYS__OP_SOFTMAX, TSYS__OP_TRANSPOSE12, TSYS__OP_VIEW, TSYS__OP_CROSS_ENTROPY,
    TSYS__OP_MSE, TSYS__OP_SUM, TSYS__OP_FLASH_ATTN, TSYS__OP_CUSTOM, TSYS__OP_LINEAR_CE, TSYS__OP_COUNT
} tsys__op;

static const char *tsys__op_names[] = {
    "cast", "embedding", "linear", "matmul", "add", "mul", "scale", "relu", "silu", "swiglu", "rmsnorm",
    "layernorm", "rope", "softmax", "transpose12", "view", "cross_entropy", "mse", "sum", "flash_attention", "custom",
    "linear_cross_entropy",
};
typedef char tsys__op_names_match[(sizeof(tsys__op_names) / sizeof(tsys__op_names[0]) == TSYS__OP_COUNT) ? 1 : -1];

#define TSYS__NODE_IN 4
#define TSYS__NODE_SAVED 6

// What each op keeps for its backward: the index of each value in node->saved, named per op.
enum {
    TSYS__SAVED_LINEAR_X = 0, TSYS__SAVED_LINEAR_W, TSYS__SAVED_LINEAR_COUNT,                 // the compute-dtype copies
    TSYS__SAVED_LCE_DX = 0, TSYS__SAVED_LCE_DW, TSYS__SAVED_LCE_COUNT,                        // the gradients, made in forward
    TSYS__SAVED_MATMUL_A = 0, TSYS__SAVED_MATMUL_B, TSYS__SAVED_MATMUL_COUNT,
    TSYS__SAVED_EMBED_IDS = 0, TSYS__SAVED_EMBED_COUNT,
    TSYS__SAVED_BINARY_A = 0, TSYS__SAVED_BINARY_B, TSYS__SAVED_BINARY_COUNT,                 // mul, swiglu, mse
    TSYS__SAVED_UNARY_X = 0, TSYS__SAVED_UNARY_COUNT,                                          // relu, silu
    TSYS__SAVED_SOFTMAX_Y = 0, TSYS__SAVED_SOFTMAX_COUNT,
    TSYS__SAVED_RMSNORM_X = 0, TSYS__SAVED_RMSNORM_W, TSYS__SAVED_RMSNORM_RSTD, TSYS__SAVED_RMSNORM_COUNT,
    TSYS__SAVED_LAYERNORM_X = 0, TSYS__SAVED_LAYERNORM_W, TSYS__SAVED_LAYERNORM_B, TSYS__SAVED_LAYERNORM_MEAN, TSYS__SAVED_LAYERNORM_RSTD,
    TSYS__SAVED_LAYERNORM_COUNT,
    TSYS__SAVED_CE_LOGITS = 0, TSYS__SAVED_CE_TARGETS, TSYS__SAVED_CE_LSE, TSYS__SAVED_CE_COUNT,
    TSYS__SAVED_FLASH_Q = 0, TSYS__SAVED_FLASH_K, TSYS__SAVED_FLASH_V, TSYS__SAVED_FLASH_O, TSYS__SAVED_FLASH_LSE, TSYS__SAVED_FLASH_COUNT,
};
typedef char tsys__saved_fits[(TSYS__SAVED_LAYERNORM_COUNT <= TSYS__NODE_SAVED && TSYS__SAVED_FLASH_COUNT <= TSYS__NODE_SAVED) ? 1 : -1];
// one backward serves both norms: x and w sit in the same slots
typedef char tsys__saved_norms_agree[(TSYS__SAVED_RMSNORM_X == TSYS__SAVED_LAYERNORM_X && TSYS__SAVED_RMSNORM_W == TSYS__SAVED_LAYERNORM_W) ? 1 : -1];
// Where an input's gradient goes: the node that produced it, or the leaf itself.
typedef struct tsys__slot {
    tsys__node *node;                      // producer (earlier on the tape, alive until processed)
    tsys_tensor *leaf;                     // leaf that requires grad (retained)
    bool needs;                            // the input wants a gradient
    tsys_dtype dtype;
    int ndim;
    int64_t shape[TSYS_MAX_DIMS];
} tsys__slot;

struct tsys__backward_hook { tsys_backward_hook_fn fn; void *user; };

// One gradient-ready hook of a tensor; a tensor's hooks form a list in registration order.
struct tsys__grad_hook {
    tsys_grad_hook_fn fn;
    void *user;
    struct tsys__grad_hook *next;
};

struct tsys__node {
    tsys__op op;
    tsys__slot in[TSYS__NODE_IN];
    int n_in;
    tsys_tensor *saved[TSYS__NODE_SAVED];  // values backward needs, retained until the node is done
    int n_saved;
    tsys_tensor *out;                      // weak: cleared when the output is released
    tsys_dtype out_dtype;
    tsys_dtype grad_dtype;                 // what gout accumulates in: out_dtype, or fp32 for a norm whose
                                           // low-precision output feeds several matmuls (tsys__rmsnorm_to)
    int out_ndim;
    int64_t out_shape[TSYS_MAX_DIMS];
    tsys_tensor *gout;                     // gradient of the output, accumulated during backward
    float f[4];
    int64_t i[4];
    // >>checkpoint: what a node inside a checkpointed region needs to be recomputed
    size_t index;                          // position on the tape
    int region;                            // innermost checkpointed region, -1 = none
    tsys_dtype autocast;                   // autocast dtype when recorded (the recompute runs under it)
    tsys__node *src[TSYS__NODE_IN];        // producer of each input (weak; earlier on the tape)
    tsys_tensor *inval[TSYS__NODE_IN];     // inputs from outside the region being recomputed (retained)
    tsys_tensor *rc_out;                   // the recomputed output while later recomputed nodes need it
    int rc_need;                           // recomputed nodes still to read rc_out
    unsigned rc_reads;                     // bit j: input j counted in its producer's rc_need
    bool rc_run;                           // the recompute runs this node's op (else it only re-links inputs)
    unsigned in_mask;                      // bit j: input j was given (not NULL)
    const tsys_custom_op *custom;          // TSYS__OP_CUSTOM: the op (i[k]: the input saved in slot k, -1 its own value)
    struct tsys__lgroup *group;            // a linear of a group computed together (tsys_linears), or NULL
    int group_at;                          // its place in the group
    bool group_done;                       // its backward ran with its group's
};

// Linears of one input whose products run batched (tsys_linears): their outputs lie back to back in one
// block, and so, where backward's kernels write them into `home` (tsys__slot_tensor), do their gradients.
typedef struct tsys__lgroup {
    int refs;              // member nodes alive
    int n;                 // members, in tape order
    int64_t per;           // elements of one output
    tsys_dtype dtype;      // the outputs' (and their gradients') dtype
    tsys_tensor *home;     // n x per gradient elements, made when backward first writes one; NULL after
    unsigned taken;        // bit i: member i's part of home was handed out
} tsys__lgroup;

// A checkpointed region: a contiguous range of the tape whose nodes dropped their saved tensors.
// Regions nest; a child lies inside its parent's range.
typedef struct tsys__region {
    size_t first, end;   // tape range [first, end); end = SIZE_MAX while the region is open
    int parent;          // enclosing region, -1 = top level
    bool dormant;        // saved tensors not there yet: recompute before backward enters the region
    unsigned flags;      // TSYS_CHECKPOINT_*
    uint64_t rng[4];     // the context RNG at begin, restored for the recompute
} tsys__region;

typedef struct tsys__mem_tracker {
    tsys_mem_stats dev[TSYS_DEVICE_COUNT];
    char *tag_names[TSYS__MAX_TAGS];
    int64_t tag_bytes[TSYS__MAX_TAGS][TSYS_DEVICE_COUNT];
    int num_tags;
    int cur_tag;
    tsys_mem_category cur_category;
    bool record;
    tsys_mem_event *events;
    size_t num_events, cap_events;
    uint64_t next_id;                // storage serial numbers
    const tsys_tensor *making;       // the tensor whose storage is being made (its shape goes in the event)
} tsys__mem_tracker;

struct tsys_ctx {
    tsys_status status;
    char error[512];
    const tsys_backend *backends[TSYS_DEVICE_COUNT];
    tsys__mem_tracker mem;
    size_t cpu_memory_limit;
    double t0_us;
    uint64_t rng[4];
    // autograd
    tsys__node **tape;
    size_t tape_len, tape_cap;
    int no_grad_depth;
    bool in_backward;
    // checkpointed regions (>>checkpoint)
    tsys__region *regions;
    int num_regions, cap_regions;
    int open_region;                // innermost open region, -1 = none
    tsys__node *replay;             // the node being recomputed: its op's record call lands here
    bool replay_keep, replay_done;  // keep the saved tensors the op hands over; the op has recorded
    // autocast: low dtype (F32 = off) and the step's cache of low-precision weight copies
    tsys_dtype autocast;
    tsys_tensor **ac_src, **ac_low;
    int ac_len, ac_cap;
    int op_tags[TSYS__OP_COUNT];
    // instrumentation
    tsys_trace_hooks trace;
    tsys_tensor *trace_weight;   // the weight of the linear/embedding whose op_begin/op_end hooks run (tsys_trace_weight)
    tsys_tensor *const *trace_ins;              // the inputs of the op whose op_begin hooks run (tsys_trace_input)
    const tsys__slot *trace_slots;              // or those of the backward node whose op_begin hooks run
    int trace_num_ins;
    uint64_t launch_seq;
    tsys_profiler_device_clock clocks[TSYS_DEVICE_COUNT];
    struct { const char *name; int tag; } ranges[TSYS__MAX_RANGES];
    int num_ranges;
    struct tsys__backward_hook *bwd_hooks;
    int num_bwd_hooks;
    // lifetime: what was made from the context (storages, models, optimizers) keeps it; after
    // tsys_ctx_free the last of them to go frees it (tsys__ctx_unref)
    int64_t users;
    bool freed;
};

// >>logging / errors ------------------------------------------------------------------------------

static tsys_status tsys__fail(tsys_ctx *ctx, tsys_status s, const char *file, int line, const char *fmt, ...) {
    if (!ctx) return s;
    if (ctx->status != TSYS_OK) return s;   // keep the first error: it is the cause
    ctx->status = s;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(ctx->error, sizeof(ctx->error), fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < sizeof(ctx->error) - 1 && file)
        snprintf(ctx->error + n, sizeof(ctx->error) - (size_t)n, " [%s:%d]", file, line);
    return s;
}

TSYSDEF tsys_status tsys_ctx_set_error(tsys_ctx *ctx, tsys_status s, const char *fmt, ...) {
    if (!ctx || ctx->status != TSYS_OK) return s;
    ctx->status = s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->error, sizeof(ctx->error), fmt, ap);
    va_end(ap);
    return s;
}

TSYSDEF const char *tsys_status_str(tsys_status s) {
    switch (s) {
#define TSYS__X(name, value, text) case name: return text;
        TSYS_RESULTS(TSYS__X)
#undef TSYS__X
    }
    return "unknown status";
}

TSYSDEF tsys_status tsys_ctx_status(const tsys_ctx *ctx) { return ctx ? ctx->status : TSYS_ERR_INVALID_ARGS; }
TSYSDEF const char *tsys_ctx_last_error(const tsys_ctx *ctx) { return ctx ? (ctx->status ? ctx->error : "") : "no context"; }
TSYSDEF void tsys_ctx_clear_error(tsys_ctx *ctx) { if (ctx) { ctx->status = TSYS_OK; ctx->error[0] = 0; } }

TSYSDEF double tsys_ctx_time_us(const tsys_ctx *ctx) { return ctx ? tsys_time_us() - ctx->t0_us : NAN; }

// A tsys_device value from the caller: one of the enum's (it indexes the backend and tracker tables).
static bool tsys__device_ok(tsys_ctx *ctx, const char *fn, tsys_device dev) {
    if ((unsigned)dev < TSYS_DEVICE_COUNT) return true;
    TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: device %d is not a tsys_device (TSYS_CPU = 0, TSYS_CUDA = 1)", fn, (int)dev);
    return false;
}
static const char *tsys__device_name(tsys_device dev) { return dev == TSYS_CPU ? "cpu" : dev == TSYS_CUDA ? "cuda" : "?"; }

// A tensor given to ctx must be one of ctx's: its storage's allocator, tracker and tape are ctx's.
static bool tsys__owned(tsys_ctx *ctx, const char *fn, const tsys_tensor *t) {
    if (t->storage->ctx == ctx) return true;
    TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: '%s' belongs to another context (a tensor is used only with the context that made it)", fn, t->name);
    return false;
}
// A parameter out of date on its storage (tsys_params_mark_stale): its bytes and its name.
typedef struct tsys__stale { size_t lo, hi; char name[TSYS_NAME_LEN]; } tsys__stale;
// A tensor whose bytes are current where they are read (none of them a parameter whose values another rank holds).
static bool tsys__current(tsys_ctx *ctx, const char *fn, const tsys_tensor *t) {
    const tsys_storage *s = t->storage;
    const size_t lo = t->offset, hi = t->offset + tsys_tensor_bytes(t);
    for (int i = 0; i < s->n_stale; i++)
        if (s->stale[i].lo < hi && lo < s->stale[i].hi) {
            TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: '%s' is out of date here: its current values are on the rank that updates it (tsys_ddp desc.shard_masters: "
                       "tsys_ddp_sync_params brings them)", fn, s->stale[i].name);
            return false;
        }
    return true;
}
// t was written: the stale parameters it covers are current.
static void tsys__freshen(tsys_tensor *t) {
    tsys_storage *s = t->storage;
    const size_t lo = t->offset, hi = t->offset + tsys_tensor_bytes(t);
    int kept = 0;
    for (int i = 0; i < s->n_stale; i++)
        if (!(lo <= s->stale[i].lo && s->stale[i].hi <= hi)) s->stale[kept++] = s->stale[i];
    s->n_stale = kept;
}
// A tensor whose bytes are there to be read or written (not on a storage freed by tsys_storage_resize).
static bool tsys__has_memory(tsys_ctx *ctx, const char *fn, const tsys_tensor *t) {
    if (t->storage->data) return true;
    TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: '%s' has no memory (its storage was resized to 0: a sharded parameter used outside its all-gather?)", fn, t->name);
    return false;
}
TSYSDEF double tsys_time_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

// >>dtypes ----------------------------------------------------------------------------------------

TSYSDEF size_t tsys_dtype_size(tsys_dtype dt) {
    static const size_t sizes[TSYS_DTYPE_COUNT] = {4, 2, 2, 4, 8};
    return (unsigned)dt < TSYS_DTYPE_COUNT ? sizes[dt] : 0;
}
TSYSDEF const char *tsys_dtype_name(tsys_dtype dt) {
    static const char *names[TSYS_DTYPE_COUNT] = {"f32", "bf16", "f16", "i32", "i64"};
    return (unsigned)dt < TSYS_DTYPE_COUNT ? names[dt] : "?";
}
TSYSDEF bool tsys_dtype_is_float(tsys_dtype dt) { return dt == TSYS_F32 || dt == TSYS_BF16 || dt == TSYS_F16; }

static uint32_t tsys__f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float tsys__bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

TSYSDEF uint16_t tsys_f32_to_bf16(float f) {
    uint32_t u = tsys__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   // NaN stays a quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                            // round to nearest even
    return (uint16_t)(u >> 16);
}
TSYSDEF float tsys_bf16_to_f32(uint16_t h) { return tsys__bits_f32((uint32_t)h << 16); }

TSYSDEF uint16_t tsys_f32_to_f16(float f) {
    uint32_t u = tsys__f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);            // NaN
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);           // rounds past 65504: inf
    if (a < 0x38800000u) {                                               // subnormal or zero in f16
        // Scale so that the f16 subnormal unit (2^-24) becomes 1, let the FPU round to nearest even.
        float v = tsys__bits_f32(a) * 16777216.0f;                      // 2^24
        uint32_t m = (uint32_t)lrintf(v);
        return (uint16_t)(sign | m);
    }
    uint32_t e = ((a >> 23) - 112u) << 10;                              // rebias 127 -> 15
    uint32_t mant = a & 0x7fffffu;
    uint32_t h = e | (mant >> 13);
    uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;           // round to nearest even (carry ok)
    return (uint16_t)(sign | h);
}
TSYSDEF float tsys_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (e == 31) return tsys__bits_f32(sign | 0x7f800000u | (m << 13));
    return tsys__bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// Read element i of a float tensor's raw data as fp32; write with rounding.
static inline float tsys__load(const void *p, tsys_dtype dt, int64_t i) {
    switch (dt) {
    case TSYS_F32: return ((const float *)p)[i];
    case TSYS_BF16: return tsys_bf16_to_f32(((const uint16_t *)p)[i]);
    case TSYS_F16: return tsys_f16_to_f32(((const uint16_t *)p)[i]);
    case TSYS_I32: return (float)((const int32_t *)p)[i];
    case TSYS_I64: return (float)((const int64_t *)p)[i];
    default: return NAN;
    }
}
static inline void tsys__store(void *p, tsys_dtype dt, int64_t i, float v) {
    switch (dt) {
    case TSYS_F32: ((float *)p)[i] = v; break;
    case TSYS_BF16: ((uint16_t *)p)[i] = tsys_f32_to_bf16(v); break;
    case TSYS_F16: ((uint16_t *)p)[i] = tsys_f32_to_f16(v); break;
    case TSYS_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case TSYS_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    default: break;
    }
}
static inline int64_t tsys__load_id(const void *p, tsys_dtype dt, int64_t i) {
    return dt == TSYS_I64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

// Counter-based normal sample: element i of stream `seed`, redraw `attempt`. Written so that the
// CUDA backend can compile the same function for the device (TSYS_HOSTDEV).
#ifndef TSYS_HOSTDEV
#if defined(__CUDACC__)
#define TSYS_HOSTDEV __host__ __device__
#else
#define TSYS_HOSTDEV
#endif
#endif
static inline TSYS_HOSTDEV uint64_t tsys__mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline TSYS_HOSTDEV float tsys__hash_normal(uint64_t seed, uint64_t i, uint32_t attempt) {
    uint64_t r1 = tsys__mix64(seed * 0x9e3779b97f4a7c15ull + i * 2 + ((uint64_t)attempt << 56) + 1);
    uint64_t r2 = tsys__mix64(r1 ^ 0x632be59bd9b4e019ull);
    float u1 = ((float)(r1 >> 40) + 0.5f) * (1.0f / 16777216.0f), u2 = (float)(r2 >> 40) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

// >>memory ----------------------------------------------------------------------------------------

TSYSDEF int tsys_mem_tag(tsys_ctx *ctx, const char *tag) {
    if (!ctx || !tag) return 0;   // the first tag ("other")
    tsys__mem_tracker *m = &ctx->mem;
    for (int i = 0; i < m->num_tags; i++)
        if (strcmp(m->tag_names[i], tag) == 0) return i;
    if (m->num_tags == TSYS__MAX_TAGS) return 0;   // table full: fold into the first tag
    size_t n = strlen(tag) + 1;
    m->tag_names[m->num_tags] = (char *)TSYS_MALLOC(n);
    if (!m->tag_names[m->num_tags]) return 0;
    memcpy(m->tag_names[m->num_tags], tag, n);
    return m->num_tags++;
}
TSYSDEF const char *tsys_mem_tag_name(const tsys_ctx *ctx, int tag) {
    return (ctx && tag >= 0 && tag < ctx->mem.num_tags) ? ctx->mem.tag_names[tag] : "?";
}
TSYSDEF int tsys_mem_num_tags(const tsys_ctx *ctx) { return ctx ? ctx->mem.num_tags : 0; }
TSYSDEF int tsys_mem_set_tag(tsys_ctx *ctx, int tag) {
    if (!ctx) return 0;
    int old = ctx->mem.cur_tag;
    if (tag >= 0 && tag < ctx->mem.num_tags) ctx->mem.cur_tag = tag;   // it indexes the tag table
    return old;
}
TSYSDEF int64_t tsys_mem_tag_bytes(const tsys_ctx *ctx, int tag, tsys_device dev) {
    return (ctx && tag >= 0 && tag < ctx->mem.num_tags && (unsigned)dev < TSYS_DEVICE_COUNT) ? ctx->mem.tag_bytes[tag][dev] : 0;
}
// A device outside the enum has no totals: zeros (no context to hold an error: these are const getters).
TSYSDEF tsys_mem_stats tsys_mem_stats_get(const tsys_ctx *ctx, tsys_device dev) {
    tsys_mem_stats none;
    memset(&none, 0, sizeof(none));
    return ctx && (unsigned)dev < TSYS_DEVICE_COUNT ? ctx->mem.dev[dev] : none;
}
TSYSDEF void tsys_mem_reset_peak(tsys_ctx *ctx, tsys_device dev) {
    if (!ctx || !tsys__device_ok(ctx, "tsys_mem_reset_peak", dev)) return;
    tsys_mem_stats *s = &ctx->mem.dev[dev];
    s->peak_bytes = s->live_bytes;
    memcpy(s->peak_category_bytes, s->category_bytes, sizeof(s->category_bytes));
}
TSYSDEF const tsys_mem_event *tsys_mem_events(const tsys_ctx *ctx, size_t *count) {
    if (count) *count = ctx ? ctx->mem.num_events : 0;
    return ctx ? ctx->mem.events : NULL;
}
TSYSDEF void tsys_mem_record_events(tsys_ctx *ctx, bool on) { if (ctx) ctx->mem.record = on; }
TSYSDEF void tsys_mem_clear_events(tsys_ctx *ctx) { if (ctx) ctx->mem.num_events = 0; }

TSYSDEF const char *tsys_mem_category_name(tsys_mem_category c) {
    static const char *names[TSYS_MEM_CATEGORY_COUNT] = {
#define TSYS__X(e, name) name,
        TSYS_MEM_CATEGORIES(TSYS__X)
#undef TSYS__X
    };
    return (unsigned)c < TSYS_MEM_CATEGORY_COUNT ? names[c] : "?";
}
TSYSDEF tsys_mem_category tsys_mem_set_category(tsys_ctx *ctx, tsys_mem_category c) {
    if (!ctx) return TSYS_MEM_TEMPORARY;
    tsys_mem_category old = ctx->mem.cur_category;
    if ((unsigned)c < TSYS_MEM_CATEGORY_COUNT) ctx->mem.cur_category = c;   // it indexes the per-category totals
    else TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_mem_set_category: %d is not a tsys_mem_category", (int)c);
    return old;
}

// Every change of live bytes: totals, tags, categories, the peak (with its breakdown), the hooks and
// the timeline. counted = an allocation or a free (not a change of category); st = the storage it
// concerns (NULL for memory a backend notes itself).
static void tsys__mem_change(tsys_ctx *ctx, tsys_device dev, int tag, tsys_mem_category cat, int64_t delta, bool counted, const tsys_storage *st) {
    tsys__mem_tracker *m = &ctx->mem;
    tsys_mem_stats *s = &m->dev[dev];
    s->live_bytes += delta;
    s->category_bytes[cat] += delta;
    if (counted && delta > 0) s->num_allocs++;
    else if (counted) s->num_frees++;
    if (s->live_bytes > s->peak_bytes) {
        s->peak_bytes = s->live_bytes;
        memcpy(s->peak_category_bytes, s->category_bytes, sizeof(s->category_bytes));
    }
    m->tag_bytes[tag][dev] += delta;
    if (!m->record && !ctx->trace.mem) return;
    tsys_mem_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.t_us = tsys_time_us() - ctx->t0_us;
    ev.delta = delta; ev.live = s->live_bytes; ev.tag = tag; ev.device = dev; ev.category = cat;
    ev.cached = ctx->backends[dev] && ctx->backends[dev]->cached_bytes ? ctx->backends[dev]->cached_bytes(ctx) : 0;
    ev.id = st ? st->id : 0;
    ev.action = !counted ? TSYS_MEM_EV_MOVE : delta > 0 ? TSYS_MEM_EV_ALLOC : TSYS_MEM_EV_FREE;
    ev.ndim = -1;
    const tsys_tensor *t = m->making;
    if (counted && delta > 0 && t && st) {
        ev.dtype = t->dtype; ev.ndim = t->ndim;
        memcpy(ev.shape, t->shape, sizeof(ev.shape));
    }
    if (ctx->trace.mem) ctx->trace.mem(ctx, &ev, ctx->trace.user);
    if (!m->record) return;
    if (m->num_events == m->cap_events) {
        size_t cap = m->cap_events ? m->cap_events * 2 : 4096;
        tsys_mem_event *e = (tsys_mem_event *)TSYS_REALLOC(m->events, cap * sizeof(*e));
        if (!e) { m->record = false; return; }   // timeline stops; totals stay exact
        m->events = e; m->cap_events = cap;
    }
    m->events[m->num_events++] = ev;
}
TSYSDEF void tsys_mem_note_external(tsys_ctx *ctx, tsys_device dev, tsys_mem_category c, int64_t delta) {
    if (ctx && (unsigned)dev < TSYS_DEVICE_COUNT && (unsigned)c < TSYS_MEM_CATEGORY_COUNT && delta) tsys__mem_change(ctx, dev, ctx->mem.cur_tag, c, delta, true, NULL);
}
// A temporary is an activation while the tape keeps it for backward (saved = +1 when a node saves
// it, -1 when the node lets go), and a temporary again after.
static void tsys__mem_recategorize(tsys_ctx *ctx, tsys_storage *st, tsys_mem_category to) {
    tsys__mem_change(ctx, st->device, st->tag, st->category, -(int64_t)st->bytes, false, st);
    tsys__mem_change(ctx, st->device, st->tag, to, (int64_t)st->bytes, false, st);
    st->category = to;
}
static void tsys__mem_saved(tsys_ctx *ctx, tsys_storage *st, int saved) {
    if (!st) return;
    st->saved_by += saved;
    if (saved > 0 && st->saved_by == 1 && st->category == TSYS_MEM_TEMPORARY) tsys__mem_recategorize(ctx, st, TSYS_MEM_ACTIVATIONS);
    else if (saved < 0 && st->saved_by == 0 && st->category == TSYS_MEM_ACTIVATIONS) tsys__mem_recategorize(ctx, st, TSYS_MEM_TEMPORARY);
}

// A storage header over data (bytes of it on dev), counted by the memory tracker from now on.
// Every storage, model and optimizer made from a context keeps it: tsys_ctx_free frees it at once only
// when none is left; otherwise the last of them to go does (the contract at tsys_ctx_free).
static void tsys__ctx_destroy(tsys_ctx *ctx);
static void tsys__ctx_ref(tsys_ctx *ctx) { ctx->users++; }
static void tsys__ctx_unref(tsys_ctx *ctx) {
    if (--ctx->users == 0 && ctx->freed) tsys__ctx_destroy(ctx);
}

// A storage header over data (bytes of it on dev), counted by the memory tracker from now on; `used`
// is what the tensor it is made for reaches (its extent).
static void tsys__storage_init(tsys_ctx *ctx, tsys_storage *s, tsys_device dev, void *data, size_t bytes, size_t used) {
    memset(s, 0, sizeof *s);
    s->ctx = ctx; s->device = dev; s->data = data; s->bytes = bytes; s->refcount = 1; s->extent = used;
    s->tag = ctx->mem.cur_tag; s->category = ctx->mem.cur_category; s->id = ++ctx->mem.next_id;
    tsys__ctx_ref(ctx);
    if (bytes) tsys__mem_change(ctx, dev, s->tag, s->category, (int64_t)bytes, true, s);
}

static tsys_storage *tsys__storage_new(tsys_ctx *ctx, tsys_device dev, size_t bytes) {
    const tsys_backend *be = ctx->backends[dev];
    if (!be) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "device %s has no backend (call tsys_cuda_init first)", tsys__device_name(dev)); return NULL; }
    size_t asked = bytes ? bytes : 1;
    if (dev == TSYS_CPU && asked > ctx->cpu_memory_limit - TSYS__MIN((size_t)ctx->mem.dev[dev].live_bytes, ctx->cpu_memory_limit)) {
        TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of memory: %zu bytes asked on cpu with %lld live (budget %zu: see tsys_ctx_desc.cpu_memory_limit)", asked,
                   (long long)ctx->mem.dev[dev].live_bytes, ctx->cpu_memory_limit);
        return NULL;
    }
    tsys_storage *s = (tsys_storage *)TSYS_MALLOC(sizeof(tsys_storage));
    void *data = s ? be->alloc(ctx, asked) : NULL;
    if (!data) {
        TSYS_FREE(s);
        TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of memory: %zu bytes asked on %s with %lld live", asked, be->name,
                   (long long)ctx->mem.dev[dev].live_bytes);
        return NULL;
    }
    tsys__storage_init(ctx, s, dev, data, asked, bytes);
    return s;
}

static void tsys__storage_release(tsys_storage *s) {
    if (!s || --s->refcount > 0) return;
    tsys_ctx *ctx = s->ctx;
    if (s->external) { if (s->release) s->release(s->release_user, s->data, s->bytes); }
    // data NULL: resized to 0 (tsys_storage_resize); no backend: it was destroyed by tsys_ctx_free, its memory with it
    else if (s->data && ctx->backends[s->device]) ctx->backends[s->device]->free(ctx, s->data, s->bytes);
    if (s->bytes) tsys__mem_change(ctx, s->device, s->tag, s->category, -(int64_t)s->bytes, true, s);
    TSYS_FREE(s->stale);
    TSYS_FREE(s);
    tsys__ctx_unref(ctx);
}

// A tensor now reaches `end` bytes into its storage: a resize must keep that much.
static void tsys__storage_reach(tsys_storage *s, size_t end) { if (end > s->extent) s->extent = end; }

TSYSDEF tsys_status tsys_storage_resize(tsys_ctx *ctx, tsys_tensor *t, size_t bytes) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (!t) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "storage resize: NULL tensor");
    if (!tsys__owned(ctx, "storage resize", t)) return TSYS_ERR_INVALID_ARGS;
    tsys_storage *s = t->storage;
    if (bytes == (s->data ? s->bytes : 0)) return TSYS_OK;
    if (s->external) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "storage resize: '%s' wraps memory tsys did not allocate (tsys_tensor_wrap)", t->name);
    // the tensors on it (t, its views, tensors rebound into it) stay within their storage: free it, or
    // give it at least what they reach; never cut under one of them
    if (bytes && bytes < s->extent)
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "storage resize of '%s' to %zu bytes: tensors on its storage reach %zu bytes (resize to 0 to free it, or to at least %zu)",
                          t->name, bytes, s->extent, s->extent);
    const tsys_backend *be = ctx->backends[s->device];
    void *data = NULL;
    if (bytes) {
        size_t live = (size_t)ctx->mem.dev[s->device].live_bytes - (s->data ? s->bytes : 0);
        if (s->device == TSYS_CPU && bytes > ctx->cpu_memory_limit - TSYS__MIN(live, ctx->cpu_memory_limit))
            return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of memory: %zu bytes asked on cpu for '%s' with %zu live (budget %zu)", bytes, t->name, live, ctx->cpu_memory_limit);
        data = be->alloc(ctx, bytes);
        if (!data) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of memory: %zu bytes asked on %s for '%s'", bytes, be->name, t->name);
    }
    if (s->data) be->free(ctx, s->data, s->bytes);
    if (s->data && s->bytes) tsys__mem_change(ctx, s->device, s->tag, s->category, -(int64_t)s->bytes, true, s);
    s->data = data;
    s->bytes = bytes;
    s->version++;   // new memory, undefined contents
    ctx->mem.making = t;   // the allocation event carries the tensor's shape
    if (bytes) tsys__mem_change(ctx, s->device, s->tag, s->category, (int64_t)bytes, true, s);
    ctx->mem.making = NULL;
    return TSYS_OK;
}

// >>tensors ---------------------------------------------------------------------------------------

TSYSDEF int64_t tsys_tensor_numel(const tsys_tensor *t) {
    if (!t) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}
TSYSDEF size_t tsys_tensor_bytes(const tsys_tensor *t) { return t ? (size_t)tsys_tensor_numel(t) * tsys_dtype_size(t->dtype) : 0; }
TSYSDEF void *tsys_tensor_data(const tsys_tensor *t) { return t ? (char *)t->storage->data + t->offset : NULL; }
TSYSDEF void tsys_tensor_mark_written(tsys_tensor *t) { if (t) { t->storage->version++; tsys__freshen(t); } }

TSYSDEF void tsys_tensor_set_name(tsys_tensor *t, const char *fmt, ...) {
    if (!t || !fmt) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof(t->name), fmt, ap);
    va_end(ap);
}

TSYSDEF bool tsys_tensor_same_shape(const tsys_tensor *a, const tsys_tensor *b) {
    if (!a || !b || a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

static void tsys__shape_str(const tsys_tensor *t, char *buf, size_t len) {
    size_t o = (size_t)snprintf(buf, len, "(");
    for (int i = 0; i < t->ndim && o < len; i++) o += (size_t)snprintf(buf + o, len - o, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (o < len) snprintf(buf + o, len - o, ")");
}

TSYSDEF int64_t tsys_shape_bytes(tsys_ctx *ctx, tsys_dtype dt, int ndim, const int64_t *shape) {
    if (ndim < 0 || ndim > TSYS_MAX_DIMS) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tensor: %d dims (at most %d)", ndim, TSYS_MAX_DIMS); return -1; }
    if ((unsigned)dt >= TSYS_DTYPE_COUNT) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tensor: unknown dtype %d", (int)dt); return -1; }
    if (!shape && ndim > 0) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tensor: shape is NULL (for %d dims)", ndim); return -1; }
    int64_t numel = 1, max_numel = INT64_MAX / (int64_t)tsys_dtype_size(dt);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tensor: negative size %lld in dim %d", (long long)shape[i], i); return -1; }
        if (shape[i] && numel > max_numel / shape[i]) {   // the byte count must fit int64 (numel would wrap)
            TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tensor: shape too large (dim %d = %lld makes more than 2^63 bytes of %s)", i, (long long)shape[i], tsys_dtype_name(dt));
            return -1;
        }
        numel *= shape[i];
    }
    return numel * (int64_t)tsys_dtype_size(dt);
}

static tsys_tensor *tsys__tensor_header(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape) {
    TSYS__CHECK_ARG(ctx, ctx, NULL, "no context");
    if (!tsys__device_ok(ctx, "tensor", dev) || tsys_shape_bytes(ctx, dt, ndim, shape) < 0) return NULL;
    tsys_tensor *t = (tsys_tensor *)TSYS_MALLOC(sizeof(tsys_tensor));
    if (!t) { TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for a tensor header"); return NULL; }
    memset(t, 0, sizeof(*t));
    t->dtype = dt; t->device = dev; t->ndim = ndim; t->refcount = 1;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    return t;
}

TSYSDEF tsys_tensor *tsys_tensor_new(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape) {
    tsys_tensor *t = tsys__tensor_header(ctx, dt, dev, ndim, shape);
    if (!t) return NULL;
    ctx->mem.making = t;
    t->storage = tsys__storage_new(ctx, dev, tsys_tensor_bytes(t));
    ctx->mem.making = NULL;
    if (!t->storage) { TSYS_FREE(t); return NULL; }
    return t;
}

TSYSDEF tsys_tensor *tsys_tensor_new_2d(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int64_t d0, int64_t d1) {
    int64_t shape[2] = {d0, d1};
    return tsys_tensor_new(ctx, dt, dev, 2, shape);
}

static tsys_status tsys__copy_bytes(tsys_ctx *ctx, void *dst, tsys_device dd, const void *src, tsys_device sd, size_t bytes) {
    if (bytes == 0) return TSYS_OK;
    if (!ctx) return TSYS_ERR_INVALID_ARGS;
    const tsys_backend *be = ctx->backends[dd != TSYS_CPU ? dd : sd];
    if (!be) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "copy: device has no backend");
    return be->copy(ctx, dst, dd, src, sd, bytes);
}

TSYSDEF tsys_tensor *tsys_tensor_from_data(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape, const void *host_data) {
    TSYS__CHECK_ARG(ctx, host_data, NULL, "tensor_from_data: host_data is NULL");
    tsys_tensor *t = tsys_tensor_new(ctx, dt, dev, ndim, shape);
    if (t && tsys__copy_bytes(ctx, tsys_tensor_data(t), dev, host_data, TSYS_CPU, tsys_tensor_bytes(t)) != TSYS_OK) {
        tsys_tensor_release(t);
        return NULL;
    }
    return t;
}

TSYSDEF tsys_tensor *tsys_tensor_wrap(tsys_ctx *ctx, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape, void *data,
                                      void (*release)(void *user, void *data, size_t bytes), void *user) {
    TSYS__CHECK_ARG(ctx, ctx, NULL, "no context");
    if (!data) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tensor_wrap: data is NULL"); return NULL; }
    if (!tsys__device_ok(ctx, "tensor_wrap", dev)) return NULL;
    if (!ctx->backends[dev]) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tensor_wrap: device %s has no backend", tsys__device_name(dev)); return NULL; }
    tsys_tensor *t = tsys__tensor_header(ctx, dt, dev, ndim, shape);
    tsys_storage *s = t ? (tsys_storage *)TSYS_MALLOC(sizeof(tsys_storage)) : NULL;
    if (!s) {
        if (t) TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for a storage header");
        TSYS_FREE(t);
        return NULL;
    }
    t->storage = s;
    ctx->mem.making = t;   // the allocation event carries the tensor's shape
    tsys__storage_init(ctx, s, dev, data, tsys_tensor_bytes(t), tsys_tensor_bytes(t));
    ctx->mem.making = NULL;
    s->external = true; s->release = release; s->release_user = user;
    return t;
}

TSYSDEF tsys_tensor *tsys_tensor_retain(tsys_tensor *t) { if (t) t->refcount++; return t; }

TSYSDEF void tsys_tensor_release(tsys_tensor *t) {
    if (!t || --t->refcount > 0) return;
    if (t->grad_fn) t->grad_fn->out = NULL;   // the tape node outlives its output
    tsys_tensor_set_grad_hook(t, NULL, NULL);
    tsys_tensor_release(t->grad);
    tsys_tensor_release(t->lowp);
    tsys__storage_release(t->storage);
    TSYS_FREE(t);
}

TSYSDEF tsys_tensor *tsys_tensor_view_raw(tsys_ctx *ctx, tsys_tensor *t, size_t byte_offset, tsys_dtype dt, int ndim, const int64_t *shape) {
    if (!t) return NULL;
    tsys_tensor *v = tsys__tensor_header(ctx, dt, t->device, ndim, shape);
    if (!v) return NULL;
    size_t need = tsys_tensor_bytes(v);
    if (t->offset + byte_offset + need > t->storage->bytes) {
        TSYS_FREE(v);
        TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "view of '%s': %zu bytes at offset %zu pass the end of its storage (%zu bytes)",
                   t->name, need, t->offset + byte_offset, t->storage->bytes);
        return NULL;
    }
    v->storage = t->storage; v->storage->refcount++;
    v->offset = t->offset + byte_offset;
    tsys__storage_reach(v->storage, v->offset + need);
    return v;
}

TSYSDEF tsys_status tsys_tensor_rebind(tsys_ctx *ctx, tsys_tensor *t, tsys_tensor *target, size_t byte_offset) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (!t || !target) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "rebind: NULL tensor");
    if (!tsys__owned(ctx, "rebind", t) || !tsys__owned(ctx, "rebind", target)) return TSYS_ERR_INVALID_ARGS;
    if (t->device != target->device) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "rebind '%s' into '%s': different devices", t->name, target->name);
    size_t off = target->offset + byte_offset;
    if (off + tsys_tensor_bytes(t) > target->storage->bytes)
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "rebind '%s' into '%s': %zu bytes at offset %zu pass the end of its storage (%zu bytes)", t->name, target->name,
                          tsys_tensor_bytes(t), off, target->storage->bytes);
    target->storage->refcount++;
    tsys__storage_release(t->storage);
    t->storage = target->storage;
    t->offset = off;
    tsys__storage_reach(t->storage, off + tsys_tensor_bytes(t));
    t->grad_home = NULL;   // its gradient no longer lies where its group's block would put it
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_tensor_copy_from(tsys_ctx *ctx, tsys_tensor *dst, const tsys_tensor *src) {
    if (!dst || !src) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "copy: NULL tensor");
    if (!tsys__has_memory(ctx, "copy", dst) || !tsys__has_memory(ctx, "copy", src)) return TSYS_ERR_INVALID_ARGS;
    if (dst->dtype != src->dtype || tsys_tensor_numel(dst) != tsys_tensor_numel(src))
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "copy into '%s': dtype/size differ (%s x %lld vs %s x %lld)", dst->name,
                          tsys_dtype_name(dst->dtype), (long long)tsys_tensor_numel(dst), tsys_dtype_name(src->dtype), (long long)tsys_tensor_numel(src));
    tsys_tensor_mark_written(dst);
    return tsys__copy_bytes(ctx, tsys_tensor_data(dst), dst->device, tsys_tensor_data(src), src->device, tsys_tensor_bytes(src));
}

TSYSDEF tsys_tensor *tsys_tensor_to(tsys_ctx *ctx, const tsys_tensor *t, tsys_device dev) {
    if (!t) return NULL;   // an earlier failure (its error stays)
    tsys_tensor *r = tsys_tensor_new(ctx, t->dtype, dev, t->ndim, t->shape);
    if (r && tsys_tensor_copy_from(ctx, r, t) != TSYS_OK) { tsys_tensor_release(r); return NULL; }
    if (r) memcpy(r->name, t->name, sizeof(r->name));
    return r;
}
TSYSDEF tsys_tensor *tsys_tensor_clone(tsys_ctx *ctx, const tsys_tensor *t) { return t ? tsys_tensor_to(ctx, t, t->device) : NULL; }

TSYSDEF tsys_status tsys_tensor_to_host(tsys_ctx *ctx, const tsys_tensor *t, void *host) {
    if (!t || !host) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "to_host: %s is NULL", t ? "host" : "the tensor");
    if (!tsys__has_memory(ctx, "to_host", t) || !tsys__current(ctx, "to_host", t)) return TSYS_ERR_INVALID_ARGS;
    return tsys__copy_bytes(ctx, host, TSYS_CPU, tsys_tensor_data(t), t->device, tsys_tensor_bytes(t));
}

TSYSDEF tsys_status tsys_tensor_to_f32(tsys_ctx *ctx, const tsys_tensor *t, float *host) {
    if (!t || !host) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "to_f32: %s is NULL", t ? "host" : "the tensor");
    if (t->dtype == TSYS_F32) return tsys_tensor_to_host(ctx, t, host);
    int64_t n = tsys_tensor_numel(t);
    void *raw = TSYS_MALLOC(tsys_tensor_bytes(t) + 1);
    if (!raw) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory reading '%s'", t->name);
    tsys_status s = tsys_tensor_to_host(ctx, t, raw);
    for (int64_t i = 0; s == TSYS_OK && i < n; i++) host[i] = tsys__load(raw, t->dtype, i);
    TSYS_FREE(raw);
    return s;
}

static tsys_status tsys__kernel(tsys_ctx *ctx, tsys_device dev, tsys_kernel k, const tsys_kargs *a);

// A NULL tensor given to a filling function: an earlier failure (its error stays) or a caller's bug.
static tsys_status tsys__null_tensor(tsys_ctx *ctx, const char *what) {
    if (!ctx) return TSYS_ERR_INVALID_ARGS;
    return ctx->status != TSYS_OK ? ctx->status : TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: NULL tensor", what);
}

TSYSDEF tsys_status tsys_tensor_fill(tsys_ctx *ctx, tsys_tensor *t, float value) {
    if (!t) return tsys__null_tensor(ctx, "fill");
    tsys_kargs a;
    memset(&a, 0, sizeof(a));
    a.t[0] = t; a.f[0] = value;
    return tsys__kernel(ctx, t->device, TSYS_K_FILL, &a);
}

// Into existing memory (what tsys_cast and gradient accumulation compute, without a new tensor): the
// same kernels, so the same bits. No autograd.
static tsys_status tsys__check_into(tsys_ctx *ctx, const char *what, const tsys_tensor *dst, const tsys_tensor *src) {
    if (!dst || !src) return tsys__null_tensor(ctx, what);
    if (tsys_tensor_numel(dst) != tsys_tensor_numel(src) || dst->device != src->device || !tsys_dtype_is_float(dst->dtype) || !tsys_dtype_is_float(src->dtype))
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s into '%s': %s x %lld on %d from '%s' %s x %lld on %d (float, same numel and device)", what, dst->name,
                          tsys_dtype_name(dst->dtype), (long long)tsys_tensor_numel(dst), (int)dst->device, src->name,
                          tsys_dtype_name(src->dtype), (long long)tsys_tensor_numel(src), (int)src->device);
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_tensor_cast_from(tsys_ctx *ctx, tsys_tensor *dst, const tsys_tensor *src) {
    tsys_status st = tsys__check_into(ctx, "cast_from", dst, src);
    if (st != TSYS_OK) return st;
    if (dst->dtype == src->dtype) return tsys_tensor_copy_from(ctx, dst, src);
    tsys_kargs a;
    memset(&a, 0, sizeof(a));
    a.t[0] = dst; a.t[1] = (tsys_tensor *)src;   // read only
    return tsys__kernel(ctx, dst->device, TSYS_K_CAST, &a);
}

TSYSDEF tsys_status tsys_tensor_accumulate(tsys_ctx *ctx, tsys_tensor *dst, const tsys_tensor *src) {
    tsys_status st = tsys__check_into(ctx, "accumulate", dst, src);
    if (st != TSYS_OK) return st;
    tsys_kargs a;
    memset(&a, 0, sizeof(a));
    a.t[0] = dst; a.t[1] = (tsys_tensor *)src; a.f[0] = 1.0f;   // dst + src·1: exactly dst + src
    return tsys__kernel(ctx, dst->device, TSYS_K_ACCUM, &a);
}

// Fills t on the host with gen(ctx) values, then copies to t's device.
static tsys_status tsys__fill_host(tsys_ctx *ctx, tsys_tensor *t, float (*gen)(tsys_ctx *, const float *), const float *p) {
    if (!tsys__has_memory(ctx, "fill", t)) return TSYS_ERR_INVALID_ARGS;
    int64_t n = tsys_tensor_numel(t);
    void *raw = TSYS_MALLOC(tsys_tensor_bytes(t) + 1);
    if (!raw) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory filling '%s'", t->name);
    for (int64_t i = 0; i < n; i++) tsys__store(raw, t->dtype, i, gen(ctx, p));
    tsys_tensor_mark_written(t);
    tsys_status s = tsys__copy_bytes(ctx, tsys_tensor_data(t), t->device, raw, TSYS_CPU, tsys_tensor_bytes(t));
    TSYS_FREE(raw);
    return s;
}

// >>rng: xoshiro256** seeded by splitmix64 ---------------------------------------------------------

static uint64_t tsys__splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
TSYSDEF void tsys_rng_seed(tsys_ctx *ctx, uint64_t seed) { for (int i = 0; ctx && i < 4; i++) ctx->rng[i] = tsys__splitmix(&seed); }
static uint64_t tsys__rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
TSYSDEF uint64_t tsys_rng_next(tsys_ctx *ctx) {
    if (!ctx) return 0;
    uint64_t *s = ctx->rng;
    uint64_t r = tsys__rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t; s[3] = tsys__rotl(s[3], 45);
    return r;
}
TSYSDEF float tsys_rng_uniform(tsys_ctx *ctx) { return !ctx ? NAN : (float)((tsys_rng_next(ctx) >> 40) * (1.0 / 16777216.0)); }
TSYSDEF float tsys_rng_normal(tsys_ctx *ctx) {
    if (!ctx) return NAN;
    double u1 = ((tsys_rng_next(ctx) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    double u2 = (tsys_rng_next(ctx) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
static float tsys__gen_int(tsys_ctx *ctx, const float *p) { return (float)(tsys_rng_next(ctx) % (uint64_t)p[0]); }

// Normal samples drawn on the tensor's own device from a seed taken off the context's RNG.
static tsys_status tsys__randn_kernel(tsys_ctx *ctx, tsys_tensor *t, float std, float lo, float hi) {
    if (!ctx || !t) return tsys__null_tensor(ctx, "randn");
    tsys_kargs a;
    memset(&a, 0, sizeof(a));
    if (!tsys_dtype_is_float(t->dtype)) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "randn: '%s' is not a float tensor", t->name);
    a.t[0] = t; a.f[0] = std; a.f[1] = lo; a.f[2] = hi; a.i[0] = (int64_t)(tsys_rng_next(ctx) >> 1);
    return tsys__kernel(ctx, t->device, TSYS_K_RANDN, &a);
}
TSYSDEF tsys_status tsys_tensor_randn(tsys_ctx *ctx, tsys_tensor *t, float std) { return tsys__randn_kernel(ctx, t, std, 0.0f, 0.0f); }
TSYSDEF tsys_status tsys_tensor_trunc_normal(tsys_ctx *ctx, tsys_tensor *t, float std, float lo, float hi) {
    if (!(lo < hi)) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "trunc_normal: lo %g must be below hi %g", lo, hi);
    return tsys__randn_kernel(ctx, t, std, lo, hi);
}
TSYSDEF tsys_status tsys_tensor_randint(tsys_ctx *ctx, tsys_tensor *t, int64_t hi) {
    float p[1] = {(float)hi};
    if (!ctx || !t) return tsys__null_tensor(ctx, "randint");
    if (hi <= 0 || hi > (1 << 24)) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "randint: bound %lld out of (0, 2^24]", (long long)hi);
    return tsys__fill_host(ctx, t, tsys__gen_int, p);
}

// >>cpu kernels -----------------------------------------------------------------------------------
// The reference implementation every other backend is tested against. Kernels compute in fp32: a
// BF16/F16 tensor is widened into a scratch buffer, and results are rounded on the way back.

typedef struct tsys__fbuf { float *p; bool owned; } tsys__fbuf;

// fp32 view of a tensor's elements: the data itself when F32, else a widened copy.
static tsys__fbuf tsys__fin(const tsys_tensor *t) {
    tsys__fbuf b = {NULL, false};
    if (!t) return b;
    if (t->dtype == TSYS_F32) { b.p = (float *)tsys_tensor_data(t); return b; }
    int64_t n = tsys_tensor_numel(t);
    b.p = (float *)TSYS_MALLOC((size_t)(n ? n : 1) * sizeof(float));
    b.owned = true;
    if (!b.p) return b;
    const void *raw = tsys_tensor_data(t);
    TSYS__OMP(omp parallel for if (n > 65536))
    for (int64_t i = 0; i < n; i++) b.p[i] = tsys__load(raw, t->dtype, i);
    return b;
}
// fp32 buffer to write a tensor's elements into; `keep` loads the current contents (accumulation).
static tsys__fbuf tsys__fout(const tsys_tensor *t, bool keep) {
    if (keep || !t || t->dtype == TSYS_F32) return tsys__fin(t);
    tsys__fbuf b = {NULL, true};
    int64_t n = tsys_tensor_numel(t);
    b.p = (float *)TSYS_MALLOC((size_t)(n ? n : 1) * sizeof(float));
    return b;
}
// Ends the use of a buffer: rounds it back into t (when t is an output) and frees the scratch.
static void tsys__fdone(tsys__fbuf *b, tsys_tensor *t) {
    if (!b->owned) return;
    if (t && b->p) {
        int64_t n = tsys_tensor_numel(t);
        void *raw = tsys_tensor_data(t);
        TSYS__OMP(omp parallel for if (n > 65536))
        for (int64_t i = 0; i < n; i++) tsys__store(raw, t->dtype, i, b->p[i]);
    }
    TSYS_FREE(b->p);
    b->p = NULL;
}

static int64_t tsys__last_dim(const tsys_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }
static int64_t tsys__rows(const tsys_tensor *t) { int64_t d = tsys__last_dim(t); return d ? tsys_tensor_numel(t) / d : 0; }
static float tsys__sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

static void tsys__cpu_rmsnorm_fwd(float *y, float *rstd, const float *x, const float *w, int64_t rows, int64_t d, float eps) {
    TSYS__OMP(omp parallel for)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        double ss = 0;
        for (int64_t j = 0; j < d; j++) ss += (double)xr[j] * xr[j];
        float s = (float)(1.0 / sqrt(ss / (double)d + eps));
        rstd[r] = s;
        for (int64_t j = 0; j < d; j++) y[r * d + j] = w[j] * (xr[j] * s);
    }
}

// dx_j = s w_j dy_j - x_j s^3 / d * sum_k(dy_k w_k x_k);  dw_j += sum_rows dy_j x_j s
static void tsys__cpu_rmsnorm_bwd(float *dx, bool dx_add, float *dw, const float *dy, const float *x, const float *w, const float *rstd, int64_t rows, int64_t d) {
    TSYS__OMP(omp parallel for)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d, *gr = dy + r * d;
        float s = rstd[r];
        double dot = 0;
        for (int64_t j = 0; j < d; j++) dot += (double)gr[j] * w[j] * xr[j];
        float c = (float)(dot * s * s * s / (double)d);
        for (int64_t j = 0; j < d; j++) {
            float v = s * w[j] * gr[j] - xr[j] * c;
            dx[r * d + j] = dx_add ? dx[r * d + j] + v : v;   // the bits of storing v, then accumulating it
        }
    }
    for (int64_t r = 0; r < rows; r++)   // rows in order: the sum is deterministic
        for (int64_t j = 0; j < d; j++) dw[j] += dy[r * d + j] * x[r * d + j] * rstd[r];
}

static void tsys__cpu_layernorm_fwd(float *y, float *mean, float *rstd, const float *x, const float *w, const float *b, int64_t rows, int64_t d, float eps) {
    TSYS__OMP(omp parallel for)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        double mu = 0, var = 0;
        for (int64_t j = 0; j < d; j++) mu += xr[j];
        mu /= (double)d;
        for (int64_t j = 0; j < d; j++) var += (xr[j] - mu) * (xr[j] - mu);
        float s = (float)(1.0 / sqrt(var / (double)d + eps));
        mean[r] = (float)mu; rstd[r] = s;
        for (int64_t j = 0; j < d; j++) y[r * d + j] = ((xr[j] - (float)mu) * s) * (w ? w[j] : 1.0f) + (b ? b[j] : 0.0f);
    }
}

static void tsys__cpu_layernorm_bwd(float *dx, float *dw, float *db, const float *dy, const float *x, const float *w, const float *mean, const float *rstd, int64_t rows, int64_t d) {
    TSYS__OMP(omp parallel for)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d, *gr = dy + r * d;
        float s = rstd[r], mu = mean[r];
        double sg = 0, sgx = 0;
        for (int64_t j = 0; j < d; j++) {
            double g = (double)gr[j] * (w ? w[j] : 1.0f), xh = (xr[j] - mu) * s;
            sg += g; sgx += g * xh;
        }
        for (int64_t j = 0; j < d; j++) {
            double g = (double)gr[j] * (w ? w[j] : 1.0f), xh = (xr[j] - mu) * s;
            dx[r * d + j] = (float)(s * (g - sg / (double)d - xh * sgx / (double)d));
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < d; j++) {
            if (dw) dw[j] += dy[r * d + j] * (x[r * d + j] - mean[r]) * rstd[r];
            if (db) db[j] += dy[r * d + j];
        }
}

// Interleaved pairs (2j, 2j+1) rotated by angle t * theta^(-2j/D); sign -1 rotates back (the backward).
// The source row of output row o and its position, by layout (TSYS_K_ROPE's i0): 0 the same (.., T, D)
// rows; 1 x (B, T, H, D) to y (B, H, T, D); 2 x (B, H, T, D) to y (B, T, H, D).
static int64_t tsys__rope_src(int64_t o, int64_t H, int64_t T, int mode, int64_t *t) {
    if (mode == 2) { int64_t b = o / (T * H), tt = (o / H) % T, h = o % H; *t = tt; return (b * H + h) * T + tt; }
    int64_t b = o / (H * T), h = (o / T) % H, tt = o % T;
    *t = tt;
    return mode == 1 ? (b * T + tt) * H + h : o;
}
static void tsys__cpu_rope(float *y, const float *x, int64_t B, int64_t H, int64_t T, int64_t D, float theta, float sign, int mode) {
    TSYS__OMP(omp parallel for)
    for (int64_t o = 0; o < B * H * T; o++) {
        int64_t t, src = tsys__rope_src(o, H, T, mode, &t);
        for (int64_t j = 0; j < D / 2; j++) {
            float freq = 1.0f / powf(theta, (float)(2 * j) / (float)D);
            float ang = (float)t * freq, c = cosf(ang), s = sign * sinf(ang);
            float x1 = x[src * D + 2 * j], x2 = x[src * D + 2 * j + 1];
            y[o * D + 2 * j] = c * x1 - s * x2;
            y[o * D + 2 * j + 1] = s * x1 + c * x2;
        }
    }
}

// The rows of a ROPE launch from its input's shape, by layout (i0): 0 (.., T, D) as B = the rest, H = 1;
// 1 (B, T, H, D); 2 (B, H, T, D).
static void tsys__rope_dims(const tsys_tensor *x, int mode, int64_t *B, int64_t *H, int64_t *T, int64_t *D) {
    *D = x->shape[x->ndim - 1];
    if (mode == 0) { *T = x->shape[x->ndim - 2]; *H = 1; *B = (*T) * (*D) != 0 ? tsys_tensor_numel(x) / ((*T) * (*D)) : 0; return; }
    *B = x->shape[0];
    *T = mode == 1 ? x->shape[1] : x->shape[2];
    *H = mode == 1 ? x->shape[2] : x->shape[1];
}

// Row r of a (.., T, n) block: causal rows keep columns c <= r % T (query index >= key index).
static void tsys__cpu_softmax_fwd(float *y, const float *x, int64_t rows, int64_t n, float scale, bool causal) {
    TSYS__OMP(omp parallel for)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        int64_t keep = causal ? (r % n) + 1 : n;
        if (causal && n && rows % n) keep = n;   // not square blocks: the op layer rejects this
        float mx = -INFINITY;
        for (int64_t c = 0; c < keep; c++) mx = TSYS__MAX(mx, scale * xr[c]);
        double sum = 0;
        for (int64_t c = 0; c < keep; c++) { yr[c] = expf(scale * xr[c] - mx); sum += yr[c]; }
        float inv = (float)(1.0 / sum);
        for (int64_t c = 0; c < keep; c++) yr[c] *= inv;
        for (int64_t c = keep; c < n; c++) yr[c] = 0.0f;
    }
}

static void tsys__cpu_softmax_bwd(float *dx, const float *dy, const float *y, int64_t rows, int64_t n, float scale) {
    TSYS__OMP(omp parallel for)
    for (int64_t r = 0; r < rows; r++) {
        const float *yr = y + r * n, *gr = dy + r * n;
        double dot = 0;
        for (int64_t c = 0; c < n; c++) dot += (double)gr[c] * yr[c];
        for (int64_t c = 0; c < n; c++) dx[r * n + c] = scale * yr[c] * (gr[c] - (float)dot);
    }
}

static void tsys__cpu_ce_fwd(float *loss, float *lse, const float *logits, const void *tgt, tsys_dtype tdt, int64_t rows, int64_t V) {
    double total = 0;
    TSYS__OMP(omp parallel for reduction(+ : total))
    for (int64_t r = 0; r < rows; r++) {
        const float *lr = logits + r * V;
        float mx = -INFINITY;
        for (int64_t c = 0; c < V; c++) mx = TSYS__MAX(mx, lr[c]);
        double s = 0;
        for (int64_t c = 0; c < V; c++) s += exp((double)(lr[c] - mx));
        lse[r] = mx + (float)log(s);
        total += (double)lse[r] - lr[tsys__load_id(tgt, tdt, r)];
    }
    *loss = (float)(total / (double)rows);
}

static void tsys__cpu_ce_bwd(float *dl, const float *logits, const float *lse, const void *tgt, tsys_dtype tdt, int64_t rows, int64_t V, float g) {
    TSYS__OMP(omp parallel for)
    for (int64_t r = 0; r < rows; r++) {
        int64_t y = tsys__load_id(tgt, tdt, r);
        for (int64_t c = 0; c < V; c++) dl[r * V + c] = g * (expf(logits[r * V + c] - lse[r]) - (c == y ? 1.0f : 0.0f));
    }
}

// 1 - beta^t, AdamW's bias correction: the power in double, rounded once (torch's AdamW computes it from host
// scalars in double; a float pow's last-bit error is amplified by the cancellation, 1e3 times at beta 0.999).
static float tsys__bias_correction(float beta, int64_t t) { return (float)(1.0 - pow((double)beta, (double)t)); }

// low (optional, dtype ldt): the new p rounded as the cast rounds it, the kept copy autocast reads.
// bc: the step's bias corrections 1 - beta1^t, 1 - beta2^t (tsys__bias_correction).
static void tsys__cpu_adamw(float *p, const float *g, float *m, float *v, void *low, tsys_dtype ldt, int64_t n, const float *f, const float bc[2]) {
    float lr = f[0], b1 = f[1], b2 = f[2], eps = f[3], wd = f[4];
    float bc1 = bc[0], bc2 = bc[1];
    float step = lr / bc1, bc2_sqrt = sqrtf(bc2);
    TSYS__OMP(omp parallel for if (n > 16384))
    for (int64_t i = 0; i < n; i++) {
        // torch.optim.AdamW: decoupled decay first, then the bias-corrected Adam step
        float pi = p[i] * (1.0f - lr * wd);
        m[i] = b1 * m[i] + (1.0f - b1) * g[i];
        v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        float denom = sqrtf(v[i]) / bc2_sqrt + eps;
        p[i] = pi - step * (m[i] / denom);
        if (low) tsys__store(low, ldt, i, p[i]);
    }
}

static void tsys__cpu_transpose12(void *dst, const void *src, const int64_t *s, size_t es) {
    int64_t A = s[0], B = s[1], C = s[2], D = s[3];
    TSYS__OMP(omp parallel for collapse(2))
    for (int64_t a = 0; a < A; a++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t c = 0; c < C; c++)
                memcpy((char *)dst + (size_t)(((a * C + c) * B + b) * D) * es, (const char *)src + (size_t)(((a * B + b) * C + c) * D) * es, (size_t)D * es);
}

// >>cpu flash -------------------------------------------------------------------------------------
// FlashAttention-2 on the CPU, the tiled reference (fp32) the CUDA kernels are checked against.
// defines: tsys__cpu_flash_fwd, tsys__cpu_flash_bwd, tsys__cpu_flash (fp32 views, for the kernel entries)
//
// This is the algorithm of the CS336 handout (§1.3.2, Algorithm 1, and the backward with recomputation,
// Eqs. 13-19), written as plain loops so that it reads as the spec. It favours clarity over speed: fp32
// everywhere, tiles of 32 x 32, OpenMP over (batch*head, tile).
//
// Layout: q (bh, n_q, d), k and v (bh, n_k, d), o (bh, n_q, d), lse (bh, n_q); all contiguous fp32.
// Causal: query i keeps key j when i >= j; a masked score gets +(-1e6), exactly as the handout, so lse is
// torch.logsumexp of the masked scores. A key tile whose every key is masked for every query of the tile
// is skipped: its terms are exp(-1e6 - m), which is 0 in fp32, so skipping changes no bit of the result
// (row 0 always keeps key 0, so a row is never fully masked).

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
// Returns false when a thread's output accumulator could not be allocated.
static bool tsys__cpu_flash_fwd(const float *q, const float *k, const float *v, float *o, float *lse,
                                int64_t bh, int64_t n_q, int64_t n_k, int64_t d, float scale, bool causal) {
    const int64_t BQ = TSYS__FLASH_CPU_BQ, BK = TSYS__FLASH_CPU_BK;
    const int64_t tq = (n_q + BQ - 1) / BQ;
    int failed = 0;
    TSYS__OMP(omp parallel reduction(| : failed))
    {
        float s[TSYS__FLASH_CPU_BQ * TSYS__FLASH_CPU_BK];   // one score tile, on the thread's stack
        float *acc = (float *)TSYS_MALLOC(sizeof(float) * (size_t)(BQ * d));
        float m[TSYS__FLASH_CPU_BQ], l[TSYS__FLASH_CPU_BQ];
        failed |= acc == NULL;
        TSYS__OMP(omp for schedule(dynamic))
        for (int64_t t = 0; t < bh * tq; t++) {
            if (!acc) continue;
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
        TSYS_FREE(acc);
    }
    return !failed;
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
        float s[TSYS__FLASH_CPU_BQ * TSYS__FLASH_CPU_BK];   // one score tile, on the thread's stack
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
    }
    // pass 2: dQ
    TSYS__OMP(omp parallel)
    {
        float s[TSYS__FLASH_CPU_BQ * TSYS__FLASH_CPU_BK];   // one score tile, on the thread's stack
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
    }
}

// Flash attention on fp32 views of the tensors (bf16/fp16 inputs are widened, outputs rounded back).
static tsys_status tsys__cpu_flash(tsys_ctx *ctx, tsys_kernel k, const tsys_kargs *a) {
    tsys_tensor *const *t = a->t;
    int nt = k == TSYS_K_FLASH_FWD ? 5 : 9, nout = k == TSYS_K_FLASH_FWD ? 2 : 3;
    tsys__fbuf b[9];
    bool ok = true;
    for (int j = 0; j < nt; j++) { b[j] = j < nout ? tsys__fout(t[j], false) : tsys__fin(t[j]); ok = ok && b[j].p; }
    const tsys_tensor *q = t[k == TSYS_K_FLASH_FWD ? 2 : 4], *kk = t[k == TSYS_K_FLASH_FWD ? 3 : 5];
    int64_t d = tsys__last_dim(q), nq = q->shape[q->ndim - 2], nk = kk->shape[kk->ndim - 2], bh = tsys_tensor_numel(q) / (nq * d);
    if (ok && k == TSYS_K_FLASH_FWD)
        ok = tsys__cpu_flash_fwd(b[2].p, b[3].p, b[4].p, b[0].p, b[1].p, bh, nq, nk, d, a->f[0], a->i[0] != 0);
    else if (ok)
        tsys__cpu_flash_bwd(b[3].p, b[4].p, b[5].p, b[6].p, b[7].p, b[8].p, b[0].p, b[1].p, b[2].p, bh, nq, nk, d, a->f[0], a->i[0] != 0);
    for (int j = 0; j < nt; j++) tsys__fdone(&b[j], j < nout ? t[j] : NULL);
    return ok ? TSYS_OK : TSYS__FAIL(ctx, TSYS_ERR_OOM, "cpu flash attention: out of host memory for fp32 scratch");
}

// >>kernel contract -------------------------------------------------------------------------------
// TSYS_KERNELS as data, for every backend: names, slots, written masks, and the launch check.

// The contract table as data: names, slot letters and written masks, indexed by tsys_kernel.
static const struct { const char *name, *slots; unsigned written; } tsys__kernel_info[TSYS_K_COUNT] = {
#define TSYS__X(e, name, slots, written, doc) {name, slots, written},
    TSYS_KERNELS(TSYS__X)
#undef TSYS__X
};

TSYSDEF const char *tsys_kernel_name(tsys_kernel k) { return (unsigned)k < TSYS_K_COUNT ? tsys__kernel_info[k].name : "gemm"; }

// Whether kernel k writes slot j (the rest are inputs).
static bool tsys__kernel_writes(tsys_kernel k, int j) { return (tsys__kernel_info[k].written >> j) & 1u; }

static bool tsys__slot_dtype_ok(char kind, tsys_dtype dt) {
    switch (kind | 0x20) {   // lower case: the same rule, NULL allowed
    case 'f': return tsys_dtype_is_float(dt);
    case 's': return dt == TSYS_F32;
    case 'i': return dt == TSYS_I32 || dt == TSYS_I64;
    case 'l': return dt == TSYS_I64;
    default: return true;
    }
}

// Checks one launch against the contract: the slot count, required slots present, dtypes, device.
static tsys_status tsys__kargs_check(tsys_ctx *ctx, tsys_device dev, tsys_kernel k, const tsys_kargs *a) {
    static const char *kinds = "fFsSiIlLaA";
    static const char *what[] = {"a float tensor", "an f32 tensor", "an i32/i64 tensor", "an i64 scalar", "a tensor"};
    if ((unsigned)k >= TSYS_K_COUNT) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "kernel %d: no such kernel", (int)k);
    const char *slots = tsys__kernel_info[k].slots, *name = tsys__kernel_info[k].name;
    int n = (int)strlen(slots);
    for (int j = 0; j < TSYS_KARGS_MAX; j++) {
        const tsys_tensor *t = a->t[j];
        if (j >= n) {
            if (t) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "kernel %s: t[%d] ('%s') is given, the kernel takes %d tensors", name, j, t->name, n);
            continue;
        }
        char kind = slots[j];
        bool optional = kind >= 'a';
        if (!t) {
            if (!optional) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "kernel %s: t[%d] is NULL, the kernel needs it", name, j);
            continue;
        }
        if (!tsys__slot_dtype_ok(kind, t->dtype))
            return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "kernel %s: t[%d] ('%s') is %s, the kernel needs %s", name, j, t->name,
                              tsys_dtype_name(t->dtype), what[(strchr(kinds, kind) - kinds) / 2]);
        if (t->device != dev)
            return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "kernel %s: t[%d] ('%s') is on another device than the launch", name, j, t->name);
    }
    return TSYS_OK;
}

// >>cpu kernel entry points -----------------------------------------------------------------------
// One function per kernel, tsys__cpu_k_<name>, as tsys_cuda.cuh has tsys_cuda__k_<name>; the table
// below maps a kernel id to its function. Semantics: the rows of TSYS_KERNELS.
// defines: tsys__cpu_launch, tsys__cpu_k_* (one per kernel), tsys__cpu_kernels, tsys__cpu_kernel
//
// A kernel reads its slots through IN(j) (an fp32 view) and writes them through OUT(j, keep) (an fp32
// buffer; keep loads the current contents, for accumulation). Both record the view in L->b[j];
// tsys__cpu_kernel then rounds every written slot back into its tensor and frees the scratch, so a
// kernel returns as soon as it is done (or fails) and never cleans up.

typedef struct tsys__cpu_launch {
    tsys_ctx *ctx;
    const tsys_kargs *a;
    tsys_tensor *const *t;   // a->t
    const float *f;          // a->f
    int64_t n;               // elements of t[0] (0 when NULL)
    tsys__fbuf b[TSYS_KARGS_MAX];
} tsys__cpu_launch;

#define IN(j) (L->b[j] = tsys__fin(L->t[j]), L->b[j].p)
#define OUT(j, keep) (L->b[j] = tsys__fout(L->t[j], keep), L->b[j].p)

static tsys_status tsys__cpu_k_fill(tsys__cpu_launch *L) {
    int64_t n = L->n;
    if (L->t[0]->dtype == TSYS_F32) { float *p = (float *)tsys_tensor_data(L->t[0]); for (int64_t i = 0; i < n; i++) p[i] = L->f[0]; return TSYS_OK; }
    void *raw = tsys_tensor_data(L->t[0]);
    for (int64_t i = 0; i < n; i++) tsys__store(raw, L->t[0]->dtype, i, L->f[0]);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_cast(tsys__cpu_launch *L) {
    int64_t n = L->n;
    void *dst = tsys_tensor_data(L->t[0]);
    const void *src = tsys_tensor_data(L->t[1]);
    TSYS__OMP(omp parallel for if (n > 65536))
    for (int64_t i = 0; i < n; i++) tsys__store(dst, L->t[0]->dtype, i, tsys__load(src, L->t[1]->dtype, i));
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_accum(tsys__cpu_launch *L) {
    float *y = OUT(0, true); const float *x = IN(1);
    for (int64_t i = 0; i < L->n; i++) y[i] += x[i] * L->f[0];
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_add(tsys__cpu_launch *L) {
    int64_t n = L->n;
    float *y = OUT(0, false); const float *p = IN(1), *q = IN(2);
    TSYS__OMP(omp parallel for if (n > 65536))
    for (int64_t i = 0; i < n; i++) y[i] = p[i] + q[i];
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_mul(tsys__cpu_launch *L) {
    float *y = OUT(0, false); const float *p = IN(1), *q = IN(2);
    for (int64_t i = 0; i < L->n; i++) y[i] = p[i] * q[i];
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_scale(tsys__cpu_launch *L) {
    float *y = OUT(0, false); const float *x = IN(1);
    for (int64_t i = 0; i < L->n; i++) y[i] = x[i] * L->f[0];
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_scale_by(tsys__cpu_launch *L) {
    float *y = OUT(0, false); const float *x = IN(1), *s = IN(2);
    const float c = s[0];
    for (int64_t i = 0; i < L->n; i++) y[i] = x[i] * c;
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_add_bias(tsys__cpu_launch *L) {
    float *y = OUT(0, true); const float *bias = IN(1);
    int64_t d = tsys_tensor_numel(L->t[1]);
    for (int64_t i = 0; i < L->n; i++) y[i] += bias[i % d];
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_bias_grad(tsys__cpu_launch *L) {
    float *db = OUT(0, true); const float *g = IN(1);
    int64_t d = tsys_tensor_numel(L->t[0]), rows = tsys_tensor_numel(L->t[1]) / d;
    for (int64_t r = 0; r < rows; r++) for (int64_t j = 0; j < d; j++) db[j] += g[r * d + j];
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_relu_fwd(tsys__cpu_launch *L) {
    float *y = OUT(0, false); const float *x = IN(1);
    for (int64_t i = 0; i < L->n; i++) y[i] = x[i] > 0 ? x[i] : 0.0f;
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_relu_bwd(tsys__cpu_launch *L) {
    float *dx = OUT(0, false); const float *g = IN(1), *x = IN(2);
    for (int64_t i = 0; i < L->n; i++) dx[i] = x[i] > 0 ? g[i] : 0.0f;
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_silu_fwd(tsys__cpu_launch *L) {
    int64_t n = L->n;
    float *y = OUT(0, false); const float *x = IN(1);
    TSYS__OMP(omp parallel for if (n > 65536))
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * tsys__sigmoid(x[i]);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_silu_bwd(tsys__cpu_launch *L) {
    int64_t n = L->n;
    float *dx = OUT(0, false); const float *g = IN(1), *x = IN(2);
    TSYS__OMP(omp parallel for if (n > 65536))
    for (int64_t i = 0; i < n; i++) { float s = tsys__sigmoid(x[i]); dx[i] = g[i] * s * (1.0f + x[i] * (1.0f - s)); }
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_swiglu_fwd(tsys__cpu_launch *L) {
    int64_t n = L->n;
    float *y = OUT(0, false); const float *p = IN(1), *q = IN(2);
    TSYS__OMP(omp parallel for if (n > 65536))
    for (int64_t i = 0; i < n; i++) y[i] = p[i] * tsys__sigmoid(p[i]) * q[i];
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_swiglu_bwd(tsys__cpu_launch *L) {
    int64_t n = L->n;
    float *da = OUT(0, false), *db = OUT(1, false); const float *g = IN(2), *p = IN(3), *q = IN(4);
    TSYS__OMP(omp parallel for if (n > 65536))
    for (int64_t i = 0; i < n; i++) {
        float s = tsys__sigmoid(p[i]);
        db[i] = g[i] * p[i] * s;
        da[i] = g[i] * q[i] * s * (1.0f + p[i] * (1.0f - s));
    }
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_rmsnorm_fwd(tsys__cpu_launch *L) {
    tsys_tensor *const *t = L->t;
    int64_t d = tsys__last_dim(t[2]);
    const float *x = IN(2);
    if (t[4]) {   // the residual add first, as TSYS_K_ADD computes it
        float *sum = OUT(5, false);
        const float *r = IN(4);
        for (int64_t i = 0, nx = tsys_tensor_numel(t[2]); i < nx; i++) sum[i] = x[i] + r[i];
        x = sum;
    }
    tsys__cpu_rmsnorm_fwd(OUT(0, false), OUT(1, false), x, IN(3), tsys__rows(t[2]), d, L->f[0]);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_rmsnorm_bwd(tsys__cpu_launch *L) {
    bool add = L->a->i[0] != 0, store_w = L->a->i[1] != 0;
    int64_t d = tsys__last_dim(L->t[3]);
    float *dw = OUT(1, !store_w);
    if (store_w) memset(dw, 0, sizeof(float) * (size_t)d);   // the sums start from 0, as a filled dw's would
    tsys__cpu_rmsnorm_bwd(OUT(0, add), add, dw, IN(2), IN(3), IN(4), IN(5), tsys__rows(L->t[3]), d);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_layernorm_fwd(tsys__cpu_launch *L) {
    int64_t d = tsys__last_dim(L->t[3]);
    tsys__cpu_layernorm_fwd(OUT(0, false), OUT(1, false), OUT(2, false), IN(3), IN(4), IN(5), tsys__rows(L->t[3]), d, L->f[0]);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_layernorm_bwd(tsys__cpu_launch *L) {
    int64_t d = tsys__last_dim(L->t[4]);
    tsys__cpu_layernorm_bwd(OUT(0, false), OUT(1, true), OUT(2, true), IN(3), IN(4), IN(5), IN(6), IN(7), tsys__rows(L->t[4]), d);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_rope(tsys__cpu_launch *L) {
    int64_t B, H, T, D;
    int mode = (int)L->a->i[0];
    tsys__rope_dims(L->t[1], mode, &B, &H, &T, &D);
    tsys__cpu_rope(OUT(0, false), IN(1), B, H, T, D, L->f[0], L->f[1], mode);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_softmax_fwd(tsys__cpu_launch *L) {
    tsys__cpu_softmax_fwd(OUT(0, false), IN(1), tsys__rows(L->t[1]), tsys__last_dim(L->t[1]), L->f[0], L->a->i[0] != 0);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_softmax_bwd(tsys__cpu_launch *L) {
    tsys__cpu_softmax_bwd(OUT(0, false), IN(1), IN(2), tsys__rows(L->t[1]), tsys__last_dim(L->t[1]), L->f[0]);
    return TSYS_OK;
}

// Kernels that index by tensor values check every value first, so a bad one writes nothing.
static tsys_status tsys__cpu_check_ids(tsys_ctx *ctx, const char *op, const char *what, const tsys_tensor *ids, int64_t limit) {
    const void *p = tsys_tensor_data(ids);
    int64_t n = tsys_tensor_numel(ids);
    for (int64_t i = 0; i < n; i++) {
        int64_t id = tsys__load_id(p, ids->dtype, i);
        if (id < 0 || id >= limit)
            return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: %s %lld at position %lld of '%s' is outside [0, %lld)", op, what, (long long)id,
                              (long long)i, ids->name, (long long)limit);
    }
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_ce_fwd(tsys__cpu_launch *L) {
    tsys_tensor *const *t = L->t;
    tsys_status st = tsys__cpu_check_ids(L->ctx, "cross_entropy", "target", t[3], tsys__last_dim(t[2]));
    if (st != TSYS_OK) return st;
    tsys__cpu_ce_fwd(OUT(0, false), OUT(1, false), IN(2), tsys_tensor_data(t[3]), t[3]->dtype, tsys__rows(t[2]), tsys__last_dim(t[2]));
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_ce_bwd(tsys__cpu_launch *L) {
    tsys_tensor *const *t = L->t;
    tsys_status st = tsys__cpu_check_ids(L->ctx, "cross_entropy backward", "target", t[3], tsys__last_dim(t[1]));
    if (st != TSYS_OK) return st;
    const float *gl = IN(4);
    tsys__cpu_ce_bwd(OUT(0, false), IN(1), IN(2), tsys_tensor_data(t[3]), t[3]->dtype, tsys__rows(t[1]), tsys__last_dim(t[1]), gl[0] * L->f[0]);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_mse_fwd(tsys__cpu_launch *L) {
    const float *p = IN(1), *q = IN(2);
    int64_t m = tsys_tensor_numel(L->t[1]);
    double s = 0;
    for (int64_t i = 0; i < m; i++) s += (double)(p[i] - q[i]) * (p[i] - q[i]);
    OUT(0, false)[0] = (float)(s / (double)m);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_mse_bwd(tsys__cpu_launch *L) {
    const float *p = IN(2), *q = IN(3), *gl = IN(4);
    int64_t m = tsys_tensor_numel(L->t[2]);
    float c = 2.0f * gl[0] / (float)m;
    float *da = L->t[0] ? OUT(0, false) : NULL, *db = L->t[1] ? OUT(1, false) : NULL;
    for (int64_t i = 0; i < m; i++) {
        float d = c * (p[i] - q[i]);
        if (da) da[i] = d;
        if (db) db[i] = -d;
    }
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_sum(tsys__cpu_launch *L) {
    const float *x = IN(1);
    int64_t m = tsys_tensor_numel(L->t[1]);
    double s = 0;
    for (int64_t i = 0; i < m; i++) s += x[i];
    OUT(0, false)[0] = (float)(s * L->f[0]);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_broadcast(tsys__cpu_launch *L) {
    float *y = OUT(0, false);
    float v = IN(1)[0] * L->f[0];
    for (int64_t i = 0; i < L->n; i++) y[i] = v;
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_embed_fwd(tsys__cpu_launch *L) {
    tsys_tensor *const *t = L->t;
    tsys_status st = tsys__cpu_check_ids(L->ctx, "embedding", "token id", t[2], t[1]->shape[0]);
    if (st != TSYS_OK) return st;
    int64_t D = tsys__last_dim(t[1]), N = tsys_tensor_numel(t[2]);
    size_t row = (size_t)D * tsys_dtype_size(t[1]->dtype);
    const void *ids = tsys_tensor_data(t[2]);
    TSYS__OMP(omp parallel for if (N > 256))
    for (int64_t r = 0; r < N; r++)
        memcpy((char *)tsys_tensor_data(t[0]) + (size_t)r * row, (const char *)tsys_tensor_data(t[1]) + (size_t)tsys__load_id(ids, t[2]->dtype, r) * row, row);
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_embed_bwd(tsys__cpu_launch *L) {
    tsys_tensor *const *t = L->t;
    tsys_status st = tsys__cpu_check_ids(L->ctx, "embedding backward", "token id", t[2], t[0]->shape[0]);
    if (st != TSYS_OK) return st;
    float *dw = OUT(0, true); const float *g = IN(1);
    int64_t D = tsys__last_dim(t[0]), N = tsys_tensor_numel(t[2]);
    const void *ids = tsys_tensor_data(t[2]);
    for (int64_t r = 0; r < N; r++) {
        float *dst = dw + tsys__load_id(ids, t[2]->dtype, r) * D;
        for (int64_t j = 0; j < D; j++) dst[j] += g[r * D + j];
    }
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_transpose12(tsys__cpu_launch *L) {
    tsys_tensor *const *t = L->t;
    tsys__cpu_transpose12(tsys_tensor_data(t[0]), tsys_tensor_data(t[1]), t[1]->shape, tsys_dtype_size(t[1]->dtype));
    return TSYS_OK;
}

// g = the rank-ordered sum of g (rank self's) and the other ranks' terms (slots `stride` apart), / ranks
static float *tsys__cpu_rank_mean(const float *g, const float *terms, int64_t stride, int ranks, int self, int64_t n) {
    float *out = (float *)TSYS_MALLOC(sizeof(float) * (size_t)(n ? n : 1));
    if (!out) return NULL;
    TSYS__OMP(omp parallel for if (n > 16384))
    for (int64_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (int r = 0; r < ranks; r++) acc += r == self ? g[i] : terms[(int64_t)(r - (r > self)) * stride + i];
        out[i] = acc / (float)ranks;
    }
    return out;
}

static tsys_status tsys__cpu_k_adamw(tsys__cpu_launch *L) {
    tsys_tensor *const *t = L->t;
    const float *f = L->f;
    const int64_t *iv = L->a->i;
    if (t[6] && (tsys_tensor_numel(t[6]) != L->n || t[6]->dtype == TSYS_F32))
        return TSYS__FAIL(L->ctx, TSYS_ERR_INVALID_ARGS, "adamw: the copy t[6] '%s' must be bf16/f16 of p's size", t[6]->name);
    if (t[7] && (iv[1] < 2 || iv[2] < 0 || iv[2] >= iv[1] || iv[0] < L->n || tsys_tensor_numel(t[7]) < (iv[1] - 2) * iv[0] + L->n))
        return TSYS__FAIL(L->ctx, TSYS_ERR_INVALID_ARGS, "adamw: the terms t[7] '%s' (%lld elements) do not hold %lld ranks' slots %lld apart, %lld each", t[7]->name,
                          (long long)tsys_tensor_numel(t[7]), (long long)iv[1] - 1, (long long)iv[0], (long long)L->n);
    float hyper[5] = {t[5] ? ((const float *)tsys_tensor_data(t[5]))[0] : f[0], f[1], f[2], f[3], f[4]};   // t5: lr on the device
    if (t[7] && t[7]->dtype != t[1]->dtype) return TSYS__FAIL(L->ctx, TSYS_ERR_INVALID_ARGS, "adamw: the terms t[7] '%s' must have g's dtype", t[7]->name);
    if (t[8] && tsys_tensor_numel(t[8]) != 2) return TSYS__FAIL(L->ctx, TSYS_ERR_INVALID_ARGS, "adamw: the bias corrections t[8] '%s' must be 2 elements", t[8]->name);
    float *mean = t[7] ? tsys__cpu_rank_mean(IN(1), IN(7), iv[0], (int)iv[1], (int)iv[2], L->n) : NULL;
    if (t[7] && !mean) return TSYS__FAIL(L->ctx, TSYS_ERR_OOM, "adamw: out of host memory for the ranks' gradient sum");
    int64_t step = tsys__load_id(tsys_tensor_data(t[4]), t[4]->dtype, 0);
    float bc[2] = {tsys__bias_correction(f[1], step), tsys__bias_correction(f[2], step)};
    if (t[8]) memcpy(bc, IN(8), sizeof bc);   // as STEP_INC wrote them
    tsys__cpu_adamw(OUT(0, true), mean ? mean : IN(1), OUT(2, true), OUT(3, true), t[6] ? tsys_tensor_data(t[6]) : NULL, t[6] ? t[6]->dtype : TSYS_F32, L->n, hyper, bc);
    TSYS_FREE(mean);
    return TSYS_OK;
}

static tsys_status tsys__cpu_gemm(tsys_ctx *ctx, const tsys_gemm_args *g);
static tsys_status tsys__cpu_kernel(tsys_ctx *ctx, tsys_kernel k, const tsys_kargs *a);
// The two launches it stands for: the weight-gradient product into a gradient of dtype i0 (the same rounding),
// then ADAMW on it.
static tsys_status tsys__cpu_k_linear_adamw(tsys__cpu_launch *L) {
    tsys_tensor *const *t = L->t;
    const tsys_tensor *dy = t[4], *x = t[5];
    const tsys_dtype gdt = (tsys_dtype)L->a->i[0];
    const int64_t d_out = tsys__last_dim(dy), d_in = tsys__last_dim(x), rows = d_out ? tsys_tensor_numel(dy) / d_out : 0;
    if (dy->dtype != x->dtype || d_out * d_in != L->n || rows * d_in != tsys_tensor_numel(x))
        return TSYS__FAIL(L->ctx, TSYS_ERR_INVALID_ARGS, "linear_adamw: dy t4 '%s' (%s, %lld elements) and x t5 '%s' (%s, %lld) must be one dtype, (rows, O) and (rows, I) with p t0 (O, I) of %lld elements",
                          dy->name, tsys_dtype_name(dy->dtype), (long long)tsys_tensor_numel(dy), x->name, tsys_dtype_name(x->dtype), (long long)tsys_tensor_numel(x), (long long)L->n);
    if (gdt != TSYS_F32 && gdt != x->dtype)
        return TSYS__FAIL(L->ctx, TSYS_ERR_INVALID_ARGS, "linear_adamw: the gradient's dtype i0 = %d must be f32 or x's (%s)", (int)gdt, tsys_dtype_name(x->dtype));
    if (tsys_tensor_numel(t[1]) != L->n || tsys_tensor_numel(t[2]) != L->n)
        return TSYS__FAIL(L->ctx, TSYS_ERR_INVALID_ARGS, "linear_adamw: m t1 '%s' and v t2 '%s' must have p's %lld elements", t[1]->name, t[2]->name, (long long)L->n);
    int64_t shape[2] = {d_out, d_in};
    tsys_tensor *g = tsys_tensor_new(L->ctx, gdt, TSYS_CPU, 2, shape);
    if (!g) return L->ctx->status;
    tsys_gemm_args ga = {dy, x, g, true, false, d_out, d_in, rows, 1, 0, 0, 0, 1.0f, 0.0f, false};
    tsys_status st = tsys__cpu_gemm(L->ctx, &ga);
    if (st == TSYS_OK) {
        tsys_kargs b;
        memset(&b, 0, sizeof b);
        b.t[0] = t[0]; b.t[1] = g; b.t[2] = t[1]; b.t[3] = t[2]; b.t[4] = t[6]; b.t[5] = t[7]; b.t[6] = t[3]; b.t[8] = t[8];
        memcpy(b.f, L->f, 5 * sizeof(float));
        st = tsys__cpu_kernel(L->ctx, TSYS_K_ADAMW, &b);
    }
    tsys_tensor_release(g);
    return st;
}

static tsys_status tsys__cpu_k_step_inc(tsys__cpu_launch *L) {
    int64_t t = ++((int64_t *)tsys_tensor_data(L->t[0]))[0];
    if (L->t[1]) {
        if (L->t[1]->dtype != TSYS_F32 || tsys_tensor_numel(L->t[1]) != 2) return TSYS__FAIL(L->ctx, TSYS_ERR_INVALID_ARGS, "step_inc: t[1] '%s' must be 2 fp32 elements", L->t[1]->name);
        float *bc = (float *)tsys_tensor_data(L->t[1]);
        bc[0] = tsys__bias_correction(L->f[0], t); bc[1] = tsys__bias_correction(L->f[1], t);
    }
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_randn(tsys__cpu_launch *L) {
    const float *f = L->f;
    int64_t n = L->n;
    float *y = OUT(0, false);
    uint64_t seed = (uint64_t)L->a->i[0];
    bool trunc = f[1] < f[2];
    TSYS__OMP(omp parallel for if (n > 65536))
    for (int64_t i = 0; i < n; i++) {
        float v = f[0] * tsys__hash_normal(seed, (uint64_t)i, 0);
        for (uint32_t r = 1; trunc && (v < f[1] || v > f[2]); r++) v = f[0] * tsys__hash_normal(seed, (uint64_t)i, r);
        y[i] = v;
    }
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_sgd(tsys__cpu_launch *L) {
    float *p = OUT(0, true); const float *g = IN(1);
    for (int64_t i = 0; i < L->n; i++) p[i] -= L->f[0] * g[i];
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_sumsq(tsys__cpu_launch *L) {
    const float *x = IN(1);
    int64_t m = tsys_tensor_numel(L->t[1]);
    double s = 0;
    for (int64_t i = 0; i < m; i++) s += (double)x[i] * x[i];
    OUT(0, true)[0] += (float)s;
    return TSYS_OK;
}

static tsys_status tsys__cpu_k_nonfinite(tsys__cpu_launch *L) {
    const float *x = IN(1);
    int64_t m = tsys_tensor_numel(L->t[1]);
    bool bad = false;
    for (int64_t i = 0; i < m; i++) bad |= !isfinite(x[i]);
    if (bad) OUT(0, true)[0] = 1.0f;
    return TSYS_OK;
}

// The flash kernels keep their own fp32 views (tsys__cpu_flash in >>cpu flash).
static tsys_status tsys__cpu_k_flash_fwd(tsys__cpu_launch *L) { return tsys__cpu_flash(L->ctx, TSYS_K_FLASH_FWD, L->a); }
static tsys_status tsys__cpu_k_flash_bwd(tsys__cpu_launch *L) { return tsys__cpu_flash(L->ctx, TSYS_K_FLASH_BWD, L->a); }

#undef IN
#undef OUT

// Kernel id -> entry point, in TSYS_KERNELS order. Each row names its id: a row out of place fails the
// size check below at compile time or the id check in tsys__cpu_kernel at the first launch.
typedef tsys_status (*tsys__cpu_kfn)(tsys__cpu_launch *L);
static const struct { tsys_kernel id; tsys__cpu_kfn fn; } tsys__cpu_kernels[] = {
    {TSYS_K_FILL, tsys__cpu_k_fill},
    {TSYS_K_CAST, tsys__cpu_k_cast},
    {TSYS_K_ACCUM, tsys__cpu_k_accum},
    {TSYS_K_ADD, tsys__cpu_k_add},
    {TSYS_K_MUL, tsys__cpu_k_mul},
    {TSYS_K_SCALE, tsys__cpu_k_scale},
    {TSYS_K_ADD_BIAS, tsys__cpu_k_add_bias},
    {TSYS_K_BIAS_GRAD, tsys__cpu_k_bias_grad},
    {TSYS_K_RELU_FWD, tsys__cpu_k_relu_fwd},
    {TSYS_K_RELU_BWD, tsys__cpu_k_relu_bwd},
    {TSYS_K_SILU_FWD, tsys__cpu_k_silu_fwd},
    {TSYS_K_SILU_BWD, tsys__cpu_k_silu_bwd},
    {TSYS_K_SWIGLU_FWD, tsys__cpu_k_swiglu_fwd},
    {TSYS_K_SWIGLU_BWD, tsys__cpu_k_swiglu_bwd},
    {TSYS_K_RMSNORM_FWD, tsys__cpu_k_rmsnorm_fwd},
    {TSYS_K_RMSNORM_BWD, tsys__cpu_k_rmsnorm_bwd},
    {TSYS_K_LAYERNORM_FWD, tsys__cpu_k_layernorm_fwd},
    {TSYS_K_LAYERNORM_BWD, tsys__cpu_k_layernorm_bwd},
    {TSYS_K_ROPE, tsys__cpu_k_rope},
    {TSYS_K_SOFTMAX_FWD, tsys__cpu_k_softmax_fwd},
    {TSYS_K_SOFTMAX_BWD, tsys__cpu_k_softmax_bwd},
    {TSYS_K_CE_FWD, tsys__cpu_k_ce_fwd},
    {TSYS_K_CE_BWD, tsys__cpu_k_ce_bwd},
    {TSYS_K_MSE_FWD, tsys__cpu_k_mse_fwd},
    {TSYS_K_MSE_BWD, tsys__cpu_k_mse_bwd},
    {TSYS_K_SUM, tsys__cpu_k_sum},
    {TSYS_K_BROADCAST, tsys__cpu_k_broadcast},
    {TSYS_K_EMBED_FWD, tsys__cpu_k_embed_fwd},
    {TSYS_K_EMBED_BWD, tsys__cpu_k_embed_bwd},
    {TSYS_K_TRANSPOSE12, tsys__cpu_k_transpose12},
    {TSYS_K_ADAMW, tsys__cpu_k_adamw},
    {TSYS_K_LINEAR_ADAMW, tsys__cpu_k_linear_adamw},
    {TSYS_K_STEP_INC, tsys__cpu_k_step_inc},
    {TSYS_K_RANDN, tsys__cpu_k_randn},
    {TSYS_K_SGD, tsys__cpu_k_sgd},
    {TSYS_K_SUMSQ, tsys__cpu_k_sumsq},
    {TSYS_K_NONFINITE, tsys__cpu_k_nonfinite},
    {TSYS_K_FLASH_FWD, tsys__cpu_k_flash_fwd},
    {TSYS_K_FLASH_BWD, tsys__cpu_k_flash_bwd},
    {TSYS_K_SCALE_BY, tsys__cpu_k_scale_by},
};
typedef char tsys__cpu_kernels_complete[(sizeof(tsys__cpu_kernels) / sizeof(tsys__cpu_kernels[0]) == TSYS_K_COUNT) ? 1 : -1];

// The backend's kernel hook: looks the entry point up, runs it, then rounds the fp32 buffers of the
// written slots back into their tensors and frees every scratch view.
static tsys_status tsys__cpu_kernel(tsys_ctx *ctx, tsys_kernel k, const tsys_kargs *a) {
    if ((unsigned)k >= TSYS_K_COUNT || tsys__cpu_kernels[k].id != k) return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "cpu: kernel %d not implemented", (int)k);
    tsys__cpu_launch L;
    memset(&L, 0, sizeof(L));
    L.ctx = ctx; L.a = a; L.t = a->t; L.f = a->f;
    L.n = a->t[0] ? tsys_tensor_numel(a->t[0]) : 0;
    tsys_status st = tsys__cpu_kernels[k].fn(&L);
    for (int j = 0; j < TSYS_KARGS_MAX; j++) {
        if (L.b[j].owned && !L.b[j].p) st = TSYS__FAIL(ctx, TSYS_ERR_OOM, "cpu kernel %d: out of host memory for fp32 scratch", (int)k);
        // outputs are the leading slots of each kernel; inputs are never written back
        bool is_out = L.b[j].owned && a->t[j] && j < 4 && tsys__kernel_writes(k, j);
        tsys__fdone(&L.b[j], is_out ? a->t[j] : NULL);
    }
    return st;
}

// >>cpu backend -----------------------------------------------------------------------------------
// C = alpha op(A) op(B) + beta C per batch item through cblas_sgemm on fp32 views.
static tsys_status tsys__cpu_gemm(tsys_ctx *ctx, const tsys_gemm_args *g) {
    tsys__fbuf a = tsys__fin(g->a), b = tsys__fin(g->b), c = tsys__fout(g->c, g->beta != 0.0f);
    tsys_status st = TSYS_OK;
    if (!a.p || !b.p || !c.p) st = TSYS__FAIL(ctx, TSYS_ERR_OOM, "cpu gemm: out of host memory for fp32 scratch");
    int64_t lda = g->trans_a ? g->m : g->k, ldb = g->trans_b ? g->k : g->n;
    for (int64_t i = 0; st == TSYS_OK && i < g->batch; i++) {
        const float *A = a.p + i * g->stride_a, *B = b.p + i * g->stride_b;
        float *C = c.p + i * g->stride_c;
#ifndef TSYS_NO_CBLAS
        cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans, g->trans_b ? CblasTrans : CblasNoTrans, (int)g->m, (int)g->n,
                    (int)g->k, g->alpha, A, (int)lda, B, (int)ldb, g->beta, C, (int)g->n);
#else
        TSYS__OMP(omp parallel for)
        for (int64_t r = 0; r < g->m; r++)
            for (int64_t col = 0; col < g->n; col++) {
                double s = 0;
                for (int64_t q = 0; q < g->k; q++)
                    s += (double)(g->trans_a ? A[q * lda + r] : A[r * lda + q]) * (g->trans_b ? B[col * ldb + q] : B[q * ldb + col]);
                C[r * g->n + col] = (float)(g->alpha * s + (g->beta != 0.0f ? g->beta * C[r * g->n + col] : 0.0));
            }
#endif
    }
    tsys__fdone(&a, NULL); tsys__fdone(&b, NULL); tsys__fdone(&c, g->c);
    return st;
}

static void *tsys__cpu_alloc(tsys_ctx *ctx, size_t bytes) {
    (void)ctx;
    // 64-byte aligned so that SIMD loads and BLAS see aligned rows
    void *raw = TSYS_MALLOC(bytes + 64 + sizeof(void *));
    if (!raw) return NULL;
    uintptr_t p = ((uintptr_t)raw + sizeof(void *) + 63) & ~(uintptr_t)63;
    ((void **)p)[-1] = raw;
    return (void *)p;
}
static void tsys__cpu_free(tsys_ctx *ctx, void *ptr, size_t bytes) { (void)ctx; (void)bytes; if (ptr) TSYS_FREE(((void **)ptr)[-1]); }
static tsys_status tsys__cpu_copy(tsys_ctx *ctx, void *dst, tsys_device dd, const void *src, tsys_device sd, size_t bytes) {
    if (dd != TSYS_CPU || sd != TSYS_CPU) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "cpu backend cannot copy to or from another device");
    memmove(dst, src, bytes);
    return TSYS_OK;
}
static tsys_status tsys__cpu_sync(tsys_ctx *ctx) { (void)ctx; return TSYS_OK; }

// The CPU runs work as it is issued, on one stream: an event is the host clock at its record
// (tsys_event_record stamps it), waiting is free, and every stream is the compute stream.
static tsys_status tsys__cpu_event_record(tsys_ctx *ctx, tsys_event *e, tsys_stream s) { (void)ctx; (void)e; (void)s; return TSYS_OK; }
static tsys_status tsys__cpu_event_wait(tsys_ctx *ctx, const tsys_event *e, tsys_stream s) { (void)ctx; (void)e; (void)s; return TSYS_OK; }
static tsys_status tsys__cpu_event_elapsed(tsys_ctx *ctx, const tsys_event *a, const tsys_event *b, double *ms) {
    (void)ctx;
    *ms = (b->host_us - a->host_us) * 1e-3;
    return TSYS_OK;
}
static void tsys__cpu_event_release(tsys_ctx *ctx, tsys_event *e) { (void)ctx; (void)e; }
static tsys_stream tsys__cpu_set_stream(tsys_ctx *ctx, tsys_stream s) { (void)ctx; (void)s; return TSYS_STREAM_COMPUTE; }

static const tsys_backend tsys__cpu_backend = {
    "cpu", tsys__cpu_alloc, tsys__cpu_free, tsys__cpu_copy, tsys__cpu_gemm, tsys__cpu_kernel, tsys__cpu_sync, NULL, NULL,
    tsys__cpu_event_record, tsys__cpu_event_wait, tsys__cpu_event_elapsed, tsys__cpu_event_release, tsys__cpu_set_stream,
    NULL,   // no cache: malloc gives memory back at free
    NULL, NULL, NULL, NULL, NULL,   // copies run as they are issued: nothing to overlap, nothing to fence
};

// >>launch ----------------------------------------------------------------------------------------
// Every launch of tsys.h goes through these two: the contract check (TSYS_DEBUG) and the kernel hook.
// Always checked, as they would otherwise corrupt memory: every tensor is one of ctx's (its memory is on
// ctx's device, in ctx's allocator) and has memory (a storage resized to 0, a sharded parameter outside
// its gather, is an error, not a crash). Ops check their inputs at their entry (tsys__check_inputs), so
// this names the kernel only for what launches directly (fills, copies, optimizers).
static tsys_status tsys__launch(tsys_ctx *ctx, tsys_device dev, tsys_kernel k, const tsys_kargs *a, const tsys_gemm_args *g) {
    if (!ctx) return TSYS_ERR_INVALID_ARGS;
    if (!tsys__device_ok(ctx, tsys_kernel_name(k), dev)) return TSYS_ERR_INVALID_ARGS;
    const tsys_backend *be = ctx->backends[dev];
    if (!be) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "device %s has no backend (call tsys_cuda_init first)", tsys__device_name(dev));
    const tsys_tensor *gt[3] = {g ? g->a : NULL, g ? g->b : NULL, g ? g->c : NULL};
    for (int j = 0; j < (a ? TSYS_KARGS_MAX : 3); j++) {
        const tsys_tensor *x = a ? a->t[j] : gt[j];
        if (x && (!tsys__owned(ctx, tsys_kernel_name(k), x) || !tsys__has_memory(ctx, tsys_kernel_name(k), x))) return TSYS_ERR_INVALID_ARGS;
    }
#if TSYS_DEBUG
    if (a && tsys__kargs_check(ctx, dev, k, a) != TSYS_OK) return ctx->status;
#endif
    for (int j = 0; j < (a ? TSYS_KARGS_MAX : 2); j++) {   // what it reads must be current (a GEMM's c is written)
        const tsys_tensor *x = a ? a->t[j] : gt[j];
        if (x && (!a || !tsys__kernel_writes(k, j)) && !tsys__current(ctx, tsys_kernel_name(k), x)) return TSYS_ERR_INVALID_ARGS;
    }
    // what the launch writes is at a new version (kept low-precision copies of it are stale) and current
    if (g) { g->c->storage->version++; tsys__freshen(g->c); }
    for (int j = 0; a && j < TSYS_KARGS_MAX; j++)
        if (a->t[j] && tsys__kernel_writes(k, j)) { a->t[j]->storage->version++; tsys__freshen(a->t[j]); }
    if (!ctx->trace.kernel && !ctx->trace.kernel_begin) return a ? be->kernel(ctx, k, a) : be->gemm(ctx, g);
    tsys_trace_kernel info;
    info.seq = ++ctx->launch_seq;
    info.device = dev; info.kernel = k; info.name = tsys_kernel_name(k); info.args = a; info.gemm = g;
    info.status = TSYS_OK; info.t_end_us = 0;
    info.t_begin_us = tsys_time_us();
    if (ctx->trace.kernel_begin) ctx->trace.kernel_begin(ctx, &info, ctx->trace.user);
    info.status = a ? be->kernel(ctx, k, a) : be->gemm(ctx, g);
    info.t_end_us = tsys_time_us();
    if (ctx->trace.kernel) ctx->trace.kernel(ctx, &info, ctx->trace.user);
    return info.status;
}
static tsys_status tsys__kernel(tsys_ctx *ctx, tsys_device dev, tsys_kernel k, const tsys_kargs *a) { return tsys__launch(ctx, dev, k, a, NULL); }
static tsys_status tsys__gemm(tsys_ctx *ctx, const tsys_gemm_args *g) { return tsys__launch(ctx, g->c->device, TSYS_K_COUNT, NULL, g); }

// >>context ---------------------------------------------------------------------------------------

// The CPU budget: the least of what the machine has (MemAvailable) and the room left in every memory
// cgroup that holds this process (a container, a Slurm job), since a cgroup's limit kills the process
// long before the machine runs out. cgroup v2: /proc/self/cgroup's "0::/path", and memory.max and
// memory.current of that cgroup and of each parent up to the root (a parent's limit binds its
// children too); cgroup v1: the same walk with memory.limit_in_bytes and memory.usage_in_bytes under
// the memory controller's mount. The cgroup's inactive page cache (memory.stat) counts as room, as
// MemAvailable counts reclaimable cache. The mounts come from /proc/self/mountinfo (a container's
// mount shows its own cgroup as the mount's root).
// TSYS_CGROUP_ROOT (environment, for tests): a directory that stands for / when the cgroup files
// are read (<root>/proc/self/cgroup, <root>/proc/self/mountinfo, the mounts under <root>), so a test
// can give fake cgroup files; MemAvailable is still the machine's.

#define TSYS__CG_PATH 1024   // a cgroup path or mount point (longer ones are skipped: no limit read)

// The number a cgroup file starts with; false when the file is missing or says "max" (no limit).
static bool tsys__cg_read_num(const char *path, unsigned long long *v) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char buf[64];
    bool ok = fgets(buf, sizeof(buf), f) != NULL;
    fclose(f);
    if (!ok || buf[0] < '0' || buf[0] > '9') return false;
    *v = strtoull(buf, NULL, 10);
    return true;
}

// One "key value" line of a memory.stat file (0 when absent).
static unsigned long long tsys__cg_stat(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    char line[256];
    unsigned long long v = 0;
    size_t k = strlen(key);
    while (f && fgets(line, sizeof(line), f))
        if (!strncmp(line, key, k) && line[k] == ' ') { v = strtoull(line + k + 1, NULL, 10); break; }
    if (f) fclose(f);
    return v;
}

// The least room over dir and each of its parents down to (and including) the mount point mnt
// (dir starts with mnt); SIZE_MAX where no level has a limit.
static size_t tsys__cg_walk(char *dir, size_t mnt_len, bool v2) {
    size_t room = SIZE_MAX, len = strlen(dir);
    char path[TSYS__CG_PATH + 64];
    for (;;) {
        unsigned long long limit, usage;
        snprintf(path, sizeof(path), "%s/%s", dir, v2 ? "memory.max" : "memory.limit_in_bytes");
        if (tsys__cg_read_num(path, &limit)) {
            snprintf(path, sizeof(path), "%s/%s", dir, v2 ? "memory.current" : "memory.usage_in_bytes");
            if (!tsys__cg_read_num(path, &usage)) usage = 0;
            snprintf(path, sizeof(path), "%s/memory.stat", dir);
            unsigned long long cache = tsys__cg_stat(path, v2 ? "inactive_file" : "total_inactive_file");
            usage -= cache < usage ? cache : usage;
            unsigned long long r = limit > usage ? limit - usage : 0;
            if (r < (unsigned long long)room) room = (size_t)r;
        }
        if (len <= mnt_len) break;
        while (len > mnt_len && dir[len - 1] != '/') len--;   // up one level
        if (len > mnt_len) len--;                             // the '/' itself
        dir[len] = 0;
    }
    return room;
}

// Copies a mountinfo field, turning its octal escapes (\040 for a space) back into characters.
static void tsys__cg_unescape(char *out, size_t cap, const char *in) {
    size_t n = 0;
    for (; *in && n + 1 < cap; n++) {
        if (in[0] == '\\' && in[1] >= '0' && in[1] <= '3' && in[2] >= '0' && in[2] <= '7' && in[3] >= '0' && in[3] <= '7') {
            out[n] = (char)((in[1] - '0') * 64 + (in[2] - '0') * 8 + (in[3] - '0'));
            in += 4;
        } else out[n] = *in++;
    }
    out[n] = 0;
}

// The room the memory cgroups of this process leave, reading the files under root ("" = the real
// /); SIZE_MAX where there is no limit or nothing can be read.
static size_t tsys__cgroup_room(const char *root) {
    char line[4 * TSYS__CG_PATH], path[TSYS__CG_PATH + 32], cg[2][TSYS__CG_PATH], mnt[2][TSYS__CG_PATH], mroot[2][TSYS__CG_PATH];
    bool have_cg[2] = {false, false}, have_mnt[2] = {false, false};   // [0] v2, [1] v1 memory
    snprintf(path, sizeof(path), "%s/proc/self/cgroup", root);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof(line), f)) {   // "0::/path" (v2), "4:memory:/path" or "3:cpu,memory:/path" (v1)
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2 || c2[1] != '/') continue;
        *c2 = 0;
        int k = -1;
        if (!strcmp(line, "0:")) k = 0;   // "0:" + the empty controller list
        else {
            char *ctl = c1 + 1;
            for (char *t = ctl; t && *t; ) {
                size_t n = strcspn(t, ",");
                if (n == 6 && !strncmp(t, "memory", 6)) { k = 1; break; }
                t = t[n] ? t + n + 1 : NULL;
            }
        }
        if (k >= 0 && strlen(c2 + 1) < sizeof(cg[k])) { memcpy(cg[k], c2 + 1, strlen(c2 + 1) + 1); have_cg[k] = true; }
    }
    if (f) fclose(f);
    if (!have_cg[0] && !have_cg[1]) return SIZE_MAX;
    snprintf(path, sizeof(path), "%s/proc/self/mountinfo", root);
    f = fopen(path, "r");
    while (f && fgets(line, sizeof(line), f)) {   // "id parent maj:min root mountpoint opts [tags] - fstype source superopts"
        char *sep = strstr(line, " - ");
        if (!sep) continue;
        char froot[TSYS__CG_PATH], fmnt[TSYS__CG_PATH], fstype[64], src[256], sopts[256];
        froot[0] = fmnt[0] = fstype[0] = sopts[0] = 0;
        if (sscanf(line, "%*s %*s %*s %1023s %1023s", froot, fmnt) != 2 || sscanf(sep + 3, "%63s %255s %255s", fstype, src, sopts) < 2) continue;
        int k = !strcmp(fstype, "cgroup2") ? 0 : !strcmp(fstype, "cgroup") ? 1 : -1;
        if (k == 1) {   // a v1 hierarchy: the memory one has "memory" among its super options
            bool mem = false;
            for (char *t = sopts; *t; ) {
                size_t n = strcspn(t, ",");
                if (n == 6 && !strncmp(t, "memory", 6)) mem = true;
                t += n + (t[n] != 0);
            }
            if (!mem) k = -1;
        }
        if (k < 0 || have_mnt[k]) continue;
        tsys__cg_unescape(mnt[k], sizeof(mnt[k]), fmnt);
        tsys__cg_unescape(mroot[k], sizeof(mroot[k]), froot);
        have_mnt[k] = true;
    }
    if (f) fclose(f);
    size_t room = SIZE_MAX;
    for (int k = 0; k < 2; k++) {
        if (!have_cg[k]) continue;
        if (!have_mnt[k]) {   // no mountinfo: the usual places
            snprintf(mnt[k], sizeof(mnt[k]), "%s", k == 0 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory");
            snprintf(mroot[k], sizeof(mroot[k]), "/");
        }
        // the cgroup's path below the mount: the part past the mount's own root (a container's mount
        // shows its cgroup as /); a path outside it ("/../..") reads as the mount point itself
        const char *rel = cg[k];
        size_t rl = strlen(mroot[k]);
        if (!strcmp(mroot[k], "/")) rl = 0;
        if (rl && !strncmp(rel, mroot[k], rl) && (rel[rl] == 0 || rel[rl] == '/')) rel += rl;
        else if (rl || strstr(rel, "/..")) rel = "";
        while (*rel == '/') rel++;
        char dir[TSYS__CG_PATH];
        int mn = snprintf(dir, sizeof(dir), "%s%s", root, mnt[k]);
        if (mn < 0 || (size_t)mn >= sizeof(dir)) continue;
        while (mn > 1 && dir[mn - 1] == '/') dir[--mn] = 0;
        if (*rel && snprintf(dir + mn, sizeof(dir) - (size_t)mn, "/%s", rel) >= (int)(sizeof(dir) - (size_t)mn)) continue;
        size_t r = tsys__cg_walk(dir, (size_t)mn, k == 0);
        if (r < room) room = r;
    }
    return room;
}

// Bytes this process can still have without swapping, the OOM killer or its cgroup's limit: the
// least of MemAvailable and the cgroups' room; SIZE_MAX where neither can be read.
static size_t tsys__host_mem_available(void) {
    size_t avail = SIZE_MAX;
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    while (f && fgets(line, sizeof(line), f)) {
        unsigned long long kib;
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) { avail = (size_t)kib * 1024; break; }
    }
    if (f) fclose(f);
    const char *root = getenv("TSYS_CGROUP_ROOT");
    size_t room = tsys__cgroup_room(root ? root : "");
    return room < avail ? room : avail;
}

TSYSDEF size_t tsys_cpu_memory_available(void) { return tsys__host_mem_available(); }
TSYSDEF size_t tsys_ctx_cpu_memory_limit(const tsys_ctx *ctx) { return ctx->cpu_memory_limit; }
TSYSDEF void tsys_ctx_set_cpu_memory_limit(tsys_ctx *ctx, size_t bytes) { ctx->cpu_memory_limit = bytes ? bytes : tsys__host_mem_available(); }

TSYSDEF tsys_ctx *tsys_ctx_new(const tsys_ctx_desc *desc) {
    tsys_ctx *ctx = (tsys_ctx *)TSYS_MALLOC(sizeof(tsys_ctx));
    if (!ctx) return NULL;
    memset(ctx, 0, sizeof(*ctx));
    ctx->backends[TSYS_CPU] = &tsys__cpu_backend;
    ctx->t0_us = tsys_time_us();
    ctx->autocast = TSYS_F32;
    ctx->open_region = -1;
    tsys_ctx_desc d;
    memset(&d, 0, sizeof(d));
    if (desc) d = *desc;
    ctx->cpu_memory_limit = d.cpu_memory_limit ? d.cpu_memory_limit : tsys__host_mem_available();
    ctx->mem.record = d.record_events;
    tsys_rng_seed(ctx, d.seed ? d.seed : 0x5eed);
    ctx->mem.cur_tag = tsys_mem_tag(ctx, "other");
    ctx->mem.cur_category = TSYS_MEM_TEMPORARY;
    for (int i = 0; i < TSYS__OP_COUNT; i++) ctx->op_tags[i] = tsys_mem_tag(ctx, tsys__op_names[i]);
    return ctx;
}

static void tsys__autocast_cache_clear(tsys_ctx *ctx);

// The context's header (the struct itself), once tsys_ctx_free has run and nothing made from it remains.
static void tsys__ctx_destroy(tsys_ctx *ctx) { TSYS_FREE(ctx); }

// Everything goes now but the header: the tape and autocast's copies (the context's own references),
// the device backends (a backend's destroy gives its memory back, that of live tensors too: CUDA
// cudaFree's every block), the hooks, tags and timeline. What the caller still holds (tensors, models,
// optimizers) keeps the header until the last of it goes (tsys__ctx_unref): a release then finds the
// tracker's totals (inline in the header), the built-in CPU backend (stateless: CPU memory is freed at
// the release) and no device backend (its memory went with it). No hook runs for what outlives the
// context: the caller may have freed what the hooks point to.
TSYSDEF void tsys_ctx_free(tsys_ctx *ctx) {
    if (!ctx || ctx->freed) return;
    tsys_tape_clear(ctx);
    tsys__autocast_cache_clear(ctx);
    for (int d = 0; d < TSYS_DEVICE_COUNT; d++)
        if (ctx->backends[d] && ctx->backends[d]->destroy) ctx->backends[d]->destroy(ctx);
    for (int d = 0; d < TSYS_DEVICE_COUNT; d++)
        if (ctx->backends[d] != &tsys__cpu_backend) ctx->backends[d] = NULL;
    memset(&ctx->trace, 0, sizeof(ctx->trace));   // after the backends: their destroy may give hooks back
    memset(ctx->clocks, 0, sizeof(ctx->clocks));
    TSYS_FREE(ctx->ac_src); TSYS_FREE(ctx->ac_low);
    ctx->ac_src = ctx->ac_low = NULL; ctx->ac_len = ctx->ac_cap = 0;
    TSYS_FREE(ctx->bwd_hooks);
    ctx->bwd_hooks = NULL; ctx->num_bwd_hooks = 0;
    TSYS_FREE(ctx->regions);
    ctx->regions = NULL; ctx->num_regions = ctx->cap_regions = 0;
    TSYS_FREE(ctx->tape);
    ctx->tape = NULL; ctx->tape_len = ctx->tape_cap = 0;
    for (int i = 0; i < ctx->mem.num_tags; i++) TSYS_FREE(ctx->mem.tag_names[i]);
    ctx->mem.num_tags = 0;   // the tag ids storages keep still index tag_bytes (inline): totals only
    TSYS_FREE(ctx->mem.events);
    ctx->mem.events = NULL; ctx->mem.num_events = ctx->mem.cap_events = 0;
    ctx->mem.record = false;
    ctx->freed = true;
    if (ctx->users == 0) tsys__ctx_destroy(ctx);
}

TSYSDEF void tsys_ctx_set_backend(tsys_ctx *ctx, tsys_device dev, const tsys_backend *backend) {
    if (ctx && tsys__device_ok(ctx, "tsys_ctx_set_backend", dev)) ctx->backends[dev] = backend;
}
TSYSDEF const tsys_backend *tsys_ctx_backend(const tsys_ctx *ctx, tsys_device dev) { return ctx && (unsigned)dev < TSYS_DEVICE_COUNT ? ctx->backends[dev] : NULL; }
TSYSDEF tsys_status tsys_sync(tsys_ctx *ctx, tsys_device dev) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (!tsys__device_ok(ctx, "tsys_sync", dev)) return TSYS_ERR_INVALID_ARGS;
    return ctx->backends[dev] ? ctx->backends[dev]->sync(ctx) : TSYS_OK;
}

// >>events ----------------------------------------------------------------------------------------

static const tsys_backend *tsys__event_backend(tsys_ctx *ctx, tsys_device dev, tsys_stream s) {
    if (!ctx) return NULL;
    const tsys_backend *be = (unsigned)dev < TSYS_DEVICE_COUNT ? ctx->backends[dev] : NULL;
    if (!be) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "event: device %d has no backend", (int)dev); return NULL; }
    if ((unsigned)s >= TSYS_STREAM_COUNT) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "event: no stream %d", (int)s); return NULL; }
    return be;
}
TSYSDEF tsys_status tsys_event_record(tsys_ctx *ctx, tsys_device dev, tsys_stream s, tsys_event *e) {
    TSYS__CHECK_ARG(ctx, ctx && e, TSYS_ERR_INVALID_ARGS, "event_record: the event is NULL");
    const tsys_backend *be = tsys__event_backend(ctx, dev, s);
    if (!be) return ctx->status;
    if (e->handle && e->device != dev) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "event: recorded on another device before (release it first)");
    e->device = dev; e->stream = s;
    e->host_us = tsys_time_us();
    return be->event_record(ctx, e, s);
}
TSYSDEF tsys_status tsys_event_wait(tsys_ctx *ctx, const tsys_event *e, tsys_stream s) {
    TSYS__CHECK_ARG(ctx, ctx && e, TSYS_ERR_INVALID_ARGS, "event_wait: the event is NULL");
    const tsys_backend *be = tsys__event_backend(ctx, e->device, s);
    return be ? be->event_wait(ctx, e, s) : ctx->status;
}
TSYSDEF double tsys_event_elapsed_ms(tsys_ctx *ctx, const tsys_event *start, const tsys_event *end) {
    double ms = NAN;
    TSYS__CHECK_ARG(ctx, ctx && start && end, NAN, "event_elapsed: an event is NULL");
    if (start->device != end->device) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "event: elapsed between two devices"); return NAN; }
    const tsys_backend *be = tsys__event_backend(ctx, end->device, end->stream);
    if (be && be->event_elapsed(ctx, start, end, &ms) != TSYS_OK) return NAN;
    return ms;
}
TSYSDEF void tsys_event_release(tsys_ctx *ctx, tsys_event *e) {
    if (!ctx || !e) return;
    const tsys_backend *be = (unsigned)e->device < TSYS_DEVICE_COUNT ? ctx->backends[e->device] : NULL;
    if (be && e->handle) be->event_release(ctx, e);
    e->handle = NULL;
}
TSYSDEF tsys_stream tsys_set_stream(tsys_ctx *ctx, tsys_device dev, tsys_stream s) {
    const tsys_backend *be = tsys__event_backend(ctx, dev, s);
    return be ? be->set_stream(ctx, s) : TSYS_STREAM_COMPUTE;
}

// >>trace -----------------------------------------------------------------------------------------

TSYSDEF tsys_tensor *tsys_trace_weight(const tsys_ctx *ctx) { return ctx ? ctx->trace_weight : NULL; }
TSYSDEF tsys_trace_hooks tsys_ctx_set_trace_hooks(tsys_ctx *ctx, const tsys_trace_hooks *hooks) {
    tsys_trace_hooks old;
    memset(&old, 0, sizeof(old));
    if (!ctx) return old;
    old = ctx->trace;
    if (hooks) ctx->trace = *hooks;
    else memset(&ctx->trace, 0, sizeof(ctx->trace));
    return old;
}

// The op_begin hooks of every scope, with what tsys_trace_input reads: an op's inputs (ins, NULL
// entries left out) or a backward node's slots; neither for a range or region. What was there is put
// back after (a hook may run an op of its own).
static void tsys__hooks_begin(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, tsys_tensor *const *ins, const tsys__slot *slots, int n_in) {
    if (!ctx->trace.op_begin) return;
    tsys_tensor *const *old_ins = ctx->trace_ins;
    const tsys__slot *old_slots = ctx->trace_slots;
    int old_n = ctx->trace_num_ins;
    ctx->trace_ins = ins; ctx->trace_slots = slots; ctx->trace_num_ins = ins || slots ? n_in : 0;
    ctx->trace.op_begin(ctx, name, kind, ctx->trace.user);
    ctx->trace_ins = old_ins; ctx->trace_slots = old_slots; ctx->trace_num_ins = old_n;
}

// Opens a scope for the hooks and the memory tracker: what it allocates carries `tag`. Returns the
// tag to restore. With no hooks installed this costs a branch and a store.
static int tsys__scope_begin(tsys_ctx *ctx, const char *name, int tag, tsys_trace_kind kind, tsys_tensor *const *ins, const tsys__slot *slots, int n_in) {
    int old = tsys_mem_set_tag(ctx, tag);
    tsys__hooks_begin(ctx, name, kind, ins, slots, n_in);
    return old;
}
static void tsys__scope_end(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, int old_tag) {
    if (ctx->trace.op_end) ctx->trace.op_end(ctx, name, kind, ctx->trace.user);
    tsys_mem_set_tag(ctx, old_tag);
}
static void tsys__region_begin(tsys_ctx *ctx, const char *name) { tsys__hooks_begin(ctx, name, TSYS_TRACE_REGION, NULL, NULL, 0); }
static void tsys__region_end(tsys_ctx *ctx, const char *name) { if (ctx->trace.op_end) ctx->trace.op_end(ctx, name, TSYS_TRACE_REGION, ctx->trace.user); }
// An op's scope; its inputs (ins[i] NULL: left out) are there for the op_begin hooks to read.
static int tsys__op_begin(tsys_ctx *ctx, tsys__op op, tsys_tensor *const *ins, int n_in) {
    return tsys__scope_begin(ctx, tsys__op_names[op], ctx->op_tags[op], TSYS_TRACE_FORWARD, ins, NULL, n_in);
}
static void tsys__op_end(tsys_ctx *ctx, tsys__op op, int old_tag) { tsys__scope_end(ctx, tsys__op_names[op], TSYS_TRACE_FORWARD, old_tag); }

TSYSDEF int tsys_trace_num_inputs(const tsys_ctx *ctx) { return ctx ? ctx->trace_num_ins : 0; }
TSYSDEF bool tsys_trace_input(const tsys_ctx *ctx, int i, tsys_dtype *dtype, int *ndim, int64_t shape[TSYS_MAX_DIMS]) {
    if (i < 0 || i >= tsys_trace_num_inputs(ctx)) return false;
    const tsys_tensor *t = ctx->trace_ins ? ctx->trace_ins[i] : NULL;
    const tsys__slot *s = ctx->trace_slots ? &ctx->trace_slots[i] : NULL;
    // a node's slot of a left-out input stays zeroed (a 0-dim f32 that no gradient goes to)
    if (!t && (!s || (!s->node && !s->leaf && !s->needs && s->ndim == 0))) return false;
    int n = t ? t->ndim : s->ndim;
    if (dtype) *dtype = t ? t->dtype : s->dtype;
    if (ndim) *ndim = n;
    if (shape) memcpy(shape, t ? t->shape : s->shape, sizeof(int64_t) * (size_t)n);
    return true;
}

// Ranges nest; past TSYS__MAX_RANGES deep they are still reported but not tagged.
TSYSDEF void tsys_trace_begin(tsys_ctx *ctx, const char *name) {
    if (!ctx) return;
    if (!name) name = "?";   // still a range, so the caller's tsys_trace_end closes this one
    int tag = tsys_mem_tag(ctx, name);
    int old = tsys__scope_begin(ctx, name, tag, TSYS_TRACE_RANGE, NULL, NULL, 0);
    if (ctx->num_ranges < TSYS__MAX_RANGES) { ctx->ranges[ctx->num_ranges].name = name; ctx->ranges[ctx->num_ranges].tag = old; }
    ctx->num_ranges++;
}
TSYSDEF void tsys_trace_end(tsys_ctx *ctx) {
    if (!ctx || ctx->num_ranges == 0) return;
    int i = --ctx->num_ranges;
    if (i < TSYS__MAX_RANGES) tsys__scope_end(ctx, ctx->ranges[i].name, TSYS_TRACE_RANGE, ctx->ranges[i].tag);
    else if (ctx->trace.op_end) ctx->trace.op_end(ctx, "?", TSYS_TRACE_RANGE, ctx->trace.user);
}

// >>autograd --------------------------------------------------------------------------------------

TSYSDEF void tsys_no_grad_begin(tsys_ctx *ctx) { if (ctx) ctx->no_grad_depth++; }
TSYSDEF void tsys_no_grad_end(tsys_ctx *ctx) { if (ctx && ctx->no_grad_depth > 0) ctx->no_grad_depth--; }
TSYSDEF bool tsys_grad_enabled(const tsys_ctx *ctx) { return ctx && ctx->no_grad_depth == 0; }
TSYSDEF size_t tsys_tape_size(const tsys_ctx *ctx) { return ctx ? ctx->tape_len : 0; }
TSYSDEF void tsys_tensor_set_requires_grad(tsys_tensor *t, bool on) { if (t && !t->grad_fn) t->requires_grad = on; }

TSYSDEF tsys_dtype tsys_tensor_grad_dtype(const tsys_tensor *t) { return !t ? TSYS_F32 : t->grad_lowp != TSYS_F32 ? t->grad_lowp : t->dtype; }
TSYSDEF tsys_status tsys_tensor_set_grad_dtype(tsys_ctx *ctx, tsys_tensor *t, tsys_dtype dt) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    TSYS__CHECK_ARG(ctx, t, TSYS_ERR_INVALID_ARGS, "tsys_tensor_set_grad_dtype: NULL tensor");
    TSYS__CHECK_ARG(ctx, !t->grad_fn && t->dtype == TSYS_F32, TSYS_ERR_INVALID_ARGS, "tsys_tensor_set_grad_dtype: '%s' must be an fp32 leaf (it is %s%s)", t->name,
                  tsys_dtype_name(t->dtype), t->grad_fn ? ", made by a recorded op" : "");
    TSYS__CHECK_ARG(ctx, dt == TSYS_F32 || dt == TSYS_BF16 || dt == TSYS_F16, TSYS_ERR_INVALID_ARGS, "tsys_tensor_set_grad_dtype: %s for '%s' is not bf16, f16 or f32", tsys_dtype_name(dt), t->name);
    if (dt == tsys_tensor_grad_dtype(t)) return TSYS_OK;
    TSYS__CHECK_ARG(ctx, !t->grad, TSYS_ERR_INVALID_ARGS, "tsys_tensor_set_grad_dtype: '%s' holds a gradient; set its dtype before backward makes one, or after tsys_release_grads", t->name);
    t->grad_lowp = dt;
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_tensor_add_grad_hook(tsys_tensor *t, tsys_grad_hook_fn fn, void *user) {
    if (!t || !fn) return TSYS_ERR_INVALID_ARGS;
    struct tsys__grad_hook *h = (struct tsys__grad_hook *)TSYS_MALLOC(sizeof(*h)), **tail = &t->hooks;
    if (!h) return TSYS__FAIL(t->storage->ctx, TSYS_ERR_OOM, "out of host memory for a gradient hook of '%s'", t->name);
    h->fn = fn; h->user = user; h->next = NULL;
    while (*tail) tail = &(*tail)->next;
    *tail = h;
    return TSYS_OK;
}
TSYSDEF bool tsys_tensor_remove_grad_hook(tsys_tensor *t, tsys_grad_hook_fn fn, void *user) {
    for (struct tsys__grad_hook **p = t ? &t->hooks : NULL; p && *p; p = &(*p)->next) {
        if ((*p)->fn != fn || (*p)->user != user) continue;
        struct tsys__grad_hook *h = *p;
        *p = h->next;
        TSYS_FREE(h);
        return true;
    }
    return false;
}
TSYSDEF void tsys_tensor_set_grad_hook(tsys_tensor *t, tsys_grad_hook_fn fn, void *user) {
    if (!t) return;
    while (t->hooks) tsys_tensor_remove_grad_hook(t, t->hooks->fn, t->hooks->user);
    if (fn) tsys_tensor_add_grad_hook(t, fn, user);
}
static void tsys__fire_grad_hooks(tsys_ctx *ctx, tsys_tensor *leaf) {
    for (struct tsys__grad_hook *h = leaf->hooks, *next; h; h = next) {
        next = h->next;   // a hook may remove itself
        h->fn(ctx, leaf, h->user);
    }
}

TSYSDEF tsys_status tsys_ctx_add_backward_hook(tsys_ctx *ctx, tsys_backward_hook_fn fn, void *user) {
    if (!ctx || !fn) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward hook: NULL function");
    struct tsys__backward_hook *h = (struct tsys__backward_hook *)TSYS_REALLOC(ctx->bwd_hooks, sizeof(*h) * (size_t)(ctx->num_bwd_hooks + 1));
    if (!h) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for a backward hook");
    ctx->bwd_hooks = h;
    h[ctx->num_bwd_hooks].fn = fn; h[ctx->num_bwd_hooks].user = user;
    ctx->num_bwd_hooks++;
    return TSYS_OK;
}
TSYSDEF bool tsys_ctx_remove_backward_hook(tsys_ctx *ctx, tsys_backward_hook_fn fn, void *user) {
    for (int i = 0; ctx && i < ctx->num_bwd_hooks; i++) {
        if (ctx->bwd_hooks[i].fn != fn || ctx->bwd_hooks[i].user != user) continue;
        memmove(&ctx->bwd_hooks[i], &ctx->bwd_hooks[i + 1], sizeof(ctx->bwd_hooks[0]) * (size_t)(ctx->num_bwd_hooks - i - 1));
        ctx->num_bwd_hooks--;
        return true;
    }
    return false;
}

static tsys_kargs tsys__kargs0(void) { tsys_kargs a; memset(&a, 0, sizeof(a)); return a; }

static tsys_tensor *tsys__new_like(tsys_ctx *ctx, const tsys_tensor *t, tsys_dtype dt) {
    return tsys_tensor_new(ctx, dt, t->device, t->ndim, t->shape);
}

// Should an op with these inputs be recorded?
static bool tsys__recording(const tsys_ctx *ctx, tsys_tensor *const *ins, int n) {
    if (ctx->no_grad_depth > 0) return false;
    for (int i = 0; i < n; i++)
        if (ins[i] && ins[i]->requires_grad) return true;
    return false;
}

static tsys__node *tsys__replay_record(tsys_ctx *ctx, tsys__op op, tsys_tensor *const *saved, int n_saved);
static void tsys__region_link(tsys_ctx *ctx, tsys__node *node, tsys_tensor *const *ins, tsys_tensor *const *saved);

// Appends a node for `out` = op(ins) that keeps `saved` alive until backward passes it (inside a
// checkpointed region it keeps the region's inputs instead: >>checkpoint). While a node is being
// recomputed, the op's call lands on that node instead of appending one.
static tsys__node *tsys__record(tsys_ctx *ctx, tsys__op op, tsys_tensor *out, tsys_tensor *const *ins, int n_in, tsys_tensor *const *saved, int n_saved) {
    if (out && ctx->replay) return tsys__replay_record(ctx, op, saved, n_saved);
    if (!out || !tsys__recording(ctx, ins, n_in)) return NULL;
    tsys__node *node = (tsys__node *)TSYS_MALLOC(sizeof(tsys__node));
    if (ctx->tape_len == ctx->tape_cap) {
        size_t cap = ctx->tape_cap ? ctx->tape_cap * 2 : 256;
        tsys__node **tape = (tsys__node **)TSYS_REALLOC(ctx->tape, cap * sizeof(*tape));
        if (tape) { ctx->tape = tape; ctx->tape_cap = cap; }
    }
    if (!node || ctx->tape_len == ctx->tape_cap) {
        TSYS_FREE(node);
        TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the autograd tape");
        return NULL;
    }
    memset(node, 0, sizeof(*node));
    node->op = op;
    node->n_in = n_in;
    for (int i = 0; i < n_in; i++) {
        tsys_tensor *x = ins[i];
        tsys__slot *s = &node->in[i];
        if (!x) continue;
        s->dtype = x->dtype; s->ndim = x->ndim;
        memcpy(s->shape, x->shape, sizeof(s->shape));
        s->needs = x->requires_grad;
        if (!x->requires_grad) continue;
        if (x->grad_fn) s->node = x->grad_fn;
        else { s->leaf = tsys_tensor_retain(x); x->tape_uses++; }
    }
    node->index = ctx->tape_len;
    node->region = ctx->open_region;
    node->autocast = ctx->autocast;
    if (node->region >= 0) tsys__region_link(ctx, node, ins, saved);   // keeps the inputs, not the saved values
    for (int i = 0; node->region < 0 && i < n_saved; i++) {
        node->saved[i] = tsys_tensor_retain(saved[i]);
        if (saved[i]) tsys__mem_saved(ctx, saved[i]->storage, +1);
    }
    node->n_saved = n_saved;
    node->out = out;
    node->out_dtype = node->grad_dtype = out->dtype; node->out_ndim = out->ndim;
    memcpy(node->out_shape, out->shape, sizeof(node->out_shape));
    out->grad_fn = node;
    out->requires_grad = true;
    ctx->tape[ctx->tape_len++] = node;
    return node;
}

// Lets go of a node: saved values, its output gradient, and the leaves' pending uses (firing the
// gradient-ready hook of a leaf whose last use this was).
static void tsys__node_drop_inputs(tsys_ctx *ctx, tsys__node *node);
static void tsys__node_free(tsys_ctx *ctx, tsys__node *node) {
    for (int i = 0; i < node->n_saved; i++) {
        if (node->saved[i]) tsys__mem_saved(ctx, node->saved[i]->storage, -1);
        tsys_tensor_release(node->saved[i]);
    }
    tsys__node_drop_inputs(ctx, node);
    tsys_tensor_release(node->rc_out);
    tsys_tensor_release(node->gout);
    if (node->group && --node->group->refs == 0) {
        tsys_tensor_release(node->group->home);
        TSYS_FREE(node->group);
    }
    if (node->out) { node->out->grad_fn = NULL; node->out->requires_grad = false; }
    for (int i = 0; i < node->n_in; i++) {
        tsys_tensor *leaf = node->in[i].leaf;
        if (!leaf) continue;
        if (--leaf->tape_uses == 0 && leaf->grad_touched) {
            leaf->grad_touched = false;
            tsys__fire_grad_hooks(ctx, leaf);
        }
        tsys_tensor_release(leaf);
    }
    TSYS_FREE(node);
}

TSYSDEF void tsys_tape_clear(tsys_ctx *ctx) {
    if (!ctx) return;
    for (size_t i = ctx->tape_len; i-- > 0;) tsys__node_free(ctx, ctx->tape[i]);
    ctx->tape_len = 0;
    ctx->num_regions = 0;   // an open region is abandoned with its tape
    ctx->open_region = -1;
}

// The gradients of a group of fp32 parameters that lie back to back in one block (a model's layer):
// one block laid out like theirs, made the first time backward needs any of them, and given back by
// tsys_release_grads. A model used only for inference never holds gradients (as PyTorch's .grad
// stays None); in training, backward makes them layer by layer as it frees the layers' activations,
// so the two do not peak together; the optimizer still sees contiguous runs.
struct tsys__grad_home {
    tsys_tensor **params;   // back to back in one storage, in order
    int n;
    tsys_tensor *block;     // NULL until made
};
// Where gradient i starts in the block, the ones before it ending at `end`: laid out like the parameters
// (back to back) while their dtypes agree; where a low-precision gradient (tsys_tensor_set_grad_dtype)
// meets one of another dtype, at the next 256 bytes, so that each run of one dtype starts aligned.
static size_t tsys__grad_home_place(const tsys__grad_home *h, int i, size_t end) {
    if (i == 0 || tsys_tensor_grad_dtype(h->params[i]) == tsys_tensor_grad_dtype(h->params[i - 1])) return end;
    return (end + 255) & ~(size_t)255;
}
static tsys_status tsys__grad_home_make(tsys_ctx *ctx, tsys__grad_home *h) {
    if (h->block) return TSYS_OK;
    size_t bytes = 0;
    for (int i = 0; i < h->n; i++) bytes = tsys__grad_home_place(h, i, bytes) + (size_t)tsys_tensor_numel(h->params[i]) * tsys_dtype_size(tsys_tensor_grad_dtype(h->params[i]));
    int64_t numel = (int64_t)((bytes + 3) / 4);
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "grad"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_GRADIENTS);
    h->block = tsys_tensor_new(ctx, TSYS_F32, h->params[0]->device, 1, &numel);
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    if (!h->block) return ctx->status;
    tsys_tensor_set_name(h->block, "%s.grads", h->params[0]->name);
    size_t off = 0;
    for (int i = 0; i < h->n; i++) {
        tsys_tensor *p = h->params[i];
        tsys_dtype dt = tsys_tensor_grad_dtype(p);
        off = tsys__grad_home_place(h, i, off);
        size_t at = off;
        off += (size_t)tsys_tensor_numel(p) * tsys_dtype_size(dt);
        if (p->grad) continue;   // one a user set on their own stays theirs
        p->grad = tsys_tensor_view_raw(ctx, h->block, at, dt, p->ndim, p->shape);
        if (!p->grad) return ctx->status;
        tsys_tensor_set_name(p->grad, "%s.grad", p->name);
        p->grad_zero = true;   // counts as zero: the first gradient is stored, not added
    }
    return TSYS_OK;
}
// Gives the block back: the parameters' .grad become NULL (those it made; a user's stay).
static void tsys__grad_home_release(tsys__grad_home *h) {
    if (!h->block) return;
    for (int i = 0; i < h->n; i++) {
        tsys_tensor *p = h->params[i];
        if (!p->grad || p->grad->storage != h->block->storage) continue;
        tsys_tensor_release(p->grad);
        p->grad = NULL; p->grad_zero = false;
    }
    tsys_tensor_release(h->block);
    h->block = NULL;
}

// A leaf's gradient buffer for a kernel to write: *overwrite says the kernel must store (the buffer
// counts as zero) rather than add. Created on first use (for a model's parameter: all of the model's).
static tsys_tensor *tsys__leaf_grad_for_write(tsys_ctx *ctx, tsys_tensor *leaf, bool *overwrite) {
    *overwrite = false;
    if (!leaf->grad && leaf->grad_home && tsys__grad_home_make(ctx, leaf->grad_home) != TSYS_OK) return NULL;
    if (!leaf->grad) {
        int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "grad"));
        tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_GRADIENTS);
        leaf->grad = tsys__new_like(ctx, leaf, tsys_tensor_grad_dtype(leaf));
        tsys_mem_set_category(ctx, cat);
        tsys_mem_set_tag(ctx, tag);
        if (!leaf->grad) return NULL;
        tsys_tensor_set_name(leaf->grad, "%s.grad", leaf->name);
        leaf->grad_zero = true;
    }
    if (leaf->grad_lowp != TSYS_F32 && !leaf->grad_zero) {   // adding in bf16 / f16 would round each sum
        TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: '%s' keeps its gradient in %s (tsys_tensor_set_grad_dtype), which takes one gradient a backward; "
                   "this is a second (a weight used twice, or gradients accumulated without zero_grad): keep it in fp32 for that", leaf->name, tsys_dtype_name(leaf->grad_lowp));
        return NULL;
    }
    *overwrite = leaf->grad_zero;
    leaf->grad_zero = false;
    leaf->grad_touched = true;
    return leaf->grad;
}

// A leaf's gradient buffer holding real values (zero-filled when it counted as zero): kernels add into it.
static tsys_tensor *tsys__leaf_grad(tsys_ctx *ctx, tsys_tensor *leaf) {
    bool overwrite;
    tsys_tensor *g = tsys__leaf_grad_for_write(ctx, leaf, &overwrite);
    if (g && overwrite && tsys_tensor_fill(ctx, g, 0.0f) != TSYS_OK) return NULL;
    return g;
}

// Gives every gradient that still counts as zero its zeros, before something reads the values.
static tsys_status tsys__grads_settle(tsys_ctx *ctx, tsys_tensor **params, int n) {
    for (int i = 0; i < n; i++) {
        if (!params[i]->grad || !params[i]->grad_zero) continue;
        params[i]->grad_zero = false;
        if (tsys_tensor_fill(ctx, params[i]->grad, 0.0f) != TSYS_OK) return ctx->status;
    }
    return TSYS_OK;
}

static tsys_tensor *tsys__cast_raw(tsys_ctx *ctx, tsys_tensor *x, tsys_dtype dt) {
    tsys_tensor *y = tsys__new_like(ctx, x, dt);
    tsys_kargs a = tsys__kargs0();
    a.t[0] = y; a.t[1] = x;
    if (y && tsys__kernel(ctx, x->device, TSYS_K_CAST, &a) != TSYS_OK) { tsys_tensor_release(y); return NULL; }
    return y;
}

// dst += src (dtypes may differ); dst must not be shared.
static tsys_status tsys__accum(tsys_ctx *ctx, tsys_tensor *dst, tsys_tensor *src) {
    tsys_kargs a = tsys__kargs0();
    a.t[0] = dst; a.t[1] = src; a.f[0] = 1.0f;
    return tsys__kernel(ctx, dst->device, TSYS_K_ACCUM, &a);
}

// Adds gradient g (consumed: the caller's reference passes here) to the input behind slot s.
static tsys_status tsys__grad_add(tsys_ctx *ctx, tsys__slot *s, tsys_tensor *g) {
    tsys_status st = TSYS_OK;
    if (!g) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "backward: gradient missing");
    if (s->leaf) {
        bool overwrite;
        tsys_tensor *dst = tsys__leaf_grad_for_write(ctx, s->leaf, &overwrite);
        tsys_kargs a = tsys__kargs0();
        a.t[0] = dst; a.t[1] = g;
        st = !dst ? ctx->status : overwrite ? tsys__kernel(ctx, dst->device, TSYS_K_CAST, &a) : tsys__accum(ctx, dst, g);
    } else if (s->node) {
        tsys__node *n = s->node;
        if (!n->gout) {
            // Take g as the gradient when it has the output's dtype; copy it on a later accumulation if shared.
            // A narrower one (a matmul's bf16 dx where a norm gathers fp32) waits as it is: the next gradient
            // is added to it into fp32 in one pass, and a lone one is widened when backward reaches n
            // (tsys__gout_settle). The same bits as widening it first.
            bool wait = n->grad_dtype == TSYS_F32 && (g->dtype == TSYS_BF16 || g->dtype == TSYS_F16);
            n->gout = g->dtype == n->grad_dtype || wait ? tsys_tensor_retain(g) : tsys__cast_raw(ctx, g, n->grad_dtype);
            if (!n->gout) st = ctx->status ? ctx->status : TSYS_ERR_OOM;
        } else if (n->gout->dtype != n->grad_dtype) {   // the waiting gradient and g, summed into a new fp32 one
            tsys_kargs a = tsys__kargs0();
            a.t[0] = tsys__new_like(ctx, n->gout, n->grad_dtype); a.t[1] = n->gout; a.t[2] = g;
            st = a.t[0] ? tsys__kernel(ctx, g->device, TSYS_K_ADD, &a) : ctx->status;
            tsys_tensor_release(n->gout);
            n->gout = st == TSYS_OK ? a.t[0] : NULL;
            if (st != TSYS_OK) tsys_tensor_release(a.t[0]);
        } else {
            if (n->gout->refcount > 1 || n->gout->storage->refcount > 1) {   // copy on write
                tsys_tensor *own = tsys_tensor_clone(ctx, n->gout);
                tsys_tensor_release(n->gout);
                n->gout = own;
            }
            st = n->gout ? tsys__accum(ctx, n->gout, g) : ctx->status;
        }
    }
    tsys_tensor_release(g);
    return st;
}

static tsys_status tsys__node_backward(tsys_ctx *ctx, tsys__node *node);
static tsys_status tsys__checkpoint_materialize(tsys_ctx *ctx, tsys__node *node);
static bool tsys__linears_ready(const tsys_ctx *ctx, size_t i);
static tsys_status tsys__bwd_linears(tsys_ctx *ctx, size_t i);

// A gradient that waited in a narrower dtype (tsys__grad_add) widened to the node's, before its backward reads it.
static tsys_status tsys__gout_settle(tsys_ctx *ctx, tsys__node *n) {
    if (n->gout->dtype == n->grad_dtype) return TSYS_OK;
    tsys_tensor *wide = tsys__cast_raw(ctx, n->gout, n->grad_dtype);
    tsys_tensor_release(n->gout);
    n->gout = wide;
    return wide ? TSYS_OK : ctx->status ? ctx->status : TSYS_ERR_OOM;
}

TSYSDEF tsys_status tsys_backward_with(tsys_ctx *ctx, tsys_tensor *out, tsys_tensor *grad_out) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (!out || !grad_out) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: NULL tensor (did the forward pass fail? %s)", ctx->error);
    if (ctx->status != TSYS_OK) return ctx->status;
    if (!tsys__owned(ctx, "backward", out) || !tsys__owned(ctx, "backward", grad_out)) return TSYS_ERR_INVALID_ARGS;
    if (!out->grad_fn) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: '%s' was not produced by a recorded op (no_grad, or nothing requires grad)", out->name);
    if (ctx->open_region >= 0) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: a checkpointed region is still open (every tsys_checkpoint_begin needs its tsys_checkpoint_end first)");
    if (tsys_tensor_numel(out) != tsys_tensor_numel(grad_out))
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: gradient has %lld elements, output '%s' has %lld", (long long)tsys_tensor_numel(grad_out), out->name, (long long)tsys_tensor_numel(out));
    tsys__slot root;
    memset(&root, 0, sizeof(root));
    root.node = out->grad_fn;
    tsys_status st = tsys__grad_add(ctx, &root, tsys_tensor_retain(grad_out));
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "backward"));
    ctx->in_backward = true;
    for (size_t i = ctx->tape_len; i-- > 0;) {
        tsys__node *node = ctx->tape[i];
        if (st == TSYS_OK && node->gout) st = tsys__gout_settle(ctx, node);
        if (st == TSYS_OK && node->gout && node->region >= 0) st = tsys__checkpoint_materialize(ctx, node);
        if (st == TSYS_OK && node->gout && !node->group_done)
            st = node->group && tsys__linears_ready(ctx, i) ? tsys__bwd_linears(ctx, i) : tsys__node_backward(ctx, node);
        tsys__node_free(ctx, node);
        ctx->tape_len = i;
    }
    ctx->num_regions = 0;
    ctx->in_backward = false;
    tsys_mem_set_tag(ctx, tag);
    for (int i = 0; st == TSYS_OK && i < ctx->num_bwd_hooks; i++) ctx->bwd_hooks[i].fn(ctx, ctx->bwd_hooks[i].user);
    return st;
}

TSYSDEF tsys_status tsys_backward(tsys_ctx *ctx, tsys_tensor *loss) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (!loss) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: loss is NULL (did the forward pass fail? %s)", ctx->error);
    if (tsys_tensor_numel(loss) != 1) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: loss '%s' has %lld elements, expected a scalar", loss->name, (long long)tsys_tensor_numel(loss));
    tsys_tensor *one = tsys__new_like(ctx, loss, loss->dtype);
    if (!one || tsys_tensor_fill(ctx, one, 1.0f) != TSYS_OK) { tsys_tensor_release(one); return ctx->status; }
    tsys_status st = tsys_backward_with(ctx, loss, one);
    tsys_tensor_release(one);
    return st;
}

// >>autocast --------------------------------------------------------------------------------------

TSYSDEF void tsys_autocast_begin(tsys_ctx *ctx, tsys_dtype low) { if (ctx) ctx->autocast = (low == TSYS_BF16 || low == TSYS_F16) ? low : TSYS_F32; }
TSYSDEF tsys_dtype tsys_autocast_dtype(const tsys_ctx *ctx) { return ctx ? ctx->autocast : TSYS_F32; }

static void tsys__autocast_cache_clear(tsys_ctx *ctx) {
    for (int i = 0; i < ctx->ac_len; i++) { tsys_tensor_release(ctx->ac_src[i]); tsys_tensor_release(ctx->ac_low[i]); }
    ctx->ac_len = 0;
}
TSYSDEF void tsys_autocast_end(tsys_ctx *ctx) { if (ctx) { ctx->autocast = TSYS_F32; tsys__autocast_cache_clear(ctx); } }

// Where a kept copy starts in its optimizer's block (tsys_optim_keep_lowp): 256-byte aligned, as a
// fresh allocation is. The CUDA GEMM picks its cuBLASLt algorithm by the operands' alignment (up to
// 256 bytes), so a copy aligned less than the cast it replaces could be multiplied by another
// algorithm and round differently.
static size_t tsys__lowp_align(size_t off) { return (off + 255) & ~(size_t)255; }
static bool tsys__lowp_valid(const tsys_tensor *w) { return w->lowp && w->lowp_of == w->storage->id && w->lowp_version == w->storage->version; }
static void tsys__lowp_mark(tsys_tensor *w) { w->lowp_of = w->storage->id; w->lowp_version = w->storage->version; }

// One new version for each storage the parameters lie in (the first parameter on it bumps it); then the
// copies whose bytes did not change are marked made from that version.
TSYSDEF void tsys_params_mark_written(tsys_tensor *const *params, int n, const bool *written, bool copies_written) {
    if (!params || !written) return;
    for (int i = 0; i < n; i++) {
        tsys_storage *s = params[i] ? params[i]->storage : NULL;
        bool first = s != NULL;
        for (int j = 0; first && j < i; j++) first = !params[j] || params[j]->storage != s;   // n is a model's tensors: quadratic is fine
        if (!first) continue;
        const uint64_t before = s->version++;
        for (int j = i; j < n; j++) {
            tsys_tensor *p = params[j];
            if (!p || p->storage != s) continue;
            if (written[j]) tsys__freshen(p);
            if (!p->lowp) continue;
            const bool was_valid = p->lowp_of == s->id && p->lowp_version == before;
            if (written[j] ? copies_written : was_valid) tsys__lowp_mark(p);
        }
    }
}

static bool tsys__params_ok(tsys_ctx *ctx, const char *fn, tsys_tensor *const *params, int n);
// Each storage's list made again from the parameters on it (n is a model's tensors: quadratic is fine).
TSYSDEF tsys_status tsys_params_mark_stale(tsys_ctx *ctx, tsys_tensor *const *params, int n, const bool *stale) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (!tsys__params_ok(ctx, "tsys_params_mark_stale", params, n)) return TSYS_ERR_INVALID_ARGS;
    TSYS__CHECK_ARG(ctx, n == 0 || stale, TSYS_ERR_INVALID_ARGS, "tsys_params_mark_stale: no stale[] for %d parameters", n);
    for (int i = 0; i < n; i++) params[i]->storage->n_stale = -1;   // not made yet
    for (int i = 0; i < n; i++) {
        tsys_storage *s = params[i]->storage;
        if (s->n_stale >= 0) continue;
        int count = 0;
        for (int j = i; j < n; j++) count += params[j]->storage == s && stale[j];
        tsys__stale *list = count ? (tsys__stale *)TSYS_REALLOC(s->stale, sizeof(tsys__stale) * (size_t)count) : s->stale;
        s->n_stale = 0;
        if (!list) {
            for (int j = i; j < n; j++) params[j]->storage->n_stale = 0;
            return TSYS__FAIL(ctx, TSYS_ERR_OOM, "tsys_params_mark_stale: out of host memory");
        }
        s->stale = list;
        for (int j = i; j < n; j++) {
            if (params[j]->storage != s || !stale[j]) continue;
            tsys__stale *e = &s->stale[s->n_stale++];
            e->lo = params[j]->offset; e->hi = params[j]->offset + tsys_tensor_bytes(params[j]);
            snprintf(e->name, sizeof e->name, "%s", params[j]->name);
        }
    }
    return TSYS_OK;
}

// The kept copy of w (tsys_optim_keep_lowp) in dt, cast again into its place when w was written since
// it was made; NULL when w has none in dt, or when the stale one is still held by another (a tape node
// saved it for backward: overwriting it would change that backward), so the caller casts as usual.
static tsys_tensor *tsys__autocast_kept(tsys_ctx *ctx, tsys_tensor *w, tsys_dtype dt) {
    if (!w->lowp || w->lowp->dtype != dt) return NULL;
    if (tsys__lowp_valid(w)) return tsys_tensor_retain(w->lowp);
    if (w->lowp->refcount > 1) return NULL;
    tsys_kargs a = tsys__kargs0();
    a.t[0] = w->lowp; a.t[1] = w;
    if (tsys__kernel(ctx, w->device, TSYS_K_CAST, &a) != TSYS_OK) return NULL;
    tsys__lowp_mark(w);
    return tsys_tensor_retain(w->lowp);
}

// Room in the autocast cache for n more copies.
static bool tsys__ac_room(tsys_ctx *ctx, int n) {
    if (ctx->ac_len + n <= ctx->ac_cap) return true;
    int cap = ctx->ac_cap ? ctx->ac_cap * 2 : 64;
    while (cap < ctx->ac_len + n) cap *= 2;
    tsys_tensor **s = (tsys_tensor **)TSYS_REALLOC(ctx->ac_src, (size_t)cap * sizeof(*s));
    if (s) ctx->ac_src = s;
    tsys_tensor **l = (tsys_tensor **)TSYS_REALLOC(ctx->ac_low, (size_t)cap * sizeof(*l));
    if (l) ctx->ac_low = l;
    if (!s || !l) { TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the autocast cache"); return false; }
    ctx->ac_cap = cap;
    return true;
}

// The copies of a linear group's weights (tsys_linears) when autocast makes them this region: side by side
// in one block, so that the group's products batch. False where any of them is kept, already made or no
// parameter (nothing made), or where making them failed: the caller then takes them one by one.
static bool tsys__autocast_weights(tsys_ctx *ctx, tsys_tensor *const *w, int n, tsys_dtype dt, tsys_tensor **out) {
    if (ctx->replay) return false;
    for (int j = 0; j < n; j++) {
        if (w[j]->dtype == dt || w[j]->grad_fn || w[j]->lowp) return false;
        for (int i = 0; i < ctx->ac_len; i++)
            if (ctx->ac_src[i] == w[j]) return false;
    }
    if (!tsys__ac_room(ctx, n)) return false;
    int64_t shape[3] = {n, w[0]->shape[0], w[0]->shape[1]};
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "autocast weights"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_PARAMETERS);
    tsys_tensor *block = tsys_tensor_new(ctx, dt, w[0]->device, 3, shape);
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    bool ok = block != NULL;
    for (int j = 0; ok && j < n; j++) {
        tsys_tensor *low = tsys_tensor_view_raw(ctx, block, (size_t)j * (size_t)tsys_tensor_numel(w[0]) * tsys_dtype_size(dt), dt, 2, w[j]->shape);
        tsys_kargs a = tsys__kargs0();
        a.t[0] = low; a.t[1] = w[j];
        ok = low && tsys__kernel(ctx, w[j]->device, TSYS_K_CAST, &a) == TSYS_OK;
        if (!ok) { tsys_tensor_release(low); break; }
        tsys_tensor_set_name(low, "%s.%s", w[j]->name, tsys_dtype_name(dt));
        ctx->ac_src[ctx->ac_len] = tsys_tensor_retain(w[j]);
        ctx->ac_low[ctx->ac_len++] = low;
        out[j] = tsys_tensor_retain(low);
    }
    tsys_tensor_release(block);
    for (int j = 0; !ok && j < n; j++) { tsys_tensor_release(out[j]); out[j] = NULL; }   // the cache keeps what was made
    return ok;
}

// Low-precision copy of a parameter: the kept one when there is one, else made once per autocast
// region (weights do not change inside it).
static tsys_tensor *tsys__autocast_weight(tsys_ctx *ctx, tsys_tensor *w, tsys_dtype dt) {
    tsys_tensor *kept = tsys__autocast_kept(ctx, w, dt);
    if (kept || ctx->status != TSYS_OK) return kept;
    for (int i = 0; i < ctx->ac_len; i++)
        if (ctx->ac_src[i] == w && ctx->ac_low[i]->dtype == dt) return tsys_tensor_retain(ctx->ac_low[i]);
    if (ctx->replay) {   // a recompute in backward (autocast has ended): the copy lives as long as its node keeps it
        int rtag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "autocast weights"));
        tsys_mem_category rcat = tsys_mem_set_category(ctx, TSYS_MEM_PARAMETERS);
        tsys_tensor *copy = tsys__cast_raw(ctx, w, dt);
        tsys_mem_set_category(ctx, rcat);
        tsys_mem_set_tag(ctx, rtag);
        return copy;
    }
    if (!tsys__ac_room(ctx, 1)) return NULL;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "autocast weights"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_PARAMETERS);   // low-precision copies of them, for the step
    tsys_tensor *low = tsys__cast_raw(ctx, w, dt);
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    if (!low) return NULL;
    tsys_tensor_set_name(low, "%s.%s", w->name, tsys_dtype_name(dt));
    ctx->ac_src[ctx->ac_len] = tsys_tensor_retain(w);
    ctx->ac_low[ctx->ac_len] = low;
    ctx->ac_len++;
    return tsys_tensor_retain(low);
}

// The dtype a matmul-class op computes in: the autocast dtype when on, else the inputs' own.
static tsys_dtype tsys__matmul_dtype(tsys_ctx *ctx, const tsys_tensor *a, const tsys_tensor *b) {
    if (ctx->autocast != TSYS_F32) return ctx->autocast;
    return a->dtype == b->dtype ? a->dtype : TSYS_F32;
}

static tsys_dtype tsys__promote(tsys_dtype a, tsys_dtype b) { return a == b ? a : TSYS_F32; }

// >>ops -------------------------------------------------------------------------------------------

// Common entry checks, which every op makes before it runs anything: a context, inputs present (a NULL
// one: an earlier op failed, its error is already recorded), each of them one of ctx's (ctx's allocator,
// tracker and tape are about to hold them), on one device; float where a float is needed.
static bool tsys__check_inputs(tsys_ctx *ctx, const char *op, tsys_tensor *const *ins, int n) {
    if (!ctx) return false;
    for (int i = 0; i < n; i++)
        if (!ins[i]) return false;
    for (int i = 0; i < n; i++)
        if (!tsys__owned(ctx, op, ins[i])) return false;
    for (int i = 1; i < n; i++)
        if (ins[i]->device != ins[0]->device) {
            TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: inputs '%s' and '%s' are on different devices", op, ins[0]->name, ins[i]->name);
            return false;
        }
    return true;
}

static bool tsys__check_float(tsys_ctx *ctx, const char *op, const tsys_tensor *t) {
    if (tsys_dtype_is_float(t->dtype)) return true;
    TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: '%s' has dtype %s, expected a float tensor", op, t->name, tsys_dtype_name(t->dtype));
    return false;
}

static bool tsys__check_same_shape(tsys_ctx *ctx, const char *op, const tsys_tensor *a, const tsys_tensor *b) {
    if (tsys_tensor_same_shape(a, b)) return true;
    char sa[96], sb[96];
    tsys__shape_str(a, sa, sizeof(sa)); tsys__shape_str(b, sb, sizeof(sb));
    TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: shapes differ: '%s' %s vs '%s' %s", op, a->name, sa, b->name, sb);
    return false;
}

// Runs kernel k on args whose t[0] is a fresh output; releases the output on failure.
static tsys_tensor *tsys__run(tsys_ctx *ctx, tsys_kernel k, tsys_kargs *a) {
    if (tsys__kernel(ctx, a->t[0]->device, k, a) != TSYS_OK) { tsys_tensor_release(a->t[0]); return NULL; }
    return a->t[0];
}

TSYSDEF tsys_tensor *tsys_cast(tsys_ctx *ctx, tsys_tensor *x, tsys_dtype dt) {
    if (!tsys__check_inputs(ctx, "cast", &x, 1)) return NULL;
    if (x->dtype == dt) return tsys_tensor_retain(x);
    TSYS__REQUIRE(ctx, tsys_dtype_is_float(dt) && tsys_dtype_is_float(x->dtype), "cast: '%s' %s -> %s is not a float conversion", x->name, tsys_dtype_name(x->dtype), tsys_dtype_name(dt));
    int tag = tsys__op_begin(ctx, TSYS__OP_CAST, &x, 1);
    tsys_tensor *y = tsys__cast_raw(ctx, x, dt);
    tsys__record(ctx, TSYS__OP_CAST, y, &x, 1, NULL, 0);
    tsys__op_end(ctx, TSYS__OP_CAST, tag);
    return y;
}

TSYSDEF tsys_tensor *tsys_view(tsys_ctx *ctx, tsys_tensor *t, int ndim, const int64_t *shape) {
    if (!tsys__check_inputs(ctx, "view", &t, 1)) return NULL;
    TSYS__REQUIRE(ctx, ndim >= 0 && ndim <= TSYS_MAX_DIMS && (shape || ndim == 0), "view: '%s' to %d dims%s (0 to %d, with a shape)", t->name, ndim,
                  shape ? "" : " of a NULL shape", TSYS_MAX_DIMS);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    TSYS__REQUIRE(ctx, n == tsys_tensor_numel(t), "view: '%s' has %lld elements, the new shape %lld", t->name, (long long)tsys_tensor_numel(t), (long long)n);
    int tag = tsys__op_begin(ctx, TSYS__OP_VIEW, &t, 1);
    tsys_tensor *v = tsys_tensor_view_raw(ctx, t, 0, t->dtype, ndim, shape);
    if (v) memcpy(v->name, t->name, sizeof(v->name));
    tsys__record(ctx, TSYS__OP_VIEW, v, &t, 1, NULL, 0);
    tsys__op_end(ctx, TSYS__OP_VIEW, tag);
    return v;
}

TSYSDEF tsys_tensor *tsys_embedding(tsys_ctx *ctx, tsys_tensor *weight, tsys_tensor *ids) {
    tsys_tensor *ins[2] = {weight, ids};
    if (!tsys__check_inputs(ctx, "embedding", ins, 2)) return NULL;
    TSYS__REQUIRE(ctx, weight->ndim == 2, "embedding: weight '%s' must be 2-D (vocab, dim)", weight->name);
    TSYS__REQUIRE(ctx, ids->dtype == TSYS_I32 || ids->dtype == TSYS_I64, "embedding: ids '%s' must be i32 or i64, got %s", ids->name, tsys_dtype_name(ids->dtype));
    TSYS__REQUIRE(ctx, ids->ndim < TSYS_MAX_DIMS, "embedding: ids '%s' has too many dims", ids->name);
    int64_t shape[TSYS_MAX_DIMS];
    memcpy(shape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
    shape[ids->ndim] = weight->shape[1];
    ctx->trace_weight = weight;
    int tag = tsys__op_begin(ctx, TSYS__OP_EMBEDDING, ins, 2);
    ctx->trace_weight = NULL;
    tsys_kargs a = tsys__kargs0();
    a.t[0] = tsys_tensor_new(ctx, weight->dtype, weight->device, ids->ndim + 1, shape);
    a.t[1] = weight; a.t[2] = ids;
    tsys_tensor *y = a.t[0] ? tsys__run(ctx, TSYS_K_EMBED_FWD, &a) : NULL;
    tsys__record(ctx, TSYS__OP_EMBEDDING, y, ins, 2, &ids, 1);
    ctx->trace_weight = weight;
    tsys__op_end(ctx, TSYS__OP_EMBEDDING, tag);
    ctx->trace_weight = NULL;
    return y;
}

static tsys_gemm_args tsys__gemm_args(const tsys_tensor *a, const tsys_tensor *b, tsys_tensor *c, bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
    tsys_gemm_args g;
    memset(&g, 0, sizeof(g));
    g.a = a; g.b = b; g.c = c; g.trans_a = ta; g.trans_b = tb;
    g.m = m; g.n = n; g.k = k; g.batch = 1; g.alpha = 1.0f; g.beta = 0.0f;
    return g;
}

// Input of a matmul-class op in the compute dtype: recorded cast, or the cached weight copy.
static tsys_tensor *tsys__matmul_input(tsys_ctx *ctx, tsys_tensor *x, tsys_dtype dt, bool is_weight) {
    if (x->dtype == dt) return tsys_tensor_retain(x);
    if (is_weight && !x->grad_fn) {
        tsys_no_grad_begin(ctx);
        tsys_tensor *w = tsys__autocast_weight(ctx, x, dt);
        tsys_no_grad_end(ctx);
        return w;
    }
    return tsys_cast(ctx, x, dt);
}

TSYSDEF tsys_tensor *tsys_linear(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *weight, tsys_tensor *bias) {
    tsys_tensor *ins[3] = {x, weight, bias};
    if (!tsys__check_inputs(ctx, "linear", ins, bias ? 3 : 2)) return NULL;
    if (!tsys__check_float(ctx, "linear", x) || !tsys__check_float(ctx, "linear", weight)) return NULL;
    TSYS__REQUIRE(ctx, weight->ndim == 2 && x->ndim >= 1 && tsys__last_dim(x) == weight->shape[1],
                  "linear: input '%s' last dim %lld does not match weight '%s' (%lld, %lld) [d_out, d_in]", x->name, (long long)tsys__last_dim(x),
                  weight->name, (long long)weight->shape[0], (long long)(weight->ndim > 1 ? weight->shape[1] : -1));
    TSYS__REQUIRE(ctx, !bias || (bias->ndim == 1 && bias->shape[0] == weight->shape[0]), "linear: bias '%s' must be (%lld)", bias ? bias->name : "", (long long)weight->shape[0]);
    ctx->trace_weight = weight;
    int tag = tsys__op_begin(ctx, TSYS__OP_LINEAR, ins, 3);   // no bias: [] as its shape
    ctx->trace_weight = NULL;
    tsys_dtype dt = tsys__matmul_dtype(ctx, x, weight);
    tsys_tensor *xl = tsys__matmul_input(ctx, x, dt, false);
    tsys_tensor *wl = xl ? tsys__matmul_input(ctx, weight, dt, true) : NULL;
    tsys_tensor *y = NULL;
    if (wl) {
        int64_t shape[TSYS_MAX_DIMS];
        memcpy(shape, x->shape, sizeof(shape));
        shape[x->ndim - 1] = weight->shape[0];
        y = tsys_tensor_new(ctx, dt, x->device, x->ndim, shape);
    }
    if (y) {
        tsys_gemm_args g = tsys__gemm_args(xl, wl, y, false, true, tsys__rows(x), weight->shape[0], weight->shape[1]);
        if (tsys__gemm(ctx, &g) != TSYS_OK) { tsys_tensor_release(y); y = NULL; }
    }
    if (y && bias) {
        tsys_kargs a = tsys__kargs0();
        a.t[0] = y; a.t[1] = bias;
        if (tsys__kernel(ctx, y->device, TSYS_K_ADD_BIAS, &a) != TSYS_OK) { tsys_tensor_release(y); y = NULL; }
    }
    // Slots: the low-precision x (its cast node routes to x), the fp32 weight itself (dW lands in fp32).
    tsys_tensor *slots[3] = {xl, weight->grad_fn ? wl : weight, bias};
    tsys_tensor *saved[TSYS__SAVED_LINEAR_COUNT];
    saved[TSYS__SAVED_LINEAR_X] = xl; saved[TSYS__SAVED_LINEAR_W] = wl;
    tsys__record(ctx, TSYS__OP_LINEAR, y, slots, 3, saved, TSYS__SAVED_LINEAR_COUNT);
    tsys_tensor_release(xl); tsys_tensor_release(wl);
    ctx->trace_weight = weight;
    tsys__op_end(ctx, TSYS__OP_LINEAR, tag);
    ctx->trace_weight = NULL;
    return y;
}

// >>linear groups: tsys_linears ---------------------------------------------------------------------
// n linears of one input whose weights lie a constant stride apart run as one strided-batched GEMM each
// way (forward, dX, dW): what n separate products of a small model's shapes leave of the GPU idle (a
// 1024 x 768 output fills a third of an H200's SMs). Measured with dev/qkv_lab.cu (H200, 1024 rows, bf16,
// us a block): small q, k, v 46 -> 30, w1, w3 59 -> 50; xl q, k, v 98 -> 80, w1, w3 209 -> 190; 2.7B
// q, k, v 224 -> 196; 2.7B's w1, w3 (10.5 M outputs each) ran slower batched: products past
// TSYS_LINEARS_GROUP_MAX outputs stay apart.

// The stride, in blocks of w[0]'s size, at which w[0 .. n) (n >= 2, one dtype) lie in one storage (1: back to
// back); 0 when they do not.
static int64_t tsys__linears_stride(tsys_tensor *const *w, int n) {
    size_t bytes = tsys_tensor_bytes(w[0]);
    if (bytes == 0 || w[1]->storage != w[0]->storage || w[1]->offset <= w[0]->offset || (w[1]->offset - w[0]->offset) % bytes) return 0;
    size_t step = w[1]->offset - w[0]->offset;
    for (int i = 1; i < n; i++)
        if (w[i]->storage != w[0]->storage || w[i]->dtype != w[0]->dtype || w[i]->offset != w[0]->offset + (size_t)i * step) return 0;
    return (int64_t)(step / bytes);
}

// A view of w[0 .. n) (one 2-D shape) as blocks of w[0]'s size, spanning what lies between them, with their
// stride in *stride; NULL when they are not a constant stride apart.
static tsys_tensor *tsys__linears_stack(tsys_ctx *ctx, tsys_tensor *const *w, int n, int64_t *stride) {
    for (int i = 1; i < n; i++)
        if (w[i]->ndim != 2 || w[i]->shape[0] != w[0]->shape[0] || w[i]->shape[1] != w[0]->shape[1]) return NULL;
    if (n < 2 || !(*stride = tsys__linears_stride(w, n))) return NULL;
    int64_t shape[3] = {(n - 1) * *stride + 1, w[0]->shape[0], w[0]->shape[1]};
    if (w[0]->offset + (size_t)shape[0] * tsys_tensor_bytes(w[0]) > w[0]->storage->bytes) return NULL;
    return tsys_tensor_view_raw(ctx, w[0], 0, w[0]->dtype, 3, shape);
}

// Whether tsys_linears can batch: no recompute or checkpointed region (whose nodes rerun one by one), x already
// in the compute dtype (a cast of x for each linear is torch's: their gradients then add in x's dtype),
// weights of one storage at a constant stride, small products.
static bool tsys__linears_batchable(tsys_ctx *ctx, const tsys_tensor *x, tsys_tensor *const *w, int n) {
    if (n < 2 || ctx->replay || ctx->open_region >= 0 || x->ndim < 1 || x->dtype != tsys__matmul_dtype(ctx, x, w[0])) return false;
    return tsys__rows(x) * w[0]->shape[0] <= TSYS_LINEARS_GROUP_MAX && tsys__linears_stride(w, n) > 0;
}

static tsys_status tsys__linears_fail(tsys_ctx *ctx, tsys_tensor **out, int n) {
    for (int i = 0; i < n; i++) { tsys_tensor_release(out[i]); out[i] = NULL; }
    return ctx->status != TSYS_OK ? ctx->status : TSYS_ERR_INVALID_ARGS;
}

TSYSDEF tsys_status tsys_linears(tsys_ctx *ctx, tsys_tensor *x, int n, tsys_tensor *const *weights, tsys_tensor **out) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    TSYS__CHECK_ARG(ctx, out && weights, TSYS_ERR_INVALID_ARGS, "linears: weights and out must be given");
    TSYS__CHECK_ARG(ctx, n >= 1 && n <= TSYS_LINEARS_MAX, TSYS_ERR_INVALID_ARGS, "linears: n is %d, must be 1 to %d (TSYS_LINEARS_MAX)", n, TSYS_LINEARS_MAX);
    for (int i = 0; i < n; i++) out[i] = NULL;
    for (int i = 0; i < n; i++) {
        TSYS__CHECK_ARG(ctx, weights[i], TSYS_ERR_INVALID_ARGS, "linears: weights[%d] is NULL", i);
        TSYS__CHECK_ARG(ctx, weights[i]->ndim == 2 && weights[0]->ndim == 2 && weights[i]->shape[0] == weights[0]->shape[0] &&
                                 weights[i]->shape[1] == weights[0]->shape[1], TSYS_ERR_INVALID_ARGS,
                        "linears: weights[%d] '%s' must have the shape of weights[0] '%s' (2-D, %lld x %lld)", i, weights[i]->name, weights[0]->name,
                        (long long)weights[0]->shape[0], (long long)(weights[0]->ndim > 1 ? weights[0]->shape[1] : -1));
    }
    if (!x || !tsys__linears_batchable(ctx, x, weights, n) || ctx->status != TSYS_OK) {
        for (int i = 0; i < n; i++)
            if (!(out[i] = tsys_linear(ctx, x, weights[i], NULL))) return tsys__linears_fail(ctx, out, n);
        return TSYS_OK;
    }
    tsys_tensor *ins0[2] = {x, weights[0]};
    if (!tsys__check_inputs(ctx, "linears", ins0, 2) || !tsys__check_float(ctx, "linears", x) || !tsys__check_float(ctx, "linears", weights[0]))
        return tsys__linears_fail(ctx, out, n);
    TSYS__CHECK_ARG(ctx, tsys__last_dim(x) == weights[0]->shape[1], TSYS_ERR_INVALID_ARGS, "linears: input '%s' last dim %lld does not match the weights (%lld, %lld) [d_out, d_in]",
                    x->name, (long long)tsys__last_dim(x), (long long)weights[0]->shape[0], (long long)weights[0]->shape[1]);
    const int64_t rows = tsys__rows(x), d_out = weights[0]->shape[0], d_in = weights[0]->shape[1];
    const tsys_dtype dt = x->dtype;
    tsys_tensor *wl[TSYS_LINEARS_MAX] = {NULL}, *ys = NULL;
    tsys__lgroup *grp = NULL;
    bool batched = false, ok = true;
    for (int i = 0; ok && i < n; i++) {
        tsys_tensor *ins[3] = {x, weights[i], NULL};
        ctx->trace_weight = weights[i];
        int tag = tsys__op_begin(ctx, TSYS__OP_LINEAR, ins, 3);
        ctx->trace_weight = NULL;
        if (i == 0) {   // every weight's copy and the batched product, in the first linear's scope
            if (!tsys__autocast_weights(ctx, weights, n, dt, wl))   // side by side where autocast makes them now
                for (int j = 0; ok && j < n; j++) ok = (wl[j] = tsys__matmul_input(ctx, weights[j], dt, true)) != NULL;
            ok = ok && ctx->status == TSYS_OK;
            int64_t stride = 0, total = n * rows * d_out;
            tsys_tensor *ws = ok ? tsys__linears_stack(ctx, wl, n, &stride) : NULL;
            if (ws && (ys = tsys_tensor_new(ctx, dt, x->device, 1, &total))) {
                tsys_gemm_args g = tsys__gemm_args(x, ws, ys, false, true, rows, d_out, d_in);
                g.batch = n; g.stride_a = 0; g.stride_b = stride * d_out * d_in; g.stride_c = rows * d_out;
                g.as_items = true;   // the bits of separate linears (checkpointed regions run them so)
                batched = tsys__gemm(ctx, &g) == TSYS_OK;
                ok = batched;
            }
            tsys_tensor_release(ws);
            ok = ok && ctx->status == TSYS_OK;
        }
        int64_t shape[TSYS_MAX_DIMS];
        memcpy(shape, x->shape, sizeof(shape));
        shape[x->ndim - 1] = d_out;
        if (ok && batched) ok = (out[i] = tsys_tensor_view_raw(ctx, ys, (size_t)i * (size_t)(rows * d_out) * tsys_dtype_size(dt), dt, x->ndim, shape)) != NULL;
        else if (ok) {
            ok = (out[i] = tsys_tensor_new(ctx, dt, x->device, x->ndim, shape)) != NULL;
            tsys_gemm_args g = tsys__gemm_args(x, wl[i], out[i], false, true, rows, d_out, d_in);
            ok = ok && tsys__gemm(ctx, &g) == TSYS_OK;
        }
        if (ok) {   // slots and saved values as tsys_linear's
            tsys_tensor *slots[3] = {x, weights[i]->grad_fn ? wl[i] : weights[i], NULL};
            tsys_tensor *saved[TSYS__SAVED_LINEAR_COUNT];
            saved[TSYS__SAVED_LINEAR_X] = x; saved[TSYS__SAVED_LINEAR_W] = wl[i];
            tsys__node *node = tsys__record(ctx, TSYS__OP_LINEAR, out[i], slots, 3, saved, TSYS__SAVED_LINEAR_COUNT);
            if (node && batched && !grp && (grp = (tsys__lgroup *)TSYS_MALLOC(sizeof(*grp)))) {
                memset(grp, 0, sizeof(*grp));
                grp->n = n; grp->per = rows * d_out; grp->dtype = dt;
            }
            if (node && grp) { node->group = grp; node->group_at = i; grp->refs++; }
            ok = ctx->status == TSYS_OK;
        }
        ctx->trace_weight = weights[i];
        tsys__op_end(ctx, TSYS__OP_LINEAR, tag);
        ctx->trace_weight = NULL;
    }
    for (int j = 0; j < n; j++) tsys_tensor_release(wl[j]);
    tsys_tensor_release(ys);
    return ok ? TSYS_OK : tsys__linears_fail(ctx, out, n);
}

// Batch count of a (.., r, c) tensor: product of the leading dims.
static int64_t tsys__batch(const tsys_tensor *t) { return t->ndim > 2 ? tsys_tensor_numel(t) / (t->shape[t->ndim - 1] * t->shape[t->ndim - 2]) : 1; }

TSYSDEF tsys_tensor *tsys_matmul(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b, bool trans_b) {
    tsys_tensor *ins[2] = {a, b};
    if (!tsys__check_inputs(ctx, "matmul", ins, 2)) return NULL;
    if (!tsys__check_float(ctx, "matmul", a) || !tsys__check_float(ctx, "matmul", b)) return NULL;
    TSYS__REQUIRE(ctx, a->ndim >= 2 && b->ndim >= 2, "matmul: '%s' and '%s' must have at least 2 dims", a->name, b->name);
    int64_t m = a->shape[a->ndim - 2], k = a->shape[a->ndim - 1];
    int64_t kb = b->shape[b->ndim - (trans_b ? 1 : 2)], n = b->shape[b->ndim - (trans_b ? 2 : 1)];
    int64_t batch = tsys__batch(a), bb = tsys__batch(b);
    TSYS__REQUIRE(ctx, k == kb, "matmul: inner dims differ: '%s' has %lld, '%s' has %lld", a->name, (long long)k, b->name, (long long)kb);
    TSYS__REQUIRE(ctx, bb == batch || b->ndim == 2, "matmul: batch sizes differ: '%s' %lld vs '%s' %lld", a->name, (long long)batch, b->name, (long long)bb);
    int tag = tsys__op_begin(ctx, TSYS__OP_MATMUL, ins, 2);
    tsys_dtype dt = tsys__matmul_dtype(ctx, a, b);
    tsys_tensor *al = tsys__matmul_input(ctx, a, dt, false);
    tsys_tensor *bl = al ? tsys__matmul_input(ctx, b, dt, false) : NULL;
    tsys_tensor *y = NULL;
    if (bl) {
        int64_t shape[TSYS_MAX_DIMS];
        memcpy(shape, a->shape, sizeof(shape));
        shape[a->ndim - 1] = n;
        y = tsys_tensor_new(ctx, dt, a->device, a->ndim, shape);
    }
    if (y) {
        tsys_gemm_args g = tsys__gemm_args(al, bl, y, false, trans_b, m, n, k);
        g.batch = batch; g.stride_a = m * k; g.stride_b = b->ndim == 2 ? 0 : k * n; g.stride_c = m * n;
        if (tsys__gemm(ctx, &g) != TSYS_OK) { tsys_tensor_release(y); y = NULL; }
    }
    tsys_tensor *saved[TSYS__SAVED_MATMUL_COUNT];
    saved[TSYS__SAVED_MATMUL_A] = al; saved[TSYS__SAVED_MATMUL_B] = bl;
    tsys_tensor *slots[2] = {al, bl};
    tsys__node *node = tsys__record(ctx, TSYS__OP_MATMUL, y, slots, 2, saved, TSYS__SAVED_MATMUL_COUNT);
    if (node) node->i[0] = trans_b;
    tsys_tensor_release(al); tsys_tensor_release(bl);
    tsys__op_end(ctx, TSYS__OP_MATMUL, tag);
    return y;
}

// Elementwise op of two same-shape inputs with dtype promotion.
static tsys_tensor *tsys__binary(tsys_ctx *ctx, tsys__op op, tsys_kernel k, tsys_tensor *a, tsys_tensor *b, bool save) {
    tsys_tensor *ins[2] = {a, b};
    const char *name = tsys__op_names[op];
    if (!tsys__check_inputs(ctx, name, ins, 2)) return NULL;
    if (!tsys__check_float(ctx, name, a) || !tsys__check_float(ctx, name, b) || !tsys__check_same_shape(ctx, name, a, b)) return NULL;
    int tag = tsys__op_begin(ctx, op, ins, 2);
    tsys_kargs args = tsys__kargs0();
    args.t[0] = tsys__new_like(ctx, a, tsys__promote(a->dtype, b->dtype));
    args.t[1] = a; args.t[2] = b;
    tsys_tensor *y = args.t[0] ? tsys__run(ctx, k, &args) : NULL;
    tsys__record(ctx, op, y, ins, 2, ins, save ? 2 : 0);
    tsys__op_end(ctx, op, tag);
    return y;
}
TSYSDEF tsys_tensor *tsys_add(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b) { return tsys__binary(ctx, TSYS__OP_ADD, TSYS_K_ADD, a, b, false); }
TSYSDEF tsys_tensor *tsys_mul(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b) { return tsys__binary(ctx, TSYS__OP_MUL, TSYS_K_MUL, a, b, true); }
TSYSDEF tsys_tensor *tsys_swiglu(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b) { return tsys__binary(ctx, TSYS__OP_SWIGLU, TSYS_K_SWIGLU_FWD, a, b, true); }

// Elementwise op of one input; the output keeps the input's dtype.
static tsys_tensor *tsys__unary(tsys_ctx *ctx, tsys__op op, tsys_kernel k, tsys_tensor *x, float f0, bool save) {
    if (!tsys__check_inputs(ctx, tsys__op_names[op], &x, 1) || !tsys__check_float(ctx, tsys__op_names[op], x)) return NULL;
    int tag = tsys__op_begin(ctx, op, &x, 1);
    tsys_kargs a = tsys__kargs0();
    a.t[0] = tsys__new_like(ctx, x, x->dtype);
    a.t[1] = x; a.f[0] = f0;
    tsys_tensor *y = a.t[0] ? tsys__run(ctx, k, &a) : NULL;
    tsys__node *node = tsys__record(ctx, op, y, &x, 1, &x, save ? 1 : 0);
    if (node) node->f[0] = f0;
    tsys__op_end(ctx, op, tag);
    return y;
}
TSYSDEF tsys_tensor *tsys_scale(tsys_ctx *ctx, tsys_tensor *a, float s) { return tsys__unary(ctx, TSYS__OP_SCALE, TSYS_K_SCALE, a, s, false); }
TSYSDEF tsys_tensor *tsys_relu(tsys_ctx *ctx, tsys_tensor *x) { return tsys__unary(ctx, TSYS__OP_RELU, TSYS_K_RELU_FWD, x, 0, true); }
TSYSDEF tsys_tensor *tsys_silu(tsys_ctx *ctx, tsys_tensor *x) { return tsys__unary(ctx, TSYS__OP_SILU, TSYS_K_SILU_FWD, x, 0, true); }

static tsys_tensor *tsys__row_stats(tsys_ctx *ctx, const tsys_tensor *x) {
    int64_t rows = tsys__rows(x);
    return tsys_tensor_new(ctx, TSYS_F32, x->device, 1, &rows);
}

// RMSNorm whose output is written in out_dt: x's dtype (tsys_rmsnorm), or, for an fp32 x under
// autocast, the compute dtype of the matmuls it feeds. The fp32 value is rounded once, as autocast's
// cast of it would be, so each matmul reads the bits it would have cast for itself; and the output's
// gradient accumulates in fp32, as the casts' gradients would have summed into the fp32 norm output.
// What that saves: the fp32 output, and one cast per reader (q, k, v; w1, w3) in forward and backward.
// The norm's node: y = rmsnorm(x) with its saved x, weight and row stats (eps for a recompute).
static void tsys__record_rmsnorm(tsys_ctx *ctx, tsys_tensor *y, tsys_tensor *x, tsys_tensor *weight, tsys_tensor *rstd, float eps) {
    tsys_tensor *ins[2] = {x, weight}, *saved[TSYS__SAVED_RMSNORM_COUNT];
    saved[TSYS__SAVED_RMSNORM_X] = x; saved[TSYS__SAVED_RMSNORM_W] = weight; saved[TSYS__SAVED_RMSNORM_RSTD] = rstd;
    tsys__node *node = tsys__record(ctx, TSYS__OP_RMSNORM, y, ins, 2, saved, TSYS__SAVED_RMSNORM_COUNT);
    if (node) { node->f[0] = eps; node->grad_dtype = x->dtype; }
}

static tsys_tensor *tsys__rmsnorm_to(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *weight, float eps, tsys_dtype out_dt) {
    tsys_tensor *ins[2] = {x, weight};
    if (!tsys__check_inputs(ctx, "rmsnorm", ins, 2) || !tsys__check_float(ctx, "rmsnorm", x)) return NULL;
    TSYS__REQUIRE(ctx, weight->ndim == 1 && weight->shape[0] == tsys__last_dim(x), "rmsnorm: weight '%s' must be (%lld) to match '%s'", weight->name, (long long)tsys__last_dim(x), x->name);
    TSYS__REQUIRE(ctx, out_dt == x->dtype || (x->dtype == TSYS_F32 && (out_dt == TSYS_BF16 || out_dt == TSYS_F16)), "rmsnorm: output %s from %s input '%s' (a low-precision output needs fp32 x)",
                  tsys_dtype_name(out_dt), tsys_dtype_name(x->dtype), x->name);
    int tag = tsys__op_begin(ctx, TSYS__OP_RMSNORM, ins, 2);
    tsys_kargs a = tsys__kargs0();
    a.t[0] = tsys__new_like(ctx, x, out_dt);   // cs336: computed in fp32, cast back to the input dtype
    a.t[1] = a.t[0] ? tsys__row_stats(ctx, x) : NULL;
    a.t[2] = x; a.t[3] = weight; a.f[0] = eps;
    tsys_tensor *y = NULL;
    if (a.t[1] && tsys__kernel(ctx, x->device, TSYS_K_RMSNORM_FWD, &a) == TSYS_OK) y = a.t[0];
    else tsys_tensor_release(a.t[0]);
    tsys__record_rmsnorm(ctx, y, x, weight, a.t[1], eps);
    tsys_tensor_release(a.t[1]);
    tsys__op_end(ctx, TSYS__OP_RMSNORM, tag);
    return y;
}
TSYSDEF tsys_tensor *tsys_rmsnorm(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *weight, float eps) { return tsys__rmsnorm_to(ctx, x, weight, eps, x ? x->dtype : TSYS_F32); }

// s = x + r and y = tsys__rmsnorm_to(s) in one pass over each row (the add that closes a pre-norm
// residual step and the norm that opens the next: s is read once instead of written and read back).
// Recorded as the two ops it is, an add node and a norm node, so backward and a checkpoint's
// recompute (which reruns them apart) see nothing new; the kernel computes both as they would, to
// the bit. *sum: the new residual stream s. x fp32, r any float dtype of x's shape.
static tsys_tensor *tsys__add_rmsnorm(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *r, tsys_tensor *weight, float eps, tsys_dtype out_dt, tsys_tensor **sum) {
    *sum = NULL;
    tsys_tensor *ins[3] = {x, r, weight};
    if (!tsys__check_inputs(ctx, "add_rmsnorm", ins, 3) || !tsys__check_float(ctx, "add_rmsnorm", r) || !tsys__check_same_shape(ctx, "add_rmsnorm", x, r)) return NULL;
    TSYS__REQUIRE(ctx, x->dtype == TSYS_F32, "add_rmsnorm: the residual stream '%s' must be fp32, is %s", x->name, tsys_dtype_name(x->dtype));
    TSYS__REQUIRE(ctx, weight->ndim == 1 && weight->shape[0] == tsys__last_dim(x), "rmsnorm: weight '%s' must be (%lld) to match '%s'", weight->name, (long long)tsys__last_dim(x), x->name);
    // the add runs inside the norm's kernel; it is still an op to the hooks (a call of its own, around the
    // norm's, with the new residual stream under its tag), as it is a node on the tape
    int add_tag = tsys__op_begin(ctx, TSYS__OP_ADD, ins, 2);
    tsys_kargs a = tsys__kargs0();
    a.t[5] = tsys__new_like(ctx, x, TSYS_F32);
    tsys_tensor *norm_ins[2] = {a.t[5], weight};   // the norm reads the sum
    int tag = tsys__op_begin(ctx, TSYS__OP_RMSNORM, norm_ins, 2);
    a.t[0] = a.t[5] ? tsys__new_like(ctx, x, out_dt) : NULL;
    a.t[1] = a.t[0] ? tsys__row_stats(ctx, x) : NULL;
    a.t[2] = x; a.t[3] = weight; a.t[4] = r; a.f[0] = eps;
    tsys_tensor *s = NULL, *y = NULL;
    if (a.t[1] && tsys__kernel(ctx, x->device, TSYS_K_RMSNORM_FWD, &a) == TSYS_OK) { s = a.t[5]; y = a.t[0]; }
    else { tsys_tensor_release(a.t[5]); tsys_tensor_release(a.t[0]); }
    tsys_tensor *add_ins[2] = {x, r};
    tsys__record(ctx, TSYS__OP_ADD, s, add_ins, 2, add_ins, 0);   // the add first: backward reaches it after the norm
    if (s) tsys__record_rmsnorm(ctx, y, s, weight, a.t[1], eps);
    tsys_tensor_release(a.t[1]);
    tsys__op_end(ctx, TSYS__OP_RMSNORM, tag);
    tsys__op_end(ctx, TSYS__OP_ADD, add_tag);
    *sum = s;
    return y;
}

TSYSDEF tsys_tensor *tsys_layernorm(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *weight, tsys_tensor *bias, float eps) {
    tsys_tensor *ins[3] = {x, weight, bias}, *given[3] = {x, weight, bias};   // weight and bias may be NULL
    int ngiven = 1;
    if (weight) given[ngiven++] = weight;
    if (bias) given[ngiven++] = bias;
    if (!tsys__check_inputs(ctx, "layernorm", given, ngiven) || !tsys__check_float(ctx, "layernorm", x)) return NULL;
    int64_t d = tsys__last_dim(x);
    TSYS__REQUIRE(ctx, !weight || (weight->ndim == 1 && weight->shape[0] == d), "layernorm: weight '%s' must be (%lld)", weight ? weight->name : "", (long long)d);
    TSYS__REQUIRE(ctx, !bias || (bias->ndim == 1 && bias->shape[0] == d), "layernorm: bias '%s' must be (%lld)", bias ? bias->name : "", (long long)d);
    int tag = tsys__op_begin(ctx, TSYS__OP_LAYERNORM, ins, 3);
    // autocast runs layer norm in fp32 and returns fp32 (torch's rule); outside it the input dtype
    tsys_dtype out_dt = ctx->autocast != TSYS_F32 ? TSYS_F32 : x->dtype;
    tsys_kargs a = tsys__kargs0();
    a.t[0] = tsys__new_like(ctx, x, out_dt);
    a.t[1] = tsys__row_stats(ctx, x);
    a.t[2] = tsys__row_stats(ctx, x);
    a.t[3] = x; a.t[4] = weight; a.t[5] = bias; a.f[0] = eps;
    tsys_tensor *y = NULL;
    if (a.t[0] && a.t[1] && a.t[2] && tsys__kernel(ctx, x->device, TSYS_K_LAYERNORM_FWD, &a) == TSYS_OK) y = a.t[0];
    else tsys_tensor_release(a.t[0]);
    tsys_tensor *saved[TSYS__SAVED_LAYERNORM_COUNT];
    saved[TSYS__SAVED_LAYERNORM_X] = x; saved[TSYS__SAVED_LAYERNORM_W] = weight; saved[TSYS__SAVED_LAYERNORM_B] = bias;
    saved[TSYS__SAVED_LAYERNORM_MEAN] = a.t[1]; saved[TSYS__SAVED_LAYERNORM_RSTD] = a.t[2];
    tsys__node *node = tsys__record(ctx, TSYS__OP_LAYERNORM, y, ins, 3, saved, TSYS__SAVED_LAYERNORM_COUNT);
    if (node) node->f[0] = eps;   // for a recompute
    tsys_tensor_release(a.t[1]); tsys_tensor_release(a.t[2]);
    tsys__op_end(ctx, TSYS__OP_LAYERNORM, tag);
    return y;
}

// heads: x is a projection split into heads (B, T, H, D) and y comes out (B, H, T, D): the transpose
// to attention's layout in the same pass (one read, one write instead of two each).
static tsys_tensor *tsys__rope(tsys_ctx *ctx, tsys_tensor *x, float theta, bool heads) {
    if (!tsys__check_inputs(ctx, heads ? "rope_heads" : "rope", &x, 1)) return NULL;
    TSYS__REQUIRE(ctx, x->ndim >= 2 && tsys__last_dim(x) % 2 == 0, "rope: '%s' needs (.., T, D) with D even (RoPE rotates pairs), got D = %lld", x->name, (long long)tsys__last_dim(x));
    TSYS__REQUIRE(ctx, !heads || x->ndim == 4, "rope_heads: '%s' needs (B, T, H, D), has %d dims", x->name, x->ndim);
    if (!tsys__check_float(ctx, "rope", x)) return NULL;
    int tag = tsys__op_begin(ctx, TSYS__OP_ROPE, &x, 1);
    tsys_kargs a = tsys__kargs0();
    int64_t shape[TSYS_MAX_DIMS];
    memcpy(shape, x->shape, sizeof(shape));
    if (heads) { shape[1] = x->shape[2]; shape[2] = x->shape[1]; }
    a.t[0] = tsys_tensor_new(ctx, x->dtype, x->device, x->ndim, shape);
    a.t[1] = x; a.f[0] = theta; a.f[1] = 1.0f; a.i[0] = heads ? 1 : 0;
    tsys_tensor *y = a.t[0] ? tsys__run(ctx, TSYS_K_ROPE, &a) : NULL;
    tsys__node *node = tsys__record(ctx, TSYS__OP_ROPE, y, &x, 1, NULL, 0);
    if (node) { node->f[0] = theta; node->i[0] = heads; }
    tsys__op_end(ctx, TSYS__OP_ROPE, tag);
    return y;
}
TSYSDEF tsys_tensor *tsys_rope(tsys_ctx *ctx, tsys_tensor *x, float theta) { return tsys__rope(ctx, x, theta, false); }
TSYSDEF tsys_tensor *tsys_rope_heads(tsys_ctx *ctx, tsys_tensor *x, float theta) { return tsys__rope(ctx, x, theta, true); }

TSYSDEF tsys_tensor *tsys_softmax(tsys_ctx *ctx, tsys_tensor *x, float scale, bool causal) {
    if (!tsys__check_inputs(ctx, "softmax", &x, 1) || !tsys__check_float(ctx, "softmax", x)) return NULL;
    TSYS__REQUIRE(ctx, !causal || (x->ndim >= 2 && x->shape[x->ndim - 1] == x->shape[x->ndim - 2]), "softmax: causal needs square (.., T, T) scores, '%s' is not", x->name);
    int tag = tsys__op_begin(ctx, TSYS__OP_SOFTMAX, &x, 1);
    tsys_kargs a = tsys__kargs0();
    a.t[0] = tsys__new_like(ctx, x, x->dtype);
    a.t[1] = x; a.f[0] = scale; a.i[0] = causal;
    tsys_tensor *y = a.t[0] ? tsys__run(ctx, TSYS_K_SOFTMAX_FWD, &a) : NULL;
    tsys__node *node = tsys__record(ctx, TSYS__OP_SOFTMAX, y, &x, 1, &y, 1);
    if (node) { node->f[0] = scale; node->i[0] = causal; }
    tsys__op_end(ctx, TSYS__OP_SOFTMAX, tag);
    return y;
}

TSYSDEF tsys_tensor *tsys_transpose12(tsys_ctx *ctx, tsys_tensor *x) {
    if (!tsys__check_inputs(ctx, "transpose12", &x, 1)) return NULL;
    TSYS__REQUIRE(ctx, x->ndim == 4, "transpose12: '%s' must be 4-D, has %d dims", x->name, x->ndim);
    int tag = tsys__op_begin(ctx, TSYS__OP_TRANSPOSE12, &x, 1);
    int64_t shape[4] = {x->shape[0], x->shape[2], x->shape[1], x->shape[3]};
    tsys_kargs a = tsys__kargs0();
    a.t[0] = tsys_tensor_new(ctx, x->dtype, x->device, 4, shape);
    a.t[1] = x;
    tsys_tensor *y = a.t[0] ? tsys__run(ctx, TSYS_K_TRANSPOSE12, &a) : NULL;
    tsys__record(ctx, TSYS__OP_TRANSPOSE12, y, &x, 1, NULL, 0);
    tsys__op_end(ctx, TSYS__OP_TRANSPOSE12, tag);
    return y;
}

TSYSDEF tsys_tensor *tsys_attention_naive(tsys_ctx *ctx, tsys_tensor *q, tsys_tensor *k, tsys_tensor *v, bool causal) {
    tsys_tensor *ins[3] = {q, k, v};
    if (!tsys__check_inputs(ctx, "attention_naive", ins, 3)) return NULL;
    float scale = 1.0f / sqrtf((float)tsys__last_dim(q));
    tsys__region_begin(ctx, "computing attention scores");
    tsys_tensor *s = tsys_matmul(ctx, q, k, true);
    tsys__region_end(ctx, "computing attention scores");
    tsys__region_begin(ctx, "computing softmax");
    tsys_tensor *p = tsys_softmax(ctx, s, scale, causal);
    tsys__region_end(ctx, "computing softmax");
    tsys_tensor_release(s);
    tsys__region_begin(ctx, "final matmul");
    tsys_tensor *o = tsys_matmul(ctx, p, v, false);
    tsys__region_end(ctx, "final matmul");
    tsys_tensor_release(p);
    return o;
}

TSYSDEF tsys_tensor *tsys_flash_attention(tsys_ctx *ctx, tsys_tensor *q, tsys_tensor *k, tsys_tensor *v, bool causal, tsys_tensor **lse_out) {
    tsys_tensor *ins[3] = {q, k, v};
    if (lse_out) *lse_out = NULL;
    if (!tsys__check_inputs(ctx, "flash_attention", ins, 3)) return NULL;
    int64_t d = tsys__last_dim(q);
    TSYS__REQUIRE(ctx, q->ndim >= 2 && k->ndim == q->ndim && v->ndim == q->ndim, "flash_attention: q, k, v must be (.., N, d) with the same number of dims");
    TSYS__REQUIRE(ctx, tsys__last_dim(k) == d && tsys__last_dim(v) == d && tsys_tensor_same_shape(k, v), "flash_attention: k '%s' and v '%s' must match q's head dim %lld", k->name, v->name, (long long)d);
    TSYS__REQUIRE(ctx, tsys_tensor_numel(q) / (q->shape[q->ndim - 2] * d) == tsys_tensor_numel(k) / (k->shape[k->ndim - 2] * d), "flash_attention: q and k have different batch*heads");
    int tag = tsys__op_begin(ctx, TSYS__OP_FLASH_ATTN, ins, 3);
    tsys_dtype dt = ctx->autocast != TSYS_F32 ? ctx->autocast : q->dtype;
    tsys_tensor *ql = tsys__matmul_input(ctx, q, dt, false), *kl = tsys__matmul_input(ctx, k, dt, false), *vl = tsys__matmul_input(ctx, v, dt, false);
    tsys_kargs a = tsys__kargs0();
    tsys_tensor *o = NULL, *lse = NULL;
    if (ql && kl && vl) {
        o = tsys__new_like(ctx, ql, dt);
        int64_t bh = tsys_tensor_numel(q) / (q->shape[q->ndim - 2] * d), lshape[2] = {bh, q->shape[q->ndim - 2]};
        lse = o ? tsys_tensor_new(ctx, TSYS_F32, q->device, 2, lshape) : NULL;
    }
    if (lse) {
        a.t[0] = o; a.t[1] = lse; a.t[2] = ql; a.t[3] = kl; a.t[4] = vl; a.i[0] = causal; a.f[0] = 1.0f / sqrtf((float)d);
        if (tsys__kernel(ctx, q->device, TSYS_K_FLASH_FWD, &a) != TSYS_OK) { tsys_tensor_release(o); tsys_tensor_release(lse); o = lse = NULL; }
    } else {
        tsys_tensor_release(o);
        o = NULL;
    }
    tsys_tensor *slots[3] = {ql, kl, vl};
    tsys_tensor *saved[TSYS__SAVED_FLASH_COUNT];
    saved[TSYS__SAVED_FLASH_Q] = ql; saved[TSYS__SAVED_FLASH_K] = kl; saved[TSYS__SAVED_FLASH_V] = vl;
    saved[TSYS__SAVED_FLASH_O] = o; saved[TSYS__SAVED_FLASH_LSE] = lse;
    tsys__node *node = o ? tsys__record(ctx, TSYS__OP_FLASH_ATTN, o, slots, 3, saved, TSYS__SAVED_FLASH_COUNT) : NULL;
    if (node) { node->i[0] = causal; node->f[0] = a.f[0]; }
    tsys_tensor_release(ql); tsys_tensor_release(kl); tsys_tensor_release(vl);
    if (lse_out) *lse_out = lse; else tsys_tensor_release(lse);
    tsys__op_end(ctx, TSYS__OP_FLASH_ATTN, tag);
    return o;
}

static tsys_tensor *tsys__scalar(tsys_ctx *ctx, tsys_device dev) {
    int64_t one = 1;
    return tsys_tensor_new(ctx, TSYS_F32, dev, 1, &one);
}

TSYSDEF tsys_tensor *tsys_cross_entropy(tsys_ctx *ctx, tsys_tensor *logits, tsys_tensor *targets) {
    tsys_tensor *ins[2] = {logits, targets};
    if (!tsys__check_inputs(ctx, "cross_entropy", ins, 2) || !tsys__check_float(ctx, "cross_entropy", logits)) return NULL;
    TSYS__REQUIRE(ctx, targets->dtype == TSYS_I32 || targets->dtype == TSYS_I64, "cross_entropy: targets '%s' must be i32 or i64", targets->name);
    TSYS__REQUIRE(ctx, tsys_tensor_numel(targets) == tsys__rows(logits), "cross_entropy: %lld targets for %lld rows of logits", (long long)tsys_tensor_numel(targets), (long long)tsys__rows(logits));
    int tag = tsys__op_begin(ctx, TSYS__OP_CROSS_ENTROPY, ins, 2);
    tsys_kargs a = tsys__kargs0();
    a.t[0] = tsys__scalar(ctx, logits->device);
    a.t[1] = tsys__row_stats(ctx, logits);
    a.t[2] = logits; a.t[3] = targets;
    tsys_tensor *loss = NULL;
    if (a.t[0] && a.t[1] && tsys__kernel(ctx, logits->device, TSYS_K_CE_FWD, &a) == TSYS_OK) loss = a.t[0];
    else tsys_tensor_release(a.t[0]);
    tsys_tensor *saved[TSYS__SAVED_CE_COUNT];
    saved[TSYS__SAVED_CE_LOGITS] = logits; saved[TSYS__SAVED_CE_TARGETS] = targets; saved[TSYS__SAVED_CE_LSE] = a.t[1];
    tsys__record(ctx, TSYS__OP_CROSS_ENTROPY, loss, ins, 2, saved, TSYS__SAVED_CE_COUNT);
    tsys_tensor_release(a.t[1]);
    if (loss) tsys_tensor_set_name(loss, "loss");
    tsys__op_end(ctx, TSYS__OP_CROSS_ENTROPY, tag);
    return loss;
}

// ---- linear + cross-entropy, a chunk of rows at a time ----
// Liger-Kernel's idea: with the loss as the graph's end, d loss / d logits is known in forward, so the
// logits never need to outlive their chunk. Each chunk runs the kernels linear + cross_entropy would run on
// it: the logits GEMM in the compute dtype, CE_FWD, CE_BWD in place (g = 1, 1 / rows), d x = dlogits w in
// x's compute dtype, d w += dlogits^T x in fp32.

// The rows of a chunk: the caller's chunk_rows (> 0), else a power of two, at least 2048 (each chunk reads and
// writes d w in fp32, 8 V d bytes for its 2 rows V d FLOPs: at 2048 rows that traffic hides under the GEMM on a
// GPU) and at least about as many logits as x has elements (rows d / V); never more than rows.
static int64_t tsys__lce_rows(int64_t chunk_rows, int64_t rows, int64_t V, int64_t d) {
    int64_t c = chunk_rows;
    if (c <= 0) {
        const int64_t want = (rows * d + V - 1) / V;
        for (c = 2048; c < want && c < rows;) c *= 2;
    }
    return c < rows ? c : rows;
}
TSYSDEF int64_t tsys_model_fused_loss_chunk(const tsys_model_desc *desc, int64_t rows) {
    const tsys_model_desc d = tsys_model_desc_defaults(desc);
    return tsys__lce_rows(d.fused_loss_chunk, rows, d.vocab_size, d.d_model);
}

// One chunk [r0, r0 + rc): the loss's share into *loss; its rows of d x (dx given) and its share of d w (dw given:
// written by the first chunk, added to by the others).
static tsys_status tsys__lce_chunk_run(tsys_ctx *ctx, tsys_tensor *xl, tsys_tensor *wl, tsys_tensor *targets, int64_t r0, int64_t rc,
                                       int64_t rows, tsys_tensor *loss, tsys_tensor *one, tsys_tensor *dx, tsys_tensor *dw) {
    const int64_t V = wl->shape[0], d = wl->shape[1];
    const int64_t xs[2] = {rc, d}, ts[1] = {rc}, ls[2] = {rc, V};
    tsys_tensor *xc = tsys_tensor_view_raw(ctx, xl, (size_t)(r0 * d) * tsys_dtype_size(xl->dtype), xl->dtype, 2, xs);
    tsys_tensor *tc = tsys_tensor_view_raw(ctx, targets, (size_t)r0 * tsys_dtype_size(targets->dtype), targets->dtype, 1, ts);
    tsys_tensor *logits = tsys_tensor_new(ctx, xl->dtype, xl->device, 2, ls), *lse = logits ? tsys__row_stats(ctx, logits) : NULL;
    tsys_tensor *part = tsys__scalar(ctx, xl->device);
    tsys_status st = xc && tc && logits && lse && part ? TSYS_OK : ctx->status ? ctx->status : TSYS_ERR_OOM;
    if (st == TSYS_OK) { tsys_gemm_args g = tsys__gemm_args(xc, wl, logits, false, true, rc, V, d); st = tsys__gemm(ctx, &g); }
    tsys_kargs a = tsys__kargs0();
    a.t[0] = part; a.t[1] = lse; a.t[2] = logits; a.t[3] = tc;
    if (st == TSYS_OK) st = tsys__kernel(ctx, xl->device, TSYS_K_CE_FWD, &a);
    a = tsys__kargs0();
    a.t[0] = loss; a.t[1] = part; a.f[0] = (float)((double)rc / (double)rows);   // the chunk's mean, weighted by its rows
    if (st == TSYS_OK) st = tsys__kernel(ctx, xl->device, TSYS_K_ACCUM, &a);
    if (st == TSYS_OK && (dx || dw)) {
        a = tsys__kargs0();
        a.t[0] = logits; a.t[1] = logits; a.t[2] = lse; a.t[3] = tc; a.t[4] = one; a.f[0] = 1.0f / (float)rows;
        st = tsys__kernel(ctx, xl->device, TSYS_K_CE_BWD, &a);   // in place: the logits' gradient
        if (st == TSYS_OK && dx) {   // this chunk's rows of d x
            tsys_tensor *dxc = tsys_tensor_view_raw(ctx, dx, (size_t)(r0 * d) * tsys_dtype_size(dx->dtype), dx->dtype, 2, xs);
            tsys_gemm_args g = tsys__gemm_args(logits, wl, dxc, false, false, rc, d, V);
            st = dxc ? tsys__gemm(ctx, &g) : ctx->status;
            tsys_tensor_release(dxc);
        }
        if (st == TSYS_OK && dw) {
            tsys_gemm_args g = tsys__gemm_args(logits, xc, dw, true, false, V, d, rc);
            g.beta = r0 > 0 ? 1.0f : 0.0f;
            st = tsys__gemm(ctx, &g);
        }
    }
    tsys_tensor *tmp[5] = {xc, tc, logits, lse, part};
    for (int i = 0; i < 5; i++) tsys_tensor_release(tmp[i]);
    return st;
}

TSYSDEF tsys_tensor *tsys_linear_cross_entropy(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *w, tsys_tensor *targets, int64_t chunk_rows) {
    tsys_tensor *ins[3] = {x, w, targets};
    const char *op = "linear_cross_entropy";
    if (!tsys__check_inputs(ctx, op, ins, 3) || !tsys__check_float(ctx, op, x) || !tsys__check_float(ctx, op, w)) return NULL;
    TSYS__REQUIRE(ctx, w->ndim == 2 && x->ndim >= 1 && tsys__last_dim(x) == w->shape[1], "%s: input '%s' last dim %lld does not match weight '%s' (%lld, %lld) [V, d]",
                  op, x->name, (long long)tsys__last_dim(x), w->name, (long long)w->shape[0], (long long)(w->ndim > 1 ? w->shape[1] : -1));
    TSYS__REQUIRE(ctx, targets->dtype == TSYS_I32 || targets->dtype == TSYS_I64, "%s: targets '%s' must be i32 or i64", op, targets->name);
    TSYS__REQUIRE(ctx, tsys_tensor_numel(targets) == tsys__rows(x), "%s: %lld targets for %lld rows of '%s'", op, (long long)tsys_tensor_numel(targets), (long long)tsys__rows(x), x->name);
    TSYS__REQUIRE(ctx, chunk_rows >= 0, "%s: chunk_rows %lld must be >= 0 (0: chosen from the shapes)", op, (long long)chunk_rows);
    TSYS__REQUIRE(ctx, ctx->open_region < 0, "%s: not inside a checkpoint region (it keeps gradients, not inputs, for backward)", op);
    const int64_t rows = tsys__rows(x), V = w->shape[0], d = w->shape[1];
    TSYS__REQUIRE(ctx, rows > 0, "%s: '%s' has no rows", op, x->name);
    const int64_t chunk = tsys__lce_rows(chunk_rows, rows, V, d);
    ctx->trace_weight = w;
    int tag = tsys__op_begin(ctx, TSYS__OP_LINEAR_CE, ins, 3);
    ctx->trace_weight = NULL;
    const tsys_dtype dt = tsys__matmul_dtype(ctx, x, w);
    tsys_tensor *xl = tsys__matmul_input(ctx, x, dt, false), *wl = xl ? tsys__matmul_input(ctx, w, dt, true) : NULL;
    const bool grads = tsys__recording(ctx, ins, 2);   // then each gradient its input needs
    const int64_t xs[2] = {rows, d};
    tsys_tensor *x2 = wl ? tsys_tensor_view_raw(ctx, xl, 0, xl->dtype, 2, xs) : NULL;   // (rows, d)
    tsys_tensor *loss = x2 ? tsys__scalar(ctx, x->device) : NULL, *one = loss ? tsys__scalar(ctx, x->device) : NULL;
    const bool want_dx = grads && x->requires_grad, want_dw = grads && w->requires_grad;
    tsys_tensor *dx = want_dx && one ? tsys__new_like(ctx, xl, xl->dtype) : NULL, *dw = want_dw && one ? tsys__new_like(ctx, w, TSYS_F32) : NULL;
    tsys_status st = one && (dx || !want_dx) && (dw || !want_dw) ? TSYS_OK : ctx->status ? ctx->status : TSYS_ERR_OOM;
    tsys_kargs a = tsys__kargs0();
    a.t[0] = loss; a.f[0] = 0.0f;
    if (st == TSYS_OK) st = tsys__kernel(ctx, x->device, TSYS_K_FILL, &a);
    a.t[0] = one; a.f[0] = 1.0f;
    if (st == TSYS_OK) st = tsys__kernel(ctx, x->device, TSYS_K_FILL, &a);
    for (int64_t r0 = 0; st == TSYS_OK && r0 < rows; r0 += chunk)
        st = tsys__lce_chunk_run(ctx, x2, wl, targets, r0, rows - r0 < chunk ? rows - r0 : chunk, rows, loss, one, dx, dw);
    if (st != TSYS_OK) { tsys_tensor_release(loss); loss = NULL; }
    // Slots as linear's: the compute-dtype x (its cast node routes to x), the fp32 weight itself.
    tsys_tensor *slots[3] = {xl, w->grad_fn ? wl : w, targets}, *saved[TSYS__SAVED_LCE_COUNT] = {dx, dw};
    if (loss) tsys__record(ctx, TSYS__OP_LINEAR_CE, loss, slots, 3, saved, TSYS__SAVED_LCE_COUNT);
    tsys_tensor *tmp[6] = {xl, wl, x2, one, dx, dw};
    for (int i = 0; i < 6; i++) tsys_tensor_release(tmp[i]);
    if (loss) tsys_tensor_set_name(loss, "loss");
    ctx->trace_weight = w;
    tsys__op_end(ctx, TSYS__OP_LINEAR_CE, tag);
    ctx->trace_weight = NULL;
    return loss;
}

// Backward: the gradients made in forward times the loss's gradient (in place: the node's own tensors).
static tsys_status tsys__bwd_linear_ce(tsys_ctx *ctx, tsys__node *n) {
    tsys_status st = TSYS_OK;
    for (int j = 0; st == TSYS_OK && j < 2; j++) {
        tsys_tensor *t = n->saved[j == 0 ? TSYS__SAVED_LCE_DX : TSYS__SAVED_LCE_DW];
        if (!n->in[j].needs || !t) continue;
        tsys_kargs a = tsys__kargs0();
        a.t[0] = t; a.t[1] = t; a.t[2] = n->gout;
        st = tsys__kernel(ctx, t->device, TSYS_K_SCALE_BY, &a);
        if (st == TSYS_OK) st = tsys__grad_add(ctx, &n->in[j], tsys_tensor_retain(t));
    }
    return st;
}

TSYSDEF tsys_tensor *tsys_mse(tsys_ctx *ctx, tsys_tensor *a, tsys_tensor *b) {
    tsys_tensor *ins[2] = {a, b};
    if (!tsys__check_inputs(ctx, "mse", ins, 2) || !tsys__check_same_shape(ctx, "mse", a, b)) return NULL;
    int tag = tsys__op_begin(ctx, TSYS__OP_MSE, ins, 2);
    tsys_kargs k = tsys__kargs0();
    k.t[0] = tsys__scalar(ctx, a->device);
    k.t[1] = a; k.t[2] = b;
    tsys_tensor *y = k.t[0] ? tsys__run(ctx, TSYS_K_MSE_FWD, &k) : NULL;
    tsys__record(ctx, TSYS__OP_MSE, y, ins, 2, ins, 2);
    tsys__op_end(ctx, TSYS__OP_MSE, tag);
    return y;
}

static tsys_tensor *tsys__sum_scaled(tsys_ctx *ctx, tsys_tensor *x, bool mean) {
    if (!tsys__check_inputs(ctx, mean ? "mean" : "sum", &x, 1) || !tsys__check_float(ctx, mean ? "mean" : "sum", x)) return NULL;
    int tag = tsys__op_begin(ctx, TSYS__OP_SUM, &x, 1);
    float s = mean ? 1.0f / (float)tsys_tensor_numel(x) : 1.0f;
    tsys_kargs a = tsys__kargs0();
    a.t[0] = tsys__scalar(ctx, x->device);
    a.t[1] = x; a.f[0] = s;
    tsys_tensor *y = a.t[0] ? tsys__run(ctx, TSYS_K_SUM, &a) : NULL;
    tsys__node *node = tsys__record(ctx, TSYS__OP_SUM, y, &x, 1, NULL, 0);
    if (node) { node->f[0] = s; node->i[0] = mean; }
    tsys__op_end(ctx, TSYS__OP_SUM, tag);
    return y;
}
TSYSDEF tsys_tensor *tsys_sum(tsys_ctx *ctx, tsys_tensor *x) { return tsys__sum_scaled(ctx, x, false); }
TSYSDEF tsys_tensor *tsys_mean(tsys_ctx *ctx, tsys_tensor *x) { return tsys__sum_scaled(ctx, x, true); }

// ---- custom ops ----
TSYSDEF tsys_tensor *tsys_custom(tsys_ctx *ctx, const tsys_custom_op *op, tsys_tensor *const *ins, int n) {
    if (!ctx) return NULL;
    const char *name = op && op->name ? op->name : "custom op";
    TSYS__REQUIRE(ctx, op && op->forward && op->backward, "%s: forward and backward must both be given", name);
    TSYS__REQUIRE(ctx, ins && n >= 1 && n <= TSYS__NODE_IN, "%s: %d inputs, it takes 1 to %d", name, n, TSYS__NODE_IN);
    if (!tsys__check_inputs(ctx, name, ins, n)) return NULL;
    // forward's own ops are not recorded, also while this node is recomputed (their records would land on it)
    tsys__node *replay = ctx->replay;
    const bool keep = ctx->replay_keep, done = ctx->replay_done;
    ctx->replay = NULL;
    tsys_no_grad_begin(ctx);
    tsys_tensor *extra = NULL, *y = op->forward(ctx, ins, n, &extra, op->user);
    tsys_no_grad_end(ctx);
    ctx->replay = replay; ctx->replay_keep = keep; ctx->replay_done = done;
    for (int j = 0; y && j < n; j++)
        if (y == ins[j]) { tsys_tensor_release(y); y = NULL; TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: forward returned its input %d: it must make a new tensor (a view is fine)", name, j); }
    if (!y) {
        tsys_tensor_release(extra);
        if (ctx->status == TSYS_OK) TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: forward made no output", name);
        return NULL;
    }
    tsys_tensor *saved[TSYS__NODE_SAVED];
    int64_t slot_of[TSYS__NODE_SAVED];
    int ns = 0;
    for (int j = 0; j < n; j++)
        if (op->saves >> j & 1u) { saved[ns] = ins[j]; slot_of[ns++] = j; }
    if (extra) { saved[ns] = extra; slot_of[ns++] = -1; }
    tsys__node *node = tsys__record(ctx, TSYS__OP_CUSTOM, y, ins, n, saved, ns);
    if (node) {
        node->custom = op;
        for (int k = 0; k < ns && k < 4; k++) node->i[k] = slot_of[k];
    }
    tsys_tensor_release(extra);   // the node holds it
    return y;
}

static int tsys__saved_input(const tsys__node *n, int k);
static tsys_status tsys__custom_backward(tsys_ctx *ctx, tsys__node *n, tsys_tensor *g) {
    const tsys_custom_op *op = n->custom;
    tsys_tensor *ins[TSYS__NODE_IN] = {NULL}, *extra = NULL, *grads[TSYS__NODE_IN] = {NULL};
    bool needs[TSYS__NODE_IN] = {false};
    for (int k = 0; k < n->n_saved; k++) {
        int j = tsys__saved_input(n, k);
        if (j >= 0) ins[j] = n->saved[k]; else extra = n->saved[k];
    }
    for (int j = 0; j < n->n_in; j++) needs[j] = n->in[j].needs;
    tsys_no_grad_begin(ctx);   // the ops backward calls are not recorded either
    tsys_status st = op->backward(ctx, g, ins, n->n_in, extra, needs, grads, op->user);
    tsys_no_grad_end(ctx);
    if (st == TSYS_OK && ctx->status != TSYS_OK) st = ctx->status;
    for (int j = 0; j < n->n_in; j++) {
        if (st != TSYS_OK || !needs[j]) { tsys_tensor_release(grads[j]); continue; }
        int64_t want = 1;
        for (int d = 0; d < n->in[j].ndim; d++) want *= n->in[j].shape[d];
        if (!grads[j]) st = TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: backward gave no gradient for input %d", op->name ? op->name : "custom op", j);
        else if (tsys_tensor_numel(grads[j]) != want || !tsys_dtype_is_float(grads[j]->dtype)) {
            st = TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: backward's gradient for input %d has %lld %s elements, the input %lld", op->name ? op->name : "custom op", j,
                            (long long)tsys_tensor_numel(grads[j]), tsys_dtype_name(grads[j]->dtype), (long long)want);
            tsys_tensor_release(grads[j]);
        } else st = tsys__grad_add(ctx, &n->in[j], grads[j]);   // takes the reference
    }
    return st;
}

TSYSDEF float tsys_item(tsys_ctx *ctx, const tsys_tensor *scalar) {
    float v = NAN;
    if (!ctx || !scalar) return v;
    if (tsys_tensor_numel(scalar) != 1) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "item: '%s' is not a one-element tensor", scalar->name); return v; }
    if (tsys_tensor_to_f32(ctx, scalar, &v) != TSYS_OK) return NAN;
    return v;
}

// >>backward --------------------------------------------------------------------------------------
// One case per op: read node->gout (the output's gradient) and the saved values, hand each input
// that wants one its gradient through tsys__grad_add.

// A new tensor for slot s's gradient; where s leads (through views) to a member of a linear group that has
// no gradient yet, that member's part of the group's home, so that the members' gradients arrive back to
// back for the group's batched products (tsys__bwd_linears).
static tsys_tensor *tsys__slot_tensor(tsys_ctx *ctx, const tsys__slot *s, tsys_device dev) {
    tsys__node *n = s->node;
    while (n && n->op == TSYS__OP_VIEW && !n->gout) n = n->in[0].node;
    tsys__lgroup *g = n && n->op == TSYS__OP_LINEAR && !n->gout ? n->group : NULL;
    int64_t numel = 1;
    for (int d = 0; d < s->ndim; d++) numel *= s->shape[d];
    if (!g || (g->taken >> n->group_at & 1u) || s->dtype != g->dtype || n->grad_dtype != g->dtype || numel != g->per ||
        (g->home && g->home->device != dev))
        return tsys_tensor_new(ctx, s->dtype, dev, s->ndim, s->shape);
    int64_t total = g->n * g->per;
    if (!g->home && !(g->home = tsys_tensor_new(ctx, g->dtype, dev, 1, &total))) return NULL;
    g->taken |= 1u << n->group_at;
    return tsys_tensor_view_raw(ctx, g->home, (size_t)n->group_at * (size_t)g->per * tsys_dtype_size(g->dtype), s->dtype, s->ndim, s->shape);
}

// Gradient for slot j from kernel k run with g as t[1] and extra inputs in t[2..].
static tsys_status tsys__bwd_unary(tsys_ctx *ctx, tsys__node *n, int j, tsys_kernel k, tsys_kargs *a) {
    if (!n->in[j].needs) return TSYS_OK;
    a->t[0] = tsys__slot_tensor(ctx, &n->in[j], n->gout->device);
    if (!a->t[0]) return ctx->status;
    if (tsys__kernel(ctx, n->gout->device, k, a) != TSYS_OK) { tsys_tensor_release(a->t[0]); return ctx->status; }
    return tsys__grad_add(ctx, &n->in[j], a->t[0]);
}

// Gradient for slot j as g itself (retyped to the input's dtype when they differ).
static tsys_status tsys__bwd_pass(tsys_ctx *ctx, tsys__node *n, int j, tsys_tensor *g) {
    if (!n->in[j].needs) return TSYS_OK;
    tsys_tensor *gi = g->dtype == n->in[j].dtype ? tsys_tensor_retain(g) : tsys__cast_raw(ctx, g, n->in[j].dtype);
    return tsys__grad_add(ctx, &n->in[j], gi);
}

// Gradient destination for a weight-like slot: the leaf's own grad when it has dtype `want` (accumulate
// in place; a low-precision one only for a caller that stores), or a fresh zeroed tensor handed over
// afterwards (rounded into a low-precision gradient then). *fresh tells which.
// With `overwrite` non-NULL the caller can store instead of add: *overwrite tells it to.
static tsys_tensor *tsys__grad_dest(tsys_ctx *ctx, tsys__node *n, int j, tsys_dtype want, bool *fresh, bool *overwrite) {
    tsys__slot *s = &n->in[j];
    if (overwrite) *overwrite = false;
    if (s->leaf && tsys_tensor_grad_dtype(s->leaf) == want && (s->leaf->grad_lowp == TSYS_F32 || overwrite)) {
        *fresh = false;
        return overwrite ? tsys__leaf_grad_for_write(ctx, s->leaf, overwrite) : tsys__leaf_grad(ctx, s->leaf);
    }
    *fresh = true;
    tsys_tensor *t = tsys_tensor_new(ctx, want, n->gout->device, s->ndim, s->shape);
    if (t && tsys_tensor_fill(ctx, t, 0.0f) != TSYS_OK) { tsys_tensor_release(t); return NULL; }
    return t;
}
static tsys_status tsys__grad_dest_done(tsys_ctx *ctx, tsys__node *n, int j, tsys_tensor *t, bool fresh, tsys_status st) {
    if (!fresh) return st;
    if (st != TSYS_OK) { tsys_tensor_release(t); return st; }
    return tsys__grad_add(ctx, &n->in[j], t);
}

static bool tsys__linear_update_fused(tsys_ctx *ctx, tsys__node *n, tsys_tensor *gy, tsys_tensor *x, tsys_status *st);   // >>optimizer
static tsys_status tsys__bwd_linear(tsys_ctx *ctx, tsys__node *n) {
    tsys_tensor *g = n->gout, *x = n->saved[TSYS__SAVED_LINEAR_X], *w = n->saved[TSYS__SAVED_LINEAR_W];
    int64_t rows = tsys__rows(x), d_out = w->shape[0], d_in = w->shape[1];
    tsys_status st = TSYS_OK;
    tsys_tensor *gl = g->dtype == x->dtype ? tsys_tensor_retain(g) : tsys__cast_raw(ctx, g, x->dtype);
    if (!gl) return ctx->status;
    if (n->in[0].needs) {   // dx = g W
        tsys_tensor *dx = tsys__new_like(ctx, x, x->dtype);
        tsys_gemm_args ga = tsys__gemm_args(gl, w, dx, false, false, rows, d_in, d_out);
        st = dx ? tsys__gemm(ctx, &ga) : ctx->status;
        if (st == TSYS_OK) st = tsys__grad_add(ctx, &n->in[0], dx);
        else tsys_tensor_release(dx);
    }
    if (st == TSYS_OK && n->in[1].needs && !tsys__linear_update_fused(ctx, n, gl, x, &st)) {   // dW += g^T x, accumulated in fp32 when W is the fp32 leaf
        bool fresh, overwrite;   // a low-precision gradient of x's dtype: the GEMM writes it (torch's autocast rounding)
        const tsys_tensor *leaf = n->in[1].leaf;
        tsys_dtype want = leaf && leaf->grad_lowp == x->dtype ? x->dtype : n->in[1].dtype;
        tsys_tensor *dw = tsys__grad_dest(ctx, n, 1, want, &fresh, &overwrite);
        tsys_gemm_args ga = tsys__gemm_args(gl, x, dw, true, false, d_out, d_in, rows);
        ga.beta = overwrite ? 0.0f : 1.0f;
        st = dw ? tsys__gemm(ctx, &ga) : ctx->status;
        st = tsys__grad_dest_done(ctx, n, 1, dw, fresh, st);
    }
    if (st == TSYS_OK && n->in[2].needs) {
        bool fresh;
        tsys_tensor *db = tsys__grad_dest(ctx, n, 2, TSYS_F32, &fresh, NULL);
        tsys_kargs a = tsys__kargs0();
        a.t[0] = db; a.t[1] = gl;
        st = db ? tsys__kernel(ctx, g->device, TSYS_K_BIAS_GRAD, &a) : ctx->status;
        st = tsys__grad_dest_done(ctx, n, 2, db, fresh, st);
    }
    tsys_tensor_release(gl);
    return st;
}

// Whether tape[i], the last member of a linear group, can run the group's backward: the members lie at
// tape[i - n + 1 .. i], read one x (of their gradients' dtype: no cast) and hold their gradients, unwidened,
// in their parts of the group's home. Otherwise each runs its own backward (as it would alone).
static bool tsys__linears_ready(const tsys_ctx *ctx, size_t i) {
    const tsys__node *last = ctx->tape[i];
    const tsys__lgroup *g = last->group;
    if (!g || last->group_at != g->n - 1 || i + 1 < (size_t)g->n || !g->home) return false;
    const tsys_tensor *x = last->saved[TSYS__SAVED_LINEAR_X];
    size_t es = tsys_dtype_size(g->dtype);
    for (int j = 0; j < g->n; j++) {
        const tsys__node *m = ctx->tape[i + 1 - (size_t)g->n + (size_t)j];
        const tsys_tensor *go = m->gout;
        if (m->group != g || m->group_at != j || m->region >= 0 || !go || !x || m->saved[TSYS__SAVED_LINEAR_X] != x || !m->saved[TSYS__SAVED_LINEAR_W] ||
            x->dtype != g->dtype || go->dtype != g->dtype || go->storage != g->home->storage ||
            go->offset != g->home->offset + (size_t)j * (size_t)g->per * es || tsys_tensor_numel(go) != g->per ||
            m->in[0].needs != last->in[0].needs || m->in[1].needs != last->in[1].needs || m->in[2].needs)
            return false;
    }
    return true;
}

// The group's dW: one batched product into the members' gradients where they lie back to back and take
// the same store-or-add, else one product each.
static tsys_status tsys__bwd_linears_dw(tsys_ctx *ctx, tsys__node **all, int n_all, tsys_tensor *home, tsys_tensor *x) {
    tsys__node *m[TSYS_LINEARS_MAX];
    int n = 0;
    tsys_status st = TSYS_OK;
    for (int j = 0; j < n_all && st == TSYS_OK; j++)   // members whose weights are updated in their products first
        if (!tsys__linear_update_fused(ctx, all[j], all[j]->gout, x, &st)) m[n++] = all[j];
    if (st != TSYS_OK || n == 0) return st;
    tsys_tensor *dw[TSYS_LINEARS_MAX] = {NULL};
    bool fresh[TSYS_LINEARS_MAX] = {false}, ow[TSYS_LINEARS_MAX] = {false}, stack = n == n_all;
    const tsys_tensor *w = m[0]->saved[TSYS__SAVED_LINEAR_W];
    int64_t rows = tsys__rows(x), d_out = w->shape[0], d_in = w->shape[1];
    for (int j = 0; j < n && st == TSYS_OK; j++) {   // a low-precision gradient of x's dtype: the GEMM writes it (as tsys__bwd_linear)
        const tsys_tensor *leaf = m[j]->in[1].leaf;
        tsys_dtype want = leaf && leaf->grad_lowp == x->dtype ? x->dtype : m[j]->in[1].dtype;
        dw[j] = tsys__grad_dest(ctx, m[j], 1, want, &fresh[j], &ow[j]);
        if (!dw[j]) st = ctx->status ? ctx->status : TSYS_ERR_OOM;
        stack = stack && dw[j] && !fresh[j] && ow[j] == ow[0];
    }
    int64_t stride = 0;
    tsys_tensor *ds = st == TSYS_OK && stack ? tsys__linears_stack(ctx, dw, n, &stride) : NULL;
    if (ds && stride == 1) {   // one block: no gradient of another weight lies in between
        tsys_gemm_args ga = tsys__gemm_args(home, x, ds, true, false, d_out, d_in, rows);
        ga.batch = n; ga.stride_a = rows * d_out; ga.stride_b = 0; ga.stride_c = d_out * d_in; ga.as_items = true;
        ga.beta = ow[0] ? 0.0f : 1.0f;
        st = tsys__gemm(ctx, &ga);
    } else {
        for (int j = 0; j < n && st == TSYS_OK; j++) {
            tsys_gemm_args ga = tsys__gemm_args(m[j]->gout, x, dw[j], true, false, d_out, d_in, rows);
            ga.beta = ow[j] ? 0.0f : 1.0f;
            st = tsys__gemm(ctx, &ga);
        }
    }
    tsys_tensor_release(ds);
    for (int j = 0; j < n; j++)
        if (dw[j]) st = tsys__grad_dest_done(ctx, m[j], 1, dw[j], fresh[j], st);
    return st;
}

// The backward of a group of linears (tsys__linears_ready), reached at its last member: dX as one batched
// product handed to x in the order the members would have (last first), then dW; the kernels run in the
// last member's scope and the others' scopes follow, empty, so that hooks counting linears see them all.
static tsys_status tsys__bwd_linears(tsys_ctx *ctx, size_t i) {
    tsys__node *last = ctx->tape[i], *m[TSYS_LINEARS_MAX];
    tsys__lgroup *g = last->group;
    const int n = g->n;
    for (int j = 0; j < n; j++) m[j] = ctx->tape[i + 1 - (size_t)n + (size_t)j];
    tsys_tensor *x = last->saved[TSYS__SAVED_LINEAR_X], *w[TSYS_LINEARS_MAX];
    for (int j = 0; j < n; j++) w[j] = m[j]->saved[TSYS__SAVED_LINEAR_W];
    const int64_t rows = tsys__rows(x), d_out = w[0]->shape[0], d_in = w[0]->shape[1];
    tsys_status st = TSYS_OK;
    for (int j = n - 1; j >= 0; j--) {
        tsys_tensor *weight = m[j]->in[1].leaf ? m[j]->in[1].leaf : w[j];
        ctx->trace_weight = weight;
        int tag = tsys__scope_begin(ctx, tsys__op_names[TSYS__OP_LINEAR], ctx->op_tags[TSYS__OP_LINEAR], TSYS_TRACE_BACKWARD, NULL, m[j]->in, m[j]->n_in);
        ctx->trace_weight = NULL;
        if (j == n - 1 && last->in[0].needs) {
            int64_t stride = 0, total = n * rows * d_in;
            tsys_tensor *ws = tsys__linears_stack(ctx, w, n, &stride), *dx = ws ? tsys_tensor_new(ctx, x->dtype, x->device, 1, &total) : NULL;
            if (dx) {
                tsys_gemm_args ga = tsys__gemm_args(g->home, ws, dx, false, false, rows, d_in, d_out);
                ga.batch = n; ga.stride_a = rows * d_out; ga.stride_b = stride * d_out * d_in; ga.stride_c = rows * d_in; ga.as_items = true;
                st = tsys__gemm(ctx, &ga);
            } else {
                st = ctx->status != TSYS_OK ? ctx->status : TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: linear group of '%s': its weight copies moved", weight->name);
            }
            for (int k = n - 1; k >= 0 && st == TSYS_OK; k--) {
                tsys_tensor *part = tsys_tensor_view_raw(ctx, dx, (size_t)k * (size_t)(rows * d_in) * tsys_dtype_size(x->dtype), x->dtype, x->ndim, x->shape);
                st = part ? tsys__grad_add(ctx, &m[k]->in[0], part) : ctx->status;
            }
            tsys_tensor_release(dx);
            tsys_tensor_release(ws);
        }
        if (j == n - 1 && st == TSYS_OK && last->in[1].needs) st = tsys__bwd_linears_dw(ctx, m, n, g->home, x);
        ctx->trace_weight = weight;
        tsys__scope_end(ctx, tsys__op_names[TSYS__OP_LINEAR], TSYS_TRACE_BACKWARD, tag);
        ctx->trace_weight = NULL;
        m[j]->group_done = true;
    }
    tsys_tensor_release(g->home);   // the members' gradients keep it until they are freed
    g->home = NULL;
    return st;
}

static tsys_status tsys__bwd_matmul(tsys_ctx *ctx, tsys__node *n) {
    tsys_tensor *a = n->saved[TSYS__SAVED_MATMUL_A], *b = n->saved[TSYS__SAVED_MATMUL_B];
    bool tb = n->i[0] != 0, b_bcast = b->ndim == 2 && a->ndim > 2;
    int64_t m = a->shape[a->ndim - 2], k = a->shape[a->ndim - 1], nn = n->out_shape[n->out_ndim - 1], batch = tsys__batch(a);
    tsys_status st = TSYS_OK;
    tsys_tensor *g = n->gout->dtype == a->dtype ? tsys_tensor_retain(n->gout) : tsys__cast_raw(ctx, n->gout, a->dtype);
    if (!g) return ctx->status;
    if (n->in[0].needs) {   // da = g b^T (or g b when b was given transposed)
        tsys_tensor *da = tsys__new_like(ctx, a, a->dtype);
        tsys_gemm_args ga = tsys__gemm_args(g, b, da, false, !tb, m, k, nn);
        ga.batch = batch; ga.stride_a = m * nn; ga.stride_b = b_bcast ? 0 : k * nn; ga.stride_c = m * k;
        st = da ? tsys__gemm(ctx, &ga) : ctx->status;
        if (st == TSYS_OK) st = tsys__grad_add(ctx, &n->in[0], da);
        else tsys_tensor_release(da);
    }
    if (st == TSYS_OK && n->in[1].needs) {
        tsys_tensor *db = tsys__new_like(ctx, b, b->dtype);
        // a broadcast b sums over the batch: treat the batch as extra rows of one product
        int64_t rows = b_bcast ? m * batch : m, nb = b_bcast ? 1 : batch;
        tsys_gemm_args ga = tb ? tsys__gemm_args(g, a, db, true, false, nn, k, rows)     // db (n, k) = g^T a
                               : tsys__gemm_args(a, g, db, true, false, k, nn, rows);    // db (k, n) = a^T g
        ga.batch = nb;
        ga.stride_a = tb ? m * nn : m * k; ga.stride_b = tb ? m * k : m * nn; ga.stride_c = k * nn;
        st = db ? tsys__gemm(ctx, &ga) : ctx->status;
        if (st == TSYS_OK) st = tsys__grad_add(ctx, &n->in[1], db);
        else tsys_tensor_release(db);
    }
    tsys_tensor_release(g);
    return st;
}

// The gradient gathered so far for input j of n when n's backward may add into it in place (a
// producer's own buffer of dtype dt, shared with nobody): what tsys__grad_add would accumulate into,
// minus the temporary. The pre-norm residual stream: the norm's dx lands on the gradient the residual
// add passed down. NULL: make a fresh buffer and tsys__grad_add it.
static tsys_tensor *tsys__grad_sink(tsys__node *n, int j, tsys_dtype dt) {
    tsys__node *p = n->in[j].needs ? n->in[j].node : NULL;
    tsys_tensor *g = p ? p->gout : NULL;
    if (!g || g->dtype != dt || g->refcount > 1 || g->storage->refcount > 1) return NULL;
    return g;
}

static tsys_status tsys__bwd_norm(tsys_ctx *ctx, tsys__node *n, bool layer) {
    tsys_tensor *g = n->gout, *x = n->saved[TSYS__SAVED_RMSNORM_X], *w = n->saved[TSYS__SAVED_RMSNORM_W];
    tsys_kargs a = tsys__kargs0();
    bool fresh_w = false, fresh_b = false, store_w = false;   // store_w: RMSNorm's dw counts as zero, the kernel stores it (no fill)
    tsys_tensor *sink = layer ? NULL : tsys__grad_sink(n, 0, x->dtype);
    tsys_tensor *dx = sink ? tsys_tensor_retain(sink) : tsys__new_like(ctx, x, x->dtype);
    tsys_tensor *dw = (w && n->in[1].needs) ? tsys__grad_dest(ctx, n, 1, TSYS_F32, &fresh_w, layer ? NULL : &store_w) : NULL;
    tsys_tensor *db = (layer && n->in[2].needs) ? tsys__grad_dest(ctx, n, 2, TSYS_F32, &fresh_b, NULL) : NULL;
    // kernels always write dw/db: give them scratch when the input wants no gradient
    tsys_tensor *scratch_w = (w && !dw) ? tsys_tensor_new(ctx, TSYS_F32, x->device, 1, &w->shape[0]) : NULL;
    tsys_status st = dx ? TSYS_OK : ctx->status;
    if (scratch_w && layer) tsys_tensor_fill(ctx, scratch_w, 0.0f);
    if (scratch_w && !layer) store_w = true;
    if (layer) {
        tsys_tensor *bias = n->saved[TSYS__SAVED_LAYERNORM_B];
        tsys_tensor *scratch_b = (bias && !db) ? tsys_tensor_new(ctx, TSYS_F32, x->device, 1, &bias->shape[0]) : NULL;
        a.t[0] = dx; a.t[1] = dw ? dw : scratch_w; a.t[2] = db ? db : scratch_b; a.t[3] = g; a.t[4] = x; a.t[5] = w;
        a.t[6] = n->saved[TSYS__SAVED_LAYERNORM_MEAN]; a.t[7] = n->saved[TSYS__SAVED_LAYERNORM_RSTD];
        if (scratch_b) tsys_tensor_fill(ctx, scratch_b, 0.0f);
        if (st == TSYS_OK) st = tsys__kernel(ctx, x->device, TSYS_K_LAYERNORM_BWD, &a);
        tsys_tensor_release(scratch_b);
    } else {
        a.t[0] = dx; a.t[1] = dw ? dw : scratch_w; a.t[2] = g; a.t[3] = x; a.t[4] = w; a.t[5] = n->saved[TSYS__SAVED_RMSNORM_RSTD];
        a.i[0] = sink != NULL; a.i[1] = store_w;
        if (st == TSYS_OK) st = tsys__kernel(ctx, x->device, TSYS_K_RMSNORM_BWD, &a);
    }
    tsys_tensor_release(scratch_w);
    if (st == TSYS_OK && n->in[0].needs && !sink) st = tsys__grad_add(ctx, &n->in[0], dx);
    else tsys_tensor_release(dx);
    if (dw) st = tsys__grad_dest_done(ctx, n, 1, dw, fresh_w, st);
    if (db) st = tsys__grad_dest_done(ctx, n, 2, db, fresh_b, st);
    return st;
}

static tsys_status tsys__node_backward(tsys_ctx *ctx, tsys__node *n) {
    tsys_tensor *g = n->gout;
    tsys_kargs a = tsys__kargs0();
    // the weight of a linear (its leaf, else the saved one) or an embedding, for the hooks
    tsys_tensor *weight = n->op == TSYS__OP_LINEAR ? (n->in[1].leaf ? n->in[1].leaf : n->saved[TSYS__SAVED_LINEAR_W])
                        : n->op == TSYS__OP_LINEAR_CE ? n->in[1].leaf : n->op == TSYS__OP_EMBEDDING ? n->in[0].leaf : NULL;
    ctx->trace_weight = weight;
    int tag = tsys__scope_begin(ctx, tsys__op_names[n->op], ctx->op_tags[n->op], TSYS_TRACE_BACKWARD, NULL, n->in, n->n_in);   // the forward op's inputs
    ctx->trace_weight = NULL;
    tsys_status st = TSYS_OK;
    switch (n->op) {
    case TSYS__OP_CAST: case TSYS__OP_ADD: st = tsys__bwd_pass(ctx, n, 0, g); if (st == TSYS_OK && n->op == TSYS__OP_ADD) st = tsys__bwd_pass(ctx, n, 1, g); break;
    case TSYS__OP_VIEW: {
        if (!n->in[0].needs) break;
        tsys_tensor *v = tsys_tensor_view_raw(ctx, g, 0, g->dtype, n->in[0].ndim, n->in[0].shape);
        st = v ? tsys__grad_add(ctx, &n->in[0], v) : ctx->status;
        break;
    }
    case TSYS__OP_EMBEDDING: {
        if (!n->in[0].needs) break;
        bool fresh;
        tsys_tensor *dw = tsys__grad_dest(ctx, n, 0, TSYS_F32, &fresh, NULL);
        a.t[0] = dw; a.t[1] = g; a.t[2] = n->saved[TSYS__SAVED_EMBED_IDS];
        st = dw ? tsys__kernel(ctx, g->device, TSYS_K_EMBED_BWD, &a) : ctx->status;
        st = tsys__grad_dest_done(ctx, n, 0, dw, fresh, st);
        break;
    }
    case TSYS__OP_LINEAR: st = tsys__bwd_linear(ctx, n); break;
    case TSYS__OP_LINEAR_CE: st = tsys__bwd_linear_ce(ctx, n); break;
    case TSYS__OP_MATMUL: st = tsys__bwd_matmul(ctx, n); break;
    case TSYS__OP_MUL:
        a.t[1] = g; a.t[2] = n->saved[TSYS__SAVED_BINARY_B];
        st = tsys__bwd_unary(ctx, n, 0, TSYS_K_MUL, &a);
        a.t[2] = n->saved[TSYS__SAVED_BINARY_A];
        if (st == TSYS_OK) st = tsys__bwd_unary(ctx, n, 1, TSYS_K_MUL, &a);
        break;
    case TSYS__OP_SCALE: a.t[1] = g; a.f[0] = n->f[0]; st = tsys__bwd_unary(ctx, n, 0, TSYS_K_SCALE, &a); break;
    case TSYS__OP_RELU: a.t[1] = g; a.t[2] = n->saved[TSYS__SAVED_UNARY_X]; st = tsys__bwd_unary(ctx, n, 0, TSYS_K_RELU_BWD, &a); break;
    case TSYS__OP_SILU: a.t[1] = g; a.t[2] = n->saved[TSYS__SAVED_UNARY_X]; st = tsys__bwd_unary(ctx, n, 0, TSYS_K_SILU_BWD, &a); break;
    case TSYS__OP_SWIGLU: {
        tsys_tensor *da = tsys__slot_tensor(ctx, &n->in[0], g->device), *db = tsys__slot_tensor(ctx, &n->in[1], g->device);
        a.t[0] = da; a.t[1] = db; a.t[2] = g; a.t[3] = n->saved[TSYS__SAVED_BINARY_A]; a.t[4] = n->saved[TSYS__SAVED_BINARY_B];
        st = (da && db) ? tsys__kernel(ctx, g->device, TSYS_K_SWIGLU_BWD, &a) : ctx->status;
        if (st == TSYS_OK && n->in[0].needs) { st = tsys__grad_add(ctx, &n->in[0], da); da = NULL; }
        if (st == TSYS_OK && n->in[1].needs) { st = tsys__grad_add(ctx, &n->in[1], db); db = NULL; }
        tsys_tensor_release(da); tsys_tensor_release(db);
        break;
    }
    case TSYS__OP_RMSNORM: st = tsys__bwd_norm(ctx, n, false); break;
    case TSYS__OP_LAYERNORM: st = tsys__bwd_norm(ctx, n, true); break;
    case TSYS__OP_ROPE: a.t[1] = g; a.f[0] = n->f[0]; a.f[1] = -1.0f; a.i[0] = n->i[0] ? 2 : 0; st = tsys__bwd_unary(ctx, n, 0, TSYS_K_ROPE, &a); break;
    case TSYS__OP_SOFTMAX: a.t[1] = g; a.t[2] = n->saved[TSYS__SAVED_SOFTMAX_Y]; a.f[0] = n->f[0]; a.i[0] = n->i[0]; st = tsys__bwd_unary(ctx, n, 0, TSYS_K_SOFTMAX_BWD, &a); break;
    case TSYS__OP_TRANSPOSE12: a.t[1] = g; st = tsys__bwd_unary(ctx, n, 0, TSYS_K_TRANSPOSE12, &a); break;
    case TSYS__OP_CROSS_ENTROPY:
        a.t[1] = n->saved[TSYS__SAVED_CE_LOGITS]; a.t[2] = n->saved[TSYS__SAVED_CE_LSE]; a.t[3] = n->saved[TSYS__SAVED_CE_TARGETS]; a.t[4] = g;
        a.f[0] = 1.0f / (float)tsys__rows(n->saved[TSYS__SAVED_CE_LOGITS]);
        st = tsys__bwd_unary(ctx, n, 0, TSYS_K_CE_BWD, &a);
        break;
    case TSYS__OP_MSE: {
        tsys_tensor *da = n->in[0].needs ? tsys__slot_tensor(ctx, &n->in[0], g->device) : NULL;
        tsys_tensor *db = n->in[1].needs ? tsys__slot_tensor(ctx, &n->in[1], g->device) : NULL;
        a.t[0] = da; a.t[1] = db; a.t[2] = n->saved[TSYS__SAVED_BINARY_A]; a.t[3] = n->saved[TSYS__SAVED_BINARY_B]; a.t[4] = g;
        st = tsys__kernel(ctx, g->device, TSYS_K_MSE_BWD, &a);
        if (st == TSYS_OK && da) { st = tsys__grad_add(ctx, &n->in[0], da); da = NULL; }
        if (st == TSYS_OK && db) { st = tsys__grad_add(ctx, &n->in[1], db); db = NULL; }
        tsys_tensor_release(da); tsys_tensor_release(db);
        break;
    }
    case TSYS__OP_SUM: a.t[1] = g; a.f[0] = n->f[0]; st = tsys__bwd_unary(ctx, n, 0, TSYS_K_BROADCAST, &a); break;
    case TSYS__OP_FLASH_ATTN: {
        tsys_tensor *dq = tsys__slot_tensor(ctx, &n->in[0], g->device), *dk = tsys__slot_tensor(ctx, &n->in[1], g->device), *dv = tsys__slot_tensor(ctx, &n->in[2], g->device);
        a.t[0] = dq; a.t[1] = dk; a.t[2] = dv; a.t[3] = g;
        for (int j = TSYS__SAVED_FLASH_Q; j < TSYS__SAVED_FLASH_COUNT; j++) a.t[4 + j] = n->saved[j];   // Q K V O L, the kernel's order
        a.i[0] = n->i[0]; a.f[0] = n->f[0];
        st = (dq && dk && dv) ? tsys__kernel(ctx, g->device, TSYS_K_FLASH_BWD, &a) : ctx->status;
        tsys_tensor *d[3] = {dq, dk, dv};
        for (int j = 0; j < 3; j++) {
            if (st == TSYS_OK && n->in[j].needs) { st = tsys__grad_add(ctx, &n->in[j], d[j]); d[j] = NULL; }
            tsys_tensor_release(d[j]);
        }
        break;
    }
    case TSYS__OP_CUSTOM: st = tsys__custom_backward(ctx, n, g); break;
    case TSYS__OP_COUNT: st = TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "backward: bad op");
    }
    ctx->trace_weight = weight;
    tsys__scope_end(ctx, tsys__op_names[n->op], TSYS_TRACE_BACKWARD, tag);
    ctx->trace_weight = NULL;
    return st;
}

// >>checkpoint ------------------------------------------------------------------------------------
// Checkpointed regions (tsys_checkpoint_begin/end). Ops inside a region are recorded as usual: the
// gradient flow, the leaves' pending uses and so their gradient-ready hooks are what they would be
// without the region. But a node keeps no saved values; it keeps (retained, in inval) the inputs it
// takes from outside the outermost region it is in: parameters, which cost nothing, and the
// activations that are the region's inputs. When backward reaches a node whose region is still
// dormant, the outermost dormant region around it is recomputed from its first node up to that node:
// each node's op runs again through its public function, and the op's record call hands its saved
// values to the existing node (tsys__replay_record) instead of appending one. A recompute leaves the
// regions nested in it dormant: their nodes keep the inputs that cross into them, and are recomputed
// in turn when backward gets there (nested checkpointing).
// The recompute is lazy: a node's op runs only when a later recomputed node reads its output, or when
// its backward needs a value the op computes (norm statistics, softmax output, attention O and L,
// cross-entropy's logsumexp). A node that saves only inputs (linear, matmul, mul, swiglu, silu,
// relu, embedding, mse) gets them back without running, so a block's last GEMM is never redone.
// It runs the same kernels on the same values in the same order as the forward did, so gradients are
// bit for bit those of the run without regions. It synchronizes nothing with the host and allocates
// through the backend's allocator, so it can be captured in a CUDA graph with the rest of the step.
// The context RNG is set back to its state at tsys_checkpoint_begin for the recompute (no op draws
// from it today; a dropout would then draw the same mask).

TSYSDEF tsys_status tsys_checkpoint_begin(tsys_ctx *ctx) { return tsys_checkpoint_begin_ex(ctx, 0); }
TSYSDEF tsys_status tsys_checkpoint_begin_ex(tsys_ctx *ctx, unsigned flags) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (flags & ~(unsigned)(TSYS_CHECKPOINT_KEEP_WEIGHT_COPIES | TSYS_CHECKPOINT_KEEP_ATTENTION)) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "checkpoint_begin: unknown flags 0x%x", flags);
    if (ctx->in_backward) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "checkpoint_begin: called during backward (a region is part of a forward pass)");
    if (ctx->num_regions == ctx->cap_regions) {
        int cap = ctx->cap_regions ? ctx->cap_regions * 2 : 64;
        tsys__region *r = (tsys__region *)TSYS_REALLOC(ctx->regions, (size_t)cap * sizeof(*r));
        if (!r) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for a checkpointed region");
        ctx->regions = r; ctx->cap_regions = cap;
    }
    tsys__region *r = &ctx->regions[ctx->num_regions];
    r->first = ctx->tape_len; r->end = SIZE_MAX; r->parent = ctx->open_region; r->dormant = true; r->flags = flags;
    memcpy(r->rng, ctx->rng, sizeof(r->rng));
    ctx->open_region = ctx->num_regions++;
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_checkpoint_end(tsys_ctx *ctx) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (ctx->open_region < 0) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "checkpoint_end: no region is open (each tsys_checkpoint_end closes one tsys_checkpoint_begin)");
    tsys__region *r = &ctx->regions[ctx->open_region];
    r->end = ctx->tape_len;
    ctx->open_region = r->parent;
    return TSYS_OK;
}

TSYSDEF int tsys_checkpoint_depth(const tsys_ctx *ctx) {
    int d = 0;
    for (int r = ctx ? ctx->open_region : -1; r >= 0; r = ctx->regions[r].parent) d++;
    return d;
}

static bool tsys__node_in(const tsys_ctx *ctx, const tsys__node *p, int r) {
    return p && p->index >= ctx->regions[r].first && p->index < ctx->regions[r].end;
}
// The region right below r on the way up from region `inner` (inner lies inside r).
static int tsys__region_child(const tsys_ctx *ctx, int inner, int r) {
    while (ctx->regions[inner].parent != r) inner = ctx->regions[inner].parent;
    return inner;
}

// Input j of `node`, kept for a later recompute; the tracker counts it as a saved activation.
static void tsys__node_keep_input(tsys_ctx *ctx, tsys__node *node, int j, tsys_tensor *x) {
    node->inval[j] = tsys_tensor_retain(x);
    tsys__mem_saved(ctx, x->storage, +1);
}
static void tsys__node_drop_inputs(tsys_ctx *ctx, tsys__node *node) {
    for (int j = 0; j < TSYS__NODE_IN; j++) {
        if (!node->inval[j]) continue;
        tsys__mem_saved(ctx, node->inval[j]->storage, -1);
        tsys_tensor_release(node->inval[j]);
        node->inval[j] = NULL;
    }
}
static void tsys__node_keep_saved(tsys_ctx *ctx, tsys__node *node, int k, tsys_tensor *t) {
    node->saved[k] = tsys_tensor_retain(t);
    if (t) tsys__mem_saved(ctx, t->storage, +1);
}

// At record time, for a node inside a region: its producers, and the inputs that the outermost open
// region cannot recompute (made before it began, or by no recorded op); a linear's low-precision
// weight copy when that region keeps them (TSYS_CHECKPOINT_KEEP_WEIGHT_COPIES).
static void tsys__region_link(tsys_ctx *ctx, tsys__node *node, tsys_tensor *const *ins, tsys_tensor *const *saved) {
    int top = node->region;
    while (ctx->regions[top].parent >= 0) top = ctx->regions[top].parent;
    tsys_tensor *w = node->op == TSYS__OP_LINEAR ? saved[TSYS__SAVED_LINEAR_W] : NULL;
    if ((ctx->regions[top].flags & TSYS_CHECKPOINT_KEEP_WEIGHT_COPIES) && w && w != ins[1]) tsys__node_keep_saved(ctx, node, TSYS__SAVED_LINEAR_W, w);
    if ((ctx->regions[top].flags & TSYS_CHECKPOINT_KEEP_ATTENTION) && node->op == TSYS__OP_FLASH_ATTN) {
        tsys__node_keep_saved(ctx, node, TSYS__SAVED_FLASH_O, saved[TSYS__SAVED_FLASH_O]);
        tsys__node_keep_saved(ctx, node, TSYS__SAVED_FLASH_LSE, saved[TSYS__SAVED_FLASH_LSE]);
    }
    for (int j = 0; j < node->n_in; j++) {
        tsys_tensor *x = ins[j];
        if (!x) continue;
        node->in_mask |= 1u << j;
        node->src[j] = x->grad_fn;
        if (!(x->grad_fn && x->grad_fn->index >= ctx->regions[top].first)) tsys__node_keep_input(ctx, node, j, x);
    }
}

// The op of a node being recomputed calls tsys__record: the node takes the saved values (when its
// backward is next) and no node is appended. Ops the recomputed one calls inside record nothing.
static tsys__node *tsys__replay_record(tsys_ctx *ctx, tsys__op op, tsys_tensor *const *saved, int n_saved) {
    tsys__node *n = ctx->replay;
    if (ctx->replay_done || n->op != op) return NULL;
    TSYS_ASSERT(n_saved == n->n_saved);
    ctx->replay_done = true;
    for (int k = 0; ctx->replay_keep && k < n_saved; k++)
        if (!n->saved[k]) tsys__node_keep_saved(ctx, n, k, saved[k]);   // a kept weight copy is already there
    return n;
}

// Which input an op saves in saved[k], for ops whose saved values are all inputs; -1 otherwise.
static int tsys__saved_input(const tsys__node *n, int k) {
    switch (n->op) {
    case TSYS__OP_LINEAR: case TSYS__OP_MATMUL: case TSYS__OP_MUL: case TSYS__OP_SWIGLU: case TSYS__OP_MSE: return k;   // x/a = in 0, w/b = in 1
    case TSYS__OP_RELU: case TSYS__OP_SILU: return 0;
    case TSYS__OP_EMBEDDING: return 1;   // the ids
    case TSYS__OP_FLASH_ATTN: return k <= TSYS__SAVED_FLASH_V ? k : -1;   // q, k, v (O and LSE it computes)
    case TSYS__OP_CUSTOM: return k < 4 ? (int)n->i[k] : -1;               // the inputs it keeps, then its own value
    default: return -1;
    }
}
// The saved value that is the op's output (-1: none): what a node that kept it gives its readers.
static int tsys__saved_output(const tsys__node *n) { return n->op == TSYS__OP_FLASH_ATTN ? TSYS__SAVED_FLASH_O : -1; }
// Does the node hold every value its op computes for backward (TSYS_CHECKPOINT_KEEP_ATTENTION)? Then
// a recompute needs only its inputs, and readers of its output get the kept one.
static bool tsys__kept_computed(const tsys__node *n) {
    bool any = false;
    for (int k = 0; k < n->n_saved; k++) {
        if (tsys__saved_input(n, k) >= 0) continue;
        if (!n->saved[k]) return false;
        any = true;
    }
    return any;
}
static bool tsys__saves_inputs_only(const tsys__node *n) {
    for (int k = 0; k < n->n_saved; k++)
        if (tsys__saved_input(n, k) < 0) return false;
    return true;
}
static bool tsys__saves_input(const tsys__node *n, int j) {
    for (int k = 0; k < n->n_saved; k++)
        if (tsys__saved_input(n, k) == j) return true;
    return false;
}

// Runs node n's op again on the values v (its inputs); the op's record call lands on n. Returns the output.
static tsys_tensor *tsys__replay_op(tsys_ctx *ctx, tsys__node *n, tsys_tensor *const *v, bool keep) {
    tsys_dtype ac = ctx->autocast;
    ctx->replay = n; ctx->replay_keep = keep; ctx->replay_done = false;
    ctx->autocast = n->autocast;
    tsys_tensor *y = NULL;
    switch (n->op) {
    case TSYS__OP_CAST: y = tsys_cast(ctx, v[0], n->out_dtype); break;
    case TSYS__OP_EMBEDDING: y = tsys_embedding(ctx, v[0], v[1]); break;
    case TSYS__OP_LINEAR: y = tsys_linear(ctx, v[0], v[1], v[2]); break;
    case TSYS__OP_MATMUL: y = tsys_matmul(ctx, v[0], v[1], n->i[0] != 0); break;
    case TSYS__OP_ADD: y = tsys_add(ctx, v[0], v[1]); break;
    case TSYS__OP_MUL: y = tsys_mul(ctx, v[0], v[1]); break;
    case TSYS__OP_SCALE: y = tsys_scale(ctx, v[0], n->f[0]); break;
    case TSYS__OP_RELU: y = tsys_relu(ctx, v[0]); break;
    case TSYS__OP_SILU: y = tsys_silu(ctx, v[0]); break;
    case TSYS__OP_SWIGLU: y = tsys_swiglu(ctx, v[0], v[1]); break;
    case TSYS__OP_RMSNORM: y = tsys__rmsnorm_to(ctx, v[0], v[1], n->f[0], n->out_dtype); break;
    case TSYS__OP_LAYERNORM: y = tsys_layernorm(ctx, v[0], v[1], v[2], n->f[0]); break;
    case TSYS__OP_ROPE: y = tsys__rope(ctx, v[0], n->f[0], n->i[0] != 0); break;
    case TSYS__OP_SOFTMAX: y = tsys_softmax(ctx, v[0], n->f[0], n->i[0] != 0); break;
    case TSYS__OP_TRANSPOSE12: y = tsys_transpose12(ctx, v[0]); break;
    case TSYS__OP_VIEW: y = tsys_view(ctx, v[0], n->out_ndim, n->out_shape); break;
    case TSYS__OP_CROSS_ENTROPY: y = tsys_cross_entropy(ctx, v[0], v[1]); break;
    case TSYS__OP_MSE: y = tsys_mse(ctx, v[0], v[1]); break;
    case TSYS__OP_SUM: y = tsys__sum_scaled(ctx, v[0], n->i[0] != 0); break;
    case TSYS__OP_FLASH_ATTN: y = tsys_flash_attention(ctx, v[0], v[1], v[2], n->i[0] != 0, NULL); break;
    case TSYS__OP_CUSTOM: y = tsys_custom(ctx, n->custom, v, n->n_in); break;
    case TSYS__OP_LINEAR_CE: case TSYS__OP_COUNT: break;   // never inside a region: nothing to recompute
    }
    ctx->autocast = ac;
    ctx->replay = NULL;
    if (y && (!ctx->replay_done || y->dtype != n->out_dtype)) {
        tsys_tensor_release(y);
        TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "checkpoint: recomputing %s (tape position %zu) did not reproduce it; was an input changed in place?", tsys__op_names[n->op], n->index);
        return NULL;
    }
    if (!y && ctx->status == TSYS_OK) TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "checkpoint: recomputing %s (tape position %zu) failed", tsys__op_names[n->op], n->index);
    return y;
}

// Gives a node that saves only its inputs its saved values without running the op. A linear saves
// the weight in its compute dtype: under autocast that is a fresh low-precision copy.
static tsys_status tsys__replay_saved_inputs(tsys_ctx *ctx, tsys__node *n, tsys_tensor *const *v) {
    for (int k = 0; k < n->n_saved; k++) {
        if (n->saved[k]) continue;   // kept from the forward: a weight copy, attention's O and LSE
        int j = tsys__saved_input(n, k);
        if (j < 0 || j >= TSYS__NODE_IN) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "checkpoint: %s computes what it saves; it must be rerun", tsys__op_names[n->op]);
        tsys_tensor *t = v[j];
        bool cast = (n->op == TSYS__OP_LINEAR && k == TSYS__SAVED_LINEAR_W) || n->op == TSYS__OP_FLASH_ATTN;   // saved in the compute dtype
        if (cast && t->dtype != n->out_dtype) {
            tsys_dtype ac = ctx->autocast;
            ctx->replay = n; ctx->replay_done = true;   // nothing records; the autocast cache is not extended
            ctx->autocast = n->autocast;
            tsys_tensor *low = tsys__matmul_input(ctx, t, n->out_dtype, true);
            ctx->autocast = ac; ctx->replay = NULL;
            if (!low) return ctx->status;
            tsys__node_keep_saved(ctx, n, k, low);
            tsys_tensor_release(low);
        } else {
            tsys__node_keep_saved(ctx, n, k, t);
        }
    }
    return TSYS_OK;
}

// Input j of a node in the dormant region `child` comes from outside it: the node keeps it for the child's recompute.
static bool tsys__replay_crosses(const tsys_ctx *ctx, const tsys__node *n, int j, int child) {
    return child >= 0 && !tsys__node_in(ctx, n->src[j], child);
}
// Does the recompute of region r need input j of node n? (child: the region below r holding n, -1 = n is directly in r)
static bool tsys__replay_reads(const tsys_ctx *ctx, const tsys__node *n, int j, int child) {
    if (n->rc_run) return true;
    return child < 0 ? tsys__saves_input(n, j) : tsys__replay_crosses(ctx, n, j, child);
}

// Marks which nodes of region r up to tape position cur run, and counts the readers of each output
// (a reader comes after its producer, so one backward sweep sees them all first).
static void tsys__replay_plan(tsys_ctx *ctx, int r, size_t cur) {
    const tsys__region *R = &ctx->regions[r];
    for (size_t i = cur + 1; i-- > R->first;) {
        tsys__node *n = ctx->tape[i];
        int child = n->region == r ? -1 : tsys__region_child(ctx, n->region, r);
        bool kept = tsys__kept_computed(n);
        n->rc_run = !kept && (n->rc_need > 0 || (child < 0 && !tsys__saves_inputs_only(n)));
        for (int j = 0; j < n->n_in; j++) {
            tsys__node *p = n->src[j];
            if (!(n->in_mask >> j & 1) || !p || p->index < R->first || !tsys__replay_reads(ctx, n, j, child)) continue;
            p->rc_need++;
            n->rc_reads |= 1u << j;
        }
    }
}

// One node of the recompute of region r: its input values, then its op (or only its saved inputs),
// then what it keeps for a dormant child region; producers nobody reads any more let go of their output.
static tsys_status tsys__replay_node(tsys_ctx *ctx, int r, tsys__node *n) {
    int child = n->region == r ? -1 : tsys__region_child(ctx, n->region, r);
    tsys_tensor *v[TSYS__NODE_IN] = {NULL, NULL, NULL, NULL}, *y = NULL;
    tsys_status st = TSYS_OK;
    for (int j = 0; j < n->n_in; j++) {
        if (!(n->in_mask >> j & 1)) continue;
        v[j] = (n->rc_reads >> j & 1) ? n->src[j]->rc_out : n->inval[j];
        if (!v[j] && tsys__replay_reads(ctx, n, j, child))
            st = TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "checkpoint: input %d of %s (tape position %zu) is missing for its recompute", j, tsys__op_names[n->op], n->index);
    }
    if (st == TSYS_OK && n->rc_run) {
        y = tsys__replay_op(ctx, n, v, child < 0);
        st = y ? TSYS_OK : ctx->status;
    } else if (st == TSYS_OK && child < 0) {
        st = tsys__replay_saved_inputs(ctx, n, v);
    }
    if (st == TSYS_OK && !n->rc_run && n->rc_need > 0 && tsys__saved_output(n) >= 0) y = tsys_tensor_retain(n->saved[tsys__saved_output(n)]);
    for (int j = 0; st == TSYS_OK && child >= 0 && j < n->n_in; j++)
        if (v[j] && !n->inval[j] && tsys__replay_crosses(ctx, n, j, child)) tsys__node_keep_input(ctx, n, j, v[j]);
    for (int j = 0; j < n->n_in; j++) {
        if (!(n->rc_reads >> j & 1)) continue;
        tsys__node *p = n->src[j];
        if (--p->rc_need == 0) { tsys_tensor_release(p->rc_out); p->rc_out = NULL; }
    }
    n->rc_reads = 0;
    if (y && n->rc_need > 0) n->rc_out = y;
    else tsys_tensor_release(y);
    return st;
}

// Recomputes region r from its first node up to tape position cur (the node backward is at; the
// nodes after it are done). Its own nodes get their saved values; nested regions stay dormant.
static tsys_status tsys__region_recompute(tsys_ctx *ctx, int r, size_t cur) {
    size_t first = ctx->regions[r].first;
    uint64_t rng[4];
    memcpy(rng, ctx->rng, sizeof(rng));
    memcpy(ctx->rng, ctx->regions[r].rng, sizeof(rng));
    tsys__region_begin(ctx, "checkpoint recompute");
    tsys__replay_plan(ctx, r, cur);
    tsys_status st = TSYS_OK;
    for (size_t i = first; i <= cur && st == TSYS_OK; i++) st = tsys__replay_node(ctx, r, ctx->tape[i]);
    for (size_t i = first; i <= cur; i++) {   // after a failure some outputs are still held
        tsys__node *n = ctx->tape[i];
        tsys_tensor_release(n->rc_out);
        n->rc_out = NULL; n->rc_need = 0; n->rc_reads = 0;
        if (n->region == r) tsys__node_drop_inputs(ctx, n);   // its saved values now hold what backward needs
    }
    tsys__region_end(ctx, "checkpoint recompute");
    memcpy(ctx->rng, rng, sizeof(rng));
    ctx->regions[r].dormant = false;
    return st;
}

// Before backward enters a node of a dormant region: recompute the outermost dormant region around
// it, then the next one inside, until the node has its saved values.
static tsys_status tsys__checkpoint_materialize(tsys_ctx *ctx, tsys__node *node) {
    while (node->region >= 0 && ctx->regions[node->region].dormant) {
        int r = node->region;
        for (int p = ctx->regions[r].parent; p >= 0 && ctx->regions[p].dormant; p = ctx->regions[p].parent) r = p;
        tsys_status st = tsys__region_recompute(ctx, r, node->index);
        if (st != TSYS_OK) return st;
    }
    return TSYS_OK;
}

// >>model -----------------------------------------------------------------------------------------

typedef struct tsys__layer {
    tsys_tensor *q, *k, *v, *o, *w1, *w2, *w3, *ln1, *ln2;
} tsys__layer;

struct tsys_model {
    tsys_ctx *ctx;
    tsys_model_desc desc;
    tsys_device device;
    tsys_tensor *flat_params;                // one block; every parameter is a view
    tsys__grad_home *grad_homes;             // the gradients by group (the embedding, each layer, the head), made by backward
    int num_grad_homes;
    tsys_tensor **params;                    // parameters() order
    int num_tensors;
    tsys__layer *layers;
    char (*layer_names)[24];                 // "layers.3": the model's regions for the trace hooks
    tsys_tensor *emb, *ln_final, *lm_head;
    tsys_checkpoint_policy ckpt;             // desc.checkpoint, parsed
    tsys_checkpoint_plan plan;               // what the last forward ran (auto: planned for its shape)
    bool has_plan;
};

static const struct { const char *name; int d_model, d_ff, num_layers, num_heads; } tsys__presets[] = {
    {"small", 768, 3072, 12, 12}, {"medium", 1024, 4096, 24, 16}, {"large", 1280, 5120, 36, 20},
    {"xl", 1600, 6400, 48, 25}, {"2.7B", 2560, 10240, 32, 32},
};
#define TSYS__NUM_PRESETS ((int)(sizeof(tsys__presets) / sizeof(tsys__presets[0])))

TSYSDEF const char *tsys_model_preset_names(void) { return "small, medium, large, xl, 2.7B"; }

TSYSDEF tsys_model_desc tsys_model_desc_defaults(const tsys_model_desc *desc) {
    tsys_model_desc d;
    memset(&d, 0, sizeof(d));
    if (desc) d = *desc;
#define TSYS__DEF(f, v) if (!d.f) d.f = (v)
    TSYS__DEF(vocab_size, 10000); TSYS__DEF(context_length, 256); TSYS__DEF(d_model, 768);
    TSYS__DEF(num_layers, 12); TSYS__DEF(num_heads, 12); TSYS__DEF(d_ff, 4 * d.d_model);
    TSYS__DEF(rope_theta, 10000.0f); TSYS__DEF(eps, 1e-5f); TSYS__DEF(attn, "naive"); TSYS__DEF(checkpoint, "none");
#undef TSYS__DEF
    return d;
}

TSYSDEF tsys_status tsys_model_desc_preset(const char *name, tsys_model_desc *out, char *err, size_t err_len) {
    if (!out) {
        if (err) snprintf(err, err_len, "model preset '%s': out is NULL", name ? name : "(null)");
        return TSYS_ERR_INVALID_ARGS;
    }
    for (int i = 0; name && i < TSYS__NUM_PRESETS; i++) {
        if (strcmp(name, tsys__presets[i].name) != 0) continue;
        tsys_model_desc d;
        memset(&d, 0, sizeof(d));
        d.d_model = tsys__presets[i].d_model; d.d_ff = tsys__presets[i].d_ff;
        d.num_layers = tsys__presets[i].num_layers; d.num_heads = tsys__presets[i].num_heads;
        *out = tsys_model_desc_defaults(&d);
        return TSYS_OK;
    }
    if (err) snprintf(err, err_len, "unknown model preset '%s' (known: %s)", name ? name : "(null)", tsys_model_preset_names());
    return TSYS_ERR_INVALID_ARGS;
}

TSYSDEF tsys_status tsys_model_desc_validate(const tsys_model_desc *desc, char *err, size_t err_len) {
    tsys_model_desc d = tsys_model_desc_defaults(desc);
    const char *why = NULL;
    char buf[256];
    if (d.vocab_size < 1 || d.context_length < 1 || d.d_model < 1 || d.num_layers < 1 || d.num_heads < 1 || d.d_ff < 1)
        why = "vocab_size, context_length, d_model, num_layers, num_heads and d_ff must all be positive";
    else if (d.d_model % d.num_heads != 0) {
        snprintf(buf, sizeof(buf), "d_model %d is not divisible by num_heads %d", d.d_model, d.num_heads);
        why = buf;
    } else if ((d.d_model / d.num_heads) % 2 != 0) {
        snprintf(buf, sizeof(buf), "head dim d_model/num_heads = %d is odd; RoPE rotates pairs and needs it even", d.d_model / d.num_heads);
        why = buf;
    } else if (!(d.rope_theta > 0) || !(d.eps > 0)) why = "rope_theta and eps must be positive";
    else if (d.fused_loss_chunk < 0) {
        snprintf(buf, sizeof(buf), "fused_loss_chunk %d must be >= 0 (0: the op's default)", d.fused_loss_chunk);
        why = buf;
    } else if (strcmp(d.attn, "naive") != 0 && strcmp(d.attn, "flash") != 0) {
        snprintf(buf, sizeof(buf), "attention '%s' is neither 'naive' nor 'flash'", d.attn);
        why = buf;
    } else {
        tsys_checkpoint_policy p;
        if (tsys_checkpoint_policy_parse(d.checkpoint, d.num_layers, &p, buf, sizeof(buf)) != TSYS_OK) why = buf;
    }
    if (!why) return TSYS_OK;
    if (err) snprintf(err, err_len, "invalid model: %s", why);
    return TSYS_ERR_INVALID_ARGS;
}

TSYSDEF int64_t tsys_model_desc_num_params(const tsys_model_desc *desc) {
    tsys_model_desc d = tsys_model_desc_defaults(desc);
    int64_t dm = d.d_model, per_layer = 4 * dm * dm + 3 * dm * d.d_ff + 2 * dm;
    return 2 * (int64_t)d.vocab_size * dm + d.num_layers * per_layer + dm;
}

// Matmul FLOPs of one forward (2 per multiply-add): projections, FFN, lm_head and the attention
// products (QK^T and PV over the full T x T, as the naive kernel computes them). Backward is 2x.
TSYSDEF double tsys_model_flops(const tsys_model_desc *desc, int64_t batch, int64_t T, bool backward) {
    tsys_model_desc d = tsys_model_desc_defaults(desc);
    double tokens = (double)batch * (double)T, dm = d.d_model;
    double per_layer = 2.0 * tokens * (4 * dm * dm + 3 * dm * d.d_ff) + 2.0 * 2.0 * (double)batch * (double)T * (double)T * dm;
    double fwd = d.num_layers * per_layer + 2.0 * tokens * dm * d.vocab_size;
    return backward ? 3.0 * fwd : fwd;
}

// What the tape keeps, op by op (N = batch x T tokens, c = bytes of the compute dtype, 4 without
// autocast). A block saves: its fp32 residual input and the mid-block residual (the norms' inputs)
// and the two norms' 1/rms; the norm outputs as the projections read them (fp32: one tensor shared by
// q, k, v and by w1, w3; autocast: each linear's own cast, 3 + 2); q and k after RoPE, v and the merged
// heads (transposed copies); naive attention the softmax output (B, H, T, T), flash attention its
// output and log-sum-exp (B, H, T); the SwiGLU inputs and output (3 x N x d_ff). Outside the blocks:
// the final norm's input and 1/rms, lm_head's input, the logits and the loss's log-sum-exp.
// Autocast's low-precision weight copies (every matrix but the embedding) live from their first use
// to the end of backward; kept by AdamW (kept_copies), a copy of every parameter lives all along.
// Gradients are fp32, one block per layer, made when backward reaches the layer and given back after
// the step (the drivers' tsys_optim_release_grads, torch's set_to_none).
TSYSDEF tsys_model_mem_estimate tsys_model_mem_predict(const tsys_model_desc *desc, int64_t batch, int64_t T, tsys_dtype compute, bool backward, bool optimizer) {
    return tsys_model_mem_predict_kept(desc, batch, T, compute, backward, optimizer, false);
}
TSYSDEF tsys_model_mem_estimate tsys_model_mem_predict_kept(const tsys_model_desc *desc, int64_t batch, int64_t T, tsys_dtype compute, bool backward, bool optimizer,
                                                            bool kept_copies) {
    tsys_model_mem_estimate e;
    memset(&e, 0, sizeof(e));
    tsys_model_desc d = tsys_model_desc_defaults(desc);
    bool autocast = compute != TSYS_F32, flash = d.attn && strcmp(d.attn, "flash") == 0;
    bool kept = kept_copies && autocast && optimizer;   // the optimizer holds them
    int64_t c = (int64_t)tsys_dtype_size(compute), N = batch * T, D = d.d_model, F = d.d_ff, H = d.num_heads, V = d.vocab_size, L = d.num_layers;
    int64_t P = tsys_model_desc_num_params(&d), matrices = P - V * D - (2 * L + 1) * D;
    // kept: each tensor's copy 256-byte aligned in the optimizer's block (tsys__lowp_align)
    int64_t kept_bytes = 2 * (int64_t)tsys__lowp_align((size_t)(V * D * c)) + (2 * L + 1) * (int64_t)tsys__lowp_align((size_t)(D * c))
                       + L * (4 * (int64_t)tsys__lowp_align((size_t)(D * D * c)) + 3 * (int64_t)tsys__lowp_align((size_t)(D * F * c)));
    int64_t copies = kept ? kept_bytes : autocast ? matrices * c : 0, scores = batch * H * T * T * c;
    e.num_layers = d.num_layers;
    e.params = 4 * P + copies;
    e.grads = backward ? 4 * P : 0;
    e.optimizer = optimizer ? 8 * P + 16 : 0;   // m, v, the step count and its two bias corrections
    int64_t norm_outs = 2 * N * D * (autocast ? c : 4);   // each norm's output, in the dtype its matmuls read (tsys__rmsnorm_to)
    e.saved_per_layer = 2 * N * D * 4 + 2 * N * 4 + norm_outs + 4 * N * D * c + (flash ? N * D * c + batch * H * T * 4 : scores) + 3 * N * F * c;
    // fused_loss: the head keeps d x (in place of its input) and d w (fp32), never the logits
    const bool fused = d.fused_loss && backward;
    e.saved_outside = N * D * 4 + N * 4 + N * D * (autocast ? c : 4) + (fused ? 4 * V * D : N * V * c + N * 4);
    int64_t act = e.saved_per_layer * L + e.saved_outside;
    if (backward) {
        // Gradients are made by group as backward reaches it (the head, then each layer) and given
        // back after the step (tsys_release_grads); the saved tensors go as their nodes finish. The
        // peak is the largest of: the loss's backward (every activation and the logits' gradient);
        // lm_head's (the logits gone, the head's gradients made); the last block's FFN backward (the
        // head's tensors gone; that layer's gradients, the residual stream's gradient, dS, da, db);
        // its naive softmax backward (the FFN's tensors gone too; dP and dS); the end of backward
        // (every gradient; autocast's weight copies gone with their nodes).
        int64_t ch = autocast ? c : 4, head_grads = 4 * (V * D + D), layer_grads = 4 * (4 * D * D + 3 * D * F + 2 * D);
        int64_t head_saved = (fused ? 4 * V * D : N * V * c + N * 4) + N * D * ch + N * D * 4 + N * 4;
        int64_t ffn_saved = 3 * N * F * c + N * D * 4 + N * D * (autocast ? c : 4) + N * 4;
        struct { int64_t act, grads, temp, params; const char *what; } cand[6] = {
            {act, 0, N * V * c, e.params, "the loss's backward: every activation and the logits' gradient"},
            {act - N * V * c, head_grads, N * V * c + N * D * c, e.params, "lm_head's backward: the logits' gradient, the head's gradients"},
            {act - head_saved, head_grads + layer_grads, N * D * 4 + 3 * N * F * c, e.params, "the last block's FFN backward: its gradients, the residual stream's, dS, da, db"},
            {act - head_saved - ffn_saved, head_grads + layer_grads, N * D * 4 + 2 * scores, e.params, "the last block's softmax backward: dP and dS"},
            {0, e.grads, N * D * 4, kept ? e.params : 4 * P, "the end of backward: every gradient, and the residual stream's"},
            {0, 0, 0, 0, ""},
        };
        int ncand = 5;
        if (fused) {   // the head's backward scales what forward made and gives it to lm_head's gradient
            const int64_t rows = tsys_model_fused_loss_chunk(&d, N);
            cand[0].temp = cand[1].temp = 0; cand[1].act = act; cand[1].grads = 4 * V * D;
            cand[1].what = "the fused head's backward: every activation and lm_head's gradient";
            cand[5].act = act; cand[5].temp = rows * (V * c + 4); cand[5].params = e.params; ncand = 6;
            cand[5].what = "the fused head's forward: every activation and a chunk's logits";
        }
        int best = 0;
        for (int k = 1; k < ncand; k++) {
            if (k == 3 && flash) continue;
            if (cand[k].act + cand[k].grads + cand[k].temp + cand[k].params > cand[best].act + cand[best].grads + cand[best].temp + cand[best].params) best = k;
        }
        e.activations = cand[best].act; e.grads = cand[best].grads; e.temporaries = cand[best].temp; e.params = cand[best].params;
        e.temporaries_what = cand[best].what;
    } else {
        // no tape: the most alive at once is in the last block's attention (the residual stream, q, k
        // and v, the scores and their softmax or flash attention's output) or its FFN (the residual
        // stream, the norm's output, both projections and their SwiGLU), where lm_head's copy is not
        // made yet; or at lm_head (its input, its cast and the logits)
        int64_t head_copy = autocast && !kept ? V * D * c : 0;   // kept: there all along
        int64_t in_attn = N * D * 4 + 3 * N * D * c + (flash ? N * D * c + batch * H * T * 4 : 2 * scores) - head_copy;
        int64_t in_ffn = N * D * 4 + N * D * (autocast ? c : 4) + 3 * N * F * c - head_copy;
        int64_t at_head = N * V * c + N * D * (autocast ? c : 4);
        e.temporaries = TSYS__MAX(TSYS__MAX(in_attn, in_ffn), at_head);
        e.temporaries_what = e.temporaries == at_head ? "the logits and lm_head's input"
                           : e.temporaries == in_ffn ? "the last block's FFN: the residual stream, the norm's output, both projections and their SwiGLU"
                                                     : "the last block's attention: the residual stream, q, k, v, the scores and their softmax";
        if (e.temporaries != at_head) { e.params -= head_copy; e.temporaries += head_copy; }
    }
    e.peak = e.params + e.grads + e.optimizer + e.activations + e.temporaries;
    return e;
}

// A NULL model: NULL, 0 (nothing to name an error in).
TSYSDEF const tsys_model_desc *tsys_model_get_desc(const tsys_model *m) { return m ? &m->desc : NULL; }
TSYSDEF tsys_tensor **tsys_model_params(tsys_model *m) { return m ? m->params : NULL; }
TSYSDEF int tsys_model_num_tensors(const tsys_model *m) { return m ? m->num_tensors : 0; }
TSYSDEF int64_t tsys_model_num_params(const tsys_model *m) { return m ? tsys_model_desc_num_params(&m->desc) : 0; }
TSYSDEF bool tsys_model_matmul_weight(const tsys_model *m, const tsys_tensor *p) {
    bool mine = false;
    for (int i = 0; m && p && !mine && i < m->num_tensors; i++) mine = m->params[i] == p;
    return mine && p->ndim == 2 && p != m->emb;
}
TSYSDEF tsys_tensor *tsys_model_param(tsys_model *m, const char *name) {
    for (int i = 0; m && name && i < m->num_tensors; i++)
        if (strcmp(m->params[i]->name, name) == 0) return m->params[i];
    return NULL;
}

TSYSDEF tsys_status tsys_model_set_grad_dtype(tsys_model *m, tsys_dtype dt) {
    if (!m) return TSYS_ERR_INVALID_ARGS;
    for (int i = 0; i < m->num_tensors; i++)
        if (tsys_model_matmul_weight(m, m->params[i]) && tsys_tensor_set_grad_dtype(m->ctx, m->params[i], dt) != TSYS_OK) return m->ctx->status;
    return TSYS_OK;
}

// Carves the next parameter (and its grad) out of the flat blocks, in parameters() order.
static tsys_tensor *tsys__model_param(tsys_model *m, size_t *offset, int ndim, int64_t d0, int64_t d1, const char *fmt, int layer) {
    int64_t shape[2] = {d0, d1};
    tsys_ctx *ctx = m->ctx;
    tsys_tensor *p = tsys_tensor_view_raw(ctx, m->flat_params, *offset, TSYS_F32, ndim, shape);
    if (!p) return NULL;
    tsys_tensor_set_name(p, fmt, layer);
    p->requires_grad = true;
    *offset += tsys_tensor_bytes(p);
    m->params[m->num_tensors++] = p;
    return p;
}

// Gradient groups: the embedding, each layer's nine, the final norm with lm_head. Backward reaches
// them in reverse order, so each group's gradients are made as its layer's backward starts.
static bool tsys__model_grad_homes(tsys_model *m) {
    int L = m->desc.num_layers, first = 0;
    m->grad_homes = (tsys__grad_home *)TSYS_MALLOC(sizeof(tsys__grad_home) * (size_t)(L + 2));
    if (!m->grad_homes) { TSYS__FAIL(m->ctx, TSYS_ERR_OOM, "out of host memory for the model"); return false; }
    m->num_grad_homes = L + 2;
    for (int g = 0; g < L + 2; g++) {
        tsys__grad_home *h = &m->grad_homes[g];
        h->params = m->params + first; h->n = g == 0 ? 1 : g <= L ? 9 : 2; h->block = NULL;
        for (int i = 0; i < h->n; i++) m->params[first + i]->grad_home = h;
        first += h->n;
    }
    TSYS_ASSERT(first == m->num_tensors);
    return true;
}

static tsys_status tsys__model_init_params(tsys_model *m) {
    tsys_ctx *ctx = m->ctx;
    for (int i = 0; i < m->num_tensors; i++) {
        tsys_tensor *p = m->params[i];
        tsys_status st;
        if (p->ndim == 1) st = tsys_tensor_fill(ctx, p, 1.0f);                   // norm gains start at 1
        else if (p == m->emb) st = tsys_tensor_trunc_normal(ctx, p, 1.0f, -3.0f, 3.0f);
        else {
            float std = sqrtf(2.0f / (float)(p->shape[0] + p->shape[1]));
            st = tsys_tensor_trunc_normal(ctx, p, std, -3.0f * std, 3.0f * std);
        }
        if (st != TSYS_OK) return st;
    }
    return TSYS_OK;
}

TSYSDEF tsys_model *tsys_model_new(tsys_ctx *ctx, const tsys_model_desc *desc, tsys_device dev, uint64_t seed) {
    char err[256];
    TSYS__CHECK_ARG(ctx, ctx, NULL, "no context");
    if (!tsys__device_ok(ctx, "tsys_model_new", dev)) return NULL;
    tsys_model_desc d = tsys_model_desc_defaults(desc);
    if (tsys_model_desc_validate(&d, err, sizeof(err)) != TSYS_OK) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s", err); return NULL; }
    tsys_model *m = (tsys_model *)TSYS_MALLOC(sizeof(tsys_model));
    if (!m) { TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the model"); return NULL; }
    memset(m, 0, sizeof(*m));
    m->ctx = ctx; m->desc = d; m->device = dev;
    tsys__ctx_ref(ctx);   // given back by tsys_model_free
    tsys_checkpoint_policy_parse(d.checkpoint, d.num_layers, &m->ckpt, NULL, 0);   // validated above
    int64_t n = tsys_model_desc_num_params(&d);
    int ntensors = 3 + 9 * d.num_layers;
    m->params = (tsys_tensor **)TSYS_MALLOC(sizeof(tsys_tensor *) * (size_t)ntensors);
    m->layers = (tsys__layer *)TSYS_MALLOC(sizeof(tsys__layer) * (size_t)d.num_layers);
    m->layer_names = (char (*)[24])TSYS_MALLOC(sizeof(*m->layer_names) * (size_t)d.num_layers);
    for (int l = 0; m->layer_names && l < d.num_layers; l++) snprintf(m->layer_names[l], sizeof(m->layer_names[l]), "layers.%d", l);
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "parameters"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_PARAMETERS);
    m->flat_params = (m->params && m->layers && m->layer_names) ? tsys_tensor_new(ctx, TSYS_F32, dev, 1, &n) : NULL;
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    if (!m->flat_params) {
        if (!m->params || !m->layers || !m->layer_names) TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the model");
        tsys_model_free(m);
        return NULL;
    }
    tsys_tensor_set_name(m->flat_params, "parameters");
    size_t off = 0;
    int64_t dm = d.d_model, dff = d.d_ff;
    bool ok = (m->emb = tsys__model_param(m, &off, 2, d.vocab_size, dm, "token_embeddings.weight", 0)) != NULL;
    for (int l = 0; ok && l < d.num_layers; l++) {
        tsys__layer *L = &m->layers[l];
        ok = (L->q = tsys__model_param(m, &off, 2, dm, dm, "layers.%d.attn.q_proj.weight", l)) &&
             (L->k = tsys__model_param(m, &off, 2, dm, dm, "layers.%d.attn.k_proj.weight", l)) &&
             (L->v = tsys__model_param(m, &off, 2, dm, dm, "layers.%d.attn.v_proj.weight", l)) &&
             (L->o = tsys__model_param(m, &off, 2, dm, dm, "layers.%d.attn.output_proj.weight", l)) &&
             (L->w1 = tsys__model_param(m, &off, 2, dff, dm, "layers.%d.ffn.w1.weight", l)) &&
             (L->w2 = tsys__model_param(m, &off, 2, dm, dff, "layers.%d.ffn.w2.weight", l)) &&
             (L->w3 = tsys__model_param(m, &off, 2, dff, dm, "layers.%d.ffn.w3.weight", l)) &&
             (L->ln1 = tsys__model_param(m, &off, 1, dm, 0, "layers.%d.ln1.weight", l)) &&
             (L->ln2 = tsys__model_param(m, &off, 1, dm, 0, "layers.%d.ln2.weight", l));
    }
    ok = ok && (m->ln_final = tsys__model_param(m, &off, 1, dm, 0, "ln_final.weight", 0)) &&
         (m->lm_head = tsys__model_param(m, &off, 2, d.vocab_size, dm, "lm_head.weight", 0));
    TSYS_ASSERT(!ok || off == (size_t)n * sizeof(float));
    ok = ok && tsys__model_grad_homes(m);
    uint64_t saved_rng[4];
    memcpy(saved_rng, ctx->rng, sizeof(saved_rng));
    tsys_rng_seed(ctx, seed);
    if (ok) ok = tsys__model_init_params(m) == TSYS_OK;
    memcpy(ctx->rng, saved_rng, sizeof(saved_rng));
    if (!ok) { tsys_model_free(m); return NULL; }
    return m;
}

TSYSDEF void tsys_model_free(tsys_model *m) {
    if (!m) return;
    for (int i = 0; m->grad_homes && i < m->num_grad_homes; i++) tsys__grad_home_release(&m->grad_homes[i]);
    for (int i = 0; i < m->num_tensors; i++) m->params[i]->grad_home = NULL;   // an optimizer may keep them
    for (int i = 0; i < m->num_tensors; i++) tsys_tensor_release(m->params[i]);
    tsys_tensor_release(m->flat_params);
    TSYS_FREE(m->grad_homes);
    TSYS_FREE(m->params);
    TSYS_FREE(m->layers);
    TSYS_FREE(m->layer_names);
    tsys_ctx *ctx = m->ctx;
    TSYS_FREE(m);
    tsys__ctx_unref(ctx);   // last: after tsys_ctx_free, this may free the context
}

TSYSDEF tsys_status tsys_check_token_ids(tsys_ctx *ctx, const tsys_tensor *ids, int vocab_size, int context_length) {
    if (!ids) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "token ids: NULL tensor");
    if (ids->dtype != TSYS_I32 && ids->dtype != TSYS_I64) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "token ids '%s': dtype %s, expected i32 or i64", ids->name, tsys_dtype_name(ids->dtype));
    if (ids->ndim != 2) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "token ids '%s': expected (batch, seq), got %d dims", ids->name, ids->ndim);
    if (context_length > 0 && ids->shape[1] > context_length)
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "token ids '%s': sequence length %lld is longer than the model's context_length %d", ids->name, (long long)ids->shape[1], context_length);
    int64_t n = tsys_tensor_numel(ids);
    void *host = TSYS_MALLOC(tsys_tensor_bytes(ids) + 1);
    if (!host) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory checking token ids");
    tsys_status st = tsys_tensor_to_host(ctx, ids, host);
    for (int64_t i = 0; st == TSYS_OK && i < n; i++) {
        int64_t id = tsys__load_id(host, ids->dtype, i);
        if (id < 0 || id >= vocab_size)
            st = TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "token ids '%s': id %lld at position %lld is outside the vocabulary [0, %d)", ids->name, (long long)id, (long long)i, vocab_size);
    }
    TSYS_FREE(host);
    return st;
}

// Selective checkpointing marks regions inside a block (tsys_checkpoint_policy.selective). Their
// linears never rerun, so under autocast they keep the weight copies the forward made.
static void tsys__sel_begin(tsys_ctx *ctx, bool sel) { if (sel) tsys_checkpoint_begin_ex(ctx, TSYS_CHECKPOINT_KEEP_WEIGHT_COPIES); }
static void tsys__sel_end(tsys_ctx *ctx, bool sel) { if (sel) tsys_checkpoint_end(ctx); }

// Causal self-attention of one block: project, split heads, RoPE on q and k, attend, merge, project.
// Selective: the projections close the region the residual step opened around the norm, and the
// attention core is a region (naive: QK^T and softmax; flash: the kernel up to the output projection).
static tsys_tensor *tsys__model_attention(tsys_model *m, const tsys__layer *L, tsys_tensor *h, int64_t B, int64_t T, bool sel) {
    tsys_ctx *ctx = m->ctx;
    int64_t H = m->desc.num_heads, dh = m->desc.d_model / H;
    int64_t split[4] = {B, T, H, dh}, merged[3] = {B, T, m->desc.d_model};
    tsys_tensor *proj[3] = {L->q, L->k, L->v}, *p[3], *heads[3] = {NULL, NULL, NULL};
    tsys_linears(ctx, h, 3, proj, p);   // a failure leaves p NULL, and the ops below pass it on
    for (int j = 0; j < 3; j++) {
        tsys_tensor *pv = tsys_view(ctx, p[j], 4, split);
        tsys_tensor_release(p[j]);
        // (B, H, T, dh); q and k rotated in the same pass
        heads[j] = j < 2 ? tsys_rope_heads(ctx, pv, m->desc.rope_theta) : tsys_transpose12(ctx, pv);
        tsys_tensor_release(pv);
    }
    tsys__sel_end(ctx, sel);
    bool flash = strcmp(m->desc.attn, "flash") == 0;
    tsys__sel_begin(ctx, sel);
    if (flash) tsys__region_begin(ctx, "flash attention");
    tsys_tensor *a = flash ? tsys_flash_attention(ctx, heads[0], heads[1], heads[2], true, NULL)
                           : tsys_attention_naive(ctx, heads[0], heads[1], heads[2], true);
    if (flash) tsys__region_end(ctx, "flash attention");
    tsys__sel_end(ctx, sel && !flash);
    for (int j = 0; j < 3; j++) tsys_tensor_release(heads[j]);
    tsys_tensor *at = tsys_transpose12(ctx, a);   // (B, T, H, dh)
    tsys_tensor_release(a);
    tsys_tensor *av = tsys_view(ctx, at, 3, merged);
    tsys_tensor_release(at);
    tsys_tensor *o = tsys_linear(ctx, av, L->o, NULL);
    tsys_tensor_release(av);
    tsys__sel_end(ctx, sel && flash);
    return o;
}

// SwiGLU feed-forward. Selective: w1 and w3 close the norm's region; SwiGLU and w2 are one region
// (SwiGLU's output is recomputed from the kept w1, w3 outputs; w2 is not rerun).
static tsys_tensor *tsys__model_ffn(tsys_model *m, const tsys__layer *L, tsys_tensor *h, bool sel) {
    tsys_ctx *ctx = m->ctx;
    tsys_tensor *w13[2] = {L->w1, L->w3}, *ab[2];
    tsys_linears(ctx, h, 2, w13, ab);   // a failure leaves ab NULL, and swiglu passes it on
    tsys__sel_end(ctx, sel);
    tsys__sel_begin(ctx, sel);
    tsys_tensor *s = tsys_swiglu(ctx, ab[0], ab[1]);
    tsys_tensor_release(ab[0]); tsys_tensor_release(ab[1]);
    tsys_tensor *y = tsys_linear(ctx, s, L->w2, NULL);
    tsys__sel_end(ctx, sel);
    tsys_tensor_release(s);
    return y;
}

// x + f(norm(x)), the pre-norm residual step; consumes x. Selective: the norm opens a region that
// the projections reading its output close.
// The dtype a norm feeding matmuls writes: autocast's compute dtype for the fp32 residual stream
// (each matmul would cast it so; tsys__rmsnorm_to), else the stream's own.
static tsys_dtype tsys__model_norm_dtype(const tsys_ctx *ctx, const tsys_tensor *x) {
    return x && x->dtype == TSYS_F32 && ctx->autocast != TSYS_F32 ? ctx->autocast : x ? x->dtype : TSYS_F32;
}

static tsys_tensor *tsys__residual(tsys_model *m, const tsys__layer *L, tsys_tensor *x, bool attn, int64_t B, int64_t T, bool sel) {
    tsys_ctx *ctx = m->ctx;
    tsys__sel_begin(ctx, sel);
    tsys_tensor *h = tsys__rmsnorm_to(ctx, x, attn ? L->ln1 : L->ln2, m->desc.eps, tsys__model_norm_dtype(ctx, x));
    tsys_tensor *f = attn ? tsys__model_attention(m, L, h, B, T, sel) : tsys__model_ffn(m, L, h, sel);
    tsys_tensor_release(h);
    tsys_tensor *y = tsys_add(ctx, x, f);
    tsys_tensor_release(x); tsys_tensor_release(f);
    return y;
}

static tsys_status tsys__checkpoint_plan(const tsys_model_desc *desc, const tsys_checkpoint_policy *pol, int64_t B, int64_t T, tsys_dtype dt, unsigned how, tsys_checkpoint_plan *out);

// The policy this forward runs: the model's, or for auto the planner's choice for this shape.
static tsys_checkpoint_policy tsys__model_policy(tsys_model *m, int64_t B, int64_t T) {
    tsys_ctx *ctx = m->ctx;
    tsys_dtype dt = ctx->autocast;
    bool same = m->has_plan && m->plan.batch == B && m->plan.context == T && m->plan.dtype == dt;
    if (!same) {
        m->has_plan = tsys__checkpoint_plan(&m->desc, &m->ckpt, B, T, dt, TSYS_PLAN_OPTIMIZER, &m->plan) == TSYS_OK;
        if (!m->has_plan) TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "model: no checkpointing plan for batch %lld, context %lld", (long long)B, (long long)T);
    }
    return m->has_plan ? m->plan.policy : m->ckpt;
}

// One residual step's seam: the norm that opens the next step over the stream x, with the branch f of the
// step before added first (tsys__add_rmsnorm) when there is one; x becomes the new stream, f is consumed.
static tsys_tensor *tsys__model_norm_next(tsys_model *m, tsys_tensor **x, tsys_tensor **f, tsys_tensor *ln) {
    tsys_ctx *ctx = m->ctx;
    tsys_dtype dt = tsys__model_norm_dtype(ctx, *x);
    if (!*f) return tsys__rmsnorm_to(ctx, *x, ln, m->desc.eps, dt);
    tsys_tensor *s = NULL, *h = tsys__add_rmsnorm(ctx, *x, *f, ln, m->desc.eps, dt, &s);
    tsys_tensor_release(*x); tsys_tensor_release(*f);
    *x = s; *f = NULL;
    return h;
}

// The blocks without checkpoint regions, each residual add fused with the norm after it
// (tsys__model_norm_next). Returns the final norm's output (the head's input). Consumes x.
static tsys_tensor *tsys__model_blocks_fused(tsys_model *m, tsys_tensor *x, int64_t B, int64_t T) {
    tsys_ctx *ctx = m->ctx;
    tsys_tensor *f = NULL, *h;
    for (int l = 0; l < m->desc.num_layers; l++) {
        const tsys__layer *L = &m->layers[l];
        tsys__region_begin(ctx, m->layer_names[l]);
        h = tsys__model_norm_next(m, &x, &f, L->ln1);
        f = tsys__model_attention(m, L, h, B, T, false);
        tsys_tensor_release(h);
        h = tsys__model_norm_next(m, &x, &f, L->ln2);
        f = tsys__model_ffn(m, L, h, false);
        tsys_tensor_release(h);
        tsys__region_end(ctx, m->layer_names[l]);
    }
    h = tsys__model_norm_next(m, &x, &f, m->ln_final);
    tsys_tensor_release(x);
    return h;
}

// The blocks, with the policy's regions: segments of p.segment blocks, regions of p.inner blocks
// nested in each, the selective regions inside every block.
static tsys_tensor *tsys__model_blocks(tsys_model *m, tsys_tensor *x, const tsys_checkpoint_policy *p, int64_t B, int64_t T) {
    tsys_ctx *ctx = m->ctx;
    int n = m->desc.num_layers, covered = p->first ? p->first : n;   // +first:N: the blocks above N have no regions
    for (int l = 0; l < n; l++) {
        int seg = l < covered ? p->segment : 0, inner = l < covered ? p->inner : 0;
        bool sel = l < covered && p->selective;
        int in_seg = seg ? l % seg : l;   // position in the segment
        bool seg_last = seg && ((l + 1) % seg == 0 || l + 1 == covered);
        unsigned flags = p->keep_attention ? TSYS_CHECKPOINT_KEEP_ATTENTION : 0;
        if (seg && in_seg == 0) tsys_checkpoint_begin_ex(ctx, flags);
        if (inner && in_seg % inner == 0) tsys_checkpoint_begin_ex(ctx, flags);
        tsys__region_begin(ctx, m->layer_names[l]);
        x = tsys__residual(m, &m->layers[l], x, true, B, T, sel);
        x = tsys__residual(m, &m->layers[l], x, false, B, T, sel);
        tsys__region_end(ctx, m->layer_names[l]);
        if (inner && ((in_seg + 1) % inner == 0 || seg_last)) tsys_checkpoint_end(ctx);
        if (seg_last) tsys_checkpoint_end(ctx);
    }
    return x;
}

// The final norm's output (B, T, d): the trunk, in the dtype lm_head reads.
static tsys_tensor *tsys__model_hidden(tsys_model *m, tsys_tensor *ids) {
    if (!m) return NULL;
    tsys_ctx *ctx = m->ctx;
    if (!tsys__check_inputs(ctx, "model", &ids, 1)) return NULL;
    TSYS__REQUIRE(ctx, ids->ndim == 2 && (ids->dtype == TSYS_I32 || ids->dtype == TSYS_I64), "model: ids '%s' must be (batch, seq) i32/i64", ids->name);
    TSYS__REQUIRE(ctx, ids->shape[1] <= m->desc.context_length, "model: sequence length %lld is longer than context_length %d", (long long)ids->shape[1], m->desc.context_length);
    TSYS__REQUIRE(ctx, ids->device == m->device, "model: ids '%s' are on another device than the model", ids->name);
    int64_t B = ids->shape[0], T = ids->shape[1];
    tsys_checkpoint_policy p = tsys__model_policy(m, B, T);
    tsys_tensor *x = tsys_embedding(ctx, m->emb, ids), *h;
    if (!p.segment && !p.selective && x && x->dtype == TSYS_F32) h = tsys__model_blocks_fused(m, x, B, T);
    else {   // checkpoint regions begin and end between the add and the norm: they run apart
        x = tsys__model_blocks(m, x, &p, B, T);
        h = tsys__rmsnorm_to(ctx, x, m->ln_final, m->desc.eps, tsys__model_norm_dtype(ctx, x));
        tsys_tensor_release(x);
    }
    return h;
}

TSYSDEF tsys_tensor *tsys_model_forward(tsys_model *m, tsys_tensor *ids) {
    tsys_tensor *h = tsys__model_hidden(m, ids);
    tsys_tensor *logits = h ? tsys_linear(m->ctx, h, m->lm_head, NULL) : NULL;
    tsys_tensor_release(h);
    if (logits) tsys_tensor_set_name(logits, "logits");
    return logits;
}

TSYSDEF tsys_tensor *tsys_model_loss(tsys_model *m, tsys_tensor *ids, tsys_tensor *targets) {
    if (!m) return NULL;
    if (!m->desc.fused_loss) {
        tsys_tensor *logits = tsys_model_forward(m, ids);
        tsys_tensor *loss = logits ? tsys_cross_entropy(m->ctx, logits, targets) : NULL;
        tsys_tensor_release(logits);
        return loss;
    }
    tsys_tensor *h = tsys__model_hidden(m, ids);
    tsys_tensor *loss = h ? tsys_linear_cross_entropy(m->ctx, h, m->lm_head, targets, m->desc.fused_loss_chunk) : NULL;
    tsys_tensor_release(h);
    return loss;
}

TSYSDEF const tsys_checkpoint_plan *tsys_model_checkpoint_plan(const tsys_model *m) { return m && m->has_plan ? &m->plan : NULL; }

// >>checkpoint planner ----------------------------------------------------------------------------
// Policies (tsys_model_desc.checkpoint) and what they cost. Bytes per block that the forward keeps for
// backward, read off the ops (E = batch x context tokens, d, f = d_ff, H heads, T context, B batch;
// c = 4 in fp32, 2 under bf16/fp16 autocast; the residual stream and norm statistics stay fp32):
//   x    4Ed     each RMSNorm's input (the residual), and rstd 4E
//   qkv  fp32: 4Ed, the norm's output the three projections share; autocast: 3cEd, a cast each
//   attn naive: q, k (QK^T), v (PV) 3cEd + the softmax output c B H T^2 (softmax and PV share it);
//        flash: q, k, v, O 4cEd + L 4 B H T
//   o    cEd     the output projection's input
//   ffn  fp32: 4Ed shared by w1, w3; autocast: 2cEd
//   ab   2cEf    SwiGLU's inputs (w1, w3 outputs);  s  cEf  SwiGLU's output (w2's input)
// Without checkpointing a block keeps all of it (the CS336 xl block, fp32, context 2048, batch 4:
// 3648 MiB against torch's 3651). A region keeps its inputs: a block or segment of blocks one x;
// selective keeps x + 3cEd + (naive: o) + x + ab (the norms' outputs and casts, the softmax output or
// flash's O and o, and s go). The rest of the model keeps the final norm's x and rstd, the lm_head
// input (4Ed or cEd), the logits c E V and the loss's logsumexp 4E. A model computing in the 16-bit dtype
// throughout (TSYS_PLAN_PURE: FSDP's compute dtype) keeps x in cEd and casts no weight.
// Peak: the fixed part (parameters 4P, gradients 4P, AdamW 8P, the (B, T) i64 ids and targets) plus
// the largest of three moments:
//   end of forward     autocast weight copies (c x matmul weights), all kept bytes, and the last
//                      block's attention transients (naive: scores and probabilities)
//   start of backward  kept bytes + the logits' gradient c E V
//   a segment's turn   the kept bytes of the earlier blocks, the segment recomputed (its blocks' kept
//                      bytes as the policy below it leaves them: all, selective's, or inputs of the
//                      nested regions plus one block), the largest part a nested selective region adds
//                      back, and the gradients in flight (two residual gradients and the largest of
//                      SwiGLU's 3cEf, naive softmax's 2 c B H T^2, flash's 4cEd)
// Recomputation: a block region reruns the block's forward but w2 (its output is not needed: the
// lazy recompute skips it); a nested segment also reruns all but its last block in full once more;
// selective reruns QK^T (naive) or the flash kernel, and the elementwise ops it recomputes.

// Bytes: a number with an optional K, M, G or T (powers of 1024), alone or with "B" or "iB".
static bool tsys__parse_bytes(const char *s, double *out) {
    if (!s || !((*s >= '0' && *s <= '9') || *s == '.')) return false;   // no sign, no hex, no inf/nan
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v >= 0) || v > 1e18) return false;
    static const char units[] = "KMGT";
    const char *u = *end ? strchr(units, *end) : NULL;
    if (u && *end) { for (int i = 0; i <= u - units; i++) v *= 1024.0; end++; if (*end == 'i') end++; if (*end == 'B') end++; }
    else if (*end == 'B') end++;
    if (*end) return false;
    *out = v;
    return true;
}

static int tsys__isqrt_up(int n) { int k = 1; while (k * k < n) k++; return k; }

TSYSDEF tsys_status tsys_checkpoint_policy_parse(const char *s, int num_layers, tsys_checkpoint_policy *out, char *err, size_t err_len) {
    if (!out) {
        if (err) snprintf(err, err_len, "checkpoint policy: out is NULL");
        return TSYS_ERR_INVALID_ARGS;
    }
    memset(out, 0, sizeof(*out));
    if (!s || !*s || !strcmp(s, "none")) return TSYS_OK;
    int L = num_layers > 0 ? num_layers : 1;
    char buf[64], why[160] = "";
    size_t n = strlen(s);
    if (n >= sizeof(buf)) snprintf(why, sizeof(why), "longer than %d characters", (int)sizeof(buf) - 1);
    else {
        memcpy(buf, s, n + 1);
        char *first = strstr(buf, "+first:");
        if (first && first != buf) {
            const char *num = first + 7;
            int f = (*num && strspn(num, "0123456789") == strlen(num) && strlen(num) < 8) ? atoi(num) : 0;
            if (f < 1 || f > L) snprintf(why, sizeof(why), "+first:N needs N from 1 to num_layers (%d)", L);
            out->first = f == L ? 0 : f;   // every block: the policy without it
            *first = 0;
        }
        char *keep = strstr(buf, "+keep-attn");
        if (keep && keep[10] == 0 && keep != buf) { out->keep_attention = true; *keep = 0; }
        char *plus = strstr(buf, "+selective");
        if (plus && plus[10] == 0 && plus != buf) { out->selective = true; *plus = 0; }
        int k = 0;
        if (!strcmp(buf, "selective") && !out->selective) out->selective = true;
        else if (!strncmp(buf, "blocks:", 7)) {
            if (buf[7] && strspn(buf + 7, "0123456789") == strlen(buf + 7) && strlen(buf + 7) < 8) k = atoi(buf + 7);
            if (k < 1 || k > L)
                snprintf(why, sizeof(why), "blocks:K needs K from 1 to num_layers (%d)", L);
            out->segment = k;
        } else if (!strcmp(buf, "sqrt")) out->segment = tsys__isqrt_up(L);
        else if (!strcmp(buf, "nested") || !strncmp(buf, "nested:", 7)) {
            k = TSYS__MAX(2, tsys__isqrt_up(L));
            if (buf[6] == ':') k = (buf[7] && strspn(buf + 7, "0123456789") == strlen(buf + 7) && strlen(buf + 7) < 8) ? atoi(buf + 7) : -1;
            if (k < 2 || k > L) snprintf(why, sizeof(why), "nested:K needs K from 2 to num_layers (%d) blocks per segment", L);
            out->segment = k; out->inner = 1;
        } else if (!strncmp(buf, "auto:", 5) && !out->selective) {
            if (!tsys__parse_bytes(buf + 5, &out->budget) || out->budget <= 0)
                snprintf(why, sizeof(why), "auto:BYTES needs a positive size such as 40GiB, 512M or 3e10");
        } else snprintf(why, sizeof(why), "unknown policy");
        if (!why[0] && out->keep_attention && (!out->segment || out->selective || out->budget > 0))
            snprintf(why, sizeof(why), "+keep-attn goes with block regions alone (blocks:K, sqrt, nested[:K])");
        if (!why[0] && first && !out->segment)
            snprintf(why, sizeof(why), "+first:N goes with block regions (blocks:K, sqrt, nested[:K], with +selective or +keep-attn)");
    }
    if (!why[0]) return TSYS_OK;
    if (err) snprintf(err, err_len, "checkpoint policy '%s': %s (policies: none, blocks:K, sqrt, nested[:K], selective, blocks:K+selective, sqrt+selective, nested[:K]+selective, P+keep-attn, P+first:N, auto:BYTES)", s, why);
    memset(out, 0, sizeof(*out));
    return TSYS_ERR_INVALID_ARGS;
}

TSYSDEF void tsys_checkpoint_policy_name(const tsys_checkpoint_policy *p, char *buf, size_t len) {
    if (!buf || !len) return;
    if (!p) snprintf(buf, len, "none");
    else if (p->budget > 0) snprintf(buf, len, "auto:%.4gGiB", p->budget / 1073741824.0);
    else if (p->segment) {
        char first[24] = "";
        if (p->first) snprintf(first, sizeof(first), "+first:%d", p->first);
        snprintf(buf, len, "%s:%d%s%s", p->inner ? "nested" : "blocks", p->segment, p->selective ? "+selective" : p->keep_attention ? "+keep-attn" : "", first);
    } else snprintf(buf, len, "%s", p->selective ? "selective" : "none");
}

// The sizes of one step and what a block keeps, part by part (the table above).
typedef struct tsys__acct {
    double E, B, T, d, f, H, V, L, c;
    bool ac, flash, fused;             // fused: desc.fused_loss (the head keeps d x and d w, no logits)
    double x, st, qkv, attn_in, attn_big, o, ffn, ab, s;   // attn_in: q, k, v; attn_big: P (naive) or O + L (flash)
    double full, sel, head, head_fwd, logits_grad;   // head_fwd: the head's most at once in forward
    double ac_block, ac_head;          // autocast copies of a block's matmul weights, of lm_head's
} tsys__acct;

// pure: the model computes in dt throughout (TSYS_PLAN_PURE): the residual stream in dt, no weight cast.
static tsys__acct tsys__acct_make(const tsys_model_desc *d, int64_t B, int64_t T, tsys_dtype dt, bool pure) {
    tsys__acct a;
    memset(&a, 0, sizeof(a));
    a.B = (double)B; a.T = (double)T; a.E = a.B * a.T;
    a.d = d->d_model; a.f = d->d_ff; a.H = d->num_heads; a.V = d->vocab_size; a.L = d->num_layers;
    a.ac = dt == TSYS_BF16 || dt == TSYS_F16;
    a.c = a.ac ? 2.0 : 4.0;
    a.flash = strcmp(d->attn, "flash") == 0;
    double E = a.E, c = a.c;
    a.x = (pure ? c : 4) * E * a.d; a.st = 4 * E;
    a.qkv = a.ac ? c * E * a.d : a.x;   // the norm's output, once for q, k and v (tsys__rmsnorm_to)
    a.attn_in = 3 * c * E * a.d;
    a.attn_big = a.flash ? c * E * a.d + 4 * a.B * a.H * a.T : c * a.B * a.H * a.T * a.T;
    a.o = c * E * a.d;
    a.ffn = a.ac ? c * E * a.d : a.x;
    a.ab = 2 * c * E * a.f; a.s = c * E * a.f;
    a.full = 2 * (a.x + a.st) + a.qkv + a.attn_in + a.attn_big + a.o + a.ffn + a.ab + a.s;
    a.sel = 2 * a.x + a.attn_in + (a.flash ? 0 : a.o) + a.ab;
    a.fused = d->fused_loss;
    const double head_in = a.ac ? c * E * a.d : a.x;   // lm_head's input, or (fused) the d x of the same size
    if (!a.fused) { a.head = a.x + a.st + head_in + c * E * a.V + 4 * E; a.head_fwd = a.head; a.logits_grad = c * E * a.V; }
    else {   // d w (fp32) kept; in forward a chunk's logits and their log-sum-exp at a time
        const double rows = (double)tsys_model_fused_loss_chunk(d, (int64_t)E);
        a.head = a.x + a.st + head_in + 4 * a.V * a.d;
        a.head_fwd = a.head + rows * (c * a.V + 4);
        a.logits_grad = 0;
    }
    a.ac_block = a.ac && !pure ? c * (4 * a.d * a.d + 3 * a.d * a.f) : 0;
    a.ac_head = a.ac && !pure ? c * a.V * a.d : 0;
    return a;
}

// The most a block holds while backward goes through it, its own kept bytes included: first the FFN
// (everything kept, SwiGLU's gradients ds, da, db in flight), then attention (the FFN's and the
// output projection's values are gone; naive: the gradients of the probabilities and the scores,
// flash: dO, dq, dk, dv). Selective: the region being recomputed adds back its part, with the
// low-precision weight copies it casts again. Two residual gradients are in flight throughout.
static double tsys__acct_block_peak(const tsys__acct *a, bool sel) {
    double attn_tr = a->flash ? 4 * a->c * a->E * a->d : 2 * a->attn_big, cc = a->ac ? a->c : 0;
    double ffn_phase, attn_phase;
    if (!sel) {
        ffn_phase = a->full + 3 * a->s;
        attn_phase = a->x + a->st + a->qkv + a->attn_in + a->attn_big + attn_tr;
    } else {
        ffn_phase = a->sel + a->s + cc * a->d * a->f + 3 * a->s;
        double norm2 = a->sel - a->ab + a->st + a->ffn + cc * 2 * a->d * a->f + 2 * a->c * a->E * a->d;
        attn_phase = a->x + a->attn_in + a->attn_big + (a->flash ? a->o + cc * a->d * a->d : 0) + attn_tr;
        double norm1 = a->x + a->st + a->qkv + cc * 3 * a->d * a->d + 3 * a->c * a->E * a->d;
        ffn_phase = TSYS__MAX(ffn_phase, norm2);
        attn_phase = TSYS__MAX(attn_phase, norm1);
    }
    return 2 * a->x + TSYS__MAX(ffn_phase, attn_phase);
}

// Predicted bytes and FLOPs of one policy.
// Bytes of the kept low-precision copies of a model's parameters in dtype size c: each tensor's copy
// starts 256-byte aligned in the optimizer's block (tsys__lowp_align).
static double tsys__kept_copies_bytes(const tsys_model_desc *d, int64_t c) {
    int64_t V = d->vocab_size, D = d->d_model, F = d->d_ff, L = d->num_layers;
    return (double)(2 * (int64_t)tsys__lowp_align((size_t)(V * D * c)) + (2 * L + 1) * (int64_t)tsys__lowp_align((size_t)(D * c))
                    + L * (4 * (int64_t)tsys__lowp_align((size_t)(D * D * c)) + 3 * (int64_t)tsys__lowp_align((size_t)(D * F * c))));
}

static void tsys__plan_fill(const tsys_model_desc *d, const tsys_checkpoint_policy *p, int64_t B, int64_t T, tsys_dtype dt, unsigned how, tsys_checkpoint_plan *out) {
    bool opt = (how & TSYS_PLAN_OPTIMIZER) != 0, free_grads = (how & TSYS_PLAN_FREE_GRADS) != 0;
    tsys__acct a = tsys__acct_make(d, B, T, dt, (how & TSYS_PLAN_PURE) != 0);
    bool kept = (how & TSYS_PLAN_KEPT_COPIES) && opt && a.ac;   // autocast reads the optimizer's copies: no weight is cast in the step
    if (kept) a.ac_block = a.ac_head = 0;
    double P = (double)tsys_model_desc_num_params(d), L = a.L, E = a.E;
    // +first:N: the regions cover F blocks, the U above them keep everything
    int seg = p->segment, cover = seg && p->first ? p->first : d->num_layers, nseg = seg ? (cover + seg - 1) / seg : 0;
    double F = cover, U = L - F;
    memset(out, 0, sizeof(*out));
    out->policy = *p;
    tsys_checkpoint_policy_name(p, out->name, sizeof(out->name));
    out->batch = B; out->context = T; out->dtype = dt; out->optimizer = opt;
    out->block_bytes = a.full;
    bool keep_attn = p->keep_attention && a.flash && seg;   // every covered block's O and LSE stay
    double kept_attn = keep_attn ? F * a.attn_big : 0;
    double kept_blocks = seg ? nseg * a.x + kept_attn + U * a.full : L * (p->selective ? a.sel : a.full);
    out->kept_block_bytes = kept_blocks / L;
    out->kept_bytes = kept_blocks + a.head;
    out->fixed_bytes = 4 * P + (opt ? 8 * P : 0) + 16 * E + (kept ? tsys__kept_copies_bytes(d, (int64_t)a.c) : 0);
    // gradients are made by group as backward reaches it (lm_head and the final norm first, then each
    // layer from the top; tsys__grad_home) and all live at its end and in the optimizer step
    double gw = (how & TSYS_PLAN_LOWP_GRADS) && a.ac ? a.c : 4;   // bytes of a linear weight's gradient element
    double head_grads = gw * a.V * a.d + 4 * a.d, layer_grads = gw * (4 * a.d * a.d + 3 * a.d * a.f) + 4 * 2 * a.d;
    // autocast copies still held after the forward: lm_head's, and every block's outside block regions
    // (selective's regions keep theirs: TSYS_CHECKPOINT_KEEP_WEIGHT_COPIES)
    double ac_held = (a.fused ? 0 : a.ac_head) + (seg ? U : L) * a.ac_block;   // the fused op casts lm_head for its forward alone
    double attn_fwd = a.flash ? 0 : a.c * a.B * a.H * a.T * a.T * ((seg || p->selective) ? 2 : 1);
    double end_fwd = L * a.ac_block + a.ac_head + kept_blocks + TSYS__MAX(a.head_fwd, attn_fwd);
    double start_bwd = ac_held + out->kept_bytes + a.logits_grad + head_grads;
    // a segment's turn: the earlier segments keep their input; in the segment, the blocks before the
    // one backward is in are recomputed (all they keep; nested: only their inputs) and that one peaks
    // Freeing gradients in backward: a layer's are given back when backward leaves it, so a block
    // holds its own alone (the head's are gone once the final norm is done).
    double kept_one = p->selective ? a.sel : a.full, blocks = 0, blocks_free = 0;
    double peak_one = tsys__acct_block_peak(&a, p->selective) + (seg ? a.ac_block : 0);   // a recomputed block casts its weights again
    if (!seg) {
        blocks = (L - 1) * kept_one + peak_one + head_grads + layer_grads;
        blocks_free = blocks - head_grads;
    } else if (U > 0) {   // the top block of those without regions, the covered ones' inputs (and O, L) below
        double below = nseg * a.x + kept_attn + (U - 1) * a.full + tsys__acct_block_peak(&a, false);
        blocks = below + head_grads + layer_grads;
        blocks_free = below + layer_grads;
    }
    for (int s = 0; s < nseg; s++) {   // s segments below; the gradients of the layers above and of this block are made
        double k = TSYS__MIN(seg, cover - s * seg);
        double before = (k - 1) * (p->inner ? a.x : kept_one + (a.ac ? a.ac_block : 0));
        double grads = head_grads + (L - s * seg - k + 1) * layer_grads;
        blocks = TSYS__MAX(blocks, s * a.x + kept_attn + before + peak_one + grads);
        blocks_free = TSYS__MAX(blocks_free, s * a.x + kept_attn + before + peak_one + layer_grads);
    }
    blocks += ac_held - a.ac_head;
    blocks_free += ac_held - a.ac_head;
    double end_bwd = 4 * P - (4 - gw) * (a.V * a.d + L * (4 * a.d * a.d + 3 * a.d * a.f)) + a.x;   // every gradient, and the residual stream's
    double end_bwd_free = 4 * (a.V * a.d) + a.x;   // the embedding's gradients, the last made
    out->peak_bytes = out->fixed_bytes + (free_grads ? TSYS__MAX(TSYS__MAX(end_fwd, end_bwd_free), TSYS__MAX(start_bwd, blocks_free))
                                                     : TSYS__MAX(TSYS__MAX(end_fwd, end_bwd), TSYS__MAX(start_bwd, blocks)));
    // recomputation: matmul FLOPs, and bytes of the elementwise ops rerun
    double gemm = 2 * E * (4 * a.d * a.d + 3 * a.d * a.f), w2 = 2 * E * a.d * a.f, qk = 2 * a.B * a.T * a.T * a.d;
    double norms = 2 * (a.x + (a.ac ? a.c * E * a.d : a.x));   // two norms: the residual read, the matmuls' input written
    double elem_blk = norms + 3 * a.s + (a.flash ? 0 : 2 * a.attn_big) + 6 * a.c * E * a.d;
    double elem_sel = norms + 3 * a.s + (a.flash ? 2 * a.o : 2 * a.attn_big);
    double flops = 0, bytes = 0, attn = keep_attn ? 0 : 2 * qk;   // +keep-attn: the attention forward is not rerun
    double R = seg ? F : L;   // the blocks with regions
    if (seg) { flops += F * (gemm - w2 + attn) + (F - nseg) * w2; bytes += F * elem_blk; }   // a segment's last w2 is not rerun
    if (p->inner) { flops += (F - nseg) * (gemm - w2 + attn); bytes += (F - nseg) * elem_blk; }   // nested: blocks but the last run once more
    if (p->selective) { flops += R * (a.flash ? 2 * qk : qk); bytes += R * elem_sel; }
    out->step_flops = tsys_model_flops(d, B, T, true);
    out->recompute_flops = flops;
    out->recompute_bytes = bytes;
    out->budget = p->budget;
    out->fits = p->budget <= 0 || out->peak_bytes <= p->budget;
}

// The nominal machine the planner ranks policies on: recomputation costs FLOPs / 400 TFLOP/s + bytes / 2 TB/s.
TSYSDEF double tsys_checkpoint_plan_cost(const tsys_checkpoint_plan *p) { return tsys_checkpoint_plan_extra_ms(p, 400.0, 2000.0); }

TSYSDEF void tsys_checkpoint_policy_each(const tsys_model_desc *desc, tsys_checkpoint_policy_fn fn, void *user) {
    const tsys_model_desc d = tsys_model_desc_defaults(desc);
    const int L = d.num_layers;
    const bool flash = d.attn && !strcmp(d.attn, "flash");
    for (int kind = 0; kind < 3; kind++)   // no block regions, blocks, nested
        for (int first = 0; first < (kind == 0 ? 1 : L); first++)
            for (int k = kind; k <= (kind == 0 ? 0 : first ? first : L); k++)
                for (int sel = 0; sel < 3; sel++) {   // none, +selective, +keep-attn (block regions, flash)
                    if (sel == 2 && (kind == 0 || !flash)) continue;
                    tsys_checkpoint_policy p;
                    memset(&p, 0, sizeof(p));
                    p.segment = k; p.inner = kind == 2; p.selective = sel == 1; p.keep_attention = sel == 2; p.first = first;
                    fn(&p, user);
                }
}

TSYSDEF bool tsys_checkpoint_candidate_better(bool fits, double cost, double peak, bool best_fits, double best_cost, double best_peak) {
    if (fits != best_fits) return fits;
    if (!fits) return peak < best_peak;
    return cost < best_cost || (cost == best_cost && peak < best_peak);
}

// auto: tsys_checkpoint_policy_each's policies ranked by tsys_checkpoint_candidate_better on the plan's peak.
typedef struct tsys__auto_search {
    const tsys_model_desc *d;
    double budget;
    int64_t B, T;
    tsys_dtype dt;
    unsigned how;
    bool have;
    tsys_checkpoint_plan best;
} tsys__auto_search;

static void tsys__auto_try(const tsys_checkpoint_policy *p, void *user) {
    tsys__auto_search *s = (tsys__auto_search *)user;
    tsys_checkpoint_plan cand;
    tsys__plan_fill(s->d, p, s->B, s->T, s->dt, s->how, &cand);
    cand.fits = cand.peak_bytes <= s->budget;
    if (!s->have || tsys_checkpoint_candidate_better(cand.fits, tsys_checkpoint_plan_cost(&cand), cand.peak_bytes, s->best.fits,
                                                     tsys_checkpoint_plan_cost(&s->best), s->best.peak_bytes))
        s->best = cand, s->have = true;
}

static void tsys__plan_auto(const tsys_model_desc *d, double budget, int64_t B, int64_t T, tsys_dtype dt, unsigned how, tsys_checkpoint_plan *out) {
    tsys__auto_search s;
    memset(&s, 0, sizeof(s));
    s.d = d; s.budget = budget; s.B = B; s.T = T; s.dt = dt; s.how = how;
    tsys_checkpoint_policy_each(d, tsys__auto_try, &s);
    *out = s.best;
    out->budget = budget;
}

static tsys_status tsys__checkpoint_plan(const tsys_model_desc *desc, const tsys_checkpoint_policy *pol, int64_t B, int64_t T, tsys_dtype dt, unsigned how, tsys_checkpoint_plan *out) {
    tsys_model_desc d = tsys_model_desc_defaults(desc);
    if (B < 1 || T < 1) return TSYS_ERR_INVALID_ARGS;
    if (pol->budget > 0) tsys__plan_auto(&d, pol->budget, B, T, dt, how, out);
    else tsys__plan_fill(&d, pol, B, T, dt, how, out);
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_checkpoint_plan_make(const tsys_model_desc *desc, const char *policy, int64_t batch, int64_t context, tsys_dtype dtype,
                                              bool optimizer, tsys_checkpoint_plan *out, char *err, size_t err_len) {
    return tsys_checkpoint_plan_make_ex(desc, policy, batch, context, dtype, optimizer ? TSYS_PLAN_OPTIMIZER : 0u, out, err, err_len);
}
TSYSDEF tsys_status tsys_checkpoint_plan_make_ex(const tsys_model_desc *desc, const char *policy, int64_t batch, int64_t context, tsys_dtype dtype,
                                                 unsigned flags, tsys_checkpoint_plan *out, char *err, size_t err_len) {
    if (!out) {
        if (err) snprintf(err, err_len, "checkpoint plan: out is NULL");
        return TSYS_ERR_INVALID_ARGS;
    }
    tsys_model_desc d = tsys_model_desc_defaults(desc);
    if (tsys_model_desc_validate(&d, err, err_len) != TSYS_OK) return TSYS_ERR_INVALID_ARGS;
    tsys_checkpoint_policy p;
    if (tsys_checkpoint_policy_parse(policy, d.num_layers, &p, err, err_len) != TSYS_OK) return TSYS_ERR_INVALID_ARGS;
    if (batch < 1 || context < 1) {
        if (err) snprintf(err, err_len, "checkpoint plan: batch %lld and context %lld must be positive", (long long)batch, (long long)context);
        return TSYS_ERR_INVALID_ARGS;
    }
    const unsigned known = TSYS_PLAN_OPTIMIZER | TSYS_PLAN_KEPT_COPIES | TSYS_PLAN_FREE_GRADS | TSYS_PLAN_PURE | TSYS_PLAN_LOWP_GRADS;
    if (flags & ~known) {
        if (err) snprintf(err, err_len, "checkpoint plan: unknown flags 0x%x", flags & ~known);
        return TSYS_ERR_INVALID_ARGS;
    }
    return tsys__checkpoint_plan(&d, &p, batch, context, dtype, flags, out);
}

TSYSDEF double tsys_checkpoint_plan_extra_ms(const tsys_checkpoint_plan *p, double tflops, double gbps) {
    double ms = 0;
    if (!p) return NAN;
    if (tflops > 0) ms += p->recompute_flops / (tflops * 1e12) * 1e3;
    if (gbps > 0) ms += p->recompute_bytes / (gbps * 1e9) * 1e3;
    return ms;
}

TSYSDEF void tsys_checkpoint_plan_print(const tsys_checkpoint_plan *p, FILE *f, double tflops, double gbps) {
    const double MiB = 1048576.0;
    if (!p || !f) return;
    fprintf(f, "checkpoint plan: %s (batch %lld, context %lld, %s%s)%s\n", p->name, (long long)p->batch, (long long)p->context,
            p->dtype == TSYS_F32 ? "fp32" : tsys_dtype_name(p->dtype), p->optimizer ? ", AdamW" : "",
            p->budget > 0 ? (p->fits ? " fits the budget" : " -- nothing fits the budget; this is the smallest peak") : "");
    const tsys_checkpoint_policy *q = &p->policy;
    fprintf(f, "  kept for backward: %.1f MiB per block (%.1f MiB without checkpointing), %.1f MiB in all\n", p->kept_block_bytes / MiB, p->block_bytes / MiB, p->kept_bytes / MiB);
    if (q->segment) fprintf(f, "  recomputed: every %d blocks from their input%s%s\n", q->segment, q->inner ? ", then each block again from its own" : "",
                            q->first ? " (the first blocks only: those above keep everything)" : "");
    if (q->selective) fprintf(f, "  recomputed in every block: the norms and their projections' inputs, the attention core, SwiGLU\n");
    if (!q->segment && !q->selective) fprintf(f, "  recomputed: nothing\n");
    fprintf(f, "  predicted peak %.1f MiB (fixed %.1f MiB%s%.1f MiB); recomputation %.3g GFLOP (+%.1f%% of the step's matmuls)",
            p->peak_bytes / MiB, p->fixed_bytes / MiB, p->budget > 0 ? ", budget " : "", p->budget > 0 ? p->budget / MiB : 0.0,
            p->recompute_flops / 1e9, p->step_flops > 0 ? 100.0 * p->recompute_flops / p->step_flops : 0.0);
    if (tflops > 0 && gbps > 0) fprintf(f, ", about +%.2f ms at %.3g TFLOP/s and %.0f GB/s", tsys_checkpoint_plan_extra_ms(p, tflops, gbps), tflops, gbps);
    fprintf(f, "\n");
}

// >>optimizer -------------------------------------------------------------------------------------

struct tsys_optim {
    tsys_ctx *ctx;
    bool adamw;
    tsys_optim_desc desc;
    tsys_tensor **params;
    int n;
    tsys_tensor *m, *v;             // AdamW state, one block each, in parameter order
    int64_t *state_at;              // AdamW: each parameter's byte offset in m and v (-1: none here, tsys_optim_shard_state)
    tsys_tensor *step_t;            // the step count on the parameters' device (read by the AdamW kernel)
    tsys_tensor *bias_t;            // beside it: the step's bias corrections (STEP_INC writes, AdamW reads; 2 x f32)
    tsys_tensor *lowp;              // kept low-precision copies (tsys_optim_keep_lowp), one block in parameter order, or NULL
    bool *lowp_into;                // tsys_optim_keep_lowp_into: per parameter, whether its copy is the caller's, given (lowp: the
                                    // first, for its dtype); NULL: the copies are in the block
    int64_t step;
    struct tsys__overlap *ov;       // the optimizer in backward (tsys_optim_overlap_begin), made on first use
    tsys_tensor *terms;             // tsys_optim_sum_grads: the other ranks' gradients, or NULL
    int terms_ranks, terms_self;
    int64_t terms_stride;           // bytes a slot: at least every parameter's gradient
    int64_t *terms_at;              // per parameter: its gradient's byte offset in a slot
};

// The end of the run of parameters that starts at i: they and their gradients lie back to back,
// each in one storage (a model's parameters; its gradients by layer, or whole), so one kernel launch
// updates the run. Found at each step: a model's gradients are made (and given back) as it trains.
static bool tsys__optim_fused(const tsys_optim *o, int i);
static int tsys__optim_run_end(const tsys_optim *o, int i, int end, int64_t *numel) {
    tsys_tensor *const *p = o->params;
    *numel = tsys_tensor_numel(p[i]);
    int j = i + 1;
    for (; p[i]->grad && j < end; j++) {
        const tsys_tensor *g = p[j]->grad;
        if (!g || tsys__optim_fused(o, j) || p[j]->storage != p[i]->storage || g->storage != p[i]->grad->storage || g->dtype != p[i]->grad->dtype) break;
        if (p[j]->offset != p[i]->offset + (size_t)*numel * 4 || g->offset != p[i]->grad->offset + (size_t)*numel * tsys_dtype_size(g->dtype)) break;
        if (o->state_at && o->state_at[j] != o->state_at[i] + *numel * 4) break;   // their moments back to back too
        if (o->terms_at && (o->terms_at[i] < 0 ? o->terms_at[j] >= 0 : o->terms_at[j] != o->terms_at[i] + *numel * (int64_t)tsys_dtype_size(g->dtype))) break;   // and terms
        *numel += tsys_tensor_numel(p[j]);
    }
    return j;
}

// A hyper-parameter torch.optim would refuse (and NaN, or infinity, which torch lets through): an error
// naming the optimizer, the field, its value and the rule. `below1`: the rule is [0, 1) (betas), else >= 0.
static bool tsys__hyper_ok(tsys_ctx *ctx, const char *opt, const char *field, float v, bool below1) {
    if (below1 ? (v >= 0.0f && v < 1.0f) : (v >= 0.0f && isfinite(v))) return true;
    TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: %s is %g (it must be %s)", opt, field, (double)v, below1 ? "in [0, 1)" : "a finite number >= 0");
    return false;
}

static tsys_optim *tsys__optim_new(tsys_ctx *ctx, tsys_tensor **params, int n, bool adamw) {
    const char *name = adamw ? "adamw" : "sgd";
    TSYS__CHECK_ARG(ctx, ctx, NULL, "no context");
    TSYS__REQUIRE(ctx, n >= 0, "%s: %d parameters (n must be >= 0)", name, n);
    TSYS__REQUIRE(ctx, params || n == 0, "%s: params is NULL for %d parameters", name, n);
    for (int i = 0; i < n; i++) {
        TSYS__REQUIRE(ctx, params[i] && params[i]->dtype == TSYS_F32, "optimizer: parameter %d ('%s') must be an fp32 tensor", i, params[i] ? params[i]->name : "NULL");
        if (!tsys__owned(ctx, name, params[i])) return NULL;
    }
    tsys_optim *o = (tsys_optim *)TSYS_MALLOC(sizeof(tsys_optim));
    tsys_tensor **list = (tsys_tensor **)TSYS_MALLOC(sizeof(tsys_tensor *) * (size_t)(n ? n : 1));
    if (!o || !list) { TSYS_FREE(o); TSYS_FREE(list); TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the optimizer"); return NULL; }
    memset(o, 0, sizeof(*o));
    list[0] = NULL;
    o->ctx = ctx; o->adamw = adamw; o->params = list; o->n = n;
    for (int i = 0; i < n; i++) list[i] = tsys_tensor_retain(params[i]);
    tsys__ctx_ref(ctx);   // given back by tsys_optim_free
    return o;
}

TSYSDEF tsys_optim *tsys_adamw_new(tsys_ctx *ctx, tsys_tensor **params, int n, const tsys_optim_desc *desc) {
    tsys_optim_desc d;
    memset(&d, 0, sizeof(d));
    if (desc) d = *desc;
    if (!d.lr) d.lr = 1e-3f;
    if (!d.beta1) d.beta1 = 0.9f;
    if (!d.beta2) d.beta2 = 0.999f;
    if (!d.eps) d.eps = 1e-8f;
    if (!d.weight_decay && !d.no_weight_decay) d.weight_decay = 0.01f;
    if (d.no_weight_decay) d.weight_decay = 0.0f;
    if (!tsys__hyper_ok(ctx, "adamw", "lr", d.lr, false) || !tsys__hyper_ok(ctx, "adamw", "beta1", d.beta1, true) ||
        !tsys__hyper_ok(ctx, "adamw", "beta2", d.beta2, true) || !tsys__hyper_ok(ctx, "adamw", "eps", d.eps, false) ||
        !tsys__hyper_ok(ctx, "adamw", "weight_decay", d.weight_decay, false))
        return NULL;
    tsys_optim *o = tsys__optim_new(ctx, params, n, true);
    if (!o) return NULL;
    o->desc = d;
    int64_t total = 0;
    if (!(o->state_at = (int64_t *)TSYS_MALLOC(sizeof(int64_t) * (size_t)(n + 1)))) { tsys_optim_free(o); TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the optimizer"); return NULL; }
    for (int i = 0; i < n; i++) { o->state_at[i] = d.sharded_state ? -1 : total * 4; total += tsys_tensor_numel(params[i]); }
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer state"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_OPTIMIZER);
    tsys_device dev = n ? params[0]->device : TSYS_CPU;
    if (!d.sharded_state) {   // else tsys_optim_shard_state makes them
        o->m = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &total);
        o->v = o->m ? tsys_tensor_new(ctx, TSYS_F32, dev, 1, &total) : NULL;
    }
    // the step count and its bias corrections in one 16-byte block: counted once a step by one kernel, and
    // AdamW's launches read the corrections instead of each thread computing two powers in double
    int64_t one = 1, two = 2, zeros[2] = {0, 0};
    tsys_tensor *counter = o->v || d.sharded_state ? tsys_tensor_from_data(ctx, TSYS_I64, dev, 1, &two, zeros) : NULL;
    o->step_t = counter ? tsys_tensor_view_raw(ctx, counter, 0, TSYS_I64, 1, &one) : NULL;
    o->bias_t = counter ? tsys_tensor_view_raw(ctx, counter, 8, TSYS_F32, 1, &two) : NULL;
    tsys_tensor_release(counter);
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    if (!o->step_t || !o->bias_t || (!d.sharded_state && (tsys_tensor_fill(ctx, o->m, 0.0f) != TSYS_OK || tsys_tensor_fill(ctx, o->v, 0.0f) != TSYS_OK))) {
        tsys_optim_free(o);
        return NULL;
    }
    return o;
}

TSYSDEF tsys_optim *tsys_sgd_new(tsys_ctx *ctx, tsys_tensor **params, int n, float lr) {
    if (!tsys__hyper_ok(ctx, "sgd", "lr", lr, false)) return NULL;
    tsys_optim *o = tsys__optim_new(ctx, params, n, false);
    if (o) o->desc.lr = lr;
    return o;
}

static void tsys__overlap_free(tsys_optim *o);
static void tsys__lowp_drop(tsys_optim *o);
TSYSDEF void tsys_optim_free(tsys_optim *o) {
    if (!o) return;
    tsys__overlap_free(o);
    tsys__lowp_drop(o);
    for (int i = 0; i < o->n; i++) tsys_tensor_release(o->params[i]);
    tsys_tensor_release(o->m); tsys_tensor_release(o->v); tsys_tensor_release(o->step_t); tsys_tensor_release(o->bias_t);
    tsys_tensor_release(o->terms);
    TSYS_FREE(o->terms_at);
    TSYS_FREE(o->state_at);
    TSYS_FREE(o->params);
    tsys_ctx *ctx = o->ctx;
    TSYS_FREE(o);
    tsys__ctx_unref(ctx);   // last: after tsys_ctx_free, this may free the context
}

TSYSDEF void tsys_optim_set_lr(tsys_optim *o, float lr) {
    if (o && tsys__hyper_ok(o->ctx, o->adamw ? "adamw (tsys_optim_set_lr)" : "sgd (tsys_optim_set_lr)", "lr", lr, false)) o->desc.lr = lr;
}
TSYSDEF int64_t tsys_optim_steps(const tsys_optim *o) { return o ? o->step : 0; }   // host count: replayed graphs do not add to it

TSYSDEF tsys_tensor *tsys_optim_state(tsys_optim *o, int param_index, int which) {
    if (!o || !o->adamw || param_index < 0 || param_index >= o->n || o->state_at[param_index] < 0) return NULL;
    tsys_tensor *p = o->params[param_index];
    return tsys_tensor_view_raw(o->ctx, which ? o->v : o->m, (size_t)o->state_at[param_index], TSYS_F32, p->ndim, p->shape);
}

TSYSDEF tsys_status tsys_optim_shard_state(tsys_optim *o, tsys_tensor *const *held, int n) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    if (!o->adamw) return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "tsys_optim_shard_state: only AdamW keeps moments");
    if (o->step > 0) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_shard_state: before the first step (the moments are zero then)");
    TSYS__CHECK_ARG(ctx, n >= 0 && (n == 0 || held), TSYS_ERR_INVALID_ARGS, "tsys_optim_shard_state: %d parameters and %s list", n, held ? "a" : "no");
    bool *mine = (bool *)TSYS_MALLOC((size_t)o->n + 1);
    if (!mine) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "tsys_optim_shard_state: out of host memory");
    memset(mine, 0, (size_t)o->n + 1);
    for (int k = 0; k < n; k++) {
        int at = -1;
        for (int i = 0; held[k] && at < 0 && i < o->n; i++) if (o->params[i] == held[k]) at = i;
        if (at < 0) { TSYS_FREE(mine); return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_shard_state: '%s' is not this optimizer's parameter", held[k] ? held[k]->name : "NULL"); }
        mine[at] = true;
    }
    int64_t total = 0;
    for (int i = 0; i < o->n; i++) total += mine[i] ? tsys_tensor_numel(o->params[i]) : 0;
    const tsys_device dev = o->n ? o->params[0]->device : TSYS_CPU;   // the moments live with the parameters
    tsys_tensor_release(o->m); tsys_tensor_release(o->v);   // zeros (no step yet): given back first, so the whole and the part never coexist
    o->m = o->v = NULL;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer state"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_OPTIMIZER);
    const int64_t room = total ? total : 1;
    tsys_tensor *m = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &room), *v = m ? tsys_tensor_new(ctx, TSYS_F32, dev, 1, &room) : NULL;
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    if (!v || tsys_tensor_fill(ctx, m, 0.0f) != TSYS_OK || tsys_tensor_fill(ctx, v, 0.0f) != TSYS_OK) {   // no moments at all: every update refused
        tsys_tensor_release(m); tsys_tensor_release(v); TSYS_FREE(mine);
        for (int i = 0; i < o->n; i++) o->state_at[i] = -1;
        return ctx->status;
    }
    o->m = m; o->v = v;
    total = 0;
    for (int i = 0; i < o->n; i++) {
        o->state_at[i] = mine[i] ? total * 4 : -1;
        total += mine[i] ? tsys_tensor_numel(o->params[i]) : 0;
    }
    TSYS_FREE(mine);
    return TSYS_OK;
}

static tsys_status tsys__copies_fence(tsys_ctx *ctx);   // >>state

// ---- kept low-precision copies ----
// The params' copies are windows of one block in parameter order, so a run of parameters that one
// AdamW launch updates has its copies back to back too (where each copy's size keeps the next one
// aligned, below), and the launch writes them all.

// Whether parameter i's kept copy is one this optimizer writes: in its block, or given to it (tsys_optim_keep_lowp_into).
static bool tsys__lowp_ours(const tsys_optim *o, int i) {
    const tsys_tensor *c = o->params[i]->lowp;
    return o->lowp && c && (o->lowp_into ? o->lowp_into[i] : c->storage == o->lowp->storage);
}
// The end of the run [i, end) (an update run) whose copies lie back to back (in the block, or in a given storage);
// *numel its elements.
static int tsys__lowp_run_end(const tsys_optim *o, int i, int end, int64_t *numel) {
    tsys_tensor *const *p = o->params;
    *numel = tsys_tensor_numel(p[i]);
    int j = i + 1;
    for (; j < end; j++) {
        const tsys_tensor *a = p[j - 1]->lowp, *b = p[j]->lowp;
        if (!tsys__lowp_ours(o, j - 1) || !tsys__lowp_ours(o, j) || b->storage != a->storage || b->offset != a->offset + tsys_tensor_bytes(a)) break;
        *numel += tsys_tensor_numel(p[j]);
    }
    return j;
}

// Gives each parameter's copy back (those this optimizer made; a parameter keeps another's).
static void tsys__lowp_drop(tsys_optim *o) {
    if (!o->lowp) return;
    for (int i = 0; i < o->n; i++) {
        tsys_tensor *p = o->params[i];
        if (!tsys__lowp_ours(o, i)) continue;
        tsys_tensor_release(p->lowp);
        p->lowp = NULL; p->lowp_of = p->lowp_version = 0;
    }
    tsys_tensor_release(o->lowp);
    o->lowp = NULL;
    TSYS_FREE(o->lowp_into);
    o->lowp_into = NULL;
}

// After one AdamW launch that wrote parameters [first, end) and their copies: their copies are made
// from the storage's new version; the launch moved the whole storage to that version, so the other
// parameters of that storage whose copies were valid before it stay valid (their bytes did not change).
static void tsys__lowp_after_update(tsys_optim *o, int first, int end, uint64_t before) {
    tsys_storage *s = o->params[first]->storage;
    if (s->version != before + 1) return;   // something else wrote it too: the others are stale
    for (int k = 0; k < o->n; k++) {
        tsys_tensor *p = o->params[k];
        if (p->storage != s || !p->lowp) continue;
        bool written = k >= first && k < end && tsys__lowp_ours(o, k), was_valid = p->lowp_of == s->id && p->lowp_version == before;
        if (written || was_valid) tsys__lowp_mark(p);
    }
}

// AdamW's scalars as its kernels take them: f = lr, beta1, beta2, eps, weight decay.
static void tsys__adamw_hyper(const tsys_optim *o, tsys_kargs *a) {
    a->f[0] = o->desc.lr; a->f[1] = o->desc.beta1; a->f[2] = o->desc.beta2; a->f[3] = o->desc.eps; a->f[4] = o->desc.weight_decay;
}

// One update of parameters [p, g, m, v] (m, v NULL for SGD); low: their kept copies, or NULL.
// terms: the other ranks' gradients from this run's place (tsys_optim_sum_grads), or NULL.
static tsys_status tsys__optim_update(tsys_optim *o, tsys_tensor *p, tsys_tensor *g, tsys_tensor *m, tsys_tensor *v, tsys_tensor *low, tsys_tensor *terms) {
    tsys_kargs a = tsys__kargs0();
    a.t[0] = p; a.t[1] = g;
    if (!o->adamw) { a.f[0] = o->desc.lr; return tsys__kernel(o->ctx, p->device, TSYS_K_SGD, &a); }
    a.t[2] = m; a.t[3] = v; a.t[4] = o->step_t; a.t[6] = low; a.t[7] = terms; a.t[8] = o->bias_t;
    a.i[0] = terms ? o->terms_stride / (int64_t)tsys_dtype_size(g->dtype) : 0; a.i[1] = o->terms_ranks; a.i[2] = o->terms_self;
    tsys__adamw_hyper(o, &a);
    return tsys__kernel(o->ctx, p->device, TSYS_K_ADAMW, &a);
}

// Updates parameters [first, end) (off: the byte offset of params[first] in m and v), one launch per
// contiguous run.
// Every parameter of [first, end) that has a gradient has its moments here (tsys_optim_shard_state).
static tsys_status tsys__optim_holds(tsys_optim *o, int first, int end) {
    for (int i = first; o->adamw && i < end; i++)
        if (o->params[i]->grad && o->state_at[i] < 0 && !tsys__optim_fused(o, i))
            return TSYS__FAIL(o->ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_step: '%s' has no moments here (tsys_optim_shard_state gave them to another rank, which "
                              "updates it)", o->params[i]->name);
    return TSYS_OK;
}
static tsys_status tsys__optim_update_range(tsys_optim *o, int first, int end) {
    tsys_ctx *ctx = o->ctx;
    tsys_status st = ctx->status != TSYS_OK ? ctx->status : tsys__optim_holds(o, first, end);   // before any launch
    for (int i = first, j; st == TSYS_OK && i < end; i = j) {
        int64_t n;
        j = tsys__optim_run_end(o, i, end, &n);   // within [first, end): a caller's range may cut a run (tsys_optim_overlap_ready)
        const size_t off = o->adamw ? (size_t)o->state_at[i] : 0;
        bool copies = tsys__lowp_ours(o, i);
        if (copies) j = tsys__lowp_run_end(o, i, j, &n);   // one launch: its copies back to back as well
        tsys_tensor *p0 = o->params[i];
        if (tsys__optim_fused(o, i)) j = i + 1;   // updated in its gradient's product (TSYS_OPTIM_FUSE_UPDATE)
        else if (p0->grad) {   // parameters without a gradient are skipped, as in torch
            const bool summed = o->terms && o->terms_at[i] >= 0;   // its ranks' terms are added as it is read
            if (summed && p0->grad->dtype != tsys_tensor_grad_dtype(p0))
                return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_step: '%s' has a %s gradient where the ranks' terms (tsys_optim_sum_grads) were laid out for %s",
                                  p0->name, tsys_dtype_name(p0->grad->dtype), tsys_dtype_name(tsys_tensor_grad_dtype(p0)));
            bool one = j == i + 1;
            tsys_tensor *p = one ? tsys_tensor_retain(p0) : tsys_tensor_view_raw(ctx, p0, 0, TSYS_F32, 1, &n);
            tsys_tensor *g = one ? tsys_tensor_retain(p0->grad) : tsys_tensor_view_raw(ctx, p0->grad, 0, p0->grad->dtype, 1, &n);
            tsys_tensor *m = NULL, *v = NULL, *low = NULL;
            if (o->adamw) { m = tsys_tensor_view_raw(ctx, o->m, off, TSYS_F32, 1, &n); v = tsys_tensor_view_raw(ctx, o->v, off, TSYS_F32, 1, &n); }
            if (copies) low = tsys_tensor_view_raw(ctx, p0->lowp, 0, o->lowp->dtype, 1, &n);   // the run's copies, back to back
            tsys_tensor *terms = NULL;
            if (summed) {   // slot 0 from this run's place through the last slot's, in its gradients' dtype
                int64_t span = (int64_t)(o->terms_ranks - 2) * (o->terms_stride / (int64_t)tsys_dtype_size(g->dtype)) + n;
                terms = tsys_tensor_view_raw(ctx, o->terms, (size_t)o->terms_at[i], p0->grad->dtype, 1, &span);
            }
            uint64_t before = p0->storage->version;
            st = p && g && (!o->adamw || (m && v)) && (!copies || low) && (!summed || terms) ? tsys__optim_update(o, p, g, m, v, low, terms) : ctx->status;
            if (st == TSYS_OK && low) tsys__lowp_after_update(o, i, j, before);
            tsys_tensor_release(p); tsys_tensor_release(g); tsys_tensor_release(m); tsys_tensor_release(v); tsys_tensor_release(low);
            tsys_tensor_release(terms);
        }
    }
    return st;
}

// The step count first, and its bias corrections (the AdamW kernel reads both on the device).
static tsys_status tsys__optim_count_step(tsys_optim *o) {
    o->step++;
    if (!o->adamw) return TSYS_OK;
    tsys_kargs inc = tsys__kargs0();
    inc.t[0] = o->step_t; inc.t[1] = o->bias_t;
    inc.f[0] = o->desc.beta1; inc.f[1] = o->desc.beta2;
    return tsys__kernel(o->ctx, o->step_t->device, TSYS_K_STEP_INC, &inc);
}

TSYSDEF tsys_status tsys_optim_step(tsys_optim *o) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    if (ctx->status != TSYS_OK) return ctx->status;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer"));
    tsys_status st = tsys__grads_settle(ctx, o->params, o->n);
    if (st == TSYS_OK) st = tsys__copies_fence(ctx);   // an asynchronous snapshot may still be reading them
    if (st == TSYS_OK) st = tsys__optim_holds(o, 0, o->n);   // before the count: a refused step is no step
    if (st == TSYS_OK) st = tsys__optim_count_step(o);
    if (st == TSYS_OK) st = tsys__optim_update_range(o, 0, o->n);
    tsys_mem_set_tag(ctx, tag);
    return st;
}

// ---- the optimizer in backward ----
// Groups: consecutive parameters of one gradient home (a model's layer), or one tensor alone; a
// group is updated when the last of its gradients is final (its grad-ready hooks count down).
typedef struct tsys__overlap {
    int ngroups;
    int *group_of;          // per parameter
    int *first, *end;       // per group: parameters [first, end)
    int *pending;           // per group: gradients not final yet in this backward
    bool *done;             // per group: updated in this step
    tsys_event *ready;      // per group: its gradients are final (recorded on the compute stream)
    tsys_event join;        // the background stream's last update
    bool active, launched;
    bool free_grads;        // TSYS_OPTIM_FREE_GRADS: updates on the compute stream, each group's gradients given back after it
    bool fuse;              // TSYS_OPTIM_FUSE_UPDATE: linear weights updated inside their gradients' products
    bool caller_ready;      // TSYS_OPTIM_CALLER_READY: updates launched by tsys_optim_overlap_ready only
    bool *said;             // per parameter, CALLER_READY: updated in this step
    bool *fused;            // per parameter: updated so in this step (its gradient was never written)
} tsys__overlap;

static bool tsys__optim_fused(const tsys_optim *o, int i) { return o->ov && o->ov->fused && o->ov->fused[i]; }

static void tsys__optim_terms_drop(tsys_optim *o) {
    tsys_tensor_release(o->terms);
    TSYS_FREE(o->terms_at);
    o->terms = NULL; o->terms_at = NULL;
}

// The ranks' terms kept after their checks; given NULL: every gradient's place packed in the optimizer's order.
static tsys_status tsys__optim_terms_set(tsys_optim *o, tsys_tensor *terms, int nranks, int self, int64_t stride_bytes, const int64_t *given, const char *fn) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    if (ctx->status != TSYS_OK) return ctx->status;
    if (!terms) { tsys__optim_terms_drop(o); return TSYS_OK; }
    if (!o->adamw) return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "%s: only AdamW sums ranks' gradients", fn);
    if (o->ov && o->ov->active) return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "%s: the optimizer runs inside backward (tsys_optim_overlap_begin)", fn);
    if (nranks < 2 || self < 0 || self >= nranks)
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: nranks %d and self %d (it must be 2 or more ranks, self one of them)", fn, nranks, self);
    if (given && stride_bytes <= 0) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: stride_bytes %lld (it must be > 0)", fn, (long long)stride_bytes);
    int64_t *at = (int64_t *)TSYS_MALLOC(sizeof(int64_t) * (size_t)(o->n ? o->n : 1)), G = 0, end = 0;
    if (!at) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "%s: out of host memory", fn);
    for (int i = 0; i < o->n; i++) {
        const tsys_tensor *p = o->params[i];
        const int64_t es = (int64_t)tsys_dtype_size(tsys_tensor_grad_dtype(p)), bytes = tsys_tensor_numel(p) * es;
        at[i] = given ? given[i] : G;
        if (at[i] < 0) { at[i] = -1; continue; }
        const char *bad = p->dtype != TSYS_F32 ? "is not fp32"
                          : at[i] % es || (nranks > 2 && stride_bytes % es) ? "would start its gradient's terms off its element size in a slot"
                          : given && at[i] + bytes > stride_bytes ? "would end its terms past the slot" : NULL;
        for (int j = 0; !bad && given && j < i; j++)
            if (at[j] >= 0 && at[j] < at[i] + bytes && at[i] < at[j] + tsys_tensor_numel(o->params[j]) * (int64_t)tsys_dtype_size(tsys_tensor_grad_dtype(o->params[j])))
                bad = "has terms that overlap another parameter's";
        if (bad) {
            const long long place = (long long)at[i];
            TSYS_FREE(at);
            return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "%s: parameter '%s' (%s, %s gradients, at byte %lld of a slot %lld bytes apart) %s", fn, p->name,
                              tsys_dtype_name(p->dtype), tsys_dtype_name(tsys_tensor_grad_dtype(p)), place, (long long)stride_bytes, bad);
        }
        G = at[i] + bytes;
        end = G > end ? G : end;
    }
    if (stride_bytes == 0) stride_bytes = end;
    const char *bad = stride_bytes < end ? "is less than the gradients' bytes"
                      : o->n && terms->device != o->params[0]->device ? "is on another device than the parameters"
                      : (int64_t)tsys_tensor_bytes(terms) < (int64_t)(nranks - 2) * stride_bytes + end ? "holds fewer bytes than the slots" : NULL;
    if (bad) {
        TSYS_FREE(at);
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: terms '%s' (%lld bytes on %s; %d ranks - 1 slots %lld bytes apart of the %lld gradient bytes) %s", fn, terms->name,
                          (long long)tsys_tensor_bytes(terms), tsys__device_name(terms->device), nranks, (long long)stride_bytes, (long long)end, bad);
    }
    tsys__optim_terms_drop(o);
    o->terms = tsys_tensor_retain(terms);
    o->terms_at = at;
    o->terms_ranks = nranks; o->terms_self = self; o->terms_stride = stride_bytes;
    return TSYS_OK;
}
TSYSDEF tsys_status tsys_optim_sum_grads(tsys_optim *o, tsys_tensor *terms, int nranks, int self, int64_t stride_bytes) {
    return tsys__optim_terms_set(o, terms, nranks, self, stride_bytes, NULL, "tsys_optim_sum_grads");
}
TSYSDEF tsys_status tsys_optim_sum_grads_at(tsys_optim *o, tsys_tensor *terms, int nranks, int self, int64_t stride_bytes, const int64_t *at) {
    if (o && terms && !at) return TSYS__FAIL(o->ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_sum_grads_at: no places (at)");
    return tsys__optim_terms_set(o, terms, nranks, self, stride_bytes, at, "tsys_optim_sum_grads_at");
}

static void tsys__overlap_hook(tsys_ctx *ctx, tsys_tensor *param, void *user);
static void tsys__overlap_free(tsys_optim *o) {
    tsys__overlap *ov = o->ov;
    if (!ov) return;
    for (int i = 0; i < o->n; i++) tsys_tensor_remove_grad_hook(o->params[i], tsys__overlap_hook, o);
    for (int g = 0; g < ov->ngroups; g++) tsys_event_release(o->ctx, &ov->ready[g]);
    tsys_event_release(o->ctx, &ov->join);
    TSYS_FREE(ov->group_of); TSYS_FREE(ov->first); TSYS_FREE(ov->end);
    TSYS_FREE(ov->pending); TSYS_FREE(ov->done); TSYS_FREE(ov->ready); TSYS_FREE(ov->fused); TSYS_FREE(ov->said);
    TSYS_FREE(ov);
    o->ov = NULL;
}

// Group g's gradients are final: its update goes on the background stream after them.
// FREE_GRADS: the group's update is queued on the compute stream, so the stream's order keeps its
// gradients' memory from being handed to a later kernel before the update has read them.
static tsys_status tsys__overlap_update_inline(tsys_optim *o, int g) {
    tsys__overlap *ov = o->ov;
    tsys_ctx *ctx = o->ctx;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer"));
    tsys_status st = tsys__optim_update_range(o, ov->first[g], ov->end[g]);
    tsys__grad_home *home = o->params[ov->first[g]]->grad_home;   // a group is one home's run of parameters, or a tensor alone
    if (st == TSYS_OK && home) tsys__grad_home_release(home);
    tsys_mem_set_tag(ctx, tag);
    ov->done[g] = true;
    return st;
}

static tsys_status tsys__overlap_launch(tsys_optim *o, int g) {
    tsys__overlap *ov = o->ov;
    tsys_ctx *ctx = o->ctx;
    if (ov->free_grads) return tsys__overlap_update_inline(o, g);
    tsys_device dev = o->params[ov->first[g]]->device;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer"));
    tsys_status st = tsys_event_record(ctx, dev, TSYS_STREAM_COMPUTE, &ov->ready[g]);
    tsys_stream prev = tsys_set_stream(ctx, dev, TSYS_STREAM_BACKGROUND);
    if (st == TSYS_OK) st = tsys_event_wait(ctx, &ov->ready[g], TSYS_STREAM_BACKGROUND);
    if (st == TSYS_OK) st = tsys__optim_update_range(o, ov->first[g], ov->end[g]);
    tsys_set_stream(ctx, dev, prev);
    tsys_mem_set_tag(ctx, tag);
    ov->done[g] = true;
    ov->launched = true;
    return st;
}

static void tsys__overlap_hook(tsys_ctx *ctx, tsys_tensor *param, void *user) {
    (void)ctx;
    tsys_optim *o = (tsys_optim *)user;
    tsys__overlap *ov = o->ov;
    if (!ov || !ov->active || ov->caller_ready) return;
    for (int i = 0; i < o->n; i++) {
        if (o->params[i] != param) continue;
        int g = ov->group_of[i];
        if (--ov->pending[g] == 0 && !ov->done[g]) tsys__overlap_launch(o, g);
        return;
    }
}

static tsys_status tsys__overlap_setup(tsys_optim *o) {
    tsys_ctx *ctx = o->ctx;
    tsys__overlap *ov = (tsys__overlap *)TSYS_MALLOC(sizeof(tsys__overlap));
    if (!ov) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the optimizer in backward");
    memset(ov, 0, sizeof(*ov));
    o->ov = ov;
    size_t np = (size_t)(o->n ? o->n : 1);
    ov->group_of = (int *)TSYS_MALLOC(np * sizeof(int)); ov->first = (int *)TSYS_MALLOC(np * sizeof(int)); ov->end = (int *)TSYS_MALLOC(np * sizeof(int));
    ov->pending = (int *)TSYS_MALLOC(np * sizeof(int)); ov->done = (bool *)TSYS_MALLOC(np * sizeof(bool));
    ov->ready = (tsys_event *)TSYS_MALLOC(np * sizeof(tsys_event));
    ov->fused = (bool *)TSYS_MALLOC(np * sizeof(bool)); ov->said = (bool *)TSYS_MALLOC(np * sizeof(bool));
    if (!ov->group_of || !ov->first || !ov->end || !ov->pending || !ov->done || !ov->ready || !ov->fused || !ov->said) {
        tsys__overlap_free(o);
        return TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the optimizer in backward");
    }
    memset(ov->ready, 0, np * sizeof(tsys_event));
    memset(ov->fused, 0, np * sizeof(bool));
    memset(ov->said, 0, np * sizeof(bool));
    memset(&ov->join, 0, sizeof(ov->join));
    for (int i = 0; i < o->n; i++) {
        tsys_tensor *p = o->params[i];
        bool joins = i > 0 && p->grad_home && p->grad_home == o->params[i - 1]->grad_home;
        if (!joins) ov->first[ov->ngroups++] = i;
        ov->group_of[i] = ov->ngroups - 1;
        ov->end[ov->ngroups - 1] = i + 1;
        if (tsys_tensor_add_grad_hook(p, tsys__overlap_hook, o) != TSYS_OK) { tsys__overlap_free(o); return ctx->status; }
    }
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_optim_overlap_begin(tsys_optim *o) { return tsys_optim_overlap_begin_ex(o, 0); }
TSYSDEF tsys_status tsys_optim_overlap_begin_ex(tsys_optim *o, unsigned flags) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    if (ctx->status != TSYS_OK) return ctx->status;
    const bool caller = (flags & TSYS_OPTIM_CALLER_READY) != 0;
    if (o->terms && !caller)   // a layer's update would read the peers' gradients before they are all in
        return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "tsys_optim_overlap_begin: the optimizer sums ranks' gradients (tsys_optim_sum_grads); step it after "
                          "backward, or say when they are in (TSYS_OPTIM_CALLER_READY)");
    const unsigned known = TSYS_OPTIM_FREE_GRADS | TSYS_OPTIM_FUSE_UPDATE | TSYS_OPTIM_CALLER_READY;
    if (flags & ~known) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_begin_ex: unknown flags 0x%x", flags & ~known);
    if (caller && (flags & (TSYS_OPTIM_FREE_GRADS | TSYS_OPTIM_FUSE_UPDATE)))
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_begin_ex: TSYS_OPTIM_CALLER_READY goes with neither FREE_GRADS nor FUSE_UPDATE");
    if ((flags & TSYS_OPTIM_FUSE_UPDATE) && !o->adamw)
        return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "tsys_optim_overlap_begin_ex: TSYS_OPTIM_FUSE_UPDATE updates with AdamW; this optimizer is SGD");
    if (!o->ov && tsys__overlap_setup(o) != TSYS_OK) return ctx->status;
    tsys__overlap *ov = o->ov;
    if (ov->active) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_begin: the previous overlap_begin was not ended");
    for (int g = 0; g < ov->ngroups; g++) { ov->pending[g] = ov->end[g] - ov->first[g]; ov->done[g] = false; }
    ov->launched = false;
    ov->free_grads = (flags & TSYS_OPTIM_FREE_GRADS) != 0;
    ov->fuse = (flags & TSYS_OPTIM_FUSE_UPDATE) != 0;   // fused[] is all false here: overlap_end clears it
    ov->caller_ready = caller;
    memset(ov->said, 0, (size_t)o->n * sizeof(bool));
    ov->active = true;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer"));
    tsys_status st = tsys__copies_fence(ctx);   // every update is ordered after it (the background stream's through events)
    if (st == TSYS_OK) st = tsys__optim_count_step(o);   // on the compute stream, before every update
    tsys_mem_set_tag(ctx, tag);
    return st;
}

TSYSDEF tsys_status tsys_optim_overlap_end(tsys_optim *o) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    tsys__overlap *ov = o->ov;
    if (!ov || !ov->active) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_end without tsys_optim_overlap_begin");
    ov->active = false;
    tsys_status st = ctx->status;
    if (st == TSYS_OK && ov->launched && o->n) {   // the compute stream waits for the background stream's updates
        tsys_device dev = o->params[0]->device;
        st = tsys_event_record(ctx, dev, TSYS_STREAM_BACKGROUND, &ov->join);
        if (st == TSYS_OK) st = tsys_event_wait(ctx, &ov->join, TSYS_STREAM_COMPUTE);
    }
    // groups backward did not finish (a parameter it did not reach): as tsys_optim_step would
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer"));
    for (int g = 0; st == TSYS_OK && g < ov->ngroups; g++) {
        if (ov->done[g]) continue;
        st = tsys__grads_settle(ctx, o->params + ov->first[g], ov->end[g] - ov->first[g]);
        if (st == TSYS_OK && ov->free_grads) st = tsys__overlap_update_inline(o, g);
        for (int i = ov->first[g], j; st == TSYS_OK && !ov->free_grads && i < ov->end[g]; i = j) {   // runs not said (CALLER_READY)
            for (j = i + 1; j < ov->end[g] && ov->said[j] == ov->said[i]; j++) {}
            if (!ov->said[i]) st = tsys__optim_update_range(o, i, j);
        }
    }
    tsys_mem_set_tag(ctx, tag);
    memset(ov->fused, 0, (size_t)o->n * sizeof(bool));   // a later tsys_optim_step updates every parameter
    return st;
}

// Parameters [i, j) of o, not yet updated this step, on the background stream after `after`'s work so far.
static tsys_status tsys__overlap_update_said(tsys_optim *o, int i, int j, tsys_stream after) {
    tsys__overlap *ov = o->ov;
    tsys_ctx *ctx = o->ctx;
    const tsys_device dev = o->params[i]->device;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer"));
    tsys_stream prev = tsys_set_stream(ctx, dev, after);
    tsys_status st = tsys__grads_settle(ctx, o->params + i, j - i);   // one that counts as zero gets its zeros first, on `after`
    if (st == TSYS_OK) st = tsys_event_record(ctx, dev, after, &ov->ready[i]);
    tsys_set_stream(ctx, dev, TSYS_STREAM_BACKGROUND);
    if (st == TSYS_OK) st = tsys_event_wait(ctx, &ov->ready[i], TSYS_STREAM_BACKGROUND);
    if (st == TSYS_OK) st = tsys__optim_update_range(o, i, j);
    tsys_set_stream(ctx, dev, prev);
    tsys_mem_set_tag(ctx, tag);
    for (int k = i; k < j; k++) ov->said[k] = true;
    ov->launched = true;
    return st;
}

TSYSDEF tsys_status tsys_optim_overlap_ready(tsys_optim *o, tsys_tensor *const *params, int n, tsys_stream after) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    if (ctx->status != TSYS_OK) return ctx->status;
    tsys__overlap *ov = o->ov;
    if (!ov || !ov->active || !ov->caller_ready)
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_ready: outside tsys_optim_overlap_begin_ex(opt, TSYS_OPTIM_CALLER_READY) ... overlap_end");
    TSYS__CHECK_ARG(ctx, n >= 0 && (n == 0 || params), TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_ready: %d parameters and %s list", n, params ? "a" : "no");
    tsys_status st = TSYS_OK;
    for (int k = 0, i = -1, first = -1; st == TSYS_OK && k <= n; k++) {   // runs of consecutive indices, each one launch group
        int at = -1;
        for (int c = 0; k < n && at < 0 && c < o->n; c++) {   // most lists are in the optimizer's order: look after the last one first
            const int idx = (i + 1 + c) % o->n;
            if (o->params[idx] == params[k]) at = idx;
        }
        if (k < n && at < 0) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_ready: '%s' is not this optimizer's parameter", params[k] ? params[k]->name : "NULL");
        const bool extends = first >= 0 && at == i + 1 && !ov->said[at];
        if (first >= 0 && !extends) st = tsys__overlap_update_said(o, first, i + 1, after);
        if (k < n && !extends) first = ov->said[at] ? -1 : at;
        i = at;
    }
    return st;
}

TSYSDEF tsys_status tsys_optim_overlap_skip(tsys_optim *o, tsys_tensor *const *params, int n) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    if (ctx->status != TSYS_OK) return ctx->status;
    tsys__overlap *ov = o->ov;
    if (!ov || !ov->active || !ov->caller_ready)
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_skip: outside tsys_optim_overlap_begin_ex(opt, TSYS_OPTIM_CALLER_READY) ... overlap_end");
    TSYS__CHECK_ARG(ctx, n >= 0 && (n == 0 || params), TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_skip: %d parameters and %s list", n, params ? "a" : "no");
    for (int k = 0, i = -1; k < n; k++) {
        int at = -1;
        for (int c = 0; at < 0 && c < o->n; c++) {   // lists in the optimizer's order: look after the last one first
            const int idx = (i + 1 + c) % o->n;
            if (o->params[idx] == params[k]) at = idx;
        }
        if (at < 0) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_skip: '%s' is not this optimizer's parameter", params[k] ? params[k]->name : "NULL");
        if (ov->said[at]) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_overlap_skip: '%s' was already updated or skipped this step", params[k]->name);
        ov->said[at] = true;
        i = at;
    }
    return TSYS_OK;
}

// ---- AdamW inside the weight-gradient product (TSYS_OPTIM_FUSE_UPDATE) ----

// The optimizer (in backward, with the flag) that updates `leaf`, and the leaf's index in it; NULL if none.
static tsys_optim *tsys__fusing_optim(const tsys_tensor *leaf, int *index) {
    for (const struct tsys__grad_hook *h = leaf->hooks; h; h = h->next) {
        tsys_optim *o = h->fn == tsys__overlap_hook ? (tsys_optim *)h->user : NULL;
        if (!o || !o->ov || !o->ov->active || !o->ov->fuse) continue;
        for (int i = 0; i < o->n; i++)
            if (o->params[i] == leaf) { *index = i; return o; }
    }
    return NULL;
}

// Linear node n's weight gradient, gy^T x (gy (rows, O) and x (rows, I) of one dtype), as its weight's AdamW
// update, when an optimizer fuses them: this is the weight's last use on the tape and it has no gradient yet
// (so the product makes the whole of it), the weight is fp32 and its gradient f32 or x's dtype. True when the
// update was launched (*st: its status); its group's hook then counts it as a final gradient.
static bool tsys__linear_update_fused(tsys_ctx *ctx, tsys__node *n, tsys_tensor *gy, tsys_tensor *x, tsys_status *st) {
    tsys_tensor *leaf = n->in[1].leaf;
    int i = 0;
    tsys_optim *o = leaf && leaf->hooks && leaf->tape_uses == 1 && (!leaf->grad || leaf->grad_zero) && leaf->dtype == TSYS_F32 && gy && x &&
                    gy->dtype == x->dtype ? tsys__fusing_optim(leaf, &i) : NULL;
    const tsys_dtype gdt = leaf ? tsys_tensor_grad_dtype(leaf) : TSYS_F32;
    if (!o || o->state_at[i] < 0 || (gdt != TSYS_F32 && gdt != x->dtype) || tsys_tensor_numel(leaf) != tsys__last_dim(gy) * tsys__last_dim(x)) return false;
    int64_t numel = tsys_tensor_numel(leaf);
    const bool copies = tsys__lowp_ours(o, i);
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "optimizer"));
    tsys_kargs a = tsys__kargs0();
    a.t[0] = leaf; a.t[3] = copies ? leaf->lowp : NULL; a.t[4] = gy; a.t[5] = x; a.t[6] = o->step_t; a.t[8] = o->bias_t;
    a.t[1] = tsys_tensor_view_raw(ctx, o->m, (size_t)o->state_at[i], TSYS_F32, 1, &numel);
    a.t[2] = tsys_tensor_view_raw(ctx, o->v, (size_t)o->state_at[i], TSYS_F32, 1, &numel);
    a.i[0] = gdt;
    tsys__adamw_hyper(o, &a);
    const uint64_t before = leaf->storage->version;
    *st = a.t[1] && a.t[2] ? tsys__kernel(ctx, leaf->device, TSYS_K_LINEAR_ADAMW, &a) : ctx->status;
    if (*st == TSYS_OK && copies) tsys__lowp_after_update(o, i, i + 1, before);
    tsys_tensor_release(a.t[1]); tsys_tensor_release(a.t[2]);
    tsys_mem_set_tag(ctx, tag);
    o->ov->fused[i] = *st == TSYS_OK;
    leaf->grad_touched = true;   // final: node_free fires its hooks (the group's count) at its last use
    return true;
}

// ---- kept low-precision copies: turning them on and off ----

TSYSDEF tsys_status tsys_optim_keep_lowp(tsys_optim *o, tsys_dtype dt) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    if (ctx->status != TSYS_OK) return ctx->status;
    if (dt != TSYS_F32 && dt != TSYS_BF16 && dt != TSYS_F16)
        return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_keep_lowp: %s is not a low-precision float (bf16 or f16; f32 turns the copies off)", tsys_dtype_name(dt));
    if (dt != TSYS_F32 && !o->adamw) return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "tsys_optim_keep_lowp: only AdamW writes the copies");
    if (o->ov && o->ov->active) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_keep_lowp: not between overlap_begin and overlap_end");
    if (o->lowp && !o->lowp_into && o->lowp->dtype == dt) return TSYS_OK;
    tsys__lowp_drop(o);
    if (dt == TSYS_F32 || o->n == 0) return TSYS_OK;
    size_t es = tsys_dtype_size(dt), bytes = 0;
    for (int i = 0; i < o->n; i++) bytes = tsys__lowp_align(bytes) + (size_t)tsys_tensor_numel(o->params[i]) * es;
    int64_t total = (int64_t)(tsys__lowp_align(bytes) / es);
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "kept weight copies"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_PARAMETERS);   // copies of them, held across steps
    o->lowp = tsys_tensor_new(ctx, dt, o->params[0]->device, 1, &total);
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    size_t off = 0;
    for (int i = 0; o->lowp && i < o->n; i++) {
        tsys_tensor *p = o->params[i];
        off = tsys__lowp_align(off);
        tsys_tensor *c = tsys_tensor_view_raw(ctx, o->lowp, off, dt, p->ndim, p->shape);
        if (!c) { tsys__lowp_drop(o); return ctx->status; }
        tsys_tensor_set_name(c, "%s.%s", p->name, tsys_dtype_name(dt));
        tsys_tensor_release(p->lowp);
        p->lowp = c; p->lowp_of = p->lowp_version = 0;   // made at first use (autocast casts into it), then by each update
        off += tsys_tensor_bytes(c);
    }
    return o->lowp ? TSYS_OK : ctx->status;
}
TSYSDEF tsys_status tsys_optim_keep_lowp_into(tsys_optim *o, tsys_tensor *const *copies) {
    if (!o) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = o->ctx;
    if (ctx->status != TSYS_OK) return ctx->status;
    if (!copies) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_keep_lowp_into: no copies");
    if (!o->adamw) return TSYS__FAIL(ctx, TSYS_ERR_UNSUPPORTED, "tsys_optim_keep_lowp_into: only AdamW writes the copies");
    if (o->ov && o->ov->active) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_keep_lowp_into: not between overlap_begin and overlap_end");
    tsys_tensor *first = NULL;
    for (int i = 0; i < o->n; i++) {
        const tsys_tensor *p = o->params[i], *c = copies[i];
        if (!c) continue;
        const char *bad = c->dtype != TSYS_BF16 && c->dtype != TSYS_F16 ? "is not bf16 or f16"
                          : first && c->dtype != first->dtype ? "has another dtype than the first copy"
                          : tsys_tensor_numel(c) != tsys_tensor_numel(p) ? "has another number of elements"
                          : c->device != p->device ? "is on another device" : NULL;
        if (bad)
            return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_keep_lowp_into: the copy of '%s' ('%s', %s, %lld elements) %s", p->name, c->name, tsys_dtype_name(c->dtype),
                              (long long)tsys_tensor_numel(c), bad);
        if (!first) first = copies[i];
    }
    if (!first) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "tsys_optim_keep_lowp_into: every copy is NULL (tsys_optim_keep_lowp(opt, TSYS_F32) gives copies back)");
    bool *given = (bool *)TSYS_MALLOC(sizeof(bool) * (size_t)o->n);
    if (!given) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "tsys_optim_keep_lowp_into: out of host memory");
    tsys__lowp_drop(o);
    o->lowp = tsys_tensor_retain(first);
    o->lowp_into = given;
    for (int i = 0; i < o->n; i++) {
        tsys_tensor *p = o->params[i];
        given[i] = false;
        if (!copies[i]) continue;
        tsys_tensor *c = tsys_tensor_view_raw(ctx, copies[i], 0, first->dtype, p->ndim, p->shape);
        if (!c) { tsys__lowp_drop(o); return ctx->status; }
        tsys_tensor_set_name(c, "%s.%s", p->name, tsys_dtype_name(first->dtype));
        tsys_tensor_release(p->lowp);
        p->lowp = c; p->lowp_of = p->lowp_version = 0;   // written by each update
        given[i] = true;
    }
    return TSYS_OK;
}
TSYSDEF tsys_dtype tsys_optim_lowp(const tsys_optim *o) { return o && o->lowp ? o->lowp->dtype : TSYS_F32; }

// Marks the gradients as zero without touching memory (like torch's zero_grad(set_to_none=True)):
// the next backward stores its first contribution instead of adding it, a gradient-sized fill and
// read fewer per step. Whatever in tsys reads gradients (optimizers, clipping, loss scaling) fills
// the ones no backward has written since; read .grad yourself only after tsys_grads_settle.
// The parameter lists the gradient utilities take: n (>= 0) tensors, none NULL (checked before any is touched).
static bool tsys__params_ok(tsys_ctx *ctx, const char *fn, tsys_tensor *const *params, int n) {
    if (n < 0 || (n > 0 && !params)) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: %s for %d parameters", fn, params ? "a negative count" : "params is NULL", n); return false; }
    for (int i = 0; i < n; i++)
        if (!params[i]) { TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: parameter %d is NULL", fn, i); return false; }
    return true;
}

TSYSDEF void tsys_zero_grads(tsys_ctx *ctx, tsys_tensor **params, int n) {
    if (!tsys__params_ok(ctx, "tsys_zero_grads", params, n)) return;
    for (int i = 0; i < n; i++)
        if (params[i]->grad) params[i]->grad_zero = true;
}
TSYSDEF tsys_status tsys_grads_settle(tsys_ctx *ctx, tsys_tensor **params, int n) {
    TSYS__CHECK_ARG(ctx, ctx, TSYS_ERR_INVALID_ARGS, "no context");
    if (!tsys__params_ok(ctx, "tsys_grads_settle", params, n)) return TSYS_ERR_INVALID_ARGS;
    return tsys__grads_settle(ctx, params, n);
}
TSYSDEF void tsys_optim_zero_grad(tsys_optim *o) { if (o) tsys_zero_grads(o->ctx, o->params, o->n); }

// torch's zero_grad(set_to_none=True), the memory side: the gradients a model made for its parameters
// (by layer, at backward) are given back, and the next backward makes them again as it reaches each
// layer, so a step's peak does not hold every gradient and every activation at once. Gradients made
// any other way (a tensor's own, DDP's buckets) are marked zero as tsys_zero_grads does.
TSYSDEF void tsys_release_grads(tsys_ctx *ctx, tsys_tensor **params, int n) {
    if (!tsys__params_ok(ctx, "tsys_release_grads", params, n)) return;
    tsys_zero_grads(ctx, params, n);
    for (int i = 0; i < n; i++) if (params[i]->grad_home) tsys__grad_home_release(params[i]->grad_home);
}
TSYSDEF void tsys_optim_release_grads(tsys_optim *o) { if (o) tsys_release_grads(o->ctx, o->params, o->n); }

// Sum over gradients of kernel k's scalar (SUMSQ or NONFINITE), read back once.
static double tsys__grads_reduce(tsys_ctx *ctx, tsys_tensor **params, int n, tsys_kernel k) {
    if (n == 0) return 0.0;
    if (tsys__grads_settle(ctx, params, n) != TSYS_OK) return NAN;
    tsys_tensor *acc = tsys__scalar(ctx, params[0]->device);
    if (!acc || tsys_tensor_fill(ctx, acc, 0.0f) != TSYS_OK) { tsys_tensor_release(acc); return NAN; }
    for (int i = 0; i < n; i++) {
        if (!params[i]->grad) continue;
        tsys_kargs a = tsys__kargs0();
        a.t[0] = acc; a.t[1] = params[i]->grad;
        tsys__kernel(ctx, acc->device, k, &a);
    }
    double v = tsys_item(ctx, acc);
    tsys_tensor_release(acc);
    return v;
}

static void tsys__grads_scale(tsys_ctx *ctx, tsys_tensor **params, int n, float s) {
    for (int i = 0; i < n; i++) {
        if (!params[i]->grad) continue;
        tsys_kargs a = tsys__kargs0();
        a.t[0] = params[i]->grad; a.t[1] = params[i]->grad; a.f[0] = s;
        tsys__kernel(ctx, params[i]->device, TSYS_K_SCALE, &a);
    }
}

// What rescales gradients in place needs them in fp32: kept in bf16 / f16, each would be rounded again.
static bool tsys__grads_fp32(tsys_ctx *ctx, const char *what, tsys_tensor *const *params, int n) {
    for (int i = 0; i < n; i++)
        if (params[i]->grad_lowp != TSYS_F32) {
            TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "%s: '%s' keeps its gradient in %s (tsys_tensor_set_grad_dtype), which rescaling in place would round again; "
                       "keep it in fp32 for this", what, params[i]->name, tsys_dtype_name(params[i]->grad_lowp));
            return false;
        }
    return true;
}

TSYSDEF double tsys_clip_grad_norm(tsys_ctx *ctx, tsys_tensor **params, int n, double max_norm) {
    if (!ctx || !tsys__params_ok(ctx, "tsys_clip_grad_norm", params, n) || !tsys__grads_fp32(ctx, "tsys_clip_grad_norm", params, n)) return NAN;
    double norm = sqrt(tsys__grads_reduce(ctx, params, n, TSYS_K_SUMSQ));
    double coef = max_norm / (norm + 1e-6);
    tsys__grads_scale(ctx, params, n, (float)(coef < 1.0 ? coef : 1.0));   // cs336: applied even when 1
    return norm;
}

TSYSDEF double tsys_cosine_lr(int64_t it, double max_lr, double min_lr, int64_t warmup_iters, int64_t cosine_cycle_iters) {
    if (it < 0 || warmup_iters < 0 || cosine_cycle_iters < warmup_iters || !(max_lr >= 0) || !(min_lr >= 0)) return NAN;   // nonsense (NaN rates too)
    if (it < warmup_iters) return max_lr * (double)it / (double)warmup_iters;
    // at it == cycle the cosine is at its end, min_lr; starting there also leaves no 0/0 when warmup == cycle
    if (it >= cosine_cycle_iters) return min_lr;
    double progress = (double)(it - warmup_iters) / (double)(cosine_cycle_iters - warmup_iters);
    return min_lr + 0.5 * (1.0 + cos(3.141592653589793 * progress)) * (max_lr - min_lr);
}

// >>loss scaling ----------------------------------------------------------------------------------

TSYSDEF tsys_grad_scaler tsys_grad_scaler_init(void) {
    tsys_grad_scaler s;
    memset(&s, 0, sizeof(s));
    s.scale = 65536.0f; s.growth_factor = 2.0f; s.backoff_factor = 0.5f; s.growth_interval = 2000;
    return s;
}

TSYSDEF tsys_tensor *tsys_grad_scaler_scale(tsys_ctx *ctx, tsys_grad_scaler *s, tsys_tensor *loss) {
    TSYS__CHECK_ARG(ctx, s, NULL, "tsys_grad_scaler_scale: the scaler is NULL");
    return tsys_scale(ctx, loss, s->scale);
}

TSYSDEF tsys_status tsys_grad_scaler_unscale(tsys_ctx *ctx, tsys_grad_scaler *s, tsys_tensor **params, int n) {
    TSYS__CHECK_ARG(ctx, ctx && s, TSYS_ERR_INVALID_ARGS, "tsys_grad_scaler_unscale: the scaler is NULL");
    if (!tsys__params_ok(ctx, "tsys_grad_scaler_unscale", params, n) || !tsys__grads_fp32(ctx, "tsys_grad_scaler_unscale", params, n)) return TSYS_ERR_INVALID_ARGS;
    double bad = tsys__grads_reduce(ctx, params, n, TSYS_K_NONFINITE);
    s->found_inf = bad != 0.0;
    if (!s->found_inf) tsys__grads_scale(ctx, params, n, 1.0f / s->scale);
    return ctx->status;
}

TSYSDEF tsys_status tsys_grad_scaler_step(tsys_grad_scaler *s, tsys_optim *opt) {
    if (!opt) return TSYS_ERR_INVALID_ARGS;
    tsys_status st = tsys_grad_scaler_unscale(opt->ctx, s, opt->params, opt->n);
    if (st != TSYS_OK || s->found_inf) return st;   // inf/nan: skip the step, the scale backs off in update
    return tsys_optim_step(opt);
}

TSYSDEF void tsys_grad_scaler_update(tsys_grad_scaler *s) {
    if (!s) return;
    if (s->found_inf) { s->scale *= s->backoff_factor; s->growth_tracker = 0; return; }
    if (++s->growth_tracker == s->growth_interval) { s->scale *= s->growth_factor; s->growth_tracker = 0; }
}

// >>bench -----------------------------------------------------------------------------------------

static int tsys__cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

TSYSDEF tsys_stats tsys_stats_of(const double *x, int n) {
    tsys_stats s;
    memset(&s, 0, sizeof(s));
    s.n = n;
    if (n <= 0 || !x) { s.mean = s.std = s.median = s.min = s.max = NAN; return s; }
    double *sorted = (double *)TSYS_MALLOC(sizeof(double) * (size_t)n), sum = 0, ss = 0;
    for (int i = 0; i < n; i++) sum += x[i];
    s.mean = sum / n;
    for (int i = 0; i < n; i++) ss += (x[i] - s.mean) * (x[i] - s.mean);
    s.std = n > 1 ? sqrt(ss / (n - 1)) : 0.0;   // sample std, as numpy/torch .std()
    if (sorted) {
        memcpy(sorted, x, sizeof(double) * (size_t)n);
        qsort(sorted, (size_t)n, sizeof(double), tsys__cmp_double);
        s.min = sorted[0]; s.max = sorted[n - 1];
        s.median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
        TSYS_FREE(sorted);
    }
    return s;
}

TSYSDEF double tsys_cpu_sgemm_gflops(int n, int reps) {
    size_t sz = (size_t)n * (size_t)n;
    float *a = (float *)TSYS_MALLOC(sz * 4), *b = (float *)TSYS_MALLOC(sz * 4), *c = (float *)TSYS_MALLOC(sz * 4);
    double best = 0;
    if (a && b && c) {
        for (size_t i = 0; i < sz; i++) { a[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f; b[i] = (float)((i * 104729) % 1000) * 1e-3f - 0.5f; }
        for (int r = 0; r <= reps; r++) {   // the first product warms caches and threads, and is not timed
            double t0 = tsys_time_us();
#ifndef TSYS_NO_CBLAS
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
#else
            for (int i = 0; i < n; i++) for (int j = 0; j < n; j++) { float s = 0; for (int k = 0; k < n; k++) s += a[i * n + k] * b[j * n + k]; c[i * n + j] = s; }
#endif
            double dt = (tsys_time_us() - t0) * 1e-6;
            if (r > 0 && 2.0 * n * (double)n * n / dt / 1e9 > best) best = 2.0 * n * (double)n * n / dt / 1e9;
        }
    }
    TSYS_FREE(a); TSYS_FREE(b); TSYS_FREE(c);
    return best;
}

// >>gemm rate -------------------------------------------------------------------------------------

TSYSDEF tsys_stats tsys_gemm_rate(tsys_ctx *ctx, tsys_device dev, tsys_dtype dt, int n, int reps) {
    enum { MAX_REPS = 64 };
    double rate[MAX_REPS];
    int timed = 0;
    if (reps > MAX_REPS) reps = MAX_REPS;
    int64_t shape[2] = {n, n};
    tsys_tensor *a = ctx && n > 0 ? tsys_tensor_new(ctx, dt, dev, 2, shape) : NULL, *b = a ? tsys_tensor_new(ctx, dt, dev, 2, shape) : NULL;
    if (b && tsys_tensor_randn(ctx, a, 1) == TSYS_OK && tsys_tensor_randn(ctx, b, 1) == TSYS_OK) {
        tsys_no_grad_begin(ctx);
        for (int r = 0; r < 2 + reps; r++) {   // the first two warm the library's handles and caches
            tsys_sync(ctx, dev);
            double t0 = tsys_time_us();
            tsys_tensor *c = tsys_matmul(ctx, a, b, false);
            tsys_sync(ctx, dev);
            double s = (tsys_time_us() - t0) * 1e-6;
            if (c && r >= 2 && s > 0) rate[timed++] = 2.0 * n * (double)n * n / s / 1e12;
            tsys_tensor_release(c);
        }
        tsys_no_grad_end(ctx);
    }
    tsys_tensor_release(a); tsys_tensor_release(b);
    if (ctx) tsys_ctx_clear_error(ctx);
    return tsys_stats_of(rate, timed);
}

// >>atomic files ----------------------------------------------------------------------------------
//
// A file is replaced whole or not at all (tsys_atomic_file in >>public). The temporary has a name of
// its own per call, made like mkstemp's (random letters, retried while the name exists), and is
// opened O_CREAT|O_EXCL|O_NOFOLLOW: a file or symlink already there, planted or left by another
// writer, is never opened, so nothing outside the temporary is written. rename() replaces the final
// name atomically; the fsyncs make the new content reach the disk before the name points at it and
// the name itself survive a crash.

#define TSYS__ATOMIC_TMP_SUFFIX ".tmp.XXXXXX"
#define TSYS__ATOMIC_TRIES 100

static tsys_status tsys__atomic_fail(tsys_ctx *ctx, const tsys_atomic_file *af, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return tsys_ctx_set_error(ctx, TSYS_ERR_IO, "%s '%s': %s", af->what, af->path, msg);
}

// Overwrites the XXXXXX at the end of tmp with letters and digits drawn from the clock, the process
// and the call: unpredictable enough that guessing the next name to plant a file there is pointless
// (the exclusive open refuses it anyway), varied enough that concurrent writers rarely collide.
static void tsys__atomic_fill_name(char *tmp, uint64_t *state) {
    static const char letters[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    uint64_t r = tsys__splitmix(state);
    char *x = tmp + strlen(tmp) - 6;
    for (int i = 0; i < 6; i++, r /= 62) x[i] = letters[r % 62];
}

static uint64_t tsys__atomic_seed(const void *salt) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t seed = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    seed ^= (uint64_t)(uintptr_t)salt * 0x9e3779b97f4a7c15ull;
#ifdef TSYS__POSIX
    seed ^= (uint64_t)getpid() << 32;
#endif
    return seed;
}

// Creates the temporary exclusively: a stdio stream on a new file nobody else has opened.
static FILE *tsys__atomic_create(char *tmp, uint64_t *state) {
    for (int attempt = 0; attempt < TSYS__ATOMIC_TRIES; attempt++) {
        tsys__atomic_fill_name(tmp, state);
#ifdef TSYS__POSIX
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd < 0) { if (errno == EEXIST) continue; return NULL; }
        FILE *f = fdopen(fd, "wb");
        if (!f) { int e = errno; close(fd); unlink(tmp); errno = e; }
        return f;
#else
        FILE *f = fopen(tmp, "wbx");   // C11 exclusive mode
        if (f || errno != EEXIST) return f;
#endif
    }
    errno = EEXIST;
    return NULL;
}

TSYSDEF tsys_status tsys_atomic_file_open(tsys_ctx *ctx, const char *what, const char *path, tsys_atomic_file *af) {
    if (!af) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_atomic_file_open: NULL tsys_atomic_file");
    memset(af, 0, sizeof *af);
    af->what = what ? what : "file";
    if (!path || !path[0]) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "%s: empty path", af->what);
    size_t len = strlen(path), suffix = sizeof TSYS__ATOMIC_TMP_SUFFIX;   // with its NUL
    char *names = (char *)TSYS_MALLOC(2 * len + 1 + suffix);
    if (!names) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "%s '%s': out of memory", af->what, path);
    af->path = names;
    af->tmp = names + len + 1;
    memcpy(af->path, path, len + 1);
    memcpy(af->tmp, path, len);
    memcpy(af->tmp + len, TSYS__ATOMIC_TMP_SUFFIX, suffix);
    uint64_t state = tsys__atomic_seed(af);
    af->f = tsys__atomic_create(af->tmp, &state);
    if (af->f) return TSYS_OK;
    tsys_status s = tsys__atomic_fail(ctx, af, "cannot create a temporary file beside it: %s", strerror(errno));
    TSYS_FREE(names);
    memset(af, 0, sizeof *af);
    return s;
}

TSYSDEF void tsys_atomic_file_abort(tsys_atomic_file *af) {
    if (!af || !af->path) return;
    if (af->f) fclose(af->f);
    remove(af->tmp);
    TSYS_FREE(af->path);   // one block with tmp
    memset(af, 0, sizeof *af);
}

// Every byte written (stdio keeps the first error), on the disk, and the stream closed.
static tsys_status tsys__atomic_finish_writes(tsys_ctx *ctx, tsys_atomic_file *af) {
    FILE *f = af->f;
    int e = errno;   // after a failed fwrite/fprintf, its reason (stdio keeps only the error flag)
    af->f = NULL;
    if (!ferror(f)) { errno = 0; if (fflush(f) != 0) e = errno; }
    const char *failed = ferror(f) ? "write failed" : NULL;
#ifdef TSYS__POSIX
    if (!failed && fsync(fileno(f)) != 0) { e = errno; failed = "fsync failed"; }
#endif
    if (fclose(f) != 0 && !failed) { e = errno; failed = "write failed on close"; }
    if (failed) return tsys__atomic_fail(ctx, af, "%s: %s", failed, e ? strerror(e) : "stream error");
    return TSYS_OK;
}

// The directory entry made by rename() survives a crash only once the directory is synced. Some
// file systems cannot sync a directory (EINVAL, ENOTSUP): there the rename is as durable as it gets.
static tsys_status tsys__atomic_sync_dir(tsys_ctx *ctx, tsys_atomic_file *af) {
#ifdef TSYS__POSIX
    char *slash = strrchr(af->path, '/');
    const char *dir = ".";
    if (slash) { *slash = 0; dir = slash == af->path ? "/" : af->path; }
    int fd = open(dir, O_RDONLY | O_CLOEXEC), e = 0;
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP)) e = errno;
    if (fd >= 0) close(fd);
    if (slash) *slash = '/';
    if (e) return tsys__atomic_fail(ctx, af, "the new file is in place, but syncing its directory failed: %s", strerror(e));
#else
    (void)ctx; (void)af;
#endif
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_atomic_file_commit(tsys_ctx *ctx, tsys_atomic_file *af) {
    if (!af || !af->path || !af->f) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_atomic_file_commit: the file is not open");
    tsys_status s = tsys__atomic_finish_writes(ctx, af);
    if (s == TSYS_OK && rename(af->tmp, af->path) != 0)
        s = tsys__atomic_fail(ctx, af, "cannot rename '%s' into place: %s", af->tmp, strerror(errno));
    if (s != TSYS_OK) { tsys_atomic_file_abort(af); return s; }
    s = tsys__atomic_sync_dir(ctx, af);
    TSYS_FREE(af->path);
    memset(af, 0, sizeof *af);
    return s;
}

// >>profiler --------------------------------------------------------------------------------------
// A client of the trace hooks: spans for ops, backward nodes and ranges; a record per kernel launch
// (device time from the device's clock when one is registered, else the launch's host time); the
// live bytes per device after each allocation and free. Names are interned (range names may be
// temporary strings). Growth past what memory allows stops recording and says so in the tables.

#define TSYS__PROF_MAX_DEPTH 64
#define TSYS__PROF_MAX_NAMES 512
#define TSYS__PROF_MAX_PHASES 8

typedef struct tsys__prof_span { int name; tsys_trace_kind kind; double t0, t1; int parent, phase; double self_us, total_us, flops; size_t in_at; int n_in; } tsys__prof_span;
// An op's input as its op_begin hook saw it (ndim -1: left out); a span's inputs lie back to back from in_at.
typedef struct tsys__prof_input { int8_t dtype, ndim; int64_t shape[TSYS_MAX_DIMS]; } tsys__prof_input;
typedef struct tsys__prof_kernel { uint64_t seq; int name; tsys_device dev; double t0, t1, dev_t0, dev_us, flops; int span, phase; bool gemm, timed; } tsys__prof_kernel;
typedef struct tsys__prof_mem { double t; int64_t live[TSYS_DEVICE_COUNT], cached[TSYS_DEVICE_COUNT]; } tsys__prof_mem;

struct tsys_profiler {
    tsys_ctx *ctx;
    tsys_trace_hooks prev;
    double t0;
    char *names[TSYS__PROF_MAX_NAMES];
    const char *name_ptr[TSYS__PROF_MAX_NAMES];   // the pointer last seen for each name: a cheap first test
    int num_names;
    int phases[TSYS__PROF_MAX_PHASES];            // name ids; index = phase id
    int num_phases;
    int phase, phase_span;                        // the open phase (-1 none) and the range that opened it
    tsys__prof_span *spans; size_t num_spans, cap_spans;
    tsys__prof_kernel *kernels; size_t num_kernels, cap_kernels;
    tsys__prof_mem *mem; size_t num_mem, cap_mem;
    tsys__prof_input *ins; size_t num_ins, cap_ins;
    int open[TSYS__PROF_MAX_DEPTH];
    int depth;
    void *clock_state[TSYS_DEVICE_COUNT];
    bool truncated, ended;
};

TSYSDEF void tsys_profiler_set_device_clock(tsys_ctx *ctx, tsys_device dev, const tsys_profiler_device_clock *clock) {
    if (!ctx || !tsys__device_ok(ctx, "tsys_profiler_set_device_clock", dev)) return;
    if (clock) ctx->clocks[dev] = *clock;
    else memset(&ctx->clocks[dev], 0, sizeof(ctx->clocks[dev]));
}

static int tsys__prof_name(tsys_profiler *p, const char *name) {
    for (int i = 0; i < p->num_names; i++)
        if (p->name_ptr[i] == name || strcmp(p->names[i], name) == 0) { p->name_ptr[i] = name; return i; }
    size_t n = strlen(name) + 1;
    char *copy = p->num_names < TSYS__PROF_MAX_NAMES ? (char *)TSYS_MALLOC(n) : NULL;
    if (!copy) { p->truncated = true; return 0; }
    memcpy(copy, name, n);
    p->names[p->num_names] = copy; p->name_ptr[p->num_names] = name;
    return p->num_names++;
}

// Room for one more element of an array that grows by doubling; false (and the profile marked
// truncated) when the host has no memory for it.
static bool tsys__prof_grow(tsys_profiler *p, void **arr, size_t *cap, size_t len, size_t elem) {
    if (len < *cap) return true;
    size_t c = *cap ? 2 * *cap : 1024;
    void *a = TSYS_REALLOC(*arr, c * elem);
    if (!a) { p->truncated = true; return false; }
    *arr = a; *cap = c;
    return true;
}

static void tsys__prof_on_op_begin(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    tsys_profiler *p = (tsys_profiler *)user;
    if (p->prev.op_begin) p->prev.op_begin(ctx, name, kind, p->prev.user);
    if (p->depth == TSYS__PROF_MAX_DEPTH || !tsys__prof_grow(p, (void **)&p->spans, &p->cap_spans, p->num_spans, sizeof(tsys__prof_span))) {
        if (p->depth < TSYS__PROF_MAX_DEPTH) p->open[p->depth] = -1;   // no span: op_end and kernels skip it
        p->depth++;   // still balanced with op_end
        return;
    }
    int id = (int)p->num_spans++;
    tsys__prof_span *sp = &p->spans[id];
    memset(sp, 0, sizeof(*sp));
    sp->name = tsys__prof_name(p, name); sp->kind = kind; sp->t0 = tsys_time_us() - p->t0;
    sp->parent = p->depth ? p->open[p->depth - 1] : -1;
    if (kind == TSYS_TRACE_RANGE && p->phase < 0) {   // the outermost range names the phase
        int ph = 0;
        while (ph < p->num_phases && p->phases[ph] != sp->name) ph++;
        if (ph == p->num_phases && ph < TSYS__PROF_MAX_PHASES) p->phases[p->num_phases++] = sp->name;
        if (ph < p->num_phases) { p->phase = ph; p->phase_span = id; }
    }
    sp->phase = p->phase;
    sp->in_at = p->num_ins;
    for (int i = 0, n = tsys_trace_num_inputs(ctx); i < n && (kind == TSYS_TRACE_FORWARD || kind == TSYS_TRACE_BACKWARD); i++) {
        if (!tsys__prof_grow(p, (void **)&p->ins, &p->cap_ins, p->num_ins, sizeof(tsys__prof_input))) break;
        tsys__prof_input *in = &p->ins[p->num_ins++];
        tsys_dtype dt = TSYS_F32;
        int nd = -1;
        memset(in, 0, sizeof(*in));
        if (!tsys_trace_input(ctx, i, &dt, &nd, in->shape)) nd = -1;
        in->dtype = (int8_t)dt; in->ndim = (int8_t)nd;
        sp->n_in++;
    }
    p->open[p->depth++] = id;
}

static void tsys__prof_on_op_end(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    tsys_profiler *p = (tsys_profiler *)user;
    if (p->depth > 0) {
        p->depth--;
        if (p->depth < TSYS__PROF_MAX_DEPTH && p->open[p->depth] >= 0 && (size_t)p->open[p->depth] < p->num_spans) {
            int id = p->open[p->depth];
            p->spans[id].t1 = tsys_time_us() - p->t0;
            if (id == p->phase_span) { p->phase = -1; p->phase_span = -1; }
        }
    }
    if (p->prev.op_end) p->prev.op_end(ctx, name, kind, p->prev.user);
}

static void tsys__prof_on_kernel_begin(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    tsys_profiler *p = (tsys_profiler *)user;
    if (p->prev.kernel_begin) p->prev.kernel_begin(ctx, k, p->prev.user);
    if (ctx->clocks[k->device].launch) ctx->clocks[k->device].launch(p->clock_state[k->device], k->seq, true);
}

static void tsys__prof_on_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    tsys_profiler *p = (tsys_profiler *)user;
    if (ctx->clocks[k->device].launch) ctx->clocks[k->device].launch(p->clock_state[k->device], k->seq, false);
    if (p->prev.kernel) p->prev.kernel(ctx, k, p->prev.user);
    if (k->status != TSYS_OK || !tsys__prof_grow(p, (void **)&p->kernels, &p->cap_kernels, p->num_kernels, sizeof(tsys__prof_kernel))) return;
    tsys__prof_kernel *r = &p->kernels[p->num_kernels++];
    r->seq = k->seq; r->name = tsys__prof_name(p, k->name); r->dev = k->device;
    r->t0 = k->t_begin_us - p->t0; r->t1 = k->t_end_us - p->t0;
    r->dev_t0 = r->t0; r->dev_us = r->t1 - r->t0;   // until a device clock says otherwise
    r->span = p->depth > 0 && p->depth <= TSYS__PROF_MAX_DEPTH ? p->open[p->depth - 1] : -1;
    r->phase = p->phase;
    r->gemm = k->gemm != NULL; r->timed = false;
    r->flops = k->gemm ? 2.0 * (double)k->gemm->m * (double)k->gemm->n * (double)k->gemm->k * (double)k->gemm->batch : 0.0;
}

static void tsys__prof_on_mem(tsys_ctx *ctx, const tsys_mem_event *e, void *user) {
    tsys_profiler *p = (tsys_profiler *)user;
    if (p->prev.mem) p->prev.mem(ctx, e, p->prev.user);
    if (!tsys__prof_grow(p, (void **)&p->mem, &p->cap_mem, p->num_mem, sizeof(tsys__prof_mem))) return;
    tsys__prof_mem *m = &p->mem[p->num_mem++];
    m->t = tsys_time_us() - p->t0;
    for (int d = 0; d < TSYS_DEVICE_COUNT; d++) m->live[d] = ctx->mem.dev[d].live_bytes;
    for (int d = 0; d < TSYS_DEVICE_COUNT; d++) m->cached[d] = d == (int)e->device ? e->cached : (m > p->mem ? m[-1].cached[d] : 0);
}

TSYSDEF tsys_profiler *tsys_profiler_begin(tsys_ctx *ctx) {
    if (!ctx) return NULL;
    tsys_profiler *p = (tsys_profiler *)TSYS_MALLOC(sizeof(tsys_profiler));
    if (!p) { TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the profiler"); return NULL; }
    memset(p, 0, sizeof(*p));
    p->ctx = ctx; p->phase = -1; p->phase_span = -1;
    for (int d = 0; d < TSYS_DEVICE_COUNT; d++)
        if (ctx->backends[d] && ctx->clocks[d].begin) p->clock_state[d] = ctx->clocks[d].begin(ctx);
    tsys_trace_hooks h = {tsys__prof_on_op_begin, tsys__prof_on_op_end, tsys__prof_on_kernel, tsys__prof_on_mem, p, tsys__prof_on_kernel_begin};
    p->t0 = tsys_time_us();
    p->prev = tsys_ctx_set_trace_hooks(ctx, &h);
    return p;
}

static void tsys__prof_put_device_time(void *user, uint64_t seq, double start_us, double dur_us) {
    tsys_profiler *p = (tsys_profiler *)user;
    size_t lo = 0, hi = p->num_kernels;   // kernels are recorded in launch order
    while (lo < hi) { size_t mid = (lo + hi) / 2; if (p->kernels[mid].seq < seq) lo = mid + 1; else hi = mid; }
    if (lo == p->num_kernels || p->kernels[lo].seq != seq) return;
    tsys__prof_kernel *k = &p->kernels[lo];
    // one tsys launch may be several device kernels (a sort, a multi-pass kernel): their times add up
    double t0 = start_us < 0 ? k->dev_t0 : start_us - p->t0;
    if (!k->timed) { k->timed = true; k->dev_t0 = t0; k->dev_us = dur_us; return; }
    k->dev_t0 = TSYS__MIN(k->dev_t0, t0);
    k->dev_us += dur_us;
}

TSYSDEF tsys_status tsys_profiler_end(tsys_profiler *p) {
    if (!p) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = p->ctx;
    if (p->ended) return TSYS_OK;
    p->ended = true;
    tsys_status st = TSYS_OK;
    for (int d = 0; d < TSYS_DEVICE_COUNT; d++) if (ctx->backends[d] && tsys_sync(ctx, (tsys_device)d) != TSYS_OK) st = ctx->status;
    tsys_ctx_set_trace_hooks(ctx, &p->prev);
    for (int d = 0; d < TSYS_DEVICE_COUNT; d++) {
        if (!p->clock_state[d]) continue;
        if (ctx->clocks[d].collect && ctx->clocks[d].collect(p->clock_state[d], tsys__prof_put_device_time, p) != TSYS_OK) st = ctx->status;
        if (ctx->clocks[d].end) ctx->clocks[d].end(p->clock_state[d]);
        p->clock_state[d] = NULL;
    }
    // self and total device time per span: a kernel counts for its innermost span (self) and for
    // every span around it (total)
    for (size_t i = 0; i < p->num_kernels; i++) {
        tsys__prof_kernel *k = &p->kernels[i];
        if (k->span < 0) continue;
        p->spans[k->span].self_us += k->dev_us;
        for (int s = k->span; s >= 0; s = p->spans[s].parent) { p->spans[s].total_us += k->dev_us; p->spans[s].flops += k->flops; }
    }
    return st;
}

TSYSDEF void tsys_profiler_free(tsys_profiler *p) {
    if (!p) return;
    if (!p->ended) tsys_profiler_end(p);
    for (int i = 0; i < p->num_names; i++) TSYS_FREE(p->names[i]);
    TSYS_FREE(p->spans); TSYS_FREE(p->kernels); TSYS_FREE(p->mem); TSYS_FREE(p->ins);
    TSYS_FREE(p);
}

static bool tsys__prof_in_phase(const tsys_profiler *p, const tsys__prof_kernel *k, const char *phase) {
    return !phase || (k->phase >= 0 && strcmp(p->names[p->phases[k->phase]], phase) == 0);
}
TSYSDEF double tsys_profiler_kernel_ms(const tsys_profiler *p, const char *phase) {
    double us = 0;
    for (size_t i = 0; p && i < p->num_kernels; i++) if (tsys__prof_in_phase(p, &p->kernels[i], phase)) us += p->kernels[i].dev_us;
    return us * 1e-3;
}
TSYSDEF double tsys_profiler_matmul_ms(const tsys_profiler *p, const char *phase) {
    double us = 0;
    for (size_t i = 0; p && i < p->num_kernels; i++) if (p->kernels[i].gemm && tsys__prof_in_phase(p, &p->kernels[i], phase)) us += p->kernels[i].dev_us;
    return us * 1e-3;
}
TSYSDEF double tsys_profiler_span_ms(const tsys_profiler *p, const char *name) {
    double us = 0;
    for (size_t i = 0; p && name && i < p->num_spans; i++) if (strcmp(p->names[p->spans[i].name], name) == 0) us += p->spans[i].total_us;
    return us * 1e-3;
}
TSYSDEF const char *tsys_profiler_top_kernel(const tsys_profiler *p, const char *phase, int matmul, double *ms, int *calls) {
    double us[TSYS__PROF_MAX_NAMES];
    int n[TSYS__PROF_MAX_NAMES], best = -1;
    memset(us, 0, sizeof(us)); memset(n, 0, sizeof(n));
    for (size_t i = 0; p && i < p->num_kernels; i++) {
        const tsys__prof_kernel *k = &p->kernels[i];
        if ((matmul >= 0 && k->gemm != (matmul == 1)) || !tsys__prof_in_phase(p, k, phase)) continue;
        us[k->name] += k->dev_us; n[k->name]++;
        if (best < 0 || us[k->name] > us[best]) best = k->name;
    }
    if (ms) *ms = best >= 0 ? us[best] * 1e-3 : 0.0;
    if (calls) *calls = best >= 0 ? n[best] : 0;
    return best >= 0 ? p->names[best] : NULL;
}

TSYSDEF int tsys_profiler_op_calls(const tsys_profiler *p, const char *name, tsys_trace_kind kind) {
    int n = 0;
    for (size_t i = 0; p && name && i < p->num_spans; i++) n += p->spans[i].kind == kind && strcmp(p->names[p->spans[i].name], name) == 0;
    return n;
}

// One row of a table: what is summed over the spans or kernels of one key.
typedef struct tsys__prof_row { int name, kind, calls; double self_us, total_us, host_us, flops, min_us, max_us, phase_us[TSYS__PROF_MAX_PHASES + 1]; bool gemm; } tsys__prof_row;

static int tsys__prof_row_cmp(const void *a, const void *b) {
    const tsys__prof_row *x = (const tsys__prof_row *)a, *y = (const tsys__prof_row *)b;
    double kx = x->self_us > 0 ? x->self_us : x->total_us, ky = y->self_us > 0 ? y->self_us : y->total_us;
    return (kx < ky) - (kx > ky);
}

static tsys__prof_row *tsys__prof_row_for(tsys__prof_row *rows, int *n, int name, int kind) {
    for (int i = 0; i < *n; i++) if (rows[i].name == name && rows[i].kind == kind) return &rows[i];
    tsys__prof_row *r = &rows[(*n)++];
    memset(r, 0, sizeof(*r));
    r->name = name; r->kind = kind; r->min_us = INFINITY;
    return r;
}

static const char *tsys__prof_kind_suffix(int kind) { return kind == TSYS_TRACE_BACKWARD ? " (backward)" : kind == TSYS_TRACE_RANGE ? " [range]" : kind == TSYS_TRACE_REGION ? " [region]" : ""; }

TSYSDEF void tsys_profiler_print_ops(const tsys_profiler *p, FILE *f, int max_rows) {
    if (!p || !f) return;
    int cap = 3 * TSYS__PROF_MAX_NAMES, n = 0;
    tsys__prof_row *rows = (tsys__prof_row *)TSYS_MALLOC(sizeof(tsys__prof_row) * (size_t)cap);
    if (!rows) return;
    double all_us = tsys_profiler_kernel_ms(p, NULL) * 1e3;
    for (size_t i = 0; i < p->num_spans; i++) {
        const tsys__prof_span *sp = &p->spans[i];
        tsys__prof_row *r = tsys__prof_row_for(rows, &n, sp->name, sp->kind);
        r->calls++; r->self_us += sp->self_us; r->total_us += sp->total_us; r->host_us += sp->t1 - sp->t0; r->flops += sp->flops;
    }
    qsort(rows, (size_t)n, sizeof(*rows), tsys__prof_row_cmp);
    // FLOP rates in TFLOP/s when a GPU ran the matmuls, in GFLOP/s when only the CPU did (where TFLOP/s reads 0.0)
    bool tera = false;
    for (size_t i = 0; i < p->num_kernels && !tera; i++) tera = p->kernels[i].flops > 0 && p->kernels[i].dev != TSYS_CPU;
    fprintf(f, "| name | calls | self device ms | self %% | total device ms | avg device ms | host ms | %s |\n|---|---:|---:|---:|---:|---:|---:|---:|\n", tera ? "TFLOP/s" : "GFLOP/s");
    for (int i = 0; i < n && (max_rows <= 0 || i < max_rows); i++) {
        const tsys__prof_row *r = &rows[i];
        char tf[32] = "";
        if (r->flops > 0 && r->total_us > 0) snprintf(tf, sizeof(tf), "%.1f", r->flops / r->total_us * (tera ? 1e-6 : 1e-3));
        fprintf(f, "| %s%s | %d | %.3f | %.1f%% | %.3f | %.4f | %.3f | %s |\n", p->names[r->name], tsys__prof_kind_suffix(r->kind), r->calls,
                r->self_us * 1e-3, all_us > 0 ? 100.0 * r->self_us / all_us : 0.0, r->total_us * 1e-3, r->total_us * 1e-3 / r->calls, r->host_us * 1e-3, tf);
    }
    fprintf(f, "\n%zu ops, %zu kernel launches, %.3f ms of kernel time%s\n", p->num_spans, p->num_kernels, all_us * 1e-3,
            p->truncated ? " (TRUNCATED: the host ran out of memory for the profile)" : "");
    TSYS_FREE(rows);
}

TSYSDEF void tsys_profiler_print_kernels(const tsys_profiler *p, FILE *f, int max_rows) {
    if (!p || !f) return;
    int n = 0;
    tsys__prof_row *rows = (tsys__prof_row *)TSYS_MALLOC(sizeof(tsys__prof_row) * TSYS__PROF_MAX_NAMES * 2);
    if (!rows) return;
    double all_us = 0, matmul_us = 0;
    for (size_t i = 0; i < p->num_kernels; i++) {
        const tsys__prof_kernel *k = &p->kernels[i];
        tsys__prof_row *r = tsys__prof_row_for(rows, &n, k->name, (int)k->dev);
        r->calls++; r->self_us += k->dev_us; r->flops += k->flops; r->gemm = k->gemm;
        r->min_us = TSYS__MIN(r->min_us, k->dev_us); r->max_us = TSYS__MAX(r->max_us, k->dev_us);
        r->phase_us[k->phase >= 0 ? k->phase : TSYS__PROF_MAX_PHASES] += k->dev_us;
        all_us += k->dev_us;
        if (k->gemm) matmul_us += k->dev_us;
    }
    qsort(rows, (size_t)n, sizeof(*rows), tsys__prof_row_cmp);
    fprintf(f, "| kernel | device | matmul | instances | total ms | %% | avg us | min us | max us |");
    for (int ph = 0; ph < p->num_phases; ph++) fprintf(f, " %s ms |", p->names[p->phases[ph]]);
    fprintf(f, " other ms |\n|---|---|---|---:|---:|---:|---:|---:|---:|");
    for (int ph = 0; ph <= p->num_phases; ph++) fprintf(f, "---:|");
    fprintf(f, "\n");
    for (int i = 0; i < n && (max_rows <= 0 || i < max_rows); i++) {
        const tsys__prof_row *r = &rows[i];
        fprintf(f, "| %s | %s | %s | %d | %.3f | %.1f%% | %.1f | %.1f | %.1f |", p->names[r->name], r->kind == TSYS_CUDA ? "cuda" : "cpu", r->gemm ? "yes" : "no",
                r->calls, r->self_us * 1e-3, all_us > 0 ? 100.0 * r->self_us / all_us : 0.0, r->self_us / r->calls, r->min_us, r->max_us);
        for (int ph = 0; ph < p->num_phases; ph++) fprintf(f, " %.3f |", r->phase_us[ph] * 1e-3);
        fprintf(f, " %.3f |\n", r->phase_us[TSYS__PROF_MAX_PHASES] * 1e-3);
    }
    fprintf(f, "\nkernel time %.3f ms: matmuls %.3f ms (%.1f%%), everything else %.3f ms\n", all_us * 1e-3, matmul_us * 1e-3,
            all_us > 0 ? 100.0 * matmul_us / all_us : 0.0, (all_us - matmul_us) * 1e-3);
    TSYS_FREE(rows);
}

static void tsys__json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

// Chrome trace event format: host spans on pid 1 (nested X events; an op's carry its inputs' shapes
// and dtypes as args "Input Dims" and "Input type", PyTorch's names), kernels on pid 2 with one track
// per device, a flow from each op to every kernel it launched (a "s" event on the op at the launch,
// a "f" event binding to the enclosing kernel slice, sharing an id and the category "ac2g" as
// Kineto's), live bytes as counters; timestamps in microseconds from tsys_profiler_begin.
// The file is replaced whole (tsys_atomic_file), never written in place through whatever is there.
TSYSDEF tsys_status tsys_profiler_write_trace(const tsys_profiler *p, const char *path) {
    if (!p) return TSYS_ERR_INVALID_ARGS;
    if (!path) return TSYS__FAIL(p->ctx, TSYS_ERR_INVALID_ARGS, "profiler trace: path is NULL");
    tsys_atomic_file af;
    tsys_status s = tsys_atomic_file_open(p->ctx, "profiler trace", path, &af);
    if (s != TSYS_OK) return s;
    FILE *f = af.f;
    fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    fprintf(f, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"args\": {\"name\": \"host\"}},\n");
    fprintf(f, "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 2, \"args\": {\"name\": \"device kernels\"}}");
    for (size_t i = 0; i < p->num_spans; i++) {
        const tsys__prof_span *sp = &p->spans[i];
        fprintf(f, ",\n{\"name\": ");
        tsys__json_str(f, p->names[sp->name]);
        fprintf(f, ", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": 1, \"tid\": 1",
                sp->kind == TSYS_TRACE_RANGE ? "range" : sp->kind == TSYS_TRACE_REGION ? "region" : sp->kind == TSYS_TRACE_BACKWARD ? "backward" : "op", sp->t0, sp->t1 - sp->t0);
        if (sp->n_in > 0) {   // a left-out input: [] and "" (as PyTorch writes an absent tensor)
            const tsys__prof_input *in = &p->ins[sp->in_at];
            fprintf(f, ", \"args\": {\"Input Dims\": [");
            for (int j = 0; j < sp->n_in; j++) {
                fprintf(f, "%s[", j ? ", " : "");
                for (int d = 0; d < in[j].ndim; d++) fprintf(f, "%s%lld", d ? ", " : "", (long long)in[j].shape[d]);
                fprintf(f, "]");
            }
            fprintf(f, "], \"Input type\": [");
            for (int j = 0; j < sp->n_in; j++) fprintf(f, "%s\"%s\"", j ? ", " : "", in[j].ndim >= 0 ? tsys_dtype_name((tsys_dtype)in[j].dtype) : "");
            fprintf(f, "]}");
        }
        fprintf(f, "}");
    }
    for (size_t i = 0; i < p->num_kernels; i++) {
        const tsys__prof_kernel *k = &p->kernels[i];
        fprintf(f, ",\n{\"name\": ");
        tsys__json_str(f, p->names[k->name]);
        fprintf(f, ", \"cat\": \"kernel\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, \"pid\": 2, \"tid\": %d, \"args\": {\"op\": ", k->dev_t0, k->dev_us, (int)k->dev + 1);
        tsys__json_str(f, k->span >= 0 ? p->names[p->spans[k->span].name] : "");
        fprintf(f, ", \"phase\": ");
        tsys__json_str(f, k->phase >= 0 ? p->names[p->phases[k->phase]] : "");
        fprintf(f, ", \"seq\": %llu}}", (unsigned long long)k->seq);
        if (k->span < 0) continue;
        // the flow: starts on the op's slice when the launch began (inside the op), ends on the kernel's
        fprintf(f, ",\n{\"name\": \"ac2g\", \"cat\": \"ac2g\", \"ph\": \"s\", \"id\": %llu, \"ts\": %.3f, \"pid\": 1, \"tid\": 1}", (unsigned long long)k->seq, k->t0);
        fprintf(f, ",\n{\"name\": \"ac2g\", \"cat\": \"ac2g\", \"ph\": \"f\", \"bp\": \"e\", \"id\": %llu, \"ts\": %.3f, \"pid\": 2, \"tid\": %d}",
                (unsigned long long)k->seq, k->dev_t0, (int)k->dev + 1);
    }
    for (size_t i = 0; i < p->num_mem; i++) {
        fprintf(f, ",\n{\"name\": \"live bytes\", \"ph\": \"C\", \"ts\": %.3f, \"pid\": 1, \"args\": {\"cpu\": %lld, \"cuda\": %lld}}", p->mem[i].t,
                (long long)p->mem[i].live[TSYS_CPU], (long long)p->mem[i].live[TSYS_CUDA]);
        // reserved = live + the allocator's cached blocks (what nvidia-smi sees, less the context)
        fprintf(f, ",\n{\"name\": \"reserved bytes\", \"ph\": \"C\", \"ts\": %.3f, \"pid\": 1, \"args\": {\"cpu\": %lld, \"cuda\": %lld}}", p->mem[i].t,
                (long long)(p->mem[i].live[TSYS_CPU] + p->mem[i].cached[TSYS_CPU]), (long long)(p->mem[i].live[TSYS_CUDA] + p->mem[i].cached[TSYS_CUDA]));
    }
    fprintf(f, "\n]}\n");
    return tsys_atomic_file_commit(p->ctx, &af);   // checks every write above (stdio's error flag)
}

// >>memory snapshot -------------------------------------------------------------------------------
//
// tsys_mem_snapshot (in >>public) writes the allocations as torch.cuda.memory._snapshot() would:
//   {'segments': [{'device', 'address', 'total_size', 'allocated_size', 'active_size', 'requested_size',
//                  'stream', 'segment_type', 'is_expandable', 'frames',
//                  'blocks': [{'address', 'size', 'requested_size', 'state', 'frames'}]}],
//    'device_traces': [[{'action', 'addr', 'size', 'stream', 'time_us', 'frames'}]]}
// Each allocation is its own segment (a caching allocator that never caches, expandable_segments off):
// segment_alloc + alloc when it is made, free_requested + free_completed + segment_free when it goes.
// The trace opens with what was live when it (re)started (the parameters, the optimizer state...), so
// replaying it alone gives the tracker's peak, and the segments are what is live at its end.
// Addresses are virtual: the tracker's events carry no pointer (and on the CPU there is no device
// address space to speak of), so each live allocation gets one first-fit over the live set, aligned to
// 512 bytes as the CUDA caching allocator's blocks are; live ones never overlap and a freed range is
// used again, as a real allocator would. Sizes are the tracker's bytes, exact.
// Frames, innermost first (memory_viz prints them as filename:line:name): the category and the op that
// allocated with the tensor's shape and dtype ("temporaries:0:linear [2, 32, 128] f32"), then the
// scopes open at the time: ops and backward ops, the model's regions ("layers.3"), and the phase.
// Identical frame stacks are interned (a hash table over their text) and written once to the pickle;
// later uses fetch them from its memo.

#define TSYS__MEMS_DEPTH 32
#define TSYS__MEMS_BASE 0x7f0000000000ll   // where the virtual addresses start
#define TSYS__MEMS_ALIGN 512

typedef struct tsys__mems_live { uint64_t id; int64_t addr, bytes; int frames; } tsys__mems_live;
typedef struct tsys__mems_entry { bool alloc; int64_t addr, bytes; int frames; double t_us; } tsys__mems_entry;

struct tsys_mem_snapshot {
    tsys_ctx *ctx;
    tsys_trace_hooks prev;                    // the hooks it chains to
    tsys_device dev;                          // the device whose allocations it follows
    const char *scope[TSYS__MEMS_DEPTH]; tsys_trace_kind kind[TSYS__MEMS_DEPTH]; int depth;   // open scopes
    tsys__mems_live *live; size_t num_live, cap_live;     // sorted by address
    tsys__mems_entry *tr; size_t num_tr, cap_tr;          // the trace: allocations and frees
    char **keys; int num_keys; size_t cap_keys;           // frame stacks, interned (each the text of its frames)
    int *slot; int num_slots;                             // hash table over keys
    size_t allocs, frees;
    int64_t cur, peak;                        // live bytes the trace replays to; the highest since the restart
    long unmatched;                           // frees of allocations it never saw
    bool broken, ended;                       // broken: out of host memory, no snapshot
};

static void *tsys__mems_grow(tsys_mem_snapshot *s, void *p, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return p;
    size_t c = *cap ? *cap * 2 : 256;
    while (c < need) c *= 2;
    void *q = TSYS_REALLOC(p, c * size);
    if (!q) { s->broken = true; return p; }
    *cap = c;
    return q;
}

static uint32_t tsys__mems_hash(const char *k) { uint32_t h = 2166136261u; for (; *k; k++) h = (h ^ (unsigned char)*k) * 16777619u; return h; }

static int tsys__mems_intern(tsys_mem_snapshot *s, const char *key) {
    if (s->num_keys * 2 >= s->num_slots) {   // keep the table at most half full
        int n = s->num_slots ? s->num_slots * 2 : 1024, *slot = (int *)TSYS_MALLOC((size_t)n * sizeof(int));
        if (!slot) { s->broken = true; return 0; }
        for (int i = 0; i < n; i++) slot[i] = -1;
        for (int k = 0; k < s->num_keys; k++) {
            uint32_t h = tsys__mems_hash(s->keys[k]) & (uint32_t)(n - 1);
            while (slot[h] >= 0) h = (h + 1) & (uint32_t)(n - 1);
            slot[h] = k;
        }
        TSYS_FREE(s->slot); s->slot = slot; s->num_slots = n;
    }
    uint32_t h = tsys__mems_hash(key) & (uint32_t)(s->num_slots - 1);
    for (; s->slot[h] >= 0; h = (h + 1) & (uint32_t)(s->num_slots - 1))
        if (!strcmp(s->keys[s->slot[h]], key)) return s->slot[h];
    s->keys = (char **)tsys__mems_grow(s, s->keys, &s->cap_keys, (size_t)s->num_keys + 1, sizeof(char *));
    size_t n = strlen(key) + 1;
    char *k = s->broken ? NULL : (char *)TSYS_MALLOC(n);
    if (!k) { s->broken = true; return 0; }
    memcpy(k, key, n);
    s->keys[s->num_keys] = k;
    s->slot[h] = s->num_keys;
    return s->num_keys++;
}

static void tsys__mems_on_begin(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    tsys_mem_snapshot *s = (tsys_mem_snapshot *)user;
    if (s->prev.op_begin) s->prev.op_begin(ctx, name, kind, s->prev.user);
    if (s->depth < TSYS__MEMS_DEPTH) { s->scope[s->depth] = name; s->kind[s->depth] = kind; }
    s->depth++;
}
static void tsys__mems_on_end(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    tsys_mem_snapshot *s = (tsys_mem_snapshot *)user;
    if (s->prev.op_end) s->prev.op_end(ctx, name, kind, s->prev.user);
    if (s->depth > 0) s->depth--;
}
static void tsys__mems_on_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    tsys_mem_snapshot *s = (tsys_mem_snapshot *)user;
    if (s->prev.kernel) s->prev.kernel(ctx, k, s->prev.user);
}
static void tsys__mems_on_kernel_begin(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) {
    tsys_mem_snapshot *s = (tsys_mem_snapshot *)user;
    if (s->prev.kernel_begin) s->prev.kernel_begin(ctx, k, s->prev.user);
}

// The frames of an allocation, as text: a "filename\tname" line each, innermost first.
static int tsys__mems_frames(tsys_mem_snapshot *s, tsys_ctx *ctx, const tsys_mem_event *e) {
    char key[2048];
    const char *tag = tsys_mem_tag_name(ctx, e->tag);
    size_t o = (size_t)snprintf(key, sizeof(key), "%s\t%s", tsys_mem_category_name(e->category), tag);
    if (e->ndim >= 0) {
        o += (size_t)snprintf(key + o, sizeof(key) - o, " [");
        for (int i = 0; i < e->ndim && o < sizeof(key); i++) o += (size_t)snprintf(key + o, sizeof(key) - o, i ? ", %lld" : "%lld", (long long)e->shape[i]);
        if (o < sizeof(key)) o += (size_t)snprintf(key + o, sizeof(key) - o, "] %s", tsys_dtype_name(e->dtype));
    }
    bool phase = false;
    for (int i = TSYS__MIN(s->depth, TSYS__MEMS_DEPTH) - 1; i >= 0 && o < sizeof(key); i--) {
        tsys_trace_kind k = s->kind[i];
        if (i == s->depth - 1 && (k == TSYS_TRACE_FORWARD || k == TSYS_TRACE_BACKWARD) && !strcmp(s->scope[i], tag)) continue;   // the op the first frame names
        phase = phase || k == TSYS_TRACE_RANGE;
        o += (size_t)snprintf(key + o, sizeof(key) - o, "\n%s\t%s", k == TSYS_TRACE_FORWARD ? "op" : k == TSYS_TRACE_BACKWARD ? "backward op" :
                              k == TSYS_TRACE_RANGE ? "phase" : "region", s->scope[i]);
    }
    if (!phase && o < sizeof(key)) snprintf(key + o, sizeof(key) - o, "\nphase\tsetup");   // outside any range: the model, its inputs
    return tsys__mems_intern(s, key);
}

static void tsys__mems_push(tsys_mem_snapshot *s, bool alloc, const tsys__mems_live *b, double t_us) {
    s->tr = (tsys__mems_entry *)tsys__mems_grow(s, s->tr, &s->cap_tr, s->num_tr + 1, sizeof(tsys__mems_entry));
    if (s->broken) return;
    tsys__mems_entry *x = &s->tr[s->num_tr++];
    x->alloc = alloc; x->addr = b->addr; x->bytes = b->bytes; x->frames = b->frames; x->t_us = t_us;
    if (alloc) { s->allocs++; s->cur += b->bytes; s->peak = TSYS__MAX(s->peak, s->cur); }
    else { s->frees++; s->cur -= b->bytes; }
}

static void tsys__mems_on_mem(tsys_ctx *ctx, const tsys_mem_event *e, void *user) {
    tsys_mem_snapshot *s = (tsys_mem_snapshot *)user;
    if (s->prev.mem) s->prev.mem(ctx, e, s->prev.user);
    if (e->device != s->dev || e->action == TSYS_MEM_EV_MOVE || s->broken) return;
    if (e->action == TSYS_MEM_EV_ALLOC) {   // first fit over the live set (sorted by address)
        int64_t addr = TSYS__MEMS_BASE;
        size_t i = 0;
        for (; i < s->num_live && s->live[i].addr < addr + e->delta; i++) {
            int64_t end = s->live[i].addr + s->live[i].bytes;
            end = (end + TSYS__MEMS_ALIGN - 1) / TSYS__MEMS_ALIGN * TSYS__MEMS_ALIGN;
            if (end > addr) addr = end;
        }
        s->live = (tsys__mems_live *)tsys__mems_grow(s, s->live, &s->cap_live, s->num_live + 1, sizeof(tsys__mems_live));
        if (s->broken) return;
        memmove(s->live + i + 1, s->live + i, (s->num_live - i) * sizeof(tsys__mems_live));
        tsys__mems_live *b = &s->live[i];
        b->id = e->id; b->addr = addr; b->bytes = e->delta; b->frames = tsys__mems_frames(s, ctx, e);
        s->num_live++;
        tsys__mems_push(s, true, b, e->t_us);
        return;
    }
    // a free: the storage's allocation; memory a backend notes itself (id 0) pairs with the latest of its size
    size_t i = s->num_live;
    for (size_t j = s->num_live; j-- > 0;)
        if (s->live[j].id == e->id && (e->id || s->live[j].bytes == -e->delta)) { i = j; break; }
    if (i == s->num_live) { s->unmatched++; return; }
    tsys__mems_push(s, false, &s->live[i], e->t_us);
    memmove(s->live + i, s->live + i + 1, (s->num_live - i - 1) * sizeof(tsys__mems_live));
    s->num_live--;
}

TSYSDEF tsys_mem_snapshot *tsys_mem_snapshot_begin(tsys_ctx *ctx, tsys_device dev) {
    if (!ctx || !tsys__device_ok(ctx, "tsys_mem_snapshot_begin", dev)) return NULL;
    tsys_mem_snapshot *s = (tsys_mem_snapshot *)TSYS_MALLOC(sizeof(tsys_mem_snapshot));
    if (!s) { TSYS__FAIL(ctx, TSYS_ERR_OOM, "out of host memory for the memory snapshot"); return NULL; }
    memset(s, 0, sizeof(*s));
    s->ctx = ctx; s->dev = dev;
    tsys_trace_hooks h = {tsys__mems_on_begin, tsys__mems_on_end, tsys__mems_on_kernel, tsys__mems_on_mem, s, tsys__mems_on_kernel_begin};
    s->prev = tsys_ctx_set_trace_hooks(ctx, &h);
    return s;
}

TSYSDEF void tsys_mem_snapshot_restart(tsys_mem_snapshot *s) {
    if (!s) return;
    s->num_tr = 0; s->allocs = s->frees = 0; s->cur = s->peak = 0;
    double t = tsys_ctx_time_us(s->ctx);
    for (size_t i = 0; i < s->num_live; i++) tsys__mems_push(s, true, &s->live[i], t);
}

TSYSDEF tsys_mem_snapshot_stats tsys_mem_snapshot_stats_get(const tsys_mem_snapshot *s) {
    tsys_mem_snapshot_stats st;
    memset(&st, 0, sizeof(st));
    if (!s) return st;
    st.allocs = s->allocs; st.frees = s->frees; st.live_bytes = s->cur; st.peak_bytes = s->peak;
    st.unmatched = s->unmatched; st.complete = !s->broken;
    return st;
}

TSYSDEF void tsys_mem_snapshot_end(tsys_mem_snapshot *s) {
    if (!s || s->ended) return;
    s->ended = true;
    tsys_ctx_set_trace_hooks(s->ctx, &s->prev);
}

TSYSDEF void tsys_mem_snapshot_free(tsys_mem_snapshot *s) {
    if (!s) return;
    tsys_mem_snapshot_end(s);
    for (int k = 0; k < s->num_keys; k++) TSYS_FREE(s->keys[k]);
    TSYS_FREE(s->keys); TSYS_FREE(s->slot); TSYS_FREE(s->live); TSYS_FREE(s->tr);
    TSYS_FREE(s);
}

// A pickle, protocol 2, with only the opcodes both Python's unpickler and memory_viz's own read.
static void tsys__pk_u32(FILE *f, uint32_t v) { for (int i = 0; i < 4; i++) fputc((int)(v >> (8 * i)) & 0xff, f); }
static void tsys__pk_int(FILE *f, int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) { fputc('J', f); tsys__pk_u32(f, (uint32_t)(int32_t)v); return; }   // BININT
    fputc(0x8a, f); fputc(8, f);   // LONG1, 8 bytes little-endian two's complement
    for (int i = 0; i < 8; i++) fputc((int)((uint64_t)v >> (8 * i)) & 0xff, f);
}
static void tsys__pk_str(FILE *f, const char *s, size_t n) { fputc('X', f); tsys__pk_u32(f, (uint32_t)n); fwrite(s, 1, n, f); }   // BINUNICODE
static void tsys__pk_key(FILE *f, const char *s) { tsys__pk_str(f, s, strlen(s)); }
static void tsys__pk_begin_dict(FILE *f) { fputc('}', f); fputc('(', f); }   // EMPTY_DICT MARK ... SETITEMS
static void tsys__pk_begin_list(FILE *f) { fputc(']', f); fputc('(', f); }   // EMPTY_LIST MARK ... APPENDS
static void tsys__pk_end_dict(FILE *f) { fputc('u', f); }
static void tsys__pk_end_list(FILE *f) { fputc('e', f); }

typedef struct tsys__pk_memo { int32_t *at; uint32_t next; } tsys__pk_memo;   // frame stack -> memo index (-1: not written yet)

// A frames list: written once, then fetched from the pickle's memo (LONG_BINPUT / LONG_BINGET).
static void tsys__pk_frames(FILE *f, const tsys_mem_snapshot *s, int k, tsys__pk_memo *memo) {
    if (memo->at[k] >= 0) { fputc('j', f); tsys__pk_u32(f, (uint32_t)memo->at[k]); return; }
    fputc(']', f);
    fputc('r', f); tsys__pk_u32(f, memo->next); memo->at[k] = (int32_t)memo->next++;
    fputc('(', f);
    for (const char *c = s->keys[k]; *c;) {
        const char *tab = strchr(c, '\t'), *nl = strchr(tab, '\n');
        size_t end = nl ? (size_t)(nl - tab - 1) : strlen(tab + 1);
        tsys__pk_begin_dict(f);
        tsys__pk_key(f, "filename"); tsys__pk_str(f, c, (size_t)(tab - c));
        tsys__pk_key(f, "line"); tsys__pk_int(f, 0);
        tsys__pk_key(f, "name"); tsys__pk_str(f, tab + 1, end);
        tsys__pk_end_dict(f);
        c = nl ? nl + 1 : tab + 1 + end;
    }
    tsys__pk_end_list(f);
}

static void tsys__pk_event(FILE *f, const char *action, const tsys__mems_entry *x, const tsys_mem_snapshot *s, tsys__pk_memo *memo) {
    tsys__pk_begin_dict(f);
    tsys__pk_key(f, "action"); tsys__pk_key(f, action);
    tsys__pk_key(f, "addr"); tsys__pk_int(f, x->addr);
    tsys__pk_key(f, "size"); tsys__pk_int(f, x->bytes);
    tsys__pk_key(f, "stream"); tsys__pk_int(f, 0);
    tsys__pk_key(f, "time_us"); tsys__pk_int(f, (int64_t)x->t_us);
    tsys__pk_key(f, "frames"); tsys__pk_frames(f, s, x->frames, memo);
    tsys__pk_end_dict(f);
}

// What is live, a segment each, with its one block.
static void tsys__pk_segments(FILE *f, const tsys_mem_snapshot *s, tsys__pk_memo *memo) {
    tsys__pk_begin_list(f);
    for (size_t i = 0; i < s->num_live; i++) {
        const tsys__mems_live *b = &s->live[i];
        tsys__pk_begin_dict(f);
        tsys__pk_key(f, "device"); tsys__pk_int(f, 0);
        tsys__pk_key(f, "address"); tsys__pk_int(f, b->addr);
        tsys__pk_key(f, "total_size"); tsys__pk_int(f, b->bytes);
        tsys__pk_key(f, "allocated_size"); tsys__pk_int(f, b->bytes);
        tsys__pk_key(f, "active_size"); tsys__pk_int(f, b->bytes);
        tsys__pk_key(f, "requested_size"); tsys__pk_int(f, b->bytes);
        tsys__pk_key(f, "stream"); tsys__pk_int(f, 0);
        tsys__pk_key(f, "segment_type"); tsys__pk_key(f, "large");
        tsys__pk_key(f, "is_expandable"); fputc(0x89, f);   // NEWFALSE
        tsys__pk_key(f, "frames"); tsys__pk_frames(f, s, b->frames, memo);
        tsys__pk_key(f, "blocks");
        tsys__pk_begin_list(f);
        tsys__pk_begin_dict(f);
        tsys__pk_key(f, "address"); tsys__pk_int(f, b->addr);
        tsys__pk_key(f, "size"); tsys__pk_int(f, b->bytes);
        tsys__pk_key(f, "requested_size"); tsys__pk_int(f, b->bytes);
        tsys__pk_key(f, "state"); tsys__pk_key(f, "active_allocated");
        tsys__pk_key(f, "frames"); tsys__pk_frames(f, s, b->frames, memo);
        tsys__pk_end_dict(f);
        tsys__pk_end_list(f);
        tsys__pk_end_dict(f);
    }
    tsys__pk_end_list(f);
}

TSYSDEF tsys_status tsys_mem_snapshot_write(const tsys_mem_snapshot *s, const char *path) {
    if (!s) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = s->ctx;
    if (!path) return TSYS__FAIL(ctx, TSYS_ERR_INVALID_ARGS, "memory snapshot: path is NULL");
    if (s->broken) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "memory snapshot '%s': the host ran out of memory while recording", path);
    tsys__pk_memo memo = {(int32_t *)TSYS_MALLOC(((size_t)s->num_keys + 1) * sizeof(int32_t)), 0};
    if (!memo.at) return TSYS__FAIL(ctx, TSYS_ERR_OOM, "memory snapshot '%s': out of host memory", path);
    for (int k = 0; k < s->num_keys; k++) memo.at[k] = -1;
    tsys_atomic_file af;
    tsys_status st = tsys_atomic_file_open(ctx, "memory snapshot", path, &af);
    if (st != TSYS_OK) { TSYS_FREE(memo.at); return st; }
    FILE *f = af.f;
    fputc(0x80, f); fputc(2, f);   // PROTO 2
    tsys__pk_begin_dict(f);
    tsys__pk_key(f, "segments");
    tsys__pk_segments(f, s, &memo);
    tsys__pk_key(f, "device_traces");
    tsys__pk_begin_list(f);
    tsys__pk_begin_list(f);
    for (size_t i = 0; i < s->num_tr; i++) {
        const tsys__mems_entry *x = &s->tr[i];
        if (x->alloc) { tsys__pk_event(f, "segment_alloc", x, s, &memo); tsys__pk_event(f, "alloc", x, s, &memo); }
        else {
            tsys__pk_event(f, "free_requested", x, s, &memo); tsys__pk_event(f, "free_completed", x, s, &memo);
            tsys__pk_event(f, "segment_free", x, s, &memo);
        }
        if (i % 1000 == 999) { tsys__pk_end_list(f); fputc('(', f); }   // APPENDS in batches, as pickle does
    }
    tsys__pk_end_list(f);
    tsys__pk_end_list(f);
    tsys__pk_end_dict(f);
    fputc('.', f);   // STOP
    TSYS_FREE(memo.at);
    return tsys_atomic_file_commit(ctx, &af);   // checks every write above (stdio's error flag)
}

// >>safetensors -----------------------------------------------------------------------------------
//
// safetensors I/O (https://github.com/huggingface/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON
//     {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//      "__metadata__": {"key": "value", ...}}
// and the data buffer; offsets are relative to the buffer's start (byte 8 + N).
//
// The loader faces untrusted files, so it is strict, in the same places as the reference Rust
// implementation: the header is at most 100 MB and must lie inside the file; the JSON is parsed
// completely (a private recursive-descent parser with a nesting limit) and nothing but spaces may
// follow it; every tensor names a known dtype, a shape whose byte size equals its data_offsets
// range, and the ranges tile the data buffer exactly (no overlap, no gap, nothing left over); names
// are unique; every string is valid UTF-8 (as JSON requires: no overlong forms, no surrogates). Only
// regular files are read: a FIFO, directory or device is refused without blocking (on POSIX systems
// the file is opened with O_NONBLOCK and checked with fstat before any read). Every violation is a
// TSYS_ERR_IO error naming the file and the tensor; no byte is read outside the file and no buffer
// larger than the file is allocated.
//
// Tensor data is streamed tensor by tensor (fseek + fread), never the whole file at once, so loading
// a 13 GB checkpoint needs one tensor of staging memory at most. Host byte order must be little
// endian, like the format (checked at run time). Names are checked and looked up through a hash
// index, so the work grows linearly with the number of tensors, hostile headers included.
//
// Saving replaces the file whole through tsys_atomic_file (>>atomic files): a unique temporary
// beside it, written, fsynced and renamed into place.
//
// It uses only the public API above, libc, and the TSYS_MALLOC/TSYS_REALLOC/TSYS_FREE macros of >>config.

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <errno.h>
#include <limits.h>

#define TSYS__ST_MAX_HEADER   100000000u   // same limit as the Rust crate (MAX_HEADER_SIZE)
#define TSYS__ST_MAX_DEPTH    64           // JSON nesting limit: no stack overflow on "[[[[..."
#define TSYS__ST_MAX_DIMS     8            // dims the parser accepts; loading needs <= TSYS_MAX_DIMS
#define TSYS__ST_ERR_LEN      512

// Host scratch memory for headers and staging buffers (not tensor storage, so not tracked).
// Never asks for 0 bytes, whose result malloc may leave NULL.
static void *tsys__st_malloc(size_t n) { return TSYS_MALLOC(n ? n : 1); }
static void *tsys__st_realloc(void *p, size_t n) { return TSYS_REALLOC(p, n ? n : 1); }
static void tsys__st_free(void *p) { if (p) TSYS_FREE(p); }

// ---- errors ---------------------------------------------------------------------------------------

// Every message starts with "safetensors '<path>': " so the user knows which file is broken.
static tsys_status tsys__st_fail(tsys_ctx *ctx, tsys_status s, const char *path, const char *fmt, ...) {
    char msg[TSYS__ST_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return tsys_ctx_set_error(ctx, s, "safetensors '%s': %s", path, msg);
}

static bool tsys__st_host_is_le(void) {
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

// ---- dtypes ---------------------------------------------------------------------------------------

static const char *tsys__st_dtype_str(tsys_dtype dt) {
    switch (dt) {
    case TSYS_F32: return "F32";
    case TSYS_BF16: return "BF16";
    case TSYS_F16: return "F16";
    case TSYS_I32: return "I32";
    case TSYS_I64: return "I64";
    default: return NULL;
    }
}

static bool tsys__st_dtype_parse(const char *s, tsys_dtype *out) {
    for (int d = 0; d < TSYS_DTYPE_COUNT; d++) {
        const char *name = tsys__st_dtype_str((tsys_dtype)d);
        if (name && strcmp(s, name) == 0) { *out = (tsys_dtype)d; return true; }
    }
    return false;
}

// ---- a name index ------------------------------------------------------------------------------------
//
// Names to indices in expected constant time, so that a header of n tensors is checked for duplicate
// names, and load_into finds its n tensors, in O(n) rather than pairwise in O(n^2) (200 000 names
// took minutes that way). Open addressing with linear probing, kept at most half full. The hash is
// FNV-1a started from a per-index random seed and finished with splitmix64's mixer, so the slot
// depends on every bit of the hash and a header cannot pile its names into one run of slots by
// choosing them in advance, as it could against a fixed hash (FNV-1a is no keyed hash like SipHash:
// this makes such an attack costly, not impossible). The index points at names it does not own.

typedef struct tsys__st_slot { const char *name; int value; } tsys__st_slot;
typedef struct tsys__st_index { tsys__st_slot *slots; size_t cap, count; uint64_t seed; } tsys__st_index;

static size_t tsys__st_hash(const tsys__st_index *ix, const char *name) {
    uint64_t h = 14695981039346656037ull ^ ix->seed;   // FNV-1a offset basis, seeded
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) h = (h ^ *c) * 1099511628211ull;
    return (size_t)tsys__splitmix(&h);
}

// The slot holding name, or the empty slot where it would go (there is one: the index is never full).
static tsys__st_slot *tsys__st_index_slot(const tsys__st_index *ix, const char *name) {
    size_t i = tsys__st_hash(ix, name) & (ix->cap - 1);
    while (ix->slots[i].name && strcmp(ix->slots[i].name, name) != 0) i = (i + 1) & (ix->cap - 1);
    return &ix->slots[i];
}

// The value stored under name, or -1.
static int tsys__st_index_find(const tsys__st_index *ix, const char *name) {
    if (!ix->cap) return -1;
    const tsys__st_slot *slot = tsys__st_index_slot(ix, name);
    return slot->name ? slot->value : -1;
}

// Doubles the slots (64 at first) and puts every name back; false when out of memory.
static bool tsys__st_index_grow(tsys__st_index *ix) {
    tsys__st_index bigger = *ix;
    bigger.cap = ix->cap ? 2 * ix->cap : 64;
    if (bigger.cap > SIZE_MAX / sizeof *bigger.slots) return false;
    bigger.slots = (tsys__st_slot *)tsys__st_malloc(bigger.cap * sizeof *bigger.slots);
    if (!bigger.slots) return false;
    memset(bigger.slots, 0, bigger.cap * sizeof *bigger.slots);
    if (!ix->cap) bigger.seed = tsys__atomic_seed(ix);   // random enough; see above
    for (size_t i = 0; i < ix->cap; i++)
        if (ix->slots[i].name) *tsys__st_index_slot(&bigger, ix->slots[i].name) = ix->slots[i];
    tsys__st_free(ix->slots);
    *ix = bigger;
    return true;
}

// Adds name -> value unless name is there already; *existing gets the value found there, or -1
// when name was added. False when out of memory.
static bool tsys__st_index_add(tsys__st_index *ix, const char *name, int value, int *existing) {
    *existing = tsys__st_index_find(ix, name);
    if (*existing >= 0) return true;
    if (2 * (ix->count + 1) > ix->cap && !tsys__st_index_grow(ix)) return false;
    tsys__st_slot *slot = tsys__st_index_slot(ix, name);
    slot->name = name;
    slot->value = value;
    ix->count++;
    return true;
}

static void tsys__st_index_free(tsys__st_index *ix) {
    tsys__st_free(ix->slots);
    memset(ix, 0, sizeof *ix);
}

// ---- the parsed header ----------------------------------------------------------------------------

typedef struct tsys__st_entry {
    char *name;                          // owned; may exceed TSYS_NAME_LEN (then it cannot be loaded)
    tsys_dtype dtype;
    int ndim;
    int64_t shape[TSYS__ST_MAX_DIMS];
    uint64_t begin, end;                 // byte range inside the data buffer
} tsys__st_entry;

typedef struct tsys__st_file {
    tsys_ctx *ctx;
    const char *path;
    FILE *f;
    uint64_t file_bytes;
    uint64_t data_start;                 // 8 + header length
    uint64_t data_bytes;
    tsys__st_entry *entries;
    int n, cap;
    tsys__st_index names;                // entry names -> indices into entries
    bool has_metadata;
    char **meta;                         // "__metadata__"'s string members: key, value, key, value, ...
    int nmeta, meta_cap;                 // strings held (twice the members)
} tsys__st_file;

static void tsys__st_close(tsys__st_file *sf) {
    tsys__st_index_free(&sf->names);
    for (int i = 0; i < sf->n; i++) tsys__st_free(sf->entries[i].name);
    tsys__st_free(sf->entries);
    for (int i = 0; i < sf->nmeta; i++) tsys__st_free(sf->meta[i]);
    tsys__st_free(sf->meta);
    if (sf->f) fclose(sf->f);
    memset(sf, 0, sizeof *sf);
}

// Writes "(2, 3)" (or "()" for a scalar) into buf; used in shape-mismatch messages.
static const char *tsys__st_shape_str(char *buf, size_t len, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, len, "(");
    for (int i = 0; i < ndim && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (used < len) snprintf(buf + used, len - used, ")");
    return buf;
}

// ---- a strict JSON parser for the header -----------------------------------------------------------

typedef struct tsys__st_parser {
    tsys__st_file *sf;
    const char *begin, *p, *end;         // the header bytes; p never passes end
    int depth;
    const char *tensor;                  // entry being parsed, for messages (NULL at top level)
} tsys__st_parser;

static tsys_status tsys__st_syntax(tsys__st_parser *P, const char *what) {
    long at = (long)(P->p - P->begin);
    if (P->tensor)
        return tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "garbled header JSON in tensor '%s': %s at byte %ld of the header",
                             P->tensor, what, at);
    return tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "garbled header JSON: %s at byte %ld of the header", what, at);
}

static void tsys__st_ws(tsys__st_parser *P) {
    while (P->p < P->end && (*P->p == ' ' || *P->p == '\t' || *P->p == '\n' || *P->p == '\r')) P->p++;
}

// Skips whitespace and consumes c if it is next.
static bool tsys__st_accept(tsys__st_parser *P, char c) {
    tsys__st_ws(P);
    if (P->p < P->end && *P->p == c) { P->p++; return true; }
    return false;
}

static tsys_status tsys__st_expect(tsys__st_parser *P, char c) {
    char what[32];
    if (tsys__st_accept(P, c)) return TSYS_OK;
    snprintf(what, sizeof what, P->p < P->end ? "expected '%c'" : "expected '%c', header ended", c);
    return tsys__st_syntax(P, what);
}

static int tsys__st_hex4(const char *s) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

// Reads a \uXXXX escape (P->p just past the 'u'), joining surrogate pairs; returns the code point or -1.
static long tsys__st_unicode_escape(tsys__st_parser *P) {
    if (P->end - P->p < 4) return -1;
    long cp = tsys__st_hex4(P->p);
    if (cp < 0) return -1;
    P->p += 4;
    if (cp >= 0xDC00 && cp <= 0xDFFF) return -1;                      // lone low surrogate
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (P->end - P->p < 6 || P->p[0] != '\\' || P->p[1] != 'u') return -1;
        long lo = tsys__st_hex4(P->p + 2);
        if (lo < 0xDC00 || lo > 0xDFFF) return -1;
        P->p += 6;
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    return cp;
}

static size_t tsys__st_utf8(long cp, char *out) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12)); out[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18)); out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// Length of the UTF-8 sequence at p (1 to 4 bytes), or 0 when it is not valid UTF-8 (RFC 3629: no
// overlong forms, no UTF-16 surrogates, nothing past U+10FFFF) or runs past end.
static int tsys__st_utf8_len(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0], lo = 0x80, hi = 0xBF;
    int n;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) { n = 3; if (c == 0xE0) lo = 0xA0; else if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 4; if (c == 0xF0) lo = 0x90; else if (c == 0xF4) hi = 0x8F; }
    else return 0;   // a continuation byte, an overlong lead (C0, C1) or a lead past U+10FFFF
    if (end - p < n || p[1] < lo || p[1] > hi) return 0;
    for (int i = 2; i < n; i++)
        if (p[i] < 0x80 || p[i] > 0xBF) return 0;
    return n;
}

// Parses a JSON string. With out != NULL the decoded bytes land in a new NUL-terminated buffer;
// an escaped NUL is refused there, because it would silently cut a tensor name short. Raw bytes
// must be valid UTF-8, so names compare and print the same in tsys and in PyTorch.
static tsys_status tsys__st_string(tsys__st_parser *P, char **out) {
    tsys_status s = tsys__st_expect(P, '"');
    if (s != TSYS_OK) return s;
    // The decoded string is never longer than its JSON form, so one allocation of that size is enough.
    const char *q = P->p;
    while (q < P->end && *q != '"') q += (*q == '\\' && q + 1 < P->end) ? 2 : 1;
    char *buf = out ? (char *)tsys__st_malloc((size_t)(q - P->p) + 1) : NULL;
    size_t n = 0;
    if (out && !buf) return tsys_ctx_set_error(P->sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory parsing the header", P->sf->path);
    for (;;) {
        if (P->p >= P->end) { s = tsys__st_syntax(P, "unterminated string"); break; }
        unsigned char c = (unsigned char)*P->p++;
        if (c == '"') { s = TSYS_OK; break; }
        if (c < 0x20) { P->p--; s = tsys__st_syntax(P, "control character in string"); break; }
        if (c >= 0x80) {
            int k = tsys__st_utf8_len((const unsigned char *)P->p - 1, (const unsigned char *)P->end);
            if (!k) { P->p--; s = tsys__st_syntax(P, "invalid UTF-8 in string"); break; }
            if (buf) memcpy(buf + n, P->p - 1, (size_t)k);
            n += (size_t)k;
            P->p += k - 1;
            continue;
        }
        if (c != '\\') { if (buf) buf[n] = (char)c; n++; continue; }
        if (P->p >= P->end) { s = tsys__st_syntax(P, "unterminated escape"); break; }
        char e = *P->p++;
        static const char escaped[] = "\"\\/bfnrt", decoded[] = "\"\\/\b\f\n\r\t";
        const char *simple = e ? strchr(escaped, e) : NULL;
        if (simple) {
            if (buf) buf[n] = decoded[simple - escaped];
            n++;
            continue;
        }
        long cp = e == 'u' ? tsys__st_unicode_escape(P) : -1;
        if (cp < 0 || (cp == 0 && buf)) { s = tsys__st_syntax(P, "bad escape in string"); break; }
        char tmp[4];
        size_t k = tsys__st_utf8(cp, tmp);
        if (buf) memcpy(buf + n, tmp, k);   // fits: \uXXXX is 6 bytes for <= 3 decoded, a pair 12 for 4
        n += k;
    }
    if (s != TSYS_OK) { tsys__st_free(buf); return s; }
    if (out) { buf[n] = 0; *out = buf; }
    return TSYS_OK;
}

// A non-negative JSON integer without sign, fraction or exponent, below 2^63 (shapes, offsets).
static tsys_status tsys__st_uint(tsys__st_parser *P, uint64_t *out) {
    tsys__st_ws(P);
    if (P->p >= P->end || *P->p < '0' || *P->p > '9') return tsys__st_syntax(P, "expected a non-negative integer");
    if (*P->p == '0' && P->p + 1 < P->end && P->p[1] >= '0' && P->p[1] <= '9') return tsys__st_syntax(P, "leading zero in integer");
    uint64_t v = 0;
    while (P->p < P->end && *P->p >= '0' && *P->p <= '9') {
        uint64_t d = (uint64_t)(*P->p - '0');
        if (v > ((uint64_t)INT64_MAX - d) / 10) return tsys__st_syntax(P, "integer too large");
        v = v * 10 + d;
        P->p++;
    }
    if (P->p < P->end && (*P->p == '.' || *P->p == 'e' || *P->p == 'E')) return tsys__st_syntax(P, "expected an integer, found a fraction");
    *out = v;
    return TSYS_OK;
}

static tsys_status tsys__st_skip_value(tsys__st_parser *P);

// Any JSON number, validated and discarded (only __metadata__ and unknown fields get here).
static tsys_status tsys__st_skip_number(tsys__st_parser *P) {
#define TSYS__ST_DIGITS(min) do { const char *d0 = P->p; \
        while (P->p < P->end && *P->p >= '0' && *P->p <= '9') P->p++; \
        if (P->p - d0 < (min)) return tsys__st_syntax(P, "bad number"); } while (0)
    if (P->p < P->end && *P->p == '-') P->p++;
    if (P->end - P->p >= 2 && P->p[0] == '0' && P->p[1] >= '0' && P->p[1] <= '9') return tsys__st_syntax(P, "leading zero in number");
    TSYS__ST_DIGITS(1);
    if (P->p < P->end && *P->p == '.') { P->p++; TSYS__ST_DIGITS(1); }
    if (P->p < P->end && (*P->p == 'e' || *P->p == 'E')) {
        P->p++;
        if (P->p < P->end && (*P->p == '+' || *P->p == '-')) P->p++;
        TSYS__ST_DIGITS(1);
    }
#undef TSYS__ST_DIGITS
    return TSYS_OK;
}

static tsys_status tsys__st_skip_literal(tsys__st_parser *P, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(P->end - P->p) < n || memcmp(P->p, word, n) != 0) return tsys__st_syntax(P, "unexpected character");
    P->p += n;
    return TSYS_OK;
}

// Arrays and objects, element by element; `close` is ']' or '}'.
static tsys_status tsys__st_skip_container(tsys__st_parser *P, char close) {
    tsys_status s;
    P->p++;   // the opening bracket
    if (++P->depth > TSYS__ST_MAX_DEPTH) return tsys__st_syntax(P, "nesting too deep");
    if (tsys__st_accept(P, close)) { P->depth--; return TSYS_OK; }
    do {
        if (close == '}') {
            if ((s = tsys__st_string(P, NULL)) != TSYS_OK) return s;
            if ((s = tsys__st_expect(P, ':')) != TSYS_OK) return s;
        }
        if ((s = tsys__st_skip_value(P)) != TSYS_OK) return s;
    } while (tsys__st_accept(P, ','));
    P->depth--;
    return tsys__st_expect(P, close);
}

static tsys_status tsys__st_skip_value(tsys__st_parser *P) {
    tsys__st_ws(P);
    if (P->p >= P->end) return tsys__st_syntax(P, "expected a value, header ended");
    switch (*P->p) {
    case '"': return tsys__st_string(P, NULL);
    case '{': return tsys__st_skip_container(P, '}');
    case '[': return tsys__st_skip_container(P, ']');
    case 't': return tsys__st_skip_literal(P, "true");
    case 'f': return tsys__st_skip_literal(P, "false");
    case 'n': return tsys__st_skip_literal(P, "null");
    default: return tsys__st_skip_number(P);
    }
}

// [a, b, ...] of non-negative integers, at most max of them.
static tsys_status tsys__st_uint_array(tsys__st_parser *P, uint64_t *vals, int max, int *count) {
    tsys_status s = tsys__st_expect(P, '[');
    *count = 0;
    if (s != TSYS_OK || tsys__st_accept(P, ']')) return s;
    do {
        if (*count == max) return tsys__st_syntax(P, "too many elements in array");
        if ((s = tsys__st_uint(P, &vals[(*count)++])) != TSYS_OK) return s;
    } while (tsys__st_accept(P, ','));
    return tsys__st_expect(P, ']');
}

// {"dtype": .., "shape": [..], "data_offsets": [b, e]}; other fields are checked as JSON and
// ignored, as the reference implementation does.
static tsys_status tsys__st_tensor_info(tsys__st_parser *P, tsys__st_entry *e) {
    tsys_status s = tsys__st_expect(P, '{');
    bool seen_dtype = false, seen_shape = false, seen_offsets = false;
    if (s != TSYS_OK) return s;
    if (!tsys__st_accept(P, '}')) do {
        char *key = NULL;
        if ((s = tsys__st_string(P, &key)) != TSYS_OK) return s;
        if ((s = tsys__st_expect(P, ':')) != TSYS_OK) { tsys__st_free(key); return s; }
        bool *seen = strcmp(key, "dtype") == 0 ? &seen_dtype : strcmp(key, "shape") == 0 ? &seen_shape
                   : strcmp(key, "data_offsets") == 0 ? &seen_offsets : NULL;
        if (seen && *seen) { tsys__st_free(key); return tsys__st_syntax(P, "duplicate field"); }
        if (seen) *seen = true;
        if (seen == &seen_dtype) {
            char *dt = NULL;
            if ((s = tsys__st_string(P, &dt)) == TSYS_OK && !tsys__st_dtype_parse(dt, &e->dtype))
                s = tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "tensor '%s': unknown dtype '%.16s' (tsys reads F32, BF16, F16, I32, I64)", e->name, dt);
            tsys__st_free(dt);
        } else if (seen == &seen_shape) {
            uint64_t dims[TSYS__ST_MAX_DIMS];
            s = tsys__st_uint_array(P, dims, TSYS__ST_MAX_DIMS, &e->ndim);
            for (int i = 0; s == TSYS_OK && i < e->ndim; i++) e->shape[i] = (int64_t)dims[i];
        } else if (seen == &seen_offsets) {
            uint64_t off[3];
            int n = 0;
            s = tsys__st_uint_array(P, off, 3, &n);
            if (s == TSYS_OK && n != 2) s = tsys__st_syntax(P, "data_offsets must hold 2 integers");
            if (s == TSYS_OK) { e->begin = off[0]; e->end = off[1]; }
        } else {
            s = tsys__st_skip_value(P);
        }
        tsys__st_free(key);
        if (s != TSYS_OK) return s;
    } while (tsys__st_accept(P, ','));
    if ((s = tsys__st_expect(P, '}')) != TSYS_OK) return s;
    if (!seen_dtype || !seen_shape || !seen_offsets)
        return tsys__st_fail(P->sf->ctx, TSYS_ERR_IO, P->sf->path, "tensor '%s': header entry lacks %s", e->name,
                             !seen_dtype ? "\"dtype\"" : !seen_shape ? "\"shape\"" : "\"data_offsets\"");
    return TSYS_OK;
}

// The value of "__metadata__"'s member key, or NULL.
static const char *tsys__st_meta_get(const tsys__st_file *sf, const char *key) {
    for (int i = 0; i + 1 < sf->nmeta; i += 2) if (strcmp(sf->meta[i], key) == 0) return sf->meta[i + 1];
    return NULL;
}

// "__metadata__": an object, at most one. The format makes it a string -> string map; its string
// members are kept (tsys_model_desc_from_file reads them), anything else is validated and ignored.
static tsys_status tsys__st_metadata(tsys__st_parser *P) {
    tsys__st_file *sf = P->sf;
    tsys_status s;
    if (sf->has_metadata) return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "'__metadata__' appears twice in the header");
    sf->has_metadata = true;
    if ((s = tsys__st_expect(P, ':')) != TSYS_OK) return s;
    tsys__st_ws(P);
    if (P->p >= P->end || *P->p != '{') return tsys__st_syntax(P, "__metadata__ must be an object");
    if ((s = tsys__st_expect(P, '{')) != TSYS_OK || tsys__st_accept(P, '}')) return s;
    do {
        char *key = NULL, *val = NULL;
        if ((s = tsys__st_string(P, &key)) != TSYS_OK) return s;
        if ((s = tsys__st_expect(P, ':')) == TSYS_OK) {
            tsys__st_ws(P);
            s = P->p < P->end && *P->p == '"' ? tsys__st_string(P, &val) : tsys__st_skip_value(P);
        }
        if (s == TSYS_OK && val && sf->nmeta + 2 > sf->meta_cap) {
            int cap = sf->meta_cap ? 2 * sf->meta_cap : 16;
            char **grown = (char **)tsys__st_realloc(sf->meta, (size_t)cap * sizeof *grown);
            if (!grown) s = tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory parsing the header", sf->path);
            else { sf->meta = grown; sf->meta_cap = cap; }
        }
        if (s == TSYS_OK && val) { sf->meta[sf->nmeta++] = key; sf->meta[sf->nmeta++] = val; key = val = NULL; }
        tsys__st_free(key); tsys__st_free(val);
        if (s != TSYS_OK) return s;
    } while (tsys__st_accept(P, ','));
    return tsys__st_expect(P, '}');
}

// One "name": {...} member of the top-level object; takes ownership of name.
static tsys_status tsys__st_member(tsys__st_parser *P, char *name) {
    tsys__st_file *sf = P->sf;
    tsys_status s;
    int earlier = -1;
    if (sf->n == sf->cap) {
        int cap = sf->cap ? 2 * sf->cap : 64;
        tsys__st_entry *grown = (tsys__st_entry *)tsys__st_realloc(sf->entries, (size_t)cap * sizeof *grown);
        if (!grown) { tsys__st_free(name); return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory parsing the header", sf->path); }
        sf->entries = grown; sf->cap = cap;
    }
    if (!tsys__st_index_add(&sf->names, name, sf->n, &earlier)) {
        tsys__st_free(name);
        return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory parsing the header", sf->path);
    }
    if (earlier >= 0) {
        s = tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s' appears twice in the header (tensors %d and %d)", name, earlier, sf->n);
        tsys__st_free(name);
        return s;
    }
    tsys__st_entry *e = &sf->entries[sf->n++];
    memset(e, 0, sizeof *e);
    e->name = name;   // owned by the file from here on, freed by tsys__st_close
    P->tensor = name;
    if ((s = tsys__st_expect(P, ':')) == TSYS_OK) s = tsys__st_tensor_info(P, e);
    P->tensor = NULL;
    return s;
}

// The top-level object: one member per tensor, plus an optional "__metadata__"; nothing but
// whitespace may follow it (the writer pads with spaces).
static tsys_status tsys__st_header(tsys__st_parser *P) {
    tsys_status s = tsys__st_expect(P, '{');
    if (s != TSYS_OK) return s;
    if (!tsys__st_accept(P, '}')) {
        do {
            char *name = NULL;
            if ((s = tsys__st_string(P, &name)) != TSYS_OK) return s;
            if (strcmp(name, "__metadata__") == 0) { tsys__st_free(name); s = tsys__st_metadata(P); }
            else s = tsys__st_member(P, name);
            if (s != TSYS_OK) return s;
        } while (tsys__st_accept(P, ','));
        if ((s = tsys__st_expect(P, '}')) != TSYS_OK) return s;
    }
    tsys__st_ws(P);
    if (P->p != P->end) return tsys__st_syntax(P, "unexpected bytes after the header object");
    return TSYS_OK;
}

// ---- layout checks --------------------------------------------------------------------------------

// numel * dtype size, or false on overflow. The product is taken left to right, as the reference
// implementation does (a checked fold) and as tsys_tensor_numel does in int64: every partial
// product must fit in int64 (so [4, 2^62, 0] overflows before the 0, while [2^62, 0, 4] is 0 bytes).
static bool tsys__st_entry_bytes(const tsys__st_entry *e, uint64_t *bytes) {
    uint64_t n = 1;
    *bytes = 0;
    for (int i = 0; i < e->ndim; i++) {
        uint64_t d = (uint64_t)e->shape[i];
        if (d && n > (uint64_t)INT64_MAX / d) return false;
        n *= d;
    }
    uint64_t size = tsys_dtype_size(e->dtype);
    if (n > (uint64_t)INT64_MAX / size) return false;
    *bytes = n * size;
    return true;
}

static int tsys__st_cmp_range(const void *a, const void *b) {
    const tsys__st_entry *x = *(const tsys__st_entry *const *)a, *y = *(const tsys__st_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

// Each tensor's range matches its shape and dtype and lies in the buffer; sorted by offset, the
// ranges tile the buffer exactly. A hole or overlap means a damaged or hand-edited file.
static tsys_status tsys__st_check_layout(tsys__st_file *sf) {
    for (int i = 0; i < sf->n; i++) {
        const tsys__st_entry *e = &sf->entries[i];
        uint64_t bytes = 0;
        char sh[160];
        if (e->begin > e->end || e->end > sf->data_bytes)
            return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': data_offsets [%llu, %llu] %s the %llu-byte data buffer",
                                 e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                                 e->begin > e->end ? "are reversed; they must be a range in" : "lie outside", (unsigned long long)sf->data_bytes);
        if (!tsys__st_entry_bytes(e, &bytes))
            return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': %s %s overflows 64-bit sizes", e->name,
                                 tsys__st_dtype_str(e->dtype), tsys__st_shape_str(sh, sizeof sh, e->ndim, e->shape));
        if (bytes != e->end - e->begin)
            return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, but %s %s needs %llu",
                                 e->name, (unsigned long long)e->begin, (unsigned long long)e->end, (unsigned long long)(e->end - e->begin),
                                 tsys__st_dtype_str(e->dtype), tsys__st_shape_str(sh, sizeof sh, e->ndim, e->shape), (unsigned long long)bytes);
    }
    const tsys__st_entry **order = (const tsys__st_entry **)tsys__st_malloc((size_t)sf->n * sizeof *order);
    if (!order) return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory checking the layout", sf->path);
    for (int i = 0; i < sf->n; i++) order[i] = &sf->entries[i];
    qsort(order, (size_t)sf->n, sizeof *order, tsys__st_cmp_range);
    uint64_t at = 0;
    tsys_status s = TSYS_OK;
    for (int i = 0; i < sf->n && s == TSYS_OK; i++) {
        if (order[i]->begin != at)
            s = tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': data_offsets start at %llu, but the previous tensor ends at %llu (%s)",
                              order[i]->name, (unsigned long long)order[i]->begin, (unsigned long long)at, order[i]->begin < at ? "overlap" : "gap");
        at = order[i]->end;
    }
    if (s == TSYS_OK && at != sf->data_bytes)
        s = tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensors cover %llu bytes of the %llu-byte data buffer (trailing bytes)",
                          (unsigned long long)at, (unsigned long long)sf->data_bytes);
    tsys__st_free(order);
    return s;
}

// ---- opening a file -------------------------------------------------------------------------------

// Opens, reads and parses the header, validates the layout. On error the file is closed.
static tsys_status tsys__st_open(tsys_ctx *ctx, const char *path, tsys__st_file *sf) {
    memset(sf, 0, sizeof *sf);
    sf->ctx = ctx; sf->path = path;
    if (!tsys__st_host_is_le()) return tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "big-endian hosts are not supported");
#ifdef TSYS__POSIX
    // A plain fopen of a FIFO waits for a writer, and one of a directory "succeeds" with a size of
    // LONG_MAX: open without blocking, then accept regular files only.
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot stat: %s", strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        const char *kind = S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)"
                         : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device" : "a socket or other special file";
        close(fd);
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "is %s; safetensors are read from regular files", kind);
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    sf->f = fdopen(fd, "rb");
    if (!sf->f) { int e = errno; close(fd); return tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot open: %s", strerror(e)); }
    long long size = (long long)st.st_size;
#else
    sf->f = fopen(path, "rb");
    if (!sf->f) return tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot open: %s", strerror(errno));
    long long size = -1;
    if (fseek(sf->f, 0, SEEK_END) == 0) size = ftell(sf->f);
    if (size < 0 || fseek(sf->f, 0, SEEK_SET) != 0) { tsys__st_close(sf); return tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot determine the file size"); }
#endif
    if (size < 0) { tsys__st_close(sf); return tsys__st_fail(ctx, TSYS_ERR_IO, path, "cannot determine the file size"); }
    sf->file_bytes = (uint64_t)size;
    unsigned char len8[8];
    if (sf->file_bytes < 8 || fread(len8, 1, 8, sf->f) != 8) {
        tsys__st_close(sf);
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "file is %llu bytes, too short for the 8-byte header length", (unsigned long long)size);
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
    if (hlen > sf->file_bytes - 8) {
        tsys__st_close(sf);
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "header length %llu runs past the end of the file (%llu bytes): truncated or not a safetensors file",
                             (unsigned long long)hlen, (unsigned long long)size);
    }
    if (hlen > TSYS__ST_MAX_HEADER || hlen < 2) {
        tsys__st_close(sf);
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "header length %llu is outside [2, %u]", (unsigned long long)hlen, TSYS__ST_MAX_HEADER);
    }
    char *hdr = (char *)tsys__st_malloc((size_t)hlen);
    if (!hdr) { tsys__st_close(sf); return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory for a %llu-byte header", path, (unsigned long long)hlen); }
    tsys_status s = TSYS_OK;
    if (fread(hdr, 1, (size_t)hlen, sf->f) != (size_t)hlen) s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "short read in the header");
    sf->data_start = 8 + hlen;
    sf->data_bytes = sf->file_bytes - sf->data_start;
    if (s == TSYS_OK) {
        tsys__st_parser P;
        memset(&P, 0, sizeof P);
        P.sf = sf; P.begin = P.p = hdr; P.end = hdr + hlen;
        s = tsys__st_header(&P);
    }
    tsys__st_free(hdr);
    if (s == TSYS_OK) s = tsys__st_check_layout(sf);
    if (s != TSYS_OK) tsys__st_close(sf);
    return s;
}

// Reads entry e's bytes into dst (e->end - e->begin bytes).
static tsys_status tsys__st_read(tsys__st_file *sf, const tsys__st_entry *e, void *dst) {
    size_t n = (size_t)(e->end - e->begin);
    uint64_t at = sf->data_start + e->begin;
    if (n == 0) return TSYS_OK;
    if (at > (uint64_t)LONG_MAX) return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': offset past what fseek reaches here", e->name);
    if (fseek(sf->f, (long)at, SEEK_SET) != 0 || fread(dst, 1, n, sf->f) != n)
        return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': short read (file changed or truncated?)", e->name);
    return TSYS_OK;
}

// ---- host <-> tensor --------------------------------------------------------------------------------

// Puts host bytes (t's dtype, t's size) into t on its device: CPU directly, other devices through a
// temporary CPU tensor and the backend's copy.
static tsys_status tsys__st_upload(tsys_ctx *ctx, tsys_tensor *t, const void *host) {
    if (t->device == TSYS_CPU) {
        memcpy(tsys_tensor_data(t), host, tsys_tensor_bytes(t));
        return TSYS_OK;
    }
    tsys_tensor *tmp = tsys_tensor_from_data(ctx, t->dtype, TSYS_CPU, t->ndim, t->shape, host);
    if (!tmp) return tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM;
    tsys_status s = tsys_tensor_copy_from(ctx, t, tmp);
    tsys_tensor_release(tmp);
    return s;
}

// Element-wise float conversion between F32 and BF16/F16 (the pairs load_into accepts).
static void tsys__st_convert(void *dst, tsys_dtype dd, const void *src, tsys_dtype sd, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float f;
        uint16_t h;
        if (sd == TSYS_F32) memcpy(&f, (const char *)src + 4 * i, 4);
        else { memcpy(&h, (const char *)src + 2 * i, 2); f = sd == TSYS_BF16 ? tsys_bf16_to_f32(h) : tsys_f16_to_f32(h); }
        if (dd == TSYS_F32) memcpy((char *)dst + 4 * i, &f, 4);
        else { h = dd == TSYS_BF16 ? tsys_f32_to_bf16(f) : tsys_f32_to_f16(f); memcpy((char *)dst + 2 * i, &h, 2); }
    }
}

// A q or k projection's rows from Hugging Face's rotate-half RoPE layout to tsys's interleaved pairs,
// in place. HF rotates the pair (i, i + d/2) of each head's d rows by angle t * theta^(-2i/d)
// (rotate_half: q*cos + cat(-q2, q1)*sin); tsys rotates the pair (2i, 2i + 1) by the same angle. So per
// head, tsys row 2i is HF row i and tsys row 2i + 1 is HF row i + d/2: q and k come out permuted alike,
// and every q.k (the scores) is HF's. False when out of memory.
static bool tsys__st_unrotate_half(void *data, int64_t rows, size_t row_bytes, int64_t heads) {
    int64_t d = rows / heads;
    char *tmp = (char *)tsys__st_malloc((size_t)d * row_bytes), *base = (char *)data;
    if (!tmp) return false;
    for (int64_t h = 0; h < heads; h++) {
        char *head = base + (size_t)(h * d) * row_bytes;
        memcpy(tmp, head, (size_t)d * row_bytes);
        for (int64_t i = 0; i < d / 2; i++) {
            memcpy(head + (size_t)(2 * i) * row_bytes, tmp + (size_t)i * row_bytes, row_bytes);
            memcpy(head + (size_t)(2 * i + 1) * row_bytes, tmp + (size_t)(i + d / 2) * row_bytes, row_bytes);
        }
    }
    tsys__st_free(tmp);
    return true;
}

// Fills t from entry e, converting F32 <-> BF16/F16 when the dtypes differ. CPU tensors of the
// file's dtype are read straight into their storage; everything else goes through staging.
// rope_heads > 0: t is a q or k projection of a Hugging Face checkpoint, its rows permuted on the way
// (tsys__st_unrotate_half).
static tsys_status tsys__st_fill_ex(tsys__st_file *sf, const tsys__st_entry *e, tsys_tensor *t, int64_t rope_heads);
static tsys_status tsys__st_fill(tsys__st_file *sf, const tsys__st_entry *e, tsys_tensor *t) { return tsys__st_fill_ex(sf, e, t, 0); }
static tsys_status tsys__st_permute_rows(tsys__st_file *sf, const tsys__st_entry *e, const tsys_tensor *t, void *host, int64_t rope_heads) {
    if (rope_heads <= 0) return TSYS_OK;
    int64_t rows = t->shape[0], d = rows / rope_heads;
    if (t->ndim != 2 || rows % rope_heads || d % 2)
        return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': %lld rows do not split into %lld heads of an even size", e->name, (long long)rows, (long long)rope_heads);
    if (!tsys__st_unrotate_half(host, rows, (size_t)t->shape[1] * tsys_dtype_size(t->dtype), rope_heads))
        return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': tensor '%s': out of memory permuting rows", sf->path, e->name);
    return TSYS_OK;
}
static tsys_status tsys__st_fill_ex(tsys__st_file *sf, const tsys__st_entry *e, tsys_tensor *t, int64_t rope_heads) {
    tsys_tensor_mark_written(t);   // the direct read below bypasses the copy that would mark it
    if (t->dtype == e->dtype && t->device == TSYS_CPU) {
        tsys_status s0 = tsys__st_read(sf, e, tsys_tensor_data(t));
        return s0 == TSYS_OK ? tsys__st_permute_rows(sf, e, t, tsys_tensor_data(t), rope_heads) : s0;
    }
    size_t file_bytes = (size_t)(e->end - e->begin);
    size_t conv_bytes = t->dtype == e->dtype ? 0 : tsys_tensor_bytes(t);
    char *buf = (char *)tsys__st_malloc(file_bytes + conv_bytes);
    if (!buf) return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': tensor '%s': out of memory for %llu staging bytes",
                                        sf->path, e->name, (unsigned long long)(file_bytes + conv_bytes));
    tsys_status s = tsys__st_read(sf, e, buf);
    if (s == TSYS_OK && conv_bytes) tsys__st_convert(buf + file_bytes, t->dtype, buf, e->dtype, tsys_tensor_numel(t));
    if (s == TSYS_OK) s = tsys__st_permute_rows(sf, e, t, buf + (conv_bytes ? file_bytes : 0), rope_heads);
    if (s == TSYS_OK) s = tsys__st_upload(sf->ctx, t, buf + (conv_bytes ? file_bytes : 0));
    tsys__st_free(buf);
    return s;
}

static bool tsys__st_convertible(tsys_dtype file, tsys_dtype tensor) {
    if (file == tensor) return true;
    return (file == TSYS_F32 && (tensor == TSYS_BF16 || tensor == TSYS_F16)) ||
           (tensor == TSYS_F32 && (file == TSYS_BF16 || file == TSYS_F16));
}

// ---- public entry points ----------------------------------------------------------------------------

TSYSDEF void tsys_tensor_list_free(tsys_tensor **list, int n) {
    if (!list) return;
    for (int i = 0; i < n; i++) tsys_tensor_release(list[i]);
    tsys__st_free(list);
}

TSYSDEF tsys_status tsys_safetensors_load(tsys_ctx *ctx, const char *path, tsys_device dev, tsys_tensor ***out, int *n) {
    if (!ctx || !path || !out || !n) return ctx ? tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_safetensors_load: NULL argument") : TSYS_ERR_INVALID_ARGS;
    *out = NULL; *n = 0;
    if (!tsys__device_ok(ctx, "tsys_safetensors_load", dev)) return TSYS_ERR_INVALID_ARGS;
    tsys__st_file sf;
    tsys_status s = tsys__st_open(ctx, path, &sf);
    if (s != TSYS_OK) return s;
    tsys_tensor **list = (tsys_tensor **)tsys__st_malloc((size_t)sf.n * sizeof *list);
    int made = 0;
    if (!list) s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", path);
    for (int i = 0; s == TSYS_OK && i < sf.n; i++) {
        const tsys__st_entry *e = &sf.entries[i];
        if (e->ndim > TSYS_MAX_DIMS) { s = tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "tensor '%s' has %d dims; tsys tensors have at most %d", e->name, e->ndim, TSYS_MAX_DIMS); break; }
        if (strlen(e->name) >= TSYS_NAME_LEN) { s = tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "tensor name '%s' is longer than %d bytes", e->name, TSYS_NAME_LEN - 1); break; }
        tsys_tensor *t = tsys_tensor_new(ctx, e->dtype, dev, e->ndim, e->shape);
        if (!t) { s = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM; break; }
        list[made++] = t;
        tsys_tensor_set_name(t, "%s", e->name);
        s = tsys__st_fill(&sf, e, t);
    }
    tsys__st_close(&sf);
    if (s != TSYS_OK) { tsys_tensor_list_free(list, made); return s; }
    *out = list; *n = made;
    return TSYS_OK;
}

// What a load into given tensors accepts beyond an exact match of names.
typedef struct tsys__st_rules {
    bool allow_missing;      // a tensor the file lacks keeps its values (else: an error naming it)
    bool refuse_unexpected;  // a file tensor no given tensor asks for is an error naming it (else: skipped)
    const char *owner;       // what the given tensors are, for messages: "the model"
    bool rename;             // file names through tsys__st_names (a model's load: prefixes, HF Llama)
    int rope_heads;          // with rename: the model's heads, for HF q/k rows
} tsys__st_rules;

// ---- names of other tools -----------------------------------------------------------------------------
//
// A model's load (tsys_model_load_ex) reads each file name as tsys would name the tensor:
//  - leading "_orig_mod." (torch.compile) and "module." (DistributedDataParallel, FSDP) prefixes are
//    dropped, name by name, any number of them in any order ("module._orig_mod.layers.0..." is
//    "layers.0..."); two file names that come to the same name are an error naming both;
//  - a Hugging Face LlamaForCausalLM checkpoint (one whose names, prefixes dropped, include
//    "model.embed_tokens.weight" or start with "model.layers.") has its names mapped:
//        model.embed_tokens.weight                       token_embeddings.weight
//        model.layers.N.self_attn.{q,k,v}_proj.weight    layers.N.attn.{q,k,v}_proj.weight
//        model.layers.N.self_attn.o_proj.weight          layers.N.attn.output_proj.weight
//        model.layers.N.mlp.gate_proj.weight             layers.N.ffn.w1.weight   (silu(w1 x) * w3 x)
//        model.layers.N.mlp.up_proj.weight               layers.N.ffn.w3.weight
//        model.layers.N.mlp.down_proj.weight             layers.N.ffn.w2.weight
//        model.layers.N.input_layernorm.weight           layers.N.ln1.weight
//        model.layers.N.post_attention_layernorm.weight  layers.N.ln2.weight
//        model.norm.weight                               ln_final.weight
//        lm_head.weight                                  lm_head.weight (absent: tied, embed_tokens' copy)
//    q_proj and k_proj rows go from HF's rotate-half RoPE layout to tsys's interleaved pairs
//    (tsys__st_unrotate_half), and "rotary_emb.inv_freq" buffers of older files are skipped. Grouped-
//    query attention (k_proj, v_proj with fewer rows than q_proj) is refused: tsys has one key/value
//    head per query head.
// Other names are kept; under the strict rules they are errors naming them.
typedef struct tsys__st_names {
    char **name;             // per file entry: its tsys name (NULL: skipped)
    bool *rope;              // per file entry: an HF q/k projection
    tsys__st_index index;    // tsys names -> entries
    bool hf;
} tsys__st_names;

static const char *tsys__st_strip(const char *name) {
    for (;;) {
        if (strncmp(name, "_orig_mod.", 10) == 0) name += 10;
        else if (strncmp(name, "module.", 7) == 0) name += 7;
        else return name;
    }
}

static const struct { const char *hf, *tsys; bool rope; } tsys__st_hf_layer[] = {
    {"self_attn.q_proj.weight", "attn.q_proj.weight", true}, {"self_attn.k_proj.weight", "attn.k_proj.weight", true},
    {"self_attn.v_proj.weight", "attn.v_proj.weight", false}, {"self_attn.o_proj.weight", "attn.output_proj.weight", false},
    {"mlp.gate_proj.weight", "ffn.w1.weight", false}, {"mlp.up_proj.weight", "ffn.w3.weight", false},
    {"mlp.down_proj.weight", "ffn.w2.weight", false}, {"input_layernorm.weight", "ln1.weight", false},
    {"post_attention_layernorm.weight", "ln2.weight", false},
};

static bool tsys__st_is_hf_name(const char *n) {
    return strcmp(n, "model.embed_tokens.weight") == 0 || strncmp(n, "model.layers.", 13) == 0;
}

// The tsys name of a file name (prefixes dropped; hf: mapped) into out (len bytes); *rope when it is an
// HF q/k projection; false when the name is a buffer to skip.
static bool tsys__st_tsys_name(const char *file_name, bool hf, char *out, size_t len, bool *rope) {
    const char *n = tsys__st_strip(file_name);
    *rope = false;
    snprintf(out, len, "%s", n);
    if (!hf) return true;
    static const char buffer[] = ".rotary_emb.inv_freq";
    size_t nl = strlen(n), bl = sizeof buffer - 1;
    if (nl >= bl && strcmp(n + nl - bl, buffer) == 0) return false;
    if (strcmp(n, "model.embed_tokens.weight") == 0) snprintf(out, len, "token_embeddings.weight");
    else if (strcmp(n, "model.norm.weight") == 0) snprintf(out, len, "ln_final.weight");
    else if (strncmp(n, "model.layers.", 13) == 0 && n[13] >= '0' && n[13] <= '9') {
        const char *p = n + 13;
        long layer = 0;
        while (*p >= '0' && *p <= '9' && layer < 100000000) layer = 10 * layer + (*p++ - '0');
        if (*p++ != '.') return true;
        for (size_t i = 0; i < sizeof tsys__st_hf_layer / sizeof tsys__st_hf_layer[0]; i++)
            if (strcmp(p, tsys__st_hf_layer[i].hf) == 0) {
                snprintf(out, len, "layers.%ld.%s", layer, tsys__st_hf_layer[i].tsys);
                *rope = tsys__st_hf_layer[i].rope;
            }
    }
    return true;
}

static void tsys__st_names_free(tsys__st_names *nm, int n) {
    for (int i = 0; nm->name && i < n; i++) tsys__st_free(nm->name[i]);
    tsys__st_free(nm->name);
    tsys__st_free(nm->rope);
    tsys__st_index_free(&nm->index);
    memset(nm, 0, sizeof *nm);
}

static tsys_status tsys__st_names_make(tsys__st_file *sf, tsys__st_names *nm) {
    memset(nm, 0, sizeof *nm);
    for (int i = 0; i < sf->n && !nm->hf; i++) nm->hf = tsys__st_is_hf_name(tsys__st_strip(sf->entries[i].name));
    nm->name = (char **)tsys__st_malloc((size_t)sf->n * sizeof *nm->name);
    nm->rope = (bool *)tsys__st_malloc((size_t)sf->n * sizeof *nm->rope);
    if (!nm->name || !nm->rope) { tsys__st_names_free(nm, 0); return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", sf->path); }
    memset(nm->name, 0, (size_t)sf->n * sizeof *nm->name);
    for (int i = 0; i < sf->n; i++) {
        size_t len = strlen(sf->entries[i].name) + 64;
        char *buf = (char *)tsys__st_malloc(len);
        int earlier = -1;
        if (!buf) { tsys__st_names_free(nm, sf->n); return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", sf->path); }
        if (!tsys__st_tsys_name(sf->entries[i].name, nm->hf, buf, len, &nm->rope[i])) { tsys__st_free(buf); continue; }
        nm->name[i] = buf;
        if (!tsys__st_index_add(&nm->index, buf, i, &earlier)) { tsys__st_names_free(nm, sf->n); return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", sf->path); }
        if (earlier >= 0) {
            tsys_status s = tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensors '%s' and '%s' both load as '%s' (%s)", sf->entries[earlier].name,
                                          sf->entries[i].name, buf, nm->hf ? "prefixes _orig_mod./module. dropped, Hugging Face names mapped" : "prefixes _orig_mod./module. dropped");
            tsys__st_names_free(nm, sf->n);
            return s;
        }
    }
    return TSYS_OK;
}

// Whether entry e can fill t (same shape, a dtype it converts from); else an error naming t.
static tsys_status tsys__st_check_match(tsys__st_file *sf, const tsys__st_entry *e, const tsys_tensor *t) {
    bool same = e->ndim == t->ndim;
    for (int d = 0; same && d < e->ndim; d++) same = e->shape[d] == t->shape[d];
    if (!same) {
        char a[160], b[160];
        return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': shape mismatch: file %s, tensor %s", t->name,
                             tsys__st_shape_str(a, sizeof a, e->ndim, e->shape), tsys__st_shape_str(b, sizeof b, t->ndim, t->shape));
    }
    if (!tsys__st_convertible(e->dtype, t->dtype))
        return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s': dtype mismatch: file %s, tensor %s", t->name,
                             tsys__st_dtype_str(e->dtype), tsys_dtype_name(t->dtype));
    return TSYS_OK;
}

// With refuse_unexpected: the first file tensor (in header order) that no given tensor matched is an
// error naming it, with the count of such tensors. Entries nm skips (NULL names) are not counted.
static tsys_status tsys__st_check_unexpected(tsys__st_file *sf, const int *match, int n, const tsys__st_rules *rules, const tsys__st_names *nm) {
    bool *wanted = (bool *)tsys__st_malloc((size_t)sf->n * sizeof *wanted);
    if (!wanted) return tsys_ctx_set_error(sf->ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", sf->path);
    memset(wanted, 0, (size_t)sf->n * sizeof *wanted);
    for (int k = 0; nm && nm->name && k < sf->n; k++) if (!nm->name[k]) wanted[k] = true;
    for (int i = 0; i < n; i++) if (match[i] >= 0) wanted[match[i]] = true;
    int first = -1, extra = 0;
    for (int k = 0; k < sf->n; k++) if (!wanted[k]) { extra++; if (first < 0) first = k; }
    tsys__st_free(wanted);
    if (!extra) return TSYS_OK;
    return tsys__st_fail(sf->ctx, TSYS_ERR_IO, sf->path, "tensor '%s' is in the file but not in %s (%d such tensor%s; the load is strict, "
                         "like load_state_dict(strict=True): tsys_model_load_ex's .allow_unexpected skips them)",
                         sf->entries[first].name, rules->owner, extra, extra == 1 ? "" : "s");
}

// Matches every tensor by name, checks them all against the rules, then fills them: a refused load
// writes nothing.
static tsys_status tsys__st_load_into(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n, const tsys__st_rules *rules) {
    tsys__st_file sf;
    tsys_status s = tsys__st_open(ctx, path, &sf);
    if (s != TSYS_OK) return s;
    tsys__st_names nm;
    memset(&nm, 0, sizeof nm);
    if (rules->rename && (s = tsys__st_names_make(&sf, &nm)) != TSYS_OK) { tsys__st_close(&sf); return s; }
    const tsys__st_index *index = rules->rename ? &nm.index : &sf.names;
    int *match = (int *)tsys__st_malloc((size_t)n * sizeof *match);
    if (!match) { tsys__st_names_free(&nm, sf.n); tsys__st_close(&sf); return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory", path); }
    for (int i = 0; s == TSYS_OK && i < n; i++) {
        tsys_tensor *t = tensors[i];
        if (!t) { s = tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_safetensors_load_into: tensors[%d] is NULL", i); break; }
        int k = match[i] = tsys__st_index_find(index, t->name);
        if (k < 0 && nm.hf && strcmp(t->name, "lm_head.weight") == 0)   // tied to the embedding: save_pretrained leaves it out
            k = match[i] = tsys__st_index_find(index, "token_embeddings.weight");
        const tsys__st_entry *e = k >= 0 ? &sf.entries[k] : NULL;
        if (e && nm.hf && e->ndim == 2 && t->ndim == 2 && e->shape[1] == t->shape[1] && e->shape[0] < t->shape[0] && (nm.rope[k] || strstr(t->name, ".attn.v_proj.")))
            s = tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "tensor '%s': %lld rows for the model's %lld: grouped-query attention (num_key_value_heads < "
                              "num_attention_heads) is not supported; tsys models have one key/value head per query head", e->name, (long long)e->shape[0], (long long)t->shape[0]);
        else if (e) s = tsys__st_check_match(&sf, e, t);
        else if (!rules->allow_missing)
            s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "tensor '%s' is missing from the file (it holds %d tensors%s)", t->name, sf.n,
                              nm.hf ? "; read as a Hugging Face Llama checkpoint" : "");
    }
    if (s == TSYS_OK && rules->refuse_unexpected) s = tsys__st_check_unexpected(&sf, match, n, rules, &nm);
    for (int i = 0; s == TSYS_OK && i < n; i++)
        if (match[i] >= 0) s = tsys__st_fill_ex(&sf, &sf.entries[match[i]], tensors[i], nm.hf && nm.rope[match[i]] ? rules->rope_heads : 0);
    tsys__st_free(match);
    tsys__st_names_free(&nm, sf.n);
    tsys__st_close(&sf);
    return s;
}

// Each given tensor must be in the file; the file may hold more.
TSYSDEF tsys_status tsys_safetensors_load_into(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n) {
    if (!ctx || !path || (n > 0 && !tensors) || n < 0) return ctx ? tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_safetensors_load_into: bad arguments") : TSYS_ERR_INVALID_ARGS;
    const tsys__st_rules rules = { false, false, "the tensors asked for", false, 0 };
    return tsys__st_load_into(ctx, path, tensors, n, &rules);
}

// ---- saving ---------------------------------------------------------------------------------------

typedef struct tsys__st_buf { char *p; size_t len, cap; bool oom; } tsys__st_buf;

static void tsys__st_put(tsys__st_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->len + n) cap *= 2;
        char *p = (char *)tsys__st_realloc(b->p, cap);
        if (!p) { b->oom = true; return; }
        b->p = p; b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void tsys__st_putf(tsys__st_buf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) tsys__st_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

// A JSON string literal: quotes, backslashes and control bytes escaped, everything else verbatim.
static void tsys__st_put_json_string(tsys__st_buf *b, const char *s) {
    tsys__st_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') { char e[2] = { '\\', (char)c }; tsys__st_put(b, e, 2); }
        else if (c < 0x20) tsys__st_putf(b, "\\u%04x", c);
        else tsys__st_put(b, (const char *)&c, 1);
    }
    tsys__st_put(b, "\"", 1);
}

// Whether tensors[i] can be saved: a NULL, a missing, reserved or non-UTF-8 name and a bad dtype are
// refused, and so is a name an earlier tensor has (names holds those).
// The name tensors[i] is saved under: names[i] when the caller gives names (the training state's
// "optim.state.<param>.exp_avg_sq" outgrow a tensor's own TSYS_NAME_LEN), else the tensor's.
static const char *tsys__st_save_name(tsys_tensor *const *tensors, const char *const *names, int i) {
    return names ? (names[i] ? names[i] : "") : tensors[i]->name;
}

static tsys_status tsys__st_check_savable(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, const char *const *names, int i, tsys__st_index *seen) {
    const tsys_tensor *t = tensors[i];
    if (!t) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: tensors[%d] is NULL", i);
    const char *name = tsys__st_save_name(tensors, names, i);
    if (!name[0]) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: tensors[%d] has no name", i);
    if (strcmp(name, "__metadata__") == 0) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: '__metadata__' is reserved");
    for (const unsigned char *c = (const unsigned char *)name, *e = c + strlen(name); c < e; ) {
        int k = tsys__st_utf8_len(c, e);   // what the loader (and PyTorch) would refuse to read back
        if (!k) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: tensors[%d]'s name is not valid UTF-8 (byte %d)", i, (int)(c - (const unsigned char *)name));
        c += k;
    }
    int earlier = -1;
    if (!tsys__st_index_add(seen, name, i, &earlier)) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory checking names", path);
    if (earlier >= 0)
        return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: tensor name '%s' used twice (tensors[%d] and [%d])", name, earlier, i);
    if (!tsys__st_dtype_str(t->dtype)) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save tensor '%s': bad dtype %d", name, (int)t->dtype);
    return TSYS_OK;
}

// The JSON header, padded with spaces so the data buffer starts 8-byte aligned. "__metadata__" holds
// "format": "pt" (unless meta gives "format") and meta's nmeta key/value pairs.
static tsys_status tsys__st_build_header(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, const char *const *tnames, int n,
                                         const char *const *meta, int nmeta, tsys__st_buf *b) {
    uint64_t at = 0;
    bool own_format = false;
    for (int i = 0; i < nmeta; i++) {
        if (!meta[2 * i] || !meta[2 * i + 1]) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: metadata pair %d has a NULL string", i);
        for (int j = 0; j < i; j++)
            if (strcmp(meta[2 * i], meta[2 * j]) == 0) return tsys__st_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "cannot save: metadata key '%s' given twice", meta[2 * i]);
        own_format |= strcmp(meta[2 * i], "format") == 0;
    }
    tsys__st_index names;
    memset(&names, 0, sizeof names);
    tsys__st_put(b, "{\"__metadata__\":{", 17);
    if (!own_format) tsys__st_put(b, "\"format\":\"pt\"", 13);
    for (int i = 0; i < nmeta; i++) {
        if (i || !own_format) tsys__st_put(b, ",", 1);
        tsys__st_put_json_string(b, meta[2 * i]);
        tsys__st_put(b, ":", 1);
        tsys__st_put_json_string(b, meta[2 * i + 1]);
    }
    tsys__st_put(b, "}", 1);
    for (int i = 0; i < n; i++) {
        const tsys_tensor *t = tensors[i];
        tsys_status s = tsys__st_check_savable(ctx, path, tensors, tnames, i, &names);
        if (s != TSYS_OK) { tsys__st_index_free(&names); return s; }
        uint64_t bytes = tsys_tensor_bytes(t);
        tsys__st_put(b, ",", 1);
        tsys__st_put_json_string(b, tsys__st_save_name(tensors, tnames, i));
        tsys__st_putf(b, ":{\"dtype\":\"%s\",\"shape\":[", tsys__st_dtype_str(t->dtype));
        for (int d = 0; d < t->ndim; d++) tsys__st_putf(b, d ? ",%lld" : "%lld", (long long)t->shape[d]);
        tsys__st_putf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)at, (unsigned long long)(at + bytes));
        at += bytes;
    }
    tsys__st_index_free(&names);
    tsys__st_put(b, "}", 1);
    while (!b->oom && b->len % 8) tsys__st_put(b, " ", 1);
    if (b->oom) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': out of memory building the header", path);
    return TSYS_OK;
}

// The size and CRC-32C of the bytes a save wrote (the training state's manifest records them).
typedef struct tsys__crc32c tsys__crc32c;   // >>state
static uint32_t tsys__crc32c_update(const tsys__crc32c *c, uint32_t crc, const void *data, size_t n);
typedef struct tsys__st_sum { const tsys__crc32c *crc; uint32_t value; uint64_t bytes; } tsys__st_sum;

// fwrite that also adds what it wrote to sum (when given).
static bool tsys__st_fwrite(FILE *f, const void *p, size_t n, tsys__st_sum *sum) {
    if (n && fwrite(p, 1, n, f) != n) return false;
    if (sum) { sum->value = tsys__crc32c_update(sum->crc, sum->value, p, n); sum->bytes += n; }
    return true;
}

// Header length, header, then each tensor's bytes (fetched to the host if it lives elsewhere).
static tsys_status tsys__st_write(tsys_ctx *ctx, const char *path, FILE *f, const tsys__st_buf *hdr, tsys_tensor **tensors,
                                  const char *const *names, int n, tsys__st_sum *sum) {
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hdr->len >> (8 * i));
    if (!tsys__st_fwrite(f, len8, 8, sum) || !tsys__st_fwrite(f, hdr->p, hdr->len, sum))
        return tsys__st_fail(ctx, TSYS_ERR_IO, path, "write failed: %s", strerror(errno));
    void *stage = NULL;
    size_t stage_bytes = 0;
    tsys_status s = TSYS_OK;
    for (int i = 0; s == TSYS_OK && i < n; i++) {
        const tsys_tensor *t = tensors[i];
        if (!tsys__current(ctx, "safetensors save", t)) { s = TSYS_ERR_INVALID_ARGS; break; }
        size_t bytes = tsys_tensor_bytes(t);
        const void *src = t->device == TSYS_CPU ? tsys_tensor_data(t) : NULL;
        if (!src && bytes > stage_bytes) {
            void *p = tsys__st_realloc(stage, bytes);
            if (!p) { s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "safetensors '%s': tensor '%s': out of memory staging %zu bytes", path, t->name, bytes); break; }
            stage = p; stage_bytes = bytes;
        }
        if (!src && (s = tsys_tensor_to_host(ctx, t, stage)) != TSYS_OK) break;
        if (!tsys__st_fwrite(f, src ? src : stage, bytes, sum))
            s = tsys__st_fail(ctx, TSYS_ERR_IO, path, "tensor '%s': write failed: %s", tsys__st_save_name(tensors, names, i), strerror(errno));
    }
    tsys__st_free(stage);
    return s;
}

// Through tsys_atomic_file: a failed save leaves the old file, concurrent saves each leave a whole
// one, and nothing but the save's own temporary is ever written.
TSYSDEF tsys_status tsys_safetensors_save(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n) {
    return tsys_safetensors_save_ex(ctx, path, tensors, n, NULL, 0);
}

// tsys_safetensors_save_ex with the names to save the tensors under (NULL: their own) and the size
// and checksum of the file written (sum NULL: none).
static tsys_status tsys__st_save(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, const char *const *names, int n,
                                 const char *const *metadata, int n_metadata, tsys__st_sum *sum) {
    if (!tsys__st_host_is_le()) return tsys__st_fail(ctx, TSYS_ERR_UNSUPPORTED, path, "big-endian hosts are not supported");
    tsys__st_buf hdr;
    memset(&hdr, 0, sizeof hdr);
    tsys_atomic_file af;
    tsys_status s = tsys__st_build_header(ctx, path, tensors, names, n, metadata, n_metadata, &hdr);
    if (s == TSYS_OK) s = tsys_atomic_file_open(ctx, "safetensors", path, &af);
    if (s == TSYS_OK) {
        s = tsys__st_write(ctx, path, af.f, &hdr, tensors, names, n, sum);
        if (s == TSYS_OK) s = tsys_atomic_file_commit(ctx, &af);
        else tsys_atomic_file_abort(&af);
    }
    tsys__st_free(hdr.p);
    return s;
}

TSYSDEF tsys_status tsys_safetensors_save_ex(tsys_ctx *ctx, const char *path, tsys_tensor **tensors, int n, const char *const *metadata, int n_metadata) {
    if (!ctx || !path || n < 0 || (n > 0 && !tensors) || n_metadata < 0 || (n_metadata > 0 && !metadata))
        return ctx ? tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_safetensors_save: bad arguments") : TSYS_ERR_INVALID_ARGS;
    return tsys__st_save(ctx, path, tensors, NULL, n, metadata, n_metadata, NULL);
}

// A checkpoint path as given, or DIR/model.safetensors for a directory that holds one (Hugging Face's
// save_pretrained layout).
static const char *tsys__st_model_file(const char *path, char *buf, size_t len) {
#ifdef TSYS__POSIX
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        int k = snprintf(buf, len, "%s/model.safetensors", path);
        if (k > 0 && (size_t)k < len && stat(buf, &st) == 0 && S_ISREG(st.st_mode)) return buf;
    }
#else
    (void)buf; (void)len;
#endif
    return path;
}

// The "__metadata__" keys of the model's dimensions, in the order tsys_model_save writes them.
static const char *const tsys__st_dim_keys[] = {"vocab_size", "context_length", "d_model", "d_ff", "num_layers", "num_heads", "rope_theta", "eps"};
#define TSYS__ST_NUM_DIMS 8
#define TSYS__ST_NUM_INT_DIMS 6

TSYSDEF tsys_status tsys_model_save(tsys_model *m, const char *path) {
    if (!m) return TSYS_ERR_INVALID_ARGS;
    const tsys_model_desc *d = &m->desc;
    char vals[TSYS__ST_NUM_DIMS][32];
    const char *meta[2 * TSYS__ST_NUM_DIMS];
    const int ints[TSYS__ST_NUM_INT_DIMS] = {d->vocab_size, d->context_length, d->d_model, d->d_ff, d->num_layers, d->num_heads};
    for (int i = 0; i < TSYS__ST_NUM_INT_DIMS; i++) snprintf(vals[i], sizeof vals[i], "%d", ints[i]);
    snprintf(vals[6], sizeof vals[6], "%.9g", (double)d->rope_theta);   // 9 digits: the float back exactly
    snprintf(vals[7], sizeof vals[7], "%.9g", (double)d->eps);
    for (int i = 0; i < TSYS__ST_NUM_DIMS; i++) { meta[2 * i] = tsys__st_dim_keys[i]; meta[2 * i + 1] = vals[i]; }
    return tsys_safetensors_save_ex(m->ctx, path, m->params, m->num_tensors, meta, TSYS__ST_NUM_DIMS);
}

// A metadata value as a positive int (ints) or a positive finite float; false if it is not one.
static bool tsys__st_parse_dim(const char *v, bool integer, double *out) {
    char *end = NULL;
    errno = 0;
    if (!v || !*v || *v == ' ') return false;
    double x = integer ? (double)strtoll(v, &end, 10) : strtod(v, &end);
    if (errno || *end || !(x > 0) || !isfinite(x) || (integer && x > INT_MAX)) return false;
    *out = x;
    return true;
}

// Dims from the "__metadata__" of an open file (tsys_model_save's keys); err names the file and key.
static tsys_status tsys__st_desc_from_meta(const tsys__st_file *sf, tsys_model_desc *d, char *err, size_t err_len) {
    double v[TSYS__ST_NUM_DIMS];
    for (int i = 0; i < TSYS__ST_NUM_DIMS; i++) {
        const char *s = tsys__st_meta_get(sf, tsys__st_dim_keys[i]);
        if (!s) {
            if (err) snprintf(err, err_len, "'%s': no model dimensions: __metadata__ lacks \"%s\" (tsys_model_save writes vocab_size, "
                              "context_length, d_model, d_ff, num_layers, num_heads, rope_theta, eps)", sf->path, tsys__st_dim_keys[i]);
            return TSYS_ERR_IO;
        }
        if (!tsys__st_parse_dim(s, i < TSYS__ST_NUM_INT_DIMS, &v[i])) {
            if (err) snprintf(err, err_len, "'%s': __metadata__ \"%s\" is \"%.40s\", not a positive %s", sf->path, tsys__st_dim_keys[i], s,
                              i < TSYS__ST_NUM_INT_DIMS ? "integer" : "number");
            return TSYS_ERR_IO;
        }
    }
    memset(d, 0, sizeof *d);
    d->vocab_size = (int)v[0]; d->context_length = (int)v[1]; d->d_model = (int)v[2]; d->d_ff = (int)v[3];
    d->num_layers = (int)v[4]; d->num_heads = (int)v[5]; d->rope_theta = (float)v[6]; d->eps = (float)v[7];
    return TSYS_OK;
}

// ---- Hugging Face config.json ---------------------------------------------------------------------

// The members of config.json that make a Llama model desc, or say it is one tsys cannot run.
enum { TSYS__HF_HIDDEN, TSYS__HF_FF, TSYS__HF_LAYERS, TSYS__HF_HEADS, TSYS__HF_VOCAB, TSYS__HF_CONTEXT, TSYS__HF_THETA, TSYS__HF_EPS,
       TSYS__HF_KV_HEADS, TSYS__HF_HEAD_DIM, TSYS__HF_ACT, TSYS__HF_ATTN_BIAS, TSYS__HF_MLP_BIAS, TSYS__HF_TYPE, TSYS__HF_ROPE_TYPE, TSYS__HF_KEYS };
static const char *const tsys__hf_keys[TSYS__HF_KEYS] = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings", "rope_theta",
    "rms_norm_eps", "num_key_value_heads", "head_dim", "hidden_act", "attention_bias", "mlp_bias", "model_type", "rope_type"};
typedef struct tsys__hf_value { int kind; double num; char str[32]; } tsys__hf_value;   // kind: 0 absent, 1 number, 2 string, 3 bool, 4 other

// One object's members into v (nested: rope_scaling / rope_parameters, whose rope_theta and
// rope_type / type count as the top level's).
static tsys_status tsys__hf_object(tsys__st_parser *P, tsys__hf_value *v, bool nested) {
    tsys_status s = tsys__st_expect(P, '{');
    if (s != TSYS_OK || tsys__st_accept(P, '}')) return s;
    do {
        char *key = NULL;
        if ((s = tsys__st_string(P, &key)) != TSYS_OK) return s;
        if ((s = tsys__st_expect(P, ':')) != TSYS_OK) { tsys__st_free(key); return s; }
        tsys__st_ws(P);
        int k = -1;
        for (int i = 0; i < TSYS__HF_KEYS; i++) if (strcmp(key, tsys__hf_keys[i]) == 0) k = i;
        if (nested && strcmp(key, "type") == 0) k = TSYS__HF_ROPE_TYPE;
        if (nested && k != TSYS__HF_THETA && k != TSYS__HF_ROPE_TYPE) k = -1;
        char c = P->p < P->end ? *P->p : 0;
        if (!nested && c == '{' && (strcmp(key, "rope_scaling") == 0 || strcmp(key, "rope_parameters") == 0)) {
            P->depth++;
            s = P->depth > TSYS__ST_MAX_DEPTH ? tsys__st_syntax(P, "nested too deeply") : tsys__hf_object(P, v, true);
            P->depth--;
        } else if (k < 0) s = tsys__st_skip_value(P);
        else if (c == '"') {
            char *str = NULL;
            if ((s = tsys__st_string(P, &str)) == TSYS_OK) { v[k].kind = 2; snprintf(v[k].str, sizeof v[k].str, "%s", str); }
            tsys__st_free(str);
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            const char *at = P->p;
            char num[64];
            if ((s = tsys__st_skip_number(P)) == TSYS_OK) {
                snprintf(num, sizeof num, "%.*s", (int)(P->p - at < 63 ? P->p - at : 63), at);
                v[k].kind = 1; v[k].num = strtod(num, NULL);
            }
        } else if (c == 't' || c == 'f') {
            v[k].kind = 3; v[k].num = c == 't';
            s = tsys__st_skip_literal(P, c == 't' ? "true" : "false");
        } else { v[k].kind = 4; s = tsys__st_skip_value(P); }
        tsys__st_free(key);
        if (s != TSYS_OK) return s;
    } while (tsys__st_accept(P, ','));
    return tsys__st_expect(P, '}');
}

#define TSYS__HF_FAIL(...) do { if (err) snprintf(err, err_len, __VA_ARGS__); return TSYS_ERR_IO; } while (0)

// A Llama model desc from the config.json at cfg; err names the file and the key.
static tsys_status tsys__hf_config(tsys_ctx *ctx, const char *cfg, tsys_model_desc *d, char *err, size_t err_len) {
    FILE *f = fopen(cfg, "rb");
    if (!f) TSYS__HF_FAIL("'%s': cannot open: %s (a Hugging Face checkpoint's dims are read from the config.json beside it)", cfg, strerror(errno));
    size_t cap = 1 << 20, n;
    char *text = (char *)tsys__st_malloc(cap);
    n = text ? fread(text, 1, cap, f) : 0;
    fclose(f);
    if (!text) TSYS__HF_FAIL("'%s': out of memory", cfg);
    if (n == cap) { tsys__st_free(text); TSYS__HF_FAIL("'%s': larger than 1 MiB; not a model config", cfg); }
    tsys__st_file sf;
    memset(&sf, 0, sizeof sf);
    sf.ctx = ctx; sf.path = cfg;
    tsys__st_parser P = { &sf, text, text, text + n, 0, NULL };
    tsys__hf_value v[TSYS__HF_KEYS];
    memset(v, 0, sizeof v);
    tsys__st_ws(&P);
    tsys_status s = tsys__hf_object(&P, v, false);
    tsys__st_free(text);
    if (s != TSYS_OK) TSYS__HF_FAIL("%s", tsys_ctx_last_error(ctx));
    for (int k = 0; k < TSYS__HF_KEYS; k++) {
        bool integer = k <= TSYS__HF_CONTEXT || k == TSYS__HF_KV_HEADS || k == TSYS__HF_HEAD_DIM, real = k == TSYS__HF_THETA || k == TSYS__HF_EPS;
        bool flag = k == TSYS__HF_ATTN_BIAS || k == TSYS__HF_MLP_BIAS, text_key = k == TSYS__HF_ACT || k == TSYS__HF_TYPE || k == TSYS__HF_ROPE_TYPE;
        if (!v[k].kind) {
            if (k <= TSYS__HF_VOCAB) TSYS__HF_FAIL("'%s': no \"%s\"", cfg, tsys__hf_keys[k]);
            continue;
        }
        if ((integer || real) && (v[k].kind != 1 || !(v[k].num > 0) || v[k].num > INT_MAX || (integer && v[k].num != floor(v[k].num))))
            TSYS__HF_FAIL("'%s': \"%s\" is not a positive %s", cfg, tsys__hf_keys[k], integer ? "integer" : "number");
        if (flag && v[k].kind != 3) TSYS__HF_FAIL("'%s': \"%s\" is not true or false", cfg, tsys__hf_keys[k]);
        if (text_key && v[k].kind != 2) TSYS__HF_FAIL("'%s': \"%s\" is not a string", cfg, tsys__hf_keys[k]);
    }
    int hidden = (int)v[TSYS__HF_HIDDEN].num, heads = (int)v[TSYS__HF_HEADS].num;
    if (v[TSYS__HF_TYPE].kind && strcmp(v[TSYS__HF_TYPE].str, "llama") != 0) TSYS__HF_FAIL("'%s': \"model_type\" is \"%s\"; tsys reads Llama checkpoints", cfg, v[TSYS__HF_TYPE].str);
    if (v[TSYS__HF_KV_HEADS].kind && (int)v[TSYS__HF_KV_HEADS].num != heads)
        TSYS__HF_FAIL("'%s': \"num_key_value_heads\" %d differs from \"num_attention_heads\" %d: grouped-query attention is not supported "
                      "(tsys models have one key/value head per query head)", cfg, (int)v[TSYS__HF_KV_HEADS].num, heads);
    if (v[TSYS__HF_HEAD_DIM].kind && (int)v[TSYS__HF_HEAD_DIM].num * heads != hidden)
        TSYS__HF_FAIL("'%s': \"head_dim\" %d is not hidden_size / num_attention_heads (%d / %d); tsys heads split d_model", cfg, (int)v[TSYS__HF_HEAD_DIM].num, hidden, heads);
    if (v[TSYS__HF_ACT].kind && strcmp(v[TSYS__HF_ACT].str, "silu") != 0) TSYS__HF_FAIL("'%s': \"hidden_act\" is \"%s\"; tsys's SwiGLU is silu", cfg, v[TSYS__HF_ACT].str);
    if (v[TSYS__HF_ROPE_TYPE].kind && strcmp(v[TSYS__HF_ROPE_TYPE].str, "default") != 0)
        TSYS__HF_FAIL("'%s': RoPE \"rope_type\" is \"%s\"; tsys has plain RoPE (\"default\") only", cfg, v[TSYS__HF_ROPE_TYPE].str);
    for (int k = TSYS__HF_ATTN_BIAS; k <= TSYS__HF_MLP_BIAS; k++)
        if (v[k].kind && v[k].num) TSYS__HF_FAIL("'%s': \"%s\" is true; tsys projections have no biases", cfg, tsys__hf_keys[k]);
    memset(d, 0, sizeof *d);
    d->d_model = hidden; d->d_ff = (int)v[TSYS__HF_FF].num; d->num_layers = (int)v[TSYS__HF_LAYERS].num; d->num_heads = heads;
    d->vocab_size = (int)v[TSYS__HF_VOCAB].num;
    d->context_length = v[TSYS__HF_CONTEXT].kind ? (int)v[TSYS__HF_CONTEXT].num : 2048;
    d->rope_theta = v[TSYS__HF_THETA].kind ? (float)v[TSYS__HF_THETA].num : 10000.0f;
    d->eps = v[TSYS__HF_EPS].kind ? (float)v[TSYS__HF_EPS].num : 1e-6f;
    return TSYS_OK;
}
#undef TSYS__HF_FAIL

// Whether the open file holds Hugging Face Llama names.
static bool tsys__st_file_is_hf(const tsys__st_file *sf) {
    for (int i = 0; i < sf->n; i++) if (tsys__st_is_hf_name(tsys__st_strip(sf->entries[i].name))) return true;
    return false;
}

TSYSDEF tsys_status tsys_model_desc_from_file(const char *path, tsys_model_desc *out, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (!path || !out) { if (err) snprintf(err, err_len, "tsys_model_desc_from_file: NULL argument"); return TSYS_ERR_INVALID_ARGS; }
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    if (!ctx) { if (err) snprintf(err, err_len, "'%s': out of memory", path); return TSYS_ERR_OOM; }
    char file[4096], cfg[4096];
    const char *fpath = tsys__st_model_file(path, file, sizeof file);
    tsys__st_file sf;
    tsys_status s = tsys__st_open(ctx, fpath, &sf);
    tsys_model_desc d;
    if (s != TSYS_OK) { if (err) snprintf(err, err_len, "%s", tsys_ctx_last_error(ctx)); }
    else {
        bool hf = !tsys__st_meta_get(&sf, "d_model") && tsys__st_file_is_hf(&sf);
        if (!hf) s = tsys__st_desc_from_meta(&sf, &d, err, err_len);
        tsys__st_close(&sf);
        if (hf) {   // config.json in the directory of the file
            const char *slash = strrchr(fpath, '/');
            int dir_len = slash ? (int)(slash - fpath) : 1;
            snprintf(cfg, sizeof cfg, "%.*s/config.json", dir_len, slash ? fpath : ".");
            tsys_ctx_clear_error(ctx);
            s = tsys__hf_config(ctx, cfg, &d, err, err_len);
        }
    }
    char why[256];
    if (s == TSYS_OK && tsys_model_desc_validate(&d, why, sizeof why) != TSYS_OK) {
        if (err) snprintf(err, err_len, "'%s': the dimensions in its __metadata__ make no model: %s", path, why);
        s = TSYS_ERR_IO;
    }
    if (s == TSYS_OK) *out = d;
    tsys_ctx_free(ctx);
    return s;
}
TSYSDEF tsys_status tsys_model_load(tsys_model *m, const char *path) { return tsys_model_load_ex(m, path, NULL); }

// Strict unless desc says otherwise (tsys_model_load_desc in >>public).
TSYSDEF tsys_status tsys_model_load_ex(tsys_model *m, const char *path, const tsys_model_load_desc *desc) {
    if (!m || !path) return m ? tsys_ctx_set_error(m->ctx, TSYS_ERR_INVALID_ARGS, "tsys_model_load: NULL path") : TSYS_ERR_INVALID_ARGS;
    tsys_model_load_desc d;
    memset(&d, 0, sizeof d);
    if (desc) d = *desc;
    const tsys__st_rules rules = { d.allow_missing, !d.allow_unexpected, "the model", true, m->desc.num_heads };
    char file[4096];
    return tsys__st_load_into(m->ctx, tsys__st_model_file(path, file, sizeof file), m->params, m->num_tensors, &rules);
}

// >>state -----------------------------------------------------------------------------------------
//
// Training-state snapshots (tsys_state_* in >>public; the format in docs/design/state.md).
//
// Crash safety rests on one rule: a snapshot is visible under its final name only once every byte of
// it is on the disk. Files are written into a temporary directory DIR/.tmp-<pid>@<host>-XXXXXX
// (tsys_atomic_file: each file fsynced, the directory fsynced), the MANIFEST last; the directory is
// then renamed to its final name and DIR fsynced. Removing a snapshot goes the other way: renamed to a
// temporary first (DIR fsynced), its files unlinked after, so a crash mid-removal leaves a temporary,
// never a snapshot with files missing. A temporary whose process is dead (same host, kill(pid, 0)
// says ESRCH) is removed by the next save; loads and tsys_state_latest never look at one.
//
// Integrity: MANIFEST records each file's size and CRC-32C, and ends with its own CRC-32C; a load
// verifies all of them before reading a tensor, so a truncated, torn or altered file (or manifest)
// is an error naming it and nothing is written. CRC-32C (Castagnoli) detects every error burst of up
// to 32 bits and any odd number of flipped bits. The SSE4.2 crc32 instruction computes it where the
// CPU has it (detected at run time; 4.2 GB/s on one core of the test machine), slicing-by-8 tables
// elsewhere (1.3 GB/s there).
//
// Which snapshot is newest: the serial number, one more than the highest in DIR at save time. Step
// numbers can go back (a run restarted from an earlier snapshot), the order of saves cannot.
//
// Sharded snapshots (ZeRO-1, FSDP: tsys_dist.h >>state sharded) are made of the same pieces, public:
// tsys_state_begin makes the temporary, every process writes its part into it (tsys_state_part_write:
// chunks of global tensors, each chunk's place in the metadata), one commits (tsys_state_commit: the
// MANIFEST with world= and layout=, the rename, keep_last). The reader serves element ranges of global
// tensors from whatever chunks hold them, plain snapshots' whole tensors included.

#ifdef TSYS__POSIX
#include <dirent.h>
#include <signal.h>
#include <pthread.h>
#endif

#define TSYS__STATE_VERSION   1
#define TSYS__STATE_VERSION_STR "1"   // the same, as a metadata value
#define TSYS__STATE_MODEL     "model.safetensors"
#define TSYS__STATE_TRAIN     "train_state.safetensors"
#define TSYS__STATE_MANIFEST  "MANIFEST"
#define TSYS__STATE_TMP       ".tmp-"      // a snapshot being written or removed
#define TSYS__STATE_OLD       ".old-"      // a snapshot moved aside by a new one of its name
#define TSYS__STATE_PATH      4096
#define TSYS__STATE_NAME      256         // bytes of a snapshot's name, NUL included (as dirent's d_name)
#define TSYS__STATE_MAX_FILES TSYS_STATE_MAX_PARTS
#define TSYS__STATE_MANIFEST_MAX 65536
#define TSYS__STATE_META      (2 * TSYS_STATE_MAX_USER + 24)   // metadata pairs of train_state.safetensors

// ---- CRC-32C ----------------------------------------------------------------------------------------

struct tsys__crc32c {
    uint32_t table[8][256];   // slicing-by-8: table[k][b] is the CRC of byte b followed by k zero bytes
    bool hw;                  // the SSE4.2 crc32 instruction is there
};

#define TSYS__CRC32C_POLY 0x82F63B78u   // Castagnoli's polynomial, bit-reflected

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define TSYS__CRC32C_HW 1
__attribute__((target("sse4.2"))) static uint32_t tsys__crc32c_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
    }
    crc = (uint32_t)c;
    for (; n; n--) crc = __builtin_ia32_crc32qi(crc, *p++);
    return crc;
}
#endif

static void tsys__crc32c_init(tsys__crc32c *c) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t r = b;
        for (int k = 0; k < 8; k++) r = r & 1 ? (r >> 1) ^ TSYS__CRC32C_POLY : r >> 1;
        c->table[0][b] = r;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++) c->table[k][b] = (c->table[k - 1][b] >> 8) ^ c->table[0][c->table[k - 1][b] & 0xff];
    c->hw = false;
#ifdef TSYS__CRC32C_HW
    c->hw = __builtin_cpu_supports("sse4.2");
#endif
}

// The CRC-32C of data following bytes whose CRC-32C is crc (0 to start): chained calls give the CRC
// of the concatenation. The bytes are read as little-endian words (the host is, as safetensors needs).
static uint32_t tsys__crc32c_update(const tsys__crc32c *c, uint32_t crc, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    crc = ~crc;
#ifdef TSYS__CRC32C_HW
    if (c->hw) return ~tsys__crc32c_hw(crc, p, n);
#endif
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = c->table[7][w & 0xff] ^ c->table[6][(w >> 8) & 0xff] ^ c->table[5][(w >> 16) & 0xff] ^ c->table[4][(w >> 24) & 0xff] ^
              c->table[3][(w >> 32) & 0xff] ^ c->table[2][(w >> 40) & 0xff] ^ c->table[1][(w >> 48) & 0xff] ^ c->table[0][w >> 56];
    }
    for (; n; n--) crc = c->table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#ifdef TSYS__POSIX

// ---- errors and paths -----------------------------------------------------------------------------

// Every message starts with "state '<path>': ", the snapshot or directory concerned.
static tsys_status tsys__state_fail(tsys_ctx *ctx, tsys_status s, const char *path, const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return tsys_ctx_set_error(ctx, s, "state '%s': %s", path, msg);
}

// "a/b" into buf; false when it does not fit.
static bool tsys__state_join(char *buf, size_t len, const char *a, const char *b) {
    int k = snprintf(buf, len, "%s/%s", a, b);
    return k > 0 && (size_t)k < len;
}

static bool tsys__state_is_dir(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

// Makes the directory entries of dir (a rename, an unlink) survive a crash; as in >>atomic files, a
// file system that cannot sync a directory (EINVAL, ENOTSUP) is as durable as it gets.
static tsys_status tsys__state_sync_dir(tsys_ctx *ctx, const char *dir) {
    int fd = open(dir, O_RDONLY | O_CLOEXEC), e = 0;
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP)) e = errno;
    if (fd >= 0) close(fd);
    if (e) return tsys__state_fail(ctx, TSYS_ERR_IO, dir, "cannot sync the directory: %s", strerror(e));
    return TSYS_OK;
}

// This host's name, for temporaries: the writer of one is known by host and pid. '-', '/' and '@' are
// replaced: the name is parsed back up to its last '-'.
static void tsys__state_host(char *buf, size_t len) {
    if (gethostname(buf, len) != 0) snprintf(buf, len, "host");
    buf[len - 1] = 0;
    for (char *c = buf; *c; c++) if (*c == '-' || *c == '/' || *c == '@') *c = '_';
}

// dir/.tmp-<pid>@<host>-XXXXXX (the X's filled by tsys__atomic_fill_name).
static bool tsys__state_tmp_name(char *buf, size_t len, const char *dir) {
    char host[64];
    tsys__state_host(host, sizeof host);
    int k = snprintf(buf, len, "%s/" TSYS__STATE_TMP "%ld@%s-XXXXXX", dir, (long)getpid(), host);
    return k > 0 && (size_t)k < len;
}

// Makes the temporary directory tmp (its XXXXXX filled), 0755 less the umask as the snapshot's files
// are 0644 less it (mkdtemp would make it 0700); false with errno set.
static bool tsys__state_mkdir_tmp(char *tmp) {
    uint64_t seed = tsys__atomic_seed(tmp);
    for (int attempt = 0; attempt < TSYS__ATOMIC_TRIES; attempt++) {
        tsys__atomic_fill_name(tmp, &seed);
        if (mkdir(tmp, 0755) == 0) return true;
        if (errno != EEXIST) return false;
    }
    return false;
}

// Whether the temporary called name (in DIR) belongs to a process of this host that is gone.
static bool tsys__state_tmp_is_stale(const char *name) {
    const char *p = name + strlen(TSYS__STATE_TMP), *dash = strrchr(name, '-');
    char *end = NULL, host[64];
    long pid = strtol(p, &end, 10);
    if (p[0] < '0' || p[0] > '9' || !end || *end != '@' || !dash || dash < end || pid <= 1 || pid == (long)getpid()) return false;
    tsys__state_host(host, sizeof host);
    size_t hl = (size_t)(dash - end - 1);
    if (hl != strlen(host) || strncmp(end + 1, host, hl) != 0) return false;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

// Removes a directory of plain files (a snapshot or a temporary) and the directory.
static tsys_status tsys__state_rmdir_files(tsys_ctx *ctx, const char *path) {
    DIR *d = opendir(path);
    if (!d) return tsys__state_fail(ctx, TSYS_ERR_IO, path, "cannot open the directory to remove it: %s", strerror(errno));
    tsys_status s = TSYS_OK;
    char file[TSYS__STATE_PATH];
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (!e) { if (errno) s = tsys__state_fail(ctx, TSYS_ERR_IO, path, "cannot list the directory: %s", strerror(errno)); break; }
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (!tsys__state_join(file, sizeof file, path, e->d_name) || unlink(file) != 0) {
            s = tsys__state_fail(ctx, TSYS_ERR_IO, path, "cannot remove '%s': %s", e->d_name, strerror(errno));
            break;
        }
    }
    closedir(d);
    if (s == TSYS_OK && rmdir(path) != 0) s = tsys__state_fail(ctx, TSYS_ERR_IO, path, "cannot remove the directory: %s", strerror(errno));
    return s;
}

// Removes snapshot dir/name: renamed to a temporary (and dir synced) before any file goes.
static tsys_status tsys__state_remove(tsys_ctx *ctx, const char *dir, const char *name) {
    char from[TSYS__STATE_PATH], to[TSYS__STATE_PATH];
    if (!tsys__state_join(from, sizeof from, dir, name) || !tsys__state_tmp_name(to, sizeof to, dir))
        return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "path too long");
    uint64_t seed = tsys__atomic_seed(to);
    for (int attempt = 0;; attempt++) {   // rename() would replace an empty directory of that name
        tsys__atomic_fill_name(to, &seed);
        if (!tsys__state_is_dir(to) || attempt == TSYS__ATOMIC_TRIES) break;
    }
    if (rename(from, to) != 0) return tsys__state_fail(ctx, TSYS_ERR_IO, from, "cannot move the snapshot aside to remove it: %s", strerror(errno));
    tsys_status s = tsys__state_sync_dir(ctx, dir);
    return s == TSYS_OK ? tsys__state_rmdir_files(ctx, to) : s;
}

// ---- the manifest -----------------------------------------------------------------------------------
//
//   format=tsys-state
//   version=1
//   serial=7
//   step=123
//   file=model.safetensors bytes=123456 crc32c=1a2b3c4d
//   file=train_state.safetensors bytes=2345 crc32c=deadbeef
//   manifest_crc32c=0badf00d          (of every byte above this line)
//
// A sharded snapshot adds "world=N" and "layout=NAME" after step, and lists rank-00000.safetensors...

typedef struct tsys__state_manifest {
    int64_t serial, step;
    int world;                  // 0: a plain snapshot
    char layout[32];
    int nfiles;
    char file[TSYS__STATE_MAX_FILES][64];
    uint64_t bytes[TSYS__STATE_MAX_FILES];
    uint32_t crc[TSYS__STATE_MAX_FILES];
} tsys__state_manifest;

static tsys_status tsys__state_write_manifest(tsys_ctx *ctx, const tsys__crc32c *crc, const char *tmp, const tsys__state_manifest *m) {
    char path[TSYS__STATE_PATH];
    if (!tsys__state_join(path, sizeof path, tmp, TSYS__STATE_MANIFEST)) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, tmp, "path too long");
    const size_t cap = 256 + (size_t)m->nfiles * 128;   // a file line is at most ~110 bytes
    char *text = (char *)TSYS_MALLOC(cap);
    if (!text) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", tmp);
    int k = snprintf(text, cap, "format=tsys-state\nversion=%d\nserial=%lld\nstep=%lld\n", TSYS__STATE_VERSION, (long long)m->serial, (long long)m->step);
    if (m->world > 0) k += snprintf(text + k, cap - (size_t)k, "world=%d\n", m->world);
    if (m->layout[0]) k += snprintf(text + k, cap - (size_t)k, "layout=%s\n", m->layout);
    for (int i = 0; i < m->nfiles; i++)
        k += snprintf(text + k, cap - (size_t)k, "file=%s bytes=%llu crc32c=%08x\n", m->file[i], (unsigned long long)m->bytes[i], (unsigned)m->crc[i]);
    k += snprintf(text + k, cap - (size_t)k, "manifest_crc32c=%08x\n", (unsigned)tsys__crc32c_update(crc, 0, text, (size_t)k));
    tsys_atomic_file af;
    tsys_status s = tsys_atomic_file_open(ctx, "state manifest", path, &af);
    if (s == TSYS_OK && fwrite(text, 1, (size_t)k, af.f) != (size_t)k) { tsys_atomic_file_abort(&af); s = tsys__state_fail(ctx, TSYS_ERR_IO, path, "write failed: %s", strerror(errno)); }
    else if (s == TSYS_OK) s = tsys_atomic_file_commit(ctx, &af);
    TSYS_FREE(text);
    return s;
}

// One "key=value" line of the manifest into m; false when it is not one the format has.
static bool tsys__state_manifest_line(const char *line, tsys__state_manifest *m, int *seen) {
    char name[64];
    unsigned long long bytes;
    unsigned crc;
    long long v;
    int used = 0;
    if (strcmp(line, "format=tsys-state") == 0) { *seen |= 1; return true; }
    if (sscanf(line, "version=%lld%n", &v, &used) == 1 && !line[used]) { *seen |= 2; return v == TSYS__STATE_VERSION; }
    if (sscanf(line, "serial=%lld%n", &v, &used) == 1 && !line[used]) { *seen |= 4; m->serial = v; return v > 0; }
    if (sscanf(line, "step=%lld%n", &v, &used) == 1 && !line[used]) { *seen |= 8; m->step = v; return v >= 0; }
    if (sscanf(line, "world=%lld%n", &v, &used) == 1 && !line[used] && !m->world) { m->world = (int)v; return v > 0 && v <= TSYS_STATE_MAX_PARTS; }
    if (sscanf(line, "layout=%31s%n", m->layout, &used) == 1 && !line[used]) return true;
    if (sscanf(line, "file=%63s bytes=%llu crc32c=%8x%n", name, &bytes, &crc, &used) == 3 && !line[used] && m->nfiles < TSYS__STATE_MAX_FILES) {
        for (int i = 0; i < m->nfiles; i++) if (strcmp(m->file[i], name) == 0) return false;
        if (strchr(name, '/') || name[0] == '.') return false;
        snprintf(m->file[m->nfiles], sizeof m->file[0], "%s", name);
        m->bytes[m->nfiles] = bytes; m->crc[m->nfiles] = crc;
        m->nfiles++;
        return true;
    }
    return false;
}

// Reads and checks snap/MANIFEST (its own checksum first, then every line). ctx NULL: quietly.
static tsys_status tsys__state_read_manifest(tsys_ctx *ctx, const tsys__crc32c *crc, const char *snap, tsys__state_manifest *m) {
    char path[TSYS__STATE_PATH];
    memset(m, 0, sizeof *m);
    if (!tsys__state_join(path, sizeof path, snap, TSYS__STATE_MANIFEST)) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, snap, "path too long");
    FILE *f = fopen(path, "rb");
    if (!f) return tsys__state_fail(ctx, TSYS_ERR_IO, snap, "no readable MANIFEST (%s): not a snapshot, or one never completed", strerror(errno));
    char *text = (char *)TSYS_MALLOC(TSYS__STATE_MANIFEST_MAX + 1);
    size_t n = text ? fread(text, 1, TSYS__STATE_MANIFEST_MAX, f) : 0;
    bool read_error = ferror(f) != 0;
    fclose(f);
    if (!text) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", snap);
    text[n] = 0;
    tsys_status s = TSYS_OK;
    const char *tail = NULL;
    unsigned recorded = 0;
    // the last line, "manifest_crc32c=XXXXXXXX\n" (25 bytes), covers the bytes before it
    const size_t tail_len = sizeof "manifest_crc32c=XXXXXXXX\n" - 1;
    if (!read_error && n >= tail_len && n < TSYS__STATE_MANIFEST_MAX && text[n - 1] == '\n') tail = text + n - tail_len;
    bool tail_ok = tail && (tail == text || tail[-1] == '\n') && memcmp(tail, "manifest_crc32c=", 16) == 0;
    for (int i = 16; tail_ok && i < 24; i++) {   // exactly the lowercase hex the writer prints: "A" for "a" is a flipped bit
        int c = tail[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        tail_ok = d >= 0;
        recorded = recorded << 4 | (unsigned)(tail_ok ? d : 0);
    }
    if (!tail_ok)
        s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "MANIFEST is truncated or damaged (%zu bytes; it must end with its manifest_crc32c line)", n);
    else if (tsys__crc32c_update(crc, 0, text, (size_t)(tail - text)) != recorded)
        s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "MANIFEST is altered: its CRC-32C is %08x, it records %08x",
                             (unsigned)tsys__crc32c_update(crc, 0, text, (size_t)(tail - text)), recorded);
    int seen = 0;
    for (char *line = text; s == TSYS_OK && line < tail; ) {
        char *nl = strchr(line, '\n');
        *nl = 0;
        if (!tsys__state_manifest_line(line, m, &seen))
            s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "MANIFEST line '%.80s' is not one of format version %d", line, TSYS__STATE_VERSION);
        line = nl + 1;
    }
    if (s == TSYS_OK && seen != 15) s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "MANIFEST lacks its %s line", !(seen & 1) ? "format" : !(seen & 2) ? "version" : !(seen & 4) ? "serial" : "step");
    TSYS_FREE(text);
    return s;
}

// Whether snap's files are there with the sizes its manifest records (no checksums: quick).
static bool tsys__state_sizes_ok(const char *snap, const tsys__state_manifest *m) {
    char path[TSYS__STATE_PATH];
    struct stat st;
    for (int i = 0; i < m->nfiles; i++)
        if (!tsys__state_join(path, sizeof path, snap, m->file[i]) || stat(path, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != m->bytes[i]) return false;
    return true;
}

// Every file's size and CRC-32C against the manifest; the first that differs is named.
static tsys_status tsys__state_verify(tsys_ctx *ctx, const tsys__crc32c *crc, const char *snap, const tsys__state_manifest *m) {
    enum { CHUNK = 1 << 20 };
    char path[TSYS__STATE_PATH];
    unsigned char *buf = (unsigned char *)TSYS_MALLOC(CHUNK);
    if (!buf) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", snap);
    tsys_status s = TSYS_OK;
    for (int i = 0; s == TSYS_OK && i < m->nfiles; i++) {
        if (!tsys__state_join(path, sizeof path, snap, m->file[i])) { s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, snap, "path too long"); break; }
        FILE *f = fopen(path, "rb");
        if (!f) { s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "'%s' is missing (%s)", m->file[i], strerror(errno)); break; }
        uint32_t c = 0;
        uint64_t total = 0;
        size_t got;
        while ((got = fread(buf, 1, CHUNK, f)) > 0) { c = tsys__crc32c_update(crc, c, buf, got); total += got; }
        bool failed = ferror(f) != 0;
        fclose(f);
        if (failed) s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "'%s': read failed", m->file[i]);
        else if (total != m->bytes[i])
            s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "'%s' is %llu bytes, the manifest records %llu (%s)", m->file[i], (unsigned long long)total,
                                 (unsigned long long)m->bytes[i], total < m->bytes[i] ? "truncated" : "grown");
        else if (c != m->crc[i])
            s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "'%s' is altered: its CRC-32C is %08x, the manifest records %08x", m->file[i], (unsigned)c, (unsigned)m->crc[i]);
    }
    TSYS_FREE(buf);
    return s;
}

// ---- the snapshots of a directory -------------------------------------------------------------------

typedef struct tsys__state_entry { char name[TSYS__STATE_NAME]; int64_t serial; } tsys__state_entry;

static int tsys__state_cmp_serial(const void *a, const void *b) {
    const tsys__state_entry *x = (const tsys__state_entry *)a, *y = (const tsys__state_entry *)b;
    if (x->serial != y->serial) return x->serial < y->serial ? -1 : 1;
    return strcmp(x->name, y->name);
}

// The complete snapshots of dir, oldest first (*list NULL, *n 0 when there is none or dir is
// missing). With clean_stale, the temporaries of dead writers are removed on the way (best effort:
// they are invisible to loads, and the next save tries again).
static tsys_status tsys__state_scan(tsys_ctx *ctx, const tsys__crc32c *crc, const char *dir, bool clean_stale, tsys__state_entry **list, int *n) {
    *list = NULL; *n = 0;
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? TSYS_OK : tsys__state_fail(ctx, TSYS_ERR_IO, dir, "cannot list the directory: %s", strerror(errno));
    tsys_status s = TSYS_OK;
    int cap = 0;
    char path[TSYS__STATE_PATH];
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (!e) { if (errno) s = tsys__state_fail(ctx, TSYS_ERR_IO, dir, "cannot list the directory: %s", strerror(errno)); break; }
        const char *name = e->d_name;
        if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0 || strlen(name) >= TSYS__STATE_NAME) continue;
        if (!tsys__state_join(path, sizeof path, dir, name) || !tsys__state_is_dir(path)) continue;
        if (strncmp(name, TSYS__STATE_TMP, strlen(TSYS__STATE_TMP)) == 0) {
            if (clean_stale && tsys__state_tmp_is_stale(name)) tsys__state_rmdir_files(NULL, path);
            continue;
        }
        tsys__state_manifest m;
        if (tsys__state_read_manifest(NULL, crc, path, &m) != TSYS_OK || !tsys__state_sizes_ok(path, &m)) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            tsys__state_entry *grown = (tsys__state_entry *)TSYS_REALLOC(*list, (size_t)cap * sizeof *grown);
            if (!grown) { s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory listing snapshots", dir); break; }
            *list = grown;
        }
        snprintf((*list)[*n].name, TSYS__STATE_NAME, "%s", name);
        (*list)[(*n)++].serial = m.serial;
    }
    closedir(d);
    if (s != TSYS_OK) { TSYS_FREE(*list); *list = NULL; *n = 0; return s; }
    if (*n) qsort(*list, (size_t)*n, sizeof **list, tsys__state_cmp_serial);
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_state_latest(tsys_ctx *ctx, const char *dir, char *buf, size_t len) {
    TSYS__CHECK_ARG(ctx, ctx && dir && buf && len, TSYS_ERR_INVALID_ARGS, "tsys_state_latest: NULL argument or empty buffer");
    buf[0] = 0;
    tsys__crc32c crc;
    tsys__crc32c_init(&crc);
    tsys__state_entry *list;
    int n;
    tsys_status s = tsys__state_scan(ctx, &crc, dir, false, &list, &n);
    if (s == TSYS_OK && n) {
        int k = snprintf(buf, len, "%s/%s", dir, list[n - 1].name);
        if (k < 0 || (size_t)k >= len) { buf[0] = 0; s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "the path of snapshot '%s' does not fit in %zu bytes", list[n - 1].name, len); }
    }
    TSYS_FREE(list);
    return s;
}

// ---- what a desc saves ------------------------------------------------------------------------------

// The tensors of a snapshot and the names they are saved under: model.safetensors' (a model's
// parameters, then desc.tensors) and train_state.safetensors' (AdamW's moments, views of its state).
typedef struct tsys__state_parts {
    tsys_tensor **model;      // borrowed
    const char **model_names;
    int n_model;
    tsys_tensor **train;      // owned views
    char **train_names;       // owned
    int n_train;
} tsys__state_parts;

static void tsys__state_parts_free(tsys__state_parts *p) {
    for (int i = 0; i < p->n_train; i++) { tsys_tensor_release(p->train[i]); TSYS_FREE(p->train_names[i]); }
    TSYS_FREE(p->model); TSYS_FREE(p->model_names); TSYS_FREE(p->train); TSYS_FREE(p->train_names);
    memset(p, 0, sizeof *p);
}

static tsys_status tsys__state_parts_make(tsys_ctx *ctx, const char *where, const tsys_state_desc *d, tsys__state_parts *p) {
    memset(p, 0, sizeof *p);
    int nm = d->model ? tsys_model_num_tensors(d->model) : 0, n = nm + d->n_tensors;
    int no = d->optim && d->optim->adamw ? d->optim->n : 0;
    if (d->n_tensors < 0 || (d->n_tensors && !d->tensors)) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "desc.tensors is NULL for %d tensors", d->n_tensors);
    if (d->model && d->model->ctx != ctx) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "desc.model belongs to another context");
    if (d->optim && d->optim->ctx != ctx) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "desc.optim belongs to another context");
    p->model = (tsys_tensor **)TSYS_MALLOC(sizeof(tsys_tensor *) * (size_t)(n + 1));
    p->model_names = (const char **)TSYS_MALLOC(sizeof(char *) * (size_t)(n + 1));
    p->train = (tsys_tensor **)TSYS_MALLOC(sizeof(tsys_tensor *) * (size_t)(2 * no + 1));
    p->train_names = (char **)TSYS_MALLOC(sizeof(char *) * (size_t)(2 * no + 1));
    if (!p->model || !p->model_names || !p->train || !p->train_names) { tsys__state_parts_free(p); return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", where); }
    for (int i = 0; i < n; i++) {
        tsys_tensor *t = i < nm ? tsys_model_params(d->model)[i] : d->tensors[i - nm];
        if (!t) { tsys__state_parts_free(p); return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "desc.tensors[%d] is NULL", i - nm); }
        if (!tsys__owned(ctx, "tsys_state", t)) { tsys__state_parts_free(p); return TSYS_ERR_INVALID_ARGS; }
        p->model[i] = t; p->model_names[i] = t->name;
    }
    p->n_model = n;
    for (int i = 0; i < no; i++) {
        tsys_tensor *param = d->optim->params[i];
        if (!param->name[0]) { tsys__state_parts_free(p); return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "the optimizer's parameter %d has no name (its moments are saved under it)", i); }
        if (d->optim->adamw && d->optim->state_at[i] < 0) {
            tsys__state_parts_free(p);
            return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "the optimizer holds no moments of '%s' here (tsys_optim_shard_state: a sharded snapshot saves each rank's part)",
                                    param->name);
        }
        for (int which = 0; which < 2; which++) {
            size_t len = strlen(param->name) + 32;
            char *name = (char *)TSYS_MALLOC(len);
            tsys_tensor *view = tsys_optim_state(d->optim, i, which);
            if (name) snprintf(name, len, "optim.state.%s.%s", param->name, which ? "exp_avg_sq" : "exp_avg");
            if (view) { p->train[p->n_train] = view; p->train_names[p->n_train++] = name; }
            if (!name || !view) { if (!view) TSYS_FREE(name); tsys__state_parts_free(p); return ctx->status != TSYS_OK ? ctx->status : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", where); }
        }
    }
    return TSYS_OK;
}

// ---- train_state.safetensors' metadata ----------------------------------------------------------------

typedef struct tsys__state_meta {
    int n;
    char key[TSYS__STATE_META][TSYS_STATE_KEY_LEN + 8];
    char value[TSYS__STATE_META][TSYS_STATE_VALUE_LEN];
    const char *pairs[2 * TSYS__STATE_META];
} tsys__state_meta;

static void tsys__state_meta_add(tsys__state_meta *m, const char *key, const char *fmt, ...) {
    if (m->n == TSYS__STATE_META) return;   // cannot happen: sized for the keys below and the user record's
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->value[m->n], TSYS_STATE_VALUE_LEN, fmt, ap);
    va_end(ap);
    snprintf(m->key[m->n], sizeof m->key[0], "%s", key);
    m->pairs[2 * m->n] = m->key[m->n]; m->pairs[2 * m->n + 1] = m->value[m->n];
    m->n++;
}

// The optimizer's step count as the AdamW kernel sees it (a replayed CUDA graph adds on the device only).
static tsys_status tsys__state_optim_step(tsys_ctx *ctx, tsys_optim *o, int64_t *step) {
    *step = o->step;
    return o->adamw && o->step_t ? tsys_tensor_to_host(ctx, o->step_t, step) : TSYS_OK;
}

// A value the safetensors header can hold: valid UTF-8 (the loader, and PyTorch's, refuse anything else).
static bool tsys__state_utf8_ok(const char *v) {
    const unsigned char *c = (const unsigned char *)v, *end = c + strlen(v);
    for (int k; c < end; c += k)
        if (!(k = tsys__st_utf8_len(c, end))) return false;
    return true;
}

static bool tsys__state_key_ok(const char *k) {
    if (!k[0] || strlen(k) >= TSYS_STATE_KEY_LEN) return false;
    for (; *k; k++) if (!((*k >= 'a' && *k <= 'z') || (*k >= 'A' && *k <= 'Z') || (*k >= '0' && *k <= '9') || *k == '_' || *k == '.' || *k == '-')) return false;
    return true;
}

// Floats with 9 significant digits read back exactly (strtof); the RNG as four 16-digit hex words.
static tsys_status tsys__state_meta_make(tsys_ctx *ctx, const char *where, const tsys_state_desc *d, tsys__state_meta *m) {
    memset(m, 0, sizeof *m);
    if (d->n_user < 0 || d->n_user > TSYS_STATE_MAX_USER || (d->n_user && !d->user))
        return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "user record of %d pairs (0 to %d, desc.user not NULL)", d->n_user, TSYS_STATE_MAX_USER);
    for (int i = 0; i < d->n_user; i++) {
        const char *k = d->user[2 * i], *v = d->user[2 * i + 1];
        if (!k || !v) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "user record pair %d has a NULL string", i);
        if (!tsys__state_key_ok(k))
            return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "user key '%.80s' must be 1 to %d letters, digits, '_', '.' or '-'", k, TSYS_STATE_KEY_LEN - 1);
        if (strlen(v) >= TSYS_STATE_VALUE_LEN) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "user value of '%s' is %zu bytes (at most %d)", k, strlen(v), TSYS_STATE_VALUE_LEN - 1);
        if (!tsys__state_utf8_ok(v)) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "user value of '%s' is not valid UTF-8", k);
        for (int j = 0; j < i; j++) if (strcmp(k, d->user[2 * j]) == 0) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, where, "user key '%s' given twice", k);
    }
    tsys__state_meta_add(m, "tsys_state_version", "%d", TSYS__STATE_VERSION);
    tsys__state_meta_add(m, "step", "%lld", (long long)d->step);
    tsys_optim *o = d->optim;
    tsys__state_meta_add(m, "optimizer", "%s", !o ? "none" : o->adamw ? "adamw" : "sgd");
    if (o) {
        int64_t steps;
        tsys_status s = tsys__state_optim_step(ctx, o, &steps);
        if (s != TSYS_OK) return s;
        tsys__state_meta_add(m, "optim.step", "%lld", (long long)steps);
        tsys__state_meta_add(m, "optim.lr", "%.9g", (double)o->desc.lr);
        if (o->adamw) {
            tsys__state_meta_add(m, "optim.beta1", "%.9g", (double)o->desc.beta1);
            tsys__state_meta_add(m, "optim.beta2", "%.9g", (double)o->desc.beta2);
            tsys__state_meta_add(m, "optim.eps", "%.9g", (double)o->desc.eps);
            tsys__state_meta_add(m, "optim.weight_decay", "%.9g", (double)o->desc.weight_decay);
        }
    }
    const tsys_grad_scaler *g = d->scaler;
    if (g) {
        tsys__state_meta_add(m, "scaler.scale", "%.9g", (double)g->scale);
        tsys__state_meta_add(m, "scaler.growth_factor", "%.9g", (double)g->growth_factor);
        tsys__state_meta_add(m, "scaler.backoff_factor", "%.9g", (double)g->backoff_factor);
        tsys__state_meta_add(m, "scaler.growth_interval", "%d", g->growth_interval);
        tsys__state_meta_add(m, "scaler.growth_tracker", "%d", g->growth_tracker);
    }
    if (!d->no_rng)
        tsys__state_meta_add(m, "rng", "%016llx%016llx%016llx%016llx", (unsigned long long)ctx->rng[0], (unsigned long long)ctx->rng[1],
                             (unsigned long long)ctx->rng[2], (unsigned long long)ctx->rng[3]);
    for (int i = 0; i < d->n_user; i++) {
        char key[TSYS_STATE_KEY_LEN + 8];
        snprintf(key, sizeof key, "user.%s", d->user[2 * i]);
        tsys__state_meta_add(m, key, "%s", d->user[2 * i + 1]);
    }
    return TSYS_OK;
}

// The model's dims as tsys_model_save writes them (tsys_model_desc_from_file reads a snapshot's
// model.safetensors too), after the format version.
static int tsys__state_model_meta(const tsys_model *model, char vals[][32], const char **meta) {
    int n = 0;
    meta[2 * n] = "tsys_state_version"; snprintf(vals[n], 32, "%d", TSYS__STATE_VERSION); meta[2 * n + 1] = vals[n]; n++;
    if (!model) return n;
    const tsys_model_desc *d = &model->desc;
    const int ints[TSYS__ST_NUM_INT_DIMS] = {d->vocab_size, d->context_length, d->d_model, d->d_ff, d->num_layers, d->num_heads};
    for (int i = 0; i < TSYS__ST_NUM_DIMS; i++, n++) {
        if (i < TSYS__ST_NUM_INT_DIMS) snprintf(vals[n], 32, "%d", ints[i]);
        else snprintf(vals[n], 32, "%.9g", (double)(i == 6 ? d->rope_theta : d->eps));
        meta[2 * n] = tsys__st_dim_keys[i]; meta[2 * n + 1] = vals[n];
    }
    return n;
}

// ---- saving -----------------------------------------------------------------------------------------

static bool tsys__state_name_ok(const char *name) {
    return name[0] && name[0] != '.' && !strchr(name, '/') && strlen(name) < TSYS__STATE_NAME - 1;
}

// One snapshot's files, ready to write: the tensors and the names they are saved under, both files'
// metadata, the directory and the snapshot's name, all taken from the live objects on the calling
// thread. tsys_state_save writes it at once; a saver's thread writes it over host copies of the tensors.
typedef struct tsys__state_job {
    char dir[TSYS__STATE_PATH], name[TSYS__STATE_NAME];
    int64_t step;
    int keep_last;
    tsys__state_parts parts;
    tsys__state_meta meta;                                   // train_state.safetensors'
    char model_vals[1 + TSYS__ST_NUM_DIMS][32];
    const char *model_meta[2 * (1 + TSYS__ST_NUM_DIMS)];     // model.safetensors'
    int n_model_meta;
    tsys_tensor **copies;   // a saver's: the host copies parts.model points at, and their names
    char **copy_names;
    int n_copies;
} tsys__state_job;

static void tsys__state_job_free(tsys__state_job *j) {
    if (!j) return;
    for (int i = 0; i < j->n_copies; i++) { tsys_tensor_release(j->copies[i]); TSYS_FREE(j->copy_names[i]); }
    TSYS_FREE(j->copies); TSYS_FREE(j->copy_names);
    tsys__state_parts_free(&j->parts);
    TSYS_FREE(j);
}

// Checks desc and dir (made if missing) as tsys_state_save promises, and takes the job; NULL + the error.
static tsys__state_job *tsys__state_job_make(tsys_ctx *ctx, const char *dir, const tsys_state_desc *desc) {
    if (desc->step < 0) { tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "desc.step is %lld (it must be >= 0)", (long long)desc->step); return NULL; }
    if (desc->keep_last < 0) { tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "desc.keep_last is %d (0 keeps every snapshot)", desc->keep_last); return NULL; }
    if (desc->name && !tsys__state_name_ok(desc->name)) {
        tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "snapshot name '%.80s' must be 1 to %d bytes, hold no '/' and not start with '.'", desc->name, TSYS__STATE_NAME - 2);
        return NULL;
    }
    if (strlen(dir) >= TSYS__STATE_PATH) { tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "path too long"); return NULL; }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) { tsys__state_fail(ctx, TSYS_ERR_IO, dir, "cannot make the directory: %s", strerror(errno)); return NULL; }
    if (!tsys__state_is_dir(dir)) { tsys__state_fail(ctx, TSYS_ERR_IO, dir, "is not a directory"); return NULL; }
    tsys__state_job *j = (tsys__state_job *)TSYS_MALLOC(sizeof *j);
    if (!j) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", dir); return NULL; }
    memset(j, 0, sizeof *j);
    snprintf(j->dir, sizeof j->dir, "%s", dir);
    snprintf(j->name, sizeof j->name, "step-%06lld", (long long)desc->step);
    if (desc->name) snprintf(j->name, sizeof j->name, "%s", desc->name);
    j->step = desc->step; j->keep_last = desc->keep_last;
    tsys_status s = tsys__state_parts_make(ctx, dir, desc, &j->parts);
    if (s == TSYS_OK) s = tsys__state_meta_make(ctx, dir, desc, &j->meta);
    if (s != TSYS_OK) { tsys__state_job_free(j); return NULL; }
    j->n_model_meta = tsys__state_model_meta(desc->model, j->model_vals, j->model_meta);
    return j;
}

// The files of a snapshot into tmp (an empty directory), the manifest last.
static tsys_status tsys__state_write_files(tsys_ctx *ctx, const tsys__crc32c *crc, const char *tmp, const tsys__state_job *j, int64_t serial) {
    tsys__state_manifest m;
    memset(&m, 0, sizeof m);
    m.serial = serial; m.step = j->step;
    char path[TSYS__STATE_PATH];
    const tsys__state_parts *p = &j->parts;
    tsys_status s = TSYS_OK;
    for (int f = 0; s == TSYS_OK && f < 2; f++) {
        const char *file = f ? TSYS__STATE_TRAIN : TSYS__STATE_MODEL;
        tsys__st_sum sum = { crc, 0, 0 };
        if (!tsys__state_join(path, sizeof path, tmp, file)) { s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, tmp, "path too long"); break; }
        s = f ? tsys__st_save(ctx, path, p->train, (const char *const *)p->train_names, p->n_train, j->meta.pairs, j->meta.n, &sum)
              : tsys__st_save(ctx, path, p->model, p->model_names, p->n_model, j->model_meta, j->n_model_meta, &sum);
        snprintf(m.file[f], sizeof m.file[f], "%s", file);
        m.bytes[f] = sum.bytes; m.crc[f] = sum.value; m.nfiles = f + 1;
    }
    return s == TSYS_OK ? tsys__state_write_manifest(ctx, crc, tmp, &m) : s;
}

// Moves the complete temporary tmp to dir/name. A snapshot already there is moved aside first, under
// a name tsys_state_latest still sees (it may be the newest until the new one is in place), and
// removed once the new one is.
static tsys_status tsys__state_install(tsys_ctx *ctx, const tsys__crc32c *crc, const char *dir, const char *tmp, const char *name) {
    char final_path[TSYS__STATE_PATH], aside[TSYS__STATE_PATH], aside_name[TSYS__STATE_NAME + 16] = "";
    if (!tsys__state_join(final_path, sizeof final_path, dir, name)) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "path too long");
    struct stat st;
    if (lstat(final_path, &st) == 0) {
        tsys__state_manifest m;
        if (!S_ISDIR(st.st_mode) || tsys__state_read_manifest(NULL, crc, final_path, &m) != TSYS_OK)
            return tsys__state_fail(ctx, TSYS_ERR_IO, final_path, "exists and is not a snapshot; it is left alone (remove it or save under another name)");
        uint64_t seed = tsys__atomic_seed(final_path);
        snprintf(aside_name, sizeof aside_name, TSYS__STATE_OLD "XXXXXX");
        do tsys__atomic_fill_name(aside_name, &seed);
        while (tsys__state_join(aside, sizeof aside, dir, aside_name) && tsys__state_is_dir(aside));
        if (rename(final_path, aside) != 0) return tsys__state_fail(ctx, TSYS_ERR_IO, final_path, "cannot move the old snapshot aside: %s", strerror(errno));
    }
    if (rename(tmp, final_path) != 0) {
        tsys_status s = tsys__state_fail(ctx, TSYS_ERR_IO, final_path, "cannot rename the new snapshot into place: %s", strerror(errno));
        if (aside_name[0] && rename(aside, final_path) != 0) { /* the old one stays complete under its aside name */ }
        return s;
    }
    tsys_status s = tsys__state_sync_dir(ctx, dir);
    if (s == TSYS_OK && aside_name[0]) s = tsys__state_remove(ctx, dir, aside_name);
    return s;
}

// All but the newest keep snapshots of dir, oldest first: once the new one is durable, and also before it is
// written, so that leftovers of writers that died between an install and its keep_last go first (else each such
// crash would leave one snapshot more; with them gone, a crash at that point leaves keep + 1 at most).
static tsys_status tsys__state_keep_last(tsys_ctx *ctx, const tsys__crc32c *crc, const char *dir, int keep) {
    tsys__state_entry *list;
    int n;
    tsys_status s = tsys__state_scan(ctx, crc, dir, false, &list, &n);
    for (int i = 0; s == TSYS_OK && i < n - keep; i++) s = tsys__state_remove(ctx, dir, list[i].name);
    TSYS_FREE(list);
    return s;
}

// Writes the job: a temporary in its directory, the files, the rename, keep_last.
static tsys_status tsys__state_job_run(tsys_ctx *ctx, const tsys__crc32c *crc, const tsys__state_job *j) {
    tsys__state_entry *list;
    int n;
    char tmp[TSYS__STATE_PATH];
    tsys_status s = tsys__state_scan(ctx, crc, j->dir, true, &list, &n);
    int64_t serial = n ? list[n - 1].serial + 1 : 1;
    TSYS_FREE(list);
    if (s == TSYS_OK && j->keep_last > 0) s = tsys__state_keep_last(ctx, crc, j->dir, j->keep_last);
    if (s == TSYS_OK && !tsys__state_tmp_name(tmp, sizeof tmp, j->dir)) s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, j->dir, "path too long");
    if (s == TSYS_OK && !tsys__state_mkdir_tmp(tmp)) s = tsys__state_fail(ctx, TSYS_ERR_IO, j->dir, "cannot make a temporary directory in it: %s", strerror(errno));
    else if (s == TSYS_OK) {
        s = tsys__state_write_files(ctx, crc, tmp, j, serial);
        if (s == TSYS_OK) s = tsys__state_install(ctx, crc, j->dir, tmp, j->name);
        if (s != TSYS_OK && tsys__state_is_dir(tmp)) tsys__state_rmdir_files(NULL, tmp);   // the error above is the one to report
    }
    if (s == TSYS_OK && j->keep_last > 0) s = tsys__state_keep_last(ctx, crc, j->dir, j->keep_last);
    return s;
}

TSYSDEF tsys_status tsys_state_save(tsys_ctx *ctx, const char *dir, const tsys_state_desc *desc) {
    TSYS__CHECK_ARG(ctx, ctx && dir && dir[0] && desc, TSYS_ERR_INVALID_ARGS, "tsys_state_save: NULL context, directory or desc");
    if (ctx->status != TSYS_OK) return ctx->status;
    tsys__state_job *j = tsys__state_job_make(ctx, dir, desc);
    if (!j) return ctx->status;
    tsys__crc32c *crc = (tsys__crc32c *)TSYS_MALLOC(sizeof *crc);
    tsys_status s = crc ? TSYS_OK : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", dir);
    if (crc) { tsys__crc32c_init(crc); s = tsys__state_job_run(ctx, crc, j); }
    TSYS_FREE(crc);
    tsys__state_job_free(j);
    return s;
}

// ---- asynchronous saving ----------------------------------------------------------------------------
// The saver's thread touches only its own context (wctx: its errors, the tensors over the staging
// memory), the job and the result fields; the caller's thread touches them only while no thread runs.

struct tsys_state_saver {
    tsys_ctx *ctx;                 // the training's
    tsys_ctx *wctx;                // the writer's
    tsys__crc32c *crc;
    unsigned char *stage;          // host copies of the tensors, each at a 64-byte boundary
    size_t stage_bytes;
    const tsys_backend *stage_owner;   // whose host_alloc made stage (NULL: malloc)
    bool on_device;                // device tensors go through dstage (tsys_state_saver_stage_on_device)
    tsys_tensor *dstage;           // their device copies, laid out as in stage (NULL: none yet)
    const tsys_backend *copier;    // the backend whose copies are in flight (NULL: none)
    tsys_device copy_dev;
    tsys_event copied;             // recorded on its TSYS_STREAM_COPY after the last copy
    tsys__state_job *job;          // the snapshot in flight, or NULL
    pthread_t thread;
    bool running;                  // a thread was started and not joined
    int done;                      // the thread finished (atomic)
    double t_call_us;
    tsys_status result;            // the thread's
    char error[512];
    tsys_state_saver_stats stats, pending;
};

// The compute streams wait for the copies queued on TSYS_STREAM_COPY: called before the library writes
// what an asynchronous snapshot may still be reading.
static tsys_status tsys__copies_fence(tsys_ctx *ctx) {
    for (int d = 0; d < TSYS_DEVICE_COUNT; d++) {
        const tsys_backend *be = ctx->backends[d];
        tsys_status s = be && be->copies_fence ? be->copies_fence(ctx) : TSYS_OK;
        if (s != TSYS_OK) return s;
    }
    return TSYS_OK;
}

static void *tsys__saver_main(void *arg) {
    tsys_state_saver *sv = (tsys_state_saver *)arg;
    tsys_status s = TSYS_OK;
    if (sv->copier) s = sv->copier->event_host_wait(sv->copier, &sv->copied, sv->error, sizeof sv->error);
    double t_copied = tsys_time_us();
    sv->pending.copy_ms = (t_copied - sv->t_call_us) / 1000.0;
    if (s == TSYS_OK && (s = tsys__state_job_run(sv->wctx, sv->crc, sv->job)) != TSYS_OK) snprintf(sv->error, sizeof sv->error, "%s", tsys_ctx_last_error(sv->wctx));
    sv->pending.write_ms = (tsys_time_us() - t_copied) / 1000.0;
    sv->result = s;
    __atomic_store_n(&sv->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

TSYSDEF tsys_state_saver *tsys_state_saver_new(tsys_ctx *ctx) {
    TSYS__CHECK_ARG(ctx, ctx, NULL, "tsys_state_saver_new: NULL context");
    tsys_ctx_desc wd;
    memset(&wd, 0, sizeof wd);
    wd.cpu_memory_limit = SIZE_MAX;   // it only wraps the staging memory, allocated by the saver
    tsys_state_saver *sv = (tsys_state_saver *)TSYS_MALLOC(sizeof *sv);
    if (sv) { memset(sv, 0, sizeof *sv); sv->ctx = ctx; sv->wctx = tsys_ctx_new(&wd); sv->crc = (tsys__crc32c *)TSYS_MALLOC(sizeof *sv->crc); }
    if (!sv || !sv->wctx || !sv->crc) {
        if (sv) { tsys_ctx_free(sv->wctx); TSYS_FREE(sv->crc); TSYS_FREE(sv); }
        tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_state_saver_new: out of host memory");
        return NULL;
    }
    tsys__crc32c_init(sv->crc);
    return sv;
}

// The snapshot in flight is over (the thread joined, or it ran here): its stats, or its error in the
// caller's context.
static tsys_status tsys__saver_finish(tsys_state_saver *sv, int join_error) {
    if (sv->copier) tsys_event_release(sv->ctx, &sv->copied);
    sv->copier = NULL;
    tsys__state_job_free(sv->job);
    sv->job = NULL;
    tsys_ctx_clear_error(sv->wctx);
    if (join_error) return tsys_ctx_set_error(sv->ctx, TSYS_ERR_IO, "tsys_state_saver: cannot join the writer thread: %s", strerror(join_error));
    if (sv->result != TSYS_OK) return tsys_ctx_set_error(sv->ctx, sv->result, "%s", sv->error);
    sv->stats = sv->pending;
    sv->stats.saves = sv->pending.saves + 1;
    return TSYS_OK;
}

static tsys_status tsys__saver_join(tsys_state_saver *sv) {
    if (!sv->running) return TSYS_OK;
    int e = pthread_join(sv->thread, NULL);
    sv->running = false;
    return tsys__saver_finish(sv, e);
}

// Host memory for n bytes of copies: the backend's page-locked memory where it has some; kept.
static tsys_status tsys__saver_stage(tsys_state_saver *sv, const tsys_backend *be, size_t n) {
    const tsys_backend *owner = be && be->host_alloc && be->host_free ? be : NULL;
    if (sv->stage && sv->stage_bytes >= n && sv->stage_owner == owner) return TSYS_OK;
    if (sv->stage && sv->stage_owner) sv->stage_owner->host_free(sv->ctx, sv->stage);
    else TSYS_FREE(sv->stage);
    sv->stage_bytes = 0; sv->stage_owner = owner;
    sv->stage = (unsigned char *)(owner ? owner->host_alloc(sv->ctx, n) : TSYS_MALLOC(n));
    if (!sv->stage) return tsys_ctx_set_error(sv->ctx, TSYS_ERR_OOM, "tsys_state_save_async: no host memory for a %.1f MiB copy of the snapshot's tensors", (double)n / 1048576.0);
    sv->stage_bytes = n;
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_state_saver_stage_on_device(tsys_state_saver *sv, bool on) {
    if (!sv) return TSYS_ERR_INVALID_ARGS;
    sv->on_device = on;
    return TSYS_OK;
}

// Part i of the job (model parts first, then the optimizer's), and where its copy goes.
static tsys_tensor **tsys__saver_part(tsys__state_job *j, int i) { return i < j->parts.n_model ? &j->parts.model[i] : &j->parts.train[i - j->parts.n_model]; }

// The device of the job's device tensors (TSYS_CPU: none); an error for two.
static tsys_status tsys__saver_device(tsys_ctx *ctx, tsys__state_job *j, tsys_device *dev, size_t *need) {
    *dev = TSYS_CPU; *need = 64;
    for (int i = 0; i < j->parts.n_model + j->parts.n_train; i++) {
        const tsys_tensor *t = *tsys__saver_part(j, i);
        *need += (tsys_tensor_bytes(t) + 63) & ~(size_t)63;
        if (t->device != TSYS_CPU && *dev != TSYS_CPU && t->device != *dev)
            return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_state_save_async: the tensors are on two devices (%s and %s)", tsys__device_name(*dev), tsys__device_name(t->device));
        if (t->device != TSYS_CPU) *dev = t->device;
    }
    return TSYS_OK;
}

// The backend that copies dev's tensors beside the streams' work (NULL: the CPU, or one that cannot).
static const tsys_backend *tsys__saver_copier(tsys_ctx *ctx, tsys_device dev) {
    const tsys_backend *be = dev != TSYS_CPU ? ctx->backends[dev] : NULL;
    return be && be->copy_async && be->event_host_wait && be->copies_fence ? be : NULL;
}

// Device memory for the n bytes of copies (laid out as the host stage) on dev when the saver stages
// there; none otherwise. Kept, as the host stage is.
static tsys_status tsys__saver_dstage(tsys_state_saver *sv, tsys_device dev, size_t n) {
    const bool want = sv->on_device && dev != TSYS_CPU && tsys__saver_copier(sv->ctx, dev);
    if (sv->dstage && (!want || sv->dstage->device != dev || tsys_tensor_bytes(sv->dstage) < n)) {
        tsys_tensor_release(sv->dstage);
        sv->dstage = NULL;
    }
    if (!want || sv->dstage) return TSYS_OK;
    const int64_t words = (int64_t)(n / 4);   // n is a multiple of 64
    tsys_mem_category was = tsys_mem_set_category(sv->ctx, TSYS_MEM_WORKSPACE);
    sv->dstage = tsys_tensor_new(sv->ctx, TSYS_F32, dev, 1, &words);
    tsys_mem_set_category(sv->ctx, was);
    if (sv->dstage) return TSYS_OK;
    char why[sizeof sv->ctx->error];
    memcpy(why, sv->ctx->error, sizeof why);
    tsys_ctx_clear_error(sv->ctx);
    return tsys_ctx_set_error(sv->ctx, TSYS_ERR_OOM, "tsys_state_save_async: no %s memory for a %.1f MiB copy of the snapshot's tensors (%s); stage them on the host "
                              "instead (tsys_state_saver_stage_on_device off)", tsys__device_name(dev), (double)n / 1048576.0, why);
}

TSYSDEF tsys_status tsys_state_saver_reserve(tsys_state_saver *sv, const tsys_state_desc *desc) {
    if (!sv) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = sv->ctx;
    TSYS__CHECK_ARG(ctx, desc, TSYS_ERR_INVALID_ARGS, "tsys_state_saver_reserve: NULL desc");
    tsys_status s = tsys__saver_join(sv);   // the staging memory may be in use
    tsys__state_job *j = s == TSYS_OK ? (tsys__state_job *)TSYS_MALLOC(sizeof *j) : NULL;
    if (s == TSYS_OK && !j) s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_state_saver_reserve: out of host memory");
    if (j) memset(j, 0, sizeof *j);
    if (j && (s = tsys__state_parts_make(ctx, "tsys_state_saver_reserve", desc, &j->parts)) == TSYS_OK) {
        tsys_device dev;
        size_t need;
        if ((s = tsys__saver_device(ctx, j, &dev, &need)) == TSYS_OK) s = tsys__saver_stage(sv, tsys__saver_copier(ctx, dev), need);
        if (s == TSYS_OK) s = tsys__saver_dstage(sv, dev, need);
    }
    tsys__state_job_free(j);
    return s;
}

// Device bytes to copy: src's run of bytes goes to offset at of the stage (and of the device stage).
typedef struct tsys__copy_run { const char *src; size_t at, bytes; } tsys__copy_run;

// Queues the runs' copies to the host stage after the compute stream's work so far: straight from the
// live tensors on TSYS_STREAM_COPY (fenced: the next update waits for them), or, staging on the device,
// first into the device stage on the compute stream itself (ordered before the next update by the stream,
// and fast) and from there to the host on TSYS_STREAM_COPY, which no update waits for.
static tsys_status tsys__saver_queue(tsys_state_saver *sv, const tsys_backend *be, tsys_device dev, const tsys__copy_run *runs, int n) {
    tsys_ctx *ctx = sv->ctx;
    char *dbase = sv->dstage ? (char *)tsys_tensor_data(sv->dstage) : NULL;
    tsys_status s = TSYS_OK;
    for (int i = 0; dbase && s == TSYS_OK && i < n; i++) s = be->copy_async(ctx, dbase + runs[i].at, dev, runs[i].src, dev, runs[i].bytes, TSYS_STREAM_COMPUTE, false);
    tsys_event ready;
    memset(&ready, 0, sizeof ready);
    if (s == TSYS_OK && (s = tsys_event_record(ctx, dev, TSYS_STREAM_COMPUTE, &ready)) == TSYS_OK) s = tsys_event_wait(ctx, &ready, TSYS_STREAM_COPY);
    for (int i = 0; s == TSYS_OK && i < n; i++)
        s = be->copy_async(ctx, sv->stage + runs[i].at, TSYS_CPU, dbase ? dbase + runs[i].at : runs[i].src, dev, runs[i].bytes, TSYS_STREAM_COPY, !dbase);
    if (s == TSYS_OK && (s = tsys_event_record(ctx, dev, TSYS_STREAM_COPY, &sv->copied)) == TSYS_OK) sv->copier = be;
    if (ready.handle) tsys_event_release(ctx, &ready);   // the wait is queued: the event may go back to the pool
    return s;
}

// Copies the job's tensors into the staging memory (device ones queued, tsys__saver_queue) and points
// the job at the copies: tensors of the writer's context.
static tsys_status tsys__saver_copy(tsys_state_saver *sv, tsys__state_job *j) {
    tsys_ctx *ctx = sv->ctx;
    int n = j->parts.n_model + j->parts.n_train, n_runs = 0;
    tsys_device dev;
    size_t need;
    tsys_status s = tsys__saver_device(ctx, j, &dev, &need);
    const tsys_backend *be = tsys__saver_copier(ctx, dev);
    bool async = be != NULL;
    j->copies = (tsys_tensor **)TSYS_MALLOC(sizeof(tsys_tensor *) * (size_t)(j->parts.n_model + 1));
    j->copy_names = (char **)TSYS_MALLOC(sizeof(char *) * (size_t)(j->parts.n_model + 1));
    tsys__copy_run *runs = (tsys__copy_run *)TSYS_MALLOC(sizeof *runs * (size_t)(n + 1));
    if (s == TSYS_OK && (!j->copies || !j->copy_names || !runs)) s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_state_save_async: out of host memory");
    if (s == TSYS_OK) s = tsys__saver_stage(sv, async ? be : NULL, need);
    if (s == TSYS_OK) s = tsys__saver_dstage(sv, async ? dev : TSYS_CPU, need);
    size_t off = 0;
    for (int i = 0; s == TSYS_OK && i < n; i++) {
        tsys_tensor **slot = tsys__saver_part(j, i), *t = *slot;
        if (!tsys__current(ctx, "tsys_state_save_async", t)) { s = TSYS_ERR_INVALID_ARGS; break; }
        size_t bytes = tsys_tensor_bytes(t);
        const char *src = (const char *)tsys_tensor_data(t);
        tsys__copy_run *last = n_runs ? &runs[n_runs - 1] : NULL;   // a model has hundreds of tensors, and a stream
        if (t->device == TSYS_CPU) memcpy(sv->stage + off, src, bytes);   // queues only so many: runs that continue
        else if (async && last && src == last->src + last->bytes && off == last->at + last->bytes) last->bytes += bytes;   // each other go as one
        else if (async) { runs[n_runs].src = src; runs[n_runs].at = off; runs[n_runs++].bytes = bytes; }
        else s = tsys_tensor_to_host(ctx, t, sv->stage + off);
        tsys_tensor *w = s == TSYS_OK ? tsys_tensor_wrap(sv->wctx, t->dtype, TSYS_CPU, t->ndim, t->shape, sv->stage + off, NULL, NULL) : NULL;
        if (s == TSYS_OK && !w) s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_state_save_async: %s", tsys_ctx_last_error(sv->wctx));
        if (s == TSYS_OK && i < j->parts.n_model) {   // a borrowed live tensor: the copy and its name are the job's
            size_t len = strlen(j->parts.model_names[i]) + 1;
            char *name = (char *)TSYS_MALLOC(len);
            j->copies[j->n_copies] = w; j->copy_names[j->n_copies++] = name;
            if (!name) { s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_state_save_async: out of host memory"); break; }
            memcpy(name, j->parts.model_names[i], len);
            j->parts.model_names[i] = name;
        } else if (s == TSYS_OK) tsys_tensor_release(t);   // the optimizer state's view, the job's own
        if (s == TSYS_OK) *slot = w;
        off += (bytes + 63) & ~(size_t)63;
    }
    if (async) sv->copy_dev = dev;
    if (s == TSYS_OK && async) s = tsys__saver_queue(sv, be, dev, runs, n_runs);
    TSYS_FREE(runs);
    return s;
}

TSYSDEF tsys_status tsys_state_save_async(tsys_state_saver *sv, const char *dir, const tsys_state_desc *desc) {
    if (!sv) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = sv->ctx;
    TSYS__CHECK_ARG(ctx, dir && dir[0] && desc, TSYS_ERR_INVALID_ARGS, "tsys_state_save_async: NULL directory or desc");
    if (ctx->status != TSYS_OK) return ctx->status;
    tsys_status s = tsys__saver_join(sv);
    if (s != TSYS_OK) return s;
    double t0 = tsys_time_us();
    tsys__state_job *j = tsys__state_job_make(ctx, dir, desc);
    if (!j) return ctx->status;
    if ((s = tsys__saver_copy(sv, j)) != TSYS_OK) {
        // copies already queued still write the staging memory: they end before it can be reused
        if (sv->copy_dev != TSYS_CPU) (void)tsys_sync(ctx, sv->copy_dev);
        if (sv->copier) tsys_event_release(ctx, &sv->copied);
        sv->copier = NULL;
        tsys__state_job_free(j);
        return s;
    }
    int64_t saves = sv->stats.saves;
    memset(&sv->pending, 0, sizeof sv->pending);
    sv->pending.saves = saves;
    for (int i = 0; i < j->parts.n_model + j->parts.n_train; i++) sv->pending.bytes += (int64_t)tsys_tensor_bytes(*tsys__saver_part(j, i));
    sv->job = j; sv->result = TSYS_OK; sv->error[0] = 0; sv->t_call_us = t0; sv->done = 0;
    sv->pending.stage_ms = (tsys_time_us() - t0) / 1000.0;
    if (pthread_create(&sv->thread, NULL, tsys__saver_main, sv) == 0) { sv->running = true; return TSYS_OK; }
    tsys__saver_main(sv);   // no thread to be had: the snapshot is written here, before returning
    return tsys__saver_finish(sv, 0);
}

TSYSDEF tsys_status tsys_state_saver_copied(tsys_state_saver *sv) {
    if (!sv) return TSYS_ERR_INVALID_ARGS;
    if (!sv->running || !sv->copier) return TSYS_OK;
    char err[256];
    tsys_status s = sv->copier->event_host_wait(sv->copier, &sv->copied, err, sizeof err);
    return s == TSYS_OK ? TSYS_OK : tsys_ctx_set_error(sv->ctx, s, "tsys_state_saver_copied: %s", err);
}

TSYSDEF tsys_status tsys_state_saver_wait(tsys_state_saver *sv) { return sv ? tsys__saver_join(sv) : TSYS_ERR_INVALID_ARGS; }
TSYSDEF bool tsys_state_saver_busy(const tsys_state_saver *sv) { return sv && sv->running && !__atomic_load_n(&sv->done, __ATOMIC_ACQUIRE); }
TSYSDEF tsys_state_saver_stats tsys_state_saver_stats_get(const tsys_state_saver *sv) {
    tsys_state_saver_stats z;
    memset(&z, 0, sizeof z);
    return sv ? sv->stats : z;
}

TSYSDEF void tsys_state_saver_free(tsys_state_saver *sv) {
    if (!sv) return;
    tsys_status keep = sv->ctx->status;   // a failure of the snapshot in flight is not the caller's error now
    char msg[sizeof sv->ctx->error];
    memcpy(msg, sv->ctx->error, sizeof msg);
    (void)tsys__saver_join(sv);
    sv->ctx->status = keep;
    memcpy(sv->ctx->error, msg, sizeof msg);
    if (sv->stage && sv->stage_owner) sv->stage_owner->host_free(sv->ctx, sv->stage);
    else TSYS_FREE(sv->stage);
    tsys_tensor_release(sv->dstage);
    tsys_ctx_free(sv->wctx);
    TSYS_FREE(sv->crc);
    TSYS_FREE(sv);
}

// ---- loading ----------------------------------------------------------------------------------------

// Matches tensors (saved as names) to the entries of an open file, exactly: every tensor is there with
// its shape and dtype, and the file holds nothing else. match[i] gets the entry of tensors[i].
static tsys_status tsys__state_match(tsys_ctx *ctx, const char *snap, tsys__st_file *sf, tsys_tensor *const *tensors, const char *const *names,
                                     int n, int *match) {
    const char *file = strrchr(sf->path, '/') + 1;
    bool *used = (bool *)TSYS_MALLOC((size_t)sf->n + 1);
    if (!used) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", snap);
    memset(used, 0, (size_t)sf->n + 1);
    tsys_status s = TSYS_OK;
    for (int i = 0; s == TSYS_OK && i < n; i++) {
        const tsys_tensor *t = tensors[i];
        int k = match[i] = tsys__st_index_find(&sf->names, names[i]);
        const tsys__st_entry *e = k >= 0 ? &sf->entries[k] : NULL;
        bool same = e && e->ndim == t->ndim && e->dtype == t->dtype;
        for (int d = 0; same && d < t->ndim; d++) same = e->shape[d] == t->shape[d];
        char a[160], b[160];
        if (!e) s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "tensor '%s' is missing from %s (it holds %d tensors)", names[i], file, sf->n);
        else if (used[k]) s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, snap, "tensor name '%s' is given twice", names[i]);
        else if (!same)
            s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "tensor '%s': %s holds %s %s, the tensor is %s %s", names[i], file, tsys_dtype_name(e->dtype),
                                 tsys__st_shape_str(a, sizeof a, e->ndim, e->shape), tsys_dtype_name(t->dtype), tsys__st_shape_str(b, sizeof b, t->ndim, t->shape));
        if (k >= 0) used[k] = true;
    }
    for (int k = 0; s == TSYS_OK && k < sf->n; k++)
        if (!used[k]) s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "%s holds tensor '%s', which the load does not list (it is strict: the same tensors as saved)", file, sf->entries[k].name);
    TSYS_FREE(used);
    return s;
}

// A metadata value of train_state.safetensors as an int64 or a float; an error naming the key.
static tsys_status tsys__state_meta_i64(tsys_ctx *ctx, const char *snap, const tsys__st_file *sf, const char *key, int64_t *out) {
    const char *v = tsys__st_meta_get(sf, key);
    char *end = NULL;
    errno = 0;
    long long x = v ? strtoll(v, &end, 10) : 0;
    if (!v || !v[0] || errno || *end) return tsys__state_fail(ctx, TSYS_ERR_IO, snap, TSYS__STATE_TRAIN " __metadata__ \"%s\" is %s%.40s%s, not an integer", key, v ? "\"" : "", v ? v : "missing", v ? "\"" : "");
    *out = x;
    return TSYS_OK;
}
static tsys_status tsys__state_meta_f32(tsys_ctx *ctx, const char *snap, const tsys__st_file *sf, const char *key, float *out) {
    const char *v = tsys__st_meta_get(sf, key);
    char *end = NULL;
    errno = 0;
    float x = v ? strtof(v, &end) : 0.0f;
    if (!v || !v[0] || errno || *end || !isfinite(x)) return tsys__state_fail(ctx, TSYS_ERR_IO, snap, TSYS__STATE_TRAIN " __metadata__ \"%s\" is %s%.40s%s, not a finite number", key, v ? "\"" : "", v ? v : "missing", v ? "\"" : "");
    *out = x;
    return TSYS_OK;
}

// What a load sets besides tensors, read and checked before anything is written.
typedef struct tsys__state_host_part {
    tsys_optim_desc hyper;
    int64_t optim_step;
    tsys_grad_scaler scaler;
    uint64_t rng[4];
} tsys__state_host_part;

// The host part of a snapshot into the live objects desc names: AdamW's step count (also its device
// copy, which the kernels read) and hyper-parameters, the scaler, the RNG. Called once everything is checked.
static tsys_status tsys__state_apply_host(tsys_ctx *ctx, const tsys_state_desc *d, const tsys__state_host_part *h) {
    tsys_status s = TSYS_OK;
    if (d->optim) {
        tsys_optim *o = d->optim;
        if (o->adamw) s = tsys__st_upload(ctx, o->step_t, &h->optim_step);
        o->step = h->optim_step;
        o->desc = h->hyper;
    }
    if (s == TSYS_OK && d->scaler) *d->scaler = h->scaler;
    if (s == TSYS_OK && !d->no_rng) memcpy(ctx->rng, h->rng, sizeof h->rng);
    return s;
}

static tsys_status tsys__state_read_optim(tsys_ctx *ctx, const char *snap, const tsys__st_file *sf, const tsys_optim *o, tsys__state_host_part *h) {
    const char *kind = tsys__st_meta_get(sf, "optimizer"), *want = o->adamw ? "adamw" : "sgd";
    if (!kind || strcmp(kind, want) != 0)
        return tsys__state_fail(ctx, TSYS_ERR_IO, snap, "holds the state of optimizer '%.20s', the load gives %s", kind ? kind : "(missing)", want);
    h->hyper = o->desc;
    tsys_status s = tsys__state_meta_i64(ctx, snap, sf, "optim.step", &h->optim_step);
    if (s == TSYS_OK) s = tsys__state_meta_f32(ctx, snap, sf, "optim.lr", &h->hyper.lr);
    if (s == TSYS_OK && o->adamw) {
        const char *keys[4] = {"optim.beta1", "optim.beta2", "optim.eps", "optim.weight_decay"};
        float *vals[4] = {&h->hyper.beta1, &h->hyper.beta2, &h->hyper.eps, &h->hyper.weight_decay};
        for (int i = 0; s == TSYS_OK && i < 4; i++) s = tsys__state_meta_f32(ctx, snap, sf, keys[i], vals[i]);
        h->hyper.no_weight_decay = h->hyper.weight_decay == 0.0f;
    }
    if (s == TSYS_OK && h->optim_step < 0) s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "optimizer step count %lld is negative", (long long)h->optim_step);
    if (s == TSYS_OK && (!tsys__hyper_ok(ctx, want, "lr (in the snapshot)", h->hyper.lr, false) ||
                         (o->adamw && (!tsys__hyper_ok(ctx, want, "beta1 (in the snapshot)", h->hyper.beta1, true) || !tsys__hyper_ok(ctx, want, "beta2 (in the snapshot)", h->hyper.beta2, true) ||
                                       !tsys__hyper_ok(ctx, want, "eps (in the snapshot)", h->hyper.eps, false) || !tsys__hyper_ok(ctx, want, "weight_decay (in the snapshot)", h->hyper.weight_decay, false)))))
        s = ctx->status;
    return s;
}

static tsys_status tsys__state_read_scaler(tsys_ctx *ctx, const char *snap, const tsys__st_file *sf, tsys_grad_scaler *g) {
    int64_t interval = 0, tracker = 0;
    memset(g, 0, sizeof *g);
    if (!tsys__st_meta_get(sf, "scaler.scale")) return tsys__state_fail(ctx, TSYS_ERR_IO, snap, "holds no loss scaler (saved without desc.scaler)");
    tsys_status s = tsys__state_meta_f32(ctx, snap, sf, "scaler.scale", &g->scale);
    if (s == TSYS_OK) s = tsys__state_meta_f32(ctx, snap, sf, "scaler.growth_factor", &g->growth_factor);
    if (s == TSYS_OK) s = tsys__state_meta_f32(ctx, snap, sf, "scaler.backoff_factor", &g->backoff_factor);
    if (s == TSYS_OK) s = tsys__state_meta_i64(ctx, snap, sf, "scaler.growth_interval", &interval);
    if (s == TSYS_OK) s = tsys__state_meta_i64(ctx, snap, sf, "scaler.growth_tracker", &tracker);
    if (s == TSYS_OK && (interval < 0 || interval > INT_MAX || tracker < 0 || tracker > INT_MAX))
        s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "loss scaler growth_interval %lld / growth_tracker %lld out of range", (long long)interval, (long long)tracker);
    g->growth_interval = (int)interval; g->growth_tracker = (int)tracker;
    return s;
}

static tsys_status tsys__state_read_rng(tsys_ctx *ctx, const char *snap, const tsys__st_file *sf, uint64_t rng[4]) {
    const char *v = tsys__st_meta_get(sf, "rng");
    if (!v) return tsys__state_fail(ctx, TSYS_ERR_IO, snap, "holds no RNG state (saved with desc.no_rng; load with no_rng too)");
    bool ok = strlen(v) == 64;
    for (int w = 0; ok && w < 4; w++) {
        rng[w] = 0;
        for (int i = 0; ok && i < 16; i++) {
            char c = v[16 * w + i];
            int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            ok = d >= 0;
            rng[w] = rng[w] << 4 | (uint64_t)(ok ? d : 0);
        }
    }
    if (!ok || !(rng[0] | rng[1] | rng[2] | rng[3])) return tsys__state_fail(ctx, TSYS_ERR_IO, snap, "RNG state '%.70s' is not 64 hex digits of a xoshiro256** state", v);
    return TSYS_OK;
}

static tsys_status tsys__state_read_info(tsys_ctx *ctx, const char *snap, const tsys__st_file *sf, const tsys__state_manifest *m, tsys_state_info *info) {
    memset(info, 0, sizeof *info);
    info->step = m->step; info->serial = m->serial;
    for (int i = 0; i + 1 < sf->nmeta; i += 2) {
        const char *k = sf->meta[i], *v = sf->meta[i + 1];
        if (strncmp(k, "user.", 5) != 0) continue;
        if (info->n_user == TSYS_STATE_MAX_USER || !tsys__state_key_ok(k + 5) || strlen(v) >= TSYS_STATE_VALUE_LEN)
            return tsys__state_fail(ctx, TSYS_ERR_IO, snap, "user record entry '%.80s' is past the limits (%d pairs, keys < %d bytes, values < %d)", k,
                                    TSYS_STATE_MAX_USER, TSYS_STATE_KEY_LEN, TSYS_STATE_VALUE_LEN);
        snprintf(info->key[info->n_user], TSYS_STATE_KEY_LEN, "%s", k + 5);
        snprintf(info->value[info->n_user], TSYS_STATE_VALUE_LEN, "%s", v);
        info->n_user++;
    }
    return TSYS_OK;
}

TSYSDEF const char *tsys_state_info_get(const tsys_state_info *info, const char *key) {
    for (int i = 0; info && key && i < info->n_user; i++) if (strcmp(info->key[i], key) == 0) return info->value[i];
    return NULL;
}

// Checks everything (manifest, checksums, names, shapes, dtypes, metadata), then writes: tensors, the
// optimizer's counts and hyper-parameters, the scaler, the RNG.
static tsys_status tsys__state_load(tsys_ctx *ctx, const tsys__crc32c *crc, const char *snap, const tsys_state_desc *d, tsys_state_info *info,
                                    tsys__st_file *mf, tsys__st_file *tf) {
    tsys__state_manifest m;
    tsys_status s = tsys__state_read_manifest(ctx, crc, snap, &m);
    if (s == TSYS_OK) s = tsys__state_verify(ctx, crc, snap, &m);
    char mpath[TSYS__STATE_PATH], tpath[TSYS__STATE_PATH];
    if (s == TSYS_OK && (!tsys__state_join(mpath, sizeof mpath, snap, TSYS__STATE_MODEL) || !tsys__state_join(tpath, sizeof tpath, snap, TSYS__STATE_TRAIN)))
        s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, snap, "path too long");
    if (s == TSYS_OK && m.world > 0)
        return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, snap, "is a sharded snapshot of %d processes (layout %s): load it with tsys_zero1_state_load or "
                                "tsys_fsdp_state_load (tsys_dist.h), or make it a plain one with tsys_state_consolidate", m.world, m.layout[0] ? m.layout : "unnamed");
    bool listed[2] = {false, false};
    for (int i = 0; i < m.nfiles; i++) { listed[0] |= strcmp(m.file[i], TSYS__STATE_MODEL) == 0; listed[1] |= strcmp(m.file[i], TSYS__STATE_TRAIN) == 0; }
    if (s == TSYS_OK && (!listed[0] || !listed[1])) s = tsys__state_fail(ctx, TSYS_ERR_IO, snap, "MANIFEST does not list %s", listed[0] ? TSYS__STATE_TRAIN : TSYS__STATE_MODEL);
    if (s == TSYS_OK) s = tsys__st_open(ctx, mpath, mf);
    if (s == TSYS_OK) s = tsys__st_open(ctx, tpath, tf);
    if (s != TSYS_OK) return s;
    const char *version = tsys__st_meta_get(tf, "tsys_state_version");
    if (!version || atoi(version) != TSYS__STATE_VERSION)
        return tsys__state_fail(ctx, TSYS_ERR_UNSUPPORTED, snap, "format version %s; this tsys reads version %d", version ? version : "(missing)", TSYS__STATE_VERSION);
    tsys__state_parts p;
    if ((s = tsys__state_parts_make(ctx, snap, d, &p)) != TSYS_OK) return s;
    int *match = (int *)TSYS_MALLOC(sizeof(int) * (size_t)(p.n_model + p.n_train + 1));
    tsys__state_host_part h;
    memset(&h, 0, sizeof h);
    if (!match) s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", snap);
    if (s == TSYS_OK) s = tsys__state_match(ctx, snap, mf, p.model, p.model_names, p.n_model, match);
    if (s == TSYS_OK && d->optim) s = tsys__state_read_optim(ctx, snap, tf, d->optim, &h);
    if (s == TSYS_OK && d->optim) s = tsys__state_match(ctx, snap, tf, p.train, (const char *const *)p.train_names, p.n_train, match + p.n_model);
    if (s == TSYS_OK && d->scaler) s = tsys__state_read_scaler(ctx, snap, tf, &h.scaler);
    if (s == TSYS_OK && !d->no_rng) s = tsys__state_read_rng(ctx, snap, tf, h.rng);
    if (s == TSYS_OK && info) s = tsys__state_read_info(ctx, snap, tf, &m, info);
    // checked: from here on only writes, after any asynchronous snapshot's copies of the tensors
    if (s == TSYS_OK) s = tsys__copies_fence(ctx);
    for (int i = 0; s == TSYS_OK && i < p.n_model; i++) s = tsys__st_fill(mf, &mf->entries[match[i]], p.model[i]);
    for (int i = 0; s == TSYS_OK && d->optim && i < p.n_train; i++) s = tsys__st_fill(tf, &tf->entries[match[p.n_model + i]], p.train[i]);
    if (s == TSYS_OK) s = tsys__state_apply_host(ctx, d, &h);
    TSYS_FREE(match);
    tsys__state_parts_free(&p);
    return s;
}

TSYSDEF tsys_status tsys_state_load(tsys_ctx *ctx, const char *path, const tsys_state_desc *desc, tsys_state_info *info) {
    TSYS__CHECK_ARG(ctx, ctx && path && desc, TSYS_ERR_INVALID_ARGS, "tsys_state_load: NULL context, path or desc");
    if (ctx->status != TSYS_OK) return ctx->status;
    tsys__crc32c *crc = (tsys__crc32c *)TSYS_MALLOC(sizeof *crc);
    if (!crc) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", path);
    tsys__crc32c_init(crc);
    tsys__st_file mf, tf;
    memset(&mf, 0, sizeof mf);
    memset(&tf, 0, sizeof tf);
    tsys_status s = tsys__state_load(ctx, crc, path, desc, info, &mf, &tf);
    tsys__st_close(&mf);
    tsys__st_close(&tf);
    TSYS_FREE(crc);
    return s;
}

// ---- sharded snapshots: parts, commit, range reads --------------------------------------------------
//
// A part is a safetensors of chunks of global tensors (under their fqns; a file holds at most one chunk
// of a tensor), each chunk's place in "__metadata__" as "chunk.<fqn>" = "<offset> <d0>,<d1>...". A
// tensor without such a key (a plain snapshot's) is a whole chunk. A reader sorts every chunk of every
// file by (fqn, offset) and serves a range from the chunks that overlap it: any sharding reads back
// into any other, and a plain snapshot is a sharded one of whole chunks.

TSYSDEF tsys_status tsys_state_begin(tsys_ctx *ctx, const char *dir, char *tmp, size_t len) {
    TSYS__CHECK_ARG(ctx, ctx && dir && dir[0] && tmp && len, TSYS_ERR_INVALID_ARGS, "tsys_state_begin: NULL argument or empty buffer");
    tmp[0] = 0;
    if (ctx->status != TSYS_OK) return ctx->status;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) return tsys__state_fail(ctx, TSYS_ERR_IO, dir, "cannot make the directory: %s", strerror(errno));
    if (!tsys__state_is_dir(dir)) return tsys__state_fail(ctx, TSYS_ERR_IO, dir, "is not a directory");
    tsys__crc32c *crc = (tsys__crc32c *)TSYS_MALLOC(sizeof *crc);
    if (!crc) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", dir);
    tsys__crc32c_init(crc);
    tsys__state_entry *list;
    int n;
    tsys_status s = tsys__state_scan(ctx, crc, dir, true, &list, &n);   // removes dead writers' temporaries
    TSYS_FREE(list);
    TSYS_FREE(crc);
    if (s == TSYS_OK && !tsys__state_tmp_name(tmp, len, dir)) s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "path too long");
    if (s == TSYS_OK && !tsys__state_mkdir_tmp(tmp)) s = tsys__state_fail(ctx, TSYS_ERR_IO, dir, "cannot make a temporary directory in it: %s", strerror(errno));
    if (s != TSYS_OK) tmp[0] = 0;
    return s;
}

TSYSDEF void tsys_state_abort(const char *tmp) {
    if (tmp && tmp[0] && tsys__state_is_dir(tmp)) tsys__state_rmdir_files(NULL, tmp);
}

static int64_t tsys__state_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    return n;
}

// A chunk the part writer can save: a tensor of this context inside its global tensor.
static tsys_status tsys__state_chunk_ok(tsys_ctx *ctx, const char *path, const tsys_state_chunk *c, int i) {
    if (!c->fqn || !c->fqn[0] || !c->t) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "chunk %d has no fqn or no tensor", i);
    if (!tsys__owned(ctx, "tsys_state_part_write", c->t)) return TSYS_ERR_INVALID_ARGS;
    bool shape_ok = c->ndim >= 0 && c->ndim <= TSYS_MAX_DIMS;
    for (int d = 0; shape_ok && d < c->ndim; d++) shape_ok = c->shape[d] >= 0;
    int64_t n = tsys_tensor_numel(c->t);
    if (!shape_ok || c->offset < 0 || c->offset + n > tsys__state_numel(c->ndim, c->shape))
        return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "chunk '%s': elements [%lld, %lld) are not inside its global tensor of %lld", c->fqn,
                                (long long)c->offset, (long long)(c->offset + n), shape_ok ? (long long)tsys__state_numel(c->ndim, c->shape) : -1LL);
    return TSYS_OK;
}

// The views a part saves: a whole chunk in its global shape, a part of one flat.
static tsys_status tsys__state_chunk_views(tsys_ctx *ctx, const char *path, const tsys_state_chunk *chunks, int n, tsys_tensor **views) {
    for (int i = 0; i < n; i++) {
        const tsys_state_chunk *c = &chunks[i];
        tsys_status s = tsys__state_chunk_ok(ctx, path, c, i);
        if (s != TSYS_OK) return s;
        int64_t numel = tsys_tensor_numel(c->t);
        bool whole = c->offset == 0 && numel == tsys__state_numel(c->ndim, c->shape);
        views[i] = whole ? tsys_tensor_view_raw(ctx, c->t, 0, c->t->dtype, c->ndim, c->shape) : tsys_tensor_view_raw(ctx, c->t, 0, c->t->dtype, 1, &numel);
        if (!views[i]) return ctx->status != TSYS_OK ? ctx->status : TSYS_ERR_OOM;
    }
    return TSYS_OK;
}

// "__metadata__" of a part: the format version, desc's (train state and model dims), each chunk's place.
typedef struct tsys__state_part_meta {
    tsys__state_meta train;
    char dims[1 + TSYS__ST_NUM_DIMS][32];
    const char **pairs;       // 2 x n
    char **owned;             // the chunk keys and values
    int n, n_owned;
} tsys__state_part_meta;

static void tsys__state_part_meta_free(tsys__state_part_meta *pm) {
    for (int i = 0; i < pm->n_owned; i++) TSYS_FREE(pm->owned[i]);
    TSYS_FREE(pm->owned); TSYS_FREE(pm->pairs);
}

static char *tsys__state_strf(const char *fmt, ...) {
    char small[512];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (k < 0) return NULL;
    char *p = (char *)TSYS_MALLOC((size_t)k + 1);
    if (!p) return NULL;
    if ((size_t)k < sizeof small) { memcpy(p, small, (size_t)k + 1); return p; }
    va_start(ap, fmt);
    vsnprintf(p, (size_t)k + 1, fmt, ap);
    va_end(ap);
    return p;
}

static tsys_status tsys__state_part_meta_make(tsys_ctx *ctx, const char *path, const tsys_state_chunk *chunks, int n, const tsys_state_desc *d,
                                              tsys__state_part_meta *pm) {
    const char *dims[2 * (1 + TSYS__ST_NUM_DIMS)];
    int nd = tsys__state_model_meta(d ? d->model : NULL, pm->dims, dims);
    tsys_status s = TSYS_OK;
    if (d) s = tsys__state_meta_make(ctx, path, d, &pm->train);
    if (s != TSYS_OK) return s;
    int nt = d ? pm->train.n - 1 : 0;   // its first pair is the version, which dims already holds
    pm->pairs = (const char **)TSYS_MALLOC(sizeof(char *) * (size_t)(2 * (nd + nt + n) + 1));
    pm->owned = (char **)TSYS_MALLOC(sizeof(char *) * (size_t)(2 * n + 1));
    if (!pm->pairs || !pm->owned) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", path);
    for (int i = 0; i < 2 * nd; i++) pm->pairs[2 * pm->n + i] = dims[i];
    pm->n = nd;
    for (int i = 1; i <= nt; i++, pm->n++) { pm->pairs[2 * pm->n] = pm->train.pairs[2 * i]; pm->pairs[2 * pm->n + 1] = pm->train.pairs[2 * i + 1]; }
    for (int i = 0; i < n; i++, pm->n++) {
        const tsys_state_chunk *c = &chunks[i];
        char shape[TSYS_MAX_DIMS * 24 + 1] = "";
        for (int k = 0, at = 0; k < c->ndim; k++) at += snprintf(shape + at, sizeof shape - (size_t)at, k ? ",%lld" : "%lld", (long long)c->shape[k]);
        char *key = tsys__state_strf("chunk.%s", c->fqn), *value = tsys__state_strf("%lld %s", (long long)c->offset, shape);
        if (key) pm->owned[pm->n_owned++] = key;
        if (value) pm->owned[pm->n_owned++] = value;
        if (!key || !value) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", path);
        pm->pairs[2 * pm->n] = key; pm->pairs[2 * pm->n + 1] = value;
    }
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_state_part_write(tsys_ctx *ctx, const char *tmp, const char *file, const tsys_state_chunk *chunks, int n,
                                          const tsys_state_desc *desc, tsys_state_part *out) {
    TSYS__CHECK_ARG(ctx, ctx && tmp && file && out && n >= 0 && (!n || chunks), TSYS_ERR_INVALID_ARGS, "tsys_state_part_write: NULL argument");
    memset(out, 0, sizeof *out);
    if (ctx->status != TSYS_OK) return ctx->status;
    char path[TSYS__STATE_PATH];
    if (strlen(file) >= sizeof out->file || !tsys__state_name_ok(file) || !tsys__state_join(path, sizeof path, tmp, file))
        return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, tmp, "part file name '%.80s' must be 1 to %d bytes, hold no '/' and not start with '.'", file, (int)sizeof out->file - 1);
    tsys_tensor **views = (tsys_tensor **)TSYS_MALLOC(sizeof(tsys_tensor *) * (size_t)(n + 1));
    const char **names = (const char **)TSYS_MALLOC(sizeof(char *) * (size_t)(n + 1));
    tsys__state_part_meta *pm = (tsys__state_part_meta *)TSYS_MALLOC(sizeof *pm);
    tsys_status s = views && names && pm ? TSYS_OK : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", path);
    if (views) memset(views, 0, sizeof(tsys_tensor *) * (size_t)(n + 1));
    if (pm) memset(pm, 0, sizeof *pm);
    for (int i = 0; s == TSYS_OK && i < n; i++) names[i] = chunks[i].fqn;
    if (s == TSYS_OK) s = tsys__state_chunk_views(ctx, path, chunks, n, views);
    if (s == TSYS_OK) s = tsys__state_part_meta_make(ctx, path, chunks, n, desc, pm);
    tsys__crc32c *crc = s == TSYS_OK ? (tsys__crc32c *)TSYS_MALLOC(sizeof *crc) : NULL;
    if (s == TSYS_OK && !crc) s = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", path);
    if (s == TSYS_OK) {
        tsys__crc32c_init(crc);
        tsys__st_sum sum = { crc, 0, 0 };
        s = tsys__st_save(ctx, path, views, names, n, pm->pairs, pm->n, &sum);
        snprintf(out->file, sizeof out->file, "%s", file);
        out->bytes = sum.bytes; out->crc32c = sum.value;
    }
    for (int i = 0; views && i < n; i++) tsys_tensor_release(views[i]);
    if (pm) tsys__state_part_meta_free(pm);
    TSYS_FREE(crc); TSYS_FREE(pm); TSYS_FREE(names); TSYS_FREE(views);
    return s;
}

static bool tsys__state_layout_ok(const char *l) {
    if (strlen(l) >= 32) return false;
    for (; *l; l++) if (!((*l >= 'a' && *l <= 'z') || (*l >= 'A' && *l <= 'Z') || (*l >= '0' && *l <= '9') || *l == '_')) return false;
    return true;
}

TSYSDEF tsys_status tsys_state_commit(tsys_ctx *ctx, const char *dir, const char *tmp, const tsys_state_commit_desc *c) {
    TSYS__CHECK_ARG(ctx, ctx && dir && tmp && c && (c->n_parts == 0 || c->parts), TSYS_ERR_INVALID_ARGS, "tsys_state_commit: NULL argument");
    if (ctx->status != TSYS_OK) return ctx->status;
    char name[TSYS__STATE_NAME];
    snprintf(name, sizeof name, "step-%06lld", (long long)c->step);
    if (c->name) snprintf(name, sizeof name, "%s", c->name);
    if (c->step < 0 || c->keep_last < 0 || c->world < 0 || c->n_parts < 0 || c->n_parts > TSYS__STATE_MAX_FILES || (c->name && !tsys__state_name_ok(c->name)) ||
        (c->layout && !tsys__state_layout_ok(c->layout)))
        return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "commit: step %lld, keep_last %d, world %d, %d parts (at most %d), name '%.80s', layout '%.40s': "
                                "one of them is out of range", (long long)c->step, c->keep_last, c->world, c->n_parts, TSYS__STATE_MAX_FILES, name, c->layout ? c->layout : "");
    tsys__state_manifest *m = (tsys__state_manifest *)TSYS_MALLOC(sizeof *m);
    tsys__crc32c *crc = (tsys__crc32c *)TSYS_MALLOC(sizeof *crc);
    tsys_status s = m && crc ? TSYS_OK : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", dir);
    tsys__state_entry *list = NULL;
    int n = 0;
    if (s == TSYS_OK) {
        tsys__crc32c_init(crc);
        memset(m, 0, sizeof *m);
        s = tsys__state_scan(ctx, crc, dir, false, &list, &n);
        m->serial = n ? list[n - 1].serial + 1 : 1;
        m->step = c->step; m->world = c->world; m->nfiles = c->n_parts;
        if (c->layout) snprintf(m->layout, sizeof m->layout, "%s", c->layout);
        if (s == TSYS_OK && c->keep_last > 0) s = tsys__state_keep_last(ctx, crc, dir, c->keep_last);
    }
    for (int i = 0; s == TSYS_OK && i < c->n_parts; i++) {
        snprintf(m->file[i], sizeof m->file[i], "%s", c->parts[i].file);
        m->bytes[i] = c->parts[i].bytes; m->crc[i] = c->parts[i].crc32c;
        for (int j = 0; j < i; j++)
            if (!strcmp(m->file[j], m->file[i])) s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, dir, "commit: part '%s' listed twice", m->file[i]);
    }
    if (s == TSYS_OK) s = tsys__state_write_manifest(ctx, crc, tmp, m);
    if (s == TSYS_OK) s = tsys__state_install(ctx, crc, dir, tmp, name);
    if (s != TSYS_OK) tsys_state_abort(tmp);
    if (s == TSYS_OK && c->keep_last > 0) s = tsys__state_keep_last(ctx, crc, dir, c->keep_last);
    TSYS_FREE(list); TSYS_FREE(m); TSYS_FREE(crc);
    return s;
}

// ---- the reader ---------------------------------------------------------------------------------------

typedef struct tsys__state_chunk_at {
    const char *fqn;          // the entry's name (its file owns it)
    int file, entry;
    int64_t offset, numel;
    int ndim;
    int64_t shape[TSYS_MAX_DIMS];
    tsys_dtype dtype;
} tsys__state_chunk_at;

struct tsys_state_reader {
    tsys_ctx *ctx;
    char path[TSYS__STATE_PATH];
    tsys__crc32c crc;
    tsys__state_manifest m;
    tsys__st_file *files;     // m.nfiles, opened
    char (*paths)[TSYS__STATE_PATH];
    bool *verified;
    tsys__state_chunk_at *chunks;   // sorted by (fqn, offset)
    int nchunks;
    int *first;               // index into chunks of each global tensor's first chunk
    int ntensors;
};

static int tsys__state_cmp_chunk(const void *a, const void *b) {
    const tsys__state_chunk_at *x = (const tsys__state_chunk_at *)a, *y = (const tsys__state_chunk_at *)b;
    int c = strcmp(x->fqn, y->fqn);
    return c ? c : x->offset < y->offset ? -1 : x->offset > y->offset;
}

TSYSDEF void tsys_state_close(tsys_state_reader *r) {
    if (!r) return;
    for (int i = 0; r->files && i < r->m.nfiles; i++) tsys__st_close(&r->files[i]);
    TSYS_FREE(r->files); TSYS_FREE(r->paths); TSYS_FREE(r->verified); TSYS_FREE(r->chunks); TSYS_FREE(r->first);
    TSYS_FREE(r);
}

// "<offset> <d0>,<d1>..." into a chunk; false when malformed.
static bool tsys__state_parse_place(const char *v, tsys__state_chunk_at *c) {
    char *end = NULL;
    errno = 0;
    long long off = strtoll(v, &end, 10);
    if (errno || end == v || *end != ' ' || off < 0) return false;
    c->offset = off; c->ndim = 0;
    for (const char *p = end + 1; *p; ) {
        if (c->ndim == TSYS_MAX_DIMS) return false;
        long long d = strtoll(p, &end, 10);
        if (errno || end == p || d < 0 || (*end && *end != ',')) return false;
        c->shape[c->ndim++] = d;
        p = *end ? end + 1 : end;
    }
    return true;
}

// Every chunk of file f into r->chunks, its place from "chunk.<fqn>" or, absent, the whole tensor.
static tsys_status tsys__state_index_file(tsys_state_reader *r, int f) {
    tsys__st_file *sf = &r->files[f];
    for (int k = 0; k < sf->n; k++) {
        const tsys__st_entry *e = &sf->entries[k];
        tsys__state_chunk_at *c = &r->chunks[r->nchunks];
        memset(c, 0, sizeof *c);
        c->fqn = e->name; c->file = f; c->entry = k; c->dtype = e->dtype;
        c->numel = tsys_dtype_size(e->dtype) ? (int64_t)((e->end - e->begin) / tsys_dtype_size(e->dtype)) : 0;
        char *key = tsys__state_strf("chunk.%s", e->name);   // fqns may be longer than tensor names
        if (!key) return tsys_ctx_set_error(r->ctx, TSYS_ERR_OOM, "state '%s': out of memory", r->path);
        const char *place = tsys__st_meta_get(sf, key);
        bool ok = !place || tsys__state_parse_place(place, c);
        if (!ok) tsys__state_fail(r->ctx, TSYS_ERR_IO, r->path, "%s: \"%.200s\" is '%.60s', not \"<offset> <shape>\"", r->m.file[f], key, place);
        TSYS_FREE(key);
        if (!ok) return TSYS_ERR_IO;
        if (!place) {
            if (e->ndim > TSYS_MAX_DIMS) return tsys__state_fail(r->ctx, TSYS_ERR_UNSUPPORTED, r->path, "%s: tensor '%s' has %d dims", r->m.file[f], e->name, e->ndim);
            c->ndim = e->ndim;
            memcpy(c->shape, e->shape, sizeof(int64_t) * (size_t)e->ndim);
        }
        if (c->offset + c->numel > tsys__state_numel(c->ndim, c->shape))
            return tsys__state_fail(r->ctx, TSYS_ERR_IO, r->path, "%s: chunk '%s' [%lld, %lld) runs past its global tensor", r->m.file[f], e->name,
                                    (long long)c->offset, (long long)(c->offset + c->numel));
        r->nchunks++;
    }
    return TSYS_OK;
}

// After sorting: the chunks of one fqn agree on shape and dtype and do not overlap.
static tsys_status tsys__state_index_check(tsys_state_reader *r) {
    for (int i = 0; i < r->nchunks; i++) {
        const tsys__state_chunk_at *c = &r->chunks[i], *p = i ? &r->chunks[i - 1] : NULL;
        if (!p || strcmp(p->fqn, c->fqn) != 0) { r->first[r->ntensors++] = i; continue; }
        bool same = p->ndim == c->ndim && p->dtype == c->dtype && !memcmp(p->shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
        if (!same) return tsys__state_fail(r->ctx, TSYS_ERR_IO, r->path, "tensor '%s': %s and %s give it different shapes or dtypes", c->fqn, r->m.file[p->file], r->m.file[c->file]);
        if (p->offset + p->numel > c->offset)
            return tsys__state_fail(r->ctx, TSYS_ERR_IO, r->path, "tensor '%s': chunks of %s and %s overlap at element %lld", c->fqn, r->m.file[p->file], r->m.file[c->file], (long long)c->offset);
    }
    return TSYS_OK;
}

static tsys_status tsys__state_reader_fill(tsys_state_reader *r) {
    tsys_ctx *ctx = r->ctx;
    tsys_status s = tsys__state_read_manifest(ctx, &r->crc, r->path, &r->m);
    int nf = r->m.nfiles;
    if (s != TSYS_OK) return s;
    r->files = (tsys__st_file *)TSYS_MALLOC(sizeof(tsys__st_file) * (size_t)(nf + 1));
    r->paths = (char (*)[TSYS__STATE_PATH])TSYS_MALLOC(sizeof(*r->paths) * (size_t)(nf + 1));
    r->verified = (bool *)TSYS_MALLOC(sizeof(bool) * (size_t)(nf + 1));
    if (!r->files || !r->paths || !r->verified) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", r->path);
    memset(r->files, 0, sizeof(tsys__st_file) * (size_t)(nf + 1));
    memset(r->verified, 0, sizeof(bool) * (size_t)(nf + 1));
    int total = 0;
    for (int f = 0; f < nf; f++) {
        if (!tsys__state_join(r->paths[f], sizeof r->paths[f], r->path, r->m.file[f])) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, r->path, "path too long");
        if ((s = tsys__st_open(ctx, r->paths[f], &r->files[f])) != TSYS_OK) return s;
        if (r->files[f].file_bytes != r->m.bytes[f])
            return tsys__state_fail(ctx, TSYS_ERR_IO, r->path, "'%s' is %llu bytes, the manifest records %llu", r->m.file[f], (unsigned long long)r->files[f].file_bytes, (unsigned long long)r->m.bytes[f]);
        total += r->files[f].n;
    }
    r->chunks = (tsys__state_chunk_at *)TSYS_MALLOC(sizeof(tsys__state_chunk_at) * (size_t)(total + 1));
    r->first = (int *)TSYS_MALLOC(sizeof(int) * (size_t)(total + 1));
    if (!r->chunks || !r->first) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", r->path);
    for (int f = 0; s == TSYS_OK && f < nf; f++) s = tsys__state_index_file(r, f);
    if (s != TSYS_OK) return s;
    if (r->nchunks) qsort(r->chunks, (size_t)r->nchunks, sizeof *r->chunks, tsys__state_cmp_chunk);
    return tsys__state_index_check(r);
}

TSYSDEF tsys_state_reader *tsys_state_open(tsys_ctx *ctx, const char *path) {
    if (!ctx) return NULL;
    if (!path) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_state_open: NULL path"); return NULL; }
    if (ctx->status != TSYS_OK) return NULL;
    tsys_state_reader *r = (tsys_state_reader *)TSYS_MALLOC(sizeof *r);
    if (!r) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", path); return NULL; }
    memset(r, 0, sizeof *r);
    r->ctx = ctx;
    tsys__crc32c_init(&r->crc);
    if (snprintf(r->path, sizeof r->path, "%s", path) >= (int)sizeof r->path) { tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, path, "path too long"); TSYS_FREE(r); return NULL; }
    if (tsys__state_reader_fill(r) != TSYS_OK) { tsys_state_close(r); return NULL; }
    return r;
}

TSYSDEF int tsys_state_reader_world(const tsys_state_reader *r) { return r ? r->m.world : 0; }
TSYSDEF int64_t tsys_state_reader_step(const tsys_state_reader *r) { return r ? r->m.step : 0; }
TSYSDEF int tsys_state_reader_count(const tsys_state_reader *r) { return r ? r->ntensors : 0; }
TSYSDEF const char *tsys_state_reader_tensor(const tsys_state_reader *r, int i, tsys_dtype *dtype, int *ndim, int64_t *shape) {
    if (!r || i < 0 || i >= r->ntensors) return NULL;
    const tsys__state_chunk_at *c = &r->chunks[r->first[i]];
    if (dtype) *dtype = c->dtype;
    if (ndim) *ndim = c->ndim;
    if (shape) memcpy(shape, c->shape, sizeof(int64_t) * (size_t)c->ndim);
    return c->fqn;
}

// The first chunk of fqn (binary search over the sorted chunks), or -1.
static int tsys__state_find(const tsys_state_reader *r, const char *fqn) {
    int lo = 0, hi = r->ntensors - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, c = strcmp(r->chunks[r->first[mid]].fqn, fqn);
        if (!c) return r->first[mid];
        if (c < 0) lo = mid + 1; else hi = mid - 1;
    }
    return -1;
}

static tsys_status tsys__state_verify_file(tsys_state_reader *r, int f) {
    if (r->verified[f]) return TSYS_OK;
    tsys__state_manifest one = r->m;   // tsys__state_verify checks a manifest's files: this one's only
    snprintf(one.file[0], sizeof one.file[0], "%s", r->m.file[f]);
    one.bytes[0] = r->m.bytes[f]; one.crc[0] = r->m.crc[f]; one.nfiles = 1;
    tsys_status s = tsys__state_verify(r->ctx, &r->crc, r->path, &one);
    r->verified[f] = s == TSYS_OK;
    return s;
}

// Walks the chunks covering [offset, offset + numel) of fqn: verifies their files and, with dst (host
// bytes), reads the overlapping bytes into it.
static tsys_status tsys__state_range(tsys_state_reader *r, const char *fqn, int ndim, const int64_t *shape, tsys_dtype dt, int64_t offset, int64_t numel, char *dst) {
    int i = tsys__state_find(r, fqn);
    if (i < 0) return tsys__state_fail(r->ctx, TSYS_ERR_IO, r->path, "holds no tensor '%s'", fqn);
    const tsys__state_chunk_at *c = &r->chunks[i];
    bool same = c->ndim == ndim && c->dtype == dt && !memcmp(c->shape, shape, sizeof(int64_t) * (size_t)ndim);
    char a[160], b[160];
    if (!same)
        return tsys__state_fail(r->ctx, TSYS_ERR_IO, r->path, "tensor '%s': the snapshot holds %s %s, the load asks for %s %s", fqn, tsys_dtype_name(c->dtype),
                                tsys__st_shape_str(a, sizeof a, c->ndim, c->shape), tsys_dtype_name(dt), tsys__st_shape_str(b, sizeof b, ndim, shape));
    size_t es = tsys_dtype_size(dt);
    int64_t at = offset, end = offset + numel;
    for (; at < end && i < r->nchunks && !strcmp(r->chunks[i].fqn, fqn); i++) {
        c = &r->chunks[i];
        if (c->offset + c->numel <= at) continue;
        if (c->offset > at) break;   // a gap
        int64_t upto = c->offset + c->numel < end ? c->offset + c->numel : end;
        tsys_status s = tsys__state_verify_file(r, c->file);
        if (s != TSYS_OK) return s;
        if (dst) {
            tsys__st_file *sf = &r->files[c->file];
            tsys__st_entry part = sf->entries[c->entry];
            part.begin += (uint64_t)(at - c->offset) * es;
            part.end = part.begin + (uint64_t)(upto - at) * es;
            if ((s = tsys__st_read(sf, &part, dst + (size_t)(at - offset) * es)) != TSYS_OK) return s;
        }
        at = upto;
    }
    if (at < end) return tsys__state_fail(r->ctx, TSYS_ERR_IO, r->path, "tensor '%s': element %lld (of the range [%lld, %lld) asked for) is in no part of the snapshot",
                                          fqn, (long long)at, (long long)offset, (long long)end);
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_state_check_range(tsys_state_reader *r, const char *fqn, int ndim, const int64_t *shape, tsys_dtype dt, int64_t offset, int64_t numel) {
    if (!r) return TSYS_ERR_INVALID_ARGS;
    TSYS__CHECK_ARG(r->ctx, fqn && shape && ndim >= 0 && ndim <= TSYS_MAX_DIMS && offset >= 0 && numel >= 0, TSYS_ERR_INVALID_ARGS, "tsys_state_check_range: bad arguments");
    if (offset + numel > tsys__state_numel(ndim, shape))
        return tsys__state_fail(r->ctx, TSYS_ERR_INVALID_ARGS, r->path, "tensor '%s': the range [%lld, %lld) is past its %lld elements", fqn, (long long)offset,
                                (long long)(offset + numel), (long long)tsys__state_numel(ndim, shape));
    return tsys__state_range(r, fqn, ndim, shape, dt, offset, numel, NULL);
}

TSYSDEF tsys_status tsys_state_read(tsys_state_reader *r, const char *fqn, int64_t offset, tsys_tensor *dst) {
    if (!r) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = r->ctx;
    TSYS__CHECK_ARG(ctx, fqn && dst && offset >= 0, TSYS_ERR_INVALID_ARGS, "tsys_state_read: bad arguments");
    if (!tsys__owned(ctx, "tsys_state_read", dst)) return TSYS_ERR_INVALID_ARGS;
    int i = tsys__state_find(r, fqn);
    if (i < 0) return tsys__state_fail(ctx, TSYS_ERR_IO, r->path, "holds no tensor '%s'", fqn);
    const tsys__state_chunk_at *c = &r->chunks[i];
    int64_t n = tsys_tensor_numel(dst);
    if (offset + n > tsys__state_numel(c->ndim, c->shape))
        return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, r->path, "tensor '%s': the range [%lld, %lld) is past its %lld elements", fqn, (long long)offset,
                                (long long)(offset + n), (long long)tsys__state_numel(c->ndim, c->shape));
    if (tsys__copies_fence(ctx) != TSYS_OK) return ctx->status;
    bool direct = dst->device == TSYS_CPU;
    char *host = direct ? (char *)tsys_tensor_data(dst) : (char *)TSYS_MALLOC(tsys_tensor_bytes(dst) + 1);
    if (!host) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory staging '%s'", r->path, fqn);
    tsys_status s = tsys__state_range(r, fqn, c->ndim, c->shape, dst->dtype, offset, n, host);
    if (direct) tsys_tensor_mark_written(dst);
    else { if (s == TSYS_OK) s = tsys__st_upload(ctx, dst, host); TSYS_FREE(host); }
    return s;
}

// The file whose metadata a load's host state comes from (see tsys_state_read_host).
static int tsys__state_meta_file(const tsys_state_reader *r, int part, bool want_optim) {
    int pick = -1;
    char name[64];
    snprintf(name, sizeof name, "rank-%05d.safetensors", part);
    for (int f = 0; f < r->m.nfiles && pick < 0; f++)
        if (r->m.world > 0 ? !strcmp(r->m.file[f], name) : !strcmp(r->m.file[f], TSYS__STATE_TRAIN)) pick = f;
    if (pick >= 0 && (!want_optim || tsys__st_meta_get(&r->files[pick], "optim.step"))) return pick;
    for (int f = 0; f < r->m.nfiles; f++)
        if (tsys__st_meta_get(&r->files[f], want_optim ? "optim.step" : "step")) return f;
    return pick;
}

TSYSDEF tsys_status tsys_state_read_host(tsys_state_reader *r, int part, const tsys_state_desc *d, tsys_state_info *info, bool apply) {
    if (!r) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = r->ctx;
    TSYS__CHECK_ARG(ctx, d, TSYS_ERR_INVALID_ARGS, "tsys_state_read_host: NULL desc");
    if (d->optim && d->optim->ctx != ctx) return tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, r->path, "desc.optim belongs to another context");
    int f = tsys__state_meta_file(r, part < 0 ? 0 : part, d->optim != NULL);
    if (f < 0) return tsys__state_fail(ctx, TSYS_ERR_IO, r->path, "no file holds the training state's metadata (step, optimizer)");
    tsys__st_file *sf = &r->files[f];
    const char *version = tsys__st_meta_get(sf, "tsys_state_version");
    if (!version || atoi(version) != TSYS__STATE_VERSION)
        return tsys__state_fail(ctx, TSYS_ERR_UNSUPPORTED, r->path, "format version %s; this tsys reads version %d", version ? version : "(missing)", TSYS__STATE_VERSION);
    tsys__state_host_part h;
    memset(&h, 0, sizeof h);
    tsys_status s = tsys__state_verify_file(r, f);
    if (s == TSYS_OK && d->optim) s = tsys__state_read_optim(ctx, r->path, sf, d->optim, &h);
    if (s == TSYS_OK && d->scaler) s = tsys__state_read_scaler(ctx, r->path, sf, &h.scaler);
    if (s == TSYS_OK && !d->no_rng) s = tsys__state_read_rng(ctx, r->path, sf, h.rng);
    if (s == TSYS_OK && info) s = tsys__state_read_info(ctx, r->path, sf, &r->m, info);
    if (s != TSYS_OK || !apply) return s;
    return tsys__state_apply_host(ctx, d, &h);
}

// ---- consolidation --------------------------------------------------------------------------------------

static bool tsys__state_is_dim_key(const char *k) {
    for (int i = 0; i < TSYS__ST_NUM_DIMS; i++) if (!strcmp(k, tsys__st_dim_keys[i])) return true;
    return false;
}

// The metadata of a consolidated file, from the reader's files: model.safetensors the version and the
// model's dims (the first file holding d_model), train_state the rest of the training state's (the
// file tsys_state_read_host would use for part 0), chunk places dropped.
static int tsys__state_plain_meta(const tsys_state_reader *r, bool model, const char **pairs, int cap) {
    int f = -1, n = 0;
    for (int i = 0; model && i < r->m.nfiles && f < 0; i++) if (tsys__st_meta_get(&r->files[i], "d_model")) f = i;
    if (!model) f = tsys__state_meta_file(r, 0, true);
    if (model) { pairs[0] = "tsys_state_version"; pairs[1] = TSYS__STATE_VERSION_STR; n = 1; }
    const tsys__st_file *sf = f >= 0 ? &r->files[f] : NULL;
    for (int i = 0; sf && i + 1 < sf->nmeta && n < cap; i += 2) {
        const char *k = sf->meta[i];
        bool keep = model ? tsys__state_is_dim_key(k) : strncmp(k, "chunk.", 6) != 0 && !tsys__state_is_dim_key(k) && strcmp(k, "format") != 0;
        if (keep) { pairs[2 * n] = k; pairs[2 * n + 1] = sf->meta[i + 1]; n++; }
    }
    return n;
}

TSYSDEF tsys_status tsys_state_consolidate(tsys_ctx *ctx, const char *src, const char *dst) {
    TSYS__CHECK_ARG(ctx, ctx && src && dst, TSYS_ERR_INVALID_ARGS, "tsys_state_consolidate: NULL argument");
    if (ctx->status != TSYS_OK) return ctx->status;
    tsys_state_reader *r = tsys_state_open(ctx, src);
    if (!r) return ctx->status;
    int n = r->ntensors, nmodel = 0, ntrain = 0;
    tsys_tensor **all = (tsys_tensor **)TSYS_MALLOC(sizeof(tsys_tensor *) * (size_t)(2 * n + 1));
    const char **names = (const char **)TSYS_MALLOC(sizeof(char *) * (size_t)(2 * n + 1));   // fqns: longer than a tensor's name may be
    const char **pairs = (const char **)TSYS_MALLOC(sizeof(char *) * 4 * (TSYS__STATE_META + TSYS__ST_NUM_DIMS + 2));
    tsys_status s = all && names && pairs ? TSYS_OK : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", src);
    tsys_tensor **model = all, **train = all ? all + n : NULL;
    const char **model_names = names, **train_names = names ? names + n : NULL;
    for (int i = 0; s == TSYS_OK && i < n; i++) {   // every tensor whole, on the host
        tsys_dtype dt;
        int ndim;
        int64_t shape[TSYS_MAX_DIMS];
        const char *fqn = tsys_state_reader_tensor(r, i, &dt, &ndim, shape);
        tsys_tensor *t = tsys_tensor_new(ctx, dt, TSYS_CPU, ndim, shape);
        if (!t) { s = ctx->status != TSYS_OK ? ctx->status : TSYS_ERR_OOM; break; }
        tsys_tensor_set_name(t, "%s", fqn);
        if (!strncmp(fqn, "optim.state.", 12)) { train_names[ntrain] = fqn; train[ntrain++] = t; }
        else { model_names[nmodel] = fqn; model[nmodel++] = t; }
        s = tsys_state_read(r, fqn, 0, t);
    }
    const char *base = strrchr(src, '/');
    base = base && base[1] ? base + 1 : src;
    char tmp[TSYS__STATE_PATH];
    tmp[0] = 0;
    if (s == TSYS_OK) s = tsys_state_begin(ctx, dst, tmp, sizeof tmp);
    tsys_state_part parts[2];
    memset(parts, 0, sizeof parts);
    for (int f = 0; s == TSYS_OK && f < 2; f++) {
        char path[TSYS__STATE_PATH];
        const char **meta = pairs + (f ? 2 * (TSYS__STATE_META + TSYS__ST_NUM_DIMS + 2) : 0);
        int nmeta = tsys__state_plain_meta(r, f == 0, meta, TSYS__STATE_META + TSYS__ST_NUM_DIMS + 1);
        tsys__st_sum sum = { &r->crc, 0, 0 };
        snprintf(parts[f].file, sizeof parts[f].file, "%s", f ? TSYS__STATE_TRAIN : TSYS__STATE_MODEL);
        if (!tsys__state_join(path, sizeof path, tmp, parts[f].file)) { s = tsys__state_fail(ctx, TSYS_ERR_INVALID_ARGS, tmp, "path too long"); break; }
        s = tsys__st_save(ctx, path, f ? train : model, f ? train_names : model_names, f ? ntrain : nmodel, meta, nmeta, &sum);
        parts[f].bytes = sum.bytes; parts[f].crc32c = sum.value;
    }
    if (s == TSYS_OK) {
        tsys_state_commit_desc c;
        memset(&c, 0, sizeof c);
        c.name = base; c.step = r->m.step; c.parts = parts; c.n_parts = 2;
        s = tsys_state_commit(ctx, dst, tmp, &c);
    } else tsys_state_abort(tmp);
    for (int i = 0; i < nmodel; i++) tsys_tensor_release(model[i]);
    for (int i = 0; i < ntrain; i++) tsys_tensor_release(train[i]);
    TSYS_FREE(all); TSYS_FREE(names); TSYS_FREE(pairs);
    tsys_state_close(r);
    return s;
}

#else   // no POSIX file system calls: snapshots are not available

TSYSDEF tsys_status tsys_state_save(tsys_ctx *ctx, const char *dir, const tsys_state_desc *desc) {
    (void)dir; (void)desc;
    return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_state_save: needs a POSIX system (directories, fsync, rename)");
}
TSYSDEF tsys_status tsys_state_load(tsys_ctx *ctx, const char *path, const tsys_state_desc *desc, tsys_state_info *info) {
    (void)path; (void)desc; (void)info;
    return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_state_load: needs a POSIX system");
}
TSYSDEF tsys_status tsys_state_latest(tsys_ctx *ctx, const char *dir, char *buf, size_t len) {
    (void)dir;
    if (buf && len) buf[0] = 0;
    return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_state_latest: needs a POSIX system");
}
TSYSDEF const char *tsys_state_info_get(const tsys_state_info *info, const char *key) {
    for (int i = 0; info && key && i < info->n_user; i++) if (strcmp(info->key[i], key) == 0) return info->value[i];
    return NULL;
}
#define TSYS__STATE_NO_POSIX(what) tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, what ": needs a POSIX system")
TSYSDEF tsys_status tsys_state_begin(tsys_ctx *ctx, const char *dir, char *tmp, size_t len) {
    (void)dir; if (tmp && len) tmp[0] = 0;
    return TSYS__STATE_NO_POSIX("tsys_state_begin");
}
TSYSDEF tsys_status tsys_state_part_write(tsys_ctx *ctx, const char *tmp, const char *file, const tsys_state_chunk *chunks, int n,
                                          const tsys_state_desc *desc, tsys_state_part *out) {
    (void)tmp; (void)file; (void)chunks; (void)n; (void)desc; (void)out;
    return TSYS__STATE_NO_POSIX("tsys_state_part_write");
}
TSYSDEF tsys_status tsys_state_commit(tsys_ctx *ctx, const char *dir, const char *tmp, const tsys_state_commit_desc *c) {
    (void)dir; (void)tmp; (void)c;
    return TSYS__STATE_NO_POSIX("tsys_state_commit");
}
TSYSDEF void tsys_state_abort(const char *tmp) { (void)tmp; }
TSYSDEF tsys_state_reader *tsys_state_open(tsys_ctx *ctx, const char *path) { (void)path; TSYS__STATE_NO_POSIX("tsys_state_open"); return NULL; }
TSYSDEF int tsys_state_reader_world(const tsys_state_reader *r) { (void)r; return 0; }
TSYSDEF int64_t tsys_state_reader_step(const tsys_state_reader *r) { (void)r; return 0; }
TSYSDEF int tsys_state_reader_count(const tsys_state_reader *r) { (void)r; return 0; }
TSYSDEF const char *tsys_state_reader_tensor(const tsys_state_reader *r, int i, tsys_dtype *dtype, int *ndim, int64_t *shape) {
    (void)r; (void)i; (void)dtype; (void)ndim; (void)shape;
    return NULL;
}
TSYSDEF tsys_status tsys_state_check_range(tsys_state_reader *r, const char *fqn, int ndim, const int64_t *shape, tsys_dtype dt, int64_t offset, int64_t numel) {
    (void)r; (void)fqn; (void)ndim; (void)shape; (void)dt; (void)offset; (void)numel;
    return TSYS_ERR_UNSUPPORTED;
}
TSYSDEF tsys_status tsys_state_read(tsys_state_reader *r, const char *fqn, int64_t offset, tsys_tensor *dst) { (void)r; (void)fqn; (void)offset; (void)dst; return TSYS_ERR_UNSUPPORTED; }
TSYSDEF tsys_status tsys_state_read_host(tsys_state_reader *r, int part, const tsys_state_desc *desc, tsys_state_info *info, bool apply) {
    (void)r; (void)part; (void)desc; (void)info; (void)apply;
    return TSYS_ERR_UNSUPPORTED;
}
TSYSDEF void tsys_state_close(tsys_state_reader *r) { (void)r; }
TSYSDEF tsys_status tsys_state_consolidate(tsys_ctx *ctx, const char *src, const char *dst) { (void)src; (void)dst; return TSYS__STATE_NO_POSIX("tsys_state_consolidate"); }
TSYSDEF tsys_state_saver *tsys_state_saver_new(tsys_ctx *ctx) { TSYS__STATE_NO_POSIX("tsys_state_saver_new"); return NULL; }
TSYSDEF tsys_status tsys_state_save_async(tsys_state_saver *sv, const char *dir, const tsys_state_desc *desc) { (void)sv; (void)dir; (void)desc; return TSYS_ERR_UNSUPPORTED; }
TSYSDEF tsys_status tsys_state_saver_copied(tsys_state_saver *sv) { (void)sv; return TSYS_ERR_UNSUPPORTED; }
TSYSDEF tsys_status tsys_state_saver_reserve(tsys_state_saver *sv, const tsys_state_desc *desc) { (void)sv; (void)desc; return TSYS_ERR_UNSUPPORTED; }
TSYSDEF tsys_status tsys_state_saver_wait(tsys_state_saver *sv) { (void)sv; return TSYS_ERR_UNSUPPORTED; }
TSYSDEF bool tsys_state_saver_busy(const tsys_state_saver *sv) { (void)sv; return false; }
TSYSDEF tsys_state_saver_stats tsys_state_saver_stats_get(const tsys_state_saver *sv) { tsys_state_saver_stats z; (void)sv; memset(&z, 0, sizeof z); return z; }
TSYSDEF void tsys_state_saver_free(tsys_state_saver *sv) { (void)sv; }
static tsys_status tsys__copies_fence(tsys_ctx *ctx) { (void)ctx; return TSYS_OK; }

#endif // TSYS__POSIX

#endif // TSYS_IMPLEMENTATION

/*
------------------------------------------------------------------------------
MIT License
Copyright (c) 2026 the tsys authors
Permission is hereby granted, free of charge, to any person obtaining a copy of
this software and associated documentation files (the "Software"), to deal in
the Software without restriction, including without limitation the rights to
use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies
of the Software, and to permit persons to whom the Software is furnished to do
so, subject to the following conditions:
The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.
THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
------------------------------------------------------------------------------
*/
