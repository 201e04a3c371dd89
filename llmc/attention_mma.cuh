// Causal GQA attention forward on tensor cores with mma.sync (FlashAttention-2 style, bf16 with fp32 accumulation),
// head_dim 64, bf16 builds. The trainer's forward at head_dim 64 on GPUs from sm_80 on other than Hopper (on Hopper
// the warp-specialised wgmma forward of attention_wgmma_forward.cuh is 1.27x faster: dev/cuda/attention_forward.cu,
// v3 / v5).
// Same contract as attention_forward in attention.cuh: qkv (B, T, (H + 2 KV) 64) -> out (B, T, H 64), lse (B, H, T)
// fp32 = log-sum-exp of each row of scaled scores. Instruction and fragment conventions: llmc/ptx.cuh.
//
// Fragment reuse: a lane owns rows g and g+8 of its warp's 16-row slice of every accumulator, so row statistics (the
// online softmax max and sum) need only a reduction over the 4 lanes of a quad (shfl xor 1, 2). The accumulators of
// two adjacent n8 tiles 2kk, 2kk+1 (columns 16kk .. 16kk+15) are exactly an A fragment with k = those 16 columns:
// {pack(d0,d1) of 2kk, pack(d2,d3) of 2kk, pack(d0,d1) of 2kk+1, pack(d2,d3) of 2kk+1}. So P, computed in accumulator
// registers, feeds P V as its A operand without a trip through shared memory (mma_acc_to_a).
// B operands: K stored row-major as K[key][d] is a "col" B of S = Q K^T as it stands (plain ldmatrix); V stored as
// V[key][d] is the B of O = P V with k = key, so it needs ldmatrix.trans. Per-lane ldmatrix addresses, relative to
// the 16 x 16 block loaded (r = lane % 8):
//   A fragment:          row = lane % 16,               col = 8 (lane / 16)        -> a0, a1, a2, a3
//   B, two n8 tiles:     row = r + 8 (lane / 16),       col = 8 ((lane / 8) % 2)   -> b0, b1 (tile 0), b0, b1 (tile 1)
//   B .trans, two n8:    row = r + 8 ((lane / 8) % 2),  col = 8 (lane / 16)        -> b0, b1 (tile 0), b0, b1 (tile 1)
// (.trans case: the stored rows are k, the stored columns n.)
//
// Shared memory: bf16 tiles, row-major, rows padded from HD to HD + 8 elements. The row stride is then HD/8 + 1
// 16-byte chunks with HD/8 a multiple of 8, so the 8 row addresses of an ldmatrix matrix fall in 8 different 16-byte
// bank groups: conflict-free; cp.async 16-byte writes of consecutive chunks are conflict-free too, and every row start
// stays 16-byte aligned. Global rows are 16-byte aligned because HD is a multiple of 8 and the base pointers are
// (checked on the host). Tiles are loaded with cp.async.cg (16 bytes, via L2); rows >= T are zero-filled (src-size 0),
// so masked entries multiply zeros, never uninitialised memory that could hold NaN.
//
// CTA = 4 warps, 128 queries of one (head, batch); warp w owns queries q0 + 32 w .. + 31 (MT = 2 m16 tiles: each K /
// V fragment loaded with ldmatrix feeds 4 mmas instead of 2, halving the shared-memory traffic per mma, which is
// what limits mma.sync kernels with 16-row warps). Its Q fragments stay in registers. K and V tiles of 64 keys stream
// through a 2-stage cp.async pipeline (tile j+1 loads while tile j is computed), only up to the causal diagonal. Per
// tile and warp: S = Q K^T (32 x 64); the causal mask only on the diagonal tile; online softmax in the log2 domain
// (scores times scale log2 e folded into one fma before exp2f); P packed to bf16 A fragments; O (32 x 64 fp32) =
// alpha O + P V. Epilogue: O / l staged through the warp's own (dead) rows of the Q tile for 16-byte stores;
// lse = (m + log2 l) ln 2. smem: Q 128 x 72 + 2 stages x (K, V) 64 x 72, bf16 (54 KiB); 251 registers, 2 CTAs per SM.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "cuda_common.h"
#include "ptx.cuh"

#if !defined(ENABLE_FP32)

constexpr int MMA_WARPS = 4;
constexpr int MMA_THREADS = 32 * MMA_WARPS;
constexpr int MMA_FWD_HD = 64;                            // the head dim of this kernel
constexpr int MMA_FWD_MT = 2;                             // m16 query tiles per warp
constexpr int MMA_FWD_ROWS = 16 * MMA_FWD_MT * MMA_WARPS;  // queries per CTA
constexpr int MMA_FWD_KEYS = 64;                          // keys per K / V tile

