// Causal GQA attention forward: validation against a CPU reference and timing.
//
//   qkv (B, T, (H + 2 KV) hd)  ->  out (B, T, H hd), lse (B, H, T) fp32
//   s_ij = q_i . k_j / sqrt(hd) for j <= i;  lse_i = log sum_j exp(s_ij);  out_i = sum_j exp(s_ij - lse_i) v_j
//
// The CPU reference accumulates in fp64 and materialises each score row (fine at the small T validated here).
//
// Versions (v1, v5 and v6 from llmc/, v2-v4 in this file; causal TFLOP/s = 2 B H T^2 hd / time, H200 unless named,
// shapes of the timing table):
//   v1: attention_forward_scalar (llmc/attention_scalar.cuh): flash-style tiled CUDA-core fp32 kernel, online
//       softmax (any precision, hd 1..128).
//       Measured: 22-26 TFLOP/s on the three timing shapes.
//   v2: the tensor-core kernel forward_mma_kernel (FlashAttention-2 style, mma.sync m16n8k16 bf16, ldmatrix,
//       cp.async double buffering) for hd 64 and 128 (bf16 build only; other head dims fall back to v1), 16 queries
//       per warp (MT 1: 64 per CTA), 64 keys per tile; Q fragments in registers. Registers 160 (hd 64) / 234 (hd 128).
//       Measured on an NVIDIA H200 (B, T, H, KV, hd):
//         (4, 2048, 32, 8, 64):  226 TFLOP/s
//         (2, 4096, 32, 8, 128): 253 TFLOP/s
//         (1, 8192, 32, 8, 128): 260 TFLOP/s
//   v3: the same kernel with 32 queries per warp (MT 2: two m16 tiles, 128 queries per CTA), so each K / V fragment
//       loaded with ldmatrix feeds 4 mmas instead of 2; 64 keys per tile for hd 64 (Q in registers, 251 registers), 32
//       for hd 128 (Q re-read from
//       smem; 255 registers, 24 bytes spilled). smem 54 / 68 KiB. At hd 64 this is llmc/attention_mma.cuh's kernel.
//       Measured on an NVIDIA H200:
//         (4, 2048, 32, 8, 64):  250 TFLOP/s
//         (2, 4096, 32, 8, 128): 278 TFLOP/s
//         (1, 8192, 32, 8, 128): 288 TFLOP/s
//       Other tile configurations tried (./attention_forward sweep), same shapes: hd 64 MT 2 / 32 keys 217; hd 128
//       MT 2 / 64 keys (176 bytes spilled) 266, 275; hd 64 MT 1 / 128 keys 208; hd 128 MT 1 / 32 keys 226, 232.
//   v4: what the trainer ran until v5: at hd 128 on Hopper the wgmma kernel below (forward_wgmma_kernel<128, 1,
//       true>; bf16 build, sm_90a); at hd 64 v3's kernel (llmc/attention_mma.cuh); v1 otherwise.
//       wgmma: CTA = 128 queries = 2 consumer warpgroups of 64 rows sharing K / V tiles of 128 keys in
//       128-byte-swizzled smem (cp.async, 3
//       stages); S = Q K^T as wgmma m64n128k16 with Q and K from smem descriptors, P V as wgmma m64nHDk16 with P from
//       registers; online softmax on the accumulator fragment; the two warpgroups take turns issuing (named barriers),
//       so one's softmax overlaps the other's matmuls. Registers 243 (hd 128), 166 (hd 64), no spills; smem 225 KiB (hd
//       128): one CTA per SM. NVIDIA H200:
//         (4, 2048, 32, 8, 64):  251 TFLOP/s   (v3: 253; wgmma at hd 64 is now sweep 103: v4 runs v3 there)
//         (2, 4096, 32, 8, 128): 417 TFLOP/s   (v3: 280; cuDNN via PyTorch SDPA: ~540)
//         (1, 8192, 32, 8, 128): 443 TFLOP/s   (v3: 288; cuDNN: ~556)
//       Steps measured (hd 64 / 4096 / 8192 shapes): plain (2 stages, __syncthreads twice a tile, each warpgroup
//       S -> wait -> softmax -> P V -> wait): 245 / 382 / 403; + S and P V split into 2 halves of 64 keys (each
//       half's softmax overlaps the other half's matmul): 247 / 389 / 411; ping-pong + 3 stages without the split:
//       241 / 418 / 444 (hd 128's choice); with the split: 249 / 394 / 417. For hd 64 the best wgmma variant (split +
//       ping-pong, sweep 103) is no faster than v3, so llmc keeps v3 there; the sweep variants (103-106) are
//       forward_wgmma_kernel below with other template arguments (and hd 64).
//       What limits it: the loads are issued by the consumer threads themselves (16 cp.async per thread per tile
//       plus the address math, and a CTA-wide __syncthreads per tile), and a warpgroup's own S and P V never overlap
//       its softmax; hd 64 has too little matmul per tile to hide the softmax at all. Next steps (FA3): a producer
//       warp loading with TMA (cp.async.bulk.tensor, CUtensorMap, mbarrier full / empty per stage) instead of
//       cp.async + __syncthreads, setmaxnreg to move registers from the producer to the consumers (240 each), then
//       intra-warpgroup pipelining (issue S of tile j+1 before the softmax of tile j, which needs the registers
//       setmaxnreg frees); and skipping the masked half of warpgroup 0's diagonal tile.
//   v5: what the trainer ran until session 22 (now run as v6's kernel launched one CTA per work item, the same
//       schedule; the numbers below are of the kernel as it then was): on Hopper at hd 64 and 128 the
//       warp-specialised TMA forward now in llmc/attention_wgmma_forward.cuh (FlashAttention-3 style; sm_90a);
//       elsewhere v3 at hd 64 (other GPUs) and v1. CTA = 128 queries, 384 threads: warpgroup 0
//       is the producer (setmaxnreg.dec 24): one elected thread loads Q once and K / V tiles of 128 keys with TMA
//       (cp.async.bulk.tensor over qkv as the 4-D tensor (hd, head, token, batch), boxes of 64 columns x 128 rows,
//       SWIZZLE_128B = the layout v4's descriptors read; tokens >= T zero-filled) into STAGES stages with full /
//       empty mbarriers per stage; warpgroups 1, 2 are consumers of 64 rows (setmaxnreg.inc 240) with v4's math and
//       ping-pong, no __syncthreads in the loop, and with OVERLAP the intra-warpgroup pipelining (S_{j+1} issued with
//       P_j V_j, the softmax of S_{j+1} while P_j V_j runs; P in two register sets by tile parity, since copying it
//       made ptxas serialise the wgmmas). 6 stages at hd 64, 3 at hd 128, overlap on. Registers: 168 at launch
//       (384 threads, 1 CTA per SM), 24 / 240 after setmaxnreg, no spills; smem 209 KiB (hd 64, 6 stages), 225 KiB
//       (hd 128, 3 stages). Measured on an NVIDIA H100 (one session; v4 in the same run: 249 / 415 / 444):
//         (4, 2048, 32, 8, 64):  319 TFLOP/s   (cuDNN via PyTorch SDPA in attention_vs_pytorch.py, the same
//         (2, 4096, 32, 8, 128): 575 TFLOP/s    session: 257 / 528 / 544; an earlier H100 session: 270 / 532 / 547)
//         (1, 8192, 32, 8, 128): 641 TFLOP/s
//       Variants (sweep, same run): 4 stages at hd 64 (the first choice) 311 / 565 / 635 (noise at hd 128: the same
//       kernel); no intra-warpgroup overlap 300 / 517 / 572; 2 stages 298 / 468 / 515.
//       Later, in the SASS: ptxas had placed the softmax of S_{j+1} after the wait for P_j V_j (register arithmetic
//       moves freely past wgmma.wait_group), so what the overlap gained came from S_{j+1} being issued early. At
//       hd 64 that wait (with the stage release and O's rescale) now sits at the start of the next step, after the
//       tile's mbarrier wait, and the softmax's exponentials stay between the two waits. Same bits (the 1B's losses
//       over 30 steps). H100, --use_fast_math, alternating, two calls: hd 64 332.7-335.2 -> 341.6-346.9 TFLOP/s and
//       335.2-341.8 -> 343.1-346.5 (hd 128 runs the same code as before). Not kept: the same at hd 128 (ptxas
//       serialises the wgmmas, C7512: registers); a wait on an mbarrier long complete placed between the softmax and
//       the P_j V_j wait, which also keeps the softmax ahead of it: hd 128 570-582 / 612-645 against 595-609 /
//       668-679, and with it instead of the moved wait at hd 64, 329-334 against 343-347.
//   v6: attention_forward (what the trainer runs, llmc/attention.cuh): v5's kernel over work items. At hd 64 it is
//       persistent: one CTA per SM takes items c, c + SMs, ... in the longest-first order, with two Q buffers (225
//       KiB of shared memory with the 6 stages), so the next item's Q and first K / V tiles load while this one's
//       last tiles and epilogue run, instead of a fresh CTA paying for its barriers, its Q load and its first tile
//       on an idle SM. At hd 128 one Q buffer fits beside 3 stages, and the kernel keeps one CTA per item. Session
//       22, H100, alternating runs of the old binary (v5 as it was) and this one (v6), three rounds each:
//         (4, 2048, 32, 8, 64):  339-346 -> 380-387 TFLOP/s
//         (2, 4096, 32, 8, 128): 590-595 -> 535-578
//         (1, 8192, 32, 8, 128): 651-655 -> 637-644
//       Those hd 128 figures are of a build that ran its one item per CTA through the item loop, with 12 bytes of
//       spills from the state carried across items. The kept kernel leaves the loop after one item at compile time
//       there (no spills, the old single-item code): 599 / 664 in the next run, on another machine.
//       Tried: persistent at hd 128 too, the next item's first two K / V tiles loaded before its Q waits for the
//       epilogue to free the buffer: (2, 4096) 587-595 against 600, (1, 8192) 636 against 667 (attention_vs_pytorch,
//       same call); not kept.
//       Session 23: persistent at hd 128 as well, its one Q buffer released as soon as the item's last S product is
//       done (every consumer thread arrives on q_empty after the wgmma wait that completes it), so the next item's
//       Q loads under the last P V; the epilogue then stores O from the registers (4-byte stores, a quad's lanes 16
//       contiguous bytes of a row) instead of staging it through the Q tile. The same bits. With the items handed
//       out at a fixed stride (CTA c: c, c + SMs, ...) it was slower, because the longest-first order gave CTA 0 the
//       longest item of every round; with the snake order (llmc's persistent_item: every other round in reverse
//       CTA order) it is faster. H100, two alternating rounds of four builds, v6 TFLOP/s (the shuffle of the
//       warpgroup index in all of them; hd 64 shapes / (2, 4096, 128) / (1, 8192, 128)):
//         session 22's kernel:                  391.6, 390.8 / 597.7, 599.4 / 667.7, 669.1
//         hd 128 early Q, fixed stride:         389.2, 385.9 / 591.6, 592.5 / 610.2, 638.3
//         snake order, hd 128 one item per CTA: 394.3, 398.1 / 571.5, 571.7 / 643.8, 641.3
//         both (kept):                          397.0, 392.3 / 615.0, 612.4 / 673.8, 670.3
//       The hd 128 kernel carries 32 bytes of spills (the item loop's state), loaded once per item, none in the
//       tile loop. memcheck, synccheck and racecheck on attention_lib's smoke test: 0 errors, 0 hazards.
//       The consumers' warpgroup index comes through a shuffle (pipeline.cuh's ws_consumer_index): ptxas then keeps
//       the wgmma descriptors in uniform registers, 52 -> 20 R2UR moves at hd 64, 74 -> 18 at hd 128, the same speed.
//       Then the kernel in pipeline.cuh's vocabulary (rings counted rather than divided, the shared memory as a
//       struct; llmc/attention_wgmma_forward.cuh): the same bits, and no spills at hd 128 any more (28 bytes stored,
//       48 loaded before). H100, 8 runs each in ABBA order, medians: 400.0 -> 403.0 / 608.5 -> 636.0 / 666.4 ->
//       677.2 TFLOP/s.
//
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a [-DENABLE_FP32] attention_forward.cu
// Run:   ./attention_forward [version]     (no argument: every version; the fp32 build has only v1)
//        ./attention_forward 6 check       (validation only, no timing: for compute-sanitizer)
//        ./attention_forward sweep         (bf16: other tile configurations and v4 variants, spot-validated and timed)
// Versions 4 to 6 need a compute capability 9.0 GPU and the sm_90a build for their Hopper kernels; elsewhere they
// run v3 / v1 (a note says so).
#include "common.h"

