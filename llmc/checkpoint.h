// The Llama 3 model: its configuration, the named configs, and our checkpoint file format.
//
// File layout (all little-endian; README.md "Model checkpoint" describes the same):
//   header: 64 slots of 4 bytes (256 bytes)
//     [0] magic 20261121   [1] version 1   [2] dtype (0 = fp32, 1 = bf16)
//     [3] vocab_size  [4] dim  [5] n_layers  [6] n_heads  [7] n_kv_heads  [8] ffn_hidden  [9] max_seq_len
//     [10] tied_embeddings (0/1)  [11] use_rope_scaling (0/1)  [12] rope_original_max_seq_len
//     [13] norm_eps (float32)  [14] rope_theta (float32)  [15] rope_scaling_factor (float32)
//     [16] rope_low_freq_factor (float32)  [17] rope_high_freq_factor (float32)
//     [18..63] zero
//   then the tensors, back to back, in this order (L layers, C dim, hd = dim / n_heads, F ffn_hidden,
//   QKV = (n_heads + 2 n_kv_heads) hd):
//     tok_embedding  (V, C)
//     attn_norm      (L, C)
//     wqkv           (L, QKV, C)   rows: the n_heads query heads, then the n_kv_heads key heads, then the values
//     wo             (L, C, n_heads hd)
//     ffn_norm       (L, C)
//     w13            (L, 2F, C)    rows: w1 (gate, goes through SiLU) then w3 (up)
//     w2             (L, C, F)
//     final_norm     (C)
//     lm_head        (V, C)        absent when tied_embeddings = 1
// Linear weights are (out, in) row-major, as nn.Linear stores them. RoPE rotates interleaved pairs
// (2i, 2i+1) of each head, as Meta's reference does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "utils.h"

constexpr int CHECKPOINT_MAGIC = 20261121;
constexpr int CHECKPOINT_VERSION = 1;
constexpr int CHECKPOINT_HEADER_SLOTS = 64;
enum CheckpointDtype { DTYPE_FP32 = 0, DTYPE_BF16 = 1 };

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

// The parameter tensors, in file order; lm_head (the last) is absent when the embedding is tied.
constexpr int NUM_PARAM_TENSORS = 9;

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
    p.count = c.tied_embeddings ? 8 : 9;
    p.total = 0;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        p.names[i] = names[i];
        p.sizes[i] = i < p.count ? sizes[i] : 0;
        p.total += p.sizes[i];
    }
    return p;
}

// Pointers to each tensor inside a flat buffer in file order (parameters or their gradients; T is the element
// type). With tied embeddings lm_head points at tok_embedding.
template <typename T>
struct ParamTensors {
    T *tok_embedding, *attn_norm, *wqkv, *wo, *ffn_norm, *w13, *w2, *final_norm, *lm_head;
};

template <typename T>
inline ParamTensors<T> point_params(T* base, const Llama3Config& c) {
    ParamLayout layout = param_layout(c);
    T* ptrs[NUM_PARAM_TENSORS];
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        ptrs[i] = base;
        base += layout.sizes[i];
    }
    ParamTensors<T> p{ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4], ptrs[5], ptrs[6], ptrs[7], ptrs[8]};
    if (c.tied_embeddings) p.lm_head = p.tok_embedding;
    return p;
}

// 2-D tensors get weight decay; the norm gains do not.
inline bool param_is_matrix(int i) { return !(i == 1 || i == 4 || i == 7); }

// Tensors with one slice per layer (attn_norm, wqkv, wo, ffn_norm, w13, w2); the others are the embedding, the final
// norm and the lm_head.
inline bool param_is_per_layer(int i) { return i >= 1 && i <= 6; }

