// Causal grouped-query attention, forward and backward, flash-attention style: no T x T buffer, only the per-row
// log-sum-exp is kept (O(B H T) extra memory).
//
// Layouts (row-major):
//   qkv  (B, T, (H + 2 KV) hd)   per token: H query heads, then KV key heads, then KV value heads (RoPE applied)
//   out  (B, T, H hd)            per token, the heads concatenated
//   lse  (B, H, T) fp32          log-sum-exp of each row of scaled scores
// Query head h attends with kv head h / (H / KV).
//
// Math, for one (b, h), scale = 1/sqrt(hd), causal (key j <= query i):
//   s_ij = scale q_i . k_j      lse_i = log sum_j exp(s_ij)      P_ij = exp(s_ij - lse_i)      o_i = sum_j P_ij v_j
// Backward, with D_i = do_i . o_i (= sum_j P_ij dP_ij):
//   dP_ij = do_i . v_j          dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j    dk_j = scale sum_i dS_ij q_i    dv_j = sum_i P_ij do_i
// For a kv head, dk and dv also sum over the H / KV query heads that share it.
//
// The scalar path (fp32 builds, and head dims other than 64 / 128):
// Forward: one block per (b, h, tile of 64 queries). Key/value tiles of 32 rows stream through shared memory; the
// softmax is online (running row max m and row sum l, rescaling the output accumulator when m grows). Exponentials are
// taken in base 2 on scores pre-multiplied by scale * log2(e), which is exact algebra and one multiply cheaper.
// Backward: two kernels, so that every output element has exactly one writer and a fixed summation order
// (deterministic, no atomics):
//   dq kernel:    one block per (b, h, tile of 64 queries), looping over key tiles of 32 (recomputing P and dS).
//   dk/dv kernel: one block per (b, kv head, tile of 64 keys), looping over the query heads of its group, and for each
//                 over query tiles of 32 from the diagonal on; the group sum happens in registers.
// D is computed first by a small kernel into delta_scratch (B, H, T).
//
// Inner loops are CUDA-core fp32 micro-GEMMs. A block is 256 threads seen
// as a 16 x 16 grid (ty, tx). For the block's 64 "fixed" rows (queries, or keys in dk/dv) and the 32 streamed rows,
// thread (ty, tx) owns score entries [4 ty + i][2 tx + j] (i < 4, j < 2), and accumulator entries
// [4 ty + i][4 tx + 64 c + e] (e < 4, c < HDP / 64) of a (64, HDP) output tile. Operands live in shared memory as fp32
// in "k-major" layout (the reduction index outermost), so each k step reads one float4 of A and one float2 / float4 of
// B per thread. Rows are padded by 4 floats (68, 36) to spread the transposing stores over more banks while keeping
// float4 alignment.
//
// Head dims: any hd in 1..128. The kernels are templated on a padded head dim HDP (64 or 128); tiles are zero-filled
// for d >= hd, which adds nothing to the dot products, and columns d >= hd are never stored.
// Ragged T: rows t >= T are zero-filled on load, masked (key j > query i, or i >= T), and never stored.
//
// Three implementations, chosen by the host launchers attention_forward / attention_backward at the end of the file:
//   * the scalar CUDA-core kernels (section "Scalar path"): fp32 builds and head dims other than 64 / 128;
//   * the tensor-core kernels (section "Tensor-core path", FlashAttention-2 style, mma.sync m16n8k16 bf16 with fp32
//     accumulation): bf16 builds with head_dim 64 or 128. Their design is described at the top of that section;
//   * on Hopper (sm_90a builds on compute capability 9.0), the wgmma kernels of attention_hopper.cuh, tried first:
//     the forward at head_dim 128, the backward at head_dim 64 and 128.
// All compute the same math above and write the same outputs; attention_forward_scalar / _tc and
// attention_backward_scalar / _tc are also callable directly (dev/cuda benchmarks compare them).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda_common.h"

constexpr int ATTN_THREADS = 256;                    // 16 x 16 thread grid
constexpr int ATTN_FIXED = 64;                       // rows a block owns (queries; keys in the dk/dv kernel)
constexpr int ATTN_STREAM = 32;                      // rows streamed through shared memory per step
constexpr int ATTN_LD_FIXED = ATTN_FIXED + 4;        // padded leading dimension of k-major fixed-row tiles
constexpr int ATTN_LD_STREAM = ATTN_STREAM + 4;      // padded leading dimension of k-major streamed-row tiles
constexpr float ATTN_LOG2E = 1.4426950408889634f;
constexpr float ATTN_LN2 = 0.6931471805599453f;

// ================================================================================================================
// Scalar path (CUDA cores, fp32 math, any floatX, head_dim 1..128)
// ================================================================================================================

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
constexpr size_t attention_forward_smem_bytes() {
    return sizeof(float) *
           (HDP * ATTN_LD_FIXED + HDP * ATTN_LD_STREAM + ATTN_STREAM * HDP + ATTN_STREAM * ATTN_LD_FIXED);
}

