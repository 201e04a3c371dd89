// What the Hopper (sm_90a) attention kernels share: the forward (attention_wgmma_forward.cuh) and the backward
// (attention_wgmma_backward.cuh), causal GQA at head_dim 64 and 128, bf16 builds only; what the trainer runs on an
// H100 / H200. Their contracts are attention_forward's and attention_backward's (attention.cuh: math, layouts, lse):
//   qkv (B, T, (H + 2 KV) hd) -> out (B, T, H hd), lse (B, H, T) fp32; backward: dqkv from dout, qkv, out, lse.
//
// Every operand tile lives in shared memory as R rows x hd bf16, 128-byte swizzled: hd / 64 column blocks of R rows x
// 128 bytes (ptx.cuh's file comment), loaded by TMA from qkv or dout viewed as the 4-D tensor (hd, head, token,
// batch) (attention_heads_tensor_map); tokens >= T read as zeros. A CTA owns 128 rows (queries; keys in the dK/dV
// kernel), 64 per consumer warpgroup, whose fp32 accumulators are wgmma fragments (ptx.cuh): element 4 j + e of a
// 64 x N fragment is row 16 warp + g + 8 (e / 2), column 8 j + c + e % 2 (g = lane / 4, c = 2 (lane % 4)).
// Here: the fragments' conversions and stores, the operand descriptors, the score products (64 x N = A B^T over hd),
// the work-item order, and the host side both directions use. The kernels' shape (a TMA producer warpgroup, two
// consumer warpgroups, rings of stages): pipeline.cuh.
//
// Builds: the kernels' bodies exist only when compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL, the Makefiles' choice
// for GPU_COMPUTE_CAPABILITY=90); for any other target they compile to a trap, and the host side never launches them
// (attention_wgmma_usable: the device is compute capability 9.0 and the kernel image loaded for it is sm_90 code).
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "cuda_common.h"
#include "pipeline.cuh"
#include "ptx.cuh"
#include "rope.cuh"
#include "tensor_map.cuh"

#if !defined(ENABLE_FP32)

constexpr int WGMMA_ROWS = 128;  // rows per CTA, 64 per consumer warpgroup: queries (keys in the dK/dV kernel)

// ----------------------------------------------------------------------------------------------------------------
// Tile helpers

// Stores a warpgroup's 64 x HD fp32 accumulator (times mult) as bf16 to global rows r0 .. r0 + 63 (skipping rows
// >= T; dst: row 0, column 0 of the head), staged through rows 64 wg .. 64 wg + 63 of a swizzled smem tile of R rows
// (wg: the consumer warpgroup's index, 0 or 1). barrier: the first of the caller's two named barriers for it (each
// warpgroup's 128 threads meet on barrier + wg once its rows are staged).
// rope: nullptr, or RoPE's (T, HD/2, 2) {cos, sin} table (llmc/rope.cuh): then each pair of columns (2i, 2i+1) of
// row t is rotated back by pair i's angle at position t after the rounding to bf16, and rounded again: the same bits
// rope_backward would leave on the stored values, without its pass over them.
template <int HD, int R>
__device__ __forceinline__ void wgmma_store_rows(__nv_bfloat16* dst, size_t row_stride, uint8_t* stage,
                                                 const float (&acc)[HD / 2], float mult, int r0, int T, int wg,
                                                 int barrier, const float* rope = nullptr) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int lr = 64 * wg + 16 * warp + g;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int t = r0 + 16 * warp + g + 8 * r;
        // rows past T are never stored: no table row to read for them
        const float2* angles = rope != nullptr && t < T ? reinterpret_cast<const float2*>(rope) + (size_t)t * (HD / 2)
                                                        : nullptr;
#pragma unroll
        for (int jn = 0; jn < HD / 8; jn++) {
            float y0 = acc[4 * jn + 2 * r] * mult, y1 = acc[4 * jn + 2 * r + 1] * mult;
            if (angles != nullptr) {
                const float2 cs = angles[4 * jn + c / 2];
                const float x0 = __bfloat162float(__float2bfloat16_rn(y0));
                const float x1 = __bfloat162float(__float2bfloat16_rn(y1));
                rope_rotate(x0, x1, cs.x, -cs.y, &y0, &y1);
            }
            *reinterpret_cast<uint32_t*>(stage + swizzle128_offset<R>(lr + 8 * r, jn) + 2 * c) = pack_bf16x2(y0, y1);
        }
    }
    named_barrier_sync<128>(barrier + wg);
    constexpr int CHUNKS = HD / 8;
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int i = 0; i < 64 * CHUNKS / 128; i++) {
        const int idx = i * 128 + t, r = idx / CHUNKS, ch = idx % CHUNKS;
        if (r0 + r < T) {
            *reinterpret_cast<int4*>(dst + (size_t)(r0 + r) * row_stride + 8 * ch) =
                *reinterpret_cast<const int4*>(stage + swizzle128_offset<R>(64 * wg + r, ch));
        }
    }
}

