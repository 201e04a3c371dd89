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

// The heuristic's choice for one problem (shape, transposes, pointer alignments), asked once and then reused:
// asking costs tens of microseconds of CPU per call, which small matmuls cannot hide, and a fixed algorithm per
// shape also keeps results bit-identical from step to step.
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

inline void matmul_init(cudaStream_t stream) {
    if (g_cublaslt_handle != nullptr) return;
    cublasCheck(cublasLtCreate(&g_cublaslt_handle));
    // Stream-ordered allocation, then a sync so the workspace is usable from any stream afterwards.
    cudaCheck(cudaMallocAsync(&g_cublaslt_workspace, MATMUL_WORKSPACE_BYTES, stream));
    cudaCheck(cudaStreamSynchronize(stream));
}

inline void matmul_destroy() {
    if (g_cublaslt_handle == nullptr) return;
    cudaCheck(cudaDeviceSynchronize());  // no matmul may still be using the workspace
    cudaCheck(cudaFree(g_cublaslt_workspace));
    cublasCheck(cublasLtDestroy(g_cublaslt_handle));
    g_cublaslt_workspace = nullptr;
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


inline cublasLtMatmulAlgo_t matmul_algo(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t layout_a,
                                               cublasLtMatrixLayout_t layout_b, cublasLtMatrixLayout_t layout_d,
                                               const MatmulKey& key) {
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

    cublasLtMatmulHeuristicResult_t heuristic = {};
    int n_found = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(g_cublaslt_handle, desc, layout_a, layout_b, layout_d,
                                                            layout_d, pref, 1, &heuristic, &n_found);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && n_found == 0)) {
        fprintf(stderr,
                "matmul: cuBLASLt has no algorithm for m=%d n=%d k=%d trans_a=%d trans_b=%d (%s), pointer "
                "alignments A=%u B=%u D=%u bytes\n",
                m, n, k, (int)trans_a, (int)trans_b, PRECISION_NAME, align_a, align_b, align_d);
        fail_exit();
    }
    cublasCheck(status);
    cublasCheck(heuristic.state);

    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    g_matmul_algos.push_back({key, heuristic.algo});
    return g_matmul_algos.back().second;
}

// D (m, n) = alpha * op(A) @ op(B) + beta * C, all column-major, with C = D (in place). `a_rows`/`b_rows` are the
// stored (column-major) row counts of A and B, which are also their leading dimensions (tightly packed).
inline void matmul_cublaslt(floatX* d, const floatX* a, const floatX* b, int m, int n, int k, bool trans_a,
                            bool trans_b, float beta, cudaStream_t stream) {
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
    cublasLtMatmulAlgo_t algo = matmul_algo(desc, layout_a, layout_b, layout_d,
                                                   {m, n, k, trans_a, trans_b, align_a, align_b, align_d});
    const float alpha = 1.0f;
    cublasCheck(cublasLtMatmul(g_cublaslt_handle, desc, &alpha, a, layout_a, b, layout_b, &beta, d, layout_d, d,
                               layout_d, &algo, g_cublaslt_workspace, MATMUL_WORKSPACE_BYTES, stream));

    cublasCheck(cublasLtMatrixLayoutDestroy(layout_a));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_b));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_d));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
}

// out (N, OC) = inp (N, C) @ weight (OC, C)^T. Overwrites out.
inline void matmul_forward(floatX* out, const floatX* inp, const floatX* weight, int N, int C, int OC,
                           cudaStream_t stream) {
    matmul_cublaslt(out, weight, inp, OC, N, C, /*trans_a=*/true, /*trans_b=*/false, /*beta=*/0.0f, stream);
}

// dinp (N, C) = dout (N, OC) @ weight (OC, C)         OVERWRITES dinp    (skipped when dinp == nullptr)
// dweight (OC, C) += dout (N, OC)^T @ inp (N, C)      ACCUMULATES        (skipped when dweight == nullptr)
inline void matmul_backward(floatX* dinp, floatX* dweight, const floatX* dout, const floatX* inp,
                            const floatX* weight, int N, int C, int OC, cudaStream_t stream) {
    if (dinp != nullptr) {
        matmul_cublaslt(dinp, weight, dout, C, N, OC, /*trans_a=*/false, /*trans_b=*/false, /*beta=*/0.0f, stream);
    }
    if (dweight != nullptr) {
        matmul_cublaslt(dweight, inp, dout, C, OC, N, /*trans_a=*/false, /*trans_b=*/true, /*beta=*/1.0f, stream);
    }
}