// grid (B * H, ceil(T / 64)), block 256.
template <int HDP>
__global__ void __launch_bounds__(ATTN_THREADS, 2)
    attention_forward_kernel(floatX* out, float* lse, const floatX* qkv, int T, int H, int KV, int hd,
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
// Backward

// delta (B, H, T) = rowsum(dout * out) per head. One warp per row.
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

template <int HDP>
constexpr size_t attention_backward_dq_smem_bytes() {
    return sizeof(float) * (2 * HDP * ATTN_LD_FIXED + 2 * HDP * ATTN_LD_STREAM + ATTN_STREAM * HDP +
                            ATTN_STREAM * ATTN_LD_FIXED);
}

// dq for one (b, h, tile of 64 queries). grid (B * H, ceil(T / 64)), block 256.
template <int HDP>
__global__ void __launch_bounds__(ATTN_THREADS)
    attention_backward_dq_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
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
constexpr size_t attention_backward_dkdv_smem_bytes() {
    return sizeof(float) * (2 * HDP * ATTN_LD_FIXED + 2 * HDP * ATTN_LD_STREAM + 2 * ATTN_STREAM * HDP +
                            2 * ATTN_STREAM * ATTN_LD_FIXED + 2 * ATTN_STREAM);
}

// dk, dv for one (b, kv head, tile of 64 keys). grid (B * KV, ceil(T / 64)), block 256.
template <int HDP>
__global__ void __launch_bounds__(ATTN_THREADS)
    attention_backward_dkdv_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
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

// ================================================================================================================
// Tensor-core path (bf16 build, head_dim HD = 64 or 128), FlashAttention-2 style
// ================================================================================================================
//
// Instruction: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D (16 x 8 fp32) += A (16 x 16) B (16 x 8), bf16.
// Fragment ownership (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane / 4 and c = 2 (lane % 4):
//   A (M x K, row):   a0 = A[g][c, c+1]    a1 = A[g+8][c, c+1]    a2 = A[g][c+8, c+9]    a3 = A[g+8][c+8, c+9]
//   B (K x N, col):   b0 = B[c, c+1][g]    b1 = B[c+8, c+9][g]
//   C/D (M x N):      d0, d1 = D[g][c, c+1]                       d2, d3 = D[g+8][c, c+1]
// Each 32-bit A/B register holds two bf16, the lower column (k) index in the low half. Consequences used throughout:
//   * A lane owns rows g and g+8 of its warp's 16-row slice of every accumulator, so row statistics (the online
//     softmax max and sum) need only a reduction over the 4 lanes of a quad (shfl xor 1, 2).
//   * The accumulators of two adjacent n8 tiles 2kk, 2kk+1 (columns 16kk .. 16kk+15) are exactly an A fragment with
//     k = those 16 columns: {pack(d0,d1) of 2kk, pack(d2,d3) of 2kk, pack(d0,d1) of 2kk+1, pack(d2,d3) of 2kk+1}.
//     So P (or dS), computed in accumulator registers, feeds the next matmul as its A operand without a trip through
//     shared memory (the FA2 register-reuse trick).
//   * B operands: a tile stored row-major as X[n][k] (K for S = Q K^T, Q for S^T = K Q^T, V for dP = dO V^T, dO for
//     dP^T = V dO^T) is a "col" B as it stands: plain ldmatrix gives b0, b1. A tile stored as X[k][n] (V for O = P V,
//     dO for dV = P^T dO, K for dQ = dS K, Q for dK = dS^T Q) needs ldmatrix.trans.
// ldmatrix.x4 loads four 8x8 bf16 matrices: lanes 8i .. 8i+7 supply the 8 row addresses of matrix i, and register i
// of every lane receives element [g][c, c+1] of matrix i (.trans: of its transpose). Per-lane addresses, relative to
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
// Rows per warp (MT). A warp owning 16 rows (one m16 tile) gets 2 mmas out of each 16 x 16 B fragment it loads with
// ldmatrix; with 32 rows (MT = 2 m16 tiles) it gets 4, halving the shared-memory traffic per mma, which is what
// limits mma.sync kernels with 16-row warps. The cost is registers (accumulators grow with MT), so each kernel and
// head dim has its own MT and streamed-tile size (ATC_* constants below; the CTA is always 4 warps, 64 MT rows).
//
// Forward: CTA = (64 MT queries, head, batch); warp w owns queries q0 + 16 MT w .. +16 MT - 1. Its Q fragments stay
// in registers where they fit (MT HD <= 128), else are re-read from smem per K tile. K and V tiles of BN keys stream
// through a 2-stage cp.async pipeline (tile j+1 loads while tile j is computed), only up to the causal diagonal. Per
// tile and warp: S = Q K^T (16 MT x BN); the causal mask only on the diagonal tile; online softmax in the log2 domain
// (scores times scale log2 e folded into one fma before exp2f); P packed to bf16 A fragments; O (16 MT x HD fp32,
// MT HD/2 regs) = alpha O + P V. Epilogue: O / l staged through the warp's own (dead) rows of the Q tile for 16-byte
// stores; lse = (m + log2 l) ln 2.
// smem: Q 64 MT x (HD+8) + 2 stages x (K, V) BN x (HD+8), bf16.
//
// Backward: D = rowsum(dO o O) by attention_delta_kernel (shared with the scalar path), then two kernels in which
// every output element has one writer and a fixed summation order (deterministic, no atomics):
//   dK/dV: CTA = (64 MT keys, kv head, batch); warp w owns keys k0 + 16 MT w ..; the K, V tiles stay in smem. Loops
//     over the group's query heads and, for each, over query tiles of BQ from the diagonal to T (2-stage cp.async
//     pipeline of Q, dO, and plain loads of lse, D). Per tile and warp, transposed (rows = the warp's keys, columns =
//     queries): S^T = K Q^T and dP^T = V dO^T; P^T = exp2(S^T scale log2 e - lse log2 e), set to 0 where
//     key > query or query >= T; dS^T = P^T o (dP^T - D); dV += P^T dO and dK += dS^T Q, with P^T and dS^T reused
//     from the accumulators as A fragments. dK is multiplied by scale once, at the store.
//     smem: (K, V) 64 MT x (HD+8) + 2 stages x (Q, dO) BQ x (HD+8) bf16 + 2 x 2 x BQ fp32.
//   dQ: CTA = (64 MT queries, head, batch); warp w owns 16 MT queries; Q, dO stay in smem; K, V tiles of BN keys up
//     to the diagonal through the 2-stage pipeline; recomputes S, P, dP, dS per tile and accumulates dQ += dS K (fp32
//     registers); dQ times scale at the store. smem: (Q, dO) 64 MT x (HD+8) + 2 stages x (K, V) BN x (HD+8).
//   dK/dV, 8 warps (used for HD 128): CTA = 128 keys; warp pairs share 32 keys and split the score work by query
//     halves and the dK/dV work by column halves, exchanging P^T, dS^T through smem; pairs 2, 3 run half a step
//     behind pairs 0, 1. Described above attention_backward_dkdv_tc8_kernel.
// The split recomputes S and dP in both kernels (7 matmuls instead of 5) in exchange for determinism without atomics
// or a T x T buffer.
#if !defined(ENABLE_FP32)

constexpr int ATC_WARPS = 4;
constexpr int ATC_THREADS = 32 * ATC_WARPS;
// Tile configuration per kernel and head dim: the best measured on an H200 (dev/cuda/attention_forward.cu and
// attention_backward.cu, "sweep"). MT: m16 row tiles per warp (the CTA owns 64 MT rows); BN / BQ: rows of the
// streamed tiles. The limit is registers: 255 per thread at 2 CTAs of 128 threads per SM. The dK/dV kernel keeps two
// accumulators (dK, dV: MT HD fp32 registers), so MT = 2 does not fit for HD 128 and spills for HD 64.
constexpr int ATC_FWD_MT_64 = 2, ATC_FWD_BN_64 = 64, ATC_FWD_MT_128 = 2, ATC_FWD_BN_128 = 32;
constexpr int ATC_DQ_MT_64 = 2, ATC_DQ_BN_64 = 64, ATC_DQ_MT_128 = 2, ATC_DQ_BN_128 = 32;
constexpr int ATC_KV_MT_64 = 1, ATC_KV_BQ_64 = 64, ATC_KV_MT_128 = 1, ATC_KV_BQ_128 = 64;
// dK/dV warps per CTA: 4 (the 4-warp kernel, MT and BQ as given) or 8 (the 8-warp kernel, 128 keys, BQ as given; MT
// unused). 8 wins at HD 128 (210 / 217 vs 206 / 213 TFLOP/s), loses at HD 64 (144 vs 168: its mma phases are too short
// to cover the exponentials of the other warp of a sub-partition).
constexpr int ATC_KV_W_64 = 4, ATC_KV_W_128 = 8;

// ----------------------------------------------------------------------------------------------------------------
// PTX wrappers

__device__ __forceinline__ uint32_t atc_smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy, asynchronous; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void atc_cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void atc_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void atc_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void atc_ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void atc_ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// d += a b, one m16n8k16 bf16 mma with fp32 accumulation.
__device__ __forceinline__ void atc_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> bf16x2 (lo in the low half: the lower column index, as the fragments want).
__device__ __forceinline__ uint32_t atc_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// A fragment for k-step kk from two adjacent n8 accumulator tiles (the register-reuse trick above).
__device__ __forceinline__ void atc_acc_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = atc_pack_bf16(lo[0], lo[1]);
    a[1] = atc_pack_bf16(lo[2], lo[3]);
    a[2] = atc_pack_bf16(hi[0], hi[1]);
    a[3] = atc_pack_bf16(hi[2], hi[3]);
}

// Per-lane ldmatrix addresses (byte offsets into a row-major tile with leading dimension LD elements) of the 16 x 16
// block at (row0, col0), for the three patterns in the section comment.
template <int LD>
__device__ __forceinline__ uint32_t atc_off_a(int row0, int col0, int lane) {
    return 2u * ((row0 + lane % 16) * LD + col0 + 8 * (lane / 16));
}
template <int LD>
__device__ __forceinline__ uint32_t atc_off_b(int row0, int col0, int lane) {
    return 2u * ((row0 + lane % 8 + 8 * (lane / 16)) * LD + col0 + 8 * ((lane / 8) % 2));
}

// The backward's two score-shaped products over the head dim, sharing one loop: s = A1 B1^T and dp = A2 B2^T.
// A1, A2: the warp's MT 16-row blocks from row0; B1, B2: N rows; all HD wide, in shared memory with leading
// dimension LD (32-bit shared addresses). The dK/dV kernel passes (K, V, Q, dO) to get S^T and dP^T, the dQ kernel
// (Q, dO, K, V) to get S and dP. Each B fragment feeds MT mmas.
template <int HD, int MT, int N, int LD>
__device__ __forceinline__ void atc_two_products(float (&s)[MT][N / 8][4], float (&dp)[MT][N / 8][4], uint32_t a1,
                                                 uint32_t a2, uint32_t b1, uint32_t b2, int row0, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < N / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[mt][nt][e] = dp[mt][nt][e] = 0.0f;
        }
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        uint32_t fa1[MT][4], fa2[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            atc_ldsm_x4(fa1[mt], a1 + atc_off_a<LD>(row0 + 16 * mt, 16 * kk, lane));
            atc_ldsm_x4(fa2[mt], a2 + atc_off_a<LD>(row0 + 16 * mt, 16 * kk, lane));
        }
