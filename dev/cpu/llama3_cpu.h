// The CPU reference: Llama 3 forward, cross-entropy loss, backward, gradient clipping and AdamW in plain C++, fp32
// in and out, sums and elementwise math in double. It is the readable spec of the math that the CUDA kernels
// implement and the one oracle they are checked against: the model ties out with scripts/train_llama3.py (see
// dev/cpu/test_llama3_cpu.cpp), and each dev/cuda/<kernel>.cu checks its kernel against the layer functions below,
// called with its own shapes.
//
// Layouts (row-major; B batch, T time, C dim, H query heads, KV kv heads, hd head dim, F ffn hidden, V vocab):
//   residual stream (B*T, C); qkv (B*T, (H + 2 KV) hd) with query heads, then key heads, then value heads;
//   attention output (B*T, H hd); w13 output (B*T, 2F) = [gate | up]; logits (B*T, V).
// Parameters are one flat fp32 buffer in ParamTensor order (llmc/model.h), gradients the same shape.
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "../../llmc/model.h"

namespace cpu {

// ---------------------------------------------------------------------------------------------------------------
// Layers. "+=" in a comment marks an output that is accumulated into; all others are overwritten.

// out (N, OC) = inp (N, C) @ weight (OC, C)^T
inline void matmul_forward(float* out, const float* inp, const float* weight, int N, int C, int OC) {
#pragma omp parallel for collapse(2)
    for (int n = 0; n < N; n++) {
        for (int o = 0; o < OC; o++) {
            double sum = 0.0;
            for (int c = 0; c < C; c++) sum += (double)inp[(size_t)n * C + c] * weight[(size_t)o * C + c];
            out[(size_t)n * OC + o] = (float)sum;
        }
    }
}

// dinp (N, C) = dout (N, OC) @ weight (OC, C)
inline void matmul_backward_input(float* dinp, const float* dout, const float* weight, int N, int C, int OC) {
#pragma omp parallel for collapse(2)
    for (int n = 0; n < N; n++) {
        for (int c = 0; c < C; c++) {
            double sum = 0.0;
            for (int o = 0; o < OC; o++) sum += (double)dout[(size_t)n * OC + o] * weight[(size_t)o * C + c];
            dinp[(size_t)n * C + c] = (float)sum;
        }
    }
}

// dweight (OC, C) += dout (N, OC)^T @ inp (N, C)
inline void matmul_backward_weight(float* dweight, const float* dout, const float* inp, int N, int C, int OC) {
#pragma omp parallel for collapse(2)
    for (int o = 0; o < OC; o++) {
        for (int c = 0; c < C; c++) {
            double sum = 0.0;
            for (int n = 0; n < N; n++) sum += (double)dout[(size_t)n * OC + o] * inp[(size_t)n * C + c];
            dweight[(size_t)o * C + c] += (float)sum;
        }
    }
}

// dinp (N, C) = dout @ weight;  dweight (OC, C) += dout^T @ inp
inline void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                            int N, int C, int OC) {
    matmul_backward_input(dinp, dout, weight, N, C, OC);
    matmul_backward_weight(dweight, dout, inp, N, C, OC);
}

// out (N, C) = rows tokens[n] of emb (V, C)
inline void encoder_forward(float* out, const int* tokens, const float* emb, int N, int C) {
    for (int n = 0; n < N; n++) std::copy_n(emb + (size_t)tokens[n] * C, C, out + (size_t)n * C);
}

// demb (V, C) += for each row n, dout[n] into row tokens[n]; each token's rows summed in double, in row order, and
// added with one rounding
inline void encoder_backward(float* demb, const int* tokens, const float* dout, int N, int C) {
    std::vector<int> order(N);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return tokens[a] < tokens[b]; });
    std::vector<double> acc(C);
    for (int i = 0; i < N;) {
        int token = tokens[order[i]];
        std::fill(acc.begin(), acc.end(), 0.0);
        for (; i < N && tokens[order[i]] == token; i++)
            for (int c = 0; c < C; c++) acc[c] += dout[(size_t)order[i] * C + c];
        float* row = demb + (size_t)token * C;
        for (int c = 0; c < C; c++) row[c] = (float)(row[c] + acc[c]);
    }
}

