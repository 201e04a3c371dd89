// The two matmuls beside SwiGLU with its passes fused into their epilogues (Hopper: bf16 build, sm_90a code, compute
// capability 9.0). Layouts row-major, N tokens, C channels, F hidden features, h13 (N, 2F) = [g | u]:
//   forward:  h13 = x (N, C) w13^T (w13 = [w1; w3], (2F, C)),  hact (N, F) = silu(g) u       (swiglu.cuh's forward)
//   backward: dhact (N, F) = dout (N, C) w2 (C, F), never stored,
//             dh13 (N, 2F) = [dg | du] and hact = silu(g) u (recomputed)                    (swiglu.cuh's backward)
// Each tile is rounded to bf16 first and the SwiGLU pass computed on chip from those values, so the results are the
// same bits as cuBLASLt's product followed by swiglu_forward / swiglu_backward. The forward saves reading h13 back
// (2 N F bf16), the backward dhact's write and read-back (2 N F).
//
// The kernel: persistent, warp-specialised (pipeline.cuh: a producer warpgroup, two consumer warpgroups, a ring of
// stages), in clusters of two CTAs along N.
//   * The producer loads each 64-deep k-block of A (128 rows of x or dout) and B (192 columns) by TMA (128-byte
//     swizzle) into the ring: 4 stages in the forward, 5 in the backward, whose mainloop waits for its data under the
//     epilogue's HBM traffic. The two CTAs of a cluster take tiles one above the other, which share B: each loads
//     half of B's k-block and multicasts it to both, so a stage is refilled only when the consumers of both CTAs are
//     done with it. In the forward B's halves are 96 rows of w1 and the same 96 features' rows of w3, so each thread
//     holds a feature's gate and up in one tile; in the backward B is 192 columns of w2.
//   * The consumers ping-pong: each owns whole 128 x 192 tiles (two m64n192k16 wgmmas per k16 step, 192 fp32
//     accumulators a thread), taking the CTA's tiles in turn, so one's epilogue runs while the other's products keep
//     the tensor cores busy.
//   * The epilogue: each warp writes its 32 rows of the tile as bf16 into its staging buffer (rows padded to 400
//     bytes: conflict-free; the backward's buffer holds 16 rows, one half after the other, to make room for its
//     fifth stage), then reads them back 16 bytes a lane and stores them with the SwiGLU pass's outputs: forward g, u
//     and hact; backward, beside 16-byte loads of g and u several in flight (fragment-order 4-byte loads leave HBM
//     idle), dg, du and hact.
// Checked against cuBLASLt + the SwiGLU pass, and timed, by dev/cuda/matmul_swiglu.cu; its header has the history.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda_common.h"
#include "matmul.cuh"
#include "pipeline.cuh"
#include "ptx.cuh"
#include "swiglu.cuh"
#include "tensor_map.cuh"

#if !defined(ENABLE_FP32)

constexpr int MMSW_BM = 128, MMSW_BN = 192, MMSW_BK = 64, MMSW_CLUSTER = 2;
constexpr int MMSW_GROUP_UNITS = 8;  // units (tile pairs) per group of rows in the persistent order (L2 reuse)
constexpr int MMSW_A_BYTES = MMSW_BM * MMSW_BK * 2, MMSW_B_BYTES = MMSW_BN * MMSW_BK * 2;
constexpr int MMSW_STAGE_BYTES = MMSW_A_BYTES + MMSW_B_BYTES;
constexpr int MMSW_ROW_BYTES = MMSW_BN * 2 + 16;

// The consumers' named barriers (TurnTaking): the mainloop's turns (1: warpgroup 0's, 2: warpgroup 1's) and the
// epilogue's (3, 4), whose staging buffers the two warpgroups share.
enum MatmulSwigluBarrier : int { MMSW_MAINLOOP_TURNS = 1, MMSW_EPILOGUE_TURNS = 3 };

