"""
Reliability on bad input, CPU only (issue 11): every case must end with a non-zero exit that is not a signal and a
message naming the problem (the flag, the file, the tensor).

  - the host-side helpers through dev/test/test_reliability (built by `make`): checked and atomic writes on a full
    disk (/dev/full) or into a directory, the stdout check, checkpoints with NaN/Inf, the flag arithmetic, the
    non-finite step guard, run-directory ownership and retention;
  - the CPU reference (dev/cpu/test_llama3_cpu) loading checkpoints that hold NaN or Inf;
  - the trainer's own checks, which all run on the host before the GPU is touched: ./train_llama3cu (built by
    `make train_llama3cu`, as .ci/run does) runs them on a machine without a GPU too, where a command that passes
    them stops at "no CUDA GPU available". Skipped when the binary is missing or older than its sources. The same
    for the tie-out's -M fp8 checks (./test_llama3cu, make test_llama3cu).

The GPU side (crashes, NaN runs, resume, write errors during training) is dev/test/test_reliability_gpu.py.
"""

import glob
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "dev" / "data"))
import export_tokenizer  # noqa: E402
import shards  # noqa: E402

HELPER = ROOT / "dev" / "test" / "test_reliability"
CPU_REF = ROOT / "dev" / "cpu" / "test_llama3_cpu"
TRAINER = ROOT / "train_llama3cu"
GQA = ROOT / "dev" / "fixtures" / "gqa_model.bin"  # V=259 C=48 L=2 H=6 KV=2 F=88 max_seq_len=64, untied
GQA_DEBUG = ROOT / "dev" / "fixtures" / "gqa_debug.bin"
NO_GPU = "no CUDA GPU available"


def run(args, **kw):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, **kw)


def helper(*args):
    if not HELPER.exists():
        pytest.fail(f"{HELPER} is missing: run `make` first")
    return run([HELPER, *args])


def assert_refused(result, *words):
    """A clean failure: exit status 1..127 (not a signal), one 'Error:' message holding every word."""
    assert result.returncode > 0, f"exit {result.returncode} (negative: killed by a signal)\n{result.stderr}"
    for word in words:
        assert str(word) in result.stderr, f"'{word}' missing from: {result.stderr}"
    assert result.stderr.count("Error:") == 1, result.stderr


# ---------------------------------------------------------------------------------------------------------------
# Writes: a full disk, a directory where a file belongs; the previous file stays, no temporary file is left


@pytest.mark.parametrize("nbytes", [100, 1 << 20])  # fails in the final flush / in fwrite itself
def test_atomic_write_disk_full_keeps_previous_file(tmp_path, nbytes):
    target = tmp_path / "model_00000010.bin"
    target.write_bytes(b"previous good file")
    tmp = tmp_path / "model_00000010.bin.tmp"
    os.symlink("/dev/full", tmp)  # every write to the temporary file fails with ENOSPC
    result = helper("atomic", target, nbytes)
    assert_refused(result, str(tmp), "No space left on device")
    assert target.read_bytes() == b"previous good file"
    assert not os.path.lexists(tmp)


def test_atomic_write_succeeds(tmp_path):
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    result = helper("atomic", target, 5000)
    assert result.returncode == 0, result.stderr
    assert target.read_bytes() == b"x" * 5000 and os.listdir(tmp_path) == ["x.bin"]


@pytest.mark.parametrize("point", ["write", "rename"])
def test_fault_hook_kills_mid_write(tmp_path, point):
    """LLAMA3_FAULT (llmc/fault.h), which the GPU crash tests use: SIGKILL with the temporary file on disk (partial
    for write, complete for rename) and the previous file untouched."""
    target = tmp_path / "state_00000006.bin"
    target.write_bytes(b"previous")
    result = subprocess.run([str(HELPER), "atomic", str(target), "5000"], capture_output=True, text=True,
                            env=dict(os.environ, LLAMA3_FAULT=f"other,{point} state_00000006.bin"))
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert f"SIGKILL at '{point} state_00000006.bin'" in result.stderr
    assert target.read_bytes() == b"previous"
    assert (tmp_path / "state_00000006.bin.tmp").stat().st_size == 5000
    # a label for another file does nothing
    result = subprocess.run([str(HELPER), "atomic", str(target), "5000"], capture_output=True, text=True,
                            env=dict(os.environ, LLAMA3_FAULT=f"{point} state_00000009.bin"))
    assert result.returncode == 0 and target.read_bytes() == b"x" * 5000


def test_atomic_write_to_a_directory(tmp_path):
    (tmp_path / "state_00000005.bin").mkdir()
    assert_refused(helper("atomic", tmp_path / "state_00000005.bin", 10), "state_00000005.bin", "is a directory")


def test_atomic_write_into_missing_directory(tmp_path):
    assert_refused(helper("atomic", tmp_path / "nowhere" / "f.bin", 10), "nowhere/f.bin.tmp", "No such file")


def test_log_disk_full(tmp_path):
    log = tmp_path / "log.txt"
    os.symlink("/dev/full", log)
    assert_refused(helper("log", log, 3), str(log), "No space left on device")


def test_log_path_is_a_directory(tmp_path):
    (tmp_path / "log.txt").mkdir()
    assert_refused(helper("log", tmp_path / "log.txt", 3), "log.txt", "is a directory")


