// RMSNorm forward, fused residual + RMSNorm forward, and backward (dinp accumulated, deterministic dweight),
// validated against the CPU reference (dev/cpu/llama3_cpu.h) and timed.
//
//   rstd = 1 / sqrt(mean_c x^2 + eps),  out = x * rstd * w
//   dx = rstd * (dout*w - xhat * mean_c(dout*w*xhat)),  dw = sum_n dout * xhat,  xhat = x * rstd
//
// Versions (the newest = llmc/rmsnorm.cuh):
//   forward 1: the row loop one 16-byte pack at a time, pass 2 reading the row again from L1.
//   forward 2: all of a segment's loads issued first (8 packs per lane), the first segment kept in registers.
//   backward 1: three kernels: dinp, then the dweight partials (reading dout and inp from HBM a second time), then the
//     reduction of the partials.
//   backward 2: one kernel for dinp and the partials, summed per warp in shared memory; the reduction as before.
//   backward 3: version 2 with a segment's loads issued together (2 packs per lane: 1 and 4 were slower, 0.162 and
//     0.161 ms; 4 takes 210 registers in bf16). More warps per row chunk (session 16, two runs each): 4 warps
//     0.1354 / 0.1365 ms, 8 warps 0.1456 / 0.1447 ms; 16 need 256 KiB of shared memory at C = 4096 and fail there.
//     Twice the row chunks (1024, 16 rows each; three runs): 0.1481-0.1493 ms against 0.1357-0.1367 ms.
//   backward 4: version 3 also writing the recomputed forward output (out = x * rstd * w, bit-identical to the
//     forward's), which with recomputation replaces the trainer's separate rmsnorm_forward pass (one read of x saved).
//     H100 (session 20, one run): 0.1556 ms against version 3's 0.1367 and the plain forward's 0.0612 in the same
//     run, so 0.042 ms less per recomputed norm than backward + forward (32 in a 1B step: about 1.35 ms).
//     Tried after it, not kept: a whole row per warp (bf16, C <= 2048: a lane's 8 packs of dout, x and dinp loaded
//     together, dout and x kept for pass 2; the same bits): 255 registers, 2 blocks per SM, 0.1585 / 0.1611 ms
//     against version 4's 0.1554 / 0.1547 in the same two runs.
//   backward 5: version 4 with the warps' partial dweight rows (and scratch) in slot order, column c at
//     (c % VEC) * (C / VEC) + c / VEC. A lane owns VEC consecutive columns, so in column order a warp's 32 adds of
//     its j-th columns were VEC floats apart: 8-way bank conflicts in bf16 (4-way in fp32), two shared accesses per
//     element. In slot order they are 32 consecutive floats. The reduction kernel maps slots back to columns. The
//     same sums in the same order: dinp, dweight and out bit-identical to version 4's (checked on every case).
//     H100 (session 21), in the same runs: bf16 0.1447 / 0.1448 ms against version 4's 0.1556 / 0.1550 (7%; the
//     plain backward without out, in an earlier build of this layout, five runs alternating with the old one:
//     0.1194-0.1217 in four and 0.1361 in the first, against 0.1365-0.1381); fp32 0.3434 against 0.3435
//     (unchanged). With the new layout, 8 warps per block or 4 packs per segment were no better: 0.1214-0.1218 and
//     0.1341-0.1349 ms against 4 warps and 2 packs' 0.1198-0.1212 (backward without out, two runs).
// H100, N = 16384, C = 2048 (a 1B layer), ms and GB/s counting the minimum traffic:
//   bf16 forward 0.073 (1840) -> 0.066 (2045); fused residual forward 0.121 (2225) -> 0.101 (2650);
//        backward 0.200 (1340) -> 0.145 (1850) -> 0.137 (1965); with out: 0.155 (2160) -> 0.145 (2320)
//   fp32 forward 0.145 (1845) -> 0.104 (2570); fused residual forward 0.241 (2230) -> 0.194 (2763);
//        backward 0.378 (1420) -> 0.281 (1911) -> 0.279 (1927)
// With the FP8 mode's amax of what they write (block_commit_amax), H200, 1B shape (2026-11-26): fused residual
// forward 0.0788 -> 0.0848 ms, backward (+ out) 0.1141 -> 0.1162 ms.
// In the 1B step (33 backward and 65 forward calls) that is about 2.9 ms of kernel time (before backward 4 took
// over the 32 recompute forwards).
//
// C = 48 and 2048 take the 16-byte path in both precisions, C = 100 only in fp32, C = 50 and 2050 never; N = 37
// leaves a partial block of rows, N = 9000 gives several row chunks in the dweight reduction; C = 4096 needs more than
// 48 KiB of shared memory in the backward.
//
// build: make -C dev/cuda bin/rmsnorm   run: dev/cuda/bin/rmsnorm
#include "common.h"
#include "../../llmc/rmsnorm.cuh"

#include <algorithm>

