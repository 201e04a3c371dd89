// Softmax + cross-entropy + its gradient, fused, in place on the logits, never materialising fp32 probabilities.
//
//   logits (N, V) floatX row-major, targets (N) int, losses (N) fp32.
//   p = softmax(logits[n, :]),  losses[n] = -log p[target] = log(sum_j exp(x_j - m)) + m - x_target  (m = row max)
//   if write_dlogits: logits[n, :] is overwritten by dlogits = (p - onehot(target)) * dloss
//   target < 0 marks an ignored position: loss 0 and (if written) dlogits 0. A target >= V is a caller bug: its loss
//   is NaN (so it cannot go unnoticed) and its dlogits are p * dloss; nothing is read out of bounds.
// dloss is the gradient of the final loss w.r.t. each per-position loss: for the trainer's mean over the targets
// that count, 1 / their number (every position of plain data; the unmasked ones with a loss mask).
//
// One block per row, two passes. Pass 1 keeps a running (max, sum of exp(x - max)) per thread ("online softmax"),
// merges them across the block, and reads the target logit first (pass 2 overwrites it). Pass 2 re-reads the row
// (partly from L2) and writes the gradient. Loads are 16 bytes wide, CLASSIFIER_BATCH of them issued per thread before
// any is used (one at a time, the loop left HBM a third idle). A row of odd V starts at any 2-byte boundary,
// so each row is split into a scalar head up to the first 16-byte boundary, an aligned vector body, and a scalar
// tail (head + tail < 2 * 16 bytes).
#pragma once

#include <cfloat>
#include <cstdint>

#include "cuda_common.h"

constexpr int CLASSIFIER_BLOCK = 1024;
constexpr int CLASSIFIER_BATCH = 4;  // 16-byte loads each thread issues before using any of them

// Folds (m2, s2) into (m, s): both are (max, sum of exp(x - max)) over disjoint sets. Starting values
// (-FLT_MAX, 0) are neutral: exp(-FLT_MAX - M) underflows to 0 instead of producing inf - inf.
__device__ __forceinline__ void classifier_merge(float& m, float& s, float m2, float s2) {
    float M = fmaxf(m, m2);
    s = s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
}

__device__ __forceinline__ void classifier_online(float& m, float& s, float v) {
    if (v > m) {
        s = s * expf(m - v) + 1.0f;
        m = v;
    } else {
        s += expf(v - m);  // a NaN logit lands here and makes s (and the loss) NaN, as it should
    }
}

// Issues a thread's CLASSIFIER_BATCH 16-byte loads of a row's vector body, packs k0, k0 + blockDim.x, ... (those
// below n_vec), before any is used.
__device__ __forceinline__ void classifier_load_batch(int4 (&raw)[CLASSIFIER_BATCH], const int4* body, int k0,
                                                      int n_vec) {
    for (int u = 0; u < CLASSIFIER_BATCH; u++) {
        int k = k0 + u * blockDim.x;
        if (k < n_vec) raw[u] = body[k];
    }
}

// The row split: elements [0, head) and [tail, V) are scalar, [head, tail) is n_vec aligned vectors.
struct ClassifierRowSplit {
    int head, n_vec, tail;
    __device__ ClassifierRowSplit(const floatX* row, int V) {
        int misalign = (int)((uintptr_t)row & 15);
        head = misalign == 0 ? 0 : (16 - misalign) / (int)sizeof(floatX);
        if (head > V) head = V;
        n_vec = (V - head) / VEC16;
        tail = head + n_vec * VEC16;
    }
    // k-th scalar element's index in the row
    __device__ int scalar_index(int k) const { return k < head ? k : tail + (k - head); }
};

