# The CS336 leaderboard shape (16 heads x 16384, bf16, causal) through PyTorch SDPA's flash and cuDNN
# backends: same method as ../shared/reference/torch/torch_fa.py (triton do_bench, median), fewer rows,
# so that it fits in the same device call as dev/flash_lab.cu; the last row is the S26 leaderboard step's attention
# (32 heads x 32768, d 128, one sequence a GPU). Prints one JSON line per row.
import json, torch
import triton.testing as tt
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
for (H, T, d) in [(16, 16384, 64), (16, 16384, 128), (32, 32768, 128)]:
    q, k, v = torch.randn(3, 1, H, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fl = 4 * H * T * T * d / 2
    for name, be in [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)]:
        def f(be=be):
            with sdpa_kernel(be): return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        def fb():
            o = f(); o.sum().backward()
        try:
            tf = tt.do_bench(f, warmup=200, rep=1000, return_mode="median")
            tfb = tt.do_bench(fb, warmup=200, rep=1000, return_mode="median")
            r = dict(H=H, T=T, d=d, impl=name, fwd_ms=round(tf, 3), fwdbwd_ms=round(tfb, 3),
                     fwd_TFLOPs=round(fl / tf / 1e9, 1), fwdbwd_TFLOPs=round(3.5 * fl / tfb / 1e9, 1))
        except Exception as e:
            r = dict(H=H, T=T, d=d, impl=name, error=str(e)[:120])
        print(json.dumps(r), flush=True)
        q.grad = k.grad = v.grad = None