// ------------------------------------------------------------------------------------------------ forward version 1
// The row loop as written first: one pack per iteration, pass 2 reading the row again from L1.

// One warp per row. FUSED: x = round(a + b) is first written to residual_out, and the norm uses the rounded values
// (what the next layer's residual stream holds). Otherwise x = a (b and residual_out unused).
// residual_out may alias a or b: each element is read and written by the same thread, reads first.
template <int VEC, bool FUSED>
__global__ void rmsnorm_forward_kernel_v1(floatX* residual_out, floatX* out, float* rstd, const floatX* a,
                                       const floatX* b, const floatX* weight, int N, int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t off = (size_t)row * C;
    float sum_sq = 0.0f;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float x[VEC];
        load_as_float<VEC>(x, a + off + c);
        if constexpr (FUSED) {
            float y[VEC];
            load_as_float<VEC>(y, b + off + c);
            for (int j = 0; j < VEC; j++) x[j] = to_float(from_float<floatX>(x[j] + y[j]));  // round as stored
            store_from_float<VEC>(residual_out + off + c, x);
        }
        for (int j = 0; j < VEC; j++) sum_sq += x[j] * x[j];
    }
    sum_sq = warp_reduce_sum(sum_sq);
    float r = rsqrtf(sum_sq / (float)C + eps);
    const floatX* x_src = FUSED ? residual_out : a;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float x[VEC], w[VEC];
        load_as_float<VEC>(x, x_src + off + c);
        load_as_float<VEC>(w, weight + c);
        for (int j = 0; j < VEC; j++) x[j] = x[j] * r * w[j];
        store_from_float<VEC>(out + off + c, x);
    }
    if (lane == 0) rstd[row] = r;
}

template <bool FUSED>
static void rmsnorm_forward_v1(floatX* residual_out, floatX* out, float* rstd, const floatX* a, const floatX* b,
                               const floatX* weight, int N, int C, float eps) {
    unsigned grid = (unsigned)ceil_div(N, 8);
    if (rmsnorm_vec_ok(C, out, a, weight, b, residual_out)) {
        rmsnorm_forward_kernel_v1<VEC16, FUSED><<<grid, 256>>>(residual_out, out, rstd, a, b, weight, N, C, eps);
    } else {
        rmsnorm_forward_kernel_v1<1, FUSED><<<grid, 256>>>(residual_out, out, rstd, a, b, weight, N, C, eps);
    }
    cudaCheckLaunch();
}

// ------------------------------------------------------------------------------------------------ backward version 1
// The backward as three kernels: dinp (one warp per row), then the partial dweight (a column walk over each row chunk,
// reading dout and inp a second time from HBM), then the same reduction as version 2. Chunks of ceil(N / 256) rows,
// at least 32.

// dinp += dx, one warp per row. Pass 1: dot = sum_c dout*weight*x, so mean_c(dxhat*xhat) = rstd * dot / C.
template <int VEC>
__global__ void rmsnorm_backward_dinp_kernel_v1(floatX* dinp, const floatX* dout, const floatX* inp,
                                             const floatX* weight, const float* rstd, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t off = (size_t)row * C;
    float dot = 0.0f;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float g[VEC], x[VEC], w[VEC];
        load_as_float<VEC>(g, dout + off + c);
        load_as_float<VEC>(x, inp + off + c);
        load_as_float<VEC>(w, weight + c);
        for (int j = 0; j < VEC; j++) dot += g[j] * w[j] * x[j];
    }
    dot = warp_reduce_sum(dot);
    float r = rstd[row];
    float mean = r * dot / (float)C;  // mean_c(dxhat * xhat)
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float g[VEC], x[VEC], w[VEC], d[VEC];
        load_as_float<VEC>(g, dout + off + c);
        load_as_float<VEC>(x, inp + off + c);
        load_as_float<VEC>(w, weight + c);
        load_as_float<VEC>(d, dinp + off + c);
        for (int j = 0; j < VEC; j++) d[j] += r * (g[j] * w[j] - x[j] * r * mean);
        store_from_float<VEC>(dinp + off + c, d);
    }
}

// Partial dweight: block (x = column slice of 2*blockDim.x columns, y = row chunk). Each thread owns two adjacent
// columns and walks the chunk's rows in order; a warp reads 64 consecutive elements of a row per step (coalesced).
__global__ void rmsnorm_backward_dweight_partial_kernel_v1(float* scratch, const floatX* dout, const floatX* inp,
                                                        const float* rstd, int N, int C, int rows_per_chunk) {
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (c >= C) return;
    bool two = c + 1 < C;
    int row_begin = blockIdx.y * rows_per_chunk;
    int row_end = min(N, row_begin + rows_per_chunk);
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 4
    for (int n = row_begin; n < row_end; n++) {
        size_t off = (size_t)n * C + c;
        float r = rstd[n];
        acc0 += to_float(dout[off]) * (to_float(inp[off]) * r);
        if (two) acc1 += to_float(dout[off + 1]) * (to_float(inp[off + 1]) * r);
    }
    float* dst = scratch + (size_t)blockIdx.y * C + c;
    dst[0] = acc0;
    if (two) dst[1] = acc1;
}

