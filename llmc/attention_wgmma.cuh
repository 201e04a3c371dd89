// Causal GQA attention forward and backward for Hopper (sm_90a): wgmma tensor cores, bf16 builds only, head_dim 64
// and 128. What the trainer runs on an H100 / H200.
//
// Same contracts as attention_forward / attention_backward in attention.cuh (math, layouts, lse definition are
// described there): qkv (B, T, (H + 2 KV) hd) -> out (B, T, H hd), lse (B, H, T) fp32 = log-sum-exp of each row of
// scaled scores; backward: dqkv from dout, qkv, out, lse, deterministic (every output element has one writer).
// Instruction, fragment, swizzle and descriptor conventions: llmc/ptx.cuh. Measurements and the variants these
// kernels were chosen from: dev/cuda/attention_forward.cu and attention_backward.cu.
//
// Builds: the kernels' bodies exist only when compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL, the Makefiles' choice
// for GPU_COMPUTE_CAPABILITY=90); for any other target they compile to a trap, and the host side never launches them
// (attention_wgmma_usable: the device is compute capability 9.0 and the kernel image loaded for it is sm_90 code).
//
// Forward: warp-specialised and fed by TMA (FlashAttention-3's design). Work item = 128 queries of one (batch, head),
// the longest (last) query tiles first. Where two Q buffers fit beside the stages (hd 64 with its 6 stages) the
// kernel is persistent: one CTA per SM takes items in turn, and the next item's Q loads while this one's epilogue
// runs; otherwise (hd 128 with 3 stages) one CTA per item (a persistent CTA waiting for each Q was slower).
// 384 threads = 3 warpgroups:
//   warpgroup 0, producer: setmaxnreg.dec to 24 registers; one elected thread loads each item's Q tile once and the
//     K, V tiles (128 keys each) up to the causal diagonal with TMA into STAGES stages, each tile as HD / 64 boxes of
//     64 columns (128 bytes) x 128 rows, 128-byte swizzled by the TMA unit into exactly the layout the wgmma
//     descriptors read. Rows past T are outside the tensor: TMA writes zeros there (and still credits the whole box).
//     The tensor map views qkv as the 4-D tensor (hd, head, token, batch), box (64, 1, 128, 1).
//   warpgroups 1, 2, consumers of 64 query rows each: setmaxnreg.inc to 240; S = Q K^T as wgmma m64n128k16 from
//     descriptors, causal mask on the diagonal tile, online softmax in the log2 domain on the fragment (quad
//     reductions), P as bf16 A registers, O += P V as wgmma m64nHDk16 with V MN-major. The two consumers take turns
//     issuing their wgmma batches ("ping-pong", named barriers 1 and 2), and within a warpgroup S_{j+1} = Q K_{j+1}^T
//     is issued together with P_j V_j, so the softmax of tile j+1 can run while P_j V_j does (the P registers
//     alternate between two sets by tile parity; at hd 64 P_j V_j is waited for in the next step, see LATE_WAIT).
// Synchronisation, per stage s: full[s] (1 arrival: the producer's arrive.expect_tx of the tile's bytes, then the
// TMA's complete_tx) and empty[s] (256 arrivals: every consumer thread, once its P V wgmma reading the stage has been
// waited on). The CTA's K / V tiles, counted over its items, take the stages in turn: tile j uses stage j % STAGES
// in round j / STAGES; round r waits for phase r of full (parity r % 2), and the producer refilling the stage in
// round r >= 1 waits for phase r - 1 of empty. Each Q buffer has its own pair: q_full (the TMA) and q_empty (256
// arrivals: with two buffers once the epilogue that staged its output there is done, after a proxy fence, since TMA
// writes next; with one, as soon as the item's last S product is done).
// Epilogue per consumer warpgroup: O / l as bf16 through the warpgroup's own rows of the dead Q tile (named barrier
// 3 + w), then 16-byte stores, or with one Q buffer (released early) straight from the registers, 4-byte stores;
// lse = (m + log2 l) ln 2.
// smem: 1 or 2 x Q 128 x HD + STAGES x (K, V) 2 x 128 x HD bf16 + the barriers + 1 KiB to align (HD 128, 3 stages,
// one Q: 225 KiB; HD 64, 6 stages, two: 225 KiB); registers: 168 at launch (384 x 168 = 128 x 24 + 256 x 240 after
// setmaxnreg). With LATE_WAIT (hd 64) a step waits for tile j + 1 before it releases tile j - 1's stage: at least
// 3 stages, or the two wait for each other.
//
// Backward. Two kernels (a dK/dV kernel per key tile and kv head, a dQ kernel over query tiles and heads, every output
// element with one writer: deterministic, no atomics), warp-specialised as the forward is: 384 threads, warpgroup 0
// the producer (setmaxnreg 24), warpgroups 1, 2 consumers of 64 rows each (240); the consumers never meet each other,
// only the stage barriers. D = rowsum(dO o O) comes first from attention_delta (attention_common.cuh).
//
// dK/dV: CTA = 128 keys x (kv head, batch). The producer loads K and V (128 x HD) once (kv_full), then for each work
// item (query head of the group, query tile of BQ = 64 from the diagonal, in a fixed order) Q and dO by TMA (64-row
// boxes) and, by 64 of its threads, the item's lse and D into smem (plain loads; an lse row need not be 16-byte
// aligned); full[s] counts the TMA thread's arrive.expect_tx and those 64 arrivals, over 4 stages. Per item and
// consumer warpgroup (rows = its 64 keys, columns = the BQ queries, all fp32 accumulators):
//   S^T = K Q^T, dP^T = V dO^T        wgmma m64nBQk16, A and B from smem descriptors (both K-major), two groups;
//                                     at hd 128 S^T's first 5 k16 slices take A (K) from registers, loaded once
//   P^T = exp2(S^T scale log2 e - lse log2 e), 0 where key > query or query >= T; bf16 A registers
//   dV += P^T dO                      wgmma m64nHDk16, A from registers, B = dO tile MN-major ("transpose B")
//   dS^T = P^T o (dP^T - D); bf16 A registers
//   dK += dS^T Q                      wgmma m64nHDk16, as dV; a stage is released on empty[s] (256 arrivals) once
//                                     the products reading it are done
// dK times scale at the store. At hd 128 dV and dK are issued together once dS^T is ready, and a warpgroup whose
// keys all follow the item's queries skips the item (after waiting for it to be loaded, so that its release of a
// round never precedes the other warpgroup's release of the round before). There the kernel is bound by shared-memory
// reads (m64n64 products with both operands in smem); K in registers takes a third of S^T's, and the registers for
// it come from not holding dV's A operands and S^T, dP^T at the same time. At hd 64, where an item's products are
// short next to its exponentials, the two consumers take turns issuing, as in the forward (named barriers 3 and 4):
// a turn issues item i's S^T, dP^T and item i - 1's dV, dK, then computes P^T, dS^T of item i into one of two
// register sets (by item parity; ptxas runs the exponentials beside those products and places dS^T's arithmetic and
// the bf16 packing after the wait for them); skipped items run masked (P^T = 0), so every turn issues the same
// groups.
// ptxas serialises all of a kernel's wgmmas (C7515) when it cannot see that no ordinary instruction writes a running
// wgmma's registers. Two things here keep it from that: the consumer warpgroup's index comes through a shuffle, and
// mbarrier_wait's loop is written in PTX (ptx.cuh).
//
// dQ: work item = 128 queries x (head, batch), in the forward's order; persistent where two (Q, dO) buffers fit (hd 64
// and 128), with the forward's q_full / q_empty pairs. The producer loads an item's Q and dO once, then K, V tiles of
// BN keys up to the causal diagonal through 3 stages. Per tile and consumer warpgroup:
//   S = Q K^T, dP = dO V^T            wgmma m64nBNk16; with AREG (the HD 128 choice) the warpgroup's Q and dO rows
//                                     are held in registers as A fragments, so only K, V are read from smem
//   P = exp2(S scale log2 e - lse log2 e), 0 where key > query; dS = P o (dP - D); bf16 A registers
//   dQ += dS K                        wgmma m64nHDk16, B = K tile MN-major
// dQ times scale at the store.
// Both kernels stage their bf16 results through their own (dead) rows of the resident tiles for 16-byte stores.
// Against the cp.async version (every thread loading its share, one __syncthreads per item), measured on an H100
// (dev/cuda/attention_backward.cu v5 -> v10, TFLOP/s at the three timing shapes): 215-219 -> 262-266, 336-341 ->
// 427-432, 340-361 -> 424-457; then, with fewer instructions per item (descriptors advanced rather than rebuilt, the
// mask only where needed, no integer division) and the faster delta pass: 311-316, 465-469, 466-504.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "attention_common.cuh"
#include "cuda_common.h"
#include "ptx.cuh"
#include "rope.cuh"
#include "tensor_map.cuh"

#if !defined(ENABLE_FP32)

constexpr int WGMMA_ROWS = 128;       // rows per CTA, 64 per warpgroup: queries (keys in the dK/dV kernel)
constexpr int WGMMA_FWD_KEYS = 128;   // keys per K / V tile of the forward (= WGMMA_ROWS: a CTA's last tile is
                                      // its diagonal)
