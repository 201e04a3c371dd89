"""
Reliability of training runs on a GPU (issue 11); skipped without one. The CPU side is dev/test/test_reliability.py.

  - crashes: SIGKILL at named moments (LLAMA3_FAULT, llmc/fault.h: in the middle of the model write, before the
    model's rename, in the middle of the state write, before the state's rename, right after a checkpoint, between
    steps) and from outside at a moment picked by the step lines; then -y 1 must resume from the newest complete
    checkpoint and reproduce the uninterrupted run bit for bit: the same loss and norm lines, and byte-identical
    final model and state files;
  - non-finite steps: an injected NaN loss skips exactly that update (the checkpoint equals the previous step's),
    N in a row stop the run, a really diverging model (huge final-norm gains) stops without writing non-finite
    weights, a state file holding NaN is refused naming the tensor;
  - run directories: -F 1 over another run, retention of this run's files only, resume of the owning run;
  - write errors during training: a full disk under log.txt or under stdout, a directory where a checkpoint goes;
  - output: step lines reach a redirected stdout before a kill; sampling with an in-vocab start id;
  - the FP8 mode (-M fp8) on d2: its loss against the BF16 mode's within a bound derived from the FP8 formats' unit
    roundoff, bit-identical recomputation levels, kill and resume bit for bit, checkpoints shared with the BF16 mode.

The model is dev/fixtures/gqa_model.bin (V=259), so no PyTorch is needed.

    python -m pytest -q dev/test/test_reliability_gpu.py
"""

import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gpu_common import build_binaries, requires_gpu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "dev" / "data"))
import shards  # noqa: E402

GQA = ROOT / "dev" / "fixtures" / "gqa_model.bin"
STEPS, EVERY = 12, 3


pytestmark = requires_gpu


def run(cmd, env=None, timeout=600):
    full_env = dict(os.environ)
    full_env.pop("LLAMA3_FAULT", None)
    full_env.update(env or {})
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=full_env)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    bins = build_binaries(str(tmp_path_factory.mktemp("bin")), targets=("train",))
    return {precision: Path(b["train"]) for precision, b in bins.items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for split, count in (("train", 40000), ("val", 5000)):
        tokens = np.zeros(count, dtype=np.int64)
        noise = rng.integers(0, 259, size=count)
        for i in range(1, count):  # learnable: a fixed rule with 10% noise
            tokens[i] = noise[i] if noise[i] < 26 else (tokens[i - 1] * 7 + 3) % 259
        shards.write_shard(out / f"{split}.bin", tokens)
    return out


def train_cmd(binary, data, out_dir, *extra, model=GQA):
    cmd = [binary, "-i", data / "train.bin", "-j", data / "val.bin", "-o", out_dir, "-b", 4, "-t", 32, "-g", 256,
           "-x", STEPS, "-l", 1e-3, "-u", 2, "-v", 4, "-m", 2, "-n", EVERY, "-r", 2, *extra]
    return cmd[:1] + (["-e", model] if model is not None else []) + cmd[1:]


def step_lines(stdout):
    return re.findall(r"step +(\d+)/\d+ \| loss (\S+) \| norm (\S+)", stdout)


def state_without_run_id(path):
    data = bytearray(Path(path).read_bytes())
    data[32:40] = b"\0" * 8  # header slots 8..9: the run id, the one field two runs may not share
    return bytes(data)


def assert_clean_failure(result, *words):
    assert result.returncode > 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr}"
    for word in words:
        assert word in result.stderr, f"'{word}' missing from: {result.stderr}"


@pytest.fixture(scope="module")
def full_runs(build, data, tmp_path_factory):
    """The uninterrupted runs, per precision: (stdout, run dir)."""
    runs = {}
    for precision, binary in build.items():
        out = tmp_path_factory.mktemp(f"full_{precision}")
        result = run(train_cmd(binary, data, out))
        assert result.returncode == 0, result.stdout + result.stderr
        assert len(step_lines(result.stdout)) == STEPS
        runs[precision] = (result.stdout, out)
    return runs


def newest_state(out_dir):
    steps = sorted(int(p.name[6:14]) for p in Path(out_dir).glob("state_*.bin"))
    return steps[-1] if steps else 0


