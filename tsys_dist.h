/* tsys_dist.h - v0.2 - distributed training for tsys: process groups on NCCL (GPUs) and MPI (CPUs),
   collectives, DDP (naive, flat, overlap, bucketed), ZeRO-1, FSDP (ZeRO-3, `>>fsdp`), and
   memory/communication accounting

   Where things are (search for the tag; one line per >>tag section, in file order):
      >>public       defines: the API (tsys_dist_desc and its options, tsys_dist_init/_free/_get_desc,
                     tsys_dist_spawn(_desc), collectives, tsys_ddp, tsys_zero1, tsys_fsdp, accounting)
      >>config       defines: includes, tuning constants, struct tsys_dist and tsys_dist_work, the engine
                     table tsys_dist__engine, tsys_dist__coll (one collective), errors, descriptor checks
      >>options      defines: tsys_dist__options (desc + environment -> the options in effect), env readers,
                     tsys_dist__shm_slice_for
      >>launch       defines: tsys_dist_spawn(_desc) (the local launcher), the TCP rendezvous
                     (tsys_dist__tcp_setup: hello, run id, HMAC secret, torchrun's agent store)
      >>engines      defines: what the engines share: host reductions (tsys_dist__reduce), pid checks,
                     setup collectives (tsys_dist__setup_bcast), the self engine (a group of one)
      >>engine shm   defines: shared-memory collectives (tsys_dist__shm_coll), tsys_dist__shm_setup, tsys_dist__engine_shm
      >>engine tcp   defines: collectives through rank 0's star of sockets (tsys_dist__tcp_coll), tsys_dist__engine_tcp
      >>engine mpi   defines: MPI's non-blocking collectives (tsys_dist__mpi_coll), tsys_dist__mpi_setup, tsys_dist__engine_mpi
      >>engine nccl  defines: NCCL collectives on the streams (tsys_dist__nccl_coll), tsys_dist__nccl_setup,
                     tsys_dist__nccl_drain, symmetric windows, tsys_dist__engine_nccl; the copy engines' transfers
                     through CUDA IPC (all-reduce, DDP's gradient gather tsys_dist__ceg, FSDP's units tsys_dist__fce)
      >>group        defines: engine dispatch (tsys_dist__host_exec), the worker thread, tsys_dist_init and
                     its steps (join, engine_fits, shm_join, device_join), teardown, accessors
      >>subgroups    defines: tsys_dist_split (a group of some ranks on the parent's engines: MPI_Comm_split, a
                     TCP star of its own, shared memory, NCCL), the device mesh (tsys_dist_mesh_*)
      >>collectives  defines: tsys_dist_tensor_new, tsys_dist__issue (every collective's path), the
                     public collectives, wait, groups, sync, barrier, all_reduce_host
      >>ddp          defines: tsys_ddp (naive, flat, overlap, bucketed), agreed layouts (tsys_dist__agree_layout)
      >>zero1        defines: tsys_zero1 (sharded AdamW)
      >>fsdp         defines: tsys_fsdp (ZeRO-3: units, gathers, reduce-scatters through the trace hooks, or
                     pulls and pushes on the copy engines: desc.ce_transfers)
      >>tp           defines: tsys_tp_model (Megatron tensor parallelism of the cs336 model: column- and row-
                     parallel linears, the all-reduces as custom autograd ops, vocabulary-parallel embedding and
                     cross-entropy, sequence parallelism)
      >>accounting   defines: tsys_dist_accounting, tsys_fsdp_accounting(_desc)
      >>link model   defines: tsys_dist_calibrate_link (an alpha-beta model of the link, measured),
                     tsys_dist_link_time_ms, tsys_dist_ring_sent, and the S26 section 8 plan: tsys_dist_plan_step,
                     _step_links, tsys_dist_plan_of
      >>state sharded defines: tsys_zero1_state_save/_load, tsys_fsdp_state_save/_load (sharded snapshots: a plan of
                     chunks per rank, parts written in parallel, rank 0's MANIFEST, statuses agreed; any world loads)
      >>trainer      defines: tsys_dist_trainer (a model trained under DDP, ZeRO-1, FSDP or alone, a step at a
                     time in timed phases, or captured as one CUDA graph and replayed: tsys_dist_trainer_capture,
                     _replay, _uncapture), tsys_dist_any_failed, tsys_dist_share_cores

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

   C builds also need -D_GNU_SOURCE (POSIX sockets, shared memory and threads; C++ has it already)
   and -pthread. The Makefile's DIST_CFLAGS / DIST_NVFLAGS have everything.

   Quick start (run as `mpirun -np 4 ./prog`, or `./prog 4` through the built-in launcher):

      int code;
      if (tsys_dist_spawn(argc > 1 ? atoi(argv[1]) : 1, argc, argv, &code)) return code;   // the launcher
      tsys_ctx *ctx = tsys_ctx_new(NULL);
      tsys_dist *d = tsys_dist_init(ctx, NULL);                  // NULL: tsys_ctx_last_error(ctx) says why
      tsys_dist_all_reduce(d, grad, TSYS_DIST_AVG);              // in place, every rank gets the mean
      tsys_dist_work *w = tsys_dist_all_reduce_async(d, other, TSYS_DIST_SUM);
      ... compute ...
      tsys_dist_wait(w);                                         // frees w
      tsys_dist_free(d);                                         // before tsys_ctx_free

   Engines (tsys_dist_engine_of):
      mpi    ranks started by mpirun / srun (needs TSYS_DIST_MPI). Host tensors through MPI's
             non-blocking collectives, or through shared memory when every rank is on this host.
      tcp    ranks started by tsys_dist_spawn or torchrun-style variables (no MPI needed): host
             tensors through shared memory on one host, else through TCP sockets (a star around
             rank 0: fine for control and small tensors; use mpirun for bandwidth across hosts).
      nccl   a CUDA group (desc.cuda) with TSYS_DIST_NCCL: CUDA tensors through NCCL on the side
             stream; host tensors still go the mpi or tcp way.
      self   a group of one: collectives are the identity (reduce-scatter and all-gather copy).
   MPI and the tcp engine are never mixed: a process started by mpirun is an MPI rank, any other
   process (the launcher's, torchrun's) is a tcp rank, and asking for the other engine is an error.
   CUDA tensors in a group without NCCL travel through host memory (copy to the host, host
   collective, copy back; blocking): how Gloo treats them, and how two ranks can share one GPU.

   Launch and rendezvous, in this order of preference (tsys_dist_init):
      1. under mpirun / srun (OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK, an srun step, or MPI
         already initialized): rank, size and local rank (MPI_COMM_TYPE_SHARED) from MPI; the NCCL
         id is broadcast over MPI (this is how to go multi-node);
      2. torchrun-style environment variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (default
         127.0.0.1), MASTER_PORT (default 29500): rank 0 listens on MASTER_PORT at MASTER_ADDR's
         address, the others connect (retrying until the timeout), send a hello and get the table of
         ranks; the connections stay as the group's control path (the NCCL id, the shared segment's
         name, the tcp engine). Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent holds
         MASTER_PORT with its TCPStore: every rank is a client of that store, rank 0 listens on a
         port the system picks and publishes it there, the others wait for it (within the timeout)
         and join as above. LOCAL_WORLD_SIZE, when set, must be in [1, WORLD_SIZE]. Who may join:
         see ON THE RENDEZVOUS;
      3. neither: a group of one.
      tsys_dist_spawn(nproc, argc, argv) is the built-in local launcher (drivers' --nproc N, like
      torch.multiprocessing.spawn): it starts N copies of the program with the variables of 2 set
      (rank 0 inherits the launcher's listening socket, so the port cannot be taken in between) and
      waits. A CUDA rank uses GPU = local rank mod the device count.

   Options: tsys_dist_desc fields (0 = default), each with an environment variable that overrides it
   when set (read in one place, tsys_dist__options, by tsys_dist_init and tsys_dist_spawn_desc; a value
   out of range is an error naming the variable or the field); tsys_dist_get_desc says what is in effect:
      TSYS_DIST_TIMEOUT     desc.timeout_s: seconds without progress from a peer before a wait fails
                            (default 300). The one exception to the rule: a desc.timeout_s > 0 wins
      TSYS_DIST_SHM=0|1     desc.no_shm: no shared-memory path (host tensors through MPI or TCP)
      TSYS_DIST_SHM_SLICE   desc.shm_slice: bytes per rank per pipeline slot of the shared segment (default
                            8 MiB / ranks, within [256 KiB, 4 MiB]: a 16 MiB segment, each slice's data in the L3 cache)
      TSYS_DIST_BIND=0|1    desc.no_bind: tsys_dist_spawn leaves the ranks unbound (by default each rank gets its
                            own ncpu/nproc cores, as mpirun binds ranks; never when ranks > cores)
      TSYS_DIST_NCCL_BLOCKING=0|1  desc.nccl_nonblocking: a non-blocking NCCL communicator (every NCCL call polled
                            with the deadline; each collective ~50 us slower); default NCCL's blocking mode
      TSYS_DIST_CE=0|1      desc.ce_allreduce: fp32 sums and averages of CUDA tensors of 1 MiB and more go through the copy
                            engines (ranks on one host, one GPU each) instead of NCCL's kernels, which slow the
                            compute beside them; summed in rank order; 256-384 MiB of scratch a rank
                            (tsys_dist_device_bytes). DDP's xl step on 2 x H200: 1.20-1.22x one GPU's against
                            NCCL's 1.27x, with buckets of 100-200 MB; on 4 GPUs slower than NCCL. Default off
      TSYS_DIST_CHECK=0|1   desc.check: 1 (TSYS_DIST_CHECK_ALWAYS): every MPI/NCCL collective first checks that
                            all ranks pass the same op, dtype and size; 0 (_NEVER): never; default (_AUTO): under
                            TSYS_DEBUG, MPI at 64 KiB and up, NCCL at 64 MiB and up (a host round trip: ~4 us,
                            13% of a 1 MB NCCL all-reduce); the shared-memory and tcp paths always check (it
                            costs them nothing)
      TSYS_DIST_RUN_ID      desc.run_id: the job's identity in the TCP rendezvous (else TORCHELASTIC_RUN_ID)
      TSYS_DIST_SECRET      desc.secret: a shared secret every rank of the TCP rendezvous must prove it knows
      TSYS_DIST_LISTEN_ADDR desc.listen_addr: where rank 0 listens (default: MASTER_ADDR's address)

   ON THE RENDEZVOUS (what rank 0's port trusts)
      - It listens where MASTER_ADDR points (loopback for tsys_dist_spawn's ranks), not on every
        interface; TSYS_DIST_LISTEN_ADDR=0.0.0.0 (or ::, or desc.listen_addr) widens it. A loopback MASTER_ADDR in a job
        whose ranks are not all on this host (LOCAL_WORLD_SIZE < WORLD_SIZE) is refused at once.
      - Every hello carries the job's run id (TSYS_DIST_RUN_ID or desc.run_id, else torchrun's TORCHELASTIC_RUN_ID):
        rank 0 admits only its own run's, and a rank joins only a rank 0 of its own run, so two jobs
        given one MASTER_PORT fail instead of forming one group. Rank 0 warns when there is no run id.
      - With TSYS_DIST_SECRET (or desc.secret) set, both sides prove they know it (HMAC-SHA-256 over the other side's
        fresh nonce: the secret never crosses the wire, an old hello cannot be replayed).
        tsys_dist_spawn gives its ranks a random run id and secret.
      - A connection that is not a rank of this job (garbage, another protocol or run, a wrong secret,
        a wrong RANK or WORLD_SIZE) is refused with one line on rank 0's stderr and the rendezvous goes
        on; at most 64 connections wait for their hello at once, each for at most 10 s.
      - Under torchrun, rank 0's port is found in the agent's store, under the key
        /tsys/<run id>/<TORCHELASTIC_RESTART_COUNT>/<n>/rank0 (n counts the TCP rendezvous of the
        process, so every rank must make its groups in the same order); only the commands VALIDATE,
        SET, CHECK, WAIT and GET of torch's TCPStore protocol are spoken (pinned on torch 2.11).
        Whoever can reach the store can read the port: the hello's run id and secret still decide.
      - Not protected: the traffic after the rendezvous (collectives, the NCCL id) is neither encrypted
        nor authenticated; run jobs on networks you trust, as with torchrun and NCCL.

   ON CORES
      tsys_dist_init gives each rank on a host cores / ranks OpenMP and OpenBLAS threads (and sets
      OMP_NUM_THREADS and OPENBLAS_NUM_THREADS to it), as torchrun does, unless OMP_NUM_THREADS is
      already set: ranks that each start a thread per core spin in each other's way.

   ON ASYNCHRONOUS COLLECTIVES
      CUDA tensors through NCCL: launched on the side stream after the compute stream's work so far
      (a blocking one goes on the compute stream itself when no asynchronous one is in flight);
      tsys_dist_wait makes the compute stream wait (no host sync; capturable in a CUDA graph).
      Host tensors: a worker thread per group runs them in the order they were issued (true overlap
      with the caller's computation); a blocking collective waits for the queue first. Keep the
      tensors alive and untouched until tsys_dist_wait, and wait for every handle (it frees it).
      One thread uses a group; several groups may coexist (each has its own worker and segment).

   ON FAILURE
      Every MPI and NCCL call is checked (MPI_ERRORS_RETURN on the group's communicator; only
      tsys_dist_free's own calls, which have nobody to report to, go unchecked). Waits poll
      with a deadline of desc.timeout_s without progress, so a dead or stalled peer ends in an error
      (TSYS_ERR_IO, the message says which collective) and the group is marked broken: every later
      call fails at once, tsys_dist_free skips MPI_Finalize, and the program should exit non-zero.
      What names the culprit:
        - shared memory (all ranks on one host, either engine): "rank R (pid P) exited" within 50 ms
          of its death, or "no reply from rank R (pid P) within T s" for a stalled one; the rank that
          sees it first tells the others through the segment;
        - tcp without shared memory: rank 0 names the rank whose socket closed or went silent and
          tells the others; the others name rank 0 when it is the one that is gone;
        - MPI across hosts: "no reply from the group within T s" (MPI does not say who; mpirun itself
          stops the job when a rank exits and names it); ranks on this host are still named by pid;
        - NCCL: the communicator is made on a helper thread that the rank waits for with the deadline
          (a group that does not form is an error, the helper left behind); a collective that never
          finishes is detected where the host waits for the NCCL streams (polling ncclCommGetAsyncError
          and, every 50 ms, the peers this rank can see: by pid on one host, by a closed socket of the
          TCP star; then ncclCommAbort): tsys_dist_sync, tsys_dist_barrier, and tsys_dist_free before
          it finalizes the communicator;
        - the launcher prints the first rank that exited non-zero and stops the others after a grace
          of min(5 s, TSYS_DIST_TIMEOUT) (they usually report the dead rank themselves first).
      Not detected: a rank that keeps calling collectives of matching shape with wrong data; an NCCL
      collective stuck while nobody calls tsys_dist_barrier (the GPU stream just waits); a mismatch in
      an MPI collective under 64 KiB or an NCCL one under 64 MiB when TSYS_DEBUG is off and
      TSYS_DIST_CHECK is not 1 (it may then hang until the timeout, or be reported by MPI as truncation).

   tsys_dist DOES NOT:
      - hang on a dead or stuck peer: every wait is bounded by the group's timeout (desc.timeout_s,
        else TSYS_DIST_TIMEOUT from the environment, else 300 s) and ends in an error naming the rank
        where it can (see ON FAILURE)
      - copy gradients into buckets: buckets are views of the contiguous gradient arena
      - keep global state beyond what MPI itself keeps (MPI_Init is once per process; the group that
        initialized MPI finalizes it in tsys_dist_free: free it last)
      - call exit(): errors come back as a status and the context's message

   Revision history:
      0.3  every option is a tsys_dist_desc field (the environment over it), tsys_dist_get_desc,
           tsys_dist_spawn_desc; one section and one function table per engine
      0.2  collectives carry their own check (the MPI path's race); MPI sums in rank order; a rendezvous
           that admits only its own job (run id, optional secret, bound to MASTER_ADDR); torchrun's agent
           store; tsys_dist_sync; tsys_dist_local_size
      0.1  first release

   License: MIT, see the end of tsys.h.
*/
#ifndef TSYS_DIST_H_INCLUDED
#define TSYS_DIST_H_INCLUDED
#define TSYS_DIST_VERSION_MAJOR 0
#define TSYS_DIST_VERSION_MINOR 3
#define TSYS_DIST_VERSION_PATCH 0

#include "tsys.h"

#ifdef __cplusplus
extern "C" {
#endif

// >>public ----------------------------------------------------------------------------------------

typedef enum tsys_dist_engine {
    TSYS_DIST_ENGINE_AUTO = 0,   // NCCL for a CUDA group when compiled in, else MPI, else a group of one
    TSYS_DIST_ENGINE_MPI,        // CPU tensors; CUDA tensors through host staging
    TSYS_DIST_ENGINE_NCCL,       // CUDA tensors
    TSYS_DIST_ENGINE_SELF,       // world size 1
    TSYS_DIST_ENGINE_TCP         // ranks not started by mpirun (tsys_dist_spawn, torchrun-style variables):
                                 // host tensors through shared memory on one host, TCP sockets across hosts
} tsys_dist_engine;

typedef enum tsys_dist_op { TSYS_DIST_SUM, TSYS_DIST_AVG, TSYS_DIST_MAX } tsys_dist_op;

// Group creation. All fields 0 = default:
//   engine     auto: NCCL for CUDA tensors when compiled in, cuda is set and there are several ranks;
//              MPI for host tensors under mpirun, tcp otherwise (see the engines at the top); a group
//              of one alone. CUDA tensors without NCCL travel through host staging
//   cuda       this rank computes on a GPU: tsys_dist_init calls tsys_cuda_init(ctx, local rank mod
//              the device count) unless the context already has a CUDA backend
//   timeout_s  TSYS_DIST_TIMEOUT from the environment, else 300
//   the tuning options below: each has an environment variable (the Options at the top of the file),
//              which overrides the field when it is set; tsys_dist_get_desc says what is in effect
// Collectives pick their path by the tensor's device: CUDA tensors go through NCCL when the group
// has a communicator, else through the host engine with host staging (2 ranks may share one GPU that
// way: engine mpi or tcp with cuda set gives no NCCL communicator).
typedef enum tsys_dist_check {
    TSYS_DIST_CHECK_AUTO = 0,    // debug builds: always; else MPI collectives from 64 KiB, NCCL ones from 64 MiB
    TSYS_DIST_CHECK_ALWAYS,      // every MPI/NCCL collective first checks that all ranks pass the same op, dtype and size
    TSYS_DIST_CHECK_NEVER        // (the shared-memory and tcp paths always check: it costs them nothing)
} tsys_dist_check;
typedef struct tsys_dist_desc {
    tsys_dist_engine engine;
    bool cuda;
    int timeout_s;
    bool no_shm;                 // TSYS_DIST_SHM=0: host tensors through MPI or TCP even on one host
    int64_t shm_slice;           // TSYS_DIST_SHM_SLICE: bytes per rank per pipeline slot of the shared segment,
                                 // in [4096, 2^30] (0: 8 MiB / ranks within [256 KiB, 4 MiB])
    bool no_bind;                // TSYS_DIST_BIND=0: tsys_dist_spawn_desc leaves its ranks unbound
    bool nccl_nonblocking;       // TSYS_DIST_NCCL_BLOCKING=0: a non-blocking NCCL communicator
    bool ce_allreduce;           // TSYS_DIST_CE=1: fp32 sums of CUDA tensors on the copy engines (one host)
    tsys_dist_check check;       // TSYS_DIST_CHECK (1: always, 0: never)
    // the TCP rendezvous (see ON THE RENDEZVOUS); NULL or "": none
    const char *run_id;          // TSYS_DIST_RUN_ID: the job's identity, at most 63 characters (none: TORCHELASTIC_RUN_ID)
    const char *secret;          // TSYS_DIST_SECRET: what every rank proves it knows, at most 256 bytes
    const char *listen_addr;     // TSYS_DIST_LISTEN_ADDR: where rank 0 listens (none: MASTER_ADDR's address)
} tsys_dist_desc;

typedef struct tsys_dist tsys_dist;             // a process group
typedef struct tsys_dist_work tsys_dist_work;   // an asynchronous collective in flight

// Built-in launcher. If this process is not a rank yet (no RANK in the environment, not under
// mpirun) and nproc > 1, starts nproc copies of argv[0] with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
// MASTER_PORT set, waits for them and returns true with *exit_code = the first non-zero child exit
// (or 0): the caller returns it. Otherwise returns false and the caller goes on as a rank.
// A child that fails makes the launcher stop the others (after the group timeout at most).
TSYSDEF bool tsys_dist_spawn(int nproc, int argc, char **argv, int *exit_code);
// The same with the launcher's options from a desc (timeout_s, no_bind; the environment still overrides
// them). The ranks make their own groups: of the desc only run_id and secret travel to them (as
// TSYS_DIST_RUN_ID and TSYS_DIST_SECRET; a random one each where none is given).
TSYSDEF bool tsys_dist_spawn_desc(int nproc, int argc, char **argv, const tsys_dist_desc *desc, int *exit_code);

TSYSDEF tsys_dist *tsys_dist_init(tsys_ctx *ctx, const tsys_dist_desc *desc);   // NULL + the context's error
TSYSDEF void tsys_dist_free(tsys_dist *d);
// The options in effect: the desc given to tsys_dist_init with the environment over it and the defaults
// filled in (engine: tsys_dist_engine_of; shm_slice: the slot size the group uses, or would use; check:
// ALWAYS in debug builds unless NEVER was asked for).
TSYSDEF tsys_dist_desc tsys_dist_get_desc(const tsys_dist *d);
// Device bytes this rank's group allocated itself, outside tsys's allocator (so outside tsys_mem_stats and the
// accounting's predictions): desc.ce_allreduce's scratch and flags; NCCL's own buffers are not known here.
TSYSDEF int64_t tsys_dist_device_bytes(const tsys_dist *d);
TSYSDEF int tsys_dist_rank(const tsys_dist *d);
TSYSDEF int tsys_dist_size(const tsys_dist *d);
TSYSDEF int tsys_dist_local_rank(const tsys_dist *d);
TSYSDEF int tsys_dist_local_size(const tsys_dist *d);   // the ranks on this host (they share its memory)
TSYSDEF tsys_dist_engine tsys_dist_engine_of(const tsys_dist *d);
TSYSDEF const char *tsys_dist_engine_name(tsys_dist_engine e);   // "mpi", "nccl", "self", "tcp"
TSYSDEF tsys_ctx *tsys_dist_ctx(const tsys_dist *d);

// Collectives on whole tsys tensors (contiguous, same shape and dtype on every rank; a mismatch is
// an error). In-place all-reduce and broadcast; reduce-scatter takes in = size x numel(out) elements,
// all-gather gives out = size x numel(in). GPU collectives run after the compute stream's work so far,
// on the side stream (TSYS_STREAM_SIDE); waiting makes the compute stream wait for them (no host sync,
// capturable in a CUDA graph). Blocking forms = async + wait, except that with no asynchronous one in
// flight a blocking one runs on the compute stream itself: either way it is ordered after the compute
// stream's work and before what follows it there; work of your own on the side stream is ordered
// against them through the compute stream (events), as against any compute-stream work.
TSYSDEF tsys_status tsys_dist_all_reduce(tsys_dist *d, tsys_tensor *t, tsys_dist_op op);
TSYSDEF tsys_status tsys_dist_broadcast(tsys_dist *d, tsys_tensor *t, int root);
TSYSDEF tsys_status tsys_dist_reduce_scatter(tsys_dist *d, tsys_tensor *out, tsys_tensor *in, tsys_dist_op op);
TSYSDEF tsys_status tsys_dist_all_gather(tsys_dist *d, tsys_tensor *out, tsys_tensor *in);
TSYSDEF tsys_status tsys_dist_barrier(tsys_dist *d);
// tsys_sync for a group's GPU: waits until the work issued so far on the compute and side streams, NCCL's
// included, is done, bounded by the group's timeout and watching NCCL's errors and the peers this rank can
// see, so that a peer that died mid-collective ends in an error naming it (where the host paths can tell)
// and an aborted communicator, never a hang. Call it where a training step would call tsys_sync.
TSYSDEF tsys_status tsys_dist_sync(tsys_dist *d);
TSYSDEF tsys_dist_work *tsys_dist_all_reduce_async(tsys_dist *d, tsys_tensor *t, tsys_dist_op op);   // NULL on error
TSYSDEF tsys_dist_work *tsys_dist_reduce_scatter_async(tsys_dist *d, tsys_tensor *out, tsys_tensor *in, tsys_dist_op op);
TSYSDEF tsys_dist_work *tsys_dist_all_gather_async(tsys_dist *d, tsys_tensor *out, tsys_tensor *in);
TSYSDEF tsys_dist_work *tsys_dist_broadcast_async(tsys_dist *d, tsys_tensor *t, int root);
// The asynchronous collectives issued between begin and end on CUDA tensors through NCCL form one NCCL
// group: they are launched together at end, so that, say, broadcasts from different roots use both
// directions of every link at once. Only asynchronous calls inside; wait for their handles after end.
// Elsewhere (host tensors, host staging) calls run as they are issued and a group changes nothing.
TSYSDEF tsys_status tsys_dist_group_begin(tsys_dist *d);
TSYSDEF tsys_status tsys_dist_group_end(tsys_dist *d);
// Host tensors: the asynchronous forms run on the group's worker thread, in issue order; leave the
// tensors alone until the wait. The wait blocks until a host collective is done (and copies a
// host-staged CUDA result back), or orders the compute stream after an NCCL one; it frees w.
TSYSDEF tsys_status tsys_dist_wait(tsys_dist_work *w);
// Host-side helpers for drivers and tests: the same over plain doubles (rank 0's view of min/max/mean).
TSYSDEF tsys_status tsys_dist_all_reduce_host(tsys_dist *d, double *v, int n, tsys_dist_op op);
// A tensor made for this group's collectives. On a GPU of a group of several NCCL ranks its memory is an
// NCCL symmetric window (ncclMemAlloc, then ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC; NCCL 2.27 or
// newer): NCCL can then run its low-latency kernels, which read and write the peers' buffers directly, for
// sum all-reduces, reduce-scatters and all-gathers of 32-bit floats and smaller (other ops and dtypes work as
// with any tensor). Anywhere else it is tsys_tensor_new's. Making and releasing the last reference are
// collective on such a group: every rank makes the same shapes in the same order and releases them in the
// same order, while the group lives (tsys_dist_free deregisters what is left; the memory itself goes with
// the last reference).
TSYSDEF tsys_tensor *tsys_dist_tensor_new(tsys_dist *d, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape);

// Sub-groups. Collective over d (after d's queued work): the ranks that pass the same color (>= 0) form
// a new group, ranked by key, ties broken by rank in d (MPI_Comm_split's rule). It travels the way d
// does: an MPI communicator split from d's (mpirun), or a TCP star of its own whose first rank admits
// only members (run id and secret derived from d's secret and a one-time token sent over d); shared
// memory among ranks of one host; its own NCCL communicator when d is a CUDA group. name (at most 31
// characters; NULL: "split") labels the group's errors. Every rank returns a group, or every rank NULL
// with the context's error (a negative color or a long name on any rank, or a group that could not
// form: the ranks agree on the outcome). The group is independent of d (its own collective sequence,
// worker and timeout); free it with tsys_dist_free before d.
TSYSDEF tsys_dist *tsys_dist_split(tsys_dist *d, int color, int key, const char *name);

// A device mesh (torch's init_device_mesh): the ranks of d as an ndim-dimensional array in row-major
// order (the last dimension varies fastest: rank = sum of coord[i] x stride[i]), with one sub-group per
// dimension holding the ranks that differ only in that coordinate, ranked by it. shape's product must be
// d's size; names are distinct, 1-31 characters of [A-Za-z0-9_]. Collective over d; every rank passes the
// same shape and names (checked). The mesh owns its groups; free it before d.
#define TSYS_DIST_MESH_MAX_DIMS 4
typedef struct tsys_dist_mesh tsys_dist_mesh;
TSYSDEF tsys_dist_mesh *tsys_dist_mesh_new(tsys_dist *d, int ndim, const int *shape, const char *const *names);   // NULL + the context's error
TSYSDEF tsys_dist *tsys_dist_mesh_group(const tsys_dist_mesh *m, const char *dim);   // NULL (and the context's error): no such dimension
TSYSDEF int tsys_dist_mesh_coord(const tsys_dist_mesh *m, const char *dim);          // this rank's coordinate; -1: no such dimension
TSYSDEF int tsys_dist_mesh_dim_size(const tsys_dist_mesh *m, const char *dim);       // -1: no such dimension
TSYSDEF int tsys_dist_mesh_ndim(const tsys_dist_mesh *m);
TSYSDEF void tsys_dist_mesh_free(tsys_dist_mesh *m);

// Tensor parallelism (Megatron-LM's split of the cs336 model over a group tp): this rank's share of every
// parameter of `full` (copied: free full afterwards if you like): q, k, v, w1, w3 and the LM head by rows
// (heads, d_ff and the vocabulary split over tp), the output projection and w2 by columns, the embedding by
// rows (vocabulary-parallel: each rank looks up the ids it holds, the ranks' rows summed); the norms whole.
// num_heads, d_ff and vocab_size must be multiples of tp's size. Every rank of tp passes the same batch: tsys_tp_model_loss runs the forward with one all-reduce per attention and per SwiGLU in
// forward and in backward, and a vocabulary-parallel cross-entropy (mean over tokens, the same on every
// rank) that never forms the full logits. Train with any optimizer over tsys_tp_model_params (the same step
// on every rank keeps the replicated parameters equal). tsys_tp_model_gather writes the full parameters
// back into a model of the same shape (collective over tp). Not yet: checkpointing policies.
typedef struct tsys_tp_model tsys_tp_model;
TSYSDEF tsys_tp_model *tsys_tp_model_new(tsys_dist *tp, tsys_model *full);      // NULL + the context's error
TSYSDEF tsys_tensor **tsys_tp_model_params(tsys_tp_model *m);                     // the full model's parameters() order
TSYSDEF int tsys_tp_model_num_tensors(const tsys_tp_model *m);
TSYSDEF tsys_tensor *tsys_tp_model_loss(tsys_tp_model *m, tsys_tensor *ids, tsys_tensor *targets);
// Sequence parallelism (Megatron-LM's, over the batch's tokens): between the tensor-parallel regions each rank
// keeps 1/tp of the tokens' rows, so the norms and residual adds run on and keep 1/tp of them; the rows are
// all-gathered entering a region and the partial sums reduce-scattered leaving it (the all-reduces' bytes in
// two halves). Every rank of tp sets the same; batch x sequence must then be a multiple of tp's size.
TSYSDEF tsys_status tsys_tp_model_set_sequence_parallel(tsys_tp_model *m, bool on);
TSYSDEF tsys_status tsys_tp_model_gather(tsys_tp_model *m, tsys_model *full);
// One step's collectives over tp alone, back to back (the embedding's all-reduce of a (batch, context, d_model)
// fp32 tensor, the 4 x num_layers + 1 of one in dtype, the compute dtype, and the cross-entropy's two; under
// sequence parallelism each of the first an all-gather and a reduce-scatter, and the norms' gains all-reduced):
// *ms, host clock, synchronized. Every rank of tp calls it, between steps.
TSYSDEF tsys_status tsys_tp_model_time_collectives(tsys_tp_model *m, int batch, int context, tsys_dtype dtype, double *ms);
TSYSDEF void tsys_tp_model_free(tsys_tp_model *m);

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
// comm_bf16 (torch's bf16_compress_hook): fp32 buckets travel as bf16, half the bytes. Each rank's
// gradients are rounded to bf16, NCCL (or the host path) averages them in bf16, and the average is
// widened back into the fp32 gradients: about 3 significant digits, where fp32 keeps 7. Costs a bf16 copy
// of the fp32 gradients (one arena). CUDA through NCCL: both casts run on the side stream, beside the
// collective, so backward does not wait for them. 16-bit gradients go as they are.
// shard_updates (ce_gather, tsys_ddp_attach_optimizer, tsys_ddp_optim_in_backward): each bucket has an owner
// (buckets dealt in backward's order to the rank with the fewest bytes so far); only the owner pulls its peers'
// gradients of it and updates it, inside backward, then pushes the new parameters into every peer's storage by the
// copy engines; the others skip it (tsys_optim_overlap_skip) and take the pushes at the step's end. The same bits as
// every rank updating every bucket; each rank's AdamW moves about 1/ranks of the bytes. The parameters must be one
// storage (a model's) with each bucket's back to back. A rank's AdamW moments of buckets it does not own are not
// kept current: tsys_ddp_sync_moments brings them from the owners (the trainer does before it saves).
// shard_masters (shard_updates, with kept copies: tsys_optim_keep_lowp before tsys_ddp_attach_optimizer): Megatron's
// distributed optimizer. The parameters read_by_copy names (the ones the step reads only through their kept copies: a
// model's matmul weights, tsys_model_matmul_weight) travel as those copies alone, 2 bytes a parameter instead of 4:
// their fp32 values stay current on the bucket's owner only, and are out of date on its peers (tsys_params_mark_stale:
// a read of them there fails, naming them) until tsys_ddp_sync_params brings them (the trainer does before it saves).
// The others travel as fp32 with their copies. The same bits as shard_updates, in the copies and, after a sync, in
// the weights.
// shard_state (shard_updates): tsys_ddp_attach_optimizer gives back the optimizer's moments of the buckets this rank
// does not own (tsys_optim_shard_state): ZeRO-1's memory at this step's speed (an AdamW made with desc.sharded_state
// never holds the whole moments: the trainer's is). Snapshots are then sharded
// (tsys_ddp_state_save: each rank writes its buckets' weights and moments) and tsys_ddp_sync_moments is refused.
// ce_gather (BUCKETED, CUDA gradients, NCCL ranks on one host): no all-reduce. Each bucket's gradients
// are copied whole into every peer by the copy engines as soon as backward finishes the bucket, so no kernel
// takes SMs from backward's GEMMs; the optimizer attached by tsys_ddp_attach_optimizer (or ZeRO-1's, by
// tsys_ddp_attach_zero1: each rank then receives its parameters' part only) then adds the ranks'
// gradients in rank order and divides by the ranks as it reads them: the same bits as the copy-engine
// all-reduce's average (desc.ce_allreduce). Each rank moves (ranks - 1) x the gradients' bytes and receives as
// much ((ranks - 1) slots of the gradients, in tsys_ddp_device_bytes): at 2 ranks the all-reduce's bytes, at
// more ranks more, so 2 ranks is where it pays. After tsys_ddp_finish, .grad still holds this rank's own
// gradients: what reads them before the optimizer (clipping, a loss scaler) sees the local ones, so those are
// not for this mode. Every parameter must be trainable, with gradients DDP made (one arena). This is the mode
// for gradients kept in bf16 / f16 (tsys_tensor_set_grad_dtype, tsys_model_set_grad_dtype): they travel in
// their dtype, half the bytes, and the optimizer widens them and sums in fp32, as torch's fp32 all-reduce of
// autocast's bf16-rounded gradients (under ZeRO-1 too, tsys_ddp_attach_zero1); without it DDP refuses them, but in
// a group of one (which averages nothing).
typedef struct tsys_ddp_desc {
    tsys_ddp_strategy strategy;
    double bucket_mb;            // BUCKETED: at most this many MB of parameters per bucket (0 = one bucket)
    bool comm_bf16;              // all-reduce fp32 gradients as bf16
    bool ce_gather;              // copy the gradients to every peer; the optimizer sums them (above)
    bool shard_updates;          // ce_gather with AdamW inside backward: each bucket updated by one rank (below)
    bool shard_masters;          // shard_updates: the fp32 weights read_by_copy names current on their owner alone (below)
    const bool *read_by_copy;    // shard_masters: [n params of tsys_ddp_new] those read only through their kept copies
    bool shard_state;            // shard_updates: the attached AdamW keeps its own buckets' moments alone (ZeRO-1; below)
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
    int64_t bytes_per_step;      // gradient bytes all-reduced per step (as they travel: bf16 under comm_bf16)
} tsys_ddp_stats;

typedef struct tsys_ddp tsys_ddp;
TSYSDEF tsys_ddp *tsys_ddp_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_ddp_desc *desc);
TSYSDEF tsys_status tsys_ddp_start_step(tsys_ddp *ddp);    // before forward (bucketed: resets the buckets)
TSYSDEF tsys_status tsys_ddp_finish(tsys_ddp *ddp);        // after backward, before the optimizer
TSYSDEF tsys_ddp_stats tsys_ddp_stats_get(const tsys_ddp *ddp);
// desc.ce_gather: opt (AdamW over the DDP's parameters, in the same order) sums the ranks' gradients from the
// DDP's receive buffer (tsys_optim_sum_grads), which this makes: every rank calls it, once, before the first step
// (or tsys_ddp_attach_zero1 instead). Free opt, or give its sums back (tsys_optim_sum_grads(opt, NULL, 0, 0, 0)),
// before tsys_ddp_free frees that buffer. Refused without ce_gather.
TSYSDEF tsys_status tsys_ddp_attach_optimizer(tsys_ddp *ddp, tsys_optim *opt);
// The optimizer inside backward under DDP: each bucket's parameters are handed to opt
// (tsys_optim_overlap_ready) as soon as their gradients are final on every rank: the bucket's all-reduce (NCCL,
// on the side stream) or, under desc.ce_gather, its peers' copies are in; opt's updates then run on the
// background stream beside the rest of backward. Every step must then run backward and tsys_ddp_finish between
// tsys_optim_overlap_begin_ex(opt, TSYS_OPTIM_CALLER_READY) and tsys_optim_overlap_end (instead of
// tsys_optim_step). Needs CUDA tensors on NCCL ranks (or a group of one), BUCKETED or OVERLAP, no bucket copied through scratch; opt
// holds every trainable parameter (under ce_gather: the attached optimizer). NULL turns it off.
TSYSDEF tsys_status tsys_ddp_optim_in_backward(tsys_ddp *ddp, tsys_optim *opt);
// Device memory the DDP holds outside the tensors' allocator: ce_gather's receive buffer and flags (else 0). The
// memory tracker counts the receive buffer (a tensor wraps it, "gradients", tag "ddp peers' gradients").
TSYSDEF int64_t tsys_ddp_device_bytes(const tsys_ddp *ddp);
// desc.shard_updates: opt's AdamW moments of every bucket broadcast from the bucket's owner (opt: the attached
// optimizer), so that any rank holds the whole state. Collective; nothing to do without shard_updates.
TSYSDEF tsys_status tsys_ddp_sync_moments(tsys_ddp *ddp, tsys_optim *opt);
// desc.shard_masters: every bucket's fp32 weights broadcast from its owner, so that every rank's are current.
// Collective; nothing to do without shard_masters.
TSYSDEF tsys_status tsys_ddp_sync_params(tsys_ddp *ddp);
// desc.shard_state: a sharded snapshot (tsys_zero1_state_save's format, layout "ddp") of the DDP's parameters and
// opt's moments, each rank writing its buckets' (whose weights are current there); a load takes a snapshot of any
// world size and layout holding the same tensors, every rank reading every weight and its buckets' moments. desc as
// tsys_zero1_state_save's; opt the attached optimizer. Every rank calls them.
TSYSDEF tsys_status tsys_ddp_state_save(tsys_ddp *ddp, tsys_optim *opt, const char *dir, const tsys_state_desc *desc);
TSYSDEF tsys_status tsys_ddp_state_load(tsys_ddp *ddp, tsys_optim *opt, const char *path, const tsys_state_desc *desc, tsys_state_info *info);
TSYSDEF const char *tsys_ddp_strategy_name(tsys_ddp_strategy s);
TSYSDEF void tsys_ddp_free(tsys_ddp *ddp);

// ZeRO-1: AdamW whose state is sharded by bytes over the ranks. Each rank updates the parameters it
// owns with the same math as tsys_adamw_new's, then the owners broadcast them: equal to unsharded
// AdamW bit for bit. Parameters without a gradient are left alone.
// Ownership: contiguous ranges of the trainable parameters in order, cut at r/N of their bytes (a
// parameter goes where its middle byte falls); a rank holds at most total/N + the largest parameter,
// and its parameters are one run of the arena. The step updates them in 4 chunks (cut the same way
// within each owner's run): chunk c's broadcasts, one group of every owner's chunk c, travel while
// chunk c + 1 is updated. The gradients must already be averaged (tsys_ddp_finish, or identical data
// on every rank); zero_grad covers every parameter.
typedef struct tsys_zero1 tsys_zero1;
TSYSDEF tsys_zero1 *tsys_zero1_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_optim_desc *desc);
TSYSDEF tsys_status tsys_zero1_step(tsys_zero1 *z);
TSYSDEF void tsys_zero1_zero_grad(tsys_zero1 *z);
TSYSDEF int64_t tsys_zero1_local_state_bytes(const tsys_zero1 *z);   // optimizer state this rank holds
TSYSDEF void tsys_zero1_free(tsys_zero1 *z);
// DDP's desc.ce_gather under ZeRO-1 (z over the DDP's parameters, in the same order): each rank receives only the
// peers' gradients of the parameters it owns, and z's AdamW sums them (the gradients are then not averaged in
// place: z alone reads them); the owners' new parameters then come back by the copy engines too, chunk by chunk,
// instead of NCCL's broadcasts. The parameters must lie in one storage (a model's). Free z before the DDP. Every
// rank calls it, once, before the first step.
TSYSDEF tsys_status tsys_ddp_attach_zero1(tsys_ddp *ddp, tsys_zero1 *z);

// FSDP (ZeRO-3, the S26 `fsdp` problem): Linear and Embedding weights (the 2-D parameters) are
// sharded over the ranks, flat per unit (a unit = the 2-D parameters of one "layers.N." block, or one
// 2-D parameter outside blocks: one all-gather and one reduce-scatter per unit); 1-D parameters (norm
// gains) stay replicated, their gradients all-reduced (AVG) as soon as they are ready. Construction
// broadcasts rank 0's weights, keeps this rank's 1/N of each unit (fp32: the master weights), frees the
// rest and the model's gradient arena. During forward and backward each unit is all-gathered (in
// compute_dtype, cast *before* the all-gather) just before its first op, into the storage its
// parameters view, and freed after its last op; the next unit's all-gather is issued when a unit
// starts (the report's rule: a unit is fetched only after the one two before it finished), on the
// communication path (NCCL: the side stream; host: the group's worker thread). Backward re-gathers
// every unit that has a linear (the embedding's backward needs no weight), and as soon as a unit's
// gradients are all ready, reduce-scatters them (AVG, in compute_dtype) and adds them into the fp32
// shard gradient. The last unit stays gathered from its forward into its backward. Without
// reshard_after_forward (the default in a group of one) every unit with a linear stays gathered from
// its forward into its backward: one all-gather per unit and step. A group of one calls no collective
// (the gather is a cast of the master into the weights, in fp32 the master itself; the reduce-scatter
// an fp32 sum into the shard gradient): per unit the work of the plain step under autocast (one cast
// in forward, one cast-or-add in backward), with the bits the collectives would give.
// Use: build the optimizer over tsys_fsdp_params (the shards, then the replicated parameters); per
// step: zero grads, forward, loss, backward, tsys_fsdp_finish, optimizer step.
// The model must use each sharded parameter in one linear or embedding op per forward (tied weights
// are refused), units in parameter order (the cs336 model, the S26 ToyFSDPModel). FSDP follows the
// forward and backward through the trace hooks, which tell it the weight of every linear/embedding
// (tsys_trace_weight): ops on other weights, another model in the same context, are ignored. It chains
// the hooks installed before it; remove a profiler installed after it before freeing it.
// compute_dtype bf16/fp16: the parameters take that dtype while FSDP holds them, so the forward runs in
// it (norms compute in fp32 and return the input's dtype), gradients come out in it; the fp32
// masters, shard gradients and optimizer state stay fp32 (the S26 fp16 semantics). Do not add
// autocast on top. tsys_fsdp_free restores the whole fp32 parameters (one all-gather).
// Reshard after forward (PyTorch FSDP2's reshard_after_forward): free a unit's gathered weights after
// its forward and gather it again for its backward (memory: about two units gathered at a time), or
// keep them from the forward through the backward (one all-gather per unit and step, every unit
// gathered at the end of the forward: the memory of autocast's weight copies in the plain step).
// A unit whose backward needs no weight (the embedding) is freed after its forward either way.
typedef enum tsys_fsdp_reshard {
    TSYS_FSDP_RESHARD_AUTO = 0,  // yes when world > 1, no in a group of one (nothing to save there)
    TSYS_FSDP_RESHARD_YES,
    TSYS_FSDP_RESHARD_NO
} tsys_fsdp_reshard;
// 0 = default for every field:
//   compute_dtype          TSYS_F32
//   no_prefetch            false: the next unit's gather is issued when a unit starts
//   reshard_after_forward  TSYS_FSDP_RESHARD_AUTO
//   no_shortcut            false: in a group of one, gather = the master shard cast into the unit's
//                          weights (fp32: the weights are views of the master), reduce-scatter = the
//                          full gradients added into the fp32 shard gradient (one kernel each, no
//                          collective); the same bits as the collectives
//   ce_transfers           false: NCCL's all-gathers and reduce-scatters. true (CUDA, NCCL ranks on one
//                          host, 2 to 8 of them, RESHARD_NO, AdamW inside backward): no collective for the
//                          units. Each unit's gathered weights and full gradients are made once and opened
//                          by every peer; when a unit's backward is over, each rank's copy engines pull its
//                          part of the peers' full gradients, AdamW adds them to its own part as it reads
//                          the shard's gradient (rank order, in fp32: in fp32 at 2 ranks the bits of NCCL's
//                          average), and the cast of the updated shard is pushed into every peer's weights;
//                          the step's end waits for the pushes. The replicated parameters' gradients are
//                          pulled whole beside the next unit's and summed the same way: no NCCL call is left
//                          in a step, and no SM is taken from backward's kernels. AdamW writes each shard's
//                          copy in the compute dtype into the rank's part of the unit's weights
//                          (tsys_optim_keep_lowp_into): the update itself makes what is pushed.
//                          Memory: the full gradients stay (compute dtype, every unit), beside a receive
//                          buffer of (world - 1) shards. The first forward gathers through NCCL.
typedef struct tsys_fsdp_desc {
    tsys_dtype compute_dtype;    // TSYS_F32 (0, default), TSYS_BF16 or TSYS_F16
    bool no_prefetch;            // gather each unit only when it is needed (for measurements)
    tsys_fsdp_reshard reshard_after_forward;
    bool no_shortcut;            // a group of one goes through the collectives too (tests, measurements)
    bool ce_transfers;           // the units' transfers on the copy engines (above)
} tsys_fsdp_desc;

// Per step (the last tsys_fsdp_finish), for this rank:
typedef struct tsys_fsdp_stats {
    int num_units;
    int64_t sharded_numel, replicated_numel;   // elements of the model, sharded (unpadded) and replicated
    int64_t local_numel;                       // fp32 elements this rank keeps (shards with padding + replicated)
    int all_gathers, reduce_scatters, all_reduces;   // a group of one (no collectives): the units made
                                                     // available, summed, and the replicated gradients
    int64_t gathered_bytes, reduced_bytes;     // bytes per step of the all-gather outputs and reduce-scatter inputs
    int max_units_gathered;                    // most units whose full weights were alive at once
    double wait_ms;                            // host time spent waiting for collectives (host engines;
                                               // on NCCL the compute stream waits instead and this is ~0)
} tsys_fsdp_stats;

typedef struct tsys_fsdp tsys_fsdp;
TSYSDEF tsys_fsdp *tsys_fsdp_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_fsdp_desc *desc);
TSYSDEF tsys_tensor **tsys_fsdp_params(tsys_fsdp *f);     // what the optimizer updates: unit shards (1-D fp32), then replicated
TSYSDEF int tsys_fsdp_num_params(const tsys_fsdp *f);
TSYSDEF bool tsys_fsdp_param_is_shard(const tsys_fsdp *f, int i);
TSYSDEF tsys_status tsys_fsdp_finish(tsys_fsdp *f);       // after backward (finish_gradient_synchronization)
// AdamW inside backward (opt over tsys_fsdp_params(f), in that order; NULL turns it off): each unit's shard is
// updated on the background stream as soon as its reduce-scatter is summed into the shard gradient, beside the
// rest of backward (the unit's backward is over by then: its gathered weights are not read again). While opt is
// attached, every step wraps its one backward and tsys_fsdp_finish in tsys_optim_overlap_begin_ex(opt,
// TSYS_OPTIM_CALLER_READY) ... tsys_optim_overlap_end, which updates the replicated parameters. The same bits as
// tsys_optim_step after tsys_fsdp_finish.
TSYSDEF tsys_status tsys_fsdp_optim_in_backward(tsys_fsdp *f, tsys_optim *opt);
// Full fp32 weights (every parameter, by its name: the unprefixed names of the model) as new tensors
// the caller releases (then TSYS_FREE(*out)); every rank gets them (all ranks must call it).
TSYSDEF tsys_status tsys_fsdp_gather_full_params(tsys_fsdp *f, tsys_tensor ***out, int *n);
TSYSDEF tsys_fsdp_stats tsys_fsdp_stats_get(const tsys_fsdp *f);
// One step's collectives alone, back to back with nothing to overlap (forward and backward all-gathers,
// reduce-scatters into scratch, the replicated all-reduces on copies): *ms, host clock, synchronized.
// Leaves the parameters and gradients as they were. Every rank calls it (between steps).
TSYSDEF tsys_status tsys_fsdp_time_collectives(tsys_fsdp *f, double *ms);
TSYSDEF void tsys_fsdp_free(tsys_fsdp *f);

// Sharded snapshots (tsys.h's tsys_state_*; docs/design/state.md): every rank writes its part of the state
// in parallel, rank-%05d.safetensors in the snapshot's temporary (a directory every rank sees), rank 0 the
// MANIFEST (the world size, the layout) once all parts are written, and renames it into place; each step's
// status is agreed by all ranks, so that all return the error when any fails. desc as tsys_state_save's:
// model (its dims, for the consolidated model.safetensors; its parameters are the wrapper's), step, name,
// keep_last, user, scaler, no_rng (each rank saves its own RNG; a load on the same world size restores each
// rank's, on another world size rank 0's). desc.tensors is not supported (NULL).
//   ZeRO-1: rank 0 saves the (replicated) parameters, each rank the AdamW moments of those it owns.
//   FSDP: desc.optim is the AdamW over tsys_fsdp_params; each rank saves its shard's part of every
//   parameter and moment (not the padding), rank 0 the replicated and frozen parameters.
// A load takes a snapshot of any world size and layout (ZeRO-1's, FSDP's, a plain one of tsys_state_save)
// holding the same tensors, every rank reading only the ranges it needs; strict as tsys_state_load, and
// nothing is written unless every rank's checks passed. tsys_state_consolidate makes a plain snapshot.
TSYSDEF tsys_status tsys_zero1_state_save(tsys_zero1 *z, const char *dir, const tsys_state_desc *desc);
TSYSDEF tsys_status tsys_zero1_state_load(tsys_zero1 *z, const char *path, const tsys_state_desc *desc, tsys_state_info *info);
TSYSDEF tsys_status tsys_fsdp_state_save(tsys_fsdp *f, const char *dir, const tsys_state_desc *desc);
TSYSDEF tsys_status tsys_fsdp_state_load(tsys_fsdp *f, const char *path, const tsys_state_desc *desc, tsys_state_info *info);

// Accounting: predicted bytes per rank and bytes sent per rank per step, for a model trained with
// batch x context tokens per rank, world ranks, a dtype (autocast) and a strategy. DDP and ZeRO-1
// as tsys implements them (ZeRO-1 = DDP's all-reduce + ZeRO-1's broadcasts); ZeRO-2/3 on paper.
// The formulas are in the >>accounting section; act_bytes is what the forward keeps for backward
// plus the logits' gradient (the peak of a step).
typedef enum tsys_dist_scheme { TSYS_SCHEME_DDP, TSYS_SCHEME_ZERO1, TSYS_SCHEME_ZERO2, TSYS_SCHEME_ZERO3 } tsys_dist_scheme;
typedef struct tsys_dist_account {
    double param_bytes, grad_bytes, optim_bytes, act_bytes, total_bytes;   // per rank, at the peak of a step
    double sent_bytes;                                                    // per rank per step (ring algorithms)
    double work_bytes;                                                    // tsys_fsdp_accounting: of param + grad bytes, the
                                                                          // gathered units and full gradients alive at the peak
} tsys_dist_account;
TSYSDEF tsys_dist_account tsys_dist_accounting(const tsys_model_desc *m, tsys_dtype dtype, int batch, int context, int world, tsys_dist_scheme scheme);
// The same with the step's options as the checkpoint planner's flags: TSYS_PLAN_LOWP_GRADS (under autocast the
// linear weights' gradients in its dtype: fewer gradient bytes, kept and sent); TSYS_PLAN_KEPT_COPIES changes no
// byte (the copies are the casts', kept across steps). Other flags are refused: zeros.
TSYSDEF tsys_dist_account tsys_dist_accounting_ex(const tsys_model_desc *m, tsys_dtype dtype, int batch, int context, int world, tsys_dist_scheme scheme, unsigned plan_flags);
TSYSDEF const char *tsys_dist_scheme_name(tsys_dist_scheme s);
// ZeRO-3 as tsys_fsdp implements it (the >>accounting section has the formulas): per-unit padded shards,
// replicated norms, the gathered working set, weights and gradients communicated in compute_dtype.
TSYSDEF tsys_dist_account tsys_fsdp_accounting(const tsys_model_desc *m, tsys_dtype compute_dtype, int batch, int context, int world);
// The same for a desc's settings (compute_dtype, reshard_after_forward, no_shortcut); the one above
// takes the defaults.
TSYSDEF tsys_dist_account tsys_fsdp_accounting_desc(const tsys_model_desc *m, const tsys_fsdp_desc *desc, int batch, int context, int world);
// auto:BYTES for a data-parallel rank: of the policies of tsys_checkpoint_policy_each, the best by
// tsys_checkpoint_candidate_better on the peak a rank is predicted to reach (the accounting's total_bytes:
// fsdp's with fd given, else scheme's under autocast dtype) against budget bytes.
// Its name goes to policy and its peak to *peak. TSYS_ERR_OOM when none fits (policy: the least peak).
TSYSDEF tsys_status tsys_dist_checkpoint_auto(const tsys_model_desc *m, const tsys_fsdp_desc *fd, tsys_dist_scheme scheme, tsys_dtype dtype, int batch,
                                              int context, int world, double budget, char *policy, size_t len, double *peak);

// The link as an alpha-beta model (>>link model), to predict the time of collectives from the bytes the
// accounting says they send: alpha_ms the fixed cost of one collective, beta the bytes a rank sends per ms.
typedef struct tsys_dist_link_model { double alpha_ms, beta_bytes_per_ms; } tsys_dist_link_model;
// Measures the group's link with all-reduces of dev tensors issued back to back with one wait at the end,
// as DDP issues its buckets: 20 of 64 KiB, 4 of 64 MiB (8 MiB on host ranks), each the slowest rank's
// median of 7 rounds after 2 warm-ups. Every rank calls it and gets the same model; zeros (no prediction) in a group of one or
// when a probe fails (out of memory: the context's error is cleared).
TSYSDEF tsys_dist_link_model tsys_dist_calibrate_link(tsys_dist *d, tsys_device dev);
// The same for one kind of collective, beta the bytes a rank sends: (world - 1) / world of an all-gather's output or
// a reduce-scatter's input (of the same 64 KiB and 64 MiB), 2 (world - 1) / world of an all-reduce's. On 2 H200s
// NCCL's all-gathers and reduce-scatters of 100 MB send at ~200 GB/s where its all-reduce sends at ~260.
typedef enum tsys_dist_collective { TSYS_DIST_ALL_REDUCE, TSYS_DIST_ALL_GATHER, TSYS_DIST_REDUCE_SCATTER } tsys_dist_collective;
TSYSDEF tsys_dist_link_model tsys_dist_calibrate_link_of(tsys_dist *d, tsys_device dev, tsys_dist_collective kind);
// n collectives issued back to back that send sent_bytes a rank: max(n alpha, sent / beta); NAN for the
// zero model.
TSYSDEF double tsys_dist_link_time_ms(tsys_dist_link_model m, int n, double sent_bytes);
// The bytes a rank sends in a ring all-reduce of `bytes` among world ranks: 2(world-1)/world bytes.
TSYSDEF double tsys_dist_ring_sent(int world, double bytes);
// FSDP's collectives of a step (s: tsys_fsdp_stats_get's), one after another as its streams issue them, each kind
// on its own link (tsys_dist_calibrate_link_of): n alpha + sent / beta, a rank sending (world - 1) / world of each
// all-gather's output and reduce-scatter's input and 2 (world - 1) / world of the replicated parameters' fp32
// gradients. NAN where a link is the zero model.
typedef struct tsys_fsdp_links { tsys_dist_link_model all_gather, reduce_scatter, all_reduce; } tsys_fsdp_links;
TSYSDEF double tsys_fsdp_link_time_ms(const tsys_fsdp_stats *s, int world, tsys_fsdp_links m);
// The copy engines' pulls (DDP's desc.ce_gather) as two links, beta the bytes a rank receives per ms: `all`, every
// rank pulling from every peer at once (DDP's buckets: each GPU's links carry its pulls and its peers' at once),
// and `one`, one rank pulling while its peers only serve (a ZeRO-1 bucket inside one owner's part).
typedef struct tsys_dist_pull_links { tsys_dist_link_model all, one; } tsys_dist_pull_links;
// A step's pulls, bucket after bucket (a bucket's pulls join its stream before the next bucket's flags go): bucket k,
// bytes [off[k], off[k] + bytes[k]) of the gradients, costs alpha + the most any rank r receives of it ((world - 1)
// x its bytes inside r's part [lo[r], hi[r])) / beta, on `one` when a single rank receives, else on `all`. NAN for
// a zero link.
TSYSDEF double tsys_dist_pull_time_ms(tsys_dist_pull_links m, int world, int n, const int64_t *off, const int64_t *bytes, const int64_t *lo, const int64_t *hi);
// DDP's desc.ce_gather with an optimizer attached: the pulls' links (tsys_dist_pull_links), measured between steps on this
// DDP's own buffers (the receive buffer is overwritten, the gradients only read). Collective. Zeros (no prediction)
// without ce_gather, for parts too small to measure, or when a probe fails (the context's error says why).
TSYSDEF tsys_dist_pull_links tsys_ddp_calibrate_pulls(tsys_ddp *ddp);
// The pulls of one of its steps on m: tsys_dist_pull_time_ms over its buckets and every rank's part. NAN without
// ce_gather and an attached optimizer.
TSYSDEF double tsys_ddp_pull_time_ms(const tsys_ddp *ddp, tsys_dist_pull_links m);

// The CS336 S26 section 8 cost model of one training step of a cs336 model under a parallel layout, per rank:
// the matmul FLOPs of its share (tsys_model_flops: batch is per dp replica, tp ranks split every matmul) at C
// FLOP/s, and the bytes it sends in ring collectives at W bytes/s of egress (an all-gather or reduce-scatter of
// S bytes sends (N-1)/N S, an all-reduce 2(N-1)/N S), each element as tsys sends it for the compute dtype:
// DDP's gradients in fp32, FSDP's weights and gradients and TP's activations in dtype.
//   DP       the gradients all-reduced over dp
//   FSDP     the weights all-gathered in forward and again in backward, the gradients reduce-scattered, over dp
//   TP       per block two all-reduces of the (batch, context, d_model) activations in forward and two in
//            backward, and one for the LM head's input in backward, over tp (tsys_tp_model)
//   DP_TP, FSDP_TP  the parameters a tp rank holds go over dp as in DP / FSDP, beside TP's traffic over tp
// weight_bytes: the fp32 weights, gradients and AdamW moments a rank holds (16 bytes a parameter; FSDP shards
// them over dp; tsys_tp_model keeps the norms whole).
// act_bytes, peak_bytes: the activations a rank keeps for backward and its predicted peak memory, as tsys
// implements the layout: DP and FSDP by the accounting (tsys_dist_accounting, tsys_fsdp_accounting); with tp,
// tsys_tp_model's activations (heads, d_ff and the vocabulary split over tp; the normed inputs whole, cast
// once under autocast; the logits' fp32 gradient) beside the weights above, the autocast copies of the matmul
// weights a rank holds, and under FSDP x TP the gathered unit and the embedding's gradient.
typedef enum tsys_dist_layout { TSYS_LAYOUT_DP, TSYS_LAYOUT_FSDP, TSYS_LAYOUT_TP, TSYS_LAYOUT_DP_TP, TSYS_LAYOUT_FSDP_TP, TSYS_LAYOUT_COUNT } tsys_dist_layout;
typedef struct tsys_dist_plan {
    double flops, compute_ms;              // per rank per step
    double dp_sent_bytes, tp_sent_bytes;   // per rank per step, over each group
    double dp_comm_ms, tp_comm_ms, comm_ms;
    double weight_bytes, act_bytes, peak_bytes;
} tsys_dist_plan;
TSYSDEF tsys_dist_plan tsys_dist_plan_step(const tsys_model_desc *m, tsys_dist_layout layout, int dp, int tp, int batch, int context, tsys_dtype dtype,
                                           double flops_per_s, double bytes_per_s);
// The same with each group's link as an alpha-beta model (tsys_dist_calibrate_link on the dp and the tp group): the
// layout's collectives on each, DDP's in 100 MiB buckets; FSDP's a unit's all-gather in forward and again in
// backward, its reduce-scatter, and the norm gains' all-reduces; TP's 4 x num_layers + 4; each paying its alpha
// and its bytes, n alpha + sent / beta: these collectives are megabytes each and wait for one another on the
// stream (on 4 H100s the max form of tsys_dist_link_time_ms left tp over pairs 16-18% short, this form within 4%).
TSYSDEF tsys_dist_plan tsys_dist_plan_step_links(const tsys_model_desc *m, tsys_dist_layout layout, int dp, int tp, int batch, int context, tsys_dtype dtype,
                                                 double flops_per_s, tsys_dist_link_model dp_link, tsys_dist_link_model tp_link);
// The same from one description, with what the two above cannot say: sequence_parallel (the tp layouts under
// tsys_tp_model_set_sequence_parallel: the norms' activations / tp; each all-reduce an all-gather and a
// reduce-scatter, and the norms' gains all-reduced).
typedef struct tsys_dist_plan_in {
    const tsys_model_desc *model;
    tsys_dist_layout layout;
    int dp, tp, batch, context;   // batch: sequences a dp replica
    tsys_dtype dtype;
    double flops_per_s;
    tsys_dist_link_model dp_link, tp_link;
    // each group's all-gathers and reduce-scatters on links of their own where given (beta > 0:
    // tsys_dist_calibrate_link_of), else on the group's link: FSDP's units over dp, sequence parallelism's over tp
    tsys_dist_link_model dp_gather, dp_scatter, tp_gather, tp_scatter;
    bool sequence_parallel;
} tsys_dist_plan_in;
TSYSDEF tsys_dist_plan tsys_dist_plan_of(const tsys_dist_plan_in *in);
TSYSDEF const char *tsys_dist_layout_name(tsys_dist_layout l);   // "dp", "fsdp", "tp", "dp_tp", "fsdp_tp"

// A tsys_model trained data-parallel with AdamW, one step at a time in timed phases (>>trainer): DDP (any
// tsys_ddp strategy), ZeRO-1 (DDP's all-reduce + tsys_zero1's sharded AdamW), FSDP (tsys_fsdp, AdamW over
// its shards), or ALONE: no group, no communication (the reference the others are compared with).
typedef enum tsys_dist_train_mode { TSYS_TRAIN_DDP, TSYS_TRAIN_ZERO1, TSYS_TRAIN_FSDP, TSYS_TRAIN_ALONE } tsys_dist_train_mode;
typedef struct tsys_dist_trainer_desc {
    tsys_dist_train_mode mode;
    tsys_ddp_desc ddp;     // DDP, ZERO1: how the gradients are all-reduced
    tsys_fsdp_desc fsdp;   // FSDP (it computes in fsdp.compute_dtype)
    tsys_dtype autocast;   // DDP, ZERO1, ALONE: the forward's autocast dtype (TSYS_F32: none)
    float loss_scale;      // backward starts from cross-entropy's mean times this (0 or 1: the mean)
    bool lowp_copies;      // DDP, ALONE under autocast (not ZERO1): AdamW keeps the weights' autocast-dtype copies, which
                           //   forward reads instead of casting (tsys_optim_keep_lowp)
    bool lowp_grads;       // DDP and ZERO1 with ddp.ce_gather (or one rank), ALONE, under autocast: the linear weights' gradients in
                           //   the autocast dtype (tsys_model_set_grad_dtype; the model holds no gradient yet)
    bool opt_in_backward;  // DDP (as tsys_ddp_optim_in_backward needs: NCCL, bucketed), FSDP, ALONE: AdamW inside
                           //   backward, each bucket's (FSDP: unit shard's, ALONE: layer's) update on the background
                           //   stream once its gradients are in (tsys_optim_overlap_begin_ex, tsys_fsdp_optim_in_backward);
                           //   the same bits as after backward
    const char *save_dir;  // with save_every > 0: a snapshot of the state (tsys_dist_trainer_state_save) into
    int save_every;        //   save_dir after every save_every-th step, named "step-%06lld" by the step count
    int keep_last;         //   (tsys_dist_trainer_resume sets it); keep_last as tsys_state_desc's
} tsys_dist_trainer_desc;
typedef struct tsys_dist_step_times {
    double forward_ms, backward_ms, optim_ms, step_ms;   // host clock, every phase synchronized with the group;
                                                         // backward_ms includes the gradients' synchronization
    double exposed_ms;                                   // DDP, ZERO1: tsys_ddp_stats.exposed_ms of the step
    double peak_pre_optim, peak_post_optim;              // the device's peak bytes before / after the optimizer
    double save_ms;                                      // the snapshot after the step (desc.save_every; 0: none), not in step_ms
} tsys_dist_step_times;
typedef struct tsys_dist_trainer tsys_dist_trainer;
// NULL + the context's error. The model (on dev) stays the caller's; d may be NULL for ALONE. Every rank
// calls it (DDP's broadcast of the weights, FSDP's sharding).
TSYSDEF tsys_dist_trainer *tsys_dist_trainer_new(tsys_ctx *ctx, tsys_dist *d, tsys_model *model, tsys_device dev, const tsys_dist_trainer_desc *desc);
// One step on this rank's batch: zero the gradients, forward (autocast), cross-entropy, backward with the
// gradients' synchronization, the optimizer step; times (optional) filled. The context's status. Refused
// while a step is captured (tsys_dist_trainer_capture).
TSYSDEF tsys_status tsys_dist_trainer_step(tsys_dist_trainer *t, tsys_tensor *ids, tsys_tensor *targets, tsys_dist_step_times *times);
// The whole step (tsys_dist_trainer_step's work, without its host clocks and syncs) captured as one CUDA
// graph on the trainer's device, run by tsys_dist_trainer_replay. Every rank calls it after at least one
// eager step (NCCL connects and FSDP makes its buffers in the first); the status is the same on every rank.
// Refused (TSYS_ERR_UNSUPPORTED, the reason in the context's error) on the CPU device, on a group whose
// CUDA collectives are staged through host memory (no NCCL), before an eager step, and when a step is
// already captured. The graph reads its batch from these ids and targets (CUDA tensors): copy each new
// batch into them before a replay (tsys_tensor_copy_from), and keep them alive until uncapture. While a
// step is captured the trainer steps by replay only: tsys_dist_trainer_step and _time_collectives are
// refused until tsys_dist_trainer_uncapture (the graph holds buffers they would move). Uncapture before a
// state load or resume too, then an eager step and a new capture (the graph baked in the step it recorded).
TSYSDEF tsys_status tsys_dist_trainer_capture(tsys_dist_trainer *t, tsys_tensor *ids, tsys_tensor *targets);
// One step: the captured graph replayed, then a bounded synchronization with the group (a peer that died
// is an error within the group's timeout, after the replay), the step counted and desc's snapshot taken.
// times (optional): step_ms from device events around the replay; the per-phase times, exposed_ms and the
// peaks, which only the host sees during an eager step, are NAN. Every rank calls it.
TSYSDEF tsys_status tsys_dist_trainer_replay(tsys_dist_trainer *t, tsys_dist_step_times *times);
TSYSDEF void tsys_dist_trainer_uncapture(tsys_dist_trainer *t);   // frees the graph (none: nothing); eager steps again
TSYSDEF bool tsys_dist_trainer_captured(const tsys_dist_trainer *t);
// A step's collectives alone, back to back with nothing to overlap (DDP, ZERO1: every bucket's
// all-reduce; FSDP: tsys_fsdp_time_collectives): *ms. Every rank calls it, between steps (not while a
// step is captured).
TSYSDEF tsys_status tsys_dist_trainer_time_collectives(tsys_dist_trainer *t, double *ms);
TSYSDEF tsys_ddp *tsys_dist_trainer_ddp(const tsys_dist_trainer *t);     // NULL unless DDP or ZERO1
// The trainer's state (its model, AdamW, and what desc adds: step, name, keep_last, user, no_rng; desc's
// model and optim are the trainer's): DDP and ALONE a plain snapshot written by rank 0 (every rank loads
// it), ZeRO-1 and FSDP a sharded one (tsys_zero1_state_save, tsys_fsdp_state_save). Every rank calls them;
// the status is the same on every rank. ZeRO-1 and FSDP load any snapshot of any world size (sharded or
// plain), DDP and ALONE a plain one (tsys_state_consolidate makes one of a sharded snapshot).
TSYSDEF tsys_status tsys_dist_trainer_state_save(tsys_dist_trainer *t, const char *dir, const tsys_state_desc *desc);
TSYSDEF tsys_status tsys_dist_trainer_state_load(tsys_dist_trainer *t, const char *path, const tsys_state_desc *desc, tsys_state_info *info);
// Resumes from path: a snapshot, or a directory of them (its newest: tsys_state_latest; rank 0's view decides).
// The trainer's step count becomes the snapshot's step (*step, may be NULL). Every rank calls it.
TSYSDEF tsys_status tsys_dist_trainer_resume(tsys_dist_trainer *t, const char *path, int64_t *step);
TSYSDEF int64_t tsys_dist_trainer_steps(const tsys_dist_trainer *t);   // steps taken (from the resumed step on)
TSYSDEF tsys_fsdp *tsys_dist_trainer_fsdp(const tsys_dist_trainer *t);   // NULL unless FSDP
TSYSDEF void tsys_dist_trainer_free(tsys_dist_trainer *t);
// Every rank calls it at the same point: true on every rank when st is not TSYS_OK on any (or the group
// fails), so that all stop together and none is left waiting in a collective.
TSYSDEF bool tsys_dist_any_failed(tsys_dist *d, tsys_status st);
// Ranks on one host share its cores: unless OMP_NUM_THREADS is set, each of `ranks` gets cores / ranks
// threads (OpenMP and OpenBLAS, and OMP_NUM_THREADS for the ranks a launcher starts after the call).
// tsys_dist_init calls it with the ranks on this host (torchrun sets OMP_NUM_THREADS likewise): 4 ranks of
// 64 threads each on a 64-core host spin in OpenMP's barriers for minutes where 16 each take seconds.
TSYSDEF void tsys_dist_share_cores(int ranks);

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
// The implementation uses POSIX sockets, shared memory (shm_open) and threads. On glibc their
// declarations need _GNU_SOURCE (or _POSIX_C_SOURCE >= 200809L) defined before the first system
// header: compile C with -D_GNU_SOURCE (C++ compilers define it already).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <errno.h>
#include <math.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <pthread.h>
#include <poll.h>
#include <netdb.h>
#include <sys/types.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <assert.h>
// tsys.h's assert override, also when its implementation is compiled elsewhere (TSYS_LINKED_IMPL)
#ifndef TSYS_ASSERT
#define TSYS_ASSERT(c) assert(c)
#endif
#ifdef __linux__
#include <sys/prctl.h>
#endif
// tsys_dist_share_cores sets OpenMP's thread count; tsys.h includes omp.h only in its implementation,
// which may be compiled elsewhere (TSYS_LINKED_IMPL)
#if defined(_OPENMP) && !defined(TSYS_NO_OPENMP)
#include <omp.h>
#endif
#if defined(__GLIBC__) && !defined(__USE_XOPEN2K8)
#error "tsys_dist.h: the implementation needs POSIX 2008 declarations: compile with -D_GNU_SOURCE"
#endif

#ifdef TSYS_DIST_MPI
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif
#ifdef TSYS_DIST_NCCL
#ifndef TSYS_CUDA_H_INCLUDED
#error "tsys_dist.h: TSYS_DIST_NCCL needs tsys_cuda.cuh included before tsys_dist.h"
#endif
#include <cuda.h>   // cuPointerGetAttribute's types (the function is fetched at run time: no link against libcuda)
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "tsys_dist.h: NCCL 2.14 or newer is needed (ncclAvg, ncclCommInitRankConfig, non-blocking communicators)"
#endif
#endif

#if !defined(TSYS_MALLOC)
#define TSYS_MALLOC(sz) malloc(sz)
#define TSYS_REALLOC(p, sz) realloc(p, sz)
#define TSYS_FREE(p) free(p)
#endif
#ifndef TSYS_DEBUG
#ifdef NDEBUG
#define TSYS_DEBUG 0
#else
#define TSYS_DEBUG 1
#endif
#endif

// Options: see the top of the file and >>options (tsys_dist__options).
#ifndef TSYS_DIST_TIMEOUT_DEFAULT
#define TSYS_DIST_TIMEOUT_DEFAULT 300
#endif
#define TSYS_DIST__SLICE_TOTAL ((size_t)8 << 20)   // slot bytes over all ranks (the segment has two slots)
#define TSYS_DIST__CHECK_BYTES ((int64_t)64 << 10)
// NCCL collectives are checked from 64 MiB: the check's host round trip (~4 us between two GPUs of one host)
// was 13% of a 1 MB all-reduce's 30 us, and is under 2% of a collective this size
#define TSYS_DIST__NCCL_CHECK_BYTES ((int64_t)64 << 20)
#define TSYS_DIST__TCP_CHUNK ((size_t)1 << 20)
#define TSYS_DIST__RUN_ID_MAX 64       // the run id's bytes, its terminating zero included
#define TSYS_DIST__SECRET_MAX 256
#define TSYS_DIST__ADDR_MAX 256
#define TSYS_DIST__MAGIC 0x74737964u   // "tsyd"
#define TSYS_DIST__DEAD_CHECK_US 50e3  // how often a long wait checks that the ranks it waits for are alive

#define TSYS_DIST__LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define TSYS_DIST__STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#if defined(__x86_64__) || defined(__i386__)
#define TSYS_DIST__RELAX() __asm__ __volatile__("pause" ::: "memory")
#elif defined(__aarch64__)
#define TSYS_DIST__RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define TSYS_DIST__RELAX() __asm__ __volatile__("" ::: "memory")
#endif

// Element types of host collectives: the five tsys dtypes, plus doubles (all_reduce_host) and bytes
// (ids and names during setup).
enum { TSYS_DIST__F64 = TSYS_DTYPE_COUNT, TSYS_DIST__U8 };
enum { TSYS_DIST__ALLREDUCE, TSYS_DIST__BCAST, TSYS_DIST__RS, TSYS_DIST__AG, TSYS_DIST__BARRIER };
static const char *const tsys_dist__kind_names[] = { "all_reduce", "broadcast", "reduce_scatter", "all_gather", "barrier" };

// One collective, as every engine sees it (host memory, or device memory for nccl).
typedef struct tsys_dist__coll {
    int kind, type, op, root;
    int64_t count;      // all_reduce, broadcast: elements; reduce_scatter: elements of out (in holds size x);
                        // all_gather: elements of in (out holds size x)
    void *in, *out;     // all_reduce and broadcast work in place on out
    int64_t seq;        // collectives issued on the group before this one
    bool check_only;    // only the agreement on the descriptor (before an NCCL collective)
    bool check;         // MPI: agree on the descriptor before the data. Decided when the collective is
                        // queued, never read later from the group: the ranks must post the same MPI calls
    tsys_event *done;   // nccl: recorded on the side stream after the collective (NULL: it runs on the compute stream)
} tsys_dist__coll;

typedef struct tsys_dist__err { tsys_status status; char msg[384]; } tsys_dist__err;

// The shared segment (ranks on one host): a header, one 256-byte record per rank, then two pipeline
// slots per rank of `slice` bytes each.
typedef struct tsys_dist__shm_rank {
    uint64_t step;            // barriers this rank has passed (only it writes; its own cache line)
    char pad0[56];
    int64_t desc[2][8];       // the collective it is in, by seq parity: seq, kind, type, op, root, count
    int32_t pid;
    char pad1[60];
} tsys_dist__shm_rank;
typedef struct tsys_dist__shm_hdr {
    uint64_t magic;
    int32_t size, pad;
    uint64_t slice;
    int32_t abort_state;      // 0; 1 while a rank writes abort_msg; 2 once it is there
    int32_t abort_rank;
    char abort_msg[384];
} tsys_dist__shm_hdr;
#define TSYS_DIST__SHM_RANKS_OFF 512
typedef char tsys_dist__shm_sizes_ok[(sizeof(tsys_dist__shm_rank) == 256 && sizeof(tsys_dist__shm_hdr) <= TSYS_DIST__SHM_RANKS_OFF) ? 1 : -1];

// An engine: one way a group's collectives travel (>>engines, >>engine shm / mpi / tcp / nccl), as a
// tsys_backend is one device for tsys. Setup is per engine (each needs its own things to start).
typedef struct tsys_dist__engine {
    const char *name;
    tsys_dist_engine kind;   // what tsys_dist_engine_of says when it forms the group (shm never does: AUTO)
    // One collective of the group as c describes it (a barrier has no data). Touches only the group's
    // transport state, never the tsys context: the worker thread calls it too. false: the error is in e
    bool (*collective)(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e);
    // Every rank got here, after what this engine has issued so far (c: the barrier's descriptor)
    bool (*barrier)(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e);
    // The peers this rank can tell are gone without their help, named in buf; how many (NULL: cannot tell)
    int (*dead_peers)(tsys_dist *d, char *buf, size_t n);
    // Releases what the setup made, also after a setup that failed halfway. finalize: tsys_dist_free, not
    // a failed tsys_dist_init; broken: the group was broken when the teardown began
    void (*teardown)(tsys_dist *d, bool finalize, bool broken);
} tsys_dist__engine;

struct tsys_dist_work {
    tsys_dist *d;
    int path;                 // TSYS_DIST__WORK_*
    tsys_dist__coll c;
    tsys_dist__err err;
    int done;                 // host work: set by whoever ran it (under d->mu when the worker did)
    void *stage_in, *stage_out;   // host staging of CUDA tensors
    tsys_tensor *dev_out;         // where stage_out goes back after the collective
    size_t out_bytes;
    tsys_event ev;            // NCCL: the collective's end on the side stream
    bool in_group;            // NCCL: issued in a group that has not ended yet (ev not recorded)
    bool async;               // NCCL: counted in d->side_inflight until freed
    tsys_dist_work *next;     // worker queue; NCCL: the open group's works
};
enum { TSYS_DIST__WORK_DONE, TSYS_DIST__WORK_HOST, TSYS_DIST__WORK_NCCL };

struct tsys_dist {
    tsys_ctx *ctx;
    int rank, size, local_rank, local_size;
    char label[32];               // a sub-group's name in errors (tsys_dist_split; "" for a group of tsys_dist_init)
    int parent_rank;              // a sub-group: this rank's rank in the group it was split from
    tsys_dist_engine engine;      // what tsys_dist_engine_of reports
    const tsys_dist__engine *launch, *host, *device;   // the group's engines (>>group says which is which)
    const tsys_dist__engine *made[4];                  // the engines set up, in order: torn down in reverse
    int nmade;
    bool one_host;
    double timeout_s;
    int64_t seq;                  // collectives issued so far (host and NCCL alike)
    int broken;                   // a peer died, stalled or an engine failed: every later call fails
    char broken_msg[384];
    bool cuda;
    tsys_dist_desc opt;           // the options in effect (tsys_dist__options); its strings point below
    char run_id[TSYS_DIST__RUN_ID_MAX], secret[TSYS_DIST__SECRET_MAX + 1], listen_addr[TSYS_DIST__ADDR_MAX];
    bool check_all, check_none;   // desc.check ALWAYS (or a debug build) / NEVER: fixed at init
    int trusted;                  // > 0 while an agreed layout issues its collectives (tsys_dist__trust);
                                  // only the issuing thread reads it, when it queues a collective
    char hostname[64];
    // TCP: a star around rank 0 (rank 0 holds fds[1..size-1], the others fds[0])
    int *fds;
    // shared memory
    char *shm_base, *shm_data;
    size_t shm_bytes, slice;
    uint64_t shm_step, shm_k;     // barriers passed, pipeline slices used (slot = shm_k & 1)
    long spin_limit;              // spins before a wait yields (tsys_dist__spin_adapt)
    char shm_note[128];           // why the shared-memory path is off, when it is
    // the worker thread that runs asynchronous host collectives in order
    bool worker_on, worker_stop, worker_busy;
    pthread_t worker;
    pthread_mutex_t mu;
    pthread_cond_t cv, cv_done;
    tsys_dist_work *q_head, *q_tail;
#ifdef TSYS_DIST_MPI
    MPI_Comm comm;
    bool have_comm, mpi_owner, mpi_multiple;
#endif
    bool group_open;              // between tsys_dist_group_begin and _end
#ifdef TSYS_DIST_NCCL
    ncclComm_t nccl;
    tsys_event ev_ready;
    tsys_dist_work *group_head, *group_tail;   // the open NCCL group's works, their end events still to record
    struct tsys_dist__window *windows;         // symmetric windows still registered (tsys_dist_tensor_new)
    int side_inflight;                         // asynchronous NCCL works not yet waited for (their side-stream work)
    int nccl_version;                          // the library's at run time (ncclGetVersion)
    struct tsys_dist__ce *ce;                  // desc.ce_allreduce: the copy engines' scratch and flags
#endif
};

static bool tsys_dist__seterr(tsys_dist__err *e, tsys_status s, const char *fmt, ...) {
    if (e->status != TSYS_OK) return false;   // keep the first: it is the cause
    e->status = s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return false;
}

static tsys_status tsys_dist__fail(tsys_dist *d, tsys_status s, const char *fmt, ...) {
    char buf[448];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (d->label[0]) return tsys_ctx_set_error(d->ctx, s, "tsys_dist group '%s' rank %d (rank %d of its parent): %s", d->label, d->rank, d->parent_rank, buf);
    return tsys_ctx_set_error(d->ctx, s, "tsys_dist rank %d: %s", d->rank, buf);
}

static size_t tsys_dist__tsize(int t) {
    switch (t) {
    case TSYS_F32: case TSYS_I32: return 4;
    case TSYS_BF16: case TSYS_F16: return 2;
    case TSYS_I64: case TSYS_DIST__F64: return 8;
    default: return 1;
    }
}
static const char *tsys_dist__tname(int t) {
    return t < TSYS_DTYPE_COUNT ? tsys_dtype_name((tsys_dtype)t) : t == TSYS_DIST__F64 ? "f64" : "bytes";
}
static const char *tsys_dist__opname(int op) { return op == TSYS_DIST_SUM ? "sum" : op == TSYS_DIST_AVG ? "avg" : op == TSYS_DIST_MAX ? "max" : "?"; }

// "all_reduce of 1001 x f32 (sum)": what a descriptor {seq, kind, type, op, root, count} asks for.
static void tsys_dist__describe(const int64_t *desc, char *buf, size_t n) {
    int kind = (int)desc[1];
    const char *k = kind >= 0 && kind <= TSYS_DIST__BARRIER ? tsys_dist__kind_names[kind] : "?";
    if (kind == TSYS_DIST__BARRIER) snprintf(buf, n, "barrier");
    else if (kind == TSYS_DIST__BCAST) snprintf(buf, n, "broadcast of %lld x %s from rank %lld", (long long)desc[5], tsys_dist__tname((int)desc[2]), (long long)desc[4]);
    else if (kind == TSYS_DIST__AG) snprintf(buf, n, "all_gather of %lld x %s per rank", (long long)desc[5], tsys_dist__tname((int)desc[2]));
    else if (kind == TSYS_DIST__RS) snprintf(buf, n, "reduce_scatter to %lld x %s per rank (%s)", (long long)desc[5], tsys_dist__tname((int)desc[2]), tsys_dist__opname((int)desc[3]));
    else snprintf(buf, n, "%s of %lld x %s (%s)", k, (long long)desc[5], tsys_dist__tname((int)desc[2]), tsys_dist__opname((int)desc[3]));
}
static void tsys_dist__desc_of(const tsys_dist__coll *c, int64_t *desc) {
    desc[0] = c->seq; desc[1] = c->kind; desc[2] = c->type;
    desc[3] = c->kind == TSYS_DIST__ALLREDUCE || c->kind == TSYS_DIST__RS ? c->op : 0;
    desc[4] = c->kind == TSYS_DIST__BCAST ? c->root : 0;
    desc[5] = c->kind == TSYS_DIST__BARRIER ? 0 : c->count;
    desc[6] = desc[7] = 0;
}
// Whether a collective of this many bytes first checks that every rank issued the same one: always
// under desc.check ALWAYS (TSYS_DIST_CHECK=1, and in debug builds), never under NEVER (=0) or for an agreed layout's collectives
// (tsys_dist__trust), else from `from` bytes. Called when the collective is queued.
static bool tsys_dist__wants_check(const tsys_dist *d, int64_t bytes, int64_t from) {
    if (d->check_none || d->trusted > 0) return false;
    return d->check_all || bytes >= from;
}

// Compares this rank's descriptor with rank r's; on a difference writes the error naming both.
static bool tsys_dist__desc_agree(tsys_dist *d, const int64_t *mine, const int64_t *other, int r, tsys_dist__err *e) {
    if (!memcmp(mine, other, 6 * sizeof(int64_t))) return true;
    char a[160], b[160];
    tsys_dist__describe(mine, a, sizeof a);
    tsys_dist__describe(other, b, sizeof b);
    if (mine[0] != other[0])
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "ranks disagree: rank %d is at collective #%lld (%s), rank %d at #%lld (%s): they issued different sequences of collectives",
                                 d->rank, (long long)mine[0], a, r, (long long)other[0], b);
    return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "collective #%lld: ranks disagree: rank %d calls %s, rank %d calls %s (every rank must pass the same op, dtype and size)",
                             (long long)mine[0], d->rank, a, r, b);
}

// Copies a string, cutting it to fit (messages are cut on purpose).
static void tsys_dist__strcpy(char *dst, size_t n, const char *src) {
    size_t l = strlen(src);
    if (l >= n) l = n - 1;
    memcpy(dst, src, l);
    dst[l] = 0;
}

static void tsys_dist__nap_us(double us) {
    struct timespec ts;
    ts.tv_sec = (time_t)(us / 1e6);
    ts.tv_nsec = (long)((us - (double)ts.tv_sec * 1e6) * 1e3);
    nanosleep(&ts, NULL);
}

// Marks the group unusable (a peer died or stalled, an engine failed): later calls fail at once.
static void tsys_dist__break(tsys_dist *d, const tsys_dist__err *e) {
    if (TSYS_DIST__LOAD(&d->broken)) return;
    snprintf(d->broken_msg, sizeof d->broken_msg, "%s", e->msg);
    TSYS_DIST__STORE(&d->broken, 1);
}

// >>options ---------------------------------------------------------------------------------------
// The desc's options with the environment over them, checked: the one place that reads the option
// variables (the launch and rendezvous variables are read where the group is formed).

static const char *tsys_dist__env(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}
// false when absent; *bad set when present but not an integer in [lo, hi]
static bool tsys_dist__env_long(const char *name, long lo, long hi, long *out, bool *bad) {
    const char *v = tsys_dist__env(name);
    if (!v) return false;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) { *bad = true; return false; }
    *out = x;
    return true;
}
// A 0/1 variable: 1 or 0 when set, -1 when not, -2 (and the error) for any other value.
static int tsys_dist__env_flag(const char *name, tsys_dist__err *e) {
    long v = 0;
    bool bad = false;
    if (tsys_dist__env_long(name, 0, 1, &v, &bad)) return (int)v;
    if (bad) { tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "%s='%s' is not 0 or 1", name, getenv(name)); return -2; }
    return -1;
}

// A string option: the variable over the field ("" counts as none: NULL), at most max bytes.
static bool tsys_dist__option_str(const char **v, const char *var, const char *field, size_t max, tsys_dist__err *e) {
    const char *env = tsys_dist__env(var);
    if (env) *v = env;
    if (*v && !**v) *v = NULL;
    if (*v && strlen(*v) > max)
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "%s is %zu bytes: at most %zu", env ? var : field, strlen(*v), max);
    return true;
}

#define TSYS_DIST__SLICE_MIN ((int64_t)4096)
#define TSYS_DIST__SLICE_MAX ((int64_t)1 << 30)

// *out = desc (NULL: every field 0) checked, with the environment over it and the defaults that do not
// depend on the group (timeout_s) filled in.
static bool tsys_dist__options(const tsys_dist_desc *desc, tsys_dist_desc *out, tsys_dist__err *e) {
    tsys_dist_desc o;
    memset(&o, 0, sizeof o);
    if (desc) o = *desc;
    if ((unsigned)o.engine > (unsigned)TSYS_DIST_ENGINE_TCP) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "unknown engine %d", (int)o.engine);
    if (o.timeout_s < 0) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "timeout_s %d is negative", o.timeout_s);
    if (o.shm_slice != 0 && (o.shm_slice < TSYS_DIST__SLICE_MIN || o.shm_slice > TSYS_DIST__SLICE_MAX))
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "desc.shm_slice = %lld is not a byte count in [%lld, %lld] (or 0: the default)",
                                 (long long)o.shm_slice, (long long)TSYS_DIST__SLICE_MIN, (long long)TSYS_DIST__SLICE_MAX);
    if ((unsigned)o.check > (unsigned)TSYS_DIST_CHECK_NEVER)
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "desc.check = %d is not a tsys_dist_check (0 auto, 1 always, 2 never)", (int)o.check);
    long v = 0;
    bool bad = false;
    // a timeout in the desc wins (documented so since 0.1): the variable fills it in
    if (o.timeout_s == 0 && tsys_dist__env_long("TSYS_DIST_TIMEOUT", 1, 1L << 30, &v, &bad)) o.timeout_s = (int)v;
    if (bad) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "TSYS_DIST_TIMEOUT='%s' is not a whole number of seconds >= 1", getenv("TSYS_DIST_TIMEOUT"));
    if (o.timeout_s == 0) o.timeout_s = TSYS_DIST_TIMEOUT_DEFAULT;
    const int shm = tsys_dist__env_flag("TSYS_DIST_SHM", e), bind = tsys_dist__env_flag("TSYS_DIST_BIND", e);
    const int blocking = tsys_dist__env_flag("TSYS_DIST_NCCL_BLOCKING", e), check = tsys_dist__env_flag("TSYS_DIST_CHECK", e);
    const int ce = tsys_dist__env_flag("TSYS_DIST_CE", e);
    if (shm == -2 || bind == -2 || blocking == -2 || check == -2 || ce == -2) return false;
    if (ce >= 0) o.ce_allreduce = ce == 1;
    if (shm >= 0) o.no_shm = shm == 0;
    if (bind >= 0) o.no_bind = bind == 0;
    if (blocking >= 0) o.nccl_nonblocking = blocking == 0;
    if (check >= 0) o.check = check ? TSYS_DIST_CHECK_ALWAYS : TSYS_DIST_CHECK_NEVER;
    if (!tsys_dist__option_str(&o.run_id, "TSYS_DIST_RUN_ID", "desc.run_id", TSYS_DIST__RUN_ID_MAX - 1, e) ||
        !tsys_dist__option_str(&o.secret, "TSYS_DIST_SECRET", "desc.secret", TSYS_DIST__SECRET_MAX, e) ||
        !tsys_dist__option_str(&o.listen_addr, "TSYS_DIST_LISTEN_ADDR", "desc.listen_addr", TSYS_DIST__ADDR_MAX - 1, e)) return false;
    if (tsys_dist__env_long("TSYS_DIST_SHM_SLICE", (long)TSYS_DIST__SLICE_MIN, (long)TSYS_DIST__SLICE_MAX, &v, &bad)) o.shm_slice = v;
    if (bad) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "TSYS_DIST_SHM_SLICE='%s' is not a byte count in [%lld, %lld]",
                                      getenv("TSYS_DIST_SHM_SLICE"), (long long)TSYS_DIST__SLICE_MIN, (long long)TSYS_DIST__SLICE_MAX);
    *out = o;
    return true;
}

// The shared segment's slot size per rank for a group of n ranks: few large slices (each costs two
// barriers, and a barrier is where a preempted peer costs time), whole pages, room for the
// reduce-scatter's n blocks.
static size_t tsys_dist__shm_slice_for(int n, int64_t asked) {
    size_t slice = TSYS_DIST__SLICE_TOTAL / (size_t)n;
    slice = slice < ((size_t)256 << 10) ? ((size_t)256 << 10) : slice > ((size_t)4 << 20) ? ((size_t)4 << 20) : slice;
    if (asked) slice = (size_t)asked;
    slice = (slice + 4095) / 4096 * 4096;
    if (slice < (size_t)n * 64) slice = ((size_t)n * 64 + 4095) / 4096 * 4096;
    return slice;
}

// >>launch ----------------------------------------------------------------------------------------

// Started by mpirun/mpiexec (Open MPI, MPICH/Hydra, PMIx) or srun (a job step: SLURM_STEP_ID).
static bool tsys_dist__launched_by_mpi(void) {
    return tsys_dist__env("OMPI_COMM_WORLD_SIZE") || tsys_dist__env("PMIX_RANK") || tsys_dist__env("PMI_RANK") ||
           tsys_dist__env("PMI_SIZE") || (tsys_dist__env("SLURM_PROCID") && (tsys_dist__env("SLURM_STEP_ID") || tsys_dist__env("SLURM_STEPID")));
}

static void tsys_dist__sock_opts(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// Moves n bytes over a non-blocking socket; fails when the peer closes or nothing moves for the
// group's timeout. `who` names the peer in errors.
static bool tsys_dist__sock_io(int fd, void *buf, size_t n, bool out, double timeout_s, const char *who, tsys_dist__err *e) {
    char *p = (char *)buf;
    size_t done = 0;
    double t0 = tsys_time_us();
    while (done < n) {
        ssize_t k = out ? send(fd, p + done, n - done, MSG_NOSIGNAL) : recv(fd, p + done, n - done, 0);
        if (k > 0) { done += (size_t)k; t0 = tsys_time_us(); continue; }
        if (k == 0) return tsys_dist__seterr(e, TSYS_ERR_IO, "%s closed the connection (it exited, or gave up after an error of its own)", who);
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            if (errno == ECONNRESET || errno == EPIPE) return tsys_dist__seterr(e, TSYS_ERR_IO, "%s dropped the connection (it exited?)", who);
            return tsys_dist__seterr(e, TSYS_ERR_IO, "connection to %s: %s", who, strerror(errno));
        }
        struct pollfd pf;
        pf.fd = fd; pf.events = (short)(out ? POLLOUT : POLLIN); pf.revents = 0;
        poll(&pf, 1, 100);
        if ((tsys_time_us() - t0) * 1e-6 > timeout_s)
            return tsys_dist__seterr(e, TSYS_ERR_IO, "%s: nothing %s within %g s (it stalled or died)", who, out ? "accepted" : "received", timeout_s);
    }
    return true;
}

// A name for this machine that differs between machines with the same hostname (containers).
static uint64_t tsys_dist__host_id(const char *hostname) {
    char boot[64] = {0};
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) { if (!fgets(boot, sizeof boot, f)) boot[0] = 0; fclose(f); }
    uint64_t h = 1469598103934665603ull;   // FNV-1a
    for (const char *s = hostname; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    for (const char *s = boot; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

// ---- who may join: the run id, the shared secret, HMAC-SHA-256 ----------------------------------
// Every hello carries the job's run id (desc.run_id / TSYS_DIST_RUN_ID, else torchrun's TORCHELASTIC_RUN_ID;
// tsys_dist_spawn makes one for its children): rank 0 admits only hellos of its own run, and a rank
// joins only a rank 0 of its own run, so two jobs given one MASTER_PORT cannot form a group. With a
// secret (desc.secret / TSYS_DIST_SECRET; tsys_dist_spawn sets a random one), each side also proves it knows the secret:
// an HMAC-SHA-256 over the other side's fresh nonce and the message, so the secret never crosses the
// wire and an old hello cannot be replayed. Without a secret the run id is an identity, not a password.
#define TSYS_DIST__PROTOCOL 2

typedef struct tsys_dist__sha256 { uint32_t h[8]; uint8_t buf[64]; uint64_t len; } tsys_dist__sha256;

static uint32_t tsys_dist__ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
static void tsys_dist__sha256_block(tsys_dist__sha256 *s, const uint8_t *p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
        0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
        0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
        0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2 };
    uint32_t w[64], v[8];
    for (int i = 0; i < 16; i++) w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = tsys_dist__ror(w[i - 15], 7) ^ tsys_dist__ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = tsys_dist__ror(w[i - 2], 17) ^ tsys_dist__ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, s->h, sizeof v);
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = v[7] + (tsys_dist__ror(v[4], 6) ^ tsys_dist__ror(v[4], 11) ^ tsys_dist__ror(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) + k[i] + w[i];
        uint32_t t2 = (tsys_dist__ror(v[0], 2) ^ tsys_dist__ror(v[0], 13) ^ tsys_dist__ror(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
        memmove(v + 1, v, sizeof(uint32_t) * 7);
        v[4] += t1;
        v[0] = t1 + t2;
    }
    for (int i = 0; i < 8; i++) s->h[i] += v[i];
}
static void tsys_dist__sha256_init(tsys_dist__sha256 *s) {
    static const uint32_t h0[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
    memcpy(s->h, h0, sizeof h0);
    s->len = 0;
}
static void tsys_dist__sha256_add(tsys_dist__sha256 *s, const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    for (size_t i = 0; i < n; i++) {
        s->buf[s->len++ % 64] = p[i];
        if (s->len % 64 == 0) tsys_dist__sha256_block(s, s->buf);
    }
}
static void tsys_dist__sha256_end(tsys_dist__sha256 *s, uint8_t out[32]) {
    const uint64_t bits = s->len * 8;
    const uint8_t one = 0x80, zero = 0;
    tsys_dist__sha256_add(s, &one, 1);
    while (s->len % 64 != 56) tsys_dist__sha256_add(s, &zero, 1);
    for (int i = 7; i >= 0; i--) { uint8_t b = (uint8_t)(bits >> (8 * i)); tsys_dist__sha256_add(s, &b, 1); }
    for (int i = 0; i < 32; i++) out[i] = (uint8_t)(s->h[i / 4] >> (24 - 8 * (i % 4)));
}
// HMAC-SHA-256 (RFC 2104) of the concatenation of two parts.
static void tsys_dist__hmac(const uint8_t *key, size_t klen, const void *a, size_t na, const void *b, size_t nb, uint8_t out[32]) {
    uint8_t k[64], pad[64], inner[32];
    tsys_dist__sha256 s;
    memset(k, 0, sizeof k);
    if (klen > 64) { tsys_dist__sha256_init(&s); tsys_dist__sha256_add(&s, key, klen); tsys_dist__sha256_end(&s, k); }
    else if (klen) memcpy(k, key, klen);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
    tsys_dist__sha256_init(&s); tsys_dist__sha256_add(&s, pad, 64); tsys_dist__sha256_add(&s, a, na); tsys_dist__sha256_add(&s, b, nb); tsys_dist__sha256_end(&s, inner);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
    tsys_dist__sha256_init(&s); tsys_dist__sha256_add(&s, pad, 64); tsys_dist__sha256_add(&s, inner, 32); tsys_dist__sha256_end(&s, out);
}
// Compares in time independent of where they differ.
static bool tsys_dist__mac_equal(const uint8_t *a, const uint8_t *b) {
    uint8_t diff = 0;
    for (int i = 0; i < 32; i++) diff |= (uint8_t)(a[i] ^ b[i]);
    return diff == 0;
}

static bool tsys_dist__random(void *buf, size_t n) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, (char *)buf + got, n - got);
        if (k > 0) got += (size_t)k;
        else if (k < 0 && errno == EINTR) continue;
        else break;
    }
    close(fd);
    return got == n;
}

// The job's identity as the environment gives it ("" when none is set).
typedef struct tsys_dist__ident {
    char run_id[TSYS_DIST__RUN_ID_MAX];
    uint8_t secret[TSYS_DIST__SECRET_MAX];
    size_t secret_len;
} tsys_dist__ident;
// The group's run id and secret (tsys_dist__options checked their sizes); torchrun's run id where none is given.
static bool tsys_dist__ident_get(const tsys_dist *d, tsys_dist__ident *id, tsys_dist__err *e) {
    memset(id, 0, sizeof *id);
    const char *run = d->opt.run_id ? d->opt.run_id : tsys_dist__env("TORCHELASTIC_RUN_ID");
    if (run && strlen(run) >= sizeof id->run_id)
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "TORCHELASTIC_RUN_ID is %zu characters: at most %d", strlen(run), TSYS_DIST__RUN_ID_MAX - 1);
    if (run) memcpy(id->run_id, run, strlen(run) + 1);
    if (d->opt.secret) { id->secret_len = strlen(d->opt.secret); memcpy(id->secret, d->opt.secret, id->secret_len); }
    return true;
}
// A message's MAC: over the other side's nonce and the message itself, its mac field zero.
static void tsys_dist__sign(const tsys_dist__ident *id, const uint8_t nonce[16], const void *msg, size_t n, uint8_t mac[32]) {
    memset(mac, 0, 32);
    uint8_t out[32];
    if (!id->secret_len) return;
    tsys_dist__hmac(id->secret, id->secret_len, nonce, 16, msg, n, out);
    memcpy(mac, out, 32);
}
static bool tsys_dist__signed_by(const tsys_dist__ident *id, const uint8_t nonce[16], const void *msg, size_t n, uint8_t mac[32]) {
    if (!id->secret_len) return true;
    uint8_t got[32], want[32];
    memcpy(got, mac, 32);
    tsys_dist__sign(id, nonce, msg, n, mac);
    memcpy(want, mac, 32);
    memcpy(mac, got, 32);
    return tsys_dist__mac_equal(got, want);
}

// The identity the launcher gives its children (through the environment, which only this user can
// read): the run id and secret of its options, else a random run id (unless torchrun's is there) and
// a random secret.
static void tsys_dist__spawn_ident(const tsys_dist_desc *opt, char run_id[TSYS_DIST__RUN_ID_MAX], char secret[TSYS_DIST__SECRET_MAX + 1]) {
    uint8_t r[40];
    run_id[0] = secret[0] = 0;
    if (opt->run_id) tsys_dist__strcpy(run_id, TSYS_DIST__RUN_ID_MAX, opt->run_id);
    if (opt->secret) tsys_dist__strcpy(secret, TSYS_DIST__SECRET_MAX + 1, opt->secret);
    if (opt->run_id && opt->secret) return;
    if (!tsys_dist__random(r, sizeof r)) { fprintf(stderr, "tsys_dist_spawn: no random bytes for the ranks' run id and secret: %s\n", strerror(errno)); return; }
    if (!opt->run_id && !tsys_dist__env("TORCHELASTIC_RUN_ID"))
        snprintf(run_id, TSYS_DIST__RUN_ID_MAX, "tsys-%02x%02x%02x%02x%02x%02x%02x%02x", r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]);
    if (!opt->secret)
        for (int i = 0; i < 32; i++) snprintf(secret + 2 * i, 3, "%02x", r[8 + i]);
}

// Built-in launcher: fork/exec nproc copies of this program with torchrun's variables set. Rank 0
// inherits the listening socket (TSYS_DIST_LISTEN_FD), so the port cannot be taken in between.
TSYSDEF bool tsys_dist_spawn(int nproc, int argc, char **argv, int *exit_code) {
    return tsys_dist_spawn_desc(nproc, argc, argv, NULL, exit_code);
}
TSYSDEF bool tsys_dist_spawn_desc(int nproc, int argc, char **argv, const tsys_dist_desc *desc, int *exit_code) {
    (void)argc;
    if (exit_code) *exit_code = 0;
    if (nproc <= 1 || !argv || !argv[0] || tsys_dist__env("RANK") || tsys_dist__launched_by_mpi()) return false;
    int code = 0;
    tsys_dist_desc opt;
    tsys_dist__err oe;
    memset(&oe, 0, sizeof oe);
    if (!tsys_dist__options(desc, &opt, &oe)) {
        fprintf(stderr, "tsys_dist_spawn: %s\n", oe.msg);
        if (exit_code) *exit_code = 1;
        return true;
    }
    const int tmo = opt.timeout_s;
    double grace_s = tmo < 5 ? (double)tmo : 5.0;   // time the others get to report the failure themselves
    int lfd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (lfd >= 0) setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);   // rank 0 listens there again for later groups
    struct sockaddr_in a;
    socklen_t alen = sizeof a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, nproc + 16) != 0 || getsockname(lfd, (struct sockaddr *)&a, &alen) != 0) {
        fprintf(stderr, "tsys_dist_spawn: cannot open a local port for the rendezvous: %s\n", strerror(errno));
        if (lfd >= 0) close(lfd);
        if (exit_code) *exit_code = 1;
        return true;
    }
    int port = ntohs(a.sin_port);
    char run_id[TSYS_DIST__RUN_ID_MAX], secret[TSYS_DIST__SECRET_MAX + 1];
    tsys_dist__spawn_ident(&opt, run_id, secret);
    char exe[4096];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el > 0) exe[el] = 0; else snprintf(exe, sizeof exe, "%s", argv[0]);
    pid_t *pids = (pid_t *)calloc((size_t)nproc, sizeof(pid_t));
    int *alive = (int *)calloc((size_t)nproc, sizeof(int));
    pid_t me = getpid();
    // Like mpirun: each rank gets its own cores (ncpu / nproc of the launcher's), so ranks that
    // wait for each other never share a core and OpenMP sizes each rank's team to its share.
    // More ranks than cores, or desc.no_bind (TSYS_DIST_BIND=0): no binding.
    int cpus[1024], ncpu = 0;
    bool bind = false;
#ifdef __linux__
    {
        cpu_set_t set;
        if (!opt.no_bind && sched_getaffinity(0, sizeof set, &set) == 0)
            for (int c = 0; c < CPU_SETSIZE && ncpu < 1024; c++) if (CPU_ISSET(c, &set)) cpus[ncpu++] = c;
        bind = ncpu >= nproc;
    }
#endif
    fflush(stdout); fflush(stderr);
    int started = 0;
    for (int r = 0; r < nproc; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            char v[32];
            snprintf(v, sizeof v, "%d", r); setenv("RANK", v, 1); setenv("LOCAL_RANK", v, 1);
            snprintf(v, sizeof v, "%d", nproc); setenv("WORLD_SIZE", v, 1); setenv("LOCAL_WORLD_SIZE", v, 1);
            snprintf(v, sizeof v, "%d", port); setenv("MASTER_PORT", v, 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            snprintf(v, sizeof v, "%d", (int)me); setenv("TSYS_DIST_LAUNCHER", v, 1);
            unsetenv("TORCHELASTIC_USE_AGENT_STORE");   // rank 0 holds MASTER_PORT itself: there is no agent's store
            if (run_id[0]) setenv("TSYS_DIST_RUN_ID", run_id, 1);
            if (secret[0]) setenv("TSYS_DIST_SECRET", secret, 1);
            if (r == 0) { snprintf(v, sizeof v, "%d", lfd); setenv("TSYS_DIST_LISTEN_FD", v, 1); }
            else close(lfd);
#ifdef __linux__
            prctl(PR_SET_PDEATHSIG, SIGTERM);   // the ranks go when the launcher goes
            if (getppid() != me) _exit(1);
            if (bind) {
                cpu_set_t set;
                CPU_ZERO(&set);
                int k = ncpu / nproc;
                for (int c = r * k; c < (r + 1) * k; c++) CPU_SET(cpus[c], &set);
                sched_setaffinity(0, sizeof set, &set);
            }
#else
            (void)bind; (void)cpus; (void)ncpu;
#endif
            execv(exe, argv);
            fprintf(stderr, "tsys_dist_spawn: rank %d: cannot run %s: %s\n", r, exe, strerror(errno));
            _exit(127);
        }
        if (pid < 0) { fprintf(stderr, "tsys_dist_spawn: fork failed for rank %d: %s\n", r, strerror(errno)); code = 1; break; }
        pids[r] = pid; alive[r] = 1; started++;
    }
    close(lfd);
    int first_fail = -1, nalive = started, stage = 0;   // stage 1: SIGTERM sent, 2: SIGKILL sent
    double fail_t = 0;
    if (code) { fail_t = tsys_time_us(); first_fail = nproc; }
    while (nalive > 0) {
        bool any = false;
        for (int r = 0; r < nproc; r++) {
            if (!alive[r]) continue;
            int st = 0;
            pid_t p = waitpid(pids[r], &st, WNOHANG);
            if (p == 0) continue;
            if (p < 0 && errno == EINTR) continue;
            alive[r] = 0; nalive--; any = true;
            int rc = p < 0 ? 1 : WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : 1;
            if (rc != 0 && first_fail < 0) {
                first_fail = r; code = rc; fail_t = tsys_time_us();
                if (p > 0 && WIFSIGNALED(st))
                    fprintf(stderr, "tsys_dist_spawn: rank %d (pid %d) was killed by signal %d; stopping the other ranks\n", r, (int)pids[r], WTERMSIG(st));
                else
                    fprintf(stderr, "tsys_dist_spawn: rank %d (pid %d) exited with code %d; stopping the other ranks\n", r, (int)pids[r], rc);
            }
        }
        if (nalive == 0) break;
        if (first_fail >= 0) {
            double waited = (tsys_time_us() - fail_t) * 1e-6;
            if (stage == 0 && waited > grace_s) { for (int r = 0; r < nproc; r++) if (alive[r]) kill(pids[r], SIGTERM); stage = 1; }
            else if (stage == 1 && waited > grace_s + 3) { for (int r = 0; r < nproc; r++) if (alive[r]) kill(pids[r], SIGKILL); stage = 2; }
        }
        if (!any) tsys_dist__nap_us(2000);
    }
    free(pids); free(alive);
    if (exit_code) *exit_code = code;
    return true;
}

// ---- the TCP rendezvous (torchrun-style variables) ----------------------------------------------
// Rank 0 listens on MASTER_PORT at MASTER_ADDR's address (not on every interface; TSYS_DIST_LISTEN_ADDR
// widens it); the others connect, retrying until the timeout. Rank 0 opens each connection with a
// challenge (its run id and a nonce), the rank answers with a hello, and once every rank is in, rank 0
// answers each with the table of ranks. The connections stay: they are the group's control path (a
// star around rank 0) and, without shared memory, its data path too. A connection that is not a rank
// of this job (another job, a scanner, a rank of another protocol) is refused, logged and closed, and
// the rendezvous goes on. At most TSYS_DIST__PENDING connections wait for their hello at once, each for
// at most TSYS_DIST__HELLO_S: idle connections cannot lock the real ranks out. Under torchrun, whose
// agent holds MASTER_PORT, rank 0 listens on a port of the system's choosing and the others find it in
// the agent's store (see "torchrun's agent store" below); the hellos are the same.
#define TSYS_DIST__PENDING 64
#define TSYS_DIST__HELLO_S 10.0

typedef struct tsys_dist__challenge {
    uint32_t magic, version;
    uint8_t nonce[16];
    char run_id[TSYS_DIST__RUN_ID_MAX];
} tsys_dist__challenge;
typedef struct tsys_dist__hello {
    uint32_t magic, version;
    int32_t rank, size, pid, local_rank;
    uint64_t host_id;
    char host[64];
    char run_id[TSYS_DIST__RUN_ID_MAX];
    uint8_t nonce[16];      // the rank's challenge to rank 0, answered by the reply's mac
    uint8_t mac[32];        // over rank 0's nonce and this hello (zeros without a secret)
} tsys_dist__hello;
typedef struct tsys_dist__reply {
    uint32_t magic;
    int32_t status;         // 0 ok, else msg says why
    char msg[256];
    uint8_t mac[32];        // over the hello's nonce and this reply
} tsys_dist__reply;

static double tsys_dist__hello_s(const tsys_dist *d) { return d->timeout_s < TSYS_DIST__HELLO_S ? d->timeout_s : TSYS_DIST__HELLO_S; }

static bool tsys_dist__is_loopback(const struct sockaddr *sa) {
    if (sa->sa_family == AF_INET) return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family == AF_INET6) return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)sa)->sin6_addr);
    return false;
}
// MASTER_ADDR values that say "this host only" (a host name that resolves to 127.0.1.1 does not).
static bool tsys_dist__loopback_name(const char *addr) { return !strcmp(addr, "localhost") || !strncmp(addr, "127.", 4) || !strcmp(addr, "::1"); }
static void tsys_dist__addr_str(const struct sockaddr *sa, char *buf, size_t n) {
    char host[64] = "?";
    int port = 0;
    if (sa->sa_family == AF_INET) { inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, host, sizeof host); port = ntohs(((const struct sockaddr_in *)sa)->sin_port); }
    else if (sa->sa_family == AF_INET6) { inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, host, sizeof host); port = ntohs(((const struct sockaddr_in6 *)sa)->sin6_port); }
    snprintf(buf, n, "%s:%d", host, port);
}

// LOCAL_WORLD_SIZE (torchrun and tsys_dist_spawn set it): the ranks on this host, 0 when unset; an
// error unless 1 <= LOCAL_WORLD_SIZE <= WORLD_SIZE (and LOCAL_RANK, when set, is below it).
static bool tsys_dist__local_world_size(const tsys_dist *d, long *lws, tsys_dist__err *e) {
    bool bad = false;
    long lr = 0;
    *lws = 0;
    if (!tsys_dist__env_long("LOCAL_WORLD_SIZE", 1, d->size, lws, &bad) && bad)
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "LOCAL_WORLD_SIZE='%s' is not a number of ranks in [1, WORLD_SIZE=%d]", getenv("LOCAL_WORLD_SIZE"), d->size);
    if (*lws && tsys_dist__env_long("LOCAL_RANK", 0, 1L << 20, &lr, &bad) && lr >= *lws)
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "LOCAL_RANK=%ld is not below LOCAL_WORLD_SIZE=%ld", lr, *lws);
    return true;
}

// The stream-socket addresses of host:port (IPv4 and IPv6); getaddrinfo's status.
static int tsys_dist__resolve(const char *host, int port, struct addrinfo **res) {
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC; hints.ai_socktype = SOCK_STREAM; hints.ai_flags = AI_NUMERICSERV;
    return getaddrinfo(host, portstr, &hints, res);
}

// Rank 0's listening socket: the one tsys_dist_spawn opened for it, else a socket bound to the address
// MASTER_ADDR names here (TSYS_DIST_LISTEN_ADDR overrides: "0.0.0.0" or "::" for every interface);
// port 0: one the system picks. A loopback address for a job whose ranks are not all on this host
// (LOCAL_WORLD_SIZE < WORLD_SIZE) is refused: they could not reach it.
static int tsys_dist__listen(tsys_dist *d, const char *addr, int port, bool *loopback, tsys_dist__err *e) {
    long inh = -1;
    bool bad = false;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (tsys_dist__env_long("TSYS_DIST_LISTEN_FD", 0, 1L << 20, &inh, &bad)) {
        unsetenv("TSYS_DIST_LISTEN_FD");   // the next group listens anew
        if (getsockname((int)inh, (struct sockaddr *)&ss, &sl) == 0 && ss.ss_family == AF_INET && ntohs(((struct sockaddr_in *)&ss)->sin_port) == port) {
            *loopback = tsys_dist__is_loopback((struct sockaddr *)&ss);
            fcntl((int)inh, F_SETFD, FD_CLOEXEC);
            return (int)inh;
        }
    }
    const char *listen_addr = d->opt.listen_addr;
    const char *host = listen_addr ? listen_addr : addr;
    struct addrinfo *res = NULL;
    int gai = tsys_dist__resolve(host, port, &res);
    if (gai != 0) { tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "rendezvous: rank 0 cannot resolve %s '%s' to listen on: %s", listen_addr ? "TSYS_DIST_LISTEN_ADDR" : "MASTER_ADDR", host, gai_strerror(gai)); return -1; }
    int fd = -1, err = 0;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) { err = errno; continue; }
        int one = 1, zero = 0;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, TSYS_DIST__PENDING) != 0) { err = errno; close(fd); fd = -1; continue; }
        *loopback = tsys_dist__is_loopback(ai->ai_addr);
    }
    freeaddrinfo(res);
    if (fd < 0) {
        tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: rank 0 cannot listen on %s port %d%s: %s%s", host, port, port ? "" : " (any)", strerror(err),
                          err == EADDRNOTAVAIL ? " (the address is not one of this host's: rank 0 must run where MASTER_ADDR points)" :
                          err == EADDRINUSE ? " (another program, or another job, holds the port: give this job its own MASTER_PORT)" : "");
        return -1;
    }
    long lws = 0;
    tsys_dist__err lws_e;   // validated by tsys_dist__tcp_setup already
    memset(&lws_e, 0, sizeof lws_e);
    if (*loopback && !listen_addr && tsys_dist__local_world_size(d, &lws, &lws_e) && lws && lws < d->size) {
        close(fd);
        tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "rendezvous: MASTER_ADDR '%s' is a loopback address on rank 0's host, but only %ld of the %d ranks run here "
                          "(LOCAL_WORLD_SIZE): the others could not reach it; set MASTER_ADDR to this host's network address (or TSYS_DIST_LISTEN_ADDR)", addr, lws, d->size);
        return -1;
    }
    return fd;
}

// A connection that rank 0 has challenged and whose hello it is reading.
typedef struct tsys_dist__pending {
    int fd;
    double deadline_us;
    size_t got;                 // bytes of the hello received so far
    tsys_dist__challenge ch;    // what it was asked
    tsys_dist__hello h;
    char from[80];              // its address, for the log
} tsys_dist__pending;

typedef struct tsys_dist__refusals { int count; char last[320]; } tsys_dist__refusals;

// Refuses a connection without ending the rendezvous: tells it why (best effort), logs one line on
// stderr, keeps the reason for rank 0's own error should a rank never arrive.
static void tsys_dist__refuse(const tsys_dist__ident *id, tsys_dist__pending *p, int port, const char *why, tsys_dist__refusals *rf) {
    if (p->got == sizeof p->h) {   // it said hello: it may be a rank of this job with a wrong setting
        tsys_dist__reply rep;
        tsys_dist__err ignore;
        memset(&rep, 0, sizeof rep);
        memset(&ignore, 0, sizeof ignore);
        rep.magic = TSYS_DIST__MAGIC; rep.status = 1;
        snprintf(rep.msg, sizeof rep.msg, "rendezvous: rank 0 refused this rank: %s", why);
        tsys_dist__sign(id, p->h.nonce, &rep, sizeof rep, rep.mac);
        tsys_dist__sock_io(p->fd, &rep, sizeof rep, true, 1.0, "", &ignore);
    }
    fprintf(stderr, "tsys_dist rank 0: rendezvous on port %d: refused a connection from %s: %s\n", port, p->from, why);
    snprintf(rf->last, sizeof rf->last, "%s (from %s)", why, p->from);
    rf->count++;
    close(p->fd);
    p->fd = -1;
}

// Why a complete hello is not one of this job's ranks, or NULL when it is.
static const char *tsys_dist__hello_fault(tsys_dist *d, const tsys_dist__ident *id, tsys_dist__pending *p, char *why, size_t n) {
    tsys_dist__hello *h = &p->h;
    h->host[sizeof h->host - 1] = 0;
    h->run_id[sizeof h->run_id - 1] = 0;
    if (h->magic != TSYS_DIST__MAGIC) snprintf(why, n, "not a tsys_dist hello");
    else if (h->version != TSYS_DIST__PROTOCOL) snprintf(why, n, "rendezvous protocol %u, rank 0 speaks %d (another tsys build?)", h->version, TSYS_DIST__PROTOCOL);
    else if (strcmp(h->run_id, id->run_id)) snprintf(why, n, "run id '%s' is not this job's ('%s'): another job on the same MASTER_PORT?", h->run_id, id->run_id);
    else if (!tsys_dist__signed_by(id, p->ch.nonce, h, sizeof *h, h->mac)) snprintf(why, n, "it failed authentication (its TSYS_DIST_SECRET differs, or it has none)");
    else if (h->size != d->size) snprintf(why, n, "rank %d says WORLD_SIZE=%d, rank 0 has %d", h->rank, h->size, d->size);
    else if (h->rank <= 0 || h->rank >= d->size) snprintf(why, n, "a process says RANK=%d, outside [1, %d)", h->rank, d->size);
    else if (d->fds[h->rank] >= 0) snprintf(why, n, "RANK=%d has joined already (two processes with one RANK?)", h->rank);
    else return NULL;
    return why;
}

// Takes a new connection: challenges it and adds it to the pending ones (the oldest is dropped when full).
static void tsys_dist__admit(tsys_dist *d, const tsys_dist__ident *id, int lfd, int port, tsys_dist__pending *pend, int *npend, tsys_dist__refusals *rf) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept(lfd, (struct sockaddr *)&ss, &sl);
    if (fd < 0) return;
    if (*npend == TSYS_DIST__PENDING) {
        tsys_dist__refuse(id, &pend[0], port, "dropped: too many connections waiting to say hello", rf);
        memmove(pend, pend + 1, sizeof *pend * (TSYS_DIST__PENDING - 1));
        (*npend)--;
    }
    tsys_dist__pending *p = &pend[(*npend)++];
    memset(p, 0, sizeof *p);
    p->fd = fd;
    p->deadline_us = tsys_time_us() + tsys_dist__hello_s(d) * 1e6;
    tsys_dist__addr_str((struct sockaddr *)&ss, p->from, sizeof p->from);
    tsys_dist__sock_opts(fd);
    p->ch.magic = TSYS_DIST__MAGIC; p->ch.version = TSYS_DIST__PROTOCOL;
    memcpy(p->ch.run_id, id->run_id, sizeof p->ch.run_id);
    tsys_dist__err ce;
    memset(&ce, 0, sizeof ce);
    if (!tsys_dist__random(p->ch.nonce, sizeof p->ch.nonce) || !tsys_dist__sock_io(fd, &p->ch, sizeof p->ch, true, 1.0, p->from, &ce)) { close(fd); (*npend)--; }
}

// Reads what a pending connection has sent; true when it became rank h.rank of the table.
static bool tsys_dist__hear(tsys_dist *d, const tsys_dist__ident *id, tsys_dist__pending *p, int port, tsys_dist__hello *table, tsys_dist__refusals *rf) {
    ssize_t k = recv(p->fd, (char *)&p->h + p->got, sizeof p->h - p->got, 0);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    if (k <= 0) { tsys_dist__refuse(id, p, port, "it closed the connection before its hello", rf); return false; }
    p->got += (size_t)k;
    if (p->got < sizeof p->h) return false;
    char why[200];
    if (tsys_dist__hello_fault(d, id, p, why, sizeof why)) { tsys_dist__refuse(id, p, port, why, rf); return false; }
    d->fds[p->h.rank] = p->fd;
    table[p->h.rank] = p->h;
    p->fd = -1;
    return true;
}

// Rank 0's side on its listening socket lfd (port: the one it listens on; closes lfd).
static bool tsys_dist__tcp_rank0(tsys_dist *d, int lfd, bool loopback, const char *addr, int port, const tsys_dist__ident *id, tsys_dist__hello *table, tsys_dist__err *e) {
    if (!id->run_id[0])
        fprintf(stderr, "tsys_dist rank 0: no run id (TSYS_DIST_RUN_ID or TORCHELASTIC_RUN_ID): a rank of another job given port %d could join this one\n", port);
    tsys_dist__pending *pend = (tsys_dist__pending *)calloc(TSYS_DIST__PENDING, sizeof *pend);
    struct pollfd *pf = (struct pollfd *)calloc(TSYS_DIST__PENDING + 1, sizeof *pf);
    if (!pend || !pf) { free(pend); free(pf); close(lfd); return tsys_dist__seterr(e, TSYS_ERR_OOM, "rendezvous: out of host memory"); }
    tsys_dist__refusals rf;
    memset(&rf, 0, sizeof rf);
    int npend = 0, got = 0;
    const double t0 = tsys_time_us();
    bool ok = true;
    while (got < d->size - 1) {
        const double now = tsys_time_us(), left_ms = d->timeout_s * 1e3 - (now - t0) * 1e-3;
        if (left_ms <= 0) {
            char missing[160] = {0};
            size_t ml = 0;
            for (int r = 1; r < d->size && ml + 12 < sizeof missing; r++)
                if (d->fds[r] < 0) ml += (size_t)snprintf(missing + ml, sizeof missing - ml, "%s%d", ml ? ", " : "", r);
            ok = tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous on port %d: rank 0 waited %g s; rank(s) %s never joined%s%s%s", port, d->timeout_s, missing,
                                   rf.count ? "; refused: " : "", rf.count ? rf.last : "",
                                   loopback && !tsys_dist__loopback_name(addr) ? " (MASTER_ADDR resolves to a loopback address here: ranks on other hosts cannot reach it)" : "");
            break;
        }
        pf[0].fd = lfd; pf[0].events = POLLIN; pf[0].revents = 0;
        for (int i = 0; i < npend; i++) { pf[1 + i].fd = pend[i].fd; pf[1 + i].events = POLLIN; pf[1 + i].revents = 0; }
        if (poll(pf, (nfds_t)(1 + npend), left_ms > 200 ? 200 : (int)left_ms + 1) < 0 && errno != EINTR) { ok = tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: poll: %s", strerror(errno)); break; }
        for (int i = 0; i < npend; i++) {
            if (pf[1 + i].revents && tsys_dist__hear(d, id, &pend[i], port, table, &rf)) got++;
            else if (pend[i].fd >= 0 && tsys_time_us() > pend[i].deadline_us) tsys_dist__refuse(id, &pend[i], port, "no hello in time", &rf);
        }
        int kept = 0;
        for (int i = 0; i < npend; i++) if (pend[i].fd >= 0) pend[kept++] = pend[i];
        npend = kept;
        if (pf[0].revents & POLLIN) tsys_dist__admit(d, id, lfd, port, pend, &npend, &rf);
    }
    for (int i = 0; i < npend; i++) close(pend[i].fd);
    free(pend); free(pf);
    close(lfd);   // before anyone hears back: a later group's hellos cannot reach this listener
    if (!ok) return false;
    for (int r = 1; r < d->size; r++) {
        char who[32];
        snprintf(who, sizeof who, "rank %d", r);
        tsys_dist__reply rep;
        memset(&rep, 0, sizeof rep);
        rep.magic = TSYS_DIST__MAGIC;
        tsys_dist__sign(id, table[r].nonce, &rep, sizeof rep, rep.mac);
        if (!tsys_dist__sock_io(d->fds[r], &rep, sizeof rep, true, d->timeout_s, who, e) ||
            !tsys_dist__sock_io(d->fds[r], table, sizeof(tsys_dist__hello) * (size_t)d->size, true, d->timeout_s, who, e)) return false;
    }
    return true;
}

// Connects to MASTER_ADDR:MASTER_PORT (every address it resolves to); -1 with *why when none answers.
static int tsys_dist__connect(const char *addr, int port, char *why, size_t nwhy) {
    struct addrinfo *res = NULL;
    int gai = tsys_dist__resolve(addr, port, &res);
    if (gai != 0) { snprintf(why, nwhy, "MASTER_ADDR '%s': %s", addr, gai_strerror(gai)); return -1; }
    int fd = -1;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) continue;
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            struct pollfd pf;
            pf.fd = fd; pf.events = POLLOUT; pf.revents = 0;
            int soerr = ETIMEDOUT;
            socklen_t sl = sizeof soerr;
            if (poll(&pf, 1, 1000) == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
            rc = soerr ? -1 : 0;
            errno = soerr;
        }
        if (rc != 0) { snprintf(why, nwhy, "%s", strerror(errno)); close(fd); fd = -1; }
    }
    freeaddrinfo(res);
    if (fd >= 0) tsys_dist__sock_opts(fd);
    return fd;
}

// One attempt to join: 1 joined, 0 try again (*why says what went wrong), -1 refused for good (e set).
static int tsys_dist__join(tsys_dist *d, int fd, const char *addr, int port, const tsys_dist__ident *id, tsys_dist__hello *table, char *why, size_t nwhy, tsys_dist__err *e) {
    tsys_dist__challenge ch;
    tsys_dist__err ce;
    memset(&ce, 0, sizeof ce);
    // a listener that closes under us (a previous group's) resets the connection: try again
    if (!tsys_dist__sock_io(fd, &ch, sizeof ch, false, tsys_dist__hello_s(d), "rank 0", &ce)) { tsys_dist__strcpy(why, nwhy, ce.msg); return 0; }
    ch.run_id[sizeof ch.run_id - 1] = 0;
    if (ch.magic != TSYS_DIST__MAGIC || ch.version != TSYS_DIST__PROTOCOL) { snprintf(why, nwhy, "%s:%d is not a tsys_dist rank 0 of rendezvous protocol %d", addr, port, TSYS_DIST__PROTOCOL); return 0; }
    if (strcmp(ch.run_id, id->run_id)) { snprintf(why, nwhy, "%s:%d is rank 0 of another job (run id '%s'; this rank's is '%s')", addr, port, ch.run_id, id->run_id); return 0; }
    tsys_dist__hello h = table[d->rank];
    memcpy(h.run_id, id->run_id, sizeof h.run_id);
    if (!tsys_dist__random(h.nonce, sizeof h.nonce)) { tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: no random bytes (/dev/urandom): %s", strerror(errno)); return -1; }
    tsys_dist__sign(id, ch.nonce, &h, sizeof h, h.mac);
    tsys_dist__reply rep;
    if (!tsys_dist__sock_io(fd, &h, sizeof h, true, d->timeout_s, "rank 0", &ce) || !tsys_dist__sock_io(fd, &rep, sizeof rep, false, d->timeout_s, "rank 0", &ce)) {
        tsys_dist__strcpy(why, nwhy, ce.msg);
        return 0;
    }
    if (rep.magic != TSYS_DIST__MAGIC) { snprintf(why, nwhy, "bad reply from %s:%d", addr, port); return 0; }
    if (!tsys_dist__signed_by(id, h.nonce, &rep, sizeof rep, rep.mac)) { snprintf(why, nwhy, "%s:%d failed authentication (its TSYS_DIST_SECRET differs)", addr, port); return 0; }
    rep.msg[sizeof rep.msg - 1] = 0;
    if (rep.status != 0) { tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "%s", rep.msg); return -1; }
    if (!tsys_dist__sock_io(fd, table, sizeof(tsys_dist__hello) * (size_t)d->size, false, d->timeout_s, "rank 0", e)) return -1;
    return 1;
}

// A rank's side: connects to rank 0 at addr:port and joins, retrying until t0 (us) + the timeout.
static bool tsys_dist__tcp_peer(tsys_dist *d, const char *addr, int port, double t0, const tsys_dist__ident *id, tsys_dist__hello *table, tsys_dist__err *e) {
    char why[256] = "no answer";
    for (;;) {
        if ((tsys_time_us() - t0) * 1e-6 > d->timeout_s)
            return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: could not join rank 0 at %s:%d within %g s (%s)", addr, port, d->timeout_s, why);
        int fd = tsys_dist__connect(addr, port, why, sizeof why);
        if (fd < 0) { tsys_dist__nap_us(100e3); continue; }
        int joined = tsys_dist__join(d, fd, addr, port, id, table, why, sizeof why, e);
        if (joined > 0) { d->fds[0] = fd; return true; }
        close(fd);
        if (joined < 0) return false;
        tsys_dist__nap_us(100e3);
    }
}

// ---- torchrun's agent store ---------------------------------------------------------------------
// torchrun's agent holds MASTER_PORT with its TCPStore and tells the workers to use it
// (TORCHELASTIC_USE_AGENT_STORE=True). Then rank 0 listens on a port the system picks and publishes it
// in that store under a key of this rendezvous, TSYS_DIST__STORE_KEY (the run, torchrun's restart
// count, and the number of TCP rendezvous this process has made: ranks make their groups in the same
// order); the others wait for the key, read the port, and join as usual. Every rank is a raw client
// of the store, torch 2.x's wire protocol (pinned on 2.11): a command byte, then keys and values as a
// u64 length and the bytes, integers raw little-endian; the first message is VALIDATE with its magic
// (no reply). Only VALIDATE, SET, CHECK, WAIT and GET are spoken; each exchange is bounded by the
// rendezvous's deadline, and an error names the store, the command and the key.
#define TSYS_DIST__STORE_MAGIC 0x3C85F7CEu
#define TSYS_DIST__STORE_KEY "/tsys/%s/%ld/%u/rank0"   // run id, TORCHELASTIC_RESTART_COUNT, group number
enum { TSYS_DIST__STORE_VALIDATE = 0, TSYS_DIST__STORE_SET = 1, TSYS_DIST__STORE_GET = 3, TSYS_DIST__STORE_CHECK = 5, TSYS_DIST__STORE_WAIT = 6 };

// The TCP rendezvous this process has made so far: the group number in the key. The one global of
// tsys_dist (the store outlives a group, and the ranks' processes are what agree on the order).
static unsigned tsys_dist__tcp_groups;

typedef struct tsys_dist__store {
    int fd;
    char name[80];        // "MASTER_ADDR:MASTER_PORT", for errors
    double deadline_us;   // the rendezvous's
    double timeout_s;
} tsys_dist__store;

static bool tsys_dist__agent_store_on(void) {
    const char *v = tsys_dist__env("TORCHELASTIC_USE_AGENT_STORE");
    return v && !strcmp(v, "True");
}

// Moves n bytes to or from the store before the deadline; `what` ("WAIT of key '...'") names the exchange.
static bool tsys_dist__store_io(tsys_dist__store *s, void *buf, size_t n, bool out, const char *what, tsys_dist__err *e) {
    char *p = (char *)buf;
    size_t done = 0;
    while (done < n) {
        ssize_t k = out ? send(s->fd, p + done, n - done, MSG_NOSIGNAL) : recv(s->fd, p + done, n - done, 0);
        if (k > 0) { done += (size_t)k; continue; }
        if (k == 0) return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: torchrun's agent store at %s closed the connection during %s", s->name, what);
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: torchrun's agent store at %s: %s: %s", s->name, what, strerror(errno));
        const double left_ms = (s->deadline_us - tsys_time_us()) * 1e-3;
        if (left_ms <= 0)
            return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: torchrun's agent store at %s: %s: no %s within the timeout (%g s)", s->name, what, out ? "progress" : "reply", s->timeout_s);
        struct pollfd pf;
        pf.fd = s->fd; pf.events = (short)(out ? POLLOUT : POLLIN); pf.revents = 0;
        if (poll(&pf, 1, left_ms > 200 ? 200 : (int)left_ms + 1) < 0 && errno != EINTR)
            return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: torchrun's agent store at %s: %s: poll: %s", s->name, what, strerror(errno));
    }
    return true;
}

// Appends a u64 little-endian length and the bytes (a key or a value) to a message at m + at.
static size_t tsys_dist__store_put(uint8_t *m, size_t at, const void *p, size_t n) {
    for (int i = 0; i < 8; i++) m[at + (size_t)i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(m + at + 8, p, n);
    return at + 8 + n;
}

// Connects to the store (retrying until the deadline: the agent starts it before the workers) and validates.
static bool tsys_dist__store_open(tsys_dist__store *s, const char *addr, int port, double deadline_us, double timeout_s, tsys_dist__err *e) {
    snprintf(s->name, sizeof s->name, "%s:%d", addr, port);
    s->deadline_us = deadline_us; s->timeout_s = timeout_s;
    char why[256] = "no answer";
    while ((s->fd = tsys_dist__connect(addr, port, why, sizeof why)) < 0) {
        if (tsys_time_us() > deadline_us)
            return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: cannot reach torchrun's agent store at %s (TORCHELASTIC_USE_AGENT_STORE=True) within %g s: %s", s->name, timeout_s, why);
        tsys_dist__nap_us(100e3);
    }
    uint8_t m[5] = { TSYS_DIST__STORE_VALIDATE };
    for (int i = 0; i < 4; i++) m[1 + i] = (uint8_t)(TSYS_DIST__STORE_MAGIC >> (8 * i));
    if (tsys_dist__store_io(s, m, sizeof m, true, "VALIDATE", e)) return true;
    close(s->fd);
    s->fd = -1;
    return false;
}

// Sends a command on one key (with a value for SET; CHECK and WAIT take a count of keys first) and
// reads a one-byte reply when `reply` is not NULL.
static bool tsys_dist__store_cmd(tsys_dist__store *s, int cmd, const char *key, const char *value, uint8_t *reply, tsys_dist__err *e) {
    uint8_t m[1 + 8 + 8 + 2 * 128];
    const size_t kl = strlen(key), vl = value ? strlen(value) : 0;
    TSYS_ASSERT(kl < 128 && vl < 128);
    size_t n = 0;
    m[n++] = (uint8_t)cmd;
    if (cmd == TSYS_DIST__STORE_CHECK || cmd == TSYS_DIST__STORE_WAIT) { for (int i = 0; i < 8; i++) m[n++] = (uint8_t)(i == 0); }   // u64 1: one key
    n = tsys_dist__store_put(m, n, key, kl);
    if (cmd == TSYS_DIST__STORE_SET) n = tsys_dist__store_put(m, n, value, vl);
    const char *name = cmd == TSYS_DIST__STORE_SET ? "SET" : cmd == TSYS_DIST__STORE_GET ? "GET" : cmd == TSYS_DIST__STORE_CHECK ? "CHECK" : "WAIT";
    char what[200];
    snprintf(what, sizeof what, "%s of key '%s'", name, key);
    return tsys_dist__store_io(s, m, n, true, what, e) && (!reply || tsys_dist__store_io(s, reply, 1, false, what, e));
}

// Rank 0: stores its port under key and checks that the store has it (VALIDATE and SET have no reply:
// CHECK is what shows that MASTER_PORT is a TCPStore that took it).
static bool tsys_dist__store_publish(tsys_dist__store *s, const char *key, int port, tsys_dist__err *e) {
    char v[16];
    uint8_t ready = 1;
    snprintf(v, sizeof v, "%d", port);
    if (!tsys_dist__store_cmd(s, TSYS_DIST__STORE_SET, key, v, NULL, e) || !tsys_dist__store_cmd(s, TSYS_DIST__STORE_CHECK, key, NULL, &ready, e)) return false;
    if (ready != 0) return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: torchrun's agent store at %s: CHECK of key '%s' after its SET answered %u, not 0 (ready)", s->name, key, ready);
    return true;
}

// The other ranks: waits until rank 0 has published its port under key, then reads it.
static bool tsys_dist__store_lookup(tsys_dist__store *s, const char *key, int *port, tsys_dist__err *e) {
    uint8_t done = 1, len8[8];
    char v[16];
    if (!tsys_dist__store_cmd(s, TSYS_DIST__STORE_WAIT, key, NULL, &done, e)) {
        if (tsys_time_us() >= s->deadline_us) snprintf(e->msg + strlen(e->msg), sizeof e->msg - strlen(e->msg), ": rank 0 never published its port (it failed, or is not a tsys program of this run)");
        return false;
    }
    if (done != 0) return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: torchrun's agent store at %s: WAIT of key '%s' answered %u, not 0 (stop waiting)", s->name, key, done);
    if (!tsys_dist__store_cmd(s, TSYS_DIST__STORE_GET, key, NULL, NULL, e) || !tsys_dist__store_io(s, len8, 8, false, "GET's reply", e)) return false;
    uint64_t len = 0;
    for (int i = 0; i < 8; i++) len |= (uint64_t)len8[i] << (8 * i);
    if (len == 0 || len >= sizeof v) return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: torchrun's agent store at %s: key '%s' holds %llu bytes, not a port", s->name, key, (unsigned long long)len);
    if (!tsys_dist__store_io(s, v, (size_t)len, false, "GET's reply", e)) return false;
    v[len] = 0;
    char *end;
    long p = strtol(v, &end, 10);
    if (*end || p < 1 || p > 65535) return tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: torchrun's agent store at %s: key '%s' holds '%s', not a port", s->name, key, v);
    *port = (int)p;
    return true;
}

// ---- the TCP rendezvous, with or without the agent's store ---------------------------------------
// The star's sockets (none yet) and this rank's entry of the table of ranks, before the rendezvous.
static void tsys_dist__tcp_hello_mine(tsys_dist *d, tsys_dist__hello *table) {
    for (int r = 0; r < d->size; r++) d->fds[r] = -1;
    tsys_dist__hello *mine = &table[d->rank];
    mine->magic = TSYS_DIST__MAGIC; mine->version = TSYS_DIST__PROTOCOL; mine->rank = d->rank; mine->size = d->size; mine->pid = (int32_t)getpid();
    mine->local_rank = d->local_rank;
    snprintf(mine->host, sizeof mine->host, "%s", d->hostname);
    mine->host_id = tsys_dist__host_id(d->hostname);
}

// After the rendezvous: the ranks on this host (one_host, local_size) from the table; this rank's place among them.
static int tsys_dist__tcp_locals(tsys_dist *d, const tsys_dist__hello *table) {
    int lr = 0, ls = 0;
    for (int r = 0; r < d->size; r++)
        if (table[r].host_id == table[d->rank].host_id) { ls++; if (r < d->rank) lr++; }
    d->one_host = ls == d->size;
    d->local_size = ls;
    return lr;
}

// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT -> the star, the local ranks, one_host.
static bool tsys_dist__tcp_setup(tsys_dist *d, const char *addr, int port, tsys_dist__err *e) {
    const double t0 = tsys_time_us();
    const unsigned group = __atomic_fetch_add(&tsys_dist__tcp_groups, 1u, __ATOMIC_RELAXED);
    tsys_dist__ident id;
    long lws = 0;
    if (!tsys_dist__ident_get(d, &id, e) || !tsys_dist__local_world_size(d, &lws, e)) return false;
    if (lws) d->local_size = (int)lws;   // until the table of ranks says which share this host
    const bool agent = tsys_dist__agent_store_on();
    tsys_dist__store store;
    char key[128];
    store.fd = -1;
    if (agent) {
        long restarts = 0;
        bool bad = false;
        tsys_dist__env_long("TORCHELASTIC_RESTART_COUNT", 0, 1L << 30, &restarts, &bad);
        snprintf(key, sizeof key, TSYS_DIST__STORE_KEY, id.run_id, restarts, group);
        if (!tsys_dist__store_open(&store, addr, port, t0 + d->timeout_s * 1e6, d->timeout_s, e)) return false;
    }
    d->fds = (int *)TSYS_MALLOC(sizeof(int) * (size_t)d->size);
    tsys_dist__hello *table = (tsys_dist__hello *)calloc((size_t)d->size, sizeof(tsys_dist__hello));
    if (!d->fds || !table) { free(table); if (store.fd >= 0) close(store.fd); return tsys_dist__seterr(e, TSYS_ERR_OOM, "rendezvous: out of memory"); }
    tsys_dist__tcp_hello_mine(d, table);
    bool ok;
    if (d->rank == 0) {
        bool loopback = false;
        int lfd = tsys_dist__listen(d, addr, agent ? 0 : port, &loopback, e);   // under torchrun the agent holds MASTER_PORT
        ok = lfd >= 0;
        if (ok && agent) {
            struct sockaddr_storage ss;
            socklen_t sl = sizeof ss;
            ok = getsockname(lfd, (struct sockaddr *)&ss, &sl) == 0 ? true : tsys_dist__seterr(e, TSYS_ERR_IO, "rendezvous: getsockname: %s", strerror(errno));
            if (ok) port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port : ((struct sockaddr_in *)&ss)->sin_port);
            ok = ok && tsys_dist__store_publish(&store, key, port, e);
            if (!ok) close(lfd);
        }
        if (store.fd >= 0) close(store.fd);
        ok = ok && tsys_dist__tcp_rank0(d, lfd, loopback, addr, port, &id, table, e);
    } else {
        ok = !agent || tsys_dist__store_lookup(&store, key, &port, e);
        if (store.fd >= 0) close(store.fd);
        ok = ok && tsys_dist__tcp_peer(d, addr, port, t0, &id, table, e);
    }
    if (ok) {
        const int lr = tsys_dist__tcp_locals(d, table);
        long env_lr = 0;
        bool bad = false;
        if (!tsys_dist__env_long("LOCAL_RANK", 0, 1L << 20, &env_lr, &bad)) d->local_rank = lr;   // torchrun's LOCAL_RANK wins
    }
    free(table);
    return ok;
}

// >>engines ---------------------------------------------------------------------------------------
// What the engines share: each fills a tsys_dist__engine (>>config) with its collective, barrier,
// dead-peer watch and teardown, as a tsys_backend does for a device, and tsys_dist_init sets them up
// by name (each needs its own things to start). The host reductions below serve shm and tcp, which
// reduce on the CPU themselves, and MPI, whose sums run here in rank order.
static bool tsys_dist__host_exec(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e);
#if defined(TSYS_DIST_NCCL) || defined(TSYS_DIST_MPI)
static int tsys_dist__dead_peers(tsys_dist *d, char *buf, size_t n);
#endif

// ---- reductions on host memory: dst = op over the sources, in fp32 for the 16-bit floats (rounded
// once at the end), in int64 for the integers. Blocks of TSYS_DIST__BLK stay in L1.
#define TSYS_DIST__BLK 256

static inline float tsys_dist__bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t tsys_dist__f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   // same rounding as tsys_f32_to_bf16
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void tsys_dist__load_f(int type, const void *src, int64_t i0, int m, float *acc, int op, bool first) {
    float v[TSYS_DIST__BLK];
    const float *s = v;
    if (type == TSYS_F32) s = (const float *)src + i0;
    else if (type == TSYS_BF16) { const uint16_t *p = (const uint16_t *)src + i0; for (int j = 0; j < m; j++) v[j] = tsys_dist__bf2f(p[j]); }
    else { const uint16_t *p = (const uint16_t *)src + i0; for (int j = 0; j < m; j++) v[j] = tsys_f16_to_f32(p[j]); }
    if (first) { memcpy(acc, s, sizeof(float) * (size_t)m); return; }
    if (op == TSYS_DIST_MAX) { for (int j = 0; j < m; j++) if (s[j] > acc[j] || s[j] != s[j]) acc[j] = s[j]; }   // NaN wins, like torch
    else if (m == TSYS_DIST__BLK) { for (int j = 0; j < TSYS_DIST__BLK; j++) acc[j] += s[j]; }                 // fixed trip count: vectorized
    else { for (int j = 0; j < m; j++) acc[j] += s[j]; }
}
static void tsys_dist__store_f(int type, void *dst, int64_t i0, int m, const float *acc) {
    if (!dst) return;
    if (type == TSYS_F32) memcpy((float *)dst + i0, acc, sizeof(float) * (size_t)m);
    else if (type == TSYS_BF16) { uint16_t *p = (uint16_t *)dst + i0; for (int j = 0; j < m; j++) p[j] = tsys_dist__f2bf(acc[j]); }
    else { uint16_t *p = (uint16_t *)dst + i0; for (int j = 0; j < m; j++) p[j] = tsys_f32_to_f16(acc[j]); }
}

// dst1 (and dst2 when not NULL) = op(src[0..nsrc-1]) over n elements; AVG divides by nsrc. A
// destination may be one of the sources (each block is read before it is written).
static void tsys_dist__reduce(int type, int op, void *dst1, void *dst2, const void *const *src, int nsrc, int64_t n) {
    for (int64_t i0 = 0; i0 < n; i0 += TSYS_DIST__BLK) {
        int m = (int)(n - i0 < TSYS_DIST__BLK ? n - i0 : TSYS_DIST__BLK);
        if (type == TSYS_F32 || type == TSYS_BF16 || type == TSYS_F16) {
            float acc[TSYS_DIST__BLK];
            for (int s = 0; s < nsrc; s++) tsys_dist__load_f(type, src[s], i0, m, acc, op, s == 0);
            if (op == TSYS_DIST_AVG) for (int j = 0; j < m; j++) acc[j] /= (float)nsrc;
            tsys_dist__store_f(type, dst1, i0, m, acc);
            tsys_dist__store_f(type, dst2, i0, m, acc);
        } else if (type == TSYS_DIST__F64) {
            double acc[TSYS_DIST__BLK];
            memcpy(acc, (const double *)src[0] + i0, sizeof(double) * (size_t)m);
            for (int s = 1; s < nsrc; s++) {
                const double *p = (const double *)src[s] + i0;
                if (op == TSYS_DIST_MAX) { for (int j = 0; j < m; j++) if (p[j] > acc[j] || p[j] != p[j]) acc[j] = p[j]; }
                else for (int j = 0; j < m; j++) acc[j] += p[j];
            }
            if (op == TSYS_DIST_AVG) for (int j = 0; j < m; j++) acc[j] /= nsrc;
            memcpy((double *)dst1 + i0, acc, sizeof(double) * (size_t)m);
            if (dst2) memcpy((double *)dst2 + i0, acc, sizeof(double) * (size_t)m);
        } else {   // I32, I64: sums wrap like two's complement
            int64_t acc[TSYS_DIST__BLK];
            for (int s = 0; s < nsrc; s++) {
                for (int j = 0; j < m; j++) {
                    int64_t v = type == TSYS_I32 ? (int64_t)((const int32_t *)src[s])[i0 + j] : ((const int64_t *)src[s])[i0 + j];
                    if (s == 0) acc[j] = v;
                    else if (op == TSYS_DIST_MAX) acc[j] = v > acc[j] ? v : acc[j];
                    else acc[j] = (int64_t)((uint64_t)acc[j] + (uint64_t)v);
                }
            }
            for (int t = 0; t < 2; t++) {
                void *dst = t ? dst2 : dst1;
                if (!dst) continue;
                if (type == TSYS_I32) for (int j = 0; j < m; j++) ((int32_t *)dst)[i0 + j] = (int32_t)(uint32_t)(uint64_t)acc[j];
                else memcpy((int64_t *)dst + i0, acc, sizeof(int64_t) * (size_t)m);
            }
        }
    }
}

// A pid that is gone (or a zombie nobody reaped yet).
static bool tsys_dist__pid_dead(int pid) {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

// How long a wait spins before it yields the CPU adapts: a wait that ran out of spins (the peer was
// not running: more ranks than cores, or a slow peer) halves it, a wait that ended while spinning
// doubles it (one that did not wait at all changes nothing). Ranks on cores of their own keep spinning (sub-microsecond barriers); oversubscribed
// ranks yield almost at once (spinning would only delay the peer they wait for).
static void tsys_dist__spin_adapt(tsys_dist *d, long spins) {
    if (spins >= d->spin_limit) d->spin_limit = d->spin_limit > 32 ? d->spin_limit / 2 : 16;
    else if (spins > 0 && d->spin_limit < 4096) d->spin_limit *= 2;   // 0: the others were there already
}

// A host collective during setup (before the worker runs): bytes from root, or an int32 reduction.
static bool tsys_dist__setup_bcast(tsys_dist *d, void *buf, int64_t bytes, int root, tsys_dist__err *e) {
    tsys_dist__coll c;
    memset(&c, 0, sizeof c);
    c.kind = TSYS_DIST__BCAST; c.type = TSYS_DIST__U8; c.root = root; c.count = bytes; c.in = c.out = buf; c.seq = d->seq++;
    c.check = tsys_dist__wants_check(d, bytes, TSYS_DIST__CHECK_BYTES);
    return tsys_dist__host_exec(d, &c, e);
}
static bool tsys_dist__setup_allreduce_i32(tsys_dist *d, int32_t *v, int n, int op, tsys_dist__err *e) {
    tsys_dist__coll c;
    memset(&c, 0, sizeof c);
    c.kind = TSYS_DIST__ALLREDUCE; c.type = TSYS_I32; c.op = op; c.count = n; c.in = c.out = v; c.seq = d->seq++;
    c.check = tsys_dist__wants_check(d, (int64_t)n * 4, TSYS_DIST__CHECK_BYTES);
    return tsys_dist__host_exec(d, &c, e);
}

// ---- self: a group of one ------------------------------------------------------------------------
// Collectives are the identity; reduce-scatter and all-gather copy in to out.
static bool tsys_dist__self_coll(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    (void)d; (void)e;
    if ((c->kind == TSYS_DIST__RS || c->kind == TSYS_DIST__AG) && !c->check_only && c->in != c->out && c->count)
        memmove(c->out, c->in, (size_t)c->count * tsys_dist__tsize(c->type));
    return true;
}
static const tsys_dist__engine tsys_dist__engine_self = { "self", TSYS_DIST_ENGINE_SELF, tsys_dist__self_coll, tsys_dist__self_coll, NULL, NULL };

// >>engine shm ------------------------------------------------------------------------------------
// Every rank on this host, through a segment of shared memory (tsys_dist__shm_setup).
// Two pipeline slots per rank. Each slice: every rank copies its part of the input into its slot,
// a barrier, then each rank reads what it needs from the others' slots (all-reduce: each rank
// reduces 1/size of the slice in place, a second barrier, everyone copies the reduced parts out).
// Slots alternate by a counter kept across collectives, so a slot is rewritten only after a later
// barrier has shown that every rank finished reading it. The descriptor of each collective sits in
// the rank records and is compared after the first barrier: a mismatch costs nothing to detect and
// every rank sees it at the same point.

static tsys_dist__shm_hdr *tsys_dist__shm_h(tsys_dist *d) { return (tsys_dist__shm_hdr *)d->shm_base; }
static tsys_dist__shm_rank *tsys_dist__shm_r(tsys_dist *d, int r) { return (tsys_dist__shm_rank *)(d->shm_base + TSYS_DIST__SHM_RANKS_OFF + sizeof(tsys_dist__shm_rank) * (size_t)r); }
static char *tsys_dist__shm_buf(tsys_dist *d, int slot, int r) { return d->shm_data + ((size_t)slot * (size_t)d->size + (size_t)r) * d->slice; }



// Publishes a failure in the segment so every rank stops at once, naming the same cause.
static bool tsys_dist__shm_abort(tsys_dist *d, tsys_dist__err *e) {
    tsys_dist__shm_hdr *h = tsys_dist__shm_h(d);
    int32_t zero = 0;
    if (__atomic_compare_exchange_n(&h->abort_state, &zero, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        h->abort_rank = d->rank;
        snprintf(h->abort_msg, sizeof h->abort_msg, "%s", e->msg);
        TSYS_DIST__STORE(&h->abort_state, 2);
    }
    tsys_dist__break(d, e);
    return false;
}

static bool tsys_dist__shm_aborted(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    tsys_dist__shm_hdr *h = tsys_dist__shm_h(d);
    for (int i = 0; i < 100000 && TSYS_DIST__LOAD(&h->abort_state) != 2; i++) TSYS_DIST__RELAX();
    tsys_dist__seterr(e, TSYS_ERR_IO, "%s #%lld: rank %d gave up: %s", tsys_dist__kind_names[c->kind], (long long)c->seq, h->abort_rank, h->abort_msg);
    tsys_dist__break(d, e);
    return false;
}

// Waits until every rank's step counter reaches target: spins briefly, then yields, then naps; checks
// the lagging ranks' pids every 50 ms and gives up after timeout_s without progress.
static bool tsys_dist__shm_wait(tsys_dist *d, uint64_t target, const tsys_dist__coll *c, tsys_dist__err *e) {
    tsys_dist__shm_hdr *h = tsys_dist__shm_h(d);
    double t0 = 0, last_check = 0;
    long spins = 0;
    for (int r = 0; r < d->size; r++) {
        tsys_dist__shm_rank *p = tsys_dist__shm_r(d, r);
        while (TSYS_DIST__LOAD(&p->step) < target) {
            if (TSYS_DIST__LOAD(&h->abort_state)) return tsys_dist__shm_aborted(d, c, e);
            if (++spins < d->spin_limit) { TSYS_DIST__RELAX(); continue; }
            double now = tsys_time_us();
            if (t0 == 0) t0 = last_check = now;
            if (now - last_check > TSYS_DIST__DEAD_CHECK_US) {
                last_check = now;
                for (int q = 0; q < d->size; q++) {
                    tsys_dist__shm_rank *pq = tsys_dist__shm_r(d, q);
                    if (TSYS_DIST__LOAD(&pq->step) < target && tsys_dist__pid_dead(pq->pid)) {
                        tsys_dist__seterr(e, TSYS_ERR_IO, "%s #%lld: rank %d (pid %d) exited before reaching it", tsys_dist__kind_names[c->kind], (long long)c->seq, q, (int)pq->pid);
                        return tsys_dist__shm_abort(d, e);
                    }
                }
            }
            if ((now - t0) * 1e-6 > d->timeout_s) {
                char late[160] = {0};
                size_t ll = 0;
                for (int q = 0; q < d->size && ll + 24 < sizeof late; q++) {
                    tsys_dist__shm_rank *pq = tsys_dist__shm_r(d, q);
                    if (TSYS_DIST__LOAD(&pq->step) < target) ll += (size_t)snprintf(late + ll, sizeof late - ll, "%s%d (pid %d)", ll ? ", " : "", q, (int)pq->pid);
                }
                tsys_dist__seterr(e, TSYS_ERR_IO, "%s #%lld: no reply from rank %s within %g s (stalled, or dead without a trace)",
                                  tsys_dist__kind_names[c->kind], (long long)c->seq, late, d->timeout_s);
                return tsys_dist__shm_abort(d, e);
            }
            if (now - t0 < 2000) sched_yield();
            else tsys_dist__nap_us(50);
        }
    }
    tsys_dist__spin_adapt(d, spins);
    return true;
}

// Every rank passes the next step (the pipeline's fence; a collective's barrier is tsys_dist__shm_coll).
static bool tsys_dist__shm_fence(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    uint64_t target = ++d->shm_step;
    TSYS_DIST__STORE(&tsys_dist__shm_r(d, d->rank)->step, target);
    return tsys_dist__shm_wait(d, target, c, e);
}

static bool tsys_dist__shm_coll(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    const int n = d->size, me = d->rank;
    const size_t es = tsys_dist__tsize(c->type);
    int64_t *desc = tsys_dist__shm_r(d, me)->desc[c->seq & 1];
    int64_t mine[8];
    tsys_dist__desc_of(c, mine);
    memcpy(desc, mine, sizeof mine);                      // published by the barrier's release store
    const int64_t total = c->kind == TSYS_DIST__BARRIER || c->check_only ? 0 : c->count;
    const int64_t per = c->kind == TSYS_DIST__RS ? (int64_t)(d->slice / (es * (size_t)n)) : (int64_t)(d->slice / es);
    const int64_t nslices = total > 0 ? (total + per - 1) / per : 1;
    char *in = (char *)c->in, *out = (char *)c->out;
    const void *srcs[512];
    for (int64_t k = 0; k < nslices; k++) {
        const int64_t off = k * per, len = total - off < per ? total - off : per;
        const int slot = (int)(d->shm_k++ & 1);
        char *mybuf = tsys_dist__shm_buf(d, slot, me);
        // all-reduce: each rank reduces one part of the slice (16-element aligned); it reads its own
        // part from its input directly, so only the other parts are published
        const int64_t q_per = ((len + n - 1) / n + 15) / 16 * 16;
        const int64_t a = (int64_t)me * q_per < len ? (int64_t)me * q_per : len, b = a + q_per < len ? a + q_per : len;
        if (len > 0) switch (c->kind) {
            case TSYS_DIST__ALLREDUCE:
                memcpy(mybuf, out + (size_t)off * es, (size_t)a * es);
                memcpy(mybuf + (size_t)b * es, out + (size_t)(off + b) * es, (size_t)(len - b) * es);
                break;
            case TSYS_DIST__BCAST: if (me == c->root) memcpy(mybuf, out + (size_t)off * es, (size_t)len * es); break;
            case TSYS_DIST__AG: memcpy(mybuf, in + (size_t)off * es, (size_t)len * es); break;
            case TSYS_DIST__RS:
                for (int q = 0; q < n; q++) memcpy(mybuf + (size_t)q * (size_t)per * es, in + ((size_t)q * (size_t)c->count + (size_t)off) * es, (size_t)len * es);
                break;
            default: break;
        }
        if (!tsys_dist__shm_fence(d, c, e)) return false;
        if (k == 0)
            for (int r = 0; r < n; r++) {
                int64_t other[8];
                memcpy(other, tsys_dist__shm_r(d, r)->desc[c->seq & 1], sizeof other);
                if (r != me && !tsys_dist__desc_agree(d, mine, other, r, e)) return false;   // every rank stops here
            }
        if (len <= 0) continue;
        switch (c->kind) {
        case TSYS_DIST__ALLREDUCE: {
            for (int r = 0; r < n; r++) srcs[r] = r == me ? out + (size_t)(off + a) * es : tsys_dist__shm_buf(d, slot, r) + (size_t)a * es;
            // the result goes to the slot (for the others) and over this rank's input (block by block,
            // each read before it is written)
            if (b > a) tsys_dist__reduce(c->type, c->op, mybuf + (size_t)a * es, out + (size_t)(off + a) * es, srcs, n, b - a);
            if (!tsys_dist__shm_fence(d, c, e)) return false;
            for (int r = 0; r < n; r++) {
                if (r == me) continue;
                int64_t ra = (int64_t)r * q_per < len ? (int64_t)r * q_per : len, rb = ra + q_per < len ? ra + q_per : len;
                if (rb > ra) memcpy(out + (size_t)(off + ra) * es, tsys_dist__shm_buf(d, slot, r) + (size_t)ra * es, (size_t)(rb - ra) * es);
            }
            break;
        }
        case TSYS_DIST__BCAST:
            if (me != c->root) memcpy(out + (size_t)off * es, tsys_dist__shm_buf(d, slot, c->root), (size_t)len * es);
            break;
        case TSYS_DIST__AG:
            for (int r = 0; r < n; r++) {
                char *dst = out + ((size_t)r * (size_t)c->count + (size_t)off) * es;
                const char *src = r == me ? in + (size_t)off * es : tsys_dist__shm_buf(d, slot, r);
                if (dst != src) memmove(dst, src, (size_t)len * es);
            }
            break;
        case TSYS_DIST__RS:
            for (int r = 0; r < n; r++) srcs[r] = tsys_dist__shm_buf(d, slot, r) + (size_t)me * (size_t)per * es;
            tsys_dist__reduce(c->type, c->op, out + (size_t)off * es, NULL, srcs, n, len);
            break;
        default: break;
        }
    }
    return true;
}

// The shared segment: rank 0 creates it (reserving the pages, so a small /dev/shm fails here and not
// with SIGBUS later), the others map it, all agree it worked, then the name is unlinked (the memory
// goes away with the last rank, even after a crash). Any failure leaves the path off, not the group.
static bool tsys_dist__shm_setup(tsys_dist *d, tsys_dist__err *e) {
    const size_t slice = tsys_dist__shm_slice_for(d->size, d->opt.shm_slice);
    size_t data_off = (TSYS_DIST__SHM_RANKS_OFF + sizeof(tsys_dist__shm_rank) * (size_t)d->size + 4095) / 4096 * 4096;
    size_t bytes = data_off + 2 * (size_t)d->size * slice;
    struct { char name[96]; int32_t ok; char why[92]; } msg;
    memset(&msg, 0, sizeof msg);
    int fd = -1;
    char *base = NULL;
    if (d->rank == 0) {
        snprintf(msg.name, sizeof msg.name, "/tsys_dist.%d.%llx", (int)getpid(), (unsigned long long)(tsys_time_us() * 1000) ^ (unsigned long long)(uintptr_t)d);
        fd = shm_open(msg.name, O_CREAT | O_EXCL | O_RDWR, 0600);
        int err = fd < 0 ? errno : 0;
        if (fd >= 0 && ftruncate(fd, (off_t)bytes) != 0) err = errno;
        if (fd >= 0 && !err) err = posix_fallocate(fd, 0, (off_t)bytes);
        if (fd >= 0 && !err) { base = (char *)mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); if (base == MAP_FAILED) { base = NULL; err = errno; } }
        if (err) snprintf(msg.why, sizeof msg.why, "%s (%zu bytes in /dev/shm)", strerror(err), bytes);
        msg.ok = base != NULL;
        if (base) {
            tsys_dist__shm_hdr *h = (tsys_dist__shm_hdr *)base;
            h->magic = 0x7473797364697374ull; h->size = d->size; h->slice = slice;
        }
    }
    if (!tsys_dist__setup_bcast(d, &msg, (int64_t)sizeof msg, 0, e)) { if (base) munmap(base, bytes); if (fd >= 0) { close(fd); shm_unlink(msg.name); } return false; }
    if (d->rank != 0 && msg.ok) {
        fd = shm_open(msg.name, O_RDWR, 0600);
        struct stat sb;
        if (fd >= 0 && fstat(fd, &sb) == 0 && (size_t)sb.st_size == bytes) {
            base = (char *)mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (base == MAP_FAILED) base = NULL;
        }
        if (!base) snprintf(msg.why, sizeof msg.why, "rank %d cannot map it: %s (another /dev/shm?)", d->rank, strerror(errno));
    }
    if (fd >= 0) close(fd);
    if (base) {
        tsys_dist__shm_rank *me = (tsys_dist__shm_rank *)(base + TSYS_DIST__SHM_RANKS_OFF + sizeof(tsys_dist__shm_rank) * (size_t)d->rank);
        me->pid = (int32_t)getpid();
    }
    int32_t failed = base != NULL ? 0 : 1;
    bool agreed = tsys_dist__setup_allreduce_i32(d, &failed, 1, TSYS_DIST_MAX, e);
    if (d->rank == 0 && msg.ok) shm_unlink(msg.name);   // everyone mapped it, or gave up
    if (!agreed) { if (base) munmap(base, bytes); return false; }
    if (failed) {
        if (base) munmap(base, bytes);
        snprintf(d->shm_note, sizeof d->shm_note, "shared memory off: %s", msg.why[0] ? msg.why : "a rank could not map the segment");
        return true;
    }
    d->shm_base = base; d->shm_bytes = bytes; d->slice = slice;
    d->shm_data = base + data_off;
    return true;
}

// The ranks whose pid is gone (the segment has every rank's).
static int tsys_dist__shm_dead_peers(tsys_dist *d, char *buf, size_t n) {
    int dead = 0;
    size_t l = 0;
    buf[0] = 0;
    for (int q = 0; q < d->size; q++) {
        if (q == d->rank) continue;
        const int pid = tsys_dist__shm_r(d, q)->pid;
        if (!tsys_dist__pid_dead(pid)) continue;
        dead++;
        if (l + 40 < n) l += (size_t)snprintf(buf + l, n - l, "%srank %d (pid %d)", l ? ", " : "", q, pid);
    }
    return dead;
}

static void tsys_dist__shm_teardown(tsys_dist *d, bool finalize, bool broken) {
    (void)finalize; (void)broken;
    if (d->shm_base) munmap(d->shm_base, d->shm_bytes);
    d->shm_base = NULL;
}

// A barrier is a collective without data here (the descriptors still agree).
static const tsys_dist__engine tsys_dist__engine_shm = { "shm", TSYS_DIST_ENGINE_AUTO, tsys_dist__shm_coll, tsys_dist__shm_coll, tsys_dist__shm_dead_peers, tsys_dist__shm_teardown };

// >>engine tcp ------------------------------------------------------------------------------------
// A star around rank 0, formed by the TCP rendezvous (tsys_dist__tcp_setup, in >>launch).
// Every collective starts with the descriptors: the ranks send theirs to rank 0, which compares
// them and answers everyone (ok, or the mismatch). Data then flows through rank 0 in 1 MiB chunks.
// Simple and deterministic (rank 0 reduces in rank order); for bandwidth across hosts use mpirun.

typedef struct tsys_dist__tcp_msg { uint32_t magic; int32_t status; int64_t desc[8]; char text[320]; } tsys_dist__tcp_msg;

static bool tsys_dist__tcp_io_t(tsys_dist *d, int peer, void *buf, size_t n, bool out, double timeout_s, const tsys_dist__coll *c, tsys_dist__err *e) {
    char who[48];
    snprintf(who, sizeof who, "rank %d", peer);
    int fd = d->rank == 0 ? d->fds[peer] : d->fds[0];
    if (tsys_dist__sock_io(fd, buf, n, out, timeout_s, who, e)) return true;
    char tmp[sizeof e->msg + 64];
    snprintf(tmp, sizeof tmp, "%s #%lld: %s", tsys_dist__kind_names[c->kind], (long long)c->seq, e->msg);
    tsys_dist__strcpy(e->msg, sizeof e->msg, tmp);
    tsys_dist__break(d, e);
    return false;
}
static bool tsys_dist__tcp_io(tsys_dist *d, int peer, void *buf, size_t n, bool out, const tsys_dist__coll *c, tsys_dist__err *e) {
    return tsys_dist__tcp_io_t(d, peer, buf, n, out, d->timeout_s, c, e);
}

static bool tsys_dist__tcp_coll(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    const int n = d->size, me = d->rank;
    const size_t es = tsys_dist__tsize(c->type);
    tsys_dist__tcp_msg m;
    memset(&m, 0, sizeof m);
    m.magic = TSYS_DIST__MAGIC;
    tsys_dist__desc_of(c, m.desc);
    if (me == 0) {
        tsys_dist__tcp_msg reply = m, got;
        tsys_dist__err mis;
        memset(&mis, 0, sizeof mis);
        for (int r = 1; r < n; r++) {
            if (!tsys_dist__tcp_io(d, r, &got, sizeof got, false, c, e)) {
                // tell the ranks waiting for the answer why (they cannot see rank r); best effort
                tsys_dist__tcp_msg bad = m;
                tsys_dist__err ignore;
                bad.status = 2;
                tsys_dist__strcpy(bad.text, sizeof bad.text, e->msg);
                for (int q = 1; q < n; q++) { memset(&ignore, 0, sizeof ignore); if (q != r) tsys_dist__sock_io(d->fds[q], &bad, sizeof bad, true, 1.0, "", &ignore); }
                return false;
            }
            if (got.magic != TSYS_DIST__MAGIC) return tsys_dist__seterr(e, TSYS_ERR_IO, "rank %d sent garbage", r);
            if (reply.status == 0 && !tsys_dist__desc_agree(d, m.desc, got.desc, r, &mis)) { reply.status = 1; tsys_dist__strcpy(reply.text, sizeof reply.text, mis.msg); }
        }
        for (int r = 1; r < n; r++) if (!tsys_dist__tcp_io(d, r, &reply, sizeof reply, true, c, e)) return false;
        if (reply.status) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "%s", reply.text);
    } else {
        if (!tsys_dist__tcp_io(d, 0, &m, sizeof m, true, c, e)) return false;
        // rank 0 answers once it heard from everyone: wait longer than it does, so that when a
        // third rank is missing, rank 0's report (naming it) arrives before this rank gives up
        if (!tsys_dist__tcp_io_t(d, 0, &m, sizeof m, false, d->timeout_s * 1.25 + 1, c, e)) return false;
        if (m.magic != TSYS_DIST__MAGIC) return tsys_dist__seterr(e, TSYS_ERR_IO, "rank 0 sent garbage");
        m.text[sizeof m.text - 1] = 0;
        if (m.status == 2) {   // rank 0 lost a rank: the group is done
            tsys_dist__seterr(e, TSYS_ERR_IO, "%s #%lld: rank 0 reports: %s", tsys_dist__kind_names[c->kind], (long long)c->seq, m.text);
            tsys_dist__break(d, e);
            return false;
        }
        if (m.status) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "%s", m.text);
    }
    if (c->check_only || c->kind == TSYS_DIST__BARRIER) return true;
    char *in = (char *)c->in, *out = (char *)c->out;
    const size_t count = (size_t)c->count;
    switch (c->kind) {
    case TSYS_DIST__ALLREDUCE: {
        const size_t per = TSYS_DIST__TCP_CHUNK / es;
        char *scratch = NULL;
        const void **srcs = NULL;
        if (me == 0 && count) {
            scratch = (char *)TSYS_MALLOC(TSYS_DIST__TCP_CHUNK * (size_t)(n - 1));
            srcs = (const void **)TSYS_MALLOC(sizeof(void *) * (size_t)n);
            if (!scratch || !srcs) { TSYS_FREE(scratch); TSYS_FREE((void *)srcs); return tsys_dist__seterr(e, TSYS_ERR_OOM, "all_reduce: out of host memory"); }
        }
        bool ok = true;
        for (size_t off = 0; ok && off < count; off += per) {
            size_t len = count - off < per ? count - off : per;
            char *p = out + off * es;
            if (me == 0) {
                srcs[0] = p;
                for (int r = 1; ok && r < n; r++) { srcs[r] = scratch + (size_t)(r - 1) * TSYS_DIST__TCP_CHUNK; ok = tsys_dist__tcp_io(d, r, (void *)srcs[r], len * es, false, c, e); }
                if (ok) tsys_dist__reduce(c->type, c->op, p, NULL, srcs, n, (int64_t)len);
                for (int r = 1; ok && r < n; r++) ok = tsys_dist__tcp_io(d, r, p, len * es, true, c, e);
            } else {
                ok = tsys_dist__tcp_io(d, 0, p, len * es, true, c, e) && tsys_dist__tcp_io(d, 0, p, len * es, false, c, e);
            }
        }
        TSYS_FREE(scratch);
        TSYS_FREE((void *)srcs);
        return ok;
    }
    case TSYS_DIST__BCAST:
        if (c->root != 0) {
            if (me == c->root && !tsys_dist__tcp_io(d, 0, out, count * es, true, c, e)) return false;
            if (me == 0 && !tsys_dist__tcp_io(d, c->root, out, count * es, false, c, e)) return false;
        }
        if (me == 0) { for (int r = 1; r < n; r++) if (r != c->root && !tsys_dist__tcp_io(d, r, out, count * es, true, c, e)) return false; }
        else if (me != c->root && !tsys_dist__tcp_io(d, 0, out, count * es, false, c, e)) return false;
        return true;
    case TSYS_DIST__AG:
        if (me == 0) {
            if (out != in) memmove(out, in, count * es);
            for (int r = 1; r < n; r++) if (!tsys_dist__tcp_io(d, r, out + (size_t)r * count * es, count * es, false, c, e)) return false;
            for (int r = 1; r < n; r++) if (!tsys_dist__tcp_io(d, r, out, (size_t)n * count * es, true, c, e)) return false;
            return true;
        }
        return tsys_dist__tcp_io(d, 0, in, count * es, true, c, e) && tsys_dist__tcp_io(d, 0, out, (size_t)n * count * es, false, c, e);
    case TSYS_DIST__RS: {
        if (me != 0) return tsys_dist__tcp_io(d, 0, in, (size_t)n * count * es, true, c, e) && tsys_dist__tcp_io(d, 0, out, count * es, false, c, e);
        // rank 0 reads every rank's blocks in the order they were sent, reduces block q for rank q,
        // and answers only once everything is in (a rank still sending cannot read yet)
        const size_t per = TSYS_DIST__TCP_CHUNK / es;
        char *scratch = (char *)TSYS_MALLOC(TSYS_DIST__TCP_CHUNK * (size_t)(n - 1) + (size_t)(n - 1) * count * es + 1);
        const void **srcs = (const void **)TSYS_MALLOC(sizeof(void *) * (size_t)n);
        if (!scratch || !srcs) { TSYS_FREE(scratch); TSYS_FREE((void *)srcs); return tsys_dist__seterr(e, TSYS_ERR_OOM, "reduce_scatter: out of host memory"); }
        char *res = scratch + TSYS_DIST__TCP_CHUNK * (size_t)(n - 1);
        bool ok = true;
        for (int q = 0; ok && q < n; q++)
            for (size_t off = 0; ok && off < count; off += per) {
                size_t len = count - off < per ? count - off : per;
                srcs[0] = in + ((size_t)q * count + off) * es;
                for (int r = 1; ok && r < n; r++) { srcs[r] = scratch + (size_t)(r - 1) * TSYS_DIST__TCP_CHUNK; ok = tsys_dist__tcp_io(d, r, (void *)srcs[r], len * es, false, c, e); }
                if (ok) tsys_dist__reduce(c->type, c->op, q == 0 ? out + off * es : res + ((size_t)(q - 1) * count + off) * es, NULL, srcs, n, (int64_t)len);
            }
        for (int r = 1; ok && r < n; r++) ok = tsys_dist__tcp_io(d, r, res + (size_t)(r - 1) * count * es, count * es, true, c, e);
        TSYS_FREE(scratch);
        TSYS_FREE((void *)srcs);
        return ok;
    }
    default: return true;
    }
}

// Rank 0 sees every rank's socket, the others rank 0's: a closed one is a peer gone.
static int tsys_dist__tcp_dead_peers(tsys_dist *d, char *buf, size_t n) {
    int dead = 0;
    size_t l = 0;
    buf[0] = 0;
    if (!d->fds) return 0;
    for (int q = 0; q < d->size; q++) {
        if (q == d->rank || (d->rank != 0 && q != 0)) continue;
        const int fd = d->rank == 0 ? d->fds[q] : d->fds[0];
        char c;
        const ssize_t k = fd >= 0 ? recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) : 1;
        if (!(k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))) continue;
        dead++;
        if (l + 40 < n) l += (size_t)snprintf(buf + l, n - l, "%srank %d", l ? ", " : "", q);
    }
    return dead;
}

static void tsys_dist__tcp_teardown(tsys_dist *d, bool finalize, bool broken) {
    (void)finalize; (void)broken;
    if (d->fds) { for (int r = 0; r < d->size; r++) if (d->fds[r] >= 0) close(d->fds[r]); TSYS_FREE(d->fds); d->fds = NULL; }
}

// A barrier is a collective without data here (the descriptors still agree).
static const tsys_dist__engine tsys_dist__engine_tcp = { "tcp", TSYS_DIST_ENGINE_TCP, tsys_dist__tcp_coll, tsys_dist__tcp_coll, tsys_dist__tcp_dead_peers, tsys_dist__tcp_teardown };

// >>engine mpi ------------------------------------------------------------------------------------
// Ranks started by mpirun / srun (tsys_dist__mpi_setup), on MPI_COMM_WORLD's duplicate.
// Every call is non-blocking and its wait polls MPI_Test against the group's timeout (a blocking
// MPI call cannot time out). Reductions happen here, in rank order (tsys_dist__mpi_allreduce).
#ifdef TSYS_DIST_MPI
static bool tsys_dist__mpi_ok(tsys_dist *d, int rc, const char *what, const tsys_dist__coll *c, tsys_dist__err *e) {
    if (rc == MPI_SUCCESS) return true;
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, s, &len);
    s[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = 0;
    tsys_dist__seterr(e, TSYS_ERR_IO, "%s #%lld: %s failed: %s (a peer died, or the MPI library failed)", c ? tsys_dist__kind_names[c->kind] : "setup", c ? (long long)c->seq : 0LL, what, s);
    tsys_dist__break(d, e);
    return false;
}

static bool tsys_dist__mpi_wait(tsys_dist *d, MPI_Request *req, const char *what, const tsys_dist__coll *c, tsys_dist__err *e) {
    double t0 = 0, last_check = 0;
    for (long spins = 0;; spins++) {
        int flag = 0;
        if (!tsys_dist__mpi_ok(d, MPI_Test(req, &flag, MPI_STATUS_IGNORE), what, c, e)) return false;
        if (flag) { tsys_dist__spin_adapt(d, spins); return true; }
        if (spins < d->spin_limit) { TSYS_DIST__RELAX(); continue; }
        double now = tsys_time_us();
        if (t0 == 0) t0 = last_check = now;
        char dead[160];
        if (d->shm_base && now - last_check > TSYS_DIST__DEAD_CHECK_US) {   // ranks on this host: name a dead one
            last_check = now;
            if (tsys_dist__dead_peers(d, dead, sizeof dead) > 0) {
                tsys_dist__seterr(e, TSYS_ERR_IO, "%s #%lld: %s exited", c ? tsys_dist__kind_names[c->kind] : what, c ? (long long)c->seq : 0LL, dead);
                tsys_dist__break(d, e);
                return false;
            }
        }
        if ((now - t0) * 1e-6 > d->timeout_s) {
            tsys_dist__seterr(e, TSYS_ERR_IO, "%s #%lld: no reply from the group within %g s (%s: a peer died or stalled; MPI does not say which)",
                              c ? tsys_dist__kind_names[c->kind] : what, c ? (long long)c->seq : 0LL, d->timeout_s, what);
            tsys_dist__break(d, e);   // the request stays posted: the group cannot be used again
            return false;
        }
        if (now - t0 < 2000) sched_yield();
        else tsys_dist__nap_us(50);
    }
}

static MPI_Datatype tsys_dist__mpi_type(int t) {
    switch (t) {
    case TSYS_F32: return MPI_FLOAT;
    case TSYS_BF16: case TSYS_F16: return MPI_UINT16_T;
    case TSYS_I32: return MPI_INT32_T;
    case TSYS_I64: return MPI_INT64_T;
    case TSYS_DIST__F64: return MPI_DOUBLE;
    default: return MPI_BYTE;
    }
}
// All-reduce and reduce-scatter run as an all-to-all (each rank receives its part of the data from
// every rank), a reduction in rank order on the receiving rank and, for all-reduce, an all-gather of
// the reduced parts: the bytes of a ring, and the sums in the order the shared-memory and TCP paths
// use, so every host engine gives the same bits (MPI's own reductions choose their order by size and
// rank count). Pieces of TSYS_DIST__MPI_PIECE bytes bound the scratch and keep MPI's counts ints.
#define TSYS_DIST__MPI_PIECE ((size_t)16 << 20)

static bool tsys_dist__mpi_run(tsys_dist *d, int rc, const char *what, MPI_Request *req, const tsys_dist__coll *c, tsys_dist__err *e) {
    return tsys_dist__mpi_ok(d, rc, what, c, e) && tsys_dist__mpi_wait(d, req, what, c, e);
}

// The part [*off, *off + return) of a piece of len elements that rank r reduces.
static int tsys_dist__mpi_part(int64_t len, int size, int r, int *off) {
    const int64_t q = (len + size - 1) / size, a = (int64_t)r * q < len ? (int64_t)r * q : len, b = a + q < len ? a + q : len;
    *off = (int)a;
    return (int)(b - a);
}

static bool tsys_dist__mpi_allreduce(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    const int n = d->size, me = d->rank;
    const size_t es = tsys_dist__tsize(c->type);
    const MPI_Datatype dt = tsys_dist__mpi_type(c->type);
    const int64_t per = (int64_t)(TSYS_DIST__MPI_PIECE / es);
    char *scratch = (char *)TSYS_MALLOC(TSYS_DIST__MPI_PIECE + (size_t)n * es);   // n parts of ceil(piece / n)
    int *cnt = (int *)TSYS_MALLOC(sizeof(int) * 5 * (size_t)n);
    const void **srcs = (const void **)TSYS_MALLOC(sizeof(void *) * (size_t)n);
    bool ok = scratch && cnt && srcs;
    if (!ok) tsys_dist__seterr(e, TSYS_ERR_OOM, "all_reduce #%lld: out of host memory for %zu bytes of scratch", (long long)c->seq, TSYS_DIST__MPI_PIECE);
    int *dsp = cnt + n, *scnt = cnt + 2 * n, *rcnt = cnt + 3 * n, *rdsp = cnt + 4 * n;
    MPI_Request req;
    for (int64_t off = 0; ok && off < c->count; off += per) {
        const int64_t len = c->count - off < per ? c->count - off : per;
        char *p = (char *)c->out + (size_t)off * es;
        for (int r = 0; r < n; r++) cnt[r] = tsys_dist__mpi_part(len, n, r, &dsp[r]);
        for (int r = 0; r < n; r++) {   // this rank's own part is read where it is, not sent to itself
            scnt[r] = r == me ? 0 : cnt[r];
            rcnt[r] = r == me ? 0 : cnt[me];
            rdsp[r] = r * cnt[me];
            srcs[r] = r == me ? p + (size_t)dsp[me] * es : scratch + (size_t)rdsp[r] * es;
        }
        ok = tsys_dist__mpi_run(d, MPI_Ialltoallv(p, scnt, dsp, dt, scratch, rcnt, rdsp, dt, d->comm, &req), "MPI_Ialltoallv", &req, c, e);
        if (ok) tsys_dist__reduce(c->type, c->op, p + (size_t)dsp[me] * es, NULL, srcs, n, cnt[me]);   // block by block: in place is safe
        ok = ok && tsys_dist__mpi_run(d, MPI_Iallgatherv(MPI_IN_PLACE, 0, dt, p, cnt, dsp, dt, d->comm, &req), "MPI_Iallgatherv", &req, c, e);
    }
    TSYS_FREE(scratch); TSYS_FREE(cnt); TSYS_FREE((void *)srcs);
    return ok;
}

// Reduce-scatter: each rank receives its block of every other rank's input and reduces them with its
// own in rank order. The displacements into `in` are ints: inputs of more than 2^31 elements are
// packed piece by piece first.
static bool tsys_dist__mpi_reduce_scatter(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    const int n = d->size, me = d->rank;
    const size_t es = tsys_dist__tsize(c->type), ob = (size_t)c->count * es;
    const MPI_Datatype dt = tsys_dist__mpi_type(c->type);
    const int64_t per = (int64_t)(TSYS_DIST__MPI_PIECE / es / (size_t)n);   // elements of each rank's block per round
    const bool packed = (int64_t)n * c->count > INT32_MAX;
    const char *in = (const char *)c->in;
    char *out = (char *)c->out;
    // out inside in (in place, as ZeRO may do it): reduced into a copy, so no unread input is overwritten
    const bool overlap = out < in + (size_t)n * ob && in < out + ob;
    char *dst = overlap ? (char *)TSYS_MALLOC(ob ? ob : 1) : out;
    char *scratch = (char *)TSYS_MALLOC((packed ? 2 : 1) * TSYS_DIST__MPI_PIECE), *pack = packed && scratch ? scratch + TSYS_DIST__MPI_PIECE : NULL;
    int *cnt = (int *)TSYS_MALLOC(sizeof(int) * 4 * (size_t)n);
    const void **srcs = (const void **)TSYS_MALLOC(sizeof(void *) * (size_t)n);
    bool ok = dst && scratch && cnt && srcs;
    if (!ok) tsys_dist__seterr(e, TSYS_ERR_OOM, "reduce_scatter #%lld: out of host memory for its scratch", (long long)c->seq);
    int *scnt = cnt, *sdsp = cnt + n, *rcnt = cnt + 2 * n, *rdsp = cnt + 3 * n;
    MPI_Request req;
    for (int64_t off = 0; ok && off < c->count; off += per) {
        const int64_t len = c->count - off < per ? c->count - off : per;
        for (int r = 0; r < n; r++) {
            const char *mine = in + ((size_t)r * (size_t)c->count + (size_t)off) * es;   // this rank's input for rank r
            if (packed) memcpy(pack + (size_t)r * (size_t)len * es, mine, (size_t)len * es);
            scnt[r] = rcnt[r] = r == me ? 0 : (int)len;
            sdsp[r] = packed ? r * (int)len : (int)((int64_t)r * c->count + off);
            rdsp[r] = r * (int)len;
            srcs[r] = r == me ? (const void *)(in + ((size_t)me * (size_t)c->count + (size_t)off) * es) : scratch + (size_t)r * (size_t)len * es;
        }
        ok = tsys_dist__mpi_run(d, MPI_Ialltoallv(packed ? pack : in, scnt, sdsp, dt, scratch, rcnt, rdsp, dt, d->comm, &req), "MPI_Ialltoallv", &req, c, e);
        if (ok) tsys_dist__reduce(c->type, c->op, dst + (size_t)off * es, NULL, srcs, n, len);
    }
    if (ok && overlap) memcpy(out, dst, ob);
    if (overlap) TSYS_FREE(dst);
    TSYS_FREE(scratch); TSYS_FREE(cnt); TSYS_FREE((void *)srcs);
    return ok;
}

static bool tsys_dist__mpi_coll(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    const size_t es = tsys_dist__tsize(c->type);
    MPI_Request req;
    if (c->check_only || c->check) {
        // everyone's descriptor to everyone: a mismatch names the ranks (MPI would hang or truncate)
        int64_t mine[8];
        tsys_dist__desc_of(c, mine);
        int64_t *all = (int64_t *)TSYS_MALLOC(sizeof mine * (size_t)d->size);
        if (!all) return tsys_dist__seterr(e, TSYS_ERR_OOM, "out of host memory");
        bool ok = tsys_dist__mpi_ok(d, MPI_Iallgather(mine, 8, MPI_INT64_T, all, 8, MPI_INT64_T, d->comm, &req), "MPI_Iallgather", c, e) &&
                  tsys_dist__mpi_wait(d, &req, "MPI_Iallgather", c, e);
        for (int r = 0; ok && r < d->size; r++) ok = r == d->rank || tsys_dist__desc_agree(d, mine, all + 8 * r, r, e);
        TSYS_FREE(all);
        if (!ok) return false;
    }
    if (c->check_only) return true;
    MPI_Datatype dt = tsys_dist__mpi_type(c->type);
    char *in = (char *)c->in, *out = (char *)c->out;
    const int64_t max_count = (int64_t)1 << 30;   // MPI counts are ints: long buffers go in pieces
    switch (c->kind) {
    case TSYS_DIST__ALLREDUCE: return tsys_dist__mpi_allreduce(d, c, e);
    case TSYS_DIST__RS: return tsys_dist__mpi_reduce_scatter(d, c, e);
    case TSYS_DIST__BCAST:
        for (int64_t off = 0; off < c->count || (off == 0 && c->count == 0); off += max_count) {
            int cnt = (int)(c->count - off < max_count ? c->count - off : max_count);
            if (!tsys_dist__mpi_run(d, MPI_Ibcast(out + (size_t)off * es, cnt, dt, c->root, d->comm, &req), "MPI_Ibcast", &req, c, e)) return false;
            if (c->count == 0) break;
        }
        return true;
    case TSYS_DIST__AG: {
        if (c->count > INT32_MAX) return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "all_gather: %lld elements per rank is more than one MPI call takes", (long long)c->count);
        const void *send = in == out + (size_t)d->rank * (size_t)c->count * es ? MPI_IN_PLACE : (const void *)in;
        return tsys_dist__mpi_ok(d, MPI_Iallgather(send, (int)c->count, dt, out, (int)c->count, dt, d->comm, &req), "MPI_Iallgather", c, e) &&
               tsys_dist__mpi_wait(d, &req, "MPI_Iallgather", c, e);
    }
    default:
        return tsys_dist__mpi_ok(d, MPI_Ibarrier(d->comm, &req), "MPI_Ibarrier", c, e) && tsys_dist__mpi_wait(d, &req, "MPI_Ibarrier", c, e);
    }
}

// A broken group leaves MPI alone: a posted request may never finish, so MPI_Finalize could hang.
// The program is expected to exit with an error, which ends the job.
static void tsys_dist__mpi_teardown(tsys_dist *d, bool finalize, bool broken) {
    if (!broken) {
        if (d->have_comm) MPI_Comm_free(&d->comm);
        int fin = 0;
        MPI_Finalized(&fin);
        if (finalize && d->mpi_owner && !fin) MPI_Finalize();
    }
    d->have_comm = false;
}

// A barrier is a collective without data here (MPI_Ibarrier, after the descriptors when checked).
static const tsys_dist__engine tsys_dist__engine_mpi = { "mpi", TSYS_DIST_ENGINE_MPI, tsys_dist__mpi_coll, tsys_dist__mpi_coll, NULL, tsys_dist__mpi_teardown };

static bool tsys_dist__mpi_setup(tsys_dist *d, tsys_dist__err *e) {
    int inited = 0, finalized = 0, prov = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (finalized) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "MPI was finalized already (the group that initialized it was freed): MPI cannot start twice in a process");
    if (!inited) {
        // MULTIPLE: each group's worker thread makes its own MPI calls, and several groups may be busy at once
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &prov);
        if (rc != MPI_SUCCESS) return tsys_dist__seterr(e, TSYS_ERR_IO, "MPI_Init_thread failed (code %d)", rc);
        d->mpi_owner = true;
    }
    if (!tsys_dist__mpi_ok(d, MPI_Query_thread(&prov), "MPI_Query_thread", NULL, e)) return false;
    d->mpi_multiple = prov >= MPI_THREAD_MULTIPLE;
    if (!tsys_dist__mpi_ok(d, MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", NULL, e)) return false;
    if (!tsys_dist__mpi_ok(d, MPI_Comm_dup(MPI_COMM_WORLD, &d->comm), "MPI_Comm_dup", NULL, e)) return false;
    d->have_comm = true;
    MPI_Comm local;
    if (!tsys_dist__mpi_ok(d, MPI_Comm_set_errhandler(d->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", NULL, e) ||
        !tsys_dist__mpi_ok(d, MPI_Comm_rank(d->comm, &d->rank), "MPI_Comm_rank", NULL, e) ||
        !tsys_dist__mpi_ok(d, MPI_Comm_size(d->comm, &d->size), "MPI_Comm_size", NULL, e) ||
        !tsys_dist__mpi_ok(d, MPI_Comm_split_type(d->comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local), "MPI_Comm_split_type", NULL, e)) return false;
    bool ok = tsys_dist__mpi_ok(d, MPI_Comm_rank(local, &d->local_rank), "MPI_Comm_rank", NULL, e) &&
              tsys_dist__mpi_ok(d, MPI_Comm_size(local, &d->local_size), "MPI_Comm_size", NULL, e);
    MPI_Comm_free(&local);
    if (!ok) return false;
    d->one_host = d->local_size == d->size;
    d->launch = &tsys_dist__engine_mpi;
    return true;
}
#endif

// ascending doubles (qsort): the probes' medians
static int tsys_dist__cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Bytes [off, off + len) of a block.
typedef struct tsys_dist__run { int64_t off, len; } tsys_dist__run;

// >>engine nccl -----------------------------------------------------------------------------------
// CUDA tensors of a group whose ranks each have a GPU: NCCL on the compute and side streams. Host
// tensors of the group still go the host engine's way.
#ifdef TSYS_DIST_NCCL
static bool tsys_dist__nccl_ok(tsys_dist *d, ncclResult_t r, const char *what, tsys_dist__err *e) {
    if (r == ncclSuccess || r == ncclInProgress) return true;
    const char *last = d->nccl ? ncclGetLastError(d->nccl) : NULL;
    tsys_dist__seterr(e, TSYS_ERR_NCCL, "%s: %s%s%s", what, ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
    tsys_dist__break(d, e);
    return false;
}
// A non-blocking communicator: waits (host side, bounded by the timeout) until the last call is
// through; on timeout the communicator is aborted.
static bool tsys_dist__nccl_settle(tsys_dist *d, const char *what, tsys_dist__err *e) {
    double t0 = tsys_time_us();
    for (;;) {
        ncclResult_t st = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(d->nccl, &st);
        if (r != ncclSuccess) return tsys_dist__nccl_ok(d, r, what, e);
        if (st != ncclInProgress) return tsys_dist__nccl_ok(d, st, what, e);
        if ((tsys_time_us() - t0) * 1e-6 > d->timeout_s) {
            tsys_dist__seterr(e, TSYS_ERR_NCCL, "%s: NCCL did not finish within %g s (a peer died or stalled); communicator aborted", what, d->timeout_s);
            tsys_dist__break(d, e);
            ncclCommAbort(d->nccl);
            d->nccl = NULL;
            return false;
        }
        // a collective is enqueued within tens of microseconds: poll without sleeping for the first 0.5 ms
        // (napping 100 us after a spin count put ~100 us of jitter on small collectives, measured on
        // 2 x H100), then nap briefly: a late peer gets the CPU back
        if (tsys_time_us() - t0 > 500.0) tsys_dist__nap_us(20);
    }
}
// A GPU rank bound to one CPU (mpirun's default for 2 ranks, --bind-to core) shares it with NCCL's
// proxy thread and the CUDA driver's: measured on 2 x H200, every all-reduce up to 10 MB then takes
// ~0.21 ms instead of 0.06. Rank 0 says so once; the results are right either way.
static void tsys_dist__warn_one_cpu(const tsys_dist *d) {
#ifdef __linux__
    cpu_set_t set;
    if (d->rank != 0 || sched_getaffinity(0, sizeof set, &set) != 0 || CPU_COUNT(&set) != 1 || sysconf(_SC_NPROCESSORS_ONLN) < 2) return;
    fprintf(stderr, "tsys_dist: rank 0 runs on one CPU (mpirun binds each rank to a core by default); NCCL's proxy thread shares it and "
                    "small collectives wait ~0.2 ms for it: launch GPU ranks with --bind-to none (or --bind-to socket)\n");
#else
    (void)d;
#endif
}
// The communicator is blocking (NCCL's default, as torch's): a non-blocking one, whose every call is polled
// with ncclCommGetAsyncError, made each collective ~50 us slower (2 x H200, 1 MB all-reduce: 80 us against
// 31). Its creation, the step that waits for every peer, still cannot hang: it runs on a helper thread that
// tsys_dist__nccl_setup waits for with the group's timeout. desc.nccl_nonblocking (TSYS_DIST_NCCL_BLOCKING=0)
// asks for the non-blocking communicator.
typedef struct tsys_dist__nccl_init {
    ncclUniqueId id;
    int size, rank, device, blocking;
    ncclComm_t comm;
    ncclResult_t r;
    int done;   // set last, with release order
} tsys_dist__nccl_init;
static void *tsys_dist__nccl_init_main(void *arg) {
    tsys_dist__nccl_init *a = (tsys_dist__nccl_init *)arg;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = a->blocking;
    a->r = cudaSetDevice(a->device) == cudaSuccess ? ncclCommInitRankConfig(&a->comm, a->size, a->id, a->rank, &cfg) : ncclUnhandledCudaError;
    __atomic_store_n(&a->done, 1, __ATOMIC_RELEASE);
    return NULL;
}
static bool tsys_dist__nccl_setup(tsys_dist *d, tsys_dist__err *e) {
    tsys_dist__nccl_init *a = (tsys_dist__nccl_init *)calloc(1, sizeof *a);   // the helper may outlive a timeout
    if (!a) return tsys_dist__seterr(e, TSYS_ERR_OOM, "NCCL setup: out of host memory");
    if (d->rank == 0 && !tsys_dist__nccl_ok(d, ncclGetUniqueId(&a->id), "ncclGetUniqueId", e)) { free(a); return false; }
    if (d->size > 1 && !tsys_dist__setup_bcast(d, &a->id, (int64_t)sizeof a->id, 0, e)) { free(a); return false; }
    a->size = d->size; a->rank = d->rank; a->blocking = d->opt.nccl_nonblocking ? 0 : 1;
    if (cudaGetDevice(&a->device) != cudaSuccess) { free(a); return tsys_dist__seterr(e, TSYS_ERR_CUDA, "NCCL setup: cudaGetDevice failed"); }
    pthread_t th;
    if (pthread_create(&th, NULL, tsys_dist__nccl_init_main, a) != 0) { free(a); return tsys_dist__seterr(e, TSYS_ERR_IO, "NCCL setup: pthread_create failed"); }
    const double t0 = tsys_time_us();
    while (!__atomic_load_n(&a->done, __ATOMIC_ACQUIRE)) {
        if ((tsys_time_us() - t0) * 1e-6 > d->timeout_s) {   // the helper stays blocked in NCCL; the group is broken
            pthread_detach(th);
            tsys_dist__seterr(e, TSYS_ERR_NCCL, "ncclCommInitRankConfig: the group did not form within %g s (a peer died or stalled)", d->timeout_s);
            tsys_dist__break(d, e);
            return false;
        }
        tsys_dist__nap_us(200);
    }
    pthread_join(th, NULL);
    const ncclResult_t r = a->r;
    d->nccl = a->comm;
    free(a);
    if (!tsys_dist__nccl_ok(d, r, "ncclCommInitRankConfig", e)) { if (d->nccl) ncclCommAbort(d->nccl); d->nccl = NULL; return false; }
    if (!tsys_dist__nccl_ok(d, ncclGetVersion(&d->nccl_version), "ncclGetVersion", e)) return false;
    return r != ncclInProgress || tsys_dist__nccl_settle(d, "ncclCommInitRankConfig (the group did not form)", e);
}

// ---- all-reduces on the copy engines (desc.ce_allreduce) -------------------------------------------
// An fp32 sum (or average) of a CUDA tensor among ranks on one host, moved by the copy engines instead of NCCL's kernels:
// those take SMs for as long as they run, and backward's GEMMs beside them ran ~1.9x their time alone against
// ~1.35x beside these copies (dev/ce_lab.cu, 2 x H200). The tensor goes in two or more equal pieces of at most
// TSYS_DIST__CE_PIECE_MB, one chunk a rank; piece k uses slot k % 2 of every rank's scratch, which holds an in-row
// [slot][rank] for every rank and one out-row [slot]:
//   scatter  I push my copy of chunk q into rank q's in-row [slot][me]
//   sum      I add the in-rows to my chunk, in rank order (the same bits on every rank, however many), writing the
//            sum into my chunk and into my out-row [slot]
//   collect  I pull rank q's sum from its out-row [slot] into my chunk q
// Ranks order each other through flags. Each lives in the memory of the rank that waits on it, is raised behind
// the data (by a 4-byte copy in the raiser's copy lane, or by the last block of its sum) and is cleared by the
// kernel that waited for it (tsys_dist__ce_take), so a collective leaves every flag as it found it and the
// sequence can be captured. A wait longer than the group's timeout traps: the context reports a launch failure
// at its next sync. Each piece costs a few launches in a chain; pieces of 16 MiB lost ~10 ms of xl's step to them.
#ifndef TSYS_DIST__CE_PIECE_MB
#define TSYS_DIST__CE_PIECE_MB 128
#endif
#define TSYS_DIST__CE_MIN ((int64_t)1 << 20)   // smaller all-reduces stay with NCCL, whose latency is lower
enum { TSYS_DIST__CE_SLOTS = 2, TSYS_DIST__CE_RANKS = 8 };
typedef struct tsys_dist__ce_flags {                          // one rank's, in its memory: [peer][slot], raised by the peer
    uint32_t in_ready[TSYS_DIST__CE_RANKS][TSYS_DIST__CE_SLOTS];   // it pushed its chunk into my in-row
    uint32_t in_space[TSYS_DIST__CE_RANKS][TSYS_DIST__CE_SLOTS];   // it summed: my in-row at it is free
    uint32_t out_ready[TSYS_DIST__CE_RANKS][TSYS_DIST__CE_SLOTS];  // its sum is in its out-row
    uint32_t out_space[TSYS_DIST__CE_RANKS][TSYS_DIST__CE_SLOTS];  // it pulled my sum: my out-row is free for it
    uint32_t one;                                             // what a raise copies
    uint32_t sum_blocks;                                      // the sum's blocks done (the last one raises, then resets it)
} tsys_dist__ce_flags;
typedef struct tsys_dist__ce_raises { uint32_t *flag[2 * TSYS_DIST__CE_RANKS]; int count; } tsys_dist__ce_raises;
typedef struct tsys_dist__ce {
    char *scratch[TSYS_DIST__CE_RANKS];           // every rank's: mine at [rank], the peers' opened through IPC
    tsys_dist__ce_flags *flags[TSYS_DIST__CE_RANKS];
    cudaStream_t lane[2 * TSYS_DIST__CE_RANKS];    // [2 q]: scatters to rank q, [2 q + 1]: collects from it (a copy engine
    cudaEvent_t fork, lane_done[2 * TSYS_DIST__CE_RANKS];   // each at a time); forked from the collective's stream
    int64_t pieces;                                // pieces issued so far: the next one's slot
} tsys_dist__ce;
typedef struct tsys_dist__ce_handles { cudaIpcMemHandle_t scratch, flags; } tsys_dist__ce_handles;

// Waits until the count flags f[i * stride] and, when g, the count flags g[i * stride] (i != skip) are 1,
// clearing each.
__global__ void tsys_dist__ce_take_kernel(uint32_t *f, uint32_t *g, int count, int stride, int skip, unsigned long long timeout_ns) {
    const int i = (int)threadIdx.x % 32;
    uint32_t *set = threadIdx.x < 32 ? f : g;
    if (!set || i >= count || i == skip) return;
    volatile uint32_t *x = set + (size_t)i * stride;
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
    while (*x != 1u) {
        __nanosleep(500);
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
        if (t - t0 > timeout_ns) __trap();
    }
    *x = 0u;
}
// own[i] = out[i] = the sum over ranks r, in rank order, of (r == me ? own : row r)[i], divided by n when avg (as
// the host paths do it); the last block to finish raises the peers' flags, after its writes are visible to them.
__global__ void tsys_dist__ce_sum_kernel(float *own, float *out, const float *rows, int64_t row_elems, int n, int me, int64_t count, bool avg,
                                         uint32_t *blocks_done, tsys_dist__ce_raises raises) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < n; r++) acc += r == me ? own[i] : rows[r * row_elems + i];
        own[i] = out[i] = avg ? __fdiv_rn(acc, (float)n) : acc;
    }
    __threadfence_system();
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence_system();
    if ((int)threadIdx.x < raises.count) *(volatile uint32_t *)raises.flag[threadIdx.x] = 1u;
    if (threadIdx.x == 0) *blocks_done = 0u;
}

static bool tsys_dist__ce_cuda(cudaError_t r, const char *what, tsys_dist__err *e) {
    return r == cudaSuccess || tsys_dist__seterr(e, TSYS_ERR_CUDA, "copy-engine all-reduce: %s: %s", what, cudaGetErrorString(r));
}
// A lane of the copy-engine collectives: at the compute stream's priority (the greatest), so that its
// flag-waiting kernels are not held back behind backward's kernels.
static cudaError_t tsys_dist__lane_make(cudaStream_t *lane) {
    int least = 0, greatest = 0;
    cudaError_t r = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    return r != cudaSuccess ? r : cudaStreamCreateWithPriority(lane, cudaStreamNonBlocking, greatest);
}
// A row's bytes: a piece's share for one rank, a multiple of 256.
static int64_t tsys_dist__ce_row_bytes(int ranks) { return ((int64_t)TSYS_DIST__CE_PIECE_MB << 20) / ranks / 256 * 256; }
// Byte offsets in a scratch of the in-row [slot][rank] and of the out-row [slot]; its size is in_row(SLOTS, 0).
static int64_t tsys_dist__ce_in_row(const tsys_dist *d, int64_t slot, int rank) { return (slot * (d->size + 1) + rank) * tsys_dist__ce_row_bytes(d->size); }
static int64_t tsys_dist__ce_out_row(const tsys_dist *d, int64_t slot) { return tsys_dist__ce_in_row(d, slot, d->size); }

// Made with the communicator when desc.ce_allreduce is set: every rank's scratch and flags opened by every other.
static bool tsys_dist__ce_setup(tsys_dist *d, tsys_dist__err *e) {
    if (!d->one_host) return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "desc.ce_allreduce (TSYS_DIST_CE=1): the ranks are on several hosts; the copy engines reach only this host's GPUs");
    if (d->size > TSYS_DIST__CE_RANKS)
        return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "desc.ce_allreduce (TSYS_DIST_CE=1): %d ranks, at most %d", d->size, (int)TSYS_DIST__CE_RANKS);
    if (d->size == 1) return true;   // nothing to move: NCCL's all-reduce of one rank is a copy at most
    tsys_dist__ce *ce = (tsys_dist__ce *)calloc(1, sizeof *ce);
    if (!ce) return tsys_dist__seterr(e, TSYS_ERR_OOM, "copy-engine all-reduce: out of host memory");
    d->ce = ce;
    const size_t bytes = (size_t)tsys_dist__ce_in_row(d, TSYS_DIST__CE_SLOTS, 0);
    tsys_dist__ce_flags init;
    memset(&init, 0, sizeof init);
    for (int p = 0; p < TSYS_DIST__CE_RANKS; p++)
        for (int k = 0; k < TSYS_DIST__CE_SLOTS; k++) init.in_space[p][k] = init.out_space[p][k] = 1;   // every row starts free
    init.one = 1;
    tsys_dist__ce_handles mine, theirs;
    if (!tsys_dist__ce_cuda(cudaMalloc((void **)&ce->scratch[d->rank], bytes), "cudaMalloc (scratch)", e) ||
        !tsys_dist__ce_cuda(cudaMalloc((void **)&ce->flags[d->rank], sizeof init), "cudaMalloc (flags)", e) ||
        !tsys_dist__ce_cuda(cudaMemcpy(ce->flags[d->rank], &init, sizeof init, cudaMemcpyHostToDevice), "cudaMemcpy (flags)", e) ||
        !tsys_dist__ce_cuda(cudaIpcGetMemHandle(&mine.scratch, ce->scratch[d->rank]), "cudaIpcGetMemHandle (scratch)", e) ||
        !tsys_dist__ce_cuda(cudaIpcGetMemHandle(&mine.flags, ce->flags[d->rank]), "cudaIpcGetMemHandle (flags)", e))
        return false;
    for (int r = 0; r < d->size; r++) {
        memset(&theirs, 0, sizeof theirs);
        if (r == d->rank) theirs = mine;
        if (!tsys_dist__setup_bcast(d, &theirs, (int64_t)sizeof theirs, r, e)) return false;
        if (r == d->rank) continue;
        if (!tsys_dist__ce_cuda(cudaIpcOpenMemHandle((void **)&ce->scratch[r], theirs.scratch, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's scratch)", e) ||
            !tsys_dist__ce_cuda(cudaIpcOpenMemHandle((void **)&ce->flags[r], theirs.flags, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's flags)", e))
            return false;
    }
    if (!tsys_dist__ce_cuda(cudaEventCreateWithFlags(&ce->fork, cudaEventDisableTiming), "cudaEventCreateWithFlags", e)) return false;
    for (int i = 0; i < 2 * d->size; i++)
        if (!tsys_dist__ce_cuda(cudaEventCreateWithFlags(&ce->lane_done[i], cudaEventDisableTiming), "cudaEventCreateWithFlags", e) ||
            !tsys_dist__ce_cuda(tsys_dist__lane_make(&ce->lane[i]), "cudaStreamCreateWithPriority", e))
            return false;
    return true;
}

// synced: every rank drained its collectives (a peer may raise a flag of mine until then), and a barrier then
// separates the closing of the peers' memory from the freeing of mine. Errors go nowhere: the group is going.
static void tsys_dist__ce_teardown(tsys_dist *d, bool synced) {
    tsys_dist__ce *ce = d->ce;
    if (!ce) return;
    for (int r = 0; r < d->size; r++) {
        if (r == d->rank) continue;
        if (ce->scratch[r]) cudaIpcCloseMemHandle(ce->scratch[r]);
        if (ce->flags[r]) cudaIpcCloseMemHandle(ce->flags[r]);
    }
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    int32_t one = 1;
    if (synced) tsys_dist__setup_allreduce_i32(d, &one, 1, TSYS_DIST_SUM, &e);
    if (ce->scratch[d->rank]) cudaFree(ce->scratch[d->rank]);
    if (ce->flags[d->rank]) cudaFree(ce->flags[d->rank]);
    if (ce->fork) cudaEventDestroy(ce->fork);
    for (int i = 0; i < 2 * TSYS_DIST__CE_RANKS; i++) {
        if (ce->lane_done[i]) cudaEventDestroy(ce->lane_done[i]);
        if (ce->lane[i]) cudaStreamDestroy(ce->lane[i]);
    }
    free(ce);
    d->ce = NULL;
}

// Waits on s for the flags f[i * stride] and, when g, g[i * stride] (i < count, i != skip), clearing them.
static bool tsys_dist__ce_take(tsys_dist *d, cudaStream_t s, uint32_t *f, uint32_t *g, int count, int stride, int skip, tsys_dist__err *e) {
    tsys_dist__ce_take_kernel<<<1, g ? 64 : 32, 0, s>>>(f, g, count, stride, skip, (unsigned long long)(d->timeout_s * 1e9));
    return tsys_dist__ce_cuda(cudaGetLastError(), "the flag wait's launch", e);
}
static bool tsys_dist__ce_raise(tsys_dist *d, cudaStream_t s, uint32_t *peer_flag, tsys_dist__err *e) {
    return tsys_dist__ce_cuda(cudaMemcpyAsync(peer_flag, &d->ce->flags[d->rank]->one, 4, cudaMemcpyDeviceToDevice, s), "a flag's raise", e);
}
static bool tsys_dist__ce_copy(void *dst, const void *src, int64_t bytes, cudaStream_t s, tsys_dist__err *e) {
    return bytes == 0 || tsys_dist__ce_cuda(cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDeviceToDevice, s), "a chunk's copy", e);
}

// One piece of n elements at x: chunk q is [q c, min((q + 1) c, n)), c = ceil(n / size); an empty chunk has
// no pushes and no flags on any rank. Scatters and collects have lanes (streams) of their own, one a peer (copies
// on one stream run one after another: 4 ranks took twice NCCL's time so), and the sums run on
// s, so a piece's sum waits for its scatters only, not for the previous piece's collects.
static bool tsys_dist__ce_piece(tsys_dist *d, float *x, int64_t n, bool avg, cudaStream_t s, tsys_dist__err *e) {
    tsys_dist__ce *ce = d->ce;
    const int me = d->rank, size = d->size;
    const int64_t slot = ce->pieces++ % TSYS_DIST__CE_SLOTS, c = (n + size - 1) / size;
#define TSYS_DIST__CE_LEN(q) ((q) * c >= n ? 0 : ((q) + 1) * c > n ? n - (q) * c : c)
    for (int q = 0; q < size; q++) {
        if (q == me || TSYS_DIST__CE_LEN(q) == 0) continue;
        cudaStream_t scatter = ce->lane[2 * q];
        if (!tsys_dist__ce_take(d, scatter, &ce->flags[me]->in_space[q][slot], NULL, 1, 1, -1, e) ||
            !tsys_dist__ce_copy(ce->scratch[q] + tsys_dist__ce_in_row(d, slot, me), x + q * c, TSYS_DIST__CE_LEN(q) * 4, scatter, e) ||
            !tsys_dist__ce_raise(d, scatter, &ce->flags[q]->in_ready[me][slot], e))
            return false;
    }
    const int64_t mine = TSYS_DIST__CE_LEN(me);
    if (mine > 0) {   // every peer's chunk is in and every peer pulled my previous sum from this slot
        if (!tsys_dist__ce_take(d, s, &ce->flags[me]->in_ready[0][slot], &ce->flags[me]->out_space[0][slot], size, TSYS_DIST__CE_SLOTS, me, e))
            return false;
        tsys_dist__ce_raises raises;
        memset(&raises, 0, sizeof raises);
        for (int q = 0; q < size; q++)
            if (q != me) {
                raises.flag[raises.count++] = &ce->flags[q]->in_space[me][slot];
                raises.flag[raises.count++] = &ce->flags[q]->out_ready[me][slot];
            }
        const int64_t blocks = (mine + 255) / 256 < 1024 ? (mine + 255) / 256 : 1024;
        tsys_dist__ce_sum_kernel<<<(unsigned)blocks, 256, 0, s>>>(x + me * c, (float *)(ce->scratch[me] + tsys_dist__ce_out_row(d, slot)),
                                                                   (const float *)(ce->scratch[me] + tsys_dist__ce_in_row(d, slot, 0)),
                                                                   tsys_dist__ce_row_bytes(size) / 4, size, me, mine, avg, &ce->flags[me]->sum_blocks, raises);
        if (!tsys_dist__ce_cuda(cudaGetLastError(), "the sum's launch", e)) return false;
    }
    // a pull overwrites chunk q after my scatter read it: q summed after my push arrived
    for (int q = 0; q < size; q++) {
        if (q == me || TSYS_DIST__CE_LEN(q) == 0) continue;
        cudaStream_t collect = ce->lane[2 * q + 1];
        if (!tsys_dist__ce_take(d, collect, &ce->flags[me]->out_ready[q][slot], NULL, 1, 1, -1, e) ||
            !tsys_dist__ce_copy(x + q * c, ce->scratch[q] + tsys_dist__ce_out_row(d, slot), TSYS_DIST__CE_LEN(q) * 4, collect, e) ||
            !tsys_dist__ce_raise(d, collect, &ce->flags[q]->out_space[me][slot], e))
            return false;
    }
#undef TSYS_DIST__CE_LEN
    return true;
}

// The whole all-reduce on s: pieces in order, the lanes forked from s before and joined to it after.
static bool tsys_dist__ce_allreduce(tsys_dist *d, float *x, int64_t count, bool avg, cudaStream_t s, tsys_dist__err *e) {
    tsys_dist__ce *ce = d->ce;
    const int64_t full = tsys_dist__ce_row_bytes(d->size) / 4 * d->size;
    if (!tsys_dist__ce_cuda(cudaEventRecord(ce->fork, s), "cudaEventRecord", e)) return false;
    for (int i = 0; i < 2 * d->size; i++)
        if (i / 2 != d->rank && !tsys_dist__ce_cuda(cudaStreamWaitEvent(ce->lane[i], ce->fork, 0), "cudaStreamWaitEvent", e)) return false;
    // equal pieces, two at least: the first's scatter and the last's collect overlap nothing (one piece a 100 MB
    // bucket: 69.9 ms a step against 61.8 for two, xl on 2 x H200)
    const int64_t pieces = (count + full - 1) / full < 2 ? 2 : (count + full - 1) / full, each = (count + pieces - 1) / pieces;
    for (int64_t at = 0, len; at < count; at += len) {
        len = count - at < each ? count - at : each;
        if (!tsys_dist__ce_piece(d, x + at, len, avg, s, e)) return false;
    }
    for (int i = 0; i < 2 * d->size; i++)
        if (i / 2 != d->rank && (!tsys_dist__ce_cuda(cudaEventRecord(ce->lane_done[i], ce->lane[i]), "cudaEventRecord", e) ||
            !tsys_dist__ce_cuda(cudaStreamWaitEvent(s, ce->lane_done[i], 0), "cudaStreamWaitEvent", e)))
            return false;
    return true;
}
// ---- gradients gathered on the copy engines (tsys_ddp's desc.ce_gather) ------------------------------
// Every rank's gradients copied into every peer's receive buffer (whole, or under ZeRO-1 the part the peer owns),
// a bucket as soon as backward finishes it, and nothing else beside backward: no sum kernel takes SMs from its GEMMs (2 x H200, xl's 7.87 GB: the
// GEMMs 13.1 ms alone, 14.1-14.6 beside these copies, 17.1-19.0 beside the copy-engine all-reduce, 24.7-25.5
// beside NCCL's; dev/ce_lab.cu). The optimizer sums the ranks' gradients as it reads them
// (tsys_optim_sum_grads). Each rank pulls: its copy engines read a peer's gradients (opened through IPC) into
// its own receive buffer, which holds a slot per peer laid out as that peer's gradients (q's slot at me:
// q - (q > me)). Pulls went at ~350 GB/s where pushes of the same bytes went at ~280 (2 x H200). Flags, each in
// the memory of the rank that waits on it:
//   ready[k][q]  q's bucket k is final: I may pull it
//   done[q]      q pulled all of my gradients this step: my next backward may overwrite them
// Raised by a 4-byte copy behind the data, cleared by the kernel that waited (tsys_dist__ce_take): a step leaves
// them as it found them, so it can be captured. My receive buffer is reused safely without a flag: my pulls
// follow my own optimizer step on my streams.
enum { TSYS_DIST__CEG_CHUNKS = 4 };   // ZeRO-1's chunks (TSYS_DIST__ZERO1_CHUNKS)
typedef struct tsys_dist__ceg_flags {
    uint32_t done[TSYS_DIST__CE_RANKS], one;
    uint32_t updated[TSYS_DIST__CEG_CHUNKS][TSYS_DIST__CE_RANKS];   // ZeRO-1: the rank updated its parameters of the chunk
    uint32_t ready[];                              // [bucket][rank]
} tsys_dist__ceg_flags;
typedef struct tsys_dist__ceg {
    char *recv;                                    // my receive buffer
    char *grads[TSYS_DIST__CE_RANKS];              // every rank's gradients: mine at [rank], the peers' through IPC
    char *params[TSYS_DIST__CE_RANKS];             // ZeRO-1: every rank's parameters' storage, the same way (NULL: none)
    char *lowp[TSYS_DIST__CE_RANKS];               // shard_masters: every rank's block of kept low-precision copies (NULL: none)
    tsys_dist__ceg_flags *flags[TSYS_DIST__CE_RANKS];
    int64_t bytes, lo, hi, flag_bytes;             // the gradients' bytes; the part [lo, hi) I receive (a slot); the flags'
    int64_t lo_of[TSYS_DIST__CE_RANKS], hi_of[TSYS_DIST__CE_RANKS];   // every rank's part (the pulls' prediction)
    int buckets;
    cudaStream_t lane[TSYS_DIST__CE_RANKS];        // pulls from rank q (a copy engine queue of its own)
    cudaEvent_t fork, lane_done[TSYS_DIST__CE_RANKS], pulled;
    // DDP's desc.shard_updates: each bucket's owner pulls its peers' gradients of it, updates it and pushes the new
    // parameters into every peer's storage (params[]) on push lanes; the peers take pushed flags at the step's end
    int *owner;                                    // [bucket], or NULL
    int64_t pushed_at;                             // byte offset in the flags of pushed[bucket]: its owner pushed it here
    cudaStream_t push[TSYS_DIST__CE_RANKS];        // my pushes into rank q
    cudaEvent_t pfork, push_done[TSYS_DIST__CE_RANKS];
} tsys_dist__ceg;
typedef struct tsys_dist__ceg_handles { cudaIpcMemHandle_t grads, flags; int64_t lo, hi; } tsys_dist__ceg_handles;

static bool tsys_dist__ceg_cuda(cudaError_t r, const char *what, tsys_dist__err *e) {
    return r == cudaSuccess || tsys_dist__seterr(e, TSYS_ERR_CUDA, "copy-engine gradient gather: %s: %s", what, cudaGetErrorString(r));
}

// CUDA IPC maps whole allocations: a peer opening p's handle gets the start of p's allocation, so p must be that
// start (the driver's cuPointerGetAttribute says, fetched through the runtime: no link against libcuda).
static bool tsys_dist__ceg_allocation_start(const void *p, const char *what, tsys_dist__err *e) {
    typedef CUresult (*attr_fn)(void *, CUpointer_attribute, CUdeviceptr);
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q;
    CUdeviceptr start = 0;
    const bool found = cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess && q == cudaDriverEntryPointSuccess && fn;
    cudaGetLastError();
    if (!found || ((attr_fn)fn)(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS)
        return tsys_dist__seterr(e, TSYS_ERR_CUDA, "copy-engine gradient gather: cannot ask the driver where %s's allocation starts", what);
    return start == (CUdeviceptr)(uintptr_t)p ||
           tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "ddp desc.ce_gather: %s does not start its allocation (%llu bytes in), and CUDA IPC maps whole allocations",
                             what, (unsigned long long)((CUdeviceptr)(uintptr_t)p - start));
}

// My receive buffer ((size - 1) slots of bytes [lo, hi) of the gradients) and flags; every rank's gradients
// (grads: mine, `bytes` at the base of a cudaMalloc allocation, as the CUDA backend's blocks are) and flags opened
// by every other. Collective.
static bool tsys_dist__ceg_setup(tsys_dist *d, tsys_dist__ceg *g, void *grads, int64_t bytes, int64_t lo, int64_t hi, int buckets, const int *owner, tsys_dist__err *e) {
    if (!d->one_host) return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "ddp desc.ce_gather: the ranks are on several hosts; the copy engines reach only this host's GPUs");
    if (d->size < 2 || d->size > TSYS_DIST__CE_RANKS)
        return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "ddp desc.ce_gather: %d ranks (it takes 2 to %d)", d->size, (int)TSYS_DIST__CE_RANKS);
    if (lo < 0 || hi < lo || hi > bytes) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "ddp desc.ce_gather: bytes [%lld, %lld) outside the %lld of the gradients",
                                                                  (long long)lo, (long long)hi, (long long)bytes);
    g->bytes = bytes; g->lo = lo; g->hi = hi; g->buckets = buckets;
    g->flag_bytes = (int64_t)sizeof(tsys_dist__ceg_flags) + (int64_t)buckets * TSYS_DIST__CE_RANKS * 4;
    if (owner) {
        if (!(g->owner = (int *)malloc(sizeof(int) * (size_t)(buckets > 0 ? buckets : 1)))) return tsys_dist__seterr(e, TSYS_ERR_OOM, "ddp desc.shard_updates: out of host memory");
        memcpy(g->owner, owner, sizeof(int) * (size_t)buckets);
        g->pushed_at = g->flag_bytes;
        g->flag_bytes += (int64_t)buckets * 4;
        for (int q = 0; q < d->size; q++)
            if (q != d->rank && (!tsys_dist__ceg_cuda(tsys_dist__lane_make(&g->push[q]), "cudaStreamCreateWithPriority", e) ||
                                 !tsys_dist__ceg_cuda(cudaEventCreateWithFlags(&g->push_done[q], cudaEventDisableTiming), "cudaEventCreateWithFlags", e)))
                return false;
        if (!tsys_dist__ceg_cuda(cudaEventCreateWithFlags(&g->pfork, cudaEventDisableTiming), "cudaEventCreateWithFlags", e)) return false;
    }
    tsys_dist__ceg_flags *init = (tsys_dist__ceg_flags *)calloc(1, (size_t)g->flag_bytes);
    if (!init) return tsys_dist__seterr(e, TSYS_ERR_OOM, "ddp desc.ce_gather: out of host memory");
    init->one = 1;
    tsys_dist__ceg_handles mine, theirs;
    memset(&mine, 0, sizeof mine);
    mine.lo = lo; mine.hi = hi;
    g->grads[d->rank] = (char *)grads;
    const size_t recv = (size_t)(hi - lo) * (size_t)(d->size - 1);
    bool ok = tsys_dist__ceg_cuda(cudaMalloc((void **)&g->recv, recv ? recv : 256), "cudaMalloc (the receive buffer)", e) &&
              tsys_dist__ceg_cuda(cudaMalloc((void **)&g->flags[d->rank], (size_t)g->flag_bytes), "cudaMalloc (flags)", e) &&
              tsys_dist__ceg_cuda(cudaMemcpy(g->flags[d->rank], init, (size_t)g->flag_bytes, cudaMemcpyHostToDevice), "cudaMemcpy (flags)", e) &&
              tsys_dist__ceg_allocation_start(grads, "the gradient arena", e) &&
              tsys_dist__ceg_cuda(cudaIpcGetMemHandle(&mine.grads, grads), "cudaIpcGetMemHandle (the gradients)", e) &&
              tsys_dist__ceg_cuda(cudaIpcGetMemHandle(&mine.flags, g->flags[d->rank]), "cudaIpcGetMemHandle (flags)", e);
    free(init);
    for (int r = 0; ok && r < d->size; r++) {
        memset(&theirs, 0, sizeof theirs);
        if (r == d->rank) theirs = mine;
        if (!tsys_dist__setup_bcast(d, &theirs, (int64_t)sizeof theirs, r, e)) return false;
        g->lo_of[r] = theirs.lo; g->hi_of[r] = theirs.hi;
        if (r == d->rank) continue;
        ok = tsys_dist__ceg_cuda(cudaIpcOpenMemHandle((void **)&g->grads[r], theirs.grads, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's gradients)", e) &&
             tsys_dist__ceg_cuda(cudaIpcOpenMemHandle((void **)&g->flags[r], theirs.flags, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's flags)", e);
    }
    if (!ok || !tsys_dist__ceg_cuda(cudaEventCreateWithFlags(&g->fork, cudaEventDisableTiming), "cudaEventCreateWithFlags", e) ||
        !tsys_dist__ceg_cuda(cudaEventCreateWithFlags(&g->pulled, cudaEventDisableTiming), "cudaEventCreateWithFlags", e))
        return false;
    for (int q = 0; q < d->size; q++)
        if (q != d->rank && (!tsys_dist__ceg_cuda(cudaEventCreateWithFlags(&g->lane_done[q], cudaEventDisableTiming), "cudaEventCreateWithFlags", e) ||
                             !tsys_dist__ceg_cuda(tsys_dist__lane_make(&g->lane[q]), "cudaStreamCreateWithPriority", e)))
            return false;
    return true;
}

// The teardowns of what the peers opened are collective unless the group is broken: every rank's copies end (a
// drained device, a barrier: tsys_dist__ipc_quiesce) before any rank closes what it opened, and those close before
// any rank frees what its peers opened (a second barrier). Errors go nowhere.
static bool tsys_dist__ipc_quiesce(tsys_dist *d, bool synced_before) {
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    int32_t one = 1;
    return !TSYS_DIST__LOAD(&d->broken) && (synced_before || cudaDeviceSynchronize() == cudaSuccess) && tsys_dist__setup_allreduce_i32(d, &one, 1, TSYS_DIST_SUM, &e);
}
static void tsys_dist__ipc_close(void *peer) { if (peer) cudaIpcCloseMemHandle(peer); }
static void tsys_dist__lane_free(cudaStream_t lane, cudaEvent_t done) {
    if (lane) cudaStreamDestroy(lane);
    if (done) cudaEventDestroy(done);
}
static void tsys_dist__ceg_teardown(tsys_dist *d, tsys_dist__ceg *g) {
    const bool synced = tsys_dist__ipc_quiesce(d, false);
    for (int r = 0; r < d->size && r < TSYS_DIST__CE_RANKS; r++) {
        if (r == d->rank) continue;
        tsys_dist__ipc_close(g->grads[r]); tsys_dist__ipc_close(g->params[r]); tsys_dist__ipc_close(g->lowp[r]); tsys_dist__ipc_close(g->flags[r]);
        tsys_dist__lane_free(g->lane[r], g->lane_done[r]);
        tsys_dist__lane_free(g->push[r], g->push_done[r]);
    }
    if (synced) tsys_dist__ipc_quiesce(d, true);
    if (g->recv) cudaFree(g->recv);
    if (g->flags[d->rank]) cudaFree(g->flags[d->rank]);
    if (g->fork) cudaEventDestroy(g->fork);
    if (g->pulled) cudaEventDestroy(g->pulled);
    if (g->pfork) cudaEventDestroy(g->pfork);
    free(g->owner);
    memset(g, 0, sizeof *g);
}

static uint32_t *tsys_dist__ceg_ready(const tsys_dist__ceg *g, int owner, int bucket, int from) { return &g->flags[owner]->ready[bucket * TSYS_DIST__CE_RANKS + from]; }

// My bucket k (bytes [off, off + bytes) of my gradients) is final as of s: tell every peer; then pull the part in
// [lo, hi) of every peer's bucket k into my slot for it once that peer says it is final (the flag is taken even
// when no byte is mine, so that none is left raised into the next step); s waits for the pulls.
static bool tsys_dist__ceg_bucket(tsys_dist *d, tsys_dist__ceg *g, int k, int64_t off, int64_t bytes, cudaStream_t s, tsys_dist__err *e) {
    const int me = d->rank;
    if (k < 0 || k >= g->buckets || off < 0 || bytes < 0 || off + bytes > g->bytes)
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "ddp desc.ce_gather: bucket %d, bytes [%lld, %lld), outside the %d buckets of %lld bytes", k, (long long)off,
                                 (long long)(off + bytes), g->buckets, (long long)g->bytes);
    const int own = g->owner ? g->owner[k] : -1;   // shard_updates: only the bucket's owner pulls it
    for (int q = 0; q < d->size; q++)
        if (q != me && (own < 0 || q == own) &&
            !tsys_dist__ceg_cuda(cudaMemcpyAsync(tsys_dist__ceg_ready(g, q, k, me), &g->flags[me]->one, 4, cudaMemcpyDeviceToDevice, s), "a flag's raise", e))
            return false;
    if (own >= 0 && own != me) return true;
    if (!tsys_dist__ceg_cuda(cudaEventRecord(g->fork, s), "cudaEventRecord", e)) return false;
    const int64_t a = off > g->lo ? off : g->lo, b = off + bytes < g->hi ? off + bytes : g->hi;
    for (int q = 0; q < d->size; q++) {
        if (q == me) continue;
        cudaStream_t lane = g->lane[q];
        if (!tsys_dist__ceg_cuda(cudaStreamWaitEvent(lane, g->fork, 0), "cudaStreamWaitEvent", e) ||
            !tsys_dist__ce_take(d, lane, tsys_dist__ceg_ready(g, me, k, q), NULL, 1, 1, -1, e) ||
            (a < b && !tsys_dist__ce_copy(g->recv + (int64_t)(q - (q > me)) * (g->hi - g->lo) + (a - g->lo), g->grads[q] + a, b - a, lane, e)) ||
            !tsys_dist__ceg_cuda(cudaEventRecord(g->lane_done[q], lane), "cudaEventRecord", e) ||
            !tsys_dist__ceg_cuda(cudaStreamWaitEvent(s, g->lane_done[q], 0), "cudaStreamWaitEvent", e))
            return false;
    }
    return true;
}

// My block `base` (the start of a cudaMalloc allocation, laid out as every rank's: `what`) opened by every peer into
// at[]. Collective.
static bool tsys_dist__ceg_share(tsys_dist *d, void *base, const char *what, char **at, tsys_dist__err *e) {
    cudaIpcMemHandle_t mine, theirs;
    memset(&mine, 0, sizeof mine);
    if (!tsys_dist__ceg_allocation_start(base, what, e) || !tsys_dist__ceg_cuda(cudaIpcGetMemHandle(&mine, base), "cudaIpcGetMemHandle (a block to share)", e))
        return false;
    at[d->rank] = (char *)base;
    for (int r = 0; r < d->size; r++) {
        theirs = mine;
        if (!tsys_dist__setup_bcast(d, &theirs, (int64_t)sizeof theirs, r, e)) return false;
        if (r != d->rank && !tsys_dist__ceg_cuda(cudaIpcOpenMemHandle((void **)&at[r], theirs, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's block)", e))
            return false;
    }
    return true;
}
// ZeRO-1 and shard_updates: my parameters' storage opened by every peer.
static bool tsys_dist__ceg_share_params(tsys_dist *d, tsys_dist__ceg *g, void *params, tsys_dist__err *e) {
    return tsys_dist__ceg_share(d, params, "the parameters' storage", g->params, e);
}

// ZeRO-1: I updated my parameters of chunk c (as of s): tell every peer; then pull every peer's part of the chunk
// (bytes [off[q], off[q] + len[q]) of its parameters, where mine lie too) once it says so. The pulls stay on the
// lanes: tsys_dist__ceg_join makes s wait for them.
static bool tsys_dist__ceg_params_chunk(tsys_dist *d, tsys_dist__ceg *g, int c, const int64_t *off, const int64_t *len, cudaStream_t s, tsys_dist__err *e) {
    const int me = d->rank;
    for (int q = 0; q < d->size; q++)
        if (q != me && !tsys_dist__ceg_cuda(cudaMemcpyAsync(&g->flags[q]->updated[c][me], &g->flags[me]->one, 4, cudaMemcpyDeviceToDevice, s), "a flag's raise", e))
            return false;
    if (!tsys_dist__ceg_cuda(cudaEventRecord(g->fork, s), "cudaEventRecord", e)) return false;
    for (int q = 0; q < d->size; q++) {
        if (q == me) continue;
        cudaStream_t lane = g->lane[q];
        if (!tsys_dist__ceg_cuda(cudaStreamWaitEvent(lane, g->fork, 0), "cudaStreamWaitEvent", e) ||
            !tsys_dist__ce_take(d, lane, &g->flags[me]->updated[c][q], NULL, 1, 1, -1, e) ||
            !tsys_dist__ce_copy(g->params[me] + off[q], g->params[q] + off[q], len[q], lane, e))
            return false;
    }
    return true;
}
// shard_updates: pushed[k] in rank r's flags (raised by bucket k's owner).
static uint32_t *tsys_dist__ceg_pushed(const tsys_dist__ceg *g, int r, int k) { return (uint32_t *)((char *)g->flags[r] + g->pushed_at) + k; }
// I updated my bucket k, as of s: its runs of the parameters' storage into every peer's storage, and bytes
// [low.off, low.off + low.len) of the kept copies' block (shard_masters) into the peer's, each push raising the
// peer's flag behind it. Nothing waits on a push lane (a kernel spinning there would hold up
// whatever stream shares its hardware queue): the peer takes the flag at its step's end. The peer's backward is
// done with the old values (this update read its gradient), and this raise cannot overtake the last step's take
// (the next update needs the peer's next gradient).
static bool tsys_dist__ceg_push(tsys_dist *d, tsys_dist__ceg *g, int k, const tsys_dist__run *runs, int nruns, tsys_dist__run low, cudaStream_t s, tsys_dist__err *e) {
    const int me = d->rank;
    if (!tsys_dist__ceg_cuda(cudaEventRecord(g->pfork, s), "cudaEventRecord", e)) return false;
    for (int q = 0; q < d->size; q++) {
        if (q == me) continue;
        if (!tsys_dist__ceg_cuda(cudaStreamWaitEvent(g->push[q], g->pfork, 0), "cudaStreamWaitEvent", e)) return false;
        for (int r = 0; r < nruns; r++)
            if (!tsys_dist__ce_copy(g->params[q] + runs[r].off, g->params[me] + runs[r].off, runs[r].len, g->push[q], e)) return false;
        if ((low.len > 0 && !tsys_dist__ce_copy(g->lowp[q] + low.off, g->lowp[me] + low.off, low.len, g->push[q], e)) ||
            !tsys_dist__ceg_cuda(cudaMemcpyAsync(tsys_dist__ceg_pushed(g, q, k), &g->flags[me]->one, 4, cudaMemcpyDeviceToDevice, g->push[q]), "a flag's raise", e))
            return false;
    }
    return true;
}
// The step's end on s: every bucket I do not own pushed into me, and my push lanes joined.
static bool tsys_dist__ceg_land(tsys_dist *d, tsys_dist__ceg *g, cudaStream_t s, tsys_dist__err *e) {
    const int me = d->rank;
    for (int k = 0; k < g->buckets; k++)
        if (g->owner[k] != me && !tsys_dist__ce_take(d, s, tsys_dist__ceg_pushed(g, me, k), NULL, 1, 1, -1, e)) return false;
    for (int q = 0; q < d->size; q++)
        if (q != me && (!tsys_dist__ceg_cuda(cudaEventRecord(g->push_done[q], g->push[q]), "cudaEventRecord", e) ||
                        !tsys_dist__ceg_cuda(cudaStreamWaitEvent(s, g->push_done[q], 0), "cudaStreamWaitEvent", e)))
            return false;
    return true;
}
static bool tsys_dist__ceg_join(tsys_dist *d, tsys_dist__ceg *g, cudaStream_t s, tsys_dist__err *e) {
    for (int q = 0; q < d->size; q++)
        if (q != d->rank && (!tsys_dist__ceg_cuda(cudaEventRecord(g->lane_done[q], g->lane[q]), "cudaEventRecord", e) ||
                             !tsys_dist__ceg_cuda(cudaStreamWaitEvent(s, g->lane_done[q], 0), "cudaStreamWaitEvent", e)))
            return false;
    return true;
}

// One round of the pulls' probe: every rank (all), or rank 0 alone, pulls `bytes` of the part it receives from every
// peer's gradients into its slot for that peer, on the peers' lanes; *ms its time from the first issue to the last
// pull's end (0 for a rank that pulls nothing). No flags: the caller has every rank between steps.
static bool tsys_dist__ceg_probe_round(tsys_dist *d, tsys_dist__ceg *g, int64_t bytes, bool all, double *ms, tsys_dist__err *e) {
    const int me = d->rank;
    *ms = 0;
    if (!all && me != 0) return true;
    const double t0 = tsys_time_us();
    for (int q = 0; q < d->size; q++)
        if (q != me && !tsys_dist__ce_copy(g->recv + (int64_t)(q - (q > me)) * (g->hi - g->lo), g->grads[q] + g->lo, bytes, g->lane[q], e)) return false;
    for (int q = 0; q < d->size; q++)
        if (q != me && !tsys_dist__ceg_cuda(cudaStreamSynchronize(g->lane[q]), "cudaStreamSynchronize (a probe's pull)", e)) return false;
    *ms = (tsys_time_us() - t0) * 1e-3;
    return true;
}

// The pulls' links: of each pattern, pulls of 64 KiB and of min(64 MiB, the least part a rank receives) from every
// peer, each the slowest rank's median of 7 rounds after 2, every round started together (the status agreed first).
// Collective. False with e set, or with nothing set where the parts are too small to tell the sizes apart.
static bool tsys_dist__ceg_calibrate(tsys_dist *d, tsys_dist__ceg *g, tsys_dist_pull_links *out, tsys_dist__err *e) {
    int64_t least = g->hi_of[0] - g->lo_of[0];
    for (int r = 1; r < d->size; r++) least = g->hi_of[r] - g->lo_of[r] < least ? g->hi_of[r] - g->lo_of[r] : least;
    const int64_t small = 64 << 10, big = (least < (64 << 20) ? least : (64 << 20)) / 256 * 256;
    if (big < 4 * small) return false;
    const int64_t size[2] = {small, big};
    for (int pattern = 0; pattern < 2; pattern++) {
        double t[2];
        for (int k = 0; k < 2; k++) {
            double round[9];
            if (tsys_dist_any_failed(d, TSYS_OK)) return tsys_dist__seterr(e, TSYS_ERR_IO, "copy-engine pulls' probe: the group failed");
            for (int it = 0; it < 9; it++) {   // the agreement after a round starts the next together
                const bool ok = tsys_dist__ceg_probe_round(d, g, size[k], pattern == 0, &round[it], e);
                if (tsys_dist_any_failed(d, ok ? TSYS_OK : TSYS_ERR_CUDA)) return !ok ? false : tsys_dist__seterr(e, TSYS_ERR_CUDA, "copy-engine pulls' probe: failed on another rank");
            }
            qsort(round + 2, 7, sizeof(double), tsys_dist__cmp_double);
            t[k] = round[5];
        }
        if (tsys_dist_all_reduce_host(d, t, 2, TSYS_DIST_MAX) != TSYS_OK) return tsys_dist__seterr(e, TSYS_ERR_IO, "copy-engine pulls' probe: the ranks' times");
        if (!(t[1] > t[0])) return false;
        tsys_dist_link_model *m = pattern == 0 ? &out->all : &out->one;
        const double peers = d->size - 1.0;
        m->beta_bytes_per_ms = peers * (double)(big - small) / (t[1] - t[0]);
        m->alpha_ms = fmax(0.0, t[0] - peers * (double)small / m->beta_bytes_per_ms);
    }
    return true;
}

// Every bucket's pulls are issued on side (each joined into it): tell every peer I read its gradients, then make
// compute wait for my pulls and until every peer read mine (its next backward overwrites them).
static bool tsys_dist__ceg_close(tsys_dist *d, tsys_dist__ceg *g, cudaStream_t side, cudaStream_t compute, tsys_dist__err *e) {
    const int me = d->rank;
    for (int q = 0; q < d->size; q++)
        if (q != me && !tsys_dist__ceg_cuda(cudaMemcpyAsync(&g->flags[q]->done[me], &g->flags[me]->one, 4, cudaMemcpyDeviceToDevice, side), "a flag's raise", e))
            return false;
    return tsys_dist__ceg_cuda(cudaEventRecord(g->pulled, side), "cudaEventRecord", e) &&
           tsys_dist__ceg_cuda(cudaStreamWaitEvent(compute, g->pulled, 0), "cudaStreamWaitEvent", e) &&
           tsys_dist__ce_take(d, compute, g->flags[me]->done, NULL, d->size, 1, me, e);
}

// ---- FSDP's units on the copy engines (tsys_fsdp's desc.ce_transfers) -------------------------------------
// Every unit's gathered weights and full gradients keep one place on every rank, opened by every peer through IPC,
// and move on the copy engines: NCCL's reduce-scatters and all-gathers take SMs from backward's GEMMs for as long
// as they run. Per unit u, once my backward of it is over (as of the compute stream):
//   ready    I raise ready[u][me] in every peer; my lane for q takes ready[u][q] (q's gradients of u are final)
//            and pulls my part of q's full gradients into q's slot of my receive buffer, with the whole of q's
//            gradients of the replicated parameters final since the last unit (its `reps` arena, laid out as
//            mine); the side stream joins the lanes, and AdamW on the background stream sums my part (my own
//            replicated gradients) and the pulled ones as it reads them. No NCCL call is left in a step.
//   pushed   behind my update, the cast of my shard lies in my part of my weights of u: my push lane for q copies
//            it into q's weights and raises pushed[u][me] there
// At the step's end the compute stream takes every pushed flag (the next forward reads those weights) and joins
// my push lanes; the side stream, which joined my pulls, raises done[me] in every peer, and the compute stream
// waits until every peer's done is in mine (my next backward overwrites my gradients). Flags live in the memory
// of the rank that waits on them and are cleared by the kernel that took them (tsys_dist__ce_take), so a step
// leaves them as it found them and can be captured. My receive buffer needs no flag: my next pulls into it
// follow my updates, which the step's end joins.
typedef struct tsys_dist__fce_flags {
    uint32_t done[TSYS_DIST__CE_RANKS], one;
    uint32_t unit[];                               // [unit + 1][rank] ready (the last: replicated gradients alone), then [unit][rank] pushed
} tsys_dist__fce_flags;
typedef struct tsys_dist__fce {
    int units;
    char *recv;                                    // my receive buffer: a slot a peer (q's at q - (q > me))
    char **weights, **grads;                       // [unit * TSYS_DIST__CE_RANKS + rank]: mine at rank, the peers' through IPC
    char *reps[TSYS_DIST__CE_RANKS];               // every rank's replicated parameters' gradients (NULL: none)
    tsys_dist__fce_flags *flags[TSYS_DIST__CE_RANKS];
    int64_t flag_bytes;
    cudaStream_t lane[TSYS_DIST__CE_RANKS], push[TSYS_DIST__CE_RANKS], signal;   // signal: the ready flags' raises
    cudaEvent_t fork, pfork, lane_done[TSYS_DIST__CE_RANKS], push_done[TSYS_DIST__CE_RANKS], pulled, signalled;
} tsys_dist__fce;
typedef struct tsys_dist__fce_handles { cudaIpcMemHandle_t weights, grads; } tsys_dist__fce_handles;   // [units]: flags, reps
// A run of bytes to pull: [src, src + len) of a peer's block into [dst, dst + len) of my slot for it.
typedef struct tsys_dist__fce_span { int64_t src, dst, len; } tsys_dist__fce_span;

static bool tsys_dist__fce_cuda(cudaError_t r, const char *what, tsys_dist__err *e) {
    return r == cudaSuccess || tsys_dist__seterr(e, TSYS_ERR_CUDA, "fsdp desc.ce_transfers: %s: %s", what, cudaGetErrorString(r));
}
static uint32_t *tsys_dist__fce_ready(const tsys_dist__fce *g, int at, int u, int from) { return &g->flags[at]->unit[u * TSYS_DIST__CE_RANKS + from]; }
static uint32_t *tsys_dist__fce_pushed(const tsys_dist__fce *g, int at, int u, int from) {
    return &g->flags[at]->unit[(g->units + 1 + u) * TSYS_DIST__CE_RANKS + from];
}

// Waits until flags f[i] (i in [0, n), i % TSYS_DIST__CE_RANKS a rank below `ranks` other than `me`) are 1, clearing each.
__global__ void tsys_dist__fce_take_kernel(uint32_t *f, int n, int ranks, int me, unsigned long long timeout_ns) {
    for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x) {
        const int r = i % TSYS_DIST__CE_RANKS;
        if (r >= ranks || r == me) continue;
        volatile uint32_t *x = f + i;
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t0));
        while (*x != 1u) {
            __nanosleep(500);
            asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
            if (t - t0 > timeout_ns) __trap();
        }
        *x = 0u;
    }
}

// Every rank's weights and gradients of every unit (mine: weights[u], grads[u], each the start of a cudaMalloc
// allocation) and replicated gradients (reps, the same or NULL on every rank) opened by every other; my receive
// buffer of recv_bytes and my flags. Collective.
static bool tsys_dist__fce_setup(tsys_dist *d, tsys_dist__fce *g, int units, void *const *weights, void *const *grads, void *reps, int64_t recv_bytes, tsys_dist__err *e) {
    if (!d->one_host) return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "fsdp desc.ce_transfers: the ranks are on several hosts; the copy engines reach only this host's GPUs");
    if (d->size < 2 || d->size > TSYS_DIST__CE_RANKS)
        return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "fsdp desc.ce_transfers: %d ranks (it takes 2 to %d)", d->size, (int)TSYS_DIST__CE_RANKS);
    const size_t slots = (size_t)units * TSYS_DIST__CE_RANKS;
    g->units = units;
    g->weights = (char **)calloc(slots, sizeof(char *));
    g->grads = (char **)calloc(slots, sizeof(char *));
    tsys_dist__fce_handles *h = (tsys_dist__fce_handles *)calloc((size_t)units + 1, sizeof *h);
    g->flag_bytes = (int64_t)sizeof(tsys_dist__fce_flags) + (2 * (int64_t)slots + TSYS_DIST__CE_RANKS) * 4;
    tsys_dist__fce_flags *init = (tsys_dist__fce_flags *)calloc(1, (size_t)g->flag_bytes);
    bool ok = (g->weights && g->grads && h && init) || tsys_dist__seterr(e, TSYS_ERR_OOM, "fsdp desc.ce_transfers: out of host memory");
    if (ok) init->one = 1;
    for (int u = 0; ok && u < units; u++) {
        g->weights[u * TSYS_DIST__CE_RANKS + d->rank] = (char *)weights[u];
        g->grads[u * TSYS_DIST__CE_RANKS + d->rank] = (char *)grads[u];
        ok = tsys_dist__ceg_allocation_start(weights[u], "a unit's gathered weights", e) && tsys_dist__ceg_allocation_start(grads[u], "a unit's full gradients", e) &&
             tsys_dist__fce_cuda(cudaIpcGetMemHandle(&h[u].weights, weights[u]), "cudaIpcGetMemHandle (a unit's weights)", e) &&
             tsys_dist__fce_cuda(cudaIpcGetMemHandle(&h[u].grads, grads[u]), "cudaIpcGetMemHandle (a unit's gradients)", e);
    }
    ok = ok && tsys_dist__fce_cuda(cudaMalloc((void **)&g->recv, recv_bytes > 0 ? (size_t)recv_bytes : 256), "cudaMalloc (the receive buffer)", e) &&
         tsys_dist__fce_cuda(cudaMalloc((void **)&g->flags[d->rank], (size_t)g->flag_bytes), "cudaMalloc (flags)", e) &&
         tsys_dist__fce_cuda(cudaMemcpy(g->flags[d->rank], init, (size_t)g->flag_bytes, cudaMemcpyHostToDevice), "cudaMemcpy (flags)", e) &&
         tsys_dist__fce_cuda(cudaIpcGetMemHandle(&h[units].weights, g->flags[d->rank]), "cudaIpcGetMemHandle (flags)", e);
    g->reps[d->rank] = (char *)reps;
    ok = ok && (!reps || (tsys_dist__ceg_allocation_start(reps, "the replicated parameters' gradients", e) &&
                          tsys_dist__fce_cuda(cudaIpcGetMemHandle(&h[units].grads, reps), "cudaIpcGetMemHandle (the replicated gradients)", e)));
    free(init);
    // every rank learns every rank's handles (a rank that failed above sends zeros and fails the opens too)
    tsys_dist__fce_handles *theirs = (tsys_dist__fce_handles *)calloc((size_t)units + 1, sizeof *theirs);
    if (!theirs) ok = tsys_dist__seterr(e, TSYS_ERR_OOM, "fsdp desc.ce_transfers: out of host memory");
    for (int r = 0; theirs && r < d->size; r++) {
        if (r == d->rank && h) memcpy(theirs, h, sizeof *h * ((size_t)units + 1));
        if (!tsys_dist__setup_bcast(d, theirs, (int64_t)(sizeof *theirs * ((size_t)units + 1)), r, e)) { ok = false; break; }
        for (int u = 0; ok && r != d->rank && u < units; u++)
            ok = tsys_dist__fce_cuda(cudaIpcOpenMemHandle((void **)&g->weights[u * TSYS_DIST__CE_RANKS + r], theirs[u].weights, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's weights)", e) &&
                 tsys_dist__fce_cuda(cudaIpcOpenMemHandle((void **)&g->grads[u * TSYS_DIST__CE_RANKS + r], theirs[u].grads, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's gradients)", e);
        if (ok && r != d->rank)
            ok = tsys_dist__fce_cuda(cudaIpcOpenMemHandle((void **)&g->flags[r], theirs[units].weights, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's flags)", e) &&
                 (!reps || tsys_dist__fce_cuda(cudaIpcOpenMemHandle((void **)&g->reps[r], theirs[units].grads, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle (a peer's replicated gradients)", e));
    }
    free(theirs); free(h);
    ok = ok && tsys_dist__fce_cuda(cudaEventCreateWithFlags(&g->fork, cudaEventDisableTiming), "cudaEventCreateWithFlags", e) &&
         tsys_dist__fce_cuda(cudaEventCreateWithFlags(&g->pfork, cudaEventDisableTiming), "cudaEventCreateWithFlags", e) &&
         tsys_dist__fce_cuda(cudaEventCreateWithFlags(&g->pulled, cudaEventDisableTiming), "cudaEventCreateWithFlags", e) &&
         tsys_dist__fce_cuda(cudaEventCreateWithFlags(&g->signalled, cudaEventDisableTiming), "cudaEventCreateWithFlags", e) &&
         tsys_dist__fce_cuda(tsys_dist__lane_make(&g->signal), "cudaStreamCreateWithPriority", e);
    for (int q = 0; ok && q < d->size; q++)
        if (q != d->rank)
            ok = tsys_dist__fce_cuda(tsys_dist__lane_make(&g->lane[q]), "cudaStreamCreateWithPriority", e) && tsys_dist__fce_cuda(tsys_dist__lane_make(&g->push[q]), "cudaStreamCreateWithPriority", e) &&
                 tsys_dist__fce_cuda(cudaEventCreateWithFlags(&g->lane_done[q], cudaEventDisableTiming), "cudaEventCreateWithFlags", e) &&
                 tsys_dist__fce_cuda(cudaEventCreateWithFlags(&g->push_done[q], cudaEventDisableTiming), "cudaEventCreateWithFlags", e);
    return ok;
}

// Collective unless the group is broken (as tsys_dist__ceg_teardown).
static void tsys_dist__fce_teardown(tsys_dist *d, tsys_dist__fce *g) {
    const bool synced = tsys_dist__ipc_quiesce(d, false);
    for (int r = 0; r < d->size && r < TSYS_DIST__CE_RANKS; r++) {
        if (r == d->rank) continue;
        for (int u = 0; u < g->units; u++) {
            if (g->weights) tsys_dist__ipc_close(g->weights[u * TSYS_DIST__CE_RANKS + r]);
            if (g->grads) tsys_dist__ipc_close(g->grads[u * TSYS_DIST__CE_RANKS + r]);
        }
        tsys_dist__ipc_close(g->flags[r]); tsys_dist__ipc_close(g->reps[r]);
        tsys_dist__lane_free(g->lane[r], g->lane_done[r]);
        tsys_dist__lane_free(g->push[r], g->push_done[r]);
    }
    if (synced) tsys_dist__ipc_quiesce(d, true);
    if (g->recv) cudaFree(g->recv);
    if (g->flags[d->rank]) cudaFree(g->flags[d->rank]);
    if (g->fork) cudaEventDestroy(g->fork);
    if (g->pfork) cudaEventDestroy(g->pfork);
    if (g->pulled) cudaEventDestroy(g->pulled);
    tsys_dist__lane_free(g->signal, g->signalled);
    free(g->weights); free(g->grads);
    memset(g, 0, sizeof *g);
}

// My gradients of unit u (u == units: none, the replicated alone) are final as of `compute`: every peer learns it; my
// part of theirs ([part, part + bytes) of their full gradients) comes into my slot for each at byte `at`, and the
// spans of their replicated gradients, and `side` waits for those pulls.
static bool tsys_dist__fce_reduce(tsys_dist *d, tsys_dist__fce *g, int u, int64_t part, int64_t bytes, int64_t at, const tsys_dist__fce_span *reps, int nreps,
                                  int64_t slot_bytes, cudaStream_t compute, cudaStream_t side, tsys_dist__err *e) {
    const int me = d->rank;
    // the raises go on a stream of their own, behind the compute stream's work so far: a copy on the compute stream
    // would hold backward's next kernel, and one behind the pulls would wait for the peers
    if (!tsys_dist__fce_cuda(cudaEventRecord(g->fork, compute), "cudaEventRecord", e) || !tsys_dist__fce_cuda(cudaStreamWaitEvent(g->signal, g->fork, 0), "cudaStreamWaitEvent", e))
        return false;
    for (int q = 0; q < d->size; q++)
        if (q != me && !tsys_dist__fce_cuda(cudaMemcpyAsync(tsys_dist__fce_ready(g, q, u, me), &g->flags[me]->one, 4, cudaMemcpyDeviceToDevice, g->signal), "a flag's raise", e))
            return false;
    for (int q = 0; q < d->size; q++) {
        if (q == me) continue;
        cudaStream_t lane = g->lane[q];
        char *slot = g->recv + (int64_t)(q - (q > me)) * slot_bytes;
        if (!tsys_dist__fce_cuda(cudaStreamWaitEvent(lane, g->fork, 0), "cudaStreamWaitEvent", e) ||
            !tsys_dist__ce_take(d, lane, tsys_dist__fce_ready(g, me, u, q), NULL, 1, 1, -1, e) ||
            (u < g->units && !tsys_dist__ce_copy(slot + at, g->grads[u * TSYS_DIST__CE_RANKS + q] + part, bytes, lane, e)))
            return false;
        for (int k = 0; k < nreps; k++)
            if (!tsys_dist__ce_copy(slot + reps[k].dst, g->reps[q] + reps[k].src, reps[k].len, lane, e)) return false;
        if (!tsys_dist__fce_cuda(cudaEventRecord(g->lane_done[q], lane), "cudaEventRecord", e) ||
            !tsys_dist__fce_cuda(cudaStreamWaitEvent(side, g->lane_done[q], 0), "cudaStreamWaitEvent", e))
            return false;
    }
    return true;
}

// My part [part, part + bytes) of my weights of unit u holds my new shard as of bg (`local`, when not NULL, is copied
// there first, on bg): into every peer's, each push raising the peer's pushed flag behind it. Nothing waits on a push
// lane: the peer takes the flag at its step's end, which joins the lanes.
// The peer's backward is done with its old weights (this update read its gradients of u), and this raise cannot
// overtake the last step's take (the next update needs the peer's next gradients).
static bool tsys_dist__fce_push(tsys_dist *d, tsys_dist__fce *g, int u, const void *local, int64_t part, int64_t bytes, cudaStream_t bg, tsys_dist__err *e) {
    const int me = d->rank;
    char *src = g->weights[u * TSYS_DIST__CE_RANKS + me] + part;
    if ((local && !tsys_dist__ce_copy(src, local, bytes, bg, e)) || !tsys_dist__fce_cuda(cudaEventRecord(g->pfork, bg), "cudaEventRecord", e)) return false;
    for (int q = 0; q < d->size; q++) {
        if (q == me) continue;
        if (!tsys_dist__fce_cuda(cudaStreamWaitEvent(g->push[q], g->pfork, 0), "cudaStreamWaitEvent", e) ||
            !tsys_dist__ce_copy(g->weights[u * TSYS_DIST__CE_RANKS + q] + part, src, bytes, g->push[q], e) ||
            !tsys_dist__fce_cuda(cudaMemcpyAsync(tsys_dist__fce_pushed(g, q, u, me), &g->flags[me]->one, 4, cudaMemcpyDeviceToDevice, g->push[q]), "a flag's raise", e))
            return false;
    }
    return true;
}

// The step's end on compute: the units moved this step pushed into me by every peer, my push lanes joined; every peer told
// (behind my pulls, which side joined) that I read its gradients, and every peer done reading mine.
static bool tsys_dist__fce_land(tsys_dist *d, tsys_dist__fce *g, const bool *moved, cudaStream_t compute, cudaStream_t side, tsys_dist__err *e) {
    const int me = d->rank;
    for (int first = 0, end; first < g->units; first = end) {   // a wait a run of moved units (one launch a step as a rule)
        for (end = first; end < g->units && moved[end] == moved[first]; end++) {}
        if (!moved[first]) continue;
        tsys_dist__fce_take_kernel<<<1, 256, 0, compute>>>(tsys_dist__fce_pushed(g, me, first, 0), (end - first) * TSYS_DIST__CE_RANKS, d->size, me,
                                                           (unsigned long long)(d->timeout_s * 1e9));
        if (!tsys_dist__fce_cuda(cudaGetLastError(), "the flags' wait", e)) return false;
    }
    for (int q = 0; q < d->size; q++)
        if (q != me && (!tsys_dist__fce_cuda(cudaEventRecord(g->push_done[q], g->push[q]), "cudaEventRecord", e) ||
                        !tsys_dist__fce_cuda(cudaStreamWaitEvent(compute, g->push_done[q], 0), "cudaStreamWaitEvent", e) ||
                        !tsys_dist__fce_cuda(cudaMemcpyAsync(&g->flags[q]->done[me], &g->flags[me]->one, 4, cudaMemcpyDeviceToDevice, side), "a flag's raise", e)))
            return false;
    return tsys_dist__fce_cuda(cudaEventRecord(g->pulled, side), "cudaEventRecord", e) && tsys_dist__fce_cuda(cudaStreamWaitEvent(compute, g->pulled, 0), "cudaStreamWaitEvent", e) &&
           tsys_dist__fce_cuda(cudaEventRecord(g->signalled, g->signal), "cudaEventRecord", e) &&
           tsys_dist__fce_cuda(cudaStreamWaitEvent(compute, g->signalled, 0), "cudaStreamWaitEvent", e) && tsys_dist__ce_take(d, compute, g->flags[me]->done, NULL, d->size, 1, me, e);
}

// A step's transfers alone, between steps (every rank here, nothing in flight): for each unit i, my part
// [part[i], part[i] + bytes[i]) of every peer's gradients pulled into my slot for it, and of my weights pushed
// into every peer's (the bytes they hold already); the peers' replicated gradients (span reps). No flags.
static bool tsys_dist__fce_probe(tsys_dist *d, tsys_dist__fce *g, const int64_t *part, const int64_t *bytes, const int64_t *at, tsys_dist__fce_span reps,
                                 int64_t slot_bytes, tsys_dist__err *e) {
    const int me = d->rank;
    for (int q = 0; q < d->size; q++)
        if (q != me && reps.len > 0 && !tsys_dist__ce_copy(g->recv + (int64_t)(q - (q > me)) * slot_bytes + reps.dst, g->reps[q] + reps.src, reps.len, g->lane[q], e)) return false;
    for (int u = 0; u < g->units; u++)
        for (int q = 0; q < d->size; q++)
            if (q != me && (!tsys_dist__ce_copy(g->recv + (int64_t)(q - (q > me)) * slot_bytes + at[u], g->grads[u * TSYS_DIST__CE_RANKS + q] + part[u], bytes[u], g->lane[q], e) ||
                            !tsys_dist__ce_copy(g->weights[u * TSYS_DIST__CE_RANKS + q] + part[u], g->weights[u * TSYS_DIST__CE_RANKS + me] + part[u], bytes[u], g->push[q], e)))
                return false;
    for (int q = 0; q < d->size; q++)
        if (q != me && (!tsys_dist__fce_cuda(cudaStreamSynchronize(g->lane[q]), "cudaStreamSynchronize", e) || !tsys_dist__fce_cuda(cudaStreamSynchronize(g->push[q]), "cudaStreamSynchronize", e)))
            return false;
    return true;
}

// Whether c goes to the copy engines: an fp32 sum or average of at least TSYS_DIST__CE_MIN bytes, outside an
// NCCL group.
static bool tsys_dist__ce_takes(const tsys_dist *d, const tsys_dist__coll *c) {
    return d->ce && c->kind == TSYS_DIST__ALLREDUCE && c->type == TSYS_F32 && (c->op == TSYS_DIST_SUM || c->op == TSYS_DIST_AVG) &&
           c->count * 4 >= TSYS_DIST__CE_MIN && !d->group_open;
}

// ---- NCCL collectives -----------------------------------------------------------------------------
// On the side stream, after the compute stream's work so far (an event from the backend's pool);
// the collective's end is another event, which tsys_dist_wait makes the compute stream wait for.
// No host sync anywhere, so the whole sequence can be captured in a CUDA graph.
static ncclDataType_t tsys_dist__nccl_type(int t) {
    switch (t) {
    case TSYS_F32: return ncclFloat32;
    case TSYS_BF16: return ncclBfloat16;
    case TSYS_F16: return ncclFloat16;
    case TSYS_I32: return ncclInt32;
    default: return ncclInt64;
    }
}
// c->done == NULL: a blocking collective with no asynchronous one in flight goes on the compute stream itself
// (the compute stream would wait for it at once; the two events of the side stream cost ~2.6 us, measured
// on 2 x H200 by dev/nccl_latency.c). With asynchronous ones in flight it takes the side stream behind them:
// collectives on one communicator must run in the order they were issued.
static bool tsys_dist__nccl_coll(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    tsys_ctx *ctx = d->ctx;
    tsys_event *done = c->done;
    if (done && (tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &d->ev_ready) != TSYS_OK ||
                 tsys_event_wait(ctx, &d->ev_ready, TSYS_STREAM_SIDE) != TSYS_OK))
        return tsys_dist__seterr(e, tsys_ctx_status(ctx), "%s", tsys_ctx_last_error(ctx));
    cudaStream_t stream = (cudaStream_t)tsys_cuda_stream_of(ctx, done ? TSYS_STREAM_SIDE : TSYS_STREAM_COMPUTE);
    ncclDataType_t dt = tsys_dist__nccl_type(c->type);
    ncclRedOp_t op = c->op == TSYS_DIST_AVG ? ncclAvg : c->op == TSYS_DIST_MAX ? ncclMax : ncclSum;
    if (tsys_dist__ce_takes(d, c)) {
        if (!tsys_dist__ce_allreduce(d, (float *)c->out, c->count, c->op == TSYS_DIST_AVG, stream, e)) {   // the peers would wait for this rank's part
            tsys_dist__break(d, e);
            return false;
        }
        if (done && tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_SIDE, done) != TSYS_OK) return tsys_dist__seterr(e, tsys_ctx_status(ctx), "%s", tsys_ctx_last_error(ctx));
        return true;
    }
    ncclResult_t r;
    const char *what;
    switch (c->kind) {
    case TSYS_DIST__ALLREDUCE: what = "ncclAllReduce"; r = ncclAllReduce(c->out, c->out, (size_t)c->count, dt, op, d->nccl, stream); break;
    case TSYS_DIST__BCAST: what = "ncclBroadcast"; r = ncclBroadcast(c->out, c->out, (size_t)c->count, dt, c->root, d->nccl, stream); break;
    case TSYS_DIST__RS: what = "ncclReduceScatter"; r = ncclReduceScatter(c->in, c->out, (size_t)c->count, dt, op, d->nccl, stream); break;
    default: what = "ncclAllGather"; r = ncclAllGather(c->in, c->out, (size_t)c->count, dt, d->nccl, stream); break;
    }
    char buf[96];
    snprintf(buf, sizeof buf, "%s (collective #%lld)", what, (long long)c->seq);
    if (!tsys_dist__nccl_ok(d, r, buf, e)) return false;
    if (d->group_open) return true;   // launched, settled and given its end event by tsys_dist_group_end
    if (r == ncclInProgress && !tsys_dist__nccl_settle(d, buf, e)) return false;
    if (done && tsys_event_record(ctx, TSYS_CUDA, TSYS_STREAM_SIDE, done) != TSYS_OK) return tsys_dist__seterr(e, tsys_ctx_status(ctx), "%s", tsys_ctx_last_error(ctx));
    return true;
}

// Ends an NCCL group that cannot go on: aborting the communicator also ends its kernels still waiting
// on the GPU for a peer that will never send (without it the process could not even exit).
static bool tsys_dist__nccl_give_up(tsys_dist *d, tsys_dist__err *e) {
    tsys_dist__break(d, e);
    if (d->nccl) ncclCommAbort(d->nccl);
    d->nccl = NULL;
    return false;
}

// Waits (host side, bounded by the timeout) for the NCCL collectives issued so far on the side stream; a
// peer that died or stalled ends it in an error and an aborted communicator. A peer that this rank can
// see is gone (tsys_dist__dead_peers) is named within TSYS_DIST__DEAD_CHECK_US.
static bool tsys_dist__nccl_drain(tsys_dist *d, const char *what, tsys_dist__err *e) {
    tsys_event ev;
    memset(&ev, 0, sizeof ev);
    // the side stream's collectives, and the compute stream's (blocking ones go there): the side stream
    // waits for the compute stream, and the host for the side stream
    if (tsys_event_record(d->ctx, TSYS_CUDA, TSYS_STREAM_COMPUTE, &d->ev_ready) != TSYS_OK || tsys_event_wait(d->ctx, &d->ev_ready, TSYS_STREAM_SIDE) != TSYS_OK ||
        tsys_event_record(d->ctx, TSYS_CUDA, TSYS_STREAM_SIDE, &ev) != TSYS_OK)
        return tsys_dist__seterr(e, tsys_ctx_status(d->ctx), "%s: %s", what, tsys_ctx_last_error(d->ctx));
    const double t0 = tsys_time_us();
    double last_check = t0;
    bool ok = true;
    for (long spins = 0;; spins++) {
        const cudaError_t q = cudaEventQuery((cudaEvent_t)ev.handle);
        if (q == cudaSuccess) break;
        char dead[160];
        if (tsys_time_us() - last_check > TSYS_DIST__DEAD_CHECK_US) {
            last_check = tsys_time_us();
            if (tsys_dist__dead_peers(d, dead, sizeof dead) > 0) {
                tsys_dist__seterr(e, TSYS_ERR_NCCL, "%s: %s exited, with NCCL collectives in flight; communicator aborted", what, dead);
                ok = tsys_dist__nccl_give_up(d, e);
                break;
            }
        }
        ncclResult_t ae = ncclSuccess;
        const ncclResult_t qr = ncclCommGetAsyncError(d->nccl, &ae);
        if (qr != ncclSuccess) ae = qr;
        if (q != cudaErrorNotReady) { ok = tsys_dist__seterr(e, TSYS_ERR_CUDA, "%s: %s", what, cudaGetErrorString(q)); break; }
        if (ae != ncclSuccess && ae != ncclInProgress) {
            char buf[200];
            const bool named = tsys_dist__dead_peers(d, dead, sizeof dead) > 0;
            snprintf(buf, sizeof buf, named ? "%s: NCCL (%s exited)" : "%s: NCCL%s", what, dead);
            tsys_dist__nccl_ok(d, ae, buf, e);
            ok = tsys_dist__nccl_give_up(d, e);
            break;
        }
        if ((tsys_time_us() - t0) * 1e-6 > d->timeout_s) {
            tsys_dist__seterr(e, TSYS_ERR_NCCL, "%s: the NCCL collectives in flight did not finish within %g s (a peer died or stalled); communicator aborted", what, d->timeout_s);
            ok = tsys_dist__nccl_give_up(d, e);
            break;
        }
        if (spins > 1000) tsys_dist__nap_us(50);
    }
    tsys_event_release(d->ctx, &ev);
    return ok;
}

// ---- symmetric windows (tsys_dist_tensor_new) ----------------------------------------------------
// A window outlives neither its group nor its memory: the tensor's last release deregisters it (while the
// group lives) and frees the memory; tsys_dist_free deregisters the ones still alive and leaves them the
// freeing (d = NULL).
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
#define TSYS_DIST__WINDOWS 1
typedef struct tsys_dist__window {
    tsys_dist *d;
    ncclWindow_t win;
    struct tsys_dist__window *next;
} tsys_dist__window;

static void tsys_dist__window_unlink(tsys_dist *d, tsys_dist__window *w) {
    for (tsys_dist__window **p = &d->windows; *p; p = &(*p)->next)
        if (*p == w) { *p = w->next; return; }
}
static void tsys_dist__window_release(void *user, void *data, size_t bytes) {
    tsys_dist__window *w = (tsys_dist__window *)user;
    (void)bytes;
    if (w->d) {
        tsys_dist *d = w->d;
        tsys_dist__window_unlink(d, w);
        tsys_dist__err e;
        memset(&e, 0, sizeof e);
        if (d->nccl && !TSYS_DIST__LOAD(&d->broken)) {
            ncclResult_t r = ncclCommWindowDeregister(d->nccl, w->win);
            if (tsys_dist__nccl_ok(d, r, "ncclCommWindowDeregister", &e) && r == ncclInProgress) tsys_dist__nccl_settle(d, "ncclCommWindowDeregister", &e);
            if (e.status != TSYS_OK) tsys_dist__fail(d, e.status, "%s", e.msg);
        }
    }
    ncclResult_t r = ncclMemFree(data);
    if (r != ncclSuccess) fprintf(stderr, "tsys_dist: ncclMemFree: %s\n", ncclGetErrorString(r));   // nobody else to tell
    free(w);
}
#endif
// NCCL 2.27 to 2.28.6's symmetric kernels could corrupt data for sizes that are not a multiple of 8 bytes and for
// several symmetric collectives in one group (fixed in 2.28.7). Seen with 2.28.3: reduce-scatters and
// all-gathers of 4097 elements a rank came back wrong (test_dist). Such a collective on a window is refused.
static bool tsys_dist__window_ok(tsys_dist *d, const char *fn, const tsys_tensor *in, const tsys_tensor *out, int64_t bytes) {
#ifdef TSYS_DIST__WINDOWS
    const bool window = in->storage->release == tsys_dist__window_release || out->storage->release == tsys_dist__window_release;
    if (!window || d->nccl_version >= NCCL_VERSION(2, 28, 7) || (bytes % 8 == 0 && !d->group_open)) return true;
    const int v = d->nccl_version;
    tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: NCCL %d.%d.%d's symmetric kernels can corrupt a collective on a window (tsys_dist_tensor_new) %s (fixed in NCCL 2.28.7): %s",
                    fn, v / 10000, v / 100 % 100, v % 100, bytes % 8 ? "whose size is not a multiple of 8 bytes" : "inside a group",
                    bytes % 8 ? "make it a multiple of 8 bytes, or use tsys_tensor_new's memory" : "issue it outside tsys_dist_group_begin / _end");
    return false;
#else
    (void)d; (void)fn; (void)in; (void)out; (void)bytes;
    return true;
#endif
}
// Deregisters every window still alive (the group is about to go; its ranks all come here).
static void tsys_dist__windows_drop(tsys_dist *d) {
#ifdef TSYS_DIST__WINDOWS
    while (d->windows) {
        tsys_dist__window *w = d->windows;
        d->windows = w->next;
        w->d = NULL;
        ncclResult_t r = ncclCommWindowDeregister(d->nccl, w->win);
        if (r != ncclSuccess && r != ncclInProgress) fprintf(stderr, "tsys_dist rank %d: ncclCommWindowDeregister at tsys_dist_free: %s\n", d->rank, ncclGetErrorString(r));
    }
#else
    (void)d;
#endif
}
// A broken group: the communicator is aborted, its windows with it; the memory is freed with the tensors.
static void tsys_dist__windows_orphan(tsys_dist *d) {
#ifdef TSYS_DIST__WINDOWS
    for (tsys_dist__window *w = d->windows; w; w = w->next) w->d = NULL;
    d->windows = NULL;
#else
    (void)d;
#endif
}

// Waits (bounded) for the NCCL work issued so far. While a CUDA graph is being captured nothing runs,
// so there is nothing to wait for; an aborted communicator has nothing left either (the group is broken).
static bool tsys_dist__nccl_barrier(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    (void)c;
    return !d->nccl || tsys_cuda_capturing(d->ctx) || tsys_dist__nccl_drain(d, "barrier", e);
}

static void tsys_dist__nccl_teardown(tsys_dist *d, bool finalize, bool broken) {
    (void)finalize;
    if (d->ce) {   // every rank's collectives end before any rank frees what its peers write into
        tsys_dist__err e;
        memset(&e, 0, sizeof e);
        int32_t one = 1;
        const bool synced = !broken && d->nccl && tsys_dist__nccl_drain(d, "tsys_dist_free", &e) &&
                            tsys_dist__setup_allreduce_i32(d, &one, 1, TSYS_DIST_SUM, &e);
        tsys_dist__ce_teardown(d, synced);
    }
    if (d->nccl) {
        if (broken) { tsys_dist__windows_orphan(d); ncclCommAbort(d->nccl); }
        else {
            tsys_dist__err e;
            memset(&e, 0, sizeof e);
            // a blocking ncclCommFinalize waits for the collectives in flight: first make sure they end
            bool drained = tsys_dist__nccl_drain(d, "tsys_dist_free", &e);
            if (drained) tsys_dist__windows_drop(d);
            if (drained && d->nccl) {
                ncclCommFinalize(d->nccl);
                tsys_dist__nccl_settle(d, "ncclCommFinalize", &e);
            }
            if (d->nccl) ncclCommDestroy(d->nccl);
        }
        d->nccl = NULL;
    }
    if (d->ev_ready.handle) tsys_event_release(d->ctx, &d->ev_ready);
}

// The peers NCCL waits for are watched through the host engine (tsys_dist__dead_peers).
static const tsys_dist__engine tsys_dist__engine_nccl = { "nccl", TSYS_DIST_ENGINE_NCCL, tsys_dist__nccl_coll, tsys_dist__nccl_barrier, NULL, tsys_dist__nccl_teardown };
#endif   // TSYS_DIST_NCCL

// >>group -----------------------------------------------------------------------------------------
// A group holds three engines (>>engines):
//   launch  the one that formed it: mpi (mpirun / srun), tcp (tsys_dist_spawn, torchrun-style
//           variables) or self (a group of one); what tsys_dist_engine_of reports without NCCL
//   host    the one that runs host collectives: self in a group of one, shm when the segment is
//           mapped, else launch
//   device  nccl when the group has a communicator (CUDA tensors), else NULL (host staging)
// tsys_dist_init sets them up in that order; tsys_dist__teardown undoes them in reverse.

#if defined(TSYS_DIST_NCCL) || defined(TSYS_DIST_MPI)
// The peers this rank can tell are gone without their help, as the host engine sees them (by pid on
// one host, by a closed socket in the TCP star; MPI cannot tell). Names them in buf; returns how many.
static int tsys_dist__dead_peers(tsys_dist *d, char *buf, size_t n) {
    buf[0] = 0;
    return d->host->dead_peers ? d->host->dead_peers(d, buf, n) : 0;
}
#endif

// Runs one host collective on the group's host engine. Touches only the group's transport state,
// never the tsys context: the worker thread calls it too.
static bool tsys_dist__host_exec(tsys_dist *d, const tsys_dist__coll *c, tsys_dist__err *e) {
    if (TSYS_DIST__LOAD(&d->broken))
        return tsys_dist__seterr(e, TSYS_ERR_IO, "%s #%lld: the group is broken since: %s", tsys_dist__kind_names[c->kind], (long long)c->seq, d->broken_msg);
    return c->kind == TSYS_DIST__BARRIER ? d->host->barrier(d, c, e) : d->host->collective(d, c, e);
}

// ---- the worker: asynchronous host collectives run on it, in the order they were issued ----------
static void *tsys_dist__worker_main(void *arg) {
    tsys_dist *d = (tsys_dist *)arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->q_head && !d->worker_stop) pthread_cond_wait(&d->cv, &d->mu);
        if (!d->q_head) break;
        tsys_dist_work *w = d->q_head;
        d->q_head = w->next;
        if (!d->q_head) d->q_tail = NULL;
        d->worker_busy = true;
        pthread_mutex_unlock(&d->mu);
        tsys_dist__host_exec(d, &w->c, &w->err);
        pthread_mutex_lock(&d->mu);
        w->done = 1;
        d->worker_busy = false;
        pthread_cond_broadcast(&d->cv_done);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

// Waits until the worker has run everything queued (a blocking collective goes after them).
static void tsys_dist__drain(tsys_dist *d) {
    if (!d->worker_on) return;
    pthread_mutex_lock(&d->mu);
    while (d->q_head || d->worker_busy) pthread_cond_wait(&d->cv_done, &d->mu);
    pthread_mutex_unlock(&d->mu);
}

// Asynchronous host collectives get a worker thread, except in a group of one and on MPI without
// MPI_THREAD_MULTIPLE (initialized so by the caller), where they run at launch.
static void tsys_dist__worker_start(tsys_dist *d) {
    bool threads_ok = d->launch != &tsys_dist__engine_self && d->size > 1;
#ifdef TSYS_DIST_MPI
    if (d->host == &tsys_dist__engine_mpi && !d->mpi_multiple) threads_ok = false;
#endif
    if (!threads_ok) return;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    pthread_cond_init(&d->cv_done, NULL);
    if (pthread_create(&d->worker, NULL, tsys_dist__worker_main, d) == 0) d->worker_on = true;
    else { pthread_mutex_destroy(&d->mu); pthread_cond_destroy(&d->cv); pthread_cond_destroy(&d->cv_done); }
}
// Runs what is queued, then stops the worker.
static void tsys_dist__worker_stop(tsys_dist *d) {
    if (!d->worker_on) return;
    tsys_dist__drain(d);
    pthread_mutex_lock(&d->mu);
    d->worker_stop = true;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->worker, NULL);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    pthread_cond_destroy(&d->cv_done);
    d->worker_on = false;
}

// ---- making and freeing a group -------------------------------------------------------------------

// Records an engine about to be set up: its teardown runs even when the setup fails halfway.
static void tsys_dist__made(tsys_dist *d, const tsys_dist__engine *eng) {
    TSYS_ASSERT(d->nmade < (int)(sizeof d->made / sizeof d->made[0]));
    d->made[d->nmade++] = eng;
}

static void tsys_dist__teardown(tsys_dist *d, bool finalize) {
    tsys_dist__worker_stop(d);
    const bool broken = TSYS_DIST__LOAD(&d->broken) != 0;   // before the engines go: one view for all of them
    for (int i = d->nmade - 1; i >= 0; i--)
        if (d->made[i]->teardown) d->made[i]->teardown(d, finalize, broken);
    d->nmade = 0;
}

// Under mpirun / srun, or with MPI initialized already: an MPI rank (*joined), set up by the MPI engine.
static bool tsys_dist__join_mpi(tsys_dist *d, const char **what, bool *joined, tsys_dist__err *e) {
    bool by_mpi = tsys_dist__launched_by_mpi();
#ifdef TSYS_DIST_MPI
    int inited = 0;
    MPI_Initialized(&inited);
    by_mpi = by_mpi || inited;
    // an explicit MPI engine in a process started alone is an MPI singleton (a group of one)
    if (!by_mpi && d->opt.engine == TSYS_DIST_ENGINE_MPI && !tsys_dist__env("RANK") && !tsys_dist__env("WORLD_SIZE")) by_mpi = true;
    *joined = by_mpi;
    if (!by_mpi) return true;
    *what = "tsys_dist_init (MPI)";
    tsys_dist__made(d, &tsys_dist__engine_mpi);
    return tsys_dist__mpi_setup(d, e);
#else
    (void)d; (void)what;
    *joined = false;
    if (!by_mpi) return true;
    const char *n = tsys_dist__env("OMPI_COMM_WORLD_SIZE");
    if (!n) n = tsys_dist__env("PMI_SIZE");
    if (!n) n = tsys_dist__env("SLURM_NTASKS");
    if (n && strcmp(n, "1"))
        return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "started by mpirun/srun with %s ranks, but this program was built without TSYS_DIST_MPI: "
                                 "rebuild it with -DTSYS_DIST_MPI and MPI's flags, or start it with --nproc / torchrun-style variables", n);
    return true;   // an MPI job of one rank: a group of one
#endif
}

// Torchrun-style variables (tsys_dist_spawn sets them too): the TCP rendezvous forms the group.
static bool tsys_dist__join_tcp(tsys_dist *d, tsys_dist__err *e) {
    long rank = -1, size = -1, port = 29500, v = 0;
    bool b1 = false, b2 = false, b3 = false, b4 = false;
    if (!tsys_dist__env_long("WORLD_SIZE", 1, 1 << 20, &size, &b1) || !tsys_dist__env_long("RANK", 0, size - 1, &rank, &b2))
        return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "RANK='%s' and WORLD_SIZE='%s' must both be set: 0 <= RANK < WORLD_SIZE",
                                 getenv("RANK") ? getenv("RANK") : "", getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : "");
    d->rank = (int)rank; d->size = (int)size;
    if (tsys_dist__env_long("LOCAL_RANK", 0, 1L << 20, &v, &b3)) d->local_rank = (int)v;
    else d->local_rank = d->rank;
    if (b3) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "LOCAL_RANK='%s' is not a rank", getenv("LOCAL_RANK"));
    d->local_size = d->size; d->one_host = true;
    if (d->size == 1) return true;
    tsys_dist__env_long("MASTER_PORT", 1, 65535, &port, &b4);
    if (b4) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "MASTER_PORT='%s' is not a port", getenv("MASTER_PORT"));
    const char *addr = tsys_dist__env("MASTER_ADDR");
    tsys_dist__made(d, &tsys_dist__engine_tcp);
    if (!tsys_dist__tcp_setup(d, addr ? addr : "127.0.0.1", (int)port, e)) return false;
    d->launch = &tsys_dist__engine_tcp;
    return true;
}

// The launch engine, in the order of preference at the top of the file: MPI, the TCP rendezvous, alone.
static bool tsys_dist__join_group(tsys_dist *d, const char **what, tsys_dist__err *e) {
    bool by_mpi = false;
    if (!tsys_dist__join_mpi(d, what, &by_mpi, e)) return false;
    if (by_mpi || (!tsys_dist__env("RANK") && !tsys_dist__env("WORLD_SIZE"))) return true;
    *what = "tsys_dist_init (TCP rendezvous)";
    return tsys_dist__join_tcp(d, e);
}

// The engine asked for, against the way this process was started.
static bool tsys_dist__engine_fits(const tsys_dist *d, tsys_dist__err *e) {
    switch (d->opt.engine) {
    case TSYS_DIST_ENGINE_SELF:
        if (d->size > 1) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "engine self is a group of one, but this process is rank %d of %d", d->rank, d->size);
        break;
    case TSYS_DIST_ENGINE_MPI:
#ifdef TSYS_DIST_MPI
        if (d->launch != &tsys_dist__engine_mpi)
            return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "engine mpi needs the ranks started by mpirun/srun; these were started by tsys_dist_spawn or torchrun-style "
                                     "variables: ask for TSYS_DIST_ENGINE_TCP (the host engine of such ranks; no NCCL) or AUTO");
#else
        return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "engine mpi: built without TSYS_DIST_MPI");
#endif
        break;
    case TSYS_DIST_ENGINE_NCCL:
#ifndef TSYS_DIST_NCCL
        return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "engine nccl: built without TSYS_DIST_NCCL");
#endif
        if (!d->opt.cuda) return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "engine nccl needs desc.cuda (NCCL moves CUDA tensors)");
        break;
    case TSYS_DIST_ENGINE_TCP:
        if (d->size > 1 && d->launch != &tsys_dist__engine_tcp)
            return tsys_dist__seterr(e, TSYS_ERR_INVALID_ARGS, "engine tcp needs ranks started by tsys_dist_spawn or torchrun-style variables, not mpirun");
        break;
    default: break;
    }
    return true;
}

// desc.cuda: this rank's GPU is local rank mod the device count, unless the context has a CUDA backend.
static bool tsys_dist__cuda_setup(tsys_dist *d, tsys_dist__err *e) {
#ifdef TSYS_CUDA_H_INCLUDED
    tsys_ctx *ctx = d->ctx;
    if (!tsys_ctx_backend(ctx, TSYS_CUDA) || !tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE)) {
        int count = tsys_cuda_device_count();
        if (count <= 0) return tsys_dist__seterr(e, TSYS_ERR_CUDA, "desc.cuda: no CUDA device is visible");
        if (tsys_cuda_init(ctx, d->local_rank % count) != TSYS_OK) return tsys_dist__seterr(e, TSYS_ERR_CUDA, "GPU %d: %s", d->local_rank % count, tsys_ctx_last_error(ctx));
    }
    d->cuda = true;
    return true;
#else
    (void)d;
    return tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "desc.cuda: this program was built without CUDA (include tsys_cuda.cuh before tsys_dist.h)");
#endif
}

// Ranks all on this host (at most 512: the segment's records) share a segment unless desc.no_shm; a
// segment that cannot be made leaves the path off (shm_note says why), not the group.
static bool tsys_dist__shm_join(tsys_dist *d, tsys_dist__err *e) {
    if (d->size == 1) return true;
    if (!d->one_host || d->size > 512) {
        snprintf(d->shm_note, sizeof d->shm_note, "shared memory off: the ranks are on %s", d->one_host ? "more than 512 ranks" : "several hosts");
        return true;
    }
    if (d->opt.no_shm) { snprintf(d->shm_note, sizeof d->shm_note, "shared memory off: TSYS_DIST_SHM=0 (desc.no_shm)"); return true; }
    tsys_dist__made(d, &tsys_dist__engine_shm);
    if (!tsys_dist__shm_setup(d, e)) return false;
    if (d->shm_base) d->host = &tsys_dist__engine_shm;
    return true;
}

// A CUDA group of several ranks (or one that asks for NCCL) gets a communicator, when built with NCCL.
static bool tsys_dist__device_join(tsys_dist *d, const char **what, tsys_dist__err *e) {
#ifdef TSYS_DIST_NCCL
    if (!d->cuda || !(d->opt.engine == TSYS_DIST_ENGINE_NCCL || (d->opt.engine == TSYS_DIST_ENGINE_AUTO && d->size > 1))) return true;
    *what = "tsys_dist_init (NCCL)";
    tsys_dist__made(d, &tsys_dist__engine_nccl);
    if (!tsys_dist__nccl_setup(d, e)) return false;
    if (d->opt.ce_allreduce && !tsys_dist__ce_setup(d, e)) return false;
    d->device = &tsys_dist__engine_nccl;
    tsys_dist__warn_one_cpu(d);
#else
    (void)d; (void)what; (void)e;
#endif
    return true;
}

// The options' strings, copied into the group: the caller's and the environment's may change or go.
static void tsys_dist__keep_strings(tsys_dist *d) {
    if (d->opt.run_id) { tsys_dist__strcpy(d->run_id, sizeof d->run_id, d->opt.run_id); d->opt.run_id = d->run_id; }
    if (d->opt.secret) { tsys_dist__strcpy(d->secret, sizeof d->secret, d->opt.secret); d->opt.secret = d->secret; }
    if (d->opt.listen_addr) { tsys_dist__strcpy(d->listen_addr, sizeof d->listen_addr, d->opt.listen_addr); d->opt.listen_addr = d->listen_addr; }
}

TSYSDEF tsys_dist *tsys_dist_init(tsys_ctx *ctx, const tsys_dist_desc *desc) {
    if (!ctx) return NULL;
    tsys_dist *d = (tsys_dist *)calloc(1, sizeof *d);
    if (!d) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_dist_init: out of host memory"); return NULL; }
    d->ctx = ctx; d->size = 1; d->local_size = 1; d->spin_limit = 1024;
    d->launch = d->host = &tsys_dist__engine_self;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    const char *what = "tsys_dist_init";
    if (!tsys_dist__options(desc, &d->opt, &e)) goto fail;
    tsys_dist__keep_strings(d);
    d->timeout_s = d->opt.timeout_s;
    d->check_none = d->opt.check == TSYS_DIST_CHECK_NEVER;
    d->check_all = !d->check_none && (TSYS_DEBUG || d->opt.check == TSYS_DIST_CHECK_ALWAYS);
    if (gethostname(d->hostname, sizeof d->hostname - 1) != 0) snprintf(d->hostname, sizeof d->hostname, "localhost");
    if (!tsys_dist__join_group(d, &what, &e)) goto fail;
    what = "tsys_dist_init";
    if (!tsys_dist__engine_fits(d, &e)) goto fail;
    if (d->size == 1 && d->opt.engine != TSYS_DIST_ENGINE_MPI) d->launch = &tsys_dist__engine_self;   // an MPI singleton stays mpi when asked
    d->host = d->size > 1 ? d->launch : &tsys_dist__engine_self;
    if (d->opt.cuda && !tsys_dist__cuda_setup(d, &e)) goto fail;
    if (!tsys_dist__shm_join(d, &e) || !tsys_dist__device_join(d, &what, &e)) goto fail;
    d->engine = d->device ? d->device->kind : d->launch->kind;
    tsys_dist_share_cores(d->local_size);   // as torchrun does: unless OMP_NUM_THREADS is set
    tsys_dist__worker_start(d);
    return d;
fail:
    tsys_ctx_set_error(ctx, e.status ? e.status : TSYS_ERR_INVALID_ARGS, "%s: rank %d: %s", what, d->rank, e.msg);
    tsys_dist__teardown(d, false);   // MPI stays initialized (a later group may still use it)
    free(d);
    return NULL;
}

TSYSDEF void tsys_dist_free(tsys_dist *d) {
    if (!d) return;
    tsys_dist__teardown(d, true);
    free(d);
}

TSYSDEF int64_t tsys_dist_device_bytes(const tsys_dist *d) {
#ifdef TSYS_DIST_NCCL
    if (d && d->ce) return tsys_dist__ce_in_row(d, TSYS_DIST__CE_SLOTS, 0) + (int64_t)sizeof(tsys_dist__ce_flags);
#endif
    (void)d;
    return 0;
}

TSYSDEF tsys_dist_desc tsys_dist_get_desc(const tsys_dist *d) {
    tsys_dist_desc o;
    memset(&o, 0, sizeof o);
    if (!d) { o.engine = TSYS_DIST_ENGINE_SELF; return o; }
    o = d->opt;
    o.engine = d->engine;
    o.cuda = d->cuda;
    o.shm_slice = d->shm_base ? (int64_t)d->slice : (int64_t)tsys_dist__shm_slice_for(d->size, d->opt.shm_slice);
    o.check = d->check_none ? TSYS_DIST_CHECK_NEVER : d->check_all ? TSYS_DIST_CHECK_ALWAYS : TSYS_DIST_CHECK_AUTO;
    return o;
}

TSYSDEF int tsys_dist_rank(const tsys_dist *d) { return d ? d->rank : 0; }
TSYSDEF int tsys_dist_size(const tsys_dist *d) { return d ? d->size : 1; }
TSYSDEF int tsys_dist_local_rank(const tsys_dist *d) { return d ? d->local_rank : 0; }
TSYSDEF int tsys_dist_local_size(const tsys_dist *d) { return d && d->local_size > 0 ? d->local_size : 1; }
TSYSDEF tsys_dist_engine tsys_dist_engine_of(const tsys_dist *d) { return d ? d->engine : TSYS_DIST_ENGINE_SELF; }
TSYSDEF tsys_ctx *tsys_dist_ctx(const tsys_dist *d) { return d ? d->ctx : NULL; }
TSYSDEF const char *tsys_dist_engine_name(tsys_dist_engine e) {
    switch (e) {
    case TSYS_DIST_ENGINE_AUTO: return "auto";
    case TSYS_DIST_ENGINE_MPI: return "mpi";
    case TSYS_DIST_ENGINE_NCCL: return "nccl";
    case TSYS_DIST_ENGINE_SELF: return "self";
    case TSYS_DIST_ENGINE_TCP: return "tcp";
    }
    return "?";
}

// >>subgroups -------------------------------------------------------------------------------------
// tsys_dist_split: a group of some of a group's ranks. Two exchanges over the parent d (the host
// engine's all-gather, from the calling thread after d's queued work): first every rank's color and
// key, from which each computes its group; then, on TCP, where each group's first rank listens and
// the group's one-time token. The group then forms as tsys_dist_init forms one (its launch engine,
// shared memory on one host, NCCL for CUDA), and the ranks agree over d on whether every group formed.

// What each rank tells the others (all-gathered over the parent, twice).
typedef struct tsys_dist__split_rec {
    int32_t color, key;
    int32_t name_len;              // the name's length: checked on every rank alike
    int32_t port;                  // TCP: where the group's first rank listens (0: it does not)
    char addr[64];                 // TCP: its address, numeric
    uint8_t token[16];             // TCP: the group's one-time identity
} tsys_dist__split_rec;

static bool tsys_dist__setup_all_gather(tsys_dist *d, const void *mine, void *all, int64_t bytes, tsys_dist__err *e) {
    tsys_dist__coll c;
    memset(&c, 0, sizeof c);
    c.kind = TSYS_DIST__AG; c.type = TSYS_DIST__U8; c.count = bytes; c.in = (void *)mine; c.out = all; c.seq = d->seq++;
    c.check = tsys_dist__wants_check(d, bytes * d->size, TSYS_DIST__CHECK_BYTES);
    return tsys_dist__host_exec(d, &c, e);
}

// The members of this rank's group (ranks of d, in the group's order); how many; this rank's place.
static int tsys_dist__split_members(const tsys_dist *d, const tsys_dist__split_rec *recs, int *members, int *me) {
    int n = 0;
    for (int r = 0; r < d->size; r++) {
        if (recs[r].color != recs[d->rank].color) continue;
        int at = n++;   // insertion by (key, rank): ranks come in rank order, so ties keep it
        while (at > 0 && recs[members[at - 1]].key > recs[r].key) { members[at] = members[at - 1]; at--; }
        members[at] = r;
    }
    for (int i = 0; i < n; i++) if (members[i] == d->rank) *me = i;
    return n;
}

// A group of d's options, context and checks, not formed yet (a group of one until its engines are set up).
static tsys_dist *tsys_dist__sub_new(const tsys_dist *d, int rank, int size, const char *name) {
    tsys_dist *s = (tsys_dist *)calloc(1, sizeof *s);
    if (!s) return NULL;
    s->ctx = d->ctx; s->rank = rank; s->size = size; s->local_rank = 0; s->local_size = 1; s->one_host = true;
    s->spin_limit = 1024;
    s->opt = d->opt;
    tsys_dist__keep_strings(s);
    s->timeout_s = d->timeout_s;
    s->check_all = d->check_all; s->check_none = d->check_none;
    memcpy(s->hostname, d->hostname, sizeof s->hostname);
    tsys_dist__strcpy(s->label, sizeof s->label, name && *name ? name : "split");
    s->parent_rank = d->rank;
    s->launch = s->host = &tsys_dist__engine_self;
    return s;
}

#ifdef TSYS_DIST_MPI
// MPI_Comm_split has no non-blocking form: the all-gather just before it showed every rank alive.
static bool tsys_dist__split_mpi(tsys_dist *s, tsys_dist *d, int color, int key, tsys_dist__err *e) {
    tsys_dist__made(s, &tsys_dist__engine_mpi);
    if (!tsys_dist__mpi_ok(s, MPI_Comm_split(d->comm, color, key, &s->comm), "MPI_Comm_split", NULL, e)) return false;
    s->have_comm = true;
    s->mpi_multiple = d->mpi_multiple;
    MPI_Comm local;
    int rank = -1;
    if (!tsys_dist__mpi_ok(s, MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", NULL, e) ||
        !tsys_dist__mpi_ok(s, MPI_Comm_rank(s->comm, &rank), "MPI_Comm_rank", NULL, e) ||
        !tsys_dist__mpi_ok(s, MPI_Comm_split_type(s->comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local), "MPI_Comm_split_type", NULL, e)) return false;
    bool ok = tsys_dist__mpi_ok(s, MPI_Comm_rank(local, &s->local_rank), "MPI_Comm_rank", NULL, e) &&
              tsys_dist__mpi_ok(s, MPI_Comm_size(local, &s->local_size), "MPI_Comm_size", NULL, e);
    MPI_Comm_free(&local);
    if (!ok) return false;
    if (rank != s->rank) return tsys_dist__seterr(e, TSYS_ERR_IO, "MPI_Comm_split ranked this rank %d, the split's rule %d", rank, s->rank);
    s->one_host = s->local_size == s->size;
    s->launch = &tsys_dist__engine_mpi;
    return true;
}
#endif

// The group's first rank listens where d's star reaches it (the local address of its connection to
// d's first rank, or from it), on a port the system picks.
static int tsys_dist__split_listen(const tsys_dist *d, tsys_dist__split_rec *rec, bool *loopback, tsys_dist__err *e) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    const int via = d->fds[d->rank == 0 ? 1 : 0];
    if (getsockname(via, (struct sockaddr *)&ss, &sl) != 0) { tsys_dist__seterr(e, TSYS_ERR_IO, "split: getsockname: %s", strerror(errno)); return -1; }
    if (ss.ss_family == AF_INET) ((struct sockaddr_in *)&ss)->sin_port = 0;
    else if (ss.ss_family == AF_INET6) ((struct sockaddr_in6 *)&ss)->sin6_port = 0;
    else { tsys_dist__seterr(e, TSYS_ERR_UNSUPPORTED, "split: the group's sockets are of address family %d, not IPv4 or IPv6", (int)ss.ss_family); return -1; }
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&ss, sl) != 0 || listen(fd, TSYS_DIST__PENDING) != 0 || getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
        tsys_dist__seterr(e, TSYS_ERR_IO, "split: cannot listen for the group: %s", strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    char where[96];
    tsys_dist__addr_str((struct sockaddr *)&ss, where, sizeof where);
    *strrchr(where, ':') = 0;
    tsys_dist__strcpy(rec->addr, sizeof rec->addr, where);
    rec->port = ss.ss_family == AF_INET ? ntohs(((struct sockaddr_in *)&ss)->sin_port) : ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    *loopback = tsys_dist__is_loopback((struct sockaddr *)&ss);
    return fd;
}

// The group's identity: a run id from the token, and a secret only d's ranks can compute (an HMAC of the
// token under d's secret; the token alone where d has none, as d's own run id was then its only identity).
static void tsys_dist__split_ident(const tsys_dist *d, const uint8_t token[16], tsys_dist__ident *id) {
    memset(id, 0, sizeof *id);
    int l = snprintf(id->run_id, sizeof id->run_id, "split-");
    for (int i = 0; i < 16; i++) l += snprintf(id->run_id + l, sizeof id->run_id - (size_t)l, "%02x", token[i]);
    if (d->opt.secret) {
        tsys_dist__hmac((const uint8_t *)d->opt.secret, strlen(d->opt.secret), token, 16, "tsys_dist_split", 15, id->secret);
        id->secret_len = 32;
    } else {
        memcpy(id->secret, token, 16);
        id->secret_len = 16;
    }
}

// The group's TCP star around its first rank (lfd: its listener, else -1), from the second exchange.
static bool tsys_dist__split_tcp(tsys_dist *s, const tsys_dist *d, const tsys_dist__split_rec *root, int lfd, bool loopback, tsys_dist__err *e) {
    tsys_dist__made(s, &tsys_dist__engine_tcp);
    s->fds = (int *)TSYS_MALLOC(sizeof(int) * (size_t)s->size);
    tsys_dist__hello *table = (tsys_dist__hello *)calloc((size_t)s->size, sizeof(tsys_dist__hello));
    if (!s->fds || !table) { free(table); if (lfd >= 0) close(lfd); return tsys_dist__seterr(e, TSYS_ERR_OOM, "split: out of host memory"); }
    tsys_dist__tcp_hello_mine(s, table);
    tsys_dist__ident id;
    tsys_dist__split_ident(d, root->token, &id);
    const bool ok = s->rank == 0 ? tsys_dist__tcp_rank0(s, lfd, loopback, root->addr, root->port, &id, table, e)
                                 : tsys_dist__tcp_peer(s, root->addr, root->port, tsys_time_us(), &id, table, e);
    if (ok) s->local_rank = tsys_dist__tcp_locals(s, table);
    free(table);
    if (ok) s->launch = &tsys_dist__engine_tcp;
    return ok;
}

// This rank's group after the exchanges: its launch engine, then shared memory and NCCL as tsys_dist_init.
static bool tsys_dist__split_form(tsys_dist *s, tsys_dist *d, const tsys_dist__split_rec *recs, const int *members, int lfd, bool loopback, tsys_dist__err *e) {
    const char *what = "split";
#ifdef TSYS_DIST_MPI
    if (d->launch == &tsys_dist__engine_mpi) {   // collective over d: groups of one split too
        if (!tsys_dist__split_mpi(s, d, recs[d->rank].color, recs[d->rank].key, e)) return false;
    } else
#endif
    if (s->size > 1 && !tsys_dist__split_tcp(s, d, &recs[members[0]], lfd, loopback, e)) return false;
    if (s->size == 1) s->launch = &tsys_dist__engine_self;
    s->host = s->launch;
    s->cuda = d->cuda;
    if (!tsys_dist__shm_join(s, e) || !tsys_dist__device_join(s, &what, e)) return false;
    s->engine = s->device ? s->device->kind : s->launch->kind;
    tsys_dist__worker_start(s);
    return true;
}

// Whether every rank of d is fine so far (else e names the first failing rank of d, unless it is this one).
static bool tsys_dist__split_agree(tsys_dist *d, tsys_dist__err *e) {
    int32_t failed = e->status != TSYS_OK ? d->size - d->rank : 0;
    tsys_dist__err ae;
    memset(&ae, 0, sizeof ae);
    if (!tsys_dist__setup_allreduce_i32(d, &failed, 1, TSYS_DIST_MAX, &ae)) { if (e->status == TSYS_OK) *e = ae; return false; }
    if (failed && e->status == TSYS_OK) tsys_dist__seterr(e, TSYS_ERR_IO, "rank %d could not form its group (its own error says why)", d->size - failed);
    return !failed;
}

TSYSDEF tsys_dist *tsys_dist_split(tsys_dist *d, int color, int key, const char *name) {
    if (!d) return NULL;
    if (TSYS_DIST__LOAD(&d->broken)) { tsys_dist__fail(d, TSYS_ERR_IO, "tsys_dist_split: the group is broken since: %s", d->broken_msg); return NULL; }
    if (d->group_open) { tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "tsys_dist_split: not between tsys_dist_group_begin and _end"); return NULL; }
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    tsys_dist__split_rec mine, *recs = (tsys_dist__split_rec *)calloc((size_t)d->size, sizeof *recs);
    int *members = (int *)calloc((size_t)d->size, sizeof(int));
    if (!recs || !members) { free(recs); free(members); tsys_dist__fail(d, TSYS_ERR_OOM, "tsys_dist_split: out of host memory"); return NULL; }
    memset(&mine, 0, sizeof mine);
    mine.color = color; mine.key = key; mine.name_len = name ? (int32_t)strlen(name) : 0;
    tsys_dist *s = NULL;
    int lfd = -1, me = 0, n = 0;
    bool loopback = false;
    tsys_dist__drain(d);
    if (!tsys_dist__setup_all_gather(d, &mine, recs, (int64_t)sizeof mine, &e)) goto fail_all;
    for (int r = 0; r < d->size; r++) {   // every rank finds the same first offender
        if (recs[r].color < 0) { tsys_dist__seterr(&e, TSYS_ERR_INVALID_ARGS, "rank %d passed color %d: colors are >= 0 (every rank joins a group)", r, (int)recs[r].color); goto fail_all; }
        if (recs[r].name_len >= (int32_t)sizeof s->label) { tsys_dist__seterr(&e, TSYS_ERR_INVALID_ARGS, "rank %d passed a name of %d characters: at most %d", r, (int)recs[r].name_len, (int)sizeof s->label - 1); goto fail_all; }
    }
    n = tsys_dist__split_members(d, recs, members, &me);
    s = tsys_dist__sub_new(d, me, n, name);
    if (!s) tsys_dist__seterr(&e, TSYS_ERR_OOM, "out of host memory");
    if (d->launch == &tsys_dist__engine_tcp) {   // where each group of several ranks will meet (every rank takes part)
        memset(&mine, 0, sizeof mine);
        if (s && me == 0 && n > 1) {
            lfd = tsys_dist__split_listen(d, &mine, &loopback, &e);
            if (lfd >= 0 && !tsys_dist__random(mine.token, sizeof mine.token)) tsys_dist__seterr(&e, TSYS_ERR_IO, "no random bytes (/dev/urandom): %s", strerror(errno));
        }
        if (!tsys_dist__setup_all_gather(d, &mine, recs, (int64_t)sizeof mine, &e)) goto fail_all;
        if (recs[members[0]].port == 0 && n > 1) tsys_dist__seterr(&e, TSYS_ERR_IO, "rank %d, the group's first, could not listen for it", members[0]);
    }
    // the groups form only if every rank got this far (MPI_Comm_split would wait for a missing rank for ever),
    // and every rank learns whether every group formed
    if (tsys_dist__split_agree(d, &e)) tsys_dist__split_form(s, d, recs, members, lfd, loopback, &e);
    else if (lfd >= 0) close(lfd);
    if (!tsys_dist__split_agree(d, &e)) goto fail_all;
    free(recs); free(members);
    return s;
fail_all:
    if (s) { tsys_dist__teardown(s, false); free(s); }
    free(recs); free(members);
    tsys_dist__fail(d, e.status ? e.status : TSYS_ERR_IO, "tsys_dist_split: %s", e.msg);
    return NULL;
}

// ---- the device mesh -----------------------------------------------------------------------------

struct tsys_dist_mesh {
    tsys_dist *d;
    int ndim, shape[TSYS_DIST_MESH_MAX_DIMS], coord[TSYS_DIST_MESH_MAX_DIMS];
    char names[TSYS_DIST_MESH_MAX_DIMS][32];
    tsys_dist *groups[TSYS_DIST_MESH_MAX_DIMS];
};

// Why shape and names do not make a mesh of d's ranks (the message names the input), or NULL.
static const char *tsys_dist__mesh_fault(const tsys_dist *d, int ndim, const int *shape, const char *const *names, char *why, size_t n) {
    if (ndim < 1 || ndim > TSYS_DIST_MESH_MAX_DIMS) { snprintf(why, n, "ndim %d: a mesh has 1 to %d dimensions", ndim, TSYS_DIST_MESH_MAX_DIMS); return why; }
    if (!shape || !names) { snprintf(why, n, "shape and names must not be NULL"); return why; }
    int64_t ranks = 1;
    for (int i = 0; i < ndim; i++) {
        const char *nm = names[i];
        if (shape[i] < 1) { snprintf(why, n, "shape[%d] = %d: every dimension has at least one rank", i, shape[i]); return why; }
        ranks *= shape[i];
        if (ranks > d->size) break;
        size_t l = nm ? strlen(nm) : 0;
        if (l == 0 || l > 31 || strspn(nm, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_") != l) {
            snprintf(why, n, "names[%d] '%s': a dimension's name is 1-31 characters of [A-Za-z0-9_]", i, nm ? nm : "(null)");
            return why;
        }
        for (int j = 0; j < i; j++) if (!strcmp(names[j], nm)) { snprintf(why, n, "names[%d] and names[%d] are both '%s'", j, i, nm); return why; }
    }
    if (ranks != d->size) {
        int l = snprintf(why, n, "shape ");
        for (int i = 0; i < ndim && l < (int)n; i++) l += snprintf(why + l, n - (size_t)l, "%s%d", i ? " x " : "", shape[i]);
        if (l < (int)n) snprintf(why + l, n - (size_t)l, " is not the group's %d ranks", d->size);
        return why;
    }
    return NULL;
}

// A fingerprint of the mesh's shape and names: every rank must pass the same.
static double tsys_dist__mesh_hash(int ndim, const int *shape, const char *const *names) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < ndim; i++) {
        h = (h ^ (uint64_t)(uint32_t)shape[i]) * 1099511628211ull;
        for (const char *c = names[i]; *c; c++) h = (h ^ (unsigned char)*c) * 1099511628211ull;
        h = (h ^ 0xffu) * 1099511628211ull;
    }
    return (double)(h >> 12);   // exact in a double
}

TSYSDEF tsys_dist_mesh *tsys_dist_mesh_new(tsys_dist *d, int ndim, const int *shape, const char *const *names) {
    if (!d) return NULL;
    char why[200];
    const char *fault = tsys_dist__mesh_fault(d, ndim, shape, names, why, sizeof why);
    // the ranks agree first: on whether every rank's arguments are good, then on the arguments themselves
    double v[3] = { fault ? 1.0 : 0.0, fault ? 0.0 : tsys_dist__mesh_hash(ndim, shape, names), 0.0 };
    v[2] = -v[1];
    if (tsys_dist_all_reduce_host(d, v, 3, TSYS_DIST_MAX) != TSYS_OK) return NULL;
    if (fault) { tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "tsys_dist_mesh_new: %s", fault); return NULL; }
    if (v[0] > 0) { tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "tsys_dist_mesh_new: another rank's shape or names are bad (its error says why)"); return NULL; }
    if (v[1] != -v[2]) { tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "tsys_dist_mesh_new: the ranks passed different shapes or names"); return NULL; }
    tsys_dist_mesh *m = (tsys_dist_mesh *)calloc(1, sizeof *m);
    if (!m) { tsys_dist__fail(d, TSYS_ERR_OOM, "tsys_dist_mesh_new: out of host memory"); return NULL; }
    m->d = d; m->ndim = ndim;
    int stride = d->size;
    for (int i = 0; i < ndim; i++) {
        stride /= shape[i];
        m->shape[i] = shape[i];
        m->coord[i] = d->rank / stride % shape[i];
        tsys_dist__strcpy(m->names[i], sizeof m->names[i], names[i]);
    }
    for (int i = 0; i < ndim; i++) {   // dimension i's group: the ranks with the other coordinates of this one
        int color = 0;
        for (int j = 0; j < ndim; j++) color = color * shape[j] + (j == i ? 0 : m->coord[j]);
        m->groups[i] = tsys_dist_split(d, color, m->coord[i], names[i]);
        if (!m->groups[i]) { tsys_dist_mesh_free(m); return NULL; }   // every rank fails at the same dimension
    }
    return m;
}

static int tsys_dist__mesh_dim(const tsys_dist_mesh *m, const char *dim) {
    for (int i = 0; m && dim && i < m->ndim; i++) if (!strcmp(m->names[i], dim)) return i;
    return -1;
}
TSYSDEF tsys_dist *tsys_dist_mesh_group(const tsys_dist_mesh *m, const char *dim) {
    int i = tsys_dist__mesh_dim(m, dim);
    if (i < 0 && m) tsys_dist__fail(m->d, TSYS_ERR_INVALID_ARGS, "tsys_dist_mesh_group: the mesh has no dimension '%s'", dim ? dim : "(null)");
    return i < 0 ? NULL : m->groups[i];
}
TSYSDEF int tsys_dist_mesh_coord(const tsys_dist_mesh *m, const char *dim) { int i = tsys_dist__mesh_dim(m, dim); return i < 0 ? -1 : m->coord[i]; }
TSYSDEF int tsys_dist_mesh_dim_size(const tsys_dist_mesh *m, const char *dim) { int i = tsys_dist__mesh_dim(m, dim); return i < 0 ? -1 : m->shape[i]; }
TSYSDEF int tsys_dist_mesh_ndim(const tsys_dist_mesh *m) { return m ? m->ndim : 0; }
TSYSDEF void tsys_dist_mesh_free(tsys_dist_mesh *m) {
    if (!m) return;
    for (int i = m->ndim - 1; i >= 0; i--) tsys_dist_free(m->groups[i]);
    free(m);
}

// >>collectives -----------------------------------------------------------------------------------
// ---- tensors for collectives ----------------------------------------------------------------------

TSYSDEF tsys_tensor *tsys_dist_tensor_new(tsys_dist *d, tsys_dtype dt, tsys_device dev, int ndim, const int64_t *shape) {
    if (!d) return NULL;
#ifdef TSYS_DIST__WINDOWS
    if (dev == TSYS_CUDA && d->nccl && d->size > 1) {
        if (TSYS_DIST__LOAD(&d->broken)) { tsys_dist__fail(d, TSYS_ERR_IO, "tsys_dist_tensor_new: the group is broken since: %s", d->broken_msg); return NULL; }
        int64_t nbytes = tsys_shape_bytes(d->ctx, dt, ndim, shape);
        if (nbytes < 0) return NULL;
        const size_t bytes = (size_t)nbytes, alloc = bytes ? bytes : 1;
        tsys_dist__err e;
        memset(&e, 0, sizeof e);
        tsys_dist__window *w = (tsys_dist__window *)calloc(1, sizeof *w);
        void *data = NULL;
        if (!w) { tsys_dist__fail(d, TSYS_ERR_OOM, "tsys_dist_tensor_new: out of host memory"); return NULL; }
        ncclResult_t r = ncclMemAlloc(&data, alloc);
        if (r != ncclSuccess) {
            free(w);
            tsys_dist__fail(d, TSYS_ERR_OOM, "tsys_dist_tensor_new: ncclMemAlloc of %zu bytes: %s", bytes, ncclGetErrorString(r));
            return NULL;
        }
        r = ncclCommWindowRegister(d->nccl, data, alloc, &w->win, NCCL_WIN_COLL_SYMMETRIC);
        if (!tsys_dist__nccl_ok(d, r, "ncclCommWindowRegister", &e) || (r == ncclInProgress && !tsys_dist__nccl_settle(d, "ncclCommWindowRegister", &e))) {
            ncclMemFree(data);
            free(w);
            tsys_dist__fail(d, e.status, "tsys_dist_tensor_new: %s", e.msg);
            return NULL;
        }
        w->d = d;
        w->next = d->windows;
        d->windows = w;
        tsys_tensor *t = tsys_tensor_wrap(d->ctx, dt, dev, ndim, shape, data, tsys_dist__window_release, w);
        if (!t) tsys_dist__window_release(w, data, bytes);
        return t;
    }
#endif
    return tsys_tensor_new(d->ctx, dt, dev, ndim, shape);
}

// ---- issuing collectives -------------------------------------------------------------------------

static void tsys_dist__work_free(tsys_dist_work *w) {
    if (!w) return;
#ifdef TSYS_DIST_NCCL
    if (w->path == TSYS_DIST__WORK_NCCL && w->async) w->d->side_inflight--;
#endif
    TSYS_FREE(w->stage_in);
    TSYS_FREE(w->stage_out);
    if (w->dev_out) tsys_tensor_release(w->dev_out);
    if (w->ev.handle) tsys_event_release(w->d->ctx, &w->ev);
    free(w);
}

// Host work finished (by the caller or the worker): copy staged results back to the device, report.
static tsys_status tsys_dist__work_finish(tsys_dist_work *w) {
    tsys_dist *d = w->d;
    tsys_status st = TSYS_OK;
    if (w->err.status != TSYS_OK) st = tsys_dist__fail(d, w->err.status, "%s", w->err.msg);
    else if (w->dev_out && w->out_bytes) {
        const tsys_backend *be = tsys_ctx_backend(d->ctx, w->dev_out->device);
        st = be->copy(d->ctx, tsys_tensor_data(w->dev_out), w->dev_out->device, w->stage_out, TSYS_CPU, w->out_bytes);
    }
    tsys_dist__work_free(w);
    return st;
}

static tsys_dist_work *tsys_dist__issue(tsys_dist *d, const char *fn, int kind, tsys_tensor *out, tsys_tensor *in, tsys_dist_op op, int root, bool async, tsys_status *st) {
    *st = TSYS_ERR_INVALID_ARGS;
    if (!d) return NULL;
    tsys_ctx *ctx = d->ctx;
    if (!out || (kind == TSYS_DIST__RS || kind == TSYS_DIST__AG ? !in : false)) { *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: NULL tensor", fn); return NULL; }
    if (!in) in = out;
    if ((unsigned)op > (unsigned)TSYS_DIST_MAX) { *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: unknown op %d", fn, (int)op); return NULL; }
    if (in->dtype != out->dtype || in->device != out->device) {
        *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: in is %s on %s, out %s on %s: they must match", fn, tsys_dtype_name(in->dtype), in->device == TSYS_CPU ? "cpu" : "cuda",
                              tsys_dtype_name(out->dtype), out->device == TSYS_CPU ? "cpu" : "cuda");
        return NULL;
    }
    if (op == TSYS_DIST_AVG && !tsys_dtype_is_float(out->dtype) && (kind == TSYS_DIST__ALLREDUCE || kind == TSYS_DIST__RS)) {
        *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: AVG needs a floating-point tensor, '%s' is %s (SUM it, then divide)", fn, out->name, tsys_dtype_name(out->dtype));
        return NULL;
    }
    int64_t nout = tsys_tensor_numel(out), nin = tsys_tensor_numel(in);
    if (kind == TSYS_DIST__RS && nin != (int64_t)d->size * nout) {
        *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: in has %lld elements, out %lld: in must hold size (%d) x numel(out) = %lld", fn, (long long)nin, (long long)nout, d->size, (long long)d->size * nout);
        return NULL;
    }
    if (kind == TSYS_DIST__AG && nout != (int64_t)d->size * nin) {
        *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: out has %lld elements, in %lld: out must hold size (%d) x numel(in) = %lld", fn, (long long)nout, (long long)nin, d->size, (long long)d->size * nin);
        return NULL;
    }
    if (kind == TSYS_DIST__BCAST && (root < 0 || root >= d->size)) { *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: root %d is not a rank of this group of %d", fn, root, d->size); return NULL; }
    if (out->device != TSYS_CPU && !tsys_ctx_backend(ctx, out->device)) { *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: the context has no backend for the tensor's device", fn); return NULL; }
    if (TSYS_DIST__LOAD(&d->broken)) { *st = tsys_dist__fail(d, TSYS_ERR_IO, "%s: the group is broken since: %s", fn, d->broken_msg); return NULL; }
    if (d->group_open && !async) { *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: between tsys_dist_group_begin and _end only asynchronous calls may be issued", fn); return NULL; }

    tsys_dist_work *w = (tsys_dist_work *)calloc(1, sizeof *w);
    if (!w) { *st = tsys_dist__fail(d, TSYS_ERR_OOM, "%s: out of host memory", fn); return NULL; }
    tsys_tensor_mark_written(out);   // the collective writes it behind tsys's back (kept weight copies of it go stale)
    w->d = d;
    tsys_dist__coll *c = &w->c;
    c->kind = kind; c->type = out->dtype; c->op = op; c->root = root;
    c->count = kind == TSYS_DIST__RS ? nout : kind == TSYS_DIST__AG ? nin : nout;
    c->in = tsys_tensor_data(in); c->out = tsys_tensor_data(out);
    c->seq = d->seq++;
    const size_t es = tsys_dtype_size(out->dtype);
    c->check = tsys_dist__wants_check(d, (int64_t)(nout > nin ? nout : nin) * (int64_t)es, TSYS_DIST__CHECK_BYTES);

#ifdef TSYS_DIST_NCCL
    if (out->device == TSYS_CUDA && d->device) {
        if (!tsys_dist__window_ok(d, fn, in, out, c->count * (int64_t)es)) { tsys_dist__work_free(w); return NULL; }
        // sizes and dtypes agree? (host round trip; not while replaying a graph: checked at capture)
        if (d->size > 1 && tsys_dist__wants_check(d, (int64_t)(nout > nin ? nout : nin) * (int64_t)es, TSYS_DIST__NCCL_CHECK_BYTES)) {
            tsys_dist__coll chk = *c;
            chk.check_only = true;
            tsys_dist__drain(d);
            if (!tsys_dist__host_exec(d, &chk, &w->err)) { *st = tsys_dist__fail(d, w->err.status, "%s", w->err.msg); tsys_dist__work_free(w); return NULL; }
        }
        const bool direct = !async && !d->group_open && d->side_inflight == 0;
        c->done = direct ? NULL : &w->ev;
        if (!d->device->collective(d, c, &w->err)) { *st = tsys_dist__fail(d, w->err.status, "%s", w->err.msg); tsys_dist__work_free(w); return NULL; }
        if (direct) { tsys_dist__work_free(w); *st = TSYS_OK; return NULL; }
        w->path = TSYS_DIST__WORK_NCCL;
        if (async) { w->async = true; d->side_inflight++; }
        if (d->group_open) {   // its end event is recorded by tsys_dist_group_end
            w->in_group = true;
            if (d->group_tail) d->group_tail->next = w; else d->group_head = w;
            d->group_tail = w;
        }
        if (async) { *st = TSYS_OK; return w; }
        *st = tsys_event_wait(ctx, &w->ev, TSYS_STREAM_COMPUTE);
        tsys_dist__work_free(w);
        return NULL;
    }
#endif
    if (d->launch == &tsys_dist__engine_self && out->device != TSYS_CPU) {
        // a group of one on a device: reduce-scatter and all-gather are copies on the current stream
        if ((kind == TSYS_DIST__RS || kind == TSYS_DIST__AG) && in != out && nout) *st = tsys_tensor_copy_from(ctx, out, in);
        else *st = TSYS_OK;
        w->path = TSYS_DIST__WORK_DONE;
        if (*st != TSYS_OK || !async) { tsys_dist__work_free(w); return NULL; }
        return w;
    }
    if (out->device != TSYS_CPU) {
        // host staging (how Gloo treats CUDA tensors): device -> host now (a sync of the current
        // stream), the collective on the host, host -> device when it is done
#ifdef TSYS_CUDA_H_INCLUDED
        if (tsys_cuda_capturing(ctx)) {
            *st = tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "%s: CUDA tensors travel through host memory in this group (no NCCL communicator), which a CUDA graph cannot capture", fn);
            tsys_dist__work_free(w);
            return NULL;
        }
#endif
        size_t in_bytes = (size_t)nin * es, out_bytes = (size_t)nout * es;
        w->stage_out = TSYS_MALLOC(out_bytes ? out_bytes : 1);
        w->stage_in = in != out ? TSYS_MALLOC(in_bytes ? in_bytes : 1) : NULL;
        if (!w->stage_out || (in != out && !w->stage_in)) { *st = tsys_dist__fail(d, TSYS_ERR_OOM, "%s: no host memory to stage %zu bytes", fn, in_bytes + out_bytes); tsys_dist__work_free(w); return NULL; }
        tsys_status cs = TSYS_OK;
        if (in != out) cs = tsys_tensor_to_host(ctx, in, w->stage_in);
        else if (kind != TSYS_DIST__BCAST || d->rank == root) cs = tsys_tensor_to_host(ctx, out, w->stage_out);
        if (cs != TSYS_OK) { *st = cs; tsys_dist__work_free(w); return NULL; }
        c->in = in != out ? w->stage_in : w->stage_out;
        c->out = w->stage_out;
        w->dev_out = tsys_tensor_retain(out);
        w->out_bytes = out_bytes;
    }
    w->path = TSYS_DIST__WORK_HOST;
    if (async && d->worker_on) {
        pthread_mutex_lock(&d->mu);
        if (d->q_tail) d->q_tail->next = w; else d->q_head = w;
        d->q_tail = w;
        pthread_cond_signal(&d->cv);
        pthread_mutex_unlock(&d->mu);
        *st = TSYS_OK;
        return w;
    }
    tsys_dist__drain(d);
    tsys_dist__host_exec(d, c, &w->err);
    w->done = 1;
    if (async) { *st = TSYS_OK; return w; }   // no worker: already done; errors come out of the wait
    *st = tsys_dist__work_finish(w);
    return NULL;
}

TSYSDEF tsys_status tsys_dist_wait(tsys_dist_work *w) {
    if (!w) return TSYS_ERR_INVALID_ARGS;
    tsys_dist *d = w->d;
    if (w->path == TSYS_DIST__WORK_NCCL) {
        if (w->in_group) return tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "tsys_dist_wait: the collective's group is still open (call tsys_dist_group_end first)");
        tsys_status st = tsys_event_wait(d->ctx, &w->ev, TSYS_STREAM_COMPUTE);
        tsys_dist__work_free(w);
        return st;
    }
    if (w->path == TSYS_DIST__WORK_DONE) { tsys_dist__work_free(w); return TSYS_OK; }
    if (d->worker_on) {
        pthread_mutex_lock(&d->mu);
        while (!w->done) pthread_cond_wait(&d->cv_done, &d->mu);
        pthread_mutex_unlock(&d->mu);
    }
    return tsys_dist__work_finish(w);
}

TSYSDEF tsys_status tsys_dist_all_reduce(tsys_dist *d, tsys_tensor *t, tsys_dist_op op) {
    tsys_status st;
    tsys_dist__issue(d, "all_reduce", TSYS_DIST__ALLREDUCE, t, NULL, op, 0, false, &st);
    return st;
}
TSYSDEF tsys_status tsys_dist_broadcast(tsys_dist *d, tsys_tensor *t, int root) {
    tsys_status st;
    tsys_dist__issue(d, "broadcast", TSYS_DIST__BCAST, t, NULL, TSYS_DIST_SUM, root, false, &st);
    return st;
}
TSYSDEF tsys_status tsys_dist_reduce_scatter(tsys_dist *d, tsys_tensor *out, tsys_tensor *in, tsys_dist_op op) {
    tsys_status st;
    tsys_dist__issue(d, "reduce_scatter", TSYS_DIST__RS, out, in, op, 0, false, &st);
    return st;
}
TSYSDEF tsys_status tsys_dist_all_gather(tsys_dist *d, tsys_tensor *out, tsys_tensor *in) {
    tsys_status st;
    tsys_dist__issue(d, "all_gather", TSYS_DIST__AG, out, in, TSYS_DIST_SUM, 0, false, &st);
    return st;
}
TSYSDEF tsys_dist_work *tsys_dist_all_reduce_async(tsys_dist *d, tsys_tensor *t, tsys_dist_op op) {
    tsys_status st;
    return tsys_dist__issue(d, "all_reduce_async", TSYS_DIST__ALLREDUCE, t, NULL, op, 0, true, &st);
}
TSYSDEF tsys_dist_work *tsys_dist_reduce_scatter_async(tsys_dist *d, tsys_tensor *out, tsys_tensor *in, tsys_dist_op op) {
    tsys_status st;
    return tsys_dist__issue(d, "reduce_scatter_async", TSYS_DIST__RS, out, in, op, 0, true, &st);
}
TSYSDEF tsys_dist_work *tsys_dist_all_gather_async(tsys_dist *d, tsys_tensor *out, tsys_tensor *in) {
    tsys_status st;
    return tsys_dist__issue(d, "all_gather_async", TSYS_DIST__AG, out, in, TSYS_DIST_SUM, 0, true, &st);
}
TSYSDEF tsys_dist_work *tsys_dist_broadcast_async(tsys_dist *d, tsys_tensor *t, int root) {
    tsys_status st;
    return tsys_dist__issue(d, "broadcast_async", TSYS_DIST__BCAST, t, NULL, TSYS_DIST_SUM, root, true, &st);
}
TSYSDEF tsys_status tsys_dist_group_begin(tsys_dist *d) {
    if (!d) return TSYS_ERR_INVALID_ARGS;
    if (d->group_open) return tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "tsys_dist_group_begin: a group is already open (groups do not nest)");
#ifdef TSYS_DIST_NCCL
    tsys_dist__err e = {TSYS_OK, ""};
    if (d->nccl && !tsys_dist__nccl_ok(d, ncclGroupStart(), "ncclGroupStart", &e)) return tsys_dist__fail(d, e.status, "%s", e.msg);
#endif
    d->group_open = true;
    return TSYS_OK;
}
// Launches the group's NCCL collectives, then records each one's end event (after all of them).
TSYSDEF tsys_status tsys_dist_group_end(tsys_dist *d) {
    if (!d) return TSYS_ERR_INVALID_ARGS;
    if (!d->group_open) return tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "tsys_dist_group_end: no group is open");
    d->group_open = false;
#ifdef TSYS_DIST_NCCL
    if (d->nccl) {
        tsys_dist__err e = {TSYS_OK, ""};
        ncclResult_t r = ncclGroupEnd();
        bool ok = tsys_dist__nccl_ok(d, r, "ncclGroupEnd", &e) && (r != ncclInProgress || tsys_dist__nccl_settle(d, "ncclGroupEnd", &e));
        for (tsys_dist_work *w = d->group_head; w; w = w->next) {
            w->in_group = false;
            if (ok && tsys_event_record(d->ctx, TSYS_CUDA, TSYS_STREAM_SIDE, &w->ev) != TSYS_OK) ok = tsys_dist__seterr(&e, tsys_ctx_status(d->ctx), "%s", tsys_ctx_last_error(d->ctx));
        }
        d->group_head = d->group_tail = NULL;
        if (!ok) return tsys_dist__fail(d, e.status, "%s", e.msg);
    }
#endif
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_dist_sync(tsys_dist *d) {
    if (!d) return TSYS_ERR_INVALID_ARGS;
    if (TSYS_DIST__LOAD(&d->broken)) return tsys_dist__fail(d, TSYS_ERR_IO, "sync: the group is broken since: %s", d->broken_msg);
#ifdef TSYS_CUDA_H_INCLUDED
    // while a CUDA graph is captured nothing runs: there is nothing to wait for (and a sync would break the capture)
    if (tsys_cuda_capturing(d->ctx)) return TSYS_OK;
#endif
#ifdef TSYS_DIST_NCCL
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    if (d->nccl) return tsys_dist__nccl_drain(d, "sync", &e) ? TSYS_OK : tsys_dist__fail(d, e.status, "%s", e.msg);
#endif
    return d->cuda ? tsys_sync(d->ctx, TSYS_CUDA) : TSYS_OK;
}

// Host barrier after everything issued so far on the host; on an NCCL group it also waits (bounded
// by the timeout, host side) for the side and compute streams, so a stuck NCCL collective ends in an error here.
TSYSDEF tsys_status tsys_dist_barrier(tsys_dist *d) {
    if (!d) return TSYS_ERR_INVALID_ARGS;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    if (d->device && !d->device->barrier(d, NULL, &e)) return tsys_dist__fail(d, e.status, "%s", e.msg);
    if (TSYS_DIST__LOAD(&d->broken)) return tsys_dist__fail(d, TSYS_ERR_IO, "barrier: the group is broken since: %s", d->broken_msg);
    tsys_dist__coll c;
    memset(&c, 0, sizeof c);
    c.kind = TSYS_DIST__BARRIER; c.seq = d->seq++;
    c.check = tsys_dist__wants_check(d, 0, TSYS_DIST__CHECK_BYTES);
    tsys_dist__drain(d);
    if (!tsys_dist__host_exec(d, &c, &e)) return tsys_dist__fail(d, e.status, "%s", e.msg);
    return TSYS_OK;
}

TSYSDEF tsys_status tsys_dist_all_reduce_host(tsys_dist *d, double *v, int n, tsys_dist_op op) {
    if (!d) return TSYS_ERR_INVALID_ARGS;
    if (n < 0 || (n > 0 && !v) || (unsigned)op > (unsigned)TSYS_DIST_MAX) return tsys_dist__fail(d, TSYS_ERR_INVALID_ARGS, "all_reduce_host: bad arguments (n %d, op %d)", n, (int)op);
    if (TSYS_DIST__LOAD(&d->broken)) return tsys_dist__fail(d, TSYS_ERR_IO, "all_reduce_host: the group is broken since: %s", d->broken_msg);
    tsys_dist__coll c;
    tsys_dist__err e;
    memset(&c, 0, sizeof c);
    memset(&e, 0, sizeof e);
    c.kind = TSYS_DIST__ALLREDUCE; c.type = TSYS_DIST__F64; c.op = op; c.count = n; c.in = c.out = v; c.seq = d->seq++;
    c.check = tsys_dist__wants_check(d, (int64_t)n * 8, TSYS_DIST__CHECK_BYTES);
    tsys_dist__drain(d);
    if (!tsys_dist__host_exec(d, &c, &e)) return tsys_dist__fail(d, e.status, "%s", e.msg);
    return TSYS_OK;
}

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
#define TSYS_DIST__ALLOC(sz) TSYS_MALLOC(sz)
#define TSYS_DIST__RELEASE(p) TSYS_FREE(p)
#else
#define TSYS_DIST__ALLOC(sz) malloc(sz)
#define TSYS_DIST__RELEASE(p) free(p)
#endif

// Side-stream events are used for timing only when the group talks NCCL on CUDA tensors and no
// graph is being captured (elapsed times cannot be read from captured events).
static bool tsys_dist__ddp_gpu_timing(tsys_dist *d, tsys_ctx *ctx, tsys_device dev) {
    if (dev != TSYS_CUDA || tsys_dist_engine_of(d) != TSYS_DIST_ENGINE_NCCL) return false;
#ifdef TSYS_CUDA_H_INCLUDED
    if (tsys_cuda_capturing(ctx)) return false;
#else
    (void)ctx;
#endif
    return true;
}

// Do the tensors' grads (or the tensors themselves) lie back to back in one storage, one dtype?
static bool tsys_dist__contiguous(tsys_tensor *const *t, int n, bool grads) {
    for (int i = 1; i < n; i++) {
        const tsys_tensor *a = grads ? t[i - 1]->grad : t[i - 1], *b = grads ? t[i]->grad : t[i];
        if (!a || !b || a->storage != b->storage || a->dtype != b->dtype || b->offset != a->offset + tsys_tensor_bytes(a)) return false;
    }
    return n > 0 && (!grads || t[0]->grad);
}

// A 1-D view over n back-to-back tensors (their grads when `grads`), starting at the first; for one
// tensor, that tensor (retained). Release it either way.
static tsys_tensor *tsys_dist__run_view(tsys_ctx *ctx, tsys_tensor *const *t, int n, bool grads) {
    tsys_tensor *base = grads ? t[0]->grad : t[0];
    if (n == 1) return tsys_tensor_retain(base);
    int64_t numel = 0;
    for (int i = 0; i < n; i++) numel += tsys_tensor_numel(t[i]);
    return tsys_tensor_view_raw(ctx, base, 0, base->dtype, 1, &numel);
}

// Broadcasts tensors from root: each maximal run of back-to-back tensors goes as one call.
static tsys_status tsys_dist__broadcast_list(tsys_dist *d, tsys_tensor *const *t, int n, int root) {
    tsys_ctx *ctx = tsys_dist_ctx(d);
    for (int i = 0; i < n;) {
        int j = i + 1;
        while (j < n && tsys_dist__contiguous(t + i, j - i + 1, false)) j++;
        tsys_tensor *v = tsys_dist__run_view(ctx, t + i, j - i, false);
        tsys_status st = v ? tsys_dist_broadcast(d, v, root) : tsys_ctx_status(ctx);
        tsys_tensor_release(v);
        if (st != TSYS_OK) return st;
        i = j;
    }
    return TSYS_OK;
}

// A layout (DDP's buckets, ZeRO-1's ownership) that every rank must share: its hash is compared once,
// over the host path, and the collectives it then issues every step skip the per-call descriptor
// check (a host round trip each, in front of every NCCL launch) because they cannot disagree.
static uint64_t tsys_dist__hash(uint64_t h, int64_t v) { return (h ^ (uint64_t)v) * 0x100000001b3ull; }
static tsys_status tsys_dist__agree_layout(tsys_dist *d, uint64_t hash, const char *what) {
    double v[2] = {(double)(hash >> 12), -(double)(hash >> 12)};   // 52 bits: exact in a double
    tsys_status st = tsys_dist_all_reduce_host(d, v, 2, TSYS_DIST_MAX);
    if (st == TSYS_OK && v[0] != -v[1])
        st = tsys_ctx_set_error(tsys_dist_ctx(d), TSYS_ERR_INVALID_ARGS, "%s: the ranks have different layouts (were they given the same parameters?)", what);
    return st;
}
// Collectives issued between tsys_dist__trust(d, true) and tsys_dist__untrust belong to an agreed
// layout and skip the per-call check. Each collective records the decision when it is queued, so
// a worker thread running it later never sees this change.
static bool tsys_dist__trust(tsys_dist *d, bool on) { if (on) d->trusted++; return on; }
static void tsys_dist__untrust(tsys_dist *d, bool was_on) { if (was_on) d->trusted--; }

typedef struct tsys_dist__ddp_bucket {
    int first, count;            // trainable parameters tp[first .. first + count)
    int64_t numel, bytes;
    int pending;                 // gradients of the bucket not final yet in this backward
    bool launched;
    bool scratch;                // flat is a copy buffer (the grads are not one run of one arena)
    size_t at;                   // the first gradient's byte offset in its storage
    tsys_tensor *flat;           // the bucket's gradients: a view of the gradient arena, or the scratch (NULL: a
                                 // run of gradients of several dtypes, which ce_gather copies as bytes, or a group
                                 // of one leaves as they are)
    tsys_tensor *wire;           // comm_bf16: the bf16 copy that is all-reduced (a view of ddp->wire_arena)
    tsys_dist_work *work;
    tsys_event ev_ready, ev_start, ev_end;   // CUDA timing: compute ready, side-stream start and end
    tsys_event ev_widened;       // comm_bf16 through NCCL: the average is back in flat (side stream)
    double t_launch_us;
} tsys_dist__ddp_bucket;

typedef struct tsys_dist__ddp_hook { struct tsys_ddp *ddp; int index; } tsys_dist__ddp_hook;

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
    tsys_dist__ddp_hook *hooks;       // one per trainable parameter (OVERLAP, BUCKETED)
    bool hooked;
    tsys_dist__ddp_bucket *b;
    int nb;
    int *order;                  // buckets in launch order this step
    int nlaunched;
    tsys_tensor *grad_arena;     // the gradients DDP gave parameters that had none
    tsys_tensor *wire_arena;     // comm_bf16: every fp32 bucket's bf16 copy
    bool gpu_timing;             // the last step recorded side-stream events
    tsys_event ev_bwd_end;
    double t_bwd_end_us, t_first_us, t_done_us;
    tsys_ddp_stats stats;
    int stats_launched;          // buckets the last finished step launched
    tsys_status launch_error;    // a hook that failed to launch (reported by finish)
    bool layout_agreed;          // every rank has the same buckets (tsys_dist__agree_layout)
    void *ceg;                   // desc.ce_gather: the copy engines' receive buffers and flags (tsys_dist__ceg), once attached
    tsys_optim *ib_opt;          // tsys_ddp_optim_in_backward: told when each bucket's gradients are in, or NULL
    tsys_tensor *terms;          // desc.ce_gather: my receive buffer, as the optimizers' terms
    int *owner;                  // desc.shard_updates: each bucket's owner, once an optimizer is attached
    int64_t *pb_off, *pb_len;    // then: each bucket's parameters, bytes in their storage
    bool *pushed_here;           // [ntp]: the parameters my peers update and push here
    bool *by_copy;               // desc.shard_masters: [ntp] desc.read_by_copy (those pushed as their kept copies alone)
    int64_t *lb_off, *lb_len;    // then: each bucket's kept copies, bytes in the optimizer's block
    tsys_tensor *lowp_held;      // a view of that block, which the peers write into (so it outlives the optimizer)
    tsys_dist__run *runs;        // [ntp]: a bucket's fp32 runs to push, made at each push
    bool *stale_scratch;         // [ntp]: what the step's end marks stale (pushed here and read by copy)
    bool alone;                  // a step of the collectives alone (no optimizer step follows: tsys_dist_trainer_time_collectives)
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

// comm_bf16's casts run on the side stream, beside the collective, where that is NCCL's stream.
static bool tsys_dist__ddp_side_casts(const tsys_ddp *ddp) {
    return ddp->dev == TSYS_CUDA && tsys_dist_engine_of(ddp->d) == TSYS_DIST_ENGINE_NCCL;
}
// dst = src in dst's dtype, on the side stream when `side`.
static tsys_status tsys_dist__ddp_cast(tsys_ddp *ddp, tsys_tensor *dst, const tsys_tensor *src, bool side) {
    tsys_stream prev = side ? tsys_set_stream(ddp->ctx, ddp->dev, TSYS_STREAM_SIDE) : TSYS_STREAM_COMPUTE;
    tsys_status st = tsys_tensor_cast_from(ddp->ctx, dst, src);
    if (side) tsys_set_stream(ddp->ctx, ddp->dev, prev);
    return st;
}

// Starts bucket bi's all-reduce: gradients that still count as zero get their zeros, a scratch
// bucket copies its gradients in, then the asynchronous average (of the bf16 copy under comm_bf16).
// ---- desc.ce_gather: the copy engines' gradient gather (tsys_dist__ceg in >>engine nccl) ----
#ifdef TSYS_DIST_NCCL
static tsys_status tsys_dist__ddp_gather_err(tsys_ddp *ddp, const tsys_dist__err *e) {
    return tsys_ctx_set_error(ddp->ctx, e->status != TSYS_OK ? e->status : TSYS_ERR_CUDA, "%s", e->msg);
}
#endif
// What ce_gather needs of the DDP (checked when it is made, the same on every rank).
static tsys_status tsys_dist__ddp_gather_check(tsys_ddp *ddp) {
    tsys_ctx *ctx = ddp->ctx;
    const tsys_tensor *arena = ddp->grad_arena;
    const char *no = ddp->desc.strategy != TSYS_DDP_BUCKETED ? "the strategy must be bucketed"
                     : ddp->desc.comm_bf16 ? "comm_bf16 is another way to send the gradients"
                     : ddp->dev != TSYS_CUDA || tsys_dist_engine_of(ddp->d) != TSYS_DIST_ENGINE_NCCL ? "it needs CUDA tensors and NCCL ranks"
                     : ddp->ntp != ddp->n ? "every parameter must be trainable (the optimizer's layout is the gradients')"
                     : !arena ? "the gradients must be made by DDP (the parameters had none)"
                     : arena->offset != 0 ? "the gradient arena must start its allocation (the peers open it through CUDA IPC)" : NULL;
    size_t at = arena ? arena->offset : 0;
    for (int i = 0; !no && i < ddp->ntp; i++) {   // one arena, in parameter order
        const tsys_tensor *g = ddp->tp[i]->grad;
        if (!g || g->storage != arena->storage || g->offset != at) no = "the gradients must be made by DDP (the parameters had none)";
        else at += tsys_tensor_bytes(g);
    }
    if (no) return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.ce_gather: %s", no);
#ifndef TSYS_DIST_NCCL
    return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.ce_gather: built without NCCL (TSYS_DIST_NCCL)");
#endif
    return TSYS_OK;
}

#ifdef TSYS_DIST_NCCL
// desc.shard_masters: each bucket's kept copies' bytes in their block (every parameter has one there: the optimizer
// keeps them, tsys_optim_keep_lowp), pushed beside its fp32 weights that are not read by copy; the block held.
static tsys_status tsys_dist__ddp_shard_copies(tsys_ddp *ddp, uint64_t *h) {
    const tsys_tensor *first = ddp->tp[0]->lowp;
    ddp->lb_off = (int64_t *)calloc((size_t)ddp->nb + 1, sizeof(int64_t));
    ddp->lb_len = (int64_t *)calloc((size_t)ddp->nb + 1, sizeof(int64_t));
    ddp->runs = (tsys_dist__run *)calloc((size_t)ddp->ntp + 1, sizeof(tsys_dist__run));
    ddp->stale_scratch = (bool *)calloc((size_t)ddp->ntp + 1, sizeof(bool));
    if (!ddp->lb_off || !ddp->lb_len || !ddp->runs || !ddp->stale_scratch) return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_OOM, "ddp: desc.shard_masters: out of host memory");
    for (int k = 0; k < ddp->nb; k++) {
        int64_t lo = INT64_MAX, hi = 0;
        for (int i = ddp->b[k].first; i < ddp->b[k].first + ddp->b[k].count; i++) {
            const tsys_tensor *c = ddp->tp[i]->lowp;
            if (!c || c->storage != first->storage || c->dtype != first->dtype)
                return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_INVALID_ARGS, "ddp: desc.shard_masters: '%s' has no kept copy in the optimizer's block (call tsys_optim_keep_lowp "
                                          "before tsys_ddp_attach_optimizer)", ddp->tp[i]->name);
            lo = (int64_t)c->offset < lo ? (int64_t)c->offset : lo;
            hi = (int64_t)(c->offset + tsys_tensor_bytes(c)) > hi ? (int64_t)(c->offset + tsys_tensor_bytes(c)) : hi;
        }
        ddp->lb_off[k] = lo; ddp->lb_len[k] = hi - lo;
        *h = tsys_dist__hash(tsys_dist__hash(*h, lo), hi);
    }
    for (int k = 0; k < ddp->nb; k++)   // a bucket's push covers its copies' bytes, gaps included: they must not hold another's
        for (int j = k + 1; j < ddp->nb; j++)
            if (ddp->lb_off[k] < ddp->lb_off[j] + ddp->lb_len[j] && ddp->lb_off[j] < ddp->lb_off[k] + ddp->lb_len[k])
                return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.shard_masters: buckets %d and %d's kept copies interleave in the optimizer's block "
                                          "(give the optimizer the parameters in the DDP's order)", k, j);
    const int64_t one = 1;
    ddp->lowp_held = tsys_tensor_view_raw(ddp->ctx, (tsys_tensor *)first, 0, first->dtype, 1, &one);
    return ddp->lowp_held ? TSYS_OK : tsys_ctx_status(ddp->ctx);
}

// desc.shard_updates: each bucket's owner, dealt in backward's order (bucket 0 first) to the rank with the
// fewest bytes so far, and each bucket's parameters' bytes in their one storage. The same on every rank.
static tsys_status tsys_dist__ddp_shard_plan(tsys_ddp *ddp, int64_t lo, int64_t hi) {
    tsys_ctx *ctx = ddp->ctx;
    const int size = tsys_dist_size(ddp->d);
    const tsys_storage *store = ddp->ntp ? ddp->tp[0]->storage : NULL;
    const char *no = lo != 0 || hi != (int64_t)tsys_tensor_bytes(ddp->grad_arena) ? "it is for tsys_ddp_attach_optimizer (ZeRO-1 shards its own way)"
                     : size > 64 ? "more than 64 ranks" : !store ? "no trainable parameter" : NULL;
    ddp->owner = (int *)calloc((size_t)ddp->nb + 1, sizeof(int));
    ddp->pb_off = (int64_t *)calloc((size_t)ddp->nb + 1, sizeof(int64_t));
    ddp->pb_len = (int64_t *)calloc((size_t)ddp->nb + 1, sizeof(int64_t));
    ddp->pushed_here = (bool *)calloc((size_t)ddp->ntp + 1, sizeof(bool));
    if (!no && (!ddp->owner || !ddp->pb_off || !ddp->pb_len || !ddp->pushed_here)) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "ddp: desc.shard_updates: out of host memory");
    uint64_t h = 0xcbf29ce484222325ull;
    for (int k = 0; !no && k < ddp->nb; k++) {
        const tsys_dist__ddp_bucket *b = &ddp->b[k];
        int64_t end = (int64_t)ddp->tp[b->first]->offset;
        ddp->pb_off[k] = end;
        for (int i = b->first; !no && i < b->first + b->count; i++) {
            const tsys_tensor *p = ddp->tp[i];
            if (p->storage != store) no = "the parameters must lie in one storage (a model's)";
            else if ((int64_t)p->offset != end) no = "each bucket's parameters must lie back to back in their storage";
            end = (int64_t)p->offset + (int64_t)tsys_tensor_bytes(p);
            h = tsys_dist__hash(h, (int64_t)p->offset);
        }
        ddp->pb_len[k] = end - ddp->pb_off[k];
    }
    if (no) return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.shard_updates: %s", no);
    double load[64] = {0};
    for (int k = 0; k < ddp->nb; k++) {   // in backward's order: bucket 0 holds the last parameters
        int r = 0;
        for (int q = 1; q < size; q++) if (load[q] < load[r]) r = q;
        ddp->owner[k] = r;
        load[r] += (double)ddp->pb_len[k];
        for (int i = ddp->b[k].first; i < ddp->b[k].first + ddp->b[k].count; i++) ddp->pushed_here[i] = r != tsys_dist_rank(ddp->d);
    }
    if (ddp->by_copy && tsys_dist__ddp_shard_copies(ddp, &h) != TSYS_OK) return tsys_ctx_status(ctx);
    return tsys_dist__agree_layout(ddp->d, h, "ddp desc.shard_updates (the parameters' places in their storage)");
}
#endif

// Every rank's receive buffer, for bytes [lo, hi) of the gradients (what this rank's optimizer reads), opened by
// the others; ddp->terms wraps mine. Collective.
static tsys_status tsys_dist__ddp_gather_open(tsys_ddp *ddp, int64_t lo, int64_t hi) {
    tsys_ctx *ctx = ddp->ctx;
    if (!ddp->desc.ce_gather) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: attaching an optimizer: the DDP was made without desc.ce_gather (its gradients are averaged in place)");
    if (ddp->ceg) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: desc.ce_gather: an optimizer is attached already");
    const tsys_tensor *arena = ddp->grad_arena;
#ifdef TSYS_DIST_NCCL
    tsys_dist__ceg *g = (tsys_dist__ceg *)calloc(1, sizeof *g);
    if (!g) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "ddp: desc.ce_gather: out of host memory");
    ddp->ceg = g;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    tsys_dist__drain(ddp->d);
    if (ddp->desc.shard_updates && tsys_dist__ddp_shard_plan(ddp, lo, hi) != TSYS_OK) return tsys_ctx_status(ctx);
    if (!tsys_dist__ceg_setup(ddp->d, g, tsys_tensor_data(arena), (int64_t)tsys_tensor_bytes(arena), lo, hi, ddp->nb, ddp->owner, &e)) return tsys_dist__ddp_gather_err(ddp, &e);
    if (ddp->owner && !tsys_dist__ceg_share_params(ddp->d, g, ddp->tp[0]->storage->data, &e)) return tsys_dist__ddp_gather_err(ddp, &e);
    if (ddp->lowp_held && !tsys_dist__ceg_share(ddp->d, ddp->lowp_held->storage->data, "the kept low-precision copies' block", g->lowp, &e)) return tsys_dist__ddp_gather_err(ddp, &e);
    int64_t numel = (hi - lo) / 4 * (tsys_dist_size(ddp->d) - 1);
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "ddp peers' gradients"));   // the tracker sees it as gradients
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_GRADIENTS);
    ddp->terms = tsys_tensor_wrap(ctx, TSYS_F32, TSYS_CUDA, 1, &numel, g->recv, NULL, NULL);
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    if (!ddp->terms) return tsys_ctx_status(ctx);
    tsys_tensor_set_name(ddp->terms, "ddp peers' gradients");
    return TSYS_OK;
#else
    (void)lo; (void)hi; (void)arena;
    return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.ce_gather: built without NCCL (TSYS_DIST_NCCL)");
#endif
}

// Bucket bi is final (the side stream waited for it): my peers learn it, and theirs come in, on the side stream.
static tsys_status tsys_dist__ddp_gather_bucket(tsys_ddp *ddp, int bi) {
#ifdef TSYS_DIST_NCCL
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    const tsys_dist__ddp_bucket *b = &ddp->b[bi];
    cudaStream_t side = (cudaStream_t)tsys_cuda_stream_of(ddp->ctx, TSYS_STREAM_SIDE);
    int64_t off = (int64_t)(b->at - ddp->grad_arena->offset);
    if (!tsys_dist__ceg_bucket(ddp->d, (tsys_dist__ceg *)ddp->ceg, bi, off, b->bytes, side, &e)) return tsys_dist__ddp_gather_err(ddp, &e);
    return TSYS_OK;
#else
    (void)bi;
    return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.ce_gather: built without NCCL");
#endif
}

// The step's end: the compute stream waits for every peer's gradients, and for every peer to have read mine.
static tsys_status tsys_dist__ddp_gather_close(tsys_ddp *ddp) {
#ifdef TSYS_DIST_NCCL
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    cudaStream_t compute = (cudaStream_t)tsys_cuda_stream_of(ddp->ctx, TSYS_STREAM_COMPUTE), side = (cudaStream_t)tsys_cuda_stream_of(ddp->ctx, TSYS_STREAM_SIDE);
    return tsys_dist__ceg_close(ddp->d, (tsys_dist__ceg *)ddp->ceg, side, compute, &e) ? TSYS_OK : tsys_dist__ddp_gather_err(ddp, &e);
#else
    return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.ce_gather: built without NCCL");
#endif
}

// shard_masters, after a step (eager or replayed): the fp32 weights my peers update and read by copy are out of date here.
static tsys_status tsys_dist__ddp_mark_stale(tsys_ddp *ddp) {
    if (!ddp->by_copy || !ddp->stale_scratch) return TSYS_OK;
    for (int i = 0; i < ddp->ntp; i++) ddp->stale_scratch[i] = ddp->pushed_here[i] && ddp->by_copy[i];
    return tsys_params_mark_stale(ddp->ctx, ddp->tp, ddp->ntp, ddp->stale_scratch);
}

// shard_updates: my bucket bi's update is queued on the background stream: its new parameters go to my peers behind it
// (shard_masters: its kept copies, and the fp32 weights of those not read by copy, in runs of neighbours).
static tsys_status tsys_dist__ddp_shard_push(tsys_ddp *ddp, int bi) {
#ifdef TSYS_DIST_NCCL
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    cudaStream_t bg = (cudaStream_t)tsys_cuda_stream_of(ddp->ctx, TSYS_STREAM_BACKGROUND);
    tsys_dist__run whole = {ddp->pb_off[bi], ddp->pb_len[bi]}, low = {0, 0}, *runs = &whole;
    int nruns = 1;
    if (ddp->by_copy) {
        low.off = ddp->lb_off[bi]; low.len = ddp->lb_len[bi];
        runs = ddp->runs; nruns = 0;
        for (int i = ddp->b[bi].first; i < ddp->b[bi].first + ddp->b[bi].count; i++) {
            const tsys_tensor *p = ddp->tp[i];
            if (ddp->by_copy[i]) continue;
            if (nruns && runs[nruns - 1].off + runs[nruns - 1].len == (int64_t)p->offset) runs[nruns - 1].len += (int64_t)tsys_tensor_bytes(p);
            else runs[nruns++] = (tsys_dist__run){(int64_t)p->offset, (int64_t)tsys_tensor_bytes(p)};
        }
    }
    return tsys_dist__ceg_push(ddp->d, (tsys_dist__ceg *)ddp->ceg, bi, runs, nruns, low, bg, &e) ? TSYS_OK : tsys_dist__ddp_gather_err(ddp, &e);
#else
    (void)bi;
    return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.ce_gather: built without NCCL");
#endif
}

// shard_updates, at the step's end: the compute stream waits for every bucket my peers own to be pushed here (the
// next forward reads them: their kept low-precision copies are made again, the others' stay; shard_masters: the copies
// came with them, and the fp32 weights read by copy are out of date here) and for my own pushes.
static tsys_status tsys_dist__ddp_shard_land(tsys_ddp *ddp) {
#ifdef TSYS_DIST_NCCL
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    cudaStream_t compute = (cudaStream_t)tsys_cuda_stream_of(ddp->ctx, TSYS_STREAM_COMPUTE);
    if (!tsys_dist__ceg_land(ddp->d, (tsys_dist__ceg *)ddp->ceg, compute, &e)) return tsys_dist__ddp_gather_err(ddp, &e);
    tsys_params_mark_written(ddp->tp, ddp->ntp, ddp->pushed_here, ddp->by_copy != NULL);
    return tsys_dist__ddp_mark_stale(ddp);
#else
    return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_UNSUPPORTED, "ddp: desc.ce_gather: built without NCCL");
#endif
}

TSYSDEF tsys_status tsys_ddp_sync_params(tsys_ddp *ddp) {
    if (!ddp) return TSYS_ERR_INVALID_ARGS;
    tsys_status st = TSYS_OK;
    for (int k = 0; ddp->by_copy && ddp->owner && st == TSYS_OK && k < ddp->nb; k++)
        for (int i = ddp->b[k].first; st == TSYS_OK && i < ddp->b[k].first + ddp->b[k].count; i++)
            if (ddp->by_copy[i]) st = tsys_dist_broadcast(ddp->d, ddp->tp[i], ddp->owner[k]);   // marks it written: current again
    return st;
}

TSYSDEF tsys_status tsys_ddp_sync_moments(tsys_ddp *ddp, tsys_optim *opt) {
    if (!ddp) return TSYS_ERR_INVALID_ARGS;
    if (ddp->desc.shard_state)
        return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_INVALID_ARGS, "tsys_ddp_sync_moments: desc.shard_state: each rank holds its buckets' moments alone (tsys_ddp_state_save "
                                  "writes them)");
    if (!opt) return TSYS_ERR_INVALID_ARGS;
    tsys_status st = TSYS_OK;
    for (int k = 0; ddp->owner && st == TSYS_OK && k < ddp->nb; k++)
        for (int i = ddp->b[k].first; st == TSYS_OK && i < ddp->b[k].first + ddp->b[k].count; i++)
            for (int which = 0; st == TSYS_OK && which < 2; which++) {
                tsys_tensor *m = tsys_optim_state(opt, i, which);   // a view of the moments: ours to release
                st = m ? tsys_dist_broadcast(ddp->d, m, ddp->owner[k]) : tsys_ctx_set_error(ddp->ctx, TSYS_ERR_INVALID_ARGS, "tsys_ddp_sync_moments: no AdamW moments for '%s'",
                                                                                           ddp->tp[i]->name);
                tsys_tensor_release(m);
            }
    return st;
}

TSYSDEF tsys_status tsys_ddp_attach_optimizer(tsys_ddp *ddp, tsys_optim *opt) {
    if (!ddp || !opt) return TSYS_ERR_INVALID_ARGS;
    tsys_status st = tsys_dist__ddp_gather_open(ddp, 0, ddp->grad_arena ? (int64_t)tsys_tensor_bytes(ddp->grad_arena) : 0);
    if (st == TSYS_OK) st = tsys_optim_sum_grads(opt, ddp->terms, tsys_dist_size(ddp->d), tsys_dist_rank(ddp->d), 0);
    if (st == TSYS_OK && ddp->desc.shard_state && ddp->owner) {   // the moments of my buckets alone
        tsys_tensor **mine = (tsys_tensor **)malloc(sizeof(tsys_tensor *) * ((size_t)ddp->ntp + 1));
        int n = 0;
        for (int i = 0; mine && i < ddp->ntp; i++) if (!ddp->pushed_here[i]) mine[n++] = ddp->tp[i];
        st = mine ? tsys_optim_shard_state(opt, mine, n) : tsys_ctx_set_error(ddp->ctx, TSYS_ERR_OOM, "ddp: desc.shard_state: out of host memory");
        free(mine);
    }
    return st;
}

TSYSDEF tsys_status tsys_ddp_optim_in_backward(tsys_ddp *ddp, tsys_optim *opt) {
    if (!ddp) return TSYS_ERR_INVALID_ARGS;
    const char *no = !opt ? NULL
                     : ddp->dev != TSYS_CUDA || (tsys_dist_engine_of(ddp->d) != TSYS_DIST_ENGINE_NCCL && tsys_dist_size(ddp->d) > 1)
                     ? "it needs CUDA tensors on NCCL ranks (the gradients are in as of the side stream)"
                     : ddp->desc.strategy != TSYS_DDP_BUCKETED && ddp->desc.strategy != TSYS_DDP_OVERLAP ? "the strategy must send gradients during backward (bucketed or overlap)"
                     : ddp->stats.copied_buckets > 0 ? "a bucket is copied through scratch memory (its average comes back only in tsys_ddp_finish)" : NULL;
    if (no) return tsys_ctx_set_error(ddp->ctx, TSYS_ERR_UNSUPPORTED, "tsys_ddp_optim_in_backward: %s", no);
    ddp->ib_opt = opt;
    return TSYS_OK;
}

TSYSDEF int64_t tsys_ddp_device_bytes(const tsys_ddp *ddp) {
#ifdef TSYS_DIST_NCCL
    const tsys_dist__ceg *g = ddp ? (const tsys_dist__ceg *)ddp->ceg : NULL;
    return g ? (g->hi - g->lo) * (tsys_dist_size(ddp->d) - 1) + g->flag_bytes : 0;
#else
    (void)ddp;
    return 0;
#endif
}

TSYSDEF tsys_dist_pull_links tsys_ddp_calibrate_pulls(tsys_ddp *ddp) {
    tsys_dist_pull_links m;
    memset(&m, 0, sizeof m);
#ifdef TSYS_DIST_NCCL
    tsys_dist__ceg *g = ddp ? (tsys_dist__ceg *)ddp->ceg : NULL;
    if (!g) return m;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    if (tsys_dist_sync(ddp->d) != TSYS_OK) return m;   // no step's copies in flight on this rank (the probe agrees the rest)
    if (!tsys_dist__ceg_calibrate(ddp->d, g, &m, &e)) {
        if (e.status != TSYS_OK) tsys_ctx_set_error(ddp->ctx, e.status, "tsys_ddp_calibrate_pulls: %s", e.msg);
        memset(&m, 0, sizeof m);
    }
#else
    (void)ddp;
#endif
    return m;
}

TSYSDEF double tsys_ddp_pull_time_ms(const tsys_ddp *ddp, tsys_dist_pull_links m) {
#ifdef TSYS_DIST_NCCL
    const tsys_dist__ceg *g = ddp ? (const tsys_dist__ceg *)ddp->ceg : NULL;
    if (!g || ddp->nb < 1) return NAN;
    int64_t *off = (int64_t *)malloc(2 * (size_t)ddp->nb * sizeof(int64_t));
    if (!off) return NAN;
    int64_t *bytes = off + ddp->nb;
    for (int k = 0; k < ddp->nb; k++) { off[k] = (int64_t)(ddp->b[k].at - ddp->grad_arena->offset); bytes[k] = ddp->b[k].bytes; }
    double ms = tsys_dist_pull_time_ms(m, tsys_dist_size(ddp->d), ddp->nb, off, bytes, g->lo_of, g->hi_of);
    if (ddp->owner && isfinite(ms)) {   // shard_updates: each bucket's owner alone pulls it
        ms = 0;
        for (int k = 0; k < ddp->nb; k++) ms += m.one.alpha_ms + (tsys_dist_size(ddp->d) - 1.0) * (double)bytes[k] / m.one.beta_bytes_per_ms;
    }
    free(off);
    return ms;
#else
    (void)ddp; (void)m;
    return NAN;
#endif
}

static tsys_status tsys_dist__ddp_launch(tsys_ddp *ddp, int bi) {
    tsys_dist__ddp_bucket *b = &ddp->b[bi];
    tsys_ctx *ctx = ddp->ctx;
    tsys_tensor **p = ddp->tp + b->first;
    if (b->launched) return TSYS_OK;
    if (ddp->desc.ce_gather && !ddp->ceg)
        return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: desc.ce_gather: no optimizer is attached to sum the gradients (tsys_ddp_attach_optimizer or tsys_ddp_attach_zero1)");
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
    if (ddp->nlaunched == 1) { ddp->t_first_us = now; ddp->gpu_timing = tsys_dist__ddp_gpu_timing(ddp->d, ctx, ddp->dev); }
    b->t_launch_us = now;
    bool side = (b->wire && tsys_dist__ddp_side_casts(ddp)) || ddp->ceg;
    if (ddp->gpu_timing || side || ddp->ib_opt) {   // the side stream waits for the gradients (ib_opt's updates wait on it), then marks the start
        tsys_event_record(ctx, ddp->dev, TSYS_STREAM_COMPUTE, &b->ev_ready);
        tsys_event_wait(ctx, &b->ev_ready, TSYS_STREAM_SIDE);
        if (ddp->gpu_timing) tsys_event_record(ctx, ddp->dev, TSYS_STREAM_SIDE, &b->ev_start);
    }
    if (b->wire && (st = tsys_dist__ddp_cast(ddp, b->wire, b->flat, side)) != TSYS_OK) return st;   // narrow
    if (ddp->ceg) {
        st = tsys_dist__ddp_gather_bucket(ddp, bi);
        if (st == TSYS_OK && ddp->gpu_timing) tsys_event_record(ctx, ddp->dev, TSYS_STREAM_SIDE, &b->ev_end);
        if (st == TSYS_OK && ddp->ib_opt && ddp->owner && ddp->owner[bi] != tsys_dist_rank(ddp->d))
            return tsys_optim_overlap_skip(ddp->ib_opt, p, b->count);   // its owner updates it and pushes it here
        if (st == TSYS_OK && ddp->ib_opt) st = tsys_optim_overlap_ready(ddp->ib_opt, p, b->count, TSYS_STREAM_SIDE);   // the peers' copies are in
        if (st == TSYS_OK && ddp->ib_opt && ddp->owner) st = tsys_dist__ddp_shard_push(ddp, bi);
        return st != TSYS_OK ? st : tsys_ctx_status(ctx);
    }
    if (!b->flat) {   // gradients of several dtypes in a group of one: the average is themselves
        if (ddp->gpu_timing) tsys_event_record(ctx, ddp->dev, TSYS_STREAM_SIDE, &b->ev_end);
        return ddp->ib_opt ? tsys_optim_overlap_ready(ddp->ib_opt, p, b->count, TSYS_STREAM_SIDE) : tsys_ctx_status(ctx);
    }
    bool trusting = tsys_dist__trust(ddp->d, ddp->layout_agreed);
    b->work = tsys_dist_all_reduce_async(ddp->d, b->wire ? b->wire : b->flat, TSYS_DIST_AVG);
    tsys_dist__untrust(ddp->d, trusting);
    if (!b->work) return tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_INVALID_ARGS;
    if (side) {   // widen right behind the collective on the side stream; tsys_dist__ddp_wait waits for it
        if ((st = tsys_dist__ddp_cast(ddp, b->flat, b->wire, true)) != TSYS_OK) return st;
        tsys_event_record(ctx, ddp->dev, TSYS_STREAM_SIDE, &b->ev_widened);
    }
    if (ddp->gpu_timing) tsys_event_record(ctx, ddp->dev, TSYS_STREAM_SIDE, &b->ev_end);
    if (ddp->ib_opt && (st = tsys_optim_overlap_ready(ddp->ib_opt, p, b->count, TSYS_STREAM_SIDE)) != TSYS_OK) return st;   // averaged in place
    return tsys_ctx_status(ctx);
}

static tsys_status tsys_dist__ddp_wait(tsys_ddp *ddp, int bi) {
    tsys_dist__ddp_bucket *b = &ddp->b[bi];
    tsys_ctx *ctx = ddp->ctx;
    if (!b->work) return TSYS_OK;
    tsys_status st = tsys_dist_wait(b->work);
    b->work = NULL;
    if (st == TSYS_OK && b->wire)   // the average back into the fp32 gradients (already under way on the side stream)
        st = tsys_dist__ddp_side_casts(ddp) ? tsys_event_wait(ctx, &b->ev_widened, TSYS_STREAM_COMPUTE) : tsys_dist__ddp_cast(ddp, b->flat, b->wire, false);
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
static void tsys_dist__ddp_grad_ready(tsys_ctx *ctx, tsys_tensor *param, void *user) {
    (void)ctx; (void)param;
    tsys_dist__ddp_hook *h = (tsys_dist__ddp_hook *)user;
    tsys_ddp *ddp = h->ddp;
    int bi = ddp->bucket_of[h->index];
    tsys_dist__ddp_bucket *b = &ddp->b[bi];
    if (b->launched || b->pending <= 0) return;   // a second backward before finish: finish sorts it out
    if (--b->pending == 0) {
        tsys_status st = tsys_dist__ddp_launch(ddp, bi);
        if (st != TSYS_OK && ddp->launch_error == TSYS_OK) ddp->launch_error = st;
    }
}

static void tsys_dist__ddp_reset(tsys_ddp *ddp) {
    for (int i = 0; i < ddp->nb; i++) { ddp->b[i].pending = ddp->b[i].count; ddp->b[i].launched = false; }
    ddp->nlaunched = 0;
    ddp->launch_error = TSYS_OK;
}

// Adds a bucket over tp[first .. first + count).
static bool tsys_dist__ddp_add_bucket(tsys_ddp *ddp, int first, int count) {
    tsys_dist__ddp_bucket *b = &ddp->b[ddp->nb];
    memset(b, 0, sizeof(*b));
    b->first = first; b->count = count;
    for (int i = first; i < first + count; i++) {
        ddp->bucket_of[i] = ddp->nb;
        b->numel += tsys_tensor_numel(ddp->tp[i]);
        b->bytes += (int64_t)tsys_tensor_bytes(ddp->tp[i]->grad);
    }
    tsys_tensor **p = ddp->tp + first;
    bool same_dtype = true, run = true;   // run: back to back in one storage, whatever their dtypes
    for (int i = 1; i < count; i++) {
        same_dtype = same_dtype && p[i]->grad->dtype == p[0]->grad->dtype;
        run = run && p[i]->grad->storage == p[0]->grad->storage && p[i]->grad->offset == p[i - 1]->grad->offset + tsys_tensor_bytes(p[i - 1]->grad);
    }
    b->at = p[0]->grad->offset;
    if (!same_dtype && run && (ddp->desc.ce_gather || tsys_dist_size(ddp->d) == 1)) { b->pending = count; ddp->nb++; return true; }   // no flat: copied as bytes, or nothing to average
    if (count == 1) b->flat = tsys_tensor_retain(p[0]->grad);
    else if (tsys_dist__contiguous(p, count, true)) b->flat = tsys_dist__run_view(ddp->ctx, p, count, true);
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

// Gives trainable parameters without a gradient one, in its gradient dtype (tsys_tensor_grad_dtype): views of
// one arena back to back when they share a dtype and a device, or whatever their dtypes under desc.ce_gather
// (whose peers copy it as bytes) and in a group of one (nothing to average), else a tensor each. Filled with
// zeros and marked zero.
static tsys_status tsys_dist__ddp_make_grads(tsys_ddp *ddp) {
    tsys_ctx *ctx = ddp->ctx;
    int missing = 0;
    int64_t bytes = 0;
    bool one_dtype = true;
    tsys_dtype dt = TSYS_F32;
    for (int i = 0; i < ddp->ntp; i++) {
        if (ddp->tp[i]->grad) continue;
        tsys_dtype gdt = tsys_tensor_grad_dtype(ddp->tp[i]);
        if (missing == 0) dt = gdt;
        one_dtype = one_dtype && gdt == dt;
        missing++;
        bytes += tsys_tensor_numel(ddp->tp[i]) * (int64_t)tsys_dtype_size(gdt);
    }
    if (missing == 0) return TSYS_OK;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "grad"));
    tsys_status st = TSYS_OK;
    const bool arena = one_dtype || ddp->desc.ce_gather || tsys_dist_size(ddp->d) == 1;
    if (arena) {   // ce_gather: an fp32 arena of the bytes rounded up (mixed dtypes too), views of any dtype in it
        const tsys_dtype adt = ddp->desc.ce_gather || !one_dtype ? TSYS_F32 : dt;
        int64_t numel = (bytes + (int64_t)tsys_dtype_size(adt) - 1) / (int64_t)tsys_dtype_size(adt);
        ddp->grad_arena = tsys_tensor_new(ctx, adt, ddp->dev, 1, &numel);
        if (ddp->grad_arena) { tsys_tensor_set_name(ddp->grad_arena, "ddp gradients"); st = tsys_tensor_fill(ctx, ddp->grad_arena, 0.0f); }
        else st = tsys_ctx_status(ctx);
    }
    size_t off = 0;
    for (int i = 0; st == TSYS_OK && i < ddp->ntp; i++) {
        tsys_tensor *p = ddp->tp[i];
        if (p->grad) continue;
        tsys_dtype gdt = tsys_tensor_grad_dtype(p);
        tsys_tensor *g = arena ? tsys_tensor_view_raw(ctx, ddp->grad_arena, off, gdt, p->ndim, p->shape)
                               : tsys_tensor_new(ctx, gdt, p->device, p->ndim, p->shape);
        if (g && !arena) st = tsys_tensor_fill(ctx, g, 0.0f);
        if (!g) { st = tsys_ctx_status(ctx); break; }
        tsys_tensor_set_name(g, "%s.grad", p->name);
        p->grad = g;
        p->grad_zero = true;
        off += tsys_tensor_bytes(g);
    }
    tsys_mem_set_tag(ctx, tag);
    return st;
}

// comm_bf16: a bf16 copy for every fp32 bucket, views of one arena.
static tsys_status tsys_dist__ddp_make_wires(tsys_ddp *ddp) {
    tsys_ctx *ctx = ddp->ctx;
    int64_t total = 0;
    for (int i = 0; i < ddp->nb; i++) if (ddp->b[i].flat && ddp->b[i].flat->dtype == TSYS_F32) total += ddp->b[i].numel;
    if (total == 0) return TSYS_OK;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "ddp buckets"));
    ddp->wire_arena = tsys_tensor_new(ctx, TSYS_BF16, ddp->dev, 1, &total);
    tsys_mem_set_tag(ctx, tag);
    if (!ddp->wire_arena) return tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM;
    tsys_tensor_set_name(ddp->wire_arena, "ddp bf16 buckets");
    size_t off = 0;
    for (int i = 0; i < ddp->nb; i++) {
        tsys_dist__ddp_bucket *b = &ddp->b[i];
        if (!b->flat || b->flat->dtype != TSYS_F32) continue;
        b->wire = tsys_tensor_view_raw(ctx, ddp->wire_arena, off, TSYS_BF16, 1, &b->numel);
        if (!b->wire) return tsys_ctx_status(ctx);
        off += (size_t)b->numel * 2;
    }
    return TSYS_OK;
}

TSYSDEF void tsys_ddp_free(tsys_ddp *ddp) {
    if (!ddp) return;
    for (int i = 0; i < ddp->nb; i++) if (ddp->b[i].work) tsys_dist_wait(ddp->b[i].work);
    if (ddp->hooked)
        for (int i = 0; i < ddp->ntp; i++) tsys_tensor_remove_grad_hook(ddp->tp[i], tsys_dist__ddp_grad_ready, &ddp->hooks[i]);
    for (int i = 0; i < ddp->nb; i++) {
        tsys_dist__ddp_bucket *b = &ddp->b[i];
        tsys_tensor_release(b->flat); tsys_tensor_release(b->wire);
        tsys_event_release(ddp->ctx, &b->ev_ready); tsys_event_release(ddp->ctx, &b->ev_start); tsys_event_release(ddp->ctx, &b->ev_end);
        tsys_event_release(ddp->ctx, &b->ev_widened);
    }
    tsys_tensor_release(ddp->wire_arena);
    tsys_tensor_release(ddp->terms);
#ifdef TSYS_DIST_NCCL
    if (ddp->ceg) { tsys_dist__ceg_teardown(ddp->d, (tsys_dist__ceg *)ddp->ceg); free(ddp->ceg); }
#endif
    tsys_event_release(ddp->ctx, &ddp->ev_bwd_end);
    for (int i = 0; i < ddp->n; i++) tsys_tensor_release(ddp->params[i]);
    tsys_tensor_release(ddp->grad_arena);
    TSYS_DIST__RELEASE(ddp->params); TSYS_DIST__RELEASE(ddp->tp); TSYS_DIST__RELEASE(ddp->bucket_of);
    TSYS_DIST__RELEASE(ddp->hooks); TSYS_DIST__RELEASE(ddp->b); TSYS_DIST__RELEASE(ddp->order);
    tsys_tensor_release(ddp->lowp_held);   // after the peers stopped writing into it (the teardown's barrier)
    free(ddp->owner); free(ddp->pb_off); free(ddp->pb_len); free(ddp->pushed_here);
    free(ddp->by_copy); free(ddp->lb_off); free(ddp->lb_len); free(ddp->runs); free(ddp->stale_scratch);
    TSYS_DIST__RELEASE(ddp);
}

// Data parallelism reduces fp32 gradients: one kept in bf16 / f16 (tsys_tensor_set_grad_dtype) is refused by name.
static bool tsys_dist__grads_fp32(tsys_ctx *ctx, const char *who, const tsys_tensor *p) {
    if (tsys_tensor_grad_dtype(p) == p->dtype) return true;
    tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "%s: '%s' keeps its gradient in %s (tsys_tensor_set_grad_dtype); %s reduces fp32 gradients",
                       who, p->name, tsys_dtype_name(tsys_tensor_grad_dtype(p)), who);
    return false;
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
        if (!dd.ce_gather && d->size > 1 && !tsys_dist__grads_fp32(ctx, "ddp (without desc.ce_gather, whose optimizer sums them in fp32)", params[i])) return NULL;
    }
    tsys_ddp *ddp = (tsys_ddp *)TSYS_DIST__ALLOC(sizeof(tsys_ddp));
    if (!ddp) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "ddp: out of host memory"); return NULL; }
    memset(ddp, 0, sizeof(*ddp));
    ddp->d = d; ddp->ctx = ctx; ddp->desc = dd;
    ddp->dev = n ? params[0]->device : TSYS_CPU;
    size_t cnt = (size_t)(n ? n : 1);
    ddp->params = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);
    ddp->tp = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);
    ddp->bucket_of = (int *)TSYS_DIST__ALLOC(sizeof(int) * cnt);
    ddp->hooks = (tsys_dist__ddp_hook *)TSYS_DIST__ALLOC(sizeof(tsys_dist__ddp_hook) * cnt);
    ddp->b = (tsys_dist__ddp_bucket *)TSYS_DIST__ALLOC(sizeof(tsys_dist__ddp_bucket) * cnt);
    ddp->order = (int *)TSYS_DIST__ALLOC(sizeof(int) * cnt);
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
    tsys_status st = tsys_dist__broadcast_list(d, ddp->params, ddp->n, 0);
    if (st == TSYS_OK) st = tsys_dist__ddp_make_grads(ddp);
    // buckets in reverse parameter order
    if (st == TSYS_OK && ddp->ntp > 0) {
        if (dd.strategy == TSYS_DDP_FLAT) { if (!tsys_dist__ddp_add_bucket(ddp, 0, ddp->ntp)) st = TSYS_ERR_INVALID_ARGS; }
        else if (dd.strategy == TSYS_DDP_BUCKETED) {
            double limit = dd.bucket_mb * 1048576.0;
            int end = ddp->ntp;   // the open bucket is tp[i + 1 .. end)
            double bytes = 0;
            for (int i = ddp->ntp - 1; st == TSYS_OK && i >= 0; i--) {
                double sz = (double)tsys_tensor_bytes(ddp->tp[i]);
                if (end > i + 1 && limit > 0 && bytes + sz > limit) {
                    if (!tsys_dist__ddp_add_bucket(ddp, i + 1, end - i - 1)) st = TSYS_ERR_INVALID_ARGS;
                    end = i + 1; bytes = 0;
                }
                bytes += sz;
            }
            if (st == TSYS_OK && !tsys_dist__ddp_add_bucket(ddp, 0, end)) st = TSYS_ERR_INVALID_ARGS;
        } else {
            for (int i = ddp->ntp - 1; st == TSYS_OK && i >= 0; i--)
                if (!tsys_dist__ddp_add_bucket(ddp, i, 1)) st = TSYS_ERR_INVALID_ARGS;
        }
        if (st != TSYS_OK && tsys_ctx_status(ctx) != TSYS_OK) st = tsys_ctx_status(ctx);
    }
    if (st == TSYS_OK && dd.comm_bf16) st = tsys_dist__ddp_make_wires(ddp);
    if (st == TSYS_OK && dd.shard_updates && !dd.ce_gather)
        st = tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: desc.shard_updates needs desc.ce_gather (each bucket's owner pulls its peers' gradients of it)");
    if (st == TSYS_OK && dd.shard_state && !dd.shard_updates)
        st = tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: desc.shard_state needs desc.shard_updates (each bucket's owner alone updates it)");
    if (st == TSYS_OK && dd.shard_masters && (!dd.shard_updates || !dd.read_by_copy))
        st = tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "ddp: desc.shard_masters needs %s", !dd.shard_updates ? "desc.shard_updates (the owners keep the fp32 weights they update)"
                                                                                                       : "desc.read_by_copy (which parameters the step reads only through their kept copies)");
    if (st == TSYS_OK && dd.shard_masters) {
        ddp->by_copy = (bool *)calloc((size_t)ddp->ntp + 1, sizeof(bool));
        if (!ddp->by_copy) st = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "ddp: desc.shard_masters: out of host memory");
        for (int j = 0; ddp->by_copy && j < ddp->ntp; j++) {   // a tensor listed twice (tied) is read by copy if both say so
            ddp->by_copy[j] = true;
            for (int i = 0; i < n; i++)
                if (params[i] == ddp->tp[j]) ddp->by_copy[j] = ddp->by_copy[j] && dd.read_by_copy[i];
        }
    }
    ddp->desc.read_by_copy = NULL;   // read here only
    if (st == TSYS_OK && dd.ce_gather) st = tsys_dist__ddp_gather_check(ddp);
    if (st == TSYS_OK) {
        uint64_t h = tsys_dist__hash(tsys_dist__hash(0xcbf29ce484222325ull, dd.strategy), dd.ce_gather);
        for (int i = 0; i < ddp->nb; i++) {
            const tsys_tensor *sent = ddp->b[i].wire ? ddp->b[i].wire : ddp->b[i].flat;
            h = tsys_dist__hash(tsys_dist__hash(h, ddp->b[i].numel), sent ? (int64_t)sent->dtype : -1);
        }
        st = tsys_dist__agree_layout(d, h, "ddp");
        ddp->layout_agreed = st == TSYS_OK;
    }
    if (st == TSYS_OK && (dd.strategy == TSYS_DDP_OVERLAP || dd.strategy == TSYS_DDP_BUCKETED)) {
        ddp->hooked = true;
        for (int i = 0; i < ddp->ntp; i++) {
            ddp->hooks[i].ddp = ddp; ddp->hooks[i].index = i;
            tsys_tensor_add_grad_hook(ddp->tp[i], tsys_dist__ddp_grad_ready, &ddp->hooks[i]);
        }
    }
    if (st != TSYS_OK || tsys_ctx_status(ctx) != TSYS_OK) {
        if (tsys_ctx_status(ctx) == TSYS_OK) tsys_ctx_set_error(ctx, st, "ddp: setup failed (%s)", tsys_status_str(st));
        tsys_ddp_free(ddp);
        return NULL;
    }
    ddp->stats.num_buckets = ddp->nb;
    for (int i = 0; i < ddp->nb; i++) {
        ddp->stats.bytes_per_step += ddp->b[i].wire ? (int64_t)tsys_tensor_bytes(ddp->b[i].wire) : ddp->b[i].bytes;
        ddp->stats.copied_buckets += ddp->b[i].scratch;
    }
    return ddp;
}

// Waits for whatever is in flight (a step that never reached finish) and re-arms the buckets.
TSYSDEF tsys_status tsys_ddp_start_step(tsys_ddp *ddp) {
    if (!ddp) return TSYS_ERR_INVALID_ARGS;
    tsys_status st = TSYS_OK;
    for (int k = 0; k < ddp->nlaunched; k++) {
        tsys_status s = tsys_dist__ddp_wait(ddp, ddp->order[k]);
        if (st == TSYS_OK) st = s;
    }
    tsys_dist__ddp_reset(ddp);
    if (st == TSYS_OK && ddp->owner && !ddp->ib_opt && !ddp->alone)   // an update after backward would read buckets never pulled here
        st = tsys_ctx_set_error(ddp->ctx, TSYS_ERR_INVALID_ARGS, "ddp: desc.shard_updates: each bucket's owner updates it inside backward: give the attached "
                                "optimizer to tsys_ddp_optim_in_backward");
    for (int i = 0; st == TSYS_OK && ddp->lowp_held && i < ddp->ntp; i++)   // the owners push copies into the block shared at attach
        if (!ddp->tp[i]->lowp || ddp->tp[i]->lowp->storage != ddp->lowp_held->storage)
            st = tsys_ctx_set_error(ddp->ctx, TSYS_ERR_INVALID_ARGS, "ddp: desc.shard_masters: '%s''s kept copy is not in the block its owner pushes into "
                                    "(tsys_optim_keep_lowp changed after tsys_ddp_attach_optimizer: make a new DDP)", ddp->tp[i]->name);
    return st;
}

TSYSDEF tsys_status tsys_ddp_finish(tsys_ddp *ddp) {
    if (!ddp) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = ddp->ctx;
    tsys_status st = ddp->launch_error != TSYS_OK ? ddp->launch_error : tsys_ctx_status(ctx);
    ddp->t_bwd_end_us = tsys_time_us();
    bool timing = tsys_dist__ddp_gpu_timing(ddp->d, ctx, ddp->dev);
    if (timing) tsys_event_record(ctx, ddp->dev, TSYS_STREAM_COMPUTE, &ddp->ev_bwd_end);
    if (ddp->nlaunched == 0) ddp->gpu_timing = timing;
    bool blocking = ddp->desc.strategy == TSYS_DDP_NAIVE;   // one all-reduce at a time
    for (int i = 0; st == TSYS_OK && i < ddp->nb; i++) {
        if (ddp->b[i].launched) continue;
        st = tsys_dist__ddp_launch(ddp, i);
        if (st == TSYS_OK && blocking) st = tsys_dist__ddp_wait(ddp, i);
    }
    for (int k = 0; k < ddp->nlaunched; k++) {   // in launch order; after an error, still drain
        tsys_status s = tsys_dist__ddp_wait(ddp, ddp->order[k]);
        if (st == TSYS_OK) st = s;
    }
    if (st == TSYS_OK && ddp->ceg) st = tsys_dist__ddp_gather_close(ddp);
    if (st == TSYS_OK && ddp->owner && ddp->ib_opt) st = tsys_dist__ddp_shard_land(ddp);   // no pushes without updates (the collectives timed alone)
    ddp->t_done_us = tsys_time_us();
    if (ddp->nlaunched > 0) {
        double start = ddp->t_bwd_end_us > ddp->t_first_us ? ddp->t_bwd_end_us : ddp->t_first_us;
        ddp->stats.comm_ms = (ddp->t_done_us - ddp->t_first_us) * 1e-3;
        ddp->stats.exposed_ms = (ddp->t_done_us - start) * 1e-3;
    } else ddp->stats.comm_ms = ddp->stats.exposed_ms = 0;
    ddp->stats_launched = ddp->nlaunched;   // CUDA times are read from this step's events by stats_get
    tsys_dist__ddp_reset(ddp);
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
            const tsys_dist__ddp_bucket *b = &ddp->b[i];
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
// Sharding: the trainable parameters, in parameter order, cut into N contiguous ranges at r/N of
// their bytes (deterministic, the same on every rank, agreed once by a hash); a rank holds at most
// total/N + the largest parameter. Each rank runs a tsys_adamw over the parameters
// it owns (the same desc, so the same per-element math and step count as one unsharded AdamW:
// bit-for-bit equal), then every parameter is broadcast from its owner, a run of back-to-back
// parameters with one owner in one call, all the calls in one group (tsys_dist_group_begin) so that
// through NCCL every owner sends at once. (A flat all-gather would need equal-sized shards: either
// parameters split across ranks or padded copies; grouped broadcasts of runs send the same bytes.)

#define TSYS_DIST__ZERO1_CHUNKS 4   // on 2 x H200 (xl): the optimizer phase 18.4 ms in one chunk, AdamW alone 14.0
enum { TSYS_DIST__ZERO1_GATHER_RANKS = 8 };   // ranks of desc.ce_gather (the copy engines' TSYS_DIST__CE_RANKS)
struct tsys_zero1 {
    tsys_dist *d;
    tsys_ctx *ctx;
    tsys_tensor **params;        // every parameter, retained
    int n;
    tsys_tensor **tp;            // trainable ones (borrowed)
    int ntp;
    int *owner;                  // per trainable parameter
    int *chunk;                  // per trainable parameter: its chunk of its owner's run
    tsys_optim *opt[TSYS_DIST__ZERO1_CHUNKS];   // AdamW over this rank's parameters of each chunk (NULL: none)
    int64_t state_bytes;
    bool layout_agreed;          // every rank has the same owners (tsys_dist__agree_layout)
    tsys_dist_work **works;      // a step's broadcasts in flight (at most one per trainable parameter)
    tsys_ddp *gather;            // tsys_ddp_attach_zero1: the DDP whose copy engines also bring the owners' new parameters
    int64_t part_off[TSYS_DIST__ZERO1_CHUNKS][TSYS_DIST__ZERO1_GATHER_RANKS];   // then: each owner's part of each chunk,
    int64_t part_len[TSYS_DIST__ZERO1_CHUNKS][TSYS_DIST__ZERO1_GATHER_RANKS];   // bytes in the parameters' storage
};

TSYSDEF void tsys_zero1_free(tsys_zero1 *z) {
    if (!z) return;
    for (int c = 0; c < TSYS_DIST__ZERO1_CHUNKS; c++) tsys_optim_free(z->opt[c]);
    for (int i = 0; i < z->n; i++) tsys_tensor_release(z->params[i]);
    TSYS_DIST__RELEASE(z->params); TSYS_DIST__RELEASE(z->tp); TSYS_DIST__RELEASE(z->owner); TSYS_DIST__RELEASE(z->chunk);
    TSYS_DIST__RELEASE(z->works);
    TSYS_DIST__RELEASE(z);
}

TSYSDEF tsys_zero1 *tsys_zero1_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_optim_desc *desc) {
    if (!d) return NULL;
    tsys_ctx *ctx = tsys_dist_ctx(d);
    if (tsys_ctx_status(ctx) != TSYS_OK) return NULL;
    if (n < 0 || (n > 0 && !params)) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "zero1: %d parameters and %s list", n, params ? "a" : "no"); return NULL; }
    for (int i = 0; i < n; i++) {
        if (!params[i]) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "zero1: parameter %d is NULL", i); return NULL; }
    }
    tsys_zero1 *z = (tsys_zero1 *)TSYS_DIST__ALLOC(sizeof(tsys_zero1));
    if (!z) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "zero1: out of host memory"); return NULL; }
    memset(z, 0, sizeof(*z));
    z->d = d; z->ctx = ctx;
    size_t cnt = (size_t)(n ? n : 1);
    int world = tsys_dist_size(d), rank = tsys_dist_rank(d);
    z->params = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);
    z->tp = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);
    z->owner = (int *)TSYS_DIST__ALLOC(sizeof(int) * cnt);
    z->chunk = (int *)TSYS_DIST__ALLOC(sizeof(int) * cnt);
    z->works = (tsys_dist_work **)TSYS_DIST__ALLOC(sizeof(tsys_dist_work *) * cnt);
    if (!z->params || !z->tp || !z->owner || !z->chunk || !z->works) {
        tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "zero1: out of host memory");
        tsys_zero1_free(z);
        return NULL;
    }
    double total = 0;
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int j = 0; j < z->n && !seen; j++) seen = z->params[j] == params[i];
        if (seen) continue;
        z->params[z->n++] = tsys_tensor_retain(params[i]);
        if (!params[i]->requires_grad) continue;   // never updated: no state, no broadcast
        z->tp[z->ntp++] = params[i];
        total += (double)tsys_tensor_bytes(params[i]);
    }
    // contiguous ranges in parameter order, cut where the bytes pass r/N of the total (a parameter
    // goes to the range holding its middle byte): each owner's parameters are one run of the arena,
    // so the step ends with one broadcast per rank instead of one per parameter
    double before = 0;
    for (int i = 0; i < z->ntp; i++) {
        double sz = (double)tsys_tensor_bytes(z->tp[i]);
        int owner = total > 0 ? (int)((before + 0.5 * sz) * world / total) : 0;
        z->owner[i] = owner < world ? owner : world - 1;
        before += sz;
        if (z->owner[i] == rank) z->state_bytes += 2 * (int64_t)tsys_tensor_numel(z->tp[i]) * 4;   // m and v, fp32
    }
    // chunks: each owner's run cut the same way, at c/CHUNKS of its bytes (by middle bytes)
    for (int i = 0; i < z->ntp;) {
        int j = i;
        double run = 0, at = 0;
        while (j < z->ntp && z->owner[j] == z->owner[i]) run += (double)tsys_tensor_bytes(z->tp[j++]);
        for (int k = i; k < j; k++) {
            double sz = (double)tsys_tensor_bytes(z->tp[k]);
            int c = run > 0 ? (int)((at + 0.5 * sz) * TSYS_DIST__ZERO1_CHUNKS / run) : 0;
            z->chunk[k] = c < TSYS_DIST__ZERO1_CHUNKS ? c : TSYS_DIST__ZERO1_CHUNKS - 1;
            at += sz;
        }
        i = j;
    }
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < z->ntp; i++) h = tsys_dist__hash(tsys_dist__hash(tsys_dist__hash(h, tsys_tensor_numel(z->tp[i])), z->tp[i]->dtype), z->owner[i]);
    z->layout_agreed = tsys_dist__agree_layout(d, h, "zero1") == TSYS_OK;
    tsys_tensor **sel = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);   // one chunk's, in order
    if (!sel) tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "zero1: out of host memory");
    for (int c = 0; sel && c < TSYS_DIST__ZERO1_CHUNKS && tsys_ctx_status(ctx) == TSYS_OK; c++) {
        int m = 0;
        for (int i = 0; i < z->ntp; i++)
            if (z->owner[i] == rank && z->chunk[i] == c) sel[m++] = z->tp[i];
        if (m > 0) z->opt[c] = tsys_adamw_new(ctx, sel, m, desc);
    }
    TSYS_DIST__RELEASE(sel);
    if (tsys_ctx_status(ctx) != TSYS_OK) { tsys_zero1_free(z); return NULL; }
    return z;
}

// Under tsys_ddp_attach_zero1: chunk by chunk, my update, then every owner's new parameters of the chunk pulled
// by the copy engines (no NCCL kernel beside the next chunk's update); the compute stream waits for the pulls.
static tsys_status tsys_dist__zero1_step_gather(tsys_zero1 *z) {
    tsys_ctx *ctx = z->ctx;
    tsys_status st = TSYS_OK;
#ifdef TSYS_DIST_NCCL
    tsys_dist__ceg *g = (tsys_dist__ceg *)z->gather->ceg;
    cudaStream_t s = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE);
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    bool ok = true;
    for (int c = 0; ok && st == TSYS_OK && c < TSYS_DIST__ZERO1_CHUNKS; c++) {
        if (z->opt[c]) st = tsys_optim_step(z->opt[c]);
        ok = st == TSYS_OK && tsys_dist__ceg_params_chunk(z->d, g, c, z->part_off[c], z->part_len[c], s, &e);
    }
    ok = ok && st == TSYS_OK && tsys_dist__ceg_join(z->d, g, s, &e);
    if (st == TSYS_OK && !ok) st = tsys_ctx_set_error(ctx, e.status != TSYS_OK ? e.status : TSYS_ERR_CUDA, "%s", e.msg);
    const int me = tsys_dist_rank(z->d);
    for (int i = 0; st == TSYS_OK && i < z->ntp; i++)
        if (z->owner[i] != me) tsys_tensor_mark_written(z->tp[i]);   // a kept low-precision copy is made again
#else
    st = tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "zero1: the copy engines' parameter pulls need NCCL");
#endif
    return st;
}

TSYSDEF tsys_status tsys_zero1_step(tsys_zero1 *z) {
    if (!z) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = z->ctx;
    if (tsys_ctx_status(ctx) != TSYS_OK) return tsys_ctx_status(ctx);
    if (z->gather) return tsys_dist__zero1_step_gather(z);
    // chunk by chunk: this rank's update of the chunk, then each run of back-to-back parameters of the
    // chunk with one owner broadcast from it, all in one group (through NCCL the owners send at the same
    // time, as an all-gather would; on the side stream, after the update, while the next chunk's runs)
    bool trusting = tsys_dist__trust(z->d, z->layout_agreed);
    tsys_status st = TSYS_OK;
    int nw = 0;
    for (int c = 0; st == TSYS_OK && c < TSYS_DIST__ZERO1_CHUNKS; c++) {
        if (z->opt[c]) st = tsys_optim_step(z->opt[c]);
        if (st == TSYS_OK) st = tsys_dist_group_begin(z->d);
        bool open = st == TSYS_OK;
        for (int i = 0; st == TSYS_OK && i < z->ntp;) {
            if (z->chunk[i] != c) { i++; continue; }
            int j = i + 1;
            while (j < z->ntp && z->owner[j] == z->owner[i] && z->chunk[j] == c && tsys_dist__contiguous(z->tp + i, j - i + 1, false)) j++;
            tsys_tensor *v = tsys_dist__run_view(ctx, z->tp + i, j - i, false);
            z->works[nw] = v ? tsys_dist_broadcast_async(z->d, v, z->owner[i]) : NULL;   // the parameters outlive the wait
            tsys_tensor_release(v);
            if (!z->works[nw]) st = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_INVALID_ARGS;
            else nw++;
            i = j;
        }
        if (open) { tsys_status e = tsys_dist_group_end(z->d); if (st == TSYS_OK) st = e; }
    }
    for (int k = 0; k < nw; k++) { tsys_status e = tsys_dist_wait(z->works[k]); if (st == TSYS_OK) st = e; }
    tsys_dist__untrust(z->d, trusting);
    return st;
}

TSYSDEF void tsys_zero1_zero_grad(tsys_zero1 *z) { if (z) tsys_zero_grads(z->ctx, z->params, z->n); }
TSYSDEF int64_t tsys_zero1_local_state_bytes(const tsys_zero1 *z) { return z ? z->state_bytes : 0; }

// The owners' new parameters come back by the copy engines too: every rank's parameter storage opened by the
// others (one storage, laid out alike on every rank, its allocation's start), and each owner's part of each chunk.
static tsys_status tsys_dist__zero1_share_params(tsys_zero1 *z, tsys_ddp *ddp) {
    tsys_ctx *ctx = z->ctx;
    const tsys_storage *store = z->ntp ? z->tp[0]->storage : NULL;
    uint64_t h = 0xcbf29ce484222325ull;
    bool one = store && tsys_dist_size(z->d) <= TSYS_DIST__ZERO1_GATHER_RANKS;
    for (int i = 0; one && i < z->ntp; i++) { one = z->tp[i]->storage == store; h = tsys_dist__hash(h, (int64_t)z->tp[i]->offset); }
    if (!one) return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_ddp_attach_zero1: the parameters must lie in one storage (a model's), with at most %d ranks",
                                        (int)TSYS_DIST__ZERO1_GATHER_RANKS);
    tsys_status st = tsys_dist__agree_layout(z->d, h, "tsys_ddp_attach_zero1 (the parameters' places in their storage)");
    memset(z->part_off, 0, sizeof z->part_off);
    memset(z->part_len, 0, sizeof z->part_len);
    for (int i = 0; i < z->ntp; i++) {
        int c = z->chunk[i], q = z->owner[i];
        if (z->part_len[c][q] == 0) z->part_off[c][q] = (int64_t)z->tp[i]->offset;
        z->part_len[c][q] = (int64_t)z->tp[i]->offset + (int64_t)tsys_tensor_bytes(z->tp[i]) - z->part_off[c][q];
    }
#ifdef TSYS_DIST_NCCL
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    if (st == TSYS_OK && !tsys_dist__ceg_share_params(z->d, (tsys_dist__ceg *)ddp->ceg, store->data, &e)) st = tsys_ctx_set_error(ctx, e.status, "%s", e.msg);
#endif
    if (st == TSYS_OK) z->gather = ddp;
    return st;
}

// The DDP receives the bytes of the parameters this rank owns (one run of its arena); each chunk's AdamW reads its
// part of every slot.
TSYSDEF tsys_status tsys_ddp_attach_zero1(tsys_ddp *ddp, tsys_zero1 *z) {
    if (!ddp || !z) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = ddp->ctx;
    bool same = z->ntp == ddp->ntp;
    for (int i = 0; same && i < z->ntp; i++) same = z->tp[i] == ddp->tp[i];
    if (!same) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_ddp_attach_zero1: ZeRO-1's parameters are not the DDP's (the same list, in the same order)");
    const int me = tsys_dist_rank(ddp->d), size = tsys_dist_size(ddp->d);
    int first = -1, last = -1;
    for (int i = 0; i < z->ntp; i++)
        if (z->owner[i] == me) { if (first < 0) first = i; last = i; }
    const size_t base = ddp->grad_arena ? ddp->grad_arena->offset : 0;
    // whole words of the arena (bf16 gradients may end a part mid-word): a slot's offsets keep the arena's alignment
    const int64_t arena = ddp->grad_arena ? (int64_t)tsys_tensor_bytes(ddp->grad_arena) : 0;
    const int64_t lo = first < 0 ? 0 : (int64_t)(z->tp[first]->grad->offset - base) / 4 * 4,
                  end = first < 0 ? 0 : (int64_t)(z->tp[last]->grad->offset - base + tsys_tensor_bytes(z->tp[last]->grad)),
                  hi = (end + 3) / 4 * 4 < arena ? (end + 3) / 4 * 4 : arena;
    tsys_status st = tsys_dist__ddp_gather_open(ddp, lo, hi);
    if (st == TSYS_OK) st = tsys_dist__zero1_share_params(z, ddp);
    for (int c = 0; st == TSYS_OK && c < TSYS_DIST__ZERO1_CHUNKS; c++) {
        if (!z->opt[c]) continue;
        int i = 0;
        while (z->owner[i] != me || z->chunk[i] != c) i++;   // the chunk's first parameter: its place in my slots
        const tsys_dtype gdt = z->tp[i]->grad->dtype;   // a view of the rest of the slots from there, in elements it starts on
        const int64_t at = (int64_t)(z->tp[i]->grad->offset - base) - lo, numel = ((int64_t)tsys_tensor_bytes(ddp->terms) - at) / (int64_t)tsys_dtype_size(gdt);
        tsys_tensor *view = tsys_tensor_view_raw(ctx, ddp->terms, (size_t)at, gdt, 1, &numel);
        st = view ? tsys_optim_sum_grads(z->opt[c], view, size, me, hi - lo) : tsys_ctx_status(ctx);
        tsys_tensor_release(view);
    }
    return st;
}

// >>fsdp ------------------------------------------------------------------------------------------
// Layout: a unit's 2-D parameters, in order, make a flat run of U elements, padded to N·S (S =
// ceil(U/N)); rank r keeps elements [rS, rS + S) as a 1-D fp32 tensor (its master shard, with an fp32
// gradient of the same shape). The parameters themselves become windows of the unit's `full` tensor
// (compute dtype, N·S elements), whose storage has memory only while the unit is gathered: the tape's
// saved weights are those same tensors, so backward reads whatever the storage holds when it runs.
// Gradients of a unit are windows of `gfull` (compute dtype), alive from the unit's first backward op
// to its reduce-scatter.
// Following the model: the trace hooks see every linear/embedding, forward and backward, with the
// weight it uses (tsys_trace_weight): the first op of a unit gathers it (and issues the next one's
// gather), the last frees it (in forward only when resharding, or when its backward needs no weight);
// ops on other weights (another model in the same context) are ignored. Gradient-ready hooks count a
// unit's gradients.
// A group of one (f->direct, desc.no_shortcut off): a unit's shard is the whole unit, unpadded; the
// all-gather of the cast master would copy it, the reduce-scatter (AVG over 1) copy gfull, and the
// sum into the shard gradient cast it to fp32 and add (or store when the gradient counts as zero).
// So the gather casts the master straight into `full` and the reduce-scatter is one cast-or-add
// kernel from gfull into the shard gradient: no `src` or `rs_out`, no collective, no wait, the same
// bits (tests/test_fsdp.c fsdp_paths_agree_* checks them against the general path). In fp32 the cast
// is a copy, so `full` is a view of the master (f->alias): gathering and freeing do nothing.
// Ordering on GPUs: an NCCL collective starts on the side stream after the compute stream's work so
// far, so a unit's reallocated memory is never written while an earlier op still reads it; the wait
// makes the compute stream wait for the gather (no host sync).
// Units kept from forward through backward, with AdamW inside backward (tsys_fsdp_optim_in_backward):
// once a unit's backward is over and its shard updated, its new weights are gathered for the next
// forward beside the rest of backward (the cast on the background stream behind the update, the
// all-gather on the side stream behind the cast), so the next forward gathers nothing. Its weights keep
// their memory from step to step (the all-gather writes over them): a captured step replays at the
// addresses it recorded. tsys_fsdp_finish waits for those gathers.

typedef struct tsys_dist__fsdp_unit {
    char name[TSYS_NAME_LEN];
    tsys_tensor **p;             // its parameters (retained), forward order
    int np;
    int64_t *off;                // element offset of each in the flat run
    int64_t numel, shard;        // U and S
    bool has_linear;             // backward needs the weights (an embedding's does not)
    tsys_tensor *full, *gfull;   // compute dtype, N·S: the gathered weights / the full gradients
    tsys_tensor *master;         // fp32 S: this rank's shard (requires grad; .grad fp32 S)
    tsys_tensor *src;            // the compute-dtype copy of master being all-gathered
    tsys_tensor *rs_out;         // reduce-scatter output (compute dtype S) while in flight
    tsys_tensor *part;           // desc.ce_transfers: my part of `full` (compute dtype S), where my shard is cast
    tsys_dist_work *ag, *rs;
    bool gathered;
    bool next;                   // being gathered in this backward for the next forward (tsys_dist__fsdp_gather_next)
    bool said;                   // its shard handed to the optimizer in this step (tsys_fsdp_optim_in_backward)
    int ready;                   // gradients final in this backward
    int seen_fwd, seen_bwd;      // its ops met in this forward / backward
} tsys_dist__fsdp_unit;

struct tsys_fsdp {
    tsys_dist *d;
    tsys_ctx *ctx;
    tsys_dtype cdt;
    bool prefetch;
    bool reshard;                // free a unit after its forward, gather it again for its backward
    bool direct;                 // a group of one without the collectives (desc.no_shortcut off)
    bool alias;                  // direct in fp32: `full` is a view of the master itself (nothing to gather)
    tsys_dist__fsdp_unit *u;
    int nu;
    tsys_tensor **rep;           // replicated trainable parameters (retained)
    int nrep;
    tsys_tensor **frozen;        // parameters without requires_grad (retained; broadcast once)
    int nfrozen;
    tsys_tensor **local;         // tsys_fsdp_params: masters then rep
    int nlocal;
    tsys_dist_work **rep_work;   // all-reduces of replicated gradients in flight
    int nrep_work;
    bool built;                  // the parameters were moved in (free gives them back)
    bool agreed;                 // every rank has the same units: the collectives skip their per-call check
    int rs_pending;              // unit whose reduce-scatter is in flight (-1 none)
    int next_pending;            // unit updated whose gather for the next forward waits for the next reduce-scatter's issue (-1 none)
    tsys_trace_hooks prev;       // hooks installed before ours (chained)
    int in_hook;
    int recompute;               // inside an activation-checkpoint recompute (its forward ops are backward's)
    int ngathered;
    int near;                    // the unit found last: where the next search starts
    tsys_optim *ib_opt;          // tsys_fsdp_optim_in_backward: told when each shard's gradient is final, or NULL
    tsys_event updated;          // the background stream's update and cast, which a next-forward gather waits for
    tsys_fsdp_stats stats, cur;
    tsys_status err;
    void *fce;                   // desc.ce_transfers: the copy engines' state (tsys_dist__fce), or NULL
    tsys_tensor *terms;          // desc.ce_transfers: my receive buffer, the optimizer's terms
    int64_t *terms_at;           // desc.ce_transfers: each of tsys_fsdp_params' terms' byte offset in a slot (-1: none)
    int64_t slot_bytes;          // desc.ce_transfers: a peer's slot: my part of every unit, back to back
    bool *moved;                 // desc.ce_transfers: the units moved in this step (scratch of tsys_fsdp_finish)
    tsys_tensor *rep_arena;      // desc.ce_transfers: the replicated parameters' gradients, one block the peers open
    int64_t *rep_off;            // desc.ce_transfers: each replicated gradient's byte offset in it
    int64_t rep_at;              // desc.ce_transfers: where the replicated gradients start in a slot
    int *pending;                // desc.ce_transfers: replicated parameters whose gradients are final, not yet pulled
    int npending;
    bool *rep_moved;             // desc.ce_transfers: the replicated parameters pulled in this step
    void *spans;                 // desc.ce_transfers: scratch of a pull, tsys_dist__fce_span (the pending gradients, neighbours merged)
    tsys_tensor **said_list;     // desc.ce_transfers: scratch of a pull (what the optimizer is told)
};

static size_t tsys_dist__fsdp_es(const tsys_fsdp *f) { return tsys_dtype_size(f->cdt); }

// Errors inside hooks cannot be returned: the first one is kept (and set in the context, which
// stops later kernels) and tsys_fsdp_finish returns it.
static tsys_status tsys_dist__fsdp_note(tsys_fsdp *f, tsys_status st) {
    if (st != TSYS_OK && f->err == TSYS_OK) f->err = st;
    return st;
}

// A group of one: the shard is the whole unit (no padding), the all-gather of its cast a copy, so the
// cast writes the weights themselves; done at once, on the compute stream.
static tsys_status tsys_dist__fsdp_gather_direct(tsys_fsdp *f, tsys_dist__fsdp_unit *U) {
    TSYS_ASSERT(f->direct && U->shard == U->numel);
    tsys_status st = tsys_tensor_cast_from(f->ctx, U->full, U->master);
    U->gathered = st == TSYS_OK;
    return st;
}

// behind: the cast runs on the current stream (the background one, after the unit's update) and the
// all-gather waits for it there too (tsys_dist__fsdp_gather_next).
static tsys_status tsys_dist__fsdp_gather_start(tsys_fsdp *f, int i, bool behind) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    if (U->gathered || U->ag) return TSYS_OK;
    tsys_ctx *ctx = f->ctx;
    int world = tsys_dist_size(f->d);
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "fsdp gathered weights"));
    tsys_status st = f->alias ? TSYS_OK : tsys_storage_resize(ctx, U->full, (size_t)(world * U->shard) * tsys_dist__fsdp_es(f));
    tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "fsdp comm"));
    if (st == TSYS_OK && f->alias) U->gathered = true;   // the weights are the master's memory
    else if (st == TSYS_OK && f->direct) st = tsys_dist__fsdp_gather_direct(f, U);
    else if (st == TSYS_OK) {
        tsys_no_grad_begin(ctx);
        U->src = tsys_cast(ctx, U->master, f->cdt);   // before communication: half the bytes in bf16/fp16
        tsys_no_grad_end(ctx);
        if (behind && U->src && (tsys_event_record(ctx, U->master->device, TSYS_STREAM_BACKGROUND, &f->updated) != TSYS_OK ||
                                 tsys_event_wait(ctx, &f->updated, TSYS_STREAM_SIDE) != TSYS_OK)) {
            tsys_tensor_release(U->src); U->src = NULL;
        }
        bool trusting = tsys_dist__trust(f->d, f->agreed);   // every rank agreed on the units at construction
        U->ag = U->src ? tsys_dist_all_gather_async(f->d, U->full, U->src) : NULL;
        tsys_dist__untrust(f->d, trusting);
        if (!U->ag) st = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_IO;
    }
    tsys_mem_set_tag(ctx, tag);
    if (st == TSYS_OK) {
        f->cur.all_gathers++;
        f->cur.gathered_bytes += (int64_t)tsys_tensor_bytes(U->full);
        if (++f->ngathered > f->cur.max_units_gathered) f->cur.max_units_gathered = f->ngathered;
    } else {
        tsys_tensor_release(U->src); U->src = NULL;
        if (!f->alias && !f->fce) tsys_storage_resize(ctx, U->full, 0);
    }
    return tsys_dist__fsdp_note(f, st);
}
static tsys_status tsys_dist__fsdp_gather_issue(tsys_fsdp *f, int i) { return tsys_dist__fsdp_gather_start(f, i, false); }

// Whether units are gathered for the next forward in backward (above): kept units, AdamW inside backward,
// collectives (a group of one casts on the compute stream: nothing to hide).
static bool tsys_dist__fsdp_gathers_next(const tsys_fsdp *f) { return f->ib_opt && !f->reshard && !f->direct; }

// Unit i's shard was handed to the optimizer (its backward is over): its new weights, gathered into the
// memory they keep, behind the update. Issued after the next unit's reduce-scatter, not before it: the
// compute stream waits for that one, and the side stream runs its collectives in order.
static tsys_status tsys_dist__fsdp_gather_next(tsys_fsdp *f, int i) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    if (!tsys_dist__fsdp_gathers_next(f) || U->ag) return TSYS_OK;
    if (U->gathered) { U->gathered = false; f->ngathered--; }   // the old weights: read by nothing from here on
    const tsys_device dev = U->master->device;
    tsys_stream prev = tsys_set_stream(f->ctx, dev, TSYS_STREAM_BACKGROUND);
    tsys_status st = tsys_dist__fsdp_gather_start(f, i, true);
    tsys_set_stream(f->ctx, dev, prev);
    U->next = st == TSYS_OK;
    return st;
}
static tsys_status tsys_dist__fsdp_next_flush(tsys_fsdp *f) {
    const int i = f->next_pending;
    f->next_pending = -1;
    return i >= 0 ? tsys_dist__fsdp_gather_next(f, i) : TSYS_OK;
}

static tsys_status tsys_dist__fsdp_gather_wait(tsys_fsdp *f, int i) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    if (U->gathered) return TSYS_OK;
    tsys_status st = tsys_dist__fsdp_gather_issue(f, i);
    if (st != TSYS_OK || U->gathered) return st;   // gathered already: a group of one's direct cast
    double t0 = tsys_time_us();
    st = tsys_dist_wait(U->ag);
    f->cur.wait_ms += (tsys_time_us() - t0) * 1e-3;
    U->ag = NULL;
    tsys_tensor_release(U->src); U->src = NULL;
    U->gathered = st == TSYS_OK;
    return tsys_dist__fsdp_note(f, st);
}

static void tsys_dist__fsdp_release(tsys_fsdp *f, int i) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    if (U->ag) { tsys_dist__fsdp_note(f, tsys_dist_wait(U->ag)); U->ag = NULL; tsys_tensor_release(U->src); U->src = NULL; U->gathered = true; }
    if (!U->gathered) return;
    if (!f->alias && !f->fce) tsys_storage_resize(f->ctx, U->full, 0);   // an alias's memory is the master's; the peers write ce's
    U->gathered = false;
    f->ngathered--;
}

// Unit i's gradients are in its shard gradient: the parameters' gradient windows and gfull go.
static void tsys_dist__fsdp_grads_end(tsys_fsdp *f, int i) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    for (int k = 0; k < U->np; k++) { tsys_tensor_release(U->p[k]->grad); U->p[k]->grad = NULL; }
    if (!f->fce) tsys_storage_resize(f->ctx, U->gfull, 0);   // desc.ce_transfers: the peers pull from it
}

// A group of one: the reduce-scatter (AVG over 1) would be a copy of gfull, added to the fp32 shard
// gradient after a cast to fp32 (stored when it counts as zero); one kernel does the same sum.
static tsys_status tsys_dist__fsdp_reduce_direct(tsys_fsdp *f, int i) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    TSYS_ASSERT(f->direct && U->shard == U->numel && !U->rs);
    tsys_tensor *g = U->master->grad;
    tsys_status st = U->master->grad_zero ? tsys_tensor_cast_from(f->ctx, g, U->gfull) : tsys_tensor_accumulate(f->ctx, g, U->gfull);
    if (st == TSYS_OK) U->master->grad_zero = false;
    if (st == TSYS_OK && f->ib_opt) st = tsys_optim_overlap_ready(f->ib_opt, &U->master, 1, TSYS_STREAM_COMPUTE);
    U->said = f->ib_opt && st == TSYS_OK;
    tsys_dist__fsdp_grads_end(f, i);
    return tsys_dist__fsdp_note(f, st);
}

// The reduce-scatter of unit i is done: its fp32 shard gradient += the result (or = when it counts as
// zero), the full gradients are freed.
static tsys_status tsys_dist__fsdp_rs_complete(tsys_fsdp *f, int i) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    if (!U->rs) return TSYS_OK;
    tsys_ctx *ctx = f->ctx;
    double t0 = tsys_time_us();
    tsys_status st = tsys_dist_wait(U->rs);
    f->cur.wait_ms += (tsys_time_us() - t0) * 1e-3;
    U->rs = NULL;
    tsys_tensor *g = U->master->grad;
    if (st == TSYS_OK && U->rs_out != g) {
        tsys_no_grad_begin(ctx);
        tsys_tensor *r32 = tsys_cast(ctx, U->rs_out, TSYS_F32);
        tsys_tensor *sum = !r32 ? NULL : U->master->grad_zero ? tsys_tensor_retain(r32) : tsys_add(ctx, g, r32);
        tsys_no_grad_end(ctx);
        st = sum ? tsys_tensor_copy_from(ctx, g, sum) : tsys_ctx_status(ctx);
        tsys_tensor_release(r32); tsys_tensor_release(sum);
    }
    if (st == TSYS_OK) U->master->grad_zero = false;   // the flag is the leaf's: its .grad holds values now
    if (st == TSYS_OK && f->ib_opt) st = tsys_optim_overlap_ready(f->ib_opt, &U->master, 1, TSYS_STREAM_COMPUTE);   // the sum is on the compute stream
    U->said = f->ib_opt && st == TSYS_OK;
    if (st == TSYS_OK && tsys_dist__fsdp_gathers_next(f)) f->next_pending = i;
    if (U->rs_out != g) tsys_tensor_release(U->rs_out);
    U->rs_out = NULL;
    tsys_dist__fsdp_grads_end(f, i);
    return tsys_dist__fsdp_note(f, st);
}

// Unit i enters its backward: full gradients as windows of gfull, marked zero (the first write stores).
static tsys_status tsys_dist__fsdp_grads_begin(tsys_fsdp *f, int i) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    tsys_ctx *ctx = f->ctx;
    if (U->rs) tsys_dist__fsdp_rs_complete(f, i);   // a second backward before finish
    if (U->p[0]->grad) return TSYS_OK;
    int world = tsys_dist_size(f->d);
    size_t es = tsys_dist__fsdp_es(f);
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "fsdp full grads"));
    tsys_status st = tsys_storage_resize(ctx, U->gfull, (size_t)(world * U->shard) * es);
    tsys_mem_set_tag(ctx, tag);
    if (st != TSYS_OK) return tsys_dist__fsdp_note(f, st);
    // the padding past U is reduced too: it must hold zeros (desc.ce_transfers: made so once)
    if (world * U->shard > U->numel && !f->fce) {
        int64_t pad = world * U->shard - U->numel;
        tsys_tensor *tail = tsys_tensor_view_raw(ctx, U->gfull, (size_t)U->numel * es, f->cdt, 1, &pad);
        st = tail ? tsys_tensor_fill(ctx, tail, 0.0f) : tsys_ctx_status(ctx);
        tsys_tensor_release(tail);
    }
    for (int k = 0; st == TSYS_OK && k < U->np; k++) {
        tsys_tensor *p = U->p[k];
        p->grad = tsys_tensor_view_raw(ctx, U->gfull, (size_t)U->off[k] * es, f->cdt, p->ndim, p->shape);
        if (!p->grad) { st = tsys_ctx_status(ctx); break; }
        tsys_tensor_set_name(p->grad, "%s.grad", p->name);
        p->grad_zero = true;
    }
    U->ready = 0;
    return tsys_dist__fsdp_note(f, st);
}

// desc.ce_transfers, unit i's backward over (as of the compute stream): my part of its gradients pulled from every
// peer, my shard updated behind the pulls (AdamW sums the parts as it reads them and writes the shard's copy in the
// compute dtype straight into my part of the unit's weights: no cast; in fp32 the shard is copied there), and that
// part pushed into every peer's (tsys_dist__fce in >>engine nccl).
#ifdef TSYS_DIST_NCCL
static tsys_status tsys_dist__fsdp_ce_err(tsys_fsdp *f, const tsys_dist__err *e) {
    return tsys_dist__fsdp_note(f, tsys_ctx_set_error(f->ctx, e->status != TSYS_OK ? e->status : TSYS_ERR_CUDA, "%s", e->msg));
}
// The replicated gradients final since the last pull, as spans of the peers' blocks (neighbours merged) into
// f->spans, and the parameters into f->said_list from index `first`; how many spans.
static int tsys_dist__fsdp_ce_pending(tsys_fsdp *f, int first) {
    tsys_dist__fce_span *sp = (tsys_dist__fce_span *)f->spans;
    int n = 0;
    for (int k = 0; k < f->npending; k++) {
        const int j = f->pending[k];
        const int64_t off = f->rep_off[j], len = (int64_t)tsys_tensor_bytes(f->rep[j]->grad);
        f->said_list[first + k] = f->rep[j];
        f->rep_moved[j] = true;
        if (n && sp[n - 1].src + sp[n - 1].len == off) sp[n - 1].len += len;   // backward meets them in either order
        else if (n && off + len == sp[n - 1].src) { sp[n - 1].src = off; sp[n - 1].dst = f->rep_at + off; sp[n - 1].len += len; }
        else sp[n++] = (tsys_dist__fce_span){off, f->rep_at + off, len};
    }
    return n;
}
// Unit i's gradients (i == f->nu: none) and the pending replicated ones pulled, then their updates queued.
static tsys_status tsys_dist__fsdp_ce_pull(tsys_fsdp *f, int i) {
    tsys_ctx *ctx = f->ctx;
    tsys_dist__fsdp_unit *U = i < f->nu ? &f->u[i] : NULL;
    const size_t es = tsys_dist__fsdp_es(f);
    const int64_t part = U ? (int64_t)tsys_dist_rank(f->d) * U->shard * (int64_t)es : 0, bytes = U ? U->shard * (int64_t)es : 0;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    cudaStream_t compute = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE), side = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_SIDE);
    if (U) f->said_list[0] = U->master;
    const int nspans = tsys_dist__fsdp_ce_pending(f, U ? 1 : 0), nsaid = (U ? 1 : 0) + f->npending;
    f->npending = 0;
    if (!tsys_dist__fce_reduce(f->d, (tsys_dist__fce *)f->fce, U ? i : f->nu, part, bytes, U ? f->terms_at[i] : 0, (const tsys_dist__fce_span *)f->spans, nspans,
                               f->slot_bytes, compute, side, &e))
        return tsys_dist__fsdp_ce_err(f, &e);
    if (U) U->master->grad_zero = false;
    return nsaid ? tsys_optim_overlap_ready(f->ib_opt, f->said_list, nsaid, TSYS_STREAM_SIDE) : TSYS_OK;   // the side stream joined the pulls
}
static tsys_status tsys_dist__fsdp_ce_reduce(tsys_fsdp *f, int i) {
    tsys_dist__fsdp_unit *U = &f->u[i];
    tsys_ctx *ctx = f->ctx;
    if (!f->ib_opt)
        return tsys_dist__fsdp_note(f, tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: desc.ce_transfers updates each unit's shard inside backward: attach the "
                                                          "optimizer with tsys_fsdp_optim_in_backward (unit '%s' has its gradients)", U->name));
    const size_t es = tsys_dist__fsdp_es(f);
    const int64_t part = (int64_t)tsys_dist_rank(f->d) * U->shard * (int64_t)es, bytes = U->shard * (int64_t)es;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    tsys_dist__fce *g = (tsys_dist__fce *)f->fce;
    tsys_status st = tsys_dist__fsdp_ce_pull(f, i);
    if (st != TSYS_OK) return tsys_dist__fsdp_note(f, st);
    U->said = true;
    const tsys_tensor *c = U->master->lowp;   // the update wrote my part (tsys_optim_keep_lowp_into)
    if (f->cdt != TSYS_F32 && (!c || tsys_tensor_data((tsys_tensor *)c) != tsys_tensor_data(U->part)))
        st = tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: desc.ce_transfers: the optimizer no longer writes shard '%s''s copy into the unit's weights (its copies "
                                "were given back or kept elsewhere)", U->master->name);
    if (st == TSYS_OK && !tsys_dist__fce_push(f->d, g, i, f->cdt == TSYS_F32 ? tsys_tensor_data(U->master) : NULL, part, bytes,
                                              (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_BACKGROUND), &e))
        return tsys_dist__fsdp_ce_err(f, &e);
    f->cur.reduce_scatters++;
    f->cur.reduced_bytes += (int64_t)tsys_tensor_bytes(U->gfull);
    f->cur.all_gathers++;
    f->cur.gathered_bytes += (int64_t)tsys_tensor_bytes(U->full);
    if (f->ngathered > f->cur.max_units_gathered) f->cur.max_units_gathered = f->ngathered;   // all of them, the step through
    tsys_dist__fsdp_grads_end(f, i);
    return tsys_dist__fsdp_note(f, st);
}
// The step's end: replicated gradients final after the last unit pulled (none in a model whose embedding comes
// first), those without a gradient in this step left alone (their peers' would be last step's); the compute
// stream waits for the weights my peers pushed and for them to have read my gradients.
static tsys_status tsys_dist__fsdp_ce_land(tsys_fsdp *f) {
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    tsys_status st = f->npending && f->ib_opt ? tsys_dist__fsdp_ce_pull(f, f->nu) : TSYS_OK;
    for (int j = 0; st == TSYS_OK && f->ib_opt && j < f->nrep; j++)
        if (!f->rep_moved[j]) st = tsys_optim_overlap_skip(f->ib_opt, &f->rep[j], 1);
    memset(f->rep_moved, 0, sizeof(bool) * (size_t)(f->nrep + 1));
    f->npending = 0;
    if (st != TSYS_OK) return tsys_dist__fsdp_note(f, st);
    for (int i = 0; i < f->nu; i++) f->moved[i] = f->u[i].said;
    cudaStream_t compute = (cudaStream_t)tsys_cuda_stream_of(f->ctx, TSYS_STREAM_COMPUTE), side = (cudaStream_t)tsys_cuda_stream_of(f->ctx, TSYS_STREAM_SIDE);
    if (!tsys_dist__fce_land(f->d, (tsys_dist__fce *)f->fce, f->moved, compute, side, &e)) return tsys_dist__fsdp_ce_err(f, &e);
    for (int i = 0; i < f->nu; i++) if (f->moved[i]) tsys_tensor_mark_written(f->u[i].full);   // written by the copy engines
    return TSYS_OK;
}
#else
static tsys_status tsys_dist__fsdp_ce_reduce(tsys_fsdp *f, int i) { (void)i; return tsys_ctx_set_error(f->ctx, TSYS_ERR_UNSUPPORTED, "fsdp: desc.ce_transfers: built without NCCL"); }
static tsys_status tsys_dist__fsdp_ce_land(tsys_fsdp *f) { return tsys_ctx_set_error(f->ctx, TSYS_ERR_UNSUPPORTED, "fsdp: desc.ce_transfers: built without NCCL"); }
#endif

static int tsys_dist__fsdp_unit_of(tsys_fsdp *f, const tsys_tensor *w);

static void tsys_dist__fsdp_grad_ready(tsys_ctx *ctx, tsys_tensor *p, void *user) {
    tsys_fsdp *f = (tsys_fsdp *)user;
    int i = tsys_dist__fsdp_unit_of(f, p);
    tsys_dist__fsdp_unit *U = i >= 0 ? &f->u[i] : NULL;
    if (!U || ++U->ready < U->np) return;
    if (U->said) {   // the optimizer updated the shard from the first backward's gradients: these would be lost
        tsys_dist__fsdp_note(f, tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: unit '%s' has gradients again before tsys_fsdp_finish, and its AdamW "
                                                   "step ran inside the first backward (tsys_fsdp_optim_in_backward): one backward a step", U->name));
        return;
    }
    if (f->direct) {
        f->cur.reduce_scatters++;
        f->cur.reduced_bytes += (int64_t)tsys_tensor_bytes(U->gfull);
        tsys_dist__fsdp_reduce_direct(f, i);
        return;
    }
    if (f->fce) { tsys_dist__fsdp_ce_reduce(f, i); return; }
    // one reduce-scatter in flight: the previous unit's completes first (bounds the full gradients alive)
    if (f->rs_pending >= 0 && f->rs_pending != i) tsys_dist__fsdp_rs_complete(f, f->rs_pending);
    f->rs_pending = -1;
    tsys_tensor *g = U->master->grad;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "fsdp comm"));
    // fp32 into a gradient that counts as zero: straight into it; else a buffer, added when done
    U->rs_out = f->cdt == TSYS_F32 && U->master->grad_zero ? g : tsys_tensor_new(ctx, f->cdt, g->device, 1, &U->shard);
    tsys_mem_set_tag(ctx, tag);
    bool trusting = tsys_dist__trust(f->d, f->agreed);
    U->rs = U->rs_out ? tsys_dist_reduce_scatter_async(f->d, U->rs_out, U->gfull, TSYS_DIST_AVG) : NULL;
    tsys_dist__untrust(f->d, trusting);
    if (!U->rs) { tsys_dist__fsdp_note(f, tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_IO); return; }
    f->cur.reduce_scatters++;
    f->cur.reduced_bytes += (int64_t)tsys_tensor_bytes(U->gfull);
    f->rs_pending = i;
    tsys_dist__fsdp_note(f, tsys_dist__fsdp_next_flush(f));
}

static void tsys_dist__fsdp_rep_ready(tsys_ctx *ctx, tsys_tensor *p, void *user) {
    tsys_fsdp *f = (tsys_fsdp *)user;
    if (!p->grad) return;
    if (f->direct) { f->cur.all_reduces++; return; }   // the average over one rank: the gradient itself
    if (f->fce) {   // desc.ce_transfers: pulled with the next unit's part (tsys_dist__fsdp_ce_pull)
        for (int j = 0; j < f->nrep; j++)
            if (f->rep[j] == p && !f->rep_moved[j] && f->npending < f->nrep) { f->pending[f->npending++] = j; f->cur.all_reduces++; }
        return;
    }
    if (f->nrep_work >= f->nrep) {   // a second backward before finish: the first one's are done first
        for (int i = 0; i < f->nrep_work; i++) tsys_dist__fsdp_note(f, tsys_dist_wait(f->rep_work[i]));
        f->nrep_work = 0;
    }
    bool trusting = tsys_dist__trust(f->d, f->agreed);
    tsys_dist_work *w = tsys_dist_all_reduce_async(f->d, p->grad, TSYS_DIST_AVG);
    tsys_dist__untrust(f->d, trusting);
    if (!w) { tsys_dist__fsdp_note(f, tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_IO); return; }
    f->rep_work[f->nrep_work++] = w;
    f->cur.all_reduces++;
}

// the ops that use a unit's weights (tsys_trace_weight names the weight); the fused head + loss's backward
// does not read its weight (it made the gradients in forward): its unit is not gathered again for it
static bool tsys_dist__fsdp_counted(const char *name) {
    return !strcmp(name, "linear") || !strcmp(name, "embedding") || !strcmp(name, "linear_cross_entropy");
}

// The unit of a parameter (the weight the running linear/embedding uses, tsys_trace_weight, or one
// whose gradient is ready); -1: not ours. Every op asks (forward and backward, begin and end), and
// the model goes through its units in order, forward then back: the search starts at the unit found
// last and widens on both sides (a few compares a call instead of a scan over all the parameters).
static int tsys_dist__fsdp_unit_of(tsys_fsdp *f, const tsys_tensor *w) {
    if (!w) return -1;
    for (int dist = 0; dist < f->nu; dist++)
        for (int side = 0; side < (dist ? 2 : 1); side++) {
            int i = side ? f->near - dist : f->near + dist;
            if (i < 0 || i >= f->nu) continue;
            for (int k = 0; k < f->u[i].np; k++)
                if (f->u[i].p[k] == w) { f->near = i; return i; }
        }
    return -1;
}

static void tsys_dist__fsdp_op_begin(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    tsys_fsdp *f = (tsys_fsdp *)user;
    if (f->prev.op_begin) f->prev.op_begin(ctx, name, kind, f->prev.user);
    if (kind == TSYS_TRACE_REGION && !strcmp(name, "checkpoint recompute")) f->recompute++;
    if (f->in_hook || (kind != TSYS_TRACE_FORWARD && kind != TSYS_TRACE_BACKWARD) || !tsys_dist__fsdp_counted(name)) return;
    int i = tsys_dist__fsdp_unit_of(f, tsys_trace_weight(ctx));
    if (i < 0) return;
    tsys_dist__fsdp_unit *U = &f->u[i];
    f->in_hook++;
    if (kind == TSYS_TRACE_FORWARD && f->recompute) {
        // a checkpointed region runs its forward again inside backward: the unit is gathered again
        // (its forward freed it) and stays so until its own backward ops are done
        tsys_dist__fsdp_gather_wait(f, i);
    } else if (kind == TSYS_TRACE_FORWARD) {
        if (U->seen_fwd >= U->np) {   // a unit used again: a new forward (what the last one left goes)
            for (int j = 0; j < f->nu; j++) {
                f->u[j].seen_fwd = f->u[j].seen_bwd = 0;
                if (j != i) tsys_dist__fsdp_release(f, j);
            }
        }
        if (!strcmp(name, "linear")) U->has_linear = true;   // its backward will read the weights
        if (U->seen_fwd == 0) {
            tsys_dist__fsdp_gather_wait(f, i);
            if (f->prefetch && i + 1 < f->nu) tsys_dist__fsdp_gather_issue(f, i + 1);
        }
    } else if (U->seen_bwd == 0) {
        if (U->has_linear) tsys_dist__fsdp_gather_wait(f, i);
        tsys_dist__fsdp_grads_begin(f, i);
        if (f->prefetch && i > 0 && f->u[i - 1].has_linear && f->u[i - 1].seen_bwd == 0) tsys_dist__fsdp_gather_issue(f, i - 1);
    }
    f->in_hook--;
}

static void tsys_dist__fsdp_op_end(tsys_ctx *ctx, const char *name, tsys_trace_kind kind, void *user) {
    tsys_fsdp *f = (tsys_fsdp *)user;
    int i = -1;
    if (kind == TSYS_TRACE_REGION && !strcmp(name, "checkpoint recompute") && f->recompute > 0) f->recompute--;
    bool counted = (kind == TSYS_TRACE_FORWARD && !f->recompute) || kind == TSYS_TRACE_BACKWARD;
    if (!f->in_hook && counted && tsys_dist__fsdp_counted(name)) i = tsys_dist__fsdp_unit_of(f, tsys_trace_weight(ctx));
    if (i >= 0) {
        tsys_dist__fsdp_unit *U = &f->u[i];
        f->in_hook++;
        if (kind == TSYS_TRACE_FORWARD) {
            // the last unit serves backward next; without resharding every unit whose backward reads
            // its weights stays gathered for it (has_linear is known by its last forward op)
            // (gathered for the next forward in backward, a unit keeps its memory: the embedding too)
            const bool drop = f->reshard || (!U->has_linear && !tsys_dist__fsdp_gathers_next(f));
            if (++U->seen_fwd == U->np && i != f->nu - 1 && drop) tsys_dist__fsdp_release(f, i);
        } else if (++U->seen_bwd == U->np && !tsys_dist__fsdp_gathers_next(f)) tsys_dist__fsdp_release(f, i);
        f->in_hook--;
    }
    if (f->prev.op_end) f->prev.op_end(ctx, name, kind, f->prev.user);
}
// the other members pass through to the hooks that were there
static void tsys_dist__fsdp_kernel(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) { tsys_fsdp *f = (tsys_fsdp *)user; if (f->prev.kernel) f->prev.kernel(ctx, k, f->prev.user); }
static void tsys_dist__fsdp_kernel_begin(tsys_ctx *ctx, const tsys_trace_kernel *k, void *user) { tsys_fsdp *f = (tsys_fsdp *)user; if (f->prev.kernel_begin) f->prev.kernel_begin(ctx, k, f->prev.user); }
static void tsys_dist__fsdp_mem(tsys_ctx *ctx, const tsys_mem_event *e, void *user) { tsys_fsdp *f = (tsys_fsdp *)user; if (f->prev.mem) f->prev.mem(ctx, e, f->prev.user); }

TSYSDEF tsys_status tsys_fsdp_finish(tsys_fsdp *f) {
    if (!f) return TSYS_ERR_INVALID_ARGS;
    tsys_status st = TSYS_OK;
    for (int i = 0; i < f->nu; i++)
        if (f->u[i].rs) { tsys_status s2 = tsys_dist__fsdp_rs_complete(f, i); if (st == TSYS_OK) st = s2; }
    tsys_status s1 = tsys_dist__fsdp_next_flush(f);
    if (st == TSYS_OK) st = s1;
    if (f->fce) { s1 = tsys_dist__fsdp_ce_land(f); if (st == TSYS_OK) st = s1; }
    int gathered = 0;
    for (int i = 0; i < f->nu; i++) {   // what is gathered for the next forward stays (the wait is the compute stream's); the rest goes
        tsys_dist__fsdp_unit *U = &f->u[i];
        if (U->next) { tsys_status s2 = tsys_dist__fsdp_gather_wait(f, i); if (st == TSYS_OK) st = s2; }
        else if (!f->fce) tsys_dist__fsdp_release(f, i);   // desc.ce_transfers: pushed in place, current as the stream goes on
        U->next = U->said = false;
        gathered += U->gathered;
        for (int k = 0; k < U->np; k++) if (U->p[k]->grad) { tsys_tensor_release(U->p[k]->grad); U->p[k]->grad = NULL; }
        if (!f->fce) tsys_storage_resize(f->ctx, U->gfull, 0);
    }
    f->rs_pending = -1;
    double t0 = tsys_time_us();
    for (int i = 0; i < f->nrep_work; i++) { tsys_status s2 = tsys_dist_wait(f->rep_work[i]); if (st == TSYS_OK) st = s2; }
    f->cur.wait_ms += (tsys_time_us() - t0) * 1e-3;
    f->nrep_work = 0;
    for (int i = 0; i < f->nu; i++) f->u[i].seen_fwd = f->u[i].seen_bwd = 0;
    f->ngathered = gathered;
    tsys_fsdp_stats keep = f->stats;
    f->stats = f->cur;
    f->stats.num_units = keep.num_units; f->stats.sharded_numel = keep.sharded_numel;
    f->stats.replicated_numel = keep.replicated_numel; f->stats.local_numel = keep.local_numel;
    memset(&f->cur, 0, sizeof(f->cur));
    if (st == TSYS_OK) st = f->err;
    f->err = TSYS_OK;
    return st;
}

// desc.ce_transfers' copy engines stopped, every peer's memory closed (collective: every rank frees its FSDP).
static void tsys_dist__fsdp_ce_close(tsys_fsdp *f) {
#ifdef TSYS_DIST_NCCL
    if (!f->fce) return;
    tsys_dist__fce_teardown(f->d, (tsys_dist__fce *)f->fce);
    free(f->fce);
    f->fce = NULL;
#else
    (void)f;
#endif
}

TSYSDEF void tsys_fsdp_free(tsys_fsdp *f) {
    if (!f) return;
    tsys_ctx *ctx = f->ctx;
    f->ib_opt = NULL;   // what is in flight settles without an optimizer step
    if (f->built) {   // unhook, settle what is in flight, give the parameters back whole in fp32
        tsys_trace_hooks now = tsys_ctx_set_trace_hooks(ctx, NULL);
        if (now.user == f) tsys_ctx_set_trace_hooks(ctx, &f->prev); else tsys_ctx_set_trace_hooks(ctx, &now);
        tsys_fsdp_finish(f);
        tsys_dist__fsdp_ce_close(f);   // before any unit's memory moves: the peers read and write it
        for (int i = 0; i < f->nu; i++) tsys_dist__fsdp_release(f, i);   // compute-dtype weights gathered for a next forward
        for (int i = 0; i < f->nrep; i++) tsys_tensor_remove_grad_hook(f->rep[i], tsys_dist__fsdp_rep_ready, f);
        f->cdt = TSYS_F32;
        for (int i = 0; i < f->nu; i++) {
            tsys_dist__fsdp_unit *U = &f->u[i];
            for (int k = 0; k < U->np; k++) tsys_tensor_remove_grad_hook(U->p[k], tsys_dist__fsdp_grad_ready, f);
            if (!U->full) continue;
            U->full->dtype = TSYS_F32;
            tsys_dist__fsdp_gather_wait(f, i);
            tsys_tensor *whole = U->gathered ? tsys_tensor_clone(ctx, U->full) : NULL;   // own storage, exactly the unit's size
            for (int k = 0; k < U->np; k++) {
                U->p[k]->dtype = TSYS_F32;
                if (whole) tsys_tensor_rebind(ctx, U->p[k], whole, (size_t)U->off[k] * 4);
            }
            tsys_tensor_release(whole);
            tsys_dist__fsdp_release(f, i);
        }
    }
    for (int i = 0; f->u && i < f->nu; i++) {
        tsys_dist__fsdp_unit *U = &f->u[i];
        for (int k = 0; k < U->np; k++) tsys_tensor_release(U->p[k]);
        tsys_tensor_release(U->part); tsys_tensor_release(U->full); tsys_tensor_release(U->gfull); tsys_tensor_release(U->master);
        TSYS_DIST__RELEASE(U->p); TSYS_DIST__RELEASE(U->off);
    }
    for (int i = 0; i < f->nrep; i++) tsys_tensor_release(f->rep[i]);
    for (int i = 0; i < f->nfrozen; i++) tsys_tensor_release(f->frozen[i]);
    if (f->updated.handle) tsys_event_release(ctx, &f->updated);
    TSYS_DIST__RELEASE(f->u); TSYS_DIST__RELEASE(f->rep); TSYS_DIST__RELEASE(f->frozen); TSYS_DIST__RELEASE(f->local);
    TSYS_DIST__RELEASE(f->rep_work);
    tsys_dist__fsdp_ce_close(f);   // a wrapper that failed before it was built
    tsys_tensor_release(f->terms); tsys_tensor_release(f->rep_arena);
    free(f->terms_at); free(f->moved); free(f->rep_off); free(f->pending); free(f->rep_moved); free(f->spans); free(f->said_list);
    TSYS_DIST__RELEASE(f);
}

// "layers.3.attn.q_proj.weight" -> "layers.3." (the unit key); other names are a unit of their own.
static size_t tsys_dist__fsdp_unit_key(const char *name) {
    if (strncmp(name, "layers.", 7) != 0) return 0;
    const char *q = name + 7;
    while (*q >= '0' && *q <= '9') q++;
    return (q > name + 7 && *q == '.') ? (size_t)(q + 1 - name) : 0;
}

// The arguments of tsys_fsdp_new, checked (the error set when not); *there: the context's trace hooks,
// which FSDP chains (one FSDP per context: its own hooks there are refused).
static bool tsys_dist__fsdp_args_ok(tsys_ctx *ctx, tsys_tensor **params, int n, const tsys_fsdp_desc *dd, tsys_trace_hooks *there) {
    if (dd->compute_dtype != TSYS_F32 && dd->compute_dtype != TSYS_BF16 && dd->compute_dtype != TSYS_F16) {
        tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: compute_dtype %s is not fp32, bf16 or fp16", tsys_dtype_name(dd->compute_dtype));
        return false;
    }
    if ((unsigned)dd->reshard_after_forward > (unsigned)TSYS_FSDP_RESHARD_NO) {
        tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: reshard_after_forward %d is not AUTO, YES or NO", (int)dd->reshard_after_forward);
        return false;
    }
    if (n < 1 || !params) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: %d parameters and %s list", n, params ? "a" : "no"); return false; }
    for (int i = 0; i < n; i++) {
        tsys_tensor *p = params[i];
        if (!p) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: parameter %d is NULL", i); return false; }
        if (p->dtype != TSYS_F32) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: parameter '%s' is %s; FSDP keeps fp32 masters and takes fp32 parameters", p->name, tsys_dtype_name(p->dtype)); return false; }
        if (p->grad_fn) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: '%s' is the result of an op, not a parameter", p->name); return false; }
        if (!tsys_dist__grads_fp32(ctx, "fsdp", p)) return false;
        for (int j = 0; j < i; j++)
            if (params[j] == p) { tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: '%s' appears twice (tied weights are not supported: each sharded weight is used once per forward)", p->name); return false; }
    }
    *there = tsys_ctx_set_trace_hooks(ctx, NULL);
    tsys_ctx_set_trace_hooks(ctx, there);
    if (there->op_begin == tsys_dist__fsdp_op_begin) {
        tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: the context already has an FSDP wrapper (one per context)");
        return false;
    }
    return true;
}

// The wrapper with its lists for n parameters (check tsys_dist__fsdp_lists_ok); NULL (the error set)
// when even the wrapper finds no memory.
static tsys_fsdp *tsys_dist__fsdp_alloc(tsys_dist *d, const tsys_fsdp_desc *dd, size_t cnt) {
    tsys_ctx *ctx = tsys_dist_ctx(d);
    tsys_fsdp *f = (tsys_fsdp *)TSYS_DIST__ALLOC(sizeof(tsys_fsdp));
    if (!f) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "fsdp: out of host memory"); return NULL; }
    memset(f, 0, sizeof(*f));
    f->d = d; f->ctx = ctx; f->cdt = dd->compute_dtype; f->prefetch = !dd->no_prefetch; f->rs_pending = -1; f->next_pending = -1;
    f->direct = tsys_dist_size(d) == 1 && !dd->no_shortcut;
    f->alias = f->direct && f->cdt == TSYS_F32;
    f->reshard = dd->reshard_after_forward == TSYS_FSDP_RESHARD_YES || (dd->reshard_after_forward == TSYS_FSDP_RESHARD_AUTO && tsys_dist_size(d) > 1);
    f->u = (tsys_dist__fsdp_unit *)TSYS_DIST__ALLOC(sizeof(tsys_dist__fsdp_unit) * cnt);
    f->rep = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);
    f->frozen = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);
    f->local = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);
    f->rep_work = (tsys_dist_work **)TSYS_DIST__ALLOC(sizeof(tsys_dist_work *) * cnt);
    if (f->u && f->rep && f->frozen && f->local && f->rep_work) memset(f->u, 0, sizeof(tsys_dist__fsdp_unit) * cnt);
    return f;
}
static bool tsys_dist__fsdp_lists_ok(const tsys_fsdp *f) { return f->u && f->rep && f->frozen && f->local && f->rep_work; }

// Units: the 2-D trainable parameters grouped by "layers.N.", in order of first appearance; the other
// trainable ones are replicated, the rest frozen.
static tsys_status tsys_dist__fsdp_make_units(tsys_fsdp *f, tsys_tensor **params, int n) {
    tsys_ctx *ctx = f->ctx;
    const size_t cnt = (size_t)n;
    for (int i = 0; i < n; i++) {
        tsys_tensor *p = params[i];
        if (!p->requires_grad) { f->frozen[f->nfrozen++] = tsys_tensor_retain(p); continue; }
        if (p->ndim != 2) { f->rep[f->nrep++] = tsys_tensor_retain(p); continue; }
        size_t key = tsys_dist__fsdp_unit_key(p->name);
        int ui = -1;
        for (int j = 0; key && j < f->nu && ui < 0; j++)
            if (f->u[j].np && !strncmp(f->u[j].p[0]->name, p->name, key) && tsys_dist__fsdp_unit_key(f->u[j].p[0]->name) == key) ui = j;
        if (ui >= 0 && ui != f->nu - 1) {
            return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: '%s' comes after another unit began; a block's parameters must be consecutive (units follow the forward order)", p->name);
        }
        if (ui < 0) {
            ui = f->nu++;
            f->u[ui].p = (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * cnt);
            f->u[ui].off = (int64_t *)TSYS_DIST__ALLOC(sizeof(int64_t) * cnt);
            if (!f->u[ui].p || !f->u[ui].off) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "fsdp: out of host memory");
            if (key) snprintf(f->u[ui].name, sizeof(f->u[ui].name), "%.*s", (int)(key - 1), p->name);
            else memcpy(f->u[ui].name, p->name, sizeof(f->u[ui].name));
        }
        tsys_dist__fsdp_unit *U = &f->u[ui];
        U->off[U->np] = U->numel;
        U->p[U->np++] = tsys_tensor_retain(p);
        U->numel += tsys_tensor_numel(p);
    }
    if (f->nu == 0) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "fsdp: no 2-D trainable parameter (Linear or Embedding weight) to shard");
    return TSYS_OK;
}

// One unit: its fp32 master (this rank's shard of the padded flat), the full weights and gradient in
// the compute dtype (no memory until gathered), and its parameters rebound as windows of the full
// weights. The parameters' old storage and gradients go to old[] (the caller frees them).
static tsys_status tsys_dist__fsdp_shard_unit(tsys_fsdp *f, tsys_dist__fsdp_unit *U, tsys_tensor **old, int *nold) {
    tsys_ctx *ctx = f->ctx;
    const int world = tsys_dist_size(f->d), rank = tsys_dist_rank(f->d);
    const size_t es = tsys_dtype_size(f->cdt);
    int64_t one = 1;
    U->shard = (U->numel + world - 1) / world;
    f->built = true;
    int64_t padded = world * U->shard;
    tsys_mem_set_category(ctx, TSYS_MEM_PARAMETERS);
    tsys_tensor *whole = tsys_tensor_new(ctx, TSYS_F32, U->p[0]->device, 1, &padded);   // fp32 flat of the unit
    U->master = whole ? tsys_tensor_new(ctx, TSYS_F32, whole->device, 1, &U->shard) : NULL;
    // fp32 in a group of one: the weights are the master (one rank, no padding), viewed
    U->full = !U->master ? NULL : f->alias ? tsys_tensor_view_raw(ctx, U->master, 0, TSYS_F32, 1, &padded) : tsys_tensor_new(ctx, f->cdt, whole->device, 1, &padded);
    tsys_mem_set_category(ctx, TSYS_MEM_GRADIENTS);
    U->gfull = U->full ? tsys_tensor_new(ctx, f->cdt, whole->device, 1, &padded) : NULL;
    if (U->master) U->master->grad = tsys_tensor_new(ctx, TSYS_F32, whole->device, 1, &U->shard);
    if (!U->gfull || !U->master->grad) { tsys_tensor_release(whole); return tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM; }
    tsys_tensor_set_name(U->master, "%s.shard", U->name);
    tsys_tensor_set_name(U->master->grad, "%s.shard.grad", U->name);
    tsys_tensor_set_name(U->full, "%s.full", U->name);
    tsys_tensor_set_name(U->gfull, "%s.full.grad", U->name);
    U->master->requires_grad = true;
    U->master->grad_zero = true;
    tsys_status st = tsys_tensor_fill(ctx, whole, 0.0f);
    for (int k = 0; st == TSYS_OK && k < U->np; k++) {
        tsys_tensor *dst = tsys_tensor_view_raw(ctx, whole, (size_t)U->off[k] * 4, TSYS_F32, U->p[k]->ndim, U->p[k]->shape);
        st = dst ? tsys_tensor_copy_from(ctx, dst, U->p[k]) : tsys_ctx_status(ctx);
        tsys_tensor_release(dst);
    }
    tsys_tensor *mine = st == TSYS_OK ? tsys_tensor_view_raw(ctx, whole, (size_t)(rank * U->shard) * 4, TSYS_F32, 1, &U->shard) : NULL;
    if (st == TSYS_OK) st = mine ? tsys_tensor_copy_from(ctx, U->master, mine) : tsys_ctx_status(ctx);
    tsys_tensor_release(mine);
    tsys_tensor_release(whole);
    // the parameters become windows of `full` in the compute dtype; their old storage and gradient go
    for (int k = 0; st == TSYS_OK && k < U->np; k++) {
        tsys_tensor *p = U->p[k];
        old[(*nold)++] = tsys_tensor_view_raw(ctx, p, 0, p->dtype, 1, &one);   // keeps the old storage to free it below
        if (p->grad) { old[(*nold)++] = tsys_tensor_retain(p->grad); tsys_tensor_release(p->grad); p->grad = NULL; }
        p->dtype = f->cdt;
        st = tsys_tensor_rebind(ctx, p, U->full, (size_t)U->off[k] * es);
        if (st == TSYS_OK) st = tsys_tensor_add_grad_hook(p, tsys_dist__fsdp_grad_ready, f);
    }
    if (st == TSYS_OK && !f->alias) st = tsys_storage_resize(ctx, U->full, 0);
    if (st == TSYS_OK) st = tsys_storage_resize(ctx, U->gfull, 0);
    f->local[f->nlocal++] = U->master;
    f->stats.sharded_numel += U->numel;
    f->stats.local_numel += U->shard;
    return st;
}
static tsys_status tsys_dist__fsdp_shard_units(tsys_fsdp *f, tsys_tensor **old, int *nold) {
    tsys_ctx *ctx = f->ctx;
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "parameters"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_PARAMETERS);
    tsys_status st = TSYS_OK;
    for (int i = 0; st == TSYS_OK && i < f->nu; i++) st = tsys_dist__fsdp_shard_unit(f, &f->u[i], old, nold);
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    return st;
}

// The replicated and frozen parameters leave the model's arena for storage of their own; their old
// homes go to old[].
static tsys_status tsys_dist__fsdp_move_rest(tsys_fsdp *f, tsys_tensor **old, int *nold) {
    tsys_ctx *ctx = f->ctx;
    int64_t one = 1;
    // replicated: their own storage (out of the model's arena), gradients all-reduced from their hooks
    tsys_status st = TSYS_OK;
    for (int i = 0; st == TSYS_OK && i < f->nrep; i++) {
        tsys_tensor *p = f->rep[i];
        tsys_tensor *own = tsys_tensor_clone(ctx, p);
        old[(*nold)++] = tsys_tensor_view_raw(ctx, p, 0, p->dtype, 1, &one);
        if (p->grad) { old[(*nold)++] = tsys_tensor_retain(p->grad); tsys_tensor_release(p->grad); p->grad = NULL; }
        st = own ? tsys_tensor_rebind(ctx, p, own, 0) : tsys_ctx_status(ctx);
        tsys_tensor_release(own);
        if (st == TSYS_OK) st = tsys_tensor_add_grad_hook(p, tsys_dist__fsdp_rep_ready, f);
        f->local[f->nlocal++] = p;
        f->stats.replicated_numel += tsys_tensor_numel(p);
        f->stats.local_numel += tsys_tensor_numel(p);
    }
    for (int i = 0; st == TSYS_OK && i < f->nfrozen; i++) {   // frozen ones move out of the arena too
        tsys_tensor *p = f->frozen[i];
        tsys_tensor *own = tsys_tensor_clone(ctx, p);
        old[(*nold)++] = tsys_tensor_view_raw(ctx, p, 0, p->dtype, 1, &one);
        st = own ? tsys_tensor_rebind(ctx, p, own, 0) : tsys_ctx_status(ctx);
        tsys_tensor_release(own);
    }
    return st;
}

// Every rank built the same layout (units, their sizes, the compute dtype, the replicated sizes)?
static tsys_status tsys_dist__fsdp_agree(tsys_fsdp *f) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < f->nu; i++) h = tsys_dist__hash(tsys_dist__hash(tsys_dist__hash(h, f->u[i].numel), f->u[i].np), f->cdt);
    for (int i = 0; i < f->nrep; i++) h = tsys_dist__hash(h, tsys_tensor_numel(f->rep[i]));
    const tsys_status st = tsys_dist__agree_layout(f->d, h, "fsdp");
    f->agreed = st == TSYS_OK;
    return st;
}

// FSDP follows forward and backward through the trace hooks, chained after the ones installed before.
static void tsys_dist__fsdp_hook_in(tsys_fsdp *f) {
    tsys_trace_hooks mine;
    memset(&mine, 0, sizeof(mine));
    mine.op_begin = tsys_dist__fsdp_op_begin; mine.op_end = tsys_dist__fsdp_op_end; mine.kernel = tsys_dist__fsdp_kernel;
    mine.kernel_begin = tsys_dist__fsdp_kernel_begin; mine.mem = tsys_dist__fsdp_mem; mine.user = f;
    f->prev = tsys_ctx_set_trace_hooks(f->ctx, &mine);
}

// desc.ce_transfers: every unit's weights and full gradients made once, where they stay (the peers open them), my
// shard's gradient a window of my part of the full ones (AdamW adds the peers' parts, pulled into my receive buffer,
// as it reads it: tsys_optim_sum_grads_at in tsys_fsdp_optim_in_backward). Collective.
static tsys_status tsys_dist__fsdp_ce_open(tsys_fsdp *f) {
    tsys_ctx *ctx = f->ctx;
    const int world = tsys_dist_size(f->d), rank = tsys_dist_rank(f->d);
    const char *no = world < 2 ? "a group of one moves nothing (it takes 2 or more ranks)"
                     : f->reshard ? "it keeps every unit's weights from step to step: reshard_after_forward must be TSYS_FSDP_RESHARD_NO"
                     : f->nu == 0 ? "there is no unit (no 2-D trainable parameter)"
                     : f->u[0].master->device != TSYS_CUDA || tsys_dist_engine_of(f->d) != TSYS_DIST_ENGINE_NCCL ? "it needs CUDA tensors and NCCL ranks" : NULL;
    if (no) return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "fsdp: desc.ce_transfers: %s", no);
#ifdef TSYS_DIST_NCCL
    const size_t es = tsys_dist__fsdp_es(f);
    f->terms_at = (int64_t *)calloc((size_t)f->nlocal + 1, sizeof(int64_t));
    f->moved = (bool *)calloc((size_t)f->nu + 1, sizeof(bool));
    void **w = (void **)calloc((size_t)f->nu, sizeof(void *)), **gr = (void **)calloc((size_t)f->nu, sizeof(void *));
    tsys_dist__fce *g = (tsys_dist__fce *)calloc(1, sizeof *g);
    tsys_status st = f->terms_at && f->moved && w && gr && g ? TSYS_OK : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "fsdp: desc.ce_transfers: out of host memory");
    int64_t total = 0;
    for (int i = f->nu; st == TSYS_OK && i < f->nlocal; i++) f->terms_at[i] = -1;   // (the replicated: set below)
    for (int i = 0; st == TSYS_OK && i < f->nu; i++) {
        tsys_dist__fsdp_unit *U = &f->u[i];
        const size_t bytes = (size_t)(world * U->shard) * es;
        int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "fsdp gathered weights"));
        st = tsys_storage_resize(ctx, U->full, bytes);
        tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "fsdp full grads"));
        tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_GRADIENTS);
        if (st == TSYS_OK) st = tsys_storage_resize(ctx, U->gfull, bytes);
        tsys_mem_set_category(ctx, cat);
        tsys_mem_set_tag(ctx, tag);
        if (st == TSYS_OK && world * U->shard > U->numel) {   // the padding is pulled too: zeros, as nothing writes it
            int64_t pad = world * U->shard - U->numel;
            tsys_tensor *tail = tsys_tensor_view_raw(ctx, U->gfull, (size_t)U->numel * es, f->cdt, 1, &pad);
            st = tail ? tsys_tensor_fill(ctx, tail, 0.0f) : tsys_ctx_status(ctx);
            tsys_tensor_release(tail);
        }
        if (st != TSYS_OK) break;
        tsys_tensor_release(U->master->grad);
        U->master->grad = NULL;
        st = tsys_tensor_set_grad_dtype(ctx, U->master, f->cdt);
        U->master->grad = st == TSYS_OK ? tsys_tensor_view_raw(ctx, U->gfull, (size_t)(rank * U->shard) * es, f->cdt, 1, &U->shard) : NULL;
        U->part = U->master->grad ? tsys_tensor_view_raw(ctx, U->full, (size_t)(rank * U->shard) * es, f->cdt, 1, &U->shard) : NULL;
        if (!U->part) { st = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM; break; }
        tsys_tensor_set_name(U->master->grad, "%s.shard.grad", U->name);
        tsys_tensor_set_name(U->part, "%s.full.part", U->name);
        U->master->grad_zero = true;
        f->terms_at[i] = total * (int64_t)es;
        total += U->shard;
        w[i] = tsys_tensor_data(U->full); gr[i] = tsys_tensor_data(U->gfull);
    }
    // the replicated gradients: one block, each 16 bytes aligned, after the units' parts in a slot
    f->rep_at = (total * (int64_t)es + 15) / 16 * 16;
    f->rep_off = (int64_t *)calloc((size_t)f->nrep + 1, sizeof(int64_t));
    f->pending = (int *)calloc((size_t)f->nrep + 1, sizeof(int));
    f->rep_moved = (bool *)calloc((size_t)f->nrep + 1, sizeof(bool));
    f->spans = calloc((size_t)f->nrep + 1, sizeof(tsys_dist__fce_span));
    f->said_list = (tsys_tensor **)calloc((size_t)f->nrep + 2, sizeof(tsys_tensor *));
    if (st == TSYS_OK && (!f->rep_off || !f->pending || !f->rep_moved || !f->spans || !f->said_list)) st = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "fsdp: desc.ce_transfers: out of host memory");
    int64_t rep_bytes = 0;
    for (int j = 0; st == TSYS_OK && j < f->nrep; j++) { f->rep_off[j] = rep_bytes; rep_bytes += ((int64_t)tsys_tensor_numel(f->rep[j]) * 4 + 15) / 16 * 16; }
    int64_t rep_numel = rep_bytes / 4;
    if (st == TSYS_OK && rep_numel > 0) {
        int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "fsdp replicated grads"));
        tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_GRADIENTS);
        f->rep_arena = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &rep_numel);
        tsys_mem_set_category(ctx, cat);
        tsys_mem_set_tag(ctx, tag);
        st = f->rep_arena ? tsys_tensor_fill(ctx, f->rep_arena, 0.0f) : tsys_ctx_status(ctx);
    }
    for (int j = 0; st == TSYS_OK && j < f->nrep; j++) {   // each gradient a window of the block (made once: backward writes into it)
        tsys_tensor *p = f->rep[j];
        tsys_tensor_release(p->grad);
        p->grad = tsys_tensor_view_raw(ctx, f->rep_arena, (size_t)f->rep_off[j], TSYS_F32, p->ndim, p->shape);
        if (!p->grad) { st = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM; break; }
        tsys_tensor_set_name(p->grad, "%s.grad", p->name);
        p->grad_zero = true;
        f->terms_at[f->nu + j] = f->rep_at + f->rep_off[j];
    }
    f->slot_bytes = f->rep_at + rep_bytes;
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    if (st == TSYS_OK) st = tsys_sync(ctx, TSYS_CUDA);   // the tails' zeros are in before any peer pulls them
    if (tsys_dist_any_failed(f->d, st)) {   // every rank sets up the transfers, or none
        free(w); free(gr); free(g);
        return st != TSYS_OK ? st : tsys_ctx_set_error(ctx, TSYS_ERR_IO, "fsdp: desc.ce_transfers: the setup failed on another rank");
    }
    f->fce = g;
    tsys_dist__drain(f->d);   // the setup's host collectives run here, after what the worker holds
    const bool ok = tsys_dist__fce_setup(f->d, g, f->nu, w, gr, f->rep_arena ? tsys_tensor_data(f->rep_arena) : NULL, (int64_t)(world - 1) * f->slot_bytes, &e);
    free(w); free(gr);
    st = ok ? TSYS_OK : tsys_ctx_set_error(ctx, e.status != TSYS_OK ? e.status : TSYS_ERR_CUDA, "%s", e.msg);
    if (tsys_dist_any_failed(f->d, st)) return st != TSYS_OK ? st : tsys_ctx_set_error(ctx, TSYS_ERR_IO, "fsdp: desc.ce_transfers: the setup failed on another rank");
    int64_t numel = (int64_t)(world - 1) * f->slot_bytes / 4;   // slots of 16-byte multiples
    int tag = tsys_mem_set_tag(ctx, tsys_mem_tag(ctx, "fsdp peers' gradients"));
    tsys_mem_category cat = tsys_mem_set_category(ctx, TSYS_MEM_GRADIENTS);
    f->terms = tsys_tensor_wrap(ctx, TSYS_F32, TSYS_CUDA, 1, &numel, g->recv, NULL, NULL);
    tsys_mem_set_category(ctx, cat);
    tsys_mem_set_tag(ctx, tag);
    if (!f->terms) return tsys_ctx_status(ctx);
    tsys_tensor_set_name(f->terms, "fsdp peers' gradients");
    return TSYS_OK;
#else
    (void)rank;
    return tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "fsdp: desc.ce_transfers: built without NCCL (TSYS_DIST_NCCL)");
#endif
}

TSYSDEF tsys_fsdp *tsys_fsdp_new(tsys_dist *d, tsys_tensor **params, int n, const tsys_fsdp_desc *desc) {
    if (!d) return NULL;
    tsys_ctx *ctx = tsys_dist_ctx(d);
    if (tsys_ctx_status(ctx) != TSYS_OK) return NULL;
    tsys_fsdp_desc dd;
    memset(&dd, 0, sizeof(dd));
    if (desc) dd = *desc;
    tsys_trace_hooks there;
    if (!tsys_dist__fsdp_args_ok(ctx, params, n, &dd, &there)) return NULL;
    tsys_fsdp *f = tsys_dist__fsdp_alloc(d, &dd, (size_t)n);
    if (!f) return NULL;
    // rank 0's weights everywhere, trainable or not (as DDP)
    tsys_status st = tsys_dist__fsdp_lists_ok(f) ? tsys_dist__broadcast_list(d, params, n, 0) : TSYS_ERR_OOM;
    if (st == TSYS_OK) st = tsys_dist__fsdp_make_units(f, params, n);
    // the old homes of the parameters and their gradients (the model's arenas): freed at the end
    tsys_tensor **old = st == TSYS_OK ? (tsys_tensor **)TSYS_DIST__ALLOC(sizeof(tsys_tensor *) * 2 * (size_t)n) : NULL;
    int nold = 0;
    if (st == TSYS_OK && !old) st = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "fsdp: out of host memory");
    if (st == TSYS_OK) st = tsys_dist__fsdp_shard_units(f, old, &nold);
    if (st == TSYS_OK) st = tsys_dist__fsdp_move_rest(f, old, &nold);
    // the model's arenas now hold nothing anyone uses (the parameters were all moved): their memory goes
    for (int i = 0; i < nold; i++) {
        if (old[i] && st == TSYS_OK) tsys_storage_resize(ctx, old[i], 0);
        tsys_tensor_release(old[i]);
    }
    TSYS_DIST__RELEASE(old);
    f->stats.num_units = f->nu;
    if (st == TSYS_OK) st = tsys_dist__fsdp_agree(f);
    if (st == TSYS_OK && dd.ce_transfers) st = tsys_dist__fsdp_ce_open(f);
    if (st != TSYS_OK || tsys_ctx_status(ctx) != TSYS_OK) {
        f->prev = there;
        tsys_fsdp_free(f);   // gives back what moved where it can (the parameters may be left unusable)
        return NULL;
    }
    tsys_dist__fsdp_hook_in(f);
    return f;
}

TSYSDEF tsys_tensor **tsys_fsdp_params(tsys_fsdp *f) { return f ? f->local : NULL; }
TSYSDEF int tsys_fsdp_num_params(const tsys_fsdp *f) { return f ? f->nlocal : 0; }
TSYSDEF bool tsys_fsdp_param_is_shard(const tsys_fsdp *f, int i) { return f && i >= 0 && i < f->nu; }
TSYSDEF tsys_fsdp_stats tsys_fsdp_stats_get(const tsys_fsdp *f) {
    tsys_fsdp_stats s;
    memset(&s, 0, sizeof(s));
    return f ? f->stats : s;
}

TSYSDEF tsys_status tsys_fsdp_optim_in_backward(tsys_fsdp *f, tsys_optim *opt) {
    if (!f) return TSYS_ERR_INVALID_ARGS;
    if (f->fce && !opt)
        return tsys_ctx_set_error(f->ctx, TSYS_ERR_INVALID_ARGS, "tsys_fsdp_optim_in_backward: desc.ce_transfers updates each shard inside backward: the optimizer stays");
    // desc.ce_transfers: AdamW adds the peers' parts of each shard's gradient, in my receive buffer, as it reads it, and
    // writes each shard's copy in the compute dtype into my part of the unit's weights, which the copy engines send
    if (f->fce && f->cdt != TSYS_F32) {
        tsys_tensor **parts = (tsys_tensor **)calloc((size_t)f->nlocal + 1, sizeof(tsys_tensor *));
        if (!parts) return tsys_ctx_set_error(f->ctx, TSYS_ERR_OOM, "tsys_fsdp_optim_in_backward: out of host memory");
        for (int i = 0; i < f->nu; i++) parts[i] = f->u[i].part;
        const tsys_status st = tsys_optim_keep_lowp_into(opt, parts);
        free(parts);
        if (st != TSYS_OK) return st;
    }
    if (f->fce && tsys_optim_sum_grads_at(opt, f->terms, tsys_dist_size(f->d), tsys_dist_rank(f->d), f->slot_bytes, f->terms_at) != TSYS_OK) return tsys_ctx_status(f->ctx);
    f->ib_opt = opt;
    return TSYS_OK;
}

// desc.ce_transfers: a step's pulls and pushes back to back, between steps (tsys_dist__fce_probe).
static tsys_status tsys_dist__fsdp_ce_probe(tsys_fsdp *f) {
#ifdef TSYS_DIST_NCCL
    const int64_t es = (int64_t)tsys_dist__fsdp_es(f), rank = tsys_dist_rank(f->d);
    int64_t *part = (int64_t *)calloc((size_t)f->nu, sizeof(int64_t)), *bytes = (int64_t *)calloc((size_t)f->nu, sizeof(int64_t));
    tsys_dist__err e;
    memset(&e, 0, sizeof e);
    bool ok = part && bytes;
    for (int i = 0; ok && i < f->nu; i++) { part[i] = rank * f->u[i].shard * es; bytes[i] = f->u[i].shard * es; }
    const tsys_dist__fce_span reps = {0, f->rep_at, f->slot_bytes - f->rep_at};
    ok = ok ? tsys_dist__fce_probe(f->d, (tsys_dist__fce *)f->fce, part, bytes, f->terms_at, reps, f->slot_bytes, &e) : tsys_dist__seterr(&e, TSYS_ERR_OOM, "fsdp: out of host memory");
    free(part); free(bytes);
    return ok ? TSYS_OK : tsys_ctx_set_error(f->ctx, e.status != TSYS_OK ? e.status : TSYS_ERR_CUDA, "%s", e.msg);
#else
    return tsys_ctx_set_error(f->ctx, TSYS_ERR_UNSUPPORTED, "fsdp: desc.ce_transfers: built without NCCL");
#endif
}

TSYSDEF tsys_status tsys_fsdp_time_collectives(tsys_fsdp *f, double *ms) {
    if (!f || !ms) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = f->ctx;
    tsys_device dev = f->u[0].master->device;
    *ms = 0;
    tsys_optim *ib = f->ib_opt;   // no optimizer step here: nothing to tell it
    f->ib_opt = NULL;
    tsys_status st = tsys_fsdp_finish(f);
    if (st == TSYS_OK) st = tsys_sync(ctx, dev);
    if (st == TSYS_OK) st = tsys_dist_barrier(f->d);
    double t0 = tsys_time_us();
    int world = tsys_dist_size(f->d);
    if (f->fce) st = tsys_dist__fsdp_ce_probe(f);   // the pulls and pushes of a step, instead of the collectives below
    for (int pass = 0; st == TSYS_OK && !f->fce && pass < 2; pass++)   // forward: every unit; backward: those it re-gathers
        for (int j = 0; st == TSYS_OK && j < f->nu; j++) {
            int i = pass ? f->nu - 1 - j : j;
            if (pass && (i == f->nu - 1 || !f->u[i].has_linear || !f->reshard)) continue;
            st = tsys_dist__fsdp_gather_wait(f, i);
            tsys_dist__fsdp_release(f, i);
        }
    for (int i = f->nu - 1; st == TSYS_OK && !f->fce && i >= 0; i--) {
        tsys_dist__fsdp_unit *U = &f->u[i];
        st = tsys_storage_resize(ctx, U->gfull, (size_t)(world * U->shard) * tsys_dist__fsdp_es(f));
        tsys_tensor *scratch = st == TSYS_OK ? tsys_tensor_new(ctx, f->cdt, dev, 1, &U->shard) : NULL;
        if (st == TSYS_OK) st = scratch ? tsys_dist_reduce_scatter(f->d, scratch, U->gfull, TSYS_DIST_AVG) : tsys_ctx_status(ctx);
        tsys_tensor_release(scratch);
        tsys_storage_resize(ctx, U->gfull, 0);
    }
    for (int i = 0; st == TSYS_OK && i < f->nrep; i++) {
        tsys_tensor *c = tsys_tensor_clone(ctx, f->rep[i]);
        st = c ? tsys_dist_all_reduce(f->d, c, TSYS_DIST_AVG) : tsys_ctx_status(ctx);
        tsys_tensor_release(c);
    }
    if (st == TSYS_OK) st = tsys_sync(ctx, dev);
    *ms = (tsys_time_us() - t0) * 1e-3;
    memset(&f->cur, 0, sizeof(f->cur));
    f->ngathered = 0;
    f->ib_opt = ib;
    return st;
}

TSYSDEF tsys_status tsys_fsdp_gather_full_params(tsys_fsdp *f, tsys_tensor ***out, int *n) {
    if (!f || !out || !n) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = f->ctx;
    *out = NULL; *n = 0;
    int total = f->nrep + f->nfrozen;
    for (int i = 0; i < f->nu; i++) total += f->u[i].np;
    tsys_tensor **list = (tsys_tensor **)TSYS_MALLOC(sizeof(tsys_tensor *) * (size_t)(total ? total : 1));
    if (!list) return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "fsdp: out of host memory");
    int world = tsys_dist_size(f->d), m = 0;
    tsys_status st = TSYS_OK;
    for (int i = 0; st == TSYS_OK && i < f->nu; i++) {   // fp32: the masters themselves, not their compute-dtype copies
        tsys_dist__fsdp_unit *U = &f->u[i];
        int64_t padded = world * U->shard;
        tsys_tensor *whole = tsys_tensor_new(ctx, TSYS_F32, U->master->device, 1, &padded);
        st = whole ? tsys_dist_all_gather(f->d, whole, U->master) : tsys_ctx_status(ctx);
        for (int k = 0; st == TSYS_OK && k < U->np; k++) {
            tsys_tensor *v = tsys_tensor_view_raw(ctx, whole, (size_t)U->off[k] * 4, TSYS_F32, U->p[k]->ndim, U->p[k]->shape);
            tsys_tensor *c = v ? tsys_tensor_clone(ctx, v) : NULL;
            tsys_tensor_release(v);
            if (!c) { st = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM; break; }
            tsys_tensor_set_name(c, "%s", U->p[k]->name);
            list[m++] = c;
        }
        tsys_tensor_release(whole);
    }
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; st == TSYS_OK && i < (pass ? f->nfrozen : f->nrep); i++) {
            tsys_tensor *p = pass ? f->frozen[i] : f->rep[i];
            tsys_tensor *c = tsys_tensor_clone(ctx, p);
            if (!c) { st = tsys_ctx_status(ctx) != TSYS_OK ? tsys_ctx_status(ctx) : TSYS_ERR_OOM; break; }
            tsys_tensor_set_name(c, "%s", p->name);
            list[m++] = c;
        }
    if (st != TSYS_OK) {
        for (int i = 0; i < m; i++) tsys_tensor_release(list[i]);
        TSYS_FREE(list);
        return st;
    }
    *out = list; *n = m;
    return TSYS_OK;
}

// >>tp --------------------------------------------------------------------------------------------
// Tensor parallelism of the cs336 model, as Megatron-LM splits it. Per block: q, k, v and w1, w3 are
// column-parallel (this rank's heads and d_ff slice: rows of the weights), the output projection and w2
// row-parallel (the matching columns); the block's input enters through `copy` (identity forward, the
// gradient all-reduced in backward: each rank's heads add a part) and each branch leaves through `reduce`
// (its partial sums all-reduced in forward, the gradient passed through): one all-reduce per branch each
// way. The LM head is vocabulary-parallel (rows of this rank's vocabulary slice) and its cross-entropy
// combines the ranks' row maxima, exp-sums and target logits (all-reduces of E and 2E numbers), so
// the full logits never exist anywhere. The embedding is vocabulary-parallel too (below). The norms are
// replicated: their gradients are the same on every rank (each sees the full activations after the
// all-reduces), so the same AdamW step keeps them equal.

struct tsys_tp_model {
    tsys_ctx *ctx;
    tsys_dist *tp;
    tsys_model_desc desc;
    tsys_device device;
    int64_t heads, dff, vocab, vocab_lo;     // this rank's share
    tsys_tensor **params;                    // parameters() order of the full model, each this rank's part
    int n;
    tsys_custom_op copy_op, reduce_op, ce_op, mask_op, gather_op, scatter_op;
    bool sequence_parallel;                  // tsys_tp_model_set_sequence_parallel
};

// ---- the collectives as autograd ops ----

static tsys_tensor *tsys_tp__alias(tsys_ctx *ctx, tsys_tensor *x) { return tsys_tensor_view_raw(ctx, x, 0, x->dtype, x->ndim, x->shape); }

// x summed over tp in place, as a new tensor on x's storage. In place is safe for both ops: `reduce` sums a
// row-parallel linear's output, which nothing else reads (a linear's backward needs its inputs only), and
// `copy` the gradient its node owns and gives away.
static tsys_tensor *tsys_tp__summed(tsys_ctx *ctx, tsys_dist *tp, tsys_tensor *x) {
    return tsys_dist_all_reduce(tp, x, TSYS_DIST_SUM) == TSYS_OK ? tsys_tp__alias(ctx, x) : NULL;
}
static tsys_tensor *tsys_tp__copy_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) {
    (void)n; (void)saved; (void)user;
    return tsys_tp__alias(ctx, ins[0]);
}
static tsys_status tsys_tp__copy_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)ins; (void)n; (void)saved;
    if (needs[0]) grads[0] = tsys_tp__summed(ctx, (tsys_dist *)user, g);
    return needs[0] && !grads[0] ? tsys_ctx_status(ctx) : TSYS_OK;
}
static tsys_tensor *tsys_tp__reduce_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) {
    (void)n; (void)saved;
    return tsys_tp__summed(ctx, (tsys_dist *)user, ins[0]);
}
static tsys_status tsys_tp__reduce_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)ins; (void)n; (void)saved; (void)user;
    if (needs[0]) grads[0] = tsys_tp__alias(ctx, g);
    return TSYS_OK;
}

// ---- sequence parallelism ----
// With it the residual stream between the tensor-parallel regions is split by rows (the batch's tokens in
// order: rank r holds rows [r E / tp, (r + 1) E / tp)), so the norms and the residual adds run on 1/tp of the
// tokens and keep 1/tp of their activations. Entering a region the rows are all-gathered (`gather`: its
// backward reduce-scatters the gradient); leaving it the partial sums are reduce-scattered (`scatter`: its
// backward all-gathers the gradient): the bytes of the all-reduces they replace, in two halves.

// (R, d) rows of every rank -> (R x tp, d), rank order.
static tsys_tensor *tsys_tp__all_rows(tsys_ctx *ctx, tsys_dist *tp, tsys_tensor *x) {
    const int64_t d = x->shape[x->ndim - 1], shape[2] = { tsys_tensor_numel(x) / d * tsys_dist_size(tp), d };
    tsys_tensor *y = tsys_tensor_new(ctx, x->dtype, x->device, 2, shape);
    if (y && tsys_dist_all_gather(tp, y, x) != TSYS_OK) { tsys_tensor_release(y); y = NULL; }
    return y;
}
// (R, d) partial sums -> this rank's (R / tp, d) rows of their sum over tp.
static tsys_tensor *tsys_tp__my_rows(tsys_ctx *ctx, tsys_dist *tp, tsys_tensor *x) {
    const int64_t d = x->shape[x->ndim - 1], shape[2] = { tsys_tensor_numel(x) / d / tsys_dist_size(tp), d };
    tsys_tensor *y = tsys_tensor_new(ctx, x->dtype, x->device, 2, shape);
    if (y && tsys_dist_reduce_scatter(tp, y, x, TSYS_DIST_SUM) != TSYS_OK) { tsys_tensor_release(y); y = NULL; }
    return y;
}
static tsys_tensor *tsys_tp__gather_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) {
    (void)n; (void)saved;
    return tsys_tp__all_rows(ctx, (tsys_dist *)user, ins[0]);
}
static tsys_status tsys_tp__gather_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)ins; (void)n; (void)saved;
    if (needs[0] && !(grads[0] = tsys_tp__my_rows(ctx, (tsys_dist *)user, g))) return tsys_ctx_status(ctx);
    return TSYS_OK;
}
static tsys_tensor *tsys_tp__scatter_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) {
    (void)n; (void)saved;
    return tsys_tp__my_rows(ctx, (tsys_dist *)user, ins[0]);
}
static tsys_status tsys_tp__scatter_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)ins; (void)n; (void)saved;
    if (needs[0] && !(grads[0] = tsys_tp__all_rows(ctx, (tsys_dist *)user, g))) return tsys_ctx_status(ctx);
    return TSYS_OK;
}

// ---- the vocabulary-parallel cross-entropy ----
// Mean over rows of log(sum over the whole vocabulary of exp(logit)) - logit[target]. Every rank holds the
// logits of its vocabulary slice; the three per-row quantities are all-reduced over tp (host tensors: on
// the CPU in double; CUDA tensors: kernels and NCCL, below). Saves the rows' log-sum-exp for backward:
// d logit = (softmax - onehot) / rows.

static int64_t tsys_tp__target(const void *t, tsys_dtype dt, int64_t i) { return dt == TSYS_I64 ? ((const int64_t *)t)[i] : ((const int32_t *)t)[i]; }

// The rows' log-sum-exp over the whole vocabulary (lse) and the mean loss, from this rank's logits l (E x V).
static bool tsys_tp__ce_rows(tsys_tp_model *m, const float *l, const void *tg, tsys_dtype tdt, int64_t E, int64_t V, float *lse, double *loss) {
    double *mx = (double *)calloc((size_t)(3 * E + 1), sizeof(double)), *st = mx + E;   // maxima, then exp-sums and target logits
    if (!mx) { tsys_ctx_set_error(m->ctx, TSYS_ERR_OOM, "tp cross_entropy: out of host memory"); return false; }
    for (int64_t e = 0; e < E; e++) {
        double best = -INFINITY;
        for (int64_t v = 0; v < V; v++) best = l[e * V + v] > best ? l[e * V + v] : best;
        mx[e] = best;
    }
    bool ok = tsys_dist_all_reduce_host(m->tp, mx, (int)E, TSYS_DIST_MAX) == TSYS_OK;
    for (int64_t e = 0; ok && e < E; e++) {
        double s = 0;
        for (int64_t v = 0; v < V; v++) s += exp((double)l[e * V + v] - mx[e]);
        const int64_t t = tsys_tp__target(tg, tdt, e) - m->vocab_lo;
        st[e] = s;
        st[E + e] = t >= 0 && t < V ? (double)l[e * V + t] : 0.0;
    }
    ok = ok && tsys_dist_all_reduce_host(m->tp, st, (int)(2 * E), TSYS_DIST_SUM) == TSYS_OK;
    double total = 0;
    for (int64_t e = 0; ok && e < E; e++) {
        const double row_lse = mx[e] + log(st[e]);
        lse[e] = (float)row_lse;
        total += row_lse - st[E + e];
    }
    *loss = total / (double)E;
    free(mx);
    return ok;
}

#ifdef TSYS_DIST_NCCL
// ---- the same on the GPU: a block a row, the logits read in their dtype, sums in fp32 ----
static __device__ float tsys_tp__f(float x) { return x; }
static __device__ float tsys_tp__f(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ float tsys_tp__f(__half x) { return __half2float(x); }
static __device__ int64_t tsys_tp__tgt(const void *tg, bool t64, int64_t e) { return t64 ? ((const int64_t *)tg)[e] : (int64_t)((const int32_t *)tg)[e]; }

// The block's max (is_max) or sum of v, in every thread.
static __device__ float tsys_tp__block_reduce(float v, bool is_max) {
    __shared__ float part[32];
    for (int o = 16; o; o >>= 1) { const float w = __shfl_xor_sync(0xffffffffu, v, o); v = is_max ? fmaxf(v, w) : v + w; }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < warps ? part[lane] : is_max ? -INFINITY : 0.0f;
    for (int o = 16; o; o >>= 1) { const float w = __shfl_xor_sync(0xffffffffu, v, o); v = is_max ? fmaxf(v, w) : v + w; }
    __syncthreads();   // part is free for the next call
    return v;
}

// pass 0: mx[e] = the row's max; pass 1 (mx the max over the ranks): st[e] = sum exp(l - mx), st[E + e] = the
// target's logit when this rank holds it, else 0.
template <typename T>
static __global__ void tsys_tp__ce_stats_kernel(const T *l, const void *tg, bool t64, int64_t V, int64_t lo, int64_t E, float *mx, float *st, int pass) {
    const int64_t e = blockIdx.x;
    const T *row = l + e * V;
    if (pass == 0) {
        float m = -INFINITY;
        for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, tsys_tp__f(row[v]));
        m = tsys_tp__block_reduce(m, true);
        if (threadIdx.x == 0) mx[e] = m;
        return;
    }
    const float m = mx[e];
    float s = 0;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += expf(tsys_tp__f(row[v]) - m);
    s = tsys_tp__block_reduce(s, false);
    if (threadIdx.x == 0) {
        const int64_t t = tsys_tp__tgt(tg, t64, e) - lo;
        st[e] = s;
        st[E + e] = t >= 0 && t < V ? tsys_tp__f(row[t]) : 0.0f;
    }
}

// d logit = (exp(logit - lse) - [the target]) x scale, scale = d loss / E read on the device (no host sync)
template <typename T>
static __global__ void tsys_tp__ce_grad_kernel(const T *l, const void *tg, bool t64, int64_t V, int64_t lo, const float *lse, const float *dloss, float E, float *g) {
    const int64_t e = blockIdx.x, t = tsys_tp__tgt(tg, t64, e) - lo;
    const float scale = __fdiv_rn(*dloss, E);
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) g[e * V + v] = (expf(tsys_tp__f(l[e * V + v]) - lse[e]) - (v == t ? 1.0f : 0.0f)) * scale;
}

static bool tsys_tp__launched(tsys_ctx *ctx, const char *what) {
    const cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) return true;
    tsys_ctx_set_error(ctx, TSYS_ERR_CUDA, "tp cross_entropy: %s: %s", what, cudaGetErrorString(err));
    return false;
}

static bool tsys_tp__ce_stats_cuda(tsys_ctx *ctx, tsys_tensor *logits, tsys_tensor *targets, int64_t V, int64_t lo, int64_t E, float *mx, float *st, int pass) {
    cudaStream_t s = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE);
    const void *l = tsys_tensor_data(logits), *tg = tsys_tensor_data(targets);
    const bool t64 = targets->dtype == TSYS_I64;
    if (logits->dtype == TSYS_BF16) tsys_tp__ce_stats_kernel<<<(unsigned)E, 256, 0, s>>>((const __nv_bfloat16 *)l, tg, t64, V, lo, E, mx, st, pass);
    else if (logits->dtype == TSYS_F16) tsys_tp__ce_stats_kernel<<<(unsigned)E, 256, 0, s>>>((const __half *)l, tg, t64, V, lo, E, mx, st, pass);
    else tsys_tp__ce_stats_kernel<<<(unsigned)E, 256, 0, s>>>((const float *)l, tg, t64, V, lo, E, mx, st, pass);
    return tsys_tp__launched(ctx, "the row statistics kernel");
}

// lse[e] = mx[e] + log(st[e]) and the loss, the mean of lse - the target's logit; one block in a fixed order, so
// the loss is the same bits run to run and stays on the device (no host sync in the step).
static __global__ void tsys_tp__ce_finish_kernel(const float *mx, const float *st, int64_t E, float *lse, float *loss) {
    __shared__ double part[256];
    double acc = 0;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
        const double row = (double)mx[e] + log((double)st[e]);
        lse[e] = (float)row;
        acc += row - (double)st[E + e];
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = blockDim.x / 2; half; half >>= 1) {
        if ((int)threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) *loss = (float)(part[0] / (double)E);
}

// The forward on CUDA tensors: three kernels and two NCCL all-reduces of E and 2E numbers; nothing comes back to
// the host. *lse_out (E numbers) is kept for the backward.
static tsys_tensor *tsys_tp__ce_cuda(tsys_tp_model *m, tsys_tensor *logits, tsys_tensor *targets, int64_t E, int64_t V, tsys_tensor **lse_out) {
    tsys_ctx *ctx = m->ctx;
    int64_t one = 1, n2 = 2 * E;
    tsys_tensor *mx = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &E), *st = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &n2),
                *lse = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &E), *loss = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, 1, &one);
    bool ok = mx && st && lse && loss;
    if (ok && E > INT32_MAX) {
        tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tp cross_entropy: %lld rows exceed the grid's limit", (long long)E);
        ok = false;
    }
    float *mxp = ok ? (float *)tsys_tensor_data(mx) : NULL, *stp = ok ? (float *)tsys_tensor_data(st) : NULL;
    ok = ok && tsys_tp__ce_stats_cuda(ctx, logits, targets, V, m->vocab_lo, E, mxp, stp, 0) && tsys_dist_all_reduce(m->tp, mx, TSYS_DIST_MAX) == TSYS_OK &&
         tsys_tp__ce_stats_cuda(ctx, logits, targets, V, m->vocab_lo, E, mxp, stp, 1) && tsys_dist_all_reduce(m->tp, st, TSYS_DIST_SUM) == TSYS_OK;
    if (ok) {
        cudaStream_t s = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE);
        tsys_tp__ce_finish_kernel<<<1, 256, 0, s>>>(mxp, stp, E, (float *)tsys_tensor_data(lse), (float *)tsys_tensor_data(loss));
        ok = tsys_tp__launched(ctx, "the loss kernel");
    }
    tsys_tensor_release(mx); tsys_tensor_release(st);
    if (!ok) { tsys_tensor_release(lse); tsys_tensor_release(loss); return NULL; }
    *lse_out = lse;
    return loss;
}

static tsys_tensor *tsys_tp__ce_grad_cuda(tsys_tp_model *m, tsys_tensor *logits, tsys_tensor *targets, tsys_tensor *lse, tsys_tensor *dloss) {
    tsys_ctx *ctx = m->ctx;
    const int64_t V = logits->shape[logits->ndim - 1], E = tsys_tensor_numel(logits) / V;
    tsys_tensor *g = tsys_tensor_new(ctx, TSYS_F32, TSYS_CUDA, logits->ndim, logits->shape);
    if (!g) return NULL;
    cudaStream_t s = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE);
    const void *l = tsys_tensor_data(logits), *tg = tsys_tensor_data(targets);
    const float *ls = (const float *)tsys_tensor_data(lse), *dl = (const float *)tsys_tensor_data(dloss), fE = (float)E;
    const bool t64 = targets->dtype == TSYS_I64;
    float *gp = (float *)tsys_tensor_data(g);
    if (logits->dtype == TSYS_BF16) tsys_tp__ce_grad_kernel<<<(unsigned)E, 256, 0, s>>>((const __nv_bfloat16 *)l, tg, t64, V, m->vocab_lo, ls, dl, fE, gp);
    else if (logits->dtype == TSYS_F16) tsys_tp__ce_grad_kernel<<<(unsigned)E, 256, 0, s>>>((const __half *)l, tg, t64, V, m->vocab_lo, ls, dl, fE, gp);
    else tsys_tp__ce_grad_kernel<<<(unsigned)E, 256, 0, s>>>((const float *)l, tg, t64, V, m->vocab_lo, ls, dl, fE, gp);
    if (!tsys_tp__launched(ctx, "the gradient kernel")) { tsys_tensor_release(g); return NULL; }
    return g;
}
#endif

static tsys_tensor *tsys_tp__ce_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) {
    (void)n;
    tsys_tp_model *m = (tsys_tp_model *)user;
    tsys_tensor *logits = ins[0], *targets = ins[1];
    const int64_t V = logits->shape[logits->ndim - 1], E = tsys_tensor_numel(logits) / V;
#ifdef TSYS_DIST_NCCL
    if (logits->device == TSYS_CUDA) {
        tsys_tensor *loss = tsys_tp__ce_cuda(m, logits, targets, E, V, saved);
        if (loss) tsys_tensor_set_name(loss, "loss");
        return loss;
    }
#endif
    float *l = (float *)TSYS_MALLOC(sizeof(float) * (size_t)(E * V) + 1), *lse = (float *)TSYS_MALLOC(sizeof(float) * (size_t)E + 1);
    void *tg = TSYS_MALLOC(tsys_tensor_bytes(targets) + 1);
    tsys_tensor *loss = NULL;
    double mean = 0;
    bool ok = false;
    if (!l || !lse || !tg) tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tp cross_entropy: out of host memory for %lld x %lld logits", (long long)E, (long long)V);
    else ok = tsys_tensor_to_f32(ctx, logits, l) == TSYS_OK && tsys_tensor_to_host(ctx, targets, tg) == TSYS_OK && tsys_tp__ce_rows(m, l, tg, targets->dtype, E, V, lse, &mean);
    if (ok) {
        const float mean_f = (float)mean;
        int64_t one = 1;
        loss = tsys_tensor_from_data(ctx, TSYS_F32, logits->device, 1, &one, &mean_f);
        *saved = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 1, &E, lse);
        if (loss) tsys_tensor_set_name(loss, "loss");
    }
    TSYS_FREE(l); TSYS_FREE(lse); TSYS_FREE(tg);
    return loss;
}

static tsys_status tsys_tp__ce_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)n;
    if (!needs[0]) return TSYS_OK;
    tsys_tp_model *m = (tsys_tp_model *)user;
    tsys_tensor *logits = ins[0], *targets = ins[1];
    const int64_t V = logits->shape[logits->ndim - 1], E = tsys_tensor_numel(logits) / V;
#ifdef TSYS_DIST_NCCL
    if (logits->device == TSYS_CUDA) {
        if (g->device != TSYS_CUDA || g->dtype != TSYS_F32 || tsys_tensor_numel(g) != 1)
            return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tp cross_entropy: the loss's gradient must be one f32 number on the GPU, as the loss is");
        return (grads[0] = tsys_tp__ce_grad_cuda(m, logits, targets, saved, g)) ? TSYS_OK : tsys_ctx_status(ctx);
    }
#endif
    float *l = (float *)TSYS_MALLOC(sizeof(float) * (size_t)(E * V) + 1), gl = 0;
    void *tg = TSYS_MALLOC(tsys_tensor_bytes(targets) + 1);
    tsys_status st = TSYS_OK;
    if (!l || !tg) st = tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tp cross_entropy: out of host memory for the gradient of %lld x %lld logits", (long long)E, (long long)V);
    if (st == TSYS_OK) st = tsys_tensor_to_f32(ctx, logits, l);
    if (st == TSYS_OK) st = tsys_tensor_to_host(ctx, targets, tg);
    if (st == TSYS_OK) st = tsys_tensor_to_f32(ctx, g, &gl);
    if (st == TSYS_OK) {
        const float *lse = (const float *)tsys_tensor_data(saved), scale = gl / (float)E;
        for (int64_t e = 0; e < E; e++) {
            const int64_t t = tsys_tp__target(tg, targets->dtype, e) - m->vocab_lo;
            for (int64_t v = 0; v < V; v++) l[e * V + v] = (expf(l[e * V + v] - lse[e]) - (v == t ? 1.0f : 0.0f)) * scale;
        }
        grads[0] = tsys_tensor_from_data(ctx, TSYS_F32, logits->device, logits->ndim, logits->shape, l);
        if (!grads[0]) st = tsys_ctx_status(ctx);
    }
    TSYS_FREE(l); TSYS_FREE(tg);
    return st;
}

// ---- the vocabulary-parallel embedding ----
// This rank's rows [vocab_lo, vocab_lo + vocab) of the table look up the ids they hold; the other ids are
// clamped into the slice and their rows masked to zero (`mask`, whose backward zeroes the same rows of the
// gradient before the embedding's own deterministic backward adds them), and `reduce` sums the ranks' rows.

#ifdef TSYS_DIST_NCCL
static __global__ void tsys_tp__local_ids_kernel(const void *ids, bool i64, int64_t E, int64_t lo, int64_t V, int32_t *local, float *keep) {
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < E; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = tsys_tp__tgt(ids, i64, e) - lo;
        const bool mine = t >= 0 && t < V;
        local[e] = (int32_t)(mine ? t : e % V);   // spread: one row taking every other rank's ids would be one long serial sum in the embedding's backward
        keep[e] = mine ? 1.0f : 0.0f;
    }
}
// T: the rows' element as bits (float or a 16-bit float's uint16_t); a masked row is zeros (+0 in every dtype).
template <typename T> static __global__ void tsys_tp__mask_rows_kernel(const T *x, const float *keep, int64_t n, int64_t D, T *y) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) y[i] = keep[i / D] != 0.0f ? x[i] : T();
}
static unsigned tsys_tp__blocks(int64_t n) { return (unsigned)(n / 256 + 1 < 65536 ? n / 256 + 1 : 65536); }
#endif

// The ids as this rank's rows (*local, I32; where another rank holds the id, row e mod the slice's rows, so
// that the masked rows spread over the slice) and *keep (F32, 1 where this rank holds the id), on the ids' device.
static bool tsys_tp__local_ids(tsys_tp_model *m, tsys_tensor *ids, tsys_tensor **local, tsys_tensor **keep) {
    tsys_ctx *ctx = m->ctx;
    const int64_t E = tsys_tensor_numel(ids);
    *local = *keep = NULL;
    bool ok = false;
#ifdef TSYS_DIST_NCCL
    if (ids->device == TSYS_CUDA) {
        *local = tsys_tensor_new(ctx, TSYS_I32, ids->device, ids->ndim, ids->shape);
        *keep = tsys_tensor_new(ctx, TSYS_F32, ids->device, 1, &E);
        ok = *local && *keep;
        if (ok) tsys_tp__local_ids_kernel<<<tsys_tp__blocks(E), 256, 0, (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE)>>>(
            tsys_tensor_data(ids), ids->dtype == TSYS_I64, E, m->vocab_lo, m->vocab, (int32_t *)tsys_tensor_data(*local), (float *)tsys_tensor_data(*keep));
        ok = ok && tsys_tp__launched(ctx, "the embedding's ids kernel");
    } else
#endif
    {
        void *h = TSYS_MALLOC(tsys_tensor_bytes(ids) + 1);
        int32_t *l = (int32_t *)TSYS_MALLOC(sizeof(int32_t) * (size_t)E + 1);
        float *k = (float *)TSYS_MALLOC(sizeof(float) * (size_t)E + 1);
        ok = h && l && k && tsys_tensor_to_host(ctx, ids, h) == TSYS_OK;
        if (!h || !l || !k) tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tp embedding: out of host memory for %lld ids", (long long)E);
        for (int64_t e = 0; ok && e < E; e++) {
            const int64_t t = tsys_tp__target(h, ids->dtype, e) - m->vocab_lo;
            const bool mine = t >= 0 && t < m->vocab;
            l[e] = (int32_t)(mine ? t : e % m->vocab);
            k[e] = mine ? 1.0f : 0.0f;
        }
        if (ok) {
            *local = tsys_tensor_from_data(ctx, TSYS_I32, ids->device, ids->ndim, ids->shape, l);
            *keep = tsys_tensor_from_data(ctx, TSYS_F32, ids->device, 1, &E, k);
            ok = *local && *keep;
        }
        TSYS_FREE(h); TSYS_FREE(l); TSYS_FREE(k);
    }
    if (!ok) { tsys_tensor_release(*local); tsys_tensor_release(*keep); *local = *keep = NULL; }
    return ok;
}

// x's rows where keep[row] is 1, zeros where it is 0: a new tensor of x's dtype (f32, or bf16 / f16 where FSDP
// gathers the embedding in low precision). A select rather than a product, so that a masked row is 0 even where
// another rank's row of x is not finite.
static tsys_tensor *tsys_tp__mask_rows(tsys_ctx *ctx, tsys_tensor *x, tsys_tensor *keep) {
    const bool rows_ok = x->dtype == TSYS_F32 || x->dtype == TSYS_BF16 || x->dtype == TSYS_F16;
    if (!rows_ok || keep->dtype != TSYS_F32 || x->device != keep->device || tsys_tensor_numel(x) % tsys_tensor_numel(keep)) {
        tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tp embedding mask: rows of f32, bf16 or f16 (got %s) and one f32 factor a row (got %s) on one device are expected",
                           tsys_dtype_name(x->dtype), tsys_dtype_name(keep->dtype));
        return NULL;
    }
    const int64_t n = tsys_tensor_numel(x), D = n / (tsys_tensor_numel(keep) ? tsys_tensor_numel(keep) : 1);
    tsys_tensor *y = tsys_tensor_new(ctx, x->dtype, x->device, x->ndim, x->shape);
    if (!y) return NULL;
#ifdef TSYS_DIST_NCCL
    if (x->device == TSYS_CUDA) {
        cudaStream_t s = (cudaStream_t)tsys_cuda_stream_of(ctx, TSYS_STREAM_COMPUTE);
        const float *k = (const float *)tsys_tensor_data(keep);
        if (x->dtype == TSYS_F32) tsys_tp__mask_rows_kernel<<<tsys_tp__blocks(n), 256, 0, s>>>((const float *)tsys_tensor_data(x), k, n, D, (float *)tsys_tensor_data(y));
        else tsys_tp__mask_rows_kernel<<<tsys_tp__blocks(n), 256, 0, s>>>((const uint16_t *)tsys_tensor_data(x), k, n, D, (uint16_t *)tsys_tensor_data(y));
        if (!tsys_tp__launched(ctx, "the embedding's mask kernel")) { tsys_tensor_release(y); return NULL; }
        return y;
    }
#endif
    const size_t row = (size_t)D * tsys_dtype_size(x->dtype);
    const char *xp = (const char *)tsys_tensor_data(x);
    const float *kp = (const float *)tsys_tensor_data(keep);
    char *yp = (char *)tsys_tensor_data(y);
    for (int64_t r = 0; r < n / (D ? D : 1); r++) {
        if (kp[r] != 0.0f) memcpy(yp + (size_t)r * row, xp + (size_t)r * row, row);
        else memset(yp + (size_t)r * row, 0, row);
    }
    return y;
}
static tsys_tensor *tsys_tp__mask_fwd(tsys_ctx *ctx, tsys_tensor *const *ins, int n, tsys_tensor **saved, void *user) {
    (void)n; (void)saved; (void)user;
    return tsys_tp__mask_rows(ctx, ins[0], ins[1]);
}
static tsys_status tsys_tp__mask_bwd(tsys_ctx *ctx, tsys_tensor *g, tsys_tensor *const *ins, int n, tsys_tensor *saved, const bool *needs, tsys_tensor **grads, void *user) {
    (void)n; (void)saved; (void)user;
    if (needs[0] && !(grads[0] = tsys_tp__mask_rows(ctx, g, ins[1]))) return tsys_ctx_status(ctx);
    return TSYS_OK;
}

static tsys_tensor *tsys_tp__embed(tsys_tp_model *m, tsys_tensor *ids) {
    tsys_tensor *local = NULL, *keep = NULL;
    if (!tsys_tp__local_ids(m, ids, &local, &keep)) return NULL;
    tsys_tensor *rows = tsys_embedding(m->ctx, m->params[0], local), *ins[2] = { rows, keep };
    tsys_tensor *masked = rows ? tsys_custom(m->ctx, &m->mask_op, ins, 2) : NULL;
    tsys_tensor_release(rows); tsys_tensor_release(local); tsys_tensor_release(keep);
    const tsys_custom_op *sum = m->sequence_parallel ? &m->scatter_op : &m->reduce_op;   // reduce: in place, masked is this op's own
    tsys_tensor *x = masked ? tsys_custom(m->ctx, sum, &masked, 1) : NULL;
    tsys_tensor_release(masked);
    return x;
}

// ---- the sharded parameters ----

// Rows [lo, lo + rows) of a (R, C) parameter, or columns [lo, lo + cols) when by_cols: a new leaf on dev.
static tsys_tensor *tsys_tp__slice(tsys_ctx *ctx, tsys_tensor *full, bool by_cols, int64_t lo, int64_t count, tsys_device dev) {
    const int64_t R = full->shape[0], C = full->ndim > 1 ? full->shape[1] : 1, n = tsys_tensor_numel(full);
    float *all = (float *)TSYS_MALLOC(sizeof(float) * (size_t)n + 1), *part = (float *)TSYS_MALLOC(sizeof(float) * (size_t)(by_cols ? R * count : count * C) + 1);
    tsys_tensor *t = NULL;
    if (all && part && tsys_tensor_to_f32(ctx, full, all) == TSYS_OK) {
        if (by_cols) { for (int64_t r = 0; r < R; r++) memcpy(part + r * count, all + r * C + lo, sizeof(float) * (size_t)count); }
        else memcpy(part, all + lo * C, sizeof(float) * (size_t)(count * C));
        int64_t shape[2] = { by_cols ? R : count, by_cols ? count : C };
        t = tsys_tensor_from_data(ctx, TSYS_F32, dev, full->ndim, shape, part);
    } else if (!all || !part) tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tp: out of host memory slicing '%s'", full->name);
    TSYS_FREE(all); TSYS_FREE(part);
    if (t) { tsys_tensor_set_name(t, "%s", full->name); tsys_tensor_set_requires_grad(t, true); }
    return t;
}

// How parameter `name` of the full model is split: 0 replicated, 1 by rows, 2 by columns; its split size.
static int tsys_tp__split_of(const tsys_tp_model *m, const char *name, int64_t *full_dim) {
    const char *rows[] = { "q_proj.weight", "k_proj.weight", "v_proj.weight", "ffn.w1.weight", "ffn.w3.weight", "lm_head.weight", "token_embeddings.weight" };
    const char *cols[] = { "output_proj.weight", "ffn.w2.weight" };
    const size_t l = strlen(name);
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        const size_t k = strlen(rows[i]);
        if (l >= k && !strcmp(name + l - k, rows[i])) {
            const bool vocab = strstr(rows[i], "lm_head") || strstr(rows[i], "embeddings");
            *full_dim = vocab ? m->desc.vocab_size : strstr(rows[i], "ffn") ? m->desc.d_ff : m->desc.d_model;
            return 1;
        }
    }
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++) {
        const size_t k = strlen(cols[i]);
        if (l >= k && !strcmp(name + l - k, cols[i])) { *full_dim = strstr(cols[i], "ffn") ? m->desc.d_ff : m->desc.d_model; return 2; }
    }
    return 0;
}

static bool tsys_tp__fits(tsys_tp_model *m, const tsys_model_desc *d, int n) {
    const char *what = d->num_heads % n ? "num_heads" : d->d_ff % n ? "d_ff" : d->vocab_size % n ? "vocab_size" : NULL;
    if (!what) return true;
    const int v = d->num_heads % n ? d->num_heads : d->d_ff % n ? d->d_ff : d->vocab_size;
    tsys_dist__fail(m->tp, TSYS_ERR_INVALID_ARGS, "tsys_tp_model_new: %s = %d is not a multiple of the tensor-parallel size %d", what, v, n);
    return false;
}

TSYSDEF tsys_tp_model *tsys_tp_model_new(tsys_dist *tp, tsys_model *full) {
    if (!tp) return NULL;
    tsys_ctx *ctx = tsys_dist_ctx(tp);
    if (!full) { tsys_dist__fail(tp, TSYS_ERR_INVALID_ARGS, "tsys_tp_model_new: full model is NULL"); return NULL; }
    tsys_tp_model *m = (tsys_tp_model *)calloc(1, sizeof *m);
    if (!m) { tsys_dist__fail(tp, TSYS_ERR_OOM, "tsys_tp_model_new: out of host memory"); return NULL; }
    const int n = tsys_dist_size(tp), r = tsys_dist_rank(tp);
    m->ctx = ctx; m->tp = tp; m->desc = *tsys_model_get_desc(full);
    tsys_tensor **fp = tsys_model_params(full);
    m->device = fp[0]->device;
    if (!tsys_tp__fits(m, &m->desc, n)) { free(m); return NULL; }
    m->heads = m->desc.num_heads / n; m->dff = m->desc.d_ff / n; m->vocab = m->desc.vocab_size / n; m->vocab_lo = r * m->vocab;
    m->n = tsys_model_num_tensors(full);
    m->params = (tsys_tensor **)calloc((size_t)m->n, sizeof *m->params);
    bool ok = m->params != NULL;
    for (int i = 0; ok && i < m->n; i++) {
        int64_t dim = 0;
        const int how = tsys_tp__split_of(m, fp[i]->name, &dim);
        m->params[i] = how ? tsys_tp__slice(ctx, fp[i], how == 2, r * (dim / n), dim / n, m->device) : tsys_tp__slice(ctx, fp[i], false, 0, fp[i]->shape[0], m->device);
        ok = m->params[i] != NULL;
    }
    if (!ok) { if (tsys_ctx_status(ctx) == TSYS_OK) tsys_dist__fail(tp, TSYS_ERR_OOM, "tsys_tp_model_new: out of memory"); tsys_tp_model_free(m); return NULL; }
    const tsys_custom_op copy = { "tp copy", tsys_tp__copy_fwd, tsys_tp__copy_bwd, 0, tp }, reduce = { "tp reduce", tsys_tp__reduce_fwd, tsys_tp__reduce_bwd, 0, tp },
                         ce = { "tp cross_entropy", tsys_tp__ce_fwd, tsys_tp__ce_bwd, 3u, m },
                         mask = { "tp embedding mask", tsys_tp__mask_fwd, tsys_tp__mask_bwd, 2u, m };
    const tsys_custom_op gather = { "tp gather rows", tsys_tp__gather_fwd, tsys_tp__gather_bwd, 0, tp }, scatter = { "tp scatter rows", tsys_tp__scatter_fwd, tsys_tp__scatter_bwd, 0, tp };
    m->copy_op = copy; m->reduce_op = reduce; m->ce_op = ce; m->mask_op = mask; m->gather_op = gather; m->scatter_op = scatter;
    return m;
}

TSYSDEF tsys_tensor **tsys_tp_model_params(tsys_tp_model *m) { return m ? m->params : NULL; }
TSYSDEF int tsys_tp_model_num_tensors(const tsys_tp_model *m) { return m ? m->n : 0; }
TSYSDEF tsys_status tsys_tp_model_set_sequence_parallel(tsys_tp_model *m, bool on) {
    if (!m) return TSYS_ERR_INVALID_ARGS;
    m->sequence_parallel = on;
    return TSYS_OK;
}

TSYSDEF void tsys_tp_model_free(tsys_tp_model *m) {
    if (!m) return;
    for (int i = 0; m->params && i < m->n; i++) tsys_tensor_release(m->params[i]);
    free(m->params);
    free(m);
}

// ---- forward ----

static tsys_tensor *tsys_tp__param(tsys_tp_model *m, int i) { return m->params[i]; }
// parameters() order: the embedding, then per layer q, k, v, o, w1, w2, w3, ln1, ln2, then ln_final, lm_head
enum { TSYS_TP__Q, TSYS_TP__K, TSYS_TP__V, TSYS_TP__O, TSYS_TP__W1, TSYS_TP__W2, TSYS_TP__W3, TSYS_TP__LN1, TSYS_TP__LN2, TSYS_TP__PER_LAYER };
static tsys_tensor *tsys_tp__layer_param(tsys_tp_model *m, int l, int which) { return tsys_tp__param(m, 1 + l * TSYS_TP__PER_LAYER + which); }

static tsys_tensor *tsys_tp__op1(tsys_tp_model *m, const tsys_custom_op *op, tsys_tensor *x) { return tsys_custom(m->ctx, op, &x, 1); }

// A block's normed input entering the column-parallel linears: under autocast cast once to the compute dtype
// (the projections would each cast it; and its gradient, all-reduced by `copy`, then travels in it too).
static tsys_tensor *tsys_tp__enter(tsys_tp_model *m, tsys_tensor *h) {
    const tsys_dtype ac = tsys_autocast_dtype(m->ctx);
    const tsys_custom_op *op = m->sequence_parallel ? &m->gather_op : &m->copy_op;   // sequence parallel: the rows of every rank
    if (ac == TSYS_F32 || h->dtype == ac) return tsys_tp__op1(m, op, h);
    tsys_tensor *c = tsys_cast(m->ctx, h, ac), *hc = c ? tsys_tp__op1(m, op, c) : NULL;
    tsys_tensor_release(c);
    return hc;
}

// A row-parallel linear leaving the tensor-parallel region: this rank's partial x W^T, summed by `reduce`. Consumes x.
static tsys_tensor *tsys_tp__row_parallel(tsys_tp_model *m, tsys_tensor *x, tsys_tensor *w) {
    tsys_tensor *part = tsys_linear(m->ctx, x, w, NULL);
    tsys_tensor_release(x);
    tsys_tensor *y = part ? tsys_tp__op1(m, m->sequence_parallel ? &m->scatter_op : &m->reduce_op, part) : NULL;
    tsys_tensor_release(part);
    return y;
}

// Attention over this rank's heads: the block's input through `copy`, the output projection's partial sums through `reduce`.
static tsys_tensor *tsys_tp__attention(tsys_tp_model *m, int l, tsys_tensor *h, int64_t B, int64_t T) {
    tsys_ctx *ctx = m->ctx;
    const int64_t dh = m->desc.d_model / m->desc.num_heads, H = m->heads;
    int64_t split[4] = { B, T, H, dh }, merged[3] = { B, T, H * dh };
    tsys_tensor *hc = tsys_tp__enter(m, h), *heads[3] = { NULL, NULL, NULL };
    for (int j = 0; j < 3; j++) {
        tsys_tensor *p = tsys_linear(ctx, hc, tsys_tp__layer_param(m, l, TSYS_TP__Q + j), NULL), *pv = tsys_view(ctx, p, 4, split);
        tsys_tensor_release(p);
        heads[j] = j < 2 ? tsys_rope_heads(ctx, pv, m->desc.rope_theta) : tsys_transpose12(ctx, pv);
        tsys_tensor_release(pv);
    }
    tsys_tensor_release(hc);
    const bool flash = m->desc.attn && !strcmp(m->desc.attn, "flash");
    tsys_tensor *a = flash ? tsys_flash_attention(ctx, heads[0], heads[1], heads[2], true, NULL) : tsys_attention_naive(ctx, heads[0], heads[1], heads[2], true);
    for (int j = 0; j < 3; j++) tsys_tensor_release(heads[j]);
    tsys_tensor *at = tsys_transpose12(ctx, a), *av = tsys_view(ctx, at, 3, merged);
    tsys_tensor_release(a); tsys_tensor_release(at);
    return tsys_tp__row_parallel(m, av, tsys_tp__layer_param(m, l, TSYS_TP__O));
}

// SwiGLU over this rank's d_ff slice.
static tsys_tensor *tsys_tp__ffn(tsys_tp_model *m, int l, tsys_tensor *h) {
    tsys_ctx *ctx = m->ctx;
    tsys_tensor *hc = tsys_tp__enter(m, h);
    tsys_tensor *a = tsys_linear(ctx, hc, tsys_tp__layer_param(m, l, TSYS_TP__W1), NULL), *b = tsys_linear(ctx, hc, tsys_tp__layer_param(m, l, TSYS_TP__W3), NULL);
    tsys_tensor_release(hc);
    tsys_tensor *s = tsys_swiglu(ctx, a, b);
    tsys_tensor_release(a); tsys_tensor_release(b);
    return tsys_tp__row_parallel(m, s, tsys_tp__layer_param(m, l, TSYS_TP__W2));
}

// rmsnorm(x) with gain w. Under sequence parallelism each rank's rows give only their part of w's gradient:
// w enters through `copy`, whose backward all-reduces it (one all-reduce of d_model numbers a norm).
static tsys_tensor *tsys_tp__norm(tsys_tp_model *m, tsys_tensor *x, tsys_tensor *w) {
    if (!m->sequence_parallel) return tsys_rmsnorm(m->ctx, x, w, m->desc.eps);
    tsys_tensor *ws = tsys_tp__op1(m, &m->copy_op, w), *h = ws ? tsys_rmsnorm(m->ctx, x, ws, m->desc.eps) : NULL;
    tsys_tensor_release(ws);
    return h;
}

// x + branch(norm(x)); consumes x.
static tsys_tensor *tsys_tp__residual(tsys_tp_model *m, int l, tsys_tensor *x, bool attn, int64_t B, int64_t T) {
    tsys_ctx *ctx = m->ctx;
    tsys_tensor *h = tsys_tp__norm(m, x, tsys_tp__layer_param(m, l, attn ? TSYS_TP__LN1 : TSYS_TP__LN2));
    tsys_tensor *f = attn ? tsys_tp__attention(m, l, h, B, T) : tsys_tp__ffn(m, l, h);
    tsys_tensor_release(h);
    tsys_tensor *y = tsys_add(ctx, x, f);
    tsys_tensor_release(x); tsys_tensor_release(f);
    return y;
}

TSYSDEF tsys_tensor *tsys_tp_model_loss(tsys_tp_model *m, tsys_tensor *ids, tsys_tensor *targets) {
    if (!m) return NULL;
    tsys_ctx *ctx = m->ctx;
    if (!ids || !targets || ids->ndim != 2 || tsys_tensor_numel(targets) != tsys_tensor_numel(ids)) {
        tsys_dist__fail(m->tp, TSYS_ERR_INVALID_ARGS, "tsys_tp_model_loss: ids must be (batch, seq) and targets hold as many ids");
        return NULL;
    }
    if (ids->shape[1] > m->desc.context_length) {
        tsys_dist__fail(m->tp, TSYS_ERR_INVALID_ARGS, "tsys_tp_model_loss: sequence length %lld is longer than context_length %d", (long long)ids->shape[1], m->desc.context_length);
        return NULL;
    }
    const int64_t B = ids->shape[0], T = ids->shape[1];
    if (m->sequence_parallel && (B * T) % tsys_dist_size(m->tp)) {
        tsys_dist__fail(m->tp, TSYS_ERR_INVALID_ARGS, "tsys_tp_model_loss: sequence parallelism splits the %lld tokens (batch %lld x sequence %lld) over %d ranks: "
                        "they must be a multiple of it", (long long)(B * T), (long long)B, (long long)T, tsys_dist_size(m->tp));
        return NULL;
    }
    tsys_tensor *x = tsys_tp__embed(m, ids);
    for (int l = 0; x && l < m->desc.num_layers; l++) {
        x = tsys_tp__residual(m, l, x, true, B, T);
        x = tsys_tp__residual(m, l, x, false, B, T);
    }
    tsys_tensor *h = tsys_tp__norm(m, x, tsys_tp__param(m, m->n - 2));
    tsys_tensor_release(x);
    tsys_tensor *hc = tsys_tp__enter(m, h);
    tsys_tensor_release(h);
    tsys_tensor *logits = tsys_linear(ctx, hc, tsys_tp__param(m, m->n - 1), NULL);   // (B, T, this rank's vocabulary)
    tsys_tensor_release(hc);
    tsys_tensor *ins[2] = { logits, targets };
    tsys_tensor *loss = logits ? tsys_custom(ctx, &m->ce_op, ins, 2) : NULL;
    tsys_tensor_release(logits);
    return loss;
}

// One of the step's activation all-reduces of x over tp: as such, or under sequence parallelism the all-gather of
// this rank's rows (rows, x's first 1/tp) and the reduce-scatter of the gathered rows back into them.
static tsys_status tsys_tp__time_one(tsys_tp_model *m, tsys_tensor *x, tsys_tensor *rows) {
    if (!m->sequence_parallel) return tsys_dist_all_reduce(m->tp, x, TSYS_DIST_SUM);
    tsys_status st = tsys_dist_all_gather(m->tp, x, rows);
    return st == TSYS_OK ? tsys_dist_reduce_scatter(m->tp, rows, x, TSYS_DIST_SUM) : st;
}

TSYSDEF tsys_status tsys_tp_model_time_collectives(tsys_tp_model *m, int batch, int context, tsys_dtype dtype, double *ms) {
    if (!m || !ms || batch < 1 || context < 1) return m ? tsys_dist__fail(m->tp, TSYS_ERR_INVALID_ARGS, "tsys_tp_model_time_collectives: batch and context must be >= 1") : TSYS_ERR_INVALID_ARGS;
    const int n = tsys_dist_size(m->tp);
    if (m->sequence_parallel && ((int64_t)batch * context) % n)
        return tsys_dist__fail(m->tp, TSYS_ERR_INVALID_ARGS, "tsys_tp_model_time_collectives: sequence parallelism splits the %lld tokens over %d ranks: "
                               "they must be a multiple of it", (long long)batch * context, n);
    tsys_ctx *ctx = m->ctx;
    const int64_t E = (int64_t)batch * context, dm = m->desc.d_model;
    int64_t act[2] = { E, dm }, mine[2] = { E / n, dm }, rows2 = 2 * E;
    tsys_tensor *a = tsys_tensor_new(ctx, dtype, m->device, 2, act), *a_rows = tsys_tensor_new(ctx, dtype, m->device, 2, mine),
                *emb = tsys_tensor_new(ctx, TSYS_F32, m->device, 2, act), *emb_rows = tsys_tensor_new(ctx, TSYS_F32, m->device, 2, mine),
                *r1 = tsys_tensor_new(ctx, TSYS_F32, m->device, 1, &E), *r2 = tsys_tensor_new(ctx, TSYS_F32, m->device, 1, &rows2),
                *gain = tsys_tensor_new(ctx, TSYS_F32, m->device, 1, &dm);
    tsys_tensor *all[7] = { a, a_rows, emb, emb_rows, r1, r2, gain };
    tsys_status st = TSYS_OK;
    for (int i = 0; i < 7 && st == TSYS_OK; i++) st = all[i] ? tsys_tensor_fill(ctx, all[i], 0.0f) : tsys_ctx_status(ctx);
    if (st == TSYS_OK) st = tsys_dist_sync(m->tp);
    if (st == TSYS_OK) st = tsys_dist_barrier(m->tp);
    const double t0 = tsys_time_us();
    if (st == TSYS_OK) st = tsys_tp__time_one(m, emb, emb_rows);   // the embedding's rows (fp32)
    for (int i = 0; st == TSYS_OK && i < 4 * m->desc.num_layers + 1; i++) st = tsys_tp__time_one(m, a, a_rows);
    for (int i = 0; st == TSYS_OK && m->sequence_parallel && i < 2 * m->desc.num_layers + 1; i++) st = tsys_dist_all_reduce(m->tp, gain, TSYS_DIST_SUM);
    if (st == TSYS_OK) st = tsys_dist_all_reduce(m->tp, r1, TSYS_DIST_MAX);
    if (st == TSYS_OK) st = tsys_dist_all_reduce(m->tp, r2, TSYS_DIST_SUM);
    if (st == TSYS_OK) st = tsys_dist_sync(m->tp);
    *ms = (tsys_time_us() - t0) * 1e-3;
    for (int i = 0; i < 7; i++) tsys_tensor_release(all[i]);
    return st;
}

// ---- the full parameters back ----

TSYSDEF tsys_status tsys_tp_model_gather(tsys_tp_model *m, tsys_model *full) {
    if (!m || !full) return m ? tsys_dist__fail(m->tp, TSYS_ERR_INVALID_ARGS, "tsys_tp_model_gather: full model is NULL") : TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = m->ctx;
    tsys_tensor **fp = tsys_model_params(full);
    const int n = tsys_dist_size(m->tp);
    tsys_status st = TSYS_OK;
    for (int i = 0; st == TSYS_OK && i < m->n; i++) {
        int64_t dim = 0;
        const int how = tsys_tp__split_of(m, fp[i]->name, &dim);
        const int64_t part = tsys_tensor_numel(m->params[i]);
        int64_t all_n = how ? part * n : part;
        tsys_tensor *mine = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &part), *all = tsys_tensor_new(ctx, TSYS_F32, TSYS_CPU, 1, &all_n);
        float *whole = (float *)TSYS_MALLOC(sizeof(float) * (size_t)tsys_tensor_numel(fp[i]) + 1);
        st = mine && all && whole ? tsys_tensor_to_f32(ctx, m->params[i], (float *)tsys_tensor_data(mine)) : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tp gather: out of memory");
        if (st == TSYS_OK && how) st = tsys_dist_all_gather(m->tp, all, mine);
        if (st == TSYS_OK) {
            const float *src = (const float *)tsys_tensor_data(how ? all : mine);
            if (how == 2) {   // rank k's block holds columns [k cols, (k + 1) cols) of every row
                const int64_t R = fp[i]->shape[0], cols = dim / n;
                for (int k = 0; k < n; k++)
                    for (int64_t r = 0; r < R; r++) memcpy(whole + r * dim + k * cols, src + k * part + r * cols, sizeof(float) * (size_t)cols);
            } else memcpy(whole, src, sizeof(float) * (size_t)tsys_tensor_numel(fp[i]));
            tsys_tensor *w = tsys_tensor_from_data(ctx, TSYS_F32, fp[i]->device, fp[i]->ndim, fp[i]->shape, whole);
            st = w ? tsys_tensor_copy_from(ctx, fp[i], w) : tsys_ctx_status(ctx);
            tsys_tensor_release(w);
        }
        TSYS_FREE(whole); tsys_tensor_release(mine); tsys_tensor_release(all);
    }
    return st;
}

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

// FSDP (tsys_fsdp_accounting), c = bytes of compute_dtype, units = the embedding (Vd), L layers (Ψl =
// 4d² + 3df each) and the lm_head (Vd), each padded to N·ceil(U/N); Ψr = (2L + 1)d replicated:
//   parameters   4(Σ shards + Ψr) fp32 masters + the working set c·(lm_head + one layer): at the peak
//                (the logits' gradient, the start of backward) the lm_head is still gathered from its
//                forward and the last layer is being prefetched; without reshard_after_forward (the
//                default in a group of one) c·(lm_head + L layers): all but the embedding are still
//                gathered from the forward, as autocast's weight copies are in the plain step; fp32 in
//                a group of one: 0 (the weights are views of the masters)
//   gradients    4(Σ shards + Ψr) fp32 + the lm_head's full gradient c·Vd
//   optimizer    8(Σ shards + Ψr)
//   activations  the fp32 formula below; for bf16/fp16 compute the whole forward runs in that dtype,
//                so scaled by c/4 (approximate: rstd and lse stay fp32)
//   sent         all-gathers in forward (every unit) and backward (all but the embedding, whose
//                backward needs no weight, and the lm_head, kept from its forward): (N-1)/N · c(2Ψs -
//                2Vd), without resharding only the forward's (N-1)/N · cΨs; reduce-scatters (N-1)/N · cΨs;
//                all-reduce of the replicated gradients 2(N-1)/N · 4Ψr
//   under a checkpoint policy (the desc's checkpoint) the activations are the planner's instead (below)

// The parameters that matmuls read (every block's projections and the LM head): what autocast casts.
static double tsys_dist__matmul_params(const tsys_model_desc *m) {
    tsys_model_desc d = tsys_model_desc_defaults(m);
    return d.num_layers * (4.0 * d.d_model * d.d_model + 3.0 * d.d_model * d.d_ff) + (double)d.vocab_size * d.d_model;
}

// The activations of a step under m's checkpointing policy (< 0: none, or one the planner refuses): the
// planner's predicted single-device peak (tsys_checkpoint_plan_make, which knows what each policy keeps
// and what backward's recomputation holds) less what it counts that the schemes count themselves: the
// parameters and AdamW's state (fixed_bytes) and, under autocast, the weights' low-precision casts. The
// formulas above do not know the policies: the S26 leaderboard row (8.13 B, context 32768, FSDP on 2
// GPUs, blocks:1+keep-attn) measured 100263 MiB a rank against their 232845.
// fsdp: the model as FSDP runs it, in the compute dtype throughout (the residual stream in that dtype, no
// cast to subtract) with each unit's gradients given back once reduce-scattered (TSYS_PLAN_PURE,
// TSYS_PLAN_FREE_GRADS). Without them the S26 step with the LM head and the loss fused, whose peak is in the
// blocks rather than at the logits' gradient, was predicted 9.6% over its measured peak.
static double tsys_dist__ckpt_act_bytes(const tsys_model_desc *m, tsys_dtype dtype, int batch, int context, bool fsdp) {
    if (!m->checkpoint || !m->checkpoint[0] || !strcmp(m->checkpoint, "none")) return -1;
    tsys_checkpoint_plan p;
    const unsigned how = TSYS_PLAN_OPTIMIZER | (fsdp ? TSYS_PLAN_PURE | TSYS_PLAN_FREE_GRADS : 0u);
    if (tsys_checkpoint_plan_make_ex(m, m->checkpoint, batch, context, dtype, how, &p, NULL, 0) != TSYS_OK) return -1;
    const bool casts = !fsdp && (dtype == TSYS_BF16 || dtype == TSYS_F16);
    return p.peak_bytes - p.fixed_bytes - (casts ? 2.0 * tsys_dist__matmul_params(m) : 0);
}

TSYSDEF tsys_dist_account tsys_fsdp_accounting(const tsys_model_desc *m, tsys_dtype compute_dtype, int batch, int context, int world) {
    tsys_fsdp_desc fd;
    memset(&fd, 0, sizeof(fd));
    fd.compute_dtype = compute_dtype;
    return tsys_fsdp_accounting_desc(m, &fd, batch, context, world);
}

TSYSDEF tsys_dist_account tsys_fsdp_accounting_desc(const tsys_model_desc *m, const tsys_fsdp_desc *desc, int batch, int context, int world) {
    tsys_dtype compute_dtype = desc ? desc->compute_dtype : TSYS_F32;
    tsys_fsdp_reshard rs = desc ? desc->reshard_after_forward : TSYS_FSDP_RESHARD_AUTO;
    bool reshard = rs == TSYS_FSDP_RESHARD_YES || (rs == TSYS_FSDP_RESHARD_AUTO && world > 1);   // as tsys_fsdp_new decides
    tsys_dist_account a = tsys_dist_accounting(m, TSYS_F32, batch, context, world, TSYS_SCHEME_ZERO3);
    tsys_model_desc d = tsys_model_desc_defaults(m);
    double N = world > 0 ? world : 1;
    double c = compute_dtype == TSYS_BF16 || compute_dtype == TSYS_F16 ? 2.0 : 4.0;
    double dm = d.d_model, V = d.vocab_size, L = d.num_layers;
    double Ue = V * dm, Ul = 4 * dm * dm + 3 * dm * d.d_ff;
    double Se = ceil(Ue / N), Sl = ceil(Ul / N), shards = 2 * Se + L * Sl, Pr = (2 * L + 1) * dm;
    bool alias = world <= 1 && c == 4 && !(desc && desc->no_shortcut);   // fp32 alone: the weights are the masters
    double work_p = alias ? 0 : c * N * (Se + (reshard ? 1 : L) * Sl), work_g = c * N * Se;
    a.param_bytes = 4 * (shards + Pr) + work_p;
    a.grad_bytes = 4 * (shards + Pr) + work_g;
    a.optim_bytes = 8 * (shards + Pr);
    a.work_bytes = work_p + work_g;
    if (desc && desc->ce_transfers && world > 1) {   // every unit's weights and full gradients stay (the shard's gradient a window of
        a.param_bytes = 4 * (shards + Pr) + c * N * shards;   // them), beside the peers' parts of the shards
        a.grad_bytes = 4 * Pr + c * N * shards + (N - 1) * (c * shards + 4 * Pr);
        a.work_bytes = 0;
    }
    const double ckpt = tsys_dist__ckpt_act_bytes(m, compute_dtype, batch, context, true);
    a.act_bytes = ckpt >= 0 ? ckpt : a.act_bytes * c / 4.0;
    a.total_bytes = a.param_bytes + a.grad_bytes + a.optim_bytes + a.act_bytes;
    double ring = (N - 1) / N, Ps = 2 * Ue + L * Ul;
    a.sent_bytes = ring * c * (reshard ? 2 * Ps - 2 * Ue : Ps) + ring * c * Ps + 2 * ring * 4 * Pr;
    return a;
}

// tsys_dist_checkpoint_auto's search: each policy of tsys_checkpoint_policy_each against a rank's accounting.
typedef struct tsys_dist__auto_search {
    const tsys_model_desc *m;
    const tsys_fsdp_desc *fd;
    tsys_dist_scheme scheme;
    tsys_dtype dtype;
    int batch, context, world;
    double budget;
    bool have, best_fits;
    double best_peak, best_cost;
    char best[64];
} tsys_dist__auto_search;

static void tsys_dist__auto_try(const tsys_checkpoint_policy *pol, void *user) {
    tsys_dist__auto_search *s = (tsys_dist__auto_search *)user;
    char name[64];
    tsys_checkpoint_policy_name(pol, name, sizeof name);
    tsys_model_desc d = *s->m;
    d.checkpoint = name;
    const double peak = (s->fd ? tsys_fsdp_accounting_desc(&d, s->fd, s->batch, s->context, s->world)
                               : tsys_dist_accounting(&d, s->dtype, s->batch, s->context, s->world, s->scheme)).total_bytes;
    tsys_checkpoint_plan p;
    const tsys_dtype ac = s->fd ? s->fd->compute_dtype : s->dtype;
    const double cost = tsys_checkpoint_plan_make(&d, name, s->batch, s->context, ac, true, &p, NULL, 0) == TSYS_OK ? tsys_checkpoint_plan_cost(&p) : INFINITY;
    const bool fits = peak <= s->budget;
    if (s->have && !tsys_checkpoint_candidate_better(fits, cost, peak, s->best_fits, s->best_cost, s->best_peak)) return;
    snprintf(s->best, sizeof s->best, "%s", name);
    s->best_peak = peak; s->best_cost = cost; s->best_fits = fits; s->have = true;
}

TSYSDEF tsys_status tsys_dist_checkpoint_auto(const tsys_model_desc *m, const tsys_fsdp_desc *fd, tsys_dist_scheme scheme, tsys_dtype dtype, int batch,
                                              int context, int world, double budget, char *policy, size_t len, double *peak) {
    if (!m || !policy || !len || batch < 1 || context < 1 || world < 1) return TSYS_ERR_INVALID_ARGS;
    const tsys_model_desc d = tsys_model_desc_defaults(m);
    tsys_dist__auto_search s;
    memset(&s, 0, sizeof(s));
    s.m = &d; s.fd = fd; s.scheme = scheme; s.dtype = dtype; s.batch = batch; s.context = context; s.world = world; s.budget = budget;
    tsys_checkpoint_policy_each(&d, tsys_dist__auto_try, &s);
    snprintf(policy, len, "%s", s.best);
    if (peak) *peak = s.best_peak;
    return s.best_fits ? TSYS_OK : TSYS_ERR_OOM;
}

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
    return tsys_dist_accounting_ex(m, dtype, batch, context, world, scheme, 0u);
}

TSYSDEF tsys_dist_account tsys_dist_accounting_ex(const tsys_model_desc *m, tsys_dtype dtype, int batch, int context, int world, tsys_dist_scheme scheme, unsigned plan_flags) {
    tsys_dist_account a;
    memset(&a, 0, sizeof(a));
    if (plan_flags & ~(TSYS_PLAN_LOWP_GRADS | TSYS_PLAN_KEPT_COPIES)) return a;
    tsys_model_desc d = tsys_model_desc_defaults(m);
    double N = world > 0 ? world : 1;
    double P = (double)tsys_model_desc_num_params(&d);
    double dm = d.d_model, f = d.d_ff, H = d.num_heads, V = d.vocab_size, L = d.num_layers;
    double B = batch > 0 ? batch : 0, T = context > 0 ? context : 0, E = B * T;
    bool ac = dtype == TSYS_BF16 || dtype == TSYS_F16;
    double c = ac ? 2.0 : 4.0;
    // autocast's copies of the matmul weights (fused_loss: lm_head's lives only inside the fused op's forward)
    a.param_bytes = 4 * P + (ac ? c * (tsys_dist__matmul_params(&d) - (d.fused_loss ? V * dm : 0)) : 0);
    a.grad_bytes = 4 * P - (ac && (plan_flags & TSYS_PLAN_LOWP_GRADS) ? (4 - c) * tsys_dist__matmul_params(&d) : 0);
    const double G = a.grad_bytes;   // every gradient's bytes, as sent
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
    // fused: d w, and beside it a chunk's logits and log-sum-exp in forward or lm_head's gradient in backward;
    // else the logits, their lse and their gradient
    const double rows = (double)tsys_model_fused_loss_chunk(&d, (int64_t)E);
    const double head = d.fused_loss ? 4 * V * dm + fmax(4 * V * dm, rows * (c * V + 4)) : c * E * V + 4 * E + c * E * V;
    a.act_bytes = L * layer + (4 * E * dm + 4 * E) + (ac ? c : 4) * E * dm + head;
    const double ckpt = tsys_dist__ckpt_act_bytes(m, dtype, batch, context, false);
    if (ckpt >= 0) a.act_bytes = ckpt;
    a.total_bytes = a.param_bytes + a.grad_bytes + a.optim_bytes + a.act_bytes;
    double ring = (N - 1) / N;
    switch (scheme) {
    case TSYS_SCHEME_DDP: a.sent_bytes = 2 * ring * G; break;
    case TSYS_SCHEME_ZERO1: a.sent_bytes = 3 * ring * G; break;
    case TSYS_SCHEME_ZERO2: a.sent_bytes = 2 * ring * G; break;
    case TSYS_SCHEME_ZERO3: a.sent_bytes = 3 * ring * G; break;
    }
    return a;
}

// >>link model ------------------------------------------------------------------------------------
// n collectives issued back to back: one's launch and sync overlap another's transfer, so the time is
// bounded below by both n alpha and sent / beta, and lies near the larger (2 x H100, xl, bf16: DDP naive's
// 435 all-reduces 39.9 ms measured, 39.8 predicted; flat 23.3 / 28.0, bucketed 100 MB 30.2 / 28.0).
TSYSDEF double tsys_dist_link_time_ms(tsys_dist_link_model m, int n, double sent_bytes) {
    if (!(m.beta_bytes_per_ms > 0)) return NAN;
    return fmax(n * m.alpha_ms, sent_bytes / m.beta_bytes_per_ms);
}

TSYSDEF double tsys_dist_ring_sent(int world, double bytes) { return world > 0 ? 2.0 * (world - 1) / world * bytes : 0; }

// n collectives one after another, each its alpha and its share of the bytes (the plan's form; NAN for the zero model)
static double tsys_dist__link_serial_ms(tsys_dist_link_model m, int n, double sent_bytes) {
    if (!(m.beta_bytes_per_ms > 0)) return NAN;
    return n * m.alpha_ms + sent_bytes / m.beta_bytes_per_ms;
}

TSYSDEF double tsys_fsdp_link_time_ms(const tsys_fsdp_stats *s, int world, tsys_fsdp_links m) {
    if (!s || world < 1) return NAN;
    const double part = (world - 1.0) / world;
    const double ag = tsys_dist__link_serial_ms(m.all_gather, s->all_gathers, part * (double)s->gathered_bytes);
    const double rs = tsys_dist__link_serial_ms(m.reduce_scatter, s->reduce_scatters, part * (double)s->reduced_bytes);
    const double ar = tsys_dist__link_serial_ms(m.all_reduce, s->all_reduces, tsys_dist_ring_sent(world, 4.0 * (double)s->replicated_numel));
    return ag + rs + (s->all_reduces > 0 ? ar : 0);   // a model without replicated parameters needs no all-reduce link
}

TSYSDEF double tsys_dist_pull_time_ms(tsys_dist_pull_links m, int world, int n, const int64_t *off, const int64_t *bytes, const int64_t *lo, const int64_t *hi) {
    if (!(m.all.beta_bytes_per_ms > 0) || !(m.one.beta_bytes_per_ms > 0) || world < 2 || n < 0 || (n > 0 && (!off || !bytes || !lo || !hi))) return NAN;
    double ms = 0;
    for (int k = 0; k < n; k++) {
        double most = 0;
        int receivers = 0;
        for (int r = 0; r < world; r++) {
            const int64_t a = off[k] > lo[r] ? off[k] : lo[r], b = off[k] + bytes[k] < hi[r] ? off[k] + bytes[k] : hi[r];
            if (b <= a) continue;
            receivers++;
            most = fmax(most, (world - 1.0) * (double)(b - a));
        }
        const tsys_dist_link_model l = receivers == 1 ? m.one : m.all;
        ms += l.alpha_ms + most / l.beta_bytes_per_ms;
    }
    return ms;
}

TSYSDEF const char *tsys_dist_layout_name(tsys_dist_layout l) {
    static const char *const names[TSYS_LAYOUT_COUNT] = { "dp", "fsdp", "tp", "dp_tp", "fsdp_tp" };
    return (unsigned)l < (unsigned)TSYS_LAYOUT_COUNT ? names[l] : "?";
}

// What one rank of tsys_tp_model keeps for backward (batch x context tokens, tp ranks): tsys_dist_accounting's
// terms of a layer with the attention's heads, the output projection's input and the SwiGLU's d_ff split over
// tp; the norms' outputs whole, cast once under autocast before the copy op (one low-precision copy feeds q, k
// and v, one w1 and w3); outside the blocks the final norm, the LM head's input, the rank's slice of the
// logits, the rows' log-sum-exp and the slice's fp32 gradient (tsys_tp's cross-entropy). pure: the model
// computes in dtype throughout (FSDP's gathered weights, no autocast), so the norms' inputs are kept in dtype too;
// sp: sequence parallelism, the norms' inputs and statistics of this rank's rows only.
static double tsys_dist__tp_act_bytes(const tsys_model_desc *d, tsys_dtype dtype, int batch, int context, int tp, bool pure, bool sp) {
    const bool ac = dtype == TSYS_BF16 || dtype == TSYS_F16, flash = d->attn && !strcmp(d->attn, "flash");
    const double c = ac ? 2.0 : 4.0, r = pure ? c : 4.0, t = tp, dm = d->d_model, H = d->num_heads / t, V = d->vocab_size / t;
    const double B = batch, T = context, E = B * T, norm = (r * E * dm + 4 * E) / (sp ? t : 1);   // sp: each rank normalizes its rows
    const double layer = 2 * norm + c * E * dm
                       + (flash ? 4 * c * E * dm / t + 4 * B * H * T : 3 * c * E * dm / t + c * B * H * T * T)
                       + c * E * dm / t + c * E * dm + 3 * c * E * d->d_ff / t;
    return d->num_layers * layer + norm + c * E * dm + c * E * V + 4 * E + 4 * E * V + 8 * E;   // + the embedding's local ids and row mask
}

// act_bytes and peak_bytes of p (weight_bytes set) for the layout; held: the parameters a tp rank holds, split:
// of them the matmul weights (autocast's copies).
static void tsys_dist__plan_memory(tsys_dist_plan *p, const tsys_model_desc *d, tsys_dist_layout layout, int dp, int tp, int batch, int context,
                                   tsys_dtype dtype, double split, bool sp) {
    const bool ac = dtype == TSYS_BF16 || dtype == TSYS_F16;
    const double c = ac ? 2.0 : 4.0;
    if (layout == TSYS_LAYOUT_DP || layout == TSYS_LAYOUT_FSDP) {
        const tsys_dist_account a = layout == TSYS_LAYOUT_DP ? tsys_dist_accounting(d, dtype, batch, context, dp, TSYS_SCHEME_DDP)
                                                             : tsys_fsdp_accounting(d, dtype, batch, context, dp);
        p->act_bytes = a.act_bytes;
        p->peak_bytes = a.total_bytes;
        return;
    }
    p->act_bytes = tsys_dist__tp_act_bytes(d, dtype, batch, context, tp, layout == TSYS_LAYOUT_FSDP_TP && dp > 1, sp);
    const double unit = (4.0 * d->d_model * d->d_model + 3.0 * d->d_model * d->d_ff) / tp, embed = (double)d->vocab_size * d->d_model / tp;
    const double working = layout == TSYS_LAYOUT_FSDP_TP && dp > 1 ? c * (embed + unit) + c * embed   // a gathered block and the embedding, its gradient
                         : ac ? c * split : 0;                                                         // autocast's copies
    p->peak_bytes = p->weight_bytes + working + p->act_bytes;
}

TSYSDEF tsys_dist_plan tsys_dist_plan_of(const tsys_dist_plan_in *in) {
    tsys_dist_plan p;
    memset(&p, 0, sizeof p);
    if (!in || !in->model) return p;
    const tsys_model_desc d = tsys_model_desc_defaults(in->model);
    const tsys_dist_layout layout = in->layout;
    const bool has_tp = layout == TSYS_LAYOUT_TP || layout == TSYS_LAYOUT_DP_TP || layout == TSYS_LAYOUT_FSDP_TP, sp = has_tp && in->sequence_parallel;
    const int tp = has_tp ? in->tp : 1, dp = layout == TSYS_LAYOUT_TP ? 1 : in->dp, batch = in->batch, context = in->context;
    if (dp < 1 || tp < 1 || batch < 1 || context < 1 || !tsys_dtype_is_float(in->dtype) || !(in->flops_per_s > 0)) return p;
    const int elem_bytes = (int)tsys_dtype_size(in->dtype);
    // what a tp rank holds: its share of the blocks' matmuls, of the LM head (split: the weights autocast casts)
    // and of the embedding's rows; the norms whole
    const double dm = d.d_model, L = d.num_layers, split = L * (4 * dm * dm + 3 * dm * d.d_ff) + (double)d.vocab_size * dm;
    const double whole = (2.0 * L + 1) * dm, held = (split + (double)d.vocab_size * dm) / tp + whole;
    p.flops = tsys_model_flops(&d, batch, context, true) / tp;
    p.compute_ms = p.flops / in->flops_per_s * 1e3;
    const double shard = (dp - 1.0) / dp * held;   // elements of one all-gather or reduce-scatter of what a tp rank holds
    const tsys_dist_link_model dp_ag = in->dp_gather.beta_bytes_per_ms > 0 ? in->dp_gather : in->dp_link,
                               dp_rs = in->dp_scatter.beta_bytes_per_ms > 0 ? in->dp_scatter : in->dp_link,
                               tp_ag = in->tp_gather.beta_bytes_per_ms > 0 ? in->tp_gather : in->tp_link,
                               tp_rs = in->tp_scatter.beta_bytes_per_ms > 0 ? in->tp_scatter : in->tp_link;
    double dp_ms = 0, tp_ms = 0;
    if (layout == TSYS_LAYOUT_DP || layout == TSYS_LAYOUT_DP_TP) {   // fp32 gradients, 100 MiB buckets
        p.dp_sent_bytes = 2 * shard * 4;
        dp_ms = tsys_dist__link_serial_ms(in->dp_link, (int)ceil(held * 4 / (100.0 * 1048576.0)), p.dp_sent_bytes);
    }
    if (layout == TSYS_LAYOUT_FSDP || layout == TSYS_LAYOUT_FSDP_TP) {   // units: the blocks, the embedding, the LM head
        const int units = d.num_layers + 2;   // each gathered in forward and again in backward, reduce-scattered; the norms' gains all-reduced
        p.dp_sent_bytes = 3 * shard * elem_bytes;
        dp_ms = tsys_dist__link_serial_ms(dp_ag, 2 * units, 2 * shard * elem_bytes) + tsys_dist__link_serial_ms(dp_rs, units, shard * elem_bytes) +
                tsys_dist__link_serial_ms(in->dp_link, 2 * d.num_layers + 1, 0);
    }
    if (has_tp) {   // per block 4 all-reduces of the activations, the LM head's input, the embedding's fp32 rows, the loss's 2
        const double act = (double)batch * context * dm;
        p.tp_sent_bytes = (4 * L + 1) * tsys_dist_ring_sent(tp, act * elem_bytes) + tsys_dist_ring_sent(tp, act * 4);
        if (!sp) tp_ms = tsys_dist__link_serial_ms(in->tp_link, 4 * d.num_layers + 4, p.tp_sent_bytes);
        else {   // each all-reduce an all-gather and a reduce-scatter (half its bytes each), and the norms' gains all-reduced
            const double half = p.tp_sent_bytes / 2, gains = (2 * L + 1) * tsys_dist_ring_sent(tp, dm * 4);
            p.tp_sent_bytes += gains;
            tp_ms = tsys_dist__link_serial_ms(tp_ag, 4 * d.num_layers + 2, half) + tsys_dist__link_serial_ms(tp_rs, 4 * d.num_layers + 2, half) +
                    tsys_dist__link_serial_ms(in->tp_link, 2 * d.num_layers + 1 + 2, gains);
        }
    }
    p.dp_comm_ms = dp > 1 ? dp_ms : 0;
    p.tp_comm_ms = has_tp ? tp_ms : 0;
    p.comm_ms = p.dp_comm_ms + p.tp_comm_ms;
    const bool sharded = layout == TSYS_LAYOUT_FSDP || layout == TSYS_LAYOUT_FSDP_TP;
    p.weight_bytes = 16.0 * (sharded ? held / dp : held);
    tsys_dist__plan_memory(&p, &d, layout, dp, tp, batch, context, in->dtype, split / tp, sp);
    return p;
}

TSYSDEF tsys_dist_plan tsys_dist_plan_step_links(const tsys_model_desc *m, tsys_dist_layout layout, int dp, int tp, int batch, int context, tsys_dtype dtype,
                                                 double flops_per_s, tsys_dist_link_model dp_link, tsys_dist_link_model tp_link) {
    tsys_dist_plan_in in;
    memset(&in, 0, sizeof in);
    in.model = m; in.layout = layout; in.dp = dp; in.tp = tp; in.batch = batch; in.context = context; in.dtype = dtype;
    in.flops_per_s = flops_per_s; in.dp_link = dp_link; in.tp_link = tp_link;
    return tsys_dist_plan_of(&in);
}

TSYSDEF tsys_dist_plan tsys_dist_plan_step(const tsys_model_desc *m, tsys_dist_layout layout, int dp, int tp, int batch, int context, tsys_dtype dtype,
                                           double flops_per_s, double bytes_per_s) {
    tsys_dist_plan p;
    memset(&p, 0, sizeof p);
    if (!(bytes_per_s > 0)) return p;
    const tsys_dist_link_model w = { 0.0, bytes_per_s * 1e-3 };
    return tsys_dist_plan_step_links(m, layout, dp, tp, batch, context, dtype, flops_per_s, w, w);
}

// The ms of one collective of `kind` over x (the full tensor: an all-reduce's, an all-gather's output, a
// reduce-scatter's input; part is x's 1/N share), from reps issued back to back and one wait (as DDP issues its
// buckets): the median of 7 rounds after 2 of warm-up. The median, since a round the host or a peer was late for
// would move a mean by tens of percent (one 256 MiB all-reduce a round moved the 2-GPU prediction from 29.5 to
// 51.3 ms between two calls).
static tsys_status tsys_dist__probe(tsys_dist *d, tsys_dist_collective kind, tsys_tensor *x, tsys_tensor *part, int reps, double *ms) {
    tsys_status st = TSYS_OK;
    double round[7];
    for (int it = 0; st == TSYS_OK && it < 9; it++) {
        if ((st = tsys_dist_barrier(d)) != TSYS_OK) break;
        double t0 = tsys_time_us();
        for (int r = 0; st == TSYS_OK && r < reps; r++)
            st = kind == TSYS_DIST_ALL_GATHER ? tsys_dist_all_gather(d, x, part)
               : kind == TSYS_DIST_REDUCE_SCATTER ? tsys_dist_reduce_scatter(d, part, x, TSYS_DIST_SUM)
               : tsys_dist_all_reduce(d, x, TSYS_DIST_SUM);
        if (st == TSYS_OK) st = tsys_dist_sync(d);
        if (it >= 2) round[it - 2] = (tsys_time_us() - t0) * 1e-3 / reps;
    }
    if (st != TSYS_OK) return st;
    qsort(round, 7, sizeof(double), tsys_dist__cmp_double);
    *ms = round[3];
    return TSYS_OK;
}

// The bytes a rank sends in one collective of `kind` over `bytes` (ring algorithms).
static double tsys_dist__sent(tsys_dist_collective kind, int world, double bytes) {
    return kind == TSYS_DIST_ALL_REDUCE ? tsys_dist_ring_sent(world, bytes) : (world - 1.0) / world * bytes;
}

TSYSDEF tsys_dist_link_model tsys_dist_calibrate_link_of(tsys_dist *d, tsys_device dev, tsys_dist_collective kind) {
    tsys_dist_link_model m = {0, 0};
    tsys_ctx *ctx = tsys_dist_ctx(d);
    const int world = tsys_dist_size(d);
    if (!ctx || world < 2 || (unsigned)kind > (unsigned)TSYS_DIST_REDUCE_SCATTER) return m;
    const int64_t want[2] = {16384, dev == TSYS_CUDA ? (int64_t)16 << 20 : (int64_t)2 << 20};
    int64_t floats[2];
    double t[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        floats[k] = want[k] / world * world;   // a whole share a rank
        const int64_t share = floats[k] / world;
        tsys_tensor *x = tsys_tensor_new(ctx, TSYS_F32, dev, 1, &floats[k]);
        tsys_tensor *part = kind == TSYS_DIST_ALL_REDUCE ? NULL : tsys_tensor_new(ctx, TSYS_F32, dev, 1, &share);
        const bool made = x && tsys_tensor_fill(ctx, x, 1.0f) == TSYS_OK && (kind == TSYS_DIST_ALL_REDUCE || (part && tsys_tensor_fill(ctx, part, 1.0f) == TSYS_OK));
        // every rank learns whether any could not allocate (or probe), so all stop at the same point
        bool bad = tsys_dist_any_failed(d, made ? TSYS_OK : TSYS_ERR_OOM);
        if (!bad) bad = tsys_dist_any_failed(d, tsys_dist__probe(d, kind, x, part, k == 0 ? 20 : 4, &t[k]));
        tsys_tensor_release(x); tsys_tensor_release(part);
        if (bad) { tsys_ctx_clear_error(ctx); return m; }
    }
    if (tsys_dist_all_reduce_host(d, t, 2, TSYS_DIST_MAX) != TSYS_OK || !(t[1] > t[0])) return m;
    const double s0 = tsys_dist__sent(kind, world, 4.0 * (double)floats[0]), s1 = tsys_dist__sent(kind, world, 4.0 * (double)floats[1]);
    m.beta_bytes_per_ms = (s1 - s0) / (t[1] - t[0]);
    m.alpha_ms = fmax(0.0, t[0] - s0 / m.beta_bytes_per_ms);
    return m;
}

TSYSDEF tsys_dist_link_model tsys_dist_calibrate_link(tsys_dist *d, tsys_device dev) { return tsys_dist_calibrate_link_of(d, dev, TSYS_DIST_ALL_REDUCE); }

// >>state sharded ---------------------------------------------------------------------------------
// Sharded snapshots of ZeRO-1 and FSDP (and the trainer's, plain for DDP), out of tsys.h's building
// blocks (tsys_state_begin, _part_write, _commit, the reader; docs/design/state.md). A layout is a plan:
// one item per chunk this rank holds of a global tensor (a parameter, or a moment
// "optim.state.<name>.exp_avg"/".exp_avg_sq"), whether it saves it and whether it loads it, and the
// global tensors every rank's plans cover together (the strict check of a load: the snapshot holds
// exactly those). ZeRO-1: the replicated parameters whole from rank 0, each owner the moments of its
// parameters whole. FSDP: each rank the intersections of its master shard [rS, rS + S) with the
// parameters' ranges of their unit (the padding is not saved), and of its moment shards; rank 0 the
// replicated and frozen parameters and the replicated moments, whole. A load reads each item's range
// from whatever chunks hold it: any world size loads any other's snapshot.
//
// A save: rank 0 begins (the temporary's path to every rank), every rank writes its part, the sizes and
// checksums go to rank 0 in the all-reduce that agrees the status, rank 0 commits, the status of that
// is agreed too. A load: every rank checks everything it will read (names, shapes, coverage, the
// checksums of the files it reads from, the metadata), the status is agreed, then every rank writes.
// No rank goes on after a failure anywhere: all return the error.

typedef struct tsys_dist__state_item {
    char fqn[TSYS_NAME_LEN + 32];
    tsys_tensor *t;              // this rank's chunk (a view; owned)
    int ndim;
    int64_t shape[TSYS_MAX_DIMS];
    int64_t offset;
    bool save, load;
} tsys_dist__state_item;

typedef struct tsys_dist__state_global { char fqn[TSYS_NAME_LEN + 32]; int ndim; int64_t shape[TSYS_MAX_DIMS]; } tsys_dist__state_global;

typedef struct tsys_dist__state_plan {
    tsys_dist__state_item *items;
    int n, cap;
    tsys_dist__state_global *globals;
    int ng, gcap;
    bool oom;
} tsys_dist__state_plan;

static void tsys_dist__state_plan_free(tsys_dist__state_plan *p) {
    for (int i = 0; i < p->n; i++) tsys_tensor_release(p->items[i].t);
    free(p->items); free(p->globals);   // grown with realloc
    memset(p, 0, sizeof(*p));
}

static bool tsys_dist__state_grow(void **arr, int *cap, int n, size_t each) {
    if (n < *cap) return true;
    int ncap = *cap ? 2 * *cap : 32;
    void *g = realloc(*arr, each * (size_t)ncap);
    if (!g) return false;
    *arr = g; *cap = ncap;
    return true;
}

// "name" (which 0) or "optim.state.name.exp_avg" (1) / ".exp_avg_sq" (2): the names tsys_state_save uses.
static void tsys_dist__state_fqn(char *buf, size_t len, const char *name, int which) {
    if (which == 0) snprintf(buf, len, "%s", name);
    else snprintf(buf, len, "optim.state.%s.%s", name, which == 1 ? "exp_avg" : "exp_avg_sq");
}

static void tsys_dist__state_global_add(tsys_dist__state_plan *p, const tsys_tensor *param, int which) {
    if (!tsys_dist__state_grow((void **)&p->globals, &p->gcap, p->ng, sizeof(*p->globals))) { p->oom = true; return; }
    tsys_dist__state_global *g = &p->globals[p->ng++];
    tsys_dist__state_fqn(g->fqn, sizeof(g->fqn), param->name, which);
    g->ndim = param->ndim;
    memcpy(g->shape, param->shape, sizeof(g->shape));
}

// An item: elements [offset, offset + numel(view)) of the global tensor `param` (which: its values or a
// moment), held by view (the plan takes the reference).
static void tsys_dist__state_item_add(tsys_dist__state_plan *p, const tsys_tensor *param, int which, tsys_tensor *view, int64_t offset, bool save, bool load) {
    if (!view || !tsys_dist__state_grow((void **)&p->items, &p->cap, p->n, sizeof(*p->items))) { tsys_tensor_release(view); p->oom = true; return; }
    tsys_dist__state_item *it = &p->items[p->n++];
    memset(it, 0, sizeof(*it));
    tsys_dist__state_fqn(it->fqn, sizeof(it->fqn), param->name, which);
    it->t = view; it->ndim = param->ndim; it->offset = offset; it->save = save; it->load = load;
    memcpy(it->shape, param->shape, sizeof(it->shape));
}

// A whole tensor of the plan: a parameter's values, or a moment tensor of its shape (views in its shape).
static void tsys_dist__state_whole(tsys_ctx *ctx, tsys_dist__state_plan *p, const tsys_tensor *param, int which, tsys_tensor *values, bool save) {
    tsys_tensor *v = values ? tsys_tensor_view_raw(ctx, values, 0, values->dtype, param->ndim, param->shape) : NULL;
    tsys_dist__state_item_add(p, param, which, v, 0, save, true);
}

// ZeRO-1: every parameter whole, saved by rank 0 (they are replicated), loaded by all; each owner the
// moments of its parameters (its AdamW of the parameter's chunk, in the order it was built over).
static void tsys_dist__zero1_plan(tsys_zero1 *z, tsys_dist__state_plan *p) {
    tsys_ctx *ctx = z->ctx;
    const int rank = tsys_dist_rank(z->d);
    for (int i = 0; i < z->n; i++) {
        tsys_dist__state_global_add(p, z->params[i], 0);
        tsys_dist__state_whole(ctx, p, z->params[i], 0, z->params[i], rank == 0);
    }
    int index[TSYS_DIST__ZERO1_CHUNKS] = {0};
    for (int i = 0; i < z->ntp; i++) {
        for (int which = 1; which <= 2; which++) tsys_dist__state_global_add(p, z->tp[i], which);
        if (z->owner[i] != rank) continue;
        int c = z->chunk[i], k = index[c]++;
        for (int which = 1; which <= 2; which++) {
            tsys_tensor *m = tsys_optim_state(z->opt[c], k, which - 1);
            tsys_dist__state_whole(ctx, p, z->tp[i], which, m, true);
            tsys_tensor_release(m);
        }
    }
}

// FSDP: a unit's parameter k covers [off_k, off_k + n_k) of the unit's flat run, this rank's shard
// [rS, rS + S): their intersection is this rank's chunk of the parameter, and of its moments.
static void tsys_dist__fsdp_plan(tsys_fsdp *f, tsys_optim *opt, tsys_dist__state_plan *p) {
    tsys_ctx *ctx = f->ctx;
    const int rank = tsys_dist_rank(f->d);
    for (int i = 0; i < f->nu; i++) {
        tsys_dist__fsdp_unit *U = &f->u[i];
        tsys_tensor *src[3] = {tsys_tensor_retain(U->master), opt ? tsys_optim_state(opt, i, 0) : NULL, opt ? tsys_optim_state(opt, i, 1) : NULL};
        const int64_t s0 = rank * U->shard, s1 = s0 + U->shard;
        for (int k = 0; k < U->np; k++) {
            const int64_t a = U->off[k], b = a + tsys_tensor_numel(U->p[k]);
            const int64_t lo = a > s0 ? a : s0, hi = b < s1 ? b : s1;
            for (int which = 0; which < 3; which++) {
                if (which == 0 || opt) tsys_dist__state_global_add(p, U->p[k], which);
                if (lo >= hi || (which && !opt)) continue;
                int64_t n = hi - lo;
                tsys_tensor *v = src[which] ? tsys_tensor_view_raw(ctx, src[which], (size_t)(lo - s0) * 4, TSYS_F32, 1, &n) : NULL;
                tsys_dist__state_item_add(p, U->p[k], which, v, lo - a, true, true);
            }
        }
        for (int which = 0; which < 3; which++) tsys_tensor_release(src[which]);
    }
    for (int j = 0; j < f->nrep; j++)
        for (int which = 0; which < (opt ? 3 : 1); which++) {
            tsys_tensor *m = which == 0 ? tsys_tensor_retain(f->rep[j]) : tsys_optim_state(opt, f->nu + j, which - 1);
            tsys_dist__state_global_add(p, f->rep[j], which);
            tsys_dist__state_whole(ctx, p, f->rep[j], which, m, rank == 0);
            tsys_tensor_release(m);
        }
    for (int j = 0; j < f->nfrozen; j++) {
        tsys_dist__state_global_add(p, f->frozen[j], 0);
        tsys_dist__state_whole(ctx, p, f->frozen[j], 0, f->frozen[j], rank == 0);
    }
}

// Every rank's status agreed (the one all-reduce of a step): true when all are TSYS_OK. A rank that
// failed has its own message; the others get one saying what failed elsewhere.
static bool tsys_dist__state_agree(tsys_dist *d, tsys_status *st, const char *path, const char *step) {
    double bad = *st != TSYS_OK;
    tsys_status e = tsys_dist_all_reduce_host(d, &bad, 1, TSYS_DIST_SUM);
    if (e != TSYS_OK && *st == TSYS_OK) *st = e;
    if (*st == TSYS_OK && bad > 0)
        *st = tsys_ctx_set_error(tsys_dist_ctx(d), TSYS_ERR_IO, "state '%s': %s failed on %.0f other rank(s) (their messages say why)", path, step, bad);
    return *st == TSYS_OK;
}

// Rank 0's path (the temporary it began, the snapshot to resume from) to every rank, in the all-reduce
// that agrees the status (its last element: the ranks that failed).
static tsys_status tsys_dist__state_share_path(tsys_dist *d, tsys_status st, char *tmp, size_t len, const char *dir) {
    const int rank = tsys_dist_rank(d);
    double *v = (double *)calloc(len + 1, sizeof(double));
    if (!v) return tsys_ctx_set_error(tsys_dist_ctx(d), TSYS_ERR_OOM, "state '%s': out of memory", dir);   // it would not reach the all-reduce either
    for (size_t i = 0; rank == 0 && st == TSYS_OK && i < len && tmp[i]; i++) v[i] = (unsigned char)tmp[i];
    v[len] = st != TSYS_OK;
    tsys_status e = tsys_dist_all_reduce_host(d, v, (int)len + 1, TSYS_DIST_SUM);
    if (st == TSYS_OK) st = e;
    for (size_t i = 0; st == TSYS_OK && i < len; i++) tmp[i] = (char)v[i];
    tmp[len - 1] = 0;
    if (st == TSYS_OK && v[len] > 0) st = tsys_ctx_set_error(tsys_dist_ctx(d), TSYS_ERR_IO, "state '%s': rank 0 failed (its message says why)", dir);
    free(v);
    return st;
}

// This rank's part; every part's size and checksum go to rank 0 in the all-reduce that agrees the
// status (the status in the last element).
static tsys_status tsys_dist__state_write_part(tsys_dist *d, const char *tmp, const tsys_dist__state_plan *p, const tsys_state_desc *desc, tsys_state_part *parts) {
    tsys_ctx *ctx = tsys_dist_ctx(d);
    const int rank = tsys_dist_rank(d), world = tsys_dist_size(d);
    tsys_state_chunk *chunks = (tsys_state_chunk *)calloc((size_t)p->n + 1, sizeof(*chunks));
    double *v = (double *)calloc(2 * (size_t)world + 1, sizeof(double));
    if (!v) { free(chunks); return tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", tmp); }
    tsys_status st = chunks ? TSYS_OK : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", tmp);
    int n = 0;
    for (int i = 0; st == TSYS_OK && i < p->n; i++) {
        const tsys_dist__state_item *it = &p->items[i];
        if (!it->save) continue;
        tsys_state_chunk *c = &chunks[n++];
        c->fqn = it->fqn; c->t = it->t; c->ndim = it->ndim; c->offset = it->offset;
        memcpy(c->shape, it->shape, sizeof(c->shape));
    }
    char file[64];
    snprintf(file, sizeof(file), "rank-%05d.safetensors", rank);
    tsys_state_part mine;
    memset(&mine, 0, sizeof(mine));
    if (st == TSYS_OK) st = tsys_state_part_write(ctx, tmp, file, chunks, n, desc, &mine);
    if (st == TSYS_OK) { v[2 * rank] = (double)mine.bytes; v[2 * rank + 1] = (double)mine.crc32c; }   // exact: below 2^53
    v[2 * world] = st != TSYS_OK;
    tsys_status e = tsys_dist_all_reduce_host(d, v, 2 * world + 1, TSYS_DIST_SUM);
    if (st == TSYS_OK) st = e;
    if (st == TSYS_OK && v[2 * world] > 0) st = tsys_ctx_set_error(ctx, TSYS_ERR_IO, "state '%s': writing a part failed on %.0f other rank(s) (their messages say why)", tmp, v[2 * world]);
    for (int r = 0; st == TSYS_OK && r < world; r++) {
        snprintf(parts[r].file, sizeof(parts[r].file), "rank-%05d.safetensors", r);
        parts[r].bytes = (uint64_t)v[2 * r]; parts[r].crc32c = (uint32_t)v[2 * r + 1];
    }
    free(chunks); free(v);
    return st;
}

static tsys_status tsys_dist__state_save(tsys_dist *d, const char *dir, const tsys_state_desc *desc, const tsys_dist__state_plan *p, const char *layout) {
    tsys_ctx *ctx = tsys_dist_ctx(d);
    const int rank = tsys_dist_rank(d), world = tsys_dist_size(d);
    char tmp[4096] = "";
    tsys_status st = p->oom ? tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory planning the snapshot", dir) : tsys_ctx_status(ctx);
    if (world > TSYS_STATE_MAX_PARTS && st == TSYS_OK) st = tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "state '%s': %d ranks; a snapshot has at most %d parts", dir, world, TSYS_STATE_MAX_PARTS);
    if (rank == 0 && st == TSYS_OK) st = tsys_state_begin(ctx, dir, tmp, sizeof(tmp));
    st = tsys_dist__state_share_path(d, st, tmp, sizeof(tmp), dir);
    if (st != TSYS_OK) { if (rank == 0) tsys_state_abort(tmp); return st; }
    tsys_state_part *parts = (tsys_state_part *)calloc((size_t)world, sizeof(*parts));
    st = parts ? tsys_dist__state_write_part(d, tmp, p, desc, parts) : tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory", dir);
    if (rank == 0 && st == TSYS_OK) {
        tsys_state_commit_desc c;
        memset(&c, 0, sizeof(c));
        c.name = desc->name; c.step = desc->step; c.world = world; c.layout = layout; c.parts = parts; c.n_parts = world; c.keep_last = desc->keep_last;
        st = tsys_state_commit(ctx, dir, tmp, &c);   // removes tmp when it fails
    } else if (rank == 0) tsys_state_abort(tmp);
    free(parts);
    tsys_dist__state_agree(d, &st, dir, "committing the snapshot");
    return st;
}

// The snapshot holds exactly the plan's global tensors, with their shapes (dtypes: tsys_state_check_range).
static tsys_status tsys_dist__state_strict(tsys_ctx *ctx, tsys_state_reader *r, const char *path, const tsys_dist__state_plan *p) {
    int n = tsys_state_reader_count(r);
    for (int i = 0; i < n; i++) {
        int ndim;
        int64_t shape[TSYS_MAX_DIMS];
        const char *fqn = tsys_state_reader_tensor(r, i, NULL, &ndim, shape);
        int g = 0;
        while (g < p->ng && strcmp(p->globals[g].fqn, fqn)) g++;
        if (g == p->ng) return tsys_ctx_set_error(ctx, TSYS_ERR_IO, "state '%s': holds tensor '%s', which the load does not list (it is strict: the same tensors as saved)", path, fqn);
        if (p->globals[g].ndim != ndim || memcmp(p->globals[g].shape, shape, sizeof(int64_t) * (size_t)ndim))
            return tsys_ctx_set_error(ctx, TSYS_ERR_IO, "state '%s': tensor '%s' has another shape in the snapshot than in the model", path, fqn);
    }
    if (n != p->ng) return tsys_ctx_set_error(ctx, TSYS_ERR_IO, "state '%s': holds %d tensors, the load lists %d (it is strict: the same tensors as saved)", path, n, p->ng);
    return TSYS_OK;
}

// Loads the plan's items, and the host state into each of opts (one pass without an optimizer when none).
static tsys_status tsys_dist__state_load(tsys_dist *d, const char *path, const tsys_state_desc *desc, const tsys_dist__state_plan *p,
                                         tsys_optim *const *opts, int nopts, tsys_state_info *info) {
    tsys_ctx *ctx = tsys_dist_ctx(d);
    tsys_status st = p->oom ? tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "state '%s': out of memory planning the load", path) : tsys_ctx_status(ctx);
    tsys_state_reader *r = st == TSYS_OK ? tsys_state_open(ctx, path) : NULL;
    if (st == TSYS_OK && !r) st = tsys_ctx_status(ctx);
    // the RNG and the user record of this rank's part when the world size is the same, else rank 0's
    const int part = r && tsys_state_reader_world(r) == tsys_dist_size(d) ? tsys_dist_rank(d) : 0;
    if (st == TSYS_OK) st = tsys_dist__state_strict(ctx, r, path, p);
    for (int i = 0; st == TSYS_OK && i < p->n; i++) {
        const tsys_dist__state_item *it = &p->items[i];
        if (it->load) st = tsys_state_check_range(r, it->fqn, it->ndim, it->shape, it->t->dtype, it->offset, tsys_tensor_numel(it->t));
    }
    tsys_state_desc one = *desc;
    for (int k = 0; st == TSYS_OK && k < (nopts ? nopts : 1); k++) {
        one.optim = nopts ? opts[k] : NULL;
        st = tsys_state_read_host(r, part, &one, info, false);
    }
    if (tsys_dist__state_agree(d, &st, path, "checking the snapshot")) {   // checked everywhere: from here on only writes
        for (int i = 0; st == TSYS_OK && i < p->n; i++)
            if (p->items[i].load) st = tsys_state_read(r, p->items[i].fqn, p->items[i].offset, p->items[i].t);
        for (int k = 0; st == TSYS_OK && k < (nopts ? nopts : 1); k++) {
            one.optim = nopts ? opts[k] : NULL;
            st = tsys_state_read_host(r, part, &one, info, true);
        }
        tsys_dist__state_agree(d, &st, path, "reading the snapshot");
    }
    tsys_state_close(r);
    return st;
}

static bool tsys_dist__state_args_ok(tsys_ctx *ctx, const void *what, const char *path, const tsys_state_desc *desc, const char *fn) {
    if (what && path && desc) return true;
    if (ctx) tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "%s: NULL %s", fn, !path ? "path" : "desc");
    return false;
}

// ZeRO-1's optimizers on this rank (its chunks'); they share one desc and step count.
static int tsys_dist__zero1_opts(const tsys_zero1 *z, tsys_optim **opts) {
    int n = 0;
    for (int c = 0; c < TSYS_DIST__ZERO1_CHUNKS; c++) if (z->opt[c]) opts[n++] = z->opt[c];
    return n;
}

TSYSDEF tsys_status tsys_zero1_state_save(tsys_zero1 *z, const char *dir, const tsys_state_desc *desc) {
    if (!tsys_dist__state_args_ok(z ? z->ctx : NULL, z, dir, desc, "tsys_zero1_state_save")) return TSYS_ERR_INVALID_ARGS;
    tsys_dist__state_plan p;
    memset(&p, 0, sizeof(p));
    tsys_dist__zero1_plan(z, &p);
    tsys_optim *opts[TSYS_DIST__ZERO1_CHUNKS];
    tsys_state_desc mine = *desc;
    mine.optim = tsys_dist__zero1_opts(z, opts) ? opts[0] : NULL;
    mine.tensors = NULL; mine.n_tensors = 0;
    tsys_status st = tsys_dist__state_save(z->d, dir, &mine, &p, "zero1");
    tsys_dist__state_plan_free(&p);
    return st;
}

TSYSDEF tsys_status tsys_zero1_state_load(tsys_zero1 *z, const char *path, const tsys_state_desc *desc, tsys_state_info *info) {
    if (!tsys_dist__state_args_ok(z ? z->ctx : NULL, z, path, desc, "tsys_zero1_state_load")) return TSYS_ERR_INVALID_ARGS;
    tsys_dist__state_plan p;
    memset(&p, 0, sizeof(p));
    tsys_dist__zero1_plan(z, &p);
    tsys_optim *opts[TSYS_DIST__ZERO1_CHUNKS];
    tsys_state_desc mine = *desc;
    mine.tensors = NULL; mine.n_tensors = 0;
    tsys_status st = tsys_dist__state_load(z->d, path, &mine, &p, opts, tsys_dist__zero1_opts(z, opts), info);
    tsys_dist__state_plan_free(&p);
    return st;
}

// DDP's desc.shard_state: each rank saves its buckets' weights (current there, shard_masters or not) and moments;
// every rank loads every weight, and its buckets' moments.
static void tsys_dist__ddp_plan(tsys_ddp *ddp, tsys_optim *opt, tsys_dist__state_plan *p) {
    const int rank = tsys_dist_rank(ddp->d);
    for (int k = 0; k < ddp->nb; k++)
        for (int i = ddp->b[k].first; i < ddp->b[k].first + ddp->b[k].count; i++) {
            tsys_tensor *param = ddp->tp[i];
            const bool mine = ddp->owner[k] == rank;
            tsys_dist__state_global_add(p, param, 0);
            tsys_dist__state_whole(ddp->ctx, p, param, 0, param, mine);
            for (int which = 1; which <= 2; which++) {
                tsys_dist__state_global_add(p, param, which);
                tsys_tensor *m = mine ? tsys_optim_state(opt, i, which - 1) : NULL;
                if (mine && !m) p->oom = true;   // the attached optimizer holds them (tsys_optim_shard_state)
                if (m) tsys_dist__state_whole(ddp->ctx, p, param, which, m, true);
                tsys_tensor_release(m);
            }
        }
}

static bool tsys_dist__ddp_sharded(tsys_ddp *ddp, tsys_optim *opt, const char *fn) {
    if (ddp && opt && ddp->desc.shard_state && ddp->owner) return true;
    if (ddp) tsys_ctx_set_error(ddp->ctx, TSYS_ERR_INVALID_ARGS, "%s: %s", fn, !opt ? "no optimizer" : "the DDP was made without desc.shard_state, or no optimizer is attached (its state "
                                                                                                      "is whole on every rank: tsys_state_save)");
    return false;
}

TSYSDEF tsys_status tsys_ddp_state_save(tsys_ddp *ddp, tsys_optim *opt, const char *dir, const tsys_state_desc *desc) {
    if (!tsys_dist__state_args_ok(ddp ? ddp->ctx : NULL, ddp, dir, desc, "tsys_ddp_state_save") || !tsys_dist__ddp_sharded(ddp, opt, "tsys_ddp_state_save"))
        return TSYS_ERR_INVALID_ARGS;
    tsys_dist__state_plan p;
    memset(&p, 0, sizeof(p));
    tsys_dist__ddp_plan(ddp, opt, &p);
    tsys_state_desc mine = *desc;
    mine.optim = opt; mine.tensors = NULL; mine.n_tensors = 0;
    tsys_status st = tsys_dist__state_save(ddp->d, dir, &mine, &p, "ddp");
    tsys_dist__state_plan_free(&p);
    return st;
}

TSYSDEF tsys_status tsys_ddp_state_load(tsys_ddp *ddp, tsys_optim *opt, const char *path, const tsys_state_desc *desc, tsys_state_info *info) {
    if (!tsys_dist__state_args_ok(ddp ? ddp->ctx : NULL, ddp, path, desc, "tsys_ddp_state_load") || !tsys_dist__ddp_sharded(ddp, opt, "tsys_ddp_state_load"))
        return TSYS_ERR_INVALID_ARGS;
    tsys_dist__state_plan p;
    memset(&p, 0, sizeof(p));
    tsys_dist__ddp_plan(ddp, opt, &p);
    tsys_state_desc mine = *desc;
    mine.tensors = NULL; mine.n_tensors = 0;
    tsys_status st = tsys_dist__state_load(ddp->d, path, &mine, &p, &opt, 1, info);
    tsys_dist__state_plan_free(&p);
    return st;
}

TSYSDEF tsys_status tsys_fsdp_state_save(tsys_fsdp *f, const char *dir, const tsys_state_desc *desc) {
    if (!tsys_dist__state_args_ok(f ? f->ctx : NULL, f, dir, desc, "tsys_fsdp_state_save")) return TSYS_ERR_INVALID_ARGS;
    tsys_dist__state_plan p;
    memset(&p, 0, sizeof(p));
    tsys_dist__fsdp_plan(f, desc->optim, &p);
    tsys_state_desc mine = *desc;
    mine.tensors = NULL; mine.n_tensors = 0;
    tsys_status st = tsys_dist__state_save(f->d, dir, &mine, &p, "fsdp");
    tsys_dist__state_plan_free(&p);
    return st;
}

TSYSDEF tsys_status tsys_fsdp_state_load(tsys_fsdp *f, const char *path, const tsys_state_desc *desc, tsys_state_info *info) {
    if (!tsys_dist__state_args_ok(f ? f->ctx : NULL, f, path, desc, "tsys_fsdp_state_load")) return TSYS_ERR_INVALID_ARGS;
    for (int i = 0; i < f->nu; i++) tsys_dist__fsdp_release(f, i);   // weights gathered for a next forward: the masters change
    tsys_dist__state_plan p;
    memset(&p, 0, sizeof(p));
    tsys_dist__fsdp_plan(f, desc->optim, &p);
    tsys_optim *opt = desc->optim;
    tsys_state_desc mine = *desc;
    mine.tensors = NULL; mine.n_tensors = 0;
    tsys_status st = tsys_dist__state_load(f->d, path, &mine, &p, &opt, opt ? 1 : 0, info);
    tsys_dist__state_plan_free(&p);
    return st;
}

// >>trainer ---------------------------------------------------------------------------------------
struct tsys_dist_trainer {
    tsys_ctx *ctx;
    tsys_dist *d;
    tsys_model *model;
    tsys_device dev;
    tsys_dist_trainer_desc desc;
    tsys_ddp *ddp;
    tsys_zero1 *zero1;
    tsys_fsdp *fsdp;
    tsys_optim *opt;
    int64_t step;          // steps taken, counted from the step a resume restored
    int64_t eager_steps;   // eager steps this trainer took (a capture needs one: NCCL connects, FSDP's buffers appear)
    struct tsys_cuda_graph *graph;   // the captured step (tsys_dist_trainer_capture); NULL when none
    tsys_event replay_ev[2];         // a replay's start and end on the compute stream (its step_ms)
};

// desc.lowp_copies and lowp_grads: under autocast, and where the strategy keeps them (the message names the rule).
static bool tsys_dist__trainer_lowp_ok(tsys_ctx *ctx, const tsys_dist_trainer_desc *desc) {
    if (desc->opt_in_backward && desc->mode == TSYS_TRAIN_ZERO1) {
        tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_dist_trainer_new: desc.opt_in_backward is for DDP, FSDP and ALONE (ZERO1 updates its own shards after backward)");
        return false;
    }
    if (desc->ddp.shard_updates && (desc->mode != TSYS_TRAIN_DDP || !desc->opt_in_backward || !desc->ddp.ce_gather)) {
        tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_dist_trainer_new: desc.ddp.shard_updates is for DDP with ddp.ce_gather and opt_in_backward (each bucket's "
                           "owner updates it inside backward)");
        return false;
    }
    if (desc->fsdp.ce_transfers && (desc->mode != TSYS_TRAIN_FSDP || !desc->opt_in_backward)) {
        tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_dist_trainer_new: desc.fsdp.ce_transfers is for FSDP with opt_in_backward (each unit's shard is updated "
                           "inside backward, between its pulls and its pushes)");
        return false;
    }
    if (desc->ddp.shard_masters && (!desc->ddp.shard_updates || !desc->lowp_copies)) {
        tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_dist_trainer_new: desc.ddp.shard_masters needs ddp.shard_updates and lowp_copies (the peers receive the "
                           "owner's kept copies of the weights)");
        return false;
    }
    const char *what = desc->lowp_copies ? "lowp_copies" : "lowp_grads";
    const char *no = !desc->lowp_copies && !desc->lowp_grads ? NULL
                     : desc->autocast != TSYS_BF16 && desc->autocast != TSYS_F16 ? "needs bf16 or f16 autocast (desc.autocast)"
                     : desc->mode == TSYS_TRAIN_FSDP ? "is FSDP's own (its units gather in fsdp.compute_dtype and reduce-scatter in it)"
                     : desc->mode == TSYS_TRAIN_ZERO1 && desc->lowp_copies ? "is not for ZERO1 (each rank's AdamW holds only the parameters it owns, the others would still be cast every step)"
                     : NULL;
    if (no) tsys_ctx_set_error(ctx, TSYS_ERR_UNSUPPORTED, "tsys_dist_trainer_new: desc.%s %s", what, no);
    return !no;
}

// The trainer's DDP; desc.ddp.shard_masters: its model's matmul weights are the ones read only through their copies.
static tsys_ddp *tsys_dist__trainer_ddp_new(tsys_dist_trainer *t, tsys_tensor **params, int np) {
    tsys_ddp_desc dd = t->desc.ddp;
    bool *by_copy = dd.shard_masters ? (bool *)calloc((size_t)np + 1, sizeof(bool)) : NULL;
    if (dd.shard_masters && !by_copy) { tsys_ctx_set_error(t->ctx, TSYS_ERR_OOM, "tsys_dist_trainer_new: out of host memory"); return NULL; }
    for (int i = 0; by_copy && i < np; i++) by_copy[i] = tsys_model_matmul_weight(t->model, params[i]);
    dd.read_by_copy = by_copy;
    tsys_ddp *ddp = tsys_ddp_new(t->d, params, np, &dd);
    free(by_copy);
    return ddp;
}

TSYSDEF tsys_dist_trainer *tsys_dist_trainer_new(tsys_ctx *ctx, tsys_dist *d, tsys_model *model, tsys_device dev, const tsys_dist_trainer_desc *desc) {
    if (!ctx || !model || !desc || (!d && desc->mode != TSYS_TRAIN_ALONE)) {
        if (ctx) tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_new: %s", !model ? "no model" : !desc ? "no desc" : "no group");
        return NULL;
    }
    tsys_dist_trainer *t = (tsys_dist_trainer *)calloc(1, sizeof(*t));
    if (!t) { tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_dist_trainer_new: out of memory"); return NULL; }
    t->ctx = ctx; t->d = d; t->model = model; t->dev = dev; t->desc = *desc;
    if (!tsys_dist__trainer_lowp_ok(ctx, desc)) { tsys_dist_trainer_free(t); return NULL; }
    tsys_tensor **params = tsys_model_params(model);
    const int np = tsys_model_num_tensors(model);
    if (desc->mode == TSYS_TRAIN_FSDP) {
        t->fsdp = tsys_fsdp_new(d, params, np, &desc->fsdp);
        if (t->fsdp) t->opt = tsys_adamw_new(ctx, tsys_fsdp_params(t->fsdp), tsys_fsdp_num_params(t->fsdp), NULL);
        if (t->opt && desc->opt_in_backward && tsys_fsdp_optim_in_backward(t->fsdp, t->opt) != TSYS_OK) { tsys_optim_free(t->opt); t->opt = NULL; }
    } else if (desc->lowp_grads && tsys_model_set_grad_dtype(model, desc->autocast) != TSYS_OK) {
        // the context's error names the tensor
    } else if (desc->mode == TSYS_TRAIN_ALONE || (t->ddp = tsys_dist__trainer_ddp_new(t, params, np)) != NULL) {
        tsys_optim_desc od;   // the buckets' owners: the moments of this rank's buckets alone, from the start
        memset(&od, 0, sizeof od);
        od.sharded_state = desc->ddp.shard_state && desc->ddp.shard_updates && desc->ddp.ce_gather && desc->mode == TSYS_TRAIN_DDP;
        if (desc->mode == TSYS_TRAIN_ZERO1) t->zero1 = tsys_zero1_new(d, params, np, NULL);
        else t->opt = tsys_adamw_new(ctx, params, np, &od);
        if (t->opt && desc->lowp_copies && tsys_optim_keep_lowp(t->opt, desc->autocast) != TSYS_OK) { tsys_optim_free(t->opt); t->opt = NULL; }
        if (t->opt && t->ddp && desc->ddp.ce_gather && tsys_ddp_attach_optimizer(t->ddp, t->opt) != TSYS_OK) { tsys_optim_free(t->opt); t->opt = NULL; }
        if (t->zero1 && desc->ddp.ce_gather && tsys_ddp_attach_zero1(t->ddp, t->zero1) != TSYS_OK) { tsys_zero1_free(t->zero1); t->zero1 = NULL; }
        if (t->opt && t->ddp && desc->opt_in_backward && tsys_ddp_optim_in_backward(t->ddp, t->opt) != TSYS_OK) { tsys_optim_free(t->opt); t->opt = NULL; }
    }
    if (t->opt || t->zero1) return t;
    if (tsys_ctx_status(ctx) == TSYS_OK) tsys_ctx_set_error(ctx, TSYS_ERR_OOM, "tsys_dist_trainer_new: out of memory");
    tsys_dist_trainer_free(t);
    return NULL;
}

static double tsys_dist__peak(const tsys_dist_trainer *t) { return (double)tsys_mem_stats_get(t->ctx, t->dev).peak_bytes; }

static tsys_status tsys_dist__trainer_autosave(tsys_dist_trainer *t, tsys_dist_step_times *times);

// The host clock at the end of an eager step's phase, every rank synchronized first (bounded: a peer
// that dies mid-step is an error, not a hang).
static double tsys_dist__trainer_clock(tsys_dist_trainer *t) {
    if (t->d) tsys_dist_sync(t->d);
    return tsys_time_us();
}

// What a step does on the devices, in order: zero the gradients, forward (autocast), cross-entropy,
// backward with the gradients' synchronization, the optimizer step (each phase a named range: NVTX
// and the profiler see them), the tape cleared. Eager (tm given):
// the host clock after each phase into clk[1..3] and the device's peaks into tm. Captured (tm NULL):
// nothing the host would wait for, so that all of it becomes one CUDA graph.
static void tsys_dist__trainer_body(tsys_dist_trainer *t, tsys_tensor *ids, tsys_tensor *targets, double *clk, tsys_dist_step_times *tm) {
    tsys_ctx *ctx = t->ctx;
    if (t->ddp) tsys_ddp_start_step(t->ddp);
    if (t->zero1) tsys_zero1_zero_grad(t->zero1); else tsys_optim_zero_grad(t->opt);
    const bool ac = t->desc.autocast != TSYS_F32 && !t->fsdp;   // FSDP computes in its compute_dtype itself
    tsys_trace_begin(ctx, "forward");
    if (ac) tsys_autocast_begin(ctx, t->desc.autocast);
    tsys_tensor *loss = tsys_model_loss(t->model, ids, targets);   // fused with the head when the model's desc says
    if (t->desc.loss_scale != 0.0f && t->desc.loss_scale != 1.0f) {
        tsys_tensor *scaled = tsys_scale(ctx, loss, t->desc.loss_scale);
        tsys_tensor_release(loss);
        loss = scaled;
    }
    if (ac) tsys_autocast_end(ctx);
    tsys_trace_end(ctx);
    if (tm) clk[1] = tsys_dist__trainer_clock(t);
    tsys_trace_begin(ctx, "backward");
    if (t->desc.opt_in_backward) tsys_optim_overlap_begin_ex(t->opt, t->ddp || t->fsdp ? TSYS_OPTIM_CALLER_READY : 0u);   // they say when
    tsys_backward(ctx, loss);
    tsys_tensor_release(loss);
    if (t->ddp) tsys_ddp_finish(t->ddp);
    if (t->fsdp) tsys_fsdp_finish(t->fsdp);
    tsys_trace_end(ctx);
    if (tm) { clk[2] = tsys_dist__trainer_clock(t); tm->peak_pre_optim = tsys_dist__peak(t); }
    tsys_trace_begin(ctx, "optimizer");
    if (t->zero1) tsys_zero1_step(t->zero1);
    else if (t->desc.opt_in_backward) tsys_optim_overlap_end(t->opt);   // joins the updates, and makes those backward did not reach
    else tsys_optim_step(t->opt);
    tsys_trace_end(ctx);
    if (tm) { clk[3] = tsys_dist__trainer_clock(t); tm->peak_post_optim = tsys_dist__peak(t); }
    tsys_tape_clear(ctx);
}

TSYSDEF tsys_status tsys_dist_trainer_step(tsys_dist_trainer *t, tsys_tensor *ids, tsys_tensor *targets, tsys_dist_step_times *times) {
    tsys_ctx *ctx = t->ctx;
    if (t->graph)
        return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_step: a step is captured (the trainer steps by tsys_dist_trainer_replay; "
                                  "tsys_dist_trainer_uncapture to step eagerly)");
    tsys_dist_step_times tm;
    memset(&tm, 0, sizeof(tm));
    double clk[4];
    clk[0] = tsys_time_us();
    tsys_dist__trainer_body(t, ids, targets, clk, &tm);
    tm.forward_ms = (clk[1] - clk[0]) * 1e-3; tm.backward_ms = (clk[2] - clk[1]) * 1e-3; tm.optim_ms = (clk[3] - clk[2]) * 1e-3; tm.step_ms = (clk[3] - clk[0]) * 1e-3;
    if (t->ddp) tm.exposed_ms = tsys_ddp_stats_get(t->ddp).exposed_ms;
    if (times) *times = tm;
    if (tsys_ctx_status(ctx) != TSYS_OK) return tsys_ctx_status(ctx);
    t->step++; t->eager_steps++;
    return tsys_dist__trainer_autosave(t, times);
}

// ---- a captured step ----
// The step's device work, recorded once as a CUDA graph and replayed: no host clock, sync or host round
// trip may sit inside it, so the body runs without them (tm NULL), and what needs the host (the wait for
// the group, the step count, the snapshot) follows each replay.

// Do d's collectives on CUDA tensors stay on the device (NCCL, or copies in a group of one)? Host
// staging copies through host memory and waits for it, which a CUDA graph cannot hold.
static bool tsys_dist__device_collectives(const tsys_dist *d) {
    return d->launch == &tsys_dist__engine_self || (d->device && d->engine == TSYS_DIST_ENGINE_NCCL);
}

// Why t's step cannot be captured with these tensors, into why (false: it can). The same answer on every
// rank but for the tensors' device, which the caller chose.
static bool tsys_dist__trainer_uncapturable(const tsys_dist_trainer *t, const tsys_tensor *ids, const tsys_tensor *targets, char *why, size_t len) {
    if (t->dev != TSYS_CUDA) snprintf(why, len, "the trainer's device is the CPU (a CUDA graph holds CUDA work only)");
    else if (t->d && !tsys_dist__device_collectives(t->d))
        snprintf(why, len, "engine %s stages CUDA collectives through host memory (a CUDA graph cannot hold that; NCCL can, with a GPU per rank)",
                 tsys_dist_engine_name(tsys_dist_engine_of(t->d)));
    else if (t->graph) snprintf(why, len, "a step is already captured (tsys_dist_trainer_uncapture first)");
    else if (t->eager_steps < 1) snprintf(why, len, "no eager step has run yet (NCCL connects and FSDP makes its buffers in the first one)");
    else if (ids->device != TSYS_CUDA || targets->device != TSYS_CUDA) snprintf(why, len, "ids and targets must be CUDA tensors (the graph reads them in place)");
    else return false;
    return true;
}

// Every rank agrees on st: an error of another rank becomes this rank's too (code), naming what failed.
static tsys_status tsys_dist__trainer_agree(tsys_dist_trainer *t, tsys_status st, tsys_status code, const char *what) {
    if (!t->d) return st;
    double bad = st != TSYS_OK;
    tsys_status e = tsys_dist_all_reduce_host(t->d, &bad, 1, TSYS_DIST_SUM);
    if (st != TSYS_OK) return st;
    if (e != TSYS_OK) return e;
    if (bad > 0) return tsys_ctx_set_error(t->ctx, code, "tsys_dist_trainer_capture: %s on %.0f other rank(s) (their messages say why)", what, bad);
    return TSYS_OK;
}

#ifdef TSYS_CUDA_H_INCLUDED
// The capture on this rank: begun and ended on every path (an error inside still ends it), the graph kept
// only when the whole step was recorded and every collective joined the compute stream.
static tsys_status tsys_dist__trainer_record(tsys_dist_trainer *t, tsys_tensor *ids, tsys_tensor *targets) {
    tsys_ctx *ctx = t->ctx;
    tsys_status st = tsys_cuda_graph_begin(ctx);
    if (st != TSYS_OK) return st;
    tsys_dist__trainer_body(t, ids, targets, NULL, NULL);
    st = tsys_ctx_status(ctx);
    if (st == TSYS_OK && t->d && t->d->side_inflight > 0)
        st = tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_capture: %d collective(s) still in flight on the side stream at the end of "
                                "the step (a CUDA graph must join them: tsys_dist_wait each)", t->d->side_inflight);
    tsys_cuda_graph *g = NULL;
    tsys_status end = tsys_cuda_graph_end(ctx, &g);
    if (st == TSYS_OK) st = end;
    if (st != TSYS_OK) { tsys_cuda_graph_free(g); return st; }
    t->graph = g;
    return TSYS_OK;
}
#endif

TSYSDEF tsys_status tsys_dist_trainer_capture(tsys_dist_trainer *t, tsys_tensor *ids, tsys_tensor *targets) {
    if (!t) return TSYS_ERR_INVALID_ARGS;
    char why[200];
    tsys_status st = tsys_ctx_status(t->ctx);
    if (st == TSYS_OK && (!ids || !targets)) st = tsys_ctx_set_error(t->ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_capture: NULL ids or targets");
    if (st == TSYS_OK && tsys_dist__trainer_uncapturable(t, ids, targets, why, sizeof why))
        st = tsys_ctx_set_error(t->ctx, TSYS_ERR_UNSUPPORTED, "tsys_dist_trainer_capture: %s", why);
    // agreed before anything is recorded: a rank capturing alone would wait in its collectives' host checks
    st = tsys_dist__trainer_agree(t, st, TSYS_ERR_UNSUPPORTED, "the step cannot be captured");
    if (st != TSYS_OK) return st;
#ifdef TSYS_CUDA_H_INCLUDED
    st = tsys_dist__trainer_record(t, ids, targets);
#else
    st = tsys_ctx_set_error(t->ctx, TSYS_ERR_UNSUPPORTED, "tsys_dist_trainer_capture: built without CUDA (tsys_cuda.cuh)");
#endif
    st = tsys_dist__trainer_agree(t, st, TSYS_ERR_CUDA, "the capture failed");
    if (st != TSYS_OK) tsys_dist_trainer_uncapture(t);   // the graph this rank made while another's capture failed
    return st;
}

TSYSDEF tsys_status tsys_dist_trainer_replay(tsys_dist_trainer *t, tsys_dist_step_times *times) {
    if (!t) return TSYS_ERR_INVALID_ARGS;
    tsys_ctx *ctx = t->ctx;
    tsys_dist_step_times tm;
    tm.forward_ms = tm.backward_ms = tm.optim_ms = tm.step_ms = tm.exposed_ms = NAN;
    tm.peak_pre_optim = tm.peak_post_optim = NAN;
    tm.save_ms = 0;
    if (times) *times = tm;
    if (!t->graph) return tsys_ctx_set_error(ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_replay: no step is captured (tsys_dist_trainer_capture first)");
    tsys_status st = tsys_ctx_status(ctx);
#ifdef TSYS_CUDA_H_INCLUDED
    if (st == TSYS_OK) st = tsys_event_record(ctx, t->dev, TSYS_STREAM_COMPUTE, &t->replay_ev[0]);
    if (st == TSYS_OK) st = tsys_cuda_graph_replay(ctx, t->graph);
    if (st == TSYS_OK) st = tsys_event_record(ctx, t->dev, TSYS_STREAM_COMPUTE, &t->replay_ev[1]);
    // bounded on a group: a dead peer is an error within its timeout here, not a hang in the event below
    if (st == TSYS_OK) st = t->d ? tsys_dist_sync(t->d) : tsys_sync(ctx, t->dev);
    if (st == TSYS_OK) tm.step_ms = tsys_event_elapsed_ms(ctx, &t->replay_ev[0], &t->replay_ev[1]);
#endif
    if (times) *times = tm;
    if (st == TSYS_OK) st = tsys_ctx_status(ctx);
    if (st == TSYS_OK && t->ddp) st = tsys_dist__ddp_mark_stale(t->ddp);   // the graph's pushes made them so again (a sync may have cleared them)
    if (st != TSYS_OK) return st;
    t->step++;
    return tsys_dist__trainer_autosave(t, times);
}

TSYSDEF void tsys_dist_trainer_uncapture(tsys_dist_trainer *t) {
    if (!t) return;
#ifdef TSYS_CUDA_H_INCLUDED
    tsys_cuda_graph_free(t->graph);   // it waits for a replay still running
#endif
    t->graph = NULL;
}

TSYSDEF bool tsys_dist_trainer_captured(const tsys_dist_trainer *t) { return t && t->graph; }

TSYSDEF tsys_status tsys_dist_trainer_time_collectives(tsys_dist_trainer *t, double *ms) {
    *ms = 0;
    if (t->graph)   // FSDP's gathered buffers and DDP's buckets are the graph's: timing them would move or overwrite them
        return tsys_ctx_set_error(t->ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_time_collectives: a step is captured (tsys_dist_trainer_uncapture first)");
    if (t->fsdp) return tsys_fsdp_time_collectives(t->fsdp, ms);
    if (!t->ddp) return TSYS_OK;
    tsys_optim *ib = t->ddp->ib_opt;   // no optimizer step here: nothing to tell it
    t->ddp->ib_opt = NULL; t->ddp->alone = true;
    tsys_status st = tsys_ddp_start_step(t->ddp);   // finish with no backward in between reduces every bucket at once
    if (st == TSYS_OK) st = tsys_ddp_finish(t->ddp);
    t->ddp->ib_opt = ib; t->ddp->alone = false;
    if (st == TSYS_OK) st = tsys_dist_sync(t->d);
    *ms = tsys_ddp_stats_get(t->ddp).comm_ms;
    return st;
}

// DDP, ALONE: the state is replicated: rank 0 writes a plain snapshot (every rank can read it).
TSYSDEF tsys_status tsys_dist_trainer_state_save(tsys_dist_trainer *t, const char *dir, const tsys_state_desc *desc) {
    if (!t || !dir || !desc) return t ? tsys_ctx_set_error(t->ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_state_save: NULL directory or desc") : TSYS_ERR_INVALID_ARGS;
    tsys_state_desc mine = *desc;
    mine.model = t->model; mine.optim = t->opt; mine.tensors = NULL; mine.n_tensors = 0;
    if (t->zero1) { mine.optim = NULL; return tsys_zero1_state_save(t->zero1, dir, &mine); }
    if (t->fsdp) return tsys_fsdp_state_save(t->fsdp, dir, &mine);
    if (t->ddp && t->desc.ddp.shard_state) return tsys_ddp_state_save(t->ddp, t->opt, dir, &mine);   // each rank its buckets'
    tsys_status st = t->ddp ? tsys_ddp_sync_params(t->ddp) : TSYS_OK;   // shard_masters: rank 0's weights of every bucket
    if (st == TSYS_OK && t->ddp) st = tsys_ddp_sync_moments(t->ddp, t->opt);   // shard_updates: and its moments
    if (st == TSYS_OK && (!t->d || tsys_dist_rank(t->d) == 0)) st = tsys_state_save(t->ctx, dir, &mine);
    if (t->d) tsys_dist__state_agree(t->d, &st, dir, "rank 0's save");
    return st;
}

TSYSDEF tsys_status tsys_dist_trainer_state_load(tsys_dist_trainer *t, const char *path, const tsys_state_desc *desc, tsys_state_info *info) {
    if (!t || !path || !desc) return t ? tsys_ctx_set_error(t->ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_state_load: NULL path or desc") : TSYS_ERR_INVALID_ARGS;
    tsys_state_desc mine = *desc;
    mine.model = t->model; mine.optim = t->opt; mine.tensors = NULL; mine.n_tensors = 0;
    if (t->zero1) { mine.optim = NULL; return tsys_zero1_state_load(t->zero1, path, &mine, info); }
    if (t->fsdp) return tsys_fsdp_state_load(t->fsdp, path, &mine, info);
    if (t->ddp && t->desc.ddp.shard_state) return tsys_ddp_state_load(t->ddp, t->opt, path, &mine, info);
    tsys_status st = tsys_state_load(t->ctx, path, &mine, info);   // a sharded snapshot: tsys_state_consolidate it first
    if (t->d) tsys_dist__state_agree(t->d, &st, path, "loading the snapshot");
    return st;
}

// After a step: the snapshot desc.save_every asks for (outside the step's times).
static tsys_status tsys_dist__trainer_autosave(tsys_dist_trainer *t, tsys_dist_step_times *times) {
    if (t->desc.save_every <= 0 || !t->desc.save_dir || t->step % t->desc.save_every) return TSYS_OK;
    tsys_state_desc sd;
    memset(&sd, 0, sizeof(sd));
    sd.step = t->step; sd.keep_last = t->desc.keep_last;
    double t0 = tsys_time_us();
    tsys_status st = tsys_dist_trainer_state_save(t, t->desc.save_dir, &sd);
    if (times) times->save_ms = (tsys_time_us() - t0) * 1e-3;
    return st;
}

TSYSDEF tsys_status tsys_dist_trainer_resume(tsys_dist_trainer *t, const char *path, int64_t *step) {
    if (!t || !path) return t ? tsys_ctx_set_error(t->ctx, TSYS_ERR_INVALID_ARGS, "tsys_dist_trainer_resume: NULL path") : TSYS_ERR_INVALID_ARGS;
    char snap[4096] = "", manifest[4200];
    tsys_status st = tsys_ctx_status(t->ctx);
    if (!t->d || tsys_dist_rank(t->d) == 0) {
        struct stat sb;
        snprintf(manifest, sizeof(manifest), "%s/MANIFEST", path);
        if (stat(manifest, &sb) == 0) snprintf(snap, sizeof(snap), "%s", path);
        else if (st == TSYS_OK && (st = tsys_state_latest(t->ctx, path, snap, sizeof(snap))) == TSYS_OK && !snap[0])
            st = tsys_ctx_set_error(t->ctx, TSYS_ERR_IO, "resume '%s': neither a snapshot nor a directory holding one", path);
    }
    if (t->d) st = tsys_dist__state_share_path(t->d, st, snap, sizeof(snap), path);
    tsys_state_desc sd;
    memset(&sd, 0, sizeof(sd));
    tsys_state_info info;
    if (st == TSYS_OK) st = tsys_dist_trainer_state_load(t, snap, &sd, &info);
    if (st == TSYS_OK) t->step = info.step;
    if (step) *step = st == TSYS_OK ? info.step : -1;
    return st;
}

TSYSDEF int64_t tsys_dist_trainer_steps(const tsys_dist_trainer *t) { return t ? t->step : 0; }

TSYSDEF tsys_ddp *tsys_dist_trainer_ddp(const tsys_dist_trainer *t) { return t ? t->ddp : NULL; }
TSYSDEF tsys_fsdp *tsys_dist_trainer_fsdp(const tsys_dist_trainer *t) { return t ? t->fsdp : NULL; }

TSYSDEF void tsys_dist_trainer_free(tsys_dist_trainer *t) {
    if (!t) return;
    tsys_dist_trainer_uncapture(t);   // first: the graph may still be replaying into what follows
    for (int i = 0; i < 2; i++) tsys_event_release(t->ctx, &t->replay_ev[i]);
    tsys_optim_free(t->opt); tsys_zero1_free(t->zero1);   // before the DDP: under ce_gather they read its receive buffer
    tsys_ddp_free(t->ddp); tsys_fsdp_free(t->fsdp);
    free(t);
}

TSYSDEF bool tsys_dist_any_failed(tsys_dist *d, tsys_status st) {
    double bad = st != TSYS_OK;
    return tsys_dist_all_reduce_host(d, &bad, 1, TSYS_DIST_MAX) != TSYS_OK || bad != 0;
}

TSYSDEF void tsys_dist_share_cores(int ranks) {
    if (getenv("OMP_NUM_THREADS") || ranks <= 1) return;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int per = (int)(cores / ranks > 1 ? cores / ranks : 1);
    char v[16];
    snprintf(v, sizeof(v), "%d", per);
    setenv("OMP_NUM_THREADS", v, 0);
    setenv("OPENBLAS_NUM_THREADS", v, 0);
#if defined(_OPENMP) && !defined(TSYS_NO_OPENMP)
    omp_set_num_threads(per);
#endif
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(per);
#endif
}

#endif // TSYS_DIST_IMPLEMENTATION
