#!/usr/bin/env python3
# flash_sweep_table.py ATTN_CSV TORCH_JSONL [OUT_FULL_MD] - the flash_benchmarking sweep as tables: the attn
# driver's rows (tsys flash and naive) beside PyTorch SDPA's (flash, cuDNN, math) from the same device call.
# Prints, per dtype, one row per (d, seq): fwd+bwd ms of each implementation, the fastest SDPA backend, and
# its ratio to tsys flash (> 1: tsys is faster). OUT_FULL_MD gets every number (fwd, bwd, fwd+bwd, ms and
# TFLOP/s) of every implementation.
import csv, json, sys

rows = {}   # (dtype, d, seq) -> impl -> dict(fwd, bwd, tot, tf_fwd, tf_bwd, tf_tot) or error
def put(key, impl, v): rows.setdefault(key, {})[impl] = v
def num(x):
    try: return float(x)
    except (TypeError, ValueError): return None

for r in csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith("attn:")):
    impl = "tsys_" + r["impl"].split(" ")[0]
    key = (r["dtype"], int(r["d"]), int(r["seq"]))
    if r["status"] != "ok": put(key, impl, {"error": r["status"][:40]}); continue
    put(key, impl, dict(fwd=num(r["fwd_ms"]), bwd=num(r["bwd_ms"]), tot=num(r["fwd+bwd_ms"]), tf_fwd=num(r["fwd_TFLOP/s"]),
                        tf_bwd=num(r["bwd_TFLOP/s"]), tf_tot=num(r["fwd+bwd_TFLOP/s"])))
for line in open(sys.argv[2]):
    if not line.startswith("{"): continue
    r = json.loads(line)
    key = (r["dtype"], r["d"], r["seq"])
    if "error" in r: put(key, r["impl"], {"error": r["error"][:40]}); continue
    put(key, r["impl"], dict(fwd=r["fwd_ms"], bwd=r["bwd_ms"], tot=r["fwdbwd_ms"], tf_fwd=r["fwd_TFLOPs"], tf_bwd=r["bwd_TFLOPs"], tf_tot=r["fwdbwd_TFLOPs"]))

impls = ["tsys_flash", "tsys_naive", "sdpa_flash", "sdpa_cudnn", "sdpa_math"]
def cell(v, f="tot"):
    if v is None: return "-"
    if "error" in v: return "OOM" if "OOM" in v["error"] else "n/a"
    return "%.3f" % v[f]

for dt in sorted({k[0] for k in rows}):
    print("\n%s, causal, batch 1: forward + backward ms (ratio: fastest SDPA / tsys flash; > 1 means tsys is faster)\n" % dt)
    print("| d | seq | tsys flash | tsys naive | SDPA flash | SDPA cuDNN | SDPA math | fastest SDPA | ratio | flash / naive |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for key in sorted(k for k in rows if k[0] == dt):
        m = rows[key]
        sd = [(m[i]["tot"], i) for i in impls[2:] if i in m and "error" not in m[i]]
        best = min(sd) if sd else None
        fl = m.get("tsys_flash")
        nv = m.get("tsys_naive")
        ratio = "%.2f" % (best[0] / fl["tot"]) if best and fl and "error" not in fl else "-"
        sp = "%.2f" % (nv["tot"] / fl["tot"]) if nv and fl and "error" not in nv and "error" not in fl else "-"
        print("| %d | %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (key[1], key[2], *[cell(m.get(i)) for i in impls],
              best[1].replace("sdpa_", "") if best else "-", ratio, sp))

if len(sys.argv) > 3:
    with open(sys.argv[3], "w") as f:
        f.write("| dtype | d | seq | impl | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|\n")
        for key in sorted(rows):
            for i in impls:
                v = rows[key].get(i)
                if v is None: continue
                if "error" in v: f.write("| %s | %d | %d | %s | %s | | | | | |\n" % (*key, i, v["error"])); continue
                f.write("| %s | %d | %d | %s | %.3f | %.3f | %.3f | %.1f | %.1f | %.1f |\n" % (*key, i, v["fwd"], v["bwd"], v["tot"], v["tf_fwd"], v["tf_bwd"], v["tf_tot"]))
