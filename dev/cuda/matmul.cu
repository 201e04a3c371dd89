// Linear-layer matmuls (llmc/matmul.cuh, cuBLASLt): validation against a CPU reference and timing.
//
//   forward   out (N, OC)      = inp (N, C) @ weight (OC, C)^T     overwrite
//   backward  dinp (N, C)      = dout (N, OC) @ weight (OC, C)     overwrite (skipped for nullptr)
//             dweight (OC, C) += dout (N, OC)^T @ inp (N, C)       accumulate (skipped for nullptr)
//
// The CPU reference (dev/cpu/llama3_cpu.h) accumulates in fp64 over inputs rounded through floatX. The fp32 build must match to ~1e-6,
// which also proves TF32 is off (TF32 would miss by ~1e-3). Version 1 is llmc/matmul.cuh.
//
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a [-DENABLE_FP32] matmul.cu -lcublasLt -lcublas
// Run:   ./matmul [version] [model]   ("model" also times the trainer's d12 and llama3.2-1B shapes)
#include <array>

#include "common.h"

#include "../../llmc/matmul.cuh"

// ---------------------------------------------------------------------------------------------------------------
// CPU reference (dev/cpu/llama3_cpu.h), on the output rows checked: `rows` of out and dinp (rows of N), `o_rows` of
// dweight (rows of OC). The others are left at zero and not compared.

static void reference_rows(std::vector<float>& out, std::vector<float>& dinp, std::vector<float>& dweight_prod,
                           const std::vector<float>& inp, const std::vector<float>& w, const std::vector<float>& dout,
                           int N, int C, int OC, const std::vector<int>& rows, const std::vector<int>& o_rows) {
    for (int n : rows) {
        cpu::matmul_forward(&out[(size_t)n * OC], &inp[(size_t)n * C], w.data(), 1, C, OC);
        cpu::matmul_backward_input(&dinp[(size_t)n * C], &dout[(size_t)n * OC], w.data(), 1, C, OC);
    }
    std::vector<float> dout_column(N);  // dweight row o sums over column o of dout
    for (int o : o_rows) {
        for (int n = 0; n < N; n++) dout_column[n] = dout[(size_t)n * OC + o];
        cpu::matmul_backward_weight(&dweight_prod[(size_t)o * C], dout_column.data(), inp.data(), N, C, 1);
    }
}

static std::vector<int> all_rows(int n) {
    std::vector<int> r(n);
    for (int i = 0; i < n; i++) r[i] = i;
    return r;
}

// Keeps only the listed rows (of width `width`) of a row-major matrix, concatenated: for sampled comparisons.
static std::vector<float> take_rows(const std::vector<float>& x, int width, const std::vector<int>& rows) {
    std::vector<float> out;
    for (int r : rows) out.insert(out.end(), x.begin() + (size_t)r * width, x.begin() + (size_t)(r + 1) * width);
    return out;
}

// ---------------------------------------------------------------------------------------------------------------
// GPU versions

static void matmul_forward_gpu(int version, floatX* out, const floatX* inp, const floatX* w, int N, int C, int OC) {
    switch (version) {
        case 1: matmul_forward(out, inp, w, N, C, OC, 0); break;
        default: fprintf(stderr, "unknown version %d\n", version); exit(EXIT_FAILURE);
    }
}

static void matmul_backward_gpu(int version, floatX* dinp, floatX* dweight, const floatX* dout, const floatX* inp,
                                const floatX* w, int N, int C, int OC) {
    switch (version) {
        case 1: matmul_backward(dinp, dweight, dout, inp, w, N, C, OC, 0); break;
        default: fprintf(stderr, "unknown version %d\n", version); exit(EXIT_FAILURE);
    }
}