def check_resume_matches(binary, data, out, full, expected_from, *extra):
    """-y 1 (with the run's flags `extra`) resumes from the newest complete checkpoint and continues exactly as the
    uninterrupted run."""
    full_stdout, full_dir = full
    assert newest_state(out) == expected_from, sorted(os.listdir(out))
    resumed = run(train_cmd(binary, data, out, "-y", 1, *extra, model=None))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {out}/state_{expected_from:08d}.bin at step {expected_from}" in resumed.stdout
    got, want = step_lines(resumed.stdout), step_lines(full_stdout)[expected_from:]
    assert [int(s[0]) for s in got] == list(range(expected_from + 1, STEPS + 1))
    assert got == want, (resumed.stdout, full_stdout)
    last = f"{STEPS:08d}"
    assert (out / f"model_{last}.bin").read_bytes() == (full_dir / f"model_{last}.bin").read_bytes()
    assert state_without_run_id(out / f"state_{last}.bin") == state_without_run_id(full_dir / f"state_{last}.bin")
    assert not list(out.glob("*.tmp"))


# (LLAMA3_FAULT label, the newest complete checkpoint after the kill)
KILL_POINTS = [
    ("write model_00000006.bin", 3),
    ("rename model_00000006.bin", 3),
    ("write state_00000006.bin", 3),
    ("rename state_00000006.bin", 3),
    ("step 6", 6),
    ("step 7", 6),
    ("write model_00000003.bin", 0),  # before any checkpoint: nothing to resume
]


@pytest.mark.parametrize("precision", ["FP32", "BF16"])
@pytest.mark.parametrize("label,newest", KILL_POINTS)
def test_kill_and_resume_is_bit_identical(build, data, full_runs, tmp_path, precision, label, newest):
    binary, out = build[precision], tmp_path / "run"
    killed = run(train_cmd(binary, data, out), env={"LLAMA3_FAULT": label})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert f"SIGKILL at '{label}'" in killed.stderr
    if label.startswith("write") or label.startswith("rename"):
        assert (out / (label.split()[1] + ".tmp")).exists()  # the kill really hit the write
    if newest == 0:
        resumed = run(train_cmd(binary, data, out, "-y", 1, model=None))
        assert_clean_failure(resumed, "no training state")
        return
    check_resume_matches(binary, data, out, full_runs[precision], newest)


def test_kill_twice_and_resume(build, data, full_runs, tmp_path):
    binary, out = build["BF16"], tmp_path / "run"
    assert run(train_cmd(binary, data, out), env={"LLAMA3_FAULT": "step 4"}).returncode == -signal.SIGKILL
    again = run(train_cmd(binary, data, out, "-y", 1, model=None), env={"LLAMA3_FAULT": "write state_00000009.bin"})
    assert again.returncode == -signal.SIGKILL, again.stdout + again.stderr
    check_resume_matches(binary, data, out, full_runs["BF16"], 6)


def test_kill_from_outside_and_resume(build, data, full_runs, tmp_path):
    """A real kill -9 from another process, when the step line of step 8 reaches the (file) stdout."""
    binary, out = build["BF16"], tmp_path / "run"
    log = tmp_path / "stdout.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in train_cmd(binary, data, out)], stdout=f, stderr=subprocess.PIPE,
                                cwd=ROOT)
        deadline = time.time() + 300
        while "step     8/" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    text = log.read_text()
    lines = step_lines(text)
    assert [int(s[0]) for s in lines[:8]] == list(range(1, 9)), text  # every line up to the kill is there
    check_resume_matches(binary, data, out, full_runs["BF16"], newest_state(out))


def test_step_lines_reach_a_redirected_stdout(build, data, tmp_path):
    log = tmp_path / "stdout.txt"
    with open(log, "w") as f:
        result = subprocess.run([str(c) for c in train_cmd(build["BF16"], data, tmp_path / "run")], stdout=f,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, LLAMA3_FAULT="step 5"))
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert [int(s[0]) for s in step_lines(log.read_text())] == [1, 2, 3, 4, 5]
    assert "saved checkpoint" in log.read_text() and "val loss" in log.read_text()


# ---------------------------------------------------------------------------------------------------------------
# Non-finite steps


