// Causal GQA attention on CUDA cores (fp32 math, any floatX, head_dim 1..128): the path of the fp32 build, and of
// the bf16 build for head dims without a tensor-core kernel (llmc/attention.cuh says which path runs where).
// Same contract and math as attention_forward / attention_backward in attention.cuh: qkv (B, T, (H + 2 KV) hd) ->
// out (B, T, H hd), lse (B, H, T) fp32; backward: dqkv from dout, qkv, out, lse, deterministic.
//
// Forward: one block per (b, h, tile of 64 queries). Key/value tiles of 32 rows stream through shared memory; the
// softmax is online (running row max m and row sum l, rescaling the output accumulator when m grows). Exponentials are
// taken in base 2 on scores pre-multiplied by scale * log2(e), which is exact algebra and one multiply cheaper.
// Backward: two kernels, so that every output element has exactly one writer and a fixed summation order
// (deterministic, no atomics):
//   dq kernel:    one block per (b, h, tile of 64 queries), looping over key tiles of 32 (recomputing P and dS).
//   dk/dv kernel: one block per (b, kv head, tile of 64 keys), looping over the query heads of its group, and for each
//                 over query tiles of 32 from the diagonal on; the group sum happens in registers.
// D is computed first into delta_scratch (B, H, T) by attention_delta (attention_common.cuh).
//
// Inner loops are CUDA-core fp32 micro-GEMMs. A block is 256 threads seen as a 16 x 16 grid (ty, tx). For the block's
// 64 "fixed" rows (queries, or keys in dk/dv) and the 32 streamed rows,
// thread (ty, tx) owns score entries [4 ty + i][2 tx + j] (i < 4, j < 2), and accumulator entries
// [4 ty + i][4 tx + 64 c + e] (e < 4, c < HDP / 64) of a (64, HDP) output tile. Operands live in shared memory as fp32
// in "k-major" layout (the reduction index outermost), so each k step reads one float4 of A and one float2 / float4 of
// B per thread. Rows are padded by 4 floats (68, 36) to spread the transposing stores over more banks while keeping
// float4 alignment.
//
// Head dims: any hd in 1..128. The kernels are templated on a padded head dim HDP (64 or 128); tiles are zero-filled
// for d >= hd, which adds nothing to the dot products, and columns d >= hd are never stored.
// Ragged T: rows t >= T are zero-filled on load, masked (key j > query i, or i >= T), and never stored.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "cuda_common.h"

constexpr int ATTN_THREADS = 256;                    // 16 x 16 thread grid
constexpr int ATTN_FIXED = 64;                       // rows a block owns (queries; keys in the dk/dv kernel)
constexpr int ATTN_STREAM = 32;                      // rows streamed through shared memory per step
constexpr int ATTN_LD_FIXED = ATTN_FIXED + 4;        // padded leading dimension of k-major fixed-row tiles
constexpr int ATTN_LD_STREAM = ATTN_STREAM + 4;      // padded leading dimension of k-major streamed-row tiles

// ----------------------------------------------------------------------------------------------------------------
// Device helpers

// Loads rows [r0, r0 + ROWS) of one head (src points at row 0, column 0 of the head; consecutive tokens are
// `row_stride` elements apart) into shared memory as fp32, zero-filling rows >= T and columns >= hd. Writes the k-major
// copy kmajor[d * ld_k + r] and/or the row-major copy rowmajor[r * HDP + d] (either may be nullptr).
template <int HDP, int ROWS>
__device__ __forceinline__ void attn_load_tile(float* kmajor, int ld_k, float* rowmajor, const floatX* src,
                                               size_t row_stride, int r0, int T, int hd) {
    for (int idx = threadIdx.x; idx < ROWS * HDP; idx += ATTN_THREADS) {
        int r = idx / HDP, d = idx % HDP;  // consecutive threads read consecutive d: coalesced
        float v = 0.0f;
        if (r0 + r < T && d < hd) v = to_float(src[(size_t)(r0 + r) * row_stride + d]);
        if (kmajor != nullptr) kmajor[d * ld_k + r] = v;
        if (rowmajor != nullptr) rowmajor[r * HDP + d] = v;
    }
}

