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
// Forward and backward use one warp per row, in two passes (sum of squares or dot product, then the output); each
// pass issues a segment's loads together before using them, and the forward keeps its first segment in registers
// for pass 2 (other reads of pass 2 hit L1). dweight is a column reduction over rows, done without atomics so it is bit-identical run
// to run: rows are cut into R fixed chunks (R depends only on N), the backward kernel writes each chunk's fp32
// partial sums to `scratch` (R x C) while it computes dinp, and a second kernel adds the R partials per column in a
// fixed order.
// The backward can also write the forward's output again (`out`, bit-identical to rmsnorm_forward's): with activation
// recomputation the trainer needs it for the weight-gradient matmul that follows, and this pass already reads x and
// has rstd, so writing it here saves a separate recompute pass and its read of x.
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

// A lane's share of a row: RMSNORM_PACKS packs of VEC elements, pack k at columns (k * 32 + lane) * VEC of the
// segment, so the warp reads 32 * VEC consecutive elements per pack (coalesced). One segment is 32 * VEC *
// RMSNORM_PACKS columns (2048 in bf16). Each pass issues all of a segment's loads before using any, and the first
// segment stays in registers for the second pass; a longer row reads its later segments again (from L1).
constexpr int RMSNORM_PACKS = 8;
template <int VEC>
struct alignas(VEC * sizeof(floatX)) RmsnormPack {
    floatX v[VEC];
};
template <int VEC>
__device__ __forceinline__ RmsnormPack<VEC> rmsnorm_load(const floatX* p) {
    return *reinterpret_cast<const RmsnormPack<VEC>*>(p);
}
template <int VEC>
__device__ __forceinline__ void rmsnorm_store(floatX* p, const RmsnormPack<VEC>& x) {
    *reinterpret_cast<RmsnormPack<VEC>*>(p) = x;
}
// Issues the loads of the lane's PACKS packs of the segment starting at column seg of `row` (packs past C untouched).
template <int VEC, int PACKS>
__device__ __forceinline__ void rmsnorm_load_segment(RmsnormPack<VEC> (&dst)[PACKS], const floatX* row, int seg,
                                                     int lane, int C) {
#pragma unroll
    for (int k = 0; k < PACKS; k++) {
        int c = seg + (k * 32 + lane) * VEC;
        if (c < C) dst[k] = rmsnorm_load<VEC>(row + c);
    }
}

// One warp per row. FUSED: x = round(a + b) is first written to residual_out, and the norm uses the rounded values
// (what the next layer's residual stream holds). Otherwise x = a (b and residual_out unused).
// residual_out may alias a or b: each element is read and written by the same thread, reads first.
// AMAX: also the amax of out into *amax_bits (block_commit_amax), for the FP8 cast of out that follows; a warp past
// the last row then stays to the end, for the block's sync.
template <int VEC, bool FUSED, bool AMAX>
__global__ void rmsnorm_forward_kernel(floatX* residual_out, floatX* out, float* rstd, unsigned int* amax_bits,
                                       const floatX* a, const floatX* b, const floatX* weight, int N, int C,
                                       float eps) {
    constexpr int SEGMENT = 32 * VEC * RMSNORM_PACKS;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    unsigned int out_amax = 0;
    if (row >= N) {
        if constexpr (AMAX) block_commit_amax(amax_bits, out_amax);
        return;
    }
    size_t off = (size_t)row * C;
    RmsnormPack<VEC> first[RMSNORM_PACKS];
    float sum_sq = 0.0f;
    for (int seg = 0; seg < C; seg += SEGMENT) {
        RmsnormPack<VEC> x[RMSNORM_PACKS], y[RMSNORM_PACKS];
        rmsnorm_load_segment(x, a + off, seg, lane, C);
        if constexpr (FUSED) rmsnorm_load_segment(y, b + off, seg, lane, C);
#pragma unroll
        for (int k = 0; k < RMSNORM_PACKS; k++) {
            int c = seg + (k * 32 + lane) * VEC;
            if (c >= C) continue;
            if constexpr (FUSED) {
                for (int j = 0; j < VEC; j++) x[k].v[j] = from_float<floatX>(to_float(x[k].v[j]) + to_float(y[k].v[j]));
                rmsnorm_store<VEC>(residual_out + off + c, x[k]);
            }
            for (int j = 0; j < VEC; j++) sum_sq += to_float(x[k].v[j]) * to_float(x[k].v[j]);
            if (seg == 0) first[k] = x[k];
        }
    }
    sum_sq = warp_reduce_sum(sum_sq);
    float r = rsqrtf(sum_sq / (float)C + eps);
    const floatX* x_src = FUSED ? residual_out : a;
    for (int seg = 0; seg < C; seg += SEGMENT) {
        RmsnormPack<VEC>(&x)[RMSNORM_PACKS] = first;  // segment 0 is already there; later ones replace it
        if (seg > 0) rmsnorm_load_segment(x, x_src + off, seg, lane, C);
#pragma unroll
        for (int k = 0; k < RMSNORM_PACKS; k++) {
            int c = seg + (k * 32 + lane) * VEC;
            if (c >= C) continue;
            RmsnormPack<VEC> w = rmsnorm_load<VEC>(weight + c);
            for (int j = 0; j < VEC; j++) {
                x[k].v[j] = from_float<floatX>(to_float(x[k].v[j]) * r * to_float(w.v[j]));
                if constexpr (AMAX) out_amax = max(out_amax, abs_bits(to_float(x[k].v[j])));
            }
            rmsnorm_store<VEC>(out + off + c, x[k]);
        }
    }
    if (lane == 0) rstd[row] = r;
    if constexpr (AMAX) block_commit_amax(amax_bits, out_amax);
}