// Packs a 64 x N fp32 accumulator fragment (N / 2 values per thread) into N / 16 bf16 A fragments (k16 slices).
template <int N>
__device__ __forceinline__ void wgmma_acc_to_a(uint32_t (&a)[N / 16][4], const float (&d)[N / 2]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        a[kk][0] = pack_bf16x2(d[8 * kk + 0], d[8 * kk + 1]);
        a[kk][1] = pack_bf16x2(d[8 * kk + 2], d[8 * kk + 3]);
        a[kk][2] = pack_bf16x2(d[8 * kk + 4], d[8 * kk + 5]);
        a[kk][3] = pack_bf16x2(d[8 * kk + 6], d[8 * kk + 7]);
    }
}

// Loads the warpgroup's A fragments (rows 64 wg .. 64 wg + 63, the first SLICES k16 slices of HD columns, all by
// default) of a swizzled tile of R rows at `tile`: a stationary operand kept in registers for wgmma_bf16_rs (the A
// fragment layout of ptx.cuh's file comment).
template <int HD, int R, int SLICES = HD / 16>
__device__ __forceinline__ void wgmma_load_a_frags(uint32_t (&a)[SLICES][4], const uint8_t* tile, int wg) {
    static_assert(SLICES <= HD / 16, "more slices than the tile has");
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int r0 = 64 * wg + 16 * warp + g;
#pragma unroll
    for (int kk = 0; kk < SLICES; kk++) {  // columns 16 kk + c (chunk 2 kk) and 16 kk + 8 + c (chunk 2 kk + 1)
        a[kk][0] = *reinterpret_cast<const uint32_t*>(tile + swizzle128_offset<R>(r0, 2 * kk) + 2 * c);
        a[kk][1] = *reinterpret_cast<const uint32_t*>(tile + swizzle128_offset<R>(r0 + 8, 2 * kk) + 2 * c);
        a[kk][2] = *reinterpret_cast<const uint32_t*>(tile + swizzle128_offset<R>(r0, 2 * kk + 1) + 2 * c);
        a[kk][3] = *reinterpret_cast<const uint32_t*>(tile + swizzle128_offset<R>(r0 + 8, 2 * kk + 1) + 2 * c);
    }
}

// Descriptors of the operands below (ptx.cuh's file comment): a swizzled tile read K-major (S = Q K^T: Q rows as A,
// K rows as B), and one read MN-major with column blocks of `rows` rows (V, dO, Q, K as the B of P V, dS K, ...).
// Built once per tile (or per warpgroup); the k16 slices and the stages are reached with wgmma_desc_advance.
__device__ __forceinline__ uint64_t wgmma_desc_kmajor(uint32_t tile) { return wgmma_desc_sw128(tile, 16, 1024); }
__device__ __forceinline__ uint64_t wgmma_desc_mnmajor(uint32_t tile, int rows) {
    return wgmma_desc_sw128(tile, rows * 128, 1024);
}

// 64 x N = (64 x HD) (N x HD)^T over the HD / 16 k16 slices, one commit group. A: the warpgroup's 64 rows of a
// resident swizzled tile of R rows (a: wgmma_desc_kmajor of its first row); B: a swizzled tile of N rows, K-major
// (b: wgmma_desc_kmajor). Slice kk sits in column block kk / 4, 32 (kk % 4) bytes into the row.
template <int HD, int R, int N>
__device__ __forceinline__ void wgmma_scores_ss(float (&d)[N / 2], uint64_t a, uint64_t b) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        wgmma_bf16_ss(d, wgmma_desc_advance(a, (kk / 4) * (R * 128) + 32 * (kk % 4)),
                      wgmma_desc_advance(b, (kk / 4) * (N * 128) + 32 * (kk % 4)), kk > 0);
    }
    wgmma_commit_group();
}

// The same with A from registers: the warpgroup's fragments (wgmma_load_a_frags).
template <int HD, int N>
__device__ __forceinline__ void wgmma_scores_rs(float (&d)[N / 2], const uint32_t (&a_frags)[HD / 16][4],
                                                uint64_t b) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        wgmma_bf16_rs<0>(d, a_frags[kk], wgmma_desc_advance(b, (kk / 4) * (N * 128) + 32 * (kk % 4)), kk > 0);
    }
    wgmma_commit_group();
}

