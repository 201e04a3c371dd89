// Causal GQA attention backward: validation against a CPU reference, a determinism check, and timing.
//
//   inputs:  qkv (B, T, (H + 2 KV) hd), out (B, T, H hd), dout (B, T, H hd), lse (B, H, T) fp32
//   output:  dqkv (B, T, (H + 2 KV) hd), every element overwritten
//   P_ij = exp(s_ij - lse_i), s_ij = q_i . k_j / sqrt(hd) (j <= i);  D_i = dout_i . out_i
//   dS_ij = P_ij (dout_i . v_j - D_i);  dq_i = sum_j dS_ij k_j / sqrt(hd);  dk_j = sum_i dS_ij q_i / sqrt(hd);
//   dv_j = sum_i P_ij dout_i   (dk, dv also summed over the query heads of a kv head's group)
//
// The inputs out and lse come from the CPU forward (out rounded through floatX), so the backward is tested alone;
// the reference uses the same rounded out for D, as the GPU does. fp64 accumulation throughout. Every version must
// also be deterministic: a rerun into a freshly poisoned buffer is compared bit for bit.
//
// Versions (v1-v4 in llmc/attention.cuh, v5 in llmc/attention_hopper.cuh; TFLOP/s = 2.5 x 2 B H T^2 hd / time, H200,
// shapes of the timing table):
//   v1: attention_backward_scalar: CUDA-core fp32 dq and dk/dv kernels (any precision, hd 1..128).
//       Measured: 14-18 TFLOP/s on the three timing shapes.
//   v2: the tensor-core kernels of attention_backward_tc (FlashAttention-2 style: a dK/dV kernel per key tile and kv
//       head, a dQ kernel per query tile and head, mma.sync m16n8k16 bf16) for hd 64 and 128 (bf16 build only; other
//       head dims fall back to v1), 16 rows per warp (MT 1) in both kernels; dQ: 64 keys per tile; dK/dV: 64 queries
//       per tile (hd 64), 32 (hd 128). Measured on an NVIDIA H200 (B, T, H, KV, hd):
//         (4, 2048, 32, 8, 64):  152 TFLOP/s
//         (2, 4096, 32, 8, 128): 180 TFLOP/s
//         (1, 8192, 32, 8, 128): 187 TFLOP/s
//   v3: attention_backward until v4: the same kernels with per-head-dim tile configurations. dQ: 32
//       queries per warp (MT 2: each K / V fragment loaded with ldmatrix feeds 4 mmas instead of 2), 64 keys per tile
//       (hd 64, 254 registers) or 32 (hd 128, 255 registers, no spill). dK/dV: 16 keys per warp, 64 queries per
//       tile (hd 64: 240 registers; hd 128: 255, 28 bytes spilled). smem dQ 72 / 102 KiB, dK/dV 55 / 103 KiB.
//       Measured on an NVIDIA H200:
//         (4, 2048, 32, 8, 64):  168 TFLOP/s
//         (2, 4096, 32, 8, 128): 208 TFLOP/s
//         (1, 8192, 32, 8, 128): 214 TFLOP/s
//       Other configurations tried (./attention_backward sweep), same shapes: dK/dV with 32 keys per warp (MT 2, 32
//       queries per tile; hd 64 spills 48 bytes): 128-137 at hd 64; dK/dV hd 128 with 32 queries per tile: 194, 200;
//       dQ hd 128 with MT 1: 191, 198 (64 keys), 183, 186 (32 keys); dQ hd 64 with 32 keys: 166; dK/dV hd 64 with 32
//       queries: 148. dK/dV with MT 2 at hd 128 would need 256 accumulator registers: out of reach in this design.
//   v4: attention_backward_tc (what the trainer ran until v5; v3 stays as a fixed entry): for hd 128 the dK/dV
//       kernel is the 8-warp attention_backward_dkdv_tc8_kernel (FA2's backward layout): 128 keys per CTA, warp
//       pairs share 32 keys; the two warps of a pair split S^T / dP^T by query halves and dK / dV by column halves
//       (HD fp32 accumulator registers each, as before), exchanging P^T, dS^T through smem (stmatrix, pair barrier):
//       ~2.5 mma per ldmatrix instead of ~1.8. 64 queries per tile, 3 stages, one CTA per SM, 255 registers (8 bytes
//       spilled), 207.5 KiB smem. Pairs 2, 3 run half a step behind pairs 0, 1 (they finish item it - 1 before
//       scoring item it), so the two warps of an SM sub-partition do not reach the exponentials together. hd 64 keeps
//       v3's kernels. dQ unchanged. Measured on an NVIDIA H200 (same session as the v3 line below):
//         (4, 2048, 32, 8, 64):  167 TFLOP/s   (v3 167)
//         (2, 4096, 32, 8, 128): 209 TFLOP/s   (v3 205)
//         (1, 8192, 32, 8, 128): 219 TFLOP/s   (v3 212)
//       In attention_vs_pytorch.py (fwd+bwd TFLOP/s, two runs of the same session, --iters 20), v3 -> v4:
//       hd 128 T 4096: 228 -> 245, T 8192: 234 -> 253 (PyTorch flash 253, 282): the gain there is larger than in
//       this benchmark's backward-only timing.
//       Tried (./attention_backward sweep): the 8-warp kernel without the skew (pairs in lockstep, one
//       __syncthreads per tile): 140, 188, 194 TFLOP/s, below v3, because with one CTA per SM every warp reaches
//       the exponentials at the same time and the tensor units idle (v3's two CTAs per SM drift apart); the skew
//       alone gives +12%. With the skew at hd 64: 144 (the mma phases are too short to cover the other warp's
//       exponentials), so hd 64 stays on the 4-warp kernel. 32 queries per tile (no skew): 138, 187, 193.
//       Tried after v4 and not kept (the code is not in the tree): the same skew in the dQ kernel, as an 8-warp dQ
//       kernel (one CTA of 256 queries per SM instead of two of 128; warps 4-7 half a key tile behind warps 0-3;
//       MT 2; K/V in 3 stages; 253 / 252 registers, no spill). NVIDIA H200, same session as v4 at 168.0 / 210.4 /
//       218.4: skewed 160.9 / 205.7 / 215.4; in lockstep 162.9 / 206.9 / 214.7; skewed with 32 keys per tile at
//       hd 64: 159.4 / 207.4 / 216.7 TFLOP/s. Fwd+bwd, dQ 4 -> 8 warps: 192.5 -> 188.4, 263.7 -> 260.9,
//       271.6 -> 273.2 (noise). The skew buys nothing here: the dQ kernel's two CTAs per SM already drift apart
//       (the dK/dV gain came from replacing one lockstep CTA per SM), and the larger query tile wastes more work
//       at the diagonal.
//   v4 is kept as a fixed entry (attention_backward_tc: the mma.sync kernels as configured above).
//   v5: attention_backward (what the trainer runs): on Hopper, attention_backward_hopper (llmc/attention_hopper.cuh,
//       sm_90a, hd 64 and 128; elsewhere v4's path). The same deterministic two-kernel split with wgmma: 2 warpgroups
//       of 64 rows per CTA, 128-byte-swizzled smem tiles read by descriptors, P^T / dS^T (dS in the dQ kernel) fed
//       to the next wgmma from registers. dK/dV: 128 keys per CTA, items of 64 queries through 4 cp.async stages, dK's
//       wgmma left running into the next item. dQ: 128 queries per CTA, K / V tiles of 128 keys (hd 64) or 64 keys
//       (hd 128, with Q and dO held in registers as A fragments). Registers: dK/dV 203 (hd 64) / 254 (hd 128), dQ 214
//       / 246, no spills. Measured on an NVIDIA H200:
//         (4, 2048, 32, 8, 64):  217 TFLOP/s   (v4 167)
//         (2, 4096, 32, 8, 128): 338 TFLOP/s   (v4 209)
//         (1, 8192, 32, 8, 128): 356 TFLOP/s   (v4 219)
//       Steps (same three shapes, each line one H200 session): first version (3 stages, dK waited for within its
//       item, dQ with 64-key tiles): 202 / 318 / 333; + dK running into the next item (4 stages): 211 / 331 / 338;
//       + 128-key dQ tiles at hd 64: 217 / 330 / 344; + Q, dO in registers in the hd 128 dQ kernel: 217 / 338 / 356.
//       Tried and not kept (./attention_backward sweep): the forward's ping-pong (warpgroups take turns issuing, named
//       barriers) in both kernels: 197 / 318 / 333 alone, 201 / 313 / 328 with the deferred dK (the enforced
//       alternation costs more than it overlaps); K and V in registers in the hd 64 dK/dV kernel (halves its smem reads
//       for S^T, dP^T, but ptxas serialises its wgmmas, C7515): 210 vs 217; Q, dO in registers at hd 64: 209 vs 210. At
//       hd 64 the softmax work per item is as large as at hd 128 for half the matmul, so the exponentials (twice per
//       score: once per kernel) limit it; the next steps would be one pass (dQ by ordered fp32 accumulation across key
//       tiles, FA3's deterministic mode) and a producer warp with TMA.
// Side by side with PyTorch SDPA: attention_vs_pytorch.py.
//
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a [-DENABLE_FP32] attention_backward.cu
// Run:   ./attention_backward [version]     (no argument: every version; the fp32 build has only v1)
//        ./attention_backward 5 check       (validation only, no timing: for compute-sanitizer)
//        ./attention_backward sweep         (bf16: other tile configurations, spot-validated and timed)
#include "common.h"