inline void rmsnorm_backward_v1(floatX* dinp, floatX* dweight, float* scratch, const floatX* dout, const floatX* inp,
                                const floatX* weight, const float* rstd, int N, int C, cudaStream_t stream) {
    if (N <= 0 || C <= 0) return;
    {
        const int block = 256, rows_per_block = block / 32;
        unsigned grid = (unsigned)ceil_div(N, rows_per_block);
        if (rmsnorm_vec_ok(C, dinp, dout, inp, weight)) {
            rmsnorm_backward_dinp_kernel_v1<VEC16><<<grid, block, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
        } else {
            rmsnorm_backward_dinp_kernel_v1<1><<<grid, block, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
        }
        cudaCheckLaunch();
    }
    int rows_per_chunk = std::max(32, ceil_div(N, 256));
    int n_chunks = ceil_div(N, rows_per_chunk);
    {
        const int block = 256;
        dim3 grid(ceil_div(C, 2 * block), n_chunks);
        rmsnorm_backward_dweight_partial_kernel_v1<<<grid, block, 0, stream>>>(scratch, dout, inp, rstd, N, C,
                                                                               rows_per_chunk);
        cudaCheckLaunch();
    }
    dim3 block(32, RMSNORM_REDUCE_GROUPS);
    rmsnorm_backward_dweight_reduce_kernel<<<ceil_div(C, 32), block, 0, stream>>>(dweight, scratch, n_chunks, C, 1,
                                                                                   true);
    cudaCheckLaunch();
}

// ------------------------------------------------------------------------------------------------ backward version 2
// One kernel for dinp and the partial dweight (summed per warp in shared memory), the row loop as version 1's.

// Block = one row chunk; each warp takes every RMSNORM_BACKWARD_WARPS-th row of it. Pass 1 over a row:
// dot = sum_c dout*weight*x, so mean_c(dxhat*xhat) = rstd * dot / C. Pass 2 (the row again, from L1): dinp += dx,
// and dout * xhat added into the warp's own fp32 row of shared memory (each element always by the same lane, so no
// synchronisation until the end). Then the warps' rows are added in warp order into scratch[chunk].
template <int VEC>
__global__ void __launch_bounds__(RMSNORM_BACKWARD_WARPS * 32)
    rmsnorm_backward_kernel_v2(floatX* dinp, float* scratch, const floatX* dout, const floatX* inp,
                            const floatX* weight, const float* rstd, int N, int C, int rows_per_chunk) {
    extern __shared__ float warp_dweight[];  // (RMSNORM_BACKWARD_WARPS, C)
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* my_dweight = warp_dweight + (size_t)warp * C;
    for (int c = lane * VEC; c < C; c += 32 * VEC)
        for (int j = 0; j < VEC; j++) my_dweight[c + j] = 0.0f;
    int row_end = min(N, (blockIdx.x + 1) * rows_per_chunk);
    for (int row = blockIdx.x * rows_per_chunk + warp; row < row_end; row += RMSNORM_BACKWARD_WARPS) {
        size_t off = (size_t)row * C;
        float dot = 0.0f;
        for (int c = lane * VEC; c < C; c += 32 * VEC) {
            float g[VEC], x[VEC], w[VEC];
            load_as_float<VEC>(g, dout + off + c);
            load_as_float<VEC>(x, inp + off + c);
            load_as_float<VEC>(w, weight + c);
            for (int j = 0; j < VEC; j++) dot += g[j] * w[j] * x[j];
        }
        dot = warp_reduce_sum(dot);
        float r = rstd[row];
        float mean = r * dot / (float)C;  // mean_c(dxhat * xhat)
        for (int c = lane * VEC; c < C; c += 32 * VEC) {
            float g[VEC], x[VEC], w[VEC], d[VEC];
            load_as_float<VEC>(g, dout + off + c);
            load_as_float<VEC>(x, inp + off + c);
            load_as_float<VEC>(w, weight + c);
            load_as_float<VEC>(d, dinp + off + c);
            for (int j = 0; j < VEC; j++) {
                d[j] += r * (g[j] * w[j] - x[j] * r * mean);
                my_dweight[c + j] += g[j] * (x[j] * r);
            }
            store_from_float<VEC>(dinp + off + c, d);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < RMSNORM_BACKWARD_WARPS; w++) sum += warp_dweight[(size_t)w * C + c];
        scratch[(size_t)blockIdx.x * C + c] = sum;
    }
}

