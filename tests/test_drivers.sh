#!/usr/bin/env bash
# test_drivers.sh BINDIR - the drivers (BINDIR/e2e, attn, precision, memory; ddp, mesh and allreduce where
# built) as a user, and a hostile one, runs them: rows printed as they are measured (markdown too), exit
# codes (0 ok, 1 a row failed, 2 bad usage), --oom-ok, --mem-limit on every driver, the budget under a
# cgroup and shared by the ranks of a host, strict flags and lists, --load on a FIFO or a directory, the
# CPU MFU column, '-' for phases a mode does not have, the precision prose, results that cannot be
# written (stdout on a full disk, output files past a size limit: exit 1, no partial file).
# Run by make test twice: on build/ and on build/asan/ (ASan + UBSan + LeakSanitizer, where any
# sanitizer report fails the test that caused it, so error exits must not leak).
# Prints "N passed, N failed" last, like the C tests.
#
#   tests/test_drivers.sh build [name-filter]
set -u
B=${1:-build}
filter=${2:-}
for d in e2e attn precision memory; do
  [ -x "$B/$d" ] || { echo "test_drivers: $B/$d is missing (make $B/$d)"; echo "0 passed, 1 failed"; exit 1; }
done
tmp=$(mktemp -d /tmp/tsys_drivers_XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export TSYS_PROGRESS=0

# A model small enough to run in milliseconds, even under ASan.
MODEL=(--model custom --d-model 16 --num-layers 1 --num-heads 2 --d-ff 32 --vocab-size 64 --batch-size 1 --warmup 0 --steps 2)
TINY=("${MODEL[@]}" --no-sgemm)

why=""        # reasons the running test failed
note() { why="$why"$'\n'"      $*"; }

# run CMD...: stdout in $tmp/out, stderr in $tmp/err, exit status in $rc (124: it hung past 120 s).
# A sanitizer report fails the running test whatever the command was expected to do.
run() {
  timeout 120 "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  if grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error:|SUMMARY: (Address|Undefined|Leak)' "$tmp/err"; then
    note "sanitizer report from: $*"
    note "$(grep -m3 -E 'ERROR|runtime error|SUMMARY' "$tmp/err")"
  fi
  [ $rc -eq 124 ] && note "timed out: $*"
  return 0
}
expect_rc() { [ "$rc" -eq "$1" ] || note "exit status $rc, wanted $1 ($2); stderr: $(head -c 300 "$tmp/err")"; }
expect_in() {   # file pattern what
  grep -qE -- "$2" "$1" || note "$3: no match for '$2' in $(basename "$1"): $(head -c 300 "$1")"
}
expect_not_in() { ! grep -qE -- "$2" "$1" || note "$3: unexpected '$2' in $(basename "$1")"; }

# csv_col FILE ROW COLUMN: the cell of data row ROW (1-based) under header COLUMN (no quoted commas).
csv_col() {
  awk -F, -v row="$2" -v col="$3" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == col) c = i; next }
                                    NR - 1 == row { print (c ? $c : "NO-COLUMN") }' "$1"
}
# expect_cells FILE "ROW COLUMN VALUE" ...: each cell of the csv holds its value
expect_cells() {
  local f=$1 c v
  shift
  for c in "$@"; do
    set -- $c
    v=$(csv_col "$f" "$1" "$2")
    [ "$v" = "$3" ] || note "row $1 $2 = '$v', wanted '$3'"
  done
}

# ---- rows and exit codes -------------------------------------------------------------------------

# Markdown: header first, then each row the moment it is measured (flushed), so a sweep that is
# killed keeps its finished rows. The second row (context 4096) takes seconds: the first must be
# out while it runs.
t_markdown_rows_stream() {
  : >"$tmp/stream"
  "$B/e2e" "${TINY[@]}" --steps 20 --context-length 8,4096 --mode forward >"$tmp/stream" 2>"$tmp/err" &
  local pid=$! seen=0
  for _ in $(seq 1 600); do
    if grep -q '^| cpu | custom | 8 |' "$tmp/stream" && ! grep -q '^| cpu | custom | 4096 |' "$tmp/stream"; then
      kill -0 $pid 2>/dev/null && seen=1; break
    fi
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
  done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  [ $seen = 1 ] || note "the first row was not printed while the second was being measured: $(cat "$tmp/stream")"
  local h r
  h=$(grep -n '^| device | model |' "$tmp/stream" | head -1 | cut -d: -f1)
  r=$(grep -n '^| cpu | custom | 8 |' "$tmp/stream" | head -1 | cut -d: -f1)
  [ -n "$h" ] && [ -n "$r" ] && [ "$h" -lt "$r" ] || note "no markdown header before the first row (header line '$h', row line '$r')"
  [ "$(grep -c '^| device | model |' "$tmp/stream")" -le 1 ] || note "the header was printed more than once"
}

t_csv_and_jsonl_stream_too() {
  run "$B/e2e" "${TINY[@]}" --context-length 8,16 --format csv
  expect_rc 0 "two ok rows"
  [ "$(grep -c '^device,model,' "$tmp/out")" = 1 ] || note "csv: one header wanted: $(cat "$tmp/out")"
  [ "$(grep -c '^cpu,custom,' "$tmp/out")" = 2 ] || note "csv: two rows wanted"
  expect_not_in "$tmp/out" '^e2e:|^cpu:' "csv: configuration lines belong on stderr"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --format jsonl
  expect_rc 0 "an ok row"
  expect_in "$tmp/out" '^\{"device": "cpu", "model": "custom", "context": 8,.*"status": "ok"\}$' "jsonl row"
  [ "$(wc -l <"$tmp/out")" = 1 ] || note "jsonl: stdout must hold the row only"
}

t_exit_1_when_a_row_fails() {
  run "$B/e2e" "${TINY[@]}" --context-length 8 --load "$tmp/no_such.safetensors"
  expect_rc 1 "a load error is a failed row"
  expect_in "$tmp/out" '\| error: safetensors .*no_such.safetensors.*cannot open' "the error row"
  expect_in "$tmp/err" 'rows failed' "the summary on stderr"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --num-heads 3
  expect_rc 1 "an invalid model is a failed row"
  expect_in "$tmp/out" '\| error: .*num_heads' "the error row names the rule"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --compile yes
  expect_rc 0 "a row skipped by design is not a failure"
  expect_in "$tmp/out" '\| skipped: ' "the skipped row"
}

# Out of memory on the CPU is a row (the budget is --mem-limit), exit 1, or 0 under --oom-ok.
t_oom_row_and_oom_ok() {
  run "$B/e2e" "${TINY[@]}" --context-length 8,2048 --mem-limit 0.01
  expect_rc 1 "an OOM row without --oom-ok"
  expect_in "$tmp/out" '^\| cpu \| custom \| 8 \|.*\| ok \|$' "the row that fits"
  expect_in "$tmp/out" '^\| cpu \| custom \| 2048 \|.*\| OOM: out of memory' "the OOM row"
  expect_in "$tmp/err" '\-\-oom-ok' "the summary points at --oom-ok"
  run "$B/e2e" "${TINY[@]}" --context-length 8,2048 --mem-limit 0.01 --oom-ok
  expect_rc 0 "OOM rows are expected under --oom-ok"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --mem-limit 0.01 --oom-ok --load "$tmp/no_such.safetensors"
  expect_rc 1 "--oom-ok does not excuse errors"
  # the 2.7B training step: out of memory at once under a small budget, never a kill
  run "$B/e2e" --model 2.7B --mode train --context-length 128 --warmup 0 --steps 1 --no-sgemm --mem-limit 0.05
  expect_rc 1 "2.7B under 0.05 GiB"
  expect_in "$tmp/out" '\| 2.7B \|.*\| OOM: out of memory' "the 2.7B OOM row"
  run "$B/attn" --seq 64,4096 --d 16 --batch 1 --warmup 0 --reps 1 --impl naive --mem-limit 0.01
  expect_rc 1 "attn: an OOM row"
  expect_in "$tmp/out" '\| naive \| 1 \| 0 \| 64 \|.*\| ok \|$' "attn: the row that fits"
  expect_in "$tmp/out" '\| naive \| 1 \| 0 \| 4096 \|.*\| OOM: ' "attn: the OOM row"
  run "$B/attn" --seq 64,4096 --d 16 --batch 1 --warmup 0 --reps 1 --impl naive --mem-limit 0.01 --oom-ok
  expect_rc 0 "attn: --oom-ok"
  run "$B/precision" --mem-limit 0.0000001
  expect_rc 1 "precision: the ToyModel out of memory"
  expect_in "$tmp/out" 'OOM: out of memory' "precision: the OOM line"
}

# ---- flags ------------------------------------------------------------------------------------------

t_unknown_flag_is_usage_error() {
  for d in e2e attn precision memory; do
    run "$B/$d" --bogus
    expect_rc 2 "$d --bogus"
    expect_in "$tmp/err" "unknown flag '--bogus'" "$d --bogus"
    expect_not_in "$tmp/err" 'needs a value' "$d --bogus"
  done
  run "$B/e2e" --model
  expect_rc 2 "e2e --model without a value"
  expect_in "$tmp/err" '\-\-model needs a value' "a known flag without its value"
}

t_empty_lists_and_items() {
  local args
  for args in "e2e --context-length" "e2e --model" "e2e --mode" "e2e --dtype" "e2e --attn" "e2e --compile" \
              "attn --seq" "attn --d" "attn --dtype" "attn --causal" "memory --context-length" "memory --mode" "memory --dtype"; do
    set -- $args
    run "$B/$1" "$2" ''
    expect_rc 2 "$1 $2 ''"
    expect_in "$tmp/err" "$2 needs at least one value" "$1 $2 ''"
    run "$B/$1" "$2" 'x,,y'
    expect_rc 2 "$1 $2 x,,y"
    run "$B/$1" "$2" ','
    expect_rc 2 "$1 $2 ,"
  done
  run "$B/e2e" --context-length 8,
  expect_rc 2 "e2e --context-length 8,"
  expect_in "$tmp/err" 'empty value in --context-length' "a trailing comma"
}

t_list_longer_than_64_is_an_error() {
  run "$B/e2e" --context-length "$(seq -s, 1 65)" --dry-run
  expect_rc 2 "65 context lengths"
  expect_in "$tmp/err" '\-\-context-length lists 65 values; at most 64' "65 items"
  run "$B/attn" --seq "$(seq -s, 1 100)" --dry-run
  expect_rc 2 "100 sequence lengths"
  expect_in "$tmp/err" '\-\-seq lists 100' "attn: 100 items"
  run "$B/e2e" --context-length "$(seq -s, 1 64)" --dry-run
  expect_rc 0 "64 context lengths are fine"
  expect_in "$tmp/out" "context 1,2,3,.*,63,64;" "all 64 in the configuration line"
  local x64
  x64=$(printf 'fp32%.0s,' $(seq 64)); x64=${x64%,}
  run "$B/e2e" --context-length "$(seq -s, 1 64)" --dtype "$x64" --mode "${x64//fp32/forward}" --attn naive,naive,naive,naive,naive --dry-run
  expect_rc 2 "64 x 64 x 64 x 5 configurations"
  expect_in "$tmp/err" 'more than 1048576 configurations' "the sweep's size is bounded too"
}