#include "../../llmc/attention.cuh"
#include "../../llmc/ptx.cuh"
#include "wgmma_cp_async.cuh"
#include "attention_shapes.h"

// ---------------------------------------------------------------------------------------------------------------
// CPU reference: cpu::attention_forward (dev/cpu/llama3_cpu.h)

#if !defined(ENABLE_FP32)
// ---------------------------------------------------------------------------------------------------------------
// v2, v3: the mma.sync forward with its tile configuration as template arguments (llmc/attention_mma.cuh keeps v3's
// hd 64 configuration, <64, 2, 64>, as a plain kernel). MT: m16 query tiles per warp (the CTA owns 64 MT queries);
// BN: keys per K / V tile. The warp's Q fragments stay in registers when MT HD <= 128, else (hd 128 with MT 2, where
// O alone takes 128 registers) they are re-read from shared memory for each K tile.

// CTA rows (queries here; keys in dK/dV) for MT m16 tiles per warp.
template <int MT>
__host__ __device__ constexpr int mma_cta_rows() {
    return 16 * MT * MMA_WARPS;
}

template <int HD, int MT, int BN>
constexpr size_t forward_mma_smem_bytes() {
    return sizeof(__nv_bfloat16) * (HD + 8) * (mma_cta_rows<MT>() + 4 * BN);
}

