// The vocabulary of the warp-specialised Hopper kernels (sm_90a): the attention forward and backward
// (attention_wgmma_forward.cuh, attention_wgmma_backward.cuh) and the fused SwiGLU matmuls (matmul_swiglu.cuh).
//
// Every such kernel has the same shape. A CTA of 384 threads is three warpgroups: warpgroup 0 produces (one elected
// thread issues TMA loads; setmaxnreg lowers its registers to 24), warpgroups 1 and 2 consume (wgmma; raised to 240).
// Tiles flow through a ring of STAGES shared-memory buffers, each with two mbarriers:
//   full[s]   completes when stage s holds its tile (the producer's arrive.expect_tx, then the TMA's bytes);
//   empty[s]  completes when every consumer that reads stage s is done with it (one arrival per reader).
// Both sides walk the ring in the same order. Entry n of the walk is stage n % STAGES in round n / STAGES; round r
// waits for phase r of full (parity r & 1), and the producer refilling a stage in round r waits for phase r - 1 of
// empty. RingState carries (stage, phase) and advances by counting, never by dividing.
//
// Both sides start at (stage 0, phase 0). The producer waits on empty for parity phase ^ 1, the round before its
// own: in round 0 that is parity 1, and a wait for parity 1 on a fresh mbarrier returns at once (the phase "before"
// phase 0 counts as complete), so the first round needs no special case.
//
// Named barriers (bar.sync / bar.arrive ids 1..15; 0 is __syncthreads) order the two consumer warpgroups: each
// kernel declares its ids in an enum beside it. The common use is taking turns (TurnTaking): issuing wgmma batches
// one warpgroup after the other, or sharing one epilogue buffer.
#pragma once

#include <cstdint>
#include <cstdio>

#include "cuda_common.h"
#include "ptx.cuh"

// The thread roles of every warp-specialised kernel.
constexpr int WS_THREADS = 384;                // producer warpgroup + 2 consumer warpgroups
constexpr int WS_CONSUMER_THREADS = 256;       // consumer threads (the count of their named barriers)
constexpr int WS_PRODUCER_REGS = 24, WS_CONSUMER_REGS = 240;  // after setmaxnreg: 128 x 24 + 256 x 240 = 384 x 168
constexpr int WS_REGS_NEEDED = 128 * WS_PRODUCER_REGS + WS_CONSUMER_THREADS * WS_CONSUMER_REGS;
static_assert(WS_REGS_NEEDED <= 65536, "the register split exceeds the SM's register file");

// Swizzle atoms (and TMA's swizzled destinations) start on 1024-byte boundaries; dynamic shared memory is only
// 16-byte aligned, so every kernel allocates its layout struct plus this much and aligns the base itself.
constexpr int WS_SMEM_ALIGN = 1024;
constexpr int WS_SMEM_LIMIT = 227 * 1024;  // an SM's shared memory per block

// Bytes of dynamic shared memory a kernel whose layout is the struct Smem asks for.
template <typename Smem>
__host__ __device__ constexpr size_t ws_smem_bytes() {
    return sizeof(Smem) + WS_SMEM_ALIGN;
}

// The kernel's shared-memory layout struct, placed at the first 1024-byte boundary of dynamic shared memory. The
// pointer is made from the aligned shared address itself: made as ws_smem_raw + (aligned - raw), the difference went
// through 64 bits and the compiler kept raw and the difference apart in every member's address (an extra add each).
template <typename Smem>
__device__ __forceinline__ Smem& ws_shared_storage() {
    extern __shared__ uint8_t ws_smem_raw[];
    const uint32_t raw = smem_addr(ws_smem_raw);
    const uint32_t aligned = (raw + (WS_SMEM_ALIGN - 1)) & ~(uint32_t)(WS_SMEM_ALIGN - 1);
    return *reinterpret_cast<Smem*>(__cvta_shared_to_generic(aligned));
}

// ----------------------------------------------------------------------------------------------------------------
// Ring position

// Where one side of a ring is: the stage of the current entry and the parity of the round it is in.
template <int STAGES>
struct RingState {
    int stage = 0;
    uint32_t phase = 0;

    __device__ __forceinline__ void advance() {
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
        }
    }
    __device__ __forceinline__ RingState next() const {
        RingState n = *this;
        n.advance();
        return n;
    }
};

// A ring's mbarriers, inside the kernel's shared-memory struct.
template <int STAGES>
struct RingBarriers {
    uint64_t full[STAGES];
    uint64_t empty[STAGES];

    __device__ __forceinline__ uint32_t full_bar(int stage) const { return smem_addr(&full[stage]); }
    __device__ __forceinline__ uint32_t empty_bar(int stage) const { return smem_addr(&empty[stage]); }

