"""
GPU tests: the CUDA trainer against the PyTorch reference, resume determinism, bad flags, and compute-sanitizer.
Skipped when no GPU is present (CI has none); `make test` runs them on a GPU machine.

They build train_llama3cu / test_llama3cu in both precisions into a temporary directory and write the debug states
with scripts/train_llama3.py (PyTorch with CUDA) for:
  - test-gqa (GQA group 3, separate lm_head, V=259) and test-tied (MQA, tied, RoPE scaling): the fixtures' configs
  - test-mha: head dim 128 with n_kv_heads == n_heads, T = 100 (a ragged last attention tile)
  - llama3.2-1B at depth 2 (the real widths: dim 2048, 32 heads, 8 kv heads, vocab 128256, tied, RoPE scaling x32)
  - llama3.2-3B at depth 2 (head dim 128 at the real widths: dim 3072, 24 heads, 8 kv heads)
The FP32 build is held to fixed bounds, the BF16 build to a multiple of PyTorch's own bf16 autocast error on the same
case (test_llama3.cu says which). The FP8 mode (test_llama3cu -M fp8) is held to the same multiple of PyTorch's
FP8 recipe's error (scripts/train_llama3.py --fp8): on the committed test-fp8 fixture (dev/fixtures, the exact-sum
emulation) and on llama3.2-1B at depth 2 (--fp8_scaled_mm: PyTorch's products on the FP8 tensor cores), and must fail
against bf16 autocast's error; skipped on GPUs without FP8 tensor cores.
"""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from gpu_common import build_binaries, requires_fp8_tensor_cores, requires_gpu, skip_without_torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "dev", "data"))
import export_tokenizer  # noqa: E402


pytestmark = requires_gpu


