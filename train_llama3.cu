// Llama 3 training on one GPU, in one file: config, parameters, activations, forward, backward, update, loop.
// The kernels live in llmc/; the CPU reference that spells out the same math is dev/cpu/llama3_cpu.h.
//
//   make train_llama3cu                     # PRECISION=BF16 (default) or FP32
//   ./train_llama3cu -c d12 -i "data/*_train.bin" -j "data/*_val.bin" -z data/tokenizer.bin -o runs/d12
//   ./train_llama3cu -h                     # every flag and its default
//
// floatX (llmc/cuda_common.h) is the type of parameters, activations and gradients: bf16, or fp32 for the exact
// tie-out build. The optimizer keeps fp32 m, v and (in bf16 builds) fp32 master weights. Parameters and
// gradients are each one flat buffer in checkpoint order (llmc/checkpoint.h), viewed through ParamTensors.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "llmc/utils.h"
#include "llmc/checkpoint.h"
#include "llmc/hf_model.h"
#include "llmc/cuda_common.h"
#include "llmc/dataloader.h"
#include "llmc/tokenizer.h"
#include "llmc/schedule.h"
#include "llmc/profiler.h"
#include "llmc/init.cuh"
#include "llmc/encoder.cuh"
#include "llmc/rmsnorm.cuh"
#include "llmc/rope.cuh"
#include "llmc/attention.cuh"
#include "llmc/swiglu.cuh"
#include "llmc/matmul.cuh"
#include "llmc/fused_classifier.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/adamw.cuh"

// ----------------------------------------------------------------------------------------------------------------
// Activations kept from the forward for the backward, for B*T = N rows, per layer unless noted. With activation
// recomputation the buffers marked (r1) and (r2) hold one layer only, and the backward recomputes them: at level 1
// the RMSNorm outputs and the SwiGLU output (cheap elementwise passes), at level 2 also the w13 matmul output.

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
    DeviceBuffer<floatX> logits;        // (chunk, V): logits of a chunk of rows, then their gradient
    DeviceBuffer<float> losses;         // (N): per-row cross-entropy
    // backward scratch, reused by every layer
    DeviceBuffer<floatX> dresidual, dnorm, datty, dqkv, dh13, dhact;
    DeviceBuffer<float> rmsnorm_scratch, attention_delta, norm_partials, norm_value;
    DeviceBuffer<int> inputs, targets;
};

// ----------------------------------------------------------------------------------------------------------------
// The model

struct Llama3 {
    Llama3Config config;
    size_t num_params = 0;
    DeviceBuffer<floatX> params, grads;
    DeviceBuffer<float> master;        // fp32 copy of bf16 params (absent in fp32 builds or with -W 0)
    DeviceBuffer<float> m, v;          // AdamW moments in fp32 ...
    DeviceBuffer<__nv_bfloat16> m_bf16, v_bf16;  // ... or in bf16 (-O bf16), stochastically rounded
    bool use_master = true, bf16_state = false;
    int recompute = 0;                 // activation recomputation level: 0 none, 1 norms + swiglu, 2 also w13
    DeviceBuffer<float> rope_table;    // (max_seq_len, hd/2, 2) {cos, sin}
    Activations acts;
    EmbeddingBackwardPlan embedding_plan;
    int B = 0, T = 0, classifier_chunk = 0;
    cudaStream_t stream = 0;
    std::vector<int> host_inputs;
    Profiler profiler;

