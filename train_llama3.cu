// Llama 3 training on one or more GPUs, in one file: config, parameters, activations, forward, backward, update, loop.
// The kernels live in llmc/; the CPU reference that spells out the same math is dev/cpu/llama3_cpu.h.
//
//   make train_llama3cu                     # PRECISION=BF16 (default) or FP32
//   ./train_llama3cu -c d12 -i "data/*_train.bin" -j "data/*_val.bin" -z data/tokenizer.bin -o runs/d12
//   ./train_llama3cu -h                     # every flag and its default
//
// floatX (llmc/cuda_common.h) is the type of parameters, activations and gradients: bf16, or fp32 for the exact
// tie-out build. The optimizer keeps fp32 m, v and (in bf16 builds) fp32 master weights. Parameters and
// gradients are each one flat buffer in checkpoint order (llmc/model.h), viewed through ParamTensors.
// With -M fp8 (bf16 builds, Ada or Hopper) the four products of each layer (wqkv, wo, w13, w2) run on FP8 tensor
// cores instead, forward and backward (llmc/matmul_fp8.cuh); the rest stays as it is.
//
// Several GPUs (mpirun -np N ./train_llama3cu ...): data parallel, one process per GPU, each rank a part of every
// batch; gradients are summed over the ranks while the backward runs, and with -Z 1, 2 or 3 each rank keeps only its
// shard of the optimizer state (with 2 also of the gradients, with 3 also of the weights, each layer gathered as the
// passes reach it). llmc/multi_gpu.cuh has the processes, the collectives, the gradients' buffers and reductions
// (Gradients) and the weights' gathers (Weights), llmc/shard_layout.h the shard layout; this file says when they
// happen.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "llmc/utils.h"
#include "llmc/checkpoint.h"
#include "llmc/flag_checks.h"
#include "llmc/nonfinite.h"
#include "llmc/run_dir.h"
#include "llmc/state_file.h"
#include "llmc/reshard.h"
#include "llmc/hf_model.h"
#include "llmc/cuda_common.h"
#include "llmc/dataloader.h"
#include "llmc/hash.h"
#include "llmc/tokenizer.h"
#include "llmc/schedule.h"
#include "llmc/profiler.h"
#include "llmc/init.cuh"
#include "llmc/encoder.cuh"
#include "llmc/rmsnorm.cuh"
#include "llmc/rope.cuh"
#include "llmc/attention.cuh"
#include "llmc/matmul.cuh"
#include "llmc/matmul_swiglu.cuh"
#include "llmc/matmul_fp8.cuh"
#include "llmc/fused_classifier.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/adamw.cuh"
#include "llmc/multi_gpu.cuh"

// ----------------------------------------------------------------------------------------------------------------
// Activations kept from the forward for the backward, for B*T = N rows, per layer unless noted. With activation
// recomputation the buffers marked (r1) and (r2) hold one layer only, and the backward recomputes them: at level 1
// the RMSNorm outputs and the SwiGLU output, each written by its own backward kernel (which reads the same input) just
// before the weight-gradient matmul that needs it; at level 2 also the w13 matmul output, which needs ln2 before the
// w2 backward, so there ln2 is recomputed by a forward pass first.

struct Activations {
    DeviceBuffer<floatX> residual;      // (L + 1, N, C): input of each layer, then the final residual
    DeviceBuffer<floatX> residual_mid;  // (L, N, C): after the attention branch
    DeviceBuffer<floatX> ln1, ln2;      // (L, N, C): RMSNorm outputs (r1)
    DeviceBuffer<float> rstd1, rstd2;   // (L, N)
    DeviceBuffer<floatX> qkv;           // (L, N, QKV), after RoPE
    DeviceBuffer<floatX> atty;          // (L, N, H hd): attention output
    DeviceBuffer<float> lse;            // (L, B, H, T): attention log-sum-exp
    DeviceBuffer<floatX> h13;           // (L, N, 2F): [gate | up] (r2)
    DeviceBuffer<floatX> hact;          // (L, N, F): silu(gate) * up (r1)
    DeviceBuffer<floatX> lnf;           // (N, C): final norm output
    DeviceBuffer<float> rstdf;          // (N)
    DeviceBuffer<float> losses;         // (N): per-row cross-entropy
    // (N, C), reused by every layer: in the forward each branch's output (the wo or w2 product) until the fused
    // residual add and norm take it; in the backward, which no longer needs those, each norm output's gradient.
    DeviceBuffer<floatX> branch_out;
    DeviceBuffer<floatX> dresidual;     // (N, C): backward scratch, reused by every layer
    // One allocation holds the layers' backward scratch (datty, dqkv, dh13, dhact) and, over the same memory, the
    // classifier's logits: (chunk, V), a chunk of rows' logits, then their gradient. Each is dead while the other is
    // in use, so the chunk can be large: every chunk reads the (V, C) lm_head twice and reads and writes its gradient,
    // the step's largest memory traffic after AdamW's.
    DeviceBuffer<floatX> shared_scratch;
    floatX *logits = nullptr, *datty = nullptr, *dqkv = nullptr, *dh13 = nullptr, *dhact = nullptr;
    DeviceBuffer<float> rmsnorm_scratch, attention_delta, norm_partials, norm_value;
    DeviceBuffer<int> inputs, targets;
};

// With -M fp8 a layer's four products each have amax slots (Fp8LinearScales), layer by layer
// in this order: the kernels that write a product's operands put their amax there (the forward its input's and
// weight's, the backward its output gradient's), and the product's casts read them.
enum Fp8Product { FP8_QKV, FP8_WO, FP8_W13, FP8_W2, FP8_PRODUCTS };

// ----------------------------------------------------------------------------------------------------------------
// The optimizer: AdamW (llmc/adamw.cuh) and its state for `count` elements in flat parameter order: the whole model,
// or with a sharded optimizer (ZeRO stages 1 to 3) this rank's shard, its part of every slice back to back
// (llmc/multi_gpu.cuh). `master` holds fp32 master weights of the bf16 params (absent with -W 0 and in fp32 builds,
// whose params are fp32 already); the moments m, v are fp32, or bf16 with -O bf16 (stochastically rounded).

// The settings of one AdamW step.
struct AdamWStep {
    float lr, beta1, beta2, eps, weight_decay;
    float grad_scale;   // the gradients are scaled by it: the clipping factor
    int step;           // 1-based
    unsigned int seed;  // of the stochastic rounding; tensor t draws its bits from seed + t
};

// Exits naming the tensor (or, for a rank's shard, the element) if the master weights (which = 0), m (1) or v (2)
// hold a NaN or Inf.
static void check_state_finite(const std::vector<float>& values, const Llama3Config& c, int which, const char* path,
                               const char* action) {
    NonFinite bad;
    if (values.size() == param_layout(c).total) {
        if (!find_non_finite(values.data(), c, &bad)) return;
    } else {
        size_t i = 0;
        while (i < values.size() && std::isfinite(values[i])) i++;
        if (i == values.size()) return;
        bad = {"(this rank's shard)", i, values[i]};
    }
    const char* names[] = {"master weights", "AdamW m", "AdamW v"};
    fprintf(stderr, "Error: %s training state '%s': the %s of tensor %s hold a non-finite value (%g) at element %zu\n",
            action, path, names[which], bad.tensor, bad.value, bad.index);
    fail_exit();
}

struct Optimizer {
    DeviceBuffer<float> master;
    DeviceBuffer<float> m, v;                    // fp32 moments ...
    DeviceBuffer<__nv_bfloat16> m_bf16, v_bf16;  // ... or bf16 ones
    bool use_master = true, bf16_state = false;
    size_t count = 0;

    void allocate(size_t n) {
        count = n;
#if !defined(ENABLE_FP32)
        if (use_master) master = DeviceBuffer<float>(count);
#endif
    }
    // The moments start at zero.
    void allocate_moments() {
        if (bf16_state) {
            m_bf16 = DeviceBuffer<__nv_bfloat16>(count);
            v_bf16 = DeviceBuffer<__nv_bfloat16>(count);
            cudaCheck(cudaMemset(m_bf16.ptr, 0, m_bf16.bytes()));
            cudaCheck(cudaMemset(v_bf16.ptr, 0, v_bf16.bytes()));
        } else {
            m = DeviceBuffer<float>(count);
            v = DeviceBuffer<float>(count);
            cudaCheck(cudaMemset(m.ptr, 0, m.bytes()));
            cudaCheck(cudaMemset(v.ptr, 0, v.bytes()));
        }
    }

    // AdamW on n elements of `tensor` (a ParamTensor; the norm gains get no weight decay): params and grads point at
    // them, their state is at `at`; index_offset is the first element's position within its tensor, so a part
    // updated on its own draws the same random bits as the whole tensor would.
    void update(floatX* params, const floatX* grads, size_t at, size_t n, int tensor, const AdamWStep& s,
                cudaStream_t stream, size_t index_offset = 0) {
        float wd = param_is_matrix(tensor) ? s.weight_decay : 0.0f;
        auto update_with = [&](auto* moment1, auto* moment2) {
            adamw_update(params, master.ptr ? master.ptr + at : nullptr, grads, moment1 + at, moment2 + at, n, s.lr,
                         s.beta1, s.beta2, s.step, s.eps, wd, s.grad_scale, s.seed + (unsigned int)tensor, stream,
                         index_offset);
        };
        if (bf16_state) update_with(m_bf16.ptr, v_bf16.ptr);
        else update_with(m.ptr, v.ptr);
    }

    // The whole model, tensor by tensor.
    void update_all(floatX* params, const floatX* grads, const Llama3Config& c, const AdamWStep& s,
                    cudaStream_t stream) {
        ParamLayout layout = param_layout(c);
        size_t offset = 0;
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            if (layout.sizes[t] == 0) continue;
            update(params + offset, grads + offset, offset, layout.sizes[t], t, s, stream);
            offset += layout.sizes[t];
        }
    }

    // A sharded optimizer: this rank's part of every slice (in weights.params), from its gradient shard, group by
    // group in the order the next forward uses the weights (group 0: the head tensors, group l + 1: layer l). After
    // each group's launches the weights gather what they need of it (Weights::part_updated).
    void update_shard(Weights& weights, const floatX* grad_shard, const ShardLayout& shards, const AdamWStep& s,
                      cudaStream_t stream) {
        for (int group = 0; group <= (int)shards.layer_slices.size(); group++) {
            const std::vector<int>& indices = group == 0 ? shards.head_slices : shards.layer_slices[group - 1];
            for (int i : indices) {
                const ParamSlice& slice = shards.slices[i];
                size_t at = shards.shard_offset(slice), part = shards.part(slice);
                update(weights.part(slice), grad_shard + at, at, part, slice.tensor, s, stream,
                       slice.tensor_offset + shards.rank * part);
            }
            weights.part_updated(group, stream);
        }
    }

    // The master weights (which = 0), m (1) or v (2) as fp32 on the host, whatever their device precision, and back
    // (bf16 -> fp32 -> bf16 is exact, so a saved bf16 state restores bit for bit).
    std::vector<float> to_host(int which) const {
        std::vector<float> host(count);
        const DeviceBuffer<float>& fp32 = which == 0 ? master : (which == 1 ? m : v);
        if (which == 0 || !bf16_state) {
            cudaCheck(cudaMemcpy(host.data(), fp32.ptr, count * sizeof(float), cudaMemcpyDeviceToHost));
        } else {
            std::vector<__nv_bfloat16> raw(count);
            cudaCheck(cudaMemcpy(raw.data(), (which == 1 ? m_bf16 : v_bf16).ptr, count * 2, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < count; i++) host[i] = __bfloat162float(raw[i]);
        }
        return host;
    }
    void from_host(int which, const std::vector<float>& host) {
        DeviceBuffer<float>& fp32 = which == 0 ? master : (which == 1 ? m : v);
        if (which == 0 || !bf16_state) {
            cudaCheck(cudaMemcpy(fp32.ptr, host.data(), count * sizeof(float), cudaMemcpyHostToDevice));
        } else {
            std::vector<__nv_bfloat16> raw(count);
            for (size_t i = 0; i < count; i++) raw[i] = __float2bfloat16_rn(host[i]);
            cudaCheck(cudaMemcpy((which == 1 ? m_bf16 : v_bf16).ptr, raw.data(), count * 2, cudaMemcpyHostToDevice));
        }
    }

    // The state as the training state file holds it (see "Training state on disk"): the master weights (if
    // present), m and v, each `count` fp32 values. Non-finite values are an error naming the file `path`.
    void save(FILE* fp, const char* path, const Llama3Config& c) const {
        for (int which = master.ptr ? 0 : 1; which <= 2; which++) {
            std::vector<float> host = to_host(which);
            check_state_finite(host, c, which, path, "not writing");
            fwriteCheck(host.data(), sizeof(float), count, fp, "optimizer state");
        }
    }
    // From a checkpoint's state files, whatever their layout: this rank's elements, by the ranges of `source`
    // (llmc/reshard.h).
    void load(const StateSource& source, const Llama3Config& c) {
        std::vector<float> host(count);
        for (int which = master.ptr ? 0 : 1; which <= 2; which++) {
            read_state_array(source, master.ptr ? which : which - 1, &host);
            check_state_finite(host, c, which, source.name().c_str(), "cannot resume from");
            from_host(which, host);
        }
    }
};