// What each direction's epilogue reads and writes; the kernel is templated on it. `stages`: the ring's depth;
// `rows`: a warp's rows staged in shared memory at a time (its 32, or one 16-row half after the other, which frees
// the room for a fifth stage).
struct SwigluForwardEpilogue {
    floatX* h13;   // (N, 2F) = [g | u], written
    floatX* hact;  // (N, F), written
    static constexpr bool forward = true;
    static constexpr int features = MMSW_BN / 2;  // per tile: a tile's columns are 96 gates and their 96 ups
    static constexpr int stages = 4, rows = 32;
};
struct SwigluBackwardEpilogue {
    const floatX* h13;  // (N, 2F) = [g | u]
    floatX* dh13;       // (N, 2F) = [dg | du], written
    floatX* hact;       // (N, F), written unless nullptr
    static constexpr bool forward = false;
    static constexpr int features = MMSW_BN;
    static constexpr int stages = 5, rows = 16;
};

// Shared memory: the ring's A and B tiles (each stage's on a 1024-byte boundary, as the swizzle's atoms need), a
// staging buffer per consumer warp (the two warpgroups' warps w share buffer w), the ring's barriers.
template <typename Epilogue>
struct MatmulSwigluSmem {
    uint8_t a[Epilogue::stages][MMSW_A_BYTES];
    uint8_t b[Epilogue::stages][MMSW_B_BYTES];
    uint8_t staging[4][Epilogue::rows * MMSW_ROW_BYTES];
    RingBarriers<Epilogue::stages> ring;
};
static_assert(MMSW_A_BYTES % WS_SMEM_ALIGN == 0 && MMSW_B_BYTES % WS_SMEM_ALIGN == 0,
              "every stage's tiles start on a swizzle atom's boundary");
static_assert(ws_smem_bytes<MatmulSwigluSmem<SwigluForwardEpilogue>>() <= WS_SMEM_LIMIT &&
                  ws_smem_bytes<MatmulSwigluSmem<SwigluBackwardEpilogue>>() <= WS_SMEM_LIMIT,
              "an SM's shared memory holds at most 227 KiB per block");

// Eight features of one row: g and u in (bf16), hact out, as swiglu_forward_kernel computes it.
__device__ __forceinline__ uint4 swiglu_forward8(uint4 gv, uint4 uv) {
    const uint32_t* gp = &gv.x;
    const uint32_t* up = &uv.x;
    uint4 act;
    uint32_t* ap = &act.x;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float g0 = __uint_as_float(gp[k] << 16), g1 = __uint_as_float(gp[k] & 0xffff0000u);
        const float u0 = __uint_as_float(up[k] << 16), u1 = __uint_as_float(up[k] & 0xffff0000u);
        ap[k] = pack_bf16x2(g0 * swiglu_sigmoid(g0) * u0, g1 * swiglu_sigmoid(g1) * u1);
    }
    return act;
}

// Eight columns of one row: dhact (bf16, from the tile), g and u in; dg, du and hact out, as swiglu_backward_kernel
// computes them.
__device__ __forceinline__ void swiglu_backward8(uint4 dv, uint4 gv, uint4 uv, uint4& dg, uint4& du, uint4& act) {
    const uint32_t* d = &dv.x;
    const uint32_t* gp = &gv.x;
    const uint32_t* up = &uv.x;
    uint32_t* dgp = &dg.x;
    uint32_t* dup = &du.x;
    uint32_t* ap = &act.x;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float d0 = __uint_as_float(d[k] << 16), d1 = __uint_as_float(d[k] & 0xffff0000u);
        const float g0 = __uint_as_float(gp[k] << 16), g1 = __uint_as_float(gp[k] & 0xffff0000u);
        const float u0 = __uint_as_float(up[k] << 16), u1 = __uint_as_float(up[k] & 0xffff0000u);
        const float s0 = swiglu_sigmoid(g0), s1 = swiglu_sigmoid(g1);
        dgp[k] = pack_bf16x2(d0 * u0 * s0 * (1.0f + g0 * (1.0f - s0)), d1 * u1 * s1 * (1.0f + g1 * (1.0f - s1)));
        dup[k] = pack_bf16x2(d0 * g0 * s0, d1 * g1 * s1);
        ap[k] = pack_bf16x2(g0 * s0 * u0, g1 * s1 * u1);
    }
}

