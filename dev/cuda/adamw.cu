// AdamW update (fp32 state, master weights with stochastic rounding in bf16 builds), validated against the CPU
// reference (cpu::adamw_update in dev/cpu/llama3_cpu.h) and timed.
//
//   g = grad * grad_scale;  p *= 1 - lr wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//
// version 1 = llmc/adamw.cuh. Checks: master/m/v against the reference; the floatX parameter is one of the two
// floatX neighbours of the new master (bf16) or equal to it (fp32); stochastic rounding is unbiased (the fraction
// rounded up matches the position between neighbours); two runs with the same seed are bit-identical, and a
// different seed changes the rounding; the no-master path.
// History of llmc/adamw.cuh: the random bits of each stochastic rounding were four chained hashes of (seed, step,
// index); now the (seed, step) stream is mixed once per thread and each element costs one hash per use (m and v share
// one, low and high halves). With bf16 m, v and no master (-W 0 -O bf16) the kernel had been compute-bound: on an
// H200 the llama3.2-1B optimizer step went from 10.33 to 8.25 ms (trainer -p 1). This benchmark's fp32-state timing
// afterwards: 268M parameters in 1.99 ms, 3774 GB/s. (The rounding draws changed with it: a run resumed from a
// checkpoint written by an earlier build continues bit-exactly only with that build.)
//
// build: make -C dev/cuda bin/adamw   run: dev/cuda/bin/adamw
#include "common.h"
#include "../../llmc/adamw.cuh"

struct AdamHyper {
    float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f, grad_scale = 0.7f;
    int step = 3;
};

// True when q is x rounded down or up to floatX (or exactly x).
static bool is_floatX_neighbour(float q, float x) {
#if defined(ENABLE_FP32)
    return q == x;
#else
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint32_t lo_bits = bits & 0xffff0000u, hi_bits = lo_bits + 0x10000u;
    float lo, hi;
    memcpy(&lo, &lo_bits, 4);
    memcpy(&hi, &hi_bits, 4);
    return q == lo || q == hi;
#endif
}

static void test_case(size_t n, bool use_master, uint64_t seed) {
    printf("n=%zu master=%d\n", n, (int)use_master);
    AdamHyper h;
    std::vector<float> p_exact = random_floats(n, seed, 0.05f);
    std::vector<float> p = round_to_floatX(p_exact);  // the floatX parameter
    std::vector<float> master = use_master ? p_exact : p;  // without a master, the floatX value is the start
    std::vector<float> grad = round_to_floatX(random_floats(n, seed + 1, 0.01f));
    std::vector<float> m = random_floats(n, seed + 2, 0.001f);
    std::vector<float> v = random_floats(n, seed + 3, 1e-5f);
    for (auto& x : v) x = x * x;

    floatX* d_p[2];
    float *d_master[2], *d_m[2], *d_v[2];
    floatX* d_grad = device_from_host<floatX>(grad);
    for (int k = 0; k < 2; k++) {
        d_p[k] = device_from_host<floatX>(p);
        d_master[k] = use_master ? device_from_host<float>(master) : nullptr;
        d_m[k] = device_from_host<float>(m);
        d_v[k] = device_from_host<float>(v);
        adamw_update(d_p[k], d_master[k], d_grad, d_m[k], d_v[k], n, h.lr, h.beta1, h.beta2, h.step, h.eps, h.wd,
                     h.grad_scale, 1234u, 0);
    }
    cudaCheck(cudaDeviceSynchronize());

    std::vector<float> ref_p = master, ref_m = m, ref_v = v;
    cpu::adamw_update(ref_p.data(), ref_m.data(), ref_v.data(), grad.data(), n, h.lr, h.beta1, h.beta2, h.eps, h.wd,
                      h.grad_scale, h.step);
    std::vector<float> got_p = host_from_device(d_p[0], n);
    // the update is ~1e-3 of the parameter: check the change itself, not just the parameter, for a sharp test
    std::vector<float> ref_delta(n), got_delta(n);
    std::vector<float> got_master = use_master ? host_from_device(d_master[0], n) : got_p;
    for (size_t i = 0; i < n; i++) {
        ref_delta[i] = ref_p[i] - master[i];
        got_delta[i] = got_master[i] - master[i];
    }
    validate("m", host_from_device(d_m[0], n), ref_m, 1e-5);
    validate("v", host_from_device(d_v[0], n), ref_v, 1e-5);
    if (use_master) {
        validate("master", got_master, ref_p, 1e-6);
        validate("master update delta", got_delta, ref_delta, 1e-4);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += !is_floatX_neighbour(got_p[i], got_master[i]);
        printf("  %-28s %zu of %zu not a floatX neighbour of master  %s\n", "params from master", bad, n,
               bad ? "FAIL" : "OK");
        if (bad) g_failures++;
    }
    validate("params", got_p, ref_p);
    validate_bitwise("params determinism", d_p[0], d_p[1], n);

#if !defined(ENABLE_FP32)
    // a different seed must change some stochastic roundings (else the bits would not be random)
    floatX* d_p3 = device_from_host<floatX>(p);
    float* d_master3 = use_master ? device_from_host<float>(master) : nullptr;
    float* d_m3 = device_from_host<float>(m);
    float* d_v3 = device_from_host<float>(v);
    adamw_update(d_p3, d_master3, d_grad, d_m3, d_v3, n, h.lr, h.beta1, h.beta2, h.step, h.eps, h.wd, h.grad_scale,
                 999u, 0);
    std::vector<float> other = host_from_device(d_p3, n);
    size_t differ = 0;
    for (size_t i = 0; i < n; i++) differ += other[i] != got_p[i];
    bool ok = n < 100 || differ > 0;
    printf("  %-28s %zu of %zu differ  %s\n", "another seed rounds otherwise", differ, n, ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
    for (void* q : {(void*)d_p3, (void*)d_master3, (void*)d_m3, (void*)d_v3}) cudaCheck(cudaFree(q));
#endif
    for (int k = 0; k < 2; k++)
        for (void* q : {(void*)d_p[k], (void*)d_master[k], (void*)d_m[k], (void*)d_v[k]}) cudaCheck(cudaFree(q));
    cudaCheck(cudaFree(d_grad));
}

// Rounds one value n times with the bits adamw uses for indices 0..n-1; the fraction rounded up should equal the
// value's position between its two bf16 neighbours.
__global__ void stochastic_round_test_kernel(float* out, float x, size_t n, unsigned int seed) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __bfloat162float(stochastic_round_bf16(x, adamw_random_bits(adamw_stream(seed, 1u), i)));
}

