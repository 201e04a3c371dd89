// A layer's gradient reduce-scatter on the copy engines, for ranks that share one host and reach each other's memory
// (ZeRO stages 1 and 2 with -E 1, the default; Gradients in multi_gpu.cuh decides).
//
// Why: NCCL's reduce-scatter runs as SM kernels that hold their SMs while they wait for the link, and the persistent
// products launched beside them wait for those SMs. Measured alone on 2 H100s (dev/NOTES.md, sixth session), the w13
// input-gradient product lost 0.18 ms beside one layer's NCCL reduce-scatter and 0.05 ms beside copy-engine copies of
// the same bytes plus an add kernel, which also finished sooner (0.26 against 0.34 ms) and gave NCCL's bits. In the
// 1B's ZeRO-1 step on 2 H100s: 227.96 and 228.37 ms against NCCL's 228.89 and 229.94 (seventh session).
//
// How, for message k (one call, a group of slices; slot k % 2 of every inbox):
//   sender r, for every peer p: waits until p has consumed message k - 2 (the slot's last), copies its part p of
//     each slice into p's inbox (peer memory, cudaMemcpyAsync: the copy engine), then writes k into p's
//     arrived[r] (cuStreamWriteValue32, which fences the copies before it).
//   receiver r: waits until arrived[p] >= k for every peer (cuStreamWaitValue32), sums every rank's part in rank
//     order into its gradient shard (accumulate: adds that sum into it, as NCCL's path does), then writes k into
//     every peer's consumed[r].
// Everything is queued on the collectives' stream, after the NCCL operations before it, so the ranks' order holds.
// Layouts: inbox [2 slots][world - 1 senders][capacity] of floatX, the sender s at index s < r ? s : s - 1; flags
// [arrived: world][consumed: world] of uint32, in device memory that the peers map (CUDA IPC).
// Sums: with 2 ranks a + b in fp32, rounded once, as NCCL's; with more ranks rank order, not NCCL's ring order.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <vector>

#if defined(USE_MPI)
#include <cuda.h>
#include <cudaTypedefs.h>
#include <mpi.h>
#endif

#include "cuda_common.h"
#include "shard_layout.h"

// Where each rank's part of a slice is: the rank's own gradients, or its inbox.
template <int MAX_RANKS>
struct PartPointers {
    const floatX* p[MAX_RANKS];
};

// out[i] = sum over the ranks of part q's element i (parts[q]), in rank order in fp32, rounded to floatX once; with
// `accumulate`, out[i] += that rounded sum (two roundings, as a reduce-scatter in place then shard_accumulate).
// VEC elements a thread (VEC16: one 16-byte access a part, every pointer 16-byte aligned); the last n % VEC elements
// one a thread.
template <int MAX_RANKS, int VEC>
__global__ void sum_parts_kernel(floatX* out, PartPointers<MAX_RANKS> parts, int world, size_t n, bool accumulate) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (size_t i = first * VEC; i + VEC <= n; i += stride * VEC) {
        float sum[VEC], part[VEC];
        load_as_float<VEC>(sum, parts.p[0] + i);
        for (int q = 1; q < world; q++) {
            load_as_float<VEC>(part, parts.p[q] + i);
            for (int j = 0; j < VEC; j++) sum[j] += part[j];
        }
        if (accumulate) {
            float before[VEC];
            load_as_float<VEC>(before, out + i);
            for (int j = 0; j < VEC; j++) sum[j] = before[j] + to_float(from_float<floatX>(sum[j]));
        }
        store_from_float<VEC>(out + i, sum);
    }
    const size_t tail = n - n % VEC;
    if (first < n - tail) {
        const size_t i = tail + first;
        float sum = to_float(parts.p[0][i]);
        for (int q = 1; q < world; q++) sum += to_float(parts.p[q][i]);
        floatX rounded = from_float<floatX>(sum);
        out[i] = accumulate ? from_float<floatX>(to_float(out[i]) + to_float(rounded)) : rounded;
    }
}

