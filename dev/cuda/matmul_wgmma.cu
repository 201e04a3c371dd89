// A hand-written Hopper matmul (TMA + wgmma, warp-specialised, persistent) against cuBLASLt on the 1B's shapes.
// The step toward the SwiGLU epilogue fusions (dev/NOTES.md, "Second round, eleventh part"): a fused epilogue only
// pays if the matmul under it is as fast as cuBLASLt at the power cap, and CUTLASS's builder kernels were not
// (matmul_cutlass.cu). This file asks whether our own kernel can be.
//
//   TN: out (M, N) = A (M, K) B (N, K)^T     the forward products (A: activations, B: the weight, K contiguous)
//   NN: out (M, N) = A (M, K) B (K, N)       the dinp products (B: the weight, N contiguous: wgmma's "transpose B")
//
// Every version validates bit for bit against cuBLASLt (the same wgmma k-order, fp32 accumulation, one bf16
// rounding) and against the CPU product in double on sampled rows, on a small shape and the 1B's products.
//
// Version 1: a CTA of 3 warpgroups per SM, persistent over 128 x 256 output tiles in groups of 8 tile rows (L2
// reuse). Warpgroup 0 is the producer: one thread loads each 64-deep k-block of A (128 x 64) and B (256 x 64) by TMA
// with the 128-byte swizzle into a ring of 4 stages (48 KiB each), full / empty mbarriers per stage. Warpgroups 1
// and 2 each compute 64 rows x 256 columns with wgmma m64n256k16 (128 fp32 accumulators a thread), release a stage
// once the wgmmas reading it are done (wait_group 1), and store their rows as bf16 straight from the registers.
// Version 2: version 1 in clusters of two CTAs along M that share B: each loads half of B's k-block and multicasts
// it to both (48 -> 32 KiB of L2 reads per k-block and CTA); a stage is refilled once both CTAs' consumers are done.
// Version 3: version 1 with the epilogue through shared memory: each consumer warp writes its 16 rows, 64 columns
// at a time, into one of two 2 KiB staging buffers in the 128-byte swizzle (conflict-free), and one TMA store writes
// each to global memory; the warp starts the next tile while the stores drain.
// Version 4: version 2's clusters with version 3's epilogue.
// Version 5: ping-pong (the kernel below version 4's): each consumer warpgroup owns whole 128 x 128 tiles, the two
// taking turns, so one's epilogue overlaps the other's products; clusters along N share A; 6 stages of 32 KiB.
//
// Results (session 17, H100 80GB HBM3, `./matmul_wgmma 2|3 ...`; TFLOP/s, alone = median of 20 single runs,
// sustained = 200 back to back after 100 warm-up runs, at the 700 W power cap as in training; cuBLASLt is the
// trainer's call with its algorithm choice, measured in the same rounds):
//
//   | product (M, N, K)            | cuBLASLt sustained | v1      | v2      | v3      | v4      | v5      |
//   | w13 fwd (16384, 16384, 2048) | 696-734            | 559-587 | 571-575 | 625-670 | 635-667 | 566-593 |
//   | w2 dinp (16384, 8192, 2048)  | 671-713            | 551-580 | 568-569 | 620-650 | 627-655 | 578-591 |
//   | qkv fwd (16384, 3072, 2048)  | 658-710            | 542-590 | 561-567 | 646-666 | 650-679 | 584-590 |
//   | w2 fwd (16384, 2048, 8192)   | 683-711            | 641-667 | 642-677 | 675-693 | 682-703 | 571-583 |
//
// Two to five rounds per version (v2: two). v2 and v4 as first written released a stage in the peer CTA with
// `mbarrier.arrive.release.cluster` and ran at 391-470; the plain `mbarrier.arrive.shared::cluster` (default
// .release.cta, as CUTLASS's cluster barrier does it) gives the figures above.
// Under ncu (clocks locked at 1.41 GHz), w13: v1 1.83 ms, v3 1.58, v4 1.57 (381 -> 357 -> 312 M L2 read sectors),
// v5 1.70 (440 M: 128 x 128 tiles). cuBLASLt's candidates there: its 128x256 cooperative cluster-2x1 kernel (the
// design of v4) 1.55 ms, and the fastest, non-cooperative 168x128 / 176x128 kernels with 5 stages and clusters 1x2,
// 1.45-1.46 ms at 99% SM throughput. So v4 is level with cuBLASLt's kernel of the same design; what cuBLASLt picks
// instead, and where the remaining 5-10% on the short-K products at the cap should lie, is a ping-pong schedule on a
// larger tile than v5's 128 x 128 (v5 loses on L2 traffic).
//
// Session 18 (H100 80GB HBM3, same measures):
// Version 6: ping-pong on cuBLASLt's larger tiles: 128 x 192 per warpgroup (two m64n192k16, 192 accumulators, 240
// registers), 5 stages of 40 KiB, clusters of two CTAs along M sharing B (multicast), one 2 KiB staging buffer per
// warp; N need not be a multiple of 192 (TMA zero-fills loads past N and clips stores). Sustained, one run of three
// rounds (and a second run of two rounds): w13 fwd 634-656 (668) against cuBLASLt 682-731 (711-716); w2 dinp
// 624-631 (649-652) against 680-702 (707-715); qkv 632-633 (644-648) against 641-673 (686-700); w2 fwd 605-634
// (633-635) against 686-701 (700-714). So no better than v4. ncu on w13: v6 1.63 ms, 306 M L2 read sectors, 1.23 GB
// read from DRAM (the weight re-read for every group of 8 tile rows); groups of 32 tile rows: 1.59 ms, 0.76 GB;
// cuBLASLt's 176x128 ping-pong kernel 1.46 ms, 218 M sectors, 0.70 GB. Larger groups did not help at the cap (32
// tile rows: 605-622 on w13).
// Version 8: version 6 with 32-deep k-blocks (A's rows 64 bytes in the 64-byte swizzle) in 10 stages of 20 KiB, so a
// stage is released after half as many products and the producer runs further ahead. Bit-identical, and slower
// (one run of two rounds, sustained): w13 551-576 (version 6 623-651, cuBLASLt 706-734), w2 dinp 600-601 (645;
// 712-714), qkv 586 (647-649; 657-695), w2 fwd 547-549 (634-641; 701-711). The finer ring is not what version 6
// lacks.
// What ncu says of cuBLASLt's fastest w13 kernel (nvjet 176x128, ping-pong, 1x2 clusters, 1.456 ms at 1.41 GHz
// against version 6's 1.609 ms): 99% tensor-pipe issue against 88.6%; 114.6 M instructions against 216.5 M; its
// consumers find the next stage loaded (735 slow-path waits in 1.5 M k-blocks, against 2.0 M retries in 1.4 M for
// version 6) and stall mostly on the wgmma wait; its tiles are handed out by a dynamic scheduler (an atomic
// counter, one fetch per tile pair) rather than a fixed stride; and 218 M L2 read sectors where its tile and
// multicast account for 325 M: the L2 request coalescer merges 2.14 sectors delivered per sector read, ours 1.51.
// Versions 7 and 9, the SwiGLU backward and forward fused into version 6's epilogue, became llmc/matmul_swiglu.cuh;
// their check, timing and history are dev/cuda/matmul_swiglu.cu's.
//
// Build: make -C dev/cuda bin/matmul_wgmma (bf16 only; the fp32 build prints that and exits 0)
// Run:   ./matmul_wgmma [rounds [versions...]]   (default 1 round of cuBLASLt and every version)
//        ./matmul_wgmma ncu                       one call of cuBLASLt and of each version on w13, for a profiler
//        ./matmul_wgmma small                     the small shapes' checks only (for compute-sanitizer)
#include "common.h"
#include "../../llmc/matmul.cuh"

