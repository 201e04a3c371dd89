// v6 of dev/cuda/attention_backward.cu: a one-pass causal GQA attention backward for Hopper (sm_90a, bf16 build,
// head_dim 64 and 128). One kernel per (128-key tile, kv head, batch) computes dK, dV and the dQ contributions of
// its keys, so S, dP and the exponentials are computed once (5 matmuls per score tile instead of the 7 of v5's
// two kernels). Shared by attention_backward.cu (validation, timing) and attention_lib.cu (attention_vs_pytorch.py).
// Same contract as attention_backward (llmc/attention.cuh), plus caller-provided scratch:
//   scratch: fp32 dQ accumulator (B, H, T, hd), then int counters (B, H, ceil(T / 64), 2); its size:
//   attention_backward_v6_scratch_bytes(B, T, H, hd). The counters are zeroed here each call; the accumulator needs
//   no zeroing (the first contributor to a query tile stores instead of adding).
//
// CTA = 128 keys x (kv head, batch) = 2 warpgroups of 64 keys, K and V resident in smem (as v5's dK/dV kernel).
// Items = (query head h of the group, query tile i of 64 queries), per head from the LAST query tile down to the
// diagonal (query tile outer, head inner); Q, dO, lse, D stream through 3 cp.async stages, two items ahead. Per item
// and warpgroup:
//   S^T = K Q^T, dP^T = V dO^T (wgmma, A and B from smem); P^T; dV += P^T dO; dS^T = P^T o (dP^T - D);
//   dK += dS^T Q (A from registers); dS^T (bf16) into a (128 keys x 64 queries) swizzled smem tile;
//   __syncthreads (both halves of dS^T written);
//   dQ partial (64 queries x hd / 2: warpgroup w takes columns w hd / 2 ..) = dS K over the CTA's 128 keys:
//     wgmma m64n(hd/2)k16, A = the dS^T tile read MN-major (transposed), B = the K tile MN-major.
// A warpgroup whose keys all follow the item's queries skips the first part (only warpgroup 1, on the diagonal item
// q0 = k0; the dQ matmul then stops at key 64).
//
// Deterministic dQ: the partials of a (b, h, query tile i, column half) are added in the order of the key tiles,
// key tile 0 first, through a counter per (b, h, i, half) in global memory. The CTA of key tile j waits (one thread
// spinning on ld.acquire.gpu, __nanosleep backoff, then a warpgroup barrier) until the counter equals j (every key
// tile j' < j reaches query tile i when j does, and adds once), then reads the fp32 accumulator (L2 only: __ldcg),
// adds its partial and writes it back (key tile 0 writes without reading); __threadfence, warpgroup barrier, and a
// release increment (red.release.gpu). The last key tile reaching tile i (j = 64 i / 128: the diagonal) writes
// bf16(scale (acc + partial)) straight into dqkv instead, so no conversion kernel and no fp32 write-back is needed
// for it. Key tiles past the query tile do not take part. Deadlock freedom: a CTA waits only on CTAs of smaller key
// tiles; the key tile is blockIdx.y, so those were launched earlier (blocks are dispatched x fastest, then y) and
// are resident or done. Walking the query tiles from the last down (heads inner) makes the CTAs of one kv head visit
// the items in the same order, each one add behind the previous key tile (a pipeline). From the diagonal up, CTA j
// would start two tiles ahead of CTA j - 1 and wait for it on every item; with heads outer, it would catch up with
// CTA j - 1 (two items behind) at every head and wait: both make every CTA as slow as key tile 0's.
//
// smem: K, V 2 x 128 x hd + 3 stages x (Q, dO) 2 x 64 x hd bf16 + dS^T 128 x 64 bf16 + 3 x 2 x 64 fp32 + 1024
// (alignment): hd 64 97.5 KiB, hd 128 178.5 KiB; one CTA per SM (registers).
#pragma once

#include "../../llmc/attention.cuh"
#include "ptx_dev.cuh"
#include "wgmma_cp_async.cuh"

#if !defined(ENABLE_FP32)

constexpr int V6_QUERIES = 64;  // queries per item, and the query tiles of the dQ order
constexpr int V6_STAGES = 3;
// Timing experiments (attention_backward.cu's header has the numbers): -DV6_DQ_MODE=1 computes the dQ partials but
// adds them nowhere (the one-pass work's own speed), =2 adds them unordered with float2 atomics. Both give wrong or
// non-deterministic dq: timing only.
#ifndef V6_DQ_MODE
#define V6_DQ_MODE 0
#endif    // Q / dO stages (every wgmma of an item is waited for within it)

