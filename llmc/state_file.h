// The header of a training-state file (<run dir>/state_<step>.bin), and its checks. The trainer writes the rest.
//
// Header, 64 int32 (256 bytes):
//   [0] magic 20261123   [1] version 2   [2] step   [3] floatX of the build: bf16 (1) or fp32 (0)
//   [4..5] num_params (low, high 32 bits)   [6] has fp32 master weights (0/1)
//   [7] world size: the number of processes (GPUs) that trained the run
//   [8..9] run id (low, high 32 bits): the run it belongs to (llmc/run_dir.h)
//   [10..11] tokens per step (low, high 32 bits)
//   [12] ZeRO stage (llmc/multi_gpu.cuh)   [13] the rank that wrote this file
//   [14..15] optimizer elements in this file (low, high): num_params, or the rank's shard with stages 1 to 3
//   [16..30] the model config, as slots 3..17 of the model checkpoint header (llmc/checkpoint.h)
//   [31..63] zero
// Then the master weights (if present), AdamW m and v, each opt_count fp32 values; the train loader's state
// (llmc/dataloader.h; the same on every rank) and the sampler RNG (uint64; rank 0's is the one in use).
// A state is only ever loaded into the run that wrote it, at the step in the file's name: every field must match
// but the layout (world size, ZeRO stage, rank, optimizer elements), which llmc/reshard.h maps onto the resuming
// run's.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "checkpoint.h"
#include "dataloader.h"

constexpr int STATE_MAGIC = 20261123;
constexpr int STATE_VERSION = 2;
constexpr int STATE_HEADER_SLOTS = 64;
constexpr int64_t STATE_HEADER_BYTES = STATE_HEADER_SLOTS * sizeof(int32_t);
constexpr int STATE_CONFIG_SLOT = 16;  // the config's first slot; checkpoint header slots 3..17 go to 16..30
constexpr int STATE_CONFIG_SLOTS = 15;

struct StateHeader {
    int step = 0;
    int is_bf16 = 0;
    int has_master = 0;
    int world_size = 1;
    int zero_stage = 0;
    int rank = 0;
    uint64_t opt_count = 0;
    uint64_t num_params = 0;
    uint64_t run_id = 0;
    int64_t tokens_per_step = 0;
    int32_t config[STATE_CONFIG_SLOTS] = {0};  // checkpoint header slots 3..17
};

inline void state_config_slots(const Llama3Config& c, int32_t out[STATE_CONFIG_SLOTS]) {
    int32_t h[CHECKPOINT_HEADER_SLOTS];
    config_to_header(c, 0, h);
    memcpy(out, h + 3, STATE_CONFIG_SLOTS * sizeof(int32_t));
}

inline void state_header_pack(const StateHeader& s, int32_t h[STATE_HEADER_SLOTS]) {
    memset(h, 0, STATE_HEADER_SLOTS * sizeof(int32_t));
    h[0] = STATE_MAGIC;
    h[1] = STATE_VERSION;
    h[2] = s.step;
    h[3] = s.is_bf16;
    h[4] = (int32_t)(uint32_t)(s.num_params & 0xffffffffu);
    h[5] = (int32_t)(uint32_t)(s.num_params >> 32);
    h[6] = s.has_master;
    h[7] = s.world_size;
    h[8] = (int32_t)(uint32_t)(s.run_id & 0xffffffffu);
    h[9] = (int32_t)(uint32_t)(s.run_id >> 32);
    h[10] = (int32_t)(uint32_t)((uint64_t)s.tokens_per_step & 0xffffffffu);
    h[11] = (int32_t)(uint32_t)((uint64_t)s.tokens_per_step >> 32);
    h[12] = s.zero_stage;
    h[13] = s.rank;
    h[14] = (int32_t)(uint32_t)(s.opt_count & 0xffffffffu);
    h[15] = (int32_t)(uint32_t)(s.opt_count >> 32);
    memcpy(h + STATE_CONFIG_SLOT, s.config, sizeof(s.config));
}

