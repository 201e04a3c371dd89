// Causal GQA attention forward: validation against a CPU reference and timing.
//
//   qkv (B, T, (H + 2 KV) hd)  ->  out (B, T, H hd), lse (B, H, T) fp32
//   s_ij = q_i . k_j / sqrt(hd) for j <= i;  lse_i = log sum_j exp(s_ij);  out_i = sum_j exp(s_ij - lse_i) v_j
//
// The CPU reference accumulates in fp64 and materialises each score row (fine at the small T validated here).
//
// Versions (all in llmc/attention.cuh; causal TFLOP/s = 2 B H T^2 hd / time, H200, shapes of the timing table):
//   v1: attention_forward_scalar: flash-style tiled CUDA-core fp32 kernel, online softmax (any precision, hd 1..128).
//       Measured: 22-26 TFLOP/s on the three timing shapes.
//   v2: the tensor-core kernel attention_forward_tc (FlashAttention-2 style, mma.sync m16n8k16 bf16, ldmatrix,
//       cp.async double buffering) for hd 64 and 128 (bf16 build only; other head dims fall back to v1), 16 queries
//       per warp (MT 1: 64 per CTA), 64 keys per tile; Q fragments in registers. Registers 160 (hd 64) / 234 (hd 128).
//       Measured on an NVIDIA H200 (B, T, H, KV, hd):
//         (4, 2048, 32, 8, 64):  226 TFLOP/s
//         (2, 4096, 32, 8, 128): 253 TFLOP/s
//         (1, 8192, 32, 8, 128): 260 TFLOP/s
//   v3: attention_forward (what the trainer runs): the same kernel with 32 queries per warp (MT 2: two m16 tiles,
//       128 queries per CTA), so each K / V fragment loaded with ldmatrix feeds 4 mmas instead of 2; 64 keys per tile
//       for hd 64 (Q in registers, 251 registers), 32 for hd 128 (Q re-read from smem; 255 registers, 24 bytes
//       spilled). smem 54 / 68 KiB. Measured on an NVIDIA H200:
//         (4, 2048, 32, 8, 64):  250 TFLOP/s
//         (2, 4096, 32, 8, 128): 278 TFLOP/s
//         (1, 8192, 32, 8, 128): 288 TFLOP/s
//       Other tile configurations tried (./attention_forward sweep), same shapes: hd 64 MT 2 / 32 keys 217; hd 128
//       MT 2 / 64 keys (176 bytes spilled) 266, 275; hd 64 MT 1 / 128 keys 208; hd 128 MT 1 / 32 keys 226, 232.
// Side by side with PyTorch SDPA: attention_vs_pytorch.py.
//
// Build: nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a [-DENABLE_FP32] attention_forward.cu
// Run:   ./attention_forward [version]     (no argument: every version; the fp32 build has only v1)
//        ./attention_forward sweep         (bf16: other tile configurations, spot-validated and timed)
#include "common.h"

#include "../../llmc/attention.cuh"

// ---------------------------------------------------------------------------------------------------------------
// CPU reference

static void attention_forward_cpu(std::vector<float>& out, std::vector<float>& lse, const std::vector<float>& qkv,
                                  int B, int T, int H, int KV, int hd) {
    const size_t qkv_stride = (size_t)(H + 2 * KV) * hd, out_stride = (size_t)H * hd;
    const double scale = 1.0 / std::sqrt((double)hd);
    out.assign((size_t)B * T * out_stride, 0.0f);
    lse.assign((size_t)B * H * T, 0.0f);
    std::vector<double> s(T), o(hd);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            const int kvh = h / (H / KV);
            for (int i = 0; i < T; i++) {
                const float* q = &qkv[((size_t)b * T + i) * qkv_stride + (size_t)h * hd];
                double max_s = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    const float* k = &qkv[((size_t)b * T + j) * qkv_stride + (size_t)(H + kvh) * hd];
                    double dot = 0.0;
                    for (int d = 0; d < hd; d++) dot += (double)q[d] * k[d];
                    s[j] = dot * scale;
                    max_s = std::max(max_s, s[j]);
                }
                double sum = 0.0;
                for (int j = 0; j <= i; j++) sum += std::exp(s[j] - max_s);
                const double row_lse = max_s + std::log(sum);
                std::fill(o.begin(), o.end(), 0.0);
                for (int j = 0; j <= i; j++) {
                    const double p = std::exp(s[j] - row_lse);
                    const float* v = &qkv[((size_t)b * T + j) * qkv_stride + (size_t)(H + KV + kvh) * hd];
                    for (int d = 0; d < hd; d++) o[d] += p * v[d];
                }
                for (int d = 0; d < hd; d++) out[((size_t)b * T + i) * out_stride + (size_t)h * hd + d] = (float)o[d];
                lse[((size_t)b * H + h) * T + i] = (float)row_lse;
            }
        }
    }
}

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