__global__ void __launch_bounds__(CLASSIFIER_BLOCK)
    fused_classifier_kernel(floatX* logits, float* losses, float dloss, const int* targets, int V, bool write_dlogits) {
    __shared__ float shared_m[32], shared_s[32];
    int row = blockIdx.x;
    floatX* x = logits + (size_t)row * V;
    int target = targets[row];
    bool ignored = target < 0;
    bool valid = !ignored && target < V;
    // read before pass 2 overwrites it; the syncs in the reduction below order this read before any write
    float x_target = (threadIdx.x == 0 && valid) ? to_float(x[target]) : 0.0f;

    ClassifierRowSplit split(x, V);
    int n_scalar = split.head + (V - split.tail);

    // pass 1: per-thread online (max, sum)
    float m = -FLT_MAX, s = 0.0f;
    for (int k = threadIdx.x; k < n_scalar; k += blockDim.x) classifier_online(m, s, to_float(x[split.scalar_index(k)]));
    const int4* body = reinterpret_cast<const int4*>(x + split.head);
    for (int k0 = threadIdx.x; k0 < split.n_vec; k0 += CLASSIFIER_BATCH * blockDim.x) {
        int4 raw[CLASSIFIER_BATCH];
        classifier_load_batch(raw, body, k0, split.n_vec);
        for (int u = 0; u < CLASSIFIER_BATCH; u++) {
            if (k0 + u * blockDim.x >= split.n_vec) break;
            const floatX* v = reinterpret_cast<const floatX*>(&raw[u]);
            for (int j = 0; j < VEC16; j++) classifier_online(m, s, to_float(v[j]));
        }
    }
    // merge: warp by shuffles, then the warps' results through shared memory (fixed tree: deterministic)
    for (int offset = 16; offset > 0; offset >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, offset);
        float s2 = __shfl_xor_sync(0xffffffff, s, offset);
        classifier_merge(m, s, m2, s2);
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    if (lane == 0) { shared_m[warp] = m; shared_s[warp] = s; }
    __syncthreads();
    m = lane < n_warps ? shared_m[lane] : -FLT_MAX;
    s = lane < n_warps ? shared_s[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffff, m, offset);
        float s2 = __shfl_xor_sync(0xffffffff, s, offset);
        classifier_merge(m, s, m2, s2);
    }
    // every thread now holds the row's (m, s), identical bit for bit (each warp ran the same tree on the same data)

    if (threadIdx.x == 0) losses[row] = ignored ? 0.0f : valid ? logf(s) + m - x_target : __int_as_float(0x7fc00000);
    if (!write_dlogits) return;

    // pass 2: dlogits in place
    float inv_s = 1.0f / s;
    float scale = ignored ? 0.0f : dloss;
    for (int k = threadIdx.x; k < n_scalar; k += blockDim.x) {
        int i = split.scalar_index(k);
        float p = expf(to_float(x[i]) - m) * inv_s;
        x[i] = from_float<floatX>((p - (i == target ? 1.0f : 0.0f)) * scale);
    }
    int4* body_out = reinterpret_cast<int4*>(x + split.head);
    for (int k0 = threadIdx.x; k0 < split.n_vec; k0 += CLASSIFIER_BATCH * blockDim.x) {
        int4 raw[CLASSIFIER_BATCH];
        classifier_load_batch(raw, body_out, k0, split.n_vec);
        for (int u = 0; u < CLASSIFIER_BATCH; u++) {
            int k = k0 + u * blockDim.x;
            if (k >= split.n_vec) break;
            floatX* v = reinterpret_cast<floatX*>(&raw[u]);
            int i0 = split.head + k * VEC16;
            for (int j = 0; j < VEC16; j++) {
                float p = expf(to_float(v[j]) - m) * inv_s;
                v[j] = from_float<floatX>((p - (i0 + j == target ? 1.0f : 0.0f)) * scale);
            }
            body_out[k] = raw[u];
        }
    }
}

// losses (N) overwritten; logits (N, V) overwritten in place by dlogits when write_dlogits (else left unchanged).
inline void fused_classifier(floatX* logits, float* losses, float dloss, const int* targets, int N, int V,
                             bool write_dlogits, cudaStream_t stream) {
    if (N <= 0) return;
    if (V <= 0) {
        fprintf(stderr, "Error: fused_classifier with V=%d\n", V);
        fail_exit();
    }
    fused_classifier_kernel<<<N, CLASSIFIER_BLOCK, 0, stream>>>(logits, losses, dloss, targets, V, write_dlogits);
    cudaCheckLaunch();
}
