"""torch.distributed's side of the allreduce benchmark (CS336 distributed_communication_single_node),
with the same sizes, timing and columns as build/allreduce, so every comparison is a ratio from one
run:

    python3 tests/ref/allreduce_torch.py --backend gloo --nproc 2 --sizes 1MB,10MB,100MB,1GB
    python3 tests/ref/allreduce_torch.py --backend nccl --nproc 2 --op all_reduce,all_gather

Ranks are started with torch.multiprocessing.spawn (the handout's setup); one thread per CPU rank
(torch.set_num_threads(1), what Gloo needs). Each iteration: a barrier, the timed collective
(torch.cuda.synchronize() after it for nccl), 5 warmups. Rows (JSON lines, or a markdown table with
--format md): min/mean/max time over iterations and ranks, time = mean over iterations of the
slowest rank, algbw = bytes / time, busbw = algbw x 2(n-1)/n (all_reduce) or (n-1)/n. Sizes: KB, MB,
GB are powers of 1024, like build/allreduce.
"""
import argparse, json, os, socket, sys, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_size(s):
    mul = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    num = s.rstrip("KMGBi")
    unit = s[len(num):].replace("i", "")
    return int(float(num) * mul[unit])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, q):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group(args.backend, rank=rank, world_size=args.nproc)
    torch.set_num_threads(1)
    n = args.nproc
    dev = torch.device(f"cuda:{rank}") if args.backend == "nccl" else torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(dev)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    for op in args.op.split(","):
        for label in args.sizes.split(","):
            es = torch.tensor([], dtype=dtype).element_size()
            count = max(parse_size(label) // es, 1 if op == "all_reduce" else n)
            if op != "all_reduce":
                count = count // n * n
            if op == "all_reduce":
                x = torch.ones(count, dtype=dtype, device=dev)
                run = lambda: dist.all_reduce(x)
            elif op == "reduce_scatter":
                x = torch.ones(count, dtype=dtype, device=dev)
                y = torch.empty(count // n, dtype=dtype, device=dev)
                run = lambda: dist.reduce_scatter_tensor(y, x)
            else:
                x = torch.ones(count // n, dtype=dtype, device=dev)
                y = torch.empty(count, dtype=dtype, device=dev)
                run = lambda: dist.all_gather_into_tensor(y, x)
            times = []
            for it in range(args.warmup + args.iters):
                dist.barrier()
                t0 = time.perf_counter()
                run()
                if args.backend == "nccl":
                    torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) * 1e3
                if it >= args.warmup:
                    times.append(dt)
            gathered = [None] * n
            dist.all_gather_object(gathered, times)
            if rank == 0:
                flat = [t for r in gathered for t in r]
                slow = sum(max(r[i] for r in gathered) for i in range(args.iters)) / args.iters
                b = count * es
                algbw = b / (slow * 1e-3) / 1e9
                factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
                q.put(dict(impl="torch", backend=args.backend, op=op, dtype=args.dtype, size=label, bytes=b, ranks=n,
                           min_ms=round(min(flat), 4), mean_ms=round(sum(flat) / len(flat), 4), max_ms=round(max(flat), 4),
                           time_ms=round(slow, 4), algbw=round(algbw, 3), busbw=round(algbw * factor, 3)))
            del x
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="1MB,10MB,100MB,1GB")
    p.add_argument("--op", default="all_reduce")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--format", default="jsonl", choices=["jsonl", "md"])
    args = p.parse_args()
    for s in args.sizes.split(","):
        parse_size(s)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.spawn(worker, args=(args, free_port(), q), nprocs=args.nproc, join=True)
    rows = []
    import queue
    while True:
        try:
            rows.append(q.get(timeout=1))
        except queue.Empty:
            break
    if args.format == "md":
        cols = list(rows[0].keys()) if rows else []
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    else:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    sys.exit(main())
