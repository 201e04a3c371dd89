// Fused softmax + cross-entropy + dlogits (in place on floatX logits), validated against the CPU reference
// (cpu::cross_entropy_row in dev/cpu/llama3_cpu.h) and timed.
//
//   losses[n] = logsumexp(x[n, :]) - x[n, target[n]]        (0 where target < 0)
//   dlogits[n, :] = (softmax(x[n, :]) - onehot(target[n])) * dloss       (0 where target < 0)
//
// version 2 = llmc/fused_classifier.cuh. H100, N = 2048, V = 128256, bf16, loss + dlogits (bandwidth counts one read
// and one write of the logits):
//   version 1, one 16-byte load per thread at a time: 0.552 ms (1905 GB/s)
//   version 2, four loads issued before use: 0.496 ms (2117 GB/s)
//   tried, not kept: a grid of one block per SM looping over rows, so that the rows in flight fit in L2 for pass 2:
//   0.590 ms one load at a time, 0.518 ms with four.
//
// Odd V (259, 1003) makes every other row start misaligned, exercising the scalar head and tail around the 16-byte
// body; V = 128256 is Llama 3's vocabulary; V = 1 and V = 7 are shorter
// than one vector. Targets of -1 are ignored, as a loss mask makes them (every fifth row, or every row), and dloss is
// 1 / the rows that count, as the trainer uses it. Logits are scaled so the softmax is far from uniform.
//
// build: make -C dev/cuda bin/fused_classifier   run: dev/cuda/bin/fused_classifier
#include "common.h"
#include "../../llmc/fused_classifier.cuh"

// ignore_every: every ignore_every-th row (from row 2, or from row 0 when 1: all rows) has target -1
static void test_case(int N, int V, uint64_t seed, int ignore_every = 5) {
    printf("N=%d V=%d, target -1 every %d rows\n", N, V, ignore_every);
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
    fused_classifier(d_logits, d_losses, dloss, d_targets, N, V, false, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate("losses (no dlogits)", host_from_device(d_losses, N), ref_loss);
    validate_bitwise("logits untouched", d_logits, d_logits_orig, NV);

    // loss and dlogits in place
    poison(d_losses, N * sizeof(float));
    fused_classifier(d_logits, d_losses, dloss, d_targets, N, V, true, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate("losses", host_from_device(d_losses, N), ref_loss);
    validate("dlogits", host_from_device(d_logits, NV), ref_dlogits);

    cudaCheck(cudaFree(d_targets));
    cudaCheck(cudaFree(d_losses));
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_logits_orig));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    test_case(37, 259, 1);
    test_case(37, 1003, 2);
    test_case(13, 128256, 3);
    test_case(9, 7, 4);
    test_case(4, 1, 5);
    test_case(16, 2048, 6);
    test_case(8, 1003, 7, 1);  // every row masked: losses and dlogits all zero
    test_case(300, 128256, 8);  // several batches of loads per thread, with odd rows

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
    // minimum traffic: read the logits once, write the dlogits once (pass 2's re-read is partly served by L2)
    float ms = benchmark_ms(20, [&] { fused_classifier(d_logits, d_losses, 1.0f / N, d_targets, N, V, true, 0); });
    report_bandwidth("loss + dlogits", ms, 2.0 * NV * sizeof(floatX));
    ms = benchmark_ms(20, [&] { fused_classifier(d_logits, d_losses, 1.0f / N, d_targets, N, V, false, 0); });
    report_bandwidth("loss only", ms, 1.0 * NV * sizeof(floatX));
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_targets));
    cudaCheck(cudaFree(d_losses));
    return finish(argv[0]);
}
