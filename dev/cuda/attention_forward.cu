// Causal GQA attention forward: validation against a CPU reference and timing.
//
//   qkv (B, T, (H + 2 KV) hd)  ->  out (B, T, H hd), lse (B, H, T) fp32
//   s_ij = q_i . k_j / sqrt(hd) for j <= i;  lse_i = log sum_j exp(s_ij);  out_i = sum_j exp(s_ij - lse_i) v_j
//
// The CPU reference accumulates in fp64 and materialises each score row (fine at the small T validated here).
//
// Versions (v1-v3 in llmc/attention.cuh, v4 in llmc/attention_hopper.cuh; causal TFLOP/s = 2 B H T^2 hd / time,
// H200, shapes of the timing table):
//   v1: attention_forward_scalar: flash-style tiled CUDA-core fp32 kernel, online softmax (any precision, hd 1..128).
//       Measured: 22-26 TFLOP/s on the three timing shapes.
//   v2: the tensor-core kernel attention_forward_tc (FlashAttention-2 style, mma.sync m16n8k16 bf16, ldmatrix,
//       cp.async double buffering) for hd 64 and 128 (bf16 build only; other head dims fall back to v1), 16 queries
//       per warp (MT 1: 64 per CTA), 64 keys per tile; Q fragments in registers. Registers 160 (hd 64) / 234 (hd 128).
//       Measured on an NVIDIA H200 (B, T, H, KV, hd):
//         (4, 2048, 32, 8, 64):  226 TFLOP/s
//         (2, 4096, 32, 8, 128): 253 TFLOP/s
//         (1, 8192, 32, 8, 128): 260 TFLOP/s
//   v3: attention_forward_tc (what the trainer runs for hd 64, and for hd 128 off Hopper): the same kernel with 32
//       queries per warp (MT 2: two m16 tiles, 128 queries per CTA), so each K / V fragment loaded with ldmatrix feeds
//       4 mmas instead of 2; 64 keys per tile for hd 64 (Q in registers, 251 registers), 32 for hd 128 (Q re-read from
//       smem; 255 registers, 24 bytes spilled). smem 54 / 68 KiB. Measured on an NVIDIA H200:
//         (4, 2048, 32, 8, 64):  250 TFLOP/s
//         (2, 4096, 32, 8, 128): 278 TFLOP/s
//         (1, 8192, 32, 8, 128): 288 TFLOP/s
//       Other tile configurations tried (./attention_forward sweep), same shapes: hd 64 MT 2 / 32 keys 217; hd 128
//       MT 2 / 64 keys (176 bytes spilled) 266, 275; hd 64 MT 1 / 128 keys 208; hd 128 MT 1 / 32 keys 226, 232.
//   v4: attention_forward (what the trainer runs): attention_forward_hopper (llmc/attention_hopper.cuh; bf16 build,
//       sm_90a, hd 128) with the fallback to v3 / v1 for other head dims and devices: Hopper wgmma. CTA = 128 queries =
//       2 consumer warpgroups of 64 rows sharing K / V tiles of 128 keys in 128-byte-swizzled smem (cp.async, 3
//       stages); S = Q K^T as wgmma m64n128k16 with Q and K from smem descriptors, P V as wgmma m64nHDk16 with P from
//       registers; online softmax on the accumulator fragment; the two warpgroups take turns issuing (named barriers),
//       so one's softmax overlaps the other's matmuls. Registers 243 (hd 128), 166 (hd 64), no spills; smem 225 KiB (hd
//       128): one CTA per SM. NVIDIA H200:
//         (4, 2048, 32, 8, 64):  251 TFLOP/s   (v3: 253; wgmma at hd 64 is now sweep 103: v4 runs v3 there)
//         (2, 4096, 32, 8, 128): 417 TFLOP/s   (v3: 280; cuDNN via PyTorch SDPA: ~540)
//         (1, 8192, 32, 8, 128): 443 TFLOP/s   (v3: 288; cuDNN: ~556)
//       Steps measured (hd 64 / 4096 / 8192 shapes): plain (2 stages, __syncthreads twice a tile, each warpgroup
//       S -> wait -> softmax -> P V -> wait): 245 / 382 / 403; + S and P V split into 2 halves of 64 keys (each
//       half's softmax overlaps the other half's matmul): 247 / 389 / 411; ping-pong + 3 stages without the split:
//       241 / 418 / 444 (hd 128's choice); with the split: 249 / 394 / 417. For hd 64 the best wgmma variant (split +
//       ping-pong, sweep 103) is no faster than v3, so llmc keeps v3 there; the sweep variants (103-106) call
//       llmc's attention_forward_hopper_cfg with other template arguments (and hd 64).
//       What limits it: the loads are issued by the consumer threads themselves (16 cp.async per thread per tile
//       plus the address math, and a CTA-wide __syncthreads per tile), and a warpgroup's own S and P V never overlap
//       its softmax; hd 64 has too little matmul per tile to hide the softmax at all. Next steps (FA3): a producer
//       warp loading with TMA (cp.async.bulk.tensor, CUtensorMap, mbarrier full / empty per stage) instead of
//       cp.async + __syncthreads, setmaxnreg to move registers from the producer to the consumers (240 each), then
//       intra-warpgroup pipelining (issue S of tile j+1 before the softmax of tile j, which needs the registers
//       setmaxnreg frees); and skipping the masked half of warpgroup 0's diagonal tile.
// Side by side with PyTorch SDPA: attention_vs_pytorch.py.
//
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a [-DENABLE_FP32] attention_forward.cu
// Run:   ./attention_forward [version]     (no argument: every version; the fp32 build has only v1)
//        ./attention_forward sweep         (bf16: other tile configurations and v4 variants, spot-validated and timed)
// Version 4 needs a compute capability 9.0 GPU and the sm_90a build; elsewhere it runs v3's kernels (a note says so).
#include "common.h"

