// Ties the CUDA trainer out against a debug state written by scripts/train_llama3.py (fp32 PyTorch, TF32 off):
// logits, loss, the gradient of every parameter tensor, and the loss and grad norm of each AdamW step. A debug state
// with a loss mask (targets of -1) checks the masked loss: the mean over the counted targets, and the gradients
// both from the whole batch and accumulated over one micro-batch per row (as the trainer accumulates: every
// micro-batch scaled by 1 / the count of the whole batch, although the rows count different numbers of targets).
//
//   make test_llama3cu PRECISION=FP32 && ./test_llama3cu model.bin debug.bin [recompute level 0|1|2]
//   make test_llama3cu && ./test_llama3cu -M fp8 model.bin fp8_debug.bin [recompute level 0|1|2]
//
// -M fp8 ties out the trainer's FP8 mode (train_llama3cu -M fp8: the four products of every layer on FP8 tensor
// cores, e4m3 operands forward, e5m2 output gradient, per-tensor current scaling). It needs the BF16 build, a GPU
// of compute capability 8.9 or later, token counts and model widths that are multiples of 16 (B*T, and T where a
// masked batch accumulates row by row; llmc/flag_checks.h fp8_shapes), and a debug state written with --fp8: the
// same fp32 reference, with the error section of PyTorch's emulation of the FP8 recipe instead of bf16 autocast's.
// The file does not say which recipe its errors are of: against a plain debug state the FP8 mode fails (as
// dev/test/test_gpu.py checks), and the bf16 mode against an FP8 one would pass bounds far too loose for it.
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
//   FP8 mode (-M fp8): the same multiple and floors, of the error of PyTorch's FP8 emulation (the --fp8 debug
//     state's). The emulation casts as the trainer does (bf16 operands, the same scales, round to nearest even) but
//     sums the exact products in fp32, where Hopper's FP8 tensor cores add in a window of about 13 bits with periodic
//     promotion to fp32 (llmc/matmul_fp8.cuh). Per element that error is far below the rounding of the operands
//     (e4m3 u = 2^-4, e5m2 u = 2^-3), which both runs share (the same bf16 values under the same scale round to the
//     same FP8 values, bar the few whose bf16 inputs differ), but it is systematic: on llama3.2-1B at depth 2 (K up
//     to 8192) it moved our loss by 9.0e-3 where the exact emulation's moved 5.7e-4, 2.07 times the bound (H200).
//     So on the GPU the debug states are written with --fp8_scaled_mm (dev/test/test_gpu.py): PyTorch's FP8 products
//     on the same tensor cores (torch._scaled_mm), whose error has that part too; there the same case came to 0.64
//     of its bounds, at most 3.00 times PyTorch's error. The committed test-fp8 fixture (C = 48: short sums) is
//     written on the CPU with the exact emulation; it came to 0.34 of its bounds (H200). What ours adds to PyTorch's FP8 error is then what the
//     bf16 mode adds to autocast's (bf16 activations between the kernels), to an error 4-20 times larger (PyTorch's
//     FP8 gradients against its bf16 ones on test-fp8), so the multiple carries over with room: a PyTorch FP8 run
//     with bf16 activations, the CPU stand-in for ours, came out at 0.9-1.35 times the emulation on logits and
//     gradients, and at most 0.4 of the bounds over 8 seeds of test-fp8.
//     The floors stay one bf16 rounding. A floor is for a measure where PyTorch's error is small by chance, and what
//     two FP8 runs then still differ in is the bf16 values they store. Floors in FP8 units would be as large as the
//     errors themselves (the layers' weight gradients are 7-10% from fp32; e5m2's u is 12.5%), and with them the FP8
//     mode would pass against bf16 autocast's errors: they could not tell FP8 error from bf16 error. The FP8 units
//     are in PyTorch's error, and so in the bound through the multiple.
//     The steps are the chancy measures: FP8 gradients are ~8% off per element, and AdamW's first updates, nearly
//     sign(g), then move the smallest weights differently in any two FP8 runs. At lr 3e-3 the stand-in's step 2-3
//     norms reached 1.4 times their bound on test-fp8, at 3e-4 at most 0.4: the FP8 debug cases train at lr 3e-4
//     or below (dev/test/test_gpu.py, dev/fixtures/make_fixtures.sh).
// Exits 1 if any check fails (2 on bad arguments); the last lines tell how close the case came to its bounds.
#define TESTING
#include "train_llama3.cu"

