#!/bin/sh
# run_fuzzer.sh DIR NAME... - bounded libFuzzer runs of DIR/NAME, side by side (one process each),
# for FUZZ_SECONDS (default 60): first every committed seed (tests/fuzz/corpus/NAME, crash
# regressions included), then new inputs, which go to DIR/corpus_NAME (the committed seeds are not
# touched). A crash, leak, timeout or sanitizer report fails that fuzzer and leaves the input in
# DIR/crash-NAME-*: fix the bug, then commit the input under tests/fuzz/corpus/NAME/ as a regression
# seed. Prints "N passed, N failed" last (one test per fuzzer).
set -u
dir=$1
shift
secs=${FUZZ_SECONDS:-60}
for name in "$@"; do
  mkdir -p "$dir/corpus_$name"
  case $name in
    fuzz_flags) opts="-max_len=1024 -close_fd_mask=3 -dict=tests/fuzz/fuzz_flags.dict" ;;
    *)          opts="-max_len=8192" ;;
  esac
  # -timeout: one input taking 10 s is a hang (a blocking open, a loop); -rss_limit_mb: a leak or a
  # runaway allocation fails instead of swapping.
  ( "$dir/$name" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$dir/crash-$name-" $opts "$dir/corpus_$name" "tests/fuzz/corpus/$name" >"$dir/$name.fuzz.log" 2>&1
    echo $? >"$dir/$name.fuzz.rc" ) &
done
wait
pass=0; fail=0
for name in "$@"; do
  log=$dir/$name.fuzz.log
  rc=$(cat "$dir/$name.fuzz.rc" 2>/dev/null || echo 1)
  if [ "$rc" -eq 0 ]; then
    grep -E '^INFO: seed corpus|^#[0-9]+[[:space:]]+(INITED|DONE)|stat::number_of_executed_units|stat::peak_rss_mb' "$log"
    echo "$name: no crash in $secs s ($(ls "$dir/corpus_$name" | wc -l) inputs kept in $dir/corpus_$name)"
    pass=$((pass + 1))
  else
    tail -n 80 "$log"
    echo "$name: libFuzzer exited $rc; the input is in $dir/crash-$name-* (full log: $log)"
    fail=$((fail + 1))
  fi
done
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
