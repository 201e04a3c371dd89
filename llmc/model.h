// The Llama 3 model: its configuration and the named configs, the parameter tensors (ParamTensor, in checkpoint
// order) and their layout in one flat buffer, and the RoPE frequencies. The file format that stores a model is
// llmc/checkpoint.h.
//
// Parameters (and their gradients, master weights, AdamW moments) are one flat buffer: the tensors back to back in
// ParamTensor order. Linear weights are (out, in) row-major, as nn.Linear stores them. wqkv rows: the n_heads query
// heads, then the n_kv_heads key heads, then the values; w13 rows: w1 (gate, goes through SiLU) then w3 (up). RoPE
// rotates interleaved pairs (2i, 2i+1) of each head, as Meta's reference does.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

struct Llama3Config {
    int vocab_size = 0;
    int dim = 0;
    int n_layers = 0;
    int n_heads = 0;
    int n_kv_heads = 0;
    int ffn_hidden = 0;
    int max_seq_len = 0;
    int tied_embeddings = 0;
    int use_rope_scaling = 0;
    int rope_original_max_seq_len = 0;
    float norm_eps = 1e-5f;
    float rope_theta = 500000.0f;
    float rope_scaling_factor = 1.0f;
    float rope_low_freq_factor = 1.0f;
    float rope_high_freq_factor = 4.0f;

    int head_dim() const { return dim / n_heads; }
    int qkv_dim() const { return (n_heads + 2 * n_kv_heads) * head_dim(); }
};

// Checks that a config describes a model we can build; returns an empty string or what is wrong.
inline std::string config_error(const Llama3Config& c) {
    char buf[256];
    auto bad = [&](const char* fmt, auto... args) {
        snprintf(buf, sizeof(buf), fmt, args...);
        return std::string(buf);
    };
    if (c.vocab_size < 2 || c.vocab_size > (1 << 24)) return bad("vocab_size %d not in [2, 2^24]", c.vocab_size);
    if (c.dim < 2 || c.dim > 65536) return bad("dim %d not in [2, 65536]", c.dim);
    if (c.n_layers < 1 || c.n_layers > 1024) return bad("n_layers %d not in [1, 1024]", c.n_layers);
    if (c.n_heads < 1 || c.dim % c.n_heads != 0) return bad("n_heads %d does not divide dim %d", c.n_heads, c.dim);
    if (c.head_dim() % 2 != 0) return bad("head_dim %d is odd (RoPE rotates pairs)", c.head_dim());
    if (c.n_kv_heads < 1 || c.n_heads % c.n_kv_heads != 0)
        return bad("n_kv_heads %d does not divide n_heads %d", c.n_kv_heads, c.n_heads);
    if (c.ffn_hidden < 1 || c.ffn_hidden > 1 << 20) return bad("ffn_hidden %d not in [1, 2^20]", c.ffn_hidden);
    if (c.max_seq_len < 1 || c.max_seq_len > 1 << 20) return bad("max_seq_len %d not in [1, 2^20]", c.max_seq_len);
    if (c.tied_embeddings != 0 && c.tied_embeddings != 1) return bad("tied_embeddings %d not 0 or 1", c.tied_embeddings);
    if (c.use_rope_scaling != 0 && c.use_rope_scaling != 1)
        return bad("use_rope_scaling %d not 0 or 1", c.use_rope_scaling);
    if (!(c.norm_eps > 0.0f && c.norm_eps < 1.0f)) return bad("norm_eps %g not in (0, 1)", c.norm_eps);
    if (!(c.rope_theta > 1.0f && c.rope_theta < 1e9f)) return bad("rope_theta %g not in (1, 1e9)", c.rope_theta);
    if (c.use_rope_scaling) {
        if (!(c.rope_scaling_factor >= 1.0f && c.rope_scaling_factor < 1e4f))
            return bad("rope_scaling_factor %g not in [1, 1e4)", c.rope_scaling_factor);
        if (!(c.rope_low_freq_factor > 0.0f && c.rope_high_freq_factor > c.rope_low_freq_factor))
            return bad("rope low/high freq factors %g/%g: need 0 < low < high", c.rope_low_freq_factor,
                       c.rope_high_freq_factor);
        if (c.rope_original_max_seq_len < 1) return bad("rope_original_max_seq_len %d < 1", c.rope_original_max_seq_len);
    }
    return "";
}