// ----------------------------------------------------------------------------------------------------------------
// The model

struct Llama3 {
    Llama3Config config;
    size_t num_params = 0;
    // The parameters (weights.params) and where the passes read them (llmc/multi_gpu.cuh): stages 0 to 2 hold the
    // whole model, stage 3 this rank's shard, each layer gathered as the passes reach it.
    Weights weights;
    // Where the backward writes the gradients, and on several GPUs their sum over the ranks (llmc/multi_gpu.cuh).
    // Stage 0: every buffer is whole. Stage 1: the optimizer holds this rank's shard (optimizer.count = num_params /
    // ranks) and grads.summed its part of the summed gradients. Stages 2 and 3: also grads.buffer is only scratch.
    Gradients grads;
    Optimizer optimizer;
    int recompute = 0;                 // activation recomputation level: 0 none, 1 norms + swiglu, 2 also w13
    bool fp8_mode = false;             // -M fp8: the layers' products in FP8, with their scratch
    Fp8LinearScales fp8_scales;
    Fp8Copies fp8_forward_copies = {}, fp8_backward_copies = {};  // see allocate_activations
    __nv_fp8_storage_t* fp8_w13_weight_copy = nullptr;            // w13's in the backward and its recomputation
    size_t fp8_extra_bytes = 0;  // what the FP8 copies added to the activations' memory
    DeviceBuffer<float> rope_table;    // (max_seq_len, hd/2, 2) {cos, sin}
    Activations acts;
    EmbeddingBackwardPlan embedding_plan;
    int B = 0, T = 0, classifier_chunk = 0;
    bool overwrite_grads = false;      // zero_grad not yet followed by a backward: it overwrites instead of adding
    cudaStream_t stream = 0;
    std::vector<int> host_inputs;
    // Pinned host staging: the batch's upload (two slots of inputs | targets, alternating between forwards, each
    // reused once the copy from it is done) and the per-row losses (a slot per micro-batch of the step), so neither
    // copy waits for the host nor makes the host wait for the GPU mid-step.
    PinnedBuffer<int> host_batch;
    cudaEvent_t batch_uploaded[2] = {nullptr, nullptr};
    int upload_slot = 0;
    PinnedBuffer<float> host_losses, host_norm;
    cudaEvent_t losses_staged = nullptr;
    Profiler profiler;

