// v7 of dev/cuda/attention_backward.cu: the one-pass causal GQA attention backward of v6 (Hopper, sm_90a, bf16 build,
// head_dim 64 and 128), with dQ accumulated in FIXED POINT, so the order of the additions does not matter and no CTA
// ever waits for another. Used by attention_backward.cu (validation, timing). Same contract as attention_backward (llmc/attention.cuh), plus caller scratch
// (attention_backward_v7_scratch_bytes) that is ZEROED ONCE when allocated: every call leaves it zeroed again.
//
// Why fixed point: v6 summed the fp32 dQ partials of the key tiles in a fixed order (deterministic), and the waiting
// that order implies made it 2.5x slower than v5; without any dQ accumulation the same kernel runs at 305 / 562 / 598
// TFLOP/s on an H100 against v5's 216 / 337 / 345. Integer addition is associative: if every partial is rounded to a
// fixed grid and summed as integers, any order gives the same bits.
//
// The grid, per query row i of head h: every partial sum of dq_i = sum_j dS_ij k_j (any subset of key tiles) is
// bounded by sum_j |dS_ij| |k_j|_inf, and with dS_ij = P_ij (dP_ij - D_i), sum_j P_ij = 1, |dP_ij| = |do_i . v_j| <=
// |do_i|_2 Vmax and |D_i| = |do_i . o_i| <= |do_i|_2 Vmax (o_i is a convex combination of the v_j):
//   |partial sums of dq_i| <= 2 |do_i|_2 Vmax Kmax = bound_i,   Vmax = max_j |v_j|_2,  Kmax = max_j |k_j|_inf
// (maxima over the whole qkv tensor: a looser bound costs only precision we have plenty of). With a factor 2 for the
// roundings (bf16 dS, fp32 wgmma sums), the row's scale 2^s_i, s_i = HEADROOM - e_i where bound_i < 2^e_i, keeps
// every partial sum below 2^HEADROOM in magnitude: HEADROOM = 61 in int64 (ACC = long long), 29 in int32. Each partial
// is rounded to the nearest integer after scaling: the absolute error of dq_i is at most (number of key tiles) / 2
// units of 2^-s_i, i.e. bound_i 2^-(HEADROOM - 1) per key tile, far below bf16's rounding of dq in int64.
//
// Steps: attention_v7_bounds (Kmax, Vmax: maxima are order-free, so atomicMax keeps it deterministic), then
// attention_v7_delta (D_i = do_i . o_i as attention_delta, and the row's multiplier 2^s_i), then the kernel.
//
// Kernel: v6's (CTA = 128 keys x (kv head, batch), 2 warpgroups of 64 keys; items (query tile of 64, query head);
// per item S^T, dP^T, P^T, dV, dS^T, dK; dS^T into smem; the dQ partial = dS K with warpgroup w taking columns
// w hd / 2 ..) with STAGES cp.async stages of Q, dO (prefetch distance STAGES - 1), then per item and warpgroup:
//   (a) thread 0 of the warpgroup waits for its bulk reduce of the previous item (cp.async.bulk.wait_group 0:
//       complete, and the staging tile read), publishes that item (fence.proxy.async.global, threadfence, atomicAdd on
//       the tile's counter) and learns whether it was the last of the tile's contributors (q0 / 128 + 1 key tiles);
//       warpgroup barrier;
//   (b) if it was the last: the warpgroup converts that accumulator tile to bf16 dq (times 2^-s_i / sqrt(hd)), writes
//       it into dqkv, zeroes the tile and its counter (the accumulator is left as found);
//   (c) the partial times 2^s_i, rounded to ACC, into the warpgroup's staging tile in FRAGMENT ORDER: the pair of
//       values dq[2 kp], dq[2 kp + 1] of thread t at pair index 128 kp + t (each warp's stores contiguous, no bank
//       conflicts); fence.proxy.async.shared::cta; warpgroup barrier;
//   (d) thread 0 issues ONE bulk reduce-add of the whole tile (64 x hd / 2 values, contiguous: the accumulator keeps
//       every (b, h, query tile, column half) tile in the same fragment order) and commits it.
// After the last item, (a) and (b) once more. Nothing waits on another CTA: no ordering, no deadlock. (A first
// version issued one bulk reduce per row of the tile, 64 copies per item: the same speed.)
//
// Scratch: the accumulator (B, H, ceil(T / 64), 2 halves, 64 x hd / 2) ACC and counters (one int per tile), both
// zero at entry and left zero; then the row multipliers (B, H, T) fp32 and Kmax, Vmax (2 x uint32, float bits),
// rewritten by every call. The layout depends on (B, T, H, hd): a caller that changes the shape re-zeroes it.
//
// Knobs (compile time, attention_backward.cu's header has the measurements): V7_ACC (long long, or int: 2^-29 of the
// bound per partial), V7_STAGES_128 (Q / dO stages at hd 128: 2 fit beside the int64 staging tiles),
// V7_EXPERIMENT=1 (timing only: no completion wait, no counting, no conversion; dq wrong).
#pragma once