// Every kernel of this file is warp-specialised: a producer warpgroup (TMA loads) and 2 consumer warpgroups.
constexpr int WGMMA_WS_THREADS = 384;   // producer warpgroup + 2 consumer warpgroups
constexpr int WGMMA_CONSUMERS = 256;    // consumer threads: the arrivals an empty barrier waits for
constexpr int WGMMA_PRODUCER_REGS = 24, WGMMA_CONSUMER_REGS = 240;  // 128 x 24 + 256 x 240 = 384 x 168
// registers the split needs after setmaxnreg
constexpr int WGMMA_REGS_NEEDED = 128 * WGMMA_PRODUCER_REGS + WGMMA_CONSUMERS * WGMMA_CONSUMER_REGS;
static_assert(WGMMA_REGS_NEEDED <= 65536, "the register split exceeds the SM's register file");
constexpr int WGMMA_DKDV_STAGES = 4;  // Q / dO stages of the dK/dV kernel
constexpr int WGMMA_DKDV_QUERIES = 64;  // queries per dK/dV work item
constexpr int WGMMA_DQ_STAGES = 3;    // K / V stages of the dQ kernel
// Per head dim, the best measured on an H200 (dev/cuda/attention_backward.cu): keys per K / V tile of the dQ kernel,
// and whether its warpgroups hold their Q and dO rows in registers as A fragments (at hd 64 no faster).
__host__ __device__ constexpr int wgmma_dq_keys(int hd) { return hd == 64 ? 128 : 64; }
__host__ __device__ constexpr bool wgmma_dq_q_in_registers(int hd) { return hd == 128; }

// ----------------------------------------------------------------------------------------------------------------
// Tile helpers

