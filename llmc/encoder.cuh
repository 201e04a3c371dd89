// Token embedding: forward gathers rows of the embedding table, backward scatters the gradient back.
//
//   forward:  out[n, :] = embedding[tokens[n], :]                         out (N, C), embedding (V, C), tokens (N)
//   backward: d_embedding[v, :] += sum over n with tokens[n] == v of dout[n, :]      (accumulates; dout is (N, C))
//
// N = B*T rows, everything row-major. The backward is deterministic without float atomics: the host already has the
// tokens, so it counting-sorts the positions by token id (EmbeddingBackwardPlan) and uploads that plan; the kernel
// then gives each distinct token one column-slice per thread, summing its positions (ascending n, four interleaved
// fp32 running sums combined in a fixed order) and adding the total to the gradient once. Each gradient element is
// owned by exactly one thread, so there are no races, and the order of every sum is fixed by the tokens alone.
// Tokens must lie in [0, V): the forward does not check them (the plan build does, given vocab_size).
//
// Vectorisation: a thread moves 16 bytes (8 bf16 or 4 fp32) when C is a multiple of that and the base pointers are
// 16-byte aligned (then every row start is too); otherwise one element per thread (e.g. C = 100 in bf16, C = 50).
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_common.h"

inline bool encoder_aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

// ------------------------------------------------------------------------------------------------ forward

// One thread per VEC elements of the output. VEC is VEC16 (16-byte path) or 1 (scalar path).
template <int VEC>
__global__ void encoder_forward_kernel(floatX* out, const int* tokens, const floatX* embedding, int N, int C) {
    size_t idx = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (idx >= (size_t)N * C) return;
    int n = (int)(idx / C), c = (int)(idx % C);  // VEC divides C, so the VEC elements lie in one row
    const floatX* src = embedding + (size_t)tokens[n] * C + c;
    if constexpr (VEC == 1) {
        out[idx] = *src;
    } else {
        *reinterpret_cast<int4*>(out + idx) = *reinterpret_cast<const int4*>(src);
    }
}

inline void encoder_forward(floatX* out, const int* tokens, const floatX* embedding, int N, int C,
                            cudaStream_t stream) {
    if (N <= 0 || C <= 0) return;
    const int block = 256;
    bool vec = C % VEC16 == 0 && encoder_aligned16(out) && encoder_aligned16(embedding);
    if (vec) {
        size_t threads = (size_t)N * C / VEC16;
        encoder_forward_kernel<VEC16><<<(unsigned)ceil_div<size_t>(threads, block), block, 0, stream>>>(
            out, tokens, embedding, N, C);
    } else {
        size_t threads = (size_t)N * C;
        encoder_forward_kernel<1><<<(unsigned)ceil_div<size_t>(threads, block), block, 0, stream>>>(out, tokens,
                                                                                                      embedding, N, C);
    }
    cudaCheckLaunch();
}

// ------------------------------------------------------------------------------------------------ backward plan

// Stable counting sort of positions 0..n-1 by token (all in [0, max_token]): fills sorted[n], seg_tok[u],
// seg_beg[u + 1] as laid out below and returns u, the number of distinct tokens. counts is scratch. Host only.
inline int embedding_plan_sort(const int* tokens, int n, int max_token, std::vector<int>& counts, int* sorted,
                               int* seg_tok, int* seg_beg) {
    // counts[t + 1] = occurrences of t; the running prefix sum turns counts[t] into t's first slot
    counts.assign((size_t)max_token + 2, 0);
    for (int i = 0; i < n; i++) counts[tokens[i] + 1]++;
    int u = 0;
    for (int t = 0; t <= max_token; t++) {
        if (counts[t + 1] > 0) {
            seg_tok[u] = t;
            seg_beg[u] = counts[t];
            u++;
        }
        counts[t + 1] += counts[t];
    }
    seg_beg[u] = n;
    for (int i = 0; i < n; i++) sorted[counts[tokens[i]]++] = i;  // ascending i inside each group: stable
    return u;
}

