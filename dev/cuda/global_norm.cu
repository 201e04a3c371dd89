// Deterministic global gradient norm: per-block partial sums of squares into fixed slots, then a fixed-order finish.
//
//   norm = sqrt(sum_i g_i^2)
//
// version 1 = llmc/global_norm.cuh. Checks: single buffers of awkward lengths, starting at misaligned offsets (so
// the scalar head/tail around the 16-byte body are used); several tensors in separate slots; a zero-length tensor;
// bit-identical results across repeated runs (with the partials poisoned in between).
//
// build: make -C dev/cuda bin/global_norm   run: dev/cuda/bin/global_norm
#include "common.h"
#include "../../llmc/global_norm.cuh"

// One buffer of `total` elements; tensors are (offset, count) pieces of it, each summed in its own slot.
static void test_case(const char* name, size_t total, const std::vector<std::pair<size_t, size_t>>& pieces,
                      uint64_t seed) {
    printf("%s: %zu piece(s) of a %zu-element buffer\n", name, pieces.size(), total);
    std::vector<float> v = round_to_floatX(random_floats(total, seed, 0.01f));
    floatX* d_v = device_from_host<floatX>(v);
    int n_slots = (int)pieces.size();
    float* d_partials;
    cudaCheck(cudaMalloc(&d_partials, global_norm_scratch_floats(n_slots) * sizeof(float)));
    float* d_norm;
    cudaCheck(cudaMalloc(&d_norm, 2 * sizeof(float)));
    double ref = 0.0;
    for (auto& p : pieces) ref += cpu::sum_squares(v.data() + p.first, p.second);
    ref = std::sqrt(ref);
    for (int run = 0; run < 2; run++) {
        poison(d_partials, global_norm_scratch_floats(n_slots) * sizeof(float));  // every used slot gets written
        for (int s = 0; s < n_slots; s++) global_norm_squared(d_partials, d_v + pieces[s].first, pieces[s].second, s, 0);
        global_norm_finish(d_norm + run, d_partials, n_slots, 0);
    }
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> got = host_from_device(d_norm, 2);
    // inputs are exact in both precisions and the sum is fp32 either way: a tight tolerance in both builds
    validate("norm", {got[0]}, {(float)ref}, 1e-5);
    validate_bitwise("determinism", d_norm, d_norm + 1, 1);
    cudaCheck(cudaFree(d_v));
    cudaCheck(cudaFree(d_partials));
    cudaCheck(cudaFree(d_norm));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    test_case("one element", 1, {{0, 1}}, 1);
    test_case("37 elements", 37, {{0, 37}}, 2);
    test_case("misaligned start", 1003, {{3, 1000}}, 3);
    test_case("large, misaligned", (1 << 22) + 13, {{1, (1 << 22) + 11}}, 4);
    test_case("three tensors + empty", 5000, {{0, 1003}, {1003, 0}, {1003, 48}, {1051, 3949}}, 5);
    test_case("more elements than threads x 8", 3 * 1024 * 256 * 8 + 5, {{0, 3 * 1024 * 256 * 8 + 5}}, 6);

    // timing: one call over a Llama 3.2 1B-sized gradient buffer (1.24e9 elements)
    size_t n = 1235814400;
    printf("timing n=%zu\n", n);
    floatX* d_g = device_random<floatX>(n, 7, 1e-3f);
    float *d_partials, *d_norm;
    cudaCheck(cudaMalloc(&d_partials, global_norm_scratch_floats(1) * sizeof(float)));
    cudaCheck(cudaMalloc(&d_norm, sizeof(float)));
    float ms = benchmark_ms(10, [&] {
        global_norm_squared(d_partials, d_g, n, 0, 0);
        global_norm_finish(d_norm, d_partials, 1, 0);
    });
    report_bandwidth("squared + finish", ms, (double)n * sizeof(floatX));
    cudaCheck(cudaFree(d_g));
    cudaCheck(cudaFree(d_partials));
    cudaCheck(cudaFree(d_norm));
    return finish(argv[0]);
}