t_mem_limit_is_strict() {
  local v d
  for d in e2e attn precision memory; do
    for v in inf -inf nan -1 1e30 1048577 1e400 0x10 ' 1' '' 1GB 2,5; do
      run "$B/$d" --mem-limit "$v" --dry-run
      expect_rc 2 "$d --mem-limit '$v'"
      expect_in "$tmp/err" '\-\-mem-limit takes a number of GiB from 0 to 1048576' "$d --mem-limit '$v'"
    done
  done
  run "$B/attn" --mem-limit 2.5 --dry-run
  expect_rc 0 "attn --mem-limit 2.5"
  expect_in "$tmp/out" 'memory limit 2.5 GiB' "the cap in the configuration line"
  run "$B/attn" --dry-run
  expect_in "$tmp/out" 'memory limit default \(available memory\)' "no cap claimed by default"
  run "$B/e2e" --mem-limit 0 --dry-run
  expect_rc 0 "e2e --mem-limit 0 (the default)"
  expect_in "$tmp/out" 'memory limit default' "0 = the default"
}

t_help_documents_exit_codes_and_memory() {
  for d in e2e attn precision memory; do
    run "$B/$d" --help
    expect_rc 0 "$d --help"
    expect_in "$tmp/out" '\-\-mem-limit GIB' "$d --help: --mem-limit"
    expect_in "$tmp/out" 'available' "$d --help: the default budget"
    expect_in "$tmp/out" 'exit status: 0 .*, 1 ' "$d --help: exit codes 0 and 1"
    expect_in "$tmp/out" ', 2 bad usage' "$d --help: exit code 2"
    expect_in "$tmp/out" '\-\-oom-ok' "$d --help: --oom-ok"
  done
}

# Error exits free what they made: under ASan, LeakSanitizer would change the status and report.
t_error_exits_do_not_leak() {
  run "$B/e2e" --attn bogus
  expect_rc 2 "e2e --attn bogus"
  expect_in "$tmp/err" "bad value 'bogus' in --attn" "the message names the flag"
  run "$B/e2e" --mode forward,backward
  expect_rc 2 "e2e --mode backward"
  run "$B/e2e" --model small,huge
  expect_rc 2 "e2e --model huge"
  expect_in "$tmp/err" "bad value 'huge' in --model" "an unknown preset"
  run "$B/attn" --causal 0,2
  expect_rc 2 "attn --causal 2"
  run "$B/attn" --sweep nope
  expect_rc 2 "attn --sweep nope"
  run "$B/attn" --flash-fp32 tf16
  expect_rc 2 "attn --flash-fp32 tf16"
  expect_in "$tmp/err" "flash-fp32 takes tf32 or exact, not 'tf16'" "the message names --flash-fp32 and its values"
  run "$B/attn" --flash-fp32 exact --dry-run
  expect_rc 0 "attn --flash-fp32 exact"
  expect_in "$tmp/out" "flash fp32 exact" "the configuration line says which fp32 flash kernel"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --load /
  expect_rc 1 "e2e --load /"
}

# ---- --load on what is not a safetensors file --------------------------------------------------------

t_load_fifo_fails_fast() {
  mkfifo "$tmp/pipe.safetensors" || { note "mkfifo failed"; return; }
  timeout 10 "$B/e2e" "${TINY[@]}" --context-length 8 --load "$tmp/pipe.safetensors" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -ne 124 ] || note "--load on a FIFO hung"
  expect_rc 1 "--load FIFO"
  expect_in "$tmp/out" 'FIFO' "the error names what the path is"
}

t_load_directory_is_named() {
  mkdir -p "$tmp/dir.safetensors"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --load "$tmp/dir.safetensors"
  expect_rc 1 "--load DIR"
  expect_in "$tmp/out" 'is a directory' "the error says it is a directory"
  expect_not_in "$tmp/out" '9223372036854775807' "a directory is no file of LONG_MAX bytes"
}

# ---- columns ----------------------------------------------------------------------------------------

