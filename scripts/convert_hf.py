"""
Converts Llama 3 weights between Hugging Face or Meta checkpoints and our checkpoint format (llmc/checkpoint.h).

  # a Hugging Face model directory: config.json + model.safetensors, or shards + model.safetensors.index.json
  python scripts/convert_hf.py import path/to/Llama-3.2-1B out/llama3.2-1B.bin
  # Meta's original layout: params.json + consolidated.00.pth ... (reading .pth needs torch)
  python scripts/convert_hf.py import path/to/Llama3.2-1B/original out/llama3.2-1B.bin --rope-scaling-factor 32
  # our checkpoint back to a Hugging Face directory, with the tokenizer files
  python scripts/convert_hf.py export out/model.bin out/hf --tokenizer tokenizer.model
  # only the tokenizer files (tokenizer.json, tokenizer_config.json) into a directory
  python scripts/convert_hf.py tokenizer tokenizer.model out/hf

Layouts. Hugging Face's LlamaForCausalLM keeps one tensor per projection per layer (q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj and the two norms) and stores the rows of each head of q_proj and k_proj permuted for
its rotate-half RoPE: HF row p * hd/2 + i of a head holds row 2i + p (p = 0, 1), the interleaved pair that our RoPE
(and Meta's) rotates. Import gathers the projections into our fused, layer-stacked tensors (wqkv rows = q heads |
k heads | v heads, w13 rows = gate | up) with that permutation undone; export splits them and redoes it. Meta's
consolidated.*.pth are in our RoPE order already; with several shards the column-parallel weights (wq, wk, wv, w1,
w3, output, tok_embeddings) are split by rows and the row-parallel ones (wo, w2) by columns.

Tensors move as raw bits (bf16 as uint16), so HF -> ours -> HF returns bit-identical tensors in the source's dtype;
fp16 is widened to fp32 exactly. Reading and writing safetensors needs numpy only: the format is an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}
and the data, offsets counted from the end of the header.

Anything our model cannot represent (another architecture or rope_type, biases, a head_dim other than dim / heads,
quantization, ...) stops the conversion with a message naming the file and the field.
"""

import argparse
import json
import math
import os
import re
import struct
import sys

import numpy as np

CHECKPOINT_MAGIC = 20261121
CHECKPOINT_VERSION = 1
HEADER_SLOTS = 64
DTYPE_CODES = {"fp32": 0, "bf16": 1}
TENSOR_NAMES = ["tok_embedding", "attn_norm", "wqkv", "wo", "ffn_norm", "w13", "w2", "final_norm", "lm_head"]

# safetensors dtype -> (numpy type that holds the raw bits, our dtype after import)
SAFETENSORS_DTYPES = {"F32": (np.float32, "fp32"), "BF16": (np.uint16, "bf16"), "F16": (np.float16, "fp32")}
DEFAULT_MAX_SHARD = "5GB"

LLAMA3_VOCAB = 128256
BOS_ID, END_OF_TEXT_ID, EOM_ID, EOT_ID = 128000, 128001, 128008, 128009


class ConvertError(Exception):
    """A bad or unsupported input; the message names the file and the field."""


# ----------------------------------------------------------------------------------------------------------------
# Our checkpoint


def config_shapes(c):
    """Shape of each tensor of our checkpoint, in file order (lm_head only when untied)."""
    V, C, L, F = c["vocab_size"], c["dim"], c["n_layers"], c["ffn_hidden"]
    hd = C // c["n_heads"]
    qkv = (c["n_heads"] + 2 * c["n_kv_heads"]) * hd
    shapes = {"tok_embedding": (V, C), "attn_norm": (L, C), "wqkv": (L, qkv, C), "wo": (L, C, c["n_heads"] * hd),
              "ffn_norm": (L, C), "w13": (L, 2 * F, C), "w2": (L, C, F), "final_norm": (C,), "lm_head": (V, C)}
    if c["tied_embeddings"]:
        del shapes["lm_head"]
    return shapes


