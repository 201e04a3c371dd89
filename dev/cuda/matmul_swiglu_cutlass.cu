// The MLP backward's first two steps in one kernel: the w2 dinp product with the SwiGLU backward in its epilogue
// (CUTLASS 3 epilogue visitor tree), against what the trainer runs: cuBLASLt's product (llmc/matmul.cuh) writing
// dhact, then llmc/swiglu.cuh's swiglu_backward pass.
//
//   dhact (N, F) = dres (N, C) . w2 (C, F)                     (the product; w2 row-major (C, F))
//   g = h13[:, :F], u = h13[:, F:], s = sigmoid(g)
//   dh13[:, :F] = dhact * u * s * (1 + g (1 - s)),  dh13[:, F:] = dhact * g * s,  hact = g * s * u
//
// Why: knock-outs of the 1B step at the power cap (dev/NOTES.md, "Second round, eighth part") put the separate
// SwiGLU backward pass at about 8.6 ms of the step, its whole kernel time. Fused, the epilogue reads g and u and
// writes dgate, dup and hact (1.34 GB per 1B layer); the trainer's path also writes dhact and reads it back (1.88 GB).
//
// The kernels: TMA + wgmma, warp-specialised (CUTLASS 4.2.0 builders). A = dres row-major (K-major), B = w2
// row-major (N-major), D = dgate (row stride 2F, into dh13). The epilogue is a DAG (Sm90TopologicalVisitor): the
// accumulator, two TMA loads of h13 (g at column 0, u at column F, row stride 2F), and three outputs: D, and two TMA
// stores (dup into dh13 at column F, hact). All math in fp32 on the unrounded accumulator (the trainer's path rounds
// dhact to bf16 first), rounded once to bf16 on store. Three configurations: cooperative 128x256 (cluster 2x1, the
// best plain GEMM in dev/cuda/matmul_cutlass.cu), and ping-pong 128x128 (cluster 1x2 or 2x1), where one consumer
// warpgroup's epilogue can run beside the other's mainloop.
//
// Measured on an NVIDIA H100 80GB HBM3 (700 W), ms per call at the 1B layer, runs of three rounds each, the
// trainer's path timed alternately in the same rounds ("alone": median of 50 single calls; "sustained": 200 back to
// back, at the power cap):
//   trainer's path (cuBLASLt + swiglu_backward)   1.19-1.35 alone, 1.20-1.36 sustained
//   fused, cooperative 128x256                    1.32-1.40 alone, 1.35-1.46 sustained
//   fused, ping-pong 128x128 cluster 1x2          1.22-1.42 alone, 1.37-1.52 sustained
//   fused, ping-pong 128x128 cluster 2x1          1.27-1.42 alone, 1.38-1.57 sustained
// Tried in the second run only, and removed:
//   fused, ping-pong 128x128 cluster 1x2, epilogue subtile 64x64   1.54-1.58 alone, 1.55-1.60 sustained
//   fused, cooperative 256x128 cluster 2x1, subtile 128x32         1.94-2.01 alone, 1.95 sustained
// Every configuration validates (dh13 within 2.8e-3 of the trainer's path, hact bit-identical). Sustained, every one
// is slower than the two kernels it replaces in every round; alone, ping-pong 1x2 was ahead in one round of nine
// (1.325 against 1.353 ms). The separate pass takes 0.53 ms (ncu), so the product about 0.7. By our
// count the fused epilogue moves 320 KB per 128x256 tile, about 14 us of one SM's share of HBM bandwidth, against
// about 20 us of mainloop; it costs more than the pass it saves. The cooperative schedule runs it after each
// tile's mainloop, and ping-pong did not hide it either. So the trainer keeps cuBLASLt and the separate pass
// (dev/NOTES.md, "Second round, eighth part").
//
// Checks: the fused outputs against a CPU reference in double on sampled rows, and against the trainer's path on
// the whole output (relative error norm; the two differ by dhact's rounding). Outputs poisoned first.
// Timing: the two paths alternately at the 1B shape (N = 16384, C = 2048, F = 8192): the median of 50 single calls,
// and the mean of 200 back-to-back calls.
//
// Build: make -C dev/cuda bin/matmul_swiglu_cutlass (bf16 only; the fp32 build prints that and exits 0)
#include "common.h"
#include "../../llmc/matmul.cuh"
#include "../../llmc/swiglu.cuh"

