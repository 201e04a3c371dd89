"""
Side by side on one GPU: train_llama3cu against scripts/train_llama3.py in its strongest PyTorch form (bf16 autocast
with fp32 master weights, fused AdamW, torch.compile, SDPA flash/cuDNN attention), same model, same tokens.

  python scripts/bench_vs_pytorch.py --train "data/tinyshakespeare/*_train.bin" [--configs d12,llama3.2-1B]

For each config it prints tok/s (median step after warm-up), peak GPU memory and MFU for both, and our/PyTorch
ratios. MFU uses one FLOP convention for both: 6 x matmul weights + 6 L H hd T per token (causal attention),
against the GPU's dense bf16 peak (989 TFLOP/s on H100/H200, or --peak).
Memory: ours is device memory in use beyond the CUDA context (all our allocations, cuBLAS workspace included);
PyTorch's is torch.cuda.max_memory_allocated (and max_memory_reserved, printed alongside).
With --fp8, also ours in FP8 (the trainer with --fp8_flag: one more row of the table, against torch.compile bf16) and,
where torchao is installed, torchao float8 (tensorwise, lm_head in bf16) + torch.compile, in a second table: ours FP8
against torch.compile bf16 and against torchao float8.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = {"d12": (16, 1024), "llama3.2-1B": (8, 2048)}


def flops_per_token(c, T):
    hd = c.dim // c.n_heads
    qkv = (c.n_heads + 2 * c.n_kv_heads) * hd
    weights = c.n_layers * (qkv * c.dim + c.dim * c.n_heads * hd + 3 * c.ffn_hidden * c.dim) + c.vocab_size * c.dim
    return 6 * weights + 6 * c.n_layers * c.n_heads * hd * T


def run(cmd, log_path):
    print("$ " + " ".join(cmd), flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    with open(log_path, "w") as f:
        f.write(result.stdout + result.stderr)
    if result.returncode != 0:
        print(result.stdout[-3000:] + result.stderr[-3000:])
        raise SystemExit(f"error: command failed ({result.returncode}), log in {log_path}")
    return result.stdout


def torch_run(name, B, T, args, torchao=False):
    """scripts/train_llama3.py with bf16 autocast and torch.compile, with torchao float8 or not: (tok/s, GiB
    allocated, GiB reserved)."""
    out = run([sys.executable, "scripts/train_llama3.py", "--config", name, "--input_bin", args.train,
               "-B", str(B), "-T", str(T), "--steps", str(args.steps), "--lr", "3e-4", "--dtype", "bfloat16",
               "--compile", "1", "--device", "cuda", *(["--torchao_float8"] if torchao else [])],
              os.path.join(args.out, f"bench_torch{'ao' if torchao else ''}_{name}.log"))
    m = re.search(r"median step (\S+) ms \| (\d+) tok/s \| peak memory (\S+) GiB allocated, (\S+) GiB reserved", out)
    if not m:
        raise SystemExit(f"error: no median line from train_llama3.py for {name}")
    return float(m.group(2)), float(m.group(3)), float(m.group(4))


def ours_run(name, B, T, args, flags, tag):
    """train_llama3cu with `flags`: (tok/s, peak GiB)."""
    out = run([args.binary, "-c", name, "-i", args.train, "-j", "", "-b", str(B), "-t", str(T),
               "-x", str(args.steps), "-l", "3e-4", "-v", "0", *flags.split()],
              os.path.join(args.out, f"bench_ours_{name}_{tag}.log"))
    m = re.search(r"summary: median step (\S+) ms over \d+ steps \| (\d+) tok/s .* peak mem (\S+) GiB", out)
    if not m:
        raise SystemExit(f"error: no summary line from train_llama3cu for {name}")
    return float(m.group(2)), float(m.group(3))


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True, help="token shard glob, the same for both")
    parser.add_argument("--configs", default="d12,llama3.2-1B")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--binary", default=os.path.join(ROOT, "train_llama3cu"))
    parser.add_argument("--extra", action="append", default=None,
                        help="extra flags for train_llama3cu, e.g. '-W 0 -O bf16'; repeat for several variants, "
                             "each a row against the same PyTorch run")
    parser.add_argument("--fp8", action="store_true",
                        help="also ours in FP8 and torchao float8 + torch.compile (where torchao is installed)")
    parser.add_argument("--fp8_flag", default="-M fp8", help="the trainer's flags for its FP8 mode")
    parser.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s of the GPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="where the logs go")
    args = parser.parse_args(argv)
    if args.fp8 and not args.fp8_flag.split():
        parser.error("--fp8_flag is empty: ours in FP8 needs the trainer's FP8 flag")
    return args


def print_tables(rows, fp8_rows, fp8_flag):
    """rows: (config, our flags, B, T, ours tok/s, torch tok/s, ours GiB, torch GiB, torch reserved GiB, ours MFU,
    torch MFU); fp8_rows: (config, B, T, ours FP8 tok/s, torch bf16 tok/s, torchao (tok/s, GiB, reserved) or None
    where torchao is not installed, ours FP8 GiB, ours FP8 MFU, torchao MFU or None)."""
    print()
    print(f"{'config':<12} {'our flags':<16} {'B':>3} {'T':>5} | {'ours tok/s':>10} {'torch tok/s':>11} {'ratio':>6} | "
          f"{'ours GiB':>8} {'torch GiB':>9} {'(reserved)':>10} {'ratio':>6} | {'ours MFU':>8} {'torch MFU':>9}")
    for name, flags, B, T, ot, tt, om, tm, tr, omfu, tmfu in rows:
        print(f"{name:<12} {flags:<16} {B:>3} {T:>5} | {ot:>10.0f} {tt:>11.0f} {ot / tt:>6.2f} | {om:>8.2f} "
              f"{tm:>9.2f} {tr:>10.2f} {om / tm:>6.2f} | {omfu:>7.1f}% {tmfu:>8.1f}%")
    if fp8_rows:
        print()
        print(f"FP8: ours ({fp8_flag}) against torch.compile bf16 and torchao float8 (tensorwise, lm_head bf16) "
              f"+ torch.compile; MFU against the bf16 peak")
        print(f"{'config':<12} {'B':>3} {'T':>5} | {'ours FP8':>9} {'torch bf16':>10} {'torchao':>9} | "
              f"{'vs bf16':>7} {'vs torchao':>10} | {'ours GiB':>8} {'torchao GiB':>11} {'(reserved)':>10} | "
              f"{'ours MFU':>8} {'torchao MFU':>11}")
        for name, B, T, ot, tt, ao, om, omfu, aomfu in fp8_rows:
            if ao is None:
                print(f"{name:<12} {B:>3} {T:>5} | {ot:>9.0f} {tt:>10.0f} {'-':>9} | {ot / tt:>7.2f} {'-':>10} | "
                      f"{om:>8.2f} {'-':>11} {'-':>10} | {omfu:>7.1f}% torchao not installed")
            else:
                print(f"{name:<12} {B:>3} {T:>5} | {ot:>9.0f} {tt:>10.0f} {ao[0]:>9.0f} | {ot / tt:>7.2f} "
                      f"{ot / ao[0]:>10.2f} | {om:>8.2f} {ao[1]:>11.2f} {ao[2]:>10.2f} | {omfu:>7.1f}% {aomfu:>10.1f}%")


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_llama3 import config_from_name  # PyTorch: imported here, so that parse_args and print_tables need none

    variants = args.extra or [""]
    have_torchao = importlib.util.find_spec("torchao") is not None
    rows, fp8_rows = [], []
    for name in args.configs.split(","):
        B, T = BENCH.get(name, (8, 1024))
        config = config_from_name(name)
        flops = flops_per_token(config, T)
        mfu = lambda tok: 100.0 * tok * flops / (args.peak * 1e12)
        torch_tok, torch_mem, torch_reserved = torch_run(name, B, T, args)
        for i, extra in enumerate(variants + ([args.fp8_flag] if args.fp8 else [])):
            tag = "fp8" if i == len(variants) else str(i)
            our_tok, our_mem = ours_run(name, B, T, args, extra, tag)
            rows.append((name, extra or "(defaults)", B, T, our_tok, torch_tok, our_mem, torch_mem, torch_reserved,
                         mfu(our_tok), mfu(torch_tok)))
        if args.fp8:  # the last row is ours in FP8
            fp8_tok, fp8_mem = rows[-1][4], rows[-1][6]
            ao = torch_run(name, B, T, args, torchao=True) if have_torchao else None
            fp8_rows.append((name, B, T, fp8_tok, torch_tok, ao, fp8_mem, mfu(fp8_tok), ao and mfu(ao[0])))

    print_tables(rows, fp8_rows, args.fp8_flag)


if __name__ == "__main__":
    main()
