// Random initialisation of a from-scratch model, on the GPU (an 8B model has 8e9 values: too many for the host).
//
//   w[i] = std * z_i,  z_i ~ N(0, 1) from a Box-Muller transform of two uniforms hashed from (seed, tensor, i)
//   gains (the RMSNorm weights) = 1
//
// Every element's value depends only on (seed, tensor, i), so the init is the same on any GPU and grid size, and a
// part of a tensor initialised on its own (index_offset: its first element's i) gets the whole tensor's values.
// The distribution matches scripts/train_llama3.py (N(0, 0.02), wo and w2 at 0.02 / sqrt(2 L)); the values do not,
// since PyTorch draws from its own generator.
#pragma once

#include <cstdint>

#include "cuda_common.h"
#include "hash.h"

__global__ void init_normal_kernel(floatX* params, float* master, size_t n, float std, uint64_t stream_seed,
                                   size_t index_offset) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint64_t bits = splitmix64(stream_seed ^ splitmix64(index_offset + i));
    // two 24-bit uniforms in (0, 1]
    float u1 = ((float)(bits >> 40) + 1.0f) * (1.0f / 16777216.0f);
    float u2 = (float)((bits >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
    float value = std * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    params[i] = from_float<floatX>(value);
    if (master != nullptr) master[i] = value;
}

__global__ void init_constant_kernel(floatX* params, float* master, size_t n, float value) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    params[i] = from_float<floatX>(value);
    if (master != nullptr) master[i] = value;
}

// std > 0: normal init; std == 0: constant 1 (gains). `tensor` separates the random streams of the tensors.
inline void init_tensor(floatX* params, float* master, size_t n, float std, uint64_t seed, int tensor,
                        cudaStream_t stream, size_t index_offset = 0) {
    if (n == 0) return;
    const int block = 256;
    unsigned int grid = (unsigned int)ceil_div<size_t>(n, block);
    if (std > 0.0f) {
        init_normal_kernel<<<grid, block, 0, stream>>>(params, master, n, std, seed * 1000003ull + (uint64_t)tensor,
                                                       index_offset);
    } else {
        init_constant_kernel<<<grid, block, 0, stream>>>(params, master, n, 1.0f);
    }
    cudaCheckLaunch();
}
