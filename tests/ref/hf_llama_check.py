#!/usr/bin/env python3
"""hf_llama_check.py - a Hugging Face LlamaForCausalLM checkpoint gives tsys transformers' logits and loss.

For an untied and a tied (tie_word_embeddings) model: builds a small random LlamaForCausalLM (hidden 64,
2 layers, 4 heads, vocab 128, fp32, no biases; random init only, nothing is downloaded), saves it with
save_pretrained(DIR, safe_serialization=True), runs transformers on the CPU in fp32 on a fixed batch and
writes the batch, the logits and the loss (torch's cross_entropy of the logits against the targets, the
loss tsys_cross_entropy computes) to DIR/check.safetensors. Then it runs build/test_model's
model_matches_transformers_llama with TSYS_HF_CHECK_DIR=DIR: tsys_model_desc_from_file(DIR) reads
config.json, tsys_model_load(DIR) maps the names and permutes the q/k rows, and the logits and loss must
agree to 1e-5 (max |diff| / max |ref| for the logits, relative for the loss). With build/e2e there, it
also runs `e2e --model from-file --load DIR` for one step.

    make build/test_model build/e2e
    python3 tests/ref/hf_llama_check.py [--out DIR] [--bin build]      # needs torch, transformers, safetensors

Exit status 0 when every case matches.
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM


def make_model(tied, seed):
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=tied,
        torch_dtype="float32")
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM._from_config(config, attn_implementation="eager")
    except TypeError:
        model = LlamaForCausalLM(config)
    model = model.float().eval()
    # Weights of a useful size (the default init, std 0.02, makes logits near zero): matrices
    # ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm gains around 1.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head is not tied"
    return model


def make_case(out, tied):
    model = make_model(tied, seed=1234 + tied)
    model.save_pretrained(out, safe_serialization=True)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=g, dtype=torch.int64)
    input_ids, targets = ids[:, :32].contiguous(), ids[:, 1:].contiguous()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    save_file({"input_ids": input_ids, "targets": targets, "logits": logits.contiguous(), "loss": loss.reshape(())},
              os.path.join(out, "check.safetensors"))
    print(f"{out}: tied={tied} logits {tuple(logits.shape)} max |logit| {logits.abs().max().item():.3f} loss {loss.item():.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for the checkpoints (default: a temporary one)")
    ap.add_argument("--bin", default="build", help="where test_model and e2e are (default build)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False   # the reference runs on the CPU anyway
    root = args.out or tempfile.mkdtemp(prefix="tsys_hf_check_")
    test_model = os.path.join(args.bin, "test_model")
    if not os.access(test_model, os.X_OK):
        sys.exit(f"{test_model} is missing: make {test_model}")
    failed = 0
    for tied in (False, True):
        out = os.path.join(root, "tied" if tied else "untied")
        os.makedirs(out, exist_ok=True)
        make_case(out, tied)
        env = dict(os.environ, TSYS_HF_CHECK_DIR=out)
        r = subprocess.run([test_model, "model_matches_transformers_llama"], env=env, capture_output=True, text=True)
        print(r.stdout.rstrip())
        ok = r.returncode == 0 and "1 passed, 0 failed" in r.stdout
        failed += not ok
        e2e = os.path.join(args.bin, "e2e")
        if os.access(e2e, os.X_OK):
            r = subprocess.run([e2e, "--device", "cpu", "--model", "from-file", "--load", out, "--context-length", "32",
                                "--batch-size", "2", "--warmup", "0", "--steps", "1", "--mode", "forward", "--format", "csv"],
                               capture_output=True, text=True)
            ok = r.returncode == 0
            failed += not ok
            print(f"e2e --model from-file --load {out}: {'ok' if ok else 'FAILED'}\n{r.stdout.rstrip()}\n{r.stderr.rstrip() if not ok else ''}")
    print("hf_llama_check:", "all cases match" if not failed else f"{failed} check(s) failed", f"(files in {root})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