template <int VEC>
static void launch_backward_v2(floatX* dinp, float* scratch, const floatX* dout, const floatX* inp,
                               const floatX* weight, const float* rstd, int N, int C) {
    size_t smem = (size_t)RMSNORM_BACKWARD_WARPS * C * sizeof(float);
    cudaCheck(cudaFuncSetAttribute(rmsnorm_backward_kernel_v2<VEC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)smem));
    rmsnorm_backward_kernel_v2<VEC><<<rmsnorm_backward_chunks(N), RMSNORM_BACKWARD_WARPS * 32, smem>>>(
        dinp, scratch, dout, inp, weight, rstd, N, C, rmsnorm_backward_rows_per_chunk(N));
    cudaCheckLaunch();
}
static void rmsnorm_backward_v2(floatX* dinp, floatX* dweight, float* scratch, const floatX* dout, const floatX* inp,
                                const floatX* weight, const float* rstd, int N, int C) {
    if (rmsnorm_vec_ok(C, dinp, dout, inp, weight)) launch_backward_v2<VEC16>(dinp, scratch, dout, inp, weight, rstd, N, C);
    else launch_backward_v2<1>(dinp, scratch, dout, inp, weight, rstd, N, C);
    dim3 block(32, RMSNORM_REDUCE_GROUPS);
    rmsnorm_backward_dweight_reduce_kernel<<<ceil_div(C, 32), block>>>(dweight, scratch,
                                                                        rmsnorm_backward_chunks(N), C, 1, true);
    cudaCheckLaunch();
}

// ------------------------------------------------------------------------------------------------ backward version 4
// llmc's kernel before version 5: the same passes, with the warps' partial dweight rows in column order, so a warp's
// j-th adds hit shared memory VEC floats apart (8-way bank conflicts in bf16). Version 3 is this kernel without out.

template <int VEC, bool OUT>
__global__ void __launch_bounds__(RMSNORM_BACKWARD_WARPS * 32)
    rmsnorm_backward_kernel_v4(floatX* dinp, float* scratch, floatX* out, const floatX* dout, const floatX* inp,
                            const floatX* weight, const float* rstd, int N, int C, int rows_per_chunk) {
    constexpr int SEGMENT = 32 * VEC * RMSNORM_BACKWARD_PACKS;
    extern __shared__ float warp_dweight[];  // (RMSNORM_BACKWARD_WARPS, C)
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* my_dweight = warp_dweight + (size_t)warp * C;
    for (int seg = 0; seg < C; seg += SEGMENT) {
        for (int k = 0; k < RMSNORM_BACKWARD_PACKS; k++) {
            int c = seg + (k * 32 + lane) * VEC;
            if (c < C)
                for (int j = 0; j < VEC; j++) my_dweight[c + j] = 0.0f;
        }
    }
    int row_end = min(N, (blockIdx.x + 1) * rows_per_chunk);
    for (int row = blockIdx.x * rows_per_chunk + warp; row < row_end; row += RMSNORM_BACKWARD_WARPS) {
        size_t off = (size_t)row * C;
        float dot = 0.0f;
        for (int seg = 0; seg < C; seg += SEGMENT) {
            RmsnormPack<VEC> g[RMSNORM_BACKWARD_PACKS], x[RMSNORM_BACKWARD_PACKS];
            rmsnorm_load_segment(g, dout + off, seg, lane, C);
            rmsnorm_load_segment(x, inp + off, seg, lane, C);
#pragma unroll
            for (int k = 0; k < RMSNORM_BACKWARD_PACKS; k++) {
                int c = seg + (k * 32 + lane) * VEC;
                if (c >= C) continue;
                RmsnormPack<VEC> w = rmsnorm_load<VEC>(weight + c);
                for (int j = 0; j < VEC; j++) dot += to_float(g[k].v[j]) * to_float(w.v[j]) * to_float(x[k].v[j]);
            }
        }
        dot = warp_reduce_sum(dot);
        float r = rstd[row];
        float mean = r * dot / (float)C;  // mean_c(dxhat * xhat)
        for (int seg = 0; seg < C; seg += SEGMENT) {
            RmsnormPack<VEC> g[RMSNORM_BACKWARD_PACKS], x[RMSNORM_BACKWARD_PACKS], d[RMSNORM_BACKWARD_PACKS];
            rmsnorm_load_segment(d, dinp + off, seg, lane, C);
            rmsnorm_load_segment(g, dout + off, seg, lane, C);
            rmsnorm_load_segment(x, inp + off, seg, lane, C);
#pragma unroll
            for (int k = 0; k < RMSNORM_BACKWARD_PACKS; k++) {
                int c = seg + (k * 32 + lane) * VEC;
                if (c >= C) continue;
                RmsnormPack<VEC> w = rmsnorm_load<VEC>(weight + c);
                for (int j = 0; j < VEC; j++) {
                    float gj = to_float(g[k].v[j]), xj = to_float(x[k].v[j]);
                    d[k].v[j] = from_float<floatX>(to_float(d[k].v[j]) + r * (gj * to_float(w.v[j]) - xj * r * mean));
                    my_dweight[c + j] += gj * (xj * r);
                    // the output takes x's register once xj holds it (the forward's expression and order)
                    if constexpr (OUT) x[k].v[j] = from_float<floatX>(xj * r * to_float(w.v[j]));
                }
                rmsnorm_store<VEC>(dinp + off + c, d[k]);
                if constexpr (OUT) rmsnorm_store<VEC>(out + off + c, x[k]);
            }
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < RMSNORM_BACKWARD_WARPS; w++) sum += warp_dweight[(size_t)w * C + c];
        scratch[(size_t)blockIdx.x * C + c] = sum;
    }
}

