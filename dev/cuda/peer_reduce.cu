// The sum of the copy-engine reduce-scatter (llmc/peer_reduce.cuh): every rank's part of a slice, added in rank order
// in fp32 and rounded once, optionally added into the gradient shard.
//
//   out[i] = round(p_0[i] + p_1[i] + ... + p_{N-1}[i])            (accumulate: out[i] = round(out[i] + that))
//
// version 2 = llmc/peer_reduce.cuh's sum_parts. Checks, each version bit for bit against the CPU's sums in the same
// order: 2, 3, 4 and 8 parts; lengths of 1, 1000 and past the grid's threads (the grid-stride loop); a fresh output
// (poisoned) and an output accumulated into (random, not zeros); parts that are not 16-byte aligned. The copies and
// flags between processes are checked by dev/test/test_multi_gpu.py (-E 1 against -E 0, bit for bit), as they need
// several GPUs.
// Timing: one layer's part of the 1B on 2 GPUs (half of 60,821,504 elements), two parts read, one written.
//
// version 1, H100 80GB HBM3 (2026-11-26): bf16 0.1418 ms (1286.8 GB/s), accumulated 0.2074 ms (1173.1 GB/s); fp32
// 0.1581 ms (2307.6 GB/s), 0.2152 ms (2260.7 GB/s). bf16 is bound by its 2-byte loads: at fp32's rate, 0.08 ms.
// version 2: 16-byte loads and stores (VEC16 elements a thread) where every part and the output are 16-byte aligned,
// the last n % VEC16 elements one a thread; a misaligned call goes to version 1's loop. The same sums, so the same
// bits. H100 80GB HBM3 (2026-11-26): bf16 0.0844 ms (2163.1 GB/s), accumulated 0.1051 ms (2315.1 GB/s); fp32 0.1469 ms
// (2483.5 GB/s), 0.1887 ms (2578.5 GB/s); version 1 in the same run 0.1413, 0.2078, 0.1556, 0.2130 ms. Floor at
// ~3 TB/s: 0.06 ms for the bf16 sum of 2 parts. In the trainer (1B, 2 H100s, -Z 1 and -Z 2, alternated, 2 rounds):
// the same losses as version 1; mean step 0.12 to 0.92 ms shorter in each pair (226 to 231 ms, about the spread
// between runs).
//
// build: make -C dev/cuda bin/peer_reduce   run: dev/cuda/bin/peer_reduce
#include "common.h"
#include "../../llmc/peer_reduce.cuh"

constexpr int MAX_PARTS = PeerReduce::MAX_RANKS;

static float round_floatX(float x) { return round_to_floatX({x})[0]; }

// ------------------------------------------------------------------------------------------------------- version 1
// One element a thread in a grid-stride loop: 2-byte loads in bf16.
__global__ void sum_parts_kernel_v1(floatX* out, PartPointers<MAX_PARTS> parts, int world, size_t n, bool accumulate) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float sum = to_float(parts.p[0][i]);
        for (int q = 1; q < world; q++) sum += to_float(parts.p[q][i]);
        floatX rounded = from_float<floatX>(sum);
        out[i] = accumulate ? from_float<floatX>(to_float(out[i]) + to_float(rounded)) : rounded;
    }
}

static void sum_parts_v1(floatX* out, const PartPointers<MAX_PARTS>& parts, int world, size_t n, bool accumulate,
                         cudaStream_t stream) {
    const size_t blocks = ceil_div<size_t>(n, 512);
    sum_parts_kernel_v1<<<(unsigned)(blocks < 1056 ? blocks : 1056), 512, 0, stream>>>(out, parts, world, n,
                                                                                      accumulate);
    cudaCheckLaunch();
}

using SumParts = void (*)(floatX*, const PartPointers<MAX_PARTS>&, int, size_t, bool, cudaStream_t);

// `shift`: the parts start that many elements into their buffers (1: not 16-byte aligned, version 2's fallback).
static void test_case(const char* name, SumParts sum, int world, size_t n, bool accumulate, size_t shift,
                      uint64_t seed) {
    printf("%s: %d parts of %zu elements%s%s\n", name, world, n, accumulate ? ", accumulated into the output" : "",
           shift ? ", misaligned" : "");
    std::vector<std::vector<float>> parts(world);
    PartPointers<MAX_PARTS> d_parts = {};
    std::vector<floatX*> owned(world);
    for (int q = 0; q < world; q++) {
        std::vector<float> padded = round_to_floatX(random_floats(n + shift, seed + q, 1.0f));
        parts[q].assign(padded.begin() + shift, padded.end());
        owned[q] = device_from_host<floatX>(padded);
        d_parts.p[q] = owned[q] + shift;
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
    sum(d_out, d_parts, world, n, accumulate, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate("sum, bit for bit", host_from_device(d_out, n), ref, 0.0);
    for (floatX* d : owned) cudaCheck(cudaFree(d));
    cudaCheck(cudaFree(d_out));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    const size_t past_grid = (size_t)1056 * 512 * VEC16 * 2 + 17;  // two turns of version 2's loop, a ragged end
    uint64_t seed = 1;
    const struct { const char* name; SumParts sum; } versions[] = {{"version 1", sum_parts_v1},
                                                                    {"version 2", sum_parts<MAX_PARTS>}};
    for (const auto& v : versions) {
        for (int world : {2, 3, 4, 8}) {
            for (size_t n : {(size_t)1, (size_t)1000, past_grid}) {
                for (bool accumulate : {false, true}) test_case(v.name, v.sum, world, n, accumulate, 0, seed += 10);
            }
        }
        for (bool accumulate : {false, true}) test_case(v.name, v.sum, 2, past_grid, accumulate, 1, seed += 10);
    }

    const size_t part = 60821504 / 2;  // llama3.2-1B: a layer's 60,821,504 weights, one rank's half
    printf("timing: 2 parts of %zu elements\n", part);
    floatX* d_a = device_random<floatX>(part, 3, 1e-3f);
    floatX* d_b = device_random<floatX>(part, 4, 1e-3f);
    floatX* d_out = device_random<floatX>(part, 5, 1e-3f);
    PartPointers<MAX_PARTS> two = {};
    two.p[0] = d_a;
    two.p[1] = d_b;
    for (const auto& v : versions) {
        printf("%s\n", v.name);
        float ms = benchmark_ms(20, [&] { v.sum(d_out, two, 2, part, false, 0); });
        report_bandwidth("sum of 2 parts", ms, 3.0 * part * sizeof(floatX));
        ms = benchmark_ms(20, [&] { v.sum(d_out, two, 2, part, true, 0); });
        report_bandwidth("sum of 2, accumulated", ms, 4.0 * part * sizeof(floatX));
    }
    cudaCheck(cudaFree(d_a));
    cudaCheck(cudaFree(d_b));
    cudaCheck(cudaFree(d_out));
    return finish(argv[0]);
}
