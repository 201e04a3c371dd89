// Rotary position embedding (RoPE), applied in place to the query and key heads of the packed qkv activation.
//
//   qkv: (B, T, (H + 2*KV) * hd) row-major; per token the H query heads of hd, then KV key heads, then KV value heads.
//   For every q and k head and every pair i in [0, hd/2), with (c, s) = freqs_cos_sin[t, i, :] and t = n % T:
//     forward:  (x0, x1) at (2i, 2i+1)  ->  (x0*c - x1*s,  x0*s + x1*c)       (Meta's interleaved-pair rotation)
//     backward: (g0, g1)                ->  (g0*c + g1*s, -g0*s + g1*c)       (the transpose = inverse rotation)
//   Value heads are left alone.
//
// freqs_cos_sin: fp32 (T, hd/2, 2), {cos, sin} interleaved so one load fetches both (8 bytes for one pair, 16 for
// two). Build it on the host with rope_interleave_tables() from model.h's rope_tables(). A table built for more
// positions (max_seq_len) works for any T up to that, since its row stride (hd floats) does not depend on T.
//
// Two kernels, the same math (rope_rotate: fp32 with fixed FMAs, rounded once to floatX per element, so they agree
// bit for bit):
// - rope_chunk_kernel (used whenever hd % VEC16 == 0, e.g. hd 64 and 128): one thread per 16-byte chunk of a head,
//   VEC16 elements = VEC16/2 pairs (4 in bf16, 2 in fp32), loaded and stored as one int4, with its {cos, sin} as
//   float4s. RoPE is memory-bound: 16 bytes per thread instead of 4 (bf16) means 4x fewer threads, instructions and
//   32-bit index divisions per byte moved, and a warp's consecutive chunks cover 512 bytes, fully coalesced.
// - rope_pair_kernel (the fallback for any other even hd, e.g. 2 and 6): one thread per pair, a 4-byte (bf16) or
//   8-byte (fp32) access; a warp covers 32 consecutive pairs, so it is coalesced too, just with narrow accesses.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_common.h"

// Interleaves rope_tables()' separate cos and sin (T, hd/2) vectors into the (T, hd/2, 2) layout the kernels read.
inline std::vector<float> rope_interleave_tables(const std::vector<float>& cos_table,
                                                 const std::vector<float>& sin_table) {
    std::vector<float> out(2 * cos_table.size());
    for (size_t i = 0; i < cos_table.size(); i++) {
        out[2 * i] = cos_table[i];
        out[2 * i + 1] = sin_table[i];
    }
    return out;
}

// Two consecutive floatX as a pair (aligned: the pair starts at an even element of an even-length head).
template <typename T>
struct RopePair;
template <>
struct RopePair<float> { typedef float2 type; };
template <>
struct RopePair<__nv_bfloat16> { typedef __nv_bfloat162 type; };

// Threads per block of both kernels.
constexpr int ROPE_BLOCK = 256;

// Rotates one pair by (c, s), s already multiplied by the direction: y0 = x0 c - x1 s, y1 = x0 s + x1 c. The FMAs
// are spelled out (__fmul_rn is never contracted) because, left to itself, the compiler fused different products in
// the two kernels (y1 as fma(x0, s, x1 c) in one, fma(x1, c, x0 s) in the other), changing last bits. This is the
// form the pair kernel compiled to before, so its results are unchanged and both kernels agree bit for bit.
__device__ __forceinline__ void rope_rotate(float x0, float x1, float c, float s, float* y0, float* y1) {
    *y0 = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
    *y1 = __fmaf_rn(x0, s, __fmul_rn(x1, c));
}

// One thread per rotated pair. direction = +1 rotates by +angle (forward), -1 by -angle (backward).
__global__ void rope_pair_kernel(floatX* qkv, const float* freqs_cos_sin, int T, int n_rot_heads, int n_all_heads,
                                 int head_dim, size_t total_pairs, float direction) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total_pairs) return;
    int half = head_dim / 2;
    size_t per_row = (size_t)n_rot_heads * half;  // rotated pairs per token: q heads then k heads, contiguous
    size_t n = idx / per_row;
    int within = (int)(idx % per_row);  // pair index inside the token's q|k part
    int i = within % half;              // pair index inside its head
    int t = (int)(n % T);
    float2 cs = *reinterpret_cast<const float2*>(freqs_cos_sin + ((size_t)t * half + i) * 2);
    float c = cs.x, s = cs.y * direction;
    // the q and k heads are the first n_rot_heads heads of the row, so the element offset is 2 * within
    typedef typename RopePair<floatX>::type pair_t;
    pair_t* p = reinterpret_cast<pair_t*>(qkv + n * ((size_t)n_all_heads * head_dim) + 2 * (size_t)within);
    pair_t v = *p;
    float y0, y1;
    rope_rotate(to_float(v.x), to_float(v.y), c, s, &y0, &y1);
    v.x = from_float<floatX>(y0);
    v.y = from_float<floatX>(y1);
    *p = v;
}

