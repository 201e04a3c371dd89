// Thin wrappers over the PTX instructions the tensor-core attention and matmul kernels use, and their operand
// conventions.
//   sm_80 and later: cp.async (global -> shared, asynchronous), ldmatrix, mma.sync m16n8k16 bf16, named barriers.
//   sm_90a only:     wgmma (warpgroup matrix multiply from shared-memory descriptors) and the async-proxy fence;
//                    call these only from code compiled for sm_90a (the kernels guard their bodies with
//                    __CUDA_ARCH_FEAT_SM90_ALL).
//   sm_90:           mbarrier with transaction counts, TMA (cp.async.bulk.tensor, also multicast to a cluster),
//                    elect.sync, setmaxnreg (sm_90a only) and thread-block clusters, for the warp-specialised
//                    kernels (attention_wgmma_forward.cuh, attention_wgmma_backward.cuh, matmul_swiglu.cuh; same
//                    guard).
// Every wrapper is one instruction (or one register constraint; mbarrier_wait loops over one; the remote arrive
// maps the address first); names follow the instruction.
//
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D (16 x 8 fp32) += A (16 x 16) B (16 x 8), bf16.
// Fragment ownership (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane / 4 and c = 2 (lane % 4):
//   A (M x K, row):   a0 = A[g][c, c+1]    a1 = A[g+8][c, c+1]    a2 = A[g][c+8, c+9]    a3 = A[g+8][c+8, c+9]
//   B (K x N, col):   b0 = B[c, c+1][g]    b1 = B[c+8, c+9][g]
//   C/D (M x N):      d0, d1 = D[g][c, c+1]                       d2, d3 = D[g+8][c, c+1]
// Each 32-bit A/B register holds two bf16, the lower column (k) index in the low half (pack_bf16x2).
// ldmatrix.x4 loads four 8x8 bf16 matrices: lanes 8i .. 8i+7 supply the 8 row addresses of matrix i, and register i
// of every lane receives element [g][c, c+1] of matrix i (.trans: of its transpose).
//
// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16, issued by a warpgroup (4 consecutive warps, 128 threads):
// D (64 x N fp32, registers) += A (64 x 16) B (16 x N). B always comes from shared memory through a 64-bit matrix
// descriptor; A from a descriptor (wgmma_bf16_ss) or from registers (wgmma_bf16_rs). The instruction is
// asynchronous: wgmma_fence before a batch (accumulator / A registers were written by ordinary instructions),
// wgmma_commit_group after it, wgmma_wait_group<0> before the results are read (or the A / B sources reused);
// pin_registers keeps the compiler from moving reads or writes of those registers across these points.
// Register fragments (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" for wgmma .m64nNk16): warp w of
// the warpgroup owns rows 16 w .. 16 w + 15 of D and of a register A; with g = lane / 4, c = 2 (lane % 4):
//   D: d[4 j + 0, 1] = D[16 w + g][8 j + c, +1]     d[4 j + 2, 3] = D[16 w + g + 8][8 j + c, +1]    (j < N / 8)
//   A: a0 = A[g][c, c+1]  a1 = A[g+8][c, c+1]  a2 = A[g][c+8, c+9]  a3 = A[g+8][c+8, c+9]  (rows of the warp's slice)
// i.e. per warp exactly the mma.sync m16n8k16 C and A fragments.
//
// Shared-memory layout for wgmma operands: the 128-byte swizzle that the descriptors' swizzle mode 1 reads. A tile of
// R rows x HD bf16 is stored as HD / 64 "column blocks" of R rows x 128 bytes (64 elements); in a block, the 16-byte
// chunk ch (< 8) of row r sits at byte r * 128 + 16 (ch ^ (r % 8)) (swizzle128_offset), blocks 1024-byte aligned (the
// swizzle XORs address bits 4-6 with bits 7-9, so it is a function of the address; the 8-row, 1024-byte atoms must
// start on 1024-byte boundaries, descriptor base offset 0). Conflict-free for 16-byte cp.async writes (a row's 8
// chunks hit 8 distinct chunk slots) and for the tensor-core reads. Descriptor fields (PTX ISA "Matrix Descriptor
// Format"): bits 0-13 start address >> 4, 16-29 leading byte offset (LBO) >> 4, 32-45 stride byte offset (SBO) >> 4,
// 62-63 swizzle (1: 128 B).
//   * K-major operands (the reduction index contiguous in a row, e.g. Q as A and K as B of S = Q K^T): SBO = 1024
//     (from one 8-row group to the next), LBO unused (16). The k16 slice kk starts at column block kk / 4, byte
//     32 (kk % 4) of row 0: the descriptor start address advances by 32 bytes inside the atom, the hardware applies
//     the swizzle.
//   * MN-major operand (the N index contiguous, e.g. V as B of O = P V; "transpose B" = 1): SBO = 1024 (from one
//     8-row group of k to the next), LBO = R * 128 (from one 64-wide column block to the next). The k16 slice kk
//     starts at row 16 kk (byte 2048 kk).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------------------------------------------
// Shared-memory addresses and cp.async

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy, asynchronous; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ----------------------------------------------------------------------------------------------------------------
// ldmatrix, mma.sync, bf16 packing

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// d += a b, one m16n8k16 bf16 mma with fp32 accumulation.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> bf16x2 (lo in the low half: the lower column index, as the fragments want).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// ----------------------------------------------------------------------------------------------------------------
// Named barriers

