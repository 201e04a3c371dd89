// Version 5 of the causal GQA attention forward (dev/cuda/attention_forward.cu): warp-specialised and fed by TMA,
// FlashAttention-3 style, for Hopper (sm_90a code, compute capability 9.0), bf16 build, head_dim 64 and 128. A header
// of its own so that attention_forward.cu (validation, timing, sweep) and attention_lib.cu (the comparison with
// PyTorch, llmc_attention_forward_v5) run the same kernel; it moves into llmc/ once it measures faster than v4.
//
// Same contract as attention_forward (llmc/attention.cuh): qkv (B, T, (H + 2 KV) hd) -> out (B, T, H hd) bf16,
// lse (B, H, T) fp32 = natural-log log-sum-exp of each row of scaled scores. Conventions: llmc/ptx.cuh.
//
// CTA = 128 queries of one (batch, head), 384 threads = 3 warpgroups:
//   warpgroup 0, producer: setmaxnreg.dec to 24 registers; one elected thread loads the Q tile once and the K, V
//     tiles (128 keys each) up to the causal diagonal with TMA into STAGES stages, each tile as HD / 64 boxes of
//     64 columns (128 bytes) x 128 rows, 128-byte swizzled by the TMA unit into exactly the layout the wgmma
//     descriptors read. Rows past T are outside the tensor: TMA writes zeros there (and still credits the whole box).
//   warpgroups 1, 2, consumers of 64 query rows each: setmaxnreg.inc to 240; v4's math (S = Q K^T as wgmma
//     m64n128k16 from descriptors, causal mask on the diagonal tile, online softmax in the log2 domain on the
//     fragment, P as bf16 A registers, O += P V as wgmma m64nHDk16 with V MN-major), v4's ping-pong (the two
//     consumers take turns issuing their wgmma batches, named barriers 1 and 2), and with OVERLAP FA3's
//     intra-warpgroup pipelining: S_{j+1} = Q K_{j+1}^T is issued together with P_j V_j, and the softmax of tile
//     j+1 runs while P_j V_j does.
// Synchronisation, per stage s: full[s] (1 arrival: the producer's arrive.expect_tx of the tile's bytes, then the
// TMA's complete_tx) and empty[s] (256 arrivals: every consumer thread, once its P V wgmma reading the stage has been
// waited on). Tile j uses stage j % STAGES in round j / STAGES; round r waits for phase r of full (parity r % 2), and
// the producer refilling the stage in round r >= 1 waits for phase r - 1 of empty. Q has its own barrier (q_full).
// The 2 x 64 + 128 x 24 registers of the producer and consumers add up to the 384 x 168 the launch bounds give.
// Epilogue as v4's, per consumer warpgroup: O / l as bf16 through the warpgroup's own rows of the dead Q tile
// (named barrier 3 + w), then 16-byte stores; lse = (m + log2 l) ln 2.
// smem: Q 128 x HD + STAGES x (K, V) 2 x 128 x HD bf16 + the barriers + 1 KiB to align (HD 128, 3 stages: 225 KiB).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>

#include <cuda.h>          // CUtensorMap and its enums; the encode function is fetched at run time (no -lcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000

#include "../../llmc/attention.cuh"
#include "../../llmc/ptx.cuh"

#if !defined(ENABLE_FP32)

constexpr int V5_THREADS = 384;     // producer warpgroup + 2 consumer warpgroups
constexpr int V5_ROWS = 128;        // queries per CTA, 64 per consumer warpgroup; also the TMA box's rows
constexpr int V5_KEYS = 128;        // keys per K / V tile (= V5_ROWS: the CTA's last tile is its diagonal)
constexpr int V5_CONSUMERS = 256;   // consumer threads: the arrivals an empty barrier waits for
constexpr int V5_PRODUCER_REGS = 24, V5_CONSUMER_REGS = 240;  // 128 x 24 + 256 x 240 = 384 x 168
constexpr int V5_REGS_NEEDED = 128 * V5_PRODUCER_REGS + V5_CONSUMERS * V5_CONSUMER_REGS;  // after setmaxnreg
static_assert(V5_REGS_NEEDED <= 65536, "the register split exceeds the SM's register file");

