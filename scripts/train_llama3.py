"""
The PyTorch reference for this project: a plain Llama 3 (Meta's architecture, our checkpoint layout), random init
from a seed, checkpoint and debug-state writers, and a small training loop.

The reference math is fp32 with TF32 off. Two things are chosen so the C++ side can match it bit for bit where it
can: the RoPE tables are computed in float64 and rounded once to fp32, and the parameters are stored fused exactly
as the checkpoint stores them (wqkv = [wq; wk; wv], w13 = [w1; w3]).

Examples:
  # debug state for the C/CUDA tie-out (model in fp32 and bf16, logits, loss, grads, 10 AdamW steps, and the errors
  # of PyTorch's bf16 autocast on the same case, which the BF16 tie-out's bounds are a multiple of)
  python scripts/train_llama3.py --config test-gqa --batch_size 2 --seq_len 13 --steps 10 \
      --write_model out/model.bin --write_debug out/debug.bin
  # the same with a loss mask: 40% of the targets ignored (-1), the loss the mean over the others
  python scripts/train_llama3.py --config test-gqa --batch_size 2 --seq_len 13 --steps 10 --ignore_fraction 0.4 \
      --model out/model.bin --write_debug out/masked_debug.bin
  # the FP8 twin of the first: the same fp32 reference, but the error section holds PyTorch's FP8 emulation of the
  # trainer's FP8 recipe (bf16 autocast with the four per-layer products in FP8) instead of bf16 autocast's
  python scripts/train_llama3.py --config test-gqa --batch_size 2 --seq_len 13 --steps 10 --fp8 \
      --model out/model.bin --write_debug out/fp8_debug.bin
  # train on token shards with bf16 autocast and torch.compile
  python scripts/train_llama3.py --config d12 --input_bin "data/tinyshakespeare/*_train.bin" \
      --batch_size 16 --seq_len 1024 --steps 50 --dtype bfloat16 --compile 1
  # the same as the trainer would run it (scripts/convergence.py): its batch order without shuffling (-f 0), its lr
  # schedule, its val loss, its log.txt lines; with --fp8 (emulated) or --torchao_float8 for the FP8 linears
  python scripts/train_llama3.py --model out/model.bin --input_bin "data/debian_docs/*_train_*.bin" \
      --val_bin "data/debian_docs/*_val_*.bin" -B 16 -T 1024 --steps 3000 --lr 6e-4 --schedule cosine \
      --warmup 100 --final_fraction 0.1 --val_every 250 --dtype bfloat16 --compile 1 --log out/torch/log.txt

FP8 (--fp8): the trainer's recipe, emulated. The four per-layer products (wqkv, wo, w13, w2) quantize their bf16
operands with per-tensor current scaling, s = FP8_MAX / amax of the tensor cast (llmc/fp8.cuh): the forward's input
and weight to e4m3 (max 448), the backward's output gradient to e5m2 (max 57344), each x * s rounded to fp32,
saturated and rounded to nearest even. The products (forward, dinp, dweight) sum the exact products of the FP8 values
in fp32 and multiply by the inverse scales, output bf16; --fp8_scaled_mm has torch._scaled_mm do them instead (the
FP8 tensor cores on a GPU, about 13 bits of accumulation window: what the trainer's cuBLASLt products do). lm_head,
the embedding, the norms and attention stay as bf16 autocast has them.
"""

import argparse
import copy
import glob
import math
import os
import struct
import sys
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

CHECKPOINT_MAGIC = 20261121
CHECKPOINT_VERSION = 1
DEBUG_MAGIC = 20261122
DEBUG_VERSION = 1
SHARD_MAGIC = 20240801
SHARD_VERSION = 7
HEADER_SLOTS = 64


@dataclass
class Llama3Config:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_hidden: int = 14336
    max_seq_len: int = 8192
    tied_embeddings: int = 0
    use_rope_scaling: int = 0
    rope_original_max_seq_len: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0

    @property
    def head_dim(self):
        return self.dim // self.n_heads


LLAMA3_SCALED = dict(vocab_size=128256, max_seq_len=8192, use_rope_scaling=1, rope_original_max_seq_len=8192,
                     rope_theta=500000.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0)
