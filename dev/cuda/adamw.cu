// AdamW update (fp32 state, master weights with stochastic rounding in bf16 builds), validated against the CPU
// reference (cpu::adamw_update in dev/cpu/llama3_cpu.h) and timed.
//
//   g = grad * grad_scale;  p *= 1 - lr wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//
// Versions: v1, one element per thread with scalar loads (llmc/adamw.cuh until issue 13), kept here; v2 =
// llmc/adamw.cuh: 8 elements per thread with 16-byte loads and stores (an element-wise loop for the tail and for
// misaligned arrays), and every operation spelled out with round-to-nearest intrinsics, so that both loops give the
// same bits (checked on the same data at an aligned and a misaligned start, fp32 and bf16 state, with and without
// master weights). v1 let the compiler choose FMA contractions, which differed between such loops: its m, v, master
// differ from v2's in the last bits (a run resumed from an older build's checkpoint is not bit-exact with it).
// Timing (n = 2^28): fp32 state with master (the defaults) and bf16 state without master (-W 0 -O bf16), both versions.
//   H100 (bf16 build): fp32 state + master v1 2.675 ms (2610 GB/s), v2 2.544 ms (2744 GB/s); bf16 state, no master
//   v1 1.925 ms (1673 GB/s), v2 1.274 ms (2528 GB/s). fp32 build: v1 2.628 ms (2452 GB/s), v2 2.524 ms (2553 GB/s).
// Checks of v2: master/m/v against the reference; the floatX parameter is one of the two
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

// v1: the scalar kernel (one element per thread), for the bit-for-bit comparison and the timing.
template <typename State>
__global__ void adamw_v1_kernel(floatX* params, float* master, const floatX* grads, State* m, State* v, size_t n,
                                AdamWScalars s, size_t index_offset) {
    const unsigned int param_stream = adamw_stream(s.seed, s.step);
    const unsigned int state_stream = adamw_stream(s.seed ^ 0x6d6d7676u, s.step);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = to_float(grads[i]) * s.grad_scale;
        float p = master != nullptr ? master[i] : to_float(params[i]);
        float mi = s.beta1 * to_float(m[i]) + (1.0f - s.beta1) * g;
        float vi = s.beta2 * to_float(v[i]) + (1.0f - s.beta2) * g * g;
        const unsigned int state_bits = adamw_random_bits(state_stream, index_offset + i);
        adamw_round(m[i], mi, state_bits);
        adamw_round(v[i], vi, state_bits >> 16);
        p *= s.decay;
        p -= s.step_size * (mi / (sqrtf(vi) / s.sqrt_bc2 + s.eps));
        if (master != nullptr) master[i] = p;
        adamw_round(params[i], p, adamw_random_bits(param_stream, index_offset + i));
    }
}

// The scalars as adamw_update computes them.
static AdamWScalars adamw_scalars(float lr, float beta1, float beta2, int step, float eps, float wd, float grad_scale,
                                  unsigned int seed) {
    AdamWScalars s;
    s.beta1 = beta1;
    s.beta2 = beta2;
    s.step_size = (float)((double)lr / (1.0 - pow((double)beta1, step)));
    s.sqrt_bc2 = (float)sqrt(1.0 - pow((double)beta2, step));
    s.decay = (float)(1.0 - (double)lr * (double)wd);
    s.eps = eps;
    s.grad_scale = grad_scale;
    s.seed = seed;
    s.step = (unsigned int)step;
    return s;
}

template <typename State>
static void adamw_v1(floatX* params, float* master, const floatX* grads, State* m, State* v, size_t n, float lr,
                     float beta1, float beta2, int step, float eps, float wd, float grad_scale, unsigned int seed,
                     size_t index_offset = 0) {
    size_t blocks = ceil_div<size_t>(n, 512);
    adamw_v1_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 512>>>(
        params, master, grads, m, v, n, adamw_scalars(lr, beta1, beta2, step, eps, wd, grad_scale, seed), index_offset);
    cudaCheckLaunch();
}

