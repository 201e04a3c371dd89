// The debug state written by scripts/train_llama3.py --write_debug: what a run of the PyTorch reference saw and
// computed, for the CPU reference and the CUDA trainer to tie out against.
//
// Layout (little-endian): header of 64 slots of 4 bytes
//   [0] magic 20261122  [1] version 1  [2] B  [3] T  [4] vocab_size  [5] n_steps
//   [6] masked: 1 when some targets are -1, ignored positions of a loss mask (the loss is then the mean over the
//       other targets, PyTorch's cross_entropy with ignore_index=-1); 0 when every target counts
//   [7] bf16 reference: 1 when PyTorch's bf16 autocast errors on the same case follow the step norms (below)
//   [8] lr  [9] beta1  [10] beta2  [11] eps  [12] weight_decay  [13] grad_clip   (float32)   other slots zero
// then: inputs int32 (B*T), targets int32 (B*T), logits fp32 (B*T*V), loss fp32 (1),
//       the gradient of every parameter fp32 (the model's parameter count, checkpoint order),
//       the loss of each of the n_steps AdamW steps fp32 (n_steps), the pre-clip grad norm of each step fp32 (n_steps).
// Each step trains on the same (inputs, targets) batch; step i's loss is measured before its update.
// With slot 7 = 1, then fp32: the errors of the same run under PyTorch's bf16 autocast (fp32 master weights) against
// this fp32 one, in the measures of tensor_error() below: logits max_rel and rel_norm, |loss diff|, the max_rel and
// rel_norm of each parameter tensor's gradient (checkpoint order, the tensors the model has), then for each step
// |loss diff| and |grad norm diff| / grad norm. The BF16 tie-out's bounds are multiples of them (test_llama3.cu).
#pragma once

#include <cstdint>
#include <vector>

#include "checkpoint.h"

constexpr int DEBUG_STATE_MAGIC = 20261122;
constexpr int DEBUG_STATE_VERSION = 1;

struct DebugState {
    int B = 0, T = 0, n_steps = 0;
    bool masked = false;
    float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, grad_clip = 0;
    std::vector<int> inputs, targets;
    std::vector<float> logits, grads, step_losses, step_norms;
    float loss = 0;
    // PyTorch's bf16 autocast errors (slot 7); has_bf16_reference false when the file holds none
    struct Bf16Reference {
        float logits_max_rel = 0, logits_rel_norm = 0, loss = 0;
        std::vector<float> grad_max_rel, grad_rel_norm;  // one per parameter tensor the model has
        std::vector<float> step_losses, step_norms;
    } bf16;
    bool has_bf16_reference = false;
};

// Reads a debug state for a model of `config`; names the file and the mismatch on any inconsistency, and exits.
inline DebugState load_debug_state(const char* path, const Llama3Config& config) {
    FILE* fp = fopenCheck(path, "rb");
    int32_t h[64];
    int64_t size = file_size_bytes(fp);
    if (size < (int64_t)sizeof(h)) {
        fprintf(stderr, "Error: debug state '%s' is %lld bytes, shorter than its header (truncated?)\n", path,
                (long long)size);
        fail_exit();
    }
    freadCheck(h, sizeof(int32_t), 64, fp, "debug state header");
    if (h[0] != DEBUG_STATE_MAGIC || h[1] != DEBUG_STATE_VERSION) {
        fprintf(stderr, "Error: '%s' is not a version %d debug state (magic %d version %d, expected %d %d)\n", path,
                DEBUG_STATE_VERSION, h[0], h[1], DEBUG_STATE_MAGIC, DEBUG_STATE_VERSION);
        fail_exit();
    }
    DebugState s;
    s.B = h[2];
    s.T = h[3];
    s.n_steps = h[5];
    if (h[6] != 0 && h[6] != 1) {
        fprintf(stderr, "Error: debug state '%s' has masked flag %d in slot 6, expected 0 or 1\n", path, h[6]);
        fail_exit();
    }
    s.masked = h[6] == 1;
    if (h[7] != 0 && h[7] != 1) {
        fprintf(stderr, "Error: debug state '%s' has bf16 reference flag %d in slot 7, expected 0 or 1\n", path, h[7]);
        fail_exit();
    }
    s.has_bf16_reference = h[7] == 1;
    if (h[4] != config.vocab_size) {
        fprintf(stderr, "Error: debug state '%s' is for vocab_size %d, the model has %d\n", path, h[4],
                config.vocab_size);
        fail_exit();
    }
    if (s.B < 1 || s.T < 1 || s.T > config.max_seq_len || s.n_steps < 0 || s.n_steps > 100000) {
        fprintf(stderr, "Error: debug state '%s' has B=%d T=%d n_steps=%d (max_seq_len %d)\n", path, s.B, s.T,
                s.n_steps, config.max_seq_len);
        fail_exit();
    }
    float hp[6];
    memcpy(hp, &h[8], sizeof(hp));
    s.lr = hp[0]; s.beta1 = hp[1]; s.beta2 = hp[2]; s.eps = hp[3]; s.weight_decay = hp[4]; s.grad_clip = hp[5];
    ParamLayout layout = param_layout(config);
    size_t N = (size_t)s.B * s.T, n_params = layout.total;
    int n_tensors = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) n_tensors += layout.sizes[t] > 0;
    int64_t bf16_floats = s.has_bf16_reference ? 3 + 2 * n_tensors + 2 * s.n_steps : 0;
    int64_t expected = (int64_t)sizeof(h) +
                       4 * (int64_t)(2 * N + N * config.vocab_size + 1 + n_params + 2 * s.n_steps + bf16_floats);
    if (size != expected) {
        fprintf(stderr, "Error: debug state '%s' is %lld bytes, expected %lld for B=%d T=%d V=%d steps=%d and %zu params%s\n",
                path, (long long)size, (long long)expected, s.B, s.T, config.vocab_size, s.n_steps, n_params,
                s.has_bf16_reference ? " with the bf16 reference errors" : "");
        fail_exit();
    }
    s.inputs.resize(N); s.targets.resize(N); s.logits.resize(N * config.vocab_size); s.grads.resize(n_params);
    s.step_losses.resize(s.n_steps); s.step_norms.resize(s.n_steps);
    freadCheck(s.inputs.data(), 4, N, fp, "inputs");
    freadCheck(s.targets.data(), 4, N, fp, "targets");
    freadCheck(s.logits.data(), 4, s.logits.size(), fp, "logits");
    freadCheck(&s.loss, 4, 1, fp, "loss");
    freadCheck(s.grads.data(), 4, n_params, fp, "gradients");
    freadCheck(s.step_losses.data(), 4, s.n_steps, fp, "step losses");
    freadCheck(s.step_norms.data(), 4, s.n_steps, fp, "step grad norms");
    if (s.has_bf16_reference) {
        std::vector<float> e(bf16_floats);
        freadCheck(e.data(), 4, e.size(), fp, "bf16 reference errors");
        const float* p = e.data();
        s.bf16.logits_max_rel = *p++;
        s.bf16.logits_rel_norm = *p++;
        s.bf16.loss = *p++;
        for (int t = 0; t < n_tensors; t++) {
            s.bf16.grad_max_rel.push_back(*p++);
            s.bf16.grad_rel_norm.push_back(*p++);
        }
        for (int i = 0; i < s.n_steps; i++) {
            s.bf16.step_losses.push_back(*p++);
            s.bf16.step_norms.push_back(*p++);
        }
        for (float x : e) {
            if (!std::isfinite(x) || x < 0) {
                fprintf(stderr, "Error: debug state '%s' has a bf16 reference error %g (not finite or negative)\n",
                        path, x);
                fail_exit();
            }
        }
    }
    fcloseCheck(fp);
    for (size_t i = 0; i < N; i++) {
        bool ignored = s.masked && s.targets[i] == -1;
        if (s.inputs[i] < 0 || s.inputs[i] >= config.vocab_size ||
            (!ignored && (s.targets[i] < 0 || s.targets[i] >= config.vocab_size))) {
            fprintf(stderr, "Error: debug state '%s' has a token id out of [0, %d) at position %zu%s\n", path,
                    config.vocab_size, i, s.masked ? " (-1 marks a masked target)" : "");
            fail_exit();
        }
    }
    return s;
}