#if defined(ENABLE_FP32)
int main() {
    printf("matmul_wgmma: bf16 only (wgmma against cuBLASLt on the bf16 trainer's shapes); nothing to do\n");
    return 0;
}
#else

#include <cuda.h>
#include <cudaTypedefs.h>

#include "../../llmc/ptx.cuh"
#include "../../llmc/tensor_map.cuh"

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, THREADS = 384, GROUP_M = 8;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
// version 3 and 4's epilogue: per consumer warp two 16 x 64 bf16 staging buffers (2 KiB each) for TMA stores
constexpr int STAGING_BYTES = 8 * 2 * 2048;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + 1024 + 16 * STAGES;  // + alignment + mbarriers
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;                 // 128 x 40 + 256 x 232 <= 65536

// 2-D tiled TMA store of the box at (c0, c1) of `map` from shared memory src, in this thread's bulk group.
__device__ __forceinline__ void tma_store_2d(const void* map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// D (64 x 256 fp32) (+)= A (64 x 16) B (16 x 256), both from descriptors; TRANS_B = 1: B MN-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, %131;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

// One warp's 16 rows x 64 columns of a wgmma accumulator fragment (columns 8 jj + c, +1 of rows g and g + 8 at
// frag[4 (j0 + jj) ..], jj < 8) to global memory at (col, row) of out_map: written into the 2 KiB staging buffer
// `buf` in the 128-byte swizzle (conflict-free: rows g and g + 8 share a swizzle, the 8 g's spread the chunks over
// all banks), then one TMA store. Before writing, the warp waits until at most PENDING of its earlier stores still
// read their buffers: with two buffers used in turn (PENDING = 1) it goes on to its next products while the stores
// drain; with one (PENDING = 0) each store must have read the buffer before the next chunk is written.
template <int PENDING, int R>
__device__ __forceinline__ void store_chunk_tma(const float (&frag)[R], int j0, uint32_t buf, const void* out_map,
                                                int col, int row, int g, int c, int lane) {
    if (lane == 0) bulk_wait_group_read<PENDING>();
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < 8; jj++) {
        const int j = j0 + jj;
        const uint32_t chunk = 16 * (jj ^ g) + 2 * c;
        st_shared_u32(buf + g * 128 + chunk, pack_bf16x2(frag[4 * j], frag[4 * j + 1]));
        st_shared_u32(buf + (g + 8) * 128 + chunk, pack_bf16x2(frag[4 * j + 2], frag[4 * j + 3]));
    }
    fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) {
        tma_store_2d(out_map, buf, col, row);
        bulk_commit_group();
    }
}

// Work unit `unit` of the persistent order (a tile, or with CLUSTER = 2 a pair of tiles one above the other):
// groups of GROUP_M unit rows, column by column inside a group, so the CTAs running at once share a few A row panels
// and B column panels in L2.
__device__ __forceinline__ void unit_coords(int unit, int units_m, int units_n, int group_m, int& um, int& un) {
    const int group = unit / (group_m * units_n), first_m = group * group_m;
    const int rows = min(units_m - first_m, group_m), in_group = unit - group * group_m * units_n;
    um = first_m + in_group % rows;
    un = in_group / rows;
}