template <int VEC, bool FUSED>
inline void rmsnorm_forward_launch_vec(floatX* residual_out, floatX* out, float* rstd, float* out_amax,
                                       const floatX* a, const floatX* b, const floatX* weight, int N, int C, float eps,
                                       cudaStream_t stream) {
    const int block = 256, rows_per_block = block / 32;
    unsigned grid = (unsigned)ceil_div(N, rows_per_block);
    unsigned int* amax_bits = reinterpret_cast<unsigned int*>(out_amax);
    if (out_amax != nullptr) {
        rmsnorm_forward_kernel<VEC, FUSED, true>
            <<<grid, block, 0, stream>>>(residual_out, out, rstd, amax_bits, a, b, weight, N, C, eps);
    } else {
        rmsnorm_forward_kernel<VEC, FUSED, false>
            <<<grid, block, 0, stream>>>(residual_out, out, rstd, amax_bits, a, b, weight, N, C, eps);
    }
    cudaCheckLaunch();
}

template <bool FUSED>
inline void rmsnorm_forward_launch(floatX* residual_out, floatX* out, float* rstd, float* out_amax, const floatX* a,
                                   const floatX* b, const floatX* weight, int N, int C, float eps,
                                   cudaStream_t stream) {
    if (N <= 0 || C <= 0) return;
    if (rmsnorm_vec_ok(C, out, a, weight, b, residual_out)) {
        rmsnorm_forward_launch_vec<VEC16, FUSED>(residual_out, out, rstd, out_amax, a, b, weight, N, C, eps, stream);
    } else {
        rmsnorm_forward_launch_vec<1, FUSED>(residual_out, out, rstd, out_amax, a, b, weight, N, C, eps, stream);
    }
}

// out (N, C) = rmsnorm(inp) * weight; rstd (N) overwritten. All outputs overwritten. out_amax: nullptr, or a float
// that becomes max(itself, max |out|) (zero it first for out's amax alone; llmc/cuda_common.h's block_commit_amax).
inline void rmsnorm_forward(floatX* out, float* rstd, const floatX* inp, const floatX* weight, int N, int C, float eps,
                            cudaStream_t stream, float* out_amax = nullptr) {
    rmsnorm_forward_launch<false>(nullptr, out, rstd, out_amax, inp, nullptr, weight, N, C, eps, stream);
}

// residual_out = a + b (rounded to floatX), out = rmsnorm(residual_out) * weight, rstd saved. All overwritten.
// residual_out may alias a or b (in-place residual update); out must not alias anything. out_amax as above.
inline void fused_residual_rmsnorm_forward(floatX* residual_out, floatX* out, float* rstd, const floatX* a,
                                           const floatX* b, const floatX* weight, int N, int C, float eps,
                                           cudaStream_t stream, float* out_amax = nullptr) {
    rmsnorm_forward_launch<true>(residual_out, out, rstd, out_amax, a, b, weight, N, C, eps, stream);
}

