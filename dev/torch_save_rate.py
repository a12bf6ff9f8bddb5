#!/usr/bin/env python3
"""torch_save_rate.py - what PyTorch users pay to snapshot the same training state tsys snapshots: the
cs336 model's fp32 parameters and AdamW's exp_avg / exp_avg_sq (random values, on the GPU), saved with
torch.save (then fsync) and with torch.distributed.checkpoint (single process; its async_save where it
runs without a process group). One line per method: bytes, seconds, GB/s; the time a training loop is
held up is the call's.

  python3 dev/torch_save_rate.py --model small --dir /tmp/torch_save [--device cuda]
"""
import argparse, os, shutil, time
import torch

PRESETS = {  # d_model, d_ff, num_layers (vocab 10000), as tsys_model_desc_preset
    "small": (768, 3072, 12), "medium": (1024, 4096, 24), "large": (1280, 5120, 36), "xl": (1600, 6400, 48), "2.7B": (2560, 10240, 32)}

def state(model, device, vocab=10000):
    d, f, n = PRESETS[model]
    shapes = [("token_embeddings.weight", (vocab, d))]
    for i in range(n):
        p = f"layers.{i}."
        shapes += [(p + "attn.q_proj.weight", (d, d)), (p + "attn.k_proj.weight", (d, d)), (p + "attn.v_proj.weight", (d, d)),
                   (p + "attn.output_proj.weight", (d, d)), (p + "ln1.weight", (d,)), (p + "ln2.weight", (d,)),
                   (p + "ffn.w1.weight", (f, d)), (p + "ffn.w2.weight", (d, f)), (p + "ffn.w3.weight", (f, d))]
    shapes += [("ln_final.weight", (d,)), ("lm_head.weight", (vocab, d))]
    g = torch.Generator(device=device).manual_seed(0)
    model_sd = {k: torch.randn(s, generator=g, device=device) for k, s in shapes}
    optim_sd = {k: {"step": torch.tensor(10.0), "exp_avg": torch.randn(s, generator=g, device=device),
                    "exp_avg_sq": torch.rand(s, generator=g, device=device)} for k, s in shapes}
    nbytes = 3 * sum(t.numel() * 4 for t in model_sd.values())
    return {"model": model_sd, "optim": optim_sd}, nbytes

def fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY); os.fsync(fd); os.close(fd)
    fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=PRESETS)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    sd, nbytes = state(a.model, a.device)
    if a.device == "cuda": torch.cuda.synchronize()
    rows = []
    def timed(name, fn, path):
        shutil.rmtree(path, ignore_errors=True)
        t0 = time.perf_counter(); wait = fn(path); t_call = time.perf_counter() - t0
        if wait: wait()
        fsync_tree(path if os.path.isdir(path) else os.path.dirname(path))
        t = time.perf_counter() - t0
        rows.append((name, nbytes, t_call, t)); shutil.rmtree(path, ignore_errors=True)
        if os.path.isfile(path): os.remove(path)
    os.makedirs(a.dir, exist_ok=True)
    def torch_save(path):
        os.makedirs(path, exist_ok=True); torch.save(sd, os.path.join(path, "state.pt"))
    timed("torch.save + fsync", torch_save, os.path.join(a.dir, "pt"))
    try:
        import torch.distributed.checkpoint as dcp
        timed("torch.distributed.checkpoint.save", lambda p: dcp.save(sd, checkpoint_id=p) and None, os.path.join(a.dir, "dcp"))
        if hasattr(dcp, "async_save"):
            try:
                timed("torch.distributed.checkpoint.async_save", lambda p: dcp.async_save(sd, checkpoint_id=p).result, os.path.join(a.dir, "dcp_async"))
            except Exception as e:  # needs a process group on some versions
                rows.append(("torch.distributed.checkpoint.async_save: " + type(e).__name__ + ": " + str(e)[:80], nbytes, float("nan"), float("nan")))
    except Exception as e:
        rows.append(("torch.distributed.checkpoint: " + type(e).__name__ + ": " + str(e)[:80], nbytes, float("nan"), float("nan")))
    print(f"torch {torch.__version__}, {a.model} state on {a.device}")
    print("| method | bytes | call s | durable s | GB/s |\n|---|---:|---:|---:|---:|")
    for name, b, tc, t in rows:
        print(f"| {name} | {b / 1e9:.2f} GB | {tc:.2f} | {t:.2f} | {b / 1e9 / t:.2f} |")

if __name__ == "__main__":
    main()
