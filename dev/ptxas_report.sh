#!/usr/bin/env bash
# ptxas_report.sh - what ptxas says about each kernel of a CUDA source, as one table: registers, spill bytes and
# whether its wgmmas were serialized (C7512: not enough registers for the wgmma pipeline) or fenced (C7519:
# warpgroup.arrive injected). No GPU needed: compile-only, for sm_90a. A kernel change that brings back a C7512
# costs its overlap of matmuls and math (docs/design/flash.md, "Serialized wgmmas at d 128").
#   dev/ptxas_report.sh [SOURCE.cu] [FILTER] [extra nvcc flags...]
#   dev/ptxas_report.sh dev/flash_lab.cu dkdv_ws            # the dK/dV kernels of the lab's build
# SOURCE defaults to dev/flash_lab.cu (every flash kernel the entry points can pick); FILTER keeps the kernels
# whose mangled name contains it. The raw ptxas output goes to $OUT/ptxas.log. Exit 3 when a listed kernel has
# serialized wgmmas, 1 when the build fails, 2 on bad arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tsys_out}; mkdir -p "$OUT"
src=${1:-dev/flash_lab.cu}; filter=${2:-}; shift $(( $# > 2 ? 2 : $# ))
[ -f "$src" ] || { echo "ptxas_report: no source '$src'" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "ptxas_report: nvcc is not on PATH" >&2; exit 2; }
obj=$(mktemp --suffix=.o); trap 'rm -f "$obj"' EXIT
nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -DTSYS_WITH_CUDA -DTSYS_NO_CBLAS -I. -Xptxas -v -c "$src" -o "$obj" "$@" \
  > "$OUT/ptxas.log" 2>&1 || { tail -20 "$OUT/ptxas.log"; echo "ptxas_report: nvcc failed (log: $OUT/ptxas.log)" >&2; exit 1; }
# ptxas prints, per kernel: "Compiling entry function 'NAME'", then its stack/spill line and "Used N registers";
# C75xx warnings name the function they are about.
awk -v filter="$filter" '
  /Compiling entry function/ { match($0, /'"'"'[^'"'"']*'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2); order[++n] = name }
  /bytes spill stores/ && name != "" { spill[name] = $5 }
  /Used [0-9]+ registers/ && name != "" { match($0, /Used [0-9]+ registers/); regs[name] = substr($0, RSTART + 5, RLENGTH - 15) }
  /C7512/ { match($0, /function '"'"'[^'"'"']*'"'"'/); f = substr($0, RSTART + 10, RLENGTH - 11); c7512[f] = 1 }
  /C7519/ { match($0, /function '"'"'[^'"'"']*'"'"'/); f = substr($0, RSTART + 10, RLENGTH - 11); c7519[f]++ }
  END {
    printf "| kernel (mangled) | registers | spill bytes | wgmmas serialized (C7512) | arrives injected (C7519) |\n|---|---:|---:|---|---:|\n"
    for (i = 1; i <= n; i++) {
      k = order[i]; if (filter != "" && index(k, filter) == 0) continue
      if (seen[k]++) continue
      printf "| %s | %s | %s | %s | %d |\n", k, regs[k], spill[k], (k in c7512) ? "YES" : "no", c7519[k] + 0
      bad += (k in c7512)
    }
    printf "\n%d kernel(s) with serialized wgmmas\n", bad
    exit bad ? 3 : 0
  }' "$OUT/ptxas.log"
