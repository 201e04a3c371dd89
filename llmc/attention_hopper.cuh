// Causal GQA attention forward and backward for Hopper (sm_90a): wgmma tensor cores, bf16 builds only. Forward:
// head_dim 128; backward: head_dim 64 and 128.
//
// Same contracts as attention_forward / attention_backward in attention.cuh (math, layouts, lse definition are
// described there): qkv (B, T, (H + 2 KV) hd) -> out (B, T, H hd), lse (B, H, T) fp32 = log-sum-exp of each row of
// scaled scores; backward: dqkv from dout, qkv, out, lse, deterministic (every output element has one writer). This
// file is included by attention.cuh after its tensor-core section, whose helpers it reuses (cp.async, bf16 packing,
// attention_set_smem, attention_delta, ATTN_LOG2E / ATTN_LN2); it is not a standalone header. attention_forward and
// attention_backward try attention_forward_hopper / attention_backward_hopper first and fall back to the mma.sync
// kernels (or the scalar ones) when they return false.
//
// Why a second implementation: mma.sync (attention.cuh's tensor-core path) tops out near 290 TFLOP/s on an H200,
// because a warp of 16 or 32 rows re-reads K and V fragments from shared memory through registers for every mma.
// Hopper's wgmma lets a warpgroup (4 warps, 64 rows) multiply straight out of shared memory, asynchronously. Forward:
// 417 / 443 TFLOP/s at hd 128 (B, T = 2, 4096 / 1, 8192; H 32, KV 8) against 280 / 288; at hd 64 it was no faster
// than mma.sync (too little matmul per tile to hide the softmax), so the hd 64 forward stays on attention.cuh's
// kernel. Backward (section "Backward kernels"): 217 / 338 / 356 TFLOP/s against 167 / 209 / 219 for mma.sync at
// (B, T, hd) = (4, 2048, 64) / (2, 4096, 128) / (1, 8192, 128). History, the variants tried and what limits the
// kernels: dev/cuda/attention_forward.cu and attention_backward.cu, "Versions".
//
// Forward, in brief (details in the comments below):
//   * Warpgroups: a CTA of 256 threads = 2 consumer warpgroups of 64 query rows each (128 queries per CTA), sharing
//     K / V tiles of 128 keys; S = Q K^T is wgmma m64n128k16 with Q and K read from shared memory by descriptor, O +=
//     P V is wgmma m64nHDk16 with P fed from registers (the score accumulator, converted to bf16 in place).
//   * Swizzle and descriptors: every tile is stored in the 128-byte swizzled layout the wgmma descriptors read
//     (conflict-free both for the cp.async writes and the tensor-core reads); a descriptor is just (address, stride
//     offsets, swizzle mode), so stepping through k slices is address arithmetic.
//   * Ping-pong: the two warpgroups take turns issuing their wgmma batches (named barriers), so one warpgroup's
//     softmax (CUDA cores, exp2) runs while the other's matmuls occupy the tensor cores; K / V go through 3 cp.async
//     stages so one __syncthreads per tile suffices.
// The kernel is templated on (HD, NH, PP) so dev/cuda/attention_forward.cu can time the variants it was chosen from;
// attention_forward_hopper runs the chosen one, <128, 1, true>.
//
// Backward, in brief: the same two-kernel split as attention.cuh's (dK/dV per key tile, dQ per query tile), on the
// same warpgroups, swizzle and descriptors; described at "Backward kernels".
//
// Builds: the kernels' bodies exist only when compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL, the Makefiles' choice
// for GPU_COMPUTE_CAPABILITY=90); for any other target they compile to a trap, and the host side never launches them
// (it checks that the device is compute capability 9.0 and that the kernel image loaded for it is sm_90 code).
#pragma once

#if !defined(ENABLE_FP32)

#include <cstdint>
#include <initializer_list>

// ----------------------------------------------------------------------------------------------------------------
// Forward kernel, and the wgmma conventions the backward kernels share
//
// Instruction: wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16, issued by a warpgroup (4 consecutive warps,
// 128 threads): D (64 x N fp32, registers) += A (64 x 16) B (16 x N). B always comes from shared memory through a
// 64-bit matrix descriptor; A from a descriptor (Q for S = Q K^T) or from registers (P for O = P V). The instruction
// is asynchronous: wgmma.fence before a batch (accumulator / A registers were written by ordinary instructions),
// wgmma.commit_group after it, wgmma.wait_group 0 before the results are read (or the A / B sources reused).
//
// Register fragments (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" for wgmma .m64nNk16): warp w of
// the warpgroup owns rows 16 w .. 16 w + 15 of D and of a register A; with g = lane / 4, c = 2 (lane % 4):
//   D: d[4 j + 0, 1] = D[16 w + g][8 j + c, +1]     d[4 j + 2, 3] = D[16 w + g + 8][8 j + c, +1]    (j < N / 8)
//   A: a0 = A[g][c, c+1]  a1 = A[g+8][c, c+1]  a2 = A[g][c+8, c+9]  a3 = A[g+8][c+8, c+9]  (rows of the warp's slice)
// i.e. per warp exactly the mma.sync m16n8k16 C and A fragments, so the online softmax (quad reductions) and the
// accumulator -> A reuse of P are those of attention.cuh's mma.sync kernel (atc_acc_to_a).
//
// Shared-memory layout: the 128-byte swizzle that the descriptors' swizzle mode 1 reads. A tile of R rows x HD bf16
// is stored as HD / 64 "column blocks" of R rows x 128 bytes (64 elements); in a block, the 16-byte chunk ch (< 8)
// of row r sits at byte r * 128 + 16 (ch ^ (r % 8)), blocks 1024-byte aligned (the swizzle XORs address bits 4-6
// with bits 7-9, so it is a function of the address; the 8-row, 1024-byte atoms must start on 1024-byte boundaries,
// descriptor base offset 0). Conflict-free for the 16-byte cp.async writes (a row's 8 chunks hit 8 distinct chunk
// slots) and for the tensor-core reads. Descriptor fields (PTX ISA "Matrix Descriptor Format"): bits 0-13 start
// address >> 4, 16-29 leading byte offset (LBO) >> 4, 32-45 stride byte offset (SBO) >> 4, 62-63 swizzle (1: 128 B).
//   * K-major operands (Q as A, K as B of S = Q K^T: rows m / n, the reduction index d contiguous): SBO = 1024 (from
//     one 8-row group to the next), LBO unused (1). The k16 slice kk starts at column block kk / 4, byte 32 (kk % 4)
//     of row 0: the descriptor start address advances by 32 bytes inside the atom, the hardware applies the swizzle.
//   * MN-major operand (V as B of O = P V: B[key][d] with d, the N index, contiguous; "transpose B" = 1): SBO = 1024
//     (from one 8-key group to the next), LBO = R * 128 (from one 64-wide column block of d to the next). The k16
//     slice of keys kk starts at row 16 kk (byte 2048 kk).
//
// CTA = 128 queries x (head, batch) = 2 warpgroups of 64 query rows (256 threads), sharing the K / V tiles. Q (128 x
// HD) is loaded once; K and V tiles of BN = 128 keys stream through a cp.async pipeline up to the causal diagonal
// (tile j+1 loads while tile j is computed; after each tile lands: cp.async.wait_group, then fence.proxy.async so
// the tensor cores (async proxy) see what cp.async (generic proxy) wrote, then __syncthreads). With 2 stages a second
// __syncthreads ends each tile (the stage is refilled next); with 3 (the ping-pong variant, PP) it is not needed.
// Per tile and warpgroup: S (64 x BN) = Q K^T as HD / 16 wgmma m64nBNk16 (A, B descriptors); wait; causal mask on
// the diagonal tile; online softmax in the log2 domain on the fragment (as mma.sync); P -> bf16 A registers;
// O (64 x HD fp32, HD / 2 registers per thread) = alpha O + P V as BN / 16 wgmma m64nHDk16 (A registers,
// B descriptor); wait.
// Epilogue: O / l staged as bf16 through the warpgroup's own (dead) rows of the Q tile (same swizzle: conflict-free
// fragment writes), then 16-byte coalesced global stores; lse = (m + log2 l) ln 2.
// Variants (template NH, PP; measured in dev/cuda/attention_forward.cu, "Versions"): NH = 2 splits each key tile
// into two halves with their own commit groups (S of the second half runs during the first half's softmax, P V of
// the first during the second's); PP makes the warpgroups take turns issuing their wgmma batches (named barriers),
// so one warpgroup's softmax runs while the other's matmuls do (FA3's "ping-pong", here without a producer warp).
// smem (HD 128): Q 32 KiB + 3 stages x (K, V) 2 x 32 KiB = 224 KiB (+1 KiB for aligning to 1024): one CTA per SM;
// registers: S 64 + O 64 + P 32 fp32/b32 per thread, bounded at 255 (256 threads, 1 CTA per SM).

