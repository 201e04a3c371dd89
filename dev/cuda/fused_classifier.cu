// Fused softmax + cross-entropy + dlogits (in place on floatX logits), validated against the CPU reference
// (cpu::cross_entropy_row in dev/cpu/llama3_cpu.h) and timed.
//
//   losses[n] = logsumexp(x[n, :]) - x[n, target[n]]        (0 where target < 0)
//   dlogits[n, :] = (softmax(x[n, :]) - onehot(target[n])) * dloss       (0 where target < 0)
//
// Versions (llmc/fused_classifier.cuh holds 2, as its fallback, and 3). H100, N = 2048, V = 128256, bf16, loss +
// dlogits (bandwidth counts one read and one write of the logits):
//   version 1, two passes, one 16-byte load per thread at a time: 0.552 ms (1905 GB/s)
//   version 2, two passes, four loads issued before use: 0.496 ms (2117 GB/s); 0.483-0.485 ms in session 16
//   tried, not kept: a grid of one block per SM looping over rows, so that the rows in flight fit in L2 for pass 2:
//   0.590 ms one load at a time, 0.518 ms with four.
//   version 3, the row read once and held on chip (registers + shared memory), max then sum of exponentials:
//   0.372-0.376 ms (2791-2827 GB/s) in three rounds alternating with version 2; loss only 0.184-0.191 ms against
//   0.212-0.214. 4 vectors per thread in registers (0.372 ms) beat 6 (0.376 ms); 8 spill. These timings are of a
//   --use_fast_math build, as the trainer is built; with this directory's Makefile flags (exact expf) version 3 does
//   more arithmetic per byte and the gap narrows: 0.498-0.499 -> 0.428-0.429 ms (three rounds).
//
// Odd V (259, 1003) makes every other row start misaligned, exercising the scalar head and tail around the 16-byte
// body; V = 128256 is Llama 3's vocabulary; V = 1 and V = 7 are shorter
// than one vector. Targets of -1 are ignored, as a loss mask makes them (every fifth row, or every row), and dloss is
// 1 / the rows that count, as the trainer uses it. Logits are scaled so the softmax is far from uniform.
//
// build: make -C dev/cuda bin/fused_classifier   run: dev/cuda/bin/fused_classifier [check [version]]
#include "common.h"
#include "../../llmc/fused_classifier.cuh"

// version 2 is the two-pass kernel (called directly, for every V); version 3 is llmc's fused_classifier, which runs
// the on-chip kernel where the row fits (V = 2048 and 128256 in bf16) and the two-pass kernel elsewhere.
static void classifier_version(int version, floatX* logits, float* losses, float dloss, const int* targets, int N,
                               int V, bool write_dlogits) {
    if (version == 2) {
        classifier_two_pass_kernel<<<N, CLASSIFIER_BLOCK>>>(logits, losses, dloss, targets, V, write_dlogits);
        cudaCheckLaunch();
    } else {
        fused_classifier(logits, losses, dloss, targets, N, V, write_dlogits, 0);
    }
}

