// Ties the CUDA trainer out against a debug state written by scripts/train_llama3.py (fp32 PyTorch, TF32 off):
// logits, loss, the gradient of every parameter tensor, and the loss and grad norm of each AdamW step. A debug state
// with a loss mask (targets of -1) checks the masked loss: the mean over the counted targets, and the gradients
// both from the whole batch and accumulated over one micro-batch per row (as the trainer accumulates: every
// micro-batch scaled by 1 / the count of the whole batch, although the rows count different numbers of targets).
//
//   make test_llama3cu PRECISION=FP32 && ./test_llama3cu model.bin debug.bin [recompute level 0|1|2]
//
// Tolerances, per tensor, with max_rel = max |got - ref| / max |ref| and rel_norm = ||got - ref|| / ||ref||:
//   FP32 build: everything is fp32 with different summation orders and fast-math exp/rsqrt (a few ulps per op):
//     logits and gradients max_rel <= 1e-4 and rel_norm <= 1e-5; losses |diff| <= 1e-5 (5e-5 after 5 steps);
//     grad norms relative 1e-4.
//   BF16 build: every activation, weight and gradient is rounded to bf16 (unit roundoff u = 2^-9 = 1.95e-3).
//     Independent roundings add in quadrature, so k roundings along a path give about sqrt(k) u: a forward of a
//     few layers has k ~ 20-30 (norm, matmul, rope, attention, swiglu, residual per layer), the backward about
//     twice that. Bounds: logits rel_norm <= 2e-2 (~10 u), gradients rel_norm <= 5e-2 (~25 u); max_rel, which one
//     unlucky element decides, only as a sanity bound (1e-1 logits, 2e-1 gradients);
//     losses |diff| <= 2e-2 at step 1 (the loss is a mean: its error is far below the per-logit one), and
//     <= 5e-2 over the steps (bf16 stochastic-rounded weights drift from the fp32 trajectory); grad norms relative 5e-2.
// Exits 1 if any check fails.
#define TESTING
#include "train_llama3.cu"

#include "llmc/debug_state.h"

#if defined(ENABLE_FP32)
constexpr double LOGITS_MAX_REL = 1e-4, LOGITS_REL_NORM = 1e-5, GRAD_MAX_REL = 1e-4, GRAD_REL_NORM = 1e-5;
constexpr double LOSS_TOL = 1e-5, STEP_LOSS_TOL = 5e-5, NORM_REL_TOL = 1e-4;
#else
constexpr double LOGITS_MAX_REL = 1e-1, LOGITS_REL_NORM = 2e-2, GRAD_MAX_REL = 2e-1, GRAD_REL_NORM = 5e-2;
constexpr double LOSS_TOL = 2e-2, STEP_LOSS_TOL = 5e-2, NORM_REL_TOL = 5e-2;
#endif

static TieOutChecks checks;