    // The parameters, gradients and optimizer state for this run's ranks (the shard layout stops with a message when
    // a sharded stage cannot split the model evenly), and on several GPUs the streams and events of the collectives.
    void allocate_params() {
        num_params = param_layout(config).total;
        grads.setup(config);
        weights.allocate(config, grads.shards, grads.comm_stream);
        grads.allocate();
        optimizer.allocate(grads.sharded() ? grads.shards.shard_size : num_params);
        optimizer.allocate_moments();
        std::vector<float> cos_table, sin_table;
        rope_tables(config, config.max_seq_len, &cos_table, &sin_table);
        std::vector<float> table = rope_interleave_tables(cos_table, sin_table);
        rope_table = DeviceBuffer<float>(table.size());
        cudaCheck(cudaMemcpy(rope_table.ptr, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
    }

    // Every element's value depends only on (seed, tensor, index within the tensor) (llmc/init.cuh), so each rank
    // draws what it keeps and all agree: the whole model, or with ZeRO-3 its parts; a sharded master its parts.
    void init_from_scratch(const Llama3Config& c, uint64_t seed) {
        config = c;
        allocate_params();
        ParamLayout layout = param_layout(c);
        float residual_std = 0.02f / sqrtf(2.0f * c.n_layers);
        auto init_std = [&](int t) {
            bool residual_projection = t == WO || t == W2;
            return !param_is_matrix(t) ? 0.0f : (residual_projection ? residual_std : 0.02f);
        };
        float* master = optimizer.master.ptr;
        if (weights.stage != 3) {
            size_t offset = 0;
            for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
                init_tensor(weights.params.ptr + offset, master && !grads.sharded() ? master + offset : nullptr,
                            layout.sizes[t], init_std(t), seed, t, stream);
                offset += layout.sizes[t];
            }
        }
        const ShardLayout& shards = grads.shards;
        if (weights.stage == 3 || (master && grads.sharded())) {
            for (const ParamSlice& s : shards.slices) {
                size_t part = shards.part(s);
                init_tensor(weights.part(s), master ? master + shards.shard_offset(s) : nullptr, part,
                            init_std(s.tensor), seed, s.tensor, stream, s.tensor_offset + shards.rank * part);
            }
        }
        weights.params_written(stream);
        cudaCheck(cudaStreamSynchronize(stream));
    }

    void load(const char* path) {
        std::vector<float> host = load_model_fp32(path, &config);  // our .bin or a Hugging Face directory
        allocate_params();
        upload_fp32(host);
    }

    // Sets the params (the whole model, or with ZeRO-3 this rank's parts) and master from the whole model's fp32 host
    // values.
    void upload_fp32(const std::vector<float>& host) {
        const ShardLayout& shards = grads.shards;
        std::vector<floatX> converted(weights.params.count);
        if (weights.stage != 3) {
            for (size_t i = 0; i < host.size(); i++) converted[i] = (floatX)host[i];
        } else {
            for (const ParamSlice& s : shards.slices) {
                for (size_t j = 0; j < shards.part(s); j++) {
                    converted[shards.shard_offset(s) + j] = (floatX)host[shards.owned_offset(s) + j];
                }
            }
        }
        cudaCheck(cudaMemcpy(weights.params.ptr, converted.data(), weights.params.bytes(), cudaMemcpyHostToDevice));
        weights.params_written(stream);
        DeviceBuffer<float>& master = optimizer.master;
        if (master.ptr == nullptr) return;
        if (!grads.sharded()) {
            cudaCheck(cudaMemcpy(master.ptr, host.data(), master.bytes(), cudaMemcpyHostToDevice));
            return;
        }
        for (const ParamSlice& s : shards.slices) {
            cudaCheck(cudaMemcpy(master.ptr + shards.shard_offset(s), host.data() + shards.owned_offset(s),
                                 shards.part(s) * sizeof(float), cudaMemcpyHostToDevice));
        }
    }

    // Writes the model in our checkpoint format, in the build's precision: the parameters exactly as they are
    // (in bf16 builds the exact master weights go to the training state). Every rank calls it (ZeRO-3 gathers the
    // weights for it); rank 0 writes.
    void save(const char* path) {
        std::vector<float> whole = weights.whole_fp32(stream);
        if (g_multi_gpu.rank == 0) {
            save_checkpoint_fp32(path, config, whole.data(), sizeof(floatX) == 4 ? DTYPE_FP32 : DTYPE_BF16);
        }
    }

    // The same parameters as a Hugging Face directory (llmc/hf_model.h); every rank calls it, rank 0 writes.
    void save_hf(const char* dir) {
        std::vector<float> whole = weights.whole_fp32(stream);
        if (g_multi_gpu.rank == 0) {
            save_hf_model(dir, config, whole.data(), sizeof(floatX) == 4 ? DTYPE_FP32 : DTYPE_BF16);
        }
    }

    // Activations for batches of up to B x T; the classifier works on chunks of rows so the (rows, V) logits never
    // exist for the whole batch. loss_slots: micro-batches per step, each staging its losses (stage_losses).
    void allocate_activations(int batch, int seq_len, int loss_slots = 1) {
        B = batch;
        T = seq_len;
        const Llama3Config& c = config;
        size_t N = (size_t)B * T, C = c.dim, L = c.n_layers, F = c.ffn_hidden;
        size_t QKV = c.qkv_dim(), attn = (size_t)c.n_heads * c.head_dim();
        Activations& a = acts;
        a.residual = DeviceBuffer<floatX>((L + 1) * N * C);
        a.residual_mid = DeviceBuffer<floatX>(L * N * C);
        size_t L1 = recompute >= 1 ? 1 : L, L2 = recompute >= 2 ? 1 : L;  // layers held
        a.ln1 = DeviceBuffer<floatX>(L1 * N * C);
        a.ln2 = DeviceBuffer<floatX>(L1 * N * C);
        a.rstd1 = DeviceBuffer<float>(L * N);
        a.rstd2 = DeviceBuffer<float>(L * N);
        a.qkv = DeviceBuffer<floatX>(L * N * QKV);
        a.atty = DeviceBuffer<floatX>(L * N * attn);
        a.lse = DeviceBuffer<float>(L * N * c.n_heads);
        a.h13 = DeviceBuffer<floatX>(L2 * N * 2 * F);
        a.hact = DeviceBuffer<floatX>(L1 * N * F);
        a.lnf = DeviceBuffer<floatX>(N * C);
        a.rstdf = DeviceBuffer<float>(N);
        a.losses = DeviceBuffer<float>(N);
        a.dresidual = DeviceBuffer<floatX>(N * C);
        a.branch_out = DeviceBuffer<floatX>(N * C);
        // The backward's scratch, each buffer at a 256-byte boundary (TMA and 16-byte accesses); the classifier's rows
        // in chunks of equal size, as few as fit in that scratch plus 2^28 elements.
        auto aligned = [](size_t count) { return (count * sizeof(floatX) + 255) / 256 * 256 / sizeof(floatX); };
        size_t layer_scratch = aligned(N * 2 * F) + aligned(N * F) + aligned(N * attn) + aligned(N * QKV);
        size_t max_rows = std::min(N, std::max<size_t>(1, (layer_scratch + ((size_t)1 << 28)) / c.vocab_size));
        size_t chunks = (N + max_rows - 1) / max_rows;
        classifier_chunk = (int)((N + chunks - 1) / chunks);
        size_t scratch_count = std::max(layer_scratch, (size_t)classifier_chunk * c.vocab_size);
        // FP8 copies (Fp8Copies) in memory that holds nothing else at the time. The forward's anywhere in the shared
        // scratch, which is free until the classifier; the backward's after the layer scratch, except the MLP's
        // largest (the w13 copies in backward()). Sizes in floatX elements, each part 256-byte aligned.
        const size_t max_weight = std::max({QKV * C, C * attn, 2 * F * C, C * F});
        auto fp8_bytes = [&](size_t bytes) { return aligned((bytes + sizeof(floatX) - 1) / sizeof(floatX)); };
        const size_t fp8_forward = fp8_bytes(N * std::max({C, attn, F})) + fp8_bytes(max_weight);
        // The backward's w13 weight copy, the largest: in datty and dqkv where they hold its bytes (both dead from
        // the layer above's qkv backward to this layer's wo backward, over the MLP's backward and its recomputation),
        // else with the other weights' copies. At the 8B and T=8192 this keeps the FP8 mode within the BF16 mode's
        // memory (the scratch is then sized by the classifier's chunk).
        const bool w13_copy_in_attention_grads = fp8_bytes(2 * F * C) <= aligned(N * attn) + aligned(N * QKV);
        const size_t backward_weight = w13_copy_in_attention_grads ? std::max({QKV * C, C * attn, C * F}) : max_weight;
        const size_t fp8_backward_operand = fp8_bytes(N * std::max({C, attn, QKV}));
        const size_t fp8_backward = fp8_backward_operand + fp8_bytes(N * std::max(C, QKV)) + fp8_bytes(backward_weight);
        if (fp8_mode) {
            size_t without = scratch_count;
            scratch_count = std::max({scratch_count, fp8_forward, layer_scratch + fp8_backward});
            fp8_extra_bytes = (scratch_count - without) * sizeof(floatX);
        }
        a.shared_scratch = DeviceBuffer<floatX>(scratch_count);
        a.logits = a.shared_scratch.ptr;
        a.dh13 = a.shared_scratch.ptr;
        a.dhact = a.dh13 + aligned(N * 2 * F);
        a.datty = a.dhact + aligned(N * F);
        a.dqkv = a.datty + aligned(N * attn);
        a.rmsnorm_scratch = DeviceBuffer<float>(rmsnorm_backward_scratch_floats((int)N, (int)C));
        a.attention_delta = DeviceBuffer<float>(N * c.n_heads);
        a.norm_partials = DeviceBuffer<float>(global_norm_scratch_floats(1));
        a.norm_value = DeviceBuffer<float>(1);
        a.inputs = DeviceBuffer<int>(N);
        a.targets = DeviceBuffer<int>(N);
        embedding_plan.allocate((int)N, c.vocab_size);
        host_batch = PinnedBuffer<int>(2 * 2 * N);
        for (cudaEvent_t* e : {&batch_uploaded[0], &batch_uploaded[1], &losses_staged}) {
            if (*e == nullptr) cudaCheck(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
        }
        host_losses = PinnedBuffer<float>((size_t)loss_slots * N);
        host_norm = PinnedBuffer<float>(1);
        if (fp8_mode) {
            using fp8_t = __nv_fp8_storage_t;
            fp8_t* forward = reinterpret_cast<fp8_t*>(a.shared_scratch.ptr);
            fp8_forward_copies = {forward, nullptr, forward + (fp8_forward - fp8_bytes(max_weight)) * sizeof(floatX),
                                  nullptr};
            fp8_t* backward = reinterpret_cast<fp8_t*>(a.shared_scratch.ptr + layer_scratch);
            fp8_t* grad_t = backward + fp8_backward_operand * sizeof(floatX);
            fp8_t* weight = backward + (fp8_backward - fp8_bytes(backward_weight)) * sizeof(floatX);
            fp8_backward_copies = {backward, grad_t, weight, backward};
            fp8_w13_weight_copy = w13_copy_in_attention_grads ? reinterpret_cast<fp8_t*>(a.datty) : weight;
            fp8_scales.allocate((int)L * FP8_PRODUCTS);
        }
    }

    // Whether a forward (and its backward) on N tokens runs the layers' products in FP8: with -M fp8, every
    // training and eval batch (B * T a multiple of 16, checked at the start); the sampler's forwards, of any length,
    // run them in bf16 when the length is not a multiple of 16, which FP8 products need.
    bool fp8_products(int N) const { return fp8_mode && N % 16 == 0; }
    static int fp8_slot(int l, Fp8Product product) { return l * FP8_PRODUCTS + product; }

    // Layer l's slice of a per-layer activation, or the single slice a recomputed buffer holds. Per layer only where
    // all L slices fit: a forward on fewer tokens than allocated (the sampler's) may fit several slices of its size
    // in a single-slice buffer, but not L of them.
    template <typename T>
    T* layer_slice(DeviceBuffer<T>& buf, int l, size_t per_layer) const {
        return buf.count >= (size_t)config.n_layers * per_layer ? buf.ptr + (size_t)l * per_layer : buf.ptr;
    }

    // Forward on (b, t) token ids (b <= B, t <= T), up to the final norm: fills the activations, acts.lnf last.
    // `targets` (optional, for the classifier() that follows) are uploaded with the inputs, before the kernels.
    void forward(const int* inputs, const int* targets, int b, int t) {
        const Llama3Config& c = config;
        int N = b * t, C = c.dim, H = c.n_heads, KV = c.n_kv_heads, hd = c.head_dim(), QKV = c.qkv_dim();
        int F = c.ffn_hidden, L = c.n_layers;
        size_t NC = (size_t)N * C;
        Activations& a = acts;
        Profiler& prof = profiler;
        const bool fp8 = fp8_products(N);
        Fp8LinearScales& f8 = fp8_scales;
        const Fp8Copies& fc = fp8_forward_copies;
        host_inputs.assign(inputs, inputs + N);
        int* staged = host_batch.ptr + (size_t)upload_slot * 2 * B * T;
        // the copy from this slot two calls ago; with accumulation it may sit behind a reduction: wait with the timeout
        event_sync(batch_uploaded[upload_slot]);
        memcpy(staged, inputs, N * sizeof(int));
        cudaCheck(cudaMemcpyAsync(a.inputs.ptr, staged, N * sizeof(int), cudaMemcpyHostToDevice, stream));
        if (targets) {
            memcpy(staged + N, targets, N * sizeof(int));
            cudaCheck(cudaMemcpyAsync(a.targets.ptr, staged + N, N * sizeof(int), cudaMemcpyHostToDevice, stream));
        }
        cudaCheck(cudaEventRecord(batch_uploaded[upload_slot], stream));
        upload_slot ^= 1;

        // FP8: the products' amax slots (Fp8LinearScales), filled by the kernels that write their inputs
        auto inp_amax = [&](int l, Fp8Product product) { return fp8 ? f8.inp_amax(fp8_slot(l, product)) : nullptr; };
        // ZeRO-3: the embedding's and the first two layers' gathers (those that their slots lack); after each layer
        // its slot gathers the layer two ahead (llmc/multi_gpu.cuh Weights)
        const floatX* embedding = weights.embedding(stream);
        weights.prefetch(0, stream);
        weights.prefetch(1, stream);
        {
            ProfileScope region(prof, "fwd embedding + norm");
            if (fp8) f8.clear_forward_amax(stream);
            encoder_forward(a.residual.ptr, a.inputs.ptr, embedding, N, C, stream);
            weights.prefetch_lm_head(stream);  // ZeRO-3: an untied one takes the embedding's place
            // later layers' input norms are fused with the residual add at the end of the previous layer
            rmsnorm_forward(layer_slice(a.ln1, 0, NC), a.rstd1.ptr, a.residual.ptr, weights.layer(0, stream).attn_norm,
                            N, C, c.norm_eps, stream, inp_amax(0, FP8_QKV));
        }
        for (int l = 0; l < L; l++) {
            floatX* x = a.residual.ptr + l * NC;
            floatX* ln1 = layer_slice(a.ln1, l, NC);
            floatX* qkv = a.qkv.ptr + (size_t)l * N * QKV;
            floatX* atty = a.atty.ptr + (size_t)l * N * H * hd;
            floatX* mid = a.residual_mid.ptr + l * NC;
            floatX* ln2 = layer_slice(a.ln2, l, NC);
            floatX* h13 = layer_slice(a.h13, l, (size_t)N * 2 * F);
            floatX* hact = layer_slice(a.hact, l, (size_t)N * F);
            const ParamTensors<floatX> w = weights.layer(l, stream);
            const floatX *wqkv = w.wqkv, *wo = w.wo, *w13 = w.w13, *w2 = w.w2;
            if (fp8) {
                ProfileScope region(prof, "fwd fp8 weight amax");
                float* amax[] = {f8.weight_amax(fp8_slot(l, FP8_QKV)), f8.weight_amax(fp8_slot(l, FP8_WO)),
                                 f8.weight_amax(fp8_slot(l, FP8_W13)), f8.weight_amax(fp8_slot(l, FP8_W2))};
                const floatX* weights[] = {wqkv, wo, w13, w2};
                const size_t sizes[] = {(size_t)QKV * C, (size_t)C * H * hd, (size_t)2 * F * C, (size_t)C * F};
                fp8_amax_accumulate(amax, weights, sizes, 4, stream);
            }
            {
                ProfileScope region(prof, "fwd qkv matmul");
                if (fp8) fp8_linear_forward(qkv, ln1, wqkv, N, C, QKV, fp8_slot(l, FP8_QKV), fc, f8, stream);
                else matmul_forward(qkv, ln1, wqkv, N, C, QKV, stream);
            }
            {
                ProfileScope region(prof, "fwd rope");
                rope_forward(qkv, rope_table.ptr, b, t, H, KV, hd, stream);
            }
            {
                ProfileScope region(prof, "fwd attention");
                attention_forward(atty, a.lse.ptr + (size_t)l * N * H, qkv, b, t, H, KV, hd, stream);
                if (fp8) fp8_amax_accumulate(f8.inp_amax(fp8_slot(l, FP8_WO)), atty, (size_t)N * H * hd, stream);
            }
            {  // the attention projection, then mid = x + it, normalised for the MLP
                ProfileScope region(prof, "fwd wo matmul + norm");
                if (fp8) {
                    fp8_linear_forward(a.branch_out.ptr, atty, wo, N, H * hd, C, fp8_slot(l, FP8_WO), fc, f8, stream);
                } else {
                    matmul_forward(a.branch_out.ptr, atty, wo, N, H * hd, C, stream);
                }
                fused_residual_rmsnorm_forward(mid, ln2, a.rstd2.ptr + (size_t)l * N, x, a.branch_out.ptr, w.ffn_norm,
                                               N, C, c.norm_eps, stream, inp_amax(l, FP8_W13));
            }
            {
                ProfileScope region(prof, "fwd w13 matmul + swiglu");
                if (fp8) {  // the product, then the SwiGLU pass (the fused kernel's products are bf16)
                    fp8_linear_forward(h13, ln2, w13, N, C, 2 * F, fp8_slot(l, FP8_W13), fc, f8, stream);
                    swiglu_forward(hact, h13, N, F, stream, inp_amax(l, FP8_W2));
                } else {
                    matmul_swiglu_forward(h13, hact, ln2, w13, N, F, C, stream);
                }
            }
            {  // x_{l+1} = mid + mlp, added in the kernel that normalises it for the next layer (or the head)
                ProfileScope region(prof, "fwd w2 matmul + norm");
                if (fp8) fp8_linear_forward(a.branch_out.ptr, hact, w2, N, F, C, fp8_slot(l, FP8_W2), fc, f8, stream);
                else matmul_forward(a.branch_out.ptr, hact, w2, N, F, C, stream);
                weights.prefetch(l + 2, stream);  // ZeRO-3: this layer's slot is read no more
                floatX* x_next = a.residual.ptr + (l + 1) * NC;
                if (l + 1 < L) {
                    fused_residual_rmsnorm_forward(x_next, layer_slice(a.ln1, l + 1, NC),
                                                   a.rstd1.ptr + (size_t)(l + 1) * N, mid, a.branch_out.ptr,
                                                   weights.layer(l + 1, stream).attn_norm, N, C, c.norm_eps, stream,
                                                   inp_amax(l + 1, FP8_QKV));
                } else {
                    fused_residual_rmsnorm_forward(x_next, a.lnf.ptr, a.rstdf.ptr, mid, a.branch_out.ptr,
                                                   weights.final_norm(stream), N, C, c.norm_eps, stream);
                }
            }
        }
    }

    // The classifier on the last forward's (b, t) rows, with the targets it uploaded: the logits, chunk by chunk so
    // the (rows, V) logits never exist for the whole batch, and the per-row losses. With dloss != 0 it also starts
    // the backward: each chunk's logits become dlogits (scaled by dloss), and the lm_head matmul's backward runs
    // right away, so acts.branch_out holds d(lnf) (the backward's first dnorm) and grads the lm_head gradient.
    void classifier(int b, int t, float dloss) {
        const Llama3Config& c = config;
        int N = b * t, C = c.dim, V = c.vocab_size;
        const floatX* lm_head = weights.lm_head(stream);
        Activations& a = acts;
        ParamTensors<floatX> g = grads.head();
        ProfileScope scope(profiler, "classifier (fwd + bwd)");
        for (int row = 0; row < N; row += classifier_chunk) {
            int rows = std::min(classifier_chunk, N - row);
            matmul_forward(a.logits, a.lnf.ptr + (size_t)row * C, lm_head, rows, C, V, stream);
            fused_classifier(a.logits, a.losses.ptr + row, dloss, a.targets.ptr + row, rows, V, dloss != 0.0f,
                             stream);
            if (dloss != 0.0f) {
                matmul_backward(a.branch_out.ptr + (size_t)row * C, g.lm_head, a.logits, a.lnf.ptr + (size_t)row * C,
                                lm_head, rows, C, V, !(overwrite_grads && row == 0), stream);
            }
        }
    }

    // The N per-row losses of the last forward on this rank (masked rows hold 0), queued for copying to slot `slot`
    // of the pinned staging; staged_loss_sum reads them once event_sync(losses_staged) has returned. A training
    // step stages each micro-batch's losses and sums them while the GPU computes the gradient norm.
    void stage_losses(int slot, int N) {
        cudaCheck(cudaMemcpyAsync(host_losses.ptr + (size_t)slot * N, acts.losses.ptr, N * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaEventRecord(losses_staged, stream));
    }
    // Their sum, on the host in a fixed order: deterministic. The mean loss is this sum over the number of targets
    // that count (count_targets).
    double staged_loss_sum(int slot, int N) const {
        double sum = 0.0;
        for (int i = 0; i < N; i++) sum += host_losses.ptr[(size_t)slot * N + i];
        return sum;
    }
    double loss_sum(int N) {
        stage_losses(0, N);
        event_sync(losses_staged);
        return staged_loss_sum(0, N);
    }

    // Backward of the last forward and classifier(..., dloss != 0); gradients accumulate into grads (the first
    // backward after zero_grad writes them). With `reduce` (several GPUs: the last micro-batch of a step, or every
    // one with stages 2 and 3) each layer's gradients are summed over the ranks once the layer below has run its
    // first product (see there), overlapping the rest of the backward; an untied lm_head's goes first, the other
    // head tensors' before layer 0's (see defer_layer0), and the step waits for them all (see Gradients).
    // `accumulate`: stages 2 and 3 add into the gradient shard instead of overwriting it (micro-batches after the
    // first).
    // forward_follows: another micro-batch's forward comes before the update (ZeRO-3 gathers its embedding early).
    void backward(int b, int t, bool reduce = false, bool accumulate = false, bool forward_follows = false) {
        const Llama3Config& c = config;
        int N = b * t, C = c.dim, H = c.n_heads, KV = c.n_kv_heads, hd = c.head_dim(), QKV = c.qkv_dim();
        int F = c.ffn_hidden, L = c.n_layers;
        size_t NC = (size_t)N * C;
        ParamTensors<floatX> hg = grads.head();
        Activations& a = acts;
        floatX* dnorm = a.branch_out.ptr;  // the gradient of each norm's output in turn, from the matmul before it
        Profiler& prof = profiler;
        bool add = !overwrite_grads;  // to the gradients, or over them (the step's first micro-batch)
        const bool fp8 = fp8_products(N);  // as the forward ran them: its amax slots are read here
        Fp8LinearScales& f8 = fp8_scales;
        const Fp8Copies& bc = fp8_backward_copies;
        // FP8: the products' output-gradient amax slots, filled by the kernels that write those gradients
        auto grad_amax = [&](int l, Fp8Product product) {
            return fp8 && l >= 0 ? f8.grad_amax(fp8_slot(l, product)) : nullptr;
        };
        if (reduce) grads.classifier_done(accumulate, stream);  // an untied lm_head's, complete now
        // The embedding's gradient (d(residual) at layer 0's input added into its rows), then the reduction of the
        // head tensors' gradients, the step's largest (a V x C table).
        auto embedding_backward = [&]() {
            ProfileScope region(prof, "bwd embedding");
            embedding_plan.build(host_inputs.data(), N, stream);
            grads.begin_embedding(stream);
            encoder_backward(hg.tok_embedding, a.dresidual.ptr, embedding_plan, C, stream);
            if (reduce) grads.head_done(accumulate, stream);
        };
        // With a reduction, layer 0's last weight-gradient products (w13's, except in FP8, and wqkv's) wait until the
        // embedding's gradient is written and the head's reduction is queued, so that they compute while it runs and
        // only layer 0's smaller reduction is left after the backward. The same products of the same inputs, which
        // nothing in between writes: the same bits. (FP8's w13 product needs the output-gradient scale that the wo and
        // qkv products after it overwrite, so it stays in place.) One GPU keeps the plain order.
        const bool defer_layer0 = reduce && L > 0;
        // ZeRO-3: the last two layers' gathers (the forward's slots still hold them); after each layer its slot
        // gathers the layer two below
        weights.prefetch(L - 1, stream);
        weights.prefetch(L - 2, stream);
        {
            ProfileScope region(prof, "bwd final norm");
            if (fp8) f8.clear_grad_amax(stream);
            cudaCheck(cudaMemsetAsync(a.dresidual.ptr, 0, NC * sizeof(floatX), stream));
            rmsnorm_backward(a.dresidual.ptr, hg.final_norm, a.rmsnorm_scratch.ptr, nullptr, dnorm,
                             a.residual.ptr + L * NC, weights.final_norm(stream), a.rstdf.ptr, N, C, add, stream,
                             grad_amax(L - 1, FP8_W2));
        }
        // ZeRO-3: the next micro-batch's embedding, hidden behind this backward (which reads neither table nor norm)
        if (forward_follows) weights.prefetch_embedding(stream);
        for (int l = L - 1; l >= 0; l--) {
            grads.begin_layer(l, stream);
            ParamTensors<floatX> g = grads.layer(l);
            const ParamTensors<floatX> w = weights.layer(l, stream);
            floatX* x = a.residual.ptr + l * NC;
            floatX* mid = a.residual_mid.ptr + l * NC;
            floatX* ln1 = layer_slice(a.ln1, l, NC);
            floatX* ln2 = layer_slice(a.ln2, l, NC);
            floatX* h13 = layer_slice(a.h13, l, (size_t)N * 2 * F);
            floatX* hact = layer_slice(a.hact, l, (size_t)N * F);
            floatX* atty = a.atty.ptr + (size_t)l * N * H * hd;
            floatX* qkv = a.qkv.ptr + (size_t)l * N * QKV;
            float* rstd1 = a.rstd1.ptr + (size_t)l * N;
            float* rstd2 = a.rstd2.ptr + (size_t)l * N;
            const floatX *wqkv = w.wqkv, *wo = w.wo, *w13 = w.w13, *w2 = w.w2;
            // FP8: the MLP's largest copies go to buffers dead by then: the w13 output gradient's copy to dhact and its
            // transpose to this layer's h13 (both read by the SwiGLU backward before), hact's transpose to dhact
            // (after the SwiGLU backward read it). Each holds at least as many bytes: floatX elements, the same count.
            // w13's weight copy: fp8_w13_weight_copy (allocate_activations).
            using fp8_t = __nv_fp8_storage_t;
            const Fp8Copies w13_copies = {reinterpret_cast<fp8_t*>(a.dhact), reinterpret_cast<fp8_t*>(h13),
                                          fp8_w13_weight_copy, bc.inp_t};
            const Fp8Copies w13_recompute_copies = {bc.operand, bc.grad_t, fp8_w13_weight_copy, bc.inp_t};
            const Fp8Copies w2_copies = {bc.operand, bc.grad_t, bc.weight, reinterpret_cast<fp8_t*>(a.dhact)};
            // The weight-gradient products that layer 0 defers under a reduction (see defer_layer0): BF16's w13
            // product (FP8's stays in place) and the qkv product.
            const bool deferred = defer_layer0 && l == 0;
            auto w13_weight_product = [&] {
                matmul_backward(nullptr, g.w13, a.dh13, ln2, w13, N, C, 2 * F, add, stream);
            };
            auto qkv_weight_product = [&] {
                if (fp8) fp8_linear_backward_weight(g.wqkv, ln1, N, C, QKV, fp8_slot(l, FP8_QKV), add, bc, f8, stream);
                else matmul_backward(nullptr, g.wqkv, a.dqkv, ln1, wqkv, N, C, QKV, add, stream);
            };
            // Recomputation: bit-identical to the forward's values (the same kernels, or the norm's backward with the
            // forward's expression and rstd, on the same inputs). ln1, and ln2 at level 1, are written by the norms'
            // backward, between the input-gradient and the weight-gradient matmuls; at level 2 the w13 product must
            // be recomputed before the w2 backward, and it needs ln2 first. In FP8 the recomputed inputs are cast as
            // the forward cast them (the same values, hence the same amax and scales).
            if (recompute >= 2) {
                ProfileScope region(prof, "bwd recompute");
                rmsnorm_forward(ln2, rstd2, mid, w.ffn_norm, N, C, c.norm_eps, stream);
                if (fp8) {
                    fp8_linear_forward(h13, ln2, w13, N, C, 2 * F, fp8_slot(l, FP8_W13), w13_recompute_copies, f8,
                                       stream);
                }
                else matmul_forward(h13, ln2, w13, N, C, 2 * F, stream);
            }
            // the MLP branch: dresidual is the gradient of its output. The w2 weight gradient comes after the swiglu
            // backward, which also recomputes hact (at recompute level 1 and up) from its one pass over h13.
            {
                ProfileScope region(prof, "bwd w2 matmul + swiglu");
                if (fp8) {  // as matmul_swiglu_backward without the fused kernel: the product into dhact, then SwiGLU
                    fp8_linear_backward_input(a.dhact, a.dresidual.ptr, w2, N, F, C, fp8_slot(l, FP8_W2), w2_copies, f8,
                                              stream);
                    swiglu_backward(a.dh13, recompute >= 1 ? hact : nullptr, a.dhact, h13, N, F, stream,
                                    grad_amax(l, FP8_W13));
                    fp8_linear_backward_weight(g.w2, hact, N, F, C, fp8_slot(l, FP8_W2), add, w2_copies, f8, stream);
                } else {
                    matmul_swiglu_backward(a.dh13, recompute >= 1 ? hact : nullptr, a.dhact, a.dresidual.ptr, w2, h13,
                                           N, F, C, stream);
                    matmul_backward(nullptr, g.w2, a.dresidual.ptr, hact, w2, N, F, C, add, stream);
                }
            }
            // The layer above's reduction is queued here, not when its last gradient was written: NCCL's kernels then
            // run beside the products that follow (cuBLASLt's, launched as many waves of tiles), not beside the fused
            // SwiGLU backward, whose one CTA per SM each waits for an SM that NCCL holds (traced on 2 H200s: that
            // kernel 28% slower beside the reductions, cuBLASLt's products 0-4%). The same sums of the same gradients.
            if (reduce && l + 1 < L) grads.layer_done(l + 1, accumulate, stream);
            {
                ProfileScope region(prof, "bwd w13 matmul + norm");
                if (fp8) {
                    fp8_linear_backward_input(dnorm, a.dh13, w13, N, C, 2 * F, fp8_slot(l, FP8_W13), w13_copies, f8,
                                              stream);
                }
                else matmul_backward(dnorm, nullptr, a.dh13, nullptr, w13, N, C, 2 * F, add, stream);
                rmsnorm_backward(a.dresidual.ptr, g.ffn_norm, a.rmsnorm_scratch.ptr, recompute == 1 ? ln2 : nullptr,
                                 dnorm, mid, w.ffn_norm, rstd2, N, C, add, stream,
                                 grad_amax(l, FP8_WO));
                if (fp8) {
                    fp8_linear_backward_weight(g.w13, ln2, N, C, 2 * F, fp8_slot(l, FP8_W13), add, w13_copies, f8,
                                               stream);
                } else if (!deferred) {
                    w13_weight_product();
                }
            }
            // the attention branch
            {
                ProfileScope region(prof, "bwd wo matmul");
                if (fp8) {
                    fp8_linear_backward_input(a.datty, a.dresidual.ptr, wo, N, H * hd, C, fp8_slot(l, FP8_WO), bc, f8,
                                              stream);
                    fp8_linear_backward_weight(g.wo, atty, N, H * hd, C, fp8_slot(l, FP8_WO), add, bc, f8, stream);
                } else {
                    matmul_backward(a.datty, g.wo, a.dresidual.ptr, atty, wo, N, H * hd, C, add, stream);
                }
            }
            {  // RoPE's backward inside (on Hopper, as the kernels store dq, dk)
                ProfileScope region(prof, "bwd attention + rope");
                attention_backward(a.dqkv, a.attention_delta.ptr, a.datty, qkv, atty, a.lse.ptr + (size_t)l * N * H,
                                   rope_table.ptr, b, t, H, KV, hd, stream);
                if (fp8) fp8_amax_accumulate(f8.grad_amax(fp8_slot(l, FP8_QKV)), a.dqkv, (size_t)N * QKV, stream);
            }
            {
                ProfileScope region(prof, "bwd qkv matmul + norm");
                if (fp8) fp8_linear_backward_input(dnorm, a.dqkv, wqkv, N, C, QKV, fp8_slot(l, FP8_QKV), bc, f8, stream);
                else matmul_backward(dnorm, nullptr, a.dqkv, nullptr, wqkv, N, C, QKV, add, stream);
                rmsnorm_backward(a.dresidual.ptr, g.attn_norm, a.rmsnorm_scratch.ptr, recompute >= 1 ? ln1 : nullptr,
                                 dnorm, x, w.attn_norm, rstd1, N, C, add, stream,
                                 grad_amax(l - 1, FP8_W2));
                if (!deferred) qkv_weight_product();
            }
            if (deferred) {  // d(residual) is final: the embedding first (see defer_layer0)
                embedding_backward();
                ProfileScope region(prof, "bwd layer 0 weight products after the embedding");
                if (!fp8) w13_weight_product();
                qkv_weight_product();
            }
            weights.prefetch(l - 2, stream);  // this layer's slot is read no more
            if (reduce && l == 0) grads.layer_done(0, accumulate, stream);  // the others: in the layer below
        }
        if (!defer_layer0) embedding_backward();
        overwrite_grads = false;
        if (reduce) grads.wait_all(stream);
    }

    // The gradients restart at zero. Outside ZeRO stages 2 and 3 (which clear their gradient slots) that takes no pass
    // over them: the next classifier and backward write every gradient instead of adding to it (beta = 0 in the
    // matmuls, which then do not read it), except the untied embedding's, to which the backward adds row by row;
    // that one alone is cleared here.
    void zero_grad() {
        if (grads.zero_grad(stream)) return;
        overwrite_grads = true;
        if (!config.tied_embeddings) {
            floatX* embedding = point_params(grads.buffer.ptr, config).tok_embedding;
            cudaCheck(cudaMemsetAsync(embedding, 0, (size_t)config.vocab_size * config.dim * sizeof(floatX), stream));
        }
    }

    // Global gradient norm (before clipping), over the summed gradients: this rank's whole buffer, or with a sharded
    // optimizer the ranks' shards, whose partial sums are added over the ranks (the same total on every rank).
    // queue_grad_norm enqueues it and its copy to the host, read_grad_norm waits for it: the host can work between.
    float grad_norm() {
        queue_grad_norm();
        return read_grad_norm();
    }
    void queue_grad_norm() {
        ProfileScope scope(profiler, "grad norm");
        if (grads.sharded()) {
            global_norm_squared(acts.norm_partials.ptr, grads.summed.ptr, optimizer.count, 0, stream);
            all_reduce_sum_device(acts.norm_partials.ptr, global_norm_scratch_floats(1), stream);
        } else {
            global_norm_squared(acts.norm_partials.ptr, grads.buffer.ptr, num_params, 0, stream);
        }
        global_norm_finish(acts.norm_value.ptr, acts.norm_partials.ptr, 1, stream);
        cudaCheck(cudaMemcpyAsync(host_norm.ptr, acts.norm_value.ptr, sizeof(float), cudaMemcpyDeviceToHost, stream));
    }
    float read_grad_norm() {
        stream_sync(stream);
        return *host_norm.ptr;
    }

    // One AdamW step (step is 1-based) with the gradients scaled by grad_scale; no weight decay on the gains.
    // Stages 1 to 3: this rank updates its part of every slice (the same arithmetic and random bits as the whole
    // update). Stages 1 and 2 then exchange the parts, group by group as soon as each is updated, on
    // grads.comm_stream, overlapping the rest of the update and the next forward (with -Q 0 the main stream waits for
    // each); stage 3 gathers the head tensors and the first two layers the same way (Weights::part_updated).
    void update(float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int step,
                unsigned int seed) {
        ProfileScope scope(profiler, "optimizer");
        AdamWStep s{lr, beta1, beta2, eps, weight_decay, grad_scale, step, seed};
        if (!grads.sharded()) {
            optimizer.update_all(weights.params.ptr, grads.buffer.ptr, config, s, stream);
            return;
        }
        optimizer.update_shard(weights, grads.summed.ptr, grads.shards, s, stream);
    }

    // FLOPs of one training step per token: 6 per matmul weight (forward 2, backward 4) plus causal attention,
    // 6 * L * H * hd * T (QK^T and PV each 2 * H * hd * T/2 per token forward, times 3 for forward + backward).
    double flops_per_token(int seq_len) const {
        const Llama3Config& c = config;
        double hd = c.head_dim(), matmul_weights = (double)c.n_layers * ((double)c.qkv_dim() * c.dim +
                                                                        (double)c.dim * c.n_heads * hd +
                                                                        3.0 * c.ffn_hidden * c.dim) +
                                                   (double)c.vocab_size * c.dim;
        return 6.0 * matmul_weights + 6.0 * c.n_layers * c.n_heads * hd * seq_len;
    }
};

// The loss is the mean over the targets that count: a target of -1 is masked (llmc/dataloader.h: a loss-masked
// shard, as for fine-tuning on chat data) and adds neither loss nor gradient. A training step's loss is the mean
// over all its micro-batches' counted targets, so the host counts them before the first forward and every
// micro-batch's dloss is 1 / that count; a step in which no target counts has no loss and takes no update.
static int64_t count_targets(const int* targets, size_t n) {
    int64_t count = 0;
    for (size_t i = 0; i < n; i++) count += targets[i] >= 0;
    return count;
}

// ----------------------------------------------------------------------------------------------------------------
// Training state on disk, in the run directory (llmc/run_dir.h): <out>/model_<step>.bin (our checkpoint format) and
// one state file per rank, <out>/state_<step>.bin for rank 0 and <out>/state_<step>_rank<r>.bin for the others: a
// header (llmc/state_file.h), then master weights fp32 (if present), m and v (fp32 in the file, also when kept in
// bf16 on the GPU) for the whole model or, with a sharded optimizer, the rank's shard; the rank's train loader
// state, the sampler RNG.
// All are written atomically, in this order: the other ranks' state files, then (once every rank has written its
// own) rank 0's model file and last its state file. So a checkpoint exists, for resuming and for retention, only
// when rank 0's state file does, and then every file of it is complete.
// A run resumes from a checkpoint written on any number of GPUs with any ZeRO stage: each rank reads its elements
// of the optimizer state from the files that hold them (llmc/reshard.h).

// The header of this run's state at `step`, for this rank (a sharded optimizer, stages 1 to 3, holds 1/ranks);
// zero_stage is the run's effective stage (0 on one GPU).
static StateHeader state_header_for(const Llama3Config& c, int step, bool has_master, uint64_t run_id,
                                    int64_t tokens_per_step, int zero_stage) {
    StateHeader h;
    h.step = step;
    h.is_bf16 = sizeof(floatX) == 2;
    h.has_master = has_master;
    h.world_size = g_multi_gpu.world;
    h.zero_stage = zero_stage;
    h.rank = g_multi_gpu.rank;
    h.num_params = param_layout(c).total;
    h.opt_count = h.zero_stage >= 1 ? h.num_params / h.world_size : h.num_params;
    h.run_id = run_id;
    h.tokens_per_step = tokens_per_step;
    state_config_slots(c, h.config);
    return h;
}

static void write_state_file(const std::string& path, Llama3& model, int step, DataLoader& loader,
                             uint64_t sampler_rng, uint64_t run_id, int64_t tokens_per_step) {
    int32_t h[STATE_HEADER_SLOTS];
    state_header_pack(state_header_for(model.config, step, model.optimizer.master.ptr != nullptr, run_id,
                                       tokens_per_step, model.grads.stage), h);
    AtomicFile out(path);
    fwriteCheck(h, sizeof(int32_t), STATE_HEADER_SLOTS, out.fp, "state header");
    model.optimizer.save(out.fp, out.path.c_str(), model.config);
    loader.save_state(out.fp);
    fwriteCheck(&sampler_rng, sizeof(sampler_rng), 1, out.fp, "sampler rng");
    out.commit();
}

// Every rank calls this. The barrier (a sum over the ranks) separates the other ranks' files from rank 0's.
static void save_training_state(const std::string& dir, Llama3& model, int step, DataLoader& loader,
                                uint64_t sampler_rng, uint64_t run_id, int64_t tokens_per_step) {
    int rank = g_multi_gpu.rank;
    if (rank != 0) write_state_file(state_path(dir, step, rank), model, step, loader, sampler_rng, run_id,
                                    tokens_per_step);
    all_reduce_sum(1.0);
    // rank 0 writes it; it refuses non-finite parameters before writing anything
    model.save(step_path(dir, "model", step).c_str());
    if (rank == 0) {
        write_state_file(state_path(dir, step, 0), model, step, loader, sampler_rng, run_id, tokens_per_step);
    }
}

// Restores what save_training_state wrote, from the files that plan_state_load checked. The model must already be
// loaded from the matching model file: it holds the parameters bit for bit (in bf16 builds the stochastic rounding
// of the master weights, which the state then restores exactly). Returns the train loader's state as saved.
static DataLoaderState load_training_state(const StateSource& source, Llama3& model, DataLoader& loader,
                                           uint64_t* sampler_rng) {
    model.optimizer.load(source, model.config);
    const char* path = source.paths[0].c_str();
    FILE* fp = fopenCheck(path, "rb");
    fseekCheck(fp, source.loader_offset(), SEEK_SET);
    DataLoaderState saved = loader.load_state(fp, path);
    freadCheck(sampler_rng, sizeof(*sampler_rng), 1, fp, "sampler rng");
    fcloseCheck(fp);
    return saved;
}

#ifndef TESTING
// ----------------------------------------------------------------------------------------------------------------
// The training loop

struct Options {
    const char* train_pattern = "data/tinyshakespeare/tiny_shakespeare_train.bin";
    const char* val_pattern = "data/tinyshakespeare/tiny_shakespeare_val.bin";
    const char* model_path = "";
    const char* config_name = "";
    int depth = 0;
    const char* out_dir = "";
    const char* export_dir = "";
    const char* tokenizer_path = "";
    const char* prompt_path = "";
    int B = 4, T = 1024;
    long total_batch = 0;  // tokens per step; 0: B * T
    float lr = 3e-4f, final_fraction = 0.0f, weight_decay = 0.1f, grad_clip = 1.0f;
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
    int warmup = 0;
    const char* schedule = "cosine";
    int max_steps = -1;  // -1: one epoch of the train data
    int val_every = 100, val_batches = 20, sample_every = 0, sample_length = 64;
    int checkpoint_every = 0, keep_checkpoints = 2, resume = 0, shuffle = 1;
    int force = 0;           // start a fresh run in an -o that holds another run's checkpoints
    int max_bad_steps = 5;   // non-finite steps in a row that stop the run
    uint64_t seed = 1337;
    float peak_tflops = 0.0f;  // 0: from the GPU's name
    int recompute = 1, master_weights = 1, profile = 0;
    const char* optimizer_state = "fp32";
    const char* matmul_precision = "bf16";  // of the layers' products: bf16 or fp8
    int fp8_min_dim = 1024;                 // -M fp8 only from this model width up
    int zero_stage = 1, overlap_reduction = 1, copy_engines = 1, collective_timeout = 600;
};

static void usage(const Options& d) {
    printf("Usage: ./train_llama3cu [options]   (this build: %s)\n", PRECISION_NAME);
    printf("Model (one of -e or -c):\n");
    printf("  -e <path>   start from this checkpoint (.bin) or Hugging Face model directory\n");
    printf("  -c <name>   from scratch: llama3.1-8B, llama3.1-70B, llama3.2-1B, llama3.2-3B or dN (e.g. d12)\n");
    printf("  -d <int>    keep only the first N layers of -c (default %d: all)\n", d.depth);
    printf("  -S <int>    seed for init, shuffling and sampling (default %llu)\n", (unsigned long long)d.seed);
    printf("Data:\n");
    printf("  -i <glob>   train token shards (default %s)\n", d.train_pattern);
    printf("  -j <glob>   val token shards, \"\" for none (default %s)\n", d.val_pattern);
    printf("  -z <path>   tokenizer .bin for samples, \"\" for none (default \"%s\")\n", d.tokenizer_path);
    printf("  -f <0|1>    shuffle the train data (default %d)\n", d.shuffle);
    printf("Batch and schedule:\n");
    printf("  -b <int>    micro-batch size B (default %d)\n", d.B);
    printf("  -t <int>    sequence length T (default %d)\n", d.T);
    printf("  -g <int>    tokens per step, a multiple of B*T: gradient accumulation (default B*T)\n");
    printf("  -x <int>    steps to train (default %d: one epoch)\n", d.max_steps);
    printf("  -l <float>  peak learning rate (default %g)\n", d.lr);
    printf("  -k <name>   schedule: cosine, linear, constant, wsd (default %s)\n", d.schedule);
    printf("  -u <int>    warmup steps (default %d)\n", d.warmup);
    printf("  -q <float>  final lr as a fraction of the peak (default %g)\n", d.final_fraction);
    printf("  -w <float>  weight decay on matrices (default %g)\n", d.weight_decay);
    printf("  -G <float>  gradient clip norm, 0 for none (default %g)\n", d.grad_clip);
    printf("Evaluation, output, checkpoints:\n");
    printf("  -v <int>    val loss every N steps, 0 never (default %d)\n", d.val_every);
    printf("  -m <int>    val batches per evaluation, -1 all (default %d)\n", d.val_batches);
    printf("  -s <int>    sample text every N steps, 0 never (default %d)\n", d.sample_every);
    printf("  -L <int>    sample length in tokens (default %d)\n", d.sample_length);
    printf("  -A <path>   samples continue this prompt (a token shard, e.g. from dev/data/chat_to_shards.py --prompt)\n"
           "              and stop at <|eot_id|>, instead of starting from <|begin_of_text|> (default \"%s\")\n",
           d.prompt_path);
    printf("  -o <dir>    output dir for log.txt and checkpoints, \"\" for none (default \"%s\")\n", d.out_dir);
    printf("  -n <int>    checkpoint every N steps, 0 never (default %d)\n", d.checkpoint_every);
    printf("  -r <int>    keep this run's last N checkpoints (default %d)\n", d.keep_checkpoints);
    printf("  -y <0|1>    resume the run in -o from its newest checkpoint; -e/-c not needed (default %d)\n", d.resume);
    printf("  -F <0|1>    start a fresh run even if -o holds another run's checkpoints; they are left alone, neither\n"
           "              resumed nor deleted (default %d)\n", d.force);
    printf("  -N <int>    stop after N steps in a row with a non-finite loss or grad norm; such steps are skipped\n"
           "              (no update) (default %d)\n", d.max_bad_steps);
    printf("  -X <dir>    at the end, write the model as a Hugging Face directory (config.json, safetensors in the\n"
           "              build's precision); add the tokenizer with scripts/convert_hf.py tokenizer (default none)\n");
    printf("Memory and speed:\n");
    printf("  -R <0|1|2>  activation recomputation: 0 none, 1 norms and swiglu, 2 also the w13 matmul (default %d)\n",
           d.recompute);
    printf("  -W <0|1>    fp32 master weights in bf16 builds (default %d; 0: bf16 params with stochastic rounding)\n",
           d.master_weights);
    printf("  -O <type>   AdamW m and v in fp32 or bf16 (stochastic rounding) (default %s)\n", d.optimizer_state);
    printf("  -M <type>   precision of the layers' matmuls (wqkv, wo, w13, w2): bf16, or fp8 on FP8 tensor cores\n"
           "              (e4m3 forward, e5m2 gradients, per-tensor scales; BF16 build, Ada or Hopper) (default %s)\n",
           d.matmul_precision);
    printf("  -K <int>    -M fp8 only for models of width (dim) at least N: below it the casts cost more than the FP8\n"
           "              products save, and the products stay bf16 (default %d; 0: any width)\n", d.fp8_min_dim);
    printf("  -p <0|1>    profile: time each region of the step with CUDA events, print a table (default %d)\n",
           d.profile);
    printf("Several GPUs (mpirun -np N ./train_llama3cu ...: one process per GPU, -b is per GPU):\n");
    printf("  -Z <0-3>    ZeRO stage: 0 all-reduce, every GPU keeps the whole optimizer state; 1 each GPU keeps 1/N\n"
           "              of the master weights and AdamW state; 2 also 1/N of the gradients; 3 also 1/N of the\n"
           "              weights, each layer gathered before the forward and the backward use it (default %d)\n",
           d.zero_stage);
    printf("  -Q <0|1>    overlap the gradient reduction with the backward and the weight gathers with the update and\n"
           "              the passes (default %d; 0 waits for each collective, to measure)\n", d.overlap_reduction);
    printf("  -E <0|1>    copy engines for the collectives when all GPUs are on one host: the layers' gradient\n"
           "              reductions (stages 1, 2) as peer copies, the weight gathers into NCCL windows (default %d;\n"
           "              0: NCCL's SM kernels for all)\n", d.copy_engines);
    printf("  -T <int>    seconds to wait for a collective before declaring a rank lost and stopping all (default %d)\n",
           d.collective_timeout);
    printf("  -P <float>  peak TFLOP/s for MFU (default: from the GPU name; H100/H200 989 bf16)\n");
    printf("  -h          this help\n");
}

[[noreturn]] static void bad_flag(const char* flag, const char* value, const char* why) {
    fprintf(stderr, "Error: invalid value '%s' for %s: %s (see -h)\n", value, flag, why);
    fail_exit();
}

static long parse_int(const char* flag, const char* s, long lo, long hi) {
    char* end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0') bad_flag(flag, s, "not an integer");
    if (v < lo || v > hi) {
        char why[96];
        snprintf(why, sizeof(why), "must be in [%ld, %ld]", lo, hi);
        bad_flag(flag, s, why);
    }
    return v;
}

static float parse_float(const char* flag, const char* s, float lo, float hi) {
    char* end;
    float v = strtof(s, &end);
    if (end == s || *end != '\0' || !std::isfinite(v)) bad_flag(flag, s, "not a number");
    if (v < lo || v > hi) {
        char why[96];
        snprintf(why, sizeof(why), "must be in [%g, %g]", lo, hi);
        bad_flag(flag, s, why);
    }
    return v;
}

static Options parse_options(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; i++) {
        const char* flag = argv[i];
        if (strcmp(flag, "-h") == 0 || strcmp(flag, "--help") == 0) {
            usage(Options());
            flush_stdout_check();
            exit(0);
        }
        if (flag[0] != '-' || strlen(flag) != 2) {
            fprintf(stderr, "Error: unknown argument '%s' (see -h)\n", flag);
            fail_exit();
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "Error: flag %s needs a value (see -h)\n", flag);
            fail_exit();
        }
        const char* val = argv[++i];
        switch (flag[1]) {
            case 'e': o.model_path = val; break;
            case 'c': o.config_name = val; break;
            case 'd': o.depth = (int)parse_int(flag, val, 0, 1024); break;
            case 'S': o.seed = (uint64_t)parse_int(flag, val, 0, 1L << 62); break;
            case 'i': o.train_pattern = val; break;
            case 'j': o.val_pattern = val; break;
            case 'z': o.tokenizer_path = val; break;
            case 'f': o.shuffle = (int)parse_int(flag, val, 0, 1); break;
            case 'b': o.B = (int)parse_int(flag, val, 1, 1 << 20); break;
            case 't': o.T = (int)parse_int(flag, val, 1, 1 << 20); break;
            case 'g': o.total_batch = parse_int(flag, val, 1, 1L << 40); break;
            case 'x': o.max_steps = (int)parse_int(flag, val, -1, 1 << 30); break;
            case 'l': o.lr = parse_float(flag, val, 0.0f, 10.0f); break;
            case 'k': {
                ScheduleType s;
                if (!parse_schedule(val, &s)) bad_flag(flag, val, "not one of cosine, linear, constant, wsd");
                o.schedule = val;
                break;
            }
            case 'u': o.warmup = (int)parse_int(flag, val, 0, 1 << 30); break;
            case 'q': o.final_fraction = parse_float(flag, val, 0.0f, 1.0f); break;
            case 'w': o.weight_decay = parse_float(flag, val, 0.0f, 10.0f); break;
            case 'G': o.grad_clip = parse_float(flag, val, 0.0f, 1e6f); break;
            case 'v': o.val_every = (int)parse_int(flag, val, 0, 1 << 30); break;
            case 'm': o.val_batches = (int)parse_int(flag, val, -1, 1 << 30); break;
            case 's': o.sample_every = (int)parse_int(flag, val, 0, 1 << 30); break;
            case 'L': o.sample_length = (int)parse_int(flag, val, 1, 1 << 20); break;
            case 'A': o.prompt_path = val; break;
            case 'o': o.out_dir = val; break;
            case 'X': o.export_dir = val; break;
            case 'n': o.checkpoint_every = (int)parse_int(flag, val, 0, 1 << 30); break;
            case 'r': o.keep_checkpoints = (int)parse_int(flag, val, 1, 1 << 20); break;
            case 'y': o.resume = (int)parse_int(flag, val, 0, 1); break;
            case 'F': o.force = (int)parse_int(flag, val, 0, 1); break;
            case 'N': o.max_bad_steps = (int)parse_int(flag, val, 1, 1 << 30); break;
            case 'P': o.peak_tflops = parse_float(flag, val, 0.001f, 1e6f); break;
            case 'R': o.recompute = (int)parse_int(flag, val, 0, 2); break;
            case 'W': o.master_weights = (int)parse_int(flag, val, 0, 1); break;
            case 'p': o.profile = (int)parse_int(flag, val, 0, 1); break;
            case 'Z': o.zero_stage = (int)parse_int(flag, val, 0, 3); break;
            case 'Q': o.overlap_reduction = (int)parse_int(flag, val, 0, 1); break;
            case 'E': o.copy_engines = (int)parse_int(flag, val, 0, 1); break;
            case 'T': o.collective_timeout = (int)parse_int(flag, val, 1, 1 << 30); break;
            case 'O':
                if (strcmp(val, "fp32") != 0 && strcmp(val, "bf16") != 0) bad_flag(flag, val, "not fp32 or bf16");
                o.optimizer_state = val;
                break;
            case 'M':
                if (strcmp(val, "bf16") != 0 && strcmp(val, "fp8") != 0) bad_flag(flag, val, "not bf16 or fp8");
                if (strcmp(val, "fp8") == 0 && sizeof(floatX) != 2)
                    bad_flag(flag, val, "FP8 matmuls need the BF16 build (this build: fp32; make PRECISION=BF16)");
                o.matmul_precision = val;
                break;
            case 'K': o.fp8_min_dim = (int)parse_int(flag, val, 0, 1 << 20); break;
            default:
                fprintf(stderr, "Error: unknown flag %s (see -h)\n", flag);
                fail_exit();
        }
    }
    return o;
}

// Dense bf16 (or fp32 without tensor cores) peak by GPU name, for MFU; -P overrides.
static float peak_tflops_for(const char* gpu_name) {
    bool bf16 = strcmp(PRECISION_NAME, "bf16") == 0;
    if (strstr(gpu_name, "H100") || strstr(gpu_name, "H200") || strstr(gpu_name, "H800")) return bf16 ? 989.0f : 67.0f;
    if (strstr(gpu_name, "A100") || strstr(gpu_name, "A800")) return bf16 ? 312.0f : 19.5f;
    return 0.0f;
}

// Samples `length` tokens after <|begin_of_text|>, one forward per token, and prints them decoded. With a prompt,
// samples after the prompt instead and stops at <|eot_id|> (the end of a chat answer). Rank 0 calls it, and with
// ZeRO-3 every rank: its forwards gather the weights, so every rank runs them, each token the one rank 0 drew (the
// ranks draw the same anyway, from the same logits and RNG: rank 0's keeps them in step for certain).
static void print_sample(Llama3& model, const Tokenizer& tokenizer, int length, uint64_t* rng,
                         const std::vector<int>& prompt) {
    ProfilerPause pause(model.profiler);
    const Llama3Config& c = model.config;
    std::vector<int> tokens = prompt;
    if (tokens.empty()) tokens.push_back(tokenizer.bos_id >= 0 ? tokenizer.bos_id : 0);
    int max_len = std::min((int)tokens.size() + length, model.T);
    std::vector<floatX> logits(c.vocab_size);
    std::vector<float> probs(c.vocab_size);
    while ((int)tokens.size() < max_len) {
        int n = (int)tokens.size();
        model.forward(tokens.data(), nullptr, 1, n);
        matmul_forward(model.acts.logits, model.acts.lnf.ptr + (size_t)(n - 1) * c.dim,
                       model.weights.lm_head(model.stream), 1, c.dim, c.vocab_size, model.stream);
        // ZeRO-3's forwards gather: wait with the collective timeout (-T) before the copy to pageable memory waits
        stream_sync(model.stream);
        cudaCheck(cudaMemcpyAsync(logits.data(), model.acts.logits, c.vocab_size * sizeof(floatX),
                                  cudaMemcpyDeviceToHost, model.stream));
        cudaCheck(cudaStreamSynchronize(model.stream));
        float maxval = -INFINITY;
        for (int i = 0; i < c.vocab_size; i++) maxval = std::max(maxval, (float)logits[i]);
        double sum = 0.0;
        for (int i = 0; i < c.vocab_size; i++) sum += probs[i] = expf((float)logits[i] - maxval);
        double u = random_unit(rng) * sum;  // inverse-CDF sampling
        int next = c.vocab_size - 1;
        for (int i = 0; i < c.vocab_size; i++) {
            u -= probs[i];
            if (u < 0) { next = i; break; }
        }
        if (model.weights.stage == 3) multi_gpu_broadcast(&next, sizeof(next));
        tokens.push_back(next);
        if (!prompt.empty() && next == tokenizer.eot_id) break;
    }
    printf("sample: ");
    tokenizer_print(tokenizer, tokens.data() + 1, tokens.size() - 1, stdout);
    printf("\n");
    flush_stdout_check();
}

// ----------------------------------------------------------------------------------------------------------------
// Host-side checks of a run before the GPU is touched (so that a bad command line fails fast, also on a machine
// without a GPU). Each one exits with a message naming the flags or the file.

static void exit_if_error(const std::string& err) {
    if (err.empty()) return;
    fprintf(stderr, "Error: %s\n", err.c_str());
    fail_exit();
}

// The config of a starting model: our checkpoint's header, or a Hugging Face directory's config.json.
static Llama3Config checkpoint_config(const char* path) {
    if (is_directory(path)) {
        std::string json = std::string(path) + "/config.json";
        if (!is_regular_file(json)) {
            fprintf(stderr, "Error: model '%s' is a directory but not a Hugging Face model directory (no "
                            "config.json); give our checkpoint file or a directory with config.json and safetensors\n",
                    path);
            fail_exit();
        }
        return hf_config_from_json(read_json_file(json), json);
    }
    FILE* fp = fopenCheck(path, "rb");
    Llama3Config c;
    int dtype;
    read_checkpoint_header(fp, path, &c, &dtype);
    fcloseCheck(fp);
    return c;
}

static bool same_config(const Llama3Config& a, const Llama3Config& b) {
    int32_t ha[CHECKPOINT_HEADER_SLOTS], hb[CHECKPOINT_HEADER_SLOTS];
    config_to_header(a, 0, ha);
    config_to_header(b, 0, hb);
    return memcmp(ha, hb, sizeof(ha)) == 0;
}

// The config named by -c and -d; -d must not exceed the named model's layers.
static Llama3Config named_config(const Options& opt) {
    Llama3Config full, named;
    if (!config_from_name(opt.config_name, 0, &full)) {
        bad_flag("-c", opt.config_name, "not llama3.1-8B, llama3.2-1B, llama3.2-3B or dN");
    }
    if (opt.depth > full.n_layers) {
        char why[96];
        snprintf(why, sizeof(why), "-c %s has only %d layers", opt.config_name, full.n_layers);
        bad_flag("-d", std::to_string(opt.depth).c_str(), why);
    }
    config_from_name(opt.config_name, opt.depth, &named);
    return named;
}

static std::string absolute_path(const char* path) {
    char buf[PATH_MAX];
    return realpath(path, buf) ? std::string(buf) : std::string(path);
}

static std::string config_summary(const Llama3Config& c) {
    char buf[160];
    snprintf(buf, sizeof(buf), "C=%d L=%d H=%d KV=%d F=%d V=%d", c.dim, c.n_layers, c.n_heads, c.n_kv_heads,
             c.ffn_hidden, c.vocab_size);
    return buf;
}

// Which model the run trains and which run it is. A fresh run: the config of -e (checked against -c/-d if given too)
// or of -c/-d, and a new run id; an -o holding checkpoints is refused unless -F 1. A resumed run (-y 1): the run
// named in <out>/run.txt at its newest state (*start_step), whose model file gives the config; a -e or -c that
// disagrees with the run is refused. Only a fresh run creates -o (and its parents), once its model is settled;
// resuming reads an existing run directory and creates nothing.
static Llama3Config resolve_run(const Options& opt, const std::string& out_dir, RunInfo* run, int* start_step) {
    bool from_file = opt.model_path[0] != '\0', from_name = opt.config_name[0] != '\0';
    if (opt.depth > 0 && !from_name) bad_flag("-d", std::to_string(opt.depth).c_str(), "applies to -c only");
    if (opt.resume) {
        if (out_dir.empty()) bad_flag("-y", "1", "resuming needs the run's output dir (-o)");
        if (!is_directory(out_dir.c_str())) {
            fprintf(stderr, "Error: -y 1 resumes the run in '%s' (-o), but there is no such directory\n",
                    out_dir.c_str());
            fail_exit();
        }
        exit_if_error(read_run_file(out_dir, run));
        std::string err;
        std::vector<int> steps = run_state_steps(out_dir, run->id, &err);
        exit_if_error(err);
        if (steps.empty()) {
            fprintf(stderr, "Error: -y 1 but '%s' holds no training state (state_*.bin) of its run %016llx\n",
                    out_dir.c_str(), (unsigned long long)run->id);
            fail_exit();
        }
        *start_step = steps.back();
        std::string model_path = step_path(out_dir, "model", *start_step);
        Llama3Config c = checkpoint_config(model_path.c_str());
        if (from_file && "-e " + absolute_path(opt.model_path) != run->source) {
            fprintf(stderr, "Error: -y 1 resumes the run in '%s', which began from %s; -e %s disagrees (resuming "
                            "loads '%s'): drop -e, or start a new run in another -o\n", out_dir.c_str(),
                    run->source.c_str(), opt.model_path, model_path.c_str());
            fail_exit();
        }
        if (from_name && !same_config(named_config(opt), c)) {
            fprintf(stderr, "Error: -y 1 resumes the run in '%s' (%s, began from %s); -c %s -d %d describes another "
                            "model: drop -c/-d, or start a new run in another -o\n", out_dir.c_str(),
                    config_summary(c).c_str(), run->source.c_str(), opt.config_name, opt.depth);
            fail_exit();
        }
        return c;
    }
    if (!from_file && !from_name) {
        fprintf(stderr, "Error: give a checkpoint (-e model.bin) or a config to train from scratch (-c d12)\n");
        fail_exit();
    }
    Llama3Config c = from_file ? checkpoint_config(opt.model_path) : named_config(opt);
    if (from_file && from_name && !same_config(c, named_config(opt))) {
        fprintf(stderr, "Error: checkpoint '%s' (%s) disagrees with -c %s -d %d\n", opt.model_path,
                config_summary(c).c_str(), opt.config_name, opt.depth);
        fail_exit();
    }
    if (!out_dir.empty()) {
        ensure_directory(out_dir, "-o");
        exit_if_error(check_fresh_run_dir(out_dir, opt.force != 0));
    }
    run->id = new_run_id();
    run->source = from_file ? "-e " + absolute_path(opt.model_path)
                            : std::string("-c ") + opt.config_name + " -d " + std::to_string(opt.depth);
    return c;
}

// Flags whose combination does nothing useful: each is an error rather than silently ignored.
static void check_flag_combinations(const Options& opt, bool have_tokenizer, int num_ranks) {
    if (opt.checkpoint_every > 0 && opt.out_dir[0] == '\0')
        bad_flag("-n", std::to_string(opt.checkpoint_every).c_str(), "checkpoints need an output dir (-o)");
    if (opt.sample_every > 0 && !have_tokenizer)
        bad_flag("-s", std::to_string(opt.sample_every).c_str(), "samples need a tokenizer (-z)");
    if (opt.sample_every > 0 && opt.sample_length + 1 > opt.T) {
        char why[128];
        snprintf(why, sizeof(why), "a sample and its start token must fit in the sequence length -t %d", opt.T);
        bad_flag("-L", std::to_string(opt.sample_length).c_str(), why);
    }
    if (opt.val_every > 0 && opt.val_pattern[0] != '\0' && opt.val_batches == 0)
        bad_flag("-m", "0", "evaluates no batch; turn validation off with -v 0 or -j \"\"");
    // on one GPU every stage's shard is the whole model: -Z 1 (the default) and 2 run as 0 there; -Z 3 is asked for
    // only to spread the weights over GPUs, which would silently not happen
    if (opt.zero_stage == 3 && num_ranks == 1)
        bad_flag("-Z", "3", "ZeRO-3 spreads the weights over several GPUs (mpirun -np N), this run has one; drop -Z 3");
}

// Every id the sampler feeds the model must be inside its embedding table: the tokenizer's special ids included.
static void check_tokenizer_ids(const Tokenizer& tok, const char* path, int model_vocab) {
    if (tok.vocab_size < model_vocab) {
        fprintf(stderr, "Error: tokenizer '%s' (-z) has %d tokens, the model %d: sampled ids could not be decoded\n",
                path, tok.vocab_size, model_vocab);
        fail_exit();
    }
    const char* names[] = {"<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"};
    int ids[] = {tok.bos_id, tok.eos_id, tok.eot_id};
    for (int i = 0; i < 3; i++) {
        if (ids[i] < 0 || ids[i] >= model_vocab) {
            fprintf(stderr, "Error: tokenizer '%s' (-z): %s is id %d, outside the model's vocab of %d (its "
                            "embedding table): use the model's own tokenizer, or no -z\n", path, names[i], ids[i],
                    model_vocab);
            fail_exit();
        }
    }
}

int main(int argc, char** argv) {
    multi_gpu_init(&argc, &argv);
    const MultiGpu& mg = g_multi_gpu;
    Options opt = parse_options(argc, argv);
    setvbuf(stdout, nullptr, _IOLBF, 0);
    if (mg.rank != 0 && freopen("/dev/null", "w", stdout) == nullptr) {  // rank 0 alone prints; errors: every rank
        fprintf(stderr, "Error: [rank %d] could not redirect stdout: %s\n", mg.rank, strerror(errno));
        fail_exit();
    }

    // --- the run, checked on the host before the GPU is touched: the model, the run directory, the flags and what
    // they combine into, the data, the tokenizer, and (resuming) the state file
    const int num_ranks = mg.world;
    std::string out_dir = opt.out_dir;
    RunInfo run;
    int start_step = 0;
    Llama3Config config = resolve_run(opt, out_dir, &run, &start_step);
    multi_gpu_broadcast(&run.id, sizeof(run.id));  // a new run's id is rank 0's: every rank's state files carry it
    if (opt.T > config.max_seq_len) {
        char why[96];
        snprintf(why, sizeof(why), "above the model's max_seq_len %d", config.max_seq_len);
        bad_flag("-t", std::to_string(opt.T).c_str(), why);
    }
    BatchPlan batch;
    exit_if_error(plan_batch(opt.B, opt.T, opt.total_batch, num_ranks, config.n_heads, &batch));
    long total_batch = batch.tokens_per_step;
    int grad_accum = batch.grad_accum;
    // -M fp8 on a narrow model: its products' FP8 savings (which grow with the width) fall below the casts' cost
    // (which do not), so it keeps them bf16; dev/NOTES.md has the measurements behind -K's default
    const bool fp8_asked = strcmp(opt.matmul_precision, "fp8") == 0;
    const bool fp8 = fp8_asked && config.dim >= opt.fp8_min_dim;
    if (fp8_asked && !fp8)
        printf("note: -M fp8 runs the layers' products in bf16 on this model: its width %d is below -K %d\n",
               config.dim, opt.fp8_min_dim);
    if (fp8) {
        exit_if_error(fp8_shapes(batch.tokens_per_micro, config.dim, config.qkv_dim(),
                                 config.n_heads * config.head_dim(), config.ffn_hidden));
    }
    bool have_tokenizer = opt.tokenizer_path[0] != '\0';
    check_flag_combinations(opt, have_tokenizer, num_ranks);

    DataLoader train_loader, val_loader;
    // each rank reads its own part of every batch
    train_loader.init(opt.train_pattern, opt.B, opt.T, mg.rank, num_ranks, opt.shuffle, opt.seed, config.vocab_size);
    bool have_val = opt.val_pattern[0] != '\0' && opt.val_every > 0;
    if (have_val) val_loader.init_eval(opt.val_pattern, opt.B, opt.T, mg.rank, num_ranks, config.vocab_size);
    Tokenizer tokenizer;
    if (have_tokenizer) {
        tokenizer.init(opt.tokenizer_path);
        check_tokenizer_ids(tokenizer, opt.tokenizer_path, config.vocab_size);
    }
    int max_steps = 0;
    exit_if_error(plan_steps(opt.max_steps, train_loader.num_batches(), grad_accum, start_step, opt.warmup,
                             &max_steps));
    bool has_master = sizeof(floatX) == 2 && opt.master_weights != 0;
    const int zero_stage = mg.world > 1 ? opt.zero_stage : 0;  // one GPU has nothing to shard
    StateSource resume_source;
    if (opt.resume) {
        StateHeader now = state_header_for(config, start_step, has_master, run.id, total_batch, zero_stage);
        exit_if_error(plan_state_load(out_dir, config, now, &resume_source));
        printf("resuming run %016llx in %s from step %d\n", (unsigned long long)run.id, out_dir.c_str(), start_step);
        if (resume_source.writer != resume_source.reader) {
            printf("resharding: the checkpoint was written on %d GPU(s) with ZeRO stage %d, this run has %d GPU(s) "
                   "with stage %d: each GPU reads its part of the optimizer state from the files that hold it\n",
                   resume_source.writer.world, resume_source.writer.stage, mg.world, zero_stage);
        }
    }
    // the starting weights, when they come from a file: read and checked (sizes, finite values) here too
    std::vector<float> initial_params;
    if (opt.resume || opt.model_path[0] != '\0') {
        std::string path = opt.resume ? step_path(out_dir, "model", start_step) : std::string(opt.model_path);
        initial_params = load_model_fp32(path.c_str(), &config);  // our .bin or a Hugging Face directory
    }

    // --- the GPU
    int device_count = 0;
    cudaError_t err = cudaGetDeviceCount(&device_count);
    if (err != cudaSuccess || device_count == 0) {
        fprintf(stderr, "Error: [rank %d] no CUDA GPU available (%s); train_llama3cu needs one\n", mg.rank,
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        fail_exit();
    }
    if (mg.local_rank >= device_count) {
        fprintf(stderr, "Error: [rank %d] local rank %d but this host has %d GPU(s): start at most one process per "
                        "GPU\n", mg.rank, mg.local_rank, device_count);
        fail_exit();
    }
    cudaCheck(cudaSetDevice(mg.local_rank));
    g_multi_gpu.timeout_s = opt.collective_timeout;
    multi_gpu_init_nccl(opt.copy_engines != 0);
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, mg.local_rank));
    if (fp8 && prop.major * 10 + prop.minor < 89) {
        fprintf(stderr, "Error: [rank %d] -M fp8 needs FP8 tensor cores (compute capability 8.9 or later: Ada, "
                        "Hopper), but GPU %d (%s) has compute capability %d.%d; use -M bf16\n", mg.rank, mg.local_rank,
                prop.name, prop.major, prop.minor);
        fail_exit();
    }
    cudaCheck(cudaFree(nullptr));  // create the context, so the baseline below excludes it
    size_t free_bytes, total_bytes;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    size_t baseline_used = total_bytes - free_bytes;

