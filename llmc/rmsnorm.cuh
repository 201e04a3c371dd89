// RMSNorm over the last dimension, and its backward.
//
//   forward:  rstd[n] = 1 / sqrt(mean_c x[n,c]^2 + eps),   out[n,c] = x[n,c] * rstd[n] * weight[c]
//   backward: with xhat = x * rstd and dxhat = dout * weight,
//             dx[n,c]     = rstd[n] * (dxhat[n,c] - xhat[n,c] * mean_c(dxhat[n,:] * xhat[n,:]))
//             dweight[c]  = sum_n dout[n,c] * xhat[n,c]
// x, out, dout, dinp: (N, C) row-major floatX; weight, dweight: (C) floatX; rstd: (N) fp32, saved for backward.
// The normalised value is computed in fp32 and rounded to floatX once (PyTorch's Llama rounds x*rstd to the input
// dtype before the weight multiply; the difference is within one bf16 rounding).
//
// Forward and dinp use one warp per row, reading the row twice (sum of squares, then the output; the second read
// hits L1/L2). dweight is a column reduction over rows, done without atomics so it is bit-identical run to run:
// rows are cut into R fixed chunks (R depends only on N), each (column slice, chunk) block writes fp32 partial sums
// to `scratch` (R x C), and a second kernel adds the R partials per column in a fixed order.
#pragma once

#include <cstdint>

#include "cuda_common.h"

// The 16-byte path needs every row start aligned: C a multiple of VEC16 and the base pointers aligned.
// (nullptr counts as aligned, for unused pointers.)
inline bool rmsnorm_vec_ok(int C, const void* a, const void* b, const void* c, const void* d = nullptr,
                           const void* e = nullptr) {
    uintptr_t bits = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e;
    return C % VEC16 == 0 && (bits & 15) == 0;
}

// ------------------------------------------------------------------------------------------------ forward

// One warp per row. FUSED: x = round(a + b) is first written to residual_out, and the norm uses the rounded values
// (what the next layer's residual stream holds). Otherwise x = a (b and residual_out unused).
// residual_out may alias a or b: each element is read and written by the same thread, reads first.
template <int VEC, bool FUSED>
__global__ void rmsnorm_forward_kernel(floatX* residual_out, floatX* out, float* rstd, const floatX* a,
                                       const floatX* b, const floatX* weight, int N, int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t off = (size_t)row * C;
    float sum_sq = 0.0f;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float x[VEC];
        load_as_float<VEC>(x, a + off + c);
        if constexpr (FUSED) {
            float y[VEC];
            load_as_float<VEC>(y, b + off + c);
            for (int j = 0; j < VEC; j++) x[j] = to_float(from_float<floatX>(x[j] + y[j]));  // round as stored
            store_from_float<VEC>(residual_out + off + c, x);
        }
        for (int j = 0; j < VEC; j++) sum_sq += x[j] * x[j];
    }
    sum_sq = warp_reduce_sum(sum_sq);
    float r = rsqrtf(sum_sq / (float)C + eps);
    const floatX* x_src = FUSED ? residual_out : a;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float x[VEC], w[VEC];
        load_as_float<VEC>(x, x_src + off + c);
        load_as_float<VEC>(w, weight + c);
        for (int j = 0; j < VEC; j++) x[j] = x[j] * r * w[j];
        store_from_float<VEC>(out + off + c, x);
    }
    if (lane == 0) rstd[row] = r;
}

template <bool FUSED>
inline void rmsnorm_forward_launch(floatX* residual_out, floatX* out, float* rstd, const floatX* a, const floatX* b,
                                   const floatX* weight, int N, int C, float eps, cudaStream_t stream) {
    if (N <= 0 || C <= 0) return;
    const int block = 256, rows_per_block = block / 32;
    unsigned grid = (unsigned)ceil_div(N, rows_per_block);
    bool vec = rmsnorm_vec_ok(C, out, a, weight, b, residual_out);
    if (vec) {
        rmsnorm_forward_kernel<VEC16, FUSED>
            <<<grid, block, 0, stream>>>(residual_out, out, rstd, a, b, weight, N, C, eps);
    } else {
        rmsnorm_forward_kernel<1, FUSED><<<grid, block, 0, stream>>>(residual_out, out, rstd, a, b, weight, N, C, eps);
    }
    cudaCheckLaunch();
}

// out (N, C) = rmsnorm(inp) * weight; rstd (N) overwritten. All outputs overwritten.
inline void rmsnorm_forward(floatX* out, float* rstd, const floatX* inp, const floatX* weight, int N, int C, float eps,
                            cudaStream_t stream) {
    rmsnorm_forward_launch<false>(nullptr, out, rstd, inp, nullptr, weight, N, C, eps, stream);
}

// residual_out = a + b (rounded to floatX), out = rmsnorm(residual_out) * weight, rstd saved. All overwritten.
// residual_out may alias a or b (in-place residual update); out must not alias anything.
inline void fused_residual_rmsnorm_forward(floatX* residual_out, floatX* out, float* rstd, const floatX* a,
                                           const floatX* b, const floatX* weight, int N, int C, float eps,
                                           cudaStream_t stream) {
    rmsnorm_forward_launch<true>(residual_out, out, rstd, a, b, weight, N, C, eps, stream);
}

// ------------------------------------------------------------------------------------------------ backward

// Row chunks for the dweight reduction: at least 32 rows each, at most 256 chunks (enough blocks to fill an H100
// with C = 2048). A function of N only, so the summation order never changes between runs.
inline int rmsnorm_backward_rows_per_chunk(int N) {
    int rows = ceil_div(N, 256);
    return rows < 32 ? 32 : rows;
}
inline int rmsnorm_backward_chunks(int N) { return N <= 0 ? 0 : ceil_div(N, rmsnorm_backward_rows_per_chunk(N)); }