// One warp's rows of the tile into its shared buffer as bf16, ROWS / 16 of its two 16-row halves from `first` on:
// rows 16 warp + g (+ 8) of the tile's 64-row half h become buffer rows 16 (h - first) + g (+ 8), columns 8 j + c,
// +1 of the fragments.
template <int ROWS>
__device__ __forceinline__ void stage_tile_rows(const float (&acc)[2][96], int first, uint32_t buf, int lane) {
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < ROWS / 16; i++) {
        const float* half = acc[first + i];
#pragma unroll
        for (int j = 0; j < 24; j++) {
            const uint32_t at = buf + (16 * i + g) * MMSW_ROW_BYTES + (8 * j + c) * 2;
            st_shared_u32(at, pack_bf16x2(half[4 * j], half[4 * j + 1]));
            st_shared_u32(at + 8 * MMSW_ROW_BYTES, pack_bf16x2(half[4 * j + 2], half[4 * j + 3]));
        }
    }
    __syncwarp();
}

// The tile row of the warp's row r (0-31: its rows of the first 64-row half, then of the second).
__device__ __forceinline__ int tile_row_of(int r, int warp) { return 64 * (r / 16) + 16 * warp + r % 16; }

// The forward's epilogue, one warp: its 32 rows of the tile of 96 features from `feature0` on (gates in the tile's
// columns 0-95, ups in 96-191), ROWS at a time through its buffer; features at or past F (the last tile column) are
// skipped.
__device__ __forceinline__ void swiglu_epilogue(const float (&acc)[2][96], uint32_t buf,
                                                const SwigluForwardEpilogue& epi, int tile_row, int feature0, int F,
                                                int warp, int lane) {
    constexpr int ROWS = SwigluForwardEpilogue::rows;
    constexpr int VECS = MMSW_BN / 16;  // vectors of 8 features in a row's gates (and in its ups)
#pragma unroll
    for (int pass = 0; pass < 32 / ROWS; pass++) {
        stage_tile_rows<ROWS>(acc, pass * ROWS / 16, buf, lane);
#pragma unroll 4
        for (int i = 0; i < ROWS * VECS / 32; i++) {  // ROWS rows x 12 vectors
            const int v = lane + 32 * i, r = v / VECS, q = v % VECS, col = feature0 + 8 * q;
            const int row = tile_row + tile_row_of(pass * ROWS + r, warp);
            if (col < F) {
                const uint4 gv = ld_shared_v4(buf + r * MMSW_ROW_BYTES + 16 * q);
                const uint4 uv = ld_shared_v4(buf + r * MMSW_ROW_BYTES + MMSW_BN + 16 * q);
                floatX* gate = epi.h13 + (size_t)row * 2 * F + col;
                *reinterpret_cast<uint4*>(gate) = gv;
                *reinterpret_cast<uint4*>(gate + F) = uv;
                *reinterpret_cast<uint4*>(epi.hact + (size_t)row * F + col) = swiglu_forward8(gv, uv);
            }
        }
        __syncwarp();
    }
}

