#!/usr/bin/env bash
# test_state_fault.sh [BUILD] - training-state snapshots under kill -9 (BUILD: default $BUILD or build).
# A writer (test_state --fault-writer) resumes from the newest snapshot of a directory and saves
# snapshots of known content (every value a function of the step) in a loop; it is killed with
# SIGKILL after a random delay of 0 to two saves' time (measured first), so kills land anywhere in a
# save: writing a file, fsyncing, renaming into place, replacing a snapshot of the same name (every
# third save), removing the oldest (keep_last 3); every other save goes through the asynchronous saver
# (tsys_state_save_async: its thread writes). After each kill a checker (test_state --fault-check)
# loads the newest snapshot, checksums verified, compares every value, the RNG and the user record
# with what that step saved, and checks that no step was lost (the newest step never goes back).
# Rounds go on until 200 kills and step 200 (100 s at most; fewer than 200 kills fails). A last
# writer run to completion must leave no temporary behind. Prints "N passed, N failed" last (a check
# per round).
BUILD=${1:-${BUILD:-build}}
BIN=$BUILD/test_state
KILLS=200
SAVES=200
SECONDS_MAX=100   # a disk slow to fsync: fewer saves, still 200 kills
if [ ! -x "$BIN" ]; then echo "$BIN not built (make $BIN)"; echo "0 passed, 1 failed"; exit 1; fi
DIR=$(mktemp -d "${TMPDIR:-/tmp}/tsys_state_fault_XXXXXX") || { echo "0 passed, 1 failed"; exit 1; }
trap 'rm -rf "$DIR"' EXIT
SNAPS=$DIR/snapshots

# The kill window: 0 to two saves' time, as measured here (process start included), so that kills
# land all over a save whatever the disk's fsync costs (~60 ms a save on an ext4 VM disk).
t0=$(date +%s%N)
if ! "$BIN" --fault-writer "$DIR/probe" 3 > "$DIR/writer.log" 2>&1; then
  echo "FAIL: the writer does not run:"; cat "$DIR/writer.log"; echo "0 passed, 1 failed"; exit 1
fi
save_ms=$(( ($(date +%s%N) - t0) / 3000000 ))
window=$(( 2 * save_ms + 10 ))
rm -rf "$DIR/probe"
echo "a save takes ~$save_ms ms here: kills after 0 to $window ms"

pass=0; fail=0; step=0; kills=0; midsave=0; round=0
deadline=$((SECONDS + SECONDS_MAX))
while { [ $kills -lt $KILLS ] || [ "$step" -lt $SAVES ]; } && [ $SECONDS -lt $deadline ]; do
  round=$((round + 1))
  "$BIN" --fault-writer "$SNAPS" > "$DIR/writer.log" 2>&1 &
  pid=$!
  ms=$((RANDOM % window))
  sleep "$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
  kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  rc=$?
  if [ $rc -ne 137 ]; then   # a writer that stopped on its own failed
    echo "FAIL round $round: the writer exited with $rc before the kill:"; cat "$DIR/writer.log"; fail=$((fail + 1)); continue
  fi
  kills=$((kills + 1))
  # a temporary left behind: the kill landed inside a save (or a removal)
  if [ -d "$SNAPS" ] && ls -A "$SNAPS" | grep -q '^\.tmp-'; then midsave=$((midsave + 1)); fi
  out=$("$BIN" --fault-check "$SNAPS" "$step" 2>&1)
  if [ $? -eq 0 ]; then
    pass=$((pass + 1)); step=$(echo "$out" | awk '/^step /{print $2}' | tail -n 1)
  else
    echo "FAIL round $round (after step $step):"; echo "$out"; fail=$((fail + 1))
  fi
done

if [ $kills -lt $KILLS ]; then echo "FAIL: $kills kills in $SECONDS_MAX s"; fail=$((fail + 1)); fi

# a writer that finishes: its save removes every temporary the killed ones left
"$BIN" --fault-writer "$SNAPS" 1 > "$DIR/writer.log" 2>&1
out=$("$BIN" --fault-check "$SNAPS" "$((step + 1))" 2>&1)
ok=$?
left=$(ls -A "$SNAPS" | grep -c '^\.tmp-')
if [ $ok -eq 0 ] && [ "$left" -eq 0 ] && echo "$out" | grep -q "^step $((step + 1))$"; then pass=$((pass + 1))
else echo "FAIL: after a finished save: $out; $left temporaries left"; cat "$DIR/writer.log"; fail=$((fail + 1)); fi

echo "$kills kills in $round rounds, $midsave of them inside a save; step $step reached"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
