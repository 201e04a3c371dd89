// Ties the CPU reference out against a debug state written by scripts/train_llama3.py:
// logits, loss, the gradient of every parameter tensor, and the loss and grad norm of each AdamW step.
//
//   dev/cpu/test_llama3_cpu model.bin debug.bin
//
// Tolerances (fp32 against fp32 PyTorch with TF32 off; both sides sum in different orders, so they agree to a few
// ulps per operation, amplified by the depth of the graph):
//   logits and each gradient tensor: max |got - ref| / max |ref| <= 1e-4 and ||got - ref|| / ||ref|| <= 1e-5
//   loss and each step's loss: |got - ref| <= 1e-5;  each step's grad norm: relative error <= 1e-4
// Prints every check; exits 1 if any fails.
#include <cstdio>

#include "../../llmc/debug_state.h"
#include "../../llmc/hf_model.h"
#include "llama3_cpu.h"

constexpr double MAX_REL_TOL = 1e-4, REL_NORM_TOL = 1e-5;
static TieOutChecks checks;

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s model.bin debug.bin\n", argv[0]);
        return 2;
    }
    Llama3Config config;
    std::vector<float> params = load_model_fp32(argv[1], &config);  // our .bin or a Hugging Face directory
    cpu::Model model(std::move(params), config);
    DebugState ref = load_debug_state(argv[2], model.config);
    const Llama3Config& c = model.config;
    printf("model %s: V=%d C=%d L=%d H=%d KV=%d F=%d tied=%d rope_scaling=%d | B=%d T=%d steps=%d\n", argv[1],
           c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.tied_embeddings,
           c.use_rope_scaling, ref.B, ref.T, ref.n_steps);

    float loss = model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
    checks.tensor("logits", model.logits.data(), ref.logits.data(), ref.logits.size(), MAX_REL_TOL, REL_NORM_TOL);
    checks.scalar("loss", loss, ref.loss, 1e-5, 0.0);
    model.zero_grad();
    model.backward();
    ParamLayout layout = param_layout(c);
    size_t offset = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (layout.sizes[t] == 0) continue;
        std::string name = std::string("d") + layout.names[t];
        checks.tensor(name.c_str(), model.grads.data() + offset, ref.grads.data() + offset, layout.sizes[t], MAX_REL_TOL, REL_NORM_TOL);
        offset += layout.sizes[t];
    }

    cpu::AdamW hp{ref.lr, ref.beta1, ref.beta2, ref.eps, ref.weight_decay, ref.grad_clip};
    for (int step = 0; step < ref.n_steps; step++) {
        float step_loss = step == 0 ? loss : model.forward(ref.inputs.data(), ref.targets.data(), ref.B, ref.T);
        if (step > 0) {
            model.zero_grad();
            model.backward();
        }
        float norm = model.update(hp);
        char name[32];
        snprintf(name, sizeof(name), "step %d loss", step + 1);
        checks.scalar(name, step_loss, ref.step_losses[step], 1e-5, 0.0);
        snprintf(name, sizeof(name), "step %d norm", step + 1);
        checks.scalar(name, norm, ref.step_norms[step], 0.0, 1e-4);
    }
    return checks.finish();
}