// Thread 0 initialises a warp-specialised kernel's mbarriers: `once` (1 arrival: the tiles loaded once per item),
// and per stage full[s] (full_count arrivals) and empty[s] (one per consumer thread); then the CTA-wide barrier that
// publishes them, the kernel's last (after it the warpgroups part ways).
__device__ __forceinline__ void wgmma_init_barriers(uint32_t once, uint32_t full0, uint32_t empty0, int stages,
                                                    uint32_t full_count) {
    if (threadIdx.x == 0) {
        mbarrier_init(once, 1);
        for (int s = 0; s < stages; s++) {
            mbarrier_init(full0 + 8 * s, full_count);
            mbarrier_init(empty0 + 8 * s, WGMMA_CONSUMERS);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
}

// The same for a persistent kernel's per-item tiles in q_buffers buffers: q_full[i] (1 arrival: the TMA) and
// q_empty[i] (one per consumer thread, once buffer i's Q is no longer read: see the forward kernel).
__device__ __forceinline__ void wgmma_init_item_barriers(uint32_t q_full0, uint32_t q_empty0, int q_buffers,
                                                         uint32_t full0, uint32_t empty0, int stages) {
    if (threadIdx.x == 0) {
        for (int i = 1; i < q_buffers; i++) mbarrier_init(q_full0 + 8 * i, 1);
        for (int i = 0; i < q_buffers; i++) mbarrier_init(q_empty0 + 8 * i, WGMMA_CONSUMERS);
    }
    wgmma_init_barriers(q_full0, full0, empty0, stages, 1);  // q_full[0] too; its fence and barrier publish all
}

// Stores a warpgroup's 64 x HD fp32 accumulator (times mult) as bf16 to global rows r0 .. r0 + 63 (skipping rows
// >= T; dst: row 0, column 0 of the head), staged through rows 64 wg .. 64 wg + 63 of a swizzled smem tile of R rows
// (wg: the consumer warpgroup's index, 0 or 1).
// rope: nullptr, or RoPE's (T, HD/2, 2) {cos, sin} table (llmc/rope.cuh): then each pair of columns (2i, 2i+1) of
// row t is rotated back by pair i's angle at position t after the rounding to bf16, and rounded again: the same bits
// rope_backward would leave on the stored values, without its pass over them.
template <int HD, int R>
__device__ __forceinline__ void wgmma_store_rows(__nv_bfloat16* dst, size_t row_stride, uint8_t* stage,
                                                 const float (&acc)[HD / 2], float mult, int r0, int T, int wg,
                                                 const float* rope = nullptr) {
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
    named_barrier_sync<128>(1 + wg);
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
// default) of a swizzled tile of R rows at `tile`: a stationary operand kept in registers for wgmma_bf16_rs (fragment
// layout in the section comment).
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
// Built once per tile (or per warpgroup); the k16 slices are reached with wgmma_desc_advance.
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

// P^T of a dK/dV item in place of its S^T fragment: rows are the thread's keys key0, key0 + 8, columns the item's BQ
// queries from q0 (element i: key key0 + 8 ((i / 2) % 2), query q0 + 8 (i / 4) + c + i % 2);
// P^T = exp2(S^T scale log2 e - lse log2 e), 0 where key > query or query >= T (MASK: the caller's item has such
// elements). lse_t: the item's lse, times lse_mult (1 where it is stored times log2 e already, log2 e where not).
template <int BQ, bool MASK>
__device__ __forceinline__ void attention_backward_probs_t(float (&s)[BQ / 2], const float* lse_t, float lse_mult,
                                                           float scale_log2, int q0, int key0, int c, int T) {
#pragma unroll
    for (int i = 0; i < BQ / 2; i++) {
        const int qi = 8 * (i / 4) + c + i % 2;
        float p = exp2f(fmaf(s[i], scale_log2, -lse_t[qi] * lse_mult));
        if constexpr (MASK) {
            const int q = q0 + qi, key = key0 + 8 * ((i / 2) % 2);
            if (key > q || q >= T) p = 0.0f;  // select, not multiply: p may be inf where masked
        }
        s[i] = p;
    }
}
// P of a dQ tile in place of its S fragment: rows are the thread's queries row0, row0 + 8, columns the tile's BN keys
// from k0 (element i: query row0 + 8 ((i / 2) % 2), key k0 + 8 (i / 4) + c + i % 2); P = exp2(S scale log2 e - lse2),
// lse2: the two rows' lse times log2 e; 0 where key > query (MASK: the caller's tile has such elements). Keys >= T
// need no test of their own: they follow every valid query.
template <int BN, bool MASK>
__device__ __forceinline__ void attention_backward_probs(float (&s)[BN / 2], const float (&lse2)[2], float scale_log2,
                                                         int k0, int row0, int c) {
#pragma unroll
    for (int i = 0; i < BN / 2; i++) {
        const int r = (i / 2) % 2;
        float p = exp2f(fmaf(s[i], scale_log2, -lse2[r]));
        if (MASK && k0 + 8 * (i / 4) + c + i % 2 > row0 + 8 * r) p = 0.0f;
        s[i] = p;
    }
}
// The dK/dV form again, masking only where the item needs it (kwg: the warpgroup's first key). The test sits outside
// the loop: inside it, ptxas turned it into predicated selects on every item (about a fifth of the hd 64 dK/dV
// kernel's instructions), where only the diagonal items and the last query tile need them.
template <int BQ>
__device__ __forceinline__ void attention_backward_probs_t(float (&s)[BQ / 2], const float* lse_t, float lse_mult,
                                                           float scale_log2, int q0, int kwg, int key0, int c, int T) {
    if (kwg + 63 > q0 || q0 + BQ > T) {  // warpgroup-uniform
        attention_backward_probs_t<BQ, true>(s, lse_t, lse_mult, scale_log2, q0, key0, c, T);
    } else {
        attention_backward_probs_t<BQ, false>(s, lse_t, lse_mult, scale_log2, q0, key0, c, T);
    }
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
// Forward

template <int NS>
__device__ __forceinline__ void wgmma_softmax_update(float (&s)[NS], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                  float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = -INFINITY;
#pragma unroll
        for (int jn = 0; jn < NS / 4; jn++) mx = fmaxf(mx, fmaxf(s[4 * jn + 2 * r], s[4 * jn + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));  // the 4 lanes of a quad share the row
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m[r], mx * scale_log2);
        const float base = m_new == -INFINITY ? 0.0f : m_new;  // no (-inf) - (-inf) for a fully masked row
        alpha[r] = exp2f(m[r] - base);
        m[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int jn = 0; jn < NS / 4; jn++) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s[4 * jn + e] = exp2f(fmaf(s[4 * jn + e], scale_log2, -base));
                sum += s[4 * jn + e];
            }
        }
        l[r] = l[r] * alpha[r] + sum;
    }
}

// Shared memory of the forward with q_buffers Q tiles: two where they fit (a later item's Q loads while the last
// one's epilogue stages its output through its own), else one.
template <int HD, int STAGES, int Q_BUFFERS>
__host__ __device__ constexpr size_t attention_forward_wgmma_smem_bytes_with() {
    return sizeof(__nv_bfloat16) * HD * (Q_BUFFERS * WGMMA_ROWS + 2 * STAGES * WGMMA_FWD_KEYS) +
           8 * (2 * Q_BUFFERS + 2 * STAGES) + 1024;
}
template <int HD, int STAGES>
__host__ __device__ constexpr int attention_forward_wgmma_q_buffers() {
    return attention_forward_wgmma_smem_bytes_with<HD, STAGES, 2>() <= 227 * 1024 ? 2 : 1;
}
template <int HD, int STAGES>
__host__ __device__ constexpr size_t attention_forward_wgmma_smem_bytes() {
    return attention_forward_wgmma_smem_bytes_with<HD, STAGES, attention_forward_wgmma_q_buffers<HD, STAGES>()>();
}
// Persistent (a CTA takes items in turn) with two Q buffers, or with one whose Q is released as soon as the item's
// last S product is done (the overlapped schedule; the epilogue then stores O from registers), so the next Q loads
// under the last P V and the epilogue. Otherwise one item per CTA.
template <int HD, int STAGES, bool OVERLAP>
__host__ __device__ constexpr bool attention_forward_wgmma_persistent() {
    return attention_forward_wgmma_q_buffers<HD, STAGES>() == 2 || OVERLAP;
}

// The consumer's turn on tile k0: causal mask (diagonal tile only), online softmax update of m, l, then P (bf16 A
// fragments); alpha: the factor the running O must be scaled by before P V is added.
__device__ __forceinline__ void attention_forward_wgmma_softmax(float (&s)[WGMMA_FWD_KEYS / 2],
                                                                uint32_t (&p)[WGMMA_FWD_KEYS / 16][4], float (&m)[2],
                                                                float (&l)[2], float (&alpha)[2], int k0, int qwg,
                                                                int row0, int c, float scale_log2) {
    // diagonal: some key is after some query of the warpgroup (keys >= T included)
    if (k0 + WGMMA_FWD_KEYS - 1 > qwg) {
#pragma unroll
        for (int i = 0; i < WGMMA_FWD_KEYS / 2; i++) {
            const int key = k0 + 8 * (i / 4) + c + (i % 2), q = row0 + 8 * ((i / 2) % 2);
            if (key > q) s[i] = -INFINITY;
        }
    }
    wgmma_softmax_update(s, m, l, alpha, scale_log2);
    wgmma_acc_to_a<WGMMA_FWD_KEYS>(p, s);
}

template <int HD>
__device__ __forceinline__ void attention_forward_wgmma_rescale(float (&o)[HD / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int jn = 0; jn < HD / 8; jn++) {
        o[4 * jn + 0] *= alpha[0];
        o[4 * jn + 1] *= alpha[0];
        o[4 * jn + 2] *= alpha[1];
        o[4 * jn + 3] *= alpha[1];
    }
}

// O += P V over the tile's 128 keys, one commit group: v = wgmma_desc_mnmajor of the V tile; its k16 slice kk is rows
// 16 kk (byte 2048 kk).
template <int HD>
__device__ __forceinline__ void attention_forward_wgmma_pv(float (&o)[HD / 2],
                                                           const uint32_t (&p)[WGMMA_FWD_KEYS / 16][4], uint64_t v) {
#pragma unroll
    for (int kk = 0; kk < WGMMA_FWD_KEYS / 16; kk++) wgmma_bf16_rs(o, p[kk], wgmma_desc_advance(v, 2048 * kk), 1);
    wgmma_commit_group();
}

// The i-th work item of this CTA in a persistent kernel: rounds of gridDim.x items, taken alternately in and against
// CTA order (a snake). The items are sorted longest first, so a fixed stride would give CTA 0 the longest item of
// every round; the snake evens the totals out (the hd 128 forward at (1, 8192): 610-638 TFLOP/s with the fixed
// stride, 670-674 with the snake; the dQ kernel +2-3% at hd 128; H100).
__device__ __forceinline__ int persistent_item(int i) {
    return i * gridDim.x + ((i & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
}

// Work item w of the persistent forward: (b, h) = w % (B H), query tile q_tiles - 1 - w / (B H), so the longest
// (last) query tiles come first.
__device__ __forceinline__ void attention_forward_item(int w, int H, int BH, int q_tiles, int& b, int& h, int& q0) {
    const int bh = w % BH;
    b = bh / H;
    h = bh % H;
    q0 = (q_tiles - 1 - w / BH) * WGMMA_ROWS;
}

// grid: at most B * H * ceil(T / 128) (persistent: the SMs), block 384; a CTA takes the work items persistent_item
// gives it (attention_forward_item). qkv_map: qkv as the 4-D tensor (hd, head, token, batch), box (64, 1, 128, 1),
// 128-byte swizzle (attention_qkv_tensor_map).
template <int HD, int STAGES, bool OVERLAP>
__global__ void __launch_bounds__(WGMMA_WS_THREADS, 1)
    attention_forward_wgmma_kernel(const __grid_constant__ CUtensorMap qkv_map, __nv_bfloat16* out, float* lse, int B,
                                   int T, int H, int KV, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma and setmaxnreg exist only in sm_90a code
    constexpr int BN = WGMMA_FWD_KEYS, QBYTES = WGMMA_ROWS * HD * 2, TBYTES = BN * HD * 2;  // tile sizes in bytes
    constexpr int QBUF = attention_forward_wgmma_q_buffers<HD, STAGES>();
    constexpr bool EARLY_Q = QBUF == 1 && OVERLAP;  // Q released after the last S product (above)
    constexpr bool PERSISTENT = attention_forward_wgmma_persistent<HD, STAGES, OVERLAP>();
    static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
    static_assert(STAGES >= 2, "at least 2 K / V stages");
    static_assert(!(OVERLAP && HD == 64) || STAGES >= 3, "LATE_WAIT (hd 64 with overlap) needs at least 3 stages");
    static_assert(attention_forward_wgmma_smem_bytes<HD, STAGES>() <= 227 * 1024, "stages do not fit in shared memory");
    extern __shared__ uint8_t wgmma_smem[];
    // Swizzle atoms (and TMA's swizzled destinations) start on 1024-byte boundaries: align the shared address.
    const uint32_t smem = (smem_addr(wgmma_smem) + 1023u) & ~1023u;
    const uint32_t q_sm = smem;                         // QBUF x Q (128 x HD), swizzled, HD / 64 column blocks
    const uint32_t k_sm = q_sm + QBUF * QBYTES;         // STAGES x K (BN x HD)
    const uint32_t v_sm = k_sm + STAGES * TBYTES;       // STAGES x V (BN x HD)
    const uint32_t q_full0 = v_sm + STAGES * TBYTES;    // mbarriers: q_full[QBUF], q_empty[QBUF], full[STAGES],
    const uint32_t q_empty0 = q_full0 + 8 * QBUF;       // empty[STAGES]
    const uint32_t full0 = q_empty0 + 8 * QBUF, empty0 = full0 + 8 * STAGES;
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));  // generic pointer to the aligned base
    const int q_tiles = ceil_div(T, WGMMA_ROWS), BH = B * H, n_items = BH * q_tiles;

    wgmma_init_item_barriers(q_full0, q_empty0, QBUF, full0, empty0, STAGES);

    if (threadIdx.x < 128) {  // producer warpgroup
        setmaxnreg_dec<WGMMA_PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            int it = 0;  // K / V tiles loaded so far: tile `it` goes to stage it % STAGES in round it / STAGES
            for (int i = 0, item = persistent_item(0); item < n_items; item = persistent_item(++i)) {
                int b, h, q0;
                attention_forward_item(item, H, BH, q_tiles, b, h, q0);
                const int kvh = h / (H / KV), n_tiles = ceil_div(min(q0 + WGMMA_ROWS, T), BN);
                auto load_kv = [&](int j) {
                    const int s = it % STAGES, round = it / STAGES;
                    if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);  // released by the consumers
                    mbarrier_arrive_expect_tx(full0 + 8 * s, 2 * TBYTES);         // K and V, all column blocks
                    for (int cb = 0; cb < HD / 64; cb++) {
                        tma_load_4d(k_sm + s * TBYTES + cb * (BN * 128), &qkv_map, full0 + 8 * s, 64 * cb, H + kvh,
                                    j * BN, b);
                        tma_load_4d(v_sm + s * TBYTES + cb * (BN * 128), &qkv_map, full0 + 8 * s, 64 * cb,
                                    H + KV + kvh, j * BN, b);
                    }
                    it++;
                };
                const int buf = i % QBUF, use = i / QBUF;
                if (use > 0) mbarrier_wait(q_empty0 + 8 * buf, (use - 1) & 1);  // its last item is done with it
                mbarrier_arrive_expect_tx(q_full0 + 8 * buf, QBYTES);
                for (int cb = 0; cb < HD / 64; cb++) {
                    tma_load_4d(q_sm + buf * QBYTES + cb * (WGMMA_ROWS * 128), &qkv_map, q_full0 + 8 * buf, 64 * cb,
                                h, q0, b);
                }
                for (int j = 0; j < n_tiles; j++) load_kv(j);
                if constexpr (!PERSISTENT) break;
            }
        }
        return;
    }

    // Consumers.
    setmaxnreg_inc<WGMMA_CONSUMER_REGS>();
    // Through a shuffle as in the backward's kernels (below): ptxas then keeps the wgmma descriptors in uniform
    // registers (52 -> 20 R2UR moves at hd 64, 74 -> 18 at hd 128; the same speed, H100).
    const int wg = __shfl_sync(0xffffffff, (int)threadIdx.x / 128 - 1, 0);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    if (wg == 1) named_barrier_arrive<WGMMA_CONSUMERS>(1);  // consumer 0 issues first
    int base = 0;  // K / V tiles of the CTA's earlier items: tile j of this one is ring entry base + j
    for (int i = 0, item = persistent_item(0); item < n_items; item = persistent_item(++i)) {
        int b, h, q0;
        attention_forward_item(item, H, BH, q_tiles, b, h, q0);
        const int n_tiles = ceil_div(min(q0 + WGMMA_ROWS, T), BN);  // causal: keys up to the item's last query
        const int buf = i % QBUF;
        const int qwg = q0 + 64 * wg;          // the warpgroup's first query
        const int row0 = qwg + 16 * warp + g;  // this thread's rows: row0 and row0 + 8

        float o[HD / 2];  // O accumulator fragment (64 x HD per warpgroup)
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows row0, row0 + 8: running max (log2), sums
#pragma unroll
        for (int r = 0; r < HD / 2; r++) o[r] = 0.0f;
        float s[BN / 2];          // S accumulator fragment (64 x 128)
        uint32_t p[BN / 16][4];   // P as bf16 A registers, live until its P V wgmma has been waited on
        float alpha[2];
        const uint64_t q_desc = wgmma_desc_kmajor(q_sm + buf * QBYTES + 64 * wg * 128);  // the warpgroup's Q rows
        const uint64_t k_desc = wgmma_desc_kmajor(k_sm), v_desc = wgmma_desc_mnmajor(v_sm, BN);  // stage 0
        mbarrier_wait(q_full0 + 8 * buf, (i / QBUF) & 1);

        if constexpr (!OVERLAP) {
            for (int j = 0; j < n_tiles; j++) {
                const int st = (base + j) % STAGES;
                mbarrier_wait(full0 + 8 * st, ((base + j) / STAGES) & 1);
                named_barrier_sync<WGMMA_CONSUMERS>(1 + wg);  // my turn to issue
                wgmma_fence();
                wgmma_scores_ss<HD, WGMMA_ROWS, BN>(s, q_desc, wgmma_desc_advance(k_desc, st * TBYTES));
                named_barrier_arrive<WGMMA_CONSUMERS>(2 - wg);  // the other consumer's turn
                wgmma_wait_group<0>();
                pin_registers(s);
                attention_forward_wgmma_softmax(s, p, m, l, alpha, j * BN, qwg, row0, c, scale_log2);
                attention_forward_wgmma_rescale<HD>(o, alpha);
                pin_registers(p);  // P and the rescaled O are written before the wgmma.fence
                pin_registers(o);
                named_barrier_sync<WGMMA_CONSUMERS>(1 + wg);
                wgmma_fence();
                attention_forward_wgmma_pv<HD>(o, p, wgmma_desc_advance(v_desc, st * TBYTES));
                named_barrier_arrive<WGMMA_CONSUMERS>(2 - wg);
                wgmma_wait_group<0>();
                pin_registers(o);
                pin_registers(p);
                mbarrier_arrive(empty0 + 8 * st);  // this thread's reads of the stage are done
            }
        } else {
            // P_j lives in p (j even) or pb (j odd) (no register copies: ptxas serialises the wgmmas when ordinary
            // instructions define their A registers inside the pipeline).
            uint32_t pb[BN / 16][4];
            // Where P_j V_j is waited for (and its stage released, O rescaled). Right after the softmax of S_{j+1},
            // ptxas schedules the softmax below the wait (register arithmetic moves freely past wgmma.wait_group). At
            // hd 64 the wait goes to the start of the next step, after the tile's mbarrier wait, and the softmax stays
            // between the two waits: forward +1-4% (H100, two sessions' calls). At hd 128 that makes ptxas serialise
            // the wgmmas (C7512: registers), and keeping the softmax ahead of the wait there by other means was 5%
            // slower.
            constexpr bool LATE_WAIT = HD == 64;
            // Tile j < n_tiles - 1: S_{j+1} and P_j V_j issued together, the softmax of S_{j+1} (into p_next) while
            // P_j V_j runs.
            auto step = [&](int j, uint32_t(&p_cur)[BN / 16][4], uint32_t(&p_next)[BN / 16][4]) {
                const int st = (base + j) % STAGES, nst = (base + j + 1) % STAGES;
                mbarrier_wait(full0 + 8 * nst, ((base + j + 1) / STAGES) & 1);
                if constexpr (LATE_WAIT) {
                    wgmma_wait_group<0>();
                    pin_registers(o);
                    pin_registers(p_next);
                    if (j > 0) mbarrier_arrive(empty0 + 8 * ((base + j - 1) % STAGES));
                    attention_forward_wgmma_rescale<HD>(o, alpha);
                }
                pin_registers(p_cur);
                pin_registers(o);
                named_barrier_sync<WGMMA_CONSUMERS>(1 + wg);
                wgmma_fence();
                wgmma_scores_ss<HD, WGMMA_ROWS, BN>(s, q_desc, wgmma_desc_advance(k_desc, nst * TBYTES));  // S_{j+1}
                attention_forward_wgmma_pv<HD>(o, p_cur, wgmma_desc_advance(v_desc, st * TBYTES));  // P_j V_j
                named_barrier_arrive<WGMMA_CONSUMERS>(2 - wg);
                wgmma_wait_group<1>();  // groups complete in order: S_{j+1} is done, P_j V_j may still run
                pin_registers(s);
                if (EARLY_Q && j + 2 == n_tiles) mbarrier_arrive(q_empty0 + 8 * buf);  // the item's last S is done
                attention_forward_wgmma_softmax(s, p_next, m, l, alpha, (j + 1) * BN, qwg, row0, c, scale_log2);
                if constexpr (!LATE_WAIT) {
                    wgmma_wait_group<0>();  // P_j V_j done: O may be rescaled, P_j's registers and stage st are free
                    pin_registers(o);
                    pin_registers(p_cur);
                    mbarrier_arrive(empty0 + 8 * st);
                    attention_forward_wgmma_rescale<HD>(o, alpha);
                }
            };
            // The last tile: P V only.
            auto last = [&](int j, uint32_t(&p_cur)[BN / 16][4]) {
                const int st = (base + j) % STAGES;
                if constexpr (LATE_WAIT) {
                    wgmma_wait_group<0>();
                    pin_registers(o);
                    if (j > 0) mbarrier_arrive(empty0 + 8 * ((base + j - 1) % STAGES));
                    attention_forward_wgmma_rescale<HD>(o, alpha);
                }
                pin_registers(p_cur);
                pin_registers(o);
                named_barrier_sync<WGMMA_CONSUMERS>(1 + wg);
                wgmma_fence();
                attention_forward_wgmma_pv<HD>(o, p_cur, wgmma_desc_advance(v_desc, st * TBYTES));
                named_barrier_arrive<WGMMA_CONSUMERS>(2 - wg);
                wgmma_wait_group<0>();
                pin_registers(o);
                pin_registers(p_cur);
                mbarrier_arrive(empty0 + 8 * st);
            };
            // Prologue: S_0 and its softmax (O is zero: no rescale).
            const int st0 = base % STAGES;
            mbarrier_wait(full0 + 8 * st0, (base / STAGES) & 1);
            named_barrier_sync<WGMMA_CONSUMERS>(1 + wg);
            wgmma_fence();
            wgmma_scores_ss<HD, WGMMA_ROWS, BN>(s, q_desc, wgmma_desc_advance(k_desc, st0 * TBYTES));
            named_barrier_arrive<WGMMA_CONSUMERS>(2 - wg);
            wgmma_wait_group<0>();
            pin_registers(s);
            if (EARLY_Q && n_tiles == 1) mbarrier_arrive(q_empty0 + 8 * buf);
            attention_forward_wgmma_softmax(s, p, m, l, alpha, 0, qwg, row0, c, scale_log2);
            int j = 0;
            for (; j + 2 < n_tiles; j += 2) {
                step(j, p, pb);
                step(j + 1, pb, p);
            }
            if (j + 1 < n_tiles) {
                step(j, p, pb);
                last(j + 1, pb);
            } else {
                last(j, p);
            }
        }
        base += n_tiles;

        // Epilogue. lse, then O / l as bf16 into the warpgroup's own rows of the (dead) Q tile, then coalesced
        // stores; then the buffer is released for a later item's Q. With the Q released early, O goes out from the
        // registers: 4-byte stores, a quad's lanes 16 contiguous bytes of a row.
        float inv_l[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float sum = l[r];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            inv_l[r] = 1.0f / sum;
            const int q = row0 + 8 * r;
            if (lane % 4 == 0 && q < T) lse[((size_t)b * H + h) * T + q] = (m[r] + log2f(sum)) * ATTN_LN2;
        }
        const size_t out_stride = (size_t)H * HD;
        __nv_bfloat16* dst = out + (size_t)b * T * out_stride + (size_t)h * HD;
        if constexpr (EARLY_Q) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                if (row0 + 8 * r >= T) continue;
                __nv_bfloat16* row = dst + (size_t)(row0 + 8 * r) * out_stride + c;
#pragma unroll
                for (int jn = 0; jn < HD / 8; jn++) {
                    *reinterpret_cast<uint32_t*>(row + 8 * jn) =
                        pack_bf16x2(o[4 * jn + 2 * r] * inv_l[r], o[4 * jn + 2 * r + 1] * inv_l[r]);
                }
            }
            continue;
        }
        uint8_t* staged = smem_ptr + buf * QBYTES;
        const int lr = 64 * wg + 16 * warp + g;  // the thread's first row inside the Q tile
