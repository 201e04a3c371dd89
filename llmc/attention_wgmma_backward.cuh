// Causal GQA attention backward for Hopper (sm_90a): two warp-specialised wgmma kernels, head_dim 64 and 128, bf16
// builds only. For one (b, h), scale = 1 / sqrt(hd), P_ij = exp(scale q_i . k_j - lse_i) (j <= i), D_i = do_i . o_i:
//   dP_ij = do_i . v_j    dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j    dk_j = scale sum_i dS_ij q_i    dv_j = sum_i P_ij do_i
// with dk, dv summed over the query heads of a kv head's group. Deterministic, no atomics: every output element has
// one writer, a dK/dV kernel over (key tile, kv head) and a dQ kernel over (query tile, head), after D from
// attention_delta (attention_common.cuh). Given RoPE's table, RoPE's backward is applied to dq and dk as they are
// stored. Layouts and tiles: attention_wgmma.cuh; the pipeline vocabulary (rings, turns, roles): pipeline.cuh.
// Versions and measurements: dev/cuda/attention_backward.cu, which checks these kernels (one and several work items
// per CTA) against its CPU reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "attention_common.cuh"
#include "attention_wgmma.cuh"
#include "cuda_common.h"
#include "pipeline.cuh"
#include "ptx.cuh"

#if !defined(ENABLE_FP32)

constexpr int WGMMA_DKDV_STAGES = 4;    // Q / dO stages of the dK/dV kernel
constexpr int WGMMA_DKDV_QUERIES = 64;  // queries per dK/dV work item
constexpr int WGMMA_DQ_STAGES = 3;      // K / V stages of the dQ kernel
// Per head dim, the best measured on an H200 (dev/cuda/attention_backward.cu): keys per K / V tile of the dQ kernel,
// and whether its warpgroups hold their Q and dO rows in registers as A fragments (at hd 64 no faster).
__host__ __device__ constexpr int wgmma_dq_keys(int hd) { return hd == 64 ? 128 : 64; }
__host__ __device__ constexpr bool wgmma_dq_q_in_registers(int hd) { return hd == 128; }

// ----------------------------------------------------------------------------------------------------------------
// Probabilities

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

// ----------------------------------------------------------------------------------------------------------------
// dK/dV

// Named barriers of the dK/dV kernel: each takes two ids, one per consumer warpgroup.
enum AttentionBackwardDkdvBarrier : int {
    DKDV_BARRIER_EPILOGUE = 1,  // 1, 2: warpgroup w's rows of dK (then dV) are staged (wgmma_store_rows)
    DKDV_BARRIER_TURN = 3,      // 3, 4: at hd 64, the consumers' turns to issue their wgmma batches (TurnTaking)
};

// Shared memory of the dK/dV kernel: the CTA's K and V, the ring's stages of an item's Q, dO, lse and D, barriers.
template <int HD>
struct AttentionBackwardDkdvSmem {
    static constexpr int S = WGMMA_DKDV_STAGES, BQ = WGMMA_DKDV_QUERIES;
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 k[WGMMA_ROWS * HD];  // K, V of the CTA's keys, swizzled; at the end each
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 v[WGMMA_ROWS * HD];  // warpgroup's rows stage its dK, dV
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 q[S][BQ * HD];       // per stage, the item's Q and dO tiles
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 dout[S][BQ * HD];
    float lse[S][BQ];    // the item's lse, times log2 e
    float delta[S][BQ];  // the item's D
    uint64_t kv_full;    // mbarrier: K and V have landed
    RingBarriers<S> ring;
};

