// CUTLASS 3 (Hopper, TMA + wgmma, warp-specialised) against cuBLASLt on the trainer's forward matmul shapes: the
// first step toward epilogue fusions (SwiGLU in the w13 product, the residual add in wo / w2) that cuBLASLt cannot
// express. Before building on CUTLASS, its plain GEMM has to keep up with cuBLASLt on our exact shapes.
//
//   out (M, N) = inp (M, K) . weight (N, K)^T, bf16 in and out, fp32 accumulation (llmc/matmul.cuh's
//   matmul_forward). In CUTLASS terms: A row-major (K-major), B column-major (K-major), D row-major.
//
// Configurations (tile M x N x K, cluster, schedule), each a separate kernel:
//   coop 128x256: 128x256x64, cluster 2x1, cooperative (both consumer warpgroups on one 128-row tile)
//   coop 256x128: 256x128x64, cluster 2x1, cooperative
//   pingpong 128x128: 128x128x64, cluster 1x2, ping-pong (the consumer warpgroups alternate tiles, so one's epilogue
//     overlaps the other's mainloop)
//   "sw8": the same kernel with the persistent scheduler's swizzle at 8 (tiles visited in bands, for L2 reuse);
//   "1x2": cluster 1x2 instead of 2x1.
// The CUTLASS headers come from the nvidia-cutlass wheel (`make cutlass` in the repo root puts them in .deps/).
//
// Checks (common.h's validate: relative error norm, every element finite): each configuration against a CPU
// reference in double (every row of a small product, a few rows of the 1B qkv product and of a classifier chunk),
// and against cuBLASLt's whole output on the same products. Outputs are poisoned (NaN) before each check.
// Timing: the median of 50 back-to-back runs per shape and kernel, cuBLASLt first then each CUTLASS kernel, then all
// again in reverse order (the GPU runs at its power cap in these, so order matters). Random inputs: at the cap, the
// operands' bits move the speed (constant inputs ran 15% faster in a probe, dev/NOTES.md).
//
// Measured on an NVIDIA H100 80GB HBM3 (700 W), TFLOP/s, forward pass / reverse pass of one run (CUTLASS 4.2.0):
//   shape (M, N, K)             cuBLASLt    best CUTLASS configuration
//   qkv (16384, 3072, 2048)     795 / 674   coop 128x256: 738 / 598
//   wo (16384, 2048, 2048)      718 / 631   coop 128x256: 709 / 612; pingpong 128x128: 652 / 681
//   w13 (16384, 16384, 2048)    704 / 654   coop 256x128 1x2 sw8: 633 / 670; coop 128x256 sw8: 631 / 633
//   w2 (16384, 2048, 8192)      696 / 676   coop 256x128 1x2 sw8: 763 / 697
//   lm_head (2093, 128256, 2048) 670 / 650  coop 128x256: 580 / 635
// Two earlier runs without the 1x2 kernels gave cuBLASLt 765 / 699 and 771 / 684 on w13 against 629-642 for the
// best CUTLASS kernel. Every CUTLASS output was bit-identical to cuBLASLt's (relative error 0: the same k order).
// The same kernel moves 5-15% between the two passes (the power cap), so single comparisons are loose. Still, no
// configuration here is reliably ahead of cuBLASLt on w13, the product a SwiGLU epilogue would go into. A fused
// SwiGLU would save the separate pass, about 1-2 ms of the 1B step; a w13 product 5-10% slower costs 1.2-2.5 ms. So it is not
// built on these kernels (dev/NOTES.md, "Second round, fifth part").
//
// Build: make -C dev/cuda bin/matmul_cutlass (bf16 only; the fp32 build prints that and exits 0)
// Run:   ./matmul_cutlass
#include "common.h"
#include "../../llmc/matmul.cuh"

#if defined(ENABLE_FP32)
int main() {
    printf("matmul_cutlass: bf16 only (CUTLASS against cuBLASLt on the bf16 trainer's shapes); nothing to do\n");
    return 0;
}
#else

#include <array>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "cutlass_gemm.h"

// One CUTLASS GEMM configuration: tile shape, cluster shape, mainloop and epilogue schedules.
template <int TILE_M, int TILE_N, int CLUSTER_M, int CLUSTER_N, class MainloopSchedule, class EpilogueSchedule,
          int SWIZZLE = 1>
struct CutlassMatmul {
    using Element = cutlass::bfloat16_t;
    using TileShape = cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N>, cute::_64>;
    using ClusterShape = cute::Shape<cute::Int<CLUSTER_M>, cute::Int<CLUSTER_N>, cute::_1>;
    static constexpr int ALIGN = 8;  // elements per 16 bytes
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, cutlass::layout::RowMajor, ALIGN,
        Element, cutlass::layout::RowMajor, ALIGN, EpilogueSchedule>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, ALIGN, Element,
        cutlass::layout::ColumnMajor, ALIGN, float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        MainloopSchedule>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