#pragma unroll
        for (int jn = 0; jn < HD / 8; jn++) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                *reinterpret_cast<uint32_t*>(staged + swizzle128_offset<WGMMA_ROWS>(lr + 8 * r, jn) + 2 * c) =
                    pack_bf16x2(o[4 * jn + 2 * r] * inv_l[r], o[4 * jn + 2 * r + 1] * inv_l[r]);
            }
        }
        named_barrier_sync<128>(3 + wg);  // the warpgroup's rows are staged
        constexpr int CHUNKS = HD / 8;
        const int t = threadIdx.x % 128;
#pragma unroll
        for (int r8 = 0; r8 < 64 * CHUNKS / 128; r8++) {
            const int idx = r8 * 128 + t, r = idx / CHUNKS, ch = idx % CHUNKS;
            if (qwg + r < T) {
                *reinterpret_cast<int4*>(dst + (size_t)(qwg + r) * out_stride + 8 * ch) =
                    *reinterpret_cast<const int4*>(staged + swizzle128_offset<WGMMA_ROWS>(64 * wg + r, ch));
            }
        }
        if constexpr (!PERSISTENT) break;  // no state carried between items: the single-item code of old
        // The TMA that loads a later item's Q into this buffer must come after these generic accesses.
        fence_proxy_async_shared();
        mbarrier_arrive(q_empty0 + 8 * buf);
    }
    if (wg == 0) named_barrier_sync<WGMMA_CONSUMERS>(1);  // consume consumer 1's last pass: no arrival left pending
