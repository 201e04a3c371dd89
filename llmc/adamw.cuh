// AdamW with fp32 optimizer state, PyTorch (torch.optim.AdamW) semantics, one thread per parameter.
//
//   g = grad * grad_scale                          (grad_scale = min(1, max_norm / norm) implements clipping)
//   p = p - lr * weight_decay * p                  (decoupled weight decay, applied before the Adam step)
//   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2
//   p = p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)          t = step, 1-based
//
// Master weights: in bf16 builds `master` (fp32, n) holds the real parameter; it is updated and the bf16 copy in
// `params` is written from it with stochastic rounding, so updates far below one bf16 ulp still move the bf16
// weights in expectation. The random bits are a hash of (seed, step, index): reproducible run to run, different
// every step even if the caller keeps `seed` fixed. Without a master (nullptr), the bf16 parameter itself is read,
// updated in fp32 and stochastically rounded back. In fp32 builds params are updated exactly; a non-null master
// is kept equal to them.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda_common.h"
#include "hash.h"

// Random bits for stochastic rounding: a stream per (seed, step), mixed once per thread, then one hash per element
// and use. The index's high half (non-zero only past 2^32 elements) is folded in by a multiply, not a third hash:
// the optimizer is one of the few memory-bound kernels whose integer work shows (4 hashes per draw made the bf16
// state path compute-bound).
__device__ __forceinline__ unsigned int adamw_stream(unsigned int seed, unsigned int step) {
    return hash32(hash32(seed ^ 0x9e3779b9U) ^ step);
}
__device__ __forceinline__ unsigned int adamw_random_bits(unsigned int stream, size_t index) {
    return hash32(stream ^ (unsigned int)index ^ ((unsigned int)(index >> 32) * 0x9e3779b9U));
}

// Rounds x to bf16 up or down with probability proportional to its distance to each neighbour: bf16 is the top
// 16 bits of fp32, so adding 16 uniform random bits to the low half and truncating rounds up exactly when the
// random value exceeds the remaining fraction. Sign-magnitude makes this symmetric for negative x. Inf and NaN
// pass through round-to-nearest (adding bits could turn an inf into a NaN).
__device__ __forceinline__ __nv_bfloat16 stochastic_round_bf16(float x, unsigned int random_bits) {
    unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7f800000U) == 0x7f800000U) return __float2bfloat16_rn(x);
    bits += random_bits & 0xffffU;
    return __ushort_as_bfloat16((unsigned short)(bits >> 16));
}

// Writes an updated parameter value to floatX: stochastic rounding for bf16, exact for fp32.
__device__ __forceinline__ void adamw_store_param(float* dst, float x, unsigned int) { *dst = x; }
__device__ __forceinline__ void adamw_store_param(__nv_bfloat16* dst, float x, unsigned int random_bits) {
    *dst = stochastic_round_bf16(x, random_bits);
}

// The optimizer state m, v is fp32, or bf16 to halve its memory (an option for large models). bf16 state is
// written with stochastic rounding too, from its own random bits, so small updates to m and v survive on average.
__device__ __forceinline__ void adamw_store_state(float* dst, float x, unsigned int) { *dst = x; }
__device__ __forceinline__ void adamw_store_state(__nv_bfloat16* dst, float x, unsigned int random_bits) {
    *dst = stochastic_round_bf16(x, random_bits);
}

// step_size = lr / (1 - beta1^t), sqrt_bc2 = sqrt(1 - beta2^t), decay = 1 - lr * weight_decay: the same scalars,
// and the same order of operations, as PyTorch's single-tensor AdamW, so fp32 runs tie out closely.
template <typename State>
__global__ void adamw_kernel(floatX* params, float* master, const floatX* grads, State* m, State* v, size_t n,
                             float beta1, float beta2, float step_size, float sqrt_bc2, float decay, float eps,
                             float grad_scale, unsigned int seed, unsigned int step, size_t index_offset) {
    // Two streams: one for the parameter, one whose low and high 16 bits round m and v (bf16 state only; with fp32
    // state the bits are unused and the compiler drops them).
    const unsigned int param_stream = adamw_stream(seed, step), state_stream = adamw_stream(seed ^ 0x6d6d7676u, step);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = to_float(grads[i]) * grad_scale;
        float p = master != nullptr ? master[i] : to_float(params[i]);
        float mi = beta1 * to_float(m[i]) + (1.0f - beta1) * g;
        float vi = beta2 * to_float(v[i]) + (1.0f - beta2) * g * g;
        const unsigned int state_bits = adamw_random_bits(state_stream, index_offset + i);
        adamw_store_state(m + i, mi, state_bits);
        adamw_store_state(v + i, vi, state_bits >> 16);
        p *= decay;
        p -= step_size * (mi / (sqrtf(vi) / sqrt_bc2 + eps));
        if (master != nullptr) master[i] = p;
        adamw_store_param(params + i, p, adamw_random_bits(param_stream, index_offset + i));
    }
}

// Updates params (and master, m, v) in place for n elements. m and v (State: float or __nv_bfloat16) start at zero
// before step 1.
// weight_decay applies to every element passed: call separately (weight_decay = 0) for the norm gains.
// seed: any value; the bits also depend on step, so a fixed seed still gives fresh rounding every step.
// index_offset: the position of element 0 within its tensor, so that a slice updated on its own (a rank's shard of
// the optimizer, llmc/multi_gpu.cuh) draws the same random bits as the whole tensor updated at once.
template <typename State>
inline void adamw_update(floatX* params, float* master, const floatX* grads, State* m, State* v, size_t n, float lr,
                         float beta1, float beta2, int step, float eps, float weight_decay, float grad_scale,
                         unsigned int seed, cudaStream_t stream, size_t index_offset = 0) {
    if (n == 0) return;
    if (step < 1) {
        fprintf(stderr, "Error: adamw_update step %d, steps are 1-based\n", step);
        fail_exit();
    }
    // scalars in double, as PyTorch computes them in Python floats
    double bias_correction1 = 1.0 - pow((double)beta1, step);
    double bias_correction2 = 1.0 - pow((double)beta2, step);
    float step_size = (float)((double)lr / bias_correction1);
    float sqrt_bc2 = (float)sqrt(bias_correction2);
    float decay = (float)(1.0 - (double)lr * (double)weight_decay);
    const int block = 512;
    // grid-stride: a fixed cap keeps the grid small for multi-billion-element buffers (each thread then loops)
    size_t blocks = ceil_div<size_t>(n, block);
    unsigned grid = (unsigned)(blocks < 65536 ? blocks : 65536);
    adamw_kernel<<<grid, block, 0, stream>>>(params, master, grads, m, v, n, beta1, beta2, step_size, sqrt_bc2, decay,
                                             eps, grad_scale, seed, (unsigned int)step, index_offset);
    cudaCheckLaunch();
}
