#!/usr/bin/env python3
"""torch_ddp.py - the PyTorch side of tsys's data-parallel comparisons, in one run on one machine.

Measures, with the columns of tsys's `allreduce` and `ddp` drivers so that every comparison is a
ratio of numbers taken in the same run:
  allreduce  torch.distributed.all_reduce (sum, float32, in place) on 1, 10, 100, 1000 MB, 5 warmups,
             then --iters timed calls after a barrier each; min/mean/max over iterations and ranks,
             algbw = bytes / time, busbw = algbw * 2(n-1)/n (the nccl-tests convention). Gloo on CPU
             tensors, NCCL on CUDA tensors (--backend gloo,nccl).
  ddp        the cs336 LM (tests/ref/torch_baseline.py's) trained with AdamW, batch --batch-size per rank,
             context --context-length, for each --dtype x --attn x --compile, and the strategies of the
             CS336 handout and FSDP2:
               naive     all_reduce of each gradient after backward
               flat      one all_reduce of torch._utils._flatten_dense_tensors(grads), unflattened back
               overlap   an async all_reduce from each parameter's post-accumulate-grad hook
               bucketed  torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=B) for each --bucket-mb
               zero1     DDP (25 MB buckets) + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
               fsdp2     torch.distributed.fsdp.fully_shard on each transformer block, then on the root
                         (default resharding: blocks re-gathered in backward, the root kept); under bf16
                         MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and no autocast (as
                         torchtitan), under fp32 no policy. Every rank builds the same weights from seed 0 on
                         the host; fully_shard moves its shards to the device.
             --attn naive|sdpa (a list): the LM's own causal attention, or
             torch.nn.functional.scaled_dot_product_attention(is_causal=True); --sdpa = --attn sdpa.
             --compile no|yes (a list): yes runs the model under torch.compile (inductor, default mode):
             for naive, flat, overlap, bucketed and zero1 the whole LM by model.compile() before the DDP
             wrapper (the placement the torch.compile docs recommend; DDP's graph splitting at bucket
             boundaries applies); for fsdp2 each transformer block by torch.compile(block, fullgraph=True)
             before fully_shard, as torchtitan does, so FSDP's hooks run eagerly around compiled blocks.
             Each compiled row starts from torch._dynamo.reset(); compilation (forward and backward)
             happens in the first warmup step, which is raised to 2 when compiled; a row whose timed
             steps still compiled says so in status. The optimizer is not compiled.
             Columns: step_ms (the slowest rank's, mean and std over steps), bwd_comm_ms (backward +
             gradient synchronization), opt_ms, comm_ms (the step's communication alone, nothing to
             overlap: one flat all-reduce of all gradients; for fsdp2 the step's collectives at their
             real sizes, per unit an all-gather of its padded shards in param dtype for forward, again
             for backward on the blocks, and a reduce-scatter of its gradients in fp32), peak memory
             after init / before / after the first optimizer step (CUDA: torch.cuda.max_memory_allocated;
             CPU: not measured), attn and compiled (to match rows with tsys's).
             (The LM fuses q, k, v in one Linear: the same parameter count as tsys's, one tensor fewer
             per layer, so bucket contents differ slightly.)

Usage (the GPU machine has torch; CPU ranks work anywhere torch is installed):
    torchrun --nproc_per_node 2 tests/ref/torch_ddp.py --part allreduce --backend gloo,nccl
    torchrun --nproc_per_node 2 tests/ref/torch_ddp.py --part ddp --device cuda --model xl --dtype fp32,bf16
    torchrun --nproc_per_node 2 tests/ref/torch_ddp.py --part ddp --device cpu --model small --steps 3 --warmup 1
    torchrun --nproc_per_node 4 tests/ref/torch_ddp.py --part ddp --device cuda --model small,xl,2.7B --dtype bf16 \
        --strategy bucketed,zero1,fsdp2 --bucket-mb 25 --attn naive,sdpa --compile no,yes
Output: markdown (default), csv or jsonl on rank 0.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MiB = 1048576.0
STRATEGIES = ("naive", "flat", "overlap", "bucketed", "zero1", "fsdp2")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", default="allreduce,ddp")
    p.add_argument("--backend", default=None, help="allreduce: gloo,nccl (default: gloo, plus nccl with GPUs)")
    p.add_argument("--sizes-mb", default="1,10,100,1000")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default=None, help="ddp: cpu (gloo) or cuda (nccl); default cuda when available")
    p.add_argument("--model", default=None, help="small..2.7B, a list (default: xl on cuda, small on cpu)")
    p.add_argument("--strategy", default="naive,flat,overlap,bucketed,zero1", help="also fsdp2")
    p.add_argument("--bucket-mb", default="1,10,100,1000")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--context-length", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--attn", default=None, help="naive,sdpa (a list; default naive)")
    p.add_argument("--sdpa", action="store_true", help="the same as --attn sdpa")
    p.add_argument("--compile", default="no", help="no,yes (a list): the model under torch.compile")
    p.add_argument("--format", default="md", choices=["md", "csv", "jsonl"])
    a = p.parse_args()
    if a.sdpa and a.attn not in (None, "sdpa"):
        p.error("--sdpa is --attn sdpa; give one of them")
    a.attn = a.attn or ("sdpa" if a.sdpa else "naive")
    for flag, vals, ok in (("--attn", a.attn, ("naive", "sdpa")), ("--compile", a.compile, ("no", "yes")),
                           ("--strategy", a.strategy, STRATEGIES)):
        bad = [v for v in vals.split(",") if v not in ok]
        if bad:
            p.error(f"{flag}: unknown {','.join(bad)} (known: {','.join(ok)})")
    return a


class Table:
    def __init__(self, cols, fmt, rank):
        self.cols, self.fmt, self.rank, self.rows = cols.split(","), fmt, rank, []

    def add(self, row):
        self.rows.append(row)
        if self.rank != 0 or self.fmt == "md":
            return
        if self.fmt == "csv":
            if len(self.rows) == 1:
                print(",".join(self.cols))
            print(",".join(str(row.get(c, "")) for c in self.cols), flush=True)
        else:
            import json
            print(json.dumps({c: row.get(c, "") for c in self.cols}), flush=True)

    def done(self):
        if self.rank != 0 or self.fmt != "md":
            return
        print("| " + " | ".join(self.cols) + " |")
        print("|" + "---|" * len(self.cols))
        for r in self.rows:
            print("| " + " | ".join(str(r.get(c, "")) for c in self.cols) + " |")
        print(flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def gather_floats(values, dev):
    """All ranks' lists of floats, on every rank (as all_gather_object would, without pickling)."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def part_allreduce(args, rank, world, backends):
    tab = Table("backend,device,ranks,size_MB,min_ms,mean_ms,max_ms,algbw_GBs,busbw_GBs", args.format, rank)
    for be in backends:
        group = dist.new_group(backend=be)
        dev = torch.device("cuda", torch.cuda.current_device()) if be == "nccl" else torch.device("cpu")
        for mb in [float(s) for s in args.sizes_mb.split(",")]:
            n = int(mb * 1e6) // 4
            x = torch.ones(n, dtype=torch.float32, device=dev)
            for _ in range(5):
                dist.all_reduce(x, group=group)
            sync(dev)
            ts = []
            for _ in range(args.iters):
                dist.barrier(group=group)
                sync(dev)
                t0 = time.perf_counter()
                dist.all_reduce(x, group=group)
                sync(dev)
                ts.append(time.perf_counter() - t0)
            allts = [t for r in gather_floats(ts, dev) for t in r]
            mean = statistics.mean(allts)
            algbw = n * 4 / mean / 1e9
            tab.add(dict(backend=be, device=dev.type, ranks=world, size_MB=mb, min_ms=round(min(allts) * 1e3, 3),
                         mean_ms=round(mean * 1e3, 3), max_ms=round(max(allts) * 1e3, 3), algbw_GBs=round(algbw, 3),
                         busbw_GBs=round(algbw * 2 * (world - 1) / world, 3)))
            del x
        dist.destroy_process_group(group)
    tab.done()