#pragma unroll
        for (int np = 0; np < N / 16; np++) {
            uint32_t fb[4];
            atc_ldsm_x4(fb, b1 + atc_off_b<LD>(16 * np, 16 * kk, lane));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                atc_mma(s[mt][2 * np], fa1[mt], fb[0], fb[1]);
                atc_mma(s[mt][2 * np + 1], fa1[mt], fb[2], fb[3]);
            }
            atc_ldsm_x4(fb, b2 + atc_off_b<LD>(16 * np, 16 * kk, lane));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                atc_mma(dp[mt][2 * np], fa2[mt], fb[0], fb[1]);
                atc_mma(dp[mt][2 * np + 1], fa2[mt], fb[2], fb[3]);
            }
        }
    }
}

template <int LD>
__device__ __forceinline__ uint32_t atc_off_bt(int row0, int col0, int lane) {
    return 2u * ((row0 + lane % 8 + 8 * ((lane / 8) % 2)) * LD + col0 + 8 * (lane / 16));
}

// out (MT 16-row blocks x HD) += acc (the same rows x N, fp32 accumulators, packed to bf16 A fragments) times a B
// tile of N rows x HD stored row-major with leading dimension LD at b (read with ldmatrix.trans): O += P V in the
// forward, dQ += dS K, dV += P^T dO and dK += dS^T Q in the backward. Each B fragment feeds MT mmas.
template <int HD, int MT, int N, int LD>
__device__ __forceinline__ void atc_acc_times_bt(float (&out)[MT][HD / 8][4], const float (&acc)[MT][N / 8][4],
                                                 uint32_t b, int lane) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) atc_acc_to_a(a[mt], acc[mt][2 * kk], acc[mt][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < HD / 16; dp++) {
            uint32_t fb[4];
            atc_ldsm_x4_trans(fb, b + atc_off_bt<LD>(16 * kk, 16 * dp, lane));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                atc_mma(out[mt][2 * dp], a[mt], fb[0], fb[1]);
                atc_mma(out[mt][2 * dp + 1], a[mt], fb[2], fb[3]);
            }
        }
    }
}

// Issues cp.async loads of rows [r0, r0 + ROWS) of one head into a (ROWS, HD + 8) smem tile (NTHREADS: CTA size);
// src points at row 0, column 0 of the head, rows `row_stride` elements apart. Rows >= T are zero-filled (the source
// address is clamped to row 0, which always exists, though nothing is read). The caller commits the group.
template <int HD, int ROWS, int NTHREADS = ATC_THREADS>
__device__ __forceinline__ void atc_load_tile(__nv_bfloat16* dst, const __nv_bfloat16* src, size_t row_stride, int r0,
                                              int T) {
    constexpr int CHUNKS = HD / 8, LD = HD + 8;  // 16-byte chunks per row
    static_assert((ROWS * CHUNKS) % NTHREADS == 0, "tile must split evenly over the CTA");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / NTHREADS; i++) {
        const int idx = i * NTHREADS + threadIdx.x;
        const int r = idx / CHUNKS, c = idx % CHUNKS;  // consecutive threads: consecutive chunks of a row
        const bool valid = r0 + r < T;
        const __nv_bfloat16* g = src + (size_t)(valid ? r0 + r : 0) * row_stride + 8 * c;
        atc_cp_async16(atc_smem_u32(dst + r * LD + 8 * c), g, valid ? 16 : 0);
    }
}

// Stores a warp's 16 x HD fp32 accumulator (times mult) as bf16: first into the warp's own 16 rows of a smem tile
// (which no other warp reads), then 16-byte chunks to global rows r0 .. r0+15 (dst: row 0, column 0 of the head),
// skipping rows >= T.
template <int HD>
__device__ __forceinline__ void atc_store_warp_rows(__nv_bfloat16* dst, size_t row_stride, __nv_bfloat16* stage,
                                                    const float (&acc)[HD / 8][4], float mult0, float mult1, int r0,
                                                    int T, int lane) {
    constexpr int LD = HD + 8, CHUNKS = HD / 8;
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < HD / 8; nt++) {
        *reinterpret_cast<uint32_t*>(stage + g * LD + 8 * nt + c) =
            atc_pack_bf16(acc[nt][0] * mult0, acc[nt][1] * mult0);
        *reinterpret_cast<uint32_t*>(stage + (g + 8) * LD + 8 * nt + c) =
            atc_pack_bf16(acc[nt][2] * mult1, acc[nt][3] * mult1);
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
// Forward

// CTA rows (queries here; keys in dK/dV) for MT m16 tiles per warp.
template <int MT>
__host__ __device__ constexpr int atc_rows() {
    return 16 * MT * ATC_WARPS;
}

template <int HD, int MT, int BN>
constexpr size_t attention_forward_tc_smem_bytes() {
    return sizeof(__nv_bfloat16) * (HD + 8) * (atc_rows<MT>() + 4 * BN);
}

// grid (B * H, ceil(T / (64 MT))), block 128. MT: m16 query tiles per warp; BN: keys per K/V tile.
template <int HD, int MT, int BN>
__global__ void __launch_bounds__(ATC_THREADS, 2)
    attention_forward_tc_kernel(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int T, int H, int KV,
                                float scale_log2) {
    constexpr int LD = HD + 8, ROWS = atc_rows<MT>(), WR = 16 * MT;  // WR: rows per warp
    // The warp's Q fragments (MT HD / 4 registers) stay in registers when that is cheap; otherwise (HD 128, MT 2,
    // where O alone takes 128 registers) they are re-read from smem for each K tile.
    constexpr bool QREG = MT * HD <= 128;
    extern __shared__ int4 atc_smem_fwd[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(atc_smem_fwd);  // (ROWS, LD)
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
    atc_load_tile<HD, ROWS>(Qs, q_src, stride, q0, T);
    atc_load_tile<HD, BN>(Ks, k_src, stride, 0, T);
    atc_load_tile<HD, BN>(Vs, v_src, stride, 0, T);
    atc_cp_async_commit();

    uint32_t qf[QREG ? MT : 1][QREG ? HD / 16 : 1][4];  // the warp's Q block as A fragments (if QREG)
    float o[MT][HD / 8][4];  // O accumulator: m tile mt, n8 tile nt holds columns 8 nt .. 8 nt + 7
    float m[MT][2], l[MT][2];  // running max of rows g, g+8 (log2 domain, scaled); this lane's part of the row sums
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;
    }
    const uint32_t q_base = atc_smem_u32(Qs);

    for (int j = 0; j < n_tiles; j++) {
        const int stage = j % 2;
        if (j + 1 < n_tiles) {  // prefetch tile j+1 into the other stage (freed by the __syncthreads ending j-1)
            atc_load_tile<HD, BN>(Ks + (1 - stage) * BN * LD, k_src, stride, (j + 1) * BN, T);
            atc_load_tile<HD, BN>(Vs + (1 - stage) * BN * LD, v_src, stride, (j + 1) * BN, T);
            atc_cp_async_commit();
            atc_cp_async_wait<1>();  // tile j (and Q) landed; tile j+1 may still be in flight
        } else {
            atc_cp_async_wait<0>();
        }
        __syncthreads();  // everyone's copies of tile j visible

        if constexpr (QREG) {
            if (j == 0) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int kk = 0; kk < HD / 16; kk++) {
                        atc_ldsm_x4(qf[mt][kk], q_base + atc_off_a<LD>(WR * warp + 16 * mt, 16 * kk, lane));
                    }
                }
            }
        }
        const int k0 = j * BN;
        if (k0 <= qw + WR - 1) {  // warp-uniform: the tile has keys visible to some query of this warp
            const uint32_t k_base = atc_smem_u32(Ks + stage * BN * LD), v_base = atc_smem_u32(Vs + stage * BN * LD);
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
                    if constexpr (QREG) {
#pragma unroll
                        for (int i = 0; i < 4; i++) qa[mt][i] = qf[mt][kk][i];
                    } else {
                        atc_ldsm_x4(qa[mt], q_base + atc_off_a<LD>(WR * warp + 16 * mt, 16 * kk, lane));
                    }
                }
