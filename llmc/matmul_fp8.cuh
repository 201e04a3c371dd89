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
// So each layer needs W's e4m3 copy and its transpose, inp's copy and transpose, and dout's copy and transpose:
// fp8_cast_transpose writes a copy and its transpose in one pass. Gradients may be e4m3 too (any pair but e5m2 x
// e5m2). fp8_linear_forward / fp8_linear_backward_input / fp8_linear_backward_weight (the end of this file) are the
// three products with their casts, as the trainer runs them.
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

#include <algorithm>
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

// ------------------------------------------------------------------------------------------------ linear layers
// The trainer's linear layers in FP8 (-M fp8): each of a layer's products (table at the top) casts its operands
// just before it runs, with current per-tensor scaling: the scale computed on the device from the amax of the
// tensor being cast (llmc/fp8.cuh). Forward operands e4m3, the output gradient e5m2, fp32 accumulation, floatX
// outputs into the buffers the bf16 products write. Nothing outlives a step but the weights themselves, so a
// checkpoint holds the same state in either mode and a resumed run is bit-exact.
//
// The amaxes are not taken here: each product finds its operands' amaxes in its slots, put there by the kernels
// that wrote the operands (the norms, SwiGLU forward and backward, the norm backward for the residual gradient) or by
// fp8_amax_accumulate where a writer does not take one (attention's output and gradient, the weights). That saves
// a read of each of those tensors. Slots, per product: its input's and its weight's amax (written by the forward,
// read by the backward too: the same tensors then, since the weights change only at the update and the inputs are
// kept or recomputed bit for bit) and its output gradient's. The forward's slots restart at zero before each
// forward, the gradients' before each backward (the writers take max(slot, their amax)).
//
// The FP8 copies of the operands are written where the caller says (Fp8Copies): the trainer puts them in memory
// that holds nothing else at the time (its allocate_activations), so the FP8 mode needs little memory of its own.
// The inverse scales and the amax slots live in Fp8LinearScales.
// The weights are cast per product, not once per step: an e4m3 copy and a transposed copy of every layer weight
// would hold as many bytes as the bf16 weights themselves, where a product needs one weight's copy at a time; the
// price is three reads of each weight per micro-batch (amax and cast in the forward, the transposed cast in the
// backward).
struct Fp8Copies {
    __nv_fp8_storage_t* operand;  // forward: the input's copy; backward: the output gradient's copy (input gradient)
    __nv_fp8_storage_t* grad_t;   // backward: the output gradient's transposed copy, from the input gradient to the
                                  // weight gradient
    __nv_fp8_storage_t* weight;   // the weight's copy (forward) or its transposed copy (input gradient)
    __nv_fp8_storage_t* inp_t;    // backward: the input's transposed copy (weight gradient)
};

struct Fp8LinearScales {
    DeviceBuffer<float> scales;  // inv_operand, inv_grad, inv_weight: 16 bytes apart
    DeviceBuffer<float> amax;    // [inputs | weights | output gradients], a slot per product each
    int products = 0;
    float *inv_operand = nullptr, *inv_grad = nullptr, *inv_weight = nullptr;

    void allocate(int n_products) {
        scales = DeviceBuffer<float>(12);
        inv_operand = scales.ptr;
        inv_grad = scales.ptr + 4;
        inv_weight = scales.ptr + 8;
        products = n_products;
        amax = DeviceBuffer<float>(3 * (size_t)products);
    }
    float* inp_amax(int product) { return amax.ptr + product; }
    float* weight_amax(int product) { return amax.ptr + products + product; }
    float* grad_amax(int product) { return amax.ptr + 2 * products + product; }
    void clear_forward_amax(cudaStream_t stream) {
        cudaCheck(cudaMemsetAsync(amax.ptr, 0, 2 * (size_t)products * sizeof(float), stream));
    }
    void clear_grad_amax(cudaStream_t stream) {
        cudaCheck(cudaMemsetAsync(grad_amax(0), 0, (size_t)products * sizeof(float), stream));
    }
};

// out (N, OC) = inp (N, C) weight (OC, C)^T, overwritten; inp and weight cast to e4m3 with the scales of their
// amaxes in slot `product`.
inline void fp8_linear_forward(floatX* out, const floatX* inp, const floatX* weight, int N, int C, int OC,
                               int product, const Fp8Copies& copies, Fp8LinearScales& s, cudaStream_t stream) {
    fp8_cast(copies.operand, s.inv_operand, inp, s.inp_amax(product), (size_t)N * C, __NV_E4M3, stream);
    fp8_cast(copies.weight, s.inv_weight, weight, s.weight_amax(product), (size_t)OC * C, __NV_E4M3, stream);
    matmul_fp8(out, copies.operand, __NV_E4M3, copies.weight, __NV_E4M3, N, OC, C, s.inv_operand, s.inv_weight, false,
               nullptr, stream);
}

// The backward's first half: dinp (N, C) = dout (N, OC) weight (OC, C), overwritten. Casts dout to e5m2 with the
// scale of its amax in slot `product`, in one pass its copy for this product and its transpose (copies.grad_t,
// which must be left for fp8_linear_backward_weight); the weight's transposed e4m3 copy uses the forward's amax.
inline void fp8_linear_backward_input(floatX* dinp, const floatX* dout, const floatX* weight, int N, int C, int OC,
                                      int product, const Fp8Copies& copies, Fp8LinearScales& s, cudaStream_t stream) {
    fp8_cast_transpose(copies.grad_t, copies.operand, s.inv_grad, dout, s.grad_amax(product), N, OC, __NV_E5M2,
                       stream);
    fp8_cast_transpose(copies.weight, nullptr, s.inv_weight, weight, s.weight_amax(product), OC, C, __NV_E4M3,
                       stream);
    matmul_fp8(dinp, copies.operand, __NV_E5M2, copies.weight, __NV_E4M3, N, C, OC, s.inv_grad, s.inv_weight, false,
               nullptr, stream);
}

// The second half, after fp8_linear_backward_input of the same product (whose dout^T it uses; work between the two
// may recompute inp, as the trainer's norm backward does): dweight (OC, C) = dout^T inp (N, C), added to dweight
// with accumulate (cuBLASLt rounds the product to floatX first: matmul_fp8), else overwriting it (not read). inp's
// transposed e4m3 copy uses the forward's amax of slot `product`.
inline void fp8_linear_backward_weight(floatX* dweight, const floatX* inp, int N, int C, int OC, int product,
                                       bool accumulate, const Fp8Copies& copies, Fp8LinearScales& s,
                                       cudaStream_t stream) {
    fp8_cast_transpose(copies.inp_t, nullptr, s.inv_operand, inp, s.inp_amax(product), N, C, __NV_E4M3, stream);
    matmul_fp8(dweight, copies.grad_t, __NV_E5M2, copies.inp_t, __NV_E4M3, OC, C, N, s.inv_grad, s.inv_operand,
               accumulate, nullptr, stream);
}