// grid (B * H, ceil(T / (64 MT))), block 128. MT: m16 query tiles per warp; BN: keys per K/V tile.
template <int HD, int MT, int BN>
__global__ void __launch_bounds__(MMA_THREADS, 2)
    forward_mma_kernel(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int T, int H, int KV,
                                float scale_log2) {
    constexpr int LD = HD + 8, ROWS = mma_cta_rows<MT>(), WR = 16 * MT;  // WR: rows per warp
    // The warp's Q fragments (MT HD / 4 registers) stay in registers when that is cheap; otherwise (HD 128, MT 2,
    // where O alone takes 128 registers) they are re-read from smem for each K tile.
    constexpr bool QREG = MT * HD <= 128;
    extern __shared__ int4 forward_mma_smem[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(forward_mma_smem);  // (ROWS, LD)
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
    mma_load_tile<HD, ROWS>(Qs, q_src, stride, q0, T);
    mma_load_tile<HD, BN>(Ks, k_src, stride, 0, T);
    mma_load_tile<HD, BN>(Vs, v_src, stride, 0, T);
    cp_async_commit();

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
    const uint32_t q_base = smem_addr(Qs);

    for (int j = 0; j < n_tiles; j++) {
        const int stage = j % 2;
        if (j + 1 < n_tiles) {  // prefetch tile j+1 into the other stage (freed by the __syncthreads ending j-1)
            mma_load_tile<HD, BN>(Ks + (1 - stage) * BN * LD, k_src, stride, (j + 1) * BN, T);
            mma_load_tile<HD, BN>(Vs + (1 - stage) * BN * LD, v_src, stride, (j + 1) * BN, T);
            cp_async_commit();
            cp_async_wait<1>();  // tile j (and Q) landed; tile j+1 may still be in flight
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // everyone's copies of tile j visible

        if constexpr (QREG) {
            if (j == 0) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int kk = 0; kk < HD / 16; kk++) {
                        ldmatrix_x4(qf[mt][kk], q_base + ldmatrix_off_a<LD>(WR * warp + 16 * mt, 16 * kk, lane));
                    }
                }
            }
        }
        const int k0 = j * BN;
        if (k0 <= qw + WR - 1) {  // warp-uniform: the tile has keys visible to some query of this warp
            const uint32_t k_base = smem_addr(Ks + stage * BN * LD), v_base = smem_addr(Vs + stage * BN * LD);
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
                        ldmatrix_x4(qa[mt], q_base + ldmatrix_off_a<LD>(WR * warp + 16 * mt, 16 * kk, lane));
                    }
                }