// Floats of `scratch` rmsnorm_backward needs: one partial dweight row (C) per row chunk (at most 256 chunks).
inline size_t rmsnorm_backward_scratch_floats(int N, int C) { return (size_t)rmsnorm_backward_chunks(N) * C; }

// dinp += dx, one warp per row. Pass 1: dot = sum_c dout*weight*x, so mean_c(dxhat*xhat) = rstd * dot / C.
template <int VEC>
__global__ void rmsnorm_backward_dinp_kernel(floatX* dinp, const floatX* dout, const floatX* inp,
                                             const floatX* weight, const float* rstd, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t off = (size_t)row * C;
    float dot = 0.0f;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float g[VEC], x[VEC], w[VEC];
        load_as_float<VEC>(g, dout + off + c);
        load_as_float<VEC>(x, inp + off + c);
        load_as_float<VEC>(w, weight + c);
        for (int j = 0; j < VEC; j++) dot += g[j] * w[j] * x[j];
    }
    dot = warp_reduce_sum(dot);
    float r = rstd[row];
    float mean = r * dot / (float)C;  // mean_c(dxhat * xhat)
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float g[VEC], x[VEC], w[VEC], d[VEC];
        load_as_float<VEC>(g, dout + off + c);
        load_as_float<VEC>(x, inp + off + c);
        load_as_float<VEC>(w, weight + c);
        load_as_float<VEC>(d, dinp + off + c);
        for (int j = 0; j < VEC; j++) d[j] += r * (g[j] * w[j] - x[j] * r * mean);
        store_from_float<VEC>(dinp + off + c, d);
    }
}

// Partial dweight: block (x = column slice of 2*blockDim.x columns, y = row chunk). Each thread owns two adjacent
// columns and walks the chunk's rows in order; a warp reads 64 consecutive elements of a row per step (coalesced).
__global__ void rmsnorm_backward_dweight_partial_kernel(float* scratch, const floatX* dout, const floatX* inp,
                                                        const float* rstd, int N, int C, int rows_per_chunk) {
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (c >= C) return;
    bool two = c + 1 < C;
    int row_begin = blockIdx.y * rows_per_chunk;
    int row_end = min(N, row_begin + rows_per_chunk);
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 4
    for (int n = row_begin; n < row_end; n++) {
        size_t off = (size_t)n * C + c;
        float r = rstd[n];
        acc0 += to_float(dout[off]) * (to_float(inp[off]) * r);
        if (two) acc1 += to_float(dout[off + 1]) * (to_float(inp[off + 1]) * r);
    }
    float* dst = scratch + (size_t)blockIdx.y * C + c;
    dst[0] = acc0;
    if (two) dst[1] = acc1;
}

// dweight[c] += sum of scratch[chunk, c] over the chunks. Block (32 columns) x (8 chunk groups): thread y sums
// chunks y, y + 8, ... in ascending order, then thread y = 0 adds the 8 group sums in order y = 0..7. The order is
// fixed by N alone, so the result is bit-identical run to run; splitting each column over 8 threads keeps the chain
// of dependent loads short (up to 32 instead of 256).
constexpr int RMSNORM_REDUCE_GROUPS = 8;
__global__ void rmsnorm_backward_dweight_reduce_kernel(floatX* dweight, const float* scratch, int n_chunks, int C) {
    __shared__ float group_sums[RMSNORM_REDUCE_GROUPS][32];
    int c = blockIdx.x * 32 + threadIdx.x;
    float sum = 0.0f;
    if (c < C) {
        for (int k = threadIdx.y; k < n_chunks; k += RMSNORM_REDUCE_GROUPS) sum += scratch[(size_t)k * C + c];
    }
    group_sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float total = 0.0f;
        for (int y = 0; y < RMSNORM_REDUCE_GROUPS; y++) total += group_sums[y][threadIdx.x];
        dweight[c] = from_float<floatX>(to_float(dweight[c]) + total);
    }
}

// dinp (N, C) += dx (accumulates into the residual gradient); dweight (C) += sum_n dout * xhat (accumulates,
// deterministic). scratch: rmsnorm_backward_scratch_floats(N, C) floats, contents don't matter, clobbered.
// dinp must not alias dout or inp.
inline void rmsnorm_backward(floatX* dinp, floatX* dweight, float* scratch, const floatX* dout, const floatX* inp,
                             const floatX* weight, const float* rstd, int N, int C, cudaStream_t stream) {
    if (N <= 0 || C <= 0) return;
    {
        const int block = 256, rows_per_block = block / 32;
        unsigned grid = (unsigned)ceil_div(N, rows_per_block);
        if (rmsnorm_vec_ok(C, dinp, dout, inp, weight)) {
            rmsnorm_backward_dinp_kernel<VEC16><<<grid, block, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
        } else {
            rmsnorm_backward_dinp_kernel<1><<<grid, block, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
        }
        cudaCheckLaunch();
    }
    int rows_per_chunk = rmsnorm_backward_rows_per_chunk(N);
    int n_chunks = rmsnorm_backward_chunks(N);
    {
        const int block = 256;
        dim3 grid(ceil_div(C, 2 * block), n_chunks);
        rmsnorm_backward_dweight_partial_kernel<<<grid, block, 0, stream>>>(scratch, dout, inp, rstd, N, C,
                                                                            rows_per_chunk);
        cudaCheckLaunch();
    }
    {
        dim3 block(32, RMSNORM_REDUCE_GROUPS);
        rmsnorm_backward_dweight_reduce_kernel<<<ceil_div(C, 32), block, 0, stream>>>(dweight, scratch, n_chunks, C);
        cudaCheckLaunch();
    }
}
