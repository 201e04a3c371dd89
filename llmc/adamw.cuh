// AdamW, PyTorch (torch.optim.AdamW) semantics; a memory-bound kernel with 16-byte accesses (8 elements a thread).
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
// is kept equal to them. m and v are fp32, or bf16 (stochastically rounded too) to halve their memory.
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

// Rounds an updated value into its storage type: stochastically for bf16 (parameters, and m, v with bf16 state, each
// from its own random bits, so small updates survive on average), exactly for fp32.
__device__ __forceinline__ void adamw_round(float& dst, float x, unsigned int) { dst = x; }
__device__ __forceinline__ void adamw_round(__nv_bfloat16& dst, float x, unsigned int random_bits) {
    dst = stochastic_round_bf16(x, random_bits);
}

// The per-step scalars. step_size = lr / (1 - beta1^t), sqrt_bc2 = sqrt(1 - beta2^t), decay = 1 - lr * weight_decay:
// the same scalars, and the same order of operations, as PyTorch's single-tensor AdamW, so fp32 runs tie out closely.
// Two random streams: one for the parameter, one whose low and high 16 bits round m and v (bf16 state only; with fp32
// state the bits are unused and the compiler drops them).
struct AdamWScalars {
    float beta1, beta2, step_size, sqrt_bc2, decay, eps, grad_scale;
    unsigned int seed, step;
};

// One element: p (fp32, from the master or the parameter) and m, v updated in place, the parameter's floatX value
// written to param. index: the element's position in its tensor (the random bits depend on it).
// Every operation is spelled as an intrinsic with round-to-nearest (no FMA contraction the compiler may choose
// differently in the packed and the element-wise loop, no fast-math division or square root): the same inputs give
// the same bits on either path, so a tensor updated whole and one updated in shards (multi_gpu.cuh) agree exactly.
template <typename State>
__device__ __forceinline__ void adamw_element(const AdamWScalars& s, unsigned int param_stream,
                                              unsigned int state_stream, size_t index, float grad, float& p, State& m,
                                              State& v, floatX& param) {
    float g = __fmul_rn(grad, s.grad_scale);
    float mi = __fadd_rn(__fmul_rn(s.beta1, to_float(m)), __fmul_rn(__fsub_rn(1.0f, s.beta1), g));
    float vi = __fadd_rn(__fmul_rn(s.beta2, to_float(v)), __fmul_rn(__fmul_rn(__fsub_rn(1.0f, s.beta2), g), g));
    const unsigned int state_bits = adamw_random_bits(state_stream, index);
    adamw_round(m, mi, state_bits);
    adamw_round(v, vi, state_bits >> 16);
    p = __fmul_rn(p, s.decay);
    float denominator = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.sqrt_bc2), s.eps);
    p = __fsub_rn(p, __fmul_rn(s.step_size, __fdiv_rn(mi, denominator)));
    adamw_round(param, p, adamw_random_bits(param_stream, index));
}

// Eight consecutive elements of one array, moved with 16-byte loads and stores (one for bf16, two for fp32).
template <typename T>
struct alignas(16) Pack8 {
    T x[8];
};
template <typename T>
__device__ __forceinline__ Pack8<T> load_pack8(const T* src) {
    Pack8<T> pack;
#pragma unroll
    for (int k = 0; k < (int)sizeof(pack) / 16; k++) {
        reinterpret_cast<int4*>(&pack)[k] = reinterpret_cast<const int4*>(src)[k];
    }
    return pack;
}
template <typename T>
__device__ __forceinline__ void store_pack8(T* dst, const Pack8<T>& pack) {
#pragma unroll
    for (int k = 0; k < (int)sizeof(pack) / 16; k++) {
        reinterpret_cast<int4*>(dst)[k] = reinterpret_cast<const int4*>(&pack)[k];
    }
}

// Memory-bound: each thread takes packs of 8 elements with 16-byte accesses when `packed` (every array 16-byte
// aligned at element 0), then the last n % 8 elements (or all of them, unpacked) one by one. Both ways give the same
// bits: the same arithmetic per element, and random bits that depend on the index only.
template <typename State>
__global__ void adamw_kernel(floatX* params, float* master, const floatX* grads, State* m, State* v, size_t n,
                             AdamWScalars s, size_t index_offset, bool packed) {
    const unsigned int param_stream = adamw_stream(s.seed, s.step);
    const unsigned int state_stream = adamw_stream(s.seed ^ 0x6d6d7676u, s.step);
    const size_t thread = (size_t)blockIdx.x * blockDim.x + threadIdx.x, threads = (size_t)gridDim.x * blockDim.x;
    const size_t n_packs = packed ? n / 8 : 0;
    for (size_t i = thread; i < n_packs; i += threads) {
        const size_t at = 8 * i;
        Pack8<floatX> g = load_pack8(grads + at), param;
        Pack8<State> mp = load_pack8(m + at), vp = load_pack8(v + at);
        Pack8<float> p;
        if (master != nullptr) {
            p = load_pack8(master + at);
        } else {
            param = load_pack8(params + at);
            for (int k = 0; k < 8; k++) p.x[k] = to_float(param.x[k]);
        }
#pragma unroll
        for (int k = 0; k < 8; k++)
            adamw_element(s, param_stream, state_stream, index_offset + at + k, to_float(g.x[k]), p.x[k], mp.x[k],
                          vp.x[k], param.x[k]);
        store_pack8(m + at, mp);
        store_pack8(v + at, vp);
        if (master != nullptr) store_pack8(master + at, p);
        store_pack8(params + at, param);
    }
    for (size_t i = 8 * n_packs + thread; i < n; i += threads) {
        float p = master != nullptr ? master[i] : to_float(params[i]);
        adamw_element(s, param_stream, state_stream, index_offset + i, to_float(grads[i]), p, m[i], v[i], params[i]);
        if (master != nullptr) master[i] = p;
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
    AdamWScalars s;
    s.beta1 = beta1;
    s.beta2 = beta2;
    s.step_size = (float)((double)lr / bias_correction1);
    s.sqrt_bc2 = (float)sqrt(bias_correction2);
    s.decay = (float)(1.0 - (double)lr * (double)weight_decay);
    s.eps = eps;
    s.grad_scale = grad_scale;
    s.seed = seed;
    s.step = (unsigned int)step;
    auto aligned = [](const void* p) { return p == nullptr || (uintptr_t)p % 16 == 0; };
    const bool packed = aligned(params) && aligned(master) && aligned(grads) && aligned(m) && aligned(v);
    const int block = 512;
    // grid-stride: a fixed cap keeps the grid small for multi-billion-element buffers (each thread then loops)
    size_t blocks = ceil_div<size_t>(packed ? ceil_div<size_t>(n, 8) : n, block);
    unsigned grid = (unsigned)(blocks < 65536 ? blocks : 65536);
    adamw_kernel<<<grid, block, 0, stream>>>(params, master, grads, m, v, n, s, index_offset, packed);
    cudaCheckLaunch();
}
