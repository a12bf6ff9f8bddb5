#!/bin/sh
# run_fuzzer.sh DIR NAME - one bounded libFuzzer run of DIR/NAME for FUZZ_SECONDS (default 60):
# first every committed seed (tests/fuzz/corpus/NAME, crash regressions included), then new inputs,
# which go to DIR/corpus_NAME (the committed seeds are not touched). A crash, leak, timeout or
# sanitizer report fails the run and leaves the input in DIR/crash-NAME-*: fix it, then commit that
# input under tests/fuzz/corpus/NAME/ as a regression seed. Prints "N passed, N failed" last.
set -u
dir=$1
name=$2
secs=${FUZZ_SECONDS:-60}
seeds=tests/fuzz/corpus/$name
mkdir -p "$dir/corpus_$name"
case $name in
  fuzz_flags) opts="-max_len=1024 -close_fd_mask=3 -dict=tests/fuzz/fuzz_flags.dict" ;;
  *)          opts="-max_len=8192" ;;
esac
log=$dir/$name.fuzz.log
# -timeout: one input taking 10 s is a hang (a FIFO-style block, a loop); -rss_limit_mb: a leak or
# a runaway allocation fails instead of swapping.
"$dir/$name" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$dir/crash-$name-" $opts "$dir/corpus_$name" "$seeds" >"$log" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
  grep -E '^INFO: seed corpus|^#[0-9]+[[:space:]]+(INITED|DONE)|stat::number_of_executed_units|stat::peak_rss_mb' "$log"
  echo "$name: no crash in ${secs} s ($(ls "$dir/corpus_$name" | wc -l) new inputs kept in $dir/corpus_$name)"
  echo "1 passed, 0 failed"
else
  tail -n 80 "$log"
  echo "$name: libFuzzer exited $rc; the input is in $dir/crash-$name-* (full log: $log)"
  echo "0 passed, 1 failed"
fi
[ $rc -eq 0 ]