#else
    // Not sm_90a code: the host never launches this (attention_forward_wgmma_config checks attention_wgmma_usable).
    __trap();
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// Backward

template <int HD>
__host__ __device__ constexpr size_t attention_backward_dkdv_wgmma_smem_bytes() {
    constexpr int S = WGMMA_DKDV_STAGES, BQ = WGMMA_DKDV_QUERIES;
    return sizeof(__nv_bfloat16) * HD * (2 * WGMMA_ROWS + 2 * S * BQ) + sizeof(float) * 2 * S * BQ + 8 * (1 + 2 * S) +
           1024;
}

// dK, dV for one (b, kv head, tile of 128 keys). grid (B * KV, ceil(T / 128)), block 384. kv_map: qkv with 128-row
// boxes; q_map: qkv with 64-row boxes; do_map: dout with 64-row boxes (attention_heads_tensor_map).
template <int HD>
__global__ void __launch_bounds__(WGMMA_WS_THREADS, 1)
    attention_backward_dkdv_wgmma_kernel(const __grid_constant__ CUtensorMap kv_map,
                                         const __grid_constant__ CUtensorMap q_map,
                                         const __grid_constant__ CUtensorMap do_map, __nv_bfloat16* dqkv,
                                         const float* lse, const float* delta, const float* rope, int T, int H, int KV,
                                         float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = WGMMA_ROWS, S = WGMMA_DKDV_STAGES, BQ = WGMMA_DKDV_QUERIES;
    constexpr int KBYTES = ROWS * HD * 2, QBYTES = BQ * HD * 2;
    // Head dim 64: the consumers take turns issuing (ping-pong), each turn one item's S^T, dP^T and the previous
    // item's dV, dK products: +5% over issuing each product when its operands are ready (H100). Head dim 128 has no
    // registers for the second item in flight (P^T, dS^T of two items) and issues per product.
    constexpr bool PINGPONG = HD == 64;
    constexpr int TURN_BARRIER = 3;  // named barriers 3 and 4: the consumers' turns (1 + wg: the stores)
    static_assert(ROWS % BQ == 0, "query tiles must start at the key tile's first key");
    static_assert(BQ == 64 || BQ == 128, "S^T, dP^T are wgmma m64nBQk16 with N = 64 or 128 (wgmma_bf16_ss overloads)");
    static_assert(attention_backward_dkdv_wgmma_smem_bytes<HD>() <= 227 * 1024, "stages do not fit in shared memory");
    extern __shared__ uint8_t wgmma_smem[];
    const uint32_t smem = (smem_addr(wgmma_smem) + 1023u) & ~1023u;
    const uint32_t k_sm = smem;                // K (128 x HD), swizzled
    const uint32_t v_sm = k_sm + KBYTES;       // V (128 x HD)
    const uint32_t q_sm = v_sm + KBYTES;       // S stages x Q (BQ x HD)
    const uint32_t do_sm = q_sm + S * QBYTES;  // S stages x dO (BQ x HD)
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));
    float* lse_s = reinterpret_cast<float*>(smem_ptr + 2 * KBYTES + 2 * S * QBYTES);  // S stages x BQ, times log2 e
    float* D_s = lse_s + S * BQ;                                                      // S stages x BQ
    const uint32_t kv_full = smem_addr(D_s + S * BQ);  // mbarriers: kv_full, full[S], empty[S]
    const uint32_t full0 = kv_full + 8, empty0 = full0 + 8 * S;

    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ROWS;  // the first key tiles see the most queries: scheduled first
    // Items (query head of the group, query tile from the diagonal); k0 is a multiple of BQ. Item it is query head
    // kvh * group + it / n_q, tile from q0 = k0 + (it % n_q) BQ; every loop below walks (head, q0) by counting
    // (q0 wraps to k0 at q_end), not by dividing by n_q (an integer division per item).
    const int n_q = ceil_div(T - k0, BQ), n_items = group * n_q, q_end = k0 + n_q * BQ;

    // full[s]: the TMA thread's arrive.expect_tx and one arrival per lse / D thread
    wgmma_init_barriers(kv_full, full0, empty0, S, 1 + BQ);

    if (threadIdx.x < 128) {  // producer warpgroup
        setmaxnreg_dec<WGMMA_PRODUCER_REGS>();
        if (threadIdx.x < 32) {
            if (elect_one_sync()) {
                mbarrier_arrive_expect_tx(kv_full, 2 * KBYTES);
                for (int cb = 0; cb < HD / 64; cb++) {
                    tma_load_4d(k_sm + cb * (ROWS * 128), &kv_map, kv_full, 64 * cb, H + kvh, k0, b);
                    tma_load_4d(v_sm + cb * (ROWS * 128), &kv_map, kv_full, 64 * cb, H + KV + kvh, k0, b);
                }
                for (int it = 0, h = kvh * group, q0 = k0; it < n_items; it++) {
                    const int s = it % S, round = it / S;
                    if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);
                    mbarrier_arrive_expect_tx(full0 + 8 * s, 2 * QBYTES);
                    for (int cb = 0; cb < HD / 64; cb++) {
                        tma_load_4d(q_sm + s * QBYTES + cb * (BQ * 128), &q_map, full0 + 8 * s, 64 * cb, h, q0, b);
                        tma_load_4d(do_sm + s * QBYTES + cb * (BQ * 128), &do_map, full0 + 8 * s, 64 * cb, h, q0, b);
                    }
                    q0 += BQ;
                    if (q0 == q_end) q0 = k0, h++;
                }
            }
        } else if (threadIdx.x < 32 + BQ) {  // one query's lse and D per thread (lse, D rows need not be 16-byte
                                             // aligned, which a bulk copy would want)
            const int i = threadIdx.x - 32;
            // (b, first head of the group) rows of lse and delta; a head's row is T further on
            const float* lse_row = lse + ((size_t)b * H + kvh * group) * T;
            const float* delta_row = delta + ((size_t)b * H + kvh * group) * T;
            for (int it = 0, q = k0 + i; it < n_items; it++) {
                const int s = it % S, round = it / S;
                if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);
                lse_s[s * BQ + i] = q < T ? lse_row[q] * ATTN_LOG2E : 0.0f;  // in the log2 domain
                D_s[s * BQ + i] = q < T ? delta_row[q] : 0.0f;
                mbarrier_arrive(full0 + 8 * s);  // releases the two stores to whoever waits on full[s]
                q += BQ;
                if (q >= q_end) q -= n_q * BQ, lse_row += T, delta_row += T;
            }
        }
        return;
    }

    // Consumers.
    setmaxnreg_inc<WGMMA_CONSUMER_REGS>();
    // The warpgroup's index through a shuffle: written as threadIdx.x / 128 - 1, ptxas serialised the kernel's wgmmas
    // when they ran on across items (C7515); as a value it cannot trace back to threadIdx it does not.
    const int wg = __shfl_sync(0xffffffff, (int)threadIdx.x / 128 - 1, 0);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int kwg = k0 + 64 * wg;          // the warpgroup's first key
    const int key0 = kwg + 16 * warp + g;  // this thread's keys: key0 and key0 + 8

    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) dk[i] = dv[i] = 0.0f;
    // Descriptors: the warpgroup's rows of K and V (A of S^T, dP^T), and stage 0 of Q and dO read K-major (B of S^T,
    // dP^T) and MN-major (B of dK, dV).
    const uint64_t k_desc = wgmma_desc_kmajor(k_sm + 64 * wg * 128), v_desc = wgmma_desc_kmajor(v_sm + 64 * wg * 128);
    const uint64_t q_desc = wgmma_desc_kmajor(q_sm), do_desc = wgmma_desc_kmajor(do_sm);
    const uint64_t q_desc_t = wgmma_desc_mnmajor(q_sm, BQ), do_desc_t = wgmma_desc_mnmajor(do_sm, BQ);
    mbarrier_wait(kv_full, 0);

    // Pieces of an item both schedules below share. dS^T = P^T o (dP^T - D), in dp's registers:
    auto ds_t = [&](const float(&s)[BQ / 2], float(&dp)[BQ / 2], const float* D_t) {
#pragma unroll
        for (int i = 0; i < BQ / 2; i++) dp[i] = s[i] * (dp[i] - D_t[8 * (i / 4) + c + i % 2]);
    };
    // dV += P^T dO and dK += dS^T Q, one commit group.
    auto grads = [&](int stage, const uint32_t(&pa)[BQ / 16][4], const uint32_t(&dsa)[BQ / 16][4]) {
        const uint32_t st_bytes = stage * QBYTES;
        wgmma_accumulate_packed<HD, BQ>(dv, pa, wgmma_desc_advance(do_desc_t, st_bytes));
        wgmma_accumulate_packed<HD, BQ>(dk, dsa, wgmma_desc_advance(q_desc_t, st_bytes));
        wgmma_commit_group();
    };
    // Waits for every product issued (the last being dV, dK), then frees their stage.
    auto finish_grads = [&](int stage, uint32_t(&pa)[BQ / 16][4], uint32_t(&dsa)[BQ / 16][4]) {
        wgmma_wait_group<0>();
        pin_registers(pa);
        pin_registers(dsa);
        pin_registers(dk);
        pin_registers(dv);
        mbarrier_arrive(empty0 + 8 * stage);
    };

    if constexpr (PINGPONG) {
        // P^T and dS^T of item it live in buffer it % 2 until the turn after (no register copies: ptxas serialises
        // the wgmmas when ordinary instructions define their A registers inside the pipeline). Every turn issues the
        // same groups in the same order, so that ptxas can tell which group each wait covers; a warpgroup's skipped
        // item (all its keys after all the queries) runs masked, P^T = 0, and adds zeros.
        uint32_t pa0[BQ / 16][4], dsa0[BQ / 16][4], pa1[BQ / 16][4], dsa1[BQ / 16][4];
        if (wg == 1) named_barrier_arrive<WGMMA_CONSUMERS>(TURN_BARRIER);  // consumer 0 issues first
        // Item it's P^T, dS^T from its S^T, dP^T (the groups in flight: S^T, dP^T, and one more if `later`).
        auto probs = [&](int it, int q0, float(&s)[BQ / 2], float(&dp)[BQ / 2], uint32_t(&pa)[BQ / 16][4],
                         uint32_t(&dsa)[BQ / 16][4], bool later) {
            const int stage = it % S;
            const float* lse_t = lse_s + stage * BQ;
            const float* D_t = D_s + stage * BQ;
            if (later) wgmma_wait_group<2>(); else wgmma_wait_group<1>();  // S^T done
            pin_registers(s);
            attention_backward_probs_t<BQ>(s, lse_t, 1.0f, scale_log2, q0, kwg, key0, c, T);
            wgmma_acc_to_a<BQ>(pa, s);
            if (later) wgmma_wait_group<1>(); else wgmma_wait_group<0>();  // dP^T done
            pin_registers(dp);
            ds_t(s, dp, D_t);
            wgmma_acc_to_a<BQ>(dsa, dp);
        };
        auto scores = [&](int stage, float(&s)[BQ / 2], float(&dp)[BQ / 2]) {
            const uint32_t st_bytes = stage * QBYTES;
            wgmma_scores_ss<HD, ROWS, BQ>(s, k_desc, wgmma_desc_advance(q_desc, st_bytes));
            wgmma_scores_ss<HD, ROWS, BQ>(dp, v_desc, wgmma_desc_advance(do_desc, st_bytes));
        };
        // The first item: its S^T, dP^T only.
        {
            float s[BQ / 2], dp[BQ / 2];
            mbarrier_wait(full0, 0);
            named_barrier_sync<WGMMA_CONSUMERS>(TURN_BARRIER + wg);
            wgmma_fence();
            scores(0, s, dp);
            named_barrier_arrive<WGMMA_CONSUMERS>(TURN_BARRIER + 1 - wg);
            probs(0, k0, s, dp, pa0, dsa0, false);
        }
        // Item it (it >= 1): its S^T, dP^T and item it - 1's dV, dK issued together, then item it's P^T, dS^T; then
        // item it - 1's stage is released.
        auto step = [&](int it, int q0, uint32_t(&pa_cur)[BQ / 16][4], uint32_t(&dsa_cur)[BQ / 16][4],
                        uint32_t(&pa_prev)[BQ / 16][4], uint32_t(&dsa_prev)[BQ / 16][4]) {
            const int stage = it % S, prev_stage = (it - 1) % S;
            float s[BQ / 2], dp[BQ / 2];
            mbarrier_wait(full0 + 8 * stage, (it / S) & 1);
            pin_registers(pa_prev);
            pin_registers(dsa_prev);
            named_barrier_sync<WGMMA_CONSUMERS>(TURN_BARRIER + wg);
            wgmma_fence();
            scores(stage, s, dp);
            grads(prev_stage, pa_prev, dsa_prev);
            named_barrier_arrive<WGMMA_CONSUMERS>(TURN_BARRIER + 1 - wg);
            probs(it, q0, s, dp, pa_cur, dsa_cur, true);
            finish_grads(prev_stage, pa_prev, dsa_prev);
        };
        // The last turn: the last item's dV, dK.
        auto last = [&](int it, uint32_t(&pa_prev)[BQ / 16][4], uint32_t(&dsa_prev)[BQ / 16][4]) {
            const int prev_stage = (it - 1) % S;
            pin_registers(pa_prev);
            pin_registers(dsa_prev);
            named_barrier_sync<WGMMA_CONSUMERS>(TURN_BARRIER + wg);
            wgmma_fence();
            grads(prev_stage, pa_prev, dsa_prev);
            named_barrier_arrive<WGMMA_CONSUMERS>(TURN_BARRIER + 1 - wg);
            finish_grads(prev_stage, pa_prev, dsa_prev);
        };
        int it = 1, q0 = k0 + BQ == q_end ? k0 : k0 + BQ;
        auto advance = [&] { it++, q0 = q0 + BQ == q_end ? k0 : q0 + BQ; };
        while (it + 1 < n_items) {
            step(it, q0, pa1, dsa1, pa0, dsa0);
            advance();
            step(it, q0, pa0, dsa0, pa1, dsa1);
            advance();
        }
        if (it < n_items) {
            step(it, q0, pa1, dsa1, pa0, dsa0);
            advance();
            last(it, pa1, dsa1);
        } else {
            last(it, pa0, dsa0);
        }
        if (wg == 0) named_barrier_sync<WGMMA_CONSUMERS>(TURN_BARRIER);  // consumer 1's last arrival
    } else {
        // K's first K_SLICES k16 slices stay in registers as S^T's A (all 8 would spill). dV and dK are issued
        // together once dS^T is ready, which leaves their two register sets and S^T, dP^T no longer live at once.
        constexpr int K_SLICES = 5;
        uint32_t ka[K_SLICES][4];
        wgmma_load_a_frags<HD, ROWS, K_SLICES>(ka, smem_ptr, wg);
        uint32_t pa[BQ / 16][4], dsa[BQ / 16][4];  // P^T, dS^T as bf16 A registers, read by dV's and dK's wgmmas
        for (int it = 0, q0 = k0; it < n_items; it++, q0 = q0 + BQ == q_end ? k0 : q0 + BQ) {
            const int stage = it % S;
            // Waited for even when skipped: a warpgroup's release of round r then never precedes the other's of
            // r - 1.
            mbarrier_wait(full0 + 8 * stage, (it / S) & 1);
            if (q0 + BQ - 1 < kwg) {  // warpgroup-uniform: every query of the tile precedes every key
                mbarrier_arrive(empty0 + 8 * stage);
                continue;
            }
            const uint32_t st_bytes = stage * QBYTES;
            const float* lse_t = lse_s + stage * BQ;
            const float* D_t = D_s + stage * BQ;

            // S^T = K Q^T and dP^T = V dO^T, one commit group each.
            float s[BQ / 2], dp[BQ / 2];
            wgmma_fence();
            wgmma_scores_rs_ss<HD, ROWS, BQ, K_SLICES>(s, ka, k_desc, wgmma_desc_advance(q_desc, st_bytes));
            wgmma_scores_ss<HD, ROWS, BQ>(dp, v_desc, wgmma_desc_advance(do_desc, st_bytes));

            // P^T. Element i: key key0 + 8 ((i / 2) % 2), query q0 + 8 (i / 4) + c + i % 2.
            wgmma_wait_group<1>();  // S^T done
            pin_registers(s);
            attention_backward_probs_t<BQ>(s, lse_t, 1.0f, scale_log2, q0, kwg, key0, c, T);
            // dS^T, then dV += P^T dO and dK += dS^T Q in one group.
            wgmma_wait_group<0>();
            pin_registers(dp);
            ds_t(s, dp, D_t);
            wgmma_acc_to_a<BQ>(pa, s);
            wgmma_acc_to_a<BQ>(dsa, dp);
            pin_registers(pa);
            pin_registers(dsa);
            pin_registers(dv);
            pin_registers(dk);
            wgmma_fence();
            grads(stage, pa, dsa);
            finish_grads(stage, pa, dsa);  // dV and dK done: the stage is free
        }
    }

    // Each warpgroup read only its own 64 rows of K and V: after its last wait they stage its results.
    const size_t stride = (size_t)(H + 2 * KV) * HD;
    __nv_bfloat16* dqkv_b = dqkv + (size_t)b * T * stride;
    wgmma_store_rows<HD, ROWS>(dqkv_b + (size_t)(H + kvh) * HD, stride, smem_ptr, dk, scale, kwg, T, wg, rope);
    wgmma_store_rows<HD, ROWS>(dqkv_b + (size_t)(H + KV + kvh) * HD, stride, smem_ptr + KBYTES, dv, 1.0f, kwg, T, wg);