// CLUSTER = 2: two CTAs take the tiles (2 um, un) and (2 um + 1, un), which share B's 256 columns. Each loads half
// of B's k-block and multicasts it to both, so L2 serves 32 KiB per k-block and CTA instead of 48. A stage may then
// be refilled only when the consumers of both CTAs are done with it: every consumer warp arrives on the empty
// barrier of both CTAs (16 arrivals).
template <int TRANS_B, int CLUSTER, bool TMA_STORE>
__global__ void __launch_bounds__(THREADS, 1)
    matmul_wgmma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                        const __grid_constant__ CUtensorMap out_map, __nv_bfloat16* out, int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    const uint32_t smem = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t a_sm = smem, b_sm = smem + STAGES * A_BYTES;
    const uint32_t staging = b_sm + STAGES * B_BYTES, full0 = staging + STAGING_BYTES, empty0 = full0 + 8 * STAGES;
    const int rank = CLUSTER > 1 ? (int)cluster_cta_rank() : 0;
    const int units_m = M / BM / CLUSTER, units_n = N / BN, n_units = units_m * units_n, k_blocks = K / BK;
    const int first_unit = blockIdx.x / CLUSTER, unit_stride = gridDim.x / CLUSTER;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full0 + 8 * s, 1);
            mbarrier_init(empty0 + 8 * s, 8 * CLUSTER);  // one arrival per consumer warp of the cluster
        }
        fence_mbarrier_init();
    }
    if (CLUSTER > 1) cluster_sync();
    else __syncthreads();

    if (threadIdx.x < 128) {  // producer
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            int it = 0;
            for (int unit = first_unit; unit < n_units; unit += unit_stride) {
                int um, tn;
                unit_coords(unit, units_m, units_n, GROUP_M / CLUSTER, um, tn);
                const int tm = um * CLUSTER + rank;
                for (int kb = 0; kb < k_blocks; kb++, it++) {
                    const int s = it % STAGES, round = it / STAGES;
                    const uint32_t full = full0 + 8 * s, a_dst = a_sm + s * A_BYTES, b_dst = b_sm + s * B_BYTES;
                    if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);
                    mbarrier_arrive_expect_tx(full, STAGE_BYTES);
                    tma_load_2d(a_dst, &a_map, full, kb * BK, tm * BM);
                    if (TRANS_B) {  // 64-column blocks of 64 k-rows; with a cluster, this CTA's half of them
                        constexpr int blocks = BN / 64 / CLUSTER;
                        for (int cb = rank * blocks; cb < (rank + 1) * blocks; cb++) {
                            const uint32_t dst = b_dst + cb * (BK * 128);
                            if (CLUSTER > 1) tma_load_2d_multicast(dst, &b_map, full, tn * BN + 64 * cb, kb * BK, 3);
                            else tma_load_2d(dst, &b_map, full, tn * BN + 64 * cb, kb * BK);
                        }
                    } else if (CLUSTER > 1) {  // rows [128 rank, 128 rank + 128) of B's 256
                        tma_load_2d_multicast(b_dst + rank * (B_BYTES / 2), &b_map, full, kb * BK,
                                              tn * BN + rank * (BN / 2), 3);
                    } else {
                        tma_load_2d(b_dst, &b_map, full, kb * BK, tn * BN);
                    }
                }
            }
        }
        __syncwarp();
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const int g = lane / 4, c = 2 * (lane % 4);
        const uint64_t a_desc = wgmma_desc_sw128(a_sm + wg * 64 * 128, 16, 1024);
        const uint64_t b_desc = TRANS_B ? wgmma_desc_sw128(b_sm, BK * 128, 1024) : wgmma_desc_sw128(b_sm, 16, 1024);
        auto release = [&](int stage) {  // this warp is done reading the stage, in every CTA of the cluster
            if (lane < CLUSTER) {
                if (CLUSTER > 1) mbarrier_arrive_cluster(empty0 + 8 * stage, lane);
                else mbarrier_arrive(empty0 + 8 * stage);
            }
        };
        float acc[128];
        int it = 0;
        for (int unit = first_unit; unit < n_units; unit += unit_stride) {
            int um, tn;
            unit_coords(unit, units_m, units_n, GROUP_M / CLUSTER, um, tn);
            const int tm = um * CLUSTER + rank;
            for (int kb = 0; kb < k_blocks; kb++, it++) {
                const int s = it % STAGES;
                mbarrier_wait(full0 + 8 * s, (it / STAGES) & 1);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; kk++) {
                    wgmma_m64n256k16<TRANS_B>(acc, wgmma_desc_advance(a_desc, s * A_BYTES + 32 * kk),
                                              wgmma_desc_advance(b_desc, s * B_BYTES + (TRANS_B ? 2048 : 32) * kk),
                                              kb > 0 || kk > 0);
                }
                wgmma_commit_group();
                if (kb > 0) {  // the previous k-block's wgmmas are done: its stage is free
                    wgmma_wait_group<1>();
                    release((it - 1) % STAGES);
                }
            }
            wgmma_wait_group<0>();
            pin_registers(acc);
            release((it - 1) % STAGES);
            if constexpr (TMA_STORE) {
                // the warp's 16 rows in four 64-column chunks, through two staging buffers
                const uint32_t warp_staging = staging + (wg * 4 + warp) * 4096;
#pragma unroll
                for (int q = 0; q < BN / 64; q++) {
                    store_chunk_tma<1>(acc, 8 * q, warp_staging + (q % 2) * 2048, &out_map, tn * BN + 64 * q,
                                    tm * BM + wg * 64 + warp * 16, g, c, lane);
                }
            } else {
                const int row = tm * BM + wg * 64 + warp * 16 + g;
                __nv_bfloat16* out0 = out + (size_t)row * N + tn * BN + c;
                __nv_bfloat16* out1 = out0 + (size_t)8 * N;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    *reinterpret_cast<uint32_t*>(out0 + 8 * j) = pack_bf16x2(acc[4 * j], acc[4 * j + 1]);
                    *reinterpret_cast<uint32_t*>(out1 + 8 * j) = pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]);
                }
            }
        }
        if (TMA_STORE && lane == 0) bulk_wait_group_read<0>();  // the staging buffers stay until the stores read them
    }
    if (CLUSTER > 1) cluster_sync();
#endif
}