def run(cmd, timeout=900, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """Binaries for both precisions: {'FP32': {'train': path, 'test': path}, 'BF16': {...}}."""
    return build_binaries(str(tmp_path_factory.mktemp("bin")))


DEBUG_CASES = {
    "test-gqa": ["--config", "test-gqa", "-B", "2", "-T", "13", "--lr", "3e-3"],
    "test-tied": ["--config", "test-tied", "-B", "3", "-T", "19", "--lr", "3e-3", "--grad_clip", "0.5"],
    "test-mha": ["--config", "test-mha", "-B", "2", "-T", "100", "--lr", "1e-3"],
    "llama3.2-1B-d2": ["--config", "llama3.2-1B", "--depth", "2", "-B", "2", "-T", "64", "--lr", "1e-4"],
    "llama3.2-3B-d2": ["--config", "llama3.2-3B", "--depth", "2", "-B", "2", "-T", "64", "--lr", "1e-5"],
}


def write_debug_states(out, cases, *recipe):
    """{case: (model path, debug state path)}, each written into `out` by scripts/train_llama3.py on the GPU with
    the error section of `recipe` (none: bf16 autocast's)."""
    skip_without_torch()
    states = {}
    for name, args in cases.items():
        model, debug = out / f"{name}_model.bin", out / f"{name}_debug.bin"
        result = run([sys.executable, "scripts/train_llama3.py", *args, "--steps", "10", "--device", "cuda",
                      "--write_model", str(model), *recipe, "--write_debug", str(debug)])
        assert result.returncode == 0, result.stdout + result.stderr
        states[name] = (str(model), str(debug))
    return states


@pytest.fixture(scope="module")
def debug_states(tmp_path_factory):
    return write_debug_states(tmp_path_factory.mktemp("debug"), DEBUG_CASES)


@pytest.mark.parametrize("precision", ["FP32", "BF16"])
@pytest.mark.parametrize("case", sorted(DEBUG_CASES))
def test_tie_out(build, debug_states, precision, case):
    model, debug = debug_states[case]
    result = run([build[precision]["test"], model, debug])
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout


@pytest.mark.parametrize("precision", ["FP32", "BF16"])
def test_tie_out_with_recompute(build, debug_states, precision):
    model, debug = debug_states["test-tied"]
    result = run([build[precision]["test"], model, debug, "2"])
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout


# The FP8 mode (-M fp8). Its products need every width and token count a multiple of 16, which test-gqa, test-tied
# and test-mha (F = 88, 72, 344) are not: test-fp8 is test-gqa with F = 96, committed in dev/fixtures
# (make_fixtures.sh) with its debug state twice, once with the error section of PyTorch's FP8 emulation and once with
# bf16 autocast's; llama3.2-1B-d2 has the real widths, and its FP8 debug state is written here. The FP8 cases train at
# lr 3e-4 or below, where the steps' errors come from rounding more than from chance (test_llama3.cu).
FIXTURES = os.path.join(ROOT, "dev", "fixtures")
FP8_MODEL = os.path.join(FIXTURES, "fp8_model.bin")
FP8_DEBUG = os.path.join(FIXTURES, "fp8_debug.bin")
FP8_DEBUG_BF16_ERRORS = os.path.join(FIXTURES, "fp8_debug_bf16_errors.bin")
# d12-d2: d12's widths (untied, dim 768), where the FP8 mode's convergence run ended 1.08% below BF16's (dev/NOTES.md)
FP8_DEBUG_CASES = {"llama3.2-1B-d2": DEBUG_CASES["llama3.2-1B-d2"],
                   "d12-d2": ["--config", "d12", "--depth", "2", "-B", "4", "-T", "256", "--lr", "3e-4"]}
FP8_PRODUCT_GRADS = ("dwqkv", "dwo", "dw13", "dw2")


@pytest.fixture(scope="module")
def tie_out_build(tmp_path_factory):
    """test_llama3cu alone in both precisions, {'FP32': path, 'BF16': path}: `-k fp8_tie_out` builds two binaries,
    not build's four."""
    bins = build_binaries(str(tmp_path_factory.mktemp("tie_out_bin")), targets=("test",))
    return {precision: b["test"] for precision, b in bins.items()}


@pytest.fixture(scope="module")
def fp8_debug_states(tmp_path_factory):
    # --fp8_scaled_mm: PyTorch's FP8 products on the GPU's FP8 tensor cores (torch._scaled_mm), which add in the
    # same limited window as ours (llmc/matmul_fp8.cuh): the exact-sum emulation misses that part of the error
    # (its bound on the loss at llama3.2-1B-d2 was 15.9 times too tight on an H200)
    return write_debug_states(tmp_path_factory.mktemp("fp8_debug"), FP8_DEBUG_CASES, "--fp8", "--fp8_scaled_mm")


def fp8_tie_out(binary, model, debug, *extra):
    result = run([binary, "-M", "fp8", model, debug, *extra])
    print(result.stdout)
    return result


@requires_fp8_tensor_cores
@pytest.mark.parametrize("recompute", ["0", "1", "2"])
def test_fp8_tie_out_fixture(tie_out_build, recompute):
    result = fp8_tie_out(tie_out_build["BF16"], FP8_MODEL, FP8_DEBUG, recompute)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layers' matmuls fp8" in result.stdout and "all checks passed" in result.stdout


@requires_fp8_tensor_cores
@pytest.mark.parametrize("recompute", ["0", "1", "2"])
@pytest.mark.parametrize("case", sorted(FP8_DEBUG_CASES))
def test_fp8_tie_out(tie_out_build, fp8_debug_states, case, recompute):
    result = fp8_tie_out(tie_out_build["BF16"], *fp8_debug_states[case], recompute)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layers' matmuls fp8" in result.stdout and "all checks passed" in result.stdout


@requires_fp8_tensor_cores
def test_fp8_tie_out_fails_against_bf16_errors(tie_out_build):
    """The bounds tell FP8 error from bf16's: against the same case's bf16 autocast errors the FP8 mode fails, on
    the gradients of the FP8 products' weights at least (PyTorch's FP8 ones are about 3-4 times those bounds:
    test_fp8_scripts.py checks the fixture for it), while the bf16 mode passes."""
    result = fp8_tie_out(tie_out_build["BF16"], FP8_MODEL, FP8_DEBUG_BF16_ERRORS)
    assert result.returncode == 1 and "FAILED:" in result.stdout, result.stdout + result.stderr
    failed = [line.split()[0] for line in result.stdout.splitlines() if line.endswith("FAIL")]
    assert set(FP8_PRODUCT_GRADS) & set(failed), result.stdout
    result = run([tie_out_build["BF16"], FP8_MODEL, FP8_DEBUG_BF16_ERRORS])
    assert result.returncode == 0 and "all checks passed" in result.stdout, result.stdout + result.stderr


def test_fp8_tie_out_refused_by_fp32_build(tie_out_build):
    result = run([tie_out_build["FP32"], "-M", "fp8", FP8_MODEL, FP8_DEBUG])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "-M fp8" in result.stderr and "BF16 build" in result.stderr, result.stderr


@pytest.fixture(scope="module")
def small_run_inputs(tmp_path_factory):
    """A test-gqa checkpoint and token shards (ids < 259) for trainer runs."""
    skip_without_torch()
    out = tmp_path_factory.mktemp("run")
    model = out / "model.bin"
    result = run([sys.executable, "scripts/train_llama3.py", "--config", "test-gqa", "--steps", "0", "--device", "cpu",
                  "--write_model", str(model)])
    assert result.returncode == 0, result.stdout + result.stderr
    rng = np.random.default_rng(0)
    for split, count in (("train", 40000), ("val", 5000)):
        header = np.zeros(256, dtype=np.int32)
        header[:3] = [20240801, 7, count]
        # learnable: each token follows from the previous one by a fixed rule, with 10% random tokens
        tokens = np.zeros(count, dtype=np.uint32)
        noise = rng.integers(0, 259, size=count)
        for i in range(1, count):
            tokens[i] = noise[i] if noise[i] < 26 else (tokens[i - 1] * 7 + 3) % 259
        with open(out / f"tok_{split}.bin", "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.tobytes())
    return out


def train_cmd(binary, inputs, out_dir, steps, *extra):
    return [binary, "-e", str(inputs / "model.bin"), "-i", str(inputs / "tok_train.bin"),
            "-j", str(inputs / "tok_val.bin"), "-o", str(out_dir), "-b", "4", "-t", "32", "-g", "256",
            "-x", str(steps), "-l", "1e-3", "-u", "2", "-v", "5", "-m", "4", "-n", "5", *extra]


def losses(stdout):
    return re.findall(r"step +(\d+)/\d+ \| loss (\S+) \| norm (\S+)", stdout)


@pytest.mark.parametrize("precision,options", [("FP32", ()), ("BF16", ()), ("BF16", ("-W", "0", "-O", "bf16"))])
def test_resume_is_bit_identical(build, small_run_inputs, tmp_path, precision, options):
    train = build[precision]["train"]
    # a constant schedule, so the run cut short at step 6 follows the same lr as the full one
    cmd = lambda name, *extra: train_cmd(train, small_run_inputs, tmp_path / name, 12, "-k", "constant", *options,
                                         *extra)
    full = run(cmd("full"))
    assert full.returncode == 0, full.stdout + full.stderr
    part = run(cmd("part", "-x", "6"))
    assert part.returncode == 0, part.stdout + part.stderr
    resumed = run(cmd("part", "-y", "1"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    full_losses = losses(full.stdout)
    assert len(full_losses) == 12
    resumed_losses = losses(resumed.stdout)
    assert [l[0] for l in resumed_losses] == [str(i) for i in range(7, 13)]
    assert resumed_losses == full_losses[6:], (resumed.stdout, full.stdout)
    # the same seed and flags give the same run
    again = run(cmd("again"))
    assert losses(again.stdout) == full_losses


def test_recompute_and_master_options(build, small_run_inputs, tmp_path):
    """Recomputing activations changes nothing, bit for bit; training without master weights, and with bf16 AdamW
    state, still learns."""
    train = build["BF16"]["train"]
    runs = {level: run(train_cmd(train, small_run_inputs, tmp_path / f"r{level}", 8, "-R", str(level), "-n", "0"))
            for level in ("0", "1", "2")}
    for result in runs.values():
        assert result.returncode == 0, result.stdout + result.stderr
    assert losses(runs["0"].stdout) == losses(runs["1"].stdout) == losses(runs["2"].stdout)
    for lean in (("-W", "0"), ("-W", "0", "-O", "bf16")):
        result = run(train_cmd(train, small_run_inputs, tmp_path / "lean", 8, *lean, "-n", "0"))
        assert result.returncode == 0, result.stdout + result.stderr
        steps = losses(result.stdout)
        assert len(steps) == 8 and float(steps[-1][1]) < float(steps[0][1]) - 0.1, result.stdout


def test_profile_table(build, small_run_inputs, tmp_path):
    result = run(train_cmd(build["BF16"]["train"], small_run_inputs, tmp_path / "p", 4, "-p", "1", "-n", "0"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "profile:" in result.stdout and "fwd attention" in result.stdout and "optimizer" in result.stdout


def test_checkpoints_kept_and_atomic(build, small_run_inputs, tmp_path):
    result = run(train_cmd(build["BF16"]["train"], small_run_inputs, tmp_path / "ck", 15, "-n", "3", "-r", "2"))
    assert result.returncode == 0, result.stdout + result.stderr
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["log.txt", "model_00000012.bin", "model_00000015.bin", "run.txt", "state_00000012.bin",
                     "state_00000015.bin"], names


BAD_FLAGS = {
    "T above max_seq_len": (["-t", "65"], "max_seq_len"),
    "batch not dividing": (["-g", "100"], "multiple"),
    "negative batch": (["-b", "-1"], "-b"),
    "unknown schedule": (["-k", "zigzag"], "-k"),
    "unknown flag": (["-Y", "1"], "-Y"),
    "not a number": (["-l", "fast"], "-l"),
    "bad optimizer state type": (["-O", "fp8"], "-O"),
    "model disagrees with config": (["-c", "d12"], "disagrees"),
    "no shards": (["-i", "/nonexistent/*.bin"], "/nonexistent"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flags_rejected(build, small_run_inputs, tmp_path, case):
    extra, word = BAD_FLAGS[case]
    result = run(train_cmd(build["BF16"]["train"], small_run_inputs, tmp_path / "bad", 2, *extra))
    assert result.returncode != 0
    assert word in result.stderr, result.stderr


@pytest.mark.parametrize("model", ["test-gqa", "test-gqa-sample", "d2", "d2-fused", "d2-fp8"])
def test_compute_sanitizer_memcheck(build, small_run_inputs, tmp_path, model):
    """test-gqa (head dim 8) runs the scalar attention kernels, d2 (head dim 64, T = 100: a ragged last tile) the
    tensor-core ones; d2-fused (256 tokens a micro-batch, F = 512: a ragged last tile column) also the w13 and w2
    products with the SwiGLU forward and backward fused on Hopper (matmul_swiglu.cuh); d2-fp8 the same in the FP8
    mode (-M fp8: casts, FP8 products and the scratch they share, matmul_fp8.cuh). test-gqa-sample samples up to
    T tokens with B = 1: the sampler's forwards on 17 to 32 tokens, where one layer's slice of the recomputed
    buffers (ln1, ln2, hact: B x T rows) holds fewer rows than two layers' (they wrote past it once)."""
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        pytest.skip("compute-sanitizer not installed")
    cmd = train_cmd(build["BF16"]["train"], small_run_inputs, tmp_path / "san", 3, "-n", "0")
    if model == "test-gqa-sample":
        cmd += ["-b", "1", "-t", "32", "-g", "32", "-s", "3", "-L", "31", "-z", str(
            export_tokenizer.write_tokenizer(tmp_path / "tok.bin", export_tokenizer.byte_pieces(259), 256, 257, 258))]
    if model == "d2":
        cmd = cmd[:1] + ["-c", "d2"] + cmd[3:] + ["-b", "2", "-t", "100", "-g", "200"]
    if model in ("d2-fused", "d2-fp8"):
        cmd = cmd[:1] + ["-c", "d2"] + cmd[3:] + ["-b", "2", "-t", "128", "-g", "256"]
    if model == "d2-fp8":
        cmd += ["-M", "fp8", "-K", "0"]
    result = run([sanitizer, "--tool", "memcheck", "--error-exitcode", "9", *cmd], timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in result.stdout + result.stderr