    void allocate_params() {
        num_params = param_layout(config).total;
        params = DeviceBuffer<floatX>(num_params);
        grads = DeviceBuffer<floatX>(num_params);
#if !defined(ENABLE_FP32)
        if (use_master) master = DeviceBuffer<float>(num_params);
#endif
        cudaCheck(cudaMemset(grads.ptr, 0, grads.bytes()));
        if (bf16_state) {
            m_bf16 = DeviceBuffer<__nv_bfloat16>(num_params);
            v_bf16 = DeviceBuffer<__nv_bfloat16>(num_params);
            cudaCheck(cudaMemset(m_bf16.ptr, 0, m_bf16.bytes()));
            cudaCheck(cudaMemset(v_bf16.ptr, 0, v_bf16.bytes()));
        } else {
            m = DeviceBuffer<float>(num_params);
            v = DeviceBuffer<float>(num_params);
            cudaCheck(cudaMemset(m.ptr, 0, m.bytes()));
            cudaCheck(cudaMemset(v.ptr, 0, v.bytes()));
        }
        std::vector<float> cos_table, sin_table;
        rope_tables(config, config.max_seq_len, &cos_table, &sin_table);
        std::vector<float> table = rope_interleave_tables(cos_table, sin_table);
        rope_table = DeviceBuffer<float>(table.size());
        cudaCheck(cudaMemcpy(rope_table.ptr, table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
    }

    void init_from_scratch(const Llama3Config& c, uint64_t seed) {
        config = c;
        allocate_params();
        ParamLayout layout = param_layout(c);
        float residual_std = 0.02f / sqrtf(2.0f * c.n_layers);
        size_t offset = 0;
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            bool residual_projection = t == 3 || t == 6;  // wo, w2
            float std = !param_is_matrix(t) ? 0.0f : (residual_projection ? residual_std : 0.02f);
            init_tensor(params.ptr + offset, master.ptr ? master.ptr + offset : nullptr, layout.sizes[t], std, seed,
                        t, stream);
            offset += layout.sizes[t];
        }
        cudaCheck(cudaStreamSynchronize(stream));
    }

    void load(const char* path) {
        std::vector<float> host = load_model_fp32(path, &config);  // our .bin or a Hugging Face directory
        allocate_params();
        upload_fp32(host);
    }

    // Sets params (and master) from fp32 host values.
    void upload_fp32(const std::vector<float>& host) {
        std::vector<floatX> converted(host.size());
        for (size_t i = 0; i < host.size(); i++) converted[i] = (floatX)host[i];
        cudaCheck(cudaMemcpy(params.ptr, converted.data(), params.bytes(), cudaMemcpyHostToDevice));
        if (master.ptr) cudaCheck(cudaMemcpy(master.ptr, host.data(), master.bytes(), cudaMemcpyHostToDevice));
    }

    // Writes the model in our checkpoint format, in the build's precision: the parameters exactly as they are
    // (in bf16 builds the exact master weights go to the training state).
    void save(const char* path) const {
        save_checkpoint_fp32(path, config, params_fp32().data(), sizeof(floatX) == 4 ? DTYPE_FP32 : DTYPE_BF16);
    }

    // The same parameters as a Hugging Face directory (llmc/hf_model.h).
    void save_hf(const char* dir) const {
        save_hf_model(dir, config, params_fp32().data(), sizeof(floatX) == 4 ? DTYPE_FP32 : DTYPE_BF16);
    }

    std::vector<float> params_fp32() const {
        std::vector<floatX> raw(num_params);
        cudaCheck(cudaMemcpy(raw.data(), params.ptr, params.bytes(), cudaMemcpyDeviceToHost));
        return std::vector<float>(raw.begin(), raw.end());
    }

    // Activations for batches of up to B x T; the classifier works on chunks of rows so the (rows, V) logits never
    // exist for the whole batch.
    void allocate_activations(int batch, int seq_len) {
        B = batch;
        T = seq_len;
        const Llama3Config& c = config;
        size_t N = (size_t)B * T, C = c.dim, L = c.n_layers, F = c.ffn_hidden;
        size_t QKV = c.qkv_dim(), attn = (size_t)c.n_heads * c.head_dim();
        classifier_chunk = (int)std::min<size_t>(N, std::max<size_t>(1, ((size_t)256 << 20) / c.vocab_size));
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
        a.logits = DeviceBuffer<floatX>((size_t)classifier_chunk * c.vocab_size);
        a.losses = DeviceBuffer<float>(N);
        a.dresidual = DeviceBuffer<floatX>(N * C);
        a.dnorm = DeviceBuffer<floatX>(N * C);
        a.datty = DeviceBuffer<floatX>(N * attn);
        a.dqkv = DeviceBuffer<floatX>(N * QKV);
        a.dh13 = DeviceBuffer<floatX>(N * 2 * F);
        a.dhact = DeviceBuffer<floatX>(N * F);
        a.rmsnorm_scratch = DeviceBuffer<float>(rmsnorm_backward_scratch_floats((int)N, (int)C));
        a.attention_delta = DeviceBuffer<float>(N * c.n_heads);
        a.norm_partials = DeviceBuffer<float>(global_norm_scratch_floats(1));
        a.norm_value = DeviceBuffer<float>(1);
        a.inputs = DeviceBuffer<int>(N);
        a.targets = DeviceBuffer<int>(N);
        embedding_plan.allocate((int)N, c.vocab_size);
    }

    // Forward on (b, t) token ids (b <= B, t <= T): fills the activations and the per-row losses. With dloss != 0
    // it also starts the backward: each chunk's logits become dlogits (scaled by dloss), and the lm_head matmul's
    // backward runs right away, so acts.dnorm holds d(lnf) and grads hold the lm_head gradient afterwards.
    // Layer l's slice of a per-layer activation, or the single slice a recomputed buffer holds.
    template <typename T>
    static T* layer_slice(DeviceBuffer<T>& buf, int l, size_t per_layer) {
        return buf.count > per_layer ? buf.ptr + (size_t)l * per_layer : buf.ptr;
    }

    void forward(const int* inputs, const int* targets, int b, int t, float dloss) {
        const Llama3Config& c = config;
        int N = b * t, C = c.dim, H = c.n_heads, KV = c.n_kv_heads, hd = c.head_dim(), QKV = c.qkv_dim();
        int F = c.ffn_hidden, V = c.vocab_size, L = c.n_layers;
        size_t NC = (size_t)N * C;
        ParamTensors<floatX> p = point_params(params.ptr, c);
        Activations& a = acts;
        Profiler& prof = profiler;
        host_inputs.assign(inputs, inputs + N);
        cudaCheck(cudaMemcpyAsync(a.inputs.ptr, inputs, N * sizeof(int), cudaMemcpyHostToDevice, stream));
        if (targets) cudaCheck(cudaMemcpyAsync(a.targets.ptr, targets, N * sizeof(int), cudaMemcpyHostToDevice, stream));

        prof.begin("fwd embedding + norm");
        encoder_forward(a.residual.ptr, a.inputs.ptr, p.tok_embedding, N, C, stream);
        // later layers' input norms are fused with the residual add at the end of the previous layer
        rmsnorm_forward(layer_slice(a.ln1, 0, NC), a.rstd1.ptr, a.residual.ptr, p.attn_norm, N, C, c.norm_eps, stream);
        prof.end();
        for (int l = 0; l < L; l++) {
            floatX* x = a.residual.ptr + l * NC;
            floatX* ln1 = layer_slice(a.ln1, l, NC);
            floatX* qkv = a.qkv.ptr + (size_t)l * N * QKV;
            floatX* atty = a.atty.ptr + (size_t)l * N * H * hd;
            floatX* mid = a.residual_mid.ptr + l * NC;
            floatX* ln2 = layer_slice(a.ln2, l, NC);
            floatX* h13 = layer_slice(a.h13, l, (size_t)N * 2 * F);
            floatX* hact = layer_slice(a.hact, l, (size_t)N * F);
            prof.begin("fwd qkv matmul");
            matmul_forward(qkv, ln1, p.wqkv + (size_t)l * QKV * C, N, C, QKV, stream);
            prof.end();
            prof.begin("fwd rope");
            rope_forward(qkv, rope_table.ptr, b, t, H, KV, hd, stream);
            prof.end();
            prof.begin("fwd attention");
            attention_forward(atty, a.lse.ptr + (size_t)l * N * H, qkv, b, t, H, KV, hd, stream);
            prof.end();
            // the attention projection goes to dnorm, free until the backward, then joins the residual stream
            prof.begin("fwd wo matmul + norm");
            matmul_forward(a.dnorm.ptr, atty, p.wo + (size_t)l * C * H * hd, N, H * hd, C, stream);
            fused_residual_rmsnorm_forward(mid, ln2, a.rstd2.ptr + (size_t)l * N, x, a.dnorm.ptr,
                                           p.ffn_norm + (size_t)l * C, N, C, c.norm_eps, stream);
            prof.end();
            prof.begin("fwd w13 matmul + swiglu");
            matmul_forward(h13, ln2, p.w13 + (size_t)l * 2 * F * C, N, C, 2 * F, stream);
            swiglu_forward(hact, h13, N, F, stream);
            prof.end();
            // x_{l+1} = mid + mlp, added in the kernel that normalises it for the next layer (or the head)
            prof.begin("fwd w2 matmul + norm");
            matmul_forward(a.dnorm.ptr, hact, p.w2 + (size_t)l * C * F, N, F, C, stream);
            floatX* x_next = a.residual.ptr + (l + 1) * NC;
            if (l + 1 < L) {
                fused_residual_rmsnorm_forward(x_next, layer_slice(a.ln1, l + 1, NC),
                                               a.rstd1.ptr + (size_t)(l + 1) * N, mid, a.dnorm.ptr,
                                               p.attn_norm + (size_t)(l + 1) * C, N, C, c.norm_eps, stream);
            } else {
                fused_residual_rmsnorm_forward(x_next, a.lnf.ptr, a.rstdf.ptr, mid, a.dnorm.ptr, p.final_norm, N, C,
                                               c.norm_eps, stream);
            }
            prof.end();
        }
        if (targets == nullptr) return;
        ParamTensors<floatX> g = point_params(grads.ptr, c);
        ProfileScope scope(prof, "classifier (fwd + bwd)");
        for (int row = 0; row < N; row += classifier_chunk) {
            int rows = std::min(classifier_chunk, N - row);
            matmul_forward(a.logits.ptr, a.lnf.ptr + (size_t)row * C, p.lm_head, rows, C, V, stream);
            fused_classifier(a.logits.ptr, a.losses.ptr + row, dloss, a.targets.ptr + row, rows, V, dloss != 0.0f,
                             stream);
            if (dloss != 0.0f) {
                matmul_backward(a.dnorm.ptr + (size_t)row * C, g.lm_head, a.logits.ptr, a.lnf.ptr + (size_t)row * C,
                                p.lm_head, rows, C, V, stream);
            }
        }
    }

    // Mean loss of the last forward (summed on the host in a fixed order: deterministic).
    float mean_loss(int N) {
        std::vector<float> losses(N);
        cudaCheck(cudaMemcpyAsync(losses.data(), acts.losses.ptr, N * sizeof(float), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
        double sum = 0.0;
        for (float x : losses) sum += x;
        return (float)(sum / N);
    }

    // Backward of the last forward(..., dloss != 0); gradients accumulate into `grads`.
    void backward(int b, int t) {
        const Llama3Config& c = config;
        int N = b * t, C = c.dim, H = c.n_heads, KV = c.n_kv_heads, hd = c.head_dim(), QKV = c.qkv_dim();
        int F = c.ffn_hidden, L = c.n_layers;
        size_t NC = (size_t)N * C;
        ParamTensors<floatX> p = point_params(params.ptr, c);
        ParamTensors<floatX> g = point_params(grads.ptr, c);
        Activations& a = acts;
        Profiler& prof = profiler;
        prof.begin("bwd final norm");
        cudaCheck(cudaMemsetAsync(a.dresidual.ptr, 0, NC * sizeof(floatX), stream));
        rmsnorm_backward(a.dresidual.ptr, g.final_norm, a.rmsnorm_scratch.ptr, a.dnorm.ptr, a.residual.ptr + L * NC,
                         p.final_norm, a.rstdf.ptr, N, C, stream);
        prof.end();
        for (int l = L - 1; l >= 0; l--) {
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
            if (recompute >= 1) {  // the same kernels on the same inputs: bit-identical to the stored values
                prof.begin("bwd recompute");
                rmsnorm_forward(ln2, rstd2, mid, p.ffn_norm + (size_t)l * C, N, C, c.norm_eps, stream);
                if (recompute >= 2) matmul_forward(h13, ln2, p.w13 + (size_t)l * 2 * F * C, N, C, 2 * F, stream);
                swiglu_forward(hact, h13, N, F, stream);
                rmsnorm_forward(ln1, rstd1, x, p.attn_norm + (size_t)l * C, N, C, c.norm_eps, stream);
                prof.end();
            }
            // the MLP branch: dresidual is the gradient of its output
            prof.begin("bwd w2 matmul + swiglu");
            matmul_backward(a.dhact.ptr, g.w2 + (size_t)l * C * F, a.dresidual.ptr, hact, p.w2 + (size_t)l * C * F, N,
                            F, C, stream);
            swiglu_backward(a.dh13.ptr, a.dhact.ptr, h13, N, F, stream);
            prof.end();
            prof.begin("bwd w13 matmul + norm");
            matmul_backward(a.dnorm.ptr, g.w13 + (size_t)l * 2 * F * C, a.dh13.ptr, ln2,
                            p.w13 + (size_t)l * 2 * F * C, N, C, 2 * F, stream);
            rmsnorm_backward(a.dresidual.ptr, g.ffn_norm + (size_t)l * C, a.rmsnorm_scratch.ptr, a.dnorm.ptr, mid,
                             p.ffn_norm + (size_t)l * C, rstd2, N, C, stream);
            prof.end();
            // the attention branch
            prof.begin("bwd wo matmul");
            matmul_backward(a.datty.ptr, g.wo + (size_t)l * C * H * hd, a.dresidual.ptr, atty,
                            p.wo + (size_t)l * C * H * hd, N, H * hd, C, stream);
            prof.end();
            prof.begin("bwd attention");
            attention_backward(a.dqkv.ptr, a.attention_delta.ptr, a.datty.ptr, qkv, atty, a.lse.ptr + (size_t)l * N * H,
                               b, t, H, KV, hd, stream);
            prof.end();
            prof.begin("bwd rope");
            rope_backward(a.dqkv.ptr, rope_table.ptr, b, t, H, KV, hd, stream);
            prof.end();
            prof.begin("bwd qkv matmul + norm");
            matmul_backward(a.dnorm.ptr, g.wqkv + (size_t)l * QKV * C, a.dqkv.ptr, ln1, p.wqkv + (size_t)l * QKV * C,
                            N, C, QKV, stream);
            rmsnorm_backward(a.dresidual.ptr, g.attn_norm + (size_t)l * C, a.rmsnorm_scratch.ptr, a.dnorm.ptr, x,
                             p.attn_norm + (size_t)l * C, rstd1, N, C, stream);
            prof.end();
        }
        ProfileScope scope(prof, "bwd embedding");
        embedding_plan.build(host_inputs.data(), N, stream);
        encoder_backward(g.tok_embedding, a.dresidual.ptr, embedding_plan, C, stream);
    }

    void zero_grad() { cudaCheck(cudaMemsetAsync(grads.ptr, 0, grads.bytes(), stream)); }

    // Global gradient norm (before clipping).
    float grad_norm() {
        ProfileScope scope(profiler, "grad norm");
        global_norm_squared(acts.norm_partials.ptr, grads.ptr, num_params, 0, stream);
        global_norm_finish(acts.norm_value.ptr, acts.norm_partials.ptr, 1, stream);
        float norm;
        cudaCheck(cudaMemcpyAsync(&norm, acts.norm_value.ptr, sizeof(float), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
        return norm;
    }

    // One AdamW step (step is 1-based) with the gradients scaled by grad_scale; no weight decay on the gains.
    void update(float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale, int step,
                unsigned int seed) {
        ProfileScope scope(profiler, "optimizer");
        ParamLayout layout = param_layout(config);
        size_t offset = 0;
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            if (layout.sizes[t] == 0) continue;
            float wd = param_is_matrix(t) ? weight_decay : 0.0f;
            auto update_tensor = [&](auto* moment1, auto* moment2) {
                adamw_update(params.ptr + offset, master.ptr ? master.ptr + offset : nullptr, grads.ptr + offset,
                             moment1 + offset, moment2 + offset, layout.sizes[t], lr, beta1, beta2, step, eps, wd,
                             grad_scale, seed + (unsigned int)t, stream);
            };
            if (bf16_state) update_tensor(m_bf16.ptr, v_bf16.ptr);
            else update_tensor(m.ptr, v.ptr);
            offset += layout.sizes[t];
        }
    }

    // The master weights (which = 0), m (1) or v (2) as fp32 on the host, whatever their device precision, and back
    // (bf16 -> fp32 -> bf16 is exact, so a saved bf16 state restores bit for bit).
    std::vector<float> state_to_host(int which) const {
        std::vector<float> host(num_params);
        const DeviceBuffer<float>& fp32 = which == 0 ? master : (which == 1 ? m : v);
        if (which == 0 || !bf16_state) {
            cudaCheck(cudaMemcpy(host.data(), fp32.ptr, num_params * sizeof(float), cudaMemcpyDeviceToHost));
        } else {
            std::vector<__nv_bfloat16> raw(num_params);
            cudaCheck(cudaMemcpy(raw.data(), (which == 1 ? m_bf16 : v_bf16).ptr, num_params * 2,
                                 cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < num_params; i++) host[i] = __bfloat162float(raw[i]);
        }
        return host;
    }
    void state_from_host(int which, const std::vector<float>& host) {
        DeviceBuffer<float>& fp32 = which == 0 ? master : (which == 1 ? m : v);
        if (which == 0 || !bf16_state) {
            cudaCheck(cudaMemcpy(fp32.ptr, host.data(), num_params * sizeof(float), cudaMemcpyHostToDevice));
        } else {
            std::vector<__nv_bfloat16> raw(num_params);
            for (size_t i = 0; i < num_params; i++) raw[i] = __float2bfloat16_rn(host[i]);
            cudaCheck(cudaMemcpy((which == 1 ? m_bf16 : v_bf16).ptr, raw.data(), num_params * 2,
                                 cudaMemcpyHostToDevice));
        }
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

// ----------------------------------------------------------------------------------------------------------------
// Training state on disk: <out>/model_<step>.bin (our checkpoint format) and <out>/state_<step>.bin:
//   header 64 int32: [0] magic 20261123 [1] version 1 [2] step [3] floatX is bf16 (1) or fp32 (0)
//                    [4..5] num_params (low, high 32 bits) [6] has master weights
//   then master weights fp32 (num_params, if present), m and v (fp32 in the file, also when kept in bf16 on the
//   GPU), the train loader's state, the sampler RNG.
// Both are written atomically; the state file is written last, so a state file always has its model.

constexpr int STATE_MAGIC = 20261123;
constexpr int STATE_VERSION = 1;

static std::string step_path(const std::string& dir, const char* kind, int step) {
    char name[64];
    snprintf(name, sizeof(name), "%s_%08d.bin", kind, step);
    return dir + "/" + name;
}

static void save_training_state(const std::string& dir, Llama3& model, int step, DataLoader& loader,
                                uint64_t sampler_rng) {
    model.save(step_path(dir, "model", step).c_str());
    int32_t h[64] = {0};
    h[0] = STATE_MAGIC;
    h[1] = STATE_VERSION;
    h[2] = step;
#if defined(ENABLE_FP32)
    h[3] = 0;
#else
    h[3] = 1;
#endif
    h[4] = (int32_t)(model.num_params & 0xffffffffu);
    h[5] = (int32_t)(model.num_params >> 32);
    h[6] = model.master.ptr != nullptr;
    AtomicFile out(step_path(dir, "state", step));
    fwriteCheck(h, sizeof(int32_t), 64, out.fp, "state header");
    for (int which = model.master.ptr ? 0 : 1; which <= 2; which++) {
        std::vector<float> host = model.state_to_host(which);
        fwriteCheck(host.data(), sizeof(float), model.num_params, out.fp, "optimizer state");
    }
    loader.save_state(out.fp);
    fwriteCheck(&sampler_rng, sizeof(sampler_rng), 1, out.fp, "sampler rng");
    out.commit();
}

// Restores what save_training_state wrote. The model must already be loaded from the matching model file: it
// holds the parameters bit for bit (in bf16 builds the stochastic rounding of the master weights, which this
// file then restores exactly).
static void load_training_state(const std::string& path, Llama3& model, int* step, DataLoader& loader,
                                uint64_t* sampler_rng) {
    FILE* fp = fopenCheck(path.c_str(), "rb");
    int32_t h[64];
    freadCheck(h, sizeof(int32_t), 64, fp, "state header");
    size_t num_params = (size_t)(uint32_t)h[4] | ((size_t)(uint32_t)h[5] << 32);
    int has_master = model.master.ptr != nullptr;
#if defined(ENABLE_FP32)
    int is_bf16 = 0;
#else
    int is_bf16 = 1;
#endif
    if (h[0] != STATE_MAGIC || h[1] != STATE_VERSION || h[3] != is_bf16 || num_params != model.num_params ||
        h[6] != has_master) {
        fprintf(stderr,
                "Error: training state '%s' does not match this run (magic %d version %d, %s build, %zu params, "
                "master %d; expected magic %d version %d, %s build, %zu params, master %d)\n",
                path.c_str(), h[0], h[1], h[3] ? "bf16" : "fp32", num_params, h[6], STATE_MAGIC, STATE_VERSION,
                is_bf16 ? "bf16" : "fp32", model.num_params, has_master);
        fail_exit();
    }
    *step = h[2];
    std::vector<float> host(model.num_params);
    for (int which = model.master.ptr ? 0 : 1; which <= 2; which++) {
        freadCheck(host.data(), sizeof(float), model.num_params, fp, "optimizer state");
        model.state_from_host(which, host);
    }
    loader.load_state(fp, path.c_str());
    freadCheck(sampler_rng, sizeof(*sampler_rng), 1, fp, "sampler rng");
    fcloseCheck(fp);
}

// Steps of the training states in dir, ascending.
static std::vector<int> saved_steps(const std::string& dir) {
    std::vector<int> steps;
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return steps;
    while (struct dirent* e = readdir(d)) {
        int step;
        char tail[8];
        if (sscanf(e->d_name, "state_%d.bi%1s", &step, tail) == 2 && strcmp(tail, "n") == 0 &&
            strlen(e->d_name) == 18)
            steps.push_back(step);
    }
    closedir(d);
    std::sort(steps.begin(), steps.end());
    return steps;
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
    int B = 4, T = 1024;
    long total_batch = 0;  // tokens per step; 0: B * T
    float lr = 3e-4f, final_fraction = 0.0f, weight_decay = 0.1f, grad_clip = 1.0f;
    float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
    int warmup = 0;
    const char* schedule = "cosine";
    int max_steps = -1;  // -1: one epoch of the train data
    int val_every = 100, val_batches = 20, sample_every = 0, sample_length = 64;
    int checkpoint_every = 0, keep_checkpoints = 2, resume = 0, shuffle = 1;
    uint64_t seed = 1337;
    float peak_tflops = 0.0f;  // 0: from the GPU's name
    int recompute = 1, master_weights = 1, profile = 0;
    const char* optimizer_state = "fp32";
};

static void usage(const Options& d) {
    printf("Usage: ./train_llama3cu [options]\n");
    printf("Model (one of -e or -c):\n");
    printf("  -e <path>   start from this checkpoint (.bin) or Hugging Face model directory\n");
    printf("  -c <name>   from scratch: llama3.1-8B, llama3.2-1B, llama3.2-3B or dN (e.g. d12)\n");
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
    printf("  -o <dir>    output dir for log.txt and checkpoints, \"\" for none (default \"%s\")\n", d.out_dir);
    printf("  -n <int>    checkpoint every N steps, 0 never (default %d)\n", d.checkpoint_every);
    printf("  -r <int>    keep the last N checkpoints (default %d)\n", d.keep_checkpoints);
    printf("  -y <0|1>    resume from the latest checkpoint in -o (default %d)\n", d.resume);
    printf("  -X <dir>    at the end, write the model as a Hugging Face directory (config.json, safetensors in the\n"
           "              build's precision); add the tokenizer with scripts/convert_hf.py tokenizer (default none)\n");
    printf("Memory and speed:\n");
    printf("  -R <0|1|2>  activation recomputation: 0 none, 1 norms and swiglu, 2 also the w13 matmul (default %d)\n",
           d.recompute);
    printf("  -W <0|1>    fp32 master weights in bf16 builds (default %d; 0: bf16 params with stochastic rounding)\n",
           d.master_weights);
    printf("  -O <type>   AdamW m and v in fp32 or bf16 (stochastic rounding) (default %s)\n", d.optimizer_state);
    printf("  -p <0|1>    profile: time each region of the step with CUDA events, print a table (default %d)\n",
           d.profile);
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
            case 'o': o.out_dir = val; break;
            case 'X': o.export_dir = val; break;
            case 'n': o.checkpoint_every = (int)parse_int(flag, val, 0, 1 << 30); break;
            case 'r': o.keep_checkpoints = (int)parse_int(flag, val, 1, 1 << 20); break;
            case 'y': o.resume = (int)parse_int(flag, val, 0, 1); break;
            case 'P': o.peak_tflops = parse_float(flag, val, 0.001f, 1e6f); break;
            case 'R': o.recompute = (int)parse_int(flag, val, 0, 2); break;
            case 'W': o.master_weights = (int)parse_int(flag, val, 0, 1); break;
            case 'p': o.profile = (int)parse_int(flag, val, 0, 1); break;
            case 'O':
                if (strcmp(val, "fp32") != 0 && strcmp(val, "bf16") != 0) bad_flag(flag, val, "not fp32 or bf16");
                o.optimizer_state = val;
                break;
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

// Samples `length` tokens after <|begin_of_text|>, one forward per token, and prints them decoded.
static void print_sample(Llama3& model, const Tokenizer& tokenizer, int length, uint64_t* rng) {
    ProfilerPause pause(model.profiler);
    const Llama3Config& c = model.config;
    int max_len = std::min(length + 1, model.T);
    std::vector<int> tokens = {tokenizer.bos_id >= 0 ? tokenizer.bos_id : 0};
    std::vector<floatX> logits(c.vocab_size);
    std::vector<float> probs(c.vocab_size);
    ParamTensors<floatX> p = point_params(model.params.ptr, c);
    while ((int)tokens.size() < max_len) {
        int n = (int)tokens.size();
        model.forward(tokens.data(), nullptr, 1, n, 0.0f);
        matmul_forward(model.acts.logits.ptr, model.acts.lnf.ptr + (size_t)(n - 1) * c.dim, p.lm_head, 1, c.dim,
                       c.vocab_size, model.stream);
        cudaCheck(cudaMemcpyAsync(logits.data(), model.acts.logits.ptr, c.vocab_size * sizeof(floatX),
                                  cudaMemcpyDeviceToHost, model.stream));
        cudaCheck(cudaStreamSynchronize(model.stream));
        float maxval = -INFINITY;
        for (int i = 0; i < c.vocab_size; i++) maxval = std::max(maxval, (float)logits[i]);
        double sum = 0.0;
        for (int i = 0; i < c.vocab_size; i++) sum += probs[i] = expf((float)logits[i] - maxval);
        // xorshift64*: a uniform in [0, 1) for inverse-CDF sampling
        *rng ^= *rng >> 12; *rng ^= *rng << 25; *rng ^= *rng >> 27;
        double u = (double)((*rng * 2685821657736338717ull) >> 11) / 9007199254740992.0 * sum;
        int next = c.vocab_size - 1;
        for (int i = 0; i < c.vocab_size; i++) {
            u -= probs[i];
            if (u < 0) { next = i; break; }
        }
        tokens.push_back(next);
    }
    printf("sample: ");
    tokenizer_print(tokenizer, tokens.data() + 1, tokens.size() - 1, stdout);
    printf("\n");
}

int main(int argc, char** argv) {
    Options opt = parse_options(argc, argv);
    setvbuf(stdout, nullptr, _IOLBF, 0);

    int device_count = 0;
    cudaError_t err = cudaGetDeviceCount(&device_count);
    if (err != cudaSuccess || device_count == 0) {
        fprintf(stderr, "Error: no CUDA GPU available (%s); train_llama3cu needs one\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return 1;
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    cudaCheck(cudaFree(nullptr));  // create the context, so the baseline below excludes it
    size_t free_bytes, total_bytes;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    size_t baseline_used = total_bytes - free_bytes;

    // --- the model: from a checkpoint, from scratch, or from the latest training state
    bool from_file = opt.model_path[0] != '\0', from_name = opt.config_name[0] != '\0';
    Llama3Config named;
    if (from_name && !config_from_name(opt.config_name, opt.depth, &named)) {
        bad_flag("-c", opt.config_name, "not llama3.1-8B, llama3.2-1B, llama3.2-3B or dN");
    }
    if (!from_file && !from_name) {
        fprintf(stderr, "Error: give a checkpoint (-e model.bin) or a config to train from scratch (-c d12)\n");
        return 1;
    }
    std::string out_dir = opt.out_dir;
    if (!out_dir.empty() && !make_dirs(out_dir)) {
        fprintf(stderr, "Error: could not create output dir '%s': %s\n", out_dir.c_str(), strerror(errno));
        return 1;
    }
    std::vector<int> previous = out_dir.empty() ? std::vector<int>() : saved_steps(out_dir);
    if (opt.resume && out_dir.empty()) bad_flag("-y", "1", "resuming needs an output dir (-o)");
    if (opt.resume && previous.empty()) {
        fprintf(stderr, "Error: -y 1 but no checkpoint (state_*.bin) in '%s'\n", out_dir.c_str());
        return 1;
    }

    Llama3 model;
    cudaCheck(cudaStreamCreate(&model.stream));
    model.use_master = opt.master_weights != 0;
    model.bf16_state = strcmp(opt.optimizer_state, "bf16") == 0;
    model.recompute = opt.recompute;
    model.profiler.timing = opt.profile != 0;
    model.profiler.stream = model.stream;
    matmul_init(model.stream);
    int start_step = 0;
    if (opt.resume) {
        model.load(step_path(out_dir, "model", previous.back()).c_str());
    } else if (from_file) {
        model.load(opt.model_path);
    } else {
        model.init_from_scratch(named, opt.seed);
    }
    const Llama3Config& c = model.config;
    if (from_file && from_name) {
        int32_t a[CHECKPOINT_HEADER_SLOTS], b[CHECKPOINT_HEADER_SLOTS];
        config_to_header(c, 0, a);
        config_to_header(named, 0, b);
        if (memcmp(a, b, sizeof(a)) != 0) {
            fprintf(stderr, "Error: checkpoint '%s' (C=%d L=%d H=%d KV=%d F=%d V=%d) disagrees with -c %s -d %d\n",
                    opt.model_path, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.vocab_size,
                    opt.config_name, opt.depth);
            return 1;
        }
    }
    if (opt.T > c.max_seq_len) {
        char why[96];
        snprintf(why, sizeof(why), "above the model's max_seq_len %d", c.max_seq_len);
        bad_flag("-t", std::to_string(opt.T).c_str(), why);
    }
    long tokens_per_micro = (long)opt.B * opt.T;
    long total_batch = opt.total_batch > 0 ? opt.total_batch : tokens_per_micro;
    if (total_batch % tokens_per_micro != 0) {
        fprintf(stderr, "Error: -g %ld is not a multiple of B*T = %d*%d = %ld\n", total_batch, opt.B, opt.T,
                tokens_per_micro);
        return 1;
    }
    int grad_accum = (int)(total_batch / tokens_per_micro);

    // --- data
    DataLoader train_loader, val_loader;
    train_loader.init(opt.train_pattern, opt.B, opt.T, 0, 1, opt.shuffle, opt.seed, c.vocab_size);
    bool have_val = opt.val_pattern[0] != '\0' && opt.val_every > 0;
    if (have_val) val_loader.init_eval(opt.val_pattern, opt.B, opt.T, 0, 1, c.vocab_size);
    Tokenizer tokenizer;
    bool have_tokenizer = opt.tokenizer_path[0] != '\0';
    if (have_tokenizer) tokenizer.init(opt.tokenizer_path);
    if (have_tokenizer && tokenizer.vocab_size < c.vocab_size) {
        fprintf(stderr, "Error: tokenizer '%s' has %d tokens, the model %d\n", opt.tokenizer_path,
                tokenizer.vocab_size, c.vocab_size);
        return 1;
    }
    int max_steps = opt.max_steps >= 0 ? opt.max_steps : (int)(train_loader.num_batches() / grad_accum);
    uint64_t sampler_rng = opt.seed * 0x9E3779B97F4A7C15ull + 1;
    if (opt.resume) {
        load_training_state(step_path(out_dir, "state", previous.back()), model, &start_step, train_loader,
                            &sampler_rng);
        printf("resumed from %s at step %d\n", step_path(out_dir, "state", previous.back()).c_str(), start_step);
    }

    model.allocate_activations(opt.B, opt.T);
    ScheduleType schedule_type;
    parse_schedule(opt.schedule, &schedule_type);
    LRSchedule schedule{schedule_type, opt.lr, opt.warmup, max_steps, opt.final_fraction};
    float peak = opt.peak_tflops > 0 ? opt.peak_tflops : peak_tflops_for(prop.name);
    double flops_per_step = model.flops_per_token(opt.T) * (double)total_batch;

    printf("device: %s | precision %s | peak %.0f TFLOP/s for MFU\n", prop.name, PRECISION_NAME, peak);
    printf("model: V=%d C=%d L=%d H=%d KV=%d F=%d max_seq_len=%d tied=%d rope_scaling=%d | %.1fM parameters\n",
           c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.max_seq_len, c.tied_embeddings,
           c.use_rope_scaling, model.num_params / 1e6);
    printf("batch: B=%d T=%d grad_accum=%d (%ld tokens/step) | steps %d..%d | train tokens %lld\n", opt.B, opt.T,
           grad_accum, total_batch, start_step + 1, max_steps, (long long)train_loader.total_tokens);
    printf("flops/token %.3e (6 x matmul weights + 6 L H hd T causal attention)\n", model.flops_per_token(opt.T));
    printf("memory: recompute level %d, master weights %s, AdamW state %s; mem = device memory in use beyond the CUDA "
           "context\n", model.recompute, model.master.ptr ? "fp32" : "none", model.bf16_state ? "bf16" : "fp32");

    FILE* log = nullptr;
    if (!out_dir.empty()) log = fopenCheck((out_dir + "/log.txt").c_str(), opt.resume ? "a" : "w");

    auto evaluate = [&](int step) {
        ProfilerPause pause(model.profiler);
        val_loader.reset();
        double sum = 0.0;
        int batches = 0;
        while ((opt.val_batches < 0 || batches < opt.val_batches) && val_loader.next_batch()) {
            model.forward(val_loader.inputs.data(), val_loader.targets.data(), opt.B, opt.T, 0.0f);
            sum += model.mean_loss(opt.B * opt.T);
            batches++;
        }
        float val_loss = batches > 0 ? (float)(sum / batches) : NAN;
        printf("step %d | val loss %.6f (%d batches)\n", step, val_loss, batches);
        if (log) { fprintf(log, "step %d val_loss %.6f\n", step, val_loss); fflush(log); }
    };

    size_t peak_used = 0;
    std::vector<double> step_times;
    for (int step = start_step + 1; step <= max_steps; step++) {
        cudaCheck(cudaStreamSynchronize(model.stream));
        auto t0 = std::chrono::steady_clock::now();
        model.zero_grad();
        double loss_sum = 0.0;
        for (int micro = 0; micro < grad_accum; micro++) {
            train_loader.next_batch();  // endless: epochs follow one another
            model.forward(train_loader.inputs.data(), train_loader.targets.data(), opt.B, opt.T,
                          1.0f / (float)(tokens_per_micro * grad_accum));
            model.backward(opt.B, opt.T);
            loss_sum += model.mean_loss(opt.B * opt.T);
        }
        float loss = (float)(loss_sum / grad_accum);
        float norm = model.grad_norm();
        float grad_scale = opt.grad_clip > 0.0f ? std::min(1.0f, opt.grad_clip / (norm + 1e-6f)) : 1.0f;
        float lr = schedule.at(step - 1);
        model.update(lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, grad_scale, step, (unsigned int)opt.seed);
        cudaCheck(cudaStreamSynchronize(model.stream));
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        double tok_s = total_batch / (ms / 1000.0);
        double mfu = peak > 0 ? flops_per_step / (ms / 1000.0) / (peak * 1e12) * 100.0 : 0.0;
        cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
        size_t used = total_bytes - free_bytes - baseline_used;
        peak_used = std::max(peak_used, used);
        model.profiler.collect();
        step_times.push_back(ms);
        printf("step %5d/%d | loss %.6f | norm %.4f | lr %.2e | %.1f ms | %.0f tok/s | MFU %.1f%% | mem %.2f GiB\n",
               step, max_steps, loss, norm, lr, ms, tok_s, mfu, used / 1073741824.0);
        if (log) {
            fprintf(log, "step %d train_loss %.6f norm %.4f lr %.4e ms %.2f\n", step, loss, norm, lr, ms);
            fflush(log);
        }
        if (have_val && (step % opt.val_every == 0 || step == max_steps)) evaluate(step);
        if (have_tokenizer && opt.sample_every > 0 && (step % opt.sample_every == 0 || step == max_steps))
            print_sample(model, tokenizer, opt.sample_length, &sampler_rng);
        if (!out_dir.empty() && opt.checkpoint_every > 0 && (step % opt.checkpoint_every == 0 || step == max_steps)) {
            save_training_state(out_dir, model, step, train_loader, sampler_rng);
            std::vector<int> steps = saved_steps(out_dir);
            for (size_t i = 0; i + opt.keep_checkpoints < steps.size(); i++) {
                remove(step_path(out_dir, "state", steps[i]).c_str());
                remove(step_path(out_dir, "model", steps[i]).c_str());
            }
            printf("saved checkpoint %s\n", step_path(out_dir, "state", step).c_str());
        }
    }
    if (step_times.size() >= 2) {  // the median over the steps after warm-up (the first 3, or 1 in short runs)
        size_t warmup = step_times.size() > 6 ? 3 : 1;
        std::vector<double> steady(step_times.begin() + warmup, step_times.end());
        std::sort(steady.begin(), steady.end());
        double median_ms = steady[steady.size() / 2];
        printf("summary: median step %.2f ms over %zu steps | %.0f tok/s | MFU %.1f%% | peak mem %.2f GiB\n",
               median_ms, steady.size(), total_batch / (median_ms / 1000.0),
               peak > 0 ? flops_per_step / (median_ms / 1000.0) / (peak * 1e12) * 100.0 : 0.0,
               peak_used / 1073741824.0);
        model.profiler.report(median_ms);
    }
    if (opt.export_dir[0] != '\0') {
        model.save_hf(opt.export_dir);
        printf("exported %s (Hugging Face format)\n", opt.export_dir);
    }
    if (log) fcloseCheck(log);
    matmul_destroy();
    cudaCheck(cudaStreamDestroy(model.stream));
    return 0;
}
#endif
