// Resuming: where each rank's optimizer state comes from in a checkpoint's state files, written on any number of
// GPUs with any ZeRO stage (llmc/shard_layout.h), and reading it by ranges.
//
// Rank 0's state file says the checkpoint's layout (world size, ZeRO stage). Each rank reads rank 0's file (the
// train loader's state and the sampler RNG are there) and the files that hold its elements of the optimizer state,
// only the ranges of them it needs; it checks each of those files as strictly as a checkpoint first (header, this
// run's fields, the layout rank 0's file implies for it, exact size). An unchanged layout reads the rank's own file
// whole, as it was written: that resume stays bit for bit. A stage-0 checkpoint's files are copies of one another:
// a rank reads one of them. Stages 1, 2 and 3 write the same shards of the optimizer state: ZeRO-3's bf16 weights,
// sharded too while it trains, are in the model file, which rank 0 writes whole, and every layout reads them from
// there, so resharding treats stage 3 as stage 2.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "run_dir.h"
#include "shard_layout.h"
#include "state_file.h"

struct StateSource {
    StateLayout writer, reader;
    bool has_master = false;
    uint64_t writer_count = 0;         // optimizer elements per array in each of the checkpoint's files
    std::vector<std::string> paths;    // the checkpoint's state file of each writer rank
    std::vector<StateRange> ranges;    // this rank's elements, in its order

    // The file(s) this rank reads its optimizer state from, for messages.
    std::string name() const {
        std::set<int> ranks;
        for (const StateRange& r : ranges) ranks.insert(r.rank);
        if (ranks.size() == 1) return paths[*ranks.begin()];
        return paths[0] + " and its rank files (" + std::to_string(ranks.size()) + " files)";
    }
    // Where the train loader's state starts in rank 0's file.
    int64_t loader_offset() const { return STATE_HEADER_BYTES + (has_master ? 3 : 2) * (int64_t)writer_count * 4; }
};

// Plans this rank's read of the checkpoint at step expected.step in `dir` of the model `c`. `expected` describes the
// state this rank would write now (its layout is the reader's). Returns "" or the first problem, naming the file.
inline std::string plan_state_load(const std::string& dir, const Llama3Config& c, const StateHeader& expected,
                                   StateSource* out) {
    std::string first = state_path(dir, expected.step, 0);
    StateHeader h;
    std::string err = read_state_header(first, &h);
    if (!err.empty()) return err;
    if (h.world_size < 1 || h.world_size > 1 << 20 || h.zero_stage < 0 || h.zero_stage > 3 ||
        (h.world_size == 1 && h.zero_stage != 0)) {
        char buf[400];
        snprintf(buf, sizeof(buf), "training state '%s' says it was written on %d GPU(s) with ZeRO stage %d: not a "
                 "layout this build writes (corrupt)", first.c_str(), h.world_size, h.zero_stage);
        return buf;
    }
    StateSource s;
    s.writer = {h.world_size, h.zero_stage};
    s.reader = {expected.world_size, expected.zero_stage};
    s.has_master = expected.has_master;
    s.writer_count = s.writer.sharded() ? expected.num_params / s.writer.world : expected.num_params;
    err = reshard_ranges(c, s.writer, s.reader, expected.rank, &s.ranges);
    if (!err.empty()) return "resuming the checkpoint at step " + std::to_string(expected.step) + ": " + err;
    std::vector<bool> reads(s.writer.world, false);
    reads[0] = true;  // the loader state and the sampler RNG
    for (const StateRange& r : s.ranges) reads[r.rank] = true;
    for (int w = 0; w < s.writer.world; w++) {
        s.paths.push_back(state_path(dir, expected.step, w));
        if (!reads[w]) continue;
        const std::string& path = s.paths.back();
        struct stat st;
        if (stat(path.c_str(), &st) != 0) {
            char buf[600];
            snprintf(buf, sizeof(buf), "the checkpoint at step %d in '%s' was written on %d GPU(s) with ZeRO stage "
                     "%d, but the state file of its rank %d, '%s', is missing: %s", expected.step, dir.c_str(),
                     s.writer.world, s.writer.stage, w, path.c_str(), strerror(errno));
            return buf;
        }
        StateHeader file = expected;
        file.world_size = s.writer.world;
        file.zero_stage = s.writer.stage;
        file.rank = w;
        file.opt_count = s.writer_count;
        err = check_state_file(path, file);
        if (!err.empty()) return err;
    }
    *out = s;
    return "";
}

// Reads array `array` of the checkpoint's files (0-based in file order: the master weights if present, m, v) for
// this rank into `values` (its optimizer elements, fp32), which the ranges must fill exactly.
inline void read_state_array(const StateSource& s, int array, std::vector<float>* values) {
    size_t filled = s.ranges.empty() ? 0 : s.ranges.back().dst + s.ranges.back().count;
    if (filled != values->size()) {
        fprintf(stderr, "Error: resuming from %s: its ranges hold %zu optimizer elements, this rank keeps %zu\n",
                s.name().c_str(), filled, values->size());
        fail_exit();
    }
    std::vector<FILE*> files(s.paths.size(), nullptr);
    for (const StateRange& r : s.ranges) {
        FILE*& fp = files[r.rank];
        if (fp == nullptr) fp = fopenCheck(s.paths[r.rank].c_str(), "rb");
        fseekCheck(fp, STATE_HEADER_BYTES + ((int64_t)array * (int64_t)s.writer_count + (int64_t)r.src) * 4, SEEK_SET);
        freadCheck(values->data() + r.dst, sizeof(float), r.count, fp, s.paths[r.rank].c_str());
    }
    for (FILE* fp : files) {
        if (fp != nullptr) fcloseCheck(fp);
    }
}