// Score tile: acc[i][j] += sum_{k < K} A[k][4 ty + i] * B[k][2 tx + j]   (A, B k-major with leading dims lda, ldb).
template <int K>
__device__ __forceinline__ void attn_score_tile(float (&acc)[4][2], const float* A, int lda, const float* B, int ldb,
                                                int ty, int tx) {
#pragma unroll 8
    for (int k = 0; k < K; k++) {
        float4 a = *reinterpret_cast<const float4*>(A + k * lda + 4 * ty);
        float2 b = *reinterpret_cast<const float2*>(B + k * ldb + 2 * tx);
        float av[4] = {a.x, a.y, a.z, a.w}, bv[2] = {b.x, b.y};
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int j = 0; j < 2; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
    }
}

// Accumulator tile: acc[i][4 c + e] += sum_{k < ATTN_STREAM} A[k][4 ty + i] * B[k][4 tx + 64 c + e]
// (A k-major with leading dim lda; B row-major (ATTN_STREAM, HDP)).
template <int HDP>
__device__ __forceinline__ void attn_accum_tile(float (&acc)[4][HDP / 16], const float* A, int lda, const float* B,
                                                int ty, int tx) {
#pragma unroll 4
    for (int k = 0; k < ATTN_STREAM; k++) {
        float4 a = *reinterpret_cast<const float4*>(A + k * lda + 4 * ty);
        float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int c = 0; c < HDP / 64; c++) {
            float4 b = *reinterpret_cast<const float4*>(B + k * HDP + 4 * tx + 64 * c);
            float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][4 * c + e] = fmaf(av[i], bv[e], acc[i][4 * c + e]);
            }
        }
    }
}

// Writes rows [r0, r0 + 64) of a (64, HDP) accumulator tile, times `mult`, to one head of a token-major tensor
// (dst points at row 0, column 0 of the head), skipping rows >= T and columns >= hd.
template <int HDP>
__device__ __forceinline__ void attn_store_tile(floatX* dst, size_t row_stride, const float (&acc)[4][HDP / 16],
                                                const float (&mult)[4], int r0, int T, int hd, int ty, int tx) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = r0 + 4 * ty + i;
        if (r >= T) continue;
#pragma unroll
        for (int c = 0; c < HDP / 64; c++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int d = 4 * tx + 64 * c + e;
                if (d < hd) dst[(size_t)r * row_stride + d] = from_float<floatX>(acc[i][4 * c + e] * mult[i]);
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------------------------
// Forward

template <int HDP>
constexpr size_t attention_forward_scalar_smem_bytes() {
    return sizeof(float) *
           (HDP * ATTN_LD_FIXED + HDP * ATTN_LD_STREAM + ATTN_STREAM * HDP + ATTN_STREAM * ATTN_LD_FIXED);
}

// grid (B * H, ceil(T / 64)), block 256.
template <int HDP>
__global__ void __launch_bounds__(ATTN_THREADS, 2)
    attention_forward_scalar_kernel(floatX* out, float* lse, const floatX* qkv, int T, int H, int KV, int hd,
                             float scale_log2) {
    extern __shared__ float4 attn_smem_fwd[];  // float4: 16-byte alignment for the vector reads
    float* Qt = reinterpret_cast<float*>(attn_smem_fwd);  // (HDP, 68)  queries, k-major
    float* Kt = Qt + HDP * ATTN_LD_FIXED;                  // (HDP, 36)  keys, k-major
    float* Vs = Kt + HDP * ATTN_LD_STREAM;                 // (32, HDP)  values, row-major
    float* Pt = Vs + ATTN_STREAM * HDP;                    // (32, 68)   probabilities, key-major

    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ATTN_FIXED;  // the longest (last) query tiles are scheduled first
    const size_t qkv_stride = (size_t)(H + 2 * KV) * hd;
    const floatX* q_src = qkv + (size_t)b * T * qkv_stride + (size_t)h * hd;
    const floatX* k_src = qkv + (size_t)b * T * qkv_stride + (size_t)(H + kvh) * hd;
    const floatX* v_src = qkv + (size_t)b * T * qkv_stride + (size_t)(H + KV + kvh) * hd;

    attn_load_tile<HDP, ATTN_FIXED>(Qt, ATTN_LD_FIXED, nullptr, q_src, qkv_stride, q0, T, hd);

    float m[4], l[4], o[4][HDP / 16];  // m: running row max (log2 domain); l: this thread's part of the row sum
#pragma unroll
    for (int i = 0; i < 4; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < HDP / 16; c++) o[i][c] = 0.0f;
    }

    const int k_end = min(q0 + ATTN_FIXED, T);  // causal: keys up to the tile's last query
    for (int k0 = 0; k0 < k_end; k0 += ATTN_STREAM) {
        attn_load_tile<HDP, ATTN_STREAM>(Kt, ATTN_LD_STREAM, nullptr, k_src, qkv_stride, k0, T, hd);
        attn_load_tile<HDP, ATTN_STREAM>(nullptr, 0, Vs, v_src, qkv_stride, k0, T, hd);
        __syncthreads();

        float s[4][2] = {};
        attn_score_tile<HDP>(s, Qt, ATTN_LD_FIXED, Kt, ATTN_LD_STREAM, ty, tx);

#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int q = q0 + 4 * ty + i;
            float row_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int key = k0 + 2 * tx + j;
                s[i][j] = key <= q ? s[i][j] * scale_log2 : -INFINITY;
                row_max = fmaxf(row_max, s[i][j]);
            }
            const float m_new = fmaxf(m[i], warp_reduce_max<16>(row_max));
            // Key 0 is in the first tile and never masked, so m_new is finite; the guard keeps a fully masked row
            // from computing (-inf) - (-inf) = NaN all the same.
            const float base = m_new == -INFINITY ? 0.0f : m_new;
            const float alpha = exp2f(m[i] - base);  // rescales what was accumulated under the old max
            m[i] = m_new;
            float p_sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const float p = exp2f(s[i][j] - base);
                p_sum += p;
                Pt[(2 * tx + j) * ATTN_LD_FIXED + 4 * ty + i] = p;
            }
            l[i] = l[i] * alpha + p_sum;