// Version 5, ping-pong: each consumer warpgroup owns whole 128 x 128 tiles (two m64n128k16 per k16 step, 128
// accumulators a thread), the two taking the CTA's tiles in turn, so one warpgroup's epilogue runs while the other's
// products keep the tensor cores busy. The producer fills one ring of 6 stages (32 KiB each) with the tiles' k-blocks
// in order; a stage is read by one warpgroup only. Clusters of two CTAs along N share A's 128 rows: each loads 64 of
// them and multicasts them to both (empty barriers: 4 warps x 2 CTAs).
constexpr int PP_BN = 128, PP_STAGES = 6, PP_A_BYTES = BM * BK * 2, PP_B_BYTES = PP_BN * BK * 2;
constexpr int PP_STAGE_BYTES = PP_A_BYTES + PP_B_BYTES;
constexpr int PP_SMEM_BYTES = PP_STAGES * PP_STAGE_BYTES + STAGING_BYTES + 1024 + 16 * PP_STAGES;

template <int TRANS_B>
__global__ void __launch_bounds__(THREADS, 1)
    matmul_pingpong_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                           const __grid_constant__ CUtensorMap out_map, int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int CLUSTER = 2;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t smem = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t a_sm = smem, b_sm = smem + PP_STAGES * PP_A_BYTES;
    const uint32_t staging = b_sm + PP_STAGES * PP_B_BYTES, full0 = staging + STAGING_BYTES;
    const uint32_t empty0 = full0 + 8 * PP_STAGES;
    const int rank = (int)cluster_cta_rank();
    const int units_m = M / BM, units_n = N / PP_BN / CLUSTER, n_units = units_m * units_n, k_blocks = K / BK;
    const int first_unit = blockIdx.x / CLUSTER, unit_stride = gridDim.x / CLUSTER;
    if (threadIdx.x == 0) {
        for (int s = 0; s < PP_STAGES; s++) {
            mbarrier_init(full0 + 8 * s, 1);
            mbarrier_init(empty0 + 8 * s, 4 * CLUSTER);
        }
        fence_mbarrier_init();
    }
    cluster_sync();

    if (threadIdx.x < 128) {  // producer
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            int it = 0;
            for (int unit = first_unit; unit < n_units; unit += unit_stride) {
                int tm, un;
                unit_coords(unit, units_m, units_n, GROUP_M, tm, un);
                const int tn = un * CLUSTER + rank;
                for (int kb = 0; kb < k_blocks; kb++, it++) {
                    const int s = it % PP_STAGES, round = it / PP_STAGES;
                    const uint32_t full = full0 + 8 * s, b_dst = b_sm + s * PP_B_BYTES;
                    if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);
                    mbarrier_arrive_expect_tx(full, PP_STAGE_BYTES);
                    tma_load_2d_multicast(a_sm + s * PP_A_BYTES + rank * (PP_A_BYTES / 2), &a_map, full, kb * BK,
                                          tm * BM + rank * (BM / 2), 3);
                    if (TRANS_B) {
                        for (int cb = 0; cb < PP_BN / 64; cb++) {
                            tma_load_2d(b_dst + cb * (BK * 128), &b_map, full, tn * PP_BN + 64 * cb, kb * BK);
                        }
                    } else {
                        tma_load_2d(b_dst, &b_map, full, kb * BK, tn * PP_BN);
                    }
                }
            }
        }
        __syncwarp();
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const int g = lane / 4, c = 2 * (lane % 4);
        const uint64_t a_desc = wgmma_desc_sw128(a_sm, 16, 1024);
        const uint64_t b_desc = TRANS_B ? wgmma_desc_sw128(b_sm, BK * 128, 1024) : wgmma_desc_sw128(b_sm, 16, 1024);
        const uint32_t warp_staging = staging + (wg * 4 + warp) * 4096;
        auto release = [&](int stage) {
            if (lane < CLUSTER) mbarrier_arrive_cluster(empty0 + 8 * stage, lane);
        };
        float acc[2][64];
        // This warpgroup's tiles: the CTA's tiles j = wg, wg + 2, ...; tile j's k-blocks are ring entries j k_blocks
        // onwards. The mainloops take turns (named barrier 1: warpgroup 0's turn, 2: warpgroup 1's): a warpgroup
        // waits on a stage's full barrier only once the other has waited on every earlier entry, so the ring is
        // never more than one round ahead of the parity it waits for.
        if (wg == 1) named_barrier_arrive<256>(1);
        for (int j = wg, unit = first_unit + wg * unit_stride; unit < n_units; j += 2, unit += 2 * unit_stride) {
            int tm, un;
            unit_coords(unit, units_m, units_n, GROUP_M, tm, un);
            const int tn = un * CLUSTER + rank;
            int it = j * k_blocks;
            named_barrier_sync<256>(1 + wg);
            for (int kb = 0; kb < k_blocks; kb++, it++) {
                const int s = it % PP_STAGES;
                mbarrier_wait(full0 + 8 * s, (it / PP_STAGES) & 1);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; kk++) {
                    const uint64_t b = wgmma_desc_advance(b_desc, s * PP_B_BYTES + (TRANS_B ? 2048 : 32) * kk);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        wgmma_bf16_ss_t<0, TRANS_B>(acc[h],
                                                    wgmma_desc_advance(a_desc, s * PP_A_BYTES + h * 8192 + 32 * kk), b,
                                                    kb > 0 || kk > 0);
                    }
                }
                wgmma_commit_group();
                if (kb > 0) {
                    wgmma_wait_group<1>();
                    release((it - 1) % PP_STAGES);
                }
            }
            if (unit + unit_stride < n_units) named_barrier_arrive<256>(2 - wg);  // the next tile's turn
            wgmma_wait_group<0>();
            pin_registers(acc[0]);
            pin_registers(acc[1]);
            release((it - 1) % PP_STAGES);
            // rows 16 warp + g (+ 8) of each 64-row half, two 64-column chunks each: four TMA stores per warp