// The backward's epilogue, one warp: its 32 rows of the dhact tile at columns (features) feature0 onwards, ROWS at
// a time through its buffer; columns at or past F (the last tile column) are skipped.
__device__ __forceinline__ void swiglu_epilogue(const float (&acc)[2][96], uint32_t buf,
                                                const SwigluBackwardEpilogue& epi, int tile_row, int feature0, int F,
                                                int warp, int lane) {
    constexpr int ROWS = SwigluBackwardEpilogue::rows;
    // ROWS rows x 24 vectors of 8 columns per pass, 4 at a time per lane (6 or more spill: the loads' registers)
    constexpr int VECS = MMSW_BN / 8, BATCH = 4;
#pragma unroll
    for (int pass = 0; pass < 32 / ROWS; pass++) {
        stage_tile_rows<ROWS>(acc, pass * ROWS / 16, buf, lane);
#pragma unroll 1
        for (int batch = 0; batch < ROWS * VECS / 32 / BATCH; batch++) {
            uint4 gv[BATCH], uv[BATCH];
#pragma unroll
            for (int i = 0; i < BATCH; i++) {
                const int v = lane + 32 * (BATCH * batch + i), col = feature0 + 8 * (v % VECS);
                const int row = tile_row + tile_row_of(pass * ROWS + v / VECS, warp);
                if (col < F) {
                    const floatX* gate = epi.h13 + (size_t)row * 2 * F + col;
                    gv[i] = __ldg(reinterpret_cast<const uint4*>(gate));
                    uv[i] = __ldg(reinterpret_cast<const uint4*>(gate + F));
                }
            }
#pragma unroll
            for (int i = 0; i < BATCH; i++) {
                const int v = lane + 32 * (BATCH * batch + i), r = v / VECS, col = feature0 + 8 * (v % VECS);
                const int row = tile_row + tile_row_of(pass * ROWS + r, warp);
                if (col < F) {
                    uint4 dg, du, act;
                    swiglu_backward8(ld_shared_v4(buf + r * MMSW_ROW_BYTES + (v % VECS) * 16), gv[i], uv[i], dg, du,
                                     act);
                    floatX* dgate = epi.dh13 + (size_t)row * 2 * F + col;
                    *reinterpret_cast<uint4*>(dgate) = dg;
                    *reinterpret_cast<uint4*>(dgate + F) = du;
                    if (epi.hact != nullptr) *reinterpret_cast<uint4*>(epi.hact + (size_t)row * F + col) = act;
                }
            }
        }
        __syncwarp();
    }
}

// Work unit `unit` of the persistent order (a pair of tiles one above the other): groups of MMSW_GROUP_UNITS unit
// rows, column by column inside a group, so the CTAs running at once share a few A row panels and B column panels in
// L2.
__device__ __forceinline__ void matmul_swiglu_unit(int unit, int units_m, int units_n, int& um, int& un) {
    const int group = unit / (MMSW_GROUP_UNITS * units_n), first_m = group * MMSW_GROUP_UNITS;
    const int rows = min(units_m - first_m, MMSW_GROUP_UNITS), in_group = unit - group * MMSW_GROUP_UNITS * units_n;
    um = first_m + in_group % rows;
    un = in_group / rows;
}