#pragma unroll
                for (int np = 0; np < BN / 16; np++) {
                    uint32_t kb[4];
                    atc_ldsm_x4(kb, k_base + atc_off_b<LD>(16 * np, 16 * kk, lane));
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        atc_mma(s[mt][2 * np], qa[mt], kb[0], kb[1]);
                        atc_mma(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
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
            atc_acc_times_bt<HD, MT, BN, LD>(o, s, v_base, lane);
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
        atc_store_warp_rows<HD>(out + (size_t)b * T * out_stride + (size_t)h * HD, out_stride,
                                Qs + (WR * warp + 16 * mt) * LD, o[mt], inv_l[0], inv_l[1], qw + 16 * mt, T, lane);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// Backward

template <int HD, int MT, int BQ>
constexpr size_t attention_backward_dkdv_tc_smem_bytes() {
    return sizeof(__nv_bfloat16) * (HD + 8) * (2 * atc_rows<MT>() + 4 * BQ) + sizeof(float) * 4 * BQ;
}

// dk, dv for one (b, kv head, tile of 64 MT keys). grid (B * KV, ceil(T / (64 MT))), block 128.
// MT: m16 key tiles per warp; BQ: queries per streamed Q/dO tile.
template <int HD, int MT, int BQ>
__global__ void __launch_bounds__(ATC_THREADS, 2)
    attention_backward_dkdv_tc_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                      const float* lse, const float* delta, int T, int H, int KV, float scale,
                                      float scale_log2) {
    constexpr int LD = HD + 8, ROWS = atc_rows<MT>(), WR = 16 * MT;
    static_assert(ROWS % BQ == 0, "query tiles must start at the key tile's first key");
    extern __shared__ int4 atc_smem_dkdv[];
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(atc_smem_dkdv);  // (ROWS, LD)
    __nv_bfloat16* Vs = Ks + ROWS * LD;                                    // (ROWS, LD)
    __nv_bfloat16* Qs = Vs + ROWS * LD;                                    // 2 stages x (BQ, LD)
    __nv_bfloat16* dOs = Qs + 2 * BQ * LD;                                 // 2 stages x (BQ, LD)
    float* lse2_s = reinterpret_cast<float*>(dOs + 2 * BQ * LD);           // 2 stages x BQ: lse log2(e)
    float* D_s = lse2_s + 2 * BQ;                                          // 2 stages x BQ: delta

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ROWS;  // the first key tiles see the most queries: scheduled first
    const int kw = k0 + WR * warp;     // the warp's first key
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    // Work items: (query head g_i of the group, query tile from the diagonal), flattened so that one pipeline runs
    // through all of them in a fixed order. k0 is a multiple of ROWS, hence of BQ: queries before k0 see no key here.
    const int n_q = ceil_div(T - k0, BQ), n_items = group * n_q;
    auto issue = [&](int item, int stage) {
        const int h = kvh * group + item / n_q, q0 = k0 + (item % n_q) * BQ;
        atc_load_tile<HD, BQ>(Qs + stage * BQ * LD, qkv + (size_t)b * T * stride + (size_t)h * HD, stride, q0, T);
        atc_load_tile<HD, BQ>(dOs + stage * BQ * LD, dout + (size_t)b * T * o_stride + (size_t)h * HD, o_stride, q0,
                              T);
        const size_t row = ((size_t)b * H + h) * T;  // (b, h) row of lse and delta
        for (int i = threadIdx.x; i < BQ; i += ATC_THREADS) {  // plain loads: visible after the next __syncthreads
            const int q = q0 + i;
            lse2_s[stage * BQ + i] = q < T ? lse[row + q] * ATTN_LOG2E : 0.0f;
            D_s[stage * BQ + i] = q < T ? delta[row + q] : 0.0f;
        }
    };

    atc_load_tile<HD, ROWS>(Ks, k_src, stride, k0, T);
    atc_load_tile<HD, ROWS>(Vs, v_src, stride, k0, T);
    issue(0, 0);
    atc_cp_async_commit();

    float dk[MT][HD / 8][4], dv[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) dk[mt][nt][e] = dv[mt][nt][e] = 0.0f;
        }
    }
    const uint32_t k_base = atc_smem_u32(Ks), v_base = atc_smem_u32(Vs);

    for (int it = 0; it < n_items; it++) {
        const int stage = it % 2;
        if (it + 1 < n_items) {
            issue(it + 1, 1 - stage);
            atc_cp_async_commit();
            atc_cp_async_wait<1>();
        } else {
            atc_cp_async_wait<0>();
        }
        __syncthreads();

        const int q0 = k0 + (it % n_q) * BQ;
        if (kw <= q0 + BQ - 1) {  // warp-uniform: some query of the tile sees some key of the warp
            const uint32_t q_base = atc_smem_u32(Qs + stage * BQ * LD), do_base = atc_smem_u32(dOs + stage * BQ * LD);
            const float* lse2_t = lse2_s + stage * BQ;
            const float* D_t = D_s + stage * BQ;
            // S^T = K Q^T and dP^T = V dO^T: rows are the warp's WR keys, columns the BQ queries. Each Q / dO
            // fragment feeds 2 MT mmas.
            float s[MT][BQ / 8][4], dp[MT][BQ / 8][4];
            atc_two_products<HD, MT, BQ, LD>(s, dp, k_base, v_base, q_base, do_base, WR * warp, lane);
            // P^T, dS^T in place. Element (mt, nt, e): key kw + 16 mt + g + 8 (e / 2), query q0 + 8 nt + c + e % 2.
            // Masking is needed where some query precedes some key of the warp, or the tile runs past T.
            const bool need_mask = q0 < kw + WR - 1 || q0 + BQ > T;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int nt = 0; nt < BQ / 8; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int qi = 8 * nt + c + e % 2;
                        float p = exp2f(fmaf(s[mt][nt][e], scale_log2, -lse2_t[qi]));
                        if (need_mask) {
                            const int q = q0 + qi, key = kw + 16 * mt + g + 8 * (e / 2);
                            if (key > q || q >= T) p = 0.0f;  // select, not multiply: p may be inf where masked
                        }
                        s[mt][nt][e] = p;
                        dp[mt][nt][e] = p * (dp[mt][nt][e] - D_t[qi]);
                    }
                }
            }
            // dV += P^T dO and dK += dS^T Q: A from the accumulators, the dO and Q tiles as B.
            atc_acc_times_bt<HD, MT, BQ, LD>(dv, s, do_base, lane);
            atc_acc_times_bt<HD, MT, BQ, LD>(dk, dp, q_base, lane);
        }
        __syncthreads();  // all warps done with this stage before the next prefetch overwrites it
    }

    // The warp's own K and V rows are dead now: they stage the bf16 results.
    __nv_bfloat16* dqkv_b = dqkv + (size_t)b * T * stride;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int rw = WR * warp + 16 * mt;
        atc_store_warp_rows<HD>(dqkv_b + (size_t)(H + kvh) * HD, stride, Ks + rw * LD, dk[mt], scale, scale,
                                k0 + rw, T, lane);
        atc_store_warp_rows<HD>(dqkv_b + (size_t)(H + KV + kvh) * HD, stride, Vs + rw * LD, dv[mt], 1.0f, 1.0f,
                                k0 + rw, T, lane);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// dK/dV with 8 warps (FA2's backward layout): more mma per ldmatrix at the same accumulator registers.
//
// The 4-warp kernel above gives each warp 16 keys (MT 1) and all HD columns of dK and dV (HD fp32 accumulator
// registers): every Q / dO fragment it loads feeds only 2 mmas (~1.8 mma per ldmatrix overall), and MT 2 would need
// 2 HD accumulator registers. Here the CTA owns 128 keys and 8 warps in 4 pairs; pair p owns keys k0 + 32 p .. + 31
// and its two warps split the work of a query tile of BQ queries two ways:
//   * S^T = K Q^T, dP^T = V dO^T, P^T, dS^T: warp (p, w) takes the 32 keys x its half of the queries (BQ / 2 from
//     q0 + w BQ / 2), MT 2: each Q / dO fragment feeds 4 mmas.
//   * dV += P^T dO, dK += dS^T Q: warp (p, w) takes the 32 keys x its half of the columns (HD / 2 from w HD / 2) over
//     all BQ queries: accumulators 2 x 32 x HD / 2 / 32 = HD registers, as before, and each dO / Q fragment feeds 4
//     mmas. The warp needs P^T, dS^T of its partner's query half too: both warps write theirs (bf16) to shared memory
//     (stmatrix) and meet at a pair barrier (bar.sync with 64 threads); a warp takes its own half from registers.
// Per warp and query tile (HD 128, BQ 64): 256 mmas for 104 ldmatrix (~2.5 per ldmatrix) instead of 144.
// A query half whose queries all precede the pair's keys is skipped by both warps (diagonal tiles).
// Skew: with one 8-warp CTA per SM and a __syncthreads per tile, all warps reach the exponentials together and the
// tensor units idle meanwhile (measured on an H200, HD 128: 188 / 194 TFLOP/s for the whole backward, below the
// 4-warp kernel's 206 / 213, where two CTAs per SM drift apart). So pairs 2, 3 run half a step behind (see the main
// loop): 210 / 217.
// Q, dO (and lse, D, by 4-byte cp.async) stream through 3 stages, prefetched one item ahead (a late pair still reads
// item it - 1's stage while item it is scored); one __syncthreads per item.
// smem: (K, V) 128 x (HD+8) + 3 stages x (Q, dO) BQ x (HD+8) + (P^T, dS^T) 128 x (BQ+8) bf16 + 3 x 2 x BQ fp32.
// 255 registers at most (one CTA of 256 threads per SM, like two CTAs of the 4-warp kernel); HD 128, BQ 64: 255 with
// 8 bytes spilled, smem 207.5 KiB.
constexpr int ATC8_THREADS = 256, ATC8_KEYS = 128, ATC8_STAGES = 3;