#pragma unroll
            for (int c = 0; c < HDP / 16; c++) o[i][c] *= alpha;
        }
        __syncthreads();  // Pt complete

        attn_accum_tile<HDP>(o, Pt, ATTN_LD_FIXED, Vs, ty, tx);
        __syncthreads();  // done reading Kt, Vs, Pt before the next tile overwrites them
    }

    float inv_l[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float row_sum = warp_reduce_sum<16>(l[i]);  // the 16 lanes of a row each summed their own columns
        inv_l[i] = 1.0f / row_sum;
        const int q = q0 + 4 * ty + i;
        if (tx == 0 && q < T) lse[(size_t)blockIdx.x * T + q] = (m[i] + log2f(row_sum)) * ATTN_LN2;
    }
    const size_t out_stride = (size_t)H * hd;
    attn_store_tile<HDP>(out + (size_t)b * T * out_stride + (size_t)h * hd, out_stride, o, inv_l, q0, T, hd, ty, tx);
}

// ----------------------------------------------------------------------------------------------------------------
// Backward (D = rowsum(dout * out) comes first, from attention_delta in attention_common.cuh)

template <int HDP>
constexpr size_t attention_backward_dq_scalar_smem_bytes() {
    return sizeof(float) * (2 * HDP * ATTN_LD_FIXED + 2 * HDP * ATTN_LD_STREAM + ATTN_STREAM * HDP +
                            ATTN_STREAM * ATTN_LD_FIXED);
}