NAMED_CONFIGS = {
    "llama3.1-8B": Llama3Config(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, tied_embeddings=0,
                                rope_scaling_factor=8.0, **LLAMA3_SCALED),
    "llama3.1-70B": Llama3Config(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, tied_embeddings=0,
                                 rope_scaling_factor=8.0, **LLAMA3_SCALED),
    "llama3.2-1B": Llama3Config(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, tied_embeddings=1,
                                rope_scaling_factor=32.0, **LLAMA3_SCALED),
    "llama3.2-3B": Llama3Config(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden=8192, tied_embeddings=1,
                                rope_scaling_factor=32.0, **LLAMA3_SCALED),
    # Tiny test configs: sizes not multiples of 32, GQA groups of 3 and 4, tied/untied, RoPE scaling off/on
    # (original length 32 with theta 10000 puts the head_dim-8 frequencies in all three scaling bands).
    "test-gqa": Llama3Config(vocab_size=259, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=88,
                             max_seq_len=64, tied_embeddings=0),
    "test-tied": Llama3Config(vocab_size=211, dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_hidden=72,
                              max_seq_len=64, tied_embeddings=1, use_rope_scaling=1, rope_original_max_seq_len=32,
                              rope_theta=10000.0, rope_scaling_factor=32.0),
    # test-gqa with ffn_hidden 96: every width of the layers' four products a multiple of 16, as the trainer's FP8
    # mode (-M fp8) needs (test-gqa's 88 is not)
    "test-fp8": Llama3Config(vocab_size=259, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=96,
                             max_seq_len=64, tied_embeddings=0),
    # head dim 128 (the 3B and 8B attention path) with as many kv heads as query heads (no GQA)
    "test-mha": Llama3Config(vocab_size=300, dim=256, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=344,
                             max_seq_len=128, tied_embeddings=0),
}


