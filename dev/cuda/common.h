// Shared by the dev/cuda microbenchmarks: random inputs, poisoned outputs, validation against the CPU reference by
// relative error norm, and event timing. Each benchmark includes the llmc/ kernel it tests, so what is validated
// here is exactly what the trainer runs; the reference is the layer functions of dev/cpu/llama3_cpu.h (namespace
// cpu), the same that tie out the whole model against PyTorch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../../llmc/cuda_common.h"
#include "../../llmc/hash.h"
#include "../cpu/llama3_cpu.h"

// Tolerance on ||gpu - cpu|| / ||cpu||: fp32 kernels land near 1e-6; bf16 storage (8 mantissa bits, unit roundoff
// 2^-9 = 2e-3) puts a single rounding at ~1e-3 relative, so 1e-2 leaves room for a few roundings and sums.
#if defined(ENABLE_FP32)
constexpr double DEFAULT_TOLERANCE = 1e-5;
#else
constexpr double DEFAULT_TOLERANCE = 1e-2;
#endif

static int g_failures = 0;

// First call in every benchmark's main: without a usable GPU, say so and exit non-zero rather than fail later with
// a confusing error (or, worse, "pass" with nothing validated). Prints the device so logs say what was measured.
inline void require_gpu(const char* program) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        fprintf(stderr, "%s: no usable CUDA device (%s); this benchmark needs a GPU\n", program,
                err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0");
        fail_exit();
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    printf("%s: %s, sm_%d%d, precision %s\n", program, prop.name, prop.major, prop.minor, PRECISION_NAME);
}

inline std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}

inline std::vector<int> random_ints(size_t n, int upper, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int> dist(0, upper - 1);
    std::vector<int> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}

// Rounds host values through floatX so the CPU reference sees exactly the inputs the GPU sees.
inline std::vector<float> round_to_floatX(const std::vector<float>& v) {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); i++) {
#if defined(ENABLE_FP32)
        out[i] = v[i];
#else
        out[i] = __bfloat162float(__float2bfloat16_rn(v[i]));
#endif
    }
    return out;
}