@pytest.mark.parametrize("precision", ["FP32", "BF16"])
def test_nan_step_skips_exactly_its_update(build, data, tmp_path, precision):
    binary = build[precision]
    skipped = run(train_cmd(binary, data, tmp_path / "a", "-x", 3, "-n", 3), env={"LLAMA3_FAULT": "nan 3"})
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    lines = [l for l in skipped.stdout.splitlines() if l.startswith("step ") and "/3 |" in l]
    assert "skipped" in lines[2] and "loss nan" in lines[2] and not any("skipped" in l for l in lines[:2])
    reference = run(train_cmd(binary, data, tmp_path / "b", "-x", 2, "-n", 2))
    assert reference.returncode == 0, reference.stderr
    # the weights and the optimizer state after the skipped step 3 are those after step 2
    assert (tmp_path / "a/model_00000003.bin").read_bytes() == (tmp_path / "b/model_00000002.bin").read_bytes()
    n = (GQA.stat().st_size - 256) // 4
    optimizer = slice(256, 256 + (3 if precision == "BF16" else 2) * 4 * n)
    assert (tmp_path / "a/state_00000003.bin").read_bytes()[optimizer] == \
        (tmp_path / "b/state_00000002.bin").read_bytes()[optimizer]
    assert "train_loss nan norm" in (tmp_path / "a/log.txt").read_text()


def test_consecutive_nan_steps_stop_the_run(build, data, tmp_path):
    out = tmp_path / "run"
    result = run(train_cmd(build["BF16"], data, out, "-N", 3, "-n", 1), env={"LLAMA3_FAULT": "nan 3,nan 4,nan 5"})
    assert_clean_failure(result, "3 steps in a row (3..5)", "non-finite", "-N 3")
    assert [int(s[0]) for s in step_lines(result.stdout)] == [1, 2, 3, 4, 5]
    assert not (out / "state_00000005.bin").exists() and (out / "state_00000004.bin").exists()
    # not in a row: the run goes on
    ok = run(train_cmd(build["BF16"], data, tmp_path / "ok", "-N", 2), env={"LLAMA3_FAULT": "nan 2,nan 4,nan 5"})
    assert_clean_failure(ok, "2 steps in a row (4..5)")
    ok = run(train_cmd(build["BF16"], data, tmp_path / "ok2", "-N", 2), env={"LLAMA3_FAULT": "nan 2,nan 4,nan 6"})
    assert ok.returncode == 0, ok.stderr
    assert sum("skipped" in l for l in ok.stdout.splitlines()) == 3


def diverging_checkpoint(path):
    """The gqa fixture with final-norm gains of 3e38: the logits overflow, the loss is NaN from step 1."""
    data = bytearray(GQA.read_bytes())
    V, C, L, H, KV, F = 259, 48, 2, 6, 2, 88
    hd = C // H
    offset = V * C + L * C + L * (H + 2 * KV) * hd * C + L * C * H * hd + L * C + L * 2 * F * C + L * C * F
    data[256 + 4 * offset:256 + 4 * (offset + C)] = struct.pack(f"<{C}f", *([3e38] * C))
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("precision", ["FP32", "BF16"])
def test_diverging_model_stops_without_writing_non_finite_weights(build, data, tmp_path, precision):
    out = tmp_path / "run"
    model = diverging_checkpoint(tmp_path / "diverging.bin")
    result = run(train_cmd(build[precision], data, out, "-N", 2, "-n", 1, model=model))
    assert_clean_failure(result, "2 steps in a row", "non-finite")
    assert all("skipped" in l for l in result.stdout.splitlines() if re.match(r"step +\d+/", l))
    for path in out.glob("model_*.bin"):  # whatever was written is finite (the weights never changed)
        values = np.fromfile(path, dtype="<f4" if precision == "FP32" else "<u2", offset=256)
        if precision == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        assert np.isfinite(values).all(), path


@pytest.mark.parametrize("moment", ["m", "v", "master"])
def test_state_with_nan_is_refused(build, data, tmp_path, moment):
    out = tmp_path / "run"
    first = run(train_cmd(build["BF16"], data, out, "-x", 3))
    assert first.returncode == 0, first.stderr
    state = out / "state_00000003.bin"
    n = (GQA.stat().st_size - 256) // 4
    block = {"master": 0, "m": 1, "v": 2}[moment]
    raw = bytearray(state.read_bytes())
    at = 256 + 4 * (block * n + 100)  # element 100 of tok_embedding
    raw[at:at + 4] = struct.pack("<f", float("nan"))
    state.write_bytes(bytes(raw))
    result = run(train_cmd(build["BF16"], data, out, "-y", 1, "-x", 6, model=None))
    name = {"master": "master weights", "m": "AdamW m", "v": "AdamW v"}[moment]
    assert_clean_failure(result, str(state), name, "tensor tok_embedding", "element 100")


