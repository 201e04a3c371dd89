// Test-only fault injection: lets the reliability tests (dev/test/test_reliability_gpu.py) kill the trainer with
// SIGKILL, or make a step's loss NaN, at an exact, named moment instead of by timing.
//
//   LLAMA3_FAULT="<label>[,<label>...]" ./train_llama3cu ...
//
// Labels (N a step, FILE a checkpoint file's name such as model_00000010.bin):
//   write FILE    SIGKILL in the middle of writing FILE: its temporary file holds the header and none of the data
//   rename FILE   SIGKILL once FILE's temporary file is complete and synced, before the rename
//   step N        SIGKILL after step N is done (its line printed, its checkpoint saved), before step N + 1
//   nan N         the loss of step N is replaced by NaN (exercises the non-finite handling)
// Unset (the normal case), every check is a getenv and a null test.
#pragma once

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

// True if LLAMA3_FAULT lists `label` (comma-separated, exact match).
inline bool fault_requested(const std::string& label) {
    const char* spec = getenv("LLAMA3_FAULT");
    if (spec == nullptr) return false;
    std::string list = std::string(",") + spec + ",";
    return list.find("," + label + ",") != std::string::npos;
}

// Kills this process with SIGKILL (no cleanup of any kind, as kill -9 from outside) if `label` is requested.
inline void fault_kill_point(const std::string& label) {
    if (!fault_requested(label)) return;
    fprintf(stderr, "LLAMA3_FAULT: SIGKILL at '%s'\n", label.c_str());
    fflush(stdout);
    fflush(stderr);
    raise(SIGKILL);
}