def check_config(c, where):
    """The structural rules of llmc/model.h config_error that the converter relies on."""
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
        if not isinstance(c[key], int) or c[key] < 1:
            raise ConvertError(f"{where}: {key} = {c[key]!r} is not a positive integer")
    if c["dim"] % c["n_heads"] != 0:
        raise ConvertError(f"{where}: n_heads {c['n_heads']} does not divide dim {c['dim']}")
    if (c["dim"] // c["n_heads"]) % 2 != 0:
        raise ConvertError(f"{where}: head_dim {c['dim'] // c['n_heads']} is odd (RoPE rotates pairs)")
    if c["n_heads"] % c["n_kv_heads"] != 0:
        raise ConvertError(f"{where}: n_kv_heads {c['n_kv_heads']} does not divide n_heads {c['n_heads']}")


def checkpoint_header(c, dtype):
    h = np.zeros(HEADER_SLOTS, dtype=np.int32)
    h[0:13] = [CHECKPOINT_MAGIC, CHECKPOINT_VERSION, DTYPE_CODES[dtype], c["vocab_size"], c["dim"], c["n_layers"],
               c["n_heads"], c["n_kv_heads"], c["ffn_hidden"], c["max_seq_len"], c["tied_embeddings"],
               c["use_rope_scaling"], c["rope_original_max_seq_len"]]
    floats = [c["norm_eps"], c["rope_theta"], c["rope_scaling_factor"], c["rope_low_freq_factor"],
              c["rope_high_freq_factor"]]
    h[13:18] = np.array(floats, dtype=np.float32).view(np.int32)
    return h


def short_float(x):
    """The shortest decimal that reads back as the same float32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def read_checkpoint(path):
    """(config, dtype, {name: array}) of our checkpoint; arrays are float32 or uint16 (bf16 bits), memory-mapped."""
    size = os.path.getsize(path)
    if size < 4 * HEADER_SLOTS:
        raise ConvertError(f"{path}: {size} bytes, shorter than the {4 * HEADER_SLOTS}-byte header (truncated?)")
    h = np.fromfile(path, dtype=np.int32, count=HEADER_SLOTS)
    if h[0] != CHECKPOINT_MAGIC or h[1] != CHECKPOINT_VERSION:
        raise ConvertError(f"{path}: not a version {CHECKPOINT_VERSION} Llama 3 checkpoint (magic {h[0]}, version {h[1]})")
    if h[2] not in (0, 1):
        raise ConvertError(f"{path}: dtype {h[2]}, expected 0 (fp32) or 1 (bf16)")
    f32 = h[13:18].view(np.float32)
    c = dict(vocab_size=int(h[3]), dim=int(h[4]), n_layers=int(h[5]), n_heads=int(h[6]), n_kv_heads=int(h[7]),
             ffn_hidden=int(h[8]), max_seq_len=int(h[9]), tied_embeddings=int(h[10]), use_rope_scaling=int(h[11]),
             rope_original_max_seq_len=int(h[12]), norm_eps=short_float(f32[0]), rope_theta=short_float(f32[1]),
             rope_scaling_factor=short_float(f32[2]), rope_low_freq_factor=short_float(f32[3]),
             rope_high_freq_factor=short_float(f32[4]))
    check_config(c, path)
    dtype = "fp32" if h[2] == 0 else "bf16"
    np_type = np.float32 if dtype == "fp32" else np.uint16
    shapes = config_shapes(c)
    expected = 4 * HEADER_SLOTS + sum(math.prod(s) for s in shapes.values()) * np.dtype(np_type).itemsize
    if size != expected:
        raise ConvertError(f"{path}: {size} bytes, but its header ({dtype}, V={c['vocab_size']} C={c['dim']} "
                           f"L={c['n_layers']}) implies {expected}")
    data = np.memmap(path, dtype=np_type, mode="r", offset=4 * HEADER_SLOTS)
    tensors, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        tensors[name] = data[offset:offset + n].reshape(shape)
        offset += n
    return c, dtype, tensors


def write_atomic(path, write):
    """Calls write(file) on path.tmp, then renames it over path, so a failure never leaves a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


LAYER_TENSORS = {"attn_norm", "wqkv", "wo", "ffn_norm", "w13", "w2"}


def write_checkpoint(path, c, dtype, tensors, source):
    """tensors: {name: callable giving the tensor's parts in `dtype`}: one part per layer for the layer-stacked
    tensors, else the whole tensor. Written one part at a time, so only one layer's tensor is in memory."""
    shapes = config_shapes(c)

    def write(f):
        f.write(checkpoint_header(c, dtype).tobytes())
        for name, shape in shapes.items():
            part_shape, count = (shape[1:], shape[0]) if name in LAYER_TENSORS else (shape, 1)
            parts = 0
            for part in tensors[name]():
                if part.shape != part_shape:
                    raise ConvertError(f"{source}: {name} (layer {parts}) has shape {list(part.shape)}, the config "
                                       f"implies {list(part_shape)}")
                f.write(np.ascontiguousarray(part).tobytes())
                parts += 1
            assert parts == count, (name, parts, count)

    write_atomic(path, write)


# ----------------------------------------------------------------------------------------------------------------
# dtypes: arrays hold raw bits (float32, uint16 for bf16, float16)


def bf16_bits_to_fp32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16_bits(x):
    """Round to nearest even, NaN kept NaN (as torch and llmc/checkpoint.h do)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def convert_bits(array, src, dst):
    """src: a safetensors dtype (F32, BF16, F16) or ours (fp32, bf16); dst: fp32 or bf16."""
    src = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}.get(src, src)
    if src == dst:
        return array
    fp32 = bf16_bits_to_fp32(array) if src == "bf16" else array.astype(np.float32)
    return fp32 if dst == "fp32" else fp32_to_bf16_bits(fp32)


# ----------------------------------------------------------------------------------------------------------------
# RoPE row order


def hf_to_interleaved(w, n_heads):
    """Rows of q_proj/k_proj (n_heads * hd, C) from HF's rotate-half order to interleaved pairs."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def interleaved_to_hf(w, n_heads):
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


# ----------------------------------------------------------------------------------------------------------------
# safetensors files


class SafetensorsFile:
    """The header of one .safetensors file, validated against the file size; tensors read on demand."""

    def __init__(self, path):
        self.path = path
        if not os.path.isfile(path):
            raise ConvertError(f"{path}: file not found")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise ConvertError(f"{path}: header length {header_len} runs past the end of the {size}-byte file "
                                   f"(truncated?)")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, ValueError) as e:
                raise ConvertError(f"{path}: the header is not valid JSON ({e})")
        if not isinstance(header, dict):
            raise ConvertError(f"{path}: the header is not a JSON object")
        self.data_start = 8 + header_len
        data_bytes = size - self.data_start
        self.tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
                begin, end = int(begin), int(end)
            except (KeyError, TypeError, ValueError):
                raise ConvertError(f"{path}: tensor '{name}' has a malformed header entry {info!r}")
            if dtype not in SAFETENSORS_DTYPES:
                raise ConvertError(f"{path}: tensor '{name}' has dtype {dtype}; supported: "
                                   f"{', '.join(SAFETENSORS_DTYPES)}")
            nbytes = math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[dtype][0]).itemsize
            if not 0 <= begin <= end <= data_bytes:
                raise ConvertError(f"{path}: tensor '{name}' data_offsets [{begin}, {end}] overflow the file's "
                                   f"{data_bytes} data bytes (truncated?)")
            if end - begin != nbytes:
                raise ConvertError(f"{path}: tensor '{name}' data_offsets span {end - begin} bytes, but shape "
                                   f"{shape} in {dtype} needs {nbytes}")
            self.tensors[name] = (dtype, tuple(shape), begin)

    def read(self, name):
        """(safetensors dtype, array of raw bits)."""
        dtype, shape, begin = self.tensors[name]
        np_type = SAFETENSORS_DTYPES[dtype][0]
        array = np.memmap(self.path, dtype=np_type, mode="r", offset=self.data_start + begin, shape=shape)
        return dtype, array


