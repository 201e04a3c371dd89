"""
Convergence, side by side: the same model from the same initial weights, trained on the same tokens in the same
order with the same hyperparameters, as
  ours_bf16    train_llama3cu (BF16 build)
  ours_fp8     train_llama3cu in its FP8 mode (--fp8_flag)
  torch_bf16   scripts/train_llama3.py, bf16 autocast (fp32 master weights) + torch.compile
  torchao_fp8  scripts/train_llama3.py, torchao float8 (tensorwise, lm_head bf16) + torch.compile, where installed
  torch_fp8    scripts/train_llama3.py, PyTorch's emulation of our FP8 recipe (--fp8 --fp8_scaled_mm); on request
then one PNG with every variant's train and val loss, a table of the final val losses, and the criteria:
ours_fp8 within 0.5% of ours_bf16, and ours_bf16 within 0.5% of torch_bf16 (final val loss, relative). Exits 1 if a
criterion fails or a run fails; a criterion whose variants did not both run is reported as not run.

  python scripts/convergence.py --train "data/debian_docs/*_train_*.bin" --val "data/debian_docs/*_val_*.bin" \
      --out runs/conv_d12
  python scripts/convergence.py --train ... --val ... --config llama3.2-1B --depth 4 --steps 1000 --out runs/conv_1B

Each variant writes <out>/<variant>/log.txt (the trainer's format: "step N train_loss X ...", "step N val_loss X");
a variant whose log already holds the final val loss of a run of the same command (<out>/<variant>/cmd.txt) is not
run again (--rerun runs it anyway), and the plot, the table and the criteria take in every variant whose log is
complete for these settings: the variants can be run one command at a time (--variants). Use one --out per case:
its init.bin is made once.

The gap between two variants moves from seed to seed (on d12 read once, by up to a point and more: README), so
one run a variant cannot settle a 0.5% criterion. --seeds 1337,7,... runs the whole case once per seed of the
initial weights, each in <out>/seed<N> (its own init.bin, logs and plot), prints each seed's table, then each
criterion's gap at every seed and their mean, and judges the criteria on the mean:

  python scripts/convergence.py --train ... --val ... --seeds 1337,7,42 --jobs 12 --out runs/conv_d12_seeds

--jobs N runs up to N of the runs at once on the GPU, the seeds' among them (the initial weights are written first,
one seed after another): a small model leaves the GPU idle between its kernels, and each run gives the losses it
gives alone.

The same start: scripts/train_llama3.py writes the initial weights once (<out>/init.bin, fp32, from --seed); ours
reads them with -e, PyTorch with --model. The same tokens in the same order: ours reads with shuffling off (-f 0),
one process, no gradient accumulation (-g B*T), so its batches are the shards in sorted name order, each one's
(N - 1) // (B*T) batches of B*T+1 tokens front to back, then again (llmc/dataloader.h); train_llama3.py takes its
batches in that order (batch_starts; dev/test/test_fp8_scripts.py checks it against the loader, token for token,
over two epochs of three shards). Val: both evaluate the first --val_batches batches of the val shards, in the
same order, at step 0, every --val_every steps and at the last step, as the mean over the counted targets. The lr
schedule is the trainer's (llmc/schedule.h; train_llama3.py's lr_at), AdamW, weight decay on the matrices, the
same grad clip.
"""

import argparse
import concurrent.futures
import importlib.util
import os
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot_loss  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ["ours_bf16", "ours_fp8", "torch_bf16", "torchao_fp8", "torch_fp8"]
DEFAULT_VARIANTS = "ours_bf16,ours_fp8,torch_bf16,torchao_fp8"
# per config: micro-batch, sequence length, peak lr, warmup steps (a flag given on the command line wins). d12's
# 3000 steps of 4 x 768 tokens read 9.2M tokens, less than `make corpus`'s 10.7M: every token is new when it is
# trained on, so the val loss measures the optimization and not how much of a corpus read twice a model memorizes.
PRESETS = {"d12": dict(batch_size=4, seq_len=768, lr=6e-4, warmup=100),
           "llama3.2-1B": dict(batch_size=8, seq_len=2048, lr=3e-4, warmup=50)}