# st_model FILE [META]: a checkpoint of the MODEL dims (zeros) whose __metadata__ holds META (by
# default the dims, as tsys_model_save writes them).
st_model() {
  local meta=${2-'"vocab_size":"64","context_length":"8","d_model":"16","d_ff":"32","num_layers":"1","num_heads":"2","rope_theta":"10000","eps":"1e-05"'}
  local hdr="{\"__metadata__\":{\"format\":\"pt\"${meta:+,$meta}}" at=0 n e
  for e in token_embeddings.weight:64,16 layers.0.attn.q_proj.weight:16,16 layers.0.attn.k_proj.weight:16,16 \
           layers.0.attn.v_proj.weight:16,16 layers.0.attn.output_proj.weight:16,16 layers.0.ffn.w1.weight:32,16 \
           layers.0.ffn.w2.weight:16,32 layers.0.ffn.w3.weight:32,16 layers.0.ln1.weight:16 layers.0.ln2.weight:16 \
           ln_final.weight:16 lm_head.weight:64,16; do
    n=$(( $(echo "${e#*:}" | tr , '*') * 4 ))
    hdr+=",\"${e%%:*}\":{\"dtype\":\"F32\",\"shape\":[${e#*:}],\"data_offsets\":[$at,$((at + n))]}"
    at=$((at + n))
  done
  hdr+='}'
  local len=${#hdr}
  { printf "$(printf '\\x%02x' $((len & 255)) $(((len >> 8) & 255)) 0 0 0 0 0 0)"; printf '%s' "$hdr"; head -c $at /dev/zero; } >"$1"
}

t_model_from_file() {
  st_model "$tmp/dims.safetensors"
  run "$B/e2e" --model from-file --load "$tmp/dims.safetensors" --context-length 8 --batch-size 1 --warmup 0 --steps 1 --no-sgemm --format csv
  expect_rc 0 "e2e --model from-file"
  expect_in "$tmp/out" '^cpu,from-file,8,1,.*,ok$' "a row of the file's model"
  run "$B/e2e" --model from-file --context-length 8 --dry-run
  expect_rc 2 "--model from-file without --load"
  expect_in "$tmp/err" 'needs --load' "the message says what from-file needs"
  run "$B/e2e" --model from-file --load "$tmp/dims.safetensors" --d-model 32 --dry-run
  expect_rc 2 "--model from-file with explicit dims"
  st_model "$tmp/nodims.safetensors" ''
  run "$B/e2e" --model from-file --load "$tmp/nodims.safetensors" --context-length 8 --batch-size 1 --warmup 0 --steps 1 --no-sgemm
  expect_rc 1 "--model from-file on a file without dims"
  expect_in "$tmp/out" 'nodims.safetensors.*lacks "vocab_size"' "the error names the file and the key"
}

t_cpu_e2e_has_mfu() {
  run "$B/e2e" "${MODEL[@]}" --context-length 8 --format csv
  expect_rc 0 "e2e with the sgemm measurement"
  expect_in "$tmp/out" '^device,.*,GFLOP/s,MFU,saved_MiB,pred_MiB,peak_MiB,note,status$' "the CPU header has MFU and its note"
  expect_in "$tmp/err" 'CBLAS sgemm .* GFLOP/s \(1024\^3, best of 3, spread [0-9]+%\)' "the reference rate and its spread"
  local m
  m=$(csv_col "$tmp/out" 1 MFU)
  [[ "$m" =~ ^[0-9]+\.[0-9]$ ]] || note "MFU cell '$m', wanted a number (percent)"
  # the note is empty unless the MFU passes 100% or the reference's repetitions spread past 20%
  local nt
  nt=$(csv_col "$tmp/out" 1 note)
  if awk -v m="$m" 'BEGIN { exit !(m > 100) }'; then [[ "$nt" == *"MFU above 100%"* ]] || note "MFU $m% without its note: '$nt'"
  else [[ -z "$nt" || "$nt" == "reference GEMM spread "* ]] || note "note '$nt' for MFU $m%"; fi
  run "$B/e2e" "${TINY[@]}" --context-length 8 --format csv
  m=$(csv_col "$tmp/out" 1 MFU)
  [ -z "$m" ] || note "--no-sgemm: MFU '$m', wanted empty"
}

t_phases_a_mode_lacks_read_dash() {
  run "$B/e2e" "${TINY[@]}" --context-length 8 --mode forward,forward-backward,train --format csv
  expect_rc 0 "three modes"
  local c want
  for c in "1 bwd_ms NA" "1 bwd_std NA" "1 opt_ms NA" "2 opt_ms NA" "3 opt_ms NUM" "2 bwd_ms NUM" "1 fwd_ms NUM"; do
    set -- $c
    want=$3
    local v
    v=$(csv_col "$tmp/out" "$1" "$2")
    if [ "$want" = NUM ]; then [[ "$v" =~ ^[0-9]+\.[0-9]+$ ]] || note "row $1 $2 = '$v', wanted a number"
    else [ -z "$v" ] || note "row $1 $2 = '$v', wanted empty (not applicable)"; fi
  done
  # not applicable is '-' in markdown and null in jsonl
  run "$B/e2e" "${TINY[@]}" --context-length 8 --mode forward
  expect_in "$tmp/out" '^\| cpu \| custom \| 8 \| 1 \| forward \|.*\| [0-9.]+ \| [0-9.]+ \| - \| - \| - \| [0-9.]+ \|' "md: '-' for bwd_ms, bwd_std, opt_ms"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --mode forward --format jsonl
  expect_in "$tmp/out" '"bwd_ms": null, "bwd_std": null, "opt_ms": null' "jsonl: null for bwd_ms, bwd_std, opt_ms"
}

# --lowp-copies is a sweep column: train mode under bf16/fp16 runs with the copies, fp32 is a
# skipped row (autocast has nothing to read them), and the column says which row is which.
t_lowp_copies_column() {
  run "$B/e2e" "${TINY[@]}" --context-length 8 --mode train --dtype fp32,bf16 --lowp-copies no,yes --format csv
  expect_rc 0 "four rows"
  expect_cells "$tmp/out" "1 lowp_copies no" "2 lowp_copies yes" "3 lowp_copies no" "4 lowp_copies yes" "1 status ok" "3 status ok" "4 status ok"
  expect_in "$tmp/out" 'skipped: --lowp-copies applies to train mode under bf16/fp16' "the fp32 row with copies"
  expect_in "$tmp/err" 'lowp-copies no,yes' "the configuration line"
}

# --opt-in-backward free: the same step with each layer's gradients given back after its update; its
# peak is below the ordinary step's by about the gradients, and the plan predicts both within 10%.
# fused (the linear weights updated inside their gradients' products) runs and is predicted as well.
t_opt_in_backward_free_grads() {
  run "$B/e2e" --model custom --d-model 128 --num-layers 8 --num-heads 2 --d-ff 512 --vocab-size 64 --batch-size 2 --warmup 0 --steps 1 --no-sgemm \
      --context-length 16 --mode train --opt-in-backward no,free,fused --format csv
  expect_rc 0 "e2e --opt-in-backward no,free,fused"
  [ "$(csv_col "$tmp/out" 2 opt_in_bwd)" = "free" ] || note "row 2 opt_in_bwd '$(csv_col "$tmp/out" 2 opt_in_bwd)', wanted free"
  [ "$(csv_col "$tmp/out" 3 opt_in_bwd)" = "fused" ] || note "row 3 opt_in_bwd '$(csv_col "$tmp/out" 3 opt_in_bwd)', wanted fused"
  [ "$(csv_col "$tmp/out" 3 status)" = "ok" ] || note "row 3 status '$(csv_col "$tmp/out" 3 status)'"
  local i p m no free
  for i in 1 2 3; do
    p=$(csv_col "$tmp/out" $i pred_MiB); m=$(csv_col "$tmp/out" $i peak_MiB)
    awk -v p="$p" -v m="$m" 'BEGIN { exit !(p > 0.9 * m && p < 1.1 * m) }' || note "row $i: predicted peak $p MiB, measured $m"
  done
  no=$(csv_col "$tmp/out" 1 peak_MiB); free=$(csv_col "$tmp/out" 2 peak_MiB)
  awk -v a="$free" -v b="$no" 'BEGIN { exit !(a < 0.9 * b) }' || note "peak with gradients freed in backward $free MiB, ordinary $no"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --opt-in-backward sometimes
  expect_rc 2 "a bad --opt-in-backward"
  expect_in "$tmp/err" 'no, yes, free or fused' "the rule"
}

# --lowp-grads keeps the linear weights' gradients in the autocast dtype: under bf16 the peak is below
# the fp32-gradient row's by about 2 bytes a linear weight, both within 5% of their predicted peaks;
# fp32 and fp16 training are skipped rows naming why.
t_lowp_grads_column() {
  run "$B/e2e" --model custom --d-model 256 --num-layers 8 --num-heads 2 --d-ff 1024 --vocab-size 64 --batch-size 2 --warmup 0 --steps 1 --no-sgemm \
      --context-length 16 --mode train --dtype fp32,bf16,fp16 --lowp-grads no,yes --format csv
  expect_rc 0 "six rows"
  local i p m
  expect_cells "$tmp/out" "1 lowp_grads no" "4 lowp_grads yes" "3 status ok" "4 status ok"
  expect_in "$tmp/out" 'skipped: --lowp-grads applies to backward under bf16/fp16' "the fp32 row"
  expect_in "$tmp/out" 'skipped: fp16 loss scaling unscales the gradients in place' "the fp16 training row"
  for i in 3 4; do
    p=$(csv_col "$tmp/out" $i pred_MiB); m=$(csv_col "$tmp/out" $i peak_MiB)
    awk -v p="$p" -v m="$m" 'BEGIN { exit !(p > 0.95 * m && p < 1.05 * m) }' || note "row $i: predicted peak $p MiB, measured $m"
  done
  # 8 layers x (4 x 256^2 + 3 x 256 x 1024) + 64 x 256 linear weights, 2 bytes each fewer (16 MiB) where every
  # gradient is alive; the peak of the bf16 row may lie elsewhere
  awk -v a="$(csv_col "$tmp/out" 4 peak_MiB)" -v b="$(csv_col "$tmp/out" 3 peak_MiB)" 'BEGIN { d = (b - a) * 1048576; exit !(d > 0.75 * 2 * 8404992 && d < 1.1 * 2 * 8404992) }' \
    || note "bf16 gradients saved $(csv_col "$tmp/out" 3 peak_MiB) - $(csv_col "$tmp/out" 4 peak_MiB) MiB, expected ~16"
  expect_in "$tmp/err" 'lowp-grads no,yes' "the configuration line"
}

t_precision_prose_matches_its_table() {
  run "$B/precision"
  expect_rc 0 "precision"
  local e
  e=$(grep -E '^\| fp32 \| fp32 \|' "$tmp/out" | awk -F'|' '{print $5}' | sed 's/^ *[+-]//; s/ *$//')
  [ -n "$e" ] || { note "no fp32/fp32 row"; return; }
  grep -v '^|' "$tmp/out" | grep -q -- "$e" || note "the prose does not quote the fp32 accumulator's error $e"
  expect_not_in "$tmp/out" 'within ~1e-5' "the old claim"
}

# precision: md keeps the tables and the prose; csv and jsonl print one table and nothing else on stdout;
# --dry-run counts the rows; --oom-ok accepts a ToyModel run out of memory.
t_precision_formats_dry_run_and_oom_ok() {
  run "$B/precision" --format csv
  expect_rc 0 "precision --format csv"
  [ "$(head -1 "$tmp/out")" = experiment,accumulator,increment,result,error,autocast,tensor,dtype,status ] || note "csv header: $(head -1 "$tmp/out")"
  [ "$(grep -c ',ok$' "$tmp/out")" = 28 ] && [ "$(wc -l <"$tmp/out")" = 29 ] || note "csv: not 28 ok rows and a header: $(head -c 300 "$tmp/out")"
  expect_in "$tmp/out" '^accumulation,fp16,fp16,9[.][0-9]+,-[0-9.]+e-[0-9]+,,,,ok$' "csv: an accumulation row, numbers only"
  expect_in "$tmp/out" '^toymodel,,,,,bf16,logits,bf16,ok$' "csv: a ToyModel row"
  run "$B/precision" --format jsonl
  [ "$(grep -c '^{"experiment": ' "$tmp/out")" = 28 ] && [ "$(wc -l <"$tmp/out")" = 28 ] || note "jsonl: not 28 rows alone: $(head -c 300 "$tmp/out")"
  run "$B/precision" --dry-run
  expect_rc 0 "precision --dry-run"
  expect_in "$tmp/out" 'dry run: 28 ' "the rows a run prints"
  run "$B/precision" --mem-limit 0.0000001 --format csv
  expect_rc 1 "precision: the ToyModel out of memory"
  expect_in "$tmp/out" '^toymodel,,,,,fp16,,,OOM: out of memory' "csv: the OOM row"
  run "$B/precision" --mem-limit 0.0000001 --oom-ok
  expect_rc 0 "precision --oom-ok"
}

# allreduce: --dry-run answers before any rank starts (one line, not one a rank) and counts op x dtype x size;
# csv keeps stdout for the rows (the configuration line on stderr) and OOM rows have no numbers.
t_allreduce_dry_run_and_csv_stdout() {
  [ -x "$B/allreduce" ] || { echo -n "(no $B/allreduce: skipped) "; return; }
  run "$B/allreduce" --nproc 2 --op all_reduce,all_gather --dtype fp32,bf16 --sizes 1KB,2KB,4KB --format csv --dry-run
  expect_rc 0 "allreduce --dry-run"
  [ -s "$tmp/out" ] && note "stdout of a csv dry run: $(head -c 200 "$tmp/out")"
  [ "$(grep -c 'dry run: 12 configurations' "$tmp/err")" = 1 ] || note "not one '12 configurations' line: $(cat "$tmp/err")"
  run "$B/allreduce" --nproc 2 --sizes 1KB --warmup 0 --iters 1 --format csv
  expect_rc 0 "allreduce --format csv"
  local cols=op,dtype,size,bytes,ranks,min_ms,mean_ms,max_ms,time_ms,algbw_GB/s,busbw_GB/s,check,status
  [ "$(head -1 "$tmp/out")" = "$cols" ] || note "csv: $(head -c 200 "$tmp/out")"
  expect_in "$tmp/err" '^allreduce: world 2, ' "the configuration line on stderr"
  run "$B/allreduce" --sizes 1MB --warmup 0 --iters 1 --mem-limit 0.0001 --format jsonl
  expect_in "$tmp/out" '"bytes": 1048576, "ranks": 1, "min_ms": null, .*"busbw_GB/s": null, "check": null, "status": "OOM: ' "jsonl: the OOM row"
}

# Sizes whose element counts would overflow the library's int64 shape products are refused before
# any tensor is made (attn: a usage error; e2e: an error row), never wrapped into small allocations.
t_sizes_past_2p62_elements_are_refused() {
  run "$B/attn" --batch 1048576 --heads 65536 --seq 16777216 --d 65536 --impl naive --warmup 0 --reps 1
  expect_rc 2 "attn at 2^76 elements"
  expect_in "$tmp/err" 'at most 2\^62' "the rule"
  run "$B/e2e" --model custom --d-model 16 --num-layers 1 --num-heads 2 --d-ff 32 --vocab-size 16777216 --batch-size 1048576 \
      --context-length 1048576 --warmup 0 --steps 1 --no-sgemm
  expect_rc 1 "e2e at 2^64 logits"
  expect_in "$tmp/out" '\| error: tensor sizes past 2\^62 elements' "the error row"
}

t_dry_run_measures_nothing() {
  run "$B/e2e" --model 2.7B --context-length 128 --mode train --dry-run
  expect_rc 0 "e2e --dry-run"
  expect_in "$tmp/out" '^e2e: device cpu; model 2.7B; context 128;' "the configuration line"
  expect_not_in "$tmp/out" '^\|' "no table"
}

# attn: a --sweep preset sets what the command line leaves unset, whichever side of --sweep the flags
# are; --dry-run counts the rows a run would measure (--impl both: naive and flash, two a configuration).
# Out of memory while the inputs are made (q fits, k does not) is an OOM row, never a crash.
t_attn_sweep_presets_yield_to_flags() {
  run "$B/attn" --d 128,64 --sweep leaderboard --reps=3 --dry-run
  expect_rc 0 "attn --sweep leaderboard --dry-run"
  expect_in "$tmp/out" 'sweep leaderboard; impl both; batch 1; heads 16; d 128,64; seq 16384; dtype bf16; causal 1; grad sum; .*warmup 10; reps 3;' \
    "the preset under the flags given"
  expect_in "$tmp/out" 'dry run: 4 configurations would run' "2 head dims, naive and flash"
  run "$B/attn" --sweep flash_benchmarking --impl flash --format csv --dry-run
  expect_rc 0 "attn --sweep flash_benchmarking --impl flash"
  [ -s "$tmp/out" ] && note "csv: a dry run leaves stdout empty: $(head -c 200 "$tmp/out")"
  expect_in "$tmp/err" 'dry run: 80 configurations would run' "10 seq x 4 d x 2 dtypes, flash only"
  run "$B/attn" --seq 4096 --d 64 --batch 1 --warmup 0 --reps 1 --mem-limit 0.0015 --oom-ok --format csv --progress on
  expect_rc 0 "attn: OOM on the inputs under --oom-ok"
  [ "$(grep -c '^cpu,\(naive\|flash\),1,0,4096,64,fp32,0,,,,,,,,,,OOM: ' "$tmp/out")" = 2 ] || note "two OOM rows with empty numeric cells: $(cat "$tmp/out")"
  expect_in "$tmp/err" 'configuration 2 of 2 \(flash fp32 d 64 seq 4096 causal 0\)' "progress on stderr"
}

# ---- activation checkpointing ----------------------------------------------------------------------

# Every policy runs, keeps less than none, and its measured peak is within 10% of the plan's.
t_checkpoint_policies_keep_less() {
  run "$B/e2e" --model custom --d-model 32 --num-layers 4 --num-heads 2 --d-ff 64 --vocab-size 64 --batch-size 2 --warmup 0 --steps 1 --no-sgemm \
      --context-length 32 --mode train --checkpoint none,blocks:1,blocks:2,sqrt,nested,selective,nested:2+selective --format csv
  expect_rc 0 "e2e --checkpoint"
  local none i s p m
  none=$(csv_col "$tmp/out" 1 saved_MiB)
  [ "$(csv_col "$tmp/out" 4 ckpt)" = "blocks:2" ] || note "sqrt of 4 blocks: ckpt '$(csv_col "$tmp/out" 4 ckpt)', wanted blocks:2"
  for i in 2 3 4 5 6 7; do
    s=$(csv_col "$tmp/out" $i saved_MiB); p=$(csv_col "$tmp/out" $i pred_MiB); m=$(csv_col "$tmp/out" $i peak_MiB)
    awk -v s="$s" -v n="$none" 'BEGIN { exit !(s < n) }' || note "row $i ($(csv_col "$tmp/out" $i ckpt)) keeps $s MiB, none $none"
    awk -v p="$p" -v m="$m" 'BEGIN { exit !(p > 0.9 * m && p < 1.1 * m) }' || note "row $i: predicted peak $p MiB, measured $m"
  done
}

# auto:BYTES prints its plan and runs the policy it chose; --plan measures nothing; bad policies are usage errors.
t_checkpoint_auto_and_plan() {
  run "$B/e2e" "${TINY[@]}" --context-length 8 --checkpoint auto:1K --format csv
  expect_rc 0 "e2e --checkpoint auto:1K"
  expect_in "$tmp/err" 'checkpoint plan: .*nothing fits the budget' "the plan on stderr"
  expect_in "$tmp/out" '\(auto\)' "the row names the policy auto chose"
  run "$B/e2e" --model 2.7B --context-length 2048 --attn naive --checkpoint none,blocks:2 --num-layers 4 --plan --format csv
  expect_rc 0 "e2e --plan"
  [ "$(csv_col "$tmp/out" 1 block_MiB)" = "3648.06" ] || note "the xl block keeps $(csv_col "$tmp/out" 1 block_MiB) MiB, wanted 3648.06 (torch: 3651.31)"
  [ "$(csv_col "$tmp/out" 2 kept_blocks_MiB)" = "160.00" ] || note "two checkpointed pairs keep $(csv_col "$tmp/out" 2 kept_blocks_MiB) MiB, wanted 160.00"
  for bad in blocks:0 blocks:x nested:1 auto:-1G auto: bogus; do
    run "$B/e2e" "${TINY[@]}" --checkpoint "$bad" --dry-run
    expect_rc 2 "--checkpoint $bad"
  done
  run "$B/e2e" "${TINY[@]}" --context-length 8 --checkpoint blocks:3
  expect_rc 1 "blocks:3 on a one-layer model"
  expect_in "$tmp/out" 'K from 1 to num_layers \(1\)' "the error row names the rule"
}

# ---- the memory driver ----------------------------------------------------------------------------------

MEMTINY=(--model custom --d-model 32 --num-layers 2 --num-heads 2 --d-ff 64 --vocab-size 128 --batch-size 2 --context-length 32)

# check_plot SVG JSON PHASES: the SVG is well-formed XML with one series per category, the reserved
# line and the peak; the JSON timeline parses, its events replay to its peak, it has PHASES phases.
check_plot() {
  [ -s "$1" ] && [ -s "$2" ] || { note "missing $1 or $2"; return; }
  if ! command -v python3 >/dev/null; then echo -n "(no python3: XML and JSON not parsed) "; grep -q '</svg>' "$1" || note "$1 has no </svg>"; return; fi
  python3 - "$1" "$2" "$3" >"$tmp/py" 2>&1 <<'PY' || note "plot/timeline: $(head -c 400 "$tmp/py")"
import json, sys, xml.etree.ElementTree as ET
svg, js, phases = sys.argv[1], sys.argv[2], int(sys.argv[3])
root = ET.parse(svg).getroot()
assert root.tag.endswith('svg'), root.tag
cats = {p.get('data-category') for p in root.iter('{http://www.w3.org/2000/svg}path') if p.get('data-category')}
want = {'parameters', 'gradients', 'optimizer state', 'activations', 'temporaries', 'workspace', 'reserved'}
assert cats == want, cats
assert any(g.get('class') == 'peak' for g in root.iter('{http://www.w3.org/2000/svg}g')), 'no peak mark'
t = json.load(open(js))
assert len(t['phases']) == phases, t['phases']
live = sum(t['start']); peak = live
for e in t['events']:
    live += e[1]; peak = max(peak, live)
    assert live == e[2], ('replayed live', live, 'event says', e[2])
assert peak == t['peak']['bytes'] and sum(t['peak']['by_category']) == peak, (peak, t['peak'])
cols = t['columns']
assert cols[-2:] == ['dtype', 'shape'], cols
allocs = [e for e in t['events'] if e[7] == 0]
assert allocs and all(len(e) == len(cols) for e in t['events'])
assert all(isinstance(e[8], str) and all(isinstance(n, int) for n in e[9]) for e in allocs if e[8] is not None)
assert sum(e[8] is not None for e in allocs) > len(allocs) // 2, 'most allocations are tensors with a dtype and shape'
# the peak's label stays inside the plot, clear of the legend (about 7px a character at 12px)
ns = '{http://www.w3.org/2000/svg}'
legend_x = min(float(r.get('x')) for g in root.iter(ns + 'g') if g.get('class') == 'legend' for r in g.iter(ns + 'rect'))
label = next(g for g in root.iter(ns + 'g') if g.get('class') == 'peak').find(ns + 'text')
x, w = float(label.get('x')), 7 * len(label.text)
lo, hi = (x - w, x) if label.get('text-anchor') == 'end' else (x, x + w)
assert hi < legend_x - 8 and lo > 0, ('peak label', lo, hi, 'legend at', legend_x)
PY
}

# check_memviz PICKLE PEAK_MIB JSON: the memory_viz snapshot reads back with pickle (only opcodes that
# memory_viz's own reader knows), has torch.cuda.memory._snapshot()'s structure, its trace pairs every
# free with an alloc, live blocks never overlap, the segments are what is live at the end, and the
# trace replays to the driver's peak: the JSON timeline's bytes exactly, the row's peak_MiB as printed.
# A snapshot with one free dropped must fail the same check.
check_memviz() {
  [ -s "$1" ] || { note "missing $1"; return; }
  if ! command -v python3 >/dev/null; then echo -n "(no python3: the snapshot is not read) "; return; fi
  python3 - "$1" "$2" "$3" >"$tmp/py" 2>&1 <<'PY' || note "memory_viz snapshot: $(head -c 600 "$tmp/py")"
import copy, json, pickle, pickletools, sys
path, peak_mib, timeline = sys.argv[1], sys.argv[2], sys.argv[3]
raw = open(path, 'rb').read()
known = {'PROTO', 'EMPTY_DICT', 'EMPTY_LIST', 'MARK', 'SETITEMS', 'APPENDS', 'BININT', 'LONG1', 'BINUNICODE',
         'NEWFALSE', 'LONG_BINPUT', 'LONG_BINGET', 'STOP'}
ops = {op.name for op, _, _ in pickletools.genops(raw)}
assert ops <= known, ('opcodes memory_viz cannot read', ops - known)
snap = pickle.loads(raw)

def check(d):
    assert isinstance(d, dict) and {'segments', 'device_traces'} <= set(d), list(d)
    assert isinstance(d['device_traces'], list) and len(d['device_traces']) == 1 and isinstance(d['device_traces'][0], list)
    def frames_ok(fr):
        return isinstance(fr, list) and fr and all(set(f) == {'filename', 'line', 'name'} and isinstance(f['name'], str) and isinstance(f['line'], int) for f in fr)
    segs, live, cur, peak = {}, {}, 0, 0
    for i, e in enumerate(d['device_traces'][0]):
        assert {'action', 'addr', 'size', 'stream', 'time_us', 'frames'} <= set(e), e
        a, addr, size = e['action'], e['addr'], e['size']
        assert isinstance(addr, int) and isinstance(size, int) and size > 0 and frames_ok(e['frames']), e
        if a == 'segment_alloc':
            assert addr not in segs and addr % 512 == 0, ('segment twice', i, e)
            segs[addr] = size
        elif a == 'alloc':
            assert segs.get(addr) == size and addr not in live, ('alloc outside its segment', i, e)
            live[addr] = size; cur += size; peak = max(peak, cur)
        elif a == 'free_requested':
            assert live.get(addr) == size, ('free of no allocation', i, e)
        elif a == 'free_completed':
            assert live.pop(addr, None) == size, ('free of no allocation', i, e)
            cur -= size
        elif a == 'segment_free':
            assert segs.pop(addr, None) == size and addr not in live, ('segment freed while in use', i, e)
        else:
            raise AssertionError(('action', a))
    spans = sorted(live.items())
    assert all(a + s <= b for (a, s), (b, _) in zip(spans, spans[1:])), 'live blocks overlap'
    assert segs == live, 'segments at the end are not the live blocks'
    end = {}
    for s in d['segments']:
        assert {'device', 'address', 'total_size', 'allocated_size', 'active_size', 'requested_size', 'stream', 'segment_type', 'blocks'} <= set(s), s
        assert s['device'] == 0 and len(s['blocks']) == 1, s
        b = s['blocks'][0]
        assert b['state'] == 'active_allocated' and b['address'] == s['address'] and b['size'] == b['requested_size'] == s['total_size'] and frames_ok(b['frames']), s
        end[s['address']] = s['total_size']
    assert end == live, 'the segments list is not what the trace leaves live'
    return peak

peak = check(snap)
want = json.load(open(timeline))['peak']['bytes']
assert peak == want, ('trace peak', peak, 'timeline peak', want)
assert '%.1f' % (peak / 1048576) == peak_mib, ('trace peak MiB', peak / 1048576, 'row', peak_mib)
names = [f['name'] for e in snap['device_traces'][0] for f in e['frames'][:1]]
assert any(n.endswith(' f32') or n.endswith(' bf16') for n in names), 'no shape and dtype in the frame names'
phases = {f['name'] for e in snap['device_traces'][0] for f in e['frames'] if f['filename'] == 'phase'}
assert phases & {'forward', 'backward', 'optimizer'}, phases
tr = snap['device_traces'][0]
i = next(i for i, e in enumerate(tr) if e['action'] == 'free_requested')
bad = copy.deepcopy(snap)
del bad['device_traces'][0][i:i + 3]   # one free dropped
try:
    check(bad)
except AssertionError:
    pass
else:
    raise SystemExit('a snapshot with a free dropped passed the check')
PY
}

t_memory_rows_plots_and_prediction() {
  run "$B/memory" --device cpu "${MEMTINY[@]}" --mode forward,train --dtype fp32,bf16 --out "$tmp/mem" --format csv
  expect_rc 0 "memory sweep"
  [ "$(grep -c ',ok$' "$tmp/out")" = 4 ] || note "4 ok rows expected: $(cat "$tmp/out")"
  local r d
  for r in 1 2 3 4; do   # the first-principles prediction within 10 % of the measured peak
    d=$(csv_col "$tmp/out" $r diff_pct | tr -d -- -)
    awk -v d="$d" 'BEGIN { exit !(d != "" && d <= 10) }' || note "row $r: prediction off by $d %"
  done
  [ "$(csv_col "$tmp/out" 3 peak_in)" = backward ] || note "a train step peaks in backward: $(csv_col "$tmp/out" 3 peak_in)"
  [ -z "$(csv_col "$tmp/out" 1 bwd_peak_MiB)" ] || note "forward rows have no backward peak (an empty cell)"
  expect_in "$tmp/err" 'largest allocations of the step' "the allocation table after the rows"
  expect_in "$tmp/err" '\| [0-9.]+ \| 1 \| [0-9.]+ \| \(2, 32, 128\) \| f32 \| linear \| activations \(saved for backward\)' "the logits, saved for the loss"
  check_plot "$tmp/mem/cpu_custom_ctx32_train_fp32_naive.svg" "$tmp/mem/cpu_custom_ctx32_train_fp32_naive.json" 3
  check_plot "$tmp/mem/cpu_custom_ctx32_forward_bf16_naive.svg" "$tmp/mem/cpu_custom_ctx32_forward_bf16_naive.json" 1
  expect_in "$tmp/err" 'memory_viz snapshot: .*/cpu_custom_ctx32_train_fp32_naive.pickle' "the snapshot named after the rows"
  check_memviz "$tmp/mem/cpu_custom_ctx32_train_fp32_naive.pickle" "$(csv_col "$tmp/out" 3 peak_MiB)" "$tmp/mem/cpu_custom_ctx32_train_fp32_naive.json"
  check_memviz "$tmp/mem/cpu_custom_ctx32_train_bf16_naive.pickle" "$(csv_col "$tmp/out" 4 peak_MiB)" "$tmp/mem/cpu_custom_ctx32_train_bf16_naive.json"
  check_memviz "$tmp/mem/cpu_custom_ctx32_forward_bf16_naive.pickle" "$(csv_col "$tmp/out" 2 peak_MiB)" "$tmp/mem/cpu_custom_ctx32_forward_bf16_naive.json"
}

t_memory_oom_is_a_row_and_the_plot_shows_it() {
  run "$B/memory" --device cpu "${MEMTINY[@]}" --context-length 32,2048 --mode train --dtype fp32 --mem-limit 0.02 --out "$tmp/mem"
  expect_rc 1 "an OOM row without --oom-ok"
  expect_in "$tmp/out" '\| 32 \|.*\| ok \|' "the row that fits"
  expect_in "$tmp/out" '\| 2048 \|.*\| OOM: out of memory' "the OOM row"
  expect_in "$tmp/mem/cpu_custom_ctx2048_train_fp32_naive.svg" 'class="oom"' "the OOM mark in the plot"
  run "$B/memory" --device cpu "${MEMTINY[@]}" --context-length 2048 --mode train --dtype fp32 --mem-limit 0.02 --oom-ok
  expect_rc 0 "--oom-ok"
  run "$B/memory" --device cpu "${MEMTINY[@]}" --out /proc/no/such/dir
  expect_rc 2 "an --out folder that cannot be made"
  expect_in "$tmp/err" "cannot make folder '/proc/no/such/dir'" "the message names the folder"
}

# ---- the memory budget under a cgroup, and ranks sharing a host -------------------------------------------

# fake_cgroup DIR BYTES: a cgroup v2 file tree under DIR (for TSYS_CGROUP_ROOT, which stands for / when
# the library reads /proc/self/cgroup, /proc/self/mountinfo and the cgroup files) whose job has BYTES
# of room: its limit is BYTES above what it uses.
fake_cgroup() {
  mkdir -p "$1/proc/self" "$1/sys/fs/cgroup/job/step"
  echo "0::/job/step" >"$1/proc/self/cgroup"
  echo "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw" >"$1/proc/self/mountinfo"
  echo $(( $2 + 1048576 )) >"$1/sys/fs/cgroup/job/memory.max"   # the parent's limit binds the step
  echo 1048576 >"$1/sys/fs/cgroup/job/memory.current"
  echo max >"$1/sys/fs/cgroup/job/step/memory.max"
  echo 524288 >"$1/sys/fs/cgroup/job/step/memory.current"
}

# In a container or a Slurm job the limit is the cgroup's, not the machine's MemAvailable: what does not
# fit is an OOM row (the budget names the cgroup's room), never the kernel killing the process rowless.
t_cgroup_limit_is_the_budget() {
  fake_cgroup "$tmp/cg" $((10 << 20))
  TSYS_CGROUP_ROOT="$tmp/cg" run "$B/e2e" "${TINY[@]}" --context-length 8,1024 --steps 1
  expect_rc 1 "e2e in a cgroup with 10 MiB of room"
  expect_in "$tmp/out" '^\| cpu \| custom \| 8 \|.*\| ok \|$' "the row that fits"
  expect_in "$tmp/out" "^\\| cpu \\| custom \\| 1024 \\|.*\\| OOM: out of memory.*budget $((10 << 20))[^0-9]" "the OOM row, the cgroup's room as the budget"
  TSYS_CGROUP_ROOT="$tmp/cg" run "$B/e2e" "${TINY[@]}" --context-length 1024 --steps 1 --mem-limit 0.5
  expect_rc 0 "--mem-limit still sets the budget"
}

# ddp and allreduce: --mem-limit (strict, as in every driver) caps each rank, and out of memory is a row
# with exit status 1 (allreduce: 0 under --oom-ok); without it the ranks on one host share its memory, so
# what fits one rank alone is an OOM row with two (the cgroup's room, split), on every rank at once.
DDPTINY=(--device cpu --model custom --d-model 32 --num-layers 2 --num-heads 2 --d-ff 64 --vocab-size 97 --batch-size 1 --context-length 16
         --warmup 0 --steps 1 --strategy flat --format csv)
t_dist_drivers_mem_limit_and_shared_budget() {
  local d v
  for d in ddp allreduce; do
    [ -x "$B/$d" ] || { echo -n "(no $B/$d: skipped) "; continue; }
    for v in inf -1 1GB ''; do
      run "$B/$d" --mem-limit "$v"
      expect_rc 2 "$d --mem-limit '$v'"
      expect_in "$tmp/err" '\-\-mem-limit takes a number of GiB from 0 to 1048576' "$d --mem-limit '$v'"
    done
    run "$B/$d" --help
    expect_in "$tmp/out" '\-\-mem-limit GIB' "$d --help: --mem-limit"
  done
  fake_cgroup "$tmp/cg" $((768 << 10))
  if [ -x "$B/ddp" ]; then
    run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --mem-limit 0.0001
    expect_rc 1 "ddp under --mem-limit 0.0001"
    expect_in "$tmp/out" '^cpu,custom,2,flat,.*,OOM: out of memory' "ddp: the OOM row"
    TSYS_CGROUP_ROOT="$tmp/cg" run "$B/ddp" --nproc 1 "${DDPTINY[@]}"
    expect_rc 0 "ddp: one rank in 768 KiB"
    expect_in "$tmp/out" '^cpu,custom,1,flat,.*,ok$' "ddp: one rank's row"
    TSYS_CGROUP_ROOT="$tmp/cg" run "$B/ddp" --nproc 2 "${DDPTINY[@]}"
    expect_rc 1 "ddp: two ranks sharing 768 KiB"
    expect_in "$tmp/err" '^ddp: .*cpu memory budget 0.0003662 GiB a rank \(the host.s available memory over 2 local ranks\)' "ddp: the budget a rank (csv: on stderr)"
    expect_in "$tmp/out" '^cpu,custom,2,flat,.*,OOM: out of memory' "ddp: the OOM row of two ranks"
    TSYS_CGROUP_ROOT="$tmp/cg" run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --mem-limit 0.01
    expect_rc 0 "ddp: --mem-limit instead of the shared budget"
  fi
  if [ -x "$B/allreduce" ]; then
    run "$B/allreduce" --sizes 1KB,1MB --warmup 0 --iters 1 --mem-limit 0.0001 --format csv
    expect_rc 1 "allreduce under --mem-limit 0.0001"
    expect_in "$tmp/out" '^all_reduce,fp32,1KB,1024,1,.*,ok,ok$' "allreduce: the size that fits"
    expect_in "$tmp/out" '^all_reduce,fp32,1MB,1048576,1,.*,OOM: allocating the buffers: out of memory' "allreduce: the OOM row"
    run "$B/allreduce" --sizes 1MB --warmup 0 --iters 1 --mem-limit 0.0001 --oom-ok
    expect_rc 0 "allreduce --oom-ok"
    TSYS_CGROUP_ROOT="$tmp/cg" run "$B/allreduce" --nproc 1 --sizes 512KB --warmup 0 --iters 1 --format csv
    expect_rc 0 "allreduce: one rank, 512 KiB in 768 KiB"
    TSYS_CGROUP_ROOT="$tmp/cg" run "$B/allreduce" --nproc 2 --sizes 512KB --warmup 0 --iters 1 --format csv
    expect_rc 1 "allreduce: two ranks sharing 768 KiB"
    expect_in "$tmp/out" '^all_reduce,fp32,512KB,524288,2,.*,OOM: allocating the buffers: out of memory' "allreduce: the OOM row of two ranks"
  fi
}

# ---- training-state snapshots: --save-every, --save-dir, --resume ------------------------------------

SNAP=(--context-length 8 --mode train --warmup 0 --format csv)

# snapshot_diff A B: the tensors of snapshots A and B (two directories) bitwise equal, and their
# metadata too but for timing fields (none today: any key holding "time" or ending in _ms or _s).
snapshot_diff() {
  python3 - "$1" "$2" <<'PY'
import json, os, struct, sys
def read(path):
    with open(path, "rb") as f: b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n]); data = b[8 + n:]
    meta = head.pop("__metadata__", {})
    return meta, {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in head.items()}