#include "../../llmc/attention.cuh"
#include "attention_reference.h"

// ---------------------------------------------------------------------------------------------------------------
// CPU reference (the forward, attention_forward_cpu, is in attention_reference.h)

// dqkv from qkv, out (as the GPU sees it), dout. Recomputes the softmax in fp64.
static void attention_backward_cpu(std::vector<float>& dqkv, const std::vector<float>& qkv,
                                   const std::vector<float>& out, const std::vector<float>& dout, int B, int T, int H,
                                   int KV, int hd) {
    const size_t qkv_stride = (size_t)(H + 2 * KV) * hd, out_stride = (size_t)H * hd;
    const double scale = 1.0 / std::sqrt((double)hd);
    std::vector<double> acc((size_t)B * T * qkv_stride, 0.0);
    std::vector<double> p(T), ds(T);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            const int kvh = h / (H / KV);
            auto q_at = [&](int t) { return &qkv[((size_t)b * T + t) * qkv_stride + (size_t)h * hd]; };
            auto k_at = [&](int t) { return &qkv[((size_t)b * T + t) * qkv_stride + (size_t)(H + kvh) * hd]; };
            auto v_at = [&](int t) { return &qkv[((size_t)b * T + t) * qkv_stride + (size_t)(H + KV + kvh) * hd]; };
            for (int i = 0; i < T; i++) {
                const float* q = q_at(i);
                const float* o = &out[((size_t)b * T + i) * out_stride + (size_t)h * hd];
                const float* dO = &dout[((size_t)b * T + i) * out_stride + (size_t)h * hd];
                double max_s = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    double dot = 0.0;
                    for (int d = 0; d < hd; d++) dot += (double)q[d] * k_at(j)[d];
                    p[j] = dot * scale;
                    max_s = std::max(max_s, p[j]);
                }
                double sum = 0.0;
                for (int j = 0; j <= i; j++) sum += std::exp(p[j] - max_s);
                for (int j = 0; j <= i; j++) p[j] = std::exp(p[j] - max_s) / sum;
                double D = 0.0;
                for (int d = 0; d < hd; d++) D += (double)dO[d] * o[d];
                for (int j = 0; j <= i; j++) {
                    double dp = 0.0;
                    for (int d = 0; d < hd; d++) dp += (double)dO[d] * v_at(j)[d];
                    ds[j] = p[j] * (dp - D);
                }
                double* dq = &acc[((size_t)b * T + i) * qkv_stride + (size_t)h * hd];
                for (int j = 0; j <= i; j++) {
                    double* dk = &acc[((size_t)b * T + j) * qkv_stride + (size_t)(H + kvh) * hd];
                    double* dv = &acc[((size_t)b * T + j) * qkv_stride + (size_t)(H + KV + kvh) * hd];
                    const float* k = k_at(j);
                    for (int d = 0; d < hd; d++) {
                        dq[d] += ds[j] * scale * k[d];
                        dk[d] += ds[j] * scale * q[d];
                        dv[d] += p[j] * dO[d];
                    }
                }
            }
        }
    }
    dqkv.resize(acc.size());
    for (size_t i = 0; i < acc.size(); i++) dqkv[i] = (float)acc[i];
}

