"""
Multi-GPU tests: train_llama3cu on 2 or more GPUs through mpirun and NCCL. They need a machine with at least 2 GPUs
and OpenMPI's mpirun; elsewhere they are skipped and say so. The cases for 4 or 8 GPUs run where that many GPUs are,
and are skipped with the reason elsewhere.

  - equivalence: d12 on N GPUs (2, 4, 8) with micro-batch B against 1 GPU with micro-batch B and N gradient-
    accumulation steps (the same global batch and token order), in FP32 (to 1e-5) and BF16 (the tie-out's bf16 bounds);
  - ZeRO stages 0 to 3 give bit-identical losses, samples and model files (without clipping), and a rerun gives the
    same run;
  - resume on N GPUs (2, 4, 8) reproduces the uninterrupted run bit for bit, for ZeRO-1, 2 and 3 (ZeRO-3 also with
    -W 0 -O bf16, -R 2, accumulation and FP8);
  - resharding: a checkpoint resumed with another ZeRO stage on the same GPUs continues its run bit for bit (without
    clipping, where the stages agree bit for bit); on another number of GPUs (2 -> 1, 1 -> 2, 4 -> 2, 8 -> 2) it
    continues the loss to rounding; the optimizer state read in another layout is, bit for bit, what that layout's own
    run wrote; what cannot be resumed is refused, naming the file;
  - NCCL's socket transport alone (peer-to-peer and shared memory off, as between hosts) gives the same losses as
    the default transport; both runs' tok/s are printed;
  - a rank that fails (a truncated state shard) stops every rank, naming itself; a rank that stops answering
    (SIGSTOP) makes the others time out (-T) and stop, never hang.
NCCL_NVLS_ENABLE=0 is set for every run (NVLink multicast stays off).
"""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from gpu_common import build_binaries, gpu_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "dev", "data"))
import export_tokenizer  # noqa: E402


GPUS = gpu_count()
NOT_RUN = None
if GPUS < 2:
    NOT_RUN = f"needs 2 GPUs, this machine has {GPUS}"
elif shutil.which("mpirun") is None:
    NOT_RUN = "needs OpenMPI's mpirun"
pytestmark = pytest.mark.skipif(NOT_RUN is not None, reason=f"multi-GPU tests not run: {NOT_RUN}")

ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
# NCCL's socket transport alone: no peer-to-peer (NVLink, PCIe), shared memory or InfiniBand, as between hosts
SOCKET = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


def needs_gpus(n):
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs, this machine has {GPUS}")


def run(cmd, timeout=900, env=ENV):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def mpirun(n, cmd, exported=()):
    """cmd on n ranks; each gets NCCL_NVLS_ENABLE and the `exported` variables of the environment."""
    return ["mpirun", "-np", str(n), "--bind-to", "none",
            *[a for var in ("NCCL_NVLS_ENABLE", *exported) for a in ("-x", var)], *cmd]


def on_gpus(n, cmd):
    """cmd on n GPUs: through mpirun for several, a plain process on one."""
    return run(mpirun(n, cmd) if n > 1 else cmd)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """The trainer with MPI and NCCL in both precisions, built in a copy of the sources (the repo's binaries stay)."""
    bins = build_binaries(str(tmp_path_factory.mktemp("bin")), targets=("train",), make_flags=("USE_MPI=1",))
    return {precision: b["train"] for precision, b in bins.items()}


@pytest.fixture(autouse=True)
def drop_checkpoints(tmp_path):
    """Each test's checkpoints deleted when it ends: a d12 checkpoint with its optimizer state is about 4 GB, and
    pytest keeps every test's directory, so a whole run of this file would fill a 128 GB disk (it did, on 2 H200s)."""
    yield
    for path in glob.glob(str(tmp_path / "**" / "*.bin*"), recursive=True):
        if re.match(r"(model|state)_\d+.*\.bin", os.path.basename(path)):
            os.remove(path)


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


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A tokenizer file for d12's 128256 ids (llmc/tokenizer.h): byte tokens, then named special tokens."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.bin"
    return export_tokenizer.write_tokenizer(path, export_tokenizer.byte_pieces(128256), 128000, 128001, 128009)