#if defined(ENABLE_FP32)
int main() {
    printf("matmul_swiglu_cutlass: bf16 only (a CUTLASS bf16 kernel against the bf16 trainer's path); nothing to do\n");
    return 0;
}
#else

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "cutlass_gemm.h"

// The epilogue's elementwise functions, on fragments (cutlass::Array<float, n>), the same expressions as
// swiglu_backward_kernel.
template <class T>
struct SwigluRecompute {  // hact = g * s * u
    CUTLASS_HOST_DEVICE T operator()(T const& g, T const& u) const {
        T out;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < int(T::kElements); i++) out[i] = g[i] * (1.0f / (1.0f + expf(-g[i]))) * u[i];
        return out;
    }
};
template <class T>
struct SwigluDup {  // dup = dhact * g * s
    CUTLASS_HOST_DEVICE T operator()(T const& d, T const& g) const {
        T out;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < int(T::kElements); i++) out[i] = d[i] * g[i] * (1.0f / (1.0f + expf(-g[i])));
        return out;
    }
};
template <class T>
struct SwigluDgate {  // dgate = dhact * u * s * (1 + g (1 - s))
    CUTLASS_HOST_DEVICE T operator()(T const& d, T const& g, T const& u) const {
        T out;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < int(T::kElements); i++) {
            float s = 1.0f / (1.0f + expf(-g[i]));
            out[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
        }
        return out;
    }
};

// One configuration of the fused kernel: tile, cluster, schedules, epilogue subtile.
template <int TILE_M, int TILE_N, int CLUSTER_M, int CLUSTER_N, class MainloopSchedule, class EpilogueSchedule,
          int EPI_M, int EPI_N>
struct FusedConfig {
    using Element = cutlass::bfloat16_t;
    static constexpr int ALIGN = 8;
    using TileShape = cute::Shape<cute::Int<TILE_M>, cute::Int<TILE_N>, cute::_64>;
    using ClusterShape = cute::Shape<cute::Int<CLUSTER_M>, cute::Int<CLUSTER_N>, cute::_1>;
    using EpilogueTile = cute::Shape<cute::Int<EPI_M>, cute::Int<EPI_N>>;  // small: five tensors are staged in smem
    using RowMajor = cutlass::layout::RowMajor;
    static constexpr auto RN = cutlass::FloatRoundStyle::round_to_nearest;

    using EpiDesc = cutlass::epilogue::collective::detail::EpilogueDescriptor<TileShape, EpilogueTile, Element,
                                                                               Element, EpilogueSchedule>;
    using LoadDesc = cutlass::epilogue::collective::detail::AuxLoadDescriptor<EpiDesc, RowMajor, Element>;
    using StoreDesc = cutlass::epilogue::collective::detail::AuxStoreDescriptor<EpiDesc, RowMajor, Element>;