template <int HD, int STAGES>
__host__ __device__ constexpr size_t forward_v5_smem_bytes() {
    return sizeof(__nv_bfloat16) * HD * (V5_ROWS + 2 * STAGES * V5_KEYS) + 8 * (1 + 2 * STAGES) + 1024;
}

// Blocks until the phase of parity `parity` of mbarrier bar has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
    while (!mbarrier_try_wait_parity(bar, parity)) {
    }
}

// The consumer's turn on tile k0: causal mask (diagonal tile only), online softmax update of m, l, then P (bf16 A
// fragments); alpha: the factor the running O must be scaled by before P V is added.
__device__ __forceinline__ void forward_v5_softmax(float (&s)[V5_KEYS / 2], uint32_t (&p)[V5_KEYS / 16][4],
                                                   float (&m)[2], float (&l)[2], float (&alpha)[2], int k0, int qwg,
                                                   int row0, int c, float scale_log2) {
    if (k0 + V5_KEYS - 1 > qwg) {  // diagonal: some key is after some query of the warpgroup (keys >= T included)
#pragma unroll
        for (int i = 0; i < V5_KEYS / 2; i++) {
            const int key = k0 + 8 * (i / 4) + c + (i % 2), q = row0 + 8 * ((i / 2) % 2);
            if (key > q) s[i] = -INFINITY;
        }
    }
    wgmma_softmax_update(s, m, l, alpha, scale_log2);
    wgmma_acc_to_a<V5_KEYS>(p, s);
}

template <int HD>
__device__ __forceinline__ void forward_v5_rescale(float (&o)[HD / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int jn = 0; jn < HD / 8; jn++) {
        o[4 * jn + 0] *= alpha[0];
        o[4 * jn + 1] *= alpha[0];
        o[4 * jn + 2] *= alpha[1];
        o[4 * jn + 3] *= alpha[1];
    }
}

// O += P V over the tile's 128 keys, one commit group: the V k16 slice kk is rows 16 kk (byte 2048 kk), MN-major.
template <int HD>
__device__ __forceinline__ void forward_v5_pv(float (&o)[HD / 2], const uint32_t (&p)[V5_KEYS / 16][4], uint32_t v_st) {
#pragma unroll
    for (int kk = 0; kk < V5_KEYS / 16; kk++) {
        wgmma_bf16_rs(o, p[kk], wgmma_desc_sw128(v_st + 128 * (16 * kk), V5_KEYS * 128, 1024), 1);
    }
    wgmma_commit_group();
}