def read_hf_weights(src):
    """{tensor name: SafetensorsFile holding it} for a HF directory, single-file or sharded with an index."""
    index_path = os.path.join(src, "model.safetensors.index.json")
    single = os.path.join(src, "model.safetensors")
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConvertError(f"{index_path}: not a safetensors index with a weight_map ({e!r})")
        files = {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(src, shard)
            if not os.path.isfile(path):
                listed = [n for n, s in weight_map.items() if s == shard]
                raise ConvertError(f"{index_path}: shard '{shard}' (holding {listed[0]} and {len(listed) - 1} more) "
                                   f"is missing")
            files[shard] = SafetensorsFile(path)
        where = {}
        for name, shard in weight_map.items():
            if name not in files[shard].tensors:
                raise ConvertError(f"{os.path.join(src, shard)}: has no tensor '{name}', which {index_path} "
                                   f"places there")
            where[name] = files[shard]
        for shard, file in files.items():
            for name in file.tensors:
                if weight_map.get(name) != shard:
                    raise ConvertError(f"{file.path}: holds tensor '{name}', which {index_path} does not place "
                                       f"in this shard")
        return where
    if os.path.isfile(single):
        file = SafetensorsFile(single)
        return {name: file for name in file.tensors}
    raise ConvertError(f"{src}: no model.safetensors or model.safetensors.index.json")


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face config.json <-> our config

# config.json fields that do not change the computation (generation defaults, bookkeeping)
HF_IGNORED_FIELDS = {
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
    "transformers_version", "use_cache", "initializer_range", "_name_or_path", "output_attentions",
    "output_hidden_states", "return_dict", "tokenizer_class", "id2label", "label2id", "torchscript",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "problem_type", "task_specific_params", "prefix", "sep_token_id", "decoder_start_token_id", "finetuning_task",
}
HF_ROPE_FIELDS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings"}


def hf_to_config(cfg, where):
    """Our config from a HF LlamaConfig dict; raises naming the field for anything we cannot represent."""
    def need(key):
        if key not in cfg:
            raise ConvertError(f"{where}: missing field '{key}'")
        return cfg[key]

    def must_be(key, allowed, default):
        value = cfg.get(key, default)
        if value not in allowed:
            raise ConvertError(f"{where}: {key} = {value!r} is not supported (only {allowed})")

    must_be("model_type", ["llama"], None)
    if "architectures" in cfg and cfg["architectures"] != ["LlamaForCausalLM"]:
        raise ConvertError(f"{where}: architectures = {cfg['architectures']!r} is not supported "
                           f"(only ['LlamaForCausalLM'])")
    must_be("hidden_act", ["silu"], "silu")
    must_be("attention_bias", [False], False)
    must_be("mlp_bias", [False], False)
    must_be("pretraining_tp", [1], 1)
    must_be("attention_dropout", [0, 0.0], 0.0)
    must_be("quantization_config", [None], None)
    c = dict(vocab_size=need("vocab_size"), dim=need("hidden_size"), n_layers=need("num_hidden_layers"),
             n_heads=need("num_attention_heads"), ffn_hidden=need("intermediate_size"),
             max_seq_len=need("max_position_embeddings"))
    c["n_kv_heads"] = cfg.get("num_key_value_heads") or c["n_heads"]
    check_config(c, where)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != c["dim"] // c["n_heads"]:
        raise ConvertError(f"{where}: head_dim = {head_dim} is not hidden_size / num_attention_heads = "
                           f"{c['dim'] // c['n_heads']}")
    tied = cfg.get("tie_word_embeddings", False)
    if tied not in (True, False):
        raise ConvertError(f"{where}: tie_word_embeddings = {tied!r} is not true or false")
    c["tied_embeddings"] = int(tied)
    c["norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))

    # transformers 4.x writes rope_theta and rope_scaling; 5.x one rope_parameters block with rope_theta inside
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if not isinstance(rope, dict):
        raise ConvertError(f"{where}: {rope_key} = {rope!r} is not an object")
    for key in rope:
        if key not in HF_ROPE_FIELDS:
            raise ConvertError(f"{where}: {rope_key}.{key} is not supported (Llama 3 RoPE has only "
                               f"{sorted(HF_ROPE_FIELDS)})")
    c["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in rope:
                raise ConvertError(f"{where}: {rope_key} has rope_type llama3 but no '{key}'")
        c.update(use_rope_scaling=1, rope_scaling_factor=float(rope["factor"]),
                 rope_low_freq_factor=float(rope["low_freq_factor"]),
                 rope_high_freq_factor=float(rope["high_freq_factor"]),
                 rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
    elif rope_type == "default":
        c.update(use_rope_scaling=0, rope_scaling_factor=1.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_seq_len=0)
    else:
        raise ConvertError(f"{where}: {rope_key}.rope_type = {rope_type!r} is not supported (only 'default' and "
                           f"'llama3')")
    known = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "max_position_embeddings", "head_dim", "tie_word_embeddings", "rms_norm_eps",
             "rope_theta", "rope_scaling", "rope_parameters", "hidden_act", "attention_bias", "mlp_bias",
             "pretraining_tp", "attention_dropout", "quantization_config"}
    for key in cfg:
        if key not in known and key not in HF_IGNORED_FIELDS:
            raise ConvertError(f"{where}: unknown field '{key}' (not a LlamaConfig field this converter knows)")
    return c


def config_to_hf(c, dtype):
    """config.json for our config. Written in the transformers 4.x form (rope_theta + rope_scaling), which 4.x and
    5.x both read, as Meta's released configs are."""
    hd = c["dim"] // c["n_heads"]
    rope_scaling = None
    if c["use_rope_scaling"]:
        rope_scaling = {"rope_type": "llama3", "factor": c["rope_scaling_factor"],
                        "low_freq_factor": c["rope_low_freq_factor"], "high_freq_factor": c["rope_high_freq_factor"],
                        "original_max_position_embeddings": c["rope_original_max_seq_len"]}
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c["vocab_size"],
        "hidden_size": c["dim"], "intermediate_size": c["ffn_hidden"], "num_hidden_layers": c["n_layers"],
        "num_attention_heads": c["n_heads"], "num_key_value_heads": c["n_kv_heads"], "head_dim": hd,
        "hidden_act": "silu", "max_position_embeddings": c["max_seq_len"], "rms_norm_eps": c["norm_eps"],
        "rope_theta": c["rope_theta"], "rope_scaling": rope_scaling, "tie_word_embeddings": bool(c["tied_embeddings"]),
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
        # the config format of Meta's Llama 3.2 release; transformers 5 reads the field, and without it some versions
        # warn that the tokenizer next to it might have Mistral's broken regex
        "transformers_version": "4.45.0",
    }
    if c["vocab_size"] >= LLAMA3_VOCAB:  # the Llama 3 special tokens exist
        cfg["bos_token_id"] = BOS_ID
        cfg["eos_token_id"] = [END_OF_TEXT_ID, EOM_ID, EOT_ID]
    return cfg


def generation_config(c):
    gen = {"_from_model_config": False, "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    if c["vocab_size"] >= LLAMA3_VOCAB:
        gen.update(bos_token_id=BOS_ID, eos_token_id=[END_OF_TEXT_ID, EOM_ID, EOT_ID])
    return gen


# ----------------------------------------------------------------------------------------------------------------
# Import


def choose_dtype(requested, source_dtypes):
    """--dtype if given, else bf16 when every source tensor is bf16, else fp32 (fp16 widens exactly)."""
    if requested:
        return requested
    return "bf16" if source_dtypes == {"BF16"} else "fp32"


def ours_from_hf(c, get):
    """Our tensors as {name: callable returning the array}, from get(HF tensor name) -> array. Only rows move, so
    it maps gradients as well as weights."""
    H, KV = c["n_heads"], c["n_kv_heads"]
    layers = range(c["n_layers"])
    per_layer = lambda build: (lambda: (build(f"model.layers.{i}.") for i in layers))
    return {
        "tok_embedding": lambda: [get("model.embed_tokens.weight")],
        "attn_norm": per_layer(lambda p: get(p + "input_layernorm.weight")),
        "wqkv": per_layer(lambda p: np.concatenate([hf_to_interleaved(get(p + "self_attn.q_proj.weight"), H),
                                                    hf_to_interleaved(get(p + "self_attn.k_proj.weight"), KV),
                                                    get(p + "self_attn.v_proj.weight")])),
        "wo": per_layer(lambda p: get(p + "self_attn.o_proj.weight")),
        "ffn_norm": per_layer(lambda p: get(p + "post_attention_layernorm.weight")),
        "w13": per_layer(lambda p: np.concatenate([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])),
        "w2": per_layer(lambda p: get(p + "mlp.down_proj.weight")),
        "final_norm": lambda: [get("model.norm.weight")],
        "lm_head": lambda: [get("lm_head.weight")],
    }


def import_hf(src, out, dtype):
    config_path = os.path.join(src, "config.json")
    if not os.path.isfile(config_path):
        raise ConvertError(f"{config_path}: file not found")
    with open(config_path) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise ConvertError(f"{config_path}: not valid JSON ({e})")
    c = hf_to_config(cfg, config_path)
    where = read_hf_weights(src)
    C, F, H, KV = c["dim"], c["ffn_hidden"], c["n_heads"], c["n_kv_heads"]
    hd = C // H
    expected = {"model.embed_tokens.weight": (c["vocab_size"], C), "model.norm.weight": (C,)}
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        expected.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                         p + "self_attn.q_proj.weight": (H * hd, C), p + "self_attn.k_proj.weight": (KV * hd, C),
                         p + "self_attn.v_proj.weight": (KV * hd, C), p + "self_attn.o_proj.weight": (C, H * hd),
                         p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C),
                         p + "mlp.down_proj.weight": (C, F)})
    if not c["tied_embeddings"]:
        expected["lm_head.weight"] = (c["vocab_size"], C)
    for name in where:
        if name in expected:
            continue
        if name == "lm_head.weight" and c["tied_embeddings"]:
            continue  # checked below: must equal the embedding
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a cached buffer some old checkpoints saved; recomputed from the config
        what = "a bias, which Llama 3 does not have" if name.endswith(".bias") else "not a Llama 3 tensor"
        raise ConvertError(f"{where[name].path}: tensor '{name}' is {what}")
    for name, shape in expected.items():
        if name not in where:
            raise ConvertError(f"{src}: tensor '{name}' is missing (config.json: num_hidden_layers "
                               f"{c['n_layers']}, tie_word_embeddings {bool(c['tied_embeddings'])})")
        got = where[name].tensors[name][1]
        if got != shape:
            raise ConvertError(f"{where[name].path}: tensor '{name}' has shape {list(got)}, config.json implies "
                               f"{list(shape)}")
    source_dtypes = {where[name].tensors[name][0] for name in expected}
    dtype = choose_dtype(dtype, source_dtypes)

    def get(name):
        src_dtype, array = where[name].read(name)
        return convert_bits(np.asarray(array), src_dtype, dtype)

    if c["tied_embeddings"] and "lm_head.weight" in where:
        if not np.array_equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
            raise ConvertError(f"{where['lm_head.weight'].path}: tie_word_embeddings is true in config.json but "
                               f"lm_head.weight differs from model.embed_tokens.weight")

    write_checkpoint(out, c, dtype, ours_from_hf(c, get), src)
    return c, dtype


