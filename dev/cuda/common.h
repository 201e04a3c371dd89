// Shared by the dev/cuda microbenchmarks: random inputs, poisoned outputs, validation against a CPU reference by
// relative error norm, and event timing. Each benchmark includes the llmc/ kernel it tests, so what is validated
// here is exactly what the trainer runs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "../../llmc/cuda_common.h"

// Tolerance on ||gpu - cpu|| / ||cpu||: fp32 kernels land near 1e-6; bf16 storage (8 mantissa bits, unit roundoff
// 2^-9 = 2e-3) puts a single rounding at ~1e-3 relative, so 1e-2 leaves room for a few roundings and sums.
#if defined(ENABLE_FP32)
constexpr double DEFAULT_TOLERANCE = 1e-5;
#else
constexpr double DEFAULT_TOLERANCE = 1e-2;
#endif

static int g_failures = 0;

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
    double rel = std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-30);
    bool ok = non_finite == 0 && rel <= tolerance;
    printf("  %-28s rel_err %.3e  max_abs %.3e  non_finite %zu  %s\n", name, rel, max_abs, non_finite,
           ok ? "OK" : "FAIL");
    if (!ok) g_failures++;
    return ok;
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