template <int VEC, bool OUT>
static void launch_backward_v4(floatX* dinp, float* scratch, floatX* out, const floatX* dout, const floatX* inp,
                               const floatX* weight, const float* rstd, int N, int C) {
    size_t smem = (size_t)RMSNORM_BACKWARD_WARPS * C * sizeof(float);
    cudaCheck(cudaFuncSetAttribute(rmsnorm_backward_kernel_v4<VEC, OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)smem));
    rmsnorm_backward_kernel_v4<VEC, OUT><<<rmsnorm_backward_chunks(N), RMSNORM_BACKWARD_WARPS * 32, smem>>>(
        dinp, scratch, out, dout, inp, weight, rstd, N, C, rmsnorm_backward_rows_per_chunk(N));
    cudaCheckLaunch();
}

static void rmsnorm_backward_v4(floatX* dinp, floatX* dweight, float* scratch, floatX* out, const floatX* dout,
                                const floatX* inp, const floatX* weight, const float* rstd, int N, int C) {
    bool vec = rmsnorm_vec_ok(C, dinp, dout, inp, weight, out);
    if (out != nullptr) {
        if (vec) launch_backward_v4<VEC16, true>(dinp, scratch, out, dout, inp, weight, rstd, N, C);
        else launch_backward_v4<1, true>(dinp, scratch, out, dout, inp, weight, rstd, N, C);
    } else {
        if (vec) launch_backward_v4<VEC16, false>(dinp, scratch, out, dout, inp, weight, rstd, N, C);
        else launch_backward_v4<1, false>(dinp, scratch, out, dout, inp, weight, rstd, N, C);
    }
    dim3 block(32, RMSNORM_REDUCE_GROUPS);
    rmsnorm_backward_dweight_reduce_kernel<<<ceil_div(C, 32), block>>>(dweight, scratch, rmsnorm_backward_chunks(N),
                                                                        C, 1, true);
    cudaCheckLaunch();
}

// scratch for any version
static size_t scratch_floats_any(int N, int C) {
    return std::max(rmsnorm_backward_scratch_floats(N, C), (size_t)ceil_div(N, std::max(32, ceil_div(N, 256))) * C);
}

// backward versions 3 and 4: version 4's kernel without and with out; version 5 = llmc/rmsnorm.cuh with out (out is
// written by versions 4 and 5 only)
constexpr int BACKWARD_VERSIONS = 5;
static void backward_version(int version, floatX* dinp, floatX* dweight, float* scratch, floatX* out,
                             const floatX* dout, const floatX* inp, const floatX* weight, const float* rstd, int N,
                             int C) {
    if (version == 1) rmsnorm_backward_v1(dinp, dweight, scratch, dout, inp, weight, rstd, N, C, 0);
    else if (version == 2) rmsnorm_backward_v2(dinp, dweight, scratch, dout, inp, weight, rstd, N, C);
    else if (version <= 4) rmsnorm_backward_v4(dinp, dweight, scratch, version == 4 ? out : nullptr, dout, inp, weight,
                                              rstd, N, C);
    else rmsnorm_backward(dinp, dweight, scratch, out, dout, inp, weight, rstd, N, C, true, 0);
}

// forward version 2 = llmc/rmsnorm.cuh
template <bool FUSED>
static void forward_version(int version, floatX* residual_out, floatX* out, float* rstd, const floatX* a,
                            const floatX* b, const floatX* weight, int N, int C, float eps) {
    if (version == 1) rmsnorm_forward_v1<FUSED>(residual_out, out, rstd, a, b, weight, N, C, eps);
    else rmsnorm_forward_launch<FUSED>(residual_out, out, rstd, nullptr, a, b, weight, N, C, eps, 0);
}


