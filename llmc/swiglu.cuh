// SwiGLU, the gate of Llama's feed-forward block: out = silu(gate) * up.
//
//   inp (N, 2F): per row the first F values are the gate g = w1 x, the next F the up projection u = w3 x
//   (the w13 weight stacks w1 over w3, so one matmul produces both). out (N, F).
//   forward:   out = silu(g) * u,                 silu(g) = g * sigmoid(g)
//   backward:  dg = dout * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))      (d silu / dg)
//              du = dout * silu(g)                dinp = [dg | du] (N, 2F), overwritten
//              and, optionally, out again: with activation recomputation the backward needs both, and one pass over
//              inp serves both (bit-identical to the forward's out: the same expression on the same values).
// All math in fp32, rounded once to floatX on store.
//
// One thread per 16 bytes of output (8 bf16 / 4 fp32) when F is a multiple of that and the pointers are 16-byte
// aligned (then gate, up and out row starts all are); otherwise one element per thread (e.g. F = 100 in bf16).
// For the FP8 mode each kernel can also take the amax of what it writes (out forward, dinp backward; llmc/fp8.cuh):
// then a grid of about one wave strides over the tensor, so that few blocks commit their amax (block_commit_amax).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda_common.h"

// expf of a large positive -g overflows to inf, giving sigmoid 0 (the right limit), so no clamping is needed.
__device__ __forceinline__ float swiglu_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// The largest |x| bits of VEC values as they are stored (rounded to floatX).
template <int VEC>
__device__ __forceinline__ unsigned int swiglu_stored_amax(const float* x, unsigned int bits) {
    for (int j = 0; j < VEC; j++) bits = max(bits, abs_bits(to_float(from_float<floatX>(x[j]))));
    return bits;
}

template <int VEC, bool AMAX>
__global__ void swiglu_forward_kernel(floatX* out, unsigned int* amax_bits, const floatX* inp, int N, int F) {
    unsigned int out_amax = 0;
    for (size_t idx = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC; idx < (size_t)N * F;  // into out (N, F)
         idx += (size_t)gridDim.x * blockDim.x * VEC) {
        size_t n = idx / F;
        int f = (int)(idx % F);  // VEC divides F: the VEC elements share a row
        const floatX* gate = inp + n * 2 * F + f;
        float g[VEC], u[VEC], o[VEC];
        load_as_float<VEC>(g, gate);
        load_as_float<VEC>(u, gate + F);
        for (int j = 0; j < VEC; j++) o[j] = g[j] * swiglu_sigmoid(g[j]) * u[j];
        store_from_float<VEC>(out + idx, o);
        if constexpr (AMAX) out_amax = swiglu_stored_amax<VEC>(o, out_amax);
    }
    if constexpr (AMAX) block_commit_amax(amax_bits, out_amax);
}

template <int VEC, bool AMAX>
__global__ void swiglu_backward_kernel(floatX* dinp, floatX* out, unsigned int* amax_bits, const floatX* dout,
                                       const floatX* inp, int N, int F) {
    unsigned int dinp_amax = 0;
    for (size_t idx = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC; idx < (size_t)N * F;  // into dout
         idx += (size_t)gridDim.x * blockDim.x * VEC) {
        size_t n = idx / F;
        int f = (int)(idx % F);
        size_t in_off = n * 2 * F + f;
        float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC], o[VEC];
        load_as_float<VEC>(g, inp + in_off);
        load_as_float<VEC>(u, inp + in_off + F);
        load_as_float<VEC>(d, dout + idx);
        for (int j = 0; j < VEC; j++) {
            float s = swiglu_sigmoid(g[j]);
            dg[j] = d[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
            du[j] = d[j] * g[j] * s;
            o[j] = g[j] * s * u[j];
        }
        store_from_float<VEC>(dinp + in_off, dg);
        store_from_float<VEC>(dinp + in_off + F, du);
        if (out != nullptr) store_from_float<VEC>(out + idx, o);
        if constexpr (AMAX) dinp_amax = swiglu_stored_amax<VEC>(du, swiglu_stored_amax<VEC>(dg, dinp_amax));
    }
    if constexpr (AMAX) block_commit_amax(amax_bits, dinp_amax);
}