// The positions grouped by token, built on the host and uploaded once per batch (the same plan serves every
// micro-step that reuses the batch). Device layout, one int buffer of 3*capacity + 1:
//   sorted_pos  [N]      positions n, grouped by token id, ascending n inside a group (a stable counting sort)
//   seg_token   [U]      the token of each group (U = number of distinct tokens in the batch, U <= N)
//   seg_start   [U + 1]  group u is sorted_pos[seg_start[u] .. seg_start[u+1])
// The upload goes through a pinned host buffer with cudaMemcpyAsync, so build() does not stall the GPU; before it
// rewrites the pinned buffer it waits for the previous upload (an event), never for kernels. Kernels that read the
// plan must run on the stream passed to build() (or be ordered after it), and a rebuild must be issued on the same
// stream as the encoder_backward calls that used the previous plan, so the copy cannot overtake them.
struct EmbeddingBackwardPlan {
    int capacity = 0;    // max N
    int vocab_size = 0;  // tokens are checked against it when > 0
    int N = 0;           // rows in the current plan
    int num_segments = 0;
    int* d_plan = nullptr;     // device: sorted_pos | seg_token | seg_start
    int* h_staging = nullptr;  // pinned host copy of the same layout
    cudaEvent_t uploaded = nullptr;
    std::vector<int> counts;  // host scratch for the counting sort, size max_token + 2

    EmbeddingBackwardPlan() = default;
    EmbeddingBackwardPlan(const EmbeddingBackwardPlan&) = delete;
    EmbeddingBackwardPlan& operator=(const EmbeddingBackwardPlan&) = delete;
    ~EmbeddingBackwardPlan() { release(); }

    void allocate(int max_rows, int vocab = 0) {
        release();
        capacity = max_rows;
        vocab_size = vocab;
        size_t ints = 3 * (size_t)max_rows + 1;
        cudaCheck(cudaMalloc(&d_plan, ints * sizeof(int)));
        cudaCheck(cudaMallocHost(&h_staging, ints * sizeof(int)));
        cudaCheck(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming));
        if (vocab > 0) counts.reserve((size_t)vocab + 1);
    }
    void release() {
        if (uploaded) { cudaEventSynchronize(uploaded); cudaEventDestroy(uploaded); }
        if (d_plan) cudaFree(d_plan);
        if (h_staging) cudaFreeHost(h_staging);
        d_plan = nullptr; h_staging = nullptr; uploaded = nullptr;
        capacity = 0; N = 0; num_segments = 0;
    }
    const int* sorted_pos() const { return d_plan; }
    const int* seg_token() const { return d_plan + capacity; }
    const int* seg_start() const { return d_plan + 2 * (size_t)capacity; }

    // Builds the plan for tokens_host[0..n) and enqueues its upload on `stream`.
    void build(const int* tokens_host, int n, cudaStream_t stream) {
        if (d_plan == nullptr || n < 0 || n > capacity) {
            fprintf(stderr, "Error: EmbeddingBackwardPlan::build with N=%d but capacity %d (allocate first)\n", n,
                    capacity);
            fail_exit();
        }
        int max_token = -1;
        for (int i = 0; i < n; i++) {
            int t = tokens_host[i];
            if (t < 0 || (vocab_size > 0 && t >= vocab_size)) {
                fprintf(stderr, "Error: token %d at position %d is negative or >= vocab_size %d\n", t, i, vocab_size);
                fail_exit();
            }
            max_token = t > max_token ? t : max_token;
        }
        cudaCheck(cudaEventSynchronize(uploaded));  // the previous upload has left h_staging
        int* sorted = h_staging;
        int* seg_tok = h_staging + capacity;
        int* seg_beg = h_staging + 2 * (size_t)capacity;
        int u = embedding_plan_sort(tokens_host, n, max_token, counts, sorted, seg_tok, seg_beg);
        N = n;
        num_segments = u;
        // three copies because the sections sit at capacity offsets; each only as long as its used part
        if (n > 0) {
            cudaCheck(cudaMemcpyAsync(d_plan, sorted, (size_t)n * sizeof(int), cudaMemcpyHostToDevice, stream));
            cudaCheck(cudaMemcpyAsync(d_plan + capacity, seg_tok, (size_t)u * sizeof(int), cudaMemcpyHostToDevice,
                                      stream));
        }
        cudaCheck(cudaMemcpyAsync(d_plan + 2 * (size_t)capacity, seg_beg, ((size_t)u + 1) * sizeof(int),
                                  cudaMemcpyHostToDevice, stream));
        cudaCheck(cudaEventRecord(uploaded, stream));
    }
};

