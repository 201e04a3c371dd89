// FP8 matmuls through cuBLASLt (Hopper, or Ada): FP8 operands, fp32 accumulation (of the tensor core's partial
// sums: see Accumulation below), floatX output.
//
//   D (M, N) = (A / s_a) (B / s_b)^T  [+ D with accumulate]       D row-major floatX, as llmc/matmul.cuh's
//   A (M, K), B (N, K): FP8 row-major (K-major: the reduction dimension contiguous), quantized by llmc/fp8.cuh with
//   scales s_a, s_b; the inverse scales 1 / s_a, 1 / s_b are device pointers (the casts write them).
//
// The trainer's three products of a linear layer (row-major inp (T, C), W (OC, C), dout (T, OC); T = tokens):
//   use       math              A                     B                    M    N    K    FP8 copies needed
//   forward   out  = inp W^T    inp    (T, C)  e4m3   W     (OC, C) e4m3   T    OC   C    inp, W as stored
//   dinp      dinp = dout W     dout   (T, OC) e5m2   W^T   (C, OC) e4m3   T    C    OC   W transposed
//   dweight   dW   = dout^T inp dout^T (OC, T) e5m2   inp^T (C, T)  e4m3   OC   C    T    dout, inp transposed
// So each layer needs W's e4m3 copy and its transpose (made once per step: the weights change only at the update),
// inp's copy and transpose, and dout's copy and transpose: fp8_cast_transpose writes a copy and its transpose in one
// pass. Gradients may be e4m3 too (any pair but e5m2 x e5m2).
//
// cuBLASLt facts this relies on (cuBLAS docs, cublasLtMatmul, the FP8 requirements; cublasLt.h):
//   * With FP8 inputs D = alpha * scale_A * scale_B * op(A) op(B) + beta * C for a bf16 / fp32 D (scale_C, scale_D
//     and the amax of D apply to FP8 outputs). The A / B scale pointers "convert data in matrix A to the compute
//     data type range" (cublasLt.h): they take the inverse scales 1 / s (as Transformer Engine passes scale_inv).
//   * On Hopper and Ada, A must be transposed and B not (the "TN" format), i.e. both operands K-major; compute
//     type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F; A and B not both e5m2.
//   * Pointers and leading dimensions 16-byte aligned: M, N, K must be multiples of 16 here. The scale pointers too
//     (seen on an H100, CUDA 13.0: a scale 4 or 8 bytes past a 16-byte boundary makes cublasLtMatmul return
//     CUBLAS_STATUS_NOT_SUPPORTED), so keep each inverse scale in its own allocation or 16 bytes apart.
//   * CUBLASLT_MATMUL_DESC_AMAX_D_POINTER is for FP8 outputs only (cuBLAS, as relayed in PyTorch PR #122821), so
//     amax_out is fp8_amax over D afterwards: one more read of D.
// Mapping: as in llmc/matmul.cuh, row-major D (M, N) is column-major D^T (N, M) = B A^T: cuBLASLt's A is our B
// (column-major (K, N), op T), its B is our A (column-major (K, M), op N); m = N, n = M, k = K.
//
// Accumulation: CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0 by default. Hopper's FP8 tensor cores add products in a window
// about 13 bits below the largest magnitude in play (dev/cuda/matmul_fp8.cu's probe; DeepSeek-V3 reports about 14
// bits); without fast accumulation cuBLASLt promotes the partial sums into fp32 periodically, with it the whole
// reduction stays in the tensor core. On the 1B's twelve products fast accumulation was no faster (H100: 4.92 ms in
// all either way) and far less exact on long sums of one sign (2^-3.7 relative error against 2^-10.4 at K = 4096),
// so it stays off. With accumulate, cuBLASLt rounds the product to floatX before adding the old D (seen on an H100:
// two roundings, where llmc/matmul.cuh's bf16 dweight has one). Split-K partial sums are restricted to fp32 as in
// llmc/matmul.cuh. The algorithm is chosen once per problem (the heuristic's first answer) and reused, so results
// are bit-identical from step to step.
#pragma once

#include <cuda_fp8.h>

#include <vector>

#include "fp8.cuh"
#include "matmul.cuh"

struct MatmulFp8Key {
    int m, n, k;
    cudaDataType_t type_a, type_b;
    bool fast_accum;
    uint32_t align_a, align_b, align_d;
    bool operator==(const MatmulFp8Key& o) const {
        return m == o.m && n == o.n && k == o.k && type_a == o.type_a && type_b == o.type_b &&
               fast_accum == o.fast_accum && align_a == o.align_a && align_b == o.align_b && align_d == o.align_d;
    }
};
inline std::vector<std::pair<MatmulFp8Key, cublasLtMatmulAlgo_t>> g_matmul_fp8_algos;

inline cudaDataType_t fp8_cuda_type(__nv_fp8_interpretation_t format) {
    return format == __NV_E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}