// The product A (M, K) B, its (M, 192) tiles handed to the epilogue; M a multiple of 256, K of 64, F of 8.
//   forward:  B = [w1; w3]^T: b_map is w1 (F, K), b3_map w3 (F, K), K contiguous (TMA fills rows past F with zeros)
//   backward: B = w2 (K, F), F contiguous (wgmma's "transpose B"; b3_map unused; TMA fills columns past F with zeros)
template <typename Epilogue>
__global__ void __launch_bounds__(WS_THREADS, 1)
    matmul_swiglu_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                         const __grid_constant__ CUtensorMap b3_map, int M, int F, int K, const Epilogue epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int CLUSTER = MMSW_CLUSTER, TRANS_B = Epilogue::forward ? 0 : 1, STAGES = Epilogue::stages;
    constexpr int WARP_BYTES = Epilogue::rows * MMSW_ROW_BYTES;
    MatmulSwigluSmem<Epilogue>& sm = ws_shared_storage<MatmulSwigluSmem<Epilogue>>();
    const uint32_t a_sm = smem_addr(sm.a), b_sm = smem_addr(sm.b), staging_sm = smem_addr(sm.staging);
    const int rank = (int)cluster_cta_rank();
    const int units_m = M / MMSW_BM / CLUSTER, units_n = (F + Epilogue::features - 1) / Epilogue::features;
    const int n_units = units_m * units_n;
    const int k_blocks = K / MMSW_BK, first_unit = blockIdx.x / CLUSTER, unit_stride = gridDim.x / CLUSTER;
    // A stage's readers: the using warpgroup's 4 warps, in both CTAs. The peer CTA arrives on these barriers and its
    // multicast credits them, so they are published to the cluster, not only to this CTA (ws_publish_barriers).
    if (threadIdx.x == 0) {
        sm.ring.init(1, 4 * CLUSTER);
        fence_mbarrier_init();
    }
    cluster_sync();

    if (threadIdx.x < 128) {  // producer
        setmaxnreg_dec<WS_PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            RingState<STAGES> p;
            for (int unit = first_unit; unit < n_units; unit += unit_stride) {
                int um, tn;
                matmul_swiglu_unit(unit, units_m, units_n, um, tn);
                const int tm = um * CLUSTER + rank;
                // one k-block at a time: unrolled, the loop spilled in the producer's 24 registers
#pragma unroll 1
                for (int kb = 0; kb < k_blocks; kb++, p.advance()) {
                    const uint32_t full = sm.ring.full_bar(p.stage), b_dst = b_sm + p.stage * MMSW_B_BYTES;
                    sm.ring.acquire(p, MMSW_STAGE_BYTES);
                    tma_load_2d(a_sm + p.stage * MMSW_A_BYTES, &a_map, full, kb * MMSW_BK, tm * MMSW_BM);
                    if constexpr (Epilogue::forward) {
                        // this CTA loads the k-block of one half (rank 0: w1's 96 rows, 1: w3's)
                        tma_load_2d_multicast(b_dst + rank * (MMSW_B_BYTES / 2), rank == 0 ? &b_map : &b3_map, full,
                                              kb * MMSW_BK, tn * Epilogue::features, 3);
                    } else {
                        // three 64-column blocks of 64 k-rows; this CTA loads 32 of the k-rows of each
                        for (int cb = 0; cb < MMSW_BN / 64; cb++) {
                            tma_load_2d_multicast(b_dst + cb * (MMSW_BK * 128) + rank * (MMSW_BK * 64), &b_map, full,
                                                  tn * MMSW_BN + 64 * cb, kb * MMSW_BK + rank * (MMSW_BK / 2), 3);
                        }
                    }
                }
            }
        }
        __syncwarp();
    } else {
        setmaxnreg_inc<WS_CONSUMER_REGS>();
        const int wg = ws_consumer_index(), warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const uint64_t a_desc = wgmma_desc_sw128(a_sm, 16, 1024);
        // B: K-major like A (forward), or 64-column blocks of 64 k-rows (backward)
        const uint64_t b_desc = wgmma_desc_sw128(b_sm, TRANS_B ? MMSW_BK * 128 : 16, 1024);
        auto release = [&](int stage) {  // this warp is done reading the stage, in both CTAs
            if (lane < CLUSTER) mbarrier_arrive_cluster(sm.ring.empty_bar(stage), lane);
        };
        float acc[2][96];
        // Warpgroup wg takes the CTA's tiles wg, wg + 2, ...; a tile's k-blocks are ring entries `entry` onwards. The
        // mainloops take turns: a warpgroup waits on a stage's full barrier only once the other has waited on every
        // earlier entry, so the ring is never more than one round ahead of the parity it waits for. The epilogues
        // take turns the same way, for the staging buffers. A warpgroup passes a turn only when the CTA has a next
        // unit (the other warpgroup's next tile): every pass is then waited for, and none is left pending at exit
        // (hence no TurnTaking::finish).
        const TurnTaking<MMSW_MAINLOOP_TURNS> mainloop_turns{wg};
        const TurnTaking<MMSW_EPILOGUE_TURNS> epilogue_turns{wg};
        mainloop_turns.start();
        epilogue_turns.start();
        for (int entry = wg * k_blocks, unit = first_unit + wg * unit_stride; unit < n_units;
             entry += 2 * k_blocks, unit += 2 * unit_stride) {
            int um, tn;
            matmul_swiglu_unit(unit, units_m, units_n, um, tn);
            const int tm = um * CLUSTER + rank;
            const bool other_has_next = unit + unit_stride < n_units;
            RingState<STAGES> c{entry % STAGES, (uint32_t)(entry / STAGES) & 1};  // once per tile
            int previous = 0;  // the stage of the previous k-block
            // The wgmmas read the accumulators (the first one scales them by 0): clearing them here tells the
            // compiler that the last tile's values are dead after its epilogue, which may then use their registers
            // (without it the epilogue spills).
#pragma unroll
            for (int i = 0; i < 96; i++) acc[0][i] = acc[1][i] = 0.0f;
            mainloop_turns.wait();
            for (int kb = 0; kb < k_blocks; kb++) {
                sm.ring.wait_full(c);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < MMSW_BK / 16; kk++) {
                    const uint64_t b = wgmma_desc_advance(b_desc, c.stage * MMSW_B_BYTES + (TRANS_B ? 2048 : 32) * kk);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        wgmma_bf16_ss_t<0, TRANS_B>(
                            acc[h], wgmma_desc_advance(a_desc, c.stage * MMSW_A_BYTES + h * 8192 + 32 * kk), b,
                            kb > 0 || kk > 0);
                    }
                }
                wgmma_commit_group();
                if (kb > 0) {  // the previous k-block's wgmmas are done: its stage is free
                    wgmma_wait_group<1>();
                    release(previous);
                }
                previous = c.stage;
                c.advance();
            }
            if (other_has_next) mainloop_turns.pass();
            wgmma_wait_group<0>();
            pin_registers(acc[0]);
            pin_registers(acc[1]);
            release(previous);
            epilogue_turns.wait();
            swiglu_epilogue(acc, staging_sm + warp * WARP_BYTES, epi, tm * MMSW_BM, tn * Epilogue::features, F, warp,
                            lane);
            if (other_has_next) epilogue_turns.pass();
        }
    }
    cluster_sync();