    // --- the model: from the run's latest training state, from a checkpoint, or from scratch
    Llama3 model;
    cudaCheck(cudaStreamCreate(&model.stream));
    model.optimizer.use_master = opt.master_weights != 0;
    model.optimizer.bf16_state = strcmp(opt.optimizer_state, "bf16") == 0;
    model.grads.stage = model.weights.stage = zero_stage;
    model.grads.overlap = model.weights.overlap = opt.overlap_reduction != 0;
    model.recompute = opt.recompute;
    model.fp8_mode = fp8;
    model.profiler.timing = opt.profile != 0;
    model.profiler.stream = model.stream;
    matmul_init(model.stream);
    if (!initial_params.empty()) {
        model.config = config;
        model.allocate_params();
        model.upload_fp32(initial_params);
        std::vector<float>().swap(initial_params);  // the host copy is no longer needed
    } else {
        model.init_from_scratch(config, opt.seed);
    }
    const Llama3Config& c = model.config;
    std::vector<int> prompt;
    if (opt.prompt_path[0] != '\0') {
        prompt = DataLoader::read_whole_shard(opt.prompt_path, c.vocab_size);
        if (prompt.empty() || (int)prompt.size() >= opt.T)
            bad_flag("-A", opt.prompt_path, "the prompt must hold 1 to T-1 tokens (-t)");
    }
    uint64_t sampler_rng = opt.seed * 0x9E3779B97F4A7C15ull + 1;
    if (opt.resume) {
        DataLoaderState saved = load_training_state(resume_source, model, train_loader, &sampler_rng);
        printf("resumed from %s at step %d\n", step_path(out_dir, "state", start_step).c_str(), start_step);
        if (saved.num_processes * saved.B != (int64_t)mg.world * opt.B) {
            printf("data: the checkpoint's run read samples of %lld GPU(s) x B %lld x T %d tokens, this run %d x %d x "
                   "%d: the train data goes on at the same token of its shard%s\n", (long long)saved.num_processes,
                   (long long)saved.B, opt.T, mg.world, opt.B, opt.T,
                   opt.shuffle ? ", the rest of that shard in another order (llmc/dataloader.h restore)" : "");
        }
    }