// out = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps), per row
inline void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C, float eps) {
    for (int n = 0; n < N; n++) {
        const float* x = inp + (size_t)n * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)x[c] * x[c];
        double r = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = (float)(x[c] * r * weight[c]);
        rstd[n] = (float)r;
    }
}

// dinp += rstd * (dxhat - xhat * mean(dxhat * xhat)) with xhat = x * rstd, dxhat = dout * weight;
// dweight += sum over rows of dout * xhat (summed in double, added with one rounding)
inline void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const float* rstd, int N, int C) {
    std::vector<double> dweight_sum(C, 0.0);
    for (int n = 0; n < N; n++) {
        const float* x = inp + (size_t)n * C;
        const float* dy = dout + (size_t)n * C;
        double r = rstd[n], dot = 0.0;
        for (int c = 0; c < C; c++) dot += (double)dy[c] * weight[c] * (x[c] * r);
        double mean_dot = dot / C;
        for (int c = 0; c < C; c++) {
            double xhat = x[c] * r;
            float* dx = dinp + (size_t)n * C + c;
            *dx = (float)(*dx + r * ((double)dy[c] * weight[c] - xhat * mean_dot));
            dweight_sum[c] += (double)dy[c] * xhat;
        }
    }
    for (int c = 0; c < C; c++) dweight[c] = (float)(dweight[c] + dweight_sum[c]);
}

// In place on the query and key heads of qkv: each interleaved pair (x0, x1) of a head at position t is rotated by
// angle t * inv_freq[i]. `inverse` applies the transposed rotation, which is the backward pass.
inline void rope(float* qkv, const std::vector<float>& cos_table, const std::vector<float>& sin_table, int B, int T,
                 int n_heads, int n_kv_heads, int head_dim, bool inverse) {
    int half = head_dim / 2, qkv_dim = (n_heads + 2 * n_kv_heads) * head_dim;
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float* row = qkv + ((size_t)b * T + t) * qkv_dim;
            for (int head = 0; head < n_heads + n_kv_heads; head++) {
                for (int i = 0; i < half; i++) {
                    double c = cos_table[(size_t)t * half + i];
                    double s = inverse ? -sin_table[(size_t)t * half + i] : sin_table[(size_t)t * half + i];
                    float* pair = row + head * head_dim + 2 * i;
                    double x0 = pair[0], x1 = pair[1];
                    pair[0] = (float)(x0 * c - x1 * s);
                    pair[1] = (float)(x0 * s + x1 * c);
                }
            }
        }
    }
}

// Causal grouped-query attention, the contract of llmc/attention.cuh: query head h attends with kv head
// h / (H / KV); out (B*T, H hd), lse (B, H, T) the log-sum-exp of each row of scaled scores (may be null). The softmax
// is never stored: the backward recomputes it, so memory stays O(T) per row as on the GPU.
inline void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int H, int KV, int hd) {
    const size_t qkv_dim = (size_t)(H + 2 * KV) * hd, out_dim = (size_t)H * hd;
    const double scale = 1.0 / sqrt((double)hd);
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            const int kv = h / (H / KV);
            std::vector<double> s(T), o(hd);
            for (int t = 0; t < T; t++) {
                const float* q = qkv + ((size_t)b * T + t) * qkv_dim + (size_t)h * hd;
                double max_s = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = qkv + ((size_t)b * T + t2) * qkv_dim + (size_t)(H + kv) * hd;
                    double dot = 0.0;
                    for (int i = 0; i < hd; i++) dot += (double)q[i] * k[i];
                    s[t2] = dot * scale;
                    max_s = std::max(max_s, s[t2]);
                }
                double sum = 0.0;
                for (int t2 = 0; t2 <= t; t2++) sum += exp(s[t2] - max_s);
                const double row_lse = max_s + log(sum);
                std::fill(o.begin(), o.end(), 0.0);
                for (int t2 = 0; t2 <= t; t2++) {
                    const double p = exp(s[t2] - row_lse);
                    const float* v = qkv + ((size_t)b * T + t2) * qkv_dim + (size_t)(H + KV + kv) * hd;
                    for (int i = 0; i < hd; i++) o[i] += p * v[i];
                }
                for (int i = 0; i < hd; i++) out[((size_t)b * T + t) * out_dim + (size_t)h * hd + i] = (float)o[i];
                if (lse) lse[((size_t)b * H + h) * T + t] = (float)row_lse;
            }
        }
    }
}

