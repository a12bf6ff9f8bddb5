#!/usr/bin/env python3
"""toy_autocast.py - the dtype rules of torch.autocast, shown on the CS336 ToyModel.

Documentation for tsys's autocast (issue 2, item 6) and its `precision` driver: prints, under
torch.autocast on the CPU for bf16 and fp16, the dtypes of the parameters, the fc1 output, the
LayerNorm output, the logits, the loss and the gradients. No fixture is written.

    python3 tests/ref/toy_autocast.py

The rule it shows (CS336 A2 benchmarking_mixed_precision (a)):
  parameters          fp32 (autocast never changes them; matmuls use low-precision copies)
  fc1 output          low precision (a matmul-class op: inputs rounded, fp32 accumulate, output rounded)
  ReLU output         low precision (follows its input)
  LayerNorm output    CUDA: fp32 (layer_norm is on CUDA autocast's fp32 list: input upcast, output fp32)
                      CPU:  low precision (CPU autocast's lists differ: layer_norm is on neither, so it
                            runs on the bf16/fp16 input and returns that dtype; torch 2.15 measured)
  logits (fc2)        low precision
  loss (cross_entropy) fp32
  gradients           fp32 (same dtype as the parameters)
tsys follows the CUDA column on every device (DESIGN.md §6: norms compute in fp32), which is also
what the CS336 handout expects. CPU autocast supports fp16 in torch >= 2.x; if this torch does not,
the script says so. Run with --device cuda on a GPU machine to see the CUDA column.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class ToyModel(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        h = self.relu(self.fc1(x))
        self.seen = {"fc1 output": h.dtype}   # ReLU keeps fc1's dtype
        h = self.ln(h)
        self.seen["layernorm output"] = h.dtype
        return self.fc2(h)


def short(dt):
    return str(dt).replace("torch.", "")


def report(device, low):
    torch.manual_seed(0)
    model = ToyModel(5, 3).to(device)
    x = torch.randn(4, 5, device=device)
    y = torch.randint(0, 3, (4,), device=device)
    try:
        with torch.autocast(device_type=device, dtype=low):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
    except (RuntimeError, AssertionError) as e:
        print(f"{device} autocast {short(low)}: not supported by this torch ({e})")
        return
    loss.backward()
    print(f"{device} autocast {short(low)} (torch {torch.__version__})")
    for n, p in model.named_parameters():
        print(f"  param {n:<18} {short(p.dtype)}")
    for k, v in model.seen.items():
        print(f"  {k:<24} {short(v)}")
    print(f"  {'logits':<24} {short(logits.dtype)}")
    print(f"  {'loss':<24} {short(loss.dtype)}")
    for n, p in model.named_parameters():
        print(f"  grad {n:<19} {short(p.grad.dtype)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    for low in (torch.bfloat16, torch.float16):
        report(args.device, low)


if __name__ == "__main__":
    main()