static void attention_forward_gpu(int version, floatX* out, float* lse, const floatX* qkv, int B, int T, int H,
                                  int KV, int hd) {
    switch (version) {
        case 1: attention_forward_scalar(out, lse, qkv, B, T, H, KV, hd, 0); break;
#if !defined(ENABLE_FP32)
        case 2: forward_tc_config<1, 64, 1, 64>(out, lse, qkv, B, T, H, KV, hd); break;  // 16 queries per warp
        case 3: attention_forward(out, lse, qkv, B, T, H, KV, hd, 0); break;
        // Tuning candidates (./attention_forward sweep): not versions of their own.
        case 101: forward_tc_config<2, 32, 2, 64>(out, lse, qkv, B, T, H, KV, hd); break;
        case 102: forward_tc_config<1, 128, 1, 32>(out, lse, qkv, B, T, H, KV, hd); break;
#endif
        default: fprintf(stderr, "unknown version %d\n", version); exit(EXIT_FAILURE);
    }
}

struct Shape {
    int B, T, H, KV, hd;
};

#if defined(ENABLE_FP32)
static const int VERSIONS[] = {1};
#else
static const int VERSIONS[] = {1, 2, 3};
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
        for (int cfg : {101, 102}) {
            uint64_t seed = 7;
            for (int hd : {64, 128}) {
                validate_shape(cfg, {2, 257, 8, 2, hd}, seed++);
                validate_shape(cfg, {1, 1000, 4, 1, hd}, seed++);
            }
            time_shape(cfg, {4, 2048, 32, 8, 64});
            time_shape(cfg, {2, 4096, 32, 8, 128});
            time_shape(cfg, {1, 8192, 32, 8, 128});
        }
        return finish(argv[0]);
    }
    if (argc > 1) versions = {atoi(argv[1])};
    for (int version : versions) {
        bool known = false;
        for (int v : VERSIONS) known |= v == version;
        if (!known) {
            fprintf(stderr, "unknown version %d (this %s build has versions 1..%d)\n", version, PRECISION_NAME,
                    (int)(sizeof(VERSIONS) / sizeof(VERSIONS[0])));
            return 1;
        }
    }

    for (int version : versions) {
        printf("attention_forward version %d (%s): validation\n", version, PRECISION_NAME);
        // T not a multiple of the tiles (64 queries; 32 or 64 keys), group sizes 1, 4, 8, head dims 16, 64, 128.
        uint64_t seed = 42;
        for (int T : {13, 100, 257}) {
            for (int KV : {8, 2, 1}) {
                for (int hd : {16, 64, 128}) validate_shape(version, {2, T, 8, KV, hd}, seed++);
            }
        }
        // Edges: a single token, an exact tile, one past it, a head dim that is neither 64 nor 128, a tiny head dim.
        validate_shape(version, {2, 1, 4, 2, 64}, seed++);
        validate_shape(version, {2, 64, 4, 1, 32}, seed++);
        validate_shape(version, {2, 65, 4, 4, 100}, seed++);
        validate_shape(version, {1, 130, 2, 1, 8}, seed++);
        // Many tiles per row (the pipeline's steady state), ragged ends, the tensor-core head dims.
        validate_shape(version, {2, 64, 4, 1, 128}, seed++);
        validate_shape(version, {1, 1000, 4, 1, 128}, seed++);
        validate_shape(version, {1, 703, 8, 2, 64}, seed++);
    }

    printf("timing (causal TFLOP/s = 2 B H T^2 hd / time)\n");
    for (int version : versions) {
        time_shape(version, {4, 2048, 32, 8, 64});
        time_shape(version, {2, 4096, 32, 8, 128});
        time_shape(version, {1, 8192, 32, 8, 128});
    }
    return finish(argv[0]);
}