// Named barriers (id 0 is __syncthreads): bar.sync waits for `count` threads to arrive (itself included);
// bar.arrive arrives without waiting. Ids may differ per warp (a register), the count must not.
template <int COUNT>
__device__ __forceinline__ void named_barrier_sync(int id) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory");
}
template <int COUNT>
__device__ __forceinline__ void named_barrier_arrive(int id) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(COUNT) : "memory");
}

// ----------------------------------------------------------------------------------------------------------------
// wgmma (sm_90a)

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Ties accumulator registers to this point of the program: the compiler may not move their reads or writes across
// it (so nothing touches them between the asynchronous wgmma and its wait).
template <int R>
__device__ __forceinline__ void pin_registers(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void pin_registers(uint32_t (&a)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; i++) {
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(a[i][e])::"memory");
    }
}
// Makes this thread's generic-proxy shared-memory writes (cp.async, st.shared) visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Matrix descriptor, 128-byte swizzle (see the file comment). addr: shared-window byte address.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)((lbo & 0x3FFFF) >> 4) << 16 |
           (uint64_t)((sbo & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}
// The same descriptor for the operand `bytes` further on (a k16 slice, a pipeline stage): only the start address
// field changes. Shared-window addresses stay below 2^18, so the field (address >> 4, 14 bits) never carries into
// the next, and the add can stay in the low word: one instruction per wgmma instead of rebuilding every field (the
// rebuild was about 10 uniform-datapath instructions per wgmma, a quarter of the hd 64 dK/dV kernel's instructions).
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
    const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4), hi = static_cast<uint32_t>(desc >> 32);
    return (uint64_t)hi << 32 | lo;
}

// Byte offset of 16-byte chunk ch (< HD / 8) of row r in a swizzled tile of R rows.
template <int R>
__device__ __forceinline__ uint32_t swizzle128_offset(int r, int ch) {
    return (uint32_t)((ch / 8) * R * 128 + r * 128 + 16 * ((ch % 8) ^ (r % 8)));
}

// wgmma wrappers. scale_d = 0: D = A B (the accumulator's old contents ignored); 1: D += A B.
// wgmma_bf16_ss (below, with wgmma_bf16_ss_t): A (K-major) and B (K-major) from descriptors. wgmma_bf16_rs: A from
// registers, B MN-major ("transpose B", TRANS_B = 1, the default) or K-major (TRANS_B = 0).
template <int TRANS_B = 1>
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
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
template <int TRANS_B = 1>
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
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