#else
    __trap();  // not sm_90a code: never launched (attention_wgmma_usable)
#endif
}

// Shared memory of the dQ kernel with q_buffers (Q, dO) pairs: two where they fit (a later item's Q and dO load
// while the last one's epilogue stages its result through its own), else one.
template <int HD, int Q_BUFFERS>
__host__ __device__ constexpr size_t attention_backward_dq_wgmma_smem_bytes_with() {
    constexpr int BN = wgmma_dq_keys(HD);
    return sizeof(__nv_bfloat16) * HD * (2 * Q_BUFFERS * WGMMA_ROWS + 2 * WGMMA_DQ_STAGES * BN) +
           8 * (2 * Q_BUFFERS + 2 * WGMMA_DQ_STAGES) + 1024;
}
template <int HD>
__host__ __device__ constexpr int attention_backward_dq_wgmma_q_buffers() {
    return attention_backward_dq_wgmma_smem_bytes_with<HD, 2>() <= 227 * 1024 ? 2 : 1;
}
template <int HD>
__host__ __device__ constexpr size_t attention_backward_dq_wgmma_smem_bytes() {
    return attention_backward_dq_wgmma_smem_bytes_with<HD, attention_backward_dq_wgmma_q_buffers<HD>()>();
}

// dQ for work items (b, h, tile of 128 queries), in the forward's order (attention_forward_item). grid: at most
// B * H * ceil(T / 128) CTAs (persistent: the SMs), block 384; a CTA takes the items persistent_item gives it. q_map:
// qkv with 128-row boxes; do_map: dout with 128-row boxes; kv_map: qkv with BN-row boxes.
template <int HD>
__global__ void __launch_bounds__(WGMMA_WS_THREADS, 1)
    attention_backward_dq_wgmma_kernel(const __grid_constant__ CUtensorMap q_map,
                                       const __grid_constant__ CUtensorMap do_map,
                                       const __grid_constant__ CUtensorMap kv_map, __nv_bfloat16* dqkv,
                                       const float* lse, const float* delta, const float* rope, int B, int T, int H,
                                       int KV, float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = WGMMA_ROWS, S = WGMMA_DQ_STAGES, BN = wgmma_dq_keys(HD);
    constexpr bool AREG = wgmma_dq_q_in_registers(HD);
    constexpr int QBYTES = ROWS * HD * 2, TBYTES = BN * HD * 2;
    constexpr int QBUF = attention_backward_dq_wgmma_q_buffers<HD>();
    constexpr bool PERSISTENT = QBUF == 2;  // else one item per CTA
    static_assert(ROWS % BN == 0, "key tiles must tile the query tile");
    static_assert(attention_backward_dq_wgmma_smem_bytes<HD>() <= 227 * 1024, "stages do not fit in shared memory");
    extern __shared__ uint8_t wgmma_smem[];
    const uint32_t smem = (smem_addr(wgmma_smem) + 1023u) & ~1023u;
    const uint32_t q_sm = smem;                        // QBUF x [Q (128 x HD), swizzled | dO (128 x HD)]
    const uint32_t k_sm = q_sm + QBUF * 2 * QBYTES;    // S stages x K (BN x HD)
    const uint32_t v_sm = k_sm + S * TBYTES;           // S stages x V (BN x HD)
    const uint32_t q_full0 = v_sm + S * TBYTES;        // mbarriers: q_full[QBUF], q_empty[QBUF], full[S], empty[S]
    const uint32_t q_empty0 = q_full0 + 8 * QBUF;
    const uint32_t full0 = q_empty0 + 8 * QBUF, empty0 = full0 + 8 * S;
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));
    const int q_tiles = ceil_div(T, ROWS), BH = B * H, n_items = BH * q_tiles;

    wgmma_init_item_barriers(q_full0, q_empty0, QBUF, full0, empty0, S);

    if (threadIdx.x < 128) {  // producer warpgroup
        setmaxnreg_dec<WGMMA_PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            int it = 0;  // K / V tiles loaded so far: tile `it` goes to stage it % S in round it / S
            for (int i = 0, item = persistent_item(0); item < n_items; item = persistent_item(++i)) {
                int b, h, q0;
                attention_forward_item(item, H, BH, q_tiles, b, h, q0);
                const int kvh = h / (H / KV), n_tiles = ceil_div(min(q0 + ROWS, T), BN);
                const int buf = i % QBUF, use = i / QBUF;
                const uint32_t qb = q_sm + buf * 2 * QBYTES, q_full = q_full0 + 8 * buf;
                if (use > 0) mbarrier_wait(q_empty0 + 8 * buf, (use - 1) & 1);  // its last item's epilogue is done
                mbarrier_arrive_expect_tx(q_full, 2 * QBYTES);
                for (int cb = 0; cb < HD / 64; cb++) {
                    tma_load_4d(qb + cb * (ROWS * 128), &q_map, q_full, 64 * cb, h, q0, b);
                    tma_load_4d(qb + QBYTES + cb * (ROWS * 128), &do_map, q_full, 64 * cb, h, q0, b);
                }
                for (int j = 0; j < n_tiles; j++, it++) {
                    const int s = it % S, round = it / S;
                    if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);
                    mbarrier_arrive_expect_tx(full0 + 8 * s, 2 * TBYTES);
                    for (int cb = 0; cb < HD / 64; cb++) {
                        tma_load_4d(k_sm + s * TBYTES + cb * (BN * 128), &kv_map, full0 + 8 * s, 64 * cb, H + kvh,
                                    j * BN, b);
                        tma_load_4d(v_sm + s * TBYTES + cb * (BN * 128), &kv_map, full0 + 8 * s, 64 * cb,
                                    H + KV + kvh, j * BN, b);
                    }
                }
                if constexpr (!PERSISTENT) break;
            }
        }
        return;
    }

    // Consumers.
    setmaxnreg_inc<WGMMA_CONSUMER_REGS>();
    // Through a shuffle as in the dK/dV kernel: 2-4% faster at hd 128 than threadIdx.x / 128 - 1 (H100).
    const int wg = __shfl_sync(0xffffffff, (int)threadIdx.x / 128 - 1, 0);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    // K / V tile j of an item: stage and phase of the ring, counted rather than divided, carried across items
    int stage = 0, phase = 0;
    for (int i = 0, item = persistent_item(0); item < n_items; item = persistent_item(++i)) {
        int b, h, q0;
        attention_forward_item(item, H, BH, q_tiles, b, h, q0);
        const int n_tiles = ceil_div(min(q0 + ROWS, T), BN);  // causal: keys up to the item's last query
        const int buf = i % QBUF;
        const uint32_t qb = q_sm + buf * 2 * QBYTES;
        uint8_t* qb_ptr = smem_ptr + buf * 2 * QBYTES;
        const int qwg = q0 + 64 * wg;
        const int row0 = qwg + 16 * warp + g;  // this thread's queries: row0 and row0 + 8

        float lse2[2], D[2];  // rows row0, row0 + 8; finite placeholders past T (never stored)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int q = row0 + 8 * r;
            lse2[r] = q < T ? lse[((size_t)b * H + h) * T + q] * ATTN_LOG2E : 0.0f;
            D[r] = q < T ? delta[((size_t)b * H + h) * T + q] : 0.0f;
        }
        float dq[HD / 2];