timing = lambda k: "time" in k or k.endswith("_ms") or k.endswith("_s")
bad = []
for name in ("model.safetensors", "train_state.safetensors"):
    (ma, ta), (mb, tb) = (read(os.path.join(d, name)) for d in sys.argv[1:3])
    if not ta: bad.append(f"{name}: no tensors")
    if ta.keys() != tb.keys(): bad.append(f"{name}: tensors {sorted(ta.keys() ^ tb.keys())} in one only")
    bad += [f"{name}: tensor {k} differs" for k in ta if k in tb and ta[k] != tb[k]]
    bad += [f"{name}: metadata {k}: {ma.get(k)!r} and {mb.get(k)!r}" for k in sorted(ma.keys() | mb.keys()) if not timing(k) and ma.get(k) != mb.get(k)]
    if name.startswith("train") and not any(k.endswith(".exp_avg_sq") for k in ta): bad.append("no AdamW moments")
    if name.startswith("train") and (ma.get("step"), ma.get("optim.step")) != ("6", "6"): bad.append(f"step {ma.get('step')}, AdamW's {ma.get('optim.step')}: wanted 6")
print("\n".join(bad[:8]))
sys.exit(1 if bad else 0)
PY
}

# 6 steps in one run, and 3 then 3 more resumed from the first 3's snapshot, reach the same step-6
# snapshot: the model, AdamW's moments and step, the RNG bitwise equal. The steps counted are all the
# training steps (warmup ones too: none here).
t_save_resume_is_bitwise() {
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 6 --save-every 6 --save-dir "$tmp/once"
  expect_rc 0 "6 steps, a snapshot at 6"
  [[ "$(csv_col "$tmp/out" 1 save_ms)" =~ ^[0-9]+\.[0-9]$ ]] || note "save_ms '$(csv_col "$tmp/out" 1 save_ms)', wanted a number"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 3 --save-every 3 --save-dir "$tmp/twice"
  expect_rc 0 "3 steps, a snapshot at 3"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 3 --save-every 3 --save-dir "$tmp/twice" --resume "$tmp/twice"
  expect_rc 0 "3 more steps resumed, a snapshot at 6"
  expect_in "$tmp/err" "resumed from $tmp/twice/step-000003: step 3" "the snapshot resumed from"
  expect_in "$tmp/err" "resumed from $tmp/twice/step-000003: 0\.[0-9]+ GB loaded in [0-9.]+ s \([0-9.]+ GB/s\)" "the load's time and rate"
  [ "$(ls "$tmp/once")" = step-000006 ] || note "once: $(ls "$tmp/once")"
  [ "$(ls "$tmp/twice" | tr '\n' ' ')" = "step-000003 step-000006 " ] || note "twice: $(ls "$tmp/twice")"
  snapshot_diff "$tmp/once/step-000006" "$tmp/twice/step-000006" >"$tmp/py" 2>&1 || note "the step-6 snapshots differ: $(head -c 600 "$tmp/py")"
  [[ "$(csv_col "$tmp/out" 1 save_GBps)" =~ ^[0-9]+\.[0-9]+$ ]] || note "save_GBps '$(csv_col "$tmp/out" 1 save_GBps)', wanted a number"
  # the synchronous save (the step waits) writes the same files as the default, asynchronous one
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 6 --save-every 6 --save-dir "$tmp/sync" --save-async no
  expect_rc 0 "6 steps, a synchronous snapshot at 6"
  expect_in "$tmp/err" "synchronous" "the configuration line says the save is synchronous"
  [ -z "$(csv_col "$tmp/out" 1 save_GBps)" ] || note "save_GBps of a synchronous save: '$(csv_col "$tmp/out" 1 save_GBps)', wanted empty"
  cmp -s "$tmp/once/step-000006/model.safetensors" "$tmp/sync/step-000006/model.safetensors" &&
    cmp -s "$tmp/once/step-000006/train_state.safetensors" "$tmp/sync/step-000006/train_state.safetensors" ||
    note "the asynchronous and synchronous step-6 snapshots differ"
  # staged on the device where there is one (on the CPU: the same as yes), the same files again
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 6 --save-every 6 --save-dir "$tmp/staged" --save-async device
  expect_rc 0 "6 steps, a snapshot at 6 staged on the device"
  expect_in "$tmp/err" "staged on the device" "the configuration line says where the snapshot is staged"
  cmp -s "$tmp/once/step-000006/train_state.safetensors" "$tmp/staged/step-000006/train_state.safetensors" || note "the staged step-6 snapshot differs"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 2
  [ "$(csv_col "$tmp/out" 1 save_ms)" = NO-COLUMN ] || note "a save_ms column without saving"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 1 --compile no,yes --save-every 1 --save-dir "$tmp/skip"
  [ -z "$(csv_col "$tmp/out" 2 save_ms)" ] || note "save_ms of a skipped row: '$(csv_col "$tmp/out" 2 save_ms)', wanted empty"
}

