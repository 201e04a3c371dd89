// v8 of dev/cuda/attention_backward.cu: v7 (fixed-point one-pass backward, bit-exact in any order) with the dQ
// partials of key tiles 2m and 2m + 1 added together on chip before they reach L2, halving the reduce traffic that
// holds v7 back (attention_backward.cu's header: L2 adds the partials at about 1.0-1.4 TB/s).
//
// The two CTAs of a key-tile pair form a thread-block cluster (1, 2, 1) and walk the same items (query tile from the
// last down, query head inner); rank 1's list is the shorter one. On each common item the non-adding rank writes its
// fixed-point partial into its SEND tile (fragment order, as v7's staging), both ranks pass a cluster barrier
// (split: barrier.cluster.arrive.release once the send tile is written, wait.acquire at once by the adding rank and
// before its next arrival by the other: the send tile is visible across the pair), and the ADDING rank (item
// parity: each rank adds on half the items) reads the partner's send tile through distributed shared memory
// (ld.shared::cluster at the mapa address), adds its own partial in integers (exact), and sends the sum to L2 with one
// bulk reduce-add, as v7. Past the common items rank 0 sends its own partials alone. A tile's counter now expects
// floor(q0 / 128) / 2 + 1 reduces (one per pair of key tiles up to the diagonal); a warpgroup counts a sum (bulk
// completion, fence.proxy.async.global, atom.release) at its next sum and reads the atomic's old value at the one after,
// so neither round trip is waited for where it was issued. Safety of the send tile: a rank
// writes it on every other common item (the ones its partner adds), and the partner's reads of item it finish before
// the partner reaches the barrier of item it + 1, which the writer passes before writing again on item it + 2. A
// final cluster barrier keeps both CTAs alive until the last remote read is done. grid.y is padded to an even count of
// key tiles; a padding CTA (keys past T) has no items and only takes part in the barriers.
//
// Everything else (bounds, row multipliers, the last contributor converting and zeroing a tile, the scratch and its
// layout) is v7's. smem: v7's plus a send tile per warpgroup (64 x hd / 2 ACC): at hd 128 the int32 accumulator with
// 2 Q / dO stages (211 KiB); at hd 64 either accumulator with 3 stages.
#pragma once

#include "attention_backward_v7.cuh"

// Timing only (results wrong): V8_EXPERIMENT=1 drops the per-item cluster barrier, 2 also the DSMEM reads.
#ifndef V8_EXPERIMENT
#define V8_EXPERIMENT 0
#endif

#if !defined(ENABLE_FP32)