#pragma unroll
                for (int np = 0; np < BN / 16; np++) {
                    uint32_t kb[4];
                    ldmatrix_x4(kb, k_base + ldmatrix_off_b<LD>(16 * np, 16 * kk, lane));
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_m16n8k16_bf16(s[mt][2 * np], qa[mt], kb[0], kb[1]);
                        mma_m16n8k16_bf16(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
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
            mma_acc_times_bt<HD, MT, BN, LD>(o, s, v_base, lane);
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
        mma_store_warp_rows<HD>(out + (size_t)b * T * out_stride + (size_t)h * HD, out_stride,
                                Qs + (WR * warp + 16 * mt) * LD, o[mt], inv_l[0], inv_l[1], qw + 16 * mt, T, lane);
    }
}

template <int HD, int MT, int BN>
static void forward_mma_launch(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV) {
    static bool smem_set = false;
    const size_t smem = forward_mma_smem_bytes<HD, MT, BN>();
    attention_set_smem(forward_mma_kernel<HD, MT, BN>, smem, smem_set);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)HD);
    dim3 grid(B * H, ceil_div(T, mma_cta_rows<MT>()));
    forward_mma_kernel<HD, MT, BN><<<grid, MMA_THREADS, smem>>>(out, lse, qkv, T, H, KV, scale_log2);
    cudaCheckLaunch();
}

// Tile configurations as version entries: <MT, BN> for hd 64 and for hd 128; other head dims take the scalar path.
template <int MT64, int BN64, int MT128, int BN128>
static void forward_tc_config(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd) {
    attention_check_args("forward_tc_config", B, T, H, KV, hd);
    if (hd == 64) return forward_mma_launch<64, MT64, BN64>(out, lse, qkv, B, T, H, KV);
    if (hd == 128) return forward_mma_launch<128, MT128, BN128>(out, lse, qkv, B, T, H, KV);
    attention_forward_scalar(out, lse, qkv, B, T, H, KV, hd, 0);
}

// ---------------------------------------------------------------------------------------------------------------
// v4's wgmma forward with its variants as template arguments (the trainer ran <128, 1, true> until v5). NH: parts per
// key tile (1, or 2 to overlap S of the second half with the softmax of the first, and P V of the first with the
// softmax of the second). PP ("ping-pong"): the two warpgroups take turns issuing their wgmma batches; with 3 K / V
// stages instead of 2.

template <int HD, bool PP>
constexpr size_t forward_wgmma_smem_bytes() {
    constexpr int STAGES = PP ? 3 : 2;
    return sizeof(__nv_bfloat16) * HD * (WGMMA_ROWS + 2 * STAGES * WGMMA_FWD_KEYS) +
           1024;  // + 1024: room to align the base
}