// v2 (llmc), its packed path against its element-wise path, bit for bit: the same data updated for three steps at
// element 0 of the buffers (16-byte aligned: packs of 8, then the tail) and 3 elements in (misaligned: element by
// element). Also v1 against v2 (not bit for bit: v2 spells out its rounding, v1 left FMA contraction and fast-math
// to the compiler), within 1e-6.
template <typename State>
static void compare_paths(size_t n, bool use_master, uint64_t seed) {
    printf("v2 packed vs element-wise: n=%zu master=%d state=%s\n", n, (int)use_master,
           sizeof(State) == 4 ? "fp32" : "bf16");
    const size_t skews[3] = {0, 3, 0};  // run 2: v1 at skew 0
    std::vector<float> p = round_to_floatX(random_floats(n, seed, 0.05f));
    std::vector<float> grad = round_to_floatX(random_floats(n, seed + 1, 0.01f));
    std::vector<float> m = random_floats(n, seed + 2, 0.001f);
    std::vector<float> v = random_floats(n, seed + 3, 1e-5f);
    for (auto& x : v) x = x * x;
    std::vector<State> m_state(n), v_state(n);
    for (size_t i = 0; i < n; i++) {
        m_state[i] = (State)m[i];
        v_state[i] = (State)v[i];
    }
    floatX *d_p[3], *d_grad[3];
    float* d_master[3];
    State *d_m[3], *d_v[3];
    for (int k = 0; k < 3; k++) {
        const size_t total = n + skews[k], at = skews[k];
        cudaCheck(cudaMalloc(&d_p[k], total * sizeof(floatX)));
        cudaCheck(cudaMalloc(&d_grad[k], total * sizeof(floatX)));
        cudaCheck(cudaMalloc(&d_master[k], total * sizeof(float)));
        cudaCheck(cudaMalloc(&d_m[k], total * sizeof(State)));
        cudaCheck(cudaMalloc(&d_v[k], total * sizeof(State)));
        std::vector<floatX> p_x(n), grad_x(n);
        for (size_t i = 0; i < n; i++) {
            p_x[i] = (floatX)p[i];
            grad_x[i] = (floatX)grad[i];
        }
        cudaCheck(cudaMemcpy(d_p[k] + at, p_x.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_grad[k] + at, grad_x.data(), n * sizeof(floatX), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_master[k] + at, p.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_m[k] + at, m_state.data(), n * sizeof(State), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_v[k] + at, v_state.data(), n * sizeof(State), cudaMemcpyHostToDevice));
        for (int step = 1; step <= 3; step++) {
            float* master = use_master ? d_master[k] + at : nullptr;
            if (k < 2) {
                adamw_update(d_p[k] + at, master, d_grad[k] + at, d_m[k] + at, d_v[k] + at, n, 1e-3f, 0.9f, 0.95f,
                             step, 1e-8f, 0.1f, 0.7f, 77u, 0, 5);
            } else {
                adamw_v1(d_p[k] + at, master, d_grad[k] + at, d_m[k] + at, d_v[k] + at, n, 1e-3f, 0.9f, 0.95f, step,
                         1e-8f, 0.1f, 0.7f, 77u, 5);
            }
        }
    }
    cudaCheck(cudaDeviceSynchronize());
    validate_bitwise("params", d_p[0], d_p[1] + 3, n);
    if (use_master) validate_bitwise("master", d_master[0], d_master[1] + 3, n);
    validate_bitwise("m", d_m[0], d_m[1] + 3, n);
    validate_bitwise("v", d_v[0], d_v[1] + 3, n);
    // fp32 state: v1 and v2 differ by a rounding here and there; bf16 state: such a difference may also send a
    // stochastic rounding of m the other way (one bf16 ulp, 2^-8 relative, on a few elements)
    const double tolerance = sizeof(State) == 4 ? 1e-6 : 1e-3;
    validate("v1 vs v2: m", host_from_device(d_m[0], n), host_from_device(d_m[2], n), tolerance);
    if (use_master) {
        validate("v1 vs v2: master", host_from_device(d_master[0], n), host_from_device(d_master[2], n), 1e-6);
    }
    for (int k = 0; k < 3; k++)
        for (void* q : {(void*)d_p[k], (void*)d_grad[k], (void*)d_master[k], (void*)d_m[k], (void*)d_v[k]})
            cudaCheck(cudaFree(q));
}

// Times v1 and v2 on n elements with State moments, with or without master weights.
template <typename State>
static void time_versions(size_t n, bool use_master) {
    floatX *d_p, *d_g;
    float* d_master = nullptr;
    State *d_m, *d_v;
    cudaCheck(cudaMalloc(&d_p, n * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_g, n * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_m, n * sizeof(State)));
    cudaCheck(cudaMalloc(&d_v, n * sizeof(State)));
    // filled with memset so setup takes no host time: byte 0x3C makes 0.0115 in both bf16 and fp32
    cudaCheck(cudaMemset(d_p, 0x3C, n * sizeof(floatX)));
    cudaCheck(cudaMemset(d_g, 0x3C, n * sizeof(floatX)));
    cudaCheck(cudaMemset(d_m, 0, n * sizeof(State)));
    cudaCheck(cudaMemset(d_v, 0, n * sizeof(State)));
    if (use_master) {
        cudaCheck(cudaMalloc(&d_master, n * sizeof(float)));
        cudaCheck(cudaMemset(d_master, 0x3C, n * sizeof(float)));
    }
    // read p (or master), g, m, v; write p, m, v (and master)
    double bytes = n * (2.0 * sizeof(floatX) + 4.0 * sizeof(State) + (use_master ? 8.0 - sizeof(floatX) : 0.0));
    char name[64];
    for (int version = 1; version <= 2; version++) {
        int step = 1;
        float ms = benchmark_ms(10, [&] {
            if (version == 1) {
                adamw_v1(d_p, d_master, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.95f, step, 1e-8f, 0.1f, 1.0f, 42u);
            } else {
                adamw_update(d_p, d_master, d_g, d_m, d_v, n, 1e-3f, 0.9f, 0.95f, step, 1e-8f, 0.1f, 1.0f, 42u, 0);
            }
            step++;
        });
        snprintf(name, sizeof(name), "v%d %s state%s", version, sizeof(State) == 4 ? "fp32" : "bf16",
                 use_master ? " + master" : "");
        report_bandwidth(name, ms, bytes);
    }
    for (void* q : {(void*)d_p, (void*)d_g, (void*)d_master, (void*)d_m, (void*)d_v}) cudaCheck(cudaFree(q));
}

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

    for (size_t n : {(size_t)1003, (size_t)(1 << 20) + 5}) {
        compare_paths<float>(n, true, 10);
        compare_paths<float>(n, false, 20);
#if !defined(ENABLE_FP32)
        compare_paths<__nv_bfloat16>(n, true, 30);
        compare_paths<__nv_bfloat16>(n, false, 40);
#endif
    }

    // timing: 1.24e9 parameters would be Llama 3.2 1B; 2^28 keeps the run short while far exceeding L2
    size_t n = (size_t)1 << 28;
    printf("timing n=%zu\n", n);
#if defined(ENABLE_FP32)
    time_versions<float>(n, false);
#else
    time_versions<float>(n, true);
    time_versions<__nv_bfloat16>(n, false);
#endif
    return finish(argv[0]);
}