def test_log_writes_every_line(tmp_path):
    result = helper("log", tmp_path / "log.txt", 4)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "log.txt").read_text().splitlines() == [f"line {i} of a test log" for i in range(4)]


def run_to_full_disk(args):
    """args with stdout on a full disk: every write to it fails with ENOSPC."""
    with open("/dev/full", "w") as full:
        return subprocess.run([str(a) for a in args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)


def test_stdout_disk_full():
    """A line-buffered printf that fails drops its line and leaves only the stream's error flag, and fflush then
    returns 0: the check must still stop the program rather than let it exit 0 with its lines lost."""
    if not HELPER.exists():
        pytest.fail(f"{HELPER} is missing: run `make` first")
    assert_refused(run_to_full_disk([HELPER, "stdout", 3]), "stdout", "lines are missing")


def test_stdout_writes_every_line():
    result = helper("stdout", 3)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"step {i} of a test run" for i in range(3)]


# ---------------------------------------------------------------------------------------------------------------
# Non-finite weights: never written, never loaded

GQA_TENSORS = ["tok_embedding", "attn_norm", "wqkv", "wo", "ffn_norm", "w13", "w2", "final_norm", "lm_head"]


def gqa_layout():
    """(name, offset, size) of each tensor of the gqa fixture, in elements after the header."""
    V, C, L, H, KV, F = 259, 48, 2, 6, 2, 88
    hd = C // H
    sizes = [V * C, L * C, L * (H + 2 * KV) * hd * C, L * C * H * hd, L * C, L * 2 * F * C, L * C * F, C, V * C]
    offsets = np.cumsum([0] + sizes[:-1])
    assert 256 + 4 * sum(sizes) == GQA.stat().st_size
    return {n: (int(o), s) for n, o, s in zip(GQA_TENSORS, offsets, sizes)}