def meta_ffn_hidden(dim, multiple_of, ffn_dim_multiplier):
    """Meta's FeedForward size: 2/3 of 4 dim, times the multiplier, rounded up to a multiple of multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


META_PARAMS_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
                      "norm_eps", "rope_theta", "use_scaled_rope", "rope_scaling_factor", "max_seq_len"}


def import_meta(src, out, dtype, rope_scaling_factor, max_seq_len):
    params_path = os.path.join(src, "params.json")
    with open(params_path) as f:
        params = json.load(f)
    for key in params:
        if key not in META_PARAMS_FIELDS:
            raise ConvertError(f"{params_path}: unknown field '{key}'")
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of"):
        if key not in params:
            raise ConvertError(f"{params_path}: missing field '{key}'")
    scaled = bool(params.get("use_scaled_rope", False))
    factor = params.get("rope_scaling_factor", rope_scaling_factor)
    if scaled and factor is None:
        raise ConvertError(f"{params_path}: use_scaled_rope is true but no rope_scaling_factor is given: pass "
                           f"--rope-scaling-factor (8 for Llama 3.1, 32 for Llama 3.2)")
    c = dict(vocab_size=params["vocab_size"], dim=params["dim"], n_layers=params["n_layers"],
             n_heads=params["n_heads"], n_kv_heads=params.get("n_kv_heads") or params["n_heads"],
             ffn_hidden=meta_ffn_hidden(params["dim"], params["multiple_of"], params.get("ffn_dim_multiplier")),
             max_seq_len=max_seq_len or params.get("max_seq_len") or (131072 if scaled else 8192),
             tied_embeddings=0, norm_eps=float(params.get("norm_eps", 1e-5)),
             rope_theta=float(params.get("rope_theta", 500000.0)))
    # Meta's apply_scaling: low 1, high 4, original context 8192
    c.update(use_rope_scaling=int(scaled), rope_scaling_factor=float(factor) if scaled else 1.0,
             rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=8192 if scaled else 0)
    check_config(c, params_path)

    import torch  # only Meta's .pth files need it

    shard_paths = sorted(p for p in os.listdir(src) if re.fullmatch(r"consolidated\.\d+\.pth", p))
    if not shard_paths:
        raise ConvertError(f"{src}: no consolidated.*.pth files")
    shards = [torch.load(os.path.join(src, p), map_location="cpu", weights_only=True, mmap=True) for p in shard_paths]
    names = set(shards[0])
    for p, shard in zip(shard_paths, shards):
        if set(shard) != names:
            raise ConvertError(f"{os.path.join(src, p)}: holds tensors {sorted(set(shard) ^ names)[:3]} that "
                               f"{shard_paths[0]} does not (or lacks them)")
    torch_dtypes = {str(t.dtype) for s in shards for t in s.values()}
    dtype = dtype or ("bf16" if torch_dtypes == {"torch.bfloat16"} else "fp32")

    def raw(t):
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(np.uint16), "bf16"
        if t.dtype in (torch.float32, torch.float16):
            return t.numpy(), "fp32" if t.dtype == torch.float32 else "fp16"
        raise ConvertError(f"{src}: a tensor has dtype {t.dtype}; supported: bfloat16, float16, float32")

    def get(name, split_dim):
        """split_dim: 0 column-parallel, 1 row-parallel, None replicated (shard 0, checked equal on the others)."""
        if name not in names:
            raise ConvertError(f"{src}: tensor '{name}' is missing from {shard_paths[0]}")
        parts = []
        for shard in shards:
            array, src_dtype = raw(shard[name])
            parts.append(convert_bits(array, src_dtype, dtype))
        if split_dim is None:
            for p, part in zip(shard_paths[1:], parts[1:]):
                if not np.array_equal(part, parts[0]):
                    raise ConvertError(f"{os.path.join(src, p)}: replicated tensor '{name}' differs from shard 0")
            return parts[0]
        return np.concatenate(parts, axis=split_dim)

    known = {"tok_embeddings.weight", "norm.weight", "output.weight", "rope.freqs"}
    for i in range(c["n_layers"]):
        known |= {f"layers.{i}.{n}.weight" for n in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                                                     "attention_norm", "ffn_norm")}
    for name in names:
        if name not in known:
            raise ConvertError(f"{os.path.join(src, shard_paths[0])}: tensor '{name}' is not a Llama 3 tensor")
    embedding = get("tok_embeddings.weight", 0)
    output = get("output.weight", 0) if "output.weight" in names else None
    c["tied_embeddings"] = int(output is None or np.array_equal(output, embedding))
    layers = range(c["n_layers"])
    per_layer = lambda build: (lambda: (build(f"layers.{i}.") for i in layers))
    tensors = {
        "tok_embedding": lambda: [embedding],
        "attn_norm": per_layer(lambda p: get(p + "attention_norm.weight", None)),
        "wqkv": per_layer(lambda p: np.concatenate([get(p + "attention.wq.weight", 0),
                                                    get(p + "attention.wk.weight", 0),
                                                    get(p + "attention.wv.weight", 0)])),
        "wo": per_layer(lambda p: get(p + "attention.wo.weight", 1)),
        "ffn_norm": per_layer(lambda p: get(p + "ffn_norm.weight", None)),
        "w13": per_layer(lambda p: np.concatenate([get(p + "feed_forward.w1.weight", 0),
                                                  get(p + "feed_forward.w3.weight", 0)])),
        "w2": per_layer(lambda p: get(p + "feed_forward.w2.weight", 1)),
        "final_norm": lambda: [get("norm.weight", None)],
        "lm_head": lambda: [output],
    }
    write_checkpoint(out, c, dtype, tensors, src)
    return c, dtype


# ----------------------------------------------------------------------------------------------------------------
# Export


def parse_size(text):
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise ConvertError(f"--max-shard-size: '{text}' is not a size like 5GB, 500MB or 100000")
    scale = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[match[2]]
    return int(float(match[1]) * scale)


def hf_tensors(c, tensors):
    """(HF name, callable giving the array) in HF's order, from our tensors."""
    H, KV, F = c["n_heads"], c["n_kv_heads"], c["ffn_hidden"]
    hd = c["dim"] // H
    q_rows, k_rows = H * hd, KV * hd
    out = [("model.embed_tokens.weight", lambda: tensors["tok_embedding"])]
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        wqkv, w13 = tensors["wqkv"][i], tensors["w13"][i]
        out += [
            (p + "input_layernorm.weight", lambda i=i: tensors["attn_norm"][i]),
            (p + "self_attn.q_proj.weight", lambda w=wqkv: interleaved_to_hf(w[:q_rows], H)),
            (p + "self_attn.k_proj.weight", lambda w=wqkv: interleaved_to_hf(w[q_rows:q_rows + k_rows], KV)),
            (p + "self_attn.v_proj.weight", lambda w=wqkv: w[q_rows + k_rows:]),
            (p + "self_attn.o_proj.weight", lambda i=i: tensors["wo"][i]),
            (p + "post_attention_layernorm.weight", lambda i=i: tensors["ffn_norm"][i]),
            (p + "mlp.gate_proj.weight", lambda w=w13: w[:F]),
            (p + "mlp.up_proj.weight", lambda w=w13: w[F:]),
            (p + "mlp.down_proj.weight", lambda i=i: tensors["w2"][i]),
        ]
    out.append(("model.norm.weight", lambda: tensors["final_norm"]))
    if not c["tied_embeddings"]:
        out.append(("lm_head.weight", lambda: tensors["lm_head"]))
    return out