#include "../../llmc/attention.cuh"
#include "attention_reference.h"

// ---------------------------------------------------------------------------------------------------------------
// CPU reference: attention_forward_cpu in attention_reference.h

// ---------------------------------------------------------------------------------------------------------------
// GPU versions

// Tensor-core tile configurations as version entries: <MT, BN> for hd 64 and for hd 128; other head dims take the
// scalar path, as attention_forward does.
template <int MT64, int BN64, int MT128, int BN128>
static void forward_tc_config(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd) {
#if !defined(ENABLE_FP32)
    if (hd == 64) return attention_forward_tc_cfg<64, MT64, BN64>(out, lse, qkv, B, T, H, KV, 0);
    if (hd == 128) return attention_forward_tc_cfg<128, MT128, BN128>(out, lse, qkv, B, T, H, KV, 0);
#endif
    attention_forward_scalar(out, lse, qkv, B, T, H, KV, hd, 0);
}

// v4 variants as sweep entries: <NH, PP> for hd 64 and for hd 128 (llmc's kernel with other template arguments);
// other head dims, devices without sm_90a code, or misaligned tensors fall back as attention_forward does.
template <int NH64, bool PP64, int NH128, bool PP128>
static void forward_hopper_config(floatX* out, float* lse, const floatX* qkv, int B, int T, int H, int KV, int hd) {
#if !defined(ENABLE_FP32)
    const bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(qkv) % 16 == 0;
    if ((hd == 64 || hd == 128) && aligned && attention_hopper_usable()) {
        attention_check_args("forward_hopper_config", B, T, H, KV, hd);
        if (hd == 64) return attention_forward_hopper_cfg<64, NH64, PP64>(out, lse, qkv, B, T, H, KV, 0);
        return attention_forward_hopper_cfg<128, NH128, PP128>(out, lse, qkv, B, T, H, KV, 0);
    }
#endif
    attention_forward(out, lse, qkv, B, T, H, KV, hd, 0);
}

static void attention_forward_gpu(int version, floatX* out, float* lse, const floatX* qkv, int B, int T, int H,
                                  int KV, int hd) {
    switch (version) {
        case 1: attention_forward_scalar(out, lse, qkv, B, T, H, KV, hd, 0); break;
#if !defined(ENABLE_FP32)
        case 2: forward_tc_config<1, 64, 1, 64>(out, lse, qkv, B, T, H, KV, hd); break;  // 16 queries per warp
        case 3:  // attention_forward_tc's choices
            forward_tc_config<ATC_FWD_MT_64, ATC_FWD_BN_64, ATC_FWD_MT_128, ATC_FWD_BN_128>(out, lse, qkv, B, T, H, KV,
                                                                                            hd);
            break;
        case 4: attention_forward(out, lse, qkv, B, T, H, KV, hd, 0); break;  // Hopper hd 128, else as v3
        // Tuning candidates (./attention_forward sweep): not versions of their own.
        case 101: forward_tc_config<2, 32, 2, 64>(out, lse, qkv, B, T, H, KV, hd); break;
        case 102: forward_tc_config<1, 128, 1, 32>(out, lse, qkv, B, T, H, KV, hd); break;
        // v4 variants <NH, PP for hd 64; NH, PP for hd 128>: v4 with wgmma also for hd 64 (split + ping-pong, the
        // best there); no split, no ping-pong; split only; the other split.
        case 103: forward_hopper_config<2, true, 1, true>(out, lse, qkv, B, T, H, KV, hd); break;
        case 104: forward_hopper_config<1, false, 1, false>(out, lse, qkv, B, T, H, KV, hd); break;
        case 105: forward_hopper_config<2, false, 2, false>(out, lse, qkv, B, T, H, KV, hd); break;
        case 106: forward_hopper_config<1, true, 2, true>(out, lse, qkv, B, T, H, KV, hd); break;
#endif
        default: fprintf(stderr, "unknown version %d\n", version); exit(EXIT_FAILURE);
    }
}

