// Causal GQA attention forward for Hopper (sm_90a): one warp-specialised wgmma kernel, head_dim 64 and 128, bf16
// builds only. For one (b, h), scale = 1 / sqrt(hd), in the log2 domain (scale_log2 = scale log2 e):
//   s_ij = q_i . k_j (j <= i)    m_i = max_j s_ij scale_log2    l_i = sum_j 2^(s_ij scale_log2 - m_i)
//   out_i = sum_j 2^(s_ij scale_log2 - m_i) v_j / l_i    lse_i = (m_i + log2 l_i) ln 2
// computed online over key tiles of 128 (m, l and out rescaled as m grows). Layouts and tiles: attention_wgmma.cuh;
// the pipeline vocabulary (rings, turns, roles): pipeline.cuh. Versions and measurements:
// dev/cuda/attention_forward.cu, which checks this file's kernel (one and several work items per CTA) against its CPU
// reference.
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

constexpr int WGMMA_FWD_KEYS = 128;  // keys per K / V tile (= WGMMA_ROWS: a query tile's last key tile is its diagonal)

// Named barriers of the forward kernel: each takes two ids, one per consumer warpgroup.
enum AttentionForwardBarrier : int {
    FWD_BARRIER_TURN = 1,      // 1, 2: the consumers' turns to issue their wgmma batches (TurnTaking)
    FWD_BARRIER_EPILOGUE = 3,  // 3, 4: warpgroup w's output rows are staged in its rows of the Q tile (128 threads)
};

// Shared memory of the forward: QBUF Q tiles (two where they fit: a later item's Q loads while the last one's
// epilogue stages its output through its own), STAGES K and V tiles, and their rings' barriers.
template <int HD, int STAGES, int QBUF>
struct AttentionForwardSmem {
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 q[QBUF][WGMMA_ROWS * HD];  // swizzled tiles, HD / 64 column blocks
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 k[STAGES][WGMMA_FWD_KEYS * HD];
    alignas(WS_SMEM_ALIGN) __nv_bfloat16 v[STAGES][WGMMA_FWD_KEYS * HD];
    RingBarriers<QBUF> q_ring;     // full: the Q's TMA; empty: its 256 readers are done with it
    RingBarriers<STAGES> kv_ring;  // full: K and V's TMA; empty: the 256 readers of the stage are done
};
template <int HD, int STAGES>
__host__ __device__ constexpr int attention_forward_wgmma_q_buffers() {
    return ws_smem_bytes<AttentionForwardSmem<HD, STAGES, 2>>() <= WS_SMEM_LIMIT ? 2 : 1;
}

// Persistent (a CTA takes items in turn) with two Q buffers, or with one whose Q is released as soon as the item's
// last S product is done (OVERLAP; the epilogue then stores O from registers), so the next Q loads under the last
// P V and the epilogue. Otherwise one item per CTA.
template <int HD, int STAGES, bool OVERLAP>
__host__ __device__ constexpr bool attention_forward_wgmma_persistent() {
    return attention_forward_wgmma_q_buffers<HD, STAGES>() == 2 || OVERLAP;
}

// ----------------------------------------------------------------------------------------------------------------
// The consumers' softmax and P V

// Online softmax over one tile's scores s (the thread's NS values of a 64 x 2 NS fragment; in place, they become
// 2^(s scale_log2 - m)), rows row0 and row0 + 8 of the thread: m (running max, log2 domain) and l (running sums of
// this thread's columns) updated; alpha: the factor earlier sums and O must be scaled by.
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