#pragma unroll
            for (int h = 0; h < 2; h++) {
#pragma unroll
                for (int q = 0; q < PP_BN / 64; q++) {
                    store_chunk_tma<1>(acc[h], 8 * q, warp_staging + q * 2048, &out_map, tn * PP_BN + 64 * q,
                                    tm * BM + 64 * h + 16 * warp, g, c, lane);
                }
            }
        }
        if (lane == 0) bulk_wait_group_read<0>();
    }
    cluster_sync();
#endif
}

// Version 6, ping-pong on the larger tile cuBLASLt's fastest kernels use: each consumer warpgroup owns whole 128 x 192
// tiles (two m64n192k16 per k16 step, 192 accumulators a thread, 240 registers), the producer 24 registers. 5 stages
// of 40 KiB. Clusters of two CTAs along M share B: each loads half of B's k-block (TN: 96 of its rows; NN: 32 of
// the 64 k-rows of each 64-column block) and multicasts it to both. One 2 KiB staging buffer per warp (the epilogue
// has the other warpgroup's whole mainloop to drain in). N need not be a multiple of 192: TMA fills the loads past N
// with zeros and clips the stores.
constexpr int V6_BN = 192, V6_STAGING_BYTES = 8 * 2048;
constexpr int V6_PRODUCER_REGS = 24, V6_CONSUMER_REGS = 240;  // 128 x 24 + 256 x 240 <= 65536
// k-block depth KB: 64 (version 6: 128-byte rows of A, 5 stages of 40 KiB) or 32 (version 8: 64-byte rows of A in
// the 64-byte swizzle, 10 stages of 20 KiB: the same bytes in flight, released in halves as soon)
__host__ __device__ constexpr int v6_stages(int kb) { return kb == 64 ? 5 : 10; }
__host__ __device__ constexpr int v6_smem_bytes(int kb) {
    return v6_stages(kb) * (BM + V6_BN) * kb * 2 + V6_STAGING_BYTES + 1024 + 16 * v6_stages(kb);
}
// K-major operand descriptor: KB = 64 the 128-byte swizzle (8-row atoms of 1024 bytes), KB = 32 the 64-byte one
// (atoms of 512 bytes; layout type 2)
template <int KB>
__device__ __forceinline__ uint64_t v6_kmajor_desc(uint32_t addr) {
    if constexpr (KB == 64) return wgmma_desc_sw128(addr, 16, 1024);
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(512 >> 4) << 32 | 2ull << 62;
}

template <int TRANS_B, int KB>
__global__ void __launch_bounds__(THREADS, 1)
    matmul_pingpong192_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                              const __grid_constant__ CUtensorMap out_map, int M, int N, int K) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int CLUSTER = 2, V6_STAGES = v6_stages(KB), V6_A_BYTES = BM * KB * 2, V6_B_BYTES = V6_BN * KB * 2;
    constexpr int V6_STAGE_BYTES = V6_A_BYTES + V6_B_BYTES;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t smem = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t a_sm = smem, b_sm = smem + V6_STAGES * V6_A_BYTES;
    const uint32_t staging = b_sm + V6_STAGES * V6_B_BYTES, full0 = staging + V6_STAGING_BYTES;
    const uint32_t empty0 = full0 + 8 * V6_STAGES;
    const int rank = (int)cluster_cta_rank();
    const int units_m = M / BM / CLUSTER, units_n = (N + V6_BN - 1) / V6_BN, n_units = units_m * units_n;
    const int k_blocks = K / KB, first_unit = blockIdx.x / CLUSTER, unit_stride = gridDim.x / CLUSTER;
    if (threadIdx.x == 0) {
        for (int s = 0; s < V6_STAGES; s++) {
            mbarrier_init(full0 + 8 * s, 1);
            mbarrier_init(empty0 + 8 * s, 4 * CLUSTER);  // the using warpgroup's 4 warps, in both CTAs
        }
        fence_mbarrier_init();
    }
    cluster_sync();

    if (threadIdx.x < 128) {  // producer
        setmaxnreg_dec<V6_PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            int it = 0;
            for (int unit = first_unit; unit < n_units; unit += unit_stride) {
                int um, tn;
                unit_coords(unit, units_m, units_n, GROUP_M / CLUSTER, um, tn);
                const int tm = um * CLUSTER + rank;
                for (int kb = 0; kb < k_blocks; kb++, it++) {
                    const int s = it % V6_STAGES, round = it / V6_STAGES;
                    const uint32_t full = full0 + 8 * s, b_dst = b_sm + s * V6_B_BYTES;
                    if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);
                    mbarrier_arrive_expect_tx(full, V6_STAGE_BYTES);
                    tma_load_2d(a_sm + s * V6_A_BYTES, &a_map, full, kb * KB, tm * BM);
                    if (TRANS_B) {
                        for (int cb = 0; cb < V6_BN / 64; cb++) {
                            tma_load_2d_multicast(b_dst + cb * (KB * 128) + rank * (KB * 64), &b_map, full,
                                                  tn * V6_BN + 64 * cb, kb * KB + rank * (KB / 2), 3);
                        }
                    } else {
                        tma_load_2d_multicast(b_dst + rank * (V6_B_BYTES / 2), &b_map, full, kb * KB,
                                              tn * V6_BN + rank * (V6_BN / 2), 3);
                    }
                }
            }
        }
        __syncwarp();
    } else {
        setmaxnreg_inc<V6_CONSUMER_REGS>();
        const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const int g = lane / 4, c = 2 * (lane % 4);
        const uint64_t a_desc = v6_kmajor_desc<KB>(a_sm);
        const uint64_t b_desc = TRANS_B ? wgmma_desc_sw128(b_sm, KB * 128, 1024) : v6_kmajor_desc<KB>(b_sm);
        const uint32_t warp_staging = staging + (wg * 4 + warp) * 2048;
        auto release = [&](int stage) {
            if (lane < CLUSTER) mbarrier_arrive_cluster(empty0 + 8 * stage, lane);
        };
        float acc[2][96];
        // the turn-taking of version 5
        if (wg == 1) named_barrier_arrive<256>(1);
        for (int j = wg, unit = first_unit + wg * unit_stride; unit < n_units; j += 2, unit += 2 * unit_stride) {
            int um, tn;
            unit_coords(unit, units_m, units_n, GROUP_M / CLUSTER, um, tn);
            const int tm = um * CLUSTER + rank;
            int it = j * k_blocks;
            // The wgmmas read the accumulators (the first one scales them by 0): clearing them here tells the
            // compiler that the last tile's values are dead after its epilogue, whose registers it may then use.
#pragma unroll
            for (int i = 0; i < 96; i++) acc[0][i] = acc[1][i] = 0.0f;
            named_barrier_sync<256>(1 + wg);
            for (int kb = 0; kb < k_blocks; kb++, it++) {
                const int s = it % V6_STAGES;
                mbarrier_wait(full0 + 8 * s, (it / V6_STAGES) & 1);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < KB / 16; kk++) {
                    const uint64_t b = wgmma_desc_advance(b_desc, s * V6_B_BYTES + (TRANS_B ? 2048 : 32) * kk);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const uint64_t a = wgmma_desc_advance(a_desc, s * V6_A_BYTES + h * 128 * KB + 32 * kk);
                        wgmma_bf16_ss_t<0, TRANS_B>(acc[h], a, b, kb > 0 || kk > 0);
                    }
                }
                wgmma_commit_group();
                if (kb > 0) {
                    wgmma_wait_group<1>();
                    release((it - 1) % V6_STAGES);
                }
            }
            if (unit + unit_stride < n_units) named_barrier_arrive<256>(2 - wg);  // the next tile's turn
            wgmma_wait_group<0>();
            pin_registers(acc[0]);
            pin_registers(acc[1]);
            release((it - 1) % V6_STAGES);
            // rows 16 warp + g (+ 8) of each 64-row half, three 64-column chunks each, through the one buffer
