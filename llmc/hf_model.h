// Hugging Face Llama directories in and out: reads config.json and the safetensors weights into our fp32 flat
// layout (llmc/checkpoint.h), and writes our parameters back as a directory transformers loads. The same mapping
// as scripts/convert_hf.py, which also handles Meta's .pth layout and the tokenizer files.
//
// A HF directory: config.json (LlamaConfig), and model.safetensors or shards named in model.safetensors.index.json
// ({"weight_map": {tensor name: shard file}}). A safetensors file: 8-byte little-endian header length n, n bytes of
// JSON {name: {"dtype": F32|BF16|F16, "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}, then the
// data, offsets counted from the end of the header.
//
// Tensors per layer i (prefix model.layers.i.): input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
// mlp.{gate,up,down}_proj (all ".weight", Linear weights (out, in)); plus model.embed_tokens, model.norm and,
// untied, lm_head. q_proj and k_proj rows are permuted for HF's rotate-half RoPE: row p * hd/2 + i of a head holds
// our row 2i + p (p = 0, 1, the interleaved pair our RoPE rotates). Loading undoes it and fuses q|k|v into wqkv and
// gate|up into w13; saving splits and permutes back.
//
// Every problem (missing shard, a shard that disagrees with the index, truncated file, offsets past the end,
// unsupported dtype or config field) exits with a message naming the file and the field.
#pragma once

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "utils.h"

using hf_json = nlohmann::ordered_json;

[[noreturn]] inline void hf_fail(const std::string& where, const std::string& what) {
    fprintf(stderr, "Error: %s: %s\n", where.c_str(), what.c_str());
    fail_exit();
}

inline bool is_regular_file(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

inline hf_json read_json_file(const std::string& path) {
    if (!is_regular_file(path)) hf_fail(path, "file not found");
    std::ifstream in(path);
    hf_json j = hf_json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.is_object()) hf_fail(path, "not a JSON object");
    return j;
}

// ---------------------------------------------------------------------------------------------------------------
// config.json -> Llama3Config

inline int hf_int(const hf_json& j, const char* key, const std::string& where) {
    if (!j.contains(key)) hf_fail(where, std::string("missing field '") + key + "'");
    const hf_json& v = j[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 30))
        hf_fail(where, std::string("field '") + key + "' = " + v.dump() + " is not an integer in [0, 2^30]");
    return v.get<int>();
}

inline float hf_float(const hf_json& j, const char* key, float fallback, const std::string& where) {
    if (!j.contains(key)) return fallback;
    if (!j[key].is_number()) hf_fail(where, std::string("field '") + key + "' = " + j[key].dump() + " is not a number");
    return j[key].get<float>();
}

// A field that must hold one of the allowed values (absent counts as `fallback`).
inline void hf_require(const hf_json& j, const char* key, const std::vector<hf_json>& allowed, const hf_json& fallback,
                       const std::string& where) {
    hf_json v = j.contains(key) ? j[key] : fallback;
    for (const hf_json& a : allowed)
        if (v == a) return;
    hf_fail(where, std::string(key) + " = " + v.dump() + " is not supported (only " + hf_json(allowed).dump() + ")");
}

