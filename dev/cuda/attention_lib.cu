// A C ABI over llmc/attention.cuh for attention_vs_pytorch.py, which loads it with ctypes. Raw device pointers and
// sizes, llmc's layouts (bf16 in the default build), and the caller's CUDA stream (PyTorch's current stream), so the
// kernels order with PyTorch's own work and CUDA events time them like any PyTorch op:
//   qkv, dqkv (B, T, (H + 2 KV) hd)   out, dout (B, T, H hd)   lse, delta (B, H, T) fp32
// The functions are the trainer's entry points (attention_forward / attention_backward, which pick the path as
// llmc/attention.cuh describes), the scalar path for comparison, and the backward under evaluation:
// attention_backward.cu's v6 (attention_backward_v6.cuh, the one-pass backward).
//
// The script builds the library itself:
//   nvcc -O3 -std=c++17 --use_fast_math -shared -Xcompiler -fPIC -DATTENTION_LIB_NO_MAIN
//        -gencode arch=compute_90a,code=sm_90a -o <dir>/libllmc_attention.so attention_lib.cu
// (--use_fast_math as in the trainer's build, so what is timed is what trains.)
// The dev/cuda Makefile builds every .cu here as a program; as one, this file runs a small smoke test of the C ABI
// (forward and backward, v6's too, against the scalar path), so `make all` and `make run_all` keep working.
#include "../../llmc/attention.cuh"
#include "attention_backward_v6.cuh"

extern "C" {

// 1 when tensors are bf16 (the default build), 0 for an fp32 (-DENABLE_FP32) build.
int llmc_attention_is_bf16() { return sizeof(floatX) == 2 ? 1 : 0; }

// out, lse OVERWRITTEN from qkv.
void llmc_attention_forward(void* out, float* lse, const void* qkv, int B, int T, int H, int KV, int hd,
                            void* stream) {
    attention_forward(static_cast<floatX*>(out), lse, static_cast<const floatX*>(qkv), B, T, H, KV, hd,
                      static_cast<cudaStream_t>(stream));
}

// dqkv OVERWRITTEN; delta is (B, H, T) fp32 scratch.
void llmc_attention_backward(void* dqkv, float* delta, const void* dout, const void* qkv, const void* out,
                             const float* lse, int B, int T, int H, int KV, int hd, void* stream) {
    attention_backward(static_cast<floatX*>(dqkv), delta, static_cast<const floatX*>(dout),
                       static_cast<const floatX*>(qkv), static_cast<const floatX*>(out), lse, nullptr, B, T, H, KV, hd,
                       static_cast<cudaStream_t>(stream));
}

// attention_backward.cu's v6 (one-pass Hopper backward; where it does not apply, attention_backward), same contract
// as llmc_attention_backward. Its scratch is allocated on first use and kept (regrown when a call needs more).
void llmc_attention_backward_v6(void* dqkv, float* delta, const void* dout, const void* qkv, const void* out,
                                const float* lse, int B, int T, int H, int KV, int hd, void* stream) {
#if defined(ENABLE_FP32)
    llmc_attention_backward(dqkv, delta, dout, qkv, out, lse, B, T, H, KV, hd, stream);
#else
    static void* scratch = nullptr;
    static size_t capacity = 0;
    const size_t bytes = attention_backward_v6_scratch_bytes(B, T, H, hd);
    if (bytes > capacity) {
        if (scratch != nullptr) cudaCheck(cudaFree(scratch));  // cudaFree waits for the device: no kernel uses it
        cudaCheck(cudaMalloc(&scratch, bytes));
        capacity = bytes;
    }
    attention_backward_v6(static_cast<floatX*>(dqkv), delta, static_cast<const floatX*>(dout),
                          static_cast<const floatX*>(qkv), static_cast<const floatX*>(out), lse, B, T, H, KV, hd,
                          scratch, static_cast<cudaStream_t>(stream));
#endif
}

// The scalar CUDA-core path, same contracts.
void llmc_attention_forward_scalar(void* out, float* lse, const void* qkv, int B, int T, int H, int KV, int hd,
                                   void* stream) {
    attention_forward_scalar(static_cast<floatX*>(out), lse, static_cast<const floatX*>(qkv), B, T, H, KV, hd,
                             static_cast<cudaStream_t>(stream));
}
void llmc_attention_backward_scalar(void* dqkv, float* delta, const void* dout, const void* qkv, const void* out,
                                    const float* lse, int B, int T, int H, int KV, int hd, void* stream) {
    attention_backward_scalar(static_cast<floatX*>(dqkv), delta, static_cast<const floatX*>(dout),
                              static_cast<const floatX*>(qkv), static_cast<const floatX*>(out), lse, B, T, H, KV, hd,
                              static_cast<cudaStream_t>(stream));
}

}  // extern "C"

