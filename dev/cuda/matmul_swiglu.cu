// The fused SwiGLU matmuls of llmc/matmul_swiglu.cuh, checked and timed against the pair of kernels they replace:
// cuBLASLt's product (llmc/matmul.cuh), then swiglu_forward / swiglu_backward (llmc/swiglu.cuh).
//
//   forward:  h13 (N, 2F) = inp (N, C) w13^T, w13 = [w1; w3] (2F, C);   hact (N, F) = silu(g) u,  [g | u] = h13
//   backward: dhact (N, F) = dout (N, C) w2 (C, F), never stored;  dh13 = [dg | du] (N, 2F) and hact (recomputed)
//
// Checks, outputs poisoned with NaN first, on a small shape (F = 512: a partial last tile column in both directions;
// 3 k-blocks, fewer than the ring's stages; one tile per CTA), one with several tiles per CTA (and partial last tile
// columns) and the 1B's:
//   * bit for bit against the pair, every output: the fused kernel rounds each product tile to bf16 and computes the
//     SwiGLU pass from those values with the pair's expressions. The backward also without hact (nullptr, as the
//     trainer calls it without recompute): dh13 the same bits.
//   * against the CPU reference (dev/cpu/llama3_cpu.h) on sampled rows (every row of the two smaller shapes): the
//     product in double rounded to bf16, as the GPU rounds it, then the SwiGLU pass. Each element within a bound:
//     one bf16 unit in the last place (both sides round to nearest), plus how far the values before rounding may
//     lie apart: the fp32 product by K 2^-23 sum |a b| (one unit of fp32 per addition, truncation included), carried
//     through the SwiGLU expressions by their derivatives, plus 2^-16 of the terms' magnitude for fp32 evaluation.
// Timing, at the 1B's shape: rounds alternating the pair and the fused kernel, ms per call alone (median of 20
// single calls) and sustained (200 back to back after 100: the GPU at its power cap, as in training).
//
// History: ms per call at the 1B's shape (N = 16384, F = 8192, C = 2048), sustained, H100 80GB HBM3, fast-math
// builds as the trainer's; in parentheses the pair in the same rounds. v1-v7 were dev/cuda/matmul_wgmma.cu's
// versions 7 (the backward) and 9 (the forward), on its version 6's ping-pong kernel.
// v1 bwd: fragments stored from registers, g and u by 4-byte loads: 2.239-2.242 (1.272-1.325)
// v2 bwd: rows through a 16-row shared buffer, 16-byte loads of g and u, the epilogue spills: 1.783-1.795 (1.261-1.314)
// v3 bwd: a 32-row buffer, accumulators cleared per tile, 8 loads in flight (spills): 1.276-1.304 (1.266-1.306)
// v4 bwd: 4 loads in flight, no spill (2, 3: the same): 1.072-1.090 (1.250-1.317); in llmc/ 1.095-1.119 (1.246-1.332)
// v5 fwd: B's halves from w1's and w3's rows of the same 96 features: 1.670-1.686 (1.730-1.745); bwd 1.067-1.068
// v6: warpgroup index by shuffle, descriptors uniform: bwd 1.075-1.097 -> 1.033-1.044, fwd 1.696-1.717 -> 1.676-1.696
// v7: bwd ring of 5 stages, rows staged 16 at a time: 1.026-1.037 -> 1.008-1.016; in the trainer bwd 946 us, fwd 1552
// v8: pipeline.cuh's ring, layout struct and turns: bwd 1.017-1.040 (1.271-1.326), fwd 1.635-1.711 (1.726-1.776)
// Notes and variants tried, not kept (same measures):
//   v4 without the loads of g and u 0.946-0.961, without the stores 1.107-1.130; the product alone about 0.85
//   v4 with this Makefile's flags (exact expf): 1.355 against the pair's 1.309; the epilogue no longer hides
//   v5 groups of 4 / 16 unit rows: fwd 1.698-1.732 / 1.719-1.725, bwd 1.074-1.076 / 1.096-1.102 (8: A's rows in L2)
//   v5 groups of 1, 2, 32: fwd 1.79-2.04, bwd 1.14-1.23; 16 unit columns, row-major: fwd 1.696-1.725, bwd 1.078-1.082
//   v5 with the wgmmas issued per accumulator half (cuBLASLt's order): fwd 1.702-1.722 against 1.700-1.726
//   v5 in 2 x 2 clusters (A multicast too): 30 clusters fit, 120 of 132 SMs: fwd 1.80-1.93, bwd 1.18-1.28
//   v5 with tiles from a dynamic scheduler: fwd 1.752-1.775 against 1.702-1.721, bwd 1.123-1.150 against 1.081-1.100
//   v5 with 5 stages and 16-row staging: fwd 1.794-1.841 against 1.710-1.745, bwd 1.067-1.101 against 1.085-1.111
//   v5 with RoPE fused into the qkv product (N = 3072): 0.3666-0.3907 against cuBLASLt + rope_forward 0.3458-0.3500
//   v5 bwd with g and u prefetched into L2 before the epilogue: 1.138-1.197 against 1.071-1.094
//   v5 with cache hints (.cs, .cg) on the epilogue's loads and stores: bwd 1.072-1.103, fwd 1.658-1.712 (no change)
//   v5 under ncu: each k-block rebuilt its 16 descriptors per thread and moved them one R2UR at a time (hence v6)
//   v7 fwd with 5 stages and 16-row staging too: 1.713-1.744 against 1.675-1.714 (the forward keeps 4 and 32)
//   v8 against v7 in alternating runs of the two builds: bwd 1.017-1.040 against 1.036-1.081, fwd 1.635-1.711
//   against 1.649-1.711; v8 has no spill (v7 bwd: 8 bytes) and 88 instructions per k-block in the mainloop (95, 94)
//
// Build: make -C dev/cuda bin/matmul_swiglu (bf16 only; the fp32 build prints that and exits 0)
// Run:   ./matmul_swiglu [rounds [forward | backward]]   the checks, then `rounds` timing rounds (default 1) of both
//                                                         directions or the one named
//        ./matmul_swiglu small                            the two smaller shapes' checks only (for compute-sanitizer)
#include "common.h"
#include "../../llmc/matmul.cuh"