    using Acc = cutlass::epilogue::fusion::Sm90AccFetch;
    using LoadH = cutlass::epilogue::fusion::Sm90AuxLoad<LoadDesc::Stages, typename EpiDesc::EpilogueTile, Element,
                                                         typename LoadDesc::Stride, typename LoadDesc::SmemLayoutAtom,
                                                         typename LoadDesc::CopyOpS2R>;
    using StoreH = cutlass::epilogue::fusion::Sm90AuxStore<StoreDesc::Stages, typename EpiDesc::EpilogueTile, Element,
                                                           RN, typename StoreDesc::Stride,
                                                           typename StoreDesc::SmemLayoutAtom,
                                                           typename StoreDesc::CopyOpR2S>;
    using Recompute = cutlass::epilogue::fusion::Sm90Compute<SwigluRecompute, float, float, RN>;
    using Dup = cutlass::epilogue::fusion::Sm90Compute<SwigluDup, float, float, RN>;
    using Dgate = cutlass::epilogue::fusion::Sm90Compute<SwigluDgate, Element, float, RN>;
    // nodes in topological order: 0 acc, 1 g, 2 u, 3 hact, 4 store hact, 5 dup, 6 store dup, 7 dgate (the output D)
    using Edges = cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<1, 2>, cute::seq<3>, cute::seq<0, 1>,
                              cute::seq<5>, cute::seq<0, 1, 2>>;
    using Callbacks = cutlass::epilogue::fusion::Sm90TopologicalVisitor<float, Edges, Acc, LoadH, LoadH, Recompute,
                                                                        StoreH, Dup, StoreH, Dgate>;

    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float, void,
        RowMajor, ALIGN, Element, RowMajor, ALIGN, EpilogueSchedule, Callbacks>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, RowMajor, ALIGN, Element, RowMajor, ALIGN, float,
        TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        MainloopSchedule>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using Coop128x256 = FusedConfig<128, 256, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                cutlass::epilogue::TmaWarpSpecializedCooperative, 128, 16>;
using Pingpong128x128 = FusedConfig<128, 128, 1, 2, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                    cutlass::epilogue::TmaWarpSpecialized, 64, 32>;
using Pingpong128x128Cluster2x1 = FusedConfig<128, 128, 2, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::TmaWarpSpecialized, 64, 16>;

// The fused kernel of one configuration for one set of pointers: dres (N, C), w2 (C, F), h13 (N, 2F) in; dh13
// (N, 2F), hact (N, F) out.
template <class Config>
struct FusedSwigluBackward {
    CutlassGemm<typename Config::Gemm> gemm;

    bool setup(floatX* dh13, floatX* hact, const floatX* dres, const floatX* w2, const floatX* h13, int N, int C,
               int F) {
        using Element = typename Config::Element;
        using Kernel = typename Config::Kernel;
        using StrideA = typename Kernel::StrideA;
        using StrideB = typename Kernel::StrideB;
        using StrideD = typename Kernel::StrideD;
        using StrideAux = typename Config::LoadDesc::Stride;
        const int64_t ld13 = 2 * (int64_t)F;
        StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, {N, F, 1});
        cute::get<0>(stride_d) = ld13;  // dgate and dup sit in the rows of dh13 (N, 2F)
        StrideAux stride_h13 = cutlass::make_cute_packed_stride(StrideAux{}, {N, F, 1});
        cute::get<0>(stride_h13) = ld13;
        StrideAux stride_hact = cutlass::make_cute_packed_stride(StrideAux{}, {N, F, 1});
        auto g = reinterpret_cast<const Element*>(h13), u = g + F;
        auto d_gate = reinterpret_cast<Element*>(dh13), d_up = d_gate + F;
        typename Config::Callbacks::Arguments fusion_args{
            {},                                               // 0 acc
            {g, Element(0), stride_h13},                      // 1 g
            {u, Element(0), stride_h13},                      // 2 u
            {},                                               // 3 hact
            {reinterpret_cast<Element*>(hact), stride_hact},  // 4 store hact
            {},                                               // 5 dup
            {d_up, stride_h13},                               // 6 store dup
            {}                                                // 7 dgate
        };
        typename Config::Gemm::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGemm,
            {N, F, C, 1},
            {reinterpret_cast<const Element*>(dres), cutlass::make_cute_packed_stride(StrideA{}, {N, C, 1}),
             reinterpret_cast<const Element*>(w2), cutlass::make_cute_packed_stride(StrideB{}, {F, C, 1})},
            {fusion_args, nullptr, stride_d, d_gate, stride_d}};
        return gemm.initialize(args);
    }
    void run() { gemm.run(); }
};