template <typename T>
inline T* device_from_host(const std::vector<float>& v) {
    std::vector<T> tmp(v.size());
    for (size_t i = 0; i < v.size(); i++) tmp[i] = (T)v[i];
    T* d;
    cudaCheck(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
    cudaCheck(cudaMemcpy(d, tmp.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

template <typename T>
inline std::vector<float> host_from_device(const T* d, size_t n) {
    std::vector<T> tmp(n);
    cudaCheck(cudaMemcpy(tmp.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<float> out(n);
    for (size_t i = 0; i < n; i++) out[i] = (float)tmp[i];
    return out;
}

// Uniform values in [-scale, scale) from a hash of (seed, index), generated on the device: for the large timing
// inputs, where drawing hundreds of millions of normals on the host would take longer than the benchmark.
template <typename T>
__global__ void fill_uniform_kernel(T* d, size_t n, uint32_t seed, float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = hash32((uint32_t)i * 0x9e3779b9u ^ (uint32_t)(i >> 32) * 0x85ebca6bu ^ seed * 0xc2b2ae35u);
        d[i] = (T)(scale * ((float)(x >> 8) * (2.0f / 16777216.0f) - 1.0f));
    }
}
template <typename T>
inline T* device_random(size_t n, uint32_t seed, float scale = 1.0f) {
    T* d;
    cudaCheck(cudaMalloc(&d, std::max<size_t>(1, n) * sizeof(T)));
    fill_uniform_kernel<T><<<1024, 256>>>(d, n, seed, scale);
    cudaCheckLaunch();
    cudaCheck(cudaDeviceSynchronize());
    return d;
}

// Fills a device buffer with NaN bytes (0xFF) so any element a kernel forgets to write fails validation.
inline void poison(void* d, size_t bytes) { cudaCheck(cudaMemset(d, 0xFF, bytes)); }

// Compares by relative error norm and checks every element is finite. Prints one line; counts failures.
inline bool validate(const char* name, const std::vector<float>& gpu, const std::vector<float>& ref,
                     double tolerance = DEFAULT_TOLERANCE) {
    double diff2 = 0.0, ref2 = 0.0, max_abs = 0.0;
    size_t non_finite = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        if (!std::isfinite(gpu[i])) { non_finite++; continue; }
        double d = (double)gpu[i] - (double)ref[i];
        diff2 += d * d;
        ref2 += (double)ref[i] * ref[i];
        max_abs = std::max(max_abs, std::fabs(d));
    }
    // An all-zero reference (e.g. dq and dk at T = 1, where the softmax has one entry) has no scale to be
    // relative to: compare the RMS of the error itself against the tolerance instead.
    double rel = ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2 / std::max<size_t>(1, ref.size()));
    bool ok = non_finite == 0 && rel <= tolerance;
    printf("  %-28s rel_err %.3e  max_abs %.3e  non_finite %zu  %s\n", name, rel, max_abs, non_finite,
           ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
    return ok;
}

// Determinism check: two runs of a kernel that promises bit-identical results must match byte for byte.
template <typename T>
inline bool validate_bitwise(const char* name, const T* d_a, const T* d_b, size_t n) {
    std::vector<T> a(n), b(n);
    cudaCheck(cudaMemcpy(a.data(), d_a, n * sizeof(T), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(b.data(), d_b, n * sizeof(T), cudaMemcpyDeviceToHost));
    size_t mismatches = 0;
    for (size_t i = 0; i < n; i++) mismatches += memcmp(&a[i], &b[i], sizeof(T)) != 0;
    bool ok = mismatches == 0;
    printf("  %-28s bitwise mismatches %zu / %zu  %s\n", name, mismatches, n, ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
    return ok;
}

// The amax a kernel takes of what it writes, for FP8 scaling (llmc/cuda_common.h's block_commit_amax): bit for bit
// the float whose bits are the largest |x| bits of the n values at d_x (as the kernel wrote them), or of those and
// `start`, the value the amax held before the kernel ran.
template <typename T>
inline bool validate_amax(const char* name, const float* d_amax, const T* d_x, size_t n, float start = 0.0f) {
    std::vector<T> x(n);
    float got;
    cudaCheck(cudaMemcpy(x.data(), d_x, n * sizeof(T), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(&got, d_amax, sizeof(float), cudaMemcpyDeviceToHost));
    uint32_t bits, want;
    memcpy(&want, &start, sizeof(float));
    for (size_t i = 0; i < n; i++) {
        float v = (float)x[i];
        memcpy(&bits, &v, sizeof(float));
        want = std::max(want, bits & 0x7FFFFFFFu);
    }
    memcpy(&bits, &got, sizeof(float));
    bool ok = bits == want;
    float want_value;
    memcpy(&want_value, &want, sizeof(float));
    printf("  %-28s amax %.9g  expected %.9g  %s\n", name, got, want_value, ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
    return ok;
}

// Prints one timing line: time and effective bandwidth from the bytes the kernel must move (read + written).
inline void report_bandwidth(const char* name, float ms, double bytes) {
    printf("  %-28s %8.4f ms  %8.1f GB/s\n", name, ms, bytes / (ms * 1e-3) / 1e9);
}

// Median time in ms of `repeats` runs of `launch`, after warm-up, measured with CUDA events.
template <typename F>
inline float benchmark_ms(int repeats, F launch) {
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    for (int i = 0; i < 3; i++) launch();
    std::vector<float> times(repeats);
    for (int i = 0; i < repeats; i++) {
        cudaCheck(cudaEventRecord(start));
        launch();
        cudaCheck(cudaEventRecord(stop));
        cudaCheck(cudaEventSynchronize(stop));
        cudaCheck(cudaEventElapsedTime(&times[i], start, stop));
    }
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    std::sort(times.begin(), times.end());
    return times[repeats / 2];
}

// Ends a benchmark: non-zero exit if any validation failed, so `make run_all` fails.
inline int finish(const char* program) {
    if (g_failures > 0) {
        printf("%s: %d validation(s) FAILED\n", program, g_failures);
        return 1;
    }
    printf("%s: all validations passed\n", program);
    return 0;
}