// ignore_every: every ignore_every-th row (from row 2, or from row 0 when 1: all rows) has target -1
static void test_case(int version, int N, int V, uint64_t seed, int ignore_every = 5) {
    printf("version %d, N=%d V=%d, target -1 every %d rows\n", version, N, V, ignore_every);
    size_t NV = (size_t)N * V;
    std::vector<float> logits = round_to_floatX(random_floats(NV, seed, 3.0f));
    std::vector<int> targets = random_ints(N, V, seed + 1);
    for (int n = ignore_every == 1 ? 0 : 2; n < N; n += ignore_every) targets[n] = -1;
    int counted = 0;
    for (int t : targets) counted += t >= 0;
    float dloss = 1.0f / std::max(counted, 1);
    std::vector<float> ref_loss(N), ref_dlogits(NV);
    for (int n = 0; n < N; n++)
        ref_loss[n] = (float)cpu::cross_entropy_row(&ref_dlogits[(size_t)n * V], &logits[(size_t)n * V], targets[n], V,
                                                    dloss);

    int* d_targets;
    cudaCheck(cudaMalloc(&d_targets, N * sizeof(int)));
    cudaCheck(cudaMemcpy(d_targets, targets.data(), N * sizeof(int), cudaMemcpyHostToDevice));
    float* d_losses;
    cudaCheck(cudaMalloc(&d_losses, N * sizeof(float)));

    // loss only: the logits must be left exactly as they were
    floatX* d_logits = device_from_host<floatX>(logits);
    floatX* d_logits_orig = device_from_host<floatX>(logits);
    poison(d_losses, N * sizeof(float));
    classifier_version(version, d_logits, d_losses, dloss, d_targets, N, V, false);
    cudaCheck(cudaDeviceSynchronize());
    validate("losses (no dlogits)", host_from_device(d_losses, N), ref_loss);
    validate_bitwise("logits untouched", d_logits, d_logits_orig, NV);

    // loss and dlogits in place
    poison(d_losses, N * sizeof(float));
    classifier_version(version, d_logits, d_losses, dloss, d_targets, N, V, true);
    cudaCheck(cudaDeviceSynchronize());
    validate("losses", host_from_device(d_losses, N), ref_loss);
    validate("dlogits", host_from_device(d_logits, NV), ref_dlogits);

    cudaCheck(cudaFree(d_targets));
    cudaCheck(cudaFree(d_losses));
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_logits_orig));
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);
    // "check [version]": validation only (for the sanitizers), of one version or both
    const bool check_only = argc > 1 && strcmp(argv[1], "check") == 0;
    std::vector<int> versions = {2, 3};
    if (check_only && argc > 2) versions = {atoi(argv[2])};
    for (int version : versions) {
        test_case(version, 37, 259, 1);
        test_case(version, 37, 1003, 2);
        test_case(version, 13, 128256, 3);
        test_case(version, 9, 7, 4);
        test_case(version, 4, 1, 5);
        test_case(version, 16, 2048, 6);
        test_case(version, 8, 1003, 7, 1);  // every row masked: losses and dlogits all zero
        test_case(version, 300, 128256, 8);  // several batches of loads per thread, with odd rows
        test_case(version, 5, 128256, 9, 1);  // every row masked, on the on-chip path
        test_case(version, 3, 40000, 10);     // on chip: registers partly filled, a short shared-memory part
    }
    if (check_only) return finish(argv[0]);

    // timing: N = 2048 rows of Llama 3's vocabulary
    int N = 2048, V = 128256;
    printf("timing N=%d V=%d\n", N, V);
    size_t NV = (size_t)N * V;
    floatX* d_logits = device_random<floatX>(NV, 9);
    std::vector<int> targets = random_ints(N, V, 10);
    int* d_targets;
    cudaCheck(cudaMalloc(&d_targets, N * sizeof(int)));
    cudaCheck(cudaMemcpy(d_targets, targets.data(), N * sizeof(int), cudaMemcpyHostToDevice));
    float* d_losses;
    cudaCheck(cudaMalloc(&d_losses, N * sizeof(float)));
    // minimum traffic: read the logits once, write the dlogits once (version 2's pass 2 re-read is partly from L2)
    for (int round = 0; round < 3; round++) {
        for (int version : {2, 3}) {
            char name[64];
            float ms = benchmark_ms(20, [&] { classifier_version(version, d_logits, d_losses, 1.0f / N, d_targets, N, V,
                                                                 true); });
            snprintf(name, sizeof(name), "v%d loss + dlogits", version);
            report_bandwidth(name, ms, 2.0 * NV * sizeof(floatX));
            ms = benchmark_ms(20, [&] { classifier_version(version, d_logits, d_losses, 1.0f / N, d_targets, N, V,
                                                           false); });
            snprintf(name, sizeof(name), "v%d loss only", version);
            report_bandwidth(name, ms, 1.0 * NV * sizeof(floatX));
        }
    }
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_targets));
    cudaCheck(cudaFree(d_losses));
    return finish(argv[0]);
}
