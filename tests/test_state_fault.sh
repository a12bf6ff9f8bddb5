#!/usr/bin/env bash
# test_state_fault.sh [BUILD] - training-state snapshots under kill -9 (BUILD: default $BUILD or build).
# A writer (test_state --fault-writer) resumes from the newest snapshot of a directory and saves
# snapshots of known content (every value a function of the step) in a loop; it is killed with SIGKILL
# after a random delay of 0 to 120 ms, so kills land anywhere in a save: writing a file, fsyncing,
# renaming into place, replacing a snapshot of the same name (every third save), removing the oldest
# (keep_last 3). After each kill a checker (test_state
# --fault-check) loads the newest snapshot, checksums verified, and compares every value, the RNG and
# the user record with what that step saved, and checks that no step was lost (the newest step never
# goes back). Rounds go on until 200 kills and 200 saves are done. A last writer run to completion must
# leave no temporary behind. Prints "N passed, N failed" last (a check per round).
BUILD=${1:-${BUILD:-build}}
BIN=$BUILD/test_state
KILLS=200
SAVES=200
MAX_ROUNDS=1000
if [ ! -x "$BIN" ]; then echo "$BIN not built (make $BIN)"; echo "0 passed, 1 failed"; exit 1; fi
DIR=$(mktemp -d "${TMPDIR:-/tmp}/tsys_state_fault_XXXXXX") || { echo "0 passed, 1 failed"; exit 1; }
trap 'rm -rf "$DIR"' EXIT
SNAPS=$DIR/snapshots

pass=0; fail=0; step=0; kills=0; midsave=0; round=0
while [ $kills -lt $KILLS ] || [ "$step" -lt $SAVES ]; do
  round=$((round + 1))
  if [ $round -gt $MAX_ROUNDS ]; then echo "FAIL: $MAX_ROUNDS rounds reached step $step only"; fail=$((fail + 1)); break; fi
  "$BIN" --fault-writer "$SNAPS" > "$DIR/writer.log" 2>&1 &
  pid=$!
  sleep "0.$(printf '%03d' $((RANDOM % 120)))"
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