static void test_case(int N, int C, uint64_t seed) {
    printf("N=%d C=%d\n", N, C);
    const float eps = 1e-5f;
    size_t NC = (size_t)N * C;
    std::vector<float> a = round_to_floatX(random_floats(NC, seed));
    std::vector<float> b = round_to_floatX(random_floats(NC, seed + 1, 0.5f));
    std::vector<float> w = round_to_floatX(random_floats(C, seed + 2, 0.3f));
    for (auto& x : w) x += 1.0f;
    w = round_to_floatX(w);
    std::vector<float> dout = round_to_floatX(random_floats(NC, seed + 3));
    std::vector<float> dinp0 = round_to_floatX(random_floats(NC, seed + 4));
    std::vector<float> dw0 = round_to_floatX(random_floats(C, seed + 5));

    floatX* d_a = device_from_host<floatX>(a);
    floatX* d_b = device_from_host<floatX>(b);
    floatX* d_w = device_from_host<floatX>(w);
    floatX* d_dout = device_from_host<floatX>(dout);
    floatX *d_out, *d_res;
    float* d_rstd;
    cudaCheck(cudaMalloc(&d_out, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_res, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_rstd, N * sizeof(float)));

    std::vector<float> ref_out(NC), ref_rstd(N);
    cpu::rmsnorm_forward(ref_out.data(), ref_rstd.data(), a.data(), w.data(), N, C, eps);
    // fused residual: the residual is a + b rounded to floatX, and the norm is of that rounded residual
    std::vector<float> sum(NC);
    for (size_t i = 0; i < NC; i++) sum[i] = a[i] + b[i];
    std::vector<float> ref_res = round_to_floatX(sum);
    std::vector<float> ref_fout(NC), ref_frstd(N);
    cpu::rmsnorm_forward(ref_fout.data(), ref_frstd.data(), ref_res.data(), w.data(), N, C, eps);
    floatX* d_a2 = device_from_host<floatX>(a);
    for (int version = 1; version <= 2; version++) {
        printf("forward version %d\n", version);
        poison(d_out, NC * sizeof(floatX));
        poison(d_rstd, N * sizeof(float));
        forward_version<false>(version, nullptr, d_out, d_rstd, d_a, nullptr, d_w, N, C, eps);
        cudaCheck(cudaDeviceSynchronize());
        validate("forward out", host_from_device(d_out, NC), ref_out);
        validate("forward rstd", host_from_device(d_rstd, N), ref_rstd);

        poison(d_out, NC * sizeof(floatX));
        poison(d_res, NC * sizeof(floatX));
        poison(d_rstd, N * sizeof(float));
        forward_version<true>(version, d_res, d_out, d_rstd, d_a, d_b, d_w, N, C, eps);
        cudaCheck(cudaDeviceSynchronize());
        // the residual is one fp32 add then one rounding on both sides: exact
        validate("fused residual_out", host_from_device(d_res, NC), ref_res, 0.0);
        validate("fused out", host_from_device(d_out, NC), ref_fout);
        validate("fused rstd", host_from_device(d_rstd, N), ref_frstd);
        // in place: residual_out aliases a (the trainer's residual += branch)
        cudaCheck(cudaMemcpy(d_a2, d_a, NC * sizeof(floatX), cudaMemcpyDeviceToDevice));
        poison(d_out, NC * sizeof(floatX));
        forward_version<true>(version, d_a2, d_out, d_rstd, d_a2, d_b, d_w, N, C, eps);
        cudaCheck(cudaDeviceSynchronize());
        validate("fused in-place residual", host_from_device(d_a2, NC), ref_res, 0.0);
        validate("fused in-place out", host_from_device(d_out, NC), ref_fout);
    }

    // backward, using the GPU's rstd from the plain forward (what the trainer saves); d_out keeps that forward's
    // output, which versions 4 and 5 must write again bit for bit
    rmsnorm_forward(d_out, d_rstd, d_a, d_w, N, C, eps, 0);
    std::vector<float> rstd_gpu = host_from_device(d_rstd, N);
    std::vector<float> ref_dinp = dinp0, ref_dw = dw0;
    cpu::rmsnorm_backward(ref_dinp.data(), ref_dw.data(), dout.data(), a.data(), w.data(), rstd_gpu.data(), N, C);
    size_t scratch_floats = scratch_floats_any(N, C);
    float* d_scratch;
    cudaCheck(cudaMalloc(&d_scratch, scratch_floats * sizeof(float)));
    floatX *d_bout, *d_dinp3 = nullptr, *d_dw3 = nullptr;  // out; version 3's results, to compare with 4 and 5
    cudaCheck(cudaMalloc(&d_bout, NC * sizeof(floatX)));
    for (int version = 1; version <= BACKWARD_VERSIONS; version++) {
        printf("backward version %d\n", version);
        floatX* d_dinp[2];
        floatX* d_dw[2];
        for (int k = 0; k < 2; k++) {
            d_dinp[k] = device_from_host<floatX>(dinp0);
            d_dw[k] = device_from_host<floatX>(dw0);
            poison(d_scratch, scratch_floats * sizeof(float));  // scratch contents must not matter
            poison(d_bout, NC * sizeof(floatX));                // every element of out must be written
            backward_version(version, d_dinp[k], d_dw[k], d_scratch, d_bout, d_dout, d_a, d_w, d_rstd, N, C);
        }
        cudaCheck(cudaDeviceSynchronize());
        validate("backward dinp (accumulate)", host_from_device(d_dinp[0], NC), ref_dinp);
        validate("backward dweight (accumulate)", host_from_device(d_dw[0], C), ref_dw);
        validate_bitwise("dinp determinism", d_dinp[0], d_dinp[1], NC);
        validate_bitwise("dweight determinism", d_dw[0], d_dw[1], C);
        if (version >= 4) {
            // the second run's out (the first's was poisoned again): bit-identical to the forward's output, and
            // neither writing it nor version 5's layout changes anything else
            validate_bitwise("out = forward's out", d_bout, d_out, NC);
            validate_bitwise("dinp = version 3's", d_dinp[0], d_dinp3, NC);
            validate_bitwise("dweight = version 3's", d_dw[0], d_dw3, C);
        }
        if (version == 3) {
            d_dinp3 = d_dinp[0];
            d_dw3 = d_dw[0];
        }
        for (int k = 0; k < 2; k++) {
            if (version == 3 && k == 0) continue;  // kept for versions 4 and 5
            cudaCheck(cudaFree(d_dinp[k]));
            cudaCheck(cudaFree(d_dw[k]));
        }
    }
    for (void* p : {(void*)d_dinp3, (void*)d_dw3, (void*)d_bout}) cudaCheck(cudaFree(p));
    // the trainer's kernel overwriting dweight (a step's first micro-batch): poisoned dweight, reference from zero
    {
        std::vector<float> ref_dinp_over = dinp0, ref_dw_over(C, 0.0f);
        cpu::rmsnorm_backward(ref_dinp_over.data(), ref_dw_over.data(), dout.data(), a.data(), w.data(),
                              rstd_gpu.data(), N, C);
        floatX* d_dinp = device_from_host<floatX>(dinp0);
        floatX* d_dw;
        cudaCheck(cudaMalloc(&d_dw, C * sizeof(floatX)));
        poison(d_dw, C * sizeof(floatX));
        rmsnorm_backward(d_dinp, d_dw, d_scratch, nullptr, d_dout, d_a, d_w, d_rstd, N, C, false, 0);
        cudaCheck(cudaDeviceSynchronize());
        validate("backward dinp (dweight overwritten)", host_from_device(d_dinp, NC), ref_dinp_over);
        validate("backward dweight (overwritten)", host_from_device(d_dw, C), ref_dw_over);
        cudaCheck(cudaFree(d_dinp));
        cudaCheck(cudaFree(d_dw));
    }

    // the FP8 mode's amax outputs (llmc/rmsnorm.cuh, the newest versions): the same tensors written, and bit for bit
    // the amax of out (forward) or of the updated dinp (backward); an amax that starts above stays
    {
        floatX* d_dinp0 = device_from_host<floatX>(dinp0);  // the residual gradient the backward adds to
        floatX* d_dinp = device_from_host<floatX>(dinp0);
        floatX *d_out2, *d_res2, *d_dinp2;
        cudaCheck(cudaMalloc(&d_dinp2, NC * sizeof(floatX)));
        floatX *d_dw, *d_bout;
        float* d_amax;
        cudaCheck(cudaMalloc(&d_out2, NC * sizeof(floatX)));
        cudaCheck(cudaMalloc(&d_res2, NC * sizeof(floatX)));
        cudaCheck(cudaMalloc(&d_dw, C * sizeof(floatX)));
        cudaCheck(cudaMalloc(&d_bout, NC * sizeof(floatX)));
        cudaCheck(cudaMalloc(&d_amax, sizeof(float)));
        fused_residual_rmsnorm_forward(d_res, d_out, d_rstd, d_a, d_b, d_w, N, C, eps, 0);
        rmsnorm_backward(d_dinp, d_dw, d_scratch, nullptr, d_dout, d_a, d_w, d_rstd, N, C, false, 0);
        for (float start : {0.0f, 1e30f}) {
            cudaCheck(cudaMemcpy(d_amax, &start, sizeof(float), cudaMemcpyHostToDevice));
            poison(d_out2, NC * sizeof(floatX));
            poison(d_res2, NC * sizeof(floatX));
            fused_residual_rmsnorm_forward(d_res2, d_out2, d_rstd, d_a, d_b, d_w, N, C, eps, 0, d_amax);
            validate_bitwise("fused with amax: out", d_out2, d_out, NC);
            validate_bitwise("fused with amax: residual", d_res2, d_res, NC);
            validate_amax("fused forward amax", d_amax, d_out2, NC, start);
            // with out (the recompute) and without: both templates
            for (floatX* bout : {(floatX*)nullptr, d_bout}) {
                cudaCheck(cudaMemcpy(d_dinp2, d_dinp0, NC * sizeof(floatX), cudaMemcpyDeviceToDevice));
                cudaCheck(cudaMemcpy(d_amax, &start, sizeof(float), cudaMemcpyHostToDevice));
                rmsnorm_backward(d_dinp2, d_dw, d_scratch, bout, d_dout, d_a, d_w, d_rstd, N, C, false, 0, d_amax);
                validate_bitwise("backward with amax: dinp", d_dinp2, d_dinp, NC);
                validate_amax("backward amax (dinp)", d_amax, d_dinp2, NC, start);
            }
        }
        for (void* p : {(void*)d_out2, (void*)d_res2, (void*)d_dinp0, (void*)d_dinp, (void*)d_dinp2, (void*)d_dw,
                        (void*)d_bout, (void*)d_amax})
            cudaCheck(cudaFree(p));
    }

    for (void* p : {(void*)d_a, (void*)d_b, (void*)d_w, (void*)d_dout, (void*)d_out, (void*)d_res, (void*)d_rstd,
                    (void*)d_a2, (void*)d_scratch})
        cudaCheck(cudaFree(p));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    test_case(37, 48, 1);
    test_case(37, 50, 2);
    test_case(37, 100, 3);
    test_case(37, 2048, 4);
    test_case(9000, 48, 5);
    test_case(1, 2, 6);
    test_case(1000, 4096, 7);  // 64 KiB of shared memory per block in the backward: the opt-in path
    test_case(9000, 2050, 8);

    int N = 16384, C = 2048;
    printf("timing N=%d C=%d\n", N, C);
    size_t NC = (size_t)N * C;
    floatX* d_x = device_random<floatX>(NC, 10);
    floatX* d_y = device_random<floatX>(NC, 11);
    floatX* d_w = device_random<floatX>(C, 12);
    floatX* d_g = device_random<floatX>(NC, 13, 1e-3f);
    floatX *d_out, *d_res, *d_dinp, *d_dw;
    float *d_rstd, *d_scratch;
    cudaCheck(cudaMalloc(&d_out, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_res, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dinp, NC * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_dw, C * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_rstd, N * sizeof(float)));
    cudaCheck(cudaMalloc(&d_scratch, scratch_floats_any(N, C) * sizeof(float)));
    cudaCheck(cudaMemset(d_dinp, 0, NC * sizeof(floatX)));
    cudaCheck(cudaMemset(d_dw, 0, C * sizeof(floatX)));
    double row_bytes = (double)NC * sizeof(floatX);
    float ms;
    char name[48];
    for (int version = 1; version <= 2; version++) {
        ms = benchmark_ms(20, [&] { forward_version<false>(version, nullptr, d_out, d_rstd, d_x, nullptr, d_w, N, C, 1e-5f); });
        snprintf(name, sizeof(name), "forward version %d", version);
        report_bandwidth(name, ms, 2 * row_bytes + N * 4.0);
        ms = benchmark_ms(20, [&] { forward_version<true>(version, d_res, d_out, d_rstd, d_x, d_y, d_w, N, C, 1e-5f); });
        snprintf(name, sizeof(name), "fused residual forward version %d", version);
        report_bandwidth(name, ms, 4 * row_bytes + N * 4.0);
    }
    // minimum traffic: read dout, inp, dinp; write dinp, and out in versions 4 and 5 (version 1's dweight pass re-reads
    // dout and inp, counted as 0)
    for (int version = 1; version <= BACKWARD_VERSIONS; version++) {
        ms = benchmark_ms(20, [&] {
            backward_version(version, d_dinp, d_dw, d_scratch, d_out, d_g, d_x, d_w, d_rstd, N, C);
        });
        snprintf(name, sizeof(name), version >= 4 ? "backward version %d (+ out)" : "backward version %d", version);
        report_bandwidth(name, ms, (version >= 4 ? 5 : 4) * row_bytes + N * 4.0);
    }
    // the FP8 mode's amax outputs (the trainer's calls): fused forward with the amax of out, backward with dinp's
    float* d_amax;
    cudaCheck(cudaMalloc(&d_amax, sizeof(float)));
    ms = benchmark_ms(20, [&] { fused_residual_rmsnorm_forward(d_res, d_out, d_rstd, d_x, d_y, d_w, N, C, 1e-5f, 0); });
    report_bandwidth("fused forward", ms, 4 * row_bytes + N * 4.0);
    ms = benchmark_ms(20, [&] {
        fused_residual_rmsnorm_forward(d_res, d_out, d_rstd, d_x, d_y, d_w, N, C, 1e-5f, 0, d_amax);
    });
    report_bandwidth("fused forward + amax", ms, 4 * row_bytes + N * 4.0);
    ms = benchmark_ms(20, [&] { rmsnorm_backward(d_dinp, d_dw, d_scratch, d_out, d_g, d_x, d_w, d_rstd, N, C, true, 0); });
    report_bandwidth("backward (+ out)", ms, 5 * row_bytes + N * 4.0);
    ms = benchmark_ms(20, [&] {
        rmsnorm_backward(d_dinp, d_dw, d_scratch, d_out, d_g, d_x, d_w, d_rstd, N, C, true, 0, d_amax);
    });
    report_bandwidth("backward (+ out) + amax", ms, 5 * row_bytes + N * 4.0);
    cudaCheck(cudaFree(d_amax));

    for (void* p : {(void*)d_x, (void*)d_y, (void*)d_w, (void*)d_g, (void*)d_out, (void*)d_res, (void*)d_dinp,
                    (void*)d_dw, (void*)d_rstd, (void*)d_scratch})
        cudaCheck(cudaFree(p));
    return finish(argv[0]);
}