constexpr int HW_THREADS = 256;  // 2 warpgroups
constexpr int HW_ROWS = 128;     // rows per CTA, 64 per warpgroup: queries (keys in the dK/dV kernel)
constexpr int HW_BN = 128;       // keys per K / V tile

__device__ __forceinline__ void hw_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void hw_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void hw_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Ties accumulator registers to this point of the program: the compiler may not move their reads or writes across
// it (so nothing touches them between the asynchronous wgmma and its wait).
template <int R>
__device__ __forceinline__ void hw_fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void hw_fence_regs(uint32_t (&a)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(a[i][e])::"memory");
    }
}
// Named barriers (id 0 is __syncthreads): bar.sync waits for `count` threads to arrive (itself included);
// bar.arrive arrives without waiting. Ids may differ per warp (a register), the count must not.
template <int COUNT>
__device__ __forceinline__ void hw_bar_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory");
}
template <int COUNT>
__device__ __forceinline__ void hw_bar_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async, st.shared) visible to the async proxy (wgmma).
__device__ __forceinline__ void hw_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Matrix descriptor, 128-byte swizzle (see the section comment). addr: shared-window byte address.
__device__ __forceinline__ uint64_t hw_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)((lbo & 0x3FFFF) >> 4) << 16 |
           (uint64_t)((sbo & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}

// Byte offset of 16-byte chunk ch (< HD / 8) of row r in a swizzled tile of R rows.
template <int R>
__device__ __forceinline__ uint32_t hw_swz(int r, int ch) {
    return (uint32_t)((ch / 8) * R * 128 + r * 128 + 16 * ((ch % 8) ^ (r % 8)));
}

// cp.async loads of rows [r0, r0 + R) of one head into a swizzled tile at shared address dst; rows >= T zero-filled
// (source clamped to row 0, nothing read). src: row 0, column 0 of the head; rows row_stride elements apart.
template <int HD, int R>
__device__ __forceinline__ void hw_load_tile(uint32_t dst, const __nv_bfloat16* src, size_t row_stride, int r0, int T) {
    constexpr int CHUNKS = HD / 8;
    static_assert((R * CHUNKS) % HW_THREADS == 0, "tile must split evenly over the CTA");
#pragma unroll
    for (int i = 0; i < R * CHUNKS / HW_THREADS; i++) {
        const int idx = i * HW_THREADS + threadIdx.x, r = idx / CHUNKS, ch = idx % CHUNKS;  // coalesced
        const bool valid = r0 + r < T;
        atc_cp_async16(dst + hw_swz<R>(r, ch), src + (size_t)(valid ? r0 + r : 0) * row_stride + 8 * ch,
                       valid ? 16 : 0);
    }
}

// wgmma wrappers. scale_d = 0: D = A B (the accumulator's old contents ignored); 1: D += A B.
// hw_wgmma_ss: A (K-major) and B (K-major) from descriptors. hw_wgmma_rs: A from registers, B MN-major
// ("transpose B", TRANS_B = 1, the default) or K-major (TRANS_B = 0).
__device__ __forceinline__ void hw_wgmma_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
template <int TRANS_B = 1>
__device__ __forceinline__ void hw_wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}
__device__ __forceinline__ void hw_wgmma_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
template <int TRANS_B = 1>
__device__ __forceinline__ void hw_wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

// Online-softmax update for one part of a score tile (NS fragment values per thread, rows row0 (r = 0: elements
// 4 jn + 0, 1) and row0 + 8 (r = 1: 4 jn + 2, 3)): raises the running max m (log2 domain, scaled), overwrites s with
// exp2(s scale_log2 - m), adds this lane's share of the row sums to l, and returns the factor alpha that rescales
// what was accumulated under the old max. As in attention.cuh's mma.sync kernel; masked entries (-inf) give
// exp2(-inf) = 0.
template <int NS>
__device__ __forceinline__ void hw_softmax_update(float (&s)[NS], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                  float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = -INFINITY;
#pragma unroll
        for (int jn = 0; jn < NS / 4; jn++) mx = fmaxf(mx, fmaxf(s[4 * jn + 2 * r], s[4 * jn + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));  // the 4 lanes of a quad share the row
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m[r], mx * scale_log2);
        const float base = m_new == -INFINITY ? 0.0f : m_new;  // no (-inf) - (-inf) for a fully masked row
        alpha[r] = exp2f(m[r] - base);
        m[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int jn = 0; jn < NS / 4; jn++) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s[4 * jn + e] = exp2f(fmaf(s[4 * jn + e], scale_log2, -base));
                sum += s[4 * jn + e];
            }
        }
        l[r] = l[r] * alpha[r] + sum;
    }
}

