// Matmuls of the linear layers through cuBLASLt: floatX inputs and outputs, fp32 accumulation.
//
// Layouts (all row-major, as PyTorch stores them):
//   inp    (N, C)    activations, N = B*T tokens
//   weight (OC, C)   nn.Linear weight
//   out    (N, OC)
// Math:
//   forward   out     = inp @ weight^T          (overwrite)
//   backward  dinp    = dout @ weight           (overwrite)
//             dweight += dout^T @ inp            (accumulate, beta = 1: gradient accumulation over micro-steps)
//
// cuBLASLt is column-major. A row-major (R, K) matrix is the same bytes as a column-major (K, R) matrix with leading
// dimension K, i.e. its transpose. So every row-major product X = Y @ Z is issued as the column-major X^T = Z^T Y^T,
// and the three products become (m, n, k = column-major D rows, D cols, reduction):
//   out^T  (OC, N) = W   [col-major (C, OC), op T]  @ inp^T  [col-major (C, N),  op N]   m=OC n=N  k=C
//   dinp^T (C, N)  = W^T [col-major (C, OC), op N]  @ dout^T [col-major (OC, N), op N]   m=C  n=N  k=OC
//   dW^T   (C, OC) = inp^T [col-major (C, N), op N] @ dout   [col-major (OC, N), op T]   m=C  n=OC k=N
//
// Precision: the fp32 build uses CUBLAS_COMPUTE_32F on fp32 data, which never uses TF32 (that would need
// CUBLAS_COMPUTE_32F_FAST_TF32), so it ties out with PyTorch run with TF32 off. The bf16 build uses the same
// compute type on bf16 A/B/C/D: bf16 tensor-core products summed in fp32, one rounding to bf16 at the end (split-K
// partial sums are restricted to fp32 too, see the reduction mask below). For dweight (beta = 1) the old bf16 value
// is read, added in fp32, and the sum rounded once.
//
// Alignment: cuBLASLt's heuristic assumes 256-byte-aligned pointers unless told otherwise, and an algorithm picked
// under that assumption may fault or misread on a less aligned pointer (e.g. a view into the middle of a buffer).
// So every call tells the heuristic the real alignment of each pointer. Odd leading dimensions (OC = 259) are
// described by the layouts and the heuristic only returns algorithms that handle them.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "cuda_common.h"
#include "hash.h"

inline void cublas_check(cublasStatus_t status, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuBLASLt error: status %d %s (%s) [%s:%d]\n", (int)status, cublasLtGetStatusName(status),
                cublasLtGetStatusString(status), file, line);
        fail_exit();
    }
}
#define cublasCheck(status) cublas_check((status), __FILE__, __LINE__)

constexpr size_t MATMUL_WORKSPACE_BYTES = 32ull << 20;  // 32 MiB: enough for the split-K algorithms on Hopper

#if defined(ENABLE_FP32)
constexpr cudaDataType_t MATMUL_DATA_TYPE = CUDA_R_32F;
#else
constexpr cudaDataType_t MATMUL_DATA_TYPE = CUDA_R_16BF;
#endif

// Process-wide state, llm.c-style: one handle and one workspace (C++17 inline variables: one copy per program).
// Matmuls on different streams must not run concurrently, since they share the workspace.
inline cublasLtHandle_t g_cublaslt_handle = nullptr;
inline void* g_cublaslt_workspace = nullptr;

