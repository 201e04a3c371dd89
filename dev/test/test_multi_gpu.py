"""
Multi-GPU tests: train_llama3cu on 2 GPUs through mpirun and NCCL. They need a machine with at least 2 GPUs and
OpenMPI's mpirun; elsewhere they are skipped and say so.

  - equivalence: d12 on 2 GPUs with micro-batch B against 1 GPU with micro-batch B and 2 gradient-accumulation steps
    (the same global batch and token order), in FP32 (to 1e-5) and BF16 (the tie-out's bf16 bounds);
  - ZeRO stages 0, 1 and 2 give bit-identical losses (without clipping), and a rerun gives the same run;
  - resume on 2 GPUs reproduces the uninterrupted run bit for bit, for ZeRO-1 and ZeRO-2;
  - resuming with another number of GPUs stops with a message saying what the checkpoint was written with;
  - a rank that fails (a truncated state shard) stops every rank, naming itself; a rank that stops answering
    (SIGSTOP) makes the others time out (-T) and stop, never hang.
NCCL_NVLS_ENABLE=0 is set for every run (NVLink multicast stays off).
"""

import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
from gpu_common import build_binaries, gpu_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


NOT_RUN = None
if gpu_count() < 2:
    NOT_RUN = f"needs 2 GPUs, this machine has {gpu_count()}"
elif shutil.which("mpirun") is None:
    NOT_RUN = "needs OpenMPI's mpirun"
pytestmark = pytest.mark.skipif(NOT_RUN is not None, reason=f"multi-GPU tests not run: {NOT_RUN}")

ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run(cmd, timeout=900):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV)