// ----------------------------------------------------------------------------------------------------------------
// Fragment and tile helpers

__device__ __forceinline__ void mma_acc_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_bf16x2(lo[0], lo[1]);
    a[1] = pack_bf16x2(lo[2], lo[3]);
    a[2] = pack_bf16x2(hi[0], hi[1]);
    a[3] = pack_bf16x2(hi[2], hi[3]);
}

// Per-lane ldmatrix addresses (byte offsets into a row-major tile with leading dimension LD elements) of the 16 x 16
// block at (row0, col0), for the patterns in the file comment.
template <int LD>
__device__ __forceinline__ uint32_t ldmatrix_off_a(int row0, int col0, int lane) {
    return 2u * ((row0 + lane % 16) * LD + col0 + 8 * (lane / 16));
}
template <int LD>
__device__ __forceinline__ uint32_t ldmatrix_off_b(int row0, int col0, int lane) {
    return 2u * ((row0 + lane % 8 + 8 * (lane / 16)) * LD + col0 + 8 * ((lane / 8) % 2));
}


template <int LD>
__device__ __forceinline__ uint32_t ldmatrix_off_bt(int row0, int col0, int lane) {
    return 2u * ((row0 + lane % 8 + 8 * ((lane / 8) % 2)) * LD + col0 + 8 * (lane / 16));
}

// out (MT 16-row blocks x HD) += acc (the same rows x N, fp32 accumulators, packed to bf16 A fragments) times a B
// tile of N rows x HD stored row-major with leading dimension LD at b (read with ldmatrix.trans): O += P V in the
//. Each B fragment feeds MT mmas.
template <int HD, int MT, int N, int LD>
__device__ __forceinline__ void mma_acc_times_bt(float (&out)[MT][HD / 8][4], const float (&acc)[MT][N / 8][4],
                                                 uint32_t b, int lane) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) mma_acc_to_a(a[mt], acc[mt][2 * kk], acc[mt][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < HD / 16; dp++) {
            uint32_t fb[4];
            ldmatrix_x4_trans(fb, b + ldmatrix_off_bt<LD>(16 * kk, 16 * dp, lane));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_m16n8k16_bf16(out[mt][2 * dp], a[mt], fb[0], fb[1]);
                mma_m16n8k16_bf16(out[mt][2 * dp + 1], a[mt], fb[2], fb[3]);
            }
        }
    }
}

// Issues cp.async loads of rows [r0, r0 + ROWS) of one head into a (ROWS, HD + 8) smem tile;
// src points at row 0, column 0 of the head, rows `row_stride` elements apart. Rows >= T are zero-filled (the source
// address is clamped to row 0, which always exists, though nothing is read). The caller commits the group.
template <int HD, int ROWS>
__device__ __forceinline__ void mma_load_tile(__nv_bfloat16* dst, const __nv_bfloat16* src, size_t row_stride, int r0,
                                              int T) {
    constexpr int CHUNKS = HD / 8, LD = HD + 8;  // 16-byte chunks per row
    static_assert((ROWS * CHUNKS) % MMA_THREADS == 0, "tile must split evenly over the CTA");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / MMA_THREADS; i++) {
        const int idx = i * MMA_THREADS + threadIdx.x;
        const int r = idx / CHUNKS, c = idx % CHUNKS;  // consecutive threads: consecutive chunks of a row
        const bool valid = r0 + r < T;
        const __nv_bfloat16* g = src + (size_t)(valid ? r0 + r : 0) * row_stride + 8 * c;
        cp_async_16(smem_addr(dst + r * LD + 8 * c), g, valid ? 16 : 0);
    }
}

// Stores a warp's 16 x HD fp32 accumulator (times mult) as bf16: first into the warp's own 16 rows of a smem tile
// (which no other warp reads), then 16-byte chunks to global rows r0 .. r0+15 (dst: row 0, column 0 of the head),
// skipping rows >= T.
template <int HD>
__device__ __forceinline__ void mma_store_warp_rows(__nv_bfloat16* dst, size_t row_stride, __nv_bfloat16* stage,
                                                    const float (&acc)[HD / 8][4], float mult0, float mult1, int r0,
                                                    int T, int lane) {
    constexpr int LD = HD + 8, CHUNKS = HD / 8;
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < HD / 8; nt++) {
        *reinterpret_cast<uint32_t*>(stage + g * LD + 8 * nt + c) =
            pack_bf16x2(acc[nt][0] * mult0, acc[nt][1] * mult0);
        *reinterpret_cast<uint32_t*>(stage + (g + 8) * LD + 8 * nt + c) =
            pack_bf16x2(acc[nt][2] * mult1, acc[nt][3] * mult1);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16 * CHUNKS / 32; i++) {
        const int idx = i * 32 + lane, r = idx / CHUNKS, ch = idx % CHUNKS;
        if (r0 + r < T) {
            *reinterpret_cast<int4*>(dst + (size_t)(r0 + r) * row_stride + 8 * ch) =
                *reinterpret_cast<const int4*>(stage + r * LD + 8 * ch);
        }
    }
}