#pragma unroll
            for (int h = 0; h < 2; h++) {
#pragma unroll
                for (int q = 0; q < V6_BN / 64; q++) {
                    store_chunk_tma<0>(acc[h], 8 * q, warp_staging, &out_map, tn * V6_BN + 64 * q,
                                       tm * BM + 64 * h + 16 * warp, g, c, lane);
                }
            }
        }
        if (lane == 0) bulk_wait_group_read<0>();
    }
    cluster_sync();
#endif
}

// Launches `kernel` persistently in clusters of `cluster` CTAs along x: as many clusters as can be resident at
// once (`resident`, asked once per kernel: a GPC with an odd SM count leaves one SM out), at most `units`.
template <typename Kernel, typename... Args>
static void launch_clusters(Kernel kernel, int cluster, size_t smem, int units, int sms, int& resident,
                            Args... args) {
    cudaLaunchConfig_t config = {};
    config.blockDim = dim3(THREADS);
    config.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    if (resident == 0) {
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        config.gridDim = dim3(cluster * (sms / cluster));
        cudaCheck(cudaOccupancyMaxActiveClusters(&resident, kernel, &config));
    }
    config.gridDim = dim3(cluster * std::min(resident, units));
    cudaCheck(cudaLaunchKernelEx(&config, kernel, args...));
}

template <int TRANS_B>
static void launch_pingpong(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& out_map, int M,
                            int N, int K, int sms) {
    static int resident = 0;
    launch_clusters(matmul_pingpong_kernel<TRANS_B>, 2, PP_SMEM_BYTES, (M / BM) * (N / PP_BN / 2), sms, resident,
                    a_map, b_map, out_map, M, N, K);
}

template <int TRANS_B, int KB>
static void launch_pingpong192(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& out_map, int M,
                               int N, int K, int sms) {
    static int resident = 0;
    launch_clusters(matmul_pingpong192_kernel<TRANS_B, KB>, 2, v6_smem_bytes(KB),
                    (M / BM / 2) * ((N + V6_BN - 1) / V6_BN), sms, resident, a_map, b_map, out_map, M, N, K);
}

