// The sum of the copy-engine reduce-scatter (llmc/peer_reduce.cuh): every rank's part of a slice, added in rank order
// in fp32 and rounded once, optionally added into the gradient shard.
//
//   out[i] = round(p_0[i] + p_1[i] + ... + p_{N-1}[i])            (accumulate: out[i] = round(out[i] + that))
//
// version 1 = llmc/peer_reduce.cuh's sum_parts. Checks, bit for bit against the CPU's sums in the same order: 2, 3, 4
// and 8 parts; lengths of 1, 1000 and past the grid's threads (the grid-stride loop); a fresh output (poisoned) and
// an output accumulated into (random, not zeros). The copies and flags between processes are checked by
// dev/test/test_multi_gpu.py (-E 1 against -E 0, bit for bit), as they need several GPUs.
// Timing: one layer's part of the 1B on 2 GPUs (half of 60,821,504 elements), two parts read, one written.
//
// version 1, H100 80GB HBM3 (2026-11-26): bf16 0.1418 ms (1286.8 GB/s), accumulated 0.2074 ms (1173.1 GB/s); fp32
// 0.1581 ms (2307.6 GB/s), 0.2152 ms (2260.7 GB/s). bf16 is bound by its 2-byte loads: at fp32's rate, 0.08 ms.
//
// build: make -C dev/cuda bin/peer_reduce   run: dev/cuda/bin/peer_reduce
#include "common.h"
#include "../../llmc/peer_reduce.cuh"

constexpr int MAX_PARTS = PeerReduce::MAX_RANKS;

static float round_floatX(float x) { return round_to_floatX({x})[0]; }

static void test_case(int world, size_t n, bool accumulate, uint64_t seed) {
    printf("%d parts of %zu elements%s\n", world, n, accumulate ? ", accumulated into the output" : "");
    std::vector<std::vector<float>> parts(world);
    PartPointers<MAX_PARTS> d_parts = {};
    std::vector<floatX*> owned(world);
    for (int q = 0; q < world; q++) {
        parts[q] = round_to_floatX(random_floats(n, seed + q, 1.0f));
        owned[q] = device_from_host<floatX>(parts[q]);
        d_parts.p[q] = owned[q];
    }
    std::vector<float> before = round_to_floatX(random_floats(n, seed + 100, 1.0f));
    std::vector<float> ref(n);
    for (size_t i = 0; i < n; i++) {
        float sum = parts[0][i];
        for (int q = 1; q < world; q++) sum += parts[q][i];
        ref[i] = accumulate ? round_floatX(before[i] + round_floatX(sum)) : round_floatX(sum);
    }
    floatX* d_out = device_from_host<floatX>(before);
    if (!accumulate) poison(d_out, n * sizeof(floatX));
    sum_parts(d_out, d_parts, world, n, accumulate, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate("sum, bit for bit", host_from_device(d_out, n), ref, 0.0);
    for (floatX* d : owned) cudaCheck(cudaFree(d));
    cudaCheck(cudaFree(d_out));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    const size_t past_grid = 1056 * 512 * 3 + 17;  // three turns of the grid-stride loop and a ragged end
    uint64_t seed = 1;
    for (int world : {2, 3, 4, 8}) {
        for (size_t n : {(size_t)1, (size_t)1000, past_grid}) {
            for (bool accumulate : {false, true}) test_case(world, n, accumulate, seed += 10);
        }
    }

    const size_t part = 60821504 / 2;  // llama3.2-1B: a layer's 60,821,504 weights, one rank's half
    printf("timing: 2 parts of %zu elements\n", part);
    floatX* d_a = device_random<floatX>(part, 3, 1e-3f);
    floatX* d_b = device_random<floatX>(part, 4, 1e-3f);
    floatX* d_out = device_random<floatX>(part, 5, 1e-3f);
    PartPointers<MAX_PARTS> two = {};
    two.p[0] = d_a;
    two.p[1] = d_b;
    float ms = benchmark_ms(20, [&] { sum_parts(d_out, two, 2, part, false, 0); });
    report_bandwidth("sum of 2 parts", ms, 3.0 * part * sizeof(floatX));
    ms = benchmark_ms(20, [&] { sum_parts(d_out, two, 2, part, true, 0); });
    report_bandwidth("sum of 2, accumulated", ms, 4.0 * part * sizeof(floatX));
    cudaCheck(cudaFree(d_a));
    cudaCheck(cudaFree(d_b));
    cudaCheck(cudaFree(d_out));
    return finish(argv[0]);
}