def train_args(shards, out_dir, steps, *extra):
    """A d12 run of `steps` steps; its warmup (5 steps) no longer than the run, which the trainer refuses."""
    return ["-c", "d12", "-i", str(shards / "tok_train.bin"), "-j", "", "-o", str(out_dir), "-b", "4", "-t", "256",
            "-x", str(steps), "-l", "1e-4", "-u", str(min(5, steps)), "-f", "0", "-S", "7", "-n", "0", *extra]


def steps_of(stdout):
    """(step, loss, norm) of every step line."""
    return [(int(s), float(l), float(n)) for s, l, n in
            re.findall(r"step +(\d+)/\d+ \| loss (\S+) \| norm (\S+)", stdout)]


def raw_steps(stdout):
    return re.findall(r"step +(\d+)/\d+ \| loss (\S+) \| norm (\S+)", stdout)


@pytest.mark.parametrize("gpus", [2, pytest.param(4, marks=needs_gpus(4)), pytest.param(8, marks=needs_gpus(8))])
def test_gpus_match_one_gpu_with_accumulation(build, shards, tmp_path, gpus):
    """20 steps of d12: N GPUs with micro-batch B against 1 GPU with B and N accumulation steps. FP32: losses and
    norms to 1e-5. BF16: within the tie-out's bf16 bounds (losses 2e-2 at step 1 and 5e-2 after, norms 5e-2
    relative) or, where the training itself amplifies rounding, within twice what bf16 arithmetic alone moves this
    run: the distance of the 1-GPU bf16 run from the 1-GPU fp32 run up to that step."""
    runs = {}
    tokens = 1024 * gpus
    for precision in ("FP32", "BF16"):
        one = run([build[precision], *train_args(shards, tmp_path / f"one{precision}", 20, "-g", str(tokens))])
        assert one.returncode == 0, one.stdout + one.stderr
        many = run(mpirun(gpus, [build[precision], *train_args(shards, tmp_path / f"many{precision}", 20)]))
        assert many.returncode == 0, many.stdout + many.stderr
        assert f"{gpus} GPU(s) x grad_accum 1 = {tokens} tokens/step" in many.stdout, many.stdout
        runs[precision] = (steps_of(one.stdout), steps_of(many.stdout))
        assert len(runs[precision][0]) == len(runs[precision][1]) == 20
        print(f"{precision}: printed values identical: {raw_steps(one.stdout) == raw_steps(many.stdout)}")
    (f1, f2), (b1, b2) = runs["FP32"], runs["BF16"]
    rel = lambda x, y: abs(x - y) / abs(y)
    bf16_loss_drift = bf16_norm_drift = 0.0
    worst = {"fp32 loss": 0.0, "fp32 norm": 0.0, "bf16 loss": 0.0, "bf16 norm": 0.0}
    failures = []
    print(f"step | fp32 loss 1 GPU, {gpus} GPUs | fp32 norm 1, {gpus} | bf16 loss 1, {gpus} | bf16 norm 1, {gpus} | "
          "bf16 vs fp32 (1 GPU)")
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


