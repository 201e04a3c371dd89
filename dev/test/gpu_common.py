"""
What the GPU test files share: whether this machine has GPUs, and the CUDA binaries, built into a temporary directory
from a copy of the sources (so a test run never rebuilds the binaries in the repo root under the user).
"""

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


def build_binaries(out_dir, precisions=("FP32", "BF16"), targets=("train", "test"), make_flags=()):
    """{precision: {target: path}}: make's <target>_llama3cu for each precision, in out_dir/src (a copy of the
    sources), moved to out_dir/<target>_llama3cu_<precision>."""
    src = os.path.join(out_dir, "src")
    os.makedirs(src, exist_ok=True)
    for name in ("Makefile", "train_llama3.cu", "test_llama3.cu"):
        shutil.copy(os.path.join(ROOT, name), os.path.join(src, name))
    for folder in ("llmc", ".deps"):  # .deps: nlohmann/json where apt is out of reach (make deps)
        if os.path.isdir(os.path.join(ROOT, folder)):
            shutil.copytree(os.path.join(ROOT, folder), os.path.join(src, folder), dirs_exist_ok=True)
    bins = {}
    for precision in precisions:
        result = subprocess.run(["make", *[f"{t}_llama3cu" for t in targets], f"PRECISION={precision}", *make_flags],
                                cwd=src, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        bins[precision] = {}
        for t in targets:
            dst = os.path.join(out_dir, f"{t}_llama3cu_{precision}")
            shutil.move(os.path.join(src, f"{t}_llama3cu"), dst)
            bins[precision][t] = dst
    return bins
