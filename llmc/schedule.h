// Learning-rate schedules. Every schedule warms up linearly from lr/warmup to lr over the first `warmup` steps,
// then (step counts from 0, total = the run's last step + 1):
//   cosine:   lr_min + (lr - lr_min) * (1 + cos(pi * progress)) / 2
//   linear:   lr - (lr - lr_min) * progress
//   constant: lr
//   wsd:      lr until the last `decay_fraction` of the steps, then linear down to lr_min (warmup-stable-decay)
// with progress in [0, 1] over the steps after warmup and lr_min = lr * final_fraction.
#pragma once

#include <cmath>
#include <cstring>

enum class ScheduleType { Cosine, Linear, Constant, WSD };

// Returns false for an unknown name.
inline bool parse_schedule(const char* name, ScheduleType* out) {
    if (strcmp(name, "cosine") == 0) *out = ScheduleType::Cosine;
    else if (strcmp(name, "linear") == 0) *out = ScheduleType::Linear;
    else if (strcmp(name, "constant") == 0) *out = ScheduleType::Constant;
    else if (strcmp(name, "wsd") == 0) *out = ScheduleType::WSD;
    else return false;
    return true;
}

struct LRSchedule {
    ScheduleType type = ScheduleType::Cosine;
    float lr = 3e-4f;
    int warmup = 0;
    int total = 1;
    float final_fraction = 0.0f;
    float decay_fraction = 0.2f;  // wsd only

    float at(int step) const {
        if (step < warmup) return lr * (float)(step + 1) / (float)warmup;
        float lr_min = lr * final_fraction;
        int span = total - warmup;
        float progress = span > 1 ? (float)(step - warmup) / (float)(span - 1) : 1.0f;
        progress = progress < 0.0f ? 0.0f : (progress > 1.0f ? 1.0f : progress);
        switch (type) {
            case ScheduleType::Cosine: return lr_min + (lr - lr_min) * 0.5f * (1.0f + cosf((float)M_PI * progress));
            case ScheduleType::Linear: return lr - (lr - lr_min) * progress;
            case ScheduleType::Constant: return lr;
            case ScheduleType::WSD: {
                int decay_steps = (int)(decay_fraction * (float)total);
                int decay_start = total - decay_steps;
                if (step < decay_start || decay_steps <= 0) return lr;
                float t = decay_steps > 1 ? (float)(step - decay_start) / (float)(decay_steps - 1) : 1.0f;
                return lr - (lr - lr_min) * (t > 1.0f ? 1.0f : t);
            }
        }
        return lr;
    }
};
