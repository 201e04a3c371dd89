// SwiGLU forward and backward, validated against the CPU reference (dev/cpu/llama3_cpu.h) and timed.
//
//   inp (N, 2F) = [gate | up],  out (N, F) = silu(gate) * up
//   dinp = [dout * up * silu'(gate) | dout * silu(gate)],  silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)
//   the backward optionally writes out again (the trainer's recompute): checked bit for bit against the forward.
//   Both optionally take the amax of what they write (out, dinp) for the FP8 mode: checked bit for bit, with the
//   tensors unchanged.
// H200, N = 16384, F = 8192 (2026-11-26): forward 0.1965 ms, backward + out 0.3857; with the amax, by grid (blocks
// per SM, striding): 8: 0.2412 / 0.4252, 16: 0.2162 / 0.4173, 32: 0.2087 / 0.4077, 64 (kept): 0.2054 / 0.4019, a
// block per 256 threads (no stride, 65536 atomics): 0.2308 / 0.4225.
//
// version 1 = llmc/swiglu.cuh. F = 72 and 8192 take the 16-byte path in both precisions, F = 100 only in fp32, F = 50
// never. Inputs are scaled by 4 so the gate reaches the saturated ends of the sigmoid.
//
// build: make -C dev/cuda bin/swiglu   run: dev/cuda/bin/swiglu
#include "common.h"
#include "../../llmc/swiglu.cuh"

