"""
Several GPUs side by side: train_llama3cu on 1 and N GPUs (mpirun) against PyTorch on 1 GPU and with DDP and FSDP2 on
N GPUs (torchrun), all with bf16 autocast or mixed precision, fp32 master weights, fused AdamW and torch.compile; the
same model and per-GPU batch.

  python scripts/bench_multi_gpu.py --gpus 2 [--config llama3.2-1B] [--steps 15] [--train "data/*_train.bin"]

Prints tok/s and per-GPU memory for every run: tok/s is tokens over the mean step time after 3 warm-up steps (the
throughput of the run; the median step is printed too, but multi-GPU step times can be bimodal, so a median jumps
between the modes), the scaling from 1 to N GPUs for us and for
DDP, our ratio to PyTorch on 1 GPU and to DDP on N, our per-GPU memory for ZeRO stages 0, 1 and 2, and how much of
the gradient reduction the backward hides: with the reduction overlapped (-Q 1) and waited for layer by layer
(-Q 0), the extra time over our 1-GPU step is the exposed reduction time, so

  hidden = 1 - (step_overlapped - step_1gpu) / (step_not_overlapped - step_1gpu).

The PyTorch side runs this same file as its worker (--worker), with the model of scripts/train_llama3.py.
NCCL_NVLS_ENABLE=0 is set for every run.
"""

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")


