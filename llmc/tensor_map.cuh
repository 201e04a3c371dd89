// TMA tensor maps (host side): the descriptors that cp.async.bulk.tensor reads (ptx.cuh's tma_load_*).
// cuTensorMapEncodeTiled is a driver function; it is fetched from the runtime once (no -lcuda), and every map here
// uses by default the 128-byte swizzle that the wgmma operand layouts expect (ptx.cuh's file comment), and zero
// fill out of bounds.
#pragma once

#include <cstdio>

#include <cuda.h>          // CUtensorMap and its enums
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000

#include "cuda_common.h"

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (encode == nullptr) {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
            fprintf(stderr, "tensor_map: the driver has no cuTensorMapEncodeTiled\n");
            fail_exit();
        }
        encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
    return encode;
}

// A bf16 tensor of `rank` dims (innermost first), strides in bytes of dims 1.. (nested), box in elements (box[0] =
// 64: one 128-byte swizzle row). `what` names it in the error message (with the dims and box).
inline CUtensorMap tensor_map_bf16(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                                   const cuuint32_t* box, const char* what,
                                   CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
    const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
    CUtensorMap map;
    const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base),
                                            dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                            swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "tensor_map: cuTensorMapEncodeTiled failed (CUresult %d) for %s, dims", (int)r, what);
        for (int i = 0; i < rank; i++) fprintf(stderr, " %llu", (unsigned long long)dims[i]);
        fprintf(stderr, ", box");
        for (int i = 0; i < rank; i++) fprintf(stderr, " %u", (unsigned)box[i]);
        fprintf(stderr, "\n");
        fail_exit();
    }
    return map;
}

// A row-major (outer, inner) bf16 matrix with boxes of box_outer rows x box_inner (<= 64) columns.
inline CUtensorMap tensor_map_2d(const void* base, int inner, int outer, int box_inner, int box_outer,
                                 const char* what, CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
    const cuuint64_t dims[2] = {(cuuint64_t)inner, (cuuint64_t)outer};
    const cuuint64_t strides[1] = {(cuuint64_t)inner * 2};
    const cuuint32_t box[2] = {(cuuint32_t)box_inner, (cuuint32_t)box_outer};
    return tensor_map_bf16(base, 2, dims, strides, box, what, swizzle);
}