// grid (B * H, ceil(T / 128)), block 384. qkv_map: qkv as the 4-D tensor (hd, head, token, batch), box
// (64, 1, 128, 1), 128-byte swizzle (forward_v5_qkv_map).
template <int HD, int STAGES, bool OVERLAP>
__global__ void __launch_bounds__(V5_THREADS, 1)
    forward_v5_kernel(const __grid_constant__ CUtensorMap qkv_map, __nv_bfloat16* out, float* lse, int T, int H,
                      int KV, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma and setmaxnreg exist only in sm_90a code
    constexpr int BN = V5_KEYS, QBYTES = V5_ROWS * HD * 2, TBYTES = BN * HD * 2;  // tile sizes in bytes
    static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
    static_assert(STAGES >= 2, "at least 2 K / V stages");
    static_assert(forward_v5_smem_bytes<HD, STAGES>() <= 227 * 1024, "stages do not fit in shared memory");
    extern __shared__ uint8_t v5_smem[];
    // Swizzle atoms (and TMA's swizzled destinations) start on 1024-byte boundaries: align the shared address.
    const uint32_t smem = (smem_addr(v5_smem) + 1023u) & ~1023u;
    const uint32_t q_sm = smem;                       // Q (128 x HD), swizzled, HD / 64 column blocks
    const uint32_t k_sm = q_sm + QBYTES;              // STAGES x K (BN x HD)
    const uint32_t v_sm = k_sm + STAGES * TBYTES;     // STAGES x V (BN x HD)
    const uint32_t q_full = v_sm + STAGES * TBYTES;   // mbarriers: q_full, full[STAGES], empty[STAGES]
    const uint32_t full0 = q_full + 8, empty0 = full0 + 8 * STAGES;
    uint8_t* smem_ptr = v5_smem + (smem - smem_addr(v5_smem));  // generic pointer to the aligned base

    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * V5_ROWS;   // the longest (last) query tiles are scheduled first
    const int n_tiles = ceil_div(min(q0 + V5_ROWS, T), BN);  // causal: keys up to the CTA's last query

    if (threadIdx.x == 0) {
        mbarrier_init(q_full, 1);
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full0 + 8 * s, 1);
            mbarrier_init(empty0 + 8 * s, V5_CONSUMERS);
        }
        fence_mbarrier_init();
    }
    __syncthreads();  // the barriers are initialised before anyone uses them (the last CTA-wide barrier)

    if (threadIdx.x < 128) {  // producer warpgroup
        setmaxnreg_dec<V5_PRODUCER_REGS>();
        if (threadIdx.x < 32 && elect_one_sync()) {
            mbarrier_arrive_expect_tx(q_full, QBYTES);
            for (int cb = 0; cb < HD / 64; cb++) {
                tma_load_4d(q_sm + cb * (V5_ROWS * 128), &qkv_map, q_full, 64 * cb, h, q0, b);
            }
            for (int j = 0; j < n_tiles; j++) {
                const int s = j % STAGES, round = j / STAGES;
                if (round > 0) mbarrier_wait(empty0 + 8 * s, (round - 1) & 1);  // the consumers released tile j-STAGES
                mbarrier_arrive_expect_tx(full0 + 8 * s, 2 * TBYTES);         // K and V, all column blocks
                for (int cb = 0; cb < HD / 64; cb++) {
                    tma_load_4d(k_sm + s * TBYTES + cb * (BN * 128), &qkv_map, full0 + 8 * s, 64 * cb, H + kvh, j * BN,
                                b);
                    tma_load_4d(v_sm + s * TBYTES + cb * (BN * 128), &qkv_map, full0 + 8 * s, 64 * cb,
                                H + KV + kvh, j * BN, b);
                }
            }
        }
        return;
    }

    // Consumers.
    setmaxnreg_inc<V5_CONSUMER_REGS>();
    const int wg = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int qwg = q0 + 64 * wg;          // the warpgroup's first query
    const int row0 = qwg + 16 * warp + g;  // this thread's rows: row0 and row0 + 8

    float o[HD / 2];  // O accumulator fragment (64 x HD per warpgroup)
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows row0, row0 + 8: running max (log2), lane sums
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.0f;
    float s[BN / 2];          // S accumulator fragment (64 x 128)
    uint32_t p[BN / 16][4];   // P as bf16 A registers, live until its P V wgmma has been waited on
    float alpha[2];
    if (wg == 1) named_barrier_arrive<V5_CONSUMERS>(1);  // consumer 0 issues first
    mbarrier_wait(q_full, 0);

    if constexpr (!OVERLAP) {
        for (int j = 0; j < n_tiles; j++) {
            const int st = j % STAGES;
            mbarrier_wait(full0 + 8 * st, (j / STAGES) & 1);
            named_barrier_sync<V5_CONSUMERS>(1 + wg);  // my turn to issue
            wgmma_fence();
            wgmma_scores_ss<HD, V5_ROWS, BN>(s, q_sm, k_sm + st * TBYTES, wg);
            named_barrier_arrive<V5_CONSUMERS>(2 - wg);  // the other consumer's turn
            wgmma_wait_group<0>();
            pin_registers(s);
            forward_v5_softmax(s, p, m, l, alpha, j * BN, qwg, row0, c, scale_log2);
            forward_v5_rescale<HD>(o, alpha);
            pin_registers(p);  // P and the rescaled O are written before the wgmma.fence
            pin_registers(o);
            named_barrier_sync<V5_CONSUMERS>(1 + wg);
            wgmma_fence();
            forward_v5_pv<HD>(o, p, v_sm + st * TBYTES);
            named_barrier_arrive<V5_CONSUMERS>(2 - wg);
            wgmma_wait_group<0>();
            pin_registers(o);
            pin_registers(p);
            mbarrier_arrive(empty0 + 8 * st);  // this thread's reads of the stage are done
        }
    } else {
        // P_j lives in p (j even) or pb (j odd) (no register copies: ptxas serialises the wgmmas when ordinary
        // instructions define their A registers inside the pipeline).
        uint32_t pb[BN / 16][4];
        // Tile j < n_tiles - 1: S_{j+1} and P_j V_j issued together, the softmax of S_{j+1} (into p_next) while
        // P_j V_j runs.
        auto step = [&](int j, uint32_t(&p_cur)[BN / 16][4], uint32_t(&p_next)[BN / 16][4]) {
            const int st = j % STAGES, nst = (j + 1) % STAGES;
            mbarrier_wait(full0 + 8 * nst, ((j + 1) / STAGES) & 1);
            pin_registers(p_cur);
            pin_registers(o);
            named_barrier_sync<V5_CONSUMERS>(1 + wg);
            wgmma_fence();
            wgmma_scores_ss<HD, V5_ROWS, BN>(s, q_sm, k_sm + nst * TBYTES, wg);  // S_{j+1}: one group
            forward_v5_pv<HD>(o, p_cur, v_sm + st * TBYTES);                    // P_j V_j: the next group
            named_barrier_arrive<V5_CONSUMERS>(2 - wg);
            wgmma_wait_group<1>();  // groups complete in order: S_{j+1} is done, P_j V_j may still run
            pin_registers(s);
            forward_v5_softmax(s, p_next, m, l, alpha, (j + 1) * BN, qwg, row0, c, scale_log2);
            wgmma_wait_group<0>();  // P_j V_j done: O may be rescaled, P_j's registers and stage st are free
            pin_registers(o);
            pin_registers(p_cur);
            mbarrier_arrive(empty0 + 8 * st);
            forward_v5_rescale<HD>(o, alpha);
        };
        // The last tile: P V only.
        auto last = [&](int j, uint32_t(&p_cur)[BN / 16][4]) {
            const int st = j % STAGES;
            pin_registers(p_cur);
            pin_registers(o);
            named_barrier_sync<V5_CONSUMERS>(1 + wg);
            wgmma_fence();
            forward_v5_pv<HD>(o, p_cur, v_sm + st * TBYTES);
            named_barrier_arrive<V5_CONSUMERS>(2 - wg);
            wgmma_wait_group<0>();
            pin_registers(o);
            pin_registers(p_cur);
            mbarrier_arrive(empty0 + 8 * st);
        };
        // Prologue: S_0 and its softmax (O is zero: no rescale).
        mbarrier_wait(full0, 0);
        named_barrier_sync<V5_CONSUMERS>(1 + wg);
        wgmma_fence();
        wgmma_scores_ss<HD, V5_ROWS, BN>(s, q_sm, k_sm, wg);
        named_barrier_arrive<V5_CONSUMERS>(2 - wg);
        wgmma_wait_group<0>();
        pin_registers(s);
        forward_v5_softmax(s, p, m, l, alpha, 0, qwg, row0, c, scale_log2);
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
    if (wg == 0) named_barrier_sync<V5_CONSUMERS>(1);  // consume consumer 1's last pass: no arrival left pending

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
            *reinterpret_cast<uint32_t*>(smem_ptr + swizzle128_offset<V5_ROWS>(lr + 8 * r, jn) + 2 * c) =
                pack_bf16x2(o[4 * jn + 2 * r] * inv_l[r], o[4 * jn + 2 * r + 1] * inv_l[r]);
        }
    }
    named_barrier_sync<128>(3 + wg);  // the warpgroup's rows are staged
    const size_t out_stride = (size_t)H * HD;
    __nv_bfloat16* dst = out + (size_t)b * T * out_stride + (size_t)h * HD;
    constexpr int CHUNKS = HD / 8;
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int i = 0; i < 64 * CHUNKS / 128; i++) {
        const int idx = i * 128 + t, r = idx / CHUNKS, ch = idx % CHUNKS;
        if (qwg + r < T) {
            *reinterpret_cast<int4*>(dst + (size_t)(qwg + r) * out_stride + 8 * ch) =
                *reinterpret_cast<const int4*>(smem_ptr + swizzle128_offset<V5_ROWS>(64 * wg + r, ch));
        }
    }
