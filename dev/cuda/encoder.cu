// Token embedding forward (gather) and deterministic backward (scatter-add by a host-built plan), validated against
// the CPU reference (dev/cpu/llama3_cpu.h) and timed.
//
//   forward:  out[n, :] = emb[tokens[n], :]
//   backward: d_emb[v, :] += sum_{n : tokens[n] = v} dout[n, :]          (accumulates onto existing values)
//
// version 1 = llmc/encoder.cuh. Sizes cover the 16-byte path (C = 48, 2048 in bf16; also 100 in fp32) and the
// scalar fallback (C = 50, and 100 in bf16), vocabularies larger and smaller than N, and a tiny vocabulary where
// every token repeats many times (exercises the 4-way unrolled loop and its tail).
//
// Tried, not kept (session 20, H100, N = 16384, C = 2048, V = 128256): 16 positions a round with their indices
// loaded a round ahead, the same sums in the same order (so the same bits). The trainer's batches are skewed (in
// tiny Shakespeare one token fills 707 of 16384 positions), and a frequent token's chain of loads sets the kernel's
// time: on such a batch 0.1444 -> 0.1062 ms, but on uniform tokens 0.0928 -> 0.1567 ms (the registers of 16 rows
// in flight cost occupancy), and in the 1B step the kernel is about 0.14 ms of 227.
//
// build: make -C dev/cuda bin/encoder   run: dev/cuda/bin/encoder
#include <chrono>

#include "common.h"
#include "../../llmc/encoder.cuh"

static void test_case(int N, int V, int C, uint64_t seed) {
    printf("N=%d V=%d C=%d\n", N, V, C);
    std::vector<int> tokens = random_ints(N, V, seed);
    std::vector<float> emb = round_to_floatX(random_floats((size_t)V * C, seed + 1));
    std::vector<float> dout = round_to_floatX(random_floats((size_t)N * C, seed + 2));
    std::vector<float> d_emb0 = round_to_floatX(random_floats((size_t)V * C, seed + 3));

    int* d_tokens;
    cudaCheck(cudaMalloc(&d_tokens, N * sizeof(int)));
    cudaCheck(cudaMemcpy(d_tokens, tokens.data(), N * sizeof(int), cudaMemcpyHostToDevice));
    floatX* d_embw = device_from_host<floatX>(emb);
    floatX* d_dout = device_from_host<floatX>(dout);
    floatX* d_out;
    cudaCheck(cudaMalloc(&d_out, (size_t)N * C * sizeof(floatX)));

    // forward: an exact copy, so any difference at all is a bug
    std::vector<float> ref((size_t)N * C);
    cpu::encoder_forward(ref.data(), tokens.data(), emb.data(), N, C);
    poison(d_out, (size_t)N * C * sizeof(floatX));
    encoder_forward(d_out, d_tokens, d_embw, N, C, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate("forward", host_from_device(d_out, (size_t)N * C), ref, 0.0);

    // backward, twice from the same starting gradient: must match the reference and each other bit for bit
    EmbeddingBackwardPlan plan;
    plan.allocate(N, V);
    plan.build(tokens.data(), N, 0);
    floatX* d_grad_a = device_from_host<floatX>(d_emb0);
    floatX* d_grad_b = device_from_host<floatX>(d_emb0);
    encoder_backward(d_grad_a, d_dout, plan, C, 0);
    plan.build(tokens.data(), N, 0);  // a rebuild of the same batch must give the same plan
    encoder_backward(d_grad_b, d_dout, plan, C, 0);
    cudaCheck(cudaDeviceSynchronize());
    std::vector<float> ref_grad = d_emb0;
    cpu::encoder_backward(ref_grad.data(), tokens.data(), dout.data(), N, C);
    validate("backward (accumulate)", host_from_device(d_grad_a, (size_t)V * C), ref_grad);
    validate_bitwise("backward determinism", d_grad_a, d_grad_b, (size_t)V * C);

    cudaCheck(cudaFree(d_tokens));
    cudaCheck(cudaFree(d_embw));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_grad_a));
    cudaCheck(cudaFree(d_grad_b));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    test_case(37, 259, 48, 1);
    test_case(37, 1003, 50, 2);
    test_case(37, 259, 100, 3);
    test_case(300, 5, 48, 4);       // few tokens, each repeated ~60 times
    test_case(300, 7, 50, 5);       // same, scalar path
    test_case(1024, 1003, 2048, 6);
    test_case(1, 2, 2, 7);          // smallest

    // timing: GPT-style batch of 8 x 2048 tokens, Llama 3.2 1B width and vocabulary
    int N = 16384, C = 2048, V = 128256;
    printf("timing N=%d C=%d V=%d\n", N, C, V);
    std::vector<int> tokens = random_ints(N, V, 42);
    int* d_tokens;
    cudaCheck(cudaMalloc(&d_tokens, N * sizeof(int)));
    cudaCheck(cudaMemcpy(d_tokens, tokens.data(), N * sizeof(int), cudaMemcpyHostToDevice));
    floatX *d_emb, *d_out, *d_grad;
    cudaCheck(cudaMalloc(&d_emb, (size_t)V * C * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_grad, (size_t)V * C * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_out, (size_t)N * C * sizeof(floatX)));
    cudaCheck(cudaMemset(d_emb, 0, (size_t)V * C * sizeof(floatX)));
    cudaCheck(cudaMemset(d_grad, 0, (size_t)V * C * sizeof(floatX)));
    cudaCheck(cudaMemset(d_out, 0, (size_t)N * C * sizeof(floatX)));
    float ms = benchmark_ms(20, [&] { encoder_forward(d_out, d_tokens, d_emb, N, C, 0); });
    report_bandwidth("forward", ms, 2.0 * N * C * sizeof(floatX) + N * sizeof(int));

    EmbeddingBackwardPlan plan;
    plan.allocate(N, V);
    auto t0 = std::chrono::steady_clock::now();
    plan.build(tokens.data(), N, 0);
    cudaCheck(cudaDeviceSynchronize());
    auto t1 = std::chrono::steady_clock::now();
    printf("  %-28s %8.4f ms (host sort + upload)\n", "plan build", std::chrono::duration<double, std::milli>(t1 - t0).count());
    // backward reads dout once and reads + writes one gradient row per distinct token
    ms = benchmark_ms(20, [&] { encoder_backward(d_grad, d_out, plan, C, 0); });
    double bytes = (double)N * C * sizeof(floatX) + 2.0 * plan.num_segments * C * sizeof(floatX) + 3.0 * N * sizeof(int);
    report_bandwidth("backward", ms, bytes);

    cudaCheck(cudaFree(d_tokens));
    cudaCheck(cudaFree(d_emb));
    cudaCheck(cudaFree(d_grad));
    cudaCheck(cudaFree(d_out));
    return finish(argv[0]);
}