// Bytes of caller scratch attention_backward_v6 needs: the fp32 dQ accumulator, then the counters.
inline size_t attention_backward_v6_acc_bytes(int B, int T, int H, int hd) {
    return ((size_t)B * H * T * hd * sizeof(float) + 255) / 256 * 256;
}
inline size_t attention_backward_v6_counter_bytes(int B, int T, int H) {
    return (size_t)B * H * ceil_div(T, V6_QUERIES) * 2 * sizeof(int);
}
inline size_t attention_backward_v6_scratch_bytes(int B, int T, int H, int hd) {
    return attention_backward_v6_acc_bytes(B, T, H, hd) + attention_backward_v6_counter_bytes(B, T, H);
}

template <int HD>
constexpr size_t backward_onepass_smem_bytes() {
    constexpr int S = V6_STAGES, BQ = V6_QUERIES;
    return sizeof(__nv_bfloat16) * (HD * (2 * WGMMA_ROWS + 2 * S * BQ) + WGMMA_ROWS * BQ) +
           sizeof(float) * 2 * S * BQ + 1024;
}

// dQ partial (64 queries x N) = dS K over the first KK k16 slices of keys. ds_tile: dS^T (128 keys x 64 queries),
// read MN-major (slice kk = rows 16 kk, byte 2048 kk); k_tile: the K tile (128 rows) at the first column, MN-major.
// One commit group, waited for.
template <int KK, int N>
__device__ __forceinline__ void backward_onepass_dq(float (&dq)[N], uint32_t ds_tile, uint32_t k_tile) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KK; kk++) {
        wgmma_bf16_ss_t<1, 1>(dq, wgmma_desc_sw128(ds_tile + 2048 * kk, WGMMA_ROWS * 128, 1024),
                              wgmma_desc_sw128(k_tile + 2048 * kk, WGMMA_ROWS * 128, 1024), kk > 0);
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
    pin_registers(dq);
}

// Adds a warpgroup's dQ partial of (b, head h, query tile from q0, column half wg) in key-tile order: waits until
// key tiles 0 .. j - 1 have added theirs (counter == j), then read-add-write of the fp32 accumulator (key tile 0:
// write only; the diagonal key tile j = q0 / 128: bf16(scale sum) into dqkv instead), then releases the counter.
// Element 4 jn + 2 r + e of dq: query q0 + 16 warp + g + 8 r, column HD / 2 wg + 8 jn + c + e. dqkv_q: dqkv at
// (b, token 0, head h); stride: its row stride.
template <int HD>
__device__ __forceinline__ void backward_onepass_accumulate(const float (&dq)[HD / 4], float* dq_acc,
                                                            int* dq_counters, __nv_bfloat16* dqkv_q, size_t stride,
                                                            int b, int h, int q0, int j, int T, int H, int n_qt,
                                                            float scale) {
    constexpr int HALF = HD / 2, BQ = V6_QUERIES;
    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int tile = q0 / BQ;
    const bool last = j == q0 / WGMMA_ROWS;  // the diagonal key tile: the last one reaching this query tile
    int* counter = dq_counters + (((size_t)b * H + h) * n_qt + tile) * 2 + wg;
    if (threadIdx.x % 128 == 0 && j > 0) {
        unsigned int backoff = 32;
        while (ld_acquire_gpu(counter) != j) {
            __nanosleep(backoff);
            backoff = backoff < 512 ? 2 * backoff : 512;
        }
    }
    named_barrier_sync<128>(1 + wg);  // the warpgroup may read what key tiles 0 .. j - 1 wrote
    float* acc = dq_acc + ((size_t)b * H + h) * T * HD + HALF * wg;
    __nv_bfloat16* dst = dqkv_q + HALF * wg;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int q = q0 + 16 * warp + g + 8 * r;
        if (q >= T) continue;
#pragma unroll
        for (int jn = 0; jn < HALF / 8; jn++) {
            const int col = 8 * jn + c;
            float2 v = make_float2(dq[4 * jn + 2 * r], dq[4 * jn + 2 * r + 1]);
            float2* a = reinterpret_cast<float2*>(acc + (size_t)q * HD + col);
            if (j > 0) {
                const float2 old = __ldcg(a);  // L2: the line may be stale in this SM's L1
                v.x = old.x + v.x;
                v.y = old.y + v.y;
            }
            if (last) {
                *reinterpret_cast<__nv_bfloat162*>(dst + (size_t)q * stride + col) =
                    __floats2bfloat162_rn(v.x * scale, v.y * scale);
            } else {
                __stcg(a, v);
            }
        }
    }
    if (!last) {
        __threadfence();                  // this thread's accumulator writes, visible at GPU scope ...
        named_barrier_sync<128>(1 + wg);  // ... for the whole warpgroup, before the release
    }
    if (threadIdx.x % 128 == 0) red_release_gpu_add(counter, 1);  // last: only counts (nobody waits)
}