// dq for one (b, h, tile of 64 queries). grid (B * H, ceil(T / 64)), block 256.
template <int HDP>
__global__ void __launch_bounds__(ATTN_THREADS)
    attention_backward_dq_scalar_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int T, int H, int KV, int hd, float scale, float scale_log2) {
    extern __shared__ float4 attn_smem_dq[];
    float* Qt = reinterpret_cast<float*>(attn_smem_dq);  // (HDP, 68)  queries, k-major
    float* dOt = Qt + HDP * ATTN_LD_FIXED;                // (HDP, 68)  output gradients, k-major
    float* Kt = dOt + HDP * ATTN_LD_FIXED;                // (HDP, 36)  keys, k-major
    float* Vt = Kt + HDP * ATTN_LD_STREAM;                // (HDP, 36)  values, k-major
    float* Ks = Vt + HDP * ATTN_LD_STREAM;                // (32, HDP)  keys, row-major
    float* dSt = Ks + ATTN_STREAM * HDP;                  // (32, 68)   dS, key-major

    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ATTN_FIXED;
    const size_t qkv_stride = (size_t)(H + 2 * KV) * hd, o_stride = (size_t)H * hd;
    const floatX* q_src = qkv + (size_t)b * T * qkv_stride + (size_t)h * hd;
    const floatX* k_src = qkv + (size_t)b * T * qkv_stride + (size_t)(H + kvh) * hd;
    const floatX* v_src = qkv + (size_t)b * T * qkv_stride + (size_t)(H + KV + kvh) * hd;
    const floatX* do_src = dout + (size_t)b * T * o_stride + (size_t)h * hd;

    attn_load_tile<HDP, ATTN_FIXED>(Qt, ATTN_LD_FIXED, nullptr, q_src, qkv_stride, q0, T, hd);
    attn_load_tile<HDP, ATTN_FIXED>(dOt, ATTN_LD_FIXED, nullptr, do_src, o_stride, q0, T, hd);
    float lse2[4], D[4], dq[4][HDP / 16];  // lse2: log-sum-exp in the base-2 domain of the scaled scores
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int q = q0 + 4 * ty + i;
        lse2[i] = q < T ? lse[(size_t)blockIdx.x * T + q] * ATTN_LOG2E : 0.0f;
        D[i] = q < T ? delta[(size_t)blockIdx.x * T + q] : 0.0f;
#pragma unroll
        for (int c = 0; c < HDP / 16; c++) dq[i][c] = 0.0f;
    }

    const int k_end = min(q0 + ATTN_FIXED, T);
    for (int k0 = 0; k0 < k_end; k0 += ATTN_STREAM) {
        attn_load_tile<HDP, ATTN_STREAM>(Kt, ATTN_LD_STREAM, Ks, k_src, qkv_stride, k0, T, hd);
        attn_load_tile<HDP, ATTN_STREAM>(Vt, ATTN_LD_STREAM, nullptr, v_src, qkv_stride, k0, T, hd);
        __syncthreads();

        float s[4][2] = {}, dp[4][2] = {};
        attn_score_tile<HDP>(s, Qt, ATTN_LD_FIXED, Kt, ATTN_LD_STREAM, ty, tx);
        attn_score_tile<HDP>(dp, dOt, ATTN_LD_FIXED, Vt, ATTN_LD_STREAM, ty, tx);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int q = q0 + 4 * ty + i;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int key = k0 + 2 * tx + j;
                const float p = (key <= q && q < T) ? exp2f(s[i][j] * scale_log2 - lse2[i]) : 0.0f;
                dSt[(2 * tx + j) * ATTN_LD_FIXED + 4 * ty + i] = p * (dp[i][j] - D[i]);
            }
        }
        __syncthreads();  // dSt complete

        attn_accum_tile<HDP>(dq, dSt, ATTN_LD_FIXED, Ks, ty, tx);
        __syncthreads();  // done reading before the next tile overwrites
    }

    const float mult[4] = {scale, scale, scale, scale};
    attn_store_tile<HDP>(dqkv + (size_t)b * T * qkv_stride + (size_t)h * hd, qkv_stride, dq, mult, q0, T, hd, ty, tx);
}

template <int HDP>
constexpr size_t attention_backward_dkdv_scalar_smem_bytes() {
    return sizeof(float) * (2 * HDP * ATTN_LD_FIXED + 2 * HDP * ATTN_LD_STREAM + 2 * ATTN_STREAM * HDP +
                            2 * ATTN_STREAM * ATTN_LD_FIXED + 2 * ATTN_STREAM);
}