inline Llama3Config hf_config_from_json(const hf_json& j, const std::string& where) {
    hf_require(j, "model_type", {"llama"}, nullptr, where);
    if (j.contains("architectures") && j["architectures"] != hf_json::array({"LlamaForCausalLM"}))
        hf_fail(where, "architectures = " + j["architectures"].dump() + " is not supported (only [\"LlamaForCausalLM\"])");
    hf_require(j, "hidden_act", {"silu"}, "silu", where);
    hf_require(j, "attention_bias", {false}, false, where);
    hf_require(j, "mlp_bias", {false}, false, where);
    hf_require(j, "pretraining_tp", {1}, 1, where);
    hf_require(j, "attention_dropout", {0, 0.0}, 0.0, where);
    hf_require(j, "quantization_config", {nullptr}, nullptr, where);
    static const std::set<std::string> read = {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "max_position_embeddings", "head_dim", "tie_word_embeddings", "rms_norm_eps",
        "rope_theta", "rope_scaling", "rope_parameters", "hidden_act", "attention_bias", "mlp_bias", "pretraining_tp",
        "attention_dropout", "quantization_config"};
    // fields that do not change the computation (generation defaults, bookkeeping); the same list as convert_hf.py
    static const std::set<std::string> ignored = {
        "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
        "transformers_version", "use_cache", "initializer_range", "_name_or_path", "output_attentions",
        "output_hidden_states", "return_dict", "tokenizer_class", "id2label", "label2id", "torchscript",
        "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
        "problem_type", "task_specific_params", "prefix", "sep_token_id", "decoder_start_token_id", "finetuning_task"};
    for (auto it = j.begin(); it != j.end(); ++it) {
        if (!read.count(it.key()) && !ignored.count(it.key()))
            hf_fail(where, "unknown field '" + it.key() + "' (not a LlamaConfig field this loader knows)");
    }

    Llama3Config c;
    c.vocab_size = hf_int(j, "vocab_size", where);
    c.dim = hf_int(j, "hidden_size", where);
    c.n_layers = hf_int(j, "num_hidden_layers", where);
    c.n_heads = hf_int(j, "num_attention_heads", where);
    c.n_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                       ? hf_int(j, "num_key_value_heads", where) : c.n_heads;
    c.ffn_hidden = hf_int(j, "intermediate_size", where);
    c.max_seq_len = hf_int(j, "max_position_embeddings", where);
    if (j.contains("head_dim") && !j["head_dim"].is_null()) {
        int hd = hf_int(j, "head_dim", where);
        if (c.n_heads < 1 || hd * c.n_heads != c.dim)
            hf_fail(where, "head_dim = " + std::to_string(hd) + " is not hidden_size / num_attention_heads = " +
                               std::to_string(c.dim) + " / " + std::to_string(c.n_heads));
    }
    hf_json tied = j.contains("tie_word_embeddings") ? j["tie_word_embeddings"] : hf_json(false);
    if (!tied.is_boolean()) hf_fail(where, "tie_word_embeddings = " + tied.dump() + " is not true or false");
    c.tied_embeddings = tied.get<bool>() ? 1 : 0;
    c.norm_eps = hf_float(j, "rms_norm_eps", 1e-6f, where);

    // transformers 4.x writes rope_theta and rope_scaling; 5.x one rope_parameters block with rope_theta inside
    bool v5 = j.contains("rope_parameters") && !j["rope_parameters"].is_null();
    std::string rope_key = v5 ? "rope_parameters" : "rope_scaling";
    hf_json rope = j.contains(rope_key) && !j[rope_key].is_null() ? j[rope_key] : hf_json::object();
    if (!rope.is_object()) hf_fail(where, rope_key + " = " + rope.dump() + " is not an object");
    static const std::set<std::string> rope_fields = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                                                      "high_freq_factor", "original_max_position_embeddings"};
    for (auto it = rope.begin(); it != rope.end(); ++it) {
        if (!rope_fields.count(it.key())) hf_fail(where, rope_key + "." + it.key() + " is not supported");
    }
    c.rope_theta = hf_float(rope, "rope_theta", hf_float(j, "rope_theta", 10000.0f, where), where);
    hf_json type = rope.contains("rope_type") ? rope["rope_type"] : rope.contains("type") ? rope["type"] : "default";
    if (type == "llama3") {
        for (const char* key : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
            if (!rope.contains(key)) hf_fail(where, rope_key + " has rope_type llama3 but no '" + key + "'");
        }
        c.use_rope_scaling = 1;
        c.rope_scaling_factor = hf_float(rope, "factor", 0.0f, where);
        c.rope_low_freq_factor = hf_float(rope, "low_freq_factor", 0.0f, where);
        c.rope_high_freq_factor = hf_float(rope, "high_freq_factor", 0.0f, where);
        c.rope_original_max_seq_len = hf_int(rope, "original_max_position_embeddings", where);
    } else if (type == "default") {
        c.use_rope_scaling = 0;
        c.rope_scaling_factor = 1.0f;
        c.rope_low_freq_factor = 1.0f;
        c.rope_high_freq_factor = 4.0f;
        c.rope_original_max_seq_len = 0;
    } else {
        hf_fail(where, rope_key + ".rope_type = " + type.dump() + " is not supported (only \"default\" and \"llama3\")");
    }
    std::string err = config_error(c);
    if (!err.empty()) hf_fail(where, "unsupported config: " + err);
    return c;
}