static void test_stochastic_rounding(float x) {
    const size_t n = 1 << 22;
    float* d_out;
    cudaCheck(cudaMalloc(&d_out, n * sizeof(float)));
    stochastic_round_test_kernel<<<(unsigned)ceil_div<size_t>(n, 256), 256>>>(d_out, x, n, 77u);
    cudaCheckLaunch();
    std::vector<float> out = host_from_device(d_out, n);
    uint32_t bits;
    memcpy(&bits, &x, 4);
    uint32_t lo_bits = bits & 0xffff0000u, hi_bits = lo_bits + 0x10000u;
    float lo, hi;
    memcpy(&lo, &lo_bits, 4);
    memcpy(&hi, &hi_bits, 4);
    double expected = (double)(bits & 0xffffu) / 65536.0;  // P(round away from zero)
    size_t up = 0, other = 0;
    for (float q : out) {
        if (q == hi) up++;
        else if (q != lo) other++;
    }
    double frac = (double)up / n;
    // binomial standard deviation at n = 4M is < 2.5e-4; allow 8 sigma
    bool ok = other == 0 && std::fabs(frac - expected) < 2e-3;
    printf("  %-28s x=%.9g  P(up) %.5f expected %.5f  %s\n", "stochastic rounding", x, frac, expected,
           ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
    cudaCheck(cudaFree(d_out));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    test_case(1003, true, 1);
    test_case(1003, false, 2);
    test_case((1 << 20) + 7, true, 3);
    test_case(1, true, 4);
    printf("stochastic rounding\n");
    test_stochastic_rounding(1.0f + 0.3f * 0.0078125f);  // 30% of the way from 1 to the next bf16
    test_stochastic_rounding(-3.14159f);
    test_stochastic_rounding(1e-30f);

    // timing: 1.24e9 parameters would be Llama 3.2 1B; 2^28 keeps the run short while far exceeding L2
    size_t n = (size_t)1 << 28;
    printf("timing n=%zu\n", n);
    // filled with memset so setup takes no host time: byte 0x3C makes 0.0115 in both bf16 and fp32
    floatX *d_p, *d_g;
    float *d_master, *d_m, *d_v;
    cudaCheck(cudaMalloc(&d_p, n * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_g, n * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_master, n * sizeof(float)));
    cudaCheck(cudaMalloc(&d_m, n * sizeof(float)));
    cudaCheck(cudaMalloc(&d_v, n * sizeof(float)));
    cudaCheck(cudaMemset(d_p, 0x3C, n * sizeof(floatX)));
    cudaCheck(cudaMemset(d_g, 0x3C, n * sizeof(floatX)));
    cudaCheck(cudaMemset(d_master, 0x3C, n * sizeof(float)));
    cudaCheck(cudaMemset(d_m, 0, n * sizeof(float)));
    cudaCheck(cudaMemset(d_v, 0, n * sizeof(float)));
#if defined(ENABLE_FP32)
    // fp32: no master; read p, g, m, v and write p, m, v
    float* master_arg = nullptr;
    double bytes = n * (3.0 * sizeof(floatX) + 4.0 * sizeof(float));
#else
    // bf16: read master, g, m, v and write p, master, m, v
    float* master_arg = d_master;
    double bytes = n * (2.0 * sizeof(floatX) + 6.0 * sizeof(float));
#endif
    int step = 1;
    float ms = benchmark_ms(10, [&] {
        adamw_update(d_p, master_arg, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.95f, step++, 1e-8f, 0.1f, 1.0f, 42u, 0);
    });
    report_bandwidth("update", ms, bytes);
    for (void* q : {(void*)d_p, (void*)d_g, (void*)d_master, (void*)d_m, (void*)d_v}) cudaCheck(cudaFree(q));
    return finish(argv[0]);
}