@pytest.mark.parametrize("precision", ["FP32", "BF16", "FP8"])
def test_zero_stages_agree_bit_for_bit(build, shards, tokenizer, tmp_path, precision):
    """Without clipping the norm never enters the update, so stages 0 to 3 must give the same bits (FP8: the BF16
    build's FP8 mode, whose amaxes and scales are taken per rank from that rank's tensors, as on one GPU): the losses,
    the samples (ZeRO-3 samples on every rank, its forwards gather the weights) and the model file written at the
    last step (ZeRO-3 gathers it for rank 0). Prints each stage's peak memory per GPU."""
    train, mode = (build["BF16"], ("-M", "fp8", "-K", "0")) if precision == "FP8" else (build[precision], ())
    results, samples = {}, {}
    for stage in ("0", "1", "2", "3"):
        r = run(mpirun(2, [train, *train_args(shards, tmp_path / f"z{stage}", 8, "-G", "0", "-Z", stage, "-n", "8",
                                              "-s", "4", "-L", "16", "-z", str(tokenizer), *mode)]))
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"ZeRO stage {stage}" in r.stdout
        results[stage] = [(s, l) for s, l, _ in raw_steps(r.stdout)]
        # a sample may span lines: it ends where the trainer's next line starts
        samples[stage] = re.findall(r"^sample: .*?(?=^step |^saved checkpoint|^summary)", r.stdout, re.M | re.S)
        print(f"Z{stage}: " + re.search(r"peak mem \S+ GiB", r.stdout).group(0))
    assert len(results["0"]) == 8 and len(samples["0"]) == 2
    assert results["0"] == results["1"] == results["2"] == results["3"], results
    assert samples["0"] == samples["1"] == samples["2"] == samples["3"], samples
    models = {stage: (tmp_path / f"z{stage}" / "model_00000008.bin").read_bytes() for stage in results}
    assert models["0"] == models["1"] == models["2"] == models["3"]
    again = run(mpirun(2, [train, *train_args(shards, tmp_path / "again", 8, "-G", "0", "-Z", "1", *mode)]))
    assert [(s, l) for s, l, _ in raw_steps(again.stdout)] == results["1"]


def test_zero3_tied_embedding_matches_zero1(build, shards, tmp_path):
    """d12 (above) has its own lm_head; llama3.2-1B ties it to the embedding, which ZeRO-3 gathers once for both
    uses and whose gradient both uses add to. Two layers of it, ZeRO-1 and ZeRO-3: the same losses and model file."""
    results, models = {}, {}
    for stage in ("1", "3"):
        args = train_args(shards, tmp_path / f"z{stage}", 4, "-G", "0", "-Z", stage, "-n", "4")
        args[args.index("d12")] = "llama3.2-1B"
        r = run(mpirun(2, [build["BF16"], *args, "-d", "2"]))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "tied=1" in r.stdout and f"ZeRO stage {stage}" in r.stdout
        results[stage] = [(s, l) for s, l, _ in raw_steps(r.stdout)]
        models[stage] = (tmp_path / f"z{stage}" / "model_00000004.bin").read_bytes()
    assert len(results["1"]) == 4 and results["1"] == results["3"], results
    assert models["1"] == models["3"]


def gpus_reach_each_other():
    """nvidia-smi's peer-to-peer read matrix says GPU 0 and GPU 1 can read each other's memory."""
    r = subprocess.run(["nvidia-smi", "topo", "-p2p", "r"], capture_output=True, text=True)
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("GPU")]
    return r.returncode == 0 and len(rows) >= 3 and rows[1][2] == "OK" and rows[2][1] == "OK"


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_copy_engines_give_the_kernels_bits(build, shards, tmp_path, stage):
    """-E 1 (the default) moves the layers' reductions (stages 1, 2) onto peer copies and the weight gathers into
    NCCL windows, both on the copy engines; -E 0 keeps NCCL's SM kernels for all. With 2 ranks every summed element
    is a + b rounded once either way, and a gather only copies: the same losses and norms, with 2 micro-batches a
    step (the accumulation into the gradient shard). Where GPU 0 and 1 reach each other the run says it uses them."""
    results = {}
    for engines in ("1", "0"):
        r = run(mpirun(2, [build["BF16"], *train_args(shards, tmp_path / f"e{engines}", 6, "-Z", stage, "-E", engines,
                                                     "-g", "4096")]))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "grad_accum 2" in r.stdout, r.stdout
        results[engines] = raw_steps(r.stdout)
        line = re.search(r"^copy engines \(-E\): .*$", r.stdout, re.M).group(0)
        print(f"-E {engines}: {line}")
        if engines == "0":
            assert line.endswith("reductions NCCL kernels, weight gathers NCCL kernels"), line
        elif gpus_reach_each_other():
            assert ("peer copies" in line) == (stage != "3"), line
    assert len(results["1"]) == 6 and results["1"] == results["0"], results


