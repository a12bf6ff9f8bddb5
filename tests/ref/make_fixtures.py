#!/usr/bin/env python3
"""make_fixtures.py - PyTorch reference fixtures for tsys's model tests.

A faithful re-implementation of cs336_basics's BasicsTransformerLM (S25 semantics, see
shared/reference/cs336_a2.md §2), written out here so the fixtures depend on nothing but torch:
Linear y = x W^T (trunc-normal init, std sqrt(2/(d_in+d_out)), cut at ±3 std), Embedding
(trunc-normal std 1, cut at ±3), RMSNorm (eps 1e-5, computed in fp32, cast back), SwiGLU
w2(silu(w1 x) * w3 x), RoPE theta 10000 on interleaved pairs (2j, 2j+1) with re-interleaved output,
causal attention (-inf mask, softmax exp(x - max) / sum), pre-norm blocks, final RMSNorm, untied
lm_head, no biases. Everything runs in plain fp32 on the CPU, so the numbers do not depend on the
machine's GPU (no TF32, no reduced-precision reductions).

Usage (from the repository root; works on any machine with torch + safetensors, e.g. the GPU one):
    python3 tests/ref/make_fixtures.py            # (re)write tests/fixtures/{model,batch}.safetensors
    python3 tests/ref/make_fixtures.py --check    # recompute batch.safetensors from the files' weights and
                                                  # tokens, compare (any torch version)
    python3 tests/ref/make_fixtures.py --out DIR  # write somewhere else

The initial weights come from torch.manual_seed(0) + trunc_normal_, whose numbers differ between torch
versions (2.11 and 2.15 give different weights), so regenerating with another torch rewrites every file.
That is harmless: the C tests take the weights and tokens from model/batch.safetensors too. The committed
files were made with the torch named in their __metadata__ ("torch").

Files written (all fp32 unless said otherwise):
  model.safetensors  the initial parameters under their PyTorch state_dict names
                     (__metadata__ holds the config as strings)
  batch.safetensors  input_ids (2,16) int64, targets (2,16) int64,
                     logits (2,16,256), loss shape [1] (the mean cross-entropy),
                     grad.<name>   d loss / d param for every parameter, at the initial weights,
                     adamw3.<name> the parameters after 3 torch.optim.AdamW steps
                                   (lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01)
                                   on the same batch; each step: zero_grad, forward, mean
                                   cross-entropy, backward, step,
                     loss_step1..3 shape [1], the loss computed in steps 1..3 (loss_step1 == loss).
"""
import argparse
import math
import os
import sys

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

CONFIG = dict(vocab_size=256, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64,
              rope_theta=10000.0, batch_size=2, seed=0)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ADAMW_STEPS = 3


# ---- modules (cs336_basics model.py, S25) --------------------------------------------------------

class Linear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        std = math.sqrt(2.0 / (d_in + d_out))
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(d_out, d_in), std=std, a=-3 * std, b=3 * std))

    def forward(self, x):
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab_size, d_model):
        super().__init__()
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(vocab_size, d_model), std=1.0, a=-3.0, b=3.0))

    def forward(self, ids):
        return self.weight[ids, :]


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        in_dtype = x.dtype
        x = x.float()   # the norm is always computed in fp32, then cast back
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * (x * rms)).to(in_dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, context_length, dim, theta=10000.0):
        super().__init__()
        d = torch.arange(0, dim, 2) / dim                       # fp32, as in cs336_basics
        freqs = theta ** -d
        t = torch.arange(context_length)
        angle = torch.outer(t, freqs)                            # (T, dim/2)
        self.register_buffer("_freq_cis_cache", torch.stack((torch.cos(angle), torch.sin(angle))), persistent=False)

    def forward(self, x, pos_ids):
        x1, x2 = x[..., 0::2], x[..., 1::2]                      # interleaved pairs (2j, 2j+1)
        cos, sin = self._freq_cis_cache[:, pos_ids]             # each (..., T, dim/2)
        y1 = cos * x1 - sin * x2
        y2 = sin * x1 + cos * x2
        return torch.stack((y1, y2), dim=-1).flatten(-2)         # re-interleaved (S25)


def softmax(x, dim):
    m = x.max(dim=dim, keepdim=True).values
    e = torch.exp(x - m)
    return e / e.sum(dim=dim, keepdim=True)


def scaled_dot_product_attention(q, k, v, mask):
    d_k = k.shape[-1]
    s = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(d_k)
    s = torch.where(mask, s, float("-inf"))
    return torch.einsum("...qk,...kd->...qd", softmax(s, -1), v)


class CausalMultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model, num_heads, rope):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model)
        self.v_proj = Linear(d_model, d_model)
        self.output_proj = Linear(d_model, d_model)
        self.positional_encoder = rope   # one module shared by all layers; no parameters, non-persistent buffer

    def _heads(self, x):   # (B, T, H*dk) -> (B, H, T, dk), head-major output rows
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, -1).transpose(1, 2)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        pos = torch.arange(t)
        q = self.positional_encoder(q, pos)
        k = self.positional_encoder(k, pos)
        qi = torch.arange(t).view(t, 1)
        kj = torch.arange(t).view(1, t)
        o = scaled_dot_product_attention(q, k, v, qi >= kj)
        return self.output_proj(o.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x):
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, rope):
        super().__init__()
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, rope)
        self.ffn = SwiGLU(d_model, d_ff)
        self.ln1 = RMSNorm(d_model)
        self.ln2 = RMSNorm(d_model)

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.ffn(self.ln2(h))