// Splits a (B, T, (H + 2 KV) hd) tensor into its query, key and value parts, each (B, T, heads * hd).
static void split_qkv(const std::vector<float>& x, int B, int T, int H, int KV, int hd, std::vector<float>& q,
                      std::vector<float>& k, std::vector<float>& v) {
    const size_t stride = (size_t)(H + 2 * KV) * hd, nq = (size_t)H * hd, nk = (size_t)KV * hd;
    q.clear(); k.clear(); v.clear();
    for (size_t t = 0; t < (size_t)B * T; t++) {
        const float* row = &x[t * stride];
        q.insert(q.end(), row, row + nq);
        k.insert(k.end(), row + nq, row + nq + nk);
        v.insert(v.end(), row + nq + nk, row + stride);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// GPU versions

// Tensor-core tile configurations as version entries, per head dim: dQ <MT, BN>, dK/dV <MT, BQ>; other head dims
// take the scalar path, as attention_backward does.
template <int QMT64, int QBN64, int KMT64, int KBQ64, int QMT128, int QBN128, int KMT128, int KBQ128, int KW64 = 4,
          int KW128 = 4, bool SKEW = true>
static void backward_tc_config(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv, const floatX* out,
                               const float* lse, int B, int T, int H, int KV, int hd) {
#if !defined(ENABLE_FP32)
    if (hd == 64) {
        return attention_backward_tc_cfg<64, QMT64, QBN64, KMT64, KBQ64, KW64, SKEW>(dqkv, delta, dout, qkv, out,
                                                                                     lse, B, T, H, KV, 0);
    }
    if (hd == 128) {
        return attention_backward_tc_cfg<128, QMT128, QBN128, KMT128, KBQ128, KW128, SKEW>(dqkv, delta, dout, qkv,
                                                                                           out, lse, B, T, H, KV, 0);
    }
#endif
    attention_backward_scalar(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, 0);
}

// Hopper (wgmma) configurations as version entries: <BQ, BN> for hd 64 and for hd 128, then AREG (K / V in the dK/dV
// kernel, Q / dO in the dQ kernel) for hd 64 and for hd 128; where the Hopper kernels do not apply,
// attention_backward's choice.
template <int BQ64, int BN64, int BQ128, int BN128, bool AKV64, bool AQ64, bool AKV128, bool AQ128>
static void backward_hopper_config(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv, const floatX* out,
                                   const float* lse, int B, int T, int H, int KV, int hd) {
#if !defined(ENABLE_FP32)
    if (attention_tc_supported(hd) && attention_hopper_usable()) {
        attention_check_args("backward_hopper_config", B, T, H, KV, hd);
        if (hd == 64) {
            return attention_backward_hopper_cfg<64, BQ64, BN64, AKV64, AQ64>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                              H, KV, 0);
        }
        return attention_backward_hopper_cfg<128, BQ128, BN128, AKV128, AQ128>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                               H, KV, 0);
    }
#endif
    attention_backward(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, 0);
}