// The shared::cluster address of shared address `addr` of this CTA in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t mapa_shared_cluster(uint32_t addr, int rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
// A pair of accumulator values (8 or 16 bytes) from distributed shared memory.
template <typename ACC, typename Pair>
__device__ __forceinline__ Pair ld_shared_cluster_pair(uint32_t addr) {
    Pair v;
    if constexpr (sizeof(ACC) == 8) {
        asm volatile("ld.shared::cluster.v2.s64 {%0, %1}, [%2];\n" : "=l"(v.x), "=l"(v.y) : "r"(addr) : "memory");
    } else {
        asm volatile("ld.shared::cluster.v2.s32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    }
    return v;
}
// All threads of every CTA of the cluster: this CTA's earlier shared-memory writes are visible to the other CTAs'
// later reads.
__device__ __forceinline__ void cluster_arrive() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// Atomic add at GPU scope with release semantics, returning the old value.
__device__ __forceinline__ int atom_add_release_gpu(int* p, int v) {
    int old;
    asm volatile("atom.release.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

template <int HD, int STAGES, typename ACC>
constexpr size_t backward_v8_smem_bytes() {
    return backward_v7_smem_bytes<HD, STAGES, ACC>() + V7_QUERIES * HD * sizeof(ACC);
}

// dK, dV of one (b, kv head, tile of 128 keys) and its keys' dQ contributions. grid (B * KV, 2 ceil(T / 256)), block
// 256, clusters of (1, 2, 1): key tiles 2m, 2m + 1.
template <int HD, int STAGES, typename ACC>
__global__ void __launch_bounds__(WGMMA_THREADS, 1)
    backward_v8_kernel(__nv_bfloat16* dqkv, ACC* dq_acc, int* dq_counters, const float* row_mult,
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
    const uint32_t send_sm = ds_sm + DSBYTES;            // 2 warpgroups x 64 x HALF ACC: partial for the partner
    const uint32_t acc_sm = send_sm + 2 * STAGE_TILE;    // 2 warpgroups x 64 x HALF ACC: the pair's sum, to L2
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));
    float* lse_s = reinterpret_cast<float*>(smem_ptr + (acc_sm - smem) + 2 * STAGE_TILE);  // S stages x BQ
    float* D_s = lse_s + S * BQ;                                                             // S stages x BQ
    int* last_s = reinterpret_cast<int*>(D_s + S * BQ);                                      // per warpgroup

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, g = (threadIdx.x % 32) / 4;
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int j = blockIdx.y, k0 = j * ROWS, rank = j % 2;  // cluster rank (clusters along y)
    const int partner_k0 = (j ^ 1) * ROWS;
    const int kwg = k0 + 64 * wg;          // the warpgroup's first key
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;

    // Items: (query tile from the last down to the diagonal, query head of the group), as v6 (no order needed here).
    const int n_qt = ceil_div(T, BQ), n_items = max(0, group * (n_qt - k0 / BQ));
    // Both ranks walk the same item sequence from the last query tile; rank 1's is the shorter (its diagonal is later):
    // its items are the common ones, where the pair adds its partials before one bulk reduce goes to L2.
    const int n_common = max(0, group * (n_qt - max(k0, partner_k0) / BQ));
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
    bool wait_pending = false;
    const uint32_t stage_tile = acc_sm + wg * STAGE_TILE, send_tile = send_sm + wg * STAGE_TILE;
    uint8_t* stage_ptr = smem_ptr + (stage_tile - smem);
    uint8_t* send_ptr = smem_ptr + (send_tile - smem);
    const uint32_t partner_send = mapa_shared_cluster(send_tile, rank ^ 1);  // the partner's send tile, same place

    // The previous item of this warpgroup whose bulk reduces are in flight (published at the next (a)).
    auto tile_index = [&](int h, int q0) { return (((size_t)b * H + h) * n_qt + q0 / BQ) * 2 + wg; };
    // This warpgroup's sums sent to L2: the newest, in flight (not yet counted), and the one before it, counted with
    // its counter's old value still on its way back (thread 0's pending_old), so neither the bulk reduce's completion
    // nor the atomic's round trip is waited for on the item that issued them.
    int prev_h = -1, prev_q0 = 0, counted_h = -1, counted_q0 = 0, pending_old = 0;
    auto publish_previous = [&]() {
        if (threadIdx.x % 128 == 0) {
            int last = 0;
            if (counted_h >= 0) {
                last = pending_old == counted_q0 / ROWS / 2;  // one reduce per pair of key tiles
                if (last) dq_counters[tile_index(counted_h, counted_q0)] = 0;  // untouched for the rest of the launch
            }
            v7_bulk_wait();  // the in-flight sum landed (and the staging tile was read)
            if (prev_h >= 0) {
                v7_fence_proxy_async_global();
                pending_old = atom_add_release_gpu(dq_counters + tile_index(prev_h, prev_q0), 1);
            }
            last_s[wg] = last;
        }
        named_barrier_sync<128>(1 + wg);
        if (last_s[wg]) {
            __threadfence();
            backward_v7_convert<HD, ACC>(dq_acc + tile_index(counted_h, counted_q0) * TILE_VALUES, row_mult, dqkv,
                                         stride, b, counted_h, counted_q0, T, H, wg, scale);
        }
        counted_h = prev_h;
        counted_q0 = prev_q0;
        prev_h = -1;
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

        // Pair exchange (common items): the non-adding rank leaves its partial in fixed point in its send tile (fragment
        // order); a cluster barrier; the adding rank (alternating by item, so both do half the adds) reads it through
        // DSMEM, adds its own and sends the sum to L2. Past the common items rank 0 sends its own partial alone.
        using Pair = typename std::conditional<sizeof(ACC) == 8, longlong2, int2>::type;
        const bool common = it < n_common;
        const bool adder = !common || it % 2 == rank;
        if (common && wait_pending) {  // (never true under V8_EXPERIMENT)  // the previous phase first (barrier.cluster alternates arrive and wait)
            cluster_wait();
            wait_pending = false;
        }
        if (!adder) {
            Pair* send_pairs = reinterpret_cast<Pair*>(send_ptr);
#pragma unroll
            for (int kp = 0; kp < HALF / 4; kp++) {
                Pair v;
                v.x = v7_to_fixed<ACC>(dq[2 * kp] * mult[kp % 2]);
                v.y = v7_to_fixed<ACC>(dq[2 * kp + 1] * mult[kp % 2]);
                send_pairs[kp * 128 + threadIdx.x % 128] = v;
            }
        }
        // Split cluster barrier, one phase per common item: everyone arrives once its send tile is written; the adder
        // waits at once, the other rank only before its next arrival (it never waits on the adder's work).
        if (common && V8_EXPERIMENT == 0) {
            cluster_arrive();
            wait_pending = !adder;
            if (adder) cluster_wait();
        }
        if (!adder) continue;

        // (a), (b): the previous sum published (and converted, if it was the tile's last); staging free.
        publish_previous();
        // (c) own partial + the partner's (common items) into the staging tile, fragment order
        Pair* stage_pairs = reinterpret_cast<Pair*>(stage_ptr);
#pragma unroll
        for (int kp = 0; kp < HALF / 4; kp++) {
            Pair v;
            v.x = v7_to_fixed<ACC>(dq[2 * kp] * mult[kp % 2]);
            v.y = v7_to_fixed<ACC>(dq[2 * kp + 1] * mult[kp % 2]);
            if (common && V8_EXPERIMENT < 2) {
                const Pair o = ld_shared_cluster_pair<ACC, Pair>(partner_send + (kp * 128 + threadIdx.x % 128) * sizeof(Pair));
                v.x += o.x;
                v.y += o.y;
            }
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
    publish_previous();  // counts the last sum
    publish_previous();  // resolves it
    if (wait_pending) cluster_wait();
    cluster_sync();  // the partner has read this CTA's send tile for the last time before either exits

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


template <int HD, int STAGES, typename ACC>
inline void backward_v8_launch(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv, const floatX* out,
                               const float* lse, int B, int T, int H, int KV, void* scratch, cudaStream_t stream) {
    static bool smem_set = false;
    const size_t smem = backward_v8_smem_bytes<HD, STAGES, ACC>();
    attention_set_smem(backward_v8_kernel<HD, STAGES, ACC>, smem, smem_set);
    const V7Scratch<ACC> sc = backward_v7_prepare<ACC>(delta, dout, qkv, out, B, T, H, KV, HD, scratch, stream);
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(B * KV, 2 * ceil_div(T, 2 * WGMMA_ROWS));
    config.blockDim = dim3(WGMMA_THREADS);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = 1;
    attribute.val.clusterDim.y = 2;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    cudaCheck(cudaLaunchKernelEx(&config, backward_v8_kernel<HD, STAGES, ACC>, dqkv, sc.acc, sc.counters,
                                 (const float*)sc.row_mult, (const __nv_bfloat16*)dout, (const __nv_bfloat16*)qkv, lse,
                                 (const float*)delta, T, H, KV, scale, scale_log2));
}

// Same contract and scratch as attention_backward_v7 (attention_backward_v7_scratch_bytes<V8Acc>).
#ifndef V8_ACC_64
#define V8_ACC_64 int
#endif
using V8Acc = int;        // hd 128 (smem allows int32 only)
using V8Acc64 = V8_ACC_64;  // hd 64
inline void attention_backward_v8(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                                  const floatX* out, const float* lse, int B, int T, int n_heads, int n_kv_heads,
                                  int head_dim, void* scratch, cudaStream_t stream) {
    attention_check_args("attention_backward_v8", B, T, n_heads, n_kv_heads, head_dim);
    if ((head_dim == 64 || head_dim == 128) && attention_wgmma_usable()) {
        if (!attention_aligned16({dqkv, dout, qkv, scratch})) {
            fprintf(stderr, "attention_backward_v8: tensors must be 16-byte aligned\n");
            fail_exit();
        }
        if (head_dim == 64) {
            backward_v8_launch<64, 3, V8Acc64>(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads,
                                               scratch, stream);
        } else {
            backward_v8_launch<128, 2, V8Acc>(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads,
                                              scratch, stream);
        }
        return;
    }
    attention_backward(dqkv, delta_scratch, dout, qkv, out, lse, nullptr, B, T, n_heads, n_kv_heads, head_dim, stream);
}
// Scratch bytes for attention_backward_v8 (the accumulator type differs by head dim).
inline size_t attention_backward_v8_scratch_bytes(int B, int T, int H, int hd) {
    return hd == 64 ? attention_backward_v7_scratch_bytes<V8Acc64>(B, T, H, hd)
                    : attention_backward_v7_scratch_bytes<V8Acc>(B, T, H, hd);
}

#endif  // !ENABLE_FP32