inline void config_to_header(const Llama3Config& c, int dtype, int32_t header[CHECKPOINT_HEADER_SLOTS]) {
    memset(header, 0, CHECKPOINT_HEADER_SLOTS * sizeof(int32_t));
    header[0] = CHECKPOINT_MAGIC;
    header[1] = CHECKPOINT_VERSION;
    header[2] = dtype;
    header[3] = c.vocab_size; header[4] = c.dim; header[5] = c.n_layers; header[6] = c.n_heads;
    header[7] = c.n_kv_heads; header[8] = c.ffn_hidden; header[9] = c.max_seq_len;
    header[10] = c.tied_embeddings; header[11] = c.use_rope_scaling; header[12] = c.rope_original_max_seq_len;
    memcpy(&header[13], &c.norm_eps, 4);
    memcpy(&header[14], &c.rope_theta, 4);
    memcpy(&header[15], &c.rope_scaling_factor, 4);
    memcpy(&header[16], &c.rope_low_freq_factor, 4);
    memcpy(&header[17], &c.rope_high_freq_factor, 4);
}

// Reads and validates a checkpoint header; on any mismatch names the file, what was expected and what was found,
// and exits. Leaves `fp` positioned at the first tensor.
inline void read_checkpoint_header(FILE* fp, const char* path, Llama3Config* config, int* dtype) {
    int32_t h[CHECKPOINT_HEADER_SLOTS];
    int64_t size = file_size_bytes(fp);
    if (size < (int64_t)sizeof(h)) {
        fprintf(stderr, "Error: checkpoint '%s' is %lld bytes, shorter than its %zu-byte header (truncated?)\n", path,
                (long long)size, sizeof(h));
        fail_exit();
    }
    freadCheck(h, sizeof(int32_t), CHECKPOINT_HEADER_SLOTS, fp, "checkpoint header");
    if (h[0] != CHECKPOINT_MAGIC) {
        fprintf(stderr, "Error: '%s' is not a Llama 3 checkpoint: magic %d, expected %d\n", path, h[0],
                CHECKPOINT_MAGIC);
        fail_exit();
    }
    if (h[1] != CHECKPOINT_VERSION) {
        fprintf(stderr, "Error: checkpoint '%s' has version %d, this build reads version %d\n", path, h[1],
                CHECKPOINT_VERSION);
        fail_exit();
    }
    if (h[2] != DTYPE_FP32 && h[2] != DTYPE_BF16) {
        fprintf(stderr, "Error: checkpoint '%s' has dtype %d, expected 0 (fp32) or 1 (bf16)\n", path, h[2]);
        fail_exit();
    }
    for (int i = 18; i < CHECKPOINT_HEADER_SLOTS; i++) {
        if (h[i] != 0) {
            fprintf(stderr, "Error: checkpoint '%s' header slot %d is %d, expected 0 (reserved)\n", path, i, h[i]);
            fail_exit();
        }
    }
    Llama3Config c;
    c.vocab_size = h[3]; c.dim = h[4]; c.n_layers = h[5]; c.n_heads = h[6]; c.n_kv_heads = h[7];
    c.ffn_hidden = h[8]; c.max_seq_len = h[9]; c.tied_embeddings = h[10]; c.use_rope_scaling = h[11];
    c.rope_original_max_seq_len = h[12];
    memcpy(&c.norm_eps, &h[13], 4);
    memcpy(&c.rope_theta, &h[14], 4);
    memcpy(&c.rope_scaling_factor, &h[15], 4);
    memcpy(&c.rope_low_freq_factor, &h[16], 4);
    memcpy(&c.rope_high_freq_factor, &h[17], 4);
    std::string err = config_error(c);
    if (!err.empty()) {
        fprintf(stderr, "Error: checkpoint '%s' has an invalid config: %s\n", path, err.c_str());
        fail_exit();
    }
    size_t bytes_per = h[2] == DTYPE_FP32 ? 4 : 2;
    int64_t expected = (int64_t)sizeof(h) + (int64_t)(param_layout(c).total * bytes_per);
    if (size != expected) {
        fprintf(stderr,
                "Error: checkpoint '%s' is %lld bytes, but its header (%s, V=%d C=%d L=%d H=%d KV=%d F=%d tied=%d) "
                "implies %lld bytes\n",
                path, (long long)size, h[2] == DTYPE_FP32 ? "fp32" : "bf16", c.vocab_size, c.dim, c.n_layers,
                c.n_heads, c.n_kv_heads, c.ffn_hidden, c.tied_embeddings, (long long)expected);
        fail_exit();
    }
    *config = c;
    *dtype = h[2];
}