// Validates all three products. With `sample_rows` > 0 only that many random output rows are checked (for shapes too
// big for a full CPU reference), with `tolerance` for the longer reductions.
static void validate_shape(int version, int N, int C, int OC, uint64_t seed, int sample_rows = 0,
                           double tolerance = DEFAULT_TOLERANCE) {
    printf("N=%d C=%d OC=%d%s\n", N, C, OC, sample_rows > 0 ? " (sampled rows)" : "");
    const size_t n_inp = (size_t)N * C, n_w = (size_t)OC * C, n_out = (size_t)N * OC;
    // Inputs drawn on the device (uniform [-1, 1), already floatX) and copied back: the reference sees exactly the
    // GPU's inputs, and the 134M-element timing shape needs no slow host RNG.
    floatX* d_inp = device_random<floatX>(n_inp, (uint32_t)seed, 1.0f);
    floatX* d_w = device_random<floatX>(n_w, (uint32_t)seed + 1, 1.0f);
    floatX* d_dout = device_random<floatX>(n_out, (uint32_t)seed + 2, 1.0f);
    floatX* d_dw = device_random<floatX>(n_w, (uint32_t)seed + 3, 1.0f);
    const std::vector<float> inp = host_from_device(d_inp, n_inp), w = host_from_device(d_w, n_w);
    const std::vector<float> dout = host_from_device(d_dout, n_out), dw_init = host_from_device(d_dw, n_w);
    std::vector<int> n_rows = all_rows(N), o_rows = all_rows(OC);
    if (sample_rows > 0) {
        n_rows = random_ints(sample_rows, N, seed + 4);
        o_rows = random_ints(sample_rows, OC, seed + 5);
    }

    std::vector<float> out_ref(n_out), dinp_ref(n_inp), dw_ref1(n_w), dw_ref2(n_w);
    std::vector<float> dw_prod(n_w, 0.0f);  // the product alone; the references add the initial value
    reference_rows(out_ref, dinp_ref, dw_prod, inp, w, dout, N, C, OC, n_rows, o_rows);
    for (size_t i = 0; i < n_w; i++) {  // after one and after two accumulating calls
        dw_ref1[i] = (float)((double)dw_init[i] + dw_prod[i]);
        dw_ref2[i] = (float)((double)dw_init[i] + 2.0 * dw_prod[i]);
    }

    floatX *d_out, *d_dinp;
    cudaCheck(cudaMalloc(&d_out, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dinp, n_inp * sizeof(floatX)));

    // forward overwrites out
    poison(d_out, n_out * sizeof(floatX));
    matmul_forward_gpu(version, d_out, d_inp, d_w, N, C, OC);
    validate("out", take_rows(host_from_device(d_out, n_out), OC, n_rows), take_rows(out_ref, OC, n_rows),
             tolerance);

    // backward: dinp overwritten, dweight accumulated onto its initial value
    poison(d_dinp, n_inp * sizeof(floatX));
    matmul_backward_gpu(version, d_dinp, d_dw, d_dout, d_inp, d_w, N, C, OC);
    validate("dinp", take_rows(host_from_device(d_dinp, n_inp), C, n_rows), take_rows(dinp_ref, C, n_rows),
             tolerance);
    validate("dweight (init + 1x)", take_rows(host_from_device(d_dw, n_w), C, o_rows), take_rows(dw_ref1, C, o_rows),
             tolerance);

    // dinp == nullptr: only dweight, accumulating a second time
    matmul_backward_gpu(version, nullptr, d_dw, d_dout, d_inp, d_w, N, C, OC);
    validate("dweight (init + 2x)", take_rows(host_from_device(d_dw, n_w), C, o_rows), take_rows(dw_ref2, C, o_rows),
             tolerance);

    // dweight == nullptr: only dinp
    poison(d_dinp, n_inp * sizeof(floatX));
    matmul_backward_gpu(version, d_dinp, nullptr, d_dout, d_inp, d_w, N, C, OC);
    validate("dinp (dweight skipped)", take_rows(host_from_device(d_dinp, n_inp), C, n_rows),
             take_rows(dinp_ref, C, n_rows), tolerance);

    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_w));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_dw));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dinp));
}