// dk, dv for one (b, kv head, tile of 64 keys). grid (B * KV, ceil(T / 64)), block 256.
template <int HDP>
__global__ void __launch_bounds__(ATTN_THREADS)
    attention_backward_dkdv_scalar_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                   const float* delta, int T, int H, int KV, int hd, float scale, float scale_log2) {
    extern __shared__ float4 attn_smem_dkdv[];
    float* Kt = reinterpret_cast<float*>(attn_smem_dkdv);  // (HDP, 68)  keys, k-major
    float* Vt = Kt + HDP * ATTN_LD_FIXED;                   // (HDP, 68)  values, k-major
    float* Qt = Vt + HDP * ATTN_LD_FIXED;                   // (HDP, 36)  queries, k-major
    float* dOt = Qt + HDP * ATTN_LD_STREAM;                 // (HDP, 36)  output gradients, k-major
    float* Qs = dOt + HDP * ATTN_LD_STREAM;                 // (32, HDP)  queries, row-major
    float* dOs = Qs + ATTN_STREAM * HDP;                    // (32, HDP)  output gradients, row-major
    float* Ps = dOs + ATTN_STREAM * HDP;                    // (32, 68)   P, query-major
    float* dSs = Ps + ATTN_STREAM * ATTN_LD_FIXED;          // (32, 68)   dS, query-major
    float* lse2_s = dSs + ATTN_STREAM * ATTN_LD_FIXED;      // (32)       lse of the query tile, base-2 domain
    float* D_s = lse2_s + ATTN_STREAM;                      // (32)       delta of the query tile

    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ATTN_FIXED;  // the first key tiles see the most queries: scheduled first
    const size_t qkv_stride = (size_t)(H + 2 * KV) * hd, o_stride = (size_t)H * hd;
    const floatX* k_src = qkv + (size_t)b * T * qkv_stride + (size_t)(H + kvh) * hd;
    const floatX* v_src = qkv + (size_t)b * T * qkv_stride + (size_t)(H + KV + kvh) * hd;

    attn_load_tile<HDP, ATTN_FIXED>(Kt, ATTN_LD_FIXED, nullptr, k_src, qkv_stride, k0, T, hd);
    attn_load_tile<HDP, ATTN_FIXED>(Vt, ATTN_LD_FIXED, nullptr, v_src, qkv_stride, k0, T, hd);
    float dk[4][HDP / 16] = {}, dv[4][HDP / 16] = {};

    for (int g = 0; g < group; g++) {  // fixed order over the query heads sharing this kv head
        const int h = kvh * group + g;
        const floatX* q_src = qkv + (size_t)b * T * qkv_stride + (size_t)h * hd;
        const floatX* do_src = dout + (size_t)b * T * o_stride + (size_t)h * hd;
        const size_t row_base = ((size_t)b * H + h) * T;  // (b, h) row of lse and delta
        // Causal: queries before k0 see none of these keys. k0 is a multiple of 64, hence of 32.
        for (int q0 = k0; q0 < T; q0 += ATTN_STREAM) {
            attn_load_tile<HDP, ATTN_STREAM>(Qt, ATTN_LD_STREAM, Qs, q_src, qkv_stride, q0, T, hd);
            attn_load_tile<HDP, ATTN_STREAM>(dOt, ATTN_LD_STREAM, dOs, do_src, o_stride, q0, T, hd);
            if (threadIdx.x < ATTN_STREAM) {
                const int q = q0 + threadIdx.x;
                lse2_s[threadIdx.x] = q < T ? lse[row_base + q] * ATTN_LOG2E : 0.0f;
                D_s[threadIdx.x] = q < T ? delta[row_base + q] : 0.0f;
            }
            __syncthreads();

            // Transposed scores: rows are keys (the block's fixed side), columns are queries.
            float s[4][2] = {}, dp[4][2] = {};
            attn_score_tile<HDP>(s, Kt, ATTN_LD_FIXED, Qt, ATTN_LD_STREAM, ty, tx);
            attn_score_tile<HDP>(dp, Vt, ATTN_LD_FIXED, dOt, ATTN_LD_STREAM, ty, tx);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int key = k0 + 4 * ty + i;
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int qi = 2 * tx + j, q = q0 + qi;
                    const float p = (key <= q && q < T) ? exp2f(s[i][j] * scale_log2 - lse2_s[qi]) : 0.0f;
                    Ps[qi * ATTN_LD_FIXED + 4 * ty + i] = p;
                    dSs[qi * ATTN_LD_FIXED + 4 * ty + i] = p * (dp[i][j] - D_s[qi]);
                }
            }
            __syncthreads();  // Ps, dSs complete

            attn_accum_tile<HDP>(dv, Ps, ATTN_LD_FIXED, dOs, ty, tx);
            attn_accum_tile<HDP>(dk, dSs, ATTN_LD_FIXED, Qs, ty, tx);
            __syncthreads();  // done reading before the next query tile overwrites
        }
    }

    floatX* dqkv_b = dqkv + (size_t)b * T * qkv_stride;
    const float k_mult[4] = {scale, scale, scale, scale}, v_mult[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    attn_store_tile<HDP>(dqkv_b + (size_t)(H + kvh) * hd, qkv_stride, dk, k_mult, k0, T, hd, ty, tx);
    attn_store_tile<HDP>(dqkv_b + (size_t)(H + KV + kvh) * hd, qkv_stride, dv, v_mult, k0, T, hd, ty, tx);
}

