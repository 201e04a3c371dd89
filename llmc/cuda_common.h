// What every CUDA file shares: the element type, error checks, and small device helpers.
//
// floatX is the type of parameters, activations and gradients: bf16 by default, fp32 with -DENABLE_FP32 (the
// exact tie-out build). Accumulation, softmax statistics, optimizer state and master weights are always fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "utils.h"

#if defined(ENABLE_FP32)
typedef float floatX;
#define PRECISION_NAME "fp32"
#else
typedef __nv_bfloat16 floatX;
#define PRECISION_NAME "bf16"
#endif

inline void cuda_check(cudaError_t err, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "CUDA error: %s (%s) [%s:%d]\n", cudaGetErrorString(err), cudaGetErrorName(err), file, line);
        fail_exit();
    }
}
#define cudaCheck(err) cuda_check((err), __FILE__, __LINE__)

// After a kernel launch: catches bad launch configurations at once (asynchronous faults surface at the next sync).
#define cudaCheckLaunch() cuda_check(cudaGetLastError(), __FILE__, __LINE__)

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
    return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// floatX elements in one 16-byte access, the widest single load or store.
constexpr int VEC16 = 16 / sizeof(floatX);

// Loads VEC consecutive floatX as fp32, in one 16-byte access when VEC == VEC16 (src must then be 16-byte aligned).
template <int VEC>
__device__ __forceinline__ void load_as_float(float* dst, const floatX* src) {
    if constexpr (VEC == 1) {
        dst[0] = to_float(src[0]);
    } else {
        int4 raw = *reinterpret_cast<const int4*>(src);
        const floatX* x = reinterpret_cast<const floatX*>(&raw);
        for (int j = 0; j < VEC; j++) dst[j] = to_float(x[j]);
    }
}

// Rounds VEC fp32 values to floatX and stores them, in one 16-byte access when VEC == VEC16.
template <int VEC>
__device__ __forceinline__ void store_from_float(floatX* dst, const float* src) {
    if constexpr (VEC == 1) {
        dst[0] = from_float<floatX>(src[0]);
    } else {
        int4 raw;
        floatX* x = reinterpret_cast<floatX*>(&raw);
        for (int j = 0; j < VEC; j++) x[j] = from_float<floatX>(src[j]);
        *reinterpret_cast<int4*>(dst) = raw;
    }
}

// Sum / max over groups of LANES consecutive lanes of a warp (the whole warp by default; LANES a power of two, xor
// offsets below LANES stay inside a group); every lane gets its group's result.
template <int LANES = 32>
__device__ __forceinline__ float warp_reduce_sum(float v) {
    for (int offset = LANES / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}
template <int LANES = 32>
__device__ __forceinline__ float warp_reduce_max(float v) {
    for (int offset = LANES / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, offset));
    return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024); every thread gets the result. `scratch` holds 32
// floats of shared memory; the function syncs before reusing it so it can be called back to back.
__device__ __forceinline__ float block_reduce_sum(float v, float* scratch) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    v = warp_reduce_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_reduce_sum(v);
}

// The amax (max |x|) of a tensor a kernel writes, for FP8 scaling (llmc/fp8.cuh): each thread keeps the largest
// |x| bits it writes (for non-negative floats integer order is numeric order, and NaN bits sort above infinity's),
// then block_commit_amax takes the block's largest into *amax_bits with one atomicMax, so the result is the exact
// maximum whatever the order. *amax_bits (a float's bits) must start at 0 or at the amax of other parts.
__device__ __forceinline__ unsigned int abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

// Every thread of the block calls it (it syncs); the block size a multiple of 32.
__device__ __forceinline__ void block_commit_amax(unsigned int* amax_bits, unsigned int bits) {
    __shared__ unsigned int warp_amax[32];
    bits = __reduce_max_sync(0xFFFFFFFFu, bits);
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = bits;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)blockDim.x / 32; w++) bits = max(bits, warp_amax[w]);
        atomicMax(amax_bits, bits);
    }
}

// True when `kernel`, a kernel compiled for sm_90a (its body a trap elsewhere), runs on the current device: compute
// capability 9.0 (H100 / H200; later architectures do not run sm_90a code) and the kernel image the runtime picked
// is sm_90 machine code (not, say, an sm_80 image or PTX JIT-compiled from an older target). Both queries are
// host-side but need not be repeated every layer, so the answer is cached per device in `cache` (one per caller).
struct PerDeviceFlag {
    int device = -1;
    bool value = false;
};
template <typename Kernel>
inline bool sm90a_kernel_runs(Kernel kernel, PerDeviceFlag& cache) {
    int device;
    cudaCheck(cudaGetDevice(&device));
    if (device != cache.device) {
        int major = 0, minor = 0;
        cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        cudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        cache.value = false;
        if (major == 9 && minor == 0) {
            cudaFuncAttributes attr;
            cudaCheck(cudaFuncGetAttributes(&attr, kernel));
            cache.value = attr.binaryVersion == 90;
        }
        cache.device = device;
    }
    return cache.value;
}

// RAII pinned (page-locked) host buffer: copies from and to it are truly asynchronous.
template <typename T>
struct PinnedBuffer {
    T* ptr = nullptr;
    size_t count = 0;
    PinnedBuffer() = default;
    explicit PinnedBuffer(size_t n) : count(n) { cudaCheck(cudaMallocHost(&ptr, n * sizeof(T))); }
    PinnedBuffer(const PinnedBuffer&) = delete;
    PinnedBuffer& operator=(const PinnedBuffer&) = delete;
    PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
        if (this != &o) { if (ptr) cudaFreeHost(ptr); ptr = o.ptr; count = o.count; o.ptr = nullptr; o.count = 0; }
        return *this;
    }
    ~PinnedBuffer() { if (ptr) cudaFreeHost(ptr); }
};

// RAII device buffer: freed when it goes out of scope.
template <typename T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t count = 0;
    DeviceBuffer() = default;
    explicit DeviceBuffer(size_t n) : count(n) { cudaCheck(cudaMalloc(&ptr, n * sizeof(T))); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), count(o.count) { o.ptr = nullptr; o.count = 0; }
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
        if (this != &o) { if (ptr) cudaFree(ptr); ptr = o.ptr; count = o.count; o.ptr = nullptr; o.count = 0; }
        return *this;
    }
    ~DeviceBuffer() { if (ptr) cudaFree(ptr); }
    size_t bytes() const { return count * sizeof(T); }
};
