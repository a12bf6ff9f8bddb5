#!/usr/bin/env bash
# A rank that exits early or stalls: the others must stop with an error that names it, within the
# timeout (TSYS_DIST_TIMEOUT=2 here) plus a margin, through the launcher and under mpirun, with and
# without shared memory; FSDP's gathers; the rendezvous without a partner; the allreduce driver's bad flags.
# Prints one line per case and "N passed, N failed".
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
T=2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
pass=0; fail=0
# case NAME LIMIT_S PATTERN cmd...: must exit non-zero within LIMIT_S with PATTERN on its output
case_() {
  local name=$1 limit=$2 pat=$3; shift 3
  local t0 t1 out rc el
  t0=$(date +%s%N)
  out=$(TSYS_DIST_TIMEOUT=$T timeout 120 "$@" 2>&1); rc=$?
  t1=$(date +%s%N); el=$(( (t1 - t0) / 1000000 ))
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $el -lt $((limit * 1000)) ] && echo "$out" | grep -Eq "$pat"; then
    printf '  %-44s ok (%d ms)\n' "$name" "$el"; pass=$((pass + 1))
  else
    printf '  %-44s FAILED (exit %d after %d ms, limit %d s, wanted /%s/)\n' "$name" "$rc" "$el" "$limit" "$pat"
    echo "$out" | sed 's/^/      /' | tail -n 20
    fail=$((fail + 1))
  fi
}
named='rank 1 \(pid [0-9]+\)'
bin=$BUILD/test_dist
case_ "launcher: rank 1 exits" $((T + 6)) "$named exited" "$bin" --nproc 3 --die 1
case_ "launcher: rank 1 stalls" $((T + 8)) "no reply from $named" "$bin" --nproc 3 --stall 1
case_ "launcher, tcp: rank 1 exits" $((T + 6)) "rank 1 closed the connection" env TSYS_DIST_SHM=0 "$bin" --nproc 3 --die 1
case_ "launcher, tcp: rank 1 stalls" $((T + 8)) "rank 1: nothing received" env TSYS_DIST_SHM=0 "$bin" --nproc 3 --stall 1
# FSDP: a rank gone after construction; the others' first forward all-gather fails and names it
if [ -x "$BUILD/test_fsdp" ]; then
  case_ "fsdp: rank 1 exits before the forward" $((T + 6)) "$named exited" "$BUILD/test_fsdp" --nproc 2 --die 1
fi
# NCCL with CUDA tensors (two GPUs and the CUDA build only): the dead or stalled rank is caught where the
# others wait for the side stream (tsys_dist_barrier), within the timeout
if [ -x "$BUILD/test_dist_cuda" ] && command -v mpirun > /dev/null && [ "$(nvidia-smi -L 2> /dev/null | grep -c GPU)" -ge 2 ]; then
  case_ "nccl: rank 1 exits" $((T + 8)) "rank 1|NCCL|did not finish" mpirun --oversubscribe -np 2 "$BUILD/test_dist_cuda" --die 1 --nccl
  case_ "nccl: rank 1 stalls" $((T + 10)) "rank 1|NCCL|did not finish" mpirun --oversubscribe -np 2 "$BUILD/test_dist_cuda" --stall 1 --nccl