    model.allocate_activations(opt.B, opt.T, grad_accum);
    ScheduleType schedule_type;
    parse_schedule(opt.schedule, &schedule_type);
    LRSchedule schedule{schedule_type, opt.lr, opt.warmup, max_steps, opt.final_fraction};
    float peak = opt.peak_tflops > 0 ? opt.peak_tflops : peak_tflops_for(prop.name);
    double flops_per_step = model.flops_per_token(opt.T) * (double)total_batch;
    double peak_all = peak * mg.world;  // MFU: of all the GPUs together

    printf("device: %d x %s | precision %s | peak %.0f TFLOP/s per GPU for MFU\n", mg.world, prop.name,
           fp8 ? PRECISION_NAME ", layers' matmuls fp8 (-M fp8)" : PRECISION_NAME, peak);
    printf("model: V=%d C=%d L=%d H=%d KV=%d F=%d max_seq_len=%d tied=%d rope_scaling=%d | %.1fM parameters\n",
           c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.max_seq_len, c.tied_embeddings,
           c.use_rope_scaling, model.num_params / 1e6);
    printf("batch: B=%d T=%d per GPU x %d GPU(s) x grad_accum %d = %ld tokens/step | steps %d..%d | train tokens %lld\n",
           opt.B, opt.T, mg.world, grad_accum, total_batch, start_step + 1, max_steps,
           (long long)train_loader.total_tokens);
    if (mg.world > 1) {
        printf("multi-GPU: ZeRO stage %d | optimizer state per GPU: %zu of %zu elements | gradient reduction %s | "
               "%s\n", model.grads.stage, model.optimizer.count, model.num_params,
               model.grads.overlap ? "overlapped with the backward (gathers: with the update and the passes)"
                                   : "not overlapped (-Q 0)", nccl_version().c_str());
        printf("copy engines (-E): layers' reductions %s, weight gathers %s\n",
               model.grads.peer_reduce.enabled ? "peer copies" : "NCCL kernels",
               model.weights.params.windowed() ? "into NCCL windows" : "NCCL kernels");
        if (model.weights.stage == 3) {
            printf("ZeRO-3: weights per GPU %zu elements, gathered %zu (two layers, the vocabulary table, the final "
                   "norm)\n", model.weights.params.count, model.weights.gathered.count);
        }
    }
    printf("flops/token %.3e (6 x matmul weights + 6 L H hd T causal attention)\n", model.flops_per_token(opt.T));
    char fp8_memory[64] = "";
    if (fp8) snprintf(fp8_memory, sizeof(fp8_memory), ", FP8 copies +%.1f MiB", model.fp8_extra_bytes / 1048576.0);
    printf("memory: recompute level %d, master weights %s, AdamW state %s%s; mem = device memory in use beyond the "
           "CUDA context\n", model.recompute, model.optimizer.master.ptr ? "fp32" : "none",
           model.optimizer.bf16_state ? "bf16" : "fp32", fp8_memory);

