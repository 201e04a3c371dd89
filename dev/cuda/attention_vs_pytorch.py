"""Side by side: llmc's causal GQA attention (llmc/attention.cuh) against PyTorch SDPA's flash and cuDNN backends.

For each shape (B, H, KV, T, D) it makes random bf16 q, k, v packed the way llmc wants them (qkv (B, T, (H + 2 KV) D)),
gives PyTorch (B, H, T, D) / (B, KV, T, D) copies, checks our output and gradients against PyTorch's (relative error
norm ||ours - torch|| / ||torch||, bf16 tolerance 1e-2), times forward and forward + backward (CUDA events, median
of --iters runs after warm-up, the contenders' runs interleaved round by round, each queued behind a spin kernel so
the events time the GPU's work alone: see time_ms) and prints TFLOP/s and our ratio to each backend. Causal FLOP
convention: forward 2 B H T^2 D (half of the 4 B H T^2 D of the two full matmuls), backward 2.5x that, forward +
backward 3.5x.

Our side runs through attention_lib.cu (a C ABI over llmc's attention_forward / attention_backward, called on
PyTorch's current stream), which this script builds with nvcc into --build-dir on first use (and whenever the sources
are newer than the library).

PyTorch's GQA: SDPA is called with enable_gqa=True; a backend that refuses it gets K and V expanded to H heads with
repeat_interleave, outside the timed region (their gradients are summed back over the group for the check).
Our forward + backward includes everything the trainer runs: forward (out, lse), backward (delta + dK/dV + dQ).
PyTorch's includes autograd's own work for one SDPA node.

--backward v6 runs attention_backward.cu's one-pass v6 (llmc_attention_backward_v6) instead of the trainer's (v10).

Usage (on the GPU machine):  python dev/cuda/attention_vs_pytorch.py [--iters 30] [--build-dir /tmp/llmc_attention]
                             [--backward trainer|v6]
"""

import argparse
import ctypes
import os
import statistics
import subprocess

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SHAPES = [(4, 32, 8, 2048, 64), (2, 32, 8, 4096, 128), (1, 32, 8, 8192, 128)]  # (B, H, KV, T, D)
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
TOLERANCE = 1e-2
HOST_AHEAD_CYCLES = 2_000_000  # about 1 ms of spinning on the GPU: the host queues the timed run meanwhile


