# memory_torch.py - the PyTorch side of the memory driver's table: torch.cuda.max_memory_allocated()
# for the same model, context, batch, dtype and step (the cs336 model of torch_baseline.py; AdamW;
# zero_grad(set_to_none=True)), measured like drivers/memory.c: one warmup step (it makes the optimizer
# state), then the peak of one more step. Attention as the memory driver's 'auto': SDPA (flash) under
# bf16 autocast, the naive softmax(QK^T)V in fp32.
#
#   python3 tests/ref/memory_torch.py --model 2.7B --context-length 128,256,512 --mode forward,train --dtype fp32,bf16
#
# Prints one markdown row per configuration (out of memory is a row), with the columns the memory
# driver's rows are joined on: model, context, mode, dtype.
import argparse, os, sys
import torch, torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_baseline import LM, SIZES, VOCAB  # noqa: E402


def make_step(name, T, mode, dtype, B):
    """The CS336 model NAME on the GPU and one step of MODE under DTYPE: (step, model, optimizer)."""
    d, dff, L, h = SIZES[name]
    torch.manual_seed(0)
    m = LM(d, dff, L, h, sdpa=dtype == "bf16").cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4) if mode == "train" else None
    x = torch.randint(0, VOCAB, (B, T), device="cuda")
    y = torch.randint(0, VOCAB, (B, T), device="cuda")
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cuda", enabled=False)

    def step():
        if mode == "forward":
            with torch.no_grad(), ac:
                m(x)
            return
        with ac:
            loss = F.cross_entropy(m(x).view(-1, VOCAB).float(), y.view(-1))
        loss.backward()
        if opt:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            m.zero_grad(set_to_none=True)

    return step, m, opt


def peak_mib(name, T, mode, dtype, B):
    step, m, opt = make_step(name, T, mode, dtype, B)
    try:
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20, "ok"
    except torch.OutOfMemoryError:
        return float("nan"), "OOM"
    finally:
        del m, opt
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="2.7B")
    ap.add_argument("--context-length", default="128,256,512")
    ap.add_argument("--mode", default="forward,train")
    ap.add_argument("--dtype", default="fp32,bf16")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--format", choices=["md", "csv"], default="md")
    a = ap.parse_args()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", file=sys.stderr if a.format == "csv" else sys.stdout, flush=True)
    if a.format == "csv":
        print("model,context,mode,dtype,torch_peak_MiB,status", flush=True)
    else:
        print("\n| model | context | mode | dtype | torch_peak_MiB | status |\n|---|---|---|---|---|---|", flush=True)
    for name in a.model.split(","):
        for T in (int(t) for t in a.context_length.split(",")):
            for mode in a.mode.split(","):
                for dtype in a.dtype.split(","):
                    mib, status = peak_mib(name, T, mode, dtype, a.batch_size)
                    cells = [name, str(T), mode, dtype, f"{mib:.1f}", status]
                    print(",".join(cells) if a.format == "csv" else "| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