    LogFile log;  // rank 0 alone writes in the run directory; every rank writes its state files
    if (!out_dir.empty() && mg.rank == 0) {
        remove_stale_temps(out_dir);
        if (!opt.resume) write_run_file(out_dir, run);  // the directory now belongs to this run
        log.open(out_dir + "/log.txt", opt.resume != 0);
    }

    auto evaluate = [&](int step) {
        ProfilerPause pause(model.profiler);
        val_loader.reset();
        double sum = 0.0;
        int64_t counted = 0;  // the mean is over the val targets that count (see count_targets)
        int batches = 0;
        while ((opt.val_batches < 0 || batches < opt.val_batches) && val_loader.next_batch()) {
            model.forward(val_loader.inputs.data(), val_loader.targets.data(), opt.B, opt.T);
            model.classifier(opt.B, opt.T, 0.0f);
            sum += model.loss_sum(opt.B * opt.T);
            counted += count_targets(val_loader.targets.data(), val_loader.targets.size());
            batches++;
        }
        // over every rank's batches (the loader gives each its part of every sample)
        sum = all_reduce_sum(sum);
        counted = (int64_t)all_reduce_sum((double)counted);
        float val_loss = counted > 0 ? (float)(sum / counted) : NAN;
        printf("step %d | val loss %.6f (%d batches)\n", step, val_loss, batches);
        flush_stdout_check();
        log.line("step %d val_loss %.6f", step, val_loss);
    };