def poisoned_checkpoint(path, tensor, value, element=0):
    data = bytearray(GQA.read_bytes())
    offset, size = gqa_layout()[tensor]
    at = 256 + 4 * (offset + min(element, size - 1))
    data[at:at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("tensor,value", [("wqkv", float("nan")), ("lm_head", float("inf"))])
def test_checkpoint_with_non_finite_is_not_written(tmp_path, tensor, value):
    out = tmp_path / "out.bin"
    out.write_bytes(b"previous")
    kind = "nan" if value != value else "inf"
    assert_refused(helper("resave", GQA, out, kind, tensor), str(out), tensor, "non-finite")
    assert out.read_bytes() == b"previous" and os.listdir(tmp_path) == ["out.bin"]
    # the same without the poison goes through, and is the same file
    result = helper("resave", GQA, out)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == GQA.read_bytes()


@pytest.mark.parametrize("tensor,value,element", [("tok_embedding", float("nan"), 0), ("wo", float("inf"), 77),
                                                  ("final_norm", float("-inf"), 47), ("lm_head", float("nan"), 10**9)])
def test_checkpoint_with_non_finite_is_not_loaded(tmp_path, tensor, value, element):
    bad = poisoned_checkpoint(tmp_path / "poisoned.bin", tensor, value, element)
    if not CPU_REF.exists():
        pytest.fail(f"{CPU_REF} is missing: run `make` first")
    result = run([CPU_REF, bad, GQA_DEBUG])
    expected_element = min(element, gqa_layout()[tensor][1] - 1)
    assert_refused(result, str(bad), f"tensor {tensor} ", "non-finite", f"element {expected_element}")


# ---------------------------------------------------------------------------------------------------------------
# Flag arithmetic (llmc/flag_checks.h), 64-bit

BATCH_OK = [
    # B, T, -g, ranks, heads -> grad_accum, tokens per step
    ((4, 32, 0, 1, 6), (1, 128)),
    ((4, 32, 512, 1, 6), (4, 512)),
    ((4, 32, 512, 2, 6), (2, 512)),
    ((1, 1, 2**31 - 1, 1, 1), (2**31 - 1, 2**31 - 1)),
    ((1024, 2048, 2**40, 8, 32), (2**40 // (1024 * 2048 * 8), 2**40)),
]
BATCH_BAD = [
    ((4, 32, 100, 1, 6), ["-g 100", "multiple", "128"]),
    ((4, 32, 64, 1, 6), ["-g 64", "multiple"]),  # smaller than one micro-batch: 0 accumulation steps
    ((4, 32, 256, 3, 6), ["-g 256", "x 3 = 384"]),  # not a multiple across 3 processes
    ((1, 1, 2**40, 1, 1), ["gradient-accumulation", "2^31"]),  # 2^40 steps would wrap a 32-bit int to 0
    ((1048576, 2048, 0, 1, 1), ["-b 1048576", "-t 2048", "2^31"]),
    ((65536, 2048, 0, 1, 32), ["attention rows", "2^31"]),
]


@pytest.mark.parametrize("args,expected", BATCH_OK)
def test_batch_plan(args, expected):
    result = helper("batch", *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["grad_accum", str(expected[0]), "tokens_per_step", str(expected[1])]


@pytest.mark.parametrize("args,words", BATCH_BAD)
def test_batch_plan_rejects(args, words):
    assert_refused(helper("batch", *args), *words)


STEPS_OK = [
    # -x, micro-batches per epoch, grad_accum, start step, warmup -> max steps
    ((-1, 312, 1, 0, 0), 312),
    ((-1, 312, 4, 0, 10), 78),
    ((100, 312, 4, 50, 100), 100),
    ((2**30, 1, 1, 0, 0), 2**30),
]
STEPS_BAD = [
    ((0, 312, 1, 0, 0), ["-x 0"]),
    ((-1, 3, 4, 0, 0), ["-x -1", "3 micro-batches", "4 of one step"]),
    ((5, 312, 1, 5, 0), ["resumed at step 5", "-x 5"]),
    ((5, 312, 1, 9, 0), ["resumed at step 9"]),
    ((10, 312, 1, 0, 11), ["-u 11", "10 steps"]),
    ((-1, 2**40, 1, 0, 0), ["-x", "2^30"]),
]


@pytest.mark.parametrize("args,expected", STEPS_OK)
def test_step_plan(args, expected):
    result = helper("steps", *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["max_steps", str(expected)]


@pytest.mark.parametrize("args,words", STEPS_BAD)
def test_step_plan_rejects(args, words):
    assert_refused(helper("steps", *args), *words)


# ---------------------------------------------------------------------------------------------------------------
# Non-finite steps (llmc/nonfinite.h)


@pytest.mark.parametrize("norm", ["nan", "inf", "-inf"])
def test_clip_never_turns_a_non_finite_norm_into_one(norm):
    assert helper("clip", norm, "1").stdout.strip() == "nan"
    assert helper("clip", norm, "0").stdout.strip() == "nan"


@pytest.mark.parametrize("norm,clip", [(4.0, 1.0), (0.5, 1.0), (0.0, 1.0), (3.0, 0.0), (1e30, 0.5)])
def test_clip_scale_finite(norm, clip):
    expected = 1.0 if clip == 0 else min(np.float32(1.0), np.float32(clip) / (np.float32(norm) + np.float32(1e-6)))
    assert np.float32(helper("clip", norm, clip).stdout.strip()) == np.float32(expected)


def test_guard_skips_and_stops():
    result = helper("guard", 3, "2:1", "nan:1", "2:inf", "2:1", "inf:1", "nan:nan", "-inf:1", "2:1")
    assert result.stdout.split() == ["apply", "skip", "skip", "apply", "skip", "skip", "stop"]
    assert result.returncode == 1
    result = helper("guard", 1, "2:1", "2:1", "nan:1")
    assert result.stdout.split() == ["apply", "apply", "stop"]


# ---------------------------------------------------------------------------------------------------------------
# Run directories (llmc/run_dir.h, llmc/state_file.h)

STATE_MAGIC, STATE_VERSION = 20261123, 2


def state_header(step, run_id, is_bf16=1, num_params=None, has_master=1, world=1, stage=0, rank=0,
                 tokens_per_step=128, model=GQA, magic=STATE_MAGIC, version=STATE_VERSION):
    num_params = (model.stat().st_size - 256) // 4 if num_params is None else num_params
    opt_count = num_params // world if stage else num_params  # the whole model, or with stages 1 to 3 a shard
    h = np.zeros(64, dtype="<u4")
    h[0], h[1], h[2], h[3] = magic, version, step, is_bf16
    h[4], h[5] = num_params & 0xFFFFFFFF, num_params >> 32
    h[6], h[7] = has_master, world
    h[8], h[9] = run_id & 0xFFFFFFFF, run_id >> 32
    h[10], h[11] = tokens_per_step & 0xFFFFFFFF, tokens_per_step >> 32
    h[12], h[13] = stage, rank
    h[14], h[15] = opt_count & 0xFFFFFFFF, opt_count >> 32
    h[16:31] = np.fromfile(model, dtype="<u4", count=18)[3:18]
    return h.tobytes()


def state_bytes(opt_count, has_master):
    return 256 + (3 if has_master else 2) * opt_count * 4 + 128 + 8


def shard_elements(model, world, rank):
    """The flat indices of rank `rank`'s shard over `world` ranks (llmc/shard_layout.h): its part of each layer's
    slice of each per-layer tensor and of each other tensor, in flat order."""
    V, C, L, H, KV, F = np.fromfile(model, dtype="<i4", count=9)[3:9]
    tied = np.fromfile(model, dtype="<i4", count=11)[10]
    hd = C // H
    sizes = [(V * C, 1), (C, L), ((H + 2 * KV) * hd * C, L), (C * H * hd, L), (C, L), (2 * F * C, L), (C * F, L),
             (C, 1)] + ([] if tied else [(V * C, 1)])  # (slice size, slices) per tensor
    parts, offset = [], 0
    for size, count in sizes:
        for _ in range(count):
            part = size // world
            parts.append(np.arange(offset + rank * part, offset + (rank + 1) * part))
            offset += size
    return np.concatenate(parts)


def write_run(directory, run_id, source="-c d2 -d 0"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "run.txt").write_text(f"run_id {run_id:016x}\nsource {source}\n")


def loader_state(B=4, T=32, processes=1, shuffle=1, shards=1, tokens=40000, seed=1337, sample=5):
    """llmc/dataloader.h's DataLoaderState (16 int64) for the `data` fixture's train shard."""
    return np.array([20261124, 1, B, T, processes, shuffle, 0, shards, tokens, seed, 0, 0, sample, 0, 0, 0],
                    "<i8").tobytes()


def write_state(directory, step, run_id, is_bf16=1, has_master=1, model=GQA, tokens_per_step=128, world=1, stage=0,
                **kw):
    """The state files of a checkpoint that passes every check and can be resumed, one per rank of `world` GPUs at
    ZeRO `stage`: master weights = the model's (its shards with stages 1 to 3), zero AdamW moments, the train loader
    at sample 5 (of 4 x 32 tokens, split over the GPUs). Returns rank 0's."""
    params = np.fromfile(model, dtype="<f4", offset=256)
    for rank in range(world):
        elements = shard_elements(model, world, rank) if stage else np.arange(len(params))
        header = state_header(step, run_id, is_bf16=is_bf16, has_master=has_master, model=model, world=world,
                              stage=stage, rank=rank, tokens_per_step=tokens_per_step, **kw)
        master = params[elements].tobytes() if has_master else b""
        path = directory / (f"state_{step:08d}.bin" if rank == 0 else f"state_{step:08d}_rank{rank}.bin")
        path.write_bytes(header + master + b"\0" * (8 * len(elements)) + loader_state(B=4 // world, processes=world)
                         + struct.pack("<Q", 12345))
        assert path.stat().st_size == state_bytes(len(elements), has_master)
    shutil.copy(model, directory / f"model_{step:08d}.bin")
    return directory / f"state_{step:08d}.bin"


def test_fresh_run_dir(tmp_path):
    assert helper("fresh", tmp_path, 0).stdout.strip() == "ok"
    (tmp_path / "log.txt").write_text("a log and notes are not checkpoints\n")
    (tmp_path / "model_final.bin").write_bytes(b"not a step file")
    assert helper("fresh", tmp_path, 0).stdout.strip() == "ok"
    (tmp_path / "state_00000030.bin").write_bytes(b"x")
    assert_refused(helper("fresh", tmp_path, 0), str(tmp_path), "state_00000030.bin", "-F 1", "-y 1")
    assert helper("fresh", tmp_path, 1).stdout.strip() == "ok"
    (tmp_path / "state_00000030.bin").unlink()
    (tmp_path / "model_00000007.bin").write_bytes(b"x")  # a model file alone is a checkpoint too
    assert_refused(helper("fresh", tmp_path, 0), "model_00000007.bin")


def test_retention_deletes_only_this_runs_files(tmp_path):
    ours, theirs = 0x1111222233334444, 0x5555666677778888
    write_run(tmp_path, ours)
    for step in (2, 4, 6):
        write_state(tmp_path, step, ours)
    for step in (3, 8):
        write_state(tmp_path, step, theirs)
    assert helper("run-steps", tmp_path).stdout.split() == ["run", f"{ours:016x}", "steps", "2", "4", "6"]
    result = helper("retain", tmp_path, 1)
    assert result.returncode == 0, result.stderr
    left = sorted(os.listdir(tmp_path))
    assert left == ["model_00000003.bin", "model_00000006.bin", "model_00000008.bin", "run.txt",
                    "state_00000003.bin", "state_00000006.bin", "state_00000008.bin"], left
    # and the other run's files are never counted as ours
    assert helper("run-steps", tmp_path).stdout.split()[-2:] == ["steps", "6"]


def test_retention_deletes_the_rank_files_of_each_checkpoint(tmp_path):
    """A run resumed on fewer GPUs: its older checkpoints' rank files go too, by their own world size."""
    write_run(tmp_path, 7)
    write_state(tmp_path, 2, 7, world=2, stage=1)
    write_state(tmp_path, 4, 7)
    result = helper("retain", tmp_path, 1)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["model_00000004.bin", "run.txt", "state_00000004.bin"]


def test_run_steps_refuse_a_damaged_state(tmp_path):
    write_run(tmp_path, 7)
    write_state(tmp_path, 2, 7)
    (tmp_path / "state_00000009.bin").write_bytes(b"\0" * 100)
    assert_refused(helper("run-steps", tmp_path), "state_00000009.bin", "shorter than its 256-byte header")
    (tmp_path / "state_00000009.bin").write_bytes(state_header(9, 7, magic=1234))
    assert_refused(helper("run-steps", tmp_path), "state_00000009.bin", "magic 1234")


@pytest.mark.parametrize("text,words", [(None, ["run.txt", "No such file"]), ("hello\n", ["not a run file"]),
                                        ("run_id 0000000000000000\nsource x\n", ["not a run file"])])
def test_run_file_damaged(tmp_path, text, words):
    if text is not None:
        (tmp_path / "run.txt").write_text(text)
    assert_refused(helper("run-steps", tmp_path), *words)


# ---------------------------------------------------------------------------------------------------------------
# The trainer's checks, before the GPU


def trainer():
    if not TRAINER.exists():
        pytest.skip(f"{TRAINER} not built (make train_llama3cu)")
    sources = [ROOT / "train_llama3.cu", *glob.glob(str(ROOT / "llmc" / "*.h")), *glob.glob(str(ROOT / "llmc" / "*.cuh"))]
    if TRAINER.stat().st_mtime < max(os.path.getmtime(s) for s in sources):
        pytest.skip(f"{TRAINER} is older than its sources (make train_llama3cu)")
    return TRAINER


@pytest.fixture(scope="module")
def precision():
    if not TRAINER.exists():
        return "bf16"
    help_text = run([TRAINER, "-h"]).stdout
    return "fp32" if "this build: fp32" in help_text else "bf16"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    shards.write_shard(out / "train.bin", rng.integers(0, 259, size=40000))
    shards.write_shard(out / "val.bin", rng.integers(0, 259, size=5000))
    return out


def write_tokenizer(path, vocab, bos, eos, eot):
    return export_tokenizer.write_tokenizer(path, export_tokenizer.byte_pieces(vocab), bos, eos, eot)


def base_cmd(data, out_dir, *extra, model=GQA):
    args = ["-i", data / "train.bin", "-j", data / "val.bin", "-b", 4, "-t", 32, "-x", 4, "-v", 2, "-m", 2,
            "-o", out_dir, *extra]
    if model is not None:
        args = ["-e", model, *args]
    return [trainer(), *args]


def passes_host_checks(result):
    """The run got past every host check: it trained (GPU machine) or stopped at the GPU (no GPU here)."""
    return result.returncode == 0 or NO_GPU in result.stderr


def assert_refused_on_host(result, *words):
    assert_refused(result, *words)
    assert NO_GPU not in result.stderr, "the check must run before the GPU is touched"


BAD_FLAGS = {
    # name: (extra flags, words the message must hold)
    "g not a multiple of B*T": (["-g", "100"], ["-g 100", "multiple"]),
    "g below B*T": (["-g", "64"], ["-g 64", "multiple"]),
    "g overflows grad accumulation": (["-b", "1", "-t", "1", "-g", str(2**40)], ["gradient-accumulation"]),
    "B*T past 2^31": (["-b", "1048576", "-t", "2048", "-c", "d2", "-e", ""], ["-b 1048576", "2^31"]),
    "x 0": (["-x", "0"], ["-x 0"]),
    "one epoch is less than a step": (["-x", "-1", "-g", str(128 * 400)], ["-x -1", "312 micro-batches"]),
    "warmup past the run": (["-u", "5"], ["-u 5", "4 steps"]),
    "T above max_seq_len": (["-t", "65"], ["-t", "max_seq_len 64"]),
    "d deeper than the model": (["-c", "d2", "-d", "3", "-e", ""], ["-d", "only 2 layers"]),
    "d without c": (["-d", "1"], ["-d", "-c only"]),
    "e disagrees with c": (["-c", "d2"], ["disagrees", "-c d2"]),
    "samples without tokenizer": (["-s", "2"], ["-s", "-z"]),
    "checkpoints without out dir": (["-n", "2", "-o", ""], ["-n", "-o"]),
    "val with zero batches": (["-m", "0"], ["-m", "-v 0"]),
    "resume without out dir": (["-y", "1", "-o", ""], ["-y", "-o"]),
    "N zero": (["-N", "0"], ["-N", "[1,"]),
    "F not 0 or 1": (["-F", "2"], ["-F"]),
    "unknown flag": (["-Y", "1"], ["-Y"]),
    "K negative": (["-K", "-1"], ["-K", "'-1'"]),
    "flag without value": (["-x"], ["-x", "needs a value"]),
    "not a number": (["-l", "fast"], ["-l", "not a number"]),
    "M not bf16 or fp8": (["-M", "fp4"], ["-M", "'fp4'", "not bf16 or fp8"]),
    "Z past 3": (["-Z", "4"], ["-Z", "'4'", "[0, 3]"]),
    "E not 0 or 1": (["-E", "2"], ["-E", "'2'", "[0, 1]"]),
    "Z 3 on one GPU": (["-Z", "3"], ["-Z", "'3'", "several GPUs", "drop -Z 3"]),
    "no model": (["-e", ""], ["-e", "-c"]),
    "model is a directory": (["-e", "/"], ["'/'", "is a directory", "config.json"]),
    "model missing": (["-e", "/nonexistent/model.bin"], ["/nonexistent/model.bin"]),
    "no shards": (["-i", "/nonexistent/*.bin"], ["/nonexistent/*.bin"]),
    "shard pattern is a directory": (["-i", "/"], ["'/'", "not a regular file"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_trainer_rejects_bad_flags(data, tmp_path, case):
    extra, words = BAD_FLAGS[case]
    # a later flag overrides an earlier one: "-e ''" drops the base command's model
    assert_refused_on_host(run(base_cmd(data, tmp_path / "run", *extra)), *words)


def test_trainer_base_command_passes_host_checks(data, tmp_path):
    """The bad-flag runs fail because of their flag alone."""
    result = run(base_cmd(data, tmp_path / "run"))
    assert passes_host_checks(result), result.stderr


@pytest.mark.parametrize("case", ["bos", "eos", "eot", "smaller", "good"])
def test_trainer_checks_tokenizer_ids(data, tmp_path, case):
    ids = {"bos": (300, 280, 257, 258), "eos": (300, 256, 259, 258), "eot": (300, 256, 257, 299),
           "smaller": (200, 197, 198, 199), "good": (300, 256, 257, 258)}[case]
    tok = write_tokenizer(tmp_path / "tok.bin", *ids)
    result = run(base_cmd(data, tmp_path / "run", "-z", tok, "-s", 2, "-L", 8))
    if case == "good":
        assert passes_host_checks(result), result.stderr
        return
    words = {"bos": ["<|begin_of_text|>", "id 280", "vocab of 259"], "eos": ["<|end_of_text|>", "id 259"],
             "eot": ["<|eot_id|>", "id 299"], "smaller": ["has 200 tokens", "259"]}[case]
    assert_refused_on_host(result, str(tok), *words)


def test_trainer_fp8_mode_checks(data, tmp_path, precision):
    """-M fp8: refused by the FP32 build; in the BF16 build every dimension of the FP8 products must be a multiple of
    16 (the gqa fixture's F = 88 is not; d2's widths are; -t 31 makes 124 tokens a micro-batch), checked where the
    products do run in FP8: from -K's width up (-K 0 here, the fixtures are narrow). The GPU's own check (compute
    capability 8.9) needs a GPU."""
    assert "-M <type>" in run([trainer(), "-h"]).stdout
    result = run(base_cmd(data, tmp_path / "run", "-M", "fp8", "-K", 0))
    if precision == "fp32":
        assert_refused_on_host(result, "-M", "'fp8'", "BF16 build")
        return
    assert_refused_on_host(result, "-M fp8", "ffn_hidden F is 88", "multiple of 16")
    narrow = run(base_cmd(data, tmp_path / "run", "-M", "fp8"))  # F = 88 does not matter: the products stay bf16
    assert passes_host_checks(narrow) and "its width 48 is below -K 1024" in narrow.stdout, \
        narrow.stdout + narrow.stderr
    d2 = ["-M", "fp8", "-K", 0, "-c", "d2", "-e", ""]
    assert passes_host_checks(run(base_cmd(data, tmp_path / "run", *d2))), result.stderr
    assert_refused_on_host(run(base_cmd(data, tmp_path / "run2", *d2, "-t", 31)), "-M fp8", "-b x -t is 124")
    assert passes_host_checks(run(base_cmd(data, tmp_path / "run3", "-M", "bf16")))


# The tie-out's own checks (./test_llama3cu, built by `make test_llama3cu`) run on the host too, before the GPU.
TIE_OUT = ROOT / "test_llama3cu"
FP8_MODEL = ROOT / "dev" / "fixtures" / "fp8_model.bin"  # test-fp8: test-gqa with F=96
FP8_DEBUG = ROOT / "dev" / "fixtures" / "fp8_debug.bin"  # B=2 T=16


def tie_out():
    if not TIE_OUT.exists():
        pytest.skip(f"{TIE_OUT} not built (make test_llama3cu)")
    sources = [ROOT / "test_llama3.cu", ROOT / "train_llama3.cu", *glob.glob(str(ROOT / "llmc" / "*.h")),
               *glob.glob(str(ROOT / "llmc" / "*.cuh"))]
    if TIE_OUT.stat().st_mtime < max(os.path.getmtime(s) for s in sources):
        pytest.skip(f"{TIE_OUT} is older than its sources (make test_llama3cu)")
    return TIE_OUT


def zero_debug_state(path, model, B, T):
    """A debug state for `model` (an untied fp32 checkpoint of ours) of B x T tokens of id 0, one step, every
    reference value and error zero: enough for the tie-out's host checks."""
    h = np.fromfile(model, dtype="<i4", count=64)
    vocab, n_params = int(h[3]), (model.stat().st_size - 256) // 4
    header = np.zeros(64, dtype="<i4")
    header[:8] = [20261122, 1, B, T, vocab, 1, 0, 1]  # magic, version, B, T, V, steps, masked, reference errors
    floats = B * T * vocab + 1 + n_params + 2 + (3 + 2 * len(GQA_TENSORS) + 2)
    path.write_bytes(header.tobytes() + np.zeros(2 * B * T, dtype="<i4").tobytes() +
                     np.zeros(floats, dtype="<f4").tobytes())
    return path


def test_tie_out_fp8_checks(tmp_path):
    """test_llama3cu -M fp8: refused by the FP32 build; in the BF16 build every product's token count must be a
    multiple of 16 (the gqa fixture has 26 tokens, its masked state accumulates rows of 13) and so must the model's
    widths (the gqa fixture's F = 88, on a state of 32 tokens); the fp8 fixture passes."""
    binary = tie_out()
    result = run([binary, "-M", "fp8", FP8_MODEL, FP8_DEBUG])
    if "this build: fp32" in run([binary]).stderr:
        assert_refused_on_host(result, "-M fp8", "BF16 build")
        return
    assert passes_host_checks(result), result.stdout + result.stderr
    assert_refused_on_host(run([binary, "-M", "fp4", FP8_MODEL, FP8_DEBUG]), "-M", "'fp4'", "not bf16 or fp8")
    assert_refused_on_host(run([binary, "-M", "fp8", GQA, GQA_DEBUG]), "-M fp8", f"'{GQA_DEBUG}'", "multiple of 16",
                           "has 26")
    masked = ROOT / "dev" / "fixtures" / "gqa_masked_debug.bin"
    assert_refused_on_host(run([binary, "-M", "fp8", GQA, masked]), f"'{masked}'", "a row at a time", "has 13")
    state = zero_debug_state(tmp_path / "gqa_32_tokens.bin", GQA, 2, 16)
    assert_refused_on_host(run([binary, "-M", "fp8", GQA, state]), f"'{GQA}'", "ffn_hidden F is 88")


def test_trainer_sample_length_must_fit(data, tmp_path):
    tok = write_tokenizer(tmp_path / "tok.bin", 259, 256, 257, 258)
    assert_refused_on_host(run(base_cmd(data, tmp_path / "run", "-z", tok, "-s", 2, "-L", 32)), "-L", "-t 32")
    assert passes_host_checks(run(base_cmd(data, tmp_path / "run", "-z", tok, "-s", 2, "-L", 31)))


def test_trainer_tokenizer_is_a_directory(data, tmp_path):
    assert_refused_on_host(run(base_cmd(data, tmp_path / "run", "-z", tmp_path, "-s", 2, "-L", 8)), "is a directory")


@pytest.mark.parametrize("tensor,value", [("w13", float("nan")), ("tok_embedding", float("inf"))])
def test_trainer_refuses_non_finite_checkpoint(data, tmp_path, tensor, value):
    bad = poisoned_checkpoint(tmp_path / "bad.bin", tensor, value, 5)
    assert_refused_on_host(run(base_cmd(data, tmp_path / "run", model=bad)), str(bad), f"tensor {tensor} ",
                           "non-finite")


def test_trainer_truncated_checkpoint(data, tmp_path):
    bad = tmp_path / "short.bin"
    bad.write_bytes(GQA.read_bytes()[:-4])
    assert_refused_on_host(run(base_cmd(data, tmp_path / "run", model=bad)), str(bad), "bytes")


# Run directories


def test_trainer_refuses_another_runs_directory(data, tmp_path):
    out = tmp_path / "run"
    write_run(out, 0xABC)
    write_state(out, 10, 0xABC)
    result = run(base_cmd(data, out))
    assert_refused_on_host(result, str(out), "state_00000010.bin", "-F 1")
    assert (out / "run.txt").read_text().startswith("run_id 0000000000000abc")  # untouched
    assert passes_host_checks(run(base_cmd(data, out, "-F", 1)))


def test_trainer_help_on_a_full_disk():
    """The trainer's one output that needs no GPU: lost, it is an error too, not exit 0."""
    assert_refused(run_to_full_disk([trainer(), "-h"]), "stdout")


@pytest.mark.parametrize("case", ["file", "under a file"])
def test_trainer_out_dir_not_a_directory(data, tmp_path, case):
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" if case == "file" else tmp_path / "f" / "sub"
    words = ["not a directory"] if case == "file" else ["could not create", "Not a directory"]
    assert_refused_on_host(run(base_cmd(data, out)), str(out), *words)


# Resume: the state file is checked as strictly as a checkpoint, before the GPU


RUN_ID = 0x0123456789ABCDEF


@pytest.fixture
def resumable(tmp_path, precision):
    """A run directory at step 5 that passes the host checks (the state payload is zeros)."""
    out = tmp_path / "run"
    write_run(out, RUN_ID, f"-e {os.path.realpath(GQA)}")
    bf16 = precision == "bf16"
    write_state(out, 5, RUN_ID, is_bf16=int(bf16), has_master=int(bf16))
    return out, bf16


def resume_cmd(data, out, *extra):
    return base_cmd(data, out, "-y", 1, "-x", 8, *extra, model=None)


@pytest.mark.parametrize("case", ["resume", "resume with -e", "fresh run with a missing model"])
def test_trainer_refused_run_creates_no_directory(data, tmp_path, case):
    """A run refused over its run directory or its model leaves no -o behind, nor any parent of it."""
    out = tmp_path / "a" / "b" / "run"
    if case == "fresh run with a missing model":
        result, words = run(base_cmd(data, out, model=tmp_path / "missing.bin")), ["missing.bin"]
    else:
        extra = ["-e", GQA] if case == "resume with -e" else []
        result, words = run(resume_cmd(data, out, *extra)), ["-y 1", str(out), "no such directory"]
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
    assert_refused_on_host(result, *words)


@pytest.mark.parametrize("extra", [[], ["-e", GQA]])  # with -e: the run's own starting checkpoint, no conflict
def test_trainer_resume_without_e_or_c(data, resumable, extra):
    out, _ = resumable
    result = run(resume_cmd(data, out, *extra))
    assert passes_host_checks(result), result.stderr
    assert f"resuming run {RUN_ID:016x} in {out} from step 5" in result.stdout


def edit_state(path, slot, value):
    data = bytearray(path.read_bytes())
    data[4 * slot:4 * slot + 4] = struct.pack("<i", value)
    path.write_bytes(bytes(data))


RESUME_BAD = {
    "conflicting -e": (lambda out: None, ["-e", str(ROOT / "dev/fixtures/tied_model.bin")], ["-e", "disagrees"]),
    "conflicting -c": (lambda out: None, ["-c", "d2"], ["-c d2", "another model"]),
    "x not past the step": (lambda out: None, ["-x", "5"], ["resumed at step 5", "-x 5"]),
    "other -g": (lambda out: None, ["-g", "256"], ["tokens per step (-g)", "256", "128"]),
    "truncated state": (lambda out: (out / "state_00000005.bin").write_bytes(
        (out / "state_00000005.bin").read_bytes()[:-1]), [], ["state_00000005.bin", "bytes", "truncated"]),
    "padded state": (lambda out: (out / "state_00000005.bin").write_bytes(
        (out / "state_00000005.bin").read_bytes() + b"\0"), [], ["state_00000005.bin", "bytes"]),
    "bad magic": (lambda out: edit_state(out / "state_00000005.bin", 0, 99), [], ["not a training state", "magic 99"]),
    "old version": (lambda out: edit_state(out / "state_00000005.bin", 1, 1), [], ["version 1"]),
    "step not the file name's": (lambda out: edit_state(out / "state_00000005.bin", 2, 6), [],
                                 ["state_00000005.bin", "holds step 6"]),
    "layout": (lambda out: edit_state(out / "state_00000005.bin", 12, 1), [],
               ["state_00000005.bin", "1 GPU(s) with ZeRO stage 1", "corrupt"]),
    "world size": (lambda out: [edit_state(out / "state_00000005.bin", slot, value) for slot, value in
                                ((7, 2), (12, 1))], [], ["state_00000005.bin", "optimizer elements"]),
    "config": (lambda out: edit_state(out / "state_00000005.bin", 17, 64), [], ["config slot 4", "64", "48"]),
    "num params": (lambda out: edit_state(out / "state_00000005.bin", 4, 5), [], ["parameter count"]),
    "reserved slot": (lambda out: edit_state(out / "state_00000005.bin", 40, 1), [], ["slot 40", "reserved"]),
    "precision": (lambda out: edit_state(out / "state_00000005.bin", 3, 7), [], ["precision"]),
    "another run's state": (lambda out: edit_state(out / "state_00000005.bin", 8, 42), [], ["no training state",
                                                                                         f"{RUN_ID:016x}"]),
    "no run.txt": (lambda out: (out / "run.txt").unlink(), [], ["run.txt"]),
    "model missing": (lambda out: (out / "model_00000005.bin").unlink(), [], ["model_00000005.bin"]),
    "model non-finite": (lambda out: poisoned_checkpoint(out / "model_00000005.bin", "w2", float("nan")), [],
                         ["model_00000005.bin", "tensor w2", "non-finite"]),
    "state is a directory": (lambda out: (out / "state_00000009.bin").mkdir(), [],
                             ["state_00000009.bin", "is a directory"]),
    "newest state corrupt": (lambda out: (out / "state_00000009.bin").write_bytes(b"\0" * 300), [],
                             ["state_00000009.bin", "magic 0"]),
}


@pytest.mark.parametrize("case", sorted(RESUME_BAD))
def test_trainer_resume_rejects(data, resumable, case):
    out, _ = resumable
    damage, extra, words = RESUME_BAD[case]
    damage(out)
    assert_refused_on_host(run(resume_cmd(data, out, *extra)), *words)


@pytest.fixture
def resumable_on_two(tmp_path, precision):
    """A run directory at step 5 written on 2 GPUs with ZeRO stage 1, with B=2 per GPU (the host checks' 4 x 32
    tokens a step)."""
    out = tmp_path / "run2"
    write_run(out, RUN_ID, f"-e {os.path.realpath(GQA)}")
    bf16 = precision == "bf16"
    write_state(out, 5, RUN_ID, is_bf16=int(bf16), has_master=int(bf16), world=2, stage=1)
    return out


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_trainer_resume_reshards(data, tmp_path, precision, stage):
    """A checkpoint of 2 GPUs passes the host checks of a 1-GPU resume, which says it reshards."""
    out = tmp_path / "run"
    write_run(out, RUN_ID, f"-e {os.path.realpath(GQA)}")
    bf16 = precision == "bf16"
    write_state(out, 5, RUN_ID, is_bf16=int(bf16), has_master=int(bf16), world=2, stage=stage)
    result = run(resume_cmd(data, out))
    assert passes_host_checks(result), result.stderr
    assert (f"resharding: the checkpoint was written on 2 GPU(s) with ZeRO stage {stage}, this run has 1 GPU(s) "
            "with stage 0") in result.stdout, result.stdout


RESHARD_BAD = {
    "rank file missing": (lambda out: (out / "state_00000005_rank1.bin").unlink(), [],
                          ["state_00000005_rank1.bin", "missing", "2 GPU(s) with ZeRO stage 1"]),
    "rank file of another layout": (lambda out: edit_state(out / "state_00000005_rank1.bin", 7, 4), [],
                                    ["state_00000005_rank1.bin", "4 GPU(s)", "not one checkpoint"]),
    "rank file of another run": (lambda out: edit_state(out / "state_00000005_rank1.bin", 8, 42), [],
                                 ["state_00000005_rank1.bin", "run id"]),
    "rank file truncated": (lambda out: (out / "state_00000005_rank1.bin").write_bytes(
        (out / "state_00000005_rank1.bin").read_bytes()[:-1]), [], ["state_00000005_rank1.bin", "truncated"]),
    "other -g": (lambda out: None, ["-g", "256"], ["128 tokens per step", "256", "-g 128"]),
}


@pytest.mark.parametrize("case", sorted(RESHARD_BAD))
def test_trainer_resume_reshard_rejects(data, resumable_on_two, case):
    damage, extra, words = RESHARD_BAD[case]
    damage(resumable_on_two)
    assert_refused_on_host(run(resume_cmd(data, resumable_on_two, *extra)), *words)


def test_trainer_resume_master_weights_mismatch(data, resumable):
    out, bf16 = resumable
    if not bf16:
        pytest.skip("fp32 builds keep no master weights")
    assert_refused_on_host(run(resume_cmd(data, out, "-W", "0")), "master weights")


def test_trainer_resume_picks_this_runs_newest_state(data, resumable, precision):
    """Another run's newer state (left by -F 1) and stale temporary files do not change what is resumed."""
    out, bf16 = resumable
    write_state(out, 7, RUN_ID, is_bf16=int(bf16), has_master=int(bf16))
    write_state(out, 9, 0x42, is_bf16=int(bf16), has_master=int(bf16))
    (out / "state_00000011.bin.tmp").write_bytes(b"partial")
    result = run(resume_cmd(data, out))
    assert passes_host_checks(result), result.stderr
    assert f"from step 7" in result.stdout
