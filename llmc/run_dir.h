// A run directory (-o) and the one run that owns it.
//
//   run.txt            "run_id <16 hex digits>\nsource <how the run began: -e <absolute path> or -c <name> -d <N>>\n"
//   log.txt            the step and validation lines
//   model_<step>.bin   the model at that step (llmc/checkpoint.h); step as 8 digits
//   state_<step>.bin   the rest of the training state at that step; its header holds the run id (llmc/state_file.h)
//
// A fresh run refuses a directory that holds checkpoints (model_* or state_* files) unless forced (-F 1); it then
// owns the directory: run.txt gets its new id. Resuming (-y 1) continues the run named in run.txt from its newest
// state file, and retention (-r) deletes only that run's files. Another run's checkpoints left in the directory by
// -F 1 are never resumed and never deleted.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "state_file.h"
#include "utils.h"

inline std::string step_path(const std::string& dir, const char* kind, int step) {
    char name[64];
    snprintf(name, sizeof(name), "%s_%08d.bin", kind, step);
    return dir + "/" + name;
}

// The state file of `rank` (a multi-GPU run writes one per rank; llmc/multi_gpu.cuh): rank 0's is
// state_<step>.bin, the one whose presence makes the checkpoint count; the others' state_<step>_rank<r>.bin.
inline std::string state_path(const std::string& dir, int step, int rank) {
    if (rank == 0) return step_path(dir, "state", step);
    char name[64];
    snprintf(name, sizeof(name), "state_%08d_rank%d.bin", step, rank);
    return dir + "/" + name;
}

// Steps of the files named <kind>_<8 digits>.bin in dir, ascending.
inline std::vector<int> steps_of_files(const std::string& dir, const char* kind) {
    std::vector<int> steps;
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return steps;
    size_t prefix = strlen(kind) + 1;
    while (struct dirent* e = readdir(d)) {
        std::string name = e->d_name;
        if (name.size() != prefix + 12 || name.compare(0, prefix, std::string(kind) + "_") != 0 ||
            name.compare(prefix + 8, 4, ".bin") != 0)
            continue;
        std::string digits = name.substr(prefix, 8);
        if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
        steps.push_back(atoi(digits.c_str()));
    }
    closedir(d);
    std::sort(steps.begin(), steps.end());
    return steps;
}

struct RunInfo {
    uint64_t id = 0;
    std::string source;  // "-e <absolute path>" or "-c <name> -d <depth>"
};

// A fresh run id: 64 random bits (never 0).
inline uint64_t new_run_id() {
    uint64_t id = 0;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd >= 0) {
        if (read(fd, &id, sizeof(id)) != (ssize_t)sizeof(id)) id = 0;
        close(fd);
    }
    if (id == 0) {  // no /dev/urandom: the clock and the pid are unique enough for one machine
        id = (uint64_t)std::chrono::steady_clock::now().time_since_epoch().count() * 0x9E3779B97F4A7C15ull ^
             (uint64_t)getpid();
    }
    return id == 0 ? 1 : id;
}

inline std::string run_file_path(const std::string& dir) { return dir + "/run.txt"; }

// Reads run.txt; returns "" or what is wrong.
inline std::string read_run_file(const std::string& dir, RunInfo* info) {
    std::string path = run_file_path(dir);
    if (is_directory(path.c_str())) return "'" + path + "' is a directory, expected a file";
    FILE* fp = fopen(path.c_str(), "r");
    if (fp == nullptr) {
        return "could not open '" + path + "': " + strerror(errno) +
               " (each run writes it when it starts; a directory without it holds no run that this build can resume)";
    }
    char line[4200];
    unsigned long long id = 0;
    bool ok = fgets(line, sizeof(line), fp) != nullptr && sscanf(line, "run_id %16llx", &id) == 1 && id != 0;
    ok = ok && fgets(line, sizeof(line), fp) != nullptr && strncmp(line, "source ", 7) == 0;
    fclose(fp);
    if (!ok) return "'" + path + "' is not a run file (expected 'run_id <16 hex digits>' and 'source ...' lines)";
    info->id = id;
    info->source = std::string(line + 7);
    while (!info->source.empty() && info->source.back() == '\n') info->source.pop_back();
    return "";
}

inline void write_run_file(const std::string& dir, const RunInfo& info) {
    AtomicFile out(run_file_path(dir));
    char head[64];
    snprintf(head, sizeof(head), "run_id %016llx\nsource ", (unsigned long long)info.id);
    std::string text = head + info.source + "\n";
    fwriteCheck(text.data(), 1, text.size(), out.fp, "run file");
    out.commit();
}

// "" if a fresh run may start in dir, else why not. Without force, a directory holding checkpoints is refused.
inline std::string check_fresh_run_dir(const std::string& dir, bool force) {
    std::vector<int> models = steps_of_files(dir, "model"), states = steps_of_files(dir, "state");
    if (force || (models.empty() && states.empty())) return "";
    std::string newest = states.empty() ? step_path(dir, "model", models.back()) : step_path(dir, "state", states.back());
    char buf[700];
    snprintf(buf, sizeof(buf), "output dir '%s' already holds checkpoints of a run (%zu model and %zu state files, "
             "newest '%s'): resume that run with -y 1, choose another -o, or give -F 1 to start a new run there anyway "
             "(the old files are then left alone: neither resumed nor deleted)", dir.c_str(), models.size(),
             states.size(), newest.c_str());
    return buf;
}

// Steps of the state files in dir that belong to run_id, ascending. A state file whose header cannot be read is an
// error (returned in *err): resuming must not silently skip over a damaged newest state.
inline std::vector<int> run_state_steps(const std::string& dir, uint64_t run_id, std::string* err) {
    std::vector<int> ours;
    for (int step : steps_of_files(dir, "state")) {
        StateHeader h;
        std::string e = read_state_header(step_path(dir, "state", step), &h);
        if (!e.empty()) {
            *err = e;
            return {};
        }
        if (h.run_id == run_id) ours.push_back(step);
    }
    return ours;
}

// Deletes this run's checkpoints (state and model) but the newest `keep`; other runs' files, and files whose header
// cannot be read, are left alone. Each checkpoint's rank files go by the world size its rank 0 file records (a
// resumed run may have another).
inline void remove_old_checkpoints(const std::string& dir, uint64_t run_id, int keep) {
    std::vector<std::pair<int, int>> ours;  // step, world size
    for (int step : steps_of_files(dir, "state")) {
        StateHeader h;
        if (read_state_header(step_path(dir, "state", step), &h).empty() && h.run_id == run_id)
            ours.push_back({step, h.world_size});
    }
    for (size_t i = 0; i + (size_t)keep < ours.size(); i++) {
        int step = ours[i].first;
        remove(step_path(dir, "state", step).c_str());  // the state first: a model without its state is unused
        remove(step_path(dir, "model", step).c_str());
        for (int rank = 1; rank < ours[i].second; rank++) remove(state_path(dir, step, rank).c_str());
    }
}

// Removes the temporary files (<model|state>_<step>.bin.tmp) a killed run left behind.
inline void remove_stale_temps(const std::string& dir) {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return;
    std::vector<std::string> stale;
    while (struct dirent* e = readdir(d)) {
        std::string name = e->d_name;
        bool checkpoint = name.rfind("model_", 0) == 0 || name.rfind("state_", 0) == 0;
        bool temp = name.size() > 8 && name.compare(name.size() - 8, 8, ".bin.tmp") == 0;
        if ((checkpoint && temp) || name == "run.txt.tmp") stale.push_back(name);
    }
    closedir(d);
    for (const std::string& name : stale) remove((dir + "/" + name).c_str());
}