static void attention_backward_gpu(int version, floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                   const floatX* out, const float* lse, int B, int T, int H, int KV, int hd) {
    switch (version) {
        case 1: attention_backward_scalar(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, 0); break;
#if !defined(ENABLE_FP32)
        case 2:  // 16 rows per warp in both kernels
            backward_tc_config<1, 64, 1, 64, 1, 64, 1, 32>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 3:  // v3's configuration, kept as a fixed entry
            backward_tc_config<2, 64, 1, 64, 2, 32, 1, 64>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 4:  // v4, kept as a fixed entry: the mma.sync kernels as attention_backward_tc configures them
            if (attention_tc_supported(hd)) attention_backward_tc(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, 0);
            else attention_backward_scalar(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, 0);
            break;
        case 5: attention_backward(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, 0); break;
        // Tuning candidates (./attention_backward sweep): not versions of their own.
        case 101:  // hd 64: dQ with 32 keys per tile
            backward_tc_config<2, 32, 1, 64, 2, 32, 1, 64>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 102:  // hd 64: dK/dV with 32 queries per tile; hd 128: dQ with 16 queries per warp, 32 keys per tile
            backward_tc_config<2, 64, 1, 32, 1, 32, 1, 64>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 103:  // 8-warp dK/dV (skewed pairs), 64 queries per tile, both head dims
            backward_tc_config<2, 64, 0, 64, 2, 32, 0, 64, 8, 8>(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd);
            break;
        case 104:  // 8-warp dK/dV without the skew of the warp pairs, 64 queries per tile, both head dims
            backward_tc_config<2, 64, 0, 64, 2, 32, 0, 64, 8, 8, false>(dqkv, delta, dout, qkv, out, lse, B, T, H,
                                                                         KV, hd);
            break;
        case 105:  // Hopper, no operand in registers; dQ with 64 keys per tile at hd 64
            backward_hopper_config<64, 64, 64, 64, false, false, false, false>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                               H, KV, hd);
            break;
        case 106:  // Hopper, no operand in registers
            backward_hopper_config<64, 128, 64, 64, false, false, false, false>(dqkv, delta, dout, qkv, out, lse, B,
                                                                                T, H, KV, hd);
            break;
        case 107:  // Hopper, K / V in registers only (hd 64 dK/dV)
            backward_hopper_config<64, 128, 64, 64, true, false, false, false>(dqkv, delta, dout, qkv, out, lse, B, T,
                                                                               H, KV, hd);
            break;
        case 108:  // Hopper, Q / dO in registers in the dQ kernel, both head dims; K / V at hd 64
            backward_hopper_config<64, 128, 64, 64, true, true, false, true>(dqkv, delta, dout, qkv, out, lse, B, T, H,
                                                                             KV, hd);
            break;
#endif
        default: fprintf(stderr, "unknown version %d\n", version); exit(EXIT_FAILURE);
    }
}