class TransformerLM(nn.Module):
    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta):
        super().__init__()
        # Registration order = cs336_basics parameters() order: embeddings, layers (q, k, v,
        # output_proj, w1, w2, w3, ln1, ln2), ln_final, lm_head.
        self.token_embeddings = Embedding(vocab_size, d_model)
        rope = RotaryEmbedding(context_length, d_model // num_heads, rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(d_model, num_heads, d_ff, rope) for _ in range(num_layers))
        self.ln_final = RMSNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size)

    def forward(self, ids):
        x = self.token_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def cross_entropy(logits, targets):
    # cs336_basics nn_utils: mean(-log_softmax(x)[target]), log_softmax = (x - max) - log(sum(exp(x - max)))
    x = logits.reshape(-1, logits.shape[-1])
    z = x - x.max(dim=-1, keepdim=True).values
    logp = z - torch.log(torch.exp(z).sum(dim=-1, keepdim=True))
    return -logp.gather(1, targets.reshape(-1, 1)).mean()


# ---- fixture generation ---------------------------------------------------------------------------

def expected_names(num_layers):
    names = ["token_embeddings.weight"]
    for i in range(num_layers):
        names += [f"layers.{i}.attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "output_proj")]
        names += [f"layers.{i}.ffn.{p}.weight" for p in ("w1", "w2", "w3")]
        names += [f"layers.{i}.ln1.weight", f"layers.{i}.ln2.weight"]
    return names + ["ln_final.weight", "lm_head.weight"]


def new_model():
    cfg = {k: CONFIG[k] for k in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta")}
    model = TransformerLM(**cfg)
    names = [n for n, _ in model.named_parameters()]
    assert names == expected_names(CONFIG["num_layers"]), names
    assert list(model.state_dict().keys()) == names
    return model


def compute(model, input_ids, targets):
    """Everything batch.safetensors holds, from the model's current weights."""
    logits = model(input_ids)
    loss = cross_entropy(logits, targets)
    loss.backward()
    batch = {"input_ids": input_ids, "targets": targets,
             "logits": logits.detach().clone(), "loss": loss.detach().reshape(1).clone()}
    for n, p in model.named_parameters():
        batch["grad." + n] = p.grad.detach().clone()

    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(1, ADAMW_STEPS + 1):
        opt.zero_grad()
        l = cross_entropy(model(input_ids), targets)
        l.backward()
        opt.step()
        batch[f"loss_step{step}"] = l.detach().reshape(1).clone()
    for n, p in model.named_parameters():
        batch["adamw3." + n] = p.detach().clone()
    return batch


def make():
    torch.manual_seed(CONFIG["seed"])
    model = new_model()
    init = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(CONFIG["seed"] + 1)
    shape = (CONFIG["batch_size"], CONFIG["context_length"])
    input_ids = torch.randint(0, CONFIG["vocab_size"], shape, generator=g, dtype=torch.int64)
    targets = torch.randint(0, CONFIG["vocab_size"], shape, generator=g, dtype=torch.int64)
    batch = compute(model, input_ids, targets)
    meta = {k: str(v) for k, v in CONFIG.items()}
    meta.update({"adamw_" + k: str(v) for k, v in ADAMW.items()}, adamw_steps=str(ADAMW_STEPS), torch=torch.__version__)
    return init, batch, meta


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(out_dir):
    """Recomputes batch.safetensors from the weights and tokens on disk and compares (relative
    L2 error per tensor, 1e-5). Independent of the torch version: the initial weights themselves
    come from torch's RNG and trunc_normal_, which differ between versions (2.11 vs 2.15), so a
    fresh init is only compared for information."""
    init = load_file(os.path.join(out_dir, "model.safetensors"))
    disk = load_file(os.path.join(out_dir, "batch.safetensors"))
    model = new_model()
    model.load_state_dict(init)
    fresh = compute(model, disk["input_ids"], disk["targets"])
    if set(disk) != set(fresh):
        print(f"batch.safetensors: names differ: {sorted(set(disk) ^ set(fresh))}")
        return 1
    worst, worst_name = 0.0, ""
    for k, v in fresh.items():
        d = disk[k]
        if d.shape != v.shape or d.dtype != v.dtype:
            print(f"batch.safetensors: {k}: {tuple(d.shape)} {d.dtype} on disk, {tuple(v.shape)} {v.dtype} now")
            return 1
        err = rel_err(v, d)
        if err > worst:
            worst, worst_name = err, k
    torch.manual_seed(CONFIG["seed"])
    same_init = all(torch.equal(p, init[n]) for n, p in new_model().named_parameters())
    print(f"recomputed from the weights on disk: worst relative error {worst:.3g} ({worst_name or '-'}); "
          f"a fresh init with this torch ({torch.__version__}) {'matches' if same_init else 'differs from'} model.safetensors")
    return 0 if worst <= 1e-5 else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
    ap.add_argument("--check", action="store_true", help="recompute and compare with the files in --out")
    args = ap.parse_args()
    torch.set_num_threads(1)   # one thread: summation order, hence the last bits, stay fixed
    torch.use_deterministic_algorithms(True)
    out = os.path.normpath(args.out)
    if args.check:
        return check(out)
    init, batch, meta = make()
    os.makedirs(out, exist_ok=True)
    save_file(init, os.path.join(out, "model.safetensors"), metadata=meta)
    save_file(batch, os.path.join(out, "batch.safetensors"), metadata=meta)
    total = sum(os.path.getsize(os.path.join(out, f)) for f in ("model.safetensors", "batch.safetensors"))
    print(f"wrote {out}/model.safetensors, batch.safetensors ({total} bytes); "
          f"loss {batch['loss'].item():.6f}, after {ADAMW_STEPS} AdamW steps "
          f"{batch[f'loss_step{ADAMW_STEPS}'].item():.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
