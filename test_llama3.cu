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
//   BF16 build: no fixed numbers. How far a bf16 computation may stray from fp32 depends on the case (depth, widths,
//     the lr, how fast training amplifies rounding), so the bound of each measure comes from PyTorch's own bf16 error
//     on the same case: scripts/train_llama3.py runs the debug case a second time under torch.autocast(bfloat16)
//     (the same weights, batch and AdamW steps, fp32 master weights) and stores that run's errors against the same
//     fp32 reference in the debug state. Ours must be within BF16_MULTIPLE (4) times PyTorch's, plus a floor of one
//     bf16 rounding (u = 2^-9), for every measure: logits and each gradient tensor (max_rel and rel_norm; floor u),
//     the loss (floor u |loss| / sqrt(counted targets): the loss is a mean of that many per-row terms, each off by
//     about u |loss|), and at each AdamW step the loss and the relative grad norm, where PyTorch's error is taken as
//     the largest over the steps so far (training amplifies any rounding, and which step lands close is chance).
//     Why 4: this build keeps in bf16 some of what autocast keeps in fp32 (the activations between the kernels and
//     their gradients); a PyTorch model run entirely in bf16 on the fixtures' configs and d3 is 1.1-2.6 times as far
//     from fp32 as autocast on logits and gradients, and on an H100 our step losses and grad norms came out at up
//     to 3.7 times autocast's (test-mha's step 3 norm at lr 3e-3). A bug moves errors by orders of magnitude.
// Exits 1 if any check fails.
#define TESTING
#include "train_llama3.cu"

#include "llmc/debug_state.h"

// the FP32 build's tolerances
constexpr double LOGITS_MAX_REL = 1e-4, LOGITS_REL_NORM = 1e-5, GRAD_MAX_REL = 1e-4, GRAD_REL_NORM = 1e-5;
constexpr double LOSS_TOL = 1e-5, STEP_LOSS_TOL = 5e-5, NORM_REL_TOL = 1e-4;
// the BF16 build's: BF16_MULTIPLE times PyTorch's bf16 autocast error, plus a floor of one bf16 rounding (u = 2^-9)
[[maybe_unused]] constexpr double BF16_MULTIPLE = 4.0, BF16_FLOOR = 1.0 / 512;  // unused in the FP32 build

static TieOutChecks checks;

// One measure's bound: the FP32 build's fixed tolerance, or in the BF16 build BF16_MULTIPLE times PyTorch's bf16
// autocast error on the same measure plus the floor.
static double bound(double fp32_tol, double torch_bf16_error, double bf16_floor) {
#if defined(ENABLE_FP32)
    (void)torch_bf16_error; (void)bf16_floor;
    return fp32_tol;
#else
    (void)fp32_tol;
    return BF16_MULTIPLE * torch_bf16_error + bf16_floor;
#endif
}

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
#if !defined(ENABLE_FP32)
    if (!ref.has_bf16_reference) {
        fprintf(stderr, "Error: debug state '%s' holds no bf16 reference errors (slot 7 is 0), which the BF16 build's "
                "bounds are made of: write it with scripts/train_llama3.py --write_debug (--dtype float32)\n", argv[2]);
        return 1;
    }
#endif
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
#if !defined(ENABLE_FP32)
    printf("bounds: %.0f x PyTorch's bf16 autocast error on this case (from the debug state) + one bf16 rounding\n",
           BF16_MULTIPLE);
#endif

    int64_t counted = count_targets(ref.targets.data(), N);
    if (counted == 0) {
        fprintf(stderr, "Error: debug state '%s' masks every target: there is no loss to compare\n", argv[2]);
        return 1;
    }
    float dloss = 1.0f / (float)counted;
    ParamLayout layout = param_layout(c);
    const DebugState::Bf16Reference& torch_bf16 = ref.bf16;  // zeros in the FP32 build when the file has none
    auto torch_error = [&](const std::vector<float>& errors, size_t i) {
        return i < errors.size() ? (double)errors[i] : 0.0;
    };
    // the floor of a loss: u |loss| / sqrt(counted targets), see the top of the file
    auto loss_floor = [&](float ref_loss) { return BF16_FLOOR * fabs(ref_loss) / sqrt((double)counted); };
    auto check_grads = [&](const char* suffix) {
        std::vector<float> grads = to_host_floats(model.grads.buffer.ptr, model.num_params);
        size_t offset = 0, k = 0;
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            if (layout.sizes[t] == 0) continue;
            std::string name = std::string("d") + layout.names[t] + suffix;
            checks.tensor(name.c_str(), grads.data() + offset, ref.grads.data() + offset, layout.sizes[t],
                          bound(GRAD_MAX_REL, torch_error(torch_bf16.grad_max_rel, k), BF16_FLOOR),
                          bound(GRAD_REL_NORM, torch_error(torch_bf16.grad_rel_norm, k), BF16_FLOOR));
            offset += layout.sizes[t];
            k++;
        }
    };

    // forward without gradients: the logits stay in the chunk buffer
    model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
    model.classifier(ref.B, ref.T, 0.0f);
    float loss = (float)(model.loss_sum(N) / counted);
    std::vector<float> logits = to_host_floats(model.acts.logits, (size_t)N * c.vocab_size);
    checks.tensor("logits", logits.data(), ref.logits.data(), logits.size(),
                  bound(LOGITS_MAX_REL, torch_bf16.logits_max_rel, BF16_FLOOR),
                  bound(LOGITS_REL_NORM, torch_bf16.logits_rel_norm, BF16_FLOOR));
    checks.scalar("loss", loss, ref.loss, bound(LOSS_TOL, torch_bf16.loss, loss_floor(ref.loss)), 0.0);

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
        checks.scalar("loss (accum)", (float)(accum_loss / counted), ref.loss,
                      bound(LOSS_TOL, torch_bf16.loss, loss_floor(ref.loss)), 0.0);
        check_grads(" (accum)");
    }

    // forward + backward: every parameter gradient
    model.zero_grad();
    model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
    model.classifier(ref.B, ref.T, dloss);
    model.backward(ref.B, ref.T);
    check_grads("");

    // the AdamW steps on the same batch (step 1 reuses the gradients above); PyTorch's bf16 error so far
    double torch_loss_error = 0.0, torch_norm_error = 0.0;
    for (int step = 1; step <= ref.n_steps; step++) {
        torch_loss_error = fmax(torch_loss_error, torch_error(torch_bf16.step_losses, step - 1));
        torch_norm_error = fmax(torch_norm_error, torch_error(torch_bf16.step_norms, step - 1));
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
        checks.scalar(name, step_loss, ref.step_losses[step - 1],
                      bound(step <= 5 ? LOSS_TOL : STEP_LOSS_TOL, torch_loss_error, loss_floor(ref.step_losses[step - 1])),
                      0.0);
        snprintf(name, sizeof(name), "step %d norm", step);
        checks.scalar(name, norm, ref.step_norms[step - 1], 0.0, bound(NORM_REL_TOL, torch_norm_error, BF16_FLOOR));
    }
    matmul_destroy();
    return checks.finish();
}