// grid (B * H, ceil(T / 128)), block 256 (2 warpgroups). NH: parts per key tile (1, or 2 to overlap S of the second
// half with the softmax of the first, and P V of the first with the softmax of the second). PP ("ping-pong"): the
// two warpgroups take turns issuing their wgmma batches (named barriers 1 and 2: "warpgroup w may issue"), so one
// warpgroup's softmax runs while the other's matmuls do; with 3 K / V stages, one __syncthreads per tile (tile
// landed) suffices, so the warpgroups may drift apart by part of a tile instead of running in lockstep.
template <int HD, int NH, bool PP>
__global__ void __launch_bounds__(WGMMA_THREADS, 1)
    forward_wgmma_kernel(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int T, int H, int KV,
                                    float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma exists only in sm_90a code; elsewhere: see the #else at the end
    constexpr int BN = WGMMA_FWD_KEYS, QBYTES = WGMMA_ROWS * HD * 2, TBYTES = BN * HD * 2;  // tile sizes in bytes
    constexpr int KP = BN / NH;                                                 // keys per part
    static_assert(NH == 1 || NH == 2, "1 or 2 parts per key tile");
    constexpr int STAGES = PP ? 3 : 2;
    extern __shared__ uint8_t wgmma_smem[];
    // Swizzle atoms must start on 1024-byte boundaries (descriptor base offset 0): align the shared address.
    const uint32_t smem = (smem_addr(wgmma_smem) + 1023u) & ~1023u;
    const uint32_t q_sm = smem;                  // Q (128 x HD), swizzled
    const uint32_t k_sm = q_sm + QBYTES;         // STAGES x K (BN x HD)
    const uint32_t v_sm = k_sm + STAGES * TBYTES;  // STAGES x V (BN x HD)
    uint8_t* smem_ptr = wgmma_smem + (smem - smem_addr(wgmma_smem));  // generic pointer to the aligned base

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * WGMMA_ROWS;  // the longest (last) query tiles are scheduled first
    const int qwg = q0 + 64 * wg;                            // the warpgroup's first query
    const int row0 = qwg + 16 * warp + g;                    // this thread's rows: row0 and row0 + 8
    const size_t stride = (size_t)(H + 2 * KV) * HD;
    const __nv_bfloat16* q_src = qkv + (size_t)b * T * stride + (size_t)h * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    const int n_tiles = ceil_div(min(q0 + WGMMA_ROWS, T), BN);  // causal: keys up to the CTA's last query
    wgmma_load_tile<HD, WGMMA_ROWS>(q_sm, q_src, stride, q0, T);
    wgmma_load_tile<HD, BN>(k_sm, k_src, stride, 0, T);
    wgmma_load_tile<HD, BN>(v_sm, v_src, stride, 0, T);
    cp_async_commit();

    float o[HD / 2];             // O accumulator fragment (64 x HD per warpgroup)
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows row0, row0 + 8: running max (log2), lane sums
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.0f;
    if (PP && wg == 1) named_barrier_arrive<256>(1);  // warpgroup 0 issues first

    for (int j = 0; j < n_tiles; j++) {
        const int stage = j % STAGES, next = (j + 1) % STAGES;
        if (j + 1 < n_tiles) {  // prefetch tile j+1 into the stage of tile j+1-STAGES (last read before the
                                // __syncthreads ending iteration j-1)
            wgmma_load_tile<HD, BN>(k_sm + next * TBYTES, k_src, stride, (j + 1) * BN, T);
            wgmma_load_tile<HD, BN>(v_sm + next * TBYTES, v_src, stride, (j + 1) * BN, T);
            cp_async_commit();
            cp_async_wait<1>();  // tile j (and Q) landed; tile j+1 may still be in flight
        } else {
            cp_async_wait<0>();
        }
        fence_proxy_async_shared();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        __syncthreads();         // ... and everyone's

        const int k0 = j * BN;
        // Warpgroup-uniform: some key of the tile is visible to some query of the warpgroup (with BN = 128 always
        // true; PP never skips, as the turn-taking needs both warpgroups to issue the same number of batches).
        if (PP || k0 <= qwg + 63) {
            const uint32_t k_st = k_sm + stage * TBYTES, v_st = v_sm + stage * TBYTES;
            // S = Q K^T, in NH parts of KP keys (each its own commit group). The k16 slice kk of d is column block
            // kk / 4, bytes 32 (kk % 4) of each row; key part hh starts at row KP hh of K (byte 128 KP hh).
            float s[NH][KP / 2];
            if constexpr (PP) named_barrier_sync<256>(1 + wg);  // my turn to issue
            wgmma_fence();
#pragma unroll
            for (int hh = 0; hh < NH; hh++) {
#pragma unroll
                for (int kk = 0; kk < HD / 16; kk++) {
                    const uint32_t off = 32 * (kk % 4);
                    const uint64_t da =
                        wgmma_desc_sw128(q_sm + (kk / 4) * (WGMMA_ROWS * 128) + 64 * wg * 128 + off, 16, 1024);
                    const uint64_t db = wgmma_desc_sw128(k_st + (kk / 4) * (BN * 128) + KP * hh * 128 + off, 16, 1024);
                    wgmma_bf16_ss(s[hh], da, db, kk > 0);
                }
                wgmma_commit_group();
            }
            if constexpr (PP) named_barrier_arrive<256>(2 - wg);  // the other warpgroup's turn
            uint32_t p[NH][KP / 16][4];  // P of each key part as bf16 A registers, live until its P V wgmma is done
#pragma unroll
            for (int hh = 0; hh < NH; hh++) {
                // Groups complete in order. Part 0: S_0 done, S_1 may run on. Part 1: S_1 done, P_0 V may run on.
                if (hh + 1 < NH || NH == 2) wgmma_wait_group<1>();
                else wgmma_wait_group<0>();
                pin_registers(s[hh]);
                const int kp0 = k0 + KP * hh;  // the part's first key
                if (kp0 + KP - 1 > qwg) {      // diagonal: some key is after some query of the warpgroup
#pragma unroll
                    for (int i = 0; i < KP / 2; i++) {
                        const int key = kp0 + 8 * (i / 4) + c + (i % 2), q = row0 + 8 * ((i / 2) % 2);
                        if (key > q) s[hh][i] = -INFINITY;
                    }
                }
                float alpha[2];
                wgmma_softmax_update(s[hh], m, l, alpha, scale_log2);
#pragma unroll
                for (int kk = 0; kk < KP / 16; kk++) {  // n8 groups 2 kk, 2 kk + 1 = keys 16 kk .. 16 kk + 15
                    p[hh][kk][0] = pack_bf16x2(s[hh][8 * kk + 0], s[hh][8 * kk + 1]);
                    p[hh][kk][1] = pack_bf16x2(s[hh][8 * kk + 2], s[hh][8 * kk + 3]);
                    p[hh][kk][2] = pack_bf16x2(s[hh][8 * kk + 4], s[hh][8 * kk + 5]);
                    p[hh][kk][3] = pack_bf16x2(s[hh][8 * kk + 6], s[hh][8 * kk + 7]);
                }
                if (hh > 0) {  // the previous part's P V must be done before O is rescaled
                    wgmma_wait_group<0>();
                    pin_registers(o);
                }
#pragma unroll
                for (int jn = 0; jn < HD / 8; jn++) {
                    o[4 * jn + 0] *= alpha[0];
                    o[4 * jn + 1] *= alpha[0];
                    o[4 * jn + 2] *= alpha[1];
                    o[4 * jn + 3] *= alpha[1];
                }
                // O += P V: the V k16 slice kk of part hh is rows KP hh + 16 kk (byte 128 (KP hh + 16 kk)), MN-major.
                pin_registers(p[hh]);  // P and the rescaled O are written before the wgmma.fence
                pin_registers(o);
                if constexpr (PP) named_barrier_sync<256>(1 + wg);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < KP / 16; kk++) {
                    wgmma_bf16_rs(o, p[hh][kk], wgmma_desc_sw128(v_st + 128 * (KP * hh + 16 * kk), BN * 128, 1024), 1);
                }
                wgmma_commit_group();
                if constexpr (PP) named_barrier_arrive<256>(2 - wg);
            }
            wgmma_wait_group<0>();
            pin_registers(o);
        }
        // 2 stages: both warpgroups done with this stage before the next iteration's prefetch overwrites it. 3
        // stages (PP): the prefetch at iteration j+1 overwrites tile j-1, which both warpgroups finished before the
        // __syncthreads at the top of iteration j.
        if (!PP) __syncthreads();
    }
    if (PP && wg == 0) named_barrier_sync<256>(1);  // consume warpgroup 1's last pass, so no arrival is left pending

    // Epilogue. lse, then O / l as bf16 into the warpgroup's own rows of the (dead) Q tile, then coalesced stores.
    float inv_l[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        inv_l[r] = 1.0f / sum;
        const int q = row0 + 8 * r;
        if (lane % 4 == 0 && q < T) lse[(size_t)blockIdx.x * T + q] = (m[r] + log2f(sum)) * ATTN_LN2;
    }
    const int lr = 64 * wg + 16 * warp + g;  // the thread's first row inside the Q tile