// bf16 <-> fp32 on the host. Conversion rounds to nearest even, as torch does.
inline float bf16_bits_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline uint16_t float_to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

// Where the first NaN or Inf of a flat buffer in checkpoint order is (parameters, master weights or AdamW
// moments): false if every value is finite, else the tensor's name, the element's index within it and its value.
struct NonFinite {
    const char* tensor;
    size_t index;
    float value;
};
inline bool find_non_finite(const float* values, const Llama3Config& c, NonFinite* found) {
    ParamLayout layout = param_layout(c);
    size_t offset = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        for (size_t i = 0; i < layout.sizes[t]; i++) {
            if (!std::isfinite(values[offset + i])) {
                *found = {layout.names[t], i, values[offset + i]};
                return true;
            }
        }
        offset += layout.sizes[t];
    }
    return false;
}

// Loads every parameter of a checkpoint into fp32 host memory (converting from bf16 if needed). A NaN or Inf in
// it is an error naming the tensor: training from it would only produce NaN.
inline std::vector<float> load_checkpoint_fp32(const char* path, Llama3Config* config) {
    FILE* fp = fopenCheck(path, "rb");
    int dtype;
    read_checkpoint_header(fp, path, config, &dtype);
    size_t n = param_layout(*config).total;
    std::vector<float> params(n);
    if (dtype == DTYPE_FP32) {
        freadCheck(params.data(), sizeof(float), n, fp, "checkpoint parameters");
    } else {
        std::vector<uint16_t> raw(n);
        freadCheck(raw.data(), sizeof(uint16_t), n, fp, "checkpoint parameters");
        for (size_t i = 0; i < n; i++) params[i] = bf16_bits_to_float(raw[i]);
    }
    fcloseCheck(fp);
    NonFinite bad;
    if (find_non_finite(params.data(), *config, &bad)) {
        fprintf(stderr, "Error: checkpoint '%s': tensor %s holds a non-finite value (%g) at element %zu\n", path,
                bad.tensor, bad.value, bad.index);
        fail_exit();
    }
    return params;
}

// Writes a checkpoint atomically from fp32 host parameters, as fp32 or bf16. Parameters holding a NaN or Inf are
// an error (nothing is written): such a file could never be loaded, and it would replace a good one.
inline void save_checkpoint_fp32(const char* path, const Llama3Config& config, const float* params, int dtype) {
    NonFinite bad;
    if (find_non_finite(params, config, &bad)) {
        fprintf(stderr, "Error: not writing checkpoint '%s': tensor %s holds a non-finite value (%g) at element %zu\n",
                path, bad.tensor, bad.value, bad.index);
        fail_exit();
    }
    int32_t header[CHECKPOINT_HEADER_SLOTS];
    config_to_header(config, dtype, header);
    size_t n = param_layout(config).total;
    AtomicFile out(path);
    fwriteCheck(header, sizeof(int32_t), CHECKPOINT_HEADER_SLOTS, out.fp, "checkpoint header");
    if (dtype == DTYPE_FP32) {
        fwriteCheck(params, sizeof(float), n, out.fp, "checkpoint parameters");
    } else {
        std::vector<uint16_t> raw(n);
        for (size_t i = 0; i < n; i++) raw[i] = float_to_bf16_bits(params[i]);
        fwriteCheck(raw.data(), sizeof(uint16_t), n, out.fp, "checkpoint parameters");
    }
    out.commit();
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