def grads_of(model):
    return [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]


def flat_allreduce(grads, world):
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world
    for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(s)


def compile_unavailable(dev):
    """Why torch.compile's inductor cannot build kernels for dev here, or None."""
    import importlib.util
    import shutil
    if dev.type == "cuda":
        return None if importlib.util.find_spec("triton") else "inductor needs triton for CUDA kernels; it is not installed"
    cxx = os.environ.get("CXX")
    if (cxx and shutil.which(cxx)) or any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return None
    return "inductor needs a C++ compiler for CPU kernels (g++, c++, clang++ or $CXX); none found"


def compile_events():
    """Counts that grow whenever dynamo captures a frame or AOTAutograd/inductor compiles a graph."""
    from torch._dynamo.utils import counters
    return (counters["frames"]["total"] + counters["aot_autograd"]["total"]
            + sum(counters["inductor"].values()))


def part_ddp(args, rank, world, dev):
    from torch_baseline import SIZES
    tab = Table("device,model,ranks,strategy,bucket_mb,dtype,attn,compiled,context,batch,step_ms,step_std,bwd_comm_ms,opt_ms,"
                "comm_ms,comm_frac,mem_init_MiB,mem_pre_opt_MiB,mem_post_opt_MiB,status", args.format, rank)
    models = (args.model or ("xl" if dev.type == "cuda" else "small")).split(",")
    unknown = [m for m in models if m not in SIZES]
    if unknown:
        sys.exit(f"torch_ddp.py: --model: unknown {','.join(unknown)} (known: {','.join(SIZES)})")
    configs = []
    for s in args.strategy.split(","):
        for b in (args.bucket_mb.split(",") if s == "bucketed" else ["-"]):
            configs.append((s, b))
    compiles = args.compile.split(",")
    no_compile = compile_unavailable(dev) if "yes" in compiles else None
    if no_compile and rank == 0:
        print(f"torch_ddp.py: --compile yes: {no_compile}; those rows are skipped", file=sys.stderr, flush=True)
    for model in models:
        for dtype in args.dtype.split(","):
            for attn in args.attn.split(","):
                for compiled in compiles:
                    for strategy, bucket in configs:
                        row = dict(device=dev.type, model=model, ranks=world, strategy=strategy, bucket_mb=bucket, dtype=dtype,
                                   attn=attn, compiled=compiled, context=args.context_length, batch=args.batch_size)
                        if compiled == "yes" and no_compile:
                            row["status"] = "skipped: " + no_compile
                            tab.add(row)
                            continue
                        try:
                            row.update(run_ddp(args, rank, world, dev, model, strategy, bucket, dtype, attn, compiled == "yes"))
                        except torch.cuda.OutOfMemoryError as e:
                            row["status"] = "OOM: " + str(e).split("\n")[0][:80]
                        except Exception as e:   # noqa: BLE001 - a compile failure ends its row, not the run
                            if compiled != "yes":
                                raise
                            msg = f"{type(e).__name__}: " + (str(e).strip().split("\n") or [""])[0][:160]
                            row["status"] = "compile failed: " + msg
                            if rank == 0:
                                print(f"torch_ddp.py: {model} {strategy} {dtype} {attn} under torch.compile failed: {msg}",
                                      file=sys.stderr, flush=True)
                        if compiled == "yes":
                            torch._dynamo.reset()
                        tab.add(row)
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()
    tab.done()