#else
    __trap();  // not sm_90a code: never launched (matmul_swiglu_usable)
#endif
}

// True when the fused kernel of this direction runs on this device (sm90a_kernel_runs) and takes these shapes and
// pointers (`any`: their addresses or'd together).
template <typename Epilogue>
inline bool matmul_swiglu_usable(uintptr_t any, int N, int F, int C) {
    static PerDeviceFlag cache;
    return sm90a_kernel_runs(matmul_swiglu_kernel<Epilogue>, cache) && N % (MMSW_CLUSTER * MMSW_BM) == 0 &&
           F % 8 == 0 && C % MMSW_BK == 0 && (any & 15) == 0;
}

// Launches the kernel persistently: as many clusters as fit at once, at most one per unit. The first launch sets
// the kernel up (ws_prepare_kernel: a register split that does not fit is a build error, reported as one).
template <typename Epilogue>
inline void matmul_swiglu_launch(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& b3_map, int N,
                                 int F, int C, const Epilogue& epi, cudaStream_t stream) {
    static bool prepared = false;
    static int clusters = 0;
    constexpr size_t smem = ws_smem_bytes<MatmulSwigluSmem<Epilogue>>();
    ws_prepare_kernel(matmul_swiglu_kernel<Epilogue>,
                      Epilogue::forward ? "matmul_swiglu_kernel (forward)" : "matmul_swiglu_kernel (backward)", smem,
                      prepared);
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = MMSW_CLUSTER;
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.blockDim = dim3(WS_THREADS);
    config.dynamicSmemBytes = smem;
    config.attrs = &attr;
    config.numAttrs = 1;
    if (clusters == 0) {
        config.gridDim = dim3(ws_sm_count() / MMSW_CLUSTER * MMSW_CLUSTER);
        // a GPC with an odd number of SMs leaves one out: ask how many clusters fit at once
        cudaCheck(cudaOccupancyMaxActiveClusters(&clusters, matmul_swiglu_kernel<Epilogue>, &config));
    }
    const int units = (N / MMSW_BM / MMSW_CLUSTER) * ((F + Epilogue::features - 1) / Epilogue::features);
    config.gridDim = dim3(MMSW_CLUSTER * std::min(clusters, units));
    config.stream = stream;
    cudaCheck(cudaLaunchKernelEx(&config, matmul_swiglu_kernel<Epilogue>, a_map, b_map, b3_map, N, F, C, epi));
}