// sum_parts_kernel over n elements of `world` parts, on `stream`: a grid-stride loop over at most 1056 blocks (8 per
// SM of an H100), 16-byte accesses where every part and the output allow them. Checked in dev/cuda/peer_reduce.cu.
template <int MAX_RANKS>
inline void sum_parts(floatX* out, const PartPointers<MAX_RANKS>& parts, int world, size_t n, bool accumulate,
                      cudaStream_t stream) {
    uintptr_t bits = reinterpret_cast<uintptr_t>(out);
    for (int q = 0; q < world; q++) bits |= reinterpret_cast<uintptr_t>(parts.p[q]);
    const bool vec = (bits & 15) == 0;
    const size_t blocks = ceil_div<size_t>(ceil_div<size_t>(n, vec ? VEC16 : 1), 512);
    const unsigned grid = (unsigned)(blocks < 1056 ? blocks : 1056);
    if (vec) sum_parts_kernel<MAX_RANKS, VEC16><<<grid, 512, 0, stream>>>(out, parts, world, n, accumulate);
    else sum_parts_kernel<MAX_RANKS, 1><<<grid, 512, 0, stream>>>(out, parts, world, n, accumulate);
    cudaCheckLaunch();
}

struct PeerReduce {
    static constexpr int MAX_RANKS = 8;
    bool enabled = false;

    PeerReduce() = default;
    PeerReduce(const PeerReduce&) = delete;
    PeerReduce& operator=(const PeerReduce&) = delete;

#if defined(USE_MPI)
    // Sets up the inboxes and flags; every rank calls it, once every GPU can reach the others' memory
    // (every_gpu_reaches_every_other). `capacity_elements`: the largest group's part.
    void setup(int rank, int world, size_t capacity_elements) {
        if (world > MAX_RANKS) return;  // more GPUs than one host has: the reductions stay NCCL's
        int device = 0;
        cudaCheck(cudaGetDevice(&device));
        if (!fetch_stream_memory_ops()) {
            fprintf(stderr, "Error: the driver lacks the stream memory operations of the copy-engine reductions; "
                            "run with -E 0\n");
            fail_exit();
        }
        // where the device can, each wait also makes the peer's earlier writes (the inbox) visible to the work after it
        int can_flush = 0;
        cudaCheck(cudaDeviceGetAttribute(&can_flush, cudaDevAttrCanFlushRemoteWrites, device));
        wait_flags = CU_STREAM_WAIT_VALUE_GEQ | (can_flush ? CU_STREAM_WAIT_VALUE_FLUSH : 0);
        this->rank = rank;
        this->world = world;
        capacity = capacity_elements;
        cudaCheck(cudaMalloc(&inbox, 2 * (size_t)(world - 1) * capacity * sizeof(floatX)));
        cudaCheck(cudaMalloc(&flags, 2 * (size_t)world * sizeof(uint32_t)));
        cudaCheck(cudaMemset(flags, 0, 2 * (size_t)world * sizeof(uint32_t)));
        cudaCheck(cudaDeviceSynchronize());  // the flags are zero before any peer can write them
        cudaIpcMemHandle_t mine[2], all[2 * MAX_RANKS];
        cudaCheck(cudaIpcGetMemHandle(&mine[0], inbox));
        cudaCheck(cudaIpcGetMemHandle(&mine[1], flags));
        MPI_Allgather(mine, (int)sizeof(mine), MPI_BYTE, all, (int)sizeof(mine), MPI_BYTE, MPI_COMM_WORLD);
        for (int q = 0; q < world; q++) {
            if (q == rank) continue;
            void* p = nullptr;
            cudaCheck(cudaIpcOpenMemHandle(&p, all[2 * q], cudaIpcMemLazyEnablePeerAccess));
            peer_inbox[q] = static_cast<floatX*>(p);
            cudaCheck(cudaIpcOpenMemHandle(&p, all[2 * q + 1], cudaIpcMemLazyEnablePeerAccess));
            peer_flags[q] = static_cast<uint32_t*>(p);
        }
        MPI_Barrier(MPI_COMM_WORLD);  // every rank's flags are zero and mapped before any message
        enabled = true;
    }
    ~PeerReduce() {
        if (!enabled) return;
        for (int q = 0; q < world; q++) {
            if (q == rank) continue;
            cudaCheck(cudaIpcCloseMemHandle(peer_inbox[q]));
            cudaCheck(cudaIpcCloseMemHandle(peer_flags[q]));
        }
        cudaCheck(cudaFree(inbox));
        cudaCheck(cudaFree(flags));
    }