# Warmup steps count: 2 warmup and 3 timed steps with --save-every 2 save after steps 2, 4 and 5 (the
# last), and --keep-last 2 keeps 4 and 5. A sweep saves each configuration in its own directory.
t_save_every_counts_warmup_keeps_last_sweeps() {
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --warmup 2 --steps 3 --save-every 2 --keep-last 2 --save-dir "$tmp/warm"
  expect_rc 0 "warmup 2, steps 3"
  [ "$(ls "$tmp/warm" | tr '\n' ' ')" = "step-000004 step-000005 " ] || note "warm: $(ls -a "$tmp/warm" | tr '\n' ' ')"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --context-length 8,16 --steps 2 --save-every 2 --save-dir "$tmp/sweep/runs"
  expect_rc 1 "a sweep into a directory whose parent is missing"
  expect_in "$tmp/out" "error: .*--save-dir '$tmp/sweep/runs': cannot make it" "the error row names --save-dir"
  mkdir "$tmp/sweep"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --context-length 8,16 --steps 2 --save-every 2 --save-dir "$tmp/sweep/runs"
  expect_rc 0 "a sweep of two"
  local c
  for c in cpu_custom_T8_train_fp32_naive cpu_custom_T16_train_fp32_naive; do
    [ -f "$tmp/sweep/runs/$c/step-000002/MANIFEST" ] || note "no $c/step-000002: $(ls -R "$tmp/sweep")"
  done
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --context-length 8,16 --steps 1 --resume "$tmp/sweep/runs"
  expect_rc 0 "the sweep resumed"
  [ "$(grep -c "resumed from $tmp/sweep/runs/cpu_custom_T[0-9]*_train_fp32_naive/step-000002: step 2" "$tmp/err")" = 2 ] || note "resumed: $(cat "$tmp/err")"
}