// The same with the first A_SLICES k16 slices of A from registers (wgmma_load_a_frags<HD, R, A_SLICES>) and the rest
// from the resident tile (a: as in wgmma_scores_ss).
template <int HD, int R, int N, int A_SLICES>
__device__ __forceinline__ void wgmma_scores_rs_ss(float (&d)[N / 2], const uint32_t (&a_frags)[A_SLICES][4],
                                                   uint64_t a, uint64_t b) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const uint64_t b_kk = wgmma_desc_advance(b, (kk / 4) * (N * 128) + 32 * (kk % 4));
        if (kk < A_SLICES) {
            wgmma_bf16_rs<0>(d, a_frags[kk], b_kk, kk > 0);
        } else {
            wgmma_bf16_ss(d, wgmma_desc_advance(a, (kk / 4) * (R * 128) + 32 * (kk % 4)), b_kk, kk > 0);
        }
    }
    wgmma_commit_group();
}

// acc (64 x HD) += A B over N: A = the 64 x N fp32 fragment `from` packed into the bf16 A registers `a` (which the
// caller keeps until the group is waited for), B = an N x HD tile read MN-major (b: wgmma_desc_mnmajor(tile, N); its
// k16 slice kk starts at row 16 kk, byte 2048 kk); one commit group.
template <int HD, int N>
__device__ __forceinline__ void wgmma_accumulate_rs(float (&acc)[HD / 2], uint32_t (&a)[N / 16][4],
                                                    const float (&from)[N / 2], uint64_t b) {
    wgmma_acc_to_a<N>(a, from);
    pin_registers(a);
    pin_registers(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) wgmma_bf16_rs(acc, a[kk], wgmma_desc_advance(b, 2048 * kk), 1);
    wgmma_commit_group();
}

// acc (64 x HD) += A B over N with A already packed (bf16 A registers); no fence, no commit (the caller groups it).
template <int HD, int N>
__device__ __forceinline__ void wgmma_accumulate_packed(float (&acc)[HD / 2], const uint32_t (&a)[N / 16][4],
                                                        uint64_t b) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) wgmma_bf16_rs(acc, a[kk], wgmma_desc_advance(b, 2048 * kk), 1);
}

// ----------------------------------------------------------------------------------------------------------------
// Work items

// Work item w of the forward and of the dQ kernel: 128 queries of one (b, h) = w % (B H), query tile
// q_tiles - 1 - w / (B H), so the longest (last) query tiles come first. A persistent CTA takes the items
// persistent_item gives it.
__device__ __forceinline__ void attention_forward_item(int w, int H, int BH, int q_tiles, int& b, int& h, int& q0) {
    const int bh = w % BH;
    b = bh / H;
    h = bh % H;
    q0 = (q_tiles - 1 - w / BH) * WGMMA_ROWS;
}

// ----------------------------------------------------------------------------------------------------------------
// Host side

// True when the kernels of attention_wgmma_forward.cuh and attention_wgmma_backward.cuh can run on the current
// device (sm90a_kernel_runs). The test looks at the image loaded for one kernel, the delta kernel's: every kernel of
// a translation unit is in the same image.
inline bool attention_wgmma_usable() {
    static PerDeviceFlag cache;
    return sm90a_kernel_runs(attention_delta_kernel, cache);
}

// A (B, T, heads, hd) bf16 tensor (qkv: heads = H + 2 KV; dout: heads = H) as the 4-D tensor (hd, head, token,
// batch), innermost first, strides in bytes nested as cuTensorMapEncodeTiled wants them; box (64, 1, rows, 1) = rows
// of 128 bytes, 128-byte swizzle; out-of-bounds elements (tokens >= T) read as zeros.
inline CUtensorMap attention_heads_tensor_map(const floatX* base, int B, int T, int heads, int hd, int rows) {
    const cuuint64_t elem = sizeof(__nv_bfloat16);
    const cuuint64_t dims[4] = {(cuuint64_t)hd, (cuuint64_t)heads, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[3] = {hd * elem, heads * hd * elem, (cuuint64_t)T * heads * hd * elem};
    const cuuint32_t box[4] = {64, 1, (cuuint32_t)rows, 1};
    return tensor_map_bf16(base, 4, dims, strides, box, "attention_heads_tensor_map (hd, heads, T, B)");
}

#endif  // !ENABLE_FP32
