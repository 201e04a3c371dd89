// The w2 dinp product with the SwiGLU backward in its epilogue (Hopper: bf16 build, sm_90a code, compute capability
// 9.0). Layouts row-major, N tokens, C channels, F hidden features:
//   dhact (N, F) = dout (N, C) W2 (C, F)                       the w2 product's input gradient, never stored
//   h13 (N, 2F) = [g | u]  ->  dh13 (N, 2F) = [dg | du],  hact (N, F) = silu(g) u     (swiglu.cuh's backward)
// Each dhact tile is rounded to bf16 and turned into dg, du and hact on chip, so the results are the same bits as
// matmul_backward (cuBLASLt) followed by swiglu_backward, without dhact's write and read-back (2 N F bf16 bytes).
//
// The kernel (dev/cuda/matmul_wgmma.cu, versions 6 and 7): persistent, one CTA of 3 warpgroups per SM, clusters of
// two CTAs along N (tokens).
//   * Warpgroup 0 produces: one thread loads each 64-deep k-block of A = dout (128 rows) and B = W2 (192 columns)
//     by TMA (128-byte swizzle) into a ring of 4 stages (full / empty mbarriers). The two CTAs of a cluster take
//     tiles one above the other, which share B: each loads half of B's k-block and multicasts it to both, so a stage
//     is refilled only when the consumers of both CTAs are done with it.
//   * Warpgroups 1 and 2 compute, ping-pong: each owns whole 128 x 192 tiles (two m64n192k16 wgmmas per k16 step,
//     192 fp32 accumulators a thread), taking the CTA's tiles in turn, so one warpgroup's epilogue runs while the
//     other's products keep the tensor cores busy (named barriers 1 and 2 pass the mainloop's turn).
//   * The epilogue: each warp writes its 32 rows of the tile as bf16 into its shared buffer (rows padded to 400
//     bytes: conflict-free), then reads them back 16 bytes a lane beside 16-byte loads of g and u, several in flight
//     (fragment-order 4-byte loads leave HBM idle), and stores dg, du and hact. The two warpgroups take turns on the
//     buffers (named barriers 3 and 4).
// Measured on an H100 at the power cap (dev/cuda/matmul_wgmma.cu, the 1B's shape N = 16384, F = 8192, C = 2048):
// see that file's header.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda_common.h"
#include "matmul.cuh"
#include "ptx.cuh"
#include "swiglu.cuh"
#include "tensor_map.cuh"

#if !defined(ENABLE_FP32)

constexpr int MMSW_BM = 128, MMSW_BN = 192, MMSW_BK = 64, MMSW_STAGES = 4, MMSW_THREADS = 384;
constexpr int MMSW_GROUP_UNITS = 4;  // units (tile pairs) per group of rows in the persistent order (L2 reuse)
constexpr int MMSW_A_BYTES = MMSW_BM * MMSW_BK * 2, MMSW_B_BYTES = MMSW_BN * MMSW_BK * 2;
constexpr int MMSW_STAGE_BYTES = MMSW_A_BYTES + MMSW_B_BYTES;
constexpr int MMSW_PRODUCER_REGS = 24, MMSW_CONSUMER_REGS = 240;  // 128 x 24 + 256 x 240 = 384 x 168
constexpr int MMSW_ROW_BYTES = MMSW_BN * 2 + 16, MMSW_WARP_BYTES = 32 * MMSW_ROW_BYTES;
constexpr int MMSW_SMEM_BYTES = MMSW_STAGES * MMSW_STAGE_BYTES + 4 * MMSW_WARP_BYTES + 1024 + 16 * MMSW_STAGES;

struct SwigluBackwardEpilogue {
    const floatX* h13;  // (N, 2F) = [g | u]
    floatX* dh13;       // (N, 2F) = [dg | du], written
    floatX* hact;       // (N, F), written unless nullptr
};

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

