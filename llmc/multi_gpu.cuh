// Data parallel training over several GPUs: one process per GPU, launched by MPI, collectives through NCCL, and the
// ZeRO sharding of the optimizer state (stage 1) and of the gradients (stage 2).
//
// Processes. MPI (mpirun, or srun with MPI) starts one process per GPU and hands the NCCL id from rank 0 to the
// others; every collective afterwards is NCCL. Each rank takes the GPU of its local rank (its index among the ranks
// of its host). A binary started without a launcher runs as one rank and touches neither MPI nor NCCL, so the
// single-GPU path is the plain trainer. Built with USE_MPI=0 (no MPI or NCCL at hand) only one rank exists.
//
// Slices and shards (llmc/shard_layout.h): every tensor slice (a layer's part of a per-layer tensor, or a whole
// other tensor) is split into N equal parts, and rank r owns part r of each; its shard is those parts back to back.
//
// Stages (-Z):
//   0  every rank reduces the whole gradient (all-reduce) and keeps the whole optimizer state; all update everything.
//   1  the optimizer state (fp32 master weights, m, v) exists for the rank's shard only; gradients are summed with a
//      reduce-scatter into the rank's gradient shard, the rank updates its parts of the parameters, and an
//      all-gather brings everyone's parts to every rank.
//   2  as 1, and no rank holds the whole gradient: the backward writes each layer's gradients into one of two
//      layer-sized buffers and the head tensors' into a third, each is reduce-scattered as soon as it is complete,
//      and the rank's part is added into its gradient shard (every micro-batch, so gradient accumulation works).
// Gradients are reduced as soon as the backward has produced them: each layer's slices (one NCCL group) on a
// second stream while the backward goes on with the layers below; the head tensors (embedding, final norm, lm_head)
// form the last group, which the step waits for.
//
// Determinism: the same ranks, flags and seed give bit-identical results (NCCL's reduction order is fixed for a
// given communicator; every sum here has one fixed order). Stage 1 updates each element exactly as stage 0 does:
// the sum of N values does not depend on the collective, and the optimizer draws its stochastic-rounding bits by
// the element's index within its tensor (llmc/adamw.cuh index_offset).
//
// Errors: any rank that stops (a bad file, out of memory, a CUDA or NCCL error) goes through fail_exit, which here
// aborts the whole MPI job, so no rank waits forever on a peer that is gone. A rank whose collectives do not finish
// within the timeout (-T; a peer hangs) aborts its NCCL communicator and then the job, with a message naming it.
#pragma once

#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

#include "model.h"
#include "cuda_common.h"
#include "shard_layout.h"

#if defined(USE_MPI)
#include <mpi.h>
#include <nccl.h>

inline void nccl_check(ncclResult_t status, const char* file, int line) {
    if (status != ncclSuccess) {
        fprintf(stderr, "NCCL error: %s [%s:%d]\n", ncclGetErrorString(status), file, line);
        fail_exit();
    }
}
#define ncclCheck(status) nccl_check((status), __FILE__, __LINE__)

#if defined(ENABLE_FP32)
constexpr ncclDataType_t NCCL_FLOATX = ncclFloat;
#else
constexpr ncclDataType_t NCCL_FLOATX = ncclBfloat16;
#endif
#endif

// The processes of the run. One global, as the error path (fail_exit's hook) needs it too.
struct MultiGpu {
    int rank = 0, world = 1, local_rank = 0;
    int timeout_s = 600;  // a collective that takes longer means a peer is gone or stuck
#if defined(USE_MPI)
    ncclComm_t comm = nullptr;
    bool mpi = false;
#endif
};
inline MultiGpu g_multi_gpu;

// True when a launcher (OpenMPI's mpirun, a PMI/PMIx launcher such as srun) started this process.
inline bool started_by_launcher() {
    const char* vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_RANK"};
    for (const char* v : vars) {
        if (getenv(v) != nullptr) return true;
    }
    return false;
}

#if defined(USE_MPI)
// fail_exit's hook under MPI: stop every rank (MPI_Abort) instead of leaving them waiting in a collective.
inline void multi_gpu_abort_job() {
    fprintf(stderr, "[rank %d of %d] stopped (error above); aborting all ranks\n", g_multi_gpu.rank,
            g_multi_gpu.world);
    fflush(stderr);
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
}
#endif