fi
# the rendezvous itself: nobody there
port=$((20000 + RANDOM % 20000))
case_ "rendezvous: rank 0 never comes" $((T + 4)) "could not join rank 0 at 127.0.0.1:$port within $T s" env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$bin"
case_ "rendezvous: rank 1 never comes" $((T + 4)) "rank\(s\) 1 never joined" env RANK=0 WORLD_SIZE=2 MASTER_PORT=$port "$bin"
case_ "rendezvous: bad RANK" 4 "RANK='5' and WORLD_SIZE='2'" env RANK=5 WORLD_SIZE=2 MASTER_PORT=$port "$bin"
# the allreduce driver's flags: a usage error (exit 2) naming the bad value, before any rank starts
ar=$BUILD/allreduce
if [ -x "$ar" ]; then
  for bad in "--sizes 1XB:bad value '1XB' in --sizes" "--op scatter:bad value 'scatter' in --op" "--dtype fp8:bad value 'fp8' in --dtype" \
             "--nproc 0:--nproc takes an integer from 1 to 1024, not '0'" "--bogus 1:unknown flag '--bogus'" "--format xml:--format takes md, csv or jsonl" \
             "--shm maybe:--shm takes yes or no, not 'maybe'" "--iters:--iters needs a value"; do
    args=${bad%%:*}; pat=${bad#*:}
    out=$("$ar" $args 2>&1); rc=$?
    if [ $rc -eq 2 ] && echo "$out" | grep -qF -- "$pat"; then printf '  %-44s ok\n' "allreduce $args"; pass=$((pass + 1))
    else printf '  %-44s FAILED (exit %d, wanted 2 and "%s")\n' "allreduce $args" $rc "$pat"; echo "$out" | head -3 | sed 's/^/      /'; fail=$((fail + 1)); fi
  done
fi
# the ddp driver: a bad --checkpoint or --loss is a usage error; the leaderboard-style step (FSDP with
# activation checkpointing, the summed loss, no unsharded reference) runs and says what it ran
dd=$BUILD/ddp
if [ -x "$dd" ]; then
  for bad in "--checkpoint blocks:x|--checkpoint takes none, blocks:K, sqrt, nested[:K], selective, P+selective, P+keep-attn, P+first:N or auto:BYTES, not 'blocks:x'" \
             "--checkpoint auto:1Q|--checkpoint takes none, blocks:K" "--checkpoint blocks:1+first:0|not 'blocks:1+first:0'" \
             "--loss max|--loss takes mean or sum, not 'max'" \
             "--fsdp-reshard maybe|--fsdp-reshard takes auto, yes or no, not 'maybe'"; do
    args=${bad%%|*}; pat=${bad#*|}
    out=$("$dd" $args 2>&1); rc=$?
    if [ $rc -eq 2 ] && echo "$out" | grep -qF -- "$pat"; then printf '  %-44s ok\n' "ddp $args"; pass=$((pass + 1))
    else printf '  %-44s FAILED (exit %d, wanted 2 and "%s")\n' "ddp $args" $rc "$pat"; echo "$out" | head -3 | sed 's/^/      /'; fail=$((fail + 1)); fi
  done
  out=$(timeout 300 "$dd" --device cpu --nproc 2 --model custom --d-model 32 --num-layers 2 --num-heads 2 --d-ff 64 --vocab-size 97 --batch-size 1 \
        --context-length 16 --strategy fsdp,flat --checkpoint blocks:1 --loss sum --no-compute-ref --warmup 0 --steps 1 --format csv 2>&1); rc=$?
  rows=$(echo "$out" | grep -c '^cpu,custom,2,\(fsdp\|flat\),.*,blocks:1,sum,.*,ok$')
  fsdp_ref=$(echo "$out" | awk -F, '/^device,/ { for (i = 1; i <= NF; i++) c[$i] = i } $4 == "fsdp" { print $c["compute_ms"] "/" $c["hidden"] }')   # not measured: empty
  if [ $rc -eq 0 ] && [ "$rows" = 2 ] && [ "$fsdp_ref" = / ]; then printf '  %-44s ok\n' "ddp fsdp+checkpoint, loss sum"; pass=$((pass + 1))
  else printf '  %-44s FAILED (exit %d, %s ok rows, compute_ms %s)\n' "ddp fsdp+checkpoint, loss sum" $rc "$rows" "$fsdp_ref"; echo "$out" | tail -4 | sed 's/^/      /'; fail=$((fail + 1)); fi
  # FSDP keeping each unit gathered from forward into backward: its own row label, one all-gather per unit
  # and step in the prediction (the resharding row's sends more)
  sent() { "$dd" --device cpu --nproc 2 --model custom --d-model 128 --num-layers 2 --num-heads 2 --d-ff 512 --vocab-size 512 --batch-size 1 \
           --context-length 16 --strategy fsdp --fsdp-reshard "$1" --warmup 0 --steps 1 --format csv 2>&1 \
           | awk -F, '/^device,/ { for (i = 1; i <= NF; i++) c[$i] = i } $4 ~ /^fsdp/ && $NF == "ok" { print $4 "=" $c["pred_sent_MB"] }'; }
  keep=$(sent no); again=$(sent yes)
  if [ "${keep%=*}" = fsdp:keep ] && [ "${again%=*}" = fsdp:reshard ] && awk -v a="${keep#*=}" -v b="${again#*=}" 'BEGIN { exit !(a > 0 && a < b) }'; then
    printf '  %-44s ok\n' "ddp fsdp --fsdp-reshard no / yes"; pass=$((pass + 1))
  else printf '  %-44s FAILED (rows: "%s", "%s")\n' "ddp fsdp --fsdp-reshard no / yes" "$keep" "$again"; fail=$((fail + 1)); fi
fi
if command -v mpirun >/dev/null && ldd "$bin" 2>/dev/null | grep -q libmpi; then
  mpi="mpirun --oversubscribe -np 3"
  # mpirun may stop the job before the others report: its own message names the rank then
  case_ "mpirun: rank 1 exits" $((T + 8)) "$named exited|process rank 1 " $mpi "$bin" --die 1
  case_ "mpirun: rank 1 stalls" $((T + 8)) "no reply from $named" $mpi "$bin" --stall 1
  case_ "mpirun, no shm: rank 1 stalls (unnamed)" $((T + 8)) "no reply from the group within $T s" $mpi -x TSYS_DIST_SHM=0 "$bin" --stall 1
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