// The trainer's path: cuBLASLt writes dhact, then the SwiGLU backward pass.
static void trainer_path(floatX* dh13, floatX* hact, floatX* dhact, const floatX* dres, const floatX* w2,
                         const floatX* h13, int N, int C, int F) {
    matmul_backward(dhact, nullptr, dres, nullptr, w2, N, F, C, true, 0);
    swiglu_backward(dh13, hact, dhact, h13, N, F, 0);
}

struct Buffers {
    floatX *dres, *w2, *h13, *dh13, *hact, *dhact;
    Buffers(int N, int C, int F) {
        dres = device_random<floatX>((size_t)N * C, 21, 1.0f);
        w2 = device_random<floatX>((size_t)C * F, 22, 0.05f);
        h13 = device_random<floatX>((size_t)N * 2 * F, 23, 3.0f);
        cudaCheck(cudaMalloc(&dh13, (size_t)N * 2 * F * sizeof(floatX)));
        cudaCheck(cudaMalloc(&hact, (size_t)N * F * sizeof(floatX)));
        cudaCheck(cudaMalloc(&dhact, (size_t)N * F * sizeof(floatX)));
    }
    Buffers(const Buffers&) = delete;
    Buffers& operator=(const Buffers&) = delete;
    ~Buffers() {
        for (floatX* p : {dres, w2, h13, dh13, hact, dhact}) cudaCheck(cudaFree(p));
    }
};

// Validates the fused kernel at one shape: CPU reference in double on `sample_rows` rows (all rows if 0), and the
// trainer's path on everything.
template <class Fused>
static void validate_shape(Fused& fused_kernel, int N, int C, int F, int sample_rows) {
    printf("N=%d C=%d F=%d\n", N, C, F);
    Buffers buf(N, C, F);
    const size_t n13 = (size_t)N * 2 * F, nf = (size_t)N * F;
    poison(buf.dh13, n13 * sizeof(floatX));
    poison(buf.hact, nf * sizeof(floatX));
    if (!fused_kernel.setup(buf.dh13, buf.hact, buf.dres, buf.w2, buf.h13, N, C, F)) {
        printf("  CUTLASS cannot run this shape\n");
        g_failures++;
        return;
    }
    fused_kernel.run();
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> dh13 = host_from_device(buf.dh13, n13), hact = host_from_device(buf.hact, nf);

    // CPU reference on sampled rows
    std::vector<float> dres = host_from_device(buf.dres, (size_t)N * C), w2 = host_from_device(buf.w2, (size_t)C * F);
    std::vector<float> h13 = host_from_device(buf.h13, n13);
    std::vector<int> rows = sample_rows > 0 ? random_ints(sample_rows, N, 7) : std::vector<int>();
    if (sample_rows == 0)
        for (int n = 0; n < N; n++) rows.push_back(n);
    std::vector<float> got_dh13, ref_dh13, got_hact, ref_hact;
    for (int n : rows) {
        for (int f = 0; f < F; f++) {
            double d = 0.0;
            for (int c = 0; c < C; c++) d += (double)dres[(size_t)n * C + c] * w2[(size_t)c * F + f];
            double g = h13[(size_t)n * 2 * F + f], u = h13[(size_t)n * 2 * F + F + f];
            double s = 1.0 / (1.0 + std::exp(-g));
            ref_dh13.push_back((float)(d * u * s * (1.0 + g * (1.0 - s))));
            ref_dh13.push_back((float)(d * g * s));
            ref_hact.push_back((float)(g * s * u));
            got_dh13.push_back(dh13[(size_t)n * 2 * F + f]);
            got_dh13.push_back(dh13[(size_t)n * 2 * F + F + f]);
            got_hact.push_back(hact[(size_t)n * F + f]);
        }
    }
    validate("fused dh13 vs CPU", got_dh13, ref_dh13);
    validate("fused hact vs CPU", got_hact, ref_hact);

    // the trainer's path on the same inputs
    poison(buf.dh13, n13 * sizeof(floatX));
    poison(buf.hact, nf * sizeof(floatX));
    trainer_path(buf.dh13, buf.hact, buf.dhact, buf.dres, buf.w2, buf.h13, N, C, F);
    cudaCheck(cudaDeviceSynchronize());
    validate("fused dh13 vs trainer's path", dh13, host_from_device(buf.dh13, n13));
    validate("fused hact vs trainer's path", hact, host_from_device(buf.hact, nf));
}