#pragma unroll
        for (int r = 0; r < HD / 2; r++) dq[r] = 0.0f;
        uint32_t qa[AREG ? HD / 16 : 1][4], doa[AREG ? HD / 16 : 1][4];  // Q, dO rows as A fragments (AREG)
        // Descriptors: the warpgroup's rows of Q and dO (A of S, dP without AREG), stage 0 of K and V read K-major
        // (B of S, dP) and of K read MN-major (B of dQ).
        const uint64_t q_desc = wgmma_desc_kmajor(qb + 64 * wg * 128);
        const uint64_t do_desc = wgmma_desc_kmajor(qb + QBYTES + 64 * wg * 128);
        const uint64_t k_desc = wgmma_desc_kmajor(k_sm), v_desc = wgmma_desc_kmajor(v_sm);
        const uint64_t k_desc_t = wgmma_desc_mnmajor(k_sm, BN);
        mbarrier_wait(q_full0 + 8 * buf, (i / QBUF) & 1);
        if constexpr (AREG) {
            wgmma_load_a_frags<HD, ROWS>(qa, qb_ptr, wg);
            wgmma_load_a_frags<HD, ROWS>(doa, qb_ptr + QBYTES, wg);
        }

        for (int j = 0; j < n_tiles; j++, stage == S - 1 ? (stage = 0, phase ^= 1) : stage++) {
            const int k0 = j * BN;
            mbarrier_wait(full0 + 8 * stage, phase);  // also when skipped (see the dK/dV kernel)
            if (k0 > qwg + 63) {  // warpgroup-uniform: every key of the tile follows every query
                mbarrier_arrive(empty0 + 8 * stage);
                continue;
            }
            const uint32_t st_bytes = stage * TBYTES;

            // S = Q K^T and dP = dO V^T, one commit group each.
            float s[BN / 2], dp[BN / 2];
            wgmma_fence();
            if constexpr (AREG) {
                wgmma_scores_rs<HD, BN>(s, qa, wgmma_desc_advance(k_desc, st_bytes));
                wgmma_scores_rs<HD, BN>(dp, doa, wgmma_desc_advance(v_desc, st_bytes));
            } else {
                wgmma_scores_ss<HD, ROWS, BN>(s, q_desc, wgmma_desc_advance(k_desc, st_bytes));
                wgmma_scores_ss<HD, ROWS, BN>(dp, do_desc, wgmma_desc_advance(v_desc, st_bytes));
            }

            // P (the mask only on the diagonal tiles)
            wgmma_wait_group<1>();
            pin_registers(s);
            if (k0 + BN - 1 > qwg) {  // warpgroup-uniform
                attention_backward_probs<BN, true>(s, lse2, scale_log2, k0, row0, c);
            } else {
                attention_backward_probs<BN, false>(s, lse2, scale_log2, k0, row0, c);
            }
            // dS, then dQ += dS K: B = the K tile, MN-major; its k16 slice kk (keys 16 kk ..) starts at row 16 kk.
            wgmma_wait_group<0>();
            pin_registers(dp);
#pragma unroll
            for (int r = 0; r < BN / 2; r++) dp[r] = s[r] * (dp[r] - D[(r / 2) % 2]);
            uint32_t dsa[BN / 16][4];
            wgmma_accumulate_rs<HD, BN>(dq, dsa, dp, wgmma_desc_advance(k_desc_t, st_bytes));
            wgmma_wait_group<0>();
            pin_registers(dsa);
            pin_registers(dq);
            mbarrier_arrive(empty0 + 8 * stage);
        }

        // Each warpgroup read only its own 64 rows of Q: after its last wait they stage its result; then the
        // buffer is released for a later item's Q and dO (after these generic accesses, for the TMA).
        const size_t stride = (size_t)(H + 2 * KV) * HD;
        wgmma_store_rows<HD, ROWS>(dqkv + (size_t)b * T * stride + (size_t)h * HD, stride, qb_ptr, dq, scale, qwg, T,
                                   wg, rope);
        if constexpr (!PERSISTENT) break;
        fence_proxy_async_shared();
        mbarrier_arrive(q_empty0 + 8 * buf);
    }