// The algorithm for one problem (shape, transposes, pointer alignments), chosen once and then reused: asking the
// heuristic costs tens of microseconds of CPU per call, which small matmuls cannot hide, and a fixed algorithm per
// shape keeps results bit-identical from step to step.
//
// Choosing: the heuristic's first answer is not always the fastest (on an H200 other candidates it offers run some
// of the Llama 3.2 1B products 3-9% faster; dev/cuda/matmul.cu "algos"). So for the forward and dinp products (which
// overwrite D, beta = 0), the first call times up to MATMUL_CANDIDATES answers on its own operands and keeps the
// fastest among those that compute every output element exactly as the first answer does, so that runs stay
// bit-reproducible whichever candidate wins the timing. A candidate qualifies when
//   * it is the same kernel (algorithm id) as the first answer and neither splits the reduction (split-K 1);
//     candidates then differ in tile, stages, custom option and cluster shape, and
//   * its output on this call is bit-identical to the first answer's (an order-independent 64-bit hash of D), on
//     an output of at least MATMUL_MIN_TIMED elements: a kernel that sums in another order then differs somewhere
//     with near certainty. On small outputs bf16 rounding can hide a different order (a split-K candidate passed
//     the hash on a test model's 128-row products and diverged later), and small products are not worth timing.
// The qualified candidates are timed in turns, MATMUL_TIMING_ROUNDS runs each, and the fastest run of each decides:
// three runs of one candidate after another had let a passing slowdown at the first step (clocks still settling,
// other work on the GPU) choose other tiles from run to run (traced on 2 H200s: a one-GPU run and each rank of a
// 2-GPU run chose differently, about 0.9 ms a step apart). The 1B step on one H200, three runs each alternated:
// 217.40 / 217.82 / 217.44 ms before, 216.39 / 217.14 / 216.78 after; 2 GPUs `-Z 1` 225.17 ms before, 224.87 after
// (means).
// dweight keeps the first answer: its product accumulates into D (beta = 1), or overwrites D on a step's first
// micro-batch (beta = 0), with one algorithm for both, and timing the accumulating call would need a copy of D. Timing
// the overwriting call instead was tried: a 1B step no faster (H100, 236.5 / 236.7 / 239.9 ms against 236.8 / 236.4 /
// 237.6 ms untimed).
// dev/cuda/matmul.cu "algos" lists, per 1B product, each candidate's configuration, whether its output is
// bit-identical to the first answer's, and its speed. Its "search" goes through every configuration of the first
// answer's kernel: some run 8-39% faster alone, but with them the 1B step was no faster, since a training step keeps
// an H100 at its power cap (the numbers are in that file).
constexpr int MATMUL_CANDIDATES = 8;
constexpr size_t MATMUL_MIN_TIMED = 1 << 20;
constexpr int MATMUL_TIMING_ROUNDS = 5;

struct MatmulKey {
    int m, n, k;
    bool trans_a, trans_b;
    uint32_t align_a, align_b, align_d;
    bool operator==(const MatmulKey& o) const {
        return m == o.m && n == o.n && k == o.k && trans_a == o.trans_a && trans_b == o.trans_b &&
               align_a == o.align_a && align_b == o.align_b && align_d == o.align_d;
    }
};
inline std::vector<std::pair<MatmulKey, cublasLtMatmulAlgo_t>> g_matmul_algos;
inline unsigned long long* g_matmul_hash = nullptr;  // device scratch for matmul_output_hash

inline void matmul_init(cudaStream_t stream) {
    if (g_cublaslt_handle != nullptr) return;
    cublasCheck(cublasLtCreate(&g_cublaslt_handle));
    // Stream-ordered allocation, then a sync so the workspace is usable from any stream afterwards.
    cudaCheck(cudaMallocAsync(&g_cublaslt_workspace, MATMUL_WORKSPACE_BYTES, stream));
    cudaCheck(cudaMallocAsync(&g_matmul_hash, sizeof(unsigned long long), stream));
    cudaCheck(cudaStreamSynchronize(stream));
}

inline void matmul_destroy() {
    if (g_cublaslt_handle == nullptr) return;
    cudaCheck(cudaDeviceSynchronize());  // no matmul may still be using the workspace
    cudaCheck(cudaFree(g_cublaslt_workspace));
    cudaCheck(cudaFree(g_matmul_hash));
    cublasCheck(cublasLtDestroy(g_cublaslt_handle));
    g_cublaslt_workspace = nullptr;
    g_matmul_hash = nullptr;
    g_cublaslt_handle = nullptr;
    g_matmul_algos.clear();
}

// Largest power of two (at most 256) dividing the address: what the heuristic may assume about the pointer.
inline uint32_t matmul_pointer_alignment(const void* p) {
    uintptr_t addr = (uintptr_t)p;
    uint32_t align = 1;
    while (align < 256 && (addr & (2 * align - 1)) == 0) align *= 2;
    return align;
}

// hash += sum_i (bits(d_i) + 1) * odd(i) mod 2^64, odd(i) a scrambled odd number per index: integer addition, so the
// result does not depend on the order of the atomics, and a changed element changes it (odd factors are invertible
// modulo 2^64).
__global__ void matmul_hash_kernel(const floatX* d, size_t count, unsigned long long* hash) {
    unsigned long long sum = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        unsigned long long bits;
        if constexpr (sizeof(floatX) == 2) bits = *reinterpret_cast<const unsigned short*>(d + i);
        else bits = *reinterpret_cast<const unsigned int*>(d + i);
        sum += (bits + 1) * (splitmix64(i * GOLDEN_RATIO_64) | 1ull);
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    if (threadIdx.x % 32 == 0) atomicAdd(hash, sum);
}