#if defined(ENABLE_FP32)
static const int VERSIONS[] = {1};
#else
static const int VERSIONS[] = {1, 2, 3, 4};
#endif

static void validate_shape(int version, const Shape& sh, uint64_t seed) {
    const size_t n_qkv = (size_t)sh.B * sh.T * (sh.H + 2 * sh.KV) * sh.hd;
    const size_t n_out = (size_t)sh.B * sh.T * sh.H * sh.hd, n_lse = (size_t)sh.B * sh.H * sh.T;
    printf("v%d B=%d T=%d H=%d KV=%d hd=%d\n", version, sh.B, sh.T, sh.H, sh.KV, sh.hd);
    // Scale 1.5 makes the softmax peakier than scale 1 would, exercising the running-max rescaling.
    std::vector<float> qkv = round_to_floatX(random_floats(n_qkv, seed, 1.5f));
    std::vector<float> out_ref, lse_ref;
    attention_forward_cpu(out_ref, lse_ref, qkv, sh.B, sh.T, sh.H, sh.KV, sh.hd);

    floatX* d_qkv = device_from_host<floatX>(qkv);
    floatX* d_out;
    float* d_lse;
    cudaCheck(cudaMalloc(&d_out, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_lse, n_lse * sizeof(float)));
    poison(d_out, n_out * sizeof(floatX));
    poison(d_lse, n_lse * sizeof(float));
    attention_forward_gpu(version, d_out, d_lse, d_qkv, sh.B, sh.T, sh.H, sh.KV, sh.hd);
    cudaCheck(cudaDeviceSynchronize());
    validate("out", host_from_device(d_out, n_out), out_ref);
    validate("lse", host_from_device(d_lse, n_lse), lse_ref);
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_lse));
}

static void time_shape(int version, const Shape& sh) {
    const size_t n_qkv = (size_t)sh.B * sh.T * (sh.H + 2 * sh.KV) * sh.hd;
    const size_t n_out = (size_t)sh.B * sh.T * sh.H * sh.hd, n_lse = (size_t)sh.B * sh.H * sh.T;
    floatX* d_qkv = device_random<floatX>(n_qkv, 1234, 2.0f);  // uniform [-2, 2): about unit variance
    floatX* d_out;
    float* d_lse;
    cudaCheck(cudaMalloc(&d_out, n_out * sizeof(floatX)));
    cudaCheck(cudaMalloc(&d_lse, n_lse * sizeof(float)));
    float ms = benchmark_ms(10, [&] {
        attention_forward_gpu(version, d_out, d_lse, d_qkv, sh.B, sh.T, sh.H, sh.KV, sh.hd);
    });
    // Causal: half of the 2 matmuls (QK^T, PV) of 2 B H T^2 hd flops each.
    const double flops = 2.0 * sh.B * sh.H * (double)sh.T * sh.T * sh.hd;
    printf("  v%d  B=%d H=%d KV=%d T=%d hd=%d: %8.3f ms  %7.2f TFLOP/s\n", version, sh.B, sh.H, sh.KV, sh.T, sh.hd,
           ms, flops / (ms * 1e-3) / 1e12);
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_lse));
}

int main(int argc, char** argv) {
    require_gpu(argv[0]);  // clear message and exit 1 without a GPU
    std::vector<int> versions(std::begin(VERSIONS), std::end(VERSIONS));
    if (argc > 1 && strcmp(argv[1], "sweep") == 0) {  // tile configurations: spot validation, then timing
        for (int cfg : {101, 102, 103, 104, 105, 106}) {
            uint64_t seed = 7;
            for (const Shape& sh : ATTENTION_SWEEP_SHAPES) validate_shape(cfg, sh, seed++);
            for (const Shape& sh : ATTENTION_TIMING_SHAPES) time_shape(cfg, sh);
        }
        return finish(argv[0]);
    }
    if (argc > 1) versions = {atoi(argv[1])};
    if (!attention_versions_known(versions, std::vector<int>(std::begin(VERSIONS), std::end(VERSIONS)),
                                  PRECISION_NAME)) {
        return 1;
    }

    for (int version : versions) {
        printf("attention_forward version %d (%s): validation\n", version, PRECISION_NAME);
#if !defined(ENABLE_FP32)
        if (version == 4 && !attention_hopper_usable()) {
            printf("  note: no sm_90 device or no sm_90a code in this build: v4 runs v3's kernels\n");
        }
#endif
        // T not a multiple of the tiles (64 queries; 32 or 64 keys), group sizes 1, 4, 8, head dims 16, 64, 128.
        uint64_t seed = 42;
        for (const Shape& sh : attention_validation_shapes()) validate_shape(version, sh, seed++);
    }

    printf("timing (causal TFLOP/s = 2 B H T^2 hd / time)\n");
    for (int version : versions) {
        for (const Shape& sh : ATTENTION_TIMING_SHAPES) time_shape(version, sh);
    }
    return finish(argv[0]);
}
