"""
Summary of a dev/kernel_trace.so trace of train_llama3cu: per training step, the GPU's busy and idle time, the gaps
between operations by size and by what sits on either side of them, and the time per kernel; or one step's
operations in order (--dump).

  python dev/kernel_trace.py TRACE [--first 3] [--last -1] [--dump STEP]

Steps are cut at the trainer's one 4-byte device-to-host copy per step (the gradient norm): the window from copy
FIRST to copy LAST (negative counts from the end) covers LAST - FIRST steps, each from one step's norm to the next,
so the optimizer of the earlier step and the host work between steps fall in it.
"""

import argparse
import collections


def read_trace(path):
    ops = []  # (start, end, grid, name)
    with open(path) as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 5:
                continue
            kind, start, end = parts[0], int(parts[1]), int(parts[2])
            if kind == "K":
                ops.append((start, end, parts[4], parts[5].strip()))
            elif kind == "C":
                ops.append((start, end, "-", f"memcpy kind{parts[5].strip()} {parts[4]}B"))
            elif kind == "S":
                ops.append((start, end, "-", f"memset {parts[4]}B"))
    ops.sort()
    return ops


def step_marks(ops):
    return [op for op in ops if op[3] == "memcpy kind2 4B"]


def summary(ops, first, last):
    marks = step_marks(ops)
    if len(marks) < 2:
        raise SystemExit(f"error: {len(marks)} step marks (4-byte device-to-host copies) in the trace; need 2")
    last = last % len(marks)
    t0, t1 = marks[first][1], marks[last][1]
    steps = last - first
    window = [op for op in ops if op[0] >= t0 and op[1] <= t1]
    busy, gaps = 0, []
    run_start, run_end, prev = t0, t0, marks[first]  # the window opens as the first mark ends
    for op in window:
        if op[0] > run_end:
            busy += run_end - run_start
            gaps.append((op[0] - run_end, prev[3], op[3]))
            run_start, run_end = op[0], op[1]
        else:
            run_end = max(run_end, op[1])
        if op[1] >= run_end:
            prev = op
    busy += run_end - run_start
    span = t1 - t0
    print(f"{steps} steps: span {span / steps / 1e6:.3f} ms, busy {busy / steps / 1e6:.3f} ms, idle "
          f"{(span - busy) / steps / 1e6:.3f} ms per step; {len(window) / steps:.0f} operations, "
          f"{len(gaps) / steps:.0f} gaps per step")
    bounds = [(1e3, "< 1 us"), (2e3, "1-2 us"), (5e3, "2-5 us"), (20e3, "5-20 us"), (100e3, "20-100 us"),
              (float("inf"), ">= 100 us")]
    by_size = collections.Counter()
    for gap, _, _ in gaps:
        by_size[next(label for bound, label in bounds if gap < bound)] += gap
    print("idle per step by gap size: " + ", ".join(f"{label} {by_size[label] / steps / 1e3:.1f} us"
                                                      for _, label in bounds))
    around = collections.defaultdict(lambda: [0, 0])
    for gap, before, after in gaps:
        if gap >= 5e3:
            around[(before[:60], after[:60])][0] += gap
            around[(before[:60], after[:60])][1] += 1
    print("gaps of 5 us or more, per step, by the operations around them:")
    for (before, after), (total, count) in sorted(around.items(), key=lambda item: -item[1][0])[:12]:
        print(f"  {total / steps / 1e3:8.1f} us  x{count / steps:4.1f}  {before}  ->  {after}")
    per_name = collections.defaultdict(lambda: [0, 0])
    for start, end, _, name in window:
        per_name[name][0] += end - start
        per_name[name][1] += 1
    print("GPU time per step by operation:")
    for name, (total, count) in sorted(per_name.items(), key=lambda item: -item[1][0])[:40]:
        print(f"  {total / steps / 1e6:8.3f} ms  x{count / steps:6.1f}  mean {total / count / 1e3:8.1f} us  "
              f"{name[:100]}")


def dump(ops, step):
    marks = step_marks(ops)
    t0, t1 = marks[step - 1][1], marks[step][1]
    print("gap (us)  time (us)    grid  operation")
    prev_end = t0
    for start, end, grid, name in ops:
        if start >= t0 and end <= t1:
            print(f"{(start - prev_end) / 1e3:8.1f} {(end - start) / 1e3:10.1f} {grid:>7}  {name[:110]}")
            prev_end = end


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--first", type=int, default=3, help="first step mark of the window (skips warm-up)")
    parser.add_argument("--last", type=int, default=-1, help="last step mark of the window")
    parser.add_argument("--dump", type=int, default=0, help="list the operations between marks DUMP - 1 and DUMP")
    args = parser.parse_args()
    ops = read_trace(args.trace)
    if args.dump:
        dump(ops, args.dump)
    else:
        summary(ops, args.first, args.last)


if __name__ == "__main__":
    main()