// The heuristic's first algorithm for `key` (cuBLASLt's operands), chosen the first time, looked up afterwards.
inline cublasLtMatmulAlgo_t matmul_fp8_algo(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t layout_a,
                                            cublasLtMatrixLayout_t layout_b, cublasLtMatrixLayout_t layout_d,
                                            const MatmulFp8Key& key) {
    for (const auto& entry : g_matmul_fp8_algos) {
        if (entry.first == key) return entry.second;
    }
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t workspace = MATMUL_WORKSPACE_BYTES;
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                     sizeof(workspace)));
    uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;  // split-K partial sums in fp32 only
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction_mask,
                                                     sizeof(reduction_mask)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a,
                                                     sizeof(key.align_a)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b,
                                                     sizeof(key.align_b)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_d,
                                                     sizeof(key.align_d)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d,
                                                     sizeof(key.align_d)));
    cublasLtMatmulHeuristicResult_t result = {};
    int n_found = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(g_cublaslt_handle, desc, layout_a, layout_b, layout_d,
                                                            layout_d, pref, 1, &result, &n_found);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && n_found == 0)) {
        fprintf(stderr, "matmul_fp8: cuBLASLt has no FP8 algorithm for m=%d n=%d k=%d (types %d x %d, %s out) on this "
                        "GPU; FP8 matmuls need Hopper or Ada\n", key.m, key.n, key.k, (int)key.type_a,
                (int)key.type_b, PRECISION_NAME);
        fail_exit();
    }
    cublasCheck(status);
    cublasCheck(result.state);
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    g_matmul_fp8_algos.push_back({key, result.algo});
    return result.algo;
}

// out (M, N) = (a (M, K) * inv_scale_a) (b (N, K) * inv_scale_b)^T, overwritten, or added to out with accumulate.
// a, b: FP8 row-major in the given formats; inv_scale_a, inv_scale_b: device pointers to one float each.
// amax_out: nullptr, or *amax_out = max |out| afterwards. Needs matmul_init(); M, N, K multiples of 16, all pointers
// 16-byte aligned.
inline void matmul_fp8(floatX* out, const __nv_fp8_storage_t* a, __nv_fp8_interpretation_t a_format,
                       const __nv_fp8_storage_t* b, __nv_fp8_interpretation_t b_format, int M, int N, int K,
                       const float* inv_scale_a, const float* inv_scale_b, bool accumulate, float* amax_out,
                       cudaStream_t stream, bool fast_accum = false) {
    if (g_cublaslt_handle == nullptr) {
        fprintf(stderr, "matmul_fp8: call matmul_init() first\n");
        fail_exit();
    }
    if (M <= 0 || N <= 0 || K <= 0 || M % 16 != 0 || N % 16 != 0 || K % 16 != 0) {
        fprintf(stderr, "matmul_fp8: M, N, K must be positive multiples of 16, got M=%d N=%d K=%d\n", M, N, K);
        fail_exit();
    }
    if ((((uintptr_t)out | (uintptr_t)a | (uintptr_t)b | (uintptr_t)inv_scale_a | (uintptr_t)inv_scale_b) & 15) != 0) {
        fprintf(stderr, "matmul_fp8: out, a, b and the scale pointers must be 16-byte aligned\n");
        fail_exit();
    }
    if (a_format == __NV_E5M2 && b_format == __NV_E5M2) {
        fprintf(stderr, "matmul_fp8: cuBLASLt has no e5m2 x e5m2 product\n");
        fail_exit();
    }
    cublasLtMatmulDesc_t desc;
    cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
    // cuBLASLt's A is our b, its B our a: the scales swap with them
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &inv_scale_b,
                                               sizeof(inv_scale_b)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &inv_scale_a,
                                               sizeof(inv_scale_a)));
    const int8_t fast = fast_accum ? 1 : 0;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));

    const cudaDataType_t type_a = fp8_cuda_type(b_format), type_b = fp8_cuda_type(a_format);
    cublasLtMatrixLayout_t layout_a, layout_b, layout_d;
    cublasCheck(cublasLtMatrixLayoutCreate(&layout_a, type_a, K, N, K));
    cublasCheck(cublasLtMatrixLayoutCreate(&layout_b, type_b, K, M, K));
    cublasCheck(cublasLtMatrixLayoutCreate(&layout_d, MATMUL_DATA_TYPE, N, M, N));

    const MatmulFp8Key key = {N, M, K, type_a, type_b, fast_accum, matmul_pointer_alignment(b),
                              matmul_pointer_alignment(a), matmul_pointer_alignment(out)};
    const cublasLtMatmulAlgo_t algo = matmul_fp8_algo(desc, layout_a, layout_b, layout_d, key);
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    cublasCheck(cublasLtMatmul(g_cublaslt_handle, desc, &alpha, b, layout_a, a, layout_b, &beta, out, layout_d, out,
                               layout_d, &algo, g_cublaslt_workspace, MATMUL_WORKSPACE_BYTES, stream));
    if (amax_out != nullptr) fp8_amax(amax_out, out, (size_t)M * N, stream);

    cublasCheck(cublasLtMatrixLayoutDestroy(layout_a));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_b));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_d));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
}
