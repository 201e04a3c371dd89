// Global L2 norm of the gradients, for clipping, bit-identical run to run.
//
//   norm = sqrt(sum_i g_i^2) over every gradient element (fp32 accumulation of floatX values)
//
// Determinism comes from fixing who adds what, in which order, independent of timing: global_norm_squared always
// launches GLOBAL_NORM_BLOCKS blocks of GLOBAL_NORM_THREADS threads; element (or 16-byte vector) k always goes to
// thread k mod (total threads), each thread sums its elements in ascending order, each block reduces its threads by
// a fixed shuffle tree and writes (overwrites) its one partial to partials[slot * GLOBAL_NORM_BLOCKS + block].
// global_norm_finish then adds all partials of slots [0, n_slots_used) in a fixed strided order and a fixed tree.
// No atomics anywhere.
//
// Use: the trainer's gradients are one contiguous floatX buffer, so one call with slot 0 over the whole buffer,
// then finish with n_slots_used = 1. To sum several separate tensors, give each call its own slot (0, 1, 2, ...)
// and pass the number of slots to finish; every slot in [0, n_slots_used) must have been written (a call with
// count 0 writes zeros). partials needs global_norm_scratch_floats(n_slots) floats.
#pragma once

#include <cstdint>

#include "cuda_common.h"

// 1024 x 256 = 262144 threads, about one full wave on an H100 (132 SMs x 2048 threads). Never derived from the
// device: the partition, and so the rounding, must not change between runs or machines.
constexpr int GLOBAL_NORM_BLOCKS = 1024;
constexpr int GLOBAL_NORM_THREADS = 256;
constexpr int GLOBAL_NORM_FINISH_THREADS = 1024;

inline size_t global_norm_scratch_floats(int n_slots = 1) { return (size_t)n_slots * GLOBAL_NORM_BLOCKS; }

// The buffer is split like the classifier's rows: a scalar head up to the first 16-byte boundary, an aligned body
// of 16-byte vectors, and a scalar tail. Head and tail elements go to the first threads of the grid.
__global__ void __launch_bounds__(GLOBAL_NORM_THREADS)
    global_norm_squared_kernel(float* partials, const floatX* values, size_t count, int slot) {
    __shared__ float scratch[32];
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    int misalign = (int)((uintptr_t)values & 15);
    size_t head = misalign == 0 ? 0 : (size_t)((16 - misalign) / (int)sizeof(floatX));
    if (head > count) head = count;
    size_t n_vec = (count - head) / VEC16;
    size_t tail = head + n_vec * VEC16;
    size_t n_scalar = head + (count - tail);  // < 2 * VEC16, far fewer than the threads

    float acc = 0.0f;
    if (tid < n_scalar) {
        float x = to_float(values[tid < head ? tid : tail + (tid - head)]);
        acc += x * x;
    }
    const int4* body = reinterpret_cast<const int4*>(values + head);
    for (size_t k = tid; k < n_vec; k += stride) {
        int4 raw = body[k];
        const floatX* x = reinterpret_cast<const floatX*>(&raw);
        for (int j = 0; j < VEC16; j++) {
            float f = to_float(x[j]);
            acc += f * f;
        }
    }
    acc = block_reduce_sum(acc, scratch);
    if (threadIdx.x == 0) partials[(size_t)slot * GLOBAL_NORM_BLOCKS + blockIdx.x] = acc;
}

// One block: thread t sums partials t, t + 1024, ... in order, then a fixed tree; writes sqrt of the total.
__global__ void __launch_bounds__(GLOBAL_NORM_FINISH_THREADS)
    global_norm_finish_kernel(float* out_norm, const float* partials, int n_partials) {
    __shared__ float scratch[32];
    float acc = 0.0f;
    for (int i = threadIdx.x; i < n_partials; i += blockDim.x) acc += partials[i];
    acc = block_reduce_sum(acc, scratch);
    if (threadIdx.x == 0) *out_norm = sqrtf(acc);
}

// partials[slot * GLOBAL_NORM_BLOCKS .. +GLOBAL_NORM_BLOCKS) = per-block sums of values^2 (overwritten).
inline void global_norm_squared(float* partials, const floatX* values, size_t count, int slot, cudaStream_t stream) {
    global_norm_squared_kernel<<<GLOBAL_NORM_BLOCKS, GLOBAL_NORM_THREADS, 0, stream>>>(partials, values, count, slot);
    cudaCheckLaunch();
}

// *out_norm (device fp32 scalar, overwritten) = sqrt(sum of the partials of slots [0, n_slots_used)).
inline void global_norm_finish(float* out_norm, const float* partials, int n_slots_used, cudaStream_t stream) {
    int n_partials = n_slots_used * GLOBAL_NORM_BLOCKS;
    global_norm_finish_kernel<<<1, GLOBAL_NORM_FINISH_THREADS, 0, stream>>>(out_norm, partials, n_partials);
    cudaCheckLaunch();
}