// dqkv (overwritten) from dout (B*T, H hd), the forward's qkv and out. Per row: P recomputed from q and k,
// D = dout . out, dS = P (dout . v - D); dq = scale dS k, dk = scale dS^T q, dv = P^T dout, with dK and dV summed over
// the query heads of each group. One thread per (b, kv head): it alone writes that group's dq, dk and dv.
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, int B, int T,
                               int H, int KV, int hd) {
    const size_t qkv_dim = (size_t)(H + 2 * KV) * hd, out_dim = (size_t)H * hd;
    const double scale = 1.0 / sqrt((double)hd);
    const int group = H / KV;
    std::vector<double> acc((size_t)B * T * qkv_dim, 0.0);
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int kv = 0; kv < KV; kv++) {
            std::vector<double> p(T), ds(T);
            auto k_at = [&](int t) { return qkv + ((size_t)b * T + t) * qkv_dim + (size_t)(H + kv) * hd; };
            auto v_at = [&](int t) { return qkv + ((size_t)b * T + t) * qkv_dim + (size_t)(H + KV + kv) * hd; };
            for (int h = kv * group; h < (kv + 1) * group; h++) {
                for (int t = 0; t < T; t++) {
                    const float* q = qkv + ((size_t)b * T + t) * qkv_dim + (size_t)h * hd;
                    const float* o = out + ((size_t)b * T + t) * out_dim + (size_t)h * hd;
                    const float* dy = dout + ((size_t)b * T + t) * out_dim + (size_t)h * hd;
                    double max_s = -INFINITY;
                    for (int t2 = 0; t2 <= t; t2++) {
                        double dot = 0.0;
                        for (int i = 0; i < hd; i++) dot += (double)q[i] * k_at(t2)[i];
                        p[t2] = dot * scale;
                        max_s = std::max(max_s, p[t2]);
                    }
                    double sum = 0.0;
                    for (int t2 = 0; t2 <= t; t2++) sum += exp(p[t2] - max_s);
                    for (int t2 = 0; t2 <= t; t2++) p[t2] = exp(p[t2] - max_s) / sum;
                    double D = 0.0;
                    for (int i = 0; i < hd; i++) D += (double)dy[i] * o[i];
                    for (int t2 = 0; t2 <= t; t2++) {
                        double dp = 0.0;
                        for (int i = 0; i < hd; i++) dp += (double)dy[i] * v_at(t2)[i];
                        ds[t2] = p[t2] * (dp - D) * scale;
                    }
                    double* dq = acc.data() + ((size_t)b * T + t) * qkv_dim + (size_t)h * hd;
                    for (int t2 = 0; t2 <= t; t2++) {
                        double* dk = acc.data() + ((size_t)b * T + t2) * qkv_dim + (size_t)(H + kv) * hd;
                        double* dv = acc.data() + ((size_t)b * T + t2) * qkv_dim + (size_t)(H + KV + kv) * hd;
                        const float* k = k_at(t2);
                        for (int i = 0; i < hd; i++) {
                            dq[i] += ds[t2] * k[i];
                            dk[i] += ds[t2] * q[i];
                            dv[i] += p[t2] * dy[i];
                        }
                    }
                }
            }
        }
    }
    for (size_t i = 0; i < acc.size(); i++) dqkv[i] = (float)acc[i];
}

inline double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// out (N, F) = silu(gate) * up, where inp (N, 2F) holds [gate | up] per row
inline void swiglu_forward(float* out, const float* inp, int N, int F) {
    for (int n = 0; n < N; n++) {
        for (int i = 0; i < F; i++) {
            double gate = inp[(size_t)n * 2 * F + i], up = inp[(size_t)n * 2 * F + F + i];
            out[(size_t)n * F + i] = (float)(gate * sigmoid(gate) * up);
        }
    }
}

