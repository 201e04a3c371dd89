"""
Several GPUs side by side: train_llama3cu on 1 GPU and on each count of --gpus (mpirun) against PyTorch on 1 GPU and
with DDP and FSDP2 on the largest count (torchrun), all with bf16 autocast or mixed precision, fp32 master weights,
fused AdamW and torch.compile; the same model and per-GPU batch.

  python scripts/bench_multi_gpu.py --gpus 2 --train <shard> [--config llama3.2-1B] [--steps 15]
  python scripts/bench_multi_gpu.py --gpus 2,4,8 --ours 1,Z1,Z2 --with_8b --train <shard>   # a host's scaling table
  python scripts/bench_multi_gpu.py --gpus 2 --transport socket --torch none --ours 1,Z1 --train <shard>

Prints tok/s and per-GPU memory for every run: tok/s is tokens over the mean step time after 3 warm-up steps (the
throughput of the run; the median step is printed too, but multi-GPU step times can be bimodal, so a median jumps
between the modes), the scaling from 1 GPU to each count for us and for DDP, our ratio to PyTorch on 1 GPU and to
DDP and FSDP2 on the largest count, our per-GPU memory for each ZeRO stage, and (Q0 in --ours, at the largest count)
how much of the gradient reduction the backward hides: with the reduction overlapped (-Q 1) and waited for layer by
layer (-Q 0), the extra time over our 1-GPU step is the exposed reduction time, so

  hidden = 1 - (step_overlapped - step_1gpu) / (step_not_overlapped - step_1gpu).

--with_8b adds llama3.1-8B at T=8192, B=1 per GPU on the largest count: ours in BF16 with fp32 master weights and
AdamW (-Z --stage_8b, -R 2) and in FP8 (-M fp8), and PyTorch FSDP2 with each layer's activations recomputed (it does
not fit otherwise); a PyTorch run that fails (out of memory) is reported, not fatal.
--each_gpu runs our 1-GPU step on every GPU of the largest count, one at a time, and gives the scaling (and with Q0
the reduction's cost) also against the slowest of them: the several-GPU step goes at its slowest GPU's pace, and
GPU 0 (the plain 1-GPU run's) need not be the slowest (2 H200s of one host: 220.4 and 218.3 ms at the 1B).
--transport socket turns NCCL's peer-to-peer, shared-memory and InfiniBand transports off, so that every collective,
ours and PyTorch's, goes through NCCL's socket transport, as between hosts without InfiniBand.

The PyTorch side runs this same file as its worker (--worker), with the model of scripts/train_llama3.py.
NCCL_NVLS_ENABLE=0 is set for every run.
"""

import argparse
import os
import re
import shlex
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
    if args.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
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


