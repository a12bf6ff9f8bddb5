#!/usr/bin/env bash
# test_tour.sh [README] - the README's tour, run as written: every line that starts with "$ " inside a
# fenced block between <!-- tour --> and <!-- /tour --> is a command, run from the repository root with
# bash; the lines under it, up to the next command or the end of the block, are what it prints. A
# command passes when it exits 0 and the lines shown come out in the same order (stdout and stderr
# together, runs of spaces squeezed): every number matches any number (timings differ from machine to
# machine; digits glued to a letter, as in fp32 or T128, stay as written), "..." inside a line matches anything, and a line that is only "..." or blank is skipped.
# Files a command names also have to be what the README says: the Chrome trace of --profile DIR
# parses as JSON, the plot of --out DIR is an SVG document beside a JSON timeline (a DIR under build/
# is removed first, so what is checked was written by this run; the tour writes nowhere else).
# The C program between <!-- example --> and <!-- /example --> is compiled the way the README says
# (with this Makefile's BLAS detection) and run; its last line must show the third step's loss.
# Prints one "ok ..." / "FAIL ..." line per command and "N passed, N failed" last.
#
#   tests/test_tour.sh [README.md]
set -u
cd "$(dirname "$0")/.."
readme=${1:-README.md}
tmp=$(mktemp -d /tmp/tsys_tour_XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export TSYS_PROGRESS=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
pass=0; fail=0

# The tour: "C<TAB>command" and "O<TAB>output line" records, in README order.
awk '
  /^<!-- tour -->/   { on = 1; next }
  /^<!-- \/tour -->/ { on = 0; next }
  on && /^```/       { fence = !fence; next }
  on && fence && /^\$ / { print "C\t" substr($0, 3); next }
  on && fence        { print "O\t" $0 }
' "$readme" > "$tmp/tour"

# squeeze: runs of blanks to one space, no trailing blanks or carriage returns
squeeze() { sed -E 's/\r$//; s/[[:blank:]]+/ /g; s/ $//'; }
# to_regex: a README output line as an anchored ERE (numbers and inline "..." are wildcards)
NUM='[-+]?[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?'
to_regex() {
  printf '%s\n' "$1" | squeeze | sed -E \
    -e 's/\.\.\./\x02/g' \
    -e "s/(^|[^A-Za-z_0-9.])$NUM/\1\x01/g" \
    -e 's/[][\.*^$(){}+?|]/\\&/g' \
    -e "s/\x01/$NUM/g" \
    -e 's/\x02/.*/g' -e 's/^/^/' -e 's/$/$/'
}

why=""
note() { why="$why"$'\n'"      $*"; }

# check_files CMD: what the command's output files must be
check_files() {
  local cmd=$1 dir f
  if [[ "$cmd" =~ --profile[[:blank:]]+([^[:blank:]]+) ]]; then
    dir=${BASH_REMATCH[1]}
    f=$(ls "$dir"/*.json 2>/dev/null | head -n 1)
    if [ -z "$f" ]; then note "no Chrome trace (*.json) in $dir"
    else
      if command -v python3 >/dev/null; then python3 -m json.tool "$f" > /dev/null 2>"$tmp/json.err" || note "$f is not JSON: $(head -c 200 "$tmp/json.err")"; fi
      grep -q '"traceEvents"' "$f" || note "$f has no traceEvents"
    fi
  fi
  if [[ "$cmd" =~ --out[[:blank:]]+([^[:blank:]]+) ]]; then
    dir=${BASH_REMATCH[1]}
    f=$(ls "$dir"/*.svg 2>/dev/null | head -n 1)
    if [ -z "$f" ]; then note "no plot (*.svg) in $dir"
    else
      head -c 5 "$f" | grep -q '^<svg ' || note "$f does not start with <svg"
      [ "$(tail -c 7 "$f" | tr -d '\n')" = "</svg>" ] || note "$f does not end with </svg>"
      [ -s "${f%.svg}.json" ] || note "no timeline ${f%.svg}.json beside the plot"
      if command -v python3 >/dev/null && [ -s "${f%.svg}.json" ]; then
        python3 -m json.tool "${f%.svg}.json" > /dev/null 2>&1 || note "${f%.svg}.json is not JSON"
      fi
    fi
  fi
}

# run_one CMD EXPECTED_FILE
run_one() {
  local cmd=$1 exp=$2 dir rc re pos=0 n line
  why=""
  for dir in $(printf '%s\n' "$cmd" | grep -oE -- '--(profile|out)[[:blank:]]+[^[:blank:]]+' | awk '{print $2}'); do
    case $dir in build/?*) rm -rf -- "$dir" ;; *) note "writes outside build/: $dir" ;; esac
  done
  # a clean environment for make: nothing inherited from a make that runs this script
  env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u MAKEOVERRIDES -u BUILD \
    timeout 900 bash -c "$cmd" > "$tmp/out" 2>&1
  rc=$?
  [ $rc -eq 0 ] || note "exit status $rc"
  squeeze < "$tmp/out" > "$tmp/out.sq"
  n=$(wc -l < "$tmp/out.sq")
  while IFS= read -r line; do
    case $(printf '%s' "$line" | squeeze) in ''|'...') continue ;; esac
    re=$(to_regex "$line")
    m=$(tail -n +$((pos + 1)) "$tmp/out.sq" | grep -n -m 1 -E -- "$re" | cut -d: -f1)
    if [ -z "$m" ]; then note "not in the output (after line $pos of $n): $line"; break; fi
    pos=$((pos + m))
  done < "$exp"
  [ $rc -eq 0 ] && check_files "$cmd"
  if [ -n "$why" ]; then
    note "output:"; why="$why"$'\n'"$(tail -n 15 "$tmp/out" | sed 's/^/        /')"
  fi
}

report() {   # report NAME
  if [ -z "$why" ]; then echo "ok   $1"; pass=$((pass + 1)); else echo "FAIL $1$why"; fail=$((fail + 1)); fi
}

ncmd=$(grep -c '^C' "$tmp/tour")
if [ "$ncmd" -eq 0 ]; then why=""; note "no '\$ ' commands between <!-- tour --> and <!-- /tour --> in $readme"; report "tour: the commands"; fi
i=0
while [ $i -lt "$ncmd" ]; do
  i=$((i + 1))
  # command i and the output lines under it
  awk -F'\t' -v want=$i '$1 == "C" { c++ } c == want && $1 == "O" { sub(/^O\t/, ""); print }' "$tmp/tour" > "$tmp/exp"
  cmd=$(awk -F'\t' -v want=$i '$1 == "C" { c++; if (c == want) { sub(/^C\t/, ""); print } }' "$tmp/tour")
  run_one "$cmd" "$tmp/exp"
  report "\$ $cmd"
done

# The library example: compiled as the README says, with the Makefile's BLAS detection.
why=""
awk '/^<!-- example -->/ { on = 1; next } /^<!-- \/example -->/ { on = 0 } on && /^```/ { f = !f; next } on && f' "$readme" > "$tmp/step.c"
if [ ! -s "$tmp/step.c" ]; then note "no C program between <!-- example --> and <!-- /example -->"
else
  blas=(-DTSYS_NO_CBLAS); lib=()
  for l in /usr/lib/x86_64-linux-gnu/libopenblas.so /usr/lib/aarch64-linux-gnu/libopenblas.so /usr/lib/libopenblas.so /usr/lib64/libopenblas.so; do
    [ -e "$l" ] || continue
    for h in /usr/include/x86_64-linux-gnu/cblas.h /usr/include/openblas/cblas.h /usr/include/cblas.h; do
      [ -e "$h" ] && { blas=(-I"$(dirname "$h")"); lib=(-lopenblas); break 2; }
    done
  done
  if ! ${CC:-cc} -std=c11 -O2 -fopenmp -Wall -Wextra -I. "${blas[@]}" "$tmp/step.c" -o "$tmp/step" "${lib[@]}" -lm > "$tmp/cc.out" 2>&1; then
    note "does not compile:"; why="$why"$'\n'"$(head -n 15 "$tmp/cc.out" | sed 's/^/        /')"
  elif [ -s "$tmp/cc.out" ]; then
    note "compiler warnings:"; why="$why"$'\n'"$(head -n 15 "$tmp/cc.out" | sed 's/^/        /')"
  else
    timeout 300 "$tmp/step" > "$tmp/step.out" 2>&1; rc=$?
    [ $rc -eq 0 ] || note "exit status $rc: $(tail -n 3 "$tmp/step.out")"
    tail -n 1 "$tmp/step.out" | grep -qE '^step 2 loss [0-9]+\.[0-9]+$' || note "last line: $(tail -n 1 "$tmp/step.out")"
  fi
fi
report "the library example compiles and trains"

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