// One item of the one-pass kernels (v6, v7, v8) for an active warpgroup: S^T = K Q^T and dP^T = V dO^T (one commit
// group each), P^T, dV += P^T dO, dS^T = P^T o (dP^T - D), dK += dS^T Q, and the warpgroup's rows of dS^T (bf16)
// into the swizzled (128 keys x BQ queries) tile at ds_ptr; every wgmma waited for. kwg: the warpgroup's first key;
// lse_t, D_t: the item's BQ queries' lse and D.
template <int HD, int BQ>
__device__ __forceinline__ void backward_onepass_item(float (&dk)[HD / 2], float (&dv)[HD / 2], uint32_t k_sm,
                                                      uint32_t v_sm, uint32_t q_st, uint32_t do_st, uint8_t* ds_ptr,
                                                      const float* lse_t, const float* D_t, int kwg, int q0, int T,
                                                      float scale_log2) {
    constexpr int ROWS = WGMMA_ROWS;
    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int key0 = kwg + 16 * warp + g;  // this thread's keys: key0 and key0 + 8
    float s[BQ / 2], dp[BQ / 2];
    wgmma_fence();
    wgmma_scores_ss<HD, ROWS, BQ>(s, wgmma_desc_kmajor(k_sm + 64 * wg * 128), wgmma_desc_kmajor(q_st));
    wgmma_scores_ss<HD, ROWS, BQ>(dp, wgmma_desc_kmajor(v_sm + 64 * wg * 128), wgmma_desc_kmajor(do_st));
    // P^T. Element i: key key0 + 8 ((i / 2) % 2), query q0 + 8 (i / 4) + c + i % 2.
    wgmma_wait_group<1>();
    pin_registers(s);
    attention_backward_probs_t<BQ>(s, lse_t, ATTN_LOG2E, scale_log2, q0, kwg, key0, c, T);
    uint32_t pa[BQ / 16][4];
    wgmma_accumulate_rs<HD, BQ>(dv, pa, s, wgmma_desc_mnmajor(do_st, BQ));  // dV += P^T dO

    // dS^T (dP^T is done once only the dV group may be outstanding); dK += dS^T Q; dS^T into smem.
    wgmma_wait_group<1>();
    pin_registers(dp);
#pragma unroll
    for (int i = 0; i < BQ / 2; i++) dp[i] = s[i] * (dp[i] - D_t[8 * (i / 4) + c + i % 2]);
    uint32_t dsa[BQ / 16][4];
    wgmma_accumulate_rs<HD, BQ>(dk, dsa, dp, wgmma_desc_mnmajor(q_st, BQ));  // dK += dS^T Q
    // Fragment kk holds rows (keys) g, g + 8 of the warp's slice, queries 16 kk + c (chunk 2 kk) and
    // 16 kk + 8 + c (chunk 2 kk + 1): the same 32-bit stores as wgmma_store_rows, conflict-free.
    const int lr = 64 * wg + 16 * warp + g;
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++) {
        *reinterpret_cast<uint32_t*>(ds_ptr + swizzle128_offset<ROWS>(lr, 2 * kk) + 2 * c) = dsa[kk][0];
        *reinterpret_cast<uint32_t*>(ds_ptr + swizzle128_offset<ROWS>(lr + 8, 2 * kk) + 2 * c) = dsa[kk][1];
        *reinterpret_cast<uint32_t*>(ds_ptr + swizzle128_offset<ROWS>(lr, 2 * kk + 1) + 2 * c) = dsa[kk][2];
        *reinterpret_cast<uint32_t*>(ds_ptr + swizzle128_offset<ROWS>(lr + 8, 2 * kk + 1) + 2 * c) =
            dsa[kk][3];
    }
    fence_proxy_async_shared();  // the dS^T stores -> visible to wgmma
    wgmma_wait_group<0>();       // dV, dK done (dK read dsa's registers)
    pin_registers(dsa);
    pin_registers(dk);
    pin_registers(pa);
    pin_registers(dv);
}