#if defined(ENABLE_FP32)
int main() {
    printf("matmul_swiglu: bf16 only (the fused kernels are the bf16 trainer's); nothing to do\n");
    return 0;
}
#else

#include <cfloat>

#include "../../llmc/matmul_swiglu.cuh"
#include "../../llmc/swiglu.cuh"

struct Shape {
    const char* name;
    int N, F, C;
    int cpu_rows;  // rows checked against the CPU (N: all)
};

// How far the fp32 product may lie from the exact one, per unit of sum |a b|: K additions, each off by at most one
// unit in the last place of fp32 (2^-23 relative: truncating tensor-core adders included).
static double accumulation_error(int K) { return K * std::ldexp(1.0, -23); }
// The fp32 evaluation of a SwiGLU expression (fast-math exp and division), relative to its terms' magnitude.
constexpr double EVALUATION_ERROR = 1.0 / 65536;

// One unit in the last place of a bf16 value of magnitude |x| (8 significant bits), at least that of the smallest
// normal.
static double bf16_ulp(double x) {
    int e;
    std::frexp(std::max(std::fabs(x), (double)FLT_MIN), &e);  // |x| = m 2^e, 0.5 <= m < 1
    return std::ldexp(1.0, e - 8);
}
// The bound on |gpu - cpu| for a bf16 output whose two values before rounding lie at most `apart` apart: half a unit
// in the last place from each side's rounding, at the larger magnitude, plus `apart`.
static double bf16_bound(double ref, double apart) { return bf16_ulp(std::fabs(ref) + apart) + apart; }