template <int HD, bool PP>
constexpr size_t attention_forward_hopper_smem_bytes() {
    constexpr int STAGES = PP ? 3 : 2;
    return sizeof(__nv_bfloat16) * HD * (HW_ROWS + 2 * STAGES * HW_BN) + 1024;  // + 1024: room to align the base
}

// grid (B * H, ceil(T / 128)), block 256 (2 warpgroups). NH: parts per key tile (1, or 2 to overlap S of the second
// half with the softmax of the first, and P V of the first with the softmax of the second). PP ("ping-pong"): the
// two warpgroups take turns issuing their wgmma batches (named barriers 1 and 2: "warpgroup w may issue"), so one
// warpgroup's softmax runs while the other's matmuls do; with 3 K / V stages, one __syncthreads per tile (tile
// landed) suffices, so the warpgroups may drift apart by part of a tile instead of running in lockstep.
template <int HD, int NH, bool PP>
__global__ void __launch_bounds__(HW_THREADS, 1)
    attention_forward_hopper_kernel(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int T, int H, int KV,
                                    float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma exists only in sm_90a code; elsewhere: see the #else at the end
    constexpr int BN = HW_BN, QBYTES = HW_ROWS * HD * 2, TBYTES = BN * HD * 2;  // tile sizes in bytes
    constexpr int KP = BN / NH;                                                 // keys per part
    static_assert(NH == 1 || NH == 2, "1 or 2 parts per key tile");
    constexpr int STAGES = PP ? 3 : 2;
    extern __shared__ uint8_t hw_smem_raw[];
    // Swizzle atoms must start on 1024-byte boundaries (descriptor base offset 0): align the shared address.
    const uint32_t smem = (atc_smem_u32(hw_smem_raw) + 1023u) & ~1023u;
    const uint32_t q_sm = smem;                  // Q (128 x HD), swizzled
    const uint32_t k_sm = q_sm + QBYTES;         // STAGES x K (BN x HD)
    const uint32_t v_sm = k_sm + STAGES * TBYTES;  // STAGES x V (BN x HD)
    uint8_t* smem_ptr = hw_smem_raw + (smem - atc_smem_u32(hw_smem_raw));  // generic pointer to the aligned base

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * HW_ROWS;  // the longest (last) query tiles are scheduled first
    const int qwg = q0 + 64 * wg;                            // the warpgroup's first query
    const int row0 = qwg + 16 * warp + g;                    // this thread's rows: row0 and row0 + 8
    const size_t stride = (size_t)(H + 2 * KV) * HD;
    const __nv_bfloat16* q_src = qkv + (size_t)b * T * stride + (size_t)h * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    const int n_tiles = ceil_div(min(q0 + HW_ROWS, T), BN);  // causal: keys up to the CTA's last query
    hw_load_tile<HD, HW_ROWS>(q_sm, q_src, stride, q0, T);
    hw_load_tile<HD, BN>(k_sm, k_src, stride, 0, T);
    hw_load_tile<HD, BN>(v_sm, v_src, stride, 0, T);
    atc_cp_async_commit();

    float o[HD / 2];             // O accumulator fragment (64 x HD per warpgroup)
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows row0, row0 + 8: running max (log2), lane sums
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.0f;
    if (PP && wg == 1) hw_bar_arrive<256>(1);  // warpgroup 0 issues first

    for (int j = 0; j < n_tiles; j++) {
        const int stage = j % STAGES, next = (j + 1) % STAGES;
        if (j + 1 < n_tiles) {  // prefetch tile j+1 into the stage of tile j+1-STAGES (last read before the
                                // __syncthreads ending iteration j-1)
            hw_load_tile<HD, BN>(k_sm + next * TBYTES, k_src, stride, (j + 1) * BN, T);
            hw_load_tile<HD, BN>(v_sm + next * TBYTES, v_src, stride, (j + 1) * BN, T);
            atc_cp_async_commit();
            atc_cp_async_wait<1>();  // tile j (and Q) landed; tile j+1 may still be in flight
        } else {
            atc_cp_async_wait<0>();
        }
        hw_fence_proxy_async();  // this thread's cp.async writes -> visible to wgmma (async proxy)
        __syncthreads();         // ... and everyone's

        const int k0 = j * BN;
        // Warpgroup-uniform: some key of the tile is visible to some query of the warpgroup (with BN = 128 always
        // true; PP never skips, as the turn-taking needs both warpgroups to issue the same number of batches).
        if (PP || k0 <= qwg + 63) {
            const uint32_t k_st = k_sm + stage * TBYTES, v_st = v_sm + stage * TBYTES;
            // S = Q K^T, in NH parts of KP keys (each its own commit group). The k16 slice kk of d is column block
            // kk / 4, bytes 32 (kk % 4) of each row; key part hh starts at row KP hh of K (byte 128 KP hh).
            float s[NH][KP / 2];
            if constexpr (PP) hw_bar_sync<256>(1 + wg);  // my turn to issue
            hw_fence();
#pragma unroll
            for (int hh = 0; hh < NH; hh++) {
#pragma unroll
                for (int kk = 0; kk < HD / 16; kk++) {
                    const uint32_t off = 32 * (kk % 4);
                    const uint64_t da = hw_desc(q_sm + (kk / 4) * (HW_ROWS * 128) + 64 * wg * 128 + off, 16, 1024);
                    const uint64_t db = hw_desc(k_st + (kk / 4) * (BN * 128) + KP * hh * 128 + off, 16, 1024);
                    hw_wgmma_ss(s[hh], da, db, kk > 0);
                }
                hw_commit();
            }
            if constexpr (PP) hw_bar_arrive<256>(2 - wg);  // the other warpgroup's turn
            uint32_t p[NH][KP / 16][4];  // P of each key part as bf16 A registers, live until its P V wgmma is done
#pragma unroll
            for (int hh = 0; hh < NH; hh++) {
                // Groups complete in order. Part 0: S_0 done, S_1 may run on. Part 1: S_1 done, P_0 V may run on.
                if (hh + 1 < NH || NH == 2) hw_wait<1>();
                else hw_wait<0>();
                hw_fence_regs(s[hh]);
                const int kp0 = k0 + KP * hh;  // the part's first key
                if (kp0 + KP - 1 > qwg) {      // diagonal: some key is after some query of the warpgroup
#pragma unroll
                    for (int i = 0; i < KP / 2; i++) {
                        const int key = kp0 + 8 * (i / 4) + c + (i % 2), q = row0 + 8 * ((i / 2) % 2);
                        if (key > q) s[hh][i] = -INFINITY;
                    }
                }
                float alpha[2];
                hw_softmax_update(s[hh], m, l, alpha, scale_log2);
#pragma unroll
                for (int kk = 0; kk < KP / 16; kk++) {  // n8 groups 2 kk, 2 kk + 1 = keys 16 kk .. 16 kk + 15
                    p[hh][kk][0] = atc_pack_bf16(s[hh][8 * kk + 0], s[hh][8 * kk + 1]);
                    p[hh][kk][1] = atc_pack_bf16(s[hh][8 * kk + 2], s[hh][8 * kk + 3]);
                    p[hh][kk][2] = atc_pack_bf16(s[hh][8 * kk + 4], s[hh][8 * kk + 5]);
                    p[hh][kk][3] = atc_pack_bf16(s[hh][8 * kk + 6], s[hh][8 * kk + 7]);
                }
                if (hh > 0) {  // the previous part's P V must be done before O is rescaled
                    hw_wait<0>();
                    hw_fence_regs(o);
                }
#pragma unroll
                for (int jn = 0; jn < HD / 8; jn++) {
                    o[4 * jn + 0] *= alpha[0];
                    o[4 * jn + 1] *= alpha[0];
                    o[4 * jn + 2] *= alpha[1];
                    o[4 * jn + 3] *= alpha[1];
                }
                // O += P V: the V k16 slice kk of part hh is rows KP hh + 16 kk (byte 128 (KP hh + 16 kk)), MN-major.
                hw_fence_regs(p[hh]);  // P and the rescaled O are written before the wgmma.fence
                hw_fence_regs(o);
                if constexpr (PP) hw_bar_sync<256>(1 + wg);
                hw_fence();
#pragma unroll
                for (int kk = 0; kk < KP / 16; kk++) {
                    hw_wgmma_rs(o, p[hh][kk], hw_desc(v_st + 128 * (KP * hh + 16 * kk), BN * 128, 1024), 1);
                }
                hw_commit();
                if constexpr (PP) hw_bar_arrive<256>(2 - wg);
            }
            hw_wait<0>();
            hw_fence_regs(o);
        }
        // 2 stages: both warpgroups done with this stage before the next iteration's prefetch overwrites it. 3
        // stages (PP): the prefetch at iteration j+1 overwrites tile j-1, which both warpgroups finished before the
        // __syncthreads at the top of iteration j.
        if (!PP) __syncthreads();
    }
    if (PP && wg == 0) hw_bar_sync<256>(1);  // consume warpgroup 1's last pass, so no arrival is left pending

    // Epilogue. lse, then O / l as bf16 into the warpgroup's own rows of the (dead) Q tile, then coalesced stores.
    float inv_l[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        sum += __shfl_xor_sync(0xffffffff, sum, 2);
        inv_l[r] = 1.0f / sum;
        const int q = row0 + 8 * r;
        if (lane % 4 == 0 && q < T) lse[(size_t)blockIdx.x * T + q] = (m[r] + log2f(sum)) * ATTN_LN2;
    }
    const int lr = 64 * wg + 16 * warp + g;  // the thread's first row inside the Q tile
#pragma unroll
    for (int jn = 0; jn < HD / 8; jn++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            *reinterpret_cast<uint32_t*>(smem_ptr + hw_swz<HW_ROWS>(lr + 8 * r, jn) + 2 * c) =
                atc_pack_bf16(o[4 * jn + 2 * r] * inv_l[r], o[4 * jn + 2 * r + 1] * inv_l[r]);
        }
    }
    __syncthreads();
    const size_t out_stride = (size_t)H * HD;
    __nv_bfloat16* dst = out + (size_t)b * T * out_stride + (size_t)h * HD;
    constexpr int CHUNKS = HD / 8;