// ---------------------------------------------------------------------------------------------------------------
// safetensors

struct SafetensorsTensor {
    std::string file, dtype;
    std::vector<int64_t> shape;
    int64_t offset = 0, nbytes = 0;  // absolute position in the file
};

inline int safetensors_dtype_bytes(const std::string& dtype) {
    return dtype == "F32" ? 4 : (dtype == "BF16" || dtype == "F16") ? 2 : 0;
}

// Reads and validates a safetensors header against the file's size.
inline std::map<std::string, SafetensorsTensor> read_safetensors_header(const std::string& path) {
    if (!is_regular_file(path)) hf_fail(path, "file not found");
    FILE* fp = fopenCheck(path.c_str(), "rb");
    int64_t size = file_size_bytes(fp);
    uint64_t header_len = 0;
    if (size < 8) hf_fail(path, std::to_string(size) + " bytes, too short for a safetensors header (truncated?)");
    freadCheck(&header_len, 8, 1, fp, "safetensors header length");
    if (header_len > (uint64_t)(size - 8))
        hf_fail(path, "header length " + std::to_string(header_len) + " runs past the end of the " +
                          std::to_string(size) + "-byte file (truncated?)");
    std::string text(header_len, '\0');
    freadCheck(text.data(), 1, header_len, fp, "safetensors header");
    fcloseCheck(fp);
    hf_json header = hf_json::parse(text, nullptr, false);
    if (header.is_discarded() || !header.is_object()) hf_fail(path, "the header is not a JSON object");
    int64_t data_start = 8 + (int64_t)header_len, data_bytes = size - data_start;
    std::map<std::string, SafetensorsTensor> tensors;
    for (auto it = header.begin(); it != header.end(); ++it) {
        const std::string& name = it.key();
        if (name == "__metadata__") continue;
        const hf_json& info = it.value();
        std::string field = "tensor '" + name + "'";
        bool ok = info.is_object() && info.contains("dtype") && info["dtype"].is_string() && info.contains("shape") &&
                  info["shape"].is_array() && info.contains("data_offsets") && info["data_offsets"].is_array() &&
                  info["data_offsets"].size() == 2 && info["data_offsets"][0].is_number_unsigned() &&
                  info["data_offsets"][1].is_number_unsigned();
        for (size_t d = 0; ok && d < info["shape"].size(); d++) ok = info["shape"][d].is_number_unsigned();
        if (!ok) hf_fail(path, field + " has a malformed header entry " + info.dump());
        SafetensorsTensor t;
        t.file = path;
        t.dtype = info["dtype"].get<std::string>();
        int bytes = safetensors_dtype_bytes(t.dtype);
        if (bytes == 0) hf_fail(path, field + " has dtype " + t.dtype + "; supported: F32, BF16, F16");
        int64_t numel = 1;
        for (const hf_json& d : info["shape"]) {
            t.shape.push_back(d.get<int64_t>());
            if (t.shape.back() > (int64_t)1 << 40 || (numel *= t.shape.back()) > (int64_t)1 << 40)
                hf_fail(path, field + " has an implausible shape " + info["shape"].dump());
        }
        uint64_t begin = info["data_offsets"][0].get<uint64_t>(), end = info["data_offsets"][1].get<uint64_t>();
        if (begin > end || end > (uint64_t)data_bytes)
            hf_fail(path, field + " data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                              "] overflow the file's " + std::to_string(data_bytes) + " data bytes (truncated?)");
        t.nbytes = numel * bytes;
        if ((int64_t)(end - begin) != t.nbytes)
            hf_fail(path, field + " data_offsets span " + std::to_string(end - begin) + " bytes, but shape " +
                              info["shape"].dump() + " in " + t.dtype + " needs " + std::to_string(t.nbytes));
        t.offset = data_start + (int64_t)begin;
        tensors[name] = t;
    }
    return tensors;
}