// dinp (N, 2F) from dout (N, F)
inline void swiglu_backward(float* dinp, const float* dout, const float* inp, int N, int F) {
    for (int n = 0; n < N; n++) {
        for (int i = 0; i < F; i++) {
            double gate = inp[(size_t)n * 2 * F + i], up = inp[(size_t)n * 2 * F + F + i];
            double sig = sigmoid(gate), dy = dout[(size_t)n * F + i];
            dinp[(size_t)n * 2 * F + i] = (float)(dy * up * sig * (1.0 + gate * (1.0 - sig)));
            dinp[(size_t)n * 2 * F + F + i] = (float)(dy * gate * sig);
        }
    }
}

// One row of the cross-entropy: returns logsumexp(logits) - logits[target] and sets dlogits (V) =
// (softmax - onehot(target)) * dloss. A target of -1 is masked (a loss mask): loss 0, dlogits 0.
inline double cross_entropy_row(float* dlogits, const float* logits, int target, int V, double dloss) {
    if (target < 0) {
        std::fill(dlogits, dlogits + V, 0.0f);
        return 0.0;
    }
    double maxval = -INFINITY, sum = 0.0;
    for (int v = 0; v < V; v++) maxval = fmax(maxval, logits[v]);
    for (int v = 0; v < V; v++) sum += exp((double)logits[v] - maxval);
    for (int v = 0; v < V; v++) {
        double p = exp((double)logits[v] - maxval) / sum;
        dlogits[v] = (float)((p - (v == target ? 1.0 : 0.0)) * dloss);
    }
    return log(sum) + maxval - logits[target];
}

// Mean cross-entropy over the rows whose target counts. With `count` counted rows, dlogits = (softmax -
// onehot(target)) / count; with none the loss is NaN (0 / 0, as PyTorch's cross_entropy with ignore_index gives).
inline float cross_entropy(float* dlogits, const float* logits, const int* targets, int N, int V) {
    double total = 0.0;
    int count = 0;
    for (int n = 0; n < N; n++) count += targets[n] >= 0;
    for (int n = 0; n < N; n++)
        total += cross_entropy_row(dlogits + (size_t)n * V, logits + (size_t)n * V, targets[n], V, 1.0 / count);
    return count > 0 ? (float)(total / count) : NAN;
}