#pragma unroll
    for (int i = 0; i < HW_ROWS * CHUNKS / HW_THREADS; i++) {
        const int idx = i * HW_THREADS + threadIdx.x, r = idx / CHUNKS, ch = idx % CHUNKS;
        if (q0 + r < T) {
            *reinterpret_cast<int4*>(dst + (size_t)(q0 + r) * out_stride + 8 * ch) =
                *reinterpret_cast<const int4*>(smem_ptr + hw_swz<HW_ROWS>(r, ch));
        }
    }
#else
    // Not sm_90a code: the host never launches this (attention_hopper_usable); fail loudly if someone does.
    __trap();
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// Backward kernels
//
// The same split as attention.cuh's tensor-core backward (a dK/dV kernel per key tile and kv head, a dQ kernel per
// query tile and head, every output element with one writer: deterministic, no atomics), with wgmma in place of
// mma.sync. D = rowsum(dO o O) comes first from attention_delta (attention.cuh).
//
// dK/dV: CTA = 128 keys x (kv head, batch) = 2 warpgroups of 64 keys (256 threads); K and V (128 x HD) stay in smem.
// Work items are (query head of the group, query tile of BQ from the diagonal), in a fixed order; Q, dO tiles and
// their lse, D stream through 4 cp.async stages, two items ahead. Per item and warpgroup (rows = its 64 keys,
// columns = the BQ queries, all fp32 accumulators):
//   S^T = K Q^T, dP^T = V dO^T        wgmma m64nBQk16, A and B from smem descriptors (both K-major), two groups
//   P^T = exp2(S^T scale log2 e - lse log2 e), 0 where key > query or query >= T; bf16 A registers
//   dV += P^T dO                      wgmma m64nHDk16, A from registers, B = dO tile MN-major ("transpose B")
//   dS^T = P^T o (dP^T - D); bf16 A registers
//   dK += dS^T Q                      wgmma m64nHDk16, as dV; left running into the next item, whose S^T wait
//                                     covers it (hence the 4th stage: the item's Q tile stays untouched meanwhile)
// dK times scale at the store. A warpgroup whose keys all follow the tile's queries skips the item.
// Registers (HD 128, BQ 64): dK, dV 2 x 64 + S^T, dP^T 2 x 32 + P^T, dS^T 2 x 16 per thread (254 in all, no spill).
//
// dQ: CTA = 128 queries x (head, batch) = 2 warpgroups of 64 queries; Q and dO stay in smem; K, V tiles of BN keys
// stream through 3 stages up to the causal diagonal. Per tile and warpgroup:
//   S = Q K^T, dP = dO V^T            wgmma m64nBNk16; with AREG (the HD 128 choice) the warpgroup's Q and dO rows
//                                     are held in registers as A fragments, so only K, V are read from smem
//   P = exp2(S scale log2 e - lse log2 e), 0 where key > query; dS = P o (dP - D); bf16 A registers
//   dQ += dS K                        wgmma m64nHDk16, B = K tile MN-major
// dQ times scale at the store.
// Both kernels stage their bf16 results through their own (dead) rows of the resident tiles for 16-byte stores.
// The two warpgroups synchronise once per item / tile (__syncthreads, before a stage is refilled) and otherwise
// drift, so one's exponentials overlap the other's matmuls; making them take turns (the forward's ping-pong) measured
// slower here.