#include <type_traits>

#include "../../llmc/attention.cuh"
#include "../../llmc/ptx.cuh"
#include "attention_backward_v6.cuh"

#if !defined(ENABLE_FP32)

constexpr int V7_QUERIES = 64;  // queries per item, and per accumulator tile
#ifndef V7_EXPERIMENT
#define V7_EXPERIMENT 0
#endif

// Bulk async reduce-add of `bytes` (a multiple of 16) from shared memory to global memory (both 16-byte aligned); L2
// performs the adds. One bulk group per commit; completion by v7_bulk_wait.
template <typename ACC>
__device__ __forceinline__ void v7_bulk_reduce_add(ACC* dst, uint32_t src, uint32_t bytes) {
    static_assert(sizeof(ACC) == 4 || sizeof(ACC) == 8, "int32 or int64 accumulators");
    if constexpr (sizeof(ACC) == 8) {
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;\n" ::"l"(dst),
                     "r"(src), "r"(bytes)
                     : "memory");
    } else {
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%0], [%1], %2;\n" ::"l"(dst),
                     "r"(src), "r"(bytes)
                     : "memory");
    }
}
__device__ __forceinline__ void v7_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until every bulk group this thread committed is complete (its writes performed, its smem source read).
__device__ __forceinline__ void v7_bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Orders this thread's completed async-proxy global writes before its later generic-proxy operations.
__device__ __forceinline__ void v7_fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

template <typename ACC>
__host__ __device__ constexpr int v7_headroom() {
    return sizeof(ACC) == 8 ? 61 : 29;
}
template <typename ACC>
__device__ __forceinline__ ACC v7_to_fixed(float x) {
    if constexpr (sizeof(ACC) == 8) {
        return __float2ll_rn(x);
    } else {
        return __float2int_rn(x);
    }
}
template <typename ACC>
__device__ __forceinline__ float v7_from_fixed(ACC v) {
    if constexpr (sizeof(ACC) == 8) {
        return __ll2float_rn(v);
    } else {
        return __int2float_rn(v);
    }
}

inline size_t v7_align(size_t bytes) { return (bytes + 255) / 256 * 256; }
template <typename ACC>
inline size_t attention_backward_v7_acc_bytes(int B, int T, int H, int hd) {
    return v7_align((size_t)B * H * ceil_div(T, V7_QUERIES) * V7_QUERIES * hd * sizeof(ACC));
}
inline size_t attention_backward_v7_counter_bytes(int B, int T, int H) {
    return v7_align((size_t)B * H * ceil_div(T, V7_QUERIES) * 2 * sizeof(int));
}
inline size_t attention_backward_v7_mult_bytes(int B, int T, int H) { return v7_align((size_t)B * H * T * sizeof(float)); }
template <typename ACC>
inline size_t attention_backward_v7_scratch_bytes(int B, int T, int H, int hd) {
    return attention_backward_v7_acc_bytes<ACC>(B, T, H, hd) + attention_backward_v7_counter_bytes(B, T, H) +
           attention_backward_v7_mult_bytes(B, T, H) + 256;
}

