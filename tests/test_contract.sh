#!/usr/bin/env bash
# test_contract.sh BINDIR - every driver (e2e, attn, precision, memory, ddp, mesh, allreduce) through the
# same contract cases, the README's promises: --help (every shared flag and the exit codes),
# --dry-run (the configuration count, which a real run then matches), bad flags and values (exit 2,
# the flag named), --flag=value, csv and jsonl that Python's csv and json read from stdout alone with
# numeric columns numeric and not-applicable cells empty / null, --progress on, exit 1 on an
# out-of-memory row and 0 with --oom-ok.
# Prints "N passed, N failed" last, like the C tests.
#
#   tests/test_contract.sh build [name-filter]
set -u
B=${1:-${BUILD:-build}}
filter=${2:-}
# TSYS_CONTRACT_DRIVERS="e2e attn": a subset (a GPU machine runs the CUDA builds of some)
read -r -a DRIVERS <<<"${TSYS_CONTRACT_DRIVERS:-e2e attn precision memory ddp mesh allreduce}"
for d in "${DRIVERS[@]}"; do
  [ -x "$B/$d" ] || { echo "test_contract: $B/$d is missing (make $B/$d)"; echo "0 passed, 1 failed"; exit 1; }
done
command -v python3 >/dev/null || { echo "test_contract: python3 is needed"; echo "0 passed, 1 failed"; exit 1; }
tmp=$(mktemp -d /tmp/tsys_contract_XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1 TSYS_DIST_TIMEOUT=60

# The smallest real run of each driver: two configurations, milliseconds each.
# head dim 16: the smallest the CUDA flash kernels take (memory sweeps bf16 by default, and auto picks flash there)
MODEL=(--model custom --d-model 32 --num-layers 1 --num-heads 2 --d-ff 64 --vocab-size 64 --batch-size 1)
args_of() {
  case "$1" in
  e2e) echo "${MODEL[*]} --context-length 8,16 --warmup 0 --steps 2 --no-sgemm" ;;
  attn) echo "--impl naive --batch 1 --seq 16,32 --d 16 --warmup 0 --reps 1" ;;
  precision) echo "" ;;
  memory) echo "${MODEL[*]} --context-length 8,16 --mode train" ;;
  ddp) echo "--nproc 2 ${MODEL[*]} --strategy naive,flat --context-length 8 --warmup 0 --steps 1" ;;
  mesh) echo "--nproc 2 ${MODEL[*]} --layout tp:2,fsdp --context-length 8 --warmup 0 --steps 1" ;;
  allreduce) echo "--nproc 2 --sizes 1KB,4KB --warmup 0 --iters 2" ;;
  esac
}

why=""
note() { why="$why"$'\n'"      $*"; }
run() {   # stdout in $tmp/out, stderr in $tmp/err, exit status in $rc (124: it hung)
  timeout 120 "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -eq 124 ] && note "timed out: $*"
  return 0
}
expect_rc() { [ "$rc" -eq "$1" ] || note "exit status $rc, wanted $1 ($2); stderr: $(head -c 300 "$tmp/err")"; }
expect_in() { grep -qE -- "$2" "$1" || note "$3: no match for '$2' in $(basename "$1"): $(head -c 300 "$1")"; }

# The number a dry run announces ("<prog>: dry run: N configurations would run"), from file $1.
dry_count() { sed -nE 's/.*: dry run: ([0-9]+) configurations? would run.*/\1/p' "$1" | tail -1; }

t_help_lists_the_shared_flags_and_exit_codes() {
  local d f
  for d in "${DRIVERS[@]}"; do
    run "$B/$d" --help
    expect_rc 0 "$d --help"
    for f in --format --progress --mem-limit --oom-ok --dry-run --help; do
      expect_in "$tmp/out" "^  $f( |$)" "$d --help lists $f"
    done
    expect_in "$tmp/out" "--flag=value" "$d --help: both flag spellings"
    expect_in "$tmp/out" 'exit status: 0 .*, 1 ' "$d --help: exit codes 0 and 1"
    expect_in "$tmp/out" ', 2 bad usage' "$d --help: exit code 2"
    [ -s "$tmp/err" ] && note "$d --help wrote to stderr: $(head -c 200 "$tmp/err")"
  done
}

t_bad_usage_names_the_flag_and_exits_2() {
  local d
  for d in "${DRIVERS[@]}"; do
    run "$B/$d" --bogus
    expect_rc 2 "$d --bogus"
    expect_in "$tmp/err" "unknown flag '--bogus'" "$d --bogus"
    run "$B/$d" --bogus=3
    expect_rc 2 "$d --bogus=3"
    expect_in "$tmp/err" "unknown flag '--bogus'" "$d --bogus=3 names the flag without its value"
    run "$B/$d" --format xml
    expect_rc 2 "$d --format xml"
    expect_in "$tmp/err" "--format takes md, csv or jsonl, not 'xml'" "$d --format xml"
    run "$B/$d" --progress=sometimes
    expect_rc 2 "$d --progress=sometimes"
    expect_in "$tmp/err" "--progress takes auto, on or off" "$d --progress=sometimes"
    run "$B/$d" --dry-run=yes
    expect_rc 2 "$d --dry-run=yes"
    expect_in "$tmp/err" "--dry-run takes no value" "$d --dry-run=yes"
    run "$B/$d" --mem-limit
    expect_rc 2 "$d --mem-limit without a value"
    expect_in "$tmp/err" "--mem-limit needs a value" "$d --mem-limit"
    run "$B/$d" stray
    expect_rc 2 "$d stray"
    expect_in "$tmp/err" "unexpected argument 'stray'" "$d stray"
  done
}