// Stores a warpgroup's 64 x HD fp32 accumulator (times mult) as bf16 to global rows r0 .. r0 + 63 (skipping rows
// >= T; dst: row 0, column 0 of the head), staged through rows 64 wg .. 64 wg + 63 of a swizzled smem tile of R rows
// at `stage` (generic pointer) that no other warpgroup reads any more. Uses named barrier 1 + wg (128 threads).
template <int HD, int R>
__device__ __forceinline__ void hw_store_wg_rows(__nv_bfloat16* dst, size_t row_stride, uint8_t* stage,
                                                 const float (&acc)[HD / 2], float mult, int r0, int T, int wg) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int lr = 64 * wg + 16 * warp + g;
#pragma unroll
    for (int jn = 0; jn < HD / 8; jn++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            *reinterpret_cast<uint32_t*>(stage + hw_swz<R>(lr + 8 * r, jn) + 2 * c) =
                atc_pack_bf16(acc[4 * jn + 2 * r] * mult, acc[4 * jn + 2 * r + 1] * mult);
        }
    }
    hw_bar_sync<128>(1 + wg);
    constexpr int CHUNKS = HD / 8;
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int i = 0; i < 64 * CHUNKS / 128; i++) {
        const int idx = i * 128 + t, r = idx / CHUNKS, ch = idx % CHUNKS;
        if (r0 + r < T) {
            *reinterpret_cast<int4*>(dst + (size_t)(r0 + r) * row_stride + 8 * ch) =
                *reinterpret_cast<const int4*>(stage + hw_swz<R>(64 * wg + r, ch));
        }
    }
}

// Packs a 64 x N fp32 accumulator fragment (N / 2 values per thread) into N / 16 bf16 A fragments (k16 slices).
template <int N>
__device__ __forceinline__ void hw_acc_to_a(uint32_t (&a)[N / 16][4], const float (&d)[N / 2]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        a[kk][0] = atc_pack_bf16(d[8 * kk + 0], d[8 * kk + 1]);
        a[kk][1] = atc_pack_bf16(d[8 * kk + 2], d[8 * kk + 3]);
        a[kk][2] = atc_pack_bf16(d[8 * kk + 4], d[8 * kk + 5]);
        a[kk][3] = atc_pack_bf16(d[8 * kk + 6], d[8 * kk + 7]);
    }
}

// Loads the warpgroup's A fragments (rows 64 wg .. 64 wg + 63, every k16 slice of HD columns) of a swizzled tile of
// R rows at `tile`: a stationary operand kept in registers for hw_wgmma_rs (fragment layout in the section comment).
template <int HD, int R>
__device__ __forceinline__ void hw_load_a_frags(uint32_t (&a)[HD / 16][4], const uint8_t* tile, int wg) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
    const int r0 = 64 * wg + 16 * warp + g;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {  // columns 16 kk + c (chunk 2 kk) and 16 kk + 8 + c (chunk 2 kk + 1)
        a[kk][0] = *reinterpret_cast<const uint32_t*>(tile + hw_swz<R>(r0, 2 * kk) + 2 * c);
        a[kk][1] = *reinterpret_cast<const uint32_t*>(tile + hw_swz<R>(r0 + 8, 2 * kk) + 2 * c);
        a[kk][2] = *reinterpret_cast<const uint32_t*>(tile + hw_swz<R>(r0, 2 * kk + 1) + 2 * c);
        a[kk][3] = *reinterpret_cast<const uint32_t*>(tile + hw_swz<R>(r0 + 8, 2 * kk + 1) + 2 * c);
    }
}

// 64 x N = (64 x HD) (N x HD)^T over the HD / 16 k16 slices, one commit group: A is either the warpgroup's rows of a
// resident swizzled tile of R rows (AREG false: from shared memory, a_tile) or its fragments in registers (AREG
// true: a_frags); B is a swizzled tile of N rows at b_tile, K-major.
template <int HD, int R, int N, bool AREG>
__device__ __forceinline__ void hw_scores(float (&d)[N / 2], uint32_t a_tile,
                                          const uint32_t (&a_frags)[AREG ? HD / 16 : 1][4], uint32_t b_tile, int wg) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const uint64_t db = hw_desc(b_tile + (kk / 4) * (N * 128) + 32 * (kk % 4), 16, 1024);
        if constexpr (AREG) {
            hw_wgmma_rs<0>(d, a_frags[kk], db, kk > 0);
        } else {
            hw_wgmma_ss(d, hw_desc(a_tile + (kk / 4) * (R * 128) + 64 * wg * 128 + 32 * (kk % 4), 16, 1024), db,
                        kk > 0);
        }
    }
    hw_commit();
}

constexpr int HWB_DKDV_STAGES = 4;  // Q / dO stages of the dK/dV kernel (dK's wgmma may run into the next item)
constexpr int HWB_DQ_STAGES = 3;    // K / V stages of the dQ kernel

template <int HD, int BQ>
constexpr size_t attention_backward_dkdv_hopper_smem_bytes() {
    constexpr int S = HWB_DKDV_STAGES;
    return sizeof(__nv_bfloat16) * HD * (2 * HW_ROWS + 2 * S * BQ) + sizeof(float) * 2 * S * BQ + 1024;
}

