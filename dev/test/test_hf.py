"""
Hugging Face weights in and out: scripts/convert_hf.py and the C++ loader/writer llmc/hf_model.h, on the tiny
transformers fixtures in dev/fixtures (made by dev/fixtures/make_hf_fixtures.py, with transformers' logits,
gradients and AdamW steps in their *_debug.bin).

Needs numpy only (CI):
  - import with the converter, and load the directory directly in C++: the CPU reference ties out against
    transformers (logits max_rel <= 1e-4, as every tie-out); without undoing HF's q/k permutation it does not;
  - the C++ and the Python import give the same bytes; so do the C++ and the Python export;
  - HF -> ours -> HF returns bit-identical tensors (the bf16 fixture: the very file save_pretrained wrote);
  - fp16 sources; bad input (missing shard, shard vs index, truncated file, offsets past the end, dtype, config,
    extra or missing tensors), each a message naming the file and the field and a non-zero exit, in both readers.
Needs torch + transformers (skipped otherwise): the export loads with from_pretrained without warnings and gives
transformers' logits; Meta's consolidated.*.pth layout (built from a fixture) imports to the same checkpoint.
With the Llama 3 tokenizer.model (the repo's copy, or $LLAMA3_TOKENIZER) and the tokenizers package: tokenizer.json
encodes as tiktoken.
"""

import importlib.util
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "dev", "fixtures")
CPU_REFERENCE = os.path.join(ROOT, "dev", "cpu", "test_llama3_cpu")
HF_TOOL = os.path.join(ROOT, "dev", "test", "test_hf_model")
CONVERTER = os.path.join(ROOT, "scripts", "convert_hf.py")
NAMES = ["hf_gqa", "hf_tied"]

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import convert_hf  # noqa: E402


def have(*modules):
    return all(importlib.util.find_spec(m) is not None for m in modules)


def run(cmd, timeout=300):
    for binary in (CPU_REFERENCE, HF_TOOL):
        if cmd[0] == binary and not os.path.exists(binary):
            pytest.fail(f"{binary} is missing: run `make` first")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def convert(*args):
    return run([sys.executable, CONVERTER, *map(str, args)])


def hf_dir(name):
    return os.path.join(FIXTURES, name)


def debug_state(name):
    return os.path.join(FIXTURES, f"{name}_debug.bin")


def assert_ties_out(result):
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
    lines = [l for l in result.stdout.splitlines() if l.endswith(" OK")]
    assert lines[0].startswith("logits") and len(lines) >= 2 + 8 + 2 * 3, result.stdout


# ----------------------------------------------------------------------------------------------------------------
# Import: the CPU reference against transformers


@pytest.mark.parametrize("name", NAMES)
def test_converter_import_ties_out(name, tmp_path):
    out = tmp_path / "model.bin"
    result = convert("import", hf_dir(name), out)
    assert result.returncode == 0, result.stderr
    assert_ties_out(run([CPU_REFERENCE, str(out), debug_state(name)]))


@pytest.mark.parametrize("name", NAMES)
def test_cpp_loader_ties_out(name):
    assert_ties_out(run([CPU_REFERENCE, hf_dir(name), debug_state(name)]))


def test_import_without_unpermuting_fails(tmp_path, monkeypatch):
    """The tie-out can fail: keeping HF's rotate-half row order breaks the logits."""
    monkeypatch.setattr(convert_hf, "hf_to_interleaved", lambda w, n_heads: w)
    out = tmp_path / "unpermuted.bin"
    convert_hf.import_hf(hf_dir("hf_gqa"), str(out), None)
    result = run([CPU_REFERENCE, str(out), debug_state("hf_gqa")])
    assert result.returncode != 0
    assert any(l.startswith("logits") and l.endswith("FAIL") for l in result.stdout.splitlines()), result.stdout


@pytest.mark.parametrize("name", NAMES)
def test_cpp_and_python_import_agree(name, tmp_path):
    ours, theirs = tmp_path / "cpp.bin", tmp_path / "py.bin"
    result = run([HF_TOOL, "load", hf_dir(name), str(ours)])
    assert result.returncode == 0, result.stderr
    assert convert("import", hf_dir(name), theirs, "--dtype", "fp32").returncode == 0
    assert ours.read_bytes() == theirs.read_bytes()


