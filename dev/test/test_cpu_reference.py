"""
The CPU reference against the PyTorch fixtures, and the checkpoint readers against bad input.

Runs dev/cpu/test_llama3_cpu (built by `make`) on:
  - each fixture in dev/fixtures (must pass),
  - a copy with one gradient element perturbed (must fail, naming the tensor),
  - damaged checkpoints and debug states (must exit non-zero with a message naming the file).
"""

import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = os.path.join(ROOT, "dev", "cpu", "test_llama3_cpu")
FIXTURES = os.path.join(ROOT, "dev", "fixtures")
HEADER_BYTES = 256


def run_reference(model, debug):
    if not os.path.exists(BINARY):
        pytest.fail(f"{BINARY} is missing: run `make` first")
    return subprocess.run([BINARY, str(model), str(debug)], capture_output=True, text=True, timeout=300)


def fixture(name):
    return os.path.join(FIXTURES, f"{name}_model.bin"), os.path.join(FIXTURES, f"{name}_debug.bin")


@pytest.mark.parametrize("name", ["gqa", "tied", "fp8"])
def test_fixture_ties_out(name):
    model, debug = fixture(name)
    result = run_reference(model, debug)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
    assert result.stdout.count(" OK") >= 2 + 9 + 2 * 10 - 1  # logits, loss, tensors, 10 steps


MASKED_DEBUG = os.path.join(FIXTURES, "gqa_masked_debug.bin")


def masked_targets():
    h = np.fromfile(MASKED_DEBUG, dtype=np.int32, count=64)
    n = int(h[2]) * int(h[3])
    return h, np.fromfile(MASKED_DEBUG, dtype=np.int32, count=n, offset=HEADER_BYTES + 4 * n)


def test_masked_fixture_ties_out():
    """The PyTorch reference with ignore_index=-1 (loss the mean over the unmasked targets) against the CPU
    reference: logits, loss, gradients and 10 AdamW steps."""
    h, targets = masked_targets()
    assert h[6] == 1 and 0 < (targets == -1).sum() < len(targets)  # masked, but not everything
    assert ((targets == -1) | (targets >= 0)).all()
    result = run_reference(fixture("gqa")[0], MASKED_DEBUG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
    assert result.stdout.count(" OK") == 2 + 9 + 2 * 10


def test_masked_fixture_needs_the_mask(tmp_path):
    """The mask matters: the same state with the masked targets given real ids (flag cleared) fails the loss, and
    -1 targets without the flag are rejected."""
    h, targets = masked_targets()
    n = len(targets)

    def with_targets(new_targets, flag):
        def edit(data):
            data[4 * 6:4 * 7] = struct.pack("<i", flag)
            data[HEADER_BYTES + 4 * n:HEADER_BYTES + 8 * n] = new_targets.astype("<i4").tobytes()
            return data
        return edit

    unmasked = damaged_copy(tmp_path, MASKED_DEBUG, "unmasked.bin", with_targets(np.where(targets < 0, 0, targets), 0))
    result = run_reference(fixture("gqa")[0], unmasked)
    assert result.returncode != 0
    assert any(l.startswith("loss") and l.endswith("FAIL") for l in result.stdout.splitlines()), result.stdout
    no_flag = damaged_copy(tmp_path, MASKED_DEBUG, "no_flag.bin", with_targets(targets, 0))
    result = run_reference(fixture("gqa")[0], no_flag)
    assert result.returncode != 0 and str(no_flag) in result.stderr and "token id" in result.stderr
    minus_two = damaged_copy(tmp_path, MASKED_DEBUG, "minus_two.bin", with_targets(np.where(targets < 0, -2, targets), 1))
    result = run_reference(fixture("gqa")[0], minus_two)
    assert result.returncode != 0 and str(minus_two) in result.stderr and "token id" in result.stderr


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_bf16_checkpoint_loads_close(name, tmp_path):
    """The bf16 checkpoint holds the same model rounded to bf16: the tie-out must fail (it is not exact) but
    the loader must accept it and give a loss within bf16 rounding of the fp32 one."""
    model, debug = fixture(name)
    result = run_reference(model.replace("_model.bin", "_model_bf16.bin"), debug)
    assert "Error" not in result.stderr, result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("loss"))
    got, ref = float(line.split()[2]), float(line.split()[4])
    assert abs(got - ref) < 0.05


def perturb(src, dst, offset_bytes, delta):
    shutil.copy(src, dst)
    with open(dst, "r+b") as f:
        f.seek(offset_bytes)
        (value,) = struct.unpack("<f", f.read(4))
        f.seek(offset_bytes)
        f.write(struct.pack("<f", value + delta))