// Unpacks a header read from `path`; returns "" or what is wrong with it (magic, version, reserved slots).
inline std::string state_header_unpack(const int32_t h[STATE_HEADER_SLOTS], const std::string& path, StateHeader* s) {
    char buf[400];
    if (h[0] != STATE_MAGIC) {
        snprintf(buf, sizeof(buf), "'%s' is not a training state: magic %d, expected %d", path.c_str(), h[0],
                 STATE_MAGIC);
        return buf;
    }
    if (h[1] != STATE_VERSION) {
        snprintf(buf, sizeof(buf), "training state '%s' has version %d, this build reads version %d", path.c_str(),
                 h[1], STATE_VERSION);
        return buf;
    }
    for (int i = 16; i < STATE_HEADER_SLOTS; i++) {
        bool config_slot = i >= STATE_CONFIG_SLOT && i < STATE_CONFIG_SLOT + STATE_CONFIG_SLOTS;
        if (!config_slot && h[i] != 0) {
            snprintf(buf, sizeof(buf), "training state '%s' header slot %d is %d, expected 0 (reserved)", path.c_str(),
                     i, h[i]);
            return buf;
        }
    }
    auto u64 = [&](int lo) { return (uint64_t)(uint32_t)h[lo] | ((uint64_t)(uint32_t)h[lo + 1] << 32); };
    s->step = h[2];
    s->is_bf16 = h[3];
    s->num_params = u64(4);
    s->has_master = h[6];
    s->world_size = h[7];
    s->run_id = u64(8);
    s->tokens_per_step = (int64_t)u64(10);
    s->zero_stage = h[12];
    s->rank = h[13];
    s->opt_count = u64(14);
    memcpy(s->config, h + STATE_CONFIG_SLOT, sizeof(s->config));
    return "";
}

// Reads and unpacks the header of the state file at `path`; returns "" or what is wrong (missing, short, bad).
inline std::string read_state_header(const std::string& path, StateHeader* s) {
    if (is_directory(path.c_str())) return "'" + path + "' is a directory, expected a training state file";
    FILE* fp = fopen(path.c_str(), "rb");
    if (fp == nullptr) return "could not open training state '" + path + "': " + strerror(errno);
    int32_t h[STATE_HEADER_SLOTS];
    size_t got = fread(h, sizeof(int32_t), STATE_HEADER_SLOTS, fp);
    fclose(fp);
    if (got != STATE_HEADER_SLOTS) return "training state '" + path + "' is shorter than its 256-byte header";
    return state_header_unpack(h, path, s);
}