// Kmax = max |k|_inf and Vmax = max |v_row|_2 over every (b, t, kv head) of qkv, into maxes[0], maxes[1] (float bits;
// zeroed by the caller). One warp per row, a block max, one atomicMax per block and value.
__global__ void attention_v7_bounds_kernel(unsigned int* maxes, const floatX* qkv, int B, int T, int H, int KV,
                                           int hd) {
    __shared__ float kmax_s[8], vmax_s[8];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const size_t rows = (size_t)B * T * KV;
    float kmax = 0.0f, vmax = 0.0f;
    for (size_t row = (size_t)blockIdx.x * 8 + warp; row < rows; row += (size_t)gridDim.x * 8) {
        const size_t bt = row / KV, kvh = row % KV;
        const floatX* k = qkv + bt * (H + 2 * KV) * hd + (H + kvh) * hd;
        const floatX* v = k + (size_t)KV * hd;
        float ka = 0.0f, vs = 0.0f;
        for (int d = lane; d < hd; d += 32) {
            ka = fmaxf(ka, fabsf(to_float(k[d])));
            const float x = to_float(v[d]);
            vs += x * x;
        }
        kmax = fmaxf(kmax, warp_reduce_max(ka));
        vmax = fmaxf(vmax, sqrtf(warp_reduce_sum(vs)));
    }
    if (lane == 0) {
        kmax_s[warp] = kmax;
        vmax_s[warp] = vmax;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < 8; w++) {
            kmax = fmaxf(kmax, kmax_s[w]);
            vmax = fmaxf(vmax, vmax_s[w]);
        }
        atomicMax(maxes, __float_as_uint(kmax));  // non-negative floats order as their bits
        atomicMax(maxes + 1, __float_as_uint(vmax));
    }
}

// D (B, H, T) = rowsum(dout * out) as attention_delta, and each row's multiplier 2^s_i (see the file comment).
template <typename ACC>
__global__ void attention_v7_delta_kernel(float* delta, float* row_mult, const floatX* dout, const floatX* out,
                                          const unsigned int* maxes, int B, int T, int H, int hd) {
    const int lane = threadIdx.x % 32;
    const size_t row = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // (b, h, t) flattened
    if (row >= (size_t)B * H * T) return;
    const int t = (int)(row % T), h = (int)((row / T) % H), b = (int)(row / ((size_t)T * H));
    const size_t base = ((size_t)b * T + t) * H * hd + (size_t)h * hd;
    float sum = 0.0f, sq = 0.0f;
    for (int d = lane; d < hd; d += 32) {
        const float g = to_float(dout[base + d]);
        sum += g * to_float(out[base + d]);
        sq += g * g;
    }
    sum = warp_reduce_sum(sum);
    sq = warp_reduce_sum(sq);
    if (lane == 0) {
        delta[row] = sum;
        // bound_i with a factor 2 for roundings; 0 (a zero gradient row: every partial is 0) or non-finite: scale 1
        const float bound = 4.0f * sqrtf(sq) * __uint_as_float(maxes[1]) * __uint_as_float(maxes[0]);
        int s = 0;
        if (bound > 0.0f && isfinite(bound)) {
            int e;
            frexpf(bound, &e);  // bound = m 2^e, m in [0.5, 1): bound < 2^e
            s = min(max(v7_headroom<ACC>() - e, -126), 126);
        }
        row_mult[row] = __int_as_float((s + 127) << 23);  // 2^s, exactly
    }
}

template <int HD, int STAGES, typename ACC>
constexpr size_t backward_v7_smem_bytes() {
    constexpr int BQ = V7_QUERIES;
    return sizeof(__nv_bfloat16) * (HD * (2 * WGMMA_ROWS + 2 * STAGES * BQ) + WGMMA_ROWS * BQ) +
           sizeof(float) * 2 * STAGES * BQ + BQ * HD * sizeof(ACC) + 16 + 1024;
}