// ------------------------------------------------------------------------------------------------ backward

// Rows are cut into chunks (a function of N alone, so the summation order never changes between runs). One block
// per chunk computes dinp for its rows and the chunk's partial dweight in the same pass over dout and inp; a second
// kernel adds the chunks' partials per column in a fixed order.
constexpr int RMSNORM_BACKWARD_WARPS = 4;
// Packs per lane and segment in the backward (the forward's RMSNORM_PACKS): 2 was fastest; at 4 the bf16 kernel
// takes 210 registers, at 8 it spills.
constexpr int RMSNORM_BACKWARD_PACKS = 2;
inline int rmsnorm_backward_rows_per_chunk(int N) {
    int rows = ceil_div(N, 512);
    return rows < 16 ? 16 : rows;
}
inline int rmsnorm_backward_chunks(int N) { return N <= 0 ? 0 : ceil_div(N, rmsnorm_backward_rows_per_chunk(N)); }

// Floats of `scratch` rmsnorm_backward needs: one partial dweight row (C) per row chunk (at most 512 chunks).
inline size_t rmsnorm_backward_scratch_floats(int N, int C) { return (size_t)rmsnorm_backward_chunks(N) * C; }

// Block = one row chunk; each warp takes every RMSNORM_BACKWARD_WARPS-th row of it, in segments as the forward.
// Pass 1: dot = sum_c dout*weight*x, so mean_c(dxhat*xhat) = rstd * dot / C. Pass 2: dinp += dx, with the segment's
// dinp loads issued together, and dout * xhat added into the warp's own fp32 row of shared memory (each element
// always by the same lane, so no synchronisation until the end). Then the warps' rows are added in warp order into
// scratch[chunk].
// The shared row and scratch hold column c at slot (c % VEC) * (C / VEC) + c / VEC: a lane owns VEC consecutive
// columns, so in column order the 32 lanes' j-th columns would be VEC floats apart and share banks (8-way in bf16);
// in slot order they are consecutive floats.
// OUT: pass 2 also writes out = x * rstd * weight, the forward's expression in the forward's order (rstd is the
// forward's r), so bit-identical to it; a template flag keeps the test out of the loop.
// AMAX: the amax of the updated dinp into *amax_bits (block_commit_amax), for the FP8 cast of it that follows.
template <int VEC, bool OUT, bool AMAX>
__global__ void __launch_bounds__(RMSNORM_BACKWARD_WARPS * 32)
    rmsnorm_backward_kernel(floatX* dinp, float* scratch, floatX* out, unsigned int* amax_bits, const floatX* dout,
                            const floatX* inp, const floatX* weight, const float* rstd, int N, int C,
                            int rows_per_chunk) {
    unsigned int dinp_amax = 0;
    constexpr int SEGMENT = 32 * VEC * RMSNORM_BACKWARD_PACKS;
    extern __shared__ float warp_dweight[];  // (RMSNORM_BACKWARD_WARPS, C)
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* my_dweight = warp_dweight + (size_t)warp * C;
    for (int seg = 0; seg < C; seg += SEGMENT) {
        for (int k = 0; k < RMSNORM_BACKWARD_PACKS; k++) {
            int c = seg + (k * 32 + lane) * VEC;
            if (c < C)
                for (int j = 0; j < VEC; j++) my_dweight[j * (C / VEC) + c / VEC] = 0.0f;
        }
    }
    int row_end = min(N, (blockIdx.x + 1) * rows_per_chunk);
    for (int row = blockIdx.x * rows_per_chunk + warp; row < row_end; row += RMSNORM_BACKWARD_WARPS) {
        size_t off = (size_t)row * C;
        float dot = 0.0f;
        for (int seg = 0; seg < C; seg += SEGMENT) {
            RmsnormPack<VEC> g[RMSNORM_BACKWARD_PACKS], x[RMSNORM_BACKWARD_PACKS];
            rmsnorm_load_segment(g, dout + off, seg, lane, C);
            rmsnorm_load_segment(x, inp + off, seg, lane, C);
#pragma unroll
            for (int k = 0; k < RMSNORM_BACKWARD_PACKS; k++) {
                int c = seg + (k * 32 + lane) * VEC;
                if (c >= C) continue;
                RmsnormPack<VEC> w = rmsnorm_load<VEC>(weight + c);
                for (int j = 0; j < VEC; j++) dot += to_float(g[k].v[j]) * to_float(w.v[j]) * to_float(x[k].v[j]);
            }
        }
        dot = warp_reduce_sum(dot);
        float r = rstd[row];
        float mean = r * dot / (float)C;  // mean_c(dxhat * xhat)
        for (int seg = 0; seg < C; seg += SEGMENT) {
            RmsnormPack<VEC> g[RMSNORM_BACKWARD_PACKS], x[RMSNORM_BACKWARD_PACKS], d[RMSNORM_BACKWARD_PACKS];
            rmsnorm_load_segment(d, dinp + off, seg, lane, C);
            rmsnorm_load_segment(g, dout + off, seg, lane, C);
            rmsnorm_load_segment(x, inp + off, seg, lane, C);
#pragma unroll
            for (int k = 0; k < RMSNORM_BACKWARD_PACKS; k++) {
                int c = seg + (k * 32 + lane) * VEC;
                if (c >= C) continue;
                RmsnormPack<VEC> w = rmsnorm_load<VEC>(weight + c);
                for (int j = 0; j < VEC; j++) {
                    float gj = to_float(g[k].v[j]), xj = to_float(x[k].v[j]);
                    d[k].v[j] = from_float<floatX>(to_float(d[k].v[j]) + r * (gj * to_float(w.v[j]) - xj * r * mean));
                    if constexpr (AMAX) dinp_amax = max(dinp_amax, abs_bits(to_float(d[k].v[j])));
                    my_dweight[j * (C / VEC) + c / VEC] += gj * (xj * r);
                    // the output takes x's register once xj holds it (the forward's expression and order)
                    if constexpr (OUT) x[k].v[j] = from_float<floatX>(xj * r * to_float(w.v[j]));
                }
                rmsnorm_store<VEC>(dinp + off + c, d[k]);
                if constexpr (OUT) rmsnorm_store<VEC>(out + off + c, x[k]);
            }
        }
    }
    __syncthreads();
    for (int slot = threadIdx.x; slot < C; slot += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < RMSNORM_BACKWARD_WARPS; w++) sum += warp_dweight[(size_t)w * C + slot];
        scratch[(size_t)blockIdx.x * C + slot] = sum;
    }
    if constexpr (AMAX) block_commit_amax(amax_bits, dinp_amax);
}