def config_from_name(name, depth=0):
    """Named config, or 'dN': dim 64N, N layers, N heads, the largest kv-head count <= N/3 dividing N,
    FFN 8/3 dim rounded up to 256, no RoPE scaling (the same rule as llmc/model.h)."""
    if name in NAMED_CONFIGS:
        config = NAMED_CONFIGS[name]
    elif len(name) >= 2 and name[0] == "d" and name[1:].isdigit() and int(name[1:]) >= 1:
        n = int(name[1:])
        kv = next((k for k in range(n // 3, 0, -1) if n % k == 0), 1)
        dim = 64 * n
        config = Llama3Config(vocab_size=128256, dim=dim, n_layers=n, n_heads=n, n_kv_heads=kv,
                              ffn_hidden=(8 * dim // 3 + 255) // 256 * 256, max_seq_len=2048)
    else:
        raise SystemExit(f"error: unknown config '{name}' (known: {', '.join(NAMED_CONFIGS)}, dN)")
    if depth > 0:
        config = replace(config, n_layers=min(depth, config.n_layers))
    return config


# ----------------------------------------------------------------------------------------------------------------
# The model


def rope_tables(config, seq_len):
    """cos, sin of shape (seq_len, head_dim/2): angles in float64, then rounded to fp32 once."""
    hd = config.head_dim
    freqs = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if config.use_rope_scaling:
        old_len = float(config.rope_original_max_seq_len)
        low_wavelen = old_len / config.rope_low_freq_factor
        high_wavelen = old_len / config.rope_high_freq_factor
        scaled = []
        for freq in freqs:
            wavelen = 2.0 * math.pi / freq
            if wavelen < high_wavelen:
                scaled.append(freq)
            elif wavelen > low_wavelen:
                scaled.append(freq / config.rope_scaling_factor)
            else:
                smooth = (old_len / wavelen - config.rope_low_freq_factor) / (
                    config.rope_high_freq_factor - config.rope_low_freq_factor)
                scaled.append((1.0 - smooth) * freq / config.rope_scaling_factor + smooth * freq)
        freqs = np.array(scaled, dtype=np.float64)
    angles = np.outer(np.arange(seq_len, dtype=np.float64), freqs)
    return torch.from_numpy(np.cos(angles).astype(np.float32)), torch.from_numpy(np.sin(angles).astype(np.float32))


def apply_rope(x, cos, sin):
    """x: (B, T, n, hd); rotates interleaved pairs (2i, 2i+1) by the position's angle."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.wqkv = nn.Linear(config.dim, (config.n_heads + 2 * config.n_kv_heads) * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, config.dim, bias=False)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.w13 = nn.Linear(config.dim, 2 * config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x, cos, sin):
        c = self.config
        B, T, _ = x.shape
        hd = c.head_dim
        qkv = self.wqkv(self.attn_norm(x))
        q, k, v = qkv.split([c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd], dim=-1)
        q = apply_rope(q.view(B, T, c.n_heads, hd), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(B, T, c.n_kv_heads, hd), cos, sin).transpose(1, 2)
        v = v.view(B, T, c.n_kv_heads, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.n_kv_heads != c.n_heads)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, c.n_heads * hd))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Llama3(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embedding = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = None if config.tied_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config, config.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, seed):
        """N(0, 0.02) for matrices, with the residual projections (wo, w2) scaled by 1/sqrt(2L); norms at 1."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.tok_embedding(idx)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.final_norm(x)
        head = self.tok_embedding.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)
        loss = None
        if targets is not None:
            # no explicit upcast: fp32 logits stay fp32, and under bf16 autocast cross_entropy runs in fp32 anyway
            # (torch.compile can then fuse the upcast instead of materialising fp32 logits). Targets of -1 are
            # masked: the loss is the mean over the others.
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def tensors_in_file_order(self):
        """(name, tensor) in checkpoint order: each per-layer tensor stacked over the layers."""
        stack = lambda get: torch.stack([get(layer) for layer in self.layers])
        out = [
            ("tok_embedding", self.tok_embedding.weight),
            ("attn_norm", stack(lambda l: l.attn_norm.weight)),
            ("wqkv", stack(lambda l: l.wqkv.weight)),
            ("wo", stack(lambda l: l.wo.weight)),
            ("ffn_norm", stack(lambda l: l.ffn_norm.weight)),
            ("w13", stack(lambda l: l.w13.weight)),
            ("w2", stack(lambda l: l.w2.weight)),
            ("final_norm", self.final_norm.weight),
        ]
        if self.lm_head is not None:
            out.append(("lm_head", self.lm_head.weight))
        return out

    def grads_in_file_order(self):
        stack = lambda get: torch.stack([get(layer).grad for layer in self.layers])
        out = [
            self.tok_embedding.weight.grad,
            stack(lambda l: l.attn_norm.weight), stack(lambda l: l.wqkv.weight), stack(lambda l: l.wo.weight),
            stack(lambda l: l.ffn_norm.weight), stack(lambda l: l.w13.weight), stack(lambda l: l.w2.weight),
            self.final_norm.weight.grad,
        ]
        if self.lm_head is not None:
            out.append(self.lm_head.weight.grad)
        return out


# ----------------------------------------------------------------------------------------------------------------
# FP8: the trainer's recipe emulated (--fp8), and torchao's float8 training (--torchao_float8)

FP8_LINEARS = ("wqkv", "wo", "w13", "w2")
FP8_SCALE_MAX = 2.0**126


def fp8_scale(amax, fp8_max):
    """s = fp8_max / amax in fp32, at most 2^126; 1 where amax is 0, infinite or NaN (llmc/fp8.cuh). A tensor
    divided by a tensor: `number / tensor` would be reciprocal(tensor) * number, rounded twice."""
    amax = amax.float()
    s = torch.clamp(torch.full_like(amax, fp8_max) / amax, max=FP8_SCALE_MAX)
    return torch.where((amax > 0) & torch.isfinite(amax), s, torch.ones_like(s))


def fp8_quantize(x, dtype):
    """(q, inv_scale): x rounded to bf16 (the trainer's operands are bf16), times the scale from its amax, rounded to
    fp32, saturated to the format's largest value and rounded to nearest even in `dtype` (torch.float8_e4m3fn or
    torch.float8_e5m2); inv_scale = 1 / s in fp32, what the products multiply by."""
    fp8_max = torch.finfo(dtype).max
    x = x.bfloat16().float()
    s = fp8_scale(x.abs().amax(), fp8_max)
    return (x * s).clamp(-fp8_max, fp8_max).to(dtype), torch.reciprocal(s)


def fp8_product(a, inv_a, b, inv_b, scaled_mm):
    """(a / s_a) (b / s_b)^T in bf16, for FP8 a (M, K) and b (N, K): the exact products of the FP8 values summed in
    fp32, times inv_a * inv_b (cuBLASLt's D = scale_A scale_B A B), rounded to bf16; with scaled_mm,
    torch._scaled_mm (without fast accumulation, as the trainer's products)."""
    if scaled_mm:
        return torch._scaled_mm(a, b.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16)
    return (a.float() @ b.float().t() * (inv_a * inv_b)).bfloat16()


class Fp8Matmul(torch.autograd.Function):
    """y = x W^T with x and W in e4m3; in the backward the output gradient in e5m2 (its own scale) for both dinp and
    dweight, against the e4m3 x and W of the forward. Every product's output is bf16; the gradients are returned
    in the dtype of x and W (bf16 values)."""

    @staticmethod
    def forward(ctx, x, weight, scaled_mm):
        with torch.autocast(x.device.type, enabled=False):
            qx, inv_x = fp8_quantize(x.reshape(-1, x.shape[-1]), torch.float8_e4m3fn)
            qw, inv_w = fp8_quantize(weight, torch.float8_e4m3fn)
            out = fp8_product(qx, inv_x, qw, inv_w, scaled_mm)
        ctx.save_for_backward(qx, inv_x, qw, inv_w)
        ctx.scaled_mm, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = scaled_mm, x.shape, x.dtype, weight.dtype
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        qx, inv_x, qw, inv_w = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            qg, inv_g = fp8_quantize(grad_out.reshape(-1, grad_out.shape[-1]), torch.float8_e5m2)
            dinp = fp8_product(qg, inv_g, qw.t().contiguous(), inv_w, ctx.scaled_mm)
            dweight = fp8_product(qg.t().contiguous(), inv_g, qx.t().contiguous(), inv_x, ctx.scaled_mm)
        return dinp.view(ctx.x_shape).to(ctx.x_dtype), dweight.to(ctx.w_dtype), None


class Fp8Linear(nn.Linear):
    def __init__(self, linear, scaled_mm):
        with torch.device("meta"):
            super().__init__(linear.in_features, linear.out_features, bias=False)
        self.weight = linear.weight  # the same parameter: checkpoints and the optimizer see no difference
        self.scaled_mm = scaled_mm

    def forward(self, x):
        return Fp8Matmul.apply(x, self.weight, self.scaled_mm)


def use_fp8_emulation(model, scaled_mm):
    """Swaps the four per-layer linears of every block for Fp8Linear (lm_head and the rest stay as they are)."""
    for layer in model.layers:
        for name in FP8_LINEARS:
            setattr(layer, name, Fp8Linear(getattr(layer, name), scaled_mm))
    return model


def use_torchao_float8(model, device):
    """torchao's float8 training, tensorwise recipe (dynamic per-tensor scales, e4m3 forward, e5m2 gradients), on
    every nn.Linear but lm_head: on a GPU with FP8 tensor cores (sm_89 or later: H100) only."""
    if not device.startswith("cuda") or not torch.cuda.is_available() or \
            torch.cuda.get_device_capability(device) < (8, 9):
        raise SystemExit(f"error: --torchao_float8 needs a CUDA GPU with FP8 tensor cores (sm_89 or later, e.g. an "
                         f"H100); this run's device is '{device}'")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise SystemExit(f"error: --torchao_float8 needs torchao (pip install torchao==0.18.0): {e}")
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn != "lm_head")


# ----------------------------------------------------------------------------------------------------------------
# Files


def config_header(config, dtype_code):
    h = np.zeros(HEADER_SLOTS, dtype=np.int32)
    h[0:13] = [CHECKPOINT_MAGIC, CHECKPOINT_VERSION, dtype_code, config.vocab_size, config.dim, config.n_layers,
               config.n_heads, config.n_kv_heads, config.ffn_hidden, config.max_seq_len, config.tied_embeddings,
               config.use_rope_scaling, config.rope_original_max_seq_len]
    floats = np.array([config.norm_eps, config.rope_theta, config.rope_scaling_factor, config.rope_low_freq_factor,
                       config.rope_high_freq_factor], dtype=np.float32)
    h[13:18] = floats.view(np.int32)
    return h


def write_atomic(path, chunks):
    """Writes byte chunks to path.tmp, then renames, so a crash never leaves a half-written file at path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_model(model, path, dtype):
    """dtype 'float32' or 'bfloat16'."""
    code = 0 if dtype == "float32" else 1
    chunks = [config_header(model.config, code).tobytes()]
    for _, t in model.tensors_in_file_order():
        t = t.detach().cpu()
        if code == 0:
            chunks.append(t.float().numpy().tobytes())
        else:
            chunks.append(t.bfloat16().view(torch.int16).numpy().tobytes())
    write_atomic(path, chunks)


def read_model(path):
    with open(path, "rb") as f:
        h = np.frombuffer(f.read(HEADER_SLOTS * 4), dtype=np.int32)
        if len(h) != HEADER_SLOTS or h[0] != CHECKPOINT_MAGIC or h[1] != CHECKPOINT_VERSION:
            raise SystemExit(f"error: '{path}' is not a version {CHECKPOINT_VERSION} Llama 3 checkpoint")
        f32 = h[13:18].view(np.float32)
        config = Llama3Config(vocab_size=int(h[3]), dim=int(h[4]), n_layers=int(h[5]), n_heads=int(h[6]),
                              n_kv_heads=int(h[7]), ffn_hidden=int(h[8]), max_seq_len=int(h[9]),
                              tied_embeddings=int(h[10]), use_rope_scaling=int(h[11]),
                              rope_original_max_seq_len=int(h[12]), norm_eps=float(f32[0]),
                              rope_theta=float(f32[1]), rope_scaling_factor=float(f32[2]),
                              rope_low_freq_factor=float(f32[3]), rope_high_freq_factor=float(f32[4]))
        model = Llama3(config)
        raw = f.read()
    dtype = np.float32 if h[2] == 0 else np.int16
    offset = 0
    with torch.no_grad():
        for name, t in model.tensors_in_file_order():
            n = t.numel()
            chunk = np.frombuffer(raw, dtype=dtype, count=n, offset=offset)
            offset += n * chunk.itemsize
            value = torch.from_numpy(chunk.copy())
            value = value.view(torch.bfloat16).float() if h[2] == 1 else value
            assign_stacked(model, name, value.view(t.shape))
    if offset != len(raw):
        raise SystemExit(f"error: '{path}' has {len(raw) - offset} bytes beyond its tensors")
    return model


def assign_stacked(model, name, value):
    if name in ("tok_embedding", "final_norm", "lm_head"):
        getattr(model, name).weight.copy_(value)
        return
    for i, layer in enumerate(model.layers):
        getattr(layer, name).weight.copy_(value[i])


def write_debug_state(path, model, inputs, targets, logits, loss, grads, step_losses, step_norms, hp,
                      bf16_errors=None):
    """bf16_errors: the floats of bf16_autocast_errors(), or None (the state then serves fp32 tie-outs only)."""
    B, T = inputs.shape
    h = np.zeros(HEADER_SLOTS, dtype=np.int32)
    h[0:8] = [DEBUG_MAGIC, DEBUG_VERSION, B, T, model.config.vocab_size, len(step_losses), int((targets < 0).any()),
              int(bf16_errors is not None)]
    h[8:14] = np.array([hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.grad_clip], dtype=np.float32).view(
        np.int32)
    f32 = lambda t: t.detach().cpu().float().numpy().astype(np.float32).tobytes()
    chunks = [h.tobytes(), inputs.cpu().numpy().astype(np.int32).tobytes(),
              targets.cpu().numpy().astype(np.int32).tobytes(), f32(logits), f32(loss.reshape(1))]
    chunks += [f32(g) for g in grads]
    chunks += [np.array(step_losses, dtype=np.float32).tobytes(), np.array(step_norms, dtype=np.float32).tobytes()]
    if bf16_errors is not None:
        chunks.append(np.array(bf16_errors, dtype=np.float32).tobytes())
    write_atomic(path, chunks)


def load_tokens(pattern):
    """All tokens of the llm.c-format shards matching pattern, concatenated, and their loss mask (1 where a token
    counts as a target: everywhere for plain shards, as the shard says for loss-masked ones; dev/data/shards.py)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise SystemExit(f"error: no token shards match '{pattern}'")
    parts, masks = [], []
    for path in files:
        header = np.fromfile(path, dtype=np.int32, count=256)
        if len(header) < 256 or header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION or header[3] not in (0, 1):
            raise SystemExit(f"error: '{path}' is not a version {SHARD_VERSION} token shard")
        n, masked = int(header[2]), bool(header[3])
        if os.path.getsize(path) != 1024 + (5 if masked else 4) * n:
            raise SystemExit(f"error: '{path}' is {os.path.getsize(path)} bytes, its header's {n} tokens "
                             f"{'and loss mask ' if masked else ''}do not match")
        parts.append(np.fromfile(path, dtype=np.uint32, count=n, offset=1024))
        masks.append(np.fromfile(path, dtype=np.uint8, count=n, offset=1024 + 4 * n) if masked
                     else np.ones(n, dtype=np.uint8))
    return np.concatenate(parts).astype(np.int64), np.concatenate(masks).astype(bool)


def batch_starts(pattern, B, T):
    """Where each batch of B*T+1 tokens starts in load_tokens(pattern)'s concatenation, in the order of the trainer's
    loader without shuffling (llmc/dataloader.h, -f 0; one process): the shards in sorted name order, each one's
    (N - 1) // (B*T) batches front to back (a batch never crosses a shard's end; the tokens after the last one are
    not used). Training takes them in this order and starts over after the last (the next epoch)."""
    starts, offset = [], 0
    for path in sorted(glob.glob(pattern)):
        n = int(np.fromfile(path, dtype=np.int32, count=3)[2])
        starts.append(offset + B * T * np.arange((n - 1) // (B * T)))
        offset += n
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------------
# Training


def forward_backward(model, inputs, targets, autocast):
    """The first half of a training step: logits and loss under `autocast`, gradients in the parameters' .grad."""
    with autocast:
        logits, loss = model(inputs, targets)
    loss.backward()
    return logits, loss


def lr_at(hp, step, total):
    """The trainer's learning rate for step `step` (from 0) of `total` (llmc/schedule.h; here in float64, there in
    float32): linear warmup from lr/warmup over hp.warmup steps, then hp.schedule down to lr * final_fraction."""
    if step < hp.warmup:
        return hp.lr * (step + 1) / hp.warmup
    lr_min = hp.lr * hp.final_fraction
    span = total - hp.warmup
    progress = min(max((step - hp.warmup) / (span - 1), 0.0), 1.0) if span > 1 else 1.0
    if hp.schedule == "cosine":
        return lr_min + (hp.lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if hp.schedule == "linear":
        return hp.lr - (hp.lr - lr_min) * progress
    if hp.schedule == "wsd":  # constant, then linear down over the last 20% of the steps
        decay_steps = int(0.2 * total)
        if step < total - decay_steps or decay_steps <= 0:
            return hp.lr
        t = (step - (total - decay_steps)) / (decay_steps - 1) if decay_steps > 1 else 1.0
        return hp.lr - (hp.lr - lr_min) * min(t, 1.0)
    return hp.lr


def clip_and_update(model, optimizer, grad_clip, lr):
    """The second half: clip the gradients to grad_clip, take the AdamW step at learning rate lr, clear the
    gradients. Returns the pre-clip grad norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def tensor_errors(got, ref):
    """max |got - ref| / max |ref| and ||got - ref|| / ||ref||, in float64 (the measures of llmc/debug_state.h)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    diff = (got - ref).abs()
    return (diff.max() / ref.abs().max()).item(), (diff.norm() / ref.norm()).item()


def bf16_autocast_errors(model, inputs, targets, hp, steps, device, ref):
    """PyTorch's own bf16 error on a debug case: `model` (the initial weights) trained on the same batch for the same
    AdamW steps under bf16 autocast (fp32 master weights), against the fp32 run ref = (logits, loss, grads,
    step_losses, step_norms). Returns the debug state's bf16 section: logits max_rel and rel_norm, |loss diff|, the
    max_rel and rel_norm of each gradient tensor (checkpoint order), then per step |loss diff| and the relative
    difference of the grad norm. The CUDA tie-out bounds its BF16 build by a multiple of these (test_llama3.cu).
    With `model`'s four per-layer linears in FP8 (use_fp8_emulation), the same measures for the FP8 recipe: the
    bounds of the trainer's FP8 mode."""
    ref_logits, ref_loss, ref_grads, ref_step_losses, ref_step_norms = ref
    optimizer = make_optimizer(model, hp, device)
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    first, per_step = [], []
    for step in range(steps):
        logits, loss = forward_backward(model, inputs, targets, autocast)
        if step == 0:
            first += [*tensor_errors(logits, ref_logits), abs(loss.item() - ref_loss.item())]
            for grad, ref_grad in zip(model.grads_in_file_order(), ref_grads):
                first += tensor_errors(grad, ref_grad)
        norm = clip_and_update(model, optimizer, hp.grad_clip, lr_at(hp, step, steps))
        per_step += [abs(loss.item() - ref_step_losses[step]),
                     abs(norm.item() - ref_step_norms[step]) / ref_step_norms[step]]
    return first + per_step


def make_optimizer(model, hp, device):
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    gains = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": hp.weight_decay}, {"params": gains, "weight_decay": 0.0}]
    fused = device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, fused=fused)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="d12",
                        help="llama3.1-8B, llama3.1-70B, llama3.2-1B, llama3.2-3B, dN, test-gqa, test-tied")
    parser.add_argument("--depth", type=int, default=0, help="keep only the first N layers (0: all)")
    parser.add_argument("--model", default="", help="start from this checkpoint instead of a random init")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--input_bin", default="", help="token shard glob; random tokens when empty")
    parser.add_argument("--val_bin", default="", help="val token shard glob: the val loss as the trainer computes it")
    parser.add_argument("--val_every", type=int, default=0, help="val loss every N steps (and at 0 and the last)")
    parser.add_argument("--val_batches", type=int, default=20, help="val batches per evaluation, -1 all")
    parser.add_argument("--ignore_fraction", type=float, default=0.0,
                        help="mask each target with this probability (seeded): target -1, left out of the loss")
    parser.add_argument("--batch_size", "-B", type=int, default=4)
    parser.add_argument("--seq_len", "-T", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--schedule", default="constant", choices=["cosine", "linear", "constant", "wsd"],
                        help="the trainer's lr schedules (-k), after --warmup steps")
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--final_fraction", type=float, default=0.0, help="final lr as a fraction of the peak")
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="bfloat16 = autocast with fp32 master weights")
    parser.add_argument("--fp8", action="store_true",
                        help="the trainer's FP8 recipe, emulated, on the bf16 autocast run: the training run with "
                             "--dtype bfloat16, the error twin of --write_debug with --dtype float32")
    parser.add_argument("--fp8_scaled_mm", action="store_true", help="--fp8's products by torch._scaled_mm")
    parser.add_argument("--torchao_float8", action="store_true",
                        help="torchao float8 training (tensorwise) on every linear but lm_head; needs --dtype "
                             "bfloat16 and a GPU with FP8 tensor cores")
    parser.add_argument("--compile", type=int, default=0)
    parser.add_argument("--log", default="", help="write the trainer's log.txt lines (train_loss, val_loss) here")
    parser.add_argument("--write_model", default="", help="write the initial model here (fp32) and *_bf16.bin")
    parser.add_argument("--write_debug", default="",
                        help="write the debug state here (trains on one fixed batch; with --dtype float32 it also "
                             "holds the errors of the same run under bf16 autocast, or with --fp8 under the FP8 "
                             "recipe)")
    args = parser.parse_args()
    if args.fp8 and args.torchao_float8:
        raise SystemExit("error: --fp8 and --torchao_float8 are two FP8 recipes: choose one")
    if args.fp8 and args.dtype == "float32" and not args.write_debug:
        raise SystemExit("error: --fp8 needs --dtype bfloat16 (or --write_debug, whose bf16 twin it then changes)")
    if args.fp8_scaled_mm and not args.fp8:
        raise SystemExit("error: --fp8_scaled_mm needs --fp8")
    if args.torchao_float8 and args.dtype != "bfloat16":
        raise SystemExit("error: --torchao_float8 needs --dtype bfloat16")
    if args.val_every < 0 or (args.val_every > 0) != bool(args.val_bin):
        raise SystemExit("error: --val_bin and --val_every > 0 go together")

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(args.seed)

    model = read_model(args.model) if args.model else Llama3(config_from_name(args.config, args.depth))
    if not args.model:
        model.init_weights(args.seed)
    config = model.config
    B, T = args.batch_size, args.seq_len
    if not 1 <= T <= config.max_seq_len:
        raise SystemExit(f"error: --seq_len {T} not in [1, max_seq_len {config.max_seq_len}]")
    if B < 1 or args.steps < 0:
        raise SystemExit("error: --batch_size must be >= 1 and --steps >= 0")

    if args.write_model:
        write_model(model, args.write_model, "float32")
        write_model(model, args.write_model.replace(".bin", "") + "_bf16.bin", "bfloat16")

    if not 0.0 <= args.ignore_fraction < 1.0:
        raise SystemExit(f"error: --ignore_fraction {args.ignore_fraction} not in [0, 1)")

    def shards(pattern):
        tokens, mask = load_tokens(pattern)
        starts = batch_starts(pattern, B, T)
        if len(starts) == 0:
            raise SystemExit(f"error: no shard of '{pattern}' has the {B * T + 1} tokens of one batch")
        if int(tokens.max()) >= config.vocab_size:
            raise SystemExit(f"error: token id {int(tokens.max())} >= vocab size {config.vocab_size}")
        return torch.from_numpy(tokens), torch.from_numpy(mask), starts

    if args.input_bin:
        tokens, mask, starts = shards(args.input_bin)
    else:
        gen = torch.Generator().manual_seed(args.seed + 1)
        tokens = torch.randint(0, config.vocab_size, (B * T * max(1, args.steps) + 1,), generator=gen)
        mask = torch.ones(len(tokens), dtype=torch.bool)
        starts = B * T * np.arange(max(1, args.steps))
    if args.ignore_fraction > 0:
        gen = torch.Generator().manual_seed(args.seed + 2)
        mask &= torch.rand(len(tokens), generator=gen) >= args.ignore_fraction
    val = shards(args.val_bin) if args.val_bin else None

    initial = copy.deepcopy(model) if args.write_debug else None  # the bf16 twin of the debug run starts here
    if args.fp8 and args.dtype == "bfloat16":
        use_fp8_emulation(model, args.fp8_scaled_mm)
    device = args.device
    if args.torchao_float8:
        use_torchao_float8(model, device)
    model = model.to(device)
    hp = args
    optimizer = make_optimizer(model, hp, device)
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16,
                              enabled=args.dtype == "bfloat16")
    forward = torch.compile(model) if args.compile else model

    def rows(tokens, mask, start):
        chunk = tokens[start:start + B * T + 1]
        targets = torch.where(mask[start + 1:start + B * T + 1], chunk[1:], -1)
        return chunk[:-1].view(B, T).to(device), targets.view(B, T).to(device)

    def batch(step):
        start = 0 if args.write_debug else int(starts[step % len(starts)])  # the debug state overfits one batch
        return rows(tokens, mask, start)

    if args.log:
        os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    log = open(args.log, "w") if args.log else None

    def evaluate(step):
        """The trainer's val loss: the mean over the counted targets of the first --val_batches val batches."""
        val_tokens, val_mask, val_starts = val
        count = len(val_starts) if args.val_batches < 0 else min(args.val_batches, len(val_starts))
        loss_sum, counted = 0.0, 0
        with torch.no_grad():
            for start in val_starts[:count]:
                inputs, targets = rows(val_tokens, val_mask, int(start))
                with autocast:
                    _, loss = forward(inputs, targets)
                n = int((targets >= 0).sum())
                if n:  # a batch with no counted target has a NaN mean
                    loss_sum += loss.item() * n
                    counted += n
        val_loss = loss_sum / counted if counted else float("nan")
        print(f"step {step} | val loss {val_loss:.6f} ({count} batches)", flush=True)
        if log:
            log.write(f"step {step} val_loss {val_loss:.6f}\n")
            log.flush()

    if val:
        evaluate(0)
    step_losses, step_norms, times = [], [], []
    for step in range(args.steps):
        inputs, targets = batch(step)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits, loss = forward_backward(forward, inputs, targets, autocast)
        if step == 0 and args.write_debug:
            first = (inputs, targets, logits.detach().float(), loss.detach(),
                     [g.detach().clone() for g in model.grads_in_file_order()])
        lr = lr_at(hp, step, args.steps)
        norm = clip_and_update(model, optimizer, args.grad_clip, lr)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        step_losses.append(loss.item())
        step_norms.append(norm.item())
        print(f"step {step + 1:4d}/{args.steps} | loss {loss.item():.6f} | norm {norm.item():.4f} | "
              f"{dt * 1000:.1f} ms | {B * T / dt:.0f} tok/s", flush=True)
        if log:
            log.write(f"step {step + 1} train_loss {loss.item():.6f} norm {norm.item():.4f} lr {lr:.4e} "
                      f"ms {dt * 1000:.2f}\n")
        if val and ((step + 1) % args.val_every == 0 or step + 1 == args.steps):
            evaluate(step + 1)
    if log:
        log.close()

    if len(times) > 1:
        steady = sorted(times[min(3, len(times) - 1):])
        median = steady[len(steady) // 2]
        cuda = device.startswith("cuda")
        allocated = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
        print(f"median step {median * 1000:.1f} ms | {B * T / median:.0f} tok/s | peak memory {allocated:.2f} GiB "
              f"allocated, {reserved:.2f} GiB reserved")

    if args.write_debug:
        if args.steps < 1:
            raise SystemExit("error: --write_debug needs --steps >= 1")
        inputs, targets, logits, loss, grads = first
        bf16_errors = None
        if args.dtype == "float32":  # the reference is fp32: measure what bf16 autocast (or FP8) does to the same case
            twin = use_fp8_emulation(initial, args.fp8_scaled_mm) if args.fp8 else initial
            bf16_errors = bf16_autocast_errors(twin.to(device), inputs, targets, hp, args.steps, device,
                                               (logits, loss, grads, step_losses, step_norms))
        write_debug_state(args.write_debug, model, inputs, targets, logits, loss, grads, step_losses, step_norms, hp,
                          bf16_errors)
        print(f"wrote debug state {args.write_debug}")


if __name__ == "__main__":
    main()
