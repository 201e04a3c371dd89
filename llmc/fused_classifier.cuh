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
// One 1024-thread block per row, two kernels for the same math:
//   * on chip (rows that fit: V a multiple of 16 bytes and the row within the registers plus the shared memory one
//     block may have; Llama 3's 128256 in bf16 does): the row is read from HBM once. Each thread keeps its first
//     CLASSIFIER_REG_VECS 16-byte vectors in registers and copies the rest to shared memory (cp.async), reading back
//     only what it copied itself, so no barrier guards them. It takes its max, then its sum of exp(x - max), and
//     writes the dlogits from the values on chip. One block fits per SM; blocks in different phases keep HBM busy.
//   * two passes (every other row: odd V, the fp32 build's 513 KB rows): pass 1 keeps a running (max, sum of
//     exp(x - max)) per thread ("online softmax"), pass 2 re-reads the row (partly from L2) and writes the gradient.
//     Loads are 16 bytes wide, CLASSIFIER_BATCH of them issued per thread before any is used (one at a time, the loop
//     left HBM a third idle). A row of odd V starts at any 2-byte boundary, so each row is split into a scalar head
//     up to the first 16-byte boundary, an aligned vector body, and a scalar tail (head + tail < 2 * 16 bytes).
// Both merge the threads' (max, sum) in the same fixed tree, so every thread gets the same bits (deterministic). Both
// read the target logit before anything is written (the merge's barrier orders the read before the writes).
// dev/cuda/fused_classifier.cu has the timings (H100, 2048 rows of 128256: 0.484 ms two passes, 0.372 ms on chip).
#pragma once

#include <cfloat>
#include <cstdint>

#include "cuda_common.h"
#include "ptx.cuh"

constexpr int CLASSIFIER_BLOCK = 1024;
constexpr int CLASSIFIER_BATCH = 4;     // two passes: 16-byte loads each thread issues before using any of them
constexpr int CLASSIFIER_REG_VECS = 4;  // on chip: 16-byte vectors per thread in registers (6 was slower, 8 spill)

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

// Merges every thread's (m, s) into the row's: within each warp by shuffles, then the warps' results through shared
// memory. A fixed tree, run by every warp on the same data, so every thread ends with the same bits.
__device__ __forceinline__ void classifier_block_merge(float& m, float& s) {
    __shared__ float shared_m[32], shared_s[32];
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
}

// The row's loss (thread 0 writes it): 0 when ignored, NaN for a target out of range.
__device__ __forceinline__ float classifier_loss(bool ignored, bool valid, float m, float s, float x_target) {
    return ignored ? 0.0f : valid ? logf(s) + m - x_target : __int_as_float(0x7fc00000);
}

// dlogit of element i with value x: (p - onehot) * scale, scale = dloss, or 0 for an ignored row.
__device__ __forceinline__ floatX classifier_dlogit(float x, int i, float m, float inv_s, int target, float scale) {
    float p = expf(x - m) * inv_s;
    return from_float<floatX>((p - (i == target ? 1.0f : 0.0f)) * scale);
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
    classifier_two_pass_kernel(floatX* logits, float* losses, float dloss, const int* targets, int V,
                               bool write_dlogits) {
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
    for (int k = threadIdx.x; k < n_scalar; k += blockDim.x) {
        classifier_online(m, s, to_float(x[split.scalar_index(k)]));
    }
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
    classifier_block_merge(m, s);
    if (threadIdx.x == 0) losses[row] = classifier_loss(ignored, valid, m, s, x_target);
    if (!write_dlogits) return;

    // pass 2: dlogits in place
    float inv_s = 1.0f / s;
    float scale = ignored ? 0.0f : dloss;
    for (int k = threadIdx.x; k < n_scalar; k += blockDim.x) {
        int i = split.scalar_index(k);
        x[i] = classifier_dlogit(to_float(x[i]), i, m, inv_s, target, scale);
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
            for (int j = 0; j < VEC16; j++) v[j] = classifier_dlogit(to_float(v[j]), i0 + j, m, inv_s, target, scale);
            body_out[k] = raw[u];
        }
    }
}