def test_import_keeps_source_dtype(tmp_path):
    for name, code in (("hf_gqa", 0), ("hf_tied", 1)):  # fp32 source -> fp32, bf16 -> bf16
        out = tmp_path / f"{name}.bin"
        assert convert("import", hf_dir(name), out).returncode == 0
        assert int(np.fromfile(out, dtype=np.int32, count=3)[2]) == code


def read_config(name):
    with open(os.path.join(hf_dir(name), "config.json")) as f:
        return json.load(f)


def test_config_fields_map(tmp_path):
    out = tmp_path / "m.bin"
    assert convert("import", hf_dir("hf_gqa"), out).returncode == 0
    c, dtype, _ = convert_hf.read_checkpoint(str(out))
    hf = read_config("hf_gqa")
    rope = hf["rope_parameters"]
    assert (c["vocab_size"], c["dim"], c["n_layers"], c["n_heads"], c["n_kv_heads"], c["ffn_hidden"],
            c["max_seq_len"]) == (hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"],
                                  hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"],
                                  hf["max_position_embeddings"])
    assert c["tied_embeddings"] == 0 and c["use_rope_scaling"] == 1
    assert (c["norm_eps"], c["rope_theta"], c["rope_scaling_factor"], c["rope_low_freq_factor"],
            c["rope_high_freq_factor"], c["rope_original_max_seq_len"]) == (
        hf["rms_norm_eps"], rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
        rope["original_max_position_embeddings"])
    # the transformers 4.x spelling (rope_theta + rope_scaling) maps the same
    legacy = dict(hf)
    legacy.pop("rope_parameters")
    legacy["rope_theta"] = rope["rope_theta"]
    legacy["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    assert convert_hf.hf_to_config(legacy, "legacy") == convert_hf.hf_to_config(hf, "v5")


def write_fp16_copy(src, dst):
    """The fp32 fixture with every tensor stored as F16 (a valid safetensors file per shard)."""
    shutil.copytree(src, dst)
    for file in os.listdir(dst):
        if not file.endswith(".safetensors"):
            continue
        path = os.path.join(dst, file)
        st = convert_hf.SafetensorsFile(path)
        header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
        for name in sorted(st.tensors):
            _, array = st.read(name)
            blob = np.asarray(array, dtype=np.float16).tobytes()
            header[name] = {"dtype": "F16", "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
            blobs.append(blob)
            offset += len(blob)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_fp16_source(tmp_path):
    src = tmp_path / "fp16"
    write_fp16_copy(hf_dir("hf_gqa"), src)
    py, cpp = tmp_path / "py.bin", tmp_path / "cpp.bin"
    assert convert("import", src, py).returncode == 0
    assert int(np.fromfile(py, dtype=np.int32, count=3)[2]) == 0  # fp16 widens to fp32
    assert run([HF_TOOL, "load", str(src), str(cpp)]).returncode == 0
    assert py.read_bytes() == cpp.read_bytes()
    result = run([CPU_REFERENCE, str(src), debug_state("hf_gqa")])
    line = next(l for l in result.stdout.splitlines() if l.startswith("loss"))
    got, ref = float(line.split()[2]), float(line.split()[4])
    assert abs(got - ref) < 1e-2 and got != ref  # fp16 rounding: close, not exact


# ----------------------------------------------------------------------------------------------------------------
# Export and round trips


def hf_tensors_raw(directory):
    """{name: (dtype, shape, raw bytes)} of every tensor of a HF directory, read with the converter's reader."""
    out = {}
    for name, file in convert_hf.read_hf_weights(str(directory)).items():
        dtype, array = file.read(name)
        out[name] = (dtype, array.shape, np.asarray(array).tobytes())
    return out


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_bit_identical(name, tmp_path):
    model, out = tmp_path / "m.bin", tmp_path / "hf"
    assert convert("import", hf_dir(name), model).returncode == 0
    result = convert("export", model, out)
    assert result.returncode == 0, result.stderr
    assert hf_tensors_raw(out) == hf_tensors_raw(hf_dir(name))
    if name == "hf_tied":  # single-file bf16: the very bytes save_pretrained wrote
        assert (out / "model.safetensors").read_bytes() == open(os.path.join(hf_dir(name), "model.safetensors"),
                                                                "rb").read()


@pytest.mark.skipif(not have("safetensors"), reason="needs the safetensors package")
def test_export_reads_with_safetensors_library(tmp_path):
    from safetensors.numpy import load_file

    model, out = tmp_path / "m.bin", tmp_path / "hf"
    assert convert("import", hf_dir("hf_gqa"), model).returncode == 0
    assert convert("export", model, out, "--max-shard-size", "30KB").returncode == 0
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    originals = {}
    with open(os.path.join(hf_dir("hf_gqa"), "model.safetensors.index.json")) as f:
        for shard in set(json.load(f)["weight_map"].values()):
            originals.update(load_file(os.path.join(hf_dir("hf_gqa"), shard)))
    exported = {}
    for shard in sorted(set(index["weight_map"].values())):
        exported.update(load_file(out / shard))
    assert len(set(index["weight_map"].values())) > 1
    assert sorted(exported) == sorted(originals) == sorted(index["weight_map"])
    for key in originals:
        assert np.array_equal(exported[key], originals[key]), key
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in exported.values())


@pytest.mark.parametrize("dtype,shard", [("fp32", "20000"), ("bf16", "1000000000")])
def test_cpp_export_matches_python(dtype, shard, tmp_path):
    model = tmp_path / "m.bin"
    assert convert("import", hf_dir("hf_gqa"), model).returncode == 0
    py, cpp = tmp_path / "py", tmp_path / "cpp"
    assert convert("export", model, py, "--dtype", dtype, "--max-shard-size", shard).returncode == 0
    result = run([HF_TOOL, "export", str(model), str(cpp), dtype, shard])
    assert result.returncode == 0, result.stderr
    files = sorted(os.listdir(py))
    assert files == sorted(os.listdir(cpp))
    assert ("model.safetensors.index.json" in files) == (dtype == "fp32")
    for file in files:
        assert (py / file).read_bytes() == (cpp / file).read_bytes(), file


def test_export_replaces_stale_shards(tmp_path):
    model, out = tmp_path / "m.bin", tmp_path / "hf"
    assert convert("import", hf_dir("hf_gqa"), model).returncode == 0
    assert convert("export", model, out, "--max-shard-size", "20KB").returncode == 0
    assert convert("export", model, out).returncode == 0
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]


