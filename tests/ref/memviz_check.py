# memviz_check.py - the memory driver's memory_viz snapshot (memory --out DIR writes DIR/<config>.pickle)
# through PyTorch's own tooling, on a machine with torch (and, for --torch, a GPU):
#
#   make cuda
#   build/memory_cuda --model 2.7B --context-length 128 --batch-size 4 --mode train --dtype bf16 --out build/mem
#   python3 tests/ref/memviz_check.py build/mem/cuda_2.7B_ctx128_train_bf16_flash.pickle \
#       --torch 2.7B --context-length 128 --batch-size 4 --mode train --dtype bf16 --html build/mem
#
# It loads the pickle with torch.cuda._memory_viz's reader and runs its functions on it: trace_plot and
# segment_plot (the HTML of pytorch.org/memory_viz; written under --html DIR), segsum (the 'stats'
# command, which asserts the segments add up), trace (the text replay), and the command line
# `python -m torch.cuda._memory_viz trace_plot`. Then the peak three ways, side by side:
#   tsys         the driver's peak_MiB (the timeline .json beside the pickle: its peak bytes)
#   memory_viz   the peak memory_viz's Active Memory Timeline draws for tsys's snapshot (its
#                process_alloc_data: what was live before the trace, then the trace's allocs and frees)
#   torch        with --torch MODEL: PyTorch's snapshot of the same model and step (the cs336 model of
#                torch_baseline.py, as memory_torch.py runs it: a warmup step, then the recorded one),
#                through the same replay, and torch.cuda.max_memory_allocated() for that step
# Exit status 1 when torch's tooling fails on the snapshot or the first two peaks differ.
import argparse, json, os, pickle, subprocess, sys, tempfile


def viz_peak(snap, device=0):
    """The top of memory_viz's Active Memory Timeline (MemoryViz.js process_alloc_data, plot_segments off):
    blocks freed in the trace but never allocated in it, and blocks live at the end that the trace did not
    allocate, count from the start; then each alloc adds and each free (or free_completed) removes."""
    trace = snap['device_traces'][device] if device < len(snap['device_traces']) else []
    live, initial = {}, 0
    for e in trace:   # first pass: what was there before the trace began
        if e['action'] == 'alloc':
            live[e['addr']] = e['size']
        elif e['action'] in ('free_completed', 'free'):
            if e['addr'] in live:
                del live[e['addr']]
            else:
                initial += e['size']
    for seg in snap['segments']:
        if seg.get('device', 0) != device:
            continue
        addr = seg['address']
        for b in seg['blocks']:
            if b['state'] == 'active_allocated' and addr not in live:
                initial += b.get('requested_size', b['size'])
            addr += b['size']
    cur = peak = initial
    allocated = set()
    for e in trace:
        if e['action'] == 'alloc':
            allocated.add(e['addr'])
            cur += e['size']
        elif e['action'] in ('free_completed', 'free'):
            cur -= e['size']   # an initial block leaves as a free too
        peak = max(peak, cur)
    return peak


def run_tooling(snap, path, html_dir, label):
    """torch.cuda._memory_viz on the snapshot; raises when any of it fails."""
    from torch.cuda import _memory_viz as mv
    pages = {'trace_plot': mv.trace_plot(snap), 'segment_plot': mv.segment_plot(snap)}
    stats = mv.segsum(snap)
    text = mv.trace(snap)
    assert 'TOTAL MEM' in text or not any(snap['device_traces']), text[-200:]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, 'trace.html')
        subprocess.run([sys.executable, '-m', 'torch.cuda._memory_viz', 'trace_plot', path, '-o', out], check=True)
        assert os.path.getsize(out) > 0
    if html_dir:
        for kind, page in pages.items():
            with open(os.path.join(html_dir, f'{label}_{kind}.html'), 'w') as f:
                f.write(page)
    return [line for line in stats.splitlines() if line.startswith('total_')]


def torch_snapshot(args):
    """PyTorch's own snapshot of the same model and step, and max_memory_allocated() for that step."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from memory_torch import make_step
    step, _, _ = make_step(args.torch, args.context_length, args.mode, args.dtype, args.batch_size)
    step()   # the warmup: the optimizer state, the caches
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        torch.cuda.memory._record_memory_history(max_entries=1000000)
    except TypeError:   # older torch
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=1000000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except TypeError:
        torch.cuda.memory._record_memory_history(False)
    return snap, torch.cuda.max_memory_allocated()


def torch_device_index():
    import torch
    return torch.cuda.current_device()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0] if __doc__ else None)
    ap.add_argument('pickle', help="tsys's snapshot: DIR/<config>.pickle from memory --out DIR")
    ap.add_argument('--tsys-json', help="the timeline beside it (default: the pickle's name with .json)")
    ap.add_argument('--torch', metavar='MODEL', help="also take PyTorch's snapshot of this model (torch_baseline.py's sizes)")
    ap.add_argument('--context-length', type=int, default=128)
    ap.add_argument('--batch-size', type=int, default=4)
    ap.add_argument('--mode', choices=['forward', 'forward-backward', 'train'], default='train')
    ap.add_argument('--dtype', choices=['fp32', 'bf16'], default='bf16')
    ap.add_argument('--html', metavar='DIR', help='write trace_plot and segment_plot pages here')
    args = ap.parse_args()

    with open(args.pickle, 'rb') as f:
        snap = pickle.load(f)
    rc = 0
    try:
        stats = run_tooling(snap, args.pickle, args.html, 'tsys')
        print('tsys snapshot through torch.cuda._memory_viz: ok;', '; '.join(stats))
    except Exception as e:   # noqa: BLE001 - report whatever the tooling raised
        print(f'tsys snapshot through torch.cuda._memory_viz: FAILED: {type(e).__name__}: {e}')
        rc = 1
    mib = 1 / 2**20
    rows = []
    js = args.tsys_json or os.path.splitext(args.pickle)[0] + '.json'
    tsys_peak = json.load(open(js))['peak']['bytes'] if os.path.exists(js) else None
    viz = viz_peak(snap)
    rows.append(('tsys (driver table)', tsys_peak))
    rows.append(('memory_viz on tsys snapshot', viz))
    if tsys_peak is not None and viz != tsys_peak:
        rc = 1
    if args.torch:
        tsnap, max_alloc = torch_snapshot(args)
        if args.html:
            with open(os.path.join(args.html, 'torch_snapshot.pickle'), 'wb') as f:
                pickle.dump(tsnap, f)
            run_tooling(tsnap, os.path.join(args.html, 'torch_snapshot.pickle'), args.html, 'torch')
        dev = torch_device_index()
        rows.append(('memory_viz on torch snapshot', viz_peak(tsnap, device=dev)))
        rows.append(('torch max_memory_allocated', max_alloc))
    print('\n| peak of | MiB | vs tsys |\n|---|---:|---:|')
    for name, v in rows:
        if v is None:
            print(f'| {name} | - | - |')
        else:
            diff = f'{100.0 * (v - tsys_peak) / tsys_peak:+.1f}%' if tsys_peak else '-'
            print(f'| {name} | {v * mib:.1f} | {diff} |')
    return rc


if __name__ == '__main__':
    sys.exit(main())