inline unsigned long long matmul_output_hash(const floatX* d, size_t count, cudaStream_t stream) {
    cudaCheck(cudaMemsetAsync(g_matmul_hash, 0, sizeof(unsigned long long), stream));
    matmul_hash_kernel<<<1024, 256, 0, stream>>>(d, count, g_matmul_hash);
    cudaCheckLaunch();
    unsigned long long hash;
    cudaCheck(cudaMemcpyAsync(&hash, g_matmul_hash, sizeof(hash), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    return hash;
}

// One configuration attribute of an algorithm (they are 2- or 4-byte integers), widened.
inline uint64_t matmul_algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
    size_t size = 0;
    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &size));
    uint64_t value = 0;
    if (size > sizeof(value)) {
        fprintf(stderr, "matmul: algorithm attribute %d has %zu bytes\n", (int)attr, size);
        fail_exit();
    }
    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, size, &size));
    return value;
}

// Whether two algorithms are the same kernel (algorithm id) and neither splits the reduction.
inline bool matmul_same_kernel_unsplit(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
    return matmul_algo_config(a, CUBLASLT_ALGO_CONFIG_ID) == matmul_algo_config(b, CUBLASLT_ALGO_CONFIG_ID) &&
           matmul_algo_config(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1 &&
           matmul_algo_config(b, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1;
}

// Chooses the algorithm for `key` (see above) the first time, looks it up afterwards. run(algo) issues the product
// with that algorithm on `stream`; d: its output (m x n), used for the hash; may_time: whether runs may be repeated
// (beta = 0).
template <typename Run>
inline cublasLtMatmulAlgo_t matmul_algo(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t layout_a,
                                        cublasLtMatrixLayout_t layout_b, cublasLtMatrixLayout_t layout_d,
                                        const MatmulKey& key, bool may_time, const floatX* d, Run run,
                                        cudaStream_t stream) {
    for (const auto& entry : g_matmul_algos) {
        if (entry.first == key) return entry.second;
    }
    int m = key.m, n = key.n, k = key.k;
    bool trans_a = key.trans_a, trans_b = key.trans_b;
    uint32_t align_a = key.align_a, align_b = key.align_b, align_d = key.align_d;
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t workspace = MATMUL_WORKSPACE_BYTES;
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                     sizeof(workspace)));
    // Split-K partial sums only in fp32 (the compute type): INPLACE and OUTPUT_TYPE reductions would add the parts in
    // the output type, i.e. in bf16 in the bf16 build. Unsplit algorithms (scheme NONE) are always allowed.
    uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction_mask,
                                                     sizeof(reduction_mask)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                     sizeof(align_a)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                     sizeof(align_b)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d,
                                                     sizeof(align_d)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                                     sizeof(align_d)));

    cublasLtMatmulHeuristicResult_t candidates[MATMUL_CANDIDATES] = {};
    int n_found = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(g_cublaslt_handle, desc, layout_a, layout_b, layout_d,
                                                            layout_d, pref, may_time ? MATMUL_CANDIDATES : 1,
                                                            candidates, &n_found);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && n_found == 0)) {
        fprintf(stderr,
                "matmul: cuBLASLt has no algorithm for m=%d n=%d k=%d trans_a=%d trans_b=%d (%s), pointer "
                "alignments A=%u B=%u D=%u bytes\n",
                m, n, k, (int)trans_a, (int)trans_b, PRECISION_NAME, align_a, align_b, align_d);
        fail_exit();
    }
    cublasCheck(status);
    cublasCheck(candidates[0].state);
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));

    int chosen = 0;
    const size_t count = (size_t)m * n;
    if (may_time && n_found > 1 && count >= MATMUL_MIN_TIMED) {
        run(candidates[0].algo);
        const unsigned long long reference = matmul_output_hash(d, count, stream);
        std::vector<int> qualified = {0};
        for (int i = 1; i < n_found; i++) {
            if (candidates[i].state != CUBLAS_STATUS_SUCCESS) continue;
            if (!matmul_same_kernel_unsplit(candidates[i].algo, candidates[0].algo)) continue;
            run(candidates[i].algo);  // warm-up, and the output to compare
            if (matmul_output_hash(d, count, stream) == reference) qualified.push_back(i);
        }
        cudaEvent_t start, stop;
        cudaCheck(cudaEventCreate(&start));
        cudaCheck(cudaEventCreate(&stop));
        std::vector<float> fastest(qualified.size(), 0.0f);
        for (int round = 0; round < MATMUL_TIMING_ROUNDS; round++) {
            for (size_t j = 0; j < qualified.size(); j++) {
                cudaCheck(cudaEventRecord(start, stream));
                run(candidates[qualified[j]].algo);
                cudaCheck(cudaEventRecord(stop, stream));
                cudaCheck(cudaEventSynchronize(stop));
                float ms;
                cudaCheck(cudaEventElapsedTime(&ms, start, stop));
                if (round == 0 || ms < fastest[j]) fastest[j] = ms;
            }
        }
        size_t best = 0;
        for (size_t j = 1; j < qualified.size(); j++) {
            if (fastest[j] < fastest[best]) best = j;
        }
        chosen = qualified[best];
        cudaCheck(cudaEventDestroy(start));
        cudaCheck(cudaEventDestroy(stop));
    }
    g_matmul_algos.push_back({key, candidates[chosen].algo});
    return g_matmul_algos.back().second;
}

