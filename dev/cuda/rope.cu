// RoPE forward and backward, in place on the packed qkv buffer (B, T, (H + 2 KV) hd), validated against a CPU
// reference in double and timed.
//
//   forward:  (x0, x1) -> (x0 c - x1 s, x0 s + x1 c) on pairs (2i, 2i+1) of q and k heads, c/s at position t
//   backward: (g0, g1) -> (g0 c + g1 s, -g0 s + g1 c)         (value heads untouched by both)
//
// version 1: rope_launch_pairs, one thread per pair (a 4-byte bf16x2 access), 64-bit index math.
// version 2: rope_forward / rope_backward = llmc/rope.cuh as the trainer runs it: one thread per 16-byte chunk
//            (int4 of q/k, float4 of {cos, sin}), 32-bit index math, whenever hd % (16 / sizeof(floatX)) == 0;
//            the pair kernel otherwise (hd 6 and 2 here). Same fp32 math, so bit-identical to version 1 (checked).
//   measured on an NVIDIA H200 (B=8 T=2048 H=32 KV=8 hd=64, bf16): v1 0.114 ms (1477 GB/s forward, 1483 backward),
//   v2 0.046 / 0.047 ms (3636 / 3562 GB/s): 2.5x, near the HBM bandwidth.
//
// The table comes from model.h's rope_tables (with and without Llama 3.1 scaling), interleaved by
// rope_interleave_tables, exactly as the trainer builds it. T = 13 and B = 3 make n % T wrap at odd places; the table
// is built for more positions than T to check the documented "longer table works" property.
//
// build: make -C dev/cuda bin/rope   run: dev/cuda/bin/rope
#include "common.h"
#include "../../llmc/model.h"
#include "../../llmc/rope.cuh"

static const int N_VERSIONS = 2;

// direction +1: forward, -1: backward.
static void rope_version(int version, floatX* qkv, const float* d_table, int B, int T, int H, int KV, int hd,
                         int direction) {
    if (version == 1) {
        rope_launch_pairs(qkv, d_table, B, T, H, KV, hd, (float)direction, 0);
    } else if (direction > 0) {
        rope_forward(qkv, d_table, B, T, H, KV, hd, 0);
    } else {
        rope_backward(qkv, d_table, B, T, H, KV, hd, 0);
    }
}

// Which kernel a version runs at this shape, for the log.
static const char* kernel_name(int version, const floatX* qkv, const float* d_table, int B, int T, int H, int KV,
                               int hd) {
    return version == 2 && rope_chunks_apply(qkv, d_table, B, T, H, KV, hd) ? "chunk kernel" : "pair kernel";
}