template <int HD, int BQ>
constexpr size_t attention_backward_dkdv_tc8_smem_bytes() {
    return sizeof(__nv_bfloat16) * ((HD + 8) * (2 * ATC8_KEYS + 2 * ATC8_STAGES * BQ) + 2 * ATC8_KEYS * (BQ + 8)) +
           sizeof(float) * 2 * ATC8_STAGES * BQ;
}

// 4-byte global -> shared copy (lse, D), asynchronous; src_bytes = 0 writes zero.
__device__ __forceinline__ void atc_cp_async4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// lse and delta of queries q0 .. q0 + BQ - 1 of one (b, h) row (`row`: its offset in the (B, H, T) arrays) into
// lse_s, D_s (BQ floats each; zeros past T), asynchronously, by the CTA's first 2 BQ threads (one float each).
template <int BQ>
__device__ __forceinline__ void atc_load_row_stats(float* lse_s, float* D_s, const float* lse, const float* delta,
                                                   size_t row, int q0, int T) {
    if (threadIdx.x < 2 * BQ) {
        const int i = threadIdx.x % BQ, q = q0 + i;
        const float* src = threadIdx.x < BQ ? lse : delta;
        float* dst = threadIdx.x < BQ ? lse_s : D_s;
        atc_cp_async4(atc_smem_u32(dst + i), src + row + (q < T ? q : 0), q < T ? 4 : 0);
    }
}

// Stores a 16 x 16 bf16 block held as an A fragment (atc_ldsm_x4's registers) at (row0, col0) of a row-major smem
// tile with leading dimension LD: one stmatrix.x4 (the inverse of ldmatrix.x4: same addresses, same registers) on
// Hopper, four 32-bit stores before it.
template <int LD>
__device__ __forceinline__ void atc_store_a_frag(uint32_t base, int row0, int col0, const uint32_t (&r)[4], int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     base + atc_off_a<LD>(row0, col0, lane)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#else
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < 4; i++) {  // register i: matrix i = rows 8 (i % 2), columns 8 (i / 2) of the block
        const uint32_t addr = base + 2u * ((row0 + g + 8 * (i % 2)) * LD + col0 + c + 8 * (i / 2));
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(r[i]) : "memory");
    }
#endif
}

// Named barrier for `count` threads (a multiple of 32), id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void atc_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Stores a warp's 16 x 8 NT fp32 accumulator block (times mult) as bf16: into the same block of a smem tile with
// leading dimension LD (which no other warp touches), then 16-byte chunks to global rows r0 .. r0+15 (dst and stage:
// row 0, column 0 of the block), skipping rows >= T.
template <int LD, int NT>
__device__ __forceinline__ void atc_store_warp_block(__nv_bfloat16* dst, size_t row_stride, __nv_bfloat16* stage,
                                                     const float (&acc)[NT][4], float mult, int r0, int T, int lane) {
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        *reinterpret_cast<uint32_t*>(stage + g * LD + 8 * nt + c) = atc_pack_bf16(acc[nt][0] * mult, acc[nt][1] * mult);
        *reinterpret_cast<uint32_t*>(stage + (g + 8) * LD + 8 * nt + c) =
            atc_pack_bf16(acc[nt][2] * mult, acc[nt][3] * mult);
    }
    __syncwarp();
    static_assert((16 * NT) % 32 == 0, "block must split evenly over the warp");
#pragma unroll
    for (int i = 0; i < 16 * NT / 32; i++) {
        const int idx = i * 32 + lane, r = idx / NT, ch = idx % NT;
        if (r0 + r < T) {
            *reinterpret_cast<int4*>(dst + (size_t)(r0 + r) * row_stride + 8 * ch) =
                *reinterpret_cast<const int4*>(stage + r * LD + 8 * ch);
        }
    }
}

// dk, dv for one (b, kv head, tile of 128 keys). grid (B * KV, ceil(T / 128)), block 256. BQ: queries per tile;
// SKEW: pairs 2, 3 half a step behind (false only for comparison).
template <int HD, int BQ, bool SKEW>
__global__ void __launch_bounds__(ATC8_THREADS, 1)
    attention_backward_dkdv_tc8_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                       const float* lse, const float* delta, int T, int H, int KV, float scale,
                                       float scale_log2) {
    constexpr int LD = HD + 8, LDP = BQ + 8, ROWS = ATC8_KEYS, S = ATC8_STAGES;
    constexpr int QH = BQ / 2, DH = HD / 2;  // a warp's queries (S^T, dP^T) and columns (dK, dV)
    constexpr int QK = QH / 16;              // 16-query k steps per half
    static_assert(QH % 16 == 0 && DH % 16 == 0 && ROWS % BQ == 0, "tile shapes");
    extern __shared__ int4 atc_smem_dkdv8[];
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(atc_smem_dkdv8);  // (ROWS, LD)
    __nv_bfloat16* Vs = Ks + ROWS * LD;                                     // (ROWS, LD)
    __nv_bfloat16* Qs = Vs + ROWS * LD;                                     // S stages x (BQ, LD)
    __nv_bfloat16* dOs = Qs + S * BQ * LD;                                  // S stages x (BQ, LD)
    __nv_bfloat16* Ps = dOs + S * BQ * LD;                                  // (ROWS, LDP): P^T of the tile
    __nv_bfloat16* dSs = Ps + ROWS * LDP;                                   // (ROWS, LDP): dS^T of the tile
    float* lse_s = reinterpret_cast<float*>(dSs + ROWS * LDP);              // S stages x BQ
    float* D_s = lse_s + S * BQ;                                            // S stages x BQ

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int pair = warp / 2, half = warp % 2;
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ROWS;  // the first key tiles see the most queries: scheduled first
    const int kr = 32 * pair;          // the pair's first key row in the tile
    const int kw = k0 + kr;            // the pair's first key
    const int qoff = QH * half, doff = DH * half;
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    // Work items (query head of the group, query tile from the diagonal), as in the 4-warp kernel.
    const int n_q = ceil_div(T - k0, BQ), n_items = group * n_q;
    auto issue = [&](int item, int stage) {
        const int h = kvh * group + item / n_q, q0 = k0 + (item % n_q) * BQ;
        atc_load_tile<HD, BQ, ATC8_THREADS>(Qs + stage * BQ * LD, qkv + (size_t)b * T * stride + (size_t)h * HD,
                                            stride, q0, T);
        atc_load_tile<HD, BQ, ATC8_THREADS>(dOs + stage * BQ * LD, dout + (size_t)b * T * o_stride + (size_t)h * HD,
                                            o_stride, q0, T);
        const size_t row = ((size_t)b * H + h) * T;  // (b, h) row of lse and delta
        atc_load_row_stats<BQ>(lse_s + stage * BQ, D_s + stage * BQ, lse, delta, row, q0, T);
    };

    atc_load_tile<HD, ROWS, ATC8_THREADS>(Ks, k_src, stride, k0, T);
    atc_load_tile<HD, ROWS, ATC8_THREADS>(Vs, v_src, stride, k0, T);
    issue(0, 0);
    atc_cp_async_commit();

    float dk[2][DH / 8][4], dv[2][DH / 8][4];  // keys kw + 16 mt + (g, g+8), columns doff + 8 nt + (c, c+1)
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
        for (int nt = 0; nt < DH / 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) dk[mt][nt][e] = dv[mt][nt][e] = 0.0f;
        }
    }
    const uint32_t k_base = atc_smem_u32(Ks), v_base = atc_smem_u32(Vs);
    const uint32_t p_base = atc_smem_u32(Ps), ds_base = atc_smem_u32(dSs);

    uint32_t pown[2][QK][4], dsown[2][QK][4];  // this warp's P^T, dS^T of its latest tile, as A fragments
    auto tile_q0 = [&](int it) { return k0 + (it % n_q) * BQ; };
    // A query half is live for the pair if some of its queries see some of the pair's keys (warp-uniform).
    auto half_live = [&](int it, int h) { return tile_q0(it) + QH * h + QH - 1 >= kw; };

    // S^T, dP^T, P^T, dS^T of the warp's query half of item it: into pown / dsown and the pair's rows of Ps / dSs.
    auto score_phase = [&](int it) {
        const int stage = it % S, q0 = tile_q0(it);
        if (!half_live(it, half)) return;
        const uint32_t q_base = atc_smem_u32(Qs + stage * BQ * LD), do_base = atc_smem_u32(dOs + stage * BQ * LD);
        float s[2][QH / 8][4], dp[2][QH / 8][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
#pragma unroll
            for (int nt = 0; nt < QH / 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) s[mt][nt][e] = dp[mt][nt][e] = 0.0f;
            }
        }
        // S^T = K Q^T, dP^T = V dO^T over the warp's 32 keys x QH queries.
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t ka[2][4], va[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                atc_ldsm_x4(ka[mt], k_base + atc_off_a<LD>(kr + 16 * mt, 16 * kk, lane));
                atc_ldsm_x4(va[mt], v_base + atc_off_a<LD>(kr + 16 * mt, 16 * kk, lane));
            }