// Converts a warpgroup's finished accumulator tile (head h, queries q0 .., columns HD / 2 wg ..; `tile`: its
// 64 x HD / 2 values in fragment order, see the kernel) to bf16 dq in dqkv, and zeroes it. 128 threads, each the
// values its own fragment positions stand for.
template <int HD, typename ACC>
__device__ __forceinline__ void backward_v7_convert(ACC* tile, const float* row_mult, __nv_bfloat16* dqkv,
                                                    size_t stride, int b, int h, int q0, int T, int H, int wg,
                                                    float scale) {
    constexpr int HALF = HD / 2;
    const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32, g = lane / 4, c = 2 * (lane % 4);
    float mult[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int q = q0 + 16 * warp + g + 8 * r;
        mult[r] = q < T ? scale / row_mult[((size_t)b * H + h) * T + q] : 0.0f;  // 2^-s_i exact
    }
    using Pair = typename std::conditional<sizeof(ACC) == 8, longlong2, int2>::type;
#pragma unroll 4
    for (int kp = 0; kp < HALF / 4; kp++) {  // pair kp: row 16 warp + g + 8 (kp % 2), column 8 (kp / 2) + c
        Pair* src = reinterpret_cast<Pair*>(tile) + kp * 128 + t;
        const Pair v = __ldcg(src);  // L2: where the bulk reduces landed
        const int r = kp % 2, q = q0 + 16 * warp + g + 8 * r;
        if (q < T) {
            __nv_bfloat16* dst = dqkv + ((size_t)b * T + q) * stride + (size_t)h * HD + HALF * wg + 8 * (kp / 2) + c;
            *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v7_from_fixed<ACC>(v.x) * mult[r],
                                                                            v7_from_fixed<ACC>(v.y) * mult[r]);
        }
        Pair zero;
        zero.x = 0;
        zero.y = 0;
        __stcg(src, zero);
    }
}

// dK, dV of one (b, kv head, tile of 128 keys) and its keys' dQ contributions. grid (B * KV, ceil(T / 128)), block 256.
template <int HD, int STAGES, typename ACC>
__global__ void __launch_bounds__(WGMMA_THREADS, 1)
    backward_v7_kernel(__nv_bfloat16* dqkv, ACC* dq_acc, int* dq_counters, const float* row_mult,
                       const __nv_bfloat16* dout, const __nv_bfloat16* qkv, const float* lse, const float* delta, int T,
                       int H, int KV, float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = WGMMA_ROWS, S = STAGES, BQ = V7_QUERIES, HALF = HD / 2;
    constexpr int KBYTES = ROWS * HD * 2, QBYTES = BQ * HD * 2, DSBYTES = ROWS * BQ * 2;
    constexpr int TILE_VALUES = 64 * HALF, STAGE_TILE = TILE_VALUES * (int)sizeof(ACC);
    static_assert(S >= 2, "prefetch distance S - 1 >= 1");
    static_assert(HD == 64 || HD == 128, "dQ halves are wgmma m64n32 / m64n64");
    extern __shared__ uint8_t wgmma_smem[];
    const uint32_t smem = (smem_addr(wgmma_smem) + 1023u) & ~1023u;  // swizzled tiles: 1024-byte aligned
    const uint32_t k_sm = smem;                  // K (128 x HD), swizzled
    const uint32_t v_sm = k_sm + KBYTES;         // V (128 x HD)
    const uint32_t q_sm = v_sm + KBYTES;         // S stages x Q (BQ x HD)
    const uint32_t do_sm = q_sm + S * QBYTES;    // S stages x dO (BQ x HD)
    const uint32_t ds_sm = do_sm + S * QBYTES;   // dS^T (128 keys x BQ queries), swizzled
    const uint32_t acc_sm = ds_sm + DSBYTES;     // 2 warpgroups x 64 x HALF ACC: the fixed-point partials
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));
    float* lse_s = reinterpret_cast<float*>(smem_ptr + (acc_sm - smem) + 2 * STAGE_TILE);  // S stages x BQ
    float* D_s = lse_s + S * BQ;                                                             // S stages x BQ
    int* last_s = reinterpret_cast<int*>(D_s + S * BQ);                                      // per warpgroup

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, g = (threadIdx.x % 32) / 4;
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int j = blockIdx.y, k0 = j * ROWS;
    const int kwg = k0 + 64 * wg;          // the warpgroup's first key
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;

    // Items: (query tile from the last down to the diagonal, query head of the group), as v6 (no order needed here).
    const int n_qt = ceil_div(T, BQ), n_items = group * (n_qt - k0 / BQ);
    auto item_head = [&](int item) { return kvh * group + item % group; };
    auto item_q0 = [&](int item) { return (n_qt - 1 - item / group) * BQ; };
    auto issue = [&](int item) {
        const int stage = item % S, h = item_head(item), q0 = item_q0(item);
        wgmma_load_tile<HD, BQ>(q_sm + stage * QBYTES, qkv + (size_t)b * T * stride + (size_t)h * HD, stride, q0, T);
        wgmma_load_tile<HD, BQ>(do_sm + stage * QBYTES, dout + (size_t)b * T * o_stride + (size_t)h * HD, o_stride,
                                q0, T);
        attention_load_row_stats<BQ>(lse_s + stage * BQ, D_s + stage * BQ, lse, delta, ((size_t)b * H + h) * T, q0, T);
    };

    wgmma_load_tile<HD, ROWS>(k_sm, qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD, stride, k0, T);
    wgmma_load_tile<HD, ROWS>(v_sm, qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD, stride, k0, T);