static void test_case(int N, int F, uint64_t seed) {
    printf("N=%d F=%d\n", N, F);
    size_t NF = (size_t)N * F;
    std::vector<float> inp = round_to_floatX(random_floats(2 * NF, seed, 4.0f));
    std::vector<float> dout = round_to_floatX(random_floats(NF, seed + 1));
    floatX* d_inp = device_from_host<floatX>(inp);
    floatX* d_dout = device_from_host<floatX>(dout);
    floatX *d_out, *d_dinp;
    cudaCheck(cudaMalloc(&d_out, NF * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dinp, 2 * NF * sizeof(floatX)));

    std::vector<float> ref(NF), dref(2 * NF);
    cpu::swiglu_forward(ref.data(), inp.data(), N, F);
    cpu::swiglu_backward(dref.data(), dout.data(), inp.data(), N, F);
    poison(d_out, NF * sizeof(floatX));
    swiglu_forward(d_out, d_inp, N, F, 0);
    poison(d_dinp, 2 * NF * sizeof(floatX));
    swiglu_backward(d_dinp, nullptr, d_dout, d_inp, N, F, 0);
    cudaCheck(cudaDeviceSynchronize());
    validate("forward", host_from_device(d_out, NF), ref);
    validate("backward", host_from_device(d_dinp, 2 * NF), dref);
    // the backward that also recomputes out: the same dinp, and out bit-identical to the forward's
    floatX *d_out2, *d_dinp2;
    cudaCheck(cudaMalloc(&d_out2, NF * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dinp2, 2 * NF * sizeof(floatX)));
    poison(d_out2, NF * sizeof(floatX));
    poison(d_dinp2, 2 * NF * sizeof(floatX));
    swiglu_backward(d_dinp2, d_out2, d_dout, d_inp, N, F, 0);
    validate_bitwise("backward + recompute: out", d_out2, d_out, NF);
    validate_bitwise("backward + recompute: dinp", d_dinp2, d_dinp, 2 * NF);
    // the FP8 mode's amax outputs: the same tensors written, and bit for bit the amax of them; an amax that starts
    // above the tensor's (an earlier part's) stays
    float* d_amax;
    cudaCheck(cudaMalloc(&d_amax, sizeof(float)));
    for (float start : {0.0f, 1e30f}) {
        cudaCheck(cudaMemcpy(d_amax, &start, sizeof(float), cudaMemcpyHostToDevice));
        poison(d_out2, NF * sizeof(floatX));
        swiglu_forward(d_out2, d_inp, N, F, 0, d_amax);
        validate_bitwise("forward with amax: out", d_out2, d_out, NF);
        validate_amax("forward amax", d_amax, d_out2, NF, start);
        cudaCheck(cudaMemcpy(d_amax, &start, sizeof(float), cudaMemcpyHostToDevice));
        poison(d_out2, NF * sizeof(floatX));
        poison(d_dinp2, 2 * NF * sizeof(floatX));
        swiglu_backward(d_dinp2, d_out2, d_dout, d_inp, N, F, 0, d_amax);
        validate_bitwise("backward with amax: dinp", d_dinp2, d_dinp, 2 * NF);
        validate_bitwise("backward with amax: out", d_out2, d_out, NF);
        validate_amax("backward amax (dinp)", d_amax, d_dinp2, 2 * NF, start);
    }
    cudaCheck(cudaFree(d_amax));
    cudaCheck(cudaFree(d_out2));
    cudaCheck(cudaFree(d_dinp2));

    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dinp));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    test_case(37, 72, 1);
    test_case(37, 100, 2);
    test_case(37, 50, 3);
    test_case(37, 8192, 4);
    test_case(1, 1, 5);

    // timing: Llama 3.2 1B FFN (F = 8192) at N = 8 x 2048 tokens
    int N = 16384, F = 8192;
    printf("timing N=%d F=%d\n", N, F);
    size_t NF = (size_t)N * F;
    floatX* d_inp = device_random<floatX>(2 * NF, 7);
    floatX* d_dout = device_random<floatX>(NF, 8);
    floatX *d_out, *d_dinp;
    cudaCheck(cudaMalloc(&d_out, NF * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dinp, 2 * NF * sizeof(floatX)));
    float ms = benchmark_ms(20, [&] { swiglu_forward(d_out, d_inp, N, F, 0); });
    report_bandwidth("forward", ms, 3.0 * NF * sizeof(floatX));
    ms = benchmark_ms(20, [&] { swiglu_backward(d_dinp, nullptr, d_dout, d_inp, N, F, 0); });
    report_bandwidth("backward", ms, 5.0 * NF * sizeof(floatX));
    ms = benchmark_ms(20, [&] { swiglu_backward(d_dinp, d_out, d_dout, d_inp, N, F, 0); });
    report_bandwidth("backward + recompute out", ms, 6.0 * NF * sizeof(floatX));
    float* d_amax;
    cudaCheck(cudaMalloc(&d_amax, sizeof(float)));
    ms = benchmark_ms(20, [&] { swiglu_forward(d_out, d_inp, N, F, 0, d_amax); });
    report_bandwidth("forward + amax", ms, 3.0 * NF * sizeof(floatX));
    ms = benchmark_ms(20, [&] { swiglu_backward(d_dinp, d_out, d_dout, d_inp, N, F, 0, d_amax); });
    report_bandwidth("backward + out + amax", ms, 6.0 * NF * sizeof(floatX));
    // the amax kernels' grid: blocks per SM (132 SMs), striding; the last, one block per 256 threads (no stride)
    unsigned int* bits = reinterpret_cast<unsigned int*>(d_amax);
    for (int per_sm : {8, 16, 32, 64, 0}) {
        unsigned grid = per_sm ? 132 * per_sm : (unsigned)ceil_div<size_t>(NF / VEC16, SWIGLU_BLOCK);
        char name[64];
        snprintf(name, sizeof(name), "forward + amax, %u blocks", grid);
        ms = benchmark_ms(20, [&] {
            swiglu_forward_kernel<VEC16, true><<<grid, SWIGLU_BLOCK>>>(d_out, bits, d_inp, N, F);
        });
        report_bandwidth(name, ms, 3.0 * NF * sizeof(floatX));
        snprintf(name, sizeof(name), "backward + amax, %u blocks", grid);
        ms = benchmark_ms(20, [&] {
            swiglu_backward_kernel<VEC16, true><<<grid, SWIGLU_BLOCK>>>(d_dinp, d_out, bits, d_dout, d_inp, N, F);
        });
        report_bandwidth(name, ms, 6.0 * NF * sizeof(floatX));
    }
    cudaCheck(cudaFree(d_amax));
    cudaCheck(cudaFree(d_inp));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dinp));
    return finish(argv[0]);
}