// ----------------------------------------------------------------------------------------------------------------
// Launchers

template <int HDP>
inline void attention_forward_scalar_hdp(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV,
                                         int hd, cudaStream_t stream) {
    static bool smem_set = false;
    const size_t smem = attention_forward_scalar_smem_bytes<HDP>();
    attention_set_smem(attention_forward_scalar_kernel<HDP>, smem, smem_set);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)hd);
    dim3 grid(B * H, ceil_div(T, ATTN_FIXED));
    attention_forward_scalar_kernel<HDP><<<grid, ATTN_THREADS, smem, stream>>>(out, lse, qkv, T, H, KV, hd, scale_log2);
    cudaCheckLaunch();
}

// The scalar forward (any precision, head_dim 1..128). Same contract as attention_forward.
inline void attention_forward_scalar(floatX* out, float* lse, const floatX* qkv, int B, int T, int n_heads,
                                     int n_kv_heads, int head_dim, cudaStream_t stream) {
    attention_check_args("attention_forward", B, T, n_heads, n_kv_heads, head_dim);
    if (head_dim <= 64) attention_forward_scalar_hdp<64>(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
    else attention_forward_scalar_hdp<128>(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
}

template <int HDP>
inline void attention_backward_scalar_hdp(floatX* dqkv, const float* delta, const floatX* dout, const floatX* qkv,
                                   const float* lse, int B, int T, int H, int KV, int hd, cudaStream_t stream) {
    static bool dq_smem_set = false, dkdv_smem_set = false;
    const size_t dq_smem = attention_backward_dq_scalar_smem_bytes<HDP>();
    const size_t dkdv_smem = attention_backward_dkdv_scalar_smem_bytes<HDP>();
    attention_set_smem(attention_backward_dq_scalar_kernel<HDP>, dq_smem, dq_smem_set);
    attention_set_smem(attention_backward_dkdv_scalar_kernel<HDP>, dkdv_smem, dkdv_smem_set);
    const float scale = 1.0f / sqrtf((float)hd), scale_log2 = scale * ATTN_LOG2E;
    dim3 dq_grid(B * H, ceil_div(T, ATTN_FIXED));
    attention_backward_dq_scalar_kernel<HDP>
        <<<dq_grid, ATTN_THREADS, dq_smem, stream>>>(dqkv, dout, qkv, lse, delta, T, H, KV, hd, scale, scale_log2);
    cudaCheckLaunch();
    dim3 dkdv_grid(B * KV, ceil_div(T, ATTN_FIXED));
    attention_backward_dkdv_scalar_kernel<HDP><<<dkdv_grid, ATTN_THREADS, dkdv_smem, stream>>>(
        dqkv, dout, qkv, lse, delta, T, H, KV, hd, scale, scale_log2);
    cudaCheckLaunch();
}

// The scalar backward (any precision, head_dim 1..128). Same contract as attention_backward.
inline void attention_backward_scalar(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                                      const floatX* out, const float* lse, int B, int T, int n_heads, int n_kv_heads,
                                      int head_dim, cudaStream_t stream) {
    attention_check_args("attention_backward", B, T, n_heads, n_kv_heads, head_dim);
    attention_delta(delta_scratch, dout, out, B, T, n_heads, head_dim, stream);
    if (head_dim <= 64) {
        attention_backward_scalar_hdp<64>(dqkv, delta_scratch, dout, qkv, lse, B, T, n_heads, n_kv_heads, head_dim,
                                          stream);
    } else {
        attention_backward_scalar_hdp<128>(dqkv, delta_scratch, dout, qkv, lse, B, T, n_heads, n_kv_heads, head_dim,
                                           stream);
    }
}