def test_export_config_reimports(tmp_path):
    model, out = tmp_path / "m.bin", tmp_path / "hf"
    assert convert("import", hf_dir("hf_tied"), model).returncode == 0
    assert convert("export", model, out).returncode == 0
    with open(out / "config.json") as f:
        exported = json.load(f)
    assert exported["rms_norm_eps"] == 1e-05 and exported["tie_word_embeddings"] is True
    assert convert_hf.hf_to_config(exported, "export") == convert_hf.hf_to_config(read_config("hf_tied"), "fixture")


# ----------------------------------------------------------------------------------------------------------------
# Bad input: both readers must stop with the file and the field named, exit 1, no signal


def copy_fixture(tmp_path, name="hf_gqa"):
    dst = tmp_path / name
    shutil.copytree(hf_dir(name), dst)
    return dst


def edit_json(path, edit):
    with open(path) as f:
        obj = json.load(f)
    edit(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


def rewrite_header(path, edit):
    """Applies edit(header dict) to a safetensors file's JSON header, keeping the data."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + n:])


def first_shard(d):
    return d / "model-00001-of-00003.safetensors"


def set_field(key, value):
    return lambda d: edit_json(d / "config.json", lambda c: c.__setitem__(key, value))


def set_rope(key, value):
    return lambda d: edit_json(d / "config.json", lambda c: c["rope_parameters"].__setitem__(key, value))


def tensor_edit(tensor, key, value):
    return lambda d: rewrite_header(first_shard(d), lambda h: h[tensor].__setitem__(key, value))


def first_tensor(d):
    return sorted(convert_hf.SafetensorsFile(str(first_shard(d))).tensors)[0]


def offsets_past_end(d):
    name = first_tensor(d)

    def edit(h):
        begin, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [begin + 10**6, end + 10**6]
    rewrite_header(first_shard(d), edit)


def wrong_dtype(d):
    name = first_tensor(d)
    rewrite_header(first_shard(d), lambda h: h[name].__setitem__("dtype", "F64"))


def index_moves_tensor(d):
    def edit(index):
        name = next(n for n, s in index["weight_map"].items() if s.startswith("model-00001"))
        index["weight_map"][name] = "model-00002-of-00003.safetensors"
    edit_json(d / "model.safetensors.index.json", edit)


def truncate(d):
    path = first_shard(d)
    data = path.read_bytes()
    path.write_bytes(data[:-100])


def huge_header_length(d):
    path = first_shard(d)
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 10**12)
    path.write_bytes(bytes(data))


def add_bias(d):
    path = first_shard(d)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    size = len(data) - 8 - n
    header["model.layers.0.self_attn.q_proj.bias"] = {"dtype": "F32", "shape": [24], "data_offsets": [size, size + 96]}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:] + b"\0" * 96)
    edit_json(d / "model.safetensors.index.json",
              lambda i: i["weight_map"].__setitem__("model.layers.0.self_attn.q_proj.bias",
                                                    "model-00001-of-00003.safetensors"))


def untie_mismatch(d):
    """hf_tied with an lm_head.weight that differs from the embedding."""
    path = d / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    emb = header["model.embed_tokens.weight"]
    size = len(data) - 8 - n
    nbytes = emb["data_offsets"][1] - emb["data_offsets"][0]
    header["lm_head.weight"] = {"dtype": emb["dtype"], "shape": emb["shape"], "data_offsets": [size, size + nbytes]}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:] + b"\x01" * nbytes)


# case: (fixture, edit, file named in the message, words the message must contain)
BAD_INPUTS = {
    "missing_shard": ("hf_gqa", lambda d: os.remove(d / "model-00002-of-00003.safetensors"),
                      "model.safetensors.index.json", ["model-00002-of-00003.safetensors", "missing"]),
    "index_disagrees": ("hf_gqa", index_moves_tensor, "model-00002-of-00003.safetensors", ["places"]),
    "truncated_file": ("hf_gqa", truncate, "model-00001-of-00003.safetensors", ["data_offsets", "truncated"]),
    "offsets_past_end": ("hf_gqa", offsets_past_end, "model-00001-of-00003.safetensors", ["data_offsets", "overflow"]),
    "header_length_past_end": ("hf_gqa", huge_header_length, "model-00001-of-00003.safetensors", ["header length"]),
    "unsupported_dtype": ("hf_gqa", wrong_dtype, "model-00001-of-00003.safetensors", ["dtype F64"]),
    "shape_disagrees": ("hf_gqa", tensor_edit("model.embed_tokens.weight", "shape", [24, 131]),
                        "model-00001-of-00003.safetensors", ["model.embed_tokens.weight"]),
    "bias_tensor": ("hf_gqa", add_bias, "model-00001-of-00003.safetensors", ["q_proj.bias", "bias"]),
    "tie_mismatch": ("hf_tied", untie_mismatch, "model.safetensors", ["tie_word_embeddings", "lm_head.weight"]),
    "missing_layer": ("hf_gqa", set_field("num_hidden_layers", 3), "hf_gqa", ["model.layers.2", "missing"]),
    "rope_type_yarn": ("hf_gqa", set_rope("rope_type", "yarn"), "config.json", ["rope_type", "yarn"]),
    "rope_field_unknown": ("hf_gqa", set_rope("mscale", 1.0), "config.json", ["mscale"]),
    "attention_bias": ("hf_gqa", set_field("attention_bias", True), "config.json", ["attention_bias"]),
    "mlp_bias": ("hf_gqa", set_field("mlp_bias", True), "config.json", ["mlp_bias"]),
    "architecture": ("hf_gqa", set_field("model_type", "mistral"), "config.json", ["model_type", "mistral"]),
    "head_dim": ("hf_gqa", set_field("head_dim", 8), "config.json", ["head_dim"]),
    "activation": ("hf_gqa", set_field("hidden_act", "gelu"), "config.json", ["hidden_act"]),
    "unknown_field": ("hf_gqa", set_field("sliding_window", 4096), "config.json", ["sliding_window"]),
    "kv_heads": ("hf_gqa", set_field("num_key_value_heads", 4), "config.json", ["n_kv_heads"]),
    "missing_field": ("hf_gqa", lambda d: edit_json(d / "config.json", lambda c: c.pop("hidden_size")),
                      "config.json", ["hidden_size"]),
    "no_weights": ("hf_tied", lambda d: os.remove(d / "model.safetensors"), "hf_tied", ["model.safetensors"]),
}


@pytest.mark.parametrize("reader", ["converter", "cpp"])
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_rejected(case, reader, tmp_path):
    fixture, edit, file, words = BAD_INPUTS[case]
    d = copy_fixture(tmp_path, fixture)
    edit(d)
    if reader == "converter":
        result = convert("import", d, tmp_path / "out.bin")
        assert not (tmp_path / "out.bin").exists()
    else:
        result = run([HF_TOOL, "load", str(d)])
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)  # an error, not a signal
    message = result.stderr.strip()
    assert message.count("\n") == 0 and "Traceback" not in message, message
    assert file in message, message
    for word in words:
        assert word in message, message


def test_cpp_tie_out_binary_rejects_bad_dir(tmp_path):
    d = copy_fixture(tmp_path)
    truncate(d)
    result = run([CPU_REFERENCE, str(d), debug_state("hf_gqa")])
    assert result.returncode == 1 and "model-00001-of-00003.safetensors" in result.stderr


def test_export_rejects_bad_checkpoint(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 300)
    result = convert("export", bad, tmp_path / "hf")
    assert result.returncode == 1 and "bad.bin" in result.stderr and "magic" in result.stderr
    result = convert("export", tmp_path / "nope.bin", tmp_path / "hf")
    assert result.returncode == 1 and "nope.bin" in result.stderr


def test_meta_params_without_factor_rejected(tmp_path):
    (tmp_path / "params.json").write_text(json.dumps(
        {"dim": 24, "n_layers": 2, "n_heads": 6, "n_kv_heads": 3, "vocab_size": 131, "multiple_of": 8,
         "norm_eps": 1e-5, "rope_theta": 10000.0, "use_scaled_rope": True}))
    result = convert("import", tmp_path, tmp_path / "m.bin")
    assert result.returncode == 1 and "params.json" in result.stderr and "rope-scaling-factor" in result.stderr


def test_meta_ffn_hidden():
    """Meta's FFN sizes of the released models from params.json's multiplier and multiple_of."""
    assert convert_hf.meta_ffn_hidden(4096, 1024, 1.3) == 14336  # Llama 3.1 8B
    assert convert_hf.meta_ffn_hidden(2048, 256, 1.5) == 8192  # Llama 3.2 1B
    assert convert_hf.meta_ffn_hidden(3072, 256, 1.0) == 8192  # Llama 3.2 3B


# ----------------------------------------------------------------------------------------------------------------
# With torch + transformers


needs_transformers = pytest.mark.skipif(not have("torch", "transformers"), reason="needs torch and transformers")


def read_debug_logits(name):
    h = np.fromfile(debug_state(name), dtype=np.int32, count=64)
    B, T, V = int(h[2]), int(h[3]), int(h[4])
    data = np.fromfile(debug_state(name), dtype=np.int32, offset=256, count=2 * B * T)
    inputs = data[:B * T].reshape(B, T)
    logits = np.fromfile(debug_state(name), dtype=np.float32, offset=256 + 8 * B * T, count=B * T * V)
    return inputs, logits.reshape(B, T, V)


@needs_transformers
@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers(name, tmp_path):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model, out = tmp_path / "m.bin", tmp_path / "hf"
    assert convert("import", hf_dir(name), model).returncode == 0
    assert convert("export", model, out).returncode == 0
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.logging.get_logger()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    finally:
        logger.removeHandler(handler)
    problems = [r.getMessage() for r in records if r.levelno >= logging.WARNING] + [str(w.message) for w in caught]
    assert not problems, problems
    inputs, expected = read_debug_logits(name)
    with torch.no_grad():
        logits = hf(input_ids=torch.from_numpy(inputs).long()).logits.numpy()
    np.testing.assert_array_equal(logits, expected)  # the same weights, the same computation


def write_meta_layout(model_bin, out_dir, n_shards):
    """Meta's consolidated.*.pth + params.json from our checkpoint, split as Meta's model parallelism splits:
    column-parallel weights (wq wk wv w1 w3 output tok_embeddings) by rows, row-parallel (wo w2) by columns."""
    import torch

    c, dtype, t = convert_hf.read_checkpoint(str(model_bin))
    H, KV, F = c["n_heads"], c["n_kv_heads"], c["ffn_hidden"]
    hd = c["dim"] // H
    tensor = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))
    shards = [{} for _ in range(n_shards)]

    def put(name, array, dim):
        for k, part in enumerate(np.array_split(np.asarray(array), n_shards, axis=dim) if dim is not None
                                 else [array] * n_shards):
            shards[k][name] = tensor(part)

    put("tok_embeddings.weight", t["tok_embedding"], 0)
    for i in range(c["n_layers"]):
        p = f"layers.{i}."
        wqkv, w13 = t["wqkv"][i], t["w13"][i]
        put(p + "attention.wq.weight", wqkv[:H * hd], 0)
        put(p + "attention.wk.weight", wqkv[H * hd:(H + KV) * hd], 0)
        put(p + "attention.wv.weight", wqkv[(H + KV) * hd:], 0)
        put(p + "attention.wo.weight", t["wo"][i], 1)
        put(p + "feed_forward.w1.weight", w13[:F], 0)
        put(p + "feed_forward.w3.weight", w13[F:], 0)
        put(p + "feed_forward.w2.weight", t["w2"][i], 1)
        put(p + "attention_norm.weight", t["attn_norm"][i], None)
        put(p + "ffn_norm.weight", t["ffn_norm"][i], None)
    put("norm.weight", t["final_norm"], None)
    put("output.weight", t["tok_embedding"] if c["tied_embeddings"] else t["lm_head"], 0)
    os.makedirs(out_dir, exist_ok=True)
    for k, shard in enumerate(shards):
        torch.save(shard, os.path.join(out_dir, f"consolidated.{k:02d}.pth"))
    base = int(2 * 4 * c["dim"] / 3)
    params = {"dim": c["dim"], "n_layers": c["n_layers"], "n_heads": H, "n_kv_heads": KV,
              "vocab_size": c["vocab_size"], "multiple_of": 1, "ffn_dim_multiplier": (F + 0.5) / base,
              "norm_eps": c["norm_eps"], "rope_theta": c["rope_theta"], "use_scaled_rope": bool(c["use_rope_scaling"])}
    with open(os.path.join(out_dir, "params.json"), "w") as f:
        json.dump(params, f)
    return c


@needs_transformers
@pytest.mark.parametrize("name", NAMES)
def test_meta_layout_import(name, tmp_path):
    """Meta's layout of the fixture (2 model-parallel shards) imports to the same checkpoint as the HF directory,
    given the rope settings Meta's params.json leaves out."""
    from_hf = tmp_path / "hf.bin"
    assert convert("import", hf_dir(name), from_hf, "--dtype", "fp32").returncode == 0
    c = write_meta_layout(from_hf, tmp_path / "meta", 2)
    from_meta = tmp_path / "meta.bin"
    result = convert("import", tmp_path / "meta", from_meta, "--rope-scaling-factor", str(c["rope_scaling_factor"]),
                     "--max-seq-len", str(c["max_seq_len"]))
    assert result.returncode == 0, result.stderr
    a, b = from_hf.read_bytes(), from_meta.read_bytes()
    header_a, header_b = np.frombuffer(a[:256], np.int32).copy(), np.frombuffer(b[:256], np.int32).copy()
    assert header_b[12] == 8192  # Meta's apply_scaling fixes the original context; the fixtures use a shorter one
    header_b[12] = header_a[12]
    assert np.array_equal(header_a, header_b)
    assert a[256:] == b[256:]


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer files


def tokenizer_model():
    return os.environ.get("LLAMA3_TOKENIZER") or os.path.join(ROOT, "dev", "data", "llama3", "tokenizer.model")


needs_tokenizer = pytest.mark.skipif(not have("tokenizers", "tiktoken"), reason="needs the tokenizers and tiktoken packages")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    result = convert("tokenizer", tokenizer_model(), out)
    assert result.returncode == 0, result.stderr
    return out


TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "Numbers 1234567 and 3.14159, dates 2024-01-31; money $1,000,000.",
    "Contractions: I'm, you're, they've, he'd, we'll, it's, DON'T.",
    "Unicode: naïve café, Ελληνικά, русский, 日本語のテキスト, emoji 🙂🚀, Ω≈ç√∫",
    "Whitespace\n\n\tmixed  \r\n   runs\n",
    "code: def f(x):\n    return x**2  # square\n",
]