// Named configs, the same as scripts/train_llama3.py's. "dN" is a small from-scratch model: dim 64N, N layers,
// N heads, the largest kv-head count <= N/3 that divides N, FFN 8/3 dim rounded up to 256, no RoPE scaling.
// depth > 0 keeps only the first `depth` layers. Returns false for an unknown name.
inline bool config_from_name(const std::string& name, int depth, Llama3Config* out) {
    Llama3Config c;
    c.vocab_size = 128256;
    c.max_seq_len = 8192;
    c.norm_eps = 1e-5f;
    c.rope_theta = 500000.0f;
    c.rope_low_freq_factor = 1.0f;
    c.rope_high_freq_factor = 4.0f;
    c.rope_original_max_seq_len = 8192;
    if (name == "llama3.1-8B") {
        c.dim = 4096; c.n_layers = 32; c.n_heads = 32; c.n_kv_heads = 8; c.ffn_hidden = 14336;
        c.tied_embeddings = 0; c.use_rope_scaling = 1; c.rope_scaling_factor = 8.0f;
    } else if (name == "llama3.1-70B") {
        c.dim = 8192; c.n_layers = 80; c.n_heads = 64; c.n_kv_heads = 8; c.ffn_hidden = 28672;
        c.tied_embeddings = 0; c.use_rope_scaling = 1; c.rope_scaling_factor = 8.0f;
    } else if (name == "llama3.2-1B") {
        c.dim = 2048; c.n_layers = 16; c.n_heads = 32; c.n_kv_heads = 8; c.ffn_hidden = 8192;
        c.tied_embeddings = 1; c.use_rope_scaling = 1; c.rope_scaling_factor = 32.0f;
    } else if (name == "llama3.2-3B") {
        c.dim = 3072; c.n_layers = 28; c.n_heads = 24; c.n_kv_heads = 8; c.ffn_hidden = 8192;
        c.tied_embeddings = 1; c.use_rope_scaling = 1; c.rope_scaling_factor = 32.0f;
    } else if (name.size() >= 2 && name[0] == 'd' && name.find_first_not_of("0123456789", 1) == std::string::npos &&
               name.size() <= 4) {
        int n = atoi(name.c_str() + 1);
        if (n < 1) return false;
        c.dim = 64 * n; c.n_layers = n; c.n_heads = n;
        c.n_kv_heads = 1;
        for (int kv = n / 3; kv >= 1; kv--) {
            if (n % kv == 0) { c.n_kv_heads = kv; break; }
        }
        c.ffn_hidden = ((8 * c.dim / 3) + 255) / 256 * 256;
        c.max_seq_len = 2048;
        c.tied_embeddings = 0; c.use_rope_scaling = 0; c.rope_scaling_factor = 1.0f;
        c.rope_original_max_seq_len = 0;
    } else {
        return false;
    }
    if (depth > 0 && depth < c.n_layers) c.n_layers = depth;
    *out = c;
    return true;
}

// The parameter tensors, in checkpoint file order (llmc/checkpoint.h): the order is the file format, never change
// it. LM_HEAD (the last) is absent when the embedding is tied. Shapes: L layers, C dim, H heads, hd head dim,
// F ffn hidden, V vocab, QKV = (H + 2 KV) hd; linear weights are (out, in).
enum ParamTensor {
    TOK_EMBEDDING,  // (V, C)
    ATTN_NORM,      // (L, C)
    WQKV,           // (L, QKV, C)
    WO,             // (L, C, H hd)
    FFN_NORM,       // (L, C)
    W13,            // (L, 2F, C)
    W2,             // (L, C, F)
    FINAL_NORM,     // (C)
    LM_HEAD,        // (V, C)
    NUM_PARAM_TENSORS
};

struct ParamLayout {
    size_t sizes[NUM_PARAM_TENSORS];  // elements of each tensor, 0 for an absent one
    const char* names[NUM_PARAM_TENSORS];
    int count;  // tensors present (lm_head dropped when tied)
    size_t total;
};