// ----------------------------------------------------------------------------------------------------------------
// mbarrier, TMA, setmaxnreg, elect (sm_90)
//
// An mbarrier (8 bytes of shared memory, 8-byte aligned) counts arrivals and, optionally, transaction bytes: a phase
// completes when its pending arrival count (set by mbarrier_init) reaches zero and its transaction count is back to
// zero; then the next phase starts with the same arrival count. Phases alternate parity 0, 1, 0, ...: a thread
// waiting for phase k of a barrier waits with parity k % 2 (mbarrier_wait returns once that phase has completed).
// expect_tx raises the phase's transaction count by the bytes a bulk copy will deliver; the copy's complete_tx lowers
// it as the bytes land (TMA credits the whole box, out-of-bounds parts included, zero-filled).
// After mbarrier_init, fence_mbarrier_init (then a CTA barrier) before any other thread or the TMA unit uses it.
//
// TMA (cp.async.bulk.tensor): one thread copies a box of a global tensor, described by a CUtensorMap made on the host
// (cuTensorMapEncodeTiled) and passed as a __grid_constant__ kernel parameter, into shared memory; with the map's
// CU_TENSOR_MAP_SWIZZLE_128B and a 128-byte inner box the smem layout is exactly the 128-byte swizzle above
// (destination 1024-byte aligned). Coordinates are in elements, innermost first; out-of-bounds elements are zeros.

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the mbarrier_init of this thread visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives and raises the current phase's expected transaction bytes by `bytes`.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Blocks until the phase of parity `parity` of mbarrier bar has completed: a loop over mbarrier.try_wait.parity
// (which may also return false after a time-out). The loop is written in PTX: as a C++ loop around a wrapper of the
// try_wait, ptxas serialised the wgmmas of the dK/dV kernel that keeps a wgmma running across the wait (C7515).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred p;\nMBARRIER_WAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra MBARRIER_WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// 4-D tiled TMA load of the box at coordinates (c0, c1, c2, c3) of tensor map `map` (a __grid_constant__ parameter)
// into shared memory at dst; completion (the box's bytes) is signalled on mbarrier bar.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Per-thread register budget of the executing warpgroup (all 128 threads execute it): dec releases registers to the
// CTA's pool, inc waits until the pool has them. N: 24 .. 256, a multiple of 8.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// True in exactly one active lane of the warp (all active lanes execute it).
__device__ __forceinline__ bool elect_one_sync() {
    uint32_t elected;
    asm volatile(
        "{\n.reg .pred p;\n.reg .b32 lane;\nelect.sync lane|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(elected));
    return elected != 0;
}

// ----------------------------------------------------------------------------------------------------------------
// wgmma with both operands from descriptors and either one MN-major (sm_90a)

// D (64 x N) (+)= A B with A and B from descriptors; TRANS_A = 1: A MN-major (the M index contiguous: a stored
// transpose, same descriptor rules as an MN-major B in the file comment), TRANS_B = 1: B MN-major. N = 64, 128, 192.
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_bf16_ss_t(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_bf16_ss_t(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_bf16_ss_t(float (&d)[96], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
        "}, %96, %97, p, 1, 1, %99, %100;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}
// Both operands K-major (the common case).
__device__ __forceinline__ void wgmma_bf16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    wgmma_bf16_ss_t<0, 0>(d, desc_a, desc_b, scale_d);
}
__device__ __forceinline__ void wgmma_bf16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    wgmma_bf16_ss_t<0, 0>(d, desc_a, desc_b, scale_d);
}

// ----------------------------------------------------------------------------------------------------------------
// Thread-block clusters, 2-D TMA and shared-memory accesses (sm_90), for the persistent matmul (matmul_swiglu.cuh)

// 2-D tiled TMA load of the box at (c0, c1) of `map` into shared memory at dst, completion on mbarrier bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
// The same box written to the same shared-memory offset of every CTA in `cta_mask` (of the cluster), each CTA's
// mbarrier at offset `bar` credited with the bytes it received.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const void* map, uint32_t bar, int c0, int c1,
                                                      uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
        : "memory");
}
__device__ __forceinline__ uint32_t cluster_cta_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Arrives on the mbarrier at shared offset `bar` of CTA `rank` of the cluster (this CTA included): the address is
// mapped into that CTA's window first (mapa), then arrived on. The plain arrive (release at CTA scope, as CUTLASS's
// cluster barrier does it): with .release.cluster the matmul ran at two thirds of its speed.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// Every thread of every CTA of the cluster (arrive, then wait): mbarrier inits visible cluster-wide at the start; at
// the end, no CTA leaves while a peer may still write into its shared memory or arrive on its barriers.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