// How far `got` is from `ref`: the largest error relative to the tensor's largest magnitude, and the relative
// error norm ||got - ref|| / ||ref||. Both are scale-free; the first bounds every element.
struct TensorError {
    double max_rel = 0.0, rel_norm = 0.0;
    size_t worst = 0;
    bool finite = true;
};

inline TensorError tensor_error(const float* got, const float* ref, size_t n) {
    double max_ref = 0.0, max_diff = 0.0, diff2 = 0.0, ref2 = 0.0;
    TensorError e;
    for (size_t i = 0; i < n; i++) {
        if (!std::isfinite(got[i])) e.finite = false;
        double d = fabs((double)got[i] - ref[i]);
        if (d > max_diff) { max_diff = d; e.worst = i; }
        max_ref = fmax(max_ref, fabs((double)ref[i]));
        diff2 += d * d;
        ref2 += (double)ref[i] * ref[i];
    }
    e.max_rel = max_ref > 0 ? max_diff / max_ref : max_diff;
    e.rel_norm = ref2 > 0 ? sqrt(diff2 / ref2) : sqrt(diff2);
    return e;
}

// Prints one check per line and counts the failures: the tie-out programs (dev/cpu/test_llama3_cpu.cpp,
// test_llama3.cu) share it, each with its own tolerances.
struct TieOutChecks {
    int failures = 0;

    // Passes when every element is finite, max_rel <= max_rel_tol and rel_norm <= rel_norm_tol.
    void tensor(const char* name, const float* got, const float* ref, size_t n, double max_rel_tol,
                double rel_norm_tol) {
        TensorError e = tensor_error(got, ref, n);
        bool ok = e.finite && e.max_rel <= max_rel_tol && e.rel_norm <= rel_norm_tol;
        printf("%-14s max_rel %.2e (<= %.1e)  rel_norm %.2e (<= %.1e)  (worst [%zu]: got %.8g ref %.8g)  %s\n", name,
               e.max_rel, max_rel_tol, e.rel_norm, rel_norm_tol, e.worst, got[e.worst], ref[e.worst], ok ? "OK" : "FAIL");
        if (!ok) failures++;
    }

    // Passes when |got - ref| <= abs_tol or <= rel_tol |ref|.
    void scalar(const char* name, float got, float ref, double abs_tol, double rel_tol) {
        double diff = fabs((double)got - ref);
        bool ok = std::isfinite(got) && (diff <= abs_tol || diff <= rel_tol * fabs(ref));
        printf("%-14s got %.8f ref %.8f  diff %.2e (<= %.1e)  %s\n", name, got, ref, diff,
               fmax(abs_tol, rel_tol * fabs(ref)), ok ? "OK" : "FAIL");
        if (!ok) failures++;
    }

    // Final line and exit status.
    int finish() const {
        if (failures > 0) {
            printf("FAILED: %d check(s)\n", failures);
            return 1;
        }
        printf("all checks passed\n");
        return 0;
    }
};