# The flags are train mode's: any other mode in the list, --plan, or one flag without its partner is
# bad usage (2) naming them; a --resume that finds nothing to load, a damaged snapshot, or another
# run's data (batch, context, seed) is an error row (1) naming the directory and the cause.
t_save_resume_usage_and_errors() {
  run "$B/e2e" "${TINY[@]}" --context-length 8 --mode forward --save-every 2 --save-dir "$tmp/fwd"
  expect_rc 2 "--save-every in forward mode"
  expect_in "$tmp/err" "^e2e: --save-every --save-dir: train mode only, and --mode holds 'forward'" "names the flags and the mode"
  [ -e "$tmp/fwd" ] && note "forward mode made $tmp/fwd"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --mode train,forward-backward --resume "$tmp/fwd"
  expect_rc 2 "--resume with a mode list holding forward-backward"
  expect_in "$tmp/err" "^e2e: --resume: train mode only, and --mode holds 'forward-backward'" "names --resume"
  run "$B/e2e" "${TINY[@]}" --mode train --plan --resume "$tmp/fwd"
  expect_rc 2 "--resume with --plan"
  run "$B/e2e" "${TINY[@]}" --mode train --save-every 2
  expect_rc 2 "--save-every alone"
  expect_in "$tmp/err" "--save-every needs --save-dir DIR" "the missing partner"
  run "$B/e2e" "${TINY[@]}" --mode train --save-dir "$tmp/fwd"
  expect_rc 2 "--save-dir alone"
  run "$B/e2e" "${TINY[@]}" --mode train --save-every 0 --save-dir "$tmp/fwd"
  expect_rc 2 "--save-every 0"
  mkdir -p "$tmp/empty"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --resume "$tmp/empty"
  expect_rc 1 "--resume of an empty directory"
  expect_in "$tmp/out" "error: --resume '$tmp/empty': no complete snapshot there" "the error row"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --resume "$tmp/no_such"
  expect_rc 1 "--resume of a missing directory"
  expect_in "$tmp/out" "error: --resume '$tmp/no_such': no complete snapshot there" "the error row"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 1 --save-every 1 --save-dir "$tmp/bad"
  python3 -c "import sys; f = open(sys.argv[1], 'r+b'); f.seek(-9, 2); b = f.read(1); f.seek(-9, 2); f.write(bytes([b[0] ^ 0x10]))" \
    "$tmp/bad/step-000001/model.safetensors"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --resume "$tmp/bad"
  expect_rc 1 "--resume of a damaged snapshot"
  expect_in "$tmp/out" "error: .*step-000001.*'model.safetensors' is altered: its CRC-32C is [0-9a-f]+, the manifest records [0-9a-f]+" "names the file"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --steps 1 --save-every 1 --save-dir "$tmp/b1"
  run "$B/e2e" "${TINY[@]}" "${SNAP[@]}" --batch-size 2 --resume "$tmp/b1"
  expect_rc 1 "--resume of another batch size"
  expect_in "$tmp/out" "error: --resume '$tmp/b1/step-000001': saved with batch 1, this run has batch 2" "names the difference"
}

# ---- results that cannot be written ---------------------------------------------------------------------

# Every driver, every format: stdout on a full disk (/dev/full) is an error on stderr and exit status 1,
# never a silent 0 (rows, --help, dry runs and the prediction tables alike).
t_full_stdout_is_a_failure() {
  local c
  local -a cmds=(
    "e2e ${TINY[*]} --context-length 8" "e2e ${TINY[*]} --context-length 8 --format csv" "e2e ${TINY[*]} --context-length 8 --format jsonl"
    "e2e --dry-run" "e2e --help" "attn --seq 16 --d 16 --batch 1 --warmup 0 --reps 1 --impl naive" "attn --dry-run" "precision"
    "memory --device cpu ${MEMTINY[*]} --mode forward --format jsonl" "memory --help"
    "ddp --account --device cpu --model custom --d-model 16 --num-layers 1 --num-heads 2 --d-ff 32 --vocab-size 64" "ddp --help"
    "ddp --plan --device cpu --model small --nproc 4" "mesh --help" "mesh --dry-run --nproc 2"
    "allreduce --sizes 1KB --warmup 0 --iters 1" "allreduce --nproc 2 --sizes 1KB --warmup 0 --iters 1 --format csv" "allreduce --help")
  for c in "${cmds[@]}"; do
    set -- $c
    [ -x "$B/$1" ] || continue
    local bin=$B/$1; shift
    timeout 120 "$bin" "$@" >/dev/full 2>"$tmp/err"
    rc=$?
    expect_rc 1 "$c >/dev/full"
    expect_in "$tmp/err" 'writing the results to stdout failed: ' "$c >/dev/full: the message"
  done
}

# A result file that cannot be written whole (here a file size limit: the write fails part way, as on a
# full disk) is an error row and exit status 1, and leaves nothing under its final name (the files go to
# a temporary, renamed into place once written, synced and closed) and no temporary behind.
# check_no_partial DIR: no *.tmp left; every .json is whole JSON, every .svg ends with </svg>.
check_no_partial() {
  local f
  for f in "$1"/*; do
    [ -e "$f" ] || continue
    case $f in
      *.tmp) note "a temporary left behind: $f" ;;
      *.json) if command -v python3 >/dev/null; then python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$f" 2>/dev/null || note "a partial file under its final name: $f ($(wc -c <"$f") bytes)"
              else tail -c 3 "$f" | grep -q '}' || note "a partial file: $f"; fi ;;
      *.svg) tail -c 8 "$f" | grep -q '</svg>' || note "a partial file under its final name: $f ($(wc -c <"$f") bytes)" ;;
      *.pickle) tail -c 1 "$f" | grep -q '[.]' || note "a partial file under its final name: $f ($(wc -c <"$f") bytes)" ;;
    esac
  done
}
t_result_files_are_whole_or_absent() {
  # memory --out: the JSON timeline (about 20 KB) fits under 40 KiB, the SVG plot (about 110 KB) does not
  local out=$tmp/mem_limited prof=$tmp/prof_limited name=cpu_custom_ctx32_train_fp32_naive
  (trap '' XFSZ; ulimit -f 40; exec "$B/memory" --device cpu "${MEMTINY[@]}" --mode train --dtype fp32 --out "$out" --format csv >"$tmp/out" 2>"$tmp/err")
  rc=$?
  expect_rc 1 "memory --out past the file size limit"
  expect_in "$tmp/out" "error: --out: cannot write .*$name.\\{json,svg,pickle\\}: .*File too large" "the error row"
  [ -s "$out/$name.json" ] || note "the timeline that fitted was not put in place"
  [ -e "$out/$name.svg" ] && note "a plot left under its final name"
  check_no_partial "$out"
  # a file already there keeps what it had when its replacement cannot be written
  echo '<svg>the previous plot</svg>' >"$out/$name.svg"
  (trap '' XFSZ; ulimit -f 40; exec "$B/memory" --device cpu "${MEMTINY[@]}" --mode train --dtype fp32 --out "$out" --format csv >"$tmp/out" 2>"$tmp/err")
  rc=$?
  expect_rc 1 "memory --out past the file size limit, again"
  [ "$(cat "$out/$name.svg")" = '<svg>the previous plot</svg>' ] || note "the previous plot was overwritten: $(head -c 100 "$out/$name.svg")"
  check_no_partial "$out"
  # e2e --profile: the Chrome trace (about 50 KB) written by the library, past an 8 KiB limit
  (trap '' XFSZ; ulimit -f 8; exec "$B/e2e" "${TINY[@]}" --context-length 8 --steps 1 --profile "$prof" >"$tmp/out" 2>"$tmp/err")
  rc=$?
  expect_rc 1 "e2e --profile past the file size limit"
  expect_in "$tmp/out" "error: --profile: write to '[^']*/cpu_custom_T8_forward-backward_fp32_naive.json' failed" "the error row names the file"
  [ -n "$(ls "$prof")" ] && note "files under their final names: $(ls "$prof")"
  check_no_partial "$prof"
  # and whole when there is room: the trace, the tables, summary.csv appended to (a line per run)
  run "$B/e2e" "${TINY[@]}" --context-length 8 --steps 1 --profile "$prof"
  run "$B/e2e" "${TINY[@]}" --context-length 8 --steps 1 --profile "$prof"
  expect_rc 0 "e2e --profile"
  [ "$(grep -c '^cpu_custom_T8_forward-backward_fp32_naive,' "$prof/summary.csv" 2>/dev/null)" = 2 ] || note "summary.csv: $(cat "$prof/summary.csv" 2>&1)"
  [ -s "$prof/cpu_custom_T8_forward-backward_fp32_naive.md" ] || note "no tables"
  check_no_partial "$prof"
}

