// CPU reference of causal grouped-query attention's forward, in fp64, shared by attention_forward.cu and
// attention_backward.cu (which needs the forward's out and lse as inputs). Layouts as in llmc/attention.cuh:
// qkv (B, T, (H + 2 KV) hd), out (B, T, H hd), lse (B, H, T); query head h uses kv head h / (H / KV).
#pragma once

#include <algorithm>
#include <cmath>
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