#pragma unroll
    for (int jn = 0; jn < HD / 8; jn++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            *reinterpret_cast<uint32_t*>(smem_ptr + swizzle128_offset<WGMMA_ROWS>(lr + 8 * r, jn) + 2 * c) =
                pack_bf16x2(o[4 * jn + 2 * r] * inv_l[r], o[4 * jn + 2 * r + 1] * inv_l[r]);
        }
    }
    __syncthreads();
    const size_t out_stride = (size_t)H * HD;
    __nv_bfloat16* dst = out + (size_t)b * T * out_stride + (size_t)h * HD;
    constexpr int CHUNKS = HD / 8;
#pragma unroll
    for (int i = 0; i < WGMMA_ROWS * CHUNKS / WGMMA_THREADS; i++) {
        const int idx = i * WGMMA_THREADS + threadIdx.x, r = idx / CHUNKS, ch = idx % CHUNKS;
        if (q0 + r < T) {
            *reinterpret_cast<int4*>(dst + (size_t)(q0 + r) * out_stride + 8 * ch) =
                *reinterpret_cast<const int4*>(smem_ptr + swizzle128_offset<WGMMA_ROWS>(r, ch));
        }
    }
#else
    // Not sm_90a code: the host never launches this (forward_wgmma_config checks attention_wgmma_usable); fail loudly
    // if someone does.
    __trap();
#endif
}

template <int HD, int NH, bool PP>
static void forward_wgmma_launch(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV) {
    static bool smem_set = false;
    const size_t smem = forward_wgmma_smem_bytes<HD, PP>();
    attention_set_smem(forward_wgmma_kernel<HD, NH, PP>, smem, smem_set);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)HD);
    dim3 grid(B * H, ceil_div(T, WGMMA_ROWS));
    forward_wgmma_kernel<HD, NH, PP><<<grid, WGMMA_THREADS, smem>>>(out, lse, qkv, T, H, KV, scale_log2);
    cudaCheckLaunch();
}

// Variants as sweep entries: <NH, PP> for hd 64 and for hd 128; other head dims, devices without sm_90a code, or
// misaligned tensors fall back as attention_forward does.
template <int NH64, bool PP64, int NH128, bool PP128>
static void forward_wgmma_config(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd) {
    if ((hd == 64 || hd == 128) && attention_aligned16({out, qkv}) && attention_wgmma_usable()) {
        attention_check_args("forward_wgmma_config", B, T, H, KV, hd);
        if (hd == 64) return forward_wgmma_launch<64, NH64, PP64>(out, lse, qkv, B, T, H, KV);
        return forward_wgmma_launch<128, NH128, PP128>(out, lse, qkv, B, T, H, KV);
    }
    attention_forward(out, lse, qkv, B, T, H, KV, hd, 0);
}

