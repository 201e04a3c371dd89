// A C ABI over llmc/attention.cuh for attention_vs_pytorch.py, which loads it with ctypes. Raw device pointers and
// sizes, llmc's layouts (bf16 in the default build), and the caller's CUDA stream (PyTorch's current stream), so the
// kernels order with PyTorch's own work and CUDA events time them like any PyTorch op:
//   qkv, dqkv (B, T, (H + 2 KV) hd)   out, dout (B, T, H hd)   lse, delta (B, H, T) fp32
// The functions are the trainer's entry points (attention_forward / attention_backward, which pick the path as
// llmc/attention.cuh describes), the scalar path for comparison, and the backward under evaluation:
// attention_backward.cu's v6 (attention_backward_v6.cuh, the one-pass backward).
//
// The script builds the library itself:
//   nvcc -O3 -std=c++17 --use_fast_math -shared -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a
//        -o <dir>/libllmc_attention.so attention_lib.cu
// (--use_fast_math as in the trainer's build, so what is timed is what trains.) The dev/cuda Makefile builds it too
// (bin/libllmc_attention.so), so that it keeps compiling. The kernels behind it are checked by attention_forward.cu
// and attention_backward.cu (v6, v10), the persistent kernels with several work items per CTA included.
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