// One thread per 16-byte chunk: VEC16 elements = VEC16/2 pairs of one q or k head (needs head_dim % VEC16 == 0, so
// no chunk straddles two heads). The launcher guarantees total_chunks + ROPE_BLOCK fits in 32 bits, so the index
// math is 32-bit; only the final addresses are size_t.
__global__ void rope_chunk_kernel(floatX* qkv, const float* freqs_cos_sin, int T, int chunks_per_row,
                                  int chunks_per_head, int row_len, int half, unsigned total_chunks, float direction) {
    unsigned idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total_chunks) return;
    unsigned n = idx / chunks_per_row;           // token index b * T + t
    unsigned within = idx - n * chunks_per_row;  // chunk index inside the token's q|k part
    unsigned t = n % T;
    unsigned pair0 = (within % chunks_per_head) * (VEC16 / 2);  // first pair of the chunk inside its head

    // the q and k heads are the first heads of the row, so the chunk's element offset is VEC16 * within
    floatX* p = qkv + (size_t)n * row_len + (size_t)within * VEC16;
    float x[VEC16];
    load_as_float<VEC16>(x, p);
    // {cos, sin} of the chunk's VEC16/2 pairs: VEC16 consecutive floats, 16-byte aligned since pair0 and half are
    // even (VEC16 >= 4 divides head_dim)
    const float4* table = reinterpret_cast<const float4*>(freqs_cos_sin + 2 * ((size_t)t * half + pair0));
    float cs[VEC16];
#pragma unroll
    for (int k = 0; k < VEC16 / 4; k++) {
        float4 f = table[k];
        cs[4 * k] = f.x;
        cs[4 * k + 1] = f.y;
        cs[4 * k + 2] = f.z;
        cs[4 * k + 3] = f.w;
    }
    float y[VEC16];
#pragma unroll
    for (int j = 0; j < VEC16 / 2; j++) {
        rope_rotate(x[2 * j], x[2 * j + 1], cs[2 * j], cs[2 * j + 1] * direction, &y[2 * j], &y[2 * j + 1]);
    }
    store_from_float<VEC16>(p, y);
}

// Always the pair kernel: rope_launch's fallback, and version 1 in dev/cuda/rope.cu.
inline void rope_launch_pairs(floatX* qkv, const float* freqs_cos_sin, int B, int T, int n_heads, int n_kv_heads,
                              int head_dim, float direction, cudaStream_t stream) {
    if (head_dim % 2 != 0) {
        fprintf(stderr, "Error: RoPE needs an even head_dim, got %d\n", head_dim);
        fail_exit();
    }
    size_t total_pairs = (size_t)B * T * (n_heads + n_kv_heads) * (head_dim / 2);
    if (total_pairs == 0) return;
    rope_pair_kernel<<<(unsigned)ceil_div<size_t>(total_pairs, ROPE_BLOCK), ROPE_BLOCK, 0, stream>>>(
        qkv, freqs_cos_sin, T, n_heads + n_kv_heads, n_heads + 2 * n_kv_heads, head_dim, total_pairs, direction);
    cudaCheckLaunch();
}

// Whether rope_launch takes the chunk kernel: chunks must not straddle heads, the 16-byte accesses must be aligned
// (cudaMalloc'd buffers are), and the chunk count must leave the 32-bit thread index room not to wrap.
inline bool rope_chunks_apply(const floatX* qkv, const float* freqs_cos_sin, int B, int T, int n_heads,
                              int n_kv_heads, int head_dim) {
    size_t total_chunks = (size_t)B * T * (n_heads + n_kv_heads) * (head_dim / VEC16);
    return head_dim % VEC16 == 0 && (uintptr_t)qkv % 16 == 0 && (uintptr_t)freqs_cos_sin % 16 == 0 &&
           total_chunks <= (size_t)UINT32_MAX - ROPE_BLOCK;
}

// The chunk kernel where it applies, else the pair kernel (which rejects an odd head_dim).
inline void rope_launch(floatX* qkv, const float* freqs_cos_sin, int B, int T, int n_heads, int n_kv_heads,
                        int head_dim, float direction, cudaStream_t stream) {
    if (!rope_chunks_apply(qkv, freqs_cos_sin, B, T, n_heads, n_kv_heads, head_dim)) {
        rope_launch_pairs(qkv, freqs_cos_sin, B, T, n_heads, n_kv_heads, head_dim, direction, stream);
        return;
    }
    int chunks_per_head = head_dim / VEC16;
    int chunks_per_row = (n_heads + n_kv_heads) * chunks_per_head;
    unsigned total_chunks = (unsigned)((size_t)B * T * chunks_per_row);
    if (total_chunks == 0) return;
    rope_chunk_kernel<<<ceil_div<unsigned>(total_chunks, ROPE_BLOCK), ROPE_BLOCK, 0, stream>>>(
        qkv, freqs_cos_sin, T, chunks_per_row, chunks_per_head, (n_heads + 2 * n_kv_heads) * head_dim, head_dim / 2,
        total_chunks, direction);
    cudaCheckLaunch();
}

// In place on qkv (B, T, (H + 2 KV) hd): rotates the q and k heads by their position's angles. Overwrites in place.
inline void rope_forward(floatX* qkv, const float* freqs_cos_sin, int B, int T, int n_heads, int n_kv_heads,
                         int head_dim, cudaStream_t stream) {
    rope_launch(qkv, freqs_cos_sin, B, T, n_heads, n_kv_heads, head_dim, 1.0f, stream);
}

// In place on the gradient dqkv: applies the inverse (transposed) rotation to the q and k parts; v untouched.
inline void rope_backward(floatX* dqkv, const float* freqs_cos_sin, int B, int T, int n_heads, int n_kv_heads,
                          int head_dim, cudaStream_t stream) {
    rope_launch(dqkv, freqs_cos_sin, B, T, n_heads, n_kv_heads, head_dim, -1.0f, stream);
}