#else
    // Not sm_90a code: the host never launches this (attention_forward_v5_config checks attention_wgmma_usable).
    __trap();
#endif
}

// The tensor map of qkv (B, T, (H + 2 KV) hd) bf16 as the 4-D tensor (hd, head, token, batch), innermost first,
// strides in bytes nested as cuTensorMapEncodeTiled wants them; box (64, 1, 128, 1) = 128 rows of 128 bytes, 128-byte
// swizzle; out-of-bounds elements (tokens >= T) read as zeros.
inline CUtensorMap forward_v5_qkv_map(const floatX* qkv, int B, int T, int H, int KV, int hd) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (encode == nullptr) {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
            fprintf(stderr, "attention_forward_v5: the driver has no cuTensorMapEncodeTiled\n");
            fail_exit();
        }
        encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
    const cuuint64_t heads = (cuuint64_t)H + 2 * KV, elem = sizeof(__nv_bfloat16);
    const cuuint64_t dims[4] = {(cuuint64_t)hd, heads, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[3] = {hd * elem, heads * hd * elem, (cuuint64_t)T * heads * hd * elem};
    const cuuint32_t box[4] = {64, 1, V5_ROWS, 1};
    const cuuint32_t element_strides[4] = {1, 1, 1, 1};
    CUtensorMap map;
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<floatX*>(qkv), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr,
                "attention_forward_v5: cuTensorMapEncodeTiled failed (CUresult %d) for B %d T %d H %d KV %d hd %d\n",
                (int)r, B, T, H, KV, hd);
        fail_exit();
    }
    return map;
}