// ------------------------------------------------------------------------------------------------ backward

// grid.x = distinct tokens (one group each), grid.y = column slices of blockDim.x * VEC. Each thread owns VEC
// columns of one token's gradient row: it sums dout over the group's positions in ascending order (fp32), then
// does one read-add-write of the gradient. Four independent loads are in flight per iteration to hide latency for
// frequent tokens; the partial sums are combined in a fixed order, so the result is still the same every run.
template <int VEC>
__global__ void encoder_backward_kernel(floatX* d_embedding, const floatX* dout, const int* sorted_pos,
                                        const int* seg_token, const int* seg_start, int C) {
    int c = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (c >= C) return;
    int seg = blockIdx.x;
    int begin = seg_start[seg], end = seg_start[seg + 1];
    float acc[4][VEC];
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < VEC; j++) acc[k][j] = 0.0f;
    auto load_add = [&](float* a, int n) {
        const floatX* src = dout + (size_t)n * C + c;
        if constexpr (VEC == 1) {
            a[0] += to_float(*src);
        } else {
            int4 raw = *reinterpret_cast<const int4*>(src);
            const floatX* x = reinterpret_cast<const floatX*>(&raw);
            for (int j = 0; j < VEC; j++) a[j] += to_float(x[j]);
        }
    };
    int i = begin;
    for (; i + 4 <= end; i += 4) {
        int n0 = sorted_pos[i], n1 = sorted_pos[i + 1], n2 = sorted_pos[i + 2], n3 = sorted_pos[i + 3];
        load_add(acc[0], n0);
        load_add(acc[1], n1);
        load_add(acc[2], n2);
        load_add(acc[3], n3);
    }
    for (; i < end; i++) load_add(acc[0], sorted_pos[i]);
    floatX* dst = d_embedding + (size_t)seg_token[seg] * C + c;
    if constexpr (VEC == 1) {
        dst[0] = from_float<floatX>(to_float(dst[0]) + ((acc[0][0] + acc[1][0]) + (acc[2][0] + acc[3][0])));
    } else {
        int4 raw = *reinterpret_cast<const int4*>(dst);
        floatX* g = reinterpret_cast<floatX*>(&raw);
        for (int j = 0; j < VEC; j++)
            g[j] = from_float<floatX>(to_float(g[j]) + ((acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j])));
        *reinterpret_cast<int4*>(dst) = raw;
    }
}

// d_embedding (V, C) += scatter of dout (plan.N, C) by the plan's tokens. Deterministic: bit-identical run to run.
inline void encoder_backward(floatX* d_embedding, const floatX* dout, const EmbeddingBackwardPlan& plan, int C,
                             cudaStream_t stream) {
    if (plan.num_segments == 0 || C <= 0) return;
    const int block = 128;
    bool vec = C % VEC16 == 0 && encoder_aligned16(d_embedding) && encoder_aligned16(dout);
    int per_thread = vec ? VEC16 : 1;
    dim3 grid(plan.num_segments, ceil_div(C, block * per_thread));
    if (vec) {
        encoder_backward_kernel<VEC16><<<grid, block, 0, stream>>>(d_embedding, dout, plan.sorted_pos(),
                                                                         plan.seg_token(), plan.seg_start(), C);
    } else {
        encoder_backward_kernel<1><<<grid, block, 0, stream>>>(d_embedding, dout, plan.sorted_pos(), plan.seg_token(),
                                                               plan.seg_start(), C);
    }
    cudaCheckLaunch();
}