# (variant, reference, tolerance): |final val loss of variant / reference's - 1| <= tolerance
CRITERIA = [("ours_fp8", "ours_bf16", 0.005), ("ours_bf16", "torch_bf16", 0.005)]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", required=True, help="train token shard glob")
    parser.add_argument("--val", required=True, help="val token shard glob")
    parser.add_argument("--out", default="runs/convergence", help="logs, the initial weights and the plot")
    parser.add_argument("--config", default="d12", help="d12, llama3.2-1B, ... (scripts/train_llama3.py)")
    parser.add_argument("--depth", type=int, default=0, help="keep only the first N layers (0: all)")
    parser.add_argument("--seed", type=int, default=1337, help="of the initial weights")
    parser.add_argument("--seeds", default="", help="a comma list of seeds: the case once per seed, in "
                                                    "<out>/seed<N>, the criteria judged on the mean gap")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch_size", "-B", type=int, default=None, help="default: the config's preset, else d12's")
    parser.add_argument("--seq_len", "-T", type=int, default=None, help="default: the config's preset, else d12's")
    parser.add_argument("--lr", type=float, default=None, help="peak lr; default: the config's preset, else 6e-4")
    parser.add_argument("--warmup", type=int, default=None, help="default: the config's preset, else 100")
    parser.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant", "wsd"])
    parser.add_argument("--final_fraction", type=float, default=0.1, help="final lr as a fraction of the peak")
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--val_every", type=int, default=250)
    parser.add_argument("--val_batches", type=int, default=-1,
                        help="val batches per evaluation; -1 (default): the whole val split")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"a comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--rerun", action="store_true", help="run variants whose log is complete again")
    parser.add_argument("--binary", default=os.path.join(ROOT, "train_llama3cu"))
    parser.add_argument("--fp8_flag", default="-M fp8 -K 0",
                        help="the trainer's flags for its FP8 mode (-K 0: FP8 products at any width, d12's too)")
    parser.add_argument("--compile", type=int, default=1, help="torch.compile for the PyTorch variants")
    parser.add_argument("--device", default="cuda", help="of the PyTorch variants")
    parser.add_argument("--smooth", type=int, default=50, help="train loss plotted as a running mean of N steps")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once, on the same GPU (the seeds' runs of --seeds among them): a small model "
                             "leaves the GPU idle between its kernels, so runs side by side finish sooner; each run "
                             "gives the same losses as alone")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    preset = PRESETS.get(args.config, PRESETS["d12"])
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    if min(args.steps, args.batch_size, args.seq_len, args.val_every, args.smooth, args.jobs) < 1 or args.warmup < 0:
        parser.error("--steps, -B, -T, --val_every, --smooth and --jobs must be >= 1, --warmup >= 0")
    if not args.fp8_flag.split():
        parser.error("--fp8_flag is empty")
    try:
        args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else []
    except ValueError:
        parser.error(f"--seeds {args.seeds}: not a comma list of integers")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error("--seeds: a seed named twice")
    return args


def commands(args, init):
    """{variant: (command, log path)} for every variant."""
    B, T = args.batch_size, args.seq_len
    ours = [args.binary, "-e", init, "-i", args.train, "-j", args.val, "-f", "0", "-b", B, "-t", T, "-g", B * T,
            "-x", args.steps, "-l", args.lr, "-k", args.schedule, "-u", args.warmup, "-q", args.final_fraction,
            "-w", args.weight_decay, "-G", args.grad_clip, "-v", args.val_every, "-m", args.val_batches, "-n", 0]
    pytorch = [sys.executable, os.path.join(ROOT, "scripts", "train_llama3.py"), "--model", init, "--input_bin",
               args.train, "--val_bin", args.val, "-B", B, "-T", T, "--steps", args.steps, "--lr", args.lr,
               "--schedule", args.schedule, "--warmup", args.warmup, "--final_fraction", args.final_fraction,
               "--weight_decay", args.weight_decay, "--grad_clip", args.grad_clip, "--val_every", args.val_every,
               "--val_batches", args.val_batches, "--dtype", "bfloat16", "--compile", args.compile,
               "--device", args.device]
    extra = {"ours_bf16": [], "ours_fp8": args.fp8_flag.split(), "torch_bf16": [], "torchao_fp8": ["--torchao_float8"],
             "torch_fp8": ["--fp8", "--fp8_scaled_mm"]}
    out = {}
    for variant in VARIANTS:
        folder = os.path.join(args.out, variant)
        log = os.path.join(folder, "log.txt")
        cmd = ours + ["-o", folder] if variant.startswith("ours") else pytorch + ["--log", log]
        out[variant] = ([str(c) for c in cmd + extra[variant]], log)
    return out


def read_log(path):
    """(train, val): lists of (step, loss) from a log.txt; empty where the file does not exist."""
    return plot_loss.read_log(path) if os.path.exists(path) else ([], [])


def final_val(path, steps):
    """The val loss at the last step, or None where the log does not reach it."""
    return next((loss for step, loss in read_log(path)[1] if step == steps), None)


def complete(cmd, log, steps):
    """Whether log.txt holds the final val loss of a run of this very command (cmd.txt beside it)."""
    cmd_file = os.path.join(os.path.dirname(log), "cmd.txt")
    if not os.path.exists(cmd_file) or final_val(log, steps) is None:
        return False
    with open(cmd_file) as f:
        return f.read() == shlex.join(cmd) + "\n"