// The dK/dV kernel. CTA = 128 keys x (kv head, batch), the first key tiles (which see the most queries) first. The
// producer's elected thread loads K and V (128 x HD) once (kv_full), then for each work item (query head of the group,
// query tile of BQ = 64 from the diagonal, in a fixed order) Q and dO by TMA (64-row boxes) into the next stage of the
// ring, while 64 other producer threads copy the item's lse (times log2 e) and D into it with plain loads (an lse row
// need not be 16-byte aligned, which a bulk copy would want): full[s] completes with the TMA thread's
// arrive.expect_tx and those 64 arrivals. Per item and consumer warpgroup (rows = its 64 keys, columns = the BQ
// queries, fp32 accumulators):
//   S^T = K Q^T, dP^T = V dO^T        wgmma m64nBQk16, A and B from smem descriptors (both K-major), two groups;
//                                     at hd 128 S^T's first 5 k16 slices take A (K) from registers, loaded once
//   P^T = exp2(S^T scale log2 e - lse log2 e), 0 where key > query or query >= T; bf16 A registers
//   dV += P^T dO                      wgmma m64nHDk16, A from registers, B = dO tile MN-major ("transpose B")
//   dS^T = P^T o (dP^T - D); bf16 A registers
//   dK += dS^T Q                      wgmma m64nHDk16, as dV; the stage is released on empty[s] (256 arrivals) once
//                                     the products reading it are done
// dK times scale at the store. At hd 128 dV and dK are issued together once dS^T is ready, and a warpgroup whose keys
// all follow the item's queries skips the item (after waiting for it to be loaded, so that its release of a round
// never precedes the other warpgroup's release of the round before). There the kernel is bound by shared-memory reads
// (m64n64 products with both operands in smem); K in registers takes a third of S^T's, and the registers for it come
// from not holding dV's A operands and S^T, dP^T at the same time. At hd 64, where an item's products are short next
// to its exponentials, the two consumers take turns issuing (DKDV_BARRIER_TURN): a turn issues item i's S^T, dP^T and
// item i - 1's dV, dK, then computes P^T, dS^T of item i into one of two register sets (by item parity; ptxas runs
// the exponentials beside those products and places dS^T's arithmetic and the bf16 packing after the wait for them);
// skipped items run masked (P^T = 0), so every turn issues the same groups.
// ptxas serialises all of a kernel's wgmmas (C7515) when it cannot see that no ordinary instruction writes a running
// wgmma's registers. Two things keep it from that here: the consumer warpgroup's index comes through a shuffle
// (ws_consumer_index), and mbarrier_wait's loop is written in PTX (ptx.cuh).
// Epilogue: each warpgroup read only its own 64 rows of K and V; after its last wait they stage its dK and dV for
// 16-byte stores (wgmma_store_rows, DKDV_BARRIER_EPILOGUE).
// grid (B * KV, ceil(T / 128)), block WS_THREADS. kv_map: qkv with 128-row boxes; q_map: qkv with 64-row boxes;
// do_map: dout with 64-row boxes (attention_heads_tensor_map).
template <int HD>
__global__ void __launch_bounds__(WS_THREADS, 1)
    attention_backward_dkdv_wgmma_kernel(const __grid_constant__ CUtensorMap kv_map,
                                         const __grid_constant__ CUtensorMap q_map,
                                         const __grid_constant__ CUtensorMap do_map, __nv_bfloat16* dqkv,
                                         const float* lse, const float* delta, const float* rope, int T, int H, int KV,
                                         float scale, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = WGMMA_ROWS, S = WGMMA_DKDV_STAGES, BQ = WGMMA_DKDV_QUERIES;
    constexpr int KBYTES = ROWS * HD * 2, QBYTES = BQ * HD * 2;
    using Smem = AttentionBackwardDkdvSmem<HD>;
    // Head dim 64: the consumers take turns issuing, each turn one item's S^T, dP^T and the previous item's dV, dK
    // products: +5% over issuing each product when its operands are ready (H100). Head dim 128 has no registers for
    // the second item in flight (P^T, dS^T of two items) and issues per product.
    constexpr bool PINGPONG = HD == 64;
    static_assert(ROWS % BQ == 0, "query tiles must start at the key tile's first key");
    static_assert(BQ == 64 || BQ == 128, "S^T, dP^T are wgmma m64nBQk16 with N = 64 or 128 (wgmma_bf16_ss overloads)");
    static_assert(ws_smem_bytes<Smem>() <= WS_SMEM_LIMIT, "stages do not fit in shared memory");
    Smem& sm = ws_shared_storage<Smem>();

    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ROWS;  // the first key tiles see the most queries: scheduled first
    // Items (query head of the group, query tile from the diagonal); k0 is a multiple of BQ. Item it is query head
    // kvh * group + it / n_q, tile from q0 = k0 + (it % n_q) BQ; every loop below walks (head, q0) by counting
    // (q0 wraps to k0 at q_end), not by dividing by n_q (an integer division per item).
    const int n_q = ceil_div(T - k0, BQ), n_items = group * n_q, q_end = k0 + n_q * BQ;

    if (threadIdx.x == 0) {
        mbarrier_init(smem_addr(&sm.kv_full), 1);
        sm.ring.init(1 + BQ, WS_CONSUMER_THREADS);  // full: the TMA thread's arrive.expect_tx, the 64 lse / D threads
    }
    ws_publish_barriers();

    if (threadIdx.x < 128) {  // producer warpgroup
        setmaxnreg_dec<WS_PRODUCER_REGS>();
        if (threadIdx.x < 32) {
            if (elect_one_sync()) {
                const uint32_t kv_full = smem_addr(&sm.kv_full);
                mbarrier_arrive_expect_tx(kv_full, 2 * KBYTES);
                for (int cb = 0; cb < HD / 64; cb++) {
                    tma_load_4d(smem_addr(sm.k) + cb * (ROWS * 128), &kv_map, kv_full, 64 * cb, H + kvh, k0, b);
                    tma_load_4d(smem_addr(sm.v) + cb * (ROWS * 128), &kv_map, kv_full, 64 * cb, H + KV + kvh, k0, b);
                }
                RingState<S> pos;
                for (int it = 0, h = kvh * group, q0 = k0; it < n_items; it++, pos.advance()) {
                    const int s = pos.stage;
                    sm.ring.acquire(pos, 2 * QBYTES);
                    for (int cb = 0; cb < HD / 64; cb++) {
                        tma_load_4d(smem_addr(sm.q[s]) + cb * (BQ * 128), &q_map, sm.ring.full_bar(s), 64 * cb, h, q0,
                                    b);
                        tma_load_4d(smem_addr(sm.dout[s]) + cb * (BQ * 128), &do_map, sm.ring.full_bar(s), 64 * cb, h,
                                    q0, b);
                    }
                    q0 += BQ;
                    if (q0 == q_end) q0 = k0, h++;
                }
            }
        } else if (threadIdx.x < 32 + BQ) {  // one query's lse and D per thread
            const int i = threadIdx.x - 32;
            // (b, first head of the group) rows of lse and delta; a head's row is T further on
            const float* lse_row = lse + ((size_t)b * H + kvh * group) * T;
            const float* delta_row = delta + ((size_t)b * H + kvh * group) * T;
            RingState<S> pos;
            for (int it = 0, q = k0 + i; it < n_items; it++, pos.advance()) {
                const int s = pos.stage;
                sm.ring.wait_empty(pos);
                sm.lse[s][i] = q < T ? lse_row[q] * ATTN_LOG2E : 0.0f;  // in the log2 domain
                sm.delta[s][i] = q < T ? delta_row[q] : 0.0f;
                sm.ring.arrive_full(s);  // releases the two stores to whoever waits on full[s]
                q += BQ;
                if (q >= q_end) q -= n_q * BQ, lse_row += T, delta_row += T;
            }
        }
        return;
    }

    // Consumers.
    setmaxnreg_inc<WS_CONSUMER_REGS>();
    const int wg = ws_consumer_index();
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int kwg = k0 + 64 * wg;          // the warpgroup's first key
    const int key0 = kwg + 16 * warp + g;  // this thread's keys: key0 and key0 + 8

    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) dk[i] = dv[i] = 0.0f;
    // Descriptors: the warpgroup's rows of K and V (A of S^T, dP^T), and stage 0 of Q and dO read K-major (B of S^T,
    // dP^T) and MN-major (B of dK, dV); stage s is QBYTES s further on.
    const uint64_t k_desc = wgmma_desc_kmajor(smem_addr(sm.k) + 64 * wg * 128);
    const uint64_t v_desc = wgmma_desc_kmajor(smem_addr(sm.v) + 64 * wg * 128);
    const uint64_t q_desc = wgmma_desc_kmajor(smem_addr(sm.q[0])), do_desc = wgmma_desc_kmajor(smem_addr(sm.dout[0]));
    const uint64_t q_desc_t = wgmma_desc_mnmajor(smem_addr(sm.q[0]), BQ);
    const uint64_t do_desc_t = wgmma_desc_mnmajor(smem_addr(sm.dout[0]), BQ);
    mbarrier_wait(smem_addr(&sm.kv_full), 0);

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
        sm.ring.release(stage);
    };

    RingState<S> pos;  // the item's stage
    if constexpr (PINGPONG) {
        // P^T and dS^T of item it live in buffer it % 2 until the turn after (no register copies: ptxas serialises
        // the wgmmas when ordinary instructions define their A registers inside the pipeline). Every turn issues the
        // same groups in the same order, so that ptxas can tell which group each wait covers; a warpgroup's skipped
        // item (all its keys after all the queries) runs masked, P^T = 0, and adds zeros.
        uint32_t pa0[BQ / 16][4], dsa0[BQ / 16][4], pa1[BQ / 16][4], dsa1[BQ / 16][4];
        const TurnTaking<DKDV_BARRIER_TURN> turns{wg};
        turns.start();
        // The item's P^T, dS^T from its S^T, dP^T (the groups in flight: S^T, dP^T, and one more if `later`).
        auto probs = [&](int stage, int q0, float(&s)[BQ / 2], float(&dp)[BQ / 2], uint32_t(&pa)[BQ / 16][4],
                         uint32_t(&dsa)[BQ / 16][4], bool later) {
            if (later) wgmma_wait_group<2>(); else wgmma_wait_group<1>();  // S^T done
            pin_registers(s);
            attention_backward_probs_t<BQ>(s, sm.lse[stage], 1.0f, scale_log2, q0, kwg, key0, c, T);
            wgmma_acc_to_a<BQ>(pa, s);
            if (later) wgmma_wait_group<1>(); else wgmma_wait_group<0>();  // dP^T done
            pin_registers(dp);
            ds_t(s, dp, sm.delta[stage]);
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
            sm.ring.wait_full(pos);
            turns.wait();
            wgmma_fence();
            scores(pos.stage, s, dp);
            turns.pass();
            probs(pos.stage, k0, s, dp, pa0, dsa0, false);
        }
        int prev_stage = pos.stage;  // the previous item's stage, freed once its dV, dK are done
        pos.advance();
        // The item at pos (not the first): its S^T, dP^T and the previous item's dV, dK issued together, then its
        // P^T, dS^T; then the previous item's stage is released.
        auto step = [&](int q0, uint32_t(&pa_cur)[BQ / 16][4], uint32_t(&dsa_cur)[BQ / 16][4],
                        uint32_t(&pa_prev)[BQ / 16][4], uint32_t(&dsa_prev)[BQ / 16][4]) {
            float s[BQ / 2], dp[BQ / 2];
            sm.ring.wait_full(pos);
            pin_registers(pa_prev);
            pin_registers(dsa_prev);
            turns.wait();
            wgmma_fence();
            scores(pos.stage, s, dp);
            grads(prev_stage, pa_prev, dsa_prev);
            turns.pass();
            probs(pos.stage, q0, s, dp, pa_cur, dsa_cur, true);
            finish_grads(prev_stage, pa_prev, dsa_prev);
        };
        // The last turn: the last item's dV, dK.
        auto last = [&](uint32_t(&pa_prev)[BQ / 16][4], uint32_t(&dsa_prev)[BQ / 16][4]) {
            pin_registers(pa_prev);
            pin_registers(dsa_prev);
            turns.wait();
            wgmma_fence();
            grads(prev_stage, pa_prev, dsa_prev);
            turns.pass();
            finish_grads(prev_stage, pa_prev, dsa_prev);
        };
        int it = 1, q0 = k0 + BQ == q_end ? k0 : k0 + BQ;
        auto advance = [&] {
            it++, q0 = q0 + BQ == q_end ? k0 : q0 + BQ;
            prev_stage = pos.stage;
            pos.advance();
        };
        while (it + 1 < n_items) {
            step(q0, pa1, dsa1, pa0, dsa0);
            advance();
            step(q0, pa0, dsa0, pa1, dsa1);
            advance();
        }
        if (it < n_items) {
            step(q0, pa1, dsa1, pa0, dsa0);
            advance();
            last(pa1, dsa1);
        } else {
            last(pa0, dsa0);
        }
        turns.finish();
    } else {
        // K's first K_SLICES k16 slices stay in registers as S^T's A (all 8 would spill). dV and dK are issued
        // together once dS^T is ready, which leaves their two register sets and S^T, dP^T no longer live at once.
        constexpr int K_SLICES = 5;
        uint32_t ka[K_SLICES][4];
        wgmma_load_a_frags<HD, ROWS, K_SLICES>(ka, reinterpret_cast<const uint8_t*>(sm.k), wg);
        uint32_t pa[BQ / 16][4], dsa[BQ / 16][4];  // P^T, dS^T as bf16 A registers, read by dV's and dK's wgmmas
        for (int it = 0, q0 = k0; it < n_items; it++, q0 = q0 + BQ == q_end ? k0 : q0 + BQ, pos.advance()) {
            const int stage = pos.stage;
            // Waited for even when skipped: a warpgroup's release of round r then never precedes the other's of
            // r - 1.
            sm.ring.wait_full(pos);
            if (q0 + BQ - 1 < kwg) {  // warpgroup-uniform: every query of the tile precedes every key
                sm.ring.release(stage);
                continue;
            }
            const uint32_t st_bytes = stage * QBYTES;

            // S^T = K Q^T and dP^T = V dO^T, one commit group each.
            float s[BQ / 2], dp[BQ / 2];
            wgmma_fence();
            wgmma_scores_rs_ss<HD, ROWS, BQ, K_SLICES>(s, ka, k_desc, wgmma_desc_advance(q_desc, st_bytes));
            wgmma_scores_ss<HD, ROWS, BQ>(dp, v_desc, wgmma_desc_advance(do_desc, st_bytes));

            // P^T. Element i: key key0 + 8 ((i / 2) % 2), query q0 + 8 (i / 4) + c + i % 2.
            wgmma_wait_group<1>();  // S^T done
            pin_registers(s);
            attention_backward_probs_t<BQ>(s, sm.lse[stage], 1.0f, scale_log2, q0, kwg, key0, c, T);
            // dS^T, then dV += P^T dO and dK += dS^T Q in one group.
            wgmma_wait_group<0>();
            pin_registers(dp);
            ds_t(s, dp, sm.delta[stage]);
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
    wgmma_store_rows<HD, ROWS>(dqkv_b + (size_t)(H + kvh) * HD, stride, reinterpret_cast<uint8_t*>(sm.k), dk, scale,
                               kwg, T, wg, DKDV_BARRIER_EPILOGUE, rope);
    wgmma_store_rows<HD, ROWS>(dqkv_b + (size_t)(H + KV + kvh) * HD, stride, reinterpret_cast<uint8_t*>(sm.v), dv,
                               1.0f, kwg, T, wg, DKDV_BARRIER_EPILOGUE);
#else
    __trap();  // not sm_90a code: never launched (attention_wgmma_usable)
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// dQ

// Named barriers of the dQ kernel: each takes two ids, one per consumer warpgroup.
enum AttentionBackwardDqBarrier : int {
    DQ_BARRIER_EPILOGUE = 1,  // 1, 2: warpgroup w's rows of dQ are staged (wgmma_store_rows)
};

// Shared memory of the dQ kernel: QBUF (Q, dO) pairs (two where they fit: a later item's load while the last one's
// epilogue stages its dQ through its own), the ring's stages of K and V, barriers.
template <int HD, int QBUF>
struct AttentionBackwardDqSmem {
    static constexpr int S = WGMMA_DQ_STAGES, BN = wgmma_dq_keys(HD);
    struct ItemTiles {  // an item's Q and dO, swizzled; at the end each warpgroup's rows of Q stage its dQ
        alignas(WS_SMEM_ALIGN) __nv_bfloat16 q[WGMMA_ROWS * HD];
        alignas(WS_SMEM_ALIGN) __nv_bfloat16 dout[WGMMA_ROWS * HD];
    };
    ItemTiles item[QBUF];
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 k[S][BN * HD];
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 v[S][BN * HD];
    RingBarriers<QBUF> q_ring;  // full: Q and dO's TMA; empty: the 256 consumer threads are done with them
    RingBarriers<S> kv_ring;    // full: K and V's TMA; empty: the 256 readers of the stage are done
};
template <int HD>
__host__ __device__ constexpr int attention_backward_dq_wgmma_q_buffers() {
    return ws_smem_bytes<AttentionBackwardDqSmem<HD, 2>>() <= WS_SMEM_LIMIT ? 2 : 1;
}

// The dQ kernel. Work item = 128 queries x (head, batch), in the forward's order (attention_forward_item). Persistent
// where two (Q, dO) buffers fit (hd 64 and 128): one CTA per SM takes items in turn (persistent_item), the next item's
// Q and dO loading while this one's last tiles and stores run; else one CTA per item. The producer's elected thread
// loads an item's Q and dO once (q_ring, as the forward's), then the K, V tiles of BN keys up to the causal diagonal
// through the 3 stages of kv_ring. Per tile and consumer warpgroup (rows = its 64 queries):
//   S = Q K^T, dP = dO V^T            wgmma m64nBNk16; with Q in registers (wgmma_dq_q_in_registers: hd 128) the
//                                     warpgroup's Q and dO rows are held as A fragments, so only K, V are read from
//                                     smem
//   P = exp2(S scale log2 e - lse log2 e), 0 where key > query; dS = P o (dP - D); bf16 A registers
//   dQ += dS K                        wgmma m64nHDk16, B = K tile MN-major
// A tile whose keys all follow the warpgroup's queries is skipped (after its wait, as in the dK/dV kernel). dQ times
// scale at the store, staged through the warpgroup's own rows of the Q tile (wgmma_store_rows, DQ_BARRIER_EPILOGUE);
// then q_ring's empty barrier frees the buffer (after a proxy fence: TMA writes next).
// grid: at most B * H * ceil(T / 128) CTAs (persistent: the SMs), block WS_THREADS. q_map: qkv with 128-row boxes;
// do_map: dout with 128-row boxes; kv_map: qkv with BN-row boxes.
template <int HD>
__global__ void __launch_bounds__(WS_THREADS, 1)
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
    using Smem = AttentionBackwardDqSmem<HD, QBUF>;
    static_assert(ROWS % BN == 0, "key tiles must tile the query tile");
    static_assert(ws_smem_bytes<Smem>() <= WS_SMEM_LIMIT, "stages do not fit in shared memory");
    Smem& sm = ws_shared_storage<Smem>();
    const int q_tiles = ceil_div(T, ROWS), BH = B * H, n_items = BH * q_tiles;

    if (threadIdx.x == 0) {
        sm.q_ring.init(1, WS_CONSUMER_THREADS);
        sm.kv_ring.init(1, WS_CONSUMER_THREADS);
    }
    ws_publish_barriers();

    if (threadIdx.x < 128) {  // producer warpgroup
        setmaxnreg_dec<WS_PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            RingState<QBUF> q_pos;
            RingState<S> kv_pos;  // carried across items
            for (int i = 0, item = persistent_item(0); item < n_items; item = persistent_item(++i)) {
                int b, h, q0;
                attention_forward_item(item, H, BH, q_tiles, b, h, q0);
                const int kvh = h / (H / KV), n_tiles = ceil_div(min(q0 + ROWS, T), BN);
                const uint32_t q_full = sm.q_ring.full_bar(q_pos.stage);
                sm.q_ring.acquire(q_pos, 2 * QBYTES);  // the buffer's last item's epilogue is done
                for (int cb = 0; cb < HD / 64; cb++) {
                    tma_load_4d(smem_addr(sm.item[q_pos.stage].q) + cb * (ROWS * 128), &q_map, q_full, 64 * cb, h,
                                q0, b);
                    tma_load_4d(smem_addr(sm.item[q_pos.stage].dout) + cb * (ROWS * 128), &do_map, q_full, 64 * cb,
                                h, q0, b);
                }
                q_pos.advance();
                for (int j = 0; j < n_tiles; j++, kv_pos.advance()) {
                    const int s = kv_pos.stage;
                    sm.kv_ring.acquire(kv_pos, 2 * TBYTES);
                    for (int cb = 0; cb < HD / 64; cb++) {
                        tma_load_4d(smem_addr(sm.k[s]) + cb * (BN * 128), &kv_map, sm.kv_ring.full_bar(s), 64 * cb,
                                    H + kvh, j * BN, b);
                        tma_load_4d(smem_addr(sm.v[s]) + cb * (BN * 128), &kv_map, sm.kv_ring.full_bar(s), 64 * cb,
                                    H + KV + kvh, j * BN, b);
                    }
                }
                if constexpr (!PERSISTENT) break;
            }
        }
        return;
    }

    // Consumers.
    setmaxnreg_inc<WS_CONSUMER_REGS>();
    const int wg = ws_consumer_index();
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    RingState<QBUF> q_pos;
    RingState<S> kv_pos;  // K / V tile j of an item, carried across items
    for (int i = 0, item = persistent_item(0); item < n_items; item = persistent_item(++i)) {
        int b, h, q0;
        attention_forward_item(item, H, BH, q_tiles, b, h, q0);
        const int n_tiles = ceil_div(min(q0 + ROWS, T), BN);  // causal: keys up to the item's last query
        const int buf = q_pos.stage;
        uint8_t* q_tile = reinterpret_cast<uint8_t*>(sm.item[buf].q);
        uint8_t* do_tile = reinterpret_cast<uint8_t*>(sm.item[buf].dout);
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
        // (B of S, dP) and of K read MN-major (B of dQ); stage s is TBYTES s further on.
        const uint64_t q_desc = wgmma_desc_kmajor(smem_addr(q_tile) + 64 * wg * 128);
        const uint64_t do_desc = wgmma_desc_kmajor(smem_addr(do_tile) + 64 * wg * 128);
        const uint64_t k_desc = wgmma_desc_kmajor(smem_addr(sm.k[0])), v_desc = wgmma_desc_kmajor(smem_addr(sm.v[0]));
        const uint64_t k_desc_t = wgmma_desc_mnmajor(smem_addr(sm.k[0]), BN);
        sm.q_ring.wait_full(q_pos);
        if constexpr (AREG) {
            wgmma_load_a_frags<HD, ROWS>(qa, q_tile, wg);
            wgmma_load_a_frags<HD, ROWS>(doa, do_tile, wg);
        }

        for (int j = 0; j < n_tiles; j++, kv_pos.advance()) {
            const int k0 = j * BN, stage = kv_pos.stage;
            sm.kv_ring.wait_full(kv_pos);  // also when skipped (see the dK/dV kernel)
            if (k0 > qwg + 63) {  // warpgroup-uniform: every key of the tile follows every query
                sm.kv_ring.release(stage);
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
            sm.kv_ring.release(stage);
        }

        // Each warpgroup read only its own 64 rows of Q: after its last wait they stage its result; then the
        // buffer is released for a later item's Q and dO (after these generic accesses, for the TMA).
        const size_t stride = (size_t)(H + 2 * KV) * HD;
        wgmma_store_rows<HD, ROWS>(dqkv + (size_t)b * T * stride + (size_t)h * HD, stride, q_tile, dq, scale, qwg, T,
                                   wg, DQ_BARRIER_EPILOGUE, rope);
        if constexpr (!PERSISTENT) break;
        fence_proxy_async_shared();
        sm.q_ring.release(buf);
        q_pos.advance();
    }
#else
    __trap();  // not sm_90a code: never launched (attention_wgmma_usable)
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// Host side

// The wgmma backward at one head dim (D included).
template <int HD>
inline void attention_backward_wgmma_hd(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                        const floatX* out, const float* lse, const float* rope, int B, int T, int H,
                                        int KV, cudaStream_t stream) {
    static bool dkdv_prepared = false, dq_prepared = false;
    constexpr int DQ_QBUF = attention_backward_dq_wgmma_q_buffers<HD>();
    const size_t dkdv_smem = ws_smem_bytes<AttentionBackwardDkdvSmem<HD>>();
    const size_t dq_smem = ws_smem_bytes<AttentionBackwardDqSmem<HD, DQ_QBUF>>();
    ws_prepare_kernel(attention_backward_dkdv_wgmma_kernel<HD>, "attention_backward_wgmma (dK/dV)", dkdv_smem,
                      dkdv_prepared);
    ws_prepare_kernel(attention_backward_dq_wgmma_kernel<HD>, "attention_backward_wgmma (dQ)", dq_smem, dq_prepared);
    attention_delta(delta, dout, out, B, T, H, HD, stream);
    const int heads = H + 2 * KV;
    const CUtensorMap qkv_128 = attention_heads_tensor_map(qkv, B, T, heads, HD, WGMMA_ROWS);
    const CUtensorMap qkv_64 = attention_heads_tensor_map(qkv, B, T, heads, HD, 64);
    const CUtensorMap dout_128 = attention_heads_tensor_map(dout, B, T, H, HD, WGMMA_ROWS);
    const CUtensorMap dout_64 = attention_heads_tensor_map(dout, B, T, H, HD, WGMMA_DKDV_QUERIES);
    static_assert(WGMMA_DKDV_QUERIES == 64, "the dK/dV kernel's Q boxes are the 64-row map");
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    dim3 dkdv_grid(B * KV, ceil_div(T, WGMMA_ROWS));
    attention_backward_dkdv_wgmma_kernel<HD><<<dkdv_grid, WS_THREADS, dkdv_smem, stream>>>(
        qkv_128, qkv_64, dout_64, dqkv, lse, delta, rope, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
    const int dq_items = B * H * ceil_div(T, WGMMA_ROWS);
    const CUtensorMap& kv_tiles = wgmma_dq_keys(HD) == WGMMA_ROWS ? qkv_128 : qkv_64;
    const int dq_grid = DQ_QBUF == 2 ? std::min(dq_items, ws_sm_count()) : dq_items;  // persistent with 2 buffers
    attention_backward_dq_wgmma_kernel<HD><<<dq_grid, WS_THREADS, dq_smem, stream>>>(
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