// v4: the wgmma kernel above at hd 128 on Hopper, v3's mma.sync kernel (llmc) at hd 64, else v1.
static void forward_v4(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd) {
    if (hd == 128 && attention_aligned16({out, qkv}) && attention_wgmma_usable()) {
        attention_check_args("forward_v4", B, T, H, KV, hd);
        return forward_wgmma_launch<128, 1, true>(out, lse, qkv, B, T, H, KV);
    }
    if (hd == MMA_FWD_HD) return attention_forward_mma(out, lse, qkv, B, T, H, KV, hd, 0);
    attention_forward_scalar(out, lse, qkv, B, T, H, KV, hd, 0);
}

// v5 (llmc's warp-specialised kernel) with its knobs <stages, overlap> for hd 64 and for hd 128; elsewhere as v5.
template <int ST64, bool OV64, int ST128, bool OV128>
static void forward_v5_config(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd) {
    if ((hd == 64 || hd == 128) && attention_aligned16({out, qkv}) && attention_wgmma_usable()) {
        attention_check_args("forward_v5_config", B, T, H, KV, hd);
        if (hd == 64) return attention_forward_wgmma_launch<64, ST64, OV64>(out, lse, qkv, B, T, H, KV, 0);
        return attention_forward_wgmma_launch<128, ST128, OV128>(out, lse, qkv, B, T, H, KV, 0);
    }
    attention_forward(out, lse, qkv, B, T, H, KV, hd, 0);
}

// v5: v6's kernel (llmc's) launched with one CTA per work item, the schedule before session 22 (at hd 128 with
// session 23's epilogue: O stored from the registers).
static void forward_v5(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd) {
    if ((hd == 64 || hd == 128) && attention_aligned16({out, qkv}) && attention_wgmma_usable()) {
        attention_check_args("forward_v5", B, T, H, KV, hd);
        if (hd == 64) return attention_forward_wgmma_launch<64, 6, true>(out, lse, qkv, B, T, H, KV, 0, true);
        return attention_forward_wgmma_launch<128, 3, true>(out, lse, qkv, B, T, H, KV, 0, true);
    }
    attention_forward(out, lse, qkv, B, T, H, KV, hd, 0);
}
#endif  // !ENABLE_FP32

static void attention_forward_gpu(int version, floatX* out, float* lse, const floatX* qkv, int B, int T, int H,
                                  int KV, int hd) {
    switch (version) {
        case 1: attention_forward_scalar(out, lse, qkv, B, T, H, KV, hd, 0); break;
#if !defined(ENABLE_FP32)
        case 2: forward_tc_config<1, 64, 1, 64>(out, lse, qkv, B, T, H, KV, hd); break;  // 16 queries per warp
        case 3: forward_tc_config<2, 64, 2, 32>(out, lse, qkv, B, T, H, KV, hd); break;  // 32 queries per warp
        case 4: forward_v4(out, lse, qkv, B, T, H, KV, hd); break;
        case 5: forward_v5(out, lse, qkv, B, T, H, KV, hd); break;
        case 6: attention_forward(out, lse, qkv, B, T, H, KV, hd, 0); break;  // what the trainer runs
        // Tuning candidates (./attention_forward sweep): not versions of their own.
        case 101: forward_tc_config<2, 32, 2, 64>(out, lse, qkv, B, T, H, KV, hd); break;
        case 102: forward_tc_config<1, 128, 1, 32>(out, lse, qkv, B, T, H, KV, hd); break;
        // v4 variants <NH, PP for hd 64; NH, PP for hd 128>: v4 with wgmma also for hd 64 (split + ping-pong, the
        // best there); no split, no ping-pong; split only; the other split.
        case 103: forward_wgmma_config<2, true, 1, true>(out, lse, qkv, B, T, H, KV, hd); break;
        case 104: forward_wgmma_config<1, false, 1, false>(out, lse, qkv, B, T, H, KV, hd); break;
        case 105: forward_wgmma_config<2, false, 2, false>(out, lse, qkv, B, T, H, KV, hd); break;
        case 106: forward_wgmma_config<1, true, 2, true>(out, lse, qkv, B, T, H, KV, hd); break;
        // v5 variants <stages, overlap for hd 64; stages, overlap for hd 128>: no intra-warpgroup overlap; 3 stages at
        // hd 64 (the fewest its late wait allows; 2 deadlocked there once the wait moved) and 2 at hd 128; 4 stages
        // at hd 64.
        case 107: forward_v5_config<6, false, 3, false>(out, lse, qkv, B, T, H, KV, hd); break;
        case 108: forward_v5_config<3, true, 2, true>(out, lse, qkv, B, T, H, KV, hd); break;
        case 109: forward_v5_config<4, true, 3, true>(out, lse, qkv, B, T, H, KV, hd); break;
#endif
        default: fprintf(stderr, "unknown version %d\n", version); exit(EXIT_FAILURE);
    }
}

#if defined(ENABLE_FP32)
static const int VERSIONS[] = {1};
#else
static const int VERSIONS[] = {1, 2, 3, 4, 5, 6};
#endif

