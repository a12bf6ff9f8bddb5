#!/usr/bin/env python3
"""torch_tp.py - the PyTorch side of tsys's 2-D layouts (the mesh driver's rows), torchtitan-style.

The cs336 LM with q, k, v as separate Linears (as torchtitan's Llama), on a DeviceMesh ("dp", "tp"):
  tp       parallelize_module: q, k, v, w1, w3 ColwiseParallel, o and w2 RowwiseParallel, the LM head
           ColwiseParallel with its logits sharded on the vocabulary and loss_parallel() around the loss
  fsdp_tp  the same, then fully_shard over "dp" on each block and on the root
  fsdp     fully_shard over all ranks (no tp)
  hsdp     fully_shard on a ("replicate", "shard") mesh: sharded over "shard", replicated over "replicate"
bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under FSDP, autocast for tp alone. AdamW,
batch --batch-size per dp replica, the slowest rank's mean step over --steps after --warmup. One row per layout,
columns: layout, dp, tp, model, context, batch, step_ms, peak_MiB (as the mesh driver's).

Usage (CPU ranks work anywhere torch is installed, through gloo):
    torchrun --nproc_per_node 4 tests/ref/torch_tp.py --device cuda --model 2.7B --context-length 1024 --layout tp:4,fsdp_tp:2,fsdp:1,hsdp:2
    torchrun --nproc_per_node 2 tests/ref/torch_tp.py --device cpu --model tiny --context-length 16 --steps 2 --warmup 1
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

SIZES = {"tiny": (48, 96, 2, 12), "small": (768, 3072, 12, 12), "xl": (1600, 6400, 48, 25), "2.7B": (2560, 10240, 32, 32)}
VOCAB = 10000


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w).to(dt)


def rope(x, cos, sin):  # interleaved pairs (2i, 2i+1), x (B, H, T, hd)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d, dff, hd):
        super().__init__()
        self.hd = hd
        self.ln1, self.ln2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, dff, bias=False), nn.Linear(d, dff, bias=False)
        self.w2 = nn.Linear(dff, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.ln1(x)
        # -1: this rank's heads under tensor parallelism (the projections' local outputs)
        q, k, v = (p(h).view(B, T, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, -1))
        y = self.ln2(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class LM(nn.Module):
    def __init__(self, d, dff, L, h):
        super().__init__()
        self.hd = d // h
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d, dff, self.hd) for _ in range(L)])
        self.lnf = RMSNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        inv = 1.0 / 10000.0 ** (torch.arange(0, self.hd, 2, device=idx.device).float() / self.hd)
        ang = torch.outer(torch.arange(T, device=idx.device).float(), inv)
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, ang.cos(), ang.sin())
        return self.head(self.lnf(x))


def shard_tp(model, tp_mesh):
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    for b in model.blocks:
        parallelize_module(b, tp_mesh, plan)
    parallelize_module(model, tp_mesh, {"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def build(args, layout, split, world, dev):
    d, dff, L, h = SIZES[args.model]
    torch.manual_seed(0)
    model = LM(d, dff, L, h).to(dev)
    bf16 = args.dtype == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    dt = "cuda" if dev.type == "cuda" else "cpu"
    tp = split if layout in ("tp", "fsdp_tp") else 1
    dp = world // tp
    mesh = init_device_mesh(dt, (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        shard_tp(model, mesh["tp"])
    if layout in ("fsdp", "fsdp_tp"):
        fmesh = mesh["dp"] if layout == "fsdp_tp" else init_device_mesh(dt, (world,), mesh_dim_names=("dp",))
        for b in model.blocks:
            fully_shard(b, mesh=fmesh, mp_policy=mp)
        fully_shard(model, mesh=fmesh, mp_policy=mp)
    elif layout == "hsdp":
        hmesh = init_device_mesh(dt, (world // split, split), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=hmesh, mp_policy=mp)
        fully_shard(model, mesh=hmesh, mp_policy=mp)
    return model, dp, tp, mesh


def run(args, layout, split, rank, world, dev):
    model, dp, tp, mesh = build(args, layout, split, world, dev)
    # tp alone leaves the embedding and the norms plain tensors beside the DTensor shards: torch 2.11's foreach
    # AdamW refuses the mix, so that layout steps parameter by parameter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False if layout == "tp" else None)
    autocast = args.dtype == "bf16" and layout == "tp"
    # every rank of a tp group the same batch; each dp replica its own
    g = torch.Generator().manual_seed(1 + (rank // tp if layout in ("tp", "fsdp_tp") else rank))
    ids = torch.randint(0, VOCAB, (args.batch_size, args.context_length), generator=g).to(dev)
    tgt = torch.randint(0, VOCAB, (args.batch_size, args.context_length), generator=g).to(dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids)
        if tp > 1:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ms = torch.tensor([(time.perf_counter() - t0) * 1e3 / args.steps,
                       torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else 0.0], device=dev)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    lv = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
    if rank == 0:
        ndp = world // split if layout == "hsdp" else dp
        print(f"| torch {layout} | {ndp} | {split if layout == 'hsdp' else tp} | {args.model} | {args.context_length} | "
              f"{args.batch_size} | {ms[0].item():.1f} | {ms[1].item():.0f} | loss {lv:.4f} |", flush=True)
    del model, opt


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="2.7B", choices=sorted(SIZES))
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--context-length", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--layout", default="tp:4,fsdp_tp:2,fsdp:1,hsdp:2", help="LAYOUT:SPLIT, a list (SPLIT: tp size, or hsdp's shard size)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if rank == 0:
        print(f"torch {torch.__version__}, {world} ranks, {dev.type}")
        print("| layout | dp | tp | model | context | batch | step_ms | peak_MiB | note |")
        print("|---|---:|---:|---|---:|---:|---:|---:|---|")
    for item in args.layout.split(","):
        layout, split = item.split(":")
        if world % int(split):
            raise SystemExit(f"torch_tp.py: {item}: {split} does not divide the {world} ranks")
        run(args, layout, int(split), rank, world, dev)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