template <int HD, int STAGES, bool OVERLAP>
inline void forward_v5_launch(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV,
                              cudaStream_t stream) {
    static bool smem_set = false, regs_checked = false;
    const size_t smem = forward_v5_smem_bytes<HD, STAGES>();
    attention_set_smem(forward_v5_kernel<HD, STAGES, OVERLAP>, smem, smem_set);
    if (!regs_checked) {
        // setmaxnreg.inc waits for registers that setmaxnreg.dec returned to the CTA's allocation: a CTA launched
        // with fewer than the split needs would hang, so refuse to launch it.
        cudaFuncAttributes attr;
        cudaCheck(cudaFuncGetAttributes(&attr, forward_v5_kernel<HD, STAGES, OVERLAP>));
        if (attr.numRegs * V5_THREADS < V5_REGS_NEEDED) {
            fprintf(stderr, "attention_forward_v5: kernel compiled to %d registers per thread, the producer / "
                    "consumer split needs %d\n", attr.numRegs, V5_REGS_NEEDED / V5_THREADS);
            fail_exit();
        }
        regs_checked = true;
    }
    const CUtensorMap map = forward_v5_qkv_map(qkv, B, T, H, KV, HD);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)HD);
    dim3 grid(B * H, ceil_div(T, V5_ROWS));
    forward_v5_kernel<HD, STAGES, OVERLAP><<<grid, V5_THREADS, smem, stream>>>(map, out, lse, T, H, KV, scale_log2);
    cudaCheckLaunch();
}

// v5 with its knobs <stages, overlap> for hd 64 and for hd 128; other head dims, devices without sm_90a code, or
// misaligned tensors fall back to attention_forward (v4).
template <int ST64, bool OV64, int ST128, bool OV128>
inline void attention_forward_v5_config(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV,
                                        int hd, cudaStream_t stream) {
    if ((hd == 64 || hd == 128) && attention_aligned16({out, qkv}) && attention_wgmma_usable()) {
        attention_check_args("attention_forward_v5", B, T, H, KV, hd);
        if (hd == 64) return forward_v5_launch<64, ST64, OV64>(out, lse, qkv, B, T, H, KV, stream);
        return forward_v5_launch<128, ST128, OV128>(out, lse, qkv, B, T, H, KV, stream);
    }
    attention_forward(out, lse, qkv, B, T, H, KV, hd, stream);
}

// Version 5 as attention_forward.cu and attention_lib.cu run it: 4 stages at hd 64, 3 at hd 128, overlap on.
inline void attention_forward_v5(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd,
                                 cudaStream_t stream) {
    attention_forward_v5_config<4, true, 3, true>(out, lse, qkv, B, T, H, KV, hd, stream);
}

#endif  // !ENABLE_FP32