// sum of x^2 over n values (the global gradient norm is its square root)
inline double sum_squares(const float* x, size_t n) {
    double ss = 0.0;
    for (size_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    return ss;
}

// One AdamW step (torch.optim.AdamW semantics, decoupled weight decay) on n values in place: g = grad * grad_scale,
// p *= 1 - lr wd, m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, p -= lr / (1 - b1^t) * m / (sqrt(v) /
// sqrt(1 - b2^t) + eps), with t = step (1-based). Math in double, one rounding per stored value.
inline void adamw_update(float* p, float* m, float* v, const float* grad, size_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, float grad_scale, int step) {
    double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
    for (size_t i = 0; i < n; i++) {
        double g = (double)grad[i] * grad_scale;
        double mi = beta1 * (double)m[i] + (1.0 - beta1) * g;
        double vi = beta2 * (double)v[i] + (1.0 - beta2) * g * g;
        double pi = p[i] * (1.0 - (double)lr * weight_decay);
        pi -= lr / bc1 * mi / (sqrt(vi) / sqrt(bc2) + eps);
        p[i] = (float)pi;
        m[i] = (float)mi;
        v[i] = (float)vi;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The model

struct AdamW {
    float lr, beta1, beta2, eps, weight_decay, grad_clip;
};

struct Model {
    Llama3Config config;
    std::vector<float> params, grads, m, v;
    int step = 0;
    // activations of the last forward, for (B, T)
    int B = 0, T = 0;
    std::vector<float> residual, ln1, rstd1, qkv, atty, residual_mid, ln2, rstd2, h13, hact, lnf, rstdf;
    std::vector<float> logits, dlogits, cos_table, sin_table;
    std::vector<int> inputs, targets;

    Model(std::vector<float> parameters, const Llama3Config& c) : config(c), params(std::move(parameters)) {
        grads.assign(params.size(), 0.0f);
        m.assign(params.size(), 0.0f);
        v.assign(params.size(), 0.0f);
    }

    // Forward pass and mean cross-entropy loss on (B, T) token ids.
    float forward(const int* in, const int* tg, int batch, int seq_len) {
        const Llama3Config& c = config;
        B = batch;
        T = seq_len;
        int N = B * T, C = c.dim, L = c.n_layers, H = c.n_heads, KV = c.n_kv_heads, hd = c.head_dim();
        int QKV = c.qkv_dim(), F = c.ffn_hidden, V = c.vocab_size;
        size_t NC = (size_t)N * C;
        inputs.assign(in, in + N);
        targets.assign(tg, tg + N);
        residual.resize((L + 1) * NC); ln1.resize(L * NC); rstd1.resize((size_t)L * N);
        qkv.resize((size_t)L * N * QKV); atty.resize((size_t)L * N * H * hd);
        residual_mid.resize(L * NC); ln2.resize(L * NC); rstd2.resize((size_t)L * N);
        h13.resize((size_t)L * N * 2 * F); hact.resize((size_t)L * N * F); lnf.resize(NC); rstdf.resize(N);
        logits.resize((size_t)N * V); dlogits.resize((size_t)N * V);
        rope_tables(c, T, &cos_table, &sin_table);
        ParamTensors<float> p = point_params(params.data(), c);

        encoder_forward(residual.data(), in, p.tok_embedding, N, C);
        std::vector<float> proj(NC);
        for (int l = 0; l < L; l++) {
            float* x = residual.data() + l * NC;
            float* l_ln1 = ln1.data() + l * NC;
            float* l_qkv = qkv.data() + (size_t)l * N * QKV;
            float* l_atty = atty.data() + (size_t)l * N * H * hd;
            float* l_mid = residual_mid.data() + l * NC;
            float* l_ln2 = ln2.data() + l * NC;
            float* l_h13 = h13.data() + (size_t)l * N * 2 * F;
            float* l_hact = hact.data() + (size_t)l * N * F;
            rmsnorm_forward(l_ln1, rstd1.data() + (size_t)l * N, x, p.attn_norm + (size_t)l * C, N, C, c.norm_eps);
            matmul_forward(l_qkv, l_ln1, p.wqkv + (size_t)l * QKV * C, N, C, QKV);
            rope(l_qkv, cos_table, sin_table, B, T, H, KV, hd, false);
            attention_forward(l_atty, nullptr, l_qkv, B, T, H, KV, hd);
            matmul_forward(proj.data(), l_atty, p.wo + (size_t)l * C * H * hd, N, H * hd, C);
            for (size_t i = 0; i < NC; i++) l_mid[i] = x[i] + proj[i];
            rmsnorm_forward(l_ln2, rstd2.data() + (size_t)l * N, l_mid, p.ffn_norm + (size_t)l * C, N, C, c.norm_eps);
            matmul_forward(l_h13, l_ln2, p.w13 + (size_t)l * 2 * F * C, N, C, 2 * F);
            swiglu_forward(l_hact, l_h13, N, F);
            matmul_forward(proj.data(), l_hact, p.w2 + (size_t)l * C * F, N, F, C);
            float* x_next = residual.data() + (l + 1) * NC;
            for (size_t i = 0; i < NC; i++) x_next[i] = l_mid[i] + proj[i];
        }
        rmsnorm_forward(lnf.data(), rstdf.data(), residual.data() + L * NC, p.final_norm, N, C, c.norm_eps);
        matmul_forward(logits.data(), lnf.data(), p.lm_head, N, C, V);
        return cross_entropy(dlogits.data(), logits.data(), tg, N, V);
    }

    // Backward pass of the last forward; gradients accumulate into `grads`.
    void backward() {
        const Llama3Config& c = config;
        int N = B * T, C = c.dim, L = c.n_layers, H = c.n_heads, KV = c.n_kv_heads, hd = c.head_dim();
        int QKV = c.qkv_dim(), F = c.ffn_hidden, V = c.vocab_size;
        size_t NC = (size_t)N * C;
        ParamTensors<float> p = point_params(params.data(), c);
        ParamTensors<float> g = point_params(grads.data(), c);
        std::vector<float> dresidual(NC, 0.0f), dnorm(NC), datty((size_t)N * H * hd), dqkv((size_t)N * QKV);
        std::vector<float> dh13((size_t)N * 2 * F), dhact((size_t)N * F);

        matmul_backward(dnorm.data(), g.lm_head, dlogits.data(), lnf.data(), p.lm_head, N, C, V);
        rmsnorm_backward(dresidual.data(), g.final_norm, dnorm.data(), residual.data() + L * NC, p.final_norm,
                         rstdf.data(), N, C);
        for (int l = L - 1; l >= 0; l--) {
            // the MLP branch: dresidual is the gradient of its output
            matmul_backward(dhact.data(), g.w2 + (size_t)l * C * F, dresidual.data(), hact.data() + (size_t)l * N * F,
                            p.w2 + (size_t)l * C * F, N, F, C);
            swiglu_backward(dh13.data(), dhact.data(), h13.data() + (size_t)l * N * 2 * F, N, F);
            matmul_backward(dnorm.data(), g.w13 + (size_t)l * 2 * F * C, dh13.data(), ln2.data() + l * NC,
                            p.w13 + (size_t)l * 2 * F * C, N, C, 2 * F);
            rmsnorm_backward(dresidual.data(), g.ffn_norm + (size_t)l * C, dnorm.data(), residual_mid.data() + l * NC,
                             p.ffn_norm + (size_t)l * C, rstd2.data() + (size_t)l * N, N, C);
            // the attention branch
            matmul_backward(datty.data(), g.wo + (size_t)l * C * H * hd, dresidual.data(),
                            atty.data() + (size_t)l * N * H * hd, p.wo + (size_t)l * C * H * hd, N, H * hd, C);
            attention_backward(dqkv.data(), datty.data(), qkv.data() + (size_t)l * N * QKV,
                               atty.data() + (size_t)l * N * H * hd, B, T, H, KV, hd);
            rope(dqkv.data(), cos_table, sin_table, B, T, H, KV, hd, true);
            matmul_backward(dnorm.data(), g.wqkv + (size_t)l * QKV * C, dqkv.data(), ln1.data() + l * NC,
                            p.wqkv + (size_t)l * QKV * C, N, C, QKV);
            rmsnorm_backward(dresidual.data(), g.attn_norm + (size_t)l * C, dnorm.data(), residual.data() + l * NC,
                             p.attn_norm + (size_t)l * C, rstd1.data() + (size_t)l * N, N, C);
        }
        encoder_backward(g.tok_embedding, inputs.data(), dresidual.data(), N, C);
    }

    void zero_grad() { std::fill(grads.begin(), grads.end(), 0.0f); }

    // Global L2 norm of the gradients, before clipping.
    float grad_norm() const { return (float)sqrt(sum_squares(grads.data(), grads.size())); }

    // Clips the gradients to a global norm of hp.grad_clip (as torch.nn.utils.clip_grad_norm_ does), then takes one
    // AdamW step with decoupled weight decay on the 2-D tensors only. Returns the pre-clip norm.
    float update(const AdamW& hp) {
        float norm = grad_norm();
        float clip = hp.grad_clip > 0.0f ? std::min(1.0f, hp.grad_clip / (norm + 1e-6f)) : 1.0f;
        step++;
        ParamLayout layout = param_layout(config);
        size_t offset = 0;
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            float wd = param_is_matrix(t) ? hp.weight_decay : 0.0f;
            adamw_update(params.data() + offset, m.data() + offset, v.data() + offset, grads.data() + offset,
                         layout.sizes[t], hp.lr, hp.beta1, hp.beta2, hp.eps, wd, clip, step);
            offset += layout.sizes[t];
        }
        return norm;
    }
};

}  // namespace cpu