# NCCL settings of --transport; NCCL_NVLS_ENABLE=0 always (ENV).
TRANSPORTS = {"default": {}, "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}}
BIG = ("llama3.1-8B", 1, 8192)  # --with_8b: config, B and T per GPU


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", default="2", help="GPU counts of the multi-GPU runs, e.g. 2 or 2,4,8; PyTorch's "
                                                    "DDP and FSDP2 run on the largest")
    parser.add_argument("--config", default="llama3.2-1B")
    parser.add_argument("--batch_size", "-B", type=int, default=8, help="per GPU")
    parser.add_argument("--seq_len", "-T", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--train", default="", help="token shard glob (random tokens for PyTorch when empty)")
    parser.add_argument("--binary", default=os.path.join(ROOT, "train_llama3cu"))
    parser.add_argument("--torch", default="single,ddp,fsdp", help="which PyTorch runs: single, ddp, fsdp, or none")
    parser.add_argument("--ours", default="1,Z1,Z0,Z2,Q0",
                        help="which of our runs: 1 (one GPU), Z<stage> (-Z <stage> on each count; Z1 always runs), "
                             "Q0 (Z1 with -Q 0 on the largest count), E0 (Z1 with -E 0, NCCL's kernels for every "
                             "collective, on the largest count)")
    parser.add_argument("--ours_flags", default="", help="trainer flags for every run of ours, e.g. '-M fp8'")
    parser.add_argument("--each_gpu", action="store_true",
                        help="our 1-GPU run on every GPU of the largest count, one at a time (CUDA_VISIBLE_DEVICES), "
                             "and the scaling also against the slowest of them: a several-GPU step goes at its "
                             "slowest GPU's pace, and the GPUs of one host differ (2 H200s: 220.4 and 218.3 ms)")
    parser.add_argument("--with_8b", action="store_true", help="also llama3.1-8B at T=8192 on the largest count")
    parser.add_argument("--stage_8b", type=int, default=1, help="our ZeRO stage for the 8B")
    parser.add_argument("--transport", default="default", choices=sorted(TRANSPORTS),
                        help="NCCL's choice, or its socket transport alone (as between hosts)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--activation_checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    try:
        args.counts = sorted({int(n) for n in args.gpus.split(",")})
    except ValueError:
        parser.error(f"--gpus {args.gpus}: not a comma-separated list of GPU counts")
    if args.counts[0] < 2:
        parser.error(f"--gpus {args.gpus}: each count must be 2 or more (our 1-GPU run is '1' in --ours)")
    for token in args.ours.split(","):
        if token not in ("1", "Q0", "E0") and not re.fullmatch(r"Z\d", token):
            parser.error(f"--ours: '{token}' is not 1, Z<stage>, Q0 or E0")
    if args.each_gpu and "1" not in args.ours.split(","):
        parser.error("--each_gpu repeats our 1-GPU run: --ours must hold 1")
    torch_modes = [] if args.torch == "none" else args.torch.split(",")
    for mode in torch_modes:
        if mode not in ("single", "ddp", "fsdp"):
            parser.error(f"--torch: '{mode}' is not single, ddp, fsdp or none")
    args.torch_modes = torch_modes
    if not args.train:
        parser.error("--train is needed for our trainer (token shards)")
    return args


def env(transport):
    """The environment of every run: ENV and the transport's NCCL settings."""
    return dict(ENV, **TRANSPORTS[transport])


def ours_cmd(args, n, config, B, T, *flags):
    """train_llama3cu on n GPUs (mpirun, handing each rank the NCCL settings) with the given model and batch."""
    nccl = ["NCCL_NVLS_ENABLE", *TRANSPORTS[args.transport]]
    launcher = ["mpirun", "-np", str(n), "--bind-to", "none", *[a for v in nccl for a in ("-x", v)]] if n > 1 else []
    return launcher + [args.binary, "-c", config, "-i", args.train, "-j", "", "-b", str(B), "-t", str(T), "-x",
                       str(args.steps), "-l", "3e-4", "-v", "0", *shlex.split(args.ours_flags), *flags]


def torch_cmd(args, n, mode, config, B, T, *flags):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", os.path.abspath(__file__),
            "--worker", mode, "--config", config, "-B", str(B), "-T", str(T), "--steps", str(args.steps), "--train",
            args.train, *flags]


def our_stages(args):
    """The ZeRO stages we run on each count: those of --ours, Z1 first (the scaling's reference)."""
    return sorted({t[1:] for t in args.ours.split(",") if t.startswith("Z")} | {"1"}, key=lambda z: (z != "1", z))


def plan(args):
    """The runs, in order: (name, command, tokens per step, whether a failure stops the benchmark)."""
    B, T, N = args.batch_size, args.seq_len, args.counts[-1]
    ours = args.ours.split(",")
    runs = []
    if "1" in ours:
        runs.append(("ours 1 GPU", ours_cmd(args, 1, args.config, B, T), B * T, True))  # on GPU 0
        for k in range(1, N if args.each_gpu else 1):
            runs.append((f"ours 1 GPU (GPU {k})", ["env", f"CUDA_VISIBLE_DEVICES={k}",
                                                    *ours_cmd(args, 1, args.config, B, T)], B * T, True))
    for n in args.counts:
        for stage in our_stages(args):
            runs.append((f"ours {n} GPUs Z{stage}", ours_cmd(args, n, args.config, B, T, "-Z", stage), B * T * n,
                         True))
    if "Q0" in ours:
        runs.append((f"ours {N} GPUs Z1 -Q 0", ours_cmd(args, N, args.config, B, T, "-Z", "1", "-Q", "0"), B * T * N,
                     True))
    if "E0" in ours:
        runs.append((f"ours {N} GPUs Z1 -E 0", ours_cmd(args, N, args.config, B, T, "-Z", "1", "-E", "0"), B * T * N,
                     True))
    if "single" in args.torch_modes:
        runs.append(("torch 1 GPU", torch_cmd(args, 1, "ddp", args.config, B, T), B * T, True))
    if "ddp" in args.torch_modes:
        runs.append((f"torch DDP {N} GPUs", torch_cmd(args, N, "ddp", args.config, B, T), B * T * N, True))
    if "fsdp" in args.torch_modes:
        runs.append((f"torch FSDP2 {N} GPUs", torch_cmd(args, N, "fsdp", args.config, B, T), B * T * N, True))
    if args.with_8b:
        config, B8, T8 = BIG
        z = ["-Z", str(args.stage_8b), "-R", "2"]
        runs.append((f"8B ours {N} GPUs bf16", ours_cmd(args, N, config, B8, T8, *z), B8 * T8 * N, True))
        runs.append((f"8B ours {N} GPUs fp8", ours_cmd(args, N, config, B8, T8, *z, "-M", "fp8"), B8 * T8 * N, True))
        runs.append((f"8B torch FSDP2 {N} GPUs", torch_cmd(args, N, "fsdp", config, B8, T8,
                                                           "--activation_checkpointing"), B8 * T8 * N, False))
    return runs


def slowest_alone(r, n):
    """(GPU index, result) of the slowest of our 1-GPU runs on GPUs 0 to n-1 (--each_gpu)."""
    alone = [r["ours 1 GPU"]] + [r[f"ours 1 GPU (GPU {k})"] for k in range(1, n)]
    slowest = max(range(n), key=lambda k: alone[k][0])
    return slowest, alone[slowest]


def log_name(name):
    return "multi_" + re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".log"


def run(cmd, log_path, tokens_per_step, run_env):
    """(mean step ms, tok/s from the mean, median step ms, peak GiB per GPU) of a run, steps after 3 warm-up; None
    for a run that failed (its log says why)."""
    print("$ " + " ".join(cmd), flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=run_env)
    with open(log_path, "w") as f:
        f.write(result.stdout + result.stderr)
    if result.returncode != 0:
        print(result.stdout[-3000:] + result.stderr[-3000:])
        print(f"command failed ({result.returncode}), log in {log_path}", flush=True)
        return None
    m = re.search(r"summary: median step (\S+) ms.*?\| (\d+) tok/s .*?peak mem (\S+) GiB", result.stdout)
    steps = [float(x) for x in re.findall(r"^step +\d+/\d+ \|.*?\| ([\d.]+) ms", result.stdout, re.M)]
    if not m or len(steps) < 5:
        raise SystemExit(f"error: no summary line or too few step lines, log in {log_path}")
    mean = sum(steps[3:]) / len(steps[3:])
    return mean, tokens_per_step / (mean / 1000.0), float(m.group(1)), float(m.group(3))


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    os.makedirs(args.out, exist_ok=True)
    B, T, N = args.batch_size, args.seq_len, args.counts[-1]
    run_env = env(args.transport)
    r = {}
    for name, cmd, tokens, required in plan(args):
        log = os.path.join(args.out, log_name(name))
        r[name] = run(cmd, log, tokens, run_env)
        if r[name] is None and required:
            raise SystemExit(f"error: {name} failed, log in {log}")

    print(f"\n{args.config}, B={B} T={T} per GPU, {args.steps} steps (mean and median after 3), NCCL transport "
          f"{args.transport}")
    print(f"{'run':<26} {'mean ms':>9} {'tok/s':>9} {'tok/s/GPU':>9} {'median ms':>10} {'GiB/GPU':>8}")
    for name, result in r.items():
        if result is None:
            print(f"{name:<26} failed (see its log)")
            continue
        ms, tok, median, mem = result
        gpus = int(re.search(r"(\d+) GPU", name).group(1))
        print(f"{name:<26} {ms:>9.1f} {tok:>9.0f} {tok / gpus:>9.0f} {median:>10.1f} {mem:>8.2f}")
    one, torch_one = r.get("ours 1 GPU"), r.get("torch 1 GPU")
    print()
    for n in args.counts:
        if one is not None:
            scaling = ", ".join(f"Z{z} {r[f'ours {n} GPUs Z{z}'][1] / (n * one[1]):.3f}" for z in our_stages(args))
            print(f"our scaling 1 -> {n} GPUs: {scaling} (from medians, Z1: {one[2] / r[f'ours {n} GPUs Z1'][2]:.3f})")
        if one is not None and args.each_gpu:
            slowest, alone = slowest_alone(r, n)
            scaling = ", ".join(f"Z{z} {r[f'ours {n} GPUs Z{z}'][1] / (n * alone[1]):.3f}" for z in our_stages(args))
            print(f"our scaling 1 -> {n} GPUs against the slowest of GPUs 0-{n - 1} alone (GPU {slowest}, "
                  f"{alone[0]:.1f} ms): {scaling}")
    many = r[f"ours {N} GPUs Z1"]
    if one is not None and torch_one is not None:
        print(f"ours / PyTorch on 1 GPU: {one[1] / torch_one[1]:.3f}")
    ddp, fsdp = r.get(f"torch DDP {N} GPUs"), r.get(f"torch FSDP2 {N} GPUs")
    if ddp is not None:
        print(f"ours Z1 / PyTorch DDP on {N} GPUs: {many[1] / ddp[1]:.3f}")
        if torch_one is not None:
            print(f"PyTorch DDP scaling 1 -> {N} GPUs: {ddp[1] / (N * torch_one[1]):.3f}")
    if fsdp is not None:
        print(f"ours Z1 / PyTorch FSDP2 on {N} GPUs: {many[1] / fsdp[1]:.3f}")
    serial = r.get(f"ours {N} GPUs Z1 -Q 0")
    if one is not None and serial is not None and serial[0] > one[0]:
        exposed, waited = many[0] - one[0], serial[0] - one[0]
        print(f"gradient reduction on {N} GPUs: {waited:.1f} ms per step not overlapped, {exposed:.1f} ms exposed "
              f"when overlapped: {100 * (1 - exposed / waited):.0f}% hidden")
        if args.each_gpu:
            slowest, alone = slowest_alone(r, N)
            print(f"against the slowest GPU alone (GPU {slowest}, {alone[0]:.1f} ms): "
                  f"{serial[0] - alone[0]:.1f} ms not overlapped, {many[0] - alone[0]:.1f} ms exposed")
    kernels = r.get(f"ours {N} GPUs Z1 -E 0")
    if kernels is not None:
        print(f"copy engines on {N} GPUs (Z1): {many[0]:.1f} ms per step, {kernels[0]:.1f} ms with NCCL's kernels for "
              f"every collective (-E 0)")
    if args.with_8b:
        bf16, fp8, big_fsdp = r[f"8B ours {N} GPUs bf16"], r[f"8B ours {N} GPUs fp8"], r[f"8B torch FSDP2 {N} GPUs"]
        line = f"llama3.1-8B T={BIG[2]} on {N} GPUs, tok/s per GPU: ours bf16 {bf16[1] / N:.0f}, fp8 {fp8[1] / N:.0f}"
        if big_fsdp is not None:
            line += f", PyTorch FSDP2 {big_fsdp[1] / N:.0f} (ours bf16 / FSDP2 {bf16[1] / big_fsdp[1]:.3f})"
        print(line)


if __name__ == "__main__":
    main()