def build_library(build_dir):
    src = os.path.join(HERE, "attention_lib.cu")
    deps = [src, os.path.join(HERE, "attention_backward_v6.cuh")]
    deps += [os.path.join(REPO, "llmc", name) for name in os.listdir(os.path.join(REPO, "llmc"))
             if name.endswith((".h", ".cuh"))]
    lib = os.path.join(build_dir, "libllmc_attention.so")
    if not os.path.exists(lib) or os.path.getmtime(lib) < max(os.path.getmtime(d) for d in deps):
        os.makedirs(build_dir, exist_ok=True)
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        cmd = ["nvcc", "-O3", "-std=c++17", "--use_fast_math", "-shared", "-Xcompiler", "-fPIC",
               "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-o", lib, src]
        print("building:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    so = ctypes.CDLL(lib)
    p, i = ctypes.c_void_p, ctypes.c_int
    so.llmc_attention_is_bf16.restype = i
    so.llmc_attention_forward.argtypes = [p, p, p, i, i, i, i, i, p]
    so.llmc_attention_forward.restype = None
    so.llmc_attention_backward.argtypes = [p, p, p, p, p, p, i, i, i, i, i, p]
    so.llmc_attention_backward.restype = None
    so.llmc_attention_backward_v6.argtypes = [p, p, p, p, p, p, i, i, i, i, i, p]
    so.llmc_attention_backward_v6.restype = None
    assert so.llmc_attention_is_bf16() == 1, "the library must be the bf16 build"
    return so


def rel_err(ours, ref):
    ours, ref = ours.float(), ref.float()
    return ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_ms(fns, iters, warmup=5):
    """Median time in ms of each function of `fns` (name -> fn) over `iters` runs after `warmup`, with CUDA events
    on the current stream. The runs are interleaved: each round runs every function once, in an order rotated from
    round to round, so that all of them meet the same clock and temperature history (at its power cap the GPU's
    clock follows the work of the last few milliseconds; timing one contender after another favours whichever runs
    on the cooler GPU). Each run is queued behind a spin kernel of HOST_AHEAD_CYCLES, so that the time between the
    events is the GPU's work alone, not the host's latency in launching it (larger for PyTorch's dispatch and
    autograd than for our one C call; in training the host runs ahead and hides it)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times = {name: [] for name in names}
    for i in range(iters):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOST_AHEAD_CYCLES)
            start.record()
            fns[name]()
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop))
    return {name: statistics.median(t) for name, t in times.items()}


class Ours:
    """llmc attention on the packed layouts, with its buffers allocated once."""

    def __init__(self, so, qkv, B, H, KV, T, D, backward="trainer"):
        self.so, self.qkv, self.shape = so, qkv, (B, T, H, KV, D)
        self.backward_fn = so.llmc_attention_backward_v6 if backward == "v6" else so.llmc_attention_backward
        self.out = torch.empty(B, T, H * D, device="cuda", dtype=torch.bfloat16)
        self.lse = torch.empty(B, H, T, device="cuda", dtype=torch.float32)
        self.dqkv = torch.empty_like(qkv)
        self.delta = torch.empty(B, H, T, device="cuda", dtype=torch.float32)

    def forward(self):
        s = torch.cuda.current_stream().cuda_stream
        self.so.llmc_attention_forward(self.out.data_ptr(), self.lse.data_ptr(), self.qkv.data_ptr(), *self.shape, s)

    def backward(self, dout):
        s = torch.cuda.current_stream().cuda_stream
        self.backward_fn(self.dqkv.data_ptr(), self.delta.data_ptr(), dout.data_ptr(),
                         self.qkv.data_ptr(), self.out.data_ptr(), self.lse.data_ptr(), *self.shape, s)

    def forward_backward(self, dout):
        self.forward()
        self.backward(dout)


class Torch:
    """One SDPA backend on (B, H, T, D) copies; enable_gqa=True, or K, V expanded to H heads if it is refused."""

    def __init__(self, backend, q, k, v, group):
        self.backend, self.q, self.group = backend, q, group
        self.gqa = True
        self.k, self.v = k, v
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
        except RuntimeError:
            self.gqa = False  # expand outside the timed region; leaves of their own, so no repeat in backward
            self.k = k.detach().repeat_interleave(group, dim=1).requires_grad_(True)
            self.v = v.detach().repeat_interleave(group, dim=1).requires_grad_(True)

    def forward(self):
        with sdpa_kernel([self.backend]):
            if self.gqa:
                return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True)

    def forward_backward(self, dout):
        o = self.forward()
        return o, torch.autograd.grad(o, (self.q, self.k, self.v), grad_outputs=dout)

    def grads_kv_heads(self, grads):
        """dq, dk, dv with dk, dv as (B, KV, T, D), summing the expanded heads of a group if K, V were expanded."""
        dq, dk, dv = grads
        if not self.gqa:
            B, H, T, D = dk.shape
            dk = dk.float().view(B, H // self.group, self.group, T, D).sum(2)
            dv = dv.float().view(B, H // self.group, self.group, T, D).sum(2)
        return dq, dk, dv


def run_shape(so, B, H, KV, T, D, iters, backward):
    torch.manual_seed(0)
    # Packed qkv as llmc wants it; PyTorch gets contiguous (B, heads, T, D) copies of the same values.
    qkv = torch.randn(B, T, (H + 2 * KV) * D, device="cuda", dtype=torch.bfloat16)
    heads = qkv.view(B, T, H + 2 * KV, D)
    q = heads[:, :, :H].transpose(1, 2).contiguous().requires_grad_(True)
    k = heads[:, :, H:H + KV].transpose(1, 2).contiguous().requires_grad_(True)
    v = heads[:, :, H + KV:].transpose(1, 2).contiguous().requires_grad_(True)
    dout_t = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)  # PyTorch's layout
    dout = dout_t.transpose(1, 2).reshape(B, T, H * D).contiguous()        # ours

    ours = Ours(so, qkv, B, H, KV, T, D, backward)
    ours.forward_backward(dout)
    torch.cuda.synchronize()
    dqkv = ours.dqkv.view(B, T, H + 2 * KV, D)
    ours_o = ours.out.view(B, T, H, D).transpose(1, 2)
    ours_grads = (dqkv[:, :, :H].transpose(1, 2), dqkv[:, :, H:H + KV].transpose(1, 2),
                  dqkv[:, :, H + KV:].transpose(1, 2))

    flops_fwd = 2.0 * B * H * T * T * D
    forward = {"ours": ours.forward}
    forward_backward = {"ours": lambda: ours.forward_backward(dout)}
    ok = True
    for name, backend in BACKENDS.items():
        try:
            t = Torch(backend, q, k, v, H // KV)
            o, grads = t.forward_backward(dout_t)
        except RuntimeError as e:  # the backend cannot run this shape at all
            print(f"  {name}: unavailable ({str(e).splitlines()[0][:100]})")
            continue
        dq, dk, dv = t.grads_kv_heads(grads)
        errs = {"out": rel_err(ours_o, o), "dq": rel_err(ours_grads[0], dq), "dk": rel_err(ours_grads[1], dk),
                "dv": rel_err(ours_grads[2], dv)}
        good = all(e <= TOLERANCE for e in errs.values())
        ok &= good
        print(f"  vs {name:5s} ({'enable_gqa' if t.gqa else 'expanded kv'}): "
              + "  ".join(f"{n} {e:.2e}" for n, e in errs.items()) + ("  OK" if good else "  FAIL"))
        del o, grads

        # The training forward (inputs require grad, so the backend also keeps its softmax statistics, as ours
        # keeps lse); the output and its graph are dropped at once.
        forward[name] = t.forward
        forward_backward[name] = lambda t=t: t.forward_backward(dout_t)
    fwd_ms, fwdbwd_ms = time_ms(forward, iters), time_ms(forward_backward, iters)
    row = {name: {"fwd": fwd_ms[name], "fwdbwd": fwdbwd_ms[name]} for name in forward}
    tflops = {n: (flops_fwd / (r["fwd"] * 1e-3) / 1e12, 3.5 * flops_fwd / (r["fwdbwd"] * 1e-3) / 1e12)
              for n, r in row.items()}
    return tflops, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30, help="timed runs per measurement (median reported), >= 20")
    ap.add_argument("--build-dir", default="/tmp/llmc_attention", help="where libllmc_attention.so is built")
    ap.add_argument("--backward", choices=["trainer", "v6"], default="trainer",
                    help="our backward: the trainer's (attention_backward.cu v10) or the one-pass v6")
    args = ap.parse_args()
    assert args.iters >= 20, "use at least 20 timed runs"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
          f"our backward {args.backward}")
    so = build_library(args.build_dir)

    results, all_ok = [], True
    for B, H, KV, T, D in SHAPES:
        print(f"(B, H, KV, T, D) = ({B}, {H}, {KV}, {T}, {D})")
        tflops, ok = run_shape(so, B, H, KV, T, D, args.iters, args.backward)
        all_ok &= ok
        results.append(((B, H, KV, T, D), tflops))

    print()
    print("TFLOP/s (causal: fwd 2 B H T^2 D, fwd+bwd 3.5x that); ratio = ours / backend")
    names = list(BACKENDS)
    header = f"{'(B, H, KV, T, D)':>22} | {'ours fwd':>8} {'f+b':>7}"
    for n in names:
        header += f" | {n + ' fwd':>9} {'f+b':>7} {'ratio fwd':>9} {'f+b':>6}"
    print(header)
    print("-" * len(header))
    for shape, tf in results:
        line = f"{str(shape):>22} | {tf['ours'][0]:8.1f} {tf['ours'][1]:7.1f}"
        for n in names:
            if n in tf:
                line += (f" | {tf[n][0]:9.1f} {tf[n][1]:7.1f} {tf['ours'][0] / tf[n][0]:9.2f}"
                         f" {tf['ours'][1] / tf[n][1]:6.2f}")
            else:
                line += f" | {'n/a':>9} {'':>7} {'':>9} {'':>6}"
        print(line)
    print("correctness:", "all OK" if all_ok else "FAILED (see above)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