# ddp --lowp-copies / --lowp-grads / --opt-in-backward: three columns of every row; kept copies train under
# bf16 on the CPU; where an option does not apply (fp32, kept copies under ZeRO-1, --lowp-grads without --grad-comm gather,
# which needs GPUs; AdamW in backward with flat, on the CPU but under FSDP, or under ZeRO-1 without the gather, whose
# owners' mode needs GPUs too) the row is skipped with the rule.
t_dist_ddp_lowp() {
  [ -x "$B/ddp" ] || { echo -n "(no $B/ddp: skipped) "; return; }
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --dtype fp32,bf16 --strategy bucketed,zero1 --bucket-mb 1 --lowp-copies yes
  expect_rc 0 "ddp --lowp-copies yes"
  expect_in "$tmp/out" '^device,model,ranks,strategy,bucket_mb,grad_comm,dtype,context,batch,ckpt,loss,compiled,lowp_copies,lowp_grads,opt_in_bwd,step_ms,' "the columns"
  expect_in "$tmp/out" '^cpu,custom,2,bucketed,1,fp32,bf16,16,1,none,mean,no,yes,no,no,[0-9.]+,.*,ok$' "kept copies under bf16: a measured row"
  expect_in "$tmp/out" '^cpu,custom,2,bucketed,1,fp32,fp32,.*,skipped: --lowp-copies and --lowp-grads apply under --dtype bf16$' "fp32: skipped"
  expect_in "$tmp/out" '^cpu,custom,2,zero1,1,fp32,bf16,.*,skipped: --lowp-copies is for the DDP strategies and zero1 with --opt-in-backward yes \(ZeRO-1.s AdamW holds only its own parameters\)$' "zero1: skipped"
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --dtype bf16 --strategy bucketed --lowp-grads yes
  expect_rc 0 "ddp --lowp-grads yes without gather"
  expect_in "$tmp/out" '^cpu,custom,2,bucketed,.*,no,yes,no,.*skipped: --lowp-grads needs --grad-comm gather' "the rule of --lowp-grads"
  run "$B/ddp" --nproc 1 "${DDPTINY[@]}" --dtype bf16 --strategy bucketed --lowp-grads yes
  expect_rc 0 "ddp --lowp-grads yes on one rank"
  expect_in "$tmp/out" '^cpu,custom,1,bucketed,.*,no,yes,no,[0-9.]+,.*,ok$' "one rank averages nothing: a measured row"
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --strategy flat,bucketed --opt-in-backward yes
  expect_rc 0 "ddp --opt-in-backward yes on the CPU"
  expect_in "$tmp/out" '^cpu,custom,2,flat,.*skipped: --opt-in-backward needs a strategy that sends gradients during backward' "flat: skipped"
  expect_in "$tmp/out" '^cpu,custom,2,bucketed,.*,no,no,yes,.*skipped: --opt-in-backward needs --device cuda with NCCL' "the CPU: skipped"
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --strategy fsdp,zero1 --opt-in-backward yes
  expect_rc 0 "ddp --opt-in-backward yes under FSDP and ZeRO-1"
  expect_in "$tmp/out" '^cpu,custom,2,fsdp,.*,no,no,yes,[0-9.]+,.*,ok$' "fsdp: a measured row on the CPU"
  expect_in "$tmp/out" '^cpu,custom,2,zero1,.*skipped: --opt-in-backward under zero1 needs --grad-comm gather \(each bucket.s owner updates it inside backward\)$' "zero1: skipped"
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --strategy zero1 --grad-comm gather --opt-in-backward yes
  expect_rc 0 "ddp zero1 as the buckets' owners on the CPU"
  expect_in "$tmp/out" '^cpu,custom,2,zero1,.*,gather\+owners,.*skipped: --opt-in-backward needs --device cuda with NCCL$' "zero1 owners: the CPU's rule"
}

# ddp --strategy fsdp --grad-comm gather (tsys_fsdp_desc.ce_transfers): one FSDP row for fp32 and bf16 (NCCL's, in the
# compute dtype either way) and one for gather, which is skipped with its rule where it cannot run: without AdamW in
# backward and kept units, on the CPU, on one rank.
t_dist_ddp_fsdp_ce() {
  [ -x "$B/ddp" ] || { echo -n "(no $B/ddp: skipped) "; return; }
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --strategy fsdp --grad-comm fp32,bf16,gather
  expect_rc 0 "ddp fsdp --grad-comm fp32,bf16,gather"
  [ "$(grep -c '^cpu,custom,2,fsdp' "$tmp/out")" = 2 ] || note "fsdp: $(grep -c '^cpu,custom,2,fsdp' "$tmp/out") rows for fp32,bf16,gather (wanted 2)"
  expect_in "$tmp/out" '^cpu,custom,2,fsdp,,,fp32,.*,ok$' "fsdp through the collectives: a measured row"
  expect_in "$tmp/out" '^cpu,custom,2,fsdp,,gather,.*skipped: --strategy fsdp --grad-comm gather needs --opt-in-backward yes and --fsdp-reshard no' "gather: the rule of its options"
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --strategy fsdp --grad-comm gather --opt-in-backward yes --fsdp-reshard no
  expect_rc 0 "ddp fsdp gather with its options on the CPU"
  expect_in "$tmp/out" '^cpu,custom,2,fsdp:keep,,gather,.*skipped: --strategy fsdp --grad-comm gather needs --device cuda with NCCL$' "gather: the CPU's rule"
  run "$B/ddp" --nproc 1 "${DDPTINY[@]}" --strategy fsdp --grad-comm gather --opt-in-backward yes --fsdp-reshard no
  expect_rc 0 "ddp fsdp gather on one rank"
  expect_in "$tmp/out" '^cpu,custom,1,fsdp:keep,,gather,.*skipped: --strategy fsdp --grad-comm gather needs 2 or more ranks' "gather: one rank's rule"
}

# ddp --profile: rank 0's profile of one more eager step of each configuration, its phases as the
# trainer names them (forward, backward, optimizer: a table with none is a profile of nothing), a trace
# JSON can read, the files listed after the table; a folder that cannot be made stops every rank.
t_dist_ddp_profile_files() {
  [ -x "$B/ddp" ] || { echo -n "(no $B/ddp: skipped) "; return; }
  local prof="$tmp/prof" n
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --strategy fsdp,bucketed --bucket-mb 1 --profile "$prof"
  expect_rc 0 "ddp --profile"
  for n in cpu_custom_T16_fp32_fsdp_2ranks cpu_custom_T16_fp32_bucketed_2ranks_bucket-1; do
    expect_in "$tmp/err" "^profile of $n: $prof/$n.md, $prof/$n.json\$" "ddp --profile lists $n (csv: on stderr)"
    grep -Eq 'kernel time by phase: forward [0-9.]*[1-9][0-9.]*, backward [0-9.]*[1-9][0-9.]*, optimizer [0-9.]*[1-9][0-9.]* ms' "$prof/$n.md" 2>/dev/null ||
      note "$n.md: a phase without kernel time: $(grep 'kernel time' "$prof/$n.md" 2>&1)"
    python3 -c 'import json, sys; t = json.load(open(sys.argv[1])); ev = t["traceEvents"] if isinstance(t, dict) else t
names = {e.get("name") for e in ev}
sys.exit(0 if {"forward", "backward", "optimizer"} <= names else "phases missing from the trace")' "$prof/$n.json" || note "$n.json"
  done
  check_no_partial "$prof"
  run "$B/ddp" --nproc 2 "${DDPTINY[@]}" --profile /proc/no/such/dir
  expect_rc 1 "ddp --profile into a folder that cannot be made"
  expect_in "$tmp/err" "^ddp: --profile: cannot make folder '/proc/no/such/dir'" "the message names the folder"
}

# ddp --checkpoint auto:BYTES: each row's policy is chosen for its strategy and ranks and named in the row;
# a budget nothing fits runs the least peak and says so; --account has no strategy to choose for.
t_dist_ddp_checkpoint_auto() {
  [ -x "$B/ddp" ] || { echo -n "(no $B/ddp: skipped) "; return; }
  local base=(--nproc 2 --device cpu --model custom --d-model 64 --num-layers 4 --num-heads 2 --d-ff 128 --vocab-size 97 --batch-size 2
              --context-length 64 --warmup 0 --steps 1 --bucket-mb 1 --format csv)
  run "$B/ddp" "${base[@]}" --strategy bucketed,fsdp --checkpoint auto:4MiB
  expect_rc 0 "ddp --checkpoint auto:4MiB"
  expect_in "$tmp/out" '^cpu,custom,2,bucketed,1,fp32,fp32,64,2,[a-z]+:[0-9]+[+a-z:0-9-]* \(auto\),.*,ok$' "bucketed: a checkpointed policy, named"
  expect_in "$tmp/out" '^cpu,custom,2,fsdp,,,fp32,64,2,none \(auto\),.*,ok$' "fsdp: its shards leave room for none"
  run "$B/ddp" "${base[@]}" --strategy fsdp --checkpoint auto:1MiB
  expect_rc 0 "ddp --checkpoint auto:1MiB"
  expect_in "$tmp/err" '^ddp: auto:1MiB: no policy fits; [a-z0-9:+-]+ has the least predicted peak \([0-9.]+ MiB a rank\)$' "nothing fits: said once"
  [ "$(grep -c 'no policy fits' "$tmp/err")" = 1 ] || note "said $(grep -c 'no policy fits' "$tmp/err") times"
  run "$B/ddp" --account --checkpoint auto:1GiB
  expect_rc 2 "ddp --account --checkpoint auto:1GiB"
  expect_in "$tmp/err" 'auto:BYTES is chosen per strategy' "--account says why"
}

# mesh: the layouts against each other and the plan. Two dp replicas (batches 0 and 1) trained seven ways, fp32:
# tensor parallelism (with and without sequence parallelism) under DDP and under FSDP on 4 ranks, plain DDP, FSDP
# and HSDP on 2: the first and last step's losses agree to 1e-5 (the paths share nothing but the weights' seed);
# each row's peak within 10% of the plan's.
MESHTINY=(--device cpu --model custom --d-model 64 --num-layers 2 --num-heads 4 --d-ff 128 --vocab-size 256 --context-length 64
          --batch-size 8 --warmup 1 --steps 3 --format csv)
t_mesh_layouts_agree() {
  [ -x "$B/mesh" ] || { echo -n "(no $B/mesh: skipped) "; return; }
  run "$B/mesh" --nproc 4 "${MESHTINY[@]}" --layout dp_tp:2,fsdp_tp:2,dp_tp_sp:2,fsdp_tp_sp:2
  expect_rc 0 "mesh at 4 ranks"
  cp "$tmp/out" "$tmp/four"
  run "$B/mesh" --nproc 2 "${MESHTINY[@]}" --layout dp,fsdp,hsdp:2
  expect_rc 0 "mesh at 2 ranks"
  cat "$tmp/four" >> "$tmp/out"
  [ "$(grep -c ',ok$' "$tmp/out")" = 7 ] || note "$(grep -c ',ok$' "$tmp/out") ok rows, wanted 7: $(cat "$tmp/out")"
  local bad
  bad=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next } $1 == "device" { next }
    { f = $c["loss_first"]; l = $c["loss_last"]; pk = $c["peak_MiB"]; pp = $c["pred_peak_MiB"]
      if (!n++) { f0 = f; l0 = l }
      if ((f - f0)^2 > (1e-5 * f0)^2 || (l - l0)^2 > (1e-5 * l0)^2) print $c["layout"] " at " $c["ranks"] " ranks: losses " f ", " l " against " f0 ", " l0
      if ((pp - pk)^2 > (0.1 * pk)^2) print $c["layout"] ": peak " pk " MiB, plan " pp }' "$tmp/out")
  [ -z "$bad" ] || note "$bad"
}