// One warp's epilogue: rows 16 warp + g (+ 8) of each 64-row half of the tile at (tile_row, tile_col), columns
// 8 j + c, +1 of the fragments. Columns at or past F (the last tile column) are skipped.
__device__ __forceinline__ void swiglu_backward_epilogue(const float (&acc)[2][96], uint32_t buf,
                                                         const SwigluBackwardEpilogue& epi, int tile_row,
                                                         int tile_col, int F, int warp, int lane) {
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int j = 0; j < 24; j++) {
            const uint32_t at = buf + (16 * h + g) * MMSW_ROW_BYTES + (8 * j + c) * 2;
            st_shared_u32(at, pack_bf16x2(acc[h][4 * j], acc[h][4 * j + 1]));
            st_shared_u32(at + 8 * MMSW_ROW_BYTES, pack_bf16x2(acc[h][4 * j + 2], acc[h][4 * j + 3]));
        }
    }
    __syncwarp();
    // 32 rows x 24 vectors of 8 columns, 24 per lane, 4 at a time (6 or more spill: the loads' registers)
    constexpr int VECS = MMSW_BN / 8, BATCH = 4;
#pragma unroll 1
    for (int batch = 0; batch < VECS / BATCH; batch++) {
        uint4 gv[BATCH], uv[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; i++) {
            const int v = lane + 32 * (BATCH * batch + i), r = v / VECS, col = tile_col + 8 * (v % VECS);
            const int row = tile_row + 64 * (r / 16) + 16 * warp + r % 16;
            if (col < F) {
                const floatX* gate = epi.h13 + (size_t)row * 2 * F + col;
                gv[i] = __ldg(reinterpret_cast<const uint4*>(gate));
                uv[i] = __ldg(reinterpret_cast<const uint4*>(gate + F));
            }
        }
#pragma unroll
        for (int i = 0; i < BATCH; i++) {
            const int v = lane + 32 * (BATCH * batch + i), r = v / VECS, col = tile_col + 8 * (v % VECS);
            const int row = tile_row + 64 * (r / 16) + 16 * warp + r % 16;
            if (col < F) {
                uint4 dg, du, act;
                swiglu_backward8(ld_shared_v4(buf + r * MMSW_ROW_BYTES + (v % VECS) * 16), gv[i], uv[i], dg, du, act);
                floatX* dgate = epi.dh13 + (size_t)row * 2 * F + col;
                *reinterpret_cast<uint4*>(dgate) = dg;
                *reinterpret_cast<uint4*>(dgate + F) = du;
                if (epi.hact != nullptr) *reinterpret_cast<uint4*>(epi.hact + (size_t)row * F + col) = act;
            }
        }
    }
    __syncwarp();
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