def mpirun(n, cmd):
    return ["mpirun", "-np", str(n), "--bind-to", "none", "-x", "NCCL_NVLS_ENABLE", *cmd]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """The trainer with MPI and NCCL in both precisions, built in a copy of the sources (the repo's binaries stay)."""
    bins = build_binaries(str(tmp_path_factory.mktemp("bin")), targets=("train",), make_flags=("USE_MPI=1",))
    return {precision: b["train"] for precision, b in bins.items()}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Learnable token shards: each token follows from the previous one by a fixed rule, with 10% noise."""
    out = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    count = 300000
    noise = rng.integers(0, 2000, size=count)
    tokens = np.zeros(count, dtype=np.uint32)
    for i in range(1, count):
        tokens[i] = noise[i] if noise[i] < 200 else (tokens[i - 1] * 7 + 3) % 2000
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240801, 7, count]
    with open(out / "tok_train.bin", "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
    return out


def train_args(shards, out_dir, steps, *extra):
    return ["-c", "d12", "-i", str(shards / "tok_train.bin"), "-j", "", "-o", str(out_dir), "-b", "4", "-t", "256",
            "-x", str(steps), "-l", "1e-4", "-u", "5", "-f", "0", "-S", "7", "-n", "0", *extra]


def steps_of(stdout):
    """(step, loss, norm) of every step line."""
    return [(int(s), float(l), float(n)) for s, l, n in
            re.findall(r"step +(\d+)/\d+ \| loss (\S+) \| norm (\S+)", stdout)]


def raw_steps(stdout):
    return re.findall(r"step +(\d+)/\d+ \| loss (\S+) \| norm (\S+)", stdout)


def test_two_gpus_match_one_gpu_with_accumulation(build, shards, tmp_path):
    """20 steps of d12: 2 GPUs with micro-batch B against 1 GPU with B and 2 accumulation steps. FP32: losses and
    norms to 1e-5. BF16: within the tie-out's bf16 bounds (losses 2e-2 at step 1 and 5e-2 after, norms 5e-2
    relative) or, where the training itself amplifies rounding, within twice what bf16 arithmetic alone moves this
    run: the distance of the 1-GPU bf16 run from the 1-GPU fp32 run up to that step."""
    runs = {}
    for precision in ("FP32", "BF16"):
        one = run([build[precision], *train_args(shards, tmp_path / f"one{precision}", 20, "-g", "2048")])
        assert one.returncode == 0, one.stdout + one.stderr
        two = run(mpirun(2, [build[precision], *train_args(shards, tmp_path / f"two{precision}", 20)]))
        assert two.returncode == 0, two.stdout + two.stderr
        assert "2 GPU(s) x grad_accum 1 = 2048 tokens/step" in two.stdout, two.stdout
        runs[precision] = (steps_of(one.stdout), steps_of(two.stdout))
        assert len(runs[precision][0]) == len(runs[precision][1]) == 20
        print(f"{precision}: printed values identical: {raw_steps(one.stdout) == raw_steps(two.stdout)}")
    (f1, f2), (b1, b2) = runs["FP32"], runs["BF16"]
    rel = lambda x, y: abs(x - y) / abs(y)
    bf16_loss_drift = bf16_norm_drift = 0.0
    worst = {"fp32 loss": 0.0, "fp32 norm": 0.0, "bf16 loss": 0.0, "bf16 norm": 0.0}
    failures = []
    print("step | fp32 loss 1 GPU, 2 GPUs | fp32 norm 1, 2 | bf16 loss 1, 2 | bf16 norm 1, 2 | bf16 vs fp32 (1 GPU)")
    for k in range(20):
        bf16_loss_drift = max(bf16_loss_drift, abs(b1[k][1] - f1[k][1]))
        bf16_norm_drift = max(bf16_norm_drift, rel(b1[k][2], f1[k][2]))
        print(f"{k + 1:4d} | {f1[k][1]:.6f} {f2[k][1]:.6f} | {f1[k][2]:.6f} {f2[k][2]:.6f} | {b1[k][1]:.6f} "
              f"{b2[k][1]:.6f} | {b1[k][2]:.6f} {b2[k][2]:.6f} | {bf16_loss_drift:.2e} {bf16_norm_drift:.2e}")
        worst["fp32 loss"] = max(worst["fp32 loss"], abs(f1[k][1] - f2[k][1]))
        worst["fp32 norm"] = max(worst["fp32 norm"], rel(f2[k][2], f1[k][2]))
        worst["bf16 loss"] = max(worst["bf16 loss"], abs(b1[k][1] - b2[k][1]))
        worst["bf16 norm"] = max(worst["bf16 norm"], rel(b2[k][2], b1[k][2]))
        loss_bound = max(2e-2 if k == 0 else 5e-2, 2 * bf16_loss_drift)
        norm_bound = max(5e-2, 2 * bf16_norm_drift)
        if abs(f1[k][1] - f2[k][1]) > 1e-5 or rel(f2[k][2], f1[k][2]) > 1e-5:
            failures.append(f"fp32 step {k + 1}")
        if abs(b1[k][1] - b2[k][1]) > loss_bound or rel(b2[k][2], b1[k][2]) > norm_bound:
            failures.append(f"bf16 step {k + 1} (bounds {loss_bound:.2e}, {norm_bound:.2e})")
    print("worst: " + ", ".join(f"{name} {value:.2e}" for name, value in worst.items()))
    assert not failures, failures


@pytest.mark.parametrize("precision", ["FP32", "BF16"])
def test_zero_stages_agree_bit_for_bit(build, shards, tmp_path, precision):
    """Without clipping the norm never enters the update, so stages 0, 1 and 2 must give the same bits."""
    results = {}
    for stage in ("0", "1", "2"):
        r = run(mpirun(2, [build[precision], *train_args(shards, tmp_path / f"z{stage}", 8, "-G", "0", "-Z", stage)]))
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"ZeRO stage {stage}" in r.stdout
        results[stage] = [(s, l) for s, l, _ in raw_steps(r.stdout)]
    assert len(results["0"]) == 8
    assert results["0"] == results["1"] == results["2"], results
    again = run(mpirun(2, [build[precision], *train_args(shards, tmp_path / "again", 8, "-G", "0", "-Z", "1")]))
    assert [(s, l) for s, l, _ in raw_steps(again.stdout)] == results["1"]


@pytest.mark.parametrize("options", [("-Z", "1"), ("-Z", "2"), ("-Z", "2", "-g", "4096"),
                                     ("-Z", "1", "-W", "0", "-O", "bf16")])
def test_resume_on_two_gpus_is_bit_identical(build, shards, tmp_path, options):
    train = build["BF16"]
    cmd = lambda name, *extra: mpirun(2, [train, *train_args(shards, tmp_path / name, 10, "-k", "constant", "-n", "5",
                                                             *options, *extra)])
    full = run(cmd("full"))
    assert full.returncode == 0, full.stdout + full.stderr
    part = run(cmd("part", "-x", "5"))
    assert part.returncode == 0, part.stdout + part.stderr
    names = sorted(os.listdir(tmp_path / "part"))
    assert names == ["log.txt", "model_00000005.bin", "run.txt", "state_00000005.bin", "state_00000005_rank1.bin"], names
    resumed = run(cmd("part", "-y", "1"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    full_steps, resumed_steps = raw_steps(full.stdout), raw_steps(resumed.stdout)
    assert len(full_steps) == 10
    assert resumed_steps == full_steps[5:], (resumed.stdout, full.stdout)


def test_resume_with_other_gpu_count_is_refused(build, shards, tmp_path):
    train = build["BF16"]
    first = run(mpirun(2, [train, *train_args(shards, tmp_path / "ck", 3, "-n", "3", "-u", "1")]))
    assert first.returncode == 0, first.stdout + first.stderr
    single = run([train, *train_args(shards, tmp_path / "ck", 6, "-n", "3", "-u", "1", "-y", "1")])
    assert single.returncode == 1, single.stdout + single.stderr
    assert "run on 2 GPU(s)" in single.stderr and "same number of GPUs" in single.stderr, single.stderr


def test_failing_rank_stops_every_rank(build, shards, tmp_path):
    train = build["BF16"]
    first = run(mpirun(2, [train, *train_args(shards, tmp_path / "ck", 3, "-n", "3", "-u", "1")]))
    assert first.returncode == 0, first.stdout + first.stderr
    shard = tmp_path / "ck" / "state_00000003_rank1.bin"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    start = time.time()
    resumed = run(mpirun(2, [train, *train_args(shards, tmp_path / "ck", 6, "-n", "3", "-u", "1", "-y", "1",
                                                "-T", "30")]), timeout=300)
    assert resumed.returncode != 0 and resumed.returncode > 0
    assert "truncated or corrupt" in resumed.stderr and "[rank 1 of 2] stopped" in resumed.stderr, resumed.stderr
    assert time.time() - start < 120


def rank_pid(marker, rank):
    """The pid of the trainer process of `rank` whose command line contains marker."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if marker in cmdline and "train_llama3cu" in cmdline and f"OMPI_COMM_WORLD_RANK={rank}" in environ:
            return int(pid)
    return None


def test_rank_that_stops_answering_times_out(build, shards, tmp_path):
    out_dir = tmp_path / "stall"
    cmd = mpirun(2, [build["BF16"], *train_args(shards, out_dir, 100000, "-T", "5")])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # wait until it trains
            log = out_dir / "log.txt"
            if log.exists() and log.read_text().count("train_loss") >= 3:
                break
            time.sleep(0.5)
        pid = rank_pid(str(out_dir), 1)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, signal.SIGSTOP)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "did not finish within 5 s" in stderr and "[rank 0 of 2]" in stderr, stderr[-3000:]