// Every tensor of a HF directory, single-file or sharded (the index and the shards must agree).
inline std::map<std::string, SafetensorsTensor> read_hf_weights(const std::string& dir) {
    std::string index_path = dir + "/model.safetensors.index.json", single = dir + "/model.safetensors";
    if (!is_regular_file(index_path)) {
        if (!is_regular_file(single)) hf_fail(dir, "no model.safetensors or model.safetensors.index.json");
        return read_safetensors_header(single);
    }
    hf_json index = read_json_file(index_path);
    if (!index.contains("weight_map") || !index["weight_map"].is_object())
        hf_fail(index_path, "no weight_map object");
    std::map<std::string, std::string> weight_map;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
        if (!it.value().is_string()) hf_fail(index_path, "weight_map entry '" + it.key() + "' is not a file name");
        std::string shard = it.value().get<std::string>();
        if (shard.find('/') != std::string::npos) hf_fail(index_path, "shard name '" + shard + "' has a '/'");
        weight_map[it.key()] = shard;
    }
    std::map<std::string, std::map<std::string, SafetensorsTensor>> shards;
    for (const auto& [name, shard] : weight_map) {
        if (shards.count(shard)) continue;
        std::string path = dir + "/" + shard;
        if (!is_regular_file(path)) hf_fail(index_path, "shard '" + shard + "' (holding " + name + ") is missing");
        shards[shard] = read_safetensors_header(path);
    }
    std::map<std::string, SafetensorsTensor> all;
    for (const auto& [name, shard] : weight_map) {
        auto found = shards[shard].find(name);
        if (found == shards[shard].end())
            hf_fail(dir + "/" + shard, "has no tensor '" + name + "', which " + index_path + " places there");
        all[name] = found->second;
    }
    for (const auto& [shard, tensors] : shards) {
        for (const auto& entry : tensors) {
            auto placed = weight_map.find(entry.first);
            if (placed == weight_map.end() || placed->second != shard)
                hf_fail(dir + "/" + shard, "holds tensor '" + entry.first + "', which " + index_path +
                                               " does not place in this shard");
        }
    }
    return all;
}

