// Our checkpoint file format: reading and writing a Llama 3 model (its config and parameters) as a .bin file. The
// model itself (config, parameter tensors, layout) is llmc/model.h.
//
// File layout (all little-endian; README.md "Model checkpoint" describes the same):
//   header: 64 slots of 4 bytes (256 bytes)
//     [0] magic 20261121   [1] version 1   [2] dtype (0 = fp32, 1 = bf16)
//     [3] vocab_size  [4] dim  [5] n_layers  [6] n_heads  [7] n_kv_heads  [8] ffn_hidden  [9] max_seq_len
//     [10] tied_embeddings (0/1)  [11] use_rope_scaling (0/1)  [12] rope_original_max_seq_len
//     [13] norm_eps (float32)  [14] rope_theta (float32)  [15] rope_scaling_factor (float32)
//     [16] rope_low_freq_factor (float32)  [17] rope_high_freq_factor (float32)
//     [18..63] zero
//   then the tensors, back to back, in ParamTensor order (llmc/model.h; L layers, C dim, hd = dim / n_heads,
//   F ffn_hidden, QKV = (n_heads + 2 n_kv_heads) hd):
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

#include "model.h"
#include "utils.h"

constexpr int CHECKPOINT_MAGIC = 20261121;
constexpr int CHECKPOINT_VERSION = 1;
constexpr int CHECKPOINT_HEADER_SLOTS = 64;
enum CheckpointDtype { DTYPE_FP32 = 0, DTYPE_BF16 = 1 };

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