_meshes = {}


def shard_fsdp2(m, dev, world, dtype, compiled):
    """FSDP2 as torchtitan applies it: (compile each block,) fully_shard each block, then the root.
    Returns the units' parameter shapes (root first) for the collectives' sizes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if dev.type not in _meshes:
        _meshes[dev.type] = init_device_mesh(dev.type, (world,))
    mesh = _meshes[dev.type]
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bf16"
          else MixedPrecisionPolicy())
    units = [[p.shape for n, p in m.named_parameters() if not n.startswith("blocks.")]]
    for i in range(len(m.blocks)):
        units.append([p.shape for p in m.blocks[i].parameters()])
        if compiled:
            m.blocks[i] = torch.compile(m.blocks[i], fullgraph=True)
        fully_shard(m.blocks[i], mesh=mesh, mp_policy=mp)
    fully_shard(m, mesh=mesh, mp_policy=mp)
    return units


def fsdp2_comm_ms(units, world, dev, dtype):
    """The collectives of one FSDP2 step timed alone: per unit an all-gather of its padded shards in the param
    dtype (forward; again in backward for the blocks, which reshard after forward while the root does not)
    and a reduce-scatter of its gradients in fp32; the slowest rank's mean of 3, in seconds."""
    pdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    sizes = []
    for shapes in units:
        n = 0
        for sh in shapes:   # fully_shard pads dim 0 to a multiple of the ranks
            rest = 1
            for k in sh[1:]:
                rest *= k
            n += -(-sh[0] // world) * rest
        sizes.append(n)
    big = max(sizes)
    shard, full = torch.zeros(big, dtype=pdt, device=dev), torch.zeros(big * world, dtype=pdt, device=dev)
    gfull, gshard = torch.zeros(big * world, dtype=torch.float32, device=dev), torch.zeros(big, dtype=torch.float32, device=dev)

    def step():
        for n in sizes:                                     # forward: every unit
            dist.all_gather_into_tensor(full[:n * world], shard[:n])
        for n in reversed(sizes[1:]):                       # backward: the blocks again, then every unit's gradients
            dist.all_gather_into_tensor(full[:n * world], shard[:n])
        for n in reversed(sizes):
            dist.reduce_scatter_tensor(gshard[:n], gfull[:n * world])
    step()
    calls = []
    for _ in range(3):
        dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        step()
        sync(dev)
        calls.append(time.perf_counter() - t0)
    return max(r[0] for r in gather_floats([statistics.mean(calls)], dev))


def run_ddp(args, rank, world, dev, model_name, strategy, bucket, dtype, attn, compiled):
    import torch_baseline
    from torch_baseline import LM, SIZES, VOCAB
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.optim import ZeroRedundancyOptimizer as ZeRO
    d, dff, L, h = SIZES[model_name]
    cuda = dev.type == "cuda"
    fsdp = strategy == "fsdp2"
    if compiled:
        torch._dynamo.reset()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch_baseline.dev = dev.type   # its RoPE cache is made on this device type (the current CUDA device)
    torch.manual_seed(0)
    m = LM(d, dff, L, h, sdpa=(attn == "sdpa"))
    units = None
    if fsdp:   # built alike on every rank from seed 0 on the host; fully_shard moves each unit to dev as it shards it
        units = shard_fsdp2(m, dev, world, dtype, compiled)
    else:
        m = m.to(dev)
        for p in m.parameters():   # every rank starts from rank 0's weights
            dist.broadcast(p.data, 0)
        if compiled:   # the inner module, before DDP wraps it
            m.compile()
    handles = []
    if strategy == "bucketed":
        net = DDP(m, device_ids=[dev.index] if cuda else None, bucket_cap_mb=float(bucket))
    elif strategy == "zero1":
        net = DDP(m, device_ids=[dev.index] if cuda else None)
    else:
        net = m
    if strategy == "overlap":
        def hook(p):
            handles.append(dist.all_reduce(p.grad, async_op=True))
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(hook)
    opt = ZeRO(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4) if strategy == "zero1" else torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, VOCAB, (args.batch_size, args.context_length), generator=g).to(dev)
    y = torch.randint(0, VOCAB, (args.batch_size, args.context_length), generator=g).to(dev)
    # fsdp2 computes in its MixedPrecisionPolicy's param dtype instead of under autocast
    ac = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=(dtype == "bf16" and not fsdp))
    mem = [torch.cuda.max_memory_allocated() / MiB if cuda else float("nan")] + [float("nan")] * 2
    warmup = max(args.warmup, 2) if compiled else args.warmup   # the first step compiles forward and backward
    tstep, tbwd, topt = [], [], []
    events = None
    for i in range(warmup + args.steps):
        if compiled and i == warmup:
            events = compile_events()
        sync(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with ac:
            logits = net(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB).float(), y.view(-1))
        sync(dev)
        t1 = time.perf_counter()
        loss.backward()
        if strategy == "naive":
            for p in m.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        elif strategy == "flat":
            flat_allreduce(grads_of(m), world)
        elif strategy == "overlap":
            for hd in handles:
                hd.wait()
            handles.clear()
            for p in m.parameters():
                if p.grad is not None:
                    p.grad /= world
        sync(dev)
        t2 = time.perf_counter()
        if i == 0 and cuda:
            mem[1] = torch.cuda.max_memory_allocated() / MiB
        opt.step()
        sync(dev)
        t3 = time.perf_counter()
        if i == 0 and cuda:
            mem[2] = torch.cuda.max_memory_allocated() / MiB
        if i >= warmup:
            tstep.append(t3 - t0); tbwd.append(t2 - t1); topt.append(t3 - t2)
        del logits, loss
    recompiled = compiled and compile_events() != events
    recompiled = max(r[0] for r in gather_floats([float(recompiled)], dev)) > 0
    status = "ok"
    if fsdp:   # the step's collectives alone at FSDP2's sizes
        try:
            alone = fsdp2_comm_ms(units, world, dev, dtype)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            alone = None
            status = "ok; comm_ms not measured: " + str(e).split("\n")[0][:80]
    else:   # the step's gradient all-reduces alone
        grads = grads_of(m)
        calls = []
        for _ in range(3):
            dist.barrier()
            sync(dev)
            t0 = time.perf_counter()
            flat_allreduce(grads, world)
            sync(dev)
            calls.append(time.perf_counter() - t0)
        alone = max(r[0] for r in gather_floats([statistics.mean(calls)], dev))
    if recompiled:
        status += "; recompiled during the timed steps"
    per_rank = gather_floats(tstep + tbwd + topt, dev)
    n = args.steps
    worst = [max(r[j] for r in per_rank) for j in range(3 * n)]
    step, bwd, optt = worst[:n], worst[n:2 * n], worst[2 * n:]
    mem = [max(r[j] for r in gather_floats(mem, dev)) for j in range(3)]
    mstep = statistics.mean(step)
    return dict(step_ms=round(mstep * 1e3, 2), step_std=round(statistics.stdev(step) * 1e3 if n > 1 else 0, 2),
                bwd_comm_ms=round(statistics.mean(bwd) * 1e3, 2), opt_ms=round(statistics.mean(optt) * 1e3, 2),
                comm_ms="" if alone is None else round(alone * 1e3, 2), comm_frac="" if alone is None else round(alone / mstep, 3),
                mem_init_MiB=round(mem[0], 1), mem_pre_opt_MiB=round(mem[1], 1), mem_post_opt_MiB=round(mem[2], 1),
                status=status)


def main():
    args = parse()
    if "RANK" not in os.environ:
        sys.exit("torch_ddp.py: run it under torchrun (torchrun --nproc_per_node 2 tests/ref/torch_ddp.py ...)")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    have_cuda = torch.cuda.is_available()
    if have_cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    devname = args.device or ("cuda" if have_cuda else "cpu")
    dist.init_process_group("cpu:gloo,cuda:nccl" if have_cuda else "gloo")
    if devname == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if rank == 0:
        print(f"torch {torch.__version__}, {world} ranks, {torch.get_num_threads()} threads per rank"
              + (f", {torch.cuda.get_device_name()}" if have_cuda else "") + "\n", flush=True)
    parts = args.part.split(",")
    if "allreduce" in parts:
        backends = (args.backend or ("gloo,nccl" if have_cuda else "gloo")).split(",")
        part_allreduce(args, rank, world, backends)
    if "ddp" in parts:
        dev = torch.device("cuda", torch.cuda.current_device()) if devname == "cuda" else torch.device("cpu")
        part_ddp(args, rank, world, dev)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
