// Rotary position embedding (RoPE), applied in place to the query and key heads of the packed qkv activation.
//
//   qkv: (B, T, (H + 2*KV) * hd) row-major; per token the H query heads of hd, then KV key heads, then KV value heads.
//   For every q and k head and every pair i in [0, hd/2), with (c, s) = freqs_cos_sin[t, i, :] and t = n % T:
//     forward:  (x0, x1) at (2i, 2i+1)  ->  (x0*c - x1*s,  x0*s + x1*c)       (Meta's interleaved-pair rotation)
//     backward: (g0, g1)                ->  (g0*c + g1*s, -g0*s + g1*c)       (the transpose = inverse rotation)
//   Value heads are left alone.
//
// freqs_cos_sin: fp32 (T, hd/2, 2), {cos, sin} interleaved so one 8-byte load fetches both. Build it on the host
// with rope_interleave_tables() from checkpoint.h's rope_tables(). A table built for more positions (max_seq_len)
// works for any T up to that, since its row stride (hd floats) does not depend on T.
//
// One thread per rotated pair: the pair is one 4-byte (bf16) or 8-byte (fp32) access, and a warp covers 32
// consecutive pairs, so loads and stores are fully coalesced. The math is in fp32, rounded once to floatX.
#pragma once

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

// direction = +1 rotates by +angle (forward), -1 by -angle (backward).
__global__ void rope_kernel(floatX* qkv, const float* freqs_cos_sin, int T, int n_rot_heads, int n_all_heads,
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
    float x0 = to_float(v.x), x1 = to_float(v.y);
    v.x = from_float<floatX>(x0 * c - x1 * s);
    v.y = from_float<floatX>(x0 * s + x1 * c);
    *p = v;
}

inline void rope_launch(floatX* qkv, const float* freqs_cos_sin, int B, int T, int n_heads, int n_kv_heads,
                        int head_dim, float direction, cudaStream_t stream) {
    if (head_dim % 2 != 0) {
        fprintf(stderr, "Error: RoPE needs an even head_dim, got %d\n", head_dim);
        fail_exit();
    }
    size_t total_pairs = (size_t)B * T * (n_heads + n_kv_heads) * (head_dim / 2);
    if (total_pairs == 0) return;
    const int block = 256;
    rope_kernel<<<(unsigned)ceil_div<size_t>(total_pairs, block), block, 0, stream>>>(
        qkv, freqs_cos_sin, T, n_heads + n_kv_heads, n_heads + 2 * n_kv_heads, head_dim, total_pairs, direction);
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