# --dry-run counts the configurations; csv/jsonl keep stdout empty (the rows' stream), the count on
# stderr; the --flag=value spelling means the same as --flag value.
t_dry_run_counts_and_keeps_stdout_for_rows() {
  local d n m
  for d in "${DRIVERS[@]}"; do
    # shellcheck disable=SC2046
    run "$B/$d" $(args_of $d) --dry-run
    expect_rc 0 "$d --dry-run"
    n=$(dry_count "$tmp/out")
    [ -n "$n" ] && [ "$n" -ge 1 ] || note "$d --dry-run: no count on stdout: $(tail -c 200 "$tmp/out")"
    run "$B/$d" $(args_of $d) --dry-run --format=csv
    expect_rc 0 "$d --dry-run --format=csv"
    [ -s "$tmp/out" ] && note "$d --dry-run --format=csv printed on stdout: $(head -c 200 "$tmp/out")"
    m=$(dry_count "$tmp/err")
    [ "$m" = "$n" ] || note "$d --dry-run --format=csv: count '$m' on stderr, md said '$n'"
  done
}

# A real run in csv and in jsonl: stdout alone parses; both hold the rows the dry run announced, the
# same columns, numbers where a column holds numbers, empty / null where a cell does not apply.
t_csv_and_jsonl_parse_with_numeric_columns() {
  local d n
  for d in "${DRIVERS[@]}"; do
    run "$B/$d" $(args_of $d) --dry-run --format csv
    n=$(dry_count "$tmp/err")
    run "$B/$d" $(args_of $d) --format csv
    expect_rc 0 "$d --format csv"
    cp "$tmp/out" "$tmp/$d.csv"
    run "$B/$d" $(args_of $d) --format=jsonl
    expect_rc 0 "$d --format=jsonl"
    cp "$tmp/out" "$tmp/$d.jsonl"
    if ! python3 - "$tmp/$d.csv" "$tmp/$d.jsonl" "${n:-0}" >"$tmp/py" 2>&1 <<'EOF'
import csv, json, sys
csv_path, jsonl_path, want = sys.argv[1], sys.argv[2], int(sys.argv[3])
def number(s):
    try: float(s); return True
    except ValueError: return False
bad = []
with open(csv_path, newline="") as f:
    rows = list(csv.DictReader(f))
with open(jsonl_path) as f:
    objs = [json.loads(line) for line in f if line.strip()]
if len(rows) != want: bad.append(f"csv: {len(rows)} rows, the dry run said {want}")
if len(objs) != want: bad.append(f"jsonl: {len(objs)} rows, the dry run said {want}")
if rows and objs and list(rows[0].keys()) != list(objs[0].keys()): bad.append("csv and jsonl columns differ")
if rows and "status" not in rows[0]: bad.append("no status column")
for r in rows:
    if r.get("status") != "ok": bad.append(f"csv row status {r.get('status')!r}")
    for k, v in r.items():
        if v == "-" or v is None: bad.append(f"csv: column {k} reads {v!r} (not applicable is empty)")
cols = list(objs[0].keys()) if objs else []
for c in cols:
    vals = [o[c] for o in objs if o[c] is not None]
    if any(isinstance(v, (int, float)) for v in vals) and not all(isinstance(v, (int, float)) for v in vals):
        bad.append(f"jsonl: column {c} mixes numbers and text: {vals}")
    if any(v in ("-", "") for v in vals): bad.append(f"jsonl: column {c} holds {vals} (not applicable is null)")
    cvals = [r[c] for r in rows if r[c] != ""]
    if any(number(v) for v in cvals) and not all(number(v) for v in cvals):
        bad.append(f"csv: column {c} mixes numbers and text: {cvals}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
EOF
    then note "$d: $(head -c 600 "$tmp/py")"; fi
  done
}

t_progress_on_says_configuration_k_of_n() {
  local d
  for d in "${DRIVERS[@]}"; do
    run "$B/$d" $(args_of $d) --format csv --progress on
    expect_rc 0 "$d --progress on"
    expect_in "$tmp/err" "configuration 1 of [0-9]+" "$d --progress on: configuration k of N"
    [ "$d" = precision ] || expect_in "$tmp/err" "step [0-9]+ of [0-9]+, ETA" "$d --progress on: step s of S, ETA"
    run "$B/$d" $(args_of $d) --format csv --progress off
    grep -q "configuration 1 of" "$tmp/err" && note "$d --progress off still reports progress"
  done
}

# An out-of-memory row fails the run (1) unless --oom-ok says it is expected (0); nothing crashes.
t_oom_row_exit_codes() {
  local d
  for d in "${DRIVERS[@]}"; do
    run "$B/$d" $(args_of $d) --format jsonl --mem-limit 0.0000001
    expect_rc 1 "$d out of memory"
    grep -q '"OOM' "$tmp/out" || note "$d --mem-limit 0.0000001: no OOM row: $(head -c 300 "$tmp/out") $(head -c 300 "$tmp/err")"
    run "$B/$d" $(args_of $d) --format jsonl --mem-limit 0.0000001 --oom-ok
    expect_rc 0 "$d out of memory under --oom-ok"
  done
}

passed=0; failed=0
for t in $(declare -F | awk '{print $3}' | grep '^t_'); do
  [ -n "$filter" ] && [[ "$t" != *"$filter"* ]] && continue
  why=""
  $t
  if [ -z "$why" ]; then echo "  ok   $t"; passed=$((passed + 1))
  else echo "  FAIL $t$why"; failed=$((failed + 1)); fi
done
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
