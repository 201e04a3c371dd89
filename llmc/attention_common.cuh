// What the attention paths share (llmc/attention.cuh describes the contract and dispatch): argument checks, the
// shared-memory opt-in, the log2-domain constants, and the first step of every backward,
//   delta (B, H, T) fp32 = rowsum(dout * out) per head        dout, out (B, T, H hd) floatX.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "cuda_common.h"

constexpr float ATTN_LOG2E = 1.4426950408889634f;  // scores are exponentiated in base 2: exp(x) = exp2(x log2 e)
constexpr float ATTN_LN2 = 0.6931471805599453f;
// The smallest row tile of any path: the grid's y dimension (ceil(T / tile), at most 65535) limits T.
constexpr int ATTN_MIN_TILE_ROWS = 64;

// Shape checks every path makes: a message naming the caller and exit on a bad shape.
inline void attention_check_args(const char* who, int B, int T, int n_heads, int n_kv_heads, int head_dim) {
    if (B <= 0 || T <= 0 || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0) {
        fprintf(stderr, "%s: bad shape B=%d T=%d n_heads=%d n_kv_heads=%d (n_heads must be a multiple of n_kv_heads)\n",
                who, B, T, n_heads, n_kv_heads);
        fail_exit();
    }
    if (head_dim < 1 || head_dim > 128) {
        fprintf(stderr, "%s: head_dim %d unsupported (supported: 1..128)\n", who, head_dim);
        fail_exit();
    }
    if ((size_t)T > (size_t)ATTN_MIN_TILE_ROWS * 65535) {
        fprintf(stderr, "%s: T=%d too long for the grid\n", who, T);
        fail_exit();
    }
}

// Raises a kernel's dynamic shared memory limit (needed above 48 KiB), once per kernel.
template <typename Kernel>
inline void attention_set_smem(Kernel kernel, size_t bytes, bool& done) {
    if (done) return;
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    done = true;
}

// Whether every pointer is 16-byte aligned (the tensor-core kernels move rows in 16-byte chunks; their row strides
// are multiples of 8 elements, so aligned base pointers suffice).
inline bool attention_aligned16(std::initializer_list<const void*> pointers) {
    for (const void* p : pointers) {
        if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    }
    return true;
}

// delta (B, H, T) = rowsum(dout * out) per head. One warp per row, an element per lane: for any head_dim (the
// scalar path's 1..128, rows not 16-byte aligned).
__global__ void attention_delta_kernel(float* delta, const floatX* dout, const floatX* out, int B, int T, int H,
                                       int hd) {
    const int lane = threadIdx.x % 32;
    const size_t row = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // (b, h, t) flattened
    if (row >= (size_t)B * H * T) return;
    const int t = (int)(row % T), h = (int)((row / T) % H), b = (int)(row / ((size_t)T * H));
    const size_t base = ((size_t)b * T + t) * H * hd + (size_t)h * hd;
    float sum = 0.0f;
    for (int d = lane; d < hd; d += 32) sum += to_float(dout[base + d]) * to_float(out[base + d]);
    sum = warp_reduce_sum(sum);
    if (lane == 0) delta[row] = sum;
}

// The same where head_dim = LANES 16-byte chunks (LANES a power of two up to 32): LANES consecutive lanes read a row
// in 16-byte loads and add up their partial sums with shuffles, and consecutive rows are consecutive in memory
// (dout, out order: b, t, h). H100 (ncu, kernel alone): 26.0 us at (B, T, H, hd) = (4, 2048, 32, 64) and 47.4 us at
// (1, 8192, 32, 128), where one element per lane in 2-byte loads (the kernel above) took 68.4 and 64.9 us.
constexpr int ATTN_DELTA_CHUNK = 16 / (int)sizeof(floatX);  // elements per 16-byte load
template <int LANES>
__global__ void attention_delta_rows_kernel(float* delta, const floatX* dout, const floatX* out, int B, int T, int H) {
    const size_t m = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / LANES;  // (b, t, h) flattened
    const bool valid = m < (size_t)B * T * H;
    float sum = 0.0f;
    if (valid) {
        const size_t offset = (m * LANES + threadIdx.x % LANES) * ATTN_DELTA_CHUNK;
        const int4 d4 = *reinterpret_cast<const int4*>(dout + offset);
        const int4 o4 = *reinterpret_cast<const int4*>(out + offset);
        const floatX* d = reinterpret_cast<const floatX*>(&d4);
        const floatX* o = reinterpret_cast<const floatX*>(&o4);
#pragma unroll
        for (int i = 0; i < ATTN_DELTA_CHUNK; i++) sum += to_float(d[i]) * to_float(o[i]);
    }
#pragma unroll
    for (int lanes = LANES / 2; lanes > 0; lanes /= 2) sum += __shfl_xor_sync(0xffffffff, sum, lanes);
    if (valid && threadIdx.x % LANES == 0) {
        const int h = (int)(m % H), t = (int)((m / H) % T);
        const size_t b = m / ((size_t)H * T);
        delta[(b * H + h) * T + t] = sum;
    }
}

template <int LANES>
inline void attention_delta_rows(float* delta, const floatX* dout, const floatX* out, int B, int T, int H,
                                 cudaStream_t stream) {
    const size_t threads = (size_t)B * T * H * LANES;
    const int block = 256;
    attention_delta_rows_kernel<LANES>
        <<<(unsigned)ceil_div(threads, (size_t)block), block, 0, stream>>>(delta, dout, out, B, T, H);
    cudaCheckLaunch();
}

// D (B, H, T) = rowsum(dout * out): the first step of both backward paths.
inline void attention_delta(float* delta, const floatX* dout, const floatX* out, int B, int T, int H, int hd,
                            cudaStream_t stream) {
    if (hd % ATTN_DELTA_CHUNK == 0 && attention_aligned16({dout, out})) {
        switch (hd / ATTN_DELTA_CHUNK) {
            case 1: attention_delta_rows<1>(delta, dout, out, B, T, H, stream); return;
            case 2: attention_delta_rows<2>(delta, dout, out, B, T, H, stream); return;
            case 4: attention_delta_rows<4>(delta, dout, out, B, T, H, stream); return;
            case 8: attention_delta_rows<8>(delta, dout, out, B, T, H, stream); return;
            case 16: attention_delta_rows<16>(delta, dout, out, B, T, H, stream); return;
            case 32: attention_delta_rows<32>(delta, dout, out, B, T, H, stream); return;
            default: break;  // not a power of two: the warp per row below
        }
    }
    const size_t rows = (size_t)B * H * T;
    const int warps_per_block = 8;
    attention_delta_kernel<<<(unsigned)ceil_div(rows, (size_t)warps_per_block), 32 * warps_per_block, 0, stream>>>(
        delta, dout, out, B, T, H, hd);
    cudaCheckLaunch();
}