// The trainer's table setup for a small test config: rope_tables on the host, interleaved, copied to the device.
static float* device_table(int H, int KV, int hd, bool scaling, int T_table, std::vector<float>* cos_t,
                           std::vector<float>* sin_t) {
    Llama3Config cfg;
    cfg.dim = H * hd;
    cfg.n_heads = H;
    cfg.n_kv_heads = KV;
    cfg.rope_theta = 500000.0f;
    cfg.use_rope_scaling = scaling;
    cfg.rope_scaling_factor = 32.0f;
    cfg.rope_original_max_seq_len = 8;  // small, so the scaled / interpolated bands all occur at small hd
    rope_tables(cfg, T_table, cos_t, sin_t);
    std::vector<float> table = rope_interleave_tables(*cos_t, *sin_t);
    float* d_table;
    cudaCheck(cudaMalloc(&d_table, table.size() * sizeof(float)));
    cudaCheck(cudaMemcpy(d_table, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
    return d_table;
}

static void test_case(int B, int T, int H, int KV, int hd, bool scaling, uint64_t seed) {
    printf("B=%d T=%d H=%d KV=%d hd=%d rope_scaling=%d\n", B, T, H, KV, hd, (int)scaling);
    std::vector<float> cos_t, sin_t;
    float* d_table = device_table(H, KV, hd, scaling, T + 5, &cos_t, &sin_t);

    size_t n = (size_t)B * T * (H + 2 * KV) * hd;
    int row = (H + 2 * KV) * hd;
    std::vector<float> x = round_to_floatX(random_floats(n, seed));
    std::vector<float> ref = x;
    cpu::rope(ref.data(), cos_t, sin_t, B, T, H, KV, hd, false);
    std::vector<float> g = round_to_floatX(random_floats(n, seed + 1));
    std::vector<float> gref = g;
    cpu::rope(gref.data(), cos_t, sin_t, B, T, H, KV, hd, true);

    for (int version = 1; version <= N_VERSIONS; version++) {
        floatX* d_qkv = device_from_host<floatX>(x);
        printf(" version %d (%s)\n", version, kernel_name(version, d_qkv, d_table, B, T, H, KV, hd));
        rope_version(version, d_qkv, d_table, B, T, H, KV, hd, +1);
        cudaCheck(cudaDeviceSynchronize());
        std::vector<float> got = host_from_device(d_qkv, n);
        validate("forward", got, ref);
        // value heads must come back bit-identical
        std::vector<float> v_got, v_ref;
        for (int r = 0; r < B * T; r++)
            for (int j = (H + KV) * hd; j < row; j++) {
                v_got.push_back(got[(size_t)r * row + j]);
                v_ref.push_back(x[(size_t)r * row + j]);
            }
        validate("forward leaves v untouched", v_got, v_ref, 0.0);

        // backward on a fresh gradient; the reference is the transposed rotation
        floatX* d_g = device_from_host<floatX>(g);
        rope_version(version, d_g, d_table, B, T, H, KV, hd, -1);
        cudaCheck(cudaDeviceSynchronize());
        validate("backward", host_from_device(d_g, n), gref);

        // backward undoes forward (up to the storage rounding in between)
        rope_version(version, d_qkv, d_table, B, T, H, KV, hd, -1);
        cudaCheck(cudaDeviceSynchronize());
        validate("backward(forward(x)) == x", host_from_device(d_qkv, n), x);

        cudaCheck(cudaFree(d_qkv));
        cudaCheck(cudaFree(d_g));
    }
    cudaCheck(cudaFree(d_table));
}

// Version 2 must reproduce version 1 bit for bit (same fp32 math, one rounding per element), forward and backward.
static void bitwise_case(int B, int T, int H, int KV, int hd, uint64_t seed) {
    std::vector<float> cos_t, sin_t;
    float* d_table = device_table(H, KV, hd, true, T, &cos_t, &sin_t);
    size_t n = (size_t)B * T * (H + 2 * KV) * hd;
    std::vector<float> x = round_to_floatX(random_floats(n, seed));
    floatX* d_v1 = device_from_host<floatX>(x);
    floatX* d_v2 = device_from_host<floatX>(x);
    printf("B=%d T=%d H=%d KV=%d hd=%d: version 2 (%s) vs version 1\n", B, T, H, KV, hd,
           kernel_name(2, d_v2, d_table, B, T, H, KV, hd));
    rope_version(1, d_v1, d_table, B, T, H, KV, hd, +1);
    rope_version(2, d_v2, d_table, B, T, H, KV, hd, +1);
    cudaCheck(cudaDeviceSynchronize());
    validate_bitwise("forward v2 == v1", d_v1, d_v2, n);
    rope_version(1, d_v1, d_table, B, T, H, KV, hd, -1);
    rope_version(2, d_v2, d_table, B, T, H, KV, hd, -1);
    cudaCheck(cudaDeviceSynchronize());
    validate_bitwise("backward v2 == v1", d_v1, d_v2, n);
    cudaCheck(cudaFree(d_table));
    cudaCheck(cudaFree(d_v1));
    cudaCheck(cudaFree(d_v2));
}

int main(int argc, char** argv) {
    (void)argc;
    require_gpu(argv[0]);
    test_case(3, 13, 4, 2, 16, false, 1);
    test_case(3, 13, 4, 2, 16, true, 2);
    test_case(2, 13, 6, 3, 6, false, 3);   // hd/2 odd
    test_case(2, 37, 8, 8, 64, true, 4);   // no GQA
    test_case(1, 1, 1, 1, 2, false, 5);    // smallest
    bitwise_case(2, 100, 8, 2, 64, 6);
    bitwise_case(2, 100, 8, 2, 128, 7);

    // timing: Llama 3.2 1B attention (H=32, KV=8, hd=64) at B=8, T=2048
    int B = 8, T = 2048, H = 32, KV = 8, hd = 64;
    printf("timing B=%d T=%d H=%d KV=%d hd=%d\n", B, T, H, KV, hd);
    Llama3Config cfg;
    config_from_name("llama3.2-1B", 0, &cfg);
    std::vector<float> cos_t, sin_t;
    rope_tables(cfg, T, &cos_t, &sin_t);
    std::vector<float> table = rope_interleave_tables(cos_t, sin_t);
    float* d_table;
    cudaCheck(cudaMalloc(&d_table, table.size() * sizeof(float)));
    cudaCheck(cudaMemcpy(d_table, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
    size_t n = (size_t)B * T * (H + 2 * KV) * hd;
    floatX* d_qkv = device_random<floatX>(n, 9);
    // q and k are read and written once; the 0.5 MB table stays in L2
    double bytes = 2.0 * B * T * (H + KV) * hd * sizeof(floatX);
    for (int version = 1; version <= N_VERSIONS; version++) {
        printf(" version %d (%s)\n", version, kernel_name(version, d_qkv, d_table, B, T, H, KV, hd));
        float ms = benchmark_ms(20, [&] { rope_version(version, d_qkv, d_table, B, T, H, KV, hd, +1); });
        report_bandwidth("forward", ms, bytes);
        ms = benchmark_ms(20, [&] { rope_version(version, d_qkv, d_table, B, T, H, KV, hd, -1); });
        report_bandwidth("backward", ms, bytes);
    }
    cudaCheck(cudaFree(d_table));
    cudaCheck(cudaFree(d_qkv));
    return finish(argv[0]);
}
