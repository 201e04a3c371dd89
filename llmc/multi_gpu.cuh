// Data parallel training over several GPUs: one process per GPU, launched by MPI, collectives through NCCL, and the
// ZeRO sharding of the optimizer state (stage 1), of the gradients (stage 2) and of the weights (stage 3).
//
// Processes. MPI (mpirun, or srun with MPI) starts one process per GPU and hands the NCCL id from rank 0 to the
// others; every collective on GPU data afterwards is NCCL, while the few host values summed over the ranks (the
// loss, the step's target count, the checkpoint barrier) go through MPI (all_reduce_sum). Each rank takes the GPU
// of its local rank (its index among the ranks of its host). A binary started without a launcher runs as one rank
// and touches neither MPI nor NCCL, so the single-GPU path is the plain trainer. Built with USE_MPI=0 (no MPI or
// NCCL at hand) only one rank exists.
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
//      layer-sized buffers and the head tensors' into a third (an untied lm_head's and the embedding's in turn in
//      one place), each is reduce-scattered as soon as it is complete, and the rank's part is added into its
//      gradient shard (every micro-batch, so gradient accumulation works).
//   3  as 2, and no rank holds the whole model: the bf16 weights too exist only as the rank's shard. Each layer is
//      all-gathered into one of two layer-sized buffers before the forward uses it and again before the backward
//      does, while the layer before computes; the embedding and final norm are gathered after every update, an
//      untied lm_head into the embedding's place once the forward has read it (Weights).
// Gradients are reduced as soon as the backward has produced them, on a second stream while the backward goes on:
// an untied lm_head's right after the classifier, each layer's slices (one NCCL group) while the layers below
// compute, the other head tensors (embedding, final norm) as one group once the embedding's is written, before layer
// 0's last products and its reduction; the step waits for them all. The weights' gathers go on that same stream:
// NCCL operations of one communicator must be queued in the same order on every rank, which one stream and the same
// program give (NCCL also runs them one after another, whatever their streams).
//
// Copy engines (-E 1, where every rank is on one host and each GPU reaches the others' memory): NCCL's collectives
// are SM kernels, and the products beside them lose the SMs they hold. So at stages 1 and 2 each layer's
// reduce-scatter is peer copies plus a small sum kernel (PeerReduce, llmc/peer_reduce.cuh), and the weights' buffers
// are NCCL symmetric windows, which NCCL 2.28 with the "zero" CTA policy gathers on the copy engines. The head's
// reductions stay NCCL's, and so do stage 3's (beside its gathers the peer copies measured slower).
//
// Determinism: the same ranks, flags and seed give bit-identical results (NCCL's reduction order is fixed for a
// given communicator; every sum here has one fixed order). Stage 1 updates each element exactly as stage 0 does:
// the sum of N values does not depend on the collective, and the optimizer draws its stochastic-rounding bits by
// the element's index within its tensor (llmc/adamw.cuh index_offset). Stage 3 reduces and updates as stage 2 does
// and computes on gathered copies of the same weights, so its results are stage 2's bit for bit. With the peer
// copies on more than 2 GPUs, stages 1 and 2 sum each element in rank order and NCCL (stages 0 and 3) in its ring's
// order: other last bits, each run still deterministic.
//
// Errors: any rank that stops (a bad file, out of memory, a CUDA or NCCL error) goes through fail_exit, which here
// aborts the whole MPI job, so no rank waits forever on a peer that is gone. A rank whose collectives do not finish
// within the timeout (-T; a peer hangs) aborts its NCCL communicator and then the job, with a message naming it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "model.h"
#include "cuda_common.h"
#include "shard_layout.h"
#include "peer_reduce.cuh"

#if defined(USE_MPI)
#include <cuda.h>          // the virtual memory API's types (CommBuffer)
#include <cudaTypedefs.h>  // and its function types
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
    int rank = 0, world = 1, local_rank = 0, local_size = 1;
    int timeout_s = 600;  // a collective that takes longer means a peer is gone or stuck
    // Copy engines (-E 1, every rank on this host and every GPU able to reach the others' memory): the layers'
    // gradient reduce-scatters as peer copies (stages 1 and 2, PeerReduce); `weight_windows` (NCCL 2.28 or later
    // also): the weights' buffers are symmetric windows, whose gathers NCCL then runs on the copy engines.
    bool copy_engines = false, weight_windows = false;
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
    MPI_Comm_size(local, &mg.local_size);
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

