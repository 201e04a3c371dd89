// Where the time goes: named regions of the training step.
//
// Every region is an NVTX range, so nsys and ncu users see the step's structure (NVTX is header-only and costs
// next to nothing when no profiler listens). With timing on (train_llama3cu -p 1), each region is also bracketed by
// CUDA events on the stream; after each step, collect() adds up the elapsed times per region name, and report()
// prints a table of milliseconds per step and share of the step. Regions with the same name (the same part of
// every layer) add up. Regions must not nest when timing: each one's time is its own. When timing, begin() first
// waits for the stream, so a region's time is its GPU work alone, not GPU idle time while the CPU was still
// launching; the sum of the regions against the step's wall time then shows the host overhead. Code marks a region
// with a ProfileScope for the length of a block.
#pragma once

#include <nvtx3/nvToolsExt.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda_common.h"

struct Profiler {
    bool timing = false;
    cudaStream_t stream = 0;
    struct Region {
        std::string name;
        double total_ms = 0.0;  // GPU time
        double host_ms = 0.0;   // CPU time spent issuing the region's work
    };
    std::vector<Region> regions;  // in first-seen order, which is step order
    std::vector<cudaEvent_t> events;
    std::vector<int> pending;  // region index of each begin/end event pair recorded this step
    int steps = 0;
    bool warmed_up = false;
    std::chrono::steady_clock::time_point host_start;

    void begin(const char* name) {
        nvtxRangePushA(name);
        if (!timing) return;
        int index = -1;
        for (size_t i = 0; i < regions.size(); i++) {
            if (regions[i].name == name) { index = (int)i; break; }
        }
        if (index < 0) {
            regions.push_back({name, 0.0});
            index = (int)regions.size() - 1;
        }
        pending.push_back(index);
        cudaCheck(cudaStreamSynchronize(stream));
        record(2 * pending.size() - 2);
        host_start = std::chrono::steady_clock::now();
    }

    void end() {
        nvtxRangePop();
        if (!timing) return;
        record(2 * pending.size() - 1);
        regions[pending.back()].host_ms +=
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start).count();
    }

    // After the step's work has finished (the caller synchronised): add up this step's region times. The first
    // step is left out: it pays one-time costs (module loading, cuBLASLt's first-call setup, algorithm choice).
    void collect() {
        if (!timing) return;
        if (!warmed_up) {
            warmed_up = true;
            for (Region& r : regions) r.total_ms = r.host_ms = 0.0;
            pending.clear();
            return;
        }
        for (size_t i = 0; i < pending.size(); i++) {
            float ms = 0.0f;
            cudaCheck(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
            regions[pending[i]].total_ms += ms;
        }
        pending.clear();
        steps++;
    }

    void report(double step_ms) const {
        if (!timing || steps == 0) return;
        double sum = 0.0;
        for (const Region& r : regions) sum += r.total_ms / steps;
        printf("profile: mean ms per step over %d steps after the first (regions sum to %.2f ms; step wall time %.2f ms)\n", steps,
               sum, step_ms);
        printf("  %-28s %9s %8s %12s\n", "region", "GPU ms", "share", "host ms");
        for (const Region& r : regions) {
            double ms = r.total_ms / steps;
            printf("  %-28s %9.3f %7.1f%% %12.3f\n", r.name.c_str(), ms, 100.0 * ms / sum, r.host_ms / steps);
        }
    }

    ~Profiler() {
        for (cudaEvent_t e : events) cudaEventDestroy(e);
    }

  private:
    void record(size_t slot) {
        while (events.size() <= slot) {
            cudaEvent_t e;
            cudaCheck(cudaEventCreate(&e));
            events.push_back(e);
        }
        cudaCheck(cudaEventRecord(events[slot], stream));
    }
};

// Brackets a C++ scope as a region: `ProfileScope region(prof, "fwd rope");` ends it where the scope ends, so a
// region is a block and cannot be left open on an early return. Not copyable: a copy would end the region twice.
struct ProfileScope {
    Profiler& profiler;
    ProfileScope(Profiler& p, const char* name) : profiler(p) { profiler.begin(name); }
    ProfileScope(const ProfileScope&) = delete;
    ProfileScope& operator=(const ProfileScope&) = delete;
    ~ProfileScope() { profiler.end(); }
};

// Keeps work outside the training step (evaluation, samples) out of the timing table while it is in scope.
struct ProfilerPause {
    Profiler& profiler;
    bool was_timing;
    explicit ProfilerPause(Profiler& p) : profiler(p), was_timing(p.timing) { profiler.timing = false; }
    ~ProfilerPause() { profiler.timing = was_timing; }
};
