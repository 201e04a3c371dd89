// Causal grouped-query attention, forward and backward, flash-attention style: no T x T buffer, only the per-row
// log-sum-exp is kept (O(B H T) extra memory).
//
// Layouts (row-major):
//   qkv  (B, T, (H + 2 KV) hd)   per token: H query heads, then KV key heads, then KV value heads (RoPE applied)
//   out  (B, T, H hd)            per token, the heads concatenated
//   lse  (B, H, T) fp32          log-sum-exp of each row of scaled scores
// Query head h attends with kv head h / (H / KV).
//
// Math, for one (b, h), scale = 1/sqrt(hd), causal (key j <= query i):
//   s_ij = scale q_i . k_j      lse_i = log sum_j exp(s_ij)      P_ij = exp(s_ij - lse_i)      o_i = sum_j P_ij v_j
// Backward, with D_i = do_i . o_i (= sum_j P_ij dP_ij):
//   dP_ij = do_i . v_j          dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j    dk_j = scale sum_i dS_ij q_i    dv_j = sum_i P_ij do_i
// For a kv head, dk and dv also sum over the H / KV query heads that share it.
//
// Paths (each in its own header; every one computes the math above and writes the same outputs):
//   attention_wgmma_forward.cuh, attention_wgmma_backward.cuh (shared pieces: attention_wgmma.cuh)
//                         Hopper wgmma kernels: bf16 build, sm_90a code, compute capability 9.0 (H100 / H200).
//                         Forward and backward, warp-specialised and fed by TMA, at head_dim 64 and 128.
//   attention_mma.cuh     mma.sync tensor-core forward (FlashAttention-2 style): bf16 build, head_dim 64, GPUs
//                         from sm_80 on other than Hopper.
//   attention_scalar.cuh  CUDA-core kernels, fp32 math, any floatX and head_dim 1..128: everything in the fp32 build
//                         (PRECISION=FP32), and in the bf16 build every head dim other than 64 / 128.
// Which runs where (bf16 build):
//                          head_dim 64             head_dim 128            other head dims
//   forward,  Hopper       wgmma                   wgmma                   scalar
//   backward, Hopper       wgmma                   wgmma                   scalar
//   forward,  other GPU    mma                     scalar                  scalar
//   backward, other GPU    scalar                  scalar                  scalar
// Only Hopper is tested with the tensor-core paths. On another GPU (or a build for another GPU_COMPUTE_CAPABILITY)
// the bf16 trainer still runs correctly, on the kernels of the last two rows (a note on stderr says so once), but the
// attention backward is several times slower there. The tensor-core paths need 16-byte aligned tensors (cudaMalloc
// gives 256) and fail with a message otherwise. Shared pieces (argument checks, D = rowsum(dout * out)):
// attention_common.cuh; PTX wrappers: ptx.cuh. Versions, measurements, and the kernels these were chosen from:
// dev/cuda/attention_forward.cu and attention_backward.cu.
#pragma once

#include <cstdio>

#include "attention_common.cuh"
#include "attention_mma.cuh"
#include "attention_scalar.cuh"
#include "attention_wgmma_backward.cuh"
#include "attention_wgmma_forward.cuh"
#include "cuda_common.h"
#include "rope.cuh"

#if !defined(ENABLE_FP32)
// Says once, on stderr, that a bf16 build runs attention on the slow CUDA-core kernels for lack of the Hopper ones.
inline void attention_note_no_wgmma() {
    static bool noted = false;
    if (noted) return;
    noted = true;
    fprintf(stderr,
            "note: attention: no Hopper wgmma kernels on this device or build (they need compute capability 9.0 and a "
            "GPU_COMPUTE_CAPABILITY=90 build): the backward, and the forward at head_dim 128, run on the CUDA-core "
            "kernels, several times slower\n");
}
#endif

// out (B, T, H hd) and lse (B, H, T) fp32, both OVERWRITTEN, from qkv (B, T, (H + 2 KV) hd).
inline void attention_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int n_heads, int n_kv_heads,
                              int head_dim, cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    if ((head_dim == 64 || head_dim == 128) && attention_wgmma_usable()) {
        attention_forward_wgmma(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
        return;
    }
    if (head_dim == 128) attention_note_no_wgmma();
    if (head_dim == MMA_FWD_HD) {
        attention_forward_mma(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
        return;
    }
#endif
    attention_forward_scalar(out, lse, qkv, B, T, n_heads, n_kv_heads, head_dim, stream);
}

// dqkv (B, T, (H + 2 KV) hd) OVERWRITTEN (query, key and value parts all written), from dout and out (B, T, H hd),
// qkv, and the forward's lse (B, H, T). delta_scratch: (B, H, T) fp32 scratch, overwritten with rowsum(dout * out).
// Deterministic: every element has one writer and a fixed summation order.
// rope: nullptr, or RoPE's {cos, sin} table (llmc/rope.cuh), whose backward is then applied to dq and dk: the result
// is bit-identical to rope_backward run on the output, and the wgmma kernels do it as they store (no extra pass).
inline void attention_backward(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                               const floatX* out, const float* lse, const float* rope, int B, int T, int n_heads,
                               int n_kv_heads, int head_dim, cudaStream_t stream) {
#if !defined(ENABLE_FP32)
    if (head_dim == 64 || head_dim == 128) {
        if (attention_wgmma_usable()) {
            attention_backward_wgmma(dqkv, delta_scratch, dout, qkv, out, lse, rope, B, T, n_heads, n_kv_heads,
                                     head_dim, stream);
            return;
        }
        attention_note_no_wgmma();
    }
#endif
    attention_backward_scalar(dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, head_dim, stream);
    if (rope != nullptr) rope_backward(dqkv, rope, B, T, n_heads, n_kv_heads, head_dim, stream);
}