// "" if `found` (read from path) is the state file `expected` describes: this run at step expected.step, and the
// layout expected of this file. Else a message naming the first field that differs, with both values.
inline std::string state_header_mismatch(const StateHeader& found, const StateHeader& expected,
                                         const std::string& path) {
    char buf[600];
    auto differs = [&](const char* what, long long got, long long want) {
        snprintf(buf, sizeof(buf), "training state '%s' does not belong to this run: %s is %lld, expected %lld",
                 path.c_str(), what, got, want);
        return std::string(buf);
    };
    auto precision = [](int is_bf16) { return is_bf16 ? "bf16" : "fp32"; };
    if (found.step != expected.step) {
        snprintf(buf, sizeof(buf), "training state '%s' holds step %d, but its name says step %d (renamed or corrupt)",
                 path.c_str(), found.step, expected.step);
        return buf;
    }
    if (found.run_id != expected.run_id) {
        snprintf(buf, sizeof(buf), "training state '%s' does not belong to this run: run id %016llx, expected %016llx "
                 "(run.txt)", path.c_str(), (unsigned long long)found.run_id, (unsigned long long)expected.run_id);
        return buf;
    }
    if (found.world_size != expected.world_size || found.zero_stage != expected.zero_stage ||
        found.rank != expected.rank) {
        snprintf(buf, sizeof(buf), "training state '%s' was written by rank %d of a run on %d GPU(s) with ZeRO stage "
                 "%d, but its checkpoint's rank 0 file says rank %d of %d GPU(s) with stage %d: the files are not one "
                 "checkpoint", path.c_str(), found.rank, found.world_size, found.zero_stage, expected.rank,
                 expected.world_size, expected.zero_stage);
        return buf;
    }
    if (found.is_bf16 != expected.is_bf16) {
        if (found.is_bf16 != 0 && found.is_bf16 != 1)
            return differs("the build's precision (1 bf16, 0 fp32)", found.is_bf16, expected.is_bf16);
        snprintf(buf, sizeof(buf), "training state '%s' was written by the %s build, this is the %s build: the "
                 "parameters' precision does not carry over; resume with the %s build (make PRECISION=%s)",
                 path.c_str(), precision(found.is_bf16), precision(expected.is_bf16), precision(found.is_bf16),
                 found.is_bf16 ? "BF16" : "FP32");
        return buf;
    }
    if (found.has_master != expected.has_master) {
        snprintf(buf, sizeof(buf), "training state '%s' %s fp32 master weights, but this run keeps %s (-W %d): resume "
                 "with -W %d", path.c_str(), found.has_master ? "holds" : "holds no", expected.has_master ? "them" :
                 "none", expected.has_master, found.has_master ? 1 : 0);
        return buf;
    }
    if (found.num_params != expected.num_params)
        return differs("the parameter count", (long long)found.num_params, (long long)expected.num_params);
    if (found.tokens_per_step != expected.tokens_per_step) {
        snprintf(buf, sizeof(buf), "training state '%s' belongs to a run of %lld tokens per step, but this run has "
                 "%lld (-b x -t x GPUs x accumulation): give -g %lld to continue it (tokens per step (-g) must stay "
                 "the same)", path.c_str(), (long long)found.tokens_per_step, (long long)expected.tokens_per_step,
                 (long long)found.tokens_per_step);
        return buf;
    }
    for (int i = 0; i < STATE_CONFIG_SLOTS; i++) {
        if (found.config[i] != expected.config[i]) {
            snprintf(buf, sizeof(buf), "training state '%s' does not belong to this model: config slot %d is %d, the "
                     "model's is %d", path.c_str(), i + 3, found.config[i], expected.config[i]);
            return buf;
        }
    }
    if (found.opt_count != expected.opt_count)
        return differs("the optimizer elements", (long long)found.opt_count, (long long)expected.opt_count);
    return "";
}

// The exact size of a state file holding opt_count optimizer elements.
inline int64_t state_file_bytes(uint64_t opt_count, bool has_master) {
    return STATE_HEADER_BYTES + (int64_t)(has_master ? 3 : 2) * (int64_t)opt_count * 4 +
           (int64_t)sizeof(DataLoaderState) + (int64_t)sizeof(uint64_t);
}

// Checks a state file as strictly as a checkpoint: its header, that it is the file `expected` describes
// (state_header_mismatch) and its exact size. Returns "" or what is wrong, naming the file.
inline std::string check_state_file(const std::string& path, const StateHeader& expected) {
    StateHeader found;
    std::string err = read_state_header(path, &found);
    if (err.empty()) err = state_header_mismatch(found, expected, path);
    if (!err.empty()) return err;
    struct stat st = {};
    int64_t want = state_file_bytes(expected.opt_count, expected.has_master);
    if (stat(path.c_str(), &st) != 0 || (int64_t)st.st_size != want) {
        char buf[400];
        snprintf(buf, sizeof(buf), "training state '%s' is %lld bytes, but its header implies %lld (truncated or "
                 "corrupt)", path.c_str(), (long long)st.st_size, (long long)want);
        return buf;
    }
    return "";
}
