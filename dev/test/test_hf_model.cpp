// Drives llmc/hf_model.h from the command line for dev/test/test_hf.py:
//
//   dev/test/test_hf_model load PATH [OUT.bin]           load a HF directory or our .bin; print the config and a
//                                                        checksum; optionally save it as our fp32 checkpoint
//   dev/test/test_hf_model export PATH OUT_DIR [fp32|bf16] [max_shard_bytes]
//                                                        load, then write a HF directory (save_hf_model)
// Exits non-zero with the loader's message on bad input.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../../llmc/hf_model.h"

int main(int argc, char** argv) {
    bool load = argc >= 3 && argc <= 4 && strcmp(argv[1], "load") == 0;
    bool save = argc >= 4 && argc <= 6 && strcmp(argv[1], "export") == 0;
    if (!load && !save) {
        fprintf(stderr, "usage: %s load PATH [OUT.bin] | export PATH OUT_DIR [fp32|bf16] [max_shard_bytes]\n", argv[0]);
        return 2;
    }
    Llama3Config c;
    std::vector<float> params = load_model_fp32(argv[2], &c);
    double sum = 0.0;
    for (float v : params) sum += v;
    printf("V=%d C=%d L=%d H=%d KV=%d F=%d max_seq_len=%d tied=%d rope_scaling=%d factor=%g low=%g high=%g "
           "original=%d eps=%g theta=%g | %zu params, sum %.9g\n",
           c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.max_seq_len, c.tied_embeddings,
           c.use_rope_scaling, c.rope_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor,
           c.rope_original_max_seq_len, c.norm_eps, c.rope_theta, params.size(), sum);
    if (load && argc == 4) save_checkpoint_fp32(argv[3], c, params.data(), DTYPE_FP32);
    if (save) {
        int dtype = DTYPE_BF16;
        if (argc >= 5) {
            if (strcmp(argv[4], "fp32") != 0 && strcmp(argv[4], "bf16") != 0) {
                fprintf(stderr, "Error: dtype '%s' is not fp32 or bf16\n", argv[4]);
                return 2;
            }
            dtype = strcmp(argv[4], "fp32") == 0 ? DTYPE_FP32 : DTYPE_BF16;
        }
        int64_t max_shard = argc == 6 ? atoll(argv[5]) : HF_MAX_SHARD_BYTES;
        if (max_shard < 1) {
            fprintf(stderr, "Error: max_shard_bytes '%s' is not a positive integer\n", argv[5]);
            return 2;
        }
        save_hf_model(argv[3], c, params.data(), dtype, max_shard);
    }
    return 0;
}