#pragma unroll
            for (int np = 0; np < QK; np++) {
                uint32_t qb[4], ob[4];
                atc_ldsm_x4(qb, q_base + atc_off_b<LD>(qoff + 16 * np, 16 * kk, lane));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    atc_mma(s[mt][2 * np], ka[mt], qb[0], qb[1]);
                    atc_mma(s[mt][2 * np + 1], ka[mt], qb[2], qb[3]);
                }
                atc_ldsm_x4(ob, do_base + atc_off_b<LD>(qoff + 16 * np, 16 * kk, lane));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    atc_mma(dp[mt][2 * np], va[mt], ob[0], ob[1]);
                    atc_mma(dp[mt][2 * np + 1], va[mt], ob[2], ob[3]);
                }
            }
        }
        // P^T, dS^T. Element (mt, nt, e): key kw + 16 mt + g + 8 (e / 2), query q0 + qoff + 8 nt + c + e % 2.
        const bool need_mask = q0 + qoff < kw + 31 || q0 + qoff + QH > T;
        const float* lse_t = lse_s + stage * BQ + qoff;
        const float* D_t = D_s + stage * BQ + qoff;
#pragma unroll
        for (int nt = 0; nt < QH / 8; nt++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int qi = 8 * nt + c + j;
                const float l2 = lse_t[qi] * ATTN_LOG2E, Dq = D_t[qi];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const int e = 2 * r + j;
                        float p = exp2f(fmaf(s[mt][nt][e], scale_log2, -l2));
                        if (need_mask) {
                            const int q = q0 + qoff + qi, key = kw + 16 * mt + g + 8 * r;
                            if (key > q || q >= T) p = 0.0f;  // select, not multiply: p may be inf where masked
                        }
                        s[mt][nt][e] = p;
                        dp[mt][nt][e] = p * (dp[mt][nt][e] - Dq);
                    }
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
#pragma unroll
            for (int kk = 0; kk < QK; kk++) {
                atc_acc_to_a(pown[mt][kk], s[mt][2 * kk], s[mt][2 * kk + 1]);
                atc_acc_to_a(dsown[mt][kk], dp[mt][2 * kk], dp[mt][2 * kk + 1]);
                atc_store_a_frag<LDP>(p_base, kr + 16 * mt, qoff + 16 * kk, pown[mt][kk], lane);
                atc_store_a_frag<LDP>(ds_base, kr + 16 * mt, qoff + 16 * kk, dsown[mt][kk], lane);
            }
        }
    };

    // dV += P^T dO, dK += dS^T Q over item it's BQ queries, the warp's DH columns (after the pair barrier that
    // follows score_phase(it)).
    auto kv_phase = [&](int it) {
        const int stage = it % S;
        const uint32_t q_base = atc_smem_u32(Qs + stage * BQ * LD), do_base = atc_smem_u32(dOs + stage * BQ * LD);
#pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++) {
            const bool mine = kk / QK == half;
            if (!half_live(it, kk / QK)) continue;  // warp-uniform: that half is all zeros
            uint32_t pa[2][4], dsa[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                if (mine) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        pa[mt][i] = pown[mt][kk % QK][i];
                        dsa[mt][i] = dsown[mt][kk % QK][i];
                    }
                } else {
                    atc_ldsm_x4(pa[mt], p_base + atc_off_a<LDP>(kr + 16 * mt, 16 * kk, lane));
                    atc_ldsm_x4(dsa[mt], ds_base + atc_off_a<LDP>(kr + 16 * mt, 16 * kk, lane));
                }
            }
#pragma unroll
            for (int dpr = 0; dpr < DH / 16; dpr++) {
                uint32_t ob[4], qb[4];
                atc_ldsm_x4_trans(ob, do_base + atc_off_bt<LD>(16 * kk, doff + 16 * dpr, lane));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    atc_mma(dv[mt][2 * dpr], pa[mt], ob[0], ob[1]);
                    atc_mma(dv[mt][2 * dpr + 1], pa[mt], ob[2], ob[3]);
                }
                atc_ldsm_x4_trans(qb, q_base + atc_off_bt<LD>(16 * kk, doff + 16 * dpr, lane));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    atc_mma(dk[mt][2 * dpr], dsa[mt], qb[0], qb[1]);
                    atc_mma(dk[mt][2 * dpr + 1], dsa[mt], qb[2], qb[3]);
                }
            }
        }
    };

    // Skew (SKEW): warps w and w + 4 share an SM sub-partition (one tensor unit); in lockstep both would reach the
    // exponentials at once and leave it idle. So pairs 2, 3 (warps 4-7) run half a step behind pairs 0, 1: in
    // iteration it they finish item it - 1 (kv_phase) before scoring item it, so one warp's exponentials overlap the
    // other's mmas. A late pair reads stages it - 1 and it, so tile it + 1 is prefetched into the third stage, one
    // item ahead; Ps / dSs rows are the pair's own, so only its barrier guards them across the iterations.
    const bool late = SKEW && pair >= 2;
    for (int it = 0; it < n_items; it++) {
        atc_cp_async_wait<0>();  // item it landed
        __syncthreads();         // visible to all; every warp done with item it - 1 (early) or it - 2 (late)
        if (it + 1 < n_items) issue(it + 1, (it + 1) % S);
        atc_cp_async_commit();
        if (late && it > 0) {
            kv_phase(it - 1);
            atc_bar_sync(1 + pair, 64);  // the partner is done reading item it - 1's P^T, dS^T
        }
        score_phase(it);
        atc_bar_sync(1 + pair, 64);  // the partner's P^T, dS^T half is in smem
        if (!late) kv_phase(it);
    }
    if (late) kv_phase(n_items - 1);
    atc_bar_sync(1 + pair, 64);  // the partner is done reading the pair's K, V rows: they stage the results

    __nv_bfloat16* dqkv_b = dqkv + (size_t)b * T * stride;
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        const int r = kr + 16 * mt;
        atc_store_warp_block<LD, DH / 8>(dqkv_b + (size_t)(H + kvh) * HD + doff, stride, Ks + r * LD + doff, dk[mt],
                                         scale, k0 + r, T, lane);
        atc_store_warp_block<LD, DH / 8>(dqkv_b + (size_t)(H + KV + kvh) * HD + doff, stride, Vs + r * LD + doff,
                                         dv[mt], 1.0f, k0 + r, T, lane);
    }
}