inline float half_bits_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000 | (mant << 13);  // inf, NaN
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do { e++; mant <<= 1; } while (!(mant & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// A tensor's values as fp32; exits if its shape is not `rows` x `cols` (cols 0: a vector of `rows`).
inline std::vector<float> read_hf_tensor(const std::map<std::string, SafetensorsTensor>& weights,
                                         const std::string& name, int64_t rows, int64_t cols) {
    auto it = weights.find(name);
    if (it == weights.end()) hf_fail(name, "tensor missing from the model's safetensors files");
    const SafetensorsTensor& t = it->second;
    std::vector<int64_t> want = cols > 0 ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows};
    if (t.shape != want)
        hf_fail(t.file, "tensor '" + name + "' has shape " + hf_json(t.shape).dump() + ", config.json implies " +
                            hf_json(want).dump());
    size_t n = (size_t)(t.nbytes / safetensors_dtype_bytes(t.dtype));
    std::vector<float> out(n);
    FILE* fp = fopenCheck(t.file.c_str(), "rb");
    fseekCheck(fp, t.offset, SEEK_SET);
    if (t.dtype == "F32") {
        freadCheck(out.data(), 4, n, fp, name.c_str());
    } else {
        std::vector<uint16_t> raw(n);
        freadCheck(raw.data(), 2, n, fp, name.c_str());
        for (size_t i = 0; i < n; i++) out[i] = t.dtype == "BF16" ? bf16_bits_to_float(raw[i]) : half_bits_to_float(raw[i]);
    }
    fcloseCheck(fp);
    return out;
}

// Row `r` of a head in HF's rotate-half order holds our (interleaved) row `hf_row_to_ours(r, hd)`.
inline int hf_row_to_ours(int r, int hd) {
    int half = hd / 2;
    return 2 * (r % half) + r / half;
}

// Loads a HF Llama directory into our fp32 flat layout (checkpoint order), as load_checkpoint_fp32 does for .bin.
inline std::vector<float> load_hf_model_fp32(const char* dir, Llama3Config* config) {
    std::string d = dir;
    Llama3Config c = hf_config_from_json(read_json_file(d + "/config.json"), d + "/config.json");
    std::map<std::string, SafetensorsTensor> weights = read_hf_weights(d);
    int64_t V = c.vocab_size, C = c.dim, F = c.ffn_hidden, H = c.n_heads, KV = c.n_kv_heads, hd = c.head_dim();
    std::set<std::string> expected = {"model.embed_tokens.weight", "model.norm.weight"};
    if (!c.tied_embeddings) expected.insert("lm_head.weight");
    const char* layer_tensors[] = {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                   "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                                   "mlp.down_proj"};
    for (int l = 0; l < c.n_layers; l++) {
        for (const char* t : layer_tensors) expected.insert("model.layers." + std::to_string(l) + "." + t + ".weight");
    }
    for (const auto& [name, t] : weights) {
        bool tolerated = (name == "lm_head.weight" && c.tied_embeddings) ||  // checked below
                         (name.size() > 19 && name.compare(name.size() - 19, 19, "rotary_emb.inv_freq") == 0);
        if (expected.count(name) || tolerated) continue;
        bool bias = name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
        hf_fail(t.file, "tensor '" + name + "' is " + (bias ? "a bias, which Llama 3 does not have" : "not a Llama 3 tensor"));
    }
    for (const std::string& name : expected) {
        if (!weights.count(name))
            hf_fail(d, "tensor '" + name + "' is missing (config.json: num_hidden_layers " + std::to_string(c.n_layers) +
                           ", tie_word_embeddings " + (c.tied_embeddings ? "true" : "false") + ")");
    }

    std::vector<float> params(param_layout(c).total);
    ParamTensors<float> p = point_params(params.data(), c);
    auto copy = [](const std::vector<float>& src, float* dst) { memcpy(dst, src.data(), src.size() * sizeof(float)); };
    // q or k rows of `heads` heads, from HF's order to ours
    auto copy_rope_rows = [&](const std::vector<float>& src, int heads, float* dst) {
        for (int h = 0; h < heads; h++)
            for (int r = 0; r < hd; r++)
                memcpy(dst + ((size_t)h * hd + hf_row_to_ours(r, (int)hd)) * C, src.data() + ((size_t)h * hd + r) * C,
                       C * sizeof(float));
    };
    copy(read_hf_tensor(weights, "model.embed_tokens.weight", V, C), p.tok_embedding);
    for (int l = 0; l < c.n_layers; l++) {
        std::string pre = "model.layers." + std::to_string(l) + ".";
        float* wqkv = p.wqkv + (size_t)l * c.qkv_dim() * C;
        float* w13 = p.w13 + (size_t)l * 2 * F * C;
        copy(read_hf_tensor(weights, pre + "input_layernorm.weight", C, 0), p.attn_norm + l * C);
        copy_rope_rows(read_hf_tensor(weights, pre + "self_attn.q_proj.weight", H * hd, C), (int)H, wqkv);
        copy_rope_rows(read_hf_tensor(weights, pre + "self_attn.k_proj.weight", KV * hd, C), (int)KV, wqkv + H * hd * C);
        copy(read_hf_tensor(weights, pre + "self_attn.v_proj.weight", KV * hd, C), wqkv + (H + KV) * hd * C);
        copy(read_hf_tensor(weights, pre + "self_attn.o_proj.weight", C, H * hd), p.wo + (size_t)l * C * H * hd);
        copy(read_hf_tensor(weights, pre + "post_attention_layernorm.weight", C, 0), p.ffn_norm + l * C);
        copy(read_hf_tensor(weights, pre + "mlp.gate_proj.weight", F, C), w13);
        copy(read_hf_tensor(weights, pre + "mlp.up_proj.weight", F, C), w13 + F * C);
        copy(read_hf_tensor(weights, pre + "mlp.down_proj.weight", C, F), p.w2 + (size_t)l * C * F);
    }
    copy(read_hf_tensor(weights, "model.norm.weight", C, 0), p.final_norm);
    if (!c.tied_embeddings) {
        copy(read_hf_tensor(weights, "lm_head.weight", V, C), p.lm_head);
    } else if (weights.count("lm_head.weight")) {
        std::vector<float> head = read_hf_tensor(weights, "lm_head.weight", V, C);
        if (memcmp(head.data(), p.tok_embedding, head.size() * sizeof(float)) != 0)
            hf_fail(weights["lm_head.weight"].file, "tie_word_embeddings is true in config.json but lm_head.weight "
                                                    "differs from model.embed_tokens.weight");
    }
    *config = c;
    return params;
}

// Our checkpoint (.bin) or a HF directory, into fp32 host memory.
inline std::vector<float> load_model_fp32(const char* path, Llama3Config* config) {
    return is_directory(path) ? load_hf_model_fp32(path, config) : load_checkpoint_fp32(path, config);
}

// ---------------------------------------------------------------------------------------------------------------
// Saving: our parameters -> a HF directory (config.json, generation_config.json, safetensors). The files are
// byte-identical to `scripts/convert_hf.py export` of the same model (dev/test/test_hf.py checks it).

// The shortest decimal that reads back as the same float32 (1e-05, not 9.999999747378752e-06), as a double.
inline double short_float(float f) {
    char buf[32];
    for (int digits = 1; digits <= 9; digits++) {
        snprintf(buf, sizeof(buf), "%.*g", digits, (double)f);
        if (strtof(buf, nullptr) == f) break;
    }
    return strtod(buf, nullptr);
}

constexpr int LLAMA3_VOCAB_SIZE = 128256;

inline hf_json hf_config_json(const Llama3Config& c, int dtype) {
    hf_json rope_scaling = nullptr;
    if (c.use_rope_scaling) {
        rope_scaling = {{"rope_type", "llama3"}, {"factor", short_float(c.rope_scaling_factor)},
                        {"low_freq_factor", short_float(c.rope_low_freq_factor)},
                        {"high_freq_factor", short_float(c.rope_high_freq_factor)},
                        {"original_max_position_embeddings", c.rope_original_max_seq_len}};
    }
    hf_json j = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", c.vocab_size},
                 {"hidden_size", c.dim}, {"intermediate_size", c.ffn_hidden}, {"num_hidden_layers", c.n_layers},
                 {"num_attention_heads", c.n_heads}, {"num_key_value_heads", c.n_kv_heads}, {"head_dim", c.head_dim()},
                 {"hidden_act", "silu"}, {"max_position_embeddings", c.max_seq_len},
                 {"rms_norm_eps", short_float(c.norm_eps)}, {"rope_theta", short_float(c.rope_theta)},
                 {"rope_scaling", rope_scaling}, {"tie_word_embeddings", c.tied_embeddings == 1},
                 {"attention_bias", false}, {"attention_dropout", 0.0}, {"mlp_bias", false}, {"pretraining_tp", 1},
                 {"initializer_range", 0.02}, {"use_cache", true},
                 {"torch_dtype", dtype == DTYPE_FP32 ? "float32" : "bfloat16"},
                 // the config format of Meta's Llama 3.2 release; transformers 5 reads the field, and without it some
                 // versions warn that the tokenizer next to it might have Mistral's broken regex
                 {"transformers_version", "4.45.0"}};
    if (c.vocab_size >= LLAMA3_VOCAB_SIZE) {  // the Llama 3 special tokens exist
        j["bos_token_id"] = 128000;
        j["eos_token_id"] = {128001, 128008, 128009};
    }
    return j;
}

inline hf_json hf_generation_config_json(const Llama3Config& c) {
    hf_json j = {{"_from_model_config", false}, {"do_sample", true}, {"temperature", 0.6}, {"top_p", 0.9}};
    if (c.vocab_size >= LLAMA3_VOCAB_SIZE) {
        j["bos_token_id"] = 128000;
        j["eos_token_id"] = {128001, 128008, 128009};
    }
    return j;
}

inline void write_json_file(const std::string& path, const hf_json& j) {
    std::string text = j.dump(2) + "\n";
    AtomicFile out(path);
    fwriteCheck(text.data(), 1, text.size(), out.fp, path.c_str());
    out.commit();
}

// One HF tensor taken from our flat parameters: rows [row0, row0 + rows) of a (.., cols) block at `src`,
// permuted to HF's rotate-half order when `rope_heads` > 0.
struct HfOutTensor {
    std::string name;
    std::vector<int64_t> shape;
    const float* src;
    int rope_heads;
};

inline std::vector<HfOutTensor> hf_out_tensors(const Llama3Config& c, const float* params) {
    ParamTensors<const float> p = point_params(params, c);
    int64_t V = c.vocab_size, C = c.dim, F = c.ffn_hidden, H = c.n_heads, KV = c.n_kv_heads, hd = c.head_dim();
    std::vector<HfOutTensor> out = {{"model.embed_tokens.weight", {V, C}, p.tok_embedding, 0}};
    for (int l = 0; l < c.n_layers; l++) {
        std::string pre = "model.layers." + std::to_string(l) + ".";
        const float* wqkv = p.wqkv + (size_t)l * c.qkv_dim() * C;
        const float* w13 = p.w13 + (size_t)l * 2 * F * C;
        out.push_back({pre + "input_layernorm.weight", {C}, p.attn_norm + l * C, 0});
        out.push_back({pre + "self_attn.q_proj.weight", {H * hd, C}, wqkv, (int)H});
        out.push_back({pre + "self_attn.k_proj.weight", {KV * hd, C}, wqkv + H * hd * C, (int)KV});
        out.push_back({pre + "self_attn.v_proj.weight", {KV * hd, C}, wqkv + (H + KV) * hd * C, 0});
        out.push_back({pre + "self_attn.o_proj.weight", {C, H * hd}, p.wo + (size_t)l * C * H * hd, 0});
        out.push_back({pre + "post_attention_layernorm.weight", {C}, p.ffn_norm + l * C, 0});
        out.push_back({pre + "mlp.gate_proj.weight", {F, C}, w13, 0});
        out.push_back({pre + "mlp.up_proj.weight", {F, C}, w13 + F * C, 0});
        out.push_back({pre + "mlp.down_proj.weight", {C, F}, p.w2 + (size_t)l * C * F, 0});
    }
    out.push_back({"model.norm.weight", {C}, p.final_norm, 0});
    if (!c.tied_embeddings) out.push_back({"lm_head.weight", {V, C}, p.lm_head, 0});
    return out;
}

inline int64_t hf_numel(const HfOutTensor& t) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    return n;
}