    // Reduce-scatters the slices `indices` (slice indices[i] read at src[i]) into grad_shard (ShardLayout's shard
    // offsets), on `stream`. The caller queues it where it would queue NCCL's (Gradients::reduce).
    void reduce_scatter(const ShardLayout& s, const std::vector<int>& indices, const std::vector<floatX*>& src,
                        floatX* grad_shard, bool accumulate, cudaStream_t stream) {
        const uint32_t k = ++messages;
        const int slot = (int)(k % 2);
        // where each slice's part sits within a sender's stretch of an inbox slot
        std::vector<size_t> at(indices.size());
        size_t total = 0;
        for (size_t i = 0; i < indices.size(); i++) {
            at[i] = total;
            total += s.part(s.slices[indices[i]]);
        }
        if (total > capacity) {
            fprintf(stderr, "Error: copy-engine reduction of %zu elements exceeds its inbox (%zu)\n", total, capacity);
            fail_exit();
        }
        CUstream cu_stream = reinterpret_cast<CUstream>(stream);
        for (int p = 0; p < world; p++) {
            if (p == rank) continue;
            if (k > 2) {
                wait_value(cu_stream, address(consumed(p)), k - 2);
            }
            floatX* dst = peer_inbox[p] + ((size_t)slot * (world - 1) + sender_index(rank, p)) * capacity;
            for (size_t i = 0; i < indices.size(); i++) {
                const ParamSlice& slice = s.slices[indices[i]];
                size_t part = s.part(slice);
                cudaCheck(cudaMemcpyAsync(dst + at[i], src[i] + (size_t)p * part, part * sizeof(floatX),
                                          cudaMemcpyDeviceToDevice, stream));
            }
            write_value(cu_stream, address(peer_flags[p] + rank), k);  // arrived[rank] at p
        }
        for (int p = 0; p < world; p++) {
            if (p != rank) wait_value(cu_stream, address(flags + p), k);  // arrived[p] here
        }
        for (size_t i = 0; i < indices.size(); i++) {
            const ParamSlice& slice = s.slices[indices[i]];
            size_t part = s.part(slice);
            PartPointers<MAX_RANKS> parts = {};
            for (int q = 0; q < world; q++) {
                parts.p[q] = q == rank ? src[i] + (size_t)rank * part
                                       : inbox + ((size_t)slot * (world - 1) + sender_index(q, rank)) * capacity + at[i];
            }
            sum_parts(grad_shard + s.shard_offset(slice), parts, world, part, accumulate, stream);
        }
        for (int p = 0; p < world; p++) {
            if (p != rank) write_value(cu_stream, address(peer_flags[p] + world + rank), k);  // consumed[rank] at p
        }
    }

  private:
    int rank = 0, world = 1;
    size_t capacity = 0;
    uint32_t messages = 0;
    unsigned wait_flags = 0;
    floatX* inbox = nullptr;
    uint32_t* flags = nullptr;
    floatX* peer_inbox[MAX_RANKS] = {};
    uint32_t* peer_flags[MAX_RANKS] = {};
    PFN_cuStreamWaitValue32_v11070 wait_fn = nullptr;
    PFN_cuStreamWriteValue32_v11070 write_fn = nullptr;

    // a sender's index among the world - 1 senders into `receiver`'s inbox
    static int sender_index(int sender, int receiver) { return sender < receiver ? sender : sender - 1; }
    uint32_t* consumed(int p) { return flags + world + p; }
    static CUdeviceptr address(uint32_t* p) { return reinterpret_cast<CUdeviceptr>(p); }

    bool fetch_stream_memory_ops() {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 11070, cudaEnableDefault, &found) !=
                cudaSuccess || found != cudaDriverEntryPointSuccess) {
            return false;
        }
        wait_fn = reinterpret_cast<PFN_cuStreamWaitValue32_v11070>(fn);
        if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 11070, cudaEnableDefault, &found) !=
                cudaSuccess || found != cudaDriverEntryPointSuccess) {
            return false;
        }
        write_fn = reinterpret_cast<PFN_cuStreamWriteValue32_v11070>(fn);
        return true;
    }
    void wait_value(CUstream stream, CUdeviceptr at, uint32_t value) {
        if (wait_fn(stream, at, value, wait_flags) != CUDA_SUCCESS) {
            fprintf(stderr, "Error: cuStreamWaitValue32 failed (copy-engine reduction)\n");
            fail_exit();
        }
    }
    void write_value(CUstream stream, CUdeviceptr at, uint32_t value) {
        if (write_fn(stream, at, value, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
            fprintf(stderr, "Error: cuStreamWriteValue32 failed (copy-engine reduction)\n");
            fail_exit();
        }
    }
#endif
};