// Random operands and outputs of one shape's three products (out = inp w^T, dinp = dout w, dw += dout^T inp).
struct ShapeBuffers {
    floatX *inp, *w, *dout, *dw, *out, *dinp;
    ShapeBuffers(int N, int C, int OC) {
        inp = device_random<floatX>((size_t)N * C, 11, 1.0f);
        w = device_random<floatX>((size_t)OC * C, 12, 0.02f);
        dout = device_random<floatX>((size_t)N * OC, 13, 1.0f);
        dw = device_random<floatX>((size_t)OC * C, 14, 0.02f);
        cudaCheck(cudaMalloc(&out, (size_t)N * OC * sizeof(floatX)));
        cudaCheck(cudaMalloc(&dinp, (size_t)N * C * sizeof(floatX)));
    }
    ShapeBuffers(const ShapeBuffers&) = delete;
    ShapeBuffers& operator=(const ShapeBuffers&) = delete;
    ~ShapeBuffers() {
        for (floatX* p : {inp, w, dout, dw, out, dinp}) cudaCheck(cudaFree(p));
    }
};

static void time_shape(int version, int N, int C, int OC) {
    ShapeBuffers buf(N, C, OC);
    const double flops = 2.0 * N * (double)C * OC;  // per product
    float ms_fwd = benchmark_ms(10, [&] { matmul_forward_gpu(version, buf.out, buf.inp, buf.w, N, C, OC); });
    float ms_dinp = benchmark_ms(
        10, [&] { matmul_backward_gpu(version, buf.dinp, nullptr, buf.dout, buf.inp, buf.w, N, C, OC); });
    float ms_dw = benchmark_ms(
        10, [&] { matmul_backward_gpu(version, nullptr, buf.dw, buf.dout, buf.inp, buf.w, N, C, OC); });
    printf("  N=%d C=%d OC=%d\n", N, C, OC);
    printf("    forward   %8.3f ms  %7.2f TFLOP/s\n", ms_fwd, flops / (ms_fwd * 1e-3) / 1e12);
    printf("    dinp      %8.3f ms  %7.2f TFLOP/s\n", ms_dinp, flops / (ms_dinp * 1e-3) / 1e12);
    printf("    dweight   %8.3f ms  %7.2f TFLOP/s\n", ms_dw, flops / (ms_dw * 1e-3) / 1e12);
}

// Experiment (./matmul 1 algos): for one product of the trainer's shapes, times every algorithm cuBLASLt's heuristic
// offers (up to 16; matmul.cuh's workspace and reduction preferences, no alignment preferences: cudaMalloc'd buffers
// are 256-byte aligned) and prints the heuristic's first choice against the fastest.
static void time_algos(const char* name, floatX* d, const floatX* a, const floatX* b, int m, int n, int k,
                       bool trans_a, bool trans_b, float beta) {
    cublasLtMatmulDesc_t desc;
    cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    const int a_rows = trans_a ? k : m, a_cols = trans_a ? m : k, b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasCheck(cublasLtMatrixLayoutCreate(&la, MATMUL_DATA_TYPE, a_rows, a_cols, a_rows));
    cublasCheck(cublasLtMatrixLayoutCreate(&lb, MATMUL_DATA_TYPE, b_rows, b_cols, b_rows));
    cublasCheck(cublasLtMatrixLayoutCreate(&ld, MATMUL_DATA_TYPE, m, n, m));
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t workspace = MATMUL_WORKSPACE_BYTES;
    uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                     sizeof(workspace)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction_mask,
                                                     sizeof(reduction_mask)));
    cublasLtMatmulHeuristicResult_t results[16];
    int n_found = 0;
    cublasCheck(cublasLtMatmulAlgoGetHeuristic(g_cublaslt_handle, desc, la, lb, ld, ld, pref, 16, results, &n_found));
    cublasCheck(results[0].state);  // the first answer is the reference of the printout
    const double flops = 2.0 * m * (double)n * k;
    const float alpha = 1.0f;
    float first = 0.0f, best = 1e30f;
    int best_i = -1;
    unsigned long long first_hash = 0;
    printf("      algorithm id, tile, stages, split-K, reduction, swizzle, custom, inner shape, cluster shape\n");
    for (int i = 0; i < n_found; i++) {
        if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
        float ms = benchmark_ms(10, [&] {
            cublasCheck(cublasLtMatmul(g_cublaslt_handle, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld,
                                       &results[i].algo, g_cublaslt_workspace, MATMUL_WORKSPACE_BYTES, 0));
        });
        const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
            CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
            CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
            CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID,
            CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
        // Its output, compared with the first answer's (for beta = 1 both accumulate onto what D holds: compare
        // the products of a fresh D instead, so only beta = 0 products get a verdict).
        const char* same_bits = "-  ";
        if (beta == 0.0f) {
            const unsigned long long hash = matmul_output_hash(d, (size_t)m * n, 0);
            if (i == 0) first_hash = hash;
            same_bits = hash == first_hash ? "yes" : "no ";
        }
        printf("      #%d", i);
        for (auto attr : attrs) printf(" %3llu", (unsigned long long)matmul_algo_config(results[i].algo, attr));
        printf(" | same kernel, unsplit: %s | same bits: %s | %7.2f TFLOP/s\n",
               matmul_same_kernel_unsplit(results[i].algo, results[0].algo) ? "yes" : "no ", same_bits,
               flops / (ms * 1e-3) / 1e12);
        if (i == 0) first = ms;
        if (ms < best) best = ms, best_i = i;
    }
    printf("    %-8s heuristic #0 %7.2f TFLOP/s | best of %2d: #%d %7.2f TFLOP/s\n", name,
           flops / (first * 1e-3) / 1e12, n_found, best_i, flops / (best * 1e-3) / 1e12);
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    cublasCheck(cublasLtMatrixLayoutDestroy(la));
    cublasCheck(cublasLtMatrixLayoutDestroy(lb));
    cublasCheck(cublasLtMatrixLayoutDestroy(ld));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
}

