# Peer baseline: the CS336 flash_benchmarking sweep (batch 1, causal, seq x d x dtype) with PyTorch's SDPA
# backends (flash, cuDNN, math), timed with triton's do_bench. One JSON line per (seq, d, dtype, backend), also
# written to $RESULTS_DIR/torch_fa_sweep.jsonl; a backend that refuses a dtype or runs out of memory is a row
# with "error". fp32 math runs with PyTorch's default (allow_tf32 = False: exact fp32 matmuls).
#   python3 tests/ref/torch_fa_sweep.py [SEQS] [DS] [DTYPES]     (defaults: the sweep's lists)
import json, math, os, sys
import torch
import torch.nn.functional as F
import triton.testing as tt
from torch.nn.attention import sdpa_kernel, SDPBackend

seqs = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "128,256,512,1024,2048,4096,8192,16384,32768,65536").split(",")]
ds = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "16,32,64,128").split(",")]
dtypes = (sys.argv[3] if len(sys.argv) > 3 else "bf16,fp32").split(",")
backends = [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_math", SDPBackend.MATH)]
out = open(os.path.join(os.environ.get("RESULTS_DIR", "."), "torch_fa_sweep.jsonl"), "w")

def bench(fn):   # median ms; short runs for the long sweep
    return tt.do_bench(fn, warmup=10, rep=50, return_mode="median")

for dt_name in dtypes:
    dt = torch.bfloat16 if dt_name == "bf16" else torch.float32
    for d in ds:
        for T in seqs:
            fl = 4 * T * T * d / 2   # causal forward FLOPs, the FlashAttention convention
            for name, be in backends:
                r = dict(seq=T, d=d, dtype=dt_name, impl=name)
                q = k = v = None
                try:
                    q, k, v = (torch.randn(1, 1, T, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
                    def fwd(be=be):
                        with sdpa_kernel(be): return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    def fwdbwd():
                        fwd().sum().backward()
                    tf = bench(fwd)
                    tfb = bench(fwdbwd)
                    r.update(fwd_ms=round(tf, 4), bwd_ms=round(tfb - tf, 4), fwdbwd_ms=round(tfb, 4),
                             fwd_TFLOPs=round(fl / tf / 1e9, 2), bwd_TFLOPs=round(2.5 * fl / max(tfb - tf, 1e-6) / 1e9, 2),
                             fwdbwd_TFLOPs=round(3.5 * fl / tfb / 1e9, 2))
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    r["error"] = ("OOM" if isinstance(e, torch.OutOfMemoryError) else (msg[0] if msg else type(e).__name__))[:100]
                del q, k, v
                torch.cuda.empty_cache()
                print(json.dumps(r), flush=True)
                out.write(json.dumps(r) + "\n")
out.close()