    CutlassGemm<Gemm> gemm;

    // Prepares out = inp . weight^T for these pointers and sizes; false if CUTLASS cannot run it.
    bool setup(floatX* out, const floatX* inp, const floatX* weight, int M, int N, int K) {
        using StrideA = typename Kernel::StrideA;
        using StrideB = typename Kernel::StrideB;
        using StrideC = typename Kernel::StrideC;
        using StrideD = typename Kernel::StrideD;
        typename Gemm::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGemm,
            {M, N, K, 1},
            {reinterpret_cast<const Element*>(inp), cutlass::make_cute_packed_stride(StrideA{}, {M, K, 1}),
             reinterpret_cast<const Element*>(weight), cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1})},
            {{1.0f, 0.0f},
             reinterpret_cast<const Element*>(out), cutlass::make_cute_packed_stride(StrideC{}, {M, N, 1}),
             reinterpret_cast<Element*>(out), cutlass::make_cute_packed_stride(StrideD{}, {M, N, 1})}};
        args.scheduler.max_swizzle_size = SWIZZLE;  // tiles visited in SWIZZLE-wide bands, for L2 reuse
        return gemm.initialize(args);
    }
    void run() { gemm.run(); }
};

using Coop128x256 = CutlassMatmul<128, 256, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                  cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Coop256x128 = CutlassMatmul<256, 128, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                  cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Pingpong128x128 = CutlassMatmul<128, 128, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                      cutlass::epilogue::TmaWarpSpecialized>;
using Coop128x256Swizzle8 = CutlassMatmul<128, 256, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                          cutlass::epilogue::TmaWarpSpecializedCooperative, 8>;
using Coop256x128Swizzle8 = CutlassMatmul<256, 128, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                          cutlass::epilogue::TmaWarpSpecializedCooperative, 8>;
using Coop128x256Cluster1x2Swizzle8 = CutlassMatmul<128, 256, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                                   cutlass::epilogue::TmaWarpSpecializedCooperative, 8>;
using Coop256x128Cluster1x2Swizzle8 = CutlassMatmul<256, 128, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                                   cutlass::epilogue::TmaWarpSpecializedCooperative, 8>;
using Pingpong128x128Swizzle8 = CutlassMatmul<128, 128, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::TmaWarpSpecialized, 8>;

// Each configuration behind one interface, so the checks and the timing loop over them.
struct Variant {
    const char* name;
    bool (*setup)(floatX*, const floatX*, const floatX*, int, int, int);
    void (*run)();
};
template <class Config>
Variant make_variant(const char* name) {
    static Config config;
    return {name, [](floatX* o, const floatX* i, const floatX* w, int M, int N, int K) { return config.setup(o, i, w, M, N, K); },
            [] { config.run(); }};
}

// bf16 outputs of fp32 sums: one rounding (2^-9 relative at most, ~2^-10 as a norm) plus the summation order.
constexpr double TOLERANCE = 4e-3;

// Every variant against the CPU (in double) on cpu_rows rows of an (M, N, K) product, and against cuBLASLt on all
// of it; cuBLASLt itself against the CPU too.
static void validate_shape(const std::vector<Variant>& variants, int M, int N, int K, int cpu_rows) {
    std::vector<float> inp = round_to_floatX(random_floats((size_t)M * K, 11, 1.0f));
    std::vector<float> weight = round_to_floatX(random_floats((size_t)N * K, 12, 0.05f));
    floatX* d_inp = device_from_host<floatX>(inp);
    floatX* d_weight = device_from_host<floatX>(weight);
    floatX *d_out, *d_ref;
    cudaCheck(cudaMalloc(&d_out, (size_t)M * N * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_ref, (size_t)M * N * sizeof(floatX)));
    poison(d_ref, (size_t)M * N * sizeof(floatX));
    matmul_forward(d_ref, d_inp, d_weight, M, K, N, 0);
    std::vector<float> ref = host_from_device(d_ref, (size_t)M * N);
    std::vector<int> rows;  // spread over M, first and last included
    for (int i = 0; i < cpu_rows; i++) rows.push_back((int)((long long)i * (M - 1) / std::max(cpu_rows - 1, 1)));
    auto rows_of = [&](const std::vector<float>& full) {
        std::vector<float> part;
        for (int r : rows) part.insert(part.end(), full.begin() + (size_t)r * N, full.begin() + (size_t)(r + 1) * N);
        return part;
    };
    std::vector<float> cpu;
    for (int r : rows) {
        for (int n = 0; n < N; n++) {
            double sum = 0.0;
            for (int k = 0; k < K; k++) sum += (double)inp[(size_t)r * K + k] * weight[(size_t)n * K + k];
            cpu.push_back((float)sum);
        }
    }
    printf(" (%d, %d, %d), %d rows on the CPU\n", M, N, K, (int)rows.size());
    validate("cuBLASLt vs CPU", rows_of(ref), cpu, TOLERANCE);
    for (const Variant& v : variants) {
        poison(d_out, (size_t)M * N * sizeof(floatX));
        char name[64];
        if (!v.setup(d_out, d_inp, d_weight, M, N, K)) {
            printf("  %s cannot run this shape: FAIL\n", v.name);
            g_failures++;
            continue;
        }
        v.run();
        cudaCheck(cudaDeviceSynchronize());
        std::vector<float> out = host_from_device(d_out, (size_t)M * N);
        snprintf(name, sizeof(name), "%s vs CPU", v.name);
        validate(name, rows_of(out), cpu, TOLERANCE);
        snprintf(name, sizeof(name), "%s vs cuBLASLt", v.name);
        validate(name, out, ref, TOLERANCE);
    }
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_weight));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_ref));
}