// Every element within its bound and finite; prints the largest |gpu - cpu| / bound. Counts a failure otherwise.
static void validate_bounded(const char* name, const std::vector<float>& gpu, const std::vector<float>& cpu,
                             const std::vector<double>& bound) {
    size_t over = 0, non_finite = 0;
    double worst = 0.0;
    for (size_t i = 0; i < cpu.size(); i++) {
        if (!std::isfinite(gpu[i])) {
            non_finite++;
            continue;
        }
        const double ratio = std::fabs((double)gpu[i] - cpu[i]) / bound[i];
        worst = std::max(worst, ratio);
        over += ratio > 1.0;
    }
    const bool ok = over == 0 && non_finite == 0;
    printf("  %-28s max |err| / bound %.3f  over %zu / %zu  non_finite %zu  %s\n", name, worst, over, cpu.size(),
           non_finite, ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
}

// The rows checked against the CPU: all, or a sample.
static std::vector<int> cpu_rows(const Shape& s, uint64_t seed) {
    if (s.cpu_rows == s.N) {
        std::vector<int> all(s.N);
        for (int r = 0; r < s.N; r++) all[r] = r;
        return all;
    }
    return random_ints(s.cpu_rows, s.N, seed);
}

// Rows `rows` of a (height x width) device matrix, on the host.
static std::vector<float> host_rows(const floatX* d, size_t height, int width, const std::vector<int>& rows) {
    const std::vector<float> all = host_from_device(d, height * width);
    std::vector<float> out;
    out.reserve(rows.size() * width);
    for (int r : rows) out.insert(out.end(), all.begin() + (size_t)r * width, all.begin() + (size_t)(r + 1) * width);
    return out;
}
static std::vector<float> absolute(const std::vector<float>& v) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); i++) out[i] = std::fabs(v[i]);
    return out;
}

// The forward against the CPU on sampled rows (file comment).
static void forward_against_cpu(const Shape& s, const floatX* inp, const floatX* w13, const floatX* h13,
                                const floatX* hact) {
    const int F = s.F, C = s.C;
    const std::vector<int> rows = cpu_rows(s, 43);
    const int R = (int)rows.size();
    const std::vector<float> x = host_rows(inp, s.N, C, rows), w = host_from_device(w13, 2 * (size_t)F * C);
    std::vector<float> product((size_t)R * 2 * F), magnitude((size_t)R * 2 * F), hact_cpu((size_t)R * F);
    cpu::matmul_forward(product.data(), x.data(), w.data(), R, C, 2 * F);
    cpu::matmul_forward(magnitude.data(), absolute(x).data(), absolute(w).data(), R, C, 2 * F);
    const std::vector<float> h13_cpu = round_to_floatX(product);
    cpu::swiglu_forward(hact_cpu.data(), h13_cpu.data(), R, F);
    std::vector<double> h13_bound(h13_cpu.size()), hact_bound(hact_cpu.size());
    for (size_t i = 0; i < h13_cpu.size(); i++) {
        h13_bound[i] = bf16_bound(product[i], accumulation_error(C) * magnitude[i]);
    }
    for (int r = 0; r < R; r++) {
        for (int f = 0; f < F; f++) {
            const size_t gi = (size_t)r * 2 * F + f, ui = gi + F;
            const double g = h13_cpu[gi], u = h13_cpu[ui], sg = cpu::sigmoid(g);
            const double apart = std::fabs(u * sg * (1.0 + g * (1.0 - sg))) * h13_bound[gi] +
                                 std::fabs(g * sg) * h13_bound[ui] + EVALUATION_ERROR * std::fabs(g * sg * u);
            hact_bound[(size_t)r * F + f] = bf16_bound(hact_cpu[(size_t)r * F + f], apart);
        }
    }
    validate_bounded("h13 against the CPU", host_rows(h13, s.N, 2 * F, rows), h13_cpu, h13_bound);
    validate_bounded("hact against the CPU", host_rows(hact, s.N, F, rows), hact_cpu, hact_bound);
}