def write_safetensors(path, named_arrays, dtype):
    """named_arrays: [(name, shape, callable giving the array)], written sorted by name as save_pretrained does."""
    named_arrays = sorted(named_arrays, key=lambda item: item[0])
    st_dtype = {"fp32": "F32", "bf16": "BF16"}[dtype]
    itemsize = 4 if dtype == "fp32" else 2
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in named_arrays:
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned

    def write(f):
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, shape, get in named_arrays:
            array = np.ascontiguousarray(get())
            assert array.shape == tuple(shape)
            f.write(array.tobytes())

    write_atomic(path, write)


def write_json(path, obj):
    write_atomic(path, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def export_hf(model_path, out_dir, dtype=None, max_shard_size=DEFAULT_MAX_SHARD, tokenizer=None):
    c, src_dtype, tensors = read_checkpoint(model_path)
    dtype = dtype or src_dtype
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    itemsize = 4 if dtype == "fp32" else 2
    named = []
    for name, get in hf_tensors(c, tensors):
        shape = get().shape
        named.append((name, shape, lambda get=get: convert_bits(get(), src_dtype, dtype)))
    # greedy sharding in order: a new shard when the next tensor would pass the limit
    shards, size = [[]], 0
    for item in named:
        nbytes = math.prod(item[1]) * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    os.makedirs(out_dir, exist_ok=True)
    for stale in os.listdir(out_dir):  # shards of an earlier export would confuse loaders
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", stale):
            os.remove(os.path.join(out_dir, stale))
    if len(shards) == 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), shards[0], dtype)
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(out_dir, file), shard, dtype)
            weight_map.update({name: file for name, _, _ in shard})
        total = sum(math.prod(shape) * itemsize for _, shape, _ in named)
        write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                   {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(os.path.join(out_dir, "config.json"), config_to_hf(c, dtype))
    write_json(os.path.join(out_dir, "generation_config.json"), generation_config(c))
    if tokenizer:
        write_tokenizer(tokenizer, out_dir, c["max_seq_len"])
    return c, dtype, len(shards)


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer: tiktoken tokenizer.model -> tokenizer.json (byte-level BPE) + tokenizer_config.json

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev", "data"))


def byte_to_unicode():
    """The byte-level alphabet of GPT-2 style BPE: printable bytes stand for themselves, the other 68 bytes map to
    the code points from 256 on, in byte order, so every token is a printable string."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_merges(ranks):
    """The merge list that makes HF's BPE reproduce tiktoken: tiktoken repeatedly joins the adjacent pair whose
    concatenation has the lowest rank, so every split of a token into two tokens is a merge whose priority is the
    rank of the result (ties between splits of the same token broken by the ranks of the parts)."""
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]


LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def write_tokenizer(model_path, out_dir, max_length):
    from llama3_tokenizer import NUM_BASE_TOKENS, PAT_STR, load_bpe_ranks, special_token_names

    ranks = load_bpe_ranks(model_path)
    if len(ranks) != NUM_BASE_TOKENS:
        raise ConvertError(f"{model_path}: {len(ranks)} BPE tokens, expected {NUM_BASE_TOKENS} for Llama 3")
    to_unicode = byte_to_unicode()
    text = lambda token: "".join(to_unicode[b] for b in token)
    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [f"{text(left)} {text(right)}" for left, right in bpe_merges(ranks)]
    specials = [(NUM_BASE_TOKENS + i, name) for i, name in enumerate(special_token_names())]
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, name in specials]
    bos = "<|begin_of_text|>"
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PAT_STR}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": bos, "type_id": 1}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }
    config = {
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "bos_token": bos,
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_CHAT_TEMPLATE,
        # no clean-up: it would drop the space in "the letter 's'" and transformers 5 warns that it is wrong for BPE
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    os.makedirs(out_dir, exist_ok=True)
    write_atomic(os.path.join(out_dir, "tokenizer.json"),
                 lambda f: f.write(json.dumps(tokenizer, ensure_ascii=False).encode()))
    write_json(os.path.join(out_dir, "tokenizer_config.json"), config)


# ----------------------------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("import", help="a HF directory or Meta's original layout -> our .bin")
    p.add_argument("src", help="HF model directory (config.json) or Meta's (params.json, consolidated.*.pth)")
    p.add_argument("out", help="our checkpoint to write")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="default: bf16 when the source is all bf16, else fp32")
    p.add_argument("--rope-scaling-factor", type=float, help="Meta layout only, when params.json has "
                   "use_scaled_rope without a factor: 8 for Llama 3.1, 32 for Llama 3.2")
    p.add_argument("--max-seq-len", type=int, help="Meta layout only (default 131072 with scaled rope, else 8192)")
    p = sub.add_parser("export", help="our .bin -> a HF directory")
    p.add_argument("model", help="our checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="default: the checkpoint's dtype")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="default %(default)s")
    p.add_argument("--tokenizer", help="Llama 3 tokenizer.model: also write tokenizer.json, tokenizer_config.json")
    p = sub.add_parser("tokenizer", help="Llama 3 tokenizer.model -> tokenizer.json + tokenizer_config.json")
    p.add_argument("model", help="Llama 3 tokenizer.model (tiktoken format)")
    p.add_argument("out_dir")
    p.add_argument("--max-length", type=int, default=131072, help="model_max_length (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            if not os.path.isdir(args.src):
                raise ConvertError(f"{args.src}: not a directory")
            if os.path.isfile(os.path.join(args.src, "config.json")):
                c, dtype = import_hf(args.src, args.out, args.dtype)
            elif os.path.isfile(os.path.join(args.src, "params.json")):
                c, dtype = import_meta(args.src, args.out, args.dtype, args.rope_scaling_factor, args.max_seq_len)
            else:
                raise ConvertError(f"{args.src}: has neither config.json (Hugging Face) nor params.json (Meta)")
            print(f"wrote {args.out} ({dtype}): V={c['vocab_size']} C={c['dim']} L={c['n_layers']} H={c['n_heads']} "
                  f"KV={c['n_kv_heads']} F={c['ffn_hidden']} tied={c['tied_embeddings']} "
                  f"rope_scaling={c['use_rope_scaling']}")
        elif args.command == "export":
            c, dtype, n = export_hf(args.model, args.out_dir, args.dtype, args.max_shard_size, args.tokenizer)
            print(f"wrote {args.out_dir} ({dtype}, {n} safetensors file{'s' if n > 1 else ''}"
                  f"{', tokenizer' if args.tokenizer else ''})")
        else:
            write_tokenizer(args.model, args.out_dir, args.max_length)
            print(f"wrote {args.out_dir}/tokenizer.json and tokenizer_config.json")
    except (ConvertError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