// h13 (N, 2F) = inp (N, C) w13^T and hact (N, F) from inp and w13 (2F, C) = [w1; w3].
inline void matmul_swiglu_forward_fused(floatX* h13, floatX* hact, const floatX* inp, const floatX* w13, int N, int F,
                                        int C, cudaStream_t stream) {
    const CUtensorMap a_map = tensor_map_2d(inp, C, N, MMSW_BK, MMSW_BM, "matmul_swiglu inp (C, N)");
    const CUtensorMap w1_map = tensor_map_2d(w13, C, F, MMSW_BK, MMSW_BN / 2, "matmul_swiglu w1 (C, F)");
    const CUtensorMap w3_map =
        tensor_map_2d(w13 + (size_t)F * C, C, F, MMSW_BK, MMSW_BN / 2, "matmul_swiglu w3 (C, F)");
    matmul_swiglu_launch(a_map, w1_map, w3_map, N, F, C, SwigluForwardEpilogue{h13, hact}, stream);
}

// dh13 (N, 2F) = [dg | du] and hact (N, F) (unless nullptr) from dout (N, C), w2 (C, F) and h13 (N, 2F).
inline void matmul_swiglu_backward_fused(floatX* dh13, floatX* hact, const floatX* dout, const floatX* w2,
                                         const floatX* h13, int N, int F, int C, cudaStream_t stream) {
    const CUtensorMap a_map = tensor_map_2d(dout, C, N, MMSW_BK, MMSW_BM, "matmul_swiglu dout (C, N)");
    const CUtensorMap b_map = tensor_map_2d(w2, F, C, 64, MMSW_BK / 2, "matmul_swiglu w2 (F, C)");
    matmul_swiglu_launch(a_map, b_map, b_map, N, F, C, SwigluBackwardEpilogue{h13, dh13, hact}, stream);
}

#endif  // !ENABLE_FP32

// The w13 product and the SwiGLU forward: h13 (N, 2F) = inp (N, C) w13^T, w13 (2F, C) = [w1; w3], and hact (N, F) =
// silu(g) u. Fused on Hopper when the shapes allow; otherwise cuBLASLt's product and swiglu_forward. The same bits
// either way.
inline void matmul_swiglu_forward(floatX* h13, floatX* hact, const floatX* inp, const floatX* w13, int N, int F, int C,
                                  cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    const uintptr_t any = (uintptr_t)h13 | (uintptr_t)hact | (uintptr_t)inp | (uintptr_t)w13;
    if (matmul_swiglu_usable<SwigluForwardEpilogue>(any, N, F, C)) {
        matmul_swiglu_forward_fused(h13, hact, inp, w13, N, F, C, stream);
        return;
    }
#endif
    matmul_forward(h13, inp, w13, N, C, 2 * F, stream);
    swiglu_forward(hact, h13, N, F, stream);
}

// The w2 input gradient and the SwiGLU backward: dh13 = [dg | du] (N, 2F) and, unless nullptr, hact (N, F) (the
// recomputed activation), from dout (N, C) = the gradient of w2's output, w2 (C, F) and h13 (N, 2F). Fused on
// Hopper when the shapes allow; otherwise cuBLASLt's product into dhact (N, F, scratch) and swiglu_backward. The
// same bits either way.
inline void matmul_swiglu_backward(floatX* dh13, floatX* hact, floatX* dhact, const floatX* dout, const floatX* w2,
                                   const floatX* h13, int N, int F, int C, cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    const uintptr_t any = (uintptr_t)dh13 | (uintptr_t)hact | (uintptr_t)dout | (uintptr_t)w2 | (uintptr_t)h13;
    if (matmul_swiglu_usable<SwigluBackwardEpilogue>(any, N, F, C)) {
        matmul_swiglu_backward_fused(dh13, hact, dout, w2, h13, N, F, C, stream);
        return;
    }
#endif
    matmul_backward(dhact, nullptr, dout, nullptr, w2, N, F, C, false, stream);
    swiglu_backward(dh13, hact, dhact, h13, N, F, stream);
}