static void validate_shape(int version, const Shape& sh, uint64_t seed) {
    const size_t n_qkv = (size_t)sh.B * sh.T * (sh.H + 2 * sh.KV) * sh.hd;
    const size_t n_out = (size_t)sh.B * sh.T * sh.H * sh.hd, n_lse = (size_t)sh.B * sh.H * sh.T;
    printf("v%d B=%d T=%d H=%d KV=%d hd=%d\n", version, sh.B, sh.T, sh.H, sh.KV, sh.hd);
    // Scale 1.5 makes the softmax peakier than scale 1 would, exercising the running-max rescaling.
    std::vector<float> qkv = round_to_floatX(random_floats(n_qkv, seed, 1.5f));
    std::vector<float> out_ref(n_out), lse_ref(n_lse);
    cpu::attention_forward(out_ref.data(), lse_ref.data(), qkv.data(), sh.B, sh.T, sh.H, sh.KV, sh.hd);

    floatX* d_qkv = device_from_host<floatX>(qkv);
    floatX* d_out;
    float* d_lse;
    cudaCheck(cudaMalloc(&d_out, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_lse, n_lse * sizeof(float)));
    poison(d_out, n_out * sizeof(floatX));
    poison(d_lse, n_lse * sizeof(float));
    attention_forward_gpu(version, d_out, d_lse, d_qkv, sh.B, sh.T, sh.H, sh.KV, sh.hd);
    cudaCheck(cudaDeviceSynchronize());
    validate("out", host_from_device(d_out, n_out), out_ref);
    validate("lse", host_from_device(d_lse, n_lse), lse_ref);
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_lse));
}

static void time_shape(int version, const Shape& sh) {
    const size_t n_qkv = (size_t)sh.B * sh.T * (sh.H + 2 * sh.KV) * sh.hd;
    const size_t n_out = (size_t)sh.B * sh.T * sh.H * sh.hd, n_lse = (size_t)sh.B * sh.H * sh.T;
    floatX* d_qkv = device_random<floatX>(n_qkv, 1234, 2.0f);  // uniform [-2, 2): about unit variance
    floatX* d_out;
    float* d_lse;
    cudaCheck(cudaMalloc(&d_out, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_lse, n_lse * sizeof(float)));
    float ms = benchmark_ms(10, [&] {
        attention_forward_gpu(version, d_out, d_lse, d_qkv, sh.B, sh.T, sh.H, sh.KV, sh.hd);
    });
    // Causal: half of the 2 matmuls (QK^T, PV) of 2 B H T^2 hd flops each.
    const double flops = 2.0 * sh.B * sh.H * (double)sh.T * sh.T * sh.hd;
    printf("  v%d  B=%d H=%d KV=%d T=%d hd=%d: %8.3f ms  %7.2f TFLOP/s\n", version, sh.B, sh.H, sh.KV, sh.T, sh.hd,
           ms, flops / (ms * 1e-3) / 1e12);
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_lse));
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);  // clear message and exit 1 without a GPU
    std::vector<int> versions(std::begin(VERSIONS), std::end(VERSIONS));
    if (argc > 1 && strcmp(argv[1], "sweep") == 0) {  // tile configurations: spot validation, then timing
        for (int cfg : {101, 102, 103, 104, 105, 106, 107, 108, 109}) {
            uint64_t seed = 7;
            for (const Shape& sh : ATTENTION_SWEEP_SHAPES) validate_shape(cfg, sh, seed++);
            for (const Shape& sh : ATTENTION_TIMING_SHAPES) time_shape(cfg, sh);
        }
        return finish(argv[0]);
    }
    if (argc > 1) versions = {atoi(argv[1])};
    if (!attention_versions_known(versions, std::vector<int>(std::begin(VERSIONS), std::end(VERSIONS)),
                                  PRECISION_NAME)) {
        return 1;
    }

    for (int version : versions) {
        printf("attention_forward version %d (%s): validation\n", version, PRECISION_NAME);
#if !defined(ENABLE_FP32)
        if (version == 4 && !attention_wgmma_usable()) {
            printf("  note: no sm_90 device or no sm_90a code in this build: v4 runs v1 at hd 128\n");
        }
        if ((version == 5 || version == 6) && !attention_wgmma_usable()) {
            printf("  note: no sm_90 device or no sm_90a code in this build: v%d runs v1 (v3 at hd 64)\n", version);
        }
#endif
        // T not a multiple of the tiles (64 queries; 32 or 64 keys), group sizes 1, 4, 8, head dims 16, 64, 128.
        uint64_t seed = 42;
        for (const Shape& sh : attention_validation_shapes()) validate_shape(version, sh, seed++);
        // llmc's Hopper kernel with several work items per CTA (v6), and on the same shapes one per CTA (v5)
        if (version == 5 || version == 6) {
            for (const Shape& sh : ATTENTION_PERSISTENT_SHAPES) validate_shape(version, sh, seed++);
        }
    }

    if (argc > 2 && strcmp(argv[2], "check") == 0) return finish(argv[0]);  // validation only (for sanitizers)
    printf("timing (causal TFLOP/s = 2 B H T^2 hd / time)\n");
    for (int version : versions) {
        for (const Shape& sh : ATTENTION_TIMING_SHAPES) time_shape(version, sh);
    }
    return finish(argv[0]);
}