#pragma unroll
    for (int s = 0; s < S - 1; s++) {
        if (s < n_items) issue(s);
        cp_async_commit();
    }

    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) dk[i] = dv[i] = 0.0f;
    const uint32_t k_cols = (HALF * wg / 64) * (ROWS * 128) + (HALF * wg % 64) * 2;
    float dq[HALF / 2];
    const uint32_t stage_tile = acc_sm + wg * STAGE_TILE;
    uint8_t* stage_ptr = smem_ptr + (stage_tile - smem);

    // The previous item of this warpgroup whose bulk reduces are in flight (published at the next (a)).
    int prev_h = -1, prev_q0 = 0;
    auto tile_index = [&](int h, int q0) { return (((size_t)b * H + h) * n_qt + q0 / BQ) * 2 + wg; };
    auto publish_previous = [&]() {
#if V7_EXPERIMENT == 1  // timing only: the staging read, no completion wait, no counting (results wrong)
        if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        named_barrier_sync<128>(1 + wg);
        return;
#endif
        if (threadIdx.x % 128 == 0) {
            v7_bulk_wait();  // this thread issued the warpgroup's bulk reduces
            int last = 0;
            if (prev_h >= 0) {
                v7_fence_proxy_async_global();
                __threadfence();
                int* counter = dq_counters + tile_index(prev_h, prev_q0);
                last = atomicAdd(counter, 1) == prev_q0 / ROWS;  // q0 / 128 + 1 contributors
                if (last) *counter = 0;                          // nobody else touches it in this launch
            }
            last_s[wg] = last;
        }
        named_barrier_sync<128>(1 + wg);
        if (last_s[wg]) {
            __threadfence();
            backward_v7_convert<HD, ACC>(dq_acc + tile_index(prev_h, prev_q0) * TILE_VALUES, row_mult, dqkv, stride,
                                         b, prev_h, prev_q0, T, H, wg, scale);
        }
    };

    for (int it = 0; it < n_items; it++) {
        // Committed so far: items 0 .. it + S - 2; all but the newest S - 2 done: item it landed.
        cp_async_wait<S - 2>();
        fence_proxy_async_shared();
        // Item it visible to all; every wgmma of item it - 1 was waited for, so its stage (refilled with item
        // it + S - 1) and the dS^T tile are free.
        __syncthreads();
        if (it + S - 1 < n_items) issue(it + S - 1);
        cp_async_commit();

        const int stage = it % S, h = item_head(it), q0 = item_q0(it);
        const uint32_t q_st = q_sm + stage * QBYTES, do_st = do_sm + stage * QBYTES;
        const bool upper_active = q0 + BQ - 1 >= k0 + 64;  // warpgroup 1 has a key at or before the last query
        const bool active = wg == 0 || upper_active;
        // this thread's dQ rows' multipliers, needed after the item's matmuls
        float mult[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int q = q0 + 16 * warp + g + 8 * r;
            mult[r] = q < T ? row_mult[((size_t)b * H + h) * T + q] : 0.0f;
        }
        if (active) {
            backward_onepass_item<HD, BQ>(dk, dv, k_sm, v_sm, q_st, do_st, smem_ptr + (ds_sm - smem),
                                          lse_s + stage * BQ, D_s + stage * BQ, kwg, q0, T, scale_log2);
        }
        __syncthreads();  // both warpgroups' dS^T rows are in the tile

        if (upper_active) {
            backward_onepass_dq<ROWS / 16>(dq, ds_sm, k_sm + k_cols);
        } else {
            backward_onepass_dq<64 / 16>(dq, ds_sm, k_sm + k_cols);
        }

        // (a), (b): the previous item published (and converted, if this was its last contribution); staging free.
        publish_previous();
        // (c) the partial in fixed point into the staging tile, in fragment order: the pair dq[2 kp], dq[2 kp + 1]
        // (row 16 warp + g + 8 (kp % 2), columns 8 (kp / 2) + c, + 1) of thread t at pair index kp * 128 + t, so a
        // warp's stores are contiguous; the accumulator tiles in global memory use the same order.
        using Pair = typename std::conditional<sizeof(ACC) == 8, longlong2, int2>::type;
        Pair* stage_pairs = reinterpret_cast<Pair*>(stage_ptr);
#pragma unroll
        for (int kp = 0; kp < HALF / 4; kp++) {
            Pair v;
            v.x = v7_to_fixed<ACC>(dq[2 * kp] * mult[kp % 2]);
            v.y = v7_to_fixed<ACC>(dq[2 * kp + 1] * mult[kp % 2]);
            stage_pairs[kp * 128 + threadIdx.x % 128] = v;
        }
        fence_proxy_async_shared();  // the staging stores -> visible to the bulk copy
        named_barrier_sync<128>(1 + wg);
        // (d) one bulk reduce-add of the whole tile
        if (threadIdx.x % 128 == 0) {
            v7_bulk_reduce_add<ACC>(dq_acc + tile_index(h, q0) * TILE_VALUES, stage_tile, STAGE_TILE);
            v7_bulk_commit();
        }
        prev_h = h;
        prev_q0 = q0;
    }
    publish_previous();

    // Both warpgroups' dQ wgmmas (which read all 128 rows of K) are done before K's rows are reused for staging.
    __syncthreads();
    __nv_bfloat16* dqkv_b = dqkv + (size_t)b * T * stride;
    // staged through named barriers 1 + wg
    wgmma_store_rows<HD, ROWS>(dqkv_b + (size_t)(H + kvh) * HD, stride, smem_ptr, dk, scale, kwg, T, wg, 1);
    wgmma_store_rows<HD, ROWS>(dqkv_b + (size_t)(H + KV + kvh) * HD, stride, smem_ptr + KBYTES, dv, 1.0f, kwg, T, wg,
                               1);