#if defined(ENABLE_FP32)
static const int VERSIONS[] = {1};
#else
static const int VERSIONS[] = {1, 2, 3, 4, 5};
#endif

static void validate_shape(int version, const Shape& sh, uint64_t seed) {
    const int B = sh.B, T = sh.T, H = sh.H, KV = sh.KV, hd = sh.hd;
    const size_t n_qkv = (size_t)B * T * (H + 2 * KV) * hd, n_out = (size_t)B * T * H * hd, n_lse = (size_t)B * H * T;
    printf("v%d B=%d T=%d H=%d KV=%d hd=%d\n", version, B, T, H, KV, hd);
    std::vector<float> qkv = round_to_floatX(random_floats(n_qkv, seed, 1.5f));
    std::vector<float> dout = round_to_floatX(random_floats(n_out, seed + 1000, 1.0f));
    std::vector<float> out, lse;
    attention_forward_cpu(out, lse, qkv, B, T, H, KV, hd);
    out = round_to_floatX(out);  // what the GPU forward would have stored
    std::vector<float> dqkv_ref;
    attention_backward_cpu(dqkv_ref, qkv, out, dout, B, T, H, KV, hd);

    floatX* d_qkv = device_from_host<floatX>(qkv);
    floatX* d_out = device_from_host<floatX>(out);
    floatX* d_dout = device_from_host<floatX>(dout);
    float* d_lse = device_from_host<float>(lse);
    floatX* d_dqkv;
    float* d_delta;
    cudaCheck(cudaMalloc(&d_dqkv, n_qkv * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_delta, n_lse * sizeof(float)));

    poison(d_dqkv, n_qkv * sizeof(floatX));
    poison(d_delta, n_lse * sizeof(float));
    attention_backward_gpu(version, d_dqkv, d_delta, d_dout, d_qkv, d_out, d_lse, B, T, H, KV, hd);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> dqkv = host_from_device(d_dqkv, n_qkv);
    std::vector<float> dq, dk, dv, dq_ref, dk_ref, dv_ref;
    split_qkv(dqkv, B, T, H, KV, hd, dq, dk, dv);
    split_qkv(dqkv_ref, B, T, H, KV, hd, dq_ref, dk_ref, dv_ref);
    validate("dq", dq, dq_ref);
    validate("dk", dk, dk_ref);
    validate("dv", dv, dv_ref);

    // Determinism: a second run into a freshly poisoned buffer must match the first bit for bit.
    floatX* d_dqkv2;
    cudaCheck(cudaMalloc(&d_dqkv2, n_qkv * sizeof(floatX)));
    poison(d_dqkv2, n_qkv * sizeof(floatX));
    attention_backward_gpu(version, d_dqkv2, d_delta, d_dout, d_qkv, d_out, d_lse, B, T, H, KV, hd);
    cudaCheck(cudaDeviceSynchronize());
    validate_bitwise("dqkv rerun", d_dqkv, d_dqkv2, n_qkv);
    cudaCheck(cudaFree(d_dqkv2));

    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_lse));
    cudaCheck(cudaFree(d_dqkv));
    cudaCheck(cudaFree(d_delta));
}