    // Thread 0: full[s] waits for full_arrivals (the producer's arrive.expect_tx, plus any plain arrivals), empty[s]
    // for empty_arrivals (the readers of a stage). Published by the caller's ws_publish_barriers.
    __device__ __forceinline__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full_bar(s), full_arrivals);
            mbarrier_init(empty_bar(s), empty_arrivals);
        }
    }
    // Producer: waits until the stage is free to refill (its readers released the round before), then expects
    // `bytes` of TMA on its full barrier.
    __device__ __forceinline__ void acquire(const RingState<STAGES>& p, uint32_t bytes) const {
        mbarrier_wait(empty_bar(p.stage), p.phase ^ 1);
        mbarrier_arrive_expect_tx(full_bar(p.stage), bytes);
    }
    // Consumer: the stage holds its tile.
    __device__ __forceinline__ void wait_full(const RingState<STAGES>& c) const {
        mbarrier_wait(full_bar(c.stage), c.phase);
    }
    // Consumer: this thread is done reading the stage.
    __device__ __forceinline__ void release(int stage) const { mbarrier_arrive(empty_bar(stage)); }
    // A producer that fills its part of a stage with ordinary stores (one of full's plain arrivals): waits until the
    // stage is free as acquire does, then, once its stores are done, arrive_full.
    __device__ __forceinline__ void wait_empty(const RingState<STAGES>& p) const {
        mbarrier_wait(empty_bar(p.stage), p.phase ^ 1);
    }
    __device__ __forceinline__ void arrive_full(int stage) const { mbarrier_arrive(full_bar(stage)); }
};

// Thread 0 has initialised the mbarriers: make them visible to every thread and to the TMA unit. The CTA-wide
// barrier here is the kernel's last; after it the warpgroups part ways.
__device__ __forceinline__ void ws_publish_barriers() {
    if (threadIdx.x == 0) fence_mbarrier_init();
    __syncthreads();
}

// ----------------------------------------------------------------------------------------------------------------
// Roles

// The consumer warpgroup's index (0 or 1), through a shuffle: as threadIdx.x / 128 - 1, ptxas cannot tell it is the
// same across the warp. It then built wgmma descriptors in per-thread registers and moved them to uniform ones one
// at a time (the fused SwiGLU backward 4-5% slower), and serialised the dK/dV kernel's wgmmas when they ran on across
// items (C7515).
__device__ __forceinline__ int ws_consumer_index() {
    return __shfl_sync(0xffffffff, (int)threadIdx.x / 128 - 1, 0);
}

// The two consumer warpgroups taking turns at something (issuing their wgmma batches, a shared buffer) through the
// named barriers FIRST (warpgroup 0's turn) and FIRST + 1 (warpgroup 1's). start() lets warpgroup 0 go first;
// wait() blocks until it is this warpgroup's turn; pass() gives the turn to the other; finish(), after a loop in
// which every turn was passed, consumes warpgroup 1's last pass so that no arrival is left pending at exit.
template <int FIRST>
struct TurnTaking {
    static_assert(FIRST >= 1 && FIRST + 1 <= 15, "named barrier ids are 1 .. 15 (0 is __syncthreads)");
    int wg;

    __device__ __forceinline__ void start() const {
        if (wg == 1) named_barrier_arrive<WS_CONSUMER_THREADS>(FIRST);
    }
    __device__ __forceinline__ void wait() const { named_barrier_sync<WS_CONSUMER_THREADS>(FIRST + wg); }
    __device__ __forceinline__ void pass() const { named_barrier_arrive<WS_CONSUMER_THREADS>(FIRST + 1 - wg); }
    __device__ __forceinline__ void finish() const {
        if (wg == 0) named_barrier_sync<WS_CONSUMER_THREADS>(FIRST);
    }
};

// The i-th work item of this CTA in a persistent kernel: rounds of gridDim.x items, taken alternately in and against
// CTA order (a snake). Items sorted longest first would give CTA 0 the longest item of every round with a fixed
// stride; the snake evens the totals out (the hd 128 attention forward at (1, 8192): 610-638 TFLOP/s with the fixed
// stride, 670-674 with the snake; the dQ kernel +2-3% at hd 128; H100).
__device__ __forceinline__ int persistent_item(int i) {
    return i * gridDim.x + ((i & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
}

// ----------------------------------------------------------------------------------------------------------------
// Host-side set-up, once per kernel

// The SMs of the current device: a persistent kernel's grid (one CTA fills an SM).
inline int ws_sm_count() {
    static int sms = 0;  // the device does not change within a process
    if (sms == 0) {
        int device = 0;
        cudaCheck(cudaGetDevice(&device));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    }
    return sms;
}

// Before a kernel's first launch: its dynamic shared memory allowed, and its register split checked. setmaxnreg.inc
// waits for the registers setmaxnreg.dec returned to the CTA's allocation, so a kernel compiled to fewer registers
// per thread than the split needs would hang: that is a build error, reported as one. `done`: the caller's static
// flag for this kernel.
template <typename Kernel>
inline void ws_prepare_kernel(Kernel kernel, const char* name, size_t smem_bytes, bool& done) {
    if (done) return;
    if (smem_bytes > (size_t)WS_SMEM_LIMIT) {
        fprintf(stderr, "%s: needs %zu bytes of shared memory, an SM has %d per block\n", name, smem_bytes,
                WS_SMEM_LIMIT);
        fail_exit();
    }
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes));
    cudaFuncAttributes attr;
    cudaCheck(cudaFuncGetAttributes(&attr, kernel));
    if (attr.numRegs * WS_THREADS < WS_REGS_NEEDED) {
        fprintf(stderr, "%s: kernel compiled to %d registers per thread, the producer / consumer split needs %d\n",
                name, attr.numRegs, WS_REGS_NEEDED / WS_THREADS);
        fail_exit();
    }
    done = true;
}