#include "llmc/debug_state.h"

// the FP32 build's tolerances
constexpr double LOGITS_MAX_REL = 1e-4, LOGITS_REL_NORM = 1e-5, GRAD_MAX_REL = 1e-4, GRAD_REL_NORM = 1e-5;
constexpr double LOSS_TOL = 1e-5, STEP_LOSS_TOL = 5e-5, NORM_REL_TOL = 1e-4;
// the BF16 build's (both modes): BF16_MULTIPLE times PyTorch's error, plus a floor of one bf16 rounding (u = 2^-9)
constexpr double BF16_MULTIPLE = 4.0, BF16_FLOOR = 1.0 / 512;

static TieOutChecks checks;

// One measure's bound: the FP32 build's fixed tolerance, or in the BF16 build BF16_MULTIPLE times PyTorch's error
// on the same measure plus the floor.
static double bound(double fp32_tol, double torch_error, double floor) {
#if defined(ENABLE_FP32)
    (void)torch_error; (void)floor;
    return fp32_tol;
#else
    (void)fp32_tol;
    return BF16_MULTIPLE * torch_error + floor;
#endif
}

// How close the case comes to its bounds: the check that uses the largest fraction of its bound, and, among the
// measures whose bound the multiple sets (BF16_MULTIPLE x PyTorch's error above the floor), the largest ratio of
// our error to PyTorch's, which is what BF16_MULTIPLE has to cover.
struct Margins {
    double fraction = 0.0, ratio = 0.0;
    std::string closest, largest;

    void add(const std::string& measure, double error, double bound, double torch_error, double floor) {
        if (error / bound > fraction) {
            fraction = error / bound;
            closest = measure;
        }
        if (BF16_MULTIPLE * torch_error > floor && error / torch_error > ratio) {
            ratio = error / torch_error;
            largest = measure;
        }
    }
};
static Margins margins;

// logits or a gradient tensor: max_rel and rel_norm
static void check_tensor(const std::string& name, const float* got, const float* ref, size_t n, double fp32_max_rel,
                         double fp32_rel_norm, double torch_max_rel, double torch_rel_norm) {
    double max_rel_bound = bound(fp32_max_rel, torch_max_rel, BF16_FLOOR);
    double rel_norm_bound = bound(fp32_rel_norm, torch_rel_norm, BF16_FLOOR);
    checks.tensor(name.c_str(), got, ref, n, max_rel_bound, rel_norm_bound);
    TensorError e = tensor_error(got, ref, n);
    margins.add(name + " max_rel", e.max_rel, max_rel_bound, torch_max_rel, BF16_FLOOR);
    margins.add(name + " rel_norm", e.rel_norm, rel_norm_bound, torch_rel_norm, BF16_FLOOR);
}

// a loss: |got - ref|
static void check_loss(const char* name, float got, float ref, double fp32_tol, double torch_error, double floor) {
    double b = bound(fp32_tol, torch_error, floor);
    checks.scalar(name, got, ref, b, 0.0);
    margins.add(name, fabs((double)got - ref), b, torch_error, floor);
}

// a grad norm: |got - ref| / |ref|
static void check_norm(const char* name, float got, float ref, double torch_error) {
    double b = bound(NORM_REL_TOL, torch_error, BF16_FLOOR);
    checks.scalar(name, got, ref, 0.0, b);
    margins.add(name, fabs((double)got - ref) / fabs((double)ref), b, torch_error, BF16_FLOOR);
}

