"""
What the GPU test files share: whether this machine has GPUs and PyTorch, and the CUDA binaries, built into a
temporary directory from a copy of the sources (so a test run never rebuilds the binaries in the repo root under the
user).
"""

import importlib.util
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return out.stdout.count("GPU ") if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        return 0


requires_gpu = pytest.mark.skipif(gpu_count() == 0, reason="no GPU on this machine")


def compute_capability():
    """The first GPU's compute capability as "major.minor", or None where nvidia-smi names none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


# -M fp8 runs on FP8 tensor cores: compute capability 8.9 (Ada) or later. Without a GPU requires_gpu skips first.
_capability = compute_capability()
requires_fp8_tensor_cores = pytest.mark.skipif(
    _capability is not None and tuple(map(int, _capability.split("."))) < (8, 9),
    reason=f"-M fp8 needs FP8 tensor cores (compute capability 8.9 or later), this GPU's is {_capability}")


def skip_without_torch():
    """For fixtures that run scripts/train_llama3.py: skips the tests that use them where PyTorch is missing."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs PyTorch (scripts/train_llama3.py writes the reference)")


def copy_sources(dst):
    """A copy of the repo's sources at dst (no .git, build outputs, data or runs), to run make targets in."""
    top_level_outputs = {".git", ".venv", "data", "runs", "out", ".devdata", "train_llama3cu", "test_llama3cu"}
    ignore = lambda folder, names: [n for n in names if (os.path.samefile(folder, ROOT) and n in top_level_outputs)
                                    or n in ("bin", "__pycache__", ".pytest_cache") or n.startswith(".precision_")
                                    or n.startswith(".use_mpi_")]
    shutil.copytree(ROOT, dst, ignore=ignore)
    return str(dst)


def build_binaries(out_dir, precisions=("FP32", "BF16"), targets=("train", "test"), make_flags=()):
    """{precision: {target: path}}: make's <target>_llama3cu for each precision, each precision in its own copy of the
    sources (out_dir/src_<precision>) and all of them at once (each is one nvcc process), moved to
    out_dir/<target>_llama3cu_<precision>."""
    builds = {}
    for precision in precisions:
        src = os.path.join(out_dir, f"src_{precision}")
        os.makedirs(src, exist_ok=True)
        for name in ("Makefile", "train_llama3.cu", "test_llama3.cu"):
            shutil.copy(os.path.join(ROOT, name), os.path.join(src, name))
        for folder in ("llmc", ".deps"):  # .deps: nlohmann/json where apt is out of reach (make deps)
            if os.path.isdir(os.path.join(ROOT, folder)):
                shutil.copytree(os.path.join(ROOT, folder), os.path.join(src, folder), dirs_exist_ok=True)
        builds[precision] = (src, subprocess.Popen(["make", *[f"{t}_llama3cu" for t in targets],
                                                    f"PRECISION={precision}", *make_flags], cwd=src,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    bins = {}
    for precision, (src, process) in builds.items():
        output, _ = process.communicate()
        assert process.returncode == 0, f"make PRECISION={precision} failed:\n{output}"
        bins[precision] = {}
        for t in targets:
            dst = os.path.join(out_dir, f"{t}_llama3cu_{precision}")
            shutil.move(os.path.join(src, f"{t}_llama3cu"), dst)
            bins[precision][t] = dst
    return bins
