// PTX wrappers that only the dev/cuda programs use (the kernels of earlier versions kept for comparison), beside
// those of llmc/ptx.cuh, whose conventions they follow (one instruction each; sm_90a ones only from sm_90a code).
#pragma once

#include <cstdint>

#include "../../llmc/ptx.cuh"

// 4-byte global -> shared copy (lse, D), asynchronous; src_bytes = 0 writes zero.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// True once the phase of parity `parity` has completed (may also return false after a time-out: call in a loop).
// llmc/ptx.cuh's mbarrier_wait is the loop, written in PTX (why: its comment).
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// Ordering between CTAs through a counter in global memory (one CTA releases its writes, a later one acquires them).

// Load at GPU scope with acquire semantics: this thread's later reads see every write released before the value
// it read (the writer's red_release_gpu_add).
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Atomic add at GPU scope with release semantics: this thread's earlier writes (and, after a __threadfence and a
// barrier, its CTA's) are visible to whoever acquires the new value.
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// wgmma_bf16_ss_t (llmc/ptx.cuh) at N = 32: D (64 x 32) (+)= A B, both from descriptors (sm_90a).
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_bf16_ss_t(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}