// The backward against the CPU on sampled rows (file comment).
static void backward_against_cpu(const Shape& s, const floatX* dout, const floatX* w2, const floatX* h13_in,
                                 const floatX* dh13, const floatX* hact) {
    const int F = s.F, C = s.C;
    const std::vector<int> rows = cpu_rows(s, 44);
    const int R = (int)rows.size();
    const std::vector<float> d = host_rows(dout, s.N, C, rows), w = host_from_device(w2, (size_t)C * F);
    const std::vector<float> h13 = host_rows(h13_in, s.N, 2 * F, rows);
    std::vector<float> product((size_t)R * F), magnitude((size_t)R * F);
    std::vector<float> dh13_cpu((size_t)R * 2 * F), hact_cpu((size_t)R * F);
    cpu::matmul_backward_input(product.data(), d.data(), w.data(), R, F, C);
    cpu::matmul_backward_input(magnitude.data(), absolute(d).data(), absolute(w).data(), R, F, C);
    const std::vector<float> dhact_cpu = round_to_floatX(product);
    cpu::swiglu_backward(dh13_cpu.data(), dhact_cpu.data(), h13.data(), R, F);
    cpu::swiglu_forward(hact_cpu.data(), h13.data(), R, F);
    std::vector<double> dh13_bound(dh13_cpu.size()), hact_bound(hact_cpu.size());
    for (int r = 0; r < R; r++) {
        for (int f = 0; f < F; f++) {
            const size_t i = (size_t)r * F + f, gi = (size_t)r * 2 * F + f, ui = gi + F;
            const double dhact = dhact_cpu[i], g = h13[gi], u = h13[ui], sg = cpu::sigmoid(g);
            // dhact is the only input the two sides may hold differently (g and u are the same bf16 values)
            const double dhact_apart = bf16_bound(product[i], accumulation_error(C) * magnitude[i]);
            const double dg_slope = u * sg * (1.0 + g * (1.0 - sg)), du_slope = g * sg;
            const double dg_terms = std::fabs(dhact * u * sg) * (1.0 + std::fabs(g) * (1.0 - sg));
            dh13_bound[gi] = bf16_bound(dh13_cpu[gi], std::fabs(dg_slope) * dhact_apart +
                                                          EVALUATION_ERROR * dg_terms);
            dh13_bound[ui] = bf16_bound(dh13_cpu[ui], std::fabs(du_slope) * dhact_apart +
                                                          EVALUATION_ERROR * std::fabs(dhact * du_slope));
            hact_bound[i] = bf16_bound(hact_cpu[i], EVALUATION_ERROR * std::fabs(g * sg * u));
        }
    }
    validate_bounded("dh13 against the CPU", host_rows(dh13, s.N, 2 * F, rows), dh13_cpu, dh13_bound);
    validate_bounded("hact against the CPU", host_rows(hact, s.N, F, rows), hact_cpu, hact_bound);
}

// Rounds alternating the pair and the fused kernel: ms per call alone and sustained (file comment), and the
// product's TFLOP/s sustained.
template <typename Pair, typename Fused>
static void time_against_pair(int rounds, double flops, const char* pair_name, Pair pair, Fused fused) {
    if (rounds > 0) printf("  ms per call alone / sustained (the product's TFLOP/s sustained):\n");
    for (int round = 0; round < rounds; round++) {
        for (int variant = 0; variant < 2; variant++) {
            auto run = [&] {
                if (variant == 0) pair();
                else fused();
            };
            const float alone = benchmark_ms(20, run);
            for (int i = 0; i < 100; i++) run();
            const float sustained = benchmark_ms(1, [&] { for (int i = 0; i < 200; i++) run(); }) / 200.0f;
            printf("  round %d %-26s %.4f / %.4f ms (%.1f)\n", round, variant == 0 ? pair_name : "fused", alone,
                   sustained, flops / (sustained * 1e-3) / 1e12);
        }
    }
}

template <typename T>
static T* device_alloc(size_t n) {
    T* p;
    cudaCheck(cudaMalloc(&p, n * sizeof(T)));
    poison(p, n * sizeof(T));
    return p;
}

// The forward: h13 and hact against the pair (cuBLASLt's product, then swiglu_forward) and the CPU, then timed.
static void forward_case(const Shape& s, int rounds) {
    const int N = s.N, F = s.F, C = s.C;
    printf("forward, %s: N=%d F=%d C=%d\n", s.name, N, F, C);
    const size_t n_act = (size_t)N * F, n_h13 = 2 * n_act;
    floatX* inp = device_random<floatX>((size_t)N * C, 41, 1.0f);
    floatX* w13 = device_random<floatX>(2 * (size_t)F * C, 42, 0.1f);
    floatX *h13_pair = device_alloc<floatX>(n_h13), *hact_pair = device_alloc<floatX>(n_act);
    floatX *h13 = device_alloc<floatX>(n_h13), *hact = device_alloc<floatX>(n_act);
    auto pair = [&] {
        matmul_forward(h13_pair, inp, w13, N, C, 2 * F, 0);
        swiglu_forward(hact_pair, h13_pair, N, F, 0);
    };
    auto fused = [&] { matmul_swiglu_forward_fused(h13, hact, inp, w13, N, F, C, 0); };
    pair();
    fused();
    cudaCheck(cudaDeviceSynchronize());
    validate_bitwise("h13 against the pair", h13, h13_pair, n_h13);
    validate_bitwise("hact against the pair", hact, hact_pair, n_act);
    forward_against_cpu(s, inp, w13, h13, hact);
    time_against_pair(rounds, 2.0 * N * (2.0 * F) * C, "cuBLASLt + swiglu_forward", pair, fused);
    for (floatX* p : {inp, w13, h13_pair, hact_pair, h13, hact}) cudaCheck(cudaFree(p));
}