def debug_layout(name):
    """Byte offsets of the sections of a fixture's debug state."""
    model, debug = fixture(name)
    mh = np.fromfile(model, dtype=np.int32, count=64)
    dh = np.fromfile(debug, dtype=np.int32, count=64)
    B, T, V = int(dh[2]), int(dh[3]), int(dh[4])
    grads = HEADER_BYTES + 4 * (2 * B * T + B * T * V + 1)
    step_losses = grads + os.path.getsize(model) - HEADER_BYTES  # the model is fp32: as many floats as gradients
    return {"grads": grads, "step_losses": step_losses, "V": V, "C": int(mh[4])}


def test_perturbed_gradient_fails(tmp_path):
    model, debug = fixture("gqa")
    layout = debug_layout("gqa")
    # one element of dattn_norm (right after the V*C embedding gradient), changed by 1e-3
    offset = layout["grads"] + 4 * (layout["V"] * layout["C"] + 5)
    bad = tmp_path / "perturbed_debug.bin"
    perturb(debug, bad, offset, 1e-3)
    result = run_reference(model, bad)
    assert result.returncode != 0
    failing = [l for l in result.stdout.splitlines() if l.endswith("FAIL")]
    assert len(failing) == 1 and failing[0].startswith("dattn_norm"), result.stdout


def test_perturbed_step_loss_fails(tmp_path):
    model, debug = fixture("tied")
    bad = tmp_path / "perturbed_debug.bin"
    perturb(debug, bad, debug_layout("tied")["step_losses"] + 4 * 7, 1e-4)  # step 8's loss, off by 1e-4
    result = run_reference(model, bad)
    assert result.returncode != 0
    failing = [l for l in result.stdout.splitlines() if l.endswith("FAIL")]
    assert len(failing) == 1 and failing[0].startswith("step 8 loss"), result.stdout


def damaged_copy(tmp_path, src, name, edit):
    data = bytearray(open(src, "rb").read())
    data = edit(data)
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def set_slot(slot, value, fmt="<i"):
    def edit(data):
        data[4 * slot:4 * slot + 4] = struct.pack(fmt, value)
        return data
    return edit


BAD_MODELS = {
    "truncated": (lambda d: d[:-7], "bytes"),
    "header_only_half": (lambda d: d[:100], "header"),
    "wrong_magic": (set_slot(0, 12345), "magic"),
    "wrong_version": (set_slot(1, 99), "version"),
    "bad_dtype": (set_slot(2, 7), "dtype"),
    "kv_heads_not_dividing": (set_slot(7, 4), "n_kv_heads"),
    "zero_layers": (set_slot(5, 0), "n_layers"),
    "negative_vocab": (set_slot(3, -5), "vocab_size"),
    "odd_head_dim": (set_slot(4, 54), "head_dim"),
    "bad_eps": (set_slot(13, -1.0, "<f"), "norm_eps"),
    "bad_tied_flag": (set_slot(10, 2), "tied_embeddings"),
    "reserved_slot_set": (set_slot(40, 1), "reserved"),
    "extra_bytes": (lambda d: d + b"\0" * 8, "bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_bad_checkpoint_rejected(case, tmp_path):
    model, debug = fixture("gqa")
    edit, expected_word = BAD_MODELS[case]
    bad = damaged_copy(tmp_path, model, f"{case}.bin", edit)
    result = run_reference(bad, debug)
    assert result.returncode != 0
    assert str(bad) in result.stderr, result.stderr
    assert expected_word in result.stderr, result.stderr


BAD_DEBUG = {
    "truncated": (lambda d: d[:-1], "bytes"),
    "wrong_magic": (set_slot(0, 1), "debug state"),
    "vocab_mismatch": (set_slot(4, 258), "vocab_size"),
    "token_out_of_range": (set_slot(64, 100000), "token id"),
    "bad_masked_flag": (set_slot(6, 2), "masked flag"),
}


@pytest.mark.parametrize("case", sorted(BAD_DEBUG))
def test_bad_debug_state_rejected(case, tmp_path):
    model, debug = fixture("gqa")
    edit, expected_word = BAD_DEBUG[case]
    bad = damaged_copy(tmp_path, debug, f"{case}.bin", edit)
    result = run_reference(model, bad)
    assert result.returncode != 0
    assert str(bad) in result.stderr, result.stderr
    assert expected_word in result.stderr, result.stderr


def test_missing_file_rejected(tmp_path):
    result = run_reference(tmp_path / "nope.bin", fixture("gqa")[1])
    assert result.returncode != 0
    assert "nope.bin" in result.stderr
