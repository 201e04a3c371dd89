// Host-side glue shared by the dev/cuda CUTLASS programs: one GemmUniversalAdapter instance with its workspace,
// initialised for a set of arguments, then run. Include after the CUTLASS headers.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "../../llmc/cuda_common.h"

template <class Gemm>
struct CutlassGemm {
    Gemm gemm;
    void* workspace = nullptr;
    size_t workspace_bytes = 0;

    CutlassGemm() = default;
    CutlassGemm(const CutlassGemm&) = delete;
    CutlassGemm& operator=(const CutlassGemm&) = delete;
    ~CutlassGemm() {
        if (workspace) cudaFree(workspace);
    }
    // false if CUTLASS cannot run these arguments (shape, alignment)
    bool initialize(const typename Gemm::Arguments& args) {
        if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
        size_t need = Gemm::get_workspace_size(args);
        if (need > workspace_bytes) {
            if (workspace) cudaCheck(cudaFree(workspace));
            cudaCheck(cudaMalloc(&workspace, need));
            workspace_bytes = need;
        }
        return gemm.initialize(args, workspace) == cutlass::Status::kSuccess;
    }
    void run() {
        if (gemm.run() != cutlass::Status::kSuccess) {
            printf("CUTLASS run failed\n");
            exit(1);
        }
        cudaCheck(cudaGetLastError());
    }
};
