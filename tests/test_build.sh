#!/usr/bin/env bash
# test_build.sh - the Makefile's promises, checked with `make -n` (prints commands, builds nothing):
# CFLAGS given on the command line keep the flags the code needs (-std=c11 -fopenmp -Wall -Wextra),
# intermediate objects are never deleted (make test's last line stays its summary), and the
# sanitizer and fuzzer builds carry their sanitizers. Prints "N passed, N failed" last.
set -u
cd "$(dirname "$0")/.."
tmp=$(mktemp -d /tmp/tsys_build_XXXXXX)
trap 'rm -rf "$tmp"' EXIT
# a clean make: nothing inherited from a make that runs this script (-j, command-line variables)
mk() { env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u MAKEOVERRIDES make --no-print-directory -n -B BUILD="$tmp/b" "$@" 2>&1; }

why=""
note() { why="$why"$'\n'"      $*"; }

t_user_cflags_keep_required_flags() {
  local out line f
  out=$(mk CFLAGS=-O0 "$tmp/b/e2e")
  line=$(grep -- 'drivers/e2e.c' <<<"$out")
  for f in -std=c11 -fopenmp -Wall -Wextra -O0; do
    grep -q -- " $f " <<<"$line " || note "make CFLAGS=-O0: '$f' missing from: $line"
  done
  out=$(mk CFLAGS=-O1 "$tmp/b/test_ops")
  grep -q -- '-fopenmp' <<<"$out" || note "make CFLAGS=-O1 test_ops: -fopenmp missing: $out"
}

t_intermediate_objects_are_kept() {
  local out
  out=$(mk HAVE_NVCC=nvcc "$tmp/b/e2e_cuda")
  grep -q 'nvcc' <<<"$out" || note "no nvcc command for e2e_cuda: $out"
  ! grep -qE '^rm ' <<<"$out" || note "make would delete intermediate files: $(grep -E '^rm ' <<<"$out")"
}

t_sanitizer_builds_are_sanitized() {
  local out
  out=$(mk "$tmp/b/asan/e2e" "$tmp/b/asan/test_ops")
  [ "$(grep -c -- '-fsanitize=address,undefined' <<<"$out")" -ge 2 ] || note "asan builds lack -fsanitize=address,undefined: $out"
  grep -q -- '-fopenmp' <<<"$out" || note "asan builds lack -fopenmp"
}

pass=0; fail=0
for t in $(declare -F | awk '{print $3}' | grep '^t_'); do
  why=""
  printf '  %-44s ' "${t#t_}"
  $t
  if [ -z "$why" ]; then echo ok; pass=$((pass + 1)); else echo " -> FAILED$why"; fail=$((fail + 1)); fi
done
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
