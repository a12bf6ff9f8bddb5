#!/usr/bin/env python3
"""e2e_table.py - e2e JSON lines (ours, and optionally PyTorch's torch_*.jsonl) as one compact table:
   dev/e2e_table.py e2e.jsonl [torch_e2e.jsonl torch_compile.jsonl]
With PyTorch rows, each of our rows gets the matching PyTorch time and the ratio ours/torch."""
import json, sys

def rows(path):
    out = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out

MODE = {"forward": "fwd", "forward-backward": "fwdbwd", "train": "step"}
ours = rows(sys.argv[1])
torch = [r for p in sys.argv[2:] for r in rows(p)]

def peer(r):
    """PyTorch's time for our row: eager rows against eager (naive attention, the cs336 model),
    compiled rows against torch.compile (SDPA, as the baseline script measures it)."""
    mode, comp = MODE[r["mode"]], r.get("compiled") == "yes"
    for t in torch:
        if t["model"] == r["model"] and t["ctx"] == r["context"] and t["mode"] == mode and t["dtype"] == r["dtype"] and t["compiled"] == comp:
            if comp or not t["sdpa"]:
                return t
    return None

print("| model | mode | dtype | compiled | ours ms | TFLOP/s | MFU | peak MiB | torch ms | torch peak GiB | ours/torch | status |")
print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
def cell(r, key, unit=""):   # null (not applicable) prints '-'
    v = r.get(key)
    return "-" if v is None else f"{v}{unit}"

for r in ours:
    t = peer(r)
    tm = t["ms"] if t else None
    ratio = f"{r['total_ms'] / tm:.2f}" if t and tm == tm and isinstance(r.get("total_ms"), (int, float)) else ""
    print(f"| {r['model']} | {r['mode']} | {r['dtype']} | {cell(r, 'compiled')} | {cell(r, 'total_ms')} | {cell(r, 'TFLOP/s')} | {cell(r, 'MFU', '%')} | "
          f"{cell(r, 'peak_MiB')} | {tm if t else ''} | {t['peak_GiB'] if t else ''} | {ratio} | {r['status'][:40]} |")