// D (m, n) = alpha * op(A) @ op(B) + beta * C, all column-major, with C = D (in place). `a_rows`/`b_rows` are the
// stored (column-major) row counts of A and B, which are also their leading dimensions (tightly packed). may_time:
// the first call of a problem may time candidates (matmul_algo; only where beta = 0).
inline void matmul_cublaslt(floatX* d, const floatX* a, const floatX* b, int m, int n, int k, bool trans_a,
                            bool trans_b, float beta, bool may_time, cudaStream_t stream) {
    if (g_cublaslt_handle == nullptr) {
        fprintf(stderr, "matmul: call matmul_init() first\n");
        fail_exit();
    }
    if (m <= 0 || n <= 0 || k <= 0) {
        fprintf(stderr, "matmul: dimensions must be positive, got m=%d n=%d k=%d\n", m, n, k);
        fail_exit();
    }
    cublasLtMatmulDesc_t desc;
    cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));

    // Stored shapes: op(A) is (m, k), so A is (k, m) when transposed; op(B) is (k, n), so B is (n, k) when transposed.
    int a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
    int b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
    cublasLtMatrixLayout_t layout_a, layout_b, layout_d;
    cublasCheck(cublasLtMatrixLayoutCreate(&layout_a, MATMUL_DATA_TYPE, a_rows, a_cols, a_rows));
    cublasCheck(cublasLtMatrixLayoutCreate(&layout_b, MATMUL_DATA_TYPE, b_rows, b_cols, b_rows));
    cublasCheck(cublasLtMatrixLayoutCreate(&layout_d, MATMUL_DATA_TYPE, m, n, m));

    uint32_t align_a = matmul_pointer_alignment(a), align_b = matmul_pointer_alignment(b);
    uint32_t align_d = matmul_pointer_alignment(d);
    const float alpha = 1.0f;
    auto run = [&](const cublasLtMatmulAlgo_t& algo) {
        cublasCheck(cublasLtMatmul(g_cublaslt_handle, desc, &alpha, a, layout_a, b, layout_b, &beta, d, layout_d, d,
                                   layout_d, &algo, g_cublaslt_workspace, MATMUL_WORKSPACE_BYTES, stream));
    };
    const MatmulKey key = {m, n, k, trans_a, trans_b, align_a, align_b, align_d};
    run(matmul_algo(desc, layout_a, layout_b, layout_d, key, may_time && beta == 0.0f, d, run, stream));

    cublasCheck(cublasLtMatrixLayoutDestroy(layout_a));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_b));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_d));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
}

// out (N, OC) = inp (N, C) @ weight (OC, C)^T. Overwrites out.
inline void matmul_forward(floatX* out, const floatX* inp, const floatX* weight, int N, int C, int OC,
                           cudaStream_t stream) {
    matmul_cublaslt(out, weight, inp, OC, N, C, /*trans_a=*/true, /*trans_b=*/false, /*beta=*/0.0f, /*may_time=*/true,
                    stream);
}

// dinp (N, C) = dout (N, OC) @ weight (OC, C)         OVERWRITES dinp    (skipped when dinp == nullptr)
// dweight (OC, C) += dout (N, OC)^T @ inp (N, C)      ACCUMULATES        (skipped when dweight == nullptr)
//                                                     or overwrites, with accumulate = false (beta = 0: D is not read)
inline void matmul_backward(floatX* dinp, floatX* dweight, const floatX* dout, const floatX* inp,
                            const floatX* weight, int N, int C, int OC, bool accumulate, cudaStream_t stream) {
    if (dinp != nullptr) {
        matmul_cublaslt(dinp, weight, dout, C, N, OC, /*trans_a=*/false, /*trans_b=*/false, /*beta=*/0.0f,
                        /*may_time=*/true, stream);
    }
    if (dweight != nullptr) {
        matmul_cublaslt(dweight, inp, dout, C, OC, N, /*trans_a=*/false, /*trans_b=*/true, accumulate ? 1.0f : 0.0f,
                        /*may_time=*/false, stream);
    }
}