# ---------------------------------------------------------------------------------------------------------------
# Run directories


def run_id(out):
    return (out / "run.txt").read_text().split()[1]


def test_forced_run_leaves_the_other_run_alone(build, data, tmp_path):
    binary, out = build["BF16"], tmp_path / "run"
    first = run(train_cmd(binary, data, out, "-x", 20, "-n", 7))  # checkpoints 7, 14, 20; 14 and 20 stay (-r 2)
    assert first.returncode == 0, first.stderr
    first_id = run_id(out)
    first_files = {name: (out / name).read_bytes() for name in os.listdir(out) if name.endswith(".bin")}
    assert sorted(first_files) == ["model_00000014.bin", "model_00000020.bin", "state_00000014.bin",
                                   "state_00000020.bin"]
    refused = run(train_cmd(binary, data, out, "-x", 6))
    assert_clean_failure(refused, "already holds checkpoints", "state_00000020.bin", "-F 1")
    assert run_id(out) == first_id
    forced = run(train_cmd(binary, data, out, "-x", 12, "-r", 1, "-F", 1))  # checkpoints 3, 6, 9, 12; 12 stays
    assert forced.returncode == 0, forced.stderr
    second_id = run_id(out)
    assert second_id != first_id
    assert sorted(os.listdir(out)) == sorted(["log.txt", "model_00000012.bin", "run.txt", "state_00000012.bin",
                                              *first_files])
    assert all((out / name).read_bytes() == content for name, content in first_files.items())  # untouched
    # resuming continues the owner's step 12, not the other run's newer step 20
    resumed = run(train_cmd(binary, data, out, "-y", 1, "-x", 15, model=None))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming run {second_id} in {out} from step 12" in resumed.stdout
    assert [int(s[0]) for s in step_lines(resumed.stdout)] == [13, 14, 15]


def test_checkpoint_files(build, data, tmp_path):
    out = tmp_path / "run"
    result = run(train_cmd(build["BF16"], data, out, "-x", 15, "-n", 3, "-r", 2))
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(out)) == ["log.txt", "model_00000012.bin", "model_00000015.bin", "run.txt",
                                       "state_00000012.bin", "state_00000015.bin"]
    header = np.fromfile(out / "state_00000015.bin", dtype="<i4", count=64)
    assert list(header[:3]) == [20261123, 2, 15] and header[7] == 1  # world size 1
    assert f"{(int(header[9]) & 0xFFFFFFFF) << 32 | (int(header[8]) & 0xFFFFFFFF):016x}" == run_id(out)
    assert "step 15 train_loss" in (out / "log.txt").read_text()


# ---------------------------------------------------------------------------------------------------------------
# Write errors while training