// out = A (M, K) B (K, N), A and B row-major (B's N index contiguous: wgmma's "transpose B"), its (M, N) tiles
// handed to the epilogue. M a multiple of 256, K of 64; N any multiple of 8 (TMA fills B past N with zeros).
__global__ void __launch_bounds__(MMSW_THREADS, 1)
    matmul_swiglu_backward_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                                  int M, int N, int K, const SwigluBackwardEpilogue epi) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int CLUSTER = 2;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t smem = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t a_sm = smem, b_sm = smem + MMSW_STAGES * MMSW_A_BYTES;
    const uint32_t epilogue_sm = b_sm + MMSW_STAGES * MMSW_B_BYTES, full0 = epilogue_sm + 4 * MMSW_WARP_BYTES;
    const uint32_t empty0 = full0 + 8 * MMSW_STAGES;
    const int rank = (int)cluster_cta_rank();
    const int units_m = M / MMSW_BM / CLUSTER, units_n = (N + MMSW_BN - 1) / MMSW_BN, n_units = units_m * units_n;
    const int k_blocks = K / MMSW_BK, first_unit = blockIdx.x / CLUSTER, unit_stride = gridDim.x / CLUSTER;
    if (threadIdx.x == 0) {
        for (int s = 0; s < MMSW_STAGES; s++) {
            mbarrier_init(full0 + 8 * s, 1);
            mbarrier_init(empty0 + 8 * s, 4 * CLUSTER);  // the using warpgroup's 4 warps, in both CTAs
        }
        fence_mbarrier_init();
    }
    cluster_sync();

    if (threadIdx.x < 128) {  // producer
        setmaxnreg_dec<MMSW_PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            int it = 0;
            for (int unit = first_unit; unit < n_units; unit += unit_stride) {
                int um, tn;
                matmul_swiglu_unit(unit, units_m, units_n, um, tn);
                const int tm = um * CLUSTER + rank;
                for (int kb = 0; kb < k_blocks; kb++, it++) {
                    const int s = it % MMSW_STAGES, round = it / MMSW_STAGES;
                    const uint32_t full = full0 + 8 * s, b_dst = b_sm + s * MMSW_B_BYTES;
                    if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);
                    mbarrier_arrive_expect_tx(full, MMSW_STAGE_BYTES);
                    tma_load_2d(a_sm + s * MMSW_A_BYTES, &a_map, full, kb * MMSW_BK, tm * MMSW_BM);
                    // B's k-block: three 64-column blocks of 64 k-rows; this CTA loads 32 of the k-rows of each
                    for (int cb = 0; cb < MMSW_BN / 64; cb++) {
                        tma_load_2d_multicast(b_dst + cb * (MMSW_BK * 128) + rank * (MMSW_BK * 64), &b_map, full,
                                              tn * MMSW_BN + 64 * cb, kb * MMSW_BK + rank * (MMSW_BK / 2), 3);
                    }
                }
            }
        }
        __syncwarp();
    } else {
        setmaxnreg_inc<MMSW_CONSUMER_REGS>();
        const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const uint64_t a_desc = wgmma_desc_sw128(a_sm, 16, 1024);
        const uint64_t b_desc = wgmma_desc_sw128(b_sm, MMSW_BK * 128, 1024);
        auto release = [&](int stage) {  // this warp is done reading the stage, in both CTAs
            if (lane < CLUSTER) mbarrier_arrive_cluster(empty0 + 8 * stage, lane);
        };
        float acc[2][96];
        // Warpgroup wg takes the CTA's tiles j = wg, wg + 2, ...; tile j's k-blocks are ring entries j k_blocks
        // onwards. The mainloops take turns (named barrier 1: warpgroup 0's turn, 2: warpgroup 1's): a warpgroup
        // waits on a stage's full barrier only once the other has waited on every earlier entry, so the ring is
        // never more than one round ahead of the parity it waits for. The epilogues take turns the same way
        // (barriers 3 and 4), for the shared buffers.
        if (wg == 1) {
            named_barrier_arrive<256>(1);
            named_barrier_arrive<256>(3);
        }
        for (int j = wg, unit = first_unit + wg * unit_stride; unit < n_units; j += 2, unit += 2 * unit_stride) {
            int um, tn;
            matmul_swiglu_unit(unit, units_m, units_n, um, tn);
            const int tm = um * CLUSTER + rank;
            int it = j * k_blocks;
            // The wgmmas read the accumulators (the first one scales them by 0): clearing them here tells the
            // compiler that the last tile's values are dead after its epilogue, which may then use their registers
            // (without it the epilogue spills).
#pragma unroll
            for (int i = 0; i < 96; i++) acc[0][i] = acc[1][i] = 0.0f;
            named_barrier_sync<256>(1 + wg);
            for (int kb = 0; kb < k_blocks; kb++, it++) {
                const int s = it % MMSW_STAGES;
                mbarrier_wait(full0 + 8 * s, (it / MMSW_STAGES) & 1);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < MMSW_BK / 16; kk++) {
                    const uint64_t b = wgmma_desc_advance(b_desc, s * MMSW_B_BYTES + 2048 * kk);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        wgmma_bf16_ss_t<0, 1>(acc[h], wgmma_desc_advance(a_desc, s * MMSW_A_BYTES + h * 8192 + 32 * kk),
                                              b, kb > 0 || kk > 0);
                    }
                }
                wgmma_commit_group();
                if (kb > 0) {  // the previous k-block's wgmmas are done: its stage is free
                    wgmma_wait_group<1>();
                    release((it - 1) % MMSW_STAGES);
                }
            }
            if (unit + unit_stride < n_units) named_barrier_arrive<256>(2 - wg);  // the next tile's mainloop
            wgmma_wait_group<0>();
            pin_registers(acc[0]);
            pin_registers(acc[1]);
            release((it - 1) % MMSW_STAGES);
            named_barrier_sync<256>(3 + wg);
            swiglu_backward_epilogue(acc, epilogue_sm + warp * MMSW_WARP_BYTES, epi, tm * MMSW_BM, tn * MMSW_BN, N,
                                     warp, lane);
            if (unit + unit_stride < n_units) named_barrier_arrive<256>(4 - wg);  // the next tile's epilogue
        }
    }
    cluster_sync();
#else
    __trap();  // not sm_90a code: never launched (matmul_swiglu_usable)
#endif
}