// The backward: dh13 and hact against the pair (cuBLASLt's product into dhact, then swiglu_backward) and the CPU,
// dh13 again without hact, then timed.
static void backward_case(const Shape& s, int rounds) {
    const int N = s.N, F = s.F, C = s.C;
    printf("backward, %s: N=%d F=%d C=%d\n", s.name, N, F, C);
    const size_t n_act = (size_t)N * F, n_h13 = 2 * n_act;
    floatX* dout = device_random<floatX>((size_t)N * C, 31, 1.0f);
    floatX* w2 = device_random<floatX>((size_t)C * F, 32, 1.0f);
    floatX* h13 = device_random<floatX>(n_h13, 33, 3.0f);
    floatX *dhact = device_alloc<floatX>(n_act), *dh13_pair = device_alloc<floatX>(n_h13);
    floatX *hact_pair = device_alloc<floatX>(n_act), *dh13 = device_alloc<floatX>(n_h13);
    floatX *hact = device_alloc<floatX>(n_act), *dh13_alone = device_alloc<floatX>(n_h13);
    auto pair = [&] {
        matmul_backward(dhact, nullptr, dout, nullptr, w2, N, F, C, false, 0);
        swiglu_backward(dh13_pair, hact_pair, dhact, h13, N, F, 0);
    };
    auto fused = [&] { matmul_swiglu_backward_fused(dh13, hact, dout, w2, h13, N, F, C, 0); };
    pair();
    fused();
    matmul_swiglu_backward_fused(dh13_alone, nullptr, dout, w2, h13, N, F, C, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate_bitwise("dh13 against the pair", dh13, dh13_pair, n_h13);
    validate_bitwise("hact against the pair", hact, hact_pair, n_act);
    validate_bitwise("dh13 without hact", dh13_alone, dh13_pair, n_h13);
    backward_against_cpu(s, dout, w2, h13, dh13, hact);
    time_against_pair(rounds, 2.0 * N * (double)F * C, "cuBLASLt + swiglu_backward", pair, fused);
    for (floatX* p : {dout, w2, h13, dhact, dh13_pair, hact_pair, dh13, hact, dh13_alone}) cudaCheck(cudaFree(p));
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);
    const bool small = argc > 1 && strcmp(argv[1], "small") == 0;
    const int rounds = argc > 1 && !small ? std::max(1, atoi(argv[1])) : 1;
    const bool forward = argc <= 2 || strcmp(argv[2], "forward") == 0;
    const bool backward = argc <= 2 || strcmp(argv[2], "backward") == 0;
    if (!forward && !backward) {
        fprintf(stderr, "usage: %s [rounds [forward | backward]] | small\n", argv[0]);
        return EXIT_FAILURE;
    }
    if (!matmul_swiglu_usable<SwigluForwardEpilogue>(0, 256, 512, 192)) {
        printf("%s: the fused kernels run on compute capability 9.0 (sm_90a) only; nothing to check here\n", argv[0]);
        return 0;
    }
    matmul_init(0);
    const Shape checked[] = {{"small", 256, 512, 192, 256}, {"several tiles per CTA", 2048, 2000, 512, 2048}};
    for (const Shape& s : checked) {
        if (forward) forward_case(s, 0);
        if (backward) backward_case(s, 0);
    }
    if (!small) {
        const Shape model = {"the 1B's", 16384, 8192, 2048, 8};
        if (forward) forward_case(model, rounds);
        if (backward) backward_case(model, rounds);
    }
    matmul_destroy();
    return finish(argv[0]);
}
#endif
