// FP8 casts for the FP8 matmuls (llmc/matmul_fp8.cuh): the amax of a tensor, and the scaled cast of a floatX tensor
// to e4m3 or e5m2, row-major or transposed.
//
// Formats (cuda_fp8.h's __nv_fp8_interpretation_t; stored as __nv_fp8_storage_t bytes):
//   __NV_E4M3  max 448      3 mantissa bits: activations and weights
//   __NV_E5M2  max 57344    2 mantissa bits, wider range: gradients
// Per-tensor scaling, for a tensor x whose amax (max |x|) is a:
//   s = FP8_MAX / a,   q = cvt_rn_satfinite(fl32(x * s)),   x ~ q / s
// so that the largest |x| lands on the format's largest value. The product x * s is rounded to fp32, then to FP8
// (round to nearest even; past the largest finite value, infinity included, it saturates to it; NaN gives 0x7F).
// The matmul undoes the scaling with the inverse scale 1 / s (its A / B scale pointers: llmc/matmul_fp8.cuh), so
// every cast writes the inverse of the scale it used, and a copy always travels with its own inverse scale.
// Special amax: a = 0 (all zeros), infinity or NaN (the tensor holds inf / NaN; the trainer's non-finite check
// skips such a step anyway) give s = 1. s is at most 2^126 so that 1 / s stays a normal float; that bound only
// matters for tensors whose amax is below 448 * 2^-126 (5e-36).
// The scale is computed on the device from the amax in device memory: no host sync.
//
// Kernels:
//   fp8_amax            amax = max |x| over n elements, in fp32 (exact: a maximum, order-independent; NaN wins);
//                       fp8_amax_accumulate: the same for up to 4 tensors in one launch, into amaxes zeroed first
//   fp8_cast            out[i] = q(x[i])                         x, out: n elements
//   fp8_cast_transpose  out_t[c][r] = q(x[r][c]), and optionally out[r][c] = q(x[r][c]) in the same pass
//                       x (rows, cols) row-major floatX; out_t (cols, rows) row-major FP8; out (rows, cols) FP8
// The transposed copy exists because Hopper's FP8 matmuls need both operands K-major (llmc/matmul_fp8.cuh): e.g.
// the weight gradient dW = dout^T inp reduces over the tokens, so it needs dout and inp with the tokens contiguous.
//
// Exactness: the trainer builds with --use_fast_math, under which the compiler's float multiply and divide flush
// subnormals to zero (mul.rn.ftz). The scale, its inverse and x * s are therefore written in PTX without .ftz, and
// the amax compares float bits, so every build produces the same bytes, bit-exact against the CPU reference
// (dev/cuda/fp8_reference.h, checked by dev/cuda/fp8_cast.cu).
#pragma once

#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "cuda_common.h"

__host__ __device__ constexpr float fp8_max(__nv_fp8_interpretation_t format) {
    return format == __NV_E4M3 ? 448.0f : 57344.0f;
}
constexpr float FP8_SCALE_MAX = 0x1p126f;