// True when the fused kernel runs on this device (sm90a_kernel_runs; its register split checked too) and takes these
// shapes and pointers.
inline bool matmul_swiglu_usable(const floatX* dh13, const floatX* hact, const floatX* dout, const floatX* w2,
                                 const floatX* h13, int N, int F, int C) {
    static PerDeviceFlag cache;
    static bool registers_ok = false, registers_checked = false;
    if (!sm90a_kernel_runs(matmul_swiglu_backward_kernel, cache)) return false;
    if (!registers_checked) {  // setmaxnreg.inc would wait forever for registers the launch did not give the CTA
        cudaFuncAttributes attr;
        cudaCheck(cudaFuncGetAttributes(&attr, matmul_swiglu_backward_kernel));
        registers_ok = attr.numRegs * MMSW_THREADS >= 128 * MMSW_PRODUCER_REGS + 256 * MMSW_CONSUMER_REGS;
        registers_checked = true;
    }
    const uintptr_t any = (uintptr_t)dh13 | (uintptr_t)hact | (uintptr_t)dout | (uintptr_t)w2 | (uintptr_t)h13;
    return registers_ok && N % (2 * MMSW_BM) == 0 && F % 8 == 0 && C % MMSW_BK == 0 && (any & 15) == 0;
}

// dh13 (N, 2F) = [dg | du] and hact (N, F) (unless nullptr) from dout (N, C), w2 (C, F) and h13 (N, 2F).
inline void matmul_swiglu_backward_fused(floatX* dh13, floatX* hact, const floatX* dout, const floatX* w2,
                                         const floatX* h13, int N, int F, int C, cudaStream_t stream) {
    static int clusters = 0;
    if (clusters == 0) {
        cudaCheck(cudaFuncSetAttribute(matmul_swiglu_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       MMSW_SMEM_BYTES));
        int sms = 0, device = 0;
        cudaCheck(cudaGetDevice(&device));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        cudaLaunchConfig_t probe = {};
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = 2;
        attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
        probe.gridDim = dim3(sms / 2 * 2);
        probe.blockDim = dim3(MMSW_THREADS);
        probe.dynamicSmemBytes = MMSW_SMEM_BYTES;
        probe.attrs = &attr;
        probe.numAttrs = 1;
        // a GPC with an odd number of SMs leaves one out: ask how many clusters fit at once
        cudaCheck(cudaOccupancyMaxActiveClusters(&clusters, matmul_swiglu_backward_kernel, &probe));
    }
    const CUtensorMap a_map = tensor_map_2d(dout, C, N, MMSW_BK, MMSW_BM, "matmul_swiglu dout (C, N)");
    const CUtensorMap b_map = tensor_map_2d(w2, F, C, 64, MMSW_BK / 2, "matmul_swiglu w2 (F, C)");
    const int units = (N / MMSW_BM / 2) * ((F + MMSW_BN - 1) / MMSW_BN);
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 2;
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    config.gridDim = dim3(2 * std::min(clusters, units));
    config.blockDim = dim3(MMSW_THREADS);
    config.dynamicSmemBytes = MMSW_SMEM_BYTES;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = 1;
    const SwigluBackwardEpilogue epi = {h13, dh13, hact};
    cudaCheck(cudaLaunchKernelEx(&config, matmul_swiglu_backward_kernel, a_map, b_map, N, F, C, epi));
}

#endif  // !ENABLE_FP32

// The w2 input gradient and the SwiGLU backward: dh13 = [dg | du] (N, 2F) and, unless nullptr, hact (N, F) (the
// recomputed activation), from dout (N, C) = the gradient of w2's output, w2 (C, F) and h13 (N, 2F). Fused on
// Hopper when the shapes allow; otherwise cuBLASLt's product into dhact (N, F, scratch) and swiglu_backward. The
// same bits either way.
inline void matmul_swiglu_backward(floatX* dh13, floatX* hact, floatX* dhact, const floatX* dout, const floatX* w2,
                                   const floatX* h13, int N, int F, int C, cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    if (matmul_swiglu_usable(dh13, hact, dout, w2, h13, N, F, C)) {
        matmul_swiglu_backward_fused(dh13, hact, dout, w2, h13, N, F, C, stream);
        return;
    }
#endif
    matmul_backward(dhact, nullptr, dout, nullptr, w2, N, F, C, false, stream);
    swiglu_backward(dh13, hact, dhact, h13, N, F, stream);
}