@pytest.mark.parametrize("options", [(), ("-Q", "0", "-R", "0")])
def test_zero3_eval_and_export_match_zero1(build, shards, tmp_path, options):
    """What the other ZeRO-3 cases leave out: the val forwards (every rank gathers the weights for them), the
    Hugging Face export at the end (gathered for rank 0), and -Q 0 / -R 0. The same val losses and the same files
    as ZeRO-1."""
    val, out = {}, {}
    for stage in ("1", "3"):
        export = tmp_path / f"hf{stage}"
        args = train_args(shards, tmp_path / f"z{stage}", 4, "-G", "0", "-Z", stage, *options, "-X", str(export))
        args[args.index("-j") + 1] = str(shards / "tok_train.bin")
        r = run(mpirun(2, [build["BF16"], *args, "-v", "2", "-m", "2"]))
        assert r.returncode == 0, r.stdout + r.stderr
        val[stage] = re.findall(r"^step (\d+) \| val loss (\S+)", r.stdout, re.M)
        out[stage] = {p.name: p.read_bytes() for p in sorted(export.iterdir())}
    assert [s for s, _ in val["1"]] == ["0", "2", "4"] and val["1"] == val["3"], val
    assert "config.json" in out["1"] and out["1"] == out["3"]


@pytest.mark.parametrize("gpus,options", [(2, ("-Z", "1")), (2, ("-Z", "2")), (2, ("-Z", "2", "-g", "4096")),
                                          (2, ("-Z", "1", "-W", "0", "-O", "bf16")),
                                          (2, ("-Z", "0", "-M", "fp8", "-K", "0")),
                                          (2, ("-Z", "1", "-M", "fp8", "-K", "0")),
                                          (2, ("-Z", "2", "-M", "fp8", "-K", "0")),
                                          (2, ("-Z", "3")), (2, ("-Z", "3", "-W", "0", "-O", "bf16")),
                                          (2, ("-Z", "3", "-R", "2")), (2, ("-Z", "3", "-g", "4096")),
                                          (2, ("-Z", "3", "-M", "fp8", "-K", "0")),
                                          *[pytest.param(n, ("-Z", z), marks=needs_gpus(n))
                                            for n in (4, 8) for z in ("1", "2", "3")]],
                         ids=lambda v: f"{v}gpus" if isinstance(v, int) else "".join(v).lstrip("-"))