inline bool swiglu_vec_ok(int F, const void* a, const void* b, const void* c = nullptr) {
    return F % VEC16 == 0 && (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) & 15) == 0;
}

constexpr int SWIGLU_BLOCK = 256;
// Blocks for `threads` threads: one each, or with an amax at most 64 per SM of an H100 (132 SMs), striding. At the
// 1B's shape (H200, dev/cuda/swiglu.cu) 64 per SM was the fastest: forward + amax 0.205 ms against 0.241 at 8 per
// SM and 0.231 with a block per 256 threads (65536 atomics); the forward alone 0.197.
inline unsigned swiglu_grid(size_t threads, bool amax) {
    size_t blocks = ceil_div<size_t>(threads, SWIGLU_BLOCK);
    return (unsigned)(amax ? std::min<size_t>(blocks, 64 * 132) : blocks);
}

// out (N, F) = silu(inp[:, :F]) * inp[:, F:]. Overwrites out. out_amax: nullptr, or a float that becomes
// max(itself, max |out|) (zero it first for out's amax alone).
inline void swiglu_forward(floatX* out, const floatX* inp, int N, int F, cudaStream_t stream,
                           float* out_amax = nullptr) {
    if (N <= 0 || F <= 0) return;
    size_t elems = (size_t)N * F;
    unsigned int* bits = reinterpret_cast<unsigned int*>(out_amax);
    const bool vec = swiglu_vec_ok(F, out, inp), amax = out_amax != nullptr;
    const unsigned grid = swiglu_grid(vec ? elems / VEC16 : elems, amax);
    if (vec && amax) swiglu_forward_kernel<VEC16, true><<<grid, SWIGLU_BLOCK, 0, stream>>>(out, bits, inp, N, F);
    else if (vec) swiglu_forward_kernel<VEC16, false><<<grid, SWIGLU_BLOCK, 0, stream>>>(out, bits, inp, N, F);
    else if (amax) swiglu_forward_kernel<1, true><<<grid, SWIGLU_BLOCK, 0, stream>>>(out, bits, inp, N, F);
    else swiglu_forward_kernel<1, false><<<grid, SWIGLU_BLOCK, 0, stream>>>(out, bits, inp, N, F);
    cudaCheckLaunch();
}

// dinp (N, 2F) = [dgate | dup]. Overwrites dinp (must not alias dout or inp). out: nullptr, or (N, F) overwritten
// with the forward's output (recomputed). dinp_amax: nullptr, or a float that becomes max(itself, max |dinp|).
inline void swiglu_backward(floatX* dinp, floatX* out, const floatX* dout, const floatX* inp, int N, int F,
                            cudaStream_t stream, float* dinp_amax = nullptr) {
    if (N <= 0 || F <= 0) return;
    size_t elems = (size_t)N * F;
    unsigned int* bits = reinterpret_cast<unsigned int*>(dinp_amax);
    const bool vec = swiglu_vec_ok(F, dinp, dout, inp) && swiglu_vec_ok(F, out, dinp), amax = dinp_amax != nullptr;
    const unsigned grid = swiglu_grid(vec ? elems / VEC16 : elems, amax);
    if (vec && amax) {
        swiglu_backward_kernel<VEC16, true><<<grid, SWIGLU_BLOCK, 0, stream>>>(dinp, out, bits, dout, inp, N, F);
    } else if (vec) {
        swiglu_backward_kernel<VEC16, false><<<grid, SWIGLU_BLOCK, 0, stream>>>(dinp, out, bits, dout, inp, N, F);
    } else if (amax) {
        swiglu_backward_kernel<1, true><<<grid, SWIGLU_BLOCK, 0, stream>>>(dinp, out, bits, dout, inp, N, F);
    } else {
        swiglu_backward_kernel<1, false><<<grid, SWIGLU_BLOCK, 0, stream>>>(dinp, out, bits, dout, inp, N, F);
    }
    cudaCheckLaunch();
}
