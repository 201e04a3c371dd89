// CPU reference of causal grouped-query attention's forward, in fp64, shared by attention_forward.cu and
// attention_backward.cu (which needs the forward's out and lse as inputs), and the shapes both validate and time.
// Layouts as in llmc/attention.cuh: qkv (B, T, (H + 2 KV) hd), out (B, T, H hd), lse (B, H, T); query head h uses kv
// head h / (H / KV).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

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

struct Shape {
    int B, T, H, KV, hd;
};

// Every version is validated on these: T not a multiple of any tile, group sizes 1, 4, 8, head dims 16, 64, 128;
// edges (a single token, an exact tile, one past it, head dims that are neither 64 nor 128, a tiny one); and long
// rows and key ranges (the pipelines' steady state, ragged ends) at the tensor-core head dims.
static std::vector<Shape> attention_validation_shapes() {
    std::vector<Shape> shapes;
    for (int T : {13, 100, 257}) {
        for (int KV : {8, 2, 1}) {
            for (int hd : {16, 64, 128}) shapes.push_back({2, T, 8, KV, hd});
        }
    }
    for (Shape sh : {Shape{2, 1, 4, 2, 64}, Shape{2, 64, 4, 1, 32}, Shape{2, 65, 4, 4, 100}, Shape{1, 130, 2, 1, 8},
                     Shape{2, 64, 4, 1, 128}, Shape{1, 1000, 4, 1, 128}, Shape{1, 703, 8, 2, 64}}) {
        shapes.push_back(sh);
    }
    return shapes;
}

// The sweep's spot validation of a tile configuration (both tensor-core head dims, ragged, grouped).
static const Shape ATTENTION_SWEEP_SHAPES[] = {{2, 257, 8, 2, 64}, {1, 1000, 4, 1, 64}, {2, 257, 8, 2, 128},
                                              {1, 1000, 4, 1, 128}};
// The timing shapes (B, T, H, KV, hd): the three.
static const Shape ATTENTION_TIMING_SHAPES[] = {{4, 2048, 32, 8, 64}, {2, 4096, 32, 8, 128}, {1, 8192, 32, 8, 128}};

// Whether every requested version exists in this build; prints which one does not.
static bool attention_versions_known(const std::vector<int>& requested, const std::vector<int>& known,
                                     const char* precision) {
    for (int version : requested) {
        if (std::find(known.begin(), known.end(), version) == known.end()) {
            fprintf(stderr, "unknown version %d (this %s build has versions 1..%d)\n", version, precision,
                    (int)known.size());
            return false;
        }
    }
    return true;
}
