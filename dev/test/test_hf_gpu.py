"""
GPU tests of the Hugging Face path: the FP32 CUDA build loads HF directories directly (test_llama3cu DIR) and ties
out against transformers, and train_llama3cu trains from a HF directory and exports one (-X).
Skipped when no GPU is present (CI has none); the ones that build a model with transformers also need torch.

  - the committed fixtures (dev/fixtures/hf_gqa, hf_tied) against their transformers debug states;
  - a Llama 3.2 1B-shaped model at depth 2 (dim 2048, 32 heads, 8 kv heads, vocab 128256, tied, RoPE scaling x32)
    made by transformers at test time, saved in bf16 in several shards (dev/fixtures/make_hf_fixtures.py);
  - -e HF_DIR ... -X OUT: the export holds exactly the trainer's final checkpoint, and transformers loads it
    without warnings and generates.
"""

import importlib.util
import glob
import os
import subprocess
import sys

import numpy as np
import pytest
from gpu_common import build_binaries, requires_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "dev", "fixtures")


pytestmark = requires_gpu
needs_transformers = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")), reason="needs torch and transformers")


def run(cmd, timeout=900):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def fp32_build(tmp_path_factory):
    return build_binaries(str(tmp_path_factory.mktemp("bin_hf")), precisions=("FP32",))["FP32"]


def assert_ties_out(result):
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout


@pytest.mark.parametrize("name", ["hf_gqa", "hf_tied"])
def test_fixture_dir_ties_out(fp32_build, name):
    assert_ties_out(run([fp32_build["test"], os.path.join(FIXTURES, name), os.path.join(FIXTURES, f"{name}_debug.bin")]))


@needs_transformers
def test_llama32_shaped_dir_ties_out(fp32_build, tmp_path):
    sys.path.insert(0, os.path.join(FIXTURES))
    import torch
    from make_hf_fixtures import make

    spec = dict(config=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                            rms_norm_eps=1e-5, tie_word_embeddings=True,
                            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=8192)),
                dtype=torch.bfloat16, max_shard_size="200MB", seed=3, lr=1e-5)
    make("llama32_d2", spec, str(tmp_path))
    assert os.path.exists(tmp_path / "llama32_d2" / "model.safetensors.index.json")
    assert_ties_out(run([fp32_build["test"], tmp_path / "llama32_d2", tmp_path / "llama32_d2_debug.bin"]))


def write_shard(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240801, 7, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint32).tobytes())


def test_train_from_hf_dir_and_export(fp32_build, tmp_path):
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "train.bin", rng.integers(0, 131, size=20000))
    write_shard(tmp_path / "val.bin", rng.integers(0, 131, size=4000))
    out, export = tmp_path / "run", tmp_path / "export"
    result = run([fp32_build["train"], "-e", os.path.join(FIXTURES, "hf_gqa"), "-i", tmp_path / "train.bin",
                  "-j", tmp_path / "val.bin", "-o", out, "-b", "4", "-t", "32", "-x", "5", "-l", "1e-3", "-v", "5",
                  "-m", "2", "-n", "5", "-X", export])
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exported" in result.stdout
    # the export holds the final checkpoint's parameters, in the HF layout
    final = sorted(glob.glob(str(out / "model_*.bin")))[-1]
    again = tmp_path / "again"
    result = run([sys.executable, "scripts/convert_hf.py", "export", final, again])
    assert result.returncode == 0, result.stderr
    for file in sorted(os.listdir(again)):
        assert (again / file).read_bytes() == (export / file).read_bytes(), file

    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        pytest.skip("transformers check needs torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers_quiet import loads_without_warnings

    with loads_without_warnings():
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    generated = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 11) and int(generated.max()) < 131
