// Checks of the quantities the trainer derives from its flags, before anything is allocated: values that each pass
// their own range check can still combine into nonsense (zero gradient-accumulation steps, a run with no steps,
// token counts past 2^31). Everything is computed in 64-bit; each function returns "" or a message that names the
// flags involved, and the trainer prints it and exits.
//
//   BatchPlan plan; std::string err = plan_batch(B, T, total_batch, num_ranks, n_heads, &plan);
//   err = plan_steps(max_steps_flag, batches_per_epoch, plan.grad_accum, start_step, warmup, &max_steps);
//   err = fp8_shapes(plan.tokens_per_micro, dim, qkv_dim, n_heads * head_dim, ffn_hidden);   // with -M fp8
#pragma once

#include <climits>
#include <cstdint>
#include <cstdio>
#include <string>

struct BatchPlan {
    int64_t tokens_per_micro;  // B * T on one rank
    int64_t tokens_per_step;   // B * T * ranks * grad_accum: -g, or one micro-batch on every rank
    int grad_accum;            // micro-batches per step on each rank
};

// -b B, -t T, -g total_batch (0: one micro-batch per rank), over num_ranks processes with n_heads attention heads.
inline std::string plan_batch(int64_t B, int64_t T, int64_t total_batch, int num_ranks, int n_heads, BatchPlan* out) {
    char buf[320];
    if (B < 1 || T < 1 || num_ranks < 1 || total_batch < 0) {
        snprintf(buf, sizeof(buf), "-b %lld, -t %lld and the %d processes must be >= 1, -g %lld >= 0", (long long)B,
                 (long long)T, num_ranks, (long long)total_batch);
        return buf;
    }
    int64_t rows = B * T;  // both < 2^31 (parse ranges): no overflow
    // kernels and the dataloader index tokens, and attention rows (tokens x heads), with 32-bit ints
    if (rows >= INT32_MAX || rows * n_heads >= INT32_MAX) {
        snprintf(buf, sizeof(buf), "-b %lld x -t %lld = %lld tokens per micro-batch (x %d heads = %lld attention "
                 "rows): must stay below 2^31", (long long)B, (long long)T, (long long)rows, n_heads,
                 (long long)(rows * n_heads));
        return buf;
    }
    int64_t per_micro_step = rows * num_ranks;
    int64_t total = total_batch > 0 ? total_batch : per_micro_step;
    if (total % per_micro_step != 0) {
        snprintf(buf, sizeof(buf), "-g %lld is not a multiple of -b x -t x processes = %lld x %lld x %d = %lld "
                 "tokens (one micro-batch on every process)", (long long)total, (long long)B, (long long)T,
                 num_ranks, (long long)per_micro_step);
        return buf;
    }
    int64_t grad_accum = total / per_micro_step;
    if (grad_accum > INT_MAX) {
        snprintf(buf, sizeof(buf), "-g %lld / (-b x -t x processes = %lld) = %lld gradient-accumulation steps: "
                 "more than 2^31 - 1", (long long)total, (long long)per_micro_step, (long long)grad_accum);
        return buf;
    }
    *out = {rows, total, (int)grad_accum};
    return "";
}

// The run's last step: -x max_steps_flag, or with -x -1 one epoch of the train data (batches_per_epoch micro-batches,
// grad_accum per step). The run must train at least one step after start_step (0, or the step resumed from), and
// the warmup (-u) must end within the run.
inline std::string plan_steps(int64_t max_steps_flag, int64_t batches_per_epoch, int grad_accum, int64_t start_step,
                              int64_t warmup, int* max_steps) {
    char buf[320];
    int64_t steps = max_steps_flag;
    if (max_steps_flag == 0) return "-x 0 trains no step (give -x >= 1, or -x -1 for one epoch of the train data)";
    if (max_steps_flag < 0) {
        steps = grad_accum > 0 ? batches_per_epoch / grad_accum : 0;
        if (steps < 1) {
            snprintf(buf, sizeof(buf), "-x -1 (one epoch) gives no step: the train data (-i) holds %lld micro-batches "
                     "of -b x -t tokens, fewer than the %d of one step (-g); give -x, more data, or a smaller -g",
                     (long long)batches_per_epoch, grad_accum);
            return buf;
        }
    }
    if (steps > (1 << 30)) {
        snprintf(buf, sizeof(buf), "-x: %lld steps is more than 2^30", (long long)steps);
        return buf;
    }
    if (start_step >= steps) {
        snprintf(buf, sizeof(buf), "the run is resumed at step %lld, but it ends at step %lld (-x %lld): nothing "
                 "to train; give a larger -x", (long long)start_step, (long long)steps, (long long)max_steps_flag);
        return buf;
    }
    if (warmup > steps) {
        snprintf(buf, sizeof(buf), "-u %lld warmup steps is more than the run's %lld steps (-x %lld): the learning "
                 "rate would never reach -l", (long long)warmup, (long long)steps, (long long)max_steps_flag);
        return buf;
    }
    *max_steps = (int)steps;
    return "";
}

// -M fp8 runs the layers' products on FP8 tensor cores through cuBLASLt, which needs every dimension of them a
// multiple of 16 (llmc/matmul_fp8.cuh): the tokens of a micro-batch (B * T) and the model's widths C, QKV, H hd
// and F (of the products wqkv C -> QKV, wo H hd -> C, w13 C -> 2F, w2 F -> C).
inline std::string fp8_shapes(int64_t tokens, int dim, int qkv, int attn, int ffn) {
    const char* names[] = {"tokens per micro-batch -b x -t", "dim C", "QKV width (H + 2 KV) hd", "attention width H hd",
                           "ffn_hidden F"};
    const int64_t values[] = {tokens, dim, qkv, attn, ffn};
    for (int i = 0; i < 5; i++) {
        if (values[i] % 16 == 0) continue;
        char buf[320];
        snprintf(buf, sizeof(buf), "-M fp8 runs the layers' matmuls on FP8 tensor cores, which need each dimension a "
                 "multiple of 16, but the %s is %lld (C=%d QKV=%d H hd=%d F=%d, -b x -t = %lld); use -M bf16",
                 names[i], (long long)values[i], dim, qkv, attn, ffn, (long long)tokens);
        return buf;
    }
    return "";
}
