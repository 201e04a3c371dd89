"""
The dev/cuda kernel checks on a GPU: every dev/cuda/<kernel>.cu program in both precisions (bin/<kernel>, the bf16
build, and bin/<kernel>_fp32), each of which validates its kernel versions against the CPU reference before timing
them and exits non-zero when one is off. `make -C dev/cuda run_all` runs the same programs by hand.

Built in a temporary copy of dev/cuda and llmc/ (the repo's dev/cuda/bin stays as it is). Skipped without a GPU.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from gpu_common import ROOT, requires_gpu

pytestmark = requires_gpu

# every program; attention_lib.cu is a library (attention_vs_pytorch.py's), whose kernels attention_*.cu check
KERNELS = sorted(p.stem for p in Path(ROOT, "dev", "cuda").glob("*.cu") if p.stem != "attention_lib")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    shutil.copytree(Path(ROOT, "llmc"), out / "llmc")
    shutil.copytree(Path(ROOT, "dev", "cpu"), out / "dev" / "cpu")  # the CPU reference the checks compare against
    shutil.copytree(Path(ROOT, "dev", "cuda"), out / "dev" / "cuda", ignore=shutil.ignore_patterns("bin"))
    cuda_dir = out / "dev" / "cuda"
    # matmul_cutlass.cu's headers: fetched once into the repo's .deps/ (a carried copy is used as it is)
    fetch = subprocess.run(["make", "cutlass"], cwd=ROOT, capture_output=True, text=True)
    assert fetch.returncode == 0, fetch.stdout[-4000:] + fetch.stderr[-4000:]
    cutlass_dir = Path(ROOT, ".deps", "cutlass", "cutlass_library", "source")
    result = subprocess.run(["make", "-j", str(os.cpu_count() or 4), "all", f"CUTLASS_DIR={cutlass_dir}"],
                            cwd=cuda_dir, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return cuda_dir


@pytest.mark.parametrize("precision", ["BF16", "FP32"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel(kernel_dir, kernel, precision):
    binary = kernel_dir / "bin" / (kernel if precision == "BF16" else f"{kernel}_fp32")
    result = subprocess.run([str(binary)], cwd=kernel_dir, capture_output=True, text=True, timeout=1200)
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