// Writes the tensors sorted by name, as transformers' save_pretrained does.
inline void write_safetensors(const std::string& path, std::vector<HfOutTensor> tensors, int dtype) {
    std::sort(tensors.begin(), tensors.end(), [](const HfOutTensor& a, const HfOutTensor& b) { return a.name < b.name; });
    int bytes = dtype == DTYPE_FP32 ? 4 : 2;
    hf_json header = {{"__metadata__", {{"format", "pt"}}}};
    int64_t offset = 0;
    for (const HfOutTensor& t : tensors) {
        int64_t n = hf_numel(t) * bytes;
        header[t.name] = {{"dtype", dtype == DTYPE_FP32 ? "F32" : "BF16"}, {"shape", t.shape},
                          {"data_offsets", {offset, offset + n}}};
        offset += n;
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
    uint64_t len = text.size();
    AtomicFile out(path);
    fwriteCheck(&len, 8, 1, out.fp, "safetensors header length");
    fwriteCheck(text.data(), 1, text.size(), out.fp, "safetensors header");
    for (const HfOutTensor& t : tensors) {
        int64_t n = hf_numel(t), cols = t.shape.size() == 2 ? t.shape[1] : n;
        std::vector<float> values(t.src, t.src + n);
        if (t.rope_heads > 0) {
            int64_t hd = t.shape[0] / t.rope_heads;
            for (int64_t h = 0; h < t.rope_heads; h++)
                for (int64_t r = 0; r < hd; r++)
                    memcpy(values.data() + (h * hd + r) * cols, t.src + (h * hd + hf_row_to_ours((int)r, (int)hd)) * cols,
                           cols * sizeof(float));
        }
        if (dtype == DTYPE_FP32) {
            fwriteCheck(values.data(), 4, n, out.fp, t.name.c_str());
        } else {
            std::vector<uint16_t> raw(n);
            for (int64_t i = 0; i < n; i++) raw[i] = float_to_bf16_bits(values[i]);
            fwriteCheck(raw.data(), 2, n, out.fp, t.name.c_str());
        }
    }
    out.commit();
}

constexpr int64_t HF_MAX_SHARD_BYTES = 5000000000;  // 5 GB, as transformers' save_pretrained

// Writes `params` (fp32, checkpoint order) as a HF directory in fp32 or bf16, sharded above max_shard_bytes.
inline void save_hf_model(const std::string& dir, const Llama3Config& c, const float* params, int dtype,
                          int64_t max_shard_bytes = HF_MAX_SHARD_BYTES) {
    if (!make_dirs(dir)) hf_fail(dir, std::string("could not create the directory: ") + strerror(errno));
    int bytes = dtype == DTYPE_FP32 ? 4 : 2;
    std::vector<std::vector<HfOutTensor>> shards(1);
    int64_t size = 0, total = 0;
    for (const HfOutTensor& t : hf_out_tensors(c, params)) {  // greedy, in order
        int64_t n = hf_numel(t) * bytes;
        if (!shards.back().empty() && size + n > max_shard_bytes) {
            shards.emplace_back();
            size = 0;
        }
        shards.back().push_back(t);
        size += n;
        total += n;
    }
    DIR* listing = opendir(dir.c_str());  // shards of an earlier export would confuse loaders
    if (listing == nullptr) hf_fail(dir, std::string("could not list: ") + strerror(errno));
    std::regex stale("model(-[0-9]+-of-[0-9]+)?\\.safetensors(\\.index\\.json)?");
    std::vector<std::string> to_remove;
    for (struct dirent* e = readdir(listing); e != nullptr; e = readdir(listing)) {
        if (std::regex_match(e->d_name, stale)) to_remove.push_back(dir + "/" + e->d_name);
    }
    closedir(listing);
    for (const std::string& path : to_remove) remove(path.c_str());
    if (shards.size() == 1) {
        write_safetensors(dir + "/model.safetensors", shards[0], dtype);
    } else {
        hf_json weight_map = hf_json::object();
        for (size_t k = 0; k < shards.size(); k++) {
            char file[64];
            snprintf(file, sizeof(file), "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
            write_safetensors(dir + "/" + file, shards[k], dtype);
            for (const HfOutTensor& t : shards[k]) weight_map[t.name] = file;
        }
        write_json_file(dir + "/model.safetensors.index.json",
                        {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
    }
    write_json_file(dir + "/config.json", hf_config_json(c, dtype));
    write_json_file(dir + "/generation_config.json", hf_generation_config_json(c));
}
