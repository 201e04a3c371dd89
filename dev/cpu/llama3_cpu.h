// The CPU reference: Llama 3 forward, cross-entropy loss, backward, gradient clipping and AdamW in plain fp32 C++
// (dot products accumulate in double). It is the readable spec of the math that the CUDA kernels implement and the
// oracle they are checked against; it ties out with scripts/train_llama3.py (see dev/cpu/test_llama3_cpu.cpp).
//
// Layouts (row-major; B batch, T time, C dim, H query heads, KV kv heads, hd head dim, F ffn hidden, V vocab):
//   residual stream (B*T, C); qkv (B*T, (H + 2 KV) hd) with query heads, then key heads, then value heads;
//   attention output (B*T, H hd); w13 output (B*T, 2F) = [gate | up]; logits (B*T, V).
// Parameters are one flat fp32 buffer in checkpoint order (llmc/checkpoint.h), gradients the same shape.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "../../llmc/checkpoint.h"
#include "../../llmc/hf_model.h"

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

// dinp (N, C) = dout @ weight;  dweight (OC, C) += dout^T @ inp
inline void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                            int N, int C, int OC) {
#pragma omp parallel for collapse(2)
    for (int n = 0; n < N; n++) {
        for (int c = 0; c < C; c++) {
            double sum = 0.0;
            for (int o = 0; o < OC; o++) sum += (double)dout[(size_t)n * OC + o] * weight[(size_t)o * C + c];
            dinp[(size_t)n * C + c] = (float)sum;
        }
    }
#pragma omp parallel for collapse(2)
    for (int o = 0; o < OC; o++) {
        for (int c = 0; c < C; c++) {
            double sum = 0.0;
            for (int n = 0; n < N; n++) sum += (double)dout[(size_t)n * OC + o] * inp[(size_t)n * C + c];
            dweight[(size_t)o * C + c] += (float)sum;
        }
    }
}

// out = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps), per row
inline void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C, float eps) {
    for (int n = 0; n < N; n++) {
        const float* x = inp + (size_t)n * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)x[c] * x[c];
        float r = (float)(1.0 / sqrt(ss / C + eps));
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = x[c] * r * weight[c];
        rstd[n] = r;
    }
}

// dinp += rstd * (dxhat - xhat * mean(dxhat * xhat)) with xhat = x * rstd, dxhat = dout * weight;
// dweight += sum over rows of dout * xhat
inline void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const float* rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float* x = inp + (size_t)n * C;
        const float* dy = dout + (size_t)n * C;
        double dot = 0.0;
        for (int c = 0; c < C; c++) dot += (double)dy[c] * weight[c] * x[c] * rstd[n];
        float mean_dot = (float)(dot / C);
        for (int c = 0; c < C; c++) {
            float xhat = x[c] * rstd[n];
            dinp[(size_t)n * C + c] += rstd[n] * (dy[c] * weight[c] - xhat * mean_dot);
            dweight[c] += dy[c] * xhat;
        }
    }
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
                    float c = cos_table[(size_t)t * half + i];
                    float s = inverse ? -sin_table[(size_t)t * half + i] : sin_table[(size_t)t * half + i];
                    float* pair = row + head * head_dim + 2 * i;
                    float x0 = pair[0], x1 = pair[1];
                    pair[0] = x0 * c - x1 * s;
                    pair[1] = x0 * s + x1 * c;
                }
            }
        }
    }
}

// Causal grouped-query attention. Query head h attends with kv head h / (n_heads / n_kv_heads).
// probs (B, H, T, T) keeps the softmax for the backward (the reference is for small T; the GPU never does this).
inline void attention_forward(float* out, float* probs, const float* qkv, int B, int T, int H, int KV, int hd) {
    int qkv_dim = (H + 2 * KV) * hd, group = H / KV;
    float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for collapse(3)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            for (int t = 0; t < T; t++) {
                int kv = h / group;
                const float* q = qkv + ((size_t)b * T + t) * qkv_dim + h * hd;
                float* p = probs + (((size_t)b * H + h) * T + t) * T;
                double maxval = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = qkv + ((size_t)b * T + t2) * qkv_dim + (H + kv) * hd;
                    double dot = 0.0;
                    for (int i = 0; i < hd; i++) dot += (double)q[i] * k[i];
                    p[t2] = (float)dot * scale;
                    maxval = fmax(maxval, p[t2]);
                }
                double sum = 0.0;
                for (int t2 = 0; t2 <= t; t2++) sum += exp((double)p[t2] - maxval);
                for (int t2 = 0; t2 < T; t2++) p[t2] = t2 <= t ? (float)(exp((double)p[t2] - maxval) / sum) : 0.0f;
                float* o = out + ((size_t)b * T + t) * H * hd + h * hd;
                for (int i = 0; i < hd; i++) {
                    double acc = 0.0;
                    for (int t2 = 0; t2 <= t; t2++)
                        acc += (double)p[t2] * qkv[((size_t)b * T + t2) * qkv_dim + (H + KV + kv) * hd + i];
                    o[i] = (float)acc;
                }
            }
        }
    }
}