static void time_shape(int version, const Shape& sh) {
    const int B = sh.B, T = sh.T, H = sh.H, KV = sh.KV, hd = sh.hd;
    const size_t n_qkv = (size_t)B * T * (H + 2 * KV) * hd, n_out = (size_t)B * T * H * hd, n_lse = (size_t)B * H * T;
    floatX* d_qkv = device_random<floatX>(n_qkv, 1234, 2.0f);  // uniform [-2, 2): about unit variance
    floatX* d_dout = device_random<floatX>(n_out, 5678, 1.0f);
    floatX *d_out, *d_dqkv;
    float *d_lse, *d_delta;
    cudaCheck(cudaMalloc(&d_out, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dqkv, n_qkv * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_lse, n_lse * sizeof(float)));
    cudaCheck(cudaMalloc(&d_delta, n_lse * sizeof(float)));
    attention_forward(d_out, d_lse, d_qkv, B, T, H, KV, hd, 0);  // realistic out and lse
    float ms = benchmark_ms(10, [&] {
        attention_backward_gpu(version, d_dqkv, d_delta, d_dout, d_qkv, d_out, d_lse, B, T, H, KV, hd);
    });
    // Convention: backward = 2.5 x the causal forward's 2 B H T^2 hd flops.
    const double flops = 2.5 * 2.0 * B * H * (double)T * T * hd;
    printf("  v%d  B=%d H=%d KV=%d T=%d hd=%d: %8.3f ms  %7.2f TFLOP/s\n", version, B, H, KV, T, hd, ms,
           flops / (ms * 1e-3) / 1e12);
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dqkv));
    cudaCheck(cudaFree(d_lse));
    cudaCheck(cudaFree(d_delta));
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);  // clear message and exit 1 without a GPU
    std::vector<int> versions(std::begin(VERSIONS), std::end(VERSIONS));
    if (argc > 1 && strcmp(argv[1], "sweep") == 0) {  // tile configurations: spot validation, then timing
        std::vector<int> cfgs = {101, 102, 103, 104, 105, 106, 107, 108};
        if (argc > 2) cfgs = {atoi(argv[2])};
        for (int cfg : cfgs) {
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
        printf("attention_backward version %d (%s): validation\n", version, PRECISION_NAME);
#if !defined(ENABLE_FP32)
        if (version == 5 && !attention_hopper_usable()) {
            printf("  note: no sm_90 device or no sm_90a code in this build: v5 runs v4's kernels\n");
        }
#endif
        // T not a multiple of the tiles (v2-v4: 64 fixed rows, 32 or 64 streamed; v5: 128 fixed rows, 64 or 128
        // streamed), group sizes 1, 4, 8, head dims 16, 64, 128.
        uint64_t seed = 7;
        for (const Shape& sh : attention_validation_shapes()) validate_shape(version, sh, seed++);
    }

    if (argc > 2 && strcmp(argv[2], "check") == 0) return finish(argv[0]);  // validation only (for sanitizers)
    printf("timing (TFLOP/s = 2.5 x 2 B H T^2 hd / time)\n");
    for (int version : versions) {
        for (const Shape& sh : ATTENTION_TIMING_SHAPES) time_shape(version, sh);
    }
    return finish(argv[0]);
}
