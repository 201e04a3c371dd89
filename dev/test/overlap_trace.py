"""Where a multi-GPU step's communication is exposed, from a kernel trace of one rank (dev/test/overlap_check.sh).

  python3 dev/test/overlap_trace.py out/overlap_check/trace_0.sqlite [--skip 2]
  python3 dev/test/overlap_trace.py out/overlap_check/trace_0.txt [--skip 2]

Reads the trace's kernels: an nsys trace's (the CUPTI_ACTIVITY_KIND_KERNEL table of `nsys export --type sqlite`,
which `nsys stats` also writes) or dev/kernel_trace.so's text file (its "K start end stream grid name" lines, for
machines without nsys), cuts the run into steps at the end of each update (the last AdamW kernel of each burst),
drops the first --skip steps (warm-up: the matmuls' algorithm choice), and prints per step, in ms:
  step        update end to update end
  compute     the GPU busy with any kernel but NCCL's
  nccl        NCCL's kernels (the reductions, the gathers, the grad norm's all-reduce)
  nccl alone  NCCL running with no compute kernel beside it: communication the step waits for
  idle        no kernel at all: the host's round trips (grad norm, loss) and launch gaps
and "nccl alone" split by collective: ReduceScatter is the backward's reductions (the last ones, after the backward's
last kernel, are the exposed tail), AllGather the weights' gathers after the update (exposed where neither the update
nor the next forward runs beside them; their tail lands in the next step's window), AllReduce the grad norm's. The
compute time against one GPU's step shows what NCCL's kernels cost the kernels beside them.
"""

import argparse
import bisect
import sqlite3
import sys

UPDATE_KERNEL = "adamw"  # llmc/adamw.cuh adamw_kernel
BURST_GAP_NS = 20_000_000  # AdamW launches of one update are far closer together than 20 ms; updates are ~200 ms apart


def kind_of(name):
    """The collective of an NCCL kernel name, None for other kernels."""
    low = name.lower()
    if "nccl" not in low:
        return None
    for kind in ("ReduceScatter", "AllGather", "AllReduce", "Broadcast", "SendRecv"):
        if kind.lower() in low:
            return kind
    return "nccl other"


def merge(intervals):
    """The union of [start, end) intervals, as sorted disjoint intervals."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return out


def length(merged):
    return sum(e - s for s, e in merged)


def uncovered(s, e, merged, starts):
    """How much of [s, e) no interval of `merged` (sorted, disjoint; starts = their starts) covers."""
    covered = 0
    i = max(bisect.bisect_right(starts, s) - 1, 0)
    while i < len(merged) and merged[i][0] < e:
        lo, hi = max(s, merged[i][0]), min(e, merged[i][1])
        if hi > lo:
            covered += hi - lo
        i += 1
    return (e - s) - covered


def read_kernels(path):
    """[(start, end, name)] of every kernel in the trace, in ns."""
    with open(path, "rb") as f:
        is_sqlite = f.read(16) == b"SQLite format 3\x00"
    if not is_sqlite:  # dev/kernel_trace.so's lines; its memcpy (C) and memset (S) lines are not kernels
        kernels = []
        with open(path) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[0] == "K":
                    kernels.append((int(parts[1]), int(parts[2]), parts[5].strip()))
        return sorted(kernels)
    db = sqlite3.connect(path)
    names = dict(db.execute("SELECT id, value FROM StringIds"))
    columns = {row[1] for row in db.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)")}
    name_col = "shortName" if "shortName" in columns else "demangledName"
    rows = db.execute(f"SELECT start, end, {name_col} FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start").fetchall()
    return [(s, e, names.get(n, str(n))) for s, e, n in rows]


def update_bursts(kernels):
    """[(first start, last end)] of each update: AdamW kernels closer than BURST_GAP_NS belong to one update."""
    bursts = []
    for s, e, name in kernels:
        if UPDATE_KERNEL not in name.lower():
            continue
        if bursts and s - bursts[-1][1] < BURST_GAP_NS:
            bursts[-1][1] = max(bursts[-1][1], e)
        else:
            bursts.append([s, e])
    return bursts


def analyse(kernels, skip):
    """Per step (after `skip` of them) a dict of ms: step, compute, nccl, nccl_alone, idle, and nccl alone by
    collective."""
    bursts = update_bursts(kernels)
    steps = []
    # step k runs from the end of update k - 1 to the end of update k; the first update has no step before it here
    for k in range(1, len(bursts)):
        a, b = bursts[k - 1][1], bursts[k][1]
        inside = [(max(s, a), min(e, b), n) for s, e, n in kernels if e > a and s < b]
        compute = merge([[s, e] for s, e, n in inside if kind_of(n) is None])
        nccl = merge([[s, e] for s, e, n in inside if kind_of(n) is not None])
        busy = merge([[s, e] for s, e, n in inside])
        starts = [s for s, _ in compute]
        alone = {}
        for s, e, n in inside:
            kind = kind_of(n)
            if kind is not None:
                alone[kind] = alone.get(kind, 0) + uncovered(s, e, compute, starts)
        steps.append({
            "step": (b - a) / 1e6,
            "compute": length(compute) / 1e6,
            "nccl": length(nccl) / 1e6,
            "nccl_alone": sum(alone.values()) / 1e6,
            "idle": ((b - a) - length(busy)) / 1e6,
            "alone": {key: v / 1e6 for key, v in alone.items()},
        })
    return steps[skip:]


def report(steps, out=sys.stdout):
    if not steps:
        print("no complete steps in the trace (AdamW kernels not found?)", file=out)
        return
    print(f"{'step ms':>9} {'compute':>9} {'nccl':>9} {'nccl alone':>11} {'idle':>8}", file=out)
    for st in steps:
        print(f"{st['step']:9.2f} {st['compute']:9.2f} {st['nccl']:9.2f} {st['nccl_alone']:11.2f} {st['idle']:8.2f}",
              file=out)
    n = len(steps)
    mean = {key: sum(st[key] for st in steps) / n for key in ("step", "compute", "nccl", "nccl_alone", "idle")}
    print(f"mean over {n} steps: step {mean['step']:.2f} | compute {mean['compute']:.2f} | nccl {mean['nccl']:.2f} | "
          f"nccl alone {mean['nccl_alone']:.2f} | idle {mean['idle']:.2f} ms", file=out)
    keys = sorted({key for st in steps for key in st["alone"]})
    for key in keys:
        print(f"  nccl alone, {key}: {sum(st['alone'].get(key, 0.0) for st in steps) / n:.2f} ms per step", file=out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="an nsys sqlite export or a dev/kernel_trace.so text file")
    parser.add_argument("--skip", type=int, default=2, help="steps to drop at the start (warm-up)")
    args = parser.parse_args()
    report(analyse(read_kernels(args.trace), args.skip))


if __name__ == "__main__":
    main()