// dqkv (overwritten) from dout (B*T, H hd), with dK and dV summed over the query heads of each group.
inline void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* probs, int B, int T,
                               int H, int KV, int hd) {
    int qkv_dim = (H + 2 * KV) * hd, group = H / KV;
    float scale = 1.0f / sqrtf((float)hd);
    std::fill(dqkv, dqkv + (size_t)B * T * qkv_dim, 0.0f);
    std::vector<float> dp(T), ds(T);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            int kv = h / group;
            for (int t = 0; t < T; t++) {
                const float* p = probs + (((size_t)b * H + h) * T + t) * T;
                const float* dy = dout + ((size_t)b * T + t) * H * hd + h * hd;
                const float* q = qkv + ((size_t)b * T + t) * qkv_dim + h * hd;
                float* dq = dqkv + ((size_t)b * T + t) * qkv_dim + h * hd;
                double pdp = 0.0;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = qkv + ((size_t)b * T + t2) * qkv_dim + (H + KV + kv) * hd;
                    float* dv = dqkv + ((size_t)b * T + t2) * qkv_dim + (H + KV + kv) * hd;
                    double dot = 0.0;
                    for (int i = 0; i < hd; i++) {
                        dot += (double)dy[i] * v[i];
                        dv[i] += p[t2] * dy[i];
                    }
                    dp[t2] = (float)dot;
                    pdp += (double)p[t2] * dp[t2];
                }
                for (int t2 = 0; t2 <= t; t2++) {
                    float dscore = p[t2] * (dp[t2] - (float)pdp) * scale;
                    const float* k = qkv + ((size_t)b * T + t2) * qkv_dim + (H + kv) * hd;
                    float* dk = dqkv + ((size_t)b * T + t2) * qkv_dim + (H + kv) * hd;
                    for (int i = 0; i < hd; i++) {
                        dq[i] += dscore * k[i];
                        dk[i] += dscore * q[i];
                    }
                }
            }
        }
    }
}

inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out (N, F) = silu(gate) * up, where inp (N, 2F) holds [gate | up] per row
inline void swiglu_forward(float* out, const float* inp, int N, int F) {
    for (int n = 0; n < N; n++) {
        for (int i = 0; i < F; i++) {
            float gate = inp[(size_t)n * 2 * F + i], up = inp[(size_t)n * 2 * F + F + i];
            out[(size_t)n * F + i] = gate * sigmoid(gate) * up;
        }
    }
}

// dinp (N, 2F) from dout (N, F)
inline void swiglu_backward(float* dinp, const float* dout, const float* inp, int N, int F) {
    for (int n = 0; n < N; n++) {
        for (int i = 0; i < F; i++) {
            float gate = inp[(size_t)n * 2 * F + i], up = inp[(size_t)n * 2 * F + F + i];
            float sig = sigmoid(gate), dy = dout[(size_t)n * F + i];
            dinp[(size_t)n * 2 * F + i] = dy * up * sig * (1.0f + gate * (1.0f - sig));
            dinp[(size_t)n * 2 * F + F + i] = dy * gate * sig;
        }
    }
}

