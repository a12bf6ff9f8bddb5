#!/usr/bin/env python3
"""state_resume_torch.py - PyTorch continues a tsys run from a tsys training-state snapshot.

tsys writes a snapshot (model.safetensors, train_state.safetensors, MANIFEST; docs/design/state.md)
and, beside it, what its own next step saw (expect.safetensors: input_ids, targets, the loss, and
after.<name>, every parameter after the step). This script checks the MANIFEST's checksums, loads the
parameters into the reference model of make_fixtures.py (the cs336 TransformerLM, fp32, CPU), the
moments and step count into torch.optim.AdamW (its state_dict names: exp_avg, exp_avg_sq, step; the
hyper-parameters from the snapshot's __metadata__), takes the same step on the same batch, and compares
the loss and every parameter with tsys's: equal within fp32 noise.

Usage (from the repository root; needs torch and safetensors):
    make build/test_state && build/test_state --export-torch /tmp/tsys_export
    python3 tests/ref/state_resume_torch.py /tmp/tsys_export
Prints "N passed, N failed" last (one check per tensor, plus the loss and the checksums).
"""
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import TransformerLM, cross_entropy  # noqa: E402  (the reference model)


def crc32c(data):
    """CRC-32C (Castagnoli, reflected 0x82F63B78), bytewise: slow, but independent of tsys's."""
    table = []
    for b in range(256):
        r = b
        for _ in range(8):
            r = (r >> 1) ^ 0x82F63B78 if r & 1 else r >> 1
        table.append(r)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def check_manifest(snap):
    """The MANIFEST's own checksum and every file's size and checksum; returns the failures."""
    text = open(os.path.join(snap, "MANIFEST"), "rb").read()
    body, last = text[: text.rindex(b"manifest_crc32c=")], text[text.rindex(b"manifest_crc32c="):]
    bad = []
    if int(last.split(b"=")[1], 16) != crc32c(body):
        bad.append("MANIFEST checksum")
    for line in body.decode().splitlines():
        if not line.startswith("file="):
            continue
        fields = dict(f.split("=") for f in line.split())
        data = open(os.path.join(snap, fields["file"]), "rb").read()
        if len(data) != int(fields["bytes"]) or crc32c(data) != int(fields["crc32c"], 16):
            bad.append(fields["file"])
    return bad


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tsys_export"
    snap = os.path.join(out, "step-000003")
    torch.set_default_dtype(torch.float32)
    passed = failed = 0

    bad = check_manifest(snap)
    print("checksums:", "ok" if not bad else "FAIL " + ", ".join(bad))
    passed, failed = passed + (not bad), failed + bool(bad)

    with safe_open(os.path.join(snap, "model.safetensors"), "pt") as f:
        dims = f.metadata()
    with safe_open(os.path.join(snap, "train_state.safetensors"), "pt") as f:
        meta = f.metadata()
    params = load_file(os.path.join(snap, "model.safetensors"))
    moments = load_file(os.path.join(snap, "train_state.safetensors"))
    expect = load_file(os.path.join(out, "expect.safetensors"))

    cfg = {k: int(dims[k]) for k in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff")}
    model = TransformerLM(rope_theta=float(dims["rope_theta"]), **cfg)
    model.load_state_dict(params, strict=True)
    assert meta["optimizer"] == "adamw", meta["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=float(meta["optim.lr"]),
                            betas=(float(meta["optim.beta1"]), float(meta["optim.beta2"])),
                            eps=float(meta["optim.eps"]), weight_decay=float(meta["optim.weight_decay"]))
    step = float(meta["optim.step"])
    for name, p in model.named_parameters():
        opt.state[p] = {"step": torch.tensor(step),
                        "exp_avg": moments[f"optim.state.{name}.exp_avg"].clone(),
                        "exp_avg_sq": moments[f"optim.state.{name}.exp_avg_sq"].clone()}
    print(f"loaded step {meta['step']} (AdamW step {int(step)}, lr {meta['optim.lr']}), user record:",
          {k[5:]: v for k, v in meta.items() if k.startswith("user.")})

    opt.zero_grad()
    loss = cross_entropy(model(expect["input_ids"].long()), expect["targets"].long())
    loss.backward()
    opt.step()

    tsys_loss = expect["loss"].reshape(()).item()
    rel = abs(loss.item() - tsys_loss) / abs(tsys_loss)
    ok = rel <= 1e-6
    print(f"loss: torch {loss.item():.9g}, tsys {tsys_loss:.9g}, relative difference {rel:.2e}", "ok" if ok else "FAIL")
    passed, failed = passed + ok, failed + (not ok)
    for name, p in model.named_parameters():
        want = expect["after." + name]
        ok = torch.allclose(p.detach(), want, rtol=1e-5, atol=1e-7)
        if not ok:
            print(f"  {name}: max |torch - tsys| {(p.detach() - want).abs().max().item():.3g} FAIL")
        passed, failed = passed + ok, failed + (not ok)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