template <typename T>
static std::vector<float> to_host_floats(const T* device, size_t n) {
    std::vector<T> raw(n);
    cudaCheck(cudaMemcpy(raw.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
    return std::vector<float>(raw.begin(), raw.end());
}

int main(int argc, char** argv) {
    const char* program = argv[0];
    const char* matmul_precision = "bf16";  // of the layers' products, as train_llama3cu's -M
    if (argc >= 3 && strcmp(argv[1], "-M") == 0) {
        matmul_precision = argv[2];
        argc -= 2;
        argv += 2;
    }
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s [-M bf16|fp8] model.bin debug.bin [recompute level 0|1|2]   (this build: %s)\n",
                program, PRECISION_NAME);
        return 2;
    }
    if (strcmp(matmul_precision, "bf16") != 0 && strcmp(matmul_precision, "fp8") != 0) {
        fprintf(stderr, "Error: invalid value '%s' for -M: not bf16 or fp8\n", matmul_precision);
        return 2;
    }
    const bool fp8 = strcmp(matmul_precision, "fp8") == 0;
    if (fp8 && sizeof(floatX) != 2) {
        fprintf(stderr, "Error: -M fp8 ties out FP8 matmuls, which need the BF16 build (this build: %s; make "
                "test_llama3cu PRECISION=BF16)\n", PRECISION_NAME);
        return 2;
    }
    int recompute = argc == 4 ? atoi(argv[3]) : 0;
    if (recompute < 0 || recompute > 2) {
        fprintf(stderr, "Error: recompute level '%s' is not 0, 1 or 2\n", argv[3]);
        return 2;
    }
    // the files, and whether they suit this build and mode, before the GPU is touched
    Llama3Config c;
    std::vector<float> initial_params = load_model_fp32(argv[1], &c);
    DebugState ref = load_debug_state(argv[2], c);
#if !defined(ENABLE_FP32)
    if (!ref.has_bf16_reference) {
        fprintf(stderr, "Error: debug state '%s' holds no reference errors (slot 7 is 0), which the BF16 build's "
                "bounds are made of: write it with scripts/train_llama3.py %s--write_debug (--dtype float32)\n",
                argv[2], fp8 ? "--fp8 " : "");
        return 1;
    }
#endif
    int N = ref.B * ref.T;
    int64_t counted = count_targets(ref.targets.data(), N);
    if (counted == 0) {
        fprintf(stderr, "Error: debug state '%s' masks every target: there is no loss to compare\n", argv[2]);
        return 1;
    }
    const bool accumulates = counted < N && ref.B > 1;  // the masked gradients, accumulated a row at a time
    if (fp8) {
        // a masked batch's row-at-a-time forwards have T tokens: not a multiple of 16, they would quietly run bf16
        int tokens = accumulates ? ref.T : N;
        if (tokens % 16 != 0) {
            fprintf(stderr, "Error: -M fp8 needs the token count of every product a multiple of 16 (FP8 tensor "
                    "cores), but debug state '%s' (B=%d T=%d%s) has %d: write it with another --batch_size or "
                    "--seq_len\n", argv[2], ref.B, ref.T, accumulates ? ", masked: accumulated a row at a time" : "",
                    tokens);
            return 1;
        }
        std::string err = fp8_shapes(tokens, c.dim, c.qkv_dim(), c.n_heads * c.head_dim(), c.ffn_hidden);
        if (!err.empty()) {
            fprintf(stderr, "Error: model '%s': %s\n", argv[1], err.c_str());
            return 1;
        }
    }

    int device_count = 0;
    if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
        fprintf(stderr, "Error: no CUDA GPU available; test_llama3cu needs one\n");
        return 1;
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    if (fp8 && prop.major * 10 + prop.minor < 89) {
        fprintf(stderr, "Error: -M fp8 needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper), but "
                "GPU 0 (%s) has compute capability %d.%d\n", prop.name, prop.major, prop.minor);
        return 1;
    }
    Llama3 model;
    cudaCheck(cudaStreamCreate(&model.stream));
    matmul_init(model.stream);
    model.recompute = recompute;
    model.fp8_mode = fp8;
    model.config = c;
    model.allocate_params();
    model.upload_fp32(initial_params);
    model.allocate_activations(ref.B, ref.T);
    if (model.classifier_chunk < N) {
        fprintf(stderr, "Error: B*T=%d rows exceed one classifier chunk (%d): use a smaller debug batch\n", N,
                model.classifier_chunk);
        return 1;
    }
    printf("[%s, layers' matmuls %s, recompute %d] model %s: V=%d C=%d L=%d H=%d KV=%d F=%d tied=%d "
           "rope_scaling=%d | B=%d T=%d steps=%d\n", PRECISION_NAME, matmul_precision, model.recompute, argv[1],
           c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.tied_embeddings,
           c.use_rope_scaling, ref.B, ref.T, ref.n_steps);
#if !defined(ENABLE_FP32)
    printf("bounds: %.0f x PyTorch's %s error on this case (from the debug state) + one bf16 rounding\n",
           BF16_MULTIPLE, fp8 ? "FP8 emulation (scripts/train_llama3.py --fp8)" : "bf16 autocast");
#endif

    float dloss = 1.0f / (float)counted;
    ParamLayout layout = param_layout(c);
    // zeros in the FP32 build when the file has none; with -M fp8 those of PyTorch's FP8 emulation
    const DebugState::Bf16Reference& torch_ref = ref.bf16;
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
            check_tensor(std::string("d") + layout.names[t] + suffix, grads.data() + offset, ref.grads.data() + offset,
                         layout.sizes[t], GRAD_MAX_REL, GRAD_REL_NORM, torch_error(torch_ref.grad_max_rel, k),
                         torch_error(torch_ref.grad_rel_norm, k));
            offset += layout.sizes[t];
            k++;
        }
    };

    // forward without gradients: the logits stay in the chunk buffer
    model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
    model.classifier(ref.B, ref.T, 0.0f);
    float loss = (float)(model.loss_sum(N) / counted);
    std::vector<float> logits = to_host_floats(model.acts.logits, (size_t)N * c.vocab_size);
    check_tensor("logits", logits.data(), ref.logits.data(), logits.size(), LOGITS_MAX_REL, LOGITS_REL_NORM,
                 torch_ref.logits_max_rel, torch_ref.logits_rel_norm);
    check_loss("loss", loss, ref.loss, LOSS_TOL, torch_ref.loss, loss_floor(ref.loss));

    if (accumulates) {
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
        check_loss("loss (accum)", (float)(accum_loss / counted), ref.loss, LOSS_TOL, torch_ref.loss,
                   loss_floor(ref.loss));
        check_grads(" (accum)");
    }

    // forward + backward: every parameter gradient
    model.zero_grad();
    model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
    model.classifier(ref.B, ref.T, dloss);
    model.backward(ref.B, ref.T);
    check_grads("");

    // the AdamW steps on the same batch (step 1 reuses the gradients above); PyTorch's error so far
    double torch_loss_error = 0.0, torch_norm_error = 0.0;
    for (int step = 1; step <= ref.n_steps; step++) {
        torch_loss_error = fmax(torch_loss_error, torch_error(torch_ref.step_losses, step - 1));
        torch_norm_error = fmax(torch_norm_error, torch_error(torch_ref.step_norms, step - 1));
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
        check_loss(name, step_loss, ref.step_losses[step - 1], step <= 5 ? LOSS_TOL : STEP_LOSS_TOL, torch_loss_error,
                   loss_floor(ref.step_losses[step - 1]));
        snprintf(name, sizeof(name), "step %d norm", step);
        check_norm(name, norm, ref.step_norms[step - 1], torch_norm_error);
    }
    matmul_destroy();
    printf("closest to its bound: %s, at %.2f of it\n", margins.closest.c_str(), margins.fraction);
#if !defined(ENABLE_FP32)
    printf("largest error / PyTorch's where the multiple sets the bound: %.2f (%s; the multiple is %.0f)\n",
           margins.ratio, margins.largest.c_str(), BF16_MULTIPLE);
#endif
    return checks.finish();
}