// dweight[c] += (or with accumulate = false, =) the sum over the chunks of column c's partial, which scratch[chunk]
// holds at slot (c % vec) * (C / vec) + c / vec (vec = 1: column order). Block (32 slots) x
// (8 chunk groups): thread y sums chunks y, y + 8, ... in ascending order, then thread y = 0 adds the 8 group sums in
// order y = 0..7. The order is fixed by N alone, so the result is bit-identical run to run; splitting each column
// over 8 threads keeps the chain of dependent loads short (up to 64 instead of 512).
constexpr int RMSNORM_REDUCE_GROUPS = 8;
__global__ void rmsnorm_backward_dweight_reduce_kernel(floatX* dweight, const float* scratch, int n_chunks, int C,
                                                       int vec, bool accumulate) {
    __shared__ float group_sums[RMSNORM_REDUCE_GROUPS][32];
    int slot = blockIdx.x * 32 + threadIdx.x;
    int c = slot % (C / vec) * vec + slot / (C / vec);
    float sum = 0.0f;
    if (slot < C) {
        for (int k = threadIdx.y; k < n_chunks; k += RMSNORM_REDUCE_GROUPS) sum += scratch[(size_t)k * C + slot];
    }
    group_sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && slot < C) {
        float total = 0.0f;
        for (int y = 0; y < RMSNORM_REDUCE_GROUPS; y++) total += group_sums[y][threadIdx.x];
        dweight[c] = from_float<floatX>(accumulate ? to_float(dweight[c]) + total : total);
    }
}