// Mean cross-entropy over the rows whose target counts: a target of -1 is masked (a loss mask), adds no loss and
// gets zero dlogits. With `count` counted rows, dlogits = (softmax - onehot(target)) / count; with none the loss is
// NaN (0 / 0, as PyTorch's cross_entropy with ignore_index gives).
inline float cross_entropy(float* dlogits, const float* logits, const int* targets, int N, int V) {
    double total = 0.0;
    int count = 0;
    for (int n = 0; n < N; n++) count += targets[n] >= 0;
    for (int n = 0; n < N; n++) {
        const float* row = logits + (size_t)n * V;
        if (targets[n] < 0) {
            std::fill(dlogits + (size_t)n * V, dlogits + (size_t)(n + 1) * V, 0.0f);
            continue;
        }
        double maxval = -INFINITY, sum = 0.0;
        for (int v = 0; v < V; v++) maxval = fmax(maxval, row[v]);
        for (int v = 0; v < V; v++) sum += exp((double)row[v] - maxval);
        total += log(sum) + maxval - row[targets[n]];
        for (int v = 0; v < V; v++) {
            double p = exp((double)row[v] - maxval) / sum;
            dlogits[(size_t)n * V + v] = (float)((p - (v == targets[n] ? 1.0 : 0.0)) / count);
        }
    }
    return count > 0 ? (float)(total / count) : NAN;
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
    std::vector<float> residual, ln1, rstd1, qkv, probs, atty, residual_mid, ln2, rstd2, h13, hact, lnf, rstdf;
    std::vector<float> logits, dlogits, cos_table, sin_table;
    std::vector<int> inputs, targets;

    explicit Model(const char* checkpoint_path) {
        params = load_model_fp32(checkpoint_path, &config);  // our .bin or a HF directory
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
        qkv.resize((size_t)L * N * QKV); probs.resize((size_t)L * B * H * T * T); atty.resize((size_t)L * N * H * hd);
        residual_mid.resize(L * NC); ln2.resize(L * NC); rstd2.resize((size_t)L * N);
        h13.resize((size_t)L * N * 2 * F); hact.resize((size_t)L * N * F); lnf.resize(NC); rstdf.resize(N);
        logits.resize((size_t)N * V); dlogits.resize((size_t)N * V);
        rope_tables(c, T, &cos_table, &sin_table);
        ParamTensors<float> p = point_params(params.data(), c);

        for (int n = 0; n < N; n++)
            std::copy_n(p.tok_embedding + (size_t)in[n] * C, C, residual.data() + (size_t)n * C);
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
            attention_forward(l_atty, probs.data() + (size_t)l * B * H * T * T, l_qkv, B, T, H, KV, hd);
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
                               probs.data() + (size_t)l * B * H * T * T, B, T, H, KV, hd);
            rope(dqkv.data(), cos_table, sin_table, B, T, H, KV, hd, true);
            matmul_backward(dnorm.data(), g.wqkv + (size_t)l * QKV * C, dqkv.data(), ln1.data() + l * NC,
                            p.wqkv + (size_t)l * QKV * C, N, C, QKV);
            rmsnorm_backward(dresidual.data(), g.attn_norm + (size_t)l * C, dnorm.data(), residual.data() + l * NC,
                             p.attn_norm + (size_t)l * C, rstd1.data() + (size_t)l * N, N, C);
        }
        for (int n = 0; n < N; n++) {
            float* row = g.tok_embedding + (size_t)inputs[n] * C;
            for (int i = 0; i < C; i++) row[i] += dresidual[(size_t)n * C + i];
        }
    }

    void zero_grad() { std::fill(grads.begin(), grads.end(), 0.0f); }

    // Global L2 norm of the gradients, before clipping.
    float grad_norm() const {
        double ss = 0.0;
        for (float x : grads) ss += (double)x * x;
        return (float)sqrt(ss);
    }

    // Clips the gradients to a global norm of hp.grad_clip (as torch.nn.utils.clip_grad_norm_ does), then takes one
    // AdamW step with decoupled weight decay on the 2-D tensors only. Returns the pre-clip norm.
    float update(const AdamW& hp) {
        float norm = grad_norm();
        float clip = hp.grad_clip > 0.0f ? std::min(1.0f, hp.grad_clip / (norm + 1e-6f)) : 1.0f;
        step++;
        float bias1 = 1.0f - powf(hp.beta1, (float)step), bias2 = 1.0f - powf(hp.beta2, (float)step);
        ParamLayout layout = param_layout(config);
        size_t offset = 0;
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            float wd = param_is_matrix(t) ? hp.weight_decay : 0.0f;
            for (size_t i = offset; i < offset + layout.sizes[t]; i++) {
                float grad = grads[i] * clip;
                m[i] = hp.beta1 * m[i] + (1.0f - hp.beta1) * grad;
                v[i] = hp.beta2 * v[i] + (1.0f - hp.beta2) * grad * grad;
                float denom = sqrtf(v[i]) / sqrtf(bias2) + hp.eps;
                params[i] -= hp.lr * wd * params[i];
                params[i] -= (hp.lr / bias1) * m[i] / denom;
            }
            offset += layout.sizes[t];
        }
        return norm;
    }
};

}  // namespace cpu