// Validates one configuration, then times it against the trainer's path at the 1B layer, alternately.
template <class Config>
static void check_and_time(const char* name) {
    printf("--- %s\n", name);
    FusedSwigluBackward<Config> fused_kernel;
    validate_shape(fused_kernel, 300, 64, 128, 0);       // a partial tile in M, every row checked
    validate_shape(fused_kernel, 1000, 256, 640, 0);     // N and F not multiples of the tile
    validate_shape(fused_kernel, 16384, 2048, 8192, 4);  // the 1B layer, 4 rows against the CPU

    const int N = 16384, C = 2048, F = 8192;
    Buffers buf(N, C, F);
    if (!fused_kernel.setup(buf.dh13, buf.hact, buf.dres, buf.w2, buf.h13, N, C, F)) {
        printf("CUTLASS cannot run the timing shape\n");
        g_failures++;
        return;
    }
    const double flops = 2.0 * N * (double)C * F;
    auto trainer = [&] { trainer_path(buf.dh13, buf.hact, buf.dhact, buf.dres, buf.w2, buf.h13, N, C, F); };
    auto fused_run = [&] { fused_kernel.run(); };
    // each run alone (median of 50), then sustained: 200 back-to-back runs, which hold the GPU at its power cap
    auto sustained_ms = [](auto launch) {
        cudaEvent_t start, stop;
        cudaCheck(cudaEventCreate(&start));
        cudaCheck(cudaEventCreate(&stop));
        cudaCheck(cudaEventRecord(start));
        for (int i = 0; i < 200; i++) launch();
        cudaCheck(cudaEventRecord(stop));
        cudaCheck(cudaEventSynchronize(stop));
        float ms;
        cudaCheck(cudaEventElapsedTime(&ms, start, stop));
        cudaCheck(cudaEventDestroy(start));
        cudaCheck(cudaEventDestroy(stop));
        return ms / 200;
    };
    printf("timing N=%d C=%d F=%d (TFLOP/s counts the product's FLOPs only)\n", N, C, F);
    for (int round = 0; round < 3; round++) {
        float t_alone = benchmark_ms(50, trainer), f_alone = benchmark_ms(50, fused_run);
        float t_sus = sustained_ms(trainer), f_sus = sustained_ms(fused_run);
        printf("  round %d: trainer's path %.3f ms alone, %.3f sustained (%.0f TFLOP/s); fused %.3f alone, %.3f "
               "sustained (%.0f TFLOP/s)\n",
               round, t_alone, t_sus, flops / (t_sus * 1e-3) / 1e12, f_alone, f_sus, flops / (f_sus * 1e-3) / 1e12);
    }
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    matmul_init(0);
    check_and_time<Coop128x256>("cooperative 128x256, cluster 2x1, epilogue subtile 128x16");
    check_and_time<Pingpong128x128>("ping-pong 128x128, cluster 1x2, epilogue subtile 64x32");
    check_and_time<Pingpong128x128Cluster2x1>("ping-pong 128x128, cluster 2x1, epilogue subtile 64x16");
    matmul_destroy();
    return finish(argv[0]);
}
#endif
