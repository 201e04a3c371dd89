// What the training loop does with a step whose loss or gradient norm is NaN or Inf (a diverging run, or a fault):
// it skips that step's update (the weights and the AdamW state stay as they were; the data and the schedule move on)
// and says so on the step line; after `limit` such steps in a row it stops with a message. Clipping only ever sees a
// finite norm: with a NaN norm, min(1, clip / norm) would be 1, an unclipped update with NaN gradients.
#pragma once

#include <algorithm>
#include <cmath>

struct NonFiniteGuard {
    int limit = 5;     // bad steps in a row that end the run
    int in_a_row = 0;  // bad steps since the last good one
    int skipped = 0;   // bad steps in this process

    // Records a step; true if its update may be applied.
    bool accept(float loss, float grad_norm) {
        bool ok = std::isfinite(loss) && std::isfinite(grad_norm);
        in_a_row = ok ? 0 : in_a_row + 1;
        skipped += ok ? 0 : 1;
        return ok;
    }
    bool exhausted() const { return in_a_row >= limit; }
};

// The factor that scales the gradients to a global norm of at most max_norm (max_norm 0: no clipping). NaN for a
// non-finite norm, so that a caller that forgot the guard above propagates it instead of updating with scale 1.
inline float clip_scale(float grad_norm, float max_norm) {
    if (!std::isfinite(grad_norm)) return NAN;
    if (max_norm <= 0.0f) return 1.0f;
    return std::min(1.0f, max_norm / (grad_norm + 1e-6f));
}