#else
    __trap();  // not sm_90a code: never launched (attention_wgmma_usable)
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// Host side

// True when the kernels of this file can run on the current device (sm90a_kernel_runs); one kernel's image stands
// for all of them: they are compiled together.
inline bool attention_wgmma_usable() {
    static PerDeviceFlag cache;
    return sm90a_kernel_runs(attention_backward_dq_wgmma_kernel<64>, cache);
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

// The SMs of the current device: a persistent kernel's grid (one CTA fills an SM, its shared memory).
inline int wgmma_sm_count() {
    static int sms = 0;  // the device does not change within a process
    if (sms == 0) {
        int device = 0;
        cudaCheck(cudaGetDevice(&device));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    }
    return sms;
}

// setmaxnreg.inc waits for registers that setmaxnreg.dec returned to the CTA's allocation: a CTA launched with fewer
// than the producer / consumer split needs would hang, so refuse to launch it (checked once per kernel).
template <typename Kernel>
inline void wgmma_check_register_split(Kernel kernel, const char* name, bool& checked) {
    if (checked) return;
    cudaFuncAttributes attr;
    cudaCheck(cudaFuncGetAttributes(&attr, kernel));
    if (attr.numRegs * WGMMA_WS_THREADS < WGMMA_REGS_NEEDED) {
        fprintf(stderr, "%s: kernel compiled to %d registers per thread, the producer / consumer split needs %d\n",
                name, attr.numRegs, WGMMA_REGS_NEEDED / WGMMA_WS_THREADS);
        fail_exit();
    }
    checked = true;
}

// Persistent (one CTA per SM taking work items in turn: attention_forward_wgmma_persistent) unless one_item_per_cta;
// else one CTA per work item.
template <int HD, int STAGES, bool OVERLAP>
inline void attention_forward_wgmma_launch(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV,
                                           cudaStream_t stream, bool one_item_per_cta = false) {
    static bool smem_set = false, regs_checked = false;
    const size_t smem = attention_forward_wgmma_smem_bytes<HD, STAGES>();
    attention_set_smem(attention_forward_wgmma_kernel<HD, STAGES, OVERLAP>, smem, smem_set);
    wgmma_check_register_split(attention_forward_wgmma_kernel<HD, STAGES, OVERLAP>, "attention_forward_wgmma",
                               regs_checked);
    const CUtensorMap map = attention_heads_tensor_map(qkv, B, T, H + 2 * KV, HD, WGMMA_ROWS);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)HD);
    const int items = B * H * ceil_div(T, WGMMA_ROWS);
    const bool persistent = attention_forward_wgmma_persistent<HD, STAGES, OVERLAP>() && !one_item_per_cta;
    const int grid = persistent ? std::min(items, wgmma_sm_count()) : items;
    attention_forward_wgmma_kernel<HD, STAGES, OVERLAP>
        <<<grid, WGMMA_WS_THREADS, smem, stream>>>(map, out, lse, B, T, H, KV, scale_log2);
    cudaCheckLaunch();
}

// The wgmma forward (head_dim 64 or 128; the caller checked attention_wgmma_usable). Same contract as
// attention_forward. Stages measured best on an H100 (dev/cuda/attention_forward.cu): 6 at hd 64, 3 at hd 128.
inline void attention_forward_wgmma(floatX* out, float* lse, const floatX* qkv, int B, int T, int n_heads,
                                    int n_kv_heads, int head_dim, cudaStream_t stream) {
    attention_check_args("attention_forward_wgmma", B, T, n_heads, n_kv_heads, head_dim);
    if (head_dim != 64 && head_dim != 128) {
        fprintf(stderr, "attention_forward_wgmma: head_dim %d unsupported (64 and 128 only)\n", head_dim);
        fail_exit();
    }
    if (!attention_aligned16({out, qkv})) {
        fprintf(stderr, "attention_forward_wgmma: tensors must be 16-byte aligned, got out %p qkv %p\n", (void*)out,
                (const void*)qkv);
        fail_exit();
    }
    if (head_dim == 64) {
        attention_forward_wgmma_launch<64, 6, true>(out, lse, qkv, B, T, n_heads, n_kv_heads, stream);
    } else {
        attention_forward_wgmma_launch<128, 3, true>(out, lse, qkv, B, T, n_heads, n_kv_heads, stream);
    }
}

// The wgmma backward at one head dim (D included).
// The dQ kernel is persistent where two (Q, dO) buffers fit.
template <int HD>
inline void attention_backward_wgmma_hd(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                        const floatX* out, const float* lse, const float* rope, int B, int T, int H,
                                        int KV, cudaStream_t stream) {
    static bool dkdv_smem_set = false, dq_smem_set = false, dkdv_regs_checked = false, dq_regs_checked = false;
    const size_t dkdv_smem = attention_backward_dkdv_wgmma_smem_bytes<HD>();
    const size_t dq_smem = attention_backward_dq_wgmma_smem_bytes<HD>();
    attention_set_smem(attention_backward_dkdv_wgmma_kernel<HD>, dkdv_smem, dkdv_smem_set);
    attention_set_smem(attention_backward_dq_wgmma_kernel<HD>, dq_smem, dq_smem_set);
    wgmma_check_register_split(attention_backward_dkdv_wgmma_kernel<HD>, "attention_backward_wgmma (dK/dV)",
                               dkdv_regs_checked);
    wgmma_check_register_split(attention_backward_dq_wgmma_kernel<HD>, "attention_backward_wgmma (dQ)",
                               dq_regs_checked);
    attention_delta(delta, dout, out, B, T, H, HD, stream);
    const int heads = H + 2 * KV;
    const CUtensorMap qkv_128 = attention_heads_tensor_map(qkv, B, T, heads, HD, WGMMA_ROWS);
    const CUtensorMap qkv_64 = attention_heads_tensor_map(qkv, B, T, heads, HD, 64);
    const CUtensorMap dout_128 = attention_heads_tensor_map(dout, B, T, H, HD, WGMMA_ROWS);
    const CUtensorMap dout_64 = attention_heads_tensor_map(dout, B, T, H, HD, WGMMA_DKDV_QUERIES);
    static_assert(WGMMA_DKDV_QUERIES == 64, "the dK/dV kernel's Q boxes are the 64-row map");
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    dim3 dkdv_grid(B * KV, ceil_div(T, WGMMA_ROWS));
    attention_backward_dkdv_wgmma_kernel<HD><<<dkdv_grid, WGMMA_WS_THREADS, dkdv_smem, stream>>>(
        qkv_128, qkv_64, dout_64, dqkv, lse, delta, rope, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
    const int dq_items = B * H * ceil_div(T, WGMMA_ROWS);
    const bool dq_persistent = attention_backward_dq_wgmma_q_buffers<HD>() == 2;
    const CUtensorMap& kv_tiles = wgmma_dq_keys(HD) == WGMMA_ROWS ? qkv_128 : qkv_64;
    const int dq_grid = dq_persistent ? std::min(dq_items, wgmma_sm_count()) : dq_items;
    attention_backward_dq_wgmma_kernel<HD><<<dq_grid, WGMMA_WS_THREADS, dq_smem, stream>>>(
        qkv_128, dout_128, kv_tiles, dqkv, lse, delta, rope, B, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
}

// The wgmma backward (head_dim 64 or 128; the caller checked attention_wgmma_usable). Same contract as
// attention_backward, RoPE's backward included when rope is given.
inline void attention_backward_wgmma(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                                     const floatX* out, const float* lse, const float* rope, int B, int T,
                                     int n_heads, int n_kv_heads, int head_dim, cudaStream_t stream) {
    attention_check_args("attention_backward_wgmma", B, T, n_heads, n_kv_heads, head_dim);
    if (head_dim != 64 && head_dim != 128) {
        fprintf(stderr, "attention_backward_wgmma: head_dim %d unsupported (64 or 128)\n", head_dim);
        fail_exit();
    }
    if (!attention_aligned16({dqkv, dout, qkv})) {
        fprintf(stderr, "attention_backward_wgmma: tensors must be 16-byte aligned, got dqkv %p dout %p qkv %p\n",
                (void*)dqkv, (const void*)dout, (const void*)qkv);
        fail_exit();
    }
    if (head_dim == 64) {
        attention_backward_wgmma_hd<64>(dqkv, delta_scratch, dout, qkv, out, lse, rope, B, T, n_heads, n_kv_heads,
                                        stream);
    } else {
        attention_backward_wgmma_hd<128>(dqkv, delta_scratch, dout, qkv, out, lse, rope, B, T, n_heads, n_kv_heads,
                                         stream);
    }
}

#endif  // !ENABLE_FP32