// Shared memory of rmsnorm_backward_kernel: a row of C floats per warp. Above 48 KiB (C > 3072) it must be opted
// into, once per kernel instance; C beyond the GPU's limit is refused with a message.
template <int VEC, bool OUT, bool AMAX>
inline size_t rmsnorm_backward_smem(int C) {
    size_t bytes = (size_t)RMSNORM_BACKWARD_WARPS * C * sizeof(float);
    static size_t opted = 48 * 1024;
    if (bytes > opted) {
        int device, limit;
        cudaCheck(cudaGetDevice(&device));
        cudaCheck(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
        if (bytes > (size_t)limit) {
            fprintf(stderr, "Error: rmsnorm_backward: C=%d needs %zu bytes of shared memory, the GPU has %d\n", C,
                    bytes, limit);
            fail_exit();
        }
        cudaCheck(cudaFuncSetAttribute(rmsnorm_backward_kernel<VEC, OUT, AMAX>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        opted = bytes;
    }
    return bytes;
}

template <int VEC, bool OUT, bool AMAX>
inline void rmsnorm_backward_launch(floatX* dinp, float* scratch, floatX* out, float* dinp_amax, const floatX* dout,
                                    const floatX* inp, const floatX* weight, const float* rstd, int N, int C,
                                    cudaStream_t stream) {
    size_t smem = rmsnorm_backward_smem<VEC, OUT, AMAX>(C);
    rmsnorm_backward_kernel<VEC, OUT, AMAX><<<rmsnorm_backward_chunks(N), RMSNORM_BACKWARD_WARPS * 32, smem, stream>>>(
        dinp, scratch, out, reinterpret_cast<unsigned int*>(dinp_amax), dout, inp, weight, rstd, N, C,
        rmsnorm_backward_rows_per_chunk(N));
    cudaCheckLaunch();
}
template <int VEC>
inline void rmsnorm_backward_launch_vec(floatX* dinp, float* scratch, floatX* out, float* dinp_amax,
                                        const floatX* dout, const floatX* inp, const floatX* weight, const float* rstd,
                                        int N, int C, cudaStream_t stream) {
    if (out != nullptr && dinp_amax != nullptr) {
        rmsnorm_backward_launch<VEC, true, true>(dinp, scratch, out, dinp_amax, dout, inp, weight, rstd, N, C, stream);
    } else if (out != nullptr) {
        rmsnorm_backward_launch<VEC, true, false>(dinp, scratch, out, dinp_amax, dout, inp, weight, rstd, N, C, stream);
    } else if (dinp_amax != nullptr) {
        rmsnorm_backward_launch<VEC, false, true>(dinp, scratch, out, dinp_amax, dout, inp, weight, rstd, N, C, stream);
    } else {
        rmsnorm_backward_launch<VEC, false, false>(dinp, scratch, out, dinp_amax, dout, inp, weight, rstd, N, C,
                                                   stream);
    }
}

// dinp (N, C) += dx (accumulates into the residual gradient); dweight (C) += sum_n dout * xhat (accumulates,
// deterministic; with accumulate = false it is overwritten instead). scratch: rmsnorm_backward_scratch_floats(N, C)
// floats, contents don't matter, clobbered. out: nullptr, or (N, C) overwritten with the forward's output
// x * rstd * weight, bit-identical to rmsnorm_forward's (recomputed for the weight gradient that needs it).
// dinp must not alias dout or inp; out must not alias anything. dinp_amax: nullptr, or a float that becomes
// max(itself, max |dinp|) over the updated dinp (zero it first for dinp's amax alone).
inline void rmsnorm_backward(floatX* dinp, floatX* dweight, float* scratch, floatX* out, const floatX* dout,
                             const floatX* inp, const floatX* weight, const float* rstd, int N, int C, bool accumulate,
                             cudaStream_t stream, float* dinp_amax = nullptr) {
    if (N <= 0 || C <= 0) return;
    int n_chunks = rmsnorm_backward_chunks(N);
    bool vec = rmsnorm_vec_ok(C, dinp, dout, inp, weight, out);
    if (vec) rmsnorm_backward_launch_vec<VEC16>(dinp, scratch, out, dinp_amax, dout, inp, weight, rstd, N, C, stream);
    else rmsnorm_backward_launch_vec<1>(dinp, scratch, out, dinp_amax, dout, inp, weight, rstd, N, C, stream);
    dim3 reduce_block(32, RMSNORM_REDUCE_GROUPS);
    rmsnorm_backward_dweight_reduce_kernel<<<ceil_div(C, 32), reduce_block, 0, stream>>>(dweight, scratch, n_chunks,
                                                                                          C, vec ? VEC16 : 1,
                                                                                          accumulate);
    cudaCheckLaunch();
}