def test_resume_is_bit_identical(build, shards, tmp_path, gpus, options):
    train = build["BF16"]
    cmd = lambda name, *extra: mpirun(gpus, [train, *train_args(shards, tmp_path / name, 10, "-k", "constant", "-n",
                                                                "5", *options, *extra)])
    full = run(cmd("full"))
    assert full.returncode == 0, full.stdout + full.stderr
    part = run(cmd("part", "-x", "5"))
    assert part.returncode == 0, part.stdout + part.stderr
    names = sorted(os.listdir(tmp_path / "part"))
    expected = ["log.txt", "model_00000005.bin", "run.txt", "state_00000005.bin"]
    assert names == sorted(expected + [f"state_00000005_rank{r}.bin" for r in range(1, gpus)]), names
    resumed = run(cmd("part", "-y", "1"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    full_steps, resumed_steps = raw_steps(full.stdout), raw_steps(resumed.stdout)
    assert len(full_steps) == 10
    assert resumed_steps == full_steps[5:], (resumed.stdout, full.stdout)


# ---------------------------------------------------------------------------------------------------------------
# Resharding: a checkpoint resumed on another number of GPUs or with another ZeRO stage


def resume_elsewhere(train, shards, tmp_path, writer, reader, *common):
    """The uninterrupted 10-step run in the writer's layout, and the run that resumes its checkpoint at step 5 in the
    reader's layout; writer and reader: (GPUs, flags). The lr is constant after the warmup, so that the 5-step run's
    schedule is the 10-step run's."""
    args = lambda name, *extra: [train, *train_args(shards, tmp_path / name, 10, "-k", "constant", "-n", "5", *common,
                                                    *extra)]
    full = on_gpus(writer[0], args("full", *writer[1]))
    part = on_gpus(writer[0], args("part", *writer[1], "-x", "5"))
    resumed = on_gpus(reader[0], args("part", *reader[1], "-y", "1"))
    for result in (full, part, resumed):
        assert result.returncode == 0, result.stdout + result.stderr
    assert len(raw_steps(full.stdout)) == 10 and len(raw_steps(resumed.stdout)) == 5, resumed.stdout
    assert f"resharding: the checkpoint was written on {writer[0]} GPU(s)" in resumed.stdout, resumed.stdout
    return full, resumed


@pytest.mark.parametrize("writer,reader,options", [("1", "2", ()), ("2", "0", ()), ("0", "1", ()),
                                                   ("1", "2", ("-W", "0", "-O", "bf16")), ("3", "1", ()),
                                                   ("0", "3", ()), ("2", "3", ("-W", "0", "-O", "bf16"))])
def test_reshard_to_another_stage_is_bit_identical(build, shards, tmp_path, writer, reader, options):
    """Without clipping the stages give the same bits (test_zero_stages_agree_bit_for_bit), and resharding copies
    the fp32 state exactly: a run resumed on the same GPUs with another -Z continues its uninterrupted run bit for
    bit. Losses only: the norm's last bits depend on the stage (it is summed over shards)."""
    full, resumed = resume_elsewhere(build["BF16"], shards, tmp_path, (2, ("-Z", writer)), (2, ("-Z", reader)),
                                     "-G", "0", *options)
    assert f"with ZeRO stage {writer}, this run has 2 GPU(s) with stage {reader}" in resumed.stdout, resumed.stdout
    losses = lambda out: [(s, l) for s, l, _ in raw_steps(out)]
    assert losses(resumed.stdout) == losses(full.stdout)[5:], (resumed.stdout, full.stdout)


def compare_continuation(full, resumed, loss_bound, norm_bound):
    """Failures where the resumed run's steps leave the uninterrupted run's by more than the bounds (loss absolute,
    loss_bound(k) at the k-th resumed step; norm relative); prints both runs' steps."""
    failures = []
    print("step | loss uninterrupted, resumed | norm uninterrupted, resumed")
    for k, ((s0, l0, n0), (s, l, n)) in enumerate(zip(steps_of(full.stdout)[5:], steps_of(resumed.stdout))):
        print(f"{s:4d} | {l0:.6f} {l:.6f} | {n0:.6f} {n:.6f}")
        if s != s0 or abs(l - l0) > loss_bound(k) or abs(n - n0) > norm_bound * abs(n0):
            failures.append(f"step {s}: loss {l} vs {l0} (bound {loss_bound(k)}), norm {n} vs {n0}")
    return failures


@pytest.mark.parametrize("writer,reader,samples_change", [
    pytest.param((2, ("-Z", "1")), (1, ()), True, id="2 GPUs Z1 -> 1 GPU"),
    pytest.param((1, ()), (2, ("-Z", "2")), True, id="1 GPU -> 2 GPUs Z2"),
    pytest.param((2, ("-Z", "3")), (1, ()), True, id="2 GPUs Z3 -> 1 GPU"),
    pytest.param((1, ()), (2, ("-Z", "3")), True, id="1 GPU -> 2 GPUs Z3"),
    pytest.param((4, ("-Z", "1", "-b", "2")), (2, ("-Z", "2", "-b", "4")), False, id="4 GPUs Z1 -> 2 GPUs Z2",
                 marks=needs_gpus(4)),
    pytest.param((8, ("-Z", "1", "-b", "1")), (2, ("-Z", "2", "-b", "4")), False, id="8 GPUs Z1 -> 2 GPUs Z2",
                 marks=needs_gpus(8)),
])
def test_reshard_to_another_gpu_count_continues_the_loss(build, shards, tmp_path, writer, reader, samples_change):
    """FP32, 2048 tokens a step, the data in order: the resumed run trains on the same batches as the uninterrupted
    one (split otherwise over GPUs and micro-batches; where GPUs x B changes, the loader says so and carries its
    position over in tokens: llmc/dataloader.h restore) from the same state, copied exactly. So the two differ only
    by the order of their sums, as N GPUs differ from 1 GPU with accumulation: losses and norms to 1e-5, the bound
    test_gpus_match_one_gpu_with_accumulation holds over 20 steps."""
    full, resumed = resume_elsewhere(build["FP32"], shards, tmp_path, writer, reader, "-g", "2048")
    assert ("data: the checkpoint's run read samples of" in resumed.stdout) == samples_change, resumed.stdout
    failures = compare_continuation(full, resumed, lambda k: 1e-5, 1e-5)
    assert not failures, failures


def test_reshard_with_master_weights_continues_the_loss(build, shards, tmp_path):
    """BF16 with fp32 master weights, the data shuffled: 2 GPUs with B=4 -> 1 GPU with B=8 read the same samples
    (2 x 4 rows = 1 x 8), so the same batches follow in the same shuffled order. BF16 rounding then moves the two
    runs apart as it moves 2 GPUs from 1 GPU with accumulation: within the tie-out's bf16 bounds, losses 2e-2 at the
    first resumed step and 5e-2 after, norms 5e-2 relative (test_gpus_match_one_gpu_with_accumulation)."""
    full, resumed = resume_elsewhere(build["BF16"], shards, tmp_path, (2, ("-Z", "1")), (1, ("-b", "8")), "-f", "1")
    assert "data:" not in resumed.stdout, resumed.stdout
    failures = compare_continuation(full, resumed, lambda k: 2e-2 if k == 0 else 5e-2, 5e-2)
    assert not failures, failures


@pytest.fixture(scope="module")
def reshard_tool(tmp_path_factory):
    """dev/test/test_reshard, built here: it reads a checkpoint in any layout through llmc/reshard.h."""
    out = str(tmp_path_factory.mktemp("tool") / "test_reshard")
    result = subprocess.run(["g++", "-O2", "-std=c++17", "-I", ROOT, os.path.join(ROOT, "dev/test/test_reshard.cpp"),
                             "-o", out], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out


def state_payload(path):
    """The optimizer arrays of a state file (master weights if present, m, v), as raw 32-bit words."""
    header = np.fromfile(path, dtype="<u4", count=64)
    opt_count = int(header[14]) | int(header[15]) << 32
    return np.fromfile(path, dtype="<u4", offset=256, count=(3 if header[6] else 2) * opt_count)


def test_resharded_state_is_the_other_layouts_state(build, shards, tmp_path, reshard_tool):
    """Without clipping, 5 steps on 2 GPUs with -Z 0, 1 and 3 leave the same optimizer state bit for bit. Read in the
    other's layout through the trainer's resharding code, each checkpoint gives the other's state files exactly:
    ZeRO-1's shards as ZeRO-0's whole state (and a 1-GPU run's), ZeRO-0's whole state as ZeRO-1's shards and as
    ZeRO-3's; ZeRO-3's shards are ZeRO-1's as written."""
    for stage in ("0", "1", "3"):
        r = run(mpirun(2, [build["BF16"], *train_args(shards, tmp_path / f"z{stage}", 5, "-G", "0", "-Z", stage,
                                                      "-n", "5")]))
        assert r.returncode == 0, r.stdout + r.stderr
    z0, z1, z3 = tmp_path / "z0", tmp_path / "z1", tmp_path / "z3"
    for name in ("state_00000005.bin", "state_00000005_rank1.bin"):
        assert np.array_equal(state_payload(z3 / name), state_payload(z1 / name)), name
    cases = [(z1, 1, 0, 0, z0 / "state_00000005.bin"), (z1, 2, 0, 1, z0 / "state_00000005_rank1.bin"),
             (z0, 2, 1, 0, z1 / "state_00000005.bin"), (z0, 2, 1, 1, z1 / "state_00000005_rank1.bin"),
             (z0, 2, 3, 1, z3 / "state_00000005_rank1.bin"), (z3, 2, 0, 0, z0 / "state_00000005.bin")]
    for source, gpus, stage, rank, expected in cases:
        out = tmp_path / "read.bin"
        result = subprocess.run([reshard_tool, "read", source, "5", str(gpus), str(stage), str(rank), out],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        print(result.stdout.strip())
        got, want = np.fromfile(out, dtype="<u4"), state_payload(expected)
        differences = np.count_nonzero(got != want) if got.size == want.size else "a size"
        assert got.size == want.size and differences == 0, \
            f"{source.name} read as {gpus} GPU(s) Z{stage} rank {rank}: {differences} differences"


def test_reshard_refusals_name_the_problem(build, shards, tmp_path):
    """What cannot be resumed stops before the GPU, naming the file: another tokens per step (-g), a rank file gone."""
    train = build["BF16"]
    first = run(mpirun(2, [train, *train_args(shards, tmp_path / "ck", 3, "-n", "3", "-u", "1")]))
    assert first.returncode == 0, first.stdout + first.stderr
    other_g = run([train, *train_args(shards, tmp_path / "ck", 6, "-n", "3", "-u", "1", "-y", "1")])
    assert other_g.returncode == 1, other_g.stdout + other_g.stderr
    assert "state_00000003.bin" in other_g.stderr and "give -g 2048" in other_g.stderr, other_g.stderr
    os.remove(tmp_path / "ck" / "state_00000003_rank1.bin")
    missing = run([train, *train_args(shards, tmp_path / "ck", 6, "-n", "3", "-u", "1", "-g", "2048", "-y", "1")])
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert "state_00000003_rank1.bin" in missing.stderr and "is missing" in missing.stderr, missing.stderr


# ---------------------------------------------------------------------------------------------------------------
# The inter-node path: NCCL's socket transport


def test_socket_transport_gives_the_same_losses(build, shards, tmp_path):
    """2 ranks through NCCL's socket transport alone (SOCKET), as between hosts, against its default transport
    (NVLink or PCIe peer-to-peer here): bit-identical losses and norms. With 2 ranks each reduced element is one
    addition of two values whatever the algorithm, protocol or channel split, and a + b = b + a exactly, so the
    transport cannot change a bit (with more ranks it could change the ring order, and the sums to rounding). The
    NCCL log shows the socket transport in use. Prints both runs' tok/s."""
    results = {}
    for name, transport in (("default", {}), ("socket", SOCKET)):
        nccl_log = str(tmp_path / f"nccl_{name}.%p.log")
        env = dict(ENV, NCCL_DEBUG="INFO", NCCL_DEBUG_FILE=nccl_log, **transport)
        cmd = mpirun(2, [build["BF16"], *train_args(shards, tmp_path / name, 20)],
                     exported=("NCCL_DEBUG", "NCCL_DEBUG_FILE", *transport))
        r = run(cmd, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        log = "".join(open(path).read() for path in glob.glob(nccl_log.replace("%p", "*")))
        tok_s = float(re.search(r"summary: .*?\| (\d+) tok/s", r.stdout).group(1))
        results[name] = (raw_steps(r.stdout), tok_s, log, r.stdout)
        print(f"{name}: {tok_s:.0f} tok/s; " + "; ".join(sorted(set(re.findall(r"via (\S+)", log)))))
    assert "via NET/Socket" in results["socket"][2], results["socket"][2][-3000:]
    assert "layers' reductions NCCL kernels" in results["socket"][3], results["socket"][3]
    assert "via NET/" not in results["default"][2]
    assert len(results["default"][0]) == 20
    assert results["socket"][0] == results["default"][0], (results["socket"][0], results["default"][0])
    print(f"socket / default tok/s: {results['socket'][1] / results['default'][1]:.3f}")


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