def evaluate(finals):
    """finals: {variant: final val loss or None}. Returns [(variant, reference, tolerance, relative difference or
    None when either did not run, passed)]."""
    results = []
    for variant, reference, tolerance in CRITERIA:
        got, ref = finals.get(variant), finals.get(reference)
        if got is None or ref is None:
            results.append((variant, reference, tolerance, None, True))
        else:
            rel = got / ref - 1.0
            results.append((variant, reference, tolerance, rel, abs(rel) <= tolerance))
    return results


def evaluate_seeds(per_seed):
    """per_seed: {seed: {variant: final val loss or None}}. Returns [(variant, reference, tolerance, {seed: relative
    difference} where both ran, their mean or None where no seed had both, passed)]: judged on the mean."""
    evaluated = {seed: evaluate(finals) for seed, finals in per_seed.items()}
    results = []
    for i, (variant, reference, tolerance) in enumerate(CRITERIA):
        gaps = {seed: rows[i][3] for seed, rows in evaluated.items() if rows[i][3] is not None}
        mean = sum(gaps.values()) / len(gaps) if gaps else None
        results.append((variant, reference, tolerance, gaps, mean, mean is None or abs(mean) <= tolerance))
    return results


def plot(args, logs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val, ax_rel) = plt.subplots(1, 3, figsize=(20, 5))
    vals = {variant: dict(read_log(log)[1]) for variant, log in logs.items()}
    reference = next((v for v in ("ours_bf16", "torch_bf16") if vals.get(v)), None)
    for variant, log in logs.items():
        train = read_log(log)[0]
        if train:
            steps, losses = zip(*train)
            first = lambda i: max(0, i - args.smooth + 1)
            running = [sum(losses[first(i):i + 1]) / (i + 1 - first(i)) for i in range(len(losses))]
            ax_train.plot(steps, running, label=variant, alpha=0.85)
        if vals[variant]:
            ax_val.plot(*zip(*sorted(vals[variant].items())), "o-", markersize=3, label=variant)
        if reference and vals[variant]:
            common = sorted(set(vals[variant]) & set(vals[reference]))
            ax_rel.plot(common, [100 * (vals[variant][s] / vals[reference][s] - 1) for s in common], "o-",
                        markersize=3, label=variant)
    depth = f" depth {args.depth}" if args.depth else ""
    ax_train.set_title(f"train loss (running mean of {args.smooth} steps)")
    ax_val.set_title(f"val loss ({'all' if args.val_batches < 0 else args.val_batches} val batches)")
    ax_rel.set_title(f"val loss against {reference} (%)")
    for ax, label in ((ax_train, "loss"), (ax_val, "loss"), (ax_rel, "relative difference (%)")):
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(f"{args.config}{depth}, B={args.batch_size} T={args.seq_len}, {args.steps} steps, lr {args.lr:g} "
                 f"{args.schedule}, warmup {args.warmup}")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def run_variant(label, cmd, log):
    """Runs one variant's command (label: "[variant]", with its seed under --seeds); True where it went through."""
    folder = os.path.dirname(log)
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(log):
        os.remove(log)  # a new run: no lines of an earlier one
    with open(os.path.join(folder, "cmd.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    print(f"{label} $ {shlex.join(cmd)}", flush=True)
    with open(os.path.join(folder, "stdout.txt"), "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
        except OSError as e:  # no such program
            out.write(f"{e}\n")
            rc = 127
    if rc != 0:
        with open(os.path.join(folder, "stdout.txt")) as f:
            tail = f.read()[-3000:]
        print(f"{tail}\n{label} failed (exit code {rc}): {os.path.join(folder, 'stdout.txt')}", flush=True)
    return rc == 0


def prepare_case(args):
    """The variants of one case (one seed) still to run, and the initial weights they start from, written here where
    a run needs them. Returns (plan, runs, notes): every variant's (command, log), the (variant, command, log) to run,
    a note for each variant that will not run; None where the initial weights could not be written."""
    init = os.path.join(args.out, "init.bin")
    init_cmd = [sys.executable, os.path.join(ROOT, "scripts", "train_llama3.py"), "--config", args.config,
                "--depth", str(args.depth), "--seed", str(args.seed), "--steps", "0", "--device", "cpu",
                "--write_model", init]
    plan = commands(args, init)
    if args.dry_run:
        print(f"$ {shlex.join(init_cmd)}")
        for variant in args.variants:
            print(f"[{variant}] $ {shlex.join(plan[variant][0])}")
        return plan, [], {}
    os.makedirs(args.out, exist_ok=True)
    have_torchao = importlib.util.find_spec("torchao") is not None
    runs, notes = [], {}
    for variant in args.variants:
        cmd, log = plan[variant]
        if complete(cmd, log, args.steps) and not args.rerun:
            notes[variant] = "(log complete: not run again)"
        elif variant == "torchao_fp8" and not have_torchao:
            notes[variant] = "torchao not installed"
        else:
            runs.append((variant, cmd, log))
    if runs and not os.path.exists(init):
        print(f"$ {shlex.join(init_cmd)}", flush=True)
        if subprocess.run(init_cmd).returncode != 0:
            print("error: could not write the initial weights")
            return None
    return plan, runs, notes


def run_all(runs, jobs):
    """runs: (label, command, log) each; at most `jobs` at once. Returns whether each went through."""
    if jobs == 1:
        return [run_variant(*run) for run in runs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda run: run_variant(*run), runs))


def report_case(args, plan, failed, notes):
    """Plots one case and prints its table and criteria: the variants asked for, and those whose logs are complete
    for these settings (earlier commands). Returns ({variant: final val loss or None}, whether each criterion held)."""
    notes = dict(notes, **{variant: "run failed" for variant in failed})
    logs = {v: log for v, (cmd, log) in plan.items() if v in args.variants or complete(cmd, log, args.steps)}
    finals = {variant: final_val(log, args.steps) for variant, log in logs.items()}
    png = os.path.join(args.out, "convergence.png")
    plot(args, logs, png)
    print(f"\nwrote {png}")
    print(f"\n{'variant':<12} {'final val':>10} {'vs ours_bf16':>12} {'vs torch_bf16':>13}")
    for variant, loss in finals.items():
        if loss is None:
            print(f"{variant:<12} {'-':>10} {notes.get(variant, 'no final val loss in ' + logs[variant])}")
            continue
        rel = lambda ref: f"{100 * (loss / finals[ref] - 1):+.2f}%" if finals.get(ref) else "-"
        print(f"{variant:<12} {loss:>10.4f} {rel('ours_bf16'):>12} {rel('torch_bf16'):>13} {notes.get(variant, '')}")
    print()
    criteria_ok = True
    for variant, reference, tolerance, rel, passed in evaluate(finals):
        what = f"{variant} within {100 * tolerance:.1f}% of {reference}"
        if rel is None:
            print(f"{what}: not run")
        else:
            print(f"{what}: {100 * rel:+.3f}% {'PASS' if passed else 'FAIL'}")
        criteria_ok = criteria_ok and passed
    return finals, criteria_ok


def main(argv=None):
    args = parse_args(argv)
    # seed (None without --seeds): the case's arguments
    cases = {seed: argparse.Namespace(**dict(vars(args), seed=seed, out=os.path.join(args.out, f"seed{seed}")))
             for seed in args.seeds} or {None: args}
    prepared, runs = {}, []  # runs: (seed, variant, command, log)
    for seed, case in cases.items():
        if args.dry_run and seed is not None:
            print(f"\n=== seed {seed}: {case.out}")
        prepared[seed] = prepare_case(case)
        if prepared[seed] is None:
            return 1
        runs += [(seed, variant, cmd, log) for variant, cmd, log in prepared[seed][1]]
    if args.dry_run:
        return 0
    tag = lambda seed: f"seed {seed}: " if seed is not None else ""
    went = run_all([(f"{tag(seed)}[{variant}]", cmd, log) for seed, variant, cmd, log in runs], args.jobs)
    failed = {(seed, variant) for (seed, variant, _, _), ok in zip(runs, went) if not ok}

    per_seed, ok = {}, not failed
    for seed, case in cases.items():
        plan, _, notes = prepared[seed]
        if seed is not None:
            print(f"\n=== seed {seed}: {case.out}", flush=True)
        case_failed = [variant for s, variant in failed if s == seed]
        per_seed[seed], criteria_ok = report_case(case, plan, case_failed, notes)
        if seed is None:
            ok = ok and criteria_ok
    if not args.seeds:
        return 0 if ok else 1
    print(f"\n=== over seeds {', '.join(map(str, args.seeds))}: the criteria on the mean gap")
    for variant, reference, tolerance, gaps, mean, passed in evaluate_seeds(per_seed):
        what = f"{variant} within {100 * tolerance:.1f}% of {reference}"
        if mean is None:
            print(f"{what}: not run")
            continue
        each = ", ".join(f"seed {seed} {100 * rel:+.3f}%" for seed, rel in gaps.items())
        print(f"{what}: mean {100 * mean:+.3f}% over {len(gaps)} seed(s) ({each}) {'PASS' if passed else 'FAIL'}")
        ok = ok and passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