// ----------------------------------------------------------------------------------------------------------------
// Kernel

constexpr size_t attention_forward_mma_smem_bytes() {
    return sizeof(__nv_bfloat16) * (MMA_FWD_HD + 8) * (MMA_FWD_ROWS + 4 * MMA_FWD_KEYS);
}

// grid (B * H, ceil(T / 128)), block 128.
__global__ void __launch_bounds__(MMA_THREADS, 2)
    attention_forward_mma_kernel(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int T, int H, int KV,
                                 float scale_log2) {
    constexpr int HD = MMA_FWD_HD, MT = MMA_FWD_MT, BN = MMA_FWD_KEYS;
    constexpr int LD = HD + 8, ROWS = MMA_FWD_ROWS, WR = 16 * MT;  // WR: rows per warp
    extern __shared__ int4 mma_smem_fwd[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(mma_smem_fwd);  // (ROWS, LD)
    __nv_bfloat16* Ks = Qs + ROWS * LD;                                   // 2 stages x (BN, LD)
    __nv_bfloat16* Vs = Ks + 2 * BN * LD;                                 // 2 stages x (BN, LD)

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;  // the longest (last) query tiles are scheduled first
    const int qw = q0 + WR * warp;                        // the warp's first query
    const size_t stride = (size_t)(H + 2 * KV) * HD;
    const __nv_bfloat16* q_src = qkv + (size_t)b * T * stride + (size_t)h * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    // Causal: keys up to the tile's last query. n_tiles >= 1 since q0 < T.
    const int n_tiles = ceil_div(min(q0 + ROWS, T), BN);
    mma_load_tile<HD, ROWS>(Qs, q_src, stride, q0, T);
    mma_load_tile<HD, BN>(Ks, k_src, stride, 0, T);
    mma_load_tile<HD, BN>(Vs, v_src, stride, 0, T);
    cp_async_commit();

    uint32_t qf[MT][HD / 16][4];  // the warp's Q block as A fragments (MT HD / 4 registers)
    float o[MT][HD / 8][4];  // O accumulator: m tile mt, n8 tile nt holds columns 8 nt .. 8 nt + 7
    float m[MT][2], l[MT][2];  // running max of rows g, g+8 (log2 domain, scaled); this lane's part of the row sums
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;
    }
    const uint32_t q_base = smem_addr(Qs);

    for (int j = 0; j < n_tiles; j++) {
        const int stage = j % 2;
        if (j + 1 < n_tiles) {  // prefetch tile j+1 into the other stage (freed by the __syncthreads ending j-1)
            mma_load_tile<HD, BN>(Ks + (1 - stage) * BN * LD, k_src, stride, (j + 1) * BN, T);
            mma_load_tile<HD, BN>(Vs + (1 - stage) * BN * LD, v_src, stride, (j + 1) * BN, T);
            cp_async_commit();
            cp_async_wait<1>();  // tile j (and Q) landed; tile j+1 may still be in flight
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // everyone's copies of tile j visible

        if (j == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int kk = 0; kk < HD / 16; kk++) {
                    ldmatrix_x4(qf[mt][kk], q_base + ldmatrix_off_a<LD>(WR * warp + 16 * mt, 16 * kk, lane));
                }
            }
        }
        const int k0 = j * BN;
        if (k0 <= qw + WR - 1) {  // warp-uniform: the tile has keys visible to some query of this warp
            const uint32_t k_base = smem_addr(Ks + stage * BN * LD), v_base = smem_addr(Vs + stage * BN * LD);
            float s[MT][BN / 8][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int nt = 0; nt < BN / 8; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
            }
            // S = Q K^T. Each K fragment (one ldmatrix) feeds 2 MT mmas: MT = 2 halves the smem traffic per mma.
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                uint32_t qa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) qa[mt][i] = qf[mt][kk][i];
                }