// ----------------------------------------------------------------------------------------------------------------
// The kernel
//
// Warp-specialised and fed by TMA (FlashAttention-3's design). Work item = 128 queries of one (b, h), the longest
// query tiles first (attention_forward_item). Persistent where attention_forward_wgmma_persistent says so: one CTA per
// SM takes items in turn (persistent_item); else one CTA per item.
//   producer (warpgroup 0, one elected thread): per item, its Q tile into the next Q buffer (q_ring), then the K and
//     V tiles of 128 keys up to the causal diagonal into the STAGES stages of kv_ring; every tile is HD / 64 TMA
//     boxes of 64 columns x 128 rows, which the TMA unit swizzles into exactly the layout the descriptors read.
//   consumers (warpgroups 1, 2, 64 query rows each): S = Q K^T as wgmma m64n128k16 from descriptors, the causal mask
//     on the diagonal tile, the online softmax on the fragment (quad reductions), P as bf16 A registers, O += P V as
//     wgmma m64nHDk16 with V MN-major. The two consumers take turns issuing their wgmma batches (FWD_BARRIER_TURN),
//     so one's softmax runs while the other's products do. With OVERLAP a warpgroup also issues S_{j+1} = Q K_{j+1}^T
//     together with P_j V_j, and the softmax of tile j + 1 runs while P_j V_j does (P alternates between two
//     register sets by tile parity; at hd 64 P_j V_j is waited for in the next step: LATE_WAIT).
// Barriers. kv_ring: full[s] completes with the producer's arrive.expect_tx of K and V's bytes; empty[s] with one
// arrival per consumer thread, once the P V reading the stage has been waited on. q_ring: full with the Q's bytes;
// empty with one arrival per consumer thread, with two Q buffers once the epilogue that staged its output there is
// done (after a proxy fence: TMA writes next), with one as soon as the item's last S product is done.
// Epilogue per consumer warpgroup: lse = (m + log2 l) ln 2; O / l as bf16 through the warpgroup's own rows of the
// dead Q tile (FWD_BARRIER_EPILOGUE), then 16-byte stores; with the Q released early, straight from the registers
// (4-byte stores, a quad's lanes 16 contiguous bytes of a row).
// Shared memory 226 KiB at (hd 64, 6 stages, two Q buffers) and at (hd 128, 3 stages, one); registers: 168 at launch,
// 24 / 240 after setmaxnreg (pipeline.cuh).
// qkv_map: qkv as (hd, head, token, batch), box (64, 1, 128, 1) (attention_heads_tensor_map with 128 rows). grid: at
// most B H ceil(T / 128) CTAs (persistent: the SMs), block WS_THREADS.
template <int HD, int STAGES, bool OVERLAP>
__global__ void __launch_bounds__(WS_THREADS, 1)
    attention_forward_wgmma_kernel(const __grid_constant__ CUtensorMap qkv_map, __nv_bfloat16* out, float* lse, int B,
                                   int T, int H, int KV, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma and setmaxnreg exist only in sm_90a code
    constexpr int BN = WGMMA_FWD_KEYS, QBYTES = WGMMA_ROWS * HD * 2, TBYTES = BN * HD * 2;  // tile sizes in bytes
    constexpr int QBUF = attention_forward_wgmma_q_buffers<HD, STAGES>();
    constexpr bool EARLY_Q = QBUF == 1 && OVERLAP;  // Q released after the item's last S product
    constexpr bool PERSISTENT = attention_forward_wgmma_persistent<HD, STAGES, OVERLAP>();
    using Smem = AttentionForwardSmem<HD, STAGES, QBUF>;
    static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
    static_assert(STAGES >= 2, "at least 2 K / V stages");
    // LATE_WAIT: a step waits for tile j + 1 before it releases tile j - 1's stage; with 2 stages the two wait for
    // each other.
    static_assert(!(OVERLAP && HD == 64) || STAGES >= 3, "LATE_WAIT (hd 64 with overlap) needs at least 3 stages");
    static_assert(ws_smem_bytes<Smem>() <= WS_SMEM_LIMIT, "stages do not fit in shared memory");
    Smem& sm = ws_shared_storage<Smem>();
    const int q_tiles = ceil_div(T, WGMMA_ROWS), BH = B * H, n_items = BH * q_tiles;

    if (threadIdx.x == 0) {
        sm.q_ring.init(1, WS_CONSUMER_THREADS);
        sm.kv_ring.init(1, WS_CONSUMER_THREADS);
    }
    ws_publish_barriers();

    if (threadIdx.x < 128) {  // producer warpgroup
        setmaxnreg_dec<WS_PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            RingState<QBUF> q_pos;
            RingState<STAGES> kv_pos;  // carried across items
            for (int i = 0, item = persistent_item(0); item < n_items; item = persistent_item(++i)) {
                int b, h, q0;
                attention_forward_item(item, H, BH, q_tiles, b, h, q0);
                const int kvh = h / (H / KV), n_tiles = ceil_div(min(q0 + WGMMA_ROWS, T), BN);
                sm.q_ring.acquire(q_pos, QBYTES);  // the buffer's last item is done with it
                for (int cb = 0; cb < HD / 64; cb++) {
                    tma_load_4d(smem_addr(sm.q[q_pos.stage]) + cb * (WGMMA_ROWS * 128), &qkv_map,
                                sm.q_ring.full_bar(q_pos.stage), 64 * cb, h, q0, b);
                }
                q_pos.advance();
                for (int j = 0; j < n_tiles; j++, kv_pos.advance()) {
                    const int s = kv_pos.stage;
                    sm.kv_ring.acquire(kv_pos, 2 * TBYTES);  // K and V, all column blocks
                    for (int cb = 0; cb < HD / 64; cb++) {
                        tma_load_4d(smem_addr(sm.k[s]) + cb * (BN * 128), &qkv_map, sm.kv_ring.full_bar(s), 64 * cb,
                                    H + kvh, j * BN, b);
                        tma_load_4d(smem_addr(sm.v[s]) + cb * (BN * 128), &qkv_map, sm.kv_ring.full_bar(s), 64 * cb,
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
    const TurnTaking<FWD_BARRIER_TURN> turns{wg};
    turns.start();
    RingState<QBUF> q_pos;
    RingState<STAGES> kv_pos;  // the K / V tile being read, carried across items
    for (int i = 0, item = persistent_item(0); item < n_items; item = persistent_item(++i)) {
        int b, h, q0;
        attention_forward_item(item, H, BH, q_tiles, b, h, q0);
        const int n_tiles = ceil_div(min(q0 + WGMMA_ROWS, T), BN);  // causal: keys up to the item's last query
        const int buf = q_pos.stage;
        const int qwg = q0 + 64 * wg;          // the warpgroup's first query
        const int row0 = qwg + 16 * warp + g;  // this thread's rows: row0 and row0 + 8

        float o[HD / 2];  // O accumulator fragment (64 x HD per warpgroup)
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows row0, row0 + 8: running max (log2), sums
#pragma unroll
        for (int r = 0; r < HD / 2; r++) o[r] = 0.0f;
        float s[BN / 2];          // S accumulator fragment (64 x 128)
        uint32_t p[BN / 16][4];   // P as bf16 A registers, live until its P V wgmma has been waited on
        float alpha[2];
        const uint64_t q_desc = wgmma_desc_kmajor(smem_addr(sm.q[buf]) + 64 * wg * 128);  // the warpgroup's Q rows
        // stage 0's K and V; stage s is TBYTES s further on
        const uint64_t k_desc = wgmma_desc_kmajor(smem_addr(sm.k[0]));
        const uint64_t v_desc = wgmma_desc_mnmajor(smem_addr(sm.v[0]), BN);
        sm.q_ring.wait_full(q_pos);

        if constexpr (!OVERLAP) {
            for (int j = 0; j < n_tiles; j++, kv_pos.advance()) {
                const int st = kv_pos.stage;
                sm.kv_ring.wait_full(kv_pos);
                turns.wait();
                wgmma_fence();
                wgmma_scores_ss<HD, WGMMA_ROWS, BN>(s, q_desc, wgmma_desc_advance(k_desc, st * TBYTES));
                turns.pass();
                wgmma_wait_group<0>();
                pin_registers(s);
                attention_forward_wgmma_softmax(s, p, m, l, alpha, j * BN, qwg, row0, c, scale_log2);
                attention_forward_wgmma_rescale<HD>(o, alpha);
                pin_registers(p);  // P and the rescaled O are written before the wgmma.fence
                pin_registers(o);
                turns.wait();
                wgmma_fence();
                attention_forward_wgmma_pv<HD>(o, p, wgmma_desc_advance(v_desc, st * TBYTES));
                turns.pass();
                wgmma_wait_group<0>();
                pin_registers(o);
                pin_registers(p);
                sm.kv_ring.release(st);  // this thread's reads of the stage are done
            }
        } else {
            // P_j lives in p (j even) or pb (j odd) (no register copies: ptxas serialises the wgmmas when ordinary
            // instructions define their A registers inside the pipeline).
            uint32_t pb[BN / 16][4];
            // Where P_j V_j is waited for (and its stage released, O rescaled). Right after the softmax of S_{j+1},
            // ptxas schedules the softmax below the wait (register arithmetic moves freely past wgmma.wait_group). At
            // hd 64 the wait goes to the start of the next step, after the tile's mbarrier wait, and the softmax stays
            // between the two waits: +1-4% (H100). At hd 128 that makes ptxas serialise the wgmmas (C7512:
            // registers), and keeping the softmax ahead of the wait there by other means was 5% slower.
            constexpr bool LATE_WAIT = HD == 64;
            int prev_stage = 0;  // with LATE_WAIT, tile j - 1's stage, released in step j
            // Tile j < n_tiles - 1 (at kv_pos): S_{j+1} and P_j V_j issued together, the softmax of S_{j+1} (into
            // p_next) while P_j V_j runs.
            auto step = [&](int j, uint32_t(&p_cur)[BN / 16][4], uint32_t(&p_next)[BN / 16][4]) {
                const RingState<STAGES> next = kv_pos.next();
                const int st = kv_pos.stage, nst = next.stage;
                sm.kv_ring.wait_full(next);
                if constexpr (LATE_WAIT) {
                    wgmma_wait_group<0>();
                    pin_registers(o);
                    pin_registers(p_next);
                    if (j > 0) sm.kv_ring.release(prev_stage);
                    attention_forward_wgmma_rescale<HD>(o, alpha);
                }
                pin_registers(p_cur);
                pin_registers(o);
                turns.wait();
                wgmma_fence();
                wgmma_scores_ss<HD, WGMMA_ROWS, BN>(s, q_desc, wgmma_desc_advance(k_desc, nst * TBYTES));  // S_{j+1}
                attention_forward_wgmma_pv<HD>(o, p_cur, wgmma_desc_advance(v_desc, st * TBYTES));  // P_j V_j
                turns.pass();
                wgmma_wait_group<1>();  // groups complete in order: S_{j+1} is done, P_j V_j may still run
                pin_registers(s);
                if (EARLY_Q && j + 2 == n_tiles) sm.q_ring.release(buf);  // the item's last S is done
                attention_forward_wgmma_softmax(s, p_next, m, l, alpha, (j + 1) * BN, qwg, row0, c, scale_log2);
                if constexpr (!LATE_WAIT) {
                    wgmma_wait_group<0>();  // P_j V_j done: O may be rescaled, P_j's registers and stage st are free
                    pin_registers(o);
                    pin_registers(p_cur);
                    sm.kv_ring.release(st);
                    attention_forward_wgmma_rescale<HD>(o, alpha);
                }
                prev_stage = st;
                kv_pos = next;
            };
            // The last tile (at kv_pos): P V only.
            auto last = [&](int j, uint32_t(&p_cur)[BN / 16][4]) {
                const int st = kv_pos.stage;
                if constexpr (LATE_WAIT) {
                    wgmma_wait_group<0>();
                    pin_registers(o);
                    if (j > 0) sm.kv_ring.release(prev_stage);
                    attention_forward_wgmma_rescale<HD>(o, alpha);
                }
                pin_registers(p_cur);
                pin_registers(o);
                turns.wait();
                wgmma_fence();
                attention_forward_wgmma_pv<HD>(o, p_cur, wgmma_desc_advance(v_desc, st * TBYTES));
                turns.pass();
                wgmma_wait_group<0>();
                pin_registers(o);
                pin_registers(p_cur);
                sm.kv_ring.release(st);
                kv_pos.advance();
            };
            // Prologue: S_0 and its softmax (O is zero: no rescale).
            sm.kv_ring.wait_full(kv_pos);
            turns.wait();
            wgmma_fence();
            wgmma_scores_ss<HD, WGMMA_ROWS, BN>(s, q_desc, wgmma_desc_advance(k_desc, kv_pos.stage * TBYTES));
            turns.pass();
            wgmma_wait_group<0>();
            pin_registers(s);
            if (EARLY_Q && n_tiles == 1) sm.q_ring.release(buf);
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

        // Epilogue. lse, then O / l as bf16 into the warpgroup's own rows of the (dead) Q tile, then coalesced
        // stores; then the buffer is released for a later item's Q. With the Q released early, O goes out from the
        // registers.
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
        } else {
            uint8_t* staged = reinterpret_cast<uint8_t*>(sm.q[buf]);
            const int lr = 64 * wg + 16 * warp + g;  // the thread's first row inside the Q tile
#pragma unroll
            for (int jn = 0; jn < HD / 8; jn++) {
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    *reinterpret_cast<uint32_t*>(staged + swizzle128_offset<WGMMA_ROWS>(lr + 8 * r, jn) + 2 * c) =
                        pack_bf16x2(o[4 * jn + 2 * r] * inv_l[r], o[4 * jn + 2 * r + 1] * inv_l[r]);
                }
            }
            named_barrier_sync<128>(FWD_BARRIER_EPILOGUE + wg);  // the warpgroup's rows are staged
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
            if constexpr (!PERSISTENT) break;  // no state carried between items: the single-item code
            // The TMA that loads a later item's Q into this buffer must come after these generic accesses.
            fence_proxy_async_shared();
            sm.q_ring.release(buf);
        }
        q_pos.advance();
    }
    turns.finish();
#else
    // Not sm_90a code: never launched (attention.cuh's dispatch checks attention_wgmma_usable).
    __trap();
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// Host side

// Persistent (one CTA per SM taking work items in turn: attention_forward_wgmma_persistent) unless one_item_per_cta;
// else one CTA per work item.
template <int HD, int STAGES, bool OVERLAP>
inline void attention_forward_wgmma_launch(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV,
                                           cudaStream_t stream, bool one_item_per_cta = false) {
    static bool prepared = false;
    constexpr int QBUF = attention_forward_wgmma_q_buffers<HD, STAGES>();
    const size_t smem = ws_smem_bytes<AttentionForwardSmem<HD, STAGES, QBUF>>();
    ws_prepare_kernel(attention_forward_wgmma_kernel<HD, STAGES, OVERLAP>, "attention_forward_wgmma", smem, prepared);
    const CUtensorMap map = attention_heads_tensor_map(qkv, B, T, H + 2 * KV, HD, WGMMA_ROWS);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)HD);
    const int items = B * H * ceil_div(T, WGMMA_ROWS);
    const bool persistent = attention_forward_wgmma_persistent<HD, STAGES, OVERLAP>() && !one_item_per_cta;
    const int grid = persistent ? std::min(items, ws_sm_count()) : items;
    attention_forward_wgmma_kernel<HD, STAGES, OVERLAP>
        <<<grid, WS_THREADS, smem, stream>>>(map, out, lse, B, T, H, KV, scale_log2);
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

#endif  // !ENABLE_FP32