// dK, dV for one (b, kv head, tile of 128 keys). grid (B * KV, ceil(T / 128)), block 256. BQ: queries per item.
// AREG: the warpgroup's K and V rows stay in registers as A fragments (S^T, dP^T then read only Q, dO from shared
// memory: half the shared-memory traffic of those products), at the cost of HD / 2 registers per thread.
template <int HD, int BQ, bool AREG>
__global__ void __launch_bounds__(HW_THREADS, 1)
    attention_backward_dkdv_hopper_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                          const float* lse, const float* delta, int T, int H, int KV, float scale,
                                          float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = HW_ROWS, S = HWB_DKDV_STAGES;
    constexpr int KBYTES = ROWS * HD * 2, QBYTES = BQ * HD * 2;
    static_assert(ROWS % BQ == 0, "query tiles must start at the key tile's first key");
    static_assert(BQ == 64 || BQ == 128, "S^T, dP^T are wgmma m64nBQk16 with N = 64 or 128 (hw_wgmma_ss overloads)");
    extern __shared__ uint8_t hw_smem_raw[];
    const uint32_t smem = (atc_smem_u32(hw_smem_raw) + 1023u) & ~1023u;
    const uint32_t k_sm = smem;                      // K (128 x HD), swizzled
    const uint32_t v_sm = k_sm + KBYTES;             // V (128 x HD)
    const uint32_t q_sm = v_sm + KBYTES;             // S stages x Q (BQ x HD)
    const uint32_t do_sm = q_sm + S * QBYTES;        // S stages x dO (BQ x HD)
    uint8_t* smem_ptr = hw_smem_raw + (smem - atc_smem_u32(hw_smem_raw));
    float* lse_s = reinterpret_cast<float*>(smem_ptr + 2 * KBYTES + 2 * S * QBYTES);  // S stages x BQ
    float* D_s = lse_s + S * BQ;                                                      // S stages x BQ

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / KV, kvh = blockIdx.x % KV, group = H / KV;
    const int k0 = blockIdx.y * ROWS;  // the first key tiles see the most queries: scheduled first
    const int kwg = k0 + 64 * wg;      // the warpgroup's first key
    const int key0 = kwg + 16 * warp + g;  // this thread's keys: key0 and key0 + 8
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;

    // Items (query head of the group, query tile from the diagonal); k0 is a multiple of BQ.
    const int n_q = ceil_div(T - k0, BQ), n_items = group * n_q;
    auto issue = [&](int item) {
        const int stage = item % S, h = kvh * group + item / n_q, q0 = k0 + (item % n_q) * BQ;
        hw_load_tile<HD, BQ>(q_sm + stage * QBYTES, qkv + (size_t)b * T * stride + (size_t)h * HD, stride, q0, T);
        hw_load_tile<HD, BQ>(do_sm + stage * QBYTES, dout + (size_t)b * T * o_stride + (size_t)h * HD, o_stride, q0,
                             T);
        const size_t row = ((size_t)b * H + h) * T;  // (b, h) row of lse and delta
        atc_load_row_stats<BQ>(lse_s + stage * BQ, D_s + stage * BQ, lse, delta, row, q0, T);
    };

    hw_load_tile<HD, ROWS>(k_sm, qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD, stride, k0, T);
    hw_load_tile<HD, ROWS>(v_sm, qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD, stride, k0, T);
    issue(0);
    atc_cp_async_commit();
    if (n_items > 1) issue(1);
    atc_cp_async_commit();

    float dk[HD / 2], dv[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) dk[i] = dv[i] = 0.0f;
    uint32_t ka[AREG ? HD / 16 : 1][4], va[AREG ? HD / 16 : 1][4];  // K, V rows as A fragments (AREG)
    uint32_t dsa[BQ / 16][4];  // dS^T as bf16 A registers, read by dK's wgmma, which runs into the next item

    for (int it = 0; it < n_items; it++) {
        // Groups committed so far: items 0 .. it + 1 (one per iteration, possibly empty). All but the newest: it.
        atc_cp_async_wait<1>();
        hw_fence_proxy_async();
        // Item it visible to all; everyone is done with item it - 2 (its dK wgmma was waited for in item it - 1),
        // whose stage is refilled next.
        __syncthreads();
        if (it + 2 < n_items) issue(it + 2);
        atc_cp_async_commit();
        if constexpr (AREG) {
            if (it == 0) {
                hw_load_a_frags<HD, ROWS>(ka, smem_ptr, wg);
                hw_load_a_frags<HD, ROWS>(va, smem_ptr + KBYTES, wg);
            }
        }

        const int stage = it % S, q0 = k0 + (it % n_q) * BQ;
        if (q0 + BQ - 1 < kwg) {  // warpgroup-uniform: every query of the tile precedes every key
            hw_wait<0>();  // the previous item's dK must be done before its stage is refilled (next iteration)
            hw_fence_regs(dsa);
            hw_fence_regs(dk);
            continue;
        }
        const uint32_t q_st = q_sm + stage * QBYTES, do_st = do_sm + stage * QBYTES;
        const float* lse_t = lse_s + stage * BQ;
        const float* D_t = D_s + stage * BQ;

        // S^T = K Q^T and dP^T = V dO^T, one commit group each.
        float s[BQ / 2], dp[BQ / 2];
        hw_fence();
        hw_scores<HD, ROWS, BQ, AREG>(s, k_sm, ka, q_st, wg);
        hw_scores<HD, ROWS, BQ, AREG>(dp, v_sm, va, do_st, wg);

        // P^T. Element i: key key0 + 8 ((i / 2) % 2), query q0 + 8 (i / 4) + c + i % 2. Outstanding: the previous
        // item's dK, S^T, dP^T: all but the newest (dP^T) done.
        hw_wait<1>();
        hw_fence_regs(s);
        hw_fence_regs(dsa);  // the previous item's dK is done with them
        hw_fence_regs(dk);
        const bool need_mask = kwg + 63 > q0 || q0 + BQ > T;
#pragma unroll
        for (int i = 0; i < BQ / 2; i++) {
            const int qi = 8 * (i / 4) + c + i % 2;
            float p = exp2f(fmaf(s[i], scale_log2, -lse_t[qi] * ATTN_LOG2E));
            if (need_mask) {
                const int q = q0 + qi, key = key0 + 8 * ((i / 2) % 2);
                if (key > q || q >= T) p = 0.0f;  // select, not multiply: p may be inf where masked
            }
            s[i] = p;
        }
        // dV += P^T dO: B = the dO tile, MN-major; its k16 slice kk (queries 16 kk ..) starts at row 16 kk.
        uint32_t pa[BQ / 16][4];
        hw_acc_to_a<BQ>(pa, s);
        hw_fence_regs(pa);
        hw_fence_regs(dv);
        hw_fence();
#pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++) hw_wgmma_rs(dv, pa[kk], hw_desc(do_st + 2048 * kk, BQ * 128, 1024), 1);
        hw_commit();

        // dS^T (dP^T is done once only the dV group may be outstanding), then dK += dS^T Q.
        hw_wait<1>();
        hw_fence_regs(dp);
#pragma unroll
        for (int i = 0; i < BQ / 2; i++) dp[i] = s[i] * (dp[i] - D_t[8 * (i / 4) + c + i % 2]);
        hw_acc_to_a<BQ>(dsa, dp);
        hw_fence_regs(dsa);
        hw_fence_regs(dk);
        hw_fence();
#pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++) hw_wgmma_rs(dk, dsa[kk], hw_desc(q_st + 2048 * kk, BQ * 128, 1024), 1);
        hw_commit();
        hw_wait<1>();  // dV done; dK runs on into the next item
        hw_fence_regs(pa);
        hw_fence_regs(dv);
    }
    hw_wait<0>();
    hw_fence_regs(dsa);
    hw_fence_regs(dk);

    // Each warpgroup read only its own 64 rows of K and V: after its last wait they stage its results.
    __nv_bfloat16* dqkv_b = dqkv + (size_t)b * T * stride;
    hw_store_wg_rows<HD, ROWS>(dqkv_b + (size_t)(H + kvh) * HD, stride, smem_ptr, dk, scale, kwg, T, wg);
    hw_store_wg_rows<HD, ROWS>(dqkv_b + (size_t)(H + KV + kvh) * HD, stride, smem_ptr + KBYTES, dv, 1.0f, kwg, T, wg);
#else
    __trap();  // not sm_90a code: never launched (attention_hopper_usable)
#endif
}