template <int HD, int MT, int BN>
constexpr size_t attention_backward_dq_tc_smem_bytes() {
    return sizeof(__nv_bfloat16) * (HD + 8) * (2 * atc_rows<MT>() + 4 * BN);
}

// dq for one (b, h, tile of 64 MT queries). grid (B * H, ceil(T / (64 MT))), block 128.
// MT: m16 query tiles per warp; BN: keys per streamed K/V tile.
template <int HD, int MT, int BN>
__global__ void __launch_bounds__(ATC_THREADS, 2)
    attention_backward_dq_tc_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                    const float* lse, const float* delta, int T, int H, int KV, float scale,
                                    float scale_log2) {
    constexpr int LD = HD + 8, ROWS = atc_rows<MT>(), WR = 16 * MT;
    extern __shared__ int4 atc_smem_dq[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(atc_smem_dq);  // (ROWS, LD)
    __nv_bfloat16* dOs = Qs + ROWS * LD;                                 // (ROWS, LD)
    __nv_bfloat16* Ks = dOs + ROWS * LD;                                 // 2 stages x (BN, LD)
    __nv_bfloat16* Vs = Ks + 2 * BN * LD;                                // 2 stages x (BN, LD)

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;
    const int qw = q0 + WR * warp;
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    const int n_tiles = ceil_div(min(q0 + ROWS, T), BN);
    atc_load_tile<HD, ROWS>(Qs, qkv + (size_t)b * T * stride + (size_t)h * HD, stride, q0, T);
    atc_load_tile<HD, ROWS>(dOs, dout + (size_t)b * T * o_stride + (size_t)h * HD, o_stride, q0, T);
    atc_load_tile<HD, BN>(Ks, k_src, stride, 0, T);
    atc_load_tile<HD, BN>(Vs, v_src, stride, 0, T);
    atc_cp_async_commit();

    float lse2[MT][2], D[MT][2];  // rows g, g+8 of each m tile; finite placeholders past T (never stored)
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int q = qw + 16 * mt + g + 8 * r;
            lse2[mt][r] = q < T ? lse[(size_t)blockIdx.x * T + q] * ATTN_LOG2E : 0.0f;
            D[mt][r] = q < T ? delta[(size_t)blockIdx.x * T + q] : 0.0f;
        }
    }
    float dq[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nt = 0; nt < HD / 8; nt++) dq[mt][nt][0] = dq[mt][nt][1] = dq[mt][nt][2] = dq[mt][nt][3] = 0.0f;
    }
    const uint32_t q_base = atc_smem_u32(Qs), do_base = atc_smem_u32(dOs);

    for (int j = 0; j < n_tiles; j++) {
        const int stage = j % 2;
        if (j + 1 < n_tiles) {
            atc_load_tile<HD, BN>(Ks + (1 - stage) * BN * LD, k_src, stride, (j + 1) * BN, T);
            atc_load_tile<HD, BN>(Vs + (1 - stage) * BN * LD, v_src, stride, (j + 1) * BN, T);
            atc_cp_async_commit();
            atc_cp_async_wait<1>();
        } else {
            atc_cp_async_wait<0>();
        }
        __syncthreads();

        const int k0 = j * BN;
        if (k0 <= qw + WR - 1) {
            const uint32_t k_base = atc_smem_u32(Ks + stage * BN * LD), v_base = atc_smem_u32(Vs + stage * BN * LD);
            float s[MT][BN / 8][4], dp[MT][BN / 8][4];
            atc_two_products<HD, MT, BN, LD>(s, dp, q_base, do_base, k_base, v_base, WR * warp, lane);
            // dS in place of dP. Element (mt, nt, e): query qw + 16 mt + g + 8 (e / 2), key k0 + 8 nt + c + e % 2.
            // Diagonal tile. Keys >= T need no test of their own: they are after every valid query.
            const bool need_mask = k0 + BN - 1 > qw;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int nt = 0; nt < BN / 8; nt++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = e / 2;
                        float p = exp2f(fmaf(s[mt][nt][e], scale_log2, -lse2[mt][r]));
                        if (need_mask && k0 + 8 * nt + c + e % 2 > qw + 16 * mt + g + 8 * r) p = 0.0f;
                        dp[mt][nt][e] = p * (dp[mt][nt][e] - D[mt][r]);
                    }
                }
            }
            // dQ += dS K: dS from the accumulators, the K tile as B.
            atc_acc_times_bt<HD, MT, BN, LD>(dq, dp, k_base, lane);
        }
        __syncthreads();
    }

    // The warp's own Q rows are dead now (each warp reads only its WR rows of Qs): they stage the result.
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int rw = WR * warp + 16 * mt;
        atc_store_warp_rows<HD>(dqkv + (size_t)b * T * stride + (size_t)h * HD, stride, Qs + rw * LD, dq[mt], scale,
                                scale, q0 + rw, T, lane);
    }
}

#endif  // !ENABLE_FP32

// ================================================================================================================
// Host API
// ================================================================================================================

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
    if ((size_t)T > (size_t)ATTN_FIXED * 65535) {
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

// D (B, H, T) = rowsum(dout * out): the first step of both backward paths.
inline void attention_delta(float* delta, const floatX* dout, const floatX* out, int B, int T, int H, int hd,
                            cudaStream_t stream) {
    const size_t rows = (size_t)B * H * T;
    const int warps_per_block = 8;
    attention_delta_kernel<<<(unsigned)ceil_div(rows, (size_t)warps_per_block), 32 * warps_per_block, 0, stream>>>(
        delta, dout, out, B, T, H, hd);
    cudaCheckLaunch();
}

// ----------------------------------------------------------------------------------------------------------------
// Scalar path launchers

template <int HDP>
inline void attention_forward_hdp(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd,
                                  cudaStream_t stream) {
    static bool smem_set = false;
    const size_t smem = attention_forward_smem_bytes<HDP>();
    attention_set_smem(attention_forward_kernel<HDP>, smem, smem_set);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)hd);
    dim3 grid(B * H, ceil_div(T, ATTN_FIXED));
    attention_forward_kernel<HDP><<<grid, ATTN_THREADS, smem, stream>>>(out, lse, qkv, T, H, KV, hd, scale_log2);
    cudaCheckLaunch();
}

// The scalar forward (any precision, head_dim 1..128). Same contract as attention_forward.
inline void attention_forward_scalar(floatX* out, float* lse, const floatX* qkv, int B, int T, int n_heads,
                                     int n_kv_heads, int head_dim, cudaStream_t stream) {
    attention_check_args("attention_forward", B, T, n_heads, n_kv_heads, head_dim);
    if (head_dim <= 64) attention_forward_hdp<64>(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
    else attention_forward_hdp<128>(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
}

template <int HDP>
inline void attention_backward_hdp(floatX* dqkv, const float* delta, const floatX* dout, const floatX* qkv,
                                   const float* lse, int B, int T, int H, int KV, int hd, cudaStream_t stream) {
    static bool dq_smem_set = false, dkdv_smem_set = false;
    const size_t dq_smem = attention_backward_dq_smem_bytes<HDP>();
    const size_t dkdv_smem = attention_backward_dkdv_smem_bytes<HDP>();
    attention_set_smem(attention_backward_dq_kernel<HDP>, dq_smem, dq_smem_set);
    attention_set_smem(attention_backward_dkdv_kernel<HDP>, dkdv_smem, dkdv_smem_set);
    const float scale = 1.0f / sqrtf((float)hd), scale_log2 = scale * ATTN_LOG2E;
    dim3 dq_grid(B * H, ceil_div(T, ATTN_FIXED));
    attention_backward_dq_kernel<HDP><<<dq_grid, ATTN_THREADS, dq_smem, stream>>>(dqkv, dout, qkv, lse, delta, T, H,
                                                                                   KV, hd, scale, scale_log2);
    cudaCheckLaunch();
    dim3 dkdv_grid(B * KV, ceil_div(T, ATTN_FIXED));
    attention_backward_dkdv_kernel<HDP><<<dkdv_grid, ATTN_THREADS, dkdv_smem, stream>>>(
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
        attention_backward_hdp<64>(dqkv, delta_scratch, dout, qkv, lse, B, T, n_heads, n_kv_heads, head_dim, stream);
    } else {
        attention_backward_hdp<128>(dqkv, delta_scratch, dout, qkv, lse, B, T, n_heads, n_kv_heads, head_dim, stream);
    }
}

// ----------------------------------------------------------------------------------------------------------------
// Tensor-core path launchers (bf16 builds only)

#if !defined(ENABLE_FP32)
// The tensor-core kernels cover exactly these head dims (no column padding: every smem row is HD + 8 elements).
inline bool attention_tc_supported(int head_dim) { return head_dim == 64 || head_dim == 128; }

// The kernels move 16-byte chunks: every row start must be 16-byte aligned. Row strides are multiples of 8 elements
// (head_dim is), so this holds iff the base pointers are 16-byte aligned (cudaMalloc gives 256).
inline void attention_tc_check_aligned(const char* who, const void* p) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
        fprintf(stderr, "%s: tensor-core path needs 16-byte aligned tensors, got %p\n", who, p);
        fail_exit();
    }
}