// dK, dV of one (b, kv head, tile of 128 keys) and its keys' ordered dQ contributions. grid (B * KV, ceil(T / 128)),
// block 256. dq_acc: (B, H, T, HD) fp32; dq_counters: (B, H, ceil(T / 64), 2), zero at launch.
template <int HD>
__global__ void __launch_bounds__(WGMMA_THREADS, 1)
    backward_onepass_wgmma_kernel(__nv_bfloat16* dqkv, float* dq_acc, int* dq_counters, const __nv_bfloat16* dout,
                                  const __nv_bfloat16* qkv, const float* lse, const float* delta, int T, int H, int KV,
                                  float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = WGMMA_ROWS, S = V6_STAGES, BQ = V6_QUERIES, HALF = HD / 2;
    constexpr int KBYTES = ROWS * HD * 2, QBYTES = BQ * HD * 2, DSBYTES = ROWS * BQ * 2;
    static_assert(BQ == 64, "the dS^T tile is one 128-byte column block; S^T, dP^T use the m64n64 wgmma");
    static_assert(HD == 64 || HD == 128, "dQ halves are wgmma m64n32 / m64n64");
    extern __shared__ uint8_t wgmma_smem[];
    const uint32_t smem = (smem_addr(wgmma_smem) + 1023u) & ~1023u;  // swizzled tiles: 1024-byte aligned
    const uint32_t k_sm = smem;                  // K (128 x HD), swizzled
    const uint32_t v_sm = k_sm + KBYTES;         // V (128 x HD)
    const uint32_t q_sm = v_sm + KBYTES;         // S stages x Q (BQ x HD)
    const uint32_t do_sm = q_sm + S * QBYTES;    // S stages x dO (BQ x HD)
    const uint32_t ds_sm = do_sm + S * QBYTES;   // dS^T (128 keys x BQ queries), swizzled (all sizes multiples of 1024)
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));
    float* lse_s = reinterpret_cast<float*>(smem_ptr + 2 * KBYTES + 2 * S * QBYTES + DSBYTES);  // S stages x BQ
    float* D_s = lse_s + S * BQ;                                                                // S stages x BQ

    const int wg = threadIdx.x / 128;
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int j = blockIdx.y, k0 = j * ROWS;  // key tile j: launched after every CTA of key tiles < j
    const int kwg = k0 + 64 * wg;             // the warpgroup's first key
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;

    // Items: (query tile from the last down to the diagonal (k0 is a multiple of BQ), query head of the group), so
    // the CTAs of key tiles j - 1 and j walk the same sequence (j - 1's is longer at its end).
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
    issue(0);
    cp_async_commit();
    if (n_items > 1) issue(1);
    cp_async_commit();

    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) dk[i] = dv[i] = 0.0f;
    // The warpgroup's dQ columns HALF wg .. inside the K tile (MN-major B): column block, then bytes in the row.
    const uint32_t k_cols = (HALF * wg / 64) * (ROWS * 128) + (HALF * wg % 64) * 2;
    float dq[HALF / 2];  // the item's dQ partial
    auto accumulate = [&](int h, int q0) {
        backward_onepass_accumulate<HD>(dq, dq_acc, dq_counters, dqkv + (size_t)b * T * stride + (size_t)h * HD,
                                        stride, b, h, q0, j, T, H, n_qt, scale);
    };

    for (int it = 0; it < n_items; it++) {
        // Groups committed so far: items 0 .. it + 1. All but the newest done: item it landed.
        cp_async_wait<1>();
        fence_proxy_async_shared();
        // Item it visible to all; every wgmma of item it - 1 was waited for, so its stage (refilled with item
        // it + 2) and the dS^T tile are free.
        __syncthreads();
        if (it + 2 < n_items) issue(it + 2);
        cp_async_commit();

        const int stage = it % S, h = item_head(it), q0 = item_q0(it);
        const uint32_t q_st = q_sm + stage * QBYTES, do_st = do_sm + stage * QBYTES;
        const bool upper_active = q0 + BQ - 1 >= k0 + 64;  // warpgroup 1 has a key at or before the last query
        const bool active = wg == 0 || upper_active;
        if (active) {
            backward_onepass_item<HD, BQ>(dk, dv, k_sm, v_sm, q_st, do_st, smem_ptr + (ds_sm - smem),
                                          lse_s + stage * BQ, D_s + stage * BQ, kwg, q0, T, scale_log2);
        }
        __syncthreads();  // both warpgroups' dS^T rows are in the tile

        // dQ partial = dS K over the keys up to the last active warpgroup's: A = the dS^T tile MN-major (its k16
        // slice kk = keys 16 kk .. = rows 16 kk, byte 2048 kk), B = the K tile MN-major at this warpgroup's columns.
        // Each count of k16 slices is a branch of its own, waited for inside it: no control flow between the wgmmas
        // of a batch and their wait.
        if (upper_active) {
            backward_onepass_dq<ROWS / 16>(dq, ds_sm, k_sm + k_cols);
        } else {
            backward_onepass_dq<64 / 16>(dq, ds_sm, k_sm + k_cols);
        }

#if V6_DQ_MODE == 1  // experiment: no dQ accumulation (the ceiling of this kernel's structure)
        (void)accumulate;
#elif V6_DQ_MODE == 2  // experiment: unordered fp32 float2 atomics (not deterministic)
        {
            const int warp = (threadIdx.x / 32) % 4, g = (threadIdx.x % 32) / 4, c = 2 * (threadIdx.x % 4);
            float* acc = dq_acc + ((size_t)b * H + h) * T * HD + HALF * wg;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int q = q0 + 16 * warp + g + 8 * r;
                if (q >= T) continue;
#pragma unroll
                for (int jn = 0; jn < HALF / 8; jn++)
                    atomicAdd(reinterpret_cast<float2*>(acc + (size_t)q * HD + 8 * jn + c),
                              make_float2(dq[4 * jn + 2 * r], dq[4 * jn + 2 * r + 1]));
            }
        }