@needs_tokenizer
def test_tokenizer_json_matches_tiktoken(tokenizer_dir):
    sys.path.insert(0, os.path.join(ROOT, "dev", "data"))
    from llama3_tokenizer import Llama3Tokenizer
    from tokenizers import Tokenizer

    ours = Llama3Tokenizer(tokenizer_model())
    hf = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = list(TEXTS)
    corpus = os.environ.get("TINYSHAKESPEARE_TXT") or os.path.join(ROOT, "dev", "data", "tinyshakespeare.txt")
    with open(corpus) as f:
        text = f.read()
    texts += [text[i:i + 2000] for i in range(0, len(text), 50000)]
    for text in texts:
        assert hf.encode(text, add_special_tokens=False).ids == ours.encode(text), text[:80]
        assert hf.encode(text).ids == ours.encode(text, bos=True)
    # special tokens are matched in text, as transformers users expect
    assert hf.encode("<|start_header_id|>user<|end_header_id|>", add_special_tokens=False).ids[0] == 128006
    assert hf.token_to_id("<|eot_id|>") == 128009 and hf.get_vocab_size() == 128256
    assert hf.decode(ours.encode(TEXTS[4])) == TEXTS[4]


@needs_tokenizer
@needs_transformers
def test_chat_template_and_tokenizer_config(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.bos_token_id == 128000 and tok.eos_token_id == 128009


def test_released_llama32_config_maps():
    """config.json as Meta's Llama-3.2-1B-Instruct ships it (transformers 4.x form) maps to our llama3.2-1B."""
    released = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
    c = convert_hf.hf_to_config(released, "config.json")
    assert c == dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                     max_seq_len=131072, tied_embeddings=1, norm_eps=1e-5, rope_theta=500000.0, use_rope_scaling=1,
                     rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_seq_len=8192)
    exported = convert_hf.config_to_hf(c, "bf16")
    assert {k: exported[k] for k in released if k != "transformers_version"} == {
        k: v for k, v in released.items() if k != "transformers_version"}