#if defined(USE_MPI)
// True on every rank when all ranks run on this host and each GPU can read and write every other's memory (and
// NCCL_P2P_DISABLE does not ask for the network path instead); the same answer everywhere.
inline bool every_gpu_reaches_every_other() {
    MultiGpu& mg = g_multi_gpu;
    int here = mg.local_size == mg.world ? 1 : 0;
    const char* p2p_off = getenv("NCCL_P2P_DISABLE");
    if (p2p_off != nullptr && atoi(p2p_off) != 0) here = 0;
    int device = 0;
    cudaCheck(cudaGetDevice(&device));
    std::vector<int> devices(mg.world);
    MPI_Allgather(&device, 1, MPI_INT, devices.data(), 1, MPI_INT, MPI_COMM_WORLD);
    for (int q = 0; q < mg.world && here; q++) {
        int can = 1;
        if (q != mg.rank) cudaCheck(cudaDeviceCanAccessPeer(&can, device, devices[q]));
        if (!can) here = 0;
    }
    int everywhere = 0;
    MPI_Allreduce(&here, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return everywhere != 0;
}
#endif

// Every rank: the NCCL communicator (rank 0 makes the id, MPI broadcasts it). Call after cudaSetDevice.
// `copy_engines` (-E): use them where every GPU reaches the others (MultiGpu::copy_engines); with NCCL 2.28 or later
// the communicator's CTA policy is then "zero", so gathers into symmetric windows run on the copy engines (the other
// collectives keep their SM kernels and their sums).
inline void multi_gpu_init_nccl(bool copy_engines) {
#if defined(USE_MPI)
    MultiGpu& mg = g_multi_gpu;
    if (mg.world == 1) return;
    mg.copy_engines = copy_engines && every_gpu_reaches_every_other();
    int version = 0;
    ncclCheck(ncclGetVersion(&version));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    mg.weight_windows = mg.copy_engines && version >= 22800;
    if (mg.weight_windows) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    ncclUniqueId id;
    if (mg.rank == 0) ncclCheck(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclCheck(ncclCommInitRankConfig(&mg.comm, mg.world, id, mg.rank, &config));
#else
    (void)copy_engines;
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

// The NCCL library loaded at run time, as "NCCL 2.28.9" (its knobs, such as NCCL_CTA_POLICY, depend on it), or "" when
// built without it.
inline std::string nccl_version() {
#if defined(USE_MPI)
    int code = 0;
    if (ncclGetVersion(&code) != ncclSuccess) return "NCCL (version unknown)";
    return "NCCL " + std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." +
           std::to_string(code % 100);
#else
    return "";
#endif
}

inline void multi_gpu_finish() {
#if defined(USE_MPI)
    MultiGpu& mg = g_multi_gpu;
    if (mg.comm != nullptr) ncclCheck(ncclCommDestroy(mg.comm));
    mg.comm = nullptr;  // its buffer registrations went with it (CommBuffer)
    if (mg.mpi) MPI_Finalize();
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// Device memory that the collectives read and write in place: the gradients, their summed shards and the weights

// On several GPUs this memory is registered with the communicator (ncclCommRegister). NCCL's ring collectives between
// the GPUs of a host then read and write it directly over NVLink (its IPC registration) instead of staging every
// chunk through NCCL's own buffers: fewer copies, and less of the SM and memory time that the kernels running beside
// the collectives lose to them. NCCL registers only memory of CUDA's virtual memory API, so the buffer comes from
// cuMemCreate (exportable as a POSIX file descriptor, which NCCL hands to the peer) at the driver's granularity,
// 2 MiB; ncclMemAlloc would round each buffer up to the multicast granularity, hundreds of MiB on GPUs that have
// multicast. NCCL_LOCAL_REGISTER=0 has NCCL leave the registration unused (to compare). Where the virtual memory API
// or the registration fails, the buffer is plain cudaMalloc memory and a note says why. On one GPU: cudaMalloc.
#if defined(USE_MPI)
// The virtual memory API's driver functions, fetched from the runtime once (no -lcuda, as tensor_map.cuh does).
struct VirtualMemoryApi {
    PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
    PFN_cuMemCreate_v10020 create = nullptr;
    PFN_cuMemRelease_v10020 release = nullptr;
    PFN_cuMemAddressReserve_v10020 reserve = nullptr;
    PFN_cuMemAddressFree_v10020 address_free = nullptr;
    PFN_cuMemMap_v10020 map = nullptr;
    PFN_cuMemUnmap_v10020 unmap = nullptr;
    PFN_cuMemSetAccess_v10020 set_access = nullptr;
    bool usable() const {
        return granularity && create && release && reserve && address_free && map && unmap && set_access;
    }
};

inline const VirtualMemoryApi& virtual_memory_api() {
    static VirtualMemoryApi api = [] {
        auto fetch = [](const char* name) -> void* {
            void* fn = nullptr;
            cudaDriverEntryPointQueryResult found;
            if (cudaGetDriverEntryPointByVersion(name, &fn, 10020, cudaEnableDefault, &found) != cudaSuccess ||
                found != cudaDriverEntryPointSuccess) {
                return nullptr;
            }
            return fn;
        };
        VirtualMemoryApi a;
        a.granularity = reinterpret_cast<PFN_cuMemGetAllocationGranularity_v10020>(
            fetch("cuMemGetAllocationGranularity"));
        a.create = reinterpret_cast<PFN_cuMemCreate_v10020>(fetch("cuMemCreate"));
        a.release = reinterpret_cast<PFN_cuMemRelease_v10020>(fetch("cuMemRelease"));
        a.reserve = reinterpret_cast<PFN_cuMemAddressReserve_v10020>(fetch("cuMemAddressReserve"));
        a.address_free = reinterpret_cast<PFN_cuMemAddressFree_v10020>(fetch("cuMemAddressFree"));
        a.map = reinterpret_cast<PFN_cuMemMap_v10020>(fetch("cuMemMap"));
        a.unmap = reinterpret_cast<PFN_cuMemUnmap_v10020>(fetch("cuMemUnmap"));
        a.set_access = reinterpret_cast<PFN_cuMemSetAccess_v10020>(fetch("cuMemSetAccess"));
        return a;
    }();
    return api;
}
#endif

// How a CommBuffer is registered with NCCL. `local`: ncclCommRegister, for the ring collectives over NVLink in place.
// `window`: a symmetric window (ncclCommWindowRegister, collective over the ranks), into which NCCL 2.28 with the
// "zero" CTA policy (multi_gpu_init_nccl) gathers on the copy engines instead of with SM kernels. Only the weights'
// buffers are windows (MultiGpu::weight_windows): a gather only copies, while NCCL's symmetric reduce kernels sum in
// another order than the ring (other bits, measured). On 2 H100s the windows took ZeRO-3's step from 238.33 to
// 232.72 ms and from 237.08 to 232.37 (dev/NOTES.md, seventh session).
enum class Registration { local, window };

template <typename T>
struct CommBuffer {
    T* ptr = nullptr;
    size_t count = 0;
    CommBuffer() = default;
    explicit CommBuffer(size_t n, Registration how = Registration::local) : count(n) {
#if defined(USE_MPI)
        if (g_multi_gpu.comm != nullptr && n > 0) {
            const bool mapped_here = map_memory();
            bool windowed = false;
            if (how == Registration::window) {
                // registering a window is collective: every rank registers one, or none does
                int here = mapped_here ? 1 : 0, everywhere = 0;
                MPI_Allreduce(&here, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
                if (everywhere) {
                    windowed = ncclCommWindowRegister(g_multi_gpu.comm, ptr, mapped, &window,
                                                      NCCL_WIN_COLL_SYMMETRIC) == ncclSuccess;
                    if (!windowed) {
                        window = nullptr;
                        note("ncclCommWindowRegister failed; registered locally instead");
                    }
                }
            }
            if (mapped_here && !windowed) register_locally();
            if (mapped_here) return;
        }
#endif
        cudaCheck(cudaMalloc(&ptr, bytes()));
    }
    CommBuffer(const CommBuffer&) = delete;
    CommBuffer& operator=(const CommBuffer&) = delete;
    CommBuffer(CommBuffer&& o) noexcept { take(o); }
    CommBuffer& operator=(CommBuffer&& o) noexcept {
        if (this != &o) {
            free_memory();
            take(o);
        }
        return *this;
    }
    ~CommBuffer() { free_memory(); }
    size_t bytes() const { return count * sizeof(T); }
#if defined(USE_MPI)
    bool windowed() const { return window != nullptr; }
#else
    bool windowed() const { return false; }
#endif

  private:
#if defined(USE_MPI)
    CUmemGenericAllocationHandle memory = 0;  // 0: cudaMalloc memory
    size_t mapped = 0;                        // bytes reserved and mapped, a multiple of the granularity
    void* registration = nullptr;             // NCCL's handle; nullptr where it did not register
    ncclWindow_t window = nullptr;            // the symmetric window (Registration::window), else nullptr

    // The buffer from the virtual memory API; false (nothing held) where that cannot be had.
    bool map_memory() {
        const VirtualMemoryApi& vm = virtual_memory_api();
        if (!vm.usable()) return fall_back("the driver lacks the virtual memory API");
        int device = 0;
        cudaCheck(cudaGetDevice(&device));
        CUmemAllocationProp prop = {};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        size_t granularity = 0;
        if (vm.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || granularity == 0)
            return fall_back("cuMemGetAllocationGranularity failed");
        const size_t size = (bytes() + granularity - 1) / granularity * granularity;
        CUmemGenericAllocationHandle handle = 0;
        if (vm.create(&handle, size, &prop, 0) != CUDA_SUCCESS) return fall_back("cuMemCreate failed");
        CUdeviceptr address = 0;
        if (vm.reserve(&address, size, granularity, 0, 0) != CUDA_SUCCESS) {
            vm.release(handle);
            return fall_back("cuMemAddressReserve failed");
        }
        CUmemAccessDesc access = {};
        access.location = prop.location;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if (vm.map(address, size, 0, handle, 0) != CUDA_SUCCESS) {
            vm.address_free(address, size);
            vm.release(handle);
            return fall_back("cuMemMap failed");
        }
        if (vm.set_access(address, size, &access, 1) != CUDA_SUCCESS) {
            vm.unmap(address, size);
            vm.address_free(address, size);
            vm.release(handle);
            return fall_back("cuMemSetAccess failed");
        }
        ptr = reinterpret_cast<T*>(address);
        memory = handle;
        mapped = size;
        return true;
    }

    void register_locally() {
        if (ncclCommRegister(g_multi_gpu.comm, ptr, mapped, &registration) != ncclSuccess) {
            registration = nullptr;  // the memory serves as it is, unregistered
            note("ncclCommRegister failed");
        }
    }

    static bool fall_back(const char* why) {
        note(why);
        return false;
    }

    static void note(const char* why) {
        static bool said = false;
        if (said) return;
        said = true;
        fprintf(stderr, "note: [rank %d] the collectives' buffers are not registered with NCCL (%s): NCCL stages "
                        "them through its own buffers\n", g_multi_gpu.rank, why);
    }
#endif

    void take(CommBuffer& o) {
        ptr = o.ptr;
        count = o.count;
        o.ptr = nullptr;
        o.count = 0;
#if defined(USE_MPI)
        memory = o.memory;
        mapped = o.mapped;
        registration = o.registration;
        window = o.window;
        o.memory = 0;
        o.mapped = 0;
        o.registration = nullptr;
        o.window = nullptr;
#endif
    }

    void free_memory() {
        if (ptr == nullptr) return;
#if defined(USE_MPI)
        if (memory != 0) {
            // a communicator destroyed first (multi_gpu_finish) took its registrations with it
            if (registration != nullptr && g_multi_gpu.comm != nullptr) {
                ncclCheck(ncclCommDeregister(g_multi_gpu.comm, registration));
            }
            if (window != nullptr && g_multi_gpu.comm != nullptr) {
                ncclCheck(ncclCommWindowDeregister(g_multi_gpu.comm, window));
            }
            const VirtualMemoryApi& vm = virtual_memory_api();
            const CUdeviceptr address = reinterpret_cast<CUdeviceptr>(ptr);
            vm.unmap(address, mapped);
            vm.address_free(address, mapped);
            vm.release(memory);
            ptr = nullptr;
            memory = 0;
            registration = nullptr;
            window = nullptr;
            return;
        }
#endif
        cudaFree(ptr);
        ptr = nullptr;
    }
};

// Polls query() (cudaStreamQuery or cudaEventQuery) until the work it asks about is done, giving up on a collective
// that never finishes: after timeout_s it names this rank and aborts the job through MPI, whose launcher kills every
// rank. Not through ncclCommAbort first: with the copy engines (-E 1) the stuck work can be a stream waiting on a
// stopped peer's flag, which no NCCL abort releases, and ncclCommAbort then spun for good (5 of 8 runs with a rank
// frozen by SIGSTOP, 2026-11-26). Without a communicator it returns at once (the caller's plain synchronize waits).
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
                                "stopped answering; aborting the job\n", mg.rank, mg.world, mg.timeout_s);
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

// The sum over ranks of a host value, the same on every rank: MPI brings every rank's value to every rank, and each
// adds them in rank order (with 2 ranks a + b, as an NCCL sum gives). Host only, on purpose: NCCL runs the operations
// of one communicator one after another whatever their streams (each launch waits for the communicator's previous
// one), so a sum through NCCL would wait for every collective queued before it, e.g. the weight gathers that the
// update queued, which the next forward waits for layer by layer instead. Gives up after the collective timeout (-T),
// as stream_sync does, so a rank that stops answering stops the job here too.
inline double all_reduce_sum(double value) {
#if defined(USE_MPI)
    MultiGpu& mg = g_multi_gpu;
    if (mg.world > 1) {
        std::vector<double> values(mg.world);
        MPI_Request request;
        MPI_Iallgather(&value, 1, MPI_DOUBLE, values.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD, &request);
        wait_for_collectives([&] {
            int done = 0;
            MPI_Test(&request, &done, MPI_STATUS_IGNORE);
            return done ? cudaSuccess : cudaErrorNotReady;
        });
        MPI_Wait(&request, MPI_STATUS_IGNORE);  // without a communicator the loop above returns at once
        value = values[0];
        for (int r = 1; r < mg.world; r++) value += values[r];
    }
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
//   stages 1 to 3, accumulate false: reduce-scatter into the rank's gradient shard (overwriting it).
//   stages 2 and 3, accumulate true: reduce-scatter in place (the rank's part lands at src + rank * part), then add it
//   into the gradient shard.
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

// Every rank's parts of the parameter slices `indices` to every rank: this rank's part of slice indices[i] is read at
// parts[i], the whole slice written at wholes[i] (stages 1 and 2 gather in place, parts[i] = wholes[i] + rank * part).
// One NCCL group per call.
inline void all_gather_slices(const ShardLayout& s, const std::vector<int>& indices,
                              const std::vector<const floatX*>& parts, const std::vector<floatX*>& wholes,
                              cudaStream_t stream) {
#if defined(USE_MPI)
    ncclCheck(ncclGroupStart());
    for (size_t i = 0; i < indices.size(); i++) {
        ncclCheck(ncclAllGather(parts[i], wholes[i], s.part(s.slices[indices[i]]), NCCL_FLOATX, g_multi_gpu.comm,
                                stream));
    }
    ncclCheck(ncclGroupEnd());
#else
    (void)s; (void)indices; (void)parts; (void)wholes; (void)stream;
#endif
}

// ----------------------------------------------------------------------------------------------------------------
// A rank's gradients and their sum over the ranks

// Where the backward writes the gradients, and their reduction as soon as each group of them is complete (stages:
// see the top of this file). Stages 0 and 1: `buffer` is the whole gradient in flat parameter order. Stages 2 and 3:
// `buffer` is only scratch (SlotLayout): two layer-sized slots that alternate (layer l in slot l % 2), a slot cleared
// before each use once the reduction of the layer it held before is done; then the vocabulary table and the final
// norm. An untied lm_head's gradient, complete when the classifier is, is reduced at the backward's start (in every
// stage), and in stages 2 and 3 the embedding's, written at its end, takes its place. Stages 1 to 3 sum into
// `summed`, this rank's shard of the summed gradients.
//
// The backward calls classifier_done() first, begin_layer(l) before it writes layer l's gradients, layer_done(l)
// after, begin_embedding() before the embedding's, head_done() once the head tensors' are complete, and wait_all()
// last. The reductions run on comm_stream after what the main stream has queued so far, so each overlaps the
// backward that follows it; the main stream waits for them all in wait_all, so the step's gradients are complete
// after it (with overlap off, -Q 0, it waits for each as it is queued). On several GPUs the backward queues the
// head's reduction before layer 0's, whose last weight-gradient products then compute beside it (Llama3::backward).
struct Gradients {
    int stage = 0;         // ZeRO stage (-Z); 0 on one GPU
    bool overlap = true;   // -Q; with 0 the main stream waits for each reduction as soon as it is queued
    ShardLayout shards;
    CommBuffer<floatX> buffer, summed;
    SlotLayout slots;  // of `buffer` in stages 2 and 3
    cudaStream_t comm_stream = 0;  // the collectives: these reductions and the weights' gathers (Weights)
    cudaEvent_t queued = nullptr, reduced = nullptr, slot_free[2] = {nullptr, nullptr}, table_free = nullptr;
    // The head tensors' slices, reduced last, and an untied lm_head's, reduced first (classifier_done).
    std::vector<int> last_slices, lm_head_slices;
    PeerReduce peer_reduce;  // stages 1 and 2 with copy engines: the layers' reduce-scatters as peer copies

    bool sharded() const { return stage >= 1; }
    // Stages 2 and 3: `buffer` is only scratch (layer slots and the head), the summed gradients only a shard.
    bool in_slots() const { return stage >= 2; }

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
        for (int i : shards.head_slices) {
            bool first = shards.slices[i].tensor == LM_HEAD;
            (first ? lm_head_slices : last_slices).push_back(i);
        }
        if (mg.world > 1) {
            cudaCheck(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
            for (cudaEvent_t* e : {&queued, &reduced, &slot_free[0], &slot_free[1], &table_free}) {
                cudaCheck(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
            }
#if defined(USE_MPI)
            // Not at stage 3: there the weights' gathers hold the copy engines, and on 2 H100s its step with both
            // was 0.61 and 0.49 ms slower than with the gathers alone on them (dev/NOTES.md, seventh session).
            if (mg.copy_engines && (stage == 1 || stage == 2)) {
                size_t layer_part = 0;
                for (int i : shards.layer_slices[0]) layer_part += shards.part(shards.slices[i]);
                peer_reduce.setup(mg.rank, mg.world, layer_part);
            }
#endif
        }
    }

    // `buffer` (zeroed) and `summed`, after setup.
    void allocate() {
        slots = make_slot_layout(config);
        buffer = CommBuffer<floatX>(in_slots() ? slots.size() : param_layout(config).total);
        if (sharded()) summed = CommBuffer<floatX>(shards.shard_size);
        cudaCheck(cudaMemset(buffer.ptr, 0, buffer.bytes()));
    }

    // Where the backward writes the gradients of the head tensors (tok_embedding, final_norm and lm_head) and of
    // layer l's (the per-layer tensors, each pointing at layer l's slice).
    ParamTensors<floatX> head() const {
        return in_slots() ? slot_tensors(buffer.ptr, slots, 0) : point_params(buffer.ptr, config);
    }
    ParamTensors<floatX> layer(int l) const {
        return in_slots() ? slot_tensors(buffer.ptr, slots, l) : layer_tensors(buffer.ptr, config, l);
    }

    // The classifier's gradient is complete: an untied lm_head's is reduced now, while the layers' backward runs
    // (stages 2 and 3 then let the embedding's take its place, begin_embedding). `accumulate` as for layer_done.
    void classifier_done(bool accumulate, cudaStream_t stream) {
        if (!lm_head_slices.empty()) reduce(lm_head_slices, head(), accumulate, table_free, stream);
    }

    // Before the backward writes layer l's gradients. Stages 2 and 3: the slot's last layer (l + 2) must be reduced
    // before the slot is cleared.
    void begin_layer(int l, cudaStream_t stream) {
        if (!in_slots()) return;
        cudaCheck(cudaStreamWaitEvent(stream, slot_free[l % 2]));
        cudaCheck(cudaMemsetAsync(buffer.ptr + slots.slot_offset(l), 0, slots.slot_size * sizeof(floatX), stream));
    }

    // Layer l's gradients are complete on `stream`: sums them over the ranks on comm_stream. `accumulate`: stages 2
    // and 3 add into `summed` instead of overwriting it (the micro-batches after a step's first).
    void layer_done(int l, bool accumulate, cudaStream_t stream) {
        reduce(shards.layer_slices[l], layer(l), accumulate, slot_free[l % 2], stream, true);
    }

    // Before the backward adds the embedding's gradient: stages 2 and 3 clear the table once an untied lm_head's
    // gradient there is reduced.
    void begin_embedding(cudaStream_t stream) {
        if (!in_slots() || lm_head_slices.empty()) return;
        cudaCheck(cudaStreamWaitEvent(stream, table_free));
        cudaCheck(cudaMemsetAsync(head().tok_embedding, 0, param_layout(config).sizes[TOK_EMBEDDING] * sizeof(floatX),
                                  stream));
    }

    // The head tensors' gradients (the embedding's, the final norm's) are complete: sums them. `accumulate` as for
    // layer_done.
    void head_done(bool accumulate, cudaStream_t stream) { reduce(last_slices, head(), accumulate, nullptr, stream); }

    // Every reduction of the micro-batch is queued: `stream` waits for them all, so the step's gradients are complete
    // after it. Stages 2 and 3 then clear the head tensors for the next micro-batch's classifier.
    void wait_all(cudaStream_t stream) {
        cudaCheck(cudaStreamWaitEvent(stream, reduced));
        if (in_slots()) {
            cudaCheck(cudaMemsetAsync(buffer.ptr + slots.head_offset(), 0, slots.head_size * sizeof(floatX), stream));
        }
    }

    // The gradients restart at zero. Stages 2 and 3 clear `buffer` here (the backward adds into it) and return true.
    // The other stages return false: the caller's next backward overwrites the gradients instead of adding to them.
    bool zero_grad(cudaStream_t stream) {
        if (!in_slots()) return false;
        cudaCheck(cudaMemsetAsync(buffer.ptr, 0, buffer.bytes(), stream));
        return true;
    }

  private:
    Llama3Config config;

    // Sums the slices `indices` (held at their places in g) over the ranks on comm_stream, after what `stream` has
    // queued so far; `done` (optional) is recorded when they are finished.
    // `layer`: a layer's slices, which go on the copy engines where peer_reduce is on. The head's stay NCCL's: the
    // vocabulary table's would need an inbox 4.3 times a layer's at the 1B.
    void reduce(const std::vector<int>& indices, const ParamTensors<floatX>& g, bool accumulate, cudaEvent_t done,
                cudaStream_t stream, bool layer = false) {
        std::vector<floatX*> src;
        for (int i : indices) src.push_back(g[shards.slices[i].tensor]);
        cudaCheck(cudaEventRecord(queued, stream));
        cudaCheck(cudaStreamWaitEvent(comm_stream, queued));
        if (layer && peer_reduce.enabled) {
#if defined(USE_MPI)
            peer_reduce.reduce_scatter(shards, indices, src, summed.ptr, accumulate, comm_stream);
#endif
        } else {
            reduce_gradient_slices(shards, indices, src, stage, summed.ptr, accumulate, comm_stream);
        }
        cudaCheck(cudaEventRecord(reduced, comm_stream));
        if (done != nullptr) cudaCheck(cudaEventRecord(done, comm_stream));
        if (!overlap) cudaCheck(cudaStreamWaitEvent(stream, reduced));
    }
};

// ----------------------------------------------------------------------------------------------------------------
// The weights the forward and backward read, and the gathers that put them there

// Groups of slices, gathered as one: group 0 the head tensors, group l + 1 layer l, and in stage 3 with an untied
// lm_head group L + 1 the lm_head (group 0 then holds the embedding and the final norm).
//
// Stages 0 to 2: `params` is the whole model in flat order on every rank, and the passes read it there. After a
// sharded update (stages 1 and 2) a rank has updated only its parts: each group is all-gathered in place on
// comm_stream as soon as its update is queued.
// Stage 3: `params` is only this rank's shard, and the passes read `gathered` (SlotLayout): two layer slots, layer l
// in slot l % 2, the vocabulary table and the final norm. A slot remembers the group it holds until the next update,
// and a group is gathered into its slot only when the slot does not hold it. prefetch queues that gather on
// comm_stream after everything the main stream has queued so far, so the slot's previous group must have its last
// reader queued by then: the forward prefetches layer l + 2 once layer l's last product is queued (and the backward
// l - 2), so each gather overlaps the layer between; the first two layers come with the update, and the backward's
// first two are the forward's last two, the next micro-batch's first two the backward's last two, all held. The
// table holds the embedding (with the final norm, gathered after every update) for the forward's start, then an
// untied lm_head, gathered once the embedding is read, for the classifier; a tied one is the embedding.
// Memory per rank in stage 3: the shard, 2 bytes x params / N, and 2 bytes x (two layers + V x C + C).
//
// The passes read the weights through layer(l), embedding(), final_norm() and lm_head(): pointers into `params` or
// `gathered` once the stream waits for their gather (in every stage: a wait for a gather already done costs nothing).
// In stage 3 these gather what their slot lacks, so a prefetch only moves a gather earlier.
struct Weights {
    int stage = 0;         // ZeRO stage (-Z); 0 on one GPU
    bool overlap = true;   // -Q; with 0 the main stream waits for each gather as soon as it is queued
    CommBuffer<floatX> params;    // stages 0 to 2: the whole model, in flat order; stage 3: this rank's shard
    CommBuffer<floatX> gathered;  // stage 3: SlotLayout

    // `params` and `gathered` (uninitialised), and on several GPUs the gathers' events. The gathers use the shard
    // layout and the stream of the gradients' reductions (Gradients::setup).
    void allocate(const Llama3Config& c, const ShardLayout& shard_layout, cudaStream_t comm) {
        config = c;
        shards = &shard_layout;
        comm_stream = comm;
        slots = make_slot_layout(c);
        // stage 0 gathers no weights: nothing to run on the copy engines
        const Registration how = g_multi_gpu.weight_windows && stage >= 1 ? Registration::window : Registration::local;
        params = CommBuffer<floatX>(stage == 3 ? shards->shard_size : param_layout(c).total, how);
        groups.assign(c.n_layers + 2, {});
        for (int i : shards->head_slices) {
            bool own_group = stage == 3 && shards->slices[i].tensor == LM_HEAD;
            groups[own_group ? c.n_layers + 1 : 0].push_back(i);
        }
        for (int l = 0; l < c.n_layers; l++) groups[l + 1] = shards->layer_slices[l];
        if (stage == 3) gathered = CommBuffer<floatX>(slots.size(), how);
        if (stage >= 1) {
            cudaCheck(cudaEventCreateWithFlags(&queued, cudaEventDisableTiming));
            group_gathered.resize(groups.size());
            for (cudaEvent_t& e : group_gathered) cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        }
    }

    // Where this rank's part of `slice` lives in `params`.
    floatX* part(const ParamSlice& slice) {
        return params.ptr + (stage == 3 ? shards->shard_offset(slice) : shards->owned_offset(slice));
    }

    // Layer l's weights (the per-layer tensors at layer l's slices) and the head tensors', for work on `stream`.
    ParamTensors<floatX> layer(int l, cudaStream_t stream) {
        ready(l + 1, stream);
        return tensors(l);
    }
    const floatX* embedding(cudaStream_t stream) {
        ready(0, stream);
        return tensors(0).tok_embedding;
    }
    const floatX* final_norm(cudaStream_t stream) {
        wait(0, stream);  // group 0's every gather writes it: the one after the update is enough
        return tensors(0).final_norm;
    }
    const floatX* lm_head(cudaStream_t stream) {
        ready(lm_head_group(), stream);
        return tensors(0).lm_head;
    }

    // Stage 3: the gather of layer l (none when l is no layer), and of the lm_head once the embedding is read.
    void prefetch(int l, cudaStream_t stream) {
        if (l >= 0 && l < config.n_layers) prefetch_group(l + 1, stream);
    }
    void prefetch_lm_head(cudaStream_t stream) { prefetch_group(lm_head_group(), stream); }
    // Stage 3 with an untied lm_head: the embedding back in the table's place, for a forward on the same weights (the
    // next micro-batch's), once the passes have read the lm_head and the final norm. A tied table holds it already.
    void prefetch_embedding(cudaStream_t stream) { prefetch_group(0, stream); }

    // `params` was written on `stream` (a model loaded, or the update from its group 0 on): stage 3 forgets what the
    // slots held and gathers the head.
    void params_written(cudaStream_t stream) {
        if (stage != 3) return;
        for (int& g : held) g = -1;
        prefetch_group(0, stream);
    }

    // The update has queued its writes of group `group`'s parts on `stream` (Optimizer::update_shard: group 0 first,
    // then the layers). Stages 1 and 2 gather the group; stage 3 the head, and the next forward's first two layers
    // while the update goes on.
    void part_updated(int group, cudaStream_t stream) {
        if (stage != 3) {
            gather(group, stream);
        } else if (group == 0) {
            params_written(stream);
        } else if (group <= 2) {
            prefetch(group - 1, stream);
        }
    }

    // The whole model as fp32 on rank 0's host (empty on the other ranks). Every rank calls it: stage 3 gathers the
    // groups one by one into their slots.
    std::vector<float> whole_fp32(cudaStream_t stream) {
        const bool root = g_multi_gpu.rank == 0;
        std::vector<float> host;
        if (stage != 3) {
            if (!root) return host;
            if (stage >= 1) stream_sync(comm_stream);  // the gathers after the last update
            std::vector<floatX> raw(params.count);
            cudaCheck(cudaMemcpy(raw.data(), params.ptr, params.bytes(), cudaMemcpyDeviceToHost));
            return std::vector<float>(raw.begin(), raw.end());
        }
        if (root) host.resize(param_layout(config).total);
        std::vector<floatX> staged;
        for (int group = 0; group < (int)groups.size(); group++) {
            if (groups[group].empty()) continue;
            ready(group, stream);
            if (!root) continue;
            stream_sync(stream);  // a copy to pageable memory blocks until the stream is done: wait with the timeout
            for (int i : groups[group]) {
                const ParamSlice& s = shards->slices[i];
                staged.resize(s.size);
                cudaCheck(cudaMemcpy(staged.data(), gathered.ptr + slots.at(s.tensor, s.layer), s.size * sizeof(floatX),
                                     cudaMemcpyDeviceToHost));
                for (size_t j = 0; j < s.size; j++) host[s.offset + j] = (float)staged[j];
            }
        }
        return host;
    }

  private:
    Llama3Config config;
    const ShardLayout* shards = nullptr;
    SlotLayout slots;
    cudaStream_t comm_stream = 0;
    std::vector<std::vector<int>> groups;     // each group's slices
    cudaEvent_t queued = nullptr;
    std::vector<cudaEvent_t> group_gathered;  // recorded on comm_stream when each group's last gather is done
    int held[3] = {-1, -1, -1};               // stage 3: the group each slot holds (two layers, the table), or -1

    int lm_head_group() const { return groups.back().empty() ? 0 : (int)groups.size() - 1; }
    int slot_of(int group) const { return group >= 1 && group <= config.n_layers ? (group - 1) % 2 : 2; }

    ParamTensors<floatX> tensors(int l) {
        return stage == 3 ? slot_tensors(gathered.ptr, slots, l) : layer_tensors(params.ptr, config, l);
    }

    // Stage 3: gathers group `group` into its slot unless the slot holds it.
    void prefetch_group(int group, cudaStream_t stream) {
        if (stage != 3 || held[slot_of(group)] == group) return;
        held[slot_of(group)] = group;
        gather(group, stream);
    }

    void wait(int group, cudaStream_t stream) {
        if (stage >= 1) cudaCheck(cudaStreamWaitEvent(stream, group_gathered[group]));
    }
    void ready(int group, cudaStream_t stream) {
        prefetch_group(group, stream);
        wait(group, stream);
    }

    // Gathers group `group` on comm_stream after what `stream` has queued so far: in place in stages 1 and 2, into
    // its slot in stage 3.
    void gather(int group, cudaStream_t stream) {
        const std::vector<int>& indices = groups[group];
        std::vector<const floatX*> parts;
        std::vector<floatX*> wholes;
        for (int i : indices) {
            const ParamSlice& s = shards->slices[i];
            parts.push_back(part(s));
            wholes.push_back(stage == 3 ? gathered.ptr + slots.at(s.tensor, s.layer) : params.ptr + s.offset);
        }
        cudaCheck(cudaEventRecord(queued, stream));
        cudaCheck(cudaStreamWaitEvent(comm_stream, queued));
        all_gather_slices(*shards, indices, parts, wholes, comm_stream);
        cudaCheck(cudaEventRecord(group_gathered[group], comm_stream));
        if (!overlap) cudaCheck(cudaStreamWaitEvent(stream, group_gathered[group]));
    }
};