#else
        accumulate(h, q0);
#endif
    }

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

template <int HD>
inline void backward_onepass_launch(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                    const floatX* out, const float* lse, int B, int T, int H, int KV, void* scratch,
                                    cudaStream_t stream) {
    static bool smem_set = false;
    const size_t smem = backward_onepass_smem_bytes<HD>();
    attention_set_smem(backward_onepass_wgmma_kernel<HD>, smem, smem_set);
    float* dq_acc = static_cast<float*>(scratch);
    int* dq_counters = reinterpret_cast<int*>(static_cast<char*>(scratch) + attention_backward_v6_acc_bytes(B, T, H, HD));
    cudaCheck(cudaMemsetAsync(dq_counters, 0, attention_backward_v6_counter_bytes(B, T, H), stream));
    attention_delta(delta, dout, out, B, T, H, HD, stream);
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    dim3 grid(B * KV, ceil_div(T, WGMMA_ROWS));  // key tile = blockIdx.y: every CTA of tile j - 1 launches first
    backward_onepass_wgmma_kernel<HD><<<grid, WGMMA_THREADS, smem, stream>>>(
        dqkv, dq_acc, dq_counters, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
}

// Same contract as attention_backward, plus scratch (attention_backward_v6_scratch_bytes(B, T, n_heads, head_dim)
// bytes, 256-byte aligned, e.g. from cudaMalloc). Where the Hopper kernels do not apply (other head dims, another
// GPU), attention_backward's path (scratch unused).
inline void attention_backward_v6(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                                  const floatX* out, const float* lse, int B, int T, int n_heads, int n_kv_heads,
                                  int head_dim, void* scratch, cudaStream_t stream) {
    attention_check_args("attention_backward_v6", B, T, n_heads, n_kv_heads, head_dim);
    if ((head_dim == 64 || head_dim == 128) && attention_wgmma_usable()) {
        if (!attention_aligned16({dqkv, dout, qkv, scratch})) {
            fprintf(stderr, "attention_backward_v6: tensors must be 16-byte aligned, got dqkv %p dout %p qkv %p "
                    "scratch %p\n", (void*)dqkv, (const void*)dout, (const void*)qkv, scratch);
            fail_exit();
        }
        if (head_dim == 64) {
            backward_onepass_launch<64>(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, scratch,
                                        stream);
        } else {
            backward_onepass_launch<128>(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads,
                                         scratch, stream);
        }
        return;
    }
    attention_backward(dqkv, delta_scratch, dout, qkv, out, lse, nullptr, B, T, n_heads, n_kv_heads, head_dim, stream);
}

#endif  // !ENABLE_FP32