#if !defined(ATTENTION_LIB_NO_MAIN)
#include "common.h"

// Smoke test of the C ABI: the entry points against the scalar path on ragged GQA shapes per head dim. T = 2100
// makes 272 query tiles, 6100 768: more than an H100 or H200 has SMs, so the persistent kernels' CTAs take several
// work items, up to 6 (each Q buffer's barriers through 3 phases). An argument T runs that T only (2100 under
// compute-sanitizer).
int main(int argc, char** argv) {
    require_gpu(argv[0]);
    const int only_T = argc > 1 ? atoi(argv[1]) : 0;
    for (int T : {200, 2100, 6100}) {
        if (only_T != 0 && T != only_T) continue;
        for (int hd : {64, 128}) {
            const int B = 2, H = 8, KV = 2;
            const size_t n_qkv = (size_t)B * T * (H + 2 * KV) * hd, n_out = (size_t)B * T * H * hd;
            const size_t n_lse = (size_t)B * H * T;
            printf("B=%d T=%d H=%d KV=%d hd=%d\n", B, T, H, KV, hd);
            floatX* qkv = device_random<floatX>(n_qkv, 11, 2.0f);
            floatX* dout = device_random<floatX>(n_out, 12, 1.0f);
            DeviceBuffer<floatX> out(n_out), out_ref(n_out), dqkv(n_qkv), dqkv_v6(n_qkv), dqkv_ref(n_qkv);
            DeviceBuffer<float> lse(n_lse), lse_ref(n_lse), delta(n_lse);
            llmc_attention_forward(out.ptr, lse.ptr, qkv, B, T, H, KV, hd, nullptr);
            llmc_attention_forward_scalar(out_ref.ptr, lse_ref.ptr, qkv, B, T, H, KV, hd, nullptr);
            // Both backwards from the scalar forward's out and lse, so they differ only in the backward itself.
            llmc_attention_backward(dqkv.ptr, delta.ptr, dout, qkv, out_ref.ptr, lse_ref.ptr, B, T, H, KV, hd,
                                    nullptr);
            llmc_attention_backward_v6(dqkv_v6.ptr, delta.ptr, dout, qkv, out_ref.ptr, lse_ref.ptr, B, T, H, KV, hd,
                                       nullptr);
            llmc_attention_backward_scalar(dqkv_ref.ptr, delta.ptr, dout, qkv, out_ref.ptr, lse_ref.ptr, B, T, H,
                                           KV, hd, nullptr);
            cudaCheck(cudaDeviceSynchronize());
            validate("out vs scalar", host_from_device(out.ptr, n_out), host_from_device(out_ref.ptr, n_out));
            validate("lse vs scalar", host_from_device(lse.ptr, n_lse), host_from_device(lse_ref.ptr, n_lse));
            validate("dqkv vs scalar", host_from_device(dqkv.ptr, n_qkv), host_from_device(dqkv_ref.ptr, n_qkv));
            validate("dqkv v6 vs scalar", host_from_device(dqkv_v6.ptr, n_qkv),
                     host_from_device(dqkv_ref.ptr, n_qkv));
            cudaCheck(cudaFree(qkv));
            cudaCheck(cudaFree(dout));
        }
    }
    return finish(argv[0]);
}
#endif
