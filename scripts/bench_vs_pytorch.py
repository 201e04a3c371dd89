"""
Side by side on one GPU: train_llama3cu against scripts/train_llama3.py in its strongest PyTorch form (bf16 autocast
with fp32 master weights, fused AdamW, torch.compile, SDPA flash/cuDNN attention), same model, same tokens.

  python scripts/bench_vs_pytorch.py --train "data/tinyshakespeare/*_train.bin" [--configs d12,llama3.2-1B]

For each config it prints tok/s (median step after warm-up), peak GPU memory and MFU for both, and our/PyTorch
ratios. MFU uses one FLOP convention for both: 6 x matmul weights + 6 L H hd T per token (causal attention),
against the GPU's dense bf16 peak (989 TFLOP/s on H100/H200, or --peak).
Memory: ours is device memory in use beyond the CUDA context (all our allocations, cuBLAS workspace included);
PyTorch's is torch.cuda.max_memory_allocated (and max_memory_reserved, printed alongside).
"""

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_llama3 import config_from_name  # noqa: E402

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True, help="token shard glob, the same for both")
    parser.add_argument("--configs", default="d12,llama3.2-1B")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--binary", default=os.path.join(ROOT, "train_llama3cu"))
    parser.add_argument("--extra", action="append", default=None,
                        help="extra flags for train_llama3cu, e.g. '-W 0 -O bf16'; repeat for several variants, "
                             "each a row against the same PyTorch run")
    parser.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s of the GPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="where the logs go")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    variants = args.extra or [""]
    rows = []
    for name in args.configs.split(","):
        B, T = BENCH.get(name, (8, 1024))
        config = config_from_name(name)
        flops = flops_per_token(config, T)
        theirs = run([sys.executable, "scripts/train_llama3.py", "--config", name, "--input_bin", args.train,
                      "-B", str(B), "-T", str(T), "--steps", str(args.steps), "--lr", "3e-4", "--dtype", "bfloat16",
                      "--compile", "1", "--device", "cuda"],
                     os.path.join(args.out, f"bench_torch_{name}.log"))
        m = re.search(r"median step (\S+) ms \| (\d+) tok/s \| peak memory (\S+) GiB allocated, (\S+) GiB reserved",
                      theirs)
        if not m:
            raise SystemExit(f"error: no median line from train_llama3.py for {name}")
        torch_tok, torch_mem, torch_reserved = float(m.group(2)), float(m.group(3)), float(m.group(4))
        for i, extra in enumerate(variants):
            ours = run([args.binary, "-c", name, "-i", args.train, "-j", "", "-b", str(B), "-t", str(T),
                        "-x", str(args.steps), "-l", "3e-4", "-v", "0", *extra.split()],
                       os.path.join(args.out, f"bench_ours_{name}_{i}.log"))
            m = re.search(r"summary: median step (\S+) ms over \d+ steps \| (\d+) tok/s .* peak mem (\S+) GiB", ours)
            if not m:
                raise SystemExit(f"error: no summary line from train_llama3cu for {name}")
            our_tok, our_mem = float(m.group(2)), float(m.group(3))
            mfu = lambda tok: 100.0 * tok * flops / (args.peak * 1e12)
            rows.append((name, extra or "(defaults)", B, T, our_tok, torch_tok, our_mem, torch_mem, torch_reserved,
                         mfu(our_tok), mfu(torch_tok)))

    print()
    print(f"{'config':<12} {'our flags':<16} {'B':>3} {'T':>5} | {'ours tok/s':>10} {'torch tok/s':>11} {'ratio':>6} | "
          f"{'ours GiB':>8} {'torch GiB':>9} {'(reserved)':>10} {'ratio':>6} | {'ours MFU':>8} {'torch MFU':>9}")
    for name, flags, B, T, ot, tt, om, tm, tr, omfu, tmfu in rows:
        print(f"{name:<12} {flags:<16} {B:>3} {T:>5} | {ot:>10.0f} {tt:>11.0f} {ot / tt:>6.2f} | {om:>8.2f} "
              f"{tm:>9.2f} {tr:>10.2f} {om / tm:>6.2f} | {omfu:>7.1f}% {tmfu:>8.1f}%")

if __name__ == "__main__":
    main()
