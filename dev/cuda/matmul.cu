// Linear-layer matmuls (llmc/matmul.cuh, cuBLASLt): validation against a CPU reference and timing.
//
//   forward   out (N, OC)      = inp (N, C) @ weight (OC, C)^T     overwrite
//   backward  dinp (N, C)      = dout (N, OC) @ weight (OC, C)     overwrite (skipped for nullptr)
//             dweight (OC, C) += dout (N, OC)^T @ inp (N, C)       accumulate (skipped for nullptr)
//
// The CPU reference (dev/cpu/llama3_cpu.h) accumulates in fp64 over inputs rounded through floatX. The fp32 build must
// match to ~1e-6, which also proves TF32 is off (TF32 would miss by ~1e-3). Version 1 is llmc/matmul.cuh.
//
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a [-DENABLE_FP32] matmul.cu -lcublasLt -lcublas
// Run:   ./matmul [version] [model]   ("model" also times the trainer's d12 and llama3.2-1B shapes)
//        ./matmul 1 algos | search    experiments on the 1B products: the heuristic's answers, every configuration
//
// Tried, not kept (session 16, dev/NOTES.md tenth part): the residual add in the wo / w2 epilogues (beta = 1, C the
// residual stream, D the next one), validated then against the CPU product plus the residual (rel_err 1.1e-3 to
// 1.7e-3 in bf16). It saves 2.1 GB per 1B step, but its one rounding, where PyTorch rounds twice, took a BF16 tie-out
// (the masked case's step 4 grad norm) past its bound, and the step gain was inside the run-to-run spread.
#include <array>
#include <string>

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
                                const floatX* w, int N, int C, int OC, bool accumulate = true) {
    switch (version) {
        case 1: matmul_backward(dinp, dweight, dout, inp, w, N, C, OC, accumulate, 0); break;
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

    // overwriting dweight (a step's first micro-batch): poisoned, so every element must be written
    poison(d_dw, n_w * sizeof(floatX));
    matmul_backward_gpu(version, nullptr, d_dw, d_dout, d_inp, d_w, N, C, OC, /*accumulate=*/false);
    validate("dweight (overwritten)", take_rows(host_from_device(d_dw, n_w), C, o_rows), take_rows(dw_prod, C, o_rows),
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

// One product of matmul.cuh (column-major D (m, n) = op(A) op(B), beta 0 or 1) with its descriptor and layouts, for
// the experiments below. matmul.cuh's workspace and reduction preferences, no alignment preferences (cudaMalloc'd
// buffers are 256-byte aligned).
struct AlgoProblem {
    floatX* d;
    const floatX *a, *b;
    int m, n, k;
    float beta;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    AlgoProblem(floatX* d, const floatX* a, const floatX* b, int m, int n, int k, bool trans_a, bool trans_b,
                float beta)
        : d(d), a(a), b(b), m(m), n(n), k(k), beta(beta) {
        cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
        const int a_rows = trans_a ? k : m, a_cols = trans_a ? m : k, b_rows = trans_b ? n : k;
        const int b_cols = trans_b ? k : n;
        cublasCheck(cublasLtMatrixLayoutCreate(&la, MATMUL_DATA_TYPE, a_rows, a_cols, a_rows));
        cublasCheck(cublasLtMatrixLayoutCreate(&lb, MATMUL_DATA_TYPE, b_rows, b_cols, b_rows));
        cublasCheck(cublasLtMatrixLayoutCreate(&ld, MATMUL_DATA_TYPE, m, n, m));
    }
    AlgoProblem(const AlgoProblem&) = delete;
    AlgoProblem& operator=(const AlgoProblem&) = delete;
    ~AlgoProblem() {
        cublasCheck(cublasLtMatrixLayoutDestroy(la));
        cublasCheck(cublasLtMatrixLayoutDestroy(lb));
        cublasCheck(cublasLtMatrixLayoutDestroy(ld));
        cublasCheck(cublasLtMatmulDescDestroy(desc));
    }
    double flops() const { return 2.0 * m * (double)n * k; }
    void run(const cublasLtMatmulAlgo_t& algo) const {
        const float alpha = 1.0f;
        cublasCheck(cublasLtMatmul(g_cublaslt_handle, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &algo,
                                   g_cublaslt_workspace, MATMUL_WORKSPACE_BYTES, 0));
    }
    // The hash of this algorithm's product alone: beta = 1 products accumulate onto D, so D is cleared first.
    unsigned long long product_hash(const cublasLtMatmulAlgo_t& algo) const {
        if (beta != 0.0f) cudaCheck(cudaMemset(d, 0, (size_t)m * n * sizeof(floatX)));
        run(algo);
        return matmul_output_hash(d, (size_t)m * n, 0);
    }
    int heuristic(cublasLtMatmulHeuristicResult_t* results, int count) const {
        cublasLtMatmulPreference_t pref;
        cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t workspace = MATMUL_WORKSPACE_BYTES;
        uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                         sizeof(workspace)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                         &reduction_mask, sizeof(reduction_mask)));
        int n_found = 0;
        cublasCheck(cublasLtMatmulAlgoGetHeuristic(g_cublaslt_handle, desc, la, lb, ld, ld, pref, count, results,
                                                   &n_found));
        cublasCheck(results[0].state);
        cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
        return n_found;
    }
};

static void print_algo_config(const cublasLtMatmulAlgo_t& algo) {
    const cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
        CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
        CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
    for (auto attr : attrs) printf(" %3llu", (unsigned long long)matmul_algo_config(algo, attr));
}

// Experiment (./matmul 1 algos): times every algorithm cuBLASLt's heuristic offers for one product (up to 32) and
// prints the heuristic's first choice against the fastest, with whether each computes the first choice's bits.
static void time_algos(const char* name, const AlgoProblem& problem) {
    cublasLtMatmulHeuristicResult_t results[32];
    const int n_found = problem.heuristic(results, 32);
    float first = 0.0f, best = 1e30f;
    int best_i = -1;
    unsigned long long first_hash = 0;
    printf("      algorithm id, tile, stages, split-K, reduction, swizzle, custom, inner shape, cluster shape\n");
    for (int i = 0; i < n_found; i++) {
        if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
        const unsigned long long hash = problem.product_hash(results[i].algo);
        if (i == 0) first_hash = hash;
        float ms = benchmark_ms(10, [&] { problem.run(results[i].algo); });
        printf("      #%-2d", i);
        print_algo_config(results[i].algo);
        printf(" | same kernel, unsplit: %s | same bits: %s | %7.2f TFLOP/s\n",
               matmul_same_kernel_unsplit(results[i].algo, results[0].algo) ? "yes" : "no ",
               hash == first_hash ? "yes" : "no ", problem.flops() / (ms * 1e-3) / 1e12);
        if (i == 0) first = ms;
        if (ms < best) best = ms, best_i = i;
    }
    printf("    %-8s heuristic #0 %7.2f TFLOP/s | best of %2d: #%d %7.2f TFLOP/s\n", name,
           problem.flops() / (first * 1e-3) / 1e12, n_found, best_i, problem.flops() / (best * 1e-3) / 1e12);
}

// Experiment (./matmul 1 search [shape:product,...]): beyond the heuristic's list, every configuration of the first
// choice's kernel that cuBLASLt accepts (tile x stages x cluster shape x custom option x swizzle, no split-K), each
// timed briefly; then the ten fastest and the first choice again, alone and sustained. With a list (e.g.
// "qkv:forward,w2:dinp") only those products are searched, and every timing is also printed as a csv line.
//
// What it showed on an H100 (1B products, cuBLASLt of CUDA 13.0): 634 tiles x 6 clusters x 8 custom options, 7632
// configurations accepted per product. Timed alone, tiles such as 128x168 and 192x112 beat the first choice by 8-39%
// (qkv forward 709-735 -> 775-809 TFLOP/s, w2 dinp 589-685 -> 818-823), all with the first choice's bits. But the
// same configuration timed twice alone differs by up to 15%; sustained, the H100 sits at its 700 W power cap (SM
// clock mostly 1.3-1.8 GHz instead of 1.98, throttle reason "SW power cap"), as it does through a whole training
// step, and the ten fastest spread over 592-740 (qkv forward) and 656-738 (w2 dinp) against the first choice's 681
// and 644.
// The trainer with this search in matmul.cuh (the heuristic's answers and ~700 configurations of its kernel: every
// candidate once, then the best 8 three times, the fastest with the first answer's bits kept; beta = 1 products
// searched on the zeroed gradients of the first step) gave the same losses bit for bit and no faster 1B step
// (median 244.96 / 246.74 ms against 243.23 / 243.49 ms, alternating runs; no profile region faster), d12 1.9%
// faster, 13 s more start-up for the 1B and 30 MB more memory: not kept.
// Later (session 13, H100), two more tries at choosing for the power cap, neither kept:
//   * energy per product from NVML's energy counter (nvmlDeviceGetTotalEnergyConsumption, loaded with dlopen), over
//     blocks of 100 back-to-back runs: the counter moved in steps of about 700 mJ, so a 75-160 ms block read 0, 1 or
//     2 steps and the per-product energy could not be resolved; blocks of several seconds would be needed.
//   * the trainer's candidates timed as in that experiment, at the cap (5 interleaved rounds of 10 back-to-back
//     runs, the median round): the spread between the heuristic's same-bits answers was up to 18% (w2 dinp 0.711 ms
//     against the first answer's 0.839 ms, w13 forward 1.520 against 1.633 ms), but the 1B step chosen this way was
//     slower than with the single cold timing matmul.cuh keeps (median 235.4 / 235.7 / 237.5 ms against 232.5 /
//     232.4 / 234.5 ms, alternating; d12 43.2 / 43.5 against 43.0 / 43.0 ms), with the same losses bit for bit and
//     4.4 s more start-up.
static bool g_search_csv = false;            // also print every timing as a csv line
static const char* g_search_only = nullptr;  // "shape:product,...": search only these

template <typename T>
static void set_algo_config(cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr, T value) {
    cublasCheck(cublasLtMatmulAlgoConfigSetAttribute(&algo, attr, &value, sizeof(value)));
}

static void search_algos(const char* name, const AlgoProblem& problem) {
    cublasLtMatmulHeuristicResult_t first;
    problem.heuristic(&first, 1);
    const int algo_id = (int)matmul_algo_config(first.algo, CUBLASLT_ALGO_CONFIG_ID);
    cublasLtMatmulAlgo_t base;
    cublasCheck(cublasLtMatmulAlgoInit(g_cublaslt_handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, MATMUL_DATA_TYPE,
                                       MATMUL_DATA_TYPE, MATMUL_DATA_TYPE, MATMUL_DATA_TYPE, algo_id, &base));
    auto cap_list = [&](cublasLtMatmulAlgoCapAttributes_t attr) {
        size_t bytes = 0;
        cublasCheck(cublasLtMatmulAlgoCapGetAttribute(&base, attr, nullptr, 0, &bytes));
        std::vector<uint32_t> ids(bytes / sizeof(uint32_t));
        if (!ids.empty()) cublasCheck(cublasLtMatmulAlgoCapGetAttribute(&base, attr, ids.data(), bytes, &bytes));
        return ids;
    };
    auto cap_value = [&](cublasLtMatmulAlgoCapAttributes_t attr) {
        int32_t value = 0;
        size_t bytes = 0;
        cublasCheck(cublasLtMatmulAlgoCapGetAttribute(&base, attr, &value, sizeof(value), &bytes));
        return value;
    };
    const std::vector<uint32_t> tiles = cap_list(CUBLASLT_ALGO_CAP_TILE_IDS);
    const std::vector<uint32_t> stages = cap_list(CUBLASLT_ALGO_CAP_STAGES_IDS);
    const int32_t custom_max = cap_value(CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX);
    const uint32_t swizzle_max = cap_value(CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT) ? 1 : 0;
    const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                                 CUBLASLT_CLUSTER_SHAPE_1x2x1, CUBLASLT_CLUSTER_SHAPE_2x2x1,
                                 CUBLASLT_CLUSTER_SHAPE_4x1x1, CUBLASLT_CLUSTER_SHAPE_1x4x1};
    const unsigned long long reference = problem.product_hash(first.algo);
    const float first_ms = benchmark_ms(5, [&] { problem.run(first.algo); });
    struct Timed {
        float ms;
        cublasLtMatmulAlgo_t algo;
    };
    std::vector<Timed> timed;
    for (uint32_t tile : tiles) {
        for (uint32_t stage : stages) {
            for (uint16_t cluster : clusters) {
                for (int32_t custom = 0; custom <= custom_max; custom++) {
                    for (uint32_t swizzle = 0; swizzle <= swizzle_max; swizzle++) {
                        cublasLtMatmulAlgo_t algo = base;
                        set_algo_config(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, tile);
                        set_algo_config(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, stage);
                        set_algo_config(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, (int32_t)1);
                        set_algo_config(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, custom);
                        set_algo_config(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swizzle);
                        set_algo_config(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster);
                        cublasLtMatmulHeuristicResult_t check = {};
                        if (cublasLtMatmulAlgoCheck(g_cublaslt_handle, problem.desc, problem.la, problem.lb,
                                                    problem.ld, problem.ld, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
                            check.workspaceSize > MATMUL_WORKSPACE_BYTES) {
                            continue;
                        }
                        timed.push_back({benchmark_ms(2, [&] { problem.run(algo); }), algo});
                        if (g_search_csv) {
                            printf("csv,%s,%d,%d,%d,%u,%u,%d,%d,%u,%.5f\n", name, problem.m, problem.n, problem.k,
                                   tile, stage, (int)cluster, custom, swizzle, timed.back().ms);
                        }
                    }
                }
            }
        }
    }
    printf("    %-8s kernel %d: %zu tiles x %zu stages x 6 clusters x %d custom x %u swizzle, %zu accepted; first "
           "choice %7.2f TFLOP/s\n",
           name, algo_id, tiles.size(), stages.size(), custom_max + 1, swizzle_max + 1, timed.size(),
           problem.flops() / (first_ms * 1e-3) / 1e12);
    // The ten fastest and the first choice again: alone (10 runs with a sync after each: the GPU stays at its boost
    // clock), then sustained (100 runs back to back after 50 warm-up runs: the GPU at its power cap, as in training).
    std::sort(timed.begin(), timed.end(), [](const Timed& x, const Timed& y) { return x.ms < y.ms; });
    timed.resize(std::min<size_t>(timed.size(), 10));
    timed.push_back({first_ms, first.algo});
    for (size_t i = 0; i < timed.size(); i++) {
        const float ms = benchmark_ms(10, [&] { problem.run(timed[i].algo); });
        const bool same = problem.product_hash(timed[i].algo) == reference;
        for (int rep = 0; rep < 50; rep++) problem.run(timed[i].algo);
        const float sustained_ms = benchmark_ms(1, [&] {
            for (int rep = 0; rep < 100; rep++) problem.run(timed[i].algo);
        }) / 100.0f;
        printf("      %s", i + 1 == timed.size() ? "first:" : "      ");
        print_algo_config(timed[i].algo);
        printf(" | same bits: %s | alone %7.2f TFLOP/s | sustained %7.2f TFLOP/s\n", same ? "yes" : "no ",
               problem.flops() / (ms * 1e-3) / 1e12, problem.flops() / (sustained_ms * 1e-3) / 1e12);
    }
}

// The three products of one linear layer, in matmul.cuh's calls, to one of the experiments above.
static void algos_shape(const char* shape, int N, int C, int OC,
                        void (*experiment)(const char*, const AlgoProblem&)) {
    ShapeBuffers buf(N, C, OC);
    printf("  %s N=%d C=%d OC=%d\n", shape, N, C, OC);
    auto wanted = [&](const char* product) {
        if (g_search_only == nullptr) return true;
        return strstr(g_search_only, (std::string(shape) + ":" + product).c_str()) != nullptr;
    };
    if (wanted("forward")) experiment("forward", AlgoProblem(buf.out, buf.w, buf.inp, OC, N, C, true, false, 0.0f));
    if (wanted("dinp")) experiment("dinp", AlgoProblem(buf.dinp, buf.w, buf.dout, C, N, OC, false, false, 0.0f));
    if (wanted("dweight")) experiment("dweight", AlgoProblem(buf.dw, buf.inp, buf.dout, C, OC, N, false, true, 1.0f));
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);  // clear message and exit 1 without a GPU
    const int version = argc > 1 ? atoi(argv[1]) : 1;
    printf("matmul version %d (%s)\n", version, PRECISION_NAME);
    matmul_init(0);

    if (argc > 2 && (strcmp(argv[2], "algos") == 0 || strcmp(argv[2], "search") == 0)) {
        // llama3.2-1B's products as the trainer issued them when these experiments ran: N = B*T = 16384 tokens, the
        // lm_head in chunks of 2093 rows (256 Mi logits; the trainer now takes 3 chunks of 5462 rows).
        printf("llama3.2-1B shapes: qkv, wo, w13, w2, lm_head; %s\n",
               strcmp(argv[2], "algos") == 0 ? "every algorithm the heuristic offers" : "every configuration");
        auto experiment = strcmp(argv[2], "algos") == 0 ? time_algos : search_algos;
        if (argc > 3) g_search_only = argv[3], g_search_csv = true;
        const char* names[] = {"qkv", "wo", "w13", "w2", "lm_head"};
        const std::array<int, 3> shapes[] = {{16384, 2048, 3072}, {16384, 2048, 2048}, {16384, 2048, 16384},
                                             {16384, 8192, 2048}, {2093, 2048, 128256}};
        for (int i = 0; i < 5; i++) algos_shape(names[i], shapes[i][0], shapes[i][1], shapes[i][2], experiment);
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
