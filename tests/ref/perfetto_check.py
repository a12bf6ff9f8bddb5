# perfetto_check.py - a tsys Chrome trace (e2e --profile DIR writes DIR/<config>.json) opened by Perfetto's
# trace processor, the engine behind ui.perfetto.dev, and queried with SQL:
#
#   build/e2e_cuda --model small --mode train --dtype bf16 --steps 1 --warmup 1 --profile build/prof
#   python3 tests/ref/perfetto_check.py build/prof/cuda_small_T256_train_bf16_flash.json
#
# Needs the Python package `perfetto` and its trace_processor_shell binary: the package fetches it on
# first use, or TRACE_PROCESSOR_BIN names one (machines without the network). Checks, each a query:
#   - the trace loads with no import errors (the `stats` table's error rows)
#   - ops and kernels are slices on their tracks: at least one op slice (cat 'op', 'backward' for
#     backward nodes) and one kernel slice (cat 'kernel')
#   - every launch flow (Kineto's ac2g) joins a host slice (the op or backward node that launched)
#     to a kernel slice
#   - op slices carry their input shapes and dtypes as args ('Input Dims', 'Input type')
# Prints the counts; exit status 1 when a check fails, 2 when the trace processor is not available.
import os, sys


def main():
    if len(sys.argv) != 2:
        print("usage: perfetto_check.py TRACE.json", file=sys.stderr)
        return 2
    try:
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig
    except ImportError:
        print("perfetto_check: the Python package 'perfetto' is missing (pip install perfetto)", file=sys.stderr)
        return 2
    path = sys.argv[1]
    binary = os.environ.get("TRACE_PROCESSOR_BIN")
    try:
        tp = TraceProcessor(trace=path, config=TraceProcessorConfig(bin_path=binary) if binary else None)
    except Exception as e:   # no binary and no network: not a verdict on the trace
        print(f"perfetto_check: no trace processor ({e}); set TRACE_PROCESSOR_BIN", file=sys.stderr)
        return 2

    def one(sql):
        rows = list(tp.query(sql))
        return rows[0] if rows else None

    bad = []
    errors = one("select coalesce(sum(value), 0) as n from stats where severity in ('error', 'data_loss') and value > 0").n
    if errors:
        names = [r.name for r in tp.query("select name from stats where severity in ('error', 'data_loss') and value > 0")]
        bad.append(f"{errors} import errors: {names}")
    ops = one("select count(*) as n from slice where category in ('op', 'backward')").n
    kernels = one("select count(*) as n from slice where category = 'kernel'").n
    flows = one("select count(*) as n from flow").n
    wrong = one("""select count(*) as n from flow f join slice a on a.id = f.slice_out join slice b on b.id = f.slice_in
                   where a.category not in ('op', 'backward', 'range', 'region') or b.category != 'kernel'""").n
    launched = one("select count(distinct slice_in) as n from flow").n
    with_dims = one("""select count(distinct s.id) as n from slice s join args a on a.arg_set_id = s.arg_set_id
                       where s.category = 'op' and a.key like '%Input Dims%'""").n
    with_type = one("""select count(distinct s.id) as n from slice s join args a on a.arg_set_id = s.arg_set_id
                       where s.category = 'op' and a.key like '%Input type%'""").n
    print(f"slices: {ops} ops, {kernels} kernels; flows {flows} ({launched} kernels reached, {wrong} not host -> kernel); "
          f"ops with Input Dims {with_dims}, with Input type {with_type}")
    if ops == 0: bad.append("no op slices (category op)")
    if kernels == 0: bad.append("no kernel slices (category kernel)")
    if flows == 0: bad.append("no flows")
    if wrong: bad.append(f"{wrong} flows do not join a host slice to a kernel")
    if with_dims == 0: bad.append("no op carries 'Input Dims'")
    if with_type == 0: bad.append("no op carries 'Input type'")
    tp.close()
    for b in bad:
        print("FAIL " + b)
    print("ok" if not bad else f"{len(bad)} checks failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