def worker(args):
    """One PyTorch process: DDP or FSDP2 when started by torchrun with several ranks, plain on one."""
    import torch
    import torch.distributed as dist
    from train_llama3 import Llama3, config_from_name, load_tokens, make_optimizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}"
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device(device))
    torch.manual_seed(1337)
    config = config_from_name(args.config)
    model = Llama3(config)
    model.init_weights(1337)
    model = model.to(device)
    B, T = args.batch_size, args.seq_len
    if args.train:
        loaded = load_tokens(args.train)  # (tokens, loss mask) where the reference reads masked shards
        tokens = torch.from_numpy(loaded[0] if isinstance(loaded, tuple) else loaded)
    else:
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, config.vocab_size, (B * T * world * 4 + 1,), generator=gen)
    optimizer_model = model
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    if args.worker == "fsdp" and world > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=False)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[local_rank])
    forward = torch.compile(model)
    optimizer = make_optimizer(optimizer_model, argparse.Namespace(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                                                                   weight_decay=0.1), device)
    times = []
    for step in range(args.steps):
        start = ((step * world + rank) * B * T) % (len(tokens) - B * T - 1)
        chunk = tokens[start:start + B * T + 1]
        inputs, targets = chunk[:-1].view(B, T).to(device), chunk[1:].view(B, T).to(device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            _, loss = forward(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(optimizer_model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step + 1}/{args.steps} | loss {loss.item():.4f} | {times[-1] * 1000:.1f} ms", flush=True)
    steady = sorted(times[3:])
    median = steady[len(steady) // 2]
    if rank == 0:
        print(f"summary: median step {median * 1000:.2f} ms | {B * T * world / median:.0f} tok/s | peak mem "
              f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    if world > 1:
        dist.destroy_process_group()


def run(cmd, log_path, tokens_per_step):
    """(mean step ms, tok/s from the mean, median step ms, peak GiB per GPU) of a run, steps after 3 warm-up."""
    print("$ " + " ".join(cmd), flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV)
    with open(log_path, "w") as f:
        f.write(result.stdout + result.stderr)
    if result.returncode != 0:
        print(result.stdout[-3000:] + result.stderr[-3000:])
        raise SystemExit(f"error: command failed ({result.returncode}), log in {log_path}")
    m = re.search(r"summary: median step (\S+) ms.*?\| (\d+) tok/s .*?peak mem (\S+) GiB", result.stdout)
    steps = [float(x) for x in re.findall(r"^step +\d+/\d+ \|.*?\| ([\d.]+) ms", result.stdout, re.M)]
    if not m or len(steps) < 5:
        raise SystemExit(f"error: no summary line or too few step lines, log in {log_path}")
    mean = sum(steps[3:]) / len(steps[3:])
    return mean, tokens_per_step / (mean / 1000.0), float(m.group(1)), float(m.group(3))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--config", default="llama3.2-1B")
    parser.add_argument("--batch_size", "-B", type=int, default=8, help="per GPU")
    parser.add_argument("--seq_len", "-T", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--train", default="", help="token shard glob (random tokens when empty)")
    parser.add_argument("--binary", default=os.path.join(ROOT, "train_llama3cu"))
    parser.add_argument("--torch", default="single,ddp,fsdp", help="which PyTorch runs: single, ddp, fsdp")
    parser.add_argument("--ours", default="1,Z1,Z0,Z2,Q0",
                        help="which of our runs: 1 (one GPU), Z0/Z1/Z2 (N GPUs, that ZeRO stage), Q0 (Z1 with -Q 0)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.out, exist_ok=True)
    N, B, T = args.gpus, args.batch_size, args.seq_len
    if not args.train:
        raise SystemExit("error: --train is needed for our trainer (token shards)")

    ours = lambda n, *flags: (["mpirun", "-np", str(n), "--bind-to", "none", "-x", "NCCL_NVLS_ENABLE"] if n > 1
                              else []) + [args.binary, "-c", args.config, "-i", args.train, "-j", "", "-b", str(B),
                                          "-t", str(T), "-x", str(args.steps), "-l", "3e-4", "-v", "0", *flags]
    torch_run = lambda n, mode: [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                                 os.path.abspath(__file__), "--worker", mode, "--config", args.config, "-B", str(B),
                                 "-T", str(T), "--steps", str(args.steps), "--train", args.train]
    log = lambda name: os.path.join(args.out, f"multi_{name}.log")
    r = {}
    ours_runs, torch_modes = args.ours.split(","), args.torch.split(",")
    tokens = lambda n: B * T * n
    r["ours 1 GPU"] = run(ours(1), log("ours_1"), tokens(1))
    for stage in ("1", "0", "2"):
        if f"Z{stage}" in ours_runs or stage == "1":
            r[f"ours {N} GPUs Z{stage}"] = run(ours(N, "-Z", stage), log(f"ours_{N}_z{stage}"), tokens(N))
    if "Q0" in ours_runs:
        r[f"ours {N} GPUs Z1 -Q 0"] = run(ours(N, "-Z", "1", "-Q", "0"), log(f"ours_{N}_z1_q0"), tokens(N))
    if "single" in torch_modes:
        r["torch 1 GPU"] = run(torch_run(1, "ddp"), log("torch_1"), tokens(1))
    if "ddp" in torch_modes:
        r[f"torch DDP {N} GPUs"] = run(torch_run(N, "ddp"), log(f"torch_ddp_{N}"), tokens(N))
    if "fsdp" in torch_modes:
        r[f"torch FSDP2 {N} GPUs"] = run(torch_run(N, "fsdp"), log(f"torch_fsdp_{N}"), tokens(N))

    print(f"\n{args.config}, B={B} T={T} per GPU, {args.steps} steps (mean and median after 3)")
    print(f"{'run':<24} {'mean ms':>9} {'tok/s':>9} {'median ms':>10} {'GiB/GPU':>8}")
    for name, (ms, tok, median, mem) in r.items():
        print(f"{name:<24} {ms:>9.1f} {tok:>9.0f} {median:>10.1f} {mem:>8.2f}")
    one, many = r["ours 1 GPU"], r[f"ours {N} GPUs Z1"]
    print(f"\nour scaling 1 -> {N} GPUs: {many[1] / (N * one[1]):.3f}")
    if "torch 1 GPU" in r:
        print(f"ours / PyTorch on 1 GPU: {one[1] / r['torch 1 GPU'][1]:.3f}")
    if f"torch DDP {N} GPUs" in r:
        ddp = r[f"torch DDP {N} GPUs"]
        print(f"ours / PyTorch DDP on {N} GPUs: {many[1] / ddp[1]:.3f}")
        if "torch 1 GPU" in r:
            print(f"PyTorch DDP scaling 1 -> {N} GPUs: {ddp[1] / (N * r['torch 1 GPU'][1]):.3f}")
    if f"torch FSDP2 {N} GPUs" in r:
        print(f"ours / PyTorch FSDP2 on {N} GPUs: {many[1] / r[f'torch FSDP2 {N} GPUs'][1]:.3f}")
    print(f"(from medians: our scaling {one[2] / many[2]:.3f})")
    exposed = many[0] - one[0]
    serial = r[f"ours {N} GPUs Z1 -Q 0"][0] - one[0] if f"ours {N} GPUs Z1 -Q 0" in r else 0
    if serial > 0:
        print(f"gradient reduction: {serial:.1f} ms per step not overlapped, {exposed:.1f} ms exposed when overlapped: "
              f"{100 * (1 - exposed / serial):.0f}% hidden")


if __name__ == "__main__":
    main()