inline ParamLayout param_layout(const Llama3Config& c) {
    ParamLayout p;
    size_t V = c.vocab_size, C = c.dim, L = c.n_layers, F = c.ffn_hidden;
    size_t attn_out = (size_t)c.n_heads * c.head_dim();
    const char* names[] = {"tok_embedding", "attn_norm", "wqkv", "wo", "ffn_norm", "w13", "w2", "final_norm", "lm_head"};
    size_t sizes[] = {V * C, L * C, L * (size_t)c.qkv_dim() * C, L * C * attn_out, L * C, L * 2 * F * C, L * C * F,
                      C, V * C};
    p.count = c.tied_embeddings ? LM_HEAD : NUM_PARAM_TENSORS;
    p.total = 0;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        p.names[i] = names[i];
        p.sizes[i] = i < p.count ? sizes[i] : 0;
        p.total += p.sizes[i];
    }
    return p;
}

// Pointers to each tensor inside a flat buffer in file order (parameters or their gradients; T is the element
// type), by name or by ParamTensor. With tied embeddings lm_head points at tok_embedding.
template <typename T>
struct ParamTensors {
    T *tok_embedding, *attn_norm, *wqkv, *wo, *ffn_norm, *w13, *w2, *final_norm, *lm_head;

    T*& operator[](int t) {
        T** all[NUM_PARAM_TENSORS] = {&tok_embedding, &attn_norm, &wqkv, &wo, &ffn_norm, &w13, &w2, &final_norm,
                                      &lm_head};
        return *all[t];
    }
    T* operator[](int t) const { return (*const_cast<ParamTensors*>(this))[t]; }
};

template <typename T>
inline ParamTensors<T> point_params(T* base, const Llama3Config& c) {
    ParamLayout layout = param_layout(c);
    ParamTensors<T> p;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        p[t] = base;
        base += layout.sizes[t];
    }
    if (c.tied_embeddings) p.lm_head = p.tok_embedding;
    return p;
}

// 2-D tensors get weight decay; the norm gains do not.
inline bool param_is_matrix(int t) { return !(t == ATTN_NORM || t == FFN_NORM || t == FINAL_NORM); }

// Tensors with one slice per layer (ATTN_NORM through W2); the others are the embedding, the final norm and the
// lm_head.
inline bool param_is_per_layer(int t) { return t >= ATTN_NORM && t <= W2; }

// point_params with the per-layer tensors pointing at layer l's slice.
template <typename T>
inline ParamTensors<T> layer_tensors(T* base, const Llama3Config& c, int l) {
    ParamTensors<T> p = point_params(base, c);
    ParamLayout layout = param_layout(c);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (param_is_per_layer(t)) p[t] += (size_t)l * (layout.sizes[t] / c.n_layers);
    }
    return p;
}


// RoPE inverse frequencies, computed in double (the PyTorch reference does the same) so both sides agree to the
// last fp32 bit. Llama 3.1 scaling: wavelengths shorter than original_len/high_freq_factor keep their frequency,
// longer than original_len/low_freq_factor are divided by the factor, and the band between is interpolated.
inline std::vector<double> rope_inv_freq(const Llama3Config& c) {
    int half = c.head_dim() / 2;
    std::vector<double> inv(half);
    for (int i = 0; i < half; i++) {
        double freq = 1.0 / pow((double)c.rope_theta, (2.0 * i) / c.head_dim());
        if (c.use_rope_scaling) {
            double old_len = c.rope_original_max_seq_len;
            double low_wavelen = old_len / c.rope_low_freq_factor;
            double high_wavelen = old_len / c.rope_high_freq_factor;
            double wavelen = 2.0 * M_PI / freq;
            if (wavelen < high_wavelen) {
                // high frequency: unchanged
            } else if (wavelen > low_wavelen) {
                freq = freq / c.rope_scaling_factor;
            } else {
                double smooth = (old_len / wavelen - c.rope_low_freq_factor) /
                                (c.rope_high_freq_factor - c.rope_low_freq_factor);
                freq = (1.0 - smooth) * freq / c.rope_scaling_factor + smooth * freq;
            }
        }
        inv[i] = freq;
    }
    return inv;
}

// cos/sin tables (T, head_dim/2) in fp32, angle = position * inv_freq in double.
inline void rope_tables(const Llama3Config& c, int T, std::vector<float>* cos_table, std::vector<float>* sin_table) {
    std::vector<double> inv = rope_inv_freq(c);
    int half = c.head_dim() / 2;
    cos_table->resize((size_t)T * half);
    sin_table->resize((size_t)T * half);
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            double angle = (double)t * inv[i];
            (*cos_table)[(size_t)t * half + i] = (float)cos(angle);
            (*sin_table)[(size_t)t * half + i] = (float)sin(angle);
        }
    }
}