    size_t peak_used = 0;
    std::vector<double> step_times;
    NonFiniteGuard guard;
    guard.limit = opt.max_bad_steps;
    std::vector<std::vector<int>> micro_inputs(grad_accum), micro_targets(grad_accum);
    if (have_val && start_step == 0) evaluate(0);  // the val loss before training (a fine-tune's starting point)
    for (int step = start_step + 1; step <= max_steps; step++) {
        stream_sync(model.stream);
        auto t0 = std::chrono::steady_clock::now();
        model.zero_grad();
        // the step's batches first: the loss is a mean over all their targets that count (see count_targets)
        int64_t step_targets = 0;
        for (int micro = 0; micro < grad_accum; micro++) {
            train_loader.next_batch();  // endless: epochs follow one another
            micro_inputs[micro] = train_loader.inputs;
            micro_targets[micro] = train_loader.targets;
            step_targets += count_targets(train_loader.targets.data(), train_loader.targets.size());
        }
        // counts below 2^53 add exactly in double: every rank gets the same total. A host sum (MPI): it does not
        // wait for the weight gathers that the last update queued, which the forward waits for layer by layer
        step_targets = (int64_t)all_reduce_sum((double)step_targets);
        double loss_sum = 0.0;
        for (int micro = 0; micro < grad_accum && step_targets > 0; micro++) {
            model.forward(micro_inputs[micro].data(), micro_targets[micro].data(), opt.B, opt.T);
            model.classifier(opt.B, opt.T, 1.0f / (float)step_targets);
            // several GPUs: stages 0 and 1 sum the gradients once they are complete (the last micro-batch),
            // stages 2 and 3 every micro-batch into the gradient shard
            bool reduce = mg.world > 1 && (model.grads.in_slots() || micro == grad_accum - 1);
            model.backward(opt.B, opt.T, reduce, model.grads.in_slots() && micro > 0, micro < grad_accum - 1);
            model.stage_losses(micro, opt.B * opt.T);
        }
        bool all_masked = step_targets == 0;
        float norm = 0.0f;
        if (!all_masked) {
            model.queue_grad_norm();
            event_sync(model.losses_staged);  // the losses are on the host while the GPU computes the norm
            for (int micro = 0; micro < grad_accum; micro++) loss_sum += model.staged_loss_sum(micro, opt.B * opt.T);
            norm = model.read_grad_norm();
        }
        loss_sum = all_reduce_sum(loss_sum);
        float loss = all_masked ? NAN : (float)(loss_sum / step_targets);
        if (fault_requested("nan " + std::to_string(step))) loss = NAN;  // test hook (llmc/fault.h)
        // a non-finite loss or norm: no update (llmc/nonfinite.h); a step with nothing to learn is no divergence
        bool apply = !all_masked && guard.accept(loss, norm);
        if (all_masked) {
            printf("step %d: every target of this step's batches is masked: no loss, no update\n", step);
        }
        float lr = schedule.at(step - 1);
        if (apply) {
            model.update(lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, clip_scale(norm, opt.grad_clip), step,
                         (unsigned int)opt.seed);
        }
        stream_sync(model.stream);
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        double tok_s = total_batch / (ms / 1000.0);
        double mfu = peak > 0 ? flops_per_step / (ms / 1000.0) / (peak_all * 1e12) * 100.0 : 0.0;
        cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
        size_t used = total_bytes - free_bytes - baseline_used;
        peak_used = std::max(peak_used, used);
        model.profiler.collect();
        step_times.push_back(ms);
        printf("step %5d/%d | loss %.6f | norm %.6f | lr %.2e | %.1f ms | %.0f tok/s | MFU %.1f%% | mem %.2f GiB%s\n",
               step, max_steps, loss, norm, lr, ms, tok_s, mfu, used / 1073741824.0,
               apply || all_masked ? "" : " | skipped: non-finite loss or grad norm, no update");
        flush_stdout_check();
        log.line("step %d train_loss %.6f norm %.4f lr %.4e ms %.2f%s", step, loss, norm, lr, ms,
                 apply ? "" : " skipped");
        if (guard.exhausted()) {
            fprintf(stderr, "Error: %d steps in a row (%d..%d) had a non-finite loss or grad norm (-N %d): stopping. "
                            "Their updates were skipped; the run diverged (try a lower -l or more -u) or its data or "
                            "model is bad\n", guard.in_a_row, step - guard.in_a_row + 1, step, opt.max_bad_steps);
            fail_exit();
        }
        if (have_val && (step % opt.val_every == 0 || step == max_steps)) evaluate(step);
        if (have_tokenizer && opt.sample_every > 0 && (step % opt.sample_every == 0 || step == max_steps) &&
            (mg.rank == 0 || model.weights.stage == 3))
            print_sample(model, tokenizer, opt.sample_length, &sampler_rng, prompt);
        if (!out_dir.empty() && opt.checkpoint_every > 0 && (step % opt.checkpoint_every == 0 || step == max_steps)) {
            save_training_state(out_dir, model, step, train_loader, sampler_rng, run.id, total_batch);
            if (mg.rank == 0) {
                remove_old_checkpoints(out_dir, run.id, opt.keep_checkpoints);
                printf("saved checkpoint %s\n", step_path(out_dir, "state", step).c_str());
            }
        }
        fault_kill_point("step " + std::to_string(step));  // test hook (llmc/fault.h)
    }
    if (step_times.size() >= 2) {  // the median over the steps after warm-up (the first 3, or 1 in short runs)
        size_t warmup = step_times.size() > 6 ? 3 : 1;
        std::vector<double> steady(step_times.begin() + warmup, step_times.end());
        std::sort(steady.begin(), steady.end());
        double median_ms = steady[steady.size() / 2];
        printf("summary: median step %.2f ms over %zu steps | %.0f tok/s | MFU %.1f%% | peak mem %.2f GiB\n",
               median_ms, steady.size(), total_batch / (median_ms / 1000.0),
               peak > 0 ? flops_per_step / (median_ms / 1000.0) / (peak_all * 1e12) * 100.0 : 0.0,
               peak_used / 1073741824.0);
        model.profiler.report(median_ms);
    }
    if (opt.export_dir[0] != '\0') {
        model.save_hf(opt.export_dir);  // every rank: ZeRO-3 gathers the weights; rank 0 writes
        printf("exported %s (Hugging Face format)\n", opt.export_dir);
    }
    log.close();
    flush_stdout_check();
    matmul_destroy();
    cudaCheck(cudaStreamDestroy(model.stream));
    multi_gpu_finish();
    return 0;
}
#endif