#else
    __trap();  // not sm_90a code: never launched (attention_wgmma_usable)
#endif
}

// v7's scratch, split into its parts (layout in the file comment).
template <typename ACC>
struct V7Scratch {
    ACC* acc;
    int* counters;
    float* row_mult;
};

// The steps before the kernel (v7 and v8): Kmax and Vmax, then D and each row's multiplier.
template <typename ACC>
inline V7Scratch<ACC> backward_v7_prepare(float* delta, const floatX* dout, const floatX* qkv, const floatX* out,
                                          int B, int T, int H, int KV, int hd, void* scratch, cudaStream_t stream) {
    char* p = static_cast<char*>(scratch);
    V7Scratch<ACC> sc;
    sc.acc = reinterpret_cast<ACC*>(p);
    p += attention_backward_v7_acc_bytes<ACC>(B, T, H, hd);
    sc.counters = reinterpret_cast<int*>(p);
    p += attention_backward_v7_counter_bytes(B, T, H);
    sc.row_mult = reinterpret_cast<float*>(p);
    p += attention_backward_v7_mult_bytes(B, T, H);
    unsigned int* maxes = reinterpret_cast<unsigned int*>(p);
    cudaCheck(cudaMemsetAsync(maxes, 0, 2 * sizeof(unsigned int), stream));
    attention_v7_bounds_kernel<<<264, 256, 0, stream>>>(maxes, qkv, B, T, H, KV, hd);
    cudaCheckLaunch();
    const size_t rows = (size_t)B * H * T;
    attention_v7_delta_kernel<ACC><<<(unsigned)ceil_div(rows, (size_t)8), 256, 0, stream>>>(delta, sc.row_mult, dout,
                                                                                            out, maxes, B, T, H, hd);
    cudaCheckLaunch();
    return sc;
}