// Starts MPI when launched by one, picks this rank's GPU. NCCL comes later (multi_gpu_init_nccl), once the GPU is set.
inline void multi_gpu_init(int* argc, char*** argv) {
    if (!started_by_launcher()) return;
#if defined(USE_MPI)
    MultiGpu& mg = g_multi_gpu;
    int provided;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "Error: MPI_Init failed\n");
        exit(EXIT_FAILURE);
    }
    mg.mpi = true;
    MPI_Comm_rank(MPI_COMM_WORLD, &mg.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &mg.world);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, mg.rank, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &mg.local_rank);
    MPI_Comm_free(&local);
    if (mg.world > 1) g_fail_hook = multi_gpu_abort_job;
#else
    (void)argc;
    (void)argv;
    const char* size = getenv("OMPI_COMM_WORLD_SIZE");
    if (size == nullptr) size = getenv("PMI_SIZE");
    if (size != nullptr && atoi(size) > 1) {
        fprintf(stderr, "Error: started by an MPI launcher with %s ranks, but this binary was built without MPI and "
                        "NCCL (USE_MPI=0); rebuild with USE_MPI=1\n", size);
        exit(EXIT_FAILURE);
    }
#endif
}

// Every rank: the NCCL communicator (rank 0 makes the id, MPI broadcasts it). Call after cudaSetDevice.
inline void multi_gpu_init_nccl() {
#if defined(USE_MPI)
    MultiGpu& mg = g_multi_gpu;
    if (mg.world == 1) return;
    ncclUniqueId id;
    if (mg.rank == 0) ncclCheck(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclCheck(ncclCommInitRank(&mg.comm, mg.world, id, mg.rank));
#endif
}

// Host data from rank 0 to every rank (bootstrap values such as the run id, before the GPUs are set up).
inline void multi_gpu_broadcast(void* data, size_t bytes) {
#if defined(USE_MPI)
    if (g_multi_gpu.world > 1) MPI_Bcast(data, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
#else
    (void)data;
    (void)bytes;
#endif
}

inline void multi_gpu_finish() {
#if defined(USE_MPI)
    MultiGpu& mg = g_multi_gpu;
    if (mg.comm != nullptr) ncclCheck(ncclCommDestroy(mg.comm));
    if (mg.mpi) MPI_Finalize();
#endif
}

// Polls query() (cudaStreamQuery or cudaEventQuery) until the work it asks about is done, giving up on a collective
// that never finishes: after timeout_s it aborts the NCCL communicator and the job, naming this rank. Without a
// communicator it returns at once (the caller's plain synchronize then waits).
template <typename Query>
inline void wait_for_collectives(Query query) {
#if defined(USE_MPI)
    MultiGpu& mg = g_multi_gpu;
    if (mg.comm != nullptr) {
        auto start = std::chrono::steady_clock::now();
        for (;;) {
            cudaError_t err = query();
            if (err == cudaSuccess) return;
            if (err != cudaErrorNotReady) cudaCheck(err);
            ncclResult_t async_err;
            ncclCheck(ncclCommGetAsyncError(mg.comm, &async_err));
            ncclCheck(async_err);
            double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (waited > mg.timeout_s) {
                fprintf(stderr, "Error: [rank %d of %d] collectives did not finish within %d s (-T): another rank "
                                "stopped answering; aborting NCCL and the job\n", mg.rank, mg.world, mg.timeout_s);
                ncclCommAbort(mg.comm);
                mg.comm = nullptr;
                fail_exit();
            }
            std::this_thread::sleep_for(std::chrono::microseconds(waited < 1.0 ? 20 : 1000));
        }
    }
#else
    (void)query;
#endif
}

// cudaStreamSynchronize and cudaEventSynchronize with the collective timeout (wait_for_collectives).
inline void stream_sync(cudaStream_t stream) {
    wait_for_collectives([&] { return cudaStreamQuery(stream); });
    cudaCheck(cudaStreamSynchronize(stream));
}
inline void event_sync(cudaEvent_t event) {
    wait_for_collectives([&] { return cudaEventQuery(event); });
    cudaCheck(cudaEventSynchronize(event));
}

// The sum over ranks of a host value, the same on every rank (fixed order). `scratch`: one device double.
inline double all_reduce_sum(double value, double* scratch, cudaStream_t stream) {
#if defined(USE_MPI)
    MultiGpu& mg = g_multi_gpu;
    if (mg.world > 1) {
        cudaCheck(cudaMemcpyAsync(scratch, &value, sizeof(double), cudaMemcpyHostToDevice, stream));
        ncclCheck(ncclAllReduce(scratch, scratch, 1, ncclFloat64, ncclSum, mg.comm, stream));
        stream_sync(stream);  // a copy to pageable memory blocks until the stream is done: wait with the timeout first
        cudaCheck(cudaMemcpyAsync(&value, scratch, sizeof(double), cudaMemcpyDeviceToHost, stream));
        stream_sync(stream);
    }
#else
    (void)scratch;
    (void)stream;
#endif
    return value;
}

// In-place sum over ranks of a device float buffer (the grad norm's partial sums).
inline void all_reduce_sum_device(float* values, size_t count, cudaStream_t stream) {
#if defined(USE_MPI)
    if (g_multi_gpu.world > 1) ncclCheck(ncclAllReduce(values, values, count, ncclFloat, ncclSum, g_multi_gpu.comm,
                                                       stream));
#else
    (void)values;
    (void)count;
    (void)stream;
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// Reductions and gathers over the shards (their layout: llmc/shard_layout.h)

// dst[i] = src[i] (assign) or dst[i] += src[i], in fp32: a stage-2 gradient shard gathering its micro-batches.
__global__ void shard_accumulate_kernel(floatX* dst, const floatX* src, size_t n, bool assign) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = to_float(src[i]);
        dst[i] = from_float<floatX>(assign ? x : to_float(dst[i]) + x);
    }
}

inline void shard_accumulate(floatX* dst, const floatX* src, size_t n, bool assign, cudaStream_t stream) {
    if (n == 0) return;
    size_t blocks = ceil_div<size_t>(n, 256);
    shard_accumulate_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, stream>>>(dst, src, n, assign);
    cudaCheckLaunch();
}

// Sums the gradient slices `indices` over the ranks; slice indices[i] is read at src[i] (where the backward wrote it).
//   stage 0: all-reduce in place.
//   stage 1 and 2, accumulate false: reduce-scatter into the rank's gradient shard (overwriting it).
//   stage 2, accumulate true: reduce-scatter in place (the rank's part lands at src + rank * part), then add it into
//   the gradient shard.
// One NCCL group per call, so a layer's slices go as one operation.
inline void reduce_gradient_slices(const ShardLayout& s, const std::vector<int>& indices,
                                   const std::vector<floatX*>& src, int stage, floatX* grad_shard, bool accumulate,
                                   cudaStream_t stream) {
#if defined(USE_MPI)
    ncclComm_t comm = g_multi_gpu.comm;
    ncclCheck(ncclGroupStart());
    for (size_t i = 0; i < indices.size(); i++) {
        const ParamSlice& slice = s.slices[indices[i]];
        size_t part = s.part(slice);
        if (stage == 0) {
            ncclCheck(ncclAllReduce(src[i], src[i], slice.size, NCCL_FLOATX, ncclSum, comm, stream));
        } else if (!accumulate) {
            ncclCheck(ncclReduceScatter(src[i], grad_shard + s.shard_offset(slice), part, NCCL_FLOATX, ncclSum, comm,
                                        stream));
        } else {
            ncclCheck(ncclReduceScatter(src[i], src[i] + s.rank * part, part, NCCL_FLOATX, ncclSum, comm, stream));
        }
    }
    ncclCheck(ncclGroupEnd());
    if (stage >= 1 && accumulate) {
        for (size_t i = 0; i < indices.size(); i++) {
            const ParamSlice& slice = s.slices[indices[i]];
            shard_accumulate(grad_shard + s.shard_offset(slice), src[i] + s.rank * s.part(slice), s.part(slice), false,
                             stream);
        }
    }
#else
    (void)s; (void)indices; (void)src; (void)stage; (void)grad_shard; (void)accumulate; (void)stream;
#endif
}

// Stages 1 and 2, after the update: every rank's parts of the slices `indices` of the parameters to every rank
// (in place).
inline void all_gather_params(const ShardLayout& s, const std::vector<int>& indices, floatX* params,
                              cudaStream_t stream) {
#if defined(USE_MPI)
    ncclCheck(ncclGroupStart());
    for (int i : indices) {
        const ParamSlice& slice = s.slices[i];
        ncclCheck(ncclAllGather(params + s.owned_offset(slice), params + slice.offset, s.part(slice), NCCL_FLOATX,
                                g_multi_gpu.comm, stream));
    }
    ncclCheck(ncclGroupEnd());
#else
    (void)s; (void)indices; (void)params; (void)stream;
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// A rank's gradients and their sum over the ranks

// Where the backward writes the gradients, and their reduction as soon as each group of them is complete (stages:
// see the top of this file). Stages 0 and 1: `buffer` is the whole gradient in flat parameter order. Stage 2:
// `buffer` is only scratch, two layer-sized slots that alternate (layer l in slot l % 2) followed by the head
// tensors (embedding, final norm, lm_head); a slot is cleared before each use, once the reduction of the layer it
// held before is done. Stages 1 and 2 sum into `summed`, this rank's shard of the summed gradients.
//
// The backward calls begin_layer(l) before it writes layer l's gradients, layer_done(l) after, and head_done() once
// the head tensors' are complete. The reductions run on comm_stream after what the main stream has queued so far, so
// each layer's overlaps the backward of the layers below; the main stream waits for the head's, the last, so the
// step's gradients are complete after head_done (with overlap off, -Q 0, it waits for each).
struct Gradients {
    int stage = 0;         // ZeRO stage (-Z); 0 on one GPU
    bool overlap = true;   // -Q; it applies to the weight gathers after a sharded update too
    ShardLayout shards;
    DeviceBuffer<floatX> buffer, summed;
    size_t slot_size = 0;  // stage 2: one layer's gradients
    cudaStream_t comm_stream = 0;  // the collectives: these reductions, and the weight gathers after a sharded update
    cudaEvent_t queued = nullptr, reduced = nullptr, slot_free[2] = {nullptr, nullptr};

    bool sharded() const { return stage >= 1; }

    // The shard layout of `c` over this run's ranks, and on several GPUs the stream and events of the reductions.
    // Stops with a message when a sharded stage is asked for and the model does not split evenly.
    void setup(const Llama3Config& c) {
        config = c;
        const MultiGpu& mg = g_multi_gpu;
        std::string why;
        if (!make_shard_layout(c, mg.world, mg.rank, &shards, &why)) {
            if (sharded()) {
                fprintf(stderr, "Error: -Z %d shards every tensor slice over the %d GPUs, but %s; use -Z 0\n", stage,
                        mg.world, why.c_str());
                fail_exit();
            }
            make_shard_layout(c, 1, 0, &shards, &why);  // stage 0 reduces whole slices: any size works
        }
        if (mg.world > 1) {
            cudaCheck(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
            cudaCheck(cudaEventCreateWithFlags(&queued, cudaEventDisableTiming));
            cudaCheck(cudaEventCreateWithFlags(&reduced, cudaEventDisableTiming));
            for (cudaEvent_t& e : slot_free) cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        }
    }

    // `buffer` (zeroed) and `summed`, after setup.
    void allocate() {
        if (stage == 2) {
            ParamLayout layout = param_layout(config);
            slot_size = 0;
            for (int i : shards.layer_slices[0]) slot_size += shards.slices[i].size;
            size_t head = layout.sizes[TOK_EMBEDDING] + layout.sizes[FINAL_NORM] + layout.sizes[LM_HEAD];
            buffer = DeviceBuffer<floatX>(2 * slot_size + head);
        } else {
            buffer = DeviceBuffer<floatX>(param_layout(config).total);
        }
        if (sharded()) summed = DeviceBuffer<floatX>(shards.shard_size);
        cudaCheck(cudaMemset(buffer.ptr, 0, buffer.bytes()));
    }

    // Where the backward writes the gradients of the head tensors (tok_embedding, final_norm and lm_head) and of
    // layer l's (the per-layer tensors, each pointing at layer l's slice).
    ParamTensors<floatX> head() const {
        ParamTensors<floatX> g = point_params(buffer.ptr, config);
        if (stage == 2) {
            g.tok_embedding = buffer.ptr + 2 * slot_size;
            g.final_norm = g.tok_embedding + (size_t)config.vocab_size * config.dim;
            g.lm_head = config.tied_embeddings ? g.tok_embedding : g.final_norm + config.dim;
        }
        return g;
    }
    ParamTensors<floatX> layer(int l) const {
        ParamTensors<floatX> g = point_params(buffer.ptr, config);
        ParamLayout layout = param_layout(config);
        floatX* slot = buffer.ptr + (size_t)(l % 2) * slot_size;
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            if (!param_is_per_layer(t)) continue;
            size_t slice = layout.sizes[t] / config.n_layers;
            if (stage == 2) {
                g[t] = slot;
                slot += slice;
            } else {
                g[t] += (size_t)l * slice;
            }
        }
        return g;
    }

    // Before the backward writes layer l's gradients. Stage 2: the slot's last layer (l + 2) must be reduced before
    // the slot is cleared.
    void begin_layer(int l, cudaStream_t stream) {
        if (stage != 2) return;
        cudaCheck(cudaStreamWaitEvent(stream, slot_free[l % 2]));
        cudaCheck(cudaMemsetAsync(buffer.ptr + (size_t)(l % 2) * slot_size, 0, slot_size * sizeof(floatX), stream));
    }

    // Layer l's gradients are complete on `stream`: sums them over the ranks on comm_stream. `accumulate`: stage 2
    // adds into `summed` instead of overwriting it (the micro-batches after a step's first).
    void layer_done(int l, bool accumulate, cudaStream_t stream) {
        reduce(shards.layer_slices[l], layer(l), accumulate, slot_free[l % 2], stream);
    }

    // The head tensors' gradients, the step's last, are complete: sums them, and `stream` waits for every reduction.
    // Stage 2 then clears the head tensors for the next micro-batch's classifier.
    void head_done(bool accumulate, cudaStream_t stream) {
        ParamTensors<floatX> g = head();
        reduce(shards.head_slices, g, accumulate, nullptr, stream);
        cudaCheck(cudaStreamWaitEvent(stream, reduced));
        if (stage == 2) {
            size_t head = buffer.ptr + buffer.count - g.tok_embedding;
            cudaCheck(cudaMemsetAsync(g.tok_embedding, 0, head * sizeof(floatX), stream));
        }
    }

    // The gradients restart at zero. Stage 2 clears `buffer` here (the backward adds into it) and returns true.
    // The other stages return false: the caller's next backward overwrites the gradients instead of adding to them.
    bool zero_grad(cudaStream_t stream) {
        if (stage != 2) return false;
        cudaCheck(cudaMemsetAsync(buffer.ptr, 0, buffer.bytes(), stream));
        return true;
    }

  private:
    Llama3Config config;

    // Sums the slices `indices` (held at their places in g) over the ranks on comm_stream, after what `stream` has
    // queued so far; `done` (optional) is recorded when they are finished.
    void reduce(const std::vector<int>& indices, const ParamTensors<floatX>& g, bool accumulate, cudaEvent_t done,
                cudaStream_t stream) {
        std::vector<floatX*> src;
        for (int i : indices) src.push_back(g[shards.slices[i].tensor]);
        cudaCheck(cudaEventRecord(queued, stream));
        cudaCheck(cudaStreamWaitEvent(comm_stream, queued));
        reduce_gradient_slices(shards, indices, src, stage, summed.ptr, accumulate, comm_stream);
        cudaCheck(cudaEventRecord(reduced, comm_stream));
        if (done != nullptr) cudaCheck(cudaEventRecord(done, comm_stream));
        if (!overlap) cudaCheck(cudaStreamWaitEvent(stream, reduced));
    }
};