// out (M, N) = A (M, K) B^T (trans_b = false: B is (N, K)) or A B (trans_b = true: B is (K, N)). version 1: one CTA
// per tile; version 2: clusters of two CTAs sharing B.
template <int TRANS_B, int CLUSTER, bool TMA_STORE>
static void launch_wgmma(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& out_map, floatX* out,
                         int M, int N, int K, int sms) {
    static bool smem_set = false;
    if (!smem_set) {
        cudaCheck(cudaFuncSetAttribute(matmul_wgmma_kernel<TRANS_B, CLUSTER, TMA_STORE>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
        smem_set = true;
    }
    const int units = (M / BM / CLUSTER) * (N / BN);
    if (CLUSTER == 1) {  // a plain launch (a cluster launch of size 1 is scheduled differently)
        matmul_wgmma_kernel<TRANS_B, 1, TMA_STORE>
            <<<std::min(sms, units), THREADS, SMEM_BYTES>>>(a_map, b_map, out_map, out, M, N, K);
        cudaCheckLaunch();
        return;
    }
    static int resident = 0;
    launch_clusters(matmul_wgmma_kernel<TRANS_B, CLUSTER, TMA_STORE>, CLUSTER, SMEM_BYTES, units, sms, resident, a_map,
                    b_map, out_map, out, M, N, K);
}

static void matmul_wgmma(int version, floatX* out, const floatX* a, const floatX* b, int M, int N, int K,
                         bool trans_b) {
    if (version == 6 || version == 8) {
        const int kb = version == 6 ? 64 : 32;
        if (M % (2 * BM) != 0 || N % 8 != 0 || K % kb != 0) {
            fprintf(stderr, "matmul_wgmma: M %d, N %d, K %d must be multiples of %d, 8, %d\n", M, N, K, 2 * BM, kb);
            exit(EXIT_FAILURE);
        }
        static int sms6 = 0;
        if (sms6 == 0) cudaCheck(cudaDeviceGetAttribute(&sms6, cudaDevAttrMultiProcessorCount, 0));
        const CUtensorMapSwizzle kmajor = kb == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
        const CUtensorMap a_map = tensor_map_2d(a, K, M, kb, BM, "matmul_wgmma", kmajor);
        const CUtensorMap b_map = trans_b ? tensor_map_2d(b, N, K, 64, kb / 2, "matmul_wgmma")
                                          : tensor_map_2d(b, K, N, kb, V6_BN / 2, "matmul_wgmma", kmajor);
        const CUtensorMap out_map = tensor_map_2d(out, N, M, 64, 16, "matmul_wgmma");
        if (kb == 64) {
            if (trans_b) launch_pingpong192<1, 64>(a_map, b_map, out_map, M, N, K, sms6);
            else launch_pingpong192<0, 64>(a_map, b_map, out_map, M, N, K, sms6);
        } else {
            if (trans_b) launch_pingpong192<1, 32>(a_map, b_map, out_map, M, N, K, sms6);
            else launch_pingpong192<0, 32>(a_map, b_map, out_map, M, N, K, sms6);
        }
        return;
    }
    if (version == 5) {
        if (M % BM != 0 || N % (2 * PP_BN) != 0 || K % BK != 0) {
            fprintf(stderr, "matmul_wgmma: M %d, N %d, K %d must be multiples of %d, %d, %d\n", M, N, K, BM,
                    2 * PP_BN, BK);
            exit(EXIT_FAILURE);
        }
        static int sms5 = 0;
        if (sms5 == 0) cudaCheck(cudaDeviceGetAttribute(&sms5, cudaDevAttrMultiProcessorCount, 0));
        const CUtensorMap a_map = tensor_map_2d(a, K, M, BK, BM / 2, "matmul_wgmma");
        const CUtensorMap b_map = trans_b ? tensor_map_2d(b, N, K, 64, BK, "matmul_wgmma")
                                          : tensor_map_2d(b, K, N, BK, PP_BN, "matmul_wgmma");
        const CUtensorMap out_map = tensor_map_2d(out, N, M, 64, 16, "matmul_wgmma");
        if (trans_b) launch_pingpong<1>(a_map, b_map, out_map, M, N, K, sms5);
        else launch_pingpong<0>(a_map, b_map, out_map, M, N, K, sms5);
        return;
    }
    const int cluster = version % 2 == 0 ? 2 : 1;
    if (M % (BM * cluster) != 0 || N % BN != 0 || K % BK != 0) {
        fprintf(stderr, "matmul_wgmma: M %d, N %d, K %d must be multiples of %d, %d, %d\n", M, N, K, BM * cluster, BN,
                BK);
        exit(EXIT_FAILURE);
    }
    static int sms = 0;
    if (sms == 0) cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const CUtensorMap a_map = tensor_map_2d(a, K, M, BK, BM, "matmul_wgmma");
    const CUtensorMap b_map = trans_b ? tensor_map_2d(b, N, K, 64, BK, "matmul_wgmma")
                                      : tensor_map_2d(b, K, N, BK, BN / cluster, "matmul_wgmma");
    const CUtensorMap out_map = tensor_map_2d(out, N, M, 64, 16, "matmul_wgmma");
    switch (version * 2 + trans_b) {
        case 2: launch_wgmma<0, 1, false>(a_map, b_map, out_map, out, M, N, K, sms); break;
        case 3: launch_wgmma<1, 1, false>(a_map, b_map, out_map, out, M, N, K, sms); break;
        case 4: launch_wgmma<0, 2, false>(a_map, b_map, out_map, out, M, N, K, sms); break;
        case 5: launch_wgmma<1, 2, false>(a_map, b_map, out_map, out, M, N, K, sms); break;
        case 6: launch_wgmma<0, 1, true>(a_map, b_map, out_map, out, M, N, K, sms); break;
        case 7: launch_wgmma<1, 1, true>(a_map, b_map, out_map, out, M, N, K, sms); break;
        case 8: launch_wgmma<0, 2, true>(a_map, b_map, out_map, out, M, N, K, sms); break;
        case 9: launch_wgmma<1, 2, true>(a_map, b_map, out_map, out, M, N, K, sms); break;
        default: fprintf(stderr, "matmul_wgmma: no version %d\n", version); exit(EXIT_FAILURE);
    }
}

// The same product through the trainer's cuBLASLt calls: forward (TN) or dinp (NN).
static void matmul_cublaslt(floatX* out, const floatX* a, const floatX* b, int M, int N, int K, bool trans_b) {
    if (trans_b) matmul_backward(out, nullptr, a, nullptr, b, M, N, K, false, 0);
    else matmul_forward(out, a, b, M, K, N, 0);
}

struct Shape {
    const char* name;
    int M, N, K;
    bool trans_b;
};

// Checks one shape: against cuBLASLt bit for bit (the same wgmma k-order, fp32 accumulation, one bf16 rounding) and,
// on `rows` sampled rows, against the CPU product in double.
static void validate_shape(int version, const Shape& s, int rows) {
    printf("version %d, %s: M=%d N=%d K=%d %s\n", version, s.name, s.M, s.N, s.K, s.trans_b ? "NN" : "TN");
    const size_t n_a = (size_t)s.M * s.K, n_b = (size_t)s.N * s.K, n_out = (size_t)s.M * s.N;
    floatX* a = device_random<floatX>(n_a, 11, 1.0f);
    floatX* b = device_random<floatX>(n_b, 12, 1.0f);
    floatX *ours, *ref;
    cudaCheck(cudaMalloc(&ours, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&ref, n_out * sizeof(floatX)));
    poison(ours, n_out * sizeof(floatX));
    poison(ref, n_out * sizeof(floatX));
    matmul_wgmma(version, ours, a, b, s.M, s.N, s.K, s.trans_b);
    matmul_cublaslt(ref, a, b, s.M, s.N, s.K, s.trans_b);
    cudaCheck(cudaDeviceSynchronize());
    const std::vector<float> got = host_from_device(ours, n_out), want = host_from_device(ref, n_out);
    validate("against cuBLASLt", got, want, 1e-6);
    validate_bitwise("against cuBLASLt", ours, ref, n_out);
    const std::vector<float> ha = host_from_device(a, n_a), hb = host_from_device(b, n_b);
    const std::vector<int> picked = random_ints(rows, s.M, 13);
    std::vector<float> got_rows, cpu_rows;
    for (int r : picked) {
        for (int n = 0; n < s.N; n++) {
            double sum = 0.0;
            for (int k = 0; k < s.K; k++) {
                const double bv = s.trans_b ? hb[(size_t)k * s.N + n] : hb[(size_t)n * s.K + k];
                sum += (double)ha[(size_t)r * s.K + k] * bv;
            }
            cpu_rows.push_back((float)sum);
            got_rows.push_back(got[(size_t)r * s.N + n]);
        }
    }
    validate("against the CPU (rows)", got_rows, cpu_rows);
    cudaCheck(cudaFree(a));
    cudaCheck(cudaFree(b));
    cudaCheck(cudaFree(ours));
    cudaCheck(cudaFree(ref));
}

// TFLOP/s alone (median of 20 single runs) and sustained (200 back to back after 100 warm-up runs, the GPU at its
// power cap as in training), rounds alternating between cuBLASLt and ours.
static void time_shape(const Shape& s, int rounds, const std::vector<int>& versions) {
    floatX* a = device_random<floatX>((size_t)s.M * s.K, 21, 1.0f);
    floatX* b = device_random<floatX>((size_t)s.N * s.K, 22, 1.0f);
    floatX* out;
    cudaCheck(cudaMalloc(&out, (size_t)s.M * s.N * sizeof(floatX)));
    const double flops = 2.0 * s.M * (double)s.N * s.K;
    printf("%s (M=%d N=%d K=%d %s), TFLOP/s alone / sustained:\n", s.name, s.M, s.N, s.K, s.trans_b ? "NN" : "TN");
    for (int round = 0; round < rounds; round++) {
        for (int version : versions) {  // 0: cuBLASLt
            auto run = [&] {
                if (version > 0) matmul_wgmma(version, out, a, b, s.M, s.N, s.K, s.trans_b);
                else matmul_cublaslt(out, a, b, s.M, s.N, s.K, s.trans_b);
            };
            const float alone = benchmark_ms(20, run);
            for (int i = 0; i < 100; i++) run();
            const float sustained = benchmark_ms(1, [&] { for (int i = 0; i < 200; i++) run(); }) / 200.0f;
            char name[32];
            snprintf(name, sizeof(name), version > 0 ? "version %d" : "cuBLASLt", version);
            printf("  round %d %-10s %7.1f / %7.1f\n", round, name, flops / (alone * 1e-3) / 1e12,
                   flops / (sustained * 1e-3) / 1e12);
        }
    }
    cudaCheck(cudaFree(a));
    cudaCheck(cudaFree(b));
    cudaCheck(cudaFree(out));
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);
    const int rounds = argc > 1 ? std::max(1, atoi(argv[1])) : 1;
    std::vector<int> versions = {0};  // cuBLASLt, then the versions to time (default: all)
    for (int i = 2; i < argc; i++) versions.push_back(atoi(argv[i]));
    if (versions.size() == 1) versions = {0, 1, 2, 3, 4, 5, 6, 8};
    matmul_init(0);
    if (argc > 1 && strcmp(argv[1], "ncu") == 0) {  // one call of each on the w13 shape, for the profiler
        const Shape s = {"w13 fwd", 16384, 16384, 2048, false};
        floatX* a = device_random<floatX>((size_t)s.M * s.K, 21, 1.0f);
        floatX* b = device_random<floatX>((size_t)s.N * s.K, 22, 1.0f);
        floatX* out;
        cudaCheck(cudaMalloc(&out, (size_t)s.M * s.N * sizeof(floatX)));
        for (int version : {0, 1, 2, 3, 4, 5, 6, 8}) {
            if (version > 0) matmul_wgmma(version, out, a, b, s.M, s.N, s.K, s.trans_b);
            else matmul_cublaslt(out, a, b, s.M, s.N, s.K, s.trans_b);
        }
        cudaCheck(cudaDeviceSynchronize());
        return 0;
    }
    const Shape small_tn = {"small", 256, 512, 192, false}, small_nn = {"small", 256, 512, 192, true};
    if (argc > 1 && strcmp(argv[1], "small") == 0) {  // the small shapes only, no timing (for compute-sanitizer)
        for (int version : {1, 2, 3, 4, 5, 6, 8}) {
            validate_shape(version, small_tn, 256);
            validate_shape(version, small_nn, 256);
        }
        matmul_destroy();
        return finish(argv[0]);
    }
    const Shape shapes[] = {{"w13 fwd", 16384, 16384, 2048, false},
                            {"w2 dinp", 16384, 8192, 2048, true},
                            {"qkv fwd", 16384, 3072, 2048, false},
                            {"w2 fwd", 16384, 2048, 8192, false}};
    for (int version : versions) {  // each version timed is validated first
        if (version == 0) continue;
        validate_shape(version, small_tn, 256);
        validate_shape(version, small_nn, 256);
        for (const Shape& s : shapes) validate_shape(version, s, 4);
    }
    if (versions.size() > 1) {
        for (const Shape& s : shapes) time_shape(s, rounds, versions);
    }
    matmul_destroy();
    return finish(argv[0]);
}
#endif