def test_log_on_a_full_disk(build, data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    os.symlink("/dev/full", out / "log.txt")
    result = run(train_cmd(build["BF16"], data, out))
    assert_clean_failure(result, str(out / "log.txt"), "No space left on device")
    assert result.stderr.count("Error:") == 1


def test_stdout_on_a_full_disk(build, data, tmp_path):
    """Step lines that cannot be written stop the run: line buffering drops a line whose write fails, and the fflush
    after it returns 0, so only the stream's error flag tells."""
    with open("/dev/full", "w") as full:
        result = subprocess.run([str(c) for c in train_cmd(build["BF16"], data, tmp_path / "run")], stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=600, cwd=ROOT)
    assert result.returncode > 0, f"exit {result.returncode}: the lost step lines went unnoticed\n{result.stderr}"
    assert_clean_failure(result, "stdout", "lines are missing")
    assert result.stderr.count("Error:") == 1


def test_log_is_a_directory(build, data, tmp_path):
    out = tmp_path / "run"
    (out / "log.txt").mkdir(parents=True)
    assert_clean_failure(run(train_cmd(build["BF16"], data, out)), "log.txt", "is a directory")


def test_checkpoint_path_is_a_directory(build, data, tmp_path):
    out = tmp_path / "run"
    (out / "model_00000006.bin").mkdir(parents=True)
    result = run(train_cmd(build["BF16"], data, out, "-F", 1))
    assert_clean_failure(result, "model_00000006.bin", "is a directory")
    assert result.stderr.count("Error:") == 1
    assert newest_state(out) == 3 and not list(out.glob("*.tmp"))  # the last good checkpoint stays


# ---------------------------------------------------------------------------------------------------------------
# Sampling


def test_sampling_with_in_vocab_tokenizer(build, data, tmp_path):
    pieces = [bytes([i]) for i in range(256)] + [b"<|begin_of_text|>", b"<|end_of_text|>", b"<|eot_id|>"]
    header = np.zeros(16, dtype="<i4")
    header[:7] = [20261125, 1, 259, 256, 257, 258, sum(len(p) for p in pieces)]
    tok = tmp_path / "tok.bin"
    tok.write_bytes(header.tobytes() + b"".join(struct.pack("<I", len(p)) + p for p in pieces))
    result = run(train_cmd(build["BF16"], data, tmp_path / "run", "-x", 4, "-z", tok, "-s", 2, "-L", 16))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("sample: ") == 2


# ---------------------------------------------------------------------------------------------------------------
# The FP8 mode (-M fp8): d2, whose widths are multiples of 16 (the gqa fixture's F = 88 is not), from a start that
# 12 BF16 steps trained, so that the layers compute something the loss depends on.
#
# The bound on the loss. Rounding to nearest, a value cast to e4m3 (3 mantissa bits) is off by at most u4 = 2^-4 of
# itself, cast to e5m2 (2 bits) by u5 = 2^-3 (the per-tensor scale puts the amax at the format's largest value, so
# only values 2^15 below the amax, in e4m3's subnormals, lose more: negligible in absolute terms). Roundings of
# different elements are independent with mean zero and an rms of u / sqrt(3) of the value, so a product of two cast
# operands is off by a relative rms of sqrt(u_a^2 + u_b^2) / sqrt(3): EPS_FWD = 0.051 in the forward (e4m3 x e4m3),
# EPS_BWD = 0.081 in the backward (e5m2 x e4m3); the fp32 accumulation adds nothing comparable. Taking that error as
# if it moved the loss coherently (it does not: the roundings of different elements and tokens average out), the
# forward changes the loss by at most EPS_FWD of what the model computes beyond a uniform guess, ln V - L, and the
# gradients change the run by at most EPS_BWD of what it has learned since its first step, |L_1 - L_k|:
#   |L8_k - L16_k| <= EPS_FWD (ln V - L16_k) + EPS_BWD |L16_1 - L16_k|
# A wrong scale, format or operand moves the loss by nats; the bit-exact checks below catch the subtler faults.

U4, U5 = 2.0 ** -4, 2.0 ** -3
EPS_FWD = math.sqrt(U4 ** 2 + U4 ** 2) / math.sqrt(3)
EPS_BWD = math.sqrt(U5 ** 2 + U4 ** 2) / math.sqrt(3)
D2_VOCAB = 128256


@pytest.fixture(scope="module")
def d2_start(build, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("d2_start")
    result = run(train_cmd(build["BF16"], data, out, "-c", "d2", model=None))
    assert result.returncode == 0, result.stdout + result.stderr
    return out / f"model_{STEPS:08d}.bin"


@pytest.fixture(scope="module")
def d2_runs(build, data, d2_start, tmp_path_factory):
    """From d2_start, STEPS steps with the layers' products in bf16 and in fp8: {mode: (stdout, run dir)}."""
    runs = {}
    for mode in ("bf16", "fp8"):
        out = tmp_path_factory.mktemp(f"d2_{mode}")
        result = run(train_cmd(build["BF16"], data, out, "-M", mode, "-K", 0, model=d2_start))
        assert result.returncode == 0, result.stdout + result.stderr
        runs[mode] = (result.stdout, out)
    return runs


def val_loss_before_training(stdout):
    return float(re.search(r"step 0 \| val loss (\S+)", stdout).group(1))


def test_fp8_loss_within_bound_of_bf16(d2_runs):
    bf16_out, fp8_out = d2_runs["bf16"][0], d2_runs["fp8"][0]
    assert "layers' matmuls fp8" in fp8_out and "FP8 copies" in fp8_out, fp8_out
    assert "layers' matmuls fp8" not in bf16_out and "FP8 copies" not in bf16_out, bf16_out
    bf16 = [float(loss) for _, loss, _ in step_lines(bf16_out)]
    fp8 = [float(loss) for _, loss, _ in step_lines(fp8_out)]
    assert len(bf16) == len(fp8) == STEPS and all(map(math.isfinite, bf16 + fp8)), (bf16, fp8)
    assert sum(fp8[-3:]) < sum(fp8[:3]), fp8  # it learns
    assert fp8 != bf16, "the FP8 mode computed exactly what the BF16 mode did"
    ln_v = math.log(D2_VOCAB)
    for k in range(STEPS):
        bound = EPS_FWD * (ln_v - bf16[k]) + EPS_BWD * abs(bf16[0] - bf16[k])
        assert abs(fp8[k] - bf16[k]) <= bound, f"step {k + 1}: fp8 {fp8[k]} bf16 {bf16[k]} bound {bound}"
    # the val loss before training: both modes on the same weights, only the forward's casts differ
    v16, v8 = val_loss_before_training(bf16_out), val_loss_before_training(fp8_out)
    assert abs(v8 - v16) <= EPS_FWD * (ln_v - v16), (v8, v16)


def test_fp8_recompute_levels_are_bit_identical(build, data, d2_start, d2_runs, tmp_path):
    """The recomputed inputs are cast as the forward cast them: -R 0 and 2 give the default -R 1's run bit for bit."""
    want = step_lines(d2_runs["fp8"][0])
    for level in (0, 2):
        result = run(train_cmd(build["BF16"], data, tmp_path / f"r{level}", "-M", "fp8", "-K", 0, "-R", level,
                               "-n", 0, model=d2_start))
        assert result.returncode == 0, result.stdout + result.stderr
        assert step_lines(result.stdout) == want, (level, result.stdout)


@pytest.mark.parametrize("seq_len", [64, 256])
def test_fp8_recompute_levels_are_bit_identical_at_d12_widths(build, data, tmp_path, seq_len):
    """The same at d12's widths (dim 768, F 2048, QKV 1280), whose FP8 copies sit elsewhere in the scratch than
    d2's: from scratch, -R 0, 1 and 2 give the same losses and norms. At B=4, T=256 the backward's w13 weight copy
    (2 F dim bytes) fits in datty and dqkv (2 N (768 + 1280) bytes) and goes there; at T=64 it does not."""
    want = None
    for level in (1, 0, 2):
        result = run(train_cmd(build["BF16"], data, tmp_path / f"r{level}", "-M", "fp8", "-K", 0, "-R", level,
                               "-c", "d12", "-b", 4, "-t", seq_len, "-g", 4 * seq_len, "-x", 4, "-n", 0, "-v", 0,
                               model=None))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "layers' matmuls fp8" in result.stdout
        lines = step_lines(result.stdout)
        assert len(lines) == 4
        want = want or lines
        assert lines == want, (level, lines, want)


def test_fp8_kill_and_resume_is_bit_identical(build, data, d2_start, d2_runs, tmp_path):
    """Current scaling keeps no state beyond the weights: a resumed FP8 run continues bit for bit."""
    out = tmp_path / "run"
    killed = run(train_cmd(build["BF16"], data, out, "-M", "fp8", "-K", 0, model=d2_start),
                 env={"LLAMA3_FAULT": "step 7"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    check_resume_matches(build["BF16"], data, out, d2_runs["fp8"], 6, "-M", "fp8", "-K", 0)


def test_fp8_on_a_narrow_model_keeps_bf16_products(build, data, d2_start, d2_runs, tmp_path):
    """-M fp8 below -K's width (d2: 128 < the default 1024) says so and runs the BF16 mode's products, bit for bit."""
    result = run(train_cmd(build["BF16"], data, tmp_path / "narrow", "-M", "fp8", "-n", 0, model=d2_start))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "note: -M fp8 runs the layers' products in bf16 on this model: its width 128 is below -K 1024" in \
        result.stdout, result.stdout
    assert "layers' matmuls fp8" not in result.stdout and "FP8 copies" not in result.stdout, result.stdout
    assert step_lines(result.stdout) == step_lines(d2_runs["bf16"][0])


@pytest.mark.parametrize("saved,resumed", [("bf16", "fp8"), ("fp8", "bf16")])
def test_fp8_and_bf16_checkpoints_are_interchangeable(build, data, d2_runs, tmp_path, saved, resumed):
    out = tmp_path / "run"
    shutil.copytree(d2_runs[saved][1], out)
    result = run(train_cmd(build["BF16"], data, out, "-y", 1, "-x", STEPS + 3, "-M", resumed, "-K", 0, model=None))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from {out}/state_{STEPS:08d}.bin at step {STEPS}" in result.stdout
    lines = step_lines(result.stdout)
    assert [int(s[0]) for s in lines] == list(range(STEPS + 1, STEPS + 4))
    assert all(math.isfinite(float(s[1])) for s in lines), result.stdout