# mesh in bf16: FSDP gathers the vocabulary-parallel embedding's rows in bf16, which its mask must take (it
# refused everything but f32 once); the FSDP x TP rows, with and without sequence parallelism, follow dp x tp's
# losses (the same batches, bf16 rounding apart).
t_mesh_bf16_fsdp_tp() {
  [ -x "$B/mesh" ] || { echo -n "(no $B/mesh: skipped) "; return; }
  run "$B/mesh" --nproc 4 "${MESHTINY[@]}" --dtype bf16 --layout dp_tp:2,fsdp_tp:2,fsdp_tp_sp:2
  expect_rc 0 "mesh --dtype bf16 at 4 ranks"
  [ "$(grep -c ',ok$' "$tmp/out")" = 3 ] || note "$(grep -c ',ok$' "$tmp/out") ok rows, wanted 3: $(cat "$tmp/out")"
  local bad
  bad=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next } $1 == "device" { next }
    { f = $c["loss_first"]; l = $c["loss_last"]; if (!n++) { f0 = f; l0 = l }
      if ((f - f0)^2 > (1e-3 * f0)^2 || (l - l0)^2 > (1e-3 * l0)^2) print $c["layout"] ": losses " f ", " l " against dp_tp " f0 ", " l0 }' "$tmp/out")
  [ -z "$bad" ] || note "$bad"
}

# mesh's refusals: a layout the parser does not know is a usage error naming the flag; a split that does not
# divide the ranks is the row's error (exit status 1), the other rows still run.
t_mesh_bad_layouts() {
  [ -x "$B/mesh" ] || { echo -n "(no $B/mesh: skipped) "; return; }
  run "$B/mesh" "${MESHTINY[@]}" --layout tp
  expect_rc 2 "mesh --layout tp"
  expect_in "$tmp/err" "--layout" "names the flag"
  run "$B/mesh" "${MESHTINY[@]}" --layout fsdp_sp
  expect_rc 2 "mesh --layout fsdp_sp (sequence parallelism without tensor parallelism)"
  run "$B/mesh" --nproc 2 "${MESHTINY[@]}" --layout tp:3,tp:2
  expect_rc 1 "mesh --layout tp:3 at 2 ranks"
  expect_in "$tmp/out" 'tp:3,.*error: --layout tp:3: 3 does not divide the 2 ranks' "the row says why"
  expect_in "$tmp/out" 'tp:2,.*,ok$' "the next row runs"
}

# ddp --plan: the S26 section 8 cost model, one row per layout of the ranks (tp over the divisors of 4);
# the small model's dp row sends 2 x 3/4 x its 128,625,408 fp32 gradients = 771.8 MB a rank.
t_dist_ddp_plan() {
  [ -x "$B/ddp" ] || { echo -n "(no $B/ddp: skipped) "; return; }
  run "$B/ddp" --plan --model small --nproc 4 --dtype bf16 --format csv
  expect_rc 0 "ddp --plan"
  expect_in "$tmp/out" '^small,bf16,256,4,4,dp,4,1,[0-9.]+,[0-9.]+,0\.00,[0-9.]+,[0-9.]+,771\.8,0\.0,' "the dp row's bytes"
  for l in fsdp,4,1 dp_tp,2,2 fsdp_tp,2,2 tp,1,4; do expect_in "$tmp/out" "^small,bf16,256,4,4,$l," "a $l row"; done
  [ "$(grep -c '^small,' "$tmp/out")" = 5 ] || note "$(grep -c '^small,' "$tmp/out") rows, wanted 5"
  # the dp row's peak is DDP's accounting (--account's ddp total), tp's below it
  local dp_peak tp_peak acct
  dp_peak=$(awk -F, '$6 == "dp" { print $17 }' "$tmp/out"); tp_peak=$(awk -F, '$6 == "tp" { print $17 }' "$tmp/out")
  run "$B/ddp" --account --model small --nproc 4 --dtype bf16 --format csv
  acct=$(awk -F, '$7 == "ddp" { print $12 }' "$tmp/out")
  [ -n "$dp_peak" ] && [ "$dp_peak" = "$acct" ] || note "dp row's peak_MiB '$dp_peak', --account's ddp total '$acct'"
  awk -v t="$tp_peak" -v d="$dp_peak" 'BEGIN { exit !(t > 0 && t < d) }' || note "tp row's peak_MiB '$tp_peak' not below dp's '$dp_peak'"
  run "$B/ddp" --plan --account
  expect_rc 2 "ddp --plan --account"
  expect_in "$tmp/err" 'print different tables' "says why"
}

# ddp --save-every/--save-dir/--resume, each strategy at 2 ranks: 4 steps saving at step 4, against 2 steps
# saving at 2 and a resumed run of 2 more saving at 4: the two step-4 snapshots hold the same tensors, byte
# for byte (DDP: rank 0's plain snapshot; zero1, fsdp: every rank's part).
same_snapshot_tensors() {   # dir dir
  python3 - "$1" "$2" <<'PY'
import json, os, struct, sys
def tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if not f.endswith('.safetensors'): continue
        with open(os.path.join(d, f), 'rb') as h:
            n = struct.unpack('<Q', h.read(8))[0]; head = json.loads(h.read(n)); data = h.read()
        for k, v in head.items():
            if k != '__metadata__': out[f + ':' + k] = data[v['data_offsets'][0]:v['data_offsets'][1]]
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
bad = [k for k in a if a[k] != b.get(k)]
if not a or a.keys() != b.keys() or bad: sys.exit('%d tensors against %d, differing: %s' % (len(a), len(b), bad[:3]))
PY
}
t_dist_ddp_save_resume_bitwise() {
  [ -x "$B/ddp" ] || { echo -n "(no $B/ddp: skipped) "; return; }
  command -v python3 >/dev/null || { echo -n "(no python3: skipped) "; return; }
  local s base=(--nproc 2 --device cpu --model custom --d-model 32 --num-layers 2 --num-heads 2 --d-ff 64 --vocab-size 97 --batch-size 1
                --context-length 16 --warmup 0 --bucket-mb 1 --format csv)
  for s in flat zero1 fsdp; do
    run "$B/ddp" "${base[@]}" --strategy $s --steps 4 --save-every 4 --save-dir "$tmp/$s-a"
    expect_rc 0 "ddp --strategy $s: 4 steps saving at 4"
    run "$B/ddp" "${base[@]}" --strategy $s --steps 2 --save-every 2 --save-dir "$tmp/$s-b"
    expect_rc 0 "ddp --strategy $s: 2 steps saving at 2"
    run "$B/ddp" "${base[@]}" --strategy $s --steps 2 --save-every 2 --save-dir "$tmp/$s-b" --resume "$tmp/$s-b"
    expect_rc 0 "ddp --strategy $s: resumed for 2 more"
    [ -f "$tmp/$s-b/step-000004/MANIFEST" ] || note "$s: the resumed run saved no step-000004: $(ls "$tmp/$s-b" 2>&1)"
    same_snapshot_tensors "$tmp/$s-a/step-000004" "$tmp/$s-b/step-000004" 2>"$tmp/cmp" || note "$s: the step-4 snapshots differ: $(cat "$tmp/cmp")"
  done
  [ "$s" = fsdp ] && grep -q '^world=2$' "$tmp/fsdp-a/step-000004/MANIFEST" || note "fsdp: no world=2 in the MANIFEST"
  run "$B/ddp" "${base[@]}" --strategy flat,zero1 --steps 1 --save-dir "$tmp/x"
  expect_rc 2 "--save-dir over two configurations"
  snapshot_tool "$tmp"
}

# assemble_check PARTS PLAIN: the tensors of the sharded snapshot PARTS (rank-*.safetensors, each chunk's
# place in "chunk.<fqn>" = "<offset> <global shape>") put together here, independently of tsys, equal
# those of the plain snapshot PLAIN byte for byte, and cover them.
assemble_check() {
  python3 - "$1" "$2" <<'PY'
import glob, json, os, struct, sys
def read(path):
    with open(path, "rb") as f: b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n]); meta = head.pop("__metadata__", {})
    return meta, {k: (v["dtype"], v["shape"], b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]) for k, v in head.items()}
whole, bad = {}, []
for part in sorted(glob.glob(os.path.join(sys.argv[1], "rank-*.safetensors"))):
    meta, tensors = read(part)
    for k, (dt, shape, data) in tensors.items():
        at, glob_shape = meta.get("chunk." + k, "0 " + ",".join(map(str, shape))).split(" ")
        glob_shape = [int(x) for x in glob_shape.split(",") if x]
        size = 4 if dt == "F32" else 2
        numel = 1
        for d in glob_shape: numel *= d
        buf = whole.setdefault(k, (dt, glob_shape, bytearray(numel * size), []))
        buf[2][int(at) * size:int(at) * size + len(data)] = data; buf[3].append((int(at), len(data) // size))
plain = {}
for f in ("model.safetensors", "train_state.safetensors"): plain.update(read(os.path.join(sys.argv[2], f))[1])
if set(plain) != set(whole): bad.append(f"tensors in one only: {sorted(set(plain) ^ set(whole))[:4]}")
for k, (dt, shape, data, chunks) in whole.items():
    covered = sum(n for _, n in chunks) * (4 if dt == "F32" else 2)
    if covered != len(data): bad.append(f"{k}: the parts cover {covered} of {len(data)} bytes")
    elif k in plain and (plain[k][0], plain[k][1], plain[k][2]) != (dt, shape, bytes(data)): bad.append(f"{k}: differs")
if not whole: bad.append("no parts")
print("\n".join(bad[:6])); sys.exit(1 if bad else 0)
PY
}

# The snapshot tool (build/snapshot) on the sharded snapshots ddp wrote into DIR: info lists them with
# their world size and marks the newest; consolidate makes each a plain one whose tensors are the
# parts put together (checked by assemble_check), which info then reads as world 0; an altered byte in
# a part fails consolidate with exit 1 naming the file; usage errors exit 2.
snapshot_tool() {
  local d=$1 s
  [ -x "$B/snapshot" ] || { note "no $B/snapshot"; return; }
  run "$B/snapshot" info "$d/zero1-b"
  expect_rc 0 "snapshot info on a directory"
  grep -q '^| step-000002 | 2 | 2 | ' "$tmp/out" && grep -q '^| step-000004 | 4 | 2 | .* | ok, newest |$' "$tmp/out" || note "info: $(cat "$tmp/out")"
  for s in zero1 fsdp; do
    run "$B/snapshot" consolidate "$d/$s-a/step-000004" "$d/$s-plain"
    expect_rc 0 "snapshot consolidate $s"
    assemble_check "$d/$s-a/step-000004" "$d/$s-plain/step-000004" > "$tmp/py" 2>&1 || note "$s consolidated: $(head -c 400 "$tmp/py")"
    run "$B/snapshot" info "$d/$s-plain/step-000004"
    grep -q '| 4 | 0 | ' "$tmp/out" || note "$s consolidated, info: $(cat "$tmp/out")"
  done
  cp -r "$d/fsdp-a/step-000004" "$d/damaged"
  printf '\x55' | dd of="$d/damaged/rank-00001.safetensors" bs=1 seek=300 conv=notrunc 2>/dev/null
  run "$B/snapshot" consolidate "$d/damaged" "$d/damaged-plain"
  expect_rc 1 "consolidate of an altered part"
  expect_in "$tmp/err" "rank-00001.safetensors" "the altered part named"
  run "$B/snapshot" consolidate "$d/damaged"
  expect_rc 2 "consolidate without DIR"
  run "$B/snapshot" bogus x
  expect_rc 2 "an unknown command"
}

# ---- runner -------------------------------------------------------------------------------------------

pass=0; fail=0
for t in $(declare -F | awk '{print $3}' | grep '^t_'); do
  [ -n "$filter" ] && [[ "$t" != *"$filter"* ]] && continue
  why=""
  printf '  %-44s ' "${t#t_}"
  $t
  if [ -z "$why" ]; then echo ok; pass=$((pass + 1)); else echo " -> FAILED$why"; fail=$((fail + 1)); fi
done
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