@needs_tokenizer
@needs_transformers
def test_full_vocab_export_generates_with_chat_template(tmp_path):
    """A random model with the Llama 3 vocab, exported with the tokenizer: transformers loads model and tokenizer
    without warnings, renders the chat template and generates."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers_quiet import loads_without_warnings

    c = dict(vocab_size=128256, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=256,
             tied_embeddings=1, use_rope_scaling=1, rope_original_max_seq_len=64, norm_eps=1e-5, rope_theta=500000.0,
             rope_scaling_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0)
    rng = np.random.default_rng(0)

    def random_parts(name, shape):
        array = rng.normal(1.0 if "norm" in name else 0.0, 0.02, shape).astype(np.float32)
        return lambda: list(array) if name in convert_hf.LAYER_TENSORS else [array]

    tensors = {name: random_parts(name, shape) for name, shape in convert_hf.config_shapes(c).items()}
    model_bin, out = tmp_path / "m.bin", tmp_path / "hf"
    convert_hf.write_checkpoint(str(model_bin), c, "fp32", tensors, "test")
    result = convert("export", model_bin, out, "--dtype", "bf16", "--tokenizer", tokenizer_model())
    assert result.returncode == 0, result.stderr
    with loads_without_warnings():
        model = AutoModelForCausalLM.from_pretrained(out)
        tok = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.eos_token_id == [128001, 128008, 128009]
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert ids[0, 0].item() == 128000 and ids[0, -1].item() == 271  # "\n\n" after the assistant header
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5 or int(generated[0, -1]) in (128001, 128008, 128009)
    assert isinstance(tok.decode(generated[0]), str)
