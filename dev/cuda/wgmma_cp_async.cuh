// cp.async tile loaders shared by the dev/cuda attention versions that load their own tiles (the trainer's Hopper
// kernels in llmc/attention_wgmma_*.cuh are fed by TMA instead): attention_forward.cu v4, attention_backward.cu v5 and
// its sweep configurations, v6-v9. 2 warpgroups per CTA (WGMMA_THREADS), every thread loads its share.
#pragma once

#include "../../llmc/attention.cuh"
#include "ptx_dev.cuh"

#if !defined(ENABLE_FP32)

constexpr int WGMMA_THREADS = 256;  // 2 warpgroups

// cp.async loads of rows [r0, r0 + R) of one head into a swizzled tile at shared address dst; rows >= T zero-filled
// (source clamped to row 0, nothing read). src: row 0, column 0 of the head; rows row_stride elements apart.
template <int HD, int R>
__device__ __forceinline__ void wgmma_load_tile(uint32_t dst, const __nv_bfloat16* src, size_t row_stride, int r0,
                                                int T) {
    constexpr int CHUNKS = HD / 8;
    static_assert((R * CHUNKS) % WGMMA_THREADS == 0, "tile must split evenly over the CTA");
#pragma unroll
    for (int i = 0; i < R * CHUNKS / WGMMA_THREADS; i++) {
        const int idx = i * WGMMA_THREADS + threadIdx.x, r = idx / CHUNKS, ch = idx % CHUNKS;  // coalesced
        const bool valid = r0 + r < T;
        cp_async_16(dst + swizzle128_offset<R>(r, ch), src + (size_t)(valid ? r0 + r : 0) * row_stride + 8 * ch,
                       valid ? 16 : 0);
    }
}

// lse and delta of queries q0 .. q0 + BQ - 1 of one (b, h) row (`row`: its offset in the (B, H, T) arrays) into
// lse_s, D_s (BQ floats each; zeros past T), asynchronously, by the CTA's first 2 BQ threads (one float each).
template <int BQ>
__device__ __forceinline__ void attention_load_row_stats(float* lse_s, float* D_s, const float* lse, const float* delta,
                                                   size_t row, int q0, int T) {
    if (threadIdx.x < 2 * BQ) {
        const int i = threadIdx.x % BQ, q = q0 + i;
        const float* src = threadIdx.x < BQ ? lse : delta;
        float* dst = threadIdx.x < BQ ? lse_s : D_s;
        cp_async_4(smem_addr(dst + i), src + row + (q < T ? q : 0), q < T ? 4 : 0);
    }
}

#endif  // !ENABLE_FP32