// IEEE fp32 multiply, divide and reciprocal, round to nearest even, subnormals kept whatever the build flags.
__device__ __forceinline__ float fp8_mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float fp8_div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float fp8_rcp_rn(float a) {
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// s from the amax (see the top): the amax's bits decide the special cases, so a subnormal amax is not taken for 0.
__device__ __forceinline__ float fp8_scale(float amax, __nv_fp8_interpretation_t format) {
    uint32_t bits = __float_as_uint(amax);
    if (bits == 0 || bits >= 0x7F800000u) return 1.0f;  // zero, infinity, NaN (or a negative amax)
    return fminf(fp8_div_rn(fp8_max(format), amax), FP8_SCALE_MAX);
}

// Two values scaled and cast by the hardware (cvt.rn.satfinite.{e4m3,e5m2}x2.f32 on sm_89+): a in the low byte.
template <__nv_fp8_interpretation_t FORMAT>
__device__ __forceinline__ __nv_fp8x2_storage_t fp8_quantize2(float a, float b, float s) {
    return __nv_cvt_float2_to_fp8x2(make_float2(fp8_mul_rn(a, s), fp8_mul_rn(b, s)), __NV_SATFINITE, FORMAT);
}
template <__nv_fp8_interpretation_t FORMAT>
__device__ __forceinline__ __nv_fp8_storage_t fp8_quantize(float a, float s) {
    return __nv_cvt_float_to_fp8(fp8_mul_rn(a, s), __NV_SATFINITE, FORMAT);
}

// Every cast kernel reads the amax, derives s, and its first thread writes 1 / s for the matmul (nullptr: not).
template <__nv_fp8_interpretation_t FORMAT>
__device__ __forceinline__ float fp8_cast_scale(const float* amax, float* inv_scale) {
    const float s = fp8_scale(*amax, FORMAT);
    if (inv_scale != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inv_scale = fp8_rcp_rn(s);
    return s;
}

// ------------------------------------------------------------------------------------------------ amax

// About one full wave of 256-thread blocks on an H100 (132 SMs x 8); each thread strides over the tensor.
constexpr int FP8_AMAX_BLOCKS = 1024;
constexpr int FP8_AMAX_THREADS = 256;

// Up to FP8_AMAX_MAX_TENSORS tensors in one launch (a layer's weights), one row of blocks (blockIdx.y) each.
constexpr int FP8_AMAX_MAX_TENSORS = 4;
struct Fp8AmaxBatch {
    const floatX* x[FP8_AMAX_MAX_TENSORS];
    size_t n[FP8_AMAX_MAX_TENSORS];
    unsigned int* amax_bits[FP8_AMAX_MAX_TENSORS];
};

// Each thread keeps the largest |x| bits it sees of its tensor, and the block commits them (block_commit_amax).
template <int VEC>
__global__ void __launch_bounds__(FP8_AMAX_THREADS) fp8_amax_kernel(Fp8AmaxBatch batch) {
    const floatX* x = batch.x[blockIdx.y];
    const size_t n = batch.n[blockIdx.y];
    unsigned int m = 0;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC; i < n;
         i += (size_t)gridDim.x * blockDim.x * VEC) {
        float v[VEC];
        load_as_float<VEC>(v, x + i);
        for (int j = 0; j < VEC; j++) m = max(m, abs_bits(v[j]));
    }
    block_commit_amax(batch.amax_bits[blockIdx.y], m);
}

// amax[i] = max(amax[i], max |x[i][k]| over its n[i] elements), for `count` tensors (at most FP8_AMAX_MAX_TENSORS)
// in one launch: zero the amax first for the tensor's own.
inline void fp8_amax_accumulate(float* const* amax, const floatX* const* x, const size_t* n, int count,
                                cudaStream_t stream) {
    if (count <= 0) return;
    if (count > FP8_AMAX_MAX_TENSORS) {
        fprintf(stderr, "fp8_amax_accumulate: at most %d tensors a launch, got %d\n", FP8_AMAX_MAX_TENSORS, count);
        fail_exit();
    }
    Fp8AmaxBatch batch = {};
    bool vec = true;
    size_t largest = 0;
    for (int i = 0; i < count; i++) {
        batch.x[i] = x[i];
        batch.n[i] = n[i];
        batch.amax_bits[i] = reinterpret_cast<unsigned int*>(amax[i]);
        vec = vec && n[i] % VEC16 == 0 && ((uintptr_t)x[i] & 15) == 0;
        largest = std::max(largest, n[i]);
    }
    if (largest == 0) return;
    const size_t threads = vec ? largest / VEC16 : largest;
    dim3 grid((unsigned)std::min<size_t>(ceil_div<size_t>(threads, FP8_AMAX_THREADS), FP8_AMAX_BLOCKS), count);
    if (vec) fp8_amax_kernel<VEC16><<<grid, FP8_AMAX_THREADS, 0, stream>>>(batch);
    else fp8_amax_kernel<1><<<grid, FP8_AMAX_THREADS, 0, stream>>>(batch);
    cudaCheckLaunch();
}

inline void fp8_amax_accumulate(float* amax, const floatX* x, size_t n, cudaStream_t stream) {
    fp8_amax_accumulate(&amax, &x, &n, 1, stream);
}

// *amax = max |x[i]| over n elements (overwritten; 0 for n = 0).
inline void fp8_amax(float* amax, const floatX* x, size_t n, cudaStream_t stream) {
    cudaCheck(cudaMemsetAsync(amax, 0, sizeof(float), stream));
    fp8_amax_accumulate(amax, x, n, stream);
}

// ------------------------------------------------------------------------------------------------ cast

// One thread per PACK consecutive elements: 16 (16 * sizeof(floatX) bytes read in 16-byte loads, one 16-byte
// store), when n is a multiple of 16 and both pointers are 16-byte aligned; else 1.
constexpr int FP8_PACK = 16;

template <__nv_fp8_interpretation_t FORMAT, int PACK>
__global__ void fp8_cast_kernel(__nv_fp8_storage_t* out, float* inv_scale, const floatX* x, const float* amax,
                                size_t n) {
    const float s = fp8_cast_scale<FORMAT>(amax, inv_scale);
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * PACK;
    if (i >= n) return;
    if constexpr (PACK == 1) {
        out[i] = fp8_quantize<FORMAT>(to_float(x[i]), s);
    } else {
        float v[PACK];
        for (int k = 0; k < PACK; k += VEC16) load_as_float<VEC16>(v + k, x + i + k);
        __align__(16) __nv_fp8x2_storage_t q[PACK / 2];
        for (int k = 0; k < PACK / 2; k++) q[k] = fp8_quantize2<FORMAT>(v[2 * k], v[2 * k + 1], s);
        *reinterpret_cast<int4*>(out + i) = *reinterpret_cast<const int4*>(q);
    }
}

template <__nv_fp8_interpretation_t FORMAT>
inline void fp8_cast_launch(__nv_fp8_storage_t* out, float* inv_scale, const floatX* x, const float* amax, size_t n,
                            cudaStream_t stream) {
    const int block = 256;
    if (n % FP8_PACK == 0 && (((uintptr_t)x | (uintptr_t)out) & 15) == 0) {
        unsigned grid = (unsigned)ceil_div<size_t>(n / FP8_PACK, block);
        fp8_cast_kernel<FORMAT, FP8_PACK><<<grid, block, 0, stream>>>(out, inv_scale, x, amax, n);
    } else {
        fp8_cast_kernel<FORMAT, 1><<<(unsigned)ceil_div<size_t>(n, block), block, 0, stream>>>(out, inv_scale, x,
                                                                                              amax, n);
    }
    cudaCheckLaunch();
}

// out (n FP8 values) = q(x) with s from *amax; writes *inv_scale = 1 / s (nullptr: not written). n > 0.
inline void fp8_cast(__nv_fp8_storage_t* out, float* inv_scale, const floatX* x, const float* amax, size_t n,
                     __nv_fp8_interpretation_t format, cudaStream_t stream) {
    if (n == 0) return;
    if (format == __NV_E4M3) fp8_cast_launch<__NV_E4M3>(out, inv_scale, x, amax, n, stream);
    else fp8_cast_launch<__NV_E5M2>(out, inv_scale, x, amax, n, stream);
}

// ------------------------------------------------------------------------------------------------ transposed cast

// A block casts a 64 x 64 tile of x. Each thread loads a 4-row x VEC16-column piece (4 16-byte loads; a warp's
// threads cover whole 128-byte row segments), packs each column's 4 bytes into one 32-bit word of the shared tile
// (column-major: tile[c][r / 4]; an odd row length in words keeps bank conflicts at 2-way), and writes its 4 rows to
// `out` if wanted. Then each output row (a column of x, 64 bytes of the tile) is written as four 16-byte stores.
// Needs rows % 16 == 0 (whole 16-byte output stores), cols % VEC16 == 0, x and out_t 16-byte aligned, out 8-byte.
constexpr int FP8_TILE = 64;
constexpr int FP8_TILE_THREADS = (FP8_TILE / 4) * (FP8_TILE / VEC16);  // 128 in bf16, 256 in fp32

template <__nv_fp8_interpretation_t FORMAT>
__global__ void __launch_bounds__(FP8_TILE_THREADS)
    fp8_cast_transpose_kernel(__nv_fp8_storage_t* out_t, __nv_fp8_storage_t* out, float* inv_scale, const floatX* x,
                              const float* amax, int rows, int cols) {
    constexpr int COL_PACKS = FP8_TILE / VEC16;
    __shared__ uint32_t tile[FP8_TILE][FP8_TILE / 4 + 1];
    const float s = fp8_cast_scale<FORMAT>(amax, inv_scale);
    const int tile_r = blockIdx.y * FP8_TILE, tile_c = blockIdx.x * FP8_TILE;
    const int pack = threadIdx.x % COL_PACKS, quad = threadIdx.x / COL_PACKS;
    const int r0 = tile_r + quad * 4, c0 = tile_c + pack * VEC16;
    if (r0 < rows && c0 < cols) {  // rows % 4 == 0 and cols % VEC16 == 0: the piece is wholly inside or outside
        float v[4][VEC16];
        for (int i = 0; i < 4; i++) load_as_float<VEC16>(v[i], x + (size_t)(r0 + i) * cols + c0);
        for (int j = 0; j < VEC16; j++) {
            uint32_t rows01 = fp8_quantize2<FORMAT>(v[0][j], v[1][j], s);
            uint32_t rows23 = fp8_quantize2<FORMAT>(v[2][j], v[3][j], s);
            tile[pack * VEC16 + j][quad] = rows01 | rows23 << 16;  // byte i = row r0 + i
        }
        if (out != nullptr) {
            for (int i = 0; i < 4; i++) {
                __align__(8) __nv_fp8x2_storage_t q[VEC16 / 2];
                for (int j = 0; j < VEC16 / 2; j++) q[j] = fp8_quantize2<FORMAT>(v[i][2 * j], v[i][2 * j + 1], s);
                __nv_fp8_storage_t* dst = out + (size_t)(r0 + i) * cols + c0;
                if constexpr (VEC16 == 8) *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(q);
                else *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(q);
            }
        }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < FP8_TILE * (FP8_TILE / 16); k += blockDim.x) {
        const int tc = k / (FP8_TILE / 16), segment = k % (FP8_TILE / 16);
        const int c = tile_c + tc, r = tile_r + segment * 16;
        if (c < cols && r < rows) {
            const uint32_t* w = &tile[tc][segment * 4];
            *reinterpret_cast<uint4*>(out_t + (size_t)c * rows + r) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// Any shape or alignment: one thread per element, in out_t's order (coalesced writes, strided reads).
template <__nv_fp8_interpretation_t FORMAT>
__global__ void fp8_cast_transpose_scalar_kernel(__nv_fp8_storage_t* out_t, __nv_fp8_storage_t* out,
                                                 float* inv_scale, const floatX* x, const float* amax, int rows,
                                                 int cols) {
    const float s = fp8_cast_scale<FORMAT>(amax, inv_scale);
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)rows * cols) return;
    size_t c = idx / rows, r = idx % rows;
    __nv_fp8_storage_t q = fp8_quantize<FORMAT>(to_float(x[r * cols + c]), s);
    out_t[idx] = q;
    if (out != nullptr) out[r * cols + c] = q;
}

template <__nv_fp8_interpretation_t FORMAT>
inline void fp8_cast_transpose_launch(__nv_fp8_storage_t* out_t, __nv_fp8_storage_t* out, float* inv_scale,
                                      const floatX* x, const float* amax, int rows, int cols, cudaStream_t stream) {
    if (rows % 16 == 0 && cols % VEC16 == 0 && (((uintptr_t)x | (uintptr_t)out_t) & 15) == 0 &&
        ((uintptr_t)out & 7) == 0) {
        dim3 grid(ceil_div(cols, FP8_TILE), ceil_div(rows, FP8_TILE));
        fp8_cast_transpose_kernel<FORMAT><<<grid, FP8_TILE_THREADS, 0, stream>>>(out_t, out, inv_scale, x, amax,
                                                                                 rows, cols);
    } else {
        const int block = 256;
        unsigned grid = (unsigned)ceil_div<size_t>((size_t)rows * cols, block);
        fp8_cast_transpose_scalar_kernel<FORMAT><<<grid, block, 0, stream>>>(out_t, out, inv_scale, x, amax, rows,
                                                                             cols);
    }
    cudaCheckLaunch();
}

// out_t (cols, rows) = q(x)^T and, unless out is nullptr, out (rows, cols) = q(x), both with s from *amax; writes
// *inv_scale = 1 / s (nullptr: not written). x (rows, cols) row-major; rows, cols > 0.
inline void fp8_cast_transpose(__nv_fp8_storage_t* out_t, __nv_fp8_storage_t* out, float* inv_scale,
                               const floatX* x, const float* amax, int rows, int cols,
                               __nv_fp8_interpretation_t format, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) return;
    if (format == __NV_E4M3) fp8_cast_transpose_launch<__NV_E4M3>(out_t, out, inv_scale, x, amax, rows, cols, stream);
    else fp8_cast_transpose_launch<__NV_E5M2>(out_t, out, inv_scale, x, amax, rows, cols, stream);
}