template <int HD, int BN>
constexpr size_t attention_backward_dq_hopper_smem_bytes() {
    return sizeof(__nv_bfloat16) * HD * (2 * HW_ROWS + 2 * HWB_DQ_STAGES * BN) + 1024;
}

// dQ for one (b, h, tile of 128 queries). grid (B * H, ceil(T / 128)), block 256. BN: keys per K / V tile.
// AREG: the warpgroup's Q and dO rows stay in registers as A fragments (as in the dK/dV kernel).
template <int HD, int BN, bool AREG>
__global__ void __launch_bounds__(HW_THREADS, 1)
    attention_backward_dq_hopper_kernel(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                        const float* lse, const float* delta, int T, int H, int KV, float scale,
                                        float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int ROWS = HW_ROWS, S = HWB_DQ_STAGES;
    constexpr int QBYTES = ROWS * HD * 2, TBYTES = BN * HD * 2;
    static_assert(ROWS % BN == 0, "key tiles must tile the query tile");
    extern __shared__ uint8_t hw_smem_raw[];
    const uint32_t smem = (atc_smem_u32(hw_smem_raw) + 1023u) & ~1023u;
    const uint32_t q_sm = smem;                     // Q (128 x HD), swizzled
    const uint32_t do_sm = q_sm + QBYTES;           // dO (128 x HD)
    const uint32_t k_sm = do_sm + QBYTES;           // S stages x K (BN x HD)
    const uint32_t v_sm = k_sm + S * TBYTES;        // S stages x V (BN x HD)
    uint8_t* smem_ptr = hw_smem_raw + (smem - atc_smem_u32(hw_smem_raw));

    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = 2 * (lane % 4);
    const int b = blockIdx.x / H, h = blockIdx.x % H, kvh = h / (H / KV);
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;  // the longest (last) query tiles are scheduled first
    const int qwg = q0 + 64 * wg;
    const int row0 = qwg + 16 * warp + g;  // this thread's queries: row0 and row0 + 8
    const size_t stride = (size_t)(H + 2 * KV) * HD, o_stride = (size_t)H * HD;
    const __nv_bfloat16* k_src = qkv + (size_t)b * T * stride + (size_t)(H + kvh) * HD;
    const __nv_bfloat16* v_src = qkv + (size_t)b * T * stride + (size_t)(H + KV + kvh) * HD;

    const int n_tiles = ceil_div(min(q0 + ROWS, T), BN);  // causal: keys up to the CTA's last query
    auto issue = [&](int j) {
        hw_load_tile<HD, BN>(k_sm + (j % S) * TBYTES, k_src, stride, j * BN, T);
        hw_load_tile<HD, BN>(v_sm + (j % S) * TBYTES, v_src, stride, j * BN, T);
    };
    hw_load_tile<HD, ROWS>(q_sm, qkv + (size_t)b * T * stride + (size_t)h * HD, stride, q0, T);
    hw_load_tile<HD, ROWS>(do_sm, dout + (size_t)b * T * o_stride + (size_t)h * HD, o_stride, q0, T);
    issue(0);
    atc_cp_async_commit();
    if (n_tiles > 1) issue(1);
    atc_cp_async_commit();

    float lse2[2], D[2];  // rows row0, row0 + 8; finite placeholders past T (never stored)
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int q = row0 + 8 * r;
        lse2[r] = q < T ? lse[(size_t)blockIdx.x * T + q] * ATTN_LOG2E : 0.0f;
        D[r] = q < T ? delta[(size_t)blockIdx.x * T + q] : 0.0f;
    }
    float dq[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; i++) dq[i] = 0.0f;
    uint32_t qa[AREG ? HD / 16 : 1][4], doa[AREG ? HD / 16 : 1][4];  // Q, dO rows as A fragments (AREG)

    for (int j = 0; j < n_tiles; j++) {
        atc_cp_async_wait<1>();
        hw_fence_proxy_async();
        __syncthreads();  // tile j visible to all; everyone is done with tile j - 1, whose stage is refilled next
        if (j + 2 < n_tiles) issue(j + 2);
        atc_cp_async_commit();
        if constexpr (AREG) {
            if (j == 0) {
                hw_load_a_frags<HD, ROWS>(qa, smem_ptr, wg);
                hw_load_a_frags<HD, ROWS>(doa, smem_ptr + QBYTES, wg);
            }
        }

        const int k0 = j * BN;
        if (k0 > qwg + 63) continue;  // warpgroup-uniform: every key of the tile follows every query
        const uint32_t k_st = k_sm + (j % S) * TBYTES, v_st = v_sm + (j % S) * TBYTES;

        // S = Q K^T and dP = dO V^T, one commit group each.
        float s[BN / 2], dp[BN / 2];
        hw_fence();
        hw_scores<HD, ROWS, BN, AREG>(s, q_sm, qa, k_st, wg);
        hw_scores<HD, ROWS, BN, AREG>(dp, do_sm, doa, v_st, wg);

        // P. Element i: query row0 + 8 ((i / 2) % 2), key k0 + 8 (i / 4) + c + i % 2. Keys >= T need no test of
        // their own: they follow every valid query.
        hw_wait<1>();
        hw_fence_regs(s);
        const bool need_mask = k0 + BN - 1 > qwg;
#pragma unroll
        for (int i = 0; i < BN / 2; i++) {
            const int r = (i / 2) % 2;
            float p = exp2f(fmaf(s[i], scale_log2, -lse2[r]));
            if (need_mask && k0 + 8 * (i / 4) + c + i % 2 > row0 + 8 * r) p = 0.0f;
            s[i] = p;
        }
        // dS, then dQ += dS K: B = the K tile, MN-major; its k16 slice kk (keys 16 kk ..) starts at row 16 kk.
        hw_wait<0>();
        hw_fence_regs(dp);
#pragma unroll
        for (int i = 0; i < BN / 2; i++) dp[i] = s[i] * (dp[i] - D[(i / 2) % 2]);
        uint32_t dsa[BN / 16][4];
        hw_acc_to_a<BN>(dsa, dp);
        hw_fence_regs(dsa);
        hw_fence_regs(dq);
        hw_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) hw_wgmma_rs(dq, dsa[kk], hw_desc(k_st + 2048 * kk, BN * 128, 1024), 1);
        hw_commit();
        hw_wait<0>();
        hw_fence_regs(dsa);
        hw_fence_regs(dq);
    }

    // Each warpgroup read only its own 64 rows of Q: after its last wait they stage its result.
    hw_store_wg_rows<HD, ROWS>(dqkv + (size_t)b * T * stride + (size_t)h * HD, stride, smem_ptr, dq, scale, qwg, T,
                               wg);
#else
    __trap();  // not sm_90a code: never launched (attention_hopper_usable)
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// Host side