// One tile configuration of the forward: MT m16 query tiles per warp (64 MT queries per CTA), BN keys per tile.
// attention_forward_tc picks the best measured one per head dim; dev/cuda benchmarks also call others.
template <int HD, int MT, int BN>
inline void attention_forward_tc_cfg(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV,
                                     cudaStream_t stream) {
    static bool smem_set = false;
    const size_t smem = attention_forward_tc_smem_bytes<HD, MT, BN>();
    attention_set_smem(attention_forward_tc_kernel<HD, MT, BN>, smem, smem_set);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)HD);
    dim3 grid(B * H, ceil_div(T, atc_rows<MT>()));
    attention_forward_tc_kernel<HD, MT, BN><<<grid, ATC_THREADS, smem, stream>>>(out, lse, qkv, T, H, KV, scale_log2);
    cudaCheckLaunch();
}

// The tensor-core forward: bf16, head_dim 64 or 128. Same contract as attention_forward.
inline void attention_forward_tc(floatX* out, float* lse, const floatX* qkv, int B, int T, int n_heads,
                                 int n_kv_heads, int head_dim, cudaStream_t stream) {
    attention_check_args("attention_forward_tc", B, T, n_heads, n_kv_heads, head_dim);
    if (!attention_tc_supported(head_dim)) {
        fprintf(stderr, "attention_forward_tc: head_dim %d unsupported (64 or 128)\n", head_dim);
        fail_exit();
    }
    attention_tc_check_aligned("attention_forward_tc", out);
    attention_tc_check_aligned("attention_forward_tc", qkv);
    if (head_dim == 64) {
        attention_forward_tc_cfg<64, ATC_FWD_MT_64, ATC_FWD_BN_64>(out, lse, qkv, B, T, n_heads, n_kv_heads, stream);
    } else {
        attention_forward_tc_cfg<128, ATC_FWD_MT_128, ATC_FWD_BN_128>(out, lse, qkv, B, T, n_heads, n_kv_heads,
                                                                      stream);
    }
}

// One tile configuration of the backward (D included): dQ kernel with QMT m16 query tiles per warp and QBN keys per
// tile; dK/dV kernel with KW warps: KW 4, the 4-warp kernel with KMT m16 key tiles per warp and KBQ queries per tile;
// KW 8, the 8-warp kernel (128 keys per CTA, KMT unused) with KBQ queries per tile.
template <int HD, int QMT, int QBN, int KMT, int KBQ, int KW = 4, bool KSKEW = true>
inline void attention_backward_tc_cfg(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                      const floatX* out, const float* lse, int B, int T, int H, int KV,
                                      cudaStream_t stream) {
    static_assert(KW == 4 || KW == 8, "dK/dV kernel: 4 or 8 warps");
    static bool dq_smem_set = false, dkdv_smem_set = false;
    const size_t dq_smem = attention_backward_dq_tc_smem_bytes<HD, QMT, QBN>();
    attention_set_smem(attention_backward_dq_tc_kernel<HD, QMT, QBN>, dq_smem, dq_smem_set);
    attention_delta(delta, dout, out, B, T, H, HD, stream);
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    // dK/dV first: its CTAs are fewer (B KV per key tile) and longer; both kernels only read what they share.
    if constexpr (KW == 4) {
        const size_t dkdv_smem = attention_backward_dkdv_tc_smem_bytes<HD, KMT, KBQ>();
        attention_set_smem(attention_backward_dkdv_tc_kernel<HD, KMT, KBQ>, dkdv_smem, dkdv_smem_set);
        dim3 dkdv_grid(B * KV, ceil_div(T, atc_rows<KMT>()));
        attention_backward_dkdv_tc_kernel<HD, KMT, KBQ><<<dkdv_grid, ATC_THREADS, dkdv_smem, stream>>>(
            dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    } else {
        const size_t dkdv_smem = attention_backward_dkdv_tc8_smem_bytes<HD, KBQ>();
        attention_set_smem(attention_backward_dkdv_tc8_kernel<HD, KBQ, KSKEW>, dkdv_smem, dkdv_smem_set);
        dim3 dkdv_grid(B * KV, ceil_div(T, ATC8_KEYS));
        attention_backward_dkdv_tc8_kernel<HD, KBQ, KSKEW><<<dkdv_grid, ATC8_THREADS, dkdv_smem, stream>>>(
            dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    }
    cudaCheckLaunch();
    dim3 dq_grid(B * H, ceil_div(T, atc_rows<QMT>()));
    attention_backward_dq_tc_kernel<HD, QMT, QBN><<<dq_grid, ATC_THREADS, dq_smem, stream>>>(
        dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
}

// The tensor-core backward: bf16, head_dim 64 or 128. Same contract as attention_backward.
inline void attention_backward_tc(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                                  const floatX* out, const float* lse, int B, int T, int n_heads, int n_kv_heads,
                                  int head_dim, cudaStream_t stream) {
    attention_check_args("attention_backward_tc", B, T, n_heads, n_kv_heads, head_dim);
    if (!attention_tc_supported(head_dim)) {
        fprintf(stderr, "attention_backward_tc: head_dim %d unsupported (64 or 128)\n", head_dim);
        fail_exit();
    }
    attention_tc_check_aligned("attention_backward_tc", dqkv);
    attention_tc_check_aligned("attention_backward_tc", dout);
    attention_tc_check_aligned("attention_backward_tc", qkv);
    if (head_dim == 64) {
        attention_backward_tc_cfg<64, ATC_DQ_MT_64, ATC_DQ_BN_64, ATC_KV_MT_64, ATC_KV_BQ_64, ATC_KV_W_64>(
            dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, stream);
    } else {
        attention_backward_tc_cfg<128, ATC_DQ_MT_128, ATC_DQ_BN_128, ATC_KV_MT_128, ATC_KV_BQ_128, ATC_KV_W_128>(
            dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, stream);
    }
}
#endif  // !ENABLE_FP32
#include "attention_hopper.cuh"  // the Hopper (sm_90a, wgmma) kernels; uses the helpers above
// ----------------------------------------------------------------------------------------------------------------
// Public entry points: the Hopper wgmma kernels where they apply (bf16, sm_90a; forward head_dim 128, backward 64 and
// 128), then the tensor-core path (bf16, head_dim 64 or 128), the scalar path otherwise.

// out (B, T, H hd) and lse (B, H, T) fp32, both OVERWRITTEN, from qkv (B, T, (H + 2 KV) hd).
inline void attention_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int n_heads, int n_kv_heads,
                              int head_dim, cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    if (attention_forward_hopper(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream)) return;
    if (attention_tc_supported(head_dim)) {
        attention_forward_tc(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
        return;
    }
#endif
    attention_forward_scalar(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
}

// dqkv (B, T, (H + 2 KV) hd) OVERWRITTEN (query, key and value parts all written), from dout and out (B, T, H hd),
// qkv, and the forward's lse (B, H, T). delta_scratch: (B, H, T) fp32 scratch, overwritten with rowsum(dout * out).
// Deterministic: every element has one writer and a fixed summation order.
inline void attention_backward(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                               const floatX* out, const float* lse, int B, int T, int n_heads, int n_kv_heads,
                               int head_dim, cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    if (attention_backward_hopper(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, head_dim,
                                  stream)) {
        return;
    }
    if (attention_tc_supported(head_dim)) {
        attention_backward_tc(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, head_dim, stream);
        return;
    }
#endif
    attention_backward_scalar(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, head_dim, stream);
}