// TFLOP/s of cuBLASLt and of each variant on one shape, in the given order.
static void time_shape(const char* label, const std::vector<Variant>& variants, int M, int N, int K, bool reverse,
                       std::vector<double>& tflops) {
    floatX* d_inp = device_random<floatX>((size_t)M * K, 21, 1.0f);
    floatX* d_weight = device_random<floatX>((size_t)N * K, 22, 0.05f);
    floatX* d_out;
    cudaCheck(cudaMalloc(&d_out, (size_t)M * N * sizeof(floatX)));
    const double flops = 2.0 * M * N * K;
    const int count = 1 + (int)variants.size();
    tflops.assign(count, 0.0);
    for (int j = 0; j < count; j++) {
        int i = reverse ? count - 1 - j : j;
        float ms;
        if (i == 0) {
            ms = benchmark_ms(50, [&] { matmul_forward(d_out, d_inp, d_weight, M, K, N, 0); });
        } else {
            if (!variants[i - 1].setup(d_out, d_inp, d_weight, M, N, K)) continue;
            ms = benchmark_ms(50, [&] { variants[i - 1].run(); });
        }
        tflops[i] = flops / (ms * 1e-3) / 1e12;
    }
    printf("  %-10s (%5d, %6d, %5d)%s", label, M, N, K, reverse ? " rev" : "    ");
    for (double t : tflops) printf(" %9.1f", t);
    printf("\n");
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_weight));
    cudaCheck(cudaFree(d_out));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9) {
        printf("matmul_cutlass: these kernels need Hopper (sm_90a); this GPU is sm_%d%d: skipped\n", prop.major,
               prop.minor);
        return 0;
    }
    matmul_init(0);
    std::vector<Variant> variants = {make_variant<Coop128x256>("coop 128x256"), make_variant<Coop256x128>("coop 256x128"),
                                     make_variant<Pingpong128x128>("pingpong 128x128"),
                                     make_variant<Coop128x256Swizzle8>("coop 128x256 sw8"),
                                     make_variant<Coop256x128Swizzle8>("coop 256x128 sw8"),
                                     make_variant<Pingpong128x128Swizzle8>("pingpong 128x128 sw8"),
                                     make_variant<Coop128x256Cluster1x2Swizzle8>("coop 128x256 1x2 sw8"),
                                     make_variant<Coop256x128Cluster1x2Swizzle8>("coop 256x128 1x2 sw8")};
    printf("validation\n");
    validate_shape(variants, 256, 384, 512, 256);     // every row on the CPU
    validate_shape(variants, 16384, 3072, 2048, 4);   // the 1B's qkv product
    validate_shape(variants, 2093, 128256, 2048, 2);  // a classifier chunk: M not a multiple of any tile

    printf("timing, TFLOP/s (median of 50 back-to-back runs): cuBLASLt");
    for (const Variant& v : variants) printf(" | %s", v.name);
    printf("\n");
    const char* names[] = {"qkv", "wo", "w13", "w2", "lm_head"};
    const std::array<int, 3> shapes[] = {{16384, 3072, 2048}, {16384, 2048, 2048}, {16384, 16384, 2048},
                                         {16384, 2048, 8192}, {2093, 128256, 2048}};
    std::vector<double> tflops;
    for (int pass = 0; pass < 2; pass++) {
        for (int s = 0; s < 5; s++) {
            time_shape(names[s], variants, shapes[s][0], shapes[s][1], shapes[s][2], pass == 1, tflops);
        }
    }
    matmul_destroy();
    return finish(argv[0]);
}
#endif