// True when the kernels of this file can run on the current device: compute capability 9.0 (H100 / H200; wgmma is
// sm_90a-only, later architectures do not run sm_90a code), and the kernel image the runtime picked is sm_90 machine
// code (not, say, an sm_80 image or PTX JIT-compiled from an older target, where the bodies are traps). The forward
// kernel's image stands for all of them: they are compiled together. Cached per device: both queries are host-side,
// but need not be repeated every layer.
inline bool attention_hopper_usable() {
    static int cached_device = -1;
    static bool cached_usable = false;
    int device;
    cudaCheck(cudaGetDevice(&device));
    if (device != cached_device) {
        int major = 0, minor = 0;
        cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        cudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
        cached_usable = false;
        if (major == 9 && minor == 0) {
            cudaFuncAttributes attr;
            cudaCheck(cudaFuncGetAttributes(&attr, attention_forward_hopper_kernel<128, 1, true>));
            cached_usable = attr.binaryVersion == 90;
        }
        cached_device = device;
    }
    return cached_usable;
}

// The kernels move rows in 16-byte chunks (cp.async loads, int4 stores): row strides are multiples of 8 elements, so
// 16-byte aligned base pointers suffice.
inline bool hw_aligned16(std::initializer_list<const void*> pointers) {
    for (const void* p : pointers) {
        if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    }
    return true;
}

// One kernel configuration (HD 64 or 128; NH, PP as above), no checks: attention_forward_hopper runs the chosen one,
// dev/cuda/attention_forward.cu also times the others.
template <int HD, int NH, bool PP>
inline void attention_forward_hopper_cfg(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV,
                                         cudaStream_t stream) {
    static bool smem_set = false;
    const size_t smem = attention_forward_hopper_smem_bytes<HD, PP>();
    attention_set_smem(attention_forward_hopper_kernel<HD, NH, PP>, smem, smem_set);
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)HD);
    dim3 grid(B * H, ceil_div(T, HW_ROWS));
    attention_forward_hopper_kernel<HD, NH, PP><<<grid, HW_THREADS, smem, stream>>>(out, lse, qkv, T, H, KV,
                                                                                      scale_log2);
    cudaCheckLaunch();
}

// The Hopper forward, same contract as attention_forward: out (B, T, H hd) and lse (B, H, T) OVERWRITTEN from qkv.
// Returns false, having done nothing, where it does not apply (head_dim != 128, a device other than compute
// capability 9.0 or a build without sm_90a code, tensors not 16-byte aligned); the caller then takes another path.
inline bool attention_forward_hopper(floatX* out, float* lse, const floatX* qkv, int B, int T, int n_heads,
                                     int n_kv_heads, int head_dim, cudaStream_t stream) {
    if (head_dim != 128) return false;
    if (!hw_aligned16({out, qkv})) return false;
    if (!attention_hopper_usable()) return false;
    attention_check_args("attention_forward_hopper", B, T, n_heads, n_kv_heads, head_dim);
    attention_forward_hopper_cfg<128, 1, true>(out, lse, qkv, B, T, n_heads, n_kv_heads, stream);
    return true;
}

// Backward configurations per head dim (queries per dK/dV item, keys per dQ tile, stationary operands in registers):
// the best measured on an H200 (dev/cuda/attention_backward.cu, "sweep").
constexpr int HWB_BQ_64 = 64, HWB_BN_64 = 128, HWB_BQ_128 = 64, HWB_BN_128 = 64;
// AREG: K / V in registers in the dK/dV kernel, Q / dO in the dQ kernel. Measured and not taken: K / V at hd 64 (210
// vs 217 TFLOP/s); at hd 128 they do not fit in the registers beside dK and dV.
constexpr bool HWB_AREG_KV_64 = false, HWB_AREG_Q_64 = false, HWB_AREG_KV_128 = false, HWB_AREG_Q_128 = true;

// One backward configuration (D included), no checks: attention_backward_hopper runs the chosen one,
// dev/cuda/attention_backward.cu also times others.
template <int HD, int BQ, int BN, bool AREG_KV, bool AREG_Q>
inline void attention_backward_hopper_cfg(floatX* dqkv, float* delta, const floatX* dout, const floatX* qkv,
                                          const floatX* out, const float* lse, int B, int T, int H, int KV,
                                          cudaStream_t stream) {
    static bool dkdv_smem_set = false, dq_smem_set = false;
    const size_t dkdv_smem = attention_backward_dkdv_hopper_smem_bytes<HD, BQ>();
    const size_t dq_smem = attention_backward_dq_hopper_smem_bytes<HD, BN>();
    attention_set_smem(attention_backward_dkdv_hopper_kernel<HD, BQ, AREG_KV>, dkdv_smem, dkdv_smem_set);
    attention_set_smem(attention_backward_dq_hopper_kernel<HD, BN, AREG_Q>, dq_smem, dq_smem_set);
    attention_delta(delta, dout, out, B, T, H, HD, stream);
    const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * ATTN_LOG2E;
    dim3 dkdv_grid(B * KV, ceil_div(T, HW_ROWS));
    attention_backward_dkdv_hopper_kernel<HD, BQ, AREG_KV><<<dkdv_grid, HW_THREADS, dkdv_smem, stream>>>(
        dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
    dim3 dq_grid(B * H, ceil_div(T, HW_ROWS));
    attention_backward_dq_hopper_kernel<HD, BN, AREG_Q><<<dq_grid, HW_THREADS, dq_smem, stream>>>(
        dqkv, dout, qkv, lse, delta, T, H, KV, scale, scale_log2);
    cudaCheckLaunch();
}

// The Hopper backward, same contract as attention_backward. Returns false, having done nothing, where it does not
// apply (head_dim other than 64 / 128, no sm_90a device or code, tensors not 16-byte aligned).
inline bool attention_backward_hopper(floatX* dqkv, float* delta_scratch, const floatX* dout, const floatX* qkv,
                                      const floatX* out, const float* lse, int B, int T, int n_heads, int n_kv_heads,
                                      int head_dim, cudaStream_t stream) {
    if (head_dim != 64 && head_dim != 128) return false;
    if (!hw_aligned16({dqkv, dout, qkv})) return false;
    if (!attention_hopper_usable()) return false;
    attention_check_args("attention_backward_hopper", B, T, n_heads, n_kv_heads, head_dim);
    if (head_dim == 64) {
        attention_backward_hopper_cfg<64, HWB_BQ_64, HWB_BN_64, HWB_AREG_KV_64, HWB_AREG_Q_64>(
            dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, stream);
    } else {
        attention_backward_hopper_cfg<128, HWB_BQ_128, HWB_BN_128, HWB_AREG_KV_128, HWB_AREG_Q_128>(
            dqkv, delta_scratch, dout, qkv, out, lse, B, T, n_heads, n_kv_heads, stream);
    }
    return true;
}

#endif  // !ENABLE_FP32