#pragma unroll
                for (int np = 0; np < BN / 16; np++) {
                    uint32_t kb[4];
                    ldmatrix_x4(kb, k_base + ldmatrix_off_b<LD>(16 * np, 16 * kk, lane));
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_m16n8k16_bf16(s[mt][2 * np], qa[mt], kb[0], kb[1]);
                        mma_m16n8k16_bf16(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
                    }
                }
            }
            if (k0 + BN - 1 > qw) {  // diagonal tile: some key is after some query of the warp
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int nt = 0; nt < BN / 8; nt++) {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int key = k0 + 8 * nt + c + (e % 2), q = qw + 16 * mt + g + 8 * (e / 2);
                            if (key > q) s[mt][nt][e] = -INFINITY;
                        }
                    }
                }
            }
            // Online softmax for rows g (r = 0: elements 0, 1) and g+8 (r = 1: elements 2, 3) of each m tile.
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < BN / 8; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));  // the 4 lanes of a quad share the row
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                    const float m_new = fmaxf(m[mt][r], mx * scale_log2);
                    // Every row sees key 0 in tile 0, so m_new is finite once tile 0 is done (a row whose keys in
                    // a later tile are all masked keeps its max); the guard keeps a fully masked row from computing
                    // (-inf) - (-inf) = NaN all the same.
                    const float base = m_new == -INFINITY ? 0.0f : m_new;
                    const float alpha = exp2f(m[mt][r] - base);  // rescales what was accumulated under the old max
                    m[mt][r] = m_new;
                    float sum = 0.0f;
#pragma unroll
                    for (int nt = 0; nt < BN / 8; nt++) {
#pragma unroll
                        for (int e = 2 * r; e < 2 * r + 2; e++) {
                            s[mt][nt][e] = exp2f(fmaf(s[mt][nt][e], scale_log2, -base));  // masked: exp2(-inf) = 0
                            sum += s[mt][nt][e];
                        }
                    }
                    l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
                    for (int nt = 0; nt < HD / 8; nt++) {
                        o[mt][nt][2 * r] *= alpha;
                        o[mt][nt][2 * r + 1] *= alpha;
                    }
                }
            }
            // O += P V: P from the S accumulators, the V tile as B.
            mma_acc_times_bt<HD, MT, BN, LD>(o, s, v_base, lane);
        }
        __syncthreads();  // all warps done with this stage before the next iteration's prefetch overwrites it
    }

    const size_t out_stride = (size_t)H * HD;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float inv_l[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            inv_l[r] = 1.0f / sum;
            const int q = qw + 16 * mt + g + 8 * r;
            if (lane % 4 == 0 && q < T) lse[(size_t)blockIdx.x * T + q] = (m[mt][r] + log2f(sum)) * ATTN_LN2;
        }
        // The warp's own Q rows (read by no other warp) are dead now: they stage the result.
        mma_store_warp_rows<HD>(out + (size_t)b * T * out_stride + (size_t)h * HD, out_stride,
                                Qs + (WR * warp + 16 * mt) * LD, o[mt], inv_l[0], inv_l[1], qw + 16 * mt, T, lane);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// Launcher

// The mma.sync forward: bf16, head_dim 64. Same contract as attention_forward.
inline void attention_forward_mma(floatX* out, float* lse, const floatX* qkv, int B, int T, int n_heads,
                                  int n_kv_heads, int head_dim, cudaStream_t stream) {
    attention_check_args("attention_forward_mma", B, T, n_heads, n_kv_heads, head_dim);
    if (head_dim != MMA_FWD_HD) {
        fprintf(stderr, "attention_forward_mma: head_dim %d unsupported (%d only)\n", head_dim, MMA_FWD_HD);
        fail_exit();
    }
    if (!attention_aligned16({out, qkv})) {
        fprintf(stderr, "attention_forward_mma: tensors must be 16-byte aligned, got out %p qkv %p\n", (void*)out,
                (const void*)qkv);
        fail_exit();
    }
    static bool smem_set = false;
    const size_t smem = attention_forward_mma_smem_bytes();
    attention_set_smem(attention_forward_mma_kernel, smem, smem_set);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)MMA_FWD_HD);
    dim3 grid(B * n_heads, ceil_div(T, MMA_FWD_ROWS));
    attention_forward_mma_kernel<<<grid, MMA_THREADS, smem, stream>>>(out, lse, qkv, T, n_heads, n_kv_heads,
                                                                      scale_log2);
    cudaCheckLaunch();
}

#endif  // !ENABLE_FP32