static void time_algos_shape(int N, int C, int OC) {
    ShapeBuffers buf(N, C, OC);
    printf("  N=%d C=%d OC=%d\n", N, C, OC);
    time_algos("forward", buf.out, buf.w, buf.inp, OC, N, C, true, false, 0.0f);  // the calls of matmul.cuh
    time_algos("dinp", buf.dinp, buf.w, buf.dout, C, N, OC, false, false, 0.0f);
    time_algos("dweight", buf.dw, buf.inp, buf.dout, C, OC, N, false, true, 1.0f);
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);  // clear message and exit 1 without a GPU
    const int version = argc > 1 ? atoi(argv[1]) : 1;
    printf("matmul version %d (%s)\n", version, PRECISION_NAME);
    matmul_init(0);

    if (argc > 2 && strcmp(argv[2], "algos") == 0) {
        printf("llama3.2-1B shapes: qkv, wo, w13, w2, lm_head; every algorithm the heuristic offers\n");
        for (auto s : {std::array<int, 2>{2048, 3072}, {2048, 2048}, {2048, 16384}, {8192, 2048}, {2048, 128256}}) {
            time_algos_shape(16384, s[0], s[1]);
        }
        matmul_destroy();
        return 0;
    }
    validate_shape(version, 37, 48, 259, 100);    // odd sizes: no dimension a multiple of 8
    validate_shape(version, 1, 3, 5, 200);        // degenerate: a single token
    validate_shape(version, 256, 2048, 6144, 300);  // realistic (a QKV projection of a 2048-wide model)
    // The timing shape, on 8 random output rows of each product. Reductions run up to N = 16384 long, so fp32 rounding
    // grows like sqrt(length): allow 4x the default tolerance.
    validate_shape(version, 16384, 2048, 8192, 400, 8, 4 * DEFAULT_TOLERANCE);

    printf("timing\n");
    time_shape(version, 16384, 2048, 8192);
    if (argc > 2) {  // ./matmul 1 model: the trainer's shapes (B*T = 16384): d12, then llama3.2-1B
        printf("d12 shapes: qkv, wo, w13, w2, lm_head\n");
        for (auto s : {std::array<int, 2>{768, 1280}, {768, 768}, {768, 4096}, {2048, 768}, {768, 128256}}) {
            time_shape(version, 16384, s[0], s[1]);
        }
        printf("llama3.2-1B shapes: qkv, wo, w13, w2, lm_head\n");
        for (auto s : {std::array<int, 2>{2048, 3072}, {2048, 2048}, {2048, 16384}, {8192, 2048}, {2048, 128256}}) {
            time_shape(version, 16384, s[0], s[1]);
        }
    }

    matmul_destroy();
    return finish(argv[0]);
}