// The on-chip kernel (see the top). Thread k % blockDim.x holds the row's 16-byte vector k: in register slot
// k / blockDim.x while k < CLASSIFIER_REG_VECS * blockDim.x, after that at held[k - CLASSIFIER_REG_VECS * blockDim.x].
__global__ void __launch_bounds__(CLASSIFIER_BLOCK, 1)
    classifier_on_chip_kernel(floatX* logits, float* losses, float dloss, const int* targets, int V,
                              bool write_dlogits) {
    extern __shared__ int4 held[];
    const int row = blockIdx.x, t = threadIdx.x, n_vec = V / VEC16;
    const int in_registers = CLASSIFIER_REG_VECS * CLASSIFIER_BLOCK;
    floatX* x = logits + (size_t)row * V;
    int4* body = reinterpret_cast<int4*>(x);
    int target = targets[row];
    bool ignored = target < 0;
    bool valid = !ignored && target < V;
    float x_target = (t == 0 && valid) ? to_float(x[target]) : 0.0f;

    for (int k = in_registers + t; k < n_vec; k += CLASSIFIER_BLOCK) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        cp_async_16(smem_addr(&held[k - in_registers]), body + k, 16);
#else
        held[k - in_registers] = body[k];
#endif
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    cp_async_commit();
#endif
    int4 reg[CLASSIFIER_REG_VECS];
#pragma unroll
    for (int u = 0; u < CLASSIFIER_REG_VECS; u++) {
        int k = t + u * CLASSIFIER_BLOCK;
        if (k < n_vec) reg[u] = body[k];
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    cp_async_wait<0>();
#endif
    // f(16-byte vector, its index) over this thread's vectors
    auto each_vector = [&](auto&& f) {
#pragma unroll
        for (int u = 0; u < CLASSIFIER_REG_VECS; u++) {
            int k = t + u * CLASSIFIER_BLOCK;
            if (k < n_vec) f(reg[u], k);
        }
        for (int k = in_registers + t; k < n_vec; k += CLASSIFIER_BLOCK) f(held[k - in_registers], k);
    };

    float m = -FLT_MAX, s = 0.0f;
    each_vector([&](int4 raw, int) {
        const floatX* v = reinterpret_cast<const floatX*>(&raw);
        for (int j = 0; j < VEC16; j++) m = fmaxf(m, to_float(v[j]));
    });
    each_vector([&](int4 raw, int) {
        const floatX* v = reinterpret_cast<const floatX*>(&raw);
        for (int j = 0; j < VEC16; j++) s += expf(to_float(v[j]) - m);  // a NaN logit makes s NaN, as it should
    });
    classifier_block_merge(m, s);
    if (t == 0) losses[row] = classifier_loss(ignored, valid, m, s, x_target);
    if (!write_dlogits) return;

    float inv_s = 1.0f / s, scale = ignored ? 0.0f : dloss;
    each_vector([&](int4 raw, int k) {
        floatX* v = reinterpret_cast<floatX*>(&raw);
        for (int j = 0; j < VEC16; j++) {
            v[j] = classifier_dlogit(to_float(v[j]), k * VEC16 + j, m, inv_s, target, scale);
        }
        body[k] = raw;
    });
}

// Whether rows of V elements fit the on-chip kernel, and the dynamic shared memory it then needs. Rows must start
// 16-byte aligned: V a multiple of VEC16 (and the logits aligned, which the caller checks).
inline bool classifier_on_chip_fits(int V, size_t* smem_bytes) {
    static int smem_limit = -1;  // the opt-in maximum of shared memory per block, on the current device
    if (smem_limit < 0) {
        int device;
        cudaCheck(cudaGetDevice(&device));
        cudaCheck(cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    }
    if (V % VEC16 != 0) return false;
    size_t vectors = (size_t)(V / VEC16), in_registers = (size_t)CLASSIFIER_REG_VECS * CLASSIFIER_BLOCK;
    *smem_bytes = vectors > in_registers ? (vectors - in_registers) * sizeof(int4) : 0;
    return *smem_bytes + 1024 <= (size_t)smem_limit;  // 1 KB left for the merge's static arrays
}

// losses (N) overwritten; logits (N, V) overwritten in place by dlogits when write_dlogits (else left unchanged).
inline void fused_classifier(floatX* logits, float* losses, float dloss, const int* targets, int N, int V,
                             bool write_dlogits, cudaStream_t stream) {
    if (N <= 0) return;
    if (V <= 0) {
        fprintf(stderr, "Error: fused_classifier with V=%d\n", V);
        fail_exit();
    }
    size_t smem = 0;
    if (classifier_on_chip_fits(V, &smem) && ((uintptr_t)logits & 15) == 0) {
        static size_t smem_set = 0;  // the largest dynamic shared memory the kernel was allowed so far
        if (smem > smem_set) {
            cudaCheck(cudaFuncSetAttribute(classifier_on_chip_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem));
            smem_set = smem;
        }
        classifier_on_chip_kernel<<<N, CLASSIFIER_BLOCK, smem, stream>>>(logits, losses, dloss, targets, V,
                                                                          write_dlogits);
    } else {
        classifier_two_pass_kernel<<<N, CLASSIFIER_BLOCK, 0, stream>>>(logits, losses, dloss, targets, V,
                                                                        write_dlogits);
    }
    cudaCheckLaunch();
}