template <int HD, int STAGES, typename ACC>
inline void backward_v7_launch(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv, const floatX* out,
                               const float* lse, int B, int T, int H, int KV, void* scratch, cudaStream_t stream) {
    static bool smem_set = false;
    const size_t smem = backward_v7_smem_bytes<HD, STAGES, ACC>();
    attention_set_smem(backward_v7_kernel<HD, STAGES, ACC>, smem, smem_set);
    const V7Scratch<ACC> sc = backward_v7_prepare<ACC>(delta, dout, qkv, out, B, T, H, KV, HD, scratch, stream);
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    dim3 grid(B * KV, ceil_div(T, WGMMA_ROWS));
    backward_v7_kernel<HD, STAGES, ACC><<<grid, WGMMA_THREADS, smem, stream>>>(
        dqkv, sc.acc, sc.counters, sc.row_mult, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
}

// Same contract as attention_backward, plus scratch: attention_backward_v7_scratch_bytes<V7Acc>(B, T, n_heads,
// head_dim) bytes, 256-byte aligned, ZEROED when allocated (each call leaves it zeroed). Elsewhere (other head dims,
// another GPU) attention_backward's path (scratch unused).
#ifndef V7_ACC
#define V7_ACC long long
#endif
#ifndef V7_STAGES_128
#define V7_STAGES_128 2
#endif
using V7Acc = V7_ACC;
inline void attention_backward_v7(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                                  const floatX* out, const float* lse, int B, int T, int n_heads, int n_kv_heads,
                                  int head_dim, void* scratch, cudaStream_t stream) {
    attention_check_args("attention_backward_v7", B, T, n_heads, n_kv_heads, head_dim);
    if ((head_dim == 64 || head_dim == 128) && attention_wgmma_usable()) {
        if (!attention_aligned16({dqkv, dout, qkv, scratch})) {
            fprintf(stderr, "attention_backward_v7: tensors must be 16-byte aligned\n");
            fail_exit();
        }
        if (head_dim == 64) {
            backward_v7_launch<64, 3, V7Acc>(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads,
                                             scratch, stream);
        } else {
            backward_v7_launch<128, V7_STAGES_128, V7Acc>(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads,
                                                         n_kv_heads, scratch, stream);
        }
        return;
    }
    attention_backward(dqkv, delta_scratch, dout, qkv, out, lse, nullptr, B, T, n_heads, n_kv_heads, head_dim, stream);
}

#endif  // !ENABLE_FP32