template <typename T>
static std::vector<float> to_host_floats(const T* device, size_t n) {
    std::vector<T> raw(n);
    cudaCheck(cudaMemcpy(raw.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
    return std::vector<float>(raw.begin(), raw.end());
}

int main(int argc, char** argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s model.bin debug.bin [recompute level 0|1|2]\n", argv[0]);
        return 2;
    }
    int device_count = 0;
    if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
        fprintf(stderr, "Error: no CUDA GPU available; test_llama3cu needs one\n");
        return 1;
    }
    Llama3 model;
    cudaCheck(cudaStreamCreate(&model.stream));
    matmul_init(model.stream);
    model.recompute = argc == 4 ? atoi(argv[3]) : 0;
    if (model.recompute < 0 || model.recompute > 2) {
        fprintf(stderr, "Error: recompute level '%s' is not 0, 1 or 2\n", argv[3]);
        return 2;
    }
    model.load(argv[1]);
    const Llama3Config& c = model.config;
    DebugState ref = load_debug_state(argv[2], c);
    int N = ref.B * ref.T;
    model.allocate_activations(ref.B, ref.T);
    if (model.classifier_chunk < N) {
        fprintf(stderr, "Error: B*T=%d rows exceed one classifier chunk (%d): use a smaller debug batch\n", N,
                model.classifier_chunk);
        return 1;
    }
    printf("[%s, recompute %d] model %s: V=%d C=%d L=%d H=%d KV=%d F=%d tied=%d rope_scaling=%d | B=%d T=%d steps=%d\n",
           PRECISION_NAME, model.recompute, argv[1], c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden,
           c.tied_embeddings, c.use_rope_scaling, ref.B, ref.T, ref.n_steps);

    int64_t counted = count_targets(ref.targets.data(), N);
    if (counted == 0) {
        fprintf(stderr, "Error: debug state '%s' masks every target: there is no loss to compare\n", argv[2]);
        return 1;
    }
    float dloss = 1.0f / (float)counted;
    ParamLayout layout = param_layout(c);
    auto check_grads = [&](const char* suffix) {
        std::vector<float> grads = to_host_floats(model.grads.ptr, model.num_params);
        size_t offset = 0;
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            if (layout.sizes[t] == 0) continue;
            std::string name = std::string("d") + layout.names[t] + suffix;
            checks.tensor(name.c_str(), grads.data() + offset, ref.grads.data() + offset, layout.sizes[t],
                          GRAD_MAX_REL, GRAD_REL_NORM);
            offset += layout.sizes[t];
        }
    };

    // forward without gradients: the logits stay in the chunk buffer
    model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
    model.classifier(ref.B, ref.T, 0.0f);
    float loss = (float)(model.loss_sum(N) / counted);
    std::vector<float> logits = to_host_floats(model.acts.logits.ptr, (size_t)N * c.vocab_size);
    checks.tensor("logits", logits.data(), ref.logits.data(), logits.size(), LOGITS_MAX_REL, LOGITS_REL_NORM);
    checks.scalar("loss", loss, ref.loss, LOSS_TOL, 0.0);

    if (counted < N && ref.B > 1) {  // masked: the gradients accumulated over one micro-batch per row
        printf("%lld of %d targets count; accumulating over %d micro-batches of one row:\n", (long long)counted, N,
               ref.B);
        model.zero_grad();
        double accum_loss = 0.0;
        for (int b = 0; b < ref.B; b++) {
            model.forward(ref.inputs.data() + (size_t)b * ref.T, ref.targets.data() + (size_t)b * ref.T, 1, ref.T);
            model.classifier(1, ref.T, dloss);
            model.backward(1, ref.T);
            accum_loss += model.loss_sum(ref.T);
        }
        checks.scalar("loss (accum)", (float)(accum_loss / counted), ref.loss, LOSS_TOL, 0.0);
        check_grads(" (accum)");
    }

    // forward + backward: every parameter gradient
    model.zero_grad();
    model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
    model.classifier(ref.B, ref.T, dloss);
    model.backward(ref.B, ref.T);
    check_grads("");

    // the AdamW steps on the same batch (step 1 reuses the gradients above)
    for (int step = 1; step <= ref.n_steps; step++) {
        if (step > 1) {
            model.zero_grad();
            model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
            model.classifier(ref.B, ref.T, dloss);
            model.backward(ref.B, ref.T);
        }
        float step_loss = (float)(model.loss_sum(N) / counted);
        float norm = model.grad_norm();
        float scale = ref.grad_clip > 0.0f ? std::min(1.0f, ref.grad_clip / (norm + 1e-6f)) : 1.0f;
        model.update(ref.lr, ref.beta1, ref.beta2, ref.eps, ref.weight_decay, scale, step, 1337u);
        char name[32];
        snprintf(name, sizeof(name), "step %d loss", step);
        checks.scalar(name, step_loss, ref.step_losses[step - 1], step <= 5 ? LOSS_TOL : STEP_LOSS_TOL, 0.0);
        snprintf(name, sizeof(name), "step %d norm", step);
        checks.scalar(name, norm, ref.step_norms[step - 1], 0.0, NORM_REL_TOL);
    }
    matmul_destroy();
    return checks.finish();
}
